//! The leak check. With a static plan, resident memory stops growing once the first steps
//! have touched the arena; growth after that means something allocates outside the plan.
//! [`LeakCheck`] takes the RSS after every step and reports growth beyond a tolerance.

use crate::util::bytes::fmt_bytes;
use serde::Serialize;

/// Steps after which RSS must be flat: the first step touches the arena and the loader's
/// buffers, the second any lazily created state (thread pools, kernel workspaces).
pub const WARMUP_STEPS: u64 = 2;

/// Growth tolerated after warm-up: the larger of 16 MiB and 2% of the plan's bytes (the
/// allocator's own bookkeeping and transient checkpoint writes stay below it).
pub fn tolerance(plan_bytes: u64) -> u64 {
    (16u64 << 20).max(plan_bytes / 50)
}

/// What the check found.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LeakReport {
    /// RSS at the end of the warm-up (the reference).
    pub reference_step: u64,
    pub reference_rss: u64,
    /// The step with the highest RSS after warm-up, and that RSS.
    pub max_step: u64,
    pub max_rss: u64,
    pub tolerance: u64,
    /// Growth beyond the tolerance.
    pub leaking: bool,
}

impl LeakReport {
    pub fn growth(&self) -> i64 {
        self.max_rss as i64 - self.reference_rss as i64
    }

    /// One line for the console or the report.
    pub fn message(&self) -> String {
        let g = self.growth();
        let growth = if g >= 0 {
            format!("+{}", fmt_bytes(g as u64))
        } else {
            format!("-{}", fmt_bytes(g.unsigned_abs()))
        };
        if self.leaking {
            format!(
                "warning: resident memory grew from {} after step {} to {} at step {} ({growth}, tolerance {}); \
                 with a static plan this means something allocates outside the plan (a leak)",
                fmt_bytes(self.reference_rss),
                self.reference_step,
                fmt_bytes(self.max_rss),
                self.max_step,
                fmt_bytes(self.tolerance)
            )
        } else {
            format!(
                "memory check: resident memory flat after step {} ({} at step {}, {growth}, tolerance {})",
                self.reference_step,
                fmt_bytes(self.max_rss),
                self.max_step,
                fmt_bytes(self.tolerance)
            )
        }
    }
}

/// Collects the RSS after each step.
#[derive(Clone, Debug)]
pub struct LeakCheck {
    tolerance: u64,
    reference: Option<(u64, u64)>,
    max: Option<(u64, u64)>,
    warned: bool,
}

impl LeakCheck {
    pub fn new(plan_bytes: u64) -> LeakCheck {
        LeakCheck {
            tolerance: tolerance(plan_bytes),
            reference: None,
            max: None,
            warned: false,
        }
    }

    /// Observes the RSS after `steps_done` steps of this process (1-based). Returns the
    /// report the first time growth exceeds the tolerance, so the caller can warn at once.
    pub fn observe(&mut self, steps_done: u64, rss: u64) -> Option<LeakReport> {
        if steps_done <= WARMUP_STEPS {
            // The reference is the highest RSS seen during warm-up.
            if self.reference.is_none_or(|(_, r)| rss >= r) {
                self.reference = Some((steps_done, rss));
            }
            return None;
        }
        if self.max.is_none_or(|(_, m)| rss > m) {
            self.max = Some((steps_done, rss));
        }
        let r = self.report()?;
        if r.leaking && !self.warned {
            self.warned = true;
            return Some(r);
        }
        None
    }

    /// The verdict so far; `None` until a step after warm-up was observed.
    pub fn report(&self) -> Option<LeakReport> {
        let (reference_step, reference_rss) = self.reference?;
        let (max_step, max_rss) = self.max?;
        Some(LeakReport {
            reference_step,
            reference_rss,
            max_step,
            max_rss,
            tolerance: self.tolerance,
            leaking: max_rss > reference_rss + self.tolerance,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    #[test]
    fn flat_memory_passes_and_growth_warns_once_with_the_numbers() {
        let mut flat = LeakCheck::new(100 * MB);
        for (s, rss) in [(1, 500), (2, 520), (3, 521), (4, 530), (5, 519)] {
            assert_eq!(flat.observe(s, rss * MB), None);
        }
        let r = flat.report().unwrap();
        assert!(!r.leaking);
        assert_eq!((r.reference_step, r.max_step), (2, 4));
        assert!(r.message().starts_with("memory check"), "{}", r.message());

        let mut leak = LeakCheck::new(100 * MB);
        let mut warnings = Vec::new();
        for s in 1..=10u64 {
            // 5 MiB per step after warm-up: beyond 16 MiB at step 6.
            let rss = 500 * MB + s.saturating_sub(2) * 5 * MB;
            warnings.extend(leak.observe(s, rss));
        }
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].max_step, 6);
        let m = leak.report().unwrap().message();
        assert!(m.starts_with("warning") && m.contains("step 10"), "{m}");
    }

    #[test]
    fn no_verdict_before_a_step_after_warm_up() {
        let mut c = LeakCheck::new(0);
        c.observe(1, 10);
        c.observe(2, 10);
        assert_eq!(c.report(), None);
        assert_eq!(tolerance(10 << 30), (10u64 << 30) / 50);
    }
}
