//! GGUF `llama` / `qwen2` / `qwen3` / `phi3` / `gemma3` models as Hugging Face sees them:
//! `config.json` from the `{arch}.*` metadata, HF tensor names and shapes from GGUF's, and the
//! inverse of the Q/K row permutation llama.cpp applies to `llama` files.
//!
//! Names (`N` a layer index):
//!
//! | GGUF                         | Hugging Face                                   |
//! |------------------------------|------------------------------------------------|
//! | `token_embd.weight`          | `model.embed_tokens.weight`                    |
//! | `blk.N.attn_{q,k,v}.{weight,bias}` | `model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}` |
//! | `blk.N.attn_output.{weight,bias}` | `model.layers.N.self_attn.o_proj.{weight,bias}` |
//! | `blk.N.attn_norm.weight`     | `model.layers.N.input_layernorm.weight`        |
//! | `blk.N.ffn_norm.weight`      | `model.layers.N.post_attention_layernorm.weight` |
//! | `blk.N.ffn_{gate,up,down}.weight` | `model.layers.N.mlp.{gate,up,down}_proj.weight` |
//! | `output_norm.weight`         | `model.norm.weight`                            |
//! | `output.weight`              | `lm_head.weight` (absent: the head is tied)    |
//!
//! **Gemma 3** (`gemma3`, gguf-py `constants.py`: `MODEL_ARCH.GEMMA3`'s tensors, named by
//! `TENSOR_NAMES`) has four norms a layer and the q/k norms: `attn_norm` is
//! `input_layernorm`, `post_attention_norm` (`ATTN_POST_NORM`) is `post_attention_layernorm`
//! (Gemma's norm *after* attention), `ffn_norm` (`FFN_PRE_NORM`, the same name as Llama's
//! `FFN_NORM`) is `pre_feedforward_layernorm`, `post_ffw_norm` (`FFN_POST_NORM`) is
//! `post_feedforward_layernorm`, `attn_q_norm` / `attn_k_norm` are `self_attn.q_norm` /
//! `k_norm`. `convert_hf_to_gguf.py`'s `Gemma3Model.modify_tensors` adds `norm_shift` = 1 to
//! every tensor whose HF name ends in `norm.weight` (`Gemma3RMSNorm` computes `x̂ · (1 + w)`,
//! llama.cpp `x̂ · w`), so those come back minus 1 ([`HfTensor::shift`]). Its metadata
//! (`Gemma3Model.set_gguf_parameters` over `TextModel.set_gguf_parameters`) has no layer
//! pattern: llama.cpp's `llama_model::load_hparams` (`LLM_ARCH_GEMMA3`) fixes it,
//! `set_swa_pattern(6)` (layer `l` slides when `l % 6 < 5`), when
//! `gemma3.attention.sliding_window` is there and not 0 (else no layer slides), and rotates
//! the sliding layers with θ 10000 unscaled; the converter writes that θ as
//! `gemma3.rope.freq_base_swa`, read here when present. Attention is scaled by
//! `head_dim^-½` except for 62 layers (llama.cpp's `LLM_TYPE_27B`: `(n_embd / n_head)^-½`),
//! written as `query_pre_attn_scalar`.
//!
//! GGUF lists dimensions innermost first, so a HF `[out, in]` weight has GGUF dims
//! `[in, out]` and the same bytes; the HF shape is the GGUF dims reversed.
//!
//! **Q/K permutation.** llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute`) reorders
//! the rows of `q_proj` (with the head count) and `k_proj` (with the KV head count) so that
//! rotary pairs are adjacent (GGML's interleaved RoPE) instead of half a head apart (HF's
//! rotate-half): `w.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2)`. HF row
//! `h·d + s·d/2 + i` (head `h`, half `s`, index `i`) lands on GGUF row `h·d + 2i + s`;
//! [`unpermute_rows`] moves it back. `qwen2` files are written without the permutation.
//!
//! **Hyper-parameters are checked** where they are read, naming the GGUF key and the file:
//! counts and sizes non-zero and at most 2³² (larger is corruption), the head size even, the
//! RMS epsilon finite and positive, θ finite and above 1, a linear RoPE factor finite and
//! positive. A NaN would otherwise be written to `config.json` as `null` and read back as a
//! default.

pub(crate) mod gpt2;
mod model;

pub use model::{Arch, Dims, HfModel, HfTensor};

use super::file::{GgufFile, TensorInfo};
use super::rope_freqs;
use crate::dtype::GgmlType;
use anyhow::{Context, Result, bail};
use model::{check_above, check_dims, get_float, required_dim, usize_of};
use serde_json::json;

impl HfModel {
    /// `config.json` as transformers' `LlamaConfig` / `Qwen2Config` read it; `torch_dtype`
    /// names the dtype of `model.safetensors` (`float32` or `bfloat16`).
    pub fn config_json(&self, torch_dtype: &str) -> serde_json::Value {
        if self.arch == Arch::Gpt2 {
            return gpt2::config_json(self, torch_dtype);
        }
        let d = &self.dims;
        let mut c = json!({
            "architectures": [self.arch.hf_class()],
            "model_type": self.arch.model_type(),
            "hidden_size": d.hidden,
            "intermediate_size": d.ffn,
            "num_hidden_layers": d.layers,
            "num_attention_heads": d.heads,
            "num_key_value_heads": d.kv_heads,
            "max_position_embeddings": d.context,
            "rms_norm_eps": d.rms_eps,
            "rope_theta": d.rope_theta,
            "rope_scaling": self.rope_scaling,
            "vocab_size": d.vocab,
            "tie_word_embeddings": self.tied,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": torch_dtype,
        });
        // Qwen3Config's head_dim defaults to 128 whatever the width (Gemma3TextConfig's to
        // 256): always written.
        if matches!(self.arch, Arch::Qwen3 | Arch::Gemma3) || d.head_dim * d.heads != d.hidden {
            c["head_dim"] = json!(d.head_dim);
        }
        match self.arch {
            Arch::Llama => c["mlp_bias"] = json!(false),
            Arch::Qwen2 => {
                c["use_sliding_window"] = json!(false);
                c["sliding_window"] = json!(d.context);
                c["max_window_layers"] = json!(d.layers);
            }
            Arch::Qwen3 => c["use_sliding_window"] = json!(false),
            Arch::Phi3 => {}
            Arch::Gemma3 => {
                // GeGLU with the tanh GELU (transformers' `gelu_pytorch_tanh`, llama.cpp's
                // `LLM_FFN_GELU` in `llm_build_gemma3`).
                let o = c.as_object_mut().expect("an object");
                o.remove("hidden_act");
                o.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            }
            Arch::Gpt2 => unreachable!("returned above"),
        }
        for (k, v) in &self.extra_config {
            c[k] = v.clone();
        }
        c
    }
}

/// What one GGUF tensor name is, once parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Embed,
    FinalNorm,
    Head,
    /// Layer, part (q, k, v, o, attn_norm, ffn_norm, gate, up, down), and whether it is a bias.
    Layer(usize, Part, bool),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Q,
    K,
    V,
    O,
    AttnNorm,
    FfnNorm,
    Gate,
    Up,
    Down,
    /// Qwen3's per-head norms.
    QNorm,
    KNorm,
    /// Phi-3's fused q|k|v.
    Qkv,
    /// Gemma 3's norms after attention and after the MLP.
    AttnPostNorm,
    FfnPostNorm,
}

const PARTS: [(&str, Part, &str); 14] = [
    ("attn_qkv", Part::Qkv, "self_attn.qkv_proj"),
    ("attn_q", Part::Q, "self_attn.q_proj"),
    ("attn_k", Part::K, "self_attn.k_proj"),
    ("attn_q_norm", Part::QNorm, "self_attn.q_norm"),
    ("attn_k_norm", Part::KNorm, "self_attn.k_norm"),
    ("attn_v", Part::V, "self_attn.v_proj"),
    ("attn_output", Part::O, "self_attn.o_proj"),
    ("attn_norm", Part::AttnNorm, "input_layernorm"),
    ("ffn_norm", Part::FfnNorm, "post_attention_layernorm"),
    ("ffn_gate", Part::Gate, "mlp.gate_proj"),
    ("ffn_up", Part::Up, "mlp.up_proj"),
    ("ffn_down", Part::Down, "mlp.down_proj"),
    (
        "post_attention_norm",
        Part::AttnPostNorm,
        "post_attention_layernorm",
    ),
    (
        "post_ffw_norm",
        Part::FfnPostNorm,
        "post_feedforward_layernorm",
    ),
];

/// Gemma 3's `ffn_norm`: the norm before the MLP (gguf-py `FFN_PRE_NORM`).
const GEMMA3_FFN_NORM: &str = "pre_feedforward_layernorm";

fn parse_name(name: &str) -> Option<Role> {
    match name {
        "token_embd.weight" => return Some(Role::Embed),
        "output_norm.weight" => return Some(Role::FinalNorm),
        "output.weight" => return Some(Role::Head),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = rest.split_once('.')?;
    let bias = match suffix {
        "weight" => false,
        "bias" => true,
        _ => return None,
    };
    let p = PARTS.iter().find(|p| p.0 == part)?.1;
    Some(Role::Layer(layer, p, bias))
}

/// The HF name of GGUF tensor `name` in a file of `arch` (Phi-3's `ffn_up` holds gate and
/// up: `mlp.gate_up_proj`; Gemma 3's `ffn_norm` is `pre_feedforward_layernorm`); an unknown
/// name is an error naming it.
fn hf_name_in(arch: Arch, name: &str) -> Result<String> {
    match (arch, parse_name(name)) {
        (Arch::Phi3, Some(Role::Layer(l, Part::Up, false))) => {
            Ok(format!("model.layers.{l}.mlp.gate_up_proj.weight"))
        }
        (Arch::Gemma3, Some(Role::Layer(l, Part::FfnNorm, false))) => {
            Ok(format!("model.layers.{l}.{GEMMA3_FFN_NORM}.weight"))
        }
        _ => hf_tensor_name(name),
    }
}

/// The HF name of GGUF tensor `name`; an unknown name is an error naming it.
pub fn hf_tensor_name(name: &str) -> Result<String> {
    let Some(role) = parse_name(name) else {
        bail!(
            "unknown tensor {name}: a llama/qwen2/qwen3 GGUF has token_embd, output_norm, output and blk.N.{{attn_q,attn_k,attn_v,attn_output,attn_norm,ffn_norm,ffn_gate,ffn_up,ffn_down}} (qwen3 also attn_q_norm, attn_k_norm; gemma3 also those and post_attention_norm, post_ffw_norm; phi3 attn_qkv for q, k and v, ffn_up for gate and up)"
        );
    };
    Ok(match role {
        Role::Embed => "model.embed_tokens.weight".into(),
        Role::FinalNorm => "model.norm.weight".into(),
        Role::Head => "lm_head.weight".into(),
        Role::Layer(l, p, bias) => {
            let hf = PARTS
                .iter()
                .find(|x| x.1 == p)
                .expect("every part is listed")
                .2;
            format!(
                "model.layers.{l}.{hf}.{}",
                if bias { "bias" } else { "weight" }
            )
        }
    })
}

/// The GGUF name of HF tensor `name` in a file of `arch` (the inverse of `hf_name_in`):
/// [`gguf_tensor_name`], but for Gemma 3's norms (`post_attention_layernorm` is its
/// `post_attention_norm`, `pre_feedforward_layernorm` its `ffn_norm`); `None` for a name the
/// architecture has no tensor for.
pub fn gguf_tensor_name_in(arch: Arch, name: &str) -> Option<String> {
    if arch != Arch::Gemma3 {
        return gguf_tensor_name(name);
    }
    let Some((layer, rest)) = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
    else {
        return gguf_tensor_name(name);
    };
    let part = match rest {
        "post_attention_layernorm.weight" => "post_attention_norm",
        "pre_feedforward_layernorm.weight" => "ffn_norm",
        "post_feedforward_layernorm.weight" => "post_ffw_norm",
        _ => return gguf_tensor_name(name),
    };
    (!layer.is_empty() && layer.bytes().all(|b| b.is_ascii_digit()))
        .then(|| format!("blk.{layer}.{part}.weight"))
}

/// The GGUF name of HF tensor `name` (the inverse of [`hf_tensor_name`]); `None` for a name
/// a llama/qwen2 GGUF has no tensor for.
pub fn gguf_tensor_name(name: &str) -> Option<String> {
    match name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (hf, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    // Phi-3's gate|up is llama.cpp's `FFN_UP` (`MODEL_ARCH.PHI3`, gate first).
    let part = match hf {
        "mlp.gate_up_proj" => "ffn_up",
        _ => PARTS.iter().find(|p| p.2 == hf)?.0,
    };
    Some(format!("blk.{layer}.{part}.{suffix}"))
}

/// Maps a llama / qwen2 GGUF file to HF: dimensions, config fields, tensor names and shapes.
/// Every tensor is checked against the dimensions; unknown names, missing tensors and shape
/// mismatches are errors naming the tensor.
pub fn map_model(f: &GgufFile) -> Result<HfModel> {
    let arch = Arch::of(f)?;
    if arch == Arch::Gpt2 {
        return gpt2::map_model(f);
    }
    let a = arch.name();
    let path = f.path().display().to_string();
    let need = |key: &str| required_dim(f, &format!("{a}.{key}"));
    let layers = need("block_count")?;
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let ffn = need("feed_forward_length")?;
    let context = need("context_length")?;
    let kv_heads = match f.get_u64(&format!("{a}.attention.head_count_kv"))? {
        Some(0) => bail!("{path}: metadata {a}.attention.head_count_kv is 0"),
        Some(v) => usize_of(v, &format!("{a}.attention.head_count_kv"), f)?,
        None => heads,
    };
    // Every layer has nine weights: more layers than tensors is a corrupt count (which would
    // make the check for missing tensors below list billions of names).
    if layers > f.tensors.len() {
        bail!(
            "{path}: metadata {a}.block_count is {layers}, but the file has only {} tensors (a \
             layer has 9): the file is corrupt",
            f.tensors.len()
        );
    }
    if heads % kv_heads != 0 {
        bail!(
            "{path}: {a}.attention.head_count {heads} is not a multiple of head_count_kv {kv_heads}"
        );
    }
    let (key_length, rope_dims) = (
        f.get_u64(&format!("{a}.attention.key_length"))?,
        f.get_u64(&format!("{a}.rope.dimension_count"))?,
    );
    if let (Some(k), Some(r)) = (key_length, rope_dims)
        && k > 0
        && r != k
    {
        bail!(
            "{path}: metadata {a}.rope.dimension_count {r} differs from {a}.attention.key_length \
             {k}: rotary embeddings on part of a head are not supported"
        );
    }
    let head_dim = match (key_length, rope_dims) {
        (Some(k), _) | (None, Some(k)) if k > 0 => usize_of(k, "head dimension", f)?,
        _ if hidden % heads == 0 => hidden / heads,
        _ => bail!(
            "{path}: embedding_length {hidden} is not a multiple of head_count {heads} and neither {a}.attention.key_length nor {a}.rope.dimension_count says the head size"
        ),
    };
    if head_dim % 2 != 0 {
        bail!(
            "{path}: the head size is {head_dim} (from {a}.attention.key_length, \
             {a}.rope.dimension_count or embedding_length / head_count); it must be even: \
             rotary embeddings turn pairs of channels"
        );
    }
    let eps_key = format!("{a}.attention.layer_norm_rms_epsilon");
    let rms_eps = get_float(f, &eps_key)?
        .with_context(|| format!("{path}: metadata {eps_key} is missing"))?;
    let rms_eps = check_above(f, &eps_key, rms_eps, 0.0)?;
    let theta_key = format!("{a}.rope.freq_base");
    let rope_theta = match get_float(f, &theta_key)? {
        Some(t) => check_above(f, &theta_key, t, 1.0)?,
        None => 10000.0,
    };
    if arch == Arch::Gemma3 {
        // llama.cpp reads it (`LLM_KV_FINAL_LOGIT_SOFTCAPPING`) and applies it in
        // `llm_build_gemma3`; memwall's Gemma 3 has none (no released Gemma 3 has).
        let key = "gemma3.final_logit_softcapping";
        if let Some(x) = get_float(f, key)?.filter(|&x| x != 0.0) {
            bail!(
                "{path}: metadata {key} is {x}; memwall computes Gemma 3's logits without \
                 softcapping"
            );
        }
    }
    let rope_scaling = match (rope_scaling(f, a)?, f.tensor(rope_freqs::TENSOR)) {
        (None, None) if arch == Arch::Phi3 => {
            phi3_longrope(f, head_dim, context).with_context(|| path.clone())?
        }
        (s, None) => s,
        (None, Some(t)) if arch == Arch::Llama => {
            llama3_scaling(f, t, head_dim, rope_theta).with_context(|| path.clone())?
        }
        (Some(_), Some(_)) => bail!(
            "{path}: the file has both {a}.rope.scaling.* metadata and a {} tensor; one kind of \
             rope scaling is expected",
            rope_freqs::TENSOR
        ),
        (None, Some(_)) => bail!(
            "{path}: tensor {} (Llama 3 rope scaling) is not part of a {a} model",
            rope_freqs::TENSOR
        ),
    };
    let embed = f
        .tensor("token_embd.weight")
        .with_context(|| format!("{path}: tensor token_embd.weight is missing"))?;
    let vocab = match (
        f.get_str_array("tokenizer.ggml.tokens")?,
        f.get_u64(&format!("{a}.vocab_size"))?,
    ) {
        (Some(t), _) => t.len(),
        (None, Some(v)) => usize_of(v, &format!("{a}.vocab_size"), f)?,
        (None, None) => *embed.dims.last().expect("tensors have dims") as usize,
    };
    let dims = Dims {
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn,
        vocab,
        context,
        rms_eps,
        rope_theta,
    };
    let tied = f.tensor("output.weight").is_none();
    let attention_bias = match arch {
        Arch::Qwen2 => true,
        Arch::Phi3 | Arch::Gemma3 => false,
        Arch::Llama | Arch::Qwen3 | Arch::Gpt2 => f.tensor("blk.0.attn_q.bias").is_some(),
    };
    let mut tensors = Vec::with_capacity(f.tensors.len());
    for t in &f.tensors {
        if t.name == rope_freqs::TENSOR || (arch == Arch::Phi3 && PHI3_FACTORS.contains(&&*t.name))
        {
            continue; // read above as `rope_scaling`
        }
        let name = hf_name_in(arch, &t.name).with_context(|| path.clone())?;
        let role = parse_name(&t.name).expect("hf_tensor_name accepted it");
        let expected = expected_dims(role, &dims, arch, attention_bias)
            .with_context(|| format!("{path}: tensor {}", t.name))?;
        check_dims(t, &expected).with_context(|| path.clone())?;
        let unpermute_heads = match (arch, role) {
            (Arch::Llama, Role::Layer(_, Part::Q, _)) => Some(heads),
            (Arch::Llama, Role::Layer(_, Part::K, _)) => Some(kv_heads),
            _ => None,
        };
        // `Gemma3Model.norm_shift`: 1 for every HF name ending in `norm.weight`.
        let shift = match arch {
            Arch::Gemma3 if name.ends_with("norm.weight") => 1.0,
            _ => 0.0,
        };
        tensors.push(HfTensor {
            gguf: t.name.clone(),
            name,
            shape: t.dims.iter().rev().map(|&d| d as usize).collect(),
            unpermute_heads,
            transpose: false,
            shift,
        });
    }
    // Every tensor the HF model has must be there.
    let mut missing = Vec::new();
    let mut want = vec!["token_embd.weight".to_string(), "output_norm.weight".into()];
    for l in 0..layers {
        for (p, part, _) in PARTS {
            let held = match part {
                Part::QNorm | Part::KNorm => matches!(arch, Arch::Qwen3 | Arch::Gemma3),
                Part::AttnPostNorm | Part::FfnPostNorm => arch == Arch::Gemma3,
                Part::Qkv => arch == Arch::Phi3,
                Part::Q | Part::K | Part::V | Part::Gate => arch != Arch::Phi3,
                _ => true,
            };
            if !held {
                continue;
            }
            want.push(format!("blk.{l}.{p}.weight"));
            let bias = match arch {
                Arch::Qwen2 => matches!(part, Part::Q | Part::K | Part::V),
                Arch::Phi3 | Arch::Gemma3 => false,
                Arch::Llama | Arch::Qwen3 | Arch::Gpt2 => {
                    attention_bias && matches!(part, Part::Q | Part::K | Part::V | Part::O)
                }
            };
            if bias {
                want.push(format!("blk.{l}.{p}.bias"));
            }
        }
    }
    for w in &want {
        if f.tensor(w).is_none() {
            missing.push(w.as_str());
        }
    }
    if !missing.is_empty() {
        let n = missing.len();
        missing.truncate(5);
        bail!(
            "{path}: {n} tensors of a {layers}-layer {a} model are missing: {}{}",
            missing.join(", "),
            if n > 5 { ", ..." } else { "" }
        );
    }
    let mut extra_config = serde_json::Map::new();
    if arch == Arch::Phi3 {
        // `phi3.attention.sliding_window` 0 means none (the converter's mark for Phi-4).
        let window = f
            .get_u64("phi3.attention.sliding_window")?
            .filter(|&w| w > 0);
        let original = match f.get_u64("phi3.rope.scaling.original_context_length")? {
            Some(o) if o > 0 => o,
            _ => context as u64,
        };
        let pad = f.get_u64("tokenizer.ggml.padding_token_id")?;
        extra_config.insert("sliding_window".into(), json!(window));
        extra_config.insert("original_max_position_embeddings".into(), json!(original));
        extra_config.insert("pad_token_id".into(), json!(pad));
        extra_config.insert("resid_pdrop".into(), json!(0.0));
        extra_config.insert("embd_pdrop".into(), json!(0.0));
    }
    if arch == Arch::Gemma3 {
        gemma3_config(f, &dims, &mut extra_config).with_context(|| path.clone())?;
    }
    Ok(HfModel {
        arch,
        dims,
        tied,
        attention_bias,
        bos_token_id: f.get_u64("tokenizer.ggml.bos_token_id")?,
        eos_token_id: f.get_u64("tokenizer.ggml.eos_token_id")?,
        rope_scaling,
        extra_config,
        tensors,
    })
}

/// Gemma 3's `config.json` fields beyond the common ones, as llama.cpp runs the file
/// (`llama_model::load_hparams`, `LLM_ARCH_GEMMA3`): each layer's attention
/// (`layer_types`: with `gemma3.attention.sliding_window` set and not 0, layer `l` slides
/// when `l % p < p − 1`, `p` = 6, llama.cpp's `set_swa_pattern(6)`, or as
/// `gemma3.attention.sliding_window_pattern` says where a file has it: a period, or a bool a
/// layer; else every layer is full), the window, the sliding layers' θ (`gemma3.rope.freq_base_swa`, the converter's
/// copy of `rope_local_base_freq`; 10000, the value llama.cpp hard-codes, when absent), the
/// attention scale as `query_pre_attn_scalar` (`f_attention_scale`: head_dim, or
/// `n_embd / n_head` for 62 layers), the pad token.
fn gemma3_config(
    f: &GgufFile,
    d: &Dims,
    extra: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let window = f
        .get_u64("gemma3.attention.sliding_window")?
        .filter(|&w| w > 0);
    // The converter writes no pattern for Gemma 3; a file that has one gives a period, or
    // (newer llama.cpp's `load_swa_pattern`, as Gemma 4's converter writes it) a flag a layer.
    let key = "gemma3.attention.sliding_window_pattern";
    let sliding: Vec<bool> = match f.get(key) {
        Some(super::file::Value::Array(flags)) => {
            if flags.len() != d.layers {
                bail!(
                    "metadata {key} lists {} layers; the model has {}",
                    flags.len(),
                    d.layers
                );
            }
            flags
                .iter()
                .map(|v| match v {
                    super::file::Value::Bool(b) => Ok(*b),
                    other => bail!(
                        "metadata {key} holds a {}, not a bool a layer",
                        other.type_name()
                    ),
                })
                .collect::<Result<_>>()?
        }
        _ => {
            let pattern = match f.get_u64(key)? {
                Some(p) => usize_of(p, key, f)?,
                None => 6,
            };
            (0..d.layers)
                .map(|l| pattern == 0 || l % pattern < pattern - 1)
                .collect()
        }
    };
    let types: Vec<&str> = sliding
        .iter()
        .map(|&s| match window.is_some() && s {
            true => "sliding_attention",
            false => "full_attention",
        })
        .collect();
    if let Some(w) = window {
        extra.insert("sliding_window".into(), json!(w));
    }
    let key = "gemma3.rope.freq_base_swa";
    let local = match get_float(f, key)? {
        Some(t) => check_above(f, key, t, 1.0)?,
        None => 10000.0,
    };
    let scalar = match d.layers {
        62 => d.hidden / d.heads,
        _ => d.head_dim,
    };
    extra.insert("layer_types".into(), json!(types));
    extra.insert("rope_local_base_freq".into(), json!(local));
    extra.insert("query_pre_attn_scalar".into(), json!(scalar));
    extra.insert(
        "pad_token_id".into(),
        json!(f.get_u64("tokenizer.ggml.padding_token_id")?),
    );
    extra.insert("final_logit_softcapping".into(), serde_json::Value::Null);
    extra.insert("attn_logit_softcapping".into(), serde_json::Value::Null);
    extra.insert("use_bidirectional_attention".into(), json!(false));
    Ok(())
}

/// Phi-3's LongRoPE tensors, long then short (`Phi3MiniModel.generate_extra_tensors`).
const PHI3_FACTORS: [&str; 2] = ["rope_factors_long.weight", "rope_factors_short.weight"];

/// HF `rope_scaling` (`longrope`) from a `phi3` file's `rope_factors_long` /
/// `rope_factors_short` tensors, `phi3.rope.scaling.attn_factor` and
/// `phi3.rope.scaling.original_context_length`; none without the tensors. One without the
/// other, factors that are not `[head_dim / 2]`, or a missing key is an error naming it.
fn phi3_longrope(
    f: &GgufFile,
    head_dim: usize,
    context: usize,
) -> Result<Option<serde_json::Value>> {
    let (long, short) = (f.tensor(PHI3_FACTORS[0]), f.tensor(PHI3_FACTORS[1]));
    let (long, short) = match (long, short) {
        (None, None) => return Ok(None),
        (Some(l), Some(s)) => (l, s),
        _ => bail!(
            "one of {} and {} is missing: LongRoPE needs both",
            PHI3_FACTORS[0],
            PHI3_FACTORS[1]
        ),
    };
    let read = |t: &TensorInfo| pair_factors(f, t, head_dim);
    let original = f
        .get_u64("phi3.rope.scaling.original_context_length")?
        .filter(|&o| o > 1)
        .context("metadata phi3.rope.scaling.original_context_length is missing (LongRoPE's pretraining context)")?;
    let mut scaling = json!({
        "type": "longrope",
        "long_factor": read(long)?,
        "short_factor": read(short)?,
        "original_max_position_embeddings": original,
    });
    let key = "phi3.rope.scaling.attn_factor";
    match get_float(f, key)? {
        Some(x) => scaling["attention_factor"] = json!(check_above(f, key, x, 0.0)?),
        None if context as u64 > original => {
            bail!("metadata {key} is missing (LongRoPE's attention factor)")
        }
        None => {}
    }
    Ok(Some(scaling))
}

/// HF `rope_scaling` from `{arch}.rope.scaling.*` (or the older `rope.scale_linear`): none or
/// linear; other kinds are refused by name.
fn rope_scaling(f: &GgufFile, a: &str) -> Result<Option<serde_json::Value>> {
    let path = f.path().display();
    let kind = f.get_str(&format!("{a}.rope.scaling.type"))?;
    let factor_key = format!("{a}.rope.scaling.factor");
    let (factor_key, factor) = match get_float(f, &factor_key)? {
        Some(x) => (factor_key, Some(x)),
        None => {
            let old = format!("{a}.rope.scale_linear");
            let x = get_float(f, &old)?;
            (old, x)
        }
    };
    if let (None | Some("linear"), Some(x)) = (kind, factor) {
        check_above(f, &factor_key, x, 0.0)?;
    }
    match (kind, factor) {
        (None | Some("none"), None) | (Some("none"), _) => Ok(None),
        (None | Some("linear"), Some(1.0)) => Ok(None),
        (None | Some("linear"), Some(x)) => Ok(Some(
            json!({"type": "linear", "rope_type": "linear", "factor": x}),
        )),
        (Some("linear"), None) => {
            bail!("{path}: {a}.rope.scaling.type is linear but no factor is given")
        }
        (Some(other), _) => {
            bail!("{path}: {a}.rope.scaling.type {other:?} is not supported (only none and linear)")
        }
    }
}

/// The values of a rope factor tensor `t`: one per rotary pair of a head of `head_dim`
/// (`rope_freqs`, Phi-3's `rope_factors_*`); other dims are an error naming the tensor.
fn pair_factors(f: &GgufFile, t: &TensorInfo, head_dim: usize) -> Result<Vec<f32>> {
    if t.dims != [head_dim as u64 / 2] {
        bail!(
            "tensor {} has GGUF dims {:?}, expected [{}] (one factor per rotary pair)",
            t.name,
            t.dims,
            head_dim / 2
        );
    }
    let mut v = vec![0f32; head_dim / 2];
    crate::dtype::dequant::dequantize(t.ty, f.tensor_data(t), &mut v)
        .with_context(|| format!("tensor {}", t.name))?;
    Ok(v)
}

/// HF `rope_scaling` (`rope_type` llama3) from the `rope_freqs.weight` factors `t`
/// ([`rope_freqs::scaling_from_factors`]).
fn llama3_scaling(
    f: &GgufFile,
    t: &TensorInfo,
    head_dim: usize,
    theta: f64,
) -> Result<Option<serde_json::Value>> {
    let vals = pair_factors(f, t, head_dim)?;
    Ok(
        rope_freqs::scaling_from_factors(&vals, head_dim, theta as f32)?.map(|p| {
            json!({
                "rope_type": "llama3",
                "factor": p.factor,
                "low_freq_factor": p.low_freq_factor,
                "high_freq_factor": p.high_freq_factor,
                "original_max_position_embeddings": p.original_max_position_embeddings,
            })
        }),
    )
}

/// GGUF dims (innermost first) the tensor must have.
fn expected_dims(role: Role, d: &Dims, arch: Arch, attention_bias: bool) -> Result<Vec<u64>> {
    let u = |x: usize| x as u64;
    let (q, kv) = (u(d.heads * d.head_dim), u(d.kv_heads * d.head_dim));
    let (h, ffn) = (u(d.hidden), u(d.ffn));
    Ok(match role {
        Role::Embed | Role::Head => vec![h, u(d.vocab)],
        Role::FinalNorm => vec![h],
        Role::Layer(l, _, _) if l >= d.layers => {
            bail!("layer {l} is beyond block_count {}", d.layers)
        }
        Role::Layer(_, p, true) => {
            let allowed = match arch {
                Arch::Qwen2 => matches!(p, Part::Q | Part::K | Part::V),
                Arch::Phi3 | Arch::Gemma3 => false,
                Arch::Llama | Arch::Qwen3 | Arch::Gpt2 => {
                    attention_bias && matches!(p, Part::Q | Part::K | Part::V | Part::O)
                }
            };
            if !allowed {
                bail!("a bias here is not part of a {} model", arch.name());
            }
            match p {
                Part::Q => vec![q],
                Part::K | Part::V => vec![kv],
                _ => vec![h],
            }
        }
        Role::Layer(_, p, false) => match p {
            Part::Qkv if arch == Arch::Phi3 => vec![h, q + 2 * kv],
            Part::Up if arch == Arch::Phi3 => vec![h, 2 * ffn],
            Part::Qkv => bail!("a fused attn_qkv is not part of a {} model", arch.name()),
            Part::Q | Part::K | Part::V | Part::Gate if arch == Arch::Phi3 => {
                bail!("a phi3 model keeps q, k and v in attn_qkv and gate and up in ffn_up")
            }
            Part::Q => vec![h, q],
            Part::K | Part::V => vec![h, kv],
            Part::O => vec![q, h],
            Part::AttnNorm | Part::FfnNorm => vec![h],
            Part::Gate | Part::Up => vec![h, ffn],
            Part::Down => vec![ffn, h],
            Part::QNorm | Part::KNorm if matches!(arch, Arch::Qwen3 | Arch::Gemma3) => {
                vec![u(d.head_dim)]
            }
            Part::QNorm | Part::KNorm => bail!("a q/k norm is not part of a {} model", arch.name()),
            Part::AttnPostNorm | Part::FfnPostNorm if arch == Arch::Gemma3 => vec![h],
            Part::AttnPostNorm | Part::FfnPostNorm => {
                bail!(
                    "a post-attention/post-MLP norm is not part of a {} model",
                    arch.name()
                )
            }
        },
    })
}

/// The storage type of every tensor of the model in `f`, by its Hugging Face name (what a
/// LoRA base kept as the file's blocks computes with, `--base-quant keep`).
pub fn tensor_types(f: &GgufFile) -> Result<std::collections::BTreeMap<String, GgmlType>> {
    let model = map_model(f)?;
    let mut out = std::collections::BTreeMap::new();
    for t in &model.tensors {
        let info = f
            .tensor(&t.gguf)
            .expect("map_model lists the file's tensors");
        out.insert(t.name.clone(), info.ty);
    }
    Ok(out)
}

/// Undoes llama.cpp's Q/K row permutation: `src` [rows, cols] in GGUF row order → `dst`
/// [rows, cols] in HF order (values, or the bytes of quantized rows with `cols` the bytes of
/// a row), with `n_head` heads of `rows / n_head` rows each. HF row
/// `h·d + s·d/2 + i` is GGUF row `h·d + 2i + s`. Biases are the case `cols` = 1.
pub fn unpermute_rows<T: Copy>(src: &[T], dst: &mut [T], n_head: usize, cols: usize) -> Result<()> {
    move_rows(src, dst, n_head, cols, true)
}

/// llama.cpp's Q/K row permutation (`LlamaModel.permute` in `convert_hf_to_gguf.py`), the
/// inverse of [`unpermute_rows`]: `src` [rows, cols] in HF row order → `dst` in GGUF order.
/// GGUF row `h·d + 2i + s` is HF row `h·d + s·d/2 + i`. Biases are the case `cols` = 1.
pub fn permute_rows<T: Copy>(src: &[T], dst: &mut [T], n_head: usize, cols: usize) -> Result<()> {
    move_rows(src, dst, n_head, cols, false)
}

/// The pairing both directions share: HF row `h·d + s·d/2 + i` ↔ GGUF row `h·d + 2i + s`,
/// copied GGUF → HF when `to_hf`, else HF → GGUF.
fn move_rows<T: Copy>(
    src: &[T],
    dst: &mut [T],
    n_head: usize,
    cols: usize,
    to_hf: bool,
) -> Result<()> {
    let what = if to_hf {
        "unpermute_rows"
    } else {
        "permute_rows"
    };
    if cols == 0 || src.len() != dst.len() || !src.len().is_multiple_of(cols) {
        bail!(
            "{what}: {} values in, {} out, rows of {cols}",
            src.len(),
            dst.len()
        );
    }
    let rows = src.len() / cols;
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        bail!("{rows} rows cannot be split into {n_head} heads of an even number of rows");
    }
    let d = rows / n_head;
    let half = d / 2;
    for h in 0..n_head {
        for s in 0..2 {
            for i in 0..half {
                let hf = (h * d + s * half + i) * cols;
                let gguf = (h * d + 2 * i + s) * cols;
                let (to, from) = if to_hf { (hf, gguf) } else { (gguf, hf) };
                dst[to..to + cols].copy_from_slice(&src[from..from + cols]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's forward permutation, written from its numpy expression:
    /// `w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
    /// Output row (h, i, s) (index h·d + 2i + s) is input row (h, s, i) (h·d + s·d/2 + i).
    fn permute_forward(w: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
        let rows = w.len() / cols;
        let half = rows / n_head / 2;
        let mut out = Vec::with_capacity(w.len());
        for h in 0..n_head {
            for i in 0..half {
                for s in 0..2 {
                    let r = h * 2 * half + s * half + i;
                    out.extend_from_slice(&w[r * cols..(r + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        for (n_head, rows, cols) in [(1, 8, 3), (2, 8, 1), (3, 12, 5), (4, 32, 2)] {
            let w: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
            let p = permute_forward(&w, n_head, cols);
            assert_ne!(p, w, "the permutation moves rows");
            let mut back = vec![0f32; w.len()];
            unpermute_rows(&p, &mut back, n_head, cols).unwrap();
            assert_eq!(back, w, "n_head {n_head} rows {rows} cols {cols}");
        }
    }

    #[test]
    fn permute_is_llama_cpp_s_and_unpermute_undoes_it() {
        for (n_head, rows, cols) in [(1, 8, 3), (2, 8, 1), (3, 12, 5), (4, 32, 2)] {
            let w: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
            let mut p = vec![0f32; w.len()];
            permute_rows(&w, &mut p, n_head, cols).unwrap();
            assert_eq!(p, permute_forward(&w, n_head, cols), "n_head {n_head}");
            let mut back = vec![0f32; w.len()];
            unpermute_rows(&p, &mut back, n_head, cols).unwrap();
            assert_eq!(back, w);
        }
        let mut out = [0f32; 8];
        assert!(permute_rows(&[0f32; 8], &mut out, 3, 1).is_err());
    }

    #[test]
    fn unpermute_hand_checked_8_rows() {
        // 2 heads of 4 rows (d = 4, pairs half a head apart in HF: rows 0,2 and 1,3).
        // GGUF stores head 0 as HF rows 0, 2, 1, 3 and head 1 as 4, 6, 5, 7.
        let gguf = [0., 2., 1., 3., 4., 6., 5., 7.];
        let mut hf = [0f32; 8];
        unpermute_rows(&gguf, &mut hf, 2, 1).unwrap();
        assert_eq!(hf, [0., 1., 2., 3., 4., 5., 6., 7.]);
        // With 1 head of 8: GGUF rows are HF rows 0, 4, 1, 5, 2, 6, 3, 7.
        let gguf = [10., 14., 11., 15., 12., 16., 13., 17.];
        unpermute_rows(&gguf, &mut hf, 1, 1).unwrap();
        assert_eq!(hf, [10., 11., 12., 13., 14., 15., 16., 17.]);
        assert!(unpermute_rows(&gguf, &mut hf, 3, 1).is_err());
    }

    #[test]
    fn tensor_names_map_to_hf() {
        for (g, h) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.0.attn_q.weight",
                "model.layers.0.self_attn.q_proj.weight",
            ),
            (
                "blk.11.attn_k.bias",
                "model.layers.11.self_attn.k_proj.bias",
            ),
            (
                "blk.2.attn_v.weight",
                "model.layers.2.self_attn.v_proj.weight",
            ),
            (
                "blk.2.attn_output.weight",
                "model.layers.2.self_attn.o_proj.weight",
            ),
            (
                "blk.3.attn_norm.weight",
                "model.layers.3.input_layernorm.weight",
            ),
            (
                "blk.3.ffn_norm.weight",
                "model.layers.3.post_attention_layernorm.weight",
            ),
            (
                "blk.4.ffn_gate.weight",
                "model.layers.4.mlp.gate_proj.weight",
            ),
            ("blk.4.ffn_up.weight", "model.layers.4.mlp.up_proj.weight"),
            (
                "blk.4.ffn_down.weight",
                "model.layers.4.mlp.down_proj.weight",
            ),
        ] {
            assert_eq!(hf_tensor_name(g).unwrap(), h);
        }
        for (g, _) in [
            ("token_embd.weight", 0),
            ("output.weight", 0),
            ("blk.3.ffn_norm.weight", 0),
            ("blk.11.attn_k.bias", 0),
            ("blk.4.ffn_down.weight", 0),
        ] {
            let h = hf_tensor_name(g).unwrap();
            assert_eq!(gguf_tensor_name(&h).as_deref(), Some(g), "{h}");
        }
        for bad in [
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.0.mlp.up_proj.scale",
            "transformer.wte.weight",
        ] {
            assert_eq!(gguf_tensor_name(bad), None, "{bad}");
        }
        // Phi-3's fused tensors: attn_qkv by its name, ffn_up as gate|up in a phi3 file only.
        assert_eq!(
            hf_tensor_name("blk.1.attn_qkv.weight").unwrap(),
            "model.layers.1.self_attn.qkv_proj.weight"
        );
        assert_eq!(
            hf_name_in(Arch::Phi3, "blk.2.ffn_up.weight").unwrap(),
            "model.layers.2.mlp.gate_up_proj.weight"
        );
        assert_eq!(
            hf_name_in(Arch::Llama, "blk.2.ffn_up.weight").unwrap(),
            "model.layers.2.mlp.up_proj.weight"
        );
        // Gemma 3's norms: `ffn_norm` is the norm before the MLP there, and both ways agree.
        for (g, h) in [
            ("blk.2.ffn_norm.weight", "pre_feedforward_layernorm"),
            (
                "blk.2.post_attention_norm.weight",
                "post_attention_layernorm",
            ),
            ("blk.2.post_ffw_norm.weight", "post_feedforward_layernorm"),
            ("blk.2.attn_norm.weight", "input_layernorm"),
            ("blk.2.attn_q_norm.weight", "self_attn.q_norm"),
        ] {
            let h = format!("model.layers.2.{h}.weight");
            assert_eq!(hf_name_in(Arch::Gemma3, g).unwrap(), h);
            assert_eq!(gguf_tensor_name_in(Arch::Gemma3, &h).as_deref(), Some(g));
        }
        assert_eq!(
            gguf_tensor_name_in(Arch::Gemma3, "model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(
            gguf_tensor_name_in(
                Arch::Llama,
                "model.layers.2.post_attention_layernorm.weight"
            )
            .as_deref(),
            Some("blk.2.ffn_norm.weight")
        );
        for bad in [
            "blk.x.attn_q.weight",
            "blk.1.attn_qkvz.weight",
            "blk.1.attn_q.scale",
            "foo",
        ] {
            let e = format!("{:#}", hf_tensor_name(bad).unwrap_err());
            assert!(e.contains(&format!("unknown tensor {bad}")), "{e}");
        }
    }
}
