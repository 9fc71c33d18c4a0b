//! Small shared utilities: deterministic RNG, process memory readings, byte formatting.

pub mod bytes;
pub mod malloc;
pub mod rng;
pub mod rss;
