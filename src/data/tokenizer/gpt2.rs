//! GPT-2's byte-level BPE tokenizer (`r50k_base`, 50257 tokens), via `tiktoken-rs`.
//!
//! The vocabulary is embedded in the `tiktoken-rs` crate, so this works offline. It is built
//! once per process (a few tens of milliseconds) and shared; `Gpt2` is a cheap handle.

use anyhow::{Result, anyhow};
use std::sync::OnceLock;
use tiktoken_rs::CoreBPE;

/// The `<|endoftext|>` token that separates documents.
pub const EOT: u32 = 50256;
/// Size of the GPT-2 vocabulary (50000 merges + 256 bytes + `<|endoftext|>`).
pub const GPT2_VOCAB: usize = 50257;
/// [`super::TokenizerId::name`] of GPT-2's tokenizer, as `meta.json` records it.
pub const GPT2_NAME: &str = "gpt2-r50k_base";
/// [`super::TokenizerId::hash`] of GPT-2's tokenizer: the embedded table's name (it has no
/// `tokenizer.json` to hash).
pub const GPT2_HASH: &str = "r50k_base";

/// A handle to the process-wide GPT-2 BPE.
#[derive(Clone, Copy)]
pub(super) struct Gpt2 {
    bpe: &'static CoreBPE,
}

static GPT2: OnceLock<CoreBPE> = OnceLock::new();

impl Gpt2 {
    /// The GPT-2 tokenizer (built on first use, then shared).
    pub(super) fn get() -> Result<Gpt2> {
        if let Some(bpe) = GPT2.get() {
            return Ok(Gpt2 { bpe });
        }
        let built = tiktoken_rs::r50k_base()
            .map_err(|e| anyhow!("cannot build the GPT-2 tokenizer: {e}"))?;
        // Another thread may have won the race; either value is the same tokenizer.
        let _ = GPT2.set(built);
        let bpe = GPT2
            .get()
            .ok_or_else(|| anyhow!("GPT-2 tokenizer was not initialised"))?;
        Ok(Gpt2 { bpe })
    }

    /// Encodes ordinary text; special tokens are not parsed.
    pub(super) fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Encodes rendered chat text: `<|endoftext|>` in it is the token; each token's byte
    /// range in `text`, in order, as the cumulative lengths of the tokens' bytes.
    pub(super) fn encode_special(&self, text: &str) -> (Vec<u32>, Vec<(usize, usize)>) {
        let ids = self.bpe.encode_with_special_tokens(text);
        let mut at = 0;
        let offsets = ids
            .iter()
            .map(|&t| {
                let n = self.bpe.decode_bytes(&[t]).map_or(0, |b| b.len());
                at += n;
                (at - n, at)
            })
            .collect();
        (ids, offsets)
    }

    /// Decodes tokens; cut UTF-8 and tokens outside the vocabulary become U+FFFD.
    pub(super) fn decode(&self, tokens: &[u32]) -> String {
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
}

/// The bytes of every GPT-2 token, id by id ([`GPT2_VOCAB`] of them; [`EOT`] is
/// `<|endoftext|>`): the vocabulary a GGUF file or a `tokenizer.json` spells out.
pub fn token_bytes() -> Result<Vec<Vec<u8>>> {
    let g = Gpt2::get()?;
    (0..GPT2_VOCAB as u32)
        .map(|id| {
            g.bpe
                .decode_bytes(&[id])
                .map_err(|e| anyhow!("GPT-2 token {id} has no bytes: {e:?}"))
        })
        .collect()
}
