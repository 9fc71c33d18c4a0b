//! Buffers of a plan: what each byte is for (category), its element type, size, and the
//! interval of the schedule over which it must hold its value.

use serde::{Deserialize, Serialize};

/// Index of a buffer in `Plan::buffers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct BufId(pub usize);

/// What a buffer is for. Every byte of a step has one (invariant 4 of ARCHITECTURE.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Model weights used in compute.
    Param,
    /// Parameter gradients.
    Grad,
    /// fp32 master weights that the optimizer updates (mixed precision; unused in fp32 plans).
    Master,
    /// Optimizer state (AdamW first and second moments).
    OptimizerState,
    /// Forward outputs kept for the backward pass.
    Activation,
    /// Gradients with respect to activations (backward scratch).
    ActivationGrad,
    /// Kernel scratch (attention tiles, LM-head logits chunk).
    Workspace,
    /// Input/output staging (token batches).
    IoStaging,
    /// Collective-communication buffers (multi-process; unused in single-process plans).
    Communication,
}

impl Category {
    pub const ALL: [Category; 9] = [
        Category::Param,
        Category::Grad,
        Category::Master,
        Category::OptimizerState,
        Category::Activation,
        Category::ActivationGrad,
        Category::Workspace,
        Category::IoStaging,
        Category::Communication,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::Param => "param",
            Category::Grad => "grad",
            Category::Master => "master",
            Category::OptimizerState => "optimizer_state",
            Category::Activation => "activation",
            Category::ActivationGrad => "activation_grad",
            Category::Workspace => "workspace",
            Category::IoStaging => "io_staging",
            Category::Communication => "communication",
        }
    }
}

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    U32,
    Bf16,
    F16,
    I8,
    U8,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::I8 | DType::U8 => 1,
        }
    }
}

/// One buffer of the plan.
#[derive(Clone, Debug, Serialize)]
pub struct Buffer {
    /// Descriptive name with its layer, e.g. `h3.qkv` or `grads`.
    pub name: String,
    pub category: Category,
    pub dtype: DType,
    /// Number of elements.
    pub elems: usize,
    /// Size in bytes (elems × dtype size).
    pub bytes: u64,
    /// Persistent buffers live across steps (parameters, gradients, optimizer state, batches).
    pub persistent: bool,
    /// First and last op index (inclusive) that touch the buffer; whole schedule if persistent.
    pub first_op: usize,
    pub last_op: usize,
    /// Byte offset in the arena, assigned by packing.
    pub offset: u64,
    /// Allocated outside the arena, once, by its owner (the loader's staging buffers, the
    /// `gemm` crate's packing scratch); counted in the plan's total but not packed.
    pub external: bool,
}

impl Buffer {
    pub fn live_at(&self, op: usize) -> bool {
        self.first_op <= op && op <= self.last_op
    }

    /// Whether the live intervals of two buffers intersect.
    pub fn lives_with(&self, o: &Buffer) -> bool {
        !self.external && !o.external && self.first_op <= o.last_op && o.first_op <= self.last_op
    }

    /// Whether the byte ranges of two buffers intersect.
    pub fn overlaps_in_memory(&self, o: &Buffer) -> bool {
        self.offset < o.offset + o.bytes && o.offset < self.offset + self.bytes
    }
}
