//! What to train: a model's dimensions ([`ModelSpec`]), its family ([`Family`], the seam
//! behind which each architecture lives in one module: [`gpt2`], [`llama`] (with Qwen2, Qwen3,
//! Mistral and Phi-3), [`gemma3`] (its configs; its blocks are [`llama`]'s)) and its parameter
//! inventory ([`ParamLayout`]) with Hugging Face tensor names and layouts. Around the
//! families: [`spec`] (presets, `config.json` dispatched on `model_type`, validation naming the
//! field), [`params`], [`lora`] (the adapters' layout and PEFT's files), [`rope`] (the
//! `inv_freq` table as transformers computes it), and the emission every family shares
//! (`block_emit`: a block's stages, recomputation and backward; `lm_head`: the chunked head
//! and loss, and the generation head; `tensor_join`: where the tensor ranks' parts meet,
//! with or without sequence parallelism).
//!
//! **Invariant:** a family is one module. Adding one is a module under `model/` (inventory,
//! initialisation, config, naming, emission), its arms in [`family`], and the ops its layers
//! need; no edit to packing, the executor or the checkpoint writer. Everything downstream
//! reads only [`ParamLayout`] and the ops, never a family.

pub(crate) mod block_emit;
pub(crate) mod embedding;
pub mod family;
pub mod gemma3;
pub mod gpt2;
pub mod llama;
pub(crate) mod lm_head;
pub mod lora;
pub mod params;
pub mod rope;
pub mod spec;
pub(crate) mod tensor_join;

pub use params::{Init, ParamGroup, ParamInit, ParamLayout, ParamTensor, TensorPart, TiedName};
pub use spec::{Biases, Family, ModelSpec, Norm, Position, RopeScaling, SpecialTokens};

impl ParamLayout {
    /// The parameter inventory of `spec`, by its family.
    pub fn new(spec: &ModelSpec) -> ParamLayout {
        spec.family.layout(spec, crate::ir::ModelPart::WHOLE)
    }

    /// A rank's part of `spec`'s inventory: its tensor share of its pipeline stage's
    /// tensors, `spec` having been checked for both.
    pub fn part(spec: &ModelSpec, part: crate::ir::ModelPart) -> ParamLayout {
        spec.family.layout(spec, part)
    }
}

impl ModelSpec {
    /// Total number of parameters (a tied LM head counted once).
    pub fn num_params(&self) -> usize {
        ParamLayout::new(self).total
    }
}
