//! Learning-rate schedule: linear warmup, then cosine decay to `min_frac` of the peak.

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
