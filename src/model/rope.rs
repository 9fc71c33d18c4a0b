//! Rotary position embeddings' frequencies: the `inv_freq` table every RoPE op carries,
//! computed as transformers computes it (`modeling_rope_utils.py`:
//! `_compute_default_rope_parameters` and `_compute_llama3_parameters`), in f32.
//!
//! Pair i of a head (elements i and i + d/2, the rotate-half convention) turns by the angle
//! `pos · inv_freq[i]`, `inv_freq[i] = θ^(−2i/d)`. Llama 3's scaling stretches the low
//! frequencies (long wavelengths) by `factor`, keeps the high ones, and interpolates between.

/// Llama 3's rope scaling (`rope_scaling` / `rope_parameters` with `rope_type` `llama3`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
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
}
