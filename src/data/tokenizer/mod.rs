//! Tokenizers: GPT-2's BPE (embedded, offline) or a Hugging Face `tokenizer.json`, behind one
//! [`Tokenizer`] type, and the [`TokenizerId`] that prepared data and models are compared by.
//!
//! * [`gpt2`]: `r50k_base` via `tiktoken-rs`, [`EOT`] and [`GPT2_VOCAB`].
//! * [`hf`]: `tokenizer.json` via the `tokenizers` crate; the end-of-text token from
//!   `tokenizer_config.json` / `config.json` beside it or the vocabulary. A GGUF file given
//!   as `--tokenizer` is the `tokenizer.json` of its conversion in the user cache.
//! * `fast`: [`Tokenizer::encode_rendered`] for byte-level BPE files with GPT-2's regex
//!   (SmolLM2's), the library's ids and offsets at a fraction of its time (its docs say
//!   which files qualify and why the result is the same); others go through the library.
//!
//! Text is encoded as ordinary text: a literal `<|endoftext|>` in a document is *not* turned
//! into the end-of-text token, and no BOS is added. Document boundaries are marked by
//! [`crate::data::prepare()`], which inserts [`Tokenizer::eot`] before every document itself.
//!
//! Two tokenizers are the same iff their [`TokenizerId::hash`]es are equal: the SHA-256 of the
//! `tokenizer.json` bytes, or [`GPT2_HASH`] for the embedded GPT-2 tables.

mod fast;
pub mod gpt2;
pub mod hf;
mod id;

#[cfg(test)]
pub(crate) mod fixture;

pub use gpt2::{EOT, GPT2_HASH, GPT2_NAME, GPT2_VOCAB};
pub use hf::{EOT_CANDIDATES, Offsets};
pub use id::TokenizerId;

use anyhow::{Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A tokenizer: GPT-2's or a `tokenizer.json`. Cheap to clone and shareable across threads.
#[derive(Clone)]
pub struct Tokenizer {
    kind: Kind,
    id: TokenizerId,
    /// Documents may be cut at [`split_points`] and encoded piece by piece.
    split_safe: bool,
}

#[derive(Clone)]
enum Kind {
    Gpt2(gpt2::Gpt2),
    Hf(Arc<hf::Hf>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({})", self.id.describe())
    }
}

/// What `--tokenizer` accepts, for error messages.
const TOKENIZER_ARG: &str = "pass `gpt2`, a model directory holding a tokenizer.json, the path of a \
     tokenizer.json, or a GGUF file";

impl Tokenizer {
    /// The GPT-2 tokenizer (built on first use, then shared).
    pub fn gpt2() -> Result<Tokenizer> {
        Ok(Tokenizer {
            kind: Kind::Gpt2(gpt2::Gpt2::get()?),
            id: TokenizerId::gpt2(),
            split_safe: true,
        })
    }

    /// A Hugging Face `tokenizer.json` (BPE). Errors name the file and say whether it is
    /// missing, not JSON, not a BPE tokenizer, or lacks an end-of-text token.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let bytes = hf::read(path)?;
        let seen = hf::inspect(path, &bytes)?;
        let tok = hf::Hf::build(path, &bytes, &seen)?;
        Ok(Tokenizer {
            kind: Kind::Hf(Arc::new(tok)),
            id: seen.id,
            split_safe: seen.split_safe,
        })
    }

    /// `--tokenizer ARG`: `gpt2`, a directory holding `tokenizer.json`, a `tokenizer.json`,
    /// or a GGUF file, whose conversion in the user cache (made once, as `train --init` and
    /// `sample --model` make it: [`crate::gguf::cache::model_dir`]) holds the `tokenizer.json`
    /// those then compare the data with. A conversion says what it does to `say` (see
    /// [`crate::gguf::cache::model_dir`]).
    pub fn load(arg: &str, say: &mut dyn FnMut(&str)) -> Result<Tokenizer> {
        match Tokenizer::file_of(arg, say)? {
            None => Tokenizer::gpt2(),
            Some(file) => Tokenizer::from_file(file),
        }
    }

    /// The `tokenizer.json` that `--tokenizer ARG` names (`None` for `gpt2`): its directory
    /// is where `tokenizer_config.json` and a chat template are looked for. A GGUF file's
    /// conversion says what it does to `say`.
    pub fn file_of(arg: &str, say: &mut dyn FnMut(&str)) -> Result<Option<PathBuf>> {
        if arg == "gpt2" {
            return Ok(None);
        }
        let mut converted = |p: &Path| crate::gguf::cache::model_dir(p, "--tokenizer", say);
        tokenizer_file(arg, &mut converted).map(Some)
    }

    /// Encodes ordinary text: special tokens are not parsed, nothing is added. GPT-2 never
    /// fails; a `tokenizer.json` fails only where the tokenizers library does.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.kind {
            Kind::Gpt2(t) => Ok(t.encode(text)),
            Kind::Hf(t) => t.encode(text),
        }
    }

    /// Encodes text rendered by a chat template, as transformers' `apply_chat_template(...,
    /// tokenize=True)` does: special tokens written in the text (`<|im_start|>`, a template's
    /// `bos_token`) are parsed as those tokens, and nothing is added (no BOS). Returns the ids
    /// and each token's byte range in `text` (the tokenizers library's offsets; for GPT-2 the
    /// tokens' bytes laid end to end), from which trained spans are mapped to tokens.
    pub fn encode_rendered(&self, text: &str) -> Result<(Vec<u32>, Offsets)> {
        match &self.kind {
            Kind::Gpt2(t) => Ok(t.encode_special(text)),
            Kind::Hf(t) => t.encode_special(text),
        }
    }

    /// Decodes tokens to text. Byte sequences that are not valid UTF-8 (for example a
    /// multi-byte character cut by the end of a window) become U+FFFD; the end-of-text token
    /// is rendered as its text (`<|endoftext|>`); a token outside the vocabulary is U+FFFD.
    pub fn decode(&self, tokens: &[u32]) -> String {
        match &self.kind {
            Kind::Gpt2(t) => t.decode(tokens),
            Kind::Hf(t) => t.decode(tokens),
        }
    }

    /// Vocabulary size: largest token id + 1, added tokens included ([`GPT2_VOCAB`] for GPT-2).
    pub fn vocab_size(&self) -> usize {
        self.id.vocab_size
    }

    /// The end-of-text token that separates documents ([`EOT`] for GPT-2).
    pub fn eot(&self) -> u32 {
        self.id.eot
    }

    /// What identifies this tokenizer (name, hash, vocabulary size, end-of-text token).
    pub fn id(&self) -> TokenizerId {
        self.id.clone()
    }

    /// Where `text` may be cut for parallel encoding (see [`split_points`]); no cut at all for
    /// a tokenizer whose pre-tokenization could join text across such a cut (a SentencePiece-
    /// style `tokenizer.json` that prepends `▁`, an unknown regex).
    pub fn split_points(&self, text: &str, target: usize) -> Vec<usize> {
        if self.split_safe {
            split_points(text, target)
        } else {
            Vec::new()
        }
    }
}

/// The `tokenizer.json` that `--tokenizer ARG` (other than `gpt2`) names; a GGUF file's is
/// that of the model directory `converted` makes of it.
fn tokenizer_file(
    arg: &str,
    converted: &mut dyn FnMut(&Path) -> Result<PathBuf>,
) -> Result<PathBuf> {
    let p = Path::new(arg);
    if crate::util::sniff::is_gguf(p) {
        return Ok(converted(p)?.join("tokenizer.json"));
    }
    if p.is_dir() {
        let f = p.join("tokenizer.json");
        if !f.is_file() {
            bail!(
                "directory '{}' holds no tokenizer.json: {TOKENIZER_ARG} (Hugging Face model \
                 directories ship one)",
                p.display()
            );
        }
        return Ok(f);
    }
    if !p.exists() {
        bail!("tokenizer '{arg}' is neither `gpt2` nor an existing path: {TOKENIZER_ARG}");
    }
    Ok(p.to_path_buf())
}

/// The `tokenizer.json` of a model: the first of `places` (directories, or files whose
/// directory is meant, such as a `config.json`) that holds one.
fn model_tokenizer_file(places: &[&Path]) -> Option<PathBuf> {
    places.iter().find_map(|p| {
        let dir = if p.is_file() { p.parent()? } else { p };
        let f = dir.join("tokenizer.json");
        f.is_file().then_some(f)
    })
}

/// A model's tokenizer: the `tokenizer.json` of the first of `places` (the model's
/// directories or config files) that has one, else GPT-2's when `gpt2_family`, else `None`
/// (a model with no known tokenizer).
pub fn model_tokenizer(places: &[&Path], gpt2_family: bool) -> Result<Option<Tokenizer>> {
    match model_tokenizer_file(places) {
        Some(f) => Ok(Some(Tokenizer::from_file(f)?)),
        None if gpt2_family => Ok(Some(Tokenizer::gpt2()?)),
        None => Ok(None),
    }
}

/// [`model_tokenizer`]'s identity, without building the tokenizer.
pub fn model_tokenizer_id(places: &[&Path], gpt2_family: bool) -> Result<Option<TokenizerId>> {
    match model_tokenizer_file(places) {
        Some(f) => Ok(Some(TokenizerId::of_file(&f)?)),
        None if gpt2_family => Ok(Some(TokenizerId::gpt2())),
        None => Ok(None),
    }
}

/// Byte offsets at which `text` can be cut into pieces of about `target` bytes such that
/// encoding the pieces separately and concatenating the tokens gives exactly the tokens of the
/// whole text under GPT-2's pre-tokenizer (and the `tokenizer.json` ones that
/// [`Tokenizer::split_points`] accepts). Used to tokenize one large document on several threads.
///
/// A cut is made just after a `'\n'` that has a non-whitespace character on both sides. No
/// GPT-2 pre-tokenizer piece spans such a point: the newline is a piece of its own both in the
/// whole text (`\s` alternative) and at the end of a piece (`\s++$`), and the next piece starts
/// with a non-whitespace character either way. The returned offsets are strictly increasing,
/// exclude 0 and `text.len()`, and lie on character boundaries.
pub fn split_points(text: &str, target: usize) -> Vec<usize> {
    let mut cuts = Vec::new();
    let bytes = text.as_bytes();
    let target = target.max(1);
    let mut from = target;
    while from < bytes.len() {
        // Search forward from `from` for a safe newline.
        let mut found = None;
        let mut i = from;
        while i < bytes.len() {
            match bytes[i..].iter().position(|&b| b == b'\n') {
                None => break,
                Some(k) => {
                    let nl = i + k;
                    let before = text[..nl].chars().next_back();
                    let after = text[nl + 1..].chars().next();
                    let solid = |c: Option<char>| c.is_some_and(|c| !c.is_whitespace());
                    if solid(before) && solid(after) {
                        found = Some(nl + 1);
                        break;
                    }
                    i = nl + 1;
                }
            }
        }
        match found {
            Some(cut) => {
                cuts.push(cut);
                from = cut + target;
            }
            None => break,
        }
    }
    cuts
}

#[cfg(test)]
mod tests {
    use super::fixture::Spec;
    use super::*;
    use serde_json::json;

    const PASSAGE: &str = "HAMLET. To be, or not to be, that is the question:\n\
        Whether 'tis nobler in the mind to suffer\n\
        The slings and arrows of outrageous fortune,\n\n  \
        Or to take arms against a sea of troubles\r\n\
        — Ophelia’s “nunnery” scene; naïve café, Ægir, 日本語, emoji 🎭!\n\t  \n";

    #[test]
    fn round_trip_including_non_ascii() {
        let tok = Tokenizer::gpt2().unwrap();
        let ids = tok.encode(PASSAGE).unwrap();
        assert!(ids.len() > 50);
        assert!(ids.iter().all(|&t| (t as usize) < GPT2_VOCAB && t != EOT));
        assert_eq!(tok.decode(&ids), PASSAGE);
        // Known GPT-2 ids: "Hello" = 15496, " world" = 995.
        assert_eq!(tok.encode("Hello world").unwrap(), vec![15496, 995]);
        assert_eq!(tok.id(), TokenizerId::gpt2());
        assert_eq!((tok.vocab_size(), tok.eot()), (GPT2_VOCAB, EOT));
    }

    #[test]
    fn special_tokens_not_parsed_and_eot_decodes() {
        let tok = Tokenizer::gpt2().unwrap();
        let ids = tok.encode("a<|endoftext|>b").unwrap();
        assert!(!ids.contains(&EOT));
        assert_eq!(tok.decode(&ids), "a<|endoftext|>b");
        let mut with_eot = tok.encode("first").unwrap();
        with_eot.push(EOT);
        with_eot.extend(tok.encode("second").unwrap());
        assert_eq!(tok.decode(&with_eot), "first<|endoftext|>second");
        assert_eq!(tok.decode(&[EOT]), "<|endoftext|>");
    }

    #[test]
    fn decode_is_lossy_not_panicking() {
        let tok = Tokenizer::gpt2().unwrap();
        let ids = tok.encode("🎭").unwrap();
        assert!(ids.len() > 1, "emoji spans several byte tokens");
        let partial = tok.decode(&ids[..1]);
        assert!(partial.contains('\u{FFFD}'));
        assert_eq!(tok.decode(&[15496, 999_999]), "Hello\u{FFFD}");
        assert_eq!(tok.decode(&[]), "");
    }

    /// Encoding the pieces between `tok.split_points` and concatenating gives the whole
    /// text's tokens; returns the number of cuts made.
    fn check_split(tok: &Tokenizer, text: &str, target: usize) -> usize {
        let cuts = tok.split_points(text, target);
        let mut bounds = vec![0];
        bounds.extend(&cuts);
        bounds.push(text.len());
        assert!(bounds.windows(2).all(|w| w[0] < w[1]));
        let joined: Vec<u32> = bounds
            .windows(2)
            .flat_map(|w| tok.encode(&text[w[0]..w[1]]).unwrap())
            .collect();
        assert_eq!(
            joined,
            tok.encode(text).unwrap(),
            "{tok:?}, target {target}"
        );
        cuts.len()
    }

    #[test]
    fn split_points_preserve_tokens() {
        let text = PASSAGE.repeat(40);
        let dir = tempfile::tempdir().unwrap();
        let hf = Tokenizer::from_file(Spec::byte_level().write(&dir.path().join("bl"))).unwrap();
        let llama =
            Tokenizer::from_file(Spec::llama3_style().write(&dir.path().join("l3"))).unwrap();
        for tok in [Tokenizer::gpt2().unwrap(), hf, llama] {
            for target in [1, 7, 100, 1000, 100_000] {
                let cuts = check_split(&tok, &text, target);
                if target <= 1000 {
                    assert!(cuts > 0, "{tok:?}, target {target}");
                }
            }
        }
    }

    #[test]
    fn split_points_refused_where_pieces_could_differ() {
        let dir = tempfile::tempdir().unwrap();
        let unsafe_specs = [
            // SentencePiece style: a `▁` prepended to every piece would change the tokens.
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}),
            // A prefix space added to every piece.
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
            // A regex memwall has not checked.
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\S+\\s*"}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}),
            // No splitting at all: BPE sees the whole text.
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}),
        ];
        let text = PASSAGE.repeat(10);
        for (i, pre) in unsafe_specs.into_iter().enumerate() {
            let spec = Spec {
                pre_tokenizer: pre,
                ..Spec::byte_level()
            };
            let tok = Tokenizer::from_file(spec.write(&dir.path().join(format!("u{i}")))).unwrap();
            assert_eq!(tok.split_points(&text, 10), Vec::<usize>::new(), "{i}");
        }
        // A normalizer that is not per-character, and a non-special added token holding a
        // newline, each make an otherwise safe tokenizer unsafe.
        let lower = Spec {
            normalizer: json!({"type": "Prepend", "prepend": "▁"}),
            ..Spec::byte_level()
        };
        let nl = Spec {
            added: vec![("<|endoftext|>", true), ("\n\n", false)],
            ..Spec::byte_level()
        };
        let nfc = Spec {
            normalizer: json!({"type": "NFC"}),
            ..Spec::llama3_style()
        };
        for (name, spec, cuts) in [
            ("prepend", lower, false),
            ("nl", nl, false),
            ("nfc", nfc, true),
        ] {
            let tok = Tokenizer::from_file(spec.write(&dir.path().join(name))).unwrap();
            assert_eq!(!tok.split_points(&text, 10).is_empty(), cuts, "{name}");
        }
    }

    #[test]
    fn hf_encode_decode_and_ids() {
        let dir = tempfile::tempdir().unwrap();
        for spec in [Spec::byte_level(), Spec::llama3_style()] {
            let path = spec.write(dir.path());
            let tok = Tokenizer::from_file(&path).unwrap();
            // 't' is byte 116; merges 256 "Ġt", 257 "he", 258 "Ġthe", ..., 265 "Ġand".
            assert_eq!(tok.encode("the and the").unwrap(), vec![116, 257, 265, 258]);
            let ids = tok.encode(PASSAGE).unwrap();
            assert_eq!(tok.decode(&ids), PASSAGE);
            assert_eq!(tok.vocab_size(), 256 + 10 + 1);
            assert_eq!(tok.eot(), 266);
            // Special tokens in text are text; the token decodes to its content.
            let ids = tok.encode("a<|endoftext|>b").unwrap();
            assert!(!ids.contains(&266), "{ids:?}");
            assert_eq!(tok.decode(&ids), "a<|endoftext|>b");
            assert_eq!(tok.decode(&[116, 266, 116]), "t<|endoftext|>t");
            // Lossy decoding: a cut emoji and an unknown id become U+FFFD.
            let emoji = tok.encode("🎭").unwrap();
            assert_eq!(emoji.len(), 4);
            assert!(tok.decode(&emoji[..2]).contains('\u{FFFD}'));
            assert_eq!(tok.decode(&[116, 99_999, 116]), "t\u{FFFD}t");
            assert_eq!(tok.decode(&[]), "");
            assert_eq!(tok.encode("").unwrap(), Vec::<u32>::new());
        }
    }

    #[test]
    fn hf_encode_adds_no_bos() {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = Spec::byte_level();
        spec.added.push(("<s>", true));
        spec.post_processor = json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [267], "tokens": ["<s>"]}}
        });
        let tok = Tokenizer::from_file(spec.write(dir.path())).unwrap();
        assert_eq!(tok.encode("the").unwrap(), vec![116, 257]);
        assert_eq!(tok.vocab_size(), 268);
    }

    #[test]
    fn hash_equal_iff_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = Tokenizer::from_file(Spec::byte_level().write(&dir.path().join("a"))).unwrap();
        let b = Tokenizer::from_file(Spec::byte_level().write(&dir.path().join("b"))).unwrap();
        let fewer = Spec {
            merges: fixture::MERGES[..9].to_vec(),
            ..Spec::byte_level()
        };
        let c = Tokenizer::from_file(fewer.write(&dir.path().join("c"))).unwrap();
        let (a, b, c) = (a.id(), b.id(), c.id());
        assert_eq!((a.name.as_str(), b.name.as_str()), ("hf:a", "hf:b"));
        assert!(a.same_as(&b) && b.same_as(&a));
        assert_eq!(a.hash.len(), 64);
        assert!(a.hash.chars().all(|c| c.is_ascii_hexdigit()));
        assert!(!a.same_as(&c));
        assert!(!a.same_as(&TokenizerId::gpt2()));
        assert_eq!(a.describe(), format!("hf:a (hash {})", &a.hash[..12]));
        assert_eq!(
            TokenizerId::gpt2().describe(),
            "gpt2-r50k_base (hash r50k_base)"
        );
        // The light read agrees with the tokenizer's own identity.
        let light = TokenizerId::of_file(&dir.path().join("a/tokenizer.json")).unwrap();
        assert_eq!(light, a);
    }

    /// A fixture whose added tokens are `added`, in `dir`, with `tokenizer_config.json` and
    /// `config.json` written when given.
    fn eot_of(
        dir: &Path,
        added: &[&'static str],
        tc: Option<&str>,
        cfg: Option<&str>,
    ) -> Result<u32> {
        let spec = Spec {
            added: added.iter().map(|&a| (a, true)).collect(),
            ..Spec::byte_level()
        };
        let path = spec.write(dir);
        for (name, content) in [("tokenizer_config.json", tc), ("config.json", cfg)] {
            let p = dir.join(name);
            match content {
                Some(c) => std::fs::write(&p, c).unwrap(),
                None => {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
        let id = TokenizerId::of_file(&path)?;
        assert_eq!(Tokenizer::from_file(&path)?.eot(), id.eot);
        Ok(id.eot)
    }

    #[test]
    fn eot_from_each_source() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        // ids: <|endoftext|> 266, </s> 267, <|im_end|> 268, <|end_of_text|> 269
        let all = ["<|endoftext|>", "</s>", "<|im_end|>", "<|end_of_text|>"];
        assert_eq!(eot_of(d, &all, None, None).unwrap(), 266);
        assert_eq!(
            eot_of(d, &all[1..], None, None).unwrap(),
            268,
            "<|end_of_text|> before </s>"
        );
        assert_eq!(
            eot_of(d, &all[1..3], None, None).unwrap(),
            266,
            "</s> (first id after the merges)"
        );
        let tc = r#"{"eos_token": "<|im_end|>", "bos_token": null}"#;
        assert_eq!(eot_of(d, &all, Some(tc), None).unwrap(), 268);
        let tc = r#"{"eos_token": {"content": "</s>", "lstrip": false, "special": true}}"#;
        assert_eq!(
            eot_of(d, &all, Some(tc), Some(r#"{"eos_token_id": 268}"#)).unwrap(),
            267
        );
        assert_eq!(
            eot_of(d, &all, None, Some(r#"{"eos_token_id": 269}"#)).unwrap(),
            269
        );
        assert_eq!(
            eot_of(d, &all, None, Some(r#"{"eos_token_id": [268, 266]}"#)).unwrap(),
            268
        );
        // No eos_token in tokenizer_config.json: config.json decides.
        let tc = r#"{"eos_token": null}"#;
        assert_eq!(
            eot_of(d, &all, Some(tc), Some(r#"{"eos_token_id": 267}"#)).unwrap(),
            267
        );
        // GPT2Config's default 50256 on a small vocabulary is not this tokenizer's: passed over.
        assert_eq!(
            eot_of(d, &all, None, Some(r#"{"eos_token_id": 50256}"#)).unwrap(),
            266
        );
        // A config.json without eos_token_id: the vocabulary decides.
        assert_eq!(
            eot_of(d, &all, None, Some(r#"{"model_type": "gpt2"}"#)).unwrap(),
            266
        );
    }

    #[test]
    fn eot_errors_name_the_file_and_the_fix() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let e = format!("{:#}", eot_of(d, &["<pad>"], None, None).unwrap_err());
        assert!(
            e.contains("tokenizer.json")
                && e.contains("end-of-text")
                && e.contains("\"eos_token\""),
            "{e}"
        );
        let e = format!(
            "{:#}",
            eot_of(d, &["<pad>"], Some(r#"{"eos_token": "<eos>"}"#), None).unwrap_err()
        );
        assert!(
            e.contains("tokenizer_config.json") && e.contains("'<eos>'"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            eot_of(d, &["<pad>"], Some(r#"{"eos_token": 7}"#), None).unwrap_err()
        );
        assert!(
            e.contains("tokenizer_config.json") && e.contains("eos_token"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            eot_of(d, &["<pad>"], None, Some(r#"{"eos_token_id": 99999}"#)).unwrap_err()
        );
        assert!(
            e.contains("config.json") && e.contains("99999") && e.contains("\"eos_token\""),
            "{e}"
        );
        let e = format!(
            "{:#}",
            eot_of(d, &["<pad>"], None, Some(r#"{"eos_token_id": "x"}"#)).unwrap_err()
        );
        assert!(
            e.contains("config.json") && e.contains("eos_token_id"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            eot_of(d, &["<pad>"], None, Some("{oops")).unwrap_err()
        );
        assert!(
            e.contains("config.json") && e.contains("not valid JSON"),
            "{e}"
        );
    }

    #[test]
    fn a_gguf_file_names_the_tokenizer_of_its_conversion() {
        use crate::gguf::testutil::{TEST_VOCAB, tiny_model, write_temp};
        let (dir, gguf) = write_temp(&tiny_model("qwen2", true).to_bytes());
        let cache = dir.path().join("cache");
        let mut converted =
            |p: &Path| crate::gguf::cache::model_dir_in(&cache, p, "--tokenizer", &mut |_| {});
        let file = tokenizer_file(gguf.to_str().unwrap(), &mut converted).unwrap();
        assert!(file.starts_with(&cache) && file.ends_with("tokenizer.json"));
        let tok = Tokenizer::from_file(&file).unwrap();
        assert_eq!(tok.vocab_size(), TEST_VOCAB);
        // What `train --init FILE.gguf` compares the data with: the same conversion's file.
        let model = crate::gguf::cache::model_dir_in(&cache, &gguf, "--init", &mut |_| {}).unwrap();
        let id = model_tokenizer_id(&[&model], false).unwrap().unwrap();
        assert!(id.same_as(&tok.id()), "{id:?} vs {:?}", tok.id());
        assert_eq!(tok.decode(&tok.encode("hello").unwrap()), "hello");
        // A damaged GGUF is named as one, not as JSON.
        std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00cut").unwrap();
        let e = format!(
            "{:#}",
            tokenizer_file(gguf.to_str().unwrap(), &mut converted).unwrap_err()
        );
        assert!(
            e.contains("--tokenizer") && e.contains("not a valid GGUF file") && !e.contains("JSON"),
            "{e}"
        );
    }

    fn load_err(arg: &Path) -> String {
        format!(
            "{:#}",
            Tokenizer::load(arg.to_str().unwrap(), &mut |_| {}).unwrap_err()
        )
    }

    #[test]
    fn load_by_argument_and_its_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("smol");
        let path = Spec::byte_level().write(&d);
        assert_eq!(
            Tokenizer::load("gpt2", &mut |_| {}).unwrap().id(),
            TokenizerId::gpt2()
        );
        let by_dir = Tokenizer::load(d.to_str().unwrap(), &mut |_| {})
            .unwrap()
            .id();
        let by_file = Tokenizer::load(path.to_str().unwrap(), &mut |_| {})
            .unwrap()
            .id();
        assert_eq!(by_dir, by_file);
        assert_eq!(by_dir.name, "hf:smol");

        // A directory without tokenizer.json, a path that does not exist.
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let e = load_err(&empty);
        assert!(
            e.contains("empty") && e.contains("no tokenizer.json") && e.contains("`gpt2`"),
            "{e}"
        );
        let e = load_err(&tmp.path().join("nope"));
        assert!(e.contains("nope") && e.contains("`gpt2`"), "{e}");
        let e = format!(
            "{:#}",
            Tokenizer::from_file(empty.join("tokenizer.json")).unwrap_err()
        );
        assert!(
            e.contains("tokenizer.json") && e.contains("does not exist"),
            "{e}"
        );

        // Corrupt: truncated JSON.
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, &text[..text.len() / 2]).unwrap();
        let e = load_err(&path);
        assert!(
            e.contains(&path.display().to_string()) && e.contains("not valid JSON"),
            "{e}"
        );
        // Valid JSON, not a tokenizer.
        std::fs::write(&path, r#"{"vocab": {"a": 0}}"#).unwrap();
        let e = load_err(&d);
        assert!(
            e.contains("tokenizer.json") && e.contains("no 'model'"),
            "{e}"
        );
        // An unsupported model.
        std::fs::write(
            &path,
            r#"{"model": {"type": "Unigram", "unk_id": 0, "vocab": [["a", 0.0]]}}"#,
        )
        .unwrap();
        let e = load_err(&path);
        assert!(
            e.contains("tokenizer.json") && e.contains("'Unigram' is not supported"),
            "{e}"
        );
        // A BPE the tokenizers library rejects (a merge of tokens not in the vocabulary).
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["model"]["merges"] = json!(["x y"]);
        v["model"]["vocab"] = json!({"<|endoftext|>": 0});
        std::fs::write(&path, v.to_string()).unwrap();
        let e = load_err(&path);
        assert!(
            e.contains("tokenizer.json") && e.contains("tokenizers library"),
            "{e}"
        );
    }

    /// `tests/fixtures/tiny-bpe/tokenizer.json` (for the CLI tests) is [`Spec::byte_level`];
    /// `MEMWALL_BLESS=1` rewrites it.
    #[test]
    fn committed_fixture_is_the_byte_level_spec() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-bpe");
        let want = Spec::byte_level().json();
        if std::env::var_os("MEMWALL_BLESS").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("tokenizer.json"), &want).unwrap();
        }
        let got = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
        assert_eq!(got, want, "run with MEMWALL_BLESS=1 to rewrite the fixture");
    }

    #[test]
    fn model_tokenizer_from_places() {
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model");
        Spec::byte_level().write(&model);
        let cfg = model.join("config.json");
        std::fs::write(&cfg, "{}").unwrap();
        let bare = tmp.path().join("bare");
        std::fs::create_dir(&bare).unwrap();
        let hf_id = TokenizerId::of_file(&model.join("tokenizer.json")).unwrap();

        for places in [
            vec![model.as_path()],
            vec![cfg.as_path()],
            vec![bare.as_path(), model.as_path()],
        ] {
            let t = model_tokenizer(&places, true).unwrap().unwrap();
            assert_eq!(t.id(), hf_id);
            assert_eq!(
                model_tokenizer_id(&places, false).unwrap(),
                Some(hf_id.clone())
            );
        }
        let none: &[&Path] = &[bare.as_path(), Path::new("gpt2-tiny")];
        assert_eq!(
            model_tokenizer(none, true).unwrap().unwrap().id(),
            TokenizerId::gpt2()
        );
        assert_eq!(
            model_tokenizer_id(none, true).unwrap(),
            Some(TokenizerId::gpt2())
        );
        assert!(model_tokenizer(none, false).unwrap().is_none());
        assert_eq!(model_tokenizer_id(none, false).unwrap(), None);
    }
}
