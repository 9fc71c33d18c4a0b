//! Builds the plan of one step: declares every buffer, emits the schedule that uses them,
//! derives each buffer's live interval from the schedule, and packs offsets.
//!
//! Shapes: B batch, T sequence, C channels, NH heads, V vocabulary, N = B·T, L layers.

use super::builder::{Builder, Loss, MicroBatch};
use super::packing;
use super::schedule::{
    GradBufs, GradSegment, ImplicitBufs, Op, OpEntry, OptimBufs, ParamSlice, Phase, Rows, Schedule,
};
use super::strategy::{OptimState, Precision, QBLOCK, Recompute};
use super::{BufId, Buffer, Category, DType, Offload, Placement, Plan, Tier};
use crate::backend::Sizing;
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
    /// What lives on the disk tier, and where its file is.
    pub offload: Offload,
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
            offload: Offload::default(),
        }
    }
}

/// Builds and packs the plan for `spec` and `cfg`, with workspace sized by `backend`.
pub fn build_plan(
    spec: &ModelSpec,
    cfg: &StepConfig,
    mode: Mode,
    backend: &dyn Sizing,
) -> Result<Plan> {
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
    if mode == Mode::Generate && cfg.precision != Precision::F32 {
        bail!("internal error: generation plans run in fp32");
    }
    let layout = ParamLayout::new(spec);
    let rows = Rows {
        b: cfg.batch,
        t: cfg.seq,
    };
    let n = rows.n();
    let storage = cfg.precision.storage();
    let attn_ws_len =
        backend.attention_workspace_elems(storage, cfg.seq, spec.head_size(), cfg.threads);
    let mut g = Builder::new(storage);

    // Persistent state: the fp32 parameters (the master weights under mixed precision, which
    // kernels read directly, converting per tile: no reduced-precision copy is stored), the
    // mixed-precision GEMM workspace, AdamW moments. Gradients are per parameter group and
    // live from the group's first backward write to its update (`grad_buffers`).
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
            backend.mixed_gemm_workspace_elems(),
        )
    });
    if mode == Mode::Generate {
        let tokens = g.persistent("tokens", Category::IoStaging, DType::U32, n); // [B, T]
        let mb = MicroBatch {
            prefix: String::new(),
            tokens,
            loss: None,
            rows,
            attn_ws_len,
        };
        let emitted = spec.family.emit(&mut g, spec, cfg, &mb);
        let io = Io {
            tokens: vec![tokens],
            targets: vec![],
            losses: vec![],
            logits: emitted.logits,
        };
        let p = ImplicitBufs {
            params,
            gemm_ws,
            grads: None,
            optim: None,
        };
        return finish(spec, cfg, mode, layout, g, p, io, backend);
    }
    let grads = grad_buffers(&mut g, &layout);
    let optim = optimizer_state(&mut g, &layout, cfg.optim_state, cfg.offload.set.optimizer);
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
        let prefix = if micro > 1 {
            format!("mb{k}.")
        } else {
            String::new()
        };
        let io_buf = |g: &mut Builder, what: &str, dtype| {
            g.persistent(&format!("{prefix}{what}"), Category::IoStaging, dtype, n)
        };
        let tokens = io_buf(&mut g, "tokens", DType::U32); // [B, T]
        let targets = io_buf(&mut g, "targets", DType::U32); // [B, T]
        let losses = io_buf(&mut g, "losses", DType::F32); // [N]
        let mb = MicroBatch {
            prefix,
            tokens,
            loss: Some(Loss {
                targets,
                losses,
                // The step's loss is the mean over every micro-batch's rows.
                loss_rows: n * micro,
            }),
            rows,
            attn_ws_len,
        };
        spec.family.emit(&mut g, spec, cfg, &mb);
        io.tokens.push(tokens);
        io.targets.push(targets);
        io.losses.push(losses);
    }
    optimizer(&mut g, &layout, &optim);
    zero_grads_before_first_write(&mut g, &grads);
    let p = ImplicitBufs {
        params,
        gemm_ws,
        grads: Some(grads),
        optim: Some(optim),
    };
    finish(spec, cfg, mode, layout, g, p, io, backend)
}

/// Declares one gradient buffer per parameter group (`{group}.grad`, in the storage type).
fn grad_buffers(g: &mut Builder, layout: &ParamLayout) -> GradBufs {
    let segments = layout
        .groups
        .iter()
        .map(|group| {
            let range = layout.group_range(group);
            let buf = g.act(format!("{}.grad", group.name), Category::Grad, range.len());
            GradSegment { range, buf }
        })
        .collect();
    GradBufs { segments }
}

/// Inserts a `Zero` of each gradient buffer just before the first op that touches it (the
/// group's first backward write, or the LM head's for a tied embedding), so its bytes are
/// live from there on and nothing earlier in the step pays for them. These ops are in the
/// backward phase: evaluation, which runs the forward ops, never zeroes gradients.
fn zero_grads_before_first_write(g: &mut Builder, grads: &GradBufs) {
    let mut zeroed = vec![false; g.buffers.len()];
    let mut ops = Vec::with_capacity(g.ops.len() + grads.segments.len());
    for e in std::mem::take(&mut g.ops) {
        for id in grads.touched_by(&e.op) {
            if !std::mem::replace(&mut zeroed[id.0], true) {
                ops.push(OpEntry {
                    name: format!("zero_{}", g.buffers[id.0].name),
                    phase: Phase::Backward,
                    op: Op::Zero { buf: id },
                    flops: 0,
                });
            }
        }
        ops.push(e);
    }
    g.ops = ops;
}

/// Emits the optimizer phase: each parameter group's share of the global gradient norm, then
/// AdamW over the groups (embeddings, each block, the final norm), one op each. With the
/// moments on the disk tier (one `OptimBufs` per group) the groups are pipelined: group
/// k+1's moments are being read into its staging buffers while group k updates, and group
/// k's are being written back while group k+1 updates; an `AwaitTransfers` before each
/// consumer (and before a staging buffer's bytes may be reused) keeps it exact, so at most
/// three groups' staging buffers are live at once.
fn optimizer(g: &mut Builder, layout: &ParamLayout, state: &[OptimBufs]) {
    for group in &layout.groups {
        g.op(
            format!("{}.grad_norm", group.name),
            Phase::Optimizer,
            0,
            Op::GradNorm {
                range: layout.group_range(group),
            },
        );
    }
    let (state_block, _) = layout.block_offsets(QBLOCK);
    let adamw = |g: &mut Builder, k: usize, state: OptimBufs| {
        let group = &layout.groups[k];
        let tensors = group
            .tensors
            .clone()
            .map(|i| {
                let t = &layout.tensors[i];
                ParamSlice {
                    range: t.range.clone(),
                    decay: t.decay,
                    state_block: state_block[i],
                }
            })
            .collect();
        g.op(
            format!("{}.adamw", group.name),
            Phase::Optimizer,
            0,
            Op::AdamW { tensors, state },
        );
    };
    if let [whole] = state {
        for k in 0..layout.groups.len() {
            adamw(g, k, *whole);
        }
        return;
    }
    let stage: Vec<OptimBufs> = state.iter().map(|home| staging(g, home)).collect();
    let transfer = |g: &mut Builder, from: OptimBufs, to: OptimBufs, what: &str| {
        for (from, to) in from.ids().into_iter().zip(to.ids()) {
            let name = format!("{}.{what}", g.buffers[from.0].name);
            g.op(name, Phase::Optimizer, 0, Op::Transfer { from, to });
        }
    };
    let wait = |g: &mut Builder, k: usize, what: &str| {
        let name = format!("{}.{what}.wait", layout.groups[k].name);
        let bufs = stage[k].ids();
        g.op(name, Phase::Optimizer, 0, Op::AwaitTransfers { bufs });
    };
    let n = stage.len();
    transfer(g, state[0], stage[0], "read");
    for k in 0..n {
        if k + 1 < n {
            transfer(g, state[k + 1], stage[k + 1], "read");
        }
        wait(g, k, "read");
        adamw(g, k, stage[k]);
        transfer(g, stage[k], state[k], "write");
        if k > 0 {
            wait(g, k - 1, "write");
        }
    }
    wait(g, n - 1, "write");
}

/// Host staging buffers (`{name}.stage`, aligned for direct I/O) for the group state `home`.
fn staging(g: &mut Builder, home: &OptimBufs) -> OptimBufs {
    let mut stage = |id: BufId| {
        let b = &g.buffers[id.0];
        let (name, dtype, elems) = (format!("{}.stage", b.name), b.dtype, b.elems);
        let s = g.buf(name, Category::OptimizerState, dtype, elems);
        g.for_io(s, false)
    };
    OptimBufs {
        m: stage(home.m),
        v: stage(home.v),
        m_scale: home.m_scale.map(&mut stage),
        v_scale: home.v_scale.map(&mut stage),
        ..*home
    }
}

/// Declares the AdamW moments in `format` (see [`OptimBufs`]): one set covering every
/// parameter in RAM, or with `on_disk` one set per parameter group on the disk tier.
fn optimizer_state(
    g: &mut Builder,
    layout: &ParamLayout,
    format: OptimState,
    on_disk: bool,
) -> Vec<OptimBufs> {
    let (first_block, blocks) = layout.block_offsets(QBLOCK);
    if !on_disk {
        return vec![moments(
            g,
            "adamw",
            format,
            0..layout.total,
            0..blocks,
            false,
        )];
    }
    layout
        .groups
        .iter()
        .map(|group| {
            let (first, last) = (group.tensors.start, group.tensors.end - 1);
            let last_blocks = layout.tensors[last].range.len().div_ceil(QBLOCK);
            let blocks = first_block[first]..first_block[last] + last_blocks;
            let name = format!("{}.adamw", group.name);
            moments(g, &name, format, layout.group_range(group), blocks, true)
        })
        .collect()
}

/// Persistent moment buffers `{name}.m`, `{name}.v` (int8: `.m.q`, `.v.q`, `.m.absmax`,
/// `.v.absmax`) for parameter elements `range` and 8-bit blocks `blocks`.
fn moments(
    g: &mut Builder,
    name: &str,
    format: OptimState,
    range: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
    on_disk: bool,
) -> OptimBufs {
    let mut st = |what: &str, dtype, elems| {
        let id = g.persistent(
            &format!("{name}.{what}"),
            Category::OptimizerState,
            dtype,
            elems,
        );
        if on_disk { g.for_io(id, true) } else { id }
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
    implicit: ImplicitBufs,
    io: Io,
    backend: &dyn Sizing,
) -> Result<Plan> {
    // Owned buffers, outside the arena: the loader's two prefetch buffers and the trainer's
    // batch buffer ([accum·B, T+1] u32 each), and the scratch the backend's libraries keep
    // for themselves (the `gemm` crate's packing on the CPU).
    if mode == Mode::Train {
        let id = g.persistent(
            "loader.staging",
            Category::IoStaging,
            DType::U32,
            3 * cfg.grad_accum * cfg.batch * (cfg.seq + 1),
        );
        g.buffers[id.0].placement = Placement::OWNED;
    }
    let scratch = backend.library_scratch_bytes(&g.ops, cfg.threads);
    let id = g.persistent(
        "gemm.packing",
        Category::Workspace,
        DType::F32,
        (scratch / 4) as usize,
    );
    g.buffers[id.0].placement = Placement::OWNED;

    // Live intervals from the schedule (gradient buffers from the ops' parameter ranges).
    let n_ops = g.ops.len();
    for (i, e) in g.ops.iter().enumerate() {
        let (r, w) = e.op.reads_writes();
        let grads = implicit.grads.as_ref().map(|gr| gr.touched_by(&e.op));
        for id in r.into_iter().chain(w).chain(grads.into_iter().flatten()) {
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
    let arena_bytes = packing::pack(&mut g.buffers, Tier::Host);
    let nvme_bytes = packing::pack(&mut g.buffers, Tier::Nvme);
    packing::verify(&g.buffers)
        .map_err(|e| anyhow::anyhow!("internal error: invalid packing: {e}"))?;
    let external_bytes: u64 = g
        .buffers
        .iter()
        .filter(|b| b.is_owned())
        .map(|b| b.bytes)
        .sum();
    let in_arena: Vec<Buffer> = g
        .buffers
        .iter()
        .filter(|b| b.placement.tier == Tier::Host)
        .cloned()
        .collect();
    let (peak_live_bytes, peak_op) = packing::peak_live(&in_arena, n_ops);
    let plan = Plan {
        spec: spec.clone(),
        layout,
        cfg: cfg.clone(),
        mode,
        schedule: Schedule {
            ops: g.ops,
            implicit,
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
        nvme_bytes,
    };
    verify_ops(&plan)?;
    Ok(plan)
}

/// Checks that no op writes a buffer whose bytes overlap another buffer the same op touches
/// (the executor relies on this to hand out `&mut` and `&` views of one arena).
fn verify_ops(plan: &Plan) -> Result<()> {
    for e in &plan.schedule.ops {
        let (mut r, mut w) = e.op.reads_writes();
        if let Some(grads) = &plan.schedule.implicit.grads {
            // Gradients are read and written in place: count them as both.
            let g = grads.touched_by(&e.op);
            r.extend(&g);
            w.extend(g);
        }
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
