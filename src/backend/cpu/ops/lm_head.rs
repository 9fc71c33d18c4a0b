//! The LM head family ([`OpFamily::LmHead`]) on the CPU: [`Op::LmHeadLoss`], chunked over rows
//! (logits, softmax cross-entropy and, in training, the input's and the head's gradients; on
//! f32 weights or a quantized base's), a tensor-parallel head's [`Op::LmHeadStats`] (its
//! part of the vocabulary's softmax statistics, [`xent_part`]), the weight gradient of a
//! slice of the vocabulary taken after the backward ([`Op::LmHeadWeightGrad`],
//! [`xent_slice`]), and generation's [`Op::LmHeadLast`].

use super::{Args, not_of};
use crate::backend::StepCtx;
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::gemm::mixed as gemm_mixed;
use crate::backend::cpu::gemm::quantized::{self, QuantWeight};
use crate::backend::cpu::xent::ROW_STATS;
use crate::backend::cpu::{distill, xent, xent_part, xent_slice};
use crate::dtype::Elem;
use crate::ir::schedule::{Op, OpEntry};
use crate::ir::{OpFamily, VocabShare};

/// The head's weight `[V, C]` as a chunk's GEMMs read it: f32, or a quantized base's.
enum HeadWeight<'a> {
    F32(&'a [f32]),
    Quant(QuantWeight<'a>),
}

impl HeadWeight<'_> {
    /// `lg[r, V] = xr[r, C] @ wᵀ`.
    fn logits<T: Elem>(&self, args: &Args<T>, lg: &mut [f32], xr: &[T], (r, c, v): Dims) {
        match self {
            HeadWeight::Quant(qw) => {
                quantized::forward(lg, xr, qw, r, false, args.quant_ws(), args.ws())
            }
            HeadWeight::F32(w) => {
                gemm_mixed::gemm_mixed(r, v, c, xr, c, false, w, c, true, lg, v, false, args.ws())
            }
        }
    }

    /// `dx[r, C] = dlogits[r, V] @ w[V, C]`.
    fn input_grad<T: Elem>(&self, args: &Args<T>, dx: &mut [T], dl: &[f32], (r, c, v): Dims) {
        match self {
            HeadWeight::Quant(qw) => {
                quantized::backward_input(dx, dl, qw, r, false, args.quant_ws(), args.ws())
            }
            HeadWeight::F32(w) => {
                gemm_mixed::gemm_mixed(r, c, v, dl, v, false, w, c, false, dx, c, false, args.ws())
            }
        }
    }
}

/// A chunk's rows, the model width and the head's rows.
type Dims = (usize, usize, usize);

/// `dw[v, C] += dlogitsᵀ[v, r] @ xr[r, C]`: a chunk of rows' share of the head's weight
/// gradient (of the whole head, or of a slice of its vocabulary).
fn weight_grad<T: Elem>(args: &Args<T>, dw: &mut [T], dl: &[f32], xr: &[T], (r, c, v): Dims) {
    gemm_mixed::gemm_mixed(v, c, r, dl, v, true, xr, c, false, dw, c, true, args.ws())
}

impl CpuDevice {
    /// The weight `w` `[v, c]` of head op `e`.
    fn head_weight<'a, T: Elem>(
        &'a self,
        args: &'a Args<T>,
        e: &OpEntry,
        w: &std::ops::Range<usize>,
        (v, c): (usize, usize),
    ) -> HeadWeight<'a> {
        match self.quant_weight(e, w, (v, c)) {
            Some(qw) => HeadWeight::Quant(qw),
            None => HeadWeight::F32(args.weights(w)),
        }
    }

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
                vocab,
                teacher,
                row_stats,
            } => {
                let (planned, n, c, v) = (rows.n(), rows.with_seq(ctx.seq).n(), *c, *v);
                let wt = self.head_weight(&args, e, w, (v, c));
                let x = &args.act(*inp)[..n * c];
                let tg = &self.u32_mut(*targets)[..n];
                let losses = &mut self.view::<f32>(*losses)[..n];
                let logits = self.view::<f32>(*logits);
                // The ranks' statistics `[ranks, planned, 3]` of a tensor-parallel head.
                let gathered = vocab.map(|s: VocabShare| {
                    let len = s.ranks * planned * xent_part::STATS;
                    (&self.view::<f32>(s.stats)[..len], s)
                });
                let training = ctx.training && dinp.is_some();
                if let (false, Some((all, _))) = (training, gathered) {
                    // Evaluation: the loss is the statistics'.
                    xent_part::part_loss(all, planned, tg, losses);
                    return;
                }
                // d(loss·loss_scale)/dlogits: the mean over the step's trained targets (every
                // micro-batch's, every rank's), scaled.
                let scale = ctx.loss_scale / ctx.loss_tokens.max(1) as f32;
                let mut start = 0;
                while start < n {
                    let r = (*rows_per_chunk).min(n - start);
                    let lg = &mut logits[..r * v];
                    let xr = &x[start * c..(start + r) * c];
                    if !gathered.is_some_and(|(_, s)| s.logits_kept) {
                        wt.logits(&args, lg, xr, (r, c, v));
                    }
                    let (tr, lr) = (&tg[start..start + r], &mut losses[start..start + r]);
                    let Some(d) = dinp.filter(|_| training) else {
                        // Evaluation: the data's cross-entropy (a distilled run's too).
                        xent::softmax_xent_forward(lg, tr, lr, r, v);
                        start += r;
                        continue;
                    };
                    match (gathered, teacher) {
                        (Some((all, s)), _) => xent_part::part_backward_inplace(
                            lg,
                            tr,
                            lr,
                            all,
                            (start, planned),
                            s.first_token,
                            scale,
                            v,
                        ),
                        (None, Some(t)) => {
                            // The teacher's logits of the rows: tl[r, V] = h[r, Ct] @ Wtᵀ.
                            let tl = &mut self.view::<f32>(t.logits)[..r * v];
                            let h = &self.view::<f32>(t.hidden)[start * t.c..(start + r) * t.c];
                            let tw = &self.view::<f32>(t.w)[..v * t.c];
                            gemm_mixed::gemm_mixed(
                                r,
                                v,
                                t.c,
                                h,
                                t.c,
                                false,
                                tw,
                                t.c,
                                true,
                                tl,
                                v,
                                false,
                                args.ws(),
                            );
                            distill::distill_backward_inplace(lg, tl, tr, lr, t.alpha, scale, r, v)
                        }
                        (None, None) => match row_stats {
                            Some(s) => xent::softmax_xent_backward_with_stats(
                                lg,
                                tr,
                                lr,
                                &mut self.view::<f32>(*s)
                                    [start * ROW_STATS..(start + r) * ROW_STATS],
                                scale,
                                r,
                                v,
                            ),
                            None => xent::softmax_xent_backward_inplace(lg, tr, lr, scale, r, v),
                        },
                    }
                    let dx = &mut self.view::<T>(d)[start * c..(start + r) * c];
                    wt.input_grad(&args, dx, lg, (r, c, v));
                    // dw[V, C] += dlogitsᵀ[V, r] @ xr[r, C] (a frozen head, a quantized
                    // base's among them, takes no gradient; with `row_stats` it is taken
                    // after the backward, by `LmHeadWeightGrad`).
                    if let (HeadWeight::F32(_), false, None) = (&wt, e.frozen, row_stats) {
                        weight_grad(&args, args.grad(w), lg, xr, (r, c, v));
                    }
                    start += r;
                }
            }
            Op::LmHeadWeightGrad {
                inp,
                targets,
                row_stats,
                logits,
                w,
                first_token,
                rows,
                c,
                v,
                rows_per_chunk,
            } => {
                let (n, c, v) = (rows.with_seq(ctx.seq).n(), *c, *v);
                let wt = self.head_weight(&args, e, w, (v, c));
                let x = &args.act(*inp)[..n * c];
                let tg = &self.u32_mut(*targets)[..n];
                let stats = &self.view::<f32>(*row_stats)[..n * ROW_STATS];
                let logits = self.view::<f32>(*logits);
                // As `LmHeadLoss` scales the logits' gradient.
                let scale = ctx.loss_scale / ctx.loss_tokens.max(1) as f32;
                let mut start = 0;
                while start < n {
                    let r = (*rows_per_chunk).min(n - start);
                    let lg = &mut logits[..r * v];
                    let xr = &x[start * c..(start + r) * c];
                    wt.logits(&args, lg, xr, (r, c, v));
                    let (tr, st) = (
                        &tg[start..start + r],
                        &stats[start * ROW_STATS..(start + r) * ROW_STATS],
                    );
                    xent_slice::grad_slice(lg, tr, st, *first_token, scale, r, v);
                    // The slice's rows of dw, as `LmHeadLoss` takes the whole.
                    weight_grad(&args, args.grad(w), lg, xr, (r, c, v));
                    start += r;
                }
            }
            Op::LmHeadStats {
                inp,
                targets,
                logits,
                stats,
                w,
                first_token,
                rows,
                c,
                v,
                rows_per_chunk,
            } => {
                let (n, c, v) = (rows.with_seq(ctx.seq).n(), *c, *v);
                let wt = self.head_weight(&args, e, w, (v, c));
                let x = &args.act(*inp)[..n * c];
                let tg = &self.u32_mut(*targets)[..n];
                let stats = &mut self.view::<f32>(*stats)[..n * xent_part::STATS];
                let logits = self.view::<f32>(*logits);
                let mut start = 0;
                while start < n {
                    let r = (*rows_per_chunk).min(n - start);
                    let lg = &mut logits[..r * v];
                    wt.logits(&args, lg, &x[start * c..(start + r) * c], (r, c, v));
                    let st = &mut stats[start * xent_part::STATS..(start + r) * xent_part::STATS];
                    xent_part::part_stats(lg, &tg[start..start + r], st, *first_token, r, v);
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
                // f32 weights, or a model kept as quantized blocks (a frozen base).
                let wt = self.head_weight(&args, e, w, (v, c));
                wt.logits(&args, self.view::<f32>(*logits), x, (1, c, v));
            }
            _ => not_of(OpFamily::LmHead, e),
        }
    }
}
