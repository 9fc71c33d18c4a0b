//! Every rank's plan of a job (`plan --ranks N --tp T --pp P`): each rank of the mesh with its
//! coordinates, parameters held, predicted peak and bytes by category, so a script can hold
//! each rank to its own figure.
//!
//! Ranks whose plans are the same bytes by construction share one plan: along the tensor
//! axis every rank holds an equal part of every layer (the first one adds the row-parallel
//! biases, which changes ops, not buffers), and along the data axis every rank holds the
//! same buffers unless 8-bit moments are sharded at the blocks' edges (then each data rank's
//! shard differs). Each pipeline stage holds its own layers (the first the embedding, the
//! last the head: stages differ), so it is planned once per stage. So a job of any size is
//! planned a few times, not once per rank.

use super::{Mode, Plan, StepConfig, build_plan};
use crate::ir::{Axis, Category, Mesh, OptimState, Sizing};
use crate::model::ModelSpec;
use anyhow::Result;
use serde::Serialize;
use std::collections::BTreeMap;

/// One rank of a job as its plan sees it.
#[derive(Clone, Debug, Serialize)]
pub struct RankPlan {
    /// The rank in the whole job (MPI's order).
    pub rank: usize,
    pub coords: Coords,
    /// Parameters this rank holds (its parts of the cut tensors, the whole ones whole).
    pub num_params: usize,
    pub predicted_peak_rss_bytes: u64,
    /// Bytes of each category in the rank's plan (every buffer declared, those that live
    /// apart counted apart: what `plan`'s `sum of bytes` column shows).
    pub by_category: BTreeMap<String, u64>,
    /// Bytes of each category live in memory at the plan's peak op: what the rank holds
    /// when it peaks (their sum and the process baseline make its peak).
    pub peak_by_category: BTreeMap<String, u64>,
}

/// A rank's place on each axis of the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Coords {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
}

impl Coords {
    pub fn of(mesh: &Mesh) -> Coords {
        Coords {
            dp: mesh.coord(Axis::Data),
            tp: mesh.coord(Axis::Tensor),
            pp: mesh.coord(Axis::Pipeline),
        }
    }
}

/// The plan every rank of `cfg`'s mesh runs, in rank order, with `baseline` bytes of
/// process each (the plans of ranks that hold the same bytes by construction are made once).
pub fn every_rank(
    spec: &ModelSpec,
    cfg: &StepConfig,
    backend: &dyn Sizing,
    baseline: u64,
) -> Result<Vec<RankPlan>> {
    let mesh = cfg.mesh;
    let edges = cfg.zero.shards_optimizer() && cfg.optim_state == OptimState::Int8;
    let mut made: BTreeMap<(usize, usize, usize, usize), RankPlan> = BTreeMap::new();
    (0..mesh.world())
        .map(|rank| {
            let m = Mesh { rank, ..mesh };
            // Tensor rank 0 adds what row-parallel layers add once; the others are alike but
            // for their rows of a vocabulary the ranks do not divide. Each pipeline stage
            // holds its own layers.
            let key = (
                m.coord(Axis::Tensor).min(1),
                m.tensor_split().vocab_part(spec.vocab_size).len(),
                if edges { m.coord(Axis::Data) } else { 0 },
                m.coord(Axis::Pipeline),
            );
            let shared = match made.entry(key) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    let c = StepConfig {
                        mesh: m,
                        ..cfg.clone()
                    };
                    let plan = build_plan(spec, &c, Mode::Train, backend)?;
                    e.insert(of_plan(&plan, baseline))
                }
            };
            Ok(RankPlan {
                rank,
                coords: Coords::of(&m),
                ..shared.clone()
            })
        })
        .collect()
}

/// A rank's figures from its plan.
fn of_plan(plan: &Plan, baseline: u64) -> RankPlan {
    RankPlan {
        rank: plan.cfg.mesh.rank,
        coords: Coords::of(&plan.cfg.mesh),
        num_params: plan.layout.total,
        predicted_peak_rss_bytes: plan.predicted_peak(baseline),
        by_category: named(plan.bytes_by_category()),
        peak_by_category: named(plan.live_by_category(plan.peak_op)),
    }
}

/// Categories by name.
fn named(by: Vec<(Category, u64)>) -> BTreeMap<String, u64> {
    (by.into_iter())
        .map(|(c, b)| (c.name().to_string(), b))
        .collect()
}

/// The ranks grouped by their peak, heaviest first: each group's peak and its ranks, for the
/// text report ("which rank is heaviest").
pub fn by_peak(ranks: &[RankPlan]) -> Vec<(u64, Vec<usize>)> {
    let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for r in ranks {
        groups
            .entry(r.predicted_peak_rss_bytes)
            .or_default()
            .push(r.rank);
    }
    groups.into_iter().rev().collect()
}
