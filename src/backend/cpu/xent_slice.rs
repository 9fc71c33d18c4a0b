//! The cross-entropy's gradient for a slice of the vocabulary, from the row statistics
//! [`super::xent::softmax_xent_backward_with_stats`] kept: what `--update in-backward` needs
//! to take the LM head's weight gradient after the backward, a slice of the vocabulary at a
//! time (`Op::LmHeadWeightGrad`), its logits computed again.
//!
//! Each element is computed as the whole-row backward computes it: `exp_f32(x − max)` times
//! the row's factor, what would be denormal flushed to 0, the target's `dloss_scale` taken
//! off where the slice holds the target. So given the same logits, the slice's gradient is
//! bitwise the whole row's at those columns. Parallel over rows: the same for any thread
//! count.

use super::features::multiversion;
use super::reduce::{exp_f32, rows_per_task};
use super::xent::ROW_STATS;
use crate::ir::IGNORE_TARGET;
use rayon::prelude::*;

/// On entry `logits` `[n, vs]` holds the logits of the vocabulary's words `first..first +
/// vs` for `n` rows; on exit their gradient `dloss_scale · (softmax − onehot(target))`, the
/// softmax's maximum and factor from `stats` `[n, 2]`. A row of an untrained target
/// ([`IGNORE_TARGET`]) becomes 0.
pub fn grad_slice(
    logits: &mut [f32], // [n, vs] in: logits, out: their gradient
    targets: &[u32],    // [n]
    stats: &[f32],      // [n, 2]: max, dloss_scale / Σ exp
    first: usize,
    dloss_scale: f32,
    n: usize,
    vs: usize,
) {
    assert_eq!(logits.len(), n * vs, "grad_slice: logits");
    assert_eq!(targets.len(), n, "grad_slice: targets");
    assert_eq!(stats.len(), n * ROW_STATS, "grad_slice: stats");
    if n == 0 || vs == 0 {
        return;
    }
    let rows = rows_per_task(vs);
    logits
        .par_chunks_mut(rows * vs)
        .zip(targets.par_chunks(rows))
        .zip(stats.par_chunks(rows * ROW_STATS))
        .for_each(|((lg, tg), st)| slice_rows(lg, tg, st, first, dloss_scale, vs));
}

multiversion! {
    /// [`grad_slice`] over a few rows.
    fn slice_rows(
        lg: &mut [f32], // [rows, vs]
        tg: &[u32],     // [rows]
        st: &[f32],     // [rows, 2]
        first: usize,
        dloss_scale: f32,
        vs: usize,
    ) {
        for ((row, &tgt), st) in lg.chunks_exact_mut(vs).zip(tg).zip(st.chunks_exact(ROW_STATS)) {
            if tgt == IGNORE_TARGET {
                row.fill(0.0);
                continue;
            }
            let (max, s) = (st[0], st[1]);
            for x in row.iter_mut() {
                // As `xent::backward_rows`: the exponential, scaled; denormals flushed.
                let g = exp_f32(*x - max) * s;
                *x = if g < 1e-30 { 0.0 } else { g };
            }
            let t = tgt as usize;
            if t >= first && t < first + vs {
                row[t - first] -= dloss_scale;
            }
        }
    }
}

/// Reference twin: f64 arithmetic.
pub mod naive {
    use crate::backend::cpu::xent::ROW_STATS;
    use crate::ir::IGNORE_TARGET;

    pub fn grad_slice(
        logits: &mut [f32], // [n, vs]
        targets: &[u32],    // [n]
        stats: &[f32],      // [n, 2]
        first: usize,
        dloss_scale: f32,
        n: usize,
        vs: usize,
    ) {
        for i in 0..n {
            let row = &mut logits[i * vs..(i + 1) * vs];
            if targets[i] == IGNORE_TARGET {
                row.fill(0.0);
                continue;
            }
            let (max, s) = (stats[i * ROW_STATS] as f64, stats[i * ROW_STATS + 1] as f64);
            for (j, x) in row.iter_mut().enumerate() {
                let onehot = if first + j == targets[i] as usize {
                    dloss_scale as f64
                } else {
                    0.0
                };
                *x = (((*x as f64) - max).exp() * s - onehot) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::reduce::testutil::*;
    use super::super::xent;
    use super::*;
    use crate::util::rng::Rng;

    /// Rows of random logits over `v` words, their targets (every fifth untrained).
    fn rows(n: usize, v: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
        let mut r = Rng::new(seed);
        let targets = (0..n)
            .map(|i| match i % 5 {
                4 => IGNORE_TARGET,
                _ => r.below(v as u64) as u32,
            })
            .collect();
        (randn(n * v, 3.0, seed + 1), targets)
    }

    /// Every slice's gradient is bitwise the whole row's at its columns.
    #[test]
    fn slices_are_the_whole_rows_gradient() {
        for (n, v, cuts) in [
            (7, 50, vec![0, 13, 50]),
            (3, 1000, vec![0, 1, 512, 999, 1000]),
        ] {
            let (logits, targets) = rows(n, v, 11);
            let (mut whole, mut losses, mut stats) =
                (logits.clone(), vec![0.0; n], vec![0.0; n * ROW_STATS]);
            let scale = 0.25;
            xent::softmax_xent_backward_with_stats(
                &mut whole,
                &targets,
                &mut losses,
                &mut stats,
                scale,
                n,
                v,
            );
            for w in cuts.windows(2) {
                let (lo, hi) = (w[0], w[1]);
                let vs = hi - lo;
                let mut part: Vec<f32> = (0..n)
                    .flat_map(|i| logits[i * v + lo..i * v + hi].to_vec())
                    .collect();
                grad_slice(&mut part, &targets, &stats, lo, scale, n, vs);
                let want: Vec<f32> = (0..n)
                    .flat_map(|i| whole[i * v + lo..i * v + hi].to_vec())
                    .collect();
                assert_eq!(bits(&part), bits(&want), "n {n} v {v} slice {lo}..{hi}");
            }
            // The statistics' own backward equals the one that keeps none.
            let (mut plain, mut l2) = (logits.clone(), vec![0.0; n]);
            xent::softmax_xent_backward_inplace(&mut plain, &targets, &mut l2, scale, n, v);
            assert_eq!(bits(&plain), bits(&whole));
            assert_eq!(bits(&l2), bits(&losses));
        }
    }

    #[test]
    fn matches_naive() {
        let (n, v, first) = (9, 300, 100);
        let (logits, targets) = rows(n, v, 5);
        let (mut whole, mut losses, mut stats) =
            (logits.clone(), vec![0.0; n], vec![0.0; n * ROW_STATS]);
        xent::softmax_xent_backward_with_stats(
            &mut whole,
            &targets,
            &mut losses,
            &mut stats,
            1.0,
            n,
            v,
        );
        let part: Vec<f32> = (0..n)
            .flat_map(|i| logits[i * v + first..i * v + v].to_vec())
            .collect();
        let (mut fast, mut slow) = (part.clone(), part);
        grad_slice(&mut fast, &targets, &stats, first, 1.0, n, v - first);
        naive::grad_slice(&mut slow, &targets, &stats, first, 1.0, n, v - first);
        assert_close(&fast, &slow, 1e-7, 1e-5, "grad_slice");
        // An untrained row is zero.
        assert!(
            fast[4 * (v - first)..5 * (v - first)]
                .iter()
                .all(|&x| x == 0.0)
        );
    }
}
