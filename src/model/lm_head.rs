//! The LM head of a micro-batch, whatever the family: in generation plans the next-token
//! logits of the last row; in training plans the head and the cross-entropy loss, chunked over
//! rows so that only one `[rows, V]` logits chunk exists at a time (its size set by
//! `StepConfig::logits_chunk_bytes`), writing the gradient of the head's input.
//!
//! Under tensor parallelism each rank holds its rows of the head, its part of the
//! vocabulary ([`crate::ir::TensorSplit::vocab_part`]; Megatron's vocabulary-parallel head
//! and cross-entropy), and no rank holds a whole row of logits: [`Op::LmHeadStats`] reduces
//! the rank's logits of each row to its maximum, sum of exponentials and target logit, an
//! all-gather on the tensor axis gives every rank every rank's, and [`Op::LmHeadLoss`] then
//! computes the same loss on every rank and its own columns of the logits' gradient (the
//! logits computed again, unless they were one chunk and kept). The ranks' input gradients
//! are partial sums, joined by an all-reduce. Under sequence parallelism the head's input is
//! gathered from the ranks' rows first, and its gradient reduce-scattered back to them
//! ([`super::tensor_join`]).

use crate::ir::builder::{Builder, MicroBatch};
use crate::ir::schedule::{Op, Phase, TeacherLogits, VocabShare};
use crate::ir::{Axis, BufId, Category, CutOf, EmitOptions};
use crate::model::tensor_join::{InputGrad, gather_rows};
use std::ops::Range;

/// Per row, the numbers [`Op::LmHeadStats`] keeps: maximum, sum of exponentials, target logit.
const STATS: usize = 3;

/// What the head left: generation logits, or the gradient of its input.
pub(crate) enum Head {
    /// `Next-token logits [V]` (generation plans).
    Logits(BufId),
    /// `d(loss)/d(inp) [N, C]` (training plans; the rank's rows under sequence
    /// parallelism), named `{prefix}{dinp_name}`.
    InputGrad(BufId),
}

/// Emits the head reading `inp` `[N, C]` (the final norm's output, the rank's rows of it
/// under sequence parallelism) with weight `w` `[V, C]` (the rank's rows of the vocabulary
/// `v` under tensor parallelism).
pub(crate) fn emit(
    g: &mut Builder,
    cfg: &EmitOptions,
    mb: &MicroBatch,
    inp: BufId,
    w: Range<usize>,
    (c, v): (usize, usize),
    dinp_name: &str,
) -> Head {
    let (n, pfx) = (mb.rows.n(), mb.prefix.as_str());
    let Some(loss) = &mb.loss else {
        let logits = g.f32("logits", Category::Workspace, v); // [V]
        g.op(
            "lm_head",
            Phase::Forward,
            2 * (c * v) as u64,
            Op::LmHeadLast {
                inp,
                logits,
                w,
                rows: mb.rows,
                c,
                v,
            },
        );
        return Head::Logits(logits);
    };
    let split = cfg.tensor;
    let inp_name = format!("{pfx}lm_head.inp");
    let cat = (inp_name.as_str(), Category::Activation);
    let inp = gather_rows(g, split, (inp, n * c), cat, Phase::Forward);
    let vocab = split.vocab_part(v);
    let v = vocab.len();
    let row_bytes = (v * 4) as u64;
    let n_chunks = ((n as u64) * row_bytes)
        .div_ceil(cfg.logits_chunk_bytes.max(row_bytes))
        .max(1);
    let rows_per_chunk = n.div_ceil(n_chunks as usize);
    let logits = g.f32(
        format!("{pfx}logits.chunk"),
        Category::Workspace,
        rows_per_chunk * v,
    ); // [rows, Vpart]
    let dinp = InputGrad::new(g, split, (&format!("{pfx}{dinp_name}"), n * c)); // [N, C]
    let name = format!("{pfx}lm_head+loss");
    let head_flops = 2 * (n * c * v) as u64;
    let vocab = split.is_split().then(|| {
        let stats = g.f32(
            format!("{pfx}lm_head.stats"),
            Category::Workspace,
            n * STATS,
        ); // [N, 3]
        g.op(
            format!("{pfx}lm_head.stats"),
            Phase::Forward,
            head_flops,
            Op::LmHeadStats {
                inp,
                targets: loss.targets,
                logits,
                stats,
                w: w.clone(),
                first_token: vocab.start,
                rows: mb.rows,
                c,
                v,
                rows_per_chunk,
            },
        );
        // [ranks, N, 3]: every tensor rank's, the same on all.
        let len = split.size * n * STATS;
        let all = g.f32(
            format!("{pfx}lm_head.stats.all"),
            Category::Communication,
            len,
        );
        g.op(
            format!("{pfx}lm_head.stats.all_gather"),
            Phase::Forward,
            0,
            Op::AllGather {
                buf: all,
                shard: Some(stats),
                cut: CutOf::Even,
                axis: Axis::Tensor,
            },
        );
        g.op(
            format!("{pfx}lm_head.stats.all_gather.await"),
            Phase::Forward,
            0,
            Op::AwaitCollective {
                bufs: vec![all, stats],
            },
        );
        VocabShare {
            first_token: vocab.start,
            stats: all,
            ranks: split.size,
            logits_kept: n_chunks == 1,
        }
    });
    let kept = vocab.is_some_and(|s| s.logits_kept);
    // Distillation: the teacher's logits, a chunk at a time beside the student's.
    let teacher = loss.teacher.map(|t| TeacherLogits {
        hidden: t.hidden,
        w: t.head,
        logits: g.f32(
            format!("{pfx}teacher.logits.chunk"),
            Category::Workspace,
            rows_per_chunk * v,
        ), // [rows, V]
        c: t.c,
        alpha: t.alpha,
    });
    let teacher_flops = teacher.map_or(0, |t| 2 * (n * t.c * v) as u64);
    g.op(
        name.clone(),
        Phase::Forward,
        3 * head_flops - if kept { head_flops } else { 0 } + teacher_flops,
        Op::LmHeadLoss {
            inp,
            targets: loss.targets,
            losses: loss.losses,
            logits,
            dinp: Some(dinp.buf),
            w,
            rows: mb.rows,
            c,
            v,
            rows_per_chunk,
            vocab,
            teacher,
            row_stats: None,
        },
    );
    // The ranks' input gradients are each their rows' share.
    Head::InputGrad(dinp.join(g, &name, Phase::Backward))
}
