//! Crash-safe directories (checkpoints, converted GGUF models): a directory becomes visible
//! under its final name only once every file in it is on disk.
//!
//! The files are written into a temporary sibling directory `<final>.tmp-<pid>-<n>` with
//! [`write_synced`](crate::util::atomic::write_synced); the directory is fsynced, renamed into
//! place and its parent fsynced (the directory form of the recipe in
//! [`crate::util::atomic`], which writes single files). On any error the temporary directory
//! is removed and what was there before is untouched; leftovers of a crashed process are
//! recognisable by their `tmp-` suffix (`latest_checkpoint` skips them).

use crate::util::atomic::{parent_dir, sync_dir, tmp_suffix};
use anyhow::{Context, Result, bail};
use std::fs;
use std::path::{Path, PathBuf};

/// A directory being written under a temporary name next to its final name. Publish it with
/// [`TempDir::publish`]; dropping it unpublished removes it with everything inside.
pub struct TempDir {
    pub path: PathBuf,
    done: bool,
}

impl TempDir {
    /// Creates `<final>.tmp-<pid>-<n>` next to `final_path`.
    pub fn create_for(final_path: &Path) -> Result<TempDir> {
        let Some(name) = final_path.file_name() else {
            bail!(
                "cannot write {}: the path does not name a directory",
                final_path.display()
            );
        };
        let path =
            parent_dir(final_path).join(format!("{}.{}", name.to_string_lossy(), tmp_suffix()));
        if path.exists() {
            // A leftover of a crashed process that had our pid: it is garbage.
            fs::remove_dir_all(&path).with_context(|| {
                format!("cannot remove stale temporary directory {}", path.display())
            })?;
        }
        fs::create_dir(&path)
            .with_context(|| format!("cannot create directory {}", path.display()))?;
        Ok(TempDir { path, done: false })
    }

    /// Fsyncs the directory, renames it to `final_path` (replacing an existing directory of
    /// that name: it is moved aside first and deleted after the rename), and fsyncs the parent.
    pub fn publish(mut self, final_path: &Path) -> Result<()> {
        sync_dir(&self.path)?;
        let parent = parent_dir(final_path);
        let mut old = None;
        if final_path.exists() {
            let name = final_path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let aside = parent.join(format!("{name}.old-{}", tmp_suffix()));
            fs::rename(final_path, &aside).with_context(|| {
                format!(
                    "cannot move the existing {} aside to replace it",
                    final_path.display()
                )
            })?;
            old = Some(aside);
        }
        if let Err(e) = fs::rename(&self.path, final_path) {
            if let Some(aside) = &old {
                let _ = fs::rename(aside, final_path);
            }
            return Err(e).with_context(|| {
                format!(
                    "cannot rename {} to {}",
                    self.path.display(),
                    final_path.display()
                )
            });
        }
        self.done = true;
        sync_dir(parent)?;
        if let Some(aside) = old {
            fs::remove_dir_all(&aside).with_context(|| {
                format!("cannot remove the replaced directory {}", aside.display())
            })?;
        }
        Ok(())
    }
}

impl TempDir {
    /// Removes the unpublished directory now; returns why that failed, if it did.
    pub fn discard(mut self) -> Option<std::io::Error> {
        self.done = true;
        fs::remove_dir_all(&self.path).err()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.done {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}
