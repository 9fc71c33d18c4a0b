//! Crash-safe file writes: a file becomes visible under its final name only once every byte
//! of it is on disk, and a failed write leaves the previous file, if any, as it was.
//!
//! The recipe (POSIX): write into a temporary sibling (same directory, so the same
//! filesystem), `fsync` it, `rename` it over the final name (atomic), then `fsync` the parent
//! directory so the rename itself survives a crash. On any error the temporary is removed.
//!
//! Temporary names carry `tmp-<pid>-<n>` so that concurrent writers never collide and
//! leftovers of a crashed process are recognisable: a write removes the temporaries of the
//! same file that a process no longer running left (killed mid-write, or interrupted), so
//! a Ctrl-C costs no disk beyond the next write ([`sweep_stale`]). Every atomic write of the crate goes
//! through here: token shards and `meta.json` (`data`), checkpoints and model exports
//! (`ckpt`, whose checkpoint *directories* are published the same way from files written by
//! [`write_synced`]), and the files of a run directory (`run_dir`, `profile`).

use anyhow::{Context, Result, bail};
use std::fs::{self, File};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Process-wide counter that makes temporary names unique within one process.
static SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh `tmp-<pid>-<n>` suffix for a temporary sibling.
pub fn tmp_suffix() -> String {
    format!(
        "tmp-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// The directory holding `path` (`.` for a bare file name).
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Writes a file atomically: temporary file in the same directory, write, fsync, rename over
/// `path`, fsync the directory. On error the temporary file is removed and an existing file
/// at `path` is unchanged; the error names `path`.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    write_with(path, |f| Ok(f.write_all(bytes)?))
}

/// Like [`write_file`], but the content is produced by `write` streaming into the temporary
/// file (so large files need no in-memory copy). `write` gets the bare file: wrap it in a
/// `BufWriter` for many small writes (and flush it before returning).
pub fn write_with(path: &Path, write: impl FnOnce(&mut File) -> Result<()>) -> Result<()> {
    let dir = parent_dir(path);
    let Some(name) = path.file_name() else {
        bail!(
            "cannot write {}: the path does not name a file",
            path.display()
        );
    };
    sweep_stale(dir, &name.to_string_lossy());
    let tmp = dir.join(format!(".{}.{}", name.to_string_lossy(), tmp_suffix()));
    let result = (|| -> Result<()> {
        write_synced(&tmp, write)?;
        fs::rename(&tmp, path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        // The disk is to blame only when the system said no; else the content was (a NaN
        // weight, a tensor that cannot be encoded), and the error below says how.
        let io = e.chain().any(|c| c.is::<std::io::Error>());
        let hint = if io {
            "; check the path and free disk space"
        } else {
            ""
        };
        return Err(e.context(format!(
            "writing {} failed (the previous file, if any, is unchanged{hint})",
            path.display()
        )));
    }
    sync_dir(dir)
}

/// Removes the temporaries `.NAME.tmp-<pid>-<n>` in `dir` whose process is no longer
/// running (Linux: no `/proc/<pid>`): what a process killed while writing `NAME` left. A
/// running process's, this one's included, are left alone, and nothing is said of a file
/// that cannot be removed (the write goes on as before). Elsewhere than Linux, nothing is
/// removed.
pub fn sweep_stale(dir: &Path, name: &str) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(rest) = file.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
            continue;
        };
        if writer_is_gone(rest) {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// Whether `suffix`, the `<pid>-<n>` that follows `tmp-` in a temporary's name, names a
/// process other than this one that is no longer running (Linux: no `/proc/<pid>`). False for
/// anything else, and everywhere on systems without `/proc`.
pub fn writer_is_gone(suffix: &str) -> bool {
    let Some((pid, n)) = suffix.split_once('-') else {
        return false;
    };
    let (Ok(pid), Ok(_)) = (pid.parse::<u32>(), n.parse::<u64>()) else {
        return false;
    };
    Path::new("/proc/self").exists()
        && pid != std::process::id()
        && !Path::new(&format!("/proc/{pid}")).exists()
}

/// Creates `path` (which must not exist), lets `write` fill it, and fsyncs it: the first half
/// of [`write_with`], and how the files inside a temporary directory that is published as a
/// whole (a checkpoint) are written.
pub fn write_synced(path: &Path, write: impl FnOnce(&mut File) -> Result<()>) -> Result<()> {
    let mut f =
        File::create_new(path).with_context(|| format!("cannot create {}", path.display()))?;
    write(&mut f).with_context(|| format!("cannot write {}", path.display()))?;
    f.sync_all()
        .with_context(|| format!("cannot fsync {}", path.display()))?;
    Ok(())
}

/// Flushes a directory's entries (new names, renames) to disk. A no-op where directories
/// cannot be opened as files (non-Unix).
pub fn sync_dir(dir: &Path) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn err_text(r: Result<()>) -> String {
        format!("{:#}", r.unwrap_err())
    }

    #[test]
    fn the_disk_is_blamed_only_for_errors_of_the_system() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("m.gguf");
        fs::write(&f, "earlier").unwrap();
        let e = err_text(write_with(&f, |_| bail!("weight 3 is NaN")));
        assert!(e.contains("NaN") && !e.contains("disk"), "{e}");
        let e = err_text(write_with(&f, |_| {
            Err(std::io::Error::from(std::io::ErrorKind::StorageFull).into())
        }));
        assert!(e.contains("free disk space"), "{e}");
        assert_eq!(fs::read_to_string(&f).unwrap(), "earlier");
    }

    #[test]
    fn a_write_removes_the_temporaries_of_dead_writers_only() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("m.gguf");
        // pid_max is at most 2^22 on Linux: no process has this id.
        let dead = dir.path().join(".m.gguf.tmp-999999999-0");
        let mine = dir
            .path()
            .join(format!(".m.gguf.tmp-{}-77", std::process::id()));
        let other_file = dir.path().join(".n.gguf.tmp-999999999-0");
        let not_ours = dir.path().join(".m.gguf.tmp-notes");
        for p in [&dead, &mine, &other_file, &not_ours] {
            fs::write(p, b"partial").unwrap();
        }
        write_file(&f, b"whole").unwrap();
        assert!(!dead.exists(), "a dead writer's temporary was kept");
        for p in [&mine, &other_file, &not_ours] {
            assert!(p.exists(), "{} was removed", p.display());
        }
        assert_eq!(fs::read(&f).unwrap(), b"whole");
    }

    #[test]
    fn write_file_replaces_and_reports() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.json");
        write_file(&f, b"one").unwrap();
        write_file(&f, b"two").unwrap();
        assert_eq!(fs::read(&f).unwrap(), b"two");
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary left"
        );
        let bad = dir.path().join("no/such/dir/a.json");
        let e = err_text(write_file(&bad, b"x"));
        assert!(e.contains(&bad.display().to_string()), "{e}");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("shard.bin");
        write_file(&f, b"old").unwrap();
        let e = err_text(write_with(&f, |w| {
            w.write_all(b"half of the new")?;
            bail!("disk full")
        }));
        assert!(e.contains("disk full") && e.contains("unchanged"), "{e}");
        assert_eq!(fs::read(&f).unwrap(), b"old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        let e = err_text(write_file(Path::new("/"), b"x"));
        assert!(e.contains("does not name a file"), "{e}");
    }
}
