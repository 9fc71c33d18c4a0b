//! The profiler's side of a training run: the spans a step records besides its ops (loading,
//! evaluation, checkpoint writes), and writing `profile.json` with the reports it feeds.

use crate::profile::record::micros;
use crate::profile::{Profile, Span, Track};
use crate::run_dir::RunDir;
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A span of `track` from `start` to `end`, in microseconds since `epoch`.
pub(super) fn span(
    epoch: Instant,
    track: Track,
    name: String,
    (start, end): (Instant, Instant),
    bytes: Option<u64>,
) -> Span {
    Span {
        track,
        name,
        start_us: micros(epoch, start),
        end_us: micros(epoch, end),
        bytes,
        direction: None,
    }
}

/// Saves `profile.json` and regenerates the reports from the run directory; returns the
/// path of `report.html`.
pub(super) fn write_profile(run: &RunDir, profile: &Profile) -> Result<PathBuf> {
    profile.write(&run.profile())?;
    Ok(crate::profile::report::write_reports(run.root())?.html)
}

/// Bytes of the files directly in `dir` (a checkpoint's size, for the I/O track).
pub(super) fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}
