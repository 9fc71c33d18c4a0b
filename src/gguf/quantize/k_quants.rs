//! The K-quants, super-blocks of 256 values, as llama.cpp's reference quantizers compute them
//! (ggml-quants.c, written from it): the same f32 operations in the same order, scales
//! rounded to f16 to nearest even.
//!
//! - Q4_K (`quantize_row_q4_K_ref`): eight sub-blocks of 32, each with a 4-bit scale and min
//!   found by `make_qkx2_quants` (a weighted least-squares search over 21 candidate scales,
//!   weights `sqrt(mean x²) + |x|`); the eight scales and mins quantized to 6 bits against
//!   the super-block's f16 `d` and `dmin`; the codes recomputed from the stored scales.
//! - Q6_K (`quantize_row_q6_K_ref`): sixteen sub-blocks of 16, each with a signed scale found
//!   by `make_qx_quants` (codes −32..31, weights `x²`, 19 candidate scales around
//!   `−32 / max`); the sixteen scales quantized to i8 against the f16 `d = max_scale / −128`;
//!   the codes recomputed from the stored scales.

use super::scale::{f16_at, nearest_int, put_f16};
use crate::dtype::dequant::scale_min_k4;

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below it is all zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `make_qkx2_quants` for one sub-block: codes `l` in 0..=nmax and `(scale, min)`
/// with `x ≈ scale · l − min`, searching `nstep + 1` scales around `nmax / (max − min)` for
/// the least weighted squared error.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    x: &[f32],       // [n]
    w: &[f32],       // [n]
    l: &mut [u8],    // [n]
    laux: &mut [u8], // [n]
    nmax: i32,
    (rmin, rdelta, nstep): (f32, f32, i32),
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let (mut sum_w, mut sum_x) = (w[0], w[0] * x[0]);
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best += w[i] * diff * diff;
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let q = q as f32;
            sum_l += w[i] * q;
            sum_l2 += w[i] * q * q;
            sum_xl += w[i] * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut err = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                err += w[i] * diff * diff;
            }
            if err < best {
                l.copy_from_slice(laux);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Q4_K (`quantize_row_q4_K_ref`): super-blocks of [f16 d, f16 dmin, 12 bytes of 6-bit
/// scales and mins, 128 bytes of codes] for 256 values (see the module docs).
pub fn q4_k_row(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(256).zip(dst.chunks_exact_mut(144)) {
        let mut l = [0u8; 256];
        let mut laux = [0u8; 32];
        let mut w = [0f32; 32];
        let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..8 {
            let xs = &x[32 * j..32 * j + 32];
            let sum_x2: f32 = xs.iter().map(|v| v * v).sum();
            let av_x = (sum_x2 / 32.0).sqrt();
            for (w, &v) in w.iter_mut().zip(xs) {
                *w = av_x + v.abs();
            }
            let (s, m) = make_qkx2_quants(
                xs,
                &w,
                &mut l[32 * j..32 * j + 32],
                &mut laux,
                15,
                (-1.0, 0.1, 20),
            );
            (scales[j], mins[j]) = (s, m);
            max_scale = max_scale.max(s);
            max_min = max_min.max(m);
        }
        let inv_scale = if max_scale > 0.0 {
            63.0 / max_scale
        } else {
            0.0
        };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        let sc = &mut [0u8; 12];
        for j in 0..8 {
            let ls = nearest_int(inv_scale * scales[j]).min(63) as u8;
            let lm = nearest_int(inv_min * mins[j]).min(63) as u8;
            if j < 4 {
                sc[j] = ls;
                sc[j + 4] = lm;
            } else {
                sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                sc[j - 4] |= (ls >> 4) << 6;
                sc[j] |= (lm >> 4) << 6;
            }
        }
        put_f16(b, 0, max_scale / 63.0);
        put_f16(b, 2, max_min / 63.0);
        b[4..16].copy_from_slice(sc);
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, sc);
            let dj = d * s as f32;
            if dj == 0.0 {
                continue;
            }
            let dm = dmin * m as f32;
            for i in 0..32 {
                l[32 * j + i] = nearest_int((x[32 * j + i] + dm) / dj).clamp(0, 15) as u8;
            }
        }
        let qs = &mut b[16..144];
        for (k, q) in qs.chunks_exact_mut(32).enumerate() {
            for i in 0..32 {
                q[i] = l[64 * k + i] | (l[64 * k + i + 32] << 4);
            }
        }
    }
}

/// ggml's `make_qx_quants` with `rmse_type` 1 and no importance weights, for one group: codes
/// `l` in 0..2·nmax (the signed code plus nmax) and the scale `s` with `x ≈ s · (l − nmax)`.
/// The first guess is `−nmax / max` (max: the value of largest magnitude, with its sign);
/// 18 more inverse scales `−(nmax + 0.1·is) / max` (is = −9..9, not 0) are tried, the one
/// with the largest `(Σ w·x·l)² / Σ w·l²` kept, weights `w = x²`.
fn make_qx_quants(x: &[f32], l: &mut [u8], nmax: i32) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (li, &v) in l.iter_mut().zip(x) {
        let q = code(iscale, v);
        *li = (q + nmax) as u8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        (sumlx, suml2) = (0.0, 0.0);
        for &v in x {
            let q = code(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (li, &v) in l.iter_mut().zip(x) {
                *li = (code(iscale, v) + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K (`quantize_row_q6_K_ref`): super-blocks of [128 bytes ql, 64 bytes qh, 16 × i8
/// scales, f16 d] for 256 values (see the module docs; the layout is
/// [`crate::dtype::dequant::q6_k_row`]'s). A super-block whose scales are all below
/// `GROUP_MAX_EPS` is all zero bytes.
pub fn q6_k_row(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(256).zip(dst.chunks_exact_mut(210)) {
        let mut l = [0u8; 256];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
        for ib in 0..16 {
            let s = make_qx_quants(&x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16], 32);
            scales[ib] = s;
            if s.abs() > max_abs_scale {
                max_abs_scale = s.abs();
                max_scale = s;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            b.fill(0);
            continue;
        }
        let iscale = -128.0 / max_scale;
        put_f16(b, 208, 1.0 / iscale);
        for ib in 0..16 {
            b[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
        }
        let d = f16_at(b, 208);
        for j in 0..16 {
            let dj = d * (b[192 + j] as i8) as f32;
            if dj == 0.0 {
                continue;
            }
            for i in 0..16 {
                let q = nearest_int(x[16 * j + i] / dj).clamp(-32, 31);
                l[16 * j + i] = (q + 32) as u8;
            }
        }
        for h in 0..2 {
            let (j, ql, qh) = (128 * h, 64 * h, 128 + 32 * h);
            for i in 0..32 {
                let (q1, q2) = (l[j + i], l[j + i + 32]);
                let (q3, q4) = (l[j + i + 64], l[j + i + 96]);
                b[ql + i] = (q1 & 0x0F) | ((q3 & 0x0F) << 4);
                b[ql + i + 32] = (q2 & 0x0F) | ((q4 & 0x0F) << 4);
                b[qh + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::round_trip;
    use super::*;
    use crate::dtype::GgmlType;
    use crate::util::rng::Rng;

    fn rmse(x: &[f32], y: &[f32]) -> f64 {
        (x.iter()
            .zip(y)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            / x.len() as f64)
            .sqrt()
    }

    /// Weight-like values: normal, per-row scales.
    fn weights(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n)
            .map(|i| rng.normal() * 0.02 * (1.0 + (i / 256) as f32 * 0.1))
            .collect()
    }

    /// Q4_K's error on weight-like values is a 4-bit type's: within 1.2× Q4_1's (5 bits a
    /// weight against its 4.5), and below Q4_0's.
    #[test]
    fn q4_k_errs_like_a_four_bit_type() {
        let x = weights(4, 256 * 64);
        let e = |ty| rmse(&x, &round_trip(ty, &x));
        let (k, q41, q40) = (e(GgmlType::Q4_K), e(GgmlType::Q4_1), e(GgmlType::Q4_0));
        assert!(
            k > 0.0 && k <= 1.2 * q41 && k < q40,
            "Q4_K {k}, Q4_1 {q41}, Q4_0 {q40}"
        );
    }

    /// Q6_K's error on weight-like values is a 6-bit type's: below Q5_0's (5.5 bits a
    /// weight against its 6.56), above Q8_0's.
    #[test]
    fn q6_k_errs_like_a_six_bit_type() {
        let x = weights(6, 256 * 64);
        let e = |ty| rmse(&x, &round_trip(ty, &x));
        let (k, q5, q8) = (e(GgmlType::Q6_K), e(GgmlType::Q5_0), e(GgmlType::Q8_0));
        assert!(k > q8 && k < q5, "Q6_K {k}, Q5_0 {q5}, Q8_0 {q8}");
    }

    /// One Q6_K group by hand: 16 values `(i − 8)/4` (largest magnitude −2, at i = 0). The
    /// first inverse scale `−32 / −2 = 16` gives codes `4(i − 8)` and scale 1/16, an exact
    /// fit, which no other candidate can beat: it stays.
    #[test]
    fn make_qx_quants_keeps_an_exact_fit() {
        let x: Vec<f32> = (0..16).map(|i| (i as f32 - 8.0) * 0.25).collect();
        let mut l = [0u8; 16];
        assert_eq!(make_qx_quants(&x, &mut l, 32), 1.0 / 16.0);
        let want: Vec<u8> = (0..16).map(|i| (4 * i) as u8).collect();
        assert_eq!(l.to_vec(), want);
        let mut z = [7u8; 16];
        assert_eq!(make_qx_quants(&[0.0; 16], &mut z, 32), 0.0);
        assert_eq!(z, [0; 16]);
    }

    /// A super-block of zeros is all zero bytes (d = 0). Groups `(i − 8)/4 · 2^(g mod 4)`
    /// have scales 2^(g mod 4)/16: d = 0.5 / −128, the i8 scales −16, −32, −64, −128, and
    /// every value comes back exactly.
    #[test]
    fn q6_k_zeros_and_exact_groups_come_back() {
        let mut b = [1u8; 210];
        q6_k_row(&[0.0; 256], &mut b);
        assert_eq!(b, [0u8; 210]);
        let x: Vec<f32> = (0..256)
            .map(|i| ((i % 16) as f32 - 8.0) * 0.25 * (1 << ((i / 16) % 4)) as f32)
            .collect();
        let mut b = [0u8; 210];
        q6_k_row(&x, &mut b);
        assert_eq!(f16_at(&b, 208), -1.0 / 256.0);
        assert_eq!(
            &b[192..196],
            &[(-16i8) as u8, (-32i8) as u8, (-64i8) as u8, 128]
        );
        assert_eq!(round_trip(GgmlType::Q6_K, &x), x);
    }
}
