//! The GEMMs under the linear layer and the tied LM head, all with one contract:
//! `c[m,n] = (accumulate ? c : 0) + op(a)[m,k] @ op(b)[k,n]` on row-major operands with
//! their own row strides, a transposed operand read through its strides, f32 accumulation,
//! elements of `c` outside the `m × n` window untouched.
//!
//! - [`f32`](mod@f32): the f32 GEMM on the `gemm` crate ([`sgemm`](f32::sgemm)), split
//!   into row blocks so `gemm`'s packing scratch stays bounded
//!   ([`packing_bytes`](f32::packing_bytes)), and the window checks all three GEMMs run first;
//!   where the crate would run its AVX2 kernels, [`avx2`] instead ([`f32::own_avx2_kernel`]).
//! - `avx2` (x86-64): memwall's own AVX2 + FMA GEMM, a 6 × 16 register tile on operands packed
//!   (f32, or bf16 widened as packed) and blocked for this machine's L2.
//! - [`bf16_dot`]: bf16 × bf16 (or f32 rounded to bf16) → f32 on the AVX512_BF16 dot product
//!   `vdpbf16ps`, with an AVX-512F emulation of the instruction as its tested twin.
//! - [`mixed`]: operands and output of any storage type ([`Elem`](crate::dtype::Elem)), tile
//!   by tile: on [`bf16_dot`] where the CPU has it and the operands are bf16, else widened to
//!   f32 for [`f32`](mod@f32); each output element rounded once.
//! - [`naive`]: the reference twins the tests of all three compare with.
//! - [`quantized`]: a frozen layer's forward and input-gradient GEMMs on a weight kept in
//!   ggml blocks (QLoRA's base), decoded a tile of rows at a time for [`f32`](mod@f32).
//!
//! Dependencies run one way: [`super::matmul`] → [`mixed`] → {[`bf16_dot`],
//! [`f32`](mod@f32)}, and [`bf16_dot`] → [`f32`](mod@f32) (the window checks); nothing here
//! imports the linear layer, and this file re-exports nothing.

#[cfg(target_arch = "x86_64")]
pub mod avx2;
pub mod bf16_dot;
pub mod f32;
pub mod mixed;
pub mod naive;
pub mod quantized;
