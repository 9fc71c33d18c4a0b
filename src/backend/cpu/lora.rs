//! A LoRA adapter on a frozen linear layer (`crate::model::lora`), forward and backward:
//! four thin GEMMs around the rank-r bottleneck, on [`gemm_mixed`] (exactly the f32 GEMM
//! when everything is f32; f32 accumulation and one rounding per stored element otherwise).
//!
//! Forward: `h[N, r] = scale · x[N, IC] @ Aᵀ`, kept for the backward, then
//! `y[:, col..col + OC] += h @ Bᵀ`, `y` rows `ldo` wide (an adapted layer may be one of
//! several sharing a fused output: Llama's q, k and v). Backward, with `dy` the columns of
//! the output gradient: `dB += dyᵀ @ h`, `dh = scale · dy @ B` (f32 scratch),
//! `dA += dhᵀ @ x`, `dx += dh @ A`. Scaling `h` rather than the product is PEFT's
//! `B(A(x)) · scale` up to the order of the rounding.
//!
//! With dropout (`--lora-dropout p`, training only) the adapter reads `xd = mask ⊙ x / (1 -
//! p)` in place of x, as PEFT's `lora_B(lora_A(dropout(x)))`: the forward writes `xd` into an
//! f32 workspace `[N, IC]` and computes h from it; the backward draws the same mask again
//! ([`Dropout`]: a hash of the element, never stored), computes `dA += dhᵀ @ xd` from it, then
//! reuses the workspace for `t = dh @ A` and adds `mask ⊙ t / (1 - p)` into dx.
//!
//! A and B are the adapters' f32 (master) weights; x, y, h and their gradients are the
//! storage type. Nothing here allocates: `dh`, the dropout workspace and the mixed GEMM's
//! tiles come in as slices.

use super::features::multiversion;
use super::gemm::mixed::gemm_mixed;
use super::reduce::ELEM_CHUNK;
use crate::dtype::Elem;
use rayon::prelude::*;

/// An adapter's dropout mask over one call's input `[N, IC]`: element `e` (row-major) is
/// dropped when the top 32 bits of a SplitMix64 finaliser of (`key`, `first + e`) fall below
/// `p · 2³²`, so the mask is a pure function of (seed, salt, the element's index in the whole
/// batch): the forward, a recomputed forward and the backward draw the same one, and a
/// resumed run the same as an uninterrupted one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// The step's seed mixed with the adapter's salt.
    key: u64,
    /// An element is dropped when its hash's top 32 bits are below this (`p · 2³²`).
    below: u64,
    /// What a kept element is multiplied by: `1 / (1 - p)`.
    scale: f32,
    /// The index in the whole batch of this call's first element (its first row · width).
    first: u64,
    /// The call's row width (IC), the one-process input's (`width`) and the call's first
    /// column in it: a tensor rank's columns of a row-parallel layer's input are drawn by
    /// their place in one process's input. `ic == width`: the input is whole.
    ic: usize,
    width: usize,
    offset: usize,
}

/// SplitMix64's increment (the golden ratio) and finaliser.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

#[inline(always)]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Dropout {
    /// The mask of probability `p` (in [0, 1)) for the step's `seed`, the adapter `salt`
    /// and an input whose first element is element `first` of the whole batch.
    pub fn new(p: f32, seed: u64, salt: u64, first: u64) -> Dropout {
        assert!((0.0..1.0).contains(&p), "dropout: p = {p} is not in [0, 1)");
        Dropout {
            key: mix(seed ^ mix(salt.wrapping_add(GOLDEN))),
            below: (p as f64 * 4294967296.0) as u64,
            scale: 1.0 / (1.0 - p),
            first,
            ic: 1,
            width: 1,
            offset: 0,
        }
    }

    /// The same mask over an input of rows `ic` wide that are columns `offset..offset + ic`
    /// of the one-process input's rows `width` wide (`first` counts whole rows of `width`).
    pub fn in_columns(self, ic: usize, (width, offset): (usize, usize)) -> Dropout {
        Dropout {
            ic: ic.max(1),
            width: width.max(1),
            offset,
            ..self
        }
    }

    /// The index in the whole batch of the call's element `e`.
    #[inline(always)]
    fn index(&self, e: usize) -> u64 {
        if self.ic == self.width {
            return self.first + e as u64;
        }
        let (row, col) = (e / self.ic, e % self.ic);
        self.first + (row * self.width + self.offset + col) as u64
    }

    /// `(key, below, scale, first)`: the mask as the CUDA kernels take it
    /// (`backend/cuda/kernels/lora.cu`), which hash each element as [`Dropout::keeps`] does
    /// for a whole input (they take no columns: the CUDA device runs no tensor ranks).
    pub fn parts(&self) -> (u64, u64, f32, u64) {
        (self.key, self.below, self.scale, self.first)
    }

    /// Whether element `e` of the call's input is kept.
    #[inline(always)]
    pub fn keeps(&self, e: usize) -> bool {
        let z = self.key.wrapping_add(self.index(e).wrapping_mul(GOLDEN));
        mix(z) >> 32 >= self.below
    }

    /// `xd = mask ⊙ x / (1 - p)`.
    fn apply<T: Elem>(&self, x: &[T], xd: &mut [f32]) {
        xd.par_chunks_mut(ELEM_CHUNK)
            .zip(x.par_chunks(ELEM_CHUNK))
            .enumerate()
            .for_each(|(c, (xd, x))| masked(self, c * ELEM_CHUNK, x, xd));
    }

    /// `dx += mask ⊙ t / (1 - p)`, rounded once into `T` (dropped elements untouched).
    fn add_into<T: Elem>(&self, t: &[f32], dx: &mut [T]) {
        dx.par_chunks_mut(ELEM_CHUNK)
            .zip(t.par_chunks(ELEM_CHUNK))
            .enumerate()
            .for_each(|(c, (dx, t))| add_masked(self, c * ELEM_CHUNK, t, dx));
    }
}

multiversion! {
    /// [`Dropout::apply`] on the chunk starting at element `at`.
    fn masked<T: Elem>(d: &Dropout, at: usize, x: &[T], xd: &mut [f32]) {
        for (e, (o, &v)) in xd.iter_mut().zip(x).enumerate() {
            *o = if d.keeps(at + e) { v.to_f32() * d.scale } else { 0.0 };
        }
    }
}

multiversion! {
    /// [`Dropout::add_into`] on the chunk starting at element `at`.
    fn add_masked<T: Elem>(d: &Dropout, at: usize, t: &[f32], dx: &mut [T]) {
        for (e, (o, &v)) in dx.iter_mut().zip(t).enumerate() {
            if d.keeps(at + e) {
                *o = T::from_f32(o.to_f32() + v * d.scale);
            }
        }
    }
}

/// The forward of one adapter: `h = scale · inp @ aᵀ`; `out[:, col..col + oc] += h @ bᵀ`.
#[allow(clippy::too_many_arguments)]
pub fn lora_forward<T: Elem>(
    out: &mut [T], // [N, ldo] +=, columns col..col + OC
    h: &mut [T],   // [N, r] overwritten
    inp: &[T],     // [N, IC]
    a: &[f32],     // [r, IC]
    b: &[f32],     // [OC, r]
    (n, ic, oc, r): (usize, usize, usize, usize),
    (col, ldo): (usize, usize),
    scale: f32,
    dropout: Option<(&Dropout, &mut [f32])>, // the mask, xd [N, IC]
    ws: &mut [f32],                          // [gemm_mixed_workspace_len()] unless T is f32
) {
    check(
        out.len(),
        h.len(),
        inp.len(),
        a.len(),
        b.len(),
        (n, ic, oc, r),
        (col, ldo),
    );
    // h[N, r] = inp[N, IC] @ aᵀ (inp masked into xd first, with dropout), then scaled.
    match dropout {
        Some((d, xd)) => {
            assert_eq!(xd.len(), n * ic, "lora_forward: xd");
            d.apply(inp, xd);
            gemm_mixed(n, r, ic, &*xd, ic, false, a, ic, true, h, r, false, ws);
        }
        None => gemm_mixed(n, r, ic, inp, ic, false, a, ic, true, h, r, false, ws),
    }
    for v in h.iter_mut() {
        *v = T::from_f32(v.to_f32() * scale);
    }
    // out[N, col..col + OC] += h[N, r] @ bᵀ.
    gemm_mixed(
        n,
        oc,
        r,
        h,
        r,
        false,
        b,
        r,
        true,
        &mut out[col..],
        ldo,
        true,
        ws,
    );
}

/// The backward of [`lora_forward`]: `db += dout[:, col..]ᵀ @ h`, `dh = scale · dout[:,
/// col..] @ b`, `da += dhᵀ @ inp`, `dinp += dh @ a`.
#[allow(clippy::too_many_arguments)]
pub fn lora_backward<T: Elem>(
    dinp: &mut [T], // [N, IC] +=
    da: &mut [T],   // [r, IC] +=
    db: &mut [T],   // [OC, r] +=
    dh: &mut [f32], // [N, r] scratch
    dout: &[T],     // [N, ldo], columns col..col + OC
    inp: &[T],      // [N, IC]
    h: &[T],        // [N, r] (scaled, from the forward)
    a: &[f32],      // [r, IC]
    b: &[f32],      // [OC, r]
    (n, ic, oc, r): (usize, usize, usize, usize),
    (col, ldo): (usize, usize),
    scale: f32,
    dropout: Option<(&Dropout, &mut [f32])>, // the forward's mask, xd [N, IC] scratch
    ws: &mut [f32],                          // [gemm_mixed_workspace_len()] unless T is f32
) {
    check(
        dout.len(),
        h.len(),
        inp.len(),
        a.len(),
        b.len(),
        (n, ic, oc, r),
        (col, ldo),
    );
    assert_eq!(dinp.len(), n * ic, "lora_backward: dinp");
    assert_eq!(
        (da.len(), db.len()),
        (r * ic, oc * r),
        "lora_backward: da, db"
    );
    assert_eq!(dh.len(), n * r, "lora_backward: dh");
    let dy = &dout[col..];
    // db[OC, r] += dyᵀ[OC, N] @ h[N, r].
    gemm_mixed(oc, r, n, dy, ldo, true, h, r, false, db, r, true, ws);
    // dh[N, r] = scale · dy[N, OC] @ b[OC, r].
    gemm_mixed(n, r, oc, dy, ldo, false, b, r, false, dh, r, false, ws);
    for v in dh.iter_mut() {
        *v *= scale;
    }
    // da[r, IC] += dhᵀ[r, N] @ inp[N, IC]; dinp[N, IC] += dh[N, r] @ a[r, IC]. With dropout,
    // inp is xd (the mask drawn again) and dh @ a goes through xd's space to be masked.
    match dropout {
        Some((d, xd)) => {
            assert_eq!(xd.len(), n * ic, "lora_backward: xd");
            d.apply(inp, xd);
            gemm_mixed(r, ic, n, &*dh, r, true, &*xd, ic, false, da, ic, true, ws);
            gemm_mixed(n, ic, r, &*dh, r, false, a, ic, false, xd, ic, false, ws);
            d.add_into(xd, dinp);
        }
        None => {
            gemm_mixed(r, ic, n, &*dh, r, true, inp, ic, false, da, ic, true, ws);
            gemm_mixed(n, ic, r, &*dh, r, false, a, ic, false, dinp, ic, true, ws);
        }
    }
}

/// The shapes both directions share.
fn check(
    out: usize,
    h: usize,
    inp: usize,
    a: usize,
    b: usize,
    (n, ic, oc, r): (usize, usize, usize, usize),
    (col, ldo): (usize, usize),
) {
    assert!(
        col + oc <= ldo,
        "lora: columns {col}..{} of {ldo}",
        col + oc
    );
    assert_eq!(out, n * ldo, "lora: out");
    assert_eq!(h, n * r, "lora: h");
    assert_eq!(inp, n * ic, "lora: inp");
    assert_eq!((a, b), (r * ic, oc * r), "lora: a, b");
}

/// Reference twins: the same formulas in triple loops with f64 accumulation (h rounded to
/// `T` and the masked input to f32 as the fast kernel stores them).
pub mod naive {
    use super::Dropout;
    use crate::dtype::Elem;

    /// Element `e` of `x` as the adapter reads it: masked and scaled with dropout.
    fn input<T: Elem>(x: &[T], e: usize, dropout: Option<&Dropout>) -> f64 {
        match dropout {
            Some(d) if !d.keeps(e) => 0.0,
            Some(d) => (x[e].to_f32() * d.scale) as f64,
            None => x[e].to_f32() as f64,
        }
    }

    /// See [`super::lora_forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn lora_forward<T: Elem>(
        out: &mut [T], // [N, ldo] +=
        h: &mut [T],   // [N, r]
        inp: &[T],     // [N, IC]
        a: &[f32],     // [r, IC]
        b: &[f32],     // [OC, r]
        (n, ic, oc, r): (usize, usize, usize, usize),
        (col, ldo): (usize, usize),
        scale: f32,
        dropout: Option<&Dropout>,
    ) {
        let f = |x: T| x.to_f32() as f64;
        for i in 0..n {
            for k in 0..r {
                let s: f64 = (0..ic)
                    .map(|j| input(inp, i * ic + j, dropout) * a[k * ic + j] as f64)
                    .sum();
                h[i * r + k] = T::from_f32(T::from_f32(s as f32).to_f32() * scale);
            }
            for o in 0..oc {
                let s: f64 = (0..r).map(|k| f(h[i * r + k]) * b[o * r + k] as f64).sum();
                let y = &mut out[i * ldo + col + o];
                *y = T::from_f32((f(*y) + s) as f32);
            }
        }
    }

    /// See [`super::lora_backward`] (`dh` computed in f64, not returned).
    #[allow(clippy::too_many_arguments)]
    pub fn lora_backward<T: Elem>(
        dinp: &mut [T], // [N, IC] +=
        da: &mut [T],   // [r, IC] +=
        db: &mut [T],   // [OC, r] +=
        dout: &[T],     // [N, ldo]
        inp: &[T],      // [N, IC]
        h: &[T],        // [N, r]
        a: &[f32],      // [r, IC]
        b: &[f32],      // [OC, r]
        (n, ic, oc, r): (usize, usize, usize, usize),
        (col, ldo): (usize, usize),
        scale: f32,
        dropout: Option<&Dropout>,
    ) {
        let f = |x: T| x.to_f32() as f64;
        let dy = |i: usize, o: usize| f(dout[i * ldo + col + o]);
        for o in 0..oc {
            for k in 0..r {
                let s: f64 = (0..n).map(|i| dy(i, o) * f(h[i * r + k])).sum();
                db[o * r + k] = T::from_f32((f(db[o * r + k]) + s) as f32);
            }
        }
        let dh: Vec<f64> = (0..n * r)
            .map(|x| {
                let (i, k) = (x / r, x % r);
                scale as f64 * (0..oc).map(|o| dy(i, o) * b[o * r + k] as f64).sum::<f64>()
            })
            .collect();
        for k in 0..r {
            for j in 0..ic {
                let s: f64 = (0..n)
                    .map(|i| dh[i * r + k] * input(inp, i * ic + j, dropout))
                    .sum();
                da[k * ic + j] = T::from_f32((f(da[k * ic + j]) + s) as f32);
            }
        }
        for i in 0..n {
            for j in 0..ic {
                let e = i * ic + j;
                let s: f64 = (0..r).map(|k| dh[i * r + k] * a[k * ic + j] as f64).sum();
                let s = match dropout {
                    Some(d) if !d.keeps(e) => continue,
                    Some(d) => s * d.scale as f64,
                    None => s,
                };
                dinp[e] = T::from_f32((f(dinp[e]) + s) as f32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::gemm::mixed::gemm_mixed_workspace_len;
    use crate::util::rng::Rng;
    use half::bf16;

    fn rand(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.next_f32() - 0.5).collect()
    }

    // N, IC, OC, r, col, ldo: an adapter writing the middle of a fused output.
    const SHAPE: (usize, usize, usize, usize) = (37, 24, 20, 4);
    const COLS: (usize, usize) = (8, 36);

    /// A mask of 30%, for an input starting at row 5 of its batch.
    fn mask() -> Dropout {
        Dropout::new(0.3, 7, 2, 5 * SHAPE.1 as u64)
    }

    /// The fast kernels agree with their twins, f32 (to rounding) and bf16 (to its
    /// precision), forward and backward, without and with dropout.
    #[test]
    fn kernels_match_their_naive_twins() {
        let (n, ic, oc, r) = SHAPE;
        let (_, ldo) = COLS;
        let mut rng = Rng::new(5);
        let (x, a, b) = (
            rand(&mut rng, n * ic),
            rand(&mut rng, r * ic),
            rand(&mut rng, oc * r),
        );
        let (y0, dy) = (rand(&mut rng, n * ldo), rand(&mut rng, n * ldo));
        let (dx0, da0, db0) = (
            rand(&mut rng, n * ic),
            rand(&mut rng, r * ic),
            rand(&mut rng, oc * r),
        );
        fn run<T: Elem>(v: [&[f32]; 8], tol: f32, d: Option<Dropout>) {
            let t = |s: &[f32]| s.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
            let [x, a, b, y0, dy, dx0, da0, db0] = v;
            let mut ws = vec![0.0; gemm_mixed_workspace_len()];
            let mut xd = vec![f32::NAN; SHAPE.0 * SHAPE.1];
            let (mut y, mut h) = (t(y0), vec![T::from_f32(0.0); SHAPE.0 * SHAPE.3]);
            let (mut yn, mut hn) = (y.clone(), h.clone());
            lora_forward(
                &mut y,
                &mut h,
                &t(x),
                a,
                b,
                SHAPE,
                COLS,
                2.0,
                d.as_ref().map(|d| (d, &mut xd[..])),
                &mut ws,
            );
            naive::lora_forward(&mut yn, &mut hn, &t(x), a, b, SHAPE, COLS, 2.0, d.as_ref());
            close(&y, &yn, tol, "y");
            close(&h, &hn, tol, "h");
            let (mut dx, mut da, mut db) = (t(dx0), t(da0), t(db0));
            let (mut dxn, mut dan, mut dbn) = (dx.clone(), da.clone(), db.clone());
            let mut dh = vec![0.0; SHAPE.0 * SHAPE.3];
            lora_backward(
                &mut dx,
                &mut da,
                &mut db,
                &mut dh,
                &t(dy),
                &t(x),
                &h,
                a,
                b,
                SHAPE,
                COLS,
                2.0,
                d.as_ref().map(|d| (d, &mut xd[..])),
                &mut ws,
            );
            naive::lora_backward(
                &mut dxn,
                &mut dan,
                &mut dbn,
                &t(dy),
                &t(x),
                &h,
                a,
                b,
                SHAPE,
                COLS,
                2.0,
                d.as_ref(),
            );
            close(&dx, &dxn, tol, "dx");
            close(&da, &dan, tol, "da");
            close(&db, &dbn, tol, "db");
        }
        let v = [&x[..], &a, &b, &y0, &dy, &dx0, &da0, &db0];
        for d in [None, Some(mask())] {
            run::<f32>(v, 1e-5, d);
            run::<bf16>(v, 2e-2, d);
        }
    }

    fn close<T: Elem>(got: &[T], want: &[T], tol: f32, what: &str) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let (g, w) = (g.to_f32(), w.to_f32());
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    /// The backward is the gradient of the forward: finite differences of
    /// `L = Σ dy ⊙ y(x, A, B)` in f64, against the kernel's gradients, for a few elements of
    /// x, A and B; with dropout, through the mask (fixed by its seed) and its 1 / (1 - p).
    #[test]
    fn backward_is_the_gradient_of_the_forward() {
        for d in [None, Some(mask())] {
            gradient_check(d);
        }
    }

    fn gradient_check(d: Option<Dropout>) {
        let (n, ic, oc, r) = SHAPE;
        let (col, ldo) = COLS;
        let scale = 0.75;
        let mut rng = Rng::new(9);
        let (x, a, b) = (
            rand(&mut rng, n * ic),
            rand(&mut rng, r * ic),
            rand(&mut rng, oc * r),
        );
        let dy = rand(&mut rng, n * ldo);
        // What the adapter reads of x[e]: in f64, through the mask.
        let keep = |e: usize| match &d {
            Some(d) if !d.keeps(e) => 0.0,
            Some(d) => d.scale as f64,
            None => 1.0,
        };
        // L in f64, h unrounded.
        let loss = |x: &[f64], a: &[f64], b: &[f64]| -> f64 {
            let mut l = 0.0;
            for i in 0..n {
                let h: Vec<f64> = (0..r)
                    .map(|k| {
                        let s = (0..ic).map(|j| keep(i * ic + j) * x[i * ic + j] * a[k * ic + j]);
                        scale as f64 * s.sum::<f64>()
                    })
                    .collect();
                for o in 0..oc {
                    let y: f64 = (0..r).map(|k| h[k] * b[o * r + k]).sum();
                    l += y * dy[i * ldo + col + o] as f64;
                }
            }
            l
        };
        let (mut ws, mut xd) = (Vec::new(), vec![0.0f32; n * ic]);
        let (mut y, mut h) = (vec![0.0f32; n * ldo], vec![0.0f32; n * r]);
        lora_forward(
            &mut y,
            &mut h,
            &x,
            &a,
            &b,
            SHAPE,
            COLS,
            scale,
            d.as_ref().map(|d| (d, &mut xd[..])),
            &mut ws,
        );
        let (mut dx, mut da, mut db, mut dh) = (
            vec![0.0f32; n * ic],
            vec![0.0f32; r * ic],
            vec![0.0f32; oc * r],
            vec![0.0; n * r],
        );
        lora_backward(
            &mut dx,
            &mut da,
            &mut db,
            &mut dh,
            &dy,
            &x,
            &h,
            &a,
            &b,
            SHAPE,
            COLS,
            scale,
            d.as_ref().map(|d| (d, &mut xd[..])),
            &mut ws,
        );
        let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let (xw, aw, bw) = (wide(&x), wide(&a), wide(&b));
        let eps = 1e-6;
        let mut dropped = 0;
        for (which, grad, len) in [(0, &dx, x.len()), (1, &da, a.len()), (2, &db, b.len())] {
            for idx in (0..len).step_by(len / 29 + 1) {
                let mut p = [xw.clone(), aw.clone(), bw.clone()];
                p[which][idx] += eps;
                let up = loss(&p[0], &p[1], &p[2]);
                p[which][idx] -= 2.0 * eps;
                let down = loss(&p[0], &p[1], &p[2]);
                let fd = (up - down) / (2.0 * eps);
                let g = grad[idx] as f64;
                assert!(
                    (g - fd).abs() <= 1e-4 * (1.0 + fd.abs()),
                    "operand {which} element {idx} ({d:?}): kernel {g}, finite difference {fd}"
                );
                dropped += (which == 0 && fd == 0.0) as usize;
            }
        }
        // With dropout, some of the x checked were dropped (their gradient exactly 0).
        assert_eq!(
            dropped > 0,
            d.is_some(),
            "x elements with no gradient: {dropped}"
        );
    }

    /// The mask drops close to p of the elements (binomial: within 5 standard deviations)
    /// and keeps the others scaled by 1 / (1 - p); a mask differs with the seed (the step),
    /// the salt (the adapter) and the first element (the micro-batch), and is a pure function
    /// of them.
    #[test]
    fn masks_drop_p_and_differ_by_step_adapter_and_rows() {
        let len = 1 << 16;
        let x = vec![1.0f32; len];
        let draw = |d: Dropout| {
            let mut xd = vec![f32::NAN; len];
            d.apply(&x, &mut xd);
            xd
        };
        for p in [0.05f32, 0.1, 0.5, 0.9] {
            let xd = draw(Dropout::new(p, 1, 0, 0));
            let dropped = xd.iter().filter(|&&v| v == 0.0).count() as f64;
            let sd = (len as f64 * p as f64 * (1.0 - p as f64)).sqrt();
            assert!(
                (dropped - p as f64 * len as f64).abs() < 5.0 * sd,
                "p {p}: {dropped} of {len} dropped"
            );
            let kept = 1.0 / (1.0 - p);
            assert!(
                xd.iter().all(|&v| v == 0.0 || v == kept),
                "p {p}: a value not 0 or {kept}"
            );
        }
        let base = draw(Dropout::new(0.1, 1, 0, 0));
        assert_eq!(
            base,
            draw(Dropout::new(0.1, 1, 0, 0)),
            "the same mask drawn again"
        );
        for (what, other) in [
            ("another step", Dropout::new(0.1, 2, 0, 0)),
            ("another adapter", Dropout::new(0.1, 1, 1, 0)),
            ("another micro-batch", Dropout::new(0.1, 1, 0, len as u64)),
        ] {
            let other = draw(other);
            let same = (base.iter().zip(&other))
                .filter(|(a, b)| (**a == 0.0) == (**b == 0.0))
                .count();
            // Independent masks agree on p² + (1-p)² = 82% of the elements.
            assert!(
                (same as f64 / len as f64 - 0.82).abs() < 0.01,
                "{what}: {same} of {len} elements masked alike"
            );
        }
        // The mask of an element is its place in the batch: a call starting at row k sees
        // the rows k.. of a call starting at 0.
        let shifted = draw(Dropout::new(0.1, 1, 0, 1000));
        assert_eq!(shifted[..len - 1000], base[1000..]);
    }

    /// The backward masks the input gradient with the forward's mask: the elements it adds
    /// to are exactly those the forward kept.
    #[test]
    fn backward_masks_as_the_forward() {
        let (n, ic, oc, r) = SHAPE;
        let mut rng = Rng::new(3);
        let (x, a, b) = (
            rand(&mut rng, n * ic),
            rand(&mut rng, r * ic),
            rand(&mut rng, oc * r),
        );
        let dy = rand(&mut rng, n * COLS.1);
        let d = mask();
        let (mut xd, mut ws) = (vec![0.0f32; n * ic], Vec::new());
        let (mut y, mut h) = (vec![0.0f32; n * COLS.1], vec![0.0f32; n * r]);
        lora_forward(
            &mut y,
            &mut h,
            &x,
            &a,
            &b,
            SHAPE,
            COLS,
            1.0,
            Some((&d, &mut xd)),
            &mut ws,
        );
        let kept: Vec<bool> = xd.iter().map(|&v| v != 0.0).collect();
        let (mut dx, mut da, mut db, mut dh) = (
            vec![0.0f32; n * ic],
            vec![0.0f32; r * ic],
            vec![0.0f32; oc * r],
            vec![0.0; n * r],
        );
        lora_backward(
            &mut dx,
            &mut da,
            &mut db,
            &mut dh,
            &dy,
            &x,
            &h,
            &a,
            &b,
            SHAPE,
            COLS,
            1.0,
            Some((&d, &mut xd)),
            &mut ws,
        );
        let touched: Vec<bool> = dx.iter().map(|&v| v != 0.0).collect();
        assert_eq!(touched, kept);
        assert!(kept.iter().any(|k| !k) && kept.iter().any(|&k| k));
    }
}
