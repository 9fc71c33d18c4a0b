//! Test fixtures: tiny Hugging Face `tokenizer.json` files written by hand (byte-level BPE
//! with a few merges and an added `<|endoftext|>`), for the tokenizer, prepare and loader
//! tests.

use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// GPT-2's byte → printable character table (`bytes_to_unicode`): printable Latin-1 bytes map
/// to themselves, the other 68 bytes to U+0100, U+0101, ... in byte order.
pub fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// Merges of the tiny BPE, in byte-level characters (`Ġ` is a space).
pub const MERGES: [(&str, &str); 10] = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("Ġ", "a"),
    ("i", "n"),
    ("Ġ", "s"),
    ("e", "r"),
    ("o", "u"),
    ("Ġa", "n"),
    ("Ġan", "d"),
];

/// What a fixture `tokenizer.json` holds.
#[derive(Clone)]
pub struct Spec {
    pub merges: Vec<(&'static str, &'static str)>,
    /// Unused vocabulary entries `<unused{i}>` after the merges (to make a large vocabulary).
    pub unused: usize,
    /// Added tokens after the BPE vocabulary: (content, special).
    pub added: Vec<(&'static str, bool)>,
    pub normalizer: Value,
    pub pre_tokenizer: Value,
    pub post_processor: Value,
}

impl Spec {
    /// Byte-level BPE as GPT-2's (ByteLevel pre-tokenizer with its regex), [`MERGES`],
    /// `<|endoftext|>` added as a special token.
    pub fn byte_level() -> Spec {
        Spec {
            merges: MERGES.to_vec(),
            unused: 0,
            added: vec![("<|endoftext|>", true)],
            normalizer: Value::Null,
            pre_tokenizer: json!({"type": "ByteLevel", "add_prefix_space": false,
                                  "trim_offsets": true, "use_regex": true}),
            post_processor: Value::Null,
        }
    }

    /// As Llama 3 / Qwen2: a `Split` with Llama 3's regex, then ByteLevel without regex.
    pub fn llama3_style() -> Spec {
        let pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        Spec {
            pre_tokenizer: json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
            ]}),
            ..Spec::byte_level()
        }
    }

    /// Token id of the first added token (ids: 256 bytes, one per merge, the unused entries,
    /// then the added tokens).
    pub fn first_added_id(&self) -> u32 {
        (256 + self.merges.len() + self.unused) as u32
    }

    /// The `tokenizer.json` text.
    pub fn json(&self) -> String {
        let chars = byte_chars();
        let mut vocab = serde_json::Map::new();
        for (i, c) in chars.iter().enumerate() {
            vocab.insert(c.to_string(), json!(i));
        }
        for (i, (a, b)) in self.merges.iter().enumerate() {
            vocab.insert(format!("{a}{b}"), json!(256 + i));
        }
        for i in 0..self.unused {
            vocab.insert(format!("<unused{i}>"), json!(256 + self.merges.len() + i));
        }
        let merges: Vec<String> = self
            .merges
            .iter()
            .map(|(a, b)| format!("{a} {b}"))
            .collect();
        let added: Vec<Value> = self
            .added
            .iter()
            .enumerate()
            .map(|(i, (content, special))| {
                json!({"id": self.first_added_id() + i as u32, "content": content,
                       "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": special})
            })
            .collect();
        let v = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": self.normalizer,
            "pre_tokenizer": self.pre_tokenizer,
            "post_processor": self.post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                        "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        });
        serde_json::to_string_pretty(&v).unwrap()
    }

    /// Writes `dir/tokenizer.json` (creating `dir`) and returns its path.
    pub fn write(&self, dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let p = dir.join("tokenizer.json");
        std::fs::write(&p, self.json()).unwrap();
        p
    }
}
