//! The micro-batch and strategies of a step: as given, as `--batch auto` and
//! `--global-batch` make them, or as the `--fit` search chooses them.

use super::request::{DEFAULT_SEQ, StepRequest, StrategyRequest};
use crate::backend::DeviceId;
use crate::ir::Sizing;
use crate::ir::shard::Zero;
use crate::ir::{OptimState, Precision, RecomputeChoice};
use crate::model::ModelSpec;
use crate::plan::fit::{self, Strategies};
use crate::plan::search::{self, Pick};
use crate::plan::time::Calibration;
use crate::plan::{Mode, OffloadChoice, build_plan};
use crate::util::bytes::fmt_bytes;
use crate::util::rss;
use anyhow::{Context, Result, bail};

impl StrategyRequest {
    /// The strategies these flags ask for, defaults filled in, with the budget `max_memory`
    /// (`auto` precision or optimizer state is for --fit only).
    pub fn strategies(&self, max_memory: Option<u64>) -> Result<Strategies> {
        let d = Strategies::default();
        Ok(Strategies {
            recompute: self.recompute.unwrap_or(d.recompute),
            grad_accum: self.grad_accum.unwrap_or(d.grad_accum),
            optim_state: fixed(self.optim_state, "--optim-state")?.unwrap_or(d.optim_state),
            precision: fixed(self.precision, "--precision")?.unwrap_or(d.precision),
            max_memory,
            offload: self.offload.unwrap_or(d.offload),
            offload_dir: self.offload_dir.clone(),
            zero: self.zero.unwrap_or(d.zero),
            base_quant: self.base_quant.unwrap_or(d.base_quant),
            update: self.update.unwrap_or(d.update),
            ..d
        })
    }

    /// The strategies of a `--fit` run before its search: the budget and the offload
    /// directory (the search sets the rest).
    pub fn for_fit(&self, max_memory: Option<u64>) -> Strategies {
        Strategies {
            max_memory,
            offload_dir: self.offload_dir.clone(),
            ..Strategies::default()
        }
    }
}

/// A flag's value, refusing `auto` outside --fit.
pub fn fixed<T>(v: Option<Pick<T>>, flag: &str) -> Result<Option<T>> {
    match v {
        Some(Pick::Auto) => bail!(
            "{flag} auto needs --fit (and --max-memory): the search then picks it by predicted step time"
        ),
        Some(Pick::Fixed(t)) => Ok(Some(t)),
        None => Ok(None),
    }
}

/// A step's micro-batch and strategies as the flags give them, or as `--fit` / `--batch
/// auto` choose them.
pub struct Resolved {
    pub batch: usize,
    pub strategies: Strategies,
    /// The search, when `--fit` ran one.
    pub found: Option<search::Found>,
    /// The search's record for plan.json.
    pub fit: Option<serde_json::Value>,
    /// The calibration the search timed with (an estimate is measured once per run).
    pub cal: Option<Calibration>,
    /// What the caller should tell the user (what `--fit` keeps of the flags given).
    pub notes: Vec<String>,
}

impl Resolved {
    /// The `--fit` search's choice `f` within `budget`: its micro-batch and strategies (the
    /// offload file in `offload_dir`, as asked), its table and record, and the calibration
    /// it timed with.
    pub fn fitted(
        f: search::Fitted,
        budget: u64,
        offload_dir: Option<std::path::PathBuf>,
        cal: Calibration,
    ) -> Resolved {
        Resolved {
            batch: f.cfg.batch,
            strategies: Strategies::chosen(&f.cfg, budget, offload_dir),
            found: Some(f.found),
            fit: Some(f.record),
            cal: Some(cal),
            notes: Vec::new(),
        }
    }
}

/// What `--fit` may choose: the flags given are kept, the rest (and those given as auto)
/// searched.
pub fn fit_space(
    step: &StepRequest,
    notes: &mut Vec<String>,
    threads: usize,
    default_batch: usize,
    ranks: usize,
) -> Result<search::Space> {
    let st = &step.strategy;
    if st.pp_layers.is_some() {
        bail!(
            "--fit chooses how the pipeline's layers are cut (evenly, or balanced by predicted \
             time as --pp-layers auto does): drop --pp-layers, or give the strategies yourself \
             (--pp, --pp-layers and the rest) without --fit"
        );
    }
    if st.grad_accum.is_some() && step.global_batch.is_some() {
        bail!("--fit chooses --grad-accum from --global-batch: give one of them");
    }
    let micro = match step.batch {
        Some(Pick::Fixed(b)) if step.global_batch.is_some() => Some(b),
        _ => None,
    };
    let global = match (step.global_batch, step.batch) {
        (Some(g), _) => g,
        (None, Some(Pick::Fixed(b))) => {
            let g = b * st.grad_accum.unwrap_or(1);
            notes.push(format!(
                "memwall: --fit keeps {g} rows per optimizer step (--batch {b}{}) and searches \
                 the micro-batch; to fix the micro-batch too, give --global-batch {g} --batch {b}",
                match st.grad_accum {
                    Some(a) => format!(" x --grad-accum {a}"),
                    None => String::new(),
                }
            ));
            g
        }
        (None, _) => default_batch * st.grad_accum.unwrap_or(1),
    };
    Ok(search::Space {
        global_batch: global,
        seq: step.seq.unwrap_or(DEFAULT_SEQ),
        threads,
        micro_batch: micro,
        recompute: match st.recompute {
            Some(RecomputeChoice::Fixed(r)) => Pick::Fixed(r),
            _ => Pick::Auto,
        },
        offload: match st.offload {
            Some(OffloadChoice::Set(o)) => Pick::Fixed(o),
            _ => Pick::Auto,
        },
        precision: st.precision.unwrap_or(Pick::Fixed(Precision::F32)),
        optim_state: st.optim_state.unwrap_or(Pick::Fixed(OptimState::F32)),
        offload_dir: st.offload_dir.clone(),
        lora: None,
        base_quant: st.base_quant.unwrap_or_default(),
        base_types: None,
        distill: None,
        ranks,
        // One process has one shape; several are searched unless given.
        tensor: match (st.tp, ranks) {
            (Some(t), _) => Pick::Fixed(t),
            (None, 1) => Pick::Fixed(1),
            (None, _) => Pick::Auto,
        },
        pipeline: match (st.pp, ranks) {
            (Some(p), _) => Pick::Fixed(p),
            (None, 1) => Pick::Fixed(1),
            (None, _) => Pick::Auto,
        },
        zero: match (st.zero, ranks) {
            (Some(z), _) => Pick::Fixed(z),
            (None, 1) => Pick::Fixed(Zero::DP),
            (None, _) => Pick::Auto,
        },
        sequence_parallel: match (st.sequence_parallel, ranks) {
            (Some(s), _) => Pick::Fixed(s),
            (None, 1) => Pick::Fixed(false),
            (None, _) => Pick::Auto,
        },
        // Interleaved meshes keep their even runs (`search::balanced_cuts` leaves them).
        stage_layers: Pick::Auto,
        pipeline_chunks: match (st.pp_chunks, ranks) {
            (Some(v), _) => Pick::Fixed(v),
            (None, 1) => Pick::Fixed(1),
            (None, _) => Pick::Auto,
        },
        update: st.update.unwrap_or_default(),
        host_budget: step.max_host_memory,
    })
}

/// What a run's frozen base and adapters are where the caller knows more than the flags:
/// `train`'s `--init-adapter` (the adapters it holds) and GGUF `--init` (the base kept as the
/// file's blocks, each tensor's type read from it). `None` fields: as the flags say.
#[derive(Clone, Debug, Default)]
pub struct Frozen {
    pub lora: Option<crate::model::lora::LoraSpec>,
    /// Distillation's teacher (`--distill-from`), whose plan every candidate holds.
    pub teacher: Option<crate::plan::Distill>,
    pub base: Option<(
        crate::ir::BaseQuant,
        Option<std::sync::Arc<crate::ir::BaseTypes>>,
    )>,
}

/// Refuses `--update in-backward` on a GPU without the placement that runs it there (the
/// update's whole state in pinned RAM, so each update runs on the host's cores); `train`
/// and `plan`/`bench` check alike.
pub fn check_in_backward_device(
    update: Option<crate::ir::Update>,
    device: DeviceId,
    offload: Option<OffloadChoice>,
) -> Result<()> {
    if update == Some(crate::ir::Update::InBackward)
        && device.kind != crate::backend::DeviceKind::Cpu
        && !offload.is_some_and(OffloadChoice::holds_the_update)
    {
        bail!(
            "--update in-backward with --device {device}: only with an --offload that includes \
             optimizer,params,grads (all does), which runs each update on the host's cores \
             inside the backward (the GPU keeps the update after the backward otherwise); use \
             --update end, or such an --offload"
        );
    }
    Ok(())
}

/// Refuses `--max-host-memory` (`host`) where it budgets nothing: 0, or a device that
/// computes in host RAM (whose budget is `--max-memory`).
pub fn check_host_memory_flag(host: Option<u64>, device: DeviceId) -> Result<()> {
    match host {
        Some(0) => bail!("--max-host-memory 0: give the host RAM the plan may pin, e.g. 64GiB"),
        Some(_) if device.sizing().tiers()[0] == crate::ir::Tier::Host => bail!(
            "--max-host-memory with --device {device}: host RAM is where this device computes, \
             so --max-memory is its budget; --max-host-memory budgets the pinned RAM beneath a \
             GPU (--device cuda)"
        ),
        _ => Ok(()),
    }
}

/// Resolves `--batch`, `--global-batch`, `--fit` and the strategy flags for `spec`, with
/// the base and adapters `frozen` gives where it gives them (so `--batch auto` and `--fit`
/// plan the base as the run will keep it).
pub fn resolve_step(
    step: &StepRequest,
    spec: &ModelSpec,
    threads: usize,
    baseline: u64,
    default_batch: usize,
    ranks: usize,
    frozen: &Frozen,
) -> Result<Resolved> {
    let st = &step.strategy;
    let backend = step.device.sizing();
    check_in_backward_device(st.update, step.device, st.offload)?;
    check_host_memory_flag(step.max_host_memory, step.device)?;
    if st.adapter_dropout.is_some() && frozen.lora.is_none() {
        bail!(
            "--lora-dropout needs --lora R (or, in `train`, --init-adapter DIR: the adapter then \
             continues with that dropout)"
        );
    }
    if step.fit {
        let budget = step.max_memory.context("--fit needs --max-memory")?;
        let mut notes = Vec::new();
        let mut space = fit_space(step, &mut notes, threads, default_batch, ranks)?;
        space.lora = match &frozen.lora {
            Some(l) => Some(l.clone()),
            None => st.lora.as_ref().map(|l| l.spec(spec.family)).transpose()?,
        };
        if let Some((quant, types)) = &frozen.base {
            (space.base_quant, space.base_types) = (*quant, types.clone());
        }
        space.distill = frozen.teacher;
        // A GPU's choices are ranked by its own calibration, never the CPU's.
        let cal = crate::exec::calibrate::for_ranking(step.device, threads, "--fit")?;
        let f = search::fit(spec, &space, budget, baseline, &cal, backend)?;
        let mut r = Resolved::fitted(f, budget, st.offload_dir.clone(), cal);
        r.strategies.max_host_memory = step.max_host_memory;
        r.notes = notes;
        return Ok(r);
    }
    let mut strategies = st.strategies(step.max_memory)?;
    strategies.max_host_memory = step.max_host_memory;
    strategies.ranks = ranks;
    strategies.tensor = st.tp.unwrap_or(1);
    strategies.sequence_parallel = st.sequence_parallel.unwrap_or(false);
    strategies.pipeline = st.pp.unwrap_or(1);
    strategies.pipeline_layers = st.pp_layers.clone().unwrap_or_default();
    strategies.pipeline_chunks = st.pp_chunks.unwrap_or(1);
    strategies.check_mesh()?;
    // The copies of the model that split the batch (each `--tp` × `--pp` ranks hold one).
    let ranks = strategies.data_ranks();
    strategies.lora = match &frozen.lora {
        Some(l) => Some(l.clone()),
        None => st.lora.as_ref().map(|l| l.spec(spec.family)).transpose()?,
    };
    if let Some((quant, types)) = &frozen.base {
        (strategies.base_quant, strategies.base_types) = (*quant, types.clone());
    }
    strategies.distill = frozen.teacher;
    let batch = match step.batch {
        Some(Pick::Auto) => {
            let budget = step
                .max_memory
                .context("--batch auto needs --max-memory: it picks the largest micro-batch that fits that budget")?;
            let (RecomputeChoice::Fixed(r), OffloadChoice::Set(_)) =
                (strategies.recompute, strategies.offload)
            else {
                bail!(
                    "--batch auto needs a fixed --recompute and --offload (or use --fit, which searches all three)"
                );
            };
            let mut cfg = strategies.step_config(1, step.seq.unwrap_or(DEFAULT_SEQ), threads);
            cfg.recompute = r;
            let largest = fit::largest_batch(spec, &cfg, Mode::Train, budget, baseline, backend)?;
            let Some((b, _)) = largest else {
                let one = build_plan(spec, &cfg, Mode::Train, backend)?;
                fit::check_budget(&one, budget, baseline, backend)?;
                bail!("internal error: batch 1 fits but was not found");
            };
            match step.global_batch {
                // The largest divisor of the global batch that fits.
                Some(g) => {
                    if !g.is_multiple_of(ranks) {
                        bail!(
                            "--global-batch {g} is not a multiple of the {ranks} ranks: each rank takes an equal part"
                        );
                    }
                    let per_rank = g / ranks;
                    let d = (1..=b.min(per_rank))
                        .rev()
                        .find(|&d| per_rank.is_multiple_of(d))
                        .unwrap_or(1);
                    strategies.grad_accum = per_rank / d;
                    d
                }
                None => b,
            }
        }
        fixed => {
            let b = match fixed {
                Some(Pick::Fixed(b)) => b,
                _ => default_batch,
            };
            if let Some(g) = step.global_batch {
                // Every rank runs --batch b per micro-batch: a step holds ranks x b x accum.
                let per_step = b * ranks;
                if b == 0 || !g.is_multiple_of(per_step) {
                    let of = if ranks > 1 {
                        format!("{ranks} ranks x --batch {b}")
                    } else {
                        format!("--batch {b}")
                    };
                    bail!(
                        "--global-batch {g} is not a multiple of {of}: the accumulation must be a whole number of micro-batches"
                    );
                }
                if step.strategy.grad_accum.is_some_and(|a| a * per_step != g) {
                    bail!(
                        "--global-batch {g} disagrees with --batch {b} x --grad-accum {}{}: give two of the three",
                        strategies.grad_accum,
                        if ranks > 1 {
                            format!(" x {ranks} ranks")
                        } else {
                            String::new()
                        }
                    );
                }
                strategies.grad_accum = g / per_step;
            }
            b
        }
    };
    let mut notes = Vec::new();
    super::stages::resolve_cut(
        &mut strategies,
        spec,
        (batch, step.seq.unwrap_or(DEFAULT_SEQ), threads),
        (step.max_memory, baseline),
        backend,
        &mut notes,
    )?;
    if st.offload_dir.is_some() && backend.offload_tier() != Some(crate::ir::Tier::Nvme) {
        notes.push(format!(
            "memwall: --offload-dir is the disk tier's, and --device {} offloads to host RAM \
             (the disk beneath it is not there yet): it is not used",
            step.device
        ));
    }
    Ok(Resolved {
        batch,
        strategies,
        found: None,
        fit: None,
        cal: None,
        notes,
    })
}

/// The `--fit` search with the baseline the run will have: the search's own allocations
/// (plans built on every core) are handed back and the baseline measured again after it;
/// where the fastest choice no longer fits with that, the search runs again with it (a
/// baseline measured before the search under-counted the run by 5.9 MiB on gpt2-tiny).
pub fn fit_measured(
    spec: &ModelSpec,
    space: &search::Space,
    budget: u64,
    cal: &Calibration,
    backend: &(dyn Sizing + Sync),
) -> Result<(search::Fitted, u64)> {
    if let Some(fixed) = backend.baseline_bytes() {
        return Ok((
            search::fit(spec, space, budget, fixed, cal, backend)?,
            fixed,
        ));
    }
    let mut baseline = rss::current_rss().unwrap_or(0);
    for _ in 0..3 {
        let f = search::fit(spec, space, budget, baseline, cal, backend)?;
        crate::util::malloc::release_free_memory();
        let after = rss::current_rss().unwrap_or(0);
        let best = &f.found.ranked[0];
        if after <= baseline || best.peak - baseline + after <= budget {
            return Ok((f, baseline.max(after)));
        }
        baseline = after;
    }
    bail!(
        "--fit: the process's resident memory kept growing with each search (now {}); \
         give the strategies yourself (see `memwall plan --fit`)",
        fmt_bytes(baseline)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(batch: Option<usize>, global: Option<usize>, accum: Option<usize>) -> StepRequest {
        StepRequest {
            batch: batch.map(Pick::Fixed),
            global_batch: global,
            strategy: StrategyRequest {
                grad_accum: accum,
                ..StrategyRequest::default()
            },
            ..StepRequest::default()
        }
    }

    fn resolved(req: &StepRequest, ranks: usize) -> Result<(usize, usize)> {
        let spec = ModelSpec::preset("gpt2-tiny")?;
        let r = resolve_step(req, &spec, 1, 0, 8, ranks, &Frozen::default())?;
        Ok((r.batch, r.strategies.grad_accum))
    }

    /// `--global-batch` sets the accumulation from a fixed micro-batch on every rank, and a
    /// global batch that no whole number of micro-batches makes is refused, naming the flags.
    #[test]
    fn the_global_batch_sets_the_accumulation_or_is_refused() {
        assert_eq!(
            resolved(&request(Some(4), Some(32), None), 1).unwrap(),
            (4, 8)
        );
        assert_eq!(
            resolved(&request(Some(4), Some(32), None), 2).unwrap(),
            (4, 4)
        );
        assert_eq!(resolved(&request(None, Some(16), None), 1).unwrap(), (8, 2));
        assert_eq!(
            resolved(&request(Some(3), None, Some(5)), 1).unwrap(),
            (3, 5)
        );
        for (req, ranks, says) in [
            (
                request(Some(3), Some(32), None),
                1,
                "--global-batch 32 is not a multiple of --batch 3",
            ),
            (
                request(Some(4), Some(36), None),
                2,
                "--global-batch 36 is not a multiple of 2 ranks x --batch 4",
            ),
            (
                request(Some(4), Some(32), Some(2)),
                1,
                "--global-batch 32 disagrees with --batch 4 x --grad-accum",
            ),
        ] {
            let e = format!("{:#}", resolved(&req, ranks).unwrap_err());
            assert!(e.contains(says), "{e}");
        }
    }

    /// `auto` precision or optimizer state is for `--fit` only; `--fit` chooses the stages'
    /// cut, so it refuses `--pp-layers`.
    #[test]
    fn auto_flags_outside_fit_are_refused() {
        let mut req = request(Some(4), None, None);
        req.strategy.precision = Some(Pick::Auto);
        let e = format!("{:#}", resolved(&req, 1).unwrap_err());
        assert!(e.contains("--precision auto needs --fit"), "{e}");
        let mut req = request(Some(4), None, None);
        req.fit = true;
        req.max_memory = Some(1 << 30);
        req.strategy.pp = Some(2);
        req.strategy.pp_layers = Some(crate::plan::stage_cut::StageCut::Auto);
        let e = format!("{:#}", resolved(&req, 2).unwrap_err());
        assert!(
            e.contains("--fit chooses how the pipeline's layers are cut"),
            "{e}"
        );
    }
}
