//! The strategies a run asks for, and budget checks: does a plan fit `--max-memory`, and if
//! not, what would.

use super::search::{Pick, Space, search};
use super::stage_cut::StageCut;
use super::time::Calibration;
use super::{Mode, OffloadChoice, OffloadSet, Plan, StepConfig, build_plan};
use crate::dtype::GgmlType;
use crate::ir::Sizing;
use crate::ir::shard::Zero;
use crate::ir::{BaseQuant, Tier};
use crate::ir::{OptimState, Precision, Recompute, RecomputeChoice, Update};
use crate::model::ModelSpec;
use crate::model::lora::LoraSpec;
use crate::util::bytes::fmt_bytes;
use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// The memory strategies of a run — the plan transformations `plan`, `train` and `bench`
/// share — and the budget they must fit (saved flattened into a run's options).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Strategies {
    /// Activation recomputation policy (`auto` is resolved against `max_memory`).
    #[serde(default)]
    pub recompute: RecomputeChoice,
    /// Micro-batches per optimizer step (`batch` is the micro-batch).
    #[serde(default = "one")]
    pub grad_accum: usize,
    /// Storage of the AdamW moments.
    #[serde(default)]
    pub optim_state: OptimState,
    /// Format of compute weights, activations and gradients.
    #[serde(default)]
    pub precision: Precision,
    /// Refuse plans whose predicted peak exceeds this many bytes.
    #[serde(default)]
    pub max_memory: Option<u64>,
    /// The budget of pinned host RAM beneath a GPU (`--max-host-memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_host_memory: Option<u64>,
    /// What lives on the disk tier between uses (`--offload`; `auto` is resolved against
    /// `max_memory`).
    #[serde(default)]
    pub offload: OffloadChoice,
    /// Directory of the disk tier's file (`--offload-dir`; train's default: `offload/` in
    /// the run directory, bench's: `memwall-offload/` in the current directory).
    #[serde(default)]
    pub offload_dir: Option<std::path::PathBuf>,
    /// Processes training together (`mpirun -np N`; `plan --ranks N` on paper).
    #[serde(default = "one")]
    pub ranks: usize,
    /// Ranks holding the parts of one copy of the model (`--tp`, tensor parallelism); the
    /// `ranks / tensor` copies split the batch.
    #[serde(default = "one")]
    pub tensor: usize,
    /// Sequence parallelism on the tensor axis (`--sequence-parallel`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sequence_parallel: bool,
    /// Pipeline stages, each holding consecutive layers (`--pp`, pipeline parallelism); the
    /// `ranks / (tensor · pipeline)` copies split the batch.
    #[serde(default = "one")]
    pub pipeline: usize,
    /// How the layers are cut into the `pipeline` stages (`--pp-layers`; `auto` is resolved
    /// into each stage's count before a run's options are saved: [`StageCut`]).
    #[serde(default, skip_serializing_if = "is_even")]
    pub pipeline_layers: StageCut,
    /// Runs of layers each stage holds (`--pp-chunks`): more than 1 for the interleaved
    /// schedule.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pipeline_chunks: usize,
    /// What each rank keeps of the model's state (`--zero`).
    #[serde(default)]
    pub zero: Zero,
    /// This process's rank (not saved: every rank's options are the same).
    #[serde(skip)]
    pub rank: usize,
    /// LoRA adapters on a frozen base (`--lora`), or `None` to train every weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSpec>,
    /// How a LoRA run keeps its frozen base (`--base-quant`).
    #[serde(default, skip_serializing_if = "is_f32")]
    pub base_quant: BaseQuant,
    /// `--base-quant keep`: the storage of each base tensor, read from the GGUF `--init`
    /// (read again on resume, not saved).
    #[serde(skip)]
    pub base_types: Option<std::sync::Arc<crate::ir::BaseTypes>>,
    /// Rows pack several examples ([`StepConfig::packed`]): set by the trainer from its data
    /// (an examples data set, unless `--no-pack`), not saved.
    #[serde(skip)]
    pub packed: bool,
    /// Distillation's loss at the head (`train --distill-from`): the teacher's width and
    /// the KL's weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distill: Option<crate::plan::config::Distill>,
    /// When each group's AdamW step runs (`--update`).
    #[serde(default, skip_serializing_if = "is_end")]
    pub update: Update,
}

fn is_end(u: &Update) -> bool {
    *u == Update::End
}

fn is_f32(q: &BaseQuant) -> bool {
    *q == BaseQuant::F32
}

fn is_even(c: &StageCut) -> bool {
    *c == StageCut::Even
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl Default for Strategies {
    fn default() -> Self {
        Strategies {
            recompute: RecomputeChoice::default(),
            grad_accum: 1,
            optim_state: OptimState::default(),
            precision: Precision::default(),
            max_memory: None,
            max_host_memory: None,
            offload: OffloadChoice::default(),
            offload_dir: None,
            ranks: 1,
            tensor: 1,
            sequence_parallel: false,
            pipeline: 1,
            pipeline_layers: StageCut::Even,
            pipeline_chunks: 1,
            zero: Zero::DP,
            rank: 0,
            lora: None,
            base_quant: BaseQuant::F32,
            base_types: None,
            packed: false,
            distill: None,
            update: Update::End,
        }
    }
}

impl Strategies {
    /// The copies of the model that split the batch: the ranks of the data axis.
    pub fn data_ranks(&self) -> usize {
        self.ranks / (self.tensor.max(1) * self.pipeline.max(1))
    }

    /// Checks `--tp` and `--pp` against the ranks, naming them.
    pub fn check_mesh(&self) -> anyhow::Result<()> {
        let (t, p, n) = (self.tensor, self.pipeline, self.ranks);
        if t == 0 {
            anyhow::bail!("--tp must be at least 1 (ranks holding the parts of each layer)");
        }
        if p == 0 {
            anyhow::bail!("--pp must be at least 1 (pipeline stages, each holding some layers)");
        }
        if n == 1 && t * p > 1 {
            anyhow::bail!(
                "--tp {t} --pp {p} splits the model among {} processes: start them with \
                 `mpirun -np {} memwall train ...` (a build with --features mpi), or see one \
                 rank's plan with `memwall plan --ranks {} ...`",
                t * p,
                t * p,
                t * p
            );
        }
        if p > 1 && n % (t * p) != 0 {
            anyhow::bail!(
                "--tp {t} × --pp {p} = {} does not divide the {n} ranks (mpirun -np {n}, or \
                 plan --ranks {n}): each {} ranks hold one copy of the model, {p} stages of {t}; \
                 use {} ranks, or a --tp and --pp whose product divides {n}",
                t * p,
                t * p,
                n.div_ceil(t * p) * t * p
            );
        }
        if n % t != 0 {
            anyhow::bail!(
                "--tp {t} does not divide the {n} ranks (mpirun -np {n}, or plan --ranks {n}): \
                 each group of {t} ranks holds one copy of the model; use a --tp that divides \
                 {n}, or {} ranks",
                n.div_ceil(t) * t
            );
        }
        Ok(())
    }

    /// The step configuration of a `batch` × `seq` micro-batch on `threads` (recomputation
    /// left at none and nothing offloaded under `auto`: [`Strategies::plan`] resolves them).
    pub fn step_config(&self, batch: usize, seq: usize, threads: usize) -> StepConfig {
        let mut cfg = StepConfig::new(batch, seq, threads);
        cfg.grad_accum = self.grad_accum;
        cfg.optim_state = self.optim_state;
        cfg.precision = self.precision;
        if let OffloadChoice::Set(set) = self.offload {
            cfg.offload.set = set;
        }
        cfg.offload.dir = self
            .offload_dir
            .clone()
            .filter(|_| self.offload.may_offload());
        cfg.mesh = crate::ir::Mesh::new(self.ranks, self.tensor, self.pipeline, self.rank);
        debug_assert!(
            self.pipeline_layers != StageCut::Auto,
            "resolved before planning"
        );
        if let StageCut::Layers(c) = &self.pipeline_layers {
            cfg.stage_layers = c.clone();
        }
        cfg.zero = self.zero;
        cfg.sequence_parallel = self.sequence_parallel;
        cfg.pipeline_chunks = self.pipeline_chunks;
        cfg.lora = self.lora.clone();
        cfg.packed = self.packed;
        cfg.base_quant = self.base_quant;
        cfg.base_types = self.base_types.clone();
        cfg.distill = self.distill;
        cfg.update = self.update;
        cfg
    }

    /// The strategies of configuration `cfg` (a `--fit` choice) under `budget`.
    pub fn chosen(
        cfg: &StepConfig,
        budget: u64,
        offload_dir: Option<std::path::PathBuf>,
    ) -> Strategies {
        Strategies {
            recompute: RecomputeChoice::Fixed(cfg.recompute),
            grad_accum: cfg.grad_accum,
            optim_state: cfg.optim_state,
            precision: cfg.precision,
            max_memory: Some(budget),
            max_host_memory: None,
            offload: OffloadChoice::Set(cfg.offload.set),
            offload_dir,
            ranks: cfg.mesh.world(),
            tensor: cfg.mesh.tensor,
            sequence_parallel: cfg.sequence_parallel,
            pipeline: cfg.mesh.pipeline,
            pipeline_layers: match cfg.stage_layers.is_empty() {
                true => StageCut::Even,
                false => StageCut::Layers(cfg.stage_layers.clone()),
            },
            pipeline_chunks: cfg.pipeline_chunks,
            zero: cfg.zero,
            rank: cfg.mesh.rank,
            lora: cfg.lora.clone(),
            base_quant: cfg.base_quant,
            base_types: cfg.base_types.clone(),
            packed: cfg.packed,
            distill: cfg.distill,
            update: cfg.update,
        }
    }

    /// With `--offload` and no `--offload-dir`: `default` as the directory (the disk tier
    /// creates it when the plan starts).
    pub fn with_offload_dir(&self, default: &std::path::Path) -> Strategies {
        let mut s = self.clone();
        if s.offload.may_offload() && s.offload_dir.is_none() {
            s.offload_dir = Some(default.to_path_buf());
        }
        s
    }

    /// The training-step plan: [`plan_fitting`] of [`Strategies::step_config`] (`auto`
    /// choices timed with `cal`).
    pub fn plan(
        &self,
        spec: &ModelSpec,
        (batch, seq, threads): (usize, usize, usize),
        baseline: u64,
        cal: &Calibration,
        backend: &(dyn Sizing + Sync),
    ) -> Result<Plan> {
        let cfg = self.step_config(batch, seq, threads);
        plan_fitting(
            spec,
            &cfg,
            Mode::Train,
            (self.recompute, self.offload),
            (self.max_memory, self.max_host_memory, baseline),
            cal,
            backend,
        )
    }
}

/// Refuses a GPU plan whose pinned host tier exceeds `budget` (`--max-host-memory`), naming
/// the flag; a plan computing in host RAM has no such tier (its budget is `--max-memory`).
pub fn check_host_budget(plan: &Plan, budget: Option<u64>) -> Result<()> {
    let Some(budget) = budget.filter(|_| plan.compute_tier() != Tier::Host) else {
        return Ok(());
    };
    let peak = plan.tier_peak(Tier::Host, 0);
    if peak > budget {
        bail!(
            "the plan keeps {} in host RAM ({} of it pinned for offloaded state, the rest the \
             loader's buffers) but --max-host-memory is {}: offload less (--offload names what \
             lives there; --optim-state int8 or bf16 shrinks the moments), or give more",
            fmt_bytes(peak),
            fmt_bytes(plan.tier_bytes(Tier::Host)),
            fmt_bytes(budget)
        );
    }
    Ok(())
}

/// Predicted peak resident memory of a process running `plan`: the plan's bytes, the
/// measured process baseline and the runtime reserve ([`Plan::runtime_reserve`]).
pub fn predicted_peak(plan: &Plan, baseline: u64) -> u64 {
    plan.predicted_peak(baseline)
}

/// The largest micro-batch (at the same sequence length) whose plan fits `budget`, with its
/// predicted peak; `None` when even batch 1 does not fit.
pub fn largest_batch(
    spec: &ModelSpec,
    cfg: &StepConfig,
    mode: Mode,
    budget: u64,
    baseline: u64,
    backend: &dyn Sizing,
) -> Result<Option<(usize, u64)>> {
    let peak = |b: usize| -> Result<u64> {
        let c = StepConfig {
            batch: b,
            ..cfg.clone()
        };
        Ok(predicted_peak(
            &build_plan(spec, &c, mode, backend)?,
            baseline,
        ))
    };
    let p1 = peak(1)?;
    if p1 > budget {
        return Ok(None);
    }
    // Peak grows with batch: binary search the largest b with peak(b) <= budget.
    let (mut lo, mut lo_peak, mut hi) = (1usize, p1, 2usize);
    loop {
        let p = peak(hi)?;
        if p > budget {
            break;
        }
        (lo, lo_peak) = (hi, p);
        if hi >= 1 << 16 {
            return Ok(Some((lo, lo_peak)));
        }
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        let p = peak(mid)?;
        if p <= budget {
            (lo, lo_peak) = (mid, p);
        } else {
            hi = mid;
        }
    }
    Ok(Some((lo, lo_peak)))
}

/// Builds the plan of `cfg` with the recomputation policy and offload placement `choice`,
/// refusing it when it does not fit `budget` (with the process `baseline`) or, beneath a GPU,
/// `host_budget` (`--max-host-memory`). Where either is
/// `auto`, the fastest candidate that fits by predicted step time (timed with `cal`) is kept:
/// [`super::search`] with the micro-batch, accumulation, precision and optimizer state fixed.
pub fn plan_fitting(
    spec: &ModelSpec,
    cfg: &StepConfig,
    mode: Mode,
    (recompute, offload): (RecomputeChoice, OffloadChoice),
    (budget, host_budget, baseline): (Option<u64>, Option<u64>, u64),
    cal: &Calibration,
    backend: &(dyn Sizing + Sync),
) -> Result<Plan> {
    // A backend with no slower tier offloads nothing: its `--offload auto` is none.
    // Nor does a rank of a model split among ranks choose to (`--tp`, `--pp`: the ranks
    // hold parts of the state already); `--offload` given offloads there too.
    let split = cfg.mesh.tensor > 1 || cfg.mesh.pipeline > 1;
    let offload = match offload {
        OffloadChoice::Auto if split || backend.offload_tier().is_none() => {
            OffloadChoice::Set(OffloadSet::NONE)
        }
        o => o,
    };
    let with = |r: Recompute, o: OffloadSet| {
        let mut c = StepConfig {
            recompute: r,
            ..cfg.clone()
        };
        c.offload.set = o;
        build_plan(spec, &c, mode, backend)
    };
    // A GPU's choices are ranked by its own calibration, never the CPU's costs.
    let auto = recompute == RecomputeChoice::Auto || offload == OffloadChoice::Auto;
    if auto && backend.tiers()[0] != Tier::Host && !cal.gpu {
        let flag = match recompute {
            RecomputeChoice::Auto => "--recompute auto",
            _ => "--offload auto",
        };
        bail!(
            "{flag} with a GPU: it picks the fastest choice by the time model, and there is no \
             GPU calibration here: run `memwall calibrate --device cuda` on the GPU machine (it \
             saves calibration/cuda-<gpu>.json in the user cache; copy that file to plan \
             elsewhere), or give {} yourself",
            flag.trim_end_matches(" auto")
        );
    }
    let budget = match (recompute, offload, budget) {
        (RecomputeChoice::Fixed(r), OffloadChoice::Set(o), budget) => {
            let plan = with(r, o)?;
            if let Some(b) = budget {
                check_budget(&plan, b, baseline, backend)?;
            }
            check_host_budget(&plan, host_budget)?;
            return Ok(plan);
        }
        (RecomputeChoice::Auto, _, None) => bail!(
            "--recompute auto needs --max-memory: it picks the fastest policy whose plan fits that budget"
        ),
        (_, OffloadChoice::Auto, None) => bail!(
            "--offload auto needs --max-memory: it picks the fastest placement whose plan fits that budget"
        ),
        (_, _, Some(b)) => b,
    };
    let space = Space {
        // The mesh as given: each data rank's part is this micro-batch × accumulation.
        global_batch: cfg.batch * cfg.grad_accum * cfg.mesh.data,
        seq: cfg.seq,
        threads: cfg.threads,
        micro_batch: Some(cfg.batch),
        recompute: match recompute {
            RecomputeChoice::Fixed(r) => Pick::Fixed(r),
            RecomputeChoice::Auto => Pick::Auto,
        },
        offload: match offload {
            OffloadChoice::Set(o) => Pick::Fixed(o),
            OffloadChoice::Auto => Pick::Auto,
        },
        precision: Pick::Fixed(cfg.precision),
        optim_state: Pick::Fixed(cfg.optim_state),
        offload_dir: cfg.offload.dir.clone(),
        lora: cfg.lora.clone(),
        base_quant: cfg.base_quant,
        base_types: cfg.base_types.clone(),
        distill: cfg.distill,
        ranks: cfg.mesh.world(),
        tensor: Pick::Fixed(cfg.mesh.tensor),
        pipeline: Pick::Fixed(cfg.mesh.pipeline),
        zero: Pick::Fixed(cfg.zero),
        sequence_parallel: Pick::Fixed(cfg.sequence_parallel),
        stage_layers: Pick::Fixed(cfg.stage_layers.clone()),
        pipeline_chunks: Pick::Fixed(cfg.pipeline_chunks),
        update: cfg.update,
        host_budget,
    };
    let found = search(spec, &space, budget, baseline, cal, backend)?;
    if let Some(best) = found.ranked.first() {
        return with(best.cfg.recompute, best.cfg.offload.set);
    }
    // Nothing fits: name the smallest candidate (the most recomputation, the most offload:
    // none with the update inside the backward, which offloads nothing).
    let most = |r: RecomputeChoice, all: Recompute| match r {
        RecomputeChoice::Fixed(r) => r,
        RecomputeChoice::Auto => all,
    };
    let smallest = with(
        most(recompute, Recompute::Full),
        match (offload, cfg.update) {
            (OffloadChoice::Set(o), _) => o,
            (OffloadChoice::Auto, Update::InBackward) => OffloadSet::NONE,
            (OffloadChoice::Auto, Update::End) => OffloadSet::ALL,
        },
    )?;
    // The smallest plan fits the compute tier: what refused it is host RAM beneath a GPU.
    let err = match check_budget(&smallest, budget, baseline, backend)
        .and_then(|()| check_host_budget(&smallest, host_budget))
    {
        Err(e) => e,
        Ok(()) => anyhow::anyhow!("the smallest plan fits but the search found nothing"),
    };
    let mut what = Vec::new();
    if recompute == RecomputeChoice::Auto {
        what.push(format!("--recompute {}", smallest.cfg.recompute));
    }
    if offload == OffloadChoice::Auto {
        what.push(format!("--offload {}", smallest.cfg.offload.set));
    }
    let auto: Vec<&str> = [
        (recompute == RecomputeChoice::Auto, "--recompute auto"),
        (offload == OffloadChoice::Auto, "--offload auto"),
    ]
    .into_iter()
    .filter(|x| x.0)
    .map(|x| x.1)
    .collect();
    Err(err.context(format!(
        "{}: nothing fits --max-memory {}; the smallest plan is {} with a predicted peak of {}",
        auto.join(" with "),
        fmt_bytes(budget),
        what.join(" "),
        fmt_bytes(predicted_peak(&smallest, baseline))
    )))
}

/// Refuses a plan that does not fit `budget` (the `--max-memory` flag), saying by how much
/// and what would fit.
pub fn check_budget(plan: &Plan, budget: u64, baseline: u64, backend: &dyn Sizing) -> Result<()> {
    let need = predicted_peak(plan, baseline);
    if need <= budget {
        return Ok(());
    }
    let cfg = &plan.cfg;
    let mut advice = match largest_batch(&plan.spec, cfg, plan.mode, budget, baseline, backend)? {
        Some((b, p)) => format!(
            "the largest batch that fits at --seq {} is --batch {b} (predicted {})",
            cfg.seq,
            fmt_bytes(p)
        ),
        None => even_batch_1(plan, budget, baseline, backend)?,
    };
    let can_offload = backend.offload_tier().is_some();
    if plan.mode == Mode::Train && can_offload && cfg.offload.set != OffloadSet::ALL {
        // Offload composes with the update after the backward, but beneath a GPU, where the
        // update then runs on the host's cores.
        let gpu = backend.offload_tier() == Some(Tier::Host);
        let update = match gpu {
            true => cfg.update,
            false => Update::End,
        };
        let mut all = StepConfig {
            recompute: Recompute::Full,
            update,
            ..cfg.clone()
        };
        all.offload.set = OffloadSet::ALL;
        let all = build_plan(&plan.spec, &all, plan.mode, backend)?;
        let p = predicted_peak(&all, baseline);
        // Beneath a GPU, what it offloads goes to host RAM (within --max-host-memory).
        let host = match all.compute_tier() {
            Tier::Host => String::new(),
            _ => format!(" ({} of host RAM)", fmt_bytes(all.tier_peak(Tier::Host, 0))),
        };
        advice.push_str(&format!(
            "; {}--offload all --recompute full needs {}{host}{}",
            match cfg.update != update {
                true => "--update end ",
                false => "",
            },
            fmt_bytes(p),
            if p <= budget {
                " and fits (or let --offload auto choose)"
            } else {
                ""
            }
        ));
    }
    if plan.mode == Mode::Train && cfg.recompute != Recompute::Full {
        let full = build_plan(
            &plan.spec,
            &StepConfig {
                recompute: Recompute::Full,
                ..cfg.clone()
            },
            plan.mode,
            backend,
        )?;
        let p = predicted_peak(&full, baseline);
        if p <= budget {
            advice.push_str(&format!(
                "; or keep --batch {} with --recompute auto (--recompute full needs {})",
                cfg.batch,
                fmt_bytes(p)
            ));
        }
    }
    // On the CPU the owned buffers and the process count in RAM; on a GPU, its context.
    let (outside, base) = baseline_terms(plan);
    bail!(
        "the plan needs {} of {} (arena {}{outside} + {base} {} + runtime reserve {}) but --max-memory is {}: \
         over by {}; {advice}",
        fmt_bytes(need),
        plan.compute_tier().describe(),
        fmt_bytes(plan.arena_bytes()),
        fmt_bytes(baseline),
        fmt_bytes(plan.runtime_reserve()),
        fmt_bytes(budget),
        fmt_bytes(need - budget)
    )
}

/// How the compute tier's peak is made beyond the arena, for messages: the owned buffers (on
/// the CPU, where they count) and the baseline's name.
fn baseline_terms(plan: &Plan) -> (String, &'static str) {
    if plan.compute_tier() == Tier::Host {
        (
            format!(" + outside the arena {}", fmt_bytes(plan.external_bytes)),
            "process baseline",
        )
    } else {
        (String::new(), "device baseline (context)")
    }
}

/// What to say when even `--batch 1` of `plan`'s configuration does not fit `budget`: what
/// its peak is made of (the state kept in RAM, when any; the biggest categories live at its
/// peak; outside the arena, baseline, reserve), and the smallest budget that fits: the plan
/// of `--batch 1` with every memory strategy the flags have not already taken (bf16, int8
/// state, full recomputation, everything offloaded).
fn even_batch_1(plan: &Plan, budget: u64, baseline: u64, backend: &dyn Sizing) -> Result<String> {
    let cfg = &plan.cfg;
    let one = build_plan(
        &plan.spec,
        &StepConfig {
            batch: 1,
            ..cfg.clone()
        },
        plan.mode,
        backend,
    )?;
    let state: u64 = one
        .buffers
        .iter()
        .filter(|b| {
            b.persistent
                && b.placement.tier == one.compute_tier()
                && b.category != crate::ir::Category::IoStaging
        })
        .map(|b| b.bytes)
        .sum();
    let mut live = one.live_by_category(one.peak_op);
    live.retain(|&(_, b)| b > 0);
    live.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
    let parts: Vec<String> = live
        .iter()
        .take(3)
        .map(|(c, b)| format!("{} {}", c.name(), fmt_bytes(*b)))
        .collect();
    let (_, base) = baseline_terms(&one);
    let mut s = format!(
        "even --batch 1 does not fit: it needs {} (arena {}, at its peak, op {}: {}{}; outside the arena {}; {base} {}; runtime reserve {})",
        fmt_bytes(predicted_peak(&one, baseline)),
        fmt_bytes(one.arena_bytes()),
        one.schedule.ops[one.peak_op].name,
        parts.join(", "),
        if state > 0 {
            format!(
                "; of it parameters, gradients and optimizer state kept in {} {}",
                one.compute_tier().describe(),
                fmt_bytes(state)
            )
        } else {
            String::new()
        },
        fmt_bytes(one.external_bytes),
        fmt_bytes(baseline),
        fmt_bytes(one.runtime_reserve())
    );
    // The smallest plan of this model at this --seq: every strategy not already taken.
    let mut small = StepConfig {
        batch: 1,
        recompute: Recompute::Full,
        ..cfg.clone()
    };
    let mut flags = Vec::new();
    if plan.mode == Mode::Train {
        small.precision = Precision::Bf16;
        // A backend with no slower tier offloads nothing; nor does an update inside the
        // backward, but beneath a GPU (where it then runs on the host).
        let gpu = backend.offload_tier() == Some(Tier::Host);
        let can_offload = backend.offload_tier().is_some() && (cfg.update == Update::End || gpu);
        if can_offload {
            small.offload.set = OffloadSet::ALL;
        }
        // Moments offloaded beneath a GPU are in pinned RAM: 8-bit ones save no device memory.
        let int8 = !(gpu && can_offload);
        if int8 {
            small.optim_state = OptimState::Int8;
        }
        for (differs, flag) in [
            (cfg.precision != Precision::Bf16, "--precision bf16"),
            (
                int8 && cfg.optim_state != OptimState::Int8,
                "--optim-state int8",
            ),
            (cfg.recompute != Recompute::Full, "--recompute full"),
            (
                can_offload && cfg.offload.set != OffloadSet::ALL,
                "--offload all",
            ),
        ] {
            if differs {
                flags.push(flag);
            }
        }
    } else if cfg.recompute != Recompute::Full {
        flags.push("--recompute full");
    }
    // A LoRA base kept wider than 4 bits: quantizing it is the largest saving of all.
    let wide = |q: BaseQuant| match q {
        BaseQuant::F32 => true,
        BaseQuant::Blocks(t) => t == GgmlType::BF16 || t == GgmlType::Q8_0,
        BaseQuant::Keep => false,
    };
    if plan.mode == Mode::Train && cfg.lora.is_some() && wide(cfg.base_quant) {
        let quantized = StepConfig {
            base_quant: BaseQuant::Blocks(GgmlType::Q4_0),
            ..small.clone()
        };
        if build_plan(&plan.spec, &quantized, plan.mode, backend).is_ok() {
            small = quantized;
            flags.insert(0, "--base-quant q4_0");
        }
    }
    let least = predicted_peak(
        &build_plan(&plan.spec, &small, plan.mode, backend)?,
        baseline,
    );
    if flags.is_empty() {
        s.push_str(&format!(
            "; this is already the smallest plan of {} at --seq {}: --max-memory {} is the least that fits (or a shorter --seq, or a smaller model)",
            plan.spec.name,
            cfg.seq,
            fmt_bytes(least)
        ));
    } else {
        s.push_str(&format!(
            "; with {} --batch 1 needs {}{}",
            flags.join(" "),
            fmt_bytes(least),
            if least <= budget {
                " and fits".to_string()
            } else {
                format!(
                    ", the least budget that fits {} at --seq {} (or a shorter --seq, or a smaller model)",
                    plan.spec.name, cfg.seq
                )
            }
        ));
    }
    Ok(s)
}
