//! Buffers of a plan: what each byte is for (category), its element type, size, and the
//! interval of the schedule over which it must hold its value.

use crate::dtype::DType;
use serde::{Deserialize, Serialize};

/// Every offset is a multiple of this (one cache line; enough for AVX-512 loads).
pub const ALIGN: u64 = 64;

/// Offsets and sizes of the buffers a disk transfer moves (both ends): direct I/O needs the
/// file offset, the length and the memory address aligned to the device's block (4 KiB covers
/// the logical block sizes of NVMe and SATA disks and the page size).
pub const IO_ALIGN: u64 = 4096;

/// Index of a buffer in `Plan::buffers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct BufId(pub usize);

/// What a buffer is for. Every byte of a step has one (ARCHITECTURE.md's rules).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Model weights used in compute.
    Param,
    /// Parameter gradients.
    Grad,
    /// fp32 master weights that the optimizer updates (mixed precision; unused in fp32 plans).
    Master,
    /// LoRA adapters' weights (fp32, trained; the frozen base they adapt is `Param`).
    Adapter,
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
    /// A distillation teacher's own plan (its weights and one sequence's activations), held
    /// beside the student's by its executor (`train --distill-from`).
    Teacher,
}

impl Category {
    pub const ALL: [Category; 11] = [
        Category::Param,
        Category::Grad,
        Category::Master,
        Category::Adapter,
        Category::OptimizerState,
        Category::Activation,
        Category::ActivationGrad,
        Category::Workspace,
        Category::IoStaging,
        Category::Communication,
        Category::Teacher,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::Param => "param",
            Category::Grad => "grad",
            Category::Master => "master",
            Category::Adapter => "adapter",
            Category::OptimizerState => "optimizer_state",
            Category::Activation => "activation",
            Category::ActivationGrad => "activation_grad",
            Category::Workspace => "workspace",
            Category::IoStaging => "io_staging",
            Category::Communication => "communication",
            Category::Teacher => "teacher",
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
    /// Number of elements (of ggml blocks: values, whole blocks).
    pub elems: usize,
    /// Size in bytes ([`DType::bytes_for`] `elems`).
    pub bytes: u64,
    /// Persistent buffers live across steps (parameters, gradients, optimizer state, batches).
    pub persistent: bool,
    /// First and last op index (inclusive) that touch the buffer; whole schedule if persistent.
    pub first_op: usize,
    pub last_op: usize,
    /// Where its bytes live: a memory tier and the offset packing gave it there.
    #[serde(flatten)]
    pub placement: Placement,
    /// Its offset is a multiple of this, and it owns the bytes up to the next multiple of it
    /// after its end ([`crate::ir::buffer::ALIGN`]; [`crate::ir::buffer::IO_ALIGN`] for the two ends
    /// of a disk transfer, which direct I/O reads and writes whole).
    #[serde(skip)]
    pub align: u64,
}

/// A memory tier. Each tier the plan packs is one allocation made by the backend; a backend
/// declares the tiers it plans, fastest first, the first being where its ops compute
/// ([`super::Sizing::tiers`]: the CPU's are [`Tier::Host`] then [`Tier::Nvme`]; a GPU's would
/// be [`Tier::Device`], [`Tier::Host`] (pinned) and [`Tier::Nvme`]). Transfer ops move
/// buffers between adjacent tiers. [`Tier::Owned`] buffers are allocated once by their owners
/// and only counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// An accelerator's own memory (a GPU backend's compute tier).
    Device,
    /// The plan's arena in host RAM.
    Host,
    /// Allocated outside the arena, once, by its owner (the loader's staging buffers, a
    /// kernel library's own scratch): counted in the plan's total, never packed.
    Owned,
    /// The offload file on disk (`--offload`): packed like the host arena, read into and
    /// written from host staging buffers by transfer ops.
    Nvme,
}

impl Tier {
    /// The tier's name in reports (`RAM`, `disk`, ...).
    pub fn describe(self) -> &'static str {
        match self {
            Tier::Device => "device memory",
            Tier::Host => "RAM",
            Tier::Owned => "RAM (owned)",
            Tier::Nvme => "disk",
        }
    }

    /// Whether a buffer on this tier is held in the memory of compute tier `compute`: on it,
    /// or owned (its owner's host allocation) when the compute tier is host RAM.
    pub fn held_in(self, compute: Tier) -> bool {
        self == compute || (self == Tier::Owned && compute == Tier::Host)
    }
}

/// One tier a plan packs and its size: the bytes of the one allocation the backend makes
/// for it (an arena in memory, a file on disk).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierSize {
    pub tier: Tier,
    pub bytes: u64,
}

/// Where a buffer's bytes are: its tier and its byte offset in that tier's arena (0 for
/// [`Tier::Owned`]). Serialised as `tier`, `offset` and `external` (true for owned buffers;
/// kept for readers of older `plan.json` files).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub tier: Tier,
    pub offset: u64,
}

impl Placement {
    /// A buffer in the host arena, offset not yet packed.
    pub const HOST: Placement = Placement {
        tier: Tier::Host,
        offset: 0,
    };
    /// A buffer its owner allocates.
    pub const OWNED: Placement = Placement {
        tier: Tier::Owned,
        offset: 0,
    };
    /// A buffer in the offload file, offset not yet packed.
    pub const NVME: Placement = Placement {
        tier: Tier::Nvme,
        offset: 0,
    };
}

impl Serialize for Placement {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Placement", 3)?;
        st.serialize_field("offset", &self.offset)?;
        st.serialize_field("external", &(self.tier == Tier::Owned))?;
        st.serialize_field("tier", &self.tier)?;
        st.end()
    }
}

impl Buffer {
    pub fn live_at(&self, op: usize) -> bool {
        self.first_op <= op && op <= self.last_op
    }

    /// Allocated by its owner outside the plan's arenas (counted, not packed).
    pub fn is_owned(&self) -> bool {
        self.placement.tier == Tier::Owned
    }

    /// Whether the two buffers compete for the same bytes: packed in the same tier with
    /// intersecting live intervals.
    pub fn lives_with(&self, o: &Buffer) -> bool {
        self.placement.tier == o.placement.tier
            && !self.is_owned()
            && self.first_op <= o.last_op
            && o.first_op <= self.last_op
    }

    /// Whether the byte ranges of two buffers of the same tier intersect (each with its
    /// padding to its alignment).
    pub fn overlaps_in_memory(&self, o: &Buffer) -> bool {
        let (a, b) = (self.placement.offset, o.placement.offset);
        self.placement.tier == o.placement.tier
            && a < b + o.padded_bytes()
            && b < a + self.padded_bytes()
    }

    /// Its bytes rounded up to its alignment: what packing reserves and a transfer moves.
    pub fn padded_bytes(&self) -> u64 {
        self.bytes.div_ceil(self.align) * self.align
    }
}
