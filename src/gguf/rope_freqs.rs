//! Llama 3 rope scaling as llama.cpp keeps it: the `rope_freqs.weight` tensor, one F32 factor
//! per rotary pair (`head_dim / 2` of them) that llama.cpp divides each frequency by.
//!
//! [`factors`] computes the tensor as `convert_hf_to_gguf.py` (`LlamaModel.
//! generate_extra_tensors`) does, in f32 as torch does: `freq = 1 / θ^(2i/d)`, `wavelen =
//! 2π / freq`; wavelengths under `old / high_freq_factor` keep factor 1, those over `old /
//! low_freq_factor` get `factor`, the ones between `1 / ((1 − s) / factor + s)` with `s = (old /
//! wavelen − low_freq_factor) / (high_freq_factor − low_freq_factor)`. One difference: the
//! converter reads `original_max_position_embeddings` from the top level of `config.json`
//! (8192 when absent, as in every Llama 3.x release) while transformers and memwall read it
//! from `rope_scaling`; memwall writes the factors of the `rope_scaling` value, so llama.cpp
//! computes what memwall trained with.
//!
//! [`scaling_from_factors`] goes back (`memwall convert` reading such a file): the largest
//! factor is `factor`; Llama 3.x's own values (low 1, high 4, original context 8192) are tried
//! first, then the values the blended factors fix when `low_freq_factor` is 1 (two blended
//! pairs or more: each gives `s`, and `s = a / wavelen − b` with `b = 1 / (high − 1)`, `a =
//! old · b`). A candidate is taken only when it gives back every factor (relative error at most
//! 1e-5); otherwise the file is refused, naming the tensor.

use anyhow::{Result, bail};

/// Llama 3's scaling parameters (HF `rope_scaling` with `rope_type` `llama3`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Params {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// The GGUF name of the factors.
pub const TENSOR: &str = "rope_freqs.weight";

/// `freq[i] = 1 / θ^(2i/d)` and its wavelength `2π / freq`, in f32 as torch computes them.
fn wavelengths(head_dim: usize, theta: f32) -> Vec<f32> {
    let d = head_dim as f32;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f32 / d);
            (2.0 * std::f64::consts::PI) as f32 / freq
        })
        .collect()
}

/// The `rope_freqs` factors `[head_dim / 2]` (see the module doc).
pub fn factors(head_dim: usize, theta: f32, p: &Llama3Params) -> Vec<f32> {
    let old = p.original_max_position_embeddings as f64;
    let (low, high) = (p.low_freq_factor as f64, p.high_freq_factor as f64);
    let low_wavelen = (old / low) as f32;
    let high_wavelen = (old / high) as f32;
    let span = (high - low) as f32;
    wavelengths(head_dim, theta)
        .into_iter()
        .map(|w| {
            if w < high_wavelen {
                1.0
            } else if w > low_wavelen {
                p.factor
            } else {
                let s = (old as f32 / w - low as f32) / span;
                1.0 / ((1.0 - s) / p.factor + s)
            }
        })
        .collect()
}

/// Whether `got` equals `want` to a relative 1e-5, element by element.
fn close(got: &[f32], want: &[f32]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| (g - w).abs() <= 1e-5 * w.abs().max(1.0))
}

/// The scaling whose [`factors`] are `f` (see the module doc); `Ok(None)` when every factor
/// is 1 (no scaling); an error (without the file's name: the caller adds it) when none fits.
pub fn scaling_from_factors(
    f: &[f32],
    head_dim: usize,
    theta: f32,
) -> Result<Option<Llama3Params>> {
    if f.len() != head_dim / 2 {
        bail!(
            "tensor {TENSOR} has {} factors; a head of {head_dim} channels has {} rotary pairs",
            f.len(),
            head_dim / 2
        );
    }
    if let Some(x) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
        bail!("tensor {TENSOR} holds {x}; its factors must be finite and positive");
    }
    if f.iter().all(|&x| x == 1.0) {
        return Ok(None);
    }
    let factor = f.iter().copied().fold(f32::MIN, f32::max);
    let mut candidates = vec![Llama3Params {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    }];
    let w = wavelengths(head_dim, theta);
    // (1 / wavelen, s) of each blended pair.
    let blends: Vec<(f64, f64)> = f
        .iter()
        .zip(&w)
        .filter(|(x, _)| **x != 1.0 && **x != factor)
        .map(|(&x, &wl)| {
            let inv_f = 1.0 / factor as f64;
            (1.0 / wl as f64, (1.0 / x as f64 - inv_f) / (1.0 - inv_f))
        })
        .collect();
    if let (Some(&(u1, s1)), Some(&(u2, s2))) = (blends.first(), blends.last())
        && blends.len() >= 2
        && u1 != u2
    {
        let a = (s1 - s2) / (u1 - u2);
        let b = a * u1 - s1;
        if b > 0.0 && a > 0.0 {
            let high = ((1.0 + 1.0 / b) * 1000.0).round() / 1000.0;
            let old = (a / b).round();
            if old >= 1.0 && old < u32::MAX as f64 {
                candidates.push(Llama3Params {
                    factor,
                    low_freq_factor: 1.0,
                    high_freq_factor: high as f32,
                    original_max_position_embeddings: old as usize,
                });
            }
        }
    }
    for c in candidates {
        if close(&factors(head_dim, theta, &c), f) {
            return Ok(Some(c));
        }
    }
    bail!(
        "tensor {TENSOR} (Llama 3 rope scaling factors {f:?}) matches no llama3 rope_scaling memwall \
         can rebuild (it tries low_freq_factor 1, high_freq_factor 4, original context 8192, and \
         low_freq_factor 1 with the values two blended factors fix)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA32: Llama3Params = Llama3Params {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };

    #[test]
    fn llama_3_2_factors_split_by_wavelength_and_come_back() {
        // θ 500000, head 64: wavelengths 2π·500000^(2i/64); i ≤ 14 below 2048 (factor 1),
        // i = 15..17 blended, i ≥ 18 above 8192 (factor 32).
        let f = factors(64, 500_000.0, &LLAMA32);
        assert_eq!(f.len(), 32);
        assert!(f[..15].iter().all(|&x| x == 1.0), "{f:?}");
        assert!(f[15..18].iter().all(|&x| x > 1.0 && x < 32.0), "{f:?}");
        assert!(f[18..].iter().all(|&x| x == 32.0), "{f:?}");
        // Blended factors grow with the wavelength.
        assert!(f[15] < f[16] && f[16] < f[17]);
        // i = 15: wavelen 2948.3, s = (8192/2948.3 − 1)/3 = 0.59284; 1/((1−s)/32 + s) = 1.6513.
        assert!((f[15] - 1.6513).abs() < 1e-3, "{}", f[15]);
        assert_eq!(
            scaling_from_factors(&f, 64, 500_000.0).unwrap(),
            Some(LLAMA32)
        );
    }

    #[test]
    fn other_values_are_found_from_two_blended_pairs() {
        // Head 8, θ 100000: wavelengths 6.28, 111.7, 1987, 35325; high 64 and old 4096 blend
        // pairs 1 and 2.
        let p = Llama3Params {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 64.0,
            original_max_position_embeddings: 4096,
        };
        let f = factors(8, 100_000.0, &p);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[3], 8.0);
        assert!(f[1] > 1.0 && f[2] < 8.0 && f[1] < f[2], "{f:?}");
        assert_eq!(scaling_from_factors(&f, 8, 100_000.0).unwrap(), Some(p));
        assert_eq!(scaling_from_factors(&[1.0; 4], 8, 100_000.0).unwrap(), None);
        // One blended pair does not fix the values: refused by name.
        let e = scaling_from_factors(&[1.0, 3.0, 8.0, 8.0], 8, 100_000.0).unwrap_err();
        assert!(e.to_string().contains("rope_freqs.weight"), "{e}");
        let e = scaling_from_factors(&[1.0; 3], 8, 100_000.0).unwrap_err();
        assert!(e.to_string().contains("3 factors"), "{e}");
        let e = scaling_from_factors(&[1.0, f32::NAN, 2.0, 2.0], 8, 1e5).unwrap_err();
        assert!(e.to_string().contains("finite"), "{e}");
    }
}
