//! Directories memwall may replace: only what it wrote itself.
//!
//! A directory memwall creates as a whole (a converted model, a run directory) carries a
//! marker file, [`MARKER`], naming the command that wrote it. Replacing such a directory
//! (`convert --force`, a demo run started again) is allowed only when the marker is there
//! and every entry in the directory is one that command writes; anything else (the input of
//! the command, a user's notes, a directory without the marker) is refused, naming what
//! would have been lost. So no flag ever deletes a file memwall did not write.

use anyhow::{Context, Result, bail};
use std::fs;
use std::path::{Path, PathBuf};

/// The marker file in a directory memwall wrote as a whole.
pub const MARKER: &str = ".memwall";

/// Writes the marker into `dir`, saying `written_by` (e.g. `memwall convert`) wrote it.
pub fn mark(dir: &Path, written_by: &str) -> Result<()> {
    let path = dir.join(MARKER);
    let text = format!(
        "{{\"written_by\": {}, \"version\": {}}}\n",
        serde_json::to_string(written_by)?,
        serde_json::to_string(env!("CARGO_PKG_VERSION"))?
    );
    crate::util::atomic::write_synced(&path, |f| {
        use std::io::Write;
        Ok(f.write_all(text.as_bytes())?)
    })
    .with_context(|| format!("cannot write {}", path.display()))
}

/// Whether `dir` carries the marker.
pub fn is_marked(dir: &Path) -> bool {
    dir.join(MARKER).is_file()
}

/// The command `dir`'s marker says wrote it (`None`: no marker, or not one memwall wrote).
pub fn written_by(dir: &Path) -> Option<String> {
    let text = fs::read_to_string(dir.join(MARKER)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["written_by"].as_str().map(str::to_owned)
}

/// The entries of `dir` that `owns` does not recognise (the marker aside), as paths. A
/// missing directory has none.
pub fn foreign_entries(dir: &Path, owns: &dyn Fn(&str) -> bool) -> Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", dir.display())),
    };
    let mut foreign = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        let name = entry.file_name();
        let ours = name.to_str().is_some_and(|n| n == MARKER || owns(n));
        if !ours {
            foreign.push(entry.path());
        }
    }
    foreign.sort();
    Ok(foreign)
}

/// Checks that `dir` may be replaced: it does not exist, is empty, or carries the marker and
/// holds nothing `owns` does not recognise. `what` names the directory in errors (e.g.
/// `--out run`); `foreign` lists further entries the caller found not to be memwall's (in
/// subdirectories it checked itself).
pub fn check_replaceable(
    dir: &Path,
    what: &str,
    owns: &dyn Fn(&str) -> bool,
    mut foreign: Vec<PathBuf>,
) -> Result<()> {
    let meta = match fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("{what}: cannot stat it")),
    };
    if !meta.is_dir() {
        bail!("{what} exists and is not a directory; choose another path");
    }
    let mut all = fs::read_dir(dir).with_context(|| format!("{what}: cannot list it"))?;
    if all.next().is_none() {
        return Ok(());
    }
    if !is_marked(dir) {
        bail!(
            "{what} holds files memwall did not write (it has no {MARKER} marker); memwall \
             replaces only its own output: move or delete the directory yourself, or choose \
             another"
        );
    }
    foreign.splice(0..0, foreign_entries(dir, owns)?);
    if !foreign.is_empty() {
        let shown: Vec<String> = foreign
            .iter()
            .take(3)
            .map(|p| p.display().to_string())
            .collect();
        let more = match foreign.len() {
            n if n > 3 => format!(" and {} more", n - 3),
            _ => String::new(),
        };
        bail!(
            "{what} holds files memwall did not write ({}{more}); memwall replaces only its own \
             output: move them out, or choose another directory",
            shown.join(", ")
        );
    }
    Ok(())
}

/// Removes `dir` after [`check_replaceable`] allowed it (nothing when it does not exist).
pub fn replace(
    dir: &Path,
    what: &str,
    owns: &dyn Fn(&str) -> bool,
    foreign: Vec<PathBuf>,
) -> Result<()> {
    check_replaceable(dir, what, owns, foreign)?;
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("{what}: cannot remove the previous output")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owns(name: &str) -> bool {
        name == "a.json" || name == "sub"
    }

    #[test]
    fn only_a_marked_directory_of_known_entries_is_replaced() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("out");
        // Missing and empty directories are free.
        replace(&d, "--out out", &owns, vec![]).unwrap();
        fs::create_dir(&d).unwrap();
        check_replaceable(&d, "--out out", &owns, vec![]).unwrap();

        // Unmarked: refused, and nothing is removed.
        fs::write(d.join("a.json"), b"{}").unwrap();
        let e = format!("{:#}", replace(&d, "--out out", &owns, vec![]).unwrap_err());
        assert!(e.contains("--out out") && e.contains(MARKER), "{e}");
        assert!(d.join("a.json").is_file());

        // Marked with a foreign file: refused, naming it.
        mark(&d, "memwall test").unwrap();
        fs::write(d.join("notes.txt"), b"mine").unwrap();
        let e = format!("{:#}", replace(&d, "--out out", &owns, vec![]).unwrap_err());
        assert!(e.contains("notes.txt"), "{e}");
        assert!(d.join("notes.txt").is_file());

        // Foreign entries found by the caller count too.
        fs::remove_file(d.join("notes.txt")).unwrap();
        let e = format!(
            "{:#}",
            replace(&d, "--out out", &owns, vec![d.join("sub/x")]).unwrap_err()
        );
        assert!(e.contains("sub/x"), "{e}");

        // Marked and all known: replaced.
        fs::create_dir(d.join("sub")).unwrap();
        replace(&d, "--out out", &owns, vec![]).unwrap();
        assert!(!d.exists());
    }

    #[test]
    fn a_file_is_not_a_directory_to_replace() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("f");
        fs::write(&f, b"x").unwrap();
        let e = format!("{:#}", replace(&f, "--out f", &owns, vec![]).unwrap_err());
        assert!(e.contains("not a directory"), "{e}");
        assert!(f.is_file());
    }
}
