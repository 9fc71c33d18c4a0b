//! Small shared utilities: crash-safe file writes, deterministic RNG, process memory readings,
//! threads and their limits, byte formatting, the CPU's name, UTC dates, the user cache's location, which directories
//! memwall may replace, fetching from PyPI with pip, finding NaN and infinite values in
//! loaded weights, content fingerprints of models, telling a GGUF file by its bytes.
//!
//! **Nothing is lost** (the design's sixth rule, which [`atomic`], [`atomic_dir`],
//! [`owned_dir`], [`fingerprint`] and [`threads`] serve; what the commands built on them
//! refuse):
//! - Every file memwall keeps is written atomically ([`atomic`], [`atomic_dir`]);
//!   `metrics.jsonl` grows a line per step and is cut back atomically on resume. A killed
//!   writer's temporaries are removed by a later write once its process is gone.
//! - A directory is replaced only when it carries the [`owned_dir::MARKER`] and holds only
//!   what the command that marked it writes, never the input; `prepare` never overwrites token
//!   files without memwall's magic; `cache --clear` removes only memwall's conversions; the
//!   demos check every output before writing any.
//! - A new run refuses a directory holding `step-N` checkpoints (loadable or not), or run
//!   files (`plan.json`, `metrics.jsonl`, ...) in a directory without the marker. `--resume`
//!   refuses to pass a newer `step-N` it cannot load (it would write over it), checks its data
//!   against the run's fingerprint (tokenizer and token counts; an examples set's boundaries
//!   and trained bits) with or without `--data`, and refuses the flags it would otherwise
//!   ignore (`--lr`, `--warmup`, `--weight-decay`, `--grad-clip`, `--seed`, `--lora-dropout`).
//! - `export --gguf` writes neither inside the model it reads (a GGUF base's file included)
//!   nor over a file it did not export (`memwall.exported_by`).
//! - A run records its paths absolute and its base's content [`fingerprint`]: `--resume` and,
//!   for the run's adapters, `export`, `merge` and `sample` refuse a base path that now holds
//!   another model (`ckpt::adapter::check_base`); a GGUF base's cleared conversion is made
//!   again (`TrainOptions::locate_base`); a full fine-tune resumes from its checkpoint alone.
//! - Sizes too large to plan (over 2^24 tokens a micro-batch, 4096 micro-batches, 1024 ranks
//!   or 1024 layers) are refused naming the flag or field, before any allocation. A thread the
//!   system refuses is an error naming the limit ([`threads`]), never a panic; a closed stdout
//!   ends the process with SIGPIPE's status 141 (`main.rs`).

pub mod atomic;
pub mod atomic_dir;
pub mod bytes;
pub mod cache;
pub mod clock;
pub mod fingerprint;
pub mod finite;
pub mod machine;
pub mod malloc;
pub mod owned_dir;
pub mod pip;
pub mod rng;
pub mod rss;
#[cfg(test)]
pub mod small_disk;
pub mod sniff;
pub mod threads;

/// `n` and `noun`, in the plural unless `n` is 1: `1 thread`, `2 threads`, `3 files`.
pub fn count(n: impl Into<u64>, noun: &str) -> String {
    match n.into() {
        1 => format!("1 {noun}"),
        n => format!("{n} {noun}s"),
    }
}
