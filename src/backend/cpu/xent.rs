//! Fused softmax + cross-entropy over a chunk of logit rows, and softmax for sampling.
//!
//! Each row is stabilised by subtracting its maximum; `e^(x - max)` comes from the
//! vectorisable `exp_f32` and is summed in 16 f32 lanes per 1024-element block, the block sums
//! in f64. The fused backward works in place: it stores the exponentials into the row, then
//! scales them into the gradient, so each row is read three times and written twice while it
//! sits in cache. Parallel over rows (rows are
//! independent), so results are identical for any thread count.
//!
//! A row whose target is [`IGNORE_TARGET`] (a token not trained: a chat prompt, padding) has
//! loss 0 and a zero gradient row, so it adds nothing to the head's weight gradient or its
//! input's.

use super::features::multiversion;
use super::reduce::{exp_f32, max_f32, rows_per_task, sum_f32};
use crate::ir::IGNORE_TARGET;
use rayon::prelude::*;

/// Elements per block of the exp-sums: summed in 16 f32 lanes (64 terms per lane), then the
/// block total is added in f64, so the sum stays accurate over a 50k-entry vocabulary while
/// the inner loop is pure f32 (which auto-vectorises; f64 lanes do not, well).
const SUM_BLOCK: usize = 1024;

/// Σ exp(x - max); the exponentials overwrite `x`.
#[inline(always)]
pub(super) fn exp_sum(
    x: &mut [f32], // [V]
    max: f32,
) -> f64 {
    let mut total = 0.0f64;
    for block in x.chunks_mut(SUM_BLOCK) {
        let mut acc = [0.0f32; 16];
        let mut it = block.chunks_exact_mut(16);
        for ch in &mut it {
            for (a, x) in acc.iter_mut().zip(ch) {
                let e = exp_f32(*x - max);
                *x = e;
                *a += e;
            }
        }
        for (a, x) in acc.iter_mut().zip(it.into_remainder()) {
            let e = exp_f32(*x - max);
            *x = e;
            *a += e;
        }
        total += sum_f32(&acc) as f64;
    }
    total
}

/// Σ exp(x - max), read only.
#[inline(always)]
pub(super) fn exp_sum_ro(
    x: &[f32], // [V]
    max: f32,
) -> f64 {
    let mut total = 0.0f64;
    for block in x.chunks(SUM_BLOCK) {
        let mut acc = [0.0f32; 16];
        let mut it = block.chunks_exact(16);
        for ch in &mut it {
            for (a, &x) in acc.iter_mut().zip(ch) {
                *a += exp_f32(x - max);
            }
        }
        for (a, &x) in acc.iter_mut().zip(it.remainder()) {
            *a += exp_f32(x - max);
        }
        total += sum_f32(&acc) as f64;
    }
    total
}

fn check_target(target: u32, v: usize) -> usize {
    let t = target as usize;
    assert!(t < v, "softmax_xent: target {t} >= vocabulary {v}");
    t
}

/// On entry `logits` holds logits `[n, v]`; on exit it holds
/// d(loss_scale * sum_rows loss)/d(logits) = dloss_scale*(softmax - onehot(target)).
/// `losses[i] = -ln softmax(logits[i])[targets[i]] (computed stably with max-subtraction,`
/// exponentials summed in f64); 0, with a zero gradient row, where `targets[i]` is
/// [`IGNORE_TARGET`].
pub fn softmax_xent_backward_inplace(
    logits: &mut [f32], // [n, V] in: logits, out: dloss/dlogits
    targets: &[u32],    // [n]
    losses: &mut [f32], // [n]
    dloss_scale: f32,
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v, "softmax_xent_backward_inplace: logits");
    assert_eq!(targets.len(), n, "softmax_xent_backward_inplace: targets");
    assert_eq!(losses.len(), n, "softmax_xent_backward_inplace: losses");
    if n == 0 {
        return;
    }
    assert!(v > 0, "softmax_xent_backward_inplace: empty vocabulary");
    let rows = rows_per_task(v);
    logits
        .par_chunks_mut(rows * v)
        .zip(targets.par_chunks(rows))
        .zip(losses.par_chunks_mut(rows))
        .for_each(|((lg, tg), ls)| backward_rows(lg, tg, ls, &mut [], dloss_scale, v));
}

/// [`softmax_xent_backward_inplace`], also writing each row's [`ROW_STATS`] into `stats`
/// `[n, 2]`: its maximum and the factor `dloss_scale / Σ exp(logit − max)` (0 and 0 for an
/// untrained target), from which [`super::xent_slice::grad_slice`] computes the same
/// gradient for any slice of the row's vocabulary, its logits computed again.
pub fn softmax_xent_backward_with_stats(
    logits: &mut [f32], // [n, V] in: logits, out: dloss/dlogits
    targets: &[u32],    // [n]
    losses: &mut [f32], // [n]
    stats: &mut [f32],  // [n, 2] out: max, dloss_scale / Σ exp
    dloss_scale: f32,
    n: usize,
    v: usize,
) {
    assert_eq!(
        stats.len(),
        n * ROW_STATS,
        "softmax_xent_backward_with_stats: stats"
    );
    assert_eq!(
        logits.len(),
        n * v,
        "softmax_xent_backward_with_stats: logits"
    );
    assert_eq!(
        targets.len(),
        n,
        "softmax_xent_backward_with_stats: targets"
    );
    assert_eq!(losses.len(), n, "softmax_xent_backward_with_stats: losses");
    if n == 0 {
        return;
    }
    assert!(v > 0, "softmax_xent_backward_with_stats: empty vocabulary");
    let rows = rows_per_task(v);
    logits
        .par_chunks_mut(rows * v)
        .zip(targets.par_chunks(rows))
        .zip(losses.par_chunks_mut(rows))
        .zip(stats.par_chunks_mut(rows * ROW_STATS))
        .for_each(|(((lg, tg), ls), st)| backward_rows(lg, tg, ls, st, dloss_scale, v));
}

/// Numbers per row [`softmax_xent_backward_with_stats`] keeps: the maximum and the factor
/// (the plan's [`HEAD_ROW_STATS`](crate::ir::schedule::HEAD_ROW_STATS)).
pub const ROW_STATS: usize = crate::ir::schedule::HEAD_ROW_STATS;

multiversion! {
    /// The fused backward over a few whole rows; each row's max and factor into `st`
    /// `[rows, 2]` unless it is empty.
    fn backward_rows(
        lg: &mut [f32], // [rows, V]
        tg: &[u32],     // [rows]
        ls: &mut [f32], // [rows]
        st: &mut [f32], // [rows, 2] or []
        dloss_scale: f32,
        v: usize,
    ) {
        for (i, ((row, &tgt), loss)) in lg.chunks_exact_mut(v).zip(tg).zip(ls).enumerate() {
            if tgt == IGNORE_TARGET {
                *loss = 0.0;
                row.fill(0.0);
                if !st.is_empty() {
                    st[i * ROW_STATS..(i + 1) * ROW_STATS].fill(0.0);
                }
                continue;
            }
            let tgt = check_target(tgt, v);
            let max = max_f32(row);
            let x_t = row[tgt];
            let sum = exp_sum(row, max);
            *loss = (sum.ln() - (x_t - max) as f64) as f32;
            let s = (dloss_scale as f64 / sum) as f32;
            if !st.is_empty() {
                st[i * ROW_STATS] = max;
                st[i * ROW_STATS + 1] = s;
            }
            for x in row.iter_mut() {
                // Flush what would be denormal (the LM-head GEMMs read this) to 0.
                let g = *x * s;
                *x = if g < 1e-30 { 0.0 } else { g };
            }
            row[tgt] -= dloss_scale;
        }
    }
}

/// `Forward only (evaluation): losses[i] as above (0 for an ignored target); logits untouched`.
pub fn softmax_xent_forward(
    logits: &[f32],     // [n, V]
    targets: &[u32],    // [n]
    losses: &mut [f32], // [n]
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v, "softmax_xent_forward: logits");
    assert_eq!(targets.len(), n, "softmax_xent_forward: targets");
    assert_eq!(losses.len(), n, "softmax_xent_forward: losses");
    if n == 0 {
        return;
    }
    assert!(v > 0, "softmax_xent_forward: empty vocabulary");
    let rows = rows_per_task(v);
    logits
        .par_chunks(rows * v)
        .zip(targets.par_chunks(rows))
        .zip(losses.par_chunks_mut(rows))
        .for_each(|((lg, tg), ls)| forward_rows(lg, tg, ls, v));
}

multiversion! {
    /// The loss over a few whole rows.
    fn forward_rows(
        lg: &[f32],     // [rows, V]
        tg: &[u32],     // [rows]
        ls: &mut [f32], // [rows]
        v: usize,
    ) {
        for ((row, &tgt), loss) in lg.chunks_exact(v).zip(tg).zip(ls) {
            if tgt == IGNORE_TARGET {
                *loss = 0.0;
                continue;
            }
            let tgt = check_target(tgt, v);
            let max = max_f32(row);
            let sum = exp_sum_ro(row, max);
            *loss = (sum.ln() - (row[tgt] - max) as f64) as f32;
        }
    }
}

/// Softmax of one row with temperature into probs (for sampling). temperature > 0.
pub fn softmax_row(
    probs: &mut [f32], // [V]
    logits: &[f32],    // [V]
    temperature: f32,
) {
    assert_eq!(probs.len(), logits.len(), "softmax_row: lengths");
    assert!(temperature > 0.0, "softmax_row: temperature must be > 0");
    if logits.is_empty() {
        return;
    }
    softmax_row_impl(probs, logits, 1.0 / temperature);
}

multiversion! {
    fn softmax_row_impl(
        probs: &mut [f32], // [V]
        logits: &[f32],    // [V]
        inv_t: f32,
    ) {
        let max = max_f32(logits);
        for (p, &x) in probs.iter_mut().zip(logits) {
            *p = (x - max) * inv_t;
        }
        let sum = exp_sum(probs, 0.0);
        let s = (1.0 / sum) as f32;
        for p in probs.iter_mut() {
            *p *= s;
        }
    }
}

/// Reference twins: f64 throughout.
pub mod naive {
    use crate::ir::IGNORE_TARGET;

    fn row_loss_and_probs(
        row: &[f32], // [V]
        tgt: usize,
    ) -> (f64, Vec<f64>) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let e: Vec<f64> = row.iter().map(|&x| (x as f64 - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let loss = sum.ln() - (row[tgt] as f64 - max);
        (loss, e.into_iter().map(|e| e / sum).collect())
    }

    pub fn softmax_xent_backward_inplace(
        logits: &mut [f32], // [n, V] in: logits, out: dloss/dlogits
        targets: &[u32],    // [n]
        losses: &mut [f32], // [n]
        dloss_scale: f32,
        n: usize,
        v: usize,
    ) {
        for i in 0..n {
            let row = &mut logits[i * v..(i + 1) * v];
            if targets[i] == IGNORE_TARGET {
                losses[i] = 0.0;
                row.fill(0.0);
                continue;
            }
            let tgt = targets[i] as usize;
            let (loss, p) = row_loss_and_probs(row, tgt);
            losses[i] = loss as f32;
            for (j, x) in row.iter_mut().enumerate() {
                let onehot = if j == tgt { 1.0 } else { 0.0 };
                *x = (dloss_scale as f64 * (p[j] - onehot)) as f32;
            }
        }
    }

    pub fn softmax_xent_forward(
        logits: &[f32],     // [n, V]
        targets: &[u32],    // [n]
        losses: &mut [f32], // [n]
        n: usize,
        v: usize,
    ) {
        for i in 0..n {
            losses[i] = if targets[i] == IGNORE_TARGET {
                0.0
            } else {
                row_loss_and_probs(&logits[i * v..(i + 1) * v], targets[i] as usize).0 as f32
            };
        }
    }

    pub fn softmax_row(
        probs: &mut [f32], // [V]
        logits: &[f32],    // [V]
        temperature: f32,
    ) {
        let scaled: Vec<f32> = logits.iter().map(|&x| x / temperature).collect();
        let (_, p) = row_loss_and_probs(&scaled, 0);
        for (o, p) in probs.iter_mut().zip(p) {
            *o = p as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::reduce::testutil::*;
    use super::*;
    use crate::util::rng::Rng;

    fn targets(n: usize, v: usize, seed: u64) -> Vec<u32> {
        let mut r = Rng::new(seed);
        (0..n).map(|_| r.below(v as u64) as u32).collect()
    }

    const SHAPES: [(usize, usize); 7] = [
        (1, 1),
        (1, 2),
        (3, 7),
        (5, 17),
        (4, 100),
        (9, 1003),
        (2, 50257),
    ];

    #[test]
    fn matches_naive() {
        for (si, &(n, v)) in SHAPES.iter().enumerate() {
            // Large offset and spread: exercises the max-subtraction.
            let logits: Vec<f32> = randn(n * v, 4.0, si as u64)
                .iter()
                .map(|x| x + 100.0)
                .collect();
            let tg = targets(n, v, 10 + si as u64);
            let scale = 1.0 / (n as f32 * 3.0);
            let (mut g1, mut l1) = (logits.clone(), vec![0.0; n]);
            let (mut g2, mut l2) = (logits.clone(), vec![0.0; n]);
            softmax_xent_backward_inplace(&mut g1, &tg, &mut l1, scale, n, v);
            naive::softmax_xent_backward_inplace(&mut g2, &tg, &mut l2, scale, n, v);
            let what = format!("{n}x{v}");
            assert_close(&l1, &l2, 1e-5, 1e-6, &format!("loss {what}"));
            assert_close(&g1, &g2, 1e-9, 1e-5, &format!("grad {what}"));
            let mut l3 = vec![0.0; n];
            softmax_xent_forward(&logits, &tg, &mut l3, n, v);
            assert_close(&l3, &l2, 1e-5, 1e-6, &format!("forward loss {what}"));
            // Each gradient row sums to zero.
            for row in g1.chunks(v) {
                let s: f64 = row.iter().map(|&x| x as f64).sum();
                assert!(s.abs() < 1e-6 * (1.0 + v as f64).sqrt(), "row sum {s}");
            }
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, v) = (3, 5);
        let logits = randn(n * v, 2.0, 1);
        let tg = vec![4, 0, 2];
        let scale = 0.7;
        let (mut g, mut l) = (logits.clone(), vec![0.0; n]);
        softmax_xent_backward_inplace(&mut g, &tg, &mut l, scale, n, v);
        let fd = fd_grad(&logits, 1e-3, |x| {
            let mut l = vec![0.0; n];
            naive::softmax_xent_forward(x, &tg, &mut l, n, v);
            scale as f64 * l.iter().map(|&v| v as f64).sum::<f64>()
        });
        assert_close(&g, &fd, 1e-4, 1e-3, "xent grad vs fd");
    }

    #[test]
    fn extreme_logits_stay_finite() {
        let v = 10;
        let mut logits = vec![-1e4f32; v];
        logits[3] = 1e4;
        let mut l = [0.0];
        softmax_xent_forward(&logits, &[3], &mut l, 1, v);
        assert!(l[0].abs() < 1e-6);
        softmax_xent_forward(&logits, &[0], &mut l, 1, v);
        assert!((l[0] - 2e4).abs() < 1.0, "{}", l[0]);
        let mut g = logits.clone();
        softmax_xent_backward_inplace(&mut g, &[0], &mut l, 1.0, 1, v);
        assert!(g.iter().all(|x| x.is_finite() && !x.is_subnormal()));
        assert!((g[0] + 1.0).abs() < 1e-6 && (g[3] - 1.0).abs() < 1e-6);
        // A gap that would leave denormal gradient entries after scaling flushes them to 0.
        let mut g = vec![0.0f32, -84.0, -86.0, -90.0];
        softmax_xent_backward_inplace(&mut g, &[0], &mut l, 1e-4, 1, 4);
        assert!(g.iter().all(|x| !x.is_subnormal()), "{g:?}");
    }

    #[test]
    fn softmax_row_matches_naive() {
        for (v, temp) in [(1usize, 1.0f32), (7, 0.5), (1003, 1.3), (50257, 0.8)] {
            let logits = randn(v, 3.0, v as u64);
            let (mut p1, mut p2) = (vec![0.0; v], vec![0.0; v]);
            softmax_row(&mut p1, &logits, temp);
            naive::softmax_row(&mut p2, &logits, temp);
            assert_close(&p1, &p2, 1e-9, 1e-5, &format!("softmax_row v={v}"));
            let s: f64 = p1.iter().map(|&p| p as f64).sum();
            assert!((s - 1.0).abs() < 1e-5);
        }
    }

    #[test]
    fn ignored_targets_have_no_loss_and_no_gradient() {
        let (n, v) = (4, 1003);
        let logits = randn(n * v, 3.0, 8);
        let mut tg = targets(n, v, 9);
        tg[1] = IGNORE_TARGET;
        tg[3] = IGNORE_TARGET;
        let (mut g, mut l) = (logits.clone(), vec![1.0; n]);
        softmax_xent_backward_inplace(&mut g, &tg, &mut l, 0.5, n, v);
        let (mut g2, mut l2) = (logits.clone(), vec![1.0; n]);
        naive::softmax_xent_backward_inplace(&mut g2, &tg, &mut l2, 0.5, n, v);
        let mut l3 = vec![1.0; n];
        softmax_xent_forward(&logits, &tg, &mut l3, n, v);
        for i in [1, 3] {
            assert_eq!((l[i], l2[i], l3[i]), (0.0, 0.0, 0.0));
            assert!(g[i * v..][..v].iter().all(|&x| x == 0.0));
            assert!(g2[i * v..][..v].iter().all(|&x| x == 0.0));
        }
        // The trained rows are as without the ignored ones.
        for i in [0, 2] {
            let (mut gi, mut li) = (logits[i * v..][..v].to_vec(), vec![0.0]);
            softmax_xent_backward_inplace(&mut gi, &tg[i..=i], &mut li, 0.5, 1, v);
            assert_eq!(li[0], l[i]);
            assert_eq!(gi, g[i * v..][..v]);
        }
    }

    #[test]
    fn identical_for_any_thread_count() {
        let (n, v) = (37, 3001);
        let logits = randn(n * v, 3.0, 5);
        let tg = targets(n, v, 6);
        let run = || {
            let (mut g, mut l) = (logits.clone(), vec![0.0; n]);
            softmax_xent_backward_inplace(&mut g, &tg, &mut l, 0.5, n, v);
            (g, l)
        };
        assert!(with_threads(1, run) == with_threads(3, run));
    }
}
