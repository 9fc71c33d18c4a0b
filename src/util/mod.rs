//! Small shared utilities: crash-safe file writes, deterministic RNG, process memory readings,
//! threads and their limits, byte formatting, the CPU's name, UTC dates, the user cache's location, which directories
//! memwall may replace, fetching from PyPI with pip, finding NaN and infinite values in
//! loaded weights, content fingerprints of models, telling a GGUF file by its bytes.

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
