//! The CUDA backend: the same plans on an NVIDIA GPU (issue #45, cuda). Built with the cargo
//! feature `cuda`; cudarc loads the driver, NVRTC and cuBLASLt when the backend opens, so the
//! feature builds on machines without CUDA.
//!
//! What every build has, with or without the feature (planning is pure):
//! - [`sizing`]: [`CudaSizing`], the planner's answers for a GPU (its one tier, device
//!   memory; the scratch its kernels and cuBLASLt keep; the CUDA context as the baseline),
//!   so `memwall plan --device cuda` works on any machine.
//! - [`kernels`]: the CUDA C sources (`kernels/*.cu`, with the prelude `common.cuh`) and
//!   the entries each declares; compiled by NVRTC when the backend starts, and by CI for
//!   sm_80 and sm_90 (no GPU needed: `tests/cuda_kernels.rs`, `scripts/nvrtc-check.py`).
//!
//! With the feature: `nvrtc` (compiling a source to PTX, cached on disk by a hash of source,
//! architecture and compiler version) and `gpu` (the opened device: [`open`] probes the
//! driver first, so a missing library or GPU is an error, never a panic).
//!
//! Without the feature, [`open`] refuses naming it: a plan for `--device cuda` is made, a
//! step is not run.

mod flag;
pub mod kernels;
pub mod sizing;

#[cfg(feature = "cuda")]
mod gemm;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod rope_tables;
#[cfg(feature = "cuda")]
mod transfer;

pub use flag::flag;
pub use sizing::CudaSizing;

use super::Backend;
use anyhow::Result;

/// Opens CUDA device `index` (`--device cuda:N`): the backend that runs plans on it, opened
/// once per process.
#[cfg(feature = "cuda")]
pub fn open(index: usize) -> Result<&'static dyn Backend> {
    gpu::open(index)
}

/// Refuses: this build has no CUDA backend. Names the feature that has it.
#[cfg(not(feature = "cuda"))]
pub fn open(index: usize) -> Result<&'static dyn Backend> {
    let device = flag(index);
    Err(super::Unavailable(format!(
        "--device {device}: this memwall was built without the CUDA backend; build it with \
         `cargo build --release --features cuda` (a plan needs no GPU: `memwall plan --device \
         cuda` works in this build)"
    ))
    .into())
}
