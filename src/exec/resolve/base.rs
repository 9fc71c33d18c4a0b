//! How a LoRA plan keeps its frozen base, decided once for `train` and `plan`: as asked
//! (`--base-quant`); else, from a GGUF model, the file's own blocks (`keep`; the plan stores
//! the parts of a fused projection whose types differ as q8_0, `plan::lora::unify_storage`),
//! or fp32 for GPT-2 (whose Conv1D layers a quantized base does not keep yet); else fp32.

use crate::ir::{BaseQuant, BaseTypes};
use crate::model::Family;
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::sync::Arc;

/// Each base tensor's storage type, by name, as a GGUF file keeps it.
pub type Kept = Arc<BaseTypes>;

/// The base storage of a plan of a `family` model read from `gguf` (when it is a GGUF file,
/// which `flag` names: `--init` or `--model`), with adapters or not (`lora`), given
/// `--base-quant asked` or not; with `keep`, each tensor's storage read from the file. A note
/// for the user goes to `notes` (re-quantizing a GGUF's blocks).
pub fn base_storage(
    gguf: Option<&Path>,
    family: Family,
    lora: bool,
    asked: Option<BaseQuant>,
    flag: &str,
    notes: &mut Vec<String>,
) -> Result<(BaseQuant, Option<Kept>)> {
    if let Some(q) = asked {
        if let (BaseQuant::Blocks(ty), Some(gguf)) = (q, gguf) {
            notes.push(format!(
                "memwall: note: --base-quant {q} quantizes the weights of {} again (its blocks \
                 decoded, then rounded to {ty}: a second rounding, and no better than the \
                 file's own); --base-quant keep, the default for a GGUF {flag}, keeps its blocks",
                gguf.display()
            ));
        }
        return Ok((q, kept_types(gguf, q, flag)?));
    }
    if !lora || gguf.is_none() || family == Family::Gpt2 {
        return Ok((BaseQuant::F32, None));
    }
    Ok((BaseQuant::Keep, kept_types(gguf, BaseQuant::Keep, flag)?))
}

/// With `--base-quant keep`, each base tensor's storage, read from `gguf` (a new run's
/// `--init`, a resumed run's again, or `plan`'s `--model`); refused without one, naming
/// `flag`.
pub fn kept_types(gguf: Option<&Path>, quant: BaseQuant, flag: &str) -> Result<Option<Kept>> {
    if quant != BaseQuant::Keep {
        return Ok(None);
    }
    let Some(gguf) = gguf else {
        bail!(
            "--base-quant keep takes the blocks of a GGUF {flag}; give a GGUF file to {flag}, or \
             --base-quant q8_0|q4_0|q4_1 to quantize this base"
        );
    };
    let types = crate::gguf::base::BaseSource::open(gguf)
        .with_context(|| format!("{flag} {} (--base-quant keep)", gguf.display()))?
        .types();
    Ok(Some(Arc::new(types)))
}
