//! Mixed-precision GEMM: operands and output stored as any [`Elem`] (f32, bf16, f16),
//! accumulation in f32: on the bf16 dot-product kernel ([`super::bf16_dot`]) where the CPU
//! has AVX512_BF16, else on the `gemm` crate's f32 kernel ([`sgemm`]) after widening.
//!
//! Two paths, chosen once per process by [`bf16_dot`]:
//! - **dot product** (CPUs with AVX512_BF16: Cooper Lake, Sapphire Rapids, Zen 4 and later):
//!   a product with a bf16 operand and the other bf16 or f32 runs on `vdpbf16ps`, reading
//!   bf16 directly; an f32 operand (the master weights) is rounded to bf16 as it is packed,
//!   as autocast casts weights per op, so no bf16 copy of the weights is stored. Results
//!   differ from the widening path in the last bits (another summation order, weights
//!   rounded, denormals flushed), so the choice is per machine, like the ISA variants of
//!   `features::multiversion!`; `MEMWALL_BF16_DOT=off` forces widening.
//! - **widening** (every other case: f16, CPUs without AVX512_BF16, as the Skylake Xeon this
//!   was first measured on): bf16/f16 operands are widened to f32 and the f32 GEMM runs.
//!   Where that is memwall's own AVX2 GEMM ([`super::f32::own_avx2_kernel`]), f32 and bf16
//!   operands are not widened here: it widens them as it packs (the same f32 values, so the
//!   same results, without the pass over the tiles). It also takes each tile's whole
//!   reduction in one call, and an f32 output whole (one tile): it blocks for the caches
//!   itself, and smaller calls would pack its shared operand again for every tile. Its sums
//!   are the same either way, as its reduction blocks (`KC`) divide [`MIXED_BLOCK`].
//!
//! Both work tile by tile. [`gemm_mixed`] blocks the problem into tiles of at most
//! [`MIXED_BLOCK`] in m, n and k. For each output tile it
//! 1. sets up an f32 C tile in the workspace: loaded from `c` (via `to_f32`) when
//!    accumulating, and kept there across the whole k loop;
//! 2. for each k block, widens the A tile and the B tile into the workspace (elementwise,
//!    rayon-parallel over row tasks) and calls [`sgemm`] on the f32 tiles, accumulating into
//!    the C tile — or, on the dot-product path, calls [`gemm_bf16`] on the stored tiles
//!    with the A/B tile buffers as its packing scratch;
//! 3. narrows the C tile into `c` with `C::from_f32`: every output element is rounded once
//!    per call, however many k blocks there are.
//!
//! Tiles are walked n-block outer, m-block inner, so when k fits in one block the B tile is
//! widened once per n block and reused for every m block. Widening costs about
//! mk·⌈n/NB⌉ + nk·⌈m/NB⌉ conversions against mnk multiply-adds (NB = [`MIXED_BLOCK`]), a few
//! percent of the work for the shapes of GPT-2. An operand stored as f32 is read in place (no
//! copy), and an f32 output is accumulated in place (no C tile): the same f32 arithmetic.
//! When A, B and C are all f32 the call is exactly [`sgemm`] (bit-identical, workspace
//! unused).
//!
//! Memory: the workspace is three NB² f32 tiles ([`gemm_mixed_workspace_len`], 12 MiB). Each
//! [`sgemm`] call has at most NB rows and depth NB, so `gemm`'s own packing scratch stays
//! within [`super::f32::packing_bytes`]`(NB, NB)`.
//!
//! Determinism: the tiling depends only on the shape, the conversions are elementwise, and
//! [`sgemm`] and [`gemm_bf16`] are deterministic, so results are too (for a given machine
//! and thread count).

use super::bf16_dot::{Dot, Operand, gemm_bf16, pack_fits};
#[cfg(target_arch = "x86_64")]
use super::f32::own_sgemm;
use super::f32::{OWN_MIN_ROWS, own_avx2_kernel};
use super::f32::{check_windows, sgemm, span};
use crate::backend::cpu::elem::{as_f32, as_f32_mut, as_words, cast, narrow_row, widen_row};
use crate::backend::cpu::features::{Bf16DotRequest, bf16_dot_request};
use crate::backend::cpu::reduce::rows_per_task;
use crate::dtype::Elem;
use half::bf16;
use rayon::prelude::*;
use std::any::TypeId;
use std::sync::OnceLock;

/// Largest m, n and k extent of one tile of [`gemm_mixed`].
pub const MIXED_BLOCK: usize = 1024;

// The own AVX2 kernel's sums do not depend on where the tiles cut (module documentation).
#[cfg(target_arch = "x86_64")]
const _: () = assert!(MIXED_BLOCK.is_multiple_of(super::avx2::KC));

/// f32 elements of workspace [`gemm_mixed`] needs (three `MIXED_BLOCK²` tiles: A, B, C),
/// whatever the shape. Unused when all three element types are f32.
pub fn gemm_mixed_workspace_len() -> usize {
    workspace_len(MIXED_BLOCK)
}

fn workspace_len(block: usize) -> usize {
    3 * block * block
}

/// `x` as an operand of the dot-product GEMM, when stored as bf16 or f32.
fn dot_operand<T: Elem>(x: &[T]) -> Option<Operand<'_>> {
    cast::<T, bf16>(x)
        .map(Operand::Bf16)
        .or_else(|| cast::<T, f32>(x).map(Operand::F32))
}

/// Which bf16 dot-product kernel multiplies bf16 × bf16 operands here, if any: `vdpbf16ps`
/// on CPUs with AVX512_BF16. `MEMWALL_BF16_DOT=off` asks for the widening path (to compare
/// the two on one machine); `MEMWALL_BF16_DOT=emulated` for the dot-product path with the
/// instruction emulated (slow; to exercise the path on CPUs without it). Neither runs under
/// `MEMWALL_CPU_ISA=avx2` (or `baseline`), which asks for what a CPU without AVX-512 would
/// run. Decided once per process.
pub fn bf16_dot() -> Option<Dot> {
    #[cfg(test)]
    if let Some(forced) = tests::FORCED_DOT.with(|f| f.get()) {
        return forced;
    }
    static CHOICE: OnceLock<Option<Dot>> = OnceLock::new();
    *CHOICE.get_or_init(|| match bf16_dot_request() {
        Bf16DotRequest::Off => None,
        _ if crate::backend::cpu::features::isa() < crate::backend::cpu::features::Isa::Avx512 => {
            None
        }
        Bf16DotRequest::Emulated => Some(Dot::Emulated).filter(|d| d.available()),
        Bf16DotRequest::Hardware => Some(Dot::Hardware).filter(|d| d.available()),
    })
}

/// How products of bf16 (`bf16` true) or f16 storage are computed in this process
/// (reported by `bench` and `plan`).
pub fn compute_path(bf16: bool) -> &'static str {
    match (bf16, bf16_dot()) {
        (true, Some(Dot::Hardware)) => {
            "vdpbf16ps micro-kernel (AVX512_BF16): bf16 pairs, f32 accumulation, f32 weights rounded to bf16 while packed"
        }
        (true, Some(Dot::Emulated)) => {
            "dot-product micro-kernel with vdpbf16ps emulated (MEMWALL_BF16_DOT=emulated: slow, for checking)"
        }
        (true, _) if own_avx2_kernel() => {
            "own AVX2 GEMM: bf16 operands widened to f32 as they are packed, f32 accumulation"
        }
        _ => "f32 GEMM on operands converted to f32 in 1024-tiles",
    }
}

/// Calls `f(r, row)` for each row `r < rows` of the window `w` (row stride `ld`, `row` =
/// the first `cols` elements), in parallel tasks of whole rows (partition fixed by shape).
fn par_rows_mut<T: Send>(
    w: &mut [T], // [rows, ld], the last row may stop after `cols`
    ld: usize,
    rows: usize,
    cols: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    let rpt = rows_per_task(cols);
    w[..span(rows, cols, ld)]
        .par_chunks_mut(rpt * ld)
        .enumerate()
        .for_each(|(t, ch)| {
            for (r, row) in ch.chunks_mut(ld).enumerate() {
                f(t * rpt + r, &mut row[..cols]);
            }
        });
}

/// Widens the `nr × nc` window at (r0, c0) of the stored matrix `src` (row stride `ld`) into
/// `buf` (row stride `nc`). Nothing to do when `T` is f32: [`view`] reads it in place.
fn widen_window<T: Elem>(
    buf: &mut [f32], // [nr, nc] written
    src: &[T],       // stored matrix, row stride ld
    ld: usize,
    (r0, nr): (usize, usize),
    (c0, nc): (usize, usize),
) {
    if as_f32(src).is_some() {
        return;
    }
    par_rows_mut(&mut buf[..nr * nc], nc, nr, nc, |r, d| {
        widen_row(d, &src[(r0 + r) * ld + c0..][..nc]);
    });
}

/// The f32 window at (r0, c0) of a stored operand as (slice, row stride): the operand
/// itself when it is f32, else `buf` as filled by [`widen_window`].
fn view<'s, T: Elem>(
    src: &'s [T], // stored matrix, row stride ld
    ld: usize,
    r0: usize,
    c0: usize,
    nc: usize,
    buf: &'s [f32], // [nr, nc]
) -> (&'s [f32], usize) {
    match as_f32(src) {
        Some(s) => (&s[r0 * ld + c0..], ld),
        None => (buf, nc),
    }
}

/// Mixed-precision GEMM with f32 accumulation:
/// `c[m,n] = (accumulate ? c : 0) + op(a)[m,k] @ op(b)[k,n]`, where op transposes when the
/// flag is set; a, b, c are row-major with the given leading dimensions, exactly as for [`sgemm`]
/// (a is stored `[m, k]`, or `[k, m]` when `a_trans`; alpha is 1). Elements of `c` outside the
/// `m × n` window are untouched. Each output element is rounded to `C` once.
///
/// `ws` must hold at least [`gemm_mixed_workspace_len`] f32 unless A, B and C are all f32,
/// in which case this is exactly [`sgemm`] and `ws` is unused (may be empty).
#[allow(clippy::too_many_arguments)]
pub fn gemm_mixed<A: Elem, B: Elem, C: Elem>(
    m: usize,
    n: usize,
    k: usize,
    a: &[A], // stored [m, k] (or [k, m] if a_trans), row stride lda
    lda: usize,
    a_trans: bool,
    b: &[B], // stored [k, n] (or [n, k] if b_trans), row stride ldb
    ldb: usize,
    b_trans: bool,
    c: &mut [C], // [m, n], row stride ldc
    ldc: usize,
    accumulate: bool,
    ws: &mut [f32], // [gemm_mixed_workspace_len()] scratch, or empty when all f32
) {
    if let (Some(a), Some(b), Some(c)) = (as_f32(a), as_f32(b), as_f32_mut(&mut *c)) {
        sgemm(
            m, n, k, 1.0, a, lda, a_trans, b, ldb, b_trans, c, ldc, accumulate,
        );
        return;
    }
    gemm_mixed_blocked(
        MIXED_BLOCK,
        (m, n, k),
        (a, lda, a_trans),
        (b, ldb, b_trans),
        (c, ldc),
        accumulate,
        None::<&[f32]>,
        ws,
    );
}

/// The blocked path of [`gemm_mixed`] with tiles of at most `block` (a parameter so tests can
/// exercise many tiles on small shapes), plus an optional `bias[n]` added to every row of the
/// output before the products (for the linear layer; still one rounding per element).
/// Needs `ws.len() >= 3·block²`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_mixed_blocked<A: Elem, B: Elem, C: Elem, D: Elem>(
    block: usize,
    (m, n, k): (usize, usize, usize),
    (a, lda, a_trans): (&[A], usize, bool), // stored [m, k] (or [k, m] if a_trans)
    (b, ldb, b_trans): (&[B], usize, bool), // stored [k, n] (or [n, k] if b_trans)
    (c, ldc): (&mut [C], usize),            // [m, n], row stride ldc
    accumulate: bool,
    bias: Option<&[D]>, // [n], added to every row of c
    ws: &mut [f32],     // [3, block, block] scratch: A, B and C tiles
) {
    assert!(block > 0, "gemm_mixed: block size 0");
    check_windows(
        "gemm_mixed",
        (m, n, k),
        (a.len(), lda, a_trans),
        (b.len(), ldb, b_trans),
        (c.len(), ldc),
    );
    if let Some(bias) = bias {
        assert_eq!(bias.len(), n, "gemm_mixed: bias length");
    }
    let need = workspace_len(block);
    assert!(
        ws.len() >= need,
        "gemm_mixed: workspace has {} f32, needs {need} (gemm_mixed_workspace_len)",
        ws.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    // The A and B tiles, adjacent (the dot-product path packs into both), then the C tile.
    let (ab_buf, c_buf) = ws[..need].split_at_mut(2 * block * block);
    // bf16 × bf16 and bf16 × f32 products (an f32 operand rounded to bf16 as it is packed,
    // as autocast does) run on the dot-product kernel when there is one.
    let is_bf16 = |t: TypeId| t == TypeId::of::<bf16>();
    let dot = bf16_dot().filter(|_| {
        (is_bf16(TypeId::of::<A>()) || is_bf16(TypeId::of::<B>()))
            && dot_operand(a).is_some()
            && dot_operand(b).is_some()
            && pack_fits(ab_buf.len())
    });
    let c_in_place = as_f32(c).is_some();
    // The own AVX2 kernel reads f32 and bf16 operands where they lie and blocks for the
    // caches itself: it takes the whole reduction in one call, and, where c is f32, the whole
    // product (cutting it into tiles would pack the shared operand once per tile).
    let own_operands = match (dot_operand(a), dot_operand(b)) {
        (Some(a), Some(b))
            if cfg!(target_arch = "x86_64") && dot.is_none() && own_avx2_kernel() =>
        {
            Some((a, b))
        }
        _ => None,
    };
    let own = own_operands.is_some();
    let (tile_m, tile_n) = if own && c_in_place && m >= OWN_MIN_ROWS {
        (m, n)
    } else {
        (block, block)
    };
    // The (j0, p0) of the B tile in b_buf, to reuse it across m blocks.
    let mut b_tile: Option<(usize, usize)> = None;
    for j0 in (0..n).step_by(tile_n) {
        let cols = tile_n.min(n - j0);
        for i0 in (0..m).step_by(tile_m) {
            let rows = tile_m.min(m - i0);
            let own_tile = own && rows >= OWN_MIN_ROWS;
            // The f32 C tile: c itself when f32, else c_buf (loaded when accumulating).
            let (ct, ldt): (&mut [f32], usize) = match as_f32_mut(&mut *c) {
                Some(c) => (&mut c[i0 * ldc + j0..], ldc),
                None => {
                    if accumulate {
                        widen_window(c_buf, c, ldc, (i0, rows), (j0, cols));
                    }
                    (&mut c_buf[..rows * cols], cols)
                }
            };
            // Whether ct holds values to accumulate onto (else sgemm overwrites it).
            let mut read_ct = accumulate;
            if let Some(bias) = bias {
                let bias = &bias[j0..j0 + cols];
                par_rows_mut(ct, ldt, rows, cols, |_, row| {
                    for (o, &b) in row.iter_mut().zip(bias) {
                        *o = if accumulate {
                            *o + b.to_f32()
                        } else {
                            b.to_f32()
                        };
                    }
                });
                read_ct = true;
            }
            if k == 0 && !read_ct {
                par_rows_mut(ct, ldt, rows, cols, |_, row| row.fill(0.0));
            }
            let k_step = if own_tile { k.max(1) } else { block };
            for p0 in (0..k).step_by(k_step) {
                let kk = k_step.min(k - p0);
                // Stored windows: op(a)[i0.., p0..] and op(b)[p0.., j0..].
                let a_win = if a_trans {
                    ((p0, kk), (i0, rows))
                } else {
                    ((i0, rows), (p0, kk))
                };
                let b_win = if b_trans {
                    ((j0, cols), (p0, kk))
                } else {
                    ((p0, kk), (j0, cols))
                };
                if let (Some(dot), Some(a), Some(b)) = (dot, dot_operand(a), dot_operand(b)) {
                    // On the dot-product kernel: no widening; the A/B tile buffers are its
                    // packing scratch.
                    let pack = as_words(&mut ab_buf[..]);
                    gemm_bf16(
                        dot,
                        (rows, cols, kk),
                        (a.from(a_win.0.0 * lda + a_win.1.0), lda, a_trans),
                        (b.from(b_win.0.0 * ldb + b_win.1.0), ldb, b_trans),
                        (&mut *ct, ldt),
                        read_ct || p0 > 0,
                        pack,
                    );
                    continue;
                }
                #[cfg(target_arch = "x86_64")]
                if let (true, Some((ao, bo))) = (own_tile, own_operands) {
                    // Widening as it packs: the same f32 products, no widening pass (the
                    // whole reduction, and the whole product where c is f32: see the module
                    // documentation).
                    let a_at = a_win.0.0 * lda + a_win.1.0;
                    let b_at = b_win.0.0 * ldb + b_win.1.0;
                    let (ao, bo) = (ao.from(a_at), bo.from(b_at));
                    let (dims, acc) = ((rows, cols, kk), read_ct || p0 > 0);
                    macro_rules! own {
                        ($a:expr, $b:expr) => {
                            own_sgemm(
                                dims,
                                1.0,
                                ($a, lda, a_trans),
                                ($b, ldb, b_trans),
                                ct,
                                ldt,
                                acc,
                                None,
                            )
                        };
                    }
                    // SAFETY: `check_windows` proved the whole windows in bounds, so
                    // these sub-windows are; kk > 0.
                    unsafe {
                        match (ao, bo) {
                            (Operand::F32(a), Operand::F32(b)) => own!(a, b),
                            (Operand::F32(a), Operand::Bf16(b)) => own!(a, b),
                            (Operand::Bf16(a), Operand::F32(b)) => own!(a, b),
                            (Operand::Bf16(a), Operand::Bf16(b)) => own!(a, b),
                        }
                    }
                    continue;
                }
                let (a_buf, b_buf) = ab_buf.split_at_mut(block * block);
                widen_window(a_buf, a, lda, a_win.0, a_win.1);
                if b_tile != Some((j0, p0)) {
                    widen_window(b_buf, b, ldb, b_win.0, b_win.1);
                    b_tile = Some((j0, p0));
                }
                let (at, lat) = view(a, lda, a_win.0.0, a_win.1.0, a_win.1.1, a_buf);
                let (bt, lbt) = view(b, ldb, b_win.0.0, b_win.1.0, b_win.1.1, b_buf);
                sgemm(
                    rows,
                    cols,
                    kk,
                    1.0,
                    at,
                    lat,
                    a_trans,
                    bt,
                    lbt,
                    b_trans,
                    ct,
                    ldt,
                    read_ct || p0 > 0,
                );
            }
            if !c_in_place {
                let ct = &c_buf[..rows * cols];
                par_rows_mut(&mut c[i0 * ldc + j0..], ldc, rows, cols, |r, row| {
                    narrow_row(row, &ct[r * cols..(r + 1) * cols]);
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::naive;
    use super::*;
    use crate::backend::cpu::reduce::testutil::*;
    use half::f16;

    fn round_to<T: Elem>(v: &[f32]) -> Vec<T> {
        v.iter().map(|&x| T::from_f32(x)).collect()
    }

    fn widened<T: Elem>(v: &[T]) -> Vec<f32> {
        v.iter().map(|x| x.to_f32()).collect()
    }

    /// Ulp-scale relative tolerance of storing into `T` (a rounding may differ by one ulp
    /// from the reference's when the f32 sums differ in the last bits).
    fn rtol<T: Elem>() -> f32 {
        match T::NAME {
            "bf16" => 1.0 / 128.0,
            "f16" => 1.0 / 1024.0,
            _ => 1e-5,
        }
    }

    /// Runs fast (tiles of `block`) and naive on one problem and compares; also checks that
    /// the row padding of c is untouched.
    #[allow(clippy::too_many_arguments)]
    fn check<A: Elem, B: Elem, C: Elem>(
        block: usize,
        (m, n, k): (usize, usize, usize),
        a_trans: bool,
        b_trans: bool,
        accumulate: bool,
        seed: u64,
    ) {
        let (ar, ac) = if a_trans { (k, m) } else { (m, k) };
        let (br, bc) = if b_trans { (n, k) } else { (k, n) };
        let (lda, ldb, ldc) = (ac + 3, bc + 1, n + 2);
        let a: Vec<A> = round_to(&randn(ar * lda, 1.0, seed));
        let b: Vec<B> = round_to(&randn(br * ldb, 1.0, seed + 1));
        let c0: Vec<C> = round_to(&randn(m * ldc, 4.0, seed + 2));
        let (mut got, mut want) = (c0.clone(), c0.clone());
        let mut ws = vec![f32::NAN; workspace_len(block)];
        // The widening path unless a test chose one (the dot-product path rounds an f32
        // operand to bf16, which the naive twin does not).
        let path = FORCED_DOT.with(|d| d.get()).unwrap_or(None);
        with_dot(path, || {
            gemm_mixed_blocked(
                block,
                (m, n, k),
                (&a, lda, a_trans),
                (&b, ldb, b_trans),
                (&mut got, ldc),
                accumulate,
                None::<&[f32]>,
                &mut ws,
            )
        });
        naive::gemm_mixed(
            m, n, k, &a, lda, a_trans, &b, ldb, b_trans, &mut want, ldc, accumulate,
        );
        let what = format!(
            "{}x{}x{} {}·{}→{} ta={a_trans} tb={b_trans} acc={accumulate} block={block}",
            m,
            n,
            k,
            A::NAME,
            B::NAME,
            C::NAME
        );
        let (g, w) = (widened(&got), widened(&want));
        assert_close(&g, &w, 2e-5 * (k as f32).sqrt(), rtol::<C>(), &what);
        for i in 0..m {
            let pad = i * ldc + n..(i + 1) * ldc;
            assert_eq!(&got[pad.clone()], &c0[pad], "{what}: padding of row {i}");
        }
    }

    fn check_all_flags<A: Elem, B: Elem, C: Elem>(block: usize, shape: (usize, usize, usize)) {
        for a_trans in [false, true] {
            for b_trans in [false, true] {
                for accumulate in [false, true] {
                    let seed = (a_trans as u64) * 4 + (b_trans as u64) * 2 + accumulate as u64;
                    check::<A, B, C>(block, shape, a_trans, b_trans, accumulate, 10 * seed);
                }
            }
        }
    }

    thread_local! {
        /// Overrides [`bf16_dot`] on this test thread (Some(choice)).
        pub(super) static FORCED_DOT: std::cell::Cell<Option<Option<Dot>>> =
            const { std::cell::Cell::new(None) };
    }

    /// Runs `f` with bf16 × bf16 products on `dot` (None: the widening path) on this thread;
    /// returns how many `gemm_bf16` calls it made.
    fn with_dot(dot: Option<Dot>, f: impl FnOnce()) -> usize {
        let before = super::super::bf16_dot::CALLS.with(|c| c.get());
        let outer = FORCED_DOT.with(|d| d.replace(Some(dot)));
        f();
        FORCED_DOT.with(|d| d.set(outer));
        super::super::bf16_dot::CALLS.with(|c| c.get()) - before
    }

    #[test]
    #[ignore = "needs AVX-512F/BW/VL"]
    fn bf16_dot_path_matches_naive_avx512() {
        // The emulated instruction runs the dot-product path's packing, blocking and kernel
        // on any AVX-512 CPU (the hardware variant is compared with it where it exists).
        Dot::Emulated.require();
        let calls = with_dot(Some(Dot::Emulated), || {
            for block in [16, 64] {
                for &shape in &SMALL {
                    check_all_flags::<bf16, bf16, f32>(block, shape);
                    check_all_flags::<bf16, bf16, bf16>(block, shape);
                }
            }
            check_all_flags::<bf16, bf16, bf16>(MIXED_BLOCK, (1100, 37, 2100));
        });
        // One call per (tile, k block).
        assert!(
            calls >= 2 * 2 * 5 * 8,
            "the dot-product path ran {calls} times"
        );
        // f16 operands and f32 × f32 products keep the widening path.
        let none = with_dot(Some(Dot::Emulated), || {
            check_all_flags::<f16, f16, f16>(16, (3, 40, 17));
            check_all_flags::<f16, f32, f32>(16, (3, 40, 17));
            let (a, b) = (randn(6 * 5, 1.0, 1), randn(5 * 7, 1.0, 2));
            let mut c = vec![bf16::ZERO; 6 * 7];
            let mut ws = vec![0.0; workspace_len(16)];
            gemm_mixed_blocked(
                16,
                (6, 7, 5),
                (&a, 5, false),
                (&b, 7, false),
                (&mut c, 7),
                false,
                None::<&[f32]>,
                &mut ws,
            );
        });
        assert_eq!(none, 0, "only bf16 products take the dot-product path");
        // A workspace too small to pack into falls back to widening (block 4: 32 words).
        let tiny = with_dot(Some(Dot::Emulated), || {
            check_all_flags::<bf16, bf16, f32>(4, (9, 9, 9))
        });
        assert_eq!(tiny, 0);
    }

    #[test]
    #[ignore = "needs AVX-512F/BW/VL"]
    fn bf16_dot_path_rounds_f32_operands_to_bf16_avx512() {
        // bf16 activations × f32 master weights: the weights are rounded to bf16 as they are
        // packed, so the product equals the one with a bf16 copy of the weights.
        Dot::Emulated.require();
        let (m, n, k) = (70, 90, 150);
        let a: Vec<bf16> = round_to(&randn(m * k, 1.0, 5));
        let w = randn(k * n, 1.0, 6);
        let w16: Vec<bf16> = round_to(&w);
        for b_trans in [false, true] {
            let ld = if b_trans { k } else { n };
            // a @ w on the given path; returns the product and the dot-product calls made.
            fn product<W: Elem>(
                dot: Option<Dot>,
                (m, n, k, ld, b_trans): (usize, usize, usize, usize, bool),
                a: &[bf16],
                w: &[W],
            ) -> (Vec<f32>, usize) {
                let mut c = vec![0.0f32; m * n];
                let mut ws = vec![0.0; workspace_len(64)];
                let calls = with_dot(dot, || {
                    let (b, cc) = ((w, ld, b_trans), (&mut c[..], n));
                    gemm_mixed_blocked(
                        64,
                        (m, n, k),
                        (a, k, false),
                        b,
                        cc,
                        false,
                        None::<&[f32]>,
                        &mut ws,
                    )
                });
                (c, calls)
            }
            let shape = (m, n, k, ld, b_trans);
            let (exact, _) = product(None, shape, &a, &w);
            let (exact16, _) = product(None, shape, &a, &w16);
            let (x, used) = product(Some(Dot::Emulated), shape, &a, &w);
            let (y, _) = product(Some(Dot::Emulated), shape, &a, &w16);
            assert!(used > 0);
            assert_eq!(x, y, "b_trans={b_trans}: f32 operand rounded while packed");
            // The widening path uses the f32 operand exactly (no rounding), so the two differ
            // there; the rounded result stays within bf16 accuracy of it.
            assert_ne!(exact, exact16);
            // Each weight moves by up to 2^-9 of itself: sums of k such errors.
            let tol = (k as f32).sqrt() / 50.0;
            assert_close(&x, &exact, tol, 1.0 / 64.0, "rounded vs exact f32 weights");
        }
    }

    /// Shapes with several partial tiles in every dimension for blocks of 16 and 32.
    const SMALL: [(usize, usize, usize); 5] = [
        (1, 1, 1),
        (3, 40, 17),
        (37, 5, 70),
        (50, 33, 100),
        (16, 32, 48),
    ];

    #[test]
    fn blocked_matches_naive_small_blocks() {
        for block in [16, 32] {
            for &shape in &SMALL {
                check_all_flags::<bf16, bf16, f32>(block, shape);
                check_all_flags::<bf16, bf16, bf16>(block, shape);
                check_all_flags::<f16, f16, f32>(block, shape);
                check_all_flags::<f16, f16, bf16>(block, shape);
                check_all_flags::<f16, f16, f16>(block, shape);
                // Operands stored as f32 are read in place.
                check_all_flags::<f32, bf16, bf16>(block, shape);
                check_all_flags::<bf16, f32, f32>(block, shape);
            }
        }
    }

    #[test]
    fn full_blocks_on_shapes_that_are_not_multiples() {
        // Partial m and k tiles of MIXED_BLOCK (1100 = 1024 + 76, 2100 = 2·1024 + 52).
        let shape = (1100, 37, 2100);
        check_all_flags::<bf16, bf16, bf16>(MIXED_BLOCK, shape);
        check::<f16, f16, f32>(MIXED_BLOCK, shape, true, false, true, 7);
        check::<bf16, bf16, f32>(MIXED_BLOCK, shape, false, true, false, 8);
        // And many tiles of a small block on the same shape.
        check::<bf16, bf16, bf16>(100, shape, true, true, true, 9);
    }

    #[test]
    fn public_entry_matches_naive() {
        let (m, n, k) = (70, 45, 90);
        let a: Vec<bf16> = round_to(&randn(m * k, 1.0, 1));
        let b: Vec<bf16> = round_to(&randn(n * k, 1.0, 2));
        let c0: Vec<bf16> = round_to(&randn(m * n, 1.0, 3));
        let (mut got, mut want) = (c0.clone(), c0.clone());
        let mut ws = vec![0.0; gemm_mixed_workspace_len()];
        gemm_mixed(
            m, n, k, &a, k, false, &b, k, true, &mut got, n, true, &mut ws,
        );
        naive::gemm_mixed(m, n, k, &a, k, false, &b, k, true, &mut want, n, true);
        let (g, w) = (widened(&got), widened(&want));
        assert_close(&g, &w, 1e-3, rtol::<bf16>(), "public gemm_mixed");
    }

    #[test]
    fn tiny_and_empty_shapes() {
        let mut ws = vec![0.0; workspace_len(4)];
        let one = [bf16::from_f32(1.5)];
        let two = [bf16::from_f32(-2.0)];
        // 1x1x1, overwrite and accumulate.
        let mut c = [bf16::from_f32(7.0)];
        gemm_mixed_blocked(
            4,
            (1, 1, 1),
            (&one, 1, false),
            (&two, 1, true),
            (&mut c, 1),
            false,
            None::<&[f32]>,
            &mut ws,
        );
        assert_eq!(c[0].to_f32(), -3.0);
        gemm_mixed_blocked(
            4,
            (1, 1, 1),
            (&one, 1, true),
            (&two, 1, false),
            (&mut c, 1),
            true,
            None::<&[f32]>,
            &mut ws,
        );
        assert_eq!(c[0].to_f32(), -6.0);
        // k = 0: overwrite zeroes the window (not the padding), accumulate leaves it.
        for accumulate in [false, true] {
            let mut c = vec![bf16::from_f32(5.0); 2 * 4];
            let mut c32 = vec![5.0f32; 2 * 4];
            let none: [bf16; 0] = [];
            gemm_mixed_blocked(
                4,
                (2, 3, 0),
                (&none, 0, false),
                (&none, 3, false),
                (&mut c, 4),
                accumulate,
                None::<&[f32]>,
                &mut ws,
            );
            gemm_mixed_blocked(
                4,
                (2, 3, 0),
                (&none, 0, false),
                (&none, 3, false),
                (&mut c32, 4),
                accumulate,
                None::<&[f32]>,
                &mut ws,
            );
            let v = if accumulate { 5.0 } else { 0.0 };
            let want = vec![v, v, v, 5.0, v, v, v, 5.0];
            assert_eq!(widened(&c), want, "k=0 bf16 acc={accumulate}");
            assert_eq!(c32, want, "k=0 f32 acc={accumulate}");
        }
        // m = 0 and n = 0 touch nothing.
        let mut ws = vec![0.0; gemm_mixed_workspace_len()];
        let mut c = vec![bf16::from_f32(5.0); 3];
        let a = vec![bf16::from_f32(1.0); 6];
        let none: &[bf16] = &[];
        gemm_mixed(
            0, 3, 2, none, 2, false, &a, 3, false, &mut c, 3, false, &mut ws,
        );
        gemm_mixed(
            3, 0, 2, &a, 2, false, none, 2, true, &mut c, 1, false, &mut ws,
        );
        assert_eq!(widened(&c), vec![5.0; 3]);
    }

    #[test]
    #[should_panic(expected = "gemm_mixed: workspace has")]
    fn short_workspace_panics() {
        let a = vec![bf16::from_f32(1.0); 4];
        let mut c = vec![0.0f32; 4];
        let mut ws = vec![0.0; gemm_mixed_workspace_len() - 1];
        gemm_mixed(
            2, 2, 2, &a, 2, false, &a, 2, false, &mut c, 2, false, &mut ws,
        );
    }

    #[test]
    fn all_f32_is_exactly_sgemm() {
        let (m, n, k) = (90, 130, 70);
        let a = randn(k * (m + 1), 1.0, 1); // stored [k, m + 1], transposed
        let b = randn(k * n, 1.0, 2);
        let c0 = randn(m * (n + 3), 1.0, 3);
        for accumulate in [false, true] {
            let (mut c1, mut c2) = (c0.clone(), c0.clone());
            with_threads(3, || {
                gemm_mixed(
                    m,
                    n,
                    k,
                    &a,
                    m + 1,
                    true,
                    &b,
                    n,
                    false,
                    &mut c1,
                    n + 3,
                    accumulate,
                    &mut [],
                );
                sgemm(
                    m,
                    n,
                    k,
                    1.0,
                    &a,
                    m + 1,
                    true,
                    &b,
                    n,
                    false,
                    &mut c2,
                    n + 3,
                    accumulate,
                );
            });
            assert!(c1 == c2, "f32 path differs from sgemm (acc={accumulate})");
            // And it is a real product (sgemm is checked against naive in gemm::f32).
            let mut c3 = c0.clone();
            naive::sgemm(
                m,
                n,
                k,
                1.0,
                &a,
                m + 1,
                true,
                &b,
                n,
                false,
                &mut c3,
                n + 3,
                accumulate,
            );
            assert_close(&c1, &c3, 1e-4, 1e-5, "f32 path vs naive");
        }
    }

    #[test]
    fn identical_for_one_and_three_threads() {
        let (m, n, k) = (300, 260, 530);
        let a: Vec<bf16> = round_to(&randn(m * k, 1.0, 1));
        let b: Vec<f16> = round_to(&randn(k * n, 1.0, 2));
        let c0: Vec<bf16> = round_to(&randn(m * n, 1.0, 3));
        let run = |block: usize| {
            let mut c = c0.clone();
            let mut ws = vec![0.0; workspace_len(block)];
            gemm_mixed_blocked(
                block,
                (m, n, k),
                (&a, k, false),
                (&b, n, false),
                (&mut c, n),
                true,
                None::<&[f32]>,
                &mut ws,
            );
            c
        };
        for block in [128, MIXED_BLOCK] {
            let r1 = with_threads(1, || run(block));
            let r3 = with_threads(3, || run(block));
            let r3b = with_threads(3, || run(block));
            assert!(
                r3 == r3b,
                "not deterministic with 3 threads (block {block})"
            );
            assert!(r1 == r3, "1 and 3 threads differ (block {block})");
            assert!(r1 != c0, "nothing computed");
        }
    }
}
