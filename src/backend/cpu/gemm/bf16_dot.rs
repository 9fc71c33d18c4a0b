//! bf16 × bf16 → f32 GEMM on the AVX512_BF16 dot product (`vdpbf16ps`), for CPUs that have
//! it (Cooper Lake, Sapphire Rapids and later, Zen 4 and later); selected at run time by
//! [`super::mixed`], which otherwise widens bf16 tiles to f32 and runs the f32 GEMM.
//!
//! `c[m, n] (f32) = (accumulate ? c : 0) + op(a)[m, k] · op(b)[k, n]`, a and b bf16 at any
//! strides (transposes are strides). One `vdpbf16ps` does, in each of 16 f32 lanes j,
//! `acc[j] += a[2j+1]·b[2j+1]; acc[j] += a[2j]·b[2j]` (bf16 products are exact in f32, each
//! sum rounds once): two steps of k at once. So the operands are packed by **pairs of k**:
//!
//! - A (broadcast operand) in slivers `[mc/MR][kc/2][MR]` of u32, each u32 the pair
//!   `(A[i, p], A[i, p+1]) — for a row-major A that pair is already adjacent in memory;`
//! - B (vector operand) in panels `[nc/NR][kc/2][NR]` of u32, each the pair
//!   `(B[p, j], B[p+1, j]) — interleaving two rows of B (vpermt2w), or, for a transposed B,`
//!   adjacent in memory again (one 32-bit gather per column);
//! - an odd k is padded with a zero pair member, partial tiles with zero rows/columns.
//!
//! The micro-kernel keeps an MR × NR = 12 × 32 f32 tile in 24 registers; per pair of k it
//! loads two B vectors, broadcasts 12 A pairs and issues 24 `vdpbf16ps`. Blocking as BLIS:
//! the A sliver (kc/2 · MR · 4 = 12 KiB) in L1, the B block (kc/2 · nc · 4 = 256 KiB) in
//! L2, C touched once per kc slice. Threads take fixed stripes of C's columns (or rows when
//! m > n); every element of C gets the same arithmetic in the same order whatever the thread
//! count, so results are deterministic and identical for any number of threads. They differ
//! in the last bits from the widening path (another summation order; `vdpbf16ps` also treats
//! denormal inputs and results as zero).
//!
//! Scratch: no allocation; the caller lends `pack`, split per thread (`blocking` sizes the
//! blocks to what it gets). [`Dot::Emulated`] runs the same packing, blocking and kernel
//! with `vdpbf16ps` emulated by AVX-512F shifts and FMAs in the instruction's order — the
//! naive twin of the instruction, so that every part but the instruction itself is tested on
//! CPUs without it. Both variants need AVX-512, so their tests are `#[ignore]`d with what they
//! need (`needs AVX-512F/BW/VL`: names ending `_avx512`; `needs AVX512_BF16`: `_avx512bf16`)
//! and run with `cargo test -- --ignored` where the CPU has it; they fail elsewhere.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::f32::checked_work;
use crate::backend::cpu::elem::bf16_bits;
use crate::backend::cpu::features::features;
use half::bf16;

/// Rows of a micro-tile (broadcast A pairs).
pub const MR: usize = 12;
/// Columns of a micro-tile (two vectors of 16 f32 lanes).
pub const NR: usize = 32;
/// Pairs of k per packed slice (512 values of k).
const KC2: usize = 256;
/// Columns of B per packed block (its panels stay in L2).
const NC: usize = 256;
/// Most rows of A packed at once.
const MC_MAX: usize = 960;

/// How the pair dot product is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dot {
    /// `vdpbf16ps` (AVX512_BF16).
    Hardware,
    /// The same arithmetic from AVX-512F instructions (tests; CPUs without AVX512_BF16).
    Emulated,
}

impl Dot {
    /// Whether this CPU can run the variant.
    pub fn available(self) -> bool {
        let f = features();
        let avx512 = f.avx2 && f.avx512f && f.avx512bw && f.avx512vl;
        match self {
            Dot::Hardware => avx512 && f.avx512bf16,
            Dot::Emulated => avx512,
        }
    }
}

#[cfg(test)]
impl Dot {
    /// What the variant needs beyond baseline x86-64: the reason its tests are ignored.
    pub(crate) fn needs(self) -> &'static str {
        match self {
            Dot::Hardware => "AVX512_BF16",
            Dot::Emulated => "AVX-512F/BW/VL",
        }
    }

    /// Panics unless this CPU runs the variant. Its tests are `#[ignore]`d with the reason
    /// ([`Dot::needs`]) and call this first, so that where the CPU lacks it they fail, rather
    /// than pass without running.
    #[track_caller]
    pub(crate) fn require(self) {
        assert!(
            self.available(),
            "{self:?} needs {}, which this CPU lacks",
            self.needs()
        );
    }
}

/// Block sizes (pairs of k per slice, rows of A, columns of B per block) that fit one
/// thread's share of the packing scratch (`per` u32), or None when not even one micro-tile's
/// slivers fit.
fn blocking(per: usize) -> Option<(usize, usize, usize)> {
    let (kc2, nc) = if per >= KC2 * (MR + NC) {
        (KC2, NC)
    } else {
        (KC2.min(per / (MR + NR)), NR)
    };
    if kc2 == 0 {
        return None;
    }
    let mc = (per / kc2 - nc) / MR * MR;
    Some((kc2, mc.min(MC_MAX), nc))
}

/// Whether `pack` (u32 words) is enough for [`gemm_bf16`] on the current rayon pool.
pub fn pack_fits(pack_words: usize) -> bool {
    blocking(pack_words / rayon::current_num_threads().max(1)).is_some()
}

/// An operand of [`gemm_bf16`]: bf16, or f32 rounded to bf16 (to nearest even, as
/// `half::bf16::from_f32`) while it is packed — how mixed precision multiplies bf16
/// activations with the f32 master weights without a bf16 copy of them.
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    Bf16(&'a [bf16]),
    F32(&'a [f32]),
}

impl<'a> Operand<'a> {
    /// The operand from element `offset` on.
    pub fn from(self, offset: usize) -> Operand<'a> {
        match self {
            Operand::Bf16(x) => Operand::Bf16(&x[offset..]),
            Operand::F32(x) => Operand::F32(&x[offset..]),
        }
    }

    fn len(&self) -> usize {
        match self {
            Operand::Bf16(x) => x.len(),
            Operand::F32(x) => x.len(),
        }
    }

    fn mat(&self, rs: usize, cs: usize) -> Mat {
        let (ptr, f32) = match self {
            Operand::Bf16(x) => (x.as_ptr().cast::<u8>(), false),
            Operand::F32(x) => (x.as_ptr().cast::<u8>(), true),
        };
        Mat {
            ptr,
            rs: rs as isize,
            cs: cs as isize,
            f32,
        }
    }
}

/// A strided operand, bf16 or f32: element (i, j) at `ptr + (i·rs + j·cs)·size`.
#[derive(Clone, Copy)]
struct Mat {
    ptr: *const u8,
    rs: isize,
    cs: isize,
    /// Elements are f32 (else bf16).
    f32: bool,
}

// SAFETY: the pointer is only read, within the window the caller proved valid.
unsafe impl Send for Mat {}
unsafe impl Sync for Mat {}

impl Mat {
    /// Address of element (i, j) (no bounds check).
    #[inline(always)]
    fn addr(&self, i: usize, j: usize) -> *const u8 {
        let e = i as isize * self.rs + j as isize * self.cs;
        self.ptr
            .wrapping_offset(if self.f32 { 4 * e } else { 2 * e })
    }

    /// The window starting at element (i, j).
    fn from(self, i: usize, j: usize) -> Mat {
        Mat {
            ptr: self.addr(i, j),
            ..self
        }
    }

    /// Element (i, j) as bf16 bits.
    ///
    /// # Safety
    /// (i, j) must be in the window.
    #[inline(always)]
    unsafe fn at(&self, i: usize, j: usize) -> u32 {
        unsafe {
            if self.f32 {
                bf16_bits((self.addr(i, j) as *const f32).read_unaligned())
            } else {
                (self.addr(i, j) as *const u16).read_unaligned() as u32
            }
        }
    }

    /// The pair (element (i, j), element (i, j + 1)) as one word, low half first.
    ///
    /// # Safety
    /// Both elements must be in the window.
    #[inline(always)]
    unsafe fn pair(&self, i: usize, j: usize) -> u32 {
        unsafe {
            if self.cs == 1 && !self.f32 {
                (self.addr(i, j) as *const u32).read_unaligned()
            } else {
                self.at(i, j) | (self.at(i, j + 1) << 16)
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: stripes write disjoint elements of C.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

#[derive(Clone, Copy)]
struct Scratch(*mut u32, usize);
// SAFETY: each stripe uses its own disjoint chunk of the scratch.
unsafe impl Send for Scratch {}
unsafe impl Sync for Scratch {}

/// `c[m, n] = (accumulate ? c : 0) + op(a)[m, k] · op(b)[k, n]` with `dot`, parallel over
/// the current rayon pool. Layout as [`super::f32::sgemm`]: a is stored `[m, k]` (or
/// `[k, m]` when `a_trans`) with row stride `lda`, b `[k, n]` (or `[n, k]`), c `[m, n]` with
/// row stride `ldc`; elements of c outside the window are untouched.
///
/// # Panics
/// When `dot` is not available on this CPU, `pack` is too small ([`pack_fits`]), or a
/// stride or length does not cover its window.
pub fn gemm_bf16(
    dot: Dot,
    (m, n, k): (usize, usize, usize),
    (a, lda, a_trans): (Operand, usize, bool), // stored [m, k] (or [k, m])
    (b, ldb, b_trans): (Operand, usize, bool), // stored [k, n] (or [n, k])
    (c, ldc): (&mut [f32], usize),             // [m, n], row stride ldc
    accumulate: bool,
    pack: &mut [u32], // packing scratch, split per thread
) {
    // These asserts guard the raw-pointer code below: keep them in release builds.
    assert!(
        dot.available(),
        "gemm_bf16: {dot:?} is not available on this CPU"
    );
    #[cfg(test)]
    CALLS.with(|c| c.set(c.get() + 1));
    if !checked_work(
        "gemm_bf16",
        (m, n, k),
        (a.len(), lda, a_trans),
        (b.len(), ldb, b_trans),
        c,
        ldc,
        accumulate,
    ) {
        return;
    }
    let a = if a_trans {
        a.mat(1, lda)
    } else {
        a.mat(lda, 1)
    };
    let b = if b_trans {
        b.mat(1, ldb)
    } else {
        b.mat(ldb, 1)
    };
    // Below ~2 MFLOP a second thread costs more than it saves.
    let parts = if m * n * k < (1 << 20) {
        1
    } else {
        rayon::current_num_threads().max(1)
    };
    let per = pack.len() / parts;
    let (kc2, mc, nc) = blocking(per).expect("gemm_bf16: packing scratch too small (pack_fits)");
    let by_cols = n >= m;
    let len = if by_cols { n } else { m };
    let unit = if by_cols { NR } else { MR };
    let units = len.div_ceil(unit);
    let per_part = units.div_ceil(parts);
    let job = Job {
        m,
        n,
        k,
        a,
        b,
        c: Out(c.as_mut_ptr()),
        ldc,
        accumulate,
    };
    let scratch = Scratch(pack.as_mut_ptr(), per);
    let blocks = Blocks { kc2, mc, nc };
    let stripe = move |s: usize| {
        let (u0, u1) = (s * per_part, ((s + 1) * per_part).min(units));
        if u0 >= u1 {
            return;
        }
        let (x0, x1) = (u0 * unit, (u1 * unit).min(len));
        let scratch = scratch;
        // SAFETY: chunk s of the scratch is this stripe's alone (s < parts, per·parts ≤
        // len); the stripe is a sub-window of the checked window; stripes of C are disjoint.
        unsafe {
            let pack = std::slice::from_raw_parts_mut(scratch.0.add(s * scratch.1), scratch.1);
            let job = if by_cols {
                job.cols(x0, x1)
            } else {
                job.rows(x0, x1)
            };
            serial(dot, blocks, job, pack);
        }
    };
    if parts == 1 {
        stripe(0);
    } else {
        rayon::scope(|s| {
            for p in 1..parts {
                s.spawn(move |_| stripe(p));
            }
            stripe(0);
        });
    }
}

#[cfg(test)]
thread_local! {
    /// Calls of [`gemm_bf16`] on this thread (tests check which path a GEMM took).
    pub(crate) static CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[derive(Clone, Copy)]
struct Blocks {
    kc2: usize,
    mc: usize,
    nc: usize,
}

/// One GEMM over a window: `c` (`m × n`, row stride `ldc`) = (`accumulate` ? c : 0) +
/// op(a) · op(b).
#[derive(Clone, Copy)]
struct Job {
    m: usize,
    n: usize,
    k: usize,
    a: Mat,
    b: Mat,
    c: Out,
    ldc: usize,
    accumulate: bool,
}

impl Job {
    /// Columns `x0..x1` of this job's C.
    fn cols(self, x0: usize, x1: usize) -> Job {
        Job {
            n: x1 - x0,
            b: self.b.from(0, x0),
            c: Out(self.c.0.wrapping_add(x0)),
            ..self
        }
    }

    /// Rows `x0..x1` of this job's C.
    fn rows(self, x0: usize, x1: usize) -> Job {
        Job {
            m: x1 - x0,
            a: self.a.from(x0, 0),
            c: Out(self.c.0.wrapping_add(x0 * self.ldc)),
            ..self
        }
    }
}

/// One thread's GEMM over its stripe, with the variant's instruction set enabled.
///
/// # Safety
/// `dot` is available; the job's windows are valid; `pack` holds `kc2·(mc + nc)` words.
unsafe fn serial(dot: Dot, blocks: Blocks, job: Job, pack: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    unsafe {
        match dot {
            Dot::Hardware => serial_hw(blocks, job, pack),
            Dot::Emulated => serial_emu(blocks, job, pack),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dot, blocks, job, pack);
        unreachable!("gemm_bf16 needs x86_64 (Dot::available is false)");
    }
}

/// The two instantiations of the driver: the whole driver is inlined into each, so the
/// kernel is compiled with the instructions its variant may use.
#[cfg(target_arch = "x86_64")]
macro_rules! variant {
    ($name:ident, $features:literal, $dot:path) => {
        #[target_feature(enable = $features)]
        unsafe fn $name(blocks: Blocks, job: Job, pack: &mut [u32]) {
            unsafe { driver::<$dot>(blocks, job, pack) }
        }
    };
}

#[cfg(target_arch = "x86_64")]
variant!(
    serial_hw,
    "avx2,avx512f,avx512bw,avx512vl,avx512bf16",
    HwDot
);
#[cfg(target_arch = "x86_64")]
variant!(serial_emu, "avx2,avx512f,avx512bw,avx512vl", EmuDot);

/// `acc + Σ pairs` in each f32 lane, as `vdpbf16ps`.
#[cfg(target_arch = "x86_64")]
trait PairDot {
    /// # Safety
    /// The variant's instructions are available.
    unsafe fn dot(acc: __m512, a: __m512i, b: __m512i) -> __m512;
}

#[cfg(target_arch = "x86_64")]
struct HwDot;
#[cfg(target_arch = "x86_64")]
impl PairDot for HwDot {
    #[inline(always)]
    unsafe fn dot(acc: __m512, a: __m512i, b: __m512i) -> __m512 {
        // SAFETY: __m512i and __m512bh are both 64 plain bytes; the caller has AVX512_BF16.
        unsafe {
            let (a, b) = (
                std::mem::transmute::<__m512i, __m512bh>(a),
                std::mem::transmute::<__m512i, __m512bh>(b),
            );
            _mm512_dpbf16_ps(acc, a, b)
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct EmuDot;
#[cfg(target_arch = "x86_64")]
impl PairDot for EmuDot {
    /// The odd (high) halves first, then the even (low) ones, as the instruction's
    /// definition orders them; bf16 products are exact in f32, so each FMA rounds as the
    /// instruction's add does.
    #[inline(always)]
    unsafe fn dot(acc: __m512, a: __m512i, b: __m512i) -> __m512 {
        // SAFETY: AVX-512F only.
        unsafe {
            let hi = _mm512_set1_epi32(0xffff_0000u32 as i32);
            let (a_odd, b_odd) = (_mm512_and_si512(a, hi), _mm512_and_si512(b, hi));
            let (a_even, b_even) = (_mm512_slli_epi32::<16>(a), _mm512_slli_epi32::<16>(b));
            let acc = _mm512_fmadd_ps(_mm512_castsi512_ps(a_odd), _mm512_castsi512_ps(b_odd), acc);
            _mm512_fmadd_ps(
                _mm512_castsi512_ps(a_even),
                _mm512_castsi512_ps(b_even),
                acc,
            )
        }
    }
}

/// The BLIS loops: row blocks of A, k slices, column blocks of B, slivers × panels.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn driver<D: PairDot>(
    Blocks { kc2, mc, nc }: Blocks,
    Job {
        m,
        n,
        k,
        a,
        b,
        c: Out(c),
        ldc,
        accumulate,
    }: Job,
    pack: &mut [u32], // [kc2·mc] A slivers, then [kc2·nc] B panels
) {
    let (ap, bp) = pack.split_at_mut(kc2 * mc);
    let kc_max = 2 * kc2;
    for i0 in (0..m).step_by(mc) {
        let rows_blk = mc.min(m - i0);
        for p0 in (0..k).step_by(kc_max) {
            let kc = kc_max.min(k - p0);
            let pairs = kc.div_ceil(2);
            // The first slice overwrites C unless accumulating; later slices add.
            let load_c = accumulate || p0 > 0;
            unsafe { pack_a(ap, a, i0, rows_blk, p0, kc) };
            for j0 in (0..n).step_by(nc) {
                let cols_blk = nc.min(n - j0);
                unsafe { pack_b(bp, b, p0, kc, j0, cols_blk) };
                for ir in (0..rows_blk).step_by(MR) {
                    let rows = MR.min(rows_blk - ir);
                    let sliver = ap[ir * pairs..].as_ptr();
                    for jr in (0..cols_blk).step_by(NR) {
                        let cols = NR.min(cols_blk - jr);
                        let panel = bp[jr * pairs..].as_ptr();
                        // SAFETY: the tile (i0+ir.., j0+jr..) of rows × cols is in the window.
                        unsafe {
                            let ct = c.add((i0 + ir) * ldc + j0 + jr);
                            kernel::<D>(pairs, sliver, panel, ct, ldc, rows, cols, load_c);
                        }
                    }
                }
            }
        }
    }
}

/// Packs op(A)[i0.., p0..] (mc × kc) into slivers `[mc/MR][⌈kc/2⌉][MR]` of pairs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack_a(ap: &mut [u32], a: Mat, i0: usize, mc: usize, p0: usize, kc: usize) {
    let pairs = kc.div_ceil(2);
    // Gather offsets (in elements) of the sliver's 12 rows of a row-major f32 A.
    let gather_ok = a.rs.unsigned_abs() * MR < i32::MAX as usize;
    // SAFETY: AVX2 and AVX-512F/BW/VL, which every variant enables.
    let (row_idx, low16, high_half) = unsafe {
        let rs = if gather_ok { a.rs as i32 } else { 0 };
        let idx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0),
            _mm512_set1_epi32(rs),
        );
        (
            idx,
            _mm512_set1_epi64(0xffff),
            _mm512_set1_epi32(0xffff_0000u32 as i32),
        )
    };
    for (s, sliver) in ap
        .chunks_exact_mut(pairs * MR)
        .take(mc.div_ceil(MR))
        .enumerate()
    {
        let r0 = i0 + s * MR;
        let rows = MR.min(mc - s * MR);
        let live: __mmask16 = ((1u32 << rows) - 1) as u16;
        for q in 0..pairs {
            let dst = &mut sliver[q * MR..(q + 1) * MR];
            let p = p0 + 2 * q;
            let second = 2 * q + 1 < kc;
            // SAFETY (all branches): rows r0..r0+rows at columns p and, when second, p + 1
            // are in the window; masked lanes are not read; dst has MR words.
            unsafe {
                if second && a.rs == 1 {
                    // Transposed A: columns p and p + 1 of the sliver are two contiguous runs.
                    let (x0, x1) = if a.f32 {
                        let x0 = _mm512_maskz_loadu_epi32(live, a.addr(r0, p).cast());
                        let x1 = _mm512_maskz_loadu_epi32(live, a.addr(r0, p + 1).cast());
                        (
                            _mm512_srli_epi32::<16>(round_high(x0)),
                            _mm512_and_si512(round_high(x1), high_half),
                        )
                    } else {
                        let x0 = _mm256_maskz_loadu_epi16(live, a.addr(r0, p).cast());
                        let x1 = _mm256_maskz_loadu_epi16(live, a.addr(r0, p + 1).cast());
                        (
                            _mm512_cvtepu16_epi32(x0),
                            _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(x1)),
                        )
                    };
                    let v = _mm512_or_si512(x0, x1);
                    _mm512_mask_storeu_epi32(dst.as_mut_ptr().cast(), 0x0fff, v);
                    continue;
                }
                if second && a.cs == 1 && a.f32 && gather_ok {
                    // Row-major f32 A: each pair is one 64-bit word of a row; gather the
                    // sliver's rows 8 + 4 at a time, round both halves.
                    let base = a.addr(r0, p);
                    for (h, lanes) in [(0usize, live as u8), (8, (live >> 8) as u8 & 0x0f)] {
                        let idx = _mm512_castsi512_si256(if h == 0 {
                            row_idx
                        } else {
                            _mm512_shuffle_i64x2::<0b00_00_11_10>(row_idx, row_idx)
                        });
                        let x = _mm512_mask_i32gather_epi64::<4>(
                            _mm512_setzero_si512(),
                            lanes,
                            idx,
                            base.cast(),
                        );
                        let r = round_high(x);
                        let even = _mm512_and_si512(_mm512_srli_epi64::<16>(r), low16);
                        let odd = _mm512_and_si512(_mm512_srli_epi64::<32>(r), high_half);
                        let pairs8 = _mm512_cvtepi64_epi32(_mm512_or_si512(even, odd));
                        if h == 0 {
                            _mm256_storeu_si256(dst.as_mut_ptr().cast(), pairs8);
                        } else {
                            _mm_storeu_si128(
                                dst.as_mut_ptr().add(8).cast(),
                                _mm256_castsi256_si128(pairs8),
                            );
                        }
                    }
                    continue;
                }
                for (i, d) in dst.iter_mut().enumerate().take(rows) {
                    *d = if second {
                        a.pair(r0 + i, p)
                    } else {
                        a.at(r0 + i, p)
                    };
                }
            }
            dst[rows..].fill(0);
        }
    }
}

/// f32 lanes rounded to bf16 in their high 16 bits (to nearest even; NaN made quiet), as
/// [`bf16_bits`] (the low 16 bits are garbage).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn round_high(x: __m512i) -> __m512i {
    // SAFETY: AVX2 and AVX-512F/BW/VL, which every variant enables.
    unsafe {
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        let xf = _mm512_castsi512_ps(x);
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(xf, xf);
        _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(x, _mm512_set1_epi32(0x0040_0000)))
    }
}

/// Packs op(B)[p0.., j0..] (kc × nc) into panels `[nc/NR][⌈kc/2⌉][NR]` of pairs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack_b(bp: &mut [u32], b: Mat, p0: usize, kc: usize, j0: usize, nc: usize) {
    let pairs = kc.div_ceil(2);
    // SAFETY: AVX2 and AVX-512F/BW/VL, which every variant enables.
    let (lo, hi, high_half) = unsafe {
        // Interleave two rows of 32 bf16 into 32 pairs: `lo` takes columns 0..16, `hi` 16..32.
        let lo = _mm512_set_epi16(
            47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36,
            4, 35, 3, 34, 2, 33, 1, 32, 0,
        );
        let hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        (lo, hi, _mm512_set1_epi32(0xffff_0000u32 as i32))
    };
    // Gather offsets (in f32) of 8 consecutive columns of a transposed f32 B.
    let gather_ok = b.cs.unsigned_abs() * 32 < i32::MAX as usize;
    // SAFETY: AVX2 and AVX-512F/BW/VL, which every variant enables.
    let (col_idx, low16) = unsafe {
        let cs = if gather_ok { b.cs as i32 } else { 0 };
        (
            _mm256_mullo_epi32(
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                _mm256_set1_epi32(cs),
            ),
            _mm512_set1_epi64(0xffff),
        )
    };
    for (s, panel) in bp
        .chunks_exact_mut(pairs * NR)
        .take(nc.div_ceil(NR))
        .enumerate()
    {
        let c0 = j0 + s * NR;
        let cols = NR.min(nc - s * NR);
        for q in 0..pairs {
            let dst = &mut panel[q * NR..(q + 1) * NR];
            let p = p0 + 2 * q;
            let second = 2 * q + 1 < kc;
            if cols == NR && second && b.cs == 1 {
                // Row-major B: two rows of 32 columns, interleaved.
                // SAFETY: rows p and p + 1, columns c0..c0+32 are in the window.
                unsafe {
                    let (r0, r1) = (b.addr(p, c0), b.addr(p + 1, c0));
                    let d = dst.as_mut_ptr();
                    if b.f32 {
                        for h in 0..2 {
                            let x0 = round_high(_mm512_loadu_si512(r0.add(64 * h).cast()));
                            let x1 = round_high(_mm512_loadu_si512(r1.add(64 * h).cast()));
                            let v = _mm512_or_si512(
                                _mm512_srli_epi32::<16>(x0),
                                _mm512_and_si512(x1, high_half),
                            );
                            _mm512_storeu_si512(d.add(16 * h).cast(), v);
                        }
                    } else {
                        let x0 = _mm512_loadu_si512(r0.cast());
                        let x1 = _mm512_loadu_si512(r1.cast());
                        _mm512_storeu_si512(d.cast(), _mm512_permutex2var_epi16(x0, lo, x1));
                        _mm512_storeu_si512(
                            d.add(16).cast(),
                            _mm512_permutex2var_epi16(x0, hi, x1),
                        );
                    }
                }
            } else if cols == NR && second && b.rs == 1 && b.f32 && gather_ok {
                // Transposed f32 B: each pair is one 64-bit word of a stored row; gather 8
                // at a time, round both halves, keep the high 16 bits of each.
                // SAFETY: (p, c0 + j) and (p + 1, c0 + j) are in the window for j < 32.
                unsafe {
                    let base = b.addr(p, c0);
                    let d = dst.as_mut_ptr();
                    for h in 0..4 {
                        let col0 = base.wrapping_offset(4 * 8 * h as isize * b.cs);
                        let x = _mm512_i32gather_epi64::<4>(col_idx, col0.cast());
                        let r = round_high(x);
                        let even = _mm512_and_si512(_mm512_srli_epi64::<16>(r), low16);
                        let odd = _mm512_and_si512(_mm512_srli_epi64::<32>(r), high_half);
                        let pairs8 = _mm512_cvtepi64_epi32(_mm512_or_si512(even, odd));
                        _mm256_storeu_si256(d.add(8 * h).cast(), pairs8);
                    }
                }
            } else {
                for (j, d) in dst.iter_mut().enumerate().take(cols) {
                    // SAFETY: (p, c0 + j) and, when second, (p + 1, c0 + j) are in the window.
                    *d = unsafe {
                        if !second {
                            b.at(p, c0 + j)
                        } else if b.rs == 1 && !b.f32 {
                            // Transposed bf16 B: the pair is adjacent in memory.
                            (b.addr(p, c0 + j) as *const u32).read_unaligned()
                        } else {
                            b.at(p, c0 + j) | (b.at(p + 1, c0 + j) << 16)
                        }
                    };
                }
                dst[cols..].fill(0);
            }
        }
    }
}

/// The MR × NR micro-kernel: acc = Σ_q dot(a[q][0..MR], b[q][0..NR]) over `pairs`; then the
/// `rows × cols` corner of C = acc (+ C when `load_c`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn kernel<D: PairDot>(
    pairs: usize,
    a: *const u32, // [pairs][MR]
    b: *const u32, // [pairs][NR]
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    load_c: bool,
) {
    // SAFETY: AVX2 and AVX-512F/BW/VL, which every variant enables.
    let mut acc = [[unsafe { _mm512_setzero_ps() }; 2]; MR];
    let (mut a, mut b) = (a, b);
    for _ in 0..pairs {
        // SAFETY: the packed sliver and panel hold `pairs` rows of MR and NR words.
        unsafe {
            let b0 = _mm512_loadu_si512(b.cast());
            let b1 = _mm512_loadu_si512(b.add(16).cast());
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = _mm512_set1_epi32(*a.add(i) as i32);
                row[0] = D::dot(row[0], ai, b0);
                row[1] = D::dot(row[1], ai, b1);
            }
            a = a.add(MR);
            b = b.add(NR);
        }
    }
    let mask = |from: usize| -> __mmask16 {
        let live = cols.saturating_sub(from).min(16);
        ((1u32 << live) - 1) as u16
    };
    let (m0, m1) = (mask(0), mask(16));
    for (i, row) in acc.iter().enumerate().take(rows) {
        // SAFETY: row i < rows and the masked columns < cols are in the caller's window.
        unsafe {
            let p = c.add(i * ldc);
            let (mut r0, mut r1) = (row[0], row[1]);
            if load_c {
                r0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, p), r0);
                r1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, p.add(16)), r1);
            }
            _mm512_mask_storeu_ps(p, m0, r0);
            _mm512_mask_storeu_ps(p.add(16), m1, r1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::naive;
    use super::*;
    use crate::backend::cpu::reduce::testutil::*;

    fn bf(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|&x| bf16::from_f32(x)).collect()
    }

    /// Runs `gemm_bf16` and the naive twin (on the operands rounded to bf16) on one problem,
    /// with each operand passed as bf16 or as f32 (`f32s`: A, B); checks the padding of c.
    #[allow(clippy::too_many_arguments)]
    fn check_as(
        dot: Dot,
        (m, n, k): (usize, usize, usize),
        ta: bool,
        tb: bool,
        acc: bool,
        pack_words: usize,
        f32s: (bool, bool),
    ) -> Vec<f32> {
        let (ar, ac) = if ta { (k, m) } else { (m, k) };
        let (br, bc) = if tb { (n, k) } else { (k, n) };
        let (lda, ldb, ldc) = (ac + 3, bc + 1, n + 2);
        let (a32, b32) = (
            randn(ar * lda, 1.0, 1 + m as u64),
            randn(br * ldb, 1.0, 2 + n as u64),
        );
        let (a, b) = (bf(&a32), bf(&b32));
        let op = |x32: &'static [f32], x: &'static [bf16], f: bool| {
            if f {
                Operand::F32(x32)
            } else {
                Operand::Bf16(x)
            }
        };
        let leak = |v: Vec<f32>| -> &'static [f32] { Box::leak(v.into_boxed_slice()) };
        let leakb = |v: Vec<bf16>| -> &'static [bf16] { Box::leak(v.into_boxed_slice()) };
        let (a32, b32, ab, bb) = (leak(a32), leak(b32), leakb(a.clone()), leakb(b.clone()));
        let c0 = randn(m * ldc, 4.0, 3 + k as u64);
        let (mut got, mut want) = (c0.clone(), c0.clone());
        let mut pack = vec![0xdead_beefu32; pack_words];
        gemm_bf16(
            dot,
            (m, n, k),
            (op(a32, ab, f32s.0), lda, ta),
            (op(b32, bb, f32s.1), ldb, tb),
            (&mut got, ldc),
            acc,
            &mut pack,
        );
        naive::gemm_mixed(m, n, k, &a, lda, ta, &b, ldb, tb, &mut want, ldc, acc);
        let what = format!(
            "{dot:?} {m}x{n}x{k} ta={ta} tb={tb} acc={acc} pack={pack_words} f32 operands {f32s:?}"
        );
        for i in 0..m {
            let row = i * ldc..i * ldc + n;
            assert_close(
                &got[row.clone()],
                &want[row],
                2e-5 * (k as f32).sqrt(),
                1e-5,
                &what,
            );
            let pad = i * ldc + n..(i + 1) * ldc;
            assert_eq!(&got[pad.clone()], &c0[pad], "{what}: padding of c");
        }
        got
    }

    fn check(
        dot: Dot,
        shape: (usize, usize, usize),
        ta: bool,
        tb: bool,
        acc: bool,
        pack_words: usize,
    ) -> Vec<f32> {
        check_as(dot, shape, ta, tb, acc, pack_words, (false, false))
    }

    fn f32_operands_are_rounded_to_bf16_while_packed(dot: Dot) {
        dot.require();
        for f32s in [(true, false), (false, true), (true, true)] {
            for &shape in &[(13, 33, 3), (25, 70, 9), (40, 64, 600)] {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    let x = check_as(dot, shape, ta, tb, true, 1 << 20, f32s);
                    // Exactly what the bf16 copies of the operands give.
                    let y = check_as(dot, shape, ta, tb, true, 1 << 20, (false, false));
                    assert_eq!(x, y, "{dot:?} {shape:?} {f32s:?} ta={ta} tb={tb}");
                }
            }
        }
    }

    #[test]
    #[ignore = "needs AVX-512F/BW/VL"]
    fn f32_operands_are_rounded_to_bf16_while_packed_avx512() {
        f32_operands_are_rounded_to_bf16_while_packed(Dot::Emulated);
    }

    #[test]
    #[ignore = "needs AVX512_BF16"]
    fn f32_operands_are_rounded_to_bf16_while_packed_avx512bf16() {
        f32_operands_are_rounded_to_bf16_while_packed(Dot::Hardware);
    }

    #[test]
    #[ignore = "needs AVX-512F/BW/VL"]
    fn vector_rounding_matches_half_avx512() {
        Dot::Emulated.require();
        let mut xs: Vec<f32> = randn(4096, 3.0, 9);
        xs.extend([
            0.0,
            -0.0,
            1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x7f7f_ffff),
            f32::from_bits(0x7fc0_0001),
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffbf_ffff),
        ]);
        while !xs.len().is_multiple_of(16) {
            xs.push(0.5);
        }
        #[target_feature(enable = "avx512f")]
        unsafe fn round_all(xs: &[f32]) -> Vec<u32> {
            let mut out = vec![0u32; xs.len()];
            for (o, x) in out.chunks_exact_mut(16).zip(xs.chunks_exact(16)) {
                // SAFETY: 16 floats read, 16 words written.
                unsafe {
                    let v = round_high(_mm512_loadu_si512(x.as_ptr().cast()));
                    _mm512_storeu_si512(o.as_mut_ptr().cast(), _mm512_srli_epi32::<16>(v));
                }
            }
            out
        }
        // SAFETY: AVX-512F required above.
        let got = unsafe { round_all(&xs) };
        for (x, g) in xs.iter().zip(got) {
            assert_eq!(g, bf16_bits(*x), "{x:e} ({:#x})", x.to_bits());
        }
    }

    fn matches_naive_on_every_layout_and_edge(dot: Dot) {
        dot.require();
        let big = 1 << 20;
        for &shape in &[
            (1, 1, 1),
            (13, 33, 3),
            (12, 32, 2),
            (25, 70, 9),
            (40, 17, 600),
            (7, 100, 1025),
        ] {
            for ta in [false, true] {
                for tb in [false, true] {
                    for acc in [false, true] {
                        check(dot, shape, ta, tb, acc, big);
                    }
                }
            }
        }
        // Small scratch: short k slices and one-panel B blocks.
        check(dot, (50, 70, 37), false, false, true, 2 * (MR + NR) * 3);
    }

    #[test]
    #[ignore = "needs AVX-512F/BW/VL"]
    fn matches_naive_on_every_layout_and_edge_avx512() {
        matches_naive_on_every_layout_and_edge(Dot::Emulated);
    }

    #[test]
    #[ignore = "needs AVX512_BF16"]
    fn matches_naive_on_every_layout_and_edge_avx512bf16() {
        matches_naive_on_every_layout_and_edge(Dot::Hardware);
    }

    fn identical_for_any_thread_count_and_scratch_split(dot: Dot) {
        dot.require();
        let shape = (130, 300, 520);
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let x = one.install(|| check(dot, shape, false, true, true, 1 << 21));
        let y = three.install(|| check(dot, shape, false, true, true, 3 << 21));
        assert_eq!(x, y, "{dot:?}");
    }

    #[test]
    #[ignore = "needs AVX-512F/BW/VL"]
    fn identical_for_any_thread_count_and_scratch_split_avx512() {
        identical_for_any_thread_count_and_scratch_split(Dot::Emulated);
    }

    #[test]
    #[ignore = "needs AVX512_BF16"]
    fn identical_for_any_thread_count_and_scratch_split_avx512bf16() {
        identical_for_any_thread_count_and_scratch_split(Dot::Hardware);
    }

    #[test]
    #[ignore = "needs AVX512_BF16"]
    fn hardware_agrees_with_its_emulation_avx512bf16() {
        Dot::Hardware.require();
        for ta in [false, true] {
            let x = check(Dot::Hardware, (37, 81, 333), ta, false, false, 1 << 20);
            let y = check(Dot::Emulated, (37, 81, 333), ta, false, false, 1 << 20);
            // Intel defines the two adds in order (odd pair member first), as the emulation
            // does; another implementation may round the pair sum once, so allow an ulp or
            // two of the sums rather than bit equality.
            assert_close(
                &x,
                &y,
                1e-5,
                1e-6,
                &format!("vdpbf16ps vs emulation ta={ta}"),
            );
            let same = x.iter().zip(&y).filter(|(a, b)| a == b).count();
            eprintln!(
                "vdpbf16ps and its emulation: {same} of {} bit-identical",
                x.len()
            );
        }
    }

    #[test]
    fn blocking_fits_its_share() {
        assert_eq!(blocking(MR + NR - 1), None);
        for per in [MR + NR, 1000, 100_000, 1 << 20, 1 << 24] {
            let (kc2, mc, nc) = blocking(per).unwrap();
            assert!(
                kc2 >= 1 && mc >= MR && mc % MR == 0 && nc % NR == 0,
                "{per}"
            );
            assert!(kc2 * (mc + nc) <= per, "{per}: {kc2} {mc} {nc}");
        }
    }

    #[test]
    fn unavailable_or_short_scratch_panics_with_the_reason() {
        let a = bf(&[1.0; 4]);
        let mut c = [0.0f32; 4];
        let r = std::panic::catch_unwind(move || {
            let mut pack = vec![0u32; 3];
            gemm_bf16(
                Dot::Emulated,
                (2, 2, 2),
                (Operand::Bf16(&a), 2, false),
                (Operand::Bf16(&a), 2, false),
                (&mut c, 2),
                false,
                &mut pack,
            );
        });
        // The scratch is checked where the variant runs; elsewhere the variant is refused.
        let want = if Dot::Emulated.available() {
            "scratch"
        } else {
            "is not available on this CPU"
        };
        let e = r.unwrap_err();
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap();
        assert!(msg.contains(want), "{msg}");
    }
}
