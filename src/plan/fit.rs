//! The strategies a run asks for, and budget checks: does a plan fit `--max-memory`, and if
//! not, what would.

use super::{
    Mode, OffloadSet, OptimState, Plan, Precision, Recompute, RecomputeChoice, StepConfig,
    build_plan,
};
use crate::backend::Sizing;
use crate::model::ModelSpec;
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
    /// What lives on the disk tier between uses (`--offload`).
    #[serde(default)]
    pub offload: OffloadSet,
    /// Directory of the disk tier's file (`--offload-dir`; train's default: `offload/` in
    /// the run directory, bench's: `memwall-offload/` in the current directory).
    #[serde(default)]
    pub offload_dir: Option<std::path::PathBuf>,
}

fn one() -> usize {
    1
}

impl Default for Strategies {
    fn default() -> Self {
        Strategies {
            recompute: RecomputeChoice::default(),
            grad_accum: 1,
            optim_state: OptimState::default(),
            precision: Precision::default(),
            max_memory: None,
            offload: OffloadSet::NONE,
            offload_dir: None,
        }
    }
}

impl Strategies {
    /// The step configuration of a `batch` × `seq` micro-batch on `threads` (recomputation
    /// left at none: [`Strategies::plan`] resolves it).
    pub fn step_config(&self, batch: usize, seq: usize, threads: usize) -> StepConfig {
        let mut cfg = StepConfig::new(batch, seq, threads);
        cfg.grad_accum = self.grad_accum;
        cfg.optim_state = self.optim_state;
        cfg.precision = self.precision;
        cfg.offload.set = self.offload;
        cfg.offload.dir = self.offload_dir.clone().filter(|_| self.offload.any());
        cfg
    }

    /// With `--offload` and no `--offload-dir`: `default` as the directory (the disk tier
    /// creates it when the plan starts).
    pub fn with_offload_dir(&self, default: &std::path::Path) -> Strategies {
        let mut s = self.clone();
        if s.offload.any() && s.offload_dir.is_none() {
            s.offload_dir = Some(default.to_path_buf());
        }
        s
    }

    /// The training-step plan: [`plan_with_recompute`] of [`Strategies::step_config`].
    pub fn plan(
        &self,
        spec: &ModelSpec,
        (batch, seq, threads): (usize, usize, usize),
        baseline: u64,
        backend: &dyn Sizing,
    ) -> Result<Plan> {
        let cfg = self.step_config(batch, seq, threads);
        plan_with_recompute(
            spec,
            &cfg,
            Mode::Train,
            self.recompute,
            self.max_memory,
            baseline,
            backend,
        )
    }
}

/// Predicted peak resident memory of a process running `plan`: the plan's bytes plus the
/// measured process baseline (code, tokenizer tables, thread stacks, allocator).
pub fn predicted_peak(plan: &Plan, baseline: u64) -> u64 {
    plan.total_bytes() + baseline
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

/// Builds the plan of `cfg` with the recomputation policy `choice`, refusing it when it does
/// not fit `budget`. `auto` picks, among none, selective, every:K and full, the plan with the
/// fewest recomputed FLOPs whose predicted peak fits (ties: the earlier candidate).
pub fn plan_with_recompute(
    spec: &ModelSpec,
    cfg: &StepConfig,
    mode: Mode,
    choice: RecomputeChoice,
    budget: Option<u64>,
    baseline: u64,
    backend: &dyn Sizing,
) -> Result<Plan> {
    let with = |r: Recompute| {
        build_plan(
            spec,
            &StepConfig {
                recompute: r,
                ..cfg.clone()
            },
            mode,
            backend,
        )
    };
    let budget = match (choice, budget) {
        (RecomputeChoice::Fixed(r), budget) => {
            let plan = with(r)?;
            if let Some(b) = budget {
                check_budget(&plan, b, baseline, backend)?;
            }
            return Ok(plan);
        }
        (RecomputeChoice::Auto, None) => bail!(
            "--recompute auto needs --max-memory: it picks the least recomputation whose plan fits that budget"
        ),
        (RecomputeChoice::Auto, Some(b)) => b,
    };
    let mut plans = Recompute::candidates(spec.n_layer)
        .into_iter()
        .map(with)
        .collect::<Result<Vec<Plan>>>()?;
    plans.sort_by_key(|p| p.recompute_flops()); // stable: ties keep candidate order
    let smallest = plans
        .iter()
        .min_by_key(|p| p.total_bytes())
        .expect("candidates")
        .clone();
    match plans
        .into_iter()
        .find(|p| predicted_peak(p, baseline) <= budget)
    {
        Some(p) => Ok(p),
        None => {
            let err = check_budget(&smallest, budget, baseline, backend).expect_err("does not fit");
            Err(err.context(format!(
                "--recompute auto: no recomputation policy fits --max-memory {}; the smallest plan is --recompute {} with a predicted peak of {}",
                fmt_bytes(budget),
                smallest.cfg.recompute,
                fmt_bytes(predicted_peak(&smallest, baseline))
            )))
        }
    }
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
        None => {
            let state: u64 = plan
                .buffers
                .iter()
                .filter(|b| {
                    b.persistent && !b.is_owned() && b.category != super::Category::IoStaging
                })
                .map(|b| b.bytes)
                .sum();
            let mut s = format!(
                "even --batch 1 does not fit: parameters, gradients and optimizer state alone take {}",
                fmt_bytes(state)
            );
            // The smallest state this build offers: bf16 compute copies, int8 moments.
            let small = StepConfig {
                batch: 1,
                precision: super::Precision::Bf16,
                optim_state: super::OptimState::Int8,
                recompute: Recompute::Full,
                ..cfg.clone()
            };
            if plan.mode == Mode::Train
                && (cfg.precision, cfg.optim_state)
                    != (super::Precision::Bf16, super::OptimState::Int8)
            {
                let p = predicted_peak(
                    &build_plan(&plan.spec, &small, plan.mode, backend)?,
                    baseline,
                );
                s.push_str(&format!(
                    "; with --precision bf16 --optim-state int8 --recompute full, --batch 1 needs {}{}",
                    fmt_bytes(p),
                    if p <= budget { " and fits" } else { " (still too much: a smaller model, or offload, is needed)" }
                ));
            } else {
                s.push_str(" (a smaller model, or offload, is needed)");
            }
            s
        }
    };
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
    bail!(
        "the plan needs {} (arena {} + outside the arena {} + process baseline {}) but --max-memory is {}: \
         over by {}; {advice}",
        fmt_bytes(need),
        fmt_bytes(plan.arena_bytes),
        fmt_bytes(plan.external_bytes),
        fmt_bytes(baseline),
        fmt_bytes(budget),
        fmt_bytes(need - budget)
    )
}
