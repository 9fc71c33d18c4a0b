//! Token + position embedding: `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]`.
//!
//! The token table may be a tensor-parallel rank's part of the vocabulary: its rows are the
//! token ids `first_token..first_token + V`, a token outside them gives a zero row (only
//! `wpe`'s) in the forward and nothing in the backward; the ranks' outputs are summed
//! elsewhere. (Tokens past the model's vocabulary are refused before work starts, where the
//! data is checked against the model.)
//!
//! The backward is a scatter-add made deterministic without atomics or workspace: the token
//! table gradient is split into fixed blocks of vocabulary rows, and each task walks all tokens
//! in order, adding only those that fall into its block; the position gradient is split over
//! positions, each summing its batch rows in order. Every element therefore receives its
//! contributions in token order, so results are identical for any thread count.
//!
//! Storage type `T` ([`Elem`]: f32, bf16, f16) for the tables, activations and gradients;
//! arithmetic in f32. The forward rounds each sum once; the backward adds all of a call's
//! contributions to an element in f32 and rounds once (for narrow types through f32 stack
//! accumulators, see [`encoder_backward`]), so the result for any `T` is the f32 kernel's
//! result on the widened inputs, rounded to `T`.

use super::features::multiversion;
use super::reduce::rows_per_task;
use crate::dtype::{Elem, is_f32};
use rayon::prelude::*;

/// Vocabulary rows per task in `encoder_backward` for f32 (each task scans all B·T tokens once).
const VOCAB_ROWS_PER_TASK: usize = 512;

/// Vocabulary rows per task in `encoder_backward` for narrow storage types: the rows of one
/// task, in column slices of [`ACC_COLS`], are accumulated in an f32 stack buffer.
const ACC_ROWS: usize = 128;

/// Column-slice width of the f32 accumulators of the narrow-type backward (the stack buffer
/// is `[ACC_ROWS, ACC_COLS]` f32 = 32 KiB).
const ACC_COLS: usize = 64;

/// Token positions a narrow-type backward task lists on the stack (16 KiB) after one scan of
/// the tokens; a task whose rows occur more often than this rescans the tokens once per
/// column slice instead (same additions in the same order).
const HIT_CAP: usize = 4096;

/// `out = scale · wte[tokens] (+ wpe[position] when given), in f32 and rounded once to T`
/// (`scale` is Gemma's √C, 1 elsewhere: a product by 1 is exact).
/// A row's position is `t` in its sequence, or `positions[b, t]` when given (rows that pack
/// several examples: the position inside the row's example). `wte`'s rows are the token ids
/// `first_token..`; a token outside them has a zero row.
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward<T: Elem, W: Elem>(
    out: &mut [T],             // [B, T, C]
    tokens: &[u32],            // [B, T]
    wte: &[W],                 // [V, C]: token ids first_token..first_token + V
    wpe: Option<&[W]>,         // [maxT, C], only the first T rows used (learned positions)
    positions: Option<&[u32]>, // [B, T], each below T
    first_token: usize,
    scale: f32,
    b: usize,
    t: usize,
    c: usize,
) {
    assert_eq!(out.len(), b * t * c, "encoder_forward: out");
    assert_eq!(tokens.len(), b * t, "encoder_forward: tokens");
    assert!(
        wpe.is_none_or(|w| w.len() >= t * c),
        "encoder_forward: wpe has fewer than T rows"
    );
    check_positions(positions, b, t, "encoder_forward");
    if c == 0 || out.is_empty() {
        return;
    }
    assert_eq!(wte.len() % c, 0, "encoder_forward: wte");
    let v = wte.len() / c;
    let rows = rows_per_task(c);
    out.par_chunks_mut(rows * c)
        .enumerate()
        .for_each(|(ti, o)| {
            let r0 = ti * rows;
            for (i, o) in o.chunks_exact_mut(c).enumerate() {
                let r = r0 + i;
                let row = (tokens[r] as usize).wrapping_sub(first_token); // wraps below
                let e = (row < v).then(|| &wte[row * c..(row + 1) * c]);
                let p = wpe.map(|wpe| {
                    let pos = positions.map_or(r % t, |p| p[r] as usize);
                    &wpe[pos * c..(pos + 1) * c]
                });
                match (e, p) {
                    (Some(e), Some(p)) => {
                        for ((o, &e), &p) in o.iter_mut().zip(e).zip(p) {
                            *o = T::from_f32(e.to_f32() * scale + p.to_f32());
                        }
                    }
                    (Some(e), None) => {
                        for (o, &e) in o.iter_mut().zip(e) {
                            *o = T::from_f32(e.to_f32() * scale);
                        }
                    }
                    (None, Some(p)) => {
                        for (o, &p) in o.iter_mut().zip(p) {
                            *o = T::from_f32(p.to_f32());
                        }
                    }
                    (None, None) => o.fill(T::from_f32(0.0)),
                }
            }
        });
}

/// `dwte[tokens[b, t]] += scale · dout[b, t]; dwpe[t] += Σ_b dout[b, t]` (when given; with
/// `positions`, `dwpe[positions[r]] += dout[r]` over the rows `r` in order).
///
/// Every element receives its contributions in token order, added in f32 to its widened
/// value and rounded to `T` once per call (a token that occurs k times is not rounded k
/// times). For f32 each task adds straight into its block of `dwte`; for narrower types each
/// task owns `ACC_ROWS` vocabulary rows, lists the positions of its tokens in one scan, and
/// accumulates `ACC_COLS` columns at a time in an f32 stack buffer. `dwte`'s rows are the
/// token ids `first_token..`: a token outside them adds nothing to it.
#[allow(clippy::too_many_arguments)]
pub fn encoder_backward<T: Elem>(
    dwte: &mut [T],            // [V, C] +=: token ids first_token..first_token + V
    dwpe: Option<&mut [T]>,    // [maxT, C] +=, only the first T rows touched (learned positions)
    dout: &[T],                // [B, T, C]
    tokens: &[u32],            // [B, T]
    positions: Option<&[u32]>, // [B, T], each below T
    first_token: usize,
    scale: f32,
    b: usize,
    t: usize,
    c: usize,
) {
    assert_eq!(dout.len(), b * t * c, "encoder_backward: dout");
    assert_eq!(tokens.len(), b * t, "encoder_backward: tokens");
    assert!(
        dwpe.as_ref().is_none_or(|w| w.len() >= t * c),
        "encoder_backward: dwpe has fewer than T rows"
    );
    check_positions(positions, b, t, "encoder_backward");
    if c == 0 || dout.is_empty() {
        return;
    }
    assert_eq!(dwte.len() % c, 0, "encoder_backward: dwte");
    if is_f32::<T>() {
        dwte.par_chunks_mut(VOCAB_ROWS_PER_TASK * c)
            .enumerate()
            .for_each(|(bi, block)| {
                let lo = first_token + bi * VOCAB_ROWS_PER_TASK;
                let hi = lo + block.len() / c;
                for (&tok, dy) in tokens.iter().zip(dout.chunks_exact(c)) {
                    let tok = tok as usize;
                    if tok >= lo && tok < hi {
                        let d = &mut block[(tok - lo) * c..(tok - lo + 1) * c];
                        for (d, &g) in d.iter_mut().zip(dy) {
                            *d = T::from_f32(d.to_f32() + scale * g.to_f32());
                        }
                    }
                }
            });
    } else {
        dwte.par_chunks_mut(ACC_ROWS * c)
            .enumerate()
            .for_each(|(bi, block)| {
                dwte_block_acc(block, first_token + bi * ACC_ROWS, dout, tokens, scale, c)
            });
    }
    let Some(dwpe) = dwpe else {
        return;
    };
    let rows = rows_per_task(c * b.max(1));
    dwpe[..t * c]
        .par_chunks_mut(rows * c)
        .enumerate()
        .for_each(|(pi, block)| dwpe_block(block, pi * rows, dout, positions, b, t, c));
}

/// Panics unless `positions` (when given) is `[B, T]` with every position below T.
fn check_positions(positions: Option<&[u32]>, b: usize, t: usize, name: &str) {
    if let Some(p) = positions {
        assert_eq!(p.len(), b * t, "{name}: positions must be [B, T]");
        assert!(
            p.iter().all(|&x| (x as usize) < t),
            "{name}: a position at or past T = {t}"
        );
    }
}

multiversion! {
    /// dwte rows `lo..lo + block.len()/C` (at most [`ACC_ROWS`]) for a narrow storage type:
    /// per column slice of [`ACC_COLS`], walk the positions whose token is in the block in
    /// order (listed once, or rescanned if more than [`HIT_CAP`]), adding each one's dout
    /// slice into an f32 accumulator row (initialised from the row's stored value at its first
    /// hit), then round the rows that were hit back into `block`.
    fn dwte_block_acc<T: Elem>(
        block: &mut [T], // [rows <= ACC_ROWS, C] +=
        lo: usize,
        dout: &[T],      // [N, C]
        tokens: &[u32],  // [N]
        scale: f32,
        c: usize,
    ) {
        let rows = block.len() / c;
        let ours = |tok: u32| (tok as usize).wrapping_sub(lo) < rows; // wraps when tok < lo
        let nhit = tokens.iter().filter(|t| ours(**t)).count();
        if nhit == 0 {
            return; // common when B·T is small next to V: skip the stack buffers
        }
        let listed = nhit <= HIT_CAP;
        let mut hits = [0u32; HIT_CAP]; // positions r with tokens[r] in the block, in order
        if listed {
            let it = tokens.iter().enumerate().filter(|(_, t)| ours(**t));
            for (h, (r, _)) in hits.iter_mut().zip(it) {
                *h = r as u32;
            }
        }
        let mut acc = [0.0f32; ACC_ROWS * ACC_COLS]; // [ACC_ROWS, ACC_COLS]
        let mut c0 = 0;
        while c0 < c {
            let w = ACC_COLS.min(c - c0);
            let mut hit = [false; ACC_ROWS];
            let mut add = |r: usize| {
                let k = tokens[r] as usize - lo;
                let a = &mut acc[k * ACC_COLS..k * ACC_COLS + w];
                if !hit[k] {
                    hit[k] = true;
                    for (a, &d) in a.iter_mut().zip(&block[k * c + c0..k * c + c0 + w]) {
                        *a = d.to_f32();
                    }
                }
                for (a, &g) in a.iter_mut().zip(&dout[r * c + c0..r * c + c0 + w]) {
                    *a += scale * g.to_f32();
                }
            };
            if listed {
                hits[..nhit].iter().for_each(|&r| add(r as usize));
            } else {
                let it = tokens.iter().enumerate().filter(|(_, t)| ours(**t));
                it.for_each(|(r, _)| add(r));
            }
            for (k, _) in hit[..rows].iter().enumerate().filter(|(_, h)| **h) {
                let a = &acc[k * ACC_COLS..k * ACC_COLS + w];
                for (d, &a) in block[k * c + c0..k * c + c0 + w].iter_mut().zip(a) {
                    *d = T::from_f32(a);
                }
            }
            c0 += w;
        }
    }
}

/// Width of the column slices the position gradient is accumulated over in f32.
const POS_COLS: usize = 256;

multiversion! {
    /// dwpe rows `p0..p0 + block.len()/C`: each element is widened, gets its contributions
    /// in row order in f32 (row t of each sequence, or with `positions` every row at that
    /// position), and is rounded back once.
    fn dwpe_block<T: Elem>(
        block: &mut [T], // [rows, C] +=: positions p0..
        p0: usize,
        dout: &[T],      // [B, T, C]
        positions: Option<&[u32]>, // [B, T]
        b: usize,
        t: usize,
        c: usize,
    ) {
        for (i, d) in block.chunks_exact_mut(c).enumerate() {
            let pos = p0 + i;
            for (ci, d) in d.chunks_mut(POS_COLS).enumerate() {
                let c0 = ci * POS_COLS;
                let mut acc = [0.0f32; POS_COLS];
                let acc = &mut acc[..d.len()];
                for (a, &v) in acc.iter_mut().zip(d.iter()) {
                    *a = v.to_f32();
                }
                let mut add = |r: usize| {
                    let dy = &dout[r * c + c0..][..acc.len()];
                    for (a, &g) in acc.iter_mut().zip(dy) {
                        *a += g.to_f32();
                    }
                };
                match positions {
                    None => (0..b).for_each(|bb| add(bb * t + pos)),
                    Some(p) => (0..b * t).filter(|&r| p[r] as usize == pos).for_each(add),
                }
                for (d, &a) in d.iter_mut().zip(acc.iter()) {
                    *d = T::from_f32(a);
                }
            }
        }
    }
}

/// Reference twins: plain loops.
pub mod naive {
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_forward(
        out: &mut [f32],           // [B, T, C]
        tokens: &[u32],            // [B, T]
        wte: &[f32],               // [V, C]: token ids first_token..
        wpe: &[f32],               // [maxT, C], only the first T rows used
        positions: Option<&[u32]>, // [B, T]
        first_token: usize,
        scale: f32,
        b: usize,
        t: usize,
        c: usize,
    ) {
        let v = wte.len() / c;
        for bb in 0..b {
            for tt in 0..t {
                let tok = tokens[bb * t + tt] as usize;
                let pos = positions.map_or(tt, |p| p[bb * t + tt] as usize);
                let held = tok >= first_token && tok < first_token + v;
                for i in 0..c {
                    let e = if held {
                        wte[(tok - first_token) * c + i]
                    } else {
                        0.0
                    };
                    out[(bb * t + tt) * c + i] = e * scale + wpe[pos * c + i];
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn encoder_backward(
        dwte: &mut [f32],          // [V, C] +=: token ids first_token..
        dwpe: &mut [f32],          // [maxT, C] +=, only the first T rows touched
        dout: &[f32],              // [B, T, C]
        tokens: &[u32],            // [B, T]
        positions: Option<&[u32]>, // [B, T]
        first_token: usize,
        scale: f32,
        b: usize,
        t: usize,
        c: usize,
    ) {
        let v = dwte.len() / c;
        for bb in 0..b {
            for tt in 0..t {
                let tok = tokens[bb * t + tt] as usize;
                let pos = positions.map_or(tt, |p| p[bb * t + tt] as usize);
                let held = tok >= first_token && tok < first_token + v;
                for i in 0..c {
                    let g = dout[(bb * t + tt) * c + i];
                    if held {
                        dwte[(tok - first_token) * c + i] += scale * g;
                    }
                    dwpe[pos * c + i] += g;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::conformance::{Case, Out, check_stored_as, stored};
    use super::super::reduce::testutil::*;
    use super::*;
    use crate::util::rng::Rng;
    use half::{bf16, f16};

    fn tokens(n: usize, v: usize, seed: u64) -> Vec<u32> {
        let mut r = Rng::new(seed);
        // Small effective vocabulary so tokens repeat (scatter-add collisions).
        (0..n)
            .map(|i| {
                if i % 3 == 0 {
                    1 % v as u32
                } else {
                    r.below(v as u64) as u32
                }
            })
            .collect()
    }

    const SHAPES: [(usize, usize, usize, usize, usize); 6] = [
        // (b, t, c, v, max_t)
        (1, 1, 1, 1, 1),
        (1, 5, 3, 7, 8),
        (3, 7, 17, 11, 9),
        (2, 64, 48, 1500, 64),
        (4, 33, 100, 700, 40),
        (1, 300, 5, 2, 300),
    ];

    #[test]
    fn forward_matches_naive() {
        for (si, &(b, t, c, v, mt)) in SHAPES.iter().enumerate() {
            let wte = randn(v * c, 1.0, si as u64);
            let wpe = randn(mt * c, 1.0, 50 + si as u64);
            let tok = tokens(b * t, v, si as u64);
            let (mut o1, mut o2) = (vec![f32::NAN; b * t * c], vec![0.0; b * t * c]);
            encoder_forward(&mut o1, &tok, &wte, Some(&wpe), None, 0, 1.0, b, t, c);
            naive::encoder_forward(&mut o2, &tok, &wte, &wpe, None, 0, 1.0, b, t, c);
            assert_eq!(o1, o2, "{b}x{t}x{c}");
        }
    }

    /// Without learned positions the forward copies the token rows (rounded to the storage
    /// type), and the backward's token gradient is the one it computes with positions.
    #[test]
    fn without_positions_is_the_token_embedding() {
        for (si, &(b, t, c, v, mt)) in SHAPES.iter().enumerate() {
            let wte = randn(v * c, 1.0, si as u64);
            let tok = tokens(b * t, v, si as u64);
            let mut out = vec![f32::NAN; b * t * c];
            encoder_forward::<f32, f32>(&mut out, &tok, &wte, None, None, 0, 1.0, b, t, c);
            for (r, row) in out.chunks_exact(c).enumerate() {
                let k = tok[r] as usize;
                assert_eq!(row, &wte[k * c..(k + 1) * c], "row {r}");
            }
            let mut narrow = vec![bf16::ZERO; b * t * c];
            encoder_forward(&mut narrow, &tok, &wte, None, None, 0, 1.0, b, t, c);
            let rounded: Vec<bf16> = out.iter().map(|&x| bf16::from_f32(x)).collect();
            assert_eq!(narrow, rounded);
            let dout = randn(b * t * c, 1.0, 100 + si as u64);
            let dwte0 = randn(v * c, 1.0, 200 + si as u64);
            let (mut with, mut without) = (dwte0.clone(), dwte0.clone());
            let mut dwpe = vec![0.0; mt * c];
            encoder_backward(
                &mut with,
                Some(&mut dwpe),
                &dout,
                &tok,
                None,
                0,
                1.0,
                b,
                t,
                c,
            );
            encoder_backward(&mut without, None, &dout, &tok, None, 0, 1.0, b, t, c);
            assert_eq!(with, without, "{b}x{t}x{c}");
        }
    }

    #[test]
    fn backward_matches_naive_and_is_thread_invariant() {
        for (si, &(b, t, c, v, mt)) in SHAPES.iter().enumerate() {
            let tok = tokens(b * t, v, si as u64);
            let dout = randn(b * t * c, 1.0, 100 + si as u64);
            let dwte0 = randn(v * c, 1.0, 200 + si as u64);
            let dwpe0 = randn(mt * c, 1.0, 300 + si as u64);
            let run = || {
                let (mut a, mut p) = (dwte0.clone(), dwpe0.clone());
                encoder_backward(&mut a, Some(&mut p), &dout, &tok, None, 0, 1.0, b, t, c);
                (a, p)
            };
            let (a1, p1) = with_threads(1, run);
            assert!(
                (a1.clone(), p1.clone()) == with_threads(3, run),
                "thread count changed result"
            );
            let (mut a2, mut p2) = (dwte0.clone(), dwpe0.clone());
            naive::encoder_backward(&mut a2, &mut p2, &dout, &tok, None, 0, 1.0, b, t, c);
            let what = format!("{b}x{t}x{c}");
            assert_close(&a1, &a2, 1e-5, 1e-5, &format!("dwte {what}"));
            assert_close(&p1, &p2, 1e-5, 1e-5, &format!("dwpe {what}"));
            // Rows of wpe beyond T are untouched.
            assert_eq!(&p1[t * c..], &dwpe0[t * c..]);
        }
    }

    /// A scale (Gemma's √C) multiplies the token rows in the forward and their gradient in
    /// the backward, not the positions': as the naive twin, for f32 and (rounded once) bf16.
    #[test]
    fn scaled_tokens() {
        let (b, t, c, v, mt) = (2, 5, 3, 6, 8);
        let scale = 24f32.sqrt();
        let (wte, wpe, tok) = (
            randn(v * c, 1.0, 1),
            randn(mt * c, 1.0, 2),
            tokens(b * t, v, 3),
        );
        let mut got = vec![f32::NAN; b * t * c];
        encoder_forward(&mut got, &tok, &wte, Some(&wpe), None, 0, scale, b, t, c);
        let mut want = vec![0.0; b * t * c];
        naive::encoder_forward(&mut want, &tok, &wte, &wpe, None, 0, scale, b, t, c);
        assert_eq!(got, want);
        let mut unscaled = vec![0.0; b * t * c];
        encoder_forward(&mut unscaled, &tok, &wte, None, None, 0, scale, b, t, c);
        assert_eq!(unscaled[0], wte[tok[0] as usize * c] * scale);
        let dout = randn(b * t * c, 1.0, 4);
        let (mut dw, mut dp) = (vec![0.0; v * c], vec![0.0; mt * c]);
        encoder_backward(&mut dw, Some(&mut dp), &dout, &tok, None, 0, scale, b, t, c);
        let (mut dw2, mut dp2) = (vec![0.0; v * c], vec![0.0; mt * c]);
        naive::encoder_backward(&mut dw2, &mut dp2, &dout, &tok, None, 0, scale, b, t, c);
        assert_close(&dw, &dw2, 1e-6, 1e-6, "scaled dwte");
        assert_close(&dp, &dp2, 1e-6, 1e-6, "dwpe unscaled");
        // bf16 storage: the f32 sums of scaled contributions, rounded once.
        let d16: Vec<bf16> = dout.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut dw16 = vec![bf16::ZERO; v * c];
        encoder_backward(&mut dw16, None, &d16, &tok, None, 0, scale, b, t, c);
        let widened: Vec<f32> = d16.iter().map(|x| x.to_f32()).collect();
        let mut dw32 = vec![0.0; v * c];
        encoder_backward(&mut dw32, None, &widened, &tok, None, 0, scale, b, t, c);
        let rounded: Vec<bf16> = dw32.iter().map(|&x| bf16::from_f32(x)).collect();
        assert_eq!(dw16, rounded);
    }

    /// Packed rows: a row's positions restart at each example, for the forward's wpe rows and
    /// the backward's dwpe; identity positions are bitwise the rows' own positions.
    #[test]
    fn given_positions() {
        let (b, t, c, v, mt) = (2, 9, 5, 7, 12);
        let wte = randn(v * c, 1.0, 1);
        let wpe = randn(mt * c, 1.0, 2);
        let tok = tokens(b * t, v, 3);
        // Row 0: examples of 4, 1 and 4 tokens; row 1: one of 9.
        let positions: Vec<u32> = [0, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8].to_vec();
        let mut got = vec![f32::NAN; b * t * c];
        encoder_forward(
            &mut got,
            &tok,
            &wte,
            Some(&wpe),
            Some(&positions),
            0,
            1.0,
            b,
            t,
            c,
        );
        let mut want = vec![0.0; b * t * c];
        naive::encoder_forward(
            &mut want,
            &tok,
            &wte,
            &wpe,
            Some(&positions),
            0,
            1.0,
            b,
            t,
            c,
        );
        assert_eq!(got, want);
        let dout = randn(b * t * c, 1.0, 4);
        let (dwte0, dwpe0) = (randn(v * c, 1.0, 5), randn(mt * c, 1.0, 6));
        let (mut a, mut p) = (dwte0.clone(), dwpe0.clone());
        encoder_backward(
            &mut a,
            Some(&mut p),
            &dout,
            &tok,
            Some(&positions),
            0,
            1.0,
            b,
            t,
            c,
        );
        let (mut a2, mut p2) = (dwte0.clone(), dwpe0.clone());
        naive::encoder_backward(
            &mut a2,
            &mut p2,
            &dout,
            &tok,
            Some(&positions),
            0,
            1.0,
            b,
            t,
            c,
        );
        assert_close(&a, &a2, 1e-6, 1e-6, "dwte");
        assert_close(&p, &p2, 1e-6, 1e-6, "dwpe");
        // Identity positions: bitwise the unpacked kernels, for f32 and bf16.
        let identity: Vec<u32> = (0..b * t).map(|r| (r % t) as u32).collect();
        let dout16: Vec<bf16> = dout.iter().map(|&x| bf16::from_f32(x)).collect();
        let dwpe16: Vec<bf16> = dwpe0.iter().map(|&x| bf16::from_f32(x)).collect();
        let dwte16: Vec<bf16> = dwte0.iter().map(|&x| bf16::from_f32(x)).collect();
        let run = |given: Option<&[u32]>| {
            let mut o = vec![f32::NAN; b * t * c];
            encoder_forward(&mut o, &tok, &wte, Some(&wpe), given, 0, 1.0, b, t, c);
            let (mut dw, mut dp) = (dwte16.clone(), dwpe16.clone());
            encoder_backward(
                &mut dw,
                Some(&mut dp),
                &dout16,
                &tok,
                given,
                0,
                1.0,
                b,
                t,
                c,
            );
            (bits(&o), bits(&dw), bits(&dp))
        };
        assert!(run(Some(&identity)) == run(None), "identity positions");
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (b, t, c, v, mt) = (2, 3, 4, 5, 4);
        let tok = vec![1, 3, 1, 1, 0, 3];
        let wte = randn(v * c, 1.0, 1);
        let wpe = randn(mt * c, 1.0, 2);
        let g = randn(b * t * c, 1.0, 3);
        let loss = |wte: &[f32], wpe: &[f32]| {
            let mut o = vec![0.0; b * t * c];
            naive::encoder_forward(&mut o, &tok, wte, wpe, None, 0, 1.0, b, t, c);
            dot(&g, &o)
        };
        let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; mt * c]);
        encoder_backward(&mut dwte, Some(&mut dwpe), &g, &tok, None, 0, 1.0, b, t, c);
        assert_close(
            &dwte,
            &fd_grad(&wte, 1e-2, |x| loss(x, &wpe)),
            1e-3,
            1e-3,
            "dwte vs fd",
        );
        assert_close(
            &dwpe,
            &fd_grad(&wpe, 1e-2, |x| loss(&wte, x)),
            1e-3,
            1e-3,
            "dwpe vs fd",
        );
    }

    /// One shape: forward and backward stored as bf16 / f16 are the f32 kernel on the widened
    /// inputs, rounded once, for any thread count.
    struct Narrow {
        shape: (usize, usize, usize, usize, usize), // (b, t, c, v, max_t)
        seed: u64,
    }

    impl Case for Narrow {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let ((b, t, c, v, mt), si) = (self.shape, self.seed);
            let tok = tokens(b * t, v, si);
            let wte: Vec<S> = stored::<T, S>(&randn(v * c, 1.0, si));
            let wpe: Vec<S> = stored::<T, S>(&randn(mt * c, 1.0, 50 + si));
            let dout: Vec<S> = stored::<T, S>(&randn(b * t * c, 1.0, 100 + si));
            let mut dwte: Vec<S> = stored::<T, S>(&randn(v * c, 1.0, 200 + si));
            let mut dwpe: Vec<S> = stored::<T, S>(&randn(mt * c, 1.0, 300 + si));
            let mut o = vec![S::from_f32(f32::NAN); b * t * c];
            encoder_forward(&mut o, &tok, &wte, Some(&wpe), None, 0, 1.0, b, t, c);
            encoder_backward(
                &mut dwte,
                Some(&mut dwpe),
                &dout,
                &tok,
                None,
                0,
                1.0,
                b,
                t,
                c,
            );
            vec![
                Out::stored("out", &o),
                Out::stored("dwte", &dwte),
                Out::stored("dwpe", &dwpe),
            ]
        }
    }

    fn narrow_is_f32_rounded<T: Elem>() {
        // The last shape has more than HIT_CAP occurrences of tokens 0..ACC_ROWS, so that
        // task takes the rescanning path; every other task lists its hits.
        let many = (1, 5000, 70, 130, 5000);
        assert!(tokens(5000, 130, 6).iter().filter(|&&t| t < 128).count() > HIT_CAP);
        for (si, &shape) in SHAPES.iter().chain([&many]).enumerate() {
            let (b, t, c, _, _) = shape;
            let case = Narrow {
                shape,
                seed: si as u64,
            };
            check_stored_as::<T>(&case, &format!("encoder {b}x{t}x{c}"));
        }
    }

    #[test]
    fn bf16_is_f32_rounded() {
        narrow_is_f32_rounded::<bf16>();
    }

    #[test]
    fn f16_is_f32_rounded() {
        narrow_is_f32_rounded::<f16>();
    }

    /// 300 unit contributions to one element: bf16 (8 significant bits) represents 300, but
    /// rounding after every addition would stall at 256 (256 + 1 rounds back to 256).
    #[test]
    fn bf16_backward_rounds_once_per_call() {
        let one = bf16::from_f32(1.0);
        // One token repeated 300 times (dwte), and one position over a batch of 300 (dwpe).
        let (b, t, c, v) = (300, 1, 70, 130);
        let tok = vec![129u32; b * t];
        let dout = vec![one; b * t * c];
        let (mut dwte, mut dwpe) = (vec![bf16::ZERO; v * c], vec![bf16::ZERO; t * c]);
        encoder_backward(
            &mut dwte,
            Some(&mut dwpe),
            &dout,
            &tok,
            None,
            0,
            1.0,
            b,
            t,
            c,
        );
        assert!(dwte[129 * c..].iter().all(|&x| x.to_f32() == 300.0), "dwte");
        assert!(dwte[..129 * c].iter().all(|&x| x == bf16::ZERO));
        assert!(dwpe.iter().all(|&x| x.to_f32() == 300.0), "dwpe");
    }

    /// Non-finite values propagate to exactly the elements they feed; nothing panics.
    #[test]
    fn non_finite_propagates() {
        let (b, t, c, v) = (2, 2, 3, 200);
        let tok = vec![3, 150, 150, 7];
        let mut dout: Vec<bf16> = narrow_vec(&randn(b * t * c, 1.0, 1));
        dout[c] = bf16::from_f32(f32::NAN); // token 150, position 1, channel 0
        dout[2] = bf16::from_f32(f32::INFINITY); // token 3, position 0, channel 2
        let (mut dwte, mut dwpe) = (vec![bf16::ZERO; v * c], vec![bf16::ZERO; t * c]);
        encoder_backward(
            &mut dwte,
            Some(&mut dwpe),
            &dout,
            &tok,
            None,
            0,
            1.0,
            b,
            t,
            c,
        );
        assert!(dwte[150 * c].is_nan() && dwpe[c].is_nan());
        assert!(dwte[3 * c + 2].is_infinite() && dwpe[2].is_infinite());
        let finite = |x: &[bf16]| x.iter().filter(|v| v.is_finite()).count();
        assert_eq!(finite(&dwte), v * c - 2);
        assert_eq!(finite(&dwpe), t * c - 2);
        let mut out = vec![bf16::ZERO; b * t * c];
        let mut wte = vec![bf16::ONE; v * c];
        wte[7 * c + 1] = bf16::NAN; // token 7: row 3
        let mut wpe = vec![bf16::ONE; t * c];
        wpe[2] = bf16::INFINITY; // position 0: rows 0 and 2
        encoder_forward(&mut out, &tok, &wte, Some(&wpe), None, 0, 1.0, b, t, c);
        assert!(out[3 * c + 1].is_nan() && out[2].is_infinite() && out[2 * c + 2].is_infinite());
        assert_eq!(finite(&out), b * t * c - 3);
    }

    #[test]
    fn a_part_of_the_vocabulary_holds_its_tokens_and_zero_rows_for_the_others() {
        let (b, t, c, v) = (2, 5, 6, 11);
        let tok = tokens(b * t, v, 4);
        let (wte, wpe, dout) = (
            randn(v * c, 1.0, 5),
            randn(t * c, 1.0, 6),
            randn(b * t * c, 1.0, 7),
        );
        let mut whole = vec![0.0; b * t * c];
        encoder_forward(&mut whole, &tok, &wte, Some(&wpe), None, 0, 1.0, b, t, c);
        let (mut dwhole, mut dpos) = (vec![0.0; v * c], vec![0.0; t * c]);
        encoder_backward(
            &mut dwhole,
            Some(&mut dpos),
            &dout,
            &tok,
            None,
            0,
            1.0,
            b,
            t,
            c,
        );
        // Three ranks' parts, the first adding the positions: their sum is the whole.
        let mut sum = vec![0.0f32; b * t * c];
        let mut dparts = Vec::new();
        for (r, part) in [0..3, 3..7, 7..11].into_iter().enumerate() {
            let table = &wte[part.start * c..part.end * c];
            let mut out = vec![f32::NAN; b * t * c];
            let pos = (r == 0).then_some(&wpe[..]);
            encoder_forward(&mut out, &tok, table, pos, None, part.start, 1.0, b, t, c);
            let mut twin = vec![0.0; b * t * c];
            let zeros = vec![0.0; t * c];
            let twin_pos = if r == 0 { &wpe[..] } else { &zeros[..] };
            naive::encoder_forward(
                &mut twin, &tok, table, twin_pos, None, part.start, 1.0, b, t, c,
            );
            assert_eq!(out, twin, "part {part:?}");
            sum.iter_mut().zip(&out).for_each(|(s, o)| *s += o);
            let mut d = vec![0.0; part.len() * c];
            encoder_backward(&mut d, None, &dout, &tok, None, part.start, 1.0, b, t, c);
            dparts.extend(d);
        }
        assert_eq!(sum, whole);
        assert_eq!(dparts, dwhole);
    }
}
