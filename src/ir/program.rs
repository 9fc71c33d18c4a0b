//! What a backend starts on ([`Program`]): a plan's buffers with their tiers and offsets,
//! its schedule, the size of each tier it packed, how each parameter group is cut among the
//! ranks, and how to run it (storage type, threads, where the disk tier's file goes). A
//! backend reads nothing else of a plan, so it stands on this vocabulary alone, never on the
//! planner.

use super::Tier;
use super::buffer::{Buffer, TierSize};
use super::schedule::Schedule;
use super::shard::Cut;
use crate::dtype::DType;
use std::path::Path;

/// Name of the disk tier's file inside its directory (`--offload-dir`) for one process;
/// each rank of a job of several names its own ([`disk_tier_file`]).
pub const DISK_TIER_FILE: &str = "memwall-offload.bin";

/// Name of the disk tier's file of rank `rank` (`None`: a job of one process): ranks that
/// share an `--offload-dir` (one machine's) each have a file of their own.
pub fn disk_tier_file(rank: Option<usize>) -> String {
    match rank {
        None => DISK_TIER_FILE.to_string(),
        Some(r) => format!("memwall-offload.rank{r}.bin"),
    }
}

/// A plan as a backend runs it, borrowed from the plan.
#[derive(Clone, Copy, Debug)]
pub struct Program<'a> {
    /// Every buffer, indexed by [`super::BufId`], with its tier and offset.
    pub buffers: &'a [Buffer],
    /// The step's ops, in order.
    pub schedule: &'a Schedule,
    /// Bytes of each tier the backend declared ([`super::Sizing::tiers`]), in its order:
    /// the size of the one allocation it makes for each.
    pub tiers: &'a [TierSize],
    /// How each parameter group's buffers are split among the data-parallel ranks (indexed
    /// by the group the collective ops name; empty for one process).
    pub cuts: &'a [Cut],
    /// Element type of activations and gradients (f32, bf16 or f16).
    pub storage: DType,
    /// Compute threads (`--threads`).
    pub threads: usize,
    /// Directory of the disk tier's file ([`DISK_TIER_FILE`]; `--offload-dir`); `None` when
    /// the plan puts nothing there or was never meant to run.
    pub disk_dir: Option<&'a Path>,
    /// This rank's index in a job of several ranks (`None`: one process), naming its disk
    /// tier's file ([`disk_tier_file`]).
    pub rank: Option<usize>,
}

impl Program<'_> {
    /// Name of this program's disk tier file within [`Program::disk_dir`].
    pub fn disk_file(&self) -> String {
        disk_tier_file(self.rank)
    }

    /// Bytes the program packs in tier `t` (0 for a tier it does not plan).
    pub fn tier_bytes(&self, t: Tier) -> u64 {
        tier_bytes(self.tiers, t)
    }
}

/// Bytes of tier `t` in `tiers` (0 when absent).
pub fn tier_bytes(tiers: &[TierSize], t: Tier) -> u64 {
    tiers.iter().find(|s| s.tier == t).map_or(0, |s| s.bytes)
}
