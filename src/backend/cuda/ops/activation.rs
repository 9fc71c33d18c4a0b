//! The activation family on the GPU (`kernels/activation.cu`): GELU and SwiGLU, forward and
//! backward, elementwise, as the CPU's `ops/activation.rs`; each op one grid-stride launch
//! (GELU 16 bytes a thread, [`grid_packs`]; SwiGLU one value, [`grid_stride`]):
//!
//! - [`Op::Gelu`]: `gelu_forward_<S>(out, inp, N·width)`.
//! - [`Op::GeluBackward`]: `gelu_backward_<S>(d, inp, N·width)` (d in place).
//! - [`Op::Glu`] (SwiGLU): `swiglu_forward_<S>(out, inp, N, H)`, over the N·H outputs.
//! - [`Op::GluBackward`] (SwiGLU): `swiglu_backward_<S>(dinp, dout, inp, N, H)` (dinp written).
//!
//! N is the op's rows at the step's sequence length (`rows.with_seq(ctx.seq)`); nothing runs
//! on no elements.

use super::super::gpu::GpuDevice;
use super::super::launch::{grid_packs, grid_stride};
use super::super::launch::{int, launch_kernel};
use crate::backend::StepCtx;
use crate::ir::schedule::{Op, OpEntry};
use anyhow::{Result, bail};

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
                inp, out, rows, h, ..
            } => {
                let (n, h) = (rows.with_seq(ctx.seq).n(), *h);
                if n == 0 || h == 0 {
                    return Ok(());
                }
                let (name, f) = self.entry("swiglu_forward")?;
                let (out, inp) = (self.ptr(*out)?, self.ptr(*inp)?);
                let (ni, hi) = (int(e, "N", n)?, int(e, "H", h)?);
                // SAFETY: swiglu_forward_<S>(T* out, const T* inp, int N, int H): out [N, H]
                // T, inp [N, 2H] T (gate | up).
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    grid_stride((n * h) as u64),
                    [&out, &inp, &ni, &hi]
                )
            }
            Op::GluBackward {
                dinp,
                dout,
                inp,
                rows,
                h,
                ..
            } => {
                let (n, h) = (rows.with_seq(ctx.seq).n(), *h);
                if n == 0 || h == 0 {
                    return Ok(());
                }
                let (name, f) = self.entry("swiglu_backward")?;
                let (dinp, dout, inp) = (self.ptr(*dinp)?, self.ptr(*dout)?, self.ptr(*inp)?);
                let (ni, hi) = (int(e, "N", n)?, int(e, "H", h)?);
                // SAFETY: swiglu_backward_<S>(T* dinp, const T* dout, const T* inp, int N, int
                // H): dinp [N, 2H] T (written), dout [N, H] T, inp [N, 2H] T.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    grid_stride((n * h) as u64),
                    [&dinp, &dout, &inp, &ni, &hi]
                )
            }
            _ => bail!("internal error: {} is not an activation op", e.name),
        }
    }
}
