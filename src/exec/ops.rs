//! The op → kernel mapping: the only place that knows which kernel runs an [`Op`]. Generic
//! over the plan's storage type `T` (f32, bf16, f16): activations and gradients are `T`;
//! weights are always the fp32 parameters (the master weights under mixed precision: kernels
//! convert them per tile, so no reduced-precision copy is stored); layernorm statistics,
//! attention log-sum-exps, losses and the LM head's logits chunk are f32.

use super::executor::{Executor, two_ranges};
use crate::backend::cpu::elem::Elem;
use crate::backend::cpu::gemm::mixed as gemm_mixed;
use crate::backend::cpu::{
    adamw, attention, encoder, gelu, layernorm, matmul, quant, reduce, xent,
};
use crate::ckpt::MomentsMut;
use crate::plan::schedule::Op;

/// What the optimizer op found.
#[derive(Clone, Copy, Debug)]
pub(super) struct OptimOutcome {
    /// Global gradient norm of the (unscaled) gradients; non-finite when they overflowed.
    pub grad_norm: f32,
    /// The update was skipped because the gradients were not finite.
    pub skipped: bool,
}

impl Executor {
    /// Runs op `i` on the first `b`×`t` rows; returns the optimizer's outcome for its op.
    pub(super) fn run_op<T: Elem>(
        &self,
        i: usize,
        b: usize,
        t: usize,
        training: bool,
    ) -> Option<OptimOutcome> {
        let spec = &self.plan.spec;
        let (c, nh, v) = (spec.n_embd, spec.n_head, spec.vocab_size);
        let n = b * t;
        let s = &self.plan.schedule;
        let params: &[f32] = self.view(s.params); // fp32 (master) weights, read by every kernel
        let grads = || self.view::<T>(s.grads.expect("training plan"));
        let ws = || match s.gemm_ws {
            Some(id) => self.view::<f32>(id),
            None => &mut [],
        };
        let act = |id| &self.view::<T>(id)[..];
        match &s.ops[i].op {
            Op::Zero { buf } => self.zero(*buf),
            Op::Encoder { tokens, out } => {
                let l = &self.plan.layout;
                encoder::encoder_forward(
                    &mut self.view::<T>(*out)[..n * c],
                    &self.u32_mut(*tokens)[..n],
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
            } => layernorm::layernorm_forward(
                &mut self.view::<T>(*out)[..n * c],
                &mut self.view::<f32>(*mean)[..n],
                &mut self.view::<f32>(*rstd)[..n],
                &act(*inp)[..n * c],
                &params[w.clone()],
                &params[bias.clone()],
                n,
                c,
                spec.layer_norm_epsilon,
            ),
            Op::Matmul {
                inp,
                out,
                residual,
                w,
                b: bias,
                ic,
                oc,
            } => {
                let out = &mut self.view::<T>(*out)[..n * oc];
                if let Some(r) = residual {
                    out.copy_from_slice(&act(*r)[..n * oc]);
                }
                matmul::matmul_forward(
                    out,
                    &act(*inp)[..n * ic],
                    &params[w.clone()],
                    Some(&params[bias.clone()]),
                    n,
                    *ic,
                    *oc,
                    residual.is_some(),
                    ws(),
                );
            }
            Op::Attention { qkv, out, lse, ws } => attention::attention_forward(
                &mut self.view::<T>(*out)[..n * c],
                &mut self.view::<f32>(*lse)[..b * nh * t],
                &act(*qkv)[..n * 3 * c],
                b,
                t,
                c,
                nh,
                self.view::<f32>(*ws),
            ),
            Op::Gelu { inp, out } => gelu::gelu_forward(
                &mut self.view::<T>(*out)[..n * 4 * c],
                &act(*inp)[..n * 4 * c],
            ),
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
                let x = &act(*inp)[..n * c];
                let tg = &self.u32_mut(*targets)[..n];
                let losses = &mut self.view::<f32>(*losses)[..n];
                let logits = self.view::<f32>(*logits);
                // d(loss·loss_scale)/dlogits: the mean over every micro-batch's rows, scaled.
                let scale = self.loss_scale / *loss_rows as f32;
                let mut start = 0;
                while start < n {
                    let r = (*rows_per_chunk).min(n - start);
                    let lg = &mut logits[..r * v];
                    let xr = &x[start * c..(start + r) * c];
                    // lg[r, V] = xr[r, C] @ wteᵀ
                    gemm_mixed::gemm_mixed(r, v, c, xr, c, false, wte, c, true, lg, v, false, ws());
                    let (tr, lr) = (&tg[start..start + r], &mut losses[start..start + r]);
                    match (training, dinp) {
                        (true, Some(d)) => {
                            xent::softmax_xent_backward_inplace(lg, tr, lr, scale, r, v);
                            let dx = &mut self.view::<T>(*d)[start * c..(start + r) * c];
                            // dx[r, C] = dlogits[r, V] @ wte[V, C]
                            gemm_mixed::gemm_mixed(
                                r,
                                c,
                                v,
                                &lg[..],
                                v,
                                false,
                                wte,
                                c,
                                false,
                                dx,
                                c,
                                false,
                                ws(),
                            );
                            // dwte[V, C] += dlogitsᵀ[V, r] @ xr[r, C]
                            let dwte = &mut grads()[self.plan.layout.wte.clone()];
                            gemm_mixed::gemm_mixed(
                                v,
                                c,
                                r,
                                &lg[..],
                                v,
                                true,
                                xr,
                                c,
                                false,
                                dwte,
                                c,
                                true,
                                ws(),
                            );
                        }
                        _ => xent::softmax_xent_forward(lg, tr, lr, r, v),
                    }
                    start += r;
                }
            }
            Op::LmHeadLast { inp, logits } => {
                let wte = &params[self.plan.layout.wte.clone()];
                let x = &act(*inp)[(n - 1) * c..n * c];
                gemm_mixed::gemm_mixed(
                    1,
                    v,
                    c,
                    x,
                    c,
                    false,
                    wte,
                    c,
                    true,
                    self.view::<f32>(*logits),
                    v,
                    false,
                    ws(),
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
                let (dw, db) = two_ranges(grads(), w.clone(), bias.clone());
                layernorm::layernorm_backward(
                    &mut self.view::<T>(*dinp)[..n * c],
                    dw,
                    db,
                    &act(*dout)[..n * c],
                    &act(*inp)[..n * c],
                    &params[w.clone()],
                    &self.view::<f32>(*mean)[..n],
                    &self.view::<f32>(*rstd)[..n],
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
                let (dw, db) = two_ranges(grads(), w.clone(), bias.clone());
                matmul::matmul_backward(
                    &mut self.view::<T>(*dinp)[..n * ic],
                    dw,
                    Some(db),
                    &act(*dout)[..n * oc],
                    &act(*inp)[..n * ic],
                    &params[w.clone()],
                    n,
                    *ic,
                    *oc,
                    ws(),
                );
            }
            Op::AttentionBackward {
                dqkv,
                dout,
                qkv,
                out,
                lse,
                ws,
            } => attention::attention_backward(
                &mut self.view::<T>(*dqkv)[..n * 3 * c],
                &act(*dout)[..n * c],
                &act(*qkv)[..n * 3 * c],
                &act(*out)[..n * c],
                &self.view::<f32>(*lse)[..b * nh * t],
                b,
                t,
                c,
                nh,
                self.view::<f32>(*ws),
            ),
            Op::GeluBackward { d, inp } => gelu::gelu_backward_inplace(
                &mut self.view::<T>(*d)[..n * 4 * c],
                &act(*inp)[..n * 4 * c],
            ),
            Op::EncoderBackward { dout, tokens } => {
                let l = &self.plan.layout;
                let (dwte, dwpe) = two_ranges(grads(), l.wte.clone(), l.wpe.clone());
                encoder::encoder_backward(
                    dwte,
                    dwpe,
                    &act(*dout)[..n * c],
                    &self.u32_mut(*tokens)[..n],
                    b,
                    t,
                    c,
                );
            }
            Op::OptimizerStep => return Some(self.optimizer_step::<T>()),
        }
        None
    }

    /// Global-norm clipping then AdamW over every parameter tensor, on the master weights
    /// (the compute weights themselves in fp32 plans). Gradients carry the loss scale, which
    /// is divided out here; non-finite gradients skip the update.
    fn optimizer_step<T: Elem>(&self) -> OptimOutcome {
        let hp = self.hp.as_ref().expect("train_step sets hyperparameters");
        let s = &self.plan.schedule;
        let grads = &self.view::<T>(s.grads.expect("training plan"))[..];
        let norm = (reduce::sum_squares(grads).sqrt() / self.loss_scale as f64) as f32;
        if !norm.is_finite() {
            return OptimOutcome {
                grad_norm: norm,
                skipped: true,
            };
        }
        let clip = if hp.grad_clip > 0.0 && norm > hp.grad_clip {
            hp.grad_clip / (norm + 1e-6)
        } else {
            1.0
        };
        let master = self.view::<f32>(s.params);
        let mut state = self.moments_view();
        for (tensor, &b0) in self.plan.layout.tensors.iter().zip(&self.state_block_of) {
            let r = tensor.range.clone();
            let blocks = b0..b0 + r.len().div_ceil(quant::QBLOCK);
            let p = adamw::AdamWParams {
                lr: hp.lr,
                beta1: hp.beta1,
                beta2: hp.beta2,
                eps: hp.eps,
                weight_decay: if tensor.decay { hp.weight_decay } else { 0.0 },
                step: hp.step,
                grad_scale: clip / self.loss_scale,
            };
            let (p_, g) = (&mut master[r.clone()], &grads[r.clone()]);
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
        OptimOutcome {
            grad_norm: norm,
            skipped: false,
        }
    }
}
