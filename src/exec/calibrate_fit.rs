//! Fitting an op kind's cost from timed samples: `secs ≈ a · flops + b · bytes + c`, each
//! coefficient non-negative ([`fit`]), for `memwall calibrate`'s suite and the host's AdamW.

use crate::plan::time::Cost;

/// One timed op: its kind, FLOPs, bytes and seconds.
pub struct Sample {
    pub kind: String,
    pub flops: f64,
    pub bytes: f64,
    pub secs: f64,
}

/// Solves the `k × k` system `a · x = b` (Gaussian elimination, partial pivoting); `None`
/// when singular.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let k = b.len();
    for col in 0..k {
        let p = (col..k).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[p][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, p);
        b.swap(col, p);
        let pivot = a[col].clone();
        for row in col + 1..k {
            let f = a[row][col] / pivot[col];
            for (x, p) in a[row][col..].iter_mut().zip(&pivot[col..]) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = vec![0.0; k];
    for row in (0..k).rev() {
        let s: f64 = (row + 1..k).map(|c| a[row][c] * x[c]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    Some(x)
}

/// Fits `secs ≈ a · flops + b · bytes + c` with a, b, c ≥ 0, minimising the squared relative
/// error: every subset of the three terms is solved by least squares, and the best fit whose
/// coefficients are all non-negative is kept.
pub fn fit(samples: &[&Sample]) -> Cost {
    let feats = |s: &Sample| [s.flops, s.bytes, 1.0];
    let mut best: Option<(f64, [f64; 3])> = None;
    for mask in 1u8..8 {
        let terms: Vec<usize> = (0..3).filter(|i| mask & (1 << i) != 0).collect();
        if terms
            .iter()
            .any(|&i| samples.iter().all(|s| feats(s)[i] == 0.0))
        {
            continue;
        }
        // Rows x_i / t (weights 1/t): minimise Σ (x·coef / t − 1)².
        let k = terms.len();
        let mut ata = vec![vec![0.0; k]; k];
        let mut atb = vec![0.0; k];
        // Scale each column to unit size so flops (1e9) and the constant (1) condition well.
        let scale: Vec<f64> = terms
            .iter()
            .map(|&i| {
                samples
                    .iter()
                    .map(|s| feats(s)[i] / s.secs)
                    .fold(0.0, f64::max)
                    .max(1e-300)
            })
            .collect();
        for s in samples {
            let x: Vec<f64> = terms
                .iter()
                .zip(&scale)
                .map(|(&i, sc)| feats(s)[i] / s.secs / sc)
                .collect();
            for r in 0..k {
                atb[r] += x[r];
                for c in 0..k {
                    ata[r][c] += x[r] * x[c];
                }
            }
        }
        let Some(sol) = solve(ata, atb) else { continue };
        if sol.iter().any(|&v| v < 0.0 || !v.is_finite()) {
            continue;
        }
        let mut coef = [0.0; 3];
        for ((&i, v), sc) in terms.iter().zip(&sol).zip(&scale) {
            coef[i] = v / sc;
        }
        let err: f64 = samples
            .iter()
            .map(|s| {
                let p: f64 = feats(s).iter().zip(&coef).map(|(f, c)| f * c).sum();
                (p / s.secs - 1.0).powi(2)
            })
            .sum();
        if best.is_none_or(|(e, _)| err < e) {
            best = Some((err, coef));
        }
    }
    let (err, [a, b, c]) = best.unwrap_or((0.0, [0.0, 0.0, 1e-5]));
    Cost {
        s_per_flop: a,
        s_per_byte: b,
        s_per_op: c,
        samples: samples.len(),
        fit_error_pct: 100.0 * (err / samples.len().max(1) as f64).sqrt(),
    }
}

/// A sample of kind `k` (tests).
#[cfg(test)]
pub(super) fn sample(flops: f64, bytes: f64, secs: f64) -> Sample {
    Sample {
        kind: "k".into(),
        flops,
        bytes,
        secs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_the_coefficients_of_exact_samples() {
        let (a, b, c) = (1.0 / 150e9, 1.0 / 20e9, 30e-6);
        let ss: Vec<Sample> = [(1e9, 4e6), (8e9, 3e7), (2e7, 9e5), (6e10, 1e8), (3e8, 2e8)]
            .iter()
            .map(|&(f, m)| sample(f, m, a * f + b * m + c))
            .collect();
        let refs: Vec<&Sample> = ss.iter().collect();
        let cost = fit(&refs);
        for (got, want) in [
            (cost.s_per_flop, a),
            (cost.s_per_byte, b),
            (cost.s_per_op, c),
        ] {
            assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
        }
        assert!(cost.fit_error_pct < 1e-6);
        assert_eq!(cost.samples, 5);
    }

    #[test]
    fn fit_never_goes_negative() {
        // Times that fall with size would want a negative coefficient: the fit drops that term.
        let ss = [
            sample(0.0, 1e6, 2e-3),
            sample(0.0, 2e6, 1e-3),
            sample(0.0, 4e6, 1.5e-3),
        ];
        let refs: Vec<&Sample> = ss.iter().collect();
        let cost = fit(&refs);
        assert!(cost.s_per_flop == 0.0 && cost.s_per_byte >= 0.0 && cost.s_per_op >= 0.0);
        assert!(cost.seconds(0, 2_000_000) > 0.0);
    }
}
