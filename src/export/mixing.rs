//! Which ggml type each tensor of an export gets: llama.cpp's `llama-quantize` rules for the
//! file type, as `llama_tensor_get_type` in `src/llama-quant.cpp` applies them by default (no
//! importance matrix, no overrides, not `--pure`), for the dense llama and qwen2 models
//! memwall exports (and GPT-2's):
//!
//! - A tensor llama-quantize does not quantize keeps its converted type, F32: 1-D tensors
//!   (norms, biases), names not ending in `weight`, `*_norm.weight`, GPT-2's
//!   `position_embd.weight` (`tensor_allows_quantization`).
//! - F32, F16 and BF16 files: every other tensor is that type.
//! - The output tensor, or `token_embd` when there is no `output.weight` (a tied LM head):
//!   Q8_0 when its rows are not whole blocks of the file's type, else Q6_K unless the file
//!   is Q8_0 (so Q4_0, Q4_1, Q4_K_M and Q6_K files get Q6_K there).
//! - Q4_K_M: `attn_v` and `ffn_down` get Q6_K in the layers `use_more_bits(i, n)` picks —
//!   the first and last eighth, and every third layer between (`i < n/8 || i >= 7n/8 ||
//!   (i − n/8) % 3 == 2`); `i` counts those tensors in llama.cpp's order (by layer, then
//!   name: `weight_name_comparer`), `n` is the number of `attn_v` tensors, or of layers for
//!   `ffn_down`. An 80-layer model (llama.cpp's `LLM_TYPE_70B`: qwen2, or llama with grouped
//!   KV heads) gets Q5_K for the other `attn_v`, which memwall does not write: refused.
//! - Q4_K_M: Phi-3's fused `attn_qkv` gets Q5_K, which memwall does not write: refused.
//! - No rule names Gemma 3 (`llama_tensor_get_type_impl`): its four norms a layer and q/k
//!   norms stay F32 (`_norm.weight`), and its tied `token_embd` takes the output tensor's
//!   type as any tied model's does.
//! - Then the fallback for rows that are not whole blocks (`tensor_type_fallback`): Q4_K →
//!   Q5_0, Q6_K → Q8_0 (Q5_K → Q5_1, refused); F16 when even those do not fit. Q4_0, Q4_1
//!   and Q8_0 have no fallback in llama-quantize (it throws): refused here too, naming the
//!   tensor and a type that fits.
//!
//! SmolLM2's 576-wide rows are not whole 256-value super-blocks, so its Q4_K_M export is
//! mostly Q5_0 (Q8_0 for the `attn_v` that would be Q6_K), with Q4_K / Q6_K only for
//! `ffn_down` (1536-wide rows).

use super::ftype::ExportType;
use crate::dtype::GgmlType;
use crate::gguf::quantize::QUANTIZABLE;
use anyhow::{Result, bail};

/// What the rules need of the model (llama.cpp's `hparams` and `model.type`).
#[derive(Clone, Copy, Debug)]
pub struct MixModel<'a> {
    /// `general.architecture`: `llama`, `qwen2`, `qwen3`, `phi3`, `gemma3` or `gpt2`.
    pub arch: &'a str,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
}

/// llama-quant.cpp's tensor categories, as far as the rules for our file types use them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    AttnV,
    /// Phi-3's fused `attn_qkv`: counted with the `attn_v` tensors, typed by a rule of its own.
    AttnQkv,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        Category::Output
    } else if name == "token_embd.weight" {
        Category::TokenEmbd
    } else if name.contains("attn_qkv.weight") {
        Category::AttnQkv
    } else if ["attn_v.weight", "attn_kv_b.weight"]
        .iter()
        .any(|s| name.contains(s))
    {
        Category::AttnV
    } else if name.contains("ffn_down") {
        Category::FfnDown
    } else {
        Category::Other
    }
}

/// llama-quant.cpp's `use_more_bits`.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The layer of a `blk.N.` name, −1 for others (`weight_name_comparer`'s key).
fn layer_of(name: &str) -> i64 {
    name.strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(-1)
}

/// Whether llama-quantize quantizes a tensor (`tensor_allows_quantization`, the parts that
/// can apply to llama, qwen2 and gpt2 tensors: not positional embeddings either).
fn allows_quantization(name: &str, dims: &[u64]) -> bool {
    let n_dims = dims.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
    n_dims >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && name != "position_embd.weight"
}

/// The ggml type of each tensor (`tensors`: GGUF names and dims, innermost first, in any
/// order; the result in the same order) in a `ty` file of `model`, as llama-quantize picks
/// it (see the module docs).
///
/// Errors: a tensor whose rows fit no block of the type and llama-quantize has no fallback
/// for (named, with the types that fit), or one that would get a type memwall does not
/// write (Q5_K, Q5_1).
pub fn tensor_types(
    ty: ExportType,
    model: MixModel,
    tensors: &[(&str, &[u64])],
) -> Result<Vec<GgmlType>> {
    let default = ty.ggml();
    let quantized = default.block_size > 1;
    let tied = !tensors.iter().any(|(n, _)| *n == "output.weight");
    let n_attn_v = tensors
        .iter()
        .filter(|(n, _)| matches!(category(n), Category::AttnV | Category::AttnQkv))
        .count();
    // llama.cpp's `LLM_TYPE_70B`: 80 layers of qwen2, or of llama with grouped KV heads
    // (`load_hparams`); no other architecture memwall writes has that type at 80 layers.
    let is_70b = model.n_layer == 80
        && (model.arch == "qwen2" || (model.arch == "llama" && model.n_head != model.n_kv_head));
    // llama.cpp visits tensors by layer, then name; its counters follow that order.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let (na, nb) = (tensors[a].0, tensors[b].0);
        (layer_of(na), na).cmp(&(layer_of(nb), nb))
    });
    let (mut i_attn_v, mut i_ffn_down) = (0, 0);
    let mut out = vec![GgmlType::F32; tensors.len()];
    for i in order {
        let (name, dims) = tensors[i];
        if !allows_quantization(name, dims) {
            continue; // F32, as converted.
        }
        if !quantized {
            out[i] = default;
            continue;
        }
        let cols = dims[0];
        let mut t = default;
        let cat = category(name);
        if cat == Category::Output || (tied && cat == Category::TokenEmbd) {
            if !cols.is_multiple_of(default.block_size) {
                t = GgmlType::Q8_0;
            } else if default != GgmlType::Q8_0 {
                t = GgmlType::Q6_K;
            }
        } else if cat == Category::AttnV {
            if ty == ExportType::Q4KM && use_more_bits(i_attn_v, n_attn_v) {
                t = GgmlType::Q6_K;
            }
            if is_70b && t == GgmlType::Q4_K {
                t = q5_k();
            }
            i_attn_v += 1;
        } else if cat == Category::AttnQkv {
            // llama-quant.cpp: `attn_qkv.weight` is Q5_K in a Q4_K_M file.
            if ty == ExportType::Q4KM {
                t = q5_k();
            }
        } else if cat == Category::FfnDown {
            if ty == ExportType::Q4KM && use_more_bits(i_ffn_down, model.n_layer) {
                t = GgmlType::Q6_K;
            }
            i_ffn_down += 1;
        }
        out[i] = fallback(name, cols, t)?;
        if out[i].block_size > 1 && !QUANTIZABLE.contains(&out[i].name) {
            bail!(
                "llama-quantize would store tensor {name} as {}, which memwall does not write: \
                 export --type q8_0 or f16 and quantize that file with llama-quantize",
                out[i]
            );
        }
    }
    Ok(out)
}

fn q5_k() -> GgmlType {
    GgmlType::from_id(13).expect("ggml type 13 is Q5_K")
}

/// llama-quant.cpp's `tensor_type_fallback`: `t` when rows of `cols` values are whole blocks
/// of it; else the K-quant's fallback (Q4_K → Q5_0, Q6_K → Q8_0, Q5_K → Q5_1), F16 if even
/// that does not fit; an error for the types llama-quantize has no fallback for.
fn fallback(name: &str, cols: u64, t: GgmlType) -> Result<GgmlType> {
    if cols.is_multiple_of(t.block_size) {
        return Ok(t);
    }
    let f = match t.name {
        "Q4_K" => GgmlType::Q5_0,
        "Q6_K" => GgmlType::Q8_0,
        "Q5_K" => GgmlType::from_id(7).expect("ggml type 7 is Q5_1"),
        _ => bail!(
            "tensor {name} has rows of {cols} values, not whole {t} blocks of {} (llama-quantize \
             has no fallback for {t} either): export with --type f16, bf16 or f32 (or q4_k_m / \
             q6_k, which store such a tensor as F16, as llama-quantize does)",
            t.block_size
        ),
    };
    Ok(if cols.is_multiple_of(f.block_size) {
        f
    } else {
        GgmlType::F16
    })
}

#[cfg(test)]
mod tests;
