//! The options of a training run: a new one from its request, or a resumed one, which
//! keeps its own configuration except what the request may change (a model of the same
//! dimensions, more steps, recomputation, the budget, the ZeRO stage, the number of ranks,
//! and the accumulation where it keeps the global batch).

use super::base::{base_storage, kept_types};
use super::request::{DEFAULT_MODEL, TrainRequest};
use super::step::{Frozen, Resolved, fit_measured, fit_space, fixed, resolve_step};
use crate::dist::Comm;
use crate::exec::train::{
    Progress, TrainOptions, planning_baseline, resume_options, with_data_open,
};
use crate::gguf;
use crate::ir::Update;
use crate::model::ModelSpec;
use crate::plan::fit::Strategies;
use crate::plan::search::Pick;
use crate::plan::stage_cut::StageCut;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

/// The options of the new run `req` asks for, on `threads` workers (checked by the caller)
/// among `ranks` processes: the micro-batch and strategies resolved with the data open, as
/// the run will measure its baseline (`--fit` searches when the run starts, for the same
/// reason).
/// The options of a new run of `req` on `threads` threads, this process being one rank of
/// `comm` (`--fit` under mpirun: rank 0 searches, every rank trains its choice).
pub fn new_run(
    req: &TrainRequest,
    threads: usize,
    comm: &dyn Comm,
    progress: &mut dyn Progress,
) -> Result<TrainOptions> {
    let ranks = comm.size();
    let (Some(data), Some(out)) = (&req.data, &req.out) else {
        bail!("a new run needs --data (prepared data) and --out (its run directory)");
    };
    // The cheap checks first: a GGUF --init's conversion takes minutes and gigabytes.
    crate::exec::train::check_new_run_dir(out)?;
    // Paths are recorded absolute, so a resumed run finds them from any directory.
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    // --init-adapter as a run directory is its newest checkpoint.
    let mut own = req.clone();
    own.init_adapter = match &req.init_adapter {
        Some(dir) => Some(absolute(&crate::ckpt::adapter::check_adapter_dir(
            dir,
            "--init-adapter",
        )?)),
        None => None,
    };
    let req = &own;
    // --init gives the architecture when --model is left out.
    let init = match &req.init {
        Some(p) => {
            let dir = absolute(&gguf::cache::model_dir(p, "--init", &mut |m: &str| {
                progress.message(m)
            })?);
            // A checkpoint holding an adapter, a run directory: named for what they are.
            crate::ckpt::load_spec(&dir).with_context(|| format!("--init {}", p.display()))?;
            Some(dir)
        }
        None => None,
    };
    let init_model = init.as_ref().map(|p| p.to_string_lossy().into_owned());
    // A --model that names a directory or file here (not a preset) is a path too.
    let given_model = (req.step.model.as_deref()).map(|m| match Path::new(m).exists() {
        true => absolute(Path::new(m)).to_string_lossy().into_owned(),
        false => m.to_string(),
    });
    let model = given_model.as_deref().or(init_model.as_deref());
    let mut o = TrainOptions::new(model.unwrap_or(DEFAULT_MODEL), data, out);
    o.steps = req.steps.unwrap_or(o.steps);
    o.seq = req.step.seq.unwrap_or(o.seq);
    o.lr = req.lr;
    o.warmup = req
        .warmup
        .unwrap_or(crate::exec::lr::default_warmup(o.steps));
    o.pin_data()?;
    o.weight_decay = req.weight_decay;
    o.grad_clip = req.grad_clip;
    o.seed = req.seed;
    o.threads = threads;
    o.init = init;
    o.init_gguf = (req.init.as_deref())
        .filter(|p| crate::util::sniff::is_gguf(p))
        .map(absolute);
    o.pin_base()?;
    o.device = req.step.device;
    o.eval_every = req.eval_every;
    o.eval_batches = req.eval_batches;
    o.save_every = req.save_every;
    o.keep_last = req.keep_last.unwrap_or(0);
    o.no_pack = req.no_pack;
    o.profile_steps = req.profile_steps;
    if let Some(p) = &req.step.distill_from {
        let dir = gguf::cache::model_dir(p, "--distill-from", &mut |m: &str| progress.message(m))?;
        o.distill_from = Some(absolute(&dir));
        o.distill_gguf = crate::util::sniff::is_gguf(p).then(|| absolute(p));
        o.distill_alpha = req.step.distill_alpha.unwrap_or(DEFAULT_DISTILL_ALPHA);
    }
    if req.step.fit {
        fit_run(&mut o, req, comm, progress)?;
    } else {
        let spec = ModelSpec::resolve(&o.model)?;
        // With the data open, as the run will measure it (`--batch auto` plans with it).
        let baseline = planning_baseline(&o)?;
        // The adapters and the base as the run will keep them, so that `--batch auto` plans
        // them so.
        let asked = (req.step.strategy.lora.as_ref())
            .map(|l| l.spec(spec.family))
            .transpose()?;
        let frozen = Frozen {
            teacher: o.distill(&spec)?,
            lora: match &req.init_adapter {
                Some(dir) => Some(adapter_spec(
                    dir,
                    &spec,
                    asked.as_ref(),
                    &req.step.strategy,
                )?),
                None => None,
            },
            base: Some(base_storage(
                o.init_gguf.as_deref(),
                spec.family,
                lora_run(req),
                req.step.strategy.base_quant,
                "--init",
                &mut o.notes,
            )?),
        };
        let r = resolve_step(
            &req.step, &spec, o.threads, baseline, o.batch, ranks, &frozen,
        )?;
        o.notes.extend(r.notes);
        o.batch = r.batch;
        o.strategies = r.strategies;
        o.init_adapter = req.init_adapter.clone();
    }
    // An update inside the backward cannot wait for the global norm: no clipping, unless
    // asked for (then refused by the options' check, naming both flags).
    if o.strategies.update == Update::InBackward && !req.given.contains(&"--grad-clip") {
        o.grad_clip = 0.0;
        o.notes.push(
            "note: --update in-backward trains without clipping (--grad-clip 0): the global \
             norm is known only after the updates"
                .into(),
        );
    }
    Ok(o)
}

/// `--distill-alpha` unless given: the teacher's KL and the data's cross-entropy weighed alike.
/// Measured better than either alone when healing a pruned SmolLM2-135M on Shakespeare from
/// its original, which was not trained on that data (`scripts/prune-quality.sh`, 300 steps;
/// docs/benchmarks.md): validation CE 3.94 against 4.03 for the cross-entropy alone, and on
/// an earlier shape 3.99 against 4.32 for the KL alone.
pub const DEFAULT_DISTILL_ALPHA: f32 = 0.5;

/// Whether the run trains adapters (`--lora`, or `--init-adapter`).
fn lora_run(req: &TrainRequest) -> bool {
    req.step.strategy.lora.is_some() || req.init_adapter.is_some()
}

/// The adapters `--init-adapter DIR` holds, for a base of `spec`; refused when `--lora` (and
/// its companions) ask for others.
fn adapter_spec(
    dir: &Path,
    spec: &ModelSpec,
    asked: Option<&crate::model::lora::LoraSpec>,
    strategy: &crate::exec::resolve::request::StrategyRequest,
) -> Result<crate::model::lora::LoraSpec> {
    let mut found = crate::ckpt::adapter::read_config(dir, spec.family)?;
    // `--lora-dropout` alone: the adapter as it is, trained on with that dropout.
    if let Some(p) = strategy.adapter_dropout {
        if !(0.0..1.0).contains(&p) {
            bail!("--lora-dropout {p}: must be in [0, 1)");
        }
        found.dropout = p;
    }
    match asked {
        Some(a) if *a != found => bail!(
            "--init-adapter {}: the adapter has rank {} (alpha {}, targets {}, dropout {}), but \
             --lora asks for rank {} (alpha {}, targets {}, dropout {}); leave out --lora to \
             train the adapter as it is",
            dir.display(),
            found.r,
            found.alpha,
            targets(&found),
            found.dropout,
            a.r,
            a.alpha,
            targets(a),
            a.dropout
        ),
        _ => Ok(found),
    }
}

fn targets(l: &crate::model::lora::LoraSpec) -> String {
    l.targets
        .iter()
        .map(|t| t.flag())
        .collect::<Vec<_>>()
        .join(",")
}

/// The options with which the run in `run` continues on `ranks` processes, and the
/// checkpoint it continues from: the run's own, with what `req` gives where a resume may
/// change it; a change it may not make is refused, naming the flag.
pub fn resume(
    req: &TrainRequest,
    run: &Path,
    ranks: usize,
    progress: &mut dyn Progress,
) -> Result<(TrainOptions, PathBuf)> {
    // `--out` naming the run itself is the same command line with `--resume` added.
    let same = |out: &Path| {
        matches!(
            (std::fs::canonicalize(out), std::fs::canonicalize(run)),
            (Ok(a), Ok(b)) if a == b
        )
    };
    if let Some(out) = req.out.as_deref().filter(|o| !same(o)) {
        bail!(
            "--out {} with --resume: a resumed run writes into its own directory ({}); leave \
             out --out (copy the run directory first to continue a copy of it)",
            out.display(),
            run.display()
        );
    }
    let (mut opts, ck) = resume_options(run)?;
    // The run's own configuration, except what the user explicitly gives: a model (checked
    // against the run's dimensions), more steps. Batch and sequence cannot change.
    if let Some(m) = &req.step.model {
        opts.model = m.clone();
    }
    if let Some(s) = req.steps {
        if s > opts.steps {
            // The schedule is a function of the total: a longer run re-stretches the decay.
            opts.notes.push(format!(
                "note: --steps {s} (the run was started for {}): the learning-rate schedule is \
                 recomputed for {s} steps, so the rate jumps back up from where it had decayed",
                opts.steps
            ));
        }
        opts.steps = s;
    }
    // Another machine may want another thread count: the run continues on it, said aloud.
    if let Some(t) = req.step.threads
        && t != opts.threads
    {
        opts.notes.push(format!(
            "note: --threads {t} (the run used {}): the run continues on {t} threads; its \
             results may differ in the last bits from a run that kept {}",
            opts.threads, opts.threads
        ));
        opts.threads = t;
    }
    // A checkpoint is host bytes, the same from every backend: the run continues on the
    // device given, said aloud (the last bits of its results follow the device's kernels).
    if req.given.contains(&"--device") && req.step.device != opts.device {
        opts.notes.push(format!(
            "note: --device {} (the run used {}): the run continues on {}; its results may \
             differ in the last bits from a run that kept {}",
            req.step.device, opts.device, req.step.device, opts.device
        ));
        opts.device = req.step.device;
    }
    // Recomputation never changes the weights, so a resumed run may change it.
    if let Some(r) = req.step.strategy.recompute {
        opts.strategies.recompute = r;
    }
    // Nor does the update's place (without clipping, which `--update in-backward` refuses).
    if let Some(u) = req.step.strategy.update {
        opts.strategies.update = u;
    }
    if req.step.max_memory.is_some() {
        opts.strategies.max_memory = req.step.max_memory;
    }
    // Checkpoints hold the whole state whatever the stage: a run resumes on any number
    // of ranks, at any stage.
    if let Some(z) = req.step.strategy.zero {
        opts.strategies.zero = z;
    }
    // The same for the layout of the ranks: another --tp cuts the whole model otherwise.
    // Below, `ranks` are the copies of the model that split the batch (the data axis),
    // then and now.
    let was_ranks = opts.strategies.data_ranks();
    if let Some(t) = req.step.strategy.tp {
        opts.strategies.tensor = t;
    }
    match req.step.strategy.sequence_parallel {
        Some(s) => opts.strategies.sequence_parallel = s,
        // Kept from the run, unless the ranks now hold the model whole.
        None if opts.strategies.sequence_parallel && opts.strategies.tensor <= 1 => {
            opts.strategies.sequence_parallel = false;
            opts.notes.push(
                "note: the run used --sequence-parallel, which cuts the stream among --tp \
                 ranks; with --tp 1 it is off"
                    .into(),
            );
        }
        None => {}
    }
    if let Some(p) = req.step.strategy.pp {
        // The run's cut is of its own stages: another --pp cuts evenly unless told.
        let cut = &opts.strategies.pipeline_layers;
        if p != opts.strategies.pipeline
            && *cut != StageCut::Even
            && req.step.strategy.pp_layers.is_none()
        {
            if p > 1 {
                opts.notes.push(format!(
                    "note: --pp {p} (the run used --pp {} --pp-layers {cut}): the layers are \
                     cut evenly into the {p} stages; give --pp-layers to cut them otherwise",
                    opts.strategies.pipeline
                ));
            }
            opts.strategies.pipeline_layers = StageCut::Even;
        }
        opts.strategies.pipeline = p;
    }
    if let Some(cut) = &req.step.strategy.pp_layers {
        opts.strategies.pipeline_layers = cut.clone();
    }
    match req.step.strategy.pp_chunks {
        Some(v) => opts.strategies.pipeline_chunks = v,
        // Kept from the run, unless the model is now one stage.
        None if opts.strategies.pipeline_chunks > 1 && opts.strategies.pipeline <= 1 => {
            opts.notes.push(format!(
                "note: the run used --pp-chunks {} (the interleaved schedule of --pp stages); \
                 with --pp 1 it is off",
                opts.strategies.pipeline_chunks
            ));
            opts.strategies.pipeline_chunks = 1;
        }
        None => {}
    }
    let resumed = Strategies {
        ranks,
        ..opts.strategies.clone()
    };
    // A layout kept from the run that these ranks cannot hold: say where it came from.
    let (t, p) = (resumed.tensor, resumed.pipeline);
    let kept =
        (req.step.strategy.tp.is_none() && t > 1) || (req.step.strategy.pp.is_none() && p > 1);
    resumed.check_mesh().map_err(|e| match kept {
        true => e.context(format!(
            "the run was trained with --tp {t} --pp {p}, which --resume keeps unless told: \
             give --tp and --pp for {ranks} rank(s) (e.g. --tp 1 --pp 1 on one process)"
        )),
        false => e,
    })?;
    let ranks = resumed.data_ranks();
    opts.profile_steps = req.profile_steps;
    // What the run's weights follow stays; when and how much it evaluates and saves may change.
    let kept = [
        "--lr",
        "--warmup",
        "--weight-decay",
        "--grad-clip",
        "--seed",
    ];
    if let Some(flag) = req.given.iter().find(|f| kept.contains(f)) {
        bail!(
            "{flag} with --resume: the run in {} continues with its own optimizer settings and \
             seed (lr {}, warm-up {}, weight decay {}, grad clip {}, seed {}), so it goes on as \
             it would have; to change them, start a new run from a checkpoint (`--init \
             {}/checkpoints/step-N`)",
            run.display(),
            opts.lr,
            opts.warmup,
            opts.weight_decay,
            opts.grad_clip,
            opts.seed,
            run.display()
        );
    }
    if req.step.strategy.adapter_dropout.is_some() {
        bail!(
            "--lora-dropout with --resume: the run in {} trains its adapters with its own \
             dropout; start a new run (`--init BASE --init-adapter {} --lora-dropout P`) to \
             change it",
            run.display(),
            run.display()
        );
    }
    for flag in &req.given {
        let (field, now) = match *flag {
            "--eval-every" => (&mut opts.eval_every, req.eval_every),
            "--eval-batches" => (&mut opts.eval_batches, req.eval_batches),
            "--save-every" => (&mut opts.save_every, req.save_every),
            _ => continue,
        };
        if *field != now {
            opts.notes
                .push(format!("note: {flag} {now} (the run used {field})"));
            *field = now;
        }
    }
    if let Some(k) = req.keep_last {
        opts.keep_last = k;
    }
    // Packing changes which rows a batch holds, not what a row trains: a resumed run may stop.
    opts.no_pack |= req.no_pack;
    if req.step.strategy.lora.is_some() || req.step.strategy.base_quant.is_some() {
        let was = match &opts.strategies.lora {
            Some(l) => format!("LoRA adapters of rank {}", l.r),
            None => "every weight (a full fine-tune)".into(),
        };
        let flag = match req.step.strategy.lora {
            Some(_) => "--lora",
            None => "--base-quant",
        };
        bail!(
            "{flag} with --resume: the run in {} trains {was} on the base it started with, and \
             a resumed run keeps both; leave out {flag} (and --lora's companions), or start a \
             new run (`--init BASE --init-adapter CHECKPOINT` continues an adapter with other \
             settings)",
            run.display()
        );
    }
    if req.step.fit || req.step.batch == Some(Pick::Auto) || req.step.global_batch.is_some() {
        bail!(
            "--resume continues the run in {} with its own batch and strategies: --fit, --batch auto and --global-batch are for new runs",
            run.display()
        );
    }
    let batch = match req.step.batch {
        Some(Pick::Fixed(b)) => Some(b),
        _ => None,
    };
    // On another number of ranks, --grad-accum may change where it keeps the global
    // batch (ranks x batch x accumulation): the same rows per step, re-sharded state.
    if let Some(acc) = req.step.strategy.grad_accum {
        let (was, now) = (was_ranks * opts.strategies.grad_accum, ranks * acc);
        if acc != opts.strategies.grad_accum && was != now {
            bail!(
                "--resume: the run in {} steps on {} rank(s) x --grad-accum {} micro-batches; on {} rank(s) --grad-accum {acc} would change the global batch (keep ranks x --grad-accum at {was})",
                run.display(),
                was_ranks,
                opts.strategies.grad_accum,
                ranks
            );
        }
        opts.strategies.grad_accum = acc;
    }
    for (flag, given, run_value) in [
        ("--batch", batch, opts.batch),
        ("--seq", req.step.seq, opts.seq),
    ] {
        if let Some(g) = given
            && g != run_value
        {
            bail!(
                "--resume: the run in {} uses {flag} {run_value}; it cannot change to {g} (start a new run with --init instead)",
                run.display()
            );
        }
    }
    if let Some(p) = fixed(req.step.strategy.precision, "--precision")?
        && p != opts.strategies.precision
    {
        bail!(
            "--resume: the run in {} trains in {}; it cannot change to {p}",
            run.display(),
            opts.strategies.precision
        );
    }
    if let Some(f) = fixed(req.step.strategy.optim_state, "--optim-state")?
        && f != opts.strategies.optim_state
    {
        bail!(
            "--resume: the run in {} stores its optimizer state as {}; it cannot change to {f}",
            run.display(),
            opts.strategies.optim_state
        );
    }
    // The run's global batch (rows per optimizer step) stays unless asked otherwise.
    let (was, now) = (
        was_ranks * opts.strategies.grad_accum,
        ranks * opts.strategies.grad_accum,
    );
    if was != now && req.step.strategy.grad_accum.is_none() {
        let keep = (was % ranks == 0).then(|| was / ranks);
        opts.notes.push(format!(
            "memwall: warning: the run in {} stepped on {} rank(s) x --grad-accum {}; on {} \
             rank(s) each step takes {}x the rows{}",
            run.display(),
            was_ranks,
            opts.strategies.grad_accum,
            ranks,
            format_ratio(now, was),
            keep.map_or(String::new(), |k| format!(
                " (pass --grad-accum {k} to keep the global batch)"
            ))
        ));
    }
    opts.locate_base(&ck, req.step.model.is_some(), &mut |m: &str| {
        progress.message(m)
    })?;
    opts.strategies.base_types = kept_types(
        opts.init_gguf.as_deref(),
        opts.strategies.base_quant,
        "--init",
    )?;
    opts.locate_data(req.data.as_deref())?;
    // A cut given now (checked, `auto` resolved) for the run's model and micro-batch.
    if req.step.strategy.pp_layers.is_some() {
        let spec = ModelSpec::resolve(&opts.model)?;
        let mut strategies = Strategies {
            ranks: resumed.ranks,
            ..opts.strategies.clone()
        };
        let baseline = crate::util::rss::current_rss().unwrap_or(0);
        super::stages::resolve_cut(
            &mut strategies,
            &spec,
            (opts.batch, opts.seq, opts.threads),
            (opts.strategies.max_memory, baseline),
            opts.device.sizing(),
            &mut opts.notes,
        )?;
        opts.strategies.pipeline_layers = strategies.pipeline_layers;
    }
    Ok((opts, ck))
}

/// `--fit` for the new run `o`: the search, with the data open as the run will have it and
/// the baseline measured after the search handed its memory back; `o` takes the fastest
/// choice, its record (for plan.json) and that baseline (the run plans with it). The table
/// of the best goes to `progress`. Under mpirun (`comm` of several ranks) the search is of
/// the job's meshes too, and rank 0 alone runs it, with its calibration, and sends its
/// choice to the others ([`crate::dist::ring::broadcast_bytes`]), so every rank trains the
/// same configuration; each plans with its own baseline.
fn fit_run(
    o: &mut TrainOptions,
    req: &TrainRequest,
    comm: &dyn Comm,
    progress: &mut dyn Progress,
) -> Result<()> {
    let ranks = comm.size();
    let mut notes = Vec::new();
    let mut space = fit_space(&req.step, &mut notes, o.threads, o.batch, ranks)?;
    o.strategies = req.step.strategy.for_fit(req.step.max_memory);
    let budget = o
        .strategies
        .max_memory
        .context("--fit needs --max-memory: it picks the fastest plan that fits that budget")?;
    o.check()?;
    let (f, baseline, base_types) = with_data_open(o, |spec| {
        let asked = (req.step.strategy.lora.as_ref())
            .map(|l| l.spec(spec.family))
            .transpose()?;
        space.lora = match &req.init_adapter {
            Some(dir) => Some(adapter_spec(dir, spec, asked.as_ref(), &req.step.strategy)?),
            None => asked,
        };
        (space.base_quant, space.base_types) = base_storage(
            o.init_gguf.as_deref(),
            spec.family,
            lora_run(req),
            req.step.strategy.base_quant,
            "--init",
            &mut notes,
        )?;
        space.distill = o.distill(spec)?;
        if comm.rank() > 0 {
            // Rank 0's choice, made below.
            let baseline = crate::util::rss::current_rss().unwrap_or(0);
            return Ok((None, baseline, space.base_types.clone()));
        }
        // A GPU's choices are ranked by its own calibration, never the CPU's.
        let cal = crate::exec::calibrate::for_ranking(o.device, o.threads, "--fit")?;
        // The offload file goes to --offload-dir, else the run's `offload/`: its disk bounds it.
        if space.offload_dir.is_none() {
            space.offload_dir = Some(o.out.join(crate::run_dir::OFFLOAD_DIR));
        }
        let (f, baseline) = fit_measured(spec, &space, budget, &cal, o.device.sizing())?;
        Ok((Some((f, cal)), baseline, space.base_types.clone()))
    })?;
    // The micro-batch, the strategies and the search's record: rank 0's. Under mpirun every
    // rank, rank 0 too, takes them as sent, so their options are the same to the bit.
    type Choice = (usize, Strategies, Option<serde_json::Value>);
    let (batch, strategies, fit): Choice = match f {
        Some((f, cal)) => {
            for line in f.found.table(budget).lines() {
                progress.message(line);
            }
            progress.message(&format!(
                "training with the fastest: {}",
                f.found.ranked[0].flags()
            ));
            let r = Resolved::fitted(f, budget, req.step.strategy.offload_dir.clone(), cal);
            match ranks > 1 {
                true => {
                    let choice = serde_json::to_vec(&(r.batch, &r.strategies, &r.fit))?;
                    let sent = crate::dist::ring::broadcast_bytes(comm, 0, Some(choice))?;
                    serde_json::from_slice(&sent)?
                }
                false => (r.batch, r.strategies, r.fit),
            }
        }
        None => {
            let bytes = crate::dist::ring::broadcast_bytes(comm, 0, None)?;
            serde_json::from_slice(&bytes).context("internal error: rank 0's --fit choice")?
        }
    };
    o.notes.extend(notes);
    o.init_adapter = req.init_adapter.clone();
    o.batch = batch;
    // What the choice does not carry (the base's storage types, read from the file) is this
    // rank's own, the same as rank 0's.
    o.strategies = Strategies {
        base_types,
        ..strategies
    };
    o.fit = fit;
    o.planned_baseline = Some(baseline);
    Ok(())
}

/// `now / was` in words: `0.5`, `2`.
fn format_ratio(now: usize, was: usize) -> String {
    let r = now as f64 / was as f64;
    format!("{}", (r * 1000.0).round() / 1000.0)
}
