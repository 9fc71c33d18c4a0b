//! Linear layers and general GEMM on the `gemm` crate. Weights use Hugging Face's Conv1D
//! layout, `[IC, OC]` row-major, so `out[N, OC] = inp[N, IC] @ w[IC, OC] + b[OC]`.
//!
//! Transposed operands are passed to `gemm` as strides, never copied. `gemm` splits the output
//! into tiles across threads and walks the reduction dimension sequentially inside a tile,
//! so results are deterministic for a given thread count. Note that `gemm` allocates its own
//! packing buffers internally; `sgemm` splits calls into row blocks so they stay below
//! [`GEMM_PACK_BYTES`] (the plan counts them); nothing else here allocates.
//! The bias gradient is a column sum in which each task owns a fixed slice of columns and
//! walks all rows in order (identical for any thread count, no workspace).
//!
//! The linear layer is generic over the storage type ([`Elem`]). For f32 it is the f32 kernel
//! (same code, bit-identical, no workspace); for bf16/f16 the products run through
//! [`gemm_mixed`](super::gemm_mixed) (operands widened to f32 tile by tile, f32 accumulation,
//! one rounding per output element per call), which needs
//! [`gemm_mixed_workspace_len`](super::gemm_mixed::gemm_mixed_workspace_len) f32 of
//! workspace; the bias gradient is summed in f32 and added to `dbias` once per element.

use super::elem::Elem;
use super::features::multiversion;
use super::gemm_mixed::{MIXED_BLOCK, as_f32, as_f32_mut, gemm_mixed, gemm_mixed_blocked};
use super::reduce::{COL_CHUNK, rows_per_task};
use gemm::{Parallelism, gemm};
use rayon::prelude::*;

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
pub(super) fn check_windows(
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

/// out = (accumulate ? out : 0) + inp @ weight + bias, stored as `T`.
///
/// f32: the f32 kernel (`ws` unused, may be empty). bf16/f16: [`gemm_mixed`] with the bias
/// folded into its f32 output tile (f32 accumulation, one rounding per element); `ws` must
/// hold [`gemm_mixed_workspace_len`](super::gemm_mixed::gemm_mixed_workspace_len) f32.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<T: Elem, W: Elem>(
    out: &mut [T],      // [N, OC]
    inp: &[T],          // [N, IC]
    weight: &[W],       // [IC, OC]
    bias: Option<&[W]>, // [OC]
    n: usize,
    ic: usize,
    oc: usize,
    accumulate: bool,
    ws: &mut [f32], // [gemm_mixed_workspace_len()] unless T is f32
) {
    assert_eq!(out.len(), n * oc, "matmul_forward: out");
    assert_eq!(inp.len(), n * ic, "matmul_forward: inp");
    assert_eq!(weight.len(), ic * oc, "matmul_forward: weight");
    if let Some(bias) = bias {
        assert_eq!(bias.len(), oc, "matmul_forward: bias");
    }
    if let (Some(out), Some(inp), Some(weight)) =
        (as_f32_mut(&mut *out), as_f32(inp), as_f32(weight))
    {
        let bias = bias.map(|b| as_f32(b).expect("bias has the element type of out"));
        return matmul_forward_f32(out, inp, weight, bias, n, ic, oc, accumulate);
    }
    gemm_mixed_blocked(
        MIXED_BLOCK,
        (n, oc, ic),
        (inp, ic, false),
        (weight, oc, false),
        (out, oc),
        accumulate,
        bias,
        ws,
    );
}

/// The f32 instantiation of [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
fn matmul_forward_f32(
    out: &mut [f32],      // [N, OC]
    inp: &[f32],          // [N, IC]
    weight: &[f32],       // [IC, OC]
    bias: Option<&[f32]>, // [OC]
    n: usize,
    ic: usize,
    oc: usize,
    accumulate: bool,
) {
    let mut read_out = accumulate;
    if let Some(bias) = bias {
        if oc > 0 {
            // Seed (or bump) the output with the bias, then let gemm accumulate onto it.
            out.par_chunks_mut(oc * rows_per_task(oc)).for_each(|rows| {
                for row in rows.chunks_exact_mut(oc) {
                    if accumulate {
                        for (o, &b) in row.iter_mut().zip(bias) {
                            *o += b;
                        }
                    } else {
                        row.copy_from_slice(bias);
                    }
                }
            });
        }
        read_out = true;
    }
    sgemm(
        n, oc, ic, 1.0, inp, ic, false, weight, oc, false, out, oc, read_out,
    );
}

/// Backward of `matmul_forward`: dinp = dout @ weight^T (overwritten),
/// dweight += inp^T @ dout, dbias += column sums of dout, stored as `T`.
///
/// f32: the f32 kernel (`ws` unused, may be empty). bf16/f16: two [`gemm_mixed`] calls (f32
/// accumulation over all N rows, one rounding of each dinp/dweight element) and an f32
/// column sum added to each dbias element once; `ws` must hold
/// [`gemm_mixed_workspace_len`](super::gemm_mixed::gemm_mixed_workspace_len) f32.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<T: Elem, W: Elem>(
    dinp: &mut [T],          // [N, IC] overwritten
    dweight: &mut [T],       // [IC, OC] +=
    dbias: Option<&mut [T]>, // [OC] +=
    dout: &[T],              // [N, OC]
    inp: &[T],               // [N, IC]
    weight: &[W],            // [IC, OC]
    n: usize,
    ic: usize,
    oc: usize,
    ws: &mut [f32], // [gemm_mixed_workspace_len()] unless T is f32
) {
    assert_eq!(dinp.len(), n * ic, "matmul_backward: dinp");
    assert_eq!(dweight.len(), ic * oc, "matmul_backward: dweight");
    assert_eq!(dout.len(), n * oc, "matmul_backward: dout");
    assert_eq!(inp.len(), n * ic, "matmul_backward: inp");
    assert_eq!(weight.len(), ic * oc, "matmul_backward: weight");
    if let Some(dbias) = &dbias {
        assert_eq!(dbias.len(), oc, "matmul_backward: dbias");
    }
    if let (Some(dinp), Some(dweight), Some(dout), Some(inp), Some(weight)) = (
        as_f32_mut(&mut *dinp),
        as_f32_mut(&mut *dweight),
        as_f32(dout),
        as_f32(inp),
        as_f32(weight),
    ) {
        let dbias = dbias.map(|d| as_f32_mut(d).expect("dbias has the element type of dout"));
        return matmul_backward_f32(dinp, dweight, dbias, dout, inp, weight, n, ic, oc);
    }
    // dinp[N, IC] = dout[N, OC] @ weight^T (weight^T read through strides).
    gemm_mixed(
        n, ic, oc, dout, oc, false, weight, oc, true, dinp, ic, false, ws,
    );
    // dweight[IC, OC] += inp^T @ dout.
    gemm_mixed(
        ic, oc, n, inp, ic, true, dout, oc, false, dweight, oc, true, ws,
    );
    if let Some(dbias) = dbias {
        col_sum_accumulate(dbias, dout, n, oc);
    }
}

/// The f32 instantiation of [`matmul_backward`].
#[allow(clippy::too_many_arguments)]
fn matmul_backward_f32(
    dinp: &mut [f32],          // [N, IC] overwritten
    dweight: &mut [f32],       // [IC, OC] +=
    dbias: Option<&mut [f32]>, // [OC] +=
    dout: &[f32],              // [N, OC]
    inp: &[f32],               // [N, IC]
    weight: &[f32],            // [IC, OC]
    n: usize,
    ic: usize,
    oc: usize,
) {
    // dinp[N, IC] = dout[N, OC] @ weight^T (weight^T read through strides).
    sgemm(
        n, ic, oc, 1.0, dout, oc, false, weight, oc, true, dinp, ic, false,
    );
    // dweight[IC, OC] += inp^T @ dout.
    sgemm(
        ic, oc, n, 1.0, inp, ic, true, dout, oc, false, dweight, oc, true,
    );
    if let Some(dbias) = dbias {
        col_sum_accumulate(dbias, dout, n, oc);
    }
}

/// `dst[j] += Σ_r src[r, j]. Each task owns COL_CHUNK columns and sums all rows in order, in`
/// f32 lanes on the stack, then adds once into `dst`: identical for any thread count.
fn col_sum_accumulate<T: Elem>(
    dst: &mut [T], // [OC]
    src: &[T],     // [N, OC]
    n: usize,
    oc: usize,
) {
    debug_assert_eq!(dst.len(), oc);
    debug_assert_eq!(src.len(), n * oc);
    dst.par_chunks_mut(COL_CHUNK)
        .enumerate()
        .for_each(|(ci, d)| col_sum_task(d, src, ci * COL_CHUNK, oc));
}

multiversion! {
    /// d[j] = T(d[j] + Σ_r src[r, c0 + j]) for the columns of one task: the sum in f32 lanes
    /// on the stack (rows in order, thread-count independent), one rounding per element.
    fn col_sum_task<T: Elem>(
        d: &mut [T], // [w <= COL_CHUNK]: columns c0..c0 + w
        src: &[T],   // [N, OC]
        c0: usize,
        oc: usize,
    ) {
        let w = d.len();
        let mut acc = [0.0f32; COL_CHUNK];
        let acc = &mut acc[..w];
        for row in src.chunks_exact(oc) {
            for (a, &v) in acc.iter_mut().zip(&row[c0..c0 + w]) {
                *a += v.to_f32();
            }
        }
        for (d, &a) in d.iter_mut().zip(acc.iter()) {
            *d = T::from_f32(d.to_f32() + a);
        }
    }
}

/// Reference twins: triple loops with f64 accumulation, generic over the storage type (one
/// rounding to `T` per output element).
pub mod naive {
    use super::Elem;

    /// out = (accumulate ? out : 0) + inp @ weight + bias.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_forward<T: Elem>(
        out: &mut [T],      // [N, OC]
        inp: &[T],          // [N, IC]
        weight: &[T],       // [IC, OC]
        bias: Option<&[T]>, // [OC]
        n: usize,
        ic: usize,
        oc: usize,
        accumulate: bool,
    ) {
        for r in 0..n {
            for o in 0..oc {
                let mut s = bias.map_or(0.0, |b| b[o].to_f32() as f64);
                for i in 0..ic {
                    s += inp[r * ic + i].to_f32() as f64 * weight[i * oc + o].to_f32() as f64;
                }
                let prev = if accumulate {
                    out[r * oc + o].to_f32() as f64
                } else {
                    0.0
                };
                out[r * oc + o] = T::from_f32((prev + s) as f32);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward<T: Elem>(
        dinp: &mut [T],          // [N, IC] overwritten
        dweight: &mut [T],       // [IC, OC] +=
        dbias: Option<&mut [T]>, // [OC] +=
        dout: &[T],              // [N, OC]
        inp: &[T],               // [N, IC]
        weight: &[T],            // [IC, OC]
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        let f = |x: T| x.to_f32() as f64;
        for r in 0..n {
            for i in 0..ic {
                let mut s = 0.0f64;
                for o in 0..oc {
                    s += f(dout[r * oc + o]) * f(weight[i * oc + o]);
                }
                dinp[r * ic + i] = T::from_f32(s as f32);
            }
        }
        for i in 0..ic {
            for o in 0..oc {
                let mut s = f(dweight[i * oc + o]);
                for r in 0..n {
                    s += f(inp[r * ic + i]) * f(dout[r * oc + o]);
                }
                dweight[i * oc + o] = T::from_f32(s as f32);
            }
        }
        if let Some(dbias) = dbias {
            for o in 0..oc {
                let mut s = f(dbias[o]);
                for r in 0..n {
                    s += f(dout[r * oc + o]);
                }
                dbias[o] = T::from_f32(s as f32);
            }
        }
    }

    /// Same contract as the fast `sgemm`.
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
}

#[cfg(test)]
mod tests {
    use super::super::gemm_mixed::gemm_mixed_workspace_len;
    use super::super::reduce::testutil::*;
    use super::*;
    use half::{bf16, f16};

    const SHAPES: [(usize, usize, usize); 9] = [
        (1, 1, 1),
        (1, 7, 5),
        (3, 1, 9),
        (5, 13, 1),
        (17, 33, 65),
        (31, 64, 129),
        (64, 48, 80),
        (100, 70, 3),
        (129, 257, 67),
    ];

    #[test]
    fn forward_matches_naive() {
        for (si, &(n, ic, oc)) in SHAPES.iter().enumerate() {
            let inp = randn(n * ic, 1.0, si as u64);
            let w = randn(ic * oc, 0.5, 100 + si as u64);
            let bias = randn(oc, 1.0, 200 + si as u64);
            let init = randn(n * oc, 1.0, 300 + si as u64);
            let tol = 2e-5 * (ic as f32).sqrt();
            for accumulate in [false, true] {
                for with_bias in [false, true] {
                    let b = with_bias.then_some(bias.as_slice());
                    let mut got = init.clone();
                    let mut want = init.clone();
                    matmul_forward(&mut got, &inp, &w, b, n, ic, oc, accumulate, &mut []);
                    naive::matmul_forward(&mut want, &inp, &w, b, n, ic, oc, accumulate);
                    let what = format!("fwd {n}x{ic}x{oc} acc={accumulate} bias={with_bias}");
                    assert_close(&got, &want, tol, 1e-5, &what);
                }
            }
        }
    }

    #[test]
    fn forward_overwrites_garbage() {
        let (n, ic, oc) = (9, 20, 11);
        let inp = randn(n * ic, 1.0, 1);
        let w = randn(ic * oc, 1.0, 2);
        let mut got = vec![f32::NAN; n * oc];
        let mut want = vec![0.0; n * oc];
        matmul_forward(&mut got, &inp, &w, None, n, ic, oc, false, &mut []);
        naive::matmul_forward(&mut want, &inp, &w, None, n, ic, oc, false);
        assert_close(&got, &want, 1e-4, 1e-5, "nan-initialised out");
        let mut got = vec![f32::NAN; n * oc];
        let bias = randn(oc, 1.0, 3);
        matmul_forward(&mut got, &inp, &w, Some(&bias), n, ic, oc, false, &mut []);
        naive::matmul_forward(&mut want, &inp, &w, Some(&bias), n, ic, oc, false);
        assert_close(&got, &want, 1e-4, 1e-5, "nan-initialised out with bias");
    }

    #[test]
    fn backward_matches_naive() {
        for (si, &(n, ic, oc)) in SHAPES.iter().enumerate() {
            let inp = randn(n * ic, 1.0, si as u64);
            let w = randn(ic * oc, 0.5, 100 + si as u64);
            let dout = randn(n * oc, 1.0, 200 + si as u64);
            let dw0 = randn(ic * oc, 1.0, 300 + si as u64);
            let db0 = randn(oc, 1.0, 400 + si as u64);
            let (mut dinp, mut dw, mut db) = (vec![f32::NAN; n * ic], dw0.clone(), db0.clone());
            let (mut dinp2, mut dw2, mut db2) = (vec![0.0; n * ic], dw0.clone(), db0.clone());
            matmul_backward(
                &mut dinp,
                &mut dw,
                Some(&mut db),
                &dout,
                &inp,
                &w,
                n,
                ic,
                oc,
                &mut [],
            );
            naive::matmul_backward(
                &mut dinp2,
                &mut dw2,
                Some(&mut db2),
                &dout,
                &inp,
                &w,
                n,
                ic,
                oc,
            );
            let what = format!("{n}x{ic}x{oc}");
            assert_close(
                &dinp,
                &dinp2,
                2e-5 * (oc as f32).sqrt(),
                1e-5,
                &format!("dinp {what}"),
            );
            assert_close(
                &dw,
                &dw2,
                2e-5 * (n as f32).sqrt(),
                1e-5,
                &format!("dw {what}"),
            );
            assert_close(
                &db,
                &db2,
                2e-5 * (n as f32).sqrt(),
                1e-5,
                &format!("db {what}"),
            );
            // Without a bias gradient the weight gradient is unchanged.
            let mut dw3 = dw0.clone();
            matmul_backward(
                &mut dinp,
                &mut dw3,
                None,
                &dout,
                &inp,
                &w,
                n,
                ic,
                oc,
                &mut [],
            );
            assert_close(
                &dw3,
                &dw2,
                2e-5 * (n as f32).sqrt(),
                1e-5,
                &format!("dw nobias {what}"),
            );
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, ic, oc) = (3, 5, 4);
        let inp = randn(n * ic, 1.0, 1);
        let w = randn(ic * oc, 1.0, 2);
        let bias = randn(oc, 1.0, 3);
        let g = randn(n * oc, 1.0, 4); // loss = Σ g · out
        let loss = |inp: &[f32], w: &[f32], b: &[f32]| {
            let mut out = vec![0.0; n * oc];
            naive::matmul_forward(&mut out, inp, w, Some(b), n, ic, oc, false);
            dot(&g, &out)
        };
        let (mut dinp, mut dw, mut db) = (vec![0.0; n * ic], vec![0.0; ic * oc], vec![0.0; oc]);
        matmul_backward(
            &mut dinp,
            &mut dw,
            Some(&mut db),
            &g,
            &inp,
            &w,
            n,
            ic,
            oc,
            &mut [],
        );
        let h = 1e-2;
        let fd_inp = fd_grad(&inp, h, |x| loss(x, &w, &bias));
        let fd_w = fd_grad(&w, h, |x| loss(&inp, x, &bias));
        let fd_b = fd_grad(&bias, h, |x| loss(&inp, &w, x));
        assert_close(&dinp, &fd_inp, 1e-3, 1e-3, "dinp vs fd");
        assert_close(&dw, &fd_w, 1e-3, 1e-3, "dw vs fd");
        assert_close(&db, &fd_b, 1e-3, 1e-3, "db vs fd");
    }

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
        let mut out = vec![f32::NAN; 4];
        matmul_forward(
            &mut out,
            &[],
            &[],
            Some(&[1.0, 2.0]),
            2,
            0,
            2,
            false,
            &mut [],
        );
        assert_eq!(out, vec![1.0, 2.0, 1.0, 2.0]);
    }

    #[test]
    fn deterministic_for_fixed_threads_and_bias_thread_invariant() {
        let (n, ic, oc) = (256, 200, 300);
        let inp = randn(n * ic, 1.0, 1);
        let w = randn(ic * oc, 0.1, 2);
        let dout = randn(n * oc, 1.0, 3);
        let run = || {
            let mut out = vec![0.0; n * oc];
            matmul_forward(&mut out, &inp, &w, None, n, ic, oc, false, &mut []);
            let (mut dinp, mut dw, mut db) = (vec![0.0; n * ic], vec![0.0; ic * oc], vec![0.0; oc]);
            matmul_backward(
                &mut dinp,
                &mut dw,
                Some(&mut db),
                &dout,
                &inp,
                &w,
                n,
                ic,
                oc,
                &mut [],
            );
            (out, dinp, dw, db)
        };
        for threads in [1, 2, 3] {
            let a = with_threads(threads, run);
            let b = with_threads(threads, run);
            assert!(a == b, "not deterministic with {threads} threads");
        }
        let db1 = with_threads(1, run).3;
        let db3 = with_threads(3, run).3;
        assert_eq!(db1, db3, "dbias depends on thread count");
    }

    /// `len` normal values times `scale`, rounded to `T` and stored as (T, exact f32 twin).
    fn rand_elem<T: Elem>(len: usize, scale: f32, seed: u64) -> (Vec<T>, Vec<f32>) {
        let t: Vec<T> = randn(len, scale, seed)
            .into_iter()
            .map(T::from_f32)
            .collect();
        let f = t.iter().map(|x| x.to_f32()).collect();
        (t, f)
    }

    fn widened<T: Elem>(v: &[T]) -> Vec<f32> {
        v.iter().map(|x| x.to_f32()).collect()
    }

    /// Largest relative error of one rounding to `T` (half an ulp).
    fn store_rtol<T: Elem>() -> f32 {
        match T::NAME {
            "bf16" => 1.0 / 256.0,
            "f16" => 1.0 / 2048.0,
            _ => 0.0,
        }
    }

    /// (N, IC, OC) for the mixed layer: partial tiles of MIXED_BLOCK in N, OC, and in the
    /// reduction depths of the backward GEMMs (N for dweight, OC for dinp).
    const MIXED_SHAPES: [(usize, usize, usize); 5] = [
        (1, 1, 1),
        (5, 13, 1),
        (17, 33, 65),
        (129, 257, 67),
        (1100, 40, 1030),
    ];

    /// matmul_forward::<T> against the f32 kernel on the same T-representable inputs: equal
    /// up to the one rounding of each output to T.
    fn forward_vs_f32<T: Elem>() {
        let mut ws = vec![f32::NAN; gemm_mixed_workspace_len()];
        for (si, &(n, ic, oc)) in MIXED_SHAPES.iter().enumerate() {
            let s = 10 * si as u64;
            let (inp, inp32) = rand_elem::<T>(n * ic, 1.0, s);
            let (w, w32) = rand_elem::<T>(ic * oc, 0.5, s + 1);
            let (bias, bias32) = rand_elem::<T>(oc, 1.0, s + 2);
            let (init, init32) = rand_elem::<T>(n * oc, 1.0, s + 3);
            for accumulate in [false, true] {
                for with_bias in [false, true] {
                    let mut got = init.clone();
                    let mut want = init32.clone();
                    let b = with_bias.then_some(bias.as_slice());
                    let b32 = with_bias.then_some(bias32.as_slice());
                    matmul_forward(&mut got, &inp, &w, b, n, ic, oc, accumulate, &mut ws);
                    matmul_forward(&mut want, &inp32, &w32, b32, n, ic, oc, accumulate, &mut []);
                    let what = format!(
                        "{} fwd {n}x{ic}x{oc} acc={accumulate} bias={with_bias}",
                        T::NAME
                    );
                    let atol = 2e-5 * (ic as f32).sqrt();
                    assert_close(&widened(&got), &want, atol, store_rtol::<T>(), &what);
                }
            }
        }
    }

    #[test]
    fn forward_bf16_matches_f32_kernel() {
        forward_vs_f32::<bf16>();
    }

    #[test]
    fn forward_f16_matches_f32_kernel() {
        forward_vs_f32::<f16>();
    }

    #[test]
    fn backward_bf16_matches_f32_kernel() {
        let mut ws = vec![f32::NAN; gemm_mixed_workspace_len()];
        for (si, &(n, ic, oc)) in MIXED_SHAPES.iter().enumerate() {
            let s = 10 * si as u64;
            let (inp, inp32) = rand_elem::<bf16>(n * ic, 1.0, s);
            let (w, w32) = rand_elem::<bf16>(ic * oc, 0.5, s + 1);
            let (dout, dout32) = rand_elem::<bf16>(n * oc, 1.0, s + 2);
            let (dw0, dw032) = rand_elem::<bf16>(ic * oc, 1.0, s + 3);
            let (db0, db032) = rand_elem::<bf16>(oc, 1.0, s + 4);
            let mut dinp = vec![bf16::NAN; n * ic];
            let (mut dw, mut db) = (dw0.clone(), db0.clone());
            matmul_backward(
                &mut dinp,
                &mut dw,
                Some(&mut db),
                &dout,
                &inp,
                &w,
                n,
                ic,
                oc,
                &mut ws,
            );
            let mut dinp32 = vec![0.0; n * ic];
            let (mut dw32, mut db32) = (dw032.clone(), db032.clone());
            matmul_backward(
                &mut dinp32,
                &mut dw32,
                Some(&mut db32),
                &dout32,
                &inp32,
                &w32,
                n,
                ic,
                oc,
                &mut [],
            );
            let what = format!("bf16 bwd {n}x{ic}x{oc}");
            let rt = store_rtol::<bf16>();
            let (at_oc, at_n) = (2e-5 * (oc as f32).sqrt(), 2e-5 * (n as f32).sqrt());
            assert_close(&widened(&dinp), &dinp32, at_oc, rt, &format!("dinp {what}"));
            assert_close(&widened(&dw), &dw32, at_n, rt, &format!("dw {what}"));
            assert_close(&widened(&db), &db32, at_n, rt, &format!("db {what}"));
            // Without a bias gradient dweight is the same, and dinp is overwritten again.
            let mut dw2 = dw0.clone();
            let mut dinp2 = vec![bf16::NAN; n * ic];
            let args = (&dout, &inp, &w);
            matmul_backward(
                &mut dinp2, &mut dw2, None, args.0, args.1, args.2, n, ic, oc, &mut ws,
            );
            assert!(
                dw2 == dw && dinp2 == dinp,
                "{what}: dbias = None changed the rest"
            );
        }
    }

    #[test]
    fn backward_bf16_bias_sum_rounds_once() {
        // 256 rows of 2^-9 add 0.5 to a bias gradient of 1.0. Added to a bf16 value of 1.0 one
        // row at a time, each 2^-9 is below half an ulp (2^-8) and would be lost.
        let (n, ic, oc) = (256, 1, 3);
        let dout = vec![bf16::from_f32(1.0 / 512.0); n * oc];
        let inp = vec![bf16::from_f32(1.0); n * ic];
        let w = vec![bf16::from_f32(1.0); ic * oc];
        let mut dinp = vec![bf16::ZERO; n * ic];
        let mut dw = vec![bf16::from_f32(1.0); ic * oc];
        let mut db = vec![bf16::from_f32(1.0); oc];
        let mut ws = vec![0.0; gemm_mixed_workspace_len()];
        matmul_backward(
            &mut dinp,
            &mut dw,
            Some(&mut db),
            &dout,
            &inp,
            &w,
            n,
            ic,
            oc,
            &mut ws,
        );
        assert_eq!(widened(&db), vec![1.5; oc], "dbias");
        assert_eq!(widened(&dw), vec![1.5; ic * oc], "dweight");
        assert_eq!(widened(&dinp), vec![3.0 / 512.0; n * ic], "dinp");
    }

    #[test]
    fn mixed_forward_and_backward_match_naive() {
        let (n, ic, oc) = (37, 50, 29);
        let (inp, _) = rand_elem::<bf16>(n * ic, 1.0, 1);
        let (w, _) = rand_elem::<bf16>(ic * oc, 0.5, 2);
        let (bias, _) = rand_elem::<bf16>(oc, 1.0, 3);
        let (init, _) = rand_elem::<bf16>(n * oc, 1.0, 4);
        let mut ws = vec![0.0; gemm_mixed_workspace_len()];
        let rt = 2.0 * store_rtol::<bf16>(); // both sides round: may differ by one ulp
        let (mut got, mut want) = (init.clone(), init.clone());
        matmul_forward(&mut got, &inp, &w, Some(&bias), n, ic, oc, true, &mut ws);
        naive::matmul_forward(&mut want, &inp, &w, Some(&bias), n, ic, oc, true);
        assert_close(&widened(&got), &widened(&want), 1e-3, rt, "fwd vs naive");
        let (dw0, _) = rand_elem::<bf16>(ic * oc, 1.0, 5);
        let (db0, _) = rand_elem::<bf16>(oc, 1.0, 6);
        let (mut dinp, mut dw, mut db) = (vec![bf16::ZERO; n * ic], dw0.clone(), db0.clone());
        let (mut dinp2, mut dw2, mut db2) = (vec![bf16::ZERO; n * ic], dw0, db0);
        matmul_backward(
            &mut dinp,
            &mut dw,
            Some(&mut db),
            &init,
            &inp,
            &w,
            n,
            ic,
            oc,
            &mut ws,
        );
        naive::matmul_backward(
            &mut dinp2,
            &mut dw2,
            Some(&mut db2),
            &init,
            &inp,
            &w,
            n,
            ic,
            oc,
        );
        assert_close(&widened(&dinp), &widened(&dinp2), 1e-3, rt, "dinp vs naive");
        assert_close(&widened(&dw), &widened(&dw2), 1e-3, rt, "dw vs naive");
        assert_close(&widened(&db), &widened(&db2), 1e-3, rt, "db vs naive");
    }

    #[test]
    fn mixed_identical_for_one_and_three_threads() {
        let (n, ic, oc) = (1100, 64, 300);
        let (inp, _) = rand_elem::<bf16>(n * ic, 1.0, 1);
        let (w, _) = rand_elem::<bf16>(ic * oc, 0.1, 2);
        let (dout, _) = rand_elem::<bf16>(n * oc, 1.0, 3);
        let (bias, _) = rand_elem::<bf16>(oc, 1.0, 4);
        let run = || {
            let mut ws = vec![0.0; gemm_mixed_workspace_len()];
            let mut out = vec![bf16::ZERO; n * oc];
            matmul_forward(&mut out, &inp, &w, Some(&bias), n, ic, oc, false, &mut ws);
            let mut dinp = vec![bf16::ZERO; n * ic];
            let (mut dw, mut db) = (vec![bf16::ZERO; ic * oc], vec![bf16::ZERO; oc]);
            matmul_backward(
                &mut dinp,
                &mut dw,
                Some(&mut db),
                &dout,
                &inp,
                &w,
                n,
                ic,
                oc,
                &mut ws,
            );
            (out, dinp, dw, db)
        };
        let r1 = with_threads(1, run);
        let r3 = with_threads(3, run);
        assert!(
            r3 == with_threads(3, run),
            "not deterministic with 3 threads"
        );
        assert!(r1 == r3, "1 and 3 threads differ");
    }
}
