//! The model-family seam. A family is one module ([`super::gpt2`], [`super::llama`], which also
//! builds Qwen2, Qwen3, Mistral and Phi-3, and [`super::gemma3`], whose configs and presets
//! are its own and whose blocks [`super::llama`] emits) that knows its
//! architecture: presets, `config.json` reading, writing and validation, the parameter
//! inventory with Hugging Face names, shapes and initialisation, checkpoint naming variants,
//! and the emission of its layers into a step's schedule. [`Family`]'s methods, here,
//! dispatch to it (the enum itself is plain data in [`super::spec`]); the
//! planner's packing, the executor and the checkpoint writer never name a family.

use super::spec::{Family, FieldNames};
use super::{ModelSpec, ParamLayout, gemma3, gpt2, llama};
use crate::ir::builder::{Builder, Emitted, MicroBatch};
use crate::ir::schedule::GluAct;
use crate::ir::{EmitOptions, ModelPart};
use anyhow::Result;
use serde_json::{Map, Value};

impl Family {
    pub const ALL: [Family; 7] = [
        Family::Gpt2,
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::Mistral,
        Family::Phi3,
        Family::Gemma3,
    ];

    /// Hugging Face's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
            Family::Phi3 => "phi3",
            Family::Gemma3 => "gemma3_text",
        }
    }

    /// Whether each query and key head is RMS-normalised before RoPE (Qwen3's and Gemma 3's
    /// `q_norm` and `k_norm`: transformers' `Qwen3Attention`, `Gemma3Attention`; llama.cpp's
    /// `LLM_ARCH_QWEN3`, `LLM_ARCH_GEMMA3`).
    pub fn qk_norm(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Gemma3)
    }

    /// What every RMSNorm's gain adds to its weight: Gemma's 1 (`Gemma3RMSNorm`: `x̂ · (1 +
    /// w)`, weights initialised to 0), 0 elsewhere.
    pub fn norm_offset(self) -> f32 {
        match self {
            Family::Gemma3 => 1.0,
            _ => 0.0,
        }
    }

    /// Whether the attention's and the MLP's outputs are normalised before the residual adds
    /// them (Gemma 3's `post_attention_layernorm` and `post_feedforward_layernorm`).
    pub fn post_norms(self) -> bool {
        matches!(self, Family::Gemma3)
    }

    /// The gated MLP's activation (GPT-2's MLP is not gated).
    pub fn glu_act(self) -> GluAct {
        match self {
            Family::Gemma3 => GluAct::GeluTanh,
            _ => GluAct::Silu,
        }
    }

    /// What the token embedding's rows are multiplied by for a width of `c`: Gemma's √C
    /// (`Gemma3TextScaledWordEmbedding`, in f32), 1 elsewhere.
    pub fn embed_scale(self, c: usize) -> f32 {
        match self {
            Family::Gemma3 => (c as f32).sqrt(),
            _ => 1.0,
        }
    }

    /// Whether q, k and v are one tensor (`qkv_proj`) and gate and up one (`gate_up_proj`) in
    /// the family's checkpoints (Phi-3); memwall's layout keeps them fused in every family.
    pub fn fused_projections(self) -> bool {
        matches!(self, Family::Phi3)
    }

    pub fn preset_names(self) -> Vec<&'static str> {
        match self {
            Family::Gpt2 => gpt2::preset_names(),
            Family::Gemma3 => gemma3::preset_names(),
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Mistral | Family::Phi3 => {
                llama::preset_names(self)
            }
        }
    }

    pub fn preset(self, name: &str) -> Option<ModelSpec> {
        match self {
            Family::Gpt2 => gpt2::preset(name),
            Family::Gemma3 => gemma3::preset(name),
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Mistral | Family::Phi3 => {
                llama::preset(self, name)
            }
        }
    }

    pub fn field_names(self) -> FieldNames {
        match self {
            Family::Gpt2 => gpt2::FIELDS,
            Family::Llama
            | Family::Qwen2
            | Family::Qwen3
            | Family::Mistral
            | Family::Phi3
            | Family::Gemma3 => llama::FIELDS,
        }
    }

    /// The text model's config inside a multimodal config a family ships (Gemma 3's
    /// `gemma3`), or `None` for any other config.
    pub fn text_of_multimodal(
        obj: &Map<String, Value>,
        source: &str,
    ) -> Result<Option<Map<String, Value>>> {
        gemma3::text_of_multimodal(obj, source)
    }

    /// Reads the family's `config.json` fields (`source` names the file in errors).
    pub fn from_hf_config(self, obj: &Map<String, Value>, source: &str) -> Result<ModelSpec> {
        match self {
            Family::Gpt2 => gpt2::from_hf_config(obj, source),
            Family::Gemma3 => gemma3::from_hf_config(obj, source),
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Mistral | Family::Phi3 => {
                llama::from_hf_config(self, obj, source)
            }
        }
    }

    pub fn to_hf_config(self, spec: &ModelSpec) -> Value {
        match self {
            Family::Gpt2 => gpt2::to_hf_config(spec),
            Family::Gemma3 => gemma3::to_hf_config(spec),
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Mistral | Family::Phi3 => {
                llama::to_hf_config(spec)
            }
        }
    }

    /// Family-specific checks after the generic ones.
    pub fn validate(self, spec: &ModelSpec) -> Result<()> {
        match self {
            Family::Gpt2 => gpt2::validate(spec),
            Family::Gemma3 => gemma3::validate(spec),
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Mistral | Family::Phi3 => {
                llama::validate(spec)
            }
        }
    }

    /// The parameter inventory of `part` of the model.
    pub fn layout(self, spec: &ModelSpec, part: ModelPart) -> ParamLayout {
        match self {
            Family::Gpt2 => gpt2::layout(spec, part),
            Family::Llama
            | Family::Qwen2
            | Family::Qwen3
            | Family::Mistral
            | Family::Phi3
            | Family::Gemma3 => llama::layout(spec, part),
        }
    }

    /// The canonical name of a tensor named `name` in a model file, or `None` for entries that
    /// are not parameters (buffers some versions save). Tied names are the layout's
    /// ([`super::TiedName`]).
    pub fn canonical_name(self, name: &str) -> Option<String> {
        match self {
            Family::Gpt2 => gpt2::canonical_name(name),
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Mistral | Family::Phi3 => {
                llama::canonical_name(name)
            }
            Family::Gemma3 => gemma3::canonical_name(name),
        }
    }

    /// Emits the forward, loss and backward of one micro-batch into `g` (training plans), or
    /// the forward and next-token logits (generation plans, `mb.targets` unset).
    pub(crate) fn emit(
        self,
        g: &mut Builder,
        spec: &ModelSpec,
        cfg: &EmitOptions,
        mb: &MicroBatch,
    ) -> Emitted {
        match self {
            Family::Gpt2 => gpt2::emit::micro_batch(g, spec, cfg, mb),
            Family::Llama
            | Family::Qwen2
            | Family::Qwen3
            | Family::Mistral
            | Family::Phi3
            | Family::Gemma3 => llama::emit::micro_batch(g, spec, cfg, mb),
        }
    }
}
