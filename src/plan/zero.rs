//! Data parallelism and ZeRO as a plan transformation (`--ranks N --zero K`): every rank
//! runs the same plan on its own batch; this module declares what a rank keeps and inserts
//! the collectives ([`Op::AllReduce`], [`Op::ReduceScatter`], [`Op::AllGather`]) that keep
//! the ranks' state consistent. Collective buffers are plan buffers: a group's gradients
//! and parameters are padded to `N·S` ([`Sharding::even`]) so the ring collectives work in
//! place, and each collective has a scratch piece (category `communication`) for what it
//! receives. With 8-bit optimizer state the groups are cut at the blocks' edges instead
//! ([`Sharding::at_edges`], `int8_cut`; a tensor-parallel part where its elements pass into
//! another of its whole tensor's blocks), so each rank's moments are whole blocks: the same
//! blocks, and so the same arithmetic, as one process's. Each collective runs beside the
//! ops after it until its [`Op::AwaitCollective`] (`overlap`); stage 3 gathers the next
//! group's parameters while the current one computes (`prefetch`).
//!
//! Per parameter group (embeddings, each block, the final norm), on each rank:
//! - `--zero 0`: parameters, gradients and moments whole. The group's gradients are
//!   all-reduced as soon as they are final (after the group's last backward op), so the
//!   exchange of late layers happens while the backward goes on with earlier ones; the norm
//!   share is then the same on every rank.
//! - `--zero 1`: moments of the rank's shard only (`{group}.adamw.*` of S elements). The
//!   group's gradients are reduce-scattered once final into `{group}.grad.shard`, and
//!   freed; the update runs on the shard; the updated shard is all-gathered into the
//!   group's parameters. Under accumulation the whole gradients are kept until the last
//!   micro-batch.
//! - `--zero 2`: as 1, but under accumulation every micro-batch's gradients go to a buffer
//!   of their own (`mb{k}.{group}.grad`), reduce-scattered (accumulated into the shard)
//!   when final and freed: a rank holds one micro-batch's whole gradients of a group at a
//!   time.
//! - `--zero 3`: as 2, and parameters as shards (`{group}.params.shard`). Each run of ops
//!   using a group's parameters (a *span*: the group's forward, its recompute and backward,
//!   the LM head) gets its own gathered copy (`{group}.params.{k}`), all-gathered just
//!   before the span and freed after it.
//!
//! Norm shares of sharded gradients are partial: the executor gathers every rank's and adds
//! them in (group, rank) order.
//!
//! Every rank runs the same plan on its own rows of each batch (`data::loader::Part`: N ranks
//! of batch B see what one process of batch B and accumulation N sees). The cut of each group
//! is in [`Plan::cuts`](super::Plan::cuts), one per group ([`dist::Cut`](crate::ir::Cut): rank r
//! owns elements `edges[r]..edges[r+1]` of the group's buffers), and each collective op names
//! its group, so the executor and [`Plan::comm_bytes`](super::Plan::comm_bytes) find its cut.
//! Each collective has a scratch piece of at most [`PIECE_ELEMS`](crate::ir::shard::PIECE_ELEMS)
//! elements. The buffers a collective uses stay live until its await, so the plan counts what
//! overlap costs (two groups' gradients or gathered copies in flight), and the builder checks
//! that no op in between touches them.
//!
//! **Invariant:** a rank's plan is its exact memory, and
//! [`Plan::comm_bytes_per_step`](super::Plan::comm_bytes_per_step) its exact traffic: the
//! ring's figures ((N−1)/N of a buffer with even chunks) plus the step's scalars (the loss
//! and, with sharded gradients, each group's norm share), equal to what the transport counts
//! (`tests/dist_train.rs`). [`per_rank`] sets it next to the ZeRO paper's formulas
//! (`tests/dist_plan.rs` checks them at N = 64 and 1024).
//!
//! **Invariant:** checkpoints never depend on the number of ranks. They hold one Hugging Face
//! model and one trainer state (sharded state streamed into rank 0's writer:
//! `exec::executor::checkpoint`), and loading fills each rank's shards from the whole file
//! (tensors may be cut), so a run resumes on any number of ranks at any stage.

use super::Plan;
use crate::dtype::DType;
use crate::ir::Axis;
use crate::ir::builder::Builder;
use crate::ir::schedule::{Binding, Op, OpEntry, OptimBufs, Phase, Reduce, Segment, Segments};
use crate::ir::strategy::QBLOCK;
use crate::ir::{BufId, Category, OptimState};
use crate::ir::{Cut, CutOf, Sharding};
use crate::model::{ParamGroup, ParamLayout};
use anyhow::{Result, bail};
use serde::Serialize;
use std::collections::BTreeMap;

/// Checks this rank's place among the ranks.
pub(super) fn check(sh: &Sharding) -> Result<()> {
    if sh.ranks == 0 || sh.rank >= sh.ranks {
        bail!("internal error: rank {} of {} ranks", sh.rank, sh.ranks);
    }
    Ok(())
}

/// A plan's ranks: this rank's place and stage, and how each parameter group is cut.
pub(super) struct Split {
    pub sh: Sharding,
    /// One per parameter group: even ([`Sharding::even`]), or with 8-bit moments sharded at
    /// the blocks' edges ([`int8_cut`]).
    pub cuts: Vec<Cut>,
    /// With 8-bit moments sharded, each group's blocks cut as its elements are (block
    /// indices within the group: its first block is 0); empty otherwise.
    pub block_cuts: Vec<Cut>,
}

/// The ZeRO cut of each of `layout`'s parameter groups along the data axis under `cfg`
/// (none without sharding): what a plan of that layout keeps in [`super::Plan::cuts`]. A
/// checkpoint of a pipeline reads the other stages' from here.
pub fn group_cuts(layout: &ParamLayout, cfg: &super::StepConfig) -> Vec<Cut> {
    cfg.sharding()
        .map(|sh| Split::new(layout, cfg.optim_state, sh).cuts)
        .unwrap_or_default()
}

/// The 8-bit blocks of each of `layout`'s parameter groups cut along the data axis under
/// `cfg` (block indices within the group), as its elements are by [`group_cuts`]; empty
/// unless 8-bit moments are sharded.
pub fn group_block_cuts(layout: &ParamLayout, cfg: &super::StepConfig) -> Vec<Cut> {
    cfg.sharding()
        .map(|sh| Split::new(layout, cfg.optim_state, sh).block_cuts)
        .unwrap_or_default()
}

impl Split {
    pub fn new(layout: &ParamLayout, format: OptimState, sh: Sharding) -> Split {
        let at_blocks = sh.zero.shards_optimizer() && format == OptimState::Int8;
        let (mut cuts, mut block_cuts) = (Vec::new(), Vec::new());
        for group in &layout.groups {
            if at_blocks {
                let (elems, blocks) = int8_cut(layout, group, &sh);
                cuts.push(elems);
                block_cuts.push(blocks);
            } else {
                cuts.push(sh.even(layout.group_range(group).len()));
            }
        }
        Split {
            sh,
            cuts,
            block_cuts,
        }
    }

    /// The parameter elements of group `k` (elements `group` of the model) this rank owns.
    pub fn owned(&self, group: &std::ops::Range<usize>, k: usize) -> std::ops::Range<usize> {
        self.cuts[k].owned(group, self.sh.rank)
    }
}

/// The cut of `group` for sharded 8-bit moments: its elements and its blocks (of
/// [`QBLOCK`] values counted per tensor, [`ParamLayout::block_offsets`]), each rank's
/// shard whole blocks, so the same blocks and the same arithmetic as one process's.
///
/// The elements are cut where a block starts ([`Sharding::at_edges`]): in a tensor held
/// whole, every [`QBLOCK`] values from its start; in a tensor-parallel part, where its
/// elements pass into another of the whole tensor's blocks (`TensorPart::block_pieces`).
/// The blocks are cut alike, a part's shard holding every block from its first piece's to
/// the next shard's (blocks of the other parts' elements too, whose scales the tensor
/// ranks agree on, `plan::block_scales`). Each tensor rank cuts its own part, so each
/// data rank's shards are as even as the edges let them be; a tensor held whole is cut
/// alike on every tensor rank (its edges and place in the group are the same).
fn int8_cut(layout: &ParamLayout, group: &ParamGroup, sh: &Sharding) -> (Cut, Cut) {
    let tensors = &layout.tensors[group.tensors.clone()];
    let start = layout.group_range(group).start;
    // Group offsets where a block starts (each tensor's first included), with the blocks
    // before each, and the group's length (and blocks) last.
    let mut edges: Vec<(usize, usize)> = Vec::new();
    let mut blocks = 0;
    for t in tensors {
        let at = t.range.start - start;
        match &t.part {
            None => edges.extend(
                (0..t.range.len())
                    .step_by(QBLOCK)
                    .map(|e| (at + e, blocks + e / QBLOCK)),
            ),
            Some(p) => edges.extend(
                p.block_pieces(0..t.range.len(), QBLOCK)
                    .map(|(b, r)| (at + r.start, blocks + b)),
            ),
        }
        blocks += t.whole_len().div_ceil(QBLOCK);
    }
    let n = layout.group_range(group).len();
    edges.push((n, blocks));
    edges.remove(0);
    let allowed: Vec<usize> = edges.iter().map(|e| e.0).collect();
    let elems = sh.at_edges(n, &allowed);
    let blocks_at = |e: usize| match e {
        0 => 0,
        e => edges[allowed.partition_point(|&a| a < e)].1,
    };
    let blocks = elems.map(blocks_at);
    (elems, blocks)
}

/// The AdamW moments of this rank's shard of every group (ZeRO ≥ 1): `{group}.adamw.m`,
/// `.v` of the rank's chunk, element 0 holding the moments of the chunk's first parameter
/// (8-bit state: the chunk's whole blocks and their scales).
pub(super) fn shard_moments(
    g: &mut Builder,
    layout: &ParamLayout,
    format: OptimState,
    split: &Split,
) -> Vec<OptimBufs> {
    let (first_block, _) = layout.block_offsets(QBLOCK);
    let rank = split.sh.rank;
    layout
        .groups
        .iter()
        .enumerate()
        .map(|(k, group)| {
            let chunk = split.cuts[k].shard(rank);
            let base = layout.group_range(group).start + chunk.start;
            // 8-bit moments' blocks (none of other formats).
            let blocks = split.block_cuts.get(k).map_or(0..0, |c| c.shard(rank));
            let first = first_block[group.tensors.start];
            let name = format!("{}.adamw", group.name);
            let (elems, blocks) = (
                base..base + chunk.len(),
                first + blocks.start..first + blocks.end,
            );
            g.moments(&name, format, elems, blocks)
        })
        .collect()
}

/// Inserts the collectives of `sh.zero` and rebinds the sharded update (see the module
/// documentation). Runs on a bound schedule (norm shares and gradient zeroing placed).
/// Returns the parameters as they persist between steps: `params` itself, or under ZeRO 3
/// the rank's shards (one segment per group over the elements it owns). In steps, per
/// parameter group: its gradients all-reduced (`--zero 0`), or reduce-scattered into the
/// rank's shard, which the norm share and the update then read, and the updated parameters
/// all-gathered (or, ZeRO 3, kept as shards and gathered for each span of use); then every
/// collective placed ([`prefetch`], [`apply`]) and overlapped with the ops after it
/// ([`overlap`]).
pub(super) fn collectives(
    g: &mut Builder,
    layout: &ParamLayout,
    split: &Split,
    params: &Segments,
    grads: &Segments,
    micro: usize,
) -> Segments {
    let sh = &split.sh;
    let groups: Vec<std::ops::Range<usize>> =
        grads.segments.iter().map(|s| s.range.clone()).collect();
    let storage = g.buffers[grads.segments[0].buf.0].dtype;
    let norm_at = norm_shares(g, &groups);
    // A tied embedding's group on a pipeline's two ends: its gradients are summed between
    // them once final (`plan::pipeline::tied_embedding_sum`), so they are reduce-scattered
    // after that, once.
    let tied = (layout.stage.is_split() && !layout.tied.is_empty()).then(|| {
        grads
            .locate(&layout.tensors[layout.tied[0].tensor].range)
            .buf
    });
    let update_at = updates(g, groups.len());
    let mut ins = Inserts::default();
    let mut shards: Vec<Segment> = Vec::new();
    for (k, range) in groups.iter().enumerate() {
        let gr = Group {
            k,
            name: layout.groups[k].name.clone(),
            range,
            grad: grads.segments[k].buf,
            params,
            cut: &split.cuts[k],
            norm: norm_at[k][0],
            norms: norm_at[k].clone(),
            update: update_at[k],
        };
        if !sh.zero.shards_optimizer() {
            all_reduce(g, &gr, storage, &mut ins);
            continue;
        }
        let shard = grad_shard(g, split, &gr);
        // Gradients: reduce-scattered once final (ZeRO 1, or one micro-batch), or every
        // micro-batch from a buffer of its own (ZeRO 2).
        if sh.zero.shards_grads() && micro > 1 && tied != Some(gr.grad) {
            reduce_scatter_each_micro_batch(g, &gr, &shard, storage, micro, &mut ins);
        } else {
            reduce_scatter(g, &gr, &shard, storage, &mut ins);
        }
        read_shard(g, &gr, &shard);
        if sh.zero.shards_params() {
            shards.push(shard_params(g, &gr, &shard, &mut ins));
        } else {
            gather_updated(g, &gr, &mut ins);
        }
    }
    let Inserts {
        mut before,
        gathers,
        after,
    } = ins;
    before.extend(prefetch(g, gathers));
    apply(g, before, after);
    overlap(g);
    if sh.zero.shards_params() {
        Segments { segments: shards }
    } else {
        params.clone()
    }
}

/// One parameter group, as [`collectives`] sees it.
struct Group<'a> {
    /// Its index (the collectives' `group`).
    k: usize,
    name: String,
    /// Its parameter elements.
    range: &'a std::ops::Range<usize>,
    /// Its gradient buffer.
    grad: BufId,
    /// The parameters (one segment per group in a sharded plan, `plan::build::param_buffers`).
    params: &'a Segments,
    cut: &'a Cut,
    /// Its (first) norm share's op and its update's (schedule indices before any insertion).
    norm: usize,
    /// All its norm shares' ops: one, or under tensor parallelism one per run of whole or
    /// cut tensors (consecutive, from `norm` on).
    norms: Vec<usize>,
    update: usize,
}

/// The ops [`collectives`] inserts, once every group is done: `before` op i and `after` op
/// i, in the order given, and ZeRO 3's all-gathers with their span's first op (placed by
/// [`prefetch`]).
#[derive(Default)]
struct Inserts {
    before: Vec<(usize, OpEntry)>,
    gathers: Vec<(usize, OpEntry)>,
    after: Vec<(usize, OpEntry)>,
}

/// An inserted op: no flops, no bindings.
pub(super) fn entry(name: String, phase: Phase, micro: usize, op: Op) -> OpEntry {
    OpEntry {
        name,
        phase,
        op,
        flops: 0,
        params: None,
        grads: None,
        micro,
        frozen: false,
    }
}

/// Declares the scratch piece (`{name}.comm`) of a collective over a buffer cut as `cut`.
fn scratch(g: &mut Builder, name: &str, dtype: DType, cut: &Cut) -> BufId {
    g.buf(
        format!("{name}.comm"),
        Category::Communication,
        dtype,
        cut.scratch(),
    )
}

/// Where each group's norm share (`GradNorm` over the group's range) is.
/// (Under tensor parallelism a group has one per run of whole or cut tensors, all
/// together; the first is where its collectives go.)
fn norm_shares(g: &Builder, groups: &[std::ops::Range<usize>]) -> Vec<Vec<usize>> {
    groups
        .iter()
        .map(|group| {
            let at: Vec<usize> = (0..g.ops.len())
                .filter(|&i| {
                    matches!(&g.ops[i].op, Op::GradNorm { range, .. }
                        if group.start <= range.start && range.end <= group.end)
                })
                .collect();
            assert!(
                !at.is_empty(),
                "internal error: a group without a norm share"
            );
            at
        })
        .collect()
}

/// Where each group's update is: the optimizer phase has one `AdamW` per group, in group
/// order.
fn updates(g: &Builder, groups: usize) -> Vec<usize> {
    let update_at: Vec<usize> = (0..g.ops.len())
        .filter(|&i| g.ops[i].phase == Phase::Optimizer && matches!(g.ops[i].op, Op::AdamW { .. }))
        .collect();
    assert_eq!(
        update_at.len(),
        groups,
        "internal error: one update per group"
    );
    update_at
}

/// `--zero 0`: the group's gradients all-reduced as soon as they are final (just before its
/// norm share).
fn all_reduce(g: &mut Builder, gr: &Group, storage: DType, ins: &mut Inserts) {
    let (name, grad, cut, k) = (&gr.name, gr.grad, gr.cut, gr.k);
    let op = Op::AllReduce {
        axis: Axis::Data,
        buf: grad,
        scratch: scratch(g, &format!("{name}.grad"), storage, cut),
        cut: CutOf::Group(k),
        elems: None,
        reduce: Reduce::Sum,
    };
    let at = gr.norm;
    let micro = g.ops[at].micro;
    ins.before.push((
        at,
        entry(
            format!("{name}.grad.all_reduce"),
            Phase::Backward,
            micro,
            op,
        ),
    ));
}

/// The rank's shard of a group's gradients (ZeRO ≥ 1).
struct Shard {
    /// The `{group}.grad.shard` buffer, as long as the rank's chunk.
    buf: BufId,
    /// The parameter element of the chunk's first.
    base: usize,
    /// The rank's chunk of the group's cut (group offsets).
    chunk: std::ops::Range<usize>,
    /// The elements this rank owns (an empty range at its chunk's start when it owns
    /// padding or nothing).
    owned: std::ops::Range<usize>,
}

impl Shard {
    /// The shard's binding, for the ops that read it.
    fn binding(&self) -> Binding {
        Binding {
            buf: self.buf,
            base: self.base,
        }
    }
}

/// Declares the rank's shard of the group's gradients (`{group}.grad.shard`).
fn grad_shard(g: &mut Builder, split: &Split, gr: &Group) -> Shard {
    let (name, range, cut) = (&gr.name, gr.range, gr.cut);
    // The elements this rank owns (an empty range at its chunk's start when it owns
    // padding or nothing).
    let chunk = cut.shard(split.sh.rank);
    let base = range.start + chunk.start;
    let owned = Some(split.owned(range, gr.k))
        .filter(|o| !o.is_empty())
        .unwrap_or(base..base);
    let buf = g.act(format!("{name}.grad.shard"), Category::Grad, chunk.len());
    Shard {
        buf,
        base,
        chunk,
        owned,
    }
}

/// ZeRO 2 under accumulation: every micro-batch's gradients go to a buffer of their own
/// (`mb{j}.{group}.grad`; micro-batch 0's, the group's), zeroed before its first write and
/// reduce-scattered (accumulated into the shard) after its last.
fn reduce_scatter_each_micro_batch(
    g: &mut Builder,
    gr: &Group,
    shard: &Shard,
    storage: DType,
    micro: usize,
    ins: &mut Inserts,
) {
    let (name, grad, cut, k) = (&gr.name, gr.grad, gr.cut, gr.k);
    let shard = shard.buf;
    // The ops of micro-batch j that write gradient buffer `buf` (not the norm share
    // or the update, which read the shard), and under tensor parallelism the sum of its
    // tensors every tensor rank holds whole over those ranks (`lora::sum_shared_grads`,
    // after the micro-batch's last write).
    let writes = |e: &OpEntry, j: usize, buf: BufId| {
        e.micro == j
            && match &e.op {
                Op::GradNorm { .. } | Op::AdamW { .. } => false,
                Op::AllReduce {
                    buf: b,
                    axis: Axis::Tensor,
                    ..
                } => *b == buf,
                Op::AwaitCollective { bufs } => bufs[0] == buf,
                _ => e.grads.is_some_and(|b| b.buf == buf),
            }
    };
    for j in 0..micro {
        let buf = if j == 0 {
            grad
        } else {
            let id = g.act(format!("mb{j}.{name}.grad"), Category::Grad, cut.len());
            let mut first = None;
            for (i, e) in g.ops.iter_mut().enumerate() {
                if writes(e, j, grad) {
                    e.rename(grad, id);
                    first.get_or_insert(i);
                }
            }
            let first = first.expect("internal error: a micro-batch without gradients");
            let op = Op::Zero { buf: id };
            ins.before.push((
                first,
                entry(format!("zero_mb{j}.{name}.grad"), Phase::Backward, j, op),
            ));
            id
        };
        let last = g
            .ops
            .iter()
            .rposition(|e| writes(e, j, buf))
            .expect("internal error: a micro-batch without gradients");
        let op = Op::ReduceScatter {
            axis: Axis::Data,
            buf,
            shard,
            scratch: scratch(g, &format!("mb{j}.{name}.grad"), storage, cut),
            accumulate: j > 0,
            cut: CutOf::Group(k),
            residual: None,
        };
        ins.after.push((
            last,
            entry(
                format!("mb{j}.{name}.grad.reduce_scatter"),
                Phase::Backward,
                j,
                op,
            ),
        ));
    }
}

/// ZeRO 1, or one micro-batch: the group's gradients reduce-scattered into the shard once
/// final (just before its norm share).
fn reduce_scatter(g: &mut Builder, gr: &Group, shard: &Shard, storage: DType, ins: &mut Inserts) {
    let (name, grad, cut, k) = (&gr.name, gr.grad, gr.cut, gr.k);
    let op = Op::ReduceScatter {
        axis: Axis::Data,
        buf: grad,
        shard: shard.buf,
        scratch: scratch(g, &format!("{name}.grad"), storage, cut),
        accumulate: false,
        cut: CutOf::Group(k),
        residual: None,
    };
    let at = gr.norm;
    let micro = g.ops[at].micro;
    ins.before.push((
        at,
        entry(
            format!("{name}.grad.reduce_scatter"),
            Phase::Backward,
            micro,
            op,
        ),
    ));
}

/// The group's norm shares and update read the gradient shard (each share over the
/// elements of its range the rank owns, maybe none).
fn read_shard(g: &mut Builder, gr: &Group, shard: &Shard) {
    let shard_binding = shard.binding();
    let owned = &shard.owned;
    for &at in &gr.norms {
        let e = &mut g.ops[at];
        let Op::GradNorm {
            out,
            slot,
            ref range,
            parts,
        } = e.op
        else {
            unreachable!("a group's norm share is a GradNorm op")
        };
        let lo = range.start.clamp(owned.start, owned.end);
        let hi = range.end.clamp(lo, owned.end);
        e.op = Op::GradNorm {
            range: lo..hi,
            out,
            slot,
            parts,
        };
        e.grads = Some(shard_binding);
    }
    let upd = gr.update;
    g.ops[upd].grads = Some(shard_binding);
}

/// ZeRO 3: the rank keeps its shard of the group's parameters (`{group}.params.shard`),
/// which the update works on, and each span of use gets a gathered copy ([`gather_spans`]).
/// Returns the shard's segment.
fn shard_params(g: &mut Builder, gr: &Group, shard: &Shard, ins: &mut Inserts) -> Segment {
    let (k, upd, base, params) = (gr.k, gr.update, shard.base, gr.params);
    let full = &g.buffers[params.segments[k].buf.0];
    let (shard_name, category) = (format!("{}.shard", full.name), full.category);
    let shard_params = g.persistent(&shard_name, category, DType::F32, shard.chunk.len());
    g.ops[upd].params = Some(Binding {
        buf: shard_params,
        base,
    });
    gather_spans(g, params.segments[k].buf, shard_params, k, &mut ins.gathers);
    Segment {
        range: shard.owned.clone(),
        buf: shard_params,
    }
}

/// ZeRO 1 and 2: the update works on the rank's part of the whole parameters, which are
/// all-gathered after it.
fn gather_updated(g: &mut Builder, gr: &Group, ins: &mut Inserts) {
    let (name, k, upd, range, params) = (&gr.name, gr.k, gr.update, gr.range, gr.params);
    // (Bound here too for a rank whose shard holds no parameter: its update has no
    // tensors, so binding found none.)
    g.ops[upd].params = Some(Binding {
        buf: params.segments[k].buf,
        base: range.start,
    });
    let op = Op::AllGather {
        axis: Axis::Data,
        buf: params.segments[k].buf,
        shard: None,
        cut: CutOf::Group(k),
    };
    ins.after.push((
        upd,
        entry(format!("{name}.params.all_gather"), Phase::Optimizer, 0, op),
    ));
}

/// ZeRO 3: splits the uses of group `group`'s transient parameter buffer `full` into spans
/// (runs of ops with no other parameter group's op in between, within one phase class; a
/// LoRA plan's frozen ops, bound to the base, are no other group),
/// gives each span a gathered copy of its own, and adds to `gathers` the all-gather from
/// `shard` that fills it, with the span's first op ([`prefetch`] places it).
fn gather_spans(
    g: &mut Builder,
    full: BufId,
    shard: BufId,
    group: usize,
    gathers: &mut Vec<(usize, OpEntry)>,
) {
    let uses: Vec<usize> = (0..g.ops.len())
        .filter(|&i| g.ops[i].params.is_some_and(|b| b.buf == full))
        .collect();
    let mut spans: Vec<Vec<usize>> = Vec::new();
    for &i in &uses {
        // Recomputation is part of the backward: one span with it.
        let class = |p: Phase| match p {
            Phase::Recompute => Phase::Backward,
            p => p,
        };
        let joins = spans.last().is_some_and(|s| {
            let last = *s.last().expect("spans are not empty");
            let other_group_between = g.ops[last + 1..i]
                .iter()
                .any(|e| !e.frozen && e.params.is_some_and(|b| b.buf != full));
            !other_group_between && class(g.ops[last].phase) == class(g.ops[i].phase)
        });
        if joins {
            spans.last_mut().expect("checked").push(i);
        } else {
            spans.push(vec![i]);
        }
    }
    let base_name = g.buffers[full.0].name.clone();
    for (k, span) in spans.iter().enumerate() {
        let copy = if k == 0 {
            full
        } else {
            let b = g.buffers[full.0].clone();
            g.buf(format!("{base_name}.{k}"), b.category, b.dtype, b.elems)
        };
        for &i in span {
            g.ops[i].rename(full, copy);
        }
        let first = span[0];
        let e = OpEntry {
            name: format!("{}.all_gather", g.buffers[copy.0].name),
            phase: g.ops[first].phase,
            op: Op::AllGather {
                axis: Axis::Data,
                buf: copy,
                shard: Some(shard),
                cut: CutOf::Group(group),
            },
            flops: 0,
            params: None,
            grads: None,
            micro: g.ops[first].micro,
            frozen: false,
        };
        gathers.push((first, e));
    }
}

/// ZeRO 3: where each span's all-gather goes, `gathers` being (the span's first op, its
/// all-gather): just before the previous span's first op (of whichever group) in the same
/// phase class, so the next group's parameters arrive while the current group computes
/// (awaited just before its span, [`overlap`]); the first span of a phase class's before
/// its own first op.
fn prefetch(g: &Builder, mut gathers: Vec<(usize, OpEntry)>) -> Vec<(usize, OpEntry)> {
    gathers.sort_by_key(|(first, _)| *first);
    let mut placed = Vec::with_capacity(gathers.len());
    let mut prev: Option<usize> = None;
    for (first, e) in gathers {
        let class = phase_class(g.ops[first].phase);
        let at = match prev {
            Some(p) if phase_class(g.ops[p].phase) == class => p,
            _ => first,
        };
        placed.push((at, e));
        prev = Some(first);
    }
    placed
}

/// Phases whose ops a collective may overlap: the forward; the recompute and backward; the
/// update. A collective is awaited within its own.
fn phase_class(p: Phase) -> u8 {
    match p {
        Phase::Forward => 0,
        Phase::Recompute | Phase::Backward => 1,
        Phase::Optimizer | Phase::DeferredUpdate => 2,
    }
}

/// Runs each collective beside the ops after it (the device's communication thread takes
/// them in schedule order): inserts its [`Op::AwaitCollective`] just before the first later
/// op that touches its buffers, but no later than just after the next collective of its
/// kind starts, nor past its phase. So a group's exchange runs beside the compute of the
/// next group (the backward of the group before it; at stage 3 also the gathering of the
/// next group's parameters), and at most two groups' buffers of a kind are in flight. A
/// gradient-norm share that reads the collective's result moves to just after the await.
fn overlap(g: &mut Builder) {
    // The data axis's (a tensor-parallel layer's exchange is awaited where it is emitted).
    let colls: Vec<usize> = (0..g.ops.len())
        .filter(|&i| matches!(g.ops[i].op.collective_cut(), Some((_, Axis::Data))))
        .collect();
    // (insert before index, entries): the await, then the norm shares it lets through.
    let mut awaits: Vec<(usize, OpEntry)> = Vec::new();
    let mut moved: Vec<usize> = Vec::new();
    for (c, &i) in colls.iter().enumerate() {
        let buf = g.ops[i].op.collective_buf().expect("a collective");
        let class = phase_class(g.ops[i].phase);
        let kind = std::mem::discriminant(&g.ops[i].op);
        let next = colls[c + 1..]
            .iter()
            .find(|&&j| std::mem::discriminant(&g.ops[j].op) == kind)
            .map_or(g.ops.len(), |&j| j + 1);
        let mut at = next;
        let mut norms = Vec::new();
        for j in i + 1..next {
            let e = &g.ops[j];
            if phase_class(e.phase) != class {
                at = j;
                break;
            }
            let conflict = e.conflicts(&g.ops[i]);
            if conflict && matches!(e.op, Op::GradNorm { .. }) && !moved.contains(&j) {
                norms.push(j);
            } else if conflict {
                at = j;
                break;
            }
        }
        let mut bufs = Vec::new();
        g.ops[i].buffers(|b, _| bufs.push(b));
        bufs.sort_by_key(|b| (*b != buf, b.0));
        bufs.dedup();
        // The await keeps the collective's phase (the op it lands before may be the next
        // phase's first).
        awaits.push((
            at,
            OpEntry {
                name: format!("{}.await", g.ops[i].name),
                phase: g.ops[i].phase,
                op: Op::AwaitCollective { bufs },
                flops: 0,
                params: None,
                grads: None,
                micro: g.ops[i].micro,
                frozen: false,
            },
        ));
        for j in norms {
            awaits.push((at, g.ops[j].clone()));
            moved.push(j);
        }
    }
    let n = g.ops.len();
    let mut pre: Vec<Vec<OpEntry>> = vec![Vec::new(); n + 1];
    for (at, e) in awaits {
        pre[at].push(e);
    }
    let mut ops = Vec::with_capacity(n + pre.iter().map(Vec::len).sum::<usize>());
    for (j, e) in std::mem::take(&mut g.ops).into_iter().enumerate() {
        ops.append(&mut pre[j]);
        if !moved.contains(&j) {
            ops.push(e);
        }
    }
    ops.append(&mut pre[n]);
    g.ops = ops;
}

/// Inserts `before[i]` entries just before op i and `after[i]` just after it, in the order
/// given.
fn apply(g: &mut Builder, before: Vec<(usize, OpEntry)>, after: Vec<(usize, OpEntry)>) {
    let n = g.ops.len();
    let mut pre: Vec<Vec<OpEntry>> = vec![Vec::new(); n];
    let mut post: Vec<Vec<OpEntry>> = vec![Vec::new(); n];
    for (i, e) in before {
        pre[i].push(e);
    }
    for (i, e) in after {
        post[i].push(e);
    }
    let mut ops = Vec::with_capacity(n + pre.iter().chain(&post).map(Vec::len).sum::<usize>());
    for ((e, pre), post) in std::mem::take(&mut g.ops).into_iter().zip(pre).zip(post) {
        ops.extend(pre);
        ops.push(e);
        ops.extend(post);
    }
    g.ops = ops;
}

/// What one rank of a plan keeps and sends, next to the ZeRO paper's figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PerRank {
    pub ranks: usize,
    pub zero: u8,
    /// Bytes each rank sends per step in collectives (every rank sends as much).
    pub comm_bytes_per_step: u64,
    /// Of which, by collective: `all_reduce`, `reduce_scatter`, `all_gather`, `send`
    /// (pipeline stages), `scalars`.
    pub comm_by_collective: BTreeMap<String, u64>,
    /// The model state this rank holds (parameters as kept between steps, the gradients'
    /// own peak, the optimizer state).
    pub model_state: ModelState,
    /// The same by Rajbhandari et al. (2020), §5: (P + G + K)·Ψ for plain data
    /// parallelism, (P + G)·Ψ + K·Ψ/N for stage 1, P·Ψ + (G + K)·Ψ/N for stage 2 and
    /// (P + G + K)·Ψ/N for stage 3, with this plan's bytes per parameter: P = 4 (the f32
    /// master weights, which kernels read directly: no 2-byte copy), G = the gradients'
    /// storage type, K = the moments' format.
    pub zero_paper: ModelState,
}

/// Bytes of model state.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ModelState {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
}

impl ModelState {
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// A training plan's per-rank figures.
pub fn per_rank(plan: &Plan) -> PerRank {
    let cfg = &plan.cfg;
    let mut comm_by_collective = BTreeMap::new();
    for e in plan
        .schedule
        .ops
        .iter()
        .filter(|e| plan.schedule.in_step(e.phase))
    {
        let name = match e.op {
            Op::AllReduce { .. } => "all_reduce",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllGather { .. } => "all_gather",
            Op::StageSend { .. } => "send",
            _ => continue,
        };
        *comm_by_collective.entry(name.to_string()).or_insert(0) += plan.comm_bytes(e);
    }
    if plan.scalar_comm_bytes() > 0 {
        comm_by_collective.insert("scalars".into(), plan.scalar_comm_bytes());
    }
    let sum = |keep: &dyn Fn(&crate::ir::Buffer) -> bool| -> u64 {
        plan.buffers
            .iter()
            .filter(|b| keep(b))
            .map(|b| b.bytes)
            .sum()
    };
    let grads = plan
        .peak_by_category()
        .into_iter()
        .find(|(c, _)| *c == Category::Grad)
        .map_or(0, |(_, b)| b);
    let model_state = ModelState {
        params: sum(&|b| b.persistent && matches!(b.category, Category::Param | Category::Master)),
        grads,
        // The state itself, wherever it lives: not the staging copies `--offload` makes.
        optimizer: sum(&|b| b.persistent && b.category == Category::OptimizerState),
    };
    let psi = plan.layout.total as f64;
    let n = cfg.mesh.data as f64;
    let (p, g) = (4.0, cfg.precision.storage_size() as f64);
    let k = match cfg.optim_state {
        OptimState::F32 => 8.0,
        OptimState::Bf16 => 4.0,
        OptimState::Int8 => 2.0 + 8.0 / crate::ir::strategy::QBLOCK as f64,
    };
    let (pd, gd, kd) = match cfg.zero.0 {
        0 => (1.0, 1.0, 1.0),
        1 => (1.0, 1.0, n),
        2 => (1.0, n, n),
        _ => (n, n, n),
    };
    let zero_paper = ModelState {
        params: (p * psi / pd) as u64,
        grads: (g * psi / gd) as u64,
        optimizer: (k * psi / kd) as u64,
    };
    PerRank {
        ranks: cfg.mesh.data,
        zero: cfg.zero.0,
        comm_bytes_per_step: plan.comm_bytes_per_step(),
        comm_by_collective,
        model_state,
        zero_paper,
    }
}
