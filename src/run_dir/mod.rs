//! The run directory: what a training run (`memwall train --out DIR`) or a profiled benchmark
//! (`memwall bench --profile DIR`) leaves on disk, under which names, in which formats.
//!
//! | path                        | written by                    | content                                        |
//! |-----------------------------|-------------------------------|------------------------------------------------|
//! | `plan.json`                 | `train`, `bench --profile`    | [`PlanJson`]: every byte of a step, planned     |
//! | `metrics.jsonl`             | `train`, `bench --profile`    | one [`Metric`] per optimizer step (and step 0) |
//! | `profile.json`              | profiled runs                 | `profile::Profile`: op spans and RSS            |
//! | `trace.json`                | reports (`profile::report`)   | Chrome trace events                            |
//! | `memory.svg`                | reports                       | the plan's memory timeline                     |
//! | `report.html`               | reports                       | the self-contained report page                 |
//! | `checkpoints/step-NNNNNN/`  | `train`                       | a checkpoint (`ckpt`); its `trainer_state.json` holds the run's options, which `--resume` reads back |
//!
//! [`RunDir`] names these paths; the submodules own the formats this module defines:
//! [`plan_json`] (written by the trainer, the benchmark and `memwall plan --json`, read back by
//! the reports) and [`metrics`]. Every file is written atomically (`util::atomic`), except
//! `metrics.jsonl` while training, which grows a line per step (and is cut back atomically to
//! the resumed checkpoint's step).
//!
//! **Invariant:** one type per file format, used both to write it and to read it back; fields
//! added later have defaults, so older run directories still get a report.

pub mod metrics;
pub mod plan_json;

pub use metrics::{Metric, MetricsLog, Update};
pub use plan_json::{BufferInfo, OpInfo, PlanJson};

use std::path::{Path, PathBuf};

/// The plan of one step ([`PlanJson`]).
pub const PLAN_FILE: &str = "plan.json";
/// One [`Metric`] per line.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// What the profiler recorded (`profile::Profile`).
pub const PROFILE_FILE: &str = "profile.json";
/// Chrome trace events of the profiled steps.
pub const TRACE_FILE: &str = "trace.json";
/// The plan's memory timeline chart.
pub const MEMORY_SVG_FILE: &str = "memory.svg";
/// The report page.
pub const REPORT_HTML_FILE: &str = "report.html";
/// Subdirectory holding the run's checkpoints, one `step-NNNNNN` directory each.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// Written and removed again to check that the directory is writable before a run starts.
pub const WRITE_PROBE_FILE: &str = ".memwall-write-test";
/// The default `--offload-dir` of a run: `offload/` in the run directory.
pub const OFFLOAD_DIR: &str = "offload";

/// Whether `name` is an entry a run writes at the top of its directory (what replacing a
/// run, as the demos do, may remove): the files above, `metrics.rank{r}.jsonl`, and the
/// temporary names of files being written atomically (`.NAME.tmp-*`).
pub fn is_run_entry(name: &str) -> bool {
    const FILES: [&str; 10] = [
        PLAN_FILE,
        METRICS_FILE,
        PROFILE_FILE,
        TRACE_FILE,
        MEMORY_SVG_FILE,
        REPORT_HTML_FILE,
        CHECKPOINTS_DIR,
        WRITE_PROBE_FILE,
        OFFLOAD_DIR,
        crate::util::owned_dir::MARKER,
    ];
    let rank_metrics = name
        .strip_prefix("metrics.rank")
        .and_then(|r| r.strip_suffix(".jsonl"))
        .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()));
    let atomic_tmp = name.starts_with('.') && name.contains(".tmp-");
    FILES.contains(&name) || rank_metrics || atomic_tmp
}

/// The name of the checkpoint directory of step `step`: `step-NNNNNN` (at least six digits).
pub fn checkpoint_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// The step of a checkpoint directory name `step-NNNNNN` (digits only), or `None` for
/// anything else (temporary `*.tmp-*` directories included).
pub fn checkpoint_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A run directory: where each of its files lives (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunDir {
    root: PathBuf,
}

impl RunDir {
    pub fn new(root: &Path) -> RunDir {
        RunDir {
            root: root.to_path_buf(),
        }
    }

    /// The directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `plan.json`.
    pub fn plan(&self) -> PathBuf {
        self.root.join(PLAN_FILE)
    }

    /// `metrics.jsonl`.
    pub fn metrics(&self) -> PathBuf {
        self.root.join(METRICS_FILE)
    }

    /// The metrics of rank `rank` of a multi-process run: `metrics.jsonl` for rank 0 (the
    /// run's), `metrics.rank{r}.jsonl` for the others (their own step times and memory).
    pub fn metrics_of(&self, rank: usize) -> PathBuf {
        match rank {
            0 => self.metrics(),
            r => self.root.join(format!("metrics.rank{r}.jsonl")),
        }
    }

    /// `profile.json`.
    pub fn profile(&self) -> PathBuf {
        self.root.join(PROFILE_FILE)
    }

    /// `trace.json`.
    pub fn trace(&self) -> PathBuf {
        self.root.join(TRACE_FILE)
    }

    /// `memory.svg`.
    pub fn memory_svg(&self) -> PathBuf {
        self.root.join(MEMORY_SVG_FILE)
    }

    /// `report.html`.
    pub fn report_html(&self) -> PathBuf {
        self.root.join(REPORT_HTML_FILE)
    }

    /// The probe file that checks the directory is writable.
    pub fn write_probe(&self) -> PathBuf {
        self.root.join(WRITE_PROBE_FILE)
    }

    /// `checkpoints/`.
    pub fn checkpoints(&self) -> PathBuf {
        self.root.join(CHECKPOINTS_DIR)
    }

    /// Removes the run directory so that a new run may start there (as the demos do), when
    /// memwall wrote everything in it: its marker, only the entries of a run
    /// ([`is_run_entry`]), and in `checkpoints/` only checkpoints (finished or interrupted).
    /// Anything else is refused, naming it; nothing is removed then. A run with checkpoints
    /// is said to `say` before it goes.
    pub fn replace_previous(&self, what: &str, say: &mut dyn FnMut(&str)) -> anyhow::Result<()> {
        let foreign = self.foreign_in_subdirs()?;
        crate::util::owned_dir::check_replaceable(&self.root, what, &is_run_entry, foreign)?;
        // Said aloud: a run continued with --resume since would go too.
        let steps = std::fs::read_dir(self.checkpoints()).map_or(0, |d| {
            d.flatten()
                .filter(|e| checkpoint_step(&e.file_name().to_string_lossy()).is_some())
                .count()
        });
        if steps > 0 {
            say(&format!(
                "memwall: replacing {what} ({} in it)",
                crate::util::count(steps as u64, "checkpoint")
            ));
        }
        crate::util::owned_dir::replace(&self.root, what, &is_run_entry, Vec::new())
    }

    /// What [`RunDir::replace_previous`] would refuse, checked without removing anything: a
    /// command that writes other files first (a demo's data) checks here before it starts.
    pub fn check_previous(&self, what: &str) -> anyhow::Result<()> {
        let foreign = self.foreign_in_subdirs()?;
        crate::util::owned_dir::check_replaceable(&self.root, what, &is_run_entry, foreign)
    }

    /// Entries of `checkpoints/` and `offload/` that a run does not write.
    fn foreign_in_subdirs(&self) -> anyhow::Result<Vec<PathBuf>> {
        let checkpoint = |n: &str| {
            checkpoint_step(n.split(".tmp-").next().unwrap_or(n)).is_some()
                || n.starts_with("step-") && n.contains(".old-tmp-")
        };
        let mut foreign =
            crate::util::owned_dir::foreign_entries(&self.checkpoints(), &checkpoint)?;
        let offload = self.root.join(OFFLOAD_DIR);
        let offload_file = |n: &str| n.starts_with("memwall-");
        foreign.extend(crate::util::owned_dir::foreign_entries(
            &offload,
            &offload_file,
        )?);
        Ok(foreign)
    }

    /// `checkpoints/step-NNNNNN/`: where the checkpoint of step `step` goes.
    pub fn checkpoint(&self, step: u64) -> PathBuf {
        self.checkpoints().join(checkpoint_name(step))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_names_round_trip_and_others_are_not_checkpoints() {
        let run = RunDir::new(Path::new("run"));
        assert_eq!(
            run.checkpoint(100),
            Path::new("run/checkpoints/step-000100")
        );
        assert_eq!(checkpoint_name(1_000_000), "step-1000000");
        for step in [0, 7, 100, 999_999, 1_000_000] {
            assert_eq!(checkpoint_step(&checkpoint_name(step)), Some(step));
        }
        for name in [
            "step-",
            "step-12a",
            "step-000100.tmp-1-0",
            "steps-1",
            "model",
        ] {
            assert_eq!(checkpoint_step(name), None, "{name}");
        }
    }
}
