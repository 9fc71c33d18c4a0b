//! Processes working on one step together: the [`Comm`] seam and the collectives built on it.
//!
//! A `Comm` is a group of ranks that can exchange bytes pairwise ([`Comm::sendrecv`]); the
//! collectives data parallelism and ZeRO need (all-reduce, reduce-scatter, all-gather) are
//! written once over it in [`ring`], so every transport reduces in the same fixed order
//! (runs are deterministic), works in place on plan buffers with one planned scratch piece
//! (no allocation during a step), sums bf16 and f16 in f32, and counts the bytes it sends
//! exactly (the plan's `comm_bytes_per_step` is checked against that count).
//!
//! Transports:
//! - [`Single`]: one process (rank 0 of 1); every collective is a copy or nothing.
//! - [`Local`]: ranks as threads of one process, over channels (tests, and `--ranks N` runs
//!   that want no MPI).
//! - `Mpi` (cargo feature `mpi`): ranks as processes started by `mpirun`, over MPI's
//!   point-to-point `MPI_Sendrecv` (rsmpi). NCCL comes with the CUDA backend behind the same
//!   trait.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod ring;
pub mod shard;

pub use local::Local;
pub use ring::Summable;
pub use shard::Sharding;

use anyhow::Result;

/// A group of `size()` ranks, this process being `rank()`.
pub trait Comm: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Sends `send` to rank `to` and receives `recv.len()` bytes from rank `from`, both at
    /// once (so a ring of these does not deadlock). Fails naming the rank when a peer is
    /// gone or the sizes disagree.
    fn sendrecv(&self, send: &[u8], to: usize, recv: &mut [u8], from: usize) -> Result<()>;
    /// Bytes this rank has sent since it started (what [`Comm::sendrecv`] was given).
    fn bytes_sent(&self) -> u64;
    /// The transport, for messages (`single process`, `MPI (Open MPI 4.1.4)`, …).
    fn describe(&self) -> String;
    /// Returns when every rank has called it: a dissemination barrier over `sendrecv`
    /// (⌈log₂ N⌉ rounds of empty messages).
    fn barrier(&self) -> Result<()> {
        let (r, n) = (self.rank(), self.size());
        let mut step = 1;
        while step < n {
            self.sendrecv(&[], (r + step) % n, &mut [], (r + n - step) % n)?;
            step *= 2;
        }
        Ok(())
    }
}

/// One process: rank 0 of 1.
#[derive(Debug, Default)]
pub struct Single;

impl Comm for Single {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn sendrecv(&self, send: &[u8], to: usize, recv: &mut [u8], from: usize) -> Result<()> {
        anyhow::ensure!(
            to == 0 && from == 0 && send.len() == recv.len(),
            "internal error: a single process exchanging with rank {to}/{from}"
        );
        recv.copy_from_slice(send);
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        0
    }

    fn describe(&self) -> String {
        "single process".into()
    }
}
