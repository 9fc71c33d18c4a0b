//! Linear layers: `out[N, OC] = inp[N, IC] @ W + b[OC]`, forward and backward, with W stored
//! either in Hugging Face's Conv1D layout (`[IC, OC]` row-major, GPT-2) or in
//! `torch.nn.Linear`'s (`[OC, IC]` row-major, Llama): [`Layout`]. The two differ only in the
//! strides the GEMMs read W with. The products run on the GEMMs of [`super::gemm`]: [`sgemm`]
//! for f32 storage, [`gemm_mixed`] for bf16/f16.
//!
//! The bias gradient is a column sum in which each task owns a fixed slice of columns and
//! walks all rows in order (identical for any thread count, no workspace). Nothing here
//! allocates (`gemm`'s own packing scratch is bounded and counted by the plan, see
//! [`packing_bytes`](super::gemm::f32::packing_bytes)).
//!
//! The linear layer is generic over the storage type ([`Elem`]). For f32 it is the f32 kernel
//! (same code, bit-identical, no workspace); for bf16/f16 the products run through
//! [`gemm_mixed`] (tile by tile, f32 accumulation, one rounding per output element per
//! call), which needs
//! [`gemm_mixed_workspace_len`](super::gemm::mixed::gemm_mixed_workspace_len) f32 of
//! workspace; the bias gradient is summed in f32 and added to `dbias` once per element.

use super::elem::{as_f32, as_f32_mut};
use super::features::multiversion;
use super::gemm::f32::sgemm;
#[cfg(target_arch = "x86_64")]
use super::gemm::f32::{OWN_MIN_ROWS, check_windows, own_avx2_kernel, own_sgemm};
use super::gemm::mixed::{MIXED_BLOCK, gemm_mixed, gemm_mixed_blocked};
use super::reduce::{COL_CHUNK, rows_per_task};
use crate::dtype::Elem;
use rayon::prelude::*;

/// How a weight matrix W (logically `[IC, OC]`) is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[IC, OC]` row-major (Conv1D).
    InOut,
    /// `[OC, IC]` row-major (`nn.Linear`).
    OutIn,
}

impl Layout {
    /// W as a GEMM's right operand `[IC, OC]`: its row stride and whether it is stored
    /// transposed.
    fn as_b(self, ic: usize, oc: usize) -> (usize, bool) {
        match self {
            Layout::InOut => (oc, false),
            Layout::OutIn => (ic, true),
        }
    }

    /// Wᵀ as a GEMM's right operand `[OC, IC]`.
    fn transposed_as_b(self, ic: usize, oc: usize) -> (usize, bool) {
        match self {
            Layout::InOut => (oc, true),
            Layout::OutIn => (ic, false),
        }
    }
}

/// out = (accumulate ? out : 0) + inp @ W + bias, stored as `T`.
///
/// f32: the f32 kernel (`ws` unused, may be empty). bf16/f16: [`gemm_mixed`] with the bias
/// folded into its f32 output tile (f32 accumulation, one rounding per element); `ws` must
/// hold [`gemm_mixed_workspace_len`](super::gemm::mixed::gemm_mixed_workspace_len) f32.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<T: Elem, W: Elem>(
    out: &mut [T],      // [N, OC]
    inp: &[T],          // [N, IC]
    weight: &[W],       // [IC, OC] or [OC, IC] (layout)
    bias: Option<&[W]>, // [OC]
    layout: Layout,
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
        return matmul_forward_f32(out, inp, weight, bias, layout, n, ic, oc, accumulate);
    }
    let (ldw, w_trans) = layout.as_b(ic, oc);
    gemm_mixed_blocked(
        MIXED_BLOCK,
        (n, oc, ic),
        (inp, ic, false),
        (weight, ldw, w_trans),
        (out, oc),
        accumulate,
        bias,
        ws,
    );
}

/// `out[n, :] += bias` for every row (a frozen layer's bias stored apart from its weight),
/// one rounding per element; parallel over rows. Elementwise: its own naive form.
pub fn add_bias<T: Elem>(
    out: &mut [T], // [N, OC]
    bias: &[f32],  // [OC]
    oc: usize,
) {
    assert_eq!(bias.len(), oc, "add_bias: bias");
    if oc == 0 {
        return;
    }
    assert_eq!(out.len() % oc, 0, "add_bias: out");
    out.par_chunks_mut(oc * rows_per_task(oc)).for_each(|rows| {
        for row in rows.chunks_exact_mut(oc) {
            for (o, &b) in row.iter_mut().zip(bias) {
                *o = T::from_f32(o.to_f32() + b);
            }
        }
    });
}

/// The f32 instantiation of [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
fn matmul_forward_f32(
    out: &mut [f32],      // [N, OC]
    inp: &[f32],          // [N, IC]
    weight: &[f32],       // [IC, OC] or [OC, IC] (layout)
    bias: Option<&[f32]>, // [OC]
    layout: Layout,
    n: usize,
    ic: usize,
    oc: usize,
    accumulate: bool,
) {
    let (ldw, w_trans) = layout.as_b(ic, oc);
    #[cfg(target_arch = "x86_64")]
    if n >= OWN_MIN_ROWS && ic > 0 && own_avx2_kernel() {
        check_windows(
            "matmul_forward",
            (n, oc, ic),
            (inp.len(), ic, false),
            (weight.len(), ldw, w_trans),
            (out.len(), oc),
        );
        // SAFETY: the windows were checked, the bias has oc elements (asserted by
        // `matmul_forward`) and ic > 0. The bias is added in the kernel's first store, the
        // same additions as the seeding pass below, without the pass.
        unsafe {
            own_sgemm(
                (n, oc, ic),
                1.0,
                (inp, ic, false),
                (weight, ldw, w_trans),
                out,
                oc,
                accumulate,
                bias,
            )
        };
        return;
    }
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
        n, oc, ic, 1.0, inp, ic, false, weight, ldw, w_trans, out, oc, read_out,
    );
}

/// Backward of `matmul_forward`: dinp = dout @ Wᵀ (overwritten), dW += inpᵀ @ dout (into
/// `dweight` in the weight's layout: `[OC, IC]` receives doutᵀ @ inp), dbias += column sums
/// of dout, stored as `T`.
///
/// f32: the f32 kernel (`ws` unused, may be empty). bf16/f16: two [`gemm_mixed`] calls (f32
/// accumulation over all N rows, one rounding of each dinp/dweight element) and an f32
/// column sum added to each dbias element once; `ws` must hold
/// [`gemm_mixed_workspace_len`](super::gemm::mixed::gemm_mixed_workspace_len) f32.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<T: Elem, W: Elem>(
    dinp: &mut [T],          // [N, IC] overwritten
    dweight: &mut [T],       // [IC, OC] or [OC, IC] (layout) +=
    dbias: Option<&mut [T]>, // [OC] +=
    dout: &[T],              // [N, OC]
    inp: &[T],               // [N, IC]
    weight: &[W],            // [IC, OC] or [OC, IC] (layout)
    layout: Layout,
    n: usize,
    ic: usize,
    oc: usize,
    ws: &mut [f32], // [gemm_mixed_workspace_len()] unless T is f32
) {
    assert_eq!(dweight.len(), ic * oc, "matmul_backward: dweight");
    assert_eq!(inp.len(), n * ic, "matmul_backward: inp");
    if let Some(dbias) = &dbias {
        assert_eq!(dbias.len(), oc, "matmul_backward: dbias");
    }
    // All f32, each gemm_mixed below is exactly sgemm (`ws` unused).
    matmul_backward_input(dinp, dout, weight, layout, n, ic, oc, ws);
    match layout {
        // dweight[IC, OC] += inpᵀ @ dout.
        Layout::InOut => gemm_mixed(
            ic, oc, n, inp, ic, true, dout, oc, false, dweight, oc, true, ws,
        ),
        // dweight[OC, IC] += doutᵀ @ inp.
        Layout::OutIn => gemm_mixed(
            oc, ic, n, dout, oc, true, inp, ic, false, dweight, ic, true, ws,
        ),
    }
    if let Some(dbias) = dbias {
        col_sum_accumulate(dbias, dout, n, oc);
    }
}

/// The input gradient alone, `dinp = dout @ Wᵀ` (overwritten): a frozen layer's backward,
/// whose weight and bias take no gradient. `dinp` is exactly what [`matmul_backward`]
/// computes (it calls this first). `ws` as for [`matmul_backward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_input<T: Elem, W: Elem>(
    dinp: &mut [T], // [N, IC] overwritten
    dout: &[T],     // [N, OC]
    weight: &[W],   // [IC, OC] or [OC, IC] (layout)
    layout: Layout,
    n: usize,
    ic: usize,
    oc: usize,
    ws: &mut [f32], // [gemm_mixed_workspace_len()] unless T and W are f32
) {
    assert_eq!(dinp.len(), n * ic, "matmul_backward: dinp");
    assert_eq!(dout.len(), n * oc, "matmul_backward: dout");
    assert_eq!(weight.len(), ic * oc, "matmul_backward: weight");
    // dinp[N, IC] = dout[N, OC] @ Wᵀ (read through strides); all f32 is exactly sgemm.
    let (ldw, w_trans) = layout.transposed_as_b(ic, oc);
    gemm_mixed(
        n, ic, oc, dout, oc, false, weight, ldw, w_trans, dinp, ic, false, ws,
    );
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
}

#[cfg(test)]
mod tests {
    use super::super::conformance::{Case, Out, Tol, check_stored_as, stored};
    use super::super::gemm::mixed::gemm_mixed_workspace_len;
    use super::super::reduce::testutil::*;
    use super::*;
    use crate::dtype::is_f32;
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
                    matmul_forward(
                        &mut got,
                        &inp,
                        &w,
                        b,
                        Layout::InOut,
                        n,
                        ic,
                        oc,
                        accumulate,
                        &mut [],
                    );
                    naive::matmul_forward(&mut want, &inp, &w, b, n, ic, oc, accumulate);
                    let what = format!("fwd {n}x{ic}x{oc} acc={accumulate} bias={with_bias}");
                    assert_close(&got, &want, tol, 1e-5, &what);
                }
            }
        }
    }

    /// `w[rows, cols]` transposed.
    fn transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0.0; w.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = w[r * cols + c];
            }
        }
        t
    }

    /// The `nn.Linear` layout computes what Conv1D computes on the transposed weight, forward
    /// and backward (the weight gradient in the weight's own layout), for f32 storage and for
    /// bf16 (the mixed GEMM reading the weight through other strides).
    #[test]
    fn out_in_layout_is_the_transposed_weight() {
        fn run<T: Elem>(tol: f32) {
            for (si, &(n, ic, oc)) in SHAPES.iter().enumerate() {
                let si = si as u64;
                let inp: Vec<T> = stored::<T, T>(&randn(n * ic, 1.0, si));
                let w = randn(ic * oc, 0.5, 100 + si); // [IC, OC]
                let wt = transpose(&w, ic, oc); // [OC, IC]
                let bias = randn(oc, 1.0, 200 + si);
                let dout: Vec<T> = stored::<T, T>(&randn(n * oc, 1.0, 300 + si));
                let mut ws = vec![0.0; gemm_mixed_workspace_len()];
                let f = |x: &[T]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
                let (mut a, mut b) = (
                    vec![T::from_f32(0.0); n * oc],
                    vec![T::from_f32(0.0); n * oc],
                );
                let bs = Some(bias.as_slice());
                matmul_forward(
                    &mut a,
                    &inp,
                    &w,
                    bs,
                    Layout::InOut,
                    n,
                    ic,
                    oc,
                    false,
                    &mut ws,
                );
                matmul_forward(
                    &mut b,
                    &inp,
                    &wt,
                    bs,
                    Layout::OutIn,
                    n,
                    ic,
                    oc,
                    false,
                    &mut ws,
                );
                let what = format!("fwd {n}x{ic}x{oc}");
                assert_close(&f(&b), &f(&a), tol * (ic as f32).sqrt(), tol, &what);
                let zero = |k| vec![T::from_f32(0.0); k];
                let (mut dx_a, mut dw_a, mut db_a) = (zero(n * ic), zero(ic * oc), zero(oc));
                let (mut dx_b, mut dw_b, mut db_b) = (zero(n * ic), zero(ic * oc), zero(oc));
                let l = Layout::InOut;
                let (dba, dbb) = (Some(&mut db_a[..]), Some(&mut db_b[..]));
                matmul_backward(
                    &mut dx_a, &mut dw_a, dba, &dout, &inp, &w, l, n, ic, oc, &mut ws,
                );
                let l = Layout::OutIn;
                matmul_backward(
                    &mut dx_b, &mut dw_b, dbb, &dout, &inp, &wt, l, n, ic, oc, &mut ws,
                );
                let what = format!("bwd {n}x{ic}x{oc}");
                assert_close(&f(&dx_b), &f(&dx_a), tol * (oc as f32).sqrt(), tol, &what);
                let dw_b_as_a = transpose(&f(&dw_b), oc, ic);
                assert_close(&dw_b_as_a, &f(&dw_a), tol * (n as f32).sqrt(), tol, &what);
                assert_eq!(f(&db_a), f(&db_b), "{what}: bias gradient");
            }
        }
        run::<f32>(2e-5);
        run::<bf16>(1e-2);
    }

    #[test]
    fn forward_overwrites_garbage() {
        let (n, ic, oc) = (9, 20, 11);
        let inp = randn(n * ic, 1.0, 1);
        let w = randn(ic * oc, 1.0, 2);
        let mut got = vec![f32::NAN; n * oc];
        let mut want = vec![0.0; n * oc];
        matmul_forward(
            &mut got,
            &inp,
            &w,
            None,
            Layout::InOut,
            n,
            ic,
            oc,
            false,
            &mut [],
        );
        naive::matmul_forward(&mut want, &inp, &w, None, n, ic, oc, false);
        assert_close(&got, &want, 1e-4, 1e-5, "nan-initialised out");
        let mut got = vec![f32::NAN; n * oc];
        let bias = randn(oc, 1.0, 3);
        matmul_forward(
            &mut got,
            &inp,
            &w,
            Some(&bias),
            Layout::InOut,
            n,
            ic,
            oc,
            false,
            &mut [],
        );
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
                Layout::InOut,
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
                Layout::InOut,
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
            Layout::InOut,
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
    fn forward_without_inputs_is_the_bias() {
        let mut out = vec![f32::NAN; 4];
        matmul_forward(
            &mut out,
            &[],
            &[],
            Some(&[1.0, 2.0]),
            Layout::InOut,
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
            matmul_forward(
                &mut out,
                &inp,
                &w,
                None,
                Layout::InOut,
                n,
                ic,
                oc,
                false,
                &mut [],
            );
            let (mut dinp, mut dw, mut db) = (vec![0.0; n * ic], vec![0.0; ic * oc], vec![0.0; oc]);
            matmul_backward(
                &mut dinp,
                &mut dw,
                Some(&mut db),
                &dout,
                &inp,
                &w,
                Layout::InOut,
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

    /// The workspace of a linear layer stored as `S` (none for f32).
    fn ws_for<S: Elem>() -> Vec<f32> {
        if is_f32::<S>() {
            vec![]
        } else {
            vec![f32::NAN; gemm_mixed_workspace_len()]
        }
    }

    /// The tolerance of a result summed over `depth` products and stored as `T`: up to the
    /// one rounding of each output to `T`.
    fn tol<T: Elem>(depth: usize) -> Tol {
        Tol {
            rel: store_rtol::<T>(),
            of_max: 0.0,
            abs: 2e-5 * (depth as f32).sqrt(),
        }
    }

    /// matmul_forward stored as `T` against the f32 kernel on the same T-representable
    /// inputs: equal up to the one rounding of each output to `T`.
    struct Forward {
        shape: (usize, usize, usize), // (N, IC, OC)
        seed: u64,
        accumulate: bool,
        with_bias: bool,
    }

    impl Case for Forward {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let ((n, ic, oc), s) = (self.shape, self.seed);
            let inp: Vec<S> = stored::<T, S>(&randn(n * ic, 1.0, s));
            let w: Vec<S> = stored::<T, S>(&randn(ic * oc, 0.5, s + 1));
            let bias: Vec<S> = stored::<T, S>(&randn(oc, 1.0, s + 2));
            let mut out: Vec<S> = stored::<T, S>(&randn(n * oc, 1.0, s + 3));
            let b = self.with_bias.then_some(bias.as_slice());
            let mut ws = ws_for::<S>();
            matmul_forward(
                &mut out,
                &inp,
                &w,
                b,
                Layout::InOut,
                n,
                ic,
                oc,
                self.accumulate,
                &mut ws,
            );
            vec![Out::stored("out", &out).close(tol::<T>(ic))]
        }
    }

    fn forward_vs_f32<T: Elem>() {
        for (si, &(n, ic, oc)) in MIXED_SHAPES.iter().enumerate() {
            for accumulate in [false, true] {
                for with_bias in [false, true] {
                    let case = Forward {
                        shape: (n, ic, oc),
                        seed: 10 * si as u64,
                        accumulate,
                        with_bias,
                    };
                    let what = format!("fwd {n}x{ic}x{oc} acc={accumulate} bias={with_bias}");
                    check_stored_as::<T>(&case, &what);
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

    /// matmul_backward stored as `T` against the f32 kernel on the same T-representable
    /// inputs, with a bias gradient and without one.
    struct Backward {
        shape: (usize, usize, usize), // (N, IC, OC)
        seed: u64,
    }

    impl Case for Backward {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let ((n, ic, oc), s) = (self.shape, self.seed);
            let inp: Vec<S> = stored::<T, S>(&randn(n * ic, 1.0, s));
            let w: Vec<S> = stored::<T, S>(&randn(ic * oc, 0.5, s + 1));
            let dout: Vec<S> = stored::<T, S>(&randn(n * oc, 1.0, s + 2));
            let dw0: Vec<S> = stored::<T, S>(&randn(ic * oc, 1.0, s + 3));
            let mut db: Vec<S> = stored::<T, S>(&randn(oc, 1.0, s + 4));
            let mut ws = ws_for::<S>();
            let mut dinp = vec![S::from_f32(f32::NAN); n * ic];
            let mut dw = dw0.clone();
            let db_ = Some(&mut db[..]);
            let args = (&dout, &inp, &w);
            matmul_backward(
                &mut dinp,
                &mut dw,
                db_,
                args.0,
                args.1,
                args.2,
                Layout::InOut,
                n,
                ic,
                oc,
                &mut ws,
            );
            // Without a bias gradient: dinp overwritten again, dweight accumulated the same.
            let mut dinp2 = vec![S::from_f32(f32::NAN); n * ic];
            let mut dw2 = dw0;
            matmul_backward(
                &mut dinp2,
                &mut dw2,
                None,
                args.0,
                args.1,
                args.2,
                Layout::InOut,
                n,
                ic,
                oc,
                &mut ws,
            );
            vec![
                Out::stored("dinp", &dinp).close(tol::<T>(oc)),
                Out::stored("dweight", &dw).close(tol::<T>(n)),
                Out::stored("dbias", &db).close(tol::<T>(n)),
                Out::stored("dinp without dbias", &dinp2).close(tol::<T>(oc)),
                Out::stored("dweight without dbias", &dw2).close(tol::<T>(n)),
            ]
        }
    }

    #[test]
    fn backward_bf16_matches_f32_kernel() {
        for (si, &(n, ic, oc)) in MIXED_SHAPES.iter().enumerate() {
            let case = Backward {
                shape: (n, ic, oc),
                seed: 10 * si as u64,
            };
            let what = format!("bwd {n}x{ic}x{oc}");
            let (got, _) = check_stored_as::<bf16>(&case, &what);
            let bits = |o: &Out| o.f32s().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&got[3]) == bits(&got[0]) && bits(&got[4]) == bits(&got[1]),
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
            Layout::InOut,
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
        matmul_forward(
            &mut got,
            &inp,
            &w,
            Some(&bias),
            Layout::InOut,
            n,
            ic,
            oc,
            true,
            &mut ws,
        );
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
            Layout::InOut,
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
            matmul_forward(
                &mut out,
                &inp,
                &w,
                Some(&bias),
                Layout::InOut,
                n,
                ic,
                oc,
                false,
                &mut ws,
            );
            let mut dinp = vec![bf16::ZERO; n * ic];
            let (mut dw, mut db) = (vec![bf16::ZERO; ic * oc], vec![bf16::ZERO; oc]);
            matmul_backward(
                &mut dinp,
                &mut dw,
                Some(&mut db),
                &dout,
                &inp,
                &w,
                Layout::InOut,
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
