//! GPT-2's layers in a step's schedule: the encoder, the blocks, the final layer norm, the
//! tied LM head with the loss, and the backward of each, for one micro-batch.
//!
//! A block's forward is a sequence of [`Stage`]s, each one op writing fresh buffers.
//! [`block_emit`] emits them and, for recomputation, re-emits a subset into fresh buffers
//! (`h{l}.re.*`, `Phase::Recompute`) just before the block's backward, which reads those
//! instead of the forward's, so the forward's buffers die at their last forward reader.
//! Shapes: B batch, T sequence, C channels, H MLP width, NH heads, V vocabulary, N = B·T,
//! A = NH·hd the attention's width (C on one rank; under tensor parallelism NH, H and A are
//! the rank's part, and [`crate::model::tensor_join`] sums the two row-parallel projections' outputs and
//! the two column-parallel ones' input gradients over the tensor ranks; under sequence
//! parallelism the residual stream, the layer norms and their outputs are the rank's rows,
//! `[N/T, C]`, gathered for the projections that read them).

use super::params::{Gpt2Params, LayerParams, inventory};
use crate::ir::EmitOptions;
use crate::ir::builder::{Builder, Emitted, MicroBatch};
use crate::ir::schedule::{Op, Phase, Rows, WeightLayout};
use crate::ir::{BufId, Category, ModelPart, TensorSplit};
use crate::model::ModelSpec;
use crate::model::block_emit::{self, StagedBlock};
use crate::model::embedding::Embedding;
use crate::model::lm_head::{self, Head};
use crate::model::tensor_join::{InputGrad, RowParallel, gather_rows};

/// Dimensions of one micro-batch, shared by the emitters.
struct Dims {
    b: usize,
    t: usize,
    c: usize,
    /// MLP width (this rank's part).
    h: usize,
    /// Heads (this rank's), their size, and the attention's width `nh·hd`.
    nh: usize,
    hd: usize,
    a: usize,
    /// Rows, B·T.
    n: usize,
    /// The same rows as ops carry them.
    rows: Rows,
    /// The rows of the residual stream this rank holds (all `rows`, or its N/T under
    /// sequence parallelism): the layer norms' and the stream's.
    own: Rows,
    /// Layer-norm epsilon.
    eps: f32,
    /// Attention workspace elements (forward or backward).
    attn_ws_len: usize,
    /// The rows' places in their examples `[B, T]` u32 when rows pack examples.
    positions: Option<BufId>,
    /// The model's vocabulary.
    v: usize,
    /// This rank's part of each block (and of the vocabulary).
    tensor: TensorSplit,
}

/// One block of one micro-batch.
type Block<'a> = block_emit::Block<'a, Dims>;

/// The activations of one block that its backward reads.
#[derive(Clone, Debug)]
/// (The stream's and the norms' `[N, C]` and `[N]` are the rank's rows: `own`.)
struct BlockActs {
    ln1: BufId,      // [N, C]
    ln1_mean: BufId, // [N]
    ln1_rstd: BufId, // [N]
    qkv: BufId,      // [N, 3A]
    atty: BufId,     // [N, A]
    lse: BufId,      // [B, NH, T]
    res2: BufId,     // [N, C] residual after attention
    ln2: BufId,      // [N, C]
    ln2_mean: BufId, // [N]
    ln2_rstd: BufId, // [N]
    fch: BufId,      // [N, H]
    fch_gelu: BufId, // [N, H]
}

/// The forward ops of a block that produce what its backward reads (the last op, the MLP
/// projection, writes the next block's input, which is always kept).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Ln1,
    Qkv,
    Attn,
    AttnProj,
    Ln2,
    Fc,
    Gelu,
}

/// Buffers written by the stages emitted so far (the rest come from the forward).
#[derive(Default)]
struct Partial {
    ln1: Option<BufId>,
    ln1_mean: Option<BufId>,
    ln1_rstd: Option<BufId>,
    qkv: Option<BufId>,
    atty: Option<BufId>,
    lse: Option<BufId>,
    res2: Option<BufId>,
    ln2: Option<BufId>,
    ln2_mean: Option<BufId>,
    ln2_rstd: Option<BufId>,
    fch: Option<BufId>,
    fch_gelu: Option<BufId>,
}

/// FLOPs of a matmul over N rows, forward (multiply-add = 2).
fn mm_flops(d: &Dims, ic: usize, oc: usize) -> u64 {
    2 * (d.n * ic * oc) as u64
}

/// Causal attention forward FLOPs: half of 4·B·NH·T²·hs (no window).
fn attn_flops(d: &Dims) -> u64 {
    d.rows.attention_flops(d.nh, d.hd, None)
}

impl StagedBlock for Dims {
    type Layer = LayerParams;
    type Stage = Stage;
    type Acts = BlockActs;
    type Partial = Partial;

    const ALL_STAGES: &'static [Stage] = &[
        Stage::Ln1,
        Stage::Qkv,
        Stage::Attn,
        Stage::AttnProj,
        Stage::Ln2,
        Stage::Fc,
        Stage::Gelu,
    ];

    /// Selective recomputation: the cheap, memory-heavy stages (layernorm outputs, GELU).
    const SELECTIVE_STAGES: &'static [Stage] = &[Stage::Ln1, Stage::Ln2, Stage::Gelu];

    fn emit_stage(
        g: &mut Builder,
        blk: &Block,
        s: Stage,
        base: Option<&BlockActs>,
        partial: &mut Partial,
        pfx: &str,
        phase: Phase,
    ) {
        let (d, p, res_in) = (blk.d, blk.p, blk.res_in);
        let (n, c, own) = (d.n, d.c, d.own.n());
        let get = |f: fn(&BlockActs) -> BufId, own: Option<BufId>| -> BufId {
            own.or_else(|| base.map(f))
                .expect("stages are emitted in order")
        };
        match s {
            Stage::Ln1 | Stage::Ln2 => {
                let (inp, w, b, tag) = if s == Stage::Ln1 {
                    (res_in, &p.ln1_w, &p.ln1_b, "ln1")
                } else {
                    let res2 = get(|a| a.res2, partial.res2);
                    (res2, &p.ln2_w, &p.ln2_b, "ln2")
                };
                let out = g.act(format!("{pfx}{tag}"), Category::Activation, own * c);
                let mean = g.f32(format!("{pfx}{tag}.mean"), Category::Activation, own);
                let rstd = g.f32(format!("{pfx}{tag}.rstd"), Category::Activation, own);
                g.op(
                    format!("{pfx}{tag}"),
                    phase,
                    0,
                    Op::LayerNorm {
                        inp,
                        out,
                        mean,
                        rstd,
                        w: w.clone(),
                        b: b.clone(),
                        rows: d.own,
                        c,
                        eps: d.eps,
                    },
                );
                if s == Stage::Ln1 {
                    (partial.ln1, partial.ln1_mean, partial.ln1_rstd) =
                        (Some(out), Some(mean), Some(rstd));
                } else {
                    (partial.ln2, partial.ln2_mean, partial.ln2_rstd) =
                        (Some(out), Some(mean), Some(rstd));
                }
            }
            Stage::Qkv => {
                let inp = d.gathered(g, get(|a| a.ln1, partial.ln1), &format!("{pfx}ln1"), phase);
                let out = g.act(format!("{pfx}qkv"), Category::Activation, 3 * n * d.a);
                g.op(
                    format!("{pfx}qkv"),
                    phase,
                    mm_flops(d, c, 3 * d.a),
                    Op::Matmul {
                        inp,
                        out,
                        residual: None,
                        w: p.qkv_w.clone(),
                        b: Some(p.qkv_b.clone()),
                        layout: WeightLayout::InOut,
                        rows: d.rows,
                        ic: c,
                        oc: 3 * d.a,
                    },
                );
                partial.qkv = Some(out);
            }
            Stage::Attn => {
                let qkv = get(|a| a.qkv, partial.qkv);
                let out = g.act(format!("{pfx}attn"), Category::Activation, n * d.a);
                let lse = g.f32(
                    format!("{pfx}attn.lse"),
                    Category::Activation,
                    d.b * d.nh * d.t,
                );
                let ws = g.f32(format!("{pfx}attn.ws"), Category::Workspace, d.attn_ws_len);
                g.op(
                    format!("{pfx}attn"),
                    phase,
                    attn_flops(d),
                    Op::Attention {
                        qkv,
                        positions: d.positions,
                        out,
                        lse,
                        ws,
                        rows: d.rows,
                        nh: d.nh,
                        nkv: d.nh,
                        hd: d.hd,
                        window: None,
                        scale_dim: d.hd as f32,
                    },
                );
                (partial.atty, partial.lse) = (Some(out), Some(lse));
            }
            Stage::AttnProj => {
                let inp = get(|a| a.atty, partial.atty);
                // Row-parallel: the ranks' sum adds the residual and the bias once.
                let out = RowParallel::new(
                    g,
                    d.tensor,
                    (&format!("{pfx}res_attn"), n * c),
                    Some(res_in),
                );
                let name = format!("{pfx}attn_proj");
                g.op(
                    name.clone(),
                    phase,
                    mm_flops(d, d.a, c),
                    Op::Matmul {
                        inp,
                        out: out.out,
                        residual: out.residual,
                        w: p.proj_w.clone(),
                        b: out.bias.then(|| p.proj_b.clone()),
                        layout: WeightLayout::InOut,
                        rows: d.rows,
                        ic: d.a,
                        oc: c,
                    },
                );
                partial.res2 = Some(out.join(g, &name, phase));
            }
            Stage::Fc => {
                let inp = d.gathered(g, get(|a| a.ln2, partial.ln2), &format!("{pfx}ln2"), phase);
                let out = g.act(format!("{pfx}fc"), Category::Activation, n * d.h);
                g.op(
                    format!("{pfx}fc"),
                    phase,
                    mm_flops(d, c, d.h),
                    Op::Matmul {
                        inp,
                        out,
                        residual: None,
                        w: p.fc_w.clone(),
                        b: Some(p.fc_b.clone()),
                        layout: WeightLayout::InOut,
                        rows: d.rows,
                        ic: c,
                        oc: d.h,
                    },
                );
                partial.fch = Some(out);
            }
            Stage::Gelu => {
                let inp = get(|a| a.fch, partial.fch);
                let out = g.act(format!("{pfx}fc.gelu"), Category::Activation, n * d.h);
                g.op(
                    format!("{pfx}gelu"),
                    phase,
                    0,
                    Op::Gelu {
                        inp,
                        out,
                        rows: d.rows,
                        width: d.h,
                    },
                );
                partial.fch_gelu = Some(out);
            }
        }
    }

    fn acts(partial: Partial, base: Option<&BlockActs>) -> BlockActs {
        let pick = |own: Option<BufId>, f: fn(&BlockActs) -> BufId| {
            own.or_else(|| base.map(f))
                .expect("every stage emitted or inherited")
        };
        BlockActs {
            ln1: pick(partial.ln1, |a| a.ln1),
            ln1_mean: pick(partial.ln1_mean, |a| a.ln1_mean),
            ln1_rstd: pick(partial.ln1_rstd, |a| a.ln1_rstd),
            qkv: pick(partial.qkv, |a| a.qkv),
            atty: pick(partial.atty, |a| a.atty),
            lse: pick(partial.lse, |a| a.lse),
            res2: pick(partial.res2, |a| a.res2),
            ln2: pick(partial.ln2, |a| a.ln2),
            ln2_mean: pick(partial.ln2_mean, |a| a.ln2_mean),
            ln2_rstd: pick(partial.ln2_rstd, |a| a.ln2_rstd),
            fch: pick(partial.fch, |a| a.fch),
            fch_gelu: pick(partial.fch_gelu, |a| a.fch_gelu),
        }
    }

    /// The MLP projection.
    fn emit_output(g: &mut Builder, blk: &Block, acts: &mut BlockActs) -> BufId {
        let (d, p, name) = (blk.d, blk.p, &blk.name);
        let out = RowParallel::new(
            g,
            d.tensor,
            (&format!("{name}out"), d.n * d.c),
            Some(acts.res2),
        );
        let name = format!("{name}mlp_proj");
        g.op(
            name.clone(),
            Phase::Forward,
            mm_flops(d, d.h, d.c),
            Op::Matmul {
                inp: acts.fch_gelu,
                out: out.out,
                residual: out.residual,
                w: p.fcproj_w.clone(),
                b: out.bias.then(|| p.fcproj_b.clone()),
                layout: WeightLayout::InOut,
                rows: d.rows,
                ic: d.h,
                oc: d.c,
            },
        );
        out.join(g, &name, Phase::Forward)
    }

    fn backward(g: &mut Builder, blk: &Block, a: &BlockActs, dres: BufId) {
        let (d, p, name, res_in) = (blk.d, blk.p, &blk.name, blk.res_in);
        let (n, c) = (d.n, d.c);
        let mm = |ic: usize, oc: usize| 2 * mm_flops(d, ic, oc);
        let dfch = g.act(format!("{name}d.fc"), Category::ActivationGrad, n * d.h);
        let dln2 = InputGrad::new(g, d.tensor, (&format!("{name}d.ln2"), n * c));
        let datty = g.act(format!("{name}d.attn"), Category::ActivationGrad, n * d.a);
        let dqkv = g.act(
            format!("{name}d.qkv"),
            Category::ActivationGrad,
            3 * n * d.a,
        );
        let dln1 = InputGrad::new(g, d.tensor, (&format!("{name}d.ln1"), n * c));
        let attn_ws = g.f32(
            format!("{name}attn.ws.bwd"),
            Category::Workspace,
            d.attn_ws_len,
        );
        let bwd = Phase::Backward;
        let dout = d.gathered_grad(g, dres, &format!("{name}d.out"));
        g.op(
            format!("{name}mlp_proj.bwd"),
            bwd,
            mm(d.h, c),
            Op::MatmulBackward {
                dinp: dfch,
                dout,
                inp: a.fch_gelu,
                w: p.fcproj_w.clone(),
                b: Some(p.fcproj_b.clone()),
                layout: WeightLayout::InOut,
                rows: d.rows,
                ic: d.h,
                oc: c,
            },
        );
        g.op(
            format!("{name}gelu.bwd"),
            bwd,
            0,
            Op::GeluBackward {
                d: dfch,
                inp: a.fch,
                rows: d.rows,
                width: d.h,
            },
        );
        let ln2 = d.gathered(g, a.ln2, &format!("{name}ln2.bwd"), bwd);
        g.op(
            format!("{name}fc.bwd"),
            bwd,
            mm(c, d.h),
            Op::MatmulBackward {
                dinp: dln2.buf,
                dout: dfch,
                inp: ln2,
                w: p.fc_w.clone(),
                b: Some(p.fc_b.clone()),
                layout: WeightLayout::InOut,
                rows: d.rows,
                ic: c,
                oc: d.h,
            },
        );
        let dln2 = dln2.join(g, &format!("{name}fc.bwd"), bwd);
        g.op(
            format!("{name}ln2.bwd"),
            bwd,
            0,
            Op::LayerNormBackward {
                dinp: dres,
                dout: dln2,
                inp: a.res2,
                mean: a.ln2_mean,
                rstd: a.ln2_rstd,
                w: p.ln2_w.clone(),
                b: p.ln2_b.clone(),
                rows: d.own,
                c,
            },
        );
        let dout = d.gathered_grad(g, dres, &format!("{name}d.res_attn"));
        g.op(
            format!("{name}attn_proj.bwd"),
            bwd,
            mm(d.a, c),
            Op::MatmulBackward {
                dinp: datty,
                dout,
                inp: a.atty,
                w: p.proj_w.clone(),
                b: Some(p.proj_b.clone()),
                layout: WeightLayout::InOut,
                rows: d.rows,
                ic: d.a,
                oc: c,
            },
        );
        g.op(
            format!("{name}attn.bwd"),
            bwd,
            5 * attn_flops(d) / 2,
            Op::AttentionBackward {
                dqkv,
                positions: d.positions,
                dout: datty,
                qkv: a.qkv,
                out: a.atty,
                lse: a.lse,
                ws: attn_ws,
                rows: d.rows,
                nh: d.nh,
                nkv: d.nh,
                hd: d.hd,
                window: None,
                scale_dim: d.hd as f32,
            },
        );
        let ln1 = d.gathered(g, a.ln1, &format!("{name}ln1.bwd"), bwd);
        g.op(
            format!("{name}qkv.bwd"),
            bwd,
            mm(c, 3 * d.a),
            Op::MatmulBackward {
                dinp: dln1.buf,
                dout: dqkv,
                inp: ln1,
                w: p.qkv_w.clone(),
                b: Some(p.qkv_b.clone()),
                layout: WeightLayout::InOut,
                rows: d.rows,
                ic: c,
                oc: 3 * d.a,
            },
        );
        let dln1 = dln1.join(g, &format!("{name}qkv.bwd"), bwd);
        g.op(
            format!("{name}ln1.bwd"),
            bwd,
            0,
            Op::LayerNormBackward {
                dinp: dres,
                dout: dln1,
                inp: res_in,
                mean: a.ln1_mean,
                rstd: a.ln1_rstd,
                w: p.ln1_w.clone(),
                b: p.ln1_b.clone(),
                rows: d.own,
                c,
            },
        );
    }
}

impl Dims {
    /// The rank's rows `x` of an activation of the stream (`[N, C]`) gathered for a
    /// column-parallel layer: `x` itself unless the rows are cut (`{name}.all` then).
    fn gathered(&self, g: &mut Builder, x: BufId, name: &str, phase: Phase) -> BufId {
        let cat = (name, Category::Activation);
        gather_rows(g, self.tensor, (x, self.n * self.c), cat, phase)
    }

    /// The stream's gradient `dres` gathered for a row-parallel layer's backward.
    fn gathered_grad(&self, g: &mut Builder, dres: BufId, name: &str) -> BufId {
        let cat = (name, Category::ActivationGrad);
        gather_rows(
            g,
            self.tensor,
            (dres, self.n * self.c),
            cat,
            Phase::Backward,
        )
    }
}

/// The micro-batch's token and position embedding (`encoder`).
fn embedding<'a>(d: &Dims, p: &Gpt2Params, mb: &'a MicroBatch) -> Embedding<'a> {
    Embedding {
        tokens: mb.tokens,
        positions: d.positions,
        wte: p.wte.clone(),
        wpe: Some(p.wpe.clone()),
        vocab: d.v,
        rows: d.rows,
        c: d.c,
        split: d.tensor,
        scale: 1.0,
        pfx: &mb.prefix,
        op: "encoder",
    }
}

/// Emits the final layernorm, the LM head (with the loss) and their backward of the last
/// stage; returns the head's generation logits, or the residual stream's gradient.
fn head(
    g: &mut Builder,
    (spec, cfg): (&ModelSpec, &EmitOptions),
    (d, p): (&Dims, &Gpt2Params),
    mb: &MicroBatch,
    out: BufId,
) -> Head {
    let (n, c, v, pfx) = (d.own.n(), d.c, spec.vocab_size, mb.prefix.as_str());
    let lnf = g.act(format!("{pfx}lnf"), Category::Activation, n * c);
    let lnf_mean = g.f32(format!("{pfx}lnf.mean"), Category::Activation, n);
    let lnf_rstd = g.f32(format!("{pfx}lnf.rstd"), Category::Activation, n);
    g.op(
        format!("{pfx}ln_f"),
        Phase::Forward,
        0,
        Op::LayerNorm {
            inp: out,
            out: lnf,
            mean: lnf_mean,
            rstd: lnf_rstd,
            w: p.lnf_w.clone(),
            b: p.lnf_b.clone(),
            rows: d.own,
            c,
            eps: d.eps,
        },
    );
    let dlnf = match lm_head::emit(g, cfg, mb, lnf, p.wte.clone(), (c, v), "d.lnf") {
        Head::InputGrad(dlnf) => dlnf,
        logits => return logits,
    };
    let dres = block_emit::residual_grad(g, pfx, n * c);
    g.op(
        format!("{pfx}ln_f.bwd"),
        Phase::Backward,
        0,
        Op::LayerNormBackward {
            dinp: dres,
            dout: dlnf,
            inp: out,
            mean: lnf_mean,
            rstd: lnf_rstd,
            w: p.lnf_w.clone(),
            b: p.lnf_b.clone(),
            rows: d.own,
            c,
        },
    );
    Head::InputGrad(dres)
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
    let nh = split.len(spec.n_head);
    let d = Dims {
        b,
        t,
        c: spec.n_embd,
        h: split.len(spec.mlp_hidden),
        nh,
        hd: spec.head_dim,
        a: nh * spec.head_dim,
        n: b * t,
        rows: mb.rows,
        own: mb.rows.own(split),
        eps: spec.norm_eps,
        attn_ws_len: mb.attn_ws_len,
        positions: mb.positions,
        v: spec.vocab_size,
        tensor: split,
    };
    let (len, pfx) = (d.own.n() * d.c, mb.prefix.as_str());
    let encoded = stage
        .is_first()
        .then(|| embedding(&d, &p, mb).forward(g, "encoded"));
    let layers = (p.layers.as_slice(), p.chunks.as_slice());
    let ends = (len, stage.is_last());
    let runs = block_emit::stage_forward(g, &d, layers, pfx, encoded, ends);
    let dres = match stage.is_last() {
        true => {
            let out = runs.last().expect("a stage holds a run").out();
            match head(g, (spec, cfg), (&d, &p), mb, out) {
                Head::InputGrad(dres) => Some(dres),
                Head::Logits(logits) => {
                    return Emitted {
                        logits: Some(logits),
                    };
                }
            }
        }
        false => None,
    };
    let begins = (len, stage.is_first());
    let dres = block_emit::stage_backward(g, &d, layers, pfx, &runs, cfg.recompute, dres, begins);
    if let Some(dres) = dres.filter(|_| !cfg.frozen_embedding) {
        embedding(&d, &p, mb).backward(g, dres);
    }
    Emitted { logits: None }
}
