//! Causal self-attention with grouped-query attention (GQA), forward and backward, without
//! keeping the attention matrix (FlashAttention-style recomputation).
//!
//! Shapes: NH query heads and NKV key/value heads (NKV divides NH; g = NH/NKV query heads per
//! KV head), each of `hd` channels (an explicit head size: Llama's `head_dim` need not be
//! width/NH). `qkv` is `[B, T, (NH + 2·NKV)·hd]` row-major; for row (b, t) query head h is
//! channels `h·hd..(h+1)·hd`, key head j channels `NH·hd + j·hd..` and value head j channels
//! `(NH+NKV)·hd + j·hd..` (`hd` each). KV head j serves query heads j·g … j·g+g−1
//! (repeat-interleave, as transformers' `repeat_kv`, not tiling). `out` is `[B, T, NH·hd]` with
//! head h in channels `h·hd..(h+1)·hd`; `dqkv` is laid out like `qkv`. Multi-head attention is
//! NKV = NH (GPT-2: `[B, T, 3C]`, hd = C/NH). Scores are scaled by 1/√scale_dim (hd, or
//! Gemma 3's `query_pre_attn_scalar`); query position i attends to key positions 0..=i, or, in a packed row, to its own example's keys only.
//!
//! Packed rows (sequence packing): several examples share a row of T tokens, and the optional
//! positions `pos` `[B, T]` (u32) give each token's position in its example: `pos[b, 0] = 0`,
//! then each next position is 0 (an example starts there) or the previous one plus 1 (checked).
//! Query i of row b attends to keys `i - pos[b, i] ..= i`: its example, causally. `None` is one
//! example per row (`pos[b, i] = i`), and identity positions give bitwise its results.
//!
//! Sliding window (Mistral's `sliding_window`, transformers' `sliding_window_overlay`): with
//! `window` W, query i sees only the last W keys, itself included, `i - W < j`, on top of the
//! above. Query i's first key is therefore `lo(i) = max(i - pos[b, i], i + 1 - W)` (each term
//! non-decreasing in i) and its keys `lo(i) ..= i`; `None` (or W ≥ T) is no window.
//!
//! The work is split into B·NKV independent (batch, KV head) units. Per unit, K and V of its
//! KV head are first copied once into contiguous `[T, hd]` scratch (with software prefetch: rows
//! several KiB apart defeat the hardware prefetchers, and the products run faster on contiguous
//! operands); then the unit's g query heads are processed in order, h = j·g … j·g+g−1, each
//! exactly as a multi-head kernel processes one head: the queries in row blocks of `BR` = 64
//! rows `r0..r1` (nb = r1 - r0 rows). A block only needs keys k0..r1 (nk = r1 - k0 of them),
//! where `k0 = lo(r0)` is its first query's first key (the start of its example, or of its
//! window; 0 without either; first keys never decrease along a row): the masked upper triangle
//! is skipped except inside the diagonal nb×nb square, and so are the keys of earlier examples
//! and the keys that slid out of the window, except those that later queries of the block still
//! see. So a block has at most nb + W - 1 keys, and the work is O(T·W), not O(T²). Masked
//! entries are computed and then set to exactly 0 (never through the exponential). Score tiles
//! are stored transposed, Sᵀ `[nk, nb]` (key index j major, query index li contiguous), which
//! suits `gemm` and turns the per-query reductions of the element-wise passes into lane-wise
//! vector ops.
//!
//! A block whose queries all belong to one example is plain causal attention on the keys
//! shifted by k0 (the same code, on K and V rows k0..r1, diagonal square at rows r0 - k0..);
//! for k0 = 0 it is bitwise the unpacked block. A block whose queries straddle an example
//! start, or whose window slides within the block, masks per lane instead: lane li sees tile
//! rows `lo(r0 + li) - k0 ..= r0 + li - k0` (first keys non-decreasing in li, so each tile
//! row's unmasked lanes are one range) on the dynamic-width path. Every query sees at least itself, so no lane is ever all masked. A full
//! block (nb = 64) inside one example whose window has slid by one key per query (the band
//! case: `lo(r0 + li) = k0 + li`, every block past the first W queries of a windowed row) has
//! fixed-size rows again: tile rows 0..64 are the window's lower-left triangle (lane li sees
//! row j iff li ≤ j), rows 64..W-1 are whole, and the last 64 the causal diagonal square; it
//! takes this fixed path when W > 64 (the triangles do not overlap), the dynamic one otherwise.
//!
//! Scores are kept in base-2 units, S' = log2(e) · S (the factor is folded into the product's
//! scale), so the softmax needs 2^x, which is cheaper than e^x. Forward, per query head and block:
//!   S'ᵀ = scale · log2(e) · K[k0..r1] Q[r0..r1]ᵀ   `[nk, nb]`
//!   `m[li] = max_j S', Pᵀ = 2^(S'ᵀ - m), l[li] = Σ_j P    (masked entries set to 0)`
//!   `O[r0..r1] = P V[k0..r1], then row li scaled by 1/l[li]  (written in place into out)`
//!   `lse[r0+li] = (m[li] + log2 l[li]) · ln 2     (natural log-sum-exp of the scores S)`
//! Only `out` and `lse` (`[B, NH, T]`) are kept for backward, never the `[B, NH, T, T]` matrix.
//!
//! Backward, per unit: K and V copied as in the forward, and dK and dV accumulated in contiguous
//! `[T, hd]` scratch zeroed once per unit, over its g query heads in order and, per head, over
//! the blocks in order (so a KV head's gradient is the sum over the query heads it serves), then
//! rounded / copied into `dqkv` once at the end. Per query head, Q and dO are copied per block;
//! per block, with `D[i] = Σ_c dO[i,c] O[i,c]` (= `Σ_j P[i,j] dP[i,j]`):
//!   Pᵀ  = 2^(S'ᵀ - log2(e) · lse)               `[nk, nb]` (recomputed; masked entries 0)
//!   dV[k0..r1] += Pᵀ dO[r0..r1]
//!   dPᵀ = V[k0..r1] dO[r0..r1]ᵀ                  `[nk, nb]`
//!   dSᵀ = scale · Pᵀ ∘ (dPᵀ - D)                 (the score scale folded in here)
//!   dQ[r0..r1] = dS K[k0..r1]                     (written in place into `dqkv`)
//!   dK[k0..r1] += dSᵀ Q[r0..r1]
//!
//! With NKV = NH (g = 1) this is operation for operation the multi-head kernel: one head per
//! unit, the same products in the same order, so results are bitwise those of multi-head
//! attention.
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
//! within one example use fixed-size rows so those loops unroll completely.
//!
//! Storage type `T` ([`Elem`]: f32, bf16, f16) for `qkv`, `out`, `dout` and `dqkv`; `lse` and
//! the workspace are f32, and all the math above runs in f32. For f32, Q, O, dO and dQ are
//! read and written in place (strided) as described. For a narrower `T` every operand a unit
//! reads is widened into the worker's workspace first (K and V as above, and a Q block of
//! `[nb, hd]`, also in the forward), and the O and dQ blocks and the dK, dV accumulators are
//! computed in f32 workspace and rounded once into `out` / `dqkv`; this costs one more
//! [min(64,T), hd] block per worker ([`attention_workspace_len`]).

use super::features::multiversion;
use crate::dtype::{Elem, is_f32};
use gemm::{Parallelism, gemm};
use rayon::prelude::*;

/// Query rows per block.
const BR: usize = 64;

/// The most keys one query block's tile holds, nk ≤ `tile_keys(t, w)`: all T without a window
/// (the last block's), else at most `nb + W - 1` (the block's first query sees W keys, each
/// next one a key more), and never more than T.
fn tile_keys(t: usize, window: Option<usize>) -> usize {
    let br = BR.min(t);
    window.map_or(t, |w| t.min((br + w).saturating_sub(1)))
}

/// Workspace elements (f32) per worker (backward needs the most):
/// Pᵀ and dSᵀ tiles `[br, nk]` each (nk = `tile_keys`: T, or nb + W - 1 with a window W),
/// K and V copies `[T, hd]` each, dK and dV accumulators `[T, hd]`
/// each, Q and dO block copies `[br, hd]` each, D [br], and for a storage type other than f32 a
/// dQ block `[br, hd]`. The forward uses less: tile, K, V, m and l [br] each, and for other
/// types Q and O blocks `[br, hd]` each. Independent of the number of query heads per KV head:
/// a unit reuses the same buffers for each of its query heads.
fn per_worker_len<T: Elem>(t: usize, hd: usize, window: Option<usize>) -> usize {
    let br = BR.min(t);
    let narrow = if is_f32::<T>() { 0 } else { br * hd };
    2 * br * tile_keys(t, window) + 4 * t * hd + 2 * br * hd + 2 * br + narrow
}

/// Workspace elements (f32) the kernels need for `threads` workers with storage type `T`:
/// per worker two score tiles of [min(64,T), nk] (nk = T, or with a sliding `window` W
/// min(T, min(64,T) + W - 1): the tiles follow the window, not the sequence), four `[T, hd]`
/// buffers (K, V copies; dK, dV accumulators) and a few [min(64,T), hd] / [min(64,T)] block
/// buffers (one more [min(64,T), hd] block for types other than f32). `hd` is the head size;
/// the numbers of query and KV heads do not enter.
pub fn attention_workspace_len<T: Elem>(
    t: usize,
    hd: usize,
    window: Option<usize>,
    threads: usize,
) -> usize {
    threads.max(1) * per_worker_len::<T>(t, hd, window)
}

/// Raw pointer that can be shared between rayon workers.
///
/// SAFETY (of every use in this file): the (batch, KV head) units write disjoint elements of
/// the destination buffers. Unit (b, j) serves query heads h = j·g … j·g+g−1 and writes only
/// rows b·T..(b+1)·T of `out` and `dqkv`, and in them only: the columns h·hd..(h+1)·hd of its g
/// query heads (`out`, and the q part of `dqkv`), the columns of key head j (NH·hd + j·hd..) and
/// of value head j ((NH+NKV)·hd + j·hd..) of `dqkv`, and the `lse` rows `lse[(b·NH+h)·T..][..T]`
/// of its g query heads. Query heads belong to exactly one KV head and KV heads to exactly one
/// unit, so these sets are disjoint between units. Each unit is processed by exactly one worker,
/// and nothing reads those elements concurrently, so no two threads ever touch the same element.
/// The pointers stay valid because the borrowed slices outlive the rayon scope.
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
    /// Query heads.
    nh: usize,
    /// Key / value heads.
    nkv: usize,
    /// Query heads per KV head, NH/NKV.
    g: usize,
    /// Head size.
    hd: usize,
    /// Row width of `qkv` / `dqkv`, (NH + 2·NKV)·hd.
    ld: usize,
    /// Row width of `out` / `dout`, NH·hd.
    co: usize,
    /// 1/√scale_dim (the head size, or Gemma 3's `query_pre_attn_scalar`): scores are
    /// scale · q·k.
    scale: f32,
    /// scale · log2(e): scores in base-2 units, the exponent `exp2_nonpos` takes.
    scale2: f32,
    /// The sliding window W (keys a query sees at most, itself included); `usize::MAX` for
    /// none.
    w: usize,
    /// Key rows of the score tiles, `tile_keys(t, window)`.
    nk_max: usize,
}

impl Dims {
    fn new(
        t: usize,
        (nh, nkv, hd): (usize, usize, usize),
        scale_dim: f32,
        window: Option<usize>,
    ) -> Self {
        assert!(
            nh > 0 && nkv > 0 && nh.is_multiple_of(nkv),
            "NH={nh} must be a positive multiple of NKV={nkv}"
        );
        assert!(hd > 0, "head size hd must be positive");
        assert!(window != Some(0), "a sliding window must be at least 1 key");
        Dims {
            t,
            nh,
            nkv,
            g: nh / nkv,
            hd,
            ld: (nh + 2 * nkv) * hd,
            co: nh * hd,
            scale: 1.0 / scale_dim.sqrt(),
            scale2: std::f32::consts::LOG2_E / scale_dim.sqrt(),
            w: window.unwrap_or(usize::MAX),
            nk_max: tile_keys(t, window),
        }
    }

    /// Offset, within a row of `qkv`, of key head 0, NH·hd.
    fn k0(&self) -> usize {
        self.nh * self.hd
    }

    /// Offset, within a row of `qkv`, of value head 0, (NH + NKV)·hd.
    fn v0(&self) -> usize {
        (self.nh + self.nkv) * self.hd
    }
}

/// Contiguous unit range [lo, hi) of worker `w` out of `workers` for `units` units.
fn unit_range(w: usize, workers: usize, units: usize) -> (usize, usize) {
    (w * units / workers, (w + 1) * units / workers)
}

/// Checks positions `pos` `[B, T]`: per row, `pos[0] = 0` and each next position is either 0
/// (an example starts) or the previous one plus 1. Every key range below relies on it.
fn check_positions(pos: &[u32], b: usize, t: usize) {
    assert_eq!(pos.len(), b * t, "pos must be [B,T]");
    for (bi, row) in pos.chunks_exact(t.max(1)).enumerate() {
        let mut prev = None;
        for (i, &p) in row.iter().enumerate() {
            assert!(
                p == 0 || prev.is_some_and(|q: u32| p == q.wrapping_add(1)),
                "pos[{bi}, {i}] = {p}: positions must start at 0 and either restart at 0 or \
                 count up by 1"
            );
            prev = Some(p);
        }
    }
}

/// First key query `i` of a row with positions `pos` `[T]` (None: plain causal) attends to
/// under a sliding window of `w` keys (`usize::MAX`: none): `max(i - pos[i], i + 1 - w)`, the
/// later of its example's start and its window's. Non-decreasing in i (positions checked).
#[inline(always)]
fn first_key(pos: Option<&[u32]>, w: usize, i: usize) -> usize {
    let example = pos.map_or(0, |p| i - p[i] as usize);
    example.max((i + 1).saturating_sub(w))
}

/// How a query block's tile is masked beyond the causal diagonal square.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum BlockMask {
    /// Every query sees keys from k0 on: plain causal attention on keys shifted by k0.
    Causal,
    /// A full block (nb = BR) whose lane li's first key is k0 + li, with more than BR tile
    /// rows before the diagonal square (r0 - k0 ≥ BR): the window's lower-left triangle in
    /// tile rows 0..BR, whole rows, then the diagonal square; fixed-size rows.
    Band,
    /// Per-lane first keys `lb` (non-decreasing), on the dynamic-width path.
    Lanes,
}

/// Keys of query block `r0..r1` of one row whose positions are `pos` `[T]` (None: plain causal,
/// `pos[i] = i`) under a sliding window of `w` keys (`usize::MAX`: none). Returns `k0 =
/// first_key(r0)`, the first key of the block's first query (first keys never decrease, so the
/// block's keys are `k0..r1`), and how the block is masked. Unless [`BlockMask::Causal`], `lb`
/// holds lane li's first key relative to k0, `lb[li] = first_key(r0 + li) - k0`
/// (non-decreasing in li). A block whose queries share their first key is plain causal
/// attention on keys shifted by k0.
#[inline]
fn block_keys(
    pos: Option<&[u32]>,
    w: usize,
    r0: usize,
    r1: usize,
    lb: &mut [usize; BR],
) -> (usize, BlockMask) {
    let k0 = first_key(pos, w, r0);
    if first_key(pos, w, r1 - 1) == k0 {
        return (k0, BlockMask::Causal);
    }
    let nb = r1 - r0;
    for (li, l) in lb[..nb].iter_mut().enumerate() {
        *l = first_key(pos, w, r0 + li) - k0;
    }
    let band = nb == BR && r0 - k0 >= BR && lb.iter().enumerate().all(|(li, &l)| l == li);
    (
        k0,
        if band {
            BlockMask::Band
        } else {
            BlockMask::Lanes
        },
    )
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

/// Copies `rows` rows of `hd` elements from `src` (row stride `ld`) into contiguous `dst`,
/// widened to f32.
fn gather_rows<T: Elem>(dst: &mut [f32], src: &[T], rows: usize, hd: usize, ld: usize) {
    for (i, d) in dst[..rows * hd].chunks_exact_mut(hd).enumerate() {
        prefetch(src, (i + PREFETCH_ROWS) * ld, hd);
        widen_into(d, &src[i * ld..i * ld + hd]);
    }
}

/// Copies one unit's K and V (`[T, hd]` each, at offsets `ko` and `vo` of each row of `src`,
/// row stride `ld`) into contiguous f32 `kc` and `vc` in a single pass over the rows.
fn gather_kv<T: Elem>(
    (kc, vc): (&mut [f32], &mut [f32]),
    src: &[T],
    (t, hd, ld): (usize, usize, usize),
    (ko, vo): (usize, usize),
) {
    let kv = kc[..t * hd]
        .chunks_exact_mut(hd)
        .zip(vc[..t * hd].chunks_exact_mut(hd));
    for (i, (kd, vd)) in kv.enumerate() {
        let ahead = (i + PREFETCH_ROWS) * ld;
        prefetch(src, ahead + ko, hd);
        prefetch(src, ahead + vo, hd);
        let row = &src[i * ld..];
        widen_into(kd, &row[ko..ko + hd]);
        widen_into(vd, &row[vo..vo + hd]);
    }
}

/// Rounds the f32 rows `src` `[rows, hd]` (contiguous) into `rows` rows of `hd` elements at `dst`
/// (row stride `ld`).
///
/// # Safety
/// `dst` must be valid for writes of every addressed element, and nothing else may access
/// them during the call; `src` must not overlap them.
#[inline(always)]
unsafe fn narrow_rows<T: Elem>(dst: *mut T, ld: usize, src: &[f32], hd: usize) {
    for (i, s) in src.chunks_exact(hd).enumerate() {
        // SAFETY: row i of the caller's destination, exclusively ours.
        let d = unsafe { std::slice::from_raw_parts_mut(dst.add(i * ld), hd) };
        for (d, &s) in d.iter_mut().zip(s) {
            *d = T::from_f32(s);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise passes over transposed tiles [nk, nb]: tile row j is key position k0 + j, lane
// li is query position k0 + r0 + li (the callers pass r0 relative to the block's first key k0;
// k0 = 0 without positions); entry (j, li) is unmasked iff j ≤ r0 + li, i.e. li ≥ j - r0.

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

/// Forward softmax, in place on base-2 scores S'ᵀ `[nk, nb]` (nk = r0 + nb) → unnormalised
/// Pᵀ = 2^(S' - m) (masked entries 0). Writes the per-query max `m` [nb] and sum `l` [nb].
/// `band` ([`BlockMask::Band`], only with nb = BR ≤ r0): tile rows j < BR are also masked
/// for lanes li > j (the sliding window's lower-left triangle).
#[inline(always)]
fn softmax_body(tile: &mut [f32], nb: usize, r0: usize, band: bool, m: &mut [f32], l: &mut [f32]) {
    if nb == BR {
        let m: &mut [f32; BR] = (&mut m[..BR]).try_into().unwrap();
        let l: &mut [f32; BR] = (&mut l[..BR]).try_into().unwrap();
        return softmax_full(tile, r0, if band { BR } else { 0 }, m, l);
    }
    debug_assert!(!band, "the band path is for full blocks only");
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
/// top ≤ j < r0 have every lane unmasked; in the diagonal rows j = r0 + jj lanes li < jj are
/// masked, and in the window's rows j < top (top = BR in a band block, else 0) lanes li > j
/// (selected away, so the results equal the dynamic path bitwise: masked lanes add +0.0).
#[inline(always)]
fn softmax_full(tile: &mut [f32], r0: usize, top: usize, m: &mut [f32; BR], l: &mut [f32; BR]) {
    let (rows, _) = tile.as_chunks_mut::<BR>();
    *m = [f32::NEG_INFINITY; BR];
    let (win, rest) = rows.split_at_mut(top);
    let (full, diag) = rest.split_at_mut(r0 - top);
    for (jj, row) in win.iter().enumerate() {
        for li in 0..BR {
            let s = if li <= jj { row[li] } else { f32::NEG_INFINITY };
            m[li] = fmax(s, m[li]);
        }
    }
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
    for (jj, row) in win.iter_mut().enumerate() {
        for li in 0..BR {
            let e = if li <= jj {
                exp2_nonpos(row[li] - m[li])
            } else {
                0.0
            };
            row[li] = e;
            l[li] += e;
        }
    }
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

/// Backward: base-2 scores S'ᵀ `[nk, nb]` (nk = r0 + nb) → Pᵀ = 2^(S' - lse·log2 e) in place
/// (masked entries 0); `lse` [nb] is the natural log-sum-exp of the forward. `band` as for
/// `softmax_body`.
#[inline(always)]
fn probs_body(tile: &mut [f32], nb: usize, r0: usize, band: bool, lse: &[f32]) {
    // 2^min(s - lse2, 0): s ≤ lse2 up to rounding.
    let p = |s: f32, lse2: f32| exp2_nonpos(if s - lse2 < 0.0 { s - lse2 } else { 0.0 });
    let to2 = |l: f32| l * std::f32::consts::LOG2_E;
    if nb == BR {
        // Fixed-width rows, as in `softmax_full`.
        let lse: [f32; BR] = std::array::from_fn(|li| to2(lse[li]));
        let (rows, _) = tile.as_chunks_mut::<BR>();
        let top = if band { BR } else { 0 };
        let (win, rest) = rows.split_at_mut(top);
        let (full, diag) = rest.split_at_mut(r0 - top);
        for (jj, row) in win.iter_mut().enumerate() {
            for li in 0..BR {
                row[li] = if li <= jj { p(row[li], lse[li]) } else { 0.0 };
            }
        }
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
    debug_assert!(!band, "the band path is for full blocks only");
    let lse = &lse[..nb];
    for (j, row) in tile.chunks_exact_mut(nb).enumerate() {
        let lo = first_lane(j, r0);
        row[..lo].fill(0.0);
        for (v, &lv) in row[lo..].iter_mut().zip(&lse[lo..]) {
            *v = p(*v, to2(lv));
        }
    }
}

/// Backward: dSᵀ = scale · Pᵀ ∘ (dPᵀ - D) in place in `dp` `[nk, nb]`; `d` [nb].
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

// Blocks whose queries do not share a first key (packed rows straddling an example start,
// windows sliding; `BlockMask::Lanes`): tile row j is key k0 + j and
// lane li is query r0 + li (r0 relative to k0 here); entry (j, li) is unmasked iff
// lb[li] ≤ j ≤ r0 + li, with lane li's first key lb[li] non-decreasing in li. The unmasked
// lanes of row j are therefore one range, [first_lane(j, r0), lanes_from(j)).

/// Lane range `[lo, hi)` of tile row `j` unmasked under per-lane first keys `lb` (non-decreasing)
/// for a block starting at query `r0`; `hi` is advanced from its value for the previous row.
/// Empty (lo = hi) when no lane sees key j.
#[inline(always)]
fn lane_range(j: usize, r0: usize, lb: &[usize], hi: &mut usize) -> (usize, usize) {
    while *hi < lb.len() && lb[*hi] <= j {
        *hi += 1;
    }
    let lo = first_lane(j, r0);
    (lo, (*hi).max(lo))
}

/// `softmax_body` for a block whose queries do not share a first key: lane li sees tile rows
/// `lb[li] ..= r0 + li` only (`lb` [nb]). Always the dynamic path; masked entries are selected
/// away before the max and set to exactly 0 (never computed through the exponential), so a
/// non-finite score of another example's key stays out of the lane.
#[inline(always)]
fn softmax_lanes_body(
    tile: &mut [f32],
    nb: usize,
    r0: usize,
    lb: &[usize],
    m: &mut [f32],
    l: &mut [f32],
) {
    let (m, l, lb) = (&mut m[..nb], &mut l[..nb], &lb[..nb]);
    m.fill(f32::NEG_INFINITY);
    let mut hi = 0;
    for (j, row) in tile.chunks_exact(nb).enumerate() {
        let (lo, hi) = lane_range(j, r0, lb, &mut hi);
        for (mv, &s) in m[lo..hi].iter_mut().zip(&row[lo..hi]) {
            *mv = fmax(s, *mv);
        }
    }
    l.fill(0.0);
    let mut hi = 0;
    for (j, row) in tile.chunks_exact_mut(nb).enumerate() {
        let (lo, hi) = lane_range(j, r0, lb, &mut hi);
        row[..lo].fill(0.0);
        row[hi..].fill(0.0);
        for ((p, &mv), lv) in row[lo..hi].iter_mut().zip(&m[lo..hi]).zip(&mut l[lo..hi]) {
            let e = exp2_nonpos(*p - mv);
            *p = e;
            *lv += e;
        }
    }
}

/// `probs_body` for a block whose queries do not share a first key (lane li sees tile rows
/// `lb[li] ..= r0 + li`; masked entries exactly 0).
#[inline(always)]
fn probs_lanes_body(tile: &mut [f32], nb: usize, r0: usize, lb: &[usize], lse: &[f32]) {
    let (lse, lb) = (&lse[..nb], &lb[..nb]);
    let mut hi = 0;
    for (j, row) in tile.chunks_exact_mut(nb).enumerate() {
        let (lo, hi) = lane_range(j, r0, lb, &mut hi);
        row[..lo].fill(0.0);
        row[hi..].fill(0.0);
        for (v, &lv) in row[lo..hi].iter_mut().zip(&lse[lo..hi]) {
            let (s, lse2) = (*v, lv * std::f32::consts::LOG2_E);
            *v = exp2_nonpos(if s - lse2 < 0.0 { s - lse2 } else { 0.0 });
        }
    }
}

multiversion! {
    /// `softmax_lanes_body`, compiled for the widest vector ISA available.
    fn softmax_lanes_tile(
        tile: &mut [f32],
        nb: usize,
        r0: usize,
        lb: &[usize],
        m: &mut [f32],
        l: &mut [f32],
    ) {
        softmax_lanes_body(tile, nb, r0, lb, m, l)
    }
}

multiversion! {
    /// `probs_lanes_body`, compiled for the widest vector ISA available.
    fn probs_lanes_tile(tile: &mut [f32], nb: usize, r0: usize, lb: &[usize], lse: &[f32]) {
        probs_lanes_body(tile, nb, r0, lb, lse)
    }
}

multiversion! {
    /// `softmax_body`, compiled for the widest vector ISA available.
    fn softmax_tile(
        tile: &mut [f32],
        nb: usize,
        r0: usize,
        band: bool,
        m: &mut [f32],
        l: &mut [f32],
    ) {
        softmax_body(tile, nb, r0, band, m, l)
    }
}

multiversion! {
    /// `probs_body`, compiled for the widest vector ISA available.
    fn probs_tile(tile: &mut [f32], nb: usize, r0: usize, band: bool, lse: &[f32]) {
        probs_body(tile, nb, r0, band, lse)
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

/// Forward of causal self-attention with NH query heads and NKV key/value heads of size `hd`.
///
/// `out` `[B,T,NH·hd]` and `lse` `[B,NH,T]` are written in full; `qkv` is `[B,T,(NH+2·NKV)·hd]`;
/// NKV must divide NH. `pos` `[B,T]` packs several examples into a row: each token's position
/// in its example (0 where an example starts, else the previous position plus 1; checked), and
/// query i attends to keys `i - pos[i] ..= i` only; `None` is plain causal attention (bitwise
/// the same as positions `0, 1, …, T-1`). A sliding `window` W (at least 1) keeps query i to
/// keys `i - W < j` as well; the blocks outside it are never computed. `ws` must hold at least
/// `attention_workspace_len::<T>(t, hd, window, rayon::current_num_threads())` elements.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: Elem>(
    out: &mut [T],   // [B, T, NH·hd]
    lse: &mut [f32], // [B, NH, T]
    qkv: &[T],       // [B, T, (NH + 2·NKV)·hd]
    b: usize,
    t: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    scale_dim: f32,
    pos: Option<&[u32]>, // [B, T]
    window: Option<usize>,
    ws: &mut [f32], // [attention_workspace_len::<T>(T, hd, window, threads)]
) {
    let dims = Dims::new(t, (nh, nkv, hd), scale_dim, window);
    if let Some(pos) = pos {
        check_positions(pos, b, t);
    }
    assert_eq!(out.len(), b * t * dims.co, "out must be [B,T,NH·hd]");
    assert_eq!(lse.len(), b * nh * t, "lse must be [B,NH,T]");
    assert_eq!(
        qkv.len(),
        b * t * dims.ld,
        "qkv must be [B,T,(NH+2·NKV)·hd]"
    );
    let threads = rayon::current_num_threads();
    let need = attention_workspace_len::<T>(t, hd, window, threads);
    assert!(
        ws.len() >= need,
        "attention workspace too small: {} < {need}",
        ws.len()
    );
    let units = b * nkv;
    if units == 0 || t == 0 {
        return;
    }
    let per = per_worker_len::<T>(t, hd, window);
    let workers = threads.min(units);
    let out_p = SyncPtr(out.as_mut_ptr());
    let lse_p = SyncPtr(lse.as_mut_ptr());
    ws[..workers * per]
        .par_chunks_mut(per)
        .enumerate()
        .for_each(|(w, ws_w)| {
            let (lo, hi) = unit_range(w, workers, units);
            for u in lo..hi {
                let pos_u = pos.map(|p| &p[u / nkv * t..][..t]); // [T]
                // SAFETY: see `SyncPtr`: unit u owns these output elements exclusively.
                unsafe { forward_unit(out_p.get(), lse_p.get(), qkv, pos_u, u, dims, ws_w) };
            }
        });
}

/// Forward of unit `u` = b·NKV + j: KV head j of batch b and its query heads j·g … j·g+g−1;
/// `pos` is row b's positions (checked by `check_positions`).
///
/// # Safety
/// `out` must point to the `[B,T,NH·hd]` output and `lse` to the `[B,NH,T]` log-sum-exp buffer;
/// the caller guarantees no other thread touches unit `u`'s elements.
unsafe fn forward_unit<T: Elem>(
    out: *mut T,
    lse: *mut f32,
    qkv: &[T],           // [B, T, (NH + 2·NKV)·hd]
    pos: Option<&[u32]>, // [T]
    u: usize,
    d: Dims,
    ws: &mut [f32],
) {
    let Dims {
        t,
        nh,
        nkv,
        g,
        hd,
        ld,
        co,
        scale2,
        w,
        nk_max,
        ..
    } = d;
    let (bi, j) = (u / nkv, u % nkv);
    let br = BR.min(t);
    let (tile, rest) = ws.split_at_mut(br * nk_max); // Sᵀ / Pᵀ block [nk, nb], nk ≤ nk_max
    let (kc, rest) = rest.split_at_mut(t * hd); // K [T, hd]
    let (vc, rest) = rest.split_at_mut(t * hd); // V [T, hd]
    let (mx, rest) = rest.split_at_mut(br); // row max m [nb]
    let (sum, rest) = rest.split_at_mut(br); // row sum l [nb]
    // T = f32 reads Q and writes O in place; other types widen Q into, and compute O in, these.
    let direct = is_f32::<T>();
    let nbuf = if direct { 0 } else { br * hd };
    let (qbuf, rest) = rest.split_at_mut(nbuf); // Q block [nb, hd]
    let obuf = &mut rest[..nbuf]; // O block [nb, hd]
    // K and V of KV head j, once for its g query heads.
    gather_kv(
        (kc, vc),
        &qkv[bi * t * ld + j * hd..],
        (t, hd, ld),
        (d.k0(), d.v0()),
    );
    for h in j * g..(j + 1) * g {
        let qoff = bi * t * ld + h * hd;
        // SAFETY: in-bounds offsets of the caller's buffers; this unit's exclusive regions.
        let (o, lse_u) = unsafe {
            (
                out.add(bi * t * co + h * hd), // O [T, hd], row stride NH·hd
                std::slice::from_raw_parts_mut(lse.add((bi * nh + h) * t), t), // lse [T]
            )
        };
        let mut lb = [0usize; BR]; // first key of each lane, relative to k0 (unless Causal)
        let mut r0 = 0;
        while r0 < t {
            let r1 = (r0 + BR).min(t);
            let nb = r1 - r0;
            // Keys k0..r1 (nk rows); the block's first query is key rr0 of them.
            let (k0, mask) = block_keys(pos, w, r0, r1, &mut lb);
            let (nk, rr0) = (r1 - k0, r0 - k0);
            let tile = &mut tile[..nk * nb];
            for i in r0..r1 {
                // The O rows this block writes at its end (strided, otherwise cache misses).
                prefetch_ptr(o.wrapping_add(i * co), hd);
            }
            let qrows = &qkv[qoff + r0 * ld..]; // Q[r0..], row stride (NH + 2·NKV)·hd
            let qv = if direct {
                tr(qrows.as_ptr().cast::<f32>(), ld) // T is f32: the same memory
            } else {
                gather_rows(qbuf, qrows, nb, hd, ld);
                tr(qbuf.as_ptr(), hd)
            };
            // SAFETY: Q rows r0..r1 < T of this batch (or their copy); kc rows k0..r1 ≤ T and
            // tile [nk, nb] are in ws.
            unsafe {
                // S'ᵀ[nk, nb] = scale2 · K[k0..r1] Q[r0..r1]ᵀ  (scores in base-2 units)
                mm(
                    (nk, nb, hd),
                    tile.as_mut_ptr(),
                    nb,
                    false,
                    rm(kc.as_ptr().add(k0 * hd), hd),
                    qv,
                    scale2,
                );
            }
            match mask {
                BlockMask::Lanes => softmax_lanes_tile(tile, nb, rr0, &lb, mx, sum),
                m => softmax_tile(tile, nb, rr0, m == BlockMask::Band, mx, sum),
            }
            // O rows r0..r1: in place for f32 (T is f32, so the cast is the same memory), else
            // the f32 block, rounded into `out` below.
            let (ob, ob_ld) = if direct {
                // SAFETY: in-bounds offset of this unit's O rows.
                (unsafe { o.add(r0 * co) }.cast::<f32>(), co)
            } else {
                (obuf.as_mut_ptr(), hd)
            };
            // SAFETY: O rows r0..r1 belong to this unit (or are the ws block); vc rows k0..r1
            // are in ws.
            unsafe {
                // O[r0..r1] = P[nb, nk] V[k0..r1]   (P = tileᵀ: column stride nb, row stride 1)
                mm(
                    (nb, hd, nk),
                    ob,
                    ob_ld,
                    false,
                    tr(tile.as_ptr(), nb),
                    rm(vc.as_ptr().add(k0 * hd), hd),
                    1.0,
                );
                // Normalise: O row li /= l[li].
                for (li, &l) in sum[..nb].iter().enumerate() {
                    let inv = 1.0 / l;
                    for e in 0..hd {
                        *ob.add(li * ob_ld + e) *= inv;
                    }
                }
                if !direct {
                    narrow_rows(o.add(r0 * co), co, &obuf[..nb * hd], hd);
                }
            }
            for ((lv, &m), &l) in lse_u[r0..r1].iter_mut().zip(&*mx).zip(&*sum) {
                *lv = (m + l.log2()) * std::f32::consts::LN_2;
            }
            r0 = r1;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backward

/// Backward of causal self-attention: overwrites all of `dqkv` `[B,T,(NH+2·NKV)·hd]` from `dout`
/// `[B,T,NH·hd]`, the forward's inputs `qkv` `[B,T,(NH+2·NKV)·hd]` and its results `out`
/// `[B,T,NH·hd]` and `lse` `[B,NH,T]`. The gradient of a KV head is the sum over the g query
/// heads it serves. `pos` `[B,T]` and `window` (those the forward was given) and `ws` as for
/// the forward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Elem>(
    dqkv: &mut [T], // [B, T, (NH + 2·NKV)·hd]
    dout: &[T],     // [B, T, NH·hd]
    qkv: &[T],      // [B, T, (NH + 2·NKV)·hd]
    out: &[T],      // [B, T, NH·hd]
    lse: &[f32],    // [B, NH, T]
    b: usize,
    t: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    scale_dim: f32,
    pos: Option<&[u32]>, // [B, T]
    window: Option<usize>,
    ws: &mut [f32], // [attention_workspace_len::<T>(T, hd, window, threads)]
) {
    let dims = Dims::new(t, (nh, nkv, hd), scale_dim, window);
    let (ld, co) = (dims.ld, dims.co);
    if let Some(pos) = pos {
        check_positions(pos, b, t);
    }
    assert_eq!(dqkv.len(), b * t * ld, "dqkv must be [B,T,(NH+2·NKV)·hd]");
    assert_eq!(dout.len(), b * t * co, "dout must be [B,T,NH·hd]");
    assert_eq!(qkv.len(), b * t * ld, "qkv must be [B,T,(NH+2·NKV)·hd]");
    assert_eq!(out.len(), b * t * co, "out must be [B,T,NH·hd]");
    assert_eq!(lse.len(), b * nh * t, "lse must be [B,NH,T]");
    let threads = rayon::current_num_threads();
    let need = attention_workspace_len::<T>(t, hd, window, threads);
    assert!(
        ws.len() >= need,
        "attention workspace too small: {} < {need}",
        ws.len()
    );
    let units = b * nkv;
    if units == 0 || t == 0 {
        return;
    }
    let per = per_worker_len::<T>(t, hd, window);
    let workers = threads.min(units);
    let dqkv_p = SyncPtr(dqkv.as_mut_ptr());
    ws[..workers * per]
        .par_chunks_mut(per)
        .enumerate()
        .for_each(|(w, ws_w)| {
            let (lo, hi) = unit_range(w, workers, units);
            for u in lo..hi {
                let pos_u = pos.map(|p| &p[u / nkv * t..][..t]); // [T]
                let io = (dout, qkv, out, lse);
                // SAFETY: see `SyncPtr`: unit u owns these dqkv elements exclusively.
                unsafe { backward_unit(dqkv_p.get(), io, pos_u, u, dims, ws_w) };
            }
        });
}

/// Backward of unit `u` = b·NKV + j: KV head j of batch b and its query heads j·g … j·g+g−1;
/// `(dout, qkv, out, lse)` as for `attention_backward`, `pos` row b's positions (checked by
/// `check_positions`).
///
/// # Safety
/// `dqkv` must point to the `[B,T,(NH+2·NKV)·hd]` gradient buffer; the caller guarantees no other
/// thread touches unit `u`'s elements of it.
#[allow(clippy::type_complexity)]
unsafe fn backward_unit<T: Elem>(
    dqkv: *mut T,
    // dout [B, T, NH·hd], qkv [B, T, (NH + 2·NKV)·hd], out [B, T, NH·hd], lse [B, NH, T]
    (dout, qkv, out, lse): (&[T], &[T], &[T], &[f32]),
    pos: Option<&[u32]>, // [T]
    u: usize,
    d: Dims,
    ws: &mut [f32],
) {
    let Dims {
        t,
        nh,
        nkv,
        g,
        hd,
        ld,
        co,
        scale,
        scale2,
        w,
        nk_max,
    } = d;
    let (bi, j) = (u / nkv, u % nkv);
    let (kcol, vcol) = (d.k0(), d.v0()); // columns of key / value head 0
    let kvoff = bi * t * ld + j * hd; // row 0 of this batch, plus j·hd: K at +kcol, V at +vcol
    let br = BR.min(t);
    let (p, rest) = ws.split_at_mut(br * nk_max); // Pᵀ block [nk, nb], nk ≤ nk_max
    let (ds, rest) = rest.split_at_mut(br * nk_max); // dPᵀ, then dSᵀ, block [nk, nb]
    let (kc, rest) = rest.split_at_mut(t * hd); // K [T, hd]
    let (vc, rest) = rest.split_at_mut(t * hd); // V [T, hd]
    let (dk, rest) = rest.split_at_mut(t * hd); // dK accumulator [T, hd]
    let (dv, rest) = rest.split_at_mut(t * hd); // dV accumulator [T, hd]
    let (qb, rest) = rest.split_at_mut(br * hd); // Q block [nb, hd]
    let (gb, rest) = rest.split_at_mut(br * hd); // dO block [nb, hd]
    let (dd, rest) = rest.split_at_mut(br); // D block [nb]
    // T = f32 writes dQ in place; other types compute it in this f32 block [nb, hd].
    let direct = is_f32::<T>();
    let dqbuf = &mut rest[..if direct { 0 } else { br * hd }];
    // K and V of KV head j, once for its g query heads; dK, dV summed over them.
    gather_kv((kc, vc), &qkv[kvoff..], (t, hd, ld), (kcol, vcol));
    dk.fill(0.0);
    dv.fill(0.0);
    for h in j * g..(j + 1) * g {
        let qoff = bi * t * ld + h * hd;
        let ooff = bi * t * co + h * hd;
        let lse_u = &lse[(bi * nh + h) * t..][..t]; // [T]
        // SAFETY: in-bounds offset; this unit's exclusive dQ region [T, hd], row stride ld.
        let dq = unsafe { dqkv.add(qoff) };
        let mut lb = [0usize; BR]; // first key of each lane, relative to k0 (unless Causal)
        let mut r0 = 0;
        while r0 < t {
            let r1 = (r0 + BR).min(t);
            let nb = r1 - r0;
            // Keys k0..r1 (nk rows); the block's first query is key rr0 of them.
            let (k0, mask) = block_keys(pos, w, r0, r1, &mut lb);
            let (nk, rr0) = (r1 - k0, r0 - k0);
            let (p, ds) = (&mut p[..nk * nb], &mut ds[..nk * nb]);
            gather_rows(qb, &qkv[qoff + r0 * ld..], nb, hd, ld);
            // dO block copy and D[li] = dO[r0+li] · O[r0+li] in one pass over the rows.
            for (li, (gr, di)) in gb[..nb * hd]
                .chunks_exact_mut(hd)
                .zip(&mut dd[..nb])
                .enumerate()
            {
                let row = ooff + (r0 + li) * co;
                prefetch(dout, row + PREFETCH_ROWS * co, hd);
                prefetch(out, row + PREFETCH_ROWS * co, hd);
                // The dQ rows this block writes at its end (strided, otherwise cache misses).
                prefetch_ptr(dq.wrapping_add((r0 + li) * ld), hd);
                widen_into(gr, &dout[row..row + hd]);
                *di = out[row..row + hd]
                    .iter()
                    .zip(&*gr)
                    .map(|(a, b)| a.to_f32() * b)
                    .sum();
            }
            // K, V rows k0.. and the dK, dV accumulator rows k0.. (k0 < r1 ≤ T: in bounds).
            let (kp, vp) = (kc[k0 * hd..].as_ptr(), vc[k0 * hd..].as_ptr());
            let (dkp, dvp) = (dk[k0 * hd..].as_mut_ptr(), dv[k0 * hd..].as_mut_ptr());
            let (qp, gp) = (qb.as_ptr(), gb.as_ptr());
            // SAFETY (all products below): operands are ws buffers of the stated shapes with
            // rows k0..r1, r1 ≤ T, and this unit's dQ rows r0..r1 in dqkv.
            unsafe {
                // S'ᵀ[nk, nb] = scale2 · K[k0..r1] Q[r0..r1]ᵀ  (scores in base-2 units)
                mm(
                    (nk, nb, hd),
                    p.as_mut_ptr(),
                    nb,
                    false,
                    rm(kp, hd),
                    tr(qp, hd),
                    scale2,
                );
            }
            match mask {
                BlockMask::Lanes => probs_lanes_tile(p, nb, rr0, &lb, &lse_u[r0..r1]),
                m => probs_tile(p, nb, rr0, m == BlockMask::Band, &lse_u[r0..r1]),
            }
            unsafe {
                // dV[k0..r1] += Pᵀ dO[r0..r1]        ([nk, nb] · [nb, hd])
                mm(
                    (nk, hd, nb),
                    dvp,
                    hd,
                    true,
                    rm(p.as_ptr(), nb),
                    rm(gp, hd),
                    1.0,
                );
                // dPᵀ[nk, nb] = V[k0..r1] dO[r0..r1]ᵀ
                mm(
                    (nk, nb, hd),
                    ds.as_mut_ptr(),
                    nb,
                    false,
                    rm(vp, hd),
                    tr(gp, hd),
                    1.0,
                );
            }
            ds_tile(ds, p, nb, &dd[..nb], scale);
            unsafe {
                // dQ[r0..r1] = dS K[k0..r1]         ([nb, nk] · [nk, hd]; dS = dSᵀ transposed)
                // In place for f32 (T is f32, so the cast is the same memory), else into the
                // f32 block, rounded into `dqkv` right after.
                let (dqb, dqb_ld) = if direct {
                    (dq.add(r0 * ld).cast::<f32>(), ld)
                } else {
                    (dqbuf.as_mut_ptr(), hd)
                };
                mm(
                    (nb, hd, nk),
                    dqb,
                    dqb_ld,
                    false,
                    tr(ds.as_ptr(), nb),
                    rm(kp, hd),
                    1.0,
                );
                if !direct {
                    narrow_rows(dq.add(r0 * ld), ld, &dqbuf[..nb * hd], hd);
                }
                // dK[k0..r1] += dSᵀ Q[r0..r1]       ([nk, nb] · [nb, hd])
                mm(
                    (nk, hd, nb),
                    dkp,
                    hd,
                    true,
                    rm(ds.as_ptr(), nb),
                    rm(qp, hd),
                    1.0,
                );
            }
            r0 = r1;
        }
    }
    for (i, (dkr, dvr)) in dk.chunks_exact(hd).zip(dv.chunks_exact(hd)).enumerate() {
        // SAFETY: row i < T of this unit's dK / dV regions of dqkv ([T, hd] each, row stride
        // ld), which no other thread touches; sources are ws rows of hd elements.
        unsafe {
            let row = dqkv.add(kvoff + i * ld);
            let ahead = row.wrapping_add(PREFETCH_ROWS * ld);
            if i + PREFETCH_ROWS < t {
                prefetch_ptr(ahead.wrapping_add(kcol), hd);
                prefetch_ptr(ahead.wrapping_add(vcol), hd);
            }
            if direct {
                // T is f32: plain copies.
                std::ptr::copy_nonoverlapping(dkr.as_ptr(), row.add(kcol).cast::<f32>(), hd);
                std::ptr::copy_nonoverlapping(dvr.as_ptr(), row.add(vcol).cast::<f32>(), hd);
            } else {
                narrow_rows(row.add(kcol), 0, dkr, hd);
                narrow_rows(row.add(vcol), 0, dvr, hd);
            }
        }
    }
}

pub mod naive;

#[cfg(test)]
mod tests;
