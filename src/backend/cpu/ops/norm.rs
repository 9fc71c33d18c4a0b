//! The normalisation family ([`OpFamily::Norm`]) on the CPU: layer norm, RMS norm and Qwen3's
//! per-head q/k norm, forward and backward (a frozen norm's backward computes only its input's
//! gradient).

use super::{Args, not_of};
use crate::backend::StepCtx;
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::rmsnorm::Gain;
use crate::backend::cpu::{layernorm, rmsnorm};
use crate::dtype::Elem;
use crate::ir::OpFamily;
use crate::ir::schedule::{Op, OpEntry};

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::Norm`], with activations stored as `T`.
    pub(super) fn run_norm<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        let args = Args::<T>::new(self, e);
        match &e.op {
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
                    &args.act(*inp)[..n * c],
                    args.weights(w),
                    args.weights(bias),
                    n,
                    c,
                    *eps,
                )
            }
            Op::RmsNorm {
                inp,
                out,
                residual,
                rstd,
                w,
                offset,
                rows,
                c,
                eps,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                rmsnorm::rmsnorm_forward(
                    &mut self.view::<T>(*out)[..n * c],
                    residual.map(|r| &args.act(r)[..n * c]),
                    &mut self.view::<f32>(*rstd)[..n],
                    &args.act(*inp)[..n * c],
                    gain(args.weights(w), *offset),
                    n,
                    c,
                    *eps,
                )
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
                        &args.act(*dout)[..n * c],
                        &args.act(*inp)[..n * c],
                        args.weights(w),
                        &self.view::<f32>(*mean)[..n],
                        &self.view::<f32>(*rstd)[..n],
                        n,
                        c,
                    );
                    return;
                }
                let (dw, db) = args.grad2(w, bias);
                layernorm::layernorm_backward(
                    &mut self.view::<T>(*dinp)[..n * c],
                    dw,
                    db,
                    &args.act(*dout)[..n * c],
                    &args.act(*inp)[..n * c],
                    args.weights(w),
                    &self.view::<f32>(*mean)[..n],
                    &self.view::<f32>(*rstd)[..n],
                    n,
                    c,
                );
            }
            Op::RmsNormBackward {
                dinp,
                dout,
                inp,
                rstd,
                w,
                offset,
                rows,
                c,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                if e.frozen {
                    rmsnorm::rmsnorm_backward_input(
                        &mut self.view::<T>(*dinp)[..n * c],
                        &args.act(*dout)[..n * c],
                        &args.act(*inp)[..n * c],
                        gain(args.weights(w), *offset),
                        &self.view::<f32>(*rstd)[..n],
                        n,
                        c,
                    );
                    return;
                }
                rmsnorm::rmsnorm_backward(
                    &mut self.view::<T>(*dinp)[..n * c],
                    args.grad(w),
                    &args.act(*dout)[..n * c],
                    &args.act(*inp)[..n * c],
                    gain(args.weights(w), *offset),
                    &self.view::<f32>(*rstd)[..n],
                    n,
                    c,
                );
            }
            Op::QkNorm {
                inp,
                out,
                rstd,
                w,
                offset,
                rows,
                nh,
                nkv,
                hd,
                eps,
            } => {
                let n = rows.with_seq(ctx.seq).n();
                let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
                rmsnorm::qk_norm_forward(
                    &mut self.view::<T>(*out)[..n * qkv],
                    &mut self.view::<f32>(*rstd)[..n * heads],
                    &args.act(*inp)[..n * qkv],
                    gain(args.weights(w), *offset),
                    n,
                    (*nh, *nkv, *hd),
                    *eps,
                )
            }
            Op::QkNormBackward {
                d,
                inp,
                rstd,
                w,
                offset,
                rows,
                nh,
                nkv,
                hd,
            } => {
                let n = rows.with_seq(ctx.seq).n();
                let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
                let dw = (!e.frozen).then(|| args.grad(w));
                rmsnorm::qk_norm_backward(
                    &mut self.view::<T>(*d)[..n * qkv],
                    dw,
                    &args.act(*inp)[..n * qkv],
                    gain(args.weights(w), *offset),
                    &self.view::<f32>(*rstd)[..n * heads],
                    n,
                    (*nh, *nkv, *hd),
                )
            }
            _ => not_of(OpFamily::Norm, e),
        }
    }
}

/// A norm's gain from its weights and offset.
fn gain<W: Elem>(w: &[W], offset: f32) -> Gain<'_, W> {
    Gain { w, offset }
}
