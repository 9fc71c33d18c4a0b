//! Rotary position embeddings' frequencies: the `inv_freq` table every RoPE op carries and
//! the factor its cosines and sines are scaled by, computed as transformers computes them
//! (`modeling_rope_utils.py`: `_compute_default_rope_parameters`, `_compute_llama3_parameters`
//! and `_compute_longrope_parameters`), in f32.
//!
//! Pair i of a head (elements i and i + d/2, the rotate-half convention) turns by the angle
//! `pos · inv_freq[i]`, `inv_freq[i] = θ^(−2i/d)`. Llama 3's scaling stretches the low
//! frequencies (long wavelengths) by `factor`, keeps the high ones, and interpolates between.
//! LongRoPE (Phi-3's 128k models, Phi-3.5) divides each frequency by its own factor: the
//! `short_factor` list for sequences within the pretraining context
//! (`original_max_position_embeddings`), the `long_factor` list beyond it; and scales the
//! rotation's cosines and sines by `attention_factor` (√(1 + ln s / ln original), s the
//! context's extension, when the config does not give it).

/// Llama 3's rope scaling (`rope_scaling` / `rope_parameters` with `rope_type` `llama3`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// LongRoPE (`rope_type` `longrope`, or the older `su` and `yarn` names Phi-3's configs use,
/// which transformers' `Phi3Config` reads as `longrope`).
#[derive(Clone, Debug, PartialEq)]
pub struct LongRope {
    /// Per-pair divisors of the frequencies within the pretraining context `[hd/2]`.
    pub short_factor: Vec<f32>,
    /// Per-pair divisors beyond it `[hd/2]`.
    pub long_factor: Vec<f32>,
    /// The pretraining context: longer sequences use `long_factor`.
    pub original_max_position_embeddings: usize,
    /// The cosines' and sines' scale (transformers' `attention_scaling`).
    pub attention_factor: f32,
}

impl LongRope {
    /// transformers' default `attention_factor` for a context extended `factor` times beyond
    /// `original` positions: √(1 + ln factor / ln original), 1 when not extended.
    pub fn default_attention_factor(factor: f64, original: usize) -> f32 {
        if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original as f64).ln()).sqrt() as f32
        }
    }
}

/// A rope scaling memwall computes.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    Llama3(Llama3Scaling),
    LongRope(LongRope),
    /// Position interpolation (`rope_type` `linear`, Gemma 3's full layers on the 4B and
    /// larger): every frequency divided by `factor` (transformers'
    /// `_compute_linear_scaling_rope_parameters`).
    Linear {
        factor: f32,
    },
}

impl RopeScaling {
    /// The factor cosines and sines are multiplied by (transformers' `attention_scaling`).
    pub fn attention_factor(&self) -> f32 {
        match self {
            RopeScaling::Llama3(_) | RopeScaling::Linear { .. } => 1.0,
            RopeScaling::LongRope(l) => l.attention_factor,
        }
    }
}

/// The rotation of a plan: `inv_freq[hd/2]` and the scale of its cosines and sines.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub inv_freq: Vec<f32>,
    pub scale: f32,
}

/// The table for heads of `head_dim` channels with base `theta`, scaled when asked, for
/// sequences of `seq` positions (LongRoPE picks its factors by the length, as transformers'
/// `dynamic_rope_update` does for a forward over `seq` positions).
pub fn table(head_dim: usize, theta: f32, scaling: Option<&RopeScaling>, seq: usize) -> RopeTable {
    let scale = scaling.map_or(1.0, RopeScaling::attention_factor);
    let inv_freq = match scaling {
        None => inv_freq(head_dim, theta, None),
        Some(RopeScaling::Llama3(s)) => inv_freq(head_dim, theta, Some(s)),
        // transformers: inv_freq /= factor.
        Some(RopeScaling::Linear { factor }) => inv_freq(head_dim, theta, None)
            .into_iter()
            .map(|f| f / factor)
            .collect(),
        Some(RopeScaling::LongRope(l)) => {
            let ext = if seq > l.original_max_position_embeddings {
                &l.long_factor
            } else {
                &l.short_factor
            };
            // transformers: 1.0 / (ext_factors * base**(arange(0, dim, 2).float() / dim)).
            let d = head_dim as f32;
            (0..head_dim / 2)
                .zip(ext)
                .map(|(i, &e)| 1.0 / (e * theta.powf((2 * i) as f32 / d)))
                .collect()
        }
    };
    RopeTable { inv_freq, scale }
}

/// `inv_freq[hd/2]` for heads of `head_dim` channels with base `theta`, scaled when asked.
pub fn inv_freq(head_dim: usize, theta: f32, scaling: Option<&Llama3Scaling>) -> Vec<f32> {
    // transformers: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), all f32.
    let d = head_dim as f32;
    let base: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / d))
        .collect();
    let Some(s) = scaling else {
        return base;
    };
    let old = s.original_max_position_embeddings as f32;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_are_powers_of_theta() {
        let f = inv_freq(8, 10_000.0, None);
        // θ^(−2i/8) for i = 0..4: 1, 10^(−1), 10^(−2), 10^(−3).
        let want = [1.0f32, 0.1, 0.01, 0.001];
        assert_eq!(f.len(), 4);
        for (g, w) in f.iter().zip(want) {
            assert!((g - w).abs() <= 1e-6 * w, "{g} vs {w}");
        }
    }

    #[test]
    fn llama3_scaling_splits_by_wavelength() {
        // Llama 3.2: θ 500000, factor 32, low 1, high 4, original context 8192; head dim 64.
        let s = Llama3Scaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let base = inv_freq(64, 500_000.0, None);
        let scaled = inv_freq(64, 500_000.0, Some(&s));
        let (mut kept, mut divided, mut blended) = (0, 0, 0);
        for (&b, &x) in base.iter().zip(&scaled) {
            let wavelen = 2.0 * std::f32::consts::PI / b;
            if wavelen < 2048.0 {
                assert_eq!(x, b);
                kept += 1;
            } else if wavelen > 8192.0 {
                assert_eq!(x, b / 32.0);
                divided += 1;
            } else {
                // Between the two: a convex blend of b/32 and b, increasing with frequency.
                assert!(
                    x > b / 32.0 && x < b,
                    "{x} not between {} and {b}",
                    b / 32.0
                );
                blended += 1;
            }
        }
        // Wavelengths 2π·500000^(2i/64) (computed with python3): i = 14 → 1956.5 and
        // i = 15 → 2948.3 straddle 2048; i = 17 → 6695.1 and i = 18 → 10089.1 straddle 8192.
        assert_eq!((kept, blended, divided), (15, 3, 14));
    }

    #[test]
    fn longrope_divides_by_the_factors_of_the_length_and_scales() {
        let l = LongRope {
            short_factor: vec![1.0, 2.0],
            long_factor: vec![4.0, 8.0],
            original_max_position_embeddings: 16,
            attention_factor: LongRope::default_attention_factor(4.0, 16),
        };
        let s = Some(RopeScaling::LongRope(l));
        let base = inv_freq(4, 100.0, None); // 1, 0.1
        let short = table(4, 100.0, s.as_ref(), 16);
        let long = table(4, 100.0, s.as_ref(), 17);
        assert_eq!(short.inv_freq, vec![base[0], base[1] / 2.0]);
        assert_eq!(long.inv_freq, vec![base[0] / 4.0, base[1] / 8.0]);
        // √(1 + ln 4 / ln 16) = √1.5, whatever the length.
        let want = 1.5f32.sqrt();
        assert!((short.scale - want).abs() < 1e-7 && short.scale == long.scale);
        assert_eq!(LongRope::default_attention_factor(1.0, 16), 1.0);
        let plain = table(4, 100.0, None, 1000);
        assert_eq!((plain.inv_freq, plain.scale), (base, 1.0));
    }
}
