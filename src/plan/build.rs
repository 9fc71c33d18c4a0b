//! Builds the plan of one step: declares every buffer, emits the schedule that uses them,
//! derives each buffer's live interval from the schedule, and packs offsets.
//!
//! Shapes: B batch, T sequence, C channels, NH heads, V vocabulary, N = B·T, L layers.

use super::packing;
use super::schedule::{Op, OpEntry, Phase, Schedule};
use super::{BufId, Buffer, Category, DType, Plan};
use crate::backend::cpu::attention::attention_workspace_len;
use crate::model::{ModelSpec, ParamLayout};
use anyhow::{Result, bail};
use serde::Serialize;

/// What the step does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Forward, backward and optimizer step (also runs forward-only evaluation).
    Train,
    /// Forward only with next-token logits of one position (sampling).
    Generate,
}

/// The step's shape and resources.
#[derive(Clone, Debug, Serialize)]
pub struct StepConfig {
    /// Micro-batch size B.
    pub batch: usize,
    /// Sequence length T.
    pub seq: usize,
    /// Worker threads (kernel workspace is sized per thread).
    pub threads: usize,
    /// Upper bound for the LM head's logits chunk (bytes); smaller saves memory, larger
    /// makes fewer passes over wte.
    pub logits_chunk_bytes: u64,
}

impl StepConfig {
    pub fn new(batch: usize, seq: usize, threads: usize) -> StepConfig {
        StepConfig {
            batch,
            seq,
            threads,
            logits_chunk_bytes: 64 << 20,
        }
    }
}

struct Builder {
    buffers: Vec<Buffer>,
    ops: Vec<OpEntry>,
}

impl Builder {
    fn buf(
        &mut self,
        name: impl Into<String>,
        category: Category,
        dtype: DType,
        elems: usize,
    ) -> BufId {
        self.push(name.into(), category, dtype, elems, false)
    }

    /// A (non-persistent) f32 buffer.
    fn f32(&mut self, name: impl Into<String>, category: Category, elems: usize) -> BufId {
        self.buf(name, category, DType::F32, elems)
    }

    fn persistent(&mut self, name: &str, category: Category, dtype: DType, elems: usize) -> BufId {
        self.push(name.into(), category, dtype, elems, true)
    }

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
            bytes: (elems * dtype.size()) as u64,
            persistent,
            first_op: usize::MAX,
            last_op: 0,
            offset: 0,
            external: false,
        });
        BufId(self.buffers.len() - 1)
    }

    fn op(&mut self, name: impl Into<String>, phase: Phase, flops: u64, op: Op) {
        self.ops.push(OpEntry {
            name: name.into(),
            phase,
            op,
            flops,
        });
    }
}

/// Per-layer activation buffers kept from forward to backward.
struct LayerActs {
    ln1: BufId,      // [N, C]
    ln1_mean: BufId, // [N]
    ln1_rstd: BufId, // [N]
    qkv: BufId,      // [N, 3C]
    atty: BufId,     // [N, C]
    lse: BufId,      // [B, NH, T]
    res2: BufId,     // [N, C] residual after attention
    ln2: BufId,      // [N, C]
    ln2_mean: BufId, // [N]
    ln2_rstd: BufId, // [N]
    fch: BufId,      // [N, 4C]
    fch_gelu: BufId, // [N, 4C]
}

/// Builds and packs the plan for `spec` and `cfg`.
pub fn build_plan(spec: &ModelSpec, cfg: &StepConfig, mode: Mode) -> Result<Plan> {
    spec.validate()?;
    spec.check_seq(cfg.seq)?;
    if cfg.batch == 0 {
        bail!("--batch must be at least 1");
    }
    if cfg.threads == 0 {
        bail!("--threads must be at least 1");
    }
    let layout = ParamLayout::new(spec);
    let (b, t, c, nh, v) = (
        cfg.batch,
        cfg.seq,
        spec.n_embd,
        spec.n_head,
        spec.vocab_size,
    );
    let n = b * t;
    let (nu, cu, vu) = (n as u64, c as u64, v as u64);
    let train = mode == Mode::Train;
    let mut g = Builder {
        buffers: Vec::new(),
        ops: Vec::new(),
    };

    // Persistent state: parameters, gradients, AdamW moments, the token batch.
    let params = g.persistent("params", Category::Param, DType::F32, layout.total);
    let (grads, adam_m, adam_v) = if train {
        (
            Some(g.persistent("grads", Category::Grad, DType::F32, layout.total)),
            Some(g.persistent(
                "adamw.m",
                Category::OptimizerState,
                DType::F32,
                layout.total,
            )),
            Some(g.persistent(
                "adamw.v",
                Category::OptimizerState,
                DType::F32,
                layout.total,
            )),
        )
    } else {
        (None, None, None)
    };
    let tokens = g.persistent("tokens", Category::IoStaging, DType::U32, n); // [B, T]
    let targets = train.then(|| g.persistent("targets", Category::IoStaging, DType::U32, n)); // [B, T]

    let attn_ws_len = attention_workspace_len(t, c / nh, cfg.threads);
    let lw = &layout.layers;

    // ---- forward ----
    if let Some(gr) = grads {
        g.op("zero_grad", Phase::Forward, 0, Op::Zero { buf: gr });
    }
    let mut res = g.f32("encoded", Category::Activation, n * c); // [N, C]
    g.op(
        "encoder",
        Phase::Forward,
        0,
        Op::Encoder { tokens, out: res },
    );
    let mut residuals = vec![res]; // residual stream entering each layer, then the final one
    let mut acts: Vec<LayerActs> = Vec::with_capacity(spec.n_layer);
    for (l, p) in lw.iter().enumerate() {
        let a = LayerActs {
            ln1: g.f32(format!("h{l}.ln1"), Category::Activation, n * c),
            ln1_mean: g.f32(format!("h{l}.ln1.mean"), Category::Activation, n),
            ln1_rstd: g.f32(format!("h{l}.ln1.rstd"), Category::Activation, n),
            qkv: g.f32(format!("h{l}.qkv"), Category::Activation, 3 * n * c),
            atty: g.f32(format!("h{l}.attn"), Category::Activation, n * c),
            lse: g.f32(format!("h{l}.attn.lse"), Category::Activation, b * nh * t),
            res2: g.f32(format!("h{l}.res_attn"), Category::Activation, n * c),
            ln2: g.f32(format!("h{l}.ln2"), Category::Activation, n * c),
            ln2_mean: g.f32(format!("h{l}.ln2.mean"), Category::Activation, n),
            ln2_rstd: g.f32(format!("h{l}.ln2.rstd"), Category::Activation, n),
            fch: g.f32(format!("h{l}.fc"), Category::Activation, 4 * n * c),
            fch_gelu: g.f32(format!("h{l}.fc.gelu"), Category::Activation, 4 * n * c),
        };
        let attn_ws = g.f32(format!("h{l}.attn.ws"), Category::Workspace, attn_ws_len);
        let out = g.f32(format!("h{l}.out"), Category::Activation, n * c);
        let mm = |ic: u64, oc: u64| 2 * nu * ic * oc;
        let attn_flops = 2 * (b * nh * t * t * (c / nh)) as u64; // causal: half of 4·B·NH·T²·hs
        g.op(
            format!("h{l}.ln1"),
            Phase::Forward,
            0,
            Op::LayerNorm {
                inp: res,
                out: a.ln1,
                mean: a.ln1_mean,
                rstd: a.ln1_rstd,
                w: p.ln1_w.clone(),
                b: p.ln1_b.clone(),
            },
        );
        g.op(
            format!("h{l}.qkv"),
            Phase::Forward,
            mm(cu, 3 * cu),
            Op::Matmul {
                inp: a.ln1,
                out: a.qkv,
                residual: None,
                w: p.qkv_w.clone(),
                b: p.qkv_b.clone(),
                ic: c,
                oc: 3 * c,
            },
        );
        g.op(
            format!("h{l}.attn"),
            Phase::Forward,
            attn_flops,
            Op::Attention {
                qkv: a.qkv,
                out: a.atty,
                lse: a.lse,
                ws: attn_ws,
            },
        );
        g.op(
            format!("h{l}.attn_proj"),
            Phase::Forward,
            mm(cu, cu),
            Op::Matmul {
                inp: a.atty,
                out: a.res2,
                residual: Some(res),
                w: p.proj_w.clone(),
                b: p.proj_b.clone(),
                ic: c,
                oc: c,
            },
        );
        g.op(
            format!("h{l}.ln2"),
            Phase::Forward,
            0,
            Op::LayerNorm {
                inp: a.res2,
                out: a.ln2,
                mean: a.ln2_mean,
                rstd: a.ln2_rstd,
                w: p.ln2_w.clone(),
                b: p.ln2_b.clone(),
            },
        );
        g.op(
            format!("h{l}.fc"),
            Phase::Forward,
            mm(cu, 4 * cu),
            Op::Matmul {
                inp: a.ln2,
                out: a.fch,
                residual: None,
                w: p.fc_w.clone(),
                b: p.fc_b.clone(),
                ic: c,
                oc: 4 * c,
            },
        );
        g.op(
            format!("h{l}.gelu"),
            Phase::Forward,
            0,
            Op::Gelu {
                inp: a.fch,
                out: a.fch_gelu,
            },
        );
        g.op(
            format!("h{l}.mlp_proj"),
            Phase::Forward,
            mm(4 * cu, cu),
            Op::Matmul {
                inp: a.fch_gelu,
                out,
                residual: Some(a.res2),
                w: p.fcproj_w.clone(),
                b: p.fcproj_b.clone(),
                ic: 4 * c,
                oc: c,
            },
        );
        res = out;
        residuals.push(res);
        acts.push(a);
    }
    let lnf = g.f32("lnf", Category::Activation, n * c);
    let lnf_mean = g.f32("lnf.mean", Category::Activation, n);
    let lnf_rstd = g.f32("lnf.rstd", Category::Activation, n);
    g.op(
        "ln_f",
        Phase::Forward,
        0,
        Op::LayerNorm {
            inp: res,
            out: lnf,
            mean: lnf_mean,
            rstd: lnf_rstd,
            w: layout.lnf_w.clone(),
            b: layout.lnf_b.clone(),
        },
    );

    if !train {
        let logits = g.f32("logits", Category::Workspace, v); // [V]
        g.op(
            "lm_head",
            Phase::Forward,
            2 * cu * vu,
            Op::LmHeadLast { inp: lnf, logits },
        );
        let io = Io {
            tokens,
            targets: None,
            losses: None,
            logits: Some(logits),
        };
        return finish(spec, cfg, mode, layout, g, params, None, None, None, io);
    }

    // ---- LM head + loss (forward and its backward, chunked) ----
    let row_bytes = (v * 4) as u64;
    let n_chunks = (nu * row_bytes)
        .div_ceil(cfg.logits_chunk_bytes.max(row_bytes))
        .max(1);
    let rows_per_chunk = n.div_ceil(n_chunks as usize);
    let logits = g.f32("logits.chunk", Category::Workspace, rows_per_chunk * v); // [rows, V]
    let losses = g.f32("losses", Category::Activation, n); // [N]
    let dlnf = g.f32("d.lnf", Category::ActivationGrad, n * c); // [N, C]
    let targets = targets.expect("training plans have targets");
    g.op(
        "lm_head+loss",
        Phase::Forward,
        6 * nu * cu * vu,
        Op::LmHeadLoss {
            inp: lnf,
            targets,
            losses,
            logits,
            dinp: Some(dlnf),
            rows_per_chunk,
            loss_rows: n,
        },
    );

    // ---- backward ----
    let dres = g.f32("d.residual", Category::ActivationGrad, n * c); // [N, C]
    g.op(
        "zero d.residual",
        Phase::Backward,
        0,
        Op::Zero { buf: dres },
    );
    g.op(
        "ln_f.bwd",
        Phase::Backward,
        0,
        Op::LayerNormBackward {
            dinp: dres,
            dout: dlnf,
            inp: res,
            mean: lnf_mean,
            rstd: lnf_rstd,
            w: layout.lnf_w.clone(),
            b: layout.lnf_b.clone(),
        },
    );
    for l in (0..spec.n_layer).rev() {
        let (a, p) = (&acts[l], &lw[l]);
        let mm = |ic: u64, oc: u64| 4 * nu * ic * oc;
        let dfch = g.f32(format!("h{l}.d.fc"), Category::ActivationGrad, 4 * n * c);
        let dln2 = g.f32(format!("h{l}.d.ln2"), Category::ActivationGrad, n * c);
        let datty = g.f32(format!("h{l}.d.attn"), Category::ActivationGrad, n * c);
        let dqkv = g.f32(format!("h{l}.d.qkv"), Category::ActivationGrad, 3 * n * c);
        let dln1 = g.f32(format!("h{l}.d.ln1"), Category::ActivationGrad, n * c);
        let attn_ws = g.f32(
            format!("h{l}.attn.ws.bwd"),
            Category::Workspace,
            attn_ws_len,
        );
        let attn_flops = 5 * (b * nh * t * t * (c / nh)) as u64;
        g.op(
            format!("h{l}.mlp_proj.bwd"),
            Phase::Backward,
            mm(4 * cu, cu),
            Op::MatmulBackward {
                dinp: dfch,
                dout: dres,
                inp: a.fch_gelu,
                w: p.fcproj_w.clone(),
                b: p.fcproj_b.clone(),
                ic: 4 * c,
                oc: c,
            },
        );
        g.op(
            format!("h{l}.gelu.bwd"),
            Phase::Backward,
            0,
            Op::GeluBackward {
                d: dfch,
                inp: a.fch,
            },
        );
        g.op(
            format!("h{l}.fc.bwd"),
            Phase::Backward,
            mm(cu, 4 * cu),
            Op::MatmulBackward {
                dinp: dln2,
                dout: dfch,
                inp: a.ln2,
                w: p.fc_w.clone(),
                b: p.fc_b.clone(),
                ic: c,
                oc: 4 * c,
            },
        );
        g.op(
            format!("h{l}.ln2.bwd"),
            Phase::Backward,
            0,
            Op::LayerNormBackward {
                dinp: dres,
                dout: dln2,
                inp: a.res2,
                mean: a.ln2_mean,
                rstd: a.ln2_rstd,
                w: p.ln2_w.clone(),
                b: p.ln2_b.clone(),
            },
        );
        g.op(
            format!("h{l}.attn_proj.bwd"),
            Phase::Backward,
            mm(cu, cu),
            Op::MatmulBackward {
                dinp: datty,
                dout: dres,
                inp: a.atty,
                w: p.proj_w.clone(),
                b: p.proj_b.clone(),
                ic: c,
                oc: c,
            },
        );
        g.op(
            format!("h{l}.attn.bwd"),
            Phase::Backward,
            attn_flops,
            Op::AttentionBackward {
                dqkv,
                dout: datty,
                qkv: a.qkv,
                out: a.atty,
                lse: a.lse,
                ws: attn_ws,
            },
        );
        g.op(
            format!("h{l}.qkv.bwd"),
            Phase::Backward,
            mm(cu, 3 * cu),
            Op::MatmulBackward {
                dinp: dln1,
                dout: dqkv,
                inp: a.ln1,
                w: p.qkv_w.clone(),
                b: p.qkv_b.clone(),
                ic: c,
                oc: 3 * c,
            },
        );
        g.op(
            format!("h{l}.ln1.bwd"),
            Phase::Backward,
            0,
            Op::LayerNormBackward {
                dinp: dres,
                dout: dln1,
                inp: residuals[l],
                mean: a.ln1_mean,
                rstd: a.ln1_rstd,
                w: p.ln1_w.clone(),
                b: p.ln1_b.clone(),
            },
        );
    }
    g.op(
        "encoder.bwd",
        Phase::Backward,
        0,
        Op::EncoderBackward { dout: dres, tokens },
    );
    g.op("adamw", Phase::Optimizer, 0, Op::OptimizerStep);
    let io = Io {
        tokens,
        targets: Some(targets),
        losses: Some(losses),
        logits: None,
    };
    finish(
        spec, cfg, mode, layout, g, params, grads, adam_m, adam_v, io,
    )
}

/// The buffers the executor reads and writes from outside the schedule.
struct Io {
    tokens: BufId,
    targets: Option<BufId>,
    losses: Option<BufId>,
    logits: Option<BufId>,
}

#[allow(clippy::too_many_arguments)]
fn finish(
    spec: &ModelSpec,
    cfg: &StepConfig,
    mode: Mode,
    layout: ParamLayout,
    mut g: Builder,
    params: BufId,
    grads: Option<BufId>,
    adam_m: Option<BufId>,
    adam_v: Option<BufId>,
    io: Io,
) -> Result<Plan> {
    // Buffers outside the arena: the loader's two prefetch buffers and the trainer's batch
    // buffer ([B, T+1] u32 each), and the packing scratch the `gemm` crate keeps for itself.
    if mode == Mode::Train {
        let id = g.persistent(
            "loader.staging",
            Category::IoStaging,
            DType::U32,
            3 * cfg.batch * (cfg.seq + 1),
        );
        g.buffers[id.0].external = true;
    }
    let id = g.persistent(
        "gemm.packing",
        Category::Workspace,
        DType::F32,
        (gemm_packing_bytes(cfg.threads) / 4) as usize,
    );
    g.buffers[id.0].external = true;

    // Live intervals from the schedule.
    let n_ops = g.ops.len();
    for (i, e) in g.ops.iter().enumerate() {
        let (r, w) = e.op.reads_writes();
        for id in r.into_iter().chain(w) {
            let buf = &mut g.buffers[id.0];
            buf.first_op = buf.first_op.min(i);
            buf.last_op = buf.last_op.max(i);
        }
    }
    for buf in &mut g.buffers {
        if buf.persistent {
            buf.first_op = 0;
            buf.last_op = n_ops - 1;
        }
        if buf.first_op == usize::MAX {
            bail!("internal error: plan buffer {} is never used", buf.name);
        }
    }
    let arena_bytes = packing::pack(&mut g.buffers);
    packing::verify(&g.buffers)
        .map_err(|e| anyhow::anyhow!("internal error: invalid packing: {e}"))?;
    let external_bytes: u64 = g
        .buffers
        .iter()
        .filter(|b| b.external)
        .map(|b| b.bytes)
        .sum();
    let internal: Vec<Buffer> = g.buffers.iter().filter(|b| !b.external).cloned().collect();
    let (peak_live_bytes, peak_op) = packing::peak_live(&internal, n_ops);
    let plan = Plan {
        spec: spec.clone(),
        layout,
        cfg: cfg.clone(),
        mode,
        schedule: Schedule {
            ops: g.ops,
            params,
            grads,
            adam_m,
            adam_v,
            tokens: io.tokens,
            targets: io.targets,
            losses: io.losses,
            logits: io.logits,
        },
        buffers: g.buffers,
        arena_bytes,
        peak_live_bytes,
        peak_op,
        external_bytes,
    };
    verify_ops(&plan)?;
    Ok(plan)
}

/// Upper bound of the packing scratch the `gemm` crate allocates for itself: one packed
/// right-hand panel of kc × n_block f32 per call (`backend::cpu::matmul` splits every GEMM
/// into column blocks so that this stays below `GEMM_PACK_BYTES`; executor calls are serial,
/// and attention's per-worker calls pack panels of T × hs, far smaller), plus one L2-sized
/// slab per thread (main thread included). The L2 size is read from sysfs as `gemm` does.
pub fn gemm_packing_bytes(threads: usize) -> u64 {
    let l2 = (0..8)
        .find_map(|i| {
            let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
            let lvl: u32 = std::fs::read_to_string(format!("{dir}/level"))
                .ok()?
                .trim()
                .parse()
                .ok()?;
            if lvl != 2 {
                return None;
            }
            let s = std::fs::read_to_string(format!("{dir}/size")).ok()?;
            crate::util::bytes::parse_bytes(s.trim()).ok()
        })
        .unwrap_or(1 << 20);
    crate::backend::cpu::matmul::GEMM_PACK_BYTES + (threads as u64 + 1) * l2
}

/// Checks that no op writes a buffer whose bytes overlap another buffer the same op touches
/// (the executor relies on this to hand out `&mut` and `&` views of one arena).
fn verify_ops(plan: &Plan) -> Result<()> {
    for e in &plan.schedule.ops {
        let (r, w) = e.op.reads_writes();
        for wid in &w {
            for other in r.iter().chain(w.iter()) {
                if other == wid {
                    continue;
                }
                let (a, o) = (plan.buffer(*wid), plan.buffer(*other));
                if a.overlaps_in_memory(o) {
                    bail!(
                        "internal error: op {} writes {} which overlaps {}",
                        e.name,
                        a.name,
                        o.name
                    );
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_plan_is_valid_and_packs_tightly() {
        let spec = ModelSpec::preset("gpt2").unwrap();
        let plan = build_plan(&spec, &StepConfig::new(4, 256, 2), Mode::Train).unwrap();
        let p = 124_439_808u64 * 4;
        let by = plan.bytes_by_category();
        let get = |c: Category| by.iter().find(|x| x.0 == c).unwrap().1;
        assert_eq!(get(Category::Param), p);
        assert_eq!(get(Category::Grad), p);
        assert_eq!(get(Category::OptimizerState), 2 * p);
        // Packing reuses backward scratch: the arena is far below the sum of all buffers, and
        // within 2% of the lower bound.
        let sum: u64 = plan.buffers.iter().map(|b| b.bytes).sum();
        assert!(plan.arena_bytes < sum);
        assert!(
            plan.arena_bytes as f64 <= plan.peak_live_bytes as f64 * 1.02,
            "{} vs {}",
            plan.arena_bytes,
            plan.peak_live_bytes
        );
    }

    #[test]
    fn generate_plan_has_no_training_state() {
        let spec = ModelSpec::preset("gpt2-tiny").unwrap();
        let plan = build_plan(&spec, &StepConfig::new(1, 64, 2), Mode::Generate).unwrap();
        assert!(
            plan.buffers
                .iter()
                .all(|b| !matches!(b.category, Category::Grad | Category::OptimizerState))
        );
    }

    #[test]
    fn bad_step_configs_name_the_flag() {
        let spec = ModelSpec::preset("gpt2-tiny").unwrap();
        let e =
            |cfg: StepConfig| format!("{:#}", build_plan(&spec, &cfg, Mode::Train).unwrap_err());
        assert!(e(StepConfig::new(0, 64, 2)).contains("--batch"));
        assert!(e(StepConfig::new(1, 1000, 2)).contains("--seq"));
        assert!(e(StepConfig::new(1, 64, 0)).contains("--threads"));
    }
}
