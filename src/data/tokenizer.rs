//! GPT-2's byte-level BPE tokenizer (`r50k_base`, 50257 tokens), via `tiktoken-rs`.
//!
//! The vocabulary is embedded in the `tiktoken-rs` crate, so this works offline. It is built
//! once per process (a few tens of milliseconds) and shared; [`Tokenizer`] is a cheap handle.
//!
//! Text is encoded as ordinary text: a literal `<|endoftext|>` in a document is *not* turned
//! into the [`EOT`] token. Document boundaries are marked by [`crate::data::prepare()`], which
//! inserts [`EOT`] between documents itself.

use anyhow::{Result, anyhow};
use std::sync::OnceLock;
use tiktoken_rs::CoreBPE;

/// The `<|endoftext|>` token that separates documents.
pub const EOT: u32 = 50256;
/// Size of the GPT-2 vocabulary (50000 merges + 256 bytes + `<|endoftext|>`).
pub const GPT2_VOCAB: usize = 50257;

/// A handle to the process-wide GPT-2 BPE.
#[derive(Clone, Copy)]
pub struct Tokenizer {
    bpe: &'static CoreBPE,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokenizer(gpt2-r50k_base)")
    }
}

static GPT2: OnceLock<CoreBPE> = OnceLock::new();

impl Tokenizer {
    /// The GPT-2 tokenizer (built on first use, then shared).
    pub fn gpt2() -> Result<Tokenizer> {
        if let Some(bpe) = GPT2.get() {
            return Ok(Tokenizer { bpe });
        }
        let built = tiktoken_rs::r50k_base()
            .map_err(|e| anyhow!("cannot build the GPT-2 tokenizer: {e}"))?;
        // Another thread may have won the race; either value is the same tokenizer.
        let _ = GPT2.set(built);
        let bpe = GPT2
            .get()
            .ok_or_else(|| anyhow!("GPT-2 tokenizer was not initialised"))?;
        Ok(Tokenizer { bpe })
    }

    /// Encodes ordinary text; special tokens are not parsed.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Decodes tokens to text. Byte sequences that are not valid UTF-8 (for example a
    /// multi-byte character cut by the end of a window) become U+FFFD; [`EOT`] is rendered as
    /// `<|endoftext|>`; a token outside the vocabulary is rendered as U+FFFD.
    pub fn decode(&self, tokens: &[u32]) -> String {
        let bytes = match self.bpe.decode_bytes(tokens) {
            Ok(b) => b,
            Err(_) => {
                let mut b = Vec::with_capacity(tokens.len() * 4);
                for &t in tokens {
                    match self.bpe.decode_bytes(&[t]) {
                        Ok(x) => b.extend_from_slice(&x),
                        Err(_) => b.extend_from_slice("\u{FFFD}".as_bytes()),
                    }
                }
                b
            }
        };
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Vocabulary size ([`GPT2_VOCAB`]).
    pub fn vocab_size(&self) -> usize {
        GPT2_VOCAB
    }
}

/// Byte offsets at which `text` can be cut into pieces of about `target` bytes such that
/// encoding the pieces separately and concatenating the tokens gives exactly the tokens of the
/// whole text. Used to tokenize one large document on several threads.
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
    use super::*;

    const PASSAGE: &str = "HAMLET. To be, or not to be, that is the question:\n\
        Whether 'tis nobler in the mind to suffer\n\
        The slings and arrows of outrageous fortune,\n\n  \
        Or to take arms against a sea of troubles\r\n\
        — Ophelia’s “nunnery” scene; naïve café, Ægir, 日本語, emoji 🎭!\n\t  \n";

    #[test]
    fn round_trip_including_non_ascii() {
        let tok = Tokenizer::gpt2().unwrap();
        let ids = tok.encode(PASSAGE);
        assert!(ids.len() > 50);
        assert!(ids.iter().all(|&t| (t as usize) < GPT2_VOCAB && t != EOT));
        assert_eq!(tok.decode(&ids), PASSAGE);
        // Known GPT-2 ids: "Hello" = 15496, " world" = 995.
        assert_eq!(tok.encode("Hello world"), vec![15496, 995]);
    }

    #[test]
    fn special_tokens_not_parsed_and_eot_decodes() {
        let tok = Tokenizer::gpt2().unwrap();
        let ids = tok.encode("a<|endoftext|>b");
        assert!(!ids.contains(&EOT));
        assert_eq!(tok.decode(&ids), "a<|endoftext|>b");
        let mut with_eot = tok.encode("first");
        with_eot.push(EOT);
        with_eot.extend(tok.encode("second"));
        assert_eq!(tok.decode(&with_eot), "first<|endoftext|>second");
        assert_eq!(tok.decode(&[EOT]), "<|endoftext|>");
    }

    #[test]
    fn decode_is_lossy_not_panicking() {
        let tok = Tokenizer::gpt2().unwrap();
        let ids = tok.encode("🎭");
        assert!(ids.len() > 1, "emoji spans several byte tokens");
        let partial = tok.decode(&ids[..1]);
        assert!(partial.contains('\u{FFFD}'));
        assert_eq!(tok.decode(&[15496, 999_999]), "Hello\u{FFFD}");
        assert_eq!(tok.decode(&[]), "");
    }

    #[test]
    fn split_points_preserve_tokens() {
        let tok = Tokenizer::gpt2().unwrap();
        let text = PASSAGE.repeat(40);
        for target in [1, 7, 100, 1000, 100_000] {
            let cuts = split_points(&text, target);
            if target <= 1000 {
                assert!(!cuts.is_empty());
            }
            let mut bounds = vec![0];
            bounds.extend(&cuts);
            bounds.push(text.len());
            assert!(bounds.windows(2).all(|w| w[0] < w[1]));
            let joined: Vec<u32> = bounds
                .windows(2)
                .flat_map(|w| tok.encode(&text[w[0]..w[1]]))
                .collect();
            assert_eq!(joined, tok.encode(&text), "target {target}");
        }
    }
}
