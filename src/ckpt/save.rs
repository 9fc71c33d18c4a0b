//! Saving: whole checkpoints (atomic as a directory) and model-only exports (atomic per file).

use anyhow::{Context, Result, bail};
use std::fs;
use std::path::{Path, PathBuf};

use super::atomic::TempDir;
use super::moments::Moments;
use super::names::{ABSMAX, EXP_AVG, EXP_AVG_SQ, FLAT_EXP_AVG, FLAT_EXP_AVG_SQ};
use super::safetensors_io::{OutData, OutTensor, write_safetensors};
use super::{CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, TrainerState};
use crate::model::{ModelSpec, ParamLayout};
use crate::run_dir::RunDir;
use crate::util::atomic::{self, parent_dir, sync_dir, write_synced};

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

/// Writes `RUN_DIR/checkpoints/step-{step:06}/` with `config.json`, `model.safetensors`,
/// `optimizer.safetensors` (the moments in their stored format) and `trainer_state.json`
/// (step = `state.step`).
///
/// Atomic: written into a temporary sibling directory, each file fsynced, the directory
/// fsynced, renamed into place (replacing a checkpoint of the same step), the parent fsynced.
/// On error the temporary directory is removed, earlier checkpoints are untouched, and the
/// error names the path. Tensors stream from the slices; no buffer is copied.
pub fn save_checkpoint(
    run_dir: &Path,
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &[f32],
    moments: &Moments,
    state: &TrainerState,
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
        write_synced(&tmp.path.join(MODEL_FILE), |f| write_safetensors(f, &model))?;
        let moments = optimizer_tensors(layout, moments);
        write_synced(&tmp.path.join(OPTIMIZER_FILE), |f| {
            write_safetensors(f, &moments)
        })?;
        let st = json_bytes(state)?;
        write_synced(&tmp.path.join(STATE_FILE), |f| {
            Ok(std::io::Write::write_all(f, &st)?)
        })?;
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

/// Writes a model-only export into `dir` (created if needed): `config.json` and
/// `model.safetensors`, each atomically (temporary file, fsync, rename, fsync the directory).
pub fn save_model(
    dir: &Path,
    spec: &ModelSpec,
    layout: &ParamLayout,
    params: &[f32],
) -> Result<()> {
    let what = || format!("saving model to {}", dir.display());
    check_buffers(spec, layout, &[("parameter", params.len())]).with_context(what)?;
    fs::create_dir_all(dir)
        .with_context(|| format!("cannot create directory {}", dir.display()))?;
    let model = model_tensors(layout, params);
    atomic::write_with(&dir.join(MODEL_FILE), |f| write_safetensors(f, &model))
        .with_context(what)?;
    atomic::write_file(&dir.join(CONFIG_FILE), &json_bytes(&spec.to_hf_config())?)
        .with_context(what)?;
    Ok(())
}
