//! Walks a plan's schedule. Every buffer is a view of the one arena allocated in
//! [`Executor::new`]; kernels receive slices and allocate nothing, so the plan's bytes are the
//! step's bytes. Ops run in a dedicated rayon pool of `threads` workers.

use crate::backend::cpu::{
    adamw, attention, encoder, gelu, layernorm, matmul, quant, reduce, xent,
};
use crate::ckpt::{Moments, MomentsMut};
use crate::mem::arena::Arena;
use crate::plan::schedule::{Op, Phase};
use crate::plan::{BufId, DType, Mode, OptimState, Plan};
use anyhow::{Result, bail};

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
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f32,
}

/// Executes plans: owns the arena, the plan and the worker pool.
pub struct Executor {
    pub plan: Plan,
    arena: Arena,
    pool: rayon::ThreadPool,
    hp: Option<OptimHparams>,
    last_grad_norm: f32,
    /// Seconds spent in each op of the schedule, summed over runs, when timing is on.
    op_seconds: Option<Vec<f64>>,
}

impl Executor {
    /// Allocates (and touches) the plan's arena and starts `plan.cfg.threads` workers.
    pub fn new(plan: Plan) -> Result<Executor> {
        crate::util::malloc::keep_library_scratch_resident();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(plan.cfg.threads)
            .thread_name(|i| format!("memwall-worker-{i}"))
            .build()?;
        let arena = pool.install(|| Arena::new(plan.arena_bytes))?;
        Ok(Executor {
            plan,
            arena,
            pool,
            hp: None,
            last_grad_norm: 0.0,
            op_seconds: None,
        })
    }

    // SAFETY (all views): offsets and sizes come from the verified plan; an op's written
    // buffers never overlap the other buffers it touches (plan::build::verify_ops), and the
    // persistent buffers (params, grads, moments) are distinct buffers in the arena.
    fn f32(&self, id: BufId) -> &[f32] {
        let b = self.plan.buffer(id);
        debug_assert_eq!(b.dtype, DType::F32);
        unsafe { self.arena.view_mut::<f32>(b.offset, b.elems) }
    }

    #[allow(clippy::mut_from_ref)]
    fn f32_mut(&self, id: BufId) -> &mut [f32] {
        let b = self.plan.buffer(id);
        debug_assert_eq!(b.dtype, DType::F32);
        unsafe { self.arena.view_mut::<f32>(b.offset, b.elems) }
    }

    #[allow(clippy::mut_from_ref)]
    fn u32_mut(&self, id: BufId) -> &mut [u32] {
        self.typed(id, DType::U32)
    }

    /// A view of buffer `id`, whose element type `T` is `dtype`'s.
    #[allow(clippy::mut_from_ref)]
    fn typed<T>(&self, id: BufId, dtype: DType) -> &mut [T] {
        let b = self.plan.buffer(id);
        assert_eq!(b.dtype, dtype, "buffer {} viewed as {dtype:?}", b.name);
        debug_assert_eq!(std::mem::size_of::<T>(), dtype.size());
        unsafe { self.arena.view_mut::<T>(b.offset, b.elems) }
    }

    /// The flat parameter buffer (layout: `plan.layout`).
    pub fn params(&self) -> &[f32] {
        self.f32(self.plan.schedule.params)
    }

    pub fn params_mut(&mut self) -> &mut [f32] {
        self.f32_mut(self.plan.schedule.params)
    }

    /// Gradients of the last step (training plans only).
    pub fn grads(&self) -> &[f32] {
        self.f32(self.plan.schedule.grads.expect("training plan"))
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

    fn moments_view(&self) -> MomentsMut<'_> {
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

    /// Copies a batch [accum·B, T+1] into the plan's token (and target) buffers: rows
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
        let grad_norm = self.apply_optimizer(hp);
        StepStats { loss, grad_norm }
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

    /// Runs the optimizer phase on the gradients; returns the gradient norm before clipping.
    pub fn apply_optimizer(&mut self, hp: &OptimHparams) -> f32 {
        self.hp = Some(hp.clone());
        let (b, t) = (self.plan.cfg.batch, self.plan.cfg.seq);
        self.run(
            self.optimizer_start()..self.plan.schedule.ops.len(),
            b,
            t,
            true,
        );
        self.last_grad_norm
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

    /// Next-token logits [V] after `context` (generation plans; `context.len()` ≤ plan seq).
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

    /// Starts (or stops) timing each op; times accumulate until read.
    pub fn time_ops(&mut self, on: bool) {
        self.op_seconds = on.then(|| vec![0.0; self.plan.schedule.ops.len()]);
    }

    /// Accumulated seconds per op (index = schedule position), if timing is on.
    pub fn op_seconds(&self) -> Option<&[f64]> {
        self.op_seconds.as_deref()
    }

    fn run(
        &mut self,
        ops: impl IntoIterator<Item = usize> + Send,
        b: usize,
        t: usize,
        training: bool,
    ) {
        let mut times = self.op_seconds.take();
        let this = &*self;
        let mut grad_norm = None;
        this.pool.install(|| {
            for i in ops {
                let t0 = times.as_ref().map(|_| std::time::Instant::now());
                if let Some(gn) = this.run_op(i, b, t, training) {
                    grad_norm = Some(gn);
                }
                if let (Some(ts), Some(t0)) = (times.as_mut(), t0) {
                    ts[i] += t0.elapsed().as_secs_f64();
                }
            }
        });
        self.op_seconds = times;
        if let Some(gn) = grad_norm {
            self.last_grad_norm = gn;
        }
    }

    /// Runs op `i` on the first `b`×`t` rows; returns the gradient norm for the optimizer op.
    fn run_op(&self, i: usize, b: usize, t: usize, training: bool) -> Option<f32> {
        let spec = &self.plan.spec;
        let (c, nh, v) = (spec.n_embd, spec.n_head, spec.vocab_size);
        let n = b * t;
        let s = &self.plan.schedule;
        let params = self.f32(s.params);
        let grads = || self.f32_mut(s.grads.expect("training plan"));
        match &self.plan.schedule.ops[i].op {
            Op::Zero { buf } => {
                use rayon::prelude::*;
                self.f32_mut(*buf)
                    .par_chunks_mut(1 << 16)
                    .for_each(|c| c.fill(0.0));
            }
            Op::Encoder { tokens, out } => {
                let toks = &self.u32_mut(*tokens)[..n];
                let l = &self.plan.layout;
                encoder::encoder_forward(
                    &mut self.f32_mut(*out)[..n * c],
                    toks,
                    &params[l.wte.clone()],
                    &params[l.wpe.clone()],
                    b,
                    t,
                    c,
                );
            }
            Op::LayerNorm {
                inp,
                out,
                mean,
                rstd,
                w,
                b: bias,
            } => {
                layernorm::layernorm_forward(
                    &mut self.f32_mut(*out)[..n * c],
                    &mut self.f32_mut(*mean)[..n],
                    &mut self.f32_mut(*rstd)[..n],
                    &self.f32(*inp)[..n * c],
                    &params[w.clone()],
                    &params[bias.clone()],
                    n,
                    c,
                    spec.layer_norm_epsilon,
                );
            }
            Op::Matmul {
                inp,
                out,
                residual,
                w,
                b: bias,
                ic,
                oc,
            } => {
                let out = &mut self.f32_mut(*out)[..n * oc];
                if let Some(r) = residual {
                    out.copy_from_slice(&self.f32(*r)[..n * oc]);
                }
                let (w, bias) = (&params[w.clone()], &params[bias.clone()]);
                matmul::matmul_forward(
                    out,
                    &self.f32(*inp)[..n * ic],
                    w,
                    Some(bias),
                    n,
                    *ic,
                    *oc,
                    residual.is_some(),
                    &mut [],
                );
            }
            Op::Attention { qkv, out, lse, ws } => {
                attention::attention_forward(
                    &mut self.f32_mut(*out)[..n * c],
                    &mut self.f32_mut(*lse)[..b * nh * t],
                    &self.f32(*qkv)[..n * 3 * c],
                    b,
                    t,
                    c,
                    nh,
                    self.f32_mut(*ws),
                );
            }
            Op::Gelu { inp, out } => {
                gelu::gelu_forward(
                    &mut self.f32_mut(*out)[..n * 4 * c],
                    &self.f32(*inp)[..n * 4 * c],
                );
            }
            Op::LmHeadLoss {
                inp,
                targets,
                losses,
                logits,
                dinp,
                rows_per_chunk,
                loss_rows,
            } => {
                let wte = &params[self.plan.layout.wte.clone()];
                let x = &self.f32(*inp)[..n * c];
                let tg = &self.u32_mut(*targets)[..n];
                let losses = &mut self.f32_mut(*losses)[..n];
                let logits = self.f32_mut(*logits);
                let scale = 1.0 / *loss_rows as f32;
                let mut start = 0;
                while start < n {
                    let r = (*rows_per_chunk).min(n - start);
                    let lg = &mut logits[..r * v];
                    let xr = &x[start * c..(start + r) * c];
                    // lg[r, V] = xr[r, C] @ wteᵀ
                    matmul::sgemm(r, v, c, 1.0, xr, c, false, wte, c, true, lg, v, false);
                    let (tr, lr) = (&tg[start..start + r], &mut losses[start..start + r]);
                    match (training, dinp) {
                        (true, Some(d)) => {
                            xent::softmax_xent_backward_inplace(lg, tr, lr, scale, r, v);
                            let dx = &mut self.f32_mut(*d)[start * c..(start + r) * c];
                            // dx[r, C] = dlogits[r, V] @ wte[V, C]
                            matmul::sgemm(r, c, v, 1.0, lg, v, false, wte, c, false, dx, c, false);
                            // dwte[V, C] += dlogitsᵀ[V, r] @ xr[r, C]
                            let dwte = &mut grads()[self.plan.layout.wte.clone()];
                            matmul::sgemm(v, c, r, 1.0, lg, v, true, xr, c, false, dwte, c, true);
                        }
                        _ => xent::softmax_xent_forward(lg, tr, lr, r, v),
                    }
                    start += r;
                }
            }
            Op::LmHeadLast { inp, logits } => {
                let wte = &params[self.plan.layout.wte.clone()];
                let x = &self.f32(*inp)[(n - 1) * c..n * c];
                matmul::sgemm(
                    1,
                    v,
                    c,
                    1.0,
                    x,
                    c,
                    false,
                    wte,
                    c,
                    true,
                    self.f32_mut(*logits),
                    v,
                    false,
                );
            }
            Op::LayerNormBackward {
                dinp,
                dout,
                inp,
                mean,
                rstd,
                w,
                b: bias,
            } => {
                let g = grads();
                let (dw, db) = two_ranges(g, w.clone(), bias.clone());
                layernorm::layernorm_backward(
                    &mut self.f32_mut(*dinp)[..n * c],
                    dw,
                    db,
                    &self.f32(*dout)[..n * c],
                    &self.f32(*inp)[..n * c],
                    &params[w.clone()],
                    &self.f32(*mean)[..n],
                    &self.f32(*rstd)[..n],
                    n,
                    c,
                );
            }
            Op::MatmulBackward {
                dinp,
                dout,
                inp,
                w,
                b: bias,
                ic,
                oc,
            } => {
                let g = grads();
                let (dw, db) = two_ranges(g, w.clone(), bias.clone());
                matmul::matmul_backward(
                    &mut self.f32_mut(*dinp)[..n * ic],
                    dw,
                    Some(db),
                    &self.f32(*dout)[..n * oc],
                    &self.f32(*inp)[..n * ic],
                    &params[w.clone()],
                    n,
                    *ic,
                    *oc,
                    &mut [],
                );
            }
            Op::AttentionBackward {
                dqkv,
                dout,
                qkv,
                out,
                lse,
                ws,
            } => {
                attention::attention_backward(
                    &mut self.f32_mut(*dqkv)[..n * 3 * c],
                    &self.f32(*dout)[..n * c],
                    &self.f32(*qkv)[..n * 3 * c],
                    &self.f32(*out)[..n * c],
                    &self.f32(*lse)[..b * nh * t],
                    b,
                    t,
                    c,
                    nh,
                    self.f32_mut(*ws),
                );
            }
            Op::GeluBackward { d, inp } => {
                gelu::gelu_backward_inplace(
                    &mut self.f32_mut(*d)[..n * 4 * c],
                    &self.f32(*inp)[..n * 4 * c],
                );
            }
            Op::EncoderBackward { dout, tokens } => {
                let l = &self.plan.layout;
                let g = grads();
                let (dwte, dwpe) = two_ranges(g, l.wte.clone(), l.wpe.clone());
                encoder::encoder_backward(
                    dwte,
                    dwpe,
                    &self.f32(*dout)[..n * c],
                    &self.u32_mut(*tokens)[..n],
                    b,
                    t,
                    c,
                );
            }
            Op::OptimizerStep => return Some(self.optimizer_step()),
        }
        None
    }

    /// Global-norm clipping then AdamW over every parameter tensor; returns the norm.
    fn optimizer_step(&self) -> f32 {
        let hp = self.hp.as_ref().expect("train_step sets hyperparameters");
        let s = &self.plan.schedule;
        let grads = self.f32(s.grads.expect("training plan"));
        let norm = reduce::sum_squares(grads).sqrt() as f32;
        let scale = if hp.grad_clip > 0.0 && norm > hp.grad_clip {
            hp.grad_clip / (norm + 1e-6)
        } else {
            1.0
        };
        let params = self.f32_mut(s.params);
        let mut state = self.moments_view();
        let (block_of, _) = self.plan.layout.block_offsets(quant::QBLOCK);
        for (tensor, &b0) in self.plan.layout.tensors.iter().zip(&block_of) {
            let r = tensor.range.clone();
            let blocks = b0..b0 + r.len().div_ceil(quant::QBLOCK);
            let p = adamw::AdamWParams {
                lr: hp.lr,
                beta1: hp.beta1,
                beta2: hp.beta2,
                eps: hp.eps,
                weight_decay: if tensor.decay { hp.weight_decay } else { 0.0 },
                step: hp.step,
                grad_scale: scale,
            };
            let (p_, g) = (&mut params[r.clone()], &grads[r.clone()]);
            match &mut state {
                MomentsMut::F32 { m, v } => {
                    adamw::adamw_update(p_, g, &mut m[r.clone()], &mut v[r], &p)
                }
                MomentsMut::Bf16 { m, v } => {
                    quant::adamw_update_bf16(p_, g, &mut m[r.clone()], &mut v[r], &p)
                }
                MomentsMut::Int8 {
                    m,
                    m_absmax,
                    v,
                    v_absmax,
                } => quant::adamw_update_int8(
                    p_,
                    g,
                    &mut m[r.clone()],
                    &mut m_absmax[blocks.clone()],
                    &mut v[r],
                    &mut v_absmax[blocks],
                    &p,
                ),
            }
        }
        norm
    }
}

/// Two disjoint mutable sub-slices of one buffer.
fn two_ranges(
    buf: &mut [f32],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&mut [f32], &mut [f32]) {
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
