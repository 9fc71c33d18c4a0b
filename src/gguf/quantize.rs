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
//! A block of zeros has `d = 0` and codes that decode to zero. Non-finite input is refused
//! before anything is written, naming the row.

use super::types::GgmlType;
use anyhow::{Result, bail};
use half::f16;

/// The types [`quantize`] writes.
pub const QUANTIZABLE: &[&str] = &["Q8_0", "Q4_0", "Q4_1"];

/// Quantizes `src` (whole blocks of 32 values) into `dst` (its bytes as `ty`).
///
/// Errors: a type outside [`QUANTIZABLE`] (named, with the list), sizes that are not whole
/// blocks or do not match, or a NaN or infinite value (its index).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let row: fn(&[f32], &mut [u8]) = match ty.name {
        "Q8_0" => q8_0_row,
        "Q4_0" => q4_0_row,
        "Q4_1" => q4_1_row,
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
    row(src, dst);
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
            quantize(GgmlType::Q4_K, &[0.0; 256], &mut [0; 144]).unwrap_err()
        );
        assert!(
            e.contains("cannot quantize to Q4_K") && e.contains("Q8_0, Q4_0, Q4_1"),
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
