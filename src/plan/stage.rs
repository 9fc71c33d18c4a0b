//! Staging: the plan transformation behind `--offload`. Some buffers live on the disk tier
//! (their *home*); every run of ops that uses one (a *span*) gets a host staging copy, and
//! the planner emits the transfers that fill the copy before the span and write it back
//! after, so staging bytes are ordinary plan buffers and the host peak stays exact.
//!
//! - Homes are per parameter group for parameters, gradients and moments, and one per kept
//!   activation (what the forward keeps for the backward). A span's copy is named after its
//!   home and part of the step (`h3.params.fwd`, `h3.params.bwd`, `h3.adamw.m.opt`, …), and
//!   the span's ops are rebound ([`crate::ir::schedule::Binding`]) or renamed to it. `Transfer`
//!   ops move the bytes and `AwaitTransfers` ops wait for them, before the copy's first use
//!   and before its bytes may be reused. Both ends of a transfer are aligned to
//!   [`crate::ir::IO_ALIGN`] for direct I/O.
//! - A home's uses are split into spans where the step's part changes (forward; recompute
//!   and backward; optimizer) and, for parameters, gradients and moments, where another home
//!   of the same kind is used in between (another parameter group), but never between a
//!   collective on the home and its await (the ranks' communication works on the copy). So
//!   the parameters of block l are read before its forward and again before its backward,
//!   its gradients are written after each micro-batch's backward and read back for the next
//!   and for the update, and its moments are read for its `AdamW` op and written after it.
//!   A home none of whose spans reads or writes it back (each micro-batch's gradients,
//!   reduce-scattered into a shard under ZeRO 2 and 3) stays in RAM: it holds nothing
//!   between its uses.
//! - A span reads its home first when its first op reads it (not when it starts by zeroing
//!   or overwriting it), and writes it back when an op in it writes and the value is needed
//!   later (a later span, or state that persists across steps).
//! - Pipelining, per kind: a span's read starts when the previous span of its kind starts
//!   (one span of prefetch; never before the same home's previous write-back is queued), and
//!   is awaited just before its first op; its write-back starts after its last op and is
//!   awaited after the next span of its kind, so about three spans' copies are live at once.
//!   Activations, whose spans are one or two ops each, look a block's worth of spans ahead
//!   and behind instead (kept activations per block), so their transfers hide behind a
//!   block's arithmetic.
//!   Transfers run in order on one I/O thread, so a read queued after a write of the same
//!   bytes sees them.
//! - A transfer and its wait take the phase of the span they serve, so evaluation (forward
//!   ops only) and the executor's split of a step into gradients and update each start and
//!   wait for their own transfers.
//! - Beneath a GPU (homes in pinned host RAM), an `AdamW` all of whose buffers are homes
//!   (`--offload optimizer,params,grads`) runs on the host's cores on the homes themselves
//!   ([`crate::ir::schedule::OpEntry::runs_on_host`]): it is no span's. Its home's spans end
//!   before it, their write-backs are awaited before it, and reads after it start after it;
//!   only the gradients cross the bus out and the weights back in. The planner places such
//!   updates where the host has GPU work queued to overlap them: a deferred update a group
//!   early (its weights' read can still start a group ahead), an update inside the backward
//!   a group late (the next group's backward is queued before the host waits for this
//!   group's gradients).
//! - With a deferred update ([`crate::ir::schedule::Phase::DeferredUpdate`]), a group's update
//!   and its forward ops share one parameter copy (read, updated, used, written back: one
//!   read and one write fewer per step), and the `Optimizer` ops, which then run only
//!   between steps, prefetch and wait among themselves.

use crate::ir::builder::Builder;
use crate::ir::schedule::{Op, OpEntry, Phase};
use crate::ir::{BufId, Category, Tier};

/// What a home holds. Spans of one kind form one pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Params,
    /// A LoRA plan's frozen base: read before each use, never written back.
    Base,
    Grads,
    Moments,
    Activations,
}

/// A buffer to keep on the disk tier.
#[derive(Clone, Copy)]
pub(super) struct Home {
    pub id: BufId,
    pub kind: Kind,
    /// The parameter group of a home that shares its group with others of its kind (a
    /// frozen base's f32 norms and quantized matrices): they are used in turn without
    /// splitting each other's spans, and prefetch looks past them. `None`: a group alone.
    pub group: Option<usize>,
}

/// One run of ops using a home through one staging copy.
struct Span {
    home: usize,
    /// First and last op (inclusive, original schedule indices).
    first: usize,
    last: usize,
    read: bool,
    write: bool,
    class: Phase,
    stage: BufId,
}

/// The part of the step an op's use of a home belongs to (Forward, Backward or Optimizer;
/// recomputation is part of the backward). Gradients are only touched when training, so the
/// LM head's forward write of them counts as backward.
fn class(kind: Kind, phase: Phase) -> Phase {
    match (kind, phase) {
        (_, Phase::Optimizer) => Phase::Optimizer,
        // A deferred update and the forward ops after it share the group's parameter copy:
        // read once, updated, used, written back.
        (Kind::Params, Phase::DeferredUpdate) => Phase::Forward,
        (_, Phase::DeferredUpdate) => Phase::DeferredUpdate,
        (Kind::Grads, _) => Phase::Backward,
        (_, Phase::Forward) => Phase::Forward,
        _ => Phase::Backward,
    }
}

/// Activations kept from the forward for the backward: non-persistent activation buffers
/// used both by forward ops and by recompute or backward ops.
pub(super) fn kept_activations(g: &Builder) -> Vec<BufId> {
    let mut seen = vec![(false, false); g.buffers.len()];
    for e in &g.ops {
        e.buffers(|id, _| {
            let s = &mut seen[id.0];
            if e.phase == Phase::Forward {
                s.0 = true;
            } else {
                s.1 = true;
            }
        });
    }
    (0..g.buffers.len())
        .filter(|&i| {
            let b = &g.buffers[i];
            b.category == Category::Activation && !b.persistent && seen[i] == (true, true)
        })
        .map(BufId)
        .collect()
}

/// Puts `homes` on the disk tier and stages every use of them (see the module docs);
/// `blocks` (the step's blocks: layers × micro-batches) sets how far ahead activations move.
/// In steps: each home's uses, split into spans, a staging copy per span, and the transfers
/// and waits around them.
pub(super) fn stage(g: &mut Builder, homes: &[Home], blocks: usize, home_tier: Tier) {
    if homes.is_empty() {
        return;
    }
    let on_host = host_updates(g, homes, home_tier);
    let uses = home_uses(g, homes, &on_host);
    let mut spans = spans(g, homes, &uses);
    // A home whose spans neither read nor write it back holds nothing between them (a
    // micro-batch's gradients reduce-scattered into a shard, ZeRO 2 and 3): it stays an
    // ordinary buffer, and the others are staged without it. A home an op uses in place
    // (on the host) stays one.
    let moved = |k: usize| {
        uses[k].iter().any(|u| u.in_place)
            || spans.iter().any(|s| s.home == k && (s.read || s.write))
    };
    if !(0..homes.len()).all(moved) {
        let kept: Vec<Home> = (0..homes.len())
            .filter(|&k| moved(k))
            .map(|k| homes[k])
            .collect();
        return stage(g, &kept, blocks, home_tier);
    }
    staging_copies(g, homes, &mut spans, home_tier);
    let inserts = transfers(g, homes, &spans, &uses, blocks);
    insert(g, inserts);
}

/// One op's use of a home.
#[derive(Clone, Copy)]
struct Use {
    op: usize,
    reads: bool,
    writes: bool,
    /// The op runs on the home itself, on the host ([`host_updates`]).
    in_place: bool,
}

/// Which ops run on the homes themselves, by op index: beneath a GPU (`home_tier` is pinned
/// host RAM), an `AdamW` all of whose buffers (master weights, gradients, moments) are homes
/// runs on the host's cores where its state is (`--offload optimizer,params,grads`), so its
/// state never crosses the bus; only the gradients come out and the weights go back in.
/// Such an op is no span's: the home's spans end before it, their write-backs are awaited
/// before it, and reads after it start after it.
fn host_updates(g: &Builder, homes: &[Home], home_tier: Tier) -> Vec<bool> {
    let mut is_home = vec![false; g.buffers.len()];
    for h in homes {
        is_home[h.id.0] = true;
    }
    g.ops
        .iter()
        .map(|e| {
            let mut all = home_tier == Tier::Host && matches!(e.op, Op::AdamW { .. });
            e.buffers(|id, _| all &= is_home[id.0]);
            all
        })
        .collect()
}

/// The key of home `k`: homes of one key are one parameter group (see `Home::group`).
fn group_key(homes: &[Home], k: usize) -> usize {
    homes[k].group.map_or(k, |g| homes.len() + g)
}

/// Each home's uses, in schedule order, one per op (`on_host`: the ops run on the homes
/// themselves).
fn home_uses(g: &Builder, homes: &[Home], on_host: &[bool]) -> Vec<Vec<Use>> {
    let mut home_of = vec![None; g.buffers.len()];
    for (k, h) in homes.iter().enumerate() {
        home_of[h.id.0] = Some(k);
    }
    // Each home's uses: (op, reads, writes).
    let mut uses: Vec<Vec<Use>> = homes.iter().map(|_| Vec::new()).collect();
    for (i, e) in g.ops.iter().enumerate() {
        e.buffers(|id, access| {
            let Some(k) = home_of[id.0] else { return };
            let (reads, writes) = (access.reads(), access.writes());
            match uses[k].last_mut() {
                Some(u) if u.op == i => {
                    u.reads |= reads;
                    u.writes |= writes;
                }
                _ => uses[k].push(Use {
                    op: i,
                    reads,
                    writes,
                    in_place: on_host[i],
                }),
            }
        });
    }
    uses
}

/// Splits each home's uses into spans: where the part of the step changes, and (parameters,
/// gradients, moments) where another group's home of the same kind is used in between. A
/// span reads its home when its first op reads it, and writes it back when it writes and the
/// value is needed later (a later span, or a persistent home). Each span's `stage` is its
/// home until [`staging_copies`] declares its copy.
fn spans(g: &Builder, homes: &[Home], uses: &[Vec<Use>]) -> Vec<Span> {
    // Homes of one key are one parameter group (see `Home::group`).
    let key = |k: usize| group_key(homes, k);
    // Ops using each kind, sorted, with the key of the home they use (to find another group
    // of the kind used between two uses).
    let kind_ops = |kind: Kind| {
        let mut ops: Vec<(usize, usize)> = (0..homes.len())
            .filter(|&k| homes[k].kind == kind)
            .flat_map(|k| uses[k].iter().map(move |u| (u.op, key(k))))
            .collect();
        ops.sort_unstable();
        ops
    };
    let by_kind: Vec<(Kind, Vec<(usize, usize)>)> =
        [Kind::Params, Kind::Base, Kind::Grads, Kind::Moments]
            .into_iter()
            .map(|k| (k, kind_ops(k)))
            .collect();

    let mut spans: Vec<Span> = Vec::new();
    for (k, home) in homes.iter().enumerate() {
        let between = by_kind.iter().find(|(kind, _)| *kind == home.kind);
        let persistent = g.buffers[home.id.0].persistent;
        let last_use = uses[k].last().map_or(0, |u| u.op);
        // An op on the home itself (on the host) ends the spans before it.
        for us in uses[k].split(|u| u.in_place).filter(|us| !us.is_empty()) {
            let mut start = 0;
            // The last op of a collective on the home still at work (its await): the ranks'
            // communication reads and writes the copy until then, so no span ends before it.
            let mut busy_until = 0;
            for j in 1..=us.len() {
                busy_until = busy_until.max(awaited_at(g, us[j - 1].op));
                let split = j == us.len()
                    || us[j].op > busy_until && {
                        let (a, b) = (us[j - 1].op, us[j].op);
                        let other = between.is_some_and(|(_, ops)| {
                            let i = ops.partition_point(|&(o, _)| o <= a);
                            ops[i..]
                                .iter()
                                .take_while(|&&(o, _)| o < b)
                                .any(|&(_, other)| other != key(k))
                        });
                        other
                            || class(home.kind, g.ops[a].phase) != class(home.kind, g.ops[b].phase)
                    };
                if !split {
                    continue;
                }
                let run = &us[start..j];
                let written = run.iter().any(|u| u.writes);
                let last = run[run.len() - 1].op;
                spans.push(Span {
                    home: k,
                    first: run[0].op,
                    last,
                    read: run[0].reads,
                    write: written && (persistent || last < last_use),
                    class: class(home.kind, g.ops[run[0].op].phase),
                    stage: home.id, // set by `staging_copies`
                });
                start = j;
            }
        }
    }
    spans
}

/// Where op `i` is awaited when it is a collective (`i` itself when it is none, or is never
/// awaited: `plan::build` refuses that): its communication reads and writes its buffers
/// (the home among them) until then.
fn awaited_at(g: &Builder, i: usize) -> usize {
    let Some(buf) = g.ops[i].op.collective_buf() else {
        return i;
    };
    let waits = |e: &OpEntry| matches!(&e.op, Op::AwaitCollective { bufs } if bufs[0] == buf);
    g.ops[i + 1..]
        .iter()
        .position(waits)
        .map_or(i, |k| i + 1 + k)
}

/// Declares each span's staging copy, named by its home and the part of the step it serves
/// (`h3.params.fwd`, `h3.params.bwd1`, …), marks the homes and the copies for direct I/O,
/// and renames each span's ops from the home to its copy.
fn staging_copies(g: &mut Builder, homes: &[Home], spans: &mut [Span], home_tier: Tier) {
    // Staging buffers, named by the part of the step they serve.
    let mut count = std::collections::HashMap::new();
    for s in spans.iter_mut() {
        let home = &g.buffers[homes[s.home].id.0];
        let part = match s.class {
            Phase::Forward => "fwd",
            Phase::Optimizer => "opt",
            Phase::DeferredUpdate => "upd",
            _ => "bwd",
        };
        let n = count.entry((s.home, part)).or_insert(0usize);
        let name = match *n {
            0 => format!("{}.{part}", home.name),
            n => format!("{}.{part}{n}", home.name),
        };
        *n += 1;
        let (category, dtype, elems) = (home.category, home.dtype, home.elems);
        let id = g.buf(name, category, dtype, elems);
        s.stage = g.for_io(id, None);
    }
    for h in homes {
        g.for_io(h.id, Some(home_tier));
    }
    for s in spans.iter() {
        let home = homes[s.home].id;
        for e in &mut g.ops[s.first..=s.last] {
            e.rename(home, s.stage);
        }
    }
}

/// A transfer or a wait to insert: (position: before original op, order at that position,
/// entry). At one position writes start, then earlier writes are awaited, then reads start,
/// then reads are awaited.
type Insert = (usize, u8, OpEntry);

/// The transfers that fill each span's copy and write it back, and their waits, pipelined
/// per kind (see the module docs): a read starts `ahead` spans of its kind early and is
/// awaited before the span's first op; a write starts after its last op and is awaited
/// `ahead` spans of its kind later.
fn transfers(
    g: &Builder,
    homes: &[Home],
    spans: &[Span],
    uses: &[Vec<Use>],
    blocks: usize,
) -> Vec<Insert> {
    let n_ops = g.ops.len();
    // The ops that run on each home itself (host updates, in order).
    let on_home: Vec<Vec<usize>> = uses
        .iter()
        .map(|us| us.iter().filter(|u| u.in_place).map(|u| u.op).collect())
        .collect();
    let key = |k: usize| group_key(homes, k);
    // With a deferred update, a step runs every op but the `Optimizer` ones, which run
    // alone between steps: a transfer is prefetched and awaited within the ops that run
    // together with it (`step_end`: where the step's ops end).
    let deferred = g.ops.iter().any(|e| e.phase == Phase::DeferredUpdate);
    let together =
        |a: Phase, b: Phase| !deferred || (a == Phase::Optimizer) == (b == Phase::Optimizer);
    let step_end = match deferred {
        true => g.ops.iter().position(|e| e.phase == Phase::Optimizer),
        false => None,
    };
    let end_of = |class: Phase| match class {
        Phase::Optimizer => n_ops,
        _ => step_end.unwrap_or(n_ops),
    };
    let mut inserts: Vec<Insert> = Vec::new();
    let entry = |g: &Builder, stage: BufId, what: &str, phase: Phase, op: Op| OpEntry {
        name: format!("{}.{what}", g.buffers[stage.0].name),
        phase,
        op,
        flops: 0,
        params: None,
        grads: None,
        micro: 0,
        frozen: false,
    };
    for kind in [
        Kind::Params,
        Kind::Base,
        Kind::Grads,
        Kind::Moments,
        Kind::Activations,
    ] {
        let mut of_kind: Vec<&Span> = spans
            .iter()
            .filter(|s| homes[s.home].kind == kind)
            .collect();
        of_kind.sort_by_key(|s| (s.first, s.home));
        // Spans ahead a read starts and a write is awaited: one for per-group state (a
        // group's span is a block's worth of ops); for activations, a block's worth of
        // spans (each is one or two ops, too short to hide a transfer behind).
        let ahead = match kind {
            Kind::Activations => {
                let n = homes.iter().filter(|h| h.kind == kind).count();
                n.div_ceil(blocks.max(1)).max(1)
            }
            _ => 1,
        };
        for s in &of_kind {
            let home = homes[s.home].id;
            if s.read {
                // Prefetch: from the start of the kind's `ahead`-th previous span (or its
                // first), but not before this home's previous write-back is queued.
                let mut starts: Vec<usize> = of_kind
                    .iter()
                    .filter(|o| o.first < s.first && together(o.class, s.class))
                    .filter(|o| o.home == s.home || key(o.home) != key(s.home))
                    .map(|o| o.first)
                    .collect();
                starts.dedup();
                let prev_kind = starts
                    .len()
                    .checked_sub(ahead)
                    .map(|i| starts[i])
                    .or(starts.first().copied());
                // Nor before an op on the home itself finished with it.
                let prev_home = of_kind
                    .iter()
                    .filter(|o| o.home == s.home && o.last < s.first)
                    .map(|o| o.last + 1)
                    .chain(
                        on_home[s.home]
                            .iter()
                            .filter(|&&h| h < s.first)
                            .map(|h| h + 1),
                    )
                    .max();
                let at = prev_kind
                    .unwrap_or(s.first)
                    .max(prev_home.unwrap_or(0))
                    .min(s.first);
                let read = Op::Transfer {
                    from: home,
                    to: s.stage,
                };
                inserts.push((at, 2, entry(g, s.stage, "read", s.class, read)));
                let wait = Op::AwaitTransfers {
                    bufs: vec![s.stage],
                };
                inserts.push((s.first, 3, entry(g, s.stage, "read.wait", s.class, wait)));
            }
            if s.write {
                let write = Op::Transfer {
                    from: s.stage,
                    to: home,
                };
                inserts.push((s.last + 1, 0, entry(g, s.stage, "write", s.class, write)));
                // Awaited after the kind's `ahead`-th next span (or where the run ends).
                let mut later: Vec<&Span> = of_kind
                    .iter()
                    .filter(|o| o.first > s.last && together(o.class, s.class))
                    .copied()
                    .collect();
                later.dedup_by_key(|o| o.first);
                // And before an op on the home itself reads it.
                let host = on_home[s.home].iter().find(|&&h| h > s.last).copied();
                let next = later
                    .get(ahead - 1)
                    .map(|o| o.last + 1)
                    .unwrap_or(end_of(s.class))
                    .min(host.unwrap_or(n_ops));
                let wait = Op::AwaitTransfers {
                    bufs: vec![s.stage],
                };
                inserts.push((next, 1, entry(g, s.stage, "write.wait", s.class, wait)));
            }
        }
    }
    inserts
}

/// Inserts `inserts` into the schedule, each before its original op (those past the last
/// op at the end), in (position, order) order.
fn insert(g: &mut Builder, mut inserts: Vec<Insert>) {
    let n_ops = g.ops.len();
    inserts.sort_by_key(|(at, order, _)| (*at, *order));
    let mut inserts = inserts.into_iter().peekable();
    let mut ops = Vec::with_capacity(n_ops + inserts.len());
    for (i, e) in std::mem::take(&mut g.ops).into_iter().enumerate() {
        while let Some((_, _, ins)) = inserts.next_if(|x| x.0 == i) {
            ops.push(ins);
        }
        ops.push(e);
    }
    ops.extend(inserts.map(|x| x.2));
    g.ops = ops;
}
