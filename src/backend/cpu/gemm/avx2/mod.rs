//! memwall's own f32 GEMM for CPUs whose widest vectors are AVX2 + FMA: a 6 × 16 register
//! tile ([`kernel`]), operands packed into slivers ([`pack`]) and blocked for this machine's
//! caches, Goto/BLIS style.
//!
//! Loops, outermost first: columns of `c` in panels of `nc`; the reduction in steps of
//! [`KC`], packing that `KC × nc` panel of `op(b)`; rows of `c` in blocks of `mc`, packing
//! that `mc × KC` block of `op(a)`; then every 16-column sliver of the panel against every
//! 6-row sliver of the block. A sliver of `b` (16 KiB) stays in L1 while the block of `a`
//! (half of L2) streams past it. `mc` and `nc` come from the L2 size ([`Blocking`]), the
//! blocks of one GEMM then made equal (at most that size, whole slivers); [`KC`]
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

/// `c[m, n] = ((accumulate ? c : 0) + bias) + alpha · op(a)[m, k] @ op(b)[k, n]` (see the
/// module documentation for the order of the sums; the bias, when there is one, is added to
/// `c` before the first block's product), with `threads` parts at most.
///
/// # Safety
/// The CPU has AVX2 and FMA; every element of the `m × k` window of `a`, the `k × n` window
/// of `b`, the `m × n` window of `c` (row stride `ldc`) and `n` elements of a non-null bias
/// are in bounds; `c` aliases no input; `k > 0`.
pub unsafe fn sgemm<A: Packable, B: Packable>(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: Strided<A>,
    b: Strided<B>,
    dst: Dst,
    threads: usize,
) {
    let blk = Blocking::here();
    let threads = if m.saturating_mul(n).saturating_mul(k) < PAR_MIN_MACS {
        1
    } else {
        threads.max(1)
    };
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
                let (b, dst) = (b.offset(0, lo), dst.offset(0, lo));
                serial((m, hi - lo, k), alpha, a, b, dst, blk);
            } else {
                let (a, dst) = (a.offset(lo, 0), dst.offset(lo, 0));
                serial((hi - lo, n, k), alpha, a, b, dst, blk);
            }
        }
    };
    if parts == 1 {
        run(0);
    } else {
        (0..parts).into_par_iter().for_each(run);
    }
}

/// Where a GEMM writes: `c[m, n]` (row stride `ldc`), onto its old values when
/// `accumulate`, plus `bias[n]` on every row when there is one (null: none).
#[derive(Clone, Copy)]
pub struct Dst {
    pub c: *mut f32,
    pub ldc: usize,
    pub accumulate: bool,
    pub bias: *const f32,
}

// SAFETY: the parts of one GEMM write disjoint windows of `c` (see `sgemm`) and only read
// `bias`.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

impl Dst {
    /// The destination from row `rows`, column `cols` on.
    ///
    /// # Safety
    /// The new origin lies inside the window.
    unsafe fn offset(self, rows: usize, cols: usize) -> Dst {
        // SAFETY: per the caller.
        unsafe {
            Dst {
                c: self.c.add(rows * self.ldc + cols),
                bias: if self.bias.is_null() {
                    self.bias
                } else {
                    self.bias.add(cols)
                },
                ..self
            }
        }
    }
}

/// One thread's GEMM (the loops of the module documentation).
///
/// # Safety
/// As [`sgemm`].
unsafe fn serial<A: Packable, B: Packable>(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: Strided<A>,
    b: Strided<B>,
    dst: Dst,
    blk: Blocking,
) {
    let Dst { c, ldc, .. } = dst;
    // Blocks of equal size rather than full ones and a sliver of a remainder (1024 rows in
    // blocks of 510 would leave 4, packed and computed as edge tiles on their own).
    let even = |len: usize, max: usize, unit: usize| {
        (len.div_ceil(len.div_ceil(max).max(1)).div_ceil(unit) * unit).max(unit)
    };
    let (mc, nc) = (even(m, blk.mc, MR), even(n, blk.nc, NR));
    let a_len = blk.mc.div_ceil(MR) * MR * KC;
    let b_len = blk.nc.div_ceil(NR) * NR * KC;
    PACK.with_borrow_mut(|buf| {
        if buf.len() < a_len + b_len {
            buf.resize(a_len + b_len, 0.0);
        }
        let (abuf, bbuf) = buf.split_at_mut(a_len);
        let mut tile = [0f32; MR * NR];
        for j0 in (0..n).step_by(nc) {
            let nb = nc.min(n - j0);
            for p0 in (0..k).step_by(KC) {
                let kb = KC.min(k - p0);
                // SAFETY: the panel is inside b's window (caller).
                unsafe { pack::pack_b(bbuf, b, (p0, kb), (j0, nb)) };
                // The first block meets c's old values (or none) and the bias; the others
                // add onto c.
                let first = Store {
                    load: dst.accumulate,
                    alpha,
                    bias: dst.bias,
                };
                let block_store = if p0 == 0 { first } else { Store::onto_c(alpha) };
                for i0 in (0..m).step_by(mc) {
                    let mb = mc.min(m - i0);
                    // SAFETY: the block is inside a's window (caller).
                    unsafe { pack::pack_a(abuf, a, (i0, mb), (p0, kb)) };
                    for jr in (0..nb).step_by(NR) {
                        let bs = &bbuf[jr / NR * NR * kb..][..NR * kb];
                        for ir in (0..mb).step_by(MR) {
                            let as_ = &abuf[ir / MR * MR * kb..][..MR * kb];
                            let (rows, cols) = (MR.min(mb - ir), NR.min(nb - jr));
                            // SAFETY: c + (i0 + ir, j0 + jr) starts a tile inside c's window,
                            // and j0 + jr a run of the bias.
                            let ct = unsafe { c.add((i0 + ir) * ldc + j0 + jr) };
                            let st = Store {
                                bias: if block_store.bias.is_null() {
                                    block_store.bias
                                } else {
                                    unsafe { block_store.bias.add(j0 + jr) }
                                },
                                ..block_store
                            };
                            if rows == MR && cols == NR {
                                // SAFETY: AVX2 + FMA (caller); slivers of kb steps; a whole
                                // tile of c.
                                unsafe {
                                    kernel::kernel(kb, as_.as_ptr(), bs.as_ptr(), ct, ldc, st)
                                };
                            } else {
                                // An edge tile: computed whole into `tile`, then the part
                                // inside c stored with the same arithmetic as the kernel's.
                                let raw = Store::raw();
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
                                        // SAFETY: (i, j) is inside the window of c, j inside
                                        // the bias's run.
                                        unsafe {
                                            let e = ct.add(i * ldc + j);
                                            let bias = if st.bias.is_null() {
                                                0.0
                                            } else {
                                                *st.bias.add(j)
                                            };
                                            *e = st.element(*e, bias, tile[i * NR + j]);
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
/// one `mul_add` chain per block of [`KC`] steps, each scaled by `alpha` and added in order,
/// the bias (if any) added to the old value before the first.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &dyn Fn(usize, usize) -> f32,
    b: &dyn Fn(usize, usize) -> f32,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    bias: Option<&[f32]>,
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
                v = match (p0 == 0, bias) {
                    (true, Some(bias)) if accumulate => (v + bias[j]) + acc,
                    (true, Some(bias)) => bias[j] + acc,
                    (true, None) if !accumulate => acc,
                    _ => v + acc,
                };
            }
            c[i * ldc + j] = v;
        }
    }
}

#[cfg(test)]
mod tests;
