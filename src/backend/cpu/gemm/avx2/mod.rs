//! memwall's own f32 GEMM for CPUs whose widest vectors are AVX2 + FMA: a 6 × 16 register
//! tile ([`kernel`]), operands packed into slivers ([`pack`]) and blocked for this machine's
//! caches, Goto/BLIS style.
//!
//! Loops, outermost first: columns of `c` in panels of `nc`; the reduction in steps of
//! [`KC`], packing that `KC × nc` panel of `op(b)`; rows of `c` in blocks of `mc`, packing
//! that `mc × KC` block of `op(a)`; then every 16-column sliver of the panel against every
//! 6-row sliver of the block. A sliver of `b` (16 KiB) stays in L1 while the block of `a`
//! (half of L2) streams past it. `mc` and `nc` come from the L2 size ([`Blocking`]); [`KC`]
//! is fixed, because it sets where partial sums are added into `c`: an element of `c` is
//! `Σ_blocks (FMA chain over its KC steps)`, added in block order, whatever the cache sizes,
//! the thread count or the tile the element falls in (the tests check it against
//! [`reference()`], the same sums in scalar code, bit for bit).
//!
//! Threads: the output is cut into one part per thread along `n` (each part packs all of
//! `op(a)`) or along `m` (each packs all of `op(b)`), whichever duplicates the smaller
//! operand. Packing buffers are per thread, made once and kept
//! ([`pack_bytes_per_thread`], counted by the plan).

pub mod kernel;
pub mod pack;

use kernel::{MR, NR, Store};
use pack::{Packable, Strided};
use rayon::prelude::*;
use std::cell::RefCell;

/// Reduction steps per packed panel (sets the rounding: see the module documentation).
pub const KC: usize = 256;

/// The cache blocking: rows of `op(a)` per packed block and columns of `op(b)` per packed
/// panel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocking {
    pub mc: usize,
    pub nc: usize,
}

impl Blocking {
    /// From the L2 size in bytes: the `mc × KC` block of `a` fills half of L2; the panel of
    /// `b` is as wide as a whole L2 of `KC` rows (at least 512 columns).
    pub fn for_l2(l2: u64) -> Blocking {
        let row = (KC * 4) as u64;
        let mc = ((l2 / 2 / row) as usize / MR * MR).clamp(8 * MR, 170 * MR);
        let nc = ((l2 / row) as usize / NR * NR).clamp(32 * NR, 256 * NR);
        Blocking { mc, nc }
    }

    /// This machine's.
    pub fn here() -> Blocking {
        Blocking::for_l2(crate::backend::cpu::caches::l2_bytes())
    }
}

/// Bytes of the packing buffers each thread keeps once it has run a GEMM here.
pub fn pack_bytes_per_thread() -> u64 {
    let b = Blocking::here();
    ((b.mc + b.nc) * KC * 4) as u64
}

thread_local! {
    /// This thread's packing buffers: a block of `a`, then a panel of `b`.
    static PACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Below this many multiply-adds a GEMM runs on one thread.
const PAR_MIN_MACS: usize = 64 * 64 * 64;

/// `c[m, n] = (accumulate ? c : 0) + alpha · op(a)[m, k] @ op(b)[k, n]` (see the module
/// documentation for the order of the sums), with `threads` parts at most.
///
/// # Safety
/// The CPU has AVX2 and FMA; every element of the `m × k` window of `a`, the `k × n` window
/// of `b` and the `m × n` window of `c` (row stride `ldc`) is in bounds; `c` aliases neither
/// input; `k > 0`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm<A: Packable, B: Packable>(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: Strided<A>,
    b: Strided<B>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    threads: usize,
) {
    let blk = Blocking::here();
    let threads = if m.saturating_mul(n).saturating_mul(k) < PAR_MIN_MACS {
        1
    } else {
        threads.max(1)
    };
    let c = SendPtr(c);
    // One part per thread along the dimension whose cut duplicates the smaller packing.
    let n_tiles = n.div_ceil(NR);
    let m_tiles = m.div_ceil(MR);
    let along_n = if m <= n {
        n_tiles >= 2 * threads
    } else {
        m_tiles < 2 * threads
    };
    let (tiles, tile) = if along_n {
        (n_tiles, NR)
    } else {
        (m_tiles, MR)
    };
    let parts = threads.min(tiles).max(1);
    let run = |t: usize| {
        let lo = tiles * t / parts * tile;
        let hi = (tiles * (t + 1) / parts * tile).min(if along_n { n } else { m });
        // SAFETY: each part writes a disjoint window of c (its own columns or rows); the
        // rest is the caller's guarantee.
        unsafe {
            if along_n {
                let b = b.offset(0, lo);
                serial((m, hi - lo, k), alpha, a, b, c.at(lo), ldc, accumulate, blk);
            } else {
                let a = a.offset(lo, 0);
                serial(
                    (hi - lo, n, k),
                    alpha,
                    a,
                    b,
                    c.at(lo * ldc),
                    ldc,
                    accumulate,
                    blk,
                );
            }
        }
    };
    if parts == 1 {
        run(0);
    } else {
        (0..parts).into_par_iter().for_each(run);
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the parts write disjoint windows of the output (see `sgemm`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer `off` elements on (a method, so closures capture the whole `SendPtr`).
    ///
    /// # Safety
    /// As `pointer::add`.
    unsafe fn at(self, off: usize) -> *mut f32 {
        // SAFETY: per the caller.
        unsafe { self.0.add(off) }
    }
}

/// One thread's GEMM (the loops of the module documentation).
///
/// # Safety
/// As [`sgemm`].
#[allow(clippy::too_many_arguments)]
unsafe fn serial<A: Packable, B: Packable>(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: Strided<A>,
    b: Strided<B>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    blk: Blocking,
) {
    let a_len = blk.mc.div_ceil(MR) * MR * KC;
    let b_len = blk.nc.div_ceil(NR) * NR * KC;
    PACK.with_borrow_mut(|buf| {
        if buf.len() < a_len + b_len {
            buf.resize(a_len + b_len, 0.0);
        }
        let (abuf, bbuf) = buf.split_at_mut(a_len);
        let mut tile = [0f32; MR * NR];
        for j0 in (0..n).step_by(blk.nc) {
            let nb = blk.nc.min(n - j0);
            for p0 in (0..k).step_by(KC) {
                let kb = KC.min(k - p0);
                // SAFETY: the panel is inside b's window (caller).
                unsafe { pack::pack_b(bbuf, b, (p0, kb), (j0, nb)) };
                let st = Store {
                    load: accumulate || p0 > 0,
                    alpha,
                };
                for i0 in (0..m).step_by(blk.mc) {
                    let mb = blk.mc.min(m - i0);
                    // SAFETY: the block is inside a's window (caller).
                    unsafe { pack::pack_a(abuf, a, (i0, mb), (p0, kb)) };
                    for jr in (0..nb).step_by(NR) {
                        let bs = &bbuf[jr / NR * NR * kb..][..NR * kb];
                        for ir in (0..mb).step_by(MR) {
                            let as_ = &abuf[ir / MR * MR * kb..][..MR * kb];
                            let (rows, cols) = (MR.min(mb - ir), NR.min(nb - jr));
                            // SAFETY: c + (i0 + ir, j0 + jr) starts a tile inside c's window.
                            let ct = unsafe { c.add((i0 + ir) * ldc + j0 + jr) };
                            if rows == MR && cols == NR {
                                // SAFETY: AVX2 + FMA (caller); slivers of kb steps; a whole
                                // tile of c.
                                unsafe {
                                    kernel::kernel(kb, as_.as_ptr(), bs.as_ptr(), ct, ldc, st)
                                };
                            } else {
                                // An edge tile: computed whole into `tile`, then the part
                                // inside c stored with the same arithmetic as the kernel's.
                                let raw = Store {
                                    load: false,
                                    alpha: 1.0,
                                };
                                // SAFETY: as above, into a local MR × NR tile.
                                unsafe {
                                    kernel::kernel(
                                        kb,
                                        as_.as_ptr(),
                                        bs.as_ptr(),
                                        tile.as_mut_ptr(),
                                        NR,
                                        raw,
                                    )
                                };
                                for i in 0..rows {
                                    for j in 0..cols {
                                        let mut v = tile[i * NR + j];
                                        if st.alpha != 1.0 {
                                            v *= st.alpha;
                                        }
                                        // SAFETY: (i, j) is inside the window of c.
                                        unsafe {
                                            let e = ct.add(i * ldc + j);
                                            *e = if st.load { *e + v } else { v };
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    });
}

/// The sums [`sgemm`] computes, in scalar code (the tests' exact twin): for each element,
/// one `mul_add` chain per block of [`KC`] steps, each scaled by `alpha` and added in order.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &dyn Fn(usize, usize) -> f32,
    b: &dyn Fn(usize, usize) -> f32,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let mut v = c[i * ldc + j];
            for p0 in (0..k).step_by(KC) {
                let mut acc = 0f32;
                for p in p0..(p0 + KC).min(k) {
                    acc = a(i, p).mul_add(b(p, j), acc);
                }
                if alpha != 1.0 {
                    acc *= alpha;
                }
                v = if accumulate || p0 > 0 { v + acc } else { acc };
            }
            c[i * ldc + j] = v;
        }
    }
}

#[cfg(test)]
mod tests;
