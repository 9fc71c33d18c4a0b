//! Checkpoints from where the state lives: the executor lends the parameters and moments to
//! `ckpt`'s writer buffer by buffer ([`Stored`]: in place in RAM, through a host copy of one
//! buffer on the disk tier) or, for state sharded among ranks, streamed into rank 0's writer
//! ([`Gathered`]): rank 0 lends its own shards in place and receives the others' piece by
//! piece ([`PIECE`] elements, into arena bytes free between steps) in the order the writer
//! reads them, while the other ranks send theirs in that same order ([`Shards`]). No rank
//! holds more than one piece beyond its plan. The host copy of a disk-tier buffer, like the
//! pieces, goes into arena bytes that no persistent buffer holds (free between steps), so a
//! save stays inside the plan.

use super::{Executor, pod, pod_bytes_mut};
use crate::backend::Device;
use crate::ckpt::{Lend, LentMoments, LentState, OutData, SaveOptions, TrainerState};
use crate::dtype::DType;
use crate::ir::{BufId, OptimBufs};
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

/// Elements per message when rank 0 gathers sharded state for a checkpoint (4 MiB of f32):
/// rank 0 holds one piece beyond the plan, whatever the model's size.
const PIECE: usize = 1 << 20;

/// The sharded arrays of a checkpoint, in the order the writer reads them (the parameters
/// at stage 3, then m and v from stage 1, then the 8-bit moments' block scales), each as one
/// [`Part`] per group. The message schedule: every rank other than 0 sends, array by array,
/// group by group, its chunk in pieces of [`PIECE`] elements (padding included); rank 0
/// receives them in that order, rank by rank.
struct Shards {
    arrays: Vec<Vec<Part>>,
}

/// One group's share of a sharded array.
struct Part {
    /// The array's elements the group holds.
    held: Range<usize>,
    /// This rank's chunk of them.
    own: BufId,
    /// How the group's elements are cut among the ranks (in the array's elements).
    cut: crate::ir::Cut,
}

/// A piece of the schedule: (array, group, rank ≥ 1, piece).
type At = (usize, usize, usize, usize);

/// Rank 0's end of the schedule: the piece it received last, held in `room`.
struct Stream<'e> {
    ex: &'e Executor,
    shards: &'e Shards,
    at: Option<At>,
    room: Spare<'e>,
}

/// Where rank 0 receives a piece: arena bytes free between steps, or a host copy of one
/// piece where the arena has not that much.
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
}

impl<'e> Stream<'e> {
    fn new(ex: &'e Executor, shards: &'e Shards) -> Stream<'e> {
        let bytes = PIECE * 4;
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
        }
    }

    /// Bytes of rank `r`'s chunk of group `k` of array `a`, and of one of its elements.
    fn shard_bytes(&self, a: usize, k: usize, r: usize) -> (usize, usize) {
        let part = &self.shards.arrays[a][k];
        let size = elem_size(self.ex.plan.buffer(part.own).dtype);
        (part.cut.shard(r).len() * size, size)
    }

    /// The byte range of piece `j` within a chunk.
    fn piece(&self, (a, k, r, j): At) -> Range<usize> {
        let (bytes, size) = self.shard_bytes(a, k, r);
        let lo = j * PIECE * size;
        lo..(lo + PIECE * size).min(bytes)
    }

    /// The piece after `at` in the schedule (the first when `None`).
    fn next(&self, at: Option<At>) -> Option<At> {
        let n = self.ex.comm.size();
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
            } else if r >= n {
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
        if self.at.is_some_and(|at| at > want) {
            bail!("internal error: sharded state read out of order");
        }
        while self.at != Some(want) {
            let Some(p) = self.next(self.at) else {
                bail!("internal error: a piece beyond the sharded state");
            };
            self.receive(p)?;
        }
        let len = self.piece(want).len();
        Ok(&self.room.bytes()[..len])
    }

    fn receive(&mut self, p: At) -> Result<()> {
        let len = self.piece(p).len();
        let comm = &*self.ex.comm;
        comm.sendrecv(&[], p.2, &mut self.room.bytes()[..len], p.2)?;
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
}

impl Shards {
    /// A rank other than 0: sends its part of the schedule.
    fn serve(&self, ex: &Executor) -> Result<()> {
        for groups in &self.arrays {
            for Part { own: shard, .. } in groups {
                let mut out = Ok(());
                ex.device.download(&[*shard], &mut |b| {
                    let size = elem_size(ex.plan.buffer(*shard).dtype);
                    out = b[0]
                        .chunks(PIECE * size)
                        .try_for_each(|piece| ex.comm.sendrecv(piece, 0, &mut [], 0));
                })?;
                out?;
            }
        }
        Ok(())
    }
}

/// Array `a` of the sharded state, lent to rank 0's writer: its own chunks from its shard
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
        for (k, Part { held, own, cut }) in shards.arrays[self.a].iter().enumerate() {
            let (lo, hi) = (range.start.max(held.start), range.end.min(held.end));
            if lo >= hi {
                continue;
            }
            // Group elements lo..hi: chunk r of the cut is rank r's shard.
            let (rel_lo, rel_hi) = (lo - held.start, hi - held.start);
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
        // Arrays sharded among ranks are gathered into rank 0's writer group by group; the
        // other ranks serve their shards in the order it reads them (parameters, then m, v).
        let layout = &self.plan.layout;
        let groups = |bufs: Vec<BufId>| -> Vec<Part> {
            let held = layout.groups.iter().map(|g| layout.group_range(g));
            (held.zip(bufs).zip(&self.plan.cuts))
                .map(|((held, own), cut)| Part {
                    held,
                    own,
                    cut: cut.clone(),
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
                        cut,
                    })
                })
                .collect()
        };
        let scales_sharded = moments_sharded && optim.iter().any(|o| o.m_scale.is_some());
        // The sharded arrays in the order the writer reads them (the weights, then m, its
        // scales, v, its scales) and the index of each in that schedule.
        let mut arrays = Vec::new();
        let mut push = |parts: Vec<Part>| {
            arrays.push(parts);
            Some(arrays.len() - 1)
        };
        let params_at = params_sharded
            .then(|| push(groups(implicit.params.bufs())))
            .flatten();
        let m_at = moments_sharded
            .then(|| push(groups(optim.iter().map(|o| o.m).collect())))
            .flatten();
        let m_scale_at = scales_sharded
            .then(|| push(scale_parts(|o| o.m_scale)?))
            .flatten();
        let v_at = moments_sharded
            .then(|| push(groups(optim.iter().map(|o| o.v).collect())))
            .flatten();
        let v_scale_at = scales_sharded
            .then(|| push(scale_parts(|o| o.v_scale)?))
            .flatten();
        let shards = Shards { arrays };
        if self.comm.rank() != 0 {
            shards.serve(self)?;
            return Ok(crate::run_dir::RunDir::new(run_dir).checkpoint(state.step));
        }
        let stream = std::cell::RefCell::new(Stream::new(self, &shards));
        let stream = &stream;
        // A sharded array streams in; the others are lent from where they are.
        let lend = |at: Option<usize>, parts: Vec<(Range<usize>, BufId)>| -> Box<dyn Lend + '_> {
            match at {
                Some(at) => Box::new(Gathered::new(stream, at)),
                None => Box::new(Stored::new(self, parts)),
            }
        };
        let segments = &implicit.params.segments;
        let params = lend(
            params_at,
            segments.iter().map(|s| (s.range.clone(), s.buf)).collect(),
        );
        let parts = |pick: fn(&OptimBufs) -> BufId| -> Vec<(Range<usize>, BufId)> {
            optim
                .iter()
                .enumerate()
                .map(|(k, o)| (self.moment_elems(k, o), pick(o)))
                .collect()
        };
        let m = lend(m_at, parts(|o| o.m));
        let v = lend(v_at, parts(|o| o.v));
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
        let (spec, layout) = (&self.plan.spec, &self.plan.layout);
        let dir = crate::ckpt::save_checkpoint_lent(run_dir, spec, layout, &lent, state, opts)?;
        // The other ranks' sends the writer did not need (padding) are received too.
        stream.borrow_mut().finish()?;
        Ok(dir)
    }
}
