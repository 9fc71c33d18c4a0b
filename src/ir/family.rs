//! Op families: the ops of [`Op`] grouped by the kernels a backend needs for them, so a
//! backend implements one function per family (the CPU's: `backend::cpu::ops`, one file each)
//! rather than one match over every op. A family holds an op with its backward, and ops that
//! share a family's kernels or operands (a linear layer's separate bias, attention's rotary
//! embedding). [`Op::family`] names an op's; its match lists every op, so a new op is given a
//! family where it is declared.

use super::schedule::Op;

/// What kind of work an op is, for a backend: which kernels run it, or which of the device's
/// own workers (transfers, collectives).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpFamily {
    /// A buffer set to zeros ([`Op::Zero`]: a gradient buffer before its first write, the
    /// residual gradient before the backward).
    Fill,
    /// The token (and learned position) embedding: [`Op::Encoder`], [`Op::EncoderBackward`].
    Embedding,
    /// Normalisations: [`Op::LayerNorm`], [`Op::RmsNorm`], [`Op::QkNorm`] and their backwards.
    Norm,
    /// Linear layers: [`Op::Matmul`], [`Op::MatmulBackward`], and [`Op::AddBias`] (a frozen
    /// layer's bias stored apart from its quantized weight).
    Linear,
    /// Causal attention: [`Op::Attention`], [`Op::AttentionBackward`], and [`Op::Rope`] (the
    /// rotary position embedding of its queries and keys, and its inverse in the backward).
    Attention,
    /// Pointwise activations: [`Op::Gelu`], [`Op::Glu`] and their backwards.
    Activation,
    /// The LM head: [`Op::LmHeadLoss`] (logits, cross-entropy and, in training, their
    /// gradients; under tensor parallelism after [`Op::LmHeadStats`]), [`Op::LmHeadWeightGrad`]
    /// (the weight gradient of a slice of the vocabulary, after the backward) and
    /// [`Op::LmHeadLast`] (generation's next-token logits).
    LmHead,
    /// LoRA adapters on frozen linear layers: [`Op::LoraForward`], [`Op::LoraBackward`].
    Adapter,
    /// The update: [`Op::GradNorm`] (a group's share of the gradient norm), [`Op::AdamW`] and
    /// [`Op::AdamWBlockMax`] (8-bit block scales of tensor-parallel parts).
    Optimizer,
    /// Copies between tiers, run beside the ops: [`Op::Transfer`], [`Op::AwaitTransfers`].
    Transfer,
    /// Exchanges among ranks, run beside the ops: [`Op::AllReduce`], [`Op::ReduceScatter`],
    /// [`Op::AllGather`], [`Op::StageSend`], [`Op::StageRecv`], [`Op::AwaitCollective`].
    Collective,
}

impl Op {
    /// The op's family.
    pub fn family(&self) -> OpFamily {
        match self {
            Op::Zero { .. } => OpFamily::Fill,
            Op::Encoder { .. } | Op::EncoderBackward { .. } => OpFamily::Embedding,
            Op::LayerNorm { .. }
            | Op::LayerNormBackward { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormBackward { .. }
            | Op::QkNorm { .. }
            | Op::QkNormBackward { .. } => OpFamily::Norm,
            Op::Matmul { .. } | Op::MatmulBackward { .. } | Op::AddBias { .. } => OpFamily::Linear,
            Op::Attention { .. } | Op::AttentionBackward { .. } | Op::Rope { .. } => {
                OpFamily::Attention
            }
            Op::Gelu { .. } | Op::GeluBackward { .. } | Op::Glu { .. } | Op::GluBackward { .. } => {
                OpFamily::Activation
            }
            Op::LmHeadLoss { .. }
            | Op::LmHeadStats { .. }
            | Op::LmHeadLast { .. }
            | Op::LmHeadWeightGrad { .. } => OpFamily::LmHead,
            Op::LoraForward { .. } | Op::LoraBackward { .. } => OpFamily::Adapter,
            Op::GradNorm { .. } | Op::AdamW { .. } | Op::AdamWBlockMax { .. } => {
                OpFamily::Optimizer
            }
            Op::Transfer { .. } | Op::AwaitTransfers { .. } => OpFamily::Transfer,
            Op::AllReduce { .. }
            | Op::ReduceScatter { .. }
            | Op::AllGather { .. }
            | Op::StageSend { .. }
            | Op::StageRecv { .. }
            | Op::AwaitCollective { .. } => OpFamily::Collective,
        }
    }
}
