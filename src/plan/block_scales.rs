//! 8-bit optimizer state under tensor parallelism: the block scales the ranks agree on, so
//! every tensor rank quantizes its part of a cut tensor's moments in the blocks one process
//! would use, bitwise.
//!
//! A cut tensor's 8-bit blocks are its whole tensor's ([`crate::model::ParamLayout::block_offsets`]):
//! a block of [`QBLOCK`] consecutive values of the whole tensor may hold values of several
//! tensor ranks' parts (a row-parallel weight's rows are cut across them), and its scale is
//! the maximum over all of them. So, before the update of a group holding cut tensors, each
//! rank computes what the update would make of its elements' maxima per block of the group
//! ([`Op::AdamWBlockMax`]; 0 for blocks it holds none of), the ranks take the maximum
//! ([`Op::AllReduce`] with [`Reduce::Max`]: over the tensor ranks, then, with sharded
//! moments, over the data ranks, whose shards of each part end where each part's blocks
//! do, `plan::zero`), and the update ([`Op::AdamW`] with its `scales`) encodes the new
//! moments at the agreed scales, which every rank then keeps for every block of its
//! moments (those of the other parts' elements too: a checkpoint writes tensor rank 0's).
//! The arithmetic of the update itself is unchanged: the scales are an output of one
//! process's step, never an input of its parameters' update.
//!
//! ```text
//!   {g}.adamw_block_max    rank's maxima per block   -> {g}.adamw.scales [2, group's blocks]
//!   {g}.adamw.scales.all_reduce (max, tensor axis)   (+ its await)
//!   {g}.adamw.scales.all_reduce_data (max, data axis, sharded moments)   (+ its await)
//!   {g}.adamw              decode at the old scales, update, encode at the agreed ones
//! ```

use super::zero::entry;
use crate::dtype::DType;
use crate::ir::builder::Builder;
use crate::ir::schedule::{BlockScales, Op, OpEntry, Phase, Reduce};
use crate::ir::strategy::QBLOCK;
use crate::ir::{Axis, Category, Cut, CutOf, OptimState};
use crate::model::ParamLayout;

/// Inserts the agreement before the update of every group that holds a cut tensor (see the
/// module documentation), where the moments are 8-bit and the tensor is cut; with
/// `sharded` (8-bit moments sharded among `data` ranks) the data ranks agree too.
pub(super) fn agree(g: &mut Builder, layout: &ParamLayout, sharded: Option<usize>) {
    if !layout.split.is_split() {
        return;
    }
    let updates: Vec<usize> = (0..g.ops.len())
        .filter(|&i| g.ops[i].phase == Phase::Optimizer)
        .filter(|&i| matches!(&g.ops[i].op, Op::AdamW { state, .. } if state.format == OptimState::Int8))
        .collect();
    if updates.is_empty() {
        return;
    }
    assert_eq!(
        updates.len(),
        layout.groups.len(),
        "internal error: one update per group"
    );
    let (first, total) = layout.block_offsets(QBLOCK);
    let mut before: Vec<(usize, Vec<OpEntry>)> = Vec::new();
    for (group, &i) in layout.groups.iter().zip(&updates) {
        if layout.tensors[group.tensors.clone()]
            .iter()
            .all(|t| t.part.is_none())
        {
            continue;
        }
        let Op::AdamW { tensors, state, .. } = &g.ops[i].op else {
            unreachable!("updates are AdamW ops");
        };
        let (tensors, state) = (tensors.clone(), *state);
        let blocks = first[group.tensors.start]..first.get(group.tensors.end).map_or(total, |&b| b);
        let name = &group.name;
        let n = 2 * blocks.len();
        let buf = g.buf(
            format!("{name}.adamw.scales"),
            Category::Communication,
            DType::F32,
            n,
        );
        let out = BlockScales { buf, blocks };
        let update = &g.ops[i];
        let micro = update.micro;
        let max = OpEntry {
            name: format!("{name}.adamw_block_max"),
            op: Op::AdamWBlockMax {
                tensors,
                state,
                out: out.clone(),
            },
            ..update.clone()
        };
        let mut ops = vec![max];
        let axes = [
            (Axis::Tensor, layout.split.size, ""),
            (Axis::Data, sharded.unwrap_or(1), "_data"),
        ];
        for (axis, ranks, suffix) in axes.into_iter().filter(|a| a.1 > 1) {
            let cut = Cut::even(n, ranks);
            let what = format!("{name}.adamw.scales.all_reduce{suffix}");
            let scratch = g.buf(
                format!("{what}.comm"),
                Category::Communication,
                DType::F32,
                cut.scratch(),
            );
            let op = Op::AllReduce {
                buf,
                scratch,
                cut: CutOf::Even,
                axis,
                elems: None,
                reduce: Reduce::Max,
            };
            ops.push(entry(what.clone(), Phase::Optimizer, micro, op));
            let await_ = Op::AwaitCollective {
                bufs: vec![buf, scratch],
            };
            ops.push(entry(
                format!("{what}.await"),
                Phase::Optimizer,
                micro,
                await_,
            ));
        }
        if let Op::AdamW { scales, .. } = &mut g.ops[i].op {
            *scales = Some(out);
        }
        before.push((i, ops));
    }
    for (i, ops) in before.into_iter().rev() {
        g.ops.splice(i..i, ops);
    }
}
