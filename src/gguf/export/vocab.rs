//! A model directory's `tokenizer.json` and `tokenizer_config.json` as the `tokenizer.*`
//! metadata llama.cpp's `convert_hf_to_gguf.py` writes for a byte-level BPE tokenizer
//! (`_set_vocab_gpt2`).
//!
//! - `tokenizer.ggml.model` `gpt2`; `tokenizer.ggml.pre` by the pre-tokenizer: llama.cpp
//!   names it from the hash of a test text's tokens, memwall by comparing the file's
//!   normalizer and pre-tokenizer with the ones it writes for each name it knows
//!   (`super::super::tokenizer::pre_tokenizer`), so an unknown one is refused by name.
//! - `.tokens`: id by id, `vocab_size` of them (ids with no token are `[PAD{id}]`, type
//!   unused); `.token_type`: 1 normal, 3 control (an added token marked special, or one that
//!   looks special, `<|…|>`), 4 user-defined (other added tokens), 5 unused.
//! - `.merges` as `"a b"` strings (either of `tokenizer.json`'s two spellings is read).
//! - `.bos_token_id`, `.eos_token_id`, `.unknown_token_id`, `.padding_token_id` from
//!   `tokenizer_config.json`'s tokens (by content), else `config.json`'s ids;
//!   `.add_bos_token` / `.add_eos_token` and `tokenizer.chat_template` when the config has
//!   them; `.add_space_prefix` false (byte-level BPE adds no space).
//!
//! SentencePiece tokenizers (Llama 2, TinyLlama: `tokenizer.ggml.model` `llama`, which needs
//! scores) are refused for now, naming the file.

use crate::gguf::file::Value;
use crate::gguf::tokenizer::{SUPPORTED_PRE, pre_tokenizer};
use crate::model::ModelSpec;
use anyhow::{Context, Result, bail};
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::Path;

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// Whether an added token not marked special should still be a control token (llama.cpp's
/// `does_token_look_special`).
fn looks_special(t: &str) -> bool {
    ["<pad>", "<mask>", "<2mass>", "[@BOS@]"].contains(&t)
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// Reads a JSON file of `dir`; `None` when it is absent.
fn read_json(dir: &Path, name: &str) -> Result<Option<Json>> {
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
    // "gpt2" before its alias "default": llama.cpp's name for GPT-2's pre-tokenizer.
    for name in ["smollm", "llama-bpe", "qwen2", "gpt2"] {
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

/// A special token of `tokenizer_config.json` (a string or `{"content": ...}`).
fn config_token<'a>(cfg: &'a Json, key: &str) -> Option<&'a str> {
    match cfg.get(key)? {
        Json::String(s) => Some(s),
        Json::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

/// The `tokenizer.*` metadata for the model in `dir` (see the module doc).
pub fn metadata(dir: &Path, spec: &ModelSpec) -> Result<Vec<(String, Value)>> {
    let tok_path = dir.join("tokenizer.json");
    let path = tok_path.display().to_string();
    let Some(tok) = read_json(dir, "tokenizer.json")? else {
        bail!(
            "{path}: no such file; a GGUF file carries its tokenizer: copy the base model's \
             tokenizer.json and tokenizer_config.json into {}",
            dir.display()
        );
    };
    let cfg = read_json(dir, "tokenizer_config.json")?.unwrap_or(Json::Null);
    let model = &tok["model"];
    if model["type"] != "BPE" {
        bail!(
            "{path}: tokenizer model {} is not supported: memwall exports byte-level BPE tokenizers",
            model["type"]
        );
    }
    if model["byte_fallback"] == true {
        bail!(
            "{path}: a SentencePiece BPE tokenizer (byte_fallback, as Llama 2 and TinyLlama have) \
             is not exported yet: GGUF's `llama` tokenizer needs token scores"
        );
    }
    let pre = pre_name(&tok, &path)?;
    let vocab = model["vocab"]
        .as_object()
        .with_context(|| format!("{path}: model.vocab is not an object"))?;
    let n = spec.vocab_size;
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![NORMAL; n];
    let mut put = |t: &str, id: &Json, ty: i32| -> Result<()> {
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
        types[i] = ty;
        Ok(())
    };
    for (t, id) in vocab {
        put(t, id, NORMAL)?;
    }
    for a in tok["added_tokens"].as_array().into_iter().flatten() {
        let t = a["content"]
            .as_str()
            .with_context(|| format!("{path}: an added token has no content"))?;
        let special = a["special"] == true || looks_special(t);
        put(t, &a["id"], if special { CONTROL } else { USER_DEFINED })?;
    }
    let mut ids = HashMap::new();
    let tokens: Vec<Value> = tokens
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
    let from_config = |key: &str| config_token(&cfg, key).and_then(|t| ids.get(t).copied());
    let st = &spec.special_tokens;
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
    // Every pre-tokenizer `pre_name` accepts has ByteLevel's add_prefix_space false.
    md.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
    for key in ["add_bos_token", "add_eos_token"] {
        if let Some(b) = cfg.get(key).and_then(Json::as_bool) {
            md.push((format!("tokenizer.ggml.{key}"), Value::Bool(b)));
        }
    }
    if let Some(t) = cfg.get("chat_template").and_then(Json::as_str) {
        md.push(("tokenizer.chat_template".into(), Value::String(t.into())));
    }
    Ok(md)
}
