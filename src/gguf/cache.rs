//! GGUF files used directly (`sample --model FILE.gguf`, `train --init FILE.gguf`): converted
//! once into the user cache and reused.
//!
//! The converted directory is `<cache>/memwall/gguf/<stem>-<key>`, where the key hashes the
//! file's canonical path, size and modification time: the same unchanged file is converted
//! once, a replaced file again. [`convert`](fn@super::convert) publishes a directory only when it
//! is complete, so an existing directory is a whole conversion.

use super::convert::{ConvertOptions, OutDtype, convert};
use crate::ckpt::{CONFIG_FILE, MODEL_FILE};
use anyhow::{Context, Result, anyhow};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The four bytes every GGUF file starts with.
const MAGIC: &[u8; 4] = b"GGUF";

/// Whether `path` is a GGUF file (by its `.gguf` extension or its magic bytes). Directories,
/// missing paths and other files (a config.json) are not.
pub fn is_gguf(path: &Path) -> bool {
    if !path.is_file() {
        return false;
    }
    let by_name = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let mut head = [0u8; 4];
    let by_magic = fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok()
        && &head == MAGIC;
    by_name || by_magic
}

/// `path` itself when it is not a GGUF file; else the Hugging Face directory it converts to
/// in the user cache, converting it first if needed (said on stderr). `flag` names the
/// option in errors (`--model`, `--init`).
pub fn model_dir(path: &Path, flag: &str) -> Result<PathBuf> {
    if !is_gguf(path) {
        return Ok(path.to_path_buf());
    }
    let cache = crate::util::cache::memwall_cache().ok_or_else(|| {
        anyhow!(
            "{flag} {}: a GGUF file is converted into the user cache, but neither \
             XDG_CACHE_HOME nor HOME is set; convert it yourself with `memwall convert {} --out DIR` \
             and pass DIR",
            path.display(),
            path.display()
        )
    })?;
    model_dir_in(&cache.join("gguf"), path, flag)
}

/// [`model_dir`] with the cache folder given (tests use their own).
pub fn model_dir_in(cache: &Path, path: &Path, flag: &str) -> Result<PathBuf> {
    let dir = cache.join(cache_name(path).with_context(|| format!("{flag} {}", path.display()))?);
    if dir.join(CONFIG_FILE).is_file() && dir.join(MODEL_FILE).is_file() {
        eprintln!(
            "{flag} {}: using its conversion in {}",
            path.display(),
            dir.display()
        );
        return Ok(dir);
    }
    fs::create_dir_all(cache)
        .with_context(|| format!("cannot create the cache folder {}", cache.display()))?;
    eprintln!(
        "{flag} {}: converting it once into {}",
        path.display(),
        dir.display()
    );
    let summary = convert(&ConvertOptions {
        input: path.to_path_buf(),
        out: dir.clone(),
        dtype: OutDtype::F32,
        // A directory without its model file is debris of another tool: replace it.
        force: true,
        progress: true,
    })
    .with_context(|| format!("{flag} {}", path.display()))?;
    eprintln!("{}", summary.describe());
    Ok(dir)
}

/// `<stem>-<16 hex digits>`: the file's stem and a hash of its canonical path, size and
/// modification time.
fn cache_name(path: &Path) -> Result<String> {
    let canonical = fs::canonicalize(path)
        .with_context(|| format!("cannot resolve the path {}", path.display()))?;
    let meta =
        fs::metadata(&canonical).with_context(|| format!("cannot stat {}", path.display()))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let mut h = Sha256::new();
    h.update(canonical.as_os_str().as_encoded_bytes());
    h.update(meta.len().to_le_bytes());
    h.update(mtime.to_le_bytes());
    let digest = h.finalize();
    let key: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let stem: String = canonical
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    Ok(format!("{stem}-{key}"))
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{tiny_model, write_temp};
    use super::*;

    #[test]
    fn a_gguf_file_is_converted_once_and_other_paths_pass_through() {
        let (dir, gguf) = write_temp(&tiny_model("llama", true).to_bytes());
        let cache = dir.path().join("cache");
        let a = model_dir_in(&cache, &gguf, "--model").unwrap();
        assert!(a.starts_with(&cache), "{}", a.display());
        assert!(a.join(CONFIG_FILE).is_file() && a.join(MODEL_FILE).is_file());
        let config_time = fs::metadata(a.join(CONFIG_FILE))
            .unwrap()
            .modified()
            .unwrap();
        let b = model_dir_in(&cache, &gguf, "--model").unwrap();
        assert_eq!(a, b);
        let again = fs::metadata(b.join(CONFIG_FILE))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(config_time, again, "the second use reuses the conversion");

        // A replaced file (another size) gets its own conversion.
        let mut bytes = fs::read(&gguf).unwrap();
        bytes.extend_from_slice(&[0u8; 32]);
        fs::write(&gguf, bytes).unwrap();
        let c = model_dir_in(&cache, &gguf, "--model").unwrap();
        assert_ne!(a, c);

        // Directories and config files are not GGUF files.
        assert!(!is_gguf(&a));
        assert!(!is_gguf(&a.join(CONFIG_FILE)));
        assert_eq!(model_dir(&a, "--model").unwrap(), a);
    }

    #[test]
    fn nan_weights_are_refused_and_leave_no_conversion_to_reuse() {
        let mut w = tiny_model("llama", true);
        w.remove_tensor("output_norm.weight");
        let mut v = [0.5f32; 32];
        v[9] = f32::NAN;
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.tensor("output_norm.weight", &[32], crate::gguf::GgmlType::F32, &b);
        let (dir, gguf) = write_temp(&w.to_bytes());
        let cache = dir.path().join("cache");
        for _ in 0..2 {
            // Refused again on the second use: no half-made conversion is picked up.
            let e = format!("{:#}", model_dir_in(&cache, &gguf, "--init").unwrap_err());
            for want in [
                "--init",
                &gguf.display().to_string(),
                "output_norm.weight",
                "element 9 of 32 is NaN",
            ] {
                assert!(e.contains(want), "{want:?} in {e}");
            }
        }
        assert_eq!(
            fs::read_dir(&cache).unwrap().count(),
            0,
            "nothing published"
        );
    }

    #[test]
    fn a_corrupt_gguf_is_refused_naming_the_flag_and_file() {
        let (dir, gguf) = write_temp(b"GGUF\x03\x00\x00\x00truncated");
        let e = format!(
            "{:#}",
            model_dir_in(&dir.path().join("cache"), &gguf, "--init").unwrap_err()
        );
        assert!(
            e.contains("--init") && e.contains(&gguf.display().to_string()),
            "{e}"
        );
    }
}
