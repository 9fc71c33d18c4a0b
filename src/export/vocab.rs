//! A model directory's `tokenizer.json` and `tokenizer_config.json` as the `tokenizer.*`
//! metadata llama.cpp's `convert_hf_to_gguf.py` writes for a byte-level BPE tokenizer
//! (`_set_vocab_gpt2`).
//!
//! - `tokenizer.ggml.model` `gpt2`; `tokenizer.ggml.pre` by the pre-tokenizer: llama.cpp
//!   names it from the hash of a test text's tokens, memwall by comparing the file's
//!   normalizer and pre-tokenizer with the ones it writes for each name it knows
//!   (`crate::gguf::tokenizer::pre_tokenizer`), so an unknown one is refused by name.
//! - `.tokens`: id by id, `vocab_size` of them (ids with no token are `[PAD{id}]`, type
//!   unused); `.token_type`: 1 normal, 3 control (an added token marked special, or one that
//!   looks special, `<|…|>`), 4 user-defined (other added tokens), 5 unused.
//! - `.merges` as `"a b"` strings (either of `tokenizer.json`'s two spellings is read).
//! - `.bos_token_id`, `.eos_token_id`, `.unknown_token_id`, `.padding_token_id` from
//!   `tokenizer_config.json`'s tokens (by content), else `config.json`'s ids;
//!   `.add_bos_token` / `.add_eos_token` and `tokenizer.chat_template` when the config has
//!   them; `.add_space_prefix` false (byte-level BPE adds no space).
//!
//! - `tokenizer.chat_template`: the directory's template, `chat_template.jinja` first, else
//!   `tokenizer_config.json`'s `chat_template` string.
//!
//! SentencePiece tokenizers (Llama 2, TinyLlama: a BPE `tokenizer.json` with byte fallback)
//! are written as `tokenizer.ggml.model` `llama` by `export::spm`. A GPT-2 model without
//! `tokenizer.json` (trained from a preset on GPT-2 data) gets GPT-2's own tokenizer
//! (`super::gpt2_vocab`).
//!
//! **The source's own keys.** A directory `memwall convert` made (or a checkpoint trained from
//! one) holds the source file's `tokenizer.*` keys in `tokenizer.gguf`
//! ([`crate::gguf::sidecar`]). When that file's `tokenizer.ggml.tokens` is `tokenizer.json`'s
//! vocabulary id by id, its keys are written as they are (values and types exact), except
//! `tokenizer.chat_template`, which is the directory's (a `--chat-template` run changes it);
//! otherwise a note on stderr says why, and the keys are rebuilt as above.

use super::tokens::{CONTROL, NORMAL, UNUSED, USER_DEFINED, add_tokens, special_ids, token_table};
use crate::gguf::file::Value;
use crate::gguf::tokenizer::{SUPPORTED_PRE, pre_tokenizer};
use crate::model::{Family, ModelSpec};
use anyhow::{Context, Result, bail};
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::Path;

/// Whether an added token not marked special should still be a control token (llama.cpp's
/// `does_token_look_special`).
pub(super) fn looks_special(t: &str) -> bool {
    ["<pad>", "<mask>", "<2mass>", "[@BOS@]"].contains(&t)
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// Reads a JSON file of `dir`; `None` when it is absent.
pub(super) fn read_json(dir: &Path, name: &str) -> Result<Option<Json>> {
    let path = dir.join(name);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text)
        .map(Some)
        .with_context(|| format!("{}: not valid JSON", path.display()))
}

/// The `tokenizer.ggml.pre` name whose normalizer and pre-tokenizer are the file's.
fn pre_name(tok: &Json, path: &str) -> Result<&'static str> {
    let norm = tok.get("normalizer").unwrap_or(&Json::Null);
    let pre = tok.get("pre_tokenizer").unwrap_or(&Json::Null);
    // "gpt-2" (llama.cpp's name for GPT-2's pre-tokenizer) before its aliases.
    for name in ["smollm", "llama-bpe", "qwen2", "gpt-2"] {
        let (n, p, _) = pre_tokenizer(name).expect("a known name");
        if &n == norm && &p == pre {
            return Ok(name);
        }
    }
    bail!(
        "{path}: the tokenizer's pre-tokenizer is none memwall can name for llama.cpp (it knows {}): \
         llama.cpp would split text differently; export a model whose tokenizer is one of those",
        SUPPORTED_PRE.join(", ")
    )
}

/// The directory's chat template: `chat_template.jinja`, else `tokenizer_config.json`'s
/// `chat_template` string.
fn chat_template(dir: &Path, cfg: &Json) -> Result<Option<String>> {
    let jinja = dir.join(crate::ckpt::CHAT_TEMPLATE_FILE);
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .with_context(|| format!("cannot read {}", jinja.display()));
    }
    Ok(cfg
        .get("chat_template")
        .and_then(Json::as_str)
        .map(String::from))
}

/// The `tokenizer.*` metadata for the model in `dir` (see the module doc).
pub fn metadata(dir: &Path, spec: &ModelSpec) -> Result<Vec<(String, Value)>> {
    let tok_path = dir.join("tokenizer.json");
    let path = tok_path.display().to_string();
    let cfg = read_json(dir, "tokenizer_config.json")?.unwrap_or(Json::Null);
    let template = chat_template(dir, &cfg)?;
    let Some(tok) = read_json(dir, "tokenizer.json")? else {
        if spec.family == Family::Gpt2 && spec.vocab_size == crate::data::tokenizer::GPT2_VOCAB {
            return Ok(with_template(super::gpt2_vocab::metadata()?, template));
        }
        bail!(
            "{path}: no such file; a GGUF file carries its tokenizer: copy the base model's \
             tokenizer.json and tokenizer_config.json into {}",
            dir.display()
        );
    };
    if let Some(keys) = crate::gguf::sidecar::read(dir)? {
        let table = token_table(&tok, &path, spec.vocab_size)?;
        let kept = match keys.iter().find(|(k, _)| k == "tokenizer.ggml.tokens") {
            Some((_, Value::Array(list))) => {
                list.len() == table.len()
                    && list.iter().zip(&table).all(|(v, t)| match (v, t) {
                        (Value::String(a), Some(b)) => a == b,
                        _ => false,
                    })
            }
            _ => false,
        };
        if kept {
            let keys = keys
                .into_iter()
                .filter(|(k, _)| k != "tokenizer.chat_template")
                .collect();
            return Ok(with_template(keys, template));
        }
        eprintln!(
            "note: {}: its tokenizer.ggml.tokens is not {path}'s vocabulary (the tokenizer was \
             changed after conversion); the tokenizer metadata is rebuilt from {path}",
            dir.join(crate::ckpt::TOKENIZER_GGUF_FILE).display()
        );
    }
    let model = &tok["model"];
    if model["type"] != "BPE" {
        bail!(
            "{path}: tokenizer model {} is not supported: memwall exports BPE tokenizers \
             (byte-level, or SentencePiece with byte fallback)",
            model["type"]
        );
    }
    let md = if model["byte_fallback"] == true {
        super::spm::metadata(&tok, &cfg, &path, spec)?
    } else {
        byte_level(&tok, &cfg, &path, spec)?
    };
    Ok(with_template(md, template))
}

/// `md` with `tokenizer.chat_template` set to `template` (in place when `md` has the key).
fn with_template(mut md: Vec<(String, Value)>, template: Option<String>) -> Vec<(String, Value)> {
    const KEY: &str = "tokenizer.chat_template";
    match (md.iter().position(|(k, _)| k == KEY), template) {
        (Some(i), Some(t)) => md[i].1 = Value::String(t),
        (Some(i), None) => {
            md.remove(i);
        }
        (None, Some(t)) => md.push((KEY.into(), Value::String(t))),
        (None, None) => {}
    }
    md
}

/// Byte-level BPE (`gpt2`), as `_set_vocab_gpt2` writes it (see the module doc).
fn byte_level(
    tok: &Json,
    cfg: &Json,
    path: &str,
    spec: &ModelSpec,
) -> Result<Vec<(String, Value)>> {
    let model = &tok["model"];
    let pre = pre_name(tok, path)?;
    let n = spec.vocab_size;
    let table = token_table(tok, path, n)?;
    let mut types = vec![NORMAL; n];
    for a in tok["added_tokens"].as_array().into_iter().flatten() {
        let t = a["content"]
            .as_str()
            .with_context(|| format!("{path}: an added token has no content"))?;
        let special = a["special"] == true || looks_special(t);
        if let Some(i) = a["id"].as_u64() {
            types[i as usize] = if special { CONTROL } else { USER_DEFINED };
        }
    }
    let mut ids = HashMap::new();
    let tokens: Vec<Value> = table
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let t = t.unwrap_or_else(|| {
                types[i] = UNUSED;
                format!("[PAD{i}]")
            });
            ids.entry(t.clone()).or_insert(i as u32);
            Value::String(t)
        })
        .collect();
    let merges = model["merges"]
        .as_array()
        .with_context(|| format!("{path}: model.merges is missing"))?
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(Value::String(s.clone())),
            Json::Array(p) if p.len() == 2 && p.iter().all(Json::is_string) => Ok(Value::String(
                format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()),
            )),
            _ => bail!("{path}: merge {m} is neither \"a b\" nor [\"a\", \"b\"]"),
        })
        .collect::<Result<Vec<_>>>()?;

    let mut md = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ];
    md.extend(special_ids(cfg, &ids, spec));
    // Every pre-tokenizer `pre_name` accepts has ByteLevel's add_prefix_space false.
    md.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
    md.extend(add_tokens(cfg));
    Ok(md)
}
