//! Small shared utilities: crash-safe file writes, deterministic RNG, process memory readings,
//! byte formatting, the user cache's location, fetching from PyPI with pip, finding NaN and
//! infinite values in loaded weights.

pub mod atomic;
pub mod atomic_dir;
pub mod bytes;
pub mod cache;
pub mod finite;
pub mod malloc;
pub mod pip;
pub mod rng;
pub mod rss;
