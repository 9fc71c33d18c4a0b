//! Whole-buffer reductions and elementwise passes (gradient-norm sum of squares, gradient
//! scaling, residual add, finiteness check), plus the small vectorisable building blocks the
//! other CPU kernels share: a branch-free `exp_f32`, lane-split sums and maxima, and the fixed
//! task sizes that make every kernel's work partitioning independent of the thread count.
//!
//! Determinism: elementwise passes give each element the same arithmetic whatever the split;
//! `sum_squares` sums fixed `ELEM_CHUNK`-sized chunks and combines them along a binary tree
//! whose shape depends only on the length, so its result is identical for any thread count.

use rayon::prelude::*;

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
/// unlike `f32::exp`, which is a libm call. Inputs are clamped to [-87, 88], so it never
/// returns 0 or infinity (e^-87 ≈ 1.6e-38, e^88 ≈ 1.7e38); NaN propagates.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to the nearest integer
    // Comparisons (not f32::max/min) so that NaN passes through.
    let x = if x < -87.0 { -87.0 } else { x };
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
        + 5.000_000_1e-1)
        * z
        + r
        + 1.0;
    let scale = f32::from_bits((ki.wrapping_add(127) as u32) << 23); // 2^k, k in [-126, 127]
    p * scale
}

/// Sum of `x` in f32 with 16 independent lanes (vectorises; fixed order, so deterministic).
#[inline]
pub fn sum_f32(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut it = x.chunks_exact(16);
    for ch in &mut it {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a += v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(it.remainder()) {
        *a += v;
    }
    combine16(acc)
}

/// Sum of squared deviations `Σ (x - mean)²` in f32 with 16 lanes.
#[inline]
pub fn sum_sq_dev_f32(x: &[f32], mean: f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut it = x.chunks_exact(16);
    for ch in &mut it {
        for (a, &v) in acc.iter_mut().zip(ch) {
            let d = v - mean;
            *a += d * d;
        }
    }
    for (a, &v) in acc.iter_mut().zip(it.remainder()) {
        let d = v - mean;
        *a += d * d;
    }
    combine16(acc)
}

/// Maximum of `x` with 16 lanes (NaN elements are skipped, as by `f32::max`; -inf if empty).
#[inline]
pub fn max_f32(x: &[f32]) -> f32 {
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

/// Serial sum of squares of one chunk, f64 lanes.
fn sum_squares_serial(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut it = x.chunks_exact(8);
    for ch in &mut it {
        for (a, &v) in acc.iter_mut().zip(ch) {
            let v = v as f64;
            *a += v * v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(it.remainder()) {
        let v = v as f64;
        *a += v * v;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Sum of squares of all elements, accumulated in f64, deterministic (fixed chunks summed in
/// order), parallel. The chunks are combined along a binary tree that depends only on
/// `x.len()`, so the result is bit-identical for any thread count.
pub fn sum_squares(x: &[f32], // [len]
) -> f64 {
    if x.len() <= ELEM_CHUNK {
        return sum_squares_serial(x);
    }
    let chunks = x.len().div_ceil(ELEM_CHUNK);
    let (a, b) = x.split_at((chunks / 2) * ELEM_CHUNK);
    let (sa, sb) = rayon::join(|| sum_squares(a), || sum_squares(b));
    sa + sb
}

/// x *= s, parallel.
pub fn scale_inplace(
    x: &mut [f32], // [len]
    s: f32,
) {
    x.par_chunks_mut(ELEM_CHUNK).for_each(|ch| {
        for v in ch {
            *v *= s;
        }
    });
}

/// out = a + b elementwise, parallel (residual add).
pub fn add(
    out: &mut [f32], // [len]
    a: &[f32],       // [len]
    b: &[f32],       // [len]
) {
    assert_eq!(out.len(), a.len(), "add: out/a length");
    assert_eq!(out.len(), b.len(), "add: out/b length");
    out.par_chunks_mut(ELEM_CHUNK)
        .zip(a.par_chunks(ELEM_CHUNK))
        .zip(b.par_chunks(ELEM_CHUNK))
        .for_each(|((o, a), b)| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
}

/// true when every element is finite.
pub fn all_finite(x: &[f32], // [len]
) -> bool {
    x.par_chunks(ELEM_CHUNK)
        .all(|ch| ch.iter().fold(true, |ok, v| ok & v.is_finite()))
}

/// Reference twins: plain loops, f64 accumulation.
pub mod naive {
    pub fn sum_squares(x: &[f32]) -> f64 {
        x.iter().map(|&v| (v as f64) * (v as f64)).sum()
    }

    pub fn scale_inplace(x: &mut [f32], s: f32) {
        for v in x {
            *v *= s;
        }
    }

    pub fn add(out: &mut [f32], a: &[f32], b: &[f32]) {
        for i in 0..out.len() {
            out[i] = a[i] + b[i];
        }
    }

    pub fn all_finite(x: &[f32]) -> bool {
        x.iter().all(|v| v.is_finite())
    }
}

/// Helpers shared by the CPU kernel tests.
#[cfg(test)]
pub(crate) mod testutil {
    use crate::util::rng::Rng;

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
    use super::testutil::*;
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let got = exp_f32(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 4e-7, "exp_f32 worst relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(-1000.0) > 0.0 && exp_f32(-1000.0) < 2e-38);
        assert!(exp_f32(1000.0).is_finite() && exp_f32(1000.0) > 1e38);
        assert!(exp_f32(f32::NEG_INFINITY) < 2e-38);
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

    #[test]
    fn elementwise_match_naive() {
        for n in [0usize, 1, 13, ELEM_CHUNK + 3, 100_000] {
            let a = randn(n, 1.0, 1);
            let b = randn(n, 1.0, 2);
            let (mut o1, mut o2) = (vec![0.0; n], vec![0.0; n]);
            add(&mut o1, &a, &b);
            naive::add(&mut o2, &a, &b);
            assert_eq!(o1, o2);
            scale_inplace(&mut o1, 0.37);
            naive::scale_inplace(&mut o2, 0.37);
            assert_eq!(o1, o2);
            assert!(all_finite(&o1));
        }
        let mut x = randn(100_000, 1.0, 3);
        assert!(all_finite(&x));
        x[77_777] = f32::NAN;
        assert!(!all_finite(&x) && !naive::all_finite(&x));
        x[77_777] = f32::NEG_INFINITY;
        assert!(!all_finite(&x));
        x[77_777] = 0.0;
        x[0] = f32::INFINITY;
        assert!(!all_finite(&x));
    }
}
