//! [`Run`]: a training run in progress, the state `setup.rs` builds ([`Run::start`]),
//! `step.rs` advances one optimizer step at a time, and [`Run::finish`] (here) turns into the
//! summary.

use super::options::TrainOptions;
use super::profiling;
use super::progress::Progress;
use super::summary::TrainSummary;
use crate::data::loader::{BatchLoader, DataSet};
use crate::exec::LossScaler;
use crate::exec::executor::Executor;
use crate::model::ModelSpec;
use crate::profile::leak::LeakCheck;
use crate::profile::{OpRecorder, Profile};
use crate::run_dir::{MetricsLog, RunDir};
use crate::util::rss;
use anyhow::Result;
use std::path::PathBuf;
use std::time::Instant;

/// A training run in progress: what [`Run::start`] set up and each step carries on.
pub(super) struct Run<'a> {
    pub(super) opts: &'a TrainOptions,
    pub(super) dir: RunDir,
    pub(super) spec: ModelSpec,
    pub(super) data: DataSet,
    pub(super) ex: Executor,
    /// Distillation's teacher (`--distill-from`).
    pub(super) teacher: Option<crate::exec::teacher::Teacher>,
    /// fp16 runs only.
    pub(super) scaler: Option<LossScaler>,
    pub(super) loader: BatchLoader,
    /// One optimizer step's tokens, `[grad_accum·batch, seq + 1]` (counted in plan staging).
    pub(super) batch: Vec<u32>,
    pub(super) metrics: MetricsLog,
    /// Optimizer steps done, counting those before a resume.
    pub(super) step: u64,
    /// The step this process started from (0, or the resumed checkpoint's).
    pub(super) first_step: u64,
    /// Resident memory before the plan was allocated.
    pub(super) baseline: u64,
    pub(super) plan_total: u64,
    /// Plan + baseline + runtime reserve: the peak `--max-memory` was checked against.
    pub(super) predicted_peak: u64,
    /// The over-budget warning was printed.
    pub(super) warned_over_budget: bool,
    /// Tokens of one optimizer step.
    pub(super) tokens_per_step: f64,
    /// Time zero of the profile and of every recorded span.
    pub(super) epoch: Instant,
    pub(super) n_ops: usize,
    /// The profile of the first `profile_steps` steps (`None` when not profiling).
    pub(super) profile: Option<Profile>,
    /// The op recorder, lent to the executor during profiled steps.
    pub(super) recorder: Option<OpRecorder>,
    pub(super) leak: LeakCheck,
    pub(super) final_loss: f32,
    pub(super) final_val: Option<f32>,
    pub(super) last_ckpt: Option<PathBuf>,
    /// Tokens and seconds of the steps after this process's first (its warm-up), for the
    /// summary's throughput.
    pub(super) timed_tokens: f64,
    pub(super) timed_secs: f64,
    /// Of `timed_secs`, the seconds in collectives (exposed communication).
    pub(super) timed_comm_secs: f64,
    pub(super) timed_comm_wait_secs: f64,
}

impl Run<'_> {
    /// After the last step: the final reports (when profiled), the leak check's verdict and
    /// the summary.
    pub(super) fn finish(mut self, progress: &mut dyn Progress) -> Result<TrainSummary> {
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
            pipeline_stages: self.ex.plan.cfg.mesh.size(crate::ir::Axis::Pipeline),
            plan_total_bytes: self.plan_total,
            baseline_bytes: self.baseline,
            peak_rss_bytes: rss::peak_rss(),
            device_in_use_bytes: self.ex.device_memory_in_use(),
            max_memory: opts.strategies.max_memory,
            predicted_peak_bytes: self.predicted_peak,
            last_checkpoint: self.last_ckpt,
            leak,
            report,
        })
    }
}
