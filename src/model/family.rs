//! The model-family seam. A family is one module ([`super::gpt2`]) that knows its
//! architecture: presets, `config.json` reading, writing and validation, the parameter
//! inventory with Hugging Face names, shapes and initialisation, checkpoint naming variants,
//! and the emission of its layers into a step's schedule. [`Family`]'s methods, here,
//! dispatch to it (the enum itself is plain data in [`super::spec`]); the
//! planner's packing, the executor and the checkpoint writer never name a family.

use super::spec::{Family, FieldNames};
use super::{ModelSpec, ParamLayout, gpt2};
use crate::plan::StepConfig;
use crate::plan::builder::{Builder, Emitted, MicroBatch};
use anyhow::Result;
use serde_json::{Map, Value};

impl Family {
    pub const ALL: [Family; 1] = [Family::Gpt2];

    /// Hugging Face's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
        }
    }

    pub fn preset_names(self) -> Vec<&'static str> {
        match self {
            Family::Gpt2 => gpt2::preset_names(),
        }
    }

    pub fn preset(self, name: &str) -> Option<ModelSpec> {
        match self {
            Family::Gpt2 => gpt2::preset(name),
        }
    }

    pub fn field_names(self) -> FieldNames {
        match self {
            Family::Gpt2 => gpt2::FIELDS,
        }
    }

    /// Reads the family's `config.json` fields (`source` names the file in errors).
    pub fn from_hf_config(self, obj: &Map<String, Value>, source: &str) -> Result<ModelSpec> {
        match self {
            Family::Gpt2 => gpt2::from_hf_config(obj, source),
        }
    }

    pub fn to_hf_config(self, spec: &ModelSpec) -> Value {
        match self {
            Family::Gpt2 => gpt2::to_hf_config(spec),
        }
    }

    /// Family-specific checks after the generic ones.
    pub fn validate(self, spec: &ModelSpec) -> Result<()> {
        match self {
            Family::Gpt2 => gpt2::validate(spec),
        }
    }

    /// The parameter inventory.
    pub fn layout(self, spec: &ModelSpec) -> ParamLayout {
        match self {
            Family::Gpt2 => gpt2::layout(spec),
        }
    }

    /// The canonical name of a tensor named `name` in a model file, or `None` for entries that
    /// are not parameters (buffers some versions save, tied duplicates).
    pub fn canonical_name(self, name: &str) -> Option<String> {
        match self {
            Family::Gpt2 => gpt2::canonical_name(name),
        }
    }

    /// Emits the forward, loss and backward of one micro-batch into `g` (training plans), or
    /// the forward and next-token logits (generation plans, `mb.targets` unset).
    pub(crate) fn emit(
        self,
        g: &mut Builder,
        spec: &ModelSpec,
        cfg: &StepConfig,
        mb: &MicroBatch,
    ) -> Emitted {
        match self {
            Family::Gpt2 => gpt2::emit::micro_batch(g, spec, cfg, mb),
        }
    }
}
