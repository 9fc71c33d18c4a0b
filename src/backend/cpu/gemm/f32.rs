//! Single-precision GEMM ([`sgemm`]): on the `gemm` crate, or on memwall's own AVX2 kernel
//! ([`super::avx2`]) where the crate would run its AVX2 one ([`own_avx2_kernel`]: CPUs without
//! AVX-512, builds without `avx512-gemm`); and the operand layout the three
//! GEMMs of this module share: `c[m,n] = (accumulate ? c : 0) + op(a)[m,k] @ op(b)[k,n]` on
//! row-major matrices, each with its own row stride (`lda`, `ldb`, `ldc`), a transposed
//! operand read through its strides, elements of `c` outside the window untouched. The other
//! two GEMMs ([`super::bf16_dot`], [`super::mixed`]) check their windows and settle the
//! degenerate shapes with the functions here.
//!
//! Transposed operands are passed to `gemm` as strides, never copied. `gemm` splits the output
//! into tiles across threads and walks the reduction dimension sequentially inside a tile,
//! so results are deterministic for a given thread count. Note that `gemm` allocates its own
//! packing buffers internally; [`sgemm`] splits calls into row blocks of [`GEMM_M_BLOCK`] so
//! they stay below [`GEMM_PACK_BYTES`] (the plan counts them with [`packing_bytes`]); nothing
//! else here allocates. The own kernel keeps per-thread packing buffers
//! ([`own_pack_bytes_per_thread`], also counted by the plan).

#[cfg(target_arch = "x86_64")]
use super::avx2::{
    Dst,
    pack::{Packable, Strided},
};
use ::gemm::{Parallelism, gemm};

/// Below this many multiply-adds a GEMM runs single-threaded.
const PAR_MIN_MACS: usize = 64 * 64 * 64;

fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    let threads = rayon::current_num_threads();
    if threads <= 1 || m.saturating_mul(n).saturating_mul(k) < PAR_MIN_MACS {
        Parallelism::None
    } else {
        Parallelism::Rayon(threads)
    }
}

/// Elements a row-major `rows × cols` matrix with row stride `ld` spans.
pub(super) fn span(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

/// Panics (naming `who`) unless the strides and lengths cover the windows of a GEMM
/// `c[m,n] = op(a)[m,k] @ op(b)[k,n]` laid out as [`sgemm`] describes. The GEMMs read their
/// operands through raw pointers on the strength of this check: it runs in release builds.
#[allow(clippy::too_many_arguments)]
pub(in crate::backend::cpu) fn check_windows(
    who: &str,
    (m, n, k): (usize, usize, usize),
    (a_len, lda, a_trans): (usize, usize, bool),
    (b_len, ldb, b_trans): (usize, usize, bool),
    (c_len, ldc): (usize, usize),
) {
    let (a_rows, a_cols) = if a_trans { (k, m) } else { (m, k) };
    let (b_rows, b_cols) = if b_trans { (n, k) } else { (k, n) };
    assert!(lda >= a_cols, "{who}: lda {lda} < {a_cols}");
    assert!(ldb >= b_cols, "{who}: ldb {ldb} < {b_cols}");
    assert!(ldc >= n, "{who}: ldc {ldc} < {n}");
    assert!(a_len >= span(a_rows, a_cols, lda), "{who}: a too short");
    assert!(b_len >= span(b_rows, b_cols, ldb), "{who}: b too short");
    assert!(c_len >= span(m, n, ldc), "{who}: c too short");
}

/// The common entry of the f32-output GEMMs: [`check_windows`], then the degenerate
/// products settled here. Returns false when nothing is left to compute: `m` or `n` is 0, or
/// `k` is 0 (the window of `c` zeroed unless accumulating).
pub(super) fn checked_work(
    who: &str,
    (m, n, k): (usize, usize, usize),
    a: (usize, usize, bool), // (len, lda, trans)
    b: (usize, usize, bool), // (len, ldb, trans)
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> bool {
    check_windows(who, (m, n, k), a, b, (c.len(), ldc));
    if m == 0 || n == 0 {
        return false;
    }
    if k == 0 {
        if !accumulate {
            for row in c.chunks_mut(ldc).take(m) {
                row[..n].fill(0.0);
            }
        }
        return false;
    }
    true
}

/// General strided single-precision GEMM used by the executor for the tied LM head:
/// `c[m,n] = (accumulate ? c : 0) + alpha * op(a)[m,k] @ op(b)[k,n], where op transposes when`
/// the flag is set; a, b, c are row-major with the given leading dimensions (lda etc. = row
/// stride in elements of the stored matrix: a is stored `[m, k]`, or `[k, m]` when `trans_a`).
/// Elements of `c` outside the `m × n` window (row padding when `ldc > n`) are untouched.
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
    if !checked_work(
        "sgemm",
        (m, n, k),
        (a.len(), lda, trans_a),
        (b.len(), ldb, trans_b),
        c,
        ldc,
        accumulate,
    ) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if m >= OWN_MIN_ROWS && own_avx2_kernel() {
        // SAFETY: `checked_work` proved the windows in bounds and k > 0.
        unsafe {
            own_sgemm(
                (m, n, k),
                alpha,
                (a, lda, trans_a),
                (b, ldb, trans_b),
                c,
                ldc,
                accumulate,
                None,
            )
        };
        return;
    }
    let (a_rs, a_cs) = if trans_a {
        (1, lda as isize)
    } else {
        (lda as isize, 1)
    };
    let (b_rs, b_cs) = if trans_b {
        (1, ldb as isize)
    } else {
        (ldb as isize, 1)
    };
    // Row blocks of at most GEMM_M_BLOCK rows of c bound gemm's packing scratch (it packs a
    // panel of kc × rows of op(a) after transposing our row-major problem).
    let mut i0 = 0;
    while i0 < m {
        let rows = GEMM_M_BLOCK.min(m - i0);
        // Offset of row i0 of op(a): a row of the stored matrix, or a column when transposed.
        let a_off = if trans_a { i0 } else { i0 * lda };
        // SAFETY: `checked_work`'s asserts prove every (row, col) index gemm touches lies inside `a`,
        // `b` and `c` (a block is a sub-window of the checked window); `c` is a unique borrow,
        // so it aliases neither input; ldc >= n keeps distinct output elements distinct, so the
        // parallel tiles never overlap.
        unsafe {
            gemm(
                rows,
                n,
                k,
                c.as_mut_ptr().add(i0 * ldc),
                1,
                ldc as isize,
                accumulate,
                a.as_ptr().add(a_off),
                a_cs,
                a_rs,
                b.as_ptr(),
                b_cs,
                b_rs,
                1.0,
                alpha,
                false,
                false,
                false,
                parallelism(rows, n, k),
            );
        }
        i0 += rows;
    }
}

/// Fewer rows than this (a generation step's single row) go to the `gemm` crate even where
/// the own kernel runs: packing all of `op(b)` for one row of 6 would cost more than the
/// product.
pub(in crate::backend::cpu) const OWN_MIN_ROWS: usize = 4;

/// Whether [`sgemm`] runs memwall's own AVX2 kernel ([`super::avx2`]): where the `gemm`
/// crate would run its AVX2 kernels ([`gemm_isa`](crate::backend::cpu::features::gemm_isa)
/// is AVX2: a CPU without AVX-512, or a build without the `avx512-gemm` feature), unless
/// `MEMWALL_SGEMM=crate` asks for the crate's (to compare the two in one build). Decided once
/// per process.
pub fn own_avx2_kernel() -> bool {
    use crate::backend::cpu::features::{Isa, features, gemm_isa};
    static OWN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OWN.get_or_init(|| {
        let f = features();
        cfg!(target_arch = "x86_64")
            && f.avx2
            && f.fma
            && gemm_isa() == Isa::Avx2
            && std::env::var("MEMWALL_SGEMM").as_deref() != Ok("crate")
    })
}

/// The packing buffers each thread keeps after running the own AVX2 kernel; 0 where the
/// `gemm` crate runs.
pub fn own_pack_bytes_per_thread() -> u64 {
    #[cfg(target_arch = "x86_64")]
    if own_avx2_kernel() {
        return super::avx2::pack_bytes_per_thread();
    }
    0
}

/// The own AVX2 kernel on operands stored as f32 or bf16 (widened as they are packed), with
/// [`sgemm`]'s layout: `c[m,n] = ((accumulate ? c : 0) + bias) + alpha · op(a)[m,k] @
/// op(b)[k,n]`, the bias (`[n]`, if any) added before the products as a separate pass would.
/// Callers check [`own_avx2_kernel`] and `m >= OWN_MIN_ROWS` first.
///
/// # Safety
/// The windows were checked ([`check_windows`]), the bias holds `n` elements, and `k > 0`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(in crate::backend::cpu) unsafe fn own_sgemm<A: Packable, B: Packable>(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, lda, trans_a): (&[A], usize, bool), // stored [m, k] (or [k, m] if trans_a)
    (b, ldb, trans_b): (&[B], usize, bool), // stored [k, n] (or [n, k] if trans_b)
    c: &mut [f32],                          // [m, n], row stride ldc
    ldc: usize,
    accumulate: bool,
    bias: Option<&[f32]>, // [n]
) {
    debug_assert!(own_avx2_kernel());
    debug_assert!(bias.is_none_or(|b| b.len() >= n));
    let a = Strided::of(a.as_ptr(), lda, trans_a);
    let b = Strided::of(b.as_ptr(), ldb, trans_b);
    let dst = Dst {
        c: c.as_mut_ptr(),
        ldc,
        accumulate,
        bias: bias.map_or(std::ptr::null(), |b| b.as_ptr()),
    };
    let threads = rayon::current_num_threads();
    // SAFETY: `own_avx2_kernel` saw AVX2 and FMA; the caller checked the windows, the bias
    // and k > 0; `c` is a unique borrow, so it aliases no input.
    unsafe { super::avx2::sgemm((m, n, k), alpha, a, b, dst, threads) };
}

/// Rows of `c` per `gemm` call. `gemm` packs a kc × rows panel (kc ≤ 1024) per call, so this
/// bounds its scratch to [`GEMM_PACK_BYTES`] while keeping every call large enough to run at
/// full speed.
pub const GEMM_M_BLOCK: usize = 2048;

/// Largest reduction depth `gemm` packs at once (its kc).
const GEMM_KC_MAX: usize = 1024;

/// Upper bound of the packing scratch one `sgemm` call makes `gemm` allocate.
pub const GEMM_PACK_BYTES: u64 = (GEMM_M_BLOCK * GEMM_KC_MAX * 4) as u64;

/// Packing scratch of an `sgemm` call with `m` output rows and reduction depth `k`: a
/// kc × rows panel, kc ≤ 1024, rows ≤ [`GEMM_M_BLOCK`] (at most [`GEMM_PACK_BYTES`]).
pub fn packing_bytes(m: usize, k: usize) -> u64 {
    (m.min(GEMM_M_BLOCK) * k.min(GEMM_KC_MAX) * 4) as u64
}

#[cfg(test)]
mod tests {
    use super::super::naive;
    use super::*;
    use crate::backend::cpu::reduce::testutil::*;

    #[test]
    fn sgemm_splits_tall_problems_into_row_blocks() {
        let (m, n, k) = (2 * GEMM_M_BLOCK + 3, 5, 7);
        for trans_a in [false, true] {
            let (ar, ac) = if trans_a { (k, m) } else { (m, k) };
            let a = randn(ar * ac, 1.0, 1);
            let b = randn(k * n, 1.0, 2);
            let (mut c1, mut c2) = (randn(m * n, 1.0, 3), vec![0f32; m * n]);
            c2.copy_from_slice(&c1);
            sgemm(
                m, n, k, 0.5, &a, ac, trans_a, &b, n, false, &mut c1, n, true,
            );
            naive::sgemm(
                m, n, k, 0.5, &a, ac, trans_a, &b, n, false, &mut c2, n, true,
            );
            assert_close(&c1, &c2, 1e-4, 1e-5, &format!("tall sgemm ta={trans_a}"));
        }
    }

    #[test]
    fn sgemm_all_transposes_strides_and_alpha() {
        let shapes = [
            (1usize, 1usize, 1usize),
            (7, 5, 3),
            (33, 17, 65),
            (70, 129, 40),
            (2, 300, 9),
        ];
        for (si, &(m, n, k)) in shapes.iter().enumerate() {
            for trans_a in [false, true] {
                for trans_b in [false, true] {
                    for accumulate in [false, true] {
                        let (ar, ac) = if trans_a { (k, m) } else { (m, k) };
                        let (br, bc) = if trans_b { (n, k) } else { (k, n) };
                        let (lda, ldb, ldc) = (ac + 3, bc + 1, n + 5);
                        let a = randn(ar * lda, 1.0, si as u64);
                        let b = randn(br * ldb, 1.0, 10 + si as u64);
                        let c0 = randn(m * ldc, 1.0, 20 + si as u64);
                        let (mut c1, mut c2) = (c0.clone(), c0.clone());
                        let alpha = -0.75;
                        sgemm(
                            m, n, k, alpha, &a, lda, trans_a, &b, ldb, trans_b, &mut c1, ldc,
                            accumulate,
                        );
                        naive::sgemm(
                            m, n, k, alpha, &a, lda, trans_a, &b, ldb, trans_b, &mut c2, ldc,
                            accumulate,
                        );
                        let what =
                            format!("{m}x{n}x{k} ta={trans_a} tb={trans_b} acc={accumulate}");
                        assert_close(&c1, &c2, 2e-5 * (k as f32).sqrt(), 1e-5, &what);
                        // Row padding of c is untouched.
                        for i in 0..m {
                            assert_eq!(
                                &c1[i * ldc + n..(i + 1) * ldc],
                                &c0[i * ldc + n..(i + 1) * ldc]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn sgemm_degenerate_sizes() {
        let mut c = vec![5.0f32; 6];
        sgemm(2, 3, 0, 1.0, &[], 0, false, &[], 3, false, &mut c, 3, true);
        assert_eq!(c, vec![5.0; 6]);
        sgemm(2, 3, 0, 1.0, &[], 0, false, &[], 3, false, &mut c, 3, false);
        assert_eq!(c, vec![0.0; 6]);
        sgemm(
            0,
            3,
            4,
            1.0,
            &[],
            4,
            false,
            &[1.0; 12],
            3,
            false,
            &mut [],
            3,
            false,
        );
    }
}
