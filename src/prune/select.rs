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
use super::held::{self, Storage, Values};
use super::score::Scores;
use super::shape::Shape;
use crate::backend::DeviceId;
use crate::backend::host;
use crate::dtype::{DType, GgmlType, dequant::dequantize};
use crate::exec::Executor;
use crate::ir::schedule::Op;
use crate::model::{ModelSpec, ParamLayout, ParamTensor};
use crate::plan::Plan;
use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::collections::BTreeMap;
use std::ops::Range;

/// Held-out calibration sequences each candidate is measured on.
pub const SEQUENCES: usize = 16;

/// One candidate shape and its pruned model's calibration loss.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub shape: Shape,
    pub params: usize,
    /// The mean next-token cross-entropy over the held-out sequences (nats).
    pub loss: f64,
    /// What running it held: its plan's bytes and its head's copy ([`Head`]).
    #[serde(default)]
    pub bytes: u64,
}

/// Rows of the LM head decoded and multiplied at once (`[VOCAB_CHUNK, C]` floats).
const VOCAB_CHUNK: usize = 4096;

/// A candidate's LM head `[V, C]` held as the candidate holds it (f32, or rows of ggml
/// blocks), decoded `VOCAB_CHUNK` (4096) rows at a time: a pruned 8B's 128k-token head is about
/// 0.5 GB in q8_0, 1.8 GB in f32.
pub struct Head {
    ty: GgmlType,
    bytes: Vec<u8>,
    v: usize,
    c: usize,
}

impl Head {
    /// The head of the model `plan` runs (its tied embedding, where it has one: a tensor of
    /// `layout`), held as `storage` holds it, from `values`.
    pub fn of(
        plan: &Plan,
        layout: &ParamLayout,
        storage: &Storage,
        values: &mut Values<'_>,
    ) -> Result<Head> {
        let (w, c, v) = (plan.schedule.ops.iter())
            .find_map(|e| match &e.op {
                Op::LmHeadLast { w, c, v, .. } => Some((w.clone(), *c, *v)),
                _ => None,
            })
            .context("internal error: a generation plan without its head")?;
        let Some(t) = layout.tensors.iter().find(|t| t.range == w) else {
            bail!("internal error: no tensor of the model is its head {w:?}");
        };
        let held = storage.type_of(&t.name);
        let ty = held.unwrap_or(GgmlType::F32);
        let Some(n) = ty.bytes_for(w.len() as u64) else {
            bail!("internal error: a head of {} values in {ty}", w.len());
        };
        let mut bytes = vec![0u8; n as usize];
        held::fill(t, held, &mut bytes, values)?;
        Ok(Head { ty, bytes, v, c })
    }

    /// Rows `r` decoded into `dst` (`[r.len(), C]`).
    fn rows(&self, r: Range<usize>, dst: &mut [f32]) -> Result<()> {
        let at = |i: usize| (self.ty.bytes_for((i * self.c) as u64)).map(|b| b as usize);
        let (Some(a), Some(b)) = (at(r.start), at(r.end)) else {
            bail!(
                "internal error: head rows {r:?} are not whole {} blocks",
                self.ty
            );
        };
        dequantize(self.ty, &self.bytes[a..b], dst)
    }
}

/// The mean next-token cross-entropy of the model `ex` runs (a generation plan of `seq`
/// tokens) with its LM head `head` over `rows` (`seq + 1` token ids each: the inputs, then
/// each one's next); `tick` after each row. The logits are computed `VOCAB_CHUNK` (4096) words
/// at a time for a whole sequence, each position's log-sum-exp carried across the chunks.
pub fn calibration_loss(
    ex: &mut Executor,
    head: &Head,
    rows: &[Vec<u32>],
    tick: &mut dyn FnMut(),
) -> Result<f64> {
    let seq = ex.plan.cfg.seq;
    let (at, inp) = (ex.plan.schedule.ops.iter().enumerate())
        .find_map(|(i, e)| match &e.op {
            Op::LmHeadLast { inp, .. } => Some((i, *inp)),
            _ => None,
        })
        .context("internal error: a generation plan without its head")?;
    let (v, c) = (head.v, head.c);
    let vc = VOCAB_CHUNK.min(v);
    let mut w = vec![0f32; vc * c]; // [vc, C]
    let mut logits = vec![0f32; seq * vc]; // [T, vc]
    // Per position: the running max and sum of exp(logit - max), and the target's logit.
    let (mut max, mut sum, mut target) = (vec![0f64; seq], vec![0f64; seq], vec![0f64; seq]);
    let (mut total, mut n) = (0f64, 0usize);
    for row in rows {
        let (ids, next) = (&row[..seq], &row[1..]);
        max.fill(f64::NEG_INFINITY);
        sum.fill(0.0);
        ex.forward_watching(ids, &[(at, inp)], &mut |_, x| {
            // x: the final norm's output [T, C].
            let x = &x[..seq * c];
            for v0 in (0..v).step_by(vc) {
                let nv = vc.min(v - v0);
                head.rows(v0..v0 + nv, &mut w[..nv * c])?;
                let out = &mut logits[..seq * nv];
                out.fill(0.0);
                host::sgemm_acc((seq, nv, c), 1.0, (x, c, false), (&w, c, true), out, nv);
                for (t, l) in out.chunks_exact(nv).enumerate() {
                    fold_exp(l, &mut max[t], &mut sum[t]);
                    let y = next[t] as usize;
                    if (v0..v0 + nv).contains(&y) {
                        target[t] = l[y - v0] as f64;
                    }
                }
            }
            Ok(())
        })?;
        total += (0..seq)
            .map(|t| max[t] + sum[t].ln() - target[t])
            .sum::<f64>();
        n += seq;
        tick();
    }
    Ok(total / n.max(1) as f64)
}

/// Folds `logits` into a running `max` and `sum` of exp(logit − max): after every chunk of
/// a row, max + ln sum is the log-sum-exp of the row so far.
fn fold_exp(logits: &[f32], max: &mut f64, sum: &mut f64) {
    let m = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let m2 = max.max(m);
    let s: f64 = logits.iter().map(|&x| (x as f64 - m2).exp()).sum();
    *sum = *sum * (*max - m2).exp() + s;
    *max = m2;
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
        let head = Head::of(&plan, &layout, &storage, &mut values)?;
        let bytes = plan.total_bytes() + head.bytes.len() as u64;
        let mut ex = held::open(plan, device, None, &mut values)?;
        let loss = calibration_loss(&mut ex, &head, rows, tick)?;
        out.push(Candidate {
            shape,
            params: layout.total,
            loss,
            bytes,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_folded_in_chunks_has_its_whole_log_sum_exp() {
        let l = [1.0f32, 2.0, 3.0, -4.0, 7.5];
        let want = l.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        for split in 1..l.len() {
            let (mut max, mut sum) = (f64::NEG_INFINITY, 0.0);
            fold_exp(&l[..split], &mut max, &mut sum);
            fold_exp(&l[split..], &mut max, &mut sum);
            assert!((max + sum.ln() - want).abs() < 1e-12, "split at {split}");
        }
    }
}
