//! Walks a plan's schedule on a backend. The backend ([`crate::backend::Device`]) holds the
//! plan's memory and runs one op at a time; the executor decides which ops run (a training
//! step, its optimizer phase, a forward-only evaluation, a generation prefix), keeps the
//! step's scalars (loss scale, gradient norm, whether the update is skipped) and moves bytes
//! between the host and plan buffers only through the backend's download and upload.
//!
//! With a deferred update ([`crate::ir::Schedule::deferred_update`]) a step settles its
//! update at its end (norm, clipping, skip: known then) and keeps it pending; the next step's
//! forward applies it, and [`Executor::finish_update`] runs the `Optimizer` ops to finish it
//! before a checkpoint, an evaluation, a read of the weights or the end of a bench. The
//! weights and moments refuse to be read while an update is pending. Same ops on the same
//! values: the weights are bitwise those of an update at the end of each step.
//!
//! Collectives are device ops like transfers: the device starts each on its communication
//! thread when the schedule reaches it, and the ops wait at their `AwaitCollective`; where
//! the thread would have no core of its own (`dist::comm_thread_wanted`,
//! `Executor::set_comm_thread`) the device runs them inline instead, with the same bits.

use crate::backend::{AdamWStep, Backend, CommSpan, Device, IoSpan, StepCtx};
use crate::data::examples::{EXAMPLE_START, UNTRAINED};
use crate::dist::{Comm, Comms, Single};
use crate::dtype::DType;
use crate::dtype::GgmlType;
use crate::ir::schedule::{Op, Phase};
use crate::ir::{Axis, BufId, IGNORE_TARGET, OptimBufs, OptimState, Update};
use crate::ir::{Moments, MomentsMut};
use crate::plan::{Mode, Plan};
use crate::profile::record::{Direction, OpRecorder, Span, Track, micros};
use anyhow::{Context, Result, bail};
use half::{bf16, f16};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

mod checkpoint;

/// Optimizer hyperparameters for one step.
#[derive(Clone, Debug)]
pub struct OptimHparams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Clip the global gradient norm to this value (0 disables clipping).
    pub grad_clip: f32,
    /// 1-based AdamW step number (bias correction).
    pub step: u64,
}

/// The seed of step `step`'s dropout masks in a run of `seed`: a pure function of the two,
/// so a resumed run draws an uninterrupted one's masks.
pub fn dropout_seed(seed: u64, step: u64) -> u64 {
    // Apart from the data's streams (batch k is `Rng::stream(seed, k)`).
    crate::util::rng::Rng::stream(seed ^ 0x6C6F_7261_6472_6F70, step).next_u64()
}

/// What one training step reports.
#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    /// Mean cross-entropy over the batch's trained target tokens (every rank's).
    pub loss: f32,
    /// Global gradient L2 norm before clipping (of the unscaled gradients).
    pub grad_norm: f32,
    /// The update was skipped because the gradients were not finite (fp16 overflow).
    pub skipped: bool,
    /// Seconds the device spent in collectives; 0 for one process.
    pub comm_s: f64,
    /// Seconds the ops waited for collectives (communication not hidden by compute).
    pub comm_wait_s: f64,
    /// Bytes this rank sent during the step, as the transport counted them.
    pub comm_bytes: u64,
    /// The targets the loss is the mean over (every rank's trained targets); 0: nothing was
    /// trained and the update was skipped.
    pub loss_tokens: usize,
}

/// What the optimizer phase reports.
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    pub grad_norm: f32,
    pub skipped: bool,
}

/// Executes plans: owns the plan and the started backend holding its memory.
pub struct Executor {
    pub plan: Plan,
    device: Box<dyn Device>,
    /// The loss is multiplied by this before backward (fp16 loss scaling; 1 otherwise).
    loss_scale: f32,
    /// The seed of the next steps' dropout masks ([`Executor::set_dropout_seed`]).
    dropout_seed: u64,
    /// Records each executed op's span when profiling (see [`Executor::record_ops`]).
    recorder: Option<OpRecorder>,
    /// The device's transfers between tiers while ops were recorded, reserved for one step's
    /// (see [`Executor::take_io_spans`]).
    io_spans: Vec<IoSpan>,
    /// Next-token logits downloaded by [`Executor::next_token_logits`].
    logits: Vec<f32>,
    /// The op indices of a segment of [`Executor::forward_watching`], reused.
    segment: Vec<usize>,
    /// The plan buffer the `GradNorm` ops write each group's share of the norm into
    /// (`grad_norm.shares` `[groups]` f64; training plans), read once when the update is
    /// settled.
    norm_shares: Option<BufId>,
    /// With a deferred update ([`crate::ir::Schedule::deferred_update`]): the update the
    /// last step settled, which the next step's forward (or [`Executor::finish_update`])
    /// applies. The weights and moments are not readable while it is pending.
    pending: Option<AdamWStep>,
    /// The device's collectives while ops were recorded, reserved for one step's (see
    /// [`Executor::take_io_spans`]).
    comm_spans: Vec<CommSpan>,
    /// The ranks running this plan together (the whole job; one process: `Single`).
    comm: Arc<dyn Comm>,
    /// Its communicators along the mesh's axes: the step's scalars (trained-token counts,
    /// losses, sharded norm shares) go along the data axis, a tensor-parallel norm's along
    /// the tensor axis.
    comms: Comms,
    /// Per gradient-norm slot (`GradNorm::slot`), whether its gradients are the same on
    /// every tensor rank (tensors held whole: counted once) rather than each rank's part.
    whole_slots: Vec<bool>,
    /// The trained targets of the batch last uploaded: this rank's, and every rank's (the
    /// step's loss is the mean over the latter, [`StepCtx::loss_tokens`]).
    loss_tokens: LossTokens,
}

/// How many targets of a batch are trained (the divisor of its mean loss).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LossTokens {
    /// This rank's.
    mine: usize,
    /// Every rank's together.
    all: usize,
}

/// The moments of `format` over their buffers' bytes (m, v, then the int8 scales).
fn moments<'a>(format: OptimState, b: &[&'a [u8]]) -> Moments<'a> {
    match format {
        OptimState::F32 => Moments::F32 {
            m: pod::cast(b[0]),
            v: pod::cast(b[1]),
        },
        OptimState::Bf16 => Moments::Bf16 {
            m: pod::cast(b[0]),
            v: pod::cast(b[1]),
        },
        OptimState::Int8 => Moments::Int8 {
            m: pod::cast(b[0]),
            v: pod::cast(b[1]),
            m_absmax: pod::cast(b[2]),
            v_absmax: pod::cast(b[3]),
        },
    }
}

/// The writable moments of `format` over their buffers' bytes (m, v, then the int8 scales).
fn moments_mut<'a>(format: OptimState, b: &'a mut [&mut [u8]]) -> MomentsMut<'a> {
    match (format, b) {
        (OptimState::F32, [m, v]) => MomentsMut::F32 {
            m: pod::cast_mut(m),
            v: pod::cast_mut(v),
        },
        (OptimState::Bf16, [m, v]) => MomentsMut::Bf16 {
            m: pod::cast_mut(m),
            v: pod::cast_mut(v),
        },
        (OptimState::Int8, [m, v, ms, vs]) => MomentsMut::Int8 {
            m: pod::cast_mut(m),
            v: pod::cast_mut(v),
            m_absmax: pod::cast_mut(ms),
            v_absmax: pod::cast_mut(vs),
        },
        _ => unreachable!("moment buffers match their format"),
    }
}

fn pod_bytes(v: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding; any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 8) }
}

fn pod_bytes_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: as in `pod_bytes`, borrowed exclusively.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 8) }
}

/// Typed views of plan buffers' bytes (every dtype of a plan is plain old data, and every
/// buffer starts at an offset aligned for it).
mod pod {
    pub fn cast<T: Copy>(b: &[u8]) -> &[T] {
        assert!(b.as_ptr().cast::<T>().is_aligned() && b.len().is_multiple_of(size_of::<T>()));
        // SAFETY: aligned, in bounds, and T is one of the plan's plain element types.
        unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len() / size_of::<T>()) }
    }

    pub fn cast_mut<T: Copy>(b: &mut [u8]) -> &mut [T] {
        assert!(b.as_ptr().cast::<T>().is_aligned() && b.len().is_multiple_of(size_of::<T>()));
        // SAFETY: as in `cast`, and the bytes are borrowed exclusively.
        unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast(), b.len() / size_of::<T>()) }
    }
}

/// Values of a quantized base tensor filled and quantized at a time ([`Executor::fill_base`]):
/// A step that trains no target (every row of every rank's batch untrained) updates
/// nothing: its gradients are zero, and AdamW would still decay the weights and moments, so
/// the update is skipped (as a step with non-finite gradients is).
fn untrained_skips(
    (o, update): (StepOutcome, Option<AdamWStep>),
    loss_tokens: usize,
) -> (StepOutcome, Option<AdamWStep>) {
    if loss_tokens == 0 {
        (StepOutcome { skipped: true, ..o }, None)
    } else {
        (o, update)
    }
}

/// 4 MiB of f32, a whole number of blocks of every type memwall quantizes to.
pub const QUANT_PIECE: usize = 1 << 20;

impl Executor {
    /// Starts the plan on `backend` (allocates and touches its memory).
    pub fn on(plan: Plan, backend: &dyn Backend) -> Result<Executor> {
        Executor::among(plan, backend, Arc::new(Single))
    }

    /// Starts one rank's plan on `backend`, its collectives run among `comm`'s ranks (as
    /// many as the plan was made for, this process being the plan's rank).
    pub fn among(plan: Plan, backend: &dyn Backend, comm: Arc<dyn Comm>) -> Result<Executor> {
        let norm_shares = plan.schedule.ops.iter().find_map(|e| match e.op {
            Op::GradNorm { out, .. } => Some(out),
            _ => None,
        });
        // One communicator per axis of the plan's mesh (which must be this job's).
        let comms = Comms::new(comm.clone(), &plan.cfg.mesh)
            .context("internal error: a plan made for another job's ranks")?;
        let whole_slots = whole_slots(&plan);
        let device = backend.start(&plan.program(), comms.clone())?;
        // Until a batch says otherwise, every target is trained.
        let mine = plan.schedule.tokens.len() * plan.cfg.batch * plan.cfg.seq;
        let loss_tokens = LossTokens {
            mine,
            all: mine * plan.cfg.mesh.data,
        };
        Ok(Executor {
            loss_tokens,
            plan,
            device,
            loss_scale: 1.0,
            dropout_seed: 0,
            recorder: None,
            io_spans: Vec::new(),
            logits: Vec::new(),
            segment: Vec::new(),
            norm_shares,
            pending: None,
            comm,
            comms,
            whole_slots,
            comm_spans: Vec::new(),
        })
    }

    /// Runs collectives beside the ops that follow them (`true`, the default: the CPU
    /// device's communication thread) or inline, each where its op starts it (for machines
    /// with no core to spare for the thread, [`crate::dist::comm_thread_wanted`]). Either
    /// way the results are the same bits: the plan keeps a collective's buffers apart until
    /// its await ([`Device::overlap_collectives`]).
    pub fn set_comm_thread(&mut self, on: bool) {
        self.device.overlap_collectives(on);
    }

    /// The ranks this executor runs with.
    pub fn comm(&self) -> &dyn Comm {
        &*self.comm
    }

    /// Whether parameters are sharded (`--zero 3`): each rank holds its shards only.
    fn params_sharded(&self) -> bool {
        self.plan
            .cfg
            .sharding()
            .is_some_and(|s| s.zero.shards_params())
    }

    /// Whether the AdamW moments are sharded (`--zero 1` and up).
    fn moments_sharded(&self) -> bool {
        self.plan
            .cfg
            .sharding()
            .is_some_and(|s| s.zero.shards_optimizer())
    }

    /// The parameter elements moment set `k` holds: the whole model's, a group's, or this
    /// rank's shard of group `k` (owned elements only; the padding holds no parameter).
    fn moment_elems(&self, k: usize, o: &OptimBufs) -> Range<usize> {
        match self.moments_sharded() {
            true => self.plan.cuts[k].owned(
                &self.plan.layout.group_range(&self.plan.layout.groups[k]),
                self.plan.cfg.mesh.data_rank(),
            ),
            false => o.base..o.base + self.plan.buffer(o.m).elems,
        }
    }

    /// The parameter buffers where they live between steps, one row per buffer (one, or one
    /// per group), as [`Executor::gather`] takes them.
    fn param_sets(&self) -> Vec<Vec<(BufId, usize)>> {
        let params = &self.plan.schedule.implicit.params;
        params
            .segments
            .iter()
            .map(|s| vec![(s.buf, s.range.len() * 4)])
            .collect()
    }

    /// Lends `f` the flat fp32 parameters (layout: `plan.layout`; the master weights under
    /// mixed precision). Parameters kept per group (offloaded) are gathered into one host
    /// copy first, group by group ([`Executor::save_checkpoint`] streams them instead).
    pub fn with_params<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        self.settled()?;
        self.not_sharded("the parameters", self.params_sharded())?;
        let sets = self.param_sets();
        let mut f = Some(f);
        if let [whole] = &sets[..] {
            let mut out = None;
            self.device.download(&[whole[0].0], &mut |b| {
                out = Some((f.take().expect("called once"))(pod::cast(b[0])))
            })?;
            return Ok(out.expect("download calls back"));
        }
        let joined = self.gather(&sets)?;
        let (v, len) = &joined[0];
        Ok((f.take().expect("called once"))(pod::cast(
            &pod_bytes(v)[..*len],
        )))
    }

    /// Lends `f` the parameters to change; they are on the backend when it returns.
    pub fn with_params_mut<R>(&mut self, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
        self.settled()?;
        self.not_sharded("the parameters", self.params_sharded())?;
        let sets = self.param_sets();
        let mut f = Some(f);
        if let [whole] = &sets[..] {
            let mut out = None;
            self.device.upload(&[whole[0].0], &mut |b| {
                out = Some((f.take().expect("called once"))(pod::cast_mut(b[0])))
            })?;
            return Ok(out.expect("upload calls back"));
        }
        let mut joined = self.joined(&sets);
        let (v, len) = &mut joined[0];
        let out = (f.take().expect("called once"))(pod::cast_mut(&mut pod_bytes_mut(v)[..*len]));
        self.scatter(&sets, &joined)?;
        Ok(out)
    }

    /// Lends `f` the parameters buffer by buffer, in parameter order (one call for
    /// parameters in RAM, one per group on the disk tier), each with its element range; each
    /// is on the backend before the next is lent. No whole host copy is made.
    pub fn fill_params(
        &mut self,
        mut f: impl FnMut(std::ops::Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        self.settled()?;
        let segments = self.plan.schedule.implicit.params.segments.clone();
        for s in segments.into_iter().filter(|s| !s.range.is_empty()) {
            let mut out = Ok(());
            self.device.upload(&[s.buf], &mut |b| {
                out = f(s.range.clone(), &mut pod::cast_mut(b[0])[..s.range.len()]);
            })?;
            out?;
        }
        Ok(())
    }

    /// Lends `f` a LoRA plan's frozen base weights to fill (layout: the base's,
    /// [`crate::plan::LoraPlan::base`]), in parameter order, a tensor per call with its
    /// element range, as [`Executor::fill_params`] does the trainable parameters (on
    /// [`Executor::fill_base_bytes`]). Where the base is kept quantized (`--base-quant`), `f`
    /// fills a piece of a tensor at a time ([`QUANT_PIECE`] values, whole blocks) into one f32 scratch, which is quantized
    /// into the plan's buffer (llama.cpp's reference quantizers: blocks never straddle a
    /// row, so piece by piece is row by row): the host holds 4 MiB in f32 beyond the plan.
    pub fn fill_base(
        &mut self,
        mut f: impl FnMut(std::ops::Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let mut values = Vec::new();
        self.fill_base_bytes(|t, storage, bytes| {
            let Some(ty) = storage else {
                return f(t.range.clone(), pod::cast_mut(bytes));
            };
            // A piece of whole blocks at a time (blocks never straddle a row), quantized
            // into the tensor's bytes.
            values.resize(QUANT_PIECE.min(t.range.len()), 0f32);
            let at = |i: usize| ty.bytes_for(i as u64).expect("whole blocks") as usize;
            for lo in t.range.clone().step_by(QUANT_PIECE) {
                let piece = lo..(lo + QUANT_PIECE).min(t.range.end);
                let v = &mut values[..piece.len()];
                f(piece.clone(), v)?;
                let b = &mut bytes[at(piece.start - t.range.start)..at(piece.end - t.range.start)];
                crate::gguf::quantize::quantize(ty, v, b)
                    .with_context(|| format!("quantizing {} to {ty}", t.name))?;
            }
            Ok(())
        })
    }

    /// Lends `f` the bytes of each base tensor where a LoRA plan keeps it, in parameter
    /// order, with its storage (`Some(ty)`: ggml blocks of `ty`; `None`: f32 values): how a
    /// base kept as a GGUF file's blocks is filled (`--base-quant keep`), copied, not
    /// converted.
    pub fn fill_base_bytes(
        &mut self,
        mut f: impl FnMut(&crate::model::ParamTensor, Option<GgmlType>, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.settled()?;
        let (Some(base), Some(lora)) = (
            self.plan.schedule.implicit.base.clone(),
            self.plan.lora.clone(),
        ) else {
            bail!("internal error: fill_base_bytes on a plan without a frozen base");
        };
        for s in base.segments.into_iter().filter(|s| !s.range.is_empty()) {
            // Tensors are whole rows, and a row of blocks whole blocks.
            let dtype = self.plan.buffer(s.buf).dtype;
            let at = |i: usize| dtype.bytes_for(i as u64).expect("whole blocks") as usize;
            let mut out = Ok(());
            self.device.upload(&[s.buf], &mut |b| {
                let inside = lora
                    .base
                    .tensors
                    .iter()
                    .filter(|t| s.range.start <= t.range.start && t.range.end <= s.range.end);
                for t in inside {
                    let bytes = at(t.range.start - s.range.start)..at(t.range.end - s.range.start);
                    out = f(t, dtype.ggml(), &mut b[0][bytes]);
                    if out.is_err() {
                        return;
                    }
                }
            })?;
            out?;
        }
        Ok(())
    }

    /// A copy of the parameters (an error where they cannot be read: a disk-tier read, a
    /// device's copy).
    pub fn download_params(&self) -> Result<Vec<f32>> {
        self.with_params(|p| p.to_vec())
    }

    /// What a failed download or upload of `ids` says: the direction and the buffers' names.
    fn moving(&self, direction: &str, ids: &[BufId]) -> String {
        let mut names = ids.iter().map(|&id| self.plan.buffer(id).name.as_str());
        let first = names.next().unwrap_or("no buffer");
        match ids.len() {
            0 | 1 => format!("{direction} plan buffer {first}"),
            n => format!("{direction} plan buffers {first} and {} more", n - 1),
        }
    }

    /// Gradients of the last [`Executor::compute_gradients`] as f32, in parameter order
    /// (training plans only; scaled by the loss scale).
    pub fn download_grads(&self) -> Result<Vec<f32>> {
        let grads = self
            .plan
            .schedule
            .implicit
            .grads
            .as_ref()
            .expect("training plan");
        let ids: Vec<BufId> = grads.segments.iter().map(|s| s.buf).collect();
        let storage = self.plan.buffer(ids[0]).dtype;
        let mut out = Vec::with_capacity(self.plan.layout.total);
        self.device
            .download(&ids, &mut |bufs| {
                for b in bufs {
                    match storage {
                        DType::Bf16 => out.extend(pod::cast::<bf16>(b).iter().map(|x| x.to_f32())),
                        DType::F16 => out.extend(pod::cast::<f16>(b).iter().map(|x| x.to_f32())),
                        _ => out.extend_from_slice(pod::cast::<f32>(b)),
                    }
                }
            })
            .with_context(|| self.moving("downloading", &ids))?;
        Ok(out)
    }

    /// The AdamW moment buffers where they live between steps: one set, or one per group.
    fn moment_sets(&self) -> Vec<Vec<(BufId, usize)>> {
        let sets = self.plan.schedule.implicit.optim.as_deref();
        sets.expect("training plan")
            .iter()
            .map(|o| {
                o.ids()
                    .into_iter()
                    .map(|id| (id, self.plan.buffer(id).bytes as usize))
                    .collect()
            })
            .collect()
    }

    /// Refuses a whole-array read of state sharded among ranks (checkpoints gather it).
    fn not_sharded(&self, what: &str, sharded: bool) -> Result<()> {
        if sharded {
            bail!(
                "internal error: {what} are sharded among {} ranks; read them from a checkpoint",
                self.plan.cfg.mesh.data
            );
        }
        Ok(())
    }

    fn moment_format(&self) -> OptimState {
        self.plan.cfg.optim_state
    }

    /// Lends `f` the AdamW moments in their stored format. Moments kept per parameter group
    /// (offloaded) are gathered into one host copy first, group by group
    /// ([`Executor::save_checkpoint`] streams them instead).
    pub fn with_moments<R>(&self, f: impl FnOnce(Moments<'_>) -> R) -> Result<R> {
        self.settled()?;
        self.not_sharded("the optimizer moments", self.moments_sharded())?;
        let sets = self.moment_sets();
        let format = self.moment_format();
        let mut f = Some(f);
        if let [whole] = &sets[..] {
            let ids: Vec<BufId> = whole.iter().map(|w| w.0).collect();
            let mut out = None;
            self.device.download(&ids, &mut |b| {
                out = Some((f.take().expect("called once"))(moments(format, b)))
            })?;
            return Ok(out.expect("download calls back"));
        }
        let joined = self.gather(&sets)?;
        let views: Vec<&[u8]> = joined
            .iter()
            .map(|(v, len)| &pod_bytes(v)[..*len])
            .collect();
        Ok((f.take().expect("called once"))(moments(format, &views)))
    }

    /// Lends `f` the AdamW moments to fill, set by set in parameter order (one call for
    /// moments in RAM, one per group on the disk tier), each with its parameter range and
    /// 8-bit block range; each is on the backend before the next is lent. No whole host
    /// copy is made (resume: [`crate::ckpt::load_trainer_state_by`]).
    pub fn fill_moments(
        &mut self,
        mut f: impl FnMut(Range<usize>, Range<usize>, MomentsMut<'_>) -> Result<()>,
    ) -> Result<()> {
        self.settled()?;
        let format = self.moment_format();
        let sets = self
            .plan
            .schedule
            .implicit
            .optim
            .clone()
            .unwrap_or_default();
        for (k, o) in sets.iter().enumerate() {
            let elems = self.moment_elems(k, o);
            let blocks = match o.m_scale {
                Some(s) => o.block_base..o.block_base + self.plan.buffer(s).elems,
                None => o.block_base..o.block_base,
            };
            // A tensor rank's shard may hold no element of its part and yet the scales of
            // blocks the other parts' elements are in (`plan::block_scales`).
            if elems.is_empty() && blocks.is_empty() {
                continue;
            }
            // A shard's padding holds no parameter: m and v are lent for the owned
            // elements only (the whole buffers everywhere else).
            let lens = [o.m, o.v].map(|id| {
                let dtype = self.plan.buffer(id).dtype;
                dtype
                    .bytes_for(elems.len() as u64)
                    .unwrap_or_else(|| panic!("internal error: moments of {dtype}"))
                    as usize
            });
            let mut out = Ok(());
            self.device.upload(&o.ids(), &mut |b| {
                let mut b: Vec<&mut [u8]> = b.iter_mut().map(|x| &mut **x).collect();
                for (x, len) in b.iter_mut().zip(lens) {
                    *x = &mut std::mem::take(x)[..len];
                }
                out = f(elems.clone(), blocks.clone(), moments_mut(format, &mut b));
            })?;
            out?;
        }
        Ok(())
    }

    /// Refuses to lend the weights or moments while an update is pending.
    fn settled(&self) -> Result<()> {
        if self.pending.is_some() {
            bail!(
                "internal error: the last step's update is still pending (Executor::finish_update applies it)"
            );
        }
        Ok(())
    }

    /// Zeroed 8-byte-aligned host buffers, one per column of `sets` (rows: parameter groups;
    /// columns: kinds of buffer, e.g. m and v), each as long as its column's buffers together.
    fn joined(&self, sets: &[Vec<(BufId, usize)>]) -> Vec<(Vec<u64>, usize)> {
        (0..sets[0].len())
            .map(|k| {
                let len: usize = sets.iter().map(|s| s[k].1).sum();
                (vec![0u64; len.div_ceil(8)], len)
            })
            .collect()
    }

    /// The buffers of `sets` joined column by column into host copies, read row by row.
    /// (Each buffer's first `used` bytes: a buffer padded for collectives holds more.)
    fn gather(&self, sets: &[Vec<(BufId, usize)>]) -> Result<Vec<(Vec<u64>, usize)>> {
        let mut joined = self.joined(sets);
        let mut at = vec![0usize; joined.len()];
        for set in sets {
            let ids: Vec<BufId> = set.iter().map(|s| s.0).collect();
            self.device.download(&ids, &mut |b| {
                for (k, part) in b.iter().enumerate() {
                    let part = &part[..set[k].1];
                    pod_bytes_mut(&mut joined[k].0)[at[k]..at[k] + part.len()]
                        .copy_from_slice(part);
                    at[k] += part.len();
                }
            })?;
        }
        Ok(joined)
    }

    /// Writes host copies `joined` (as [`Executor::gather`] makes them) back, row by row.
    fn scatter(
        &mut self,
        sets: &[Vec<(BufId, usize)>],
        joined: &[(Vec<u64>, usize)],
    ) -> Result<()> {
        let mut at = vec![0usize; joined.len()];
        for set in sets {
            let ids: Vec<BufId> = set.iter().map(|s| s.0).collect();
            self.device.upload(&ids, &mut |b| {
                for (k, part) in b.iter_mut().enumerate() {
                    let n = set[k].1;
                    let part = &mut part[..n];
                    part.copy_from_slice(&pod_bytes(&joined[k].0)[at[k]..at[k] + n]);
                    at[k] += n;
                }
            })?;
        }
        Ok(())
    }

    /// What the backend has to say once about its disk tier (e.g. a buffered-I/O fallback).
    pub fn offload_note(&self) -> Option<String> {
        self.device.offload_note()
    }

    /// The device's memory in use now ([`crate::backend::Device::memory_in_use`]; `None` on
    /// the CPU).
    pub fn device_memory_in_use(&self) -> Option<u64> {
        self.device.memory_in_use()
    }

    /// Time the backend has spent on disk-tier transfers since it started.
    pub fn io_time(&self) -> crate::backend::IoTime {
        self.device.io_time()
    }

    /// Sets the factor the loss is multiplied by before backward (fp16 loss scaling).
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    /// Sets the seed of the dropout masks of the training steps that follow (`--lora-dropout`:
    /// the trainer gives each step its own, [`dropout_seed`]); 0 until set.
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.dropout_seed = seed;
    }

    /// Copies a batch `[accum·B, T+1]` of raw text into the plan's token (and target)
    /// buffers: rows k·B..(k+1)·B go to micro-batch k; every target is trained.
    pub fn upload_batch(&mut self, batch: &[u32]) -> Result<()> {
        let mine = self.stage(batch, false)?;
        self.loss_tokens = LossTokens {
            mine,
            all: mine * self.plan.cfg.mesh.data,
        };
        Ok(())
    }

    /// Copies a batch `[accum·B, T+1]` of examples (rows as [`crate::data::examples`] draws
    /// them: a token with [`UNTRAINED`] set is not trained as a target) into the plan's token
    /// and target buffers, untrained targets as [`IGNORE_TARGET`]. The step's loss is the mean
    /// over the trained targets of every rank's batch: ranks exchange their counts (one
    /// scalar each) here, before the step.
    pub fn upload_examples(&mut self, batch: &[u32]) -> Result<()> {
        let mine = self.stage(batch, true)?;
        let data = self.comms.along(Axis::Data);
        let all = if data.size() > 1 {
            let mut every = vec![0u64; data.size()];
            crate::dist::ring::gather_values(&**data, &[mine as u64], &mut every)
                .context("exchanging the batch's trained-token counts among the ranks")?;
            every.iter().sum::<u64>() as usize
        } else {
            mine
        };
        self.loss_tokens = LossTokens { mine, all };
        Ok(())
    }

    /// Distillation: stages the teacher's final-norm output for the batch last uploaded,
    /// `[micro-batches, B·T, Ct]` in the batch's order (`plan.schedule.teacher_hidden`).
    pub fn upload_teacher(&mut self, hidden: &[f32]) -> Result<()> {
        let ids = self.plan.schedule.teacher_hidden.clone();
        let per = ids.first().map_or(0, |&b| self.plan.buffer(b).elems);
        if ids.is_empty() || hidden.len() != per * ids.len() {
            bail!(
                "internal error: teacher outputs of {} values for {} buffers of {per}",
                hidden.len(),
                ids.len()
            );
        }
        self.device
            .upload(&ids, &mut |bufs| {
                for (k, b) in bufs.iter_mut().enumerate() {
                    pod::cast_mut::<f32>(b).copy_from_slice(&hidden[k * per..(k + 1) * per]);
                }
            })
            .with_context(|| self.moving("uploading", &ids))
    }

    /// Distillation: fills the teacher's LM head `[V, Ct]` (once, before the first step)
    /// with what `fill` writes into it.
    pub fn fill_teacher_head(
        &mut self,
        fill: &mut dyn FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let id = self
            .plan
            .schedule
            .teacher_head
            .context("internal error: a plan without a teacher")?;
        let mut result = Ok(());
        self.device
            .upload(&[id], &mut |bufs| {
                result = fill(pod::cast_mut::<f32>(bufs[0]));
            })
            .with_context(|| self.moving("uploading", &[id]))?;
        result
    }

    /// The trained targets of the batch last uploaded, every rank's: what the step's loss is
    /// the mean over (0: the step trains nothing and its update is skipped).
    pub fn loss_tokens(&self) -> usize {
        self.loss_tokens.all
    }

    /// Stages a batch (see [`Executor::upload_batch`]); `marked`: tokens may carry
    /// [`UNTRAINED`] and [`EXAMPLE_START`]. Returns this rank's trained targets.
    fn stage(&mut self, batch: &[u32], marked: bool) -> Result<usize> {
        let (b, t) = (self.plan.cfg.batch, self.plan.cfg.seq);
        let s = &self.plan.schedule;
        let micro = s.tokens.len();
        if batch.len() != micro * b * (t + 1) {
            bail!(
                "internal error: batch of {} tokens, expected {}",
                batch.len(),
                micro * b * (t + 1)
            );
        }
        let packed = !s.positions.is_empty();
        if marked && !packed && batch.iter().any(|&x| x & EXAMPLE_START != 0) {
            bail!("internal error: a batch of packed rows for a plan without positions");
        }
        let v = self.plan.spec.vocab_size as u32;
        let id = |x: u32| {
            if marked {
                x & !(UNTRAINED | EXAMPLE_START)
            } else {
                x
            }
        };
        if let Some(bad) = batch.iter().map(|&x| id(x)).find(|&x| x >= v) {
            bail!(
                "token id {bad} is outside the model's vocabulary ({v}); was the data prepared for another tokenizer?"
            );
        }
        let target = |x: u32| {
            if marked && x & UNTRAINED != 0 {
                IGNORE_TARGET
            } else {
                id(x)
            }
        };
        let trained = batch
            .chunks(t + 1)
            .map(|row| {
                row[1..]
                    .iter()
                    .filter(|&&x| target(x) != IGNORE_TARGET)
                    .count()
            })
            .sum();
        let mut ids = s.tokens.clone();
        ids.extend(&s.targets);
        ids.extend(&s.positions);
        let with_targets = !s.targets.is_empty();
        self.device
            .upload(&ids, &mut |bufs| {
                let (tokens, rest) = bufs.split_at_mut(micro);
                let (targets, positions) = rest.split_at_mut(if with_targets { micro } else { 0 });
                for (k, rows) in batch.chunks(b * (t + 1)).enumerate() {
                    let tk = pod::cast_mut::<u32>(tokens[k]);
                    for (i, row) in rows.chunks(t + 1).enumerate() {
                        for (d, &x) in tk[i * t..(i + 1) * t].iter_mut().zip(&row[..t]) {
                            *d = id(x);
                        }
                    }
                    if with_targets {
                        let tg = pod::cast_mut::<u32>(targets[k]);
                        for (i, row) in rows.chunks(t + 1).enumerate() {
                            for (d, &x) in tg[i * t..(i + 1) * t].iter_mut().zip(&row[1..]) {
                                *d = target(x);
                            }
                        }
                    }
                    if packed {
                        // Each row's place in its example: 0 at the row's start and at every
                        // token marked as an example's first, counting up in between.
                        let ps = pod::cast_mut::<u32>(positions[k]);
                        for (i, row) in rows.chunks(t + 1).enumerate() {
                            let mut p = 0u32;
                            for (j, (d, &x)) in
                                ps[i * t..(i + 1) * t].iter_mut().zip(&row[..t]).enumerate()
                            {
                                if j > 0 {
                                    p = if marked && x & EXAMPLE_START != 0 {
                                        0
                                    } else {
                                        p + 1
                                    };
                                }
                                *d = p;
                            }
                        }
                    }
                }
            })
            .with_context(|| self.moving("uploading", &ids))?;
        Ok(trained)
    }

    /// One optimizer step on the batch set by [`Executor::upload_batch`]: the whole
    /// schedule in order (so transfers for the update overlap the backward). With a deferred
    /// update, the step applies the previous step's update in its forward and leaves its own
    /// pending (settled: the norm, clipping and whether it is skipped are known); the
    /// weights are readable again after [`Executor::finish_update`]. After an error the
    /// weights in the executor are undefined (a checkpoint is the record).
    pub fn train_step(&mut self, hp: &OptimHparams) -> Result<StepStats> {
        assert_eq!(self.plan.mode, Mode::Train);
        let time_before = self.device.comm_time();
        let sent_before = self.comm.bytes_sent();
        let o = if self.plan.schedule.deferred_update {
            let pending = self.pending.take();
            let ops = self.ops_where(|p| {
                p != Phase::Optimizer && (p != Phase::DeferredUpdate || pending.is_some())
            });
            let ctx = StepCtx {
                update: pending,
                ..self.ctx(true)
            };
            self.run(&ops, ctx, None)?;
            let (o, update) = untrained_skips(self.settle(hp)?, self.loss_tokens.all);
            self.pending = update;
            o
        } else if self.plan.cfg.update == Update::InBackward {
            self.step_updating_in_backward(hp)?
        } else {
            let ops: Vec<usize> = (0..self.plan.schedule.ops.len()).collect();
            let o = self.run(&ops, self.ctx(true), Some(hp))?;
            o.expect("a training step has AdamW ops")
        };
        let time = self.device.comm_time();
        let loss = self.mean_loss()?;
        Ok(StepStats {
            loss,
            grad_norm: o.grad_norm,
            skipped: o.skipped,
            comm_s: time.busy_s - time_before.busy_s,
            comm_wait_s: time.wait_s - time_before.wait_s,
            comm_bytes: self.comm.bytes_sent() - sent_before,
            loss_tokens: self.loss_tokens.all,
        })
    }

    /// A step of a plan whose updates run inside the backward (`--update in-backward`): the
    /// AdamW step is known before the norm (no clipping), so each group's update runs where
    /// the plan put it; the norm is read after the step. A step whose gradients are not
    /// finite cannot be skipped whole (the groups before it in the backward are updated):
    /// the run stops with an error, its last checkpoint untouched.
    fn step_updating_in_backward(&mut self, hp: &OptimHparams) -> Result<StepOutcome> {
        if hp.grad_clip != 0.0 {
            bail!(
                "--update in-backward with --grad-clip {}: clipping by the global gradient \
                 norm needs every gradient before the first update; use --grad-clip 0 (or \
                 --update end)",
                hp.grad_clip
            );
        }
        let (_, step) = clip(0.0, self.loss_scale, hp);
        let ctx = StepCtx {
            update: step.filter(|_| self.loss_tokens.all > 0),
            ..self.ctx(true)
        };
        let ops: Vec<usize> = (0..self.plan.schedule.ops.len()).collect();
        self.run(&ops, ctx, None)?;
        let (o, _) = untrained_skips(self.settle(hp)?, self.loss_tokens.all);
        if !o.grad_norm.is_finite() {
            bail!(
                "the step's gradients are not finite (norm {}), and with --update in-backward \
                 some groups were already updated with them: the run stops here (its last \
                 checkpoint is kept). Resume it with --update end, which skips such a step, \
                 or start a new run from that checkpoint (--init RUN/checkpoints/step-N) with \
                 a lower --lr",
                o.grad_norm
            );
        }
        Ok(o)
    }

    /// Applies the update the last step left pending (plans with a deferred update; does
    /// nothing otherwise): the schedule's `Optimizer` ops. Run before reading or saving the
    /// weights, evaluating, or ending a run.
    pub fn finish_update(&mut self) -> Result<()> {
        let Some(update) = self.pending.take() else {
            return Ok(());
        };
        let ops = self.ops_where(|p| p == Phase::Optimizer);
        let ctx = StepCtx {
            update: Some(update),
            ..self.ctx(true)
        };
        self.run(&ops, ctx, None)?;
        Ok(())
    }

    /// The update from the step's gradient-norm shares (added in parameter order): the
    /// norm, and the AdamW step with clipping, or none when the gradients are not finite.
    fn settle(&mut self, hp: &OptimHparams) -> Result<(StepOutcome, Option<AdamWStep>)> {
        let shares = read_norm_shares(&self.plan, &*self.device, self.norm_shares)?;
        settle(&shares, self.loss_scale, hp, &self.norm_ranks())
    }

    /// Forward and backward: fills the gradients, returns the mean loss (after finishing a
    /// pending update). No update is run (neither phase's, nor their transfers).
    pub fn compute_gradients(&mut self) -> Result<f32> {
        assert_eq!(self.plan.mode, Mode::Train);
        self.gradients_outlive_the_backward()?;
        self.finish_update()?;
        let ops = self.ops_where(|p| !matches!(p, Phase::Optimizer | Phase::DeferredUpdate));
        self.run(&ops, self.ctx(true), None)?;
        self.mean_loss()
    }

    /// Runs the optimizer phase on the gradients of [`Executor::compute_gradients`]:
    /// clipping by the gradient norm (whose shares the backward took) and AdamW, unless the
    /// gradients are not finite. Returns the norm before clipping and whether the update was
    /// skipped.
    pub fn apply_optimizer(&mut self, hp: &OptimHparams) -> Result<StepOutcome> {
        self.gradients_outlive_the_backward()?;
        let ops = self.ops_where(|p| p == Phase::Optimizer);
        let ctx = self.ctx(true);
        Ok(self
            .run(&ops, ctx, Some(hp))?
            .expect("the optimizer phase has AdamW ops"))
    }

    /// Refuses to split a step of a plan whose gradients die inside the backward
    /// (`--update in-backward`), where there are none to read or update afterwards.
    fn gradients_outlive_the_backward(&self) -> Result<()> {
        if self.plan.cfg.update == Update::InBackward {
            bail!(
                "internal error: a plan with --update in-backward has no gradients after its \
                 backward; run its steps whole (train_step)"
            );
        }
        Ok(())
    }

    fn ctx(&self, training: bool) -> StepCtx {
        StepCtx {
            seq: None,
            training,
            loss_scale: self.loss_scale,
            update: None,
            dropout_seed: self.dropout_seed,
            first_micro: self.plan.cfg.mesh.data_rank() * self.plan.schedule.tokens.len(),
            loss_tokens: self.loss_tokens.all,
        }
    }

    /// Indices of the ops whose phase satisfies `keep`, in schedule order.
    fn ops_where(&self, keep: impl Fn(Phase) -> bool) -> Vec<usize> {
        let ops = &self.plan.schedule.ops;
        (0..ops.len()).filter(|&i| keep(ops[i].phase)).collect()
    }

    /// Mean loss on the batch set by [`Executor::upload_batch`], forward only (no state
    /// changes besides activations): every micro-batch's forward ops (gradient zeroing is in
    /// the backward phase).
    pub fn eval_loss(&mut self) -> Result<f32> {
        self.finish_update()?;
        let ops = self.ops_where(|p| p == Phase::Forward);
        self.run(&ops, self.ctx(false), None)?;
        self.mean_loss()
    }

    /// The per-target losses of the last forward, `[micro-batches·B·T]` in batch order (0 for
    /// a target not trained): what the step's mean loss is the mean of.
    pub fn target_losses(&self) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.device
            .download(&self.plan.schedule.losses, &mut |bufs| {
                for b in bufs {
                    out.extend_from_slice(pod::cast::<f32>(b));
                }
            })
            .with_context(|| self.moving("downloading", &self.plan.schedule.losses))?;
        Ok(out)
    }

    /// Mean of the per-row losses over the trained targets of every micro-batch (and every
    /// rank: ranks exchange their sums); 0 when nothing is trained.
    fn mean_loss(&self) -> Result<f32> {
        let mut sum = 0.0f64;
        let stage = self.plan.cfg.pipeline_stage(self.plan.spec.n_layer);
        // Only the last pipeline stage computes the loss: the others add nothing.
        if stage.is_last() {
            self.device
                .download(&self.plan.schedule.losses, &mut |bufs| {
                    for b in bufs {
                        let losses = pod::cast::<f32>(b);
                        sum += losses.iter().map(|&x| x as f64).sum::<f64>();
                    }
                })
                .with_context(|| self.moving("downloading", &self.plan.schedule.losses))?;
        }
        if stage.is_split() {
            let pipeline = self.comms.along(Axis::Pipeline);
            let mut all = vec![0.0f64; stage.size];
            crate::dist::ring::gather_values(&**pipeline, &[sum], &mut all)
                .context("gathering the loss from the last pipeline stage")?;
            sum = all.iter().sum();
        }
        let rows = self.loss_tokens.mine;
        let data = self.comms.along(Axis::Data);
        if data.size() > 1 {
            let mut all = vec![0.0f64; 2 * data.size()];
            crate::dist::ring::gather_values(&**data, &[sum, rows as f64], &mut all)?;
            sum = all.chunks(2).map(|c| c[0]).sum();
            let n: f64 = all.chunks(2).map(|c| c[1]).sum();
            return Ok(if n > 0.0 { (sum / n) as f32 } else { 0.0 });
        }
        Ok(if rows > 0 {
            (sum / rows as f64) as f32
        } else {
            0.0
        })
    }

    /// `Next-token logits [V] after context (generation plans; context.len() ≤ plan seq)`.
    pub fn next_token_logits(&mut self, context: &[u32]) -> Result<&[f32]> {
        assert_eq!(self.plan.mode, Mode::Generate);
        let t = context.len();
        if t == 0 || t > self.plan.cfg.seq {
            bail!(
                "internal error: context of {t} tokens for a plan of {}",
                self.plan.cfg.seq
            );
        }
        let ctx = self.upload_context(context)?;
        let logits = self.plan.schedule.logits.expect("generation plan");
        let ops: Vec<usize> = (0..self.plan.schedule.ops.len()).collect();
        self.run(&ops, ctx, None)?;
        let mut out = std::mem::take(&mut self.logits);
        self.device
            .download(&[logits], &mut |b| {
                out.clear();
                out.extend_from_slice(pod::cast::<f32>(b[0]))
            })
            .with_context(|| self.moving("downloading", &[logits]))?;
        self.logits = out;
        Ok(&self.logits)
    }

    /// Stages `context` (1 to the plan's `seq` tokens, checked by the caller) as a
    /// generation plan's tokens, refusing ids outside the vocabulary; returns the step values
    /// that run its forward on those rows.
    fn upload_context(&mut self, context: &[u32]) -> Result<StepCtx> {
        let v = self.plan.spec.vocab_size as u32;
        if let Some(bad) = context.iter().find(|&&x| x >= v) {
            bail!("token id {bad} is outside the model's vocabulary ({v})");
        }
        let tokens = self.plan.schedule.tokens[0];
        self.device
            .upload(&[tokens], &mut |b| {
                pod::cast_mut::<u32>(b[0])[..context.len()].copy_from_slice(context)
            })
            .with_context(|| self.moving("uploading", &[tokens]))?;
        Ok(StepCtx {
            seq: Some(context.len()),
            ..self.ctx(false)
        })
    }

    /// The forward of a generation plan over `context` (as many tokens as the plan's
    /// `seq`), stopping after each op of `watch` (op index, f32 buffer; in schedule order)
    /// to hand `on` the watch's index and the buffer's contents `[seq, …]`: what an
    /// analysis of the model's activations reads (`prune`'s importance scores), with the
    /// plan's own kernels and memory.
    pub fn forward_watching(
        &mut self,
        context: &[u32],
        watch: &[(usize, BufId)],
        on: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        assert_eq!(self.plan.mode, Mode::Generate);
        if context.len() != self.plan.cfg.seq {
            bail!(
                "internal error: a watched forward of {} tokens for a plan of {}",
                context.len(),
                self.plan.cfg.seq
            );
        }
        let ctx = self.upload_context(context)?;
        let mut next = 0;
        for (k, &(op, buf)) in watch.iter().enumerate() {
            if k > 0 && op < watch[k - 1].0 {
                bail!("internal error: watched ops out of schedule order");
            }
            if op >= next {
                // The ops up to this one (a list kept between calls: the teacher of a
                // distilled run watches every row of every step).
                let mut segment = std::mem::take(&mut self.segment);
                segment.clear();
                segment.extend(next..=op);
                let ran = self.run(&segment, ctx, None);
                self.segment = segment;
                ran?;
                next = op + 1;
            }
            if self.plan.buffer(buf).dtype != DType::F32 {
                bail!(
                    "internal error: watched buffer {} is not f32",
                    self.plan.buffer(buf).name
                );
            }
            let mut handed = Ok(());
            self.device
                .download(&[buf], &mut |b| handed = on(k, pod::cast::<f32>(b[0])))
                .with_context(|| self.moving("downloading", &[buf]))?;
            handed?;
        }
        Ok(())
    }

    /// Starts recording a span per executed op into `recorder` (profiling, `bench --time-ops`),
    /// or stops when `None`; returns the previous recorder with what it holds.
    /// Transfers between tiers (the disk tier's reads and writes) are recorded with the ops;
    /// [`Executor::take_io_spans`] takes them.
    pub fn record_ops(&mut self, recorder: Option<OpRecorder>) -> Option<OpRecorder> {
        if recorder.is_some() {
            let per_step = self.plan.schedule.ops.iter();
            let per_step = per_step.filter(|e| matches!(e.op, Op::Transfer { .. }));
            self.io_spans.reserve(per_step.count());
            let comm = self
                .plan
                .schedule
                .ops
                .iter()
                .filter(|e| self.plan.comm_bytes(e) > 0);
            self.comm_spans.reserve(comm.count());
        }
        std::mem::replace(&mut self.recorder, recorder)
    }

    /// The transfers between tiers the device performed while ops were recorded, since the
    /// last call: one I/O-track span each, named after the host buffer it filled or emptied,
    /// with its bytes and direction, times in microseconds since `epoch` (the recorder's);
    /// then the collectives, one communication-track span each with the bytes this rank sent.
    pub fn take_io_spans(&mut self, epoch: std::time::Instant) -> Vec<Span> {
        let ops = &self.plan.schedule.ops;
        let comm: Vec<Span> = self
            .comm_spans
            .drain(..)
            .filter_map(|s| {
                let e = ops.iter().find(|e| e.op.collective_buf() == Some(s.buf))?;
                Some(Span {
                    track: Track::Communication,
                    name: e.name.clone(),
                    start_us: micros(epoch, s.start),
                    end_us: micros(epoch, s.end),
                    bytes: Some(self.plan.comm_bytes(e)),
                    direction: None,
                    rank: None,
                })
            })
            .collect();
        let spans = self
            .io_spans
            .iter()
            .map(|t| {
                let direction = if t.read {
                    Direction::Read
                } else {
                    Direction::Write
                };
                Span {
                    track: Track::Io,
                    name: format!("{} {}", direction.name(), self.plan.buffer(t.buf).name),
                    start_us: micros(epoch, t.start),
                    end_us: micros(epoch, t.end),
                    bytes: Some(t.bytes),
                    direction: Some(direction),
                    rank: None,
                }
            })
            .chain(comm)
            .collect();
        self.io_spans.clear();
        spans
    }

    /// The active recorder, to take its spans between steps.
    pub fn recorder_mut(&mut self) -> Option<&mut OpRecorder> {
        self.recorder.as_mut()
    }

    /// Runs ops `ops` in order. `GradNorm` ops add their group's share of the norm; with
    /// `hp`, the norm and clipping are settled before the first `AdamW` op (from the shares,
    /// added in parameter order) and returned; `AdamW` ops run with `ctx.update` (settled
    /// or given), or not at all when there is none (gradients not finite). Transfers and
    /// collectives are the device's: their ops start them, their awaits wait for them, and
    /// what a run leaves in flight is waited for at its end. Stops at the first op that
    /// fails (a disk transfer, a lost rank), with its error.
    fn run(
        &mut self,
        ops: &[usize],
        mut ctx: StepCtx,
        hp: Option<&OptimHparams>,
    ) -> Result<Option<StepOutcome>> {
        let mut recorder = self.recorder.take();
        let mut outcome = None;
        let mut failed = None;
        let norm_ranks = self.norm_ranks();
        let (plan, device) = (&self.plan, &*self.device);
        let shares = self.norm_shares;
        let loss_scale = self.loss_scale;
        device.scope(&mut || {
            for &i in ops {
                let e = &plan.schedule.ops[i];
                if matches!(e.op, Op::AdamW { .. } | Op::AdamWBlockMax { .. }) {
                    if let (None, Some(hp)) = (outcome, hp) {
                        let settled = read_norm_shares(plan, device, shares)
                            .and_then(|s| settle(&s, loss_scale, hp, &norm_ranks));
                        match settled {
                            Ok(settled) => {
                                let (o, update) = untrained_skips(settled, ctx.loss_tokens);
                                ctx.update = update;
                                outcome = Some(o);
                            }
                            Err(err) => {
                                failed = Some(err.context("gathering the gradient norm"));
                                return;
                            }
                        }
                    }
                    if ctx.update.is_none() {
                        continue;
                    }
                }
                let t0 = recorder.as_ref().map(|_| Instant::now());
                if let Err(err) = device.run(e, &ctx) {
                    failed = Some(err.context(format!("op {}", e.name)));
                    return;
                }
                if let (Some(r), Some(t0)) = (recorder.as_mut(), t0) {
                    // A queued op is timed to its end (the GPU's stream), not its launch.
                    if device.queues_ops()
                        && let Err(err) = device.sync()
                    {
                        failed = Some(err.context(format!("op {}", e.name)));
                        return;
                    }
                    r.record(i, t0);
                }
            }
        });
        // What is still in flight: a run of part of the schedule, or one that failed.
        if let Err(err) = device.sync() {
            failed.get_or_insert(err);
        }
        self.take_device_spans(recorder.as_mut());
        self.recorder = recorder;
        match failed {
            Some(e) => Err(e),
            None => Ok(outcome),
        }
    }

    /// The transfers and collectives the device ran: kept when recording, within the room
    /// reserved for them (transfers that did not fit counted as dropped); else discarded.
    fn take_device_spans(&mut self, recorder: Option<&mut OpRecorder>) {
        let device = &*self.device;
        match recorder {
            Some(r) => {
                r.dropped += device.take_io_spans(&mut self.io_spans) as usize;
                device.take_comm_spans(&mut self.comm_spans);
            }
            None => {
                device.take_io_spans(&mut Vec::new());
                device.take_comm_spans(&mut Vec::new());
            }
        }
    }
}

/// The gradient-norm shares the `GradNorm` ops wrote into `buf` (one per parameter group,
/// in parameter order): one download.
fn read_norm_shares(plan: &Plan, device: &dyn Device, buf: Option<BufId>) -> Result<Vec<f64>> {
    let buf = buf.context("internal error: a training plan without GradNorm ops")?;
    let mut out = Vec::new();
    device
        .download(&[buf], &mut |b| {
            out.extend_from_slice(pod::cast::<f64>(b[0]))
        })
        .with_context(|| format!("downloading plan buffer {}", plan.buffer(buf).name))?;
    Ok(out)
}

/// Whose gradient-norm shares a rank adds to its own ([`settle`]).
struct NormRanks<'a> {
    /// Sharded gradients (`--zero 1` and up): each data rank's shares cover its shards.
    data: Option<&'a dyn Comm>,
    /// Tensor parallelism: each tensor rank's shares cover its parts of the cut tensors
    /// (the slots not in `whole`), the same on all of them for the whole ones.
    tensor: Option<(&'a dyn Comm, &'a [bool])>,
    /// Pipeline parallelism: each stage's sum of squares covers its layers.
    pipeline: Option<&'a dyn Comm>,
}

impl Executor {
    /// The ranks whose norm shares this one's are added to.
    fn norm_ranks(&self) -> NormRanks<'_> {
        let tensor = self.comms.along(Axis::Tensor);
        NormRanks {
            data: self
                .moments_sharded()
                .then(|| &**self.comms.along(Axis::Data)),
            tensor: (tensor.size() > 1).then(|| (&**tensor, &self.whole_slots[..])),
            pipeline: Some(&**self.comms.along(Axis::Pipeline)).filter(|c| c.size() > 1),
        }
    }
}

/// Per `GradNorm` slot of `plan`, whether it holds whole tensors only (the same on every
/// tensor rank), rather than tensor-parallel parts; the plan's emission keeps the two in
/// separate slots and says which (`parts`: a ZeRO shard's range of a slot may be empty, on
/// some tensor ranks and not others, `plan::zero::int8_cut`).
fn whole_slots(plan: &Plan) -> Vec<bool> {
    let mut whole = Vec::new();
    for e in &plan.schedule.ops {
        if let Op::GradNorm { slot, parts, .. } = &e.op {
            if whole.len() <= *slot {
                whole.resize(*slot + 1, true);
            }
            whole[*slot] = !parts;
        }
    }
    whole
}

/// The update from gradient-norm shares (each group's sum of squares), added in parameter
/// order whatever order the backward took them in (see [`clip`]). With tensor parallelism
/// every tensor rank's shares are gathered: a slot of cut tensors is the sum of its ranks'
/// (in rank order), a slot of whole ones counted once. With sharded gradients each data
/// rank's shares cover its shards: every rank's are gathered and added in (group, rank)
/// order. So every rank settles the same update.
fn settle(
    shares: &[f64],
    loss_scale: f32,
    hp: &OptimHparams,
    ranks: &NormRanks,
) -> Result<(StepOutcome, Option<AdamWStep>)> {
    let mut shares = shares.to_vec();
    if let Some((comm, whole)) = ranks.tensor {
        let n = shares.len();
        let mut all = vec![0.0f64; n * comm.size()];
        crate::dist::ring::gather_values(comm, &shares, &mut all)?;
        for (k, share) in shares.iter_mut().enumerate() {
            if !whole[k] {
                *share = (0..comm.size()).map(|r| all[r * n + k]).sum();
            }
        }
    }
    let sum_sq = match ranks.data {
        Some(comm) if comm.size() > 1 => {
            let mine = shares;
            let mut all = vec![0.0f64; mine.len() * comm.size()];
            crate::dist::ring::gather_values(comm, &mine, &mut all)?;
            (0..mine.len())
                .map(|g| {
                    (0..comm.size())
                        .map(|r| all[r * mine.len() + g])
                        .sum::<f64>()
                })
                .sum()
        }
        _ => shares.iter().sum::<f64>(),
    };
    let sum_sq = match ranks.pipeline {
        Some(comm) => {
            let mut all = vec![0.0f64; comm.size()];
            crate::dist::ring::gather_values(comm, &[sum_sq], &mut all)?;
            all.iter().sum()
        }
        None => sum_sq,
    };
    Ok(clip(sum_sq, loss_scale, hp))
}

/// From the gradients' sum of squares (which carry the loss scale): the norm of the unscaled
/// gradients, and the AdamW step with global-norm clipping, or none when the norm is not
/// finite (the update is skipped).
fn clip(sum_sq: f64, loss_scale: f32, hp: &OptimHparams) -> (StepOutcome, Option<AdamWStep>) {
    let norm = (sum_sq.sqrt() / loss_scale as f64) as f32;
    if !norm.is_finite() {
        let o = StepOutcome {
            grad_norm: norm,
            skipped: true,
        };
        return (o, None);
    }
    let clip = if hp.grad_clip > 0.0 && norm > hp.grad_clip {
        hp.grad_clip / (norm + 1e-6)
    } else {
        1.0
    };
    let step = AdamWStep {
        lr: hp.lr,
        beta1: hp.beta1,
        beta2: hp.beta2,
        eps: hp.eps,
        weight_decay: hp.weight_decay,
        step: hp.step,
        grad_scale: clip / loss_scale,
    };
    let o = StepOutcome {
        grad_norm: norm,
        skipped: false,
    };
    (o, Some(step))
}
