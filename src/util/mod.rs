//! Small shared utilities: deterministic RNG, process memory readings, byte formatting.

pub mod bytes;
pub mod rng;
pub mod rss;
