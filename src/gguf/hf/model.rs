//! What [`super`] maps a GGUF model to, shared by its per-architecture mappings: the
//! architectures, the dimensions, the HF tensors and model, and the checked reading of
//! hyper-parameters (each error names the key and the file).

use crate::gguf::file::{GgufFile, TensorInfo, Value};
use anyhow::{Context, Result, bail};

/// The architectures `general.architecture` may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    /// Qwen3 (dense): llama.cpp's `LLM_ARCH_QWEN3`, `qwen2`'s tensors without the permutation
    /// plus `attn_q_norm` / `attn_k_norm` (gguf-py `constants.py`, `MODEL_ARCH.QWEN3`).
    Qwen3,
    /// Phi-3: llama.cpp's `LLM_ARCH_PHI3`, q|k|v fused as `attn_qkv` and gate|up as
    /// `ffn_up` (gate first), NEOX rotation (no permutation), LongRoPE's factors as the
    /// `rope_factors_long` / `rope_factors_short` tensors.
    Phi3,
    /// Gemma 3 (text): llama.cpp's `LLM_ARCH_GEMMA3` (gguf-py `constants.py`,
    /// `MODEL_ARCH.GEMMA3`): q/k norms, `post_attention_norm`, `ffn_norm` (the norm before the
    /// MLP, transformers' `pre_feedforward_layernorm`) and `post_ffw_norm`, no permutation
    /// (NEOX rotation), every norm stored as `1 + w` (`convert_hf_to_gguf.py`,
    /// `Gemma3Model.norm_shift`).
    Gemma3,
    Gpt2,
}

impl Arch {
    /// The `general.architecture` value, also HF's `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Phi3 => "phi3",
            Arch::Gemma3 => "gemma3",
            Arch::Gpt2 => "gpt2",
        }
    }

    /// HF's `model_type` (the architecture's name but for Gemma 3's text model).
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Gemma3 => "gemma3_text",
            a => a.name(),
        }
    }

    /// The transformers class that loads the directory.
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Phi3 => "Phi3ForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
            Arch::Gpt2 => "GPT2LMHeadModel",
        }
    }

    /// Reads `general.architecture`; anything but llama, qwen2, qwen3, phi3, gemma3 and gpt2 is
    /// refused by name.
    pub fn of(f: &GgufFile) -> Result<Arch> {
        let path = f.path().display();
        match f.get_str("general.architecture")? {
            Some("llama") => Ok(Arch::Llama),
            Some("qwen2") => Ok(Arch::Qwen2),
            Some("qwen3") => Ok(Arch::Qwen3),
            Some("phi3") => Ok(Arch::Phi3),
            Some("gemma3") => Ok(Arch::Gemma3),
            Some("gpt2") => Ok(Arch::Gpt2),
            Some(other) => bail!(
                "{path}: architecture {other:?} is not supported (general.architecture must be llama, qwen2, qwen3, phi3, gemma3 or gpt2)"
            ),
            None => bail!("{path}: metadata general.architecture is missing"),
        }
    }
}

/// The model's dimensions, from metadata (and the tensors where metadata is silent).
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub context: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
}

/// One tensor to write: where it comes from and what HF calls it.
#[derive(Clone, Debug, PartialEq)]
pub struct HfTensor {
    /// The GGUF tensor name.
    pub gguf: String,
    /// The HF name.
    pub name: String,
    /// HF shape, outermost first.
    pub shape: Vec<usize>,
    /// `Some(n_head)` for the rows of a `llama` Q or K weight or bias, which must be
    /// un-permuted with that head count.
    pub unpermute_heads: Option<usize>,
    /// A GPT-2 Conv1D weight: GGUF holds it `[out, in]` row-major (dims `[in, out]`), HF
    /// `[in, out]`, so the values are transposed.
    pub transpose: bool,
    /// What the file adds to every value (Gemma 3's norms: llama.cpp's converter stores the
    /// gain `1 + w`); the HF value is the file's minus this.
    pub shift: f32,
}

/// A GGUF model mapped to HF: dimensions, tying, special tokens, tensors in file order.
#[derive(Clone, Debug)]
pub struct HfModel {
    pub arch: Arch,
    pub dims: Dims,
    pub tied: bool,
    pub attention_bias: bool,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    /// HF `rope_scaling`, when the file has linear, llama3 or LongRoPE scaling.
    pub rope_scaling: Option<serde_json::Value>,
    /// `config.json` fields of the architecture's own (Phi-3's window, pretraining context and
    /// pad token; Gemma 3's layer types, window and sliding layers' θ).
    pub extra_config: serde_json::Map<String, serde_json::Value>,
    pub tensors: Vec<HfTensor>,
}

impl HfModel {
    /// Parameters written (a tied head counted once).
    pub fn parameter_count(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum()
    }
}

/// An f32 metadata value as its shortest decimal (so `9.999999747e-6` stored as f32 is
/// written as `1e-5`, the value the model was configured with).
pub(crate) fn get_float(f: &GgufFile, key: &str) -> Result<Option<f64>> {
    Ok(match f.get(key) {
        Some(Value::F32(x)) => Some(x.to_string().parse::<f64>().expect("f32 prints as a float")),
        _ => f.get_f64(key)?,
    })
}

/// Largest dimension (a width, a head count, a context length) taken from metadata: larger
/// values are corrupt, and products of two of them must not overflow.
const MAX_DIM: u64 = u32::MAX as u64;

pub(crate) fn usize_of(v: u64, key: &str, f: &GgufFile) -> Result<usize> {
    if v > MAX_DIM {
        bail!(
            "{}: metadata {key} = {v} is too large (at most {MAX_DIM}): the file is corrupt",
            f.path().display()
        );
    }
    usize::try_from(v)
        .with_context(|| format!("{}: metadata {key} = {v} is too large", f.path().display()))
}

/// The positive integer metadata `key` of `f`; missing or 0 is an error naming the key.
pub(crate) fn required_dim(f: &GgufFile, key: &str) -> Result<usize> {
    let path = f.path().display();
    match f.get_u64(key)? {
        Some(v) if v > 0 => usize_of(v, key, f),
        Some(_) => bail!("{path}: metadata {key} is 0"),
        None => bail!("{path}: metadata {key} is missing"),
    }
}

/// Refuses a float hyper-parameter that is NaN, infinite or not above `min`, naming the key
/// and the file.
pub(crate) fn check_above(f: &GgufFile, key: &str, x: f64, min: f64) -> Result<f64> {
    if !(x.is_finite() && x > min) {
        bail!(
            "{}: metadata {key} is {x}; it must be a finite number above {min} (the file is \
             corrupt or was written wrongly: re-download it, or fix the key with llama.cpp's \
             gguf_set_metadata.py)",
            f.path().display()
        );
    }
    Ok(x)
}

pub(crate) fn check_dims(t: &TensorInfo, expected: &[u64]) -> Result<()> {
    if t.dims != expected {
        bail!(
            "tensor {} has GGUF dims {:?} (innermost first), expected {:?} from the metadata",
            t.name,
            t.dims,
            expected
        );
    }
    Ok(())
}
