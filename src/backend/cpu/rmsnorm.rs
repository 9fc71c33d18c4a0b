//! RMS normalisation over the channel dimension of `[N, C]` rows (Llama's norm, as
//! transformers' `LlamaRMSNorm` computes it): `out = x · rstd · gain`,
//! `rstd = 1 / sqrt(mean(x²) + eps)`, statistics in f32; no mean subtraction, no bias. The
//! gain ([`Gain`]) is the weight, or Gemma's `1 + weight` (`Gemma3RMSNorm`, whose weights
//! start at 0); the forward may add a residual to its output (Gemma's post-norms:
//! `residual + post_attention_layernorm(o)`).
//!
//! Forward is parallel over rows; `Σ x²` is an f32 sum in 16 lanes. Backward runs two
//! parallel passes with no workspace: one over rows for the input gradient (which
//! accumulates, `+=`, because the executor feeds the residual-stream gradient through it) and
//! one over fixed column slices for the weight gradient, each slice walking all rows in
//! order, so every result is identical for any thread count.
//!
//! Qwen3's per-head norm of fused q|k|v rows ([`qk_norm_forward`], [`qk_norm_backward`]) is
//! the same arithmetic on each query and key head of hd channels (one statistic a head), the
//! query heads scaled by `q_norm`, the key heads by `k_norm`, the value heads copied; its
//! backward replaces the output's gradient by the input's in place.
//!
//! Storage type `T` ([`Elem`]: f32, bf16, f16) for activations and gradients, `W` for the
//! weight (the fp32 master weight under mixed precision); `rstd` stays f32. Elements are
//! widened to f32 as they are read, all arithmetic and accumulation is f32, and each stored
//! element is rounded to `T` once per call (the accumulating gradients as
//! `T::from_f32(old + sum)`), so the result for any `T` is the f32 kernel's result on the
//! widened inputs, rounded to `T`. (transformers, given a half-precision input, rounds
//! `x · rstd` to the input's type before multiplying by the weight; here that product is
//! rounded once, after the weight.)

use super::features::multiversion;
use super::reduce::{COL_CHUNK, rows_per_task, sum_f32, sum_sq_dev_f32};
use crate::dtype::Elem;
use rayon::prelude::*;
use std::ops::Range;

/// A norm's per-channel gain: `offset + w` (Gemma's `1 + w`; the weight itself with offset
/// 0, where adding +0 changes no value but a −0 weight's sign).
#[derive(Clone, Copy, Debug)]
pub struct Gain<'a, W> {
    pub w: &'a [W],
    pub offset: f32,
}

impl<'a, W: Elem> Gain<'a, W> {
    /// The weight itself (Llama's, GPT-2's).
    pub fn plain(w: &'a [W]) -> Self {
        Gain { w, offset: 0.0 }
    }

    pub fn len(&self) -> usize {
        self.w.len()
    }

    pub fn is_empty(&self) -> bool {
        self.w.is_empty()
    }

    /// The gains of channels `r` (a head's, a lane block's).
    fn slice(&self, r: Range<usize>) -> Gain<'a, W> {
        Gain {
            w: &self.w[r],
            offset: self.offset,
        }
    }
}

/// The gain of one weight element.
#[inline(always)]
fn gain<W: Elem>(w: W, offset: f32) -> f32 {
    w.to_f32() + offset
}

/// RMS-norm forward, `out = (residual +) x · rstd · gain`; also stores each row's 1/rms for
/// the backward pass.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward<T: Elem, W: Elem>(
    out: &mut [T],          // [N, C]
    residual: Option<&[T]>, // [N, C]
    rstd: &mut [f32],       // [N]
    inp: &[T],              // [N, C]
    weight: Gain<W>,        // [C]
    n: usize,
    c: usize,
    eps: f32,
) {
    assert_eq!(out.len(), n * c, "rmsnorm_forward: out");
    assert_eq!(rstd.len(), n, "rmsnorm_forward: rstd");
    assert_eq!(inp.len(), n * c, "rmsnorm_forward: inp");
    assert_eq!(weight.len(), c, "rmsnorm_forward: weight");
    assert!(
        residual.is_none_or(|r| r.len() == n * c),
        "rmsnorm_forward: residual"
    );
    if n == 0 || c == 0 {
        return;
    }
    let rows = rows_per_task(c);
    let work = out
        .par_chunks_mut(rows * c)
        .zip(inp.par_chunks(rows * c))
        .zip(rstd.par_chunks_mut(rows))
        .enumerate();
    work.for_each(|(i, ((out, inp), rstd))| {
        let res = residual.map(|r| &r[i * rows * c..][..out.len()]);
        forward_rows(out, res, inp, rstd, weight, c, eps)
    });
}

multiversion! {
    /// Forward over a few whole rows.
    fn forward_rows<T: Elem, W: Elem>(
        out: &mut [T],          // [rows, C]
        residual: Option<&[T]>, // [rows, C]
        inp: &[T],              // [rows, C]
        rstd: &mut [f32],       // [rows]
        weight: Gain<W>,        // [C]
        c: usize,
        eps: f32,
    ) {
        let (wt, off) = (weight.w, weight.offset);
        let it = out.chunks_exact_mut(c).zip(inp.chunks_exact(c));
        for (r, ((o, x), rs)) in it.zip(rstd.iter_mut()).enumerate() {
            // Σ (x - 0)² = Σ x²: the shared 16-lane sum of squared deviations.
            let ms = sum_sq_dev_f32(x, 0.0) / c as f32;
            let s = 1.0 / (ms + eps).sqrt();
            match residual {
                None => {
                    for ((o, &x), &w) in o.iter_mut().zip(x).zip(wt) {
                        *o = T::from_f32(x.to_f32() * s * gain(w, off));
                    }
                }
                Some(res) => {
                    let res = &res[r * c..(r + 1) * c];
                    for (((o, &x), &w), &y) in o.iter_mut().zip(x).zip(wt).zip(res) {
                        *o = T::from_f32(y.to_f32() + x.to_f32() * s * gain(w, off));
                    }
                }
            }
            *rs = s;
        }
    }
}

/// RMS-norm backward. `dinp` ACCUMULATES (`+=`), as does `dweight`. With x̂ = x·rstd and
/// g = dout·gain: dinp += rstd·(g − x̂·mean(g·x̂)), dweight += Σ_rows dout·x̂ (the offset is
/// a constant: the weight's gradient is the gain's).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward<T: Elem, W: Elem>(
    dinp: &mut [T],    // [N, C] +=
    dweight: &mut [T], // [C] +=
    dout: &[T],        // [N, C]
    inp: &[T],         // [N, C]
    weight: Gain<W>,   // [C]
    rstd: &[f32],      // [N]
    n: usize,
    c: usize,
) {
    assert_eq!(dweight.len(), c, "rmsnorm_backward: dweight");
    // Pass 1 (and the other operands' checks).
    rmsnorm_backward_input(dinp, dout, inp, weight, rstd, n, c);
    if n == 0 || c == 0 {
        return;
    }
    // Pass 2, over fixed column slices: dweight += Σ_r x̂·dout.
    dweight
        .par_chunks_mut(COL_CHUNK)
        .enumerate()
        .for_each(|(ci, dw)| backward_cols(dw, dout, inp, rstd, ci * COL_CHUNK, c));
}

/// The input gradient alone (a frozen RMS norm's backward, whose weight takes no gradient):
/// `dinp` exactly as [`rmsnorm_backward`] computes it.
pub fn rmsnorm_backward_input<T: Elem, W: Elem>(
    dinp: &mut [T],  // [N, C] +=
    dout: &[T],      // [N, C]
    inp: &[T],       // [N, C]
    weight: Gain<W>, // [C]
    rstd: &[f32],    // [N]
    n: usize,
    c: usize,
) {
    assert_eq!(dinp.len(), n * c, "rmsnorm_backward: dinp");
    assert_eq!(dout.len(), n * c, "rmsnorm_backward: dout");
    assert_eq!(inp.len(), n * c, "rmsnorm_backward: inp");
    assert_eq!(weight.len(), c, "rmsnorm_backward: weight");
    assert_eq!(rstd.len(), n, "rmsnorm_backward: rstd");
    if n == 0 || c == 0 {
        return;
    }
    // Pass 1, over rows: the input gradient.
    let rows = rows_per_task(c);
    dinp.par_chunks_mut(rows * c)
        .zip(dout.par_chunks(rows * c))
        .zip(inp.par_chunks(rows * c))
        .zip(rstd.par_chunks(rows))
        .for_each(|(((dinp, dout), inp), rstd)| backward_rows(dinp, dout, inp, rstd, weight, c));
}

/// Qwen3's q/k norm forward over fused q|k|v rows (transformers' `Qwen3Attention`:
/// `q_norm(q_proj(x).view(..., hd))`, `k_norm` likewise): each of the NH query and NKV key
/// heads of a row normalised over its hd channels with its own 1/rms (stored in `rstd`, heads
/// in row order), scaled by `weight[..hd]` (query) or `weight[hd..]` (key); the value heads
/// copied. Per head exactly [`rmsnorm_forward`]'s arithmetic.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_forward<T: Elem, W: Elem>(
    out: &mut [T],    // [N, QKV], QKV = (NH + 2·NKV)·hd
    rstd: &mut [f32], // [N, NH + NKV]
    inp: &[T],        // [N, QKV]
    weight: Gain<W>,  // [2, hd]: q_norm, k_norm
    n: usize,
    (nh, nkv, hd): (usize, usize, usize),
    eps: f32,
) {
    let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
    assert_eq!(out.len(), n * qkv, "qk_norm_forward: out");
    assert_eq!(rstd.len(), n * heads, "qk_norm_forward: rstd");
    assert_eq!(inp.len(), n * qkv, "qk_norm_forward: inp");
    assert_eq!(weight.len(), 2 * hd, "qk_norm_forward: weight");
    if n == 0 || hd == 0 {
        return;
    }
    let (wq, wk) = (weight.slice(0..hd), weight.slice(hd..2 * hd));
    let (q, k) = (nh * hd, (nh + nkv) * hd);
    let rows = rows_per_task(qkv);
    out.par_chunks_mut(rows * qkv)
        .zip(inp.par_chunks(rows * qkv))
        .zip(rstd.par_chunks_mut(rows * heads))
        .for_each(|((out, inp), rstd)| {
            let it = out.chunks_exact_mut(qkv).zip(inp.chunks_exact(qkv));
            for ((o, x), rs) in it.zip(rstd.chunks_exact_mut(heads)) {
                let (rq, rk) = rs.split_at_mut(nh);
                forward_rows(&mut o[..q], None, &x[..q], rq, wq, hd, eps);
                forward_rows(&mut o[q..k], None, &x[q..k], rk, wk, hd, eps);
                o[k..].copy_from_slice(&x[k..]);
            }
        });
}

/// [`qk_norm_forward`]'s backward. `d` `[N, QKV]` holds the gradient of the output and is
/// OVERWRITTEN with the input's (value heads unchanged: the copy's gradient is itself);
/// `dweight` `[2, hd]` ACCUMULATES (`None`: a frozen norm, input gradient only). The weight
/// gradient is read from `d` before it is overwritten, over fixed column slices walking rows
/// and heads in order, so every result is identical for any thread count.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_backward<T: Elem, W: Elem>(
    d: &mut [T],               // [N, QKV] in: dout, out: dinp
    dweight: Option<&mut [T]>, // [2, hd] +=
    inp: &[T],                 // [N, QKV]
    weight: Gain<W>,           // [2, hd]
    rstd: &[f32],              // [N, NH + NKV]
    n: usize,
    (nh, nkv, hd): (usize, usize, usize),
) {
    let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
    assert_eq!(d.len(), n * qkv, "qk_norm_backward: d");
    assert_eq!(inp.len(), n * qkv, "qk_norm_backward: inp");
    assert_eq!(weight.len(), 2 * hd, "qk_norm_backward: weight");
    assert_eq!(rstd.len(), n * heads, "qk_norm_backward: rstd");
    if n == 0 || hd == 0 {
        return;
    }
    if let Some(dw) = dweight {
        assert_eq!(dw.len(), 2 * hd, "qk_norm_backward: dweight");
        let dout: &[T] = d;
        // Column slices of q_norm's gradient, then of k_norm's: (which, first column).
        let slices: Vec<(usize, usize)> = (0..2)
            .flat_map(|which| (0..hd).step_by(COL_CHUNK).map(move |c0| (which, c0)))
            .collect();
        let sums: Vec<Vec<f32>> = slices
            .par_iter()
            .map(|&(which, c0)| {
                let w = COL_CHUNK.min(hd - c0);
                let heads_of = if which == 0 { 0..nh } else { nh..nh + nkv };
                qk_norm_cols(dout, inp, rstd, (c0, w), heads_of, (qkv, heads, hd))
            })
            .collect();
        for (&(which, c0), acc) in slices.iter().zip(&sums) {
            let dw = &mut dw[which * hd + c0..which * hd + c0 + acc.len()];
            for (g, &a) in dw.iter_mut().zip(acc) {
                *g = T::from_f32(g.to_f32() + a);
            }
        }
    }
    let (wq, wk) = (weight.slice(0..hd), weight.slice(hd..2 * hd));
    let rows = rows_per_task(qkv);
    d.par_chunks_mut(rows * qkv)
        .zip(inp.par_chunks(rows * qkv))
        .zip(rstd.par_chunks(rows * heads))
        .for_each(|((d, inp), rstd)| {
            let it = d.chunks_exact_mut(qkv).zip(inp.chunks_exact(qkv));
            for ((d, x), rs) in it.zip(rstd.chunks_exact(heads)) {
                let heads = d[..heads * hd].chunks_exact_mut(hd).zip(x.chunks_exact(hd));
                for (h, ((d, x), &s)) in heads.zip(rs).enumerate() {
                    let w = if h < nh { wq } else { wk };
                    qk_norm_head_input(d, x, w, s);
                }
            }
        });
}

/// Σ over rows and the heads `heads_of` of x̂·dout, for the columns `c0..c0 + w` of a head.
fn qk_norm_cols<T: Elem>(
    dout: &[T],   // [N, QKV]
    inp: &[T],    // [N, QKV]
    rstd: &[f32], // [N, NH + NKV]
    (c0, w): (usize, usize),
    heads_of: Range<usize>,
    (qkv, heads, hd): (usize, usize, usize),
) -> Vec<f32> {
    let mut acc = vec![0.0f32; w];
    let rows = dout.chunks_exact(qkv).zip(inp.chunks_exact(qkv));
    for ((dy, x), rs) in rows.zip(rstd.chunks_exact(heads)) {
        for h in heads_of.clone() {
            let s = rs[h];
            let at = h * hd + c0;
            let (dy, x) = (&dy[at..at + w], &x[at..at + w]);
            for ((a, &dy), &x) in acc.iter_mut().zip(dy).zip(x) {
                *a += x.to_f32() * s * dy.to_f32();
            }
        }
    }
    acc
}

/// One head's input gradient in place: `d` (dout in, dinp out) = rstd·(g − x̂·mean(g·x̂)),
/// g = w·dout, x̂ = x·rstd (as [`rmsnorm_backward_input`], overwriting).
#[inline(always)]
fn qk_norm_head_input<T: Elem, W: Elem>(
    d: &mut [T],     // [hd]
    x: &[T],         // [hd]
    weight: Gain<W>, // [hd]
    s: f32,
) {
    let mean_gn = row_sum_gn(d, x, weight, s) / d.len() as f32;
    for ((d, &x), &w) in d.iter_mut().zip(x).zip(weight.w) {
        let norm = x.to_f32() * s;
        let g = gain(w, weight.offset) * d.to_f32();
        *d = T::from_f32((g - norm * mean_gn) * s);
    }
}

multiversion! {
    /// Input gradient over a few whole rows.
    fn backward_rows<T: Elem, W: Elem>(
        dinp: &mut [T],   // [rows, C] +=
        dout: &[T],       // [rows, C]
        inp: &[T],        // [rows, C]
        rstd: &[f32],     // [rows]
        weight: Gain<W>,  // [C]
        c: usize,
    ) {
        let it = dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c));
        for (((di, dy), x), &s) in it.zip(rstd) {
            let mean_gn = row_sum_gn(dy, x, weight, s) / c as f32;
            for (((d, &dy), &x), &w) in di.iter_mut().zip(dy).zip(x).zip(weight.w) {
                let norm = x.to_f32() * s;
                let g = gain(w, weight.offset) * dy.to_f32();
                *d = T::from_f32(d.to_f32() + (g - norm * mean_gn) * s);
            }
        }
    }
}

multiversion! {
    /// Weight gradient of the columns `c0..c0 + dw.len()`, walking all rows in order.
    fn backward_cols<T: Elem>(
        dw: &mut [T],   // [w <= COL_CHUNK] +=: columns c0..c0 + w
        dout: &[T],     // [N, C]
        inp: &[T],      // [N, C]
        rstd: &[f32],   // [N]
        c0: usize,
        c: usize,
    ) {
        let w = dw.len();
        let mut acc = [0.0f32; COL_CHUNK];
        let acc = &mut acc[..w];
        let rows = dout.chunks_exact(c).zip(inp.chunks_exact(c));
        for ((dy, x), &s) in rows.zip(rstd) {
            let (dy, x) = (&dy[c0..c0 + w], &x[c0..c0 + w]);
            for ((a, &dy), &x) in acc.iter_mut().zip(dy).zip(x) {
                *a += x.to_f32() * s * dy.to_f32();
            }
        }
        for (d, &a) in dw.iter_mut().zip(acc.iter()) {
            *d = T::from_f32(d.to_f32() + a);
        }
    }
}

/// Σ (gain·dy)·(x·rstd) over one row, in 16 f32 lanes.
#[inline(always)]
fn row_sum_gn<T: Elem, W: Elem>(
    dy: &[T],        // [C]
    x: &[T],         // [C]
    weight: Gain<W>, // [C]
    s: f32,
) -> f32 {
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let off = weight.offset;
    #[inline(always)]
    fn lanes<T: Elem, W: Elem>(
        acc: &mut [f32], // [L]
        dy: &[T],        // [<= L]
        x: &[T],         // [<= L]
        w: &[W],         // [<= L]
        (s, off): (f32, f32),
    ) {
        for (((a, &dy), &x), &w) in acc.iter_mut().zip(dy).zip(x).zip(w) {
            *a += (gain(w, off) * dy.to_f32()) * (x.to_f32() * s);
        }
    }
    let w = weight.w;
    let mut it = dy
        .chunks_exact(L)
        .zip(x.chunks_exact(L))
        .zip(w.chunks_exact(L));
    for ((dy, x), w) in &mut it {
        lanes(&mut acc, dy, x, w, (s, off));
    }
    let tail = dy.len() - dy.len() % L;
    lanes(&mut acc, &dy[tail..], &x[tail..], &w[tail..], (s, off));
    sum_f32(&acc)
}

/// Reference twins: per-row loops in f64.
pub mod naive {
    use super::Gain;

    /// [`super::qk_norm_forward`], head by head in f64.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_forward(
        out: &mut [f32],   // [N, QKV]
        rstd: &mut [f32],  // [N, NH + NKV]
        inp: &[f32],       // [N, QKV]
        weight: Gain<f32>, // [2, hd]
        n: usize,
        (nh, nkv, hd): (usize, usize, usize),
        eps: f32,
    ) {
        let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
        out[..n * qkv].copy_from_slice(&inp[..n * qkv]);
        for r in 0..n {
            for h in 0..heads {
                let at = r * qkv + h * hd;
                let w = if h < nh { 0..hd } else { hd..2 * hd };
                let w = weight.slice(w);
                let mut s = [0.0f32];
                rmsnorm_forward(
                    &mut out[at..at + hd],
                    None,
                    &mut s,
                    &inp[at..at + hd],
                    w,
                    1,
                    hd,
                    eps,
                );
                rstd[r * heads + h] = s[0];
            }
        }
    }

    /// [`super::qk_norm_backward`], head by head in f64 (`d` overwritten, `dweight` +=).
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_backward(
        d: &mut [f32],       // [N, QKV]
        dweight: &mut [f32], // [2, hd] +=
        inp: &[f32],         // [N, QKV]
        weight: Gain<f32>,   // [2, hd]
        rstd: &[f32],        // [N, NH + NKV]
        n: usize,
        (nh, nkv, hd): (usize, usize, usize),
    ) {
        let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
        let mut dw = vec![0.0f64; 2 * hd];
        for r in 0..n {
            for h in 0..heads {
                let at = r * qkv + h * hd;
                let which = usize::from(h >= nh);
                let s = rstd[r * heads + h] as f64;
                for i in 0..hd {
                    dw[which * hd + i] += inp[at + i] as f64 * s * d[at + i] as f64;
                }
                let w = weight.slice(which * hd..(which + 1) * hd);
                let mut dx = vec![0.0f32; hd];
                let mut scratch = vec![0.0f32; hd];
                rmsnorm_backward(
                    &mut dx,
                    &mut scratch,
                    &d[at..at + hd],
                    &inp[at..at + hd],
                    w,
                    &[s as f32],
                    1,
                    hd,
                );
                d[at..at + hd].copy_from_slice(&dx);
            }
        }
        for (g, a) in dweight.iter_mut().zip(&dw) {
            *g = (*g as f64 + a) as f32;
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_forward(
        out: &mut [f32],          // [N, C]
        residual: Option<&[f32]>, // [N, C]
        rstd: &mut [f32],         // [N]
        inp: &[f32],              // [N, C]
        weight: Gain<f32>,        // [C]
        n: usize,
        c: usize,
        eps: f32,
    ) {
        for r in 0..n {
            let x = &inp[r * c..(r + 1) * c];
            let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c as f64;
            let s = 1.0 / (ms + eps as f64).sqrt();
            for i in 0..c {
                let g = weight.w[i] as f64 + weight.offset as f64;
                let y = residual.map_or(0.0, |res| res[r * c + i] as f64);
                out[r * c + i] = (y + x[i] as f64 * s * g) as f32;
            }
            rstd[r] = s as f32;
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        dinp: &mut [f32],    // [N, C] +=
        dweight: &mut [f32], // [C] +=
        dout: &[f32],        // [N, C]
        inp: &[f32],         // [N, C]
        weight: Gain<f32>,   // [C]
        rstd: &[f32],        // [N]
        n: usize,
        c: usize,
    ) {
        for r in 0..n {
            let s = rstd[r] as f64;
            let norm = |i: usize| inp[r * c + i] as f64 * s;
            let gain = |i: usize| weight.w[i] as f64 + weight.offset as f64;
            let g = |i: usize| gain(i) * dout[r * c + i] as f64;
            let mean_gn = (0..c).map(|i| g(i) * norm(i)).sum::<f64>() / c as f64;
            for i in 0..c {
                let d = (g(i) - norm(i) * mean_gn) * s;
                dinp[r * c + i] = (dinp[r * c + i] as f64 + d) as f32;
            }
        }
        for i in 0..c {
            let mut sw = dweight[i] as f64;
            for r in 0..n {
                sw += inp[r * c + i] as f64 * rstd[r] as f64 * dout[r * c + i] as f64;
            }
            dweight[i] = sw as f32;
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

    const SHAPES: [(usize, usize); 8] = [
        (1, 1),
        (1, 7),
        (3, 16),
        (5, 17),
        (2, 64),
        (13, 100),
        (40, 576),
        (300, 33),
    ];

    fn data(n: usize, c: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        // Rows of different scales, some far from 1, to exercise the statistics.
        let mut inp = randn(n * c, 1.0, seed);
        for (r, row) in inp.chunks_exact_mut(c.max(1)).enumerate() {
            let scale = [0.01f32, 1.0, 30.0][r % 3];
            row.iter_mut().for_each(|v| *v = *v * scale + 0.5 * scale);
        }
        let w: Vec<f32> = randn(c, 0.5, seed + 1).iter().map(|v| v + 1.0).collect();
        (inp, w)
    }

    /// Gemma's norm: the gain `1 + w` (weights near 0) and a residual added to the output,
    /// forward and backward, as the naive twin; the q/k norm's gain likewise. And offset 0 is
    /// the plain weight, bitwise.
    #[test]
    fn offset_gain_and_residual_match_naive() {
        for (si, &(n, c)) in SHAPES.iter().enumerate() {
            let (inp, w) = data(n, c, si as u64 * 10 + 3);
            let w: Vec<f32> = w.iter().map(|v| v - 1.0).collect(); // around 0
            let gain = Gain {
                w: &w[..],
                offset: 1.0,
            };
            let res = randn(n * c, 2.0, si as u64);
            let (mut o1, mut r1) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(&mut o1, Some(&res), &mut r1, &inp, gain, n, c, 1e-6);
            let (mut o2, mut r2) = (vec![0.0; n * c], vec![0.0; n]);
            naive::rmsnorm_forward(&mut o2, Some(&res), &mut r2, &inp, gain, n, c, 1e-6);
            assert_close(&o1, &o2, 2e-6, 2e-6, &format!("forward {n}x{c}"));
            let dout = randn(n * c, 1.0, si as u64 + 7);
            let (mut di1, mut dw1) = (vec![0.5; n * c], vec![0.25; c]);
            rmsnorm_backward(&mut di1, &mut dw1, &dout, &inp, gain, &r1, n, c);
            let (mut di2, mut dw2) = (vec![0.5; n * c], vec![0.25; c]);
            naive::rmsnorm_backward(&mut di2, &mut dw2, &dout, &inp, gain, &r1, n, c);
            assert_close(&di1, &di2, 1e-4, 1e-5, &format!("dinp {n}x{c}"));
            assert_close(&dw1, &dw2, 1e-4, 1e-5, &format!("dw {n}x{c}"));
            // Offset 1 with weights w is offset 0 with weights 1 + w.
            let shifted: Vec<f32> = w.iter().map(|v| v + 1.0).collect();
            let (mut o3, mut r3) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(
                &mut o3,
                None,
                &mut r3,
                &inp,
                Gain::plain(&shifted),
                n,
                c,
                1e-6,
            );
            let (mut o4, mut r4) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(&mut o4, None, &mut r4, &inp, gain, n, c, 1e-6);
            assert_eq!(bits(&o3), bits(&o4), "{n}x{c}");
        }
        let (n, dims) = (5, (4, 2, 8));
        let qkv = (4 + 2 * 2) * 8;
        let inp = randn(n * qkv, 1.0, 3);
        let w = randn(16, 0.1, 4);
        let gain = Gain {
            w: &w[..],
            offset: 1.0,
        };
        let (mut o1, mut r1) = (vec![0.0; n * qkv], vec![0.0; n * 6]);
        qk_norm_forward(&mut o1, &mut r1, &inp, gain, n, dims, 1e-6);
        let (mut o2, mut r2) = (vec![0.0; n * qkv], vec![0.0; n * 6]);
        naive::qk_norm_forward(&mut o2, &mut r2, &inp, gain, n, dims, 1e-6);
        assert_close(&o1, &o2, 2e-6, 2e-6, "qk forward");
        let dout = randn(n * qkv, 1.0, 5);
        let (mut d1, mut dw1) = (dout.clone(), vec![0.0; 16]);
        qk_norm_backward(&mut d1, Some(&mut dw1), &inp, gain, &r1, n, dims);
        let (mut d2, mut dw2) = (dout.clone(), vec![0.0; 16]);
        naive::qk_norm_backward(&mut d2, &mut dw2, &inp, gain, &r2, n, dims);
        assert_close(&d1, &d2, 1e-4, 1e-5, "qk dinp");
        assert_close(&dw1, &dw2, 1e-4, 1e-5, "qk dw");
    }

    #[test]
    fn forward_matches_naive() {
        for (si, &(n, c)) in SHAPES.iter().enumerate() {
            let (inp, w) = data(n, c, si as u64 * 10);
            let (mut o1, mut r1) = (vec![0.0; n * c], vec![0.0; n]);
            let (mut o2, mut r2) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(&mut o1, None, &mut r1, &inp, Gain::plain(&w), n, c, 1e-5);
            naive::rmsnorm_forward(&mut o2, None, &mut r2, &inp, Gain::plain(&w), n, c, 1e-5);
            let what = format!("{n}x{c}");
            assert_close(&o1, &o2, 2e-5, 2e-5, &format!("out {what}"));
            assert_close(&r1, &r2, 0.0, 1e-5, &format!("rstd {what}"));
        }
    }

    /// Rows of ±2 with eps = 0: mean(x²) = 4, rstd = 1/2 exactly, out = x·w/2 exactly.
    #[test]
    fn hand_computed_row() {
        let inp = [2.0f32, -2.0, 2.0, -2.0, 0.0, 0.0, 0.0, 0.0];
        let w = [1.0f32, 3.0, -0.5, 0.25];
        let (mut o, mut r) = ([9.0f32; 8], [9.0f32; 2]);
        rmsnorm_forward(&mut o, None, &mut r, &inp, Gain::plain(&w), 2, 4, 0.0);
        assert_eq!(r[0], 0.5);
        assert_eq!(&o[..4], &[1.0, -3.0, -0.5, -0.25]);
        // An all-zero row with eps > 0: rstd = 1/sqrt(eps), out = 0 (no NaN).
        rmsnorm_forward(&mut o, None, &mut r, &inp, Gain::plain(&w), 2, 4, 1e-6);
        assert!((r[1] - 1000.0).abs() < 1e-2, "rstd {}", r[1]);
        assert!(o[4..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn backward_matches_naive_and_accumulates() {
        for (si, &(n, c)) in SHAPES.iter().enumerate() {
            let (inp, w) = data(n, c, si as u64 * 10);
            let (mut o, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            naive::rmsnorm_forward(&mut o, None, &mut r, &inp, Gain::plain(&w), n, c, 1e-5);
            let dout = randn(n * c, 1.0, 77 + si as u64);
            let di0 = randn(n * c, 1.0, 78 + si as u64);
            let dw0 = randn(c, 1.0, 79 + si as u64);
            let (mut di1, mut dw1) = (di0.clone(), dw0.clone());
            let (mut di2, mut dw2) = (di0.clone(), dw0.clone());
            rmsnorm_backward(&mut di1, &mut dw1, &dout, &inp, Gain::plain(&w), &r, n, c);
            naive::rmsnorm_backward(&mut di2, &mut dw2, &dout, &inp, Gain::plain(&w), &r, n, c);
            let what = format!("{n}x{c}");
            // dinp scales with rstd (up to 100 for the 0.01-scaled rows).
            assert_close(&di1, &di2, 1e-3, 1e-4, &format!("dinp {what}"));
            let tol = 2e-5 * (n as f32).sqrt();
            assert_close(&dw1, &dw2, tol, 1e-5, &format!("dweight {what}"));
            // And it accumulated: the kernel's result minus its start is the gradient alone.
            let (mut di3, mut dw3) = (vec![0.0; n * c], vec![0.0; c]);
            naive::rmsnorm_backward(&mut di3, &mut dw3, &dout, &inp, Gain::plain(&w), &r, n, c);
            let d: Vec<f32> = di1.iter().zip(&di0).map(|(a, b)| a - b).collect();
            assert_close(&d, &di3, 1e-3, 1e-3, &format!("dinp increment {what}"));
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, c) = (3, 6);
        let inp = randn(n * c, 1.0, 5);
        let w = randn(c, 1.0, 6);
        let g = randn(n * c, 1.0, 8);
        let loss = |inp: &[f32], w: &[f32]| {
            let (mut o, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            naive::rmsnorm_forward(&mut o, None, &mut r, inp, Gain::plain(w), n, c, 1e-5);
            dot(&g, &o)
        };
        let (mut o, mut r) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut o, None, &mut r, &inp, Gain::plain(&w), n, c, 1e-5);
        let (mut di, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
        rmsnorm_backward(&mut di, &mut dw, &g, &inp, Gain::plain(&w), &r, n, c);
        let h = 1e-3;
        let fd_di = fd_grad(&inp, h, |x| loss(x, &w));
        assert_close(&di, &fd_di, 2e-3, 2e-3, "dinp vs fd");
        let fd_dw = fd_grad(&w, h, |x| loss(&inp, x));
        assert_close(&dw, &fd_dw, 2e-3, 2e-3, "dw vs fd");
    }

    fn run_f32(n: usize, c: usize) -> [Vec<f32>; 4] {
        let (inp, w) = data(n, c, 3);
        let dout = randn(n * c, 1.0, 4);
        let (mut o, mut r) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut o, None, &mut r, &inp, Gain::plain(&w), n, c, 1e-5);
        let (mut di, mut dw) = (randn(n * c, 1.0, 5), randn(c, 1.0, 6));
        rmsnorm_backward(&mut di, &mut dw, &dout, &inp, Gain::plain(&w), &r, n, c);
        [o, r, di, dw]
    }

    #[test]
    fn identical_for_any_thread_count() {
        let (n, c) = (97, 300);
        let bits = |v: [Vec<f32>; 4]| v.map(|x| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        let a = bits(with_threads(1, || run_f32(n, c)));
        assert!(a == bits(with_threads(2, || run_f32(n, c))));
        assert!(a == bits(with_threads(3, || run_f32(n, c))));
    }

    /// One shape of [`SHAPES`]: forward and backward stored as bf16 / f16 are the f32 kernel
    /// on the widened inputs, each stored element rounded once (rstd bitwise equal), for 1
    /// and 3 threads. `master`: the weight stays f32 (mixed precision) instead of `S`.
    struct Narrow {
        si: usize,
        master: bool,
    }

    impl Narrow {
        fn go<T: Elem, S: Elem, W: Elem>(&self) -> Vec<Out> {
            let si = self.si;
            let (n, c) = SHAPES[si];
            let (inp, w) = data(n, c, si as u64 * 10);
            let inp: Vec<S> = stored::<T, S>(&inp);
            // Master weights are not rounded to T: the same f32 values in both runs.
            let w: Vec<W> = if self.master {
                stored::<f32, W>(&w)
            } else {
                stored::<T, W>(&w)
            };
            let dout: Vec<S> = stored::<T, S>(&randn(n * c, 1.0, 77 + si as u64));
            let mut di: Vec<S> = stored::<T, S>(&randn(n * c, 1.0, 78 + si as u64));
            let mut dw: Vec<S> = stored::<T, S>(&randn(c, 1.0, 79 + si as u64));
            let (mut o, mut r) = (vec![S::from_f32(f32::NAN); n * c], vec![0.0; n]);
            rmsnorm_forward(&mut o, None, &mut r, &inp, Gain::plain(&w), n, c, 1e-5);
            rmsnorm_backward(&mut di, &mut dw, &dout, &inp, Gain::plain(&w), &r, n, c);
            vec![
                Out::stored("out", &o),
                Out::f32("rstd", &r),
                Out::stored("dinp", &di),
                Out::stored("dweight", &dw),
            ]
        }
    }

    impl Case for Narrow {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            if self.master {
                self.go::<T, S, f32>()
            } else {
                self.go::<T, S, S>()
            }
        }
    }

    #[test]
    fn bf16_is_f32_rounded() {
        for (si, &(n, c)) in SHAPES.iter().enumerate() {
            for master in [false, true] {
                let what = format!("rmsnorm {n}x{c} master {master}");
                check_stored_as::<bf16>(&Narrow { si, master }, &what);
            }
        }
    }

    #[test]
    fn f16_is_f32_rounded() {
        for (si, &(n, c)) in SHAPES.iter().enumerate() {
            for master in [false, true] {
                let what = format!("rmsnorm {n}x{c} master {master}");
                check_stored_as::<f16>(&Narrow { si, master }, &what);
            }
        }
    }

    /// f32 and bf16 outputs (bit patterns) on fixed inputs.
    fn isa_run() -> Vec<Vec<u32>> {
        let (n, c) = (37, 203);
        let mut all: Vec<Vec<u32>> = run_f32(n, c)
            .iter()
            .map(|v| v.iter().map(|x| x.to_bits()).collect())
            .collect();
        let narrow = Narrow {
            si: 5,
            master: true,
        }
        .run::<bf16, bf16>();
        all.extend(
            narrow
                .iter()
                .map(|o| o.f32s().iter().map(|x| x.to_bits()).collect()),
        );
        all
    }

    /// Bit-identical results on every instruction set this CPU has.
    #[test]
    fn isa_invariant() {
        conformance::isa_invariant(&isas_here(), isa_run, "rmsnorm");
    }

    /// The AVX-512 variants against the baseline (fails on a CPU without AVX-512F).
    #[test]
    #[ignore = "needs AVX-512F"]
    fn isa_invariant_avx512() {
        conformance::isa_invariant(&[Isa::Avx512], isa_run, "rmsnorm");
    }

    /// (N, NH, NKV, hd): GQA and MHA, one head, hd above a column slice and not a multiple.
    const QK_SHAPES: [(usize, usize, usize, usize); 5] = [
        (1, 1, 1, 2),
        (3, 4, 2, 8),
        (5, 2, 2, 16),
        (7, 4, 1, 64),
        (9, 3, 3, 130),
    ];

    fn qk_data(n: usize, (nh, nkv, hd): (usize, usize, usize), seed: u64) -> (Vec<f32>, Vec<f32>) {
        data(n * (nh + 2 * nkv), hd, seed)
    }

    #[test]
    fn qk_norm_matches_naive_and_copies_values() {
        for (si, &(n, nh, nkv, hd)) in QK_SHAPES.iter().enumerate() {
            let dims = (nh, nkv, hd);
            let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
            let (inp, w1) = qk_data(n, dims, si as u64);
            let w: Vec<f32> = w1
                .iter()
                .chain(w1.iter().map(|v| v * 0.5 - 0.25).collect::<Vec<_>>().iter())
                .copied()
                .collect();
            let (mut o1, mut r1) = (vec![f32::NAN; n * qkv], vec![0.0; n * heads]);
            let (mut o2, mut r2) = (vec![0.0; n * qkv], vec![0.0; n * heads]);
            qk_norm_forward(&mut o1, &mut r1, &inp, Gain::plain(&w), n, dims, 1e-6);
            naive::qk_norm_forward(&mut o2, &mut r2, &inp, Gain::plain(&w), n, dims, 1e-6);
            let what = format!("{n}x{nh}/{nkv}x{hd}");
            assert_close(&o1, &o2, 2e-5, 2e-5, &format!("out {what}"));
            assert_close(&r1, &r2, 0.0, 1e-5, &format!("rstd {what}"));
            for r in 0..n {
                let v = r * qkv + heads * hd..(r + 1) * qkv;
                assert_eq!(&o1[v.clone()], &inp[v], "values copied {what}");
            }
            // Backward: d overwritten, dw accumulated; frozen (None) gives the same d.
            let dout = randn(n * qkv, 1.0, 50 + si as u64);
            let dw0 = randn(2 * hd, 1.0, 60 + si as u64);
            let (mut d1, mut dw1) = (dout.clone(), dw0.clone());
            let (mut d2, mut dw2) = (dout.clone(), dw0.clone());
            qk_norm_backward(&mut d1, Some(&mut dw1), &inp, Gain::plain(&w), &r1, n, dims);
            naive::qk_norm_backward(&mut d2, &mut dw2, &inp, Gain::plain(&w), &r2, n, dims);
            assert_close(&d1, &d2, 1e-3, 1e-4, &format!("dinp {what}"));
            let tol = 2e-5 * ((n * heads) as f32).sqrt();
            assert_close(&dw1, &dw2, tol, 1e-5, &format!("dweight {what}"));
            let mut d3 = dout.clone();
            qk_norm_backward::<f32, f32>(&mut d3, None, &inp, Gain::plain(&w), &r1, n, dims);
            assert_eq!(d3, d1, "frozen: the same input gradient {what}");
        }
    }

    #[test]
    fn qk_norm_backward_matches_finite_differences() {
        let (n, dims) = (2, (2usize, 1usize, 6usize));
        let (nh, nkv, hd) = dims;
        let qkv = (nh + 2 * nkv) * hd;
        let inp = randn(n * qkv, 1.0, 5);
        let w = randn(2 * hd, 1.0, 6);
        let g = randn(n * qkv, 1.0, 8);
        let loss = |inp: &[f32], w: &[f32]| {
            let (mut o, mut r) = (vec![0.0; n * qkv], vec![0.0; n * (nh + nkv)]);
            naive::qk_norm_forward(&mut o, &mut r, inp, Gain::plain(w), n, dims, 1e-6);
            dot(&g, &o)
        };
        let (mut o, mut r) = (vec![0.0; n * qkv], vec![0.0; n * (nh + nkv)]);
        qk_norm_forward(&mut o, &mut r, &inp, Gain::plain(&w), n, dims, 1e-6);
        let (mut d, mut dw) = (g.clone(), vec![0.0; 2 * hd]);
        qk_norm_backward(&mut d, Some(&mut dw), &inp, Gain::plain(&w), &r, n, dims);
        let h = 1e-3;
        assert_close(
            &d,
            &fd_grad(&inp, h, |x| loss(x, &w)),
            2e-3,
            2e-3,
            "dinp vs fd",
        );
        assert_close(
            &dw,
            &fd_grad(&w, h, |x| loss(&inp, x)),
            2e-3,
            2e-3,
            "dw vs fd",
        );
    }

    #[test]
    fn qk_norm_identical_for_any_thread_count() {
        let (n, dims) = (61, (4usize, 2usize, 130usize));
        let (nh, nkv, hd) = dims;
        let qkv = (nh + 2 * nkv) * hd;
        let run = || {
            let (inp, _) = qk_data(n, dims, 3);
            let w = randn(2 * hd, 0.5, 4);
            let (mut o, mut r) = (vec![0.0; n * qkv], vec![0.0; n * (nh + nkv)]);
            qk_norm_forward(&mut o, &mut r, &inp, Gain::plain(&w), n, dims, 1e-6);
            let (mut d, mut dw) = (randn(n * qkv, 1.0, 5), randn(2 * hd, 1.0, 6));
            qk_norm_backward(&mut d, Some(&mut dw), &inp, Gain::plain(&w), &r, n, dims);
            [o, r, d, dw].map(|x| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
        };
        let a = with_threads(1, run);
        assert!(a == with_threads(2, run));
        assert!(a == with_threads(3, run));
    }

    /// bf16 storage: the f32 kernel on the widened inputs, each stored element rounded once.
    #[test]
    fn qk_norm_bf16_is_f32_rounded() {
        let (n, dims) = (5, (2usize, 1usize, 16usize));
        let (nh, nkv, hd) = dims;
        let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
        let (inp, _) = qk_data(n, dims, 11);
        let inp: Vec<f32> = inp.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let w = randn(2 * hd, 0.5, 12);
        let (mut o, mut r) = (vec![0.0f32; n * qkv], vec![0.0; n * heads]);
        qk_norm_forward(&mut o, &mut r, &inp, Gain::plain(&w), n, dims, 1e-6);
        let ib: Vec<bf16> = narrow_vec(&inp);
        let (mut ob, mut rb) = (vec![bf16::ZERO; n * qkv], vec![0.0; n * heads]);
        qk_norm_forward(&mut ob, &mut rb, &ib, Gain::plain(&w), n, dims, 1e-6);
        assert_eq!(r, rb, "rstd bitwise");
        let want: Vec<bf16> = narrow_vec(&o);
        assert_eq!(ob, want, "out rounded once");
    }

    /// A non-finite input poisons its row (forward, dinp) and its column sums (dweight) and
    /// nothing else; no panic.
    #[test]
    fn non_finite_stays_local() {
        let (n, c) = (4, 70);
        let (inp, w) = data(n, c, 9);
        let (mut inp, w): (Vec<bf16>, Vec<bf16>) = (narrow_vec(&inp), narrow_vec(&w));
        inp[2 * c + 5] = bf16::NAN;
        let (mut o, mut r) = (vec![bf16::ZERO; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut o, None, &mut r, &inp, Gain::plain(&w), n, c, 1e-5);
        let row_bad = |x: &[bf16], i: usize| x[i * c..(i + 1) * c].iter().all(|v| v.is_nan());
        let row_ok = |x: &[bf16], i: usize| x[i * c..(i + 1) * c].iter().all(|v| v.is_finite());
        assert!(row_bad(&o, 2) && row_ok(&o, 0) && row_ok(&o, 1) && row_ok(&o, 3));
        assert!(r[2].is_nan() && r[0].is_finite() && r[1].is_finite() && r[3].is_finite());
        let mut dout: Vec<bf16> = narrow_vec(&randn(n * c, 1.0, 1));
        dout[c + 3] = bf16::INFINITY;
        let (mut di, mut dw) = (vec![bf16::ZERO; n * c], vec![bf16::ZERO; c]);
        rmsnorm_backward(&mut di, &mut dw, &dout, &inp, Gain::plain(&w), &r, n, c);
        assert!(row_ok(&di, 0) && row_ok(&di, 3) && !row_ok(&di, 1) && !row_ok(&di, 2));
        assert!(
            dw.iter().all(|v| v.is_nan()),
            "row 2 is NaN: every dweight column"
        );
    }
}
