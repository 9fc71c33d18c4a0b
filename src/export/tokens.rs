//! What the tokenizer metadata writers ([`super::vocab`], and the SentencePiece one) share:
//! GGUF's token types, `tokenizer.json`'s tokens id by id, the special token ids and the
//! `add_bos_token` / `add_eos_token` flags of `tokenizer_config.json`.

use crate::gguf::file::Value;
use crate::model::ModelSpec;
use anyhow::{Context, Result, bail};
use serde_json::Value as Json;
use std::collections::HashMap;

/// GGUF token types (`llama_token_type`).
pub(super) const NORMAL: i32 = 1;
pub(super) const CONTROL: i32 = 3;
pub(super) const USER_DEFINED: i32 = 4;
pub(super) const UNUSED: i32 = 5;

/// A special token of `tokenizer_config.json` (a string or `{"content": ...}`).
pub(super) fn config_token<'a>(cfg: &'a Json, key: &str) -> Option<&'a str> {
    match cfg.get(key)? {
        Json::String(s) => Some(s),
        Json::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

/// The tokens of `tokenizer.json` id by id (`model.vocab` and `added_tokens`), `n` of them.
pub(super) fn token_table(tok: &Json, path: &str, n: usize) -> Result<Vec<Option<String>>> {
    let vocab = tok["model"]["vocab"]
        .as_object()
        .with_context(|| format!("{path}: model.vocab is not an object"))?;
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let entries = vocab.iter().map(|(t, id)| (t.as_str(), id)).chain(
        tok["added_tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| (a["content"].as_str().unwrap_or(""), &a["id"])),
    );
    for (t, id) in entries {
        let i = id
            .as_u64()
            .with_context(|| format!("{path}: token {t:?} has id {id}, not an integer"))?
            as usize;
        if i >= n {
            bail!(
                "{path}: token {t:?} has id {i}, but the model's vocab_size is {n} (config.json)"
            );
        }
        tokens[i] = Some(t.to_string());
    }
    Ok(tokens)
}

/// The `bos`/`eos`/`unknown`/`padding` token ids (from `tokenizer_config.json`'s tokens, by
/// content, else `config.json`'s ids) as `tokenizer.ggml.*_token_id`, then `add_bos_token` /
/// `add_eos_token` when the config has them.
pub(super) fn special_ids(
    cfg: &Json,
    ids: &HashMap<String, u32>,
    spec: &ModelSpec,
) -> Vec<(String, Value)> {
    let from_config = |key: &str| config_token(cfg, key).and_then(|t| ids.get(t).copied());
    let st = &spec.special_tokens;
    let mut md = Vec::new();
    for (key, id) in [
        ("bos", from_config("bos_token").or(st.bos)),
        ("eos", from_config("eos_token").or(st.eos.first().copied())),
        ("unknown", from_config("unk_token")),
        ("padding", from_config("pad_token")),
    ] {
        if let Some(id) = id {
            md.push((format!("tokenizer.ggml.{key}_token_id"), Value::U32(id)));
        }
    }
    md
}

/// `add_bos_token` / `add_eos_token` as the config has them.
pub(super) fn add_tokens(cfg: &Json) -> Vec<(String, Value)> {
    ["add_bos_token", "add_eos_token"]
        .into_iter()
        .filter_map(|key| {
            let b = cfg.get(key)?.as_bool()?;
            Some((format!("tokenizer.ggml.{key}"), Value::Bool(b)))
        })
        .collect()
}
