//! `metrics.jsonl`: one JSON object per optimizer step ([`Metric`]). Training appends a line per
//! step ([`MetricsLog`]) and, on `--resume`, first cuts the file back to the checkpoint's step
//! ([`truncate`]); a profiled benchmark writes it whole ([`write()`]); the reports read it back
//! ([`read`]).

use crate::util::atomic;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One line of `metrics.jsonl`: an optimizer step's figures, with the validation loss when it
/// was measured after the step; or, at step 0, only the validation loss measured before the
/// first update (runs with `--eval-every`), so a fine-tune shows where it started.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Metric {
    pub step: u64,
    /// The update's figures (absent in the step-0 record).
    #[serde(flatten)]
    pub update: Option<Update>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
}

/// What an optimizer step measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Update {
    pub loss: f32,
    pub lr: f32,
    pub grad_norm: f32,
    /// fp16 runs: the loss scale used by this step, and whether its update was skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    pub tokens_per_s: f64,
    /// Chat data: the step's trained targets, every micro-batch's and rank's (what the loss is
    /// the mean over; rows count padding and prompts too, `tokens_per_s` all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trained_tokens: Option<u64>,
    pub step_s: f64,
    pub rss_bytes: Option<u64>,
    /// The process's peak resident memory so far (`VmHWM`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// By how much that peak exceeds `--max-memory` (absent while within it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over_max_memory_bytes: Option<u64>,
    /// Steps done by the process that wrote this line (1-based; restarts on `--resume`): the
    /// leak check's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_step: Option<u64>,
    /// Multi-process runs: seconds this rank's communication thread spent in collectives
    /// during the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_s: Option<f64>,
    /// Multi-process runs: seconds the step's ops waited for collectives (communication not
    /// overlapped with compute: exposed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_wait_s: Option<f64>,
    /// Multi-process runs: bytes this rank sent during the step, as its transport counted
    /// them (the plan's `comm_bytes_per_step`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_bytes: Option<u64>,
}

impl Metric {
    /// The step-0 record: the validation loss before the first update.
    pub fn initial(val_loss: f32) -> Metric {
        Metric {
            step: 0,
            update: None,
            val_loss: Some(val_loss),
        }
    }
}

/// `metrics.jsonl` open for appending, a line per step.
pub struct MetricsLog {
    file: File,
    path: PathBuf,
}

impl MetricsLog {
    /// Opens `path` for appending, creating it if absent.
    pub fn append_to(path: &Path) -> Result<MetricsLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(MetricsLog {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Appends `m` as one line.
    pub fn push(&mut self, m: &Metric) -> Result<()> {
        let line = serde_json::to_string(m)?;
        writeln!(self.file, "{line}")
            .with_context(|| format!("cannot append to {}", self.path.display()))
    }

    pub fn flush(&mut self) -> Result<()> {
        Ok(self.file.flush()?)
    }
}

/// Writes `metrics` as the whole of `path`, atomically.
pub fn write(path: &Path, metrics: &[Metric]) -> Result<()> {
    let mut lines = String::new();
    for m in metrics {
        lines.push_str(&serde_json::to_string(m)?);
        lines.push('\n');
    }
    atomic::write_file(path, lines.as_bytes())
}

/// Reads `metrics.jsonl` (empty when the file does not exist); the error names the file and
/// line.
pub fn read(path: &Path) -> Result<Vec<Metric>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            parse(l)
                .with_context(|| format!("{} line {}: not a metrics record", path.display(), i + 1))
        })
        .collect()
}

/// One line: a step with its update's figures, or the step-0 validation loss.
fn parse(line: &str) -> Result<Metric> {
    let m: Metric = serde_json::from_str(line)?;
    match (&m.update, m.val_loss, m.step) {
        (Some(_), _, _) | (None, Some(_), 0) => Ok(m),
        _ => anyhow::bail!("step {} has neither loss nor (at step 0) val_loss", m.step),
    }
}

/// Keeps only the lines of steps up to `step` (the checkpoint being resumed), atomically;
/// lines that are not metrics records go too. Nothing to do when the file does not exist.
pub fn truncate(path: &Path, step: u64) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|l| parse(l).map(|m| m.step <= step).unwrap_or(false))
        .map(|l| format!("{l}\n"))
        .collect();
    atomic::write_file(path, kept.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metric(step: u64) -> Metric {
        Metric {
            step,
            update: Some(Update {
                loss: 10.5,
                lr: 6e-4,
                grad_norm: 1.25,
                loss_scale: None,
                skipped: false,
                tokens_per_s: 1000.0,
                trained_tokens: None,
                step_s: 0.5,
                rss_bytes: Some(1 << 20),
                peak_rss_bytes: None,
                over_max_memory_bytes: None,
                process_step: Some(step),
                comm_s: None,
                comm_wait_s: None,
                comm_bytes: None,
            }),
            val_loss: (step == 2).then_some(10.75),
        }
    }

    #[test]
    fn appended_written_truncated_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(super::super::METRICS_FILE);
        let mut log = MetricsLog::append_to(&path).unwrap();
        log.push(&Metric::initial(11.0)).unwrap();
        for s in 1..=3 {
            log.push(&metric(s)).unwrap();
        }
        log.flush().unwrap();
        let appended = std::fs::read_to_string(&path).unwrap();
        // The optional fields are left out when empty; one object per line.
        assert_eq!(appended.lines().count(), 4);
        assert_eq!(
            appended.lines().next().unwrap(),
            r#"{"step":0,"val_loss":11.0}"#
        );
        assert!(!appended.lines().nth(1).unwrap().contains("val_loss"));
        assert!(!appended.contains("skipped") && !appended.contains("loss_scale"));
        let copy = dir.path().join("copy.jsonl");
        write(&copy, &read(&path).unwrap()).unwrap();
        assert_eq!(std::fs::read_to_string(&copy).unwrap(), appended);

        truncate(&path, 2).unwrap();
        let kept = read(&path).unwrap();
        assert_eq!(kept.iter().map(|m| m.step).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(kept[0].update.is_none() && kept[0].val_loss == Some(11.0));
        assert_eq!(kept[2].val_loss, Some(10.75));
        assert!(read(&dir.path().join("absent.jsonl")).unwrap().is_empty());

        for bad in ["{\"step\": 1}", "{\"step\": 1, \"val_loss\": 2.0}"] {
            std::fs::write(&path, format!("{bad}\n")).unwrap();
            let e = format!("{:#}", read(&path).unwrap_err());
            assert!(e.contains("line 1: not a metrics record"), "{e}");
        }
    }
}
