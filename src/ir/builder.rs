//! The builder a plan is emitted into: buffers declared by name, category, dtype and size
//! (their lifetimes come later, from the ops that touch them), and ops appended in schedule
//! order. The planner ([`crate::plan::build`]) emits the persistent state, the micro-batch loop and
//! the optimizer phase; a model family emits each micro-batch's layers ([`MicroBatch`]).

use super::buffer::{BufId, Buffer, Category, Placement, Tier};
use super::schedule::{Op, OpEntry, OptimBufs, Phase, Rows};
use super::strategy::OptimState;
use crate::dtype::DType;

/// What a model family's emission reads of the step's configuration: the planner makes it
/// from its `StepConfig` (`crate::plan::StepConfig::emit_options`).
#[derive(Clone, Copy, Debug)]
pub struct EmitOptions {
    /// Activation recomputation policy.
    pub recompute: super::strategy::Recompute,
    /// Upper bound for the LM head's logits chunk (bytes).
    pub logits_chunk_bytes: u64,
    /// This rank's share of every layer (tensor parallelism; [`super::TensorSplit::WHOLE`] on one
    /// rank): the family emits its part of each layer and the all-reduces that join the parts.
    pub tensor: super::TensorSplit,
    /// This rank's stage of the layers (pipeline parallelism; [`super::PipelineStage::WHOLE`]
    /// on one rank): the family emits its layers, and where the stage does not hold the
    /// embedding or the head, receives its input from the stage before and sends its output
    /// to the stage after ([`super::Op::StageSend`], [`super::Op::StageRecv`]); the gradients
    /// travel back the same way.
    pub stage: super::PipelineStage,
    /// The token embedding is frozen (a LoRA plan: `plan::lora`): its backward, and what
    /// only it reads, is not emitted.
    pub frozen_embedding: bool,
}

/// One micro-batch as the planner hands it to the model family: its buffers and shape.
pub struct MicroBatch {
    /// Name prefix of its ops and buffers: empty, or `mb1.` under gradient accumulation.
    pub prefix: String,
    /// Input token ids `[B, T]` (u32).
    pub tokens: BufId,
    /// Packed rows: each row's place in its example `[B, T]` (u32), for the position
    /// embeddings and attention ([`crate::plan::StepConfig::packed`]).
    pub positions: Option<BufId>,
    /// Training plans: what the loss needs; `None` for generation (next-token logits).
    pub loss: Option<Loss>,
    pub rows: Rows,
    /// f32 elements of one attention op's workspace (the backend's answer).
    pub attn_ws_len: usize,
}

/// The loss of a training micro-batch.
pub struct Loss {
    /// Target token ids `[B, T]` (u32).
    pub targets: BufId,
    /// `Per-row losses [N]` (f32).
    pub losses: BufId,
    /// Distillation: what the head reads of the teacher.
    pub teacher: Option<Teacher>,
}

/// A micro-batch's teacher (distillation): its final-norm output `hidden` `[N, Ct]` and its
/// LM head `head` `[V, Ct]` (both f32), its width Ct and the KL's weight `alpha`.
#[derive(Clone, Copy, Debug)]
pub struct Teacher {
    pub hidden: BufId,
    pub head: BufId,
    pub c: usize,
    pub alpha: f32,
}

/// What a family's emission of a micro-batch leaves for the planner.
pub struct Emitted {
    /// `Next-token logits [V]` (generation plans).
    pub logits: Option<BufId>,
}

/// Buffers and ops of a plan being built.
pub struct Builder {
    pub(crate) buffers: Vec<Buffer>,
    pub(crate) ops: Vec<OpEntry>,
    /// Element type of activations, compute weights and gradients.
    storage: DType,
    /// The tier ops compute on (the backend's first): where every buffer is declared.
    compute: Tier,
    /// The micro-batch the ops emitted now belong to ([`OpEntry::micro`]).
    pub(crate) micro: usize,
}

impl Builder {
    /// Persistent moment buffers `{name}.m`, `{name}.v` (int8: `.m.q`, `.v.q`, `.m.absmax`,
    /// `.v.absmax`) for parameter elements `range` and 8-bit blocks `blocks`.
    pub(crate) fn moments(
        &mut self,
        name: &str,
        format: OptimState,
        range: std::ops::Range<usize>,
        blocks: std::ops::Range<usize>,
    ) -> OptimBufs {
        let mut st = |what: &str, dtype, elems| {
            let name = format!("{name}.{what}");
            self.persistent(&name, Category::OptimizerState, dtype, elems)
        };
        let p = range.len();
        let (m, v, m_scale, v_scale) = match format {
            OptimState::F32 => (st("m", DType::F32, p), st("v", DType::F32, p), None, None),
            OptimState::Bf16 => (st("m", DType::Bf16, p), st("v", DType::Bf16, p), None, None),
            OptimState::Int8 => (
                st("m.q", DType::I8, p),
                st("v.q", DType::U8, p),
                Some(st("m.absmax", DType::F32, blocks.len())),
                Some(st("v.absmax", DType::F32, blocks.len())),
            ),
        };
        OptimBufs {
            format,
            m,
            v,
            m_scale,
            v_scale,
            base: range.start,
            block_base: blocks.start,
        }
    }

    /// A plan whose activations are stored as `storage`, computed on tier `compute`.
    pub(crate) fn new(storage: DType, compute: Tier) -> Builder {
        Builder {
            buffers: Vec::new(),
            ops: Vec::new(),
            storage,
            compute,
            micro: 0,
        }
    }

    /// A (non-persistent) buffer in the plan's storage type (activations and their grads).
    pub(crate) fn act(
        &mut self,
        name: impl Into<String>,
        category: Category,
        elems: usize,
    ) -> BufId {
        let dt = self.storage;
        self.buf(name, category, dt, elems)
    }

    /// A (non-persistent) buffer of any element type.
    pub(crate) fn buf(
        &mut self,
        name: impl Into<String>,
        category: Category,
        dtype: DType,
        elems: usize,
    ) -> BufId {
        self.push(name.into(), category, dtype, elems, false)
    }

    /// A (non-persistent) f32 buffer.
    pub(crate) fn f32(
        &mut self,
        name: impl Into<String>,
        category: Category,
        elems: usize,
    ) -> BufId {
        self.buf(name, category, DType::F32, elems)
    }

    pub(crate) fn persistent(
        &mut self,
        name: &str,
        category: Category,
        dtype: DType,
        elems: usize,
    ) -> BufId {
        self.push(name.into(), category, dtype, elems, true)
    }

    /// Declares a buffer of `elems` elements of `dtype`, [`DType::bytes_for`] bytes: of ggml
    /// blocks, `elems` values that are whole blocks (the planner refuses other shapes before
    /// it declares one; an internal error otherwise).
    fn push(
        &mut self,
        name: String,
        category: Category,
        dtype: DType,
        elems: usize,
        persistent: bool,
    ) -> BufId {
        self.buffers.push(Buffer {
            name,
            category,
            dtype,
            elems,
            bytes: dtype.bytes_for(elems as u64).unwrap_or_else(|| {
                panic!(
                    "internal error: {elems} elements of {dtype} overflow or are not whole blocks"
                )
            }),
            persistent,
            first_op: usize::MAX,
            last_op: 0,
            placement: Placement {
                tier: self.compute,
                offset: 0,
            },
            align: super::buffer::ALIGN,
        });
        BufId(self.buffers.len() - 1)
    }

    /// Makes `id` one end of transfers between tiers: moved to tier `home` when given (an
    /// offloaded buffer's home), and aligned for direct I/O ([`crate::ir::buffer::IO_ALIGN`])
    /// on either tier.
    pub(crate) fn for_io(&mut self, id: BufId, home: Option<Tier>) -> BufId {
        let b = &mut self.buffers[id.0];
        b.align = super::buffer::IO_ALIGN;
        if let Some(tier) = home {
            b.placement = Placement { tier, offset: 0 };
        }
        id
    }

    pub(crate) fn op(&mut self, name: impl Into<String>, phase: Phase, flops: u64, op: Op) {
        self.ops.push(OpEntry {
            name: name.into(),
            phase,
            op,
            flops,
            params: None,
            grads: None,
            micro: self.micro,
            frozen: false,
        });
    }
}
