//! Pipeline parallelism's passes over a stage's schedule (`--pp P`, [`crate::ir::PipelineStage`]).
//!
//! The family emits each micro-batch of the stage whole, forward then backward, with the
//! sends and receives that join it to its neighbours ([`crate::model::block_emit`]'s
//! `send_to_stage` and `receive_from_stage`). [`one_f_one_b`] reorders those pieces into
//! the 1F1B schedule (Narayanan et al. 2021, PipeDream-Flush; Megatron's
//! `forward_backward_pipelining_without_interleaving`): stage `s` of `p` runs
//! `w = min(p − s − 1, m)` forwards, then alternates one forward and one backward, then the
//! `w` backwards left, so it holds at most `min(p − s, m)` micro-batches of activations
//! (which the lifetimes, taken from this order, then show).
//!
//! **No deadlock on a blocking transport.** Two neighbouring stages must meet each message
//! between them in the same order. In the steady phase a stage would send micro-batch `i`'s
//! output just as the next stage sends back micro-batch `i − w`'s gradient: both sending at
//! once, which a transport that waits for its receiver (MPI's rendezvous) never finishes.
//! So each steady forward's send waits until the backward's gradient has been received
//! (Megatron pairs the two in one `send_forward_recv_backward`); [`order`] writes that
//! down and its test runs every (p, m) against a rendezvous transport.
//!
//! A tied embedding is held by the first and the last stage ([`tied_embedding_sum`]): their
//! gradients are summed between the two after the step's backward, so both apply the same
//! update and stay equal.

use crate::ir::builder::Builder;
use crate::ir::schedule::{Op, OpEntry, Phase, Segments};
use crate::ir::{Axis, Category, Cut, CutOf, PipelineStage};
use crate::model::ParamLayout;

/// A piece of one micro-batch's work on a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Micro-batch `i`'s forward, up to (not including) the send of its output.
    Forward(usize),
    /// The send of micro-batch `i`'s output to the next stage (nothing on the last).
    ForwardSend(usize),
    /// The receive of micro-batch `i`'s output gradient from the next stage (nothing on the
    /// last).
    BackwardRecv(usize),
    /// The rest of micro-batch `i`'s backward.
    Backward(usize),
}

/// The 1F1B order of `stage`'s pieces of `m` micro-batches.
pub(crate) fn order(stage: PipelineStage, m: usize) -> Vec<Piece> {
    use Piece::*;
    let w = (stage.size - stage.rank - 1).min(m);
    let mut out = Vec::with_capacity(4 * m);
    for i in 0..w {
        out.extend([Forward(i), ForwardSend(i)]);
    }
    for i in w..m {
        // The forward's send waits for the backward's receive: see the module doc.
        out.extend([
            Forward(i),
            BackwardRecv(i - w),
            ForwardSend(i),
            Backward(i - w),
        ]);
    }
    for j in m - w..m {
        out.extend([BackwardRecv(j), Backward(j)]);
    }
    out
}

/// Reorders the ops of the `m` micro-batches just emitted (each forward then backward, in
/// order) into [`order`]'s 1F1B schedule for `stage`. Nothing on one stage.
pub(crate) fn one_f_one_b(g: &mut Builder, stage: PipelineStage, m: usize) {
    if !stage.is_split() {
        return;
    }
    // Per micro-batch: [forward, its trailing send, the backward's leading receive, the rest].
    let mut pieces: Vec<[Vec<OpEntry>; 4]> = (0..m).map(|_| Default::default()).collect();
    for e in std::mem::take(&mut g.ops) {
        let k = e.micro;
        let p = &mut pieces[k];
        let slot = match e.phase {
            Phase::Forward if is_stage_comm(&e.op, &p[1], true) => 1,
            Phase::Forward => {
                assert!(
                    p[1].is_empty(),
                    "internal error: {} after its stage's send",
                    e.name
                );
                0
            }
            Phase::Backward | Phase::Recompute
                if p[3].is_empty() && is_stage_comm(&e.op, &p[2], false) =>
            {
                2
            }
            Phase::Backward | Phase::Recompute => 3,
            other => panic!("internal error: {other:?} op {} in a micro-batch", e.name),
        };
        p[slot].push(e);
    }
    for piece in order(stage, m) {
        let (k, slot) = match piece {
            Piece::Forward(k) => (k, 0),
            Piece::ForwardSend(k) => (k, 1),
            Piece::BackwardRecv(k) => (k, 2),
            Piece::Backward(k) => (k, 3),
        };
        g.ops.append(&mut pieces[k][slot]);
    }
}

/// Whether `op` is a stage send (`send`) or receive, or the await of the one just before
/// it in `piece` (the pair is moved together).
fn is_stage_comm(op: &Op, piece: &[OpEntry], send: bool) -> bool {
    match op {
        Op::StageSend { .. } => send,
        Op::StageRecv { .. } => !send,
        Op::AwaitCollective { bufs } => piece.last().is_some_and(|e| match e.op {
            Op::StageSend { buf, .. } => send && bufs[0] == buf,
            Op::StageRecv { buf, .. } => !send && bufs[0] == buf,
            _ => false,
        }),
        _ => false,
    }
}

/// On the first and the last stage of a model whose LM head is its embedding, both holding
/// it: sums the gradients of the embedding's parameter group between the two (an
/// all-reduce along the pipeline axis, whose two stages they are: `--pp 2`, checked by the
/// planner), after the step's backward, so both update it alike. Both ends hold the same
/// group (GPT-2's keeps `wpe` beside `wte` on the last stage too). Nothing otherwise.
pub(crate) fn tied_embedding_sum(g: &mut Builder, layout: &ParamLayout, grads: &Segments) {
    let stage = layout.stage;
    if !stage.is_split() || layout.tied.is_empty() {
        return;
    }
    debug_assert_eq!(stage.size, 2, "checked: tied embeddings with --pp 2 only");
    let tensor = &layout.tensors[layout.tied[0].tensor];
    let seg = grads.locate(&tensor.range);
    let (buf, len) = (seg.buf, seg.range.len());
    let scratch = g.act(
        "tied_embedding.grad.comm",
        Category::Communication,
        Cut::even(len, 2).scratch(),
    );
    // After the last backward op: both stages' backward done.
    let at = g
        .ops
        .iter()
        .rposition(|e| matches!(e.phase, Phase::Backward | Phase::Recompute))
        .map_or(g.ops.len(), |i| i + 1);
    let entry = |name: &str, op| OpEntry {
        name: name.into(),
        phase: Phase::Backward,
        op,
        flops: 0,
        params: None,
        grads: None,
        micro: 0,
        frozen: false,
    };
    let reduce = entry(
        "tied_embedding.grad.all_reduce",
        Op::AllReduce {
            buf,
            scratch,
            cut: CutOf::Even,
            axis: Axis::Pipeline,
            elems: None,
        },
    );
    let wait = entry(
        "tied_embedding.grad.all_reduce.await",
        Op::AwaitCollective {
            bufs: vec![buf, scratch],
        },
    );
    g.ops.splice(at..at, [reduce, wait]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message between two neighbouring stages.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Msg {
        Act(usize),
        Grad(usize),
    }

    /// Stage `s` of `p`'s sends and receives in the order `pieces` gives: (send?, peer
    /// stage, message).
    fn events(pieces: Vec<Piece>, s: usize, p: usize) -> Vec<(bool, usize, Msg)> {
        let stage = PipelineStage::even(p, s, p);
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Forward(i) if !stage.is_first() => out.push((false, s - 1, Msg::Act(i))),
                Piece::ForwardSend(i) if !stage.is_last() => out.push((true, s + 1, Msg::Act(i))),
                Piece::BackwardRecv(i) if !stage.is_last() => {
                    out.push((false, s + 1, Msg::Grad(i)))
                }
                Piece::Backward(i) if !stage.is_first() => out.push((true, s - 1, Msg::Grad(i))),
                _ => {}
            }
        }
        out
    }

    /// Every stage runs each micro-batch's forward and backward once, forward first, and
    /// holds at most min(p − s, m) micro-batches between a forward and its backward.
    #[test]
    fn each_stage_runs_every_piece_once_holding_at_most_p_minus_s() {
        for p in 1..=5 {
            for m in 1..=9 {
                for s in 0..p {
                    let stage = PipelineStage::even(p, s, p);
                    let o = order(stage, m);
                    assert_eq!(o.len(), 4 * m);
                    let (mut held, mut most) = (0usize, 0usize);
                    for i in 0..m {
                        let at = |x| o.iter().position(|&y| y == x).expect("every piece");
                        assert!(at(Piece::Forward(i)) < at(Piece::ForwardSend(i)));
                        assert!(at(Piece::ForwardSend(i)) < at(Piece::Backward(i)));
                        assert!(at(Piece::BackwardRecv(i)) < at(Piece::Backward(i)));
                    }
                    for x in &o {
                        match x {
                            Piece::Forward(_) => held += 1,
                            Piece::Backward(_) => held -= 1,
                            _ => {}
                        }
                        most = most.max(held);
                    }
                    assert_eq!(most, stage.in_flight(m), "p {p} m {m} s {s}");
                }
            }
        }
    }

    /// Whether the stages' sends and receives all meet on a transport where a send waits
    /// for its receiver (rendezvous): each step, any two neighbours whose next events are
    /// the two ends of one message both move on.
    fn runs_to_the_end(ev: &[Vec<(bool, usize, Msg)>]) -> bool {
        let mut at = vec![0usize; ev.len()];
        loop {
            let mut moved = false;
            for s in 0..ev.len() {
                let Some(&(send, peer, msg)) = ev[s].get(at[s]) else {
                    continue;
                };
                if let Some(&(psend, pp, pmsg)) = ev[peer].get(at[peer])
                    && psend != send
                    && pp == s
                    && pmsg == msg
                {
                    at[s] += 1;
                    at[peer] += 1;
                    moved = true;
                }
            }
            if !moved {
                return (0..ev.len()).all(|s| at[s] == ev[s].len());
            }
        }
    }

    #[test]
    fn the_schedule_never_deadlocks_on_a_rendezvous_transport() {
        for p in 2..=6 {
            for m in 1..=10 {
                let ev: Vec<_> = (0..p)
                    .map(|s| events(order(PipelineStage::even(p, s, p), m), s, p))
                    .collect();
                assert!(runs_to_the_end(&ev), "p {p} m {m}");
            }
        }
    }

    /// Without the steady phase's reordering (each forward's send straight after it), two
    /// neighbours would both be sending: the check above catches it.
    #[test]
    fn sending_each_forward_at_once_would_deadlock() {
        let (p, m) = (2, 4);
        let ev: Vec<_> = (0..p)
            .map(|s| {
                let mut o = order(PipelineStage::even(p, s, p), m);
                for k in 1..o.len() {
                    if let (Piece::BackwardRecv(_), Piece::ForwardSend(_)) = (o[k - 1], o[k]) {
                        o.swap(k - 1, k);
                    }
                }
                events(o, s, p)
            })
            .collect();
        assert!(!runs_to_the_end(&ev));
    }
}
