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
//! - `run.rs`: the state a run carries (`Run`), and `Run::finish`: the final
//!   reports and the summary ([`TrainSummary`], `summary.rs`).
//!
//! Around them: [`TrainOptions`] (`options.rs`), fp16's [`LossScaler`](crate::exec::LossScaler), the
//! [`Progress`] reporters (`progress.rs`), and the profiler's files (`profiling.rs`).

mod options;
mod profiling;
mod progress;
mod run;
mod setup;
mod step;
mod summary;

pub use options::{TrainOptions, default_threads, resume_options};
pub use progress::{ConsoleProgress, NoProgress, Progress};
pub use setup::{check_new_run_dir, plan_for, planning_baseline, with_data_open};
pub use summary::{TrainSummary, over_max_memory, over_max_memory_warning};

use crate::dist::{Comm, Single};
use anyhow::Result;
use run::Run;
use std::path::Path;
use std::sync::Arc;

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
    let opts = &opts;
    let mut run = Run::start(opts, resume, opts.planned_baseline, comm, progress)?;
    if resume.is_none() && opts.eval_every > 0 && opts.steps > 0 {
        run.evaluate_initial(progress)?;
    }
    while run.step < opts.steps {
        run.next_step(progress)?;
    }
    let summary = run.finish(progress)?;
    // The run's own offload directory, once its file is gone (a killed run's scratch was
    // replaced by this one's, removed with its tier): only an empty directory goes.
    let _ = std::fs::remove_dir(opts.out.join(crate::run_dir::OFFLOAD_DIR));
    Ok(summary)
}
