//! A faster road to the same tokens: byte-level BPE `tokenizer.json`s (GPT-2's regex, as
//! SmolLM2's), encoded with special tokens parsed and offsets, for rendered chat text
//! ([`super::Tokenizer::encode_rendered`]). The `tokenizers` library spends most of its time
//! keeping a `NormalizedString`'s alignments and allocating a `String` per token; this does
//! the same steps on plain byte ranges and asks the library's own BPE model only for words it
//! has not seen (a bounded per-thread cache of word → tokens).
//!
//! **Taken only where it gives the library's result**, checked on the loaded tokenizer
//! ([`FastBpe::new`] returns `None` otherwise, and the library encodes): no normalizer, no
//! truncation or padding; the pre-tokenizer is `ByteLevel` (`add_prefix_space: false`,
//! `use_regex: true`), alone or after `Digits`; the post-processor is none or `ByteLevel`
//! without `trim_offsets`; the model is BPE without dropout; no added token strips spaces or
//! matches single words. The steps, each as the library does it:
//!
//! 1. **Added tokens** split the text, leftmost-longest (Aho-Corasick), first those matched on
//!    the raw text, then in the pieces left the ones marked `normalized` (no normalizer, so
//!    the same text): `AddedVocabulary::extract_and_normalize`.
//! 2. **`Digits`** isolates each numeric character (`char::is_numeric`), or each run of them.
//! 3. **The GPT-2 regex** `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
//!    cuts each piece into words. Its look-ahead needs a backtracking engine; here the `regex`
//!    crate (whose Unicode tables `fancy-regex` delegates to) matches it without
//!    `\s+(?!\S)`, and a match of whitespace only (which only `\s+` can give: the other
//!    alternatives need a letter, digit or other character) is cut as the look-ahead would:
//!    whole if it ends the piece, else without its last character when it has two or more
//!    (that character then starts the next word), else whole (`\s+`).
//! 4. **BPE** on the word's bytes mapped to GPT-2's byte characters, by the library's model.
//! 5. **Offsets** as the library gives them for `ByteLevel`: each token's bytes in the text,
//!    widened to the characters they cut (a token holding one byte of `é` spans all of `é`).
//!
//! `tests` compare ids and offsets with the library's on texts made to hit every case.

use anyhow::{Result, anyhow};
use regex::Regex;

/// Token ids and each token's byte range `(start, end)` in the text (the library's offsets).
type Encoded = (Vec<u32>, Vec<(usize, usize)>);
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokenizers::{Model, ModelWrapper, PostProcessorWrapper, PreTokenizerWrapper};

/// GPT-2's pre-tokenizer regex without its look-ahead alternative `\s+(?!\S)` (see step 3).
const GPT2_NO_LOOKAHEAD: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// Words a thread remembers before it forgets them all (bounds the cache's memory: a few MB).
const CACHE_WORDS: usize = 1 << 16;

/// Tells one [`FastBpe`]'s cache entries from another's on the same thread.
static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

/// A word's tokens: (id, bytes of the word it covers).
type Pieces = Vec<(u32, u32)>;

/// Words (their bytes) → their tokens.
type Cache = HashMap<Box<[u8]>, Pieces, ahash::RandomState>;

thread_local! {
    /// (the [`FastBpe`] it belongs to, its words' tokens).
    static CACHE: RefCell<(usize, Cache)> =
        RefCell::new((usize::MAX, HashMap::default()));
}

/// How `Digits` cuts a piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Digits {
    None,
    Individual,
    Contiguous,
}

/// A byte-level BPE tokenizer's fast encoding of text with special tokens (see the module docs).
pub(super) struct FastBpe {
    id: usize,
    /// Added tokens matched on the raw text, and their ids.
    raw: Option<(aho_corasick::AhoCorasick, Vec<u32>)>,
    /// Added tokens marked `normalized`, and their ids.
    normalized: Option<(aho_corasick::AhoCorasick, Vec<u32>)>,
    digits: Digits,
    re: Regex,
    /// GPT-2's byte → character map, as UTF-8.
    byte_char: [([u8; 2], u8); 256],
    /// The library's tokenizer, whose BPE model encodes new words.
    tok: tokenizers::Tokenizer,
}

impl FastBpe {
    /// The fast path for `tok` (special tokens parsed), or `None` when it is not one this
    /// covers exactly (see the module docs).
    pub(super) fn new(tok: &tokenizers::Tokenizer) -> Option<FastBpe> {
        if tok.get_normalizer().is_some()
            || tok.get_truncation().is_some()
            || tok.get_padding().is_some()
        {
            return None;
        }
        let byte_level_ok = |p: &PreTokenizerWrapper| match p {
            PreTokenizerWrapper::ByteLevel(b) => !b.add_prefix_space && b.use_regex,
            _ => false,
        };
        let digits = match tok.get_pre_tokenizer()? {
            p @ PreTokenizerWrapper::ByteLevel(_) if byte_level_ok(p) => Digits::None,
            PreTokenizerWrapper::Sequence(s) => match s.as_ref() {
                [PreTokenizerWrapper::Digits(d), b] if byte_level_ok(b) => {
                    if d.individual_digits {
                        Digits::Individual
                    } else {
                        Digits::Contiguous
                    }
                }
                _ => return None,
            },
            _ => return None,
        };
        match tok.get_post_processor() {
            None => {}
            Some(PostProcessorWrapper::ByteLevel(b)) if !b.trim_offsets => {}
            Some(_) => return None,
        }
        match tok.get_model() {
            ModelWrapper::BPE(b) if b.dropout.is_none_or(|d| d == 0.0) => {}
            _ => return None,
        }
        let mut raw = (Vec::new(), Vec::new());
        let mut normalized = (Vec::new(), Vec::new());
        for (id, t) in tok.get_added_tokens_decoder() {
            if t.lstrip || t.rstrip || t.single_word {
                return None;
            }
            // The library numbers a pattern by the vocabulary's id for its content.
            let id = tok.token_to_id(&t.content).unwrap_or(id);
            let side = if t.normalized {
                &mut normalized
            } else {
                &mut raw
            };
            side.0.push(t.content);
            side.1.push(id);
        }
        let trie = |(pats, ids): (Vec<String>, Vec<u32>)| -> Option<Option<_>> {
            if pats.is_empty() {
                return Some(None);
            }
            let ac = aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&pats)
                .ok()?;
            Some(Some((ac, ids)))
        };
        let mut byte_char = [([0u8; 2], 0u8); 256];
        for (b, c) in bytes_char().into_iter().enumerate() {
            let mut buf = [0u8; 4];
            let s = c.encode_utf8(&mut buf);
            byte_char[b].0[..s.len()].copy_from_slice(s.as_bytes());
            byte_char[b].1 = s.len() as u8;
        }
        Some(FastBpe {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            raw: trie(raw)?,
            normalized: trie(normalized)?,
            digits,
            re: Regex::new(GPT2_NO_LOOKAHEAD).ok()?,
            byte_char,
            tok: tok.clone(),
        })
    }

    /// The ids of `text` and each token's byte range, as the library's `encode(text, false)`.
    pub(super) fn encode(&self, text: &str) -> Result<Encoded> {
        let mut out = Out {
            ids: Vec::with_capacity(text.len() / 3),
            offsets: Vec::with_capacity(text.len() / 3),
        };
        CACHE.with_borrow_mut(|(owner, cache)| {
            if *owner != self.id {
                cache.clear();
                *owner = self.id;
            }
            split_added(&self.raw, text, 0, &mut |a, b, id| match id {
                Some(id) => {
                    out.push(id, (a, b));
                    Ok(())
                }
                None => split_added(&self.normalized, &text[a..b], a, &mut |a, b, id| match id {
                    Some(id) => {
                        out.push(id, (a, b));
                        Ok(())
                    }
                    None => self.pieces(text, a, b, cache, &mut out),
                }),
            })
        })?;
        Ok((out.ids, out.offsets))
    }

    /// `text[a..b]`, a piece between added tokens: `Digits`, then the regex, then BPE.
    fn pieces(
        &self,
        text: &str,
        a: usize,
        b: usize,
        cache: &mut Cache,
        out: &mut Out,
    ) -> Result<()> {
        let mut piece = |s: usize, e: usize| self.words(text, s, e, cache, out);
        if self.digits == Digits::None {
            return piece(a, b);
        }
        let mut start = a;
        let mut in_digits = false;
        for (i, c) in text[a..b].char_indices() {
            let i = a + i;
            let numeric = c.is_numeric();
            let cut = match self.digits {
                Digits::Individual => numeric || in_digits,
                _ => numeric != in_digits,
            };
            if cut && i > start {
                piece(start, i)?;
                start = i;
            }
            in_digits = numeric;
        }
        if b > start {
            piece(start, b)?;
        }
        Ok(())
    }

    /// `text[a..b]` cut by GPT-2's regex (step 3 of the module docs), each word encoded.
    fn words(
        &self,
        text: &str,
        a: usize,
        b: usize,
        cache: &mut Cache,
        out: &mut Out,
    ) -> Result<()> {
        let s = &text[..b];
        let mut at = a;
        while at < b {
            let m = self
                .re
                .find_at(s, at)
                .filter(|m| m.start() == at)
                .ok_or_else(|| anyhow!("the pre-tokenizer's regex matched nothing at byte {at}"))?;
            let mut end = m.end();
            let word = m.as_str();
            if end < b && word.chars().all(char::is_whitespace) {
                // `\s+(?!\S)`: the run without its last character, when that leaves one.
                let last = word.char_indices().next_back().map_or(0, |(i, _)| i);
                if last > 0 {
                    end = at + last;
                }
            }
            self.word(text, at, end, cache, out)?;
            at = end;
        }
        Ok(())
    }

    /// One word, `text[a..b]`, by BPE (from the cache when seen before).
    fn word(&self, text: &str, a: usize, b: usize, cache: &mut Cache, out: &mut Out) -> Result<()> {
        let bytes = &text.as_bytes()[a..b];
        if let Some(p) = cache.get(bytes) {
            out.word(text, a, p);
            return Ok(());
        }
        let mut mapped = Vec::with_capacity(bytes.len() * 2);
        for &x in bytes {
            let (c, n) = &self.byte_char[x as usize];
            mapped.extend_from_slice(&c[..*n as usize]);
        }
        let mapped = String::from_utf8(mapped).expect("byte characters are UTF-8");
        let tokens = self
            .tok
            .get_model()
            .tokenize(&mapped)
            .map_err(|e| anyhow!("the tokenizer failed on the text: {e}"))?;
        // Token offsets are byte ranges of `mapped`; each of its characters is one byte.
        // A vocabulary without every byte's character (not a byte-level one) may cut a
        // character: refused, not a panic.
        let p: Pieces = tokens
            .iter()
            .map(|t| match mapped.get(t.offsets.0..t.offsets.1) {
                Some(piece) => Ok((t.id, piece.chars().count() as u32)),
                None => Err(anyhow!(
                    "the tokenizer cut the text {:?} inside a character (its vocabulary lacks \
                     some bytes' pieces: it is not a byte-level BPE tokenizer with all 256)",
                    String::from_utf8_lossy(bytes)
                )),
            })
            .collect::<Result<_>>()?;
        out.word(text, a, &p);
        if cache.len() >= CACHE_WORDS {
            cache.clear();
        }
        cache.insert(bytes.into(), p);
        Ok(())
    }
}

/// What [`FastBpe::encode`] builds.
struct Out {
    ids: Vec<u32>,
    offsets: Vec<(usize, usize)>,
}

impl Out {
    fn push(&mut self, id: u32, range: (usize, usize)) {
        self.ids.push(id);
        self.offsets.push(range);
    }

    /// A word at byte `a` of `text`, its tokens' ranges widened to whole characters.
    fn word(&mut self, text: &str, a: usize, pieces: &[(u32, u32)]) {
        let mut at = a;
        for &(id, n) in pieces {
            let (mut s, mut e) = (at, at + n as usize);
            at = e;
            while !text.is_char_boundary(s) {
                s -= 1;
            }
            while !text.is_char_boundary(e) {
                e += 1;
            }
            self.push(id, (s, e));
        }
    }
}

/// Calls `each(start, end, Some(id))` for each added token of `trie` in `text` (at byte `base`
/// of the whole) and `each(start, end, None)` for each non-empty stretch between them.
fn split_added(
    trie: &Option<(aho_corasick::AhoCorasick, Vec<u32>)>,
    text: &str,
    base: usize,
    each: &mut dyn FnMut(usize, usize, Option<u32>) -> Result<()>,
) -> Result<()> {
    let mut at = 0;
    if let Some((ac, ids)) = trie {
        for m in ac.find_iter(text) {
            if m.start() > at {
                each(base + at, base + m.start(), None)?;
            }
            each(
                base + m.start(),
                base + m.end(),
                Some(ids[m.pattern().as_usize()]),
            )?;
            at = m.end();
        }
    }
    if text.len() > at {
        each(base + at, base + text.len(), None)?;
    }
    Ok(())
}

/// GPT-2's byte → character map (`bytes_to_unicode`), as the library's `bytes_char`.
fn bytes_char() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[b as usize] = if printable {
            b as char
        } else {
            n += 1;
            char::from_u32(256 + n - 1).expect("below U+0200")
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level tokenizer like SmolLM2's: `Digits` then `ByteLevel`, a few merges, and
    /// special tokens, one of them `normalized`.
    fn tokenizer(digits: Option<bool>) -> tokenizers::Tokenizer {
        let chars = bytes_char();
        let mut vocab = serde_json::Map::new();
        for c in chars {
            let n = vocab.len();
            vocab.insert(c.to_string(), n.into());
        }
        let merges = [
            ("Ġ", "t"),
            ("h", "e"),
            ("Ġt", "he"),
            ("Ã", "©"),
            ("Ġ", "Ġ"),
            ("Ċ", "Ċ"),
            ("'", "s"),
            ("l", "l"),
            ("e", "ll"),
            ("Ġ", "Ã"),
        ];
        for (a, b) in merges {
            let n = vocab.len();
            vocab.insert(format!("{a}{b}"), n.into());
        }
        let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
        let n = vocab.len();
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": true});
        let pre = match digits {
            None => byte_level,
            Some(individual) => serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": individual}, byte_level]}),
        };
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null, "padding": null,
            "added_tokens": [
                {"id": n, "content": "<|im_start|>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": true},
                {"id": n + 1, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": true},
                {"id": n + 2, "content": "<|im", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": true, "special": false},
            ],
            "normalizer": null,
            "pre_tokenizer": pre,
            "post_processor": {"type": "ByteLevel", "add_prefix_space": true,
                "trim_offsets": false, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges},
        });
        let mut t = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
        t.set_encode_special_tokens(false);
        t
    }

    /// Texts that hit every case of the module docs.
    fn texts() -> Vec<String> {
        let mut texts: Vec<String> = [
            "",
            " ",
            "the",
            " the  the   the\n\nthe \n the\t\tx",
            "<|im_start|>user\nHello, it's 2024-11-25: 12345 apples.<|im_end|>\n<|im_start|>assistant\n",
            "  <|im_start|>  <|im_end|><|im_end|>x<|im",
            "<|imx <|im_star <|im_start|",
            "café é ée 日本語 ٣٤ Ⅻ ½ x²  \u{a0}\u{a0}a \u{3000}b\u{2028}\u{1f600}\u{1f600}!",
            "don't 'S 'll 're've'd'm 's",
            "trailing spaces   ",
            "\n\n\n",
            " \n \n x",
            "a\u{a0} b\u{a0}\u{a0}c \u{a0}1 2  3",
            "?!... ---  ***x((()))",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // Pseudo-random strings over an alphabet of the interesting characters.
        let alphabet: Vec<char> = "ab e'sthl 1 2\n\t\u{a0}é日½\u{1f600}<|im_start|>?.-"
            .chars()
            .collect();
        let mut state = 0x9e3779b97f4a7c15u64;
        for _ in 0..300 {
            let mut s = String::new();
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = (state >> 58) as usize + 1;
            for _ in 0..len {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let r = (state >> 33) as usize;
                if r.is_multiple_of(11) {
                    s.push_str(["<|im_start|>", "<|im_end|>", "<|im"][r % 3]);
                } else {
                    s.push(alphabet[r % alphabet.len()]);
                }
            }
            texts.push(s);
        }
        texts
    }

    #[test]
    fn gives_the_librarys_ids_and_offsets() {
        for digits in [None, Some(true), Some(false)] {
            let tok = tokenizer(digits);
            let fast = FastBpe::new(&tok).expect("a byte-level BPE tokenizer");
            for text in texts() {
                let want = tok.encode(text.as_str(), false).unwrap();
                // Twice: the second from the cache.
                for _ in 0..2 {
                    let (ids, offsets) = fast.encode(&text).unwrap();
                    assert_eq!(ids, want.get_ids(), "{digits:?} {text:?}");
                    assert_eq!(offsets, want.get_offsets(), "{digits:?} {text:?}");
                }
            }
        }
    }

    /// A vocabulary of printable ASCII as plain characters (as a tiny test model's: no
    /// byte-level `Ġ` for the space): a text it cannot cut on characters is refused naming
    /// it, never a panic.
    #[test]
    fn a_vocabulary_without_every_byte_is_an_error_not_a_panic() {
        let mut vocab = serde_json::Map::new();
        for b in (0x20u8..0x7f).chain([b'\n']) {
            let n = vocab.len();
            vocab.insert((b as char).to_string(), n.into());
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": []},
        });
        let tok = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
        let fast = FastBpe::new(&tok).expect("a byte-level BPE tokenizer");
        assert!(fast.encode("plain").is_ok());
        let e = format!("{:#}", fast.encode("two words").unwrap_err());
        assert!(
            e.contains("inside a character") && e.contains("words"),
            "{e}"
        );
    }

    #[test]
    fn refuses_what_it_does_not_cover() {
        let mut tok = tokenizer(None);
        tok.with_post_processor(Some(
            tokenizers::processors::byte_level::ByteLevel::default(),
        ));
        assert!(FastBpe::new(&tok).is_none(), "trim_offsets");
        let mut tok = tokenizer(None);
        tok.with_pre_tokenizer(Some(
            tokenizers::pre_tokenizers::byte_level::ByteLevel::new(true, true, true),
        ));
        assert!(FastBpe::new(&tok).is_none(), "add_prefix_space");
        let mut tok = tokenizer(None);
        tok.add_special_tokens(&[tokenizers::AddedToken::from("<x>", true).lstrip(true)]);
        assert!(FastBpe::new(&tok).is_none(), "lstrip");
    }
}
