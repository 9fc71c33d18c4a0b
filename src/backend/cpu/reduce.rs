//! Whole-buffer reductions (the gradient-norm sum of squares), plus the small vectorisable
//! building blocks the other CPU kernels share: a branch-free `exp_f32`, lane-split sums and
//! maxima, and the fixed task sizes that make every kernel's work partitioning independent of
//! the thread count.
//!
//! `sum_squares` and the lane sums `sum_f32`, `sum_sq_dev_f32` are generic over the storage
//! type ([`Elem`]); elements are widened exactly to f32, so the f32 instantiation is the f32
//! kernel and the others see the stored values exactly.
//!
//! Determinism: `sum_squares` sums fixed `ELEM_CHUNK`-sized chunks and combines them along a
//! binary tree whose shape depends only on the length, so its result is identical for any
//! thread count.
//!
//! Vector width: the hot loops here, as in every CPU kernel, are wrapped in `multiversion!`
//! (see [`super::features`]), which compiles them for AVX2+FMA and AVX-512 too and picks one
//! at run time; every variant gives bit-identical results (a test here checks this for all
//! the kernels).

use super::features::multiversion;
use crate::dtype::Elem;

/// Elements per parallel task of the elementwise kernels (128 KiB of f32). A constant, not a
/// function of the thread count, so partitioning never depends on the pool size.
pub const ELEM_CHUNK: usize = 1 << 15;

/// Rows per parallel task for a row-wise kernel whose rows hold `row_len` elements: about
/// 8 Ki elements per task, at least one row. Depends only on the shape.
#[inline]
pub fn rows_per_task(row_len: usize) -> usize {
    (8192 / row_len.max(1)).max(1)
}

/// Column-slice width for kernels that reduce over rows (bias and norm-weight gradients):
/// each task owns `COL_CHUNK` columns and walks all rows in order.
pub const COL_CHUNK: usize = 64;

/// Branch-free `e^x` for f32 (Cephes polynomial, ~2 ulp) that inlines and auto-vectorises,
/// unlike `f32::exp`, which is a libm call. Below -87.3 it returns exactly 0 (never a
/// denormal, which would slow later arithmetic); above 88 it saturates at e^88 ≈ 1.65e38
/// (never infinity, so `e·σ`-style products stay finite); NaN propagates.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to the nearest integer
    // Comparisons (not f32::max/min) so that NaN passes through.
    let underflow = x < -87.3;
    let x = if underflow { -87.3 } else { x };
    let x = if x > 88.0 { 88.0 } else { x };
    let t = x * LOG2E + MAGIC;
    let k = t - MAGIC; // round(x / ln 2)
    let ki = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = x - k * LN2_HI - k * LN2_LO; // |r| <= ~ln2/2
    let z = r * r;
    let p = (((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * z
        + r
        + 1.0;
    let scale = f32::from_bits((ki.wrapping_add(127) as u32) << 23); // 2^k, k in [-126, 127]
    let e = p * scale; // >= 2^-126 for x >= -87.3: normal
    if underflow { 0.0 } else { e }
}

/// Sum of `x` in f32 with 16 independent lanes (vectorises; fixed order, so deterministic).
/// Elements of any storage type are widened to f32 first.
#[inline(always)]
pub fn sum_f32<T: Elem>(x: &[T] /* [len] */) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut it = x.chunks_exact(16);
    for ch in &mut it {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a += v.to_f32();
        }
    }
    for (a, &v) in acc.iter_mut().zip(it.remainder()) {
        *a += v.to_f32();
    }
    combine16(acc)
}

/// Sum of squared deviations `Σ (x - mean)²` in f32 with 16 lanes (elements widened to f32).
#[inline(always)]
pub fn sum_sq_dev_f32<T: Elem>(
    x: &[T], // [len]
    mean: f32,
) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut it = x.chunks_exact(16);
    for ch in &mut it {
        for (a, &v) in acc.iter_mut().zip(ch) {
            let d = v.to_f32() - mean;
            *a += d * d;
        }
    }
    for (a, &v) in acc.iter_mut().zip(it.remainder()) {
        let d = v.to_f32() - mean;
        *a += d * d;
    }
    combine16(acc)
}

/// Maximum of `x` with 16 lanes (NaN elements are skipped, as by `f32::max`; -inf if empty).
#[inline(always)]
pub fn max_f32(x: &[f32] /* [len] */) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut it = x.chunks_exact(16);
    for ch in &mut it {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a = a.max(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(it.remainder()) {
        *a = a.max(v);
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// Pairwise sum of 16 lanes in a fixed order.
#[inline(always)]
fn combine16(a: [f32; 16]) -> f32 {
    let mut h = [0.0f32; 8];
    for (i, v) in h.iter_mut().enumerate() {
        *v = a[i] + a[i + 8];
    }
    let q = [h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

multiversion! {
    /// Serial sum of squares of one chunk, f64 lanes.
    fn sum_squares_serial<T: Elem>(
        x: &[T], // [len]
    ) -> f64 {
        let mut acc = [0.0f64; 8];
        let mut it = x.chunks_exact(8);
        for ch in &mut it {
            for (a, &v) in acc.iter_mut().zip(ch) {
                let v = v.to_f32() as f64;
                *a += v * v;
            }
        }
        for (a, &v) in acc.iter_mut().zip(it.remainder()) {
            let v = v.to_f32() as f64;
            *a += v * v;
        }
        ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
    }
}

/// Sum of squares of all elements, accumulated in f64, deterministic (fixed chunks summed in
/// order), parallel. The chunks are combined along a binary tree that depends only on
/// `x.len()`, so the result is bit-identical for any thread count. Elements of any storage
/// type (the gradients, for the global norm) are widened exactly, so the result depends only
/// on the stored values.
pub fn sum_squares<T: Elem>(x: &[T] /* [len] */) -> f64 {
    if x.len() <= ELEM_CHUNK {
        return sum_squares_serial(x);
    }
    let chunks = x.len().div_ceil(ELEM_CHUNK);
    let (a, b) = x.split_at((chunks / 2) * ELEM_CHUNK);
    let (sa, sb) = rayon::join(|| sum_squares(a), || sum_squares(b));
    sa + sb
}

/// Reference twins: plain loops, f64 accumulation.
pub mod naive {
    use super::Elem;

    pub fn sum_squares<T: Elem>(x: &[T] /* [len] */) -> f64 {
        x.iter()
            .map(|&v| (v.to_f32() as f64) * (v.to_f32() as f64))
            .sum()
    }
}

/// Helpers shared by the CPU kernel tests.
#[cfg(test)]
pub(crate) mod testutil {
    use super::Elem;
    use crate::util::rng::Rng;

    /// `x` rounded to `T` (round to nearest even).
    pub fn narrow_vec<T: Elem>(x: &[f32]) -> Vec<T> {
        x.iter().map(|&v| T::from_f32(v)).collect()
    }

    /// `x` widened to f32 (exact).
    pub fn widen_vec<T: Elem>(x: &[T]) -> Vec<f32> {
        x.iter().map(|&v| v.to_f32()).collect()
    }

    /// Bit patterns of the widened values: equal iff the stored values are identical
    /// (NaN payloads and signed zeros included).
    pub fn bits<T: Elem>(x: &[T]) -> Vec<u32> {
        x.iter().map(|&v| v.to_f32().to_bits()).collect()
    }

    /// `n` standard-normal values times `scale`.
    pub fn randn(n: usize, scale: f32, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed);
        (0..n).map(|_| r.normal() * scale).collect()
    }

    /// Asserts |a - b| <= atol + rtol·|b| elementwise.
    #[track_caller]
    pub fn assert_close(a: &[f32], b: &[f32], atol: f32, rtol: f32, what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            let ok = (x - y).abs() <= atol + rtol * y.abs();
            assert!(ok, "{what}[{i}]: {x} vs {y} (diff {})", (x - y).abs());
        }
    }

    /// Central finite-difference gradient of `f` at `x` with step `h`.
    pub fn fd_grad(x: &[f32], h: f32, f: impl Fn(&[f32]) -> f64) -> Vec<f32> {
        let mut w = x.to_vec();
        (0..x.len())
            .map(|i| {
                w[i] = x[i] + h;
                let fp = f(&w);
                w[i] = x[i] - h;
                let fm = f(&w);
                w[i] = x[i];
                // The step actually taken, after rounding to f32.
                let dh = (x[i] + h) as f64 - (x[i] - h) as f64;
                ((fp - fm) / dh) as f32
            })
            .collect()
    }

    /// Σ g·y in f64 (a random linear "loss" to differentiate through).
    pub fn dot(g: &[f32], y: &[f32]) -> f64 {
        g.iter().zip(y).map(|(&a, &b)| a as f64 * b as f64).sum()
    }

    /// Runs `f` on a private rayon pool with `threads` threads.
    pub fn with_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }
}

#[cfg(test)]
mod tests {
    use super::super::conformance::{Case, Out, check_stored_as, isa_invariant, isas_here, stored};
    use super::super::features::{Isa, detected_isa, isa};
    use super::testutil::*;
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let mut worst = 0.0f64;
        let mut x = -87.3f32;
        while x <= 88.0 {
            let got = exp_f32(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 4e-7, "exp_f32 worst relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(-87.31), 0.0);
        assert_eq!(exp_f32(-1000.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(-87.29).is_normal());
        assert!(exp_f32(1000.0).is_finite() && exp_f32(1000.0) > 1e38);
        assert!(exp_f32(f32::INFINITY).is_finite());
    }

    #[test]
    fn lane_helpers_match_naive() {
        for n in [0usize, 1, 5, 15, 16, 17, 33, 100, 1001] {
            let x = randn(n, 3.0, n as u64);
            let s: f64 = x.iter().map(|&v| v as f64).sum();
            assert!(
                (sum_f32(&x) as f64 - s).abs() < 1e-4 * (1.0 + n as f64),
                "sum n={n}"
            );
            let mean = (s / n.max(1) as f64) as f32;
            let d: f64 = x.iter().map(|&v| ((v - mean) as f64).powi(2)).sum();
            assert!(
                (sum_sq_dev_f32(&x, mean) as f64 - d).abs() < 1e-5 * (1.0 + d),
                "dev n={n}"
            );
            let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            assert_eq!(max_f32(&x), m, "max n={n}");
        }
    }

    #[test]
    fn sum_squares_matches_and_is_thread_invariant() {
        for n in [
            0usize,
            1,
            7,
            ELEM_CHUNK - 1,
            ELEM_CHUNK,
            3 * ELEM_CHUNK + 5,
            300_001,
        ] {
            let x = randn(n, 1.5, 11 + n as u64);
            let want = naive::sum_squares(&x);
            let got1 = with_threads(1, || sum_squares(&x));
            let got2 = with_threads(2, || sum_squares(&x));
            let got3 = with_threads(3, || sum_squares(&x));
            assert!(
                (got1 - want).abs() <= 1e-12 * want.max(1.0),
                "n={n}: {got1} vs {want}"
            );
            assert_eq!(got1.to_bits(), got2.to_bits(), "n={n}");
            assert_eq!(got1.to_bits(), got3.to_bits(), "n={n}");
        }
    }

    /// The outputs (as bit patterns) of every multiversioned kernel on fixed inputs.
    fn all_kernels() -> Vec<Vec<u32>> {
        use super::super::{adamw, gelu, layernorm, matmul, xent};
        let run = || {
            let (n, c, v) = (37, 203, 1001);
            let x = randn(n * c, 2.0, 1);
            let w = randn(c, 1.0, 2);
            let b = randn(c, 1.0, 3);
            let mut o = vec![0.0; n * c];
            gelu::gelu_forward(&mut o, &x);
            let mut d = randn(n * c, 1.0, 4);
            gelu::gelu_backward_inplace(&mut d, &x);
            let (mut ln, mut mu, mut rs) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            layernorm::layernorm_forward(&mut ln, &mut mu, &mut rs, &x, &w, &b, n, c, 1e-5);
            let (mut di, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
            layernorm::layernorm_backward(&mut di, &mut dw, &mut db, &d, &x, &w, &mu, &rs, n, c);
            let mut lg = randn(n * v, 3.0, 5);
            let tg: Vec<u32> = (0..n as u32).map(|i| i * 17 % v as u32).collect();
            let mut l1 = vec![0.0; n];
            xent::softmax_xent_forward(&lg, &tg, &mut l1, n, v);
            let mut l2 = vec![0.0; n];
            xent::softmax_xent_backward_inplace(&mut lg, &tg, &mut l2, 0.25, n, v);
            let mut pr = vec![0.0; v];
            xent::softmax_row(&mut pr, &lg[..v], 0.7);
            let (mut p, mut m, mut vv) = (x.clone(), vec![0.0; n * c], vec![0.0; n * c]);
            let hp = adamw::AdamWStep {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                step: 2,
                grad_scale: 0.5,
            };
            adamw::adamw_update(&mut p, &d, &mut m, &mut vv, &hp);
            let mut dbias = vec![0.0; c];
            let mut dinp = vec![0.0; n];
            let mut dwt = vec![0.0; c];
            let ones = vec![1.0; c];
            matmul::matmul_backward(
                &mut dinp,
                &mut dwt,
                Some(&mut dbias),
                &d,
                &x[..n],
                &ones,
                matmul::Layout::InOut,
                n,
                1,
                c,
                &mut [],
            );
            let ss = vec![sum_squares(&x) as f32];
            // bf16 instantiations of the generic kernels.
            let xb: Vec<half::bf16> = narrow_vec(&x);
            let (wb, bb): (Vec<half::bf16>, Vec<half::bf16>) = (narrow_vec(&w), narrow_vec(&b));
            let mut ob = xb.clone();
            gelu::gelu_forward(&mut ob, &xb);
            let mut db16: Vec<half::bf16> = narrow_vec(&randn(n * c, 1.0, 4));
            gelu::gelu_backward_inplace(&mut db16, &xb);
            let (mut lnb, mut mub, mut rsb) = (xb.clone(), vec![0.0; n], vec![0.0; n]);
            layernorm::layernorm_forward(&mut lnb, &mut mub, &mut rsb, &xb, &wb, &bb, n, c, 1e-5);
            let (mut dib, mut dwb, mut dbb) = (xb.clone(), wb.clone(), bb.clone());
            let (dib_, dwb_, dbb_) = (&mut dib, &mut dwb, &mut dbb);
            layernorm::layernorm_backward(dib_, dwb_, dbb_, &db16, &xb, &wb, &mub, &rsb, n, c);
            let (mut pb, mut mb, mut vb) = (x.clone(), vec![0.0; n * c], vec![0.0; n * c]);
            adamw::adamw_update(&mut pb, &db16, &mut mb, &mut vb, &hp);
            let ssb = vec![sum_squares(&db16) as f32];
            let w16 = |v: &[half::bf16]| widen_vec(v);
            [
                o,
                d,
                ln,
                mu,
                rs,
                di,
                dw,
                db,
                l1,
                l2,
                lg,
                pr,
                p,
                m,
                vv,
                dbias,
                ss,
                w16(&ob),
                w16(&db16),
                w16(&lnb),
                mub,
                rsb,
                w16(&dib),
                w16(&dwb),
                w16(&dbb),
                pb,
                mb,
                vb,
                ssb,
            ]
        };
        run()
            .iter()
            .map(|v| v.iter().map(|x| x.to_bits()).collect())
            .collect()
    }

    /// Every multiversioned kernel gives bit-identical results on every instruction set this
    /// CPU has (this also runs the baseline and AVX2 code paths, which the other tests may not
    /// reach).
    #[test]
    fn all_isas_bit_identical() {
        isa_invariant(&isas_here(), all_kernels, "all kernels");
        // And the dispatch never claims more than the CPU has.
        assert!(isa() <= detected_isa());
    }

    /// The AVX-512 variants against the baseline (fails on a CPU without AVX-512F).
    #[test]
    #[ignore = "needs AVX-512F"]
    fn all_isas_bit_identical_avx512() {
        isa_invariant(&[Isa::Avx512], all_kernels, "all kernels");
    }

    /// `sum_squares` of `len` values (times 100): stored as bf16 / f16 it sees exactly the
    /// widened values (bitwise the f32 result), for any thread count.
    struct Narrow(usize);

    impl Case for Narrow {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let n = self.0;
            let x: Vec<S> = stored::<T, S>(&randn(n, 100.0, 7 + n as u64));
            vec![Out::f64("sum_squares", &[sum_squares(&x)])]
        }
    }

    #[test]
    fn sum_squares_of_narrow_types() {
        fn check<T: Elem>() {
            for n in [0usize, 5, ELEM_CHUNK + 1, 3 * ELEM_CHUNK + 5] {
                let (_, want) = check_stored_as::<T>(&Narrow(n), &format!("sum_squares n={n}"));
                let want = want[0].f64s();
                let x: Vec<T> = narrow_vec(&randn(n, 100.0, 7 + n as u64));
                let got = sum_squares(&x);
                assert_eq!(got.to_bits(), want[0].to_bits(), "{} n={n}", T::NAME);
                assert!((got - naive::sum_squares(&x)).abs() <= 1e-12 * want[0].max(1.0));
            }
            let mut x: Vec<T> = narrow_vec(&randn(100_000, 1.0, 3));
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                x[77_777] = T::from_f32(bad);
                assert!(!sum_squares(&x).is_finite(), "{} {bad}", T::NAME);
            }
        }
        check::<half::bf16>();
        check::<half::f16>();
    }
}
