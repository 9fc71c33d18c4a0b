//! [`TrainSummary`]: what a finished run reports (`memwall train`'s last lines), and the
//! warning when the measured peak exceeded `--max-memory`.

use crate::profile::leak::LeakReport;
use crate::util::bytes::fmt_bytes;
use serde::Serialize;
use std::path::PathBuf;

/// What a finished run reports.
#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    pub out: PathBuf,
    pub first_step: u64,
    pub last_step: u64,
    /// The last step's loss that trained a token (NaN when none did).
    pub final_loss: f32,
    pub final_val_loss: Option<f32>,
    pub tokens_per_s: f64,
    /// Multi-process runs: the share of step time the communication thread spent in
    /// collectives (after the first step).
    pub comm_frac: Option<f64>,
    /// Of step time, the share the ops waited for collectives: communication not hidden
    /// behind compute.
    pub comm_exposed_frac: Option<f64>,
    /// Pipeline stages of the job (1: none): with several, what the ops wait for includes
    /// the stages' sends and receives and the schedule's bubble, not only collectives.
    pub pipeline_stages: usize,
    pub plan_total_bytes: u64,
    pub baseline_bytes: u64,
    pub peak_rss_bytes: Option<u64>,
    /// A GPU run: the device's memory in use after the last step (its context and the plan's
    /// one allocation: the run's peak there). The memory line and `--max-memory` are then
    /// the device's, and `baseline_bytes` is the context.
    pub device_in_use_bytes: Option<u64>,
    /// `--max-memory`, and the peak predicted against it (plan + baseline + runtime reserve).
    pub max_memory: Option<u64>,
    pub predicted_peak_bytes: u64,
    pub last_checkpoint: Option<PathBuf>,
    /// The leak check's verdict (`None` when the run had too few steps for one).
    pub leak: Option<LeakReport>,
    /// The reports written when profiling (`report.html` and its siblings).
    pub report: Option<PathBuf>,
}

impl TrainSummary {
    /// The measured peak the plan is held to: the device's memory on a GPU, else the
    /// process's resident memory.
    fn peak(&self) -> Option<u64> {
        self.device_in_use_bytes.or(self.peak_rss_bytes)
    }

    /// What the peak and the baseline are called: a GPU's memory in use and its context, or
    /// the process's peak RSS and baseline.
    fn memory_words(&self) -> (&'static str, &'static str) {
        match self.device_in_use_bytes {
            Some(_) => ("device memory in use", "context"),
            None => ("peak RSS", "baseline"),
        }
    }

    /// The lines `memwall train` ends with: steps, losses, throughput and memory; then the
    /// last checkpoint and the report, when there are any.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "trained steps {}..{}: {}{} | {} | {} {} (plan {} + {} {})",
            self.first_step,
            self.last_step,
            match self.final_loss {
                l if l.is_nan() => "no loss (no step had a trained token)".to_string(),
                l => format!("loss {l:.4}"),
            },
            self.final_val_loss
                .map(|v| format!(", val loss {v:.4}"))
                .unwrap_or_default(),
            // The first step of an invocation warms up and is not timed.
            match self.tokens_per_s {
                t if t > 0.0 => format!("{t:.0} tokens/s"),
                _ => "tokens/s not timed (one step ran: the first is warm-up)".to_string(),
            },
            self.memory_words().0,
            self.peak().map(fmt_bytes).unwrap_or_else(|| "?".into()),
            fmt_bytes(self.plan_total_bytes),
            self.memory_words().1,
            fmt_bytes(self.baseline_bytes)
        );
        if let Some(by) = over_max_memory(self.peak(), self.max_memory) {
            s.push('\n');
            s.push_str(&over_max_memory_warning(
                self.memory_words(),
                self.peak().unwrap_or(0),
                self.max_memory.unwrap_or(0),
                self.predicted_peak_bytes,
                by,
            ));
        }
        if let (Some(busy), Some(exposed)) = (self.comm_frac, self.comm_exposed_frac) {
            s.push_str(&match self.pipeline_stages {
                1 => format!(
                    "\ncommunication: collectives busy {:.1}% of step time; {:.1}% exposed (ops \
                     waiting for them)",
                    100.0 * busy,
                    100.0 * exposed
                ),
                stages => format!(
                    "\ncommunication: collectives and transfers between the {stages} stages busy \
                     {:.1}% of step time; {:.1}% spent waiting for them (the pipeline's bubble \
                     included)",
                    100.0 * busy,
                    100.0 * exposed
                ),
            });
        }
        if let Some(c) = &self.last_checkpoint {
            s.push_str(&format!("\ncheckpoint: {}", c.display()));
        }
        if let Some(r) = &self.report {
            s.push_str(&format!(
                "\nreport: {} (trace.json, memory.svg beside it)",
                r.display()
            ));
        }
        s
    }
}

/// By how much the measured `peak` exceeds the `--max-memory` `budget` (`None` within it,
/// or when either is unknown).
pub fn over_max_memory(peak: Option<u64>, budget: Option<u64>) -> Option<u64> {
    peak?.checked_sub(budget?).filter(|&by| by > 0)
}

/// The warning printed (once) and put in the summary when the measured peak exceeds
/// `--max-memory`.
pub fn over_max_memory_warning(
    (what, baseline): (&str, &str),
    peak: u64,
    budget: u64,
    predicted: u64,
    by: u64,
) -> String {
    format!(
        "warning: {what} {} exceeds --max-memory {} by {} (predicted {}: plan + {baseline} + \
         runtime reserve); memory outside the plan outgrew the reserve: raise --max-memory by \
         that much, and please report it",
        fmt_bytes(peak),
        fmt_bytes(budget),
        fmt_bytes(by),
        fmt_bytes(predicted)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(peak: u64, budget: Option<u64>) -> TrainSummary {
        TrainSummary {
            out: PathBuf::from("run"),
            first_step: 0,
            last_step: 3,
            final_loss: 1.0,
            final_val_loss: None,
            tokens_per_s: 1.0,
            comm_frac: None,
            comm_exposed_frac: None,
            pipeline_stages: 1,
            plan_total_bytes: 100 << 20,
            baseline_bytes: 7 << 20,
            peak_rss_bytes: Some(peak),
            device_in_use_bytes: None,
            max_memory: budget,
            predicted_peak_bytes: 112 << 20,
            last_checkpoint: None,
            leak: None,
            report: None,
        }
    }

    /// On a GPU the memory line is the device's (its use against plan + context), and so is
    /// the warning.
    #[test]
    fn a_gpu_runs_summary_gives_the_devices_memory() {
        let gpu = TrainSummary {
            device_in_use_bytes: Some(130 << 20),
            ..summary(50 << 20, Some(120 << 20))
        };
        let s = gpu.describe();
        assert!(
            s.contains("device memory in use 130.00 MiB (plan 100.00 MiB + context 7.00 MiB)")
                && s.contains("warning: device memory in use 130.00 MiB exceeds --max-memory")
                && s.contains("plan + context + runtime reserve")
                && !s.contains("RSS"),
            "{s}"
        );
    }

    /// A pipeline's waits are named as what they are: stage transfers and the bubble too.
    #[test]
    fn a_pipelines_waits_are_not_called_collectives_alone() {
        let one = TrainSummary {
            comm_frac: Some(0.2),
            comm_exposed_frac: Some(0.1),
            ..summary(50 << 20, None)
        };
        assert!(
            one.describe().contains("collectives busy 20.0%"),
            "{}",
            one.describe()
        );
        let staged = TrainSummary {
            pipeline_stages: 2,
            ..one
        }
        .describe();
        assert!(
            staged.contains("transfers between the 2 stages busy 20.0%")
                && staged.contains("10.0% spent waiting for them (the pipeline's bubble included)"),
            "{staged}"
        );
    }

    /// A measured peak above `--max-memory` is said in the summary, with by how much; within
    /// the budget, or without one, nothing is.
    #[test]
    fn the_summary_warns_when_the_peak_exceeds_max_memory() {
        let s = summary(125 << 20, Some(120 << 20)).describe();
        assert!(
            s.contains("warning: peak RSS 125.00 MiB exceeds --max-memory 120.00 MiB by 5.00 MiB")
                && s.contains("predicted 112.00 MiB"),
            "{s}"
        );
        for quiet in [
            summary(120 << 20, Some(120 << 20)),
            summary(125 << 20, None),
        ] {
            assert!(
                !quiet.describe().contains("warning"),
                "{}",
                quiet.describe()
            );
        }
        assert_eq!(over_max_memory(Some(5), Some(3)), Some(2));
        assert_eq!(over_max_memory(Some(3), Some(3)), None);
        assert_eq!(over_max_memory(None, Some(3)), None);
    }

    /// A run none of whose steps trained a token reports no loss rather than 0, and a
    /// one-step run no throughput rather than 0 tokens/s.
    #[test]
    fn no_loss_over_no_tokens_and_no_untimed_throughput() {
        let mut s = summary(1 << 20, None);
        (s.final_loss, s.tokens_per_s) = (f32::NAN, 0.0);
        let text = s.describe();
        assert!(
            text.contains("no loss (no step had a trained token)"),
            "{text}"
        );
        assert!(text.contains("tokens/s not timed"), "{text}");
        assert!(
            !text.contains("loss 0.0000") && !text.contains("0 tokens/s"),
            "{text}"
        );
    }
}
