//! Ring collectives over [`Comm::sendrecv`], in place on the caller's buffers.
//!
//! A buffer is cut into `N` chunks ([`Cut`]: equal, or at allowed edges); chunk `r` is rank
//! `r`'s shard.
//! - [`reduce_scatter`]: N−1 steps; at step k rank r sends its partial sum of chunk
//!   r−k−1 to rank r+1 and adds the partial of chunk r−k−2 it receives from rank r−1 into
//!   its own. Chunk c is summed in the fixed order c+1, c+2, …, c (every run, every
//!   transport): results are deterministic. The buffer's other chunks are left holding
//!   partial sums.
//! - [`all_gather`]: N−1 steps; at step k rank r sends chunk r−k to rank r+1 and receives
//!   chunk r−k−1 from rank r−1 straight into place.
//! - [`all_reduce`]: the two in turn, in place; [`all_reduce_max`] likewise, with the
//!   maximum in place of the sum.
//!
//! Messages go in pieces of at most the scratch's length (the plan sizes it), so nothing is
//! allocated here; every rank sends as many pieces per step, enough for the longest chunk
//! (some empty), so that messages pair up when chunks differ. Each rank sends every chunk
//! but one per reduce-scatter or all-gather, (N−1)·S elements with equal chunks, and both
//! per all-reduce ([`Cut::sent`]): the bandwidth-optimal figure the plan predicts and the
//! transport's counter confirms. bf16 and f16 partial sums are added in f32
//! and rounded once per hop, as NCCL does.

use super::Comm;
use crate::dtype::Elem;
#[cfg(test)]
use crate::ir::Collective;
use crate::ir::Cut;
use anyhow::{Result, ensure};
use half::{bf16, f16};

/// An element type the collectives can sum (and take the maximum of).
pub trait Summable: Copy + Send + Sync + 'static {
    /// `acc[i] += x[i]`, in f32 or wider, rounded once.
    fn add_into(acc: &mut [Self], x: &[Self]);

    /// `acc[i] = max(acc[i], x[i])`, NaN if either is NaN (exact in any order).
    fn max_into(acc: &mut [Self], x: &[Self]);
}

/// The larger of `a` and `b`, NaN if either is.
fn max_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

impl Summable for f32 {
    fn add_into(acc: &mut [f32], x: &[f32]) {
        acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b);
    }

    fn max_into(acc: &mut [f32], x: &[f32]) {
        (acc.iter_mut().zip(x)).for_each(|(a, b)| *a = max_nan(*a as f64, *b as f64) as f32);
    }
}

impl Summable for f64 {
    fn add_into(acc: &mut [f64], x: &[f64]) {
        acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b);
    }

    fn max_into(acc: &mut [f64], x: &[f64]) {
        acc.iter_mut()
            .zip(x)
            .for_each(|(a, b)| *a = max_nan(*a, *b));
    }
}

impl Summable for bf16 {
    fn add_into(acc: &mut [bf16], x: &[bf16]) {
        acc.iter_mut()
            .zip(x)
            .for_each(|(a, b)| *a = bf16::from_f32(a.to_f32() + b.to_f32()));
    }

    fn max_into(acc: &mut [bf16], x: &[bf16]) {
        let wide = |a: bf16| a.to_f64();
        (acc.iter_mut().zip(x)).for_each(|(a, b)| *a = bf16::from_f64(max_nan(wide(*a), wide(*b))));
    }
}

impl Summable for f16 {
    fn add_into(acc: &mut [f16], x: &[f16]) {
        acc.iter_mut()
            .zip(x)
            .for_each(|(a, b)| *a = <f16 as Elem>::from_f32(Elem::to_f32(*a) + Elem::to_f32(*b)));
    }

    fn max_into(acc: &mut [f16], x: &[f16]) {
        let wide = |a: f16| a.to_f64();
        (acc.iter_mut().zip(x)).for_each(|(a, b)| *a = f16::from_f64(max_nan(wide(*a), wide(*b))));
    }
}

fn as_bytes<T: Copy>(s: &[T]) -> &[u8] {
    // SAFETY: the collectives' element types (f32, f64, bf16, f16, u64) are plain data with
    // no padding; any initialised value is valid bytes.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

fn as_bytes_mut<T: Copy>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid value of these types.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Checks that `cut` cuts `buf` among the comm's ranks.
fn check_cut<T>(comm: &dyn Comm, buf: &[T], cut: &Cut) -> Result<()> {
    ensure!(
        cut.ranks() == comm.size() && cut.len() == buf.len(),
        "internal error: a collective over {} elements among {} ranks, cut for {} elements among {}",
        buf.len(),
        comm.size(),
        cut.len(),
        cut.ranks()
    );
    Ok(())
}

/// Leaves chunk `rank` of `buf` holding the sum (with `combine` = `T::max_into`, the
/// maximum) of every rank's chunk `rank` (the other chunks hold partial sums), using
/// `scratch` for the pieces received.
fn reduce_in_place<T: Summable>(
    comm: &dyn Comm,
    buf: &mut [T],
    cut: &Cut,
    scratch: &mut [T],
    combine: fn(&mut [T], &[T]),
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    check_cut(comm, buf, cut)?;
    if n == 1 || cut.largest() == 0 {
        return Ok(());
    }
    ensure!(
        !scratch.is_empty(),
        "internal error: an empty collective scratch"
    );
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let p = scratch.len();
    for k in 0..n - 1 {
        let send = cut.shard((r + 2 * n - k - 1) % n);
        let recv = cut.shard((r + 2 * n - k - 2) % n);
        for j in 0..cut.pieces(p) {
            let part = |c: &std::ops::Range<usize>| {
                let lo = (c.start + j * p).min(c.end);
                lo..(lo + p).min(c.end)
            };
            let (send, recv) = (part(&send), part(&recv));
            let piece = &mut scratch[..recv.len()];
            comm.sendrecv(as_bytes(&buf[send]), next, as_bytes_mut(piece), prev)?;
            combine(&mut buf[recv], piece);
        }
    }
    Ok(())
}

/// `out` (rank's chunk long) becomes (with `accumulate`, gains) the sum over ranks of chunk
/// `rank` of `buf` (cut by `cut`), whose contents are destroyed.
pub fn reduce_scatter<T: Summable>(
    comm: &dyn Comm,
    buf: &mut [T],
    cut: &Cut,
    out: &mut [T],
    scratch: &mut [T],
    accumulate: bool,
) -> Result<()> {
    let mine = cut.shard(comm.rank());
    ensure!(
        out.len() == mine.len(),
        "internal error: a reduce-scatter into {} elements, a chunk of {}",
        out.len(),
        mine.len()
    );
    reduce_in_place(comm, buf, cut, scratch, T::add_into)?;
    let mine = &buf[mine];
    if accumulate {
        T::add_into(out, mine);
    } else {
        out.copy_from_slice(mine);
    }
    Ok(())
}

/// Every rank's chunk `rank` of `buf` (cut by `cut`) is copied into every rank's `buf`.
pub fn all_gather<T: Copy>(comm: &dyn Comm, buf: &mut [T], cut: &Cut) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    check_cut(comm, buf, cut)?;
    if n == 1 || cut.largest() == 0 {
        return Ok(());
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for k in 0..n - 1 {
        let send = cut.shard((r + n - k) % n);
        let recv = cut.shard((r + 2 * n - k - 1) % n);
        let (send, recv) = two_ranges(buf, send, recv);
        comm.sendrecv(as_bytes(send), next, as_bytes_mut(recv), prev)?;
    }
    Ok(())
}

/// Every element of `buf` (cut by `cut`) becomes its sum over ranks, using `scratch` for
/// the pieces received.
pub fn all_reduce<T: Summable>(
    comm: &dyn Comm,
    buf: &mut [T],
    cut: &Cut,
    scratch: &mut [T],
) -> Result<()> {
    reduce_in_place(comm, buf, cut, scratch, T::add_into)?;
    all_gather(comm, buf, cut)
}

/// Every element of `buf` (cut by `cut`) becomes its maximum over ranks (NaN if any rank's
/// is), using `scratch` for the pieces received: 8-bit block scales the tensor ranks agree
/// on.
pub fn all_reduce_max<T: Summable>(
    comm: &dyn Comm,
    buf: &mut [T],
    cut: &Cut,
    scratch: &mut [T],
) -> Result<()> {
    reduce_in_place(comm, buf, cut, scratch, T::max_into)?;
    all_gather(comm, buf, cut)
}

/// `out` (N·`mine.len()` elements) becomes every rank's `mine`, in rank order (small
/// values: loss, gradient-norm shares, configuration hashes).
pub fn gather_values<T: Copy>(comm: &dyn Comm, mine: &[T], out: &mut [T]) -> Result<()> {
    ensure!(
        out.len() == mine.len() * comm.size(),
        "internal error: gathering {} values from {} ranks into {}",
        mine.len(),
        comm.size(),
        out.len()
    );
    out[comm.rank() * mine.len()..][..mine.len()].copy_from_slice(mine);
    all_gather(comm, out, &Cut::equal(mine.len(), comm.size()))
}

/// Rank `root`'s `bytes` on every rank: the root sends their length, then them, to each
/// other rank in turn; the others pass `None` and receive them.
pub fn broadcast_bytes(comm: &dyn Comm, root: usize, bytes: Option<Vec<u8>>) -> Result<Vec<u8>> {
    let (r, n) = (comm.rank(), comm.size());
    match bytes {
        Some(b) => {
            ensure!(
                r == root,
                "internal error: rank {r} broadcasting as root {root}"
            );
            for to in (0..n).filter(|&to| to != root) {
                comm.send(&(b.len() as u64).to_le_bytes(), to)?;
                comm.send(&b, to)?;
            }
            Ok(b)
        }
        None => {
            ensure!(
                r != root,
                "internal error: root {root} broadcasting nothing"
            );
            let mut len = [0u8; 8];
            comm.recv(&mut len, root)?;
            let mut b = vec![0u8; u64::from_le_bytes(len) as usize];
            comm.recv(&mut b, root)?;
            Ok(b)
        }
    }
}

/// Rank `root`'s `buf` (N chunks of `mine.len()` bytes) receives every rank's `mine` in rank
/// order; the other ranks pass no `buf` (checkpoints: one group's shards at a time, so no
/// rank holds more than one group's whole state).
pub fn gather_to_root(
    comm: &dyn Comm,
    root: usize,
    mine: &[u8],
    buf: Option<&mut [u8]>,
) -> Result<()> {
    let (r, n, s) = (comm.rank(), comm.size(), mine.len());
    match buf {
        Some(buf) => {
            ensure!(
                r == root && buf.len() == n * s,
                "internal error: gathering {n} x {s} bytes into {} at rank {r}",
                buf.len()
            );
            buf[r * s..][..s].copy_from_slice(mine);
            for from in (0..n).filter(|&k| k != root) {
                comm.sendrecv(&[], from, &mut buf[from * s..][..s], from)?;
            }
        }
        None => {
            ensure!(r != root, "internal error: the root gathers into nothing");
            comm.sendrecv(mine, root, &mut [], root)?;
        }
    }
    Ok(())
}

/// Ranges `a` (read) and `b` (written) of `buf`, which do not overlap.
fn two_ranges<T>(
    buf: &mut [T],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[T], &mut [T]) {
    assert!(
        a.end <= b.start || b.end <= a.start,
        "internal error: a chunk sent into itself"
    );
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::{Local, Single};

    /// Runs `f` on every rank of a `Local` group of `n`, one thread each; results by rank.
    fn on_ranks<R: Send>(n: usize, f: impl Fn(&dyn Comm) -> R + Sync) -> Vec<R> {
        let group = Local::group(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .map(|c| s.spawn(|| f(c as &dyn Comm)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Rank r's value of element i: distinct per rank and element, exact in f32 sums.
    #[test]
    fn broadcast_bytes_gives_every_rank_the_roots() {
        for root in [0, 2] {
            let got = on_ranks(3, |c| {
                let mine = (c.rank() == root).then(|| vec![7u8, root as u8, 9]);
                broadcast_bytes(c, root, mine).unwrap()
            });
            assert!(got.iter().all(|b| *b == [7, root as u8, 9]), "{got:?}");
        }
    }

    fn value(r: usize, i: usize) -> f32 {
        ((r * 131 + i * 7) % 97) as f32 - 40.0
    }

    #[test]
    fn all_reduce_sums_in_place_for_any_rank_count_and_piece_size() {
        for n in 1..=5 {
            for piece in [1, 3, 64] {
                let s = 11;
                let out = on_ranks(n, |c| {
                    let mut buf: Vec<f32> = (0..n * s).map(|i| value(c.rank(), i)).collect();
                    let mut scratch = vec![0.0; piece];
                    all_reduce(c, &mut buf, &Cut::equal(s, n), &mut scratch).unwrap();
                    (buf, c.bytes_sent())
                });
                let want: Vec<f32> = (0..n * s)
                    .map(|i| (0..n).map(|r| value(r, i)).sum())
                    .collect();
                for (buf, sent) in out {
                    assert_eq!(buf, want, "n={n} piece={piece}");
                    assert_eq!(sent, (2 * (n - 1) * s * 4) as u64);
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_and_all_gather_move_the_shards() {
        let (n, s) = (4, 6);
        let out = on_ranks(n, |c| {
            let r = c.rank();
            let mut grads: Vec<f32> = (0..n * s).map(|i| value(r, i)).collect();
            let mut shard = vec![1.0f32; s];
            let mut scratch = vec![0.0; 4];
            let cut = Cut::equal(s, n);
            reduce_scatter(c, &mut grads, &cut, &mut shard, &mut scratch, true).unwrap();
            let after_rs = c.bytes_sent();
            // Each rank puts its shard in place, then gathers everyone's.
            let mut full = vec![0.0f32; n * s];
            full[r * s..][..s].copy_from_slice(&shard);
            all_gather(c, &mut full, &cut).unwrap();
            (shard, full, after_rs, c.bytes_sent() - after_rs)
        });
        let sum = |i: usize| -> f32 { (0..n).map(|r| value(r, i)).sum() };
        for (r, (shard, full, rs, ag)) in out.into_iter().enumerate() {
            let want: Vec<f32> = (0..s).map(|j| 1.0 + sum(r * s + j)).collect();
            assert_eq!(shard, want, "rank {r}'s shard accumulated");
            let all: Vec<f32> = (0..n * s).map(|i| 1.0 + sum(i)).collect();
            assert_eq!(full, all);
            let bytes = ((n - 1) * s * 4) as u64;
            assert_eq!((rs, ag), (bytes, bytes));
        }
    }

    #[test]
    fn uneven_chunks_pair_up_and_are_counted() {
        // Chunks of 5, 10, 0 and 0 elements (ranks owning nothing), pieces of 2.
        let sh = crate::ir::Sharding {
            ranks: 4,
            rank: 0,
            zero: crate::ir::shard::Zero(1),
        };
        let cut = sh.at_edges(15, &[5, 6, 15]);
        assert_eq!((cut.shard(1), cut.shard(2)), (5..15, 15..15));
        let out = on_ranks(4, |c| {
            let r = c.rank();
            let mut grads: Vec<f32> = (0..15).map(|i| value(r, i)).collect();
            let mut shard = vec![0.0f32; cut.shard(r).len()];
            let mut scratch = vec![0.0; 2];
            reduce_scatter(c, &mut grads, &cut, &mut shard, &mut scratch, false).unwrap();
            let rs = c.bytes_sent();
            let mut full = vec![0.0f32; 15];
            full[cut.shard(r)].copy_from_slice(&shard);
            all_gather(c, &mut full, &cut).unwrap();
            (full, rs, c.bytes_sent() - rs)
        });
        let all: Vec<f32> = (0..15).map(|i| (0..4).map(|r| value(r, i)).sum()).collect();
        for (r, (full, rs, ag)) in out.into_iter().enumerate() {
            assert_eq!(full, all, "rank {r}");
            assert_eq!(rs, 4 * cut.sent(Collective::ReduceScatter, r) as u64);
            assert_eq!(ag, 4 * cut.sent(Collective::AllGather, r) as u64);
        }
    }

    #[test]
    fn bf16_sums_in_f32_per_hop_and_every_rank_agrees() {
        let n = 3;
        let out = on_ranks(n, |c| {
            let mut buf: Vec<bf16> = (0..n * 5)
                .map(|i| bf16::from_f32(value(c.rank(), i) / 8.0))
                .collect();
            let mut scratch = vec![bf16::ZERO; 5];
            all_reduce(c, &mut buf, &Cut::equal(5, n), &mut scratch).unwrap();
            buf
        });
        for (i, got) in out[0].iter().enumerate() {
            let want: f32 = (0..n).map(|r| value(r, i) / 8.0).sum();
            assert!((got.to_f32() - want).abs() <= want.abs() / 128.0 + 1e-3);
        }
        assert!(out.iter().all(|b| *b == out[0]), "identical on every rank");
    }

    #[test]
    fn results_do_not_depend_on_timing() {
        // Sums of values whose f32 addition is not associative: the fixed ring order gives
        // the same bits every run.
        let run = || {
            on_ranks(4, |c| {
                let mut buf: Vec<f32> = (0..8)
                    .map(|i| 0.1f32 * (c.rank() + i) as f32 + 1e-7)
                    .collect();
                let mut scratch = vec![0.0; 2];
                all_reduce(c, &mut buf, &Cut::equal(2, 4), &mut scratch).unwrap();
                buf
            })
        };
        let first = run();
        for _ in 0..5 {
            assert_eq!(run(), first);
        }
    }

    #[test]
    fn gather_values_and_single_process() {
        let out = on_ranks(3, |c| {
            let mut all = vec![0u64; 6];
            gather_values(c, &[c.rank() as u64, 10], &mut all).unwrap();
            c.barrier().unwrap();
            all
        });
        assert!(out.iter().all(|v| *v == [0, 10, 1, 10, 2, 10]));
        let mut buf = vec![1.0f32, 2.0];
        all_reduce(&Single, &mut buf, &Cut::equal(2, 1), &mut [0.0]).unwrap();
        assert_eq!(buf, [1.0, 2.0]);
    }

    #[test]
    fn gather_to_root_collects_every_rank_in_order() {
        let out = on_ranks(3, |c| {
            let mine = [c.rank() as u8; 4];
            if c.rank() == 1 {
                let mut buf = vec![9u8; 12];
                gather_to_root(c, 1, &mine, Some(&mut buf)).unwrap();
                buf
            } else {
                gather_to_root(c, 1, &mine, None).unwrap();
                vec![]
            }
        });
        assert_eq!(out[1], [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]);
    }

    #[test]
    fn a_lost_peer_is_named() {
        let group = Local::group(2);
        let mut it = group.into_iter();
        let (a, b) = (it.next().unwrap(), it.next().unwrap());
        drop(b);
        let err = a.sendrecv(&[1], 1, &mut [0], 1).unwrap_err();
        assert!(format!("{err}").contains("rank 1"), "{err}");
    }
}
