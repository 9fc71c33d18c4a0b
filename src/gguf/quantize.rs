//! Quantization of f32 rows into ggml blocks, as llama.cpp's reference quantizers
//! (`quantize_row_*_ref` in ggml-quants.c) compute it: the same block layouts as
//! [`super::dequant`] decodes, the same f32 operations in the same order, the scales rounded
//! to f16 to nearest even. What `--base-quant` turns a base model's weights into (QLoRA), and
//! what writing a GGUF file will use.
//!
//! | type | per block of 32 values                                                             |
//! |------|------------------------------------------------------------------------------------|
//! | Q8_0 | `d = amax / 127`, `q = round(x / d)` (half away from zero)                          |
//! | Q4_0 | `d = max / −8` (max: the value of largest magnitude, with its sign), `q = min(15, trunc(x / d + 8.5))` |
//! | Q4_1 | `d = (max − min) / 15`, `m = min`, `q = min(15, trunc((x − min) / d + 0.5))`         |
//!
//! BF16 rounds each value to the nearest bfloat16 (ties to even).
//!
//! Q4_K (`quantize_row_q4_K_ref`) works on super-blocks of 256 values: eight sub-blocks of 32,
//! each with a 4-bit scale and min found by `make_qkx2_quants` (a weighted least-squares
//! search over 21 candidate scales, weights `sqrt(mean x²) + |x|`), then the eight scales and
//! mins quantized to 6 bits against the super-block's f16 `d` and `dmin`, and the codes
//! recomputed from the stored scales. Written from ggml-quants.c; its round trip is checked
//! against the decoder ([`super::dequant`], itself checked against gguf-py) and its error
//! against Q4_0's and Q4_1's.
//!
//! A block of zeros has `d = 0` and codes that decode to zero. Non-finite input is refused
//! before anything is written, naming the row.

use super::types::GgmlType;
use anyhow::{Result, bail};
use half::f16;
use rayon::prelude::*;

/// The types [`quantize`] writes.
pub const QUANTIZABLE: &[&str] = &["Q8_0", "Q4_0", "Q4_1", "Q4_K", "BF16"];

/// Quantizes `src` (whole blocks of 32 values) into `dst` (its bytes as `ty`).
///
/// Errors: a type outside [`QUANTIZABLE`] (named, with the list), sizes that are not whole
/// blocks or do not match, or a NaN or infinite value (its index).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let row: fn(&[f32], &mut [u8]) = match ty.name {
        "Q8_0" => q8_0_row,
        "Q4_0" => q4_0_row,
        "Q4_1" => q4_1_row,
        "Q4_K" => q4_k_row,
        "BF16" => bf16_row,
        _ => bail!(
            "cannot quantize to {ty}: memwall writes {}",
            QUANTIZABLE.join(", ")
        ),
    };
    let n = src.len() as u64;
    match ty.bytes_for(n) {
        Some(b) if b == dst.len() as u64 => {}
        Some(b) => bail!(
            "{n} {ty} values take {b} bytes, but {} were given",
            dst.len()
        ),
        None => bail!(
            "{n} values are not a whole number of {ty} blocks of {}",
            ty.block_size
        ),
    }
    if let Some(i) = src.iter().position(|x| !x.is_finite()) {
        bail!("value {i} is {} and cannot be quantized", src[i]);
    }
    // Blocks are independent: 64 at a time in parallel, the same bytes as one pass.
    let (vals, bytes) = (64 * ty.block_size as usize, 64 * ty.type_size as usize);
    src.par_chunks(vals)
        .zip(dst.par_chunks_mut(bytes))
        .for_each(|(s, d)| row(s, d));
    Ok(())
}

fn put_f16(b: &mut [u8], at: usize, x: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes());
}

/// Q8_0 (`quantize_row_q8_0_ref`): blocks of [f16 d, 32 × i8].
pub fn q8_0_row(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(34)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        for (q, &v) in b[2..34].iter_mut().zip(x) {
            *q = (v * id).round() as i8 as u8;
        }
    }
}

/// Q4_0 (`quantize_row_q4_0_ref`): blocks of [f16 d, 16 bytes]; byte j holds value j in its
/// low nibble and value j + 16 in its high nibble.
pub fn q4_0_row(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(18)) {
        // The value of largest magnitude, with its sign (the first of equal magnitudes).
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        let code = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
        for j in 0..16 {
            b[2 + j] = code(x[j]) | (code(x[j + 16]) << 4);
        }
    }
}

/// Q4_1 (`quantize_row_q4_1_ref`): blocks of [f16 d, f16 m, 16 bytes as Q4_0].
pub fn q4_1_row(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(20)) {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &v in x {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        let code = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
        for j in 0..16 {
            b[4 + j] = code(x[j]) | (code(x[j + 16]) << 4);
        }
    }
}

/// BF16: each value rounded to the nearest bfloat16 (ties to even), little-endian.
pub fn bf16_row(src: &[f32], dst: &mut [u8]) {
    for (&x, b) in src.iter().zip(dst.chunks_exact_mut(2)) {
        b.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even, through the f32 magic constant.
fn nearest_int(x: f32) -> i32 {
    let v = x + 12582912.0;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

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
            let (s, m) = super::dequant::scale_min_k4(j, sc);
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

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[cfg(test)]
mod tests {
    use super::super::dequant::dequantize;
    use super::*;
    use crate::util::rng::Rng;

    fn round_trip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
        let mut q = vec![0u8; ty.bytes_for(x.len() as u64).unwrap() as usize];
        quantize(ty, x, &mut q).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize(ty, &q, &mut y).unwrap();
        y
    }

    /// llama.cpp's `test-quantize-fns` check, as it computes it: 4096 values `0.1 +
    /// 2·cos(i)`, the total error `sqrt(Σ (x − y)²) / n` below 0.002 for every type written.
    #[test]
    fn every_type_passes_llama_cpps_total_error_bound() {
        let n = 32 * 128;
        let x: Vec<f32> = (0..n).map(|i| 0.1 + 2.0 * (i as f32).cos()).collect();
        for name in QUANTIZABLE {
            let ty = [
                GgmlType::Q8_0,
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q4_K,
                GgmlType::BF16,
            ]
            .into_iter()
            .find(|t| t.name == *name)
            .unwrap();
            let y = round_trip(ty, &x);
            let sum: f64 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            let total = sum.sqrt() / n as f64;
            assert!(total < 0.002, "{ty}: total error {total}");
        }
    }

    /// Q4_K's error on weight-like values (normal, per-row scales) is a 4-bit type's: within
    /// 1.2× Q4_1's (5 bits a weight against its 4.5), and below Q4_0's.
    #[test]
    fn q4_k_errs_like_a_four_bit_type() {
        let mut rng = Rng::new(4);
        let x: Vec<f32> = (0..256 * 64)
            .map(|i| rng.normal() * 0.02 * (1.0 + (i / 256) as f32 * 0.1))
            .collect();
        let rmse = |ty| {
            let y = round_trip(ty, &x);
            (x.iter()
                .zip(&y)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
                / x.len() as f64)
                .sqrt()
        };
        let (k, q41, q40) = (
            rmse(GgmlType::Q4_K),
            rmse(GgmlType::Q4_1),
            rmse(GgmlType::Q4_0),
        );
        assert!(
            k > 0.0 && k <= 1.2 * q41 && k < q40,
            "Q4_K {k}, Q4_1 {q41}, Q4_0 {q40}"
        );
    }

    /// Every value comes back within half a step of its block's grid (plus the scale's f16
    /// rounding), and the block's extreme value (the one that sets the scale) comes back
    /// almost exactly.
    #[test]
    fn values_come_back_within_half_a_step() {
        let mut rng = Rng::new(9);
        let x: Vec<f32> = (0..32 * 64)
            .map(|i| (rng.next_f32() - 0.5) * (1 + i / 32) as f32)
            .collect();
        for (ty, steps) in [
            (GgmlType::Q8_0, 254.0),
            (GgmlType::Q4_0, 16.0),
            (GgmlType::Q4_1, 15.0),
        ] {
            let y = round_trip(ty, &x);
            for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let lo = xb.iter().fold(f32::MAX, |m, &v| m.min(v));
                let hi = xb.iter().fold(f32::MIN, |m, &v| m.max(v));
                let range = match ty.name {
                    "Q4_1" => hi - lo,
                    _ => 2.0 * lo.abs().max(hi.abs()),
                };
                let step = range / steps;
                for (j, (&a, &c)) in xb.iter().zip(yb).enumerate() {
                    // Half a step (Q4_0: a whole one, as its codes reach −8·d but only 7·d
                    // on the other side), and the f16 rounding of d (and m) over the steps.
                    let half = if ty.name == "Q4_0" { 1.0 } else { 0.5 };
                    let tol = half * step + range * 2e-3;
                    assert!(
                        (a - c).abs() <= tol,
                        "{ty} block {b} value {j}: {a} came back {c} (step {step})"
                    );
                }
            }
        }
    }

    /// Bytes llama.cpp's reference quantizers write for one hand-checked block each.
    #[test]
    fn blocks_are_the_reference_quantizers_bytes() {
        // 0, 1, ..., 31 scaled so the largest magnitude is 31 (the last value).
        let x: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let mut q8 = [0u8; 34];
        quantize(GgmlType::Q8_0, &x, &mut q8).unwrap();
        // d = 31 / 127; q = round(i · 127 / 31): 0, 4 (4.097), 8, ..., 127.
        assert_eq!(
            f16::from_le_bytes([q8[0], q8[1]]),
            f16::from_f32(31.0 / 127.0)
        );
        assert_eq!(&q8[2..6], &[0, 4, 8, 12]);
        assert_eq!(q8[33], 127);
        let mut q4 = [0u8; 18];
        quantize(GgmlType::Q4_0, &x, &mut q4).unwrap();
        // d = 31 / −8; code(i) = min(15, trunc(−8i/31 + 8.5)): code(0) = 8, code(31) = 0,
        // code(16) = trunc(4.371) = 4.
        assert_eq!(
            f16::from_le_bytes([q4[0], q4[1]]),
            f16::from_f32(-31.0 / 8.0)
        );
        assert_eq!(q4[2], 8 | (4 << 4));
        assert_eq!(q4[17] >> 4, 0);
        let mut q41 = [0u8; 20];
        quantize(GgmlType::Q4_1, &x, &mut q41).unwrap();
        // d = 31 / 15, m = 0; code(i) = trunc(15i/31 + 0.5): code(1) = 0 (0.98), code(2) = 1.
        assert_eq!(f16::from_le_bytes([q41[2], q41[3]]), f16::from_f32(0.0));
        assert_eq!(q41[4] & 0x0F, 0);
        assert_eq!(q41[5] & 0x0F, 0);
        assert_eq!(q41[6] & 0x0F, 1);
        assert_eq!(q41[19] >> 4, 15);
        // A block of zeros: d = 0, every value decodes to zero.
        let zeros = [0f32; 32];
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
            assert!(round_trip(ty, &zeros).iter().all(|&v| v == 0.0), "{ty}");
        }
    }

    /// Bitwise the bytes of llama.cpp's reference quantizers, as the `gguf` Python package
    /// (gguf-py) computes them (`tests/fixtures/make_quant_reference.py`): normal and uniform
    /// rows, constant blocks (one of zeros), and grid points with ties.
    #[test]
    fn bytes_are_those_of_gguf_py() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/quant_reference.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 4);
        for (r, row) in rows.iter().enumerate() {
            let x: Vec<f32> = row["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
                let hex = row[ty.name].as_str().unwrap();
                let want: Vec<u8> = (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                    .collect();
                let mut got = vec![0u8; want.len()];
                quantize(ty, &x, &mut got).unwrap();
                let first = got.iter().zip(&want).position(|(a, b)| a != b);
                assert_eq!(first, None, "row {r} {ty}: first differing byte");
            }
        }
    }

    #[test]
    fn bad_input_is_refused_naming_it() {
        let mut q = [0u8; 34];
        let e = format!(
            "{:#}",
            quantize(GgmlType::Q6_K, &[0.0; 256], &mut [0; 210]).unwrap_err()
        );
        assert!(
            e.contains("cannot quantize to Q6_K") && e.contains("Q8_0, Q4_0, Q4_1, Q4_K, BF16"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            quantize(GgmlType::Q8_0, &[0.0; 31], &mut q).unwrap_err()
        );
        assert!(e.contains("not a whole number of Q8_0 blocks of 32"), "{e}");
        let mut x = [0f32; 32];
        x[5] = f32::NAN;
        let e = format!("{:#}", quantize(GgmlType::Q8_0, &x, &mut q).unwrap_err());
        assert!(e.contains("value 5 is NaN"), "{e}");
    }
}
