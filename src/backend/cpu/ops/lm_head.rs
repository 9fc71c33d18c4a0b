//! The LM head family ([`OpFamily::LmHead`]) on the CPU: [`Op::LmHeadLoss`], chunked over rows
//! (logits, softmax cross-entropy and, in training, the input's and the head's gradients; on
//! f32 weights or a quantized base's), and generation's [`Op::LmHeadLast`].

use super::{Args, not_of};
use crate::backend::StepCtx;
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::gemm::mixed as gemm_mixed;
use crate::backend::cpu::gemm::quantized;
use crate::backend::cpu::xent;
use crate::dtype::Elem;
use crate::ir::OpFamily;
use crate::ir::schedule::{Op, OpEntry};

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::LmHead`], with activations stored as `T`.
    pub(super) fn run_lm_head<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        let args = Args::<T>::new(self, e);
        match &e.op {
            Op::LmHeadLoss {
                inp,
                targets,
                losses,
                logits,
                dinp,
                w,
                rows,
                c,
                v,
                rows_per_chunk,
            } => {
                let (n, c, v) = (rows.with_seq(ctx.seq).n(), *c, *v);
                // The head's weight `[V, C]`: f32, or a quantized base's.
                let qw = self.quant_weight(e, w, (v, c));
                let wte = if qw.is_none() { args.weights(w) } else { &[] };
                let x = &args.act(*inp)[..n * c];
                let tg = &self.u32_mut(*targets)[..n];
                let losses = &mut self.view::<f32>(*losses)[..n];
                let logits = self.view::<f32>(*logits);
                // d(loss·loss_scale)/dlogits: the mean over the step's trained targets (every
                // micro-batch's, every rank's), scaled.
                let scale = ctx.loss_scale / ctx.loss_tokens.max(1) as f32;
                let mut start = 0;
                while start < n {
                    let r = (*rows_per_chunk).min(n - start);
                    let lg = &mut logits[..r * v];
                    let xr = &x[start * c..(start + r) * c];
                    // lg[r, V] = xr[r, C] @ wteᵀ
                    match &qw {
                        Some(qw) => {
                            quantized::forward(lg, xr, qw, r, false, args.quant_ws(), args.ws())
                        }
                        None => gemm_mixed::gemm_mixed(
                            r,
                            v,
                            c,
                            xr,
                            c,
                            false,
                            wte,
                            c,
                            true,
                            lg,
                            v,
                            false,
                            args.ws(),
                        ),
                    }
                    let (tr, lr) = (&tg[start..start + r], &mut losses[start..start + r]);
                    match (ctx.training, dinp) {
                        (true, Some(d)) => {
                            xent::softmax_xent_backward_inplace(lg, tr, lr, scale, r, v);
                            let dx = &mut self.view::<T>(*d)[start * c..(start + r) * c];
                            // dx[r, C] = dlogits[r, V] @ wte[V, C]
                            if let Some(qw) = &qw {
                                quantized::backward_input(
                                    dx,
                                    &lg[..],
                                    qw,
                                    r,
                                    false,
                                    args.quant_ws(),
                                    args.ws(),
                                );
                                start += r;
                                continue;
                            }
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
                                args.ws(),
                            );
                            // dwte[V, C] += dlogitsᵀ[V, r] @ xr[r, C] (a frozen head
                            // takes no gradient).
                            if e.frozen {
                                start += r;
                                continue;
                            }
                            let dwte = args.grad(w);
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
                                args.ws(),
                            );
                        }
                        _ => xent::softmax_xent_forward(lg, tr, lr, r, v),
                    }
                    start += r;
                }
            }
            Op::LmHeadLast {
                inp,
                logits,
                w,
                rows,
                c,
                v,
            } => {
                let (n, c, v) = (rows.with_seq(ctx.seq).n(), *c, *v);
                let x = &args.act(*inp)[(n - 1) * c..n * c];
                gemm_mixed::gemm_mixed(
                    1,
                    v,
                    c,
                    x,
                    c,
                    false,
                    args.weights(w),
                    c,
                    true,
                    self.view::<f32>(*logits),
                    v,
                    false,
                    args.ws(),
                );
            }
            _ => not_of(OpFamily::LmHead, e),
        }
    }
}
