//! Checkpoints from where the state lives: the executor lends the parameters and moments to
//! `ckpt`'s writer buffer by buffer ([`Stored`]: in place in RAM, through a host copy of one
//! buffer on the disk tier) or, for state sharded among ranks, group by group gathered into
//! rank 0's writer while the other ranks serve their shards in the same order ([`Gathered`]).

use super::{Executor, pod, pod_bytes_mut};
use crate::backend::Device;
use crate::ckpt::{Lend, LentMoments, LentState, OutData, SaveOptions, TrainerState};
use crate::dist::Comm;
use crate::plan::{BufId, DType, OptimBufs};
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

/// A flat array sharded among ranks (`--zero`: moments from stage 1, parameters at stage 3),
/// lent to rank 0's checkpoint writer one parameter group at a time: the group's shards are
/// gathered from every rank into one host copy of that group (the other ranks run
/// [`Gathered::serve`] in the same order), so no rank holds more than one group's whole state.
struct Gathered<'e> {
    device: &'e dyn Device,
    comm: &'e dyn Comm,
    elem: OutData<'static>,
    /// Per group: its elements, the rank's shard buffer (S elements: chunk `rank` of the
    /// group padded to N·S).
    groups: Vec<(Range<usize>, BufId)>,
    len: usize,
    /// Which of the checkpoint's gathered arrays this is (parameters, m, v).
    id: usize,
    /// Room for one group's N·S elements, shared by the checkpoint's gathered arrays (rank 0
    /// only).
    room: Option<&'e std::cell::RefCell<Room<'e>>>,
}

/// Where rank 0 gathers a group's shards at a checkpoint, and what it holds.
struct Room<'e> {
    spare: Spare<'e>,
    /// (array, group) gathered there last.
    holds: Option<(usize, usize)>,
}

impl<'e> Room<'e> {
    /// Room for `bytes`: arena bytes free between steps, or a host copy where the arena has
    /// not that much.
    fn new(ex: &'e Executor, bytes: usize) -> Room<'e> {
        // SAFETY: checkpoints are written between steps, and this is the one spare slice.
        let spare = match unsafe { ex.device.spare_between_steps(bytes) } {
            Some(b) => Spare::Arena(b),
            None => Spare::Owned(vec![0u64; bytes.div_ceil(8)], bytes),
        };
        Room { spare, holds: None }
    }
}

/// Where a checkpoint gathers a group's shards.
enum Spare<'e> {
    Arena(&'e mut [u8]),
    Owned(Vec<u64>, usize),
}

impl Spare<'_> {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Spare::Arena(b) => b,
            Spare::Owned(v, n) => &mut pod_bytes_mut(v)[..*n],
        }
    }
}

impl<'e> Gathered<'e> {
    /// Array `id` of `groups` (each with its shard buffer) of executor `ex`; rank 0, which
    /// writes, gathers into `room`.
    fn new(
        ex: &'e Executor,
        id: usize,
        groups: Vec<(Range<usize>, BufId)>,
        room: Option<&'e std::cell::RefCell<Room<'e>>>,
    ) -> Gathered<'e> {
        Gathered {
            device: &*ex.device,
            comm: &*ex.comm,
            elem: elem_of(ex.plan.buffer(groups[0].1).dtype),
            len: groups.last().map_or(0, |g| g.0.end),
            groups,
            id,
            room,
        }
    }

    /// Group `k`'s shard from this rank, to the root (`into`: the root's N chunks).
    fn exchange(&self, k: usize, mut into: Option<&mut [u8]>) -> Result<()> {
        let mut out = Ok(());
        self.device.download(&[self.groups[k].1], &mut |b| {
            out = crate::dist::ring::gather_to_root(self.comm, 0, b[0], into.take());
        })?;
        out
    }

    /// A rank other than 0: sends its shard of every group, in the order rank 0's writer
    /// reads them.
    fn serve(&self) -> Result<()> {
        (0..self.groups.len()).try_for_each(|k| self.exchange(k, None))
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
        for (k, (held, shard)) in self.groups.iter().enumerate() {
            let (lo, hi) = (range.start.max(held.start), range.end.min(held.end));
            if lo >= hi {
                continue;
            }
            let mut room = self
                .room
                .expect("internal error: a gathered array without room")
                .borrow_mut();
            let bytes = self.comm.size() * self.device_bytes(*shard);
            if room.holds != Some((self.id, k)) {
                let next = match room.holds {
                    Some((id, j)) if id == self.id => j + 1,
                    _ => 0,
                };
                if k < next {
                    bail!("internal error: a sharded array read out of group order");
                }
                // Groups the writer skipped are gathered too: every rank serves them all.
                for j in next..=k {
                    self.exchange(j, Some(&mut room.spare.bytes()[..bytes]))?;
                }
                room.holds = Some((self.id, k));
            }
            let elems = typed(self.elem, &room.spare.bytes()[..bytes]);
            put(elems.slice(lo - held.start..hi - held.start))?;
        }
        Ok(())
    }
}

impl Gathered<'_> {
    /// Bytes of shard buffer `id`.
    fn device_bytes(&self, id: BufId) -> usize {
        let mut n = 0;
        let _ = self.device.download(&[id], &mut |b| n = b[0].len());
        n
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
        let groups = |bufs: Vec<BufId>| -> Vec<(Range<usize>, BufId)> {
            layout
                .groups
                .iter()
                .map(|g| layout.group_range(g))
                .zip(bufs)
                .collect()
        };
        let (params_sharded, moments_sharded) = (self.params_sharded(), self.moments_sharded());
        if self.comm.rank() != 0 {
            return self.serve_checkpoint(params_sharded, moments_sharded, run_dir, state.step);
        }
        // Room for the largest group's whole state (rank 0 gathers one group at a time).
        let shard_bufs = optim
            .iter()
            .filter(|_| moments_sharded)
            .flat_map(|o| [o.m, o.v])
            .chain(
                implicit
                    .params
                    .bufs()
                    .into_iter()
                    .filter(|_| params_sharded),
            );
        let most = shard_bufs.map(|b| self.plan.buffer(b).bytes as usize).max();
        let room_bytes = if params_sharded || moments_sharded {
            most.unwrap_or(0) * self.comm.size()
        } else {
            0
        };
        let room = std::cell::RefCell::new(Room::new(self, room_bytes));
        let room = &room;
        let lend = |id: usize,
                    sharded: bool,
                    parts: Vec<(Range<usize>, BufId)>,
                    bufs: Vec<BufId>|
         -> Box<dyn Lend + '_> {
            if sharded {
                Box::new(Gathered::new(self, id, groups(bufs), Some(room)))
            } else {
                Box::new(Stored::new(self, parts))
            }
        };
        let segments = &implicit.params.segments;
        let params = lend(
            0,
            params_sharded,
            segments.iter().map(|s| (s.range.clone(), s.buf)).collect(),
            segments.iter().map(|s| s.buf).collect(),
        );
        let parts = |pick: fn(&OptimBufs) -> BufId| -> Vec<(Range<usize>, BufId)> {
            optim
                .iter()
                .enumerate()
                .map(|(k, o)| (self.moment_elems(k, o), pick(o)))
                .collect()
        };
        let bufs = |pick: fn(&OptimBufs) -> BufId| optim.iter().map(pick).collect::<Vec<_>>();
        let m = lend(1, moments_sharded, parts(|o| o.m), bufs(|o| o.m));
        let v = lend(2, moments_sharded, parts(|o| o.v), bufs(|o| o.v));
        let scales = |pick: fn(&OptimBufs) -> Option<BufId>| {
            let bufs: Option<Vec<(Range<usize>, BufId)>> = optim
                .iter()
                .map(|o| {
                    let id = pick(o)?;
                    let n = self.plan.buffer(id).elems;
                    Some((o.block_base..o.block_base + n, id))
                })
                .collect();
            bufs.map(|b| Stored::new(self, b))
        };
        let (m_absmax, v_absmax) = (scales(|o| o.m_scale), scales(|o| o.v_scale));
        let lent = LentState {
            params: &*params,
            moments: LentMoments {
                format: self.moment_format(),
                m: &*m,
                v: &*v,
                absmax: m_absmax
                    .as_ref()
                    .zip(v_absmax.as_ref())
                    .map(|(a, b)| [a as &dyn Lend, b as &dyn Lend]),
            },
        };
        let (spec, layout) = (&self.plan.spec, &self.plan.layout);
        crate::ckpt::save_checkpoint_lent(run_dir, spec, layout, &lent, state, opts)
    }

    /// A rank other than 0 during a checkpoint: sends its shards of what is sharded
    /// (parameters, then m, then v, group by group) to rank 0's writer; returns the
    /// checkpoint's directory (written by rank 0).
    fn serve_checkpoint(
        &self,
        params_sharded: bool,
        moments_sharded: bool,
        run_dir: &Path,
        step: u64,
    ) -> Result<PathBuf> {
        let layout = &self.plan.layout;
        let groups = |bufs: Vec<BufId>| -> Vec<(Range<usize>, BufId)> {
            layout
                .groups
                .iter()
                .map(|g| layout.group_range(g))
                .zip(bufs)
                .collect()
        };
        let implicit = &self.plan.schedule.implicit;
        if params_sharded {
            Gathered::new(self, 0, groups(implicit.params.bufs()), None).serve()?;
        }
        if moments_sharded {
            let optim = implicit.optim.as_deref().unwrap_or_default();
            for pick in [|o: &OptimBufs| o.m, |o: &OptimBufs| o.v] {
                Gathered::new(self, 1, groups(optim.iter().map(pick).collect()), None).serve()?;
            }
        }
        Ok(crate::run_dir::RunDir::new(run_dir).checkpoint(step))
    }
}
