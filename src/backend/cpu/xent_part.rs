//! Softmax cross-entropy over a vocabulary cut among tensor-parallel ranks (Megatron's
//! vocabulary-parallel cross-entropy): each rank holds the logits of its own token ids only,
//! so no rank holds a whole row.
//!
//! Two passes. [`part_stats`] reduces each row of the rank's logits to three numbers: its
//! maximum, Σ exp(logit − maximum) (exponentials summed as [`super::xent`] sums them, in
//! f64 per block) and the target's logit where this rank holds the target (else 0). The
//! ranks' statistics are gathered (`[ranks, N, 3]`, the same bits on every rank), and
//! [`combine`] folds them in rank order into the whole row's maximum, sum and target logit.
//! From those, [`part_backward_inplace`] turns the rank's logits into its columns of
//! d(loss)/d(logits) and every rank writes the same loss, and [`part_loss`] writes the loss
//! alone (evaluation).
//!
//! A row whose target is [`IGNORE_TARGET`] has loss 0 and a zero gradient row, as in
//! [`super::xent`]. Parallel over rows: results are identical for any thread count.

use super::features::multiversion;
use super::reduce::{exp_f32, max_f32, rows_per_task};
use super::xent::exp_sum_ro;
use crate::ir::IGNORE_TARGET;
use rayon::prelude::*;

/// Numbers per row of the statistics: maximum, sum of exponentials, target logit.
pub const STATS: usize = 3;

/// `stats[i] = (max_j x[i,j], Σ_j exp(x[i,j] − max), x[i, target − first_token] or 0)` over
/// the rank's logits `x` `[n, v]` of the token ids `first_token..first_token + v`.
pub fn part_stats(
    logits: &[f32],    // [n, v]
    targets: &[u32],   // [n]
    stats: &mut [f32], // [n, 3]
    first_token: usize,
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v, "part_stats: logits");
    assert_eq!(targets.len(), n, "part_stats: targets");
    assert_eq!(stats.len(), n * STATS, "part_stats: stats");
    if n == 0 {
        return;
    }
    assert!(v > 0, "part_stats: empty part of the vocabulary");
    let rows = rows_per_task(v);
    logits
        .par_chunks(rows * v)
        .zip(targets.par_chunks(rows))
        .zip(stats.par_chunks_mut(rows * STATS))
        .for_each(|((lg, tg), st)| stats_rows(lg, tg, st, first_token, v));
}

multiversion! {
    /// [`part_stats`] over a few whole rows.
    fn stats_rows(
        lg: &[f32],      // [rows, v]
        tg: &[u32],      // [rows]
        st: &mut [f32],  // [rows, 3]
        first_token: usize,
        v: usize,
    ) {
        for ((row, &tgt), s) in lg.chunks_exact(v).zip(tg).zip(st.chunks_exact_mut(STATS)) {
            let max = max_f32(row);
            s[0] = max;
            s[1] = exp_sum_ro(row, max) as f32;
            s[2] = local(tgt, first_token, v).map_or(0.0, |j| row[j]);
        }
    }
}

/// The column of token `target` among the rank's `v` token ids from `first_token`.
#[inline(always)]
fn local(target: u32, first_token: usize, v: usize) -> Option<usize> {
    let t = target as usize;
    (target != IGNORE_TARGET && t >= first_token && t < first_token + v).then(|| t - first_token)
}

/// Row `i`'s whole softmax from the ranks' gathered statistics `[ranks, n, 3]` (`n` the
/// micro-batch's planned rows), folded in rank order: (maximum, Σ exp(logit − maximum),
/// target logit).
#[inline(always)]
pub fn combine(gathered: &[f32], n: usize, i: usize) -> (f32, f64, f32) {
    let ranks = gathered.len() / (n * STATS);
    let at = |r: usize| &gathered[(r * n + i) * STATS..(r * n + i + 1) * STATS];
    let max = (0..ranks)
        .map(|r| at(r)[0])
        .fold(f32::NEG_INFINITY, f32::max);
    let (mut sum, mut target) = (0.0f64, 0.0f32);
    for r in 0..ranks {
        let s = at(r);
        sum += s[1] as f64 * ((s[0] - max) as f64).exp();
        target += s[2];
    }
    (max, sum, target)
}

/// On entry `logits` holds the rank's logits `[n, v]` of rows `row0..row0 + n` of the
/// micro-batch's `rows` (token ids `first_token..`); on exit its columns of
/// d(dloss_scale · Σ loss)/d(logits). `losses[i]`, the whole row's loss, comes from the
/// gathered statistics `[ranks, rows, 3]` (0, with a zero gradient row, for an ignored
/// target).
#[allow(clippy::too_many_arguments)]
pub fn part_backward_inplace(
    logits: &mut [f32], // [n, v] in: logits, out: dloss/dlogits
    targets: &[u32],    // [n]
    losses: &mut [f32], // [n]
    gathered: &[f32],   // [ranks, rows, 3]
    (row0, rows): (usize, usize),
    first_token: usize,
    dloss_scale: f32,
    v: usize,
) {
    let n = targets.len();
    assert_eq!(logits.len(), n * v, "part_backward_inplace: logits");
    assert_eq!(losses.len(), n, "part_backward_inplace: losses");
    assert!(row0 + n <= rows, "part_backward_inplace: rows");
    assert_eq!(
        gathered.len() % (rows * STATS),
        0,
        "part_backward_inplace: stats"
    );
    if n == 0 {
        return;
    }
    let per = rows_per_task(v);
    logits
        .par_chunks_mut(per * v)
        .zip(targets.par_chunks(per))
        .zip(losses.par_chunks_mut(per))
        .enumerate()
        .for_each(|(k, ((lg, tg), ls))| {
            let at = (row0 + k * per, rows);
            backward_rows(lg, tg, ls, gathered, at, first_token, dloss_scale, v)
        });
}

multiversion! {
    /// [`part_backward_inplace`] over a few whole rows, the first being row `row0`.
    fn backward_rows(
        lg: &mut [f32],  // [k, v]
        tg: &[u32],      // [k]
        ls: &mut [f32],  // [k]
        gathered: &[f32],
        at: (usize, usize),
        first_token: usize,
        dloss_scale: f32,
        v: usize,
    ) {
        let (row0, rows) = at;
        for (i, ((row, &tgt), loss)) in lg.chunks_exact_mut(v).zip(tg).zip(ls).enumerate() {
            if tgt == IGNORE_TARGET {
                *loss = 0.0;
                row.fill(0.0);
                continue;
            }
            let (max, sum, x_t) = combine(gathered, rows, row0 + i);
            *loss = (sum.ln() - (x_t - max) as f64) as f32;
            let s = (dloss_scale as f64 / sum) as f32;
            for x in row.iter_mut() {
                // Flush what would be denormal (the LM-head GEMMs read this) to 0.
                let g = exp_f32(*x - max) * s;
                *x = if g < 1e-30 { 0.0 } else { g };
            }
            if let Some(j) = local(tgt, first_token, v) {
                row[j] -= dloss_scale;
            }
        }
    }
}

/// `losses[i]` of the micro-batch's first `n` rows of `rows` from the gathered statistics
/// `[ranks, rows, 3]` alone (evaluation: 0 for an ignored target).
pub fn part_loss(
    gathered: &[f32], // [ranks, rows, 3]
    rows: usize,
    targets: &[u32],    // [n]
    losses: &mut [f32], // [n]
) {
    let n = targets.len();
    assert_eq!(losses.len(), n, "part_loss: losses");
    assert!(n <= rows, "part_loss: rows");
    assert_eq!(
        gathered.len() % (rows * STATS).max(1),
        0,
        "part_loss: stats"
    );
    for (i, (loss, &tgt)) in losses.iter_mut().zip(targets).enumerate() {
        *loss = match tgt {
            IGNORE_TARGET => 0.0,
            _ => {
                let (max, sum, x_t) = combine(gathered, rows, i);
                (sum.ln() - (x_t - max) as f64) as f32
            }
        };
    }
}

/// Reference twins: f64 throughout, each part's statistics as [`super::xent::naive`] sees
/// a row.
pub mod naive {
    use super::{STATS, local};
    use crate::ir::IGNORE_TARGET;

    pub fn part_stats(
        logits: &[f32],    // [n, v]
        targets: &[u32],   // [n]
        stats: &mut [f32], // [n, 3]
        first_token: usize,
        n: usize,
        v: usize,
    ) {
        for i in 0..n {
            let row = &logits[i * v..(i + 1) * v];
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            let s = &mut stats[i * STATS..(i + 1) * STATS];
            s[0] = max as f32;
            s[1] = sum as f32;
            s[2] = local(targets[i], first_token, v).map_or(0.0, |j| row[j]);
        }
    }

    /// [`super::part_backward_inplace`] over all `n` rows of the micro-batch.
    #[allow(clippy::too_many_arguments)]
    pub fn part_backward_inplace(
        logits: &mut [f32], // [n, v]
        targets: &[u32],    // [n]
        losses: &mut [f32], // [n]
        gathered: &[f32],   // [ranks, n, 3]
        first_token: usize,
        dloss_scale: f32,
        n: usize,
        v: usize,
    ) {
        let ranks = gathered.len() / (n * STATS);
        for i in 0..n {
            let row = &mut logits[i * v..(i + 1) * v];
            if targets[i] == IGNORE_TARGET {
                losses[i] = 0.0;
                row.fill(0.0);
                continue;
            }
            let st = |r: usize, k: usize| gathered[(r * n + i) * STATS + k] as f64;
            let max = (0..ranks)
                .map(|r| st(r, 0))
                .fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = (0..ranks).map(|r| st(r, 1) * (st(r, 0) - max).exp()).sum();
            let x_t: f64 = (0..ranks).map(|r| st(r, 2)).sum();
            losses[i] = (sum.ln() - (x_t - max)) as f32;
            let tgt = local(targets[i], first_token, v);
            for (j, x) in row.iter_mut().enumerate() {
                let onehot = if Some(j) == tgt { 1.0 } else { 0.0 };
                let p = (*x as f64 - max).exp() / sum;
                *x = (dloss_scale as f64 * (p - onehot)) as f32;
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

    /// Rows `[n, v]` of logits (with a large offset: the maxima matter), targets (some
    /// ignored) and a cut of the vocabulary into `ranks` parts as `TensorSplit::vocab_part`.
    fn case(n: usize, v: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
        let logits = randn(n * v, 4.0, seed).iter().map(|x| x + 60.0).collect();
        let mut r = Rng::new(seed + 1);
        let tg = (0..n)
            .map(|i| match i % 5 {
                4 => IGNORE_TARGET,
                _ => r.below(v as u64) as u32,
            })
            .collect();
        (logits, tg)
    }

    fn parts(v: usize, ranks: usize) -> Vec<std::ops::Range<usize>> {
        (0..ranks)
            .map(|r| r * v / ranks..(r + 1) * v / ranks)
            .collect()
    }

    /// The columns `part` of rows `[n, v]`.
    fn columns(x: &[f32], v: usize, part: &std::ops::Range<usize>) -> Vec<f32> {
        x.chunks(v)
            .flat_map(|row| row[part.clone()].to_vec())
            .collect()
    }

    /// Every rank's statistics of `logits`, gathered `[ranks, n, 3]`.
    fn gathered(logits: &[f32], tg: &[u32], v: usize, ranks: usize) -> Vec<f32> {
        let n = tg.len();
        let mut all = vec![0.0; ranks * n * STATS];
        for (r, p) in parts(v, ranks).iter().enumerate() {
            let st = &mut all[r * n * STATS..(r + 1) * n * STATS];
            part_stats(&columns(logits, v, p), tg, st, p.start, n, p.len());
        }
        all
    }

    #[test]
    fn the_ranks_parts_give_the_whole_rows_loss_and_gradient() {
        for (n, v, ranks) in [
            (5, 17, 2),
            (7, 1003, 3),
            (4, 50257, 2),
            (6, 100, 4),
            (3, 9, 8),
        ] {
            let (logits, tg) = case(n, v, (n * v + ranks) as u64);
            let scale = 1.0 / (n as f32 * 2.0);
            let (mut whole, mut want) = (logits.clone(), vec![0.0; n]);
            xent::naive::softmax_xent_backward_inplace(&mut whole, &tg, &mut want, scale, n, v);
            let all = gathered(&logits, &tg, v, ranks);
            let what = format!("{n}x{v} on {ranks}");
            let mut eval = vec![0.0; n];
            part_loss(&all, n, &tg, &mut eval);
            assert_close(&eval, &want, 1e-5, 1e-6, &format!("eval loss {what}"));
            let mut grad = vec![0.0; n * v];
            for p in parts(v, ranks) {
                let mut lg = columns(&logits, v, &p);
                let mut ls = vec![0.0; n];
                // Two chunks of rows, as the head runs them.
                let k = n / 2;
                let (a, b) = lg.split_at_mut(k * p.len());
                let (la, lb) = ls.split_at_mut(k);
                part_backward_inplace(a, &tg[..k], la, &all, (0, n), p.start, scale, p.len());
                part_backward_inplace(b, &tg[k..], lb, &all, (k, n), p.start, scale, p.len());
                // Every rank writes the whole row's loss, the same bits.
                assert_eq!(ls, eval, "{what}: rank {p:?}'s losses");
                let mut twin = (columns(&logits, v, &p), vec![0.0; n]);
                naive::part_backward_inplace(
                    &mut twin.0,
                    &tg,
                    &mut twin.1,
                    &all,
                    p.start,
                    scale,
                    n,
                    p.len(),
                );
                assert_close(&lg, &twin.0, 1e-9, 1e-5, &format!("grad twin {what}"));
                for (row, part) in grad.chunks_mut(v).zip(lg.chunks(p.len())) {
                    row[p.clone()].copy_from_slice(part);
                }
            }
            assert_close(&grad, &whole, 1e-9, 1e-5, &format!("grad {what}"));
        }
    }

    #[test]
    fn stats_match_their_twin() {
        let (n, v) = (9, 1003);
        let (logits, tg) = case(n, v, 7);
        let (mut fast, mut slow) = (vec![0.0; n * STATS], vec![0.0; n * STATS]);
        part_stats(&logits, &tg, &mut fast, 500, n, v);
        naive::part_stats(&logits, &tg, &mut slow, 500, n, v);
        assert_close(&fast, &slow, 1e-6, 1e-6, "stats");
        // The target's logit only where this part holds it.
        for (i, &t) in tg.iter().enumerate() {
            let held = t != IGNORE_TARGET && (500..500 + v).contains(&(t as usize));
            assert_eq!(fast[i * STATS + 2] != 0.0, held, "row {i} target {t}");
        }
    }
}
