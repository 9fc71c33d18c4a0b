//! Content fingerprints of the models a run is based on, so that a run, an export or a merge
//! notices when the file or directory it names now holds another model.
//!
//! A file's fingerprint is the SHA-256 of its bytes. Hashing a 16 GB model takes seconds, so
//! each file's hash is remembered in the user cache (`hashes.json`) by its canonical path,
//! size, modification time, status-change time and inode: a file written again, or replaced
//! by another (a copy that kept the old modification time included: its inode and change time
//! differ), is hashed again. Without a user cache every file is hashed each time.
//!
//! A directory's fingerprint is the SHA-256 of the names and hashes of the files that define
//! the model in it (`config.json`, `*.safetensors`, `model.safetensors.index.json`), in name
//! order: tokenizer files and notes beside them may change without changing the weights.

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::Path;

/// The memo of file hashes in the user cache.
const MEMO_FILE: &str = "hashes.json";

/// What the memo remembers of a path: the stat fields a replacement changes, and the hash.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Entry {
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    inode: u64,
    sha256: String,
}

/// The SHA-256 of `path`'s content, in hex (remembered in the user cache, see the module doc).
pub fn file_sha256(path: &Path) -> Result<String> {
    let memo = crate::util::cache::memwall_cache().map(|c| c.join(MEMO_FILE));
    file_sha256_memo(path, memo.as_deref())
}

/// [`file_sha256`] with the memo file given (`None`: none).
pub fn file_sha256_memo(path: &Path, memo: Option<&Path>) -> Result<String> {
    use std::os::unix::fs::MetadataExt;
    let canonical =
        fs::canonicalize(path).with_context(|| format!("cannot resolve {}", path.display()))?;
    let meta =
        fs::metadata(&canonical).with_context(|| format!("cannot stat {}", path.display()))?;
    let ns = |s: i64, n: i64| s as i128 * 1_000_000_000 + n as i128;
    let stat = |sha256: String| Entry {
        size: meta.len(),
        mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
        ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
        inode: meta.ino(),
        sha256,
    };
    let key = canonical.to_string_lossy().into_owned();
    let mut entries: BTreeMap<String, Entry> = memo
        .and_then(|m| fs::read(m).ok())
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    if let Some(e) = entries.get(&key)
        && *e == stat(e.sha256.clone())
    {
        return Ok(e.sha256.clone());
    }
    let sha = sha256_of(&canonical)?;
    if let Some(m) = memo {
        // Paths that no longer exist are forgotten, so the memo does not grow for ever.
        entries.retain(|p, _| Path::new(p).exists());
        entries.insert(key, stat(sha.clone()));
        // The memo only saves time: failing to write it is not an error.
        if let Some(dir) = m.parent() {
            let _ = fs::create_dir_all(dir);
        }
        if let Ok(bytes) = serde_json::to_vec_pretty(&entries) {
            let _ = crate::util::atomic::write_file(m, &bytes);
        }
    }
    Ok(sha)
}

/// The SHA-256 of a file's content, read in 64 KiB pieces into a buffer on the stack (no
/// heap left grown behind a run's measured baseline), in hex.
pub fn sha256_of(path: &Path) -> Result<String> {
    let mut f = fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = [0u8; 1 << 16];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether a directory entry named `name` defines the model (its fingerprint covers it).
fn defines_model(name: &str) -> bool {
    name == "config.json"
        || name.ends_with(".safetensors")
        || name.ends_with(".safetensors.index.json")
}

/// The fingerprint of a model: a file's SHA-256, or a directory's over its defining files
/// (see the module doc). Errors name the path.
pub fn of_model(path: &Path) -> Result<String> {
    if !path.is_dir() {
        return file_sha256(path);
    }
    let mut names: Vec<String> = fs::read_dir(path)
        .with_context(|| format!("cannot list {}", path.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| defines_model(n))
        .collect();
    if names.is_empty() {
        bail!(
            "{}: no config.json or safetensors weights to fingerprint",
            path.display()
        );
    }
    names.sort();
    let mut h = Sha256::new();
    for n in &names {
        h.update(n.as_bytes());
        h.update([0]);
        h.update(file_sha256(&path.join(n))?.as_bytes());
        h.update([b'\n']);
    }
    Ok(hex(&h.finalize()))
}

/// The first 16 hex digits of a fingerprint, for messages.
pub fn short(fingerprint: &str) -> &str {
    &fingerprint[..fingerprint.len().min(16)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_file_is_hashed_again_even_with_its_old_times() {
        let dir = tempfile::tempdir().unwrap();
        let memo = dir.path().join("memo.json");
        let f = dir.path().join("model.gguf");
        fs::write(&f, b"first model").unwrap();
        let a = file_sha256_memo(&f, Some(&memo)).unwrap();
        assert_eq!(a, sha256_of(&f).unwrap());
        assert!(memo.is_file());
        assert_eq!(file_sha256_memo(&f, Some(&memo)).unwrap(), a);
        // Another file of the same size moved over it, its modification time set to the
        // old one's (as `cp -p` or `rsync -a` keep it).
        let old = fs::metadata(&f).unwrap().modified().unwrap();
        let other = dir.path().join("other");
        fs::write(&other, b"other model").unwrap();
        fs::File::options()
            .write(true)
            .open(&other)
            .unwrap()
            .set_modified(old)
            .unwrap();
        fs::rename(&other, &f).unwrap();
        let b = file_sha256_memo(&f, Some(&memo)).unwrap();
        assert_ne!(a, b);
        assert_eq!(b, sha256_of(&f).unwrap());
    }

    #[test]
    fn a_directory_fingerprint_covers_its_weights_and_config_only() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path();
        fs::write(m.join("config.json"), b"{}").unwrap();
        fs::write(m.join("model.safetensors"), b"weights").unwrap();
        let a = of_model(m).unwrap();
        fs::write(m.join("tokenizer.json"), b"{}").unwrap();
        fs::write(m.join("notes.txt"), b"mine").unwrap();
        assert_eq!(
            of_model(m).unwrap(),
            a,
            "tokenizer and notes are not the model"
        );
        fs::write(m.join("model.safetensors"), b"other weights").unwrap();
        assert_ne!(of_model(m).unwrap(), a);
        let empty = tempfile::tempdir().unwrap();
        let e = format!("{:#}", of_model(empty.path()).unwrap_err());
        assert!(e.contains(&empty.path().display().to_string()), "{e}");
    }
}
