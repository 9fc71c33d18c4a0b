//! How a parameter group's elements are split among ranks (ZeRO stages 1–3): the group's
//! `n` elements are padded to `N·S` (`S` = ⌈n/N⌉ rounded up to [`SHARD_ALIGN`]) and rank
//! `r` owns elements `r·S .. (r+1)·S` of it (some of the last ranks own padding only).
//! Buffers that collectives move are laid out this way, so reduce-scatter and all-gather
//! work in place with equal chunks.

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Shard lengths are multiples of this many elements (64 bytes of f32).
pub const SHARD_ALIGN: usize = 16;

/// Elements of a collective's scratch piece at most: messages go in pieces this long, so the
/// scratch a plan holds for them is bounded whatever the group's size.
pub const PIECE_ELEMS: usize = 1 << 22;

/// The ZeRO stage: what each rank keeps of the model's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Zero(pub u8);

impl Zero {
    /// Plain data parallelism: every rank keeps everything; gradients are all-reduced.
    pub const DP: Zero = Zero(0);

    /// Optimizer state is sharded (stage ≥ 1).
    pub fn shards_optimizer(self) -> bool {
        self.0 >= 1
    }

    /// Gradients are reduce-scattered every micro-batch and only the shard is kept (≥ 2).
    pub fn shards_grads(self) -> bool {
        self.0 >= 2
    }

    /// Parameters are sharded and gathered for each use (stage 3).
    pub fn shards_params(self) -> bool {
        self.0 >= 3
    }
}

impl std::str::FromStr for Zero {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Zero> {
        match s.trim() {
            "0" => Ok(Zero(0)),
            "1" => Ok(Zero(1)),
            "2" => Ok(Zero(2)),
            "3" => Ok(Zero(3)),
            other => anyhow::bail!(
                "--zero {other:?}: expected 0 (data parallel), 1 (optimizer state sharded), 2 (and gradients) or 3 (and parameters)"
            ),
        }
    }
}

impl std::fmt::Display for Zero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// This rank's place among `ranks` and the ZeRO stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sharding {
    pub ranks: usize,
    pub rank: usize,
    pub zero: Zero,
}

impl Sharding {
    /// The shard length S of a group of `n` elements.
    pub fn chunk(&self, n: usize) -> usize {
        n.div_ceil(self.ranks).next_multiple_of(SHARD_ALIGN)
    }

    /// The padded length N·S of a group of `n` elements.
    pub fn padded(&self, n: usize) -> usize {
        self.chunk(n) * self.ranks
    }

    /// The parameter elements of `group` this rank owns (maybe empty): the group's
    /// elements within `start + rank·S .. start + (rank+1)·S`.
    pub fn owned(&self, group: &Range<usize>) -> Range<usize> {
        let s = self.chunk(group.len());
        let lo = (group.start + self.rank * s).min(group.end);
        let hi = (group.start + (self.rank + 1) * s).min(group.end);
        lo..hi
    }

    /// The first parameter element of this rank's shard of `group` (element 0 of a shard
    /// buffer; beyond the group's end for ranks that own padding only).
    pub fn shard_base(&self, group: &Range<usize>) -> usize {
        group.start + self.rank * self.chunk(group.len())
    }

    /// Scratch elements a collective over a group of `n` elements needs.
    pub fn scratch(&self, n: usize) -> usize {
        self.chunk(n).min(PIECE_ELEMS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_group_once() {
        for ranks in [1, 2, 3, 7, 64, 1024] {
            for n in [1, 15, 16, 768, 1536, 2_362_368, 7_087_872] {
                let group = 1000..1000 + n;
                let mut covered = 0;
                let mut next = group.start;
                for rank in 0..ranks {
                    let sh = Sharding {
                        ranks,
                        rank,
                        zero: Zero(1),
                    };
                    let o = sh.owned(&group);
                    assert!(o.start == next || o.is_empty(), "contiguous");
                    next = o.end.max(next);
                    covered += o.len();
                    assert_eq!(sh.chunk(n) % SHARD_ALIGN, 0);
                    assert!(sh.padded(n) >= n && sh.padded(n) - n < ranks * SHARD_ALIGN + ranks);
                    assert_eq!(sh.shard_base(&group), group.start + rank * sh.chunk(n));
                }
                assert_eq!(covered, n, "ranks={ranks} n={n}");
            }
        }
    }

    #[test]
    fn zero_parses_and_refuses() {
        assert_eq!("2".parse::<Zero>().unwrap(), Zero(2));
        let e = "4".parse::<Zero>().unwrap_err().to_string();
        assert!(e.contains("--zero") && e.contains("3"), "{e}");
    }
}
