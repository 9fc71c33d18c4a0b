//! GGUF files used directly (`sample --model FILE.gguf`, `train --init FILE.gguf`): converted
//! once into the user cache and reused.
//!
//! The converted directory is `<cache>/memwall/gguf/<stem>-<key>`, where the key is the
//! start of the SHA-256 of the file's content: the same bytes are converted once, whatever
//! their path or modification time. A file is not hashed at every use:
//! [`crate::util::fingerprint::file_sha256`] remembers its hash by path, size, times and
//! inode. `index.json` maps each path to its hash and conversion; when a path's content
//! changed, the conversion of its old content is removed unless another indexed file still
//! has that content (a replaced model leaves no copy behind). [`convert`](fn@super::convert)
//! publishes a directory only when it is complete, so an existing directory is a whole
//! conversion; two processes converting one file take turns on a lock file beside it, and a
//! conversion first checks the disk has room for its f32 copy.
//!
//! What it has to tell the user (which conversion it uses, that it converts, that it waits
//! for another process's conversion, a stale conversion removed) goes to the caller's `say`
//! when it happens, as the conversion and the wait can take minutes: the library prints
//! nothing; the command line prints each line on stderr.
//!
//! `memwall cache` lists the entries ([`conversions_in`]) and `memwall cache --clear`
//! removes memwall's own ([`clear_in`]): each conversion is an f32 copy of its model,
//! several times the size of a quantized file.

use super::convert::{ConvertOptions, OutDtype, convert};
use crate::ckpt::{CONFIG_FILE, MODEL_FILE};
use anyhow::{Context, Result, anyhow, bail};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use crate::util::sniff::is_gguf;

/// `path` itself when it is not a GGUF file; else the Hugging Face directory it converts to
/// in the user cache, converting it first if needed. What it does is said to `say`, a line
/// at a time, when it happens (the command line prints them on stderr); a path that is not
/// a GGUF file says nothing. `flag` names the option in errors (`--model`, `--init`).
pub fn model_dir(path: &Path, flag: &str, say: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    if !is_gguf(path) {
        let named_gguf = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        if named_gguf && !path.exists() {
            bail!("{flag} {}: no such file", path.display());
        }
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
    model_dir_in(&cache.join("gguf"), path, flag, say)
}

/// [`model_dir`] with the cache folder given (tests use their own).
pub fn model_dir_in(
    cache: &Path,
    path: &Path,
    flag: &str,
    say: &mut dyn FnMut(&str),
) -> Result<PathBuf> {
    let here = || format!("{flag} {}", path.display());
    let canonical =
        fs::canonicalize(path).with_context(|| format!("{}: cannot resolve the path", here()))?;
    let (size, mtime) = stat(&canonical).with_context(here)?;
    let key = canonical.to_string_lossy().into_owned();
    let index_path = cache.join(INDEX_FILE);
    let mut index = read_index(&index_path);
    let previous = index.get(&key).cloned();
    // Remembered by path, size, times and inode (`util::fingerprint`): a file replaced by
    // another, even one that kept the old modification time, is hashed again.
    let sha = crate::util::fingerprint::file_sha256(&canonical).with_context(here)?;
    let complete = |d: &Path| d.join(CONFIG_FILE).is_file() && d.join(MODEL_FILE).is_file();
    // The same content under another name (a copy of the file) is the same conversion.
    let suffix = format!("-{}", &sha[..16]);
    let same_content = fs::read_dir(cache).ok().and_then(|entries| {
        entries
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with(&suffix) && complete(p))
    });
    let dir = same_content.unwrap_or_else(|| cache.join(dir_name(&canonical, &sha)));
    if complete(&dir) {
        say(&format!(
            "{}: using its conversion in {}",
            here(),
            dir.display()
        ));
    } else {
        fs::create_dir_all(cache)
            .with_context(|| format!("cannot create the cache folder {}", cache.display()))?;
        // One conversion of a file at a time: a second process waits, then uses the first's.
        let _lock = ConversionLock::take(cache, &dir, &here(), say)?;
        if complete(&dir) {
            say(&format!(
                "{}: using its conversion in {}",
                here(),
                dir.display()
            ));
        } else {
            convert_into(path, &dir, &here(), say)?;
        }
    }
    let entry = IndexEntry {
        size,
        mtime_ns: mtime,
        sha256: sha.clone(),
        dir: dir.file_name().map(|n| n.to_string_lossy().into_owned()),
    };
    if previous.as_ref() != Some(&entry) {
        index.insert(key, entry);
        // The conversion of this path's old content, when nothing else has that content.
        if let Some(old) = previous
            && old.sha256 != sha
            && !index.values().any(|e| e.sha256 == old.sha256)
            && let Some(name) = old.dir
        {
            let stale = cache.join(name);
            if stale != dir && stale.is_dir() && is_conversion(&stale) {
                say(&match fs::remove_dir_all(&stale) {
                    Ok(()) => format!(
                        "{}: removed the conversion of its earlier content, {}",
                        here(),
                        stale.display()
                    ),
                    Err(e) => format!(
                        "memwall: warning: cannot remove the stale conversion {}: {e}",
                        stale.display()
                    ),
                });
            }
        }
        // The index only saves hashing: failing to write it costs time, not correctness.
        if let Err(e) = write_index(&index_path, &index) {
            say(&format!("memwall: warning: {e:#}"));
        }
    }
    Ok(dir)
}

/// Converts the GGUF file `path` into `dir` (in the cache), said to `say` with the disk it
/// takes before it starts, refused before any work when the disk has less room. A directory
/// already at `dir` without a whole conversion is removed only when `memwall convert` wrote
/// it (its marker).
fn convert_into(path: &Path, dir: &Path, here: &str, say: &mut dyn FnMut(&str)) -> Result<()> {
    if dir.exists() {
        if crate::util::owned_dir::written_by(dir).as_deref() != Some("memwall convert") {
            bail!(
                "{here}: its conversion would go to {}, which holds a directory memwall did not \
                 write; move it away, or convert the file yourself (`memwall convert {} --out \
                 DIR`) and pass DIR",
                dir.display(),
                path.display()
            );
        }
        fs::remove_dir_all(dir)
            .with_context(|| format!("cannot remove the incomplete {}", dir.display()))?;
    }
    let f = super::GgufFile::open(path).with_context(|| here.to_string())?;
    // f32 weights, 4 bytes a value, plus the tokenizer files (a few MB).
    let need: u64 = f
        .tensors
        .iter()
        .map(|t| 4 * t.dims.iter().product::<u64>())
        .sum::<u64>()
        + (16 << 20);
    drop(f);
    let parent = dir.parent().unwrap_or(Path::new("."));
    if let Ok(free) = crate::mem::disk::free_bytes(parent)
        && free < need
    {
        bail!(
            "{here}: converting it takes about {} in {} (an f32 copy, 4 bytes a parameter) but \
             the disk has {} free; free space there, point XDG_CACHE_HOME at a larger disk, or \
             convert it yourself (`memwall convert {} --out DIR --dtype bf16`) and pass DIR",
            crate::util::bytes::fmt_bytes(need),
            parent.display(),
            crate::util::bytes::fmt_bytes(free),
            path.display()
        );
    }
    say(&format!(
        "{here}: converting it once into {} (about {} of disk)",
        dir.display(),
        crate::util::bytes::fmt_bytes(need)
    ));
    let summary = convert(&ConvertOptions {
        input: path.to_path_buf(),
        out: dir.to_path_buf(),
        dtype: OutDtype::F32,
        force: false,
        progress: true,
    })
    .with_context(|| here.to_string())?;
    say(&summary.describe());
    Ok(())
}

/// An exclusive lock on one conversion (`flock` on a hidden `.<name>.lock` file beside it),
/// held until dropped, so that two processes using a new GGUF file at once convert it once.
struct ConversionLock {
    _file: fs::File,
}

impl ConversionLock {
    /// Takes the lock, waiting while another process holds it (said to `say` before the
    /// wait).
    fn take(
        cache: &Path,
        dir: &Path,
        here: &str,
        say: &mut dyn FnMut(&str),
    ) -> Result<ConversionLock> {
        use std::os::fd::AsRawFd;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let path = cache.join(format!(".{name}.lock"));
        let file = fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("cannot create the lock file {}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns.
        let lock = |op| unsafe { libc::flock(file.as_raw_fd(), op) } == 0;
        if !lock(libc::LOCK_EX | libc::LOCK_NB) {
            say(&format!(
                "{here}: another memwall is converting it; waiting for it to finish"
            ));
            if !lock(libc::LOCK_EX) {
                return Err(std::io::Error::last_os_error())
                    .with_context(|| format!("cannot lock {}", path.display()));
            }
        }
        Ok(ConversionLock { _file: file })
    }
}

/// What an entry of the cache folder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// A whole conversion memwall wrote (its `.memwall` marker, only a conversion's files).
    Conversion,
    /// The temporary of a conversion whose process is gone (killed while converting).
    Interrupted,
    /// The temporary of a conversion still running in another process.
    InProgress,
    /// A directory memwall did not write (no marker, or other files in it): never removed.
    Foreign,
}

/// One entry of the cache folder: its directory, the bytes it holds, the GGUF files the
/// index maps to it (a file since moved or changed is still listed, as the index knew it),
/// and what it is.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Conversion {
    pub dir: PathBuf,
    pub bytes: u64,
    pub sources: Vec<String>,
    pub kind: EntryKind,
}

impl Conversion {
    /// Whether `memwall cache --clear` removes it: memwall's own conversions and the
    /// temporaries of killed ones.
    pub fn removable(&self) -> bool {
        matches!(self.kind, EntryKind::Conversion | EntryKind::Interrupted)
    }
}

/// The entries of the cache folder `cache` (`<cache>/memwall/gguf`), by name; none when the
/// folder does not exist.
pub fn conversions_in(cache: &Path) -> Result<Vec<Conversion>> {
    let index = read_index(&cache.join(INDEX_FILE));
    let Ok(entries) = fs::read_dir(cache) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.with_context(|| format!("cannot read the cache folder {}", cache.display()))?;
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if !path.is_dir() || name.starts_with('.') {
            continue;
        }
        // A temporary counts as a conversion's only when its name is `<stem>-<16 hex
        // digits>.tmp-<pid>-<n>` and it holds nothing a conversion does not write.
        let kind = match name.rsplit_once(".tmp-") {
            Some((stem, writer)) if is_key_name(stem) && only_conversion_files(&path, true) => {
                match crate::util::atomic::writer_is_gone(writer) {
                    true => EntryKind::Interrupted,
                    false => EntryKind::InProgress,
                }
            }
            Some(_) => EntryKind::Foreign,
            None if is_conversion(&path) => EntryKind::Conversion,
            None => EntryKind::Foreign,
        };
        let sources = index
            .iter()
            .filter(|(_, v)| v.dir.as_deref() == Some(name.as_str()))
            .map(|(k, _)| k.clone())
            .collect();
        out.push(Conversion {
            bytes: dir_bytes(&path),
            dir: path,
            sources,
            kind,
        });
    }
    out.sort_by(|a, b| a.dir.cmp(&b.dir));
    Ok(out)
}

/// The GGUF files the index maps to `dir` when it is a conversion in the user cache (none
/// for any other path).
pub fn sources_of(dir: &Path) -> Vec<PathBuf> {
    let (Some(cache), Ok(dir)) = (
        crate::util::cache::memwall_cache().and_then(|c| fs::canonicalize(c.join("gguf")).ok()),
        fs::canonicalize(dir),
    ) else {
        return Vec::new();
    };
    if dir.parent() != Some(cache.as_path()) {
        return Vec::new();
    }
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    read_index(&cache.join(INDEX_FILE))
        .into_iter()
        .filter(|(_, e)| e.dir == name)
        .map(|(k, _)| PathBuf::from(k))
        .collect()
}

/// Whether `path` is inside memwall's folder of conversions in the user cache.
pub fn is_cached_conversion(path: &Path) -> bool {
    let Some(cache) = crate::util::cache::memwall_cache().map(|c| c.join("gguf")) else {
        return false;
    };
    let canon = |p: &Path| fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    canon(path).starts_with(canon(&cache)) || path.starts_with(&cache)
}

/// Whether `dir` is a whole conversion memwall wrote: the marker `convert` writes, and
/// nothing a conversion does not write.
fn is_conversion(dir: &Path) -> bool {
    crate::util::owned_dir::written_by(dir).as_deref() == Some("memwall convert")
        && only_conversion_files(dir, false)
}

/// Whether every entry of `dir` is a file a conversion writes (its marker included; in a
/// conversion's temporary, `unfinished`, also the safetensors writer's `.tmp…` file).
fn only_conversion_files(dir: &Path, unfinished: bool) -> bool {
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().all(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        e.file_type().is_ok_and(|t| t.is_file())
            && (name == crate::util::owned_dir::MARKER
                || super::convert::written_by_convert(&name)
                || (unfinished && name.starts_with(".tmp")))
    })
}

/// Whether `name` is a conversion's directory name, `<stem>-<16 hex digits>`.
fn is_key_name(name: &str) -> bool {
    name.rsplit_once('-').is_some_and(|(stem, key)| {
        !stem.is_empty() && key.len() == 16 && key.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

/// The bytes of the files under `dir` (unreadable entries count 0).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

/// Removes memwall's conversions and the temporaries of killed ones from `cache`, and the
/// index entries of what it removed; returns every entry, removed or kept
/// ([`Conversion::removable`]). A directory memwall did not write, and a conversion still
/// running, are left as they are. The next use of a GGUF file converts it again.
pub fn clear_in(cache: &Path) -> Result<Vec<Conversion>> {
    let all = conversions_in(cache)?;
    for c in all.iter().filter(|c| c.removable()) {
        fs::remove_dir_all(&c.dir)
            .with_context(|| format!("cannot remove the conversion {}", c.dir.display()))?;
    }
    let index_path = cache.join(INDEX_FILE);
    let mut index = read_index(&index_path);
    let before = index.len();
    index.retain(|_, e| {
        e.dir
            .as_ref()
            .is_some_and(|d| cache.join(d).join(CONFIG_FILE).is_file())
    });
    if index.is_empty() && index_path.exists() {
        fs::remove_file(&index_path)
            .with_context(|| format!("cannot remove {}", index_path.display()))?;
    } else if index.len() != before {
        write_index(&index_path, &index)?;
    }
    Ok(all)
}

/// The index of hashed files, in the cache folder.
const INDEX_FILE: &str = "index.json";

/// What the index remembers of one path.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct IndexEntry {
    size: u64,
    mtime_ns: u128,
    sha256: String,
    /// The conversion's directory name in the cache.
    dir: Option<String>,
}

/// The index at `path`; empty when missing or unreadable (it is only a shortcut).
fn read_index(path: &Path) -> BTreeMap<String, IndexEntry> {
    fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn write_index(path: &Path, index: &BTreeMap<String, IndexEntry>) -> Result<()> {
    crate::util::atomic::write_file(path, &serde_json::to_vec_pretty(index)?)
        .with_context(|| format!("cannot write the cache index {}", path.display()))
}

/// The file's size and modification time in nanoseconds.
fn stat(path: &Path) -> Result<(u64, u128)> {
    let meta = fs::metadata(path).with_context(|| format!("cannot stat {}", path.display()))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok((meta.len(), mtime))
}

/// `<stem>-<16 hex digits of the content hash>`.
fn dir_name(canonical: &Path, sha: &str) -> String {
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
    format!("{stem}-{}", &sha[..16])
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{tiny_model, write_temp};
    use super::*;

    /// What `f` returns, and the lines it said.
    fn saying<R>(f: impl FnOnce(&mut dyn FnMut(&str)) -> R) -> (R, Vec<String>) {
        let mut said = Vec::new();
        let r = f(&mut |m: &str| said.push(m.to_string()));
        (r, said)
    }

    /// [`model_dir_in`] for `--model`, its lines left unread.
    fn quiet(cache: &Path, gguf: &Path) -> Result<PathBuf> {
        model_dir_in(cache, gguf, "--model", &mut |_| {})
    }

    #[test]
    fn conversions_are_listed_with_their_sources_and_cleared() {
        let (dir, gguf) = write_temp(&tiny_model("llama", true).to_bytes());
        let cache = dir.path().join("cache");
        assert_eq!(conversions_in(&cache).unwrap(), Vec::new());
        let a = quiet(&cache, &gguf).unwrap();
        let listed = conversions_in(&cache).unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].dir, a);
        let canonical = fs::canonicalize(&gguf).unwrap();
        assert_eq!(listed[0].sources, vec![canonical.display().to_string()]);
        let model = fs::metadata(a.join(MODEL_FILE)).unwrap().len();
        assert!(listed[0].bytes > model, "{} bytes", listed[0].bytes);
        let cleared = clear_in(&cache).unwrap();
        assert_eq!(cleared, listed);
        assert!(!a.exists() && !cache.join(INDEX_FILE).exists());
        assert_eq!(conversions_in(&cache).unwrap(), Vec::new());
        // The next use converts again.
        assert_eq!(quiet(&cache, &gguf).unwrap(), a);
    }

    #[test]
    fn a_gguf_file_is_converted_once_and_other_paths_pass_through() {
        let (dir, gguf) = write_temp(&tiny_model("llama", true).to_bytes());
        let cache = dir.path().join("cache");
        let (a, said) = saying(|say| model_dir_in(&cache, &gguf, "--model", say));
        let a = a.unwrap();
        let here = format!("--model {}", gguf.display());
        assert!(a.starts_with(&cache), "{}", a.display());
        let converting = format!("{here}: converting it once into {}", a.display());
        assert!(said[0].starts_with(&converting), "{said:?}");
        assert_eq!(said.len(), 2, "the conversion, then its summary: {said:?}");
        assert!(a.join(CONFIG_FILE).is_file() && a.join(MODEL_FILE).is_file());
        let config_time = fs::metadata(a.join(CONFIG_FILE))
            .unwrap()
            .modified()
            .unwrap();
        let (b, said) = saying(|say| model_dir_in(&cache, &gguf, "--model", say));
        let b = b.unwrap();
        assert_eq!(a, b);
        let using = format!("{here}: using its conversion in {}", a.display());
        assert_eq!(said, vec![using]);
        let again = fs::metadata(b.join(CONFIG_FILE))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(config_time, again, "the second use reuses the conversion");

        // The same bytes with a new modification time (or at another path): no new copy.
        let bytes = fs::read(&gguf).unwrap();
        fs::write(&gguf, &bytes).unwrap();
        let copy = dir.path().join("copy.gguf");
        fs::write(&copy, &bytes).unwrap();
        assert_eq!(quiet(&cache, &gguf).unwrap(), a);
        assert_eq!(quiet(&cache, &copy).unwrap(), a);

        // A replaced file gets its own conversion; the old one goes once no indexed file
        // has its content.
        let mut changed = bytes.clone();
        changed.extend_from_slice(&[0u8; 32]);
        fs::write(&gguf, &changed).unwrap();
        let c = quiet(&cache, &gguf).unwrap();
        assert_ne!(a, c);
        assert!(a.is_dir(), "copy.gguf still has the old content");
        fs::write(&copy, &changed).unwrap();
        let (same, said) = saying(|say| model_dir_in(&cache, &copy, "--model", say));
        assert_eq!(same.unwrap(), c);
        let removed = format!(
            "--model {}: removed the conversion of its earlier content, {}",
            copy.display(),
            a.display()
        );
        assert!(said.contains(&removed), "{said:?}");
        assert!(
            !a.exists(),
            "no indexed file has the old content: its conversion went"
        );
        let dirs = fs::read_dir(&cache)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().is_dir());
        assert_eq!(dirs.count(), 1, "one conversion in the cache");

        // Directories and config files are not GGUF files.
        assert!(!is_gguf(&a));
        assert!(!is_gguf(&a.join(CONFIG_FILE)));
        let (same, said) = saying(|say| model_dir(&a, "--model", say));
        assert_eq!(same.unwrap(), a);
        assert_eq!(
            said,
            Vec::<String>::new(),
            "a directory is used as it is, silently"
        );
    }

    #[test]
    fn nan_weights_are_refused_and_leave_no_conversion_to_reuse() {
        let mut w = tiny_model("llama", true);
        w.remove_tensor("output_norm.weight");
        let mut v = [0.5f32; 32];
        v[9] = f32::NAN;
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.tensor("output_norm.weight", &[32], crate::dtype::GgmlType::F32, &b);
        let (dir, gguf) = write_temp(&w.to_bytes());
        let cache = dir.path().join("cache");
        for _ in 0..2 {
            // Refused again on the second use: no half-made conversion is picked up.
            let e = format!(
                "{:#}",
                model_dir_in(&cache, &gguf, "--init", &mut |_| {}).unwrap_err()
            );
            for want in [
                "--init",
                &gguf.display().to_string(),
                "output_norm.weight",
                "element 9 of 32 is NaN",
            ] {
                assert!(e.contains(want), "{want:?} in {e}");
            }
        }
        let published = fs::read_dir(&cache)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().is_dir())
            .count();
        assert_eq!(published, 0, "nothing published");
    }

    #[test]
    fn a_corrupt_gguf_is_refused_naming_the_flag_and_file() {
        let (dir, gguf) = write_temp(b"GGUF\x03\x00\x00\x00truncated");
        let e = format!(
            "{:#}",
            model_dir_in(&dir.path().join("cache"), &gguf, "--init", &mut |_| {}).unwrap_err()
        );
        assert!(
            e.contains("--init") && e.contains(&gguf.display().to_string()),
            "{e}"
        );
    }

    #[test]
    fn a_process_waiting_for_another_conversion_says_so_while_it_waits() {
        let (dir, gguf) = write_temp(&tiny_model("llama", true).to_bytes());
        let cache = dir.path().join("cache");
        fs::create_dir_all(&cache).unwrap();
        let canonical = fs::canonicalize(&gguf).unwrap();
        let sha = crate::util::fingerprint::file_sha256(&canonical).unwrap();
        let target = cache.join(dir_name(&canonical, &sha));
        // Another memwall converting it: its lock held here.
        let held = ConversionLock::take(&cache, &target, "--model", &mut |_| {}).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let (cache, gguf) = (cache.clone(), gguf.clone());
            std::thread::spawn(move || {
                model_dir_in(&cache, &gguf, "--model", &mut |m: &str| {
                    tx.send(m.to_string()).unwrap()
                })
            })
        };
        // Said before the lock is given back: the user hears it while the process waits.
        let first = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("the waiting process says it waits");
        assert!(
            first.ends_with("another memwall is converting it; waiting for it to finish"),
            "{first}"
        );
        assert!(!waiter.is_finished(), "it waits for the lock");
        drop(held);
        assert_eq!(waiter.join().unwrap().unwrap(), target);
    }
}
