//! What `memwall export`'s command line names, resolved before the export: the model (a
//! run directory's newest checkpoint, a GGUF file's conversion), the base an adapter records
//! when no model is given, the name the file gets, an output that would overwrite a
//! directory or the model being read, and the note a user re-quantizing a GGUF should see.

use super::ftype::ExportType;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

/// What a user exporting a GGUF file whose matrices are already quantized should know:
/// its rounding stays in the export, and a quantized `--type` rounds again (llama-quantize
/// asks for `--allow-requantize` there).
pub fn requantize_note(input: &Path, ty: ExportType) -> Option<String> {
    if !crate::util::sniff::is_gguf(input) {
        return None;
    }
    let f = crate::gguf::GgufFile::open(input).ok()?;
    let quantized = f
        .tensors
        .iter()
        .filter(|t| t.dims.len() > 1 && t.ty.block_size > 1)
        .map(|t| t.ty.name)
        .max_by_key(|name| f.tensors.iter().filter(|t| t.ty.name == *name).count())?;
    Some(if ty.ggml().block_size > 1 {
        format!(
            "{} stores its matrices as {quantized}: they are dequantized and quantized again, \
             which adds the second type's error to the first's (from the original f16 or f32 \
             model, where you have it, the export loses less)",
            input.display()
        )
    } else {
        format!(
            "{} stores its matrices as {quantized}: the export keeps that rounding at its own type",
            input.display()
        )
    })
}

/// The base an adapter (or a LoRA run's newest checkpoint) records
/// (`base_model_name_or_path`), when it is a model directory or GGUF file here.
pub fn recorded_base(adapter: &Path) -> Result<PathBuf> {
    let dir = crate::ckpt::adapter::resolve_dir(adapter)?;
    let config = dir.join(crate::ckpt::ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&config).with_context(|| {
        format!(
            "--adapter {}: cannot read {} (give the MODEL to merge it into as well)",
            adapter.display(),
            config.display()
        )
    })?;
    let recorded = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["base_model_name_or_path"].as_str().map(PathBuf::from));
    match recorded {
        Some(p) if p.exists() => {
            eprintln!(
                "{}: merging into the base it records, {}",
                config.display(),
                p.display()
            );
            Ok(p)
        }
        Some(p) if crate::gguf::cache::is_cached_conversion(&p) => bail!(
            "{}: the adapter's base {} was memwall's conversion of a GGUF file in the user \
             cache, since removed (`memwall cache --clear`); give that GGUF file as the MODEL, \
             it is converted once more (`memwall export FILE.gguf --adapter {} --gguf \
             OUT.gguf`)",
            config.display(),
            p.display(),
            adapter.display()
        ),
        Some(p) => bail!(
            "{}: the adapter's base {} is not here: give the MODEL to merge it into \
             (`memwall export MODEL --adapter {} --gguf OUT.gguf`)",
            config.display(),
            p.display(),
            adapter.display()
        ),
        None => bail!(
            "{}: no base_model_name_or_path: give the MODEL to merge the adapter into",
            config.display()
        ),
    }
}

/// What a model path is called in `general.name`: a file's stem, a directory's name, a
/// checkpoint's `RUN-step-N` (its run's name beside its step), a GGUF file's conversion
/// the file's stem.
pub fn display_name(path: &Path) -> Option<String> {
    // A GGUF file's conversion in the user cache is named after the file, not its hash.
    if let Some(source) = crate::gguf::cache::sources_of(path).first() {
        return Some(source.file_stem()?.to_string_lossy().into_owned());
    }
    let p = std::fs::canonicalize(path).ok()?;
    let own = if p.is_dir() {
        p.file_name()
    } else {
        p.file_stem()
    }?
    .to_string_lossy()
    .into_owned();
    let parent = p.parent()?;
    if parent.file_name().is_some_and(|n| n == "checkpoints")
        && let Some(run) = parent.parent().and_then(|r| r.file_name())
    {
        return Some(format!("{}-{own}", run.to_string_lossy()));
    }
    Some(own)
}

/// `--gguf OUT` names a file that is neither a directory, nor the model or adapter being
/// read, nor inside either's directory (a checkpoint's `model.safetensors`, or a file that
/// `--keep-last` would delete with its checkpoint), nor an existing file other than a GGUF
/// file (an earlier export is replaced; anything else would be lost): checked before any work
/// is done.
pub fn check_output(out: &Path, model: &Path, adapter: Option<&Path>) -> Result<()> {
    if out.is_dir() || out.as_os_str().to_string_lossy().ends_with('/') {
        bail!(
            "--gguf {}: a directory; give the file to write, e.g. {}",
            out.display(),
            out.join("model.gguf").display()
        );
    }
    let same = |p: &Path| {
        matches!(
            (std::fs::canonicalize(p), std::fs::canonicalize(out)),
            (Ok(x), Ok(y)) if x == y
        )
    };
    if same(model) || adapter.is_some_and(same) {
        bail!(
            "--gguf {} is the model being read: write the export to another file",
            out.display()
        );
    }
    // The directory the output goes into, resolved ("" is the current one).
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if let Ok(parent) = std::fs::canonicalize(parent) {
        for input in std::iter::once(model).chain(adapter) {
            if input.is_dir()
                && let Ok(dir) = std::fs::canonicalize(input)
                && parent.starts_with(&dir)
            {
                bail!(
                    "--gguf {}: inside {}, which is being read; write the export outside it",
                    out.display(),
                    input.display()
                );
            }
        }
    }
    // A GGUF file's conversion in the user cache is read for it: the file is the input too.
    for source in crate::gguf::cache::sources_of(model) {
        if same(&source) {
            bail!(
                "--gguf {} is the GGUF file {} was converted from, the base being read: write \
                 the export to another file",
                out.display(),
                model.display()
            );
        }
    }
    check_replaceable(out)
}

/// The metadata key that marks a GGUF file memwall exported (its version as the value): a
/// later export replaces only such a file.
pub const EXPORT_MARK: &str = "memwall.exported_by";

/// The mark every export carries ([`EXPORT_MARK`]).
pub fn export_mark() -> (String, crate::gguf::file::Value) {
    (
        EXPORT_MARK.to_string(),
        crate::gguf::file::Value::String(format!("memwall {}", env!("CARGO_PKG_VERSION"))),
    )
}

/// Refuses to replace `out` unless it does not exist or is a GGUF file memwall exported (its
/// [`EXPORT_MARK`]): a downloaded model, or any other file, is never written over.
pub fn check_replaceable(out: &Path) -> Result<()> {
    if !out.exists() {
        return Ok(());
    }
    let mut magic = [0u8; 4];
    let is_gguf = std::fs::File::open(out)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF";
    if !is_gguf {
        bail!(
            "--gguf {}: exists and is not a GGUF file; memwall replaces only its own earlier \
             export: move it, or choose another file name",
            out.display()
        );
    }
    let ours = crate::gguf::GgufFile::open(out)
        .ok()
        .is_some_and(|f| f.get(EXPORT_MARK).is_some());
    if !ours {
        bail!(
            "--gguf {}: exists and is a GGUF file memwall did not export (it has no {EXPORT_MARK} \
             key: a downloaded model, say); memwall replaces only its own earlier export: move \
             it, or choose another file name",
            out.display()
        );
    }
    Ok(())
}

/// The model to export for the MODEL a user gave, and the path its name comes from: a run
/// directory's newest checkpoint (said on stderr), a GGUF file itself (read in place), else
/// the directory itself.
pub fn resolve_model(given: &Path) -> Result<(PathBuf, PathBuf)> {
    // A GGUF file is exported in place (no f32 conversion in the user cache).
    if crate::util::sniff::is_gguf(given) {
        return Ok((given.to_path_buf(), given.to_path_buf()));
    }
    if given.join("config.json").is_file() || !given.join("checkpoints").is_dir() {
        return Ok((
            // Not a GGUF file (those are read in place, above): nothing converts, nothing is
            // said; this names a missing `.gguf` path.
            crate::gguf::cache::model_dir(given, "the model", &mut |_| {})?,
            given.to_path_buf(),
        ));
    }
    match crate::ckpt::latest_checkpoint(given)? {
        Some(newest) => {
            eprintln!(
                "{}: exporting its newest checkpoint, {}",
                given.display(),
                newest.display()
            );
            Ok((newest.clone(), newest))
        }
        None => bail!(
            "{}: a run directory with no complete checkpoint yet (train with --save-every, or \
             wait for the first)",
            given.display()
        ),
    }
}
