//! A Hugging Face `tokenizer.json` (and `tokenizer_config.json`) rebuilt from a GGUF file's
//! `tokenizer.ggml.*` metadata.
//!
//! GGUF keeps the vocabulary (`tokens`), the BPE `merges`, each token's `token_type`
//! (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), the special token ids
//! and `add_bos_token` / `add_eos_token`, but the pre-tokenizer only by name
//! (`tokenizer.ggml.pre`, as llama.cpp's `convert_hf_to_gguf.py` recognised it). So the
//! pre-tokenizers are written here from what those models' own `tokenizer.json` files say:
//!
//! | `pre`             | HF pre-tokenizer                                                      |
//! |-------------------|-----------------------------------------------------------------------|
//! | `gpt-2`, `gpt2`, `default` | ByteLevel (GPT-2 regex)                                      |
//! | `smollm`          | Digits (one by one), ByteLevel (GPT-2 regex)                          |
//! | `llama-bpe`       | Split (Llama 3 regex: digits in groups of up to 3), ByteLevel without regex |
//! | `qwen2`           | NFC normalizer; Split (Qwen2 regex: digits one by one), ByteLevel without regex |
//!
//! `tokenizer.ggml.model` `gpt2` is byte-level BPE as above (ByteLevel decoder and
//! post-processor). `llama` is SentencePiece BPE with byte fallback, written as transformers'
//! `LlamaConverter` does (`▁` for spaces, `<0xNN>` byte tokens, merges rebuilt from the
//! scores; `tokenizer.ggml.pre` does not apply). Other models (`bert`, `t5`, ...) are refused
//! by name. Unknown and control tokens become special added tokens, user-defined ones plain
//! added tokens; a template adds BOS / EOS when the file asks for them.

use super::file::GgufFile;
use anyhow::{Context, Result, bail};
use serde_json::{Map, Value as Json, json};

/// Llama 3's pre-tokenizer regex (its `tokenizer.json`, `Split` pattern).
pub const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer regex (its `tokenizer.json`, `Split` pattern).
pub const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` names this module writes pre-tokenizers for.
pub const SUPPORTED_PRE: &[&str] = &["default", "gpt-2", "gpt2", "smollm", "llama-bpe", "qwen2"];

/// GGUF token types (`llama_token_type`).
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The tokenizer files of a converted model.
#[derive(Clone, Debug)]
pub struct HfTokenizer {
    /// `tokenizer.json`.
    pub tokenizer_json: Json,
    /// `tokenizer_config.json` (special tokens by content, `add_bos_token`, chat template).
    pub tokenizer_config: Json,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// `tokenizer.ggml.model` and `tokenizer.ggml.pre`, for the summary.
    pub model: String,
    pub pre: String,
}

/// The byte-level alphabet (GPT-2's `bytes_to_unicode`): byte b is written as character
/// `alphabet[b]`; printable Latin-1 bytes stand for themselves, the other 68 bytes map to
/// U+0100 onwards in byte order (space is `Ġ`, newline `Ċ`).
pub fn byte_level_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        out[b as usize] = if printable {
            char::from_u32(b).expect("Latin-1")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below U+0200")
        };
    }
    out
}

fn byte_level(use_regex: bool, trim_offsets: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": trim_offsets, "use_regex": use_regex})
}

fn split(regex: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

/// The normalizer, pre-tokenizer and `ignore_merges` for pre-tokenizer name `pre` (also how
/// `export` names a `tokenizer.json`'s pre-tokenizer).
pub(crate) fn pre_tokenizer(pre: &str) -> Result<(Json, Json, bool)> {
    Ok(match pre {
        "default" | "gpt-2" | "gpt2" => (Json::Null, byte_level(true, true), false),
        "smollm" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true, true),
            ]}),
            false,
        ),
        "llama-bpe" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false, true)]}),
            true,
        ),
        "qwen2" => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false, false)]}),
            false,
        ),
        other => bail!(
            "tokenizer.ggml.pre {other:?} is not supported (memwall knows {}): its pre-tokenizer regex is not in the file",
            SUPPORTED_PRE.join(", ")
        ),
    })
}

/// Reads the tokenizer metadata of `f` and writes the HF files' JSON; `context` is the
/// model's context length (`model_max_length`).
pub fn from_gguf(f: &GgufFile, context: usize) -> Result<HfTokenizer> {
    let path = f.path().display().to_string();
    let model = f.get_str("tokenizer.ggml.model")?.with_context(|| {
        format!("{path}: metadata tokenizer.ggml.model is missing (the file has no tokenizer)")
    })?;
    let spm = match model {
        "gpt2" => false,
        "llama" => true,
        other => {
            let what = match other {
                "bert" => " (WordPiece)",
                "t5" => " (SentencePiece unigram)",
                "rwkv" => " (RWKV)",
                _ => "",
            };
            bail!(
                "{path}: tokenizer.ggml.model {other:?}{what} is not supported; memwall converts gpt2 (byte-level BPE) and llama (SentencePiece BPE) tokenizers"
            );
        }
    };
    let tokens = f
        .get_str_array("tokenizer.ggml.tokens")?
        .with_context(|| format!("{path}: metadata tokenizer.ggml.tokens is missing"))?;
    let types = match f.get_int_array("tokenizer.ggml.token_type")? {
        Some(t) if t.len() == tokens.len() => t,
        Some(t) => bail!(
            "{path}: tokenizer.ggml.token_type has {} entries for {} tokens",
            t.len(),
            tokens.len()
        ),
        None => vec![1; tokens.len()],
    };
    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        vocab.entry(tok.to_string()).or_insert(json!(id));
        if ty == UNKNOWN || ty == CONTROL || ty == USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty != USER_DEFINED,
            }));
        }
    }
    let special = |key: &str| -> Result<Option<(u64, String)>> {
        let k = format!("tokenizer.ggml.{key}_token_id");
        match f.get_u64(&k)? {
            None => Ok(None),
            Some(id) => match tokens.get(id as usize) {
                Some(t) => Ok(Some((id, t.to_string()))),
                None => bail!("{path}: {k} = {id} is outside the {} tokens", tokens.len()),
            },
        }
    };
    let bos = special("bos")?;
    let eos = special("eos")?;
    let unk = special("unknown")?;
    let pad = special("padding")?;
    // llama.cpp's defaults: SentencePiece vocabularies add BOS, byte-level ones do not.
    let add_bos = f.get_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(spm);
    let add_eos = f.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);

    let (pre, parts) = if spm {
        (
            "sentencepiece".to_string(),
            spm_parts(f, &tokens, &vocab, &unk)?,
        )
    } else {
        let pre = f.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
        (pre.to_string(), bpe_parts(f, pre)?)
    };
    let post_processor =
        with_template(parts.post, add_bos, add_eos, &bos, &eos).with_context(|| path.clone())?;
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": parts.normalizer,
        "pre_tokenizer": parts.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": parts.decoder,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": parts.unk_token,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": spm,
            "byte_fallback": spm,
            "ignore_merges": parts.ignore_merges,
            "vocab": vocab,
            "merges": parts.merges,
        },
    });
    let mut cfg = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": false,
        "model_max_length": context,
    });
    for (key, tok) in [
        ("bos_token", &bos),
        ("eos_token", &eos),
        ("unk_token", &unk),
        ("pad_token", &pad),
    ] {
        if let Some((_, t)) = tok {
            cfg[key] = json!(t);
        }
    }
    if let Some(t) = f.get_str("tokenizer.chat_template")? {
        cfg["chat_template"] = json!(t);
    }
    Ok(HfTokenizer {
        tokenizer_json,
        tokenizer_config: cfg,
        vocab_size: tokens.len(),
        model: model.to_string(),
        pre,
    })
}

/// The parts of `tokenizer.json` that differ between byte-level and SentencePiece BPE.
struct Parts {
    normalizer: Json,
    pre_tokenizer: Json,
    /// The post-processor before any BOS / EOS template.
    post: Json,
    decoder: Json,
    unk_token: Json,
    ignore_merges: bool,
    merges: Vec<Json>,
}

/// Byte-level BPE (`gpt2`): merges from the file, pre-tokenizer by name, ByteLevel decoder.
fn bpe_parts(f: &GgufFile, pre: &str) -> Result<Parts> {
    let path = f.path().display().to_string();
    let (normalizer, pre_tokenizer, ignore_merges) =
        pre_tokenizer(pre).with_context(|| path.clone())?;
    let merges = f.get_str_array("tokenizer.ggml.merges")?.with_context(|| {
        format!("{path}: metadata tokenizer.ggml.merges is missing (a gpt2 tokenizer needs its BPE merges)")
    })?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok(json!([a, b])),
            _ => bail!(
                "{path}: tokenizer.ggml.merges[{i}] {m:?} is not two tokens separated by a space"
            ),
        })
        .collect::<Result<_>>()?;
    Ok(Parts {
        normalizer,
        pre_tokenizer,
        post: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        unk_token: Json::Null,
        ignore_merges,
        merges,
    })
}

/// SentencePiece BPE (`llama`), as transformers' `LlamaConverter` writes it: spaces become
/// `▁` (and one is prepended when `tokenizer.ggml.add_space_prefix`, default true), no
/// pre-tokenizer, byte fallback to the `<0xNN>` tokens, and merges rebuilt from the scores
/// the way `SentencePieceExtractor` does: every split of a piece into two vocabulary pieces,
/// ranked by the merged piece's score (highest first).
fn spm_parts(
    f: &GgufFile,
    tokens: &[&str],
    vocab: &Map<String, Json>,
    unk: &Option<(u64, String)>,
) -> Result<Parts> {
    let path = f.path().display().to_string();
    let scores = match f.get("tokenizer.ggml.scores") {
        Some(super::file::Value::Array(v)) if v.len() == tokens.len() => v
            .iter()
            .map(|x| x.as_f64())
            .collect::<Option<Vec<f64>>>()
            .with_context(|| format!("{path}: tokenizer.ggml.scores must be numbers"))?,
        Some(_) => bail!(
            "{path}: tokenizer.ggml.scores must be an array of one number per token ({})",
            tokens.len()
        ),
        None => bail!(
            "{path}: metadata tokenizer.ggml.scores is missing (a SentencePiece tokenizer needs them to rank its merges)"
        ),
    };
    let id = |t: &str| vocab.get(t).and_then(Json::as_u64);
    // (score of the merged piece, its id, left id, right id, left, right)
    let mut merges: Vec<(f64, u64, u64, u64, &str, &str)> = Vec::new();
    for (i, (&piece, &score)) in tokens.iter().zip(&scores).enumerate() {
        for (cut, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(cut);
            if let (Some(li), Some(ri)) = (id(l), id(r)) {
                merges.push((score, i as u64, li, ri, l, r));
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    let add_prefix = f
        .get_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let replace_space =
        json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let normalizer = if add_prefix {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, replace_space]})
    } else {
        replace_space
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    Ok(Parts {
        normalizer,
        pre_tokenizer: Json::Null,
        post: Json::Null,
        decoder: json!({"type": "Sequence", "decoders": decoders}),
        unk_token: unk.as_ref().map_or(Json::Null, |u| json!(u.1)),
        ignore_merges: false,
        merges: merges.iter().map(|m| json!([m.4, m.5])).collect(),
    })
}

/// `post` followed by a template adding BOS and/or EOS (as Llama's `tokenizer.json` does).
fn with_template(
    post: Json,
    add_bos: bool,
    add_eos: bool,
    bos: &Option<(u64, String)>,
    eos: &Option<(u64, String)>,
) -> Result<Json> {
    if !add_bos && !add_eos {
        return Ok(post);
    }
    let mut specials = Map::new();
    let mut piece =
        |on: bool, tok: &Option<(u64, String)>, which: &str| -> Result<Option<String>> {
            if !on {
                return Ok(None);
            }
            let Some((id, t)) = tok else {
                bail!("tokenizer.ggml.add_{which}_token is true but {which}_token_id is missing");
            };
            specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
            Ok(Some(t.clone()))
        };
    let b = piece(add_bos, bos, "bos")?;
    let e = piece(add_eos, eos, "eos")?;
    let mut single = Vec::new();
    let mut pair = Vec::new();
    for (list, seqs) in [(&mut single, &["A"][..]), (&mut pair, &["A", "B"][..])] {
        for (type_id, s) in seqs.iter().enumerate() {
            if let Some(b) = &b {
                list.push(json!({"SpecialToken": {"id": b, "type_id": type_id}}));
            }
            list.push(json!({"Sequence": {"id": s, "type_id": type_id}}));
            if let Some(e) = &e {
                list.push(json!({"SpecialToken": {"id": e, "type_id": type_id}}));
            }
        }
    }
    let template = json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials});
    Ok(if post.is_null() {
        template
    } else {
        json!({"type": "Sequence", "processors": [post, template]})
    })
}

/// Loads `tokenizer.json` text in the `tokenizers` crate: what transformers' fast tokenizer
/// will do with the file.
pub fn load(json_text: &str) -> Result<tokenizers::Tokenizer> {
    json_text.parse::<tokenizers::Tokenizer>().map_err(|e| {
        anyhow::anyhow!("the tokenizers crate rejects the tokenizer.json written: {e}")
    })
}

#[cfg(test)]
mod tests {
    use super::super::file::Value;
    use super::super::testutil::{GgufWriter, s, write_temp};
    use super::*;

    fn tok_file(pre: Option<&str>, add_bos: bool) -> GgufWriter {
        let mut w = GgufWriter::new(3);
        w.tokenizer(pre, add_bos);
        w
    }

    fn build(w: &GgufWriter) -> Result<(HfTokenizer, tokenizers::Tokenizer)> {
        let (_dir, path) = write_temp(&w.to_bytes());
        let f = GgufFile::open(&path)?;
        let t = from_gguf(&f, 2048)?;
        let tk = load(&t.tokenizer_json.to_string())?;
        Ok((t, tk))
    }

    fn pieces(tk: &tokenizers::Tokenizer, text: &str) -> Vec<String> {
        tk.encode(text, false).unwrap().get_tokens().to_vec()
    }

    fn round_trip(tk: &tokenizers::Tokenizer, text: &str) {
        let ids = tk.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tk.decode(&ids, false).unwrap(), text, "ids {ids:?}");
    }

    const TEXTS: [&str; 4] = [
        "hello the world 12345",
        "héllo wörld ✓ 日本語\n\ttabs  and  spaces",
        " leading space, trailing space ",
        "<|im_start|>user\nhi<|im_end|> <my_tok>",
    ];

    #[test]
    fn byte_level_alphabet_is_gpt2s() {
        let a = byte_level_alphabet();
        assert_eq!(
            (a[b' ' as usize], a[b'\n' as usize], a[b'A' as usize]),
            ('Ġ', 'Ċ', 'A')
        );
        assert_eq!((a[0], a[0xAD], a[0xFF]), ('Ā', 'Ń', 'ÿ'));
        let mut sorted = a.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256, "a bijection");
    }

    #[test]
    fn smollm_splits_digits_one_by_one_and_round_trips() {
        let (t, tk) = build(&tok_file(Some("smollm"), false)).unwrap();
        assert_eq!(t.vocab_size, 3 + 256 + 6 + 1);
        assert_eq!(tk.get_vocab_size(true), t.vocab_size);
        assert_eq!(
            pieces(&tk, "hello the 123"),
            ["hell", "o", "Ġthe", "Ġ", "1", "2", "3"]
        );
        for text in TEXTS {
            round_trip(&tk, text);
        }
        let ids = tk
            .encode("<|im_start|>hi<my_tok>", false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(ids[0], 1, "control token matched as one id");
        assert_eq!(
            *ids.last().unwrap(),
            3 + 256 + 6,
            "user-defined token matched"
        );
        assert_eq!(
            tk.decode(&ids, true).unwrap(),
            "hi<my_tok>",
            "specials skipped, user token kept"
        );
        assert_eq!(t.tokenizer_config["bos_token"], "<|im_start|>");
        assert_eq!(t.tokenizer_config["eos_token"], "<|im_end|>");
    }

    #[test]
    fn gpt2_pre_tokenizer_keeps_digit_runs_together() {
        let (_, tk) = build(&tok_file(Some("gpt2"), false)).unwrap();
        assert_eq!(pieces(&tk, "x 123"), ["x", "Ġ", "12", "3"]);
        let (_, tk) = build(&tok_file(None, false)).unwrap();
        assert_eq!(
            pieces(&tk, "x 123"),
            ["x", "Ġ", "12", "3"],
            "absent pre is default"
        );
        for text in TEXTS {
            round_trip(&tk, text);
        }
    }

    #[test]
    fn llama_bpe_groups_three_digits_and_qwen2_one() {
        let (_, tk) = build(&tok_file(Some("llama-bpe"), false)).unwrap();
        // Llama 3: digits in groups of up to three, each group its own pre-token.
        assert_eq!(pieces(&tk, "12345"), ["12", "3", "4", "5"]);
        assert_eq!(pieces(&tk, "hello the"), ["hell", "o", "Ġthe"]);
        for text in TEXTS {
            round_trip(&tk, text);
        }
        let (_, tk) = build(&tok_file(Some("qwen2"), false)).unwrap();
        assert_eq!(pieces(&tk, "12345"), ["1", "2", "3", "4", "5"]);
        for text in TEXTS {
            round_trip(&tk, text);
        }
    }

    #[test]
    fn add_bos_token_prepends_bos() {
        let (t, tk) = build(&tok_file(Some("smollm"), true)).unwrap();
        let ids = tk.encode("he", true).unwrap().get_ids().to_vec();
        assert_eq!(ids, [1, 3 + 256 + 1]);
        assert_eq!(tk.encode("he", false).unwrap().get_ids(), [3 + 256 + 1]);
        assert_eq!(t.tokenizer_config["add_bos_token"], true);
    }

    #[test]
    fn unknown_models_and_pre_tokenizers_are_refused_by_name() {
        let e = format!(
            "{:#}",
            build(&tok_file(Some("deepseek-coder"), false)).unwrap_err()
        );
        assert!(
            e.contains("\"deepseek-coder\"") && e.contains("smollm"),
            "{e}"
        );
        let mut w = GgufWriter::new(3);
        w.kv("tokenizer.ggml.model", s("bert"));
        let e = format!("{:#}", build(&w).unwrap_err());
        assert!(e.contains("\"bert\"") && e.contains("WordPiece"), "{e}");
    }

    /// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, and pieces
    /// whose scores rank the merges ll > ▁h > ▁he > ▁hell > ▁hello.
    fn spm_file(add_space_prefix: Option<bool>) -> GgufWriter {
        let mut w = GgufWriter::new(3);
        w.spm_vocabulary(&[
            ("\u{2581}", -10.0),
            ("h", -11.0),
            ("e", -12.0),
            ("l", -13.0),
            ("o", -14.0),
            ("ll", -1.0),
            ("\u{2581}h", -2.0),
            ("\u{2581}he", -3.0),
            ("\u{2581}hell", -4.0),
            ("\u{2581}hello", -5.0),
        ]);
        if let Some(p) = add_space_prefix {
            w.kv("tokenizer.ggml.add_space_prefix", Value::Bool(p));
        }
        w
    }

    #[test]
    fn sentencepiece_merges_from_scores_byte_fallback_and_bos() {
        let (t, tk) = build(&spm_file(None)).unwrap();
        assert_eq!(t.pre, "sentencepiece");
        let enc = tk.encode("hello hi", true).unwrap();
        // BOS by default; "i" is not a piece: byte fallback to <0x69>.
        assert_eq!(
            enc.get_tokens(),
            ["<s>", "\u{2581}hello", "\u{2581}h", "<0x69>"]
        );
        assert_eq!(enc.get_ids()[3], 3 + 0x69);
        assert_eq!(tk.decode(enc.get_ids(), true).unwrap(), "hello hi");
        for text in ["hello hi", "ol\u{e9} h\u{e9}llo ✓", "  two  spaces "] {
            round_trip(&tk, text);
        }
        assert_eq!(t.tokenizer_config["unk_token"], "<unk>");
        let merges = t.tokenizer_json["model"]["merges"].as_array().unwrap();
        assert_eq!(merges[0], json!(["l", "l"]), "highest-scoring piece first");
        assert_eq!(merges.len(), 5);
        // Without the prepended space, "hello" starts with a bare h.
        let (_, tk) = build(&spm_file(Some(false))).unwrap();
        assert_eq!(
            tk.encode("hello", false).unwrap().get_tokens(),
            ["h", "e", "ll", "o"]
        );
    }
}
