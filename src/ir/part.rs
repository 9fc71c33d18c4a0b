//! Where a tensor-parallel rank's part of a tensor sits in the whole tensor ([`TensorPart`]):
//! the runs of the whole tensor it holds, and how its elements fall into the whole tensor's
//! 8-bit optimizer blocks ([`TensorPart::block_pieces`]), so a part's moments are quantized
//! in the blocks one process would use.

use std::ops::Range;

/// Where a tensor-parallel rank's tensor sits in the model's tensor of the same name: the
/// ranges of dimension `dim` it keeps, concatenated in order (GPT-2's fused `c_attn` keeps
/// three: its q, k and v columns). The rank's tensor is contiguous in its own layout, so
/// its kernels read it as any tensor; only loading, saving and initialising map it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorPart {
    /// The whole tensor's shape (as Hugging Face stores it).
    pub whole: Vec<usize>,
    /// The dimension cut.
    pub dim: usize,
    /// The ranges of `dim` kept, in the part's order.
    pub ranges: Vec<Range<usize>>,
}

impl TensorPart {
    /// Elements of the whole tensor.
    pub fn whole_len(&self) -> usize {
        self.whole.iter().product()
    }

    /// The part's contiguous runs in order: (offset in the whole tensor, length); the part
    /// is their concatenation.
    pub fn runs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let outer: usize = self.whole[..self.dim].iter().product();
        let inner: usize = self.whole[self.dim + 1..].iter().product();
        let d = self.whole[self.dim];
        (0..outer).flat_map(move |o| {
            self.ranges
                .iter()
                .map(move |r| ((o * d + r.start) * inner, r.len() * inner))
        })
    }

    /// The part's elements `range` (in the part's order) as runs of the whole tensor, in
    /// order: (offset in the whole tensor, the part's elements it holds). What loading and
    /// saving a piece of a part map through, so neither needs the whole tensor's runs.
    pub fn runs_in(&self, range: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        let mut at = 0;
        self.runs().filter_map(move |(w, n)| {
            let (lo, hi) = (range.start.max(at), range.end.min(at + n));
            let run = (lo < hi).then(|| (w + lo - at, lo..hi));
            at += n;
            run
        })
    }

    /// The part's elements `range` cut where the whole tensor's blocks of `block` values
    /// change (8-bit optimizer state is quantized in such blocks, `ir::strategy::QBLOCK`):
    /// (the whole tensor's block, the part's elements in it), in order. The runs keep the
    /// whole tensor's order, so a block's elements in the part are consecutive and each
    /// block comes once; a block the part holds none of does not come.
    pub fn block_pieces(
        &self,
        range: Range<usize>,
        block: usize,
    ) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        let mut pieces = self
            .runs_in(range)
            .flat_map(move |(w, r)| {
                // The run's elements, cut at the whole tensor's block edges.
                let mut at = r.start;
                std::iter::from_fn(move || {
                    (at < r.end).then(|| {
                        let b = (w + at - r.start) / block;
                        let end = r.end.min(r.start + (b + 1) * block - w);
                        let piece = (b, at..end);
                        at = end;
                        piece
                    })
                })
            })
            .peekable();
        std::iter::from_fn(move || {
            let (b, mut r) = pieces.next()?;
            while let Some((_, next)) = pieces.next_if(|(nb, nr)| *nb == b && nr.start == r.end) {
                r.end = next.end;
            }
            Some((b, r))
        })
    }

    /// Copies the part out of the whole tensor `whole` into `part`.
    pub fn take<T: Copy>(&self, whole: &[T], part: &mut [T]) {
        let mut at = 0;
        for (w, n) in self.runs() {
            part[at..at + n].copy_from_slice(&whole[w..w + n]);
            at += n;
        }
        debug_assert_eq!(at, part.len());
    }

    /// Copies `part` into its place in the whole tensor `whole`.
    pub fn put<T: Copy>(&self, part: &[T], whole: &mut [T]) {
        let mut at = 0;
        for (w, n) in self.runs() {
            whole[w..w + n].copy_from_slice(&part[at..at + n]);
            at += n;
        }
        debug_assert_eq!(at, part.len());
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // a part keeping one range of its dimension
mod tests {
    use super::*;

    /// Every element of the whole tensor's blocks, by block: from the part's pieces and
    /// straight from its runs.
    fn by_block(p: &TensorPart, range: Range<usize>, block: usize) -> Vec<(usize, usize)> {
        let mut from_runs = Vec::new();
        for (w, r) in p.runs_in(range.clone()) {
            for (k, i) in r.enumerate() {
                from_runs.push(((w + k) / block, i));
            }
        }
        let mut from_pieces = Vec::new();
        let mut seen = Vec::new();
        for (b, r) in p.block_pieces(range, block) {
            assert!(!seen.contains(&b), "block {b} comes once");
            seen.push(b);
            from_pieces.extend(r.map(|i| (b, i)));
        }
        assert_eq!(from_pieces, from_runs);
        from_pieces
    }

    #[test]
    fn block_pieces_cover_the_part_once_in_the_whole_tensors_blocks() {
        // Rows kept (a column-parallel weight), columns kept (row-parallel), three ranges
        // (a fused q|k|v), blocks smaller and larger than a run.
        let parts = [
            TensorPart {
                whole: vec![12, 10],
                dim: 0,
                ranges: vec![3..9],
            },
            TensorPart {
                whole: vec![6, 10],
                dim: 1,
                ranges: vec![5..10],
            },
            TensorPart {
                whole: vec![4, 18],
                dim: 1,
                ranges: vec![2..4, 8..10, 14..16],
            },
            TensorPart {
                whole: vec![7],
                dim: 0,
                ranges: vec![0..3],
            },
        ];
        for p in &parts {
            let n: usize = p.runs().map(|r| r.1).sum();
            for block in [1, 3, 4, 7, 16, 64] {
                for range in [0..n, 1..n, 0..n - 1, n / 3..n / 2 + 1] {
                    let got = by_block(p, range.clone(), block);
                    assert_eq!(got.len(), range.len());
                }
            }
        }
        // Columns 5..10 of rows of 10 in blocks of 4: the part's elements 0..5 are whole
        // elements 5..10 (blocks 1 and 2), then 15..20 (blocks 3 and 4).
        let p = &parts[1];
        let pieces: Vec<_> = p.block_pieces(0..10, 4).collect();
        assert_eq!(pieces, [(1, 0..3), (2, 3..5), (3, 5..6), (4, 6..10)]);
    }
}
