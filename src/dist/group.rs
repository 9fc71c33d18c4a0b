//! Communicators along the axes of a mesh ([`crate::ir::Mesh`]): a [`Group`] is the ranks of
//! the job that differ from this one along one axis, speaking over the job's communicator
//! with its ranks renumbered, so the collectives of [`super::ring`] run on it unchanged.
//! Two ranks share at most one axis's group (they differ in one coordinate or in more), so
//! the messages between them belong to one group and arrive in order; the one exception,
//! the pipeline's ends ([`Axis::PipelineEnds`], also neighbours on the pipeline axis under
//! the interleaved schedule, or its two stages), sum a tied embedding's gradients after
//! every stage message of the step on both, so the two still meet their messages in one
//! order.

use super::Comm;
use crate::ir::{Axis, Mesh};
use anyhow::{Result, bail};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Some of a job's ranks, renumbered `0..members.len()`.
pub struct Group {
    world: Arc<dyn Comm>,
    /// The job's rank of each member, in the group's order.
    members: Vec<usize>,
    /// This rank's index among the members.
    me: usize,
    sent: AtomicU64,
}

impl Group {
    /// The group of `members` (ranks of `world`, this one among them).
    pub fn new(world: Arc<dyn Comm>, members: Vec<usize>) -> Result<Group> {
        let Some(me) = members.iter().position(|&r| r == world.rank()) else {
            bail!(
                "internal error: rank {} is not in the group {members:?}",
                world.rank()
            );
        };
        if let Some(&bad) = members.iter().find(|&&r| r >= world.size()) {
            bail!(
                "internal error: group member {bad} of a job of {} ranks",
                world.size()
            );
        }
        Ok(Group {
            world,
            members,
            me,
            sent: AtomicU64::new(0),
        })
    }
}

impl Comm for Group {
    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn sendrecv(&self, send: &[u8], to: usize, recv: &mut [u8], from: usize) -> Result<()> {
        self.world
            .sendrecv(send, self.members[to], recv, self.members[from])?;
        self.sent.fetch_add(send.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn send(&self, send: &[u8], to: usize) -> Result<()> {
        self.world.send(send, self.members[to])?;
        self.sent.fetch_add(send.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn recv(&self, recv: &mut [u8], from: usize) -> Result<()> {
        self.world.recv(recv, self.members[from])
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn describe(&self) -> String {
        format!(
            "{} of the {} ranks of {}",
            self.members.len(),
            self.world.size(),
            self.world.describe()
        )
    }

    fn abort(&self, code: i32) {
        self.world.abort(code)
    }
}

/// One communicator per axis of a job's mesh.
#[derive(Clone)]
pub struct Comms {
    /// The whole job.
    pub world: Arc<dyn Comm>,
    /// Along each axis, in [`Axis::ALL`]'s order (the whole job itself where the axis spans
    /// it, as the data axis does today).
    axes: [Arc<dyn Comm>; 3],
    /// The ends of this rank's pipeline ([`Axis::PipelineEnds`]), where it is one of them.
    ends: Option<Arc<dyn Comm>>,
}

impl Comms {
    /// The communicators of `mesh` over `world` (whose size must be the mesh's).
    pub fn new(world: Arc<dyn Comm>, mesh: &Mesh) -> Result<Comms> {
        if mesh.world() != world.size() || mesh.rank != world.rank() {
            bail!(
                "a mesh of {} ranks ({} data x {} tensor x {} pipeline, this rank {}) on a job of \
                 {} ranks (this rank {})",
                mesh.world(),
                mesh.data,
                mesh.tensor,
                mesh.pipeline,
                mesh.rank,
                world.size(),
                world.rank()
            );
        }
        let along = |axis: Axis| -> Result<Arc<dyn Comm>> {
            Ok(match mesh.size(axis) == world.size() {
                true => world.clone(),
                false => Arc::new(Group::new(world.clone(), mesh.group(axis))?),
            })
        };
        Ok(Comms {
            axes: [
                along(Axis::ALL[0])?,
                along(Axis::ALL[1])?,
                along(Axis::ALL[2])?,
            ],
            ends: match mesh.at_pipeline_end() {
                true => Some(along(Axis::PipelineEnds)?),
                false => None,
            },
            world,
        })
    }

    /// Data parallelism over the whole of `world`.
    pub fn data_parallel(world: Arc<dyn Comm>) -> Comms {
        let mesh = Mesh::data_parallel(world.size(), world.rank());
        Comms::new(world, &mesh).expect("the mesh is the job's")
    }

    /// The communicator along `axis` (the pipeline's ends: on the first or the last stage).
    pub fn along(&self, axis: Axis) -> &Arc<dyn Comm> {
        if axis == Axis::PipelineEnds {
            return self.ends.as_ref().expect(
                "internal error: a collective between the pipeline's ends on a middle stage",
            );
        }
        let i = Axis::ALL.iter().position(|&a| a == axis).expect("an axis");
        &self.axes[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::{Local, ring};
    use crate::ir::Cut;

    /// 2 tensor x 3 data ranks as threads: an all-reduce along each axis sums exactly its
    /// group's values, with both axes' collectives on the same job.
    #[test]
    fn collectives_along_an_axis_sum_its_group_only() {
        let (t, d) = (2usize, 3usize);
        let handles: Vec<_> = Local::group(t * d)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let world: Arc<dyn Comm> = Arc::new(c);
                    let rank = world.rank();
                    let mesh = Mesh {
                        data: d,
                        tensor: t,
                        pipeline: 1,
                        rank,
                    };
                    let comms = Comms::new(world, &mesh).unwrap();
                    let mut out = Vec::new();
                    for axis in [Axis::Tensor, Axis::Data] {
                        let comm = comms.along(axis);
                        let n = comm.size();
                        let mut buf = vec![(rank + 1) as f32; 4 * n];
                        let mut scratch = vec![0.0f32; 4];
                        ring::all_reduce(&**comm, &mut buf, &Cut::equal(4, n), &mut scratch)
                            .unwrap();
                        let want: usize = mesh.group(axis).iter().map(|r| r + 1).sum();
                        assert!(buf.iter().all(|&x| x == want as f32), "{axis:?}: {buf:?}");
                        out.push(comm.size());
                    }
                    out
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![t, d]);
        }
    }

    #[test]
    fn a_mesh_of_another_size_is_refused() {
        let world: Arc<dyn Comm> = Arc::new(super::super::Single);
        let e = Comms::new(world, &Mesh::data_parallel(2, 0)).err().unwrap();
        assert!(format!("{e:#}").contains("on a job of 1 ranks"), "{e:#}");
    }
}
