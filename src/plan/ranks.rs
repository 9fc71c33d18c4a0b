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
//!
//! Each rank lists its stage's layers, and, where a calibration prices the plans
//! ([`every_rank_timed`]), its stage's predicted forward and backward of one micro-batch:
//! [`describe_stages`] shows the cut, each stage's time and peak, and the 1F1B step they make.

use super::time::Calibration;
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
    /// The model's layers this rank's pipeline stage holds (all of them for one stage;
    /// under the interleaved schedule, from its first run's first to its last run's last).
    pub layers: std::ops::Range<usize>,
    /// Under the interleaved schedule, its runs of layers (empty otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<std::ops::Range<usize>>,
    /// Its stage's predicted forward and backward of one micro-batch (seconds: the plan's
    /// ops but the update's, over its micro-batches), where a calibration priced it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_micro_batch_s: Option<f64>,
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
    every_rank_timed(spec, cfg, backend, baseline, None)
}

/// [`every_rank`], each stage's forward and backward of a micro-batch priced with `cal`.
pub fn every_rank_timed(
    spec: &ModelSpec,
    cfg: &StepConfig,
    backend: &dyn Sizing,
    baseline: u64,
    cal: Option<&Calibration>,
) -> Result<Vec<RankPlan>> {
    let mesh = cfg.mesh;
    let mut made: BTreeMap<PlanKey, RankPlan> = BTreeMap::new();
    (0..mesh.world())
        .map(|rank| {
            let m = Mesh { rank, ..mesh };
            let shared = match made.entry(plan_key(spec, cfg, rank)) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    let c = StepConfig {
                        mesh: m,
                        ..cfg.clone()
                    };
                    let plan = build_plan(spec, &c, Mode::Train, backend)?;
                    e.insert(of_plan(&plan, baseline, cal))
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

/// What makes one rank's plan differ from another's ([`plan_key`]).
type PlanKey = (usize, usize, usize, usize);

/// The rank of `cfg`'s mesh by what its plan holds: ranks with equal keys have plans of the
/// same bytes and ops. Tensor rank 0 adds what row-parallel layers add once; the others are
/// alike but for their rows of a vocabulary the ranks do not divide; data ranks differ only
/// where 8-bit moments are sharded at the blocks' edges; each pipeline stage holds its own
/// layers.
fn plan_key(spec: &ModelSpec, cfg: &StepConfig, rank: usize) -> PlanKey {
    let m = Mesh { rank, ..cfg.mesh };
    let edges = cfg.zero.shards_optimizer() && cfg.optim_state == OptimState::Int8;
    (
        m.coord(Axis::Tensor).min(1),
        m.tensor_split().vocab_part(spec.vocab_size).len(),
        if edges { m.coord(Axis::Data) } else { 0 },
        m.coord(Axis::Pipeline),
    )
}

/// One rank for each distinct plan of `cfg`'s mesh (the first with its `plan_key`), in
/// rank order: the plans `--fit` builds to know a mesh's heaviest and slowest rank.
pub fn distinct_ranks(spec: &ModelSpec, cfg: &StepConfig) -> Vec<usize> {
    let mut seen = std::collections::BTreeSet::new();
    (0..cfg.mesh.world())
        .filter(|&r| seen.insert(plan_key(spec, cfg, r)))
        .collect()
}

/// A rank's figures from its plan (its stage's time priced with `cal`, where given).
fn of_plan(plan: &Plan, baseline: u64, cal: Option<&Calibration>) -> RankPlan {
    let micro = |cal| {
        let t = super::time::predict(plan, cal);
        (t.compute_s - t.update_s) / plan.cfg.grad_accum.max(1) as f64
    };
    let chunks = plan.layout.stage.chunk_layers(plan.spec.n_layer);
    RankPlan {
        layers: chunks[0].start..chunks[chunks.len() - 1].end,
        chunks: match chunks.len() {
            1 => Vec::new(),
            _ => chunks,
        },
        predicted_micro_batch_s: cal.map(micro),
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

/// The pipeline's stages (`--pp`): the cut, and each stage's layers, ranks, peak and (where
/// priced) forward and backward of one micro-batch, with the 1F1B step of the plan's `m`
/// micro-batches they make: about (m − 1) × the slowest stage plus each stage once, the
/// update aside. Empty for one stage.
pub fn describe_stages(ranks: &[RankPlan], cfg: &StepConfig, n_layer: usize) -> String {
    use std::fmt::Write;
    let p = cfg.mesh.pipeline;
    let mut s = String::new();
    if p <= 1 {
        return s;
    }
    let counts = cfg.stage_counts(n_layer);
    let how = match cfg.stage_layers.is_empty() {
        true => "as even as they divide",
        false => "by --pp-layers",
    };
    let _ = match cfg.pipeline_chunks {
        0 | 1 => writeln!(
            s,
            "  pipeline stages: the {n_layer} layers cut {} ({how})",
            super::stage_layers::list(&counts)
        ),
        v => writeln!(
            s,
            "  pipeline stages: the {n_layer} layers cut into {} runs as even as they divide, \
             each stage holding {v} (--pp-chunks {v}: stage s runs s, s + {p}, ...)",
            p * v
        ),
    };
    let mut times = Vec::new();
    for stage in 0..p {
        let mine: Vec<&RankPlan> = ranks.iter().filter(|r| r.coords.pp == stage).collect();
        let Some(first) = mine.first() else { continue };
        let heaviest = mine.iter().map(|r| r.predicted_peak_rss_bytes).max();
        let layers = match first.chunks.is_empty() {
            true => describe_layers(std::slice::from_ref(&first.layers)),
            false => describe_layers(&first.chunks),
        };
        let ends = match stage {
            0 => ", the embedding",
            s if s + 1 == p => ", the head and the loss",
            _ => "",
        };
        let time = match first.predicted_micro_batch_s {
            Some(t) => {
                times.push(t);
                format!(", {t:.3} s forward and backward per micro-batch")
            }
            None => String::new(),
        };
        let who: Vec<usize> = mine.iter().map(|r| r.rank).collect();
        let _ = writeln!(
            s,
            "    stage {stage}: {layers}{ends}{time}, peak {} ({})",
            crate::util::bytes::fmt_bytes(heaviest.unwrap_or(0)),
            describe_ranks(&who)
        );
    }
    if times.len() == p {
        let (m, v) = (cfg.grad_accum.max(1), cfg.pipeline_chunks.max(1));
        let slowest = times.iter().copied().fold(0.0, f64::max);
        // Interleaved, the fill and drain pass each stage once per run: (V·m − 1) runs of
        // the slowest stage and each stage's run once, a run being 1/V of a stage's work.
        let step = ((v * m - 1) as f64 * slowest + times.iter().sum::<f64>()) / v as f64;
        let ideal = m as f64 * times.iter().sum::<f64>() / p as f64;
        let (what, how) = match v {
            1 => (
                "1F1B".to_string(),
                "(m - 1) x the slowest stage + each once",
            ),
            _ => (
                format!("Interleaved 1F1B ({v} runs a stage)"),
                "(Vm - 1) x the slowest stage's run + each stage's once",
            ),
        };
        let _ = writeln!(
            s,
            "    {what} over {m} micro-batches: about {step:.2} s of forward and backward \
             ({how}), {:.2}x the ideal {ideal:.2} s (the work split evenly, no bubble)",
            step / ideal
        );
    }
    s
}

/// `layer 3`, `layers 0-5`, or the runs of an interleaved stage, `layers 0-1, 4-5`.
pub fn describe_layers(runs: &[std::ops::Range<usize>]) -> String {
    let each: Vec<String> = (runs.iter())
        .map(|r| match r.len() {
            1 => r.start.to_string(),
            _ => format!("{}-{}", r.start, r.end - 1),
        })
        .collect();
    match runs.len() == 1 && runs[0].len() == 1 {
        true => format!("layer {}", each[0]),
        false => format!("layers {}", each.join(", ")),
    }
}

/// `ranks 0-3, 6` for a sorted list of ranks.
pub fn describe_ranks(ranks: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &r in ranks {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == r => *end = r,
            _ => runs.push((r, r)),
        }
    }
    let parts: Vec<String> = runs
        .iter()
        .map(|&(a, b)| match a == b {
            true => a.to_string(),
            false => format!("{a}-{b}"),
        })
        .collect();
    format!(
        "{} {}",
        if ranks.len() == 1 { "rank" } else { "ranks" },
        parts.join(", ")
    )
}
