//! What a run keeps of its checkpoints: the newest `--keep-last N` (older ones are removed
//! once a newer one is safely written), and no debris: a `step-N.tmp-PID-K` directory left
//! by a process killed while saving is removed when that process is gone.
//!
//! Only directories named as checkpoints (`step-NNNNNN`, and their temporary names) under
//! `checkpoints/` are ever touched, and of the `step-NNNNNN` ones only complete checkpoints.

use super::load::checkpoint_dirs;
use crate::run_dir::{RunDir, checkpoint_step};
use anyhow::{Context, Result};
use std::fs;
use std::path::{Path, PathBuf};

/// Removes all but the newest `keep` complete checkpoints of `run_dir` (`keep` 0 keeps all);
/// the newest is never removed. A `step-N` directory that is not a complete checkpoint is
/// never removed: memwall's saves are atomic, so such a directory is not one it wrote whole
/// (a user's copy, or one whose files were removed by hand), and its files may be all that is
/// left of something. Returns the removed directories.
pub fn keep_last(run_dir: &Path, keep: u64) -> Result<Vec<PathBuf>> {
    if keep == 0 {
        return Ok(Vec::new());
    }
    let complete: Vec<PathBuf> = checkpoint_dirs(run_dir)?
        .into_iter()
        .filter(|c| c.is_complete())
        .map(|c| c.path)
        .collect();
    let old = complete.len().saturating_sub(keep.max(1) as usize);
    let mut removed = Vec::new();
    for dir in complete.into_iter().take(old) {
        fs::remove_dir_all(&dir).with_context(|| {
            format!(
                "--keep-last: cannot remove the old checkpoint {}",
                dir.display()
            )
        })?;
        removed.push(dir);
    }
    Ok(removed)
}

/// Removes the temporary checkpoint directories (`step-N.tmp-PID-K`, `step-N.old-tmp-PID-K`)
/// whose process is no longer running: a save interrupted by `kill -9`. Returns them.
pub fn remove_stale_temporaries(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let root = RunDir::new(run_dir).checkpoints();
    let Ok(entries) = fs::read_dir(&root) else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some((base, tail)) = name
            .split_once(".tmp-")
            .or_else(|| name.split_once(".old-tmp-"))
        else {
            continue;
        };
        let pid = tail.split('-').next().and_then(|p| p.parse::<i32>().ok());
        let (Some(pid), Some(_)) = (pid, checkpoint_step(base)) else {
            continue;
        };
        if pid != std::process::id() as i32 && !process_alive(pid) {
            let path = entry.path();
            fs::remove_dir_all(&path).with_context(|| {
                format!(
                    "cannot remove {}, left by an interrupted save",
                    path.display()
                )
            })?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// Whether process `pid` exists (signal 0 probes without sending anything).
fn process_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only checks the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_dir::checkpoint_name;

    /// A directory `latest_checkpoint` takes as complete: every file a checkpoint needs, not
    /// empty (their contents are not read here).
    fn fake_complete(dir: &Path) {
        fs::create_dir_all(dir).unwrap();
        for f in crate::ckpt::CHECKPOINT_FILES
            .iter()
            .chain([&crate::ckpt::MODEL_FILE])
        {
            fs::write(dir.join(f), "x").unwrap();
        }
    }

    fn steps_left(run: &Path) -> Vec<u64> {
        checkpoint_dirs(run)
            .unwrap()
            .iter()
            .map(|c| c.step)
            .collect()
    }

    #[test]
    fn keeps_the_newest_checkpoints_and_nothing_else_is_touched() {
        let t = tempfile::tempdir().unwrap();
        let root = RunDir::new(t.path()).checkpoints();
        for step in [5, 10, 15, 20] {
            fake_complete(&root.join(checkpoint_name(step)));
        }
        fs::write(root.join("notes.txt"), "mine").unwrap();
        assert!(keep_last(t.path(), 0).unwrap().is_empty());
        let removed = keep_last(t.path(), 2).unwrap();
        assert_eq!(removed.len(), 2);
        assert_eq!(steps_left(t.path()), [15, 20]);
        assert!(root.join("notes.txt").is_file());
    }

    #[test]
    fn a_step_directory_that_is_no_complete_checkpoint_is_never_removed() {
        // A user's directory under a checkpoint's name (one file of a checkpoint in it), older
        // than the run's own checkpoints: --keep-last 1 removes only the run's older one.
        let t = tempfile::tempdir().unwrap();
        let root = RunDir::new(t.path()).checkpoints();
        let mine = root.join(checkpoint_name(1));
        fs::create_dir_all(&mine).unwrap();
        fs::write(mine.join(crate::ckpt::MODEL_FILE), "precious").unwrap();
        for step in [2, 4] {
            fake_complete(&root.join(checkpoint_name(step)));
        }
        let removed = keep_last(t.path(), 1).unwrap();
        assert_eq!(removed, [root.join(checkpoint_name(2))]);
        assert_eq!(steps_left(t.path()), [1, 4]);
        assert_eq!(
            fs::read_to_string(mine.join(crate::ckpt::MODEL_FILE)).unwrap(),
            "precious"
        );
    }

    #[test]
    fn debris_of_a_dead_process_goes_and_a_live_ones_stays() {
        let t = tempfile::tempdir().unwrap();
        let root = RunDir::new(t.path()).checkpoints();
        // A process that has ended: a child we waited for.
        let dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        let mut dead = dead;
        dead.wait().unwrap();
        let stale = root.join(format!("step-000010.tmp-{dead_pid}-0"));
        let live = root.join(format!("step-000010.tmp-{}-0", std::process::id()));
        let other = root.join(format!("other.tmp-{dead_pid}-0"));
        for d in [&stale, &live, &other] {
            fs::create_dir_all(d).unwrap();
        }
        assert_eq!(
            remove_stale_temporaries(t.path()).unwrap(),
            std::slice::from_ref(&stale)
        );
        assert!(!stale.exists() && live.exists() && other.exists());
    }
}
