//! The embedding family ([`OpFamily::Embedding`]) on the CPU: the token (and learned
//! position) embedding's gather ([`Op::Encoder`], rows of a quantized table decoded as they
//! are gathered) and its scatter into the tables' gradients ([`Op::EncoderBackward`]).

use super::{Args, not_of};
use crate::backend::StepCtx;
use crate::backend::cpu::device::CpuDevice;
use crate::backend::cpu::encoder;
use crate::dtype::Elem;
use crate::ir::OpFamily;
use crate::ir::schedule::{Op, OpEntry};

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::Embedding`], with activations stored as `T`.
    pub(super) fn run_embedding<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        let args = Args::<T>::new(self, e);
        match &e.op {
            Op::Encoder {
                tokens,
                positions: pos,
                out,
                wte,
                wpe,
                first_token,
                rows,
                c,
                scale,
            } => {
                let (r, c) = (rows.with_seq(ctx.seq), *c);
                let n = r.n();
                let held = wte.len() / c;
                if let Some(table) = self.quant_weight(e, wte, (held, c)) {
                    // Rows of a quantized table, decoded as they are gathered.
                    assert!(wpe.is_none(), "internal error: a quantized base with wpe");
                    let out = &mut self.view::<T>(*out)[..n * c];
                    let row = &mut args.quant_ws()[..c];
                    for (o, &tok) in out.chunks_exact_mut(c).zip(&self.u32_mut(*tokens)[..n]) {
                        let k = (tok as usize).wrapping_sub(*first_token);
                        if k >= held {
                            o.fill(T::from_f32(0.0)); // another rank's token
                            continue;
                        }
                        table.decode_row(k, row);
                        for (o, &x) in o.iter_mut().zip(row.iter()) {
                            *o = T::from_f32(x * scale);
                        }
                    }
                    return;
                }
                encoder::encoder_forward(
                    &mut self.view::<T>(*out)[..n * c],
                    &self.u32_mut(*tokens)[..n],
                    args.weights(wte),
                    wpe.as_ref().map(|r| args.weights(r)),
                    args.positions(pos, r),
                    *first_token,
                    *scale,
                    r.b,
                    r.t,
                    c,
                );
            }
            Op::EncoderBackward {
                dout,
                tokens,
                positions: pos,
                wte,
                wpe,
                first_token,
                rows,
                c,
                scale,
            } => {
                let (r, c) = (rows.with_seq(ctx.seq), *c);
                let n = r.n();
                let (dwte, dwpe) = match wpe {
                    Some(wpe) => {
                        let (dwte, dwpe) = args.grad2(wte, wpe);
                        (dwte, Some(dwpe))
                    }
                    None => (args.grad(wte), None),
                };
                encoder::encoder_backward(
                    dwte,
                    dwpe,
                    &args.act(*dout)[..n * c],
                    &self.u32_mut(*tokens)[..n],
                    args.positions(pos, r),
                    *first_token,
                    *scale,
                    r.b,
                    r.t,
                    c,
                );
            }
            _ => not_of(OpFamily::Embedding, e),
        }
    }
}
