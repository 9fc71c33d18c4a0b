//! The linear family ([`OpFamily::Linear`]) on the CPU: [`Op::Matmul`] and
//! [`Op::MatmulBackward`] on f32 weights or a quantized base's blocks, and [`Op::AddBias`].

use super::{Args, not_of};
use crate::backend::StepCtx;
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::gemm::quantized;
use crate::backend::cpu::matmul;
use crate::dtype::Elem;
use crate::ir::OpFamily;
use crate::ir::schedule::{Op, OpEntry, WeightLayout};

/// The kernel's name for a plan's weight layout.
fn weight_layout(l: WeightLayout) -> matmul::Layout {
    match l {
        WeightLayout::InOut => matmul::Layout::InOut,
        WeightLayout::OutIn => matmul::Layout::OutIn,
    }
}

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::Linear`], with activations stored as `T`.
    pub(super) fn run_linear<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        let args = Args::<T>::new(self, e);
        match &e.op {
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
                    out.copy_from_slice(&args.act(*r)[..n * oc]);
                }
                if let Some(qw) = self.quant_weight(e, w, (oc, ic)) {
                    assert!(
                        bias.is_none() && *layout == WeightLayout::OutIn,
                        "internal error: a quantized base is [out, in] without biases"
                    );
                    let inp = &args.act(*inp)[..n * ic];
                    quantized::forward(
                        out,
                        inp,
                        &qw,
                        n,
                        residual.is_some(),
                        args.quant_ws(),
                        args.ws(),
                    );
                    return;
                }
                matmul::matmul_forward(
                    out,
                    &args.act(*inp)[..n * ic],
                    args.weights(w),
                    bias.as_ref().map(|r| args.weights(r)),
                    weight_layout(*layout),
                    n,
                    ic,
                    oc,
                    residual.is_some(),
                    args.ws(),
                );
            }
            Op::AddBias { out, b, rows, oc } => {
                let n = rows.with_seq(ctx.seq).n();
                matmul::add_bias(&mut self.view::<T>(*out)[..n * oc], args.weights(b), *oc);
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
                    let (dinp, dout) = (
                        &mut self.view::<T>(*dinp)[..n * ic],
                        &args.act(*dout)[..n * oc],
                    );
                    quantized::backward_input(
                        dinp,
                        dout,
                        &qw,
                        n,
                        false,
                        args.quant_ws(),
                        args.ws(),
                    );
                    return;
                }
                if e.frozen {
                    matmul::matmul_backward_input(
                        &mut self.view::<T>(*dinp)[..n * ic],
                        &args.act(*dout)[..n * oc],
                        args.weights(w),
                        weight_layout(*layout),
                        n,
                        ic,
                        oc,
                        args.ws(),
                    );
                    return;
                }
                let (dw, db) = match bias {
                    Some(b) => {
                        let (dw, db) = args.grad2(w, b);
                        (dw, Some(db))
                    }
                    None => (args.grad(w), None),
                };
                matmul::matmul_backward(
                    &mut self.view::<T>(*dinp)[..n * ic],
                    dw,
                    db,
                    &args.act(*dout)[..n * oc],
                    &args.act(*inp)[..n * ic],
                    args.weights(w),
                    weight_layout(*layout),
                    n,
                    ic,
                    oc,
                    args.ws(),
                );
            }
            _ => not_of(OpFamily::Linear, e),
        }
    }
}
