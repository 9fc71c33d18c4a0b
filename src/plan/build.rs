//! Builds the plan of one step: declares every buffer, emits the schedule that uses them,
//! derives each buffer's live interval from the schedule, and packs offsets.
//!
//! Shapes: B batch, T sequence, C channels, NH heads, V vocabulary, N = B·T, L layers.

use super::block::{self, Block, BlockActs};
use super::packing;
use super::schedule::OptimBufs;
use super::schedule::{Op, OpEntry, Phase, Schedule};
use super::strategy::{OptimState, Precision, Recompute};
use super::{BufId, Buffer, Category, DType, Plan};
use crate::backend::cpu::attention::attention_workspace_len;
use crate::backend::cpu::gemm::mixed::gemm_mixed_workspace_len;
use crate::backend::cpu::quant::QBLOCK;
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
    /// Activation recomputation policy.
    pub recompute: Recompute,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub grad_accum: usize,
    /// Storage of the AdamW moments.
    pub optim_state: OptimState,
    /// Format of compute weights, activations and gradients.
    pub precision: Precision,
}

impl StepConfig {
    pub fn new(batch: usize, seq: usize, threads: usize) -> StepConfig {
        StepConfig {
            batch,
            seq,
            threads,
            logits_chunk_bytes: 64 << 20,
            recompute: Recompute::None,
            grad_accum: 1,
            optim_state: OptimState::F32,
            precision: Precision::F32,
        }
    }
}

pub(super) struct Builder {
    buffers: Vec<Buffer>,
    ops: Vec<OpEntry>,
    /// Element type of activations, compute weights and gradients.
    storage: DType,
}

impl Builder {
    /// A (non-persistent) buffer in the plan's storage type (activations and their grads).
    pub(super) fn act(
        &mut self,
        name: impl Into<String>,
        category: Category,
        elems: usize,
    ) -> BufId {
        let dt = self.storage;
        self.buf(name, category, dt, elems)
    }

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
    pub(super) fn f32(
        &mut self,
        name: impl Into<String>,
        category: Category,
        elems: usize,
    ) -> BufId {
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

    pub(super) fn op(&mut self, name: impl Into<String>, phase: Phase, flops: u64, op: Op) {
        self.ops.push(OpEntry {
            name: name.into(),
            phase,
            op,
            flops,
        });
    }
}

/// Dimensions of one micro-batch, shared by the block emitters.
pub(super) struct Dims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    /// Rows per micro-batch, B·T.
    pub n: usize,
    /// Attention workspace elements (forward or backward).
    pub attn_ws_len: usize,
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
    if cfg.grad_accum == 0 {
        bail!("--grad-accum must be at least 1 (micro-batches per optimizer step)");
    }
    let layout = ParamLayout::new(spec);
    let (b, t, c, nh) = (cfg.batch, cfg.seq, spec.n_embd, spec.n_head);
    let d = Dims {
        b,
        t,
        c,
        nh,
        n: b * t,
        attn_ws_len: match cfg.precision {
            Precision::F32 => attention_workspace_len::<f32>(t, c / nh, cfg.threads),
            Precision::Bf16 => attention_workspace_len::<half::bf16>(t, c / nh, cfg.threads),
            Precision::F16 => attention_workspace_len::<half::f16>(t, c / nh, cfg.threads),
        },
    };
    let train = mode == Mode::Train;
    if mode == Mode::Generate && cfg.precision != Precision::F32 {
        bail!("internal error: generation plans run in fp32");
    }
    let storage = cfg.precision.storage();
    let mut g = Builder {
        buffers: Vec::new(),
        ops: Vec::new(),
        storage,
    };

    // Persistent state: the fp32 parameters (the master weights under mixed precision, which
    // kernels read directly, converting per tile: no reduced-precision copy is stored), the
    // mixed-precision GEMM workspace, gradients, AdamW moments.
    let mixed = cfg.precision != Precision::F32;
    let params = if mixed {
        g.persistent("params.master", Category::Master, DType::F32, layout.total)
    } else {
        g.persistent("params", Category::Param, DType::F32, layout.total)
    };
    let gemm_ws = mixed.then(|| {
        g.persistent(
            "gemm.mixed_tiles",
            Category::Workspace,
            DType::F32,
            gemm_mixed_workspace_len(),
        )
    });
    if !train {
        let tokens = g.persistent("tokens", Category::IoStaging, DType::U32, d.n); // [B, T]
        let fwd = forward(&mut g, &d, spec, &layout, "", tokens);
        let logits = g.f32("logits", Category::Workspace, spec.vocab_size); // [V]
        g.op(
            "lm_head",
            Phase::Forward,
            2 * (c * spec.vocab_size) as u64,
            Op::LmHeadLast {
                inp: fwd.lnf,
                logits,
            },
        );
        let io = Io {
            tokens: vec![tokens],
            targets: vec![],
            losses: vec![],
            logits: Some(logits),
        };
        let p = Persistent {
            params,
            gemm_ws,
            grads: None,
            optim: None,
        };
        return finish(spec, cfg, mode, layout, g, p, io);
    }
    let grads = g.persistent("grads", Category::Grad, storage, layout.total);
    let optim = optimizer_state(&mut g, &layout, cfg.optim_state);
    g.op("zero_grad", Phase::Forward, 0, Op::Zero { buf: grads });
    let micro = cfg.grad_accum;
    let mut io = Io {
        tokens: vec![],
        targets: vec![],
        losses: vec![],
        logits: None,
    };
    for k in 0..micro {
        // Micro-batch k: its own batch buffers and activations (packing reuses the bytes of
        // micro-batch k-1's, whose lifetimes have ended); gradients accumulate.
        let pfx = if micro > 1 {
            format!("mb{k}.")
        } else {
            String::new()
        };
        let io_buf = |g: &mut Builder, what: &str, dtype| {
            g.persistent(&format!("{pfx}{what}"), Category::IoStaging, dtype, d.n)
        };
        let tokens = io_buf(&mut g, "tokens", DType::U32); // [B, T]
        let targets = io_buf(&mut g, "targets", DType::U32); // [B, T]
        let losses = io_buf(&mut g, "losses", DType::F32); // [N]
        micro_batch(
            &mut g, &d, spec, cfg, &layout, &pfx, tokens, targets, losses,
        );
        io.tokens.push(tokens);
        io.targets.push(targets);
        io.losses.push(losses);
    }
    g.op("adamw", Phase::Optimizer, 0, Op::OptimizerStep);
    let p = Persistent {
        params,
        gemm_ws,
        grads: Some(grads),
        optim: Some(optim),
    };
    finish(spec, cfg, mode, layout, g, p, io)
}

/// The persistent buffers every op may touch implicitly.
struct Persistent {
    params: BufId,
    gemm_ws: Option<BufId>,
    grads: Option<BufId>,
    optim: Option<OptimBufs>,
}

/// Declares the AdamW moments in `format` (see [`OptimBufs`]).
fn optimizer_state(g: &mut Builder, layout: &ParamLayout, format: OptimState) -> OptimBufs {
    let st = |g: &mut Builder, name: &str, dtype, elems| {
        g.persistent(name, Category::OptimizerState, dtype, elems)
    };
    let p = layout.total;
    match format {
        OptimState::F32 | OptimState::Bf16 => {
            let dt = if format == OptimState::F32 {
                DType::F32
            } else {
                DType::Bf16
            };
            OptimBufs {
                format,
                m: st(g, "adamw.m", dt, p),
                v: st(g, "adamw.v", dt, p),
                m_scale: None,
                v_scale: None,
            }
        }
        OptimState::Int8 => {
            let (_, blocks) = layout.block_offsets(QBLOCK);
            OptimBufs {
                format,
                m: st(g, "adamw.m.q", DType::I8, p),
                v: st(g, "adamw.v.q", DType::U8, p),
                m_scale: Some(st(g, "adamw.m.absmax", DType::F32, blocks)),
                v_scale: Some(st(g, "adamw.v.absmax", DType::F32, blocks)),
            }
        }
    }
}

/// What the forward leaves for the LM head and the backward.
struct Forward {
    /// Residual stream entering each block, then the final one.
    residuals: Vec<BufId>,
    acts: Vec<BlockActs>,
    lnf: BufId,      // [N, C]
    lnf_mean: BufId, // [N]
    lnf_rstd: BufId, // [N]
}

/// Emits the encoder, the blocks and the final layernorm of one micro-batch.
fn forward(
    g: &mut Builder,
    d: &Dims,
    spec: &ModelSpec,
    layout: &ParamLayout,
    pfx: &str,
    tokens: BufId,
) -> Forward {
    let (n, c) = (d.n, d.c);
    let mut res = g.act(format!("{pfx}encoded"), Category::Activation, n * c); // [N, C]
    g.op(
        format!("{pfx}encoder"),
        Phase::Forward,
        0,
        Op::Encoder { tokens, out: res },
    );
    let mut residuals = vec![res];
    let mut acts = Vec::with_capacity(spec.n_layer);
    for (l, p) in layout.layers.iter().enumerate() {
        let blk = Block {
            d,
            p,
            name: format!("{pfx}h{l}."),
            res_in: res,
        };
        let (a, out) = block::forward(g, &blk);
        res = out;
        residuals.push(res);
        acts.push(a);
    }
    let lnf = g.act(format!("{pfx}lnf"), Category::Activation, n * c);
    let lnf_mean = g.f32(format!("{pfx}lnf.mean"), Category::Activation, n);
    let lnf_rstd = g.f32(format!("{pfx}lnf.rstd"), Category::Activation, n);
    g.op(
        format!("{pfx}ln_f"),
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
    Forward {
        residuals,
        acts,
        lnf,
        lnf_mean,
        lnf_rstd,
    }
}

/// Emits one micro-batch's forward, LM head and loss, and backward (gradients accumulate).
#[allow(clippy::too_many_arguments)]
fn micro_batch(
    g: &mut Builder,
    d: &Dims,
    spec: &ModelSpec,
    cfg: &StepConfig,
    layout: &ParamLayout,
    pfx: &str,
    tokens: BufId,
    targets: BufId,
    losses: BufId,
) {
    let (n, c, v) = (d.n, d.c, spec.vocab_size);
    let fwd = forward(g, d, spec, layout, pfx, tokens);

    // ---- LM head + loss (forward and its backward, chunked) ----
    let row_bytes = (v * 4) as u64;
    let n_chunks = ((n as u64) * row_bytes)
        .div_ceil(cfg.logits_chunk_bytes.max(row_bytes))
        .max(1);
    let rows_per_chunk = n.div_ceil(n_chunks as usize);
    let logits = g.f32(
        format!("{pfx}logits.chunk"),
        Category::Workspace,
        rows_per_chunk * v,
    ); // [rows, V]
    let dlnf = g.act(format!("{pfx}d.lnf"), Category::ActivationGrad, n * c); // [N, C]
    g.op(
        format!("{pfx}lm_head+loss"),
        Phase::Forward,
        6 * (n * c * v) as u64,
        Op::LmHeadLoss {
            inp: fwd.lnf,
            targets,
            losses,
            logits,
            dinp: Some(dlnf),
            rows_per_chunk,
            // The step's loss is the mean over every micro-batch's rows.
            loss_rows: n * cfg.grad_accum,
        },
    );

    // ---- backward ----
    let dres = g.act(format!("{pfx}d.residual"), Category::ActivationGrad, n * c); // [N, C]
    g.op(
        format!("{pfx}zero d.residual"),
        Phase::Backward,
        0,
        Op::Zero { buf: dres },
    );
    let res_final = *fwd.residuals.last().expect("residuals");
    g.op(
        format!("{pfx}ln_f.bwd"),
        Phase::Backward,
        0,
        Op::LayerNormBackward {
            dinp: dres,
            dout: dlnf,
            inp: res_final,
            mean: fwd.lnf_mean,
            rstd: fwd.lnf_rstd,
            w: layout.lnf_w.clone(),
            b: layout.lnf_b.clone(),
        },
    );
    for l in (0..spec.n_layer).rev() {
        let blk = Block {
            d,
            p: &layout.layers[l],
            name: format!("{pfx}h{l}."),
            res_in: fwd.residuals[l],
        };
        let acts = block::recompute(g, &blk, &fwd.acts[l], cfg.recompute.block(l));
        block::backward(g, &blk, &acts, dres);
    }
    g.op(
        format!("{pfx}encoder.bwd"),
        Phase::Backward,
        0,
        Op::EncoderBackward { dout: dres, tokens },
    );
}

/// The buffers the executor reads and writes from outside the schedule.
struct Io {
    tokens: Vec<BufId>,
    targets: Vec<BufId>,
    losses: Vec<BufId>,
    logits: Option<BufId>,
}

#[allow(clippy::too_many_arguments)]
fn finish(
    spec: &ModelSpec,
    cfg: &StepConfig,
    mode: Mode,
    layout: ParamLayout,
    mut g: Builder,
    p: Persistent,
    io: Io,
) -> Result<Plan> {
    // Buffers outside the arena: the loader's two prefetch buffers and the trainer's batch
    // buffer ([accum·B, T+1] u32 each), and the packing scratch the `gemm` crate keeps for itself.
    if mode == Mode::Train {
        let id = g.persistent(
            "loader.staging",
            Category::IoStaging,
            DType::U32,
            3 * cfg.grad_accum * cfg.batch * (cfg.seq + 1),
        );
        g.buffers[id.0].external = true;
    }
    let panel = g
        .ops
        .iter()
        .map(|e| gemm_panel_bytes(&e.op, spec, cfg))
        .max()
        .unwrap_or(0);
    let id = g.persistent(
        "gemm.packing",
        Category::Workspace,
        DType::F32,
        (gemm_packing_bytes(cfg.threads, panel) / 4) as usize,
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
            params: p.params,
            gemm_ws: p.gemm_ws,
            grads: p.grads,
            optim: p.optim,
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

/// The largest packing panel the GEMMs of `op` make `gemm` allocate
/// (`backend::cpu::gemm::f32::packing_bytes` of each call's rows and depth).
fn gemm_panel_bytes(op: &Op, spec: &ModelSpec, cfg: &StepConfig) -> u64 {
    use crate::backend::cpu::gemm::f32::packing_bytes;
    let (n, c, v) = (cfg.batch * cfg.seq, spec.n_embd, spec.vocab_size);
    match op {
        Op::Matmul { ic, .. } => packing_bytes(n, *ic),
        // dinp = dout @ wᵀ (n rows, depth oc); dw += inpᵀ @ dout (ic rows, depth n).
        Op::MatmulBackward { ic, oc, .. } => packing_bytes(n, *oc).max(packing_bytes(*ic, n)),
        // logits = x @ wteᵀ, dx = dlogits @ wte, dwte += dlogitsᵀ @ x, per chunk of r rows.
        Op::LmHeadLoss { rows_per_chunk, .. } => {
            let r = *rows_per_chunk;
            packing_bytes(r, c)
                .max(packing_bytes(r, v))
                .max(packing_bytes(v, r))
        }
        Op::LmHeadLast { .. } => packing_bytes(1, c),
        _ => 0,
    }
}

/// Upper bound of the packing scratch the `gemm` crate allocates for itself: the largest
/// packed panel of any call (`panel`; executor calls are serial, and attention's per-worker
/// calls pack panels of T × hs, far smaller), plus one L2-sized slab per thread (main thread
/// included). The L2 size is read from sysfs as `gemm` does.
pub fn gemm_packing_bytes(threads: usize, panel: u64) -> u64 {
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
    panel + (threads as u64 + 1) * l2
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
