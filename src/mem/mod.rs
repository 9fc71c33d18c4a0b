//! Memory tiers: host RAM, held in one [`arena::Arena`] per plan, and the disk tier
//! ([`disk::DiskTier`], `--offload`), one preallocated file per run. Device tiers come with
//! the CUDA backend.

pub mod arena;
pub mod disk;
pub mod probe;

pub use arena::Arena;
