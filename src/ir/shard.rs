//! How a parameter group's elements are split among ranks (ZeRO stages 1–3): a [`Cut`]
//! per group gives rank r its chunk of the buffers the collectives move, so reduce-scatter
//! and all-gather work in place. The even cut pads the group's `n` elements to `N·S` (`S` =
//! ⌈n/N⌉ rounded up to [`SHARD_ALIGN`]; some of the last ranks own padding only); with 8-bit
//! optimizer state the cut falls on the blocks' edges instead ([`Sharding::at_edges`]), so
//! no block straddles two ranks.

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Which collective a plan op is (for the bytes each rank sends, [`Cut::sent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// How a collective's buffer is cut among the ranks of its axis (chunk r is rank r's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CutOf {
    /// As parameter group k's buffers are ([`crate::ir::Program::cuts`]`[k]`: ZeRO's).
    Group(usize),
    /// Evenly: of a buffer of n elements among R ranks, rank r's chunk is elements
    /// ⌊r·n/R⌋..⌊(r+1)·n/R⌋ (activations, [`Cut::even`]).
    Even,
}

impl CutOf {
    /// The cut of a buffer of `len` elements among `ranks`, `cuts` being the groups'.
    pub fn resolve<'a>(
        &self,
        cuts: &'a [Cut],
        len: usize,
        ranks: usize,
    ) -> std::borrow::Cow<'a, Cut> {
        match *self {
            CutOf::Group(k) => std::borrow::Cow::Borrowed(&cuts[k]),
            CutOf::Even => std::borrow::Cow::Owned(Cut::even(len, ranks)),
        }
    }
}

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
    /// The even cut of a group of `n` elements: chunks of S = ⌈n/N⌉ rounded up to
    /// [`SHARD_ALIGN`], the buffer padded to N·S.
    pub fn even(&self, n: usize) -> Cut {
        Cut::equal(
            n.div_ceil(self.ranks).next_multiple_of(SHARD_ALIGN),
            self.ranks,
        )
    }

    /// A cut of a group of `n` elements at allowed edges only (`allowed`: ascending offsets
    /// within the group, ending with `n`; e.g. the edges of 8-bit optimizer blocks): rank r's
    /// shard starts at the first allowed edge at or after r·⌈n/N⌉, so shards are as even as
    /// the edges let them be; the buffer is not padded (some ranks may own nothing).
    pub fn at_edges(&self, n: usize, allowed: &[usize]) -> Cut {
        debug_assert_eq!(allowed.last().copied().unwrap_or(0), n);
        let target = n.div_ceil(self.ranks);
        let mut edges = Vec::with_capacity(self.ranks + 1);
        edges.push(0);
        let mut i = 0;
        for r in 1..self.ranks {
            let want = (r * target).min(n);
            while i < allowed.len() && allowed[i] < want {
                i += 1;
            }
            edges.push(allowed.get(i).copied().unwrap_or(n));
        }
        edges.push(n);
        Cut { edges }
    }
}

/// How one parameter group's buffers (gradients, parameters, and so its moments) are split
/// among the ranks: rank r owns elements `edges[r]..edges[r+1]`; the buffers the collectives
/// move hold `edges[N]` elements (the group's, and padding). Every rank computes the same
/// cut, so each knows how long every other rank's messages are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cut {
    /// N+1 ascending offsets, from 0 to the buffer's length.
    edges: Vec<usize>,
}

impl Cut {
    /// N chunks of exactly `s` elements.
    pub fn equal(s: usize, ranks: usize) -> Cut {
        Cut {
            edges: (0..=ranks).map(|r| r * s).collect(),
        }
    }

    /// `len` elements among `ranks`, chunk r being ⌊r·len/ranks⌋..⌊(r+1)·len/ranks⌋.
    pub fn even(len: usize, ranks: usize) -> Cut {
        Cut {
            edges: (0..=ranks).map(|r| r * len / ranks).collect(),
        }
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.edges.len() - 1
    }

    /// Elements of a buffer cut this way (the group's, and padding).
    pub fn len(&self) -> usize {
        self.edges[self.ranks()]
    }

    /// Whether the buffer holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rank `r`'s chunk of the buffer.
    pub fn shard(&self, r: usize) -> Range<usize> {
        self.edges[r]..self.edges[r + 1]
    }

    /// The longest chunk.
    pub fn largest(&self) -> usize {
        (0..self.ranks())
            .map(|r| self.shard(r).len())
            .max()
            .unwrap_or(0)
    }

    /// The elements of `group` (the group's elements in the whole model) that rank `r` owns
    /// (maybe empty, at the start of its chunk).
    pub fn owned(&self, group: &Range<usize>, r: usize) -> Range<usize> {
        let c = self.shard(r);
        let lo = (group.start + c.start).min(group.end);
        let hi = (group.start + c.end).min(group.end);
        lo..hi.max(lo)
    }

    /// The same cut in other units: edge e becomes `f(e)` (e.g. from elements to 8-bit blocks).
    pub fn map(&self, f: impl Fn(usize) -> usize) -> Cut {
        Cut {
            edges: self.edges.iter().map(|&e| f(e)).collect(),
        }
    }

    /// Elements rank `r` sends in collective `c` over a buffer cut this way (the ring's
    /// schedule, [`crate::dist::ring`]): a reduce-scatter sends every chunk but its own, an
    /// all-gather every chunk but the next rank's, an all-reduce both.
    pub fn sent(&self, c: Collective, r: usize) -> usize {
        let n = self.ranks();
        if n == 1 {
            return 0;
        }
        let reduce = self.len() - self.shard(r).len();
        let gather = self.len() - self.shard((r + 1) % n).len();
        match c {
            Collective::AllReduce => reduce + gather,
            Collective::ReduceScatter => reduce,
            Collective::AllGather => gather,
        }
    }

    /// Scratch elements a collective over buffers cut this way needs: its longest chunk, at
    /// most [`PIECE_ELEMS`].
    pub fn scratch(&self) -> usize {
        self.largest().min(PIECE_ELEMS)
    }

    /// Messages per ring step with a scratch of `piece` elements: every rank sends as many
    /// (some empty), enough for the longest chunk, so the ranks' messages pair up.
    pub fn pieces(&self, piece: usize) -> usize {
        self.largest().div_ceil(piece.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_group_once() {
        for ranks in [1, 2, 3, 7, 64, 1024] {
            for n in [1usize, 15, 16, 768, 1536, 2_362_368, 7_087_872] {
                let group = 1000..1000 + n;
                let sh = |rank| Sharding {
                    ranks,
                    rank,
                    zero: Zero(1),
                };
                // Even, and at edges every 100 elements.
                let allowed: Vec<usize> = (1..=n.div_ceil(100)).map(|k| (k * 100).min(n)).collect();
                for cut in [sh(0).even(n), sh(0).at_edges(n, &allowed)] {
                    let mut next = group.start;
                    let mut covered = 0;
                    for rank in 0..ranks {
                        let o = cut.owned(&group, rank);
                        assert!(o.start == next || o.is_empty(), "contiguous");
                        next = o.end.max(next);
                        covered += o.len();
                    }
                    assert_eq!(covered, n, "ranks={ranks} n={n}");
                    assert!(cut.len() >= n && cut.len() - n < ranks * SHARD_ALIGN + ranks);
                }
                let even = sh(0).even(n);
                assert_eq!(even.largest() % SHARD_ALIGN, 0);
                assert!((0..ranks).all(|r| even.shard(r).len() == even.largest()));
                let at = sh(0).at_edges(n, &allowed);
                for r in 0..ranks {
                    let s = at.shard(r);
                    assert!(s.start == 0 || s.start == n || s.start % 100 == 0);
                    assert!(
                        s.len() <= n.div_ceil(ranks) + 100,
                        "as even as the edges allow"
                    );
                }
            }
        }
    }

    #[test]
    fn uneven_cuts_send_all_but_one_chunk() {
        let sh = Sharding {
            ranks: 3,
            rank: 0,
            zero: Zero(1),
        };
        let cut = sh.at_edges(10, &[4, 5, 10]);
        // Targets 4 and 8: the first allowed edges at or after them are 4 and 10.
        assert_eq!(
            (cut.shard(0), cut.shard(1), cut.shard(2)),
            (0..4, 4..10, 10..10)
        );
        use super::Collective::*;
        assert_eq!(cut.sent(ReduceScatter, 1), 4);
        assert_eq!(cut.sent(AllGather, 1), 10);
        assert_eq!(cut.sent(AllReduce, 2), 10 + 6);
        assert_eq!(cut.pieces(2), 3);
        assert_eq!(cut.map(|e| e * 2).shard(1), 8..20);
    }

    #[test]
    fn zero_parses_and_refuses() {
        assert_eq!("2".parse::<Zero>().unwrap(), Zero(2));
        let e = "4".parse::<Zero>().unwrap_err().to_string();
        assert!(e.contains("--zero") && e.contains("3"), "{e}");
    }
}
