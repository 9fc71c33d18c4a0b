//! How the ranks of a job are arranged: a mesh of data × tensor × pipeline axes (Megatron's
//! order: the tensor axis varies fastest, so a tensor group is neighbouring ranks, then the
//! data axis, then the pipeline stages), and where this rank sits in it. Every collective a
//! plan holds runs along one axis ([`Axis`]), among the ranks that differ from this one only
//! there. The data axis is what "ranks" meant before tensor and pipeline parallelism: each
//! of its ranks runs the same plan on its own rows. Along the tensor axis each rank holds a
//! slice of every layer ([`TensorSplit`]: Megatron's layout); along the pipeline axis each
//! rank holds a stage of consecutive layers ([`PipelineStage`]: as even as they divide, or
//! the runs `--pp-layers` gives), the first the embedding, the last the final norm, the head
//! and the loss.

use serde::Serialize;
use serde::ser::SerializeMap;

/// An axis of the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Axis {
    /// Ranks that hold the same model and split the batch (ZeRO shards state along it).
    Data,
    /// Ranks that each hold a slice of every layer.
    Tensor,
    /// Ranks that each hold a stage of the layers.
    Pipeline,
    /// The first and the last stage of this rank's pipeline (two ranks where there are
    /// stages): the two holding a tied embedding, whose gradients are summed between them.
    /// Not an axis of the mesh ([`Axis::ALL`]): a group of the pipeline axis's ends.
    PipelineEnds,
}

impl Axis {
    /// The axes of the mesh.
    pub const ALL: [Axis; 3] = [Axis::Tensor, Axis::Data, Axis::Pipeline];
}

/// The mesh's sizes and this rank's place (`rank` in the whole job, `0..world()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    pub data: usize,
    pub tensor: usize,
    pub pipeline: usize,
    /// This rank in the whole job.
    pub rank: usize,
}

impl Mesh {
    /// One process.
    pub const SINGLE: Mesh = Mesh {
        data: 1,
        tensor: 1,
        pipeline: 1,
        rank: 0,
    };

    /// `ranks` processes splitting the batch (data parallelism), this one being `rank`.
    pub fn data_parallel(ranks: usize, rank: usize) -> Mesh {
        Mesh {
            data: ranks,
            rank,
            ..Mesh::SINGLE
        }
    }

    /// `ranks` processes as `pipeline` stages of `tensor` neighbouring ranks each, the copies
    /// splitting the batch; `tensor × pipeline` divides `ranks` (checked by the caller, naming
    /// its flags).
    pub fn new(ranks: usize, tensor: usize, pipeline: usize, rank: usize) -> Mesh {
        let (tensor, pipeline) = (tensor.max(1), pipeline.max(1));
        debug_assert_eq!(
            ranks % (tensor * pipeline),
            0,
            "--tp {tensor} --pp {pipeline} of {ranks} ranks"
        );
        Mesh {
            data: ranks / (tensor * pipeline),
            tensor,
            pipeline,
            rank,
        }
    }

    /// This rank's index along the data axis (its shard of sharded state, its rows).
    pub fn data_rank(&self) -> usize {
        self.coord(Axis::Data)
    }

    /// Ranks in the whole job.
    pub fn world(&self) -> usize {
        self.data * self.tensor * self.pipeline
    }

    /// Ranks along `axis`.
    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Data => self.data,
            Axis::Tensor => self.tensor,
            Axis::Pipeline => self.pipeline,
            Axis::PipelineEnds => self.pipeline.min(2),
        }
    }

    /// This rank's index along `axis`.
    pub fn coord(&self, axis: Axis) -> usize {
        let (t, d) = (self.tensor.max(1), self.data.max(1));
        match axis {
            Axis::Tensor => self.rank % t,
            Axis::Data => (self.rank / t) % d,
            Axis::Pipeline => self.rank / (t * d),
            Axis::PipelineEnds => usize::from(self.rank / (t * d) > 0),
        }
    }

    /// Whether this rank is on the first or the last pipeline stage (a member of its
    /// [`Axis::PipelineEnds`] group).
    pub fn at_pipeline_end(&self) -> bool {
        let s = self.coord(Axis::Pipeline);
        s == 0 || s + 1 == self.pipeline.max(1)
    }

    /// This rank's share of every layer along the tensor axis.
    pub fn tensor_split(&self) -> TensorSplit {
        TensorSplit::new(self.tensor.max(1), self.coord(Axis::Tensor))
    }

    /// This rank's stage of the layers along the pipeline axis, of the cut `counts` (each
    /// stage's count of consecutive layers, in order: [`even_layers`] or `--pp-layers`; its
    /// length is the pipeline's size).
    pub fn pipeline_stage(&self, counts: &[usize]) -> PipelineStage {
        match self.pipeline > 1 {
            true => PipelineStage::of(counts, self.coord(Axis::Pipeline)),
            false => PipelineStage::WHOLE,
        }
    }

    /// This rank's part of the model: its tensor share of its stage of the cut `counts`.
    pub fn model_part(&self, counts: &[usize]) -> ModelPart {
        ModelPart {
            tensor: self.tensor_split(),
            stage: self.pipeline_stage(counts),
        }
    }

    /// The job's ranks along `axis` through this one, in order of their index on it (this
    /// rank is at [`Mesh::coord`]): the members of its communicator on that axis.
    pub fn group(&self, axis: Axis) -> Vec<usize> {
        let (t, d) = (self.tensor.max(1), self.data.max(1));
        let (tc, dc, pc) = (
            self.coord(Axis::Tensor),
            self.coord(Axis::Data),
            self.coord(Axis::Pipeline),
        );
        let at = |tc: usize, dc: usize, pc: usize| tc + t * (dc + d * pc);
        (0..self.size(axis))
            .map(|i| match axis {
                Axis::Tensor => at(i, dc, pc),
                Axis::Data => at(tc, i, pc),
                Axis::Pipeline => at(tc, dc, i),
                Axis::PipelineEnds => at(tc, dc, i * (self.pipeline - 1)),
            })
            .collect()
    }
}

/// A tensor-parallel rank's share of a model (Megatron's layout): of every layer's attention
/// heads, key/value heads and MLP channels, the `rank`-th of `size` equal contiguous parts.
/// Column-parallel projections (q, k, v, gate, up, GPT-2's `c_attn` and `c_fc`) keep their
/// outputs' part, row-parallel ones (o, down, the `c_proj`s) their inputs' part, the token
/// embedding and the LM head their rows of the vocabulary ([`TensorSplit::vocab_part`]), and
/// every other tensor (norms, learned positions, the row-parallel biases) is whole on every
/// rank.
///
/// With `sequence` (Megatron's sequence parallelism, Korthikanti et al. 2022) the residual
/// stream between the parallel regions is cut too: each rank holds its `rank`-th run of the
/// N token rows ([`super::schedule::Rows::own`]), on which the norms and residual adds run; a
/// column-parallel layer gathers the rows it reads (all-gather), a row-parallel layer's
/// output is reduce-scattered back to them, and in the backward the two swap. The norms'
/// gradients are then each rank's share, summed over the tensor axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TensorSplit {
    /// Ranks on the tensor axis.
    pub size: usize,
    /// This rank's index on it.
    pub rank: usize,
    /// Sequence parallelism: the residual stream cut by token rows among the tensor ranks.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub sequence: bool,
}

impl TensorSplit {
    /// The whole model (one rank on the tensor axis).
    pub const WHOLE: TensorSplit = TensorSplit {
        size: 1,
        rank: 0,
        sequence: false,
    };

    /// The `rank`-th of `size` tensor ranks, the residual stream whole on each.
    pub fn new(size: usize, rank: usize) -> TensorSplit {
        TensorSplit {
            size,
            rank,
            sequence: false,
        }
    }

    /// Whether the residual stream is cut by rows among the ranks (sequence parallelism on
    /// more than one rank).
    pub fn cuts_rows(&self) -> bool {
        self.sequence && self.is_split()
    }

    /// Whether the model is cut at all.
    pub fn is_split(&self) -> bool {
        self.size > 1
    }

    /// This rank's part of `n` items (heads, channels) cut into `size` equal parts; `n` is a
    /// multiple of `size` (the model's check, `ModelSpec::check_tensor_split`).
    pub fn part(&self, n: usize) -> std::ops::Range<usize> {
        debug_assert_eq!(n % self.size, 0, "{n} items among {} ranks", self.size);
        let k = n / self.size;
        self.rank * k..(self.rank + 1) * k
    }

    /// This rank's count of `n` items.
    pub fn len(&self, n: usize) -> usize {
        n / self.size
    }

    /// This rank's token ids of a vocabulary of `v` (the rows it holds of the embedding and
    /// the LM head, Megatron's vocabulary-parallel layout): the `rank`-th of `size`
    /// contiguous runs, ⌊r·v/size⌋..⌊(r+1)·v/size⌋, so a vocabulary the ranks do not divide
    /// is cut as evenly as it can be, no row padded.
    pub fn vocab_part(&self, v: usize) -> std::ops::Range<usize> {
        self.rank * v / self.size..(self.rank + 1) * v / self.size
    }

    /// Whether this rank adds what a row-parallel layer adds once (its bias, the residual):
    /// the first on the axis; the others' partial sums are added to it by the all-reduce.
    pub fn adds_once(&self) -> bool {
        self.rank == 0
    }
}

/// A neighbouring stage along the pipeline axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Peer {
    /// The stage after this one (which reads this one's output).
    Next,
    /// The stage before this one (whose output this one reads).
    Prev,
}

/// A pipeline stage: of a model's layers, the `rank`-th of `size` runs of consecutive layers,
/// `start..end` (as even as they divide by default, [`even_layers`]; any runs `--pp-layers`
/// gives). The first stage also holds the embedding, the last the final norm, the LM head
/// and the loss; a tied embedding is held by both ends, its gradients summed between them.
///
/// **Interleaved** (`chunks` V > 1, `--pp-chunks`; Narayanan et al. 2021, Megatron's virtual
/// pipeline stages): the layers are cut as even as they divide into `size × V` runs (virtual
/// stages), and the stage holds runs `rank`, `rank + size`, … ([`PipelineStage::chunk_layers`]),
/// so a micro-batch passes every rank V times, the last sending on to the first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PipelineStage {
    /// Stages on the pipeline axis.
    pub size: usize,
    /// This stage's index on it.
    pub rank: usize,
    /// Its first layer (of its one run: `chunks` is 1).
    pub start: usize,
    /// One past its last layer (`usize::MAX` for [`PipelineStage::WHOLE`]: to the model's end).
    pub end: usize,
    /// The runs of layers it holds: 1, or V of the interleaved schedule.
    #[serde(skip_serializing_if = "is_one")]
    pub chunks: usize,
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// Each of `p` stages' count of the `n` layers, as even as they divide: the first `n % p`
/// stages one layer more.
pub fn even_layers(n: usize, p: usize) -> Vec<usize> {
    let p = p.max(1);
    (0..p).map(|s| n / p + usize::from(s < n % p)).collect()
}

impl PipelineStage {
    /// The whole model in one stage.
    pub const WHOLE: PipelineStage = PipelineStage {
        size: 1,
        rank: 0,
        start: 0,
        end: usize::MAX,
        chunks: 1,
    };

    /// Stage `rank` of the cut `counts`: each stage's count of consecutive layers, in order
    /// (checked by the caller: `plan::stage_layers::check`, naming `--pp-layers`).
    pub fn of(counts: &[usize], rank: usize) -> PipelineStage {
        let start = counts[..rank].iter().sum();
        PipelineStage {
            size: counts.len(),
            rank,
            start,
            end: start + counts[rank],
            chunks: 1,
        }
    }

    /// Stage `rank` of `size` holding `chunks` runs of the layers cut as even as they divide
    /// into `size × chunks` (the interleaved schedule; `chunks` 1: [`PipelineStage::even`]'s
    /// run, given the layer count `n`).
    pub fn interleaved(size: usize, rank: usize, chunks: usize, n: usize) -> PipelineStage {
        match chunks {
            0 | 1 => PipelineStage::even(size, rank, n),
            _ => PipelineStage {
                size,
                rank,
                start: 0,
                end: 0,
                chunks,
            },
        }
    }

    /// Stage `rank` of `size`, the model's `n` layers cut as even as they divide.
    pub fn even(size: usize, rank: usize, n: usize) -> PipelineStage {
        PipelineStage::of(&even_layers(n, size), rank)
    }

    /// The stage `rank` of the same cut (another rank's on the pipeline axis).
    pub fn sibling(&self, rank: usize, counts: &[usize]) -> PipelineStage {
        match (self.is_split(), self.chunks > 1) {
            (false, _) => *self,
            (true, true) => PipelineStage { rank, ..*self },
            (true, false) => PipelineStage::of(counts, rank),
        }
    }

    /// Whether the model is cut into stages at all.
    pub fn is_split(&self) -> bool {
        self.size > 1
    }

    /// Whether this stage holds the embedding (and reads the tokens).
    pub fn is_first(&self) -> bool {
        self.rank == 0
    }

    /// Whether this stage holds the final norm, the LM head and the loss.
    pub fn is_last(&self) -> bool {
        self.rank + 1 == self.size
    }

    /// This stage's runs of the model's `n` layers, in model order: one (a cut's stages
    /// end within them: `plan::stage_layers::check`; [`PipelineStage::WHOLE`]'s is all `n`),
    /// or its `chunks` virtual stages' (each one layer or more: checked by the planner).
    pub fn chunk_layers(&self, n: usize) -> Vec<std::ops::Range<usize>> {
        if self.chunks <= 1 {
            debug_assert!(
                self.end == usize::MAX || self.end <= n,
                "{self:?} of {n} layers"
            );
            return std::iter::once(self.start.min(n)..self.end.min(n)).collect();
        }
        let counts = even_layers(n, self.size * self.chunks);
        let start = |v: usize| counts[..v].iter().sum::<usize>();
        (0..self.chunks)
            .map(|k| k * self.size + self.rank)
            .map(|v| start(v)..start(v) + counts[v])
            .collect()
    }

    /// The index on the pipeline axis of `peer`: the neighbour, the last stage's next being
    /// the first under the interleaved schedule (a micro-batch's next chunk).
    pub fn peer(&self, peer: Peer) -> usize {
        match peer {
            Peer::Next => (self.rank + 1) % self.size,
            Peer::Prev => (self.rank + self.size - 1) % self.size,
        }
    }

    /// Micro-batches whose forward this stage runs before its first backward under 1F1B
    /// (Narayanan et al. 2021; Megatron's `num_warmup_microbatches` + 1): `min(size − rank,
    /// m)`, the most whose activations it holds at once. Interleaved, in chunks (each
    /// 1/V of its layers): `min(2(size − rank − 1) + (V − 1)·size + 1, V·m)`.
    pub fn in_flight(&self, micro: usize) -> usize {
        match self.chunks {
            0 | 1 => (self.size - self.rank).min(micro),
            v => (2 * (self.size - self.rank - 1) + (v - 1) * self.size + 1).min(v * micro),
        }
    }
}

/// A rank's part of a model: its tensor-parallel share of its pipeline stage's layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ModelPart {
    pub tensor: TensorSplit,
    pub stage: PipelineStage,
}

impl ModelPart {
    /// The whole model.
    pub const WHOLE: ModelPart = ModelPart {
        tensor: TensorSplit::WHOLE,
        stage: PipelineStage::WHOLE,
    };

    /// A tensor-parallel share of the whole model (one stage).
    pub fn tensor(tensor: TensorSplit) -> ModelPart {
        ModelPart {
            tensor,
            stage: PipelineStage::WHOLE,
        }
    }
}

/// Serialised as the data axis's `ranks` and `rank` (what plan.json has always said), and
/// the other axes' sizes where they are more than 1.
impl Serialize for Mesh {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let extra = (self.tensor > 1) as usize + (self.pipeline > 1) as usize;
        let mut m = s.serialize_map(Some(2 + extra))?;
        m.serialize_entry("ranks", &self.data)?;
        m.serialize_entry("rank", &self.coord(Axis::Data))?;
        if self.tensor > 1 {
            m.serialize_entry("tensor", &self.tensor)?;
        }
        if self.pipeline > 1 {
            m.serialize_entry("pipeline", &self.pipeline)?;
        }
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_has_one_place_and_its_groups_cross_there() {
        let (t, d, p) = (2, 3, 2);
        let mut seen = std::collections::HashSet::new();
        for rank in 0..t * d * p {
            let m = Mesh {
                data: d,
                tensor: t,
                pipeline: p,
                rank,
            };
            assert_eq!(m.world(), 12);
            let place = Axis::ALL.map(|a| m.coord(a));
            assert!(seen.insert(place), "rank {rank} shares its place {place:?}");
            for a in Axis::ALL {
                let g = m.group(a);
                assert_eq!(g.len(), m.size(a));
                assert_eq!(g[m.coord(a)], rank, "{a:?}: {g:?}");
                // Every member sees the same group.
                for &other in &g {
                    let o = Mesh { rank: other, ..m };
                    assert_eq!(o.group(a), g);
                }
            }
        }
        // Megatron's order: a tensor group is neighbouring ranks.
        let m = Mesh {
            data: d,
            tensor: t,
            pipeline: p,
            rank: 5,
        };
        assert_eq!(m.group(Axis::Tensor), vec![4, 5]);
        assert_eq!(m.group(Axis::Data), vec![1, 3, 5]);
        assert_eq!(m.group(Axis::Pipeline), vec![5, 11]);
    }

    #[test]
    fn stages_cover_the_layers_once_in_order_and_as_even_as_they_divide() {
        for (n, p) in [(12, 2), (12, 4), (5, 2), (7, 3), (4, 4)] {
            let mut next = 0;
            for rank in 0..p {
                let s = PipelineStage::even(p, rank, n);
                let l = s.chunk_layers(n)[0].clone();
                assert_eq!(l.start, next, "{n} layers, {p} stages");
                assert!(l.len() == n / p || l.len() == n / p + 1, "{l:?}");
                next = l.end;
            }
            assert_eq!(next, n);
        }
        let m = Mesh::new(8, 2, 2, 6);
        assert_eq!((m.data, m.tensor, m.pipeline), (2, 2, 2));
        assert_eq!(m.pipeline_stage(&[9, 3]), PipelineStage::of(&[9, 3], 1));
        assert_eq!(m.pipeline_stage(&[9, 3]).chunk_layers(12), vec![(9..12)]);
        assert_eq!(PipelineStage::even(4, 1, 8).in_flight(8), 3);
        assert_eq!(PipelineStage::even(4, 0, 8).in_flight(2), 2);
        assert_eq!(
            Mesh::SINGLE.pipeline_stage(&[]).chunk_layers(12),
            vec![(0..12)]
        );
        // Interleaved: 10 layers in 2 × 3 runs (2,2,2,2,1,1); stage 1 holds runs 1, 3, 5.
        let s = PipelineStage::interleaved(2, 1, 3, 10);
        assert_eq!(s.chunk_layers(10), [2..4, 6..8, 9..10]);
        let held = |l: usize| s.chunk_layers(10).iter().any(|r| r.contains(&l));
        assert!(held(9) && !held(8));
        assert_eq!((s.peer(Peer::Next), s.peer(Peer::Prev)), (0, 0));
    }

    #[test]
    fn data_parallelism_is_the_data_axis_alone() {
        let m = Mesh::data_parallel(4, 3);
        assert_eq!((m.world(), m.coord(Axis::Data)), (4, 3));
        assert_eq!(m.group(Axis::Data), vec![0, 1, 2, 3]);
        assert_eq!(m.group(Axis::Tensor), vec![3]);
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(json, r#"{"ranks":4,"rank":3}"#);
    }
}
