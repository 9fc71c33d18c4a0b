//! The attention family ([`OpFamily::Attention`]) on the CPU: causal attention forward and
//! backward (packed rows, sliding windows), and the rotary position embedding ([`Op::Rope`],
//! in place, either direction).

use super::{Args, not_of};
use crate::backend::StepCtx;
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::{attention, rope};
use crate::dtype::Elem;
use crate::ir::OpFamily;
use crate::ir::schedule::{Op, OpEntry};

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::Attention`], with activations stored as `T`.
    pub(super) fn run_attention<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        let args = Args::<T>::new(self, e);
        match &e.op {
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
                window,
                scale_dim,
            } => {
                let (r, nh, nkv, hd) = (rows.with_seq(ctx.seq), *nh, *nkv, *hd);
                let n = r.n();
                attention::attention_forward(
                    &mut self.view::<T>(*out)[..n * nh * hd],
                    &mut self.view::<f32>(*lse)[..r.b * nh * r.t],
                    &args.act(*qkv)[..n * (nh + 2 * nkv) * hd],
                    r.b,
                    r.t,
                    nh,
                    nkv,
                    hd,
                    *scale_dim,
                    args.positions(pos, r),
                    *window,
                    self.view::<f32>(*ws),
                )
            }
            Op::Rope {
                x,
                positions: pos,
                rows,
                width,
                rotated,
                hd,
                inv_freq,
                scale,
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
                    *scale,
                    0,
                    args.positions(pos, r),
                )
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
                window,
                scale_dim,
            } => {
                let (r, nh, nkv, hd) = (rows.with_seq(ctx.seq), *nh, *nkv, *hd);
                let n = r.n();
                let (a, qkv_w) = (nh * hd, (nh + 2 * nkv) * hd);
                attention::attention_backward(
                    &mut self.view::<T>(*dqkv)[..n * qkv_w],
                    &args.act(*dout)[..n * a],
                    &args.act(*qkv)[..n * qkv_w],
                    &args.act(*out)[..n * a],
                    &self.view::<f32>(*lse)[..r.b * nh * r.t],
                    r.b,
                    r.t,
                    nh,
                    nkv,
                    hd,
                    *scale_dim,
                    args.positions(pos, r),
                    *window,
                    self.view::<f32>(*ws),
                )
            }
            _ => not_of(OpFamily::Attention, e),
        }
    }
}
