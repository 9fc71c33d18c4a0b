//! [`TokenizerId`]: what prepared data and models compare tokenizers by (the identity of a
//! `tokenizer.json` is read by [`TokenizerId::of_file`], in [`super::hf`]).

use super::gpt2::{EOT, GPT2_HASH, GPT2_NAME, GPT2_VOCAB};
use serde::{Deserialize, Serialize};

/// What identifies a tokenizer: recorded in `meta.json`, compared between data and model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerId {
    /// `gpt2-r50k_base`, or `hf:<name of the directory holding tokenizer.json>`.
    pub name: String,
    /// Hex SHA-256 of `tokenizer.json`, or [`GPT2_HASH`].
    pub hash: String,
    /// Largest token id + 1, added tokens included.
    pub vocab_size: usize,
    /// The end-of-text token that separates documents.
    pub eot: u32,
}

impl TokenizerId {
    /// GPT-2's identity (no tables are built).
    pub fn gpt2() -> TokenizerId {
        TokenizerId {
            name: GPT2_NAME.into(),
            hash: GPT2_HASH.into(),
            vocab_size: GPT2_VOCAB,
            eot: EOT,
        }
    }

    /// Same tokens for the same text: equal hashes.
    pub fn same_as(&self, other: &TokenizerId) -> bool {
        self.hash == other.hash
    }

    /// `name (hash 0123456789ab)` for messages.
    pub fn describe(&self) -> String {
        let short: String = self.hash.chars().take(12).collect();
        format!("{} (hash {short})", self.name)
    }
}
