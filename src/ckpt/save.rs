//! Saving: whole checkpoints (atomic as a directory) and model-only exports (atomic per file),
//! the weights as one file or as shards (see `shards.rs`), the tokenizer files copied along.

use anyhow::{Context, Result, bail};
use std::fs;
use std::path::{Path, PathBuf};

use super::files::{ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE};
use super::names::{ABSMAX, EXP_AVG, EXP_AVG_SQ, FLAT_EXP_AVG, FLAT_EXP_AVG_SQ};
use super::safetensors_io::{Lend, OutData, OutTensor, Whole, write_safetensors};
use super::shards::{DEFAULT_MAX_SHARD_BYTES, is_shard_name, weight_files};
use super::tokenizer::{copy_chat_template, copy_tokenizer_files};
use super::{CONFIG_FILE, MODEL_FILE, MODEL_INDEX_FILE, OPTIMIZER_FILE, STATE_FILE, TrainerState};
use crate::ir::OptimState;
use crate::ir::moments::Moments;
use crate::model::lora::AdapterLayout;
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
    /// The chat template the run's data was prepared with: written as `chat_template.jinja`
    /// (after the tokenizer files: it replaces the model's own), so the checkpoint renders
    /// conversations as it was trained on them.
    pub chat_template: Option<&'a Path>,
    /// A LoRA run's checkpoint: the parameters are these adapters', written as PEFT's
    /// `adapter_model.safetensors` and `adapter_config.json` in place of the model's
    /// `config.json` and weights.
    pub adapter: Option<AdapterCheckpoint<'a>>,
}

/// The adapters a LoRA checkpoint holds, and the base they adapt.
#[derive(Clone, Copy, Debug)]
pub struct AdapterCheckpoint<'a> {
    pub adapters: &'a AdapterLayout,
    /// Recorded as `base_model_name_or_path` (the `--init` directory).
    pub base: &'a str,
}

impl Default for SaveOptions<'_> {
    fn default() -> Self {
        SaveOptions {
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            tokenizer_dir: None,
            chat_template: None,
            adapter: None,
        }
    }
}

/// Checks that `layout` is the layout of `spec` (or of `adapters`, a LoRA checkpoint's) and
/// that each buffer covers it.
fn check_buffers(
    spec: &ModelSpec,
    layout: &ParamLayout,
    adapters: Option<&AdapterLayout>,
    bufs: &[(&str, usize)],
) -> Result<()> {
    let same = match adapters {
        Some(a) => a.params.same_layout(layout),
        None => ParamLayout::new(spec).same_layout(layout),
    };
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

/// The state a checkpoint holds as the writer reads it: flat arrays lent piece by piece
/// ([`Lend`]), borrowed whole when they are in RAM ([`Whole`]) or read one parameter group
/// at a time when they are offloaded (the executor's).
pub(crate) struct LentState<'a> {
    /// The f32 parameters [params].
    pub params: &'a dyn Lend,
    pub moments: LentMoments<'a>,
}

/// The AdamW moments in their stored format (see `moments.rs`), lent.
pub(crate) struct LentMoments<'a> {
    pub format: OptimState,
    /// exp_avg [params]: f32, bf16, or int8 codes (i8).
    pub m: &'a dyn Lend,
    /// exp_avg_sq [params]: f32, bf16, or int8 codes (u8).
    pub v: &'a dyn Lend,
    /// Int8 only: the f32 scales of m's and v's blocks [blocks].
    pub absmax: Option<[&'a dyn Lend; 2]>,
}

/// The model's tensors under their HF names, reading `params`.
fn model_tensors<'a>(layout: &ParamLayout, params: &'a dyn Lend) -> Vec<OutTensor<'a>> {
    layout
        .tensors
        .iter()
        .map(|t| OutTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            from: params,
            range: t.range.clone(),
        })
        .collect()
}

/// The optimizer moments in their stored format (see `moments.rs`).
fn optimizer_tensors<'a>(
    layout: &ParamLayout,
    moments: &LentMoments<'a>,
) -> Result<Vec<OutTensor<'a>>> {
    let flat = |name: &str, from: &'a dyn Lend| OutTensor {
        name: name.to_string(),
        shape: vec![from.len()],
        from,
        range: 0..from.len(),
    };
    let (m, v) = (moments.m, moments.v);
    Ok(match (moments.format, moments.absmax) {
        (OptimState::F32, _) => {
            let mut out = Vec::with_capacity(2 * layout.tensors.len());
            for (prefix, from) in [(EXP_AVG, m), (EXP_AVG_SQ, v)] {
                out.extend(layout.tensors.iter().map(|t| OutTensor {
                    name: format!("{prefix}{}", t.name),
                    shape: t.shape.clone(),
                    from,
                    range: t.range.clone(),
                }));
            }
            out
        }
        (OptimState::Bf16, _) => vec![flat(FLAT_EXP_AVG, m), flat(FLAT_EXP_AVG_SQ, v)],
        (OptimState::Int8, Some([m_absmax, v_absmax])) => vec![
            flat(FLAT_EXP_AVG, m),
            flat(&format!("{FLAT_EXP_AVG}{ABSMAX}"), m_absmax),
            flat(FLAT_EXP_AVG_SQ, v),
            flat(&format!("{FLAT_EXP_AVG_SQ}{ABSMAX}"), v_absmax),
        ],
        (OptimState::Int8, None) => bail!("internal error: int8 moments without their scales"),
    })
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
    let params = Whole(OutData::F32(params));
    let (m, v, absmax) = match *moments {
        Moments::F32 { m, v } => (OutData::F32(m), OutData::F32(v), None),
        Moments::Bf16 { m, v } => (OutData::Bf16(m), OutData::Bf16(v), None),
        Moments::Int8 {
            m,
            m_absmax,
            v,
            v_absmax,
        } => (
            OutData::I8(m),
            OutData::U8(v),
            Some([Whole(OutData::F32(m_absmax)), Whole(OutData::F32(v_absmax))]),
        ),
    };
    let (m, v) = (Whole(m), Whole(v));
    let lent = LentState {
        params: &params,
        moments: LentMoments {
            format: moments.format(),
            m: &m,
            v: &v,
            absmax: absmax
                .as_ref()
                .map(|[a, b]| [a as &dyn Lend, b as &dyn Lend]),
        },
    };
    save_checkpoint_lent(run_dir, spec, layout, &lent, state, opts)
}

/// [`save_checkpoint_with`] reading the parameters and moments from `lent`: each file is
/// written in one pass over its arrays, so state lent group by group (offloaded) is never
/// held whole in RAM.
pub(crate) fn save_checkpoint_lent(
    run_dir: &Path,
    spec: &ModelSpec,
    layout: &ParamLayout,
    lent: &LentState,
    state: &TrainerState,
    opts: &SaveOptions,
) -> Result<PathBuf> {
    let final_dir = RunDir::new(run_dir).checkpoint(state.step);
    let what = || format!("saving checkpoint {}", final_dir.display());
    let moments = &lent.moments;
    check_buffers(
        spec,
        layout,
        opts.adapter.map(|a| a.adapters),
        &[
            ("parameter", lent.params.len()),
            ("exp_avg (m)", moments.m.len()),
            ("exp_avg_sq (v)", moments.v.len()),
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
        let model = model_tensors(layout, lent.params);
        match opts.adapter {
            // PEFT's two files: the adapters under their PEFT names, and their config.
            Some(a) => {
                let config = serde_json::to_vec_pretty(&a.adapters.config(a.base))?;
                write_synced(&tmp.path.join(ADAPTER_CONFIG_FILE), |f| {
                    Ok(std::io::Write::write_all(f, &config)?)
                })?;
                write_synced(&tmp.path.join(ADAPTER_MODEL_FILE), |f| {
                    let mut w = std::io::BufWriter::new(f);
                    write_safetensors(&mut w, &model)?;
                    Ok(std::io::Write::flush(&mut w)?)
                })?;
            }
            None => {
                let config = json_bytes(&spec.to_hf_config())?;
                write_synced(&tmp.path.join(CONFIG_FILE), |f| {
                    Ok(std::io::Write::write_all(f, &config)?)
                })?;
                for (name, file) in weight_files(&model, opts.max_shard_bytes)? {
                    write_synced(&tmp.path.join(name), |f| file.write_to(f))?;
                }
            }
        }
        let moments = optimizer_tensors(layout, moments)?;
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
        if let Some(t) = opts.chat_template {
            copy_chat_template(t, &tmp.path)?;
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
    save_model_as(dir, spec, layout, params, false, opts)
}

/// [`save_model_with`], the weights rounded to bfloat16 (nearest even) when `bf16` (and
/// `config.json`'s `torch_dtype` saying so): half the size, as a bf16 base is distributed.
pub fn save_model_as(
    dir: &Path,
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &[f32],
    bf16: bool,
    opts: &SaveOptions,
) -> Result<()> {
    let rounded: Vec<half::bf16>;
    let params = match bf16 {
        true => {
            rounded = params.iter().map(|&x| half::bf16::from_f32(x)).collect();
            Whole(OutData::Bf16(&rounded))
        }
        false => Whole(OutData::F32(params)),
    };
    save_model_lent(dir, spec, layout, &params, opts)
}

/// [`save_model_as`] from parameters lent piece by piece (`layout`'s order; bf16 where
/// their elements are): a model written without a copy of it in memory (`memwall prune`
/// cuts each tensor as it is written).
pub(crate) fn save_model_lent(
    dir: &Path,
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &dyn Lend,
    opts: &SaveOptions,
) -> Result<()> {
    let what = || format!("saving model to {}", dir.display());
    check_buffers(spec, layout, None, &[("parameter", params.len())]).with_context(what)?;
    fs::create_dir_all(dir)
        .with_context(|| format!("cannot create directory {}", dir.display()))?;
    let bf16 = matches!(params.elem(), OutData::Bf16(_));
    let model = model_tensors(layout, params);
    let files = weight_files(&model, opts.max_shard_bytes).with_context(what)?;
    for (name, file) in &files {
        atomic::write_with(&dir.join(name), |f| file.write_to(f)).with_context(what)?;
    }
    let written: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    remove_stale_weights(dir, &written).with_context(what)?;
    let mut config = spec.to_hf_config();
    if bf16 {
        config["torch_dtype"] = "bfloat16".into();
    }
    atomic::write_file(&dir.join(CONFIG_FILE), &json_bytes(&config)?).with_context(what)?;
    if let Some(src) = opts.tokenizer_dir {
        copy_tokenizer_files(src, dir).with_context(what)?;
    }
    if let Some(t) = opts.chat_template {
        copy_chat_template(t, dir).with_context(what)?;
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
