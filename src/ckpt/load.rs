//! Loading: model config, weights (one file or shards; the family's HF naming variants;
//! F32/F16/BF16), optimizer moments and trainer state; finding the newest complete checkpoint
//! of a run.

use anyhow::{Context, Result, bail};
use safetensors::Dtype;
use std::fs;
use std::path::{Path, PathBuf};

use super::layout_summary as describe;
use super::moments::MomentsMut;
use super::names::{ABSMAX, EXP_AVG, EXP_AVG_SQ, FLAT_EXP_AVG, FLAT_EXP_AVG_SQ, resolve_exact};
use super::safetensors_io::{Resolved, Sources, StFile, Target, decode_into, supported};
use super::shards::{Sharded, weights_missing};
use super::{
    CHECKPOINT_FILES, CONFIG_FILE, MODEL_FILE, MODEL_INDEX_FILE, OPTIMIZER_FILE, STATE_FILE,
    TrainerState,
};
use crate::model::{ModelSpec, ParamLayout};
use crate::run_dir::{RunDir, checkpoint_step};

/// Reads `DIR/config.json` (a Hugging Face config of a family memwall trains).
pub fn load_spec(dir: &Path) -> Result<ModelSpec> {
    let path = dir.join(CONFIG_FILE);
    if !path.is_file() {
        bail!(
            "{}: no such file; {} is not a model or checkpoint directory (it needs config.json \
             and model.safetensors, or model.safetensors.index.json and its shards)",
            path.display(),
            dir.display()
        );
    }
    ModelSpec::from_hf_config_file(&path)
}

/// Opens a safetensors file of a checkpoint directory, with hints when it is absent.
fn open_in(dir: &Path, file: &str) -> Result<StFile> {
    let path = dir.join(file);
    if !path.exists() && file == MODEL_FILE && dir.join("pytorch_model.bin").exists() {
        bail!(
            "{}: no such file; the directory has pytorch_model.bin, convert it to safetensors first",
            path.display()
        );
    }
    StFile::open(&path)
}

/// Checks a buffer length against the layout.
fn check_len(what: &str, len: usize, layout: &ParamLayout) -> Result<()> {
    if len != layout.total {
        bail!(
            "{what} buffer holds {len} elements but the model has {} parameters",
            layout.total
        );
    }
    Ok(())
}

/// Loads the weights of directory `dir` into `params` (length `layout.total`): from
/// `DIR/model.safetensors` when it exists, else from the shards that
/// `DIR/model.safetensors.index.json` names (each tensor from the shard its `weight_map`
/// names; a directory with both loads `model.safetensors` and ignores the index).
///
/// Accepts the family's HF naming variants (GPT-2: `GPT2LMHeadModel` names
/// `transformer.h.0...` and `GPT2Model` names `h.0...`); skips known non-parameters (GPT-2's
/// `attn.bias`/`attn.masked_bias` buffers) and a tied `lm_head.weight` (a warning on stderr
/// if it differs from the embedding); converts F16/BF16. Errors name the file (the index for
/// sharded weights, and the shard where it matters) and the tensors: missing (all listed),
/// wrong shape (expected and found), unsupported dtype, truncated or corrupt file, missing
/// file or shard, an index that does not match its shards. Every file is opened and checked
/// before anything is copied, so on error `params` is unchanged.
pub fn load_params(dir: &Path, layout: &ParamLayout, params: &mut [f32]) -> Result<()> {
    let single = dir.join(MODEL_FILE);
    let index = dir.join(MODEL_INDEX_FILE);
    let sharded = !single.exists() && index.exists();
    check_len("parameter", params.len(), layout).with_context(|| {
        format!(
            "loading {}",
            if sharded { &index } else { &single }.display()
        )
    })?;
    let targets: Vec<Target> = layout
        .tensors
        .iter()
        .map(|t| Target {
            key: t.name.clone(),
            shape: t.shape.clone(),
            buf: 0,
            range: t.range.clone(),
        })
        .collect();
    let family = layout.family;
    // Tied names (a tied LM head) are checked below, not loaded.
    let resolve = |name: &str| match family.canonical_name(name) {
        _ if layout.tied.iter().any(|t| t.name == name) => Resolved::Ignore,
        Some(k) => Resolved::Key(k),
        None => Resolved::Ignore,
    };
    let (file, shards);
    let src = if sharded {
        shards = Sharded::open(dir, &resolve)?;
        shards.sources()
    } else {
        file = open_in(dir, MODEL_FILE)?;
        Sources::single(&file)
    };
    super::safetensors_io::load_targets(&src, &resolve, &targets, &mut [params]).with_context(
        || {
            format!(
                "loading weights into a {} with {}; check --model / config.json",
                family.model_type(),
                describe(layout)
            )
        },
    )?;
    for tied in &layout.tied {
        let to = &layout.tensors[tied.tensor];
        let Some((file, _)) = src.get(&tied.name) else {
            continue;
        };
        if tied_differs(file, &tied.name, to, params) {
            eprintln!(
                "memwall: warning: {}: {} differs from {}; memwall ties them and uses {} for \
                 both ({} is ignored)",
                file.path.display(),
                tied.name,
                to.name,
                to.name,
                tied.name
            );
        }
    }
    Ok(())
}

/// Whether the file has a tensor `name` that is not (bitwise, after conversion) the tensor
/// `to` it is tied to, just loaded into `params`.
pub(crate) fn tied_differs(
    file: &StFile,
    name: &str,
    to: &crate::model::ParamTensor,
    params: &[f32],
) -> bool {
    let Some(info) = file.info(name) else {
        return false;
    };
    let (wte_t, Some(wte)) = (to, params.get(to.range.clone())) else {
        return false;
    };
    if info.shape != wte_t.shape || !supported(info.dtype) {
        return true;
    }
    let Ok(bytes) = file.bytes(name, info) else {
        return true;
    };
    // Compare block by block so that no wte-sized copy is made.
    let width = if info.dtype == Dtype::F32 { 4 } else { 2 };
    let mut block = [0f32; 4096];
    let mut differs = false;
    for (w, src) in wte
        .chunks(block.len())
        .zip(bytes.chunks(block.len() * width))
    {
        let dst = &mut block[..w.len()];
        if decode_into(info.dtype, src, dst).is_err()
            || dst.iter().zip(w).any(|(a, b)| a.to_bits() != b.to_bits())
        {
            differs = true;
            break;
        }
    }
    file.release(info);
    differs
}

/// Loads `DIR/optimizer.safetensors` into the moments (in their stored format, see
/// `moments.rs`) and returns `DIR/trainer_state.json`, checking that the state's model
/// matches `layout`. Same validation as [`load_params`]; a file written for another
/// `--optim-state` is refused, naming the tensor.
pub fn load_trainer_state(
    dir: &Path,
    layout: &ParamLayout,
    moments: MomentsMut,
) -> Result<TrainerState> {
    let path = dir.join(OPTIMIZER_FILE);
    let state_path = dir.join(STATE_FILE);
    let state = TrainerState::read(&state_path)?;
    state.check_layout(&state_path, layout)?;
    let file = open_in(dir, OPTIMIZER_FILE)?;
    let format = moments.format();
    let what = || {
        format!(
            "loading {format} optimizer moments for a {} with {}",
            layout.family.model_type(),
            describe(layout)
        )
    };
    match moments {
        MomentsMut::F32 { m, v } => {
            check_len("exp_avg (m)", m.len(), layout)
                .and_then(|_| check_len("exp_avg_sq (v)", v.len(), layout))
                .with_context(|| format!("loading {}", path.display()))?;
            let mut targets = Vec::with_capacity(2 * layout.tensors.len());
            for (prefix, buf) in [(EXP_AVG, 0), (EXP_AVG_SQ, 1)] {
                targets.extend(layout.tensors.iter().map(|t| Target {
                    key: format!("{prefix}{}", t.name),
                    shape: t.shape.clone(),
                    buf,
                    range: t.range.clone(),
                }));
            }
            let src = Sources::single(&file);
            super::safetensors_io::load_targets(&src, &resolve_exact, &targets, &mut [m, v])
                .with_context(what)?;
        }
        MomentsMut::Bf16 { m, v } => {
            read_raw(&file, FLAT_EXP_AVG, Dtype::BF16, m.len(), |b| {
                for (d, c) in m.iter_mut().zip(b.chunks_exact(2)) {
                    *d = half::bf16::from_le_bytes([c[0], c[1]]);
                }
            })
            .and_then(|_| {
                read_raw(&file, FLAT_EXP_AVG_SQ, Dtype::BF16, v.len(), |b| {
                    for (d, c) in v.iter_mut().zip(b.chunks_exact(2)) {
                        *d = half::bf16::from_le_bytes([c[0], c[1]]);
                    }
                })
            })
            .with_context(what)?;
        }
        MomentsMut::Int8 {
            m,
            m_absmax,
            v,
            v_absmax,
        } => {
            let f32s = |dst: &mut [f32], b: &[u8]| {
                for (d, c) in dst.iter_mut().zip(b.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            };
            read_raw(&file, FLAT_EXP_AVG, Dtype::I8, m.len(), |b| {
                for (d, &x) in m.iter_mut().zip(b) {
                    *d = x as i8;
                }
            })
            .and_then(|_| {
                read_raw(&file, FLAT_EXP_AVG_SQ, Dtype::U8, v.len(), |b| {
                    v.copy_from_slice(b)
                })
            })
            .and_then(|_| {
                let name = format!("{FLAT_EXP_AVG}{ABSMAX}");
                read_raw(&file, &name, Dtype::F32, m_absmax.len(), |b| {
                    f32s(m_absmax, b)
                })
            })
            .and_then(|_| {
                let name = format!("{FLAT_EXP_AVG_SQ}{ABSMAX}");
                read_raw(&file, &name, Dtype::F32, v_absmax.len(), |b| {
                    f32s(v_absmax, b)
                })
            })
            .with_context(what)?;
        }
    }
    Ok(state)
}

/// Hands the bytes of flat tensor `name` (dtype `dtype`, shape `[len]`) to `copy`, after
/// checking both; errors name the file and the tensor.
fn read_raw(
    file: &StFile,
    name: &str,
    dtype: Dtype,
    len: usize,
    copy: impl FnOnce(&[u8]),
) -> Result<()> {
    let p = file.path.display();
    let Some(info) = file.info(name) else {
        let found: Vec<&str> = file.names().take(4).collect();
        bail!(
            "{p}: no tensor {name} (found {}); was the checkpoint written with another --optim-state?",
            found.join(", ")
        );
    };
    if info.dtype != dtype || info.shape != [len] {
        bail!(
            "{p}: tensor {name} is {:?} {:?}, expected {dtype:?} [{len}]; was the checkpoint written with another --optim-state?",
            info.dtype,
            info.shape
        );
    }
    let bytes = file.bytes(name, info)?;
    copy(bytes);
    file.release(info);
    Ok(())
}

/// The newest complete checkpoint under `RUN_DIR/checkpoints`, or `None` if there is none.
/// Ignores temporary (`*.tmp-*`) and other non-`step-N` entries silently, and incomplete
/// `step-N` directories (one of [`CHECKPOINT_FILES`] missing or empty, or the weights: no
/// `model.safetensors`, or no index, or a shard the index names missing or empty) with a
/// warning on stderr.
pub fn latest_checkpoint(run_dir: &Path) -> Result<Option<PathBuf>> {
    let root = RunDir::new(run_dir).checkpoints();
    let entries = match fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", root.display())),
    };
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", root.display()))?;
        let name = entry.file_name();
        let Some(step) = name.to_str().and_then(checkpoint_step) else {
            continue;
        };
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        let mut missing: Vec<String> = CHECKPOINT_FILES
            .iter()
            .filter(|f| !fs::metadata(path.join(f)).is_ok_and(|m| m.is_file() && m.len() > 0))
            .map(|f| f.to_string())
            .collect();
        missing.extend(weights_missing(&path));
        if !missing.is_empty() {
            eprintln!(
                "memwall: warning: ignoring incomplete checkpoint {} (missing or empty: {})",
                path.display(),
                missing.join(", ")
            );
            continue;
        }
        if best.as_ref().is_none_or(|(s, _)| step > *s) {
            best = Some((step, path));
        }
    }
    Ok(best.map(|(_, p)| p))
}
