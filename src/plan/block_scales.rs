//! 8-bit optimizer state under tensor parallelism: the block scales the tensor ranks agree
//! on, so every rank quantizes its part of a cut tensor's moments in the blocks one process
//! would use, bitwise.
//!
//! A cut tensor's 8-bit blocks are its whole tensor's ([`crate::model::ParamLayout::block_offsets`]):
//! a block of [`QBLOCK`] consecutive values of the whole tensor may hold values of several
//! tensor ranks' parts (a row-parallel weight's rows are cut across them), and its scale is
//! the maximum over all of them. So, before the update of a group holding cut tensors, each
//! rank computes what the update would make of its elements' maxima per block
//! ([`Op::AdamWBlockMax`]), the tensor ranks take the maximum of those ([`Op::AllReduce`]
//! with [`Reduce::Max`]), and the update ([`Op::AdamW`] with its `scales`) encodes the new
//! moments at the agreed scales, which every tensor rank then keeps for every block of the
//! group (its checkpoint writes tensor rank 0's). The arithmetic of the update itself is
//! unchanged: the scales are an output of one process's step, never an input of its
//! parameters' update.
//!
//! ```text
//!   {g}.adamw_block_max    rank's maxima per block   -> {g}.adamw.scales [2, blocks]
//!   {g}.adamw.scales.all_reduce (max, tensor axis)   (+ its await)
//!   {g}.adamw              decode at the old scales, update, encode at the agreed ones
//! ```
//!
//! The blocks are those of the rank's moments of the group: all of the group's, or under
//! ZeRO its data shard's, which every tensor rank of a data rank holds alike (ZeRO cuts a
//! group with cut tensors at the whole tensors' block edges, `plan::zero`).

use crate::dtype::DType;
use crate::ir::builder::Builder;
use crate::ir::schedule::{BlockScales, Op, OpEntry, Phase, Reduce};
use crate::ir::strategy::QBLOCK;
use crate::ir::{Axis, Category, Cut, CutOf, OptimState};
use crate::model::ParamLayout;

/// Inserts the agreement before the update of every group that holds a cut tensor (see the
/// module documentation), where the moments are 8-bit and the tensor is cut.
pub(super) fn agree(g: &mut Builder, layout: &ParamLayout) {
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
    let mut before: Vec<(usize, [OpEntry; 3])> = Vec::new();
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
        // The group's blocks that the rank's moments hold (all of them, or its shard's).
        let of_group =
            first[group.tensors.start]..first.get(group.tensors.end).map_or(total, |&b| b);
        let scales = state
            .m_scale
            .expect("internal error: 8-bit moments without scales");
        let held = state.block_base..state.block_base + g.buffers[scales.0].elems;
        let blocks = of_group.start.max(held.start)..of_group.end.min(held.end);
        if blocks.is_empty() {
            continue;
        }
        let name = &group.name;
        let n = 2 * blocks.len();
        let buf = g.buf(
            format!("{name}.adamw.scales"),
            Category::Communication,
            DType::F32,
            n,
        );
        let cut = Cut::even(n, layout.split.size);
        let scratch = g.buf(
            format!("{name}.adamw.scales.comm"),
            Category::Communication,
            DType::F32,
            cut.scratch(),
        );
        let out = BlockScales { buf, blocks };
        let update = &g.ops[i];
        let max = OpEntry {
            name: format!("{name}.adamw_block_max"),
            op: Op::AdamWBlockMax {
                tensors,
                state,
                out: out.clone(),
            },
            ..update.clone()
        };
        let collective = |name: String, op| OpEntry {
            name,
            phase: Phase::Optimizer,
            op,
            flops: 0,
            params: None,
            grads: None,
            micro: update.micro,
            frozen: false,
        };
        let all_reduce = collective(
            format!("{name}.adamw.scales.all_reduce"),
            Op::AllReduce {
                buf,
                scratch,
                cut: CutOf::Even,
                axis: Axis::Tensor,
                elems: None,
                reduce: Reduce::Max,
            },
        );
        let await_ = collective(
            format!("{name}.adamw.scales.all_reduce.await"),
            Op::AwaitCollective {
                bufs: vec![buf, scratch],
            },
        );
        if let Op::AdamW { scales, .. } = &mut g.ops[i].op {
            *scales = Some(out);
        }
        before.push((i, [max, all_reduce, await_]));
    }
    for (i, ops) in before.into_iter().rev() {
        g.ops.splice(i..i, ops);
    }
}
