//! `memwall plan`'s request, resolved as `train` resolves its own: the model (a GGUF file is
//! planned as its conversion, converted once into the user cache), the rank count within the
//! planner's limit, the frozen base kept as a run from that file would keep it
//! ([`super::base::base_storage`]), then the step ([`resolve_step`]).

use super::base::base_storage;
use super::request::{DEFAULT_MODEL, StepRequest};
use super::step::{Frozen, Resolved, resolve_step};
use crate::model::ModelSpec;
use anyhow::Result;
use std::path::Path;

/// What `plan` plans: the model and the resolved step.
pub struct PlanTarget {
    pub spec: ModelSpec,
    pub resolved: Resolved,
}

/// Resolves `plan`'s request `req` for `ranks` processes on `threads` workers, with the
/// process's `baseline` and the micro-batch `default_batch` where none is asked. A GGUF
/// file's conversion says what it does to `say` when it does it.
pub fn plan_target(
    req: &StepRequest,
    ranks: usize,
    threads: usize,
    baseline: u64,
    default_batch: usize,
    say: &mut dyn FnMut(&str),
) -> Result<PlanTarget> {
    crate::plan::build::check_ranks(ranks)?;
    let model = Path::new(req.model.as_deref().unwrap_or(DEFAULT_MODEL));
    let named_gguf = model
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let gguf = crate::util::sniff::is_gguf(model);
    let spec = match gguf || named_gguf {
        true => {
            let dir = crate::gguf::cache::model_dir(model, "--model", say)?;
            ModelSpec::resolve(&dir.to_string_lossy())?
        }
        false => ModelSpec::resolve(&model.to_string_lossy())?,
    };
    let mut notes = Vec::new();
    let teacher = match &req.distill_from {
        Some(path) => {
            let dir = crate::gguf::cache::model_dir(path, "--distill-from", say)?;
            let alpha = req
                .distill_alpha
                .unwrap_or(super::train::DEFAULT_DISTILL_ALPHA);
            let seq = req.seq.unwrap_or(super::request::DEFAULT_SEQ);
            let at = (seq, threads, req.device);
            let gguf = crate::util::sniff::is_gguf(path).then_some(path.as_path());
            Some(crate::exec::teacher::distill(
                (&dir, gguf),
                &spec,
                alpha,
                at,
            )?)
        }
        None => None,
    };
    let frozen = Frozen {
        teacher,
        lora: None,
        base: Some(base_storage(
            gguf.then_some(model),
            spec.family,
            req.strategy.lora.is_some(),
            req.strategy.base_quant,
            "--model",
            &mut notes,
        )?),
    };
    let mut resolved = resolve_step(req, &spec, threads, baseline, default_batch, ranks, &frozen)?;
    notes.append(&mut resolved.notes);
    resolved.notes = notes;
    Ok(PlanTarget { spec, resolved })
}
