//! Small shared utilities: crash-safe file writes, deterministic RNG, process memory readings,
//! byte formatting.

pub mod atomic;
pub mod bytes;
pub mod malloc;
pub mod rng;
pub mod rss;
