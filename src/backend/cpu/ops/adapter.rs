//! The adapter family ([`OpFamily::Adapter`]) on the CPU: a LoRA adapter's forward and
//! backward, with the step's dropout mask where the plan has one.

use super::{Args, not_of};
use crate::backend::StepCtx;
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::lora;
use crate::dtype::Elem;
use crate::ir::OpFamily;
use crate::ir::schedule::{LoraDropout, Op, OpEntry, Rows};

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::Adapter`], with activations stored as `T`.
    pub(super) fn run_adapter<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        let args = Args::<T>::new(self, e);
        match &e.op {
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
                    &args.act(*inp)[..n * ic],
                    args.weights(a),
                    args.weights(b),
                    (n, *ic, *oc, r),
                    (*col, *ldo),
                    *scale,
                    mask.as_mut().map(|(d, xd)| (&*d, &mut xd[..n * ic])),
                    args.ws(),
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
                let (da, db) = args.grad2(a, b);
                let mut mask = self.dropout(dropout, *rows, *ic, ctx);
                lora::lora_backward(
                    &mut self.view::<T>(*dinp)[..n * ic],
                    da,
                    db,
                    &mut self.view::<f32>(*dh)[..n * r],
                    &args.act(*dout)[..n * ldo],
                    &args.act(*inp)[..n * ic],
                    &args.act(*h)[..n * r],
                    args.weights(a),
                    args.weights(b),
                    (n, *ic, *oc, r),
                    (*col, *ldo),
                    *scale,
                    mask.as_mut().map(|(d, xd)| (&*d, &mut xd[..n * ic])),
                    args.ws(),
                );
            }
            _ => not_of(OpFamily::Adapter, e),
        }
    }

    /// An adapter's dropout mask for this step and its workspace, in a training step (none
    /// otherwise: evaluation and generation use the whole input). The op's rows are
    /// `(ctx.first_micro + micro)·N..` of the step's batch, whose elements the mask is drawn
    /// by (a tensor rank's columns of it where the input is cut).
    #[allow(clippy::type_complexity)]
    fn dropout(
        &self,
        d: &Option<LoraDropout>,
        rows: Rows,
        ic: usize,
        ctx: &StepCtx,
    ) -> Option<(lora::Dropout, &mut [f32])> {
        let d = d.as_ref().filter(|_| ctx.training)?;
        // Rows of the one-process input (a tensor rank's columns of it: `d.cols`).
        let first = ((ctx.first_micro + d.micro) * rows.n() * d.cols.0) as u64;
        let mask = lora::Dropout::new(d.p, ctx.dropout_seed, d.adapter as u64, first)
            .in_columns(ic, d.cols);
        Some((mask, self.view::<f32>(d.ws)))
    }
}
