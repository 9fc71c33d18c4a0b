//! Ranks as processes started by `mpirun`, exchanging bytes with `MPI_Sendrecv` (rsmpi,
//! cargo feature `mpi`). MPI is initialised with `MPI_THREAD_SERIALIZED`: memwall
//! calls it from one thread at a time (the device's communication thread, or the executor's
//! between collectives), never concurrently.
//!
//! A rank that dies makes `mpirun` end the others (Open MPI's default), which the run's
//! wrapper reports naming the rank; a rank that fails with an error aborts the job
//! ([`Comm::abort`]) once it has printed it; a message larger than the receive buffer is an MPI error
//! (fatal by MPI's default error handler), so sizes are also checked here.

use super::Comm;
use anyhow::{Result, bail};
use mpi::environment::Universe;
use mpi::point_to_point as p2p;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// MPI counts are `int`: messages go in pieces of at most this many bytes.
const MAX_MESSAGE: usize = 1 << 30;

/// `MPI_COMM_WORLD` of a process started by `mpirun`. Keep it alive for the whole run:
/// dropping it finalises MPI.
pub struct Mpi {
    world: SimpleCommunicator,
    sent: AtomicU64,
    library: String,
    // Declared last: finalises MPI after the communicator is gone.
    _universe: Universe,
}

// SAFETY: MPI is initialised with MPI_THREAD_SERIALIZED and memwall makes one call at a time
// (collectives run in schedule order on the device's communication thread, and the step's
// scalars are exchanged while none is in flight), which is what SERIALIZED allows
// from any thread; the handles are plain identifiers.
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

impl Mpi {
    /// Initialises MPI. Fails when MPI was already initialised, or when the library cannot
    /// give serialized threading.
    pub fn init() -> Result<Mpi> {
        let Some((universe, threading)) =
            mpi::initialize_with_threading(mpi::Threading::Serialized)
        else {
            bail!("MPI was already initialised in this process");
        };
        if threading < mpi::Threading::Serialized {
            bail!(
                "this MPI library offers only {threading:?} threading; memwall needs Serialized (Open MPI and MPICH both do)"
            );
        }
        let library = mpi::environment::library_version()
            .unwrap_or_default()
            .lines()
            .next()
            .unwrap_or("MPI")
            // Open MPI's string ends in a NUL, which would make the run's output binary.
            .trim_matches(|c: char| c == '\0' || c.is_whitespace())
            .to_string();
        Ok(Mpi {
            world: universe.world(),
            sent: AtomicU64::new(0),
            library,
            _universe: universe,
        })
    }
}

impl Comm for Mpi {
    fn abort(&self, code: i32) {
        self.world.abort(code)
    }

    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn size(&self) -> usize {
        self.world.size() as usize
    }

    fn sendrecv(&self, send: &[u8], to: usize, recv: &mut [u8], from: usize) -> Result<()> {
        let (dst, src) = (
            self.world.process_at_rank(to as i32),
            self.world.process_at_rank(from as i32),
        );
        // Both sides cut the same lengths (every rank sends and receives equal sizes in a
        // collective), in pieces MPI's int counts can hold.
        let pieces = send.len().max(recv.len()).div_ceil(MAX_MESSAGE).max(1);
        for k in 0..pieces {
            let s = piece(send, k);
            let r = piece_mut(recv, k);
            let want = r.len();
            let status = p2p::send_receive_into(s, &dst, r, &src);
            let got = status.count(u8::equivalent_datatype()) as usize;
            if got != want {
                bail!(
                    "internal error: rank {from} sent {got} bytes, rank {} expected {want}",
                    self.rank()
                );
            }
        }
        self.sent.fetch_add(send.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn send(&self, send: &[u8], to: usize) -> Result<()> {
        let dst = self.world.process_at_rank(to as i32);
        for k in 0..send.len().div_ceil(MAX_MESSAGE).max(1) {
            dst.send(piece(send, k));
        }
        self.sent.fetch_add(send.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn recv(&self, recv: &mut [u8], from: usize) -> Result<()> {
        let src = self.world.process_at_rank(from as i32);
        for k in 0..recv.len().div_ceil(MAX_MESSAGE).max(1) {
            let r = piece_mut(recv, k);
            let want = r.len();
            let status = src.receive_into(r);
            let got = status.count(u8::equivalent_datatype()) as usize;
            if got != want {
                bail!(
                    "internal error: rank {from} sent {got} bytes, rank {} expected {want}",
                    self.rank()
                );
            }
        }
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn describe(&self) -> String {
        format!("MPI, {} processes ({})", self.size(), self.library)
    }

    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }
}

fn piece(b: &[u8], k: usize) -> &[u8] {
    let lo = (k * MAX_MESSAGE).min(b.len());
    &b[lo..(lo + MAX_MESSAGE).min(b.len())]
}

fn piece_mut(b: &mut [u8], k: usize) -> &mut [u8] {
    let lo = (k * MAX_MESSAGE).min(b.len());
    let hi = (lo + MAX_MESSAGE).min(b.len());
    &mut b[lo..hi]
}
