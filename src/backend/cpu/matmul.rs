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

use super::reduce::{COL_CHUNK, multiversion, rows_per_task};
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
fn span(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

/// General strided single-precision GEMM used by the executor for the tied LM head:
/// c[m,n] = (accumulate ? c : 0) + alpha * op(a)[m,k] @ op(b)[k,n], where op transposes when
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
    let (a_rows, a_cols) = if trans_a { (k, m) } else { (m, k) };
    let (b_rows, b_cols) = if trans_b { (n, k) } else { (k, n) };
    // These asserts guard the raw-pointer call below: keep them in release builds.
    assert!(lda >= a_cols, "sgemm: lda {lda} < {a_cols}");
    assert!(ldb >= b_cols, "sgemm: ldb {ldb} < {b_cols}");
    assert!(ldc >= n, "sgemm: ldc {ldc} < {n}");
    assert!(a.len() >= span(a_rows, a_cols, lda), "sgemm: a too short");
    assert!(b.len() >= span(b_rows, b_cols, ldb), "sgemm: b too short");
    assert!(c.len() >= span(m, n, ldc), "sgemm: c too short");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in c.chunks_mut(ldc).take(m) {
                row[..n].fill(0.0);
            }
        }
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
        // SAFETY: the asserts above prove every (row, col) index gemm touches lies inside `a`,
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

/// out = (accumulate ? out : 0) + inp @ weight + bias.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward(
    out: &mut [f32],      // [N, OC]
    inp: &[f32],          // [N, IC]
    weight: &[f32],       // [IC, OC]
    bias: Option<&[f32]>, // [OC]
    n: usize,
    ic: usize,
    oc: usize,
    accumulate: bool,
) {
    assert_eq!(out.len(), n * oc, "matmul_forward: out");
    assert_eq!(inp.len(), n * ic, "matmul_forward: inp");
    assert_eq!(weight.len(), ic * oc, "matmul_forward: weight");
    let mut read_out = accumulate;
    if let Some(bias) = bias {
        assert_eq!(bias.len(), oc, "matmul_forward: bias");
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
/// dweight += inp^T @ dout, dbias += column sums of dout.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
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
    assert_eq!(dinp.len(), n * ic, "matmul_backward: dinp");
    assert_eq!(dweight.len(), ic * oc, "matmul_backward: dweight");
    assert_eq!(dout.len(), n * oc, "matmul_backward: dout");
    assert_eq!(inp.len(), n * ic, "matmul_backward: inp");
    assert_eq!(weight.len(), ic * oc, "matmul_backward: weight");
    // dinp[N, IC] = dout[N, OC] @ weight^T (weight^T read through strides).
    sgemm(
        n, ic, oc, 1.0, dout, oc, false, weight, oc, true, dinp, ic, false,
    );
    // dweight[IC, OC] += inp^T @ dout.
    sgemm(
        ic, oc, n, 1.0, inp, ic, true, dout, oc, false, dweight, oc, true,
    );
    if let Some(dbias) = dbias {
        assert_eq!(dbias.len(), oc, "matmul_backward: dbias");
        col_sum_accumulate(dbias, dout, n, oc);
    }
}

/// dst[j] += Σ_r src[r, j]. Each task owns `COL_CHUNK` columns and sums all rows in order, in
/// f32 lanes on the stack, then adds once into `dst`: identical for any thread count.
fn col_sum_accumulate(
    dst: &mut [f32], // [OC]
    src: &[f32],     // [N, OC]
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
    /// d[j] += Σ_r src[r, c0 + j] for the columns of one task.
    fn col_sum_task(
        d: &mut [f32], // [w <= COL_CHUNK]: columns c0..c0 + w
        src: &[f32],   // [N, OC]
        c0: usize,
        oc: usize,
    ) {
        let w = d.len();
        let mut acc = [0.0f32; COL_CHUNK];
        let acc = &mut acc[..w];
        for row in src.chunks_exact(oc) {
            for (a, &v) in acc.iter_mut().zip(&row[c0..c0 + w]) {
                *a += v;
            }
        }
        for (d, &a) in d.iter_mut().zip(acc.iter()) {
            *d += a;
        }
    }
}

/// Reference twins: triple loops with f64 accumulation.
pub mod naive {
    /// out = (accumulate ? out : 0) + inp @ weight + bias.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_forward(
        out: &mut [f32],      // [N, OC]
        inp: &[f32],          // [N, IC]
        weight: &[f32],       // [IC, OC]
        bias: Option<&[f32]>, // [OC]
        n: usize,
        ic: usize,
        oc: usize,
        accumulate: bool,
    ) {
        for r in 0..n {
            for o in 0..oc {
                let mut s = bias.map_or(0.0, |b| b[o] as f64);
                for i in 0..ic {
                    s += inp[r * ic + i] as f64 * weight[i * oc + o] as f64;
                }
                let prev = if accumulate {
                    out[r * oc + o] as f64
                } else {
                    0.0
                };
                out[r * oc + o] = (prev + s) as f32;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
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
        for r in 0..n {
            for i in 0..ic {
                let mut s = 0.0f64;
                for o in 0..oc {
                    s += dout[r * oc + o] as f64 * weight[i * oc + o] as f64;
                }
                dinp[r * ic + i] = s as f32;
            }
        }
        for i in 0..ic {
            for o in 0..oc {
                let mut s = dweight[i * oc + o] as f64;
                for r in 0..n {
                    s += inp[r * ic + i] as f64 * dout[r * oc + o] as f64;
                }
                dweight[i * oc + o] = s as f32;
            }
        }
        if let Some(dbias) = dbias {
            for o in 0..oc {
                let mut s = dbias[o] as f64;
                for r in 0..n {
                    s += dout[r * oc + o] as f64;
                }
                dbias[o] = s as f32;
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
    use super::super::reduce::testutil::*;
    use super::*;

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
                    matmul_forward(&mut got, &inp, &w, b, n, ic, oc, accumulate);
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
        matmul_forward(&mut got, &inp, &w, None, n, ic, oc, false);
        naive::matmul_forward(&mut want, &inp, &w, None, n, ic, oc, false);
        assert_close(&got, &want, 1e-4, 1e-5, "nan-initialised out");
        let mut got = vec![f32::NAN; n * oc];
        let bias = randn(oc, 1.0, 3);
        matmul_forward(&mut got, &inp, &w, Some(&bias), n, ic, oc, false);
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
            matmul_backward(&mut dinp, &mut dw3, None, &dout, &inp, &w, n, ic, oc);
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
        matmul_backward(&mut dinp, &mut dw, Some(&mut db), &g, &inp, &w, n, ic, oc);
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
        matmul_forward(&mut out, &[], &[], Some(&[1.0, 2.0]), 2, 0, 2, false);
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
            matmul_forward(&mut out, &inp, &w, None, n, ic, oc, false);
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
}
