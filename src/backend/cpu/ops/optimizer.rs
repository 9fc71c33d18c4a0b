//! The optimizer family ([`OpFamily::Optimizer`]) on the CPU: a group's share of the gradient
//! norm ([`Op::GradNorm`]) and [`Op::AdamW`] on the master weights, the moments in the plan's
//! format (f32, bf16 or 8-bit blocks).

use super::{Args, not_of};
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::{adamw, quant, reduce};
use crate::backend::{AdamWStep, StepCtx};
use crate::dtype::Elem;
use crate::ir::schedule::{Op, OpEntry, OptimBufs, ParamSlice};
use crate::ir::{MomentsMut, OpFamily};

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::Optimizer`], with activations stored as `T`.
    pub(super) fn run_optimizer<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        let args = Args::<T>::new(self, e);
        match &e.op {
            Op::GradNorm { range, out, slot } => {
                self.f64_mut(*out)[*slot] = reduce::sum_squares(&*args.grad(range));
            }
            Op::AdamW { tensors, state } => {
                let step = ctx.update.expect("the executor sets the AdamW step");
                self.adamw::<T>(e, tensors, state, &step);
            }
            _ => not_of(OpFamily::Optimizer, e),
        }
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
