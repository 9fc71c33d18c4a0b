//! Loading: model config, weights (one file or shards; the family's HF naming variants;
//! F32/F16/BF16), optimizer moments and trainer state, NaN and infinite values refused;
//! finding the newest complete checkpoint of a run.
//!
//! State that lives in several buffers (per parameter group, offloaded, or sharded among
//! ranks) loads range by range: [`load_params_by`] and [`load_trainer_state_by`] open and
//! check the files first, then lend a copier that the executor (`fill_params`,
//! `fill_moments`) calls once per buffer, releasing the mapped file's pages after each range.
//! So `--resume` and `--init` need no host copy of the whole state, and each rank fills its
//! own shards from the whole file (tensors may be cut): a run resumes on any number of ranks.
//! A tensor-parallel rank's layout (`ParamLayout::part`) loads the same way: each cut
//! tensor's part is read from its runs of the whole tensor in the file
//! (`TensorPart::runs_in`; bf16 moments: its runs of the flat arrays), and the trainer
//! state's model is checked against the whole model the part belongs to
//! (`ParamLayout::same_model`), so a checkpoint of one process resumes on tensor ranks and
//! the reverse.

use anyhow::{Context, Result, bail};
use safetensors::Dtype;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::files::{ADAPTER_CHECKPOINT_FILES, ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE};
use super::names::{ABSMAX, EXP_AVG, EXP_AVG_SQ, FLAT_EXP_AVG, FLAT_EXP_AVG_SQ, resolve_exact};
use super::safetensors_io::{
    Resolved, Sources, StFile, Target, check_targets, copy_targets, decode_into, supported,
};
use super::shards::{Sharded, weights_missing};
use super::state::layout_summary as describe;
use super::{
    CHECKPOINT_FILES, CONFIG_FILE, MODEL_FILE, MODEL_INDEX_FILE, OPTIMIZER_FILE, STATE_FILE,
    TrainerState,
};
use crate::ir::OptimState;
use crate::ir::moments::MomentsMut;
use crate::ir::strategy::QBLOCK;
use crate::model::{ModelSpec, ParamLayout};
use crate::run_dir::{RunDir, checkpoint_step};

/// Whether tensor `name` is another pipeline stage's (absent from `layout`).
fn is_absent(layout: &ParamLayout, name: &str) -> bool {
    layout.absent.iter().any(|a| a.name == name)
}

/// Reads `DIR/config.json` (a Hugging Face config of a family memwall trains).
pub fn load_spec(dir: &Path) -> Result<ModelSpec> {
    let path = dir.join(CONFIG_FILE);
    if !path.is_file() && dir.join(ADAPTER_CONFIG_FILE).is_file() {
        bail!(
            "{} holds a LoRA adapter, not a model: give its base as the model and the adapter \
             beside it (`train --init BASE --init-adapter {d}`, `sample --model BASE --adapter \
             {d}`, `merge BASE {d} --out DIR`, `export BASE --adapter {d} --gguf OUT.gguf`)",
            dir.display(),
            d = dir.display()
        );
    }
    if !path.is_file() {
        // A run directory one level up from its checkpoints: name the newest.
        let run_hint = match latest_checkpoint(dir) {
            Ok(Some(ck)) => format!(
                "; it is a training run: give one of its checkpoints, the newest being {}",
                ck.display()
            ),
            _ => String::new(),
        };
        bail!(
            "{}: no such file; {} is not a model or checkpoint directory (it needs config.json \
             and model.safetensors, or model.safetensors.index.json and its shards){run_hint}",
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
/// before anything is copied, so on those errors `params` is unchanged. A NaN or infinite
/// value is refused too, naming the tensor, the element and the file; it is found while
/// copying, so `params` then holds part of the file.
pub fn load_params(dir: &Path, layout: &ParamLayout, params: &mut [f32]) -> Result<()> {
    check_len("parameter", params.len(), layout).with_context(|| {
        let single = dir.join(MODEL_FILE);
        let file = match !single.exists() && dir.join(MODEL_INDEX_FILE).exists() {
            true => dir.join(MODEL_INDEX_FILE),
            false => single,
        };
        format!("loading {}", file.display())
    })?;
    load_params_by(dir, layout, |copy| copy(0..layout.total, params))
}

/// What [`load_params_by`] lends: copies the parameters `range` (whole tensors, or a piece
/// of one) from the checked files into `dst` (`range.len()` elements).
pub type CopyParams<'a> = dyn FnMut(Range<usize>, &mut [f32]) -> Result<()> + 'a;

/// [`load_params`] range by range, without a host copy of the whole model: opens and checks
/// the files (every check of [`load_params`], before `fill` runs), then lends `fill` the
/// copier, which it calls for the ranges it holds (e.g. one parameter group's buffer at a
/// time). A tied tensor is compared with its twin when the range holding it is copied.
pub fn load_params_by(
    dir: &Path,
    layout: &ParamLayout,
    fill: impl FnOnce(&mut CopyParams<'_>) -> Result<()>,
) -> Result<()> {
    let single = dir.join(MODEL_FILE);
    let index = dir.join(MODEL_INDEX_FILE);
    let sharded = !single.exists() && index.exists();
    let targets: Vec<Target> = Target::whole_tensors(layout, "", 0).collect();
    let family = layout.family;
    // Tied names (a tied LM head) are checked below, not loaded; a pipeline stage's file
    // holds the other stages' tensors too, which are theirs to load.
    let resolve = |name: &str| match family.canonical_name(name) {
        _ if layout.tied.iter().any(|t| t.name == name) => Resolved::Ignore,
        Some(k) if is_absent(layout, &k) => Resolved::Ignore,
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
    let what = || {
        format!(
            "loading weights into a {} with {}; check --model / config.json",
            family.model_type(),
            describe(layout)
        )
    };
    let located = check_targets(&src, &resolve, &targets).with_context(what)?;
    let mut copy = |range: Range<usize>, dst: &mut [f32]| -> Result<()> {
        if dst.len() != range.len() {
            bail!(
                "internal error: {} elements for parameters {range:?}",
                dst.len()
            );
        }
        let inside = |r: &Range<usize>| range.start <= r.start && r.end <= range.end;
        let within = targets_within(&targets, &range)?;
        let copied = copy_targets(&src, &located, &within, &mut [&mut *dst]);
        src.release_all();
        copied.with_context(what)?;
        for tied in &layout.tied {
            let to = &layout.tensors[tied.tensor];
            let whole = to.part.is_none();
            let Some((file, _)) = src.get(&tied.name).filter(|_| whole && inside(&to.range)) else {
                continue;
            };
            let values = &dst[to.range.start - range.start..to.range.end - range.start];
            if tied_differs(file, &tied.name, to, values) {
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
    };
    fill(&mut copy)
}

/// The targets lying in parameter elements `range`, their ranges made relative to its start
/// (for a destination holding just `range`); a target `range` cuts is cut to its part inside
/// (a rank's shard holds parts of tensors).
fn targets_within(targets: &[Target], range: &Range<usize>) -> Result<Vec<Target>> {
    let mut within = Vec::new();
    for t in targets {
        let r = &t.range;
        let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
        if lo < hi {
            within.push(Target {
                range: lo - range.start..hi - range.start,
                from: t.from + (lo - r.start),
                ..t.clone()
            });
        }
    }
    Ok(within)
}

/// Whether the file has a tensor `name` that is not (bitwise, after conversion) the tensor
/// `to` it is tied to, whose values `wte` were just loaded.
pub(crate) fn tied_differs(
    file: &StFile,
    name: &str,
    to: &crate::model::ParamTensor,
    wte: &[f32],
) -> bool {
    let Some(info) = file.info(name) else {
        return false;
    };
    if info.shape != to.shape || !supported(info.dtype) {
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
/// matches `layout`. Same validation as [`load_params`] (NaN and infinite moments and
/// int8 block scales included); a file written for another `--optim-state` is refused,
/// naming the tensor.
pub fn load_trainer_state(
    dir: &Path,
    layout: &ParamLayout,
    moments: MomentsMut,
) -> Result<TrainerState> {
    let format = moments.format();
    let (m_len, v_len) = match &moments {
        MomentsMut::F32 { m, v } => (m.len(), v.len()),
        MomentsMut::Bf16 { m, v } => (m.len(), v.len()),
        MomentsMut::Int8 { m, v, .. } => (m.len(), v.len()),
    };
    check_len("exp_avg (m)", m_len, layout)
        .and_then(|_| check_len("exp_avg_sq (v)", v_len, layout))
        .with_context(|| format!("loading {}", dir.join(OPTIMIZER_FILE).display()))?;
    let blocks = 0..layout.block_offsets(QBLOCK).1;
    load_trainer_state_by(dir, (layout, layout), format, |copy| {
        copy(0..layout.total, blocks, moments)
    })
}

/// What [`load_trainer_state_by`] lends: copies the moments of parameters `elems` (whole
/// tensors) and, for int8 state, their 8-bit blocks `blocks`, into `dst`.
pub type CopyMoments<'a> = dyn FnMut(Range<usize>, Range<usize>, MomentsMut<'_>) -> Result<()> + 'a;

/// [`load_trainer_state`] range by range, without a host copy of all the moments: reads and
/// checks the trainer state and the moments file (before `fill` runs), then lends `fill`
/// the copier, which it calls for the ranges it holds (e.g. one parameter group's moments
/// at a time), in `format`. The model the state records must be `model`'s: the trained
/// `layout`'s, or the frozen base of a LoRA run's adapters.
pub fn load_trainer_state_by(
    dir: &Path,
    (layout, model): (&ParamLayout, &ParamLayout),
    format: OptimState,
    fill: impl FnOnce(&mut CopyMoments<'_>) -> Result<()>,
) -> Result<TrainerState> {
    let state_path = dir.join(STATE_FILE);
    let state = TrainerState::read(&state_path)?;
    state.check_layout(&state_path, model)?;
    let file = open_in(dir, OPTIMIZER_FILE)?;
    let what = || {
        format!(
            "loading {format} optimizer moments for a {} with {}",
            layout.family.model_type(),
            describe(layout)
        )
    };
    // A tensor-parallel part or a pipeline stage reads its runs of the whole model's flat
    // arrays; 8-bit moments' blocks are the whole tensors' (a part's too: it numbers its
    // whole tensor's blocks, `ParamLayout::block_offsets`).
    let (total, n_blocks) = (layout.total, layout.block_offsets(QBLOCK).1);
    let (whole_total, whole_blocks) = (layout.whole_total(), layout.whole_blocks(QBLOCK));
    let src = Sources::single(&file);
    let mut targets = Vec::new();
    let located = match format {
        OptimState::F32 => {
            for (prefix, buf) in [(EXP_AVG, 0), (EXP_AVG_SQ, 1)] {
                targets.extend(Target::whole_tensors(layout, prefix, buf));
            }
            // Another pipeline stage's moments are its own to load.
            let resolve = |name: &str| match [EXP_AVG_SQ, EXP_AVG]
                .iter()
                .find_map(|p| name.strip_prefix(p))
            {
                Some(t) if is_absent(layout, t) => Resolved::Ignore,
                _ => resolve_exact(name),
            };
            check_targets(&src, &resolve, &targets).with_context(what)?
        }
        OptimState::Bf16 => {
            check_raw(&file, FLAT_EXP_AVG, Dtype::BF16, whole_total)
                .and_then(|_| check_raw(&file, FLAT_EXP_AVG_SQ, Dtype::BF16, whole_total))
                .with_context(what)?;
            Default::default()
        }
        OptimState::Int8 => {
            let (m_absmax, v_absmax) = (
                format!("{FLAT_EXP_AVG}{ABSMAX}"),
                format!("{FLAT_EXP_AVG_SQ}{ABSMAX}"),
            );
            check_raw(&file, FLAT_EXP_AVG, Dtype::I8, whole_total)
                .and_then(|_| check_raw(&file, FLAT_EXP_AVG_SQ, Dtype::U8, whole_total))
                .and_then(|_| check_raw(&file, &m_absmax, Dtype::F32, whole_blocks))
                .and_then(|_| check_raw(&file, &v_absmax, Dtype::F32, whole_blocks))
                .with_context(what)?;
            Default::default()
        }
    };
    let f32s = |dst: &mut [f32], b: &[u8]| {
        for (d, c) in dst.iter_mut().zip(b.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    };
    let mut copy = |elems: Range<usize>, blocks: Range<usize>, dst: MomentsMut| -> Result<()> {
        if dst.format() != format || elems.end > total || blocks.end > n_blocks {
            bail!("internal error: moments {elems:?} (blocks {blocks:?}) of another layout");
        }
        match dst {
            MomentsMut::F32 { m, v } => {
                let within = targets_within(&targets, &elems)?;
                let copied = copy_targets(&src, &located, &within, &mut [m, v]);
                file.release_all();
                copied
            }
            MomentsMut::Bf16 { m, v } => {
                let bf16s = |dst: &mut [half::bf16], b: &[u8]| {
                    for (d, c) in dst.iter_mut().zip(b.chunks_exact(2)) {
                        *d = half::bf16::from_le_bytes([c[0], c[1]]);
                    }
                };
                if m.len() != elems.len() || v.len() != elems.len() {
                    bail!("internal error: bf16 moments of {elems:?} into other lengths");
                }
                // The elements' runs of the flat arrays (one, unless this is a part).
                for (w, r) in layout.whole_runs(elems.clone()) {
                    let (whole, at) = (w..w + r.len(), r.start - elems.start..r.end - elems.start);
                    for (name, dst) in [(FLAT_EXP_AVG, &mut *m), (FLAT_EXP_AVG_SQ, &mut *v)] {
                        let dst = &mut dst[at.clone()];
                        read_part(&file, name, 2, &whole, dst.len(), |b| bf16s(dst, b))?;
                        check_finite(&file, name, &whole, dst.iter().map(|x| x.to_f32()))?;
                    }
                }
                Ok(())
            }
            MomentsMut::Int8 {
                m,
                m_absmax,
                v,
                v_absmax,
            } => {
                if m.len() != elems.len() || m_absmax.len() != blocks.len() {
                    bail!("internal error: 8-bit moments of {elems:?} into other lengths");
                }
                // The codes' and the scales' runs of the flat arrays (one each, unless this
                // is a stage).
                for (w, r) in layout.whole_runs(elems.clone()) {
                    let (whole, at) = (w..w + r.len(), r.start - elems.start..r.end - elems.start);
                    let dst = &mut m[at.clone()];
                    read_part(&file, FLAT_EXP_AVG, 1, &whole, dst.len(), |b| {
                        for (d, &x) in dst.iter_mut().zip(b) {
                            *d = x as i8;
                        }
                    })?;
                    let dst = &mut v[at];
                    read_part(&file, FLAT_EXP_AVG_SQ, 1, &whole, dst.len(), |b| {
                        dst.copy_from_slice(b)
                    })?;
                }
                for (w, r) in layout.whole_block_runs(blocks.clone(), QBLOCK) {
                    let whole = w..w + r.len();
                    let at = r.start - blocks.start..r.end - blocks.start;
                    for (name, dst) in [
                        (FLAT_EXP_AVG, &mut *m_absmax),
                        (FLAT_EXP_AVG_SQ, &mut *v_absmax),
                    ] {
                        let (name, dst) = (format!("{name}{ABSMAX}"), &mut dst[at.clone()]);
                        read_part(&file, &name, 4, &whole, dst.len(), |b| f32s(dst, b))?;
                        check_finite(&file, &name, &whole, dst.iter().copied())?;
                    }
                }
                Ok(())
            }
        }
        .with_context(what)
    };
    fill(&mut copy)?;
    file.release_all();
    Ok(state)
}

/// Checks that flat tensor `name` is `dtype` of shape `[len]`; errors name the file and the
/// tensor.
fn check_raw(file: &StFile, name: &str, dtype: Dtype, len: usize) -> Result<()> {
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
    Ok(())
}

/// Refuses NaN or infinite values just read into elements `range` of flat tensor `name`,
/// naming the first, the tensor and the file.
fn check_finite(
    file: &StFile,
    name: &str,
    range: &Range<usize>,
    values: impl Iterator<Item = f32>,
) -> Result<()> {
    let mut bad = values.enumerate().filter(|(_, x)| !x.is_finite());
    let Some((i, x)) = bad.next() else {
        return Ok(());
    };
    let more = bad.count();
    bail!(
        "{}: tensor {name}: element {} is {x}{}: NaN or infinite optimizer state cannot be \
         resumed (the file is corrupt, or a diverged run saved it); resume from an earlier \
         checkpoint",
        file.path.display(),
        range.start + i,
        if more > 0 {
            format!(" ({} non-finite values in all)", more + 1)
        } else {
            String::new()
        }
    )
}

/// Hands the bytes of elements `range` (each `width` bytes) of flat tensor `name` (checked
/// by [`check_raw`]) to `copy`, whose destination holds `dst_len` elements.
fn read_part(
    file: &StFile,
    name: &str,
    width: usize,
    range: &Range<usize>,
    dst_len: usize,
    copy: impl FnOnce(&[u8]),
) -> Result<()> {
    if range.len() != dst_len {
        bail!("internal error: {dst_len} elements for {name} {range:?}");
    }
    let info = file
        .info(name)
        .with_context(|| format!("internal error: {name} was not checked"))?;
    let bytes = file.bytes(name, info)?;
    let read = range.start * width..range.end * width;
    copy(&bytes[read.clone()]);
    file.release_within(info, read);
    Ok(())
}

/// A `step-N` directory under `RUN_DIR/checkpoints`, complete or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointDir {
    pub step: u64,
    pub path: PathBuf,
    /// What it lacks to be loadable (files missing or empty); empty when complete.
    pub missing: Vec<String>,
}

impl CheckpointDir {
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty()
    }
}

/// Every `step-N` directory under `RUN_DIR/checkpoints`, oldest first, each with what it
/// lacks: one of [`CHECKPOINT_FILES`] (or, for a LoRA run's, of
/// [`ADAPTER_CHECKPOINT_FILES`]) missing or empty, or the weights (no `model.safetensors`,
/// or no index, or a shard the index names missing or empty). Temporary (`*.tmp-*`) and other
/// entries are not listed. No `checkpoints/` is no checkpoint.
pub fn checkpoint_dirs(run_dir: &Path) -> Result<Vec<CheckpointDir>> {
    let root = RunDir::new(run_dir).checkpoints();
    let entries = match fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", root.display())),
    };
    let mut found = Vec::new();
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
        // A LoRA run's checkpoint holds the adapter in place of the model.
        let adapter = [ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE]
            .iter()
            .any(|f| path.join(f).exists());
        let required: &[&str] = match adapter {
            true => &ADAPTER_CHECKPOINT_FILES,
            false => &CHECKPOINT_FILES,
        };
        let mut missing: Vec<String> = required
            .iter()
            .filter(|f| !fs::metadata(path.join(f)).is_ok_and(|m| m.is_file() && m.len() > 0))
            .map(|f| f.to_string())
            .collect();
        if !adapter {
            missing.extend(weights_missing(&path));
        }
        found.push(CheckpointDir {
            step,
            path,
            missing,
        });
    }
    found.sort_by_key(|c| c.step);
    Ok(found)
}

/// What a user can do when checkpoint `ck` of `run_dir` (a complete one, by its files)
/// cannot be loaded: resume from the newest complete checkpoint before it, once `ck` is moved
/// aside; or, when there is none, that there is none.
pub fn unloadable_checkpoint_hint(run_dir: &Path, ck: &Path) -> String {
    let step = ck
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(checkpoint_step);
    let older = checkpoint_dirs(run_dir).ok().and_then(|dirs| {
        dirs.into_iter()
            .rfind(|d| d.is_complete() && step.is_some_and(|s| d.step < s))
    });
    match older {
        Some(d) => format!(
            "checkpoint {} cannot be loaded; if it is damaged, move it out of {} and resume \
             again: the run then continues from {}",
            ck.display(),
            RunDir::new(run_dir).checkpoints().display(),
            d.path.display()
        ),
        None => format!(
            "checkpoint {} cannot be loaded, and the run has no earlier complete checkpoint",
            ck.display()
        ),
    }
}

/// The newest complete checkpoint under `RUN_DIR/checkpoints`, or `None` if there is none.
/// Ignores temporary (`*.tmp-*`) and other non-`step-N` entries silently, and incomplete
/// `step-N` directories ([`checkpoint_dirs`]) with a warning on stderr.
pub fn latest_checkpoint(run_dir: &Path) -> Result<Option<PathBuf>> {
    let mut best = None;
    for dir in checkpoint_dirs(run_dir)? {
        if dir.is_complete() {
            best = Some(dir.path);
        } else {
            eprintln!(
                "memwall: warning: ignoring incomplete checkpoint {} (missing or empty: {})",
                dir.path.display(),
                dir.missing.join(", ")
            );
        }
    }
    Ok(best)
}
