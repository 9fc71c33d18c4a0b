//! Memory tiers. Today one tier, host RAM, held in one [`arena::Arena`] per plan; NVMe and
//! device tiers come with offload and the CUDA backend.

pub mod arena;
