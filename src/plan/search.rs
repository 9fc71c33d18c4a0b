//! `--fit`: the fastest combination of strategies that fits a memory budget, by prediction.
//!
//! The space: the micro-batch × accumulation pairs that keep the global batch, every offload
//! placement, every recomputation policy (none, selective, every:K, full), and, only where
//! the user allows it, the precision and the optimizer-state format. Memory is exact, so a
//! candidate either fits or not; those that fit are ranked by predicted step time
//! ([`super::time::predict`]).
//!
//! Pruning keeps the search to a few hundred plan builds for gpt2-xl:
//! - for a placement and micro-batch, the policies are ordered by recomputed FLOPs (none,
//!   selective, every:2, …, every:L, full) and memory falls along that order, so the least
//!   recomputation that fits is found by bisection;
//! - offloading more never makes a step faster with the same recomputation, so a placement is
//!   tried only when every smaller placement needed more recomputation than the one that
//!   fits it could ([`OffloadSet`] subsets);
//! - groups (precision, state, micro-batch) are visited fastest-first by the time of their
//!   unconstrained plan (no recomputation, nothing offloaded), a lower bound of the group, and
//!   the search stops when that bound is no better than the fifth best found;
//! - plans of more than two micro-batches are built with two (the peak does not change; the
//!   time of the others is scaled) and rebuilt exactly when kept;
//! - with activations on disk more recomputation moves fewer bytes, so those placements, when
//!   the step waits for the disk, also try a coarse ladder of heavier policies.
//!
//! A candidate's offload file must also fit the disk of `--offload-dir` (a run's `offload/`
//! when not given): its free space, read once, bounds the search as the budget does.
//! Candidates are built unverified (`Verify::No`: they are measured and timed, never run);
//! the chosen one is built again, verified. `tests/fit.rs` checks the search against every
//! candidate built one by one. `--recompute auto` and `--offload auto` are this search with
//! the micro-batch, accumulation, precision and optimizer state fixed
//! ([`super::fit::plan_fitting`]).

use super::build::{Verify, build, check_mesh};
use super::search_mesh::{Built, meshes, micro_batches_built};
use super::time::{Calibration, StepTime, predict};
use super::{Budgets, Mode, OffloadSet, StepConfig};
use crate::ir::Sizing;
use crate::ir::shard::Zero;
use crate::ir::{OptimState, Precision, Recompute, Tier};
use crate::model::ModelSpec;
use crate::util::bytes::fmt_bytes;
use anyhow::{Result, bail};
use rayon::prelude::*;
use std::fmt;
use std::str::FromStr;

/// A strategy flag that may be left to the search: `auto` or a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick<T> {
    Auto,
    Fixed(T),
}

impl<T: FromStr<Err = anyhow::Error>> FromStr for Pick<T> {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Pick<T>> {
        match s.trim() {
            "auto" => Ok(Pick::Auto),
            other => other.parse().map(Pick::Fixed),
        }
    }
}

impl<T: fmt::Display> fmt::Display for Pick<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pick::Auto => write!(f, "auto"),
            Pick::Fixed(t) => t.fmt(f),
        }
    }
}

impl<T: Copy> Pick<T> {
    /// The value given, or `None` for `auto`.
    pub fn fixed(self) -> Option<T> {
        match self {
            Pick::Auto => None,
            Pick::Fixed(t) => Some(t),
        }
    }

    fn options(self, all: &[T]) -> Vec<T> {
        match self {
            Pick::Auto => all.to_vec(),
            Pick::Fixed(t) => vec![t],
        }
    }
}

/// What `--fit` may choose, and what it keeps.
#[derive(Clone, Debug)]
pub struct Space {
    /// Sequences per optimizer step: micro-batch × accumulation.
    pub global_batch: usize,
    pub seq: usize,
    pub threads: usize,
    /// A fixed micro-batch (`--batch N` with `--fit`), or every divisor of the global batch.
    pub micro_batch: Option<usize>,
    pub recompute: Pick<Recompute>,
    pub offload: Pick<OffloadSet>,
    pub precision: Pick<Precision>,
    pub optim_state: Pick<OptimState>,
    /// The offload file's directory (recorded in the chosen configuration).
    pub offload_dir: Option<std::path::PathBuf>,
    /// LoRA adapters and the base's storage, as given (`--lora`, `--base-quant`): the
    /// search chooses the rest around them (nothing is offloaded with them).
    pub lora: Option<crate::model::lora::LoraSpec>,
    pub base_quant: crate::ir::BaseQuant,
    pub base_types: Option<std::sync::Arc<crate::ir::BaseTypes>>,
    /// Distillation (`--distill-from`), as given: its teacher's plan is counted in every
    /// candidate's.
    pub distill: Option<crate::plan::Distill>,
    /// Processes of the job (`plan --ranks N`): with more than one, the search also chooses
    /// the mesh (`plan::search_mesh`), each rank planned, the heaviest within the budget.
    pub ranks: usize,
    /// Tensor-parallel size (`--tp`), pipeline stages (`--pp`) and ZeRO stage (`--zero`):
    /// given, or searched where there are ranks to search them over.
    pub tensor: Pick<usize>,
    pub pipeline: Pick<usize>,
    pub zero: Pick<Zero>,
    /// Sequence parallelism on the tensor axis (`--sequence-parallel`): given, or tried both
    /// ways on meshes of two tensor ranks or more.
    pub sequence_parallel: Pick<bool>,
    /// Layers of each pipeline stage (`--pp-layers`, with a fixed `pipeline`; empty for an
    /// even cut), or `Auto`: on each pipeline the even cut and the one balanced by predicted
    /// time (`plan::stage_cut::balanced`), where they differ.
    pub stage_layers: Pick<Vec<usize>>,
    /// Runs of layers each pipeline stage holds (`--pp-chunks`): given (more than 1
    /// interleaves the stages of every mesh with a pipeline), or `Auto`: 1 and, where the
    /// interleaved schedule divides, 2 (`chunk_options`).
    pub pipeline_chunks: Pick<usize>,
    /// When each group's update runs (`--update`), as given: with `in-backward`, which
    /// composes with neither, nothing is offloaded and fp16 is not tried.
    pub update: crate::ir::Update,
    /// The pinned host tier's budget beneath a GPU (`--max-host-memory`): what a placement
    /// keeps there must fit it.
    pub host_budget: Option<u64>,
}

/// One configuration that fits, with its plan's peak and predicted time.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub cfg: StepConfig,
    pub peak: u64,
    pub time: StepTime,
}

impl Candidate {
    /// The flags that select it (with the mesh's, for a job of several ranks).
    pub fn flags(&self) -> String {
        let c = &self.cfg;
        let one = format!(
            "--batch {} --grad-accum {} --recompute {} --offload {} --precision {} --optim-state {}",
            c.batch, c.grad_accum, c.recompute, c.offload.set, c.precision, c.optim_state
        );
        match c.mesh.world() > 1 {
            true => format!("{} {one}", mesh_flags(c)),
            false => one,
        }
    }

    /// Tokens per second at the predicted step time.
    pub fn tokens_per_s(&self) -> f64 {
        (self.cfg.batch * self.cfg.grad_accum * self.cfg.mesh.data * self.cfg.seq) as f64
            / self.time.step_s
    }
}

/// `--tp T --pp P --zero Z` of `c` (and `--sequence-parallel`, `--pp-layers`).
fn mesh_flags(c: &StepConfig) -> String {
    let sp = if c.sequence_parallel {
        " --sequence-parallel"
    } else {
        ""
    };
    let cut = match c.stage_layers.is_empty() {
        true => String::new(),
        false => format!(
            " --pp-layers {}",
            super::stage_layers::list(&c.stage_layers)
        ),
    };
    let chunks = match c.pipeline_chunks {
        0 | 1 => String::new(),
        v => format!(" --pp-chunks {v}"),
    };
    let (m, zero) = (&c.mesh, c.zero);
    format!(
        "--tp {}{sp} --pp {}{cut}{chunks} --zero {zero}",
        m.tensor, m.pipeline
    )
}

/// `2 x 2 x 2, 1` of `c` (tp x pp x dp, ZeRO stage; `2+sp x …` with sequence parallelism,
/// `… x 2(9,3) x …` with an uneven cut, `… x 2(v2) x …` interleaved).
fn mesh_shape(c: &StepConfig) -> String {
    let sp = if c.sequence_parallel { "+sp" } else { "" };
    let cut = match (c.stage_layers.is_empty(), c.pipeline_chunks) {
        (true, 0 | 1) => String::new(),
        (true, v) => format!("(v{v})"),
        (false, _) => format!("({})", super::stage_layers::list(&c.stage_layers)),
    };
    let (m, zero) = (&c.mesh, c.zero);
    format!(
        "{}{sp} x {}{cut} x {}, {zero}",
        m.tensor, m.pipeline, m.data
    )
}

/// A group of the space that nothing fits, with its smallest plan's peak.
#[derive(Clone, Debug)]
pub struct Rejected {
    pub what: String,
    pub smallest_peak: u64,
}

/// What the search found.
#[derive(Clone, Debug)]
pub struct Found {
    /// Candidates that fit, fastest first (at most [`Found::KEEP`]).
    pub ranked: Vec<Candidate>,
    /// Groups (precision, state, micro-batch) in which nothing fits.
    pub rejected: Vec<Rejected>,
    /// Groups never searched: their fastest plan could not beat the candidates kept.
    pub skipped: usize,
    pub plans_built: usize,
    /// The tier ops compute on, whose peak the candidates' `peak` is (the CPU's: RAM).
    pub compute: Tier,
    /// Ranks of the job (`Space::ranks`).
    pub ranks: usize,
    /// The offload directory and the bytes free on its disk, when a plan within the budget
    /// was refused because its offload file is larger.
    pub disk: Option<(std::path::PathBuf, u64)>,
    /// The search kept `--update in-backward` (so it offloaded nothing).
    pub in_backward: bool,
    /// `--max-host-memory`, when a plan within the budget was refused because what it keeps
    /// in host RAM beneath the GPU is more.
    pub host: Option<u64>,
}

impl Found {
    /// How many of the fastest candidates are kept.
    pub const KEEP: usize = 5;

    /// The search as plan.json records it (`fit`): budget, candidates with their predicted
    /// peak and time, the groups that do not fit.
    pub fn record(
        &self,
        space: &Space,
        budget: u64,
        cal: &Calibration,
        search_s: f64,
    ) -> serde_json::Value {
        serde_json::json!({
            "max_memory": budget,
            "global_batch": space.global_batch,
            "calibration": cal.describe(),
            "plans_built": self.plans_built,
            "search_s": search_s,
            "ranks": space.ranks,
            "candidates": self.ranked.iter().map(|k| serde_json::json!({
                "flags": k.flags(), "batch": k.cfg.batch, "grad_accum": k.cfg.grad_accum,
                "tp": k.cfg.mesh.tensor, "pp": k.cfg.mesh.pipeline, "dp": k.cfg.mesh.data,
                "zero": k.cfg.zero.0, "sequence_parallel": k.cfg.sequence_parallel,
                "recompute": k.cfg.recompute.to_string(), "offload": k.cfg.offload.set.to_string(),
                "precision": k.cfg.precision.to_string(), "optim_state": k.cfg.optim_state.to_string(),
                "predicted_peak_bytes": k.peak, "predicted_step_s": k.time.step_s,
                "tokens_per_s": k.tokens_per_s(), "bound": k.time.bound,
            })).collect::<Vec<_>>(),
            "not_fitting": self.rejected.iter().map(|r| serde_json::json!({
                "flags": r.what, "smallest_peak_bytes": r.smallest_peak,
            })).collect::<Vec<_>>(),
            "groups_skipped": self.skipped,
        })
    }

    /// The five best as a table, then what does not fit.
    pub fn table(&self, budget: u64) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "fastest plans that fit --max-memory {} ({} plans built):",
            fmt_bytes(budget),
            self.plans_built
        );
        // Jobs of several ranks: the mesh first, the peak the heaviest rank's.
        let mesh = |s: String| match self.ranks > 1 {
            true => format!(" {s:>18}"),
            false => String::new(),
        };
        let _ = writeln!(
            o,
            "  {:>2}{} {:>13} {:>10} {:<34} {:>5} {:>6} {:>10} {:>9} {:>9} {:>8}",
            "#",
            mesh("tp x pp x dp, zero".into()),
            "batch x accum",
            "recompute",
            "offload",
            "prec",
            "optim",
            match self.ranks > 1 {
                true => format!("{} peak*", self.compute.describe()),
                false => format!("{} peak", self.compute.describe()),
            },
            "s/step",
            "tokens/s",
            "bound"
        );
        for (i, k) in self.ranked.iter().enumerate() {
            let c = &k.cfg;
            let _ = writeln!(
                o,
                "  {:>2}{} {:>13} {:>10} {:<34} {:>5} {:>6} {:>10} {:>9.2} {:>9.1} {:>8}",
                i + 1,
                mesh(mesh_shape(c)),
                format!("{} x {}", c.batch, c.grad_accum),
                c.recompute.to_string(),
                c.offload.set.to_string(),
                c.precision.to_string(),
                c.optim_state.to_string(),
                fmt_bytes(k.peak),
                k.time.step_s,
                k.tokens_per_s(),
                format!("{:?}", k.time.bound).to_lowercase()
            );
        }
        if self.ranks > 1 {
            let _ = writeln!(
                o,
                "  * the heaviest rank's; s/step the slowest rank's (batch: each data rank's micro-batch)"
            );
        }
        // The groups nearest the budget (a mesh search rejects dozens).
        let mut rejected: Vec<&Rejected> = self.rejected.iter().collect();
        rejected.sort_by_key(|r| r.smallest_peak);
        for r in rejected.iter().take(Self::KEEP) {
            let _ = writeln!(
                o,
                "  does not fit: {} (its smallest plan needs {})",
                r.what,
                fmt_bytes(r.smallest_peak)
            );
        }
        if rejected.len() > Self::KEEP {
            let _ = writeln!(
                o,
                "  and {} more groups that need more (plan.json's fit.not_fitting lists them)",
                rejected.len() - Self::KEEP
            );
        }
        if let Some((dir, free)) = &self.disk {
            let _ = writeln!(
                o,
                "  offload files limited to the {} free at {} (--offload-dir)",
                fmt_bytes(*free),
                dir.display()
            );
        }
        if self.skipped > 0 {
            let _ = writeln!(
                o,
                "  {} more micro-batch/precision groups not searched: even unconstrained they are slower than these",
                self.skipped
            );
        }
        o
    }
}

/// The recomputation policies in order of recomputed FLOPs (memory falls along it): none,
/// selective, every:K from K = 2 up (a ladder, not every K), full.
fn policies(pick: Pick<Recompute>, n_layer: usize) -> Vec<Recompute> {
    match pick {
        Pick::Fixed(r) => vec![r],
        Pick::Auto => {
            // every:K for K up to 6, then about a third apart: memory between every:K and
            // every:K+1 differs by one block's activations over L/K(K+1) blocks.
            let mut v = vec![Recompute::None, Recompute::Selective];
            let mut k = 2;
            while k <= n_layer {
                v.push(Recompute::Every(k));
                k = if k < 6 {
                    k + 1
                } else {
                    (k * 4 / 3).next_multiple_of(2)
                };
            }
            v.push(Recompute::Full);
            v
        }
    }
}

/// Indices into `policies` of a coarse ladder up the order: selective, every:2, every:4,
/// every:8, …, full (all of them for a fixed policy).
fn coarse(policies: &[Recompute]) -> Vec<usize> {
    policies
        .iter()
        .enumerate()
        .filter(|(_, r)| match r {
            Recompute::Every(k) => k.is_power_of_two(),
            _ => true,
        })
        .map(|(i, _)| i)
        .collect()
}

/// Whether placement `a` offloads a subset of what `b` does.
fn subset(a: OffloadSet, b: OffloadSet) -> bool {
    (!a.optimizer || b.optimizer)
        && (!a.params || b.params)
        && (!a.grads || b.grads)
        && (!a.activations || b.activations)
}

/// Sequence parallelism to try on a mesh of `tensor` ranks with micro-batches of `rows` token
/// rows: as given (on, only where there are tensor ranks), or both ways where there are
/// tensor ranks and they divide the rows, else off.
fn sequence_options(space: &Space, tensor: usize, rows: usize) -> impl Iterator<Item = bool> {
    let can = tensor > 1 && rows.is_multiple_of(tensor);
    let options: &[bool] = match space.sequence_parallel {
        Pick::Fixed(true) if tensor > 1 => &[true],
        Pick::Fixed(true) => &[],
        Pick::Auto if can => &[false, true],
        _ => &[false],
    };
    options.iter().copied()
}

/// Each pipeline configuration of `configs` again, its layers cut by predicted time
/// ([`super::stage_cut::balanced`], priced at recomputation `least` and one micro-batch),
/// where that cut is not the even one: a stage holding the embedding or the head takes fewer
/// layers.
fn balanced_cuts(
    spec: &ModelSpec,
    configs: &[StepConfig],
    least: Recompute,
    cal: &Calibration,
    backend: &(dyn Sizing + Sync),
) -> Result<Vec<StepConfig>> {
    let cut = |cfg: &StepConfig| -> Result<Option<StepConfig>> {
        let mut one = cfg.clone();
        (one.grad_accum, one.recompute) = (1, least);
        let b = super::stage_cut::balanced(spec, &one, cal, None, 0, backend)?;
        let even = crate::ir::mesh::even_layers(spec.n_layer, cfg.mesh.pipeline);
        Ok((b.counts != even).then(|| StepConfig {
            stage_layers: b.counts,
            ..cfg.clone()
        }))
    };
    let cuts = (configs.par_iter())
        .filter(|c| c.mesh.pipeline > 1 && c.stage_layers.is_empty() && c.pipeline_chunks <= 1)
        .map(cut)
        .collect::<Result<Vec<_>>>()?;
    Ok(cuts.into_iter().flatten().collect())
}

/// The `--pp-chunks` values tried for `cfg`: 1 without a pipeline; as given; else 1 and 2
/// where the interleaved schedule can run (an even cut into twice the stages' runs, the
/// micro-batches in whole groups of the stages: `build::check_interleaved`).
fn chunk_options(spec: &ModelSpec, space: &Space, cfg: &StepConfig) -> Vec<usize> {
    let p = cfg.mesh.pipeline;
    match (p > 1, &space.pipeline_chunks) {
        (false, _) => vec![1],
        (true, Pick::Fixed(v)) => vec![*v],
        (true, Pick::Auto) => {
            let fits = 2 * p <= spec.n_layer
                && cfg.grad_accum.is_multiple_of(p)
                && cfg.stage_layers.is_empty();
            if fits { vec![1, 2] } else { vec![1] }
        }
    }
}

fn count(o: OffloadSet) -> usize {
    [o.optimizer, o.params, o.grads, o.activations]
        .iter()
        .filter(|&&x| x)
        .count()
}

/// One group of the space: a precision, a state format and a micro-batch, with a lower
/// bound of its step time.
struct Group {
    bound: f64,
    cfg: StepConfig,
}

/// What searching one group found.
struct GroupResult {
    fitting: Vec<Candidate>,
    /// The smallest peak among the plans built (for the refusal when nothing fits).
    smallest: u64,
    built: usize,
    /// A plan within the budget was refused for its offload file alone.
    disk_refused: bool,
    /// A plan was refused for its host RAM beneath a GPU (`--max-host-memory`).
    host_refused: bool,
}

/// Searches `space` for the fastest plans of `spec` that fit `budget` (bytes of peak
/// resident memory, with the process `baseline`), timed with `cal`.
pub fn search(
    spec: &ModelSpec,
    space: &Space,
    budget: u64,
    baseline: u64,
    cal: &Calibration,
    backend: &(dyn Sizing + Sync),
) -> Result<Found> {
    if space.global_batch == 0 {
        bail!("--global-batch must be at least 1");
    }
    if space.update == crate::ir::Update::InBackward && space.ranks > 1 {
        bail!(
            "--fit with --update in-backward over {} ranks: the update inside the backward runs \
             on one process for now; use --update end",
            space.ranks
        );
    }
    let shapes = meshes(
        spec,
        space.ranks,
        (
            space.tensor.fixed(),
            space.pipeline.fixed(),
            space.zero.fixed(),
        ),
    )?;
    if let Some(b) = space.micro_batch
        && shapes.len() == 1
        && space.global_batch.is_multiple_of(shapes[0].0.data)
        && (b == 0 || !(space.global_batch / shapes[0].0.data).is_multiple_of(b))
    {
        bail!(
            "--batch {b} does not divide --global-batch {}: the micro-batch times the accumulation must make the global batch",
            space.global_batch
        );
    }
    let mut placements = space.offload.options(&OffloadSet::every());
    if space.update == crate::ir::Update::InBackward {
        placements.retain(|o| !o.any());
    }
    placements.sort_by_key(|&o| count(o));
    let policies = policies(space.recompute, spec.n_layer);
    // The offload file must fit the disk of --offload-dir as the plan must fit the budget.
    let disk_free = match &space.offload_dir {
        Some(dir) if placements.iter().any(|&o| o != OffloadSet::NONE) => {
            Some(crate::mem::disk::free_bytes_for(dir)?)
        }
        _ => None,
    };
    // Groups: a mesh shape (one process's alone for one rank), precision, state format and
    // micro-batch, each data rank taking an equal part of the global batch.
    let mut configs = Vec::new();
    let mut refused = Vec::new();
    for &(mesh, zero) in &shapes {
        let shape = StepConfig {
            mesh,
            zero,
            ..StepConfig::new(1, space.seq, space.threads)
        };
        if !space.global_batch.is_multiple_of(mesh.data) {
            refused.push(format!(
                "{}: --global-batch {} does not split over {} data ranks",
                mesh_flags(&shape),
                space.global_batch,
                mesh.data
            ));
            continue;
        }
        let per_rank = space.global_batch / mesh.data;
        let micro: Vec<usize> = match space.micro_batch {
            Some(b) if b > 0 && per_rank.is_multiple_of(b) => vec![b],
            Some(_) => continue,
            // Micro-batches that divide the rank's part, in no more steps than a plan takes.
            None => (1..=per_rank)
                .filter(|&b| per_rank.is_multiple_of(b))
                .filter(|&b| per_rank / b <= super::build::MAX_GRAD_ACCUM)
                .collect(),
        };
        for &precision in
            &space
                .precision
                .options(&[Precision::F32, Precision::Bf16, Precision::F16])
        {
            if precision == Precision::F16 && space.update == crate::ir::Update::InBackward {
                continue;
            }
            for &state in
                &space
                    .optim_state
                    .options(&[OptimState::F32, OptimState::Bf16, OptimState::Int8])
            {
                for (&b, sequence) in (micro.iter()).flat_map(|b| {
                    sequence_options(space, mesh.tensor, b * space.seq).map(move |s| (b, s))
                }) {
                    let mut cfg = StepConfig::new(b, space.seq, space.threads);
                    cfg.sequence_parallel = sequence;
                    cfg.grad_accum = per_rank / b;
                    cfg.precision = precision;
                    cfg.optim_state = state;
                    cfg.offload.dir = space.offload_dir.clone();
                    cfg.lora = space.lora.clone();
                    cfg.base_quant = space.base_quant;
                    cfg.base_types = space.base_types.clone();
                    cfg.distill = space.distill;
                    cfg.update = space.update;
                    cfg.mesh = mesh;
                    cfg.zero = zero;
                    if let Pick::Fixed(cut) = &space.stage_layers {
                        cfg.stage_layers = cut.clone();
                    }
                    for chunks in chunk_options(spec, space, &cfg) {
                        let mut cfg = cfg.clone();
                        cfg.pipeline_chunks = chunks;
                        // What the mesh does not compose with (int8 moments, a quantized base
                        // under --tp, …) leaves the group out.
                        if mesh.world() > 1
                            && let Err(e) = check_mesh(spec, &cfg, Mode::Train)
                        {
                            refused.push(format!("{}: {e}", mesh_flags(&cfg)));
                            continue;
                        }
                        configs.push(cfg);
                    }
                }
            }
        }
    }
    if space.stage_layers == Pick::Auto {
        configs.extend(balanced_cuts(spec, &configs, policies[0], cal, backend)?);
    }
    if configs.is_empty() {
        refused.dedup();
        bail!(
            "--fit: no mesh shape of the {} ranks can run this step: {}",
            space.ranks,
            refused.join("; ")
        );
    }
    // Each group's lower bound of its time: its unconstrained plan (least recomputation,
    // least offload) with the fewest micro-batches, their part repeated; on a mesh, rank
    // 0's (the slowest rank is no faster).
    let mut groups = configs
        .into_par_iter()
        .map(|cfg| -> Result<Group> {
            let mut one = cfg.clone();
            // The fewest micro-batches the schedule runs: one, or a group of the stages for
            // the interleaved one.
            one.grad_accum = match cfg.pipeline_chunks > 1 {
                true => cfg.mesh.pipeline,
                false => 1,
            };
            one.recompute = policies[0];
            one.offload.set = placements[0];
            let t = predict(&build(spec, &one, Mode::Train, backend, Verify::No)?, cal);
            let k = cfg.grad_accum as f64 / one.grad_accum as f64;
            // The pipeline's bubble is (p − 1) micro-batches' work whatever their number.
            Ok(Group {
                bound: k * (t.step_s - t.once_s() - t.bubble_s).max(0.0) + t.bubble_s + t.once_s(),
                cfg,
            })
        })
        .collect::<Result<Vec<Group>>>()?;
    let mut built = groups.len();
    groups.sort_by(|a, b| a.bound.total_cmp(&b.bound));
    let mut ranked: Vec<Candidate> = Vec::new();
    let mut rejected = Vec::new();
    let mut skipped = 0;
    let (mut disk_refused, mut host_refused) = (false, false);
    // Groups are searched fastest bound first, as many at once as there are threads.
    let width = rayon::current_num_threads().max(1);
    let mut rest = &groups[..];
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(width.min(rest.len()));
        rest = tail;
        let beaten = |g: &Group| {
            ranked.len() >= Found::KEEP && ranked[Found::KEEP - 1].time.step_s <= g.bound
        };
        let todo: Vec<&Group> = chunk.iter().filter(|g| !beaten(g)).collect();
        skipped += chunk.len() - todo.len();
        let results = todo
            .par_iter()
            .map(|g| {
                search_group(
                    spec,
                    &g.cfg,
                    &placements,
                    &policies,
                    (budget, disk_free, space.host_budget),
                    baseline,
                    cal,
                    backend,
                )
            })
            .collect::<Result<Vec<GroupResult>>>()?;
        for (g, r) in todo.iter().zip(results) {
            built += r.built;
            disk_refused |= r.disk_refused;
            host_refused |= r.host_refused;
            if r.fitting.is_empty() {
                let mesh = match g.cfg.mesh.world() > 1 {
                    true => format!("{} ", mesh_flags(&g.cfg)),
                    false => String::new(),
                };
                rejected.push(Rejected {
                    what: format!(
                        "{mesh}--batch {} --grad-accum {} --precision {} --optim-state {}",
                        g.cfg.batch, g.cfg.grad_accum, g.cfg.precision, g.cfg.optim_state
                    ),
                    smallest_peak: r.smallest,
                });
            }
            ranked.extend(r.fitting);
        }
        ranked.sort_by(|a, b| a.time.step_s.total_cmp(&b.time.step_s));
        ranked.truncate(Found::KEEP);
    }
    let (ranked, rebuilt) = exact(spec, ranked, budget, baseline, cal, backend)?;
    built += rebuilt;
    Ok(Found {
        compute: backend.tiers()[0],
        ranks: space.ranks,
        ranked,
        rejected,
        skipped,
        plans_built: built,
        disk: space
            .offload_dir
            .clone()
            .zip(disk_free)
            .filter(|_| disk_refused),
        host: space.host_budget.filter(|_| host_refused),
        in_backward: space.update == crate::ir::Update::InBackward,
    })
}

/// The time of a step of `k` micro-batches from that of `built` (1 or 2): the update once,
/// the rest `k / built` times (an estimate; [`exact`] replaces it for the plans kept).
fn repeat_micro_batches(t: StepTime, built: usize, k: usize) -> StepTime {
    if built == k {
        return t;
    }
    let f = k as f64 / built as f64;
    let scale = |x: f64| x * f;
    StepTime {
        // A stage's idle time is (p − 1) micro-batches' work, whatever their number.
        step_s: t.once_s() + (t.step_s - t.once_s() - t.bubble_s).max(0.0) * f + t.bubble_s,
        compute_s: t.update_s + (t.compute_s - t.update_s) * f,
        io_s: scale(t.io_s),
        stall_s: scale(t.stall_s),
        by_kind: t.by_kind.into_iter().map(|(k, s)| (k, scale(s))).collect(),
        ..t
    }
}

/// Rebuilds the kept candidates with their own accumulation, for their exact peak and
/// time; drops any that then exceeds `budget` (by its extra micro-batches' token buffers).
fn exact(
    spec: &ModelSpec,
    ranked: Vec<Candidate>,
    budget: u64,
    baseline: u64,
    cal: &Calibration,
    backend: &(dyn Sizing + Sync),
) -> Result<(Vec<Candidate>, usize)> {
    let rebuilt = ranked
        .into_par_iter()
        .map(|k| -> Result<(Candidate, usize)> {
            if micro_batches_built(&k.cfg.mesh, k.cfg.grad_accum) == k.cfg.grad_accum {
                return Ok((k, 0));
            }
            let built = Built::new(spec, &k.cfg, backend)?;
            Ok((
                Candidate {
                    peak: built.peak(baseline),
                    time: built.time(cal),
                    cfg: k.cfg,
                },
                built.count(),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let built = rebuilt.iter().map(|r| r.1).sum();
    let mut kept: Vec<Candidate> = rebuilt
        .into_iter()
        .map(|r| r.0)
        .filter(|k| k.peak <= budget)
        .collect();
    kept.sort_by(|a, b| a.time.step_s.total_cmp(&b.time.step_s));
    Ok((kept, built))
}

/// For each placement (fewest parts first), the least recomputation that fits, where it is
/// less than every smaller placement's: the candidates of one group.
#[allow(clippy::too_many_arguments)]
fn search_group(
    spec: &ModelSpec,
    cfg: &StepConfig,
    placements: &[OffloadSet],
    policies: &[Recompute],
    (budget, disk_free, host): (u64, Option<u64>, Option<u64>),
    baseline: u64,
    cal: &Calibration,
    backend: &(dyn Sizing + Sync),
) -> Result<GroupResult> {
    let compute = backend.tiers()[0];
    let budgets = Budgets::new(compute, Some(budget), disk_free).with_host(compute, host);
    let mut out = GroupResult {
        fitting: Vec::new(),
        smallest: u64::MAX,
        built: 0,
        disk_refused: false,
        host_refused: false,
    };
    // For each placement that fits: the index of the least recomputation that does.
    let mut least: Vec<(OffloadSet, usize)> = Vec::new();
    for &o in placements {
        // Less recomputation than every smaller placement's least is needed to be faster.
        let cap = least
            .iter()
            .filter(|(s, _)| subset(*s, o))
            .map(|&(_, i)| i)
            .min()
            .unwrap_or(policies.len());
        if cap == 0 {
            continue;
        }
        // Where offloading is the search's choice, a mesh of several ranks offloads
        // nothing: its ranks shard the state instead (and the search stays short); a
        // placement given by --offload is every mesh's.
        if cfg.mesh.world() > 1 && o != OffloadSet::NONE && placements.contains(&OffloadSet::NONE) {
            continue;
        }
        let mut placed = cfg.clone();
        placed.offload.set = o;
        let mut fits_at = |i: usize| -> Result<(bool, Built)> {
            let mut c = placed.clone();
            c.recompute = policies[i];
            // Micro-batches after the second (a pipeline's first stage: the p-th) repeat its
            // buffers and ops: the search builds that many (fast), and `exact` rebuilds the
            // plans it keeps.
            c.grad_accum = micro_batches_built(&c.mesh, c.grad_accum);
            let plans = Built::new(spec, &c, backend)?;
            out.built += plans.count();
            out.smallest = out.smallest.min(plans.peak(baseline));
            // Every tier within its budget on every rank: the compute tier's, then the pinned
            // RAM's beneath a GPU, or the disk's.
            let over = plans.over_budget(baseline, &budgets);
            out.disk_refused |= over.as_ref().is_some_and(|u| u.tier == Tier::Nvme);
            out.host_refused |=
                over.as_ref().is_some_and(|u| u.tier == Tier::Host) && compute != Tier::Host;
            Ok((over.is_none(), plans))
        };
        // The most recomputation allowed must fit, else nothing does with this placement.
        let (ok, plan) = fits_at(cap - 1)?;
        if !ok {
            continue;
        }
        // Bisect for the least recomputation that fits: fits(hi) holds, fits(lo - 1) not.
        let (mut lo, mut hi, mut best) = (0usize, cap - 1, plan);
        while lo < hi {
            let mid = (lo + hi) / 2;
            let (ok, plan) = fits_at(mid)?;
            if ok {
                (hi, best) = (mid, plan);
            } else {
                lo = mid + 1;
            }
        }
        least.push((o, hi));
        let mut time = best.time(cal);
        if o.activations && time.stall_s > 0.01 * time.step_s {
            // With activations on disk, recomputing more moves fewer bytes: a step that waits
            // for the disk can be faster with more recomputation. Try a few steps up the order.
            for i in coarse(policies).into_iter().filter(|&i| hi < i && i < cap) {
                let (ok, plans) = fits_at(i)?;
                let t = plans.time(cal);
                if ok && t.step_s < time.step_s {
                    (best, time) = (plans, t);
                }
            }
        }
        let mut cfg_k = best.cfg().clone();
        cfg_k.grad_accum = cfg.grad_accum;
        out.fitting.push(Candidate {
            cfg: cfg_k,
            peak: best.peak(baseline),
            time: repeat_micro_batches(time, best.cfg().grad_accum, cfg.grad_accum),
        });
    }
    Ok(out)
}

/// What `--fit` chose: the search, its record for plan.json, and the fastest candidate's
/// configuration (`found.ranked[0]`).
pub struct Fitted {
    pub found: Found,
    pub record: serde_json::Value,
    pub cfg: StepConfig,
}

/// `--fit`: searches `space` and keeps the fastest plan that fits `budget`; refuses with the
/// smallest plan when nothing does.
pub fn fit(
    spec: &ModelSpec,
    space: &Space,
    budget: u64,
    baseline: u64,
    cal: &Calibration,
    backend: &(dyn Sizing + Sync),
) -> Result<Fitted> {
    let t0 = std::time::Instant::now();
    let found = search(spec, space, budget, baseline, cal, backend)?;
    let search_s = t0.elapsed().as_secs_f64();
    let Some(best) = found.ranked.first() else {
        return Err(nothing_fits(&found, budget));
    };
    Ok(Fitted {
        cfg: best.cfg.clone(),
        record: found.record(space, budget, cal, search_s),
        found,
    })
}

/// The refusal when nothing fits: the smallest plan's peak, and what it was.
pub fn nothing_fits(found: &Found, budget: u64) -> anyhow::Error {
    let searched = match found.in_backward {
        true => {
            "the most recomputation searched; with --update in-backward nothing is offloaded, which --update end may"
        }
        false => "the most recomputation and offload searched",
    };
    let smallest = found.rejected.iter().min_by_key(|r| r.smallest_peak);
    let disk = match &found.disk {
        Some((dir, free)) => format!(
            " (offload files must also fit the {} free at --offload-dir {}: free space there, or point it at a larger disk)",
            fmt_bytes(*free),
            dir.display()
        ),
        None => String::new(),
    };
    let disk = match found.host {
        Some(host) => format!(
            "{disk} (what --offload keeps in host RAM must also fit --max-host-memory {}: give \
             more, or offload less)",
            fmt_bytes(host)
        ),
        None => disk,
    };
    match smallest {
        Some(r) if r.smallest_peak > budget => anyhow::anyhow!(
            "--fit: nothing fits --max-memory {}: the smallest plan ({} with {searched}) needs {}; raise --max-memory, or allow --precision auto --optim-state auto{disk}",
            fmt_bytes(budget),
            r.what,
            fmt_bytes(r.smallest_peak)
        ),
        _ => anyhow::anyhow!(
            "--fit: nothing fits --max-memory {}{disk}",
            fmt_bytes(budget)
        ),
    }
}
