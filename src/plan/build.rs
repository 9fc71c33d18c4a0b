//! Builds the plan of one step: declares every buffer, emits the schedule that uses them,
//! derives each buffer's live interval from the schedule, and packs offsets.
//!
//! `build` is a list of passes, each a function here (or in the module named), run in this
//! order; buffers are declared as the passes go, so their ids and offsets follow it:
//! - `Request::checked`, `sharding`, `lora_plan`: the flags checked, a training plan's ranks
//!   and adapters; `trainable_layout`: the parameters trained (the model's or the adapters').
//! - `state_buffers`: the persistent state (fp32 parameters, a LoRA plan's frozen base and the
//!   tile its blocks are decoded into, the mixed-precision GEMM workspace); `grad_buffers`:
//!   one gradient buffer per parameter group; `moments`: the AdamW moments.
//! - `emit_micro_batches`: each micro-batch's layers, which the model family emits
//!   (`Family::emit`: the forward, recomputation as `--recompute` asks, the backward); the
//!   gradients accumulate over the micro-batches (`--grad-accum`).
//! - `lora::apply`: a LoRA plan's adapters ([`super::lora`]); `optimizer`: the optimizer
//!   phase; `deferred_update`: the update moved into the next step's forward (gradients on
//!   the disk tier).
//! - `zero_grads_before_first_write`, `norm_when_final`: each group's gradient zeroing and
//!   norm share.
//! - `base_storage`: a quantized LoRA base's storage settled; `bind_state`: every op bound to
//!   the buffers of its state.
//! - `zero::collectives`: the ranks' collectives ([`super::zero`]); `offload_homes` and
//!   `stage::stage`: staging for `--offload`.
//! - `finish`: `owned_buffers`, `lifetimes`, `pack` per tier ([`super::packing`]), and
//!   verification (`verify_ops`).
//!
//! A generation plan (`generation`) declares the parameters, emits one batch's forward, and
//! finishes.
//!
//! How the passes shape the schedule:
//! - **Gradients are per parameter group** (`Segments`: one `{group}.grad` buffer per group).
//!   A `Zero` of a group's buffer goes just before the first op that writes it (the group's
//!   first backward op, or the LM head's for a tied embedding), and the group's `AdamW` op is
//!   its last reader, so its bytes are live only from there to the update: at the end of the
//!   forward, where activations peak, only the head's gradients exist. Under accumulation a
//!   buffer lives from the first micro-batch's backward on.
//! - **Ops are bound to the buffers holding their state.** An op names parameter ranges; its
//!   `OpEntry` carries `params` and `grads` `Binding`s (`buf[i - base]` holds element `i`),
//!   set by `bind_state` (an op's ranges always lie in one parameter group) and rewritten by
//!   staging. So the device never looks parameters up: the same op runs on the one `params`
//!   buffer, or on a group's staging copy.
//! - **The optimizer phase is ops like any other**: one `AdamW` op per parameter group
//!   (embeddings, each block, the final norm), each over its tensors' ranges, with its moments'
//!   buffers ([`OptimBufs`]: the whole model's, or a group's). Each group's `GradNorm` (its sum
//!   of squares) is emitted right after the last op that writes its gradients, in the
//!   backward; the executor adds the shares in parameter order (whatever the op order) into
//!   the norm, the clipping factor and the skip decision before the first `AdamW`. With
//!   sharded gradients (`--zero 1` and up) each rank's shares cover its shards: every rank's
//!   are gathered and added in (group, rank) order.
//! - **Deferred update** ([`Schedule::deferred_update`], set when gradients live on the disk
//!   tier): an update at the end of the step is pure I/O when its state is on disk (read
//!   parameters, gradients and moments, write three of them back, almost no arithmetic), so
//!   `defer_updates` copies each group's `AdamW` into the forward as a
//!   [`Phase::DeferredUpdate`] op just before the first op that uses the group: a step applies
//!   the previous step's update there, and its transfers overlap the forward's matmuls (and
//!   the group's update and forward share one parameter copy: one read and one write fewer).
//!   The gradients are kept across the step boundary (persistent on the disk tier, so no RAM
//!   for it); the executor settles and applies such updates (`Executor::finish_update`).
//!
//! **Invariant:** no lifetime is written by hand. Each buffer's interval runs from the first
//! to the last op that touches it (persistent buffers: the whole step), so a strategy that
//! changes the schedule changes lifetimes and packing with no special case in the executor.
//!
//! **Invariant:** a plan that runs is verified: no two simultaneously live buffers of a tier
//! overlap ([`packing::verify`]), no op writes a buffer overlapping another buffer it touches,
//! and every collective is awaited later with no op in between touching its buffers. The CPU
//! device's `unsafe` views rely on exactly that. `--fit`'s candidates, measured and timed but
//! never run, are built unverified; the one chosen is built again, verified.
//!
//! Shapes: B batch, T sequence, C channels, NH heads, V vocabulary, N = B·T, L layers.

use super::config::{Mode, StepConfig};
use super::packing;
use super::stage::{self, Home, Kind};
use super::update;
use super::zero;
use super::{LoraPlan, OffloadSet, Plan};
use crate::dtype::DType;
use crate::ir::BaseQuant;
use crate::ir::Sharding;
use crate::ir::Sizing;
use crate::ir::builder::{Builder, Loss, MicroBatch, Teacher};
use crate::ir::schedule::{
    Binding, ImplicitBufs, Op, OpEntry, OptimBufs, ParamSlice, Phase, Rows, Schedule, Segment,
    Segments,
};
use crate::ir::strategy::{OptimState, Precision, QBLOCK, Update};
use crate::ir::{BufId, Buffer, Category, Placement, Tier, TierSize};
use crate::model::lora::AdapterLayout;
use crate::model::{ModelSpec, ParamLayout, ParamTensor};
use anyhow::{Result, bail};

/// Builds and packs the plan for `spec` and `cfg`, with workspace sized by `backend`.
pub fn build_plan(
    spec: &ModelSpec,
    cfg: &StepConfig,
    mode: Mode,
    backend: &dyn Sizing,
) -> Result<Plan> {
    build(spec, cfg, mode, backend, Verify::Yes)
}

/// Whether a plan's packing and ops are verified ([`packing::verify`], `verify_ops`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Verify {
    Yes,
    /// For plans that are only measured and timed, never run (`--fit`'s candidates: the
    /// one chosen is built again, verified, before it runs).
    No,
}

/// Tokens of one micro-batch (`--batch × --seq`) memwall plans at most: 2^24, far beyond any
/// that fits a machine, and small enough that no byte count of a plan can overflow.
pub const MAX_MICRO_BATCH_TOKENS: usize = 1 << 24;
/// Micro-batches per optimizer step memwall plans at most: the schedule holds each one's ops
/// and buffers, and planning takes time and memory in proportion (GPT-2 124M at 1 × 64
/// tokens: 1.5 s and 0.2 GB for 1024, 6.4 s and 0.9 GB for 4096).
pub const MAX_GRAD_ACCUM: usize = 4096;

/// The most ranks memwall plans (`plan --ranks N` builds every rank's plan to report them).
pub const MAX_RANKS: usize = 1024;

/// Refuses a rank count memwall does not plan: none, or more than [`MAX_RANKS`].
pub fn check_ranks(ranks: usize) -> Result<()> {
    if ranks == 0 {
        bail!("--ranks must be at least 1 (processes training together)");
    }
    if ranks > MAX_RANKS {
        bail!("--ranks {ranks} (or mpirun -np {ranks}): memwall plans at most {MAX_RANKS} ranks");
    }
    Ok(())
}

/// Refuses a micro-batch, an accumulation or a rank count too large to plan, naming the
/// flags.
fn check_sizes(cfg: &StepConfig) -> Result<()> {
    check_ranks(cfg.mesh.world())?;
    let tokens = cfg.batch.checked_mul(cfg.seq);
    if tokens.is_none_or(|t| t > MAX_MICRO_BATCH_TOKENS) {
        bail!(
            "--batch {} × --seq {} is more tokens per micro-batch than memwall plans ({}); \
             lower --batch and accumulate with --grad-accum",
            cfg.batch,
            cfg.seq,
            MAX_MICRO_BATCH_TOKENS
        );
    }
    if cfg.grad_accum > MAX_GRAD_ACCUM {
        bail!(
            "--grad-accum {} (or --global-batch / --batch): more than the {} micro-batches per \
             optimizer step memwall plans; raise --batch",
            cfg.grad_accum,
            MAX_GRAD_ACCUM
        );
    }
    Ok(())
}

/// [`build_plan`], verifying or not: the passes of the module documentation, in order.
pub(super) fn build(
    spec: &ModelSpec,
    cfg: &StepConfig,
    mode: Mode,
    backend: &dyn Sizing,
    verify: Verify,
) -> Result<Plan> {
    let r = Request::checked(spec, cfg, mode, backend, verify)?;
    if mode == Mode::Generate {
        return generation(&r);
    }
    let sharding = sharding(cfg)?;
    let lora = lora_plan(spec, cfg)?;
    let layout = trainable_layout(spec, cfg, lora.as_ref());
    let split = sharding.map(|sh| zero::Split::new(&layout, cfg.optim_state, sh));
    let sharded = split.as_ref().filter(|s| s.sh.zero.shards_optimizer());
    let mut g = Builder::new(cfg.precision.storage(), r.backend.tiers()[0]);
    let State {
        params,
        base,
        quant_ws,
        gemm_ws,
    } = state_buffers(&mut g, &r, &layout, lora.as_ref(), sharded)?;
    // Updates on the host take the head whole: each slice's would split the head's weights
    // into a read from pinned RAM per slice.
    let head = update::head_slices(cfg, &layout).filter(|_| !r.updates_on_host());
    let grads = grad_buffers(&mut g, &layout, split.as_ref(), head.as_ref());
    let optim = moments(&mut g, &r, &layout, sharded);
    let mut io = emit_micro_batches(&mut g, &r);
    super::pipeline::one_f_one_b(&mut g, cfg.pipeline_stage(spec.n_layer), cfg.grad_accum);
    super::pipeline::tied_embedding_sum(&mut g, &layout, &grads);
    if let Some(l) = &lora {
        super::lora::apply(&mut g, l);
    }
    if let Some(h) = &head {
        update::head_after_backward(&mut g, h);
    }
    optimizer(&mut g, &layout, &optim, sharded, &grads);
    io.deferred_update = deferred_update(&mut g, &r, &grads);
    zero_grads_before_first_write(&mut g, &grads);
    // The adapters' whole tensors, or the model's with partial gradients (Qwen3's q/k norms).
    let shared: fn(&ParamTensor) -> bool = match lora {
        Some(_) => |t| t.part.is_none(),
        None => |t| t.partial_grad,
    };
    // ZeRO 2 and 3 reduce-scatter each micro-batch's gradients (`zero::collectives`).
    let per_micro = split.is_some() && cfg.zero.shards_grads() && cfg.grad_accum > 1;
    super::lora::sum_shared_grads(&mut g, &layout, &grads, shared, per_micro);
    norm_when_final(&mut g, &layout, &grads);
    if cfg.update == Update::InBackward {
        update::move_updates(&mut g, &grads, r.updates_on_host());
    }
    if let Some(plan) = base_storage(&mut g, &r, lora.as_ref(), base.as_ref())? {
        return Ok(plan);
    }
    bind_state(&mut g, &params, Some(&grads), base.as_ref());
    let params = match &split {
        Some(split) => zero::collectives(&mut g, &layout, split, &params, &grads, cfg.grad_accum),
        None => params,
    };
    // 8-bit moments sharded among data ranks: the agreement on block scales spans them too.
    let data = sharded
        .map(|s| s.sh.ranks)
        .filter(|_| cfg.optim_state == OptimState::Int8);
    super::block_scales::agree(&mut g, &layout, data);
    let homes = offload_homes(
        &g,
        &r,
        &params,
        base.as_ref(),
        lora.as_ref(),
        &grads,
        &optim,
    );
    // Blocks in the step: every micro-batch's.
    if let Some(tier) = r.home_tier {
        stage::stage(&mut g, &homes, spec.n_layer * cfg.grad_accum, tier);
    }
    let implicit = ImplicitBufs {
        params,
        base,
        quant_ws,
        gemm_ws,
        grads: Some(grads),
        optim: Some(optim),
        scratch: None,
    };
    let mut plan = finish(&r, (layout, lora), g, implicit, io)?;
    plan.cuts = split.map(|s| s.cuts).unwrap_or_default();
    Ok(plan)
}

/// What the passes of [`build`] read: the request, checked, and what follows from it.
struct Request<'a> {
    spec: &'a ModelSpec,
    cfg: &'a StepConfig,
    mode: Mode,
    backend: &'a dyn Sizing,
    verify: Verify,
    /// One micro-batch's rows (`--batch` sequences of `--seq`).
    rows: Rows,
    /// The attention kernel's workspace, in elements ([`Sizing::attention_workspace_elems`]).
    attn_ws_len: usize,
    /// What lives on the tier beneath the compute tier (nothing in a generation plan).
    offload: OffloadSet,
    /// The tier offloaded buffers live on between their uses (the backend's second: the
    /// CPU's disk, a GPU's pinned host RAM); `None` where the backend plans one tier.
    home_tier: Option<Tier>,
}

/// Whether the updates run on the host's cores (`stage::host_updates`): beneath a GPU,
/// with their whole state (parameters, gradients, moments) in pinned RAM.
fn updates_on_host(home_tier: Option<Tier>, offload: OffloadSet) -> bool {
    home_tier == Some(Tier::Host) && offload.holds_the_update()
}

impl<'a> Request<'a> {
    /// Whether the plan's updates run on the host's cores ([`updates_on_host`]).
    fn updates_on_host(&self) -> bool {
        updates_on_host(self.home_tier, self.offload)
    }

    /// Checks the model and the step's sizes, naming the flags, and derives what the passes
    /// share.
    fn checked(
        spec: &'a ModelSpec,
        cfg: &'a StepConfig,
        mode: Mode,
        backend: &'a dyn Sizing,
        verify: Verify,
    ) -> Result<Self> {
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
        check_sizes(cfg)?;
        check_mesh(spec, cfg, mode)?;
        if mode == Mode::Generate && cfg.precision != Precision::F32 {
            bail!("internal error: generation plans run in fp32");
        }
        let rows = Rows {
            b: cfg.batch,
            t: cfg.seq,
        };
        let storage = cfg.precision.storage();
        let attn_ws_len = backend.attention_workspace_elems(
            storage,
            cfg.seq,
            spec.head_size(),
            spec.widest_window(),
            cfg.threads,
        );
        let offload = match mode {
            Mode::Train => cfg.offload.set,
            Mode::Generate => OffloadSet::NONE,
        };
        let home_tier = backend.offload_tier();
        if offload != OffloadSet::NONE && home_tier.is_none() {
            bail!(
                "--offload {}: this device plans no slower tier to offload to (its tiers: {}); \
                 give --offload none",
                offload,
                backend
                    .tiers()
                    .iter()
                    .map(|t| t.describe())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        if mode == Mode::Train {
            update::check(cfg, updates_on_host(home_tier, offload))?;
        }
        Ok(Request {
            spec,
            cfg,
            mode,
            backend,
            verify,
            rows,
            attn_ws_len,
            offload,
            home_tier,
        })
    }
}

/// Checks the mesh of ranks against the model and the other strategies, naming the flags:
/// each tensor rank's part of every layer must be equal; what tensor parallelism does not
/// compose with yet is refused before anything is planned.
pub(super) fn check_mesh(spec: &ModelSpec, cfg: &StepConfig, mode: Mode) -> Result<()> {
    let mesh = &cfg.mesh;
    if let Some(d) = cfg.distill {
        check_distill(d, cfg)?;
    }
    if mesh.pipeline > 1 {
        check_pipeline(spec, cfg, mode)?;
    }
    if cfg.pipeline_chunks == 0 {
        bail!("--pp-chunks must be at least 1 (runs of layers each pipeline stage holds)");
    }
    if cfg.pipeline_chunks > 1 {
        check_interleaved(spec, cfg)?;
    }
    if cfg.sequence_parallel {
        check_sequence_parallel(cfg)?;
    }
    if mesh.tensor <= 1 {
        return Ok(());
    }
    spec.check_tensor_split(mesh.tensor)?;
    let t = mesh.tensor;
    if mode == Mode::Generate {
        bail!("--tp {t}: sampling runs on one rank; use --tp 1");
    }
    Ok(())
}

/// Checks the interleaved schedule (`--pp-chunks V`, V > 1): each of the P stages holds V
/// runs of one layer or more, cut evenly, and the step's micro-batches go through the runs
/// in groups of P (Megatron's interleaved schedule asks the same).
fn check_interleaved(spec: &ModelSpec, cfg: &StepConfig) -> Result<()> {
    let (p, v, m, n) = (
        cfg.mesh.pipeline,
        cfg.pipeline_chunks,
        cfg.grad_accum,
        spec.n_layer,
    );
    if p <= 1 {
        bail!(
            "--pp-chunks {v} interleaves the runs of layers of pipeline stages: give --pp 2 or \
             more with it (or leave it out)"
        );
    }
    if p * v > n {
        bail!(
            "--pp {p} --pp-chunks {v} cuts the model into {} runs of one layer or more, and it \
             has {n} layers: use --pp-chunks {} or less",
            p * v,
            n / p
        );
    }
    if !cfg.stage_layers.is_empty() {
        bail!(
            "--pp-layers with --pp-chunks {v}: the interleaved runs are cut as even as they \
             divide; leave out --pp-layers (or --pp-chunks)"
        );
    }
    if m % p != 0 {
        bail!(
            "--pp-chunks {v}: the interleaved schedule runs a step's micro-batches through each \
             run in groups of --pp {p}, and this step has {m} (--grad-accum, or --global-batch \
             over --batch and the data ranks): use a multiple of {p}, such as {}",
            m.div_ceil(p) * p
        );
    }
    Ok(())
}

/// Checks distillation (`--distill-from`) against what its head does not compose with yet:
/// a head cut among tensor ranks, or one on a pipeline's last stage alone.
fn check_distill(d: super::config::Distill, cfg: &StepConfig) -> Result<()> {
    if !(0.0..=1.0).contains(&d.alpha) {
        bail!(
            "--distill-alpha {}: the weight of the teacher's KL against the data's \
             cross-entropy, from 0 (the data alone) to 1 (the teacher alone)",
            d.alpha
        );
    }
    if d.teacher_width == 0 {
        bail!("internal error: a teacher of width 0");
    }
    let (t, p) = (cfg.mesh.tensor, cfg.mesh.pipeline);
    if t > 1 || p > 1 {
        bail!(
            "--distill-from with --tp {t} --pp {p}: the teacher's logits are computed at a \
             whole head on one rank; distil with data-parallel ranks (--zero) only"
        );
    }
    Ok(())
}

/// Checks sequence parallelism (`--sequence-parallel`): it cuts the residual stream among
/// the tensor ranks, so it needs some, and a micro-batch's B·T rows must divide among them.
fn check_sequence_parallel(cfg: &StepConfig) -> Result<()> {
    let t = cfg.mesh.tensor;
    if t <= 1 {
        bail!(
            "--sequence-parallel cuts the residual stream by token rows among the tensor ranks: \
             give --tp 2 or more with it (or leave it out)"
        );
    }
    let (b, s) = (cfg.batch, cfg.seq);
    if (b * s) % t != 0 {
        bail!(
            "--sequence-parallel with --tp {t}: a micro-batch's {b} x {s} = {} token rows do not \
             divide among {t} tensor ranks; choose --batch and --seq so that {t} divides their \
             product",
            b * s
        );
    }
    Ok(())
}

/// Checks pipeline parallelism (`--pp P`, P > 1) against the model and the other
/// strategies, naming the flags.
fn check_pipeline(spec: &ModelSpec, cfg: &StepConfig, mode: Mode) -> Result<()> {
    let p = cfg.mesh.pipeline;
    if p > spec.n_layer {
        bail!(
            "--pp {p}: the model has {} layers, so at most --pp {} stages (each holds one layer or more)",
            spec.n_layer,
            spec.n_layer
        );
    }
    if !cfg.stage_layers.is_empty() {
        super::stage_layers::check(&cfg.stage_layers, p, spec.n_layer)?;
    }
    if mode == Mode::Generate {
        bail!("--pp {p}: sampling runs on one rank; use --pp 1");
    }
    Ok(())
}

/// A generation plan: the parameters (and the mixed-precision workspace), one batch of
/// tokens, the model's forward to the last row's logits; then [`finish`]. With
/// `--base-quant` the model is a frozen base of quantized blocks (a LoRA plan's, without
/// adapters: [`AdapterLayout::none`]), read as a QLoRA step reads its base.
fn generation(r: &Request) -> Result<Plan> {
    let (spec, cfg) = (r.spec, r.cfg);
    let frozen = (cfg.base_quant != BaseQuant::F32).then(|| {
        let base = ParamLayout::new(spec);
        LoraPlan {
            adapters: AdapterLayout::none(&base),
            base,
            requantized: Vec::new(),
        }
    });
    let layout = match &frozen {
        Some(f) => f.adapters.params.clone(),
        None => ParamLayout::new(spec),
    };
    let mut g = Builder::new(cfg.precision.storage(), r.backend.tiers()[0]);
    let State {
        params,
        base,
        quant_ws,
        gemm_ws,
    } = state_buffers(&mut g, r, &layout, frozen.as_ref(), None)?;
    let tokens = g.persistent("tokens", Category::IoStaging, DType::U32, r.rows.n()); // [B, T]
    let mb = MicroBatch {
        prefix: String::new(),
        tokens,
        positions: None,
        loss: None,
        rows: r.rows,
        attn_ws_len: r.attn_ws_len,
    };
    let emitted = spec
        .family
        .emit(&mut g, spec, &cfg.emit_options(spec.n_layer), &mb);
    let io = Io {
        tokens: vec![tokens],
        positions: vec![],
        targets: vec![],
        losses: vec![],
        logits: emitted.logits,
        teacher_hidden: vec![],
        teacher_head: None,
        deferred_update: false,
    };
    if let Some(f) = &frozen {
        super::lora::apply(&mut g, f);
    }
    if let Some(plan) = base_storage(&mut g, r, frozen.as_ref(), base.as_ref())? {
        return Ok(plan);
    }
    bind_state(&mut g, &params, None, base.as_ref());
    let p = ImplicitBufs {
        params,
        base,
        quant_ws,
        gemm_ws,
        grads: None,
        optim: None,
        scratch: None,
    };
    finish(r, (layout, frozen), g, p, io)
}

/// A training plan's ranks (`--ranks`, `--zero`), checked; `None` for one process.
fn sharding(cfg: &StepConfig) -> Result<Option<Sharding>> {
    let sharding = cfg.sharding();
    if let Some(sh) = &sharding {
        zero::check(sh)?;
    }
    Ok(sharding)
}

/// A training plan's adapters over its frozen base (`--lora`), its flags checked first.
fn lora_plan(spec: &ModelSpec, cfg: &StepConfig) -> Result<Option<LoraPlan>> {
    check_lora(cfg)?;
    let Some(l) = &cfg.lora else {
        return Ok(None);
    };
    // A pipeline stage's base: its layers' (the adapters follow it).
    let base = ParamLayout::part(spec, cfg.model_part(spec.n_layer));
    let adapters = AdapterLayout::new(&base, l.clone())?;
    Ok(Some(LoraPlan {
        base,
        adapters,
        requantized: Vec::new(),
    }))
}

/// The trainable parameters: the model's (this rank's part: its tensor share of its
/// pipeline stage), or the adapters'.
fn trainable_layout(spec: &ModelSpec, cfg: &StepConfig, lora: Option<&LoraPlan>) -> ParamLayout {
    match lora {
        Some(l) => l.adapters.params.clone(),
        None => ParamLayout::part(spec, cfg.model_part(spec.n_layer)),
    }
}

/// The persistent state that [`state_buffers`] declares before any op.
struct State {
    params: Segments,
    /// A LoRA plan's frozen base.
    base: Option<Segments>,
    /// The tile a quantized base is decoded into.
    quant_ws: Option<BufId>,
    /// The mixed-precision GEMM's tiles.
    gemm_ws: Option<BufId>,
}

/// Declares the persistent state: the fp32 parameters (the master weights under mixed
/// precision, which kernels read directly, converting per tile: no reduced-precision copy is
/// stored), a LoRA plan's frozen base and its decoding tile, the mixed-precision GEMM
/// workspace. (Gradients are per parameter group and live from the group's first backward
/// write to its update, [`grad_buffers`]; the moments are [`moments`].)
fn state_buffers(
    g: &mut Builder,
    r: &Request,
    layout: &ParamLayout,
    lora: Option<&LoraPlan>,
    sharded: Option<&zero::Split>,
) -> Result<State> {
    let (spec, cfg) = (r.spec, r.cfg);
    let mixed = cfg.precision != Precision::F32;
    let params = param_buffers(g, layout, mixed, r.offload.params, sharded, lora.is_some());
    // A LoRA plan's frozen base (read by the model's ops, never written), and the tile its
    // quantized weights are decoded into.
    let (base, quant_ws) = match lora {
        Some(l) => {
            let types = cfg.base_types.as_deref();
            let (segments, widest) = super::lora::base_buffers(
                g,
                spec,
                &l.base,
                (cfg.base_quant, types),
                r.offload.params,
            )?;
            let ws = (widest > 0).then(|| {
                let elems = r.backend.quantized_gemm_workspace_elems(widest);
                g.persistent("gemm.quant_tile", Category::Workspace, DType::F32, elems)
            });
            (Some(segments), ws)
        }
        None => (None, None),
    };
    let gemm_ws = mixed.then(|| {
        g.persistent(
            "gemm.mixed_tiles",
            Category::Workspace,
            DType::F32,
            r.backend.mixed_gemm_workspace_elems(),
        )
    });
    Ok(State {
        params,
        base,
        quant_ws,
        gemm_ws,
    })
}

/// Declares the AdamW moments: the rank's shards (`--zero 1` and up, [`zero::shard_moments`]),
/// or the whole model's, per group on the disk tier ([`optimizer_state`]).
fn moments(
    g: &mut Builder,
    r: &Request,
    layout: &ParamLayout,
    sharded: Option<&zero::Split>,
) -> Vec<OptimBufs> {
    match sharded {
        Some(split) => zero::shard_moments(g, layout, r.cfg.optim_state, split),
        None => optimizer_state(g, layout, r.cfg.optim_state, r.offload.optimizer),
    }
}

/// Emits the step's micro-batches (`--grad-accum`), each with its own batch buffers (tokens,
/// positions of packed rows, targets, losses) and the layers the model family emits for it
/// (`Family::emit`: forward, recomputation as `--recompute` asks, backward); their gradients
/// accumulate in the groups' buffers. Returns the batch buffers.
fn emit_micro_batches(g: &mut Builder, r: &Request) -> Io {
    let (spec, cfg, n) = (r.spec, r.cfg, r.rows.n());
    let micro = cfg.grad_accum;
    let mut io = Io {
        tokens: vec![],
        positions: vec![],
        targets: vec![],
        losses: vec![],
        logits: None,
        teacher_hidden: vec![],
        teacher_head: None,
        deferred_update: false,
    };
    // Distillation: the teacher's head, frozen, filled once ([V, Ct]).
    let teacher_head = cfg.distill.map(|d| {
        let len = spec.vocab_size * d.teacher_width;
        g.persistent("teacher.lm_head", Category::Param, DType::F32, len)
    });
    io.teacher_head = teacher_head;
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
        let tokens = io_buf(g, "tokens", DType::U32); // [B, T]
        let positions = cfg.packed.then(|| io_buf(g, "positions", DType::U32)); // [B, T]
        let targets = io_buf(g, "targets", DType::U32); // [B, T]
        let losses = io_buf(g, "losses", DType::F32); // [N]
        // Distillation: the teacher's final-norm output for the rows ([N, Ct]).
        let teacher = cfg.distill.zip(teacher_head).map(|(d, head)| {
            let len = n * d.teacher_width;
            let hidden = g.persistent(
                &format!("{prefix}teacher.hidden"),
                Category::IoStaging,
                DType::F32,
                len,
            );
            Teacher {
                hidden,
                head,
                c: d.teacher_width,
                alpha: d.alpha,
            }
        });
        let mb = MicroBatch {
            prefix,
            tokens,
            positions,
            // The step's loss is the mean over every micro-batch's trained targets, on every
            // rank: a count of the step's data (`StepCtx::loss_tokens`), not of the plan.
            loss: Some(Loss {
                targets,
                losses,
                teacher,
            }),
            rows: r.rows,
            attn_ws_len: r.attn_ws_len,
        };
        g.micro = k;
        spec.family
            .emit(g, spec, &cfg.emit_options(spec.n_layer), &mb);
        g.micro = 0;
        io.tokens.push(tokens);
        io.positions.extend(positions);
        io.targets.push(targets);
        io.losses.push(losses);
        io.teacher_hidden.extend(teacher.map(|t| t.hidden));
    }
    io
}

/// With gradients on the disk tier, each step runs the previous step's update in its
/// forward ([`defer_updates`]), so the update's transfers overlap arithmetic; the gradients
/// are then kept across the step boundary (on disk: no RAM for it). Not with a sharded
/// optimizer (ZeRO 1 and up): each rank's update is then followed by the all-gather of the
/// updated shards, which the forward must await. Returns whether it does.
fn deferred_update(g: &mut Builder, r: &Request, grads: &Segments) -> bool {
    let deferred =
        r.offload.grads && !r.cfg.zero.shards_optimizer() && r.cfg.update != Update::InBackward;
    if deferred {
        // Updates on the host go a group early, so the read of their new weights can start
        // a group ahead.
        defer_updates(g, grads, r.updates_on_host());
        for id in grads.bufs() {
            g.buffers[id.0].persistent = true;
        }
    }
    deferred
}

/// A LoRA plan's quantized base as its ops read it: a kept GGUF base whose fused projections
/// differ in type is planned again with those parts as q8_0 (that plan is returned); else
/// frozen layers' biases are split from their quantized weights
/// ([`super::lora::split_biases`]).
fn base_storage(
    g: &mut Builder,
    r: &Request,
    lora: Option<&LoraPlan>,
    base: Option<&Segments>,
) -> Result<Option<Plan>> {
    let (Some(l), Some(base)) = (lora, base) else {
        return Ok(None);
    };
    let storage = (r.cfg.base_quant, r.cfg.base_types.as_deref());
    if let Some((types, names)) = super::lora::unify_storage(&g.ops, base, l, storage)? {
        let mut cfg = r.cfg.clone();
        cfg.base_types = Some(std::sync::Arc::new(types));
        let mut plan = build(r.spec, &cfg, r.mode, r.backend, r.verify)?;
        if let Some(l) = &mut plan.lora {
            l.requantized = names;
        }
        return Ok(Some(plan));
    }
    super::lora::split_biases(g, base);
    Ok(None)
}

/// The buffers `--offload` puts on the disk tier ([`stage::stage`] stages their uses): the
/// parameters (and a LoRA plan's frozen base), the gradients, the moments, the activations
/// the forward keeps for the backward, as the flag asks.
fn offload_homes(
    g: &Builder,
    r: &Request,
    params: &Segments,
    base: Option<&Segments>,
    lora: Option<&LoraPlan>,
    grads: &Segments,
    optim: &[OptimBufs],
) -> Vec<Home> {
    let offload = r.offload;
    let mut homes = Vec::new();
    let mut home = |ids: Vec<BufId>, kind, group: &dyn Fn(BufId) -> Option<usize>| {
        homes.extend(ids.into_iter().map(|id| Home {
            id,
            kind,
            group: group(id),
        }))
    };
    let alone = |_| None;
    if offload.params {
        home(params.bufs(), Kind::Params, &alone);
        // A LoRA plan's frozen base too: read one group at a time, never written back.
        if let (Some(base), Some(l)) = (base, lora) {
            home(base.bufs(), Kind::Base, &|id| base_group(base, l, id));
        }
    }
    if offload.grads {
        home(grads.bufs(), Kind::Grads, &alone);
    }
    if offload.optimizer {
        home(
            optim.iter().flat_map(|o| o.ids()).collect(),
            Kind::Moments,
            &alone,
        );
    }
    if offload.activations {
        home(stage::kept_activations(g), Kind::Activations, &alone);
    }
    homes
}

/// The parameter group of the base's buffer `id` (a segment of `base`).
fn base_group(base: &Segments, l: &LoraPlan, id: BufId) -> Option<usize> {
    let s = base.segments.iter().find(|s| s.buf == id)?;
    let end = |gr: &crate::model::ParamGroup| l.base.tensors[gr.tensors.end - 1].range.end;
    l.base.groups.iter().position(|gr| s.range.start < end(gr))
}

/// Refuses `--base-quant` without `--lora`, naming the flags.
fn check_lora(cfg: &StepConfig) -> Result<()> {
    if cfg.lora.is_none() && cfg.base_quant != BaseQuant::F32 {
        bail!(
            "--base-quant {} needs --lora: a quantized base cannot be trained, only adapted",
            cfg.base_quant
        );
    }
    Ok(())
}

/// Declares the fp32 parameters (the master weights under mixed precision): one persistent
/// buffer, or one per parameter group (`{group}.params`) with `per_group` (for the disk tier)
/// or `sharded` (a ZeRO plan: each as long as its group's cut for the collectives; transient
/// at stage 3, where `plan::zero` gives each span of use its own gathered copy and keeps
/// shards).
fn param_buffers(
    g: &mut Builder,
    layout: &ParamLayout,
    mixed: bool,
    per_group: bool,
    sharded: Option<&zero::Split>,
    adapters: bool,
) -> Segments {
    let (name, category) = if adapters {
        ("params.adapter", Category::Adapter)
    } else if mixed {
        ("params.master", Category::Master)
    } else {
        ("params", Category::Param)
    };
    if !per_group && sharded.is_none() {
        let buf = g.persistent(name, category, DType::F32, layout.total);
        let range = 0..layout.total;
        return Segments {
            segments: vec![Segment { range, buf }],
        };
    }
    let segments = layout
        .groups
        .iter()
        .enumerate()
        .map(|(k, group)| {
            let range = layout.group_range(group);
            let name = format!("{}.{name}", group.name);
            let buf = match sharded {
                Some(s) if s.sh.zero.shards_params() => g.f32(name, category, s.cuts[k].len()),
                Some(s) => g.persistent(&name, category, DType::F32, s.cuts[k].len()),
                None => g.persistent(&name, category, DType::F32, range.len()),
            };
            Segment { range, buf }
        })
        .collect();
    Segments { segments }
}

/// Declares one gradient buffer per parameter group (`{group}.grad`, in the storage type;
/// as long as the group's cut for the collectives of a plan with ranks, `split`); the LM
/// head's group has one per slice of the head with `--update in-backward` (`head`).
fn grad_buffers(
    g: &mut Builder,
    layout: &ParamLayout,
    split: Option<&zero::Split>,
    head: Option<&update::HeadSlices>,
) -> Segments {
    let mut segments = Vec::new();
    for (k, group) in layout.groups.iter().enumerate() {
        let range = layout.group_range(group);
        // `--update in-backward`: the head's group, cut at the head's slices.
        if let Some(parts) = head.and_then(|h| h.group_segments(&range)) {
            for (suffix, range) in parts {
                let name = format!("{}{suffix}.grad", group.name);
                let buf = g.act(name, Category::Grad, range.len());
                segments.push(Segment { range, buf });
            }
            continue;
        }
        let elems = split.map_or(range.len(), |s| s.cuts[k].len());
        let buf = g.act(format!("{}.grad", group.name), Category::Grad, elems);
        segments.push(Segment { range, buf });
    }
    Segments { segments }
}

/// Each gradient segment's name: its buffer's, less `.grad` (the group's name, or a slice
/// of the LM head's group: `embed.slice3`).
fn segment_names(g: &Builder, grads: &Segments) -> Vec<String> {
    let name = |s: &Segment| {
        let n = &g.buffers[s.buf.0].name;
        n.strip_suffix(".grad").unwrap_or(n).to_string()
    };
    grads.segments.iter().map(name).collect()
}

/// Inserts a `Zero` of each gradient buffer just before the first op that touches it (the
/// group's first backward write, or the LM head's for a tied embedding), so its bytes are
/// live from there on and nothing earlier in the step pays for them. These ops are in the
/// backward phase: evaluation, which runs the forward ops, never zeroes gradients.
fn zero_grads_before_first_write(g: &mut Builder, grads: &Segments) {
    let mut zeroed = vec![false; g.buffers.len()];
    let mut ops = Vec::with_capacity(g.ops.len() + grads.segments.len());
    for e in std::mem::take(&mut g.ops) {
        if let Some(r) = e.grad_ranges().first().filter(|_| !is_update(e.phase)) {
            let id = grads.locate(r).buf;
            if !std::mem::replace(&mut zeroed[id.0], true) {
                ops.push(OpEntry {
                    name: format!("zero_{}", g.buffers[id.0].name),
                    phase: Phase::Backward,
                    op: Op::Zero { buf: id },
                    flops: 0,
                    params: None,
                    grads: None,
                    micro: e.micro,
                    frozen: false,
                });
            }
        }
        ops.push(e);
    }
    g.ops = ops;
}

/// Inserts each group's `GradNorm` (its share of the global gradient norm) just after the
/// last op that writes its gradients (in the last micro-batch's backward): the share is
/// taken while the gradients are still at hand, so gradients on the disk tier are not read
/// back for it. The executor sums the shares in parameter order, whatever the op order.
/// Under tensor parallelism a group's share is one per run of its tensors that are whole
/// or cut ([`norm_runs`]): the executor counts the first once and adds the tensor ranks'
/// second.
fn norm_when_final(g: &mut Builder, layout: &ParamLayout, grads: &Segments) {
    // A segment per group, or the LM head's group cut into slices (one process).
    let sliced = grads.segments.len() != layout.groups.len();
    let runs: Vec<Vec<(bool, std::ops::Range<usize>)>> = (grads.segments.iter().enumerate())
        .map(|(k, s)| match sliced {
            true => vec![(false, s.range.clone())],
            false => norm_runs(layout, k, &s.range),
        })
        .collect();
    let names = segment_names(g, grads);
    // The last pipeline stage's copy of a tied embedding's group: the first stage's share
    // counts it (the two are equal after their sum), so this one takes its share over nothing.
    let copy = (layout.stage.is_split() && !layout.stage.is_first() && !layout.tied.is_empty())
        .then(|| {
            grads
                .locate(&layout.tensors[layout.tied[0].tensor].range)
                .range
                .clone()
        });
    let runs: Vec<Vec<(bool, std::ops::Range<usize>)>> = runs
        .into_iter()
        .map(|r| match &copy {
            Some(c) if r[0].1.start == c.start => vec![(r[0].0, c.start..c.start)],
            _ => r,
        })
        .collect();
    // [slots] f64: each share, read by the executor before the first update (in the next
    // step's forward with a deferred update, so it lives across steps).
    let out = g.persistent(
        "grad_norm.shares",
        Category::Workspace,
        DType::F64,
        runs.iter().map(Vec::len).sum(),
    );
    let mut last = vec![None; grads.segments.len()];
    for (i, e) in g.ops.iter().enumerate() {
        if is_update(e.phase) {
            continue;
        }
        if let Some(r) = e.grad_ranges().first() {
            let k = grads.segments.partition_point(|s| s.range.end <= r.start);
            last[k] = Some(i);
        }
        // A collective on a group's gradients (a tied embedding's sum between the pipeline's
        // two ends) finishes writing them at its await.
        if let Op::AwaitCollective { bufs } = &e.op
            && let Some(k) = grads.segments.iter().position(|s| s.buf == bufs[0])
        {
            last[k] = Some(i);
        }
    }
    let mut after: Vec<Vec<usize>> = vec![Vec::new(); g.ops.len()];
    for (k, at) in last.iter().enumerate() {
        let at = at.expect("internal error: a parameter group without gradients");
        after[at].push(k);
    }
    let first_slot: Vec<usize> = runs
        .iter()
        .scan(0, |at, r| {
            let first = *at;
            *at += r.len();
            Some(first)
        })
        .collect();
    let mut ops = Vec::with_capacity(g.ops.len() + grads.segments.len());
    for (i, e) in std::mem::take(&mut g.ops).into_iter().enumerate() {
        let micro = e.micro;
        ops.push(e);
        for &k in &after[i] {
            for (j, (parts, range)) in runs[k].iter().enumerate() {
                let name = &names[k];
                ops.push(OpEntry {
                    name: match runs[k].len() {
                        1 => format!("{name}.grad_norm"),
                        _ => format!("{name}.grad_norm.{j}"),
                    },
                    phase: Phase::Backward,
                    op: Op::GradNorm {
                        range: range.clone(),
                        out,
                        slot: first_slot[k] + j,
                        parts: *parts,
                    },
                    flops: 0,
                    params: None,
                    grads: None,
                    micro,
                    frozen: false,
                });
            }
        }
    }
    g.ops = ops;
}

/// The ranges group `k` (elements `range`) takes its norm shares over, each with whether
/// it holds tensor-parallel parts: the whole group, or under tensor parallelism each
/// maximal run of its tensors that are all whole (the same on every tensor rank) or all
/// cut.
fn norm_runs(
    layout: &ParamLayout,
    k: usize,
    range: &std::ops::Range<usize>,
) -> Vec<(bool, std::ops::Range<usize>)> {
    if !layout.split.is_split() {
        return vec![(false, range.clone())];
    }
    let mut runs: Vec<(bool, std::ops::Range<usize>)> = Vec::new();
    for t in &layout.tensors[layout.groups[k].tensors.clone()] {
        let cut = t.part.is_some();
        match runs.last_mut() {
            Some((c, r)) if *c == cut && r.end == t.range.start => r.end = t.range.end,
            _ => runs.push((cut, t.range.clone())),
        }
    }
    debug_assert_eq!(
        (runs[0].1.start, runs[runs.len() - 1].1.end),
        (range.start, range.end)
    );
    runs
}

/// Whether ops of `phase` apply an update (they read the step's gradients, never write them).
fn is_update(phase: Phase) -> bool {
    matches!(phase, Phase::Optimizer | Phase::DeferredUpdate)
}

/// Copies each group's `AdamW` op (of the `Optimizer` phase, at the end of the schedule) to
/// just before the first op of the step that uses the group's parameters or gradients (its
/// first forward op), as a [`Phase::DeferredUpdate`] op: there it applies the previous
/// step's update, before anything reads the new values or overwrites the gradients (runs
/// before gradient zeroing is inserted, which then comes after it). `early`: each goes
/// before the first op of the group used just before its own instead (the first group's
/// stays), so a transfer of its new weights that must follow it can start a group ahead.
fn defer_updates(g: &mut Builder, grads: &Segments, early: bool) {
    let group =
        |r: &std::ops::Range<usize>| grads.segments.partition_point(|s| s.range.end <= r.start);
    let mut updates: Vec<Option<OpEntry>> = vec![None; grads.segments.len()];
    let mut at = vec![usize::MAX; grads.segments.len()];
    for (i, e) in g.ops.iter().enumerate() {
        if e.phase == Phase::Optimizer {
            let k = group(&e.op.param_ranges()[0]);
            updates[k] = Some(OpEntry {
                name: format!("{}.deferred", e.name),
                phase: Phase::DeferredUpdate,
                ..e.clone()
            });
        } else if !e.frozen {
            for r in e.op.param_ranges().into_iter().chain(e.op.grad_ranges()) {
                let k = group(&r);
                at[k] = at[k].min(i);
            }
        }
    }
    if early {
        let mut order: Vec<usize> = (0..at.len()).collect();
        order.sort_by_key(|&k| at[k]);
        let first_uses: Vec<usize> = order.iter().map(|&k| at[k]).collect();
        for (j, &k) in order.iter().enumerate().skip(1) {
            at[k] = first_uses[j - 1];
        }
    }
    let mut before: Vec<Vec<OpEntry>> = vec![Vec::new(); g.ops.len()];
    for (k, update) in updates.into_iter().enumerate() {
        let update = update.expect("internal error: a parameter group without an update");
        let at = at[k];
        assert!(
            at < g.ops.len(),
            "internal error: a parameter group no op uses"
        );
        before[at].push(update);
    }
    let mut ops = Vec::with_capacity(g.ops.len() + grads.segments.len());
    for (e, updates) in std::mem::take(&mut g.ops).into_iter().zip(before) {
        ops.extend(updates);
        ops.push(e);
    }
    g.ops = ops;
}

/// Binds every op to the buffers holding the parameters and gradients its ranges name
/// ([`Binding`]): the parameter buffer (or its group's, per group) and its group's
/// gradient buffer.
fn bind_state(
    g: &mut Builder,
    params: &Segments,
    grads: Option<&Segments>,
    base: Option<&Segments>,
) {
    let bind = |segs: &Segments, ranges: Vec<std::ops::Range<usize>>| {
        let first = ranges.first()?;
        let s = segs.locate(first);
        for r in &ranges {
            assert!(
                s.range.start <= r.start && r.end <= s.range.end,
                "internal error: an op's parameter ranges span two groups"
            );
        }
        Some(Binding {
            buf: s.buf,
            base: s.range.start,
        })
    };
    for e in &mut g.ops {
        let space = match (e.frozen, base) {
            (true, Some(base)) => base,
            (true, None) => panic!("internal error: a frozen op in a plan without a base"),
            (false, _) => params,
        };
        e.params = bind(space, e.op.param_ranges());
        e.grads = grads.and_then(|gr| bind(gr, e.grad_ranges()));
    }
}

/// Emits the optimizer phase: AdamW over each gradient segment (each parameter group:
/// embeddings, each block, the final norm; with `--update in-backward` the LM head's group
/// cut at its slices), one op each, with its group's moments (`state`: one set covering
/// every parameter, or one per group). The gradient norm's shares are taken in the backward
/// ([`norm_when_final`]); moments on the disk tier are staged by `plan::stage`. With a
/// sharded optimizer (`--zero 1` and up) each op updates the rank's shard of the group.
fn optimizer(
    g: &mut Builder,
    layout: &ParamLayout,
    state: &[OptimBufs],
    sharded: Option<&zero::Split>,
    grads: &Segments,
) {
    let (state_block, _) = layout.block_offsets(QBLOCK);
    let names = segment_names(g, grads);
    for (seg, name) in grads.segments.iter().zip(names) {
        let k = (layout.groups).partition_point(|gr| layout.group_range(gr).end <= seg.range.start);
        let group = &layout.groups[k];
        // A sharded plan's segments are its groups.
        let owned = match sharded {
            Some(s) => s.owned(&seg.range, k),
            None => seg.range.clone(),
        };
        let tensors = slices_of(layout, &state_block, &owned, group.tensors.clone());
        let state = if let [whole] = state {
            *whole
        } else {
            state[k]
        };
        g.op(
            format!("{name}.adamw"),
            Phase::Optimizer,
            0,
            Op::AdamW {
                tensors,
                state,
                scales: None,
            },
        );
    }
}

/// The parts of tensors `among` (indices into the layout) within elements `owned`, as an
/// `AdamW` op names them (each part starts a block of 8-bit state: `owned` is cut so).
fn slices_of(
    layout: &ParamLayout,
    state_block: &[usize],
    owned: &std::ops::Range<usize>,
    among: std::ops::Range<usize>,
) -> Vec<ParamSlice> {
    among
        .filter_map(|i| {
            let t = &layout.tensors[i];
            let lo = t.range.start.max(owned.start);
            let hi = t.range.end.min(owned.end);
            let at = lo - t.range.start;
            // The block of the slice's first element: of a part, in its whole tensor.
            let first = match &t.part {
                None => at,
                Some(p) => p.runs_in(at..at + 1).next().map_or(0, |(w, _)| w),
            };
            (lo < hi).then(|| ParamSlice {
                range: lo..hi,
                decay: t.decay,
                state_block: state_block[i] + first / QBLOCK,
                part: t.part.clone().map(|p| (p, at)),
            })
        })
        .collect()
}

/// Declares the AdamW moments in `format` (see [`OptimBufs`]): one set covering every
/// parameter, or with `per_group` one set per parameter group (for the disk tier).
fn optimizer_state(
    g: &mut Builder,
    layout: &ParamLayout,
    format: OptimState,
    per_group: bool,
) -> Vec<OptimBufs> {
    let (first_block, blocks) = layout.block_offsets(QBLOCK);
    if !per_group {
        return vec![g.moments("adamw", format, 0..layout.total, 0..blocks)];
    }
    layout
        .groups
        .iter()
        .map(|group| {
            let (first, last) = (group.tensors.start, group.tensors.end - 1);
            let last_blocks = layout.tensors[last].range.len().div_ceil(QBLOCK);
            let blocks = first_block[first]..first_block[last] + last_blocks;
            let name = format!("{}.adamw", group.name);
            g.moments(&name, format, layout.group_range(group), blocks)
        })
        .collect()
}

/// The buffers the executor reads and writes from outside the schedule, and how it runs
/// the schedule's update ([`Schedule::deferred_update`]).
struct Io {
    tokens: Vec<BufId>,
    positions: Vec<BufId>,
    targets: Vec<BufId>,
    losses: Vec<BufId>,
    logits: Option<BufId>,
    teacher_hidden: Vec<BufId>,
    teacher_head: Option<BufId>,
    deferred_update: bool,
}

/// The last passes, on the whole schedule: the buffers outside the arena
/// ([`owned_buffers`]), every buffer's live interval ([`lifetimes`]), the offsets of each
/// tier ([`pack`]), then the plan, verified ([`verify_ops`]).
fn finish(
    r: &Request,
    (layout, lora): (ParamLayout, Option<LoraPlan>),
    mut g: Builder,
    mut implicit: ImplicitBufs,
    io: Io,
) -> Result<Plan> {
    owned_buffers(&mut g, r);
    let scratch = r.backend.scratch_bytes(&g.ops, r.cfg.precision.storage());
    implicit.scratch = (scratch > 0).then(|| {
        g.persistent(
            "backend.scratch",
            Category::Workspace,
            DType::U8,
            scratch as usize,
        )
    });
    lifetimes(&mut g)?;
    let packed = pack(&mut g, r.backend.tiers(), r.verify)?;
    let plan = Plan {
        spec: r.spec.clone(),
        layout,
        lora,
        cfg: r.cfg.clone(),
        mode: r.mode,
        schedule: Schedule {
            ops: g.ops,
            implicit,
            tokens: io.tokens,
            positions: io.positions,
            targets: io.targets,
            losses: io.losses,
            logits: io.logits,
            teacher_hidden: io.teacher_hidden,
            teacher_head: io.teacher_head,
            deferred_update: io.deferred_update,
        },
        buffers: g.buffers,
        peak_live_bytes: packed.peak_live_bytes,
        peak_op: packed.peak_op,
        external_bytes: packed.external_bytes,
        tiers: packed.tiers,
        cuts: Vec::new(),
    };
    if r.verify == Verify::Yes {
        verify_ops(&plan)?;
    }
    Ok(plan)
}

/// Declares the owned buffers, outside the arena: the loader's two prefetch buffers and the
/// trainer's batch buffer ([accum·B, T+1] u32 each), a distillation teacher's own plan, and
/// the scratch the backend's libraries keep for themselves (the `gemm` crate's packing on
/// the CPU).
fn owned_buffers(g: &mut Builder, r: &Request) {
    let cfg = r.cfg;
    if r.mode == Mode::Train {
        let id = g.persistent(
            "loader.staging",
            Category::IoStaging,
            DType::U32,
            3 * cfg.grad_accum * cfg.batch * (cfg.seq + 1),
        );
        g.buffers[id.0].placement = Placement::OWNED;
        if let Some(d) = cfg.distill.filter(|d| d.teacher_bytes > 0) {
            let id = g.persistent(
                "teacher.plan",
                Category::Teacher,
                DType::U8,
                d.teacher_bytes as usize,
            );
            g.buffers[id.0].placement = Placement::OWNED;
        }
    }
    let scratch = r
        .backend
        .library_scratch_bytes(&g.ops, cfg.precision.storage(), cfg.threads);
    if scratch == 0 {
        return;
    }
    let id = g.persistent(
        "gemm.packing",
        Category::Workspace,
        DType::F32,
        (scratch / 4) as usize,
    );
    g.buffers[id.0].placement = Placement::OWNED;
}

/// Sets each buffer's live interval from the schedule: from the first to the last op that
/// touches it (gradient buffers through the ops' parameter ranges); persistent buffers, the
/// whole step. A buffer no op uses is an internal error.
fn lifetimes(g: &mut Builder) -> Result<()> {
    let n_ops = g.ops.len();
    for (i, e) in g.ops.iter().enumerate() {
        e.buffers(|id, _| {
            let buf = &mut g.buffers[id.0];
            buf.first_op = buf.first_op.min(i);
            buf.last_op = buf.last_op.max(i);
        });
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
    Ok(())
}

/// A plan's sizes once its tiers are packed ([`pack`]).
struct Packed {
    tiers: Vec<TierSize>,
    external_bytes: u64,
    peak_live_bytes: u64,
    peak_op: usize,
}

/// Checks that every transfer moves a buffer between two adjacent tiers of the backend's
/// list (the CPU's: RAM and the disk; a GPU's: device memory and pinned RAM, pinned RAM and
/// the disk), between buffers of one size.
fn check_transfers(ops: &[OpEntry], buffers: &[Buffer], tiers: &[Tier]) -> Result<()> {
    let place = |t: Tier| tiers.iter().position(|&x| x == t);
    for e in ops {
        let Op::Transfer { from, to } = e.op else {
            continue;
        };
        let (f, t) = (&buffers[from.0], &buffers[to.0]);
        let adjacent = match (place(f.placement.tier), place(t.placement.tier)) {
            (Some(a), Some(b)) => a.abs_diff(b) == 1,
            _ => false,
        };
        if !adjacent || f.bytes != t.bytes {
            bail!(
                "internal error: op {} moves {} ({}, {} B) to {} ({}, {} B): a transfer moves \
                 one size between adjacent tiers of {tiers:?}",
                e.name,
                f.name,
                f.placement.tier.describe(),
                f.bytes,
                t.name,
                t.placement.tier.describe(),
                t.bytes
            );
        }
    }
    Ok(())
}

/// Packs the offsets of each tier the backend declares, in its order ([`packing::pack`];
/// the CPU's: the host arena, then the disk tier), verified with `verify`, and measures the
/// compute tier's peak and the bytes outside the tiers.
fn pack(g: &mut Builder, tiers: &[Tier], verify: Verify) -> Result<Packed> {
    let n_ops = g.ops.len();
    if let Some(b) = g
        .buffers
        .iter()
        .find(|b| !b.is_owned() && !tiers.contains(&b.placement.tier))
    {
        bail!(
            "internal error: buffer {} is placed on {}, which this backend does not plan (its \
             tiers: {tiers:?})",
            b.name,
            b.placement.tier.describe()
        );
    }
    check_transfers(&g.ops, &g.buffers, tiers)?;
    let sizes: Vec<TierSize> = tiers
        .iter()
        .map(|&tier| TierSize {
            tier,
            bytes: packing::pack(&mut g.buffers, tier),
        })
        .collect();
    let compute = tiers[0];
    if verify == Verify::Yes {
        packing::verify(&g.buffers)
            .map_err(|e| anyhow::anyhow!("internal error: invalid packing: {e}"))?;
    }
    let external_bytes: u64 = g
        .buffers
        .iter()
        .filter(|b| b.is_owned())
        .map(|b| b.bytes)
        .sum();
    let in_arena: Vec<Buffer> = g
        .buffers
        .iter()
        .filter(|b| b.placement.tier == compute)
        .cloned()
        .collect();
    let (peak_live_bytes, peak_op) = packing::peak_live(&in_arena, n_ops);
    Ok(Packed {
        tiers: sizes,
        external_bytes,
        peak_live_bytes,
        peak_op,
    })
}

/// Checks that no op writes a buffer whose bytes overlap another buffer the same op touches
/// (the executor relies on this to hand out `&mut` and `&` views of one arena).
fn verify_ops(plan: &Plan) -> Result<()> {
    verify_collectives(plan)?;
    verify_transfers(plan)?;
    for e in &plan.schedule.ops {
        let mut clash = None;
        e.buffers(|written, access| {
            if !access.writes() {
                return;
            }
            e.buffers(|other, _| {
                let (a, o) = (plan.buffer(written), plan.buffer(other));
                if other != written && a.overlaps_in_memory(o) {
                    clash.get_or_insert((a, o));
                }
            });
        });
        if let Some((a, o)) = clash {
            bail!(
                "internal error: op {} writes {} which overlaps {}",
                e.name,
                a.name,
                o.name
            );
        }
    }
    Ok(())
}

/// Checks the tiers' invariants: an op that is not a transfer touches only buffers of the
/// compute tier (or owned ones); every transfer is awaited later in the step, by an
/// `AwaitTransfers` naming its staging buffer (its end on the compute tier), and no op in
/// between touches that buffer (the copy reads or writes it meanwhile).
fn verify_transfers(plan: &Plan) -> Result<()> {
    let compute = plan.compute_tier();
    let ops = &plan.schedule.ops;
    for (i, e) in ops.iter().enumerate() {
        let Op::Transfer { from, to } = e.op else {
            // An update on the host runs where its state is (pinned RAM), the rest on the
            // compute tier.
            let on = match e.runs_on_host(&plan.buffers, compute) {
                true => Tier::Host,
                false => compute,
            };
            let mut elsewhere = None;
            if !matches!(e.op, Op::AwaitTransfers { .. }) {
                e.buffers(|id, _| {
                    let b = plan.buffer(id);
                    if b.placement.tier != on && !b.is_owned() {
                        elsewhere.get_or_insert(b);
                    }
                });
            }
            if let Some(b) = elsewhere {
                bail!(
                    "internal error: op {} touches {}, which is on {} (the op computes on {})",
                    e.name,
                    b.name,
                    b.placement.tier.describe(),
                    on.describe()
                );
            }
            continue;
        };
        let (stage, home) = match plan.buffer(from).placement.tier == compute {
            true => (from, to),
            false => (to, from),
        };
        let awaits =
            |x: &OpEntry| matches!(&x.op, Op::AwaitTransfers { bufs } if bufs.contains(&stage));
        let Some(k) = ops[i + 1..].iter().position(awaits) else {
            bail!("internal error: transfer {} is never awaited", e.name);
        };
        // Nothing touches either end meanwhile: the device copy (ops on the compute tier)
        // or the home (an update on the host).
        let meddles = |x: &OpEntry| {
            !matches!(x.op, Op::Transfer { .. }) && (x.touches(stage) || x.touches(home))
        };
        if let Some(x) = ops[i + 1..i + 1 + k].iter().find(|x| meddles(x)) {
            let moved = if x.touches(stage) { stage } else { home };
            bail!(
                "internal error: op {} touches {} while transfer {} moves it",
                x.name,
                plan.buffer(moved).name,
                e.name
            );
        }
    }
    Ok(())
}

/// Checks that every collective is awaited later in the step, and that no op in between
/// touches its buffers (the communication thread works on them meanwhile).
fn verify_collectives(plan: &Plan) -> Result<()> {
    let ops = &plan.schedule.ops;
    for (i, e) in ops.iter().enumerate() {
        let Some(buf) = e.op.collective_buf() else {
            continue;
        };
        let awaited = ops[i + 1..]
            .iter()
            .position(|x| matches!(&x.op, Op::AwaitCollective { bufs } if bufs[0] == buf))
            .map(|k| i + 1 + k);
        let Some(end) = awaited else {
            bail!("internal error: collective {} is never awaited", e.name);
        };
        for x in &ops[i + 1..end] {
            if x.conflicts(e) && x.op.collective_buf().is_none() {
                bail!(
                    "internal error: op {} touches the buffers of collective {} before it is awaited",
                    x.name,
                    e.name
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DeviceKind;

    /// A llama-tiny plan for a GPU with everything offloaded to pinned RAM.
    fn offloaded() -> Plan {
        let spec = ModelSpec::preset("llama-tiny").unwrap();
        let mut cfg = StepConfig::new(2, 32, 1);
        cfg.offload.set = OffloadSet::ALL;
        build_plan(&spec, &cfg, Mode::Train, DeviceKind::Cuda.sizing()).unwrap()
    }

    /// The first read into a staging copy: (the transfer's index, its wait's, the copy).
    fn first_read(plan: &Plan) -> (usize, usize, BufId) {
        let ops = &plan.schedule.ops;
        let (i, to) = ops
            .iter()
            .enumerate()
            .find_map(|(i, e)| match e.op {
                Op::Transfer { from, to } if plan.buffer(from).placement.tier == Tier::Host => {
                    Some((i, to))
                }
                _ => None,
            })
            .unwrap();
        let waits = |e: &OpEntry| matches!(&e.op, Op::AwaitTransfers { bufs } if bufs == &[to]);
        let w = i + ops[i..].iter().position(waits).unwrap();
        (i, w, to)
    }

    #[test]
    fn transfers_are_verified_awaited_before_use_and_ops_compute_on_the_compute_tier() {
        let plan = offloaded();
        verify_ops(&plan).unwrap();
        let (i, w, to) = first_read(&plan);

        // The wait moved past the copy's first use.
        let mut late = plan.clone();
        let wait = late.schedule.ops.remove(w);
        let used = w + late.schedule.ops[w..]
            .iter()
            .position(|e| e.touches(to))
            .unwrap();
        assert!(!matches!(
            late.schedule.ops[used].op,
            Op::AwaitTransfers { .. }
        ));
        late.schedule.ops.insert(used + 1, wait);
        let e = format!("{:#}", verify_ops(&late).unwrap_err());
        assert!(
            e.contains("while transfer") && e.contains(&plan.buffer(to).name),
            "{e}"
        );

        // The wait gone: the copy is used while the read may still be filling it (or, where
        // a later wait on the same copy comes after those uses, its write-back's, that one
        // is taken for it).
        let mut never = plan.clone();
        never.schedule.ops.remove(w);
        let e = format!("{:#}", verify_ops(&never).unwrap_err());
        let read = &plan.schedule.ops[i].name;
        assert!(
            e.contains(&format!("while transfer {read} moves"))
                || e.contains(&format!("{read} is never awaited")),
            "{e}"
        );
        // And with no wait at all after it.
        let mut unawaited = plan.clone();
        unawaited
            .schedule
            .ops
            .retain(|e| !matches!(&e.op, Op::AwaitTransfers { bufs } if bufs.contains(&to)));
        let e = format!("{:#}", verify_ops(&unawaited).unwrap_err());
        assert!(e.contains(&format!("{read} is never awaited")), "{e}");

        // An op reading the home in pinned RAM instead of its copy on the device.
        let Op::Transfer { from: home, .. } = plan.schedule.ops[i].op else {
            unreachable!()
        };
        let mut home_read = plan.clone();
        let user = w
            + 1
            + plan.schedule.ops[w + 1..]
                .iter()
                .position(|e| e.touches(to))
                .unwrap();
        home_read.schedule.ops[user].rename(to, home);
        let e = format!("{:#}", verify_ops(&home_read).unwrap_err());
        assert!(
            e.contains("which is on RAM") && e.contains("device memory"),
            "{e}"
        );

        // The update on the host (in place, in pinned RAM) moved to between the read of its
        // weights and that read's wait: it would write them while the copy reads them.
        let on_host = |e: &OpEntry| e.runs_on_host(&plan.buffers, Tier::Device) && e.touches(home);
        let u = plan.schedule.ops.iter().position(on_host).unwrap();
        assert!(u < i, "the update runs before its weights are read");
        let mut racing = plan.clone();
        let update = racing.schedule.ops.remove(u);
        racing.schedule.ops.insert(i, update);
        let e = format!("{:#}", verify_ops(&racing).unwrap_err());
        assert!(
            e.contains(&format!(
                "touches {} while transfer {read}",
                plan.buffer(home).name
            )),
            "{e}"
        );
        // And an update on the host given a buffer on the device (its first moment).
        let mut astray = plan.clone();
        let Op::AdamW { state, .. } = &plan.schedule.ops[u].op else {
            unreachable!()
        };
        astray.schedule.ops[u].rename(state.m, to);
        let e = format!("{:#}", verify_ops(&astray).unwrap_err());
        assert!(
            e.contains("which is on device memory (the op computes on RAM)"),
            "{e}"
        );
    }
}
