//! A SentencePiece BPE `tokenizer.json` (byte fallback: Llama 2, TinyLlama) as the
//! `tokenizer.*` metadata of GGUF's `llama` tokenizer, as llama.cpp's converter writes it for a
//! directory with only `tokenizer.json` (`_set_vocab_llama_hf`, gguf-py's `LlamaHfVocab`):
//!
//! - `tokenizer.ggml.model` `llama`, `.pre` `default`;
//! - `.tokens` id by id (ids with no token: `[PAD{id}]`, score −1000, type unused);
//! - `.token_type`: 6 (byte) for `<0xNN>`, 3 (control) for special tokens (added tokens marked
//!   special, and `tokenizer_config.json`'s bos/eos/unk/pad), 1 (normal) otherwise. One
//!   difference: an added token not marked special is 4 (user-defined) even when it is in
//!   `model.vocab` (`LlamaHfVocab` makes it normal then), so that `convert` gives it back as an
//!   added token;
//! - `.scores`: `LlamaHfVocab` writes −1000 for every token, which leaves llama.cpp's
//!   SentencePiece tokenizer (it merges the pair whose result scores highest) with nothing to
//!   rank merges by. memwall writes the merges' order instead: the k-th distinct piece the
//!   merges produce scores −k, every other token −1000. That is the order `convert` rebuilds
//!   the merges from (by score, then id: `crate::gguf::tokenizer`'s `spm_parts`), so convert →
//!   export → convert gives back the same `tokenizer.json`;
//! - bos/eos/unk/pad ids and `add_bos_token` / `add_eos_token` from `tokenizer_config.json`
//!   (gguf-py's `SpecialVocab`); `.add_space_prefix` false only when the normalizer does not
//!   prepend `▁` (llama.cpp's default is true).

use super::tokens::{
    CONTROL, NORMAL, UNUSED, USER_DEFINED, add_tokens, config_token, special_ids, token_table,
};
use crate::gguf::file::Value;
use crate::model::ModelSpec;
use anyhow::{Context, Result, bail};
use serde_json::Value as Json;
use std::collections::HashMap;

const BYTE: i32 = 6;
/// `LlamaHfVocab`'s score for every token.
const NO_SCORE: f32 = -1000.0;

/// Whether `t` is a byte token `<0xNN>`.
fn is_byte(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() == 6
        && t.starts_with("<0x")
        && t.ends_with('>')
        && b[3].is_ascii_hexdigit()
        && b[4].is_ascii_hexdigit()
}

/// Whether the normalizer prepends `▁` (SentencePiece's `add_dummy_prefix`).
fn prepends_space(n: &Json) -> bool {
    match n["type"].as_str() {
        Some("Prepend") => n["prepend"] == "\u{2581}",
        Some("Sequence") => n["normalizers"]
            .as_array()
            .is_some_and(|l| l.iter().any(prepends_space)),
        _ => false,
    }
}

/// The metadata (see the module doc).
pub(super) fn metadata(
    tok: &Json,
    cfg: &Json,
    path: &str,
    spec: &ModelSpec,
) -> Result<Vec<(String, Value)>> {
    let n = spec.vocab_size;
    let table = token_table(tok, path, n)?;
    let mut ids: HashMap<String, u32> = HashMap::new();
    for (i, t) in table.iter().enumerate() {
        if let Some(t) = t {
            ids.entry(t.clone()).or_insert(i as u32);
        }
    }
    let mut special = vec![false; n];
    let mut user = vec![false; n];
    for a in tok["added_tokens"].as_array().into_iter().flatten() {
        if let Some(i) = a["id"].as_u64() {
            let i = i as usize; // token_table checked it
            if a["special"] == true {
                special[i] = true;
            } else {
                user[i] = true;
            }
        }
    }
    for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
        if let Some(&i) = config_token(cfg, key).and_then(|t| ids.get(t)) {
            special[i as usize] = true;
        }
    }
    // Scores from the merges' order.
    let merges = tok["model"]["merges"]
        .as_array()
        .with_context(|| format!("{path}: model.merges is missing"))?;
    let mut scores = vec![NO_SCORE; n];
    let mut ranked = vec![false; n];
    let mut k = 0u32;
    for m in merges {
        let (a, b) = match m {
            Json::String(s) => s.split_once(' ').unwrap_or((s, "")),
            Json::Array(p) if p.len() == 2 => {
                (p[0].as_str().unwrap_or(""), p[1].as_str().unwrap_or(""))
            }
            _ => bail!("{path}: merge {m} is neither \"a b\" nor [\"a\", \"b\"]"),
        };
        if let Some(&i) = ids.get(&format!("{a}{b}")) {
            let i = i as usize;
            if !ranked[i] {
                ranked[i] = true;
                if k >= 1 << 24 {
                    bail!(
                        "{path}: more than 2^24 merged pieces; their ranks do not fit f32 scores"
                    );
                }
                scores[i] = -(k as f32);
                k += 1;
            }
        }
    }
    let mut tokens = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    for (i, t) in table.into_iter().enumerate() {
        let (t, ty) = match t {
            None => (format!("[PAD{i}]"), UNUSED),
            Some(t) if special[i] => (t, CONTROL),
            Some(t) if user[i] => (t, USER_DEFINED),
            Some(t) if is_byte(&t) => (t, BYTE),
            Some(t) => (t, NORMAL),
        };
        tokens.push(Value::String(t));
        types.push(Value::I32(ty));
    }
    let s = |x: &str| Value::String(x.into());
    let mut md = vec![
        ("tokenizer.ggml.model".to_string(), s("llama")),
        ("tokenizer.ggml.pre".into(), s("default")),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        (
            "tokenizer.ggml.scores".into(),
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
    ];
    md.extend(special_ids(cfg, &ids, spec));
    if !prepends_space(&tok["normalizer"]) {
        md.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
    }
    md.extend(add_tokens(cfg));
    Ok(md)
}
