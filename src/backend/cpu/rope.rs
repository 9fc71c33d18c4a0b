//! Rotary position embedding (RoPE), transformers' rotate-half convention, in place on the
//! fused q|k|v activation `[B, T, width]`, `width = (NH + 2·NKV)·hd`: each row holds NH query
//! heads, then NKV key heads, then NKV value heads, `hd` channels each. The first `rotated`
//! channels of a row (`(NH + NKV)·hd`: queries and keys) are rotated head by head; the values
//! are untouched. Inside a head, element `i < hd/2` is paired with element `i + hd/2`
//! (transformers' `rotate_half`, `modeling_llama.py`), at angle `θ = pos · inv_freq[i]` with
//! `pos = pos0 + t` (`t` the row's position in its sequence; rows are `b·T + t`), or, for rows
//! that pack several examples, `pos = pos0 + positions[b·T + t]` (the row's position inside its
//! example, so each example's positions restart at 0):
//! `x'[i] = x[i]·cos θ − x[i+hd/2]·sin θ`, `x'[i+hd/2] = x[i+hd/2]·cos θ + x[i]·sin θ`.
//! The backward applies the inverse (transposed) rotation, angle `−θ`, to the gradient, in
//! place. `inv_freq` (`θ_base^(−2i/hd)`, with any llama3 scaling) comes from
//! `model::rope`; transformers' `attention_scaling` (1 for the default and llama3 rope types)
//! is not applied here.
//!
//! Angles as transformers computes them: `(pos as f32) · inv_freq[i]`, an f32 product. Their
//! cosine and sine are computed in f64 from that f32 angle and rounded to f32: this gives the
//! correctly rounded f32 value (up to the rare f64 near-tie), the same on every machine and
//! libm, and at most half an ulp from the exact cos/sin of the f32 angle, which is as close
//! as any f32 implementation (PyTorch's vectorised `cosf`, CUDA's) can be. The cost is small:
//! `hd/2` pairs per row, computed once on the stack and applied to all `NH + NKV` heads.
//!
//! Parallel over fixed row chunks, no allocation, no reduction: identical results for any
//! thread count. Storage type `T` ([`Elem`]: f32, bf16, f16): each element is widened to f32,
//! rotated in f32 and rounded once, so the result for any `T` is the f32 kernel's result on
//! the widened input, rounded to `T`. (transformers, under half precision, rounds cos and sin
//! to the activation's type and rounds each product; here there is one rounding.)

use super::features::multiversion;
use super::reduce::rows_per_task;
use crate::dtype::Elem;
use rayon::prelude::*;

/// Largest head size the kernels accept (their cos/sin tables live on the stack).
pub const MAX_HEAD_DIM: usize = 512;

/// Rotates the queries and keys of `x` by their positions, in place.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward<T: Elem>(
    x: &mut [T], // [B, T, width] rotated in place
    b: usize,
    t: usize,
    width: usize,
    rotated: usize,
    hd: usize,
    inv_freq: &[f32], // [hd/2]
    scale: f32,
    pos0: usize,
    positions: Option<&[u32]>, // [B, T] position inside the row's example (packed rows)
) {
    rope(
        x,
        b,
        t,
        width,
        rotated,
        hd,
        (inv_freq, scale),
        (pos0, positions),
        false,
        "rope_forward",
    );
}

/// The inverse rotation (angle −θ), in place: on entry `dx` holds the gradient with respect
/// to the rotated values, on exit the gradient with respect to the un-rotated ones (the
/// rotation is linear and orthogonal, so its Jacobian's transpose is its inverse).
#[allow(clippy::too_many_arguments)]
pub fn rope_backward<T: Elem>(
    dx: &mut [T], // [B, T, width] in: dL/d(rotated), out: dL/d(un-rotated)
    b: usize,
    t: usize,
    width: usize,
    rotated: usize,
    hd: usize,
    inv_freq: &[f32], // [hd/2]
    scale: f32,
    pos0: usize,
    positions: Option<&[u32]>, // [B, T] position inside the row's example (packed rows)
) {
    rope(
        dx,
        b,
        t,
        width,
        rotated,
        hd,
        (inv_freq, scale),
        (pos0, positions),
        true,
        "rope_backward",
    );
}

#[allow(clippy::too_many_arguments)]
fn rope<T: Elem>(
    x: &mut [T], // [B, T, width]
    b: usize,
    t: usize,
    width: usize,
    rotated: usize,
    hd: usize,
    (inv_freq, scale): (&[f32], f32),           // inv_freq: [hd/2]
    (pos0, positions): (usize, Option<&[u32]>), // positions: [B, T]
    inverse: bool,
    name: &str,
) {
    assert_eq!(x.len(), b * t * width, "{name}: x");
    assert!(
        positions.is_none_or(|p| p.len() == b * t),
        "{name}: positions must be [B, T]"
    );
    assert!(
        hd >= 2 && hd.is_multiple_of(2) && hd <= MAX_HEAD_DIM,
        "{name}: head size {hd} must be even, 2..={MAX_HEAD_DIM}"
    );
    assert_eq!(inv_freq.len(), hd / 2, "{name}: inv_freq");
    assert!(
        rotated <= width && rotated.is_multiple_of(hd),
        "{name}: rotated {rotated} must be whole heads of {hd} within the width {width}"
    );
    if x.is_empty() || rotated == 0 {
        return;
    }
    let rows = rows_per_task(width);
    x.par_chunks_mut(rows * width)
        .enumerate()
        .for_each(|(k, x)| {
            let r0 = k * rows;
            let given = positions.map(|p| &p[r0..r0 + x.len() / width]);
            rotate_rows(
                x, r0, t, width, rotated, hd, inv_freq, scale, pos0, given, inverse,
            )
        });
}

multiversion! {
    /// Rotates a few whole rows, the first of them row `r0` of the batch.
    fn rotate_rows<T: Elem>(
        x: &mut [T],      // [rows, width]
        r0: usize,
        t: usize,
        width: usize,
        rotated: usize,
        hd: usize,
        inv_freq: &[f32], // [hd/2]
        scale: f32,
        pos0: usize,
        positions: Option<&[u32]>, // [rows]: these rows' positions inside their examples
        inverse: bool,
    ) {
        let half = hd / 2;
        let mut cos = [0.0f32; MAX_HEAD_DIM / 2];
        let mut sin = [0.0f32; MAX_HEAD_DIM / 2];
        let (cos, sin) = (&mut cos[..half], &mut sin[..half]);
        for (i, row) in x.chunks_exact_mut(width).enumerate() {
            let within = match positions {
                Some(p) => p[i] as usize,
                None => (r0 + i) % t,
            };
            let pos = (pos0 + within) as f32;
            for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
                let angle = (pos * f) as f64;
                // Scaled as transformers scales them: the f32 cosine times the f32 scale.
                *c = angle.cos() as f32 * scale;
                // The inverse rotation: sin(−θ) = −sin θ, exactly.
                let sn = angle.sin() as f32 * scale;
                *s = if inverse { -sn } else { sn };
            }
            for head in row[..rotated].chunks_exact_mut(hd) {
                let (lo, hi) = head.split_at_mut(half);
                let it = lo.iter_mut().zip(hi.iter_mut()).zip(cos.iter()).zip(sin.iter());
                for (((a, b), &c), &s) in it {
                    let (xa, xb) = (a.to_f32(), b.to_f32());
                    *a = T::from_f32(xa * c - xb * s);
                    *b = T::from_f32(xb * c + xa * s);
                }
            }
        }
    }
}

/// Reference twins: plain loops, the rotation in f64 (the angle in f32, as specified).
pub mod naive {
    /// (cos θ, sin θ) of the f32 angle `pos · inv_freq`, in f64.
    pub fn cos_sin(pos: usize, inv_freq: f32) -> (f64, f64) {
        let angle = (pos as f32 * inv_freq) as f64;
        (angle.cos(), angle.sin())
    }

    /// `x` rotated by `+θ` (forward) or by `−θ` (`inverse`: the backward).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        x: &mut [f32], // [B, T, width]
        b: usize,
        t: usize,
        width: usize,
        rotated: usize,
        hd: usize,
        inv_freq: &[f32], // [hd/2]
        scale: f32,
        pos0: usize,
        positions: Option<&[u32]>, // [B, T] positions inside the rows' examples
        inverse: bool,
    ) {
        let half = hd / 2;
        for bi in 0..b {
            for ti in 0..t {
                let row = &mut x[(bi * t + ti) * width..(bi * t + ti + 1) * width];
                for h in 0..rotated / hd {
                    for (i, &f) in inv_freq.iter().enumerate() {
                        let within = positions.map_or(ti, |p| p[bi * t + ti] as usize);
                        let (c, s) = cos_sin(pos0 + within, f);
                        let (c, s) = (c * scale as f64, s * scale as f64);
                        let (ia, ib) = (h * hd + i, h * hd + i + half);
                        let (xa, xb) = (row[ia] as f64, row[ib] as f64);
                        let (ya, yb) = if inverse {
                            // The transpose of [[c, −s], [s, c]].
                            (c * xa + s * xb, -s * xa + c * xb)
                        } else {
                            (c * xa - s * xb, s * xa + c * xb)
                        };
                        row[ia] = ya as f32;
                        row[ib] = yb as f32;
                    }
                }
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

    /// A RoPE shape: (B, T, NH, NKV, hd, pos0).
    #[derive(Clone, Copy, Debug)]
    struct Shape {
        b: usize,
        t: usize,
        nh: usize,
        nkv: usize,
        hd: usize,
        pos0: usize,
    }

    impl Shape {
        const fn new(b: usize, t: usize, nh: usize, nkv: usize, hd: usize, pos0: usize) -> Self {
            Shape {
                b,
                t,
                nh,
                nkv,
                hd,
                pos0,
            }
        }
        fn width(&self) -> usize {
            (self.nh + 2 * self.nkv) * self.hd
        }
        fn rotated(&self) -> usize {
            (self.nh + self.nkv) * self.hd
        }
        fn len(&self) -> usize {
            self.b * self.t * self.width()
        }
        /// transformers' default inverse frequencies, θ^(−2i/hd) (here θ = 10,000).
        fn inv_freq(&self) -> Vec<f32> {
            (0..self.hd / 2)
                .map(|i| 10_000f64.powf(-2.0 * i as f64 / self.hd as f64) as f32)
                .collect()
        }
        fn fwd<T: Elem>(&self, x: &mut [T]) {
            let f = self.inv_freq();
            let (w, r) = (self.width(), self.rotated());
            rope_forward(x, self.b, self.t, w, r, self.hd, &f, 1.0, self.pos0, None);
        }
        fn bwd<T: Elem>(&self, x: &mut [T]) {
            let f = self.inv_freq();
            let (w, r) = (self.width(), self.rotated());
            rope_backward(x, self.b, self.t, w, r, self.hd, &f, 1.0, self.pos0, None);
        }
        fn naive(&self, x: &mut [f32], inverse: bool) {
            let f = self.inv_freq();
            let (w, r) = (self.width(), self.rotated());
            naive::rope(
                x, self.b, self.t, w, r, self.hd, &f, 1.0, self.pos0, None, inverse,
            );
        }
    }

    const SHAPES: [Shape; 7] = [
        Shape::new(1, 1, 1, 1, 2, 0),
        Shape::new(2, 5, 2, 1, 4, 0),
        Shape::new(3, 7, 4, 2, 6, 3),
        Shape::new(2, 33, 9, 3, 64, 0), // SmolLM2-135M's heads
        Shape::new(1, 17, 4, 4, 128, 1000),
        Shape::new(2, 3, 2, 1, 512, 8190),
        Shape::new(1, 300, 8, 2, 16, 0), // several row chunks
    ];

    #[test]
    fn forward_and_backward_match_naive() {
        for (si, s) in SHAPES.iter().enumerate() {
            let x = randn(s.len(), 1.5, si as u64);
            for inverse in [false, true] {
                let (mut a, mut b) = (x.clone(), x.clone());
                if inverse {
                    s.bwd(&mut a)
                } else {
                    s.fwd(&mut a)
                }
                s.naive(&mut b, inverse);
                assert_close(&a, &b, 2e-6, 2e-6, &format!("{s:?} inverse {inverse}"));
            }
        }
    }

    /// Values (and anything past `rotated`) are never touched, bitwise.
    #[test]
    fn values_untouched() {
        for (si, s) in SHAPES.iter().enumerate() {
            let x = randn(s.len(), 1.0, 40 + si as u64);
            for inverse in [false, true] {
                let mut y = x.clone();
                if inverse {
                    s.bwd(&mut y)
                } else {
                    s.fwd(&mut y)
                }
                let (w, r) = (s.width(), s.rotated());
                for (xr, yr) in x.chunks_exact(w).zip(y.chunks_exact(w)) {
                    assert_eq!(bits(&xr[r..]), bits(&yr[r..]), "{s:?}");
                }
                // The queries and keys did change (nothing silently skipped) past
                // position 0, where the rotation is the identity.
                if s.t > 1 {
                    assert_ne!(bits(&x[w..w + r]), bits(&y[w..w + r]), "{s:?} row 1");
                }
            }
        }
    }

    /// hd = 2, inv_freq = [π/2], B = 2, T = 3: row t of each sequence turns by t·90°.
    #[test]
    fn hand_computed_quarter_turns() {
        let (b, t, width, hd) = (2, 3, 6, 2); // NH = NKV = 1: q, k, v of 2 channels each
        let f = [std::f32::consts::FRAC_PI_2];
        let row = [2.0f32, 3.0, -1.0, 0.5, 7.0, 8.0];
        let mut x: Vec<f32> = row.repeat(b * t);
        rope_forward(&mut x, b, t, width, 4, hd, &f, 1.0, 0, None);
        let want: [[f32; 6]; 3] = [
            [2.0, 3.0, -1.0, 0.5, 7.0, 8.0],   // 0°: the identity, exactly
            [-3.0, 2.0, -0.5, -1.0, 7.0, 8.0], // 90°: (a, b) → (−b, a)
            [-2.0, -3.0, 1.0, -0.5, 7.0, 8.0], // 180°: (a, b) → (−a, −b)
        ];
        for (r, got) in x.chunks_exact(width).enumerate() {
            // Positions restart at each sequence of the batch.
            assert_close(got, &want[r % t], 1e-6, 0.0, &format!("row {r}"));
        }
        assert_eq!(&x[..width], &row, "position 0 is bitwise unchanged");
        // pos0 = 1 shifts every row by one quarter turn: row 0 now turns by 90°.
        let mut x: Vec<f32> = row.repeat(b * t);
        rope_forward(&mut x, b, t, width, 4, hd, &f, 1.0, 1, None);
        assert_close(&x[..width], &want[1], 1e-6, 0.0, "pos0 = 1");
        // And the backward turns back.
        rope_backward(&mut x, b, t, width, 4, hd, &f, 1.0, 1, None);
        assert_close(&x, &row.repeat(b * t), 1e-6, 0.0, "backward");
    }

    /// Packed rows: each example's rows turn as the same example alone at the start of a
    /// sequence (bitwise: a row's rotation depends only on its position), and the naive twin
    /// agrees with the given positions.
    #[test]
    fn given_positions_restart_at_each_example() {
        let s = Shape::new(2, 13, 3, 1, 8, 0);
        let (w, r, f) = (s.width(), s.rotated(), s.inv_freq());
        // Row 0: examples of 5, 1 and 7 tokens; row 1: one of 13.
        let lens: [&[usize]; 2] = [&[5, 1, 7], &[13]];
        let positions: Vec<u32> = lens
            .iter()
            .flat_map(|l| l.iter().flat_map(|&n| 0..n as u32))
            .collect();
        let x = randn(s.len(), 1.0, 77);
        for inverse in [false, true] {
            let mut packed = x.clone();
            let rotate = if inverse {
                rope_backward::<f32>
            } else {
                rope_forward::<f32>
            };
            rotate(
                &mut packed,
                s.b,
                s.t,
                w,
                r,
                s.hd,
                &f,
                1.0,
                0,
                Some(&positions),
            );
            let mut naive_packed = x.clone();
            naive::rope(
                &mut naive_packed,
                s.b,
                s.t,
                w,
                r,
                s.hd,
                &f,
                1.0,
                0,
                Some(&positions),
                inverse,
            );
            assert_close(
                &packed,
                &naive_packed,
                1e-6,
                1e-6,
                "packed against the naive twin",
            );
            let mut row0 = 0;
            for l in lens {
                for &n in l {
                    let mut alone = x[row0 * w..(row0 + n) * w].to_vec();
                    rotate(&mut alone, 1, n, w, r, s.hd, &f, 1.0, 0, None);
                    assert_eq!(
                        bits(&packed[row0 * w..(row0 + n) * w]),
                        bits(&alone),
                        "example of {n} rows at row {row0} (inverse {inverse})"
                    );
                    row0 += n;
                }
            }
        }
    }

    /// backward ∘ forward and forward ∘ backward are the identity, within rounding.
    #[test]
    fn backward_inverts_forward() {
        for (si, s) in SHAPES.iter().enumerate() {
            let x = randn(s.len(), 1.0, 10 + si as u64);
            let mut y = x.clone();
            s.fwd(&mut y);
            s.bwd(&mut y);
            assert_close(&y, &x, 1e-6, 1e-6, &format!("bwd∘fwd {s:?}"));
            let mut y = x.clone();
            s.bwd(&mut y);
            s.fwd(&mut y);
            assert_close(&y, &x, 1e-6, 1e-6, &format!("fwd∘bwd {s:?}"));
        }
    }

    /// The backward is the transpose of the forward: ⟨R x, y⟩ = ⟨x, Rᵀ y⟩.
    #[test]
    fn backward_is_the_transpose() {
        for (si, s) in SHAPES.iter().enumerate() {
            let x = randn(s.len(), 1.0, 20 + si as u64);
            let y = randn(s.len(), 1.0, 30 + si as u64);
            let (mut rx, mut rty) = (x.clone(), y.clone());
            s.fwd(&mut rx);
            s.bwd(&mut rty);
            let (lhs, rhs) = (dot(&rx, &y), dot(&x, &rty));
            let tol = 1e-5 * (s.len() as f64).sqrt();
            assert!((lhs - rhs).abs() <= tol, "{s:?}: {lhs} vs {rhs}");
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        for s in [SHAPES[1], SHAPES[2]] {
            let x = randn(s.len(), 1.0, 50);
            let g = randn(s.len(), 1.0, 51);
            let mut d = g.clone();
            s.bwd(&mut d);
            let fd = fd_grad(&x, 1e-2, |x| {
                let mut y = x.to_vec();
                s.naive(&mut y, false);
                dot(&g, &y)
            });
            assert_close(&d, &fd, 1e-3, 1e-3, &format!("{s:?} vs fd"));
        }
    }

    /// Every shape, forward then backward, stored as bf16 / f16: the f32 kernel on the
    /// widened input, rounded once; thread invariant.
    struct Narrow(Shape);

    impl Case for Narrow {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let s = self.0;
            let mut x: Vec<S> = stored::<T, S>(&randn(s.len(), 2.0, 60));
            s.fwd(&mut x);
            let mut d: Vec<S> = stored::<T, S>(&randn(s.len(), 2.0, 61));
            s.bwd(&mut d);
            vec![Out::stored("forward", &x), Out::stored("backward", &d)]
        }
    }

    #[test]
    fn bf16_is_f32_rounded() {
        for s in SHAPES {
            check_stored_as::<bf16>(&Narrow(s), &format!("rope {s:?}"));
        }
    }

    #[test]
    fn f16_is_f32_rounded() {
        for s in SHAPES {
            check_stored_as::<f16>(&Narrow(s), &format!("rope {s:?}"));
        }
    }

    #[test]
    fn identical_for_any_thread_count() {
        let s = SHAPES[6];
        let run = || {
            let mut x = randn(s.len(), 1.0, 70);
            s.fwd(&mut x);
            s.bwd(&mut x[..]);
            bits(&x)
        };
        let a = with_threads(1, run);
        assert!(a == with_threads(2, run) && a == with_threads(3, run));
    }

    /// f32 and bf16 outputs (bit patterns) on fixed inputs.
    fn isa_run() -> Vec<Vec<u32>> {
        let mut all = Vec::new();
        for s in [SHAPES[3], SHAPES[6]] {
            let mut x = randn(s.len(), 1.0, 80);
            s.fwd(&mut x);
            all.push(bits(&x));
            s.bwd(&mut x);
            all.push(bits(&x));
            let mut x: Vec<bf16> = narrow_vec(&randn(s.len(), 1.0, 81));
            s.fwd(&mut x);
            s.bwd(&mut x);
            all.push(bits(&x));
        }
        all
    }

    /// Bit-identical results on every instruction set this CPU has.
    #[test]
    fn isa_invariant() {
        conformance::isa_invariant(&isas_here(), isa_run, "rope");
    }

    /// The AVX-512 variants against the baseline (fails on a CPU without AVX-512F).
    #[test]
    #[ignore = "needs AVX-512F"]
    fn isa_invariant_avx512() {
        conformance::isa_invariant(&[Isa::Avx512], isa_run, "rope");
    }

    /// A NaN poisons exactly its pair (itself and its partner hd/2 away), nothing else.
    #[test]
    fn non_finite_stays_local() {
        let s = SHAPES[2];
        let (w, hd) = (s.width(), s.hd);
        let mut x: Vec<bf16> = narrow_vec(&randn(s.len(), 1.0, 90));
        let bad = 4 * w + hd + 1; // row 4, head 1, element 1
        x[bad] = bf16::NAN;
        s.fwd(&mut x);
        for (i, v) in x.iter().enumerate() {
            let poisoned = i == bad || i == bad + hd / 2;
            assert_eq!(v.is_nan(), poisoned, "element {i}");
        }
        s.bwd(&mut x);
        assert_eq!(x.iter().filter(|v| v.is_nan()).count(), 2);
    }

    /// LongRoPE's scale multiplies the rotated channels (cosine and sine alike), in the
    /// forward and in the backward (the transpose of s·R is s·Rᵀ), and leaves the values; the
    /// naive twin agrees.
    #[test]
    fn a_scale_multiplies_the_rotated_channels() {
        let s = Shape::new(2, 9, 3, 1, 8, 5);
        let (w, r, f) = (s.width(), s.rotated(), s.inv_freq());
        let scale = 1.190_238_1f32;
        let x = randn(s.len(), 1.0, 5);
        for inverse in [false, true] {
            let rotate = if inverse {
                rope_backward::<f32>
            } else {
                rope_forward::<f32>
            };
            let (mut plain, mut scaled) = (x.clone(), x.clone());
            rotate(&mut plain, s.b, s.t, w, r, s.hd, &f, 1.0, s.pos0, None);
            rotate(&mut scaled, s.b, s.t, w, r, s.hd, &f, scale, s.pos0, None);
            for (row, (p, q)) in plain.chunks(w).zip(scaled.chunks(w)).enumerate() {
                let want: Vec<f32> = p[..r].iter().map(|v| v * scale).collect();
                assert_close(&q[..r], &want, 1e-6, 1e-6, &format!("row {row}"));
                assert_eq!(&q[r..], &x[row * w + r..(row + 1) * w], "values untouched");
            }
            let mut naive_scaled = x.clone();
            naive::rope(
                &mut naive_scaled,
                s.b,
                s.t,
                w,
                r,
                s.hd,
                &f,
                scale,
                s.pos0,
                None,
                inverse,
            );
            assert_close(&scaled, &naive_scaled, 1e-6, 1e-6, "naive twin");
        }
    }

    #[test]
    #[should_panic(expected = "head size")]
    fn rejects_odd_head_size() {
        let mut x = vec![0.0f32; 6];
        rope_forward(&mut x, 1, 1, 6, 3, 3, &[1.0], 1.0, 0, None);
    }

    #[test]
    #[should_panic(expected = "head size")]
    fn rejects_huge_head_size() {
        let hd = 2 * MAX_HEAD_DIM;
        let mut x = vec![0.0f32; hd];
        rope_forward(&mut x, 1, 1, hd, hd, hd, &vec![1.0; hd / 2], 1.0, 0, None);
    }
}
