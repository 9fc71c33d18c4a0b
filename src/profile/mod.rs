//! The profiler: where every byte and second of a step went, predicted and measured.
//!
//! - [`record`]: what is recorded while steps run (op spans with the RSS after each op,
//!   transfers: batches, checkpoints, the disk tier's reads and writes), saved as
//!   `RUN_DIR/profile.json`.
//! - [`timeline`]: the plan's memory by category at every op, read back from `plan.json`, so a
//!   report needs no model or executor, only the run directory.
//! - [`trace`]: Chrome trace events (`trace.json`, opens in Perfetto or chrome://tracing).
//! - [`chart`]: SVG charts drawn with `plotters` (memory timeline, loss, throughput).
//! - [`html`]: the self-contained `report.html`.
//! - [`leak`]: the per-step RSS check that warns when a static plan's process grows.
//! - [`report`]: writes all of the above into a run directory (`memwall report RUN_DIR`).
//!
//! Under `mpirun` every rank profiles, and rank 0 gathers the others' collectives into its
//! profile (one communication track per rank, on rank 0's clock).
//!
//! **Invariant:** reports need only the run directory (`plan.json`, `metrics.jsonl`,
//! `profile.json`): `memwall report RUN_DIR` regenerates the same pages without the model, the
//! data or an executor. So this module imports `ir`, `plan`, `run_dir` and `util`, never
//! `exec` or `ckpt`; and recording changes nothing of what runs.

pub mod chart;
pub mod html;
pub mod leak;
pub mod record;
pub mod report;
pub mod timeline;
pub mod trace;

pub use record::{Direction, OpRecorder, OpSpan, Profile, Span, StepProfile, Track};
