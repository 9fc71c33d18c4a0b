//! Causal multi-head self-attention, forward and backward, without keeping the attention
//! matrix (FlashAttention-style recomputation).
//!
//! Shapes: `qkv` is [B, T, 3C] row-major; for row (b, t) the query is `qkv[.., 0..C]`, the key
//! `qkv[.., C..2C]` and the value `qkv[.., 2C..3C]`; head h owns channels `h*hs..(h+1)*hs` of
//! each (hs = C/NH). `out` is [B, T, C] with head h in channels `h*hs..(h+1)*hs` (GPT-2 / HF
//! layout). Scores are scaled by 1/sqrt(hs); position t attends to positions 0..=t.
//!
//! Forward, per (batch, head) unit, in row blocks of `BR` query rows `r0..r1`:
//!   S = scale · Q[r0..r1] K[0..r1]ᵀ              (only the causal columns 0..r1 are computed)
//!   P = softmax(S) row-wise over columns 0..=i    (masked columns are set to exactly 0)
//!   O[r0..r1] = P V[0..r1]                        (written in place into `out`)
//!   lse[i] = max_j S[i,j] + ln Σ_j exp(S[i,j] - max)
//! Only `out` and `lse` ([B, NH, T]) are kept for backward, never the [B, NH, T, T] matrix.
//!
//! Backward, per unit, with D[i] = Σ_c dO[i,c] O[i,c] (= rowsum(dP ∘ P)), same row blocks:
//!   P  = exp(scale · Q K[0..r1]ᵀ - lse)           (recomputed; masked entries 0)
//!   dV[0..r1] += Pᵀ dO[r0..r1]
//!   dP = dO[r0..r1] V[0..r1]ᵀ
//!   dS = scale · P ∘ (dP - D)                     (scale folded in here)
//!   dQ[r0..r1] = dS K[0..r1]
//!   dK[0..r1] += dSᵀ Q[r0..r1]
//! dK and dV of a unit are zeroed first and then accumulated block by block in a fixed order.
//!
//! All matrix products go through `gemm::gemm` with `Parallelism::None`, reading Q/K/V/dO/O in
//! place through their row strides (3C or C) and writing `out`/`dqkv` in place. Parallelism is
//! over the B·NH units: they are split into contiguous groups, one per rayon worker, each with its
//! own slice of the workspace. Every unit is computed by the same sequence of operations
//! whatever worker runs it, so results are bitwise identical for any thread count.
//!
//! The kernels allocate nothing themselves (the `gemm` crate may use its own internal packing
//! buffers). The element-wise parts (exp, softmax, dS) are written so that LLVM vectorises them;
//! an AVX-512 / AVX2 build of the same code is picked at run time when the CPU supports it (no
//! FMA contraction, so every variant computes bitwise the same values).

use gemm::{Parallelism, gemm};
use rayon::prelude::*;

/// Query rows per block. Each block computes scores only for key columns 0..end-of-block, which
/// skips (almost) all of the masked upper triangle.
const BR: usize = 64;

/// Workspace elements per worker: a P tile and a dP tile of [min(BR,T), T] each, plus
/// D [min(BR,T)].
fn per_worker_len(t: usize) -> usize {
    let br = BR.min(t);
    2 * br * t + br
}

/// Workspace elements the kernels need for `threads` workers: per worker two score-sized tiles
/// of [min(64,T), T] (forward uses one) and a row vector of min(64,T). `hs` does not enter the
/// size today; it is part of the signature so the plan does not change if a variant needs it.
pub fn attention_workspace_len(t: usize, _hs: usize, threads: usize) -> usize {
    threads.max(1) * per_worker_len(t)
}

/// Raw pointer that can be shared between rayon workers.
///
/// SAFETY (of every use in this file): the (batch, head) units write disjoint elements of the
/// destination buffers: unit (b, h) writes only rows b·T..(b+1)·T, columns h·hs..(h+1)·hs of
/// `out` (and of each of the q/k/v thirds of `dqkv`), and only `lse[(b·NH+h)·T..][..T]`. Each
/// unit is processed by exactly one worker, and nothing reads those elements concurrently, so no
/// two threads ever touch the same element. The pointers stay valid because the borrowed slices
/// outlive the rayon scope.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    /// Method (not field) access so closures capture the whole `Send + Sync` wrapper.
    fn get(self) -> *mut f32 {
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
    scale: f32,
}

impl Dims {
    fn new(t: usize, c: usize, nh: usize) -> Self {
        assert!(
            nh > 0 && c.is_multiple_of(nh),
            "C={c} is not divisible by NH={nh}"
        );
        let hs = c / nh;
        Dims {
            t,
            c,
            nh,
            hs,
            scale: 1.0 / (hs as f32).sqrt(),
        }
    }
}

/// Contiguous unit range [lo, hi) of worker `w` out of `workers` for `units` units.
fn unit_range(w: usize, workers: usize, units: usize) -> (usize, usize) {
    (w * units / workers, (w + 1) * units / workers)
}

/// `dst[m×n] (=|+=) beta · lhs[m×k] · rhs[k×n]` on one thread; strides in elements as
/// (column stride, row stride).
///
/// # Safety
/// All pointers must be valid for the addressed elements; `dst` must not alias `lhs`/`rhs`.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn mm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const f32,
    (lhs_cs, lhs_rs): (usize, usize),
    rhs: *const f32,
    (rhs_cs, rhs_rs): (usize, usize),
    beta: f32,
) {
    // SAFETY: forwarded to the caller's contract. gemm semantics: dst = alpha·dst + beta·lhs·rhs,
    // alpha only read when read_dst.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise pieces (vectorisable). Fixed 16-lane partial sums keep the reduction order
// identical for every instruction set.

const LANES: usize = 16;

/// exp(x) for x ≤ 0 (Cephes-style range reduction + degree-6 polynomial, ~1-2 ulp); returns 0
/// below the f32 normal range. Branch-free so that it vectorises.
#[inline(always)]
fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4; // ln 2 split: high part (exact in few bits)
    const C2: f32 = -2.121_944_4e-4; // ln 2 - C1
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let xc = x.max(-87.0);
    let tt = xc * LOG2E + MAGIC;
    let n = tt - MAGIC; // round(x·log2 e) as a float
    let ni = (tt.to_bits() as i32).wrapping_sub(0x4B40_0000); // the same integer
    let r = xc - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let pow2 = f32::from_bits(((ni + 127) as u32) << 23);
    if x < -87.0 { 0.0 } else { y * pow2 }
}

/// Row-wise causal softmax of a score block in place. `tile` is [nb, ld] (ld = r1); row `li`
/// is query position `r0 + li` and keeps columns 0..=r0+li, the rest of the row is zeroed.
/// Writes `lse[li]` for each row.
#[inline(always)]
fn softmax_rows_body(tile: &mut [f32], ld: usize, nb: usize, r0: usize, lse: &mut [f32]) {
    for li in 0..nb {
        let row = &mut tile[li * ld..(li + 1) * ld];
        let (valid, masked) = row.split_at_mut(r0 + li + 1);
        let mut mx = [f32::NEG_INFINITY; LANES];
        let mut chunks = valid.chunks_exact(LANES);
        for ch in &mut chunks {
            for l in 0..LANES {
                mx[l] = mx[l].max(ch[l]);
            }
        }
        let mut m = f32::NEG_INFINITY;
        for &v in chunks.remainder() {
            m = m.max(v);
        }
        for v in mx {
            m = m.max(v);
        }
        let mut acc = [0.0f32; LANES];
        let mut chunks = valid.chunks_exact_mut(LANES);
        for ch in &mut chunks {
            for l in 0..LANES {
                let e = exp_nonpos(ch[l] - m);
                ch[l] = e;
                acc[l] += e;
            }
        }
        let mut s = 0.0f32;
        for v in chunks.into_remainder() {
            let e = exp_nonpos(*v - m);
            *v = e;
            s += e;
        }
        for v in acc {
            s += v;
        }
        let inv = 1.0 / s;
        for v in valid.iter_mut() {
            *v *= inv;
        }
        masked.fill(0.0);
        lse[li] = m + s.ln();
    }
}

/// P = exp(S - lse) in place over a [nb, ld] score block, masked columns zeroed.
#[inline(always)]
fn probs_rows_body(tile: &mut [f32], ld: usize, nb: usize, r0: usize, lse: &[f32]) {
    for li in 0..nb {
        let row = &mut tile[li * ld..(li + 1) * ld];
        let (valid, masked) = row.split_at_mut(r0 + li + 1);
        let l = lse[li];
        for v in valid.iter_mut() {
            *v = exp_nonpos((*v - l).min(0.0));
        }
        masked.fill(0.0);
    }
}

/// dS = scale · P ∘ (dP - D) in place in `dp`, both [nb, ld].
#[inline(always)]
fn ds_rows_body(dp: &mut [f32], p: &[f32], ld: usize, nb: usize, d: &[f32], scale: f32) {
    for li in 0..nb {
        let drow = &mut dp[li * ld..(li + 1) * ld];
        let prow = &p[li * ld..(li + 1) * ld];
        let di = d[li];
        for (g, &pv) in drow.iter_mut().zip(prow) {
            *g = pv * (*g - di) * scale;
        }
    }
}

/// Run-time selection of an instruction-set variant of an `#[inline(always)]` body. The bodies
/// contain no FMA-contractible operations that Rust would fuse, so all variants agree bitwise.
macro_rules! multiversion {
    ($name:ident, $body:ident, ($($arg:ident : $ty:ty),*)) => {
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports the enabled feature (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

multiversion!(softmax_rows, softmax_rows_body, (tile: &mut [f32], ld: usize, nb: usize, r0: usize, lse: &mut [f32]));
multiversion!(probs_rows, probs_rows_body, (tile: &mut [f32], ld: usize, nb: usize, r0: usize, lse: &[f32]));
multiversion!(ds_rows, ds_rows_body, (dp: &mut [f32], p: &[f32], ld: usize, nb: usize, d: &[f32], scale: f32));

// ---------------------------------------------------------------------------------------------
// Forward

/// Forward of causal self-attention.
///
/// `out` [B,T,C] and `lse` [B,NH,T] are written in full; `qkv` is [B,T,3C]; `ws` must hold at
/// least `attention_workspace_len(t, c/nh, rayon::current_num_threads())` elements.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    ws: &mut [f32],
) {
    let dims = Dims::new(t, c, nh);
    assert_eq!(out.len(), b * t * c, "out must be [B,T,C]");
    assert_eq!(lse.len(), b * nh * t, "lse must be [B,NH,T]");
    assert_eq!(qkv.len(), b * t * 3 * c, "qkv must be [B,T,3C]");
    let threads = rayon::current_num_threads();
    let need = attention_workspace_len(t, dims.hs, threads);
    assert!(
        ws.len() >= need,
        "attention workspace too small: {} < {need}",
        ws.len()
    );
    let units = b * nh;
    if units == 0 || t == 0 || dims.hs == 0 {
        out.fill(0.0);
        lse.fill(0.0);
        return;
    }
    let per = per_worker_len(t);
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
/// `out` must point to the [B,T,C] output and `lse` to the [B,NH,T] log-sum-exp buffer; the
/// caller guarantees no other thread touches unit `u`'s elements.
unsafe fn forward_unit(
    out: *mut f32,
    lse: *mut f32,
    qkv: &[f32],
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
    } = d;
    let (bi, h) = (u / nh, u % nh);
    let ld3 = 3 * c;
    // Q, K, V of this unit: [T, hs] views with row stride 3C into qkv.
    let q = qkv[bi * t * ld3 + h * hs..].as_ptr();
    let k = qkv[bi * t * ld3 + c + h * hs..].as_ptr();
    let v = qkv[bi * t * ld3 + 2 * c + h * hs..].as_ptr();
    // SAFETY: in-bounds offsets of the caller's buffers; this unit's exclusive region.
    let (o, lse_u) = unsafe {
        (
            out.add(bi * t * c + h * hs), // [T, hs], row stride C
            std::slice::from_raw_parts_mut(lse.add(u * t), t), // [T]
        )
    };
    let tile = &mut ws[..BR.min(t) * t]; // [nb, r1] score / probability block
    let mut r0 = 0;
    while r0 < t {
        let r1 = (r0 + BR).min(t);
        let nb = r1 - r0;
        let ld = r1;
        // SAFETY: all views stay inside qkv (rows < T of this batch) and the tile.
        unsafe {
            // S[nb, r1] = scale · Q[r0..r1] K[0..r1]ᵀ
            mm(
                nb,
                r1,
                hs,
                tile.as_mut_ptr(),
                ld,
                false,
                q.add(r0 * ld3),
                (1, ld3),
                k,
                (ld3, 1),
                scale,
            );
        }
        softmax_rows(&mut tile[..nb * ld], ld, nb, r0, &mut lse_u[r0..r1]);
        // SAFETY: o rows r0..r1 belong to this unit; v rows 0..r1 are in bounds.
        unsafe {
            // O[r0..r1] = P[nb, r1] V[0..r1]
            mm(
                nb,
                hs,
                r1,
                o.add(r0 * c),
                c,
                false,
                tile.as_ptr(),
                (1, ld),
                v,
                (1, ld3),
                1.0,
            );
        }
        r0 = r1;
    }
}

// ---------------------------------------------------------------------------------------------
// Backward

/// Backward of causal self-attention: overwrites all of `dqkv` [B,T,3C] from `dout` [B,T,C],
/// the forward's inputs `qkv` and its results `out` [B,T,C] and `lse` [B,NH,T]. `ws` as for
/// the forward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    ws: &mut [f32],
) {
    let dims = Dims::new(t, c, nh);
    assert_eq!(dqkv.len(), b * t * 3 * c, "dqkv must be [B,T,3C]");
    assert_eq!(dout.len(), b * t * c, "dout must be [B,T,C]");
    assert_eq!(qkv.len(), b * t * 3 * c, "qkv must be [B,T,3C]");
    assert_eq!(out.len(), b * t * c, "out must be [B,T,C]");
    assert_eq!(lse.len(), b * nh * t, "lse must be [B,NH,T]");
    let threads = rayon::current_num_threads();
    let need = attention_workspace_len(t, dims.hs, threads);
    assert!(
        ws.len() >= need,
        "attention workspace too small: {} < {need}",
        ws.len()
    );
    let units = b * nh;
    if units == 0 || t == 0 || dims.hs == 0 {
        dqkv.fill(0.0);
        return;
    }
    let per = per_worker_len(t);
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
/// `dqkv` must point to the [B,T,3C] gradient buffer; the caller guarantees no other thread
/// touches unit `u`'s elements of it.
#[allow(clippy::too_many_arguments)]
unsafe fn backward_unit(
    dqkv: *mut f32,
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
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
    } = d;
    let (bi, h) = (u / nh, u % nh);
    let ld3 = 3 * c;
    let qoff = bi * t * ld3 + h * hs;
    let ooff = bi * t * c + h * hs;
    // Inputs, [T, hs] each: Q/K/V with row stride 3C, dO/O with row stride C.
    let q = qkv[qoff..].as_ptr();
    let k = qkv[qoff + c..].as_ptr();
    let v = qkv[qoff + 2 * c..].as_ptr();
    let dov = &dout[ooff..];
    let ov = &out[ooff..];
    let lse_u = &lse[u * t..(u + 1) * t]; // [T]
    // SAFETY: in-bounds offsets; this unit's exclusive [T, hs] regions (row stride 3C).
    let (dq, dk, dv) = unsafe { (dqkv.add(qoff), dqkv.add(qoff + c), dqkv.add(qoff + 2 * c)) };
    for i in 0..t {
        for j in 0..hs {
            // SAFETY: row i < T, column j < hs of this unit's dK / dV.
            unsafe {
                *dk.add(i * ld3 + j) = 0.0;
                *dv.add(i * ld3 + j) = 0.0;
            }
        }
    }
    let br = BR.min(t);
    let (p, rest) = ws.split_at_mut(br * t); // P block [nb, r1]
    let (dp, rest) = rest.split_at_mut(br * t); // dP, then dS, block [nb, r1]
    let dd = &mut rest[..br]; // D [nb]
    let mut r0 = 0;
    while r0 < t {
        let r1 = (r0 + BR).min(t);
        let nb = r1 - r0;
        let ld = r1;
        for li in 0..nb {
            let (orow, grow) = (&ov[(r0 + li) * c..][..hs], &dov[(r0 + li) * c..][..hs]);
            dd[li] = orow.iter().zip(grow).map(|(a, b)| a * b).sum();
        }
        // SAFETY (all gemm calls below): operand views stay within rows 0..r1 < T of this
        // batch's qkv/dout and this unit's dqkv columns; tiles are [nb, ld] ⊂ ws.
        unsafe {
            // S[nb, r1] = scale · Q[r0..r1] K[0..r1]ᵀ
            mm(
                nb,
                r1,
                hs,
                p.as_mut_ptr(),
                ld,
                false,
                q.add(r0 * ld3),
                (1, ld3),
                k,
                (ld3, 1),
                scale,
            );
        }
        probs_rows(&mut p[..nb * ld], ld, nb, r0, &lse_u[r0..r1]);
        unsafe {
            // dV[0..r1] += Pᵀ dO[r0..r1]      ([r1, nb] · [nb, hs])
            mm(
                r1,
                hs,
                nb,
                dv,
                ld3,
                true,
                p.as_ptr(),
                (ld, 1),
                dov[r0 * c..].as_ptr(),
                (1, c),
                1.0,
            );
            // dP[nb, r1] = dO[r0..r1] V[0..r1]ᵀ
            mm(
                nb,
                r1,
                hs,
                dp.as_mut_ptr(),
                ld,
                false,
                dov[r0 * c..].as_ptr(),
                (1, c),
                v,
                (ld3, 1),
                1.0,
            );
        }
        ds_rows(&mut dp[..nb * ld], &p[..nb * ld], ld, nb, &dd[..nb], scale);
        unsafe {
            // dQ[r0..r1] = dS K[0..r1]          ([nb, r1] · [r1, hs])
            mm(
                nb,
                hs,
                r1,
                dq.add(r0 * ld3),
                ld3,
                false,
                dp.as_ptr(),
                (1, ld),
                k,
                (1, ld3),
                1.0,
            );
            // dK[0..r1] += dSᵀ Q[r0..r1]        ([r1, nb] · [nb, hs])
            mm(
                r1,
                hs,
                nb,
                dk,
                ld3,
                true,
                dp.as_ptr(),
                (ld, 1),
                q.add(r0 * ld3),
                (1, ld3),
                1.0,
            );
        }
        r0 = r1;
    }
}

/// Straightforward reference twins (allocating, f64 accumulation, materialised probabilities).
pub mod naive {
    /// f64 forward: returns (out [B,T,C], lse [B,NH,T], att [B,NH,T,T] probabilities, zero above
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

    /// Naive forward (f32 in/out, f64 inside): writes `out` [B,T,C] and `lse` [B,NH,T].
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
    /// [B,T,3C] for upstream gradient `dout` [B,T,C].
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

    /// Naive backward (f32 in/out, f64 inside): overwrites `dqkv` [B,T,3C].
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
    use super::*;

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

    fn ws_for(t: usize, c: usize, nh: usize) -> Vec<f32> {
        vec![f32::NAN; attention_workspace_len(t, c / nh, rayon::current_num_threads())]
    }

    fn fast_fwd(qkv: &[f32], b: usize, t: usize, c: usize, nh: usize) -> (Vec<f32>, Vec<f32>) {
        // NaN-filled outputs and workspace: any element not written shows up.
        let mut out = vec![f32::NAN; b * t * c];
        let mut lse = vec![f32::NAN; b * nh * t];
        let mut ws = ws_for(t, c, nh);
        attention_forward(&mut out, &mut lse, qkv, b, t, c, nh, &mut ws);
        (out, lse)
    }

    #[allow(clippy::too_many_arguments)]
    fn fast_bwd(
        dout: &[f32],
        qkv: &[f32],
        out: &[f32],
        lse: &[f32],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Vec<f32> {
        let mut dqkv = vec![f32::NAN; b * t * 3 * c];
        let mut ws = ws_for(t, c, nh);
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
    fn exp_matches_std() {
        let mut worst = 0.0f32;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (a, b) = (exp_nonpos(x), x.exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(-100.0), 0.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
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

    /// Bitwise identical results on repeated runs and for 1, 2 and 3 worker threads.
    #[test]
    fn deterministic_across_runs_and_thread_counts() {
        let (b, t, c, nh) = (2, 77, 36, 3);
        let qkv = rand_vec(b * t * 3 * c, 7, 2.0);
        let dout = rand_vec(b * t * c, 8, 1.0);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let (out, lse) = fast_fwd(&qkv, b, t, c, nh);
                let dqkv = fast_bwd(&dout, &qkv, &out, &lse, b, t, c, nh);
                (out, lse, dqkv)
            })
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let reference = run(2);
        for threads in [2, 1, 3, 2] {
            let got = run(threads);
            assert_eq!(bits(&got.0), bits(&reference.0), "out, {threads} threads");
            assert_eq!(bits(&got.1), bits(&reference.1), "lse, {threads} threads");
            assert_eq!(bits(&got.2), bits(&reference.2), "dqkv, {threads} threads");
        }
    }

    #[test]
    #[should_panic(expected = "workspace too small")]
    fn rejects_small_workspace() {
        let (b, t, c, nh) = (1, 8, 8, 2);
        let qkv = rand_vec(b * t * 3 * c, 1, 1.0);
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        let mut ws =
            vec![0.0; attention_workspace_len(t, c / nh, rayon::current_num_threads()) - 1];
        attention_forward(&mut out, &mut lse, &qkv, b, t, c, nh, &mut ws);
    }
}
