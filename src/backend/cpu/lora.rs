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
//! A and B are the adapters' f32 (master) weights; x, y, h and their gradients are the
//! storage type. Nothing here allocates: `dh` and the mixed GEMM's tiles come in as slices.

use super::gemm::mixed::gemm_mixed;
use crate::dtype::Elem;

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
    ws: &mut [f32], // [gemm_mixed_workspace_len()] unless T is f32
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
    // h[N, r] = inp[N, IC] @ aᵀ, then scaled.
    gemm_mixed(n, r, ic, inp, ic, false, a, ic, true, h, r, false, ws);
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
    ws: &mut [f32], // [gemm_mixed_workspace_len()] unless T is f32
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
    // da[r, IC] += dhᵀ[r, N] @ inp[N, IC]; dinp[N, IC] += dh[N, r] @ a[r, IC].
    gemm_mixed(r, ic, n, &*dh, r, true, inp, ic, false, da, ic, true, ws);
    gemm_mixed(n, ic, r, &*dh, r, false, a, ic, false, dinp, ic, true, ws);
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
/// `T` as the fast kernel stores it).
pub mod naive {
    use crate::dtype::Elem;

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
    ) {
        let f = |x: T| x.to_f32() as f64;
        for i in 0..n {
            for k in 0..r {
                let s: f64 = (0..ic)
                    .map(|j| f(inp[i * ic + j]) * a[k * ic + j] as f64)
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
                let s: f64 = (0..n).map(|i| dh[i * r + k] * f(inp[i * ic + j])).sum();
                da[k * ic + j] = T::from_f32((f(da[k * ic + j]) + s) as f32);
            }
        }
        for i in 0..n {
            for j in 0..ic {
                let s: f64 = (0..r).map(|k| dh[i * r + k] * a[k * ic + j] as f64).sum();
                dinp[i * ic + j] = T::from_f32((f(dinp[i * ic + j]) + s) as f32);
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

    /// The fast kernels agree with their twins, f32 (to rounding) and bf16 (to its
    /// precision), forward and backward.
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
        fn run<T: Elem>(v: [&[f32]; 8], tol: f32) {
            let t = |s: &[f32]| s.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
            let [x, a, b, y0, dy, dx0, da0, db0] = v;
            let mut ws = vec![0.0; gemm_mixed_workspace_len()];
            let (mut y, mut h) = (t(y0), vec![T::from_f32(0.0); SHAPE.0 * SHAPE.3]);
            let (mut yn, mut hn) = (y.clone(), h.clone());
            lora_forward(&mut y, &mut h, &t(x), a, b, SHAPE, COLS, 2.0, &mut ws);
            naive::lora_forward(&mut yn, &mut hn, &t(x), a, b, SHAPE, COLS, 2.0);
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
            );
            close(&dx, &dxn, tol, "dx");
            close(&da, &dan, tol, "da");
            close(&db, &dbn, tol, "db");
        }
        let v = [&x[..], &a, &b, &y0, &dy, &dx0, &da0, &db0];
        run::<f32>(v, 1e-5);
        run::<bf16>(v, 2e-2);
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
    /// `L = Σ dy ⊙ y(x, A, B)` in f64 through the naive forward, against the kernel's
    /// gradients, for a few elements of x, A and B.
    #[test]
    fn backward_is_the_gradient_of_the_forward() {
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
        // L in f64, h unrounded.
        let loss = |x: &[f64], a: &[f64], b: &[f64]| -> f64 {
            let mut l = 0.0;
            for i in 0..n {
                let h: Vec<f64> = (0..r)
                    .map(|k| {
                        scale as f64 * (0..ic).map(|j| x[i * ic + j] * a[k * ic + j]).sum::<f64>()
                    })
                    .collect();
                for o in 0..oc {
                    let y: f64 = (0..r).map(|k| h[k] * b[o * r + k]).sum();
                    l += y * dy[i * ldo + col + o] as f64;
                }
            }
            l
        };
        let mut ws = Vec::new();
        let (mut y, mut h) = (vec![0.0f32; n * ldo], vec![0.0f32; n * r]);
        lora_forward(&mut y, &mut h, &x, &a, &b, SHAPE, COLS, scale, &mut ws);
        let (mut dx, mut da, mut db, mut dh) = (
            vec![0.0f32; n * ic],
            vec![0.0f32; r * ic],
            vec![0.0f32; oc * r],
            vec![0.0; n * r],
        );
        lora_backward(
            &mut dx, &mut da, &mut db, &mut dh, &dy, &x, &h, &a, &b, SHAPE, COLS, scale, &mut ws,
        );
        let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let (xw, aw, bw) = (wide(&x), wide(&a), wide(&b));
        let eps = 1e-6;
        for (which, grad, len) in [(0, &dx, x.len()), (1, &da, a.len()), (2, &db, b.len())] {
            for idx in (0..len).step_by(len / 7 + 1) {
                let mut p = [xw.clone(), aw.clone(), bw.clone()];
                p[which][idx] += eps;
                let up = loss(&p[0], &p[1], &p[2]);
                p[which][idx] -= 2.0 * eps;
                let down = loss(&p[0], &p[1], &p[2]);
                let fd = (up - down) / (2.0 * eps);
                let g = grad[idx] as f64;
                assert!(
                    (g - fd).abs() <= 1e-4 * (1.0 + fd.abs()),
                    "operand {which} element {idx}: kernel {g}, finite difference {fd}"
                );
            }
        }
    }
}
