//! What every family's host code launches with: a kernel by name and storage type
//! ([`GpuDevice::kernel`]), the device address of a buffer, of a parameter range or of its
//! gradient ([`GpuDevice::ptr`], [`GpuDevice::param_ptr`], [`GpuDevice::grad_ptr`]), the
//! regions of the backend's scratch ([`GpuDevice::scratch`]), and launch shapes
//! ([`grid_stride`], [`rows_of_warps`]), the launch macro `launch_kernel!` and the range check
//! of `int` arguments ([`int`]). Kernel arguments are plain values: device addresses
//! as `u64`, sizes as `i32` or `i64` as each kernel's doc says, floats as `f32`.

use super::gpu::GpuDevice;
use super::sizing::Scratch;
use crate::dtype::DType;
use crate::ir::BufId;
use crate::ir::schedule::OpEntry;
use anyhow::{Result, anyhow, bail};
use cudarc::driver::{CudaFunction, LaunchArgs, LaunchConfig};
use std::ops::Range;

/// Threads of the grid-stride kernels' blocks.
pub const BLOCK: u32 = 256;
/// The most blocks a grid-stride launch uses (the kernels loop over the rest).
pub const MAX_GRID: u64 = 65535;

/// A grid-stride launch over `work` items: blocks of [`BLOCK`] threads, as many as the work
/// needs up to [`MAX_GRID`] (at least one).
pub fn grid_stride(work: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (work.div_ceil(BLOCK as u64).clamp(1, MAX_GRID) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Values of the storage type a thread of the 16-byte kernels takes at once (8 bf16/f16
/// values; an f32 kernel's 4 take a quarter of its items, so its grid is a little smaller
/// than its work wants, and the kernel strides).
pub const PACK: u64 = 8;

/// A grid-stride launch of a kernel that takes [`PACK`] of its `work` items per thread
/// (`MwPack`, kernels/common.cuh).
pub fn grid_packs(work: u64) -> LaunchConfig {
    grid_stride(work.div_ceil(PACK))
}

/// One warp per row over `rows` rows, `warps` warps a block.
pub fn rows_of_warps(rows: u64, warps: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(warps as u64).max(1) as u32, 1, 1),
        block_dim: (32 * warps, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The suffix of the entries instantiated for storage type `storage`.
pub fn suffix(storage: DType) -> &'static str {
    match storage {
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// Device addresses of the scratch regions ([`Scratch`]), 0 where a region is empty.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScratchPtrs {
    pub cublaslt: (u64, u64),
    pub weight_tile: (u64, u64),
    pub partials: (u64, u64),
    pub norm_partials: (u64, u64),
    pub attention_rows: (u64, u64),
}

impl GpuDevice {
    /// Entry `stem_<storage>` of the plan's storage type.
    pub(super) fn kernel(&self, stem: &str) -> Result<&CudaFunction> {
        self.plain_kernel(&format!("{stem}_{}", suffix(self.storage)))
    }

    /// Entry `name` (no storage suffix added).
    pub(super) fn plain_kernel(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| anyhow!("internal error: no CUDA kernel {name} was loaded"))
    }

    /// Starts a launch of `f` on the device's stream.
    pub(super) fn launch<'a>(&'a self, f: &'a CudaFunction) -> LaunchArgs<'a> {
        self.stream.launch_builder(f)
    }

    /// Device address of buffer `id`.
    pub(super) fn ptr(&self, id: BufId) -> Result<u64> {
        self.addr(id).map(|(p, _)| p)
    }

    /// Device address of `id`, or 0 (a kernel's NULL) for none.
    pub(super) fn ptr_or_null(&self, id: Option<BufId>) -> Result<u64> {
        id.map_or(Ok(0), |id| self.ptr(id))
    }

    /// Device address of the first element of parameter range `r` of `e`'s parameter
    /// binding (f32 master weights; a quantized base's blocks: the byte of the block holding
    /// `r.start`).
    pub(super) fn param_ptr(&self, e: &OpEntry, r: &Range<usize>) -> Result<u64> {
        let b = e
            .params
            .ok_or_else(|| anyhow!("internal error: {} has no parameter binding", e.name))?;
        let local = b.local(r).start as u64;
        let dtype = self.dtypes[b.buf.0];
        let offset = dtype
            .bytes_for(local)
            .ok_or_else(|| anyhow!("internal error: {}: a range starts inside a block", e.name))?;
        Ok(self.ptr(b.buf)? + offset)
    }

    /// The dtype of the buffer `e`'s parameters are bound to (f32, or ggml blocks).
    pub(super) fn param_dtype(&self, e: &OpEntry) -> Option<DType> {
        e.params.map(|b| self.dtypes[b.buf.0])
    }

    /// Device address of the gradient of parameter range `r` (stored as the plan's storage
    /// type) in `e`'s gradient binding.
    pub(super) fn grad_ptr(&self, e: &OpEntry, r: &Range<usize>) -> Result<u64> {
        let b = e
            .grads
            .ok_or_else(|| anyhow!("internal error: {} has no gradient binding", e.name))?;
        let local = b.local(r).start as u64;
        let size = self.dtypes[b.buf.0].size().unwrap_or(4) as u64;
        Ok(self.ptr(b.buf)? + local * size)
    }

    /// The scratch regions' addresses and sizes.
    pub(super) fn scratch(&self) -> ScratchPtrs {
        let Some((base, _)) = self.scratch else {
            return ScratchPtrs::default();
        };
        let s: Scratch = self.scratch_layout;
        let (o, _) = s.offsets();
        let at = |i: usize, bytes: u64| (if bytes > 0 { base + o[i] } else { 0 }, bytes);
        ScratchPtrs {
            cublaslt: at(0, s.cublaslt),
            weight_tile: at(1, s.weight_tile),
            partials: at(2, s.partials),
            norm_partials: at(3, s.norm_partials),
            attention_rows: at(4, s.attention_rows),
        }
    }
}

/// Launches kernel `$f` (named `$name` in errors) of op `$e` on `$dev`'s stream with launch
/// shape `$cfg` and the arguments `$arg` (references to locals: `u64` device addresses,
/// `i32`, `i64`, `f32`), in the kernel's order; a `Result<()>`, the error naming the op and
/// the kernel. The caller vouches (a `SAFETY` comment at the call) that the arguments are the
/// kernel's signature and the addresses hold what the kernel reads and writes.
macro_rules! launch_kernel {
    ($dev:expr, $e:expr, $name:expr, $f:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        use cudarc::driver::PushKernelArg;
        let mut args = $dev.launch($f);
        $(args.arg($arg);)*
        // SAFETY: the caller's: the arguments match the kernel's signature and every address
        // holds the elements the kernel's doc comment says it touches.
        unsafe { args.launch($cfg) }
            .map(|_| ())
            .map_err(|err| $crate::backend::cuda::launch::launch_error($e, &$name, err))
    }};
}
pub(super) use launch_kernel;

impl GpuDevice {
    /// Entry `stem_<storage>` and its full name (for errors).
    pub(super) fn entry(&self, stem: &str) -> Result<(String, &CudaFunction)> {
        let f = self.kernel(stem)?;
        Ok((format!("{stem}_{}", suffix(self.storage)), f))
    }

    /// Device address of parameter range `r`'s f32 values (an internal error where `e` is
    /// bound to anything but f32: a quantized base's blocks).
    pub(super) fn f32_param_ptr(&self, e: &OpEntry, r: &Range<usize>) -> Result<u64> {
        match self.param_dtype(e) {
            Some(DType::F32) => self.param_ptr(e, r),
            Some(d) => bail!(
                "internal error: {}: its parameters are bound to {d} values, not f32",
                e.name
            ),
            None => bail!("internal error: {} has no parameter binding", e.name),
        }
    }
}

/// `v` as a kernel's `int` argument `what`; an error naming the op where it does not fit.
pub(super) fn int(e: &OpEntry, what: &str, v: usize) -> Result<i32> {
    match i32::try_from(v) {
        Ok(i) => Ok(i),
        Err(_) => bail!(
            "{}: {what} = {v} is beyond the CUDA kernels' int arguments (2^31 - 1)",
            e.name
        ),
    }
}

/// The error of a failed launch, naming the op and the kernel.
pub fn launch_error(e: &OpEntry, kernel: &str, err: impl std::fmt::Debug) -> anyhow::Error {
    anyhow!("{}: the GPU refused CUDA kernel {kernel}: {err:?}", e.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_stride_launches_cover_the_work_within_the_grid_limit() {
        assert_eq!(grid_stride(0).grid_dim.0, 1);
        assert_eq!(grid_stride(256).grid_dim.0, 1);
        assert_eq!(grid_stride(257).grid_dim.0, 2);
        assert_eq!(grid_stride(1 << 40).grid_dim.0, MAX_GRID as u32);
        assert_eq!(rows_of_warps(10, 4).grid_dim.0, 3);
        assert_eq!(rows_of_warps(10, 4).block_dim.0, 128);
    }
}
