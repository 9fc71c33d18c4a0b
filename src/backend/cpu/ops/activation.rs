//! The activation family ([`OpFamily::Activation`]) on the CPU: GELU and the gated units
//! (SwiGLU, GeGLU), forward and backward.

use super::{Args, not_of};
use crate::backend::StepCtx;
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::{gelu, glu};
use crate::dtype::Elem;
use crate::ir::OpFamily;
use crate::ir::schedule::{Op, OpEntry};

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::Activation`], with activations stored as `T`.
    pub(super) fn run_activation<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        let args = Args::<T>::new(self, e);
        match &e.op {
            Op::Glu {
                inp,
                out,
                rows,
                h,
                act,
            } => {
                let (n, h) = (rows.with_seq(ctx.seq).n(), *h);
                glu::glu_forward(
                    &mut self.view::<T>(*out)[..n * h],
                    &args.act(*inp)[..n * 2 * h],
                    n,
                    h,
                    *act,
                )
            }
            Op::Gelu {
                inp,
                out,
                rows,
                width,
            } => {
                let len = rows.with_seq(ctx.seq).n() * width;
                gelu::gelu_forward(&mut self.view::<T>(*out)[..len], &args.act(*inp)[..len])
            }
            Op::GluBackward {
                dinp,
                dout,
                inp,
                rows,
                h,
                act,
            } => {
                let (n, h) = (rows.with_seq(ctx.seq).n(), *h);
                glu::glu_backward(
                    &mut self.view::<T>(*dinp)[..n * 2 * h],
                    &args.act(*dout)[..n * h],
                    &args.act(*inp)[..n * 2 * h],
                    n,
                    h,
                    *act,
                )
            }
            Op::GeluBackward {
                d,
                inp,
                rows,
                width,
            } => {
                let len = rows.with_seq(ctx.seq).n() * width;
                gelu::gelu_backward_inplace(&mut self.view::<T>(*d)[..len], &args.act(*inp)[..len])
            }
            _ => not_of(OpFamily::Activation, e),
        }
    }
}
