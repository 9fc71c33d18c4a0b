//! Quantization of f32 rows into ggml blocks, as llama.cpp's reference quantizers
//! (`quantize_row_*_ref` in ggml-quants.c) compute it: the same block layouts as
//! [`crate::dtype::dequant`] decodes, the same f32 operations in the same order, the scales rounded
//! to f16 to nearest even. What `--base-quant` turns a base model's weights into (QLoRA), and
//! what `memwall export` writes.
//!
//! | type | values | per block                                                                 |
//! |------|--------|---------------------------------------------------------------------------|
//! | Q8_0 | 32     | `d = amax / 127`, `q = round(x / d)` (half away from zero)                 |
//! | Q4_0 | 32     | `d = max / −8` (max: the value of largest magnitude, with its sign), `q = min(15, trunc(x / d + 8.5))` |
//! | Q4_1 | 32     | `d = (max − min) / 15`, `m = min`, `q = min(15, trunc((x − min) / d + 0.5))` |
//! | Q5_0 | 32     | `d = max / −16`, `q = min(31, trunc(x / d + 16.5))`                        |
//! | Q4_K | 256    | 8 sub-blocks of 32, 6-bit scales and mins found by least squares ([`k_quants`]) |
//! | Q6_K | 256    | 16 sub-blocks of 16, i8 scales found by least squares ([`k_quants`])       |
//!
//! BF16 rounds each value to the nearest bfloat16 (ties to even).
//!
//! The 32-value types ([`legacy`]) are checked bitwise against gguf-py's quantizers (a fixture
//! here, and thousands of random and edge-case blocks where `.ci/run` installs gguf-py); the
//! K-quants by decoding their bytes with gguf-py and by llama.cpp's `test-quantize-fns`
//! error bounds. A block of zeros has `d = 0` and codes that decode to zero. Non-finite
//! input is refused before anything is written, naming the value.

pub mod k_quants;
pub mod legacy;
mod scale;

use crate::dtype::GgmlType;
use anyhow::{Result, bail};
use rayon::prelude::*;

/// The types [`quantize`] writes.
pub const QUANTIZABLE: &[&str] = &["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "BF16"];

/// Quantizes `src` (whole blocks of `ty`) into `dst` (its bytes as `ty`).
///
/// Errors: a type outside [`QUANTIZABLE`] (named, with the list), sizes that are not whole
/// blocks or do not match, or a NaN or infinite value (its index).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let row: fn(&[f32], &mut [u8]) = match ty.name {
        "Q8_0" => legacy::q8_0_row,
        "Q4_0" => legacy::q4_0_row,
        "Q4_1" => legacy::q4_1_row,
        "Q5_0" => legacy::q5_0_row,
        "Q4_K" => k_quants::q4_k_row,
        "Q6_K" => k_quants::q6_k_row,
        "BF16" => legacy::bf16_row,
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

/// `x` quantized to `ty` and decoded again (tests).
#[cfg(test)]
fn round_trip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    let mut q = vec![0u8; ty.bytes_for(x.len() as u64).unwrap() as usize];
    quantize(ty, x, &mut q).unwrap();
    let mut y = vec![0f32; x.len()];
    crate::dtype::dequant::dequantize(ty, &q, &mut y).unwrap();
    y
}

#[cfg(test)]
mod gguf_py_tests;

#[cfg(test)]
mod tests {
    use super::*;

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
                GgmlType::Q5_0,
                GgmlType::Q4_K,
                GgmlType::Q6_K,
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

    #[test]
    fn bad_input_is_refused_naming_it() {
        let mut q = [0u8; 34];
        let q5k = GgmlType::from_id(13).unwrap();
        let e = format!(
            "{:#}",
            quantize(q5k, &[0.0; 256], &mut [0; 176]).unwrap_err()
        );
        assert!(
            e.contains("cannot quantize to Q5_K")
                && e.contains("Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K, BF16"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            quantize(GgmlType::Q8_0, &[0.0; 31], &mut q).unwrap_err()
        );
        assert!(e.contains("not a whole number of Q8_0 blocks of 32"), "{e}");
        let e = format!(
            "{:#}",
            quantize(GgmlType::Q6_K, &[0.0; 255], &mut [0; 210]).unwrap_err()
        );
        assert!(
            e.contains("not a whole number of Q6_K blocks of 256"),
            "{e}"
        );
        let mut x = [0f32; 32];
        x[5] = f32::NAN;
        let e = format!("{:#}", quantize(GgmlType::Q8_0, &x, &mut q).unwrap_err());
        assert!(e.contains("value 5 is NaN"), "{e}");
    }
}
