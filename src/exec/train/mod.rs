//! The training loop: validate everything up front, plan, allocate once, then for each step
//! draw a batch, run the schedule, log metrics, evaluate and checkpoint.
//!
//! A run directory (see [`crate::run_dir`]) holds `plan.json`, `metrics.jsonl` (one JSON object
//! per step) and `checkpoints/step-NNNNNN/`. `--resume RUN_DIR` continues from the newest
//! checkpoint with the run's own configuration and is bitwise identical to an uninterrupted
//! run.
//!
//! [`train`] reads as its three phases, each in its own file:
//! - `setup.rs`: every check that can fail before work starts, the plan (and `plan.json`),
//!   the executor, and the initial state (fresh, `--init` or `--resume`);
//! - `step.rs`: one optimizer step with its evaluation, metrics line, checkpoint and profile;
//! - `Run::finish`, here: the final reports and the summary.
//!
//! Around them: [`TrainOptions`] (`options.rs`), [`LossScaler`] (`loss_scale.rs`), the
//! [`Progress`] reporters (`progress.rs`), and the profiler's files (`profiling.rs`).

mod loss_scale;
mod options;
mod profiling;
mod progress;
mod setup;
mod step;

pub use loss_scale::LossScaler;
pub use options::{TrainOptions, default_threads, resume_options};
pub use progress::{ConsoleProgress, NoProgress, Progress};
pub use setup::{plan_for, planning_baseline};

use super::executor::Executor;
use crate::data::loader::{BatchLoader, DataSet};
use crate::dist::{Comm, Single};
use crate::model::ModelSpec;
use crate::profile::leak::{LeakCheck, LeakReport};
use crate::profile::{OpRecorder, Profile};
use crate::run_dir::{MetricsLog, RunDir};
use crate::util::bytes::fmt_bytes;
use crate::util::rss;
use anyhow::{Result, bail};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What a finished run reports.
#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    pub out: PathBuf,
    pub first_step: u64,
    pub last_step: u64,
    pub final_loss: f32,
    pub final_val_loss: Option<f32>,
    pub tokens_per_s: f64,
    /// Multi-process runs: the share of step time the communication thread spent in
    /// collectives (after the first step).
    pub comm_frac: Option<f64>,
    /// Of step time, the share the ops waited for collectives: communication not hidden
    /// behind compute.
    pub comm_exposed_frac: Option<f64>,
    pub plan_total_bytes: u64,
    pub baseline_bytes: u64,
    pub peak_rss_bytes: Option<u64>,
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
    /// The lines `memwall train` ends with: steps, losses, throughput and memory; then the
    /// last checkpoint and the report, when there are any.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "trained steps {}..{}: loss {:.4}{} | {:.0} tokens/s | peak RSS {} (plan {} + baseline {})",
            self.first_step,
            self.last_step,
            self.final_loss,
            self.final_val_loss
                .map(|v| format!(", val loss {v:.4}"))
                .unwrap_or_default(),
            self.tokens_per_s,
            self.peak_rss_bytes
                .map(fmt_bytes)
                .unwrap_or_else(|| "?".into()),
            fmt_bytes(self.plan_total_bytes),
            fmt_bytes(self.baseline_bytes)
        );
        if let Some(by) = over_max_memory(self.peak_rss_bytes, self.max_memory) {
            s.push('\n');
            s.push_str(&over_max_memory_warning(
                self.peak_rss_bytes.unwrap_or(0),
                self.max_memory.unwrap_or(0),
                self.predicted_peak_bytes,
                by,
            ));
        }
        if let (Some(busy), Some(exposed)) = (self.comm_frac, self.comm_exposed_frac) {
            s.push_str(&format!(
                "\ncommunication: collectives busy {:.1}% of step time; {:.1}% exposed (ops waiting for them)",
                100.0 * busy,
                100.0 * exposed
            ));
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
pub fn over_max_memory_warning(peak: u64, budget: u64, predicted: u64, by: u64) -> String {
    format!(
        "warning: peak RSS {} exceeds --max-memory {} by {} (predicted {}: plan + process \
         baseline + runtime reserve); memory outside the plan outgrew the reserve: raise \
         --max-memory by that much, and please report it",
        fmt_bytes(peak),
        fmt_bytes(budget),
        fmt_bytes(by),
        fmt_bytes(predicted)
    )
}

/// Runs (or resumes, when `resume` is the checkpoint to continue from) a training run.
pub fn train(
    opts: &TrainOptions,
    resume: Option<&Path>,
    progress: &mut dyn Progress,
) -> Result<TrainSummary> {
    train_among(opts, resume, Arc::new(Single), progress)
}

/// [`train`] as one rank of `comm`'s: every rank runs this with the same options; each
/// draws its own rows of every batch, the ranks keep their state consistent through the
/// plan's collectives (`--zero`), and rank 0 writes the run directory (`plan.json`,
/// `metrics.jsonl`, checkpoints; the others their own `metrics.rank{r}.jsonl`).
pub fn train_among(
    opts: &TrainOptions,
    resume: Option<&Path>,
    comm: Arc<dyn Comm>,
    progress: &mut dyn Progress,
) -> Result<TrainSummary> {
    let mut opts = setup::with_tokenizer_dir(opts, resume)?;
    opts.strategies.ranks = comm.size();
    opts.strategies.rank = comm.rank();
    if opts.fit_search.is_some() && comm.size() > 1 {
        bail!("--fit searches one process's plan; under mpirun give the strategies yourself");
    }
    let (opts, baseline) = setup::with_fit(opts, progress)?;
    let opts = &opts;
    let mut run = Run::start(opts, resume, baseline, comm, progress)?;
    if resume.is_none() && opts.eval_every > 0 && opts.steps > 0 {
        run.evaluate_initial(progress)?;
    }
    while run.step < opts.steps {
        run.next_step(progress)?;
    }
    run.finish(progress)
}

/// A training run in progress: what [`Run::start`] set up and each step carries on.
struct Run<'a> {
    opts: &'a TrainOptions,
    dir: RunDir,
    spec: ModelSpec,
    data: DataSet,
    ex: Executor,
    /// fp16 runs only.
    scaler: Option<LossScaler>,
    loader: BatchLoader,
    /// One optimizer step's tokens, `[grad_accum·batch, seq + 1]` (counted in plan staging).
    batch: Vec<u32>,
    metrics: MetricsLog,
    /// Optimizer steps done, counting those before a resume.
    step: u64,
    /// The step this process started from (0, or the resumed checkpoint's).
    first_step: u64,
    /// Resident memory before the plan was allocated.
    baseline: u64,
    plan_total: u64,
    /// Plan + baseline + runtime reserve: the peak `--max-memory` was checked against.
    predicted_peak: u64,
    /// The over-budget warning was printed.
    warned_over_budget: bool,
    /// Tokens of one optimizer step.
    tokens_per_step: f64,
    /// Time zero of the profile and of every recorded span.
    epoch: Instant,
    n_ops: usize,
    /// The profile of the first `profile_steps` steps (`None` when not profiling).
    profile: Option<Profile>,
    /// The op recorder, lent to the executor during profiled steps.
    recorder: Option<OpRecorder>,
    leak: LeakCheck,
    final_loss: f32,
    final_val: Option<f32>,
    last_ckpt: Option<PathBuf>,
    /// Tokens and seconds of the steps after this process's first (its warm-up), for the
    /// summary's throughput.
    timed_tokens: f64,
    timed_secs: f64,
    /// Of `timed_secs`, the seconds in collectives (exposed communication).
    timed_comm_secs: f64,
    timed_comm_wait_secs: f64,
}

impl Run<'_> {
    /// After the last step: the final reports (when profiled), the leak check's verdict and
    /// the summary.
    fn finish(mut self, progress: &mut dyn Progress) -> Result<TrainSummary> {
        let opts = self.opts;
        progress.finish();
        self.metrics.flush()?;
        let report = match &self.profile {
            Some(p) if !p.steps.is_empty() && self.ex.comm().rank() == 0 => {
                match profiling::write_profile(&self.dir, p) {
                    Ok(html) => Some(html),
                    Err(e) => {
                        progress.message(&format!(
                        "warning: the report could not be written ({e:#}); `memwall report {}` retries",
                        opts.out.display()
                    ));
                        None
                    }
                }
            }
            _ => None,
        };
        let leak = self.leak.report();
        if let Some(l) = &leak {
            progress.message(&l.message());
        }
        Ok(TrainSummary {
            out: opts.out.clone(),
            first_step: self.first_step,
            last_step: self.step,
            final_loss: self.final_loss,
            final_val_loss: self.final_val,
            tokens_per_s: if self.timed_secs > 0.0 {
                self.timed_tokens / self.timed_secs
            } else {
                0.0
            },
            comm_frac: (self.ex.comm().size() > 1 && self.timed_secs > 0.0)
                .then(|| self.timed_comm_secs / self.timed_secs),
            comm_exposed_frac: (self.ex.comm().size() > 1 && self.timed_secs > 0.0)
                .then(|| self.timed_comm_wait_secs / self.timed_secs),
            plan_total_bytes: self.plan_total,
            baseline_bytes: self.baseline,
            peak_rss_bytes: rss::peak_rss(),
            max_memory: opts.strategies.max_memory,
            predicted_peak_bytes: self.predicted_peak,
            last_checkpoint: self.last_ckpt,
            leak,
            report,
        })
    }
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
            plan_total_bytes: 100 << 20,
            baseline_bytes: 7 << 20,
            peak_rss_bytes: Some(peak),
            max_memory: budget,
            predicted_peak_bytes: 112 << 20,
            last_checkpoint: None,
            leak: None,
            report: None,
        }
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
}
