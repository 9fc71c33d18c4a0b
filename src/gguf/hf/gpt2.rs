//! GGUF `gpt2` files (as llama.cpp's `convert_hf_to_gguf.py` `GPT2Model` writes them and
//! `llama_model_gpt2` loads them) as Hugging Face's `GPT2LMHeadModel` sees them.
//!
//! | GGUF (dims innermost first)               | Hugging Face (shape)                        |
//! |-------------------------------------------|---------------------------------------------|
//! | `token_embd.weight` `[C, V]`              | `transformer.wte.weight` `[V, C]`           |
//! | `position_embd.weight` `[C, T]`           | `transformer.wpe.weight` `[T, C]`           |
//! | `blk.N.attn_norm.{weight,bias}` `[C]`     | `transformer.h.N.ln_1.*`                    |
//! | `blk.N.attn_qkv.weight` `[C, 3C]`         | `transformer.h.N.attn.c_attn.weight` `[C, 3C]` |
//! | `blk.N.attn_qkv.bias` `[3C]`              | `transformer.h.N.attn.c_attn.bias`          |
//! | `blk.N.attn_output.{weight,bias}` `[C, C]`| `transformer.h.N.attn.c_proj.*`             |
//! | `blk.N.ffn_norm.{weight,bias}` `[C]`      | `transformer.h.N.ln_2.*`                    |
//! | `blk.N.ffn_up.{weight,bias}` `[C, H]`     | `transformer.h.N.mlp.c_fc.*` `[C, H]`       |
//! | `blk.N.ffn_down.{weight,bias}` `[H, C]`   | `transformer.h.N.mlp.c_proj.*` `[H, C]`     |
//! | `output_norm.{weight,bias}` `[C]`         | `transformer.ln_f.*`                        |
//! | `output.weight` `[C, V]` (absent: tied)   | `lm_head.weight`                            |
//!
//! HF's Conv1D weights are `[in, out]`; the converter transposes them to `[out, in]` (GGUF dims
//! `[in, out]`), as `nn.Linear` weights are stored, so the four weight matrices are transposed
//! back here ([`super::HfTensor::transpose`](crate::gguf::hf::HfTensor::transpose)); embeddings, norms and biases are copied.
//! Hyper-parameters: `gpt2.block_count`, `.context_length`, `.embedding_length`,
//! `.feed_forward_length`, `.attention.head_count`, `.attention.layer_norm_epsilon`.

use super::model::{
    Arch, Dims, HfModel, HfTensor, check_above, check_dims, get_float, required_dim, usize_of,
};
use crate::gguf::file::GgufFile;
use anyhow::{Context, Result, bail};
use serde_json::json;

/// (GGUF part, HF part, whether the weight is a Conv1D matrix).
const PARTS: [(&str, &str, bool); 6] = [
    ("attn_norm", "ln_1", false),
    ("attn_qkv", "attn.c_attn", true),
    ("attn_output", "attn.c_proj", true),
    ("ffn_norm", "ln_2", false),
    ("ffn_up", "mlp.c_fc", true),
    ("ffn_down", "mlp.c_proj", true),
];

/// HF name, whether transposed, and expected GGUF dims of GGUF tensor `name`.
fn map_name(name: &str, d: &Dims) -> Result<(String, bool, Vec<u64>)> {
    let (c, v, t, h) = (
        d.hidden as u64,
        d.vocab as u64,
        d.context as u64,
        d.ffn as u64,
    );
    let unknown = || {
        anyhow::anyhow!(
            "unknown tensor {name}: a gpt2 GGUF has token_embd, position_embd, output_norm, \
             output and blk.N.{{attn_norm,attn_qkv,attn_output,ffn_norm,ffn_up,ffn_down}}"
        )
    };
    Ok(match name {
        "token_embd.weight" => ("transformer.wte.weight".into(), false, vec![c, v]),
        "position_embd.weight" => ("transformer.wpe.weight".into(), false, vec![c, t]),
        "output_norm.weight" => ("transformer.ln_f.weight".into(), false, vec![c]),
        "output_norm.bias" => ("transformer.ln_f.bias".into(), false, vec![c]),
        "output.weight" => ("lm_head.weight".into(), false, vec![c, v]),
        _ => {
            let rest = name.strip_prefix("blk.").ok_or_else(unknown)?;
            let (layer, rest) = rest.split_once('.').ok_or_else(unknown)?;
            if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
                return Err(unknown());
            }
            let l: usize = layer.parse().map_err(|_| unknown())?;
            if l >= d.layers {
                bail!(
                    "tensor {name}: layer {l} is beyond gpt2.block_count {}",
                    d.layers
                );
            }
            let (part, suffix) = rest.split_once('.').ok_or_else(unknown)?;
            let &(_, hf, conv) = PARTS.iter().find(|p| p.0 == part).ok_or_else(unknown)?;
            let bias = match suffix {
                "weight" => false,
                "bias" => true,
                _ => return Err(unknown()),
            };
            let dims = match (part, bias) {
                ("attn_qkv", false) => vec![c, 3 * c],
                ("attn_qkv", true) => vec![3 * c],
                ("attn_output", false) => vec![c, c],
                ("ffn_up", false) => vec![c, h],
                ("ffn_up", true) => vec![h],
                ("ffn_down", false) => vec![h, c],
                _ => vec![c],
            };
            (
                format!("transformer.h.{l}.{hf}.{suffix}"),
                conv && !bias,
                dims,
            )
        }
    })
}

/// The GGUF name of HF GPT-2 tensor `name` (canonical `transformer.*` names, see the module
/// doc) and whether it is a Conv1D weight (transposed); `None` for a name a gpt2 GGUF has no
/// tensor for.
pub(crate) fn gguf_tensor_name(name: &str) -> Option<(String, bool)> {
    match name {
        "transformer.wte.weight" => return Some(("token_embd.weight".into(), false)),
        "transformer.wpe.weight" => return Some(("position_embd.weight".into(), false)),
        "transformer.ln_f.weight" => return Some(("output_norm.weight".into(), false)),
        "transformer.ln_f.bias" => return Some(("output_norm.bias".into(), false)),
        "lm_head.weight" => return Some(("output.weight".into(), false)),
        _ => {}
    }
    let rest = name.strip_prefix("transformer.h.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (hf, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let &(part, _, conv) = PARTS.iter().find(|p| p.1 == hf)?;
    Some((
        format!("blk.{layer}.{part}.{suffix}"),
        conv && suffix == "weight",
    ))
}

/// Maps a `gpt2` GGUF file to HF (see the module doc); every tensor checked against the
/// dimensions, unknown and missing ones named.
pub(super) fn map_model(f: &GgufFile) -> Result<HfModel> {
    let path = f.path().display().to_string();
    let need = |key: &str| required_dim(f, &format!("gpt2.{key}"));
    let layers = need("block_count")?;
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let context = need("context_length")?;
    let ffn = match f.get_u64("gpt2.feed_forward_length")? {
        Some(v) if v > 0 => usize_of(v, "gpt2.feed_forward_length", f)?,
        _ => 4 * hidden,
    };
    if layers > f.tensors.len() {
        bail!(
            "{path}: metadata gpt2.block_count is {layers}, but the file has only {} tensors (a \
             layer has 12): the file is corrupt",
            f.tensors.len()
        );
    }
    if !hidden.is_multiple_of(heads) {
        bail!(
            "{path}: gpt2.embedding_length {hidden} is not a multiple of gpt2.attention.head_count {heads}"
        );
    }
    let eps_key = "gpt2.attention.layer_norm_epsilon";
    let eps =
        get_float(f, eps_key)?.with_context(|| format!("{path}: metadata {eps_key} is missing"))?;
    let eps = check_above(f, eps_key, eps, 0.0)?;
    let embed = f
        .tensor("token_embd.weight")
        .with_context(|| format!("{path}: tensor token_embd.weight is missing"))?;
    let vocab = match f.get_str_array("tokenizer.ggml.tokens")? {
        Some(t) => t.len(),
        None => *embed.dims.last().expect("tensors have dims") as usize,
    };
    let dims = Dims {
        layers,
        hidden,
        heads,
        kv_heads: heads,
        head_dim: hidden / heads,
        ffn,
        vocab,
        context,
        rms_eps: eps,
        rope_theta: 0.0,
    };
    let mut tensors = Vec::with_capacity(f.tensors.len());
    for t in &f.tensors {
        let (name, transpose, expected) = map_name(&t.name, &dims).with_context(|| path.clone())?;
        check_dims(t, &expected).with_context(|| path.clone())?;
        // A Conv1D weight's HF shape is its GGUF dims ([in, out]); others' are reversed.
        let shape = if transpose {
            t.dims.iter().map(|&d| d as usize).collect()
        } else {
            t.dims.iter().rev().map(|&d| d as usize).collect()
        };
        tensors.push(HfTensor {
            gguf: t.name.clone(),
            name,
            shape,
            unpermute_heads: None,
            transpose,
            shift: 0.0,
        });
    }
    let mut want = vec![
        "token_embd.weight".to_string(),
        "position_embd.weight".into(),
        "output_norm.weight".into(),
        "output_norm.bias".into(),
    ];
    for l in 0..layers {
        for (p, _, _) in PARTS {
            want.push(format!("blk.{l}.{p}.weight"));
            want.push(format!("blk.{l}.{p}.bias"));
        }
    }
    let missing: Vec<&str> = want
        .iter()
        .filter(|w| f.tensor(w).is_none())
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        bail!(
            "{path}: {} tensors of a {layers}-layer gpt2 model are missing: {}{}",
            missing.len(),
            missing[..missing.len().min(5)].join(", "),
            if missing.len() > 5 { ", ..." } else { "" }
        );
    }
    Ok(HfModel {
        arch: Arch::Gpt2,
        dims,
        tied: f.tensor("output.weight").is_none(),
        attention_bias: true,
        bos_token_id: f.get_u64("tokenizer.ggml.bos_token_id")?,
        eos_token_id: f.get_u64("tokenizer.ggml.eos_token_id")?,
        rope_scaling: None,
        extra_config: Default::default(),
        tensors,
    })
}

/// `config.json` as transformers' `GPT2Config` reads it (`n_inner` null when 4·C).
pub(super) fn config_json(m: &HfModel, torch_dtype: &str) -> serde_json::Value {
    let d = &m.dims;
    let n_inner = if d.ffn == 4 * d.hidden {
        serde_json::Value::Null
    } else {
        json!(d.ffn)
    };
    json!({
        "architectures": [Arch::Gpt2.hf_class()],
        "model_type": "gpt2",
        "vocab_size": d.vocab,
        "n_positions": d.context,
        "n_ctx": d.context,
        "n_embd": d.hidden,
        "n_layer": d.layers,
        "n_head": d.heads,
        "n_inner": n_inner,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": d.rms_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": m.bos_token_id,
        "eos_token_id": m.eos_token_id,
        "tie_word_embeddings": m.tied,
        "torch_dtype": torch_dtype,
    })
}
