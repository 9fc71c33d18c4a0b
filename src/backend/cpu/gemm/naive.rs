//! Reference twins of the GEMMs: triple loops with f64 accumulation, one rounding per output
//! element. They sit in a file of their own, below the three GEMMs, because the tests of each
//! check against them across files: [`sgemm`] is the twin of the f32 GEMM, [`gemm_mixed`] the
//! twin of the mixed-precision GEMM and (on bf16 operands, f32 output) of the bf16
//! dot-product GEMM.

use crate::dtype::Elem;

/// Same contract as the fast [`sgemm`](super::f32::sgemm).
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32], // stored [m, k] (or [k, m] if trans_a), row stride lda
    lda: usize,
    trans_a: bool,
    b: &[f32], // stored [k, n] (or [n, k] if trans_b), row stride ldb
    ldb: usize,
    trans_b: bool,
    c: &mut [f32], // [m, n], row stride ldc
    ldc: usize,
    accumulate: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let av = if trans_a {
                    a[p * lda + i]
                } else {
                    a[i * lda + p]
                };
                let bv = if trans_b {
                    b[j * ldb + p]
                } else {
                    b[p * ldb + j]
                };
                s += av as f64 * bv as f64;
            }
            let prev = if accumulate {
                c[i * ldc + j] as f64
            } else {
                0.0
            };
            c[i * ldc + j] = (prev + alpha as f64 * s) as f32;
        }
    }
}

/// Same contract as the fast [`gemm_mixed`](super::mixed::gemm_mixed) (no workspace).
#[allow(clippy::too_many_arguments)]
pub fn gemm_mixed<A: Elem, B: Elem, C: Elem>(
    m: usize,
    n: usize,
    k: usize,
    a: &[A], // stored [m, k] (or [k, m] if a_trans), row stride lda
    lda: usize,
    a_trans: bool,
    b: &[B], // stored [k, n] (or [n, k] if b_trans), row stride ldb
    ldb: usize,
    b_trans: bool,
    c: &mut [C], // [m, n], row stride ldc
    ldc: usize,
    accumulate: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let mut s = if accumulate {
                c[i * ldc + j].to_f32() as f64
            } else {
                0.0
            };
            for p in 0..k {
                let av = if a_trans {
                    a[p * lda + i]
                } else {
                    a[i * lda + p]
                };
                let bv = if b_trans {
                    b[j * ldb + p]
                } else {
                    b[p * ldb + j]
                };
                s += av.to_f32() as f64 * bv.to_f32() as f64;
            }
            c[i * ldc + j] = C::from_f32(s as f32);
        }
    }
}
