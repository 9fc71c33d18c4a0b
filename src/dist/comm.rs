//! The [`Comm`] seam: a group of ranks that exchange bytes pairwise, on which the
//! collectives ([`super::ring`]) are written once; and [`Single`], the group of one process.

use anyhow::Result;

/// A group of `size()` ranks, this process being `rank()`.
pub trait Comm: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Sends `send` to rank `to` and receives `recv.len()` bytes from rank `from`, both at
    /// once (so a ring of these does not deadlock). Fails naming the rank when a peer is
    /// gone or the sizes disagree.
    fn sendrecv(&self, send: &[u8], to: usize, recv: &mut [u8], from: usize) -> Result<()>;
    /// Sends `send` to rank `to` alone (pipeline parallelism's point-to-point), which receives
    /// it with [`Comm::recv`]; it may return before `to` has (a transport buffers small
    /// messages), or wait for it: callers order their sends and receives alike on both sides.
    fn send(&self, send: &[u8], to: usize) -> Result<()>;
    /// Receives `recv.len()` bytes from rank `from` (what its [`Comm::send`] sent). Fails
    /// naming the rank when the peer is gone or the sizes disagree.
    fn recv(&self, recv: &mut [u8], from: usize) -> Result<()>;
    /// Bytes this rank has sent since it started (what [`Comm::sendrecv`] and
    /// [`Comm::send`] were given).
    fn bytes_sent(&self) -> u64;
    /// The transport, for messages (`single process`, `MPI (Open MPI 4.1.4)`, …).
    fn describe(&self) -> String;
    /// Ends every rank's process with exit status `code`, where the transport can (MPI's
    /// abort: a rank that fails alone would leave the others waiting on it for ever, and
    /// finalising MPI would wait too). Transports that cannot return, leaving it to their
    /// caller.
    fn abort(&self, code: i32) {
        let _ = code;
    }
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

    fn send(&self, _: &[u8], to: usize) -> Result<()> {
        anyhow::bail!("internal error: a single process sending to rank {to}")
    }

    fn recv(&self, _: &mut [u8], from: usize) -> Result<()> {
        anyhow::bail!("internal error: a single process receiving from rank {from}")
    }

    fn bytes_sent(&self) -> u64 {
        0
    }

    fn describe(&self) -> String {
        "single process".into()
    }
}
