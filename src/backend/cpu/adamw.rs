//! AdamW (Loshchilov & Hutter, decoupled weight decay) with bias correction, computed the way
//! `torch.optim.AdamW` does it:
//!
//! ```text
//! g = grad · grad_scale
//! p ← p · (1 − lr·weight_decay)                 (decay first, on the pre-step parameter)
//! m ← β1·m + (1 − β1)·g ;  v ← β2·v + (1 − β2)·g²
//! p ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + ε)      (t is 1-based)
//! ```
//!
//! which equals `p -= lr·(m̂/(sqrt(v̂)+ε) + weight_decay·p)` with `m̂ = m/(1−β1^t)`,
//! `v̂ = v/(1−β2^t)`. Elementwise, parallel over fixed chunks: identical results for any thread
//! count. Weight decay is per call, so the executor passes 0 for tensors that skip it.
//!
//! Parameters and moments are f32 (the master weights); the gradients may be stored in any
//! [`Elem`] type (f32, bf16, f16) and are widened exactly as they are read, so an update
//! from bf16 gradients equals the f32 update from the widened gradients.

use super::features::multiversion;
use super::reduce::ELEM_CHUNK;
use crate::dtype::Elem;
use rayon::prelude::*;

/// Hyper-parameters of one AdamW step (the backend-neutral type every backend applies).
pub use crate::backend::AdamWStep;

/// One AdamW step over a parameter range; `m` and `v` are the moment buffers of the same range.
pub fn adamw_update<G: Elem>(
    params: &mut [f32], // [len]
    grads: &[G],        // [len]
    m: &mut [f32],      // [len] first moment
    v: &mut [f32],      // [len] second moment
    hp: &AdamWStep,
) {
    assert_eq!(grads.len(), params.len(), "adamw_update: grads");
    assert_eq!(m.len(), params.len(), "adamw_update: m");
    assert_eq!(v.len(), params.len(), "adamw_update: v");
    let k = consts(hp);
    params
        .par_chunks_mut(ELEM_CHUNK)
        .zip(grads.par_chunks(ELEM_CHUNK))
        .zip(m.par_chunks_mut(ELEM_CHUNK))
        .zip(v.par_chunks_mut(ELEM_CHUNK))
        .for_each(|(((p, g), m), v)| update_chunk(p, g, m, v, &k));
}

/// Per-step constants of the update (shared with the compressed-state variants in
/// [`quant`](super::quant), which run this same arithmetic on dequantized moments).
pub(crate) struct Consts {
    b1: f32,
    b2: f32,
    c1: f32, // 1 - b1
    c2: f32, // 1 - b2
    eps: f32,
    gs: f32,           // grad_scale
    step_size: f32,    // lr / (1 - b1^t)
    inv_sqrt_bc2: f32, // 1 / sqrt(1 - b2^t)
    decay: f32,        // 1 - lr·weight_decay
}

impl Consts {
    /// The constants in the argument order of the CUDA AdamW kernels
    /// (`backend/cuda/kernels/optimizer.cu`): b1, b2, c1, c2, eps, gs, step_size,
    /// inv_sqrt_bc2, decay. One computation for both backends.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn args(&self) -> [f32; 9] {
        [
            self.b1,
            self.b2,
            self.c1,
            self.c2,
            self.eps,
            self.gs,
            self.step_size,
            self.inv_sqrt_bc2,
            self.decay,
        ]
    }
}

/// The per-step constants of `hp`. Panics unless `hp.step >= 1`.
pub(crate) fn consts(hp: &AdamWStep) -> Consts {
    assert!(hp.step >= 1, "adamw_update: step is 1-based");
    let t = hp.step as f64;
    let bc1 = 1.0 - (hp.beta1 as f64).powf(t);
    let bc2 = 1.0 - (hp.beta2 as f64).powf(t);
    Consts {
        b1: hp.beta1,
        b2: hp.beta2,
        c1: 1.0 - hp.beta1,
        c2: 1.0 - hp.beta2,
        eps: hp.eps,
        gs: hp.grad_scale,
        step_size: (hp.lr as f64 / bc1) as f32,
        inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
        decay: 1.0 - hp.lr * hp.weight_decay,
    }
}

multiversion! {
    /// The update over one chunk (any length; elementwise, so the split never matters).
    pub(crate) fn update_chunk<G: Elem>(
        p: &mut [f32], // [len]
        g: &[G],       // [len]
        m: &mut [f32], // [len]
        v: &mut [f32], // [len]
        k: &Consts,
    ) {
        let it = p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut());
        for (((p, &g), m), v) in it {
            let g = g.to_f32() * k.gs;
            let mi = k.b1 * *m + k.c1 * g;
            let vi = k.b2 * *v + k.c2 * g * g;
            *m = mi;
            *v = vi;
            *p = *p * k.decay - k.step_size * mi / (vi.sqrt() * k.inv_sqrt_bc2 + k.eps);
        }
    }
}

/// Reference twin: the textbook formula in f64.
pub mod naive {
    use super::{AdamWStep, Elem};

    pub fn adamw_update<G: Elem>(
        params: &mut [f32], // [len]
        grads: &[G],        // [len]
        m: &mut [f32],      // [len] first moment
        v: &mut [f32],      // [len] second moment
        hp: &AdamWStep,
    ) {
        let (b1, b2) = (hp.beta1 as f64, hp.beta2 as f64);
        let t = hp.step as i32;
        for i in 0..params.len() {
            let g = grads[i].to_f32() as f64 * hp.grad_scale as f64;
            let mi = b1 * m[i] as f64 + (1.0 - b1) * g;
            let vi = b2 * v[i] as f64 + (1.0 - b2) * g * g;
            let mhat = mi / (1.0 - b1.powi(t));
            let vhat = vi / (1.0 - b2.powi(t));
            let p = params[i] as f64;
            let upd = mhat / (vhat.sqrt() + hp.eps as f64) + hp.weight_decay as f64 * p;
            params[i] = (p - hp.lr as f64 * upd) as f32;
            m[i] = mi as f32;
            v[i] = vi as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::conformance::{Case, Out, check_stored_as, stored};
    use super::super::reduce::testutil::*;
    use super::*;

    fn hp(step: u64) -> AdamWStep {
        AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            grad_scale: 0.5,
        }
    }

    #[test]
    fn first_step_is_sign_like() {
        // Step 1: m̂ = g, v̂ = g², so p ← p(1 − lr·wd) − lr·g/(|g| + eps).
        let p0 = randn(1000, 1.0, 1);
        let g = randn(1000, 1.0, 2);
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.0; 1000], vec![0.0; 1000]);
        let h = hp(1);
        adamw_update(&mut p, &g, &mut m, &mut v, &h);
        for i in 0..1000 {
            let gs = g[i] * h.grad_scale;
            let want = p0[i] * (1.0 - h.lr * h.weight_decay) - h.lr * gs / (gs.abs() + h.eps);
            assert!((p[i] - want).abs() < 1e-6, "{i}: {} vs {want}", p[i]);
        }
    }

    #[test]
    fn matches_naive_over_steps() {
        for len in [0usize, 1, 7, ELEM_CHUNK + 9, 100_003] {
            let mut pa = randn(len, 1.0, len as u64);
            let mut pb = pa.clone();
            let (mut ma, mut va) = (vec![0.0; len], vec![0.0; len]);
            let (mut mb, mut vb) = (vec![0.0; len], vec![0.0; len]);
            for step in 1..=5u64 {
                let g = randn(len, 1.0, 100 * step + len as u64);
                let mut h = hp(step);
                if step == 3 {
                    h.weight_decay = 0.0;
                }
                adamw_update(&mut pa, &g, &mut ma, &mut va, &h);
                naive::adamw_update(&mut pb, &g, &mut mb, &mut vb, &h);
            }
            assert_close(&pa, &pb, 1e-6, 1e-6, &format!("params len={len}"));
            assert_close(&ma, &mb, 1e-7, 1e-5, &format!("m len={len}"));
            assert_close(&va, &vb, 1e-8, 1e-5, &format!("v len={len}"));
        }
    }

    #[test]
    fn identical_for_any_thread_count() {
        let len = 3 * ELEM_CHUNK + 11;
        let p0 = randn(len, 1.0, 1);
        let g = randn(len, 1.0, 2);
        let run = || {
            let (mut p, mut m, mut v) = (p0.clone(), vec![0.1; len], vec![0.2; len]);
            adamw_update(&mut p, &g, &mut m, &mut v, &hp(7));
            (p, m, v)
        };
        assert!(with_threads(1, run) == with_threads(3, run));
    }

    /// One update from bf16 / f16 gradients (two of them non-finite): bitwise the f32 update
    /// from the widened gradients, for any thread count.
    struct NarrowGrads;

    const NARROW_LEN: usize = 2 * ELEM_CHUNK + 11;

    impl Case for NarrowGrads {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let len = NARROW_LEN;
            let mut p = randn(len, 1.0, 1);
            let mut g = randn(len, 1.0, 2);
            g[7] = f32::NAN;
            g[8] = f32::INFINITY;
            let g: Vec<S> = stored::<T, S>(&g);
            let (mut m, mut v) = (vec![0.1; len], vec![0.2; len]);
            adamw_update(&mut p, &g, &mut m, &mut v, &hp(3));
            vec![Out::f32("params", &p), Out::f32("m", &m), Out::f32("v", &v)]
        }
    }

    /// [`NarrowGrads`]; non-finite gradients give non-finite parameters without a panic, and
    /// the naive twin reads the same widened values.
    fn narrow_grads_are_widened<G: Elem>() {
        let (got, _) = check_stored_as::<G>(&NarrowGrads, "adamw");
        let got = got[0].f32s();
        assert!(got[7].is_nan() && !got[8].is_finite() && got[9].is_finite());
        let len = NARROW_LEN;
        let p0 = randn(len, 1.0, 1);
        let mut g: Vec<G> = narrow_vec(&randn(len, 1.0, 2));
        g[7] = G::from_f32(f32::NAN);
        g[8] = G::from_f32(f32::INFINITY);
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.1; len], vec![0.2; len]);
        naive::adamw_update(&mut p, &g, &mut m, &mut v, &hp(3));
        p[7..9].fill(0.0);
        let mut gp = got.to_vec();
        gp[7..9].fill(0.0);
        assert_close(&gp, &p, 1e-6, 1e-6, "fast vs naive");
    }

    #[test]
    fn bf16_grads_are_widened() {
        narrow_grads_are_widened::<half::bf16>();
    }

    #[test]
    fn f16_grads_are_widened() {
        narrow_grads_are_widened::<half::f16>();
    }
}
