//! Hugging Face `tokenizer.json` tokenizers (Llama 3, Qwen2, SmolLM2, TinyLlama, ...), via the
//! `tokenizers` crate built without C or C++ code (`fancy-regex` for the pre-tokenizer regexes).
//!
//! * `inspect` reads what memwall needs without building the tokenizer: the content hash,
//!   the vocabulary size (largest id + 1, added tokens included), the end-of-text token and
//!   whether a document may be cut at newlines for parallel encoding. Training uses it to
//!   compare a model's tokenizer with its data at little memory cost.
//! * `Hf` is the tokenizer itself, for `prepare` and `sample`: ordinary text is encoded with
//!   no special-token parsing (`encode_special_tokens`) and nothing added (no BOS).
//!
//! The end-of-text token comes, in order, from `eos_token` of a `tokenizer_config.json` beside
//! the file, `eos_token_id` of a `config.json` beside it (when it is a token of this
//! vocabulary), or the first of [`EOT_CANDIDATES`] in the vocabulary.

use super::TokenizerId;
use super::fast::FastBpe;
use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Tokens taken as end-of-text when neither `tokenizer_config.json` nor `config.json` says.
pub const EOT_CANDIDATES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>"];

/// Pre-tokenizer regexes (a `Split`'s pattern) under which a cut just after a `'\n'` between
/// two non-whitespace characters is a pre-token boundary both in the whole text and at the
/// ends of the pieces (see [`super::split_points`]): no alternative starts with or crosses a
/// newline into a following non-space (`[^\r\n\p{L}\p{N}]?` excludes it; `[\r\n]*` and
/// `\s*[\r\n]+` stop at the non-space), and a lone trailing `"\n"` is matched by the same
/// alternative whether the text ends there or not.
const SPLIT_SAFE_PATTERNS: [&str; 3] = [
    // Llama 3 (and tiktoken's cl100k_base).
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    // Qwen2: single digits.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    // GPT-2's, as a Split (what `ByteLevel` with `use_regex` applies).
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
];

/// The parts of a `tokenizer.json` that [`inspect`] reads (the merges are skipped).
#[derive(Deserialize)]
struct FileJson {
    model: Option<ModelJson>,
    #[serde(default)]
    added_tokens: Vec<AddedJson>,
    #[serde(default)]
    normalizer: Option<Value>,
    #[serde(default)]
    pre_tokenizer: Option<Value>,
}

#[derive(Deserialize)]
struct ModelJson {
    #[serde(rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    vocab: Option<Value>,
}

#[derive(Deserialize)]
struct AddedJson {
    id: u32,
    content: String,
    #[serde(default)]
    special: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
}

/// What [`inspect`] learns about a `tokenizer.json`.
pub(super) struct Inspected {
    pub id: TokenizerId,
    /// Documents may be cut at [`super::split_points`] and encoded piece by piece.
    pub split_safe: bool,
    /// The added tokens, (id, content), as the file numbers them.
    added: Vec<(u32, String)>,
}

/// Reads `path`, naming it and saying what to pass instead when it is missing.
pub(super) fn read(path: &Path) -> Result<Vec<u8>> {
    let p = path.display();
    if !path.exists() {
        bail!(
            "tokenizer file '{p}' does not exist: pass `gpt2`, a model directory holding a \
             tokenizer.json, or the path of a tokenizer.json"
        );
    }
    std::fs::read(path).with_context(|| format!("cannot read tokenizer file '{p}'"))
}

/// Hex SHA-256 of the file's bytes (also the Hugging Face Hub's LFS object id of the file).
fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `hf:<name of the directory holding the file>`.
fn name_of(path: &Path) -> String {
    let full = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let dir = full
        .parent()
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "tokenizer.json".into());
    format!("hf:{dir}")
}

/// Validates `bytes` (the content of `path`) as a BPE `tokenizer.json` and derives its
/// [`TokenizerId`] and split safety.
pub(super) fn inspect(path: &Path, bytes: &[u8]) -> Result<Inspected> {
    let p = path.display();
    let file: FileJson = serde_json::from_slice(bytes).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            anyhow!(
                "tokenizer file '{p}' is not valid JSON ({e}): it is corrupt or truncated; \
                 copy the model's tokenizer.json again"
            )
        } else {
            anyhow!("tokenizer file '{p}' is not a Hugging Face tokenizer.json: {e}")
        }
    })?;
    let Some(model) = file.model else {
        bail!("tokenizer file '{p}' has no 'model' field: it is not a Hugging Face tokenizer.json");
    };
    match model.kind.as_deref() {
        Some("BPE") | None => {}
        Some(other) => bail!(
            "tokenizer file '{p}': model type '{other}' is not supported: memwall reads BPE \
             tokenizers (GPT-2, Llama, Qwen2, SmolLM2, TinyLlama)"
        ),
    }
    let Some(vocab) = model.vocab else {
        bail!("tokenizer file '{p}': 'model' has no 'vocab': it is not a BPE tokenizer.json");
    };
    let vocab: HashMap<String, u32> = serde_json::from_value(vocab).map_err(|e| {
        anyhow!("tokenizer file '{p}': 'model.vocab' is not a map of token to id: {e}")
    })?;
    let vocab_size = vocab
        .values()
        .copied()
        .chain(file.added_tokens.iter().map(|t| t.id))
        .max()
        .map(|m| m as usize + 1)
        .ok_or_else(|| anyhow!("tokenizer file '{p}' has an empty vocabulary"))?;
    // As the tokenizers crate looks a token up: added tokens first, then the model's vocabulary.
    let lookup = |s: &str| {
        file.added_tokens
            .iter()
            .find(|t| t.content == s)
            .map(|t| t.id)
            .or_else(|| vocab.get(s).copied())
    };
    let eot = resolve_eot(path, &lookup, vocab_size)?;
    let split_safe = split_safe(
        file.normalizer.as_ref(),
        file.pre_tokenizer.as_ref(),
        &file.added_tokens,
    );
    Ok(Inspected {
        id: TokenizerId {
            name: name_of(path),
            hash: sha256_hex(bytes),
            vocab_size,
            eot,
        },
        split_safe,
        added: file
            .added_tokens
            .into_iter()
            .map(|t| (t.id, t.content))
            .collect(),
    })
}

/// Reads a JSON file beside the tokenizer; `None` when it does not exist.
fn read_beside(path: &Path) -> Result<Option<(PathBuf, Value)>> {
    if !path.is_file() {
        return Ok(None);
    }
    let p = path.display();
    let raw = std::fs::read(path).with_context(|| format!("cannot read '{p}'"))?;
    let v = serde_json::from_slice(&raw).with_context(|| {
        format!("'{p}' is not valid JSON: it is corrupt; fix or remove it (memwall reads the end-of-text token from it)")
    })?;
    Ok(Some((path.to_path_buf(), v)))
}

/// The end-of-text token of the tokenizer at `path` (see the module docs for the order).
fn resolve_eot(
    path: &Path,
    lookup: &dyn Fn(&str) -> Option<u32>,
    vocab_size: usize,
) -> Result<u32> {
    let dir = path.parent().unwrap_or(Path::new("."));
    if let Some((tc, v)) = read_beside(&dir.join("tokenizer_config.json"))? {
        let tcd = tc.display();
        let name = match v.get("eos_token") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.as_str()),
            Some(Value::Object(o)) => match o.get("content") {
                Some(Value::String(s)) => Some(s.as_str()),
                _ => bail!("'{tcd}': field 'eos_token' is an object without a string 'content'"),
            },
            Some(other) => bail!(
                "'{tcd}': field 'eos_token' is {other}; expected a token string or {{\"content\": \"...\"}}"
            ),
        };
        if let Some(name) = name {
            return lookup(name).ok_or_else(|| {
                anyhow!(
                    "'{tcd}': eos_token '{name}' is not in the vocabulary of '{}': fix eos_token",
                    path.display()
                )
            });
        }
    }
    // A model's config.json may carry a default eos_token_id that is not this tokenizer's
    // (GPT2Config's 50256 whatever the vocabulary): such an id is passed over, and named in
    // the error when nothing else decides.
    let mut passed_over = String::new();
    if let Some((cfg, v)) = read_beside(&dir.join("config.json"))? {
        let cd = cfg.display();
        let id = match v.get("eos_token_id") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => a.first(),
            Some(x) => Some(x),
        };
        if let Some(raw) = id {
            let Some(id) = raw.as_u64() else {
                bail!(
                    "'{cd}': eos_token_id {raw} is not a token id; expected a number or a list of numbers"
                );
            };
            if (id as usize) < vocab_size {
                return Ok(id as u32);
            }
            passed_over =
                format!(" ('{cd}' has eos_token_id {id}, outside this vocabulary of {vocab_size})");
        }
    }
    for name in EOT_CANDIDATES {
        if let Some(id) = lookup(name) {
            return Ok(id);
        }
    }
    bail!(
        "cannot tell the end-of-text token of '{}': there is no tokenizer_config.json with \
         eos_token nor config.json with a valid eos_token_id beside it{passed_over}, and none of \
         {} is in its vocabulary; add a tokenizer_config.json beside it with \
         {{\"eos_token\": \"<the token that ends a document>\"}}",
        path.display(),
        EOT_CANDIDATES.join(", ")
    )
}

/// Whether cutting a document just after a `'\n'` between two non-whitespace characters
/// leaves its tokens unchanged: a per-character normalizer (or none), pre-tokenizers that
/// split there (GPT-2's byte-level regex or one of [`SPLIT_SAFE_PATTERNS`]) and never add a
/// prefix space, and no non-special added token that could match across the cut. Anything
/// else (SentencePiece-style `Prepend`/`Metaspace`, unknown regexes) is encoded whole.
fn split_safe(normalizer: Option<&Value>, pre: Option<&Value>, added: &[AddedJson]) -> bool {
    fn kind(v: &Value) -> &str {
        v.get("type").and_then(Value::as_str).unwrap_or("")
    }
    fn normalizer_ok(v: &Value) -> bool {
        match kind(v) {
            "NFC" | "NFKC" | "NFD" | "NFKD" => true,
            "Sequence" => v
                .get("normalizers")
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().all(normalizer_ok)),
            _ => false,
        }
    }
    /// `Some(splits at the cut)` for an allowed pre-tokenizer, `None` for another.
    fn pre_ok(v: &Value) -> Option<bool> {
        let no_prefix = v.get("add_prefix_space").and_then(Value::as_bool) == Some(false);
        match kind(v) {
            "ByteLevel" if no_prefix => {
                Some(v.get("use_regex").and_then(Value::as_bool).unwrap_or(true))
            }
            "Digits" => Some(false),
            "Split" => {
                let pattern = v.get("pattern")?.get("Regex")?.as_str()?;
                let isolated = v.get("behavior").and_then(Value::as_str) == Some("Isolated");
                let inverted = v.get("invert").and_then(Value::as_bool).unwrap_or(false);
                (isolated && !inverted && SPLIT_SAFE_PATTERNS.contains(&pattern)).then_some(true)
            }
            "Sequence" => {
                let mut splits = false;
                for p in v.get("pretokenizers")?.as_array()? {
                    splits |= pre_ok(p)?;
                }
                Some(splits)
            }
            _ => None,
        }
    }
    let norm = normalizer.is_none_or(|n| n.is_null() || normalizer_ok(n));
    let pre = pre.is_some_and(|p| pre_ok(p) == Some(true));
    let added = added
        .iter()
        .filter(|t| !t.special)
        .all(|t| !t.lstrip && !t.rstrip && !t.content.chars().any(char::is_whitespace));
    norm && pre && added
}

/// Each token's byte range `(start, end)` in the text it was encoded from.
pub type Offsets = Vec<(usize, usize)>;

/// A loaded `tokenizer.json`.
pub(super) struct Hf {
    tok: tokenizers::Tokenizer,
    vocab_size: usize,
    /// The same tokenizer parsing special tokens, for rendered chat text (made on first use),
    /// and its fast path where it has one ([`super::fast`]).
    special: std::sync::OnceLock<(tokenizers::Tokenizer, Option<FastBpe>)>,
}

impl Hf {
    /// Builds the tokenizer from the bytes of `path` (already [`inspect`]ed as `seen`),
    /// checking that the library numbers the tokens as the file does.
    pub(super) fn build(path: &Path, bytes: &[u8], seen: &Inspected) -> Result<Hf> {
        let p = path.display();
        let mut tok = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| {
            anyhow!(
                "tokenizer file '{p}' is not a tokenizer.json that the tokenizers library reads: {e}"
            )
        })?;
        // The library numbers added tokens missing from the model's vocabulary itself, after
        // it; a file whose ids disagree would make `meta.json` lie about the vocabulary.
        for (id, content) in &seen.added {
            let got = tok.token_to_id(content);
            if got != Some(*id) {
                bail!(
                    "tokenizer file '{p}' is inconsistent: added token '{content}' has id {id} in \
                     the file but {got:?} when loaded; copy the model's tokenizer.json again"
                );
            }
        }
        let vocab_size = seen.id.vocab_size;
        let loaded = tok
            .get_vocab(true)
            .into_values()
            .max()
            .map_or(0, |m| m as usize + 1);
        if loaded != vocab_size {
            bail!(
                "tokenizer file '{p}' is inconsistent: its ids go up to {} but {} when loaded",
                vocab_size - 1,
                loaded.saturating_sub(1)
            );
        }
        // Ordinary text: `<|endoftext|>` written in a document is text, not the token.
        tok.set_encode_special_tokens(true);
        Ok(Hf {
            tok,
            vocab_size,
            special: std::sync::OnceLock::new(),
        })
    }

    /// Encodes ordinary text: no special-token parsing, no BOS or other added tokens.
    pub(super) fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode_fast(text, false)
            .map_err(|e| anyhow!("the tokenizer failed on the text: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes rendered chat text as transformers' `apply_chat_template(tokenize=True)` does
    /// (`add_special_tokens=False`): special tokens written in the text are parsed, nothing is
    /// added. Returns the ids and each token's byte range in `text`.
    pub(super) fn encode_special(&self, text: &str) -> Result<(Vec<u32>, Offsets)> {
        let (tok, fast) = self.special.get_or_init(|| {
            let mut t = self.tok.clone();
            t.set_encode_special_tokens(false);
            let fast = FastBpe::new(&t);
            (t, fast)
        });
        if let Some(fast) = fast {
            return fast.encode(text);
        }
        let enc = tok
            .encode(text, false)
            .map_err(|e| anyhow!("the tokenizer failed on the text: {e}"))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Decodes tokens; cut UTF-8 becomes U+FFFD (the byte-level and byte-fallback decoders
    /// are lossy), as does a token outside the vocabulary.
    pub(super) fn decode(&self, ids: &[u32]) -> String {
        let known = |t: u32| (t as usize) < self.vocab_size && self.tok.id_to_token(t).is_some();
        if ids.iter().all(|&t| known(t)) {
            return self.decode_run(ids);
        }
        let mut out = String::new();
        let mut run = Vec::new();
        for &t in ids {
            if known(t) {
                run.push(t);
            } else {
                out.push_str(&self.decode_run(&run));
                run.clear();
                out.push('\u{FFFD}');
            }
        }
        out.push_str(&self.decode_run(&run));
        out
    }

    fn decode_run(&self, ids: &[u32]) -> String {
        if ids.is_empty() {
            return String::new();
        }
        self.tok
            .decode(ids, false)
            .unwrap_or_else(|_| "\u{FFFD}".repeat(ids.len()))
    }
}

impl TokenizerId {
    /// The identity of a `tokenizer.json`, read without building the tokenizer (the merges
    /// are not loaded): what training compares with its data.
    pub fn of_file(path: &Path) -> Result<TokenizerId> {
        let bytes = read(path)?;
        Ok(inspect(path, &bytes)?.id)
    }
}
