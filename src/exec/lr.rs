//! Learning-rate schedule: linear warmup, then cosine decay to `min_frac` of the peak.

/// The default warm-up of a run of `steps` steps: a tenth of them, at most 50 (a short
/// fine-tune reaches its learning rate; a long run warms up as it always did).
pub fn default_warmup(steps: u64) -> u64 {
    (steps / 10).min(50)
}

/// The schedule in words, e.g. `lr: warm-up 2 steps to 6e-4, cosine to 6e-5 at step 20`.
pub fn describe(steps: u64, warmup: u64, peak: f32, min_frac: f32) -> String {
    let warm = match warmup.min(steps) {
        0 => "no warm-up, starts at".to_string(),
        1 => "warm-up 1 step to".to_string(),
        w => format!("warm-up {w} steps to"),
    };
    format!(
        "lr: {warm} {}, cosine to {} at step {steps}",
        short(peak),
        short(peak * min_frac)
    )
}

/// A learning rate in four significant digits, without trailing zeros: `6e-5`, `3.125e-4`.
fn short(x: f32) -> String {
    let s = format!("{x:.3e}");
    match s.split_once('e') {
        Some((m, e)) if m.contains('.') => {
            format!("{}e{e}", m.trim_end_matches('0').trim_end_matches('.'))
        }
        _ => s,
    }
}

/// Learning rate for optimizer step `step` (0-based) of `total`.
pub fn cosine_with_warmup(step: u64, total: u64, warmup: u64, peak: f32, min_frac: f32) -> f32 {
    if step < warmup {
        return peak * (step + 1) as f32 / warmup as f32;
    }
    let min = peak * min_frac;
    if step >= total {
        return min;
    }
    let span = (total - warmup).max(1) as f64;
    let progress = (step - warmup) as f64 / span;
    let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    min + (peak - min) * cos as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's 3-step example once ran at 6e-6 (warm-up 50 of a 3-step run).
    #[test]
    fn short_runs_reach_their_learning_rate() {
        assert_eq!(default_warmup(3), 0);
        assert_eq!(cosine_with_warmup(0, 3, default_warmup(3), 6e-4, 0.1), 6e-4);
        assert_eq!(default_warmup(20), 2);
        assert_eq!(default_warmup(500), 50);
        assert_eq!(default_warmup(100_000), 50);
        let d = describe(20, 2, 6e-4, 0.1);
        assert!(
            d.contains("warm-up 2 steps") && d.contains("step 20"),
            "{d}"
        );
    }

    #[test]
    fn warmup_then_decay() {
        let lr = |s| cosine_with_warmup(s, 100, 10, 1.0, 0.1);
        assert!((lr(0) - 0.1).abs() < 1e-6);
        assert!((lr(9) - 1.0).abs() < 1e-6);
        assert!((lr(10) - 1.0).abs() < 1e-6);
        assert!(lr(55) < lr(20) && lr(55) > lr(99));
        assert!((lr(100) - 0.1).abs() < 1e-6);
    }
}
