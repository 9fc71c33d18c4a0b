//! Token + position embedding: `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]`.
//!
//! The backward is a scatter-add made deterministic without atomics or workspace: the token
//! table gradient is split into fixed blocks of vocabulary rows, and each task walks all tokens
//! in order, adding only those that fall into its block; the position gradient is split over
//! positions, each summing its batch rows in order. Every element therefore receives its
//! contributions in token order, so results are identical for any thread count.

use super::reduce::rows_per_task;
use rayon::prelude::*;

/// Vocabulary rows per task in `encoder_backward` (each task scans all B·T tokens once).
const VOCAB_ROWS_PER_TASK: usize = 512;

/// out = wte[tokens] + wpe[position].
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward(
    out: &mut [f32], // [B, T, C]
    tokens: &[u32],  // [B, T]
    wte: &[f32],     // [V, C]
    wpe: &[f32],     // [maxT, C], only the first T rows used
    b: usize,
    t: usize,
    c: usize,
) {
    assert_eq!(out.len(), b * t * c, "encoder_forward: out");
    assert_eq!(tokens.len(), b * t, "encoder_forward: tokens");
    assert!(
        wpe.len() >= t * c,
        "encoder_forward: wpe has fewer than T rows"
    );
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
                let tok = tokens[r] as usize;
                assert!(tok < v, "encoder_forward: token {tok} >= vocabulary {v}");
                let pos = r % t;
                let (e, p) = (&wte[tok * c..(tok + 1) * c], &wpe[pos * c..(pos + 1) * c]);
                for ((o, &e), &p) in o.iter_mut().zip(e).zip(p) {
                    *o = e + p;
                }
            }
        });
}

/// dwte[tokens[b, t]] += dout[b, t]; dwpe[t] += Σ_b dout[b, t].
pub fn encoder_backward(
    dwte: &mut [f32], // [V, C] +=
    dwpe: &mut [f32], // [maxT, C] +=, only the first T rows touched
    dout: &[f32],     // [B, T, C]
    tokens: &[u32],   // [B, T]
    b: usize,
    t: usize,
    c: usize,
) {
    assert_eq!(dout.len(), b * t * c, "encoder_backward: dout");
    assert_eq!(tokens.len(), b * t, "encoder_backward: tokens");
    assert!(
        dwpe.len() >= t * c,
        "encoder_backward: dwpe has fewer than T rows"
    );
    if c == 0 || dout.is_empty() {
        return;
    }
    assert_eq!(dwte.len() % c, 0, "encoder_backward: dwte");
    let v = dwte.len() / c;
    if let Some(&bad) = tokens.iter().find(|&&tok| tok as usize >= v) {
        panic!("encoder_backward: token {bad} >= vocabulary {v}");
    }
    dwte.par_chunks_mut(VOCAB_ROWS_PER_TASK * c)
        .enumerate()
        .for_each(|(bi, block)| {
            let lo = bi * VOCAB_ROWS_PER_TASK;
            let hi = lo + block.len() / c;
            for (&tok, dy) in tokens.iter().zip(dout.chunks_exact(c)) {
                let tok = tok as usize;
                if tok >= lo && tok < hi {
                    let d = &mut block[(tok - lo) * c..(tok - lo + 1) * c];
                    for (d, &g) in d.iter_mut().zip(dy) {
                        *d += g;
                    }
                }
            }
        });
    let rows = rows_per_task(c * b.max(1));
    dwpe[..t * c]
        .par_chunks_mut(rows * c)
        .enumerate()
        .for_each(|(pi, block)| {
            let p0 = pi * rows;
            for (i, d) in block.chunks_exact_mut(c).enumerate() {
                let pos = p0 + i;
                for bb in 0..b {
                    let dy = &dout[(bb * t + pos) * c..(bb * t + pos + 1) * c];
                    for (d, &g) in d.iter_mut().zip(dy) {
                        *d += g;
                    }
                }
            }
        });
}

/// Reference twins: plain loops.
pub mod naive {
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_forward(
        out: &mut [f32], // [B, T, C]
        tokens: &[u32],  // [B, T]
        wte: &[f32],     // [V, C]
        wpe: &[f32],     // [maxT, C], only the first T rows used
        b: usize,
        t: usize,
        c: usize,
    ) {
        for bb in 0..b {
            for tt in 0..t {
                let tok = tokens[bb * t + tt] as usize;
                for i in 0..c {
                    out[(bb * t + tt) * c + i] = wte[tok * c + i] + wpe[tt * c + i];
                }
            }
        }
    }

    pub fn encoder_backward(
        dwte: &mut [f32], // [V, C] +=
        dwpe: &mut [f32], // [maxT, C] +=, only the first T rows touched
        dout: &[f32],     // [B, T, C]
        tokens: &[u32],   // [B, T]
        b: usize,
        t: usize,
        c: usize,
    ) {
        for bb in 0..b {
            for tt in 0..t {
                let tok = tokens[bb * t + tt] as usize;
                for i in 0..c {
                    let g = dout[(bb * t + tt) * c + i];
                    dwte[tok * c + i] += g;
                    dwpe[tt * c + i] += g;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::reduce::testutil::*;
    use super::*;
    use crate::util::rng::Rng;

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
            encoder_forward(&mut o1, &tok, &wte, &wpe, b, t, c);
            naive::encoder_forward(&mut o2, &tok, &wte, &wpe, b, t, c);
            assert_eq!(o1, o2, "{b}x{t}x{c}");
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
                encoder_backward(&mut a, &mut p, &dout, &tok, b, t, c);
                (a, p)
            };
            let (a1, p1) = with_threads(1, run);
            assert!(
                (a1.clone(), p1.clone()) == with_threads(3, run),
                "thread count changed result"
            );
            let (mut a2, mut p2) = (dwte0.clone(), dwpe0.clone());
            naive::encoder_backward(&mut a2, &mut p2, &dout, &tok, b, t, c);
            let what = format!("{b}x{t}x{c}");
            assert_close(&a1, &a2, 1e-5, 1e-5, &format!("dwte {what}"));
            assert_close(&p1, &p2, 1e-5, 1e-5, &format!("dwpe {what}"));
            // Rows of wpe beyond T are untouched.
            assert_eq!(&p1[t * c..], &dwpe0[t * c..]);
        }
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
            naive::encoder_forward(&mut o, &tok, wte, wpe, b, t, c);
            dot(&g, &o)
        };
        let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; mt * c]);
        encoder_backward(&mut dwte, &mut dwpe, &g, &tok, b, t, c);
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

    #[test]
    #[should_panic(expected = "vocabulary")]
    fn out_of_range_token_panics() {
        let mut out = vec![0.0; 2];
        encoder_forward(&mut out, &[0, 2], &[0.0; 2], &[0.0; 2], 1, 2, 1);
    }
}
