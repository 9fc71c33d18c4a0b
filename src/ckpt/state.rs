//! The trainer state saved next to the weights (`trainer_state.json`): where the run stands,
//! so that resuming continues bitwise where it stopped.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::Path;

use crate::model::{ModelSpec, ParamLayout};

/// Everything besides tensors that a resumed run needs. Written as `trainer_state.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: u64,
    /// Training batches consumed (the loader restarts from here).
    pub data_position: u64,
    /// The run's seed.
    pub seed: u64,
    /// The training RNG's state after `step` steps.
    pub rng_state: u64,
    /// `ModelSpec::to_hf_config()` of the run (dimensions are checked on resume).
    pub model: serde_json::Value,
    /// The run's training configuration (opaque to `ckpt`).
    pub train: serde_json::Value,
    /// `memwall` version that wrote the checkpoint.
    pub memwall_version: String,
    /// Dynamic loss scaling (fp16 runs): the current scale and the clean steps since it last
    /// changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScaleState>,
}

/// The state of dynamic loss scaling.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct LossScaleState {
    pub scale: f32,
    pub clean_steps: u64,
}

impl TrainerState {
    /// The model recorded in the state.
    pub fn model_spec(&self) -> Result<ModelSpec> {
        ModelSpec::from_hf_config_str(&self.model.to_string(), "trainer_state.json field 'model'")
    }

    /// Reads and parses a `trainer_state.json`; errors name the file.
    pub(crate) fn read(path: &Path) -> Result<TrainerState> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| {
            format!(
                "{}: not a valid trainer state (expected JSON with step, data_position, seed, \
                 rng_state, model, train, memwall_version); the checkpoint is corrupt",
                path.display()
            )
        })
    }

    /// Checks that the recorded model has the tensors of `layout` (same names and shapes),
    /// or of the whole model `layout` is a tensor-parallel part of: a checkpoint holds the
    /// whole model, whatever the ranks that wrote it or resume it.
    pub(crate) fn check_layout(&self, path: &Path, layout: &ParamLayout) -> Result<()> {
        let spec = self
            .model_spec()
            .with_context(|| format!("{}", path.display()))?;
        let recorded = ParamLayout::new(&spec);
        let same = recorded.same_model(layout);
        if !same {
            bail!(
                "{}: the checkpoint was written by a run of a different model ({}) than this one \
                 ({}); resume with the same --model",
                path.display(),
                layout_summary(&recorded),
                layout_summary(layout)
            );
        }
        Ok(())
    }
}

/// One-line description of a layout's model for messages, e.g. `gpt2: 14 parameter groups,
/// 148 tensors, 124439808 parameters (transformer.wte.weight [50257, 768], ...)`: the whole
/// model's, for a tensor-parallel part too (which is named after it, with its own count).
pub(crate) fn layout_summary(layout: &crate::model::ParamLayout) -> String {
    let first: Vec<String> = layout
        .tensors
        .iter()
        .take(2)
        .map(|t| format!("{} {:?}", t.name, t.whole_shape()))
        .collect();
    let split = &layout.split;
    let part = match split.is_split() {
        true => format!(
            "; tensor-parallel part {} of {}: {} parameters",
            split.rank + 1,
            split.size,
            layout.total
        ),
        false => String::new(),
    };
    format!(
        "{}: {} parameter groups, {} tensors, {} parameters ({}, ...{part})",
        layout.family.model_type(),
        layout.groups.len(),
        layout.tensors.len(),
        layout.whole_total(),
        first.join(", ")
    )
}
