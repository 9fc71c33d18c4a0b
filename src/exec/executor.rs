//! Walks a plan's schedule. Every buffer is a view of the one arena allocated in
//! [`Executor::new`]; kernels receive slices and allocate nothing, so the plan's bytes are the
//! step's bytes. Ops run in a dedicated rayon pool of `threads` workers.

use super::ops::OptimOutcome;
use crate::backend::cpu::elem::Elem;
use crate::ckpt::{Moments, MomentsMut};
use crate::mem::arena::Arena;
use crate::plan::schedule::{Op, Phase};
use crate::plan::{BufId, DType, Mode, OptimState, Plan, Precision};
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

/// Executes plans: owns the arena, the plan and the worker pool.
pub struct Executor {
    pub plan: Plan,
    arena: Arena,
    pool: rayon::ThreadPool,
    pub(super) hp: Option<OptimHparams>,
    /// The loss is multiplied by this before backward (fp16 loss scaling; 1 otherwise).
    pub(super) loss_scale: f32,
    last: Option<OptimOutcome>,
    /// Records each executed op's span when profiling (see [`Executor::record_ops`]).
    recorder: Option<OpRecorder>,
    /// Per parameter tensor, its first 8-bit optimizer-state block (computed once, so the
    /// optimizer step allocates nothing).
    pub(super) state_block_of: Vec<usize>,
}

impl Executor {
    /// Allocates (and touches) the plan's arena and starts `plan.cfg.threads` workers.
    pub fn new(plan: Plan) -> Result<Executor> {
        if plan.cfg.precision == Precision::F16 && !f16_conversions_available() {
            bail!(
                "--precision fp16: this CPU has no F16C half-precision conversions, so fp16 storage would be converted in software, far slower than fp32; use --precision bf16"
            );
        }
        crate::util::malloc::keep_library_scratch_resident();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(plan.cfg.threads)
            .thread_name(|i| format!("memwall-worker-{i}"))
            .build()?;
        let arena = pool.install(|| Arena::new(plan.arena_bytes))?;
        let (state_block_of, _) = plan
            .layout
            .block_offsets(crate::backend::cpu::quant::QBLOCK);
        Ok(Executor {
            plan,
            arena,
            pool,
            hp: None,
            loss_scale: 1.0,
            last: None,
            recorder: None,
            state_block_of,
        })
    }

    // SAFETY (all views): offsets and sizes come from the verified plan; an op's written
    // buffers never overlap the other buffers it touches (plan::build::verify_ops), and the
    // persistent buffers (params, grads, moments) are distinct buffers in the arena.
    fn f32(&self, id: BufId) -> &[f32] {
        self.typed(id, DType::F32)
    }

    #[allow(clippy::mut_from_ref)]
    fn f32_mut(&self, id: BufId) -> &mut [f32] {
        self.typed(id, DType::F32)
    }

    #[allow(clippy::mut_from_ref)]
    pub(super) fn u32_mut(&self, id: BufId) -> &mut [u32] {
        self.typed(id, DType::U32)
    }

    /// A view of buffer `id` as elements of `T` (whose dtype it must have).
    #[allow(clippy::mut_from_ref)]
    pub(super) fn view<T: Elem>(&self, id: BufId) -> &mut [T] {
        let dtype = match T::NAME {
            "f32" => DType::F32,
            "bf16" => DType::Bf16,
            "f16" => DType::F16,
            other => unreachable!("element type {other}"),
        };
        self.typed(id, dtype)
    }

    /// Zeroes a buffer of any dtype (all-zero bits are 0 in every element type).
    pub(super) fn zero(&self, id: BufId) {
        use rayon::prelude::*;
        let b = self.plan.buffer(id);
        // SAFETY: as for every view; u8 has no alignment or validity requirement.
        let bytes = unsafe { self.arena.view_mut::<u8>(b.offset, b.bytes as usize) };
        bytes.par_chunks_mut(1 << 18).for_each(|c| c.fill(0));
    }

    /// A view of buffer `id`, whose element type `T` is `dtype`'s.
    #[allow(clippy::mut_from_ref)]
    fn typed<T>(&self, id: BufId, dtype: DType) -> &mut [T] {
        let b = self.plan.buffer(id);
        assert_eq!(b.dtype, dtype, "buffer {} viewed as {dtype:?}", b.name);
        debug_assert_eq!(std::mem::size_of::<T>(), dtype.size());
        unsafe { self.arena.view_mut::<T>(b.offset, b.elems) }
    }

    /// The flat fp32 parameter buffer (layout: `plan.layout`); the master weights under mixed
    /// precision.
    pub fn params(&self) -> &[f32] {
        self.f32(self.plan.schedule.params)
    }

    pub fn params_mut(&mut self) -> &mut [f32] {
        self.f32_mut(self.plan.schedule.params)
    }

    /// Gradients of the last step as f32 (training plans only; scaled by the loss scale).
    pub fn grads(&self) -> Vec<f32> {
        let id = self.plan.schedule.grads.expect("training plan");
        match self.plan.cfg.precision {
            Precision::F32 => self.f32(id).to_vec(),
            Precision::Bf16 => self.view::<bf16>(id).iter().map(|x| x.to_f32()).collect(),
            Precision::F16 => self.view::<f16>(id).iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// Sets the factor the loss is multiplied by before backward (fp16 loss scaling).
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    /// AdamW moments in their stored format, for checkpoints.
    pub fn moments(&self) -> Moments<'_> {
        match self.moments_view() {
            MomentsMut::F32 { m, v } => Moments::F32 { m, v },
            MomentsMut::Bf16 { m, v } => Moments::Bf16 { m, v },
            MomentsMut::Int8 {
                m,
                m_absmax,
                v,
                v_absmax,
            } => Moments::Int8 {
                m,
                m_absmax,
                v,
                v_absmax,
            },
        }
    }

    pub fn moments_mut(&mut self) -> MomentsMut<'_> {
        self.moments_view()
    }

    pub(super) fn moments_view(&self) -> MomentsMut<'_> {
        let o = self.plan.schedule.optim.expect("training plan");
        match o.format {
            OptimState::F32 => MomentsMut::F32 {
                m: self.typed(o.m, DType::F32),
                v: self.typed(o.v, DType::F32),
            },
            OptimState::Bf16 => MomentsMut::Bf16 {
                m: self.typed(o.m, DType::Bf16),
                v: self.typed(o.v, DType::Bf16),
            },
            OptimState::Int8 => MomentsMut::Int8 {
                m: self.typed(o.m, DType::I8),
                m_absmax: self.typed(o.m_scale.expect("int8 scales"), DType::F32),
                v: self.typed(o.v, DType::U8),
                v_absmax: self.typed(o.v_scale.expect("int8 scales"), DType::F32),
            },
        }
    }

    /// Copies a batch `[accum·B, T+1]` into the plan's token (and target) buffers: rows
    /// k·B..(k+1)·B go to micro-batch k.
    pub fn set_batch(&mut self, batch: &[u32]) -> Result<()> {
        let (b, t) = (self.plan.cfg.batch, self.plan.cfg.seq);
        let micro = self.plan.schedule.tokens.len();
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
        let s = &self.plan.schedule;
        for (k, rows) in batch.chunks(b * (t + 1)).enumerate() {
            let tokens = self.u32_mut(s.tokens[k]);
            for (i, row) in rows.chunks(t + 1).enumerate() {
                tokens[i * t..(i + 1) * t].copy_from_slice(&row[..t]);
            }
            if let Some(&tg) = s.targets.get(k) {
                let targets = self.u32_mut(tg);
                for (i, row) in rows.chunks(t + 1).enumerate() {
                    targets[i * t..(i + 1) * t].copy_from_slice(&row[1..]);
                }
            }
        }
        Ok(())
    }

    /// One optimizer step on the batch set by [`Executor::set_batch`].
    pub fn train_step(&mut self, hp: &OptimHparams) -> StepStats {
        let loss = self.compute_gradients();
        let o = self.apply_optimizer(hp);
        StepStats {
            loss,
            grad_norm: o.grad_norm,
            skipped: o.skipped,
        }
    }

    /// Forward and backward: fills the gradients, returns the mean loss. The optimizer ops
    /// (the schedule's `Optimizer` phase) are not run.
    pub fn compute_gradients(&mut self) -> f32 {
        assert_eq!(self.plan.mode, Mode::Train);
        let (b, t) = (self.plan.cfg.batch, self.plan.cfg.seq);
        let end = self.optimizer_start();
        self.run(0..end, b, t, true);
        self.mean_loss()
    }

    /// Runs the optimizer phase on the gradients; returns the gradient norm before clipping and
    /// whether the update was skipped (non-finite gradients).
    pub fn apply_optimizer(&mut self, hp: &OptimHparams) -> StepOutcome {
        self.hp = Some(hp.clone());
        let (b, t) = (self.plan.cfg.batch, self.plan.cfg.seq);
        self.run(
            self.optimizer_start()..self.plan.schedule.ops.len(),
            b,
            t,
            true,
        );
        let o = self.last.expect("the optimizer op ran");
        StepOutcome {
            grad_norm: o.grad_norm,
            skipped: o.skipped,
        }
    }

    fn optimizer_start(&self) -> usize {
        let ops = &self.plan.schedule.ops;
        ops.iter()
            .position(|o| o.phase == Phase::Optimizer)
            .unwrap_or(ops.len())
    }

    /// Mean loss on the batch set by [`Executor::set_batch`], forward only (no state changes
    /// besides activations): every micro-batch's forward ops, without gradient zeroing.
    pub fn eval_loss(&mut self) -> f32 {
        let (b, t) = (self.plan.cfg.batch, self.plan.cfg.seq);
        let s = &self.plan.schedule;
        let ops: Vec<usize> = (0..s.ops.len())
            .filter(|&i| {
                s.ops[i].phase == Phase::Forward
                    && !matches!(s.ops[i].op, Op::Zero { buf } if Some(buf) == s.grads)
            })
            .collect();
        self.run(ops, b, t, false);
        self.mean_loss()
    }

    /// Mean of the per-row losses over every micro-batch.
    fn mean_loss(&self) -> f32 {
        let s = &self.plan.schedule;
        let (mut sum, mut rows) = (0.0f64, 0usize);
        for &id in &s.losses {
            let losses = self.f32(id);
            sum += losses.iter().map(|&x| x as f64).sum::<f64>();
            rows += losses.len();
        }
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
        self.u32_mut(self.plan.schedule.tokens[0])[..t].copy_from_slice(context);
        self.run(0..self.plan.schedule.ops.len(), 1, t, false);
        Ok(self.f32(self.plan.schedule.logits.expect("generation plan")))
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

    fn run(
        &mut self,
        ops: impl IntoIterator<Item = usize> + Send,
        b: usize,
        t: usize,
        training: bool,
    ) {
        let mut recorder = self.recorder.take();
        let this = &*self;
        let mut outcome = None;
        let precision = self.plan.cfg.precision;
        this.pool.install(|| {
            for i in ops {
                let t0 = recorder.as_ref().map(|_| std::time::Instant::now());
                let o = match precision {
                    Precision::F32 => this.run_op::<f32>(i, b, t, training),
                    Precision::Bf16 => this.run_op::<bf16>(i, b, t, training),
                    Precision::F16 => this.run_op::<f16>(i, b, t, training),
                };
                if o.is_some() {
                    outcome = o;
                }
                if let (Some(r), Some(t0)) = (recorder.as_mut(), t0) {
                    r.record(i, t0);
                }
            }
        });
        self.recorder = recorder;
        if outcome.is_some() {
            self.last = outcome;
        }
    }
}

/// Whether the CPU converts f16 in hardware (F16C).
fn f16_conversions_available() -> bool {
    crate::backend::cpu::features::f16_conversions_available()
}

/// What the optimizer phase reports.
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    pub grad_norm: f32,
    pub skipped: bool,
}

/// Two disjoint mutable sub-slices of one buffer.
pub(super) fn two_ranges<T>(
    buf: &mut [T],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&mut [T], &mut [T]) {
    assert!(
        a.end <= b.start || b.end <= a.start,
        "overlapping parameter ranges"
    );
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&mut lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        let bl = b.end - b.start;
        (&mut hi[..a.end - a.start], &mut lo[b.start..b.start + bl])
    }
}
