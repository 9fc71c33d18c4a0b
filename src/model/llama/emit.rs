//! The Llama family's layers in a step's schedule: the token embedding, the blocks, the final
//! RMSNorm, the LM head with the loss, and the backward of each, for one micro-batch.
//!
//! A block (pre-norm, as transformers' `LlamaDecoderLayer`):
//!   x1 = rmsnorm(x); qkv = x1 @ [Wq; Wk; Wv]ᵀ (+ b); [Qwen3: qkv = qk_norm(qkv)]; rope(q, k)
//!   in place;
//!   a = attention(qkv); r = x + a @ Woᵀ (+ bo);
//!   x2 = rmsnorm(r); gu = x2 @ [Wgate; Wup]ᵀ (+ b); s = silu(gate) · up; out = r + s @ Wdownᵀ.
//! As in GPT-2's emission, the forward is a sequence of [`Stage`]s writing fresh buffers, which
//! [`block_emit`] emits and re-emits in part (`h{l}.re.*`, `Phase::Recompute`) just before
//! the block's backward. The RoPE op rotates the fused q|k|v buffer in place right after the
//! projection that wrote it, so the buffer every later reader sees is the rotated one; the
//! backward un-rotates the attention's gradient in place before the projection's backward.
//! Qwen3 ([`crate::model::Family::qk_norm`]) normalises each query and key head between the
//! projection and RoPE (transformers' `Qwen3Attention`: `q_norm(q_proj(x).view(.., hd))`,
//! then `apply_rotary_pos_emb`; llama.cpp's `LLM_ARCH_QWEN3` graph: `attn_q_norm` before
//! `ggml_rope_ext`): the projection writes `qkv.raw`, which the backward keeps as the norm's
//! input, [`Op::QkNorm`] writes `qkv`; the backward turns the un-rotated gradient into the
//! projection's in place ([`Op::QkNormBackward`]).
//! Gemma 3 ([`crate::model::Family::post_norms`]) normalises the attention's output projection
//! `o` and the MLP's down projection `m` before the residual adds them: the projections write
//! fresh buffers (`attn_o`, `mlp_out`), one [`Op::RmsNorm`] with the residual writes the
//! stream (`r = x + norm(o)`, `out = r + norm(m)`); the backward takes each norm's input
//! gradient into a zeroed buffer (the residual's gradient is the stream's own). The block
//! output's norm is emitted with the down projection, outside the stages, so full
//! recomputation keeps `mlp_out` from the forward. Gemma's gains are `1 + w` (every norm's
//! `offset`), its MLP GeGLU ([`Op::Glu`]'s `act`), its embedding scaled by √C, and its layers
//! attend and rotate each as [`ModelSpec::layer_window`] and [`ModelSpec::layer_rope`] say.
//! Under tensor parallelism the projections are the rank's parts, joined as
//! [`crate::model::tensor_join`] says; under sequence parallelism the residual stream, every
//! norm and its output are the rank's rows (`own`, `[N/T, C]`), gathered for the
//! projections that read them.
//! Shapes: B batch, T sequence, N = B·T rows, C width, H MLP width, NH query heads, NKV
//! key/value heads, hd head size, QKV = (NH + 2·NKV)·hd, A = NH·hd, V vocabulary.

use super::params::{LayerParams, LlamaParams, inventory};
use crate::ir::EmitOptions;
use crate::ir::builder::{Builder, Emitted, MicroBatch};
use crate::ir::schedule::{GluAct, Op, Phase, Rows, WeightLayout};
use crate::ir::{BufId, Category, ModelPart, TensorSplit};
use crate::model::block_emit::{self, StagedBlock};
use crate::model::embedding::Embedding;
use crate::model::lm_head::{self, Head};
use crate::model::tensor_join::{InputGrad, RowParallel, gather_rows};
use crate::model::{ModelSpec, rope};
use std::ops::Range;

/// Dimensions of one micro-batch, shared by the emitters.
struct Dims {
    b: usize,
    t: usize,
    n: usize,
    rows: Rows,
    /// The rows of the residual stream this rank holds (all `rows`, or its N/T under
    /// sequence parallelism): every norm's and the stream's.
    own: Rows,
    c: usize,
    h: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    eps: f32,
    /// What every norm's gain adds to its weight (Gemma's 1).
    norm_offset: f32,
    /// Each layer's attention, by the model's layer index.
    layers: Vec<LayerAttention>,
    /// Attention workspace elements (forward or backward).
    attn_ws_len: usize,
    /// The rows' places in their examples `[B, T]` u32 when rows pack examples.
    positions: Option<BufId>,
    /// The model's vocabulary.
    v: usize,
    /// This rank's part of each block (`nh`, `nkv` and `h` are its part's).
    tensor: TensorSplit,
    /// Each query and key head RMS-normalised before RoPE (Qwen3, Gemma 3).
    qk_norm: bool,
    /// The gated MLP's activation.
    act: GluAct,
    /// The token embedding's factor (Gemma's √C).
    embed_scale: f32,
    /// Attention scores are q·k / √scale_dim ([`ModelSpec::attention_scale_dim`]).
    scale_dim: f32,
}

/// One layer's attention: its window and its rotation.
struct LayerAttention {
    /// The sliding window (Mistral's and Phi-3's every layer's, Gemma's sliding layers').
    window: Option<usize>,
    /// RoPE frequencies `[hd/2]` and the scale of the rotation.
    rope: rope::RopeTable,
}

impl Dims {
    /// Width of the fused q|k|v row.
    fn qkv(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }
    /// Width of the attention output (all query heads).
    fn a(&self) -> usize {
        self.nh * self.hd
    }
    /// FLOPs of a linear layer over N rows, forward (multiply-add = 2).
    fn mm_flops(&self, ic: usize, oc: usize) -> u64 {
        2 * (self.n * ic * oc) as u64
    }
    /// Causal attention forward FLOPs: half of 4·B·NH·T²·hd, or with a window what it
    /// leaves ([`Rows::attention_flops`]).
    fn attn_flops(&self, window: Option<usize>) -> u64 {
        self.rows.attention_flops(self.nh, self.hd, window)
    }
    /// Elements of the rank's rows of the stream `[N, C]`.
    fn stream_len(&self) -> usize {
        self.own.n() * self.c
    }
    /// The rank's rows `x` of a norm's output gathered for a column-parallel layer: `x`
    /// itself unless the rows are cut (`{name}.all` then).
    fn gathered(&self, g: &mut Builder, x: BufId, name: &str, phase: Phase) -> BufId {
        let cat = (name, Category::Activation);
        gather_rows(g, self.tensor, (x, self.n * self.c), cat, phase)
    }
    /// The stream's gradient (or a post-norm's input's) gathered for a row-parallel layer's
    /// backward.
    fn gathered_grad(&self, g: &mut Builder, d: BufId, name: &str) -> BufId {
        let cat = (name, Category::ActivationGrad);
        gather_rows(g, self.tensor, (d, self.n * self.c), cat, Phase::Backward)
    }
}

impl Block<'_> {
    /// The block's attention (window and rotation).
    fn attn(&self) -> &LayerAttention {
        &self.d.layers[self.index]
    }
}

/// One block of one micro-batch.
type Block<'a> = block_emit::Block<'a, Dims>;

/// The activations of one block that its backward reads (the norms' `[N, C]` and `[N]` are
/// the rank's rows: `own`).
#[derive(Clone, Debug)]
struct BlockActs {
    x1: BufId,      // [N, C] attention norm output
    x1_rstd: BufId, // [N]
    qkv: BufId,     // [N, QKV] (q and k normalised when qk_norm, then rotated)
    /// Qwen3: the projection's output, the q/k norm's input `[N, QKV]`, and its 1/rms
    /// `[N, NH + NKV]`.
    qk_norm: Option<(BufId, BufId)>,
    attn: BufId, // [N, A]
    lse: BufId,  // [B, NH, T]
    res2: BufId, // [N, C] residual after attention
    /// Gemma's post-attention norm: its input, the output projection's `[N, C]`, and its
    /// 1/rms `[N]`.
    post_attn: Option<(BufId, BufId)>,
    x2: BufId,      // [N, C] MLP norm output
    x2_rstd: BufId, // [N]
    gu: BufId,      // [N, 2H] gate | up
    act: BufId,     // [N, H] act(gate) · up
    /// Gemma's post-MLP norm: its input, the down projection's `[N, C]`, and its 1/rms `[N]`
    /// (written with the block's output).
    post_mlp: Option<(BufId, BufId)>,
}

/// The forward ops of a block that produce what its backward reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    AttnNorm,
    /// The q|k|v projection and RoPE.
    Qkv,
    Attn,
    AttnOut,
    MlpNorm,
    GateUp,
    Glu,
}

/// Buffers written by the stages emitted so far (the rest come from the forward).
#[derive(Default)]
struct Partial {
    x1: Option<BufId>,
    x1_rstd: Option<BufId>,
    qkv: Option<BufId>,
    /// Written with `qkv` (the Qkv stage) when the model has q/k norms.
    qk_norm: Option<(BufId, BufId)>,
    attn: Option<BufId>,
    lse: Option<BufId>,
    res2: Option<BufId>,
    /// Written with `res2` (the AttnOut stage) when the model has post-norms.
    post_attn: Option<(BufId, BufId)>,
    x2: Option<BufId>,
    x2_rstd: Option<BufId>,
    gu: Option<BufId>,
    act: Option<BufId>,
}

/// A linear layer `out[N, oc] = (residual +) inp[N, ic] @ wᵀ (+ b)`, `w` `[oc, ic]`.
#[allow(clippy::too_many_arguments)]
fn linear(
    g: &mut Builder,
    d: &Dims,
    name: String,
    phase: Phase,
    (inp, out, residual): (BufId, BufId, Option<BufId>),
    w: &Range<usize>,
    b: &Option<Range<usize>>,
    (ic, oc): (usize, usize),
) {
    g.op(
        name,
        phase,
        d.mm_flops(ic, oc),
        Op::Matmul {
            inp,
            out,
            residual,
            w: w.clone(),
            b: b.clone(),
            layout: WeightLayout::OutIn,
            rows: d.rows,
            ic,
            oc,
        },
    );
}

/// The backward of [`linear`]: `dinp` overwritten, the weight and bias gradients accumulated.
#[allow(clippy::too_many_arguments)]
fn linear_backward(
    g: &mut Builder,
    d: &Dims,
    name: String,
    (dinp, dout, inp): (BufId, BufId, BufId),
    w: &Range<usize>,
    b: &Option<Range<usize>>,
    (ic, oc): (usize, usize),
) {
    g.op(
        name,
        Phase::Backward,
        2 * d.mm_flops(ic, oc),
        Op::MatmulBackward {
            dinp,
            dout,
            inp,
            w: w.clone(),
            b: b.clone(),
            layout: WeightLayout::OutIn,
            rows: d.rows,
            ic,
            oc,
        },
    );
}

/// An RMSNorm of `inp` into fresh buffers `{pfx}{tag}` and `{pfx}{tag}.rstd`.
fn rmsnorm(
    g: &mut Builder,
    d: &Dims,
    (pfx, tag): (&str, &str),
    phase: Phase,
    inp: BufId,
    w: &Range<usize>,
) -> (BufId, BufId) {
    let out = g.act(format!("{pfx}{tag}"), Category::Activation, d.stream_len()); // [N, C]
    let rstd = norm_into(g, d, (pfx, tag), phase, (inp, out, None), w);
    (out, rstd)
}

/// An RMSNorm of `inp` into `out` (plus `residual`, Gemma's post-norms): the op `{pfx}{tag}`
/// and its fresh `{pfx}{tag}.rstd` `[N]`, returned.
fn norm_into(
    g: &mut Builder,
    d: &Dims,
    (pfx, tag): (&str, &str),
    phase: Phase,
    (inp, out, residual): (BufId, BufId, Option<BufId>),
    w: &Range<usize>,
) -> BufId {
    let rstd = g.f32(format!("{pfx}{tag}.rstd"), Category::Activation, d.own.n()); // [N]
    g.op(
        format!("{pfx}{tag}"),
        phase,
        0,
        Op::RmsNorm {
            inp,
            out,
            residual,
            rstd,
            w: w.clone(),
            offset: d.norm_offset,
            rows: d.own,
            c: d.c,
            eps: d.eps,
        },
    );
    rstd
}

/// The backward of a norm the forward added to the residual stream (Gemma's post-norms):
/// its input's gradient `{name}d.{tag}` `[N, C]`, zeroed then accumulated from `dres`, the
/// stream's gradient (also the residual's).
fn post_norm_backward(
    g: &mut Builder,
    d: &Dims,
    (name, tag): (&str, &str),
    (inp, rstd): (BufId, BufId),
    w: &Range<usize>,
    dres: BufId,
) -> BufId {
    let dinp = g.act(
        format!("{name}d.{tag}"),
        Category::ActivationGrad,
        d.stream_len(),
    );
    let bwd = Phase::Backward;
    g.op(
        format!("{name}zero d.{tag}"),
        bwd,
        0,
        Op::Zero { buf: dinp },
    );
    g.op(
        format!("{name}{tag}_norm.bwd"),
        bwd,
        0,
        Op::RmsNormBackward {
            dinp,
            dout: dres,
            inp,
            rstd,
            w: w.clone(),
            offset: d.norm_offset,
            rows: d.own,
            c: d.c,
        },
    );
    dinp
}

impl StagedBlock for Dims {
    type Layer = LayerParams;
    type Stage = Stage;
    type Acts = BlockActs;
    type Partial = Partial;

    const ALL_STAGES: &'static [Stage] = &[
        Stage::AttnNorm,
        Stage::Qkv,
        Stage::Attn,
        Stage::AttnOut,
        Stage::MlpNorm,
        Stage::GateUp,
        Stage::Glu,
    ];

    /// Selective recomputation: the cheap, memory-heavy stages (norm outputs, the gated product).
    const SELECTIVE_STAGES: &'static [Stage] = &[Stage::AttnNorm, Stage::MlpNorm, Stage::Glu];

    fn emit_stage(
        g: &mut Builder,
        blk: &Block,
        s: Stage,
        base: Option<&BlockActs>,
        partial: &mut Partial,
        pfx: &str,
        phase: Phase,
    ) {
        let (d, p) = (blk.d, blk.p);
        let get = |f: fn(&BlockActs) -> BufId, own: Option<BufId>| -> BufId {
            own.or_else(|| base.map(f))
                .expect("stages are emitted in order")
        };
        match s {
            Stage::AttnNorm => {
                let (x1, rstd) = rmsnorm(g, d, (pfx, "attn_norm"), phase, blk.res_in, &p.attn_norm);
                (partial.x1, partial.x1_rstd) = (Some(x1), Some(rstd));
            }
            Stage::Qkv => {
                let x1 = get(|a| a.x1, partial.x1);
                let inp = d.gathered(g, x1, &format!("{pfx}attn_norm"), phase);
                let qkv = g.act(format!("{pfx}qkv"), Category::Activation, d.n * d.qkv());
                // Qwen3: the projection into `qkv.raw` [N, QKV], normalised into `qkv`.
                let raw = d.qk_norm.then(|| {
                    let n = d.n * d.qkv();
                    g.act(format!("{pfx}qkv.raw"), Category::Activation, n)
                });
                let io = (inp, raw.unwrap_or(qkv), None);
                linear(
                    g,
                    d,
                    format!("{pfx}qkv"),
                    phase,
                    io,
                    &p.qkv_w,
                    &p.qkv_b,
                    (d.c, d.qkv()),
                );
                if let (Some(raw), Some(w)) = (raw, &p.qk_norm) {
                    let heads = d.n * (d.nh + d.nkv);
                    let rstd = g.f32(format!("{pfx}qk_norm.rstd"), Category::Activation, heads); // [N, NH + NKV]
                    g.op(
                        format!("{pfx}qk_norm"),
                        phase,
                        0,
                        Op::QkNorm {
                            inp: raw,
                            out: qkv,
                            rstd,
                            w: w.clone(),
                            offset: d.norm_offset,
                            rows: d.rows,
                            nh: d.nh,
                            nkv: d.nkv,
                            hd: d.hd,
                            eps: d.eps,
                        },
                    );
                    partial.qk_norm = Some((raw, rstd));
                }
                let rope = &blk.attn().rope;
                g.op(
                    format!("{pfx}rope"),
                    phase,
                    0,
                    Op::Rope {
                        x: qkv,
                        positions: d.positions,
                        rows: d.rows,
                        width: d.qkv(),
                        rotated: (d.nh + d.nkv) * d.hd,
                        hd: d.hd,
                        inv_freq: rope.inv_freq.clone(),
                        scale: rope.scale,
                        inverse: false,
                    },
                );
                partial.qkv = Some(qkv);
            }
            Stage::Attn => {
                let qkv = get(|a| a.qkv, partial.qkv);
                let out = g.act(format!("{pfx}attn"), Category::Activation, d.n * d.a());
                let lse = g.f32(
                    format!("{pfx}attn.lse"),
                    Category::Activation,
                    d.b * d.nh * d.t,
                );
                let ws = g.f32(format!("{pfx}attn.ws"), Category::Workspace, d.attn_ws_len);
                let window = blk.attn().window;
                g.op(
                    format!("{pfx}attn"),
                    phase,
                    d.attn_flops(window),
                    Op::Attention {
                        qkv,
                        positions: d.positions,
                        out,
                        lse,
                        ws,
                        rows: d.rows,
                        nh: d.nh,
                        nkv: d.nkv,
                        hd: d.hd,
                        window,
                        scale_dim: d.scale_dim,
                    },
                );
                (partial.attn, partial.lse) = (Some(out), Some(lse));
            }
            Stage::AttnOut => {
                let inp = get(|a| a.attn, partial.attn);
                // Row-parallel: the ranks' sum adds the residual and the bias once.
                let name = format!("{pfx}attn_out");
                let nc = d.n * d.c;
                let Some(w) = &p.post_attn_norm else {
                    let res = Some(blk.res_in);
                    let out = RowParallel::new(g, d.tensor, (&format!("{pfx}res_attn"), nc), res);
                    let b = if out.bias { &p.o_b } else { &None };
                    let io = (inp, out.out, out.residual);
                    linear(g, d, name.clone(), phase, io, &p.o_w, b, (d.a(), d.c));
                    partial.res2 = Some(out.join(g, &name, phase));
                    return;
                };
                // Gemma: r = x + norm(o), the norm on every tensor rank after the join.
                let o = RowParallel::new(g, d.tensor, (&format!("{pfx}attn_o"), nc), None);
                let b = if o.bias { &p.o_b } else { &None };
                linear(
                    g,
                    d,
                    name.clone(),
                    phase,
                    (inp, o.out, None),
                    &p.o_w,
                    b,
                    (d.a(), d.c),
                );
                let o = o.join(g, &name, phase);
                let out = g.act(
                    format!("{pfx}res_attn"),
                    Category::Activation,
                    d.stream_len(),
                );
                let io = (o, out, Some(blk.res_in));
                let rstd = norm_into(g, d, (pfx, "post_attn_norm"), phase, io, w);
                (partial.res2, partial.post_attn) = (Some(out), Some((o, rstd)));
            }
            Stage::MlpNorm => {
                let res2 = get(|a| a.res2, partial.res2);
                let (x2, rstd) = rmsnorm(g, d, (pfx, "mlp_norm"), phase, res2, &p.mlp_norm);
                (partial.x2, partial.x2_rstd) = (Some(x2), Some(rstd));
            }
            Stage::GateUp => {
                let x2 = get(|a| a.x2, partial.x2);
                let inp = d.gathered(g, x2, &format!("{pfx}mlp_norm"), phase);
                let gu = g.act(format!("{pfx}gate_up"), Category::Activation, d.n * 2 * d.h);
                let io = (inp, gu, None);
                let (w, b) = (&p.gate_up_w, &p.gate_up_b);
                linear(
                    g,
                    d,
                    format!("{pfx}gate_up"),
                    phase,
                    io,
                    w,
                    b,
                    (d.c, 2 * d.h),
                );
                partial.gu = Some(gu);
            }
            Stage::Glu => {
                let inp = get(|a| a.gu, partial.gu);
                let tag = glu_name(d.act);
                let out = g.act(format!("{pfx}{tag}"), Category::Activation, d.n * d.h);
                g.op(
                    format!("{pfx}{tag}"),
                    phase,
                    0,
                    Op::Glu {
                        inp,
                        out,
                        rows: d.rows,
                        h: d.h,
                        act: d.act,
                    },
                );
                partial.act = Some(out);
            }
        }
    }

    fn acts(partial: Partial, base: Option<&BlockActs>) -> BlockActs {
        let pick = |own: Option<BufId>, f: fn(&BlockActs) -> BufId| {
            own.or_else(|| base.map(f))
                .expect("every stage emitted or inherited")
        };
        BlockActs {
            x1: pick(partial.x1, |a| a.x1),
            x1_rstd: pick(partial.x1_rstd, |a| a.x1_rstd),
            qkv: pick(partial.qkv, |a| a.qkv),
            qk_norm: match partial.qkv {
                Some(_) => partial.qk_norm,
                None => base.and_then(|a| a.qk_norm),
            },
            attn: pick(partial.attn, |a| a.attn),
            lse: pick(partial.lse, |a| a.lse),
            res2: pick(partial.res2, |a| a.res2),
            post_attn: match partial.res2 {
                Some(_) => partial.post_attn,
                None => base.and_then(|a| a.post_attn),
            },
            x2: pick(partial.x2, |a| a.x2),
            x2_rstd: pick(partial.x2_rstd, |a| a.x2_rstd),
            gu: pick(partial.gu, |a| a.gu),
            act: pick(partial.act, |a| a.act),
            post_mlp: base.and_then(|a| a.post_mlp),
        }
    }

    /// The down projection (Gemma: and its post-norm, recorded in `acts`).
    fn emit_output(g: &mut Builder, blk: &Block, acts: &mut BlockActs) -> BufId {
        let (d, p, pfx) = (blk.d, blk.p, &blk.name);
        let name = format!("{pfx}down");
        let (fwd, nc) = (Phase::Forward, d.n * d.c);
        let Some(w) = &p.post_mlp_norm else {
            let res = Some(acts.res2);
            let out = RowParallel::new(g, d.tensor, (&format!("{pfx}out"), nc), res); // [N, C]
            let b = if out.bias { &p.down_b } else { &None };
            let io = (acts.act, out.out, out.residual);
            linear(g, d, name.clone(), fwd, io, &p.down_w, b, (d.h, d.c));
            return out.join(g, &name, fwd);
        };
        let m = RowParallel::new(g, d.tensor, (&format!("{pfx}mlp_out"), nc), None); // [N, C]
        let b = if m.bias { &p.down_b } else { &None };
        linear(
            g,
            d,
            name.clone(),
            fwd,
            (acts.act, m.out, None),
            &p.down_w,
            b,
            (d.h, d.c),
        );
        let m = m.join(g, &name, fwd);
        let out = g.act(format!("{pfx}out"), Category::Activation, d.stream_len()); // [N, C]
        let io = (m, out, Some(acts.res2));
        let rstd = norm_into(g, d, (pfx, "post_mlp_norm"), fwd, io, w);
        acts.post_mlp = Some((m, rstd));
        out
    }

    fn backward(g: &mut Builder, blk: &Block, a: &BlockActs, dres: BufId) {
        let (d, p, name) = (blk.d, blk.p, &blk.name);
        let (n, c) = (d.n, d.c);
        let dact = g.act(
            format!("{name}d.{}", glu_name(d.act)),
            Category::ActivationGrad,
            n * d.h,
        );
        let dgu = g.act(
            format!("{name}d.gate_up"),
            Category::ActivationGrad,
            n * 2 * d.h,
        );
        let dx2 = InputGrad::new(g, d.tensor, (&format!("{name}d.mlp_norm"), n * c));
        let dattn = g.act(format!("{name}d.attn"), Category::ActivationGrad, n * d.a());
        let dqkv = g.act(
            format!("{name}d.qkv"),
            Category::ActivationGrad,
            n * d.qkv(),
        );
        let dx1 = InputGrad::new(g, d.tensor, (&format!("{name}d.attn_norm"), n * c));
        let attn_ws = g.f32(
            format!("{name}attn.ws.bwd"),
            Category::Workspace,
            d.attn_ws_len,
        );
        let bwd = Phase::Backward;
        let (down, gate_up) = ((&p.down_w, &p.down_b), (&p.gate_up_w, &p.gate_up_b));
        // Gemma: the down projection's output gradient is its post-norm's input gradient.
        let dm = match (a.post_mlp, &p.post_mlp_norm) {
            (Some(m), Some(w)) => post_norm_backward(g, d, (name, "post_mlp"), m, w, dres),
            _ => dres,
        };
        let dm = d.gathered_grad(g, dm, &format!("{name}d.down"));
        let io = (dact, dm, a.act);
        linear_backward(
            g,
            d,
            format!("{name}down.bwd"),
            io,
            down.0,
            down.1,
            (d.h, c),
        );
        g.op(
            format!("{name}{}.bwd", glu_name(d.act)),
            bwd,
            0,
            Op::GluBackward {
                dinp: dgu,
                dout: dact,
                inp: a.gu,
                rows: d.rows,
                h: d.h,
                act: d.act,
            },
        );
        let x2 = d.gathered(g, a.x2, &format!("{name}mlp_norm.bwd"), bwd);
        let io = (dx2.buf, dgu, x2);
        let name_gu = format!("{name}gate_up.bwd");
        linear_backward(
            g,
            d,
            name_gu.clone(),
            io,
            gate_up.0,
            gate_up.1,
            (c, 2 * d.h),
        );
        let dx2 = dx2.join(g, &name_gu, bwd);
        g.op(
            format!("{name}mlp_norm.bwd"),
            bwd,
            0,
            Op::RmsNormBackward {
                dinp: dres,
                dout: dx2,
                inp: a.res2,
                rstd: a.x2_rstd,
                w: p.mlp_norm.clone(),
                offset: d.norm_offset,
                rows: d.own,
                c,
            },
        );
        let d_o = match (a.post_attn, &p.post_attn_norm) {
            (Some(o), Some(w)) => post_norm_backward(g, d, (name, "post_attn"), o, w, dres),
            _ => dres,
        };
        let d_o = d.gathered_grad(g, d_o, &format!("{name}d.attn_out"));
        let io = (dattn, d_o, a.attn);
        linear_backward(
            g,
            d,
            format!("{name}attn_out.bwd"),
            io,
            &p.o_w,
            &p.o_b,
            (d.a(), c),
        );
        let attn = blk.attn();
        g.op(
            format!("{name}attn.bwd"),
            bwd,
            5 * d.attn_flops(attn.window) / 2,
            Op::AttentionBackward {
                dqkv,
                positions: d.positions,
                dout: dattn,
                qkv: a.qkv,
                out: a.attn,
                lse: a.lse,
                ws: attn_ws,
                rows: d.rows,
                nh: d.nh,
                nkv: d.nkv,
                hd: d.hd,
                window: attn.window,
                scale_dim: d.scale_dim,
            },
        );
        g.op(
            format!("{name}rope.bwd"),
            bwd,
            0,
            Op::Rope {
                x: dqkv,
                positions: d.positions,
                rows: d.rows,
                width: d.qkv(),
                rotated: (d.nh + d.nkv) * d.hd,
                hd: d.hd,
                inv_freq: attn.rope.inv_freq.clone(),
                scale: attn.rope.scale,
                inverse: true,
            },
        );
        if let (Some((raw, rstd)), Some(w)) = (a.qk_norm, &p.qk_norm) {
            g.op(
                format!("{name}qk_norm.bwd"),
                bwd,
                0,
                Op::QkNormBackward {
                    d: dqkv,
                    inp: raw,
                    rstd,
                    w: w.clone(),
                    offset: d.norm_offset,
                    rows: d.rows,
                    nh: d.nh,
                    nkv: d.nkv,
                    hd: d.hd,
                },
            );
        }
        let x1 = d.gathered(g, a.x1, &format!("{name}attn_norm.bwd"), bwd);
        let io = (dx1.buf, dqkv, x1);
        let name_qkv = format!("{name}qkv.bwd");
        linear_backward(g, d, name_qkv.clone(), io, &p.qkv_w, &p.qkv_b, (c, d.qkv()));
        let dx1 = dx1.join(g, &name_qkv, bwd);
        g.op(
            format!("{name}attn_norm.bwd"),
            bwd,
            0,
            Op::RmsNormBackward {
                dinp: dres,
                dout: dx1,
                inp: blk.res_in,
                rstd: a.x1_rstd,
                w: p.attn_norm.clone(),
                offset: d.norm_offset,
                rows: d.own,
                c,
            },
        );
    }
}

/// The gated unit's name in ops and buffers (`swiglu`, `geglu`).
fn glu_name(act: GluAct) -> &'static str {
    match act {
        GluAct::Silu => "swiglu",
        GluAct::GeluTanh => "geglu",
    }
}

/// The micro-batch's token embedding (`embed`).
fn embedding<'a>(d: &Dims, p: &LlamaParams, mb: &'a MicroBatch) -> Embedding<'a> {
    Embedding {
        tokens: mb.tokens,
        positions: d.positions,
        wte: p.embed.clone(),
        wpe: None,
        vocab: d.v,
        rows: d.rows,
        c: d.c,
        split: d.tensor,
        scale: d.embed_scale,
        pfx: &mb.prefix,
        op: "embed",
    }
}

/// Emits one micro-batch of the stage `cfg.stage` (the whole model on one rank): the
/// forward, then in training plans the LM head with the loss and the backward (gradients
/// accumulate), in generation plans the next-token logits. A stage that does not end the
/// model sends its output on and receives its gradient back; one that does not begin it
/// sends the gradient of its input back.
pub(crate) fn micro_batch(
    g: &mut Builder,
    spec: &ModelSpec,
    cfg: &EmitOptions,
    mb: &MicroBatch,
) -> Emitted {
    let (split, stage) = (cfg.tensor, cfg.stage);
    let (_, p) = inventory(
        spec,
        ModelPart {
            tensor: split,
            stage,
        },
    );
    let Rows { b, t } = mb.rows;
    let layers = (0..spec.n_layer)
        .map(|l| {
            let (theta, scaling) = spec
                .layer_rope(l)
                .expect("validated: Llama-family models use rotary positions");
            LayerAttention {
                window: spec.layer_window(l),
                rope: rope::table(spec.head_dim, theta, scaling, t),
            }
        })
        .collect();
    let d = Dims {
        b,
        t,
        n: b * t,
        rows: mb.rows,
        own: mb.rows.own(split),
        c: spec.n_embd,
        h: split.len(spec.mlp_hidden),
        nh: split.len(spec.n_head),
        nkv: split.len(spec.n_kv_head),
        hd: spec.head_dim,
        eps: spec.norm_eps,
        norm_offset: spec.family.norm_offset(),
        layers,
        attn_ws_len: mb.attn_ws_len,
        positions: mb.positions,
        v: spec.vocab_size,
        tensor: split,
        qk_norm: spec.family.qk_norm(),
        act: spec.family.glu_act(),
        embed_scale: spec.family.embed_scale(spec.n_embd),
        scale_dim: spec.attention_scale_dim(),
    };
    let (len, pfx) = (d.stream_len(), mb.prefix.as_str());
    let embedded = stage
        .is_first()
        .then(|| embedding(&d, &p, mb).forward(g, "embedded"));
    let layers = (p.layers.as_slice(), p.chunks.as_slice());
    let ends = (len, stage.is_last());
    let runs = block_emit::stage_forward(g, &d, layers, pfx, embedded, ends);
    let dres = if stage.is_last() {
        let out = runs.last().expect("a stage holds a run").out();
        let (normed, rstd) = rmsnorm(g, &d, (pfx, "norm"), Phase::Forward, out, &p.norm);
        let cv = (d.c, spec.vocab_size);
        let dnormed = match lm_head::emit(g, cfg, mb, normed, p.lm_head.clone(), cv, "d.norm") {
            Head::Logits(logits) => {
                return Emitted {
                    logits: Some(logits),
                };
            }
            Head::InputGrad(dnormed) => dnormed,
        };
        let dres = block_emit::residual_grad(g, pfx, d.stream_len());
        g.op(
            format!("{pfx}norm.bwd"),
            Phase::Backward,
            0,
            Op::RmsNormBackward {
                dinp: dres,
                dout: dnormed,
                inp: out,
                rstd,
                w: p.norm.clone(),
                offset: d.norm_offset,
                rows: d.own,
                c: d.c,
            },
        );
        Some(dres)
    } else {
        None
    };
    let begins = (len, stage.is_first());
    let dres = block_emit::stage_backward(g, &d, layers, pfx, &runs, cfg.recompute, dres, begins);
    if let Some(dres) = dres.filter(|_| !cfg.frozen_embedding) {
        embedding(&d, &p, mb).backward(g, dres);
    }
    Emitted { logits: None }
}
