//! Checkpoints from where the state lives: the executor lends the parameters and moments to
//! `ckpt`'s writer buffer by buffer ([`Stored`]: in place in RAM, through a host copy of one
//! buffer on the disk tier) or, for state spread among ranks, streamed into rank 0's writer
//! ([`Gathered`]): rank 0 lends its own pieces in place and receives the others' piece by
//! piece ([`PIECE`] elements, into arena bytes free between steps) in the order the writer
//! reads them, while the other ranks send theirs in that same order ([`Schedule`]).
//!
//! **Owners.** Every spread array (the parameters at ZeRO stage 3 or of a tensor-parallel
//! plan, m and v at stage ≥ 1 or of a tensor-parallel plan, the 8-bit moments' block
//! scales at stage ≥ 1 or of a pipeline's stages: [`Owners::blocks`]) is described tensor by
//! tensor ([`Part`], whole-model order), and
//! each tensor as its [`Share`]s: a run of elements and the rank that owns it, named by its
//! coordinates on the mesh ([`Owner`]). A tensor the tensor ranks cut has a share per tensor
//! rank (its part, [`TensorPart`]), one held whole has tensor rank 0's only; each of those is
//! cut again, where the array is sharded (ZeRO), by its group's data cut
//! ([`crate::ir::Cut`]): data rank d owns the elements of its chunk. The owner of a piece
//! is thus (its data shard, its tensor part); ranks holding a copy of what an owner holds
//! (the other data ranks of unsharded state, the other tensor ranks of a whole tensor) send
//! nothing. Rank 0 puts a cut tensor's shares in their places in one host copy of that
//! tensor ([`TensorPart::runs_in`]) and lends a whole tensor's shares in order, so it writes
//! the whole model under its Hugging Face names, as one process does, byte for byte,
//! whatever the mesh (dp × tp × ZeRO 0–3). Pieces go over the job's communicator (rank 0
//! and an owner may differ on several axes). No rank holds more than one piece (and rank 0
//! one tensor) beyond its plan; the pieces and the tensor go into arena bytes that no
//! persistent buffer holds (free between steps), so a save stays inside the plan.
//!
//! A pipeline axis fits the same description: a stage owns the tensors of its layers whole,
//! so an [`Owner`] gains a stage coordinate, and a tensor's shares name its stage's ranks
//! (the schedule, the stream and the sends are unchanged: they only follow owners).

use super::{Executor, pod, pod_bytes_mut};
use crate::backend::Device;
use crate::ckpt::{Lend, LentMoments, LentState, OutData, SaveOptions, TrainerState};
use crate::dtype::DType;
use crate::ir::{BufId, Cut, Mesh, OptimBufs, QBLOCK};
use crate::model::{ParamLayout, TensorPart};
use anyhow::{Result, bail};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// A flat array of parameters or moments as the plan keeps it between steps: consecutive
/// buffers (the whole model's, or one per parameter group), lent to the checkpoint writer
/// one buffer at a time: an arena buffer in place, a disk-tier one through a host copy of
/// that buffer alone (the device's scratch, freed before the next buffer is read).
struct Stored<'e> {
    device: &'e dyn Device,
    /// The element type, as an empty piece.
    elem: OutData<'static>,
    /// Each buffer and the elements of the array it holds, in order.
    parts: Vec<(Range<usize>, BufId)>,
}

impl<'e> Stored<'e> {
    /// The array held by `bufs`: (the elements of the array the buffer's first elements
    /// hold, buffer), in order (a buffer padded for collectives holds more elements than its
    /// range); the element type is the buffers'.
    fn new(ex: &'e Executor, bufs: impl IntoIterator<Item = (Range<usize>, BufId)>) -> Stored<'e> {
        let mut elem = OutData::F32(&[]);
        let parts = bufs
            .into_iter()
            .inspect(|(_, id)| elem = elem_of(ex.plan.buffer(*id).dtype))
            .collect();
        Stored {
            device: &*ex.device,
            elem,
            parts,
        }
    }
}

/// The checkpoint element type of buffers of `dtype`, as an empty piece.
fn elem_of(dtype: DType) -> OutData<'static> {
    match dtype {
        DType::F32 => OutData::F32(&[]),
        DType::Bf16 => OutData::Bf16(&[]),
        DType::I8 => OutData::I8(&[]),
        DType::U8 => OutData::U8(&[]),
        other => unreachable!("checkpoints hold no {other:?} state"),
    }
}

/// Bytes of one element of sharded state (parameters, moments, scales: element types).
fn elem_size(dtype: DType) -> usize {
    match dtype.size() {
        Some(size) => size,
        None => unreachable!("sharded state is stored as elements, not {dtype} blocks"),
    }
}

/// Elements per message when rank 0 gathers spread state for a checkpoint (4 MiB of f32):
/// rank 0 holds one piece beyond the plan, whatever the model's size.
const PIECE: usize = 1 << 20;

/// A rank as the owner of pieces of spread state: its coordinates on the mesh's axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Owner {
    /// Its index on the data axis: its ZeRO shard of sharded state.
    data: usize,
    /// Its index on the tensor axis: its part of a cut tensor.
    tensor: usize,
    /// Its index on the pipeline axis: the stage holding the tensor.
    stage: usize,
}

impl Owner {
    /// Its rank in the job (`ir::Mesh`'s order: the tensor axis fastest, then data, then
    /// pipeline).
    fn rank(self, mesh: &Mesh) -> usize {
        let (t, d) = (mesh.tensor.max(1), mesh.data.max(1));
        self.tensor + t * (self.data + d * self.stage)
    }
}

/// The spread arrays of a checkpoint, in the order the writer reads them (the parameters,
/// then m, its block scales, v, its block scales: those spread among ranks). The message
/// schedule: array by array, part by part, share by share (tensor rank, then data rank),
/// each share's owner other than rank 0 sends it in pieces of [`PIECE`] elements over the
/// job's communicator, and rank 0 receives them in that order.
struct Schedule {
    arrays: Vec<Array>,
}

/// A spread array: this rank's buffers of it, and its parts with their owners.
struct Array {
    /// Where this rank holds its elements: (elements of its layout, the buffer whose first
    /// elements they are), in order.
    held: Vec<(Range<usize>, BufId)>,
    /// The element type, as an empty piece.
    elem: OutData<'static>,
    /// Bytes per element.
    size: usize,
    /// Its tensors (8-bit block scales: each tensor's blocks) in the whole model's order.
    parts: Vec<Part>,
}

/// One tensor of a spread array (or its 8-bit block scales).
struct Part {
    /// The whole array's elements it covers (the whole model's layout).
    whole: Range<usize>,
    /// A tensor cut among the tensor ranks: each tensor rank's part of it, where its shares
    /// go in the whole tensor. `None`: the shares are consecutive runs of the whole, in order.
    cut: Option<Vec<TensorPart>>,
    /// Its pieces and their owners, in the schedule's order; none is empty.
    shares: Vec<Share>,
}

/// A run of a part's elements and the rank that owns it.
struct Share {
    owner: Owner,
    /// The owner's rank in the job.
    rank: usize,
    /// Its elements of the owner's tensor part (of the whole tensor where it is not cut).
    of: Range<usize>,
    /// The same elements in the owner's layout (where it finds them in its buffers).
    local: Range<usize>,
}

impl Array {
    /// Lends `f` the bytes of elements `local` (of this rank's layout) where this rank holds
    /// them (one buffer holds them all).
    fn with_local(
        &self,
        device: &dyn Device,
        local: &Range<usize>,
        f: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let Some((r, id)) =
            (self.held.iter()).find(|(r, _)| r.start <= local.start && local.end <= r.end)
        else {
            bail!("internal error: elements {local:?} of spread state in no buffer of this rank");
        };
        let at = (local.start - r.start) * self.size..(local.end - r.start) * self.size;
        let mut out = Ok(());
        device.download(&[*id], &mut |b| out = f(&b[0][at.clone()]))?;
        out
    }
}

/// One pipeline stage's state, as [`Owners`] reads it.
struct StageState {
    /// Each tensor rank's layout of the stage (one where tensors are whole).
    layouts: Vec<ParamLayout>,
    /// Each tensor rank's cut of each of its groups along the data axis (ZeRO).
    cuts: Vec<Vec<Cut>>,
    /// With 8-bit moments sharded, each group's blocks cut along the data axis
    /// ([`crate::plan::zero::group_block_cuts`]: the same on every tensor rank).
    block_cuts: Vec<Cut>,
    /// The group of each of its tensors.
    group_of: Vec<usize>,
}

impl StageState {
    /// The stage whose tensor ranks' layouts are `layouts`, their groups cut by `cuts` (and
    /// their 8-bit blocks by `block_cuts`).
    fn new(
        layouts: Vec<ParamLayout>,
        cuts: Vec<Vec<Cut>>,
        block_cuts: Vec<Cut>,
    ) -> Result<StageState> {
        let first = &layouts[0];
        let mut group_of = vec![usize::MAX; first.tensors.len()];
        for (k, g) in first.groups.iter().enumerate() {
            group_of[g.tensors.clone()].fill(k);
        }
        // Every tensor rank's layout holds the same tensors in the same groups (their parts'
        // sizes may differ: the rows of a vocabulary the ranks do not divide).
        for l in &layouts[1..] {
            let same = (l.tensors.iter().zip(&first.tensors)).all(|(a, b)| a.name == b.name)
                && l.tensors.len() == first.tensors.len()
                && (l.groups.iter().zip(&first.groups)).all(|(a, b)| a.tensors == b.tensors);
            if !same {
                bail!("internal error: tensor ranks whose layouts hold other tensors");
            }
        }
        if group_of.contains(&usize::MAX) {
            bail!("internal error: a tensor in no parameter group");
        }
        Ok(StageState {
            layouts,
            cuts,
            block_cuts,
            group_of,
        })
    }
}

/// Where each tensor rank's part starts in the whole tensor, when the parts are one run each
/// and follow each other in rank order (a cut of the first dimension); `None` otherwise.
fn in_order(parts: &[TensorPart]) -> Option<Vec<usize>> {
    let mut starts = Vec::with_capacity(parts.len());
    let mut next = 0;
    for p in parts {
        let mut runs = p.runs();
        let (Some((at, len)), None) = (runs.next(), runs.next()) else {
            return None;
        };
        if at != next {
            return None;
        }
        starts.push(at);
        next = at + len;
    }
    Some(starts)
}

/// How the state lies among the ranks, from which the [`Part`]s are made.
struct Owners<'a> {
    mesh: Mesh,
    /// Each pipeline stage's (one where the layers are not staged).
    stages: Vec<StageState>,
    /// The whole model's layout.
    whole: &'a ParamLayout,
    /// Each of the whole model's tensors: the stage that owns it and its index there (a
    /// tied embedding held by both ends of a pipeline: the first's, the last's a copy).
    located: Vec<(usize, usize)>,
}

impl<'a> Owners<'a> {
    fn new(mesh: Mesh, stages: Vec<StageState>, whole: &'a ParamLayout) -> Result<Owners<'a>> {
        // Each name's first holder: stages in order, so a tied copy's owner is the first.
        let mut by_name: std::collections::HashMap<&str, (usize, usize)> = Default::default();
        for (s, st) in stages.iter().enumerate() {
            for (j, t) in st.layouts[0].tensors.iter().enumerate() {
                by_name.entry(t.name.as_str()).or_insert((s, j));
            }
        }
        let located = (whole.tensors.iter())
            .map(|t| {
                (by_name.get(t.name.as_str()).copied()).ok_or_else(|| {
                    anyhow::anyhow!("internal error: no rank holds {} of the model", t.name)
                })
            })
            .collect::<Result<_>>()?;
        Ok(Owners {
            mesh,
            stages,
            whole,
            located,
        })
    }

    /// Data ranks owning a piece of an array sharded (ZeRO) or not (data rank 0's copy).
    fn data_ranks(&self, sharded: bool) -> usize {
        if sharded { self.mesh.data.max(1) } else { 1 }
    }

    /// Tensor `i` of an array sharded along the data axis or not: its shares, tensor rank by
    /// tensor rank (rank 0 alone for a tensor held whole), each cut by its group's data cut.
    fn tensor(&self, i: usize, sharded: bool) -> Result<Part> {
        let whole = self.whole.tensors[i].range.clone();
        let (stage, j) = self.located[i];
        let st = &self.stages[stage];
        let cut = st.layouts[0].tensors[j].part.is_some();
        let tensor_ranks = if cut { st.layouts.len() } else { 1 };
        let k = st.group_of[j];
        let mut shares = Vec::new();
        let mut parts = Vec::new();
        for (tr, layout) in st.layouts[..tensor_ranks].iter().enumerate() {
            let t = &layout.tensors[j];
            if cut {
                let Some(part) = t.part.clone() else {
                    bail!("internal error: {} cut on some tensor ranks only", t.name);
                };
                parts.push(part);
            }
            let group = layout.group_range(&layout.groups[k]);
            for d in 0..self.data_ranks(sharded) {
                let held = match sharded {
                    true => st.cuts[tr][k].owned(&group, d),
                    false => t.range.clone(),
                };
                let (lo, hi) = (held.start.max(t.range.start), held.end.min(t.range.end));
                if lo < hi {
                    let owner = Owner {
                        data: d,
                        tensor: tr,
                        stage,
                    };
                    shares.push(Share {
                        owner,
                        rank: owner.rank(&self.mesh),
                        of: lo - t.range.start..hi - t.range.start,
                        local: lo..hi,
                    });
                }
            }
        }
        let covered: usize = shares.iter().map(|s| s.of.len()).sum();
        let expected = match cut {
            true => parts
                .iter()
                .map(|p| p.runs().map(|r| r.1).sum::<usize>())
                .sum(),
            false => whole.len(),
        };
        if covered != expected || (cut && expected != whole.len()) {
            bail!(
                "internal error: the shares of {} cover {covered} of its {} elements",
                self.whole.tensors[i].name,
                whole.len()
            );
        }
        // Parts that are consecutive runs of the whole tensor in rank order (rows of the
        // vocabulary) need no assembling: their shares are runs of it, as a whole tensor's.
        if let Some(starts) = cut.then(|| in_order(&parts)).flatten() {
            for s in &mut shares {
                let at = starts[s.owner.tensor];
                s.of = at + s.of.start..at + s.of.end;
            }
            return Ok(Part {
                whole,
                cut: None,
                shares,
            });
        }
        Ok(Part {
            whole,
            cut: cut.then_some(parts),
            shares,
        })
    }

    /// The 8-bit block scales of tensor `i` (the whole model's blocks of it, [`QBLOCK`]
    /// values each, counted per tensor), sharded along the data axis or not: its stage's
    /// tensor rank 0's (every tensor rank holds its whole tensor's blocks, with the scales
    /// they agreed on, `plan::block_scales`), each data rank's those of its group's block
    /// cut ([`StageState::block_cuts`]).
    fn tensor_blocks(&self, i: usize, sharded: bool, whole_first: &[usize]) -> Result<Part> {
        let name = &self.whole.tensors[i].name;
        let n = self.whole.tensors[i].range.len().div_ceil(QBLOCK);
        let whole = whole_first[i]..whole_first[i] + n;
        let (stage, j) = self.located[i];
        let st = &self.stages[stage];
        let layout = &st.layouts[0];
        let (first, _) = layout.block_offsets(QBLOCK);
        let k = st.group_of[j];
        let g0 = first[layout.groups[k].tensors.start];
        // The tensor's blocks, counted from its group's first.
        let mine = first[j] - g0..first[j] - g0 + n;
        let cut = sharded.then(|| &st.block_cuts[k]);
        let mut shares = Vec::new();
        for d in 0..self.data_ranks(sharded) {
            let held = match &cut {
                Some(cut) => cut.owned(&(0..cut.len()), d),
                None => mine.clone(),
            };
            let (lo, hi) = (held.start.max(mine.start), held.end.min(mine.end));
            if lo < hi {
                let owner = Owner {
                    data: d,
                    tensor: 0,
                    stage,
                };
                shares.push(Share {
                    owner,
                    rank: owner.rank(&self.mesh),
                    of: lo - mine.start..hi - mine.start,
                    local: g0 + lo..g0 + hi,
                });
            }
        }
        if shares.iter().map(|s| s.of.len()).sum::<usize>() != n {
            bail!("internal error: the block scales of {name} are not covered once");
        }
        Ok(Part {
            whole,
            cut: None,
            shares,
        })
    }

    /// Every tensor's 8-bit block scales of moments sharded along the data axis or not,
    /// held in `held`.
    fn blocks(
        &self,
        ex: &Executor,
        held: Vec<(Range<usize>, BufId)>,
        sharded: bool,
    ) -> Result<Array> {
        let (first, _) = self.whole.block_offsets(QBLOCK);
        self.parts(ex, held, |i| self.tensor_blocks(i, sharded, &first))
    }

    /// Every tensor of an array sharded along the data axis or not, held in `held`.
    fn array(
        &self,
        ex: &Executor,
        held: Vec<(Range<usize>, BufId)>,
        sharded: bool,
    ) -> Result<Array> {
        self.parts(ex, held, |i| self.tensor(i, sharded))
    }

    /// The array held in `held` whose part of the whole model's tensor `i` is `part(i)`.
    fn parts(
        &self,
        ex: &Executor,
        held: Vec<(Range<usize>, BufId)>,
        part: impl Fn(usize) -> Result<Part>,
    ) -> Result<Array> {
        let parts = (0..self.whole.tensors.len())
            .map(part)
            .collect::<Result<_>>()?;
        Ok(Array::of(ex, held, parts))
    }
}

impl Array {
    fn of(ex: &Executor, held: Vec<(Range<usize>, BufId)>, parts: Vec<Part>) -> Array {
        let dtype = ex.plan.buffer(held[0].1).dtype;
        Array {
            held,
            elem: elem_of(dtype),
            size: elem_size(dtype),
            parts,
        }
    }
}

/// A piece of the schedule: (array, part, share, piece).
type At = (usize, usize, usize, usize);

/// Rank 0's end of the schedule: the piece it received last, held in the first [`PIECE`]
/// elements' bytes of `room`, and the cut tensor it assembled last, in the rest.
struct Stream<'e> {
    ex: &'e Executor,
    schedule: &'e Schedule,
    at: Option<At>,
    room: Spare<'e>,
    /// The (array, part) whose whole tensor the room holds.
    assembled: Option<(usize, usize)>,
}

/// Where rank 0 receives a piece (and assembles a cut tensor): arena bytes free between
/// steps, or a host copy where the arena has not that much.
enum Spare<'e> {
    Arena(&'e mut [u8]),
    Owned(Vec<u64>),
}

impl Spare<'_> {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Spare::Arena(b) => b,
            Spare::Owned(v) => pod_bytes_mut(v),
        }
    }

    /// The piece's bytes and the tensor's.
    fn split(&mut self) -> (&mut [u8], &mut [u8]) {
        self.bytes().split_at_mut(PIECE * 4)
    }
}

impl<'e> Stream<'e> {
    fn new(ex: &'e Executor, schedule: &'e Schedule) -> Stream<'e> {
        // One piece, then the largest cut tensor whole (8-byte aligned).
        let tensor = (schedule.arrays.iter())
            .flat_map(|a| a.parts.iter().map(move |p| (a, p)))
            .filter(|(_, p)| p.cut.is_some())
            .map(|(a, p)| p.whole.len() * a.size)
            .max()
            .unwrap_or(0);
        let bytes = PIECE * 4 + tensor.next_multiple_of(8);
        // SAFETY: checkpoints are written between steps, and this is the one spare slice.
        let room = match unsafe { ex.device.spare_between_steps(bytes) } {
            Some(b) => Spare::Arena(b),
            None => Spare::Owned(vec![0u64; bytes / 8]),
        };
        Stream {
            ex,
            schedule,
            at: None,
            room,
            assembled: None,
        }
    }

    /// The byte range of piece `j` within share `s` of part `k` of array `a`.
    fn piece(&self, (a, k, s, j): At) -> Range<usize> {
        let array = &self.schedule.arrays[a];
        let bytes = array.parts[k].shares[s].of.len() * array.size;
        let lo = j * PIECE * array.size;
        lo..(lo + PIECE * array.size).min(bytes)
    }

    /// The piece after `at` in the schedule (the first when `None`): rank 0's own shares
    /// have none.
    fn next(&self, at: Option<At>) -> Option<At> {
        let (mut a, mut k, mut s, mut j) = match at {
            None => (0, 0, 0, 0),
            Some((a, k, s, j)) => (a, k, s, j + 1),
        };
        loop {
            let arrays = &self.schedule.arrays;
            if a >= arrays.len() {
                return None;
            }
            let parts = &arrays[a].parts;
            if k >= parts.len() {
                (a, k, s, j) = (a + 1, 0, 0, 0);
            } else if s >= parts[k].shares.len() {
                (k, s, j) = (k + 1, 0, 0);
            } else if parts[k].shares[s].rank == 0 || j * PIECE >= parts[k].shares[s].of.len() {
                (s, j) = (s + 1, 0);
            } else {
                return Some((a, k, s, j));
            }
        }
    }

    /// Receives the schedule up to piece `want` and returns its bytes.
    fn reach(&mut self, want: At) -> Result<&[u8]> {
        self.advance(want)?;
        let len = self.piece(want).len();
        Ok(&self.room.split().0[..len])
    }

    /// Receives the schedule up to piece `want`, which the room then holds.
    fn advance(&mut self, want: At) -> Result<()> {
        if self.at.is_some_and(|at| at > want) {
            bail!("internal error: spread state read out of order");
        }
        while self.at != Some(want) {
            let Some(p) = self.next(self.at) else {
                bail!("internal error: a piece beyond the spread state");
            };
            self.receive(p)?;
        }
        Ok(())
    }

    fn receive(&mut self, p: At) -> Result<()> {
        let len = self.piece(p).len();
        let from = self.schedule.arrays[p.0].parts[p.1].shares[p.2].rank;
        let world = &self.ex.comms.world;
        world.sendrecv(&[], from, &mut self.room.split().0[..len], from)?;
        self.at = Some(p);
        Ok(())
    }

    /// Receives what is left of the schedule (what the writer did not read).
    fn finish(&mut self) -> Result<()> {
        while let Some(p) = self.next(self.at) {
            self.receive(p)?;
        }
        Ok(())
    }

    /// Assembles the whole tensor of part `k` of array `a` (a cut tensor) in the room: each
    /// share in schedule order, rank 0's own from its buffer, the others' as their pieces
    /// arrive, each put in its runs of the whole tensor; returns its bytes.
    fn assemble(&mut self, a: usize, k: usize) -> Result<&[u8]> {
        let (ex, schedule) = (self.ex, self.schedule);
        let array = &schedule.arrays[a];
        let part = &array.parts[k];
        let Some(cut) = &part.cut else {
            bail!("internal error: assembling a tensor that is not cut");
        };
        let size = array.size;
        let whole = part.whole.len() * size;
        if self.assembled != Some((a, k)) {
            self.assembled = None;
            // Elements `from..` of tensor rank `tr`'s part, `bytes`, into their runs of the
            // whole tensor.
            let put = |tensor: &mut [u8], tr: usize, from: usize, bytes: &[u8]| {
                for (w, r) in cut[tr].runs_in(from..from + bytes.len() / size) {
                    let src = &bytes[(r.start - from) * size..(r.end - from) * size];
                    tensor[w * size..w * size + src.len()].copy_from_slice(src);
                }
            };
            for (s, share) in part.shares.iter().enumerate() {
                let tr = share.owner.tensor;
                if share.rank == 0 {
                    let tensor = &mut self.room.split().1[..whole];
                    array.with_local(&*ex.device, &share.local, &mut |b| {
                        put(tensor, tr, share.of.start, b);
                        Ok(())
                    })?;
                    continue;
                }
                for j in 0..share.of.len().div_ceil(PIECE) {
                    self.advance((a, k, s, j))?;
                    let len = self.piece((a, k, s, j)).len();
                    let (piece, tensor) = self.room.split();
                    put(
                        &mut tensor[..whole],
                        tr,
                        share.of.start + j * PIECE,
                        &piece[..len],
                    );
                }
            }
            self.assembled = Some((a, k));
        }
        Ok(&self.room.split().1[..whole])
    }
}

impl Schedule {
    /// A rank other than 0: sends the shares it owns, in the schedule's order (nothing
    /// where another rank owns what it holds).
    fn serve(&self, ex: &Executor) -> Result<()> {
        let me = ex.comm.rank();
        let world = &ex.comms.world;
        for array in &self.arrays {
            let shares = array.parts.iter().flat_map(|p| &p.shares);
            for share in shares.filter(|s| s.rank == me) {
                array.with_local(&*ex.device, &share.local, &mut |b| {
                    b.chunks(PIECE * array.size)
                        .try_for_each(|piece| world.sendrecv(piece, 0, &mut [], 0))
                })?;
            }
        }
        Ok(())
    }
}

/// Array `a` of the spread state, lent to rank 0's writer: its own shares from its
/// buffers, the other ranks' received piece by piece through the stream.
struct Gathered<'e> {
    stream: &'e std::cell::RefCell<Stream<'e>>,
    a: usize,
    elem: OutData<'static>,
    len: usize,
}

impl<'e> Gathered<'e> {
    fn new(stream: &'e std::cell::RefCell<Stream<'e>>, a: usize) -> Gathered<'e> {
        let s = stream.borrow();
        let array = &s.schedule.arrays[a];
        Gathered {
            stream,
            a,
            elem: array.elem,
            len: array.parts.last().map_or(0, |p| p.whole.end),
        }
    }
}

impl Lend for Gathered<'_> {
    fn elem(&self) -> OutData<'static> {
        self.elem
    }

    fn len(&self) -> usize {
        self.len
    }

    fn lend(
        &self,
        range: Range<usize>,
        put: &mut dyn FnMut(OutData<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut stream = self.stream.borrow_mut();
        let (ex, schedule) = (stream.ex, stream.schedule);
        let array = &schedule.arrays[self.a];
        for (k, part) in array.parts.iter().enumerate() {
            let held = &part.whole;
            let (lo, hi) = (range.start.max(held.start), range.end.min(held.end));
            if lo >= hi {
                continue;
            }
            let (rel_lo, rel_hi) = (lo - held.start, hi - held.start);
            if part.cut.is_some() {
                let whole = stream.assemble(self.a, k)?;
                put(typed(self.elem, whole).slice(rel_lo..rel_hi))?;
                continue;
            }
            // Elements rel_lo..rel_hi of the part: its shares are consecutive runs of it.
            for (s, share) in part.shares.iter().enumerate() {
                let (c_lo, c_hi) = (rel_lo.max(share.of.start), rel_hi.min(share.of.end));
                if c_lo >= c_hi {
                    continue;
                }
                let (c_lo, c_hi) = (c_lo - share.of.start, c_hi - share.of.start);
                if share.rank == 0 {
                    array.with_local(&*ex.device, &share.local, &mut |b| {
                        put(typed(self.elem, b).slice(c_lo..c_hi))
                    })?;
                    continue;
                }
                for j in c_lo / PIECE..=(c_hi - 1) / PIECE {
                    let bytes = stream.reach((self.a, k, s, j))?;
                    let (p_lo, p_hi) = (
                        c_lo.max(j * PIECE) - j * PIECE,
                        c_hi.min((j + 1) * PIECE) - j * PIECE,
                    );
                    put(typed(self.elem, bytes).slice(p_lo..p_hi))?;
                }
            }
        }
        Ok(())
    }
}

/// A buffer's bytes as elements of `elem`'s type.
fn typed<'a>(elem: OutData<'static>, b: &'a [u8]) -> OutData<'a> {
    match elem {
        OutData::F32(_) => OutData::F32(pod::cast(b)),
        OutData::Bf16(_) => OutData::Bf16(pod::cast(b)),
        OutData::I8(_) => OutData::I8(pod::cast(b)),
        OutData::U8(_) => OutData::U8(b),
    }
}

impl Lend for Stored<'_> {
    fn elem(&self) -> OutData<'static> {
        self.elem
    }

    fn len(&self) -> usize {
        self.parts.last().map_or(0, |p| p.0.end)
    }

    fn lend(
        &self,
        range: Range<usize>,
        put: &mut dyn FnMut(OutData<'_>) -> Result<()>,
    ) -> Result<()> {
        for (held, id) in &self.parts {
            let (lo, hi) = (range.start.max(held.start), range.end.min(held.end));
            if lo >= hi {
                continue;
            }
            let mut put_result = Ok(());
            self.device.download(&[*id], &mut |b| {
                let piece = typed(self.elem, b[0]).slice(lo - held.start..hi - held.start);
                put_result = put(piece);
            })?;
            put_result?;
        }
        Ok(())
    }
}

impl Executor {
    /// The trainable layout of `part` of this plan's model: the model's tensors, or a LoRA
    /// plan's adapters on that part of the base.
    fn trainable_part(&self, part: crate::ir::ModelPart) -> Result<ParamLayout> {
        let base = ParamLayout::part(&self.plan.spec, part);
        Ok(match &self.plan.lora {
            Some(l) => {
                crate::model::lora::AdapterLayout::new(&base, l.adapters.spec.clone())?.params
            }
            None => base,
        })
    }

    /// Writes checkpoint `RUN_DIR/checkpoints/step-NNNNNN/` of the plan's model, its
    /// parameters and AdamW moments (as [`crate::ckpt::save_checkpoint_with`] does, with
    /// `state` and `opts`), read straight from where they live: in RAM in place, offloaded
    /// one parameter group's buffer at a time while each file is written, so the save holds
    /// at most one buffer's host copy (and the writer's 1 MiB staging) beyond the plan.
    /// Every rank of the job calls it: rank 0 writes the whole model (ZeRO's shards and a
    /// tensor-parallel plan's parts gathered from the ranks owning them), the others send
    /// what they own, if anything, and write nothing; all return the checkpoint's path.
    pub fn save_checkpoint(
        &self,
        run_dir: &Path,
        state: &TrainerState,
        opts: &SaveOptions,
    ) -> Result<PathBuf> {
        self.settled()?;
        let implicit = &self.plan.schedule.implicit;
        let optim = implicit.optim.as_deref().unwrap_or_default();
        if optim.is_empty() {
            bail!("internal error: a checkpoint of a plan without optimizer state");
        }
        let layout = &self.plan.layout;
        let mesh = self.plan.cfg.mesh;
        // A tensor-parallel rank's parameters and moments are its parts, a pipeline stage's
        // its layers': rank 0 writes the whole model's, gathered tensor by tensor, under the
        // whole layout.
        let (tensor, stage) = (layout.split, layout.stage);
        let split = tensor.is_split() || stage.is_split();
        let whole = match split {
            true => Some(self.trainable_part(crate::ir::ModelPart::WHOLE)?),
            false => None,
        };
        let (params_sharded, moments_sharded) = (self.params_sharded(), self.moments_sharded());
        let int8 = optim.iter().any(|o| o.m_scale.is_some());
        // Every stage's tensor ranks' layouts (their parts of each tensor), or this plan's.
        let counts = self.plan.cfg.stage_counts(self.plan.spec.n_layer);
        let stages = (0..stage.size)
            .map(|s| {
                let layouts: Vec<ParamLayout> = match split {
                    true => (0..tensor.size)
                        .map(|t| {
                            self.trainable_part(crate::ir::ModelPart {
                                tensor: crate::ir::TensorSplit { rank: t, ..tensor },
                                stage: stage.sibling(s, &counts),
                            })
                        })
                        .collect::<Result<_>>()?,
                    false => vec![layout.clone()],
                };
                let cuts = (layouts.iter().enumerate())
                    .map(
                        |(t, l)| match (s, t) == (stage.rank, tensor.rank) || !split {
                            true => self.plan.cuts.clone(),
                            false => crate::plan::zero::group_cuts(l, &self.plan.cfg),
                        },
                    )
                    .collect();
                let block_cuts = crate::plan::zero::group_block_cuts(&layouts[0], &self.plan.cfg);
                StageState::new(layouts, cuts, block_cuts)
            })
            .collect::<Result<Vec<_>>>()?;
        let owners = Owners::new(mesh, stages, whole.as_ref().unwrap_or(layout))?;
        // Where each array lives on this rank: (this layout's elements, buffer) in order.
        let segments = &implicit.params.segments;
        let param_bufs = || -> Vec<(Range<usize>, BufId)> {
            segments.iter().map(|s| (s.range.clone(), s.buf)).collect()
        };
        let moment_bufs = |pick: fn(&OptimBufs) -> BufId| -> Vec<(Range<usize>, BufId)> {
            optim
                .iter()
                .enumerate()
                .map(|(k, o)| (self.moment_elems(k, o), pick(o)))
                .collect()
        };
        // 8-bit moments' scales where this rank holds them (its shard's blocks under ZeRO).
        let block_cuts = crate::plan::zero::group_block_cuts(layout, &self.plan.cfg);
        let scale_bufs = |pick: fn(&OptimBufs) -> Option<BufId>| -> Result<Vec<_>> {
            (optim.iter().enumerate())
                .map(|(k, o)| {
                    let Some(id) = pick(o) else {
                        bail!("internal error: 8-bit moments without scales in group {k}");
                    };
                    let n = match moments_sharded {
                        true => {
                            (block_cuts[k].owned(&(0..block_cuts[k].len()), mesh.data_rank())).len()
                        }
                        false => self.plan.buffer(id).elems,
                    };
                    Ok((o.block_base..o.block_base + n, id))
                })
                .collect()
        };
        // The spread arrays in the order the writer reads them (the weights, then m, its
        // scales, v, its scales) and the index of each in that schedule.
        let mut arrays = Vec::new();
        let mut push = |array: Result<Array>| -> Result<Option<usize>> {
            arrays.push(array?);
            Ok(Some(arrays.len() - 1))
        };
        let params_at = match split || params_sharded {
            true => push(owners.array(self, param_bufs(), params_sharded))?,
            false => None,
        };
        let (m_at, v_at, m_scale_at, v_scale_at);
        if split || moments_sharded {
            m_at = push(owners.array(self, moment_bufs(|o| o.m), moments_sharded))?;
            m_scale_at = match int8 {
                true => push(owners.blocks(self, scale_bufs(|o| o.m_scale)?, moments_sharded))?,
                false => None,
            };
            v_at = push(owners.array(self, moment_bufs(|o| o.v), moments_sharded))?;
            v_scale_at = match int8 {
                true => push(owners.blocks(self, scale_bufs(|o| o.v_scale)?, moments_sharded))?,
                false => None,
            };
        } else {
            (m_at, v_at, m_scale_at, v_scale_at) = (None, None, None, None);
        }
        let schedule = Schedule { arrays };
        if self.comm.rank() != 0 {
            schedule.serve(self)?;
            return Ok(crate::run_dir::RunDir::new(run_dir).checkpoint(state.step));
        }
        let stream = std::cell::RefCell::new(Stream::new(self, &schedule));
        let stream = &stream;
        // A spread array streams in; the others are lent from where they are.
        let lend = |at: Option<usize>, parts: Vec<(Range<usize>, BufId)>| -> Box<dyn Lend + '_> {
            match at {
                Some(at) => Box::new(Gathered::new(stream, at)),
                None => Box::new(Stored::new(self, parts)),
            }
        };
        let params = lend(params_at, param_bufs());
        let m = lend(m_at, moment_bufs(|o| o.m));
        let v = lend(v_at, moment_bufs(|o| o.v));
        let scales = |at: Option<usize>, pick: fn(&OptimBufs) -> Option<BufId>| {
            let bufs: Option<Vec<(Range<usize>, BufId)>> = optim
                .iter()
                .map(|o| {
                    let id = pick(o)?;
                    let n = self.plan.buffer(id).elems;
                    Some((o.block_base..o.block_base + n, id))
                })
                .collect();
            bufs.map(|b| lend(at, b))
        };
        let (m_absmax, v_absmax) = (
            scales(m_scale_at, |o| o.m_scale),
            scales(v_scale_at, |o| o.v_scale),
        );
        let lent = LentState {
            params: &*params,
            moments: LentMoments {
                format: self.moment_format(),
                m: &*m,
                v: &*v,
                absmax: m_absmax
                    .as_ref()
                    .zip(v_absmax.as_ref())
                    .map(|(a, b)| [&**a, &**b]),
            },
        };
        // The whole model's layout where this rank holds parts of it (and a LoRA plan's
        // whole adapters: PEFT's files of the whole model).
        let (spec, layout) = (&self.plan.spec, whole.as_ref().unwrap_or(layout));
        let whole_adapters = match (split, &self.plan.lora) {
            (true, Some(l)) => Some(crate::model::lora::AdapterLayout::new(
                &ParamLayout::new(spec),
                l.adapters.spec.clone(),
            )?),
            _ => None,
        };
        let opts = &SaveOptions {
            adapter: opts.adapter.map(|a| crate::ckpt::AdapterCheckpoint {
                adapters: whole_adapters.as_ref().unwrap_or(a.adapters),
                ..a
            }),
            ..*opts
        };
        let dir = crate::ckpt::save_checkpoint_lent(run_dir, spec, layout, &lent, state, opts)?;
        // The other ranks' sends the writer did not need are received too.
        stream.borrow_mut().finish()?;
        Ok(dir)
    }
}
