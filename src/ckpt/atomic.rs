//! Crash-safe writes: a file or a whole checkpoint directory becomes visible under its final
//! name only once every byte of it is on disk.
//!
//! The recipe (POSIX): write into a temporary sibling (same directory, so the same
//! filesystem), `fsync` it, `rename` it over the final name (atomic), then `fsync` the parent
//! directory so the rename itself survives a crash. On any error the temporary is removed
//! and the previous file or directory, if any, is untouched.
//!
//! Temporary names carry `tmp-<pid>-<n>` so that concurrent writers never collide and
//! leftovers of a crashed process are recognisable (`latest_checkpoint` skips them).

use anyhow::{Context, Result, bail};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Process-wide counter that makes temporary names unique within one process.
static SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh `tmp-<pid>-<n>` suffix for a temporary sibling.
pub(crate) fn tmp_suffix() -> String {
    format!(
        "tmp-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// The directory holding `path` (`.` for a bare file name).
pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Writes a file atomically: temporary file in the same directory, write, fsync, rename over
/// `path`, fsync the directory. On error the temporary file is removed and an existing file
/// at `path` is unchanged; the error names `path`.
pub fn write_file_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| Ok(f.write_all(bytes)?))
}

/// Like [`write_file_atomic`], but the content is produced by `write` streaming into the
/// temporary file (so large files need no in-memory copy).
pub(crate) fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut File) -> Result<()>,
) -> Result<()> {
    let dir = parent_dir(path);
    let Some(name) = path.file_name() else {
        bail!(
            "cannot write {}: the path does not name a file",
            path.display()
        );
    };
    let tmp = dir.join(format!(".{}.{}", name.to_string_lossy(), tmp_suffix()));
    let result = (|| -> Result<()> {
        write_synced(&tmp, write)?;
        fs::rename(&tmp, path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e.context(format!(
            "writing {} failed (the previous file, if any, is unchanged; check the path and free disk space)",
            path.display()
        )));
    }
    sync_dir(dir)
}

/// Creates `path` (which must not exist), lets `write` fill it, and fsyncs it. Used for files
/// inside a temporary directory that is published as a whole.
pub(crate) fn write_synced(path: &Path, write: impl FnOnce(&mut File) -> Result<()>) -> Result<()> {
    let mut f =
        File::create_new(path).with_context(|| format!("cannot create {}", path.display()))?;
    write(&mut f).with_context(|| format!("cannot write {}", path.display()))?;
    f.sync_all()
        .with_context(|| format!("cannot fsync {}", path.display()))?;
    Ok(())
}

/// Flushes a directory's entries (new names, renames) to disk. A no-op where directories
/// cannot be opened as files (non-Unix).
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("cannot fsync directory {}", dir.display()))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// A directory being written under a temporary name next to its final name. Publish it with
/// [`TempDir::publish`]; dropping it unpublished removes it with everything inside.
pub(crate) struct TempDir {
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
