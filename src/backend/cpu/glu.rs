//! Gated linear units, the gated MLPs' activation: the gate|up activation `[N, 2H]` (gate in
//! channels `0..H`, up in `H..2H`, the output of the fused gate and up projections) becomes
//! `out = act(gate) · up` `[N, H]` ([`GluAct`]):
//! - SwiGLU, `silu(g) = g·σ(g)` (transformers' `LlamaMLP`: `down_proj(act_fn(gate_proj(x)) *
//!   up_proj(x))`, `hidden_act = "silu"`);
//! - GeGLU, GELU's tanh approximation (`Gemma3MLP`, the same product, `hidden_activation =
//!   "gelu_pytorch_tanh"`), with [`super::gelu`]'s arithmetic.
//!
//! σ is computed as `1 / (1 + e)`, `e = exp_f32(−g)`, with the vectorisable `exp_f32`
//! (which saturates at e^88 instead of overflowing, so `1 + e` is never infinite and σ never
//! NaN for a finite g), and `1 − σ = e·σ` without cancellation. Below 1e-30 (g < about −69)
//! σ is flushed to 0 rather than left to become a denormal, which would slow every later
//! GEMM reading it; there `|silu(g)| < 1e-28` anyway. A NaN input gives NaN outputs in its
//! own element only.
//!
//! Parallel over fixed row chunks, no reduction: identical results for any thread count.
//! Storage type `T` ([`Elem`]: f32, bf16, f16): each element is widened to f32, computed in
//! f32 and rounded once, so the result for any `T` is the f32 kernel's result on the widened
//! input, rounded to `T`. (transformers, under half precision, rounds `act(gate)` to the
//! activation's type before the product; here there is one rounding.)

use super::features::multiversion;
use super::gelu::{gelu, gelu_grad};
use super::reduce::{exp_f32, rows_per_task};
use crate::dtype::Elem;
pub use crate::ir::schedule::GluAct;
use rayon::prelude::*;

/// (σ(g), 1 − σ(g)) without overflow or cancellation; σ below 1e-30 flushed to 0.
#[inline(always)]
fn sigmoid(g: f32) -> (f32, f32) {
    let e = exp_f32(-g); // saturates at e^88: never inf
    let s = 1.0 / (1.0 + e);
    let s = if s < 1e-30 { 0.0 } else { s }; // NaN stays NaN
    (s, e * s)
}

/// out = act(gate) · up, row by row.
pub fn glu_forward<T: Elem>(
    out: &mut [T], // [N, H]
    inp: &[T],     // [N, 2H] gate | up
    n: usize,
    h: usize,
    act: GluAct,
) {
    assert_eq!(out.len(), n * h, "glu_forward: out");
    assert_eq!(inp.len(), n * 2 * h, "glu_forward: inp");
    if n == 0 || h == 0 {
        return;
    }
    let rows = rows_per_task(2 * h);
    out.par_chunks_mut(rows * h)
        .zip(inp.par_chunks(rows * 2 * h))
        .for_each(|(o, x)| match act {
            GluAct::Silu => swiglu_rows(o, x, h),
            GluAct::GeluTanh => geglu_rows(o, x, h),
        });
}

multiversion! {
    /// SwiGLU forward over a few whole rows.
    fn swiglu_rows<T: Elem>(
        out: &mut [T], // [rows, H]
        inp: &[T],     // [rows, 2H]
        h: usize,
    ) {
        for (o, x) in out.chunks_exact_mut(h).zip(inp.chunks_exact(2 * h)) {
            let (gate, up) = x.split_at(h);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                let g = g.to_f32();
                *o = T::from_f32(g * sigmoid(g).0 * u.to_f32());
            }
        }
    }
}

multiversion! {
    /// GeGLU forward over a few whole rows.
    fn geglu_rows<T: Elem>(
        out: &mut [T], // [rows, H]
        inp: &[T],     // [rows, 2H]
        h: usize,
    ) {
        for (o, x) in out.chunks_exact_mut(h).zip(inp.chunks_exact(2 * h)) {
            let (gate, up) = x.split_at(h);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = T::from_f32(gelu(g.to_f32()) * u.to_f32());
            }
        }
    }
}

/// Gradient of the gate|up input; OVERWRITES `dinp`:
/// `dinp[r, j] = dout·up·act'(g)` (d gate), `dinp[r, H + j] = dout·act(g)` (d up); SwiGLU's
/// `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))`, GeGLU's `gelu_grad` (gelu.rs).
pub fn glu_backward<T: Elem>(
    dinp: &mut [T], // [N, 2H] overwritten: d gate | d up
    dout: &[T],     // [N, H]
    inp: &[T],      // [N, 2H] gate | up
    n: usize,
    h: usize,
    act: GluAct,
) {
    assert_eq!(dinp.len(), n * 2 * h, "glu_backward: dinp");
    assert_eq!(dout.len(), n * h, "glu_backward: dout");
    assert_eq!(inp.len(), n * 2 * h, "glu_backward: inp");
    if n == 0 || h == 0 {
        return;
    }
    let rows = rows_per_task(2 * h);
    dinp.par_chunks_mut(rows * 2 * h)
        .zip(dout.par_chunks(rows * h))
        .zip(inp.par_chunks(rows * 2 * h))
        .for_each(|((d, dy), x)| match act {
            GluAct::Silu => swiglu_backward_rows(d, dy, x, h),
            GluAct::GeluTanh => geglu_backward_rows(d, dy, x, h),
        });
}

multiversion! {
    /// SwiGLU backward over a few whole rows.
    fn swiglu_backward_rows<T: Elem>(
        dinp: &mut [T], // [rows, 2H]
        dout: &[T],     // [rows, H]
        inp: &[T],      // [rows, 2H]
        h: usize,
    ) {
        let it = dinp.chunks_exact_mut(2 * h).zip(dout.chunks_exact(h)).zip(inp.chunks_exact(2 * h));
        for ((d, dy), x) in it {
            let (dgate, dup) = d.split_at_mut(h);
            let (gate, up) = x.split_at(h);
            let it = dgate.iter_mut().zip(dup.iter_mut()).zip(dy).zip(gate).zip(up);
            for ((((dg, du), &dy), &g), &u) in it {
                let (dy, g) = (dy.to_f32(), g.to_f32());
                let (s, one_minus) = sigmoid(g);
                *dg = T::from_f32(dy * u.to_f32() * (s * (1.0 + g * one_minus)));
                *du = T::from_f32(dy * (g * s));
            }
        }
    }
}

multiversion! {
    /// GeGLU backward over a few whole rows.
    fn geglu_backward_rows<T: Elem>(
        dinp: &mut [T], // [rows, 2H]
        dout: &[T],     // [rows, H]
        inp: &[T],      // [rows, 2H]
        h: usize,
    ) {
        let it = dinp.chunks_exact_mut(2 * h).zip(dout.chunks_exact(h)).zip(inp.chunks_exact(2 * h));
        for ((d, dy), x) in it {
            let (dgate, dup) = d.split_at_mut(h);
            let (gate, up) = x.split_at(h);
            let it = dgate.iter_mut().zip(dup.iter_mut()).zip(dy).zip(gate).zip(up);
            for ((((dg, du), &dy), &g), &u) in it {
                let (dy, g) = (dy.to_f32(), g.to_f32());
                *dg = T::from_f32(dy * u.to_f32() * gelu_grad(g));
                *du = T::from_f32(dy * gelu(g));
            }
        }
    }
}

/// Reference twins in f64 with the textbook formulas.
pub mod naive {
    use super::GluAct;
    use crate::backend::cpu::gelu::naive::{gelu, gelu_grad};

    pub fn sigmoid(g: f64) -> f64 {
        1.0 / (1.0 + (-g).exp())
    }

    pub fn silu(g: f64) -> f64 {
        g * sigmoid(g)
    }

    /// d silu / d g.
    pub fn silu_grad(g: f64) -> f64 {
        let s = sigmoid(g);
        s * (1.0 + g * (1.0 - s))
    }

    /// The gate's activation and its derivative.
    fn act_and_grad(act: GluAct, g: f64) -> (f64, f64) {
        match act {
            GluAct::Silu => (silu(g), silu_grad(g)),
            GluAct::GeluTanh => (gelu(g), gelu_grad(g)),
        }
    }

    pub fn glu_forward(
        out: &mut [f32], // [N, H]
        inp: &[f32],     // [N, 2H]
        n: usize,
        h: usize,
        act: GluAct,
    ) {
        for r in 0..n {
            for j in 0..h {
                let (g, u) = (inp[r * 2 * h + j] as f64, inp[r * 2 * h + h + j] as f64);
                out[r * h + j] = (act_and_grad(act, g).0 * u) as f32;
            }
        }
    }

    pub fn glu_backward(
        dinp: &mut [f32], // [N, 2H]
        dout: &[f32],     // [N, H]
        inp: &[f32],      // [N, 2H]
        n: usize,
        h: usize,
        act: GluAct,
    ) {
        for r in 0..n {
            for j in 0..h {
                let (g, u) = (inp[r * 2 * h + j] as f64, inp[r * 2 * h + h + j] as f64);
                let dy = dout[r * h + j] as f64;
                let (a, da) = act_and_grad(act, g);
                dinp[r * 2 * h + j] = (dy * u * da) as f32;
                dinp[r * 2 * h + h + j] = (dy * a) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::conformance::{self, Case, Out, check_stored_as, isas_here, stored};
    use super::super::features::Isa;
    use super::super::reduce::testutil::*;
    use super::*;
    use half::{bf16, f16};

    /// Gate values on a grid from −100 to 100 plus extremes, as rows of width `h`, with
    /// random up values: the input `[N, 2H]` and N.
    fn grid(h: usize) -> (Vec<f32>, usize) {
        let mut g: Vec<f32> = (0..4001).map(|i| -100.0 + i as f32 * 0.05).collect();
        g.extend([0.0, -0.0, 1e-8, -1e-8, -1.2785, 1e6, -1e6, 3e30, -3e30]);
        g.resize(g.len().div_ceil(h) * h, 0.5);
        let n = g.len() / h;
        let up = randn(n * h, 2.0, 1);
        let mut inp = Vec::with_capacity(2 * n * h);
        for (g, u) in g.chunks_exact(h).zip(up.chunks_exact(h)) {
            inp.extend_from_slice(g);
            inp.extend_from_slice(u);
        }
        (inp, n)
    }

    /// (input, N, H) cases: the grid and random rows of a few widths.
    fn cases() -> Vec<(Vec<f32>, usize, usize)> {
        let mut v = Vec::new();
        for h in [1, 7, 64] {
            let (inp, n) = grid(h);
            v.push((inp, n, h));
        }
        for (n, h) in [(1, 1), (3, 5), (37, 1536), (0, 4), (4, 0)] {
            v.push((randn(n * 2 * h, 3.0, (n * h) as u64), n, h));
        }
        v
    }

    const ACTS: [GluAct; 2] = [GluAct::Silu, GluAct::GeluTanh];

    #[test]
    fn forward_matches_naive() {
        for ((inp, n, h), act) in cases()
            .into_iter()
            .flat_map(|c| ACTS.map(|a| (c.clone(), a)))
        {
            let (mut a, mut b) = (vec![0.0; n * h], vec![0.0; n * h]);
            glu_forward(&mut a, &inp, n, h, act);
            naive::glu_forward(&mut b, &inp, n, h, act);
            assert_close(&a, &b, 1e-6, 2e-6, &format!("{act:?} forward {n}x{h}"));
        }
    }

    #[test]
    fn backward_matches_naive_and_overwrites() {
        for ((inp, n, h), act) in cases()
            .into_iter()
            .flat_map(|c| ACTS.map(|a| (c.clone(), a)))
        {
            let dout = randn(n * h, 1.0, 5);
            // Garbage in dinp on entry: it must be overwritten, not accumulated into.
            let mut a = vec![1e3; n * 2 * h];
            let mut b = vec![0.0; n * 2 * h];
            glu_backward(&mut a, &dout, &inp, n, h, act);
            naive::glu_backward(&mut b, &dout, &inp, n, h, act);
            assert_close(&a, &b, 2e-6, 4e-6, &format!("{act:?} backward {n}x{h}"));
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, h) = (3, 9);
        let mut inp = randn(n * 2 * h, 2.0, 6);
        inp[..6].copy_from_slice(&[0.0, 0.5, -0.5, 4.0, -4.0, -1.2785]);
        let g = randn(n * h, 1.0, 7);
        for act in ACTS {
            let mut d = vec![0.0; n * 2 * h];
            glu_backward(&mut d, &g, &inp, n, h, act);
            let fd = fd_grad(&inp, 1e-3, |x| {
                let mut o = vec![0.0; n * h];
                naive::glu_forward(&mut o, x, n, h, act);
                dot(&g, &o)
            });
            assert_close(&d, &fd, 1e-3, 1e-3, &format!("{act:?} backward vs fd"));
        }
    }

    #[test]
    fn never_denormal() {
        let h = 64;
        let (mut inp, n) = grid(h);
        // Up = 1 and dout = 1: the outputs are the activation and its derivative themselves.
        for row in inp.chunks_exact_mut(2 * h) {
            row[h..].fill(1.0);
        }
        for act in ACTS {
            let mut o = vec![0.0; n * h];
            glu_forward(&mut o, &inp, n, h, act);
            assert!(o.iter().all(|v| !v.is_subnormal()), "forward: a denormal");
            let mut d = vec![0.0; n * 2 * h];
            glu_backward(&mut d, &vec![1.0; n * h], &inp, n, h, act);
            assert!(d.iter().all(|v| !v.is_subnormal()), "backward: a denormal");
            // And large |g| gave their limits: act(g) = g for g ≫ 0, 0 for g ≪ 0.
            let at = |g: f32| {
                inp.chunks_exact(2 * h)
                    .flat_map(|r| &r[..h])
                    .position(|&v| v == g)
            };
            let (big, small) = (at(1e6).unwrap(), at(-1e6).unwrap());
            assert_eq!((o[big], o[small]), (1e6, 0.0));
            assert_eq!(d[(big / h) * 2 * h + big % h], 1.0);
            assert_eq!(d[(small / h) * 2 * h + small % h], 0.0);
        }
    }

    /// The grid and random rows, forward and backward, stored as bf16 / f16: the f32 kernel
    /// on the widened input, rounded once; thread invariant.
    struct Narrow;

    impl Case for Narrow {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let mut out = Vec::new();
            for ((inp, n, h), act) in cases()
                .into_iter()
                .flat_map(|c| ACTS.map(|a| (c.clone(), a)))
            {
                let inp: Vec<S> = stored::<T, S>(&inp);
                let dout: Vec<S> = stored::<T, S>(&randn(n * h, 1.0, 9));
                let mut o = vec![S::from_f32(f32::NAN); n * h];
                glu_forward(&mut o, &inp, n, h, act);
                let mut d = vec![S::from_f32(f32::NAN); n * 2 * h];
                glu_backward(&mut d, &dout, &inp, n, h, act);
                out.push(Out::stored("glu forward", &o));
                out.push(Out::stored("glu backward", &d));
            }
            out
        }
    }

    #[test]
    fn bf16_is_f32_rounded() {
        check_stored_as::<bf16>(&Narrow, "glu");
    }

    #[test]
    fn f16_is_f32_rounded() {
        check_stored_as::<f16>(&Narrow, "glu");
    }

    #[test]
    fn identical_for_any_thread_count() {
        let (n, h) = (37, 1536);
        let inp = randn(n * 2 * h, 3.0, 10);
        let dout = randn(n * h, 1.0, 11);
        let run = || {
            let mut all = Vec::new();
            for act in ACTS {
                let mut o = vec![0.0; n * h];
                glu_forward(&mut o, &inp, n, h, act);
                let mut d = vec![0.0; n * 2 * h];
                glu_backward(&mut d, &dout, &inp, n, h, act);
                all.push((bits(&o), bits(&d)));
            }
            all
        };
        let a = with_threads(1, run);
        assert!(a == with_threads(2, run) && a == with_threads(3, run));
    }

    /// f32 and bf16 outputs (bit patterns) of the grid.
    fn isa_run() -> Vec<Vec<u32>> {
        let mut all = Vec::new();
        for o in Narrow
            .run::<f32, f32>()
            .iter()
            .chain(&Narrow.run::<bf16, bf16>())
        {
            all.push(o.f32s().iter().map(|v| v.to_bits()).collect());
        }
        all
    }

    /// Bit-identical results on every instruction set this CPU has.
    #[test]
    fn isa_invariant() {
        conformance::isa_invariant(&isas_here(), isa_run, "glu");
    }

    /// The AVX-512 variants against the baseline (fails on a CPU without AVX-512F).
    #[test]
    #[ignore = "needs AVX-512F"]
    fn isa_invariant_avx512() {
        conformance::isa_invariant(&[Isa::Avx512], isa_run, "glu");
    }

    /// A NaN or infinite gate or up poisons its own outputs only; no panic.
    #[test]
    fn non_finite_stays_local() {
        for act in ACTS {
            non_finite_stays_local_for(act);
        }
    }

    fn non_finite_stays_local_for(act: GluAct) {
        let (n, h) = (2, 4);
        let mut inp: Vec<f32> = randn(n * 2 * h, 1.0, 12);
        inp[1] = f32::NAN; // row 0, gate 1
        inp[2 * h + h + 2] = f32::INFINITY; // row 1, up 2
        let mut o = vec![0.0; n * h];
        glu_forward(&mut o, &inp, n, h, act);
        let bad_o = [1, h + 2];
        for (i, v) in o.iter().enumerate() {
            assert_eq!(v.is_finite(), !bad_o.contains(&i), "out[{i}] = {v}");
        }
        assert!(o[1].is_nan());
        let mut d = vec![0.0; n * 2 * h];
        glu_backward(&mut d, &vec![1.0; n * h], &inp, n, h, act);
        // NaN gate: d gate and d up of its element; inf up: d gate of its element.
        let bad_d = [1, h + 1, 2 * h + 2];
        for (i, v) in d.iter().enumerate() {
            assert_eq!(v.is_finite(), !bad_d.contains(&i), "dinp[{i}] = {v}");
        }
        assert!(d[1].is_nan() && d[h + 1].is_nan());
        // Narrow types: NaN stays NaN, overflow of the f16 range gives ±inf.
        let x = [bf16::NAN, bf16::ONE];
        let mut o = [bf16::ZERO; 1];
        glu_forward(&mut o, &x, 1, 1, act);
        assert!(o[0].is_nan());
        let x = [f16::from_f32(300.0), f16::from_f32(300.0)];
        let mut o = [f16::ZERO; 1];
        glu_forward(&mut o, &x, 1, 1, act);
        assert_eq!(o[0], f16::INFINITY);
    }
}
