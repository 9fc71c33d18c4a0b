//! The parameter inventory of a model, whatever its family: every tensor with its Hugging
//! Face name, shape, initialisation and offset in the one flat parameter buffer (llm.c style:
//! all parameters in one allocation, pointed into by a cursor), cut into groups that the
//! optimizer phase is emitted by. Gradients and optimizer moments use the same layout. The
//! family module ([`super::gpt2`]) decides the tensors; everything downstream (planner,
//! executor, checkpoints) reads only this.

use super::spec::Family;
pub use crate::ir::TensorPart;
use crate::ir::{ModelPart, PipelineStage, TensorSplit};
use std::ops::Range;

/// How a tensor is initialised when training starts from scratch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    /// Independent normal draws with this standard deviation.
    Normal {
        std: f32,
    },
    /// Independent uniform draws in [-bound, bound) (a LoRA adapter's `A`).
    Uniform {
        bound: f32,
    },
}

/// One parameter tensor inside the flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamTensor {
    /// Hugging Face name, e.g. `transformer.h.0.attn.c_attn.weight`.
    pub name: String,
    /// Shape as Hugging Face stores it.
    pub shape: Vec<usize>,
    /// Element range in the flat buffer.
    pub range: Range<usize>,
    /// Whether AdamW applies weight decay (matrices and embeddings; not biases or norms).
    pub decay: bool,
    pub init: Init,
    /// A tensor-parallel rank's part of the model's tensor of this name (`shape` is the
    /// part's); `None` for a tensor the rank holds whole.
    pub part: Option<TensorPart>,
    /// Held whole on every tensor rank, each of which computes only its share of the
    /// gradient (Qwen3's q/k norms: a rank normalises its own heads), so the plan sums it over
    /// the tensor ranks (`plan::lora::sum_shared_grads`). `false` on one rank.
    pub partial_grad: bool,
}

impl ParamTensor {
    /// The shape of the model's tensor of this name: the whole of a part, else its own.
    pub fn whole_shape(&self) -> &[usize] {
        match &self.part {
            Some(p) => &p.whole,
            None => &self.shape,
        }
    }

    /// Elements of the model's tensor of this name.
    pub fn whole_len(&self) -> usize {
        self.whole_shape().iter().product()
    }
}

/// Consecutive parameter tensors updated together (an embedding, a block, the final norm):
/// the unit the optimizer phase is emitted in, so a strategy can stream or shard by group.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamGroup {
    /// Short name, e.g. `h3` (the optimizer op is `h3.adamw`, which reports group with the other blocks' `adamw`).
    pub name: String,
    /// Indices into [`ParamLayout::tensors`].
    pub tensors: Range<usize>,
}

/// A name a checkpoint may hold for a tensor that is stored once (a tied LM head).
#[derive(Clone, Debug, PartialEq)]
pub struct TiedName {
    /// The name in Hugging Face files, e.g. `lm_head.weight`.
    pub name: String,
    /// Index into [`ParamLayout::tensors`] of the tensor it is tied to.
    pub tensor: usize,
}

/// A tensor of the model that a pipeline stage's layout does not hold (another stage's):
/// kept so the stage knows the whole model (its order, for initialisation's random stream and
/// the whole model's flat array).
#[derive(Clone, Debug, PartialEq)]
pub struct AbsentTensor {
    /// Its place: before the layout's tensor of this index (`tensors.len()`: after the last).
    pub before: usize,
    pub name: String,
    /// Its shape (the whole tensor's).
    pub shape: Vec<usize>,
    pub init: Init,
}

impl AbsentTensor {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// All parameter tensors of a model, in buffer order.
#[derive(Clone, Debug)]
pub struct ParamLayout {
    /// The family that made it (its checkpoint naming rules apply).
    pub family: Family,
    pub tensors: Vec<ParamTensor>,
    /// The tensors cut into consecutive groups, in order, covering every tensor once.
    pub groups: Vec<ParamGroup>,
    /// Names of tied tensors that checkpoints may also hold (skipped on load, checked equal).
    pub tied: Vec<TiedName>,
    /// Total number of elements.
    pub total: usize,
    /// Which tensor-parallel part of its model this is ([`TensorSplit::WHOLE`]: all of it;
    /// else its cut tensors carry their [`ParamTensor::part`]).
    pub split: TensorSplit,
    /// Which pipeline stage of its model this is ([`PipelineStage::WHOLE`]: all of it).
    pub stage: PipelineStage,
    /// The model's tensors this stage does not hold, in model order (empty for one stage).
    pub absent: Vec<AbsentTensor>,
}

/// Builds a layout tensor by tensor (used by the family modules).
pub(crate) struct LayoutBuilder {
    family: Family,
    tensors: Vec<ParamTensor>,
    groups: Vec<ParamGroup>,
    group_start: usize,
    at: usize,
    /// Whether the tensors pushed now are held (else another pipeline stage's).
    held: bool,
    absent: Vec<AbsentTensor>,
}

impl LayoutBuilder {
    pub(crate) fn new(family: Family) -> LayoutBuilder {
        LayoutBuilder {
            family,
            tensors: Vec::new(),
            groups: Vec::new(),
            group_start: 0,
            at: 0,
            held: true,
            absent: Vec::new(),
        }
    }

    /// Whether the tensors pushed from now on are this layout's (a pipeline stage holds
    /// some of its model's): the others are recorded as absent, and their pushes return an
    /// empty range.
    pub(crate) fn hold(&mut self, held: bool) {
        self.held = held;
    }

    /// Appends a tensor; returns its element range.
    pub(crate) fn push(
        &mut self,
        name: String,
        shape: &[usize],
        decay: bool,
        init: Init,
    ) -> Range<usize> {
        self.push_part(name, shape, None, decay, init)
    }

    /// Appends a tensor of which this rank keeps, of dimension `dim` of `whole`, the
    /// `ranges` (in order); the whole tensor when they cover the dimension. Returns the
    /// part's element range.
    pub(crate) fn push_cut(
        &mut self,
        name: String,
        whole: &[usize],
        (dim, cut): (usize, Vec<Range<usize>>),
        decay: bool,
        init: Init,
    ) -> Range<usize> {
        // Runs that follow each other are one (a whole fused tensor's parts are the whole).
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(cut.len());
        for r in cut {
            match ranges.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => ranges.push(r),
            }
        }
        if ranges.len() == 1 && ranges[0] == (0..whole[dim]) {
            return self.push(name, whole, decay, init);
        }
        let mut shape = whole.to_vec();
        shape[dim] = ranges.iter().map(|r| r.len()).sum();
        let part = TensorPart {
            whole: whole.to_vec(),
            dim,
            ranges,
        };
        self.push_part(name, &shape, Some(part), decay, init)
    }

    fn push_part(
        &mut self,
        name: String,
        shape: &[usize],
        part: Option<TensorPart>,
        decay: bool,
        init: Init,
    ) -> Range<usize> {
        if !self.held {
            self.absent.push(AbsentTensor {
                before: self.tensors.len(),
                shape: part.as_ref().map_or(shape, |p| &p.whole).to_vec(),
                name,
                init,
            });
            return self.at..self.at;
        }
        let n: usize = shape.iter().product();
        let range = self.at..self.at + n;
        self.at += n;
        self.tensors.push(ParamTensor {
            name,
            shape: shape.to_vec(),
            range: range.clone(),
            decay,
            init,
            part,
            partial_grad: false,
        });
        range
    }

    /// Marks the tensor pushed last, when held, as one whose gradient each tensor rank
    /// computes only a share of ([`ParamTensor::partial_grad`]); nothing on one rank.
    pub(crate) fn partial_grad(&mut self, split: crate::ir::TensorSplit) {
        if let (true, Some(t)) = (split.is_split() && self.held, self.tensors.last_mut()) {
            t.partial_grad = true;
        }
    }

    /// Appends a norm's tensor (`[n]`, no decay): a norm on the residual stream's rows,
    /// whose gradient each tensor rank computes a share of under sequence parallelism (its
    /// rows'; [`ParamTensor::partial_grad`] then). Returns its element range.
    pub(crate) fn push_norm(
        &mut self,
        name: String,
        n: usize,
        init: Init,
        split: crate::ir::TensorSplit,
    ) -> Range<usize> {
        let r = self.push(name, &[n], false, init);
        if split.cuts_rows() {
            self.partial_grad(split);
        }
        r
    }

    /// Closes the group of the tensors pushed since the last group (none when those are
    /// all absent).
    pub(crate) fn group(&mut self, name: impl Into<String>) {
        let end = self.tensors.len();
        if end == self.group_start {
            return;
        }
        self.groups.push(ParamGroup {
            name: name.into(),
            tensors: self.group_start..end,
        });
        self.group_start = end;
    }

    /// The layout of the tensors pushed, `part` of its model.
    pub(crate) fn finish(self, tied: Vec<TiedName>, part: ModelPart) -> ParamLayout {
        assert_eq!(
            self.group_start,
            self.tensors.len(),
            "every tensor belongs to a group"
        );
        ParamLayout {
            family: self.family,
            tensors: self.tensors,
            groups: self.groups,
            tied,
            total: self.at,
            split: part.tensor,
            stage: part.stage,
            absent: self.absent,
        }
    }
}

impl ParamLayout {
    /// Whether `other` has the same tensors (names and shapes) in the same order.
    pub fn same_layout(&self, other: &ParamLayout) -> bool {
        self.total == other.total
            && self.tensors.len() == other.tensors.len()
            && self
                .tensors
                .iter()
                .zip(&other.tensors)
                .all(|(a, b)| a.name == b.name && a.shape == b.shape)
    }

    /// Whether `other` holds (a tensor-parallel part of) the same model as this layout (or
    /// part): the same tensors (names and whole shapes) in the same order. What a checkpoint
    /// is checked against, since it holds the whole model whatever the ranks that wrote it.
    pub fn same_model(&self, other: &ParamLayout) -> bool {
        let (a, b) = (self.model_tensors(), other.model_tensors());
        a.len() == b.len() && a.iter().zip(&b).all(|(a, b)| a == b)
    }

    /// The model's tensors (names and whole shapes) in model order: this layout's and, of a
    /// pipeline stage, the other stages' ([`ParamLayout::absent`]).
    pub fn model_tensors(&self) -> Vec<(&str, &[usize])> {
        let mut out = Vec::with_capacity(self.tensors.len() + self.absent.len());
        let mut absent = self.absent.iter().peekable();
        for (k, t) in self.tensors.iter().enumerate() {
            while let Some(a) = absent.next_if(|a| a.before <= k) {
                out.push((a.name.as_str(), a.shape.as_slice()));
            }
            out.push((t.name.as_str(), t.whole_shape()));
        }
        out.extend(absent.map(|a| (a.name.as_str(), a.shape.as_slice())));
        out
    }

    /// Elements of the whole model (`total` unless this is a part).
    pub fn whole_total(&self) -> usize {
        let held: usize = self.tensors.iter().map(ParamTensor::whole_len).sum();
        held + self.absent.iter().map(AbsentTensor::len).sum::<usize>()
    }

    /// This layout's elements `range` as runs of the whole model's flat array (its tensors
    /// whole, in the same order), in order: (the run's first element in the whole model's
    /// array, the elements of this layout it holds), adjacent runs joined: one run for a
    /// layout of the whole model; a part's cut tensors map through [`TensorPart::runs_in`].
    pub fn whole_runs(&self, range: Range<usize>) -> Vec<(usize, Range<usize>)> {
        let mut runs: Vec<(usize, Range<usize>)> = Vec::new();
        let mut push = |w: usize, r: Range<usize>| match runs.last_mut() {
            Some((lw, lr)) if *lw + lr.len() == w && lr.end == r.start => lr.end = r.end,
            _ => runs.push((w, r)),
        };
        let mut whole_start = 0;
        for (k, t) in self.tensors.iter().enumerate() {
            let skipped = self.absent.iter().filter(|a| a.before == k);
            whole_start += skipped.map(AbsentTensor::len).sum::<usize>();
            let (lo, hi) = (range.start.max(t.range.start), range.end.min(t.range.end));
            if lo < hi {
                let local = lo - t.range.start..hi - t.range.start;
                match &t.part {
                    None => push(whole_start + local.start, lo..hi),
                    Some(part) => {
                        for (w, r) in part.runs_in(local) {
                            push(
                                whole_start + w,
                                r.start + t.range.start..r.end + t.range.start,
                            )
                        }
                    }
                }
            }
            whole_start += t.whole_len();
        }
        runs
    }

    /// Blocks of `block` values counted per tensor ([`ParamLayout::block_offsets`]) of the
    /// whole model: this layout's tensors whole and the other stages' ones.
    pub fn whole_blocks(&self, block: usize) -> usize {
        let held: usize = (self.tensors.iter())
            .map(|t| t.whole_len().div_ceil(block))
            .sum();
        held + (self.absent.iter())
            .map(|a| a.len().div_ceil(block))
            .sum::<usize>()
    }

    /// This layout's blocks `range` (of `block` values counted per tensor,
    /// [`ParamLayout::block_offsets`]) as runs of the whole model's blocks, as
    /// [`ParamLayout::whole_runs`] maps elements: (the run's first block in the whole
    /// model's numbering, the blocks of this layout it holds), adjacent runs joined. A
    /// tensor-parallel part's blocks are its whole tensor's, so they map one to one.
    pub fn whole_block_runs(
        &self,
        range: Range<usize>,
        block: usize,
    ) -> Vec<(usize, Range<usize>)> {
        let mut runs: Vec<(usize, Range<usize>)> = Vec::new();
        let (mut local, mut whole) = (0, 0);
        for (k, t) in self.tensors.iter().enumerate() {
            let skipped = self.absent.iter().filter(|a| a.before == k);
            whole += skipped.map(|a| a.len().div_ceil(block)).sum::<usize>();
            let n = t.whole_len().div_ceil(block);
            let (lo, hi) = (range.start.max(local), range.end.min(local + n));
            if lo < hi {
                let w = whole + lo - local;
                match runs.last_mut() {
                    Some((lw, lr)) if *lw + lr.len() == w && lr.end == lo => lr.end = hi,
                    _ => runs.push((w, lo..hi)),
                }
            }
            local += n;
            whole += n;
        }
        runs
    }

    /// Looks a tensor up by its Hugging Face name.
    pub fn get(&self, name: &str) -> Option<&ParamTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The element range of the tensor named `name` (a name the family's inventory has).
    pub fn range(&self, name: &str) -> Range<usize> {
        match self.get(name) {
            Some(t) => t.range.clone(),
            None => panic!("no parameter tensor named {name}"),
        }
    }

    /// Initialises `params` (len = total) from each tensor's [`Init`], drawing normals from
    /// one generator seeded with `seed`, tensor by tensor in buffer order.
    pub fn init(&self, params: &mut [f32], seed: u64) {
        assert_eq!(params.len(), self.total);
        self.initializer(seed).fill(0..self.total, params);
    }

    /// Fills the parameters piece by piece, in order, with the values [`ParamLayout::init`]
    /// gives (one random stream over the tensors in buffer order), so parameters kept per
    /// group never need one whole host copy.
    pub fn initializer(&self, seed: u64) -> ParamInit<'_> {
        ParamInit {
            layout: self,
            rng: crate::util::rng::Rng::new(seed),
            next: 0,
            part: None,
            absent_drawn: 0,
        }
    }

    /// The element range of `group`'s tensors (contiguous: tensors are in buffer order).
    pub fn group_range(&self, group: &ParamGroup) -> Range<usize> {
        let (first, last) = (group.tensors.start, group.tensors.end - 1);
        self.tensors[first].range.start..self.tensors[last].range.end
    }

    /// Cutting each tensor into blocks of `block` values (its last block partial): the index
    /// of every tensor's first block, and the total number of blocks. A tensor-parallel
    /// part counts its whole tensor's blocks ([`TensorPart::block_pieces`] places its
    /// elements in them), so every tensor rank numbers the blocks alike, as one process does.
    pub fn block_offsets(&self, block: usize) -> (Vec<usize>, usize) {
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut total = 0;
        for t in &self.tensors {
            offsets.push(total);
            total += t.whole_len().div_ceil(block);
        }
        (offsets, total)
    }
}

/// Initialises consecutive ranges of the parameters (see [`ParamLayout::initializer`]).
pub struct ParamInit<'a> {
    layout: &'a ParamLayout,
    rng: crate::util::rng::Rng,
    /// The first element not yet filled.
    next: usize,
    /// The tensor-parallel part being filled: its tensor's index, and how many values of
    /// the whole tensor's stream were drawn.
    part: Option<(usize, usize)>,
    /// The absent tensors whose values were drawn (and dropped) so far.
    absent_drawn: usize,
}

impl ParamInit<'_> {
    /// Fills `dst`, the parameters of `range`: a range at or after where the previous one
    /// ended (the values in between are drawn and dropped, so a rank filling only its shards
    /// gets the values of the whole model's initialisation), whole tensors or not.
    pub fn fill(&mut self, range: Range<usize>, dst: &mut [f32]) {
        assert!(
            range.start >= self.next,
            "parameters are initialised in order"
        );
        assert_eq!(dst.len(), range.len());
        for (k, t) in self.layout.tensors.iter().enumerate() {
            let lo = t.range.start.max(self.next);
            let hi = t.range.end.min(range.end);
            if lo >= hi {
                continue;
            }
            self.finish_part(k);
            // Another stage's tensors before this one: their values are drawn and dropped,
            // so the stream reaches this tensor where the whole model's does.
            while let Some(a) = self.layout.absent.get(self.absent_drawn) {
                if a.before > k {
                    break;
                }
                for _ in 0..a.len() {
                    draw(&mut self.rng, a.init);
                }
                self.absent_drawn += 1;
            }
            let Some(part) = &t.part else {
                for i in lo..hi {
                    let x = draw(&mut self.rng, t.init);
                    if i >= range.start {
                        dst[i - range.start] = x;
                    }
                }
                continue;
            };
            // A part: the whole tensor's values are drawn in order (the random stream is the
            // whole model's), those of the part's runs kept, the others dropped, so no
            // whole tensor is held.
            let drawn = &mut self.part.get_or_insert((k, 0)).1;
            let at = t.range.start;
            for (w, r) in part.runs_in(lo - at..hi - at) {
                assert!(
                    w >= *drawn,
                    "internal error: {}'s runs out of order",
                    t.name
                );
                for _ in *drawn..w {
                    draw(&mut self.rng, t.init);
                }
                for j in r.clone() {
                    let x = draw(&mut self.rng, t.init);
                    if at + j >= range.start {
                        dst[at + j - range.start] = x;
                    }
                }
                *drawn = w + r.len();
            }
        }
        self.next = range.end;
    }

    /// Before tensor `k`: draws (and drops) what is left of the part filled before it.
    fn finish_part(&mut self, k: usize) {
        let Some((p, drawn)) = self.part.filter(|&(p, _)| p != k) else {
            return;
        };
        let t = &self.layout.tensors[p];
        let whole = t.part.as_ref().map_or(0, |w| w.whole_len());
        for _ in drawn..whole {
            draw(&mut self.rng, t.init);
        }
        self.part = None;
    }
}

/// One value of a tensor initialised as `init`.
fn draw(rng: &mut crate::util::rng::Rng, init: Init) -> f32 {
    match init {
        Init::Zeros => 0.0,
        Init::Ones => 1.0,
        Init::Normal { std } => rng.normal() * std,
        Init::Uniform { bound } => (2.0 * rng.next_f32() - 1.0) * bound,
    }
}

#[cfg(test)]
mod tests {
    use crate::model::{ModelSpec, ParamLayout};

    #[test]
    fn layout_is_contiguous_grouped_and_named() {
        let spec = ModelSpec::preset("gpt2-tiny").unwrap();
        let lay = ParamLayout::new(&spec);
        let mut at = 0;
        for t in &lay.tensors {
            assert_eq!(t.range.start, at, "{}", t.name);
            assert_eq!(t.range.len(), t.shape.iter().product::<usize>());
            at = t.range.end;
        }
        assert_eq!(at, lay.total);
        assert_eq!(lay.tensors.len(), 2 + 12 * spec.n_layer + 2);
        assert_eq!(
            lay.get("transformer.h.3.mlp.c_fc.weight").unwrap().shape,
            vec![128, 512]
        );
        let mut next = 0;
        for g in &lay.groups {
            assert_eq!(g.tensors.start, next, "group {}", g.name);
            next = g.tensors.end;
        }
        assert_eq!(next, lay.tensors.len());
        assert_eq!(lay.groups.len(), spec.n_layer + 2);
    }

    /// The tensor-parallel parts' runs of the whole model cover it once: every element of
    /// the whole flat array is held by exactly one rank's cut tensor, or by every rank's copy
    /// of a whole one; pieces of a part map as the whole part does; and the parts are of
    /// the same model as the whole layout.
    #[test]
    fn the_parts_runs_cover_the_whole_model_once() {
        use crate::ir::TensorSplit;
        for name in ["gpt2-tiny", "llama-tiny"] {
            let spec = ModelSpec::preset(name).unwrap();
            let whole = ParamLayout::new(&spec);
            assert_eq!(whole.whole_runs(3..whole.total), vec![(3, 3..whole.total)]);
            let mut held = vec![0usize; whole.total];
            for rank in 0..2 {
                let part = ParamLayout::part(
                    &spec,
                    crate::ir::ModelPart::tensor(TensorSplit::new(2, rank)),
                );
                assert!(part.same_model(&whole) && whole.same_model(&part), "{name}");
                assert!(!part.same_layout(&whole), "{name}: a part is not the whole");
                assert_eq!(part.whole_total(), whole.total, "{name}");
                // Pieces that cut tensors map as the whole range does.
                let all = part.whole_runs(0..part.total);
                let mut pieces = Vec::new();
                for lo in (0..part.total).step_by(1000) {
                    pieces.extend(part.whole_runs(lo..(lo + 1000).min(part.total)));
                }
                let flat = |runs: &[(usize, std::ops::Range<usize>)]| -> Vec<(usize, usize)> {
                    runs.iter()
                        .flat_map(|(w, r)| r.clone().map(move |i| (w + i - r.start, i)))
                        .collect()
                };
                assert_eq!(flat(&pieces), flat(&all), "{name} rank {rank}");
                for (w, r) in &all {
                    for i in 0..r.len() {
                        held[w + i] += 1;
                    }
                }
                // Each local element lands where the part's own runs put it.
                for t in part.tensors.iter().filter(|t| t.part.is_some()) {
                    let p = t.part.as_ref().unwrap();
                    let w = whole.get(&t.name).unwrap();
                    let ids: Vec<usize> = (0..w.range.len()).collect();
                    let mut taken = vec![0; t.range.len()];
                    p.take(&ids, &mut taken);
                    let runs: Vec<_> = part.whole_runs(t.range.clone());
                    let mapped = flat(&runs);
                    for (wi, li) in mapped {
                        assert_eq!(wi - w.range.start, taken[li - t.range.start], "{}", t.name);
                    }
                }
            }
            for t in &whole.tensors {
                let part =
                    ParamLayout::part(&spec, crate::ir::ModelPart::tensor(TensorSplit::new(2, 0)));
                let cut = part.get(&t.name).unwrap().part.is_some();
                let want = if cut { 1 } else { 2 };
                assert!(
                    held[t.range.clone()].iter().all(|&n| n == want),
                    "{name}: {} held {want} times",
                    t.name
                );
            }
        }
    }

    /// A tensor rank's part initialised, at once or in pieces with gaps (a rank filling only
    /// its shards), holds the whole model's values at its elements, bitwise: the parts'
    /// tensors draw the whole tensors' random stream without holding them.
    #[test]
    fn a_parts_initialisation_is_the_wholes_at_its_elements() {
        use crate::ir::{ModelPart, TensorSplit};
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for name in ["gpt2-tiny", "llama-tiny"] {
            let spec = ModelSpec::preset(name).unwrap();
            let whole = ParamLayout::new(&spec);
            let mut values = vec![0.0f32; whole.total];
            whole.init(&mut values, 5);
            let cuts = [(2, 0), (2, 1), (4, 3)];
            for (size, rank) in cuts
                .into_iter()
                .filter(|c| spec.check_tensor_split(c.0).is_ok())
            {
                let part =
                    ParamLayout::part(&spec, ModelPart::tensor(TensorSplit::new(size, rank)));
                let mut want = vec![f32::NAN; part.total];
                for (w, r) in part.whole_runs(0..part.total) {
                    want[r.clone()].copy_from_slice(&values[w..w + r.len()]);
                }
                let mut got = vec![f32::NAN; part.total];
                part.init(&mut got, 5);
                assert!(bits(&got) == bits(&want), "{name} rank {rank} of {size}");
                // Pieces of 777 elements, every third left out.
                let mut init = part.initializer(5);
                let mut pieces = vec![f32::NAN; part.total];
                for (i, lo) in (0..part.total).step_by(777).enumerate() {
                    let r = lo..(lo + 777).min(part.total);
                    if i % 3 != 1 {
                        init.fill(r.clone(), &mut pieces[r]);
                    }
                }
                for (i, lo) in (0..part.total).step_by(777).enumerate() {
                    let r = lo..(lo + 777).min(part.total);
                    if i % 3 != 1 {
                        assert_eq!(
                            bits(&pieces[r.clone()]),
                            bits(&want[r]),
                            "{name} {size}/{rank}"
                        );
                    }
                }
            }
        }
    }

    /// Initialising group by group gives the values of initialising the whole vector.
    #[test]
    fn initialising_by_group_is_initialising_the_whole() {
        for name in ["gpt2-tiny", "llama-tiny"] {
            let lay = ParamLayout::new(&ModelSpec::preset(name).unwrap());
            let mut whole = vec![0.0f32; lay.total];
            lay.init(&mut whole, 3);
            let mut pieces = vec![f32::NAN; lay.total];
            let mut init = lay.initializer(3);
            for g in &lay.groups {
                let r = lay.group_range(g);
                init.fill(r.clone(), &mut pieces[r]);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&pieces), bits(&whole), "{name}");
            assert!(
                whole.iter().any(|&x| x != 0.0 && x != 1.0),
                "{name}: no random values"
            );
        }
    }
}
