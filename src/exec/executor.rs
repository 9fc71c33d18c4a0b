//! Walks a plan's schedule on a backend. The backend ([`crate::backend::Device`]) holds the
//! plan's memory and runs one op at a time; the executor decides which ops run (a training
//! step, its optimizer phase, a forward-only evaluation, a generation prefix), keeps the
//! step's scalars (loss scale, gradient norm, whether the update is skipped) and moves bytes
//! between the host and plan buffers only through the backend's download and upload.

use crate::backend::cpu::Cpu;
use crate::backend::{AdamWStep, Backend, Device, OpResult, StepCtx};
use crate::ckpt::{Moments, MomentsMut};
use crate::plan::schedule::{Op, OptimBufs, Phase};
use crate::plan::{BufId, DType, Mode, OptimState, Plan};
use crate::profile::record::OpRecorder;
use anyhow::{Result, bail};
use half::{bf16, f16};

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

/// What one training step reports.
#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    /// Mean cross-entropy over the batch's tokens.
    pub loss: f32,
    /// Global gradient L2 norm before clipping (of the unscaled gradients).
    pub grad_norm: f32,
    /// The update was skipped because the gradients were not finite (fp16 overflow).
    pub skipped: bool,
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
    /// Records each executed op's span when profiling (see [`Executor::record_ops`]).
    recorder: Option<OpRecorder>,
    /// Next-token logits downloaded by [`Executor::next_token_logits`].
    logits: Vec<f32>,
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

/// Why a download or upload of arena buffers cannot fail (only disk-tier buffers can).
const HOST_ONLY: &str = "internal error: arena buffers move without I/O";

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

impl Executor {
    /// Starts the plan on the CPU backend with `plan.cfg.threads` workers.
    pub fn new(plan: Plan) -> Result<Executor> {
        Executor::on(plan, &Cpu)
    }

    /// Starts the plan on `backend` (allocates and touches its memory).
    pub fn on(plan: Plan, backend: &dyn Backend) -> Result<Executor> {
        let device = backend.start(&plan)?;
        Ok(Executor {
            plan,
            device,
            loss_scale: 1.0,
            recorder: None,
            logits: Vec::new(),
        })
    }

    /// Lends `f` the flat fp32 parameters (layout: `plan.layout`; the master weights under
    /// mixed precision).
    pub fn with_params<R>(&self, f: impl FnOnce(&[f32]) -> R) -> R {
        let mut f = Some(f);
        let mut out = None;
        let id = self.plan.schedule.implicit.params;
        self.device
            .download(&[id], &mut |b| {
                out = Some((f.take().expect("called once"))(pod::cast(b[0])))
            })
            .expect(HOST_ONLY);
        out.expect("download calls back")
    }

    /// Lends `f` the parameters to change; they are on the backend when it returns.
    pub fn with_params_mut<R>(&mut self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        let mut f = Some(f);
        let mut out = None;
        let id = self.plan.schedule.implicit.params;
        self.device
            .upload(&[id], &mut |b| {
                out = Some((f.take().expect("called once"))(pod::cast_mut(b[0])))
            })
            .expect(HOST_ONLY);
        out.expect("upload calls back")
    }

    /// A copy of the parameters.
    pub fn download_params(&self) -> Vec<f32> {
        self.with_params(|p| p.to_vec())
    }

    /// Gradients of the last [`Executor::compute_gradients`] as f32, in parameter order
    /// (training plans only; scaled by the loss scale).
    pub fn download_grads(&self) -> Vec<f32> {
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
            .expect(HOST_ONLY);
        out
    }

    /// The AdamW moment buffers where they live between steps: one set, or one per group.
    fn moment_sets(&self) -> &[OptimBufs] {
        self.plan
            .schedule
            .implicit
            .optim
            .as_deref()
            .expect("training plan")
    }

    /// Lends `f` the AdamW moments in their stored format (for checkpoints). Moments kept
    /// per parameter group (offloaded) are gathered into one host copy first, group by group.
    pub fn with_moments<R>(&self, f: impl FnOnce(Moments<'_>) -> R) -> Result<R> {
        let sets = self.moment_sets();
        let format = sets[0].format;
        let mut f = Some(f);
        let mut out = None;
        if let [whole] = sets {
            self.device.download(&whole.ids(), &mut |b| {
                out = Some((f.take().expect("called once"))(moments(format, b)))
            })?;
            return Ok(out.expect("download calls back"));
        }
        let mut joined = self.joined_moments();
        let mut at = vec![0usize; joined.len()];
        for set in sets {
            self.device.download(&set.ids(), &mut |b| {
                for (k, part) in b.iter().enumerate() {
                    pod_bytes_mut(&mut joined[k].0)[at[k]..at[k] + part.len()]
                        .copy_from_slice(part);
                    at[k] += part.len();
                }
            })?;
        }
        let views: Vec<&[u8]> = joined
            .iter()
            .map(|(v, len)| &pod_bytes(v)[..*len])
            .collect();
        Ok((f.take().expect("called once"))(moments(format, &views)))
    }

    /// Lends `f` the AdamW moments to fill (resume); they are on the backend when it returns
    /// (moments kept per group are filled as one host copy, then written group by group).
    pub fn with_moments_mut<R>(&mut self, f: impl FnOnce(MomentsMut<'_>) -> R) -> Result<R> {
        let sets = self.moment_sets().to_vec();
        let format = sets[0].format;
        let mut f = Some(f);
        let mut out = None;
        if let [whole] = &sets[..] {
            self.device.upload(&whole.ids(), &mut |b| {
                out = Some((f.take().expect("called once"))(moments_mut(format, b)))
            })?;
            return Ok(out.expect("upload calls back"));
        }
        let mut joined = self.joined_moments();
        let mut views: Vec<&mut [u8]> = joined
            .iter_mut()
            .map(|(v, len)| &mut pod_bytes_mut(v)[..*len])
            .collect();
        let out = (f.take().expect("called once"))(moments_mut(format, &mut views));
        let mut at = vec![0usize; joined.len()];
        for set in &sets {
            self.device.upload(&set.ids(), &mut |b| {
                for (k, part) in b.iter_mut().enumerate() {
                    let n = part.len();
                    part.copy_from_slice(&pod_bytes(&joined[k].0)[at[k]..at[k] + n]);
                    at[k] += n;
                }
            })?;
        }
        Ok(out)
    }

    /// Zeroed 8-byte-aligned host buffers for each kind of moment buffer (m, v, scales) of
    /// per-group moments, each as long as that kind's buffers of every group together.
    fn joined_moments(&self) -> Vec<(Vec<u64>, usize)> {
        let sets = self.moment_sets();
        (0..sets[0].ids().len())
            .map(|k| {
                let len: u64 = sets
                    .iter()
                    .map(|s| self.plan.buffer(s.ids()[k]).bytes)
                    .sum();
                (vec![0u64; (len as usize).div_ceil(8)], len as usize)
            })
            .collect()
    }

    /// What the backend has to say once about its disk tier (e.g. a buffered-I/O fallback).
    pub fn offload_note(&self) -> Option<String> {
        self.device.offload_note()
    }

    /// Time the backend has spent on disk-tier transfers since it started.
    pub fn io_time(&self) -> crate::backend::IoTime {
        self.device.io_time()
    }

    /// Sets the factor the loss is multiplied by before backward (fp16 loss scaling).
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    /// Copies a batch `[accum·B, T+1]` into the plan's token (and target) buffers: rows
    /// k·B..(k+1)·B go to micro-batch k.
    pub fn upload_batch(&mut self, batch: &[u32]) -> Result<()> {
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
        let v = self.plan.spec.vocab_size as u32;
        if let Some(bad) = batch.iter().find(|&&x| x >= v) {
            bail!(
                "token id {bad} is outside the model's vocabulary ({v}); was the data prepared for another tokenizer?"
            );
        }
        let mut ids = s.tokens.clone();
        ids.extend(&s.targets);
        let with_targets = !s.targets.is_empty();
        self.device
            .upload(&ids, &mut |bufs| {
                let (tokens, targets) = bufs.split_at_mut(micro);
                for (k, rows) in batch.chunks(b * (t + 1)).enumerate() {
                    let tk = pod::cast_mut::<u32>(tokens[k]);
                    for (i, row) in rows.chunks(t + 1).enumerate() {
                        tk[i * t..(i + 1) * t].copy_from_slice(&row[..t]);
                    }
                    if with_targets {
                        let tg = pod::cast_mut::<u32>(targets[k]);
                        for (i, row) in rows.chunks(t + 1).enumerate() {
                            tg[i * t..(i + 1) * t].copy_from_slice(&row[1..]);
                        }
                    }
                }
            })
            .expect(HOST_ONLY);
        Ok(())
    }

    /// One optimizer step on the batch set by [`Executor::upload_batch`].
    pub fn train_step(&mut self, hp: &OptimHparams) -> Result<StepStats> {
        let loss = self.compute_gradients()?;
        let o = self.apply_optimizer(hp)?;
        Ok(StepStats {
            loss,
            grad_norm: o.grad_norm,
            skipped: o.skipped,
        })
    }

    /// Forward and backward: fills the gradients, returns the mean loss. The optimizer ops
    /// (the schedule's `Optimizer` phase) are not run.
    pub fn compute_gradients(&mut self) -> Result<f32> {
        assert_eq!(self.plan.mode, Mode::Train);
        let end = self.optimizer_start();
        self.run(0..end, self.ctx(true), None)?;
        Ok(self.mean_loss())
    }

    /// Runs the optimizer phase on the gradients: the gradient norm, then (unless the
    /// gradients are not finite) clipping and AdamW. Returns the norm before clipping and
    /// whether the update was skipped.
    pub fn apply_optimizer(&mut self, hp: &OptimHparams) -> Result<StepOutcome> {
        let ops = self.optimizer_start()..self.plan.schedule.ops.len();
        let ctx = self.ctx(true);
        Ok(self
            .run(ops, ctx, Some(hp))?
            .expect("the optimizer phase has a gradient-norm op"))
    }

    fn ctx(&self, training: bool) -> StepCtx {
        StepCtx {
            seq: None,
            training,
            loss_scale: self.loss_scale,
            update: None,
        }
    }

    fn optimizer_start(&self) -> usize {
        let ops = &self.plan.schedule.ops;
        ops.iter()
            .position(|o| o.phase == Phase::Optimizer)
            .unwrap_or(ops.len())
    }

    /// Mean loss on the batch set by [`Executor::upload_batch`], forward only (no state
    /// changes besides activations): every micro-batch's forward ops (gradient zeroing is in
    /// the backward phase).
    pub fn eval_loss(&mut self) -> Result<f32> {
        let s = &self.plan.schedule;
        let ops: Vec<usize> = (0..s.ops.len())
            .filter(|&i| s.ops[i].phase == Phase::Forward)
            .collect();
        self.run(ops.into_iter(), self.ctx(false), None)?;
        Ok(self.mean_loss())
    }

    /// Mean of the per-row losses over every micro-batch.
    fn mean_loss(&self) -> f32 {
        let (mut sum, mut rows) = (0.0f64, 0usize);
        self.device
            .download(&self.plan.schedule.losses, &mut |bufs| {
                for b in bufs {
                    let losses = pod::cast::<f32>(b);
                    sum += losses.iter().map(|&x| x as f64).sum::<f64>();
                    rows += losses.len();
                }
            })
            .expect(HOST_ONLY);
        (sum / rows as f64) as f32
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
        let v = self.plan.spec.vocab_size as u32;
        if let Some(bad) = context.iter().find(|&&x| x >= v) {
            bail!("token id {bad} is outside the model's vocabulary ({v})");
        }
        let s = &self.plan.schedule;
        let (tokens, logits) = (s.tokens[0], s.logits.expect("generation plan"));
        self.device
            .upload(&[tokens], &mut |b| {
                pod::cast_mut::<u32>(b[0])[..t].copy_from_slice(context)
            })
            .expect(HOST_ONLY);
        let ctx = StepCtx {
            seq: Some(t),
            ..self.ctx(false)
        };
        self.run(0..self.plan.schedule.ops.len(), ctx, None)?;
        let mut out = std::mem::take(&mut self.logits);
        self.device
            .download(&[logits], &mut |b| {
                out.clear();
                out.extend_from_slice(pod::cast::<f32>(b[0]))
            })
            .expect(HOST_ONLY);
        self.logits = out;
        Ok(&self.logits)
    }

    /// Starts recording a span per executed op into `recorder` (profiling, `bench --time-ops`),
    /// or stops when `None`; returns the previous recorder with what it holds.
    pub fn record_ops(&mut self, recorder: Option<OpRecorder>) -> Option<OpRecorder> {
        std::mem::replace(&mut self.recorder, recorder)
    }

    /// The active recorder, to take its spans between steps.
    pub fn recorder_mut(&mut self) -> Option<&mut OpRecorder> {
        self.recorder.as_mut()
    }

    /// Runs ops `ops` in order. With `hp`, the `GradNorm` ops' sums of squares add up to the
    /// step's norm and clipping, settled before the first `AdamW` op, which then run with
    /// them, or not at all when the norm is not finite; returns what the optimizer found.
    /// Stops at the first op that fails (a disk transfer), with its error.
    fn run(
        &mut self,
        ops: impl Iterator<Item = usize> + Send,
        mut ctx: StepCtx,
        hp: Option<&OptimHparams>,
    ) -> Result<Option<StepOutcome>> {
        let mut recorder = self.recorder.take();
        let mut outcome = None;
        let mut sum_sq = None;
        let mut failed = None;
        let (plan, device) = (&self.plan, &*self.device);
        let loss_scale = self.loss_scale;
        let mut ops = ops;
        let settle = |sum_sq: Option<f64>, ctx: &mut StepCtx| {
            let hp = hp.expect("the optimizer phase runs with hyperparameters");
            let (o, update) = clip(sum_sq.expect("GradNorm ops precede AdamW"), loss_scale, hp);
            ctx.update = update;
            o
        };
        device.scope(&mut || {
            for i in ops.by_ref() {
                let op = &plan.schedule.ops[i].op;
                if matches!(op, Op::AdamW { .. }) {
                    if outcome.is_none() {
                        outcome = Some(settle(sum_sq, &mut ctx));
                    }
                    if outcome.is_some_and(|o: StepOutcome| o.skipped) {
                        continue;
                    }
                }
                let t0 = recorder.as_ref().map(|_| std::time::Instant::now());
                match device.run(op, &ctx) {
                    Ok(OpResult::SumOfSquares(sq)) => sum_sq = Some(sum_sq.unwrap_or(0.0) + sq),
                    Ok(OpResult::Done) => {}
                    Err(e) => {
                        failed = Some(e.context(format!("op {}", plan.schedule.ops[i].name)));
                        return;
                    }
                }
                if let (Some(r), Some(t0)) = (recorder.as_mut(), t0) {
                    r.record(i, t0);
                }
            }
            if outcome.is_none() && sum_sq.is_some() {
                outcome = Some(settle(sum_sq, &mut ctx));
            }
        });
        self.recorder = recorder;
        match failed {
            Some(e) => Err(e),
            None => Ok(outcome),
        }
    }
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
