//! How `prune` holds the models it runs: the original while it is scored, each candidate
//! shape while its calibration loss is measured ([`super::select`]). Each runs as `sample`
//! runs a model (a generation plan of one sequence), its weights in f32 or, as QLoRA holds
//! a base, as ggml blocks: `--base-quant`, a GGUF's own blocks by default. So a 7B given as
//! a 4-bit GGUF is scored in about its file's bytes, not 28 GB of f32.
//!
//! A candidate of a model held as blocks is held in q8_0 ([`candidate_storage`]): about
//! 1.1 bytes a weight of the smaller model, against 4 in f32. The values
//! come streamed, a piece of whole rows at a time (from the checkpoint's files, or cut from
//! them by [`super::cut::Cut`]): nothing else holds a model.

use super::cut::{self, Kept, PIECE, Read};
use crate::backend::DeviceId;
use crate::dtype::{DType, GgmlType};
use crate::exec::Executor;
use crate::exec::resolve::base::base_storage;
use crate::gguf::base::BaseSource;
use crate::gguf::quantize::{QUANTIZABLE, quantize};
use crate::ir::{BaseQuant, BaseTypes};
use crate::model::{ModelSpec, ParamLayout, ParamTensor};
use crate::plan::{Mode, Plan, StepConfig, build_plan};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// How a model's weights are held: f32, one block type, or each tensor's own
/// (`BaseQuant::Keep` with `types`).
#[derive(Clone, Debug)]
pub struct Storage {
    pub quant: BaseQuant,
    pub types: Option<Arc<BaseTypes>>,
}

impl Storage {
    /// What the summary says of it.
    pub fn describe(&self, gguf: Option<&Path>) -> String {
        match (self.quant, gguf) {
            (BaseQuant::F32, _) => "f32".into(),
            (BaseQuant::Blocks(ty), _) => format!("{} blocks", ty.name.to_ascii_lowercase()),
            (BaseQuant::Keep, Some(f)) => format!("the blocks of {}", f.display()),
            (BaseQuant::Keep, None) => "blocks of each tensor's own type".into(),
        }
    }

    /// The blocks tensor `name` is held as (`None`: f32).
    pub fn type_of(&self, name: &str) -> Option<GgmlType> {
        match (self.quant, &self.types) {
            (BaseQuant::Keep, Some(types)) => types.get(name).copied(),
            (BaseQuant::Blocks(ty), _) => Some(ty),
            _ => None,
        }
        .filter(|&ty| ty != GgmlType::F32)
    }
}

/// How the original is held while scored: as `asked` (`--base-quant`), else a GGUF
/// `gguf`'s own blocks, else f32, unless its f32 plan (`seq` tokens, `at`) is more than the
/// memory available now (`available`), then q8_0 blocks ([`too_big_for_f32`]). Notes for
/// the user (a GGUF quantized again, f32 given up) go to `notes`.
pub fn original_storage(
    spec: &ModelSpec,
    (gguf, asked): (Option<&Path>, Option<BaseQuant>),
    (seq, at): (usize, (usize, DeviceId)),
    available: Option<u64>,
    notes: &mut Vec<String>,
) -> Result<Storage> {
    let (quant, types) = base_storage(gguf, spec.family, true, asked, "--model", notes)?;
    let storage = Storage { quant, types };
    if asked.is_some() || quant != BaseQuant::F32 {
        return Ok(storage);
    }
    let bytes = plan(spec, seq, &storage, at)?.total_bytes();
    match too_big_for_f32(bytes, available) {
        Some(note) => {
            notes.push(note);
            Ok(Storage {
                quant: BaseQuant::Blocks(GgmlType::Q8_0),
                types: None,
            })
        }
        None => Ok(storage),
    }
}

/// Where an f32 scoring plan of `bytes` is more than the `available` memory: what the user
/// is told as the model is held in q8_0 blocks instead.
pub fn too_big_for_f32(bytes: u64, available: Option<u64>) -> Option<String> {
    let available = available?;
    (bytes > available).then(|| {
        format!(
            "memwall: note: holding --model in fp32 takes {}, and {} is available: it is held \
             as q8_0 blocks (about 1.1 bytes a weight; give --base-quant fp32 to insist)",
            crate::util::bytes::fmt_bytes(bytes),
            crate::util::bytes::fmt_bytes(available)
        )
    })
}

/// Hands tensor `t`'s values to `put`, as pieces of whole rows in order.
pub type Values<'a> =
    dyn FnMut(&ParamTensor, &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()> + 'a;

/// Tensor `t`'s values read by `read` (the model's own layout), a piece of whole rows at a
/// time (at most [`PIECE`] values, or one row where a row is longer).
pub fn rows(
    t: &ParamTensor,
    read: &mut Read<'_>,
    put: &mut dyn FnMut(&[f32]) -> Result<()>,
) -> Result<()> {
    let width = t.shape.get(1).copied().unwrap_or(t.range.len()).max(1);
    let per = (PIECE / width).max(1) * width;
    let mut piece = vec![0f32; per.min(t.range.len())];
    for lo in t.range.clone().step_by(per) {
        let r = lo..(lo + per).min(t.range.end);
        let p = &mut piece[..r.len()];
        read(r, p)?;
        put(p)?;
    }
    Ok(())
}

/// The generation plan of `spec` over sequences of `seq` tokens, its weights held as
/// `storage`.
pub fn plan(
    spec: &ModelSpec,
    seq: usize,
    storage: &Storage,
    (threads, device): (usize, DeviceId),
) -> Result<Plan> {
    let mut cfg = StepConfig::new(1, seq, threads);
    cfg.base_quant = storage.quant;
    cfg.base_types = storage.types.clone();
    build_plan(spec, &cfg, Mode::Generate, device.sizing())
}

/// Runs `plan` on `device`, its weights copied from `gguf` (a plan keeping that file's
/// blocks) or filled from `values` (quantized where the plan keeps blocks).
pub fn open(
    plan: Plan,
    device: DeviceId,
    gguf: Option<&BaseSource>,
    values: &mut Values<'_>,
) -> Result<Executor> {
    let layout = plan.layout.clone();
    let kept = plan.lora.is_some();
    let mut ex = Executor::on(plan, device.open()?)?;
    match (kept, gguf) {
        (false, _) => ex.with_params_mut(|p| -> Result<()> {
            for t in &layout.tensors {
                let mut at = t.range.start;
                values(t, &mut |piece| {
                    p[at..at + piece.len()].copy_from_slice(piece);
                    at += piece.len();
                    Ok(())
                })?;
            }
            Ok(())
        })??,
        (true, Some(src)) => ex.fill_base_bytes(|t, storage, dst| src.copy(t, storage, dst))?,
        (true, None) => ex.fill_base_bytes(|t, storage, dst| fill(t, storage, dst, values))?,
    }
    Ok(ex)
}

/// Fills tensor `t`'s bytes `dst` (f32, or blocks of `storage`) from `values`.
pub fn fill(
    t: &ParamTensor,
    storage: Option<GgmlType>,
    dst: &mut [u8],
    values: &mut Values<'_>,
) -> Result<()> {
    let mut at = 0usize;
    values(t, &mut |piece| {
        let end = at + piece.len();
        match storage {
            None => {
                let bytes = &mut dst[at * 4..end * 4];
                for (d, v) in bytes.chunks_exact_mut(4).zip(piece) {
                    d.copy_from_slice(&v.to_ne_bytes());
                }
            }
            Some(ty) => {
                let (Some(a), Some(b)) = (ty.bytes_for(at as u64), ty.bytes_for(end as u64)) else {
                    bail!(
                        "internal error: {} values {at}..{end} are not whole {ty} blocks",
                        t.name
                    );
                };
                quantize(ty, piece, &mut dst[a as usize..b as usize])
                    .with_context(|| format!("quantizing {} to {ty}", t.name))?;
            }
        }
        at = end;
        Ok(())
    })
}

/// Each tensor's storage in `plan` by its name, where the plan keeps its weights as a base
/// (`None`: all f32).
pub fn storage_of(plan: &Plan) -> Option<BTreeMap<String, DType>> {
    let (lora, base) = (plan.lora.as_ref()?, plan.schedule.implicit.base.as_ref()?);
    let mut out = BTreeMap::new();
    for t in &lora.base.tensors {
        if let Some(s) = base.find(&t.range) {
            out.insert(t.name.clone(), plan.buffer(s.buf).dtype);
        }
    }
    Some(out)
}

/// How a candidate of `new_spec` cut by `kept` from a model held as `original`
/// ([`storage_of`]) is held: f32 where the original is; else each matrix in q8_0 where it
/// is cut from one of at most q8_0's bits a weight, or as that tensor's type (16-bit ones),
/// or the smallest type of at least as many bits whose blocks its rows hold whole, or f32.
///
/// Not in the original's 4-bit type: a cut row is quantized again, and rounding it twice
/// would cost the candidates that cut the embedding's channels (whose every row is cut)
/// more than those that cut MLP channels only. On SmolLM2-135M (Q4_1) q8_0 candidates'
/// losses are within 0.001 of f32 ones; Q4_1 ones were 0.08 to 0.2 higher, unevenly.
pub fn candidate_storage(
    original: Option<&BTreeMap<String, DType>>,
    new_spec: &ModelSpec,
    kept: &Kept,
) -> Result<Storage> {
    let Some(original) = original else {
        return Ok(Storage {
            quant: BaseQuant::F32,
            types: None,
        });
    };
    let mut types = BaseTypes::new();
    for t in ParamLayout::new(new_spec).tensors {
        let [_, cols] = t.shape[..] else { continue };
        let (_, name) = cut::original_name(&t.name, kept);
        let Some(&dtype) = original.get(&name) else {
            bail!("internal error: the held model has no {name}");
        };
        types.insert(t.name, held_type(dtype, cols));
    }
    Ok(Storage {
        quant: BaseQuant::Keep,
        types: Some(Arc::new(types)),
    })
}

/// The type a matrix of rows of `cols` values is held as, cut from one held as `original`.
fn held_type(original: DType, cols: usize) -> GgmlType {
    let DType::Ggml(ty) = original else {
        return GgmlType::F32;
    };
    let fits =
        |t: GgmlType| cols.is_multiple_of(t.block_size as usize) && QUANTIZABLE.contains(&t.name);
    let bits = |t: GgmlType| t.type_size as f64 * 8.0 / t.block_size as f64;
    use GgmlType as G;
    if fits(G::Q8_0) && bits(ty) <= bits(G::Q8_0) {
        return G::Q8_0;
    }
    if fits(ty) {
        return ty;
    }
    [
        G::Q4_0,
        G::Q4_K,
        G::Q4_1,
        G::Q5_0,
        G::Q6_K,
        G::Q8_0,
        G::BF16,
    ]
    .into_iter()
    .filter(|&t| fits(t) && bits(t) >= bits(ty))
    .min_by(|&a, &b| bits(a).total_cmp(&bits(b)))
    .unwrap_or(G::F32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_is_held_in_f32_only_where_the_memory_available_holds_it() {
        assert!(too_big_for_f32(100, Some(100)).is_none());
        assert!(too_big_for_f32(100, None).is_none());
        let note = too_big_for_f32(3 << 30, Some(1 << 30)).unwrap();
        assert!(
            note.contains("3.00 GiB") && note.contains("--base-quant fp32") && !note.contains("  "),
            "{note}"
        );
    }

    #[test]
    fn a_candidate_is_held_in_q8_0_or_as_wide_as_its_original() {
        let q = |t: GgmlType| DType::Ggml(t);
        use GgmlType as G;
        assert_eq!(held_type(DType::F32, 64), G::F32);
        // Up to q8_0's bits: q8_0, where the rows are whole blocks of 32.
        assert_eq!(held_type(q(G::Q4_K), 512), G::Q8_0);
        assert_eq!(held_type(q(G::Q6_K), 864), G::Q8_0);
        assert_eq!(held_type(q(G::Q8_0), 38), G::BF16);
        // Wider types: their own, or the nearest as wide.
        assert_eq!(held_type(q(G::BF16), 38), G::BF16);
        assert_eq!(held_type(q(G::F16), 64), G::BF16);
    }
}
