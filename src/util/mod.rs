//! Small shared utilities: crash-safe file writes, deterministic RNG, process memory readings, threads and their limits,
//! byte formatting, the user cache's location, which directories memwall may replace, fetching from PyPI with pip.

pub mod atomic;
pub mod atomic_dir;
pub mod bytes;
pub mod cache;
pub mod malloc;
pub mod owned_dir;
pub mod pip;
pub mod rng;
pub mod rss;
pub mod threads;
