//! Layer normalisation over the channel dimension of `[N, C]` rows:
//! `out = (x - mean) * rstd * weight + bias`, `rstd = 1 / sqrt(var + eps)` (biased variance).
//!
//! Forward is parallel over rows; mean and variance are two-pass f32 sums in 16 lanes.
//! Backward runs two parallel passes with no workspace: one over rows for the input gradient
//! (which accumulates, `+=`, because the executor feeds the residual-stream gradient through
//! it) and one over fixed column slices for the weight/bias gradients, each slice walking all
//! rows in order, so every result is identical for any thread count.
//!
//! Storage type `T` ([`Elem`]: f32, bf16, f16) for activations and gradients, `W` for the
//! weights (the fp32 master weights under mixed precision);
//! `mean` and `rstd` stay f32. Elements are widened to f32 as they are read, all arithmetic
//! and accumulation is f32, and each stored element is rounded to `T` once per call (the
//! accumulating gradients as `T::from_f32(old + sum)`), so the result for any `T` is the
//! f32 kernel's result on the widened inputs, rounded to `T`.

use super::features::multiversion;
use super::reduce::{COL_CHUNK, rows_per_task, sum_f32, sum_sq_dev_f32};
use crate::dtype::Elem;
use rayon::prelude::*;

/// Layer-norm forward; also stores each row's mean and 1/std for the backward pass.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<T: Elem, W: Elem>(
    out: &mut [T],    // [N, C]
    mean: &mut [f32], // [N]
    rstd: &mut [f32], // [N]
    inp: &[T],        // [N, C]
    weight: &[W],     // [C]
    bias: &[W],       // [C]
    n: usize,
    c: usize,
    eps: f32,
) {
    assert_eq!(out.len(), n * c, "layernorm_forward: out");
    assert_eq!(mean.len(), n, "layernorm_forward: mean");
    assert_eq!(rstd.len(), n, "layernorm_forward: rstd");
    assert_eq!(inp.len(), n * c, "layernorm_forward: inp");
    assert_eq!(weight.len(), c, "layernorm_forward: weight");
    assert_eq!(bias.len(), c, "layernorm_forward: bias");
    if n == 0 || c == 0 {
        return;
    }
    let rows = rows_per_task(c);
    out.par_chunks_mut(rows * c)
        .zip(inp.par_chunks(rows * c))
        .zip(mean.par_chunks_mut(rows))
        .zip(rstd.par_chunks_mut(rows))
        .for_each(|(((out, inp), mean), rstd)| {
            forward_rows(out, inp, mean, rstd, weight, bias, c, eps)
        });
}

multiversion! {
    /// Forward over a few whole rows.
    fn forward_rows<T: Elem, W: Elem>(
        out: &mut [T],    // [rows, C]
        inp: &[T],        // [rows, C]
        mean: &mut [f32], // [rows]
        rstd: &mut [f32], // [rows]
        weight: &[W],     // [C]
        bias: &[W],       // [C]
        c: usize,
        eps: f32,
    ) {
        let it = out.chunks_exact_mut(c).zip(inp.chunks_exact(c));
        for (((o, x), m), rs) in it.zip(mean.iter_mut()).zip(rstd.iter_mut()) {
            let mu = sum_f32(x) / c as f32;
            let var = sum_sq_dev_f32(x, mu) / c as f32;
            let s = 1.0 / (var + eps).sqrt();
            for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(weight).zip(bias) {
                *o = T::from_f32((x.to_f32() - mu) * s * w.to_f32() + b.to_f32());
            }
            *m = mu;
            *rs = s;
        }
    }
}

/// Layer-norm backward. `dinp` ACCUMULATES (`+=`), as do `dweight` and `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Elem, W: Elem>(
    dinp: &mut [T],    // [N, C] +=
    dweight: &mut [T], // [C] +=
    dbias: &mut [T],   // [C] +=
    dout: &[T],        // [N, C]
    inp: &[T],         // [N, C]
    weight: &[W],      // [C]
    mean: &[f32],      // [N]
    rstd: &[f32],      // [N]
    n: usize,
    c: usize,
) {
    assert_eq!(dweight.len(), c, "layernorm_backward: dweight");
    assert_eq!(dbias.len(), c, "layernorm_backward: dbias");
    // Pass 1 (and the other operands' checks).
    layernorm_backward_input(dinp, dout, inp, weight, mean, rstd, n, c);
    if n == 0 || c == 0 {
        return;
    }
    // Pass 2, over fixed column slices: dweight += Σ_r norm·dout, dbias += Σ_r dout.
    dweight
        .par_chunks_mut(COL_CHUNK)
        .zip(dbias.par_chunks_mut(COL_CHUNK))
        .enumerate()
        .for_each(|(ci, (dw, db))| backward_cols(dw, db, dout, inp, mean, rstd, ci * COL_CHUNK, c));
}

/// The input gradient alone (a frozen layer norm's backward, whose weight and bias take no
/// gradient): `dinp` exactly as [`layernorm_backward`] computes it.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_input<T: Elem, W: Elem>(
    dinp: &mut [T], // [N, C] +=
    dout: &[T],     // [N, C]
    inp: &[T],      // [N, C]
    weight: &[W],   // [C]
    mean: &[f32],   // [N]
    rstd: &[f32],   // [N]
    n: usize,
    c: usize,
) {
    assert_eq!(dinp.len(), n * c, "layernorm_backward: dinp");
    assert_eq!(dout.len(), n * c, "layernorm_backward: dout");
    assert_eq!(inp.len(), n * c, "layernorm_backward: inp");
    assert_eq!(weight.len(), c, "layernorm_backward: weight");
    assert_eq!(
        (mean.len(), rstd.len()),
        (n, n),
        "layernorm_backward: mean, rstd"
    );
    if n == 0 || c == 0 {
        return;
    }
    // Pass 1, over rows: with norm = (x - mean)·rstd and g = weight·dout,
    // dinp += (g - mean(g) - norm·mean(g·norm))·rstd.
    let rows = rows_per_task(c);
    dinp.par_chunks_mut(rows * c)
        .zip(dout.par_chunks(rows * c))
        .zip(inp.par_chunks(rows * c))
        .zip(mean.par_chunks(rows).zip(rstd.par_chunks(rows)))
        .for_each(|(((dinp, dout), inp), (mean, rstd))| {
            backward_rows(dinp, dout, inp, mean, rstd, weight, c)
        });
}

multiversion! {
    /// Input gradient over a few whole rows.
    fn backward_rows<T: Elem, W: Elem>(
        dinp: &mut [T],   // [rows, C] +=
        dout: &[T],       // [rows, C]
        inp: &[T],        // [rows, C]
        mean: &[f32],     // [rows]
        rstd: &[f32],     // [rows]
        weight: &[W],     // [C]
        c: usize,
    ) {
        let it = dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c));
        for (((di, dy), x), (&mu, &s)) in it.zip(mean.iter().zip(rstd)) {
            let (sum_g, sum_gn) = row_sums(dy, x, weight, mu, s);
            let mean_g = sum_g / c as f32;
            let mean_gn = sum_gn / c as f32;
            for (((d, &dy), &x), &w) in di.iter_mut().zip(dy).zip(x).zip(weight) {
                let norm = (x.to_f32() - mu) * s;
                let g = w.to_f32() * dy.to_f32();
                *d = T::from_f32(d.to_f32() + (g - mean_g - norm * mean_gn) * s);
            }
        }
    }
}

multiversion! {
    /// Weight and bias gradients of the columns `c0..c0 + dw.len()`, walking all rows in order.
    fn backward_cols<T: Elem>(
        dw: &mut [T],   // [w <= COL_CHUNK] +=: columns c0..c0 + w
        db: &mut [T],   // [w] +=
        dout: &[T],     // [N, C]
        inp: &[T],      // [N, C]
        mean: &[f32],   // [N]
        rstd: &[f32],   // [N]
        c0: usize,
        c: usize,
    ) {
        let w = dw.len();
        let mut acc_w = [0.0f32; COL_CHUNK];
        let mut acc_b = [0.0f32; COL_CHUNK];
        let (acc_w, acc_b) = (&mut acc_w[..w], &mut acc_b[..w]);
        let rows = dout.chunks_exact(c).zip(inp.chunks_exact(c));
        for ((dy, x), (&mu, &s)) in rows.zip(mean.iter().zip(rstd)) {
            let (dy, x) = (&dy[c0..c0 + w], &x[c0..c0 + w]);
            for (((aw, ab), &dy), &x) in acc_w.iter_mut().zip(acc_b.iter_mut()).zip(dy).zip(x) {
                let dy = dy.to_f32();
                *aw += (x.to_f32() - mu) * s * dy;
                *ab += dy;
            }
        }
        for (d, &a) in dw.iter_mut().zip(acc_w.iter()) {
            *d = T::from_f32(d.to_f32() + a);
        }
        for (d, &a) in db.iter_mut().zip(acc_b.iter()) {
            *d = T::from_f32(d.to_f32() + a);
        }
    }
}

/// (Σ w·dy, Σ w·dy·norm) over one row, 16 f32 lanes each.
#[inline(always)]
fn row_sums<T: Elem, W: Elem>(
    dy: &[T], // [C]
    x: &[T],  // [C]
    w: &[W],  // [C]
    mu: f32,
    s: f32,
) -> (f32, f32) {
    const L: usize = 16;
    let mut ag = [0.0f32; L];
    let mut agn = [0.0f32; L];
    #[inline(always)]
    fn lanes<T: Elem, W: Elem>(
        ag: &mut [f32],  // [L]
        agn: &mut [f32], // [L]
        dy: &[T],        // [<= L]
        x: &[T],         // [<= L]
        w: &[W],         // [<= L]
        mu: f32,
        s: f32,
    ) {
        let it = ag.iter_mut().zip(agn.iter_mut()).zip(dy).zip(x).zip(w);
        for ((((a, an), &dy), &x), &w) in it {
            let g = w.to_f32() * dy.to_f32();
            *a += g;
            *an += g * ((x.to_f32() - mu) * s);
        }
    }
    let mut it = dy
        .chunks_exact(L)
        .zip(x.chunks_exact(L))
        .zip(w.chunks_exact(L));
    for ((dy, x), w) in &mut it {
        lanes(&mut ag, &mut agn, dy, x, w, mu, s);
    }
    let tail = dy.len() - dy.len() % L;
    lanes(
        &mut ag,
        &mut agn,
        &dy[tail..],
        &x[tail..],
        &w[tail..],
        mu,
        s,
    );
    (sum_f32(&ag), sum_f32(&agn))
}

/// Reference twins: per-row loops in f64.
pub mod naive {
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward(
        out: &mut [f32],  // [N, C]
        mean: &mut [f32], // [N]
        rstd: &mut [f32], // [N]
        inp: &[f32],      // [N, C]
        weight: &[f32],   // [C]
        bias: &[f32],     // [C]
        n: usize,
        c: usize,
        eps: f32,
    ) {
        for r in 0..n {
            let x = &inp[r * c..(r + 1) * c];
            let mu = x.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var = x.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / c as f64;
            let s = 1.0 / (var + eps as f64).sqrt();
            for i in 0..c {
                out[r * c + i] =
                    ((x[i] as f64 - mu) * s * weight[i] as f64 + bias[i] as f64) as f32;
            }
            mean[r] = mu as f32;
            rstd[r] = s as f32;
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        dinp: &mut [f32],    // [N, C] +=
        dweight: &mut [f32], // [C] +=
        dbias: &mut [f32],   // [C] +=
        dout: &[f32],        // [N, C]
        inp: &[f32],         // [N, C]
        weight: &[f32],      // [C]
        mean: &[f32],        // [N]
        rstd: &[f32],        // [N]
        n: usize,
        c: usize,
    ) {
        for r in 0..n {
            let (mu, s) = (mean[r] as f64, rstd[r] as f64);
            let norm = |i: usize| (inp[r * c + i] as f64 - mu) * s;
            let g = |i: usize| weight[i] as f64 * dout[r * c + i] as f64;
            let mean_g = (0..c).map(g).sum::<f64>() / c as f64;
            let mean_gn = (0..c).map(|i| g(i) * norm(i)).sum::<f64>() / c as f64;
            for i in 0..c {
                let d = (g(i) - mean_g - norm(i) * mean_gn) * s;
                dinp[r * c + i] = (dinp[r * c + i] as f64 + d) as f32;
            }
        }
        for i in 0..c {
            let (mut sw, mut sb) = (dweight[i] as f64, dbias[i] as f64);
            for r in 0..n {
                let norm = (inp[r * c + i] as f64 - mean[r] as f64) * rstd[r] as f64;
                sw += norm * dout[r * c + i] as f64;
                sb += dout[r * c + i] as f64;
            }
            dweight[i] = sw as f32;
            dbias[i] = sb as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::conformance::{Case, Out, check_stored_as, stored};
    use super::super::reduce::testutil::*;
    use super::*;
    use half::{bf16, f16};

    const SHAPES: [(usize, usize); 8] = [
        (1, 1),
        (1, 7),
        (3, 16),
        (5, 17),
        (2, 64),
        (13, 100),
        (40, 768),
        (300, 33),
    ];

    fn data(n: usize, c: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        // Offset mean so a one-pass variance would lose precision.
        let inp: Vec<f32> = randn(n * c, 2.0, seed).iter().map(|v| v + 30.0).collect();
        let w: Vec<f32> = randn(c, 0.5, seed + 1).iter().map(|v| v + 1.0).collect();
        let b = randn(c, 0.5, seed + 2);
        (inp, w, b)
    }

    #[test]
    fn forward_matches_naive() {
        for (si, &(n, c)) in SHAPES.iter().enumerate() {
            let (inp, w, b) = data(n, c, si as u64 * 10);
            let (mut o1, mut m1, mut r1) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            let (mut o2, mut m2, mut r2) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            layernorm_forward(&mut o1, &mut m1, &mut r1, &inp, &w, &b, n, c, 1e-5);
            naive::layernorm_forward(&mut o2, &mut m2, &mut r2, &inp, &w, &b, n, c, 1e-5);
            let what = format!("{n}x{c}");
            assert_close(&o1, &o2, 2e-5, 2e-5, &format!("out {what}"));
            assert_close(&m1, &m2, 1e-5, 1e-6, &format!("mean {what}"));
            assert_close(&r1, &r2, 0.0, 1e-5, &format!("rstd {what}"));
        }
    }

    #[test]
    fn backward_matches_naive_and_accumulates() {
        for (si, &(n, c)) in SHAPES.iter().enumerate() {
            let (inp, w, b) = data(n, c, si as u64 * 10);
            let (mut o, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            naive::layernorm_forward(&mut o, &mut m, &mut r, &inp, &w, &b, n, c, 1e-5);
            let dout = randn(n * c, 1.0, 77 + si as u64);
            let di0 = randn(n * c, 1.0, 78 + si as u64);
            let dw0 = randn(c, 1.0, 79 + si as u64);
            let db0 = randn(c, 1.0, 80 + si as u64);
            let (mut di1, mut dw1, mut db1) = (di0.clone(), dw0.clone(), db0.clone());
            let (mut di2, mut dw2, mut db2) = (di0.clone(), dw0.clone(), db0.clone());
            layernorm_backward(&mut di1, &mut dw1, &mut db1, &dout, &inp, &w, &m, &r, n, c);
            naive::layernorm_backward(&mut di2, &mut dw2, &mut db2, &dout, &inp, &w, &m, &r, n, c);
            let what = format!("{n}x{c}");
            assert_close(&di1, &di2, 1e-4, 1e-4, &format!("dinp {what}"));
            let tol = 2e-5 * (n as f32).sqrt();
            assert_close(&dw1, &dw2, tol, 1e-5, &format!("dweight {what}"));
            assert_close(&db1, &db2, tol, 1e-5, &format!("dbias {what}"));
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, c) = (3, 6);
        let inp = randn(n * c, 1.0, 5);
        let w = randn(c, 1.0, 6);
        let b = randn(c, 1.0, 7);
        let g = randn(n * c, 1.0, 8);
        let loss = |inp: &[f32], w: &[f32], b: &[f32]| {
            let (mut o, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            naive::layernorm_forward(&mut o, &mut m, &mut r, inp, w, b, n, c, 1e-5);
            dot(&g, &o)
        };
        let (mut o, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut o, &mut m, &mut r, &inp, &w, &b, n, c, 1e-5);
        let (mut di, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
        layernorm_backward(&mut di, &mut dw, &mut db, &g, &inp, &w, &m, &r, n, c);
        let h = 1e-3;
        assert_close(
            &di,
            &fd_grad(&inp, h, |x| loss(x, &w, &b)),
            2e-3,
            2e-3,
            "dinp vs fd",
        );
        assert_close(
            &dw,
            &fd_grad(&w, h, |x| loss(&inp, x, &b)),
            2e-3,
            2e-3,
            "dw vs fd",
        );
        assert_close(
            &db,
            &fd_grad(&b, h, |x| loss(&inp, &w, x)),
            2e-3,
            2e-3,
            "db vs fd",
        );
    }

    #[test]
    fn identical_for_any_thread_count() {
        let (n, c) = (97, 300);
        let (inp, w, b) = data(n, c, 3);
        let dout = randn(n * c, 1.0, 4);
        let run = || {
            let (mut o, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            layernorm_forward(&mut o, &mut m, &mut r, &inp, &w, &b, n, c, 1e-5);
            let (mut di, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
            layernorm_backward(&mut di, &mut dw, &mut db, &dout, &inp, &w, &m, &r, n, c);
            (o, m, r, di, dw, db)
        };
        let a = with_threads(1, run);
        assert!(a == with_threads(2, run) && a == with_threads(3, run));
    }

    /// One shape of [`SHAPES`]: forward and backward stored as bf16 / f16 are the f32 kernel
    /// on the widened inputs, each stored element rounded once (mean and rstd bitwise equal),
    /// for 1 and 3 threads.
    struct Narrow(usize);

    impl Case for Narrow {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let si = self.0;
            let (n, c) = SHAPES[si];
            let (inp, w, b) = data(n, c, si as u64 * 10);
            let (inp, w, b): (Vec<S>, Vec<S>, Vec<S>) =
                (stored::<T, S>(&inp), stored::<T, S>(&w), stored::<T, S>(&b));
            let dout: Vec<S> = stored::<T, S>(&randn(n * c, 1.0, 77 + si as u64));
            let mut di: Vec<S> = stored::<T, S>(&randn(n * c, 1.0, 78 + si as u64));
            let mut dw: Vec<S> = stored::<T, S>(&randn(c, 1.0, 79 + si as u64));
            let mut db: Vec<S> = stored::<T, S>(&randn(c, 1.0, 80 + si as u64));
            let nan = S::from_f32(f32::NAN);
            let (mut o, mut m, mut r) = (vec![nan; n * c], vec![0.0; n], vec![0.0; n]);
            layernorm_forward(&mut o, &mut m, &mut r, &inp, &w, &b, n, c, 1e-5);
            layernorm_backward(&mut di, &mut dw, &mut db, &dout, &inp, &w, &m, &r, n, c);
            vec![
                Out::stored("out", &o),
                Out::f32("mean", &m),
                Out::f32("rstd", &r),
                Out::stored("dinp", &di),
                Out::stored("dweight", &dw),
                Out::stored("dbias", &db),
            ]
        }
    }

    #[test]
    fn bf16_is_f32_rounded() {
        for (si, &(n, c)) in SHAPES.iter().enumerate() {
            check_stored_as::<bf16>(&Narrow(si), &format!("layernorm {n}x{c}"));
        }
    }

    #[test]
    fn f16_is_f32_rounded() {
        for (si, &(n, c)) in SHAPES.iter().enumerate() {
            check_stored_as::<f16>(&Narrow(si), &format!("layernorm {n}x{c}"));
        }
    }

    /// A non-finite input poisons its row (forward, dinp) and its column sums (dweight,
    /// dbias) and nothing else; no panic.
    #[test]
    fn non_finite_stays_local() {
        let (n, c) = (4, 70);
        let (inp, w, b) = data(n, c, 9);
        let (mut inp, w, b): (Vec<bf16>, Vec<bf16>, Vec<bf16>) =
            (narrow_vec(&inp), narrow_vec(&w), narrow_vec(&b));
        inp[2 * c + 5] = bf16::NAN;
        let (mut o, mut m, mut r) = (vec![bf16::ZERO; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut o, &mut m, &mut r, &inp, &w, &b, n, c, 1e-5);
        let row_bad = |x: &[bf16], i: usize| x[i * c..(i + 1) * c].iter().all(|v| v.is_nan());
        let row_ok = |x: &[bf16], i: usize| x[i * c..(i + 1) * c].iter().all(|v| v.is_finite());
        assert!(row_bad(&o, 2) && row_ok(&o, 0) && row_ok(&o, 1) && row_ok(&o, 3));
        let mut dout: Vec<bf16> = narrow_vec(&randn(n * c, 1.0, 1));
        dout[c + 3] = bf16::INFINITY;
        let (mut di, mut dw, mut db) = (
            vec![bf16::ZERO; n * c],
            vec![bf16::ZERO; c],
            vec![bf16::ZERO; c],
        );
        layernorm_backward(&mut di, &mut dw, &mut db, &dout, &inp, &w, &m, &r, n, c);
        assert!(row_ok(&di, 0) && row_ok(&di, 3) && !row_ok(&di, 1) && !row_ok(&di, 2));
        assert!(
            dw.iter().all(|v| v.is_nan()),
            "row 2 is NaN: every dweight column"
        );
        assert!(!db[3].is_finite() && db.iter().filter(|v| v.is_finite()).count() == c - 1);
    }
}
