//! The schedule: the ordered ops of one step. Each op names the buffers it reads and writes
//! (how it uses each is described once, in [`crate::plan::operands`]) and carries every dimension
//! and parameter range its kernel needs, so buffer lifetimes follow from the schedule alone
//! and a backend runs an op knowing nothing of the model, its parameter layout or the
//! strategy that produced it.

use super::buffer::{BufId, Buffer, Tier};
use super::mesh::{Axis, Peer};
use super::part::TensorPart;
use super::shard::CutOf;
use super::strategy::{OptimState, QBLOCK};
use serde::Serialize;
use std::ops::Range;

/// A target id that is not trained ([`Op::LmHeadLoss`]'s `targets`): a chat example's prompt
/// tokens and a row's padding. No vocabulary reaches it (ids are below 2³¹).
pub const IGNORE_TARGET: u32 = u32::MAX;

/// The gate's activation of a gated linear unit ([`Op::Glu`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum GluAct {
    /// `silu(g) = g·σ(g)` (SwiGLU: Llama's `hidden_act = "silu"`).
    Silu,
    /// GELU's tanh approximation (GeGLU: Gemma's `hidden_activation = "gelu_pytorch_tanh"`).
    GeluTanh,
}

/// Numbers per row [`Op::LmHeadLoss`] keeps in its `row_stats` for [`Op::LmHeadWeightGrad`]:
/// the row's softmax maximum and `scale / Σ exp(logit − max)`.
pub const HEAD_ROW_STATS: usize = 2;

/// A tensor-parallel LM head's share of the vocabulary ([`Op::LmHeadLoss`]'s `vocab`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabShare {
    /// The token id of the rank's first row of the head.
    pub first_token: usize,
    /// Every tensor rank's [`Op::LmHeadStats`] of the rows, gathered: `[ranks, N, 3]`.
    pub stats: BufId,
    /// Ranks on the tensor axis.
    pub ranks: usize,
    /// Whether the logits of the rows are still in `logits` from [`Op::LmHeadStats`] (one
    /// chunk), so they are not computed again.
    pub logits_kept: bool,
}

/// Distillation's teacher at an LM head ([`Op::LmHeadLoss`]'s `teacher`): the teacher's
/// final-norm output for the head's rows, its head, and a chunk of its logits; the loss is
/// `alpha` · KL(teacher ‖ student) + (1 − `alpha`) · cross-entropy in training steps (the
/// cross-entropy alone in evaluation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TeacherLogits {
    /// `[N, Ct]` f32: the teacher's final-norm output for the rows (uploaded each step).
    pub hidden: BufId,
    /// `[V, Ct]` f32: the teacher's LM head (frozen; filled once).
    pub w: BufId,
    /// `[rows_per_chunk, V]` f32: a chunk of the teacher's logits.
    pub logits: BufId,
    /// Ct: the teacher's width.
    pub c: usize,
    pub alpha: f32,
}

/// Which part of the step an op belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Forward,
    /// Forward ops re-run during the backward to rebuild activations that were not kept.
    Recompute,
    Backward,
    /// The update after the backward: `AdamW` over each parameter group. In plans with a
    /// deferred update ([`Schedule::deferred_update`]) these ops run only to finish an update
    /// outside a step (before a checkpoint, an evaluation or a read of the weights); with
    /// `--update in-backward` each sits inside the backward, just after the last op that
    /// touches its group (`plan::update`).
    Optimizer,
    /// The previous step's `AdamW` of one parameter group, run in this step's forward just
    /// before the group's first use (plans with [`Schedule::deferred_update`]): the update's
    /// disk transfers then overlap the forward's arithmetic instead of stalling after the
    /// backward. The same ops as the `Optimizer` phase's, on the same values: weights are
    /// bitwise those of an update at the end of the step.
    DeferredUpdate,
}

/// How a linear layer's weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum WeightLayout {
    /// `[IC, OC]` row-major: Hugging Face's Conv1D (GPT-2).
    InOut,
    /// `[OC, IC]` row-major: `torch.nn.Linear` (Llama and most models).
    OutIn,
}

/// The token rows an op works on: B sequences of T positions, N = B·T rows. This is the
/// plan's (largest) shape; generation runs a plan on a shorter prefix ([`Rows::with_seq`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Rows {
    pub b: usize,
    pub t: usize,
}

impl Rows {
    /// N = B·T.
    pub fn n(self) -> usize {
        self.b * self.t
    }

    /// Forward FLOPs of causal attention over these rows, `nh` query heads of size `hd`: 4·hd
    /// a (query, key) pair attended per head (the score and the weighted value, a
    /// multiply-add each). Without a sliding window, or with one of T keys or more, T²/2 pairs
    /// a head (the triangle); with a window W < T, query i attends min(W, i + 1) keys:
    /// W(W+1)/2 + (T − W)·W pairs.
    pub fn attention_flops(self, nh: usize, hd: usize, window: Option<usize>) -> u64 {
        let t = self.t as u64;
        let twice_pairs = match window.map(|w| w as u64) {
            Some(w) if w < t => w * (w + 1) + 2 * (t - w) * w,
            _ => t * t,
        };
        2 * (self.b * nh * hd) as u64 * twice_pairs
    }

    /// The rows of the residual stream a tensor rank holds of these (`split`): all of them,
    /// or under sequence parallelism its `rank`-th run of N/size consecutive rows (N a
    /// multiple of the size: the plan's check), as one sequence of that many rows (the ops
    /// on them work row by row).
    pub fn own(self, split: super::mesh::TensorSplit) -> Rows {
        match split.cuts_rows() {
            true => Rows {
                b: 1,
                t: self.n() / split.size,
            },
            false => self,
        }
    }

    /// The same sequences cut to their first `t` positions, when `t` is given.
    pub fn with_seq(self, t: Option<usize>) -> Rows {
        Rows {
            b: self.b,
            t: t.unwrap_or(self.t),
        }
    }
}

/// One parameter tensor an optimizer op updates: its element range (the same range of the
/// parameters, the gradients and the moments), whether weight decay applies, and the index of
/// its first block of 8-bit optimizer state (see [`super::strategy::QBLOCK`]): the block of
/// its first element.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSlice {
    pub range: Range<usize>,
    pub decay: bool,
    pub state_block: usize,
    /// Of a tensor-parallel part: the part, and where the slice starts in it (its 8-bit
    /// blocks are the whole tensor's, [`TensorPart::block_pieces`]); `None` for a slice of
    /// a tensor held whole, whose blocks are its runs of [`QBLOCK`] values from its start.
    pub part: Option<(TensorPart, usize)>,
}

impl ParamSlice {
    /// The slice's elements by 8-bit block: (the block's index in the state's numbering,
    /// the slice's elements in it, counted from its first), in order.
    pub fn block_pieces(&self) -> Box<dyn Iterator<Item = (usize, Range<usize>)> + Send + '_> {
        let n = self.range.len();
        match &self.part {
            None => Box::new(
                (0..n.div_ceil(QBLOCK))
                    .map(move |k| (self.state_block + k, k * QBLOCK..((k + 1) * QBLOCK).min(n))),
            ),
            Some((part, at)) => {
                let first = part
                    .runs_in(*at..at + 1)
                    .next()
                    .map_or(0, |(w, _)| w / QBLOCK);
                Box::new(
                    part.block_pieces(*at..at + n, QBLOCK).map(move |(b, r)| {
                        (self.state_block + b - first, r.start - at..r.end - at)
                    }),
                )
            }
        }
    }
}

/// The 8-bit block scales the ranks agree on before the update of a group holding
/// tensor-parallel parts (`plan::block_scales`): `buf`, f32 `[2, blocks.len()]`, holds the
/// new scales of m then of v of blocks `blocks` (state numbering: the group's), each the
/// maximum over the ranks of what each computed of its elements ([`Op::AdamWBlockMax`],
/// then an [`Op::AllReduce`] with [`Reduce::Max`] on the tensor axis, and on the data axis
/// where the moments are sharded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockScales {
    pub buf: BufId,
    pub blocks: Range<usize>,
}

/// What an [`Op::AllReduce`] computes of the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// Their sum, in the ring's fixed order.
    Sum,
    /// Their maximum (NaN if any is NaN): 8-bit block scales ([`BlockScales`]).
    Max,
}

/// One op. Parameter tensors are element ranges of the flat parameter vector; the matching
/// gradient is the same range of the gradients. Which buffers hold them is the op entry's
/// [`Binding`]s ([`OpEntry::params`], [`OpEntry::grads`]). Shapes: N = B·T rows (`rows`),
/// C channels.
#[derive(Clone, Debug)]
pub enum Op {
    /// Zero a buffer (a parameter group's gradients before their first write, the residual
    /// gradient before backward).
    Zero { buf: BufId },
    /// `out[N,C] = wte[tokens] (+ wpe[t] with learned positions)`; `t` is the row's place in
    /// its sequence, or its place in its example when the rows pack examples (`positions`).
    /// Under tensor parallelism `wte` holds the rows of the token ids `first_token..` (the
    /// rank's part of the vocabulary): a token outside them gives a zero row (then `wpe`'s
    /// alone), and the ranks' outputs are summed. The token rows are multiplied by `scale`
    /// (Gemma's √C, `Gemma3TextScaledWordEmbedding`; 1 elsewhere) before the positions are
    /// added.
    Encoder {
        tokens: BufId,
        positions: Option<BufId>, // [B, T] u32, packed rows only
        out: BufId,
        wte: Range<usize>,         // [Vpart, C]
        wpe: Option<Range<usize>>, // [maxT, C]
        first_token: usize,
        rows: Rows,
        c: usize,
        scale: f32,
    },
    /// `out[N,C], mean[N], rstd[N] = layernorm(inp[N,C]; w, b)`.
    LayerNorm {
        inp: BufId,
        out: BufId,
        mean: BufId,
        rstd: BufId,
        w: Range<usize>, // [C]
        b: Range<usize>, // [C]
        rows: Rows,
        c: usize,
        eps: f32,
    },
    /// `out[N,OC] = (residual[N,OC] if any) + inp[N,IC] @ W + b[OC]`, W `[IC,OC]` or the
    /// transpose of `w[OC,IC]` (see [`WeightLayout`]).
    Matmul {
        inp: BufId,
        out: BufId,
        residual: Option<BufId>,
        w: Range<usize>,         // [IC, OC] or [OC, IC]
        b: Option<Range<usize>>, // [OC]
        layout: WeightLayout,
        rows: Rows,
        ic: usize,
        oc: usize,
    },
    /// `out[N,NH·hd], lse[B,NH,T] = causal_attention(qkv[N,(NH+2·NKV)·hd])`: NH query heads,
    /// then NKV key heads, then NKV value heads; KV head j serves query heads j·g…j·g+g−1
    /// (g = NH/NKV). With `positions` (rows that pack examples) a query attends only the
    /// keys of its own example: `i − positions[i] ≤ j ≤ i`. With a sliding `window` (Mistral's
    /// `sliding_window`) a query sees only the last `window` keys, itself included: `i − j <
    /// window` as well (transformers' `sliding_window_overlay`); the kernels compute only
    /// inside it, so the work is O(T·window), not O(T²).
    Attention {
        qkv: BufId,
        positions: Option<BufId>, // [B, T] u32, packed rows only
        out: BufId,
        lse: BufId,
        ws: BufId,
        rows: Rows,
        nh: usize,
        nkv: usize,
        hd: usize,
        window: Option<usize>,
        /// Scores are q·k / √scale_dim: the head size `hd`, or Gemma 3's
        /// `query_pre_attn_scalar`.
        scale_dim: f32,
    },
    /// `out[N,C] = (residual[N,C] if any) + rmsnorm(inp[N,C]; w)`, `rstd[N]` its 1/rms. The
    /// gain is `offset + w` (Gemma's `(1 + w)`, `Gemma3RMSNorm`; offset 0 elsewhere). The
    /// residual is Gemma's post-norms' (`residual + post_attention_layernorm(o)`).
    RmsNorm {
        inp: BufId,
        out: BufId,
        residual: Option<BufId>,
        rstd: BufId,
        w: Range<usize>, // [C]
        offset: f32,
        rows: Rows,
        c: usize,
        eps: f32,
    },
    /// Qwen3's per-head RMSNorm of a fused q|k|v row: `out[N,QKV], rstd[N,NH+NKV] =
    /// qk_norm(inp[N,QKV]; w)`, QKV = (NH + 2·NKV)·hd. Each of the NH query heads and NKV key
    /// heads (hd channels) is normalised as [`Op::RmsNorm`] normalises a row, with its own
    /// statistics: query heads scaled by `offset + w[..hd]` (`q_norm`), key heads by `offset +
    /// w[hd..]` (`k_norm`); the NKV value heads are copied.
    QkNorm {
        inp: BufId,
        out: BufId,
        rstd: BufId,
        w: Range<usize>, // [2, hd]: q_norm, k_norm
        offset: f32,
        rows: Rows,
        nh: usize,
        nkv: usize,
        hd: usize,
        eps: f32,
    },
    /// `out[n, :] += b` for every row `n` (`b` `[OC]`): a frozen linear layer's bias where its
    /// weight is stored apart from it (a quantized LoRA base: the weight in blocks, the bias in
    /// f32; `plan::lora::split_biases`).
    AddBias {
        out: BufId,
        b: Range<usize>,
        rows: Rows,
        oc: usize,
    },
    /// Rotary embedding of `x[N,width]` in place: the first `rotated` channels, head by head
    /// (hd channels, element i paired with i + hd/2), position t turned by `t · inv_freq[i]`
    /// (`t` the row's place in its example when the rows pack examples: `positions`).
    Rope {
        x: BufId,
        positions: Option<BufId>, // [B, T] u32, packed rows only
        rows: Rows,
        width: usize,
        rotated: usize,
        hd: usize,
        inv_freq: Vec<f32>, // [hd/2]
        /// Cosines and sines are multiplied by this (LongRoPE's attention factor; 1
        /// otherwise): the rotated channels come out scaled, in either direction.
        scale: f32,
        /// The inverse rotation (angle −θ): the backward, turning the gradient of the
        /// rotated values into that of the un-rotated ones.
        inverse: bool,
    },
    /// A gated linear unit: `out[N,H] = act(inp[.., 0..H]) · inp[.., H..2H]` (inp `[N, 2H]`:
    /// gate | up), `act` SiLU (SwiGLU, Llama) or the tanh GELU (GeGLU, Gemma).
    Glu {
        inp: BufId,
        out: BufId,
        rows: Rows,
        h: usize,
        act: GluAct,
    },
    /// `out = gelu(inp)`, both `[N, width]`.
    Gelu {
        inp: BufId,
        out: BufId,
        rows: Rows,
        width: usize,
    },
    /// LM head `w[V,C]` and loss, chunked over rows so only `logits` `[rows,V]` exists at a
    /// time: `losses[N] from inp[N,C] and targets[N]; when training also dinp[N,C]`
    /// (overwritten) and `dw` (+=), the loss being the mean over the step's trained targets
    /// ([`crate::backend::StepCtx::loss_tokens`], every micro-batch's and rank's). A target
    /// of [`IGNORE_TARGET`] is not trained: its row's loss is 0 and its gradient row 0.
    ///
    /// Under tensor parallelism (`vocab`) `w` is the rank's rows of the vocabulary, `v` their
    /// count: the softmax's maximum and sum come from every rank's [`Op::LmHeadStats`], so
    /// every rank writes the same `losses`, its own columns of the logits' gradient, its
    /// rows' `dw`, and a `dinp` the ranks' sum of which is the input's gradient.
    LmHeadLoss {
        inp: BufId,
        targets: BufId,
        losses: BufId,
        logits: BufId,
        dinp: Option<BufId>,
        w: Range<usize>, // [V, C]
        rows: Rows,
        c: usize,
        v: usize,
        rows_per_chunk: usize,
        vocab: Option<VocabShare>,
        /// Distillation (`train --distill-from`): the teacher's logits, chunk by chunk.
        teacher: Option<TeacherLogits>,
        /// `[N, 2]` f32 (`--update in-backward`): the head's weight gradient is not taken
        /// here but after the backward, by [`Op::LmHeadWeightGrad`] ops over slices of the
        /// vocabulary; each row's softmax maximum and `scale / Σ exp(logit − max)` are
        /// written here for them (a row of an untrained target: 0 and 0).
        row_stats: Option<BufId>,
    },
    /// The LM head's weight gradient for the vocabulary's rows `first_token..first_token +
    /// v` (`w` `[v, C]`), taken after the backward (`--update in-backward`,
    /// `plan::update`): per chunk of rows of `inp[N,C]`, the logits of those words again,
    /// `logits[rows, v] = inp @ wᵀ`, their gradient from `row_stats` `[N, 2]` (what
    /// [`Op::LmHeadLoss`] left) and the targets, and `dw += dlogitsᵀ @ inp`: the rows of
    /// the whole head's `dw`.
    LmHeadWeightGrad {
        inp: BufId,
        targets: BufId,
        row_stats: BufId,
        logits: BufId,
        w: Range<usize>, // [v, C]
        first_token: usize,
        rows: Rows,
        c: usize,
        v: usize,
        rows_per_chunk: usize,
    },
    /// A tensor-parallel LM head's first pass over the rank's rows `w` `[v, C]` of the
    /// vocabulary (token ids `first_token..`), chunked like [`Op::LmHeadLoss`]: per row of
    /// `inp[N,C]`, `stats[N, 3]` = (max of its logits, Σ exp(logit − max), the target's logit
    /// where this rank holds the target, else 0). Gathered over the tensor axis, they give
    /// every rank the whole softmax's maximum and sum, no rank holding all the logits.
    LmHeadStats {
        inp: BufId,
        targets: BufId,
        logits: BufId,
        stats: BufId,
        w: Range<usize>, // [Vpart, C]
        first_token: usize,
        rows: Rows,
        c: usize,
        v: usize,
        rows_per_chunk: usize,
    },
    /// `logits[V]` of the last row of `inp[N,C]` (generation).
    LmHeadLast {
        inp: BufId,
        logits: BufId,
        w: Range<usize>, // [V, C]
        rows: Rows,
        c: usize,
        v: usize,
    },
    /// `dinp[N,C] += layernorm_backward(dout); dw, db +=`.
    LayerNormBackward {
        dinp: BufId,
        dout: BufId,
        inp: BufId,
        mean: BufId,
        rstd: BufId,
        w: Range<usize>,
        b: Range<usize>,
        rows: Rows,
        c: usize,
    },
    /// `dinp[N,IC] = dout @ Wᵀ; dW += inpᵀ @ dout; db += Σ dout` (W as in [`Op::Matmul`]).
    MatmulBackward {
        dinp: BufId,
        dout: BufId,
        inp: BufId,
        w: Range<usize>,
        b: Option<Range<usize>>,
        layout: WeightLayout,
        rows: Rows,
        ic: usize,
        oc: usize,
    },
    /// A LoRA adapter on a frozen linear layer (`crate::model::lora`): `h[N,r] = scale ·
    /// inp[N,IC] @ aᵀ` (kept for the backward), then `out[:, col..col+OC] += h @ bᵀ`, where
    /// `out` rows are `ldo` wide (the adapted layer may be one of several sharing a fused
    /// output, as Llama's q, k and v). `a` `[r, IC]`, `b` `[OC, r]`.
    LoraForward {
        inp: BufId,
        out: BufId,
        h: BufId,
        a: Range<usize>, // [r, IC]
        b: Range<usize>, // [OC, r]
        rows: Rows,
        ic: usize,
        oc: usize,
        r: usize,
        col: usize,
        ldo: usize,
        scale: f32,
        /// The adapter's input dropout (`--lora-dropout` above 0): `inp` masked into its
        /// workspace first, and `h` computed from that.
        dropout: Option<LoraDropout>,
    },
    /// The backward of [`Op::LoraForward`], with `dout` rows `ldo` wide: `db += dout[:,
    /// col..]ᵀ @ h`; `dh[N,r] = scale · dout[:, col..] @ b` (f32 scratch); `da += dhᵀ @ inp`;
    /// `dinp[N,IC] += dh @ a` (the frozen layer's backward wrote it first). With dropout,
    /// `inp` is the forward's masked input (the same mask drawn again) and `dh @ a` is masked
    /// before it is added.
    LoraBackward {
        dinp: BufId,
        dout: BufId,
        inp: BufId,
        h: BufId,
        dh: BufId,
        a: Range<usize>,
        b: Range<usize>,
        rows: Rows,
        ic: usize,
        oc: usize,
        r: usize,
        col: usize,
        ldo: usize,
        scale: f32,
        dropout: Option<LoraDropout>,
    },
    /// `dqkv[N,(NH+2·NKV)·hd] from dout[N,NH·hd]` (probabilities recomputed from lse; a KV
    /// head's gradient sums over its query heads). `positions` and `window` as the forward's.
    AttentionBackward {
        dqkv: BufId,
        positions: Option<BufId>, // [B, T] u32, packed rows only
        dout: BufId,
        qkv: BufId,
        out: BufId,
        lse: BufId,
        ws: BufId,
        rows: Rows,
        nh: usize,
        nkv: usize,
        hd: usize,
        window: Option<usize>,
        /// The forward's `scale_dim`.
        scale_dim: f32,
    },
    /// `dinp[N,C] += rmsnorm_backward(dout); dw +=` (the gain `offset + w`, as the forward's).
    /// A residual the forward added is the caller's: its gradient is `dout` itself.
    RmsNormBackward {
        dinp: BufId,
        dout: BufId,
        inp: BufId,
        rstd: BufId,
        w: Range<usize>,
        offset: f32,
        rows: Rows,
        c: usize,
    },
    /// The backward of [`Op::QkNorm`] in place: `d[N,QKV]`, the gradient of its output, becomes
    /// its input's (query and key heads replaced, value heads passed through unchanged);
    /// `dw[2·hd] +=` (query heads' sum into `q_norm`'s, key heads' into `k_norm`'s).
    QkNormBackward {
        d: BufId,
        inp: BufId,
        rstd: BufId,
        w: Range<usize>, // [2, hd]
        offset: f32,
        rows: Rows,
        nh: usize,
        nkv: usize,
        hd: usize,
    },
    /// `dinp[N,2H] = glu_backward(dout[N,H], inp[N,2H])` (overwritten), `act` as the
    /// forward's.
    GluBackward {
        dinp: BufId,
        dout: BufId,
        inp: BufId,
        rows: Rows,
        h: usize,
        act: GluAct,
    },
    /// `d[N,width] ← d ⊙ gelu'(inp)` in place.
    GeluBackward {
        d: BufId,
        inp: BufId,
        rows: Rows,
        width: usize,
    },
    /// `dwte (, dwpe) += scatter(dout[N,C])`; `dwte` gains only the rows of the token ids it
    /// holds (`first_token..`, as in [`Op::Encoder`]), `scale · dout` (the forward's scale).
    EncoderBackward {
        dout: BufId,
        tokens: BufId,
        positions: Option<BufId>, // [B, T] u32, packed rows only
        wte: Range<usize>,        // [Vpart, C]
        wpe: Option<Range<usize>>,
        first_token: usize,
        rows: Rows,
        c: usize,
        scale: f32,
    },
    /// `out[slot] = Σ grad²` over the gradients of `range` (one parameter group's share of
    /// the global gradient norm, in f64; `out` is the step's `grad_norm.shares` `[groups]`,
    /// slot = the group's index). The executor reads `out` once, before the first `AdamW` op
    /// runs, and sums the shares in slot order into the norm, the clipping factor and
    /// whether the step is skipped (gradients not finite): one read of the device per step.
    GradNorm {
        range: Range<usize>,
        out: BufId, // [groups] f64
        slot: usize,
        /// The slot's tensors are tensor-parallel parts (the executor adds the tensor
        /// ranks' shares), not tensors every tensor rank holds whole (counted once). Set
        /// by the slot, not by `range`, which a ZeRO shard may leave empty.
        parts: bool,
    },
    /// AdamW on these parameter tensors (master weights, gradients and moments of the same
    /// ranges; the moments in `state`), with the step's clipping factor; not run when the
    /// step is skipped.
    AdamW {
        tensors: Vec<ParamSlice>,
        state: OptimBufs,
        /// 8-bit state of a group holding tensor-parallel parts: each block's new scales,
        /// agreed among the ranks, which the update encodes the moments at instead of its
        /// elements' maxima (and keeps for every block of its state).
        scales: Option<BlockScales>,
    },
    /// The new 8-bit block scales an [`Op::AdamW`] of the same `tensors` and `state` would
    /// compute (the maxima of |m| and |v| after the update, over the rank's elements of
    /// each block), into `out` (0 for a block it holds none of), changing nothing else.
    AdamWBlockMax {
        tensors: Vec<ParamSlice>,
        state: OptimBufs,
        out: BlockScales,
    },
    /// Starts copying buffer `from` into buffer `to`: one size, on two adjacent tiers of the
    /// backend's list ([`crate::ir::Sizing::tiers`]; the CPU's: a disk-tier buffer and a RAM
    /// staging buffer, so a read from disk or a write to it). It runs beside the ops that
    /// follow, until an [`Op::AwaitTransfers`] naming the staging buffer.
    Transfer { from: BufId, to: BufId },
    /// Waits until every transfer started into or out of `bufs` (host staging buffers) is
    /// done; fails with the first one that failed.
    AwaitTransfers { bufs: Vec<BufId> },
    /// `buf` (or its `elems`; cut among the ranks as `cut` says) becomes its sum over the
    /// ranks of `axis`, in place (a group's gradients, `--zero 0`; a row-parallel layer's
    /// output or a column-parallel layer's input gradient, `--tp`; the gradient of a LoRA
    /// adapter's tensor that every tensor rank holds whole, `--tp` with `--lora`); `scratch`
    /// receives the pieces in flight (`dist::ring`).
    AllReduce {
        buf: BufId,
        scratch: BufId,
        cut: CutOf,
        /// The mesh axis whose ranks it runs among.
        axis: Axis,
        /// The elements of `buf` it sums (`None`: all of them): a LoRA adapter's tensor held
        /// whole by every tensor rank, whose gradient each rank computes a partial sum of,
        /// inside its group's gradients (`plan::lora::sum_shared_grads`).
        elems: Option<Range<usize>>,
        /// Sum, or maximum (8-bit block scales, f32).
        reduce: Reduce,
    },
    /// `shard` (as long as the rank's chunk) becomes (`accumulate`: gains) the sum over the
    /// ranks of chunk `rank` of `buf` (cut as `cut` says), whose contents are consumed
    /// (`--zero 1` and up: a group's gradients; under sequence parallelism a row-parallel
    /// layer's output, or a column-parallel layer's input gradient, scattered to each
    /// tensor rank's rows). With `residual` (as long as `shard`, not accumulating) `shard`
    /// becomes `residual` plus the sum: the residual stream's add after a row-parallel layer.
    ReduceScatter {
        buf: BufId,
        shard: BufId,
        scratch: BufId,
        accumulate: bool,
        cut: CutOf,
        axis: Axis,
        residual: Option<BufId>,
    },
    /// Every rank's chunk `rank` of `buf` (cut as `cut` says) is copied into every
    /// rank's `buf`; with `shard`, the rank's chunk is first copied from there (a group's
    /// parameters after its sharded update, `--zero 1` and up, or gathered for use,
    /// `--zero 3`).
    AllGather {
        buf: BufId,
        shard: Option<BufId>,
        cut: CutOf,
        axis: Axis,
    },
    /// Starts sending `buf` to the neighbouring pipeline stage `to` (a stage's output
    /// activations to the next, its input gradient to the one before): pipeline
    /// parallelism's point-to-point, on the collectives' thread in schedule order, until an
    /// [`Op::AwaitCollective`] naming `buf`. The two stages order their sends and receives
    /// alike (`plan::pipeline`), so blocking transports never deadlock.
    StageSend { buf: BufId, to: Peer },
    /// Starts receiving `buf` from the neighbouring pipeline stage `from` (what its
    /// [`Op::StageSend`] sends), until an [`Op::AwaitCollective`] naming `buf`.
    StageRecv { buf: BufId, from: Peer },
    /// Waits until the collective on `bufs[0]` (its `buf`), started earlier in the step,
    /// is done. Collectives run on the device's communication thread, in schedule order,
    /// beside the ops between the collective and this one, which touch none of `bufs` (the
    /// collective's buffers, kept live until here).
    AwaitCollective { bufs: Vec<BufId> },
}

/// An adapter's input dropout (`--lora-dropout p`, PEFT's `nn.Dropout` on the adapter's
/// input), in training steps only: each element of the input `[N, IC]` is kept with
/// probability `1 - p` and scaled by `1 / (1 - p)`. The mask is never stored: it is a hash of
/// (the step's seed, `adapter`, the element's place in the step's whole batch), so the
/// backward and a recomputed forward draw the forward's mask again.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraDropout {
    /// The probability an element is dropped, in (0, 1).
    pub p: f32,
    /// Which adapter (its index among the plan's adapters): adapters sharing an input (q, k
    /// and v) draw their own masks.
    pub adapter: usize,
    /// The op's micro-batch: its rows are rows `micro·N..` of the step's batch (a rank's
    /// micro-batches follow those of the ranks before it).
    pub micro: usize,
    /// `[N, IC]` f32 workspace: the masked input (and, in the backward, `dh @ a` after it).
    pub ws: BufId,
    /// Where the op's input sits in the one-process input, whose elements the mask is drawn
    /// by: `(width, offset)`, its rows `width` wide and the op's `IC` columns starting at
    /// column `offset` (a tensor rank's part of a row-parallel layer's input, `--tp`);
    /// `(IC, 0)` for a whole input.
    pub cols: (usize, usize),
}

impl LoraDropout {
    /// Whether the op's input is part of the one-process input's columns (`ic` of them).
    pub fn is_cut(&self, ic: usize) -> bool {
        self.cols != (ic, 0)
    }
}

/// An op with its display name, phase, arithmetic cost, and where it finds the parameters
/// and gradients its ranges name.
#[derive(Clone, Debug)]
pub struct OpEntry {
    pub name: String,
    pub phase: Phase,
    pub op: Op,
    /// Floating-point operations (multiply-add = 2).
    pub flops: u64,
    /// The buffer holding the parameters of [`Op::param_ranges`] (set when there are any).
    pub params: Option<Binding>,
    /// The buffer holding the gradients of [`Op::grad_ranges`] (set when there are any).
    pub grads: Option<Binding>,
    /// The micro-batch the op belongs to (0 for the optimizer's ops and single-batch steps).
    pub micro: usize,
    /// The op's parameter ranges are the frozen base model's (a LoRA plan,
    /// `plan::lora`): [`OpEntry::params`] binds them in the base's buffers, and the op
    /// computes no gradient for them (a backward op still computes its input's gradient).
    pub frozen: bool,
}

impl OpEntry {
    /// Whether the op runs on the host's cores, on its buffers where they live beneath a
    /// GPU (`compute` is device memory): an [`Op::AdamW`] whose master weights are in
    /// pinned host RAM. The planner keeps every buffer of such an op there (`plan::stage`,
    /// checked by `plan::build::verify_transfers`), so its state never crosses the bus.
    pub fn runs_on_host(&self, buffers: &[Buffer], compute: Tier) -> bool {
        compute == Tier::Device
            && matches!(self.op, Op::AdamW { .. })
            && self
                .params
                .is_some_and(|b| buffers[b.buf.0].placement.tier == Tier::Host)
    }
}

/// AdamW moment buffers in the plan's `OptimState` format, holding the moments of parameter
/// elements `base..base + len`: f32 or bf16 `m`, `v` `[len]`; or int8 codes m (i8) and v (u8)
/// `[len]` with f32 block scales `m_scale, v_scale [blocks]` for 8-bit blocks
/// `block_base..` (blocks of QBLOCK values counted per tensor). Either the whole model's
/// state (`base` 0) or one parameter group's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptimBufs {
    pub format: OptimState,
    pub m: BufId,
    pub v: BufId,
    pub m_scale: Option<BufId>,
    pub v_scale: Option<BufId>,
    /// First parameter element whose moments `m[0]` and `v[0]` hold.
    pub base: usize,
    /// First 8-bit block whose scale `m_scale[0]` and `v_scale[0]` hold.
    pub block_base: usize,
}

impl OptimBufs {
    /// The buffers, in the order checkpoints and transfers list them: m, v (, scales).
    pub fn ids(&self) -> Vec<BufId> {
        let mut ids = vec![self.m, self.v];
        ids.extend(self.m_scale);
        ids.extend(self.v_scale);
        ids
    }
}

/// One buffer holding the parameters (or gradients, or moments) of parameter elements
/// `range`: `buf[i - range.start]` is element `i`'s. How it stores them is the buffer's
/// dtype: f32 elements, or ggml blocks (a LoRA plan's quantized base, `--base-quant`,
/// [`crate::dtype::DType::Ggml`]: element `i` is in block `(i - range.start) / block_size`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub range: Range<usize>,
    pub buf: BufId,
}

/// Buffers covering every parameter once, in parameter order: the parameters (one buffer in
/// RAM, or one per group on the disk tier) or the gradients (one per group).
#[derive(Clone, Debug, Default)]
pub struct Segments {
    pub segments: Vec<Segment>,
}

impl Segments {
    /// The segment holding parameter range `r`. Every parameter range an op names lies in
    /// one parameter group, and so in one segment (internal error otherwise).
    pub fn locate(&self, r: &Range<usize>) -> &Segment {
        match self.find(r) {
            Some(s) => s,
            None => panic!("internal error: parameter range {r:?} is not inside one group"),
        }
    }

    /// The segment holding all of parameter range `r`, if one does.
    pub fn find(&self, r: &Range<usize>) -> Option<&Segment> {
        let i = self.segments.partition_point(|s| s.range.end <= r.start);
        self.segments
            .get(i)
            .filter(|s| s.range.start <= r.start && r.end <= s.range.end)
    }

    /// The buffers, in parameter order.
    pub fn bufs(&self) -> Vec<BufId> {
        self.segments.iter().map(|s| s.buf).collect()
    }
}

/// Where an op finds parameter (or gradient) element `i` of the ranges it names:
/// `buf[i - base]`. The planner binds every op that reads parameters or touches gradients
/// (`plan::build::bind_state`); an op's ranges lie in one parameter group, so one binding
/// serves them all. Staging (`plan::stage`) rebinds an op to a group's host staging copy.
/// The bound buffer's dtype says how it stores them (f32, or ggml blocks of a quantized
/// base: [`Segment`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Binding {
    pub buf: BufId,
    pub base: usize,
}

impl Binding {
    /// The binding's elements for parameter range `r`.
    pub fn local(&self, r: &Range<usize>) -> Range<usize> {
        r.start - self.base..r.end - self.base
    }
}

/// The buffers ops touch without naming them: parameter ranges index `params` and the
/// gradients, optimizer ops the moments, matmuls the mixed-precision tiles.
#[derive(Clone, Debug)]
pub struct ImplicitBufs {
    /// The fp32 parameters (the master weights under mixed precision; kernels read them
    /// directly and the optimizer updates them) where they live between steps: one buffer
    /// in RAM, or one per parameter group on the disk tier (`--offload params`).
    pub params: Segments,
    /// A LoRA plan's frozen base weights (in the base model's [`crate::model::ParamLayout`],
    /// which [`crate::plan::Plan::lora`] holds): what [`OpEntry::frozen`] ops are bound to. The
    /// adapters are then [`ImplicitBufs::params`].
    pub base: Option<Segments>,
    /// f32 tiles of the mixed-precision GEMM (mixed precision).
    pub gemm_ws: Option<BufId>,
    /// The f32 tile a quantized base's weights are decoded into, a few rows at a time, by
    /// the frozen layers' GEMMs (`--base-quant`).
    pub quant_ws: Option<BufId>,
    /// Parameter gradients in the storage type, one buffer per group (training plans): in
    /// RAM from the group's first backward write to its update, or on the disk tier
    /// (`--offload grads`).
    pub grads: Option<Segments>,
    /// AdamW moments where they live between steps (training plans): one entry covering
    /// every parameter when they stay in RAM, or one per parameter group on the offload tier
    /// (`--offload optimizer`; each group's `AdamW` then reads host staging copies).
    pub optim: Option<Vec<OptimBufs>>,
    /// The backend's own scratch in its compute tier, for the whole step
    /// ([`super::Sizing::scratch_bytes`]: a GPU's cuBLASLt workspace, weight tile and
    /// reduction partials); `None` where the backend keeps none (the CPU).
    pub scratch: Option<BufId>,
}

/// The ordered ops of one step, the buffers they use implicitly, and the buffers the host
/// fills or reads between steps.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub ops: Vec<OpEntry>,
    pub implicit: ImplicitBufs,
    /// Input token ids `[B, T]`, one buffer per micro-batch.
    pub tokens: Vec<BufId>,
    /// Each row's place in its example `[B, T]` per micro-batch (packed training plans,
    /// [`crate::plan::StepConfig::packed`]; empty otherwise).
    pub positions: Vec<BufId>,
    /// Target token ids `[B, T]` per micro-batch (training plans; empty otherwise).
    pub targets: Vec<BufId>,
    /// `Per-row losses [N] per micro-batch (training plans; empty otherwise)`.
    pub losses: Vec<BufId>,
    /// `Next-token logits [V] (generation plans)`.
    pub logits: Option<BufId>,
    /// Distillation: the teacher's final-norm output `[B·T, Ct]` per micro-batch (filled
    /// each step, `Executor::upload_teacher`) and its LM head `[V, Ct]` (filled once).
    pub teacher_hidden: Vec<BufId>,
    pub teacher_head: Option<BufId>,
    /// Each step runs the previous step's update in its forward (`DeferredUpdate` ops), and
    /// the `Optimizer` ops only finish a pending update between steps. Set when gradients
    /// live on the disk tier (they are then kept across the step boundary there).
    pub deferred_update: bool,
}

impl Schedule {
    /// Whether a training step runs ops of `phase` (a deferred update's `Optimizer` copy
    /// runs only between steps, to finish an update).
    pub fn in_step(&self, phase: Phase) -> bool {
        !(self.deferred_update && phase == Phase::Optimizer)
    }
}

impl Op {
    /// The buffer a collective works on (its `buf`, which no other collective of a step
    /// names: an [`Op::AwaitCollective`] names it first); `None` for other ops.
    pub fn collective_buf(&self) -> Option<BufId> {
        match self {
            Op::AllReduce { buf, .. }
            | Op::ReduceScatter { buf, .. }
            | Op::AllGather { buf, .. }
            | Op::StageSend { buf, .. }
            | Op::StageRecv { buf, .. } => Some(*buf),
            _ => None,
        }
    }

    /// How a collective's buffer is cut, and along which axis; `None` for other ops.
    pub fn collective_cut(&self) -> Option<(CutOf, Axis)> {
        match self {
            Op::AllReduce { cut, axis, .. }
            | Op::ReduceScatter { cut, axis, .. }
            | Op::AllGather { cut, axis, .. } => Some((*cut, *axis)),
            _ => None,
        }
    }
}
