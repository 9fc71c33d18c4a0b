//! Packing: copies of a block of `op(a)` and a panel of `op(b)` laid out in the order the
//! micro-kernel reads them, zero-padded to whole slivers. An operand is addressed as
//! `x[r · rs + c · cs]` (row and column strides in elements), so transposed operands are packed
//! from where they lie; the contiguous cases move 8 or 16 elements at a time.
//!
//! An operand may be stored as f32 or bf16 ([`Packable`]): a bf16 one is widened as it is
//! packed (exactly, so the product is the f32 GEMM's of the widened operand, bit for bit),
//! which saves the mixed-precision GEMM a widening pass and half the bytes it reads.

use super::kernel::{MR, NR};
use crate::dtype::Elem;
use half::bf16;
use std::arch::x86_64::*;

/// A storage type the packing reads: f32, or bf16 widened on the way.
pub trait Packable: Elem {
    /// Eight consecutive elements at `p`, as f32.
    ///
    /// # Safety
    /// The CPU has AVX2; `p` points at 8 readable elements.
    unsafe fn load8(p: *const Self) -> __m256;

    /// Six consecutive elements at `p`, as f32 in lanes 0..6 (lanes 6 and 7 zero); reads
    /// nothing past the sixth.
    ///
    /// # Safety
    /// The CPU has AVX2; `p` points at 6 readable elements.
    unsafe fn load6(p: *const Self) -> __m256;
}

/// The first six of eight 32-bit lanes.
#[inline(always)]
fn six_lanes() -> __m256i {
    // SAFETY: only called from functions compiled with AVX2 (inlined into them).
    unsafe { _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0) }
}

impl Packable for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: per the caller.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn load6(p: *const f32) -> __m256 {
        // SAFETY: per the caller; masked-off lanes are not read (and never fault).
        unsafe { _mm256_maskload_ps(p, six_lanes()) }
    }
}

impl Packable for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        // SAFETY: per the caller (bf16 is 2 bytes, so 8 of them are 16 bytes); a bf16 is the
        // high half of its f32.
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }

    #[inline(always)]
    unsafe fn load6(p: *const bf16) -> __m256 {
        // SAFETY: per the caller: six bf16 are the first three 32-bit words at `p` (the
        // fourth is masked off: not read, never faults).
        unsafe {
            let h = _mm_maskload_epi32(p as *const i32, _mm_setr_epi32(-1, -1, -1, 0));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
}

/// A row-major operand read through strides: element `(r, c)` is `ptr[r · rs + c · cs]`.
pub struct Strided<T> {
    pub ptr: *const T,
    pub rs: usize,
    pub cs: usize,
}

impl<T> Clone for Strided<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Strided<T> {}

// SAFETY: a `Strided` is a read-only view; the GEMM driver shares it between its tasks only
// for the duration of one call, while the slice it came from is borrowed.
unsafe impl<T: Sync> Send for Strided<T> {}
unsafe impl<T: Sync> Sync for Strided<T> {}

impl<T: Elem> Strided<T> {
    /// Element `(r, c)` as f32.
    ///
    /// # Safety
    /// `(r, c)` lies inside the window the caller checked.
    #[inline(always)]
    unsafe fn at(&self, r: usize, c: usize) -> f32 {
        // SAFETY: per the caller.
        unsafe { (*self.ptr.add(r * self.rs + c * self.cs)).to_f32() }
    }

    /// A matrix stored row-major with row stride `ld`, read as its transpose when `trans`.
    pub fn of(ptr: *const T, ld: usize, trans: bool) -> Strided<T> {
        let (rs, cs) = if trans { (1, ld) } else { (ld, 1) };
        Strided { ptr, rs, cs }
    }

    /// The view starting `rows` rows and `cols` columns further on.
    ///
    /// # Safety
    /// The new origin lies inside the checked window.
    pub unsafe fn offset(self, rows: usize, cols: usize) -> Strided<T> {
        // SAFETY: per the caller.
        let ptr = unsafe { self.ptr.add(rows * self.rs + cols * self.cs) };
        Strided { ptr, ..self }
    }
}

/// Packs rows `i0 .. i0 + mb`, columns `p0 .. p0 + kb` of `a` into `out` as `ceil(mb / MR)`
/// slivers `[kb, MR]`, rows past `mb` zero.
///
/// # Safety
/// Every `(i, p)` of the block lies inside `a`'s checked window; `out` holds
/// `ceil(mb / MR) · MR · kb` f32.
#[target_feature(enable = "avx2")]
pub unsafe fn pack_a<T: Packable>(
    out: &mut [f32],
    a: Strided<T>,
    (i0, mb): (usize, usize),
    (p0, kb): (usize, usize),
) {
    for (s, sliver) in out
        .chunks_exact_mut(MR * kb)
        .take(mb.div_ceil(MR))
        .enumerate()
    {
        let rows = MR.min(mb - s * MR);
        let r0 = i0 + s * MR;
        if rows < MR {
            sliver.fill(0.0);
        }
        let mut done = 0;
        if a.cs == 1 && rows == MR {
            // Rows of a are contiguous: MR × 8 blocks transposed in registers.
            done = kb / 8 * 8;
            for p in (0..done).step_by(8) {
                // SAFETY: rows r0 .. r0 + MR, columns p0 + p .. + 8 are inside the block;
                // the 8 destination steps lie in this sliver.
                unsafe {
                    transpose_6x8(
                        a.ptr.add(r0 * a.rs + p0 + p),
                        a.rs,
                        sliver.as_mut_ptr().add(p * MR),
                    )
                };
            }
        } else if a.rs == 1 && rows == MR {
            // Columns of a are contiguous (a is stored transposed): each step's MR elements
            // are one run. Eight lanes are stored, the last two overwritten by the next step,
            // except at the sliver's end, where six are.
            for p in 0..kb {
                // SAFETY: rows r0 .. r0 + MR of column p0 + p are inside the block; the
                // 8-lane store stays in the sliver (p + 1 < kb), the last one stores six.
                unsafe {
                    let v = T::load6(a.ptr.add(r0 + (p0 + p) * a.cs));
                    let d = sliver.as_mut_ptr().add(p * MR);
                    if p + 1 < kb {
                        _mm256_storeu_ps(d, v);
                    } else {
                        store6(d, v);
                    }
                }
            }
            done = kb;
        }
        for (p, dst) in sliver.chunks_exact_mut(MR).enumerate().skip(done) {
            for (i, d) in dst.iter_mut().take(rows).enumerate() {
                // SAFETY: (r0 + i, p0 + p) is inside the block, per the caller.
                *d = unsafe { a.at(r0 + i, p0 + p) };
            }
        }
    }
}

/// Packs rows `p0 .. p0 + kb`, columns `j0 .. j0 + nb` of `b` into `out` as
/// `ceil(nb / NR)` slivers `[kb, NR]`, columns past `nb` zero.
///
/// # Safety
/// Every `(p, j)` of the panel lies inside `b`'s checked window; `out` holds
/// `ceil(nb / NR) · NR · kb` f32.
#[target_feature(enable = "avx2")]
pub unsafe fn pack_b<T: Packable>(
    out: &mut [f32],
    b: Strided<T>,
    (p0, kb): (usize, usize),
    (j0, nb): (usize, usize),
) {
    for (s, sliver) in out
        .chunks_exact_mut(NR * kb)
        .take(nb.div_ceil(NR))
        .enumerate()
    {
        let cols = NR.min(nb - s * NR);
        let c0 = j0 + s * NR;
        if cols < NR {
            sliver.fill(0.0);
        }
        if b.cs == 1 {
            // Rows of b are contiguous: one run of `cols` per row.
            for (p, dst) in sliver.chunks_exact_mut(NR).enumerate() {
                // SAFETY: row p0 + p, columns c0 .. c0 + cols are inside the panel.
                let src = unsafe { b.ptr.add((p0 + p) * b.rs + c0) };
                if cols == NR {
                    // SAFETY: a whole row of NR = 2 × 8 elements, into dst's NR.
                    unsafe {
                        _mm256_storeu_ps(dst.as_mut_ptr(), T::load8(src));
                        _mm256_storeu_ps(dst.as_mut_ptr().add(8), T::load8(src.add(8)));
                    }
                } else {
                    for (j, d) in dst[..cols].iter_mut().enumerate() {
                        // SAFETY: column c0 + j < c0 + cols of the row.
                        *d = unsafe { (*src.add(j)).to_f32() };
                    }
                }
            }
        } else if b.rs == 1 && cols == NR {
            // Columns of b are contiguous (b is stored transposed): 8 × 8 blocks transposed
            // in registers, the rows left over by a short kb one by one.
            let whole = kb / 8 * 8;
            for g in 0..NR / 8 {
                for p in (0..whole).step_by(8) {
                    // SAFETY: columns c0 + 8g .. + 8, rows p0 + p .. + 8 are inside the
                    // panel; the 8 destination rows lie in this sliver.
                    unsafe {
                        let src = b.ptr.add((c0 + 8 * g) * b.cs + p0 + p);
                        transpose_8x8(src, b.cs, sliver.as_mut_ptr().add(p * NR + 8 * g), NR);
                    }
                }
            }
            for j in 0..NR {
                for p in whole..kb {
                    // SAFETY: inside the panel.
                    sliver[p * NR + j] = unsafe { b.at(p0 + p, c0 + j) };
                }
            }
        } else {
            // Columns of b are strided: element by element.
            for (p, dst) in sliver.chunks_exact_mut(NR).enumerate() {
                for (j, d) in dst[..cols].iter_mut().enumerate() {
                    // SAFETY: (p0 + p, c0 + j) is inside the panel.
                    *d = unsafe { b.at(p0 + p, c0 + j) };
                }
            }
        }
    }
}

/// Writes the transpose of the 8 × 8 block at `src` (row stride `ld_src`) to `dst` (row
/// stride `ld_dst`): `dst[q · ld_dst + r] = src[r · ld_src + q]`.
///
/// # Safety
/// The CPU has AVX2; both blocks are in bounds.
#[target_feature(enable = "avx2")]
unsafe fn transpose_8x8<T: Packable>(src: *const T, ld_src: usize, dst: *mut f32, ld_dst: usize) {
    // SAFETY: per the caller.
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|i| T::load8(src.add(i * ld_src)));
        for (q, v) in transpose(r).iter().enumerate() {
            _mm256_storeu_ps(dst.add(q * ld_dst), *v);
        }
    }
}

/// Writes lanes 0..6 of `v` to `dst[0..6]`, with a 4-lane and a 2-lane store: no
/// `vmaskmovps` store, which AMD cores before Zen 5 run as microcode (about 20 cycles each on
/// a Zen 4, against under 1 for a plain store).
///
/// # Safety
/// The CPU has AVX2; `dst` is valid for writes of 6 f32.
#[inline(always)]
unsafe fn store6(dst: *mut f32, v: __m256) {
    // SAFETY: per the caller: 4 + 2 lanes, 24 bytes from `dst`.
    unsafe {
        _mm_storeu_ps(dst, _mm256_castps256_ps128(v));
        _mm_storel_epi64(
            dst.add(4) as *mut __m128i,
            _mm_castps_si128(_mm256_extractf128_ps::<1>(v)),
        );
    }
}

/// Writes the transpose of the `MR × 8` block at `src` (row stride `ld_src`) as 8 rows of
/// `MR` to `dst`: `dst[q · MR + r] = src[r · ld_src + q]`. Rows 0..7 are stored 8 lanes
/// wide (the two past `MR`, zero, are overwritten by the next row's store); the last one
/// stores its six, so nothing past the block's `8 · MR` is written.
///
/// # Safety
/// The CPU has AVX2; both blocks are in bounds.
#[target_feature(enable = "avx2")]
unsafe fn transpose_6x8<T: Packable>(src: *const T, ld_src: usize, dst: *mut f32) {
    const { assert!(MR == 6) };
    // SAFETY: per the caller; every store lies in dst[0 .. 8 · MR] (row q < 7 writes
    // q · MR .. q · MR + 8 ≤ 7 · MR + 2); prefetches never fault.
    unsafe {
        for i in 0..MR {
            _mm_prefetch::<_MM_HINT_T0>(src.add(i * ld_src + 64) as *const i8);
        }
        let r: [__m256; 8] = std::array::from_fn(|i| {
            if i < MR {
                T::load8(src.add(i * ld_src))
            } else {
                _mm256_setzero_ps()
            }
        });
        let t = transpose(r);
        for (q, v) in t.iter().enumerate().take(7) {
            _mm256_storeu_ps(dst.add(q * MR), *v);
        }
        store6(dst.add(7 * MR), t[7]);
    }
}

/// The transpose of 8 rows of 8: lane `r` of output `q` is lane `q` of input `r`.
#[inline(always)]
fn transpose(r: [__m256; 8]) -> [__m256; 8] {
    // SAFETY: only called from functions compiled with AVX2 (inlined into them).
    unsafe {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}
