//! GPT-2 (`gpt2`) as llama.cpp's `convert_hf_to_gguf.py` (`GPT2Model`) writes it and
//! `llama_model_gpt2` loads it.
//!
//! - metadata: `gpt2.block_count`, `.context_length` (`n_positions`), `.embedding_length`,
//!   `.feed_forward_length` (the converter writes 4·C whatever `n_inner` says; memwall writes
//!   the MLP's real width, which llama.cpp reads to shape `ffn_up`/`ffn_down`),
//!   `.attention.head_count`, `.attention.layer_norm_epsilon`; no vocab size, no RoPE.
//! - tensors: names as [`crate::gguf::hf`]'s GPT-2 table; the Conv1D weights (`c_attn`,
//!   `attn.c_proj`, `c_fc`, `mlp.c_proj`), `[in, out]` in memwall and HF, are transposed to
//!   `[out, in]` as the converter does (GGUF dims `[in, out]`, what llama.cpp's
//!   `create_tensor` asks: `attn_qkv` `{n_embd, 3·n_embd}`, `ffn_up` `{n_embd, n_ff}`);
//!   `position_embd` stays F32 whatever `--type` is (the converter keeps `POS_EMBD` in F32);
//!   the head is tied (`output` absent, llama.cpp reuses `token_embd`).

use crate::gguf::file::Value;
use crate::gguf::hf::gpt2::gguf_tensor_name;
use crate::model::ModelSpec;
use anyhow::{Context, Result};

/// The `gpt2.*` metadata, in the converter's order.
pub(super) fn metadata(spec: &ModelSpec) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    vec![
        ("gpt2.block_count".into(), u(spec.n_layer)),
        ("gpt2.context_length".into(), u(spec.n_positions)),
        ("gpt2.embedding_length".into(), u(spec.n_embd)),
        ("gpt2.feed_forward_length".into(), u(spec.mlp_hidden)),
        ("gpt2.attention.head_count".into(), u(spec.n_head)),
        (
            "gpt2.attention.layer_norm_epsilon".into(),
            Value::F32(spec.norm_eps),
        ),
    ]
}

/// GGUF name of memwall's GPT-2 tensor `name` and whether it is transposed.
pub(super) fn tensor_name(name: &str) -> Result<(String, bool)> {
    gguf_tensor_name(name)
        .with_context(|| format!("tensor {name} has no GGUF name (memwall's gpt2 layout)"))
}
