//! Causal multi-head self-attention, forward and backward, without keeping the attention
//! matrix (FlashAttention-style recomputation).
//!
//! Shapes: `qkv` is `[B, T, 3C]` row-major; for row (b, t) the query is `qkv[.., 0..C]`, the key
//! `qkv[.., C..2C]` and the value `qkv[.., 2C..3C]`; head h owns channels `h*hs..(h+1)*hs` of
//! each (hs = C/NH). `out` is `[B, T, C]` with head h in channels `h*hs..(h+1)*hs` (GPT-2 / HF
//! layout). Scores are scaled by 1/sqrt(hs); query position i attends to key positions 0..=i.
//!
//! The work is split into B·NH independent (batch, head) units. Per unit, K and V are first
//! copied into contiguous `[T, hs]` scratch (with software prefetch: rows 3C apart defeat the
//! hardware prefetchers, and the products run faster on contiguous operands), then the queries
//! are processed in row blocks of `BR` = 64 rows `r0..r1` (nb = r1 - r0 rows). A block only
//! needs key columns 0..r1: the masked upper triangle is skipped except inside the diagonal
//! nb×nb square, which is computed and then zeroed. Score tiles are stored transposed,
//! Sᵀ `[r1, nb]` (key index j major, query index li contiguous), which suits `gemm` and turns the
//! per-query reductions of the element-wise passes into lane-wise vector ops.
//!
//! Scores are kept in base-2 units, S' = log2(e) · S (the factor is folded into the product's
//! scale), so the softmax needs 2^x, which is cheaper than e^x. Forward, per block:
//!   S'ᵀ = scale · log2(e) · K[0..r1] Q[r0..r1]ᵀ   `[r1, nb]`
//!   `m[li] = max_j S', Pᵀ = 2^(S'ᵀ - m), l[li] = Σ_j P    (masked j > r0+li set to 0)`
//!   `O[r0..r1] = P V[0..r1], then row li scaled by 1/l[li]  (written in place into out)`
//!   `lse[r0+li] = (m[li] + log2 l[li]) · ln 2     (natural log-sum-exp of the scores S)`
//! Only `out` and `lse` (`[B, NH, T]`) are kept for backward, never the `[B, NH, T, T]` matrix.
//!
//! Backward, per unit: K and V copied as in the forward, Q and dO copied per block, dK and dV
//! accumulated in zeroed contiguous `[T, hs]` scratch (in a fixed block order) and copied into
//! `dqkv at the end; per block, with D[i] = Σ_c dO[i,c] O[i,c] (= Σ_j P[i,j] dP[i,j]):`
//!   Pᵀ  = 2^(S'ᵀ - log2(e) · lse)               `[r1, nb]` (recomputed; masked entries 0)
//!   dV[0..r1] += Pᵀ dO[r0..r1]
//!   dPᵀ = V[0..r1] dO[r0..r1]ᵀ                  `[r1, nb]`
//!   dSᵀ = scale · Pᵀ ∘ (dPᵀ - D)                 (the score scale folded in here)
//!   dQ[r0..r1] = dS K[0..r1]                     (written in place into `dqkv`)
//!   dK[0..r1] += dSᵀ Q[r0..r1]
//!
//! All matrix products go through `gemm::gemm` with `Parallelism::None` (arbitrary strides, so
//! `out`, `dout` and `dqkv` are read and written in place). Parallelism is over units: they are
//! split into contiguous groups, one per rayon worker, each with its own slice of the workspace.
//! Every unit is computed by the same sequence of operations whatever worker runs it, with all
//! reductions in a fixed order, so results are bitwise identical for any thread count.
//!
//! The kernels allocate nothing themselves (the `gemm` crate may use internal packing buffers).
//! The element-wise passes (softmax with the polynomial `exp2_nonpos`, dS) are written so that
//! LLVM vectorises them and are compiled per instruction set with `features::multiversion!`
//! (same arithmetic, no FMA, so bitwise the same results on every ISA). Full 64-query blocks
//! use fixed-size rows so those loops unroll completely.
//!
//! Storage type `T` ([`Elem`]: f32, bf16, f16) for `qkv`, `out`, `dout` and `dqkv`; `lse` and
//! the workspace are f32, and all the math above runs in f32. For f32, Q, O, dO and dQ are
//! read and written in place (strided) as described. For a narrower `T` every operand a unit
//! reads is widened into the worker's workspace first (K and V as above, and a Q block of
//! `[nb, hs]`, also in the forward), and the O and dQ blocks and the dK, dV accumulators are
//! computed in f32 workspace and rounded once into `out` / `dqkv`; this costs one more
//! [min(64,T), hs] block per worker ([`attention_workspace_len`]).

use super::elem::{Elem, is_f32};
use super::features::multiversion;
use gemm::{Parallelism, gemm};
use rayon::prelude::*;

/// Query rows per block.
const BR: usize = 64;

/// Workspace elements (f32) per worker (backward needs the most):
/// Pᵀ and dSᵀ tiles `[br, T]` each, K and V copies `[T, hs]` each, dK and dV accumulators `[T, hs]`
/// each, Q and dO block copies `[br, hs]` each, D [br], and for a storage type other than f32 a
/// dQ block `[br, hs]`. The forward uses less: tile, K, V, m and l [br] each, and for other
/// types Q and O blocks `[br, hs]` each.
fn per_worker_len<T: Elem>(t: usize, hs: usize) -> usize {
    let br = BR.min(t);
    let narrow = if is_f32::<T>() { 0 } else { br * hs };
    2 * br * t + 4 * t * hs + 2 * br * hs + 2 * br + narrow
}

/// Workspace elements (f32) the kernels need for `threads` workers with storage type `T`:
/// per worker two score tiles of [min(64,T), T], four `[T, hs]` buffers (K, V copies; dK, dV
/// accumulators) and a few [min(64,T), hs] / [min(64,T)] block buffers (one more
/// [min(64,T), hs] block for types other than f32).
pub fn attention_workspace_len<T: Elem>(t: usize, hs: usize, threads: usize) -> usize {
    threads.max(1) * per_worker_len::<T>(t, hs)
}

/// Raw pointer that can be shared between rayon workers.
///
/// SAFETY (of every use in this file): the (batch, head) units write disjoint elements of the
/// destination buffers: unit (b, h) writes only rows b·T..(b+1)·T, columns h·hs..(h+1)·hs of
/// `out` (and of each of the q/k/v thirds of `dqkv`), and only `lse[(b·NH+h)·T..][..T]`. Each
/// unit is processed by exactly one worker, and nothing reads those elements concurrently, so no
/// two threads ever touch the same element. The pointers stay valid because the borrowed slices
/// outlive the rayon scope.
struct SyncPtr<P>(*mut P);
impl<P> Clone for SyncPtr<P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for SyncPtr<P> {}
unsafe impl<P> Send for SyncPtr<P> {}
unsafe impl<P> Sync for SyncPtr<P> {}
impl<P> SyncPtr<P> {
    /// Method (not field) access so closures capture the whole `Send + Sync` wrapper.
    fn get(self) -> *mut P {
        self.0
    }
}

/// Geometry of one call, shared by the per-unit routines.
#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    c: usize,
    nh: usize,
    hs: usize,
    /// 1/sqrt(hs): scores are scale · q·k.
    scale: f32,
    /// scale · log2(e): scores in base-2 units, the exponent `exp2_nonpos` takes.
    scale2: f32,
}

impl Dims {
    fn new(t: usize, c: usize, nh: usize) -> Self {
        assert!(
            nh > 0 && c > 0 && c.is_multiple_of(nh),
            "C={c} must be a positive multiple of NH={nh}"
        );
        let hs = c / nh;
        Dims {
            t,
            c,
            nh,
            hs,
            scale: 1.0 / (hs as f32).sqrt(),
            scale2: std::f32::consts::LOG2_E / (hs as f32).sqrt(),
        }
    }
}

/// Contiguous unit range [lo, hi) of worker `w` out of `workers` for `units` units.
fn unit_range(w: usize, workers: usize, units: usize) -> (usize, usize) {
    (w * units / workers, (w + 1) * units / workers)
}

/// A strided read-only matrix operand for `gemm`: element (r, c) at `p + r·rs + c·cs`.
#[derive(Clone, Copy)]
struct View {
    p: *const f32,
    rs: usize,
    cs: usize,
}

/// Row-major matrix with row stride `ld`.
fn rm(p: *const f32, ld: usize) -> View {
    View { p, rs: ld, cs: 1 }
}

/// Transpose of a row-major matrix with row stride `ld` (a column-major view).
fn tr(p: *const f32, ld: usize) -> View {
    View { p, rs: 1, cs: ld }
}

/// `dst[m×n] (= | +=) beta · lhs[m×k] · rhs[k×n]` on the calling thread; `dst` is row-major
/// with row stride `dst_ld`, and is accumulated into when `accumulate`.
///
/// # Safety
/// All pointers must be valid for the addressed elements; `dst` must not alias `lhs`/`rhs`.
#[inline]
unsafe fn mm(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_ld: usize,
    accumulate: bool,
    lhs: View,
    rhs: View,
    beta: f32,
) {
    // SAFETY: forwarded to the caller's contract. gemm semantics: dst = alpha·dst + beta·lhs·rhs
    // with alpha only read when read_dst; strides are (column, row).
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_ld as isize,
            accumulate,
            lhs.p,
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.p,
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

/// Rows ahead that the strided row gathers prefetch. Rows of `qkv`/`dout` are several KiB
/// apart, a stride the hardware prefetchers do not follow, so without hints the copies are
/// bound by memory latency.
const PREFETCH_ROWS: usize = 8;

/// Hints the CPU to pull `src[at..at + len]` into cache (no-op when out of range).
#[inline(always)]
fn prefetch<T>(src: &[T], at: usize, len: usize) {
    if at + len <= src.len() {
        prefetch_ptr(src.as_ptr().wrapping_add(at), len);
    }
}

/// Hints the CPU to pull the `len` elements at `p` into cache (also before writing them).
/// Never dereferences `p`; a no-op on other architectures.
#[inline(always)]
fn prefetch_ptr<T>(p: *const T, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len > 0 {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let (p, bytes) = (p.cast::<i8>(), len * size_of::<T>());
        // One hint per 64-byte line, plus the last byte for unaligned rows.
        for off in (0..bytes).step_by(64).chain(std::iter::once(bytes - 1)) {
            // SAFETY: a prefetch is only a hint: it never faults and has no architectural
            // effect, whatever the address (`wrapping_add` keeps the arithmetic defined).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

/// `dst[i] = src[i].to_f32()` over equal-length slices (a plain copy for f32).
#[inline(always)]
fn widen_into<T: Elem>(dst: &mut [f32], src: &[T]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// Copies `rows` rows of `hs` elements from `src` (row stride `ld`) into contiguous `dst`,
/// widened to f32.
fn gather_rows<T: Elem>(dst: &mut [f32], src: &[T], rows: usize, hs: usize, ld: usize) {
    for (i, d) in dst[..rows * hs].chunks_exact_mut(hs).enumerate() {
        prefetch(src, (i + PREFETCH_ROWS) * ld, hs);
        widen_into(d, &src[i * ld..i * ld + hs]);
    }
}

/// Copies one unit's K and V (`[T, hs]` each, at offsets `c` and `2c` of each [3C] row of `src`)
/// into contiguous f32 `kc` and `vc` in a single pass over the rows.
fn gather_kv<T: Elem>(kc: &mut [f32], vc: &mut [f32], src: &[T], t: usize, hs: usize, c: usize) {
    let kv = kc[..t * hs]
        .chunks_exact_mut(hs)
        .zip(vc[..t * hs].chunks_exact_mut(hs));
    for (i, (kd, vd)) in kv.enumerate() {
        let ahead = (i + PREFETCH_ROWS) * 3 * c;
        prefetch(src, ahead + c, hs);
        prefetch(src, ahead + 2 * c, hs);
        let row = &src[i * 3 * c..];
        widen_into(kd, &row[c..c + hs]);
        widen_into(vd, &row[2 * c..2 * c + hs]);
    }
}

/// Rounds the f32 rows `src` `[rows, hs]` (contiguous) into `rows` rows of `hs` elements at `dst`
/// (row stride `ld`).
///
/// # Safety
/// `dst` must be valid for writes of every addressed element, and nothing else may access
/// them during the call; `src` must not overlap them.
#[inline(always)]
unsafe fn narrow_rows<T: Elem>(dst: *mut T, ld: usize, src: &[f32], hs: usize) {
    for (i, s) in src.chunks_exact(hs).enumerate() {
        // SAFETY: row i of the caller's destination, exclusively ours.
        let d = unsafe { std::slice::from_raw_parts_mut(dst.add(i * ld), hs) };
        for (d, &s) in d.iter_mut().zip(s) {
            *d = T::from_f32(s);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise passes over transposed tiles [r1, nb]: tile row j is key position j, lane li is
// query position r0 + li; entry (j, li) is unmasked iff j ≤ r0 + li, i.e. li ≥ j - r0.

/// 2^x for x ≤ 0, and exactly 0 for x < -126 (so results are never denormal, and masked or
/// negligible probabilities are exact zeros that keep denormal products out of the matrix
/// products). Round-to-nearest split x = k + f, |f| ≤ 1/2, then 2^f by a degree-5 polynomial
/// (near-minimax relative-error fit on [-1/2, 1/2]); max relative error ≈ 1.7e-7 (3 ulp).
/// Working in base 2 (log2 e folded into the score scale) saves the Cody–Waite reduction of a
/// natural exp: about 40% fewer vector ops than `reduce::exp_f32`. Plain mul/add only (no FMA),
/// so every instruction set gives bitwise the same result; NaN propagates.
#[inline(always)]
fn exp2_nonpos(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to the nearest integer
    let xc = if x < -126.0 { -126.0 } else { x };
    let t = xc + MAGIC;
    let k = t - MAGIC; // round(x)
    let ki = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32); // the same, as i32
    let f = xc - k; // exact, in [-1/2, 1/2]
    let p = 1.0
        + f * (0.693_146_9
            + f * (0.240_222_41 + f * (0.055_508_81 + f * (0.009_671_571 + f * 0.001_322_207_6))));
    let pow2k = f32::from_bits((ki.wrapping_add(127) as u32) << 23); // 2^k, k in [-126, 127]
    if x < -126.0 { 0.0 } else { p * pow2k }
}

/// First unmasked lane of tile row `j` for a block starting at query `r0`.
#[inline(always)]
fn first_lane(j: usize, r0: usize) -> usize {
    j.saturating_sub(r0)
}

/// max that vectorises to a plain `maxps` (no NaN bookkeeping).
#[inline(always)]
fn fmax(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// Forward softmax, in place on base-2 scores S'ᵀ `[r1, nb]` → unnormalised Pᵀ = 2^(S' - m)
/// (masked entries 0). Writes the per-query max `m` [nb] and sum `l` [nb].
#[inline(always)]
fn softmax_body(tile: &mut [f32], nb: usize, r0: usize, m: &mut [f32], l: &mut [f32]) {
    if nb == BR {
        let m: &mut [f32; BR] = (&mut m[..BR]).try_into().unwrap();
        let l: &mut [f32; BR] = (&mut l[..BR]).try_into().unwrap();
        return softmax_full(tile, r0, m, l);
    }
    let (m, l) = (&mut m[..nb], &mut l[..nb]);
    m.fill(f32::NEG_INFINITY);
    for (j, row) in tile.chunks_exact(nb).enumerate() {
        let lo = first_lane(j, r0);
        for (mv, &s) in m[lo..].iter_mut().zip(&row[lo..]) {
            *mv = fmax(s, *mv);
        }
    }
    l.fill(0.0);
    for (j, row) in tile.chunks_exact_mut(nb).enumerate() {
        let lo = first_lane(j, r0);
        row[..lo].fill(0.0);
        for ((p, &mv), lv) in row[lo..].iter_mut().zip(&m[lo..]).zip(&mut l[lo..]) {
            let e = exp2_nonpos(*p - mv);
            *p = e;
            *lv += e;
        }
    }
}

/// `softmax_body` for full-width blocks (nb = BR): rows are fixed-size arrays, so the lane
/// loops unroll completely (short dynamic loops cost more in set-up than in work). Rows
/// j < r0 have every lane unmasked; in the diagonal rows j = r0 + jj lanes li < jj are masked
/// (selected away, so the results equal the dynamic path bitwise: masked lanes add +0.0).
#[inline(always)]
fn softmax_full(tile: &mut [f32], r0: usize, m: &mut [f32; BR], l: &mut [f32; BR]) {
    let (rows, _) = tile.as_chunks_mut::<BR>();
    *m = [f32::NEG_INFINITY; BR];
    let (full, diag) = rows.split_at_mut(r0);
    for row in full.iter() {
        for li in 0..BR {
            m[li] = fmax(row[li], m[li]);
        }
    }
    for (jj, row) in diag.iter().enumerate() {
        for li in 0..BR {
            let s = if li >= jj { row[li] } else { f32::NEG_INFINITY };
            m[li] = fmax(s, m[li]);
        }
    }
    *l = [0.0; BR];
    for row in full.iter_mut() {
        for li in 0..BR {
            let e = exp2_nonpos(row[li] - m[li]);
            row[li] = e;
            l[li] += e;
        }
    }
    for (jj, row) in diag.iter_mut().enumerate() {
        for li in 0..BR {
            let e = if li >= jj {
                exp2_nonpos(row[li] - m[li])
            } else {
                0.0
            };
            row[li] = e;
            l[li] += e;
        }
    }
}

/// Backward: base-2 scores S'ᵀ `[r1, nb]` → Pᵀ = 2^(S' - lse·log2 e) in place (masked entries
/// 0); `lse` [nb] is the natural log-sum-exp of the forward.
#[inline(always)]
fn probs_body(tile: &mut [f32], nb: usize, r0: usize, lse: &[f32]) {
    // 2^min(s - lse2, 0): s ≤ lse2 up to rounding.
    let p = |s: f32, lse2: f32| exp2_nonpos(if s - lse2 < 0.0 { s - lse2 } else { 0.0 });
    let to2 = |l: f32| l * std::f32::consts::LOG2_E;
    if nb == BR {
        // Fixed-width rows, as in `softmax_full`.
        let lse: [f32; BR] = std::array::from_fn(|li| to2(lse[li]));
        let (rows, _) = tile.as_chunks_mut::<BR>();
        let (full, diag) = rows.split_at_mut(r0);
        for row in full.iter_mut() {
            for li in 0..BR {
                row[li] = p(row[li], lse[li]);
            }
        }
        for (jj, row) in diag.iter_mut().enumerate() {
            for li in 0..BR {
                row[li] = if li >= jj { p(row[li], lse[li]) } else { 0.0 };
            }
        }
        return;
    }
    let lse = &lse[..nb];
    for (j, row) in tile.chunks_exact_mut(nb).enumerate() {
        let lo = first_lane(j, r0);
        row[..lo].fill(0.0);
        for (v, &lv) in row[lo..].iter_mut().zip(&lse[lo..]) {
            *v = p(*v, to2(lv));
        }
    }
}

/// Backward: dSᵀ = scale · Pᵀ ∘ (dPᵀ - D) in place in `dp` `[r1, nb]`; `d` [nb].
#[inline(always)]
fn ds_body(dp: &mut [f32], p: &[f32], nb: usize, d: &[f32], scale: f32) {
    if nb == BR {
        let d: &[f32; BR] = d[..BR].try_into().unwrap();
        let (drows, _) = dp.as_chunks_mut::<BR>();
        let (prows, _) = p.as_chunks::<BR>();
        for (drow, prow) in drows.iter_mut().zip(prows) {
            for li in 0..BR {
                drow[li] = prow[li] * (drow[li] - d[li]) * scale;
            }
        }
        return;
    }
    let d = &d[..nb];
    for (drow, prow) in dp.chunks_exact_mut(nb).zip(p.chunks_exact(nb)) {
        for ((g, &pv), &dv) in drow.iter_mut().zip(prow).zip(d) {
            *g = pv * (*g - dv) * scale;
        }
    }
}

multiversion! {
    /// `softmax_body`, compiled for the widest vector ISA available.
    fn softmax_tile(tile: &mut [f32], nb: usize, r0: usize, m: &mut [f32], l: &mut [f32]) {
        softmax_body(tile, nb, r0, m, l)
    }
}

multiversion! {
    /// `probs_body`, compiled for the widest vector ISA available.
    fn probs_tile(tile: &mut [f32], nb: usize, r0: usize, lse: &[f32]) {
        probs_body(tile, nb, r0, lse)
    }
}

multiversion! {
    /// `ds_body`, compiled for the widest vector ISA available.
    fn ds_tile(dp: &mut [f32], p: &[f32], nb: usize, d: &[f32], scale: f32) {
        ds_body(dp, p, nb, d, scale)
    }
}

// ---------------------------------------------------------------------------------------------
// Forward

/// Forward of causal self-attention.
///
/// `out` `[B,T,C]` and `lse` `[B,NH,T]` are written in full; `qkv` is `[B,T,3C]`; `ws` must hold at
/// least `attention_workspace_len::<T>(t, c/nh, rayon::current_num_threads())` elements.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: Elem>(
    out: &mut [T],   // [B, T, C]
    lse: &mut [f32], // [B, NH, T]
    qkv: &[T],       // [B, T, 3C]
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    ws: &mut [f32], // [attention_workspace_len::<T>(T, hs, threads)]
) {
    let dims = Dims::new(t, c, nh);
    assert_eq!(out.len(), b * t * c, "out must be [B,T,C]");
    assert_eq!(lse.len(), b * nh * t, "lse must be [B,NH,T]");
    assert_eq!(qkv.len(), b * t * 3 * c, "qkv must be [B,T,3C]");
    let threads = rayon::current_num_threads();
    let need = attention_workspace_len::<T>(t, dims.hs, threads);
    assert!(
        ws.len() >= need,
        "attention workspace too small: {} < {need}",
        ws.len()
    );
    let units = b * nh;
    if units == 0 || t == 0 {
        return;
    }
    let per = per_worker_len::<T>(t, dims.hs);
    let workers = threads.min(units);
    let out_p = SyncPtr(out.as_mut_ptr());
    let lse_p = SyncPtr(lse.as_mut_ptr());
    ws[..workers * per]
        .par_chunks_mut(per)
        .enumerate()
        .for_each(|(w, ws_w)| {
            let (lo, hi) = unit_range(w, workers, units);
            for u in lo..hi {
                // SAFETY: see `SyncPtr`: unit u owns these output elements exclusively.
                unsafe { forward_unit(out_p.get(), lse_p.get(), qkv, u, dims, ws_w) };
            }
        });
}

/// Forward of unit `u` = b·NH + h.
///
/// # Safety
/// `out` must point to the `[B,T,C]` output and `lse` to the `[B,NH,T]` log-sum-exp buffer; the
/// caller guarantees no other thread touches unit `u`'s elements.
unsafe fn forward_unit<T: Elem>(
    out: *mut T,
    lse: *mut f32,
    qkv: &[T], // [B, T, 3C]
    u: usize,
    d: Dims,
    ws: &mut [f32],
) {
    let Dims {
        t,
        c,
        nh,
        hs,
        scale2,
        ..
    } = d;
    let (bi, h) = (u / nh, u % nh);
    let ld3 = 3 * c;
    let qoff = bi * t * ld3 + h * hs;
    let br = BR.min(t);
    let (tile, rest) = ws.split_at_mut(br * t); // Sᵀ / Pᵀ block [r1, nb]
    let (kc, rest) = rest.split_at_mut(t * hs); // K [T, hs]
    let (vc, rest) = rest.split_at_mut(t * hs); // V [T, hs]
    let (mx, rest) = rest.split_at_mut(br); // row max m [nb]
    let (sum, rest) = rest.split_at_mut(br); // row sum l [nb]
    // T = f32 reads Q and writes O in place; other types widen Q into, and compute O in, these.
    let direct = is_f32::<T>();
    let nbuf = if direct { 0 } else { br * hs };
    let (qbuf, rest) = rest.split_at_mut(nbuf); // Q block [nb, hs]
    let obuf = &mut rest[..nbuf]; // O block [nb, hs]
    gather_kv(kc, vc, &qkv[qoff..], t, hs, c);
    // SAFETY: in-bounds offsets of the caller's buffers; this unit's exclusive regions.
    let (o, lse_u) = unsafe {
        (
            out.add(bi * t * c + h * hs), // O [T, hs], row stride C
            std::slice::from_raw_parts_mut(lse.add(u * t), t), // lse [T]
        )
    };
    let mut r0 = 0;
    while r0 < t {
        let r1 = (r0 + BR).min(t);
        let nb = r1 - r0;
        let tile = &mut tile[..r1 * nb];
        for i in r0..r1 {
            // The O rows this block writes at its end (strided, otherwise cache misses).
            prefetch_ptr(o.wrapping_add(i * c), hs);
        }
        let qrows = &qkv[qoff + r0 * ld3..]; // Q[r0..], row stride 3C
        let qv = if direct {
            tr(qrows.as_ptr().cast::<f32>(), ld3) // T is f32: the same memory
        } else {
            gather_rows(qbuf, qrows, nb, hs, ld3);
            tr(qbuf.as_ptr(), hs)
        };
        // SAFETY: Q rows r0..r1 < T of this batch (or their copy); kc/tile are [r1, hs] /
        // [r1, nb] in ws.
        unsafe {
            // S'ᵀ[r1, nb] = scale2 · K[0..r1] Q[r0..r1]ᵀ  (scores in base-2 units)
            mm(
                (r1, nb, hs),
                tile.as_mut_ptr(),
                nb,
                false,
                rm(kc.as_ptr(), hs),
                qv,
                scale2,
            );
        }
        softmax_tile(tile, nb, r0, mx, sum);
        // O rows r0..r1: in place for f32 (T is f32, so the cast is the same memory), else
        // the f32 block, rounded into `out` below.
        let (ob, ob_ld) = if direct {
            // SAFETY: in-bounds offset of this unit's O rows.
            (unsafe { o.add(r0 * c) }.cast::<f32>(), c)
        } else {
            (obuf.as_mut_ptr(), hs)
        };
        // SAFETY: O rows r0..r1 belong to this unit (or are the ws block); vc rows 0..r1 are
        // in ws.
        unsafe {
            // O[r0..r1] = P[nb, r1] V[0..r1]   (P = tileᵀ: column stride nb, row stride 1)
            mm(
                (nb, hs, r1),
                ob,
                ob_ld,
                false,
                tr(tile.as_ptr(), nb),
                rm(vc.as_ptr(), hs),
                1.0,
            );
            // Normalise: O row li /= l[li].
            for (li, &l) in sum[..nb].iter().enumerate() {
                let inv = 1.0 / l;
                for e in 0..hs {
                    *ob.add(li * ob_ld + e) *= inv;
                }
            }
            if !direct {
                narrow_rows(o.add(r0 * c), c, &obuf[..nb * hs], hs);
            }
        }
        for ((lv, &m), &l) in lse_u[r0..r1].iter_mut().zip(&*mx).zip(&*sum) {
            *lv = (m + l.log2()) * std::f32::consts::LN_2;
        }
        r0 = r1;
    }
}

// ---------------------------------------------------------------------------------------------
// Backward

/// Backward of causal self-attention: overwrites all of `dqkv` `[B,T,3C]` from `dout` `[B,T,C]`,
/// the forward's inputs `qkv` and its results `out` `[B,T,C]` and `lse` `[B,NH,T]`. `ws` as for
/// the forward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Elem>(
    dqkv: &mut [T], // [B, T, 3C]
    dout: &[T],     // [B, T, C]
    qkv: &[T],      // [B, T, 3C]
    out: &[T],      // [B, T, C]
    lse: &[f32],    // [B, NH, T]
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    ws: &mut [f32], // [attention_workspace_len::<T>(T, hs, threads)]
) {
    let dims = Dims::new(t, c, nh);
    assert_eq!(dqkv.len(), b * t * 3 * c, "dqkv must be [B,T,3C]");
    assert_eq!(dout.len(), b * t * c, "dout must be [B,T,C]");
    assert_eq!(qkv.len(), b * t * 3 * c, "qkv must be [B,T,3C]");
    assert_eq!(out.len(), b * t * c, "out must be [B,T,C]");
    assert_eq!(lse.len(), b * nh * t, "lse must be [B,NH,T]");
    let threads = rayon::current_num_threads();
    let need = attention_workspace_len::<T>(t, dims.hs, threads);
    assert!(
        ws.len() >= need,
        "attention workspace too small: {} < {need}",
        ws.len()
    );
    let units = b * nh;
    if units == 0 || t == 0 {
        return;
    }
    let per = per_worker_len::<T>(t, dims.hs);
    let workers = threads.min(units);
    let dqkv_p = SyncPtr(dqkv.as_mut_ptr());
    ws[..workers * per]
        .par_chunks_mut(per)
        .enumerate()
        .for_each(|(w, ws_w)| {
            let (lo, hi) = unit_range(w, workers, units);
            for u in lo..hi {
                // SAFETY: see `SyncPtr`: unit u owns these dqkv elements exclusively.
                unsafe { backward_unit(dqkv_p.get(), dout, qkv, out, lse, u, dims, ws_w) };
            }
        });
}

/// Backward of unit `u` = b·NH + h.
///
/// # Safety
/// `dqkv` must point to the `[B,T,3C]` gradient buffer; the caller guarantees no other thread
/// touches unit `u`'s elements of it.
#[allow(clippy::too_many_arguments)]
unsafe fn backward_unit<T: Elem>(
    dqkv: *mut T,
    dout: &[T],  // [B, T, C]
    qkv: &[T],   // [B, T, 3C]
    out: &[T],   // [B, T, C]
    lse: &[f32], // [B, NH, T]
    u: usize,
    d: Dims,
    ws: &mut [f32],
) {
    let Dims {
        t,
        c,
        nh,
        hs,
        scale,
        scale2,
    } = d;
    let (bi, h) = (u / nh, u % nh);
    let ld3 = 3 * c;
    let qoff = bi * t * ld3 + h * hs;
    let ooff = bi * t * c + h * hs;
    let br = BR.min(t);
    let (p, rest) = ws.split_at_mut(br * t); // Pᵀ block [r1, nb]
    let (ds, rest) = rest.split_at_mut(br * t); // dPᵀ, then dSᵀ, block [r1, nb]
    let (kc, rest) = rest.split_at_mut(t * hs); // K [T, hs]
    let (vc, rest) = rest.split_at_mut(t * hs); // V [T, hs]
    let (dk, rest) = rest.split_at_mut(t * hs); // dK accumulator [T, hs]
    let (dv, rest) = rest.split_at_mut(t * hs); // dV accumulator [T, hs]
    let (qb, rest) = rest.split_at_mut(br * hs); // Q block [nb, hs]
    let (gb, rest) = rest.split_at_mut(br * hs); // dO block [nb, hs]
    let (dd, rest) = rest.split_at_mut(br); // D block [nb]
    // T = f32 writes dQ in place; other types compute it in this f32 block [nb, hs].
    let direct = is_f32::<T>();
    let dqbuf = &mut rest[..if direct { 0 } else { br * hs }];
    gather_kv(kc, vc, &qkv[qoff..], t, hs, c);
    dk.fill(0.0);
    dv.fill(0.0);
    let lse_u = &lse[u * t..(u + 1) * t]; // [T]
    // SAFETY: in-bounds offset; this unit's exclusive dQ region [T, hs], row stride 3C.
    let dq = unsafe { dqkv.add(qoff) };
    let mut r0 = 0;
    while r0 < t {
        let r1 = (r0 + BR).min(t);
        let nb = r1 - r0;
        let (p, ds) = (&mut p[..r1 * nb], &mut ds[..r1 * nb]);
        gather_rows(qb, &qkv[qoff + r0 * ld3..], nb, hs, ld3);
        // dO block copy and D[li] = dO[r0+li] · O[r0+li] in one pass over the rows.
        for (li, (g, di)) in gb[..nb * hs]
            .chunks_exact_mut(hs)
            .zip(&mut dd[..nb])
            .enumerate()
        {
            let row = ooff + (r0 + li) * c;
            prefetch(dout, row + PREFETCH_ROWS * c, hs);
            prefetch(out, row + PREFETCH_ROWS * c, hs);
            // The dQ rows this block writes at its end (strided, otherwise cache misses).
            prefetch_ptr(dq.wrapping_add((r0 + li) * ld3), hs);
            widen_into(g, &dout[row..row + hs]);
            *di = out[row..row + hs]
                .iter()
                .zip(&*g)
                .map(|(a, b)| a.to_f32() * b)
                .sum();
        }
        let (qp, gp, kp, vp) = (qb.as_ptr(), gb.as_ptr(), kc.as_ptr(), vc.as_ptr());
        // SAFETY (all products below): operands are ws buffers of the stated shapes with
        // rows < r1 ≤ T, and this unit's dQ rows r0..r1 in dqkv.
        unsafe {
            // S'ᵀ[r1, nb] = scale2 · K[0..r1] Q[r0..r1]ᵀ  (scores in base-2 units)
            mm(
                (r1, nb, hs),
                p.as_mut_ptr(),
                nb,
                false,
                rm(kp, hs),
                tr(qp, hs),
                scale2,
            );
        }
        probs_tile(p, nb, r0, &lse_u[r0..r1]);
        unsafe {
            // dV[0..r1] += Pᵀ dO[r0..r1]        ([r1, nb] · [nb, hs])
            mm(
                (r1, hs, nb),
                dv.as_mut_ptr(),
                hs,
                true,
                rm(p.as_ptr(), nb),
                rm(gp, hs),
                1.0,
            );
            // dPᵀ[r1, nb] = V[0..r1] dO[r0..r1]ᵀ
            mm(
                (r1, nb, hs),
                ds.as_mut_ptr(),
                nb,
                false,
                rm(vp, hs),
                tr(gp, hs),
                1.0,
            );
        }
        ds_tile(ds, p, nb, &dd[..nb], scale);
        unsafe {
            // dQ[r0..r1] = dS K[0..r1]          ([nb, r1] · [r1, hs]; dS = dSᵀ transposed)
            // In place for f32 (T is f32, so the cast is the same memory), else into the
            // f32 block, rounded into `dqkv` right after.
            let (dqb, dqb_ld) = if direct {
                (dq.add(r0 * ld3).cast::<f32>(), ld3)
            } else {
                (dqbuf.as_mut_ptr(), hs)
            };
            mm(
                (nb, hs, r1),
                dqb,
                dqb_ld,
                false,
                tr(ds.as_ptr(), nb),
                rm(kp, hs),
                1.0,
            );
            if !direct {
                narrow_rows(dq.add(r0 * ld3), ld3, &dqbuf[..nb * hs], hs);
            }
            // dK[0..r1] += dSᵀ Q[r0..r1]        ([r1, nb] · [nb, hs])
            mm(
                (r1, hs, nb),
                dk.as_mut_ptr(),
                hs,
                true,
                rm(ds.as_ptr(), nb),
                rm(qp, hs),
                1.0,
            );
        }
        r0 = r1;
    }
    for (i, (dkr, dvr)) in dk.chunks_exact(hs).zip(dv.chunks_exact(hs)).enumerate() {
        // SAFETY: row i < T of this unit's dK / dV regions of dqkv ([T, hs], row stride 3C),
        // which no other thread touches; sources are ws rows of hs elements.
        unsafe {
            let row = dqkv.add(qoff + i * ld3);
            let ahead = row.wrapping_add(PREFETCH_ROWS * ld3);
            if i + PREFETCH_ROWS < t {
                prefetch_ptr(ahead.wrapping_add(c), hs);
                prefetch_ptr(ahead.wrapping_add(2 * c), hs);
            }
            if direct {
                // T is f32: plain copies.
                std::ptr::copy_nonoverlapping(dkr.as_ptr(), row.add(c).cast::<f32>(), hs);
                std::ptr::copy_nonoverlapping(dvr.as_ptr(), row.add(2 * c).cast::<f32>(), hs);
            } else {
                narrow_rows(row.add(c), 0, dkr, hs);
                narrow_rows(row.add(2 * c), 0, dvr, hs);
            }
        }
    }
}

/// Straightforward reference twins (allocating, f64 accumulation, materialised probabilities).
pub mod naive {
    /// f64 forward: returns (out `[B,T,C]`, lse `[B,NH,T]`, att `[B,NH,T,T]` probabilities, zero above
    /// the diagonal).
    pub fn forward_f64(
        qkv: &[f64],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        assert_eq!(qkv.len(), b * t * 3 * c);
        let hs = c / nh;
        let scale = 1.0 / (hs as f64).sqrt();
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        let mut att = vec![0.0; b * nh * t * t];
        for bi in 0..b {
            for h in 0..nh {
                for i in 0..t {
                    let qi = &qkv[(bi * t + i) * 3 * c + h * hs..][..hs];
                    let row = &mut att[((bi * nh + h) * t + i) * t..][..t];
                    let mut mx = f64::NEG_INFINITY;
                    for (j, r) in row.iter_mut().enumerate().take(i + 1) {
                        let kj = &qkv[(bi * t + j) * 3 * c + c + h * hs..][..hs];
                        let s: f64 = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale;
                        *r = s;
                        mx = mx.max(s);
                    }
                    let mut sum = 0.0;
                    for r in row.iter_mut().take(i + 1) {
                        *r = (*r - mx).exp();
                        sum += *r;
                    }
                    for r in row.iter_mut().take(i + 1) {
                        *r /= sum;
                    }
                    lse[(bi * nh + h) * t + i] = mx + sum.ln();
                    let o = &mut out[(bi * t + i) * c + h * hs..][..hs];
                    for (j, &pr) in row.iter().enumerate().take(i + 1) {
                        let vj = &qkv[(bi * t + j) * 3 * c + 2 * c + h * hs..][..hs];
                        for (oo, vv) in o.iter_mut().zip(vj) {
                            *oo += pr * vv;
                        }
                    }
                }
            }
        }
        (out, lse, att)
    }

    /// Naive forward (f32 in/out, f64 inside): writes `out` `[B,T,C]` and `lse` `[B,NH,T]`.
    pub fn attention_forward(
        out: &mut [f32],
        lse: &mut [f32],
        qkv: &[f32],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        let q64: Vec<f64> = qkv.iter().map(|&x| x as f64).collect();
        let (o, l, _) = forward_f64(&q64, b, t, c, nh);
        for (d, s) in out.iter_mut().zip(&o) {
            *d = *s as f32;
        }
        for (d, s) in lse.iter_mut().zip(&l) {
            *d = *s as f32;
        }
    }

    /// f64 backward from scratch (recomputes the probabilities from `qkv`): returns dqkv
    /// `[B,T,3C]` for upstream gradient `dout` `[B,T,C]`.
    pub fn backward_f64(
        dout: &[f64],
        qkv: &[f64],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Vec<f64> {
        let hs = c / nh;
        let scale = 1.0 / (hs as f64).sqrt();
        let (_, _, att) = forward_f64(qkv, b, t, c, nh);
        let mut dqkv = vec![0.0; b * t * 3 * c];
        let mut dp = vec![0.0; t];
        for bi in 0..b {
            for h in 0..nh {
                for i in 0..t {
                    let p = &att[((bi * nh + h) * t + i) * t..][..t];
                    let doi = &dout[(bi * t + i) * c + h * hs..][..hs];
                    // dP[j] = dO_i · V_j ; dV_j += P[j] dO_i
                    for j in 0..=i {
                        let vrow = (bi * t + j) * 3 * c + 2 * c + h * hs;
                        dp[j] = (0..hs).map(|e| doi[e] * qkv[vrow + e]).sum();
                        for e in 0..hs {
                            dqkv[vrow + e] += p[j] * doi[e];
                        }
                    }
                    // softmax backward: dS[j] = P[j] (dP[j] - Σ_k P[k] dP[k])
                    let dot: f64 = (0..=i).map(|j| p[j] * dp[j]).sum();
                    let qrow = (bi * t + i) * 3 * c + h * hs;
                    for j in 0..=i {
                        let ds = p[j] * (dp[j] - dot) * scale;
                        let krow = (bi * t + j) * 3 * c + c + h * hs;
                        for e in 0..hs {
                            dqkv[qrow + e] += ds * qkv[krow + e];
                            dqkv[krow + e] += ds * qkv[qrow + e];
                        }
                    }
                }
            }
        }
        dqkv
    }

    /// Naive backward (f32 in/out, f64 inside): overwrites `dqkv` `[B,T,3C]`.
    pub fn attention_backward(
        dqkv: &mut [f32],
        dout: &[f32],
        qkv: &[f32],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        let d64: Vec<f64> = dout.iter().map(|&x| x as f64).collect();
        let q64: Vec<f64> = qkv.iter().map(|&x| x as f64).collect();
        let g = backward_f64(&d64, &q64, b, t, c, nh);
        assert_eq!(dqkv.len(), g.len());
        for (d, s) in dqkv.iter_mut().zip(&g) {
            *d = *s as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::conformance::{self, Case, Out, Tol, check_stored_as, isas_here, stored};
    use super::super::features::Isa;
    use super::super::reduce::testutil::{bits, narrow_vec, widen_vec};
    use super::*;
    use half::{bf16, f16};

    /// Deterministic pseudo-random values in [-amp, amp] (xorshift64*).
    fn rand_vec(n: usize, seed: u64, amp: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 bits
                (r as f32 / (1u64 << 23) as f32 - 1.0) * amp
            })
            .collect()
    }

    fn ws_for<T: Elem>(t: usize, c: usize, nh: usize) -> Vec<f32> {
        let threads = rayon::current_num_threads();
        vec![f32::NAN; attention_workspace_len::<T>(t, c / nh, threads)]
    }

    fn fast_fwd<T: Elem>(qkv: &[T], b: usize, t: usize, c: usize, nh: usize) -> (Vec<T>, Vec<f32>) {
        // NaN-filled outputs and workspace: any element not written shows up.
        let mut out = vec![T::from_f32(f32::NAN); b * t * c];
        let mut lse = vec![f32::NAN; b * nh * t];
        let mut ws = ws_for::<T>(t, c, nh);
        attention_forward(&mut out, &mut lse, qkv, b, t, c, nh, &mut ws);
        (out, lse)
    }

    #[allow(clippy::too_many_arguments)]
    fn fast_bwd<T: Elem>(
        dout: &[T],
        qkv: &[T],
        out: &[T],
        lse: &[f32],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Vec<T> {
        let mut dqkv = vec![T::from_f32(f32::NAN); b * t * 3 * c];
        let mut ws = ws_for::<T>(t, c, nh);
        attention_backward(&mut dqkv, dout, qkv, out, lse, b, t, c, nh, &mut ws);
        dqkv
    }

    /// |got - want| ≤ rtol · (|want| + 0.1 · max|want| + tiny), element-wise.
    fn assert_close(name: &str, got: &[f32], want: &[f32], rtol: f32) {
        assert_eq!(got.len(), want.len(), "{name}: length");
        let maxabs = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let tol = rtol * (w.abs() + 0.1 * maxabs + 1e-12);
            assert!(
                (g - w).abs() <= tol,
                "{name}[{i}]: got {g}, want {w} (tol {tol})"
            );
        }
    }

    /// (B, T, C, NH): single position, odd head sizes, several row blocks with a ragged tail,
    /// exact block multiple, head size not a multiple of 16.
    const SHAPES: &[(usize, usize, usize, usize)] = &[
        (1, 1, 4, 1),
        (2, 7, 9, 3),
        (1, 5, 6, 2),
        (2, 70, 40, 2),
        (1, 130, 60, 3),
        (3, 64, 32, 4),
        (1, 200, 24, 1),
    ];

    #[test]
    fn exp2_nonpos_matches_std() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x <= 0.0 {
            let (a, b) = (exp2_nonpos(x) as f64, (x as f64).exp2());
            worst = worst.max(((a - b) / b).abs());
            x += 0.000_731;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(exp2_nonpos(0.0), 1.0);
        assert_eq!(exp2_nonpos(-3.0), 0.125);
        assert_eq!(exp2_nonpos(-126.0), f32::MIN_POSITIVE);
        assert_eq!(exp2_nonpos(-126.5), 0.0);
        assert_eq!(exp2_nonpos(f32::NEG_INFINITY), 0.0);
        assert!(exp2_nonpos(f32::NAN).is_nan());
    }

    #[test]
    fn forward_matches_naive() {
        for (si, &(b, t, c, nh)) in SHAPES.iter().enumerate() {
            let qkv = rand_vec(b * t * 3 * c, 11 + si as u64, 2.0);
            let (out, lse) = fast_fwd(&qkv, b, t, c, nh);
            let mut out_n = vec![0.0; b * t * c];
            let mut lse_n = vec![0.0; b * nh * t];
            naive::attention_forward(&mut out_n, &mut lse_n, &qkv, b, t, c, nh);
            let tag = format!("{b}x{t}x{c}/{nh}");
            assert_close(&format!("out {tag}"), &out, &out_n, 1e-5);
            assert_close(&format!("lse {tag}"), &lse, &lse_n, 1e-5);
        }
    }

    #[test]
    fn backward_matches_naive() {
        for (si, &(b, t, c, nh)) in SHAPES.iter().enumerate() {
            let qkv = rand_vec(b * t * 3 * c, 101 + si as u64, 2.0);
            let dout = rand_vec(b * t * c, 202 + si as u64, 1.0);
            let (out, lse) = fast_fwd(&qkv, b, t, c, nh);
            let dqkv = fast_bwd(&dout, &qkv, &out, &lse, b, t, c, nh);
            let mut dqkv_n = vec![0.0; b * t * 3 * c];
            naive::attention_backward(&mut dqkv_n, &dout, &qkv, b, t, c, nh);
            assert_close(&format!("dqkv {b}x{t}x{c}/{nh}"), &dqkv, &dqkv_n, 1e-5);
        }
    }

    /// Very peaky softmax with large offsets (scores of several hundred): exercises exp
    /// underflow to exact zeros and the max subtraction (a wrong max overflows or underflows
    /// here), in both the full-width and the ragged-block paths. Rounding of scores that large
    /// costs accuracy, so the tolerance is looser.
    #[test]
    fn peaky_scores_match_naive() {
        for (si, &(b, t, c, nh)) in [(2, 70, 16, 2), (1, 9, 6, 1)].iter().enumerate() {
            let mut qkv = rand_vec(b * t * 3 * c, 505 + si as u64, 12.0);
            // A common offset on every key shifts each score row by q_i·40 (hundreds), which
            // the softmax must cancel exactly through its max subtraction.
            for row in qkv.chunks_exact_mut(3 * c) {
                row[c..2 * c].iter_mut().for_each(|k| *k += 40.0);
            }
            let dout = rand_vec(b * t * c, 606 + si as u64, 1.0);
            let (out, lse) = fast_fwd(&qkv, b, t, c, nh);
            let mut out_n = vec![0.0; b * t * c];
            let mut lse_n = vec![0.0; b * nh * t];
            naive::attention_forward(&mut out_n, &mut lse_n, &qkv, b, t, c, nh);
            // Probabilities below 2^-126 (flushed to 0 by the fast kernel) must occur.
            let q64: Vec<f64> = qkv.iter().map(|&x| x as f64).collect();
            let (_, _, att) = naive::forward_f64(&q64, b, t, c, nh);
            let tiny = att
                .iter()
                .filter(|&&p| p > 0.0 && p < 2f64.powi(-126))
                .count();
            assert!(
                tiny > t,
                "not peaky enough: {tiny} probabilities below 2^-126"
            );
            let tag = format!("{b}x{t}x{c}/{nh}");
            assert_close(&format!("peaky out {tag}"), &out, &out_n, 5e-4);
            assert_close(&format!("peaky lse {tag}"), &lse, &lse_n, 1e-5);
            let dqkv = fast_bwd(&dout, &qkv, &out, &lse, b, t, c, nh);
            let mut dqkv_n = vec![0.0; b * t * 3 * c];
            naive::attention_backward(&mut dqkv_n, &dout, &qkv, b, t, c, nh);
            assert_close(&format!("peaky dqkv {tag}"), &dqkv, &dqkv_n, 5e-4);
        }
    }

    /// Both backwards against central differences of L = Σ out ∘ R (f64 naive forward).
    #[test]
    fn backward_matches_finite_differences() {
        for (si, &(b, t, c, nh)) in [(1, 1, 4, 1), (2, 5, 6, 3), (1, 9, 10, 2)]
            .iter()
            .enumerate()
        {
            let qkv = rand_vec(b * t * 3 * c, 303 + si as u64, 1.5);
            let r = rand_vec(b * t * c, 404 + si as u64, 1.0);
            let q64: Vec<f64> = qkv.iter().map(|&x| x as f64).collect();
            let r64: Vec<f64> = r.iter().map(|&x| x as f64).collect();
            let loss = |x: &[f64]| -> f64 {
                let (o, _, _) = naive::forward_f64(x, b, t, c, nh);
                o.iter().zip(&r64).map(|(a, b)| a * b).sum()
            };
            let eps = 1e-5;
            let mut x = q64.clone();
            let num: Vec<f64> = (0..x.len())
                .map(|i| {
                    let x0 = x[i];
                    x[i] = x0 + eps;
                    let lp = loss(&x);
                    x[i] = x0 - eps;
                    let lm = loss(&x);
                    x[i] = x0;
                    (lp - lm) / (2.0 * eps)
                })
                .collect();
            let maxabs = num.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(maxabs > 1e-3, "degenerate test: gradient is ~0");
            let ana64 = naive::backward_f64(&r64, &q64, b, t, c, nh);
            for (i, (&a, &n)) in ana64.iter().zip(&num).enumerate() {
                assert!(
                    (a - n).abs() <= 1e-7 * (1.0 + maxabs),
                    "naive d[{i}]: {a} vs fd {n}"
                );
            }
            let (out, lse) = fast_fwd(&qkv, b, t, c, nh);
            let fast = fast_bwd(&r, &qkv, &out, &lse, b, t, c, nh);
            for (i, (&a, &n)) in fast.iter().zip(&num).enumerate() {
                let a = a as f64;
                assert!(
                    (a - n).abs() <= 2e-5 * (n.abs() + 0.1 * maxabs),
                    "fast d[{i}]: {a} vs fd {n} ({b}x{t}x{c}/{nh})"
                );
            }
        }
    }

    /// Forward and backward outputs of one run with storage type `T`, as bit patterns.
    fn run_bits<T: Elem>(b: usize, t: usize, c: usize, nh: usize, seed: u64) -> [Vec<u32>; 3] {
        let qkv: Vec<T> = narrow_vec(&rand_vec(b * t * 3 * c, seed, 2.0));
        let dout: Vec<T> = narrow_vec(&rand_vec(b * t * c, seed + 1, 1.0));
        let (out, lse) = fast_fwd(&qkv, b, t, c, nh);
        let dqkv = fast_bwd(&dout, &qkv, &out, &lse, b, t, c, nh);
        [bits(&out), bits(&lse), bits(&dqkv)]
    }

    /// Bitwise identical results on repeated runs and for 1, 2 and 3 worker threads, including
    /// more threads than (batch, head) units.
    #[test]
    fn deterministic_across_runs_and_thread_counts() {
        for (b, t, c, nh) in [(2, 77, 36, 3), (1, 70, 8, 1)] {
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    (
                        run_bits::<f32>(b, t, c, nh, 7),
                        run_bits::<bf16>(b, t, c, nh, 7),
                        run_bits::<f16>(b, t, c, nh, 7),
                    )
                })
            };
            let reference = run(2);
            for threads in [2, 1, 3, 2] {
                assert!(
                    run(threads) == reference,
                    "{b}x{t}x{c}/{nh}: {threads} threads differ from 2"
                );
            }
        }
    }

    /// f32 and bf16 forward and backward outputs (bit patterns) on fixed inputs.
    fn isa_run() -> ([Vec<u32>; 3], [Vec<u32>; 3]) {
        (
            run_bits::<f32>(2, 70, 12, 2, 9),
            run_bits::<bf16>(2, 70, 12, 2, 9),
        )
    }

    /// The element-wise passes give bit-identical results on every instruction set this CPU
    /// has.
    #[test]
    fn isa_invariant() {
        conformance::isa_invariant(&isas_here(), isa_run, "attention");
    }

    /// The AVX-512 variants against the baseline (fails on a CPU without AVX-512F).
    #[test]
    #[ignore = "needs AVX-512F"]
    fn isa_invariant_avx512() {
        conformance::isa_invariant(&[Isa::Avx512], isa_run, "attention");
    }

    #[test]
    #[should_panic(expected = "workspace too small")]
    fn rejects_small_workspace() {
        let (b, t, c, nh) = (1, 8, 8, 2);
        let qkv = rand_vec(b * t * 3 * c, 1, 1.0);
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        let mut ws =
            vec![0.0; attention_workspace_len::<f32>(t, c / nh, rayon::current_num_threads()) - 1];
        attention_forward(&mut out, &mut lse, &qkv, b, t, c, nh, &mut ws);
    }

    /// Narrow types need one more [min(64,T), hs] block per worker, and check for it.
    #[test]
    #[should_panic(expected = "workspace too small")]
    fn rejects_f32_sized_workspace_for_bf16() {
        let (b, t, c, nh) = (1, 8, 8, 2);
        let threads = rayon::current_num_threads();
        let len32 = attention_workspace_len::<f32>(t, c / nh, threads);
        let len16 = attention_workspace_len::<bf16>(t, c / nh, threads);
        assert_eq!(len16, len32 + threads * t * (c / nh));
        assert_eq!(len16, attention_workspace_len::<f16>(t, c / nh, threads));
        let qkv: Vec<bf16> = narrow_vec(&rand_vec(b * t * 3 * c, 1, 1.0));
        let mut out = vec![bf16::ZERO; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        let mut ws = vec![0.0; len32];
        attention_forward(&mut out, &mut lse, &qkv, b, t, c, nh, &mut ws);
    }

    /// bf16 / f16 storage: forward and backward against the f32 kernel on the widened inputs
    /// (the backward given the same rounded `out` and the same `lse`). All math is f32 in both,
    /// so the narrow results are the f32 ones rounded once, up to f32 rounding noise from the
    /// products running on contiguous copies instead of in place: within half a unit in the
    /// last place of `T` (`half_ulp`) plus 1e-5 of the largest magnitude.
    struct Narrow {
        shape: (usize, usize, usize, usize), // (B, T, C, NH)
        seed: u64,
        half_ulp: f32,
    }

    impl Case for Narrow {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let ((b, t, c, nh), si) = (self.shape, self.seed);
            let qkv32 = rand_vec(b * t * 3 * c, 11 + si, 2.0);
            let qkv: Vec<S> = stored::<T, S>(&qkv32);
            let dout: Vec<S> = stored::<T, S>(&rand_vec(b * t * c, 202 + si, 1.0));
            let (out, lse) = fast_fwd(&qkv, b, t, c, nh);
            // Both backwards take the narrow forward's results: `out` as stored in `T`, `lse`.
            let (out_t, lse_t) = fast_fwd(&stored::<T, T>(&qkv32), b, t, c, nh);
            let out_t: Vec<S> = stored::<T, S>(&widen_vec(&out_t));
            let dqkv = fast_bwd(&dout, &qkv, &out_t, &lse_t, b, t, c, nh);
            let tol = |rel| Tol {
                rel,
                of_max: 1e-5,
                abs: 1e-7,
            };
            vec![
                Out::stored("out", &out).close(tol(self.half_ulp)),
                Out::f32("lse", &lse).close(tol(1e-6)),
                Out::stored("dqkv", &dqkv).close(tol(self.half_ulp)),
            ]
        }
    }

    fn narrow_matches_f32<T: Elem>(half_ulp: f32) {
        for (si, &shape) in SHAPES.iter().enumerate() {
            let case = Narrow {
                shape,
                seed: si as u64,
                half_ulp,
            };
            let (b, t, c, nh) = shape;
            let (_, want) = check_stored_as::<T>(&case, &format!("attention {b}x{t}x{c}/{nh}"));
            for w in want {
                let maxabs = w.f32s().iter().fold(0.0f32, |m, w| m.max(w.abs()));
                assert!(maxabs > 0.1, "{} {b}x{t}x{c}/{nh}: degenerate", w.name);
            }
        }
    }

    #[test]
    fn bf16_matches_f32() {
        narrow_matches_f32::<bf16>(2f32.powi(-8));
    }

    #[test]
    fn f16_matches_f32() {
        narrow_matches_f32::<f16>(2f32.powi(-11));
    }

    /// A NaN in one key of batch 0, head 0, position 5: queries of that head from position 5
    /// on become NaN, everything else stays finite; the backward does not panic and keeps
    /// batch 1 finite.
    #[test]
    fn non_finite_stays_in_its_unit() {
        let (b, t, c, nh) = (2, 70, 8, 2);
        let hs = c / nh;
        let mut qkv: Vec<bf16> = narrow_vec(&rand_vec(b * t * 3 * c, 3, 1.0));
        qkv[5 * 3 * c + c + 1] = bf16::NAN; // K of (batch 0, position 5), head 0
        let dout: Vec<bf16> = narrow_vec(&rand_vec(b * t * c, 4, 1.0));
        let (out, lse) = fast_fwd(&qkv, b, t, c, nh);
        for (r, row) in out.chunks_exact(c).enumerate() {
            let (head0, head1) = row.split_at(hs);
            let poisoned = r >= 5 && r < t; // batch 0 rows 5.. of head 0
            assert!(head0.iter().all(|v| v.is_nan() == poisoned), "row {r}");
            assert!(head1.iter().all(|v| v.is_finite()), "row {r} head 1");
        }
        assert_eq!(lse.iter().filter(|v| v.is_nan()).count(), t - 5);
        let dqkv = fast_bwd(&dout, &qkv, &out, &lse, b, t, c, nh);
        assert!(dqkv[t * 3 * c..].iter().all(|v| v.is_finite()), "batch 1");
    }
}
