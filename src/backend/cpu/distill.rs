//! The distillation loss over a chunk of logit rows, fused with its gradient: per row, with
//! the teacher's logits `t` and the student's `x` over the same vocabulary,
//!
//! `loss = α · KL(softmax t ‖ softmax x) + (1 − α) · (−ln softmax(x)[target])`
//!
//! (forward KL, as Minitron distils; α = 1 is the teacher alone, α = 0 the data's
//! cross-entropy alone), and `dloss/dx = softmax x − α · softmax t − (1 − α) · onehot`. A row
//! whose target is [`IGNORE_TARGET`] is not trained: loss 0 and a zero gradient row.
//!
//! Each row is stabilised by its maximum; the exponential sums come from `xent`'s blocked
//! f32/f64 sums. Parallel over rows, so results are identical for any thread count.

use super::features::multiversion;
use super::reduce::{exp_f32, max_f32, rows_per_task};
use super::xent::exp_sum_ro;
use crate::ir::IGNORE_TARGET;
use rayon::prelude::*;

/// On entry `logits` holds the student's logits `[n, V]`; on exit `dloss_scale` × the
/// gradient of each row's loss. `teacher` `[n, V]` is read only.
#[allow(clippy::too_many_arguments)]
pub fn distill_backward_inplace(
    logits: &mut [f32], // [n, V] in: student logits, out: dloss/dlogits
    teacher: &[f32],    // [n, V] teacher logits
    targets: &[u32],    // [n]
    losses: &mut [f32], // [n]
    alpha: f32,
    dloss_scale: f32,
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v, "distill_backward_inplace: logits");
    assert_eq!(teacher.len(), n * v, "distill_backward_inplace: teacher");
    assert_eq!(targets.len(), n, "distill_backward_inplace: targets");
    assert_eq!(losses.len(), n, "distill_backward_inplace: losses");
    if n == 0 {
        return;
    }
    let rows = rows_per_task(v);
    logits
        .par_chunks_mut(rows * v)
        .zip(teacher.par_chunks(rows * v))
        .zip(targets.par_chunks(rows))
        .zip(losses.par_chunks_mut(rows))
        .for_each(|(((lg, tl), tg), ls)| backward_rows(lg, tl, tg, ls, alpha, dloss_scale, v));
}

multiversion! {
    /// The fused loss and gradient over a few whole rows.
    fn backward_rows(
        lg: &mut [f32], // [rows, V]
        tl: &[f32],     // [rows, V]
        tg: &[u32],     // [rows]
        ls: &mut [f32], // [rows]
        alpha: f32,
        scale: f32,
        v: usize,
    ) {
        for (((row, trow), &tgt), loss) in lg.chunks_exact_mut(v).zip(tl.chunks_exact(v)).zip(tg).zip(ls) {
            if tgt == IGNORE_TARGET {
                *loss = 0.0;
                row.fill(0.0);
                continue;
            }
            let tgt = tgt as usize;
            assert!(tgt < v, "distill: target {tgt} >= vocabulary {v}");
            let (smax, tmax) = (max_f32(row), max_f32(trow));
            let (ssum, tsum) = (exp_sum_ro(row, smax), exp_sum_ro(trow, tmax));
            let (ln_s, ln_t) = (ssum.ln() as f32, tsum.ln() as f32);
            let (inv_s, inv_t) = ((1.0 / ssum) as f32, (1.0 / tsum) as f32);
            let ce = ln_s - (row[tgt] - smax);
            let mut kl = 0.0f64;
            for (x, &t) in row.iter_mut().zip(trow) {
                let (xs, ts) = (*x - smax, t - tmax);
                let (ps, pt) = (exp_f32(xs) * inv_s, exp_f32(ts) * inv_t);
                if pt > 0.0 {
                    kl += (pt * ((ts - ln_t) - (xs - ln_s))) as f64;
                }
                let g = scale * (ps - alpha * pt);
                // Flush what would be denormal (the LM-head GEMMs read this) to 0.
                *x = if g.abs() < 1e-30 { 0.0 } else { g };
            }
            row[tgt] -= scale * (1.0 - alpha);
            *loss = (alpha as f64 * kl + (1.0 - alpha as f64) * ce as f64) as f32;
        }
    }
}

/// Reference twin: f64 throughout.
pub mod naive {
    use crate::ir::IGNORE_TARGET;

    /// `ln softmax(row)`, in f64.
    fn log_softmax(row: &[f32]) -> Vec<f64> {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        row.iter().map(|&x| x as f64 - max - sum.ln()).collect()
    }

    #[allow(clippy::too_many_arguments)]
    pub fn distill_backward_inplace(
        logits: &mut [f32], // [n, V]
        teacher: &[f32],    // [n, V]
        targets: &[u32],    // [n]
        losses: &mut [f32], // [n]
        alpha: f32,
        dloss_scale: f32,
        n: usize,
        v: usize,
    ) {
        let a = alpha as f64;
        for i in 0..n {
            let row = &mut logits[i * v..(i + 1) * v];
            if targets[i] == IGNORE_TARGET {
                losses[i] = 0.0;
                row.fill(0.0);
                continue;
            }
            let tgt = targets[i] as usize;
            let (ls, lt) = (log_softmax(row), log_softmax(&teacher[i * v..(i + 1) * v]));
            let kl: f64 = (0..v).map(|j| lt[j].exp() * (lt[j] - ls[j])).sum();
            losses[i] = (a * kl - (1.0 - a) * ls[tgt]) as f32;
            for (j, x) in row.iter_mut().enumerate() {
                let onehot = if j == tgt { 1.0 } else { 0.0 };
                let g = ls[j].exp() - a * lt[j].exp() - (1.0 - a) * onehot;
                *x = (dloss_scale as f64 * g) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::reduce::testutil::*;
    use super::*;
    use crate::util::rng::Rng;

    fn case(n: usize, v: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
        let mut r = Rng::new(seed);
        let tg = (0..n).map(|_| r.below(v as u64) as u32).collect();
        let x = randn(n * v, 3.0, seed).iter().map(|x| x + 50.0).collect();
        let t = randn(n * v, 3.0, seed + 1)
            .iter()
            .map(|x| x - 20.0)
            .collect();
        (x, t, tg)
    }

    #[test]
    fn matches_naive() {
        for (k, &(n, v)) in [(1, 1), (3, 7), (5, 100), (4, 1003), (2, 49152)]
            .iter()
            .enumerate()
        {
            for alpha in [1.0, 0.5, 0.0] {
                let (x, t, mut tg) = case(n, v, 7 + k as u64);
                if n > 2 {
                    tg[1] = IGNORE_TARGET;
                }
                let scale = 0.25;
                let (mut g1, mut l1) = (x.clone(), vec![0.0; n]);
                let (mut g2, mut l2) = (x.clone(), vec![0.0; n]);
                distill_backward_inplace(&mut g1, &t, &tg, &mut l1, alpha, scale, n, v);
                naive::distill_backward_inplace(&mut g2, &t, &tg, &mut l2, alpha, scale, n, v);
                let what = format!("{n}x{v} alpha {alpha}");
                assert_close(&l1, &l2, 1e-4, 1e-5, &format!("loss {what}"));
                assert_close(&g1, &g2, 1e-7, 1e-5, &format!("grad {what}"));
            }
        }
    }

    /// α = 0 is the data's cross-entropy: the softmax cross-entropy kernel's loss and
    /// gradient.
    #[test]
    fn alpha_zero_is_the_cross_entropy() {
        let (n, v) = (6, 517);
        let (x, t, tg) = case(n, v, 3);
        let (mut g1, mut l1) = (x.clone(), vec![0.0; n]);
        let (mut g2, mut l2) = (x.clone(), vec![0.0; n]);
        distill_backward_inplace(&mut g1, &t, &tg, &mut l1, 0.0, 0.5, n, v);
        super::super::xent::softmax_xent_backward_inplace(&mut g2, &tg, &mut l2, 0.5, n, v);
        assert_close(&l1, &l2, 1e-5, 1e-6, "loss");
        assert_close(&g1, &g2, 1e-9, 1e-6, "grad");
    }

    /// A student equal to its teacher (up to a shift, which softmax ignores) has no KL and,
    /// at α = 1, no gradient.
    #[test]
    fn a_student_equal_to_its_teacher_has_nothing_to_learn() {
        let (n, v) = (3, 300);
        let (x, _, tg) = case(n, v, 5);
        let t: Vec<f32> = x.iter().map(|a| a - 7.0).collect();
        let (mut g, mut l) = (x.clone(), vec![0.0; n]);
        distill_backward_inplace(&mut g, &t, &tg, &mut l, 1.0, 1.0, n, v);
        assert!(l.iter().all(|&l| l.abs() < 1e-5), "{l:?}");
        assert!(g.iter().all(|&g| g.abs() < 1e-6));
    }

    /// The gradient is the loss's: central differences of the naive loss in f64.
    #[test]
    fn the_gradient_is_the_losss() {
        let (n, v) = (2, 9);
        let (x, t, tg) = case(n, v, 9);
        let alpha = 0.7;
        let loss = |x: &[f32]| {
            let (mut g, mut l) = (x.to_vec(), vec![0.0; n]);
            naive::distill_backward_inplace(&mut g, &t, &tg, &mut l, alpha, 1.0, n, v);
            l.iter().map(|&l| l as f64).sum::<f64>()
        };
        let (mut g, mut l) = (x.clone(), vec![0.0; n]);
        distill_backward_inplace(&mut g, &t, &tg, &mut l, alpha, 1.0, n, v);
        for i in 0..n * v {
            let h = 1e-2f32;
            let (mut up, mut dn) = (x.clone(), x.clone());
            up[i] += h;
            dn[i] -= h;
            let fd = (loss(&up) - loss(&dn)) / (2.0 * h as f64);
            assert!(
                (fd - g[i] as f64).abs() < 2e-3,
                "element {i}: {fd} vs {}",
                g[i]
            );
        }
    }
}
