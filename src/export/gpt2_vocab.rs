//! GPT-2's own tokenizer (`r50k_base`, embedded in memwall) as `tokenizer.*` metadata, for a
//! GPT-2 checkpoint with no `tokenizer.json` (trained from a preset on GPT-2-tokenized data):
//! what llama.cpp's converter writes from `openai-community/gpt2`'s files.
//!
//! - `tokenizer.ggml.model` `gpt2`, `.pre` `gpt-2`;
//! - `.tokens`: each id's bytes in the byte-level alphabet
//!   ([`crate::gguf::tokenizer::byte_level_alphabet`]), `<|endoftext|>` last (id 50256);
//!   `.token_type` 1, and 3 (control) for `<|endoftext|>`;
//! - `.merges`: the 50000 merges in rank order, each found as transformers finds a tiktoken
//!   vocabulary's merges: the token's bytes merged with the earlier ranks only end in two
//!   pieces, and those are the merge;
//! - `.bos_token_id` and `.eos_token_id` 50256 (GPT-2's `config.json`), `.add_space_prefix`
//!   false.

use crate::data::tokenizer::gpt2::{EOT, token_bytes};
use crate::gguf::file::Value;
use crate::gguf::tokenizer::byte_level_alphabet;
use anyhow::{Result, bail};
use std::collections::HashMap;

/// The two pieces `bytes` (of rank `rank`) is merged from: byte-pair merging with only the
/// ranks below `rank`.
fn split(bytes: &[u8], rank: u32, ranks: &HashMap<&[u8], u32>) -> Option<(usize, usize)> {
    // Piece boundaries: parts[i]..parts[i + 1].
    let mut parts: Vec<usize> = (0..=bytes.len()).collect();
    while parts.len() > 3 {
        let best = (0..parts.len() - 2)
            .filter_map(|i| {
                let r = *ranks.get(&bytes[parts[i]..parts[i + 2]])?;
                (r < rank).then_some((r, i))
            })
            .min()?;
        parts.remove(best.1 + 1);
    }
    (parts.len() == 3).then_some((parts[0], parts[1]))
}

/// The metadata (see the module doc).
pub(super) fn metadata() -> Result<Vec<(String, Value)>> {
    let bytes = token_bytes()?;
    let alphabet = byte_level_alphabet();
    let text = |b: &[u8]| -> String { b.iter().map(|&x| alphabet[x as usize]).collect() };
    let ranks: HashMap<&[u8], u32> = bytes
        .iter()
        .enumerate()
        .take(EOT as usize)
        .map(|(i, b)| (b.as_slice(), i as u32))
        .collect();
    let mut tokens = Vec::with_capacity(bytes.len());
    let mut types = Vec::with_capacity(bytes.len());
    let mut merges = Vec::new();
    for (id, b) in bytes.iter().enumerate() {
        if id == EOT as usize {
            tokens.push(Value::String("<|endoftext|>".into()));
            types.push(Value::I32(3));
            continue;
        }
        tokens.push(Value::String(text(b)));
        types.push(Value::I32(1));
        if b.len() > 1 {
            let Some((_, cut)) = split(b, id as u32, &ranks) else {
                bail!(
                    "GPT-2 token {id} ({:?}) is not a merge of two earlier tokens",
                    text(b)
                );
            };
            merges.push(Value::String(format!(
                "{} {}",
                text(&b[..cut]),
                text(&b[cut..])
            )));
        }
    }
    let s = |x: &str| Value::String(x.into());
    Ok(vec![
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("gpt-2")),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(EOT)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(EOT)),
        ("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)),
    ])
}
