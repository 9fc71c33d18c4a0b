//! The op → kernel mapping of the CPU backend: the only place that knows which kernel runs an
//! [`Op`]. Generic over the plan's storage type `T` (f32, bf16, f16): activations and
//! gradients are `T`; weights are always the fp32 parameters (the master weights under mixed
//! precision: kernels convert them per tile, so no reduced-precision copy is stored);
//! layernorm statistics, attention log-sum-exps, losses and the LM head's logits chunk are
//! f32. Every dimension comes from the op itself; nothing here reads the model.

use super::device::{CpuDevice, two_ranges};
use super::gemm::mixed as gemm_mixed;
use super::gemm::quantized::{self, QuantWeight};
use super::{adamw, attention, encoder, gelu, layernorm, lora, matmul, quant, reduce, xent};
use super::{rmsnorm, rope, swiglu};
use crate::backend::{AdamWStep, OpResult, StepCtx};
use crate::dtype::Elem;
use crate::ir::BufId;
use crate::ir::MomentsMut;
use crate::ir::schedule::{LoraDropout, Op, OpEntry, OptimBufs, ParamSlice, Rows, WeightLayout};
use std::ops::Range;

/// The kernel's name for a plan's weight layout.
fn weight_layout(l: WeightLayout) -> matmul::Layout {
    match l {
        WeightLayout::InOut => matmul::Layout::InOut,
        WeightLayout::OutIn => matmul::Layout::OutIn,
    }
}

impl CpuDevice {
    /// The gradients of parameter range `r`, in the buffer `e` is bound to.
    #[allow(clippy::mut_from_ref)]
    fn grad<T: Elem>(&self, e: &OpEntry, r: &Range<usize>) -> &mut [T] {
        let b = e
            .grads
            .expect("internal error: an op with gradients has them bound");
        &mut self.view::<T>(b.buf)[b.local(r)]
    }

    /// The gradients of two disjoint parameter ranges of one group (a weight and its bias).
    fn grad2<T: Elem>(
        &self,
        e: &OpEntry,
        a: &Range<usize>,
        c: &Range<usize>,
    ) -> (&mut [T], &mut [T]) {
        let b = e
            .grads
            .expect("internal error: an op with gradients has them bound");
        two_ranges(self.view::<T>(b.buf), b.local(a), b.local(c))
    }

    /// The `[rows, cols]` weight of parameter range `r` where `e` is bound to a quantized
    /// base ([`crate::ir::schedule::Binding::quant`]); `None` where it is bound to f32.
    fn quant_weight(
        &self,
        e: &OpEntry,
        r: &Range<usize>,
        (rows, cols): (usize, usize),
    ) -> Option<QuantWeight<'_>> {
        let b = e.params?;
        let ty = b.quant?;
        let at = |n: usize| {
            ty.bytes_for(n as u64)
                .expect("internal error: a quantized range of whole blocks") as usize
        };
        let start = at(r.start - b.base);
        let bytes = &self.bytes(b.buf)[start..start + at(r.len())];
        Some(
            QuantWeight::new(ty, bytes, rows, cols)
                .expect("internal error: a quantized weight of its shape"),
        )
    }

    /// An adapter's dropout mask for this step and its workspace, in a training step (none
    /// otherwise: evaluation and generation use the whole input). The op's rows are
    /// `(ctx.first_micro + micro)·N..` of the step's batch, whose elements the mask is drawn
    /// by.
    #[allow(clippy::type_complexity)]
    fn dropout(
        &self,
        d: &Option<LoraDropout>,
        rows: Rows,
        ic: usize,
        ctx: &StepCtx,
    ) -> Option<(lora::Dropout, &mut [f32])> {
        let d = d.as_ref().filter(|_| ctx.training)?;
        let first = ((ctx.first_micro + d.micro) * rows.n() * ic) as u64;
        let mask = lora::Dropout::new(d.p, ctx.dropout_seed, d.adapter as u64, first);
        Some((mask, self.view::<f32>(d.ws)))
    }

    /// Runs `op` with activations stored as `T`.
    pub(super) fn run_op<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) -> OpResult {
        let op = &e.op;
        // The fp32 (master) weights of the op's parameter ranges, where the op is bound.
        let (params, base): (&[f32], usize) = match e.params {
            Some(b) if b.quant.is_none() => (self.view(b.buf), b.base),
            _ => (&[], 0),
        };
        let weights = |r: &Range<usize>| &params[r.start - base..r.end - base];
        let grad = |r: &Range<usize>| self.grad::<T>(e, r);
        let grad2 = |a: &Range<usize>, b: &Range<usize>| self.grad2::<T>(e, a, b);
        let ws = || match self.state.gemm_ws {
            Some(id) => self.view::<f32>(id),
            None => &mut [],
        };
        let quant_ws = || match self.state.quant_ws {
            Some(id) => self.view::<f32>(id),
            None => &mut [],
        };
        let act = |id| &self.view::<T>(id)[..];
        // The rows' places in their examples (packed rows), `[B, T]` of the op's shape.
        let positions = |p: &Option<BufId>, r: Rows| p.map(|id| &self.u32_mut(id)[..r.n()]);
        match op {
            Op::Zero { buf } => self.zero(*buf),
            Op::Encoder {
                tokens,
                positions: pos,
                out,
                wte,
                wpe,
                rows,
                c,
            } => {
                let (r, c) = (rows.with_seq(ctx.seq), *c);
                let n = r.n();
                if let Some(table) = self.quant_weight(e, wte, (wte.len() / c, c)) {
                    // Rows of a quantized table, decoded as they are gathered.
                    assert!(wpe.is_none(), "internal error: a quantized base with wpe");
                    let out = &mut self.view::<T>(*out)[..n * c];
                    let row = &mut quant_ws()[..c];
                    for (o, &tok) in out.chunks_exact_mut(c).zip(&self.u32_mut(*tokens)[..n]) {
                        table.decode_row(tok as usize, row);
                        for (o, &x) in o.iter_mut().zip(row.iter()) {
                            *o = T::from_f32(x);
                        }
                    }
                    return OpResult::Done;
                }
                encoder::encoder_forward(
                    &mut self.view::<T>(*out)[..n * c],
                    &self.u32_mut(*tokens)[..n],
                    weights(wte),
                    wpe.as_ref().map(weights),
                    positions(pos, r),
                    r.b,
                    r.t,
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
                rows,
                c,
                eps,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                layernorm::layernorm_forward(
                    &mut self.view::<T>(*out)[..n * c],
                    &mut self.view::<f32>(*mean)[..n],
                    &mut self.view::<f32>(*rstd)[..n],
                    &act(*inp)[..n * c],
                    weights(w),
                    weights(bias),
                    n,
                    c,
                    *eps,
                )
            }
            Op::Matmul {
                inp,
                out,
                residual,
                w,
                b: bias,
                layout,
                rows,
                ic,
                oc,
            } => {
                let (n, ic, oc) = (rows.with_seq(ctx.seq).n(), *ic, *oc);
                let out = &mut self.view::<T>(*out)[..n * oc];
                if let Some(r) = residual {
                    out.copy_from_slice(&act(*r)[..n * oc]);
                }
                if let Some(qw) = self.quant_weight(e, w, (oc, ic)) {
                    assert!(
                        bias.is_none() && *layout == WeightLayout::OutIn,
                        "internal error: a quantized base is [out, in] without biases"
                    );
                    let inp = &act(*inp)[..n * ic];
                    quantized::forward(out, inp, &qw, n, residual.is_some(), quant_ws(), ws());
                    return OpResult::Done;
                }
                matmul::matmul_forward(
                    out,
                    &act(*inp)[..n * ic],
                    weights(w),
                    bias.as_ref().map(weights),
                    weight_layout(*layout),
                    n,
                    ic,
                    oc,
                    residual.is_some(),
                    ws(),
                );
            }
            Op::Attention {
                qkv,
                positions: pos,
                out,
                lse,
                ws,
                rows,
                nh,
                nkv,
                hd,
            } => {
                let (r, nh, nkv, hd) = (rows.with_seq(ctx.seq), *nh, *nkv, *hd);
                let n = r.n();
                attention::attention_forward(
                    &mut self.view::<T>(*out)[..n * nh * hd],
                    &mut self.view::<f32>(*lse)[..r.b * nh * r.t],
                    &act(*qkv)[..n * (nh + 2 * nkv) * hd],
                    r.b,
                    r.t,
                    nh,
                    nkv,
                    hd,
                    positions(pos, r),
                    self.view::<f32>(*ws),
                )
            }
            Op::RmsNorm {
                inp,
                out,
                rstd,
                w,
                rows,
                c,
                eps,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                rmsnorm::rmsnorm_forward(
                    &mut self.view::<T>(*out)[..n * c],
                    &mut self.view::<f32>(*rstd)[..n],
                    &act(*inp)[..n * c],
                    weights(w),
                    n,
                    c,
                    *eps,
                )
            }
            Op::AddBias { out, b, rows, oc } => {
                let n = rows.with_seq(ctx.seq).n();
                matmul::add_bias(&mut self.view::<T>(*out)[..n * oc], weights(b), *oc);
            }
            Op::Rope {
                x,
                positions: pos,
                rows,
                width,
                rotated,
                hd,
                inv_freq,
                inverse,
            } => {
                let r = rows.with_seq(ctx.seq);
                let rotate = if *inverse {
                    rope::rope_backward
                } else {
                    rope::rope_forward
                };
                rotate(
                    &mut self.view::<T>(*x)[..r.n() * width],
                    r.b,
                    r.t,
                    *width,
                    *rotated,
                    *hd,
                    inv_freq,
                    0,
                    positions(pos, r),
                )
            }
            Op::Swiglu { inp, out, rows, h } => {
                let (n, h) = (rows.with_seq(ctx.seq).n(), *h);
                swiglu::swiglu_forward(
                    &mut self.view::<T>(*out)[..n * h],
                    &act(*inp)[..n * 2 * h],
                    n,
                    h,
                )
            }
            Op::Gelu {
                inp,
                out,
                rows,
                width,
            } => {
                let len = rows.with_seq(ctx.seq).n() * width;
                gelu::gelu_forward(&mut self.view::<T>(*out)[..len], &act(*inp)[..len])
            }
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
                let wte = if qw.is_none() { weights(w) } else { &[] };
                let x = &act(*inp)[..n * c];
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
                        Some(qw) => quantized::forward(lg, xr, qw, r, false, quant_ws(), ws()),
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
                            ws(),
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
                                    quant_ws(),
                                    ws(),
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
                                ws(),
                            );
                            // dwte[V, C] += dlogitsᵀ[V, r] @ xr[r, C] (a frozen head
                            // takes no gradient).
                            if e.frozen {
                                start += r;
                                continue;
                            }
                            let dwte = grad(w);
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
            Op::LmHeadLast {
                inp,
                logits,
                w,
                rows,
                c,
                v,
            } => {
                let (n, c, v) = (rows.with_seq(ctx.seq).n(), *c, *v);
                let x = &act(*inp)[(n - 1) * c..n * c];
                gemm_mixed::gemm_mixed(
                    1,
                    v,
                    c,
                    x,
                    c,
                    false,
                    weights(w),
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
                rows,
                c,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                if e.frozen {
                    layernorm::layernorm_backward_input(
                        &mut self.view::<T>(*dinp)[..n * c],
                        &act(*dout)[..n * c],
                        &act(*inp)[..n * c],
                        weights(w),
                        &self.view::<f32>(*mean)[..n],
                        &self.view::<f32>(*rstd)[..n],
                        n,
                        c,
                    );
                    return OpResult::Done;
                }
                let (dw, db) = grad2(w, bias);
                layernorm::layernorm_backward(
                    &mut self.view::<T>(*dinp)[..n * c],
                    dw,
                    db,
                    &act(*dout)[..n * c],
                    &act(*inp)[..n * c],
                    weights(w),
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
                layout,
                rows,
                ic,
                oc,
            } => {
                let (n, ic, oc) = (rows.with_seq(ctx.seq).n(), *ic, *oc);
                if let Some(qw) = self.quant_weight(e, w, (oc, ic)) {
                    let (dinp, dout) =
                        (&mut self.view::<T>(*dinp)[..n * ic], &act(*dout)[..n * oc]);
                    quantized::backward_input(dinp, dout, &qw, n, false, quant_ws(), ws());
                    return OpResult::Done;
                }
                if e.frozen {
                    matmul::matmul_backward_input(
                        &mut self.view::<T>(*dinp)[..n * ic],
                        &act(*dout)[..n * oc],
                        weights(w),
                        weight_layout(*layout),
                        n,
                        ic,
                        oc,
                        ws(),
                    );
                    return OpResult::Done;
                }
                let (dw, db) = match bias {
                    Some(b) => {
                        let (dw, db) = grad2(w, b);
                        (dw, Some(db))
                    }
                    None => (grad(w), None),
                };
                matmul::matmul_backward(
                    &mut self.view::<T>(*dinp)[..n * ic],
                    dw,
                    db,
                    &act(*dout)[..n * oc],
                    &act(*inp)[..n * ic],
                    weights(w),
                    weight_layout(*layout),
                    n,
                    ic,
                    oc,
                    ws(),
                );
            }
            Op::LoraForward {
                inp,
                out,
                h,
                a,
                b,
                rows,
                ic,
                oc,
                r,
                col,
                ldo,
                scale,
                dropout,
            } => {
                let (n, r) = (rows.with_seq(ctx.seq).n(), *r);
                let mut mask = self.dropout(dropout, *rows, *ic, ctx);
                lora::lora_forward(
                    &mut self.view::<T>(*out)[..n * ldo],
                    &mut self.view::<T>(*h)[..n * r],
                    &act(*inp)[..n * ic],
                    weights(a),
                    weights(b),
                    (n, *ic, *oc, r),
                    (*col, *ldo),
                    *scale,
                    mask.as_mut().map(|(d, xd)| (&*d, &mut xd[..n * ic])),
                    ws(),
                );
            }
            Op::LoraBackward {
                dinp,
                dout,
                inp,
                h,
                dh,
                a,
                b,
                rows,
                ic,
                oc,
                r,
                col,
                ldo,
                scale,
                dropout,
            } => {
                let (n, r) = (rows.with_seq(ctx.seq).n(), *r);
                let (da, db) = grad2(a, b);
                let mut mask = self.dropout(dropout, *rows, *ic, ctx);
                lora::lora_backward(
                    &mut self.view::<T>(*dinp)[..n * ic],
                    da,
                    db,
                    &mut self.view::<f32>(*dh)[..n * r],
                    &act(*dout)[..n * ldo],
                    &act(*inp)[..n * ic],
                    &act(*h)[..n * r],
                    weights(a),
                    weights(b),
                    (n, *ic, *oc, r),
                    (*col, *ldo),
                    *scale,
                    mask.as_mut().map(|(d, xd)| (&*d, &mut xd[..n * ic])),
                    ws(),
                );
            }
            Op::AttentionBackward {
                dqkv,
                positions: pos,
                dout,
                qkv,
                out,
                lse,
                ws,
                rows,
                nh,
                nkv,
                hd,
            } => {
                let (r, nh, nkv, hd) = (rows.with_seq(ctx.seq), *nh, *nkv, *hd);
                let n = r.n();
                let (a, qkv_w) = (nh * hd, (nh + 2 * nkv) * hd);
                attention::attention_backward(
                    &mut self.view::<T>(*dqkv)[..n * qkv_w],
                    &act(*dout)[..n * a],
                    &act(*qkv)[..n * qkv_w],
                    &act(*out)[..n * a],
                    &self.view::<f32>(*lse)[..r.b * nh * r.t],
                    r.b,
                    r.t,
                    nh,
                    nkv,
                    hd,
                    positions(pos, r),
                    self.view::<f32>(*ws),
                )
            }
            Op::RmsNormBackward {
                dinp,
                dout,
                inp,
                rstd,
                w,
                rows,
                c,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                if e.frozen {
                    rmsnorm::rmsnorm_backward_input(
                        &mut self.view::<T>(*dinp)[..n * c],
                        &act(*dout)[..n * c],
                        &act(*inp)[..n * c],
                        weights(w),
                        &self.view::<f32>(*rstd)[..n],
                        n,
                        c,
                    );
                    return OpResult::Done;
                }
                rmsnorm::rmsnorm_backward(
                    &mut self.view::<T>(*dinp)[..n * c],
                    grad(w),
                    &act(*dout)[..n * c],
                    &act(*inp)[..n * c],
                    weights(w),
                    &self.view::<f32>(*rstd)[..n],
                    n,
                    c,
                );
            }
            Op::SwigluBackward {
                dinp,
                dout,
                inp,
                rows,
                h,
            } => {
                let (n, h) = (rows.with_seq(ctx.seq).n(), *h);
                swiglu::swiglu_backward(
                    &mut self.view::<T>(*dinp)[..n * 2 * h],
                    &act(*dout)[..n * h],
                    &act(*inp)[..n * 2 * h],
                    n,
                    h,
                )
            }
            Op::GeluBackward {
                d,
                inp,
                rows,
                width,
            } => {
                let len = rows.with_seq(ctx.seq).n() * width;
                gelu::gelu_backward_inplace(&mut self.view::<T>(*d)[..len], &act(*inp)[..len])
            }
            Op::EncoderBackward {
                dout,
                tokens,
                positions: pos,
                wte,
                wpe,
                rows,
                c,
            } => {
                let (r, c) = (rows.with_seq(ctx.seq), *c);
                let n = r.n();
                let (dwte, dwpe) = match wpe {
                    Some(wpe) => {
                        let (dwte, dwpe) = grad2(wte, wpe);
                        (dwte, Some(dwpe))
                    }
                    None => (grad(wte), None),
                };
                encoder::encoder_backward(
                    dwte,
                    dwpe,
                    &act(*dout)[..n * c],
                    &self.u32_mut(*tokens)[..n],
                    positions(pos, r),
                    r.b,
                    r.t,
                    c,
                );
            }
            Op::GradNorm { range } => {
                return OpResult::SumOfSquares(reduce::sum_squares(&*grad(range)));
            }
            Op::AdamW { tensors, state } => {
                let step = ctx.update.expect("the executor sets the AdamW step");
                self.adamw::<T>(e, tensors, state, &step);
            }
            Op::Transfer { .. } | Op::AwaitTransfers { .. } => {
                unreachable!("the device runs transfers itself")
            }
            Op::AllReduce { .. }
            | Op::ReduceScatter { .. }
            | Op::AllGather { .. }
            | Op::AwaitCollective { .. } => {
                unreachable!("the device starts and awaits collectives itself")
            }
        }
        OpResult::Done
    }

    /// AdamW over `tensors` on the master weights (the compute weights themselves in fp32
    /// plans), the moments in `moments` (in the plan's format; the whole model's, or a
    /// group's staging copy whose element 0 is parameter `moments.base`).
    fn adamw<T: Elem>(
        &self,
        e: &OpEntry,
        tensors: &[ParamSlice],
        moments: &OptimBufs,
        step: &AdamWStep,
    ) {
        let bound = e
            .params
            .expect("internal error: AdamW has its parameters bound");
        let master = self.view::<f32>(bound.buf);
        let mut state = self.moments_view(moments);
        for t in tensors {
            let r = t.range.clone();
            let (base, block_base) = (moments.base, moments.block_base);
            let b0 = t.state_block - block_base;
            let blocks = b0..b0 + r.len().div_ceil(quant::QBLOCK);
            let local = r.start - base..r.end - base;
            let p = AdamWStep {
                weight_decay: if t.decay { step.weight_decay } else { 0.0 },
                ..*step
            };
            let (p_, g) = (&mut master[bound.local(&r)], &*self.grad::<T>(e, &r));
            let r = local;
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
    }
}
