//! Saving: whole checkpoints (atomic as a directory) and model-only exports (atomic per file),
//! the weights as one file or as shards (see `shards.rs`), the tokenizer files copied along.

use anyhow::{Context, Result, bail};
use std::fs;
use std::path::{Path, PathBuf};

use super::moments::Moments;
use super::names::{ABSMAX, EXP_AVG, EXP_AVG_SQ, FLAT_EXP_AVG, FLAT_EXP_AVG_SQ};
use super::safetensors_io::{OutData, OutTensor, write_safetensors};
use super::shards::{DEFAULT_MAX_SHARD_BYTES, is_shard_name, weight_files};
use super::tokenizer::copy_tokenizer_files;
use super::{CONFIG_FILE, MODEL_FILE, MODEL_INDEX_FILE, OPTIMIZER_FILE, STATE_FILE, TrainerState};
use crate::model::{ModelSpec, ParamLayout};
use crate::run_dir::RunDir;
use crate::util::atomic::{self, parent_dir, sync_dir, write_synced};
use crate::util::atomic_dir::TempDir;

/// How a save writes the weights, and what it copies next to them.
#[derive(Clone, Copy, Debug)]
pub struct SaveOptions<'a> {
    /// One `model.safetensors` while the tensors' bytes total at most this; above it,
    /// `model-0000k-of-0000n.safetensors` shards of at most this many bytes each (a larger
    /// tensor alone in its shard) and `model.safetensors.index.json`. Default
    /// [`DEFAULT_MAX_SHARD_BYTES`] (5 GB, as transformers' `save_pretrained`).
    pub max_shard_bytes: u64,
    /// Copy the tokenizer files this directory holds (see [`copy_tokenizer_files`]).
    pub tokenizer_dir: Option<&'a Path>,
}

impl Default for SaveOptions<'_> {
    fn default() -> Self {
        SaveOptions {
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            tokenizer_dir: None,
        }
    }
}

/// Checks that `layout` is the layout of `spec` and that each buffer covers it.
fn check_buffers(spec: &ModelSpec, layout: &ParamLayout, bufs: &[(&str, usize)]) -> Result<()> {
    let expect = ParamLayout::new(spec);
    let same = expect.same_layout(layout);
    if !same {
        bail!(
            "the parameter layout ({} elements) is not the layout of model {}",
            layout.total,
            spec.describe()
        );
    }
    for (what, len) in bufs {
        if *len != layout.total {
            bail!(
                "{what} buffer holds {len} elements but the model has {} parameters",
                layout.total
            );
        }
    }
    Ok(())
}

/// The model's tensors under their HF names, borrowing `params`.
fn model_tensors<'a>(layout: &'a ParamLayout, params: &'a [f32]) -> Vec<OutTensor<'a>> {
    layout
        .tensors
        .iter()
        .map(|t| OutTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            data: OutData::F32(&params[t.range.clone()]),
        })
        .collect()
}

/// The optimizer moments in their stored format (see `moments.rs`), borrowed.
fn optimizer_tensors<'a>(layout: &'a ParamLayout, moments: &Moments<'a>) -> Vec<OutTensor<'a>> {
    let flat = |name: &str, data: OutData<'a>| OutTensor {
        name: name.to_string(),
        shape: vec![data_len(&data)],
        data,
    };
    match *moments {
        Moments::F32 { m, v } => {
            let mut out = Vec::with_capacity(2 * layout.tensors.len());
            for (prefix, buf) in [(EXP_AVG, m), (EXP_AVG_SQ, v)] {
                out.extend(layout.tensors.iter().map(|t| OutTensor {
                    name: format!("{prefix}{}", t.name),
                    shape: t.shape.clone(),
                    data: OutData::F32(&buf[t.range.clone()]),
                }));
            }
            out
        }
        Moments::Bf16 { m, v } => vec![
            flat(FLAT_EXP_AVG, OutData::Bf16(m)),
            flat(FLAT_EXP_AVG_SQ, OutData::Bf16(v)),
        ],
        Moments::Int8 {
            m,
            m_absmax,
            v,
            v_absmax,
        } => vec![
            flat(FLAT_EXP_AVG, OutData::I8(m)),
            flat(&format!("{FLAT_EXP_AVG}{ABSMAX}"), OutData::F32(m_absmax)),
            flat(FLAT_EXP_AVG_SQ, OutData::U8(v)),
            flat(
                &format!("{FLAT_EXP_AVG_SQ}{ABSMAX}"),
                OutData::F32(v_absmax),
            ),
        ],
    }
}

fn data_len(d: &OutData) -> usize {
    match d {
        OutData::F32(x) => x.len(),
        OutData::Bf16(x) => x.len(),
        OutData::I8(x) => x.len(),
        OutData::U8(x) => x.len(),
    }
}

/// Pretty JSON bytes with a trailing newline.
fn json_bytes(v: &impl serde::Serialize) -> Result<Vec<u8>> {
    let mut b = serde_json::to_vec_pretty(v)?;
    b.push(b'\n');
    Ok(b)
}

/// [`save_checkpoint_with`] with the default [`SaveOptions`] (shards above 5 GB, no
/// tokenizer files).
pub fn save_checkpoint(
    run_dir: &Path,
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &[f32],
    moments: &Moments,
    state: &TrainerState,
) -> Result<PathBuf> {
    let opts = SaveOptions::default();
    save_checkpoint_with(run_dir, spec, layout, params, moments, state, &opts)
}

/// Writes `RUN_DIR/checkpoints/step-{step:06}/` with `config.json`, the weights
/// (`model.safetensors`, or shards and their index above `opts.max_shard_bytes`),
/// `optimizer.safetensors` (the moments in their stored format), `trainer_state.json`
/// (step = `state.step`) and the tokenizer files of `opts.tokenizer_dir`.
///
/// Atomic: written into a temporary sibling directory, each file fsynced, the directory
/// fsynced, renamed into place (replacing a checkpoint of the same step), the parent fsynced.
/// On error the temporary directory is removed, earlier checkpoints are untouched, and the
/// error names the path. Tensors stream from the slices; no buffer is copied.
pub fn save_checkpoint_with(
    run_dir: &Path,
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &[f32],
    moments: &Moments,
    state: &TrainerState,
    opts: &SaveOptions,
) -> Result<PathBuf> {
    let final_dir = RunDir::new(run_dir).checkpoint(state.step);
    let what = || format!("saving checkpoint {}", final_dir.display());
    let (m_len, v_len) = match moments {
        Moments::F32 { m, v } => (m.len(), v.len()),
        Moments::Bf16 { m, v } => (m.len(), v.len()),
        Moments::Int8 { m, v, .. } => (m.len(), v.len()),
    };
    check_buffers(
        spec,
        layout,
        &[
            ("parameter", params.len()),
            ("exp_avg (m)", m_len),
            ("exp_avg_sq (v)", v_len),
        ],
    )
    .with_context(what)?;
    let root = parent_dir(&final_dir);
    if !root.is_dir() {
        fs::create_dir_all(root)
            .with_context(|| format!("cannot create directory {}", root.display()))
            .with_context(what)?;
        sync_dir(parent_dir(root)).with_context(what)?;
    }
    let tmp = TempDir::create_for(&final_dir).with_context(what)?;
    let written = (|| -> Result<()> {
        let config = json_bytes(&spec.to_hf_config())?;
        write_synced(&tmp.path.join(CONFIG_FILE), |f| {
            Ok(std::io::Write::write_all(f, &config)?)
        })?;
        let model = model_tensors(layout, params);
        for (name, file) in weight_files(&model, opts.max_shard_bytes)? {
            write_synced(&tmp.path.join(name), |f| file.write_to(f))?;
        }
        let moments = optimizer_tensors(layout, moments);
        write_synced(&tmp.path.join(OPTIMIZER_FILE), |f| {
            write_safetensors(f, &moments)
        })?;
        let st = json_bytes(state)?;
        write_synced(&tmp.path.join(STATE_FILE), |f| {
            Ok(std::io::Write::write_all(f, &st)?)
        })?;
        if let Some(src) = opts.tokenizer_dir {
            copy_tokenizer_files(src, &tmp.path)?;
        }
        Ok(())
    })();
    let result = match written {
        Ok(()) => tmp.publish(&final_dir),
        Err(e) => {
            let tmp_path = tmp.path.clone();
            match tmp.discard() {
                None => Err(e.context(format!("removed the incomplete {}", tmp_path.display()))),
                Some(rm) => Err(e.context(format!(
                    "could not remove the incomplete {} ({rm}); delete it by hand",
                    tmp_path.display()
                ))),
            }
        }
    };
    result.with_context(|| format!("{} failed; earlier checkpoints are untouched", what()))?;
    Ok(final_dir)
}

/// [`save_model_with`] with the default [`SaveOptions`] (shards above 5 GB, no tokenizer
/// files).
pub fn save_model(
    dir: &Path,
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &[f32],
) -> Result<()> {
    save_model_with(dir, spec, layout, params, &SaveOptions::default())
}

/// Writes a model-only export into `dir` (created if needed): `config.json`, the weights
/// (`model.safetensors`, or shards and their index above `opts.max_shard_bytes`) and the
/// tokenizer files of `opts.tokenizer_dir`, each file atomically (temporary file, fsync,
/// rename, fsync the directory).
///
/// Weights files of the other form left by an earlier export (a `model.safetensors` when
/// writing shards; an index and shards when writing one file; shards of another count) are
/// removed after the new files are in place. A crash between the two leaves both forms, and
/// loading prefers `model.safetensors`; the export is atomic per file, not as a directory
/// (checkpoints are: [`save_checkpoint_with`]).
pub fn save_model_with(
    dir: &Path,
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &[f32],
    opts: &SaveOptions,
) -> Result<()> {
    let what = || format!("saving model to {}", dir.display());
    check_buffers(spec, layout, &[("parameter", params.len())]).with_context(what)?;
    fs::create_dir_all(dir)
        .with_context(|| format!("cannot create directory {}", dir.display()))?;
    let model = model_tensors(layout, params);
    let files = weight_files(&model, opts.max_shard_bytes).with_context(what)?;
    for (name, file) in &files {
        atomic::write_with(&dir.join(name), |f| file.write_to(f)).with_context(what)?;
    }
    let written: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    remove_stale_weights(dir, &written).with_context(what)?;
    atomic::write_file(&dir.join(CONFIG_FILE), &json_bytes(&spec.to_hf_config())?)
        .with_context(what)?;
    if let Some(src) = opts.tokenizer_dir {
        copy_tokenizer_files(src, dir).with_context(what)?;
    }
    Ok(())
}

/// Removes the weights files in `dir` (`model.safetensors`, the index, shards) that are not
/// among `written`, then fsyncs the directory.
fn remove_stale_weights(dir: &Path, written: &[&str]) -> Result<()> {
    let entries = fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    let mut removed = false;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let weights = name == MODEL_FILE || name == MODEL_INDEX_FILE || is_shard_name(name);
        if weights && !written.contains(&name) {
            fs::remove_file(entry.path()).with_context(|| {
                format!(
                    "cannot remove {}, weights of an earlier export that the new ones replace; \
                     delete it by hand",
                    entry.path().display()
                )
            })?;
            removed = true;
        }
    }
    if removed {
        sync_dir(dir)?;
    }
    Ok(())
}
