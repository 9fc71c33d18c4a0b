//! Checkpoints from where the state lives: the executor lends the parameters and moments to
//! `ckpt`'s writer buffer by buffer ([`Stored`]: in place in RAM, through a host copy of one
//! buffer on the disk tier) or, for state spread among ranks, streamed into rank 0's writer
//! ([`Gathered`]): rank 0 lends its own share in place and receives the others' piece by
//! piece ([`PIECE`] elements, into arena bytes free between steps) in the order the writer
//! reads them, while the other ranks send theirs in that same order ([`Shards`]). Two kinds
//! of spread share that schedule: ZeRO's shards of each parameter group along the data axis,
//! and a tensor-parallel plan's parts of each cut tensor along the tensor axis (from data
//! rank 0's tensor ranks; tensors held whole are rank 0's own, and the other data ranks,
//! which hold the same state, send nothing). Rank 0 puts a cut tensor's parts in their
//! places in one host copy of that tensor ([`crate::model::TensorPart::runs_in`]), so it
//! writes the whole model under its Hugging Face names, as one process does. No rank holds
//! more than one piece (and rank 0 one tensor) beyond its plan. The host copy of a
//! disk-tier buffer, like the pieces and the tensor, goes into arena bytes that no
//! persistent buffer holds (free between steps), so a save stays inside the plan.

use super::{Executor, pod, pod_bytes_mut};
use crate::backend::Device;
use crate::ckpt::{Lend, LentMoments, LentState, OutData, SaveOptions, TrainerState};
use crate::dtype::DType;
use crate::ir::{Axis, BufId, OptimBufs};
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

/// The spread arrays of a checkpoint, in the order the writer reads them (the parameters
/// at ZeRO stage 3 or of a tensor-parallel plan, then m and v, then the 8-bit moments'
/// block scales), each as consecutive [`Part`]s: one per group (ZeRO) or per tensor
/// (tensor parallelism). The message schedule: every rank that holds a share rank 0 has
/// not sends, array by array, part by part, its share in pieces of [`PIECE`] elements
/// (padding included); rank 0 receives them in that order, rank by rank along the part's
/// axis.
struct Shards {
    arrays: Vec<Vec<Part>>,
}

/// One group's or tensor's share of a spread array.
struct Part {
    /// The array's elements it covers (in the whole model's layout).
    held: Range<usize>,
    /// This rank's buffer holding its share of them.
    own: BufId,
    /// How they are spread.
    how: Spread,
}

/// How a [`Part`]'s elements are spread among ranks.
enum Spread {
    /// ZeRO: cut among the data axis's ranks (in the array's elements), chunk r being rank
    /// r's shard buffer.
    Shards(crate::ir::Cut),
    /// A tensor cut among the tensor axis's ranks: rank r holds `parts[r]`, each rank in
    /// elements `at` of its buffer (equal lengths on every rank).
    Tensor {
        parts: Vec<TensorPart>,
        at: Range<usize>,
    },
    /// A tensor every tensor rank holds whole, elements `at` of the buffer: rank 0's own.
    Whole { at: Range<usize> },
}

impl Part {
    /// The axis whose ranks hold the shares.
    fn axis(&self) -> Axis {
        match self.how {
            Spread::Shards(_) => Axis::Data,
            Spread::Tensor { .. } | Spread::Whole { .. } => Axis::Tensor,
        }
    }

    /// Ranks along the axis that hold a share of the part (ranks ≥ 1 send theirs).
    fn ranks(&self, mesh: &crate::ir::Mesh) -> usize {
        match &self.how {
            Spread::Shards(cut) => cut.ranks(),
            Spread::Tensor { .. } => mesh.tensor,
            Spread::Whole { .. } => 1,
        }
    }

    /// Elements of rank `r`'s share (padding included).
    fn share(&self, r: usize) -> usize {
        match &self.how {
            Spread::Shards(cut) => cut.shard(r).len(),
            Spread::Tensor { at, .. } => at.len(),
            Spread::Whole { at } => at.len(),
        }
    }

    /// Whether this rank sends its share to rank 0: ZeRO's shards from the data axis's
    /// other ranks, a cut tensor's parts from data rank 0's other tensor ranks.
    fn sends(&self, mesh: &crate::ir::Mesh) -> bool {
        let (t, d) = (mesh.coord(Axis::Tensor), mesh.coord(Axis::Data));
        match &self.how {
            Spread::Shards(_) => d != 0,
            Spread::Tensor { .. } => d == 0 && t != 0,
            Spread::Whole { .. } => false,
        }
    }

    /// This rank's share among the `len` bytes of its buffer (elements of `size` bytes).
    fn share_bytes(&self, len: usize, size: usize) -> Range<usize> {
        match &self.how {
            Spread::Shards(_) => 0..len,
            Spread::Tensor { at, .. } | Spread::Whole { at } => at.start * size..at.end * size,
        }
    }
}

/// A piece of the schedule: (array, group, rank ≥ 1, piece).
type At = (usize, usize, usize, usize);

/// Rank 0's end of the schedule: the piece it received last, held in the first [`PIECE`]
/// elements' bytes of `room`, and the cut tensor it assembled last, in the rest.
struct Stream<'e> {
    ex: &'e Executor,
    shards: &'e Shards,
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
    fn new(ex: &'e Executor, shards: &'e Shards) -> Stream<'e> {
        // One piece, then the largest cut tensor whole (8-byte aligned).
        let tensor = (shards.arrays.iter().flatten())
            .filter(|p| matches!(p.how, Spread::Tensor { .. }))
            .map(|p| p.held.len() * elem_size(ex.plan.buffer(p.own).dtype))
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
            shards,
            at: None,
            room,
            assembled: None,
        }
    }

    /// Bytes of rank `r`'s share of part `k` of array `a`, and of one of its elements.
    fn shard_bytes(&self, a: usize, k: usize, r: usize) -> (usize, usize) {
        let part = &self.shards.arrays[a][k];
        let size = elem_size(self.ex.plan.buffer(part.own).dtype);
        (part.share(r) * size, size)
    }

    /// The byte range of piece `j` within a share.
    fn piece(&self, (a, k, r, j): At) -> Range<usize> {
        let (bytes, size) = self.shard_bytes(a, k, r);
        let lo = j * PIECE * size;
        lo..(lo + PIECE * size).min(bytes)
    }

    /// The piece after `at` in the schedule (the first when `None`).
    fn next(&self, at: Option<At>) -> Option<At> {
        let mesh = &self.ex.plan.cfg.mesh;
        let (mut a, mut k, mut r, mut j) = match at {
            None => (0, 0, 1, 0),
            Some((a, k, r, j)) => (a, k, r, j + 1),
        };
        loop {
            let arrays = &self.shards.arrays;
            if a >= arrays.len() {
                return None;
            }
            if k >= arrays[a].len() {
                (a, k, r, j) = (a + 1, 0, 1, 0);
            } else if r >= arrays[a][k].ranks(mesh) {
                (k, r, j) = (k + 1, 1, 0);
            } else if j * PIECE * self.shard_bytes(a, k, r).1 >= self.shard_bytes(a, k, r).0 {
                (r, j) = (r + 1, 0);
            } else {
                return Some((a, k, r, j));
            }
        }
    }

    /// Receives the schedule up to piece `want` (pieces before it that nothing asked for,
    /// padding, are dropped) and returns its bytes.
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
        let comm = self.ex.comms.along(self.shards.arrays[p.0][p.1].axis());
        comm.sendrecv(&[], p.2, &mut self.room.split().0[..len], p.2)?;
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

    /// Assembles the whole tensor of part `k` of array `a` (a cut tensor) in the room: rank
    /// 0's own part, then each other tensor rank's as its pieces arrive, each put in its
    /// runs of the whole tensor; returns its bytes.
    fn assemble(&mut self, a: usize, k: usize) -> Result<&[u8]> {
        let (ex, shards) = (self.ex, self.shards);
        let part = &shards.arrays[a][k];
        let Spread::Tensor { parts, at } = &part.how else {
            bail!("internal error: assembling a tensor that is not cut");
        };
        let size = elem_size(ex.plan.buffer(part.own).dtype);
        let whole = part.held.len() * size;
        if self.assembled != Some((a, k)) {
            self.assembled = None;
            // Elements `from..` of rank `r`'s part, `bytes`, into their runs of the whole
            // tensor.
            let put = |tensor: &mut [u8], r: usize, from: usize, bytes: &[u8]| {
                for (w, r) in parts[r].runs_in(from..from + bytes.len() / size) {
                    let src = &bytes[(r.start - from) * size..(r.end - from) * size];
                    tensor[w * size..w * size + src.len()].copy_from_slice(src);
                }
            };
            {
                let tensor = &mut self.room.split().1[..whole];
                ex.device.download(&[part.own], &mut |b| {
                    put(tensor, 0, 0, &b[0][at.start * size..at.end * size])
                })?;
            }
            for r in 1..part.ranks(&ex.plan.cfg.mesh) {
                for j in 0..part.share(r).div_ceil(PIECE) {
                    self.advance((a, k, r, j))?;
                    let len = self.piece((a, k, r, j)).len();
                    let (piece, tensor) = self.room.split();
                    put(&mut tensor[..whole], r, j * PIECE, &piece[..len]);
                }
            }
            self.assembled = Some((a, k));
        }
        Ok(&self.room.split().1[..whole])
    }
}

impl Shards {
    /// A rank other than 0: sends its part of the schedule (nothing where rank 0 holds
    /// what it holds: data ranks other than 0 of a tensor-parallel plan).
    fn serve(&self, ex: &Executor) -> Result<()> {
        let mesh = &ex.plan.cfg.mesh;
        for part in self.arrays.iter().flatten().filter(|p| p.sends(mesh)) {
            let comm = ex.comms.along(part.axis());
            let size = elem_size(ex.plan.buffer(part.own).dtype);
            let mut out = Ok(());
            ex.device.download(&[part.own], &mut |b| {
                out = b[0][part.share_bytes(b[0].len(), size)]
                    .chunks(PIECE * size)
                    .try_for_each(|piece| comm.sendrecv(piece, 0, &mut [], 0));
            })?;
            out?;
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
        let groups = &s.shards.arrays[a];
        Gathered {
            stream,
            a,
            elem: elem_of(s.ex.plan.buffer(groups[0].own).dtype),
            len: groups.last().map_or(0, |g| g.held.end),
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
        let (ex, shards) = (stream.ex, stream.shards);
        for (k, Part { held, own, how }) in shards.arrays[self.a].iter().enumerate() {
            let (lo, hi) = (range.start.max(held.start), range.end.min(held.end));
            if lo >= hi {
                continue;
            }
            let (rel_lo, rel_hi) = (lo - held.start, hi - held.start);
            let cut = match how {
                Spread::Shards(cut) => cut,
                Spread::Whole { at } => {
                    let mut out = Ok(());
                    ex.device.download(&[*own], &mut |b| {
                        out =
                            put(typed(self.elem, b[0]).slice(at.start + rel_lo..at.start + rel_hi));
                    })?;
                    out?;
                    continue;
                }
                Spread::Tensor { .. } => {
                    let whole = stream.assemble(self.a, k)?;
                    put(typed(self.elem, whole).slice(rel_lo..rel_hi))?;
                    continue;
                }
            };
            // Group elements lo..hi: chunk r of the cut is rank r's shard.
            for r in 0..cut.ranks() {
                let chunk = cut.shard(r);
                let (c_lo, c_hi) = (rel_lo.max(chunk.start), rel_hi.min(chunk.end));
                if c_lo >= c_hi {
                    continue;
                }
                let (c_lo, c_hi) = (c_lo - chunk.start, c_hi - chunk.start);
                if r == 0 {
                    let mut out = Ok(());
                    ex.device.download(&[*own], &mut |b| {
                        out = put(typed(self.elem, b[0]).slice(c_lo..c_hi));
                    })?;
                    out?;
                    continue;
                }
                for j in c_lo / PIECE..=(c_hi - 1) / PIECE {
                    let bytes = stream.reach((self.a, k, r, j))?;
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
    /// Writes checkpoint `RUN_DIR/checkpoints/step-NNNNNN/` of the plan's model, its
    /// parameters and AdamW moments (as [`crate::ckpt::save_checkpoint_with`] does, with
    /// `state` and `opts`), read straight from where they live: in RAM in place, offloaded
    /// one parameter group's buffer at a time while each file is written, so the save holds
    /// at most one buffer's host copy (and the writer's 1 MiB staging) beyond the plan.
    /// Every rank of the job calls it: rank 0 writes the whole model (ZeRO's shards and a
    /// tensor-parallel plan's parts gathered from the ranks holding them), the others send
    /// their share, if any, and write nothing; all return the checkpoint's path.
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
        // Arrays spread among ranks are gathered into rank 0's writer part by part; the
        // other ranks serve their shares in the order it reads them (parameters, then m, v).
        let layout = &self.plan.layout;
        // A tensor-parallel rank's parameters and moments are its parts: the whole model's
        // are gathered tensor by tensor, and rank 0 writes them under the whole layout.
        let split = layout.split.is_split();
        let whole = split.then(|| ParamLayout::new(&self.plan.spec));
        // Every tensor rank's part of each tensor, where rank 0 puts what it receives.
        let ranks: Vec<ParamLayout> = match split {
            true => (0..layout.split.size)
                .map(|rank| {
                    let of = crate::ir::TensorSplit {
                        rank,
                        ..layout.split
                    };
                    ParamLayout::split(&self.plan.spec, of)
                })
                .collect(),
            false => Vec::new(),
        };
        if split && (self.moments_sharded() || optim.iter().any(|o| o.m_scale.is_some())) {
            bail!("internal error: a tensor-parallel checkpoint of sharded or 8-bit moments");
        }
        // Each tensor of the whole model as the part of an array held in `bufs` (this
        // layout's elements of each buffer).
        let tensors = |bufs: Vec<(Range<usize>, BufId)>| -> Result<Vec<Part>> {
            let whole = whole.as_ref().expect("a tensor-parallel plan");
            (whole.tensors.iter().zip(&layout.tensors).enumerate())
                .map(|(i, (w, t))| {
                    let Some((r, own)) = bufs
                        .iter()
                        .find(|(r, _)| r.start <= t.range.start && t.range.end <= r.end)
                    else {
                        bail!("internal error: tensor {} in no buffer", t.name);
                    };
                    let at = t.range.start - r.start..t.range.end - r.start;
                    Ok(Part {
                        held: w.range.clone(),
                        own: *own,
                        how: match &t.part {
                            Some(_) => Spread::Tensor {
                                parts: (ranks.iter())
                                    .map(|l| l.tensors[i].part.clone().expect("cut on every rank"))
                                    .collect(),
                                at,
                            },
                            None => Spread::Whole { at },
                        },
                    })
                })
                .collect()
        };
        let groups = |bufs: Vec<BufId>| -> Vec<Part> {
            let held = layout.groups.iter().map(|g| layout.group_range(g));
            (held.zip(bufs).zip(&self.plan.cuts))
                .map(|((held, own), cut)| Part {
                    held,
                    own,
                    how: Spread::Shards(cut.clone()),
                })
                .collect()
        };
        let (params_sharded, moments_sharded) = (self.params_sharded(), self.moments_sharded());
        // 8-bit moments' scales, sharded by blocks: (block range held, buffer, cut) per group.
        let (first_block, _) = layout.block_offsets(crate::ir::strategy::QBLOCK);
        let scale_parts = |pick: fn(&OptimBufs) -> Option<BufId>| -> Option<Vec<Part>> {
            optim
                .iter()
                .enumerate()
                .map(|(k, o)| {
                    let cut = crate::plan::zero::block_cut(layout, k, &self.plan.cuts[k]);
                    let first = first_block[layout.groups[k].tensors.start];
                    Some(Part {
                        held: first..first + cut.len(),
                        own: pick(o)?,
                        how: Spread::Shards(cut),
                    })
                })
                .collect()
        };
        let scales_sharded = moments_sharded && optim.iter().any(|o| o.m_scale.is_some());
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
        // The spread arrays in the order the writer reads them (the weights, then m, its
        // scales, v, its scales) and the index of each in that schedule.
        let mut arrays = Vec::new();
        let mut push = |parts: Vec<Part>| {
            arrays.push(parts);
            Some(arrays.len() - 1)
        };
        let (params_at, m_at, m_scale_at, v_at, v_scale_at) = match split {
            true => (
                push(tensors(param_bufs())?),
                push(tensors(moment_bufs(|o| o.m))?),
                None,
                push(tensors(moment_bufs(|o| o.v))?),
                None,
            ),
            false => (
                params_sharded
                    .then(|| push(groups(implicit.params.bufs())))
                    .flatten(),
                moments_sharded
                    .then(|| push(groups(optim.iter().map(|o| o.m).collect())))
                    .flatten(),
                scales_sharded
                    .then(|| push(scale_parts(|o| o.m_scale)?))
                    .flatten(),
                moments_sharded
                    .then(|| push(groups(optim.iter().map(|o| o.v).collect())))
                    .flatten(),
                scales_sharded
                    .then(|| push(scale_parts(|o| o.v_scale)?))
                    .flatten(),
            ),
        };
        let shards = Shards { arrays };
        if self.comm.rank() != 0 {
            shards.serve(self)?;
            return Ok(crate::run_dir::RunDir::new(run_dir).checkpoint(state.step));
        }
        let stream = std::cell::RefCell::new(Stream::new(self, &shards));
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
        // The whole model's layout where this rank holds parts of it.
        let (spec, layout) = (&self.plan.spec, whole.as_ref().unwrap_or(layout));
        let dir = crate::ckpt::save_checkpoint_lent(run_dir, spec, layout, &lent, state, opts)?;
        // The other ranks' sends the writer did not need (padding) are received too.
        stream.borrow_mut().finish()?;
        Ok(dir)
    }
}
