//! The fill family on the GPU: [`Op::Zero`] (`zero_bytes`, `kernels/fill.cu`).

use super::super::gpu::GpuDevice;
use super::super::launch::{grid_stride, launch_error};
use crate::ir::schedule::{Op, OpEntry};
use anyhow::{Result, bail};
use cudarc::driver::PushKernelArg;

impl GpuDevice {
    /// Runs `e`, an op of the fill family.
    pub(in crate::backend::cuda) fn run_fill(&self, e: &OpEntry) -> Result<()> {
        let Op::Zero { buf } = &e.op else {
            bail!("internal error: {} is not a fill op", e.name);
        };
        let (ptr, bytes) = self.addr(*buf)?;
        let nbytes = bytes as i64;
        let f = self.plain_kernel("zero_bytes")?;
        // SAFETY: `zero_bytes(u8* p, long long nbytes)` over the buffer's bytes (4-byte
        // aligned: plan buffers start at `ALIGN`).
        unsafe {
            self.launch(f)
                .arg(&ptr)
                .arg(&nbytes)
                .launch(grid_stride((bytes / 4).max(1)))
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, "zero_bytes", err))
    }
}
