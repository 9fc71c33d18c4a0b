//! Ranks as threads of one process, exchanging bytes over channels: a real transport for
//! tests of the collectives and of multi-rank training without MPI. Each ordered pair of
//! ranks has its own channel, so messages between two ranks arrive in the order sent.

use super::Comm;
use anyhow::{Result, bail};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

/// How long a rank waits for a peer's message before it calls the peer lost.
const PEER_TIMEOUT: Duration = Duration::from_secs(60);

/// One rank of a group made by [`Local::group`].
pub struct Local {
    rank: usize,
    /// `to[j]`: the channel into rank j's inbox from this rank.
    to: Vec<Sender<Vec<u8>>>,
    /// `from[j]`: messages from rank j.
    from: Vec<Mutex<Receiver<Vec<u8>>>>,
    sent: AtomicU64,
}

impl Local {
    /// `n` ranks, to be moved one per thread.
    pub fn group(n: usize) -> Vec<Local> {
        assert!(n > 0, "a group has at least one rank");
        // to[i][j] sends from rank i to rank j; from[j][i] receives it.
        let mut to: Vec<Vec<Sender<Vec<u8>>>> = (0..n).map(|_| Vec::with_capacity(n)).collect();
        let mut from: Vec<Vec<Option<Receiver<Vec<u8>>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (i, row) in to.iter_mut().enumerate() {
            for inbox in from.iter_mut() {
                let (tx, rx) = channel();
                row.push(tx);
                inbox[i] = Some(rx);
            }
        }
        to.into_iter()
            .zip(from)
            .enumerate()
            .map(|(rank, (to, from))| Local {
                rank,
                to,
                from: from
                    .into_iter()
                    .map(|r| Mutex::new(r.expect("made above")))
                    .collect(),
                sent: AtomicU64::new(0),
            })
            .collect()
    }
}

impl Comm for Local {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.to.len()
    }

    fn sendrecv(&self, send: &[u8], to: usize, recv: &mut [u8], from: usize) -> Result<()> {
        self.send(send, to)?;
        self.recv(recv, from)
    }

    fn send(&self, send: &[u8], to: usize) -> Result<()> {
        if self.to[to].send(send.to_vec()).is_err() {
            bail!("rank {to} is gone (its thread ended)");
        }
        self.sent.fetch_add(send.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn recv(&self, recv: &mut [u8], from: usize) -> Result<()> {
        let inbox = self.from[from].lock().expect("not poisoned");
        let msg = match inbox.recv_timeout(PEER_TIMEOUT) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => bail!(
                "rank {from} sent nothing for {} s: lost",
                PEER_TIMEOUT.as_secs()
            ),
            Err(RecvTimeoutError::Disconnected) => bail!("rank {from} is gone (its thread ended)"),
        };
        if msg.len() != recv.len() {
            bail!(
                "internal error: rank {from} sent {} bytes, rank {} expected {}",
                msg.len(),
                self.rank,
                recv.len()
            );
        }
        recv.copy_from_slice(&msg);
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn describe(&self) -> String {
        format!("{} threads of one process", self.size())
    }
}
