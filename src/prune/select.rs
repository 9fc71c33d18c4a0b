//! Which shape `prune` keeps when its budget allows several (`--keep` or `--fit-memory`
//! without widths: the frontier of embedding and MLP widths, [`super::shape::frontier`]):
//! the one whose pruned model predicts held-out calibration tokens best. Each candidate is
//! cut from the scores as the result would be and run as `sample` runs it, held as
//! [`super::held`] holds it, over [`SEQUENCES`] sequences drawn after the scored ones.
//!
//! Minitron ranks candidate architectures after a short retraining; the loss before any
//! training is the cheap proxy. On SmolLM2-135M at 75% it ranked the candidates as 300
//! distilled steps did (`docs/benchmarks.md`).

use super::cut::{self, Cut, Read};
use super::held::{self, Values};
use super::score::Scores;
use super::shape::Shape;
use crate::backend::DeviceId;
use crate::backend::host;
use crate::dtype::DType;
use crate::exec::Executor;
use crate::ir::schedule::Op;
use crate::model::{ModelSpec, ParamLayout, ParamTensor};
use crate::plan::Plan;
use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::collections::BTreeMap;

/// Held-out calibration sequences each candidate is measured on.
pub const SEQUENCES: usize = 16;

/// One candidate shape and its pruned model's calibration loss.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub shape: Shape,
    pub params: usize,
    /// The mean next-token cross-entropy over the held-out sequences (nats).
    pub loss: f64,
}

/// Rows of the LM head's logits computed at once (`[ROWS, V]` floats).
const ROWS: usize = 32;

/// The mean next-token cross-entropy of the model `ex` runs (a generation plan of `seq`
/// tokens) with its LM head `head` `[V, C]` (f32) over `rows` (`seq + 1` token ids each:
/// the inputs, then each one's next); `tick` after each row.
pub fn calibration_loss(
    ex: &mut Executor,
    head: &[f32],
    rows: &[Vec<u32>],
    tick: &mut dyn FnMut(),
) -> Result<f64> {
    let seq = ex.plan.cfg.seq;
    let (at, inp, c, v) = (ex.plan.schedule.ops.iter().enumerate())
        .find_map(|(i, e)| match &e.op {
            Op::LmHeadLast { inp, c, v, .. } => Some((i, *inp, *c, *v)),
            _ => None,
        })
        .context("internal error: a generation plan without its head")?;
    if head.len() != v * c {
        bail!(
            "internal error: a head of {} values for [{v}, {c}]",
            head.len()
        );
    }
    let mut logits = vec![0f32; ROWS * v]; // [ROWS, V]
    let (mut sum, mut n) = (0f64, 0usize);
    for row in rows {
        let (ids, next) = (&row[..seq], &row[1..]);
        ex.forward_watching(ids, &[(at, inp)], &mut |_, x| {
            // x: the final norm's output [T, C].
            for (t0, xs) in x[..seq * c].chunks(ROWS * c).enumerate() {
                let r = xs.len() / c;
                let out = &mut logits[..r * v];
                out.fill(0.0);
                host::sgemm_acc((r, v, c), 1.0, (xs, c, false), (head, c, true), out, v);
                for (k, l) in out.chunks_exact(v).enumerate() {
                    sum += cross_entropy(l, next[t0 * ROWS + k] as usize);
                }
            }
            Ok(())
        })?;
        n += seq;
        tick();
    }
    Ok(sum / n.max(1) as f64)
}

/// The LM head `[V, C]` of the model `plan` runs (its tied embedding, where it has one),
/// in f32 from `values` (the model's layout `layout`).
pub fn head(plan: &Plan, layout: &ParamLayout, values: &mut Values<'_>) -> Result<Vec<f32>> {
    let w = (plan.schedule.ops.iter())
        .find_map(|e| match &e.op {
            Op::LmHeadLast { w, .. } => Some(w.clone()),
            _ => None,
        })
        .context("internal error: a generation plan without its head")?;
    let Some(t) = layout.tensors.iter().find(|t| t.range == w) else {
        bail!("internal error: no tensor of the model is its head {w:?}");
    };
    let mut out = Vec::with_capacity(w.len());
    values(t, &mut |piece| {
        out.extend_from_slice(piece);
        Ok(())
    })?;
    Ok(out)
}

/// −log softmax(`logits`)[`target`], in f64.
fn cross_entropy(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln() - logits[target] as f64
}

/// Each of `shapes` cut by `scores` from the model `spec` (its parameters read by `read`,
/// held as `held`, [`super::held::storage_of`]), and its calibration loss over `rows`, run
/// one candidate at a time; `tick` after each row of each.
pub fn by_loss(
    read: &mut Read<'_>,
    (spec, scores, held): (&ModelSpec, &Scores, Option<&BTreeMap<String, DType>>),
    shapes: &[Shape],
    rows: &[Vec<u32>],
    (seq, threads, device): (usize, usize, DeviceId),
    tick: &mut dyn FnMut(),
) -> Result<Vec<Candidate>> {
    let old = ParamLayout::new(spec);
    let mut out = Vec::with_capacity(shapes.len());
    for &shape in shapes {
        let kept = cut::choose(spec, scores, &shape);
        let new_spec = shape.apply(spec);
        let storage = held::candidate_storage(held, &new_spec, &kept)?;
        let plan = held::plan(&new_spec, seq, &storage, (threads, device))?;
        let layout = ParamLayout::new(&new_spec);
        let mut cut = Cut::new(spec, &kept, &old);
        let mut values =
            |t: &ParamTensor, put: &mut dyn FnMut(&[f32]) -> Result<()>| cut.tensor(t, read, put);
        let head = head(&plan, &layout, &mut values)?;
        let mut ex = held::open(plan, device, None, &mut values)?;
        let loss = calibration_loss(&mut ex, &head, rows, tick)?;
        out.push(Candidate {
            shape,
            params: layout.total,
            loss,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_entropy_is_minus_the_log_softmax_of_the_target() {
        let l = [1.0f32, 2.0, 3.0];
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        for t in 0..3 {
            let want = -((l[t] as f64).exp() / z).ln();
            assert!((cross_entropy(&l, t) - want).abs() < 1e-12);
        }
        // Uniform logits: log V.
        assert!((cross_entropy(&[5.0; 4], 2) - 4f64.ln()).abs() < 1e-12);
    }
}
