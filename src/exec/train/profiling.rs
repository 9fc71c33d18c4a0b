//! The profiler's side of a training run: the spans a step records besides its ops (loading,
//! evaluation, checkpoint writes), the other ranks' collectives brought to rank 0, and
//! writing `profile.json` with the reports it feeds.

use crate::dist::Comm;
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
        rank: None,
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

/// Under `mpirun`, brings every rank's collectives into rank 0's profile: each other rank
/// sends rank 0 its communication spans of the profiled steps (JSON, after its length),
/// which rank 0 adds to its steps marked with the rank (`trace.json` gives each rank a
/// track). Every rank calls it at the same point of the run.
pub(super) fn gather_comm_spans(comm: &dyn Comm, profile: &mut Profile) -> Result<()> {
    let (rank, ranks) = (comm.rank(), comm.size());
    if ranks == 1 {
        return Ok(());
    }
    if rank != 0 {
        let mine: Vec<(u64, &Span)> = profile
            .steps
            .iter()
            .flat_map(|s| s.spans.iter().map(move |sp| (s.step, sp)))
            .filter(|(_, sp)| sp.track == Track::Communication)
            .collect();
        let bytes = serde_json::to_vec(&mine)?;
        comm.sendrecv(&(bytes.len() as u64).to_le_bytes(), 0, &mut [], 0)?;
        return comm.sendrecv(&bytes, 0, &mut [], 0);
    }
    for from in 1..ranks {
        let mut len = [0u8; 8];
        comm.sendrecv(&[], from, &mut len, from)?;
        let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
        comm.sendrecv(&[], from, &mut bytes, from)?;
        let theirs: Vec<(u64, Span)> = serde_json::from_slice(&bytes)
            .map_err(|e| anyhow::anyhow!("internal error: rank {from}'s profile spans: {e}"))?;
        for (step, mut sp) in theirs {
            if let Some(s) = profile.steps.iter_mut().find(|s| s.step == step) {
                sp.rank = Some(from as u32);
                s.spans.push(sp);
            }
        }
    }
    Ok(())
}
