//! CPU kernels (f32 compute, multi-threaded with rayon; most are generic over the storage
//! type, f32/bf16/f16, see [`elem`]). Each layer is a `_forward`/`_backward` pair side by
//! side; each fast kernel has a naive reference twin (a `naive` submodule in the same file;
//! the GEMMs share [`gemm::naive`]) used by the tests. Shape legend: B batch, T sequence,
//! C channels, NH heads, hs = C/NH head size, N = B·T rows, V vocabulary, IC/OC input/output
//! channels of a linear.
//!
//! Layout, bottom up (a file imports only files listed before it, except `reduce`'s test that
//! runs every kernel at every instruction set):
//! - [`features`]: what the CPU can run, detected once (and the `MEMWALL_CPU_ISA` /
//!   `MEMWALL_BF16_DOT` overrides); the `multiversion!` dispatch every hot loop uses.
//! - [`elem`]: the storage types and the slice casts between them and f32.
//! - [`reduce`]: whole-buffer reductions and the shared building blocks (task sizes, lane
//!   sums, `exp_f32`); its `testutil` holds the helpers every kernel test uses.
//! - [`gemm`]: the GEMMs ([`gemm::f32`], [`gemm::bf16_dot`], [`gemm::mixed`]).
//! - the layers: [`encoder`], [`layernorm`] and [`rmsnorm`], [`matmul`] (the linear layer, on
//!   [`gemm`]), [`attention`], [`rope`] (rotary position embedding, in place on q|k|v),
//!   [`gelu`] and [`glu`] (the gated MLPs' activations: SwiGLU, GeGLU), [`xent`] (and
//!   [`xent_slice`], its gradient for a slice of the vocabulary) and
//!   [`distill`] (the losses on the logits: cross-entropy, distillation), [`lora`] (an adapter
//!   on a frozen linear layer); the optimizers [`adamw`]
//!   and [`quant`] (compressed optimizer state); [`peak`] (the machine's measured FMA
//!   ceiling).
//! - [`device`]: the started backend ([`CpuDevice`]: the arena, the disk tier's transfers,
//!   the collectives of `collective`), and `ops`, its [`Kernels`](crate::backend::Kernels):
//!   the op → kernel mapping, one file per op family ([`crate::ir::OpFamily`]).
//!
//! Tests: each kernel's tests sit in its file; [`reduce`]'s `testutil` and the test-only
//! `conformance` module hold what they share (random data, tolerances, the storage-type check
//! of the generic kernels against their f32 instantiation, the instruction-set invariance
//! check). Tests that need an instruction set this CPU may lack are `#[ignore]`d with it
//! (`needs AVX-512F`, `needs AVX-512F/BW/VL`, `needs AVX512_BF16`; names ending `_avx512` or
//! `_avx512bf16`) and fail, rather than pass without running, under `--ignored` on a CPU
//! without it.
//!
//! Kernels never allocate: workspace comes in as slices, sized by the `*_workspace_len`
//! functions, so the memory plan can account for it. Results are deterministic for a given
//! thread count (fixed work partitioning, reductions in a fixed order).
//!
//! Storage types: the encoder, layer norm, RMS norm, RoPE, GELU, SwiGLU, linear and
//! attention kernels, the optimizer's gradient input and `reduce::sum_squares` are generic
//! over [`Elem`](crate::dtype::Elem) (f32, bf16, f16). They widen to f32 as they read, compute and
//! accumulate in f32, and round once per stored element; the f32 instantiation is bitwise the
//! f32 kernel. Statistics
//! (`mean`, `rstd`, `lse`), workspaces, optimizer moments and master weights stay f32.

pub mod adamw;
pub mod attention;
pub mod caches;
mod collective;
#[cfg(test)]
pub(crate) mod conformance;
pub mod device;
pub mod distill;
pub mod elem;
pub mod encoder;
pub mod features;
pub mod gelu;
pub mod gemm;
pub mod glu;
pub mod layernorm;
pub mod lora;
pub mod matmul;
mod ops;
pub mod peak;
pub mod quant;
pub mod reduce;
pub mod rmsnorm;
pub mod rope;
pub mod xent;
pub mod xent_part;
pub mod xent_slice;

pub use device::{Cpu, CpuDevice};
