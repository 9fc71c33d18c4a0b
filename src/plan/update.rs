//! `--update in-backward` ([`Update::InBackward`]): each parameter group's AdamW step runs as
//! soon as the group's gradients are final, inside the backward (PyTorch's
//! optimizer-in-backward, LOMO's fused update), so a group's gradients live from its backward
//! to its update and no step holds the whole model's.
//!
//! Two passes of [`super::build`] do it:
//! - [`head_after_backward`]: the LM head's weight gradient would otherwise be the first to
//!   exist and the last to be final (a tied embedding's gradient is finished by the
//!   embedding's backward, the backward's last op), alive through the whole backward. So the
//!   head's op takes only its input's gradient and leaves each row's softmax statistics
//!   (`LmHeadLoss::row_stats`); after the backward, [`Op::LmHeadWeightGrad`] takes the weight
//!   gradient of one slice of the vocabulary at a time (its logits computed again), a tied
//!   embedding's backward scatter adds that slice's rows, and the slice is updated. The
//!   gradient segments ([`HeadSlices::group_segments`]) give each slice its own buffer, so
//!   only one slice's gradient exists at a time.
//! - [`move_updates`]: each segment's `AdamW` (and so its gradients' last use) moves to just
//!   after the last op that touches the segment's parameters or gradients, its norm share
//!   included.
//!
//! The arithmetic is [`Update::End`]'s: every op computes what it computed, on the same
//! values (a group's update runs after the last op that reads it). The update needs its
//! clipping factor before the norm is known, so clipping is refused (`--grad-clip 0`,
//! checked where the hyperparameters are), and a step whose gradients are not finite cannot
//! be skipped whole: the executor stops the run (its last checkpoint is kept).

use super::config::StepConfig;
use crate::ir::builder::Builder;
use crate::ir::schedule::{HEAD_ROW_STATS, Op, OpEntry, Phase, Segments};
use crate::ir::{Category, Precision, QBLOCK, Update};
use crate::model::ParamLayout;
use anyhow::{Result, bail};
use std::ops::Range;

/// Refuses what `--update in-backward` does not compose with, naming the flags;
/// `on_host`: the updates run on the host's cores, their state in pinned RAM beneath a GPU.
pub(super) fn check(cfg: &StepConfig, on_host: bool) -> Result<()> {
    if cfg.update != Update::InBackward {
        return Ok(());
    }
    let flag = "--update in-backward";
    if cfg.mesh.world() > 1 {
        bail!(
            "{flag} runs on one process for now: the ranks' sums of gradients (--zero, --tp, \
             --pp) are placed for an update after the backward; use --update end with \
             {} ranks",
            cfg.mesh.world()
        );
    }
    if cfg.offload.set.any() && !on_host {
        bail!(
            "{flag} with --offload {}: offloaded state is staged for an update after the \
             backward; use --update end, or --offload none (beneath a GPU, --offload \
             optimizer,params,grads runs each update on the host's cores inside the backward)",
            cfg.offload.set
        );
    }
    if cfg.precision == Precision::F16 {
        bail!(
            "{flag} with --precision fp16: loss scaling skips a step whose gradients overflow, \
             and an update inside the backward cannot be taken back; use --precision bf16 or \
             fp32"
        );
    }
    if cfg.distill.is_some() {
        bail!("{flag} with --distill-from: not yet; use --update end");
    }
    Ok(())
}

/// The LM head's weight, its gradient taken after the backward a slice of the vocabulary at
/// a time ([`head_after_backward`]).
pub(super) struct HeadSlices {
    /// The head's elements `[V, C]` in the parameters.
    head: Range<usize>,
    c: usize,
    v: usize,
    /// Words per slice (the last one may have fewer): as many as `logits_chunk_bytes` of f32
    /// gradient hold, in a whole number of 8-bit optimizer blocks (so each slice's moments
    /// start a block, [`QBLOCK`]).
    words: usize,
}

/// The head's slices for `cfg` and the layout it trains, if its weight gradient is taken
/// after the backward: with `--update in-backward`, one micro-batch a step (accumulating
/// micro-batches keep every gradient across the step anyway), the model trained (not
/// adapters), and its head a tensor held whole (a tied embedding, or `lm_head.weight`).
pub(super) fn head_slices(cfg: &StepConfig, layout: &ParamLayout) -> Option<HeadSlices> {
    if cfg.update != Update::InBackward || cfg.grad_accum != 1 || cfg.lora.is_some() {
        return None;
    }
    let head = match layout.tied.first() {
        Some(t) => &layout.tensors[t.tensor],
        None => layout.tensors.iter().find(|t| t.name == "lm_head.weight")?,
    };
    let [v, c] = head.shape[..] else {
        return None;
    };
    if head.part.is_some() || v == 0 || c == 0 {
        return None;
    }
    let align = QBLOCK / gcd(c, QBLOCK);
    let bytes = usize::try_from(cfg.logits_chunk_bytes).unwrap_or(usize::MAX);
    let words = (bytes / (4 * c) / align).max(1) * align;
    Some(HeadSlices {
        head: head.range.clone(),
        c,
        v,
        words: words.min(v),
    })
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl HeadSlices {
    /// The slices' words, in order.
    fn slices(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.v)
            .step_by(self.words)
            .map(|lo| lo..(lo + self.words).min(self.v))
    }

    /// The head's elements of `words`.
    fn elems(&self, words: &Range<usize>) -> Range<usize> {
        self.head.start + words.start * self.c..self.head.start + words.end * self.c
    }

    /// The gradient segments of the group of elements `group` (suffixes of its buffer's
    /// name, and their ranges), if it holds the head: the part before the head, then one
    /// per slice, the last running to the group's end (a tied embedding's group also holds
    /// GPT-2's learned positions, which the last slice's embedding backward writes).
    pub(super) fn group_segments(
        &self,
        group: &Range<usize>,
    ) -> Option<Vec<(String, Range<usize>)>> {
        if !(group.start <= self.head.start && self.head.end <= group.end) {
            return None;
        }
        let mut out = Vec::new();
        if group.start < self.head.start {
            out.push((String::new(), group.start..self.head.start));
        }
        let n = self.v.div_ceil(self.words);
        for (k, words) in self.slices().enumerate() {
            let mut r = self.elems(&words);
            if k + 1 == n {
                r.end = group.end;
            }
            out.push((format!(".slice{k}"), r));
        }
        Some(out)
    }
}

/// The head's weight gradient taken after the backward, a slice of the vocabulary at a time
/// (see the module's text): the head's op leaves its rows' statistics instead; a tied
/// embedding's backward is cut into the same slices; each slice's ops go after the
/// backward's last op, each over the head's chunks of rows.
pub(super) fn head_after_backward(g: &mut Builder, s: &HeadSlices) {
    let at = g
        .ops
        .iter()
        .position(|e| matches!(e.op, Op::LmHeadLoss { dinp: Some(_), .. }) && !e.frozen)
        .expect("internal error: a training plan without its LM head");
    let Op::LmHeadLoss {
        inp,
        targets,
        rows,
        c,
        rows_per_chunk,
        ..
    } = g.ops[at].op
    else {
        unreachable!()
    };
    let n = rows.n();
    let stats = g.f32("lm_head.row_stats", Category::Workspace, n * HEAD_ROW_STATS); // [N, 2]
    let head = &mut g.ops[at];
    if let Op::LmHeadLoss { row_stats, .. } = &mut head.op {
        *row_stats = Some(stats);
    }
    // Two of its three GEMMs: the weight gradient's is taken after the backward.
    head.flops = head.flops / 3 * 2;
    // A tied embedding's backward scatter, taken out to be cut into the slices.
    let encoder = g
        .ops
        .iter()
        .position(|e| matches!(&e.op, Op::EncoderBackward { wte, .. } if *wte == s.head))
        .map(|i| g.ops.remove(i));
    // The head's chunks of rows, so each slice's gradient adds them up in its order.
    let logits = g.f32(
        "lm_head.slice.logits",
        Category::Workspace,
        rows_per_chunk * s.words,
    ); // [rows, words]
    let slices: Vec<Range<usize>> = s.slices().collect();
    for (k, words) in slices.iter().enumerate() {
        let (w, v) = (s.elems(words), words.len());
        g.op(
            format!("lm_head.slice{k}.weight_grad"),
            Phase::Backward,
            4 * (n * c * v) as u64,
            Op::LmHeadWeightGrad {
                inp,
                targets,
                row_stats: stats,
                logits,
                w: w.clone(),
                first_token: words.start,
                rows,
                c,
                v,
                rows_per_chunk,
            },
        );
        let Some(enc) = &encoder else {
            continue;
        };
        let Op::EncoderBackward {
            dout,
            tokens,
            positions,
            wpe,
            rows,
            c,
            scale,
            ..
        } = &enc.op
        else {
            unreachable!()
        };
        g.ops.push(OpEntry {
            name: format!("{}.slice{k}", enc.name),
            op: Op::EncoderBackward {
                dout: *dout,
                tokens: *tokens,
                positions: *positions,
                wte: w,
                // The learned positions' rows go with the last slice (its segment's end).
                wpe: wpe.clone().filter(|_| k + 1 == slices.len()),
                first_token: words.start,
                rows: *rows,
                c: *c,
                scale: *scale,
            },
            ..enc.clone()
        });
    }
}

/// Moves each `AdamW` op (of the optimizer phase, one per gradient segment) to just after
/// the last op of the step that touches its segment's parameters or gradients (the
/// segment's norm share among them), so its gradients die there. `late` (updates on the
/// host's cores): each goes where the next one would instead (the last stays), so the host,
/// which waits for a group's gradients to land before updating it, has already queued the
/// next group's backward for the GPU to run meanwhile.
pub(super) fn move_updates(g: &mut Builder, grads: &Segments, late: bool) {
    let segs = &grads.segments;
    let first = |r: &Range<usize>| segs.partition_point(|s| s.range.end <= r.start);
    let mut last = vec![0usize; segs.len()];
    for (i, e) in g.ops.iter().enumerate() {
        if e.phase == Phase::Optimizer {
            continue;
        }
        // A frozen op's parameters are the base's, not these.
        let params = match e.frozen {
            true => Vec::new(),
            false => e.op.param_ranges(),
        };
        for r in params.iter().chain(&e.grad_ranges()) {
            let mut k = first(r);
            while k < segs.len() && segs[k].range.start < r.end {
                last[k] = i;
                k += 1;
            }
        }
    }
    let ops = std::mem::take(&mut g.ops);
    let mut after: Vec<Vec<OpEntry>> = vec![Vec::new(); ops.len()];
    let mut kept = Vec::with_capacity(ops.len());
    let mut updates = Vec::new();
    for (i, e) in ops.into_iter().enumerate() {
        match (&e.op, e.phase) {
            (Op::AdamW { tensors, .. }, Phase::Optimizer) if !tensors.is_empty() => {
                updates.push((last[first(&tensors[0].range)], e))
            }
            _ => kept.push((i, e)),
        }
    }
    updates.sort_by_key(|u| u.0);
    let places: Vec<usize> = updates.iter().map(|u| u.0).collect();
    for (j, (at, e)) in updates.into_iter().enumerate() {
        let at = match late {
            true => places.get(j + 1).copied().unwrap_or(at),
            false => at,
        };
        after[at].push(e);
    }
    for (i, e) in kept {
        g.ops.push(e);
        g.ops.append(&mut after[i]);
    }
}
