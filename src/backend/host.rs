//! The host's math: what code that is not a plan op computes on the CPU whatever device runs
//! the plans (sampling's softmax over downloaded logits, merging a LoRA adapter into its base
//! weights). Backend-neutral modules call these, never `backend::cpu`; each runs the CPU
//! backend's kernel (whose naive twin tests it), so a result is the same on every backend.

use super::cpu;

/// Softmax of one row of logits with temperature into `probs` (for sampling). `temperature`
/// > 0.
pub fn softmax_row(
    probs: &mut [f32], // [V]
    logits: &[f32],    // [V]
    temperature: f32,
) {
    cpu::xent::softmax_row(probs, logits, temperature)
}

/// `c[m, n] += alpha · op(a)[m, k] @ op(b)[k, n]` in f32, where `op` transposes when its flag
/// is set: `a` is stored `[m, k]` (or `[k, m]` if `trans_a`) with row stride `lda`, `b`
/// `[k, n]` (or `[n, k]` if `trans_b`) with row stride `ldb`, `c` `[m, n]` with row stride
/// `ldc`.
#[allow(clippy::too_many_arguments)]
pub fn sgemm_acc(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, lda, trans_a): (&[f32], usize, bool),
    (b, ldb, trans_b): (&[f32], usize, bool),
    c: &mut [f32],
    ldc: usize,
) {
    cpu::gemm::f32::sgemm(
        m, n, k, alpha, a, lda, trans_a, b, ldb, trans_b, c, ldc, true,
    )
}
