//! CPU kernels (f32 compute, multi-threaded with rayon; some are generic over the storage
//! type, f32/bf16/f16, see [`elem`] and [`gemm_mixed`]). Each layer is a `_forward`/`_backward`
//! pair side by side; each fast kernel has a naive reference twin (a `naive` submodule in the
//! same file) used by the tests. Shape legend: B batch, T sequence, C channels, NH heads,
//! hs = C/NH head size, N = B·T rows, V vocabulary, IC/OC input/output channels of a linear.
//!
//! Kernels never allocate: workspace comes in as slices, sized by the `*_workspace_len`
//! functions, so the memory plan can account for it. Results are deterministic for a given
//! thread count (fixed work partitioning, reductions in a fixed order).
//!
//! Storage types: the encoder, layer norm, GELU and attention kernels, the optimizer's
//! gradient input and the whole-buffer passes of `reduce` are generic over
//! [`elem::Elem`] (f32, bf16, f16). They widen to f32 as they read, compute and accumulate in
//! f32, and round once per stored element; the f32 instantiation is bitwise the f32 kernel.
//! Statistics (`mean`, `rstd`, `lse`), workspaces, optimizer moments and master weights stay
//! f32.

pub mod adamw;
pub mod attention;
pub mod elem;
pub mod encoder;
pub mod features;
pub mod gelu;
pub mod gemm_bf16;
pub mod gemm_mixed;
pub mod layernorm;
pub mod matmul;
pub mod peak;
pub mod quant;
pub mod reduce;
pub mod xent;
