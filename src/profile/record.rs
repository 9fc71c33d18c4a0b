//! What the profiler records while steps run: one [`OpSpan`] per executed op (start, end,
//! resident memory right after), one [`Span`] per piece of I/O or communication, grouped by
//! step into a [`Profile`] that is saved as `RUN_DIR/profile.json` and drawn by the reports.
//!
//! Recording costs two clock reads and one `pread` of `/proc/self/statm` per op, into a
//! vector reserved before the step, so a profiled step allocates nothing more than an
//! unprofiled one. The disk tier's transfers are timed on the device's I/O thread, into a log
//! reserved when it starts, and moved after each run into a vector the executor reserved;
//! their spans (with a [`Direction`]) are built after the step.

use crate::util::atomic;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Instant;

/// One executed op of the schedule. Times are microseconds since the profile's epoch.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct OpSpan {
    /// Index of the op in the plan's schedule.
    pub op: u32,
    pub start_us: f64,
    pub end_us: f64,
    /// Resident set size of the process right after the op (bytes; 0 if unreadable).
    pub rss: u64,
}

/// Which timeline track a span belongs to.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Track {
    Compute,
    /// Transfers: batches into their staging buffers, checkpoints to disk, tier moves.
    Io,
    /// Collectives between processes.
    Communication,
}

/// Which way a transfer between a memory tier and host RAM went.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// From the tier (the offload file) into host RAM.
    Read,
    /// From host RAM to the tier.
    Write,
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::Read => "read",
            Direction::Write => "write",
        }
    }
}

/// A span that is not a schedule op: a transfer, a checkpoint write, an evaluation.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Span {
    pub track: Track,
    pub name: String,
    pub start_us: f64,
    pub end_us: f64,
    /// Bytes moved, for transfers.
    pub bytes: Option<u64>,
    /// For a transfer between a memory tier and host RAM (the offload file's reads and
    /// writes during a step): which way it went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direction: Option<Direction>,
    /// For a collective of another rank than the one that wrote the profile (rank 0): that
    /// rank, whose span was sent to rank 0 (times on rank 0's clock, aligned by a barrier
    /// when profiling started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
}

/// Everything recorded for one profiled step.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StepProfile {
    /// 1-based optimizer step.
    pub step: u64,
    pub start_us: f64,
    pub end_us: f64,
    pub ops: Vec<OpSpan>,
    pub spans: Vec<Span>,
}

/// `profile.json`: the profiled steps and the process baseline they are measured against.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Profile {
    /// Resident memory before the arena was allocated (bytes).
    pub baseline_rss: u64,
    pub steps: Vec<StepProfile>,
}

impl Profile {
    /// Writes `profile.json` (atomically).
    pub fn write(&self, path: &Path) -> Result<()> {
        atomic::write_file(path, serde_json::to_string(self)?.as_bytes())
    }

    /// Reads `profile.json`; `None` when the run was not profiled (no such file).
    pub fn read(path: &Path) -> Result<Option<Profile>> {
        match std::fs::read_to_string(path) {
            Ok(t) => Ok(Some(serde_json::from_str(&t).with_context(|| {
                format!("{} is not a memwall profile.json", path.display())
            })?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }

    /// The last profiled step: the warmest one, which the memory chart draws.
    pub fn chart_step(&self) -> Option<&StepProfile> {
        self.steps.iter().rev().find(|s| !s.ops.is_empty())
    }
}

/// Microseconds from `epoch` to `t`.
pub fn micros(epoch: Instant, t: Instant) -> f64 {
    t.saturating_duration_since(epoch).as_secs_f64() * 1e6
}

/// Records op spans inside the executor (see `Executor::record_ops` in `exec`).
pub struct OpRecorder {
    epoch: Instant,
    rss: RssProbe,
    /// Reserved up front; recording stops adding (and counts `dropped`) when full rather than
    /// allocate during a step.
    pub spans: Vec<OpSpan>,
    pub dropped: usize,
}

impl OpRecorder {
    /// A recorder with room for `capacity` ops, timing relative to `epoch`.
    pub fn new(epoch: Instant, capacity: usize) -> OpRecorder {
        OpRecorder {
            epoch,
            rss: RssProbe::open(),
            spans: Vec::with_capacity(capacity),
            dropped: 0,
        }
    }

    /// Records op `op`, which started at `start` and has just finished.
    #[inline]
    pub fn record(&mut self, op: usize, start: Instant) {
        let end = Instant::now();
        if self.spans.len() == self.spans.capacity() {
            self.dropped += 1;
            return;
        }
        let rss = self.rss.read();
        self.spans.push(OpSpan {
            op: op as u32,
            start_us: micros(self.epoch, start),
            end_us: micros(self.epoch, end),
            rss,
        });
    }

    /// Takes the spans recorded so far, leaving room for `capacity` more.
    pub fn take(&mut self, capacity: usize) -> Vec<OpSpan> {
        std::mem::replace(&mut self.spans, Vec::with_capacity(capacity))
    }
}

/// Seconds one recorded op costs (two clock reads, one RSS read, one push), measured here
/// over `n` records: the profiler's overhead per op, independent of machine noise.
pub fn seconds_per_record(n: usize) -> f64 {
    let mut r = OpRecorder::new(Instant::now(), n);
    let t0 = Instant::now();
    for i in 0..n {
        let start = Instant::now();
        r.record(i, start);
    }
    let s = t0.elapsed().as_secs_f64();
    std::hint::black_box(&r.spans);
    s / n.max(1) as f64
}

/// Reads the resident set size cheaply: `/proc/self/statm` kept open and re-read with `pread`
/// into a stack buffer (no allocation). Reads 0 where the file does not exist.
pub struct RssProbe {
    file: Option<std::fs::File>,
    page_bytes: u64,
}

impl RssProbe {
    pub fn open() -> RssProbe {
        let file = std::fs::File::open("/proc/self/statm").ok();
        let mut probe = RssProbe {
            file,
            page_bytes: 4096,
        };
        // statm counts pages; calibrate the page size against VmRSS (bytes) once.
        if let (Some(bytes), pages) = (crate::util::rss::current_rss(), probe.pages())
            && pages > 0
        {
            let ratio = bytes as f64 / pages as f64;
            probe.page_bytes = [4096u64, 16384, 65536]
                .into_iter()
                .min_by(|a, b| {
                    (*a as f64 - ratio)
                        .abs()
                        .total_cmp(&(*b as f64 - ratio).abs())
                })
                .unwrap_or(4096);
        }
        probe
    }

    fn pages(&self) -> u64 {
        use std::os::unix::fs::FileExt;
        let Some(f) = &self.file else { return 0 };
        let mut buf = [0u8; 128];
        let Ok(n) = f.read_at(&mut buf, 0) else {
            return 0;
        };
        // "size resident shared text lib data dt": the second field.
        buf[..n]
            .split(|&c| c == b' ')
            .nth(1)
            .and_then(|s| std::str::from_utf8(s).ok()?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Resident bytes now (0 when unreadable).
    #[inline]
    pub fn read(&self) -> u64 {
        self.pages() * self.page_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorder_never_grows_past_its_reservation() {
        let epoch = Instant::now();
        let mut r = OpRecorder::new(epoch, 3);
        for i in 0..5 {
            r.record(i, Instant::now());
        }
        assert_eq!(r.spans.len(), 3);
        assert_eq!(r.dropped, 2);
        assert!(r.spans.iter().all(|s| s.end_us >= s.start_us));
        let spans = r.take(3);
        assert_eq!(spans.iter().map(|s| s.op).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(r.spans.is_empty() && r.spans.capacity() >= 3);
    }
}
