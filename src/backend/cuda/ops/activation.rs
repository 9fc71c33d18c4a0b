//! The activation family on the GPU (`kernels/activation.cu`): GELU and the gated units
//! (SwiGLU, GeGLU), forward and backward, elementwise, as the CPU's `ops/activation.rs`; each
//! op one grid-stride launch (GELU 16 bytes a thread, [`grid_packs`]; the gated units one
//! value, [`grid_stride`]):
//!
//! - [`Op::Gelu`]: `gelu_forward_<S>(out, inp, N·width)`.
//! - [`Op::GeluBackward`]: `gelu_backward_<S>(d, inp, N·width)` (d in place).
//! - [`Op::Glu`]: `glu_forward_<S>(out, inp, N, H, act)`, over the N·H outputs.
//! - [`Op::GluBackward`]: `glu_backward_<S>(dinp, dout, inp, N, H, act)` (dinp written).
//!
//! `act` is the kernels' code of the op's [`GluAct`] ([`glu_act`]: `MW_GLU_SILU` 0 for
//! SwiGLU, `MW_GLU_GELU_TANH` 1 for GeGLU).
//!
//! N is the op's rows at the step's sequence length (`rows.with_seq(ctx.seq)`); nothing runs
//! on no elements.

use super::super::gpu::GpuDevice;
use super::super::launch::{grid_packs, grid_stride};
use super::super::launch::{int, launch_kernel};
use crate::backend::StepCtx;
use crate::ir::schedule::{GluAct, Op, OpEntry};
use anyhow::{Result, bail};

/// The kernels' `act` argument for a gated unit's activation (`MW_GLU_*` in
/// `kernels/activation.cu`).
fn glu_act(act: GluAct) -> i32 {
    match act {
        GluAct::Silu => 0,
        GluAct::GeluTanh => 1,
    }
}

impl GpuDevice {
    /// Runs `e`, an op of the activation family.
    pub(in crate::backend::cuda) fn run_activation(
        &self,
        e: &OpEntry,
        ctx: &StepCtx,
    ) -> Result<()> {
        match &e.op {
            Op::Gelu {
                inp,
                out,
                rows,
                width,
            } => {
                let len = rows.with_seq(ctx.seq).n() * width;
                if len == 0 {
                    return Ok(());
                }
                let (name, f) = self.entry("gelu_forward")?;
                let (out, inp, len) = (self.ptr(*out)?, self.ptr(*inp)?, len as i64);
                // SAFETY: gelu_forward_<S>(T* out, const T* inp, long long len): out, inp
                // [N·width] T.
                launch_kernel!(self, e, name, f, grid_packs(len as u64), [&out, &inp, &len])
            }
            Op::GeluBackward {
                d,
                inp,
                rows,
                width,
            } => {
                let len = rows.with_seq(ctx.seq).n() * width;
                if len == 0 {
                    return Ok(());
                }
                let (name, f) = self.entry("gelu_backward")?;
                let (d, inp, len) = (self.ptr(*d)?, self.ptr(*inp)?, len as i64);
                // SAFETY: gelu_backward_<S>(T* d, const T* inp, long long len): d (in place),
                // inp [N·width] T.
                launch_kernel!(self, e, name, f, grid_packs(len as u64), [&d, &inp, &len])
            }
            Op::Glu {
                inp,
                out,
                rows,
                h,
                act,
            } => {
                let (n, h) = (rows.with_seq(ctx.seq).n(), *h);
                if n == 0 || h == 0 {
                    return Ok(());
                }
                let (name, f) = self.entry("glu_forward")?;
                let (out, inp) = (self.ptr(*out)?, self.ptr(*inp)?);
                let (ni, hi, act) = (int(e, "N", n)?, int(e, "H", h)?, glu_act(*act));
                // SAFETY: glu_forward_<S>(T* out, const T* inp, int N, int H, int act): out
                // [N, H] T, inp [N, 2H] T (gate | up), act a MW_GLU_* code.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    grid_stride((n * h) as u64),
                    [&out, &inp, &ni, &hi, &act]
                )
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
                if n == 0 || h == 0 {
                    return Ok(());
                }
                let (name, f) = self.entry("glu_backward")?;
                let (dinp, dout, inp) = (self.ptr(*dinp)?, self.ptr(*dout)?, self.ptr(*inp)?);
                let (ni, hi, act) = (int(e, "N", n)?, int(e, "H", h)?, glu_act(*act));
                // SAFETY: glu_backward_<S>(T* dinp, const T* dout, const T* inp, int N, int H,
                // int act): dinp [N, 2H] T (written), dout [N, H] T, inp [N, 2H] T, act a
                // MW_GLU_* code.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    grid_stride((n * h) as u64),
                    [&dinp, &dout, &inp, &ni, &hi, &act]
                )
            }
            _ => bail!("internal error: {} is not an activation op", e.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::SOURCES;

    /// The codes passed as `act` are the kernels' `MW_GLU_*`.
    #[test]
    fn glu_act_codes_are_the_kernels() {
        let src = SOURCES.iter().find(|s| s.name == "activation.cu").unwrap();
        for (act, name) in [
            (GluAct::Silu, "MW_GLU_SILU"),
            (GluAct::GeluTanh, "MW_GLU_GELU_TANH"),
        ] {
            let line = format!("#define {name} {}\n", glu_act(act));
            assert!(src.text.contains(&line), "activation.cu lacks {line:?}");
        }
    }
}
