//! The optimizer family ([`OpFamily::Optimizer`]) on the CPU: a group's share of the gradient
//! norm ([`Op::GradNorm`]) and [`Op::AdamW`] on the master weights, the moments in the plan's
//! format (f32, bf16 or 8-bit blocks).

use super::{Args, not_of};
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::{adamw, quant, reduce};
use crate::backend::{AdamWStep, StepCtx};
use crate::dtype::Elem;
use crate::ir::schedule::{BlockScales, Op, OpEntry, OptimBufs, ParamSlice};
use crate::ir::{MomentsMut, OpFamily};
use rayon::prelude::*;

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::Optimizer`], with activations stored as `T`.
    pub(super) fn run_optimizer<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        let args = Args::<T>::new(self, e);
        match &e.op {
            Op::GradNorm {
                range, out, slot, ..
            } => {
                self.f64_mut(*out)[*slot] = reduce::sum_squares(&*args.grad(range));
            }
            Op::AdamW {
                tensors,
                state,
                scales,
            } => {
                let step = ctx.update.expect("the executor sets the AdamW step");
                match scales {
                    None => self.adamw::<T>(e, tensors, state, &step),
                    Some(s) => self.adamw_at_scales::<T>(e, tensors, state, s, &step),
                }
            }
            Op::AdamWBlockMax {
                tensors,
                state,
                out,
            } => {
                let step = ctx.update.expect("the executor sets the AdamW step");
                self.adamw_block_max::<T>(e, tensors, state, out, &step);
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
            let p = tensor_step(step, t);
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

    /// The new 8-bit block scales of [`Op::AdamWBlockMax`]: per piece of a block
    /// ([`ParamSlice::block_pieces`]), the maxima of |m| and |v| an update would give, into
    /// `out` (`[2, blocks]`: m's then v's; 0 for the blocks this rank holds none of).
    fn adamw_block_max<T: Elem>(
        &self,
        e: &OpEntry,
        tensors: &[ParamSlice],
        moments: &OptimBufs,
        out: &BlockScales,
        step: &AdamWStep,
    ) {
        let bound = e
            .params
            .expect("internal error: AdamWBlockMax has its parameters bound");
        let master = self.view::<f32>(bound.buf);
        let (m, m_absmax, v, v_absmax) = self.int8_moments(moments);
        let (m, m_absmax, v, v_absmax) = (&*m, &*m_absmax, &*v, &*v_absmax);
        let scales = self.view::<f32>(out.buf); // [2, blocks]
        scales.fill(0.0);
        let (m_out, v_out) = scales.split_at_mut(out.blocks.len());
        // Each block comes once, in increasing order (pieces of a slice, then the next
        // slice's), so each piece is handed its two outputs.
        let (mut m_out, mut v_out) = (Slots::new(m_out), Slots::new(v_out));
        for t in tensors {
            let r = t.range.clone();
            let local = r.start - moments.base..r.end - moments.base;
            let p = tensor_step(step, t);
            let (params, g) = (&master[bound.local(&r)], &*self.grad::<T>(e, &r));
            let (mq, vq) = (&m[local.clone()], &v[local]);
            let pieces = t.block_pieces().map(|(b, r)| {
                let k = b - out.blocks.start;
                (b, r, m_out.take(k), v_out.take(k))
            });
            pieces.par_bridge().for_each(|(b, r, m_max, v_max)| {
                let k = b - moments.block_base;
                (*m_max, *v_max) = quant::adamw_piece_max(
                    &params[r.clone()],
                    &g[r.clone()],
                    &mq[r.clone()],
                    m_absmax[k],
                    &vq[r],
                    v_absmax[k],
                    &p,
                );
            });
        }
    }

    /// [`Op::AdamW`] of 8-bit moments at block scales the ranks agreed on (`scales`, from
    /// [`Op::AdamWBlockMax`] reduced by maximum): each piece of a block decoded at the
    /// block's scales and encoded at the agreed ones, which then become the state's for
    /// every block it holds (those of other ranks' elements too, so each rank keeps the
    /// scales one process would).
    fn adamw_at_scales<T: Elem>(
        &self,
        e: &OpEntry,
        tensors: &[ParamSlice],
        moments: &OptimBufs,
        scales: &BlockScales,
        step: &AdamWStep,
    ) {
        let bound = e
            .params
            .expect("internal error: AdamW has its parameters bound");
        let master = self.view::<f32>(bound.buf);
        let (m, m_absmax, v, v_absmax) = self.int8_moments(moments);
        let agreed = &*self.view::<f32>(scales.buf); // [2, blocks]
        let nb = scales.blocks.len();
        for t in tensors {
            let r = t.range.clone();
            let local = r.start - moments.base..r.end - moments.base;
            let p = tensor_step(step, t);
            let (mut params, mut g) = (&mut master[bound.local(&r)], &*self.grad::<T>(e, &r));
            let (mut mq, mut vq) = (&mut m[local.clone()], &mut v[local]);
            let (old_m, old_v) = (&*m_absmax, &*v_absmax);
            // The pieces cover the slice in order: each takes the next elements.
            let pieces = t.block_pieces().map(move |(b, r)| {
                let n = r.len();
                let (p_, p_rest) = std::mem::take(&mut params).split_at_mut(n);
                let (g_, g_rest) = g.split_at(n);
                let (mq_, mq_rest) = std::mem::take(&mut mq).split_at_mut(n);
                let (vq_, vq_rest) = std::mem::take(&mut vq).split_at_mut(n);
                (params, g, mq, vq) = (p_rest, g_rest, mq_rest, vq_rest);
                (b, p_, g_, mq_, vq_)
            });
            pieces.par_bridge().for_each(|(b, params, g, mq, vq)| {
                let (k, a) = (b - moments.block_base, b - scales.blocks.start);
                let (old, new) = ((old_m[k], old_v[k]), (agreed[a], agreed[nb + a]));
                quant::adamw_piece_at(params, g, mq, vq, old, new, &p);
            });
        }
        // The state's blocks of the agreed range (a ZeRO shard's, or all of them).
        let held = moments.block_base..moments.block_base + m_absmax.len();
        let (lo, hi) = (
            held.start.max(scales.blocks.start),
            held.end.min(scales.blocks.end),
        );
        if lo < hi {
            let state = lo - held.start..hi - held.start;
            let a = lo - scales.blocks.start..hi - scales.blocks.start;
            m_absmax[state.clone()].copy_from_slice(&agreed[a.clone()]);
            v_absmax[state].copy_from_slice(&agreed[nb + a.start..nb + a.end]);
        }
    }

    /// 8-bit moments' codes and scales: m, m's scales, v, v's scales.
    #[allow(clippy::type_complexity)]
    fn int8_moments(&self, moments: &OptimBufs) -> (&mut [i8], &mut [f32], &mut [u8], &mut [f32]) {
        match self.moments_view(moments) {
            MomentsMut::Int8 {
                m,
                m_absmax,
                v,
                v_absmax,
            } => (m, m_absmax, v, v_absmax),
            _ => unreachable!("internal error: agreed block scales of moments not 8-bit"),
        }
    }
}

/// The step of tensor `t`: weight decay where it applies.
fn tensor_step(step: &AdamWStep, t: &ParamSlice) -> AdamWStep {
    AdamWStep {
        weight_decay: if t.decay { step.weight_decay } else { 0.0 },
        ..*step
    }
}

/// Hands out the elements of a slice one at a time, at increasing indices, each at most
/// once: disjoint `&mut`s that parallel tasks may write.
struct Slots<'a, T> {
    rest: &'a mut [T],
    /// The index of `rest[0]`.
    at: usize,
}

impl<'a, T> Slots<'a, T> {
    fn new(x: &'a mut [T]) -> Slots<'a, T> {
        Slots { rest: x, at: 0 }
    }

    /// Element `i` (above every index taken before).
    fn take(&mut self, i: usize) -> &'a mut T {
        let rest = std::mem::take(&mut self.rest);
        let (x, rest) = rest[i - self.at..]
            .split_first_mut()
            .expect("internal error: a block past the scales' range");
        (self.rest, self.at) = (rest, i + 1);
        x
    }
}
