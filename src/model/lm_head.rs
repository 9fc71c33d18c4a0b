//! The LM head of a micro-batch, whatever the family: in generation plans the next-token
//! logits of the last row; in training plans the head and the cross-entropy loss, chunked over
//! rows so that only one `[rows, V]` logits chunk exists at a time (its size set by
//! `StepConfig::logits_chunk_bytes`), writing the gradient of the head's input.

use crate::ir::EmitOptions;
use crate::ir::builder::{Builder, MicroBatch};
use crate::ir::schedule::{Op, Phase};
use crate::ir::{BufId, Category};
use std::ops::Range;

/// What the head left: generation logits, or the gradient of its input.
pub(crate) enum Head {
    /// `Next-token logits [V]` (generation plans).
    Logits(BufId),
    /// `d(loss)/d(inp) [N, C]` (training plans), named `{prefix}{dinp_name}`.
    InputGrad(BufId),
}

/// Emits the head reading `inp` `[N, C]` (the final norm's output) with weight `w` `[V, C]`.
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
    let row_bytes = (v * 4) as u64;
    let n_chunks = ((n as u64) * row_bytes)
        .div_ceil(cfg.logits_chunk_bytes.max(row_bytes))
        .max(1);
    let rows_per_chunk = n.div_ceil(n_chunks as usize);
    let logits = g.f32(
        format!("{pfx}logits.chunk"),
        Category::Workspace,
        rows_per_chunk * v,
    ); // [rows, V]
    let dinp = g.act(format!("{pfx}{dinp_name}"), Category::ActivationGrad, n * c); // [N, C]
    g.op(
        format!("{pfx}lm_head+loss"),
        Phase::Forward,
        6 * (n * c * v) as u64,
        Op::LmHeadLoss {
            inp,
            targets: loss.targets,
            losses: loss.losses,
            logits,
            dinp: Some(dinp),
            w,
            rows: mb.rows,
            c,
            v,
            rows_per_chunk,
        },
    );
    Head::InputGrad(dinp)
}
