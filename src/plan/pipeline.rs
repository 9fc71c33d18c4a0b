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
//! **Interleaved** (`--pp-chunks V`, [`PipelineStage::chunks`]): a stage holds V runs of
//! layers and emits each run's forward in turn, then their backwards; [`one_f_one_b`] cuts
//! each micro-batch's ops into its runs' pieces and orders them as Megatron's
//! `forward_backward_pipelining_with_interleaving` does ([`interleaved_order`]). There the
//! pairing above does not suffice (the last stage also sends to the first), so each stage's
//! sends and receives follow the times a simulation of every stage gives the messages: one
//! global order, which no rendezvous can deadlock.
//!
//! A tied embedding is held by the first and the last stage ([`tied_embedding_sum`]): their
//! gradients are summed between the two after the step's backward, so both apply the same
//! update and stay equal.

use crate::ir::builder::Builder;
use crate::ir::schedule::{Op, OpEntry, Phase, Reduce, Segments};
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

/// Where an op of one micro-batch's run of layers goes among its pieces: the receive of its
/// input and its await, its forward, the send of its output and its await, the receive of
/// its output's gradient and its await, its backward, the send of its input's gradient and
/// its await. The sends and receives are empty where the run begins or ends the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Slot {
    Receive,
    ReceiveWait,
    Forward,
    Send,
    SendWait,
    GradReceive,
    GradReceiveWait,
    Backward,
    GradSend,
    GradSendWait,
}

/// Slots of one micro-batch's run.
const SLOTS: usize = 10;

impl Slot {
    /// The await of a send or receive.
    fn wait(self) -> Slot {
        match self {
            Slot::Receive => Slot::ReceiveWait,
            Slot::Send => Slot::SendWait,
            Slot::GradReceive => Slot::GradReceiveWait,
            Slot::GradSend => Slot::GradSendWait,
            other => other,
        }
    }
}

/// A slot of micro-batch `.1`'s run `.2` (0 but under the interleaved schedule).
pub(crate) type Step = (Slot, usize, usize);

/// [`order`]'s pieces as slots (its forward holds the receive, its backward the send back;
/// each send and receive awaited at once).
fn one_run_steps(stage: PipelineStage, m: usize) -> Vec<Step> {
    use Slot::*;
    let mut out = Vec::with_capacity(SLOTS * m);
    for piece in order(stage, m) {
        let slots: &[Slot] = match piece {
            Piece::Forward(_) => &[Receive, ReceiveWait, Forward],
            Piece::ForwardSend(_) => &[Send, SendWait],
            Piece::BackwardRecv(_) => &[GradReceive, GradReceiveWait],
            Piece::Backward(_) => &[Backward, GradSend, GradSendWait],
        };
        let i = match piece {
            Piece::Forward(i) | Piece::ForwardSend(i) => i,
            Piece::BackwardRecv(i) | Piece::Backward(i) => i,
        };
        out.extend(slots.iter().map(|&s| (s, i, 0)));
    }
    out
}

/// Reorders the ops of the `m` micro-batches just emitted (each forward then backward, in
/// order; a stage of several runs of layers emits each run's forward in turn, then their
/// backward last run first) into [`order`]'s 1F1B schedule for `stage`, or
/// [`interleaved_order`]'s where it holds several runs. Nothing on one stage.
pub(crate) fn one_f_one_b(g: &mut Builder, stage: PipelineStage, m: usize) {
    if !stage.is_split() {
        return;
    }
    let v = stage.chunks.max(1);
    let mut pieces = slots_of_runs(std::mem::take(&mut g.ops), m, v);
    let steps = match v {
        1 => one_run_steps(stage, m),
        _ => interleaved_order(stage, m),
    };
    for (slot, i, k) in steps {
        g.ops.append(&mut pieces[i * v + k][slot as usize]);
    }
    debug_assert!(pieces.iter().flatten().all(Vec::is_empty));
}

/// The ops of `m` micro-batches of `v` runs each (emitted as [`one_f_one_b`] says), by
/// micro-batch and run (`i * v + k`), by slot.
fn slots_of_runs(ops: Vec<OpEntry>, m: usize, v: usize) -> Vec<[Vec<OpEntry>; SLOTS]> {
    let mut pieces: Vec<[Vec<OpEntry>; SLOTS]> = (0..m * v).map(|_| Default::default()).collect();
    // The run each micro-batch's next forward and backward op belongs to.
    let (mut fwd_run, mut bwd_run) = (vec![0; m], vec![v - 1; m]);
    for e in ops {
        let i = e.micro;
        let at = |p: &[Vec<OpEntry>; SLOTS], s: Slot| awaits(&e.op, &p[s as usize]);
        let slot = match e.phase {
            Phase::Forward => {
                let k = &mut fwd_run[i];
                // A run's forward ends with its send and the send's await: what follows is
                // the next run's.
                let p = &pieces[i * v + *k];
                if !p[Slot::Send as usize].is_empty() && !at(p, Slot::Send) {
                    *k += 1;
                }
                let p = &pieces[i * v + *k];
                match e.op {
                    Op::StageSend { .. } => Slot::Send,
                    Op::StageRecv { .. } if p[Slot::Forward as usize].is_empty() => Slot::Receive,
                    _ if at(p, Slot::Send) => Slot::SendWait,
                    _ if at(p, Slot::Receive) => Slot::ReceiveWait,
                    _ => Slot::Forward,
                }
            }
            Phase::Backward | Phase::Recompute => {
                let k = &mut bwd_run[i];
                // A run's backward begins with its receive (but the head's): one after the
                // run's own ops is the run before's.
                let p = &pieces[i * v + *k];
                let begun = !p[Slot::Backward as usize].is_empty()
                    || !p[Slot::GradSend as usize].is_empty();
                if matches!(e.op, Op::StageRecv { .. }) && begun {
                    *k = k.checked_sub(1).unwrap_or_else(|| {
                        panic!("internal error: {} before the stage's first run", e.name)
                    });
                }
                let p = &pieces[i * v + *k];
                match e.op {
                    Op::StageRecv { .. } => Slot::GradReceive,
                    Op::StageSend { .. } => Slot::GradSend,
                    // A run sends back the buffer it received (the stream's gradient,
                    // accumulated in place): the send's await is the later one.
                    _ if at(p, Slot::GradSend) => Slot::GradSendWait,
                    _ if at(p, Slot::GradReceive) => Slot::GradReceiveWait,
                    _ => Slot::Backward,
                }
            }
            other => panic!("internal error: {other:?} op {} in a micro-batch", e.name),
        };
        let p = &mut pieces[i * v
            + match slot < Slot::GradReceive {
                true => fwd_run[i],
                false => bwd_run[i],
            }];
        assert!(
            !matches!(slot, Slot::Forward | Slot::Backward) || p[slot as usize + 1].is_empty(),
            "internal error: {} after its run's send",
            e.name
        );
        p[slot as usize].push(e);
    }
    pieces
}

/// The j-th forward of an interleaved stage's schedule as (micro-batch, run): runs in
/// turn over groups of `p` micro-batches (Megatron's `get_model_chunk_id`); the j-th
/// backward takes the runs the other way. `m` is a multiple of `p` (checked by the planner).
fn interleaved_piece(j: usize, p: usize, v: usize, forward: bool) -> (usize, usize) {
    let run = (j / p) % v;
    let micro = (j / (p * v)) * p + j % p;
    (micro, if forward { run } else { v - 1 - run })
}

/// Each stage's forwards and backwards, in order, under the interleaved schedule
/// (Narayanan et al. 2021; Megatron's `forward_backward_pipelining_with_interleaving`):
/// stage `r` of `p` runs `w = min(2(p − r − 1) + (V − 1)·p, V·m)` forwards first, then one
/// forward and one backward in turn, then the backwards left, so it holds at most `w + 1`
/// runs' activations ([`PipelineStage::in_flight`]). (forward?, micro-batch, run).
fn interleaved_compute(r: usize, p: usize, v: usize, m: usize) -> Vec<(bool, usize, usize)> {
    let total = m * v;
    let w = (2 * (p - r - 1) + (v - 1) * p).min(total);
    let f = |j| {
        let (i, k) = interleaved_piece(j, p, v, true);
        (true, i, k)
    };
    let b = |j| {
        let (i, k) = interleaved_piece(j, p, v, false);
        (false, i, k)
    };
    let mut out: Vec<_> = (0..w).map(f).collect();
    for j in 0..total - w {
        out.extend([f(w + j), b(j)]);
    }
    out.extend((total - w..total).map(b));
    out
}

/// `stage`'s slots of `m` micro-batches under the interleaved schedule
/// ([`interleaved_compute`]'s order of forwards and backwards), with its sends and receives
/// placed so that no two stages ever wait on each other.
///
/// Every message (an activation from virtual stage `c` to `c + 1`, a gradient from `c + 1`
/// to `c`) gets a time: when its sender's forward or backward ends, in a simulation of all
/// the stages where a forward takes 1 and a backward 2 and each waits for its input. Each
/// stage runs its sends and receives in the order of those times (ties in one order all
/// stages share), its forwards and backwards in the order above, each after the messages
/// timed at or before its start. So every stage meets its messages in one global order,
/// and a transport whose sends wait for their receiver (MPI's rendezvous) never deadlocks
/// whatever the real times: the earliest message not yet passed has both its ends ready.
pub(crate) fn interleaved_order(stage: PipelineStage, m: usize) -> Vec<Step> {
    use std::collections::HashMap;
    let (p, v) = (stage.size, stage.chunks);
    let last = p * v - 1;
    // (forward?, micro-batch, virtual stage) -> (start, end).
    let mut times: HashMap<(bool, usize, usize), (u64, u64)> = HashMap::new();
    let orders: Vec<_> = (0..p).map(|r| interleaved_compute(r, p, v, m)).collect();
    let (mut at, mut free) = (vec![0; p], vec![0u64; p]);
    loop {
        let mut moved = false;
        for r in 0..p {
            while let Some(&(fwd, i, k)) = orders[r].get(at[r]) {
                let c = k * p + r;
                let input = match (fwd, c) {
                    (true, 0) => Some(0),
                    (true, _) => times.get(&(true, i, c - 1)).map(|t| t.1),
                    (false, c) if c == last => times.get(&(true, i, c)).map(|t| t.1),
                    (false, _) => times.get(&(false, i, c + 1)).map(|t| t.1),
                };
                let Some(ready) = input else { break };
                let start = free[r].max(ready);
                free[r] = start + if fwd { 1 } else { 2 };
                times.insert((fwd, i, c), (start, free[r]));
                at[r] += 1;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    let r = stage.rank;
    assert_eq!(
        at[r],
        orders[r].len(),
        "internal error: the interleaved schedule stalls (p {p}, V {v}, m {m})"
    );
    // (time, comm before compute, message: (gradient?, from, micro-batch), position) -> slot.
    type Key = (u64, u8, (bool, usize, usize), usize);
    let mut events: Vec<(Key, Step)> = Vec::new();
    for (n, &(fwd, i, k)) in orders[r].iter().enumerate() {
        let c = k * p + r;
        let (start, end) = times[&(fwd, i, c)];
        let mut comm = |time: u64, msg, slot| events.push(((time, 0, msg, 0), (slot, i, k)));
        if fwd {
            if c > 0 {
                comm(times[&(true, i, c - 1)].1, (false, c - 1, i), Slot::Receive);
            }
            if c < last {
                comm(end, (false, c, i), Slot::Send);
            }
        } else {
            if c < last {
                comm(
                    times[&(false, i, c + 1)].1,
                    (true, c + 1, i),
                    Slot::GradReceive,
                );
            }
            if c > 0 {
                comm(end, (true, c, i), Slot::GradSend);
            }
        }
        let slot = if fwd { Slot::Forward } else { Slot::Backward };
        events.push(((start, 1, (false, 0, 0), n), (slot, i, k)));
    }
    events.sort_by_key(|e| e.0);
    // Each send and receive is issued there, its await as late as it may be: a receive's
    // just before the forward or backward reading it, a send's after the next forward or
    // backward (its buffer lives until then). The compute then waits for nothing it does
    // not read, whatever the real times, and the transport still meets the messages in
    // the order above.
    let mut out = Vec::with_capacity(events.len() * 2);
    let (mut armed, mut ripe): (Vec<Step>, Vec<Step>) = (Vec::new(), Vec::new());
    for (_, (slot, i, k)) in events {
        match slot {
            Slot::Forward | Slot::Backward => {
                let c = k * p + r;
                match slot {
                    Slot::Forward if c > 0 => out.push((Slot::ReceiveWait, i, k)),
                    Slot::Backward if c < last => out.push((Slot::GradReceiveWait, i, k)),
                    _ => {}
                }
                out.push((slot, i, k));
                out.append(&mut ripe);
                ripe = std::mem::take(&mut armed);
            }
            Slot::Send | Slot::GradSend => {
                out.push((slot, i, k));
                armed.push((slot.wait(), i, k));
            }
            _ => out.push((slot, i, k)),
        }
    }
    out.extend(ripe.into_iter().chain(armed));
    out
}

/// Whether `op` awaits the stage send or receive that `piece` ends with.
fn awaits(op: &Op, piece: &[OpEntry]) -> bool {
    let Op::AwaitCollective { bufs } = op else {
        return false;
    };
    piece.last().is_some_and(|e| match e.op {
        Op::StageSend { buf, .. } | Op::StageRecv { buf, .. } => bufs[0] == buf,
        _ => false,
    })
}

/// On the first and the last stage of a model whose LM head is its embedding, both holding
/// it: sums the gradients of the embedding's parameter group between the two (an
/// all-reduce among the pipeline's ends, [`Axis::PipelineEnds`]: Megatron's embedding
/// group), after the step's backward, so both update it alike. Both ends hold the same
/// group (GPT-2's keeps `wpe` beside `wte` on the last stage too). Nothing otherwise.
pub(crate) fn tied_embedding_sum(g: &mut Builder, layout: &ParamLayout, grads: &Segments) {
    let stage = layout.stage;
    if !stage.is_split() || layout.tied.is_empty() {
        return;
    }
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
            axis: Axis::PipelineEnds,
            elems: None,
            reduce: Reduce::Sum,
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

    /// A message between two neighbouring stages: micro-batch `.0`'s activation or
    /// gradient, sent by virtual stage `.1` (the stage itself but under the interleaved
    /// schedule).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Msg {
        Act(usize, usize),
        Grad(usize, usize),
    }

    /// Stage `s` of `p`'s sends and receives in the order `pieces` gives: (send?, peer
    /// stage, message).
    fn events(pieces: Vec<Piece>, s: usize, p: usize) -> Vec<(bool, usize, Msg)> {
        let stage = PipelineStage::even(p, s, p);
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Forward(i) if !stage.is_first() => {
                    out.push((false, s - 1, Msg::Act(i, s - 1)))
                }
                Piece::ForwardSend(i) if !stage.is_last() => {
                    out.push((true, s + 1, Msg::Act(i, s)))
                }
                Piece::BackwardRecv(i) if !stage.is_last() => {
                    out.push((false, s + 1, Msg::Grad(i, s + 1)))
                }
                Piece::Backward(i) if !stage.is_first() => out.push((true, s - 1, Msg::Grad(i, s))),
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

    /// Stage `r`'s sends and receives under the interleaved schedule, in the order
    /// [`interleaved_order`] gives: (send?, peer stage, message).
    fn interleaved_events(r: usize, p: usize, v: usize, m: usize) -> Vec<(bool, usize, Msg)> {
        let stage = PipelineStage::interleaved(p, r, v, p * v);
        let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
        let mut out = Vec::new();
        for (slot, i, k) in interleaved_order(stage, m) {
            let c = k * p + r;
            match slot {
                Slot::Receive => out.push((false, prev, Msg::Act(i, c - 1))),
                Slot::Send => out.push((true, next, Msg::Act(i, c))),
                Slot::GradReceive => out.push((false, next, Msg::Grad(i, c + 1))),
                Slot::GradSend => out.push((true, prev, Msg::Grad(i, c))),
                _ => {}
            }
        }
        out
    }

    /// Under the interleaved schedule every stage runs each run's forward and backward of
    /// every micro-batch once, receives each input before the forward reading it and each
    /// gradient before the backward, sends each output after its forward, and holds at most
    /// `in_flight` runs' activations (Megatron's warm-up plus one), reached.
    #[test]
    fn interleaved_stages_run_every_piece_once_holding_at_most_their_warm_up() {
        for p in 2..=4 {
            for v in 2..=3 {
                for m in [p, 2 * p, 3 * p] {
                    for r in 0..p {
                        let stage = PipelineStage::interleaved(p, r, v, p * v);
                        let o = interleaved_order(stage, m);
                        let at = |x: Step| {
                            let found = o.iter().position(|&y| y == x);
                            found.unwrap_or_else(|| panic!("p {p} v {v} m {m} r {r}: {x:?}"))
                        };
                        let (mut held, mut most) = (0usize, 0usize);
                        for i in 0..m {
                            for k in 0..v {
                                let c = k * p + r;
                                let before = |a: Slot, b: Slot| {
                                    assert!(at((a, i, k)) < at((b, i, k)), "{a:?} {b:?}")
                                };
                                before(Slot::Forward, Slot::Backward);
                                // Each receive awaited before the op reading it, each send
                                // after the op writing it, each await after its issue.
                                if c > 0 {
                                    before(Slot::Receive, Slot::ReceiveWait);
                                    before(Slot::ReceiveWait, Slot::Forward);
                                    before(Slot::Backward, Slot::GradSend);
                                    before(Slot::GradSend, Slot::GradSendWait);
                                }
                                if c < p * v - 1 {
                                    before(Slot::Forward, Slot::Send);
                                    before(Slot::Send, Slot::SendWait);
                                    before(Slot::GradReceive, Slot::GradReceiveWait);
                                    before(Slot::GradReceiveWait, Slot::Backward);
                                }
                            }
                        }
                        // Forward and backward, and each send and receive with its await.
                        let comm = 4 * m * v
                            - 2 * m * usize::from(r == 0)
                            - 2 * m * usize::from(r + 1 == p);
                        assert_eq!(o.len(), 2 * m * v + 2 * comm, "p {p} v {v} m {m} r {r}");
                        for x in &o {
                            match x.0 {
                                Slot::Forward => held += 1,
                                Slot::Backward => held -= 1,
                                _ => {}
                            }
                            most = most.max(held);
                        }
                        assert_eq!(most, stage.in_flight(m), "p {p} v {v} m {m} r {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_interleaved_schedule_never_deadlocks_on_a_rendezvous_transport() {
        for p in 2..=5 {
            for v in 2..=4 {
                for m in [p, 2 * p, 3 * p] {
                    let ev: Vec<_> = (0..p).map(|r| interleaved_events(r, p, v, m)).collect();
                    assert!(runs_to_the_end(&ev), "p {p} v {v} m {m}");
                }
            }
        }
    }

    /// Each stage's sends and receives as soon as it can (a receive just before the
    /// forward or backward reading it, a send just after the one writing it) would deadlock
    /// some interleaved pipeline: the check above catches it.
    #[test]
    fn eager_sends_would_deadlock_the_interleaved_schedule() {
        let deadlocks = |p: usize, v: usize, m: usize| {
            let ev: Vec<_> = (0..p)
                .map(|r| {
                    let (next, prev, last) = ((r + 1) % p, (r + p - 1) % p, p * v - 1);
                    let mut out = Vec::new();
                    for (fwd, i, k) in interleaved_compute(r, p, v, m) {
                        let c = k * p + r;
                        match fwd {
                            true if c > 0 => out.push((false, prev, Msg::Act(i, c - 1))),
                            false if c < last => out.push((false, next, Msg::Grad(i, c + 1))),
                            _ => {}
                        }
                        match fwd {
                            true if c < last => out.push((true, next, Msg::Act(i, c))),
                            false if c > 0 => out.push((true, prev, Msg::Grad(i, c))),
                            _ => {}
                        }
                    }
                    out
                })
                .collect();
            !runs_to_the_end(&ev)
        };
        assert!((2..=4).any(|p| (2..=3).any(|v| deadlocks(p, v, 2 * p))));
    }
}
