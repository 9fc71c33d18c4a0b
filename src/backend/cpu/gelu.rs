//! GELU activation, GPT-2's tanh approximation ("gelu_new"):
//! `gelu(x) = 0.5·x·(1 + tanh(u))`, `u = sqrt(2/π)·(x + 0.044715·x³)`.
//!
//! Computed as the identical `x·σ(2u)` (since `0.5·(1 + tanh u) = σ(2u)`) with the
//! vectorisable `exp_f32`, so the loops auto-vectorise instead of calling libm's `tanhf`.
//! Elementwise and parallel over fixed chunks: identical results for any thread count.
//!
//! Storage type `T` ([`Elem`]: f32, bf16, f16) for inputs and outputs: each element is
//! widened to f32, computed in f32 and rounded once, so the result for any `T` is the f32
//! kernel's result on the widened input, rounded to `T`.

use super::features::multiversion;
use super::reduce::{ELEM_CHUNK, exp_f32};
use crate::dtype::Elem;
use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_K: f32 = 0.044_715;

/// (σ(2u), 1 - σ(2u)) for the GELU argument `x`, without cancellation.
#[inline(always)]
fn sig2u(x: f32) -> (f32, f32) {
    let u = SQRT_2_OVER_PI * (x + GELU_K * x * x * x);
    let e = exp_f32(-2.0 * u); // saturates at e^88: never inf
    let sg = 1.0 / (1.0 + e);
    // Below 1e-30 (x < about -9.2) flush to 0 rather than produce denormals, which would
    // slow down every later GEMM that reads them; there |gelu(x)| < 1e-29 anyway.
    let sg = if sg < 1e-30 { 0.0 } else { sg };
    (sg, e * sg)
}

/// gelu(x) = x·σ(2u): the arithmetic of every GELU here (and of GeGLU's gate, `glu.rs`).
#[inline(always)]
pub(super) fn gelu(x: f32) -> f32 {
    x * sig2u(x).0
}

/// gelu'(x) = σ(2u) + 2·x·σ(2u)·(1 − σ(2u))·sqrt(2/π)·(1 + 3·0.044715·x²).
#[inline(always)]
pub(super) fn gelu_grad(x: f32) -> f32 {
    let (sg, one_minus) = sig2u(x);
    // Beyond |x| = 12 the second term is below 1e-30; clamping keeps x³ finite.
    let xc = x.clamp(-12.0, 12.0); // NaN stays NaN
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_K * xc * xc);
    sg + 2.0 * xc * sg * one_minus * du
}

multiversion! {
    /// One chunk of the forward.
    fn forward_chunk<T: Elem>(
        o: &mut [T], // [len]
        x: &[T],     // [len]
    ) {
        for (o, &x) in o.iter_mut().zip(x) {
            *o = T::from_f32(gelu(x.to_f32()));
        }
    }
}

multiversion! {
    /// One chunk of the backward.
    fn backward_chunk<T: Elem>(
        d: &mut [T], // [len]
        x: &[T],     // [len]
    ) {
        for (d, &x) in d.iter_mut().zip(x) {
            *d = T::from_f32(d.to_f32() * gelu_grad(x.to_f32()));
        }
    }
}

/// out = gelu(inp) elementwise.
pub fn gelu_forward<T: Elem>(
    out: &mut [T], // [len]
    inp: &[T],     // [len]
) {
    assert_eq!(out.len(), inp.len(), "gelu_forward: lengths");
    out.par_chunks_mut(ELEM_CHUNK)
        .zip(inp.par_chunks(ELEM_CHUNK))
        .for_each(|(o, x)| forward_chunk(o, x));
}

/// In place: on entry `d` holds dL/dout, on exit dL/dinp = dL/dout · gelu'(inp), with
/// gelu'(x) = σ(2u) + 2·x·σ(2u)·(1 - σ(2u))·sqrt(2/π)·(1 + 3·0.044715·x²).
pub fn gelu_backward_inplace<T: Elem>(
    d: &mut [T], // [len] in: dL/dout, out: dL/dinp
    inp: &[T],   // [len]
) {
    assert_eq!(d.len(), inp.len(), "gelu_backward_inplace: lengths");
    d.par_chunks_mut(ELEM_CHUNK)
        .zip(inp.par_chunks(ELEM_CHUNK))
        .for_each(|(d, x)| backward_chunk(d, x));
}

/// Reference twins in f64 with the textbook tanh formula.
pub mod naive {
    fn u(x: f64) -> f64 {
        (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)
    }

    pub fn gelu(x: f64) -> f64 {
        0.5 * x * (1.0 + u(x).tanh())
    }

    pub fn gelu_grad(x: f64) -> f64 {
        let t = u(x).tanh();
        let du = (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * x * x);
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
    }

    pub fn gelu_forward(
        out: &mut [f32], // [len]
        inp: &[f32],     // [len]
    ) {
        for (o, &x) in out.iter_mut().zip(inp) {
            *o = gelu(x as f64) as f32;
        }
    }

    pub fn gelu_backward_inplace(
        d: &mut [f32], // [len] in: dL/dout, out: dL/dinp
        inp: &[f32],   // [len]
    ) {
        for (d, &x) in d.iter_mut().zip(inp) {
            *d = (*d as f64 * gelu_grad(x as f64)) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::conformance::{Case, Out, check_stored_as, stored};
    use super::super::reduce::testutil::*;
    use super::*;
    use half::{bf16, f16};

    fn grid() -> Vec<f32> {
        let mut x: Vec<f32> = (0..4001).map(|i| -20.0 + i as f32 * 0.01).collect();
        x.extend([0.0, -0.0, 1e-8, -1e-8, 50.0, -50.0, 1e6, -1e6, 3e30, -3e30]);
        x
    }

    #[test]
    fn forward_matches_naive() {
        for x in [
            grid(),
            randn(ELEM_CHUNK * 2 + 17, 3.0, 1),
            randn(1, 1.0, 2),
            vec![],
        ] {
            let (mut a, mut b) = (vec![0.0; x.len()], vec![0.0; x.len()]);
            gelu_forward(&mut a, &x);
            naive::gelu_forward(&mut b, &x);
            assert_close(&a, &b, 1e-6, 2e-6, "gelu forward");
        }
    }

    #[test]
    fn backward_matches_naive() {
        for x in [
            grid(),
            randn(ELEM_CHUNK + 5, 3.0, 3),
            randn(1, 1.0, 4),
            vec![],
        ] {
            let g = randn(x.len(), 1.0, 5);
            let (mut a, mut b) = (g.clone(), g.clone());
            gelu_backward_inplace(&mut a, &x);
            naive::gelu_backward_inplace(&mut b, &x);
            assert_close(&a, &b, 2e-6, 4e-6, "gelu backward");
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let x: Vec<f32> = randn(40, 2.0, 6)
            .into_iter()
            .chain([0.0, 0.5, -0.5, 4.0, -4.0])
            .collect();
        let g = randn(x.len(), 1.0, 7);
        let mut d = g.clone();
        gelu_backward_inplace(&mut d, &x);
        let fd = fd_grad(&x, 1e-3, |x| {
            x.iter()
                .zip(&g)
                .map(|(&x, &g)| g as f64 * naive::gelu(x as f64))
                .sum()
        });
        assert_close(&d, &fd, 1e-4, 1e-3, "gelu backward vs fd");
    }

    #[test]
    fn never_denormal() {
        let x = grid();
        let mut o = vec![0.0; x.len()];
        gelu_forward(&mut o, &x);
        assert!(
            o.iter().all(|v| !v.is_subnormal()),
            "forward produced a denormal"
        );
        let mut d = vec![1.0; x.len()];
        gelu_backward_inplace(&mut d, &x);
        assert!(
            d.iter().all(|v| !v.is_subnormal()),
            "backward produced a denormal"
        );
    }

    /// Forward and backward on a grid and random values: stored as bf16 / f16, the f32
    /// kernel on the widened input, rounded once; thread invariant.
    struct Narrow;

    impl Case for Narrow {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let mut x = grid();
            x.extend(randn(ELEM_CHUNK * 2 + 17, 3.0, 8));
            let x: Vec<S> = stored::<T, S>(&x);
            let g: Vec<S> = stored::<T, S>(&randn(x.len(), 1.0, 9));
            let mut o = vec![S::from_f32(f32::NAN); x.len()];
            gelu_forward(&mut o, &x);
            let mut d = g;
            gelu_backward_inplace(&mut d, &x);
            vec![
                Out::stored("gelu forward", &o),
                Out::stored("gelu backward", &d),
            ]
        }
    }

    #[test]
    fn bf16_is_f32_rounded() {
        check_stored_as::<bf16>(&Narrow, "gelu");
    }

    #[test]
    fn f16_is_f32_rounded() {
        check_stored_as::<f16>(&Narrow, "gelu");
    }

    #[test]
    fn nan_propagates() {
        let x = [1.0, f32::NAN, -1.0];
        let mut o = [0.0; 3];
        gelu_forward(&mut o, &x);
        assert!(o[1].is_nan() && o[0].is_finite() && o[2].is_finite());
        let mut d = [1.0; 3];
        gelu_backward_inplace(&mut d, &x);
        assert!(d[1].is_nan() && d[0].is_finite());
        // Narrow types: NaN stays NaN, overflow of the f16 range gives ±inf, no panic.
        let x = [bf16::ONE, bf16::NAN, bf16::INFINITY, bf16::NEG_INFINITY];
        let mut o = [bf16::ZERO; 4];
        gelu_forward(&mut o, &x);
        assert!(o[0].is_finite() && o[1].is_nan() && o[2] == bf16::INFINITY);
        let mut d = [bf16::ONE; 4];
        gelu_backward_inplace(&mut d, &x);
        assert!(d[0].is_finite() && d[1].is_nan());
        let x = [f16::from_f32(2.0), f16::NAN];
        let mut d = [f16::MAX, f16::ONE];
        gelu_backward_inplace(&mut d, &x);
        assert!(d[0] == f16::INFINITY && d[1].is_nan());
    }
}
