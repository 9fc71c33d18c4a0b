//! Setting a run up: everything that can be refused is checked before anything is written
//! (options, model, data, the plan against the budget), then the run directory is prepared,
//! `plan.json` written, the arena allocated once, and the initial state made: fresh weights,
//! `--init` weights, or a `--resume` checkpoint's weights, moments and position.

use super::run::Run;
use super::{Progress, TrainOptions};
use crate::ckpt;
use crate::data::loader::{BatchLoader, DataSet, Part, check_fits};
use crate::data::{check_tokenizer, tokenizer};
use crate::dist::Comm;
use crate::exec::LossScaler;
use crate::exec::executor::Executor;
use crate::ir::Precision;
use crate::model::lora::LoraSpec;
use crate::model::{Family, ModelSpec};
use crate::plan::Plan;
use crate::profile::leak::LeakCheck;
use crate::profile::{OpRecorder, Profile};
use crate::run_dir::{self, MetricsLog, PlanJson, RunDir};
use crate::util::bytes::fmt_bytes;
use crate::util::rss;
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

impl<'a> Run<'a> {
    /// Checks, plans, allocates and restores; on return the run is ready for its next step,
    /// which is below `opts.steps`.
    /// `baseline`: the process's resident memory to plan with, when `--fit`'s search
    /// measured it (`TrainOptions::planned_baseline`; else measured here, once the data is
    /// open).
    pub(super) fn start(
        opts: &'a TrainOptions,
        resume: Option<&Path>,
        baseline: Option<u64>,
        comm: Arc<dyn Comm>,
        progress: &mut dyn Progress,
    ) -> Result<Run<'a>> {
        opts.check()?;
        same_configuration(opts, resume, &*comm)?;
        // ---- everything that can be checked before work starts ----
        let spec = model_spec(opts, resume)?;
        let data = open_data(opts, &spec)?;
        let (rank, ranks) = (comm.rank(), comm.size());

        // ---- plan (refused before anything is written if over budget), then allocate once ----
        // A GPU's baseline is its context (the plan lives in device memory); else the
        // process's resident memory.
        let baseline = match opts.device.sizing().baseline_bytes() {
            Some(context) => context,
            None => baseline.unwrap_or_else(|| rss::current_rss().unwrap_or(0)),
        };
        let packed = data.packs(opts.no_pack);
        let (plan, calibration) = plan_for(opts, &spec, baseline, ranks, packed)?;
        let dir = RunDir::new(&opts.out);
        // Rank 0 owns the run directory; the others wait until it is there.
        if rank == 0 {
            prepare_run_dir(&dir, resume.is_some(), progress)?;
            let predicted = crate::plan::time::predict(&plan, &calibration);
            let budgets =
                crate::plan::Budgets::new(plan.compute_tier(), opts.strategies.max_memory, None);
            let mut plan_json = PlanJson::from_plan(&plan, baseline)?
                .with_budgets(&budgets)
                .with_prediction(&predicted, &calibration);
            plan_json.fit = opts.fit.clone();
            plan_json.write(&dir.plan())?;
        }
        comm.barrier()?;
        progress.message(&plan_line(opts, &spec, &plan, baseline));
        progress.message(&crate::exec::lr::describe(
            opts.steps,
            opts.warmup,
            opts.lr,
            opts.min_lr_frac,
        ));
        let (comm_thread, why) = crate::dist::comm_thread_wanted(opts.threads, ranks);
        if ranks > 1 {
            let thread = comm_thread;
            let mesh = plan.cfg.mesh;
            let layout = match (mesh.tensor, mesh.pipeline) {
                (1, 1) => String::new(),
                (t, p) => format!(
                    ": {p} pipeline stages x {t} tensor ranks x {} data ranks",
                    mesh.data
                ),
            };
            progress.message(&format!(
                "ranks: {ranks} ({}){layout}, --zero {}; rank 0 sends {} per step; collectives {} ({why})",
                comm.describe(),
                plan.cfg.zero,
                fmt_bytes(plan.comm_bytes_per_step()),
                if thread {
                    "beside compute, on a communication thread"
                } else {
                    "inline: no core to spare for a communication thread"
                }
            ));
        }
        let plan_total = plan.total_bytes();
        let predicted_peak = plan.predicted_peak(baseline);
        let mut ex = Executor::among(plan, opts.device.open()?, comm)?;
        ex.set_comm_thread(comm_thread);
        if let Some(note) = ex.offload_note() {
            progress.message(&note);
        }

        // ---- initial state ----
        let mut scaler = (opts.strategies.precision == Precision::F16).then(LossScaler::new);
        let (step, data_position) = match resume {
            Some(ck) => restore(ck, &dir, opts, &mut ex, &mut scaler, progress)
                .with_context(|| ckpt::unloadable_checkpoint_hint(dir.root(), ck))?,
            None => {
                let layout = ex.plan.layout.clone();
                match (&ex.plan.lora, &opts.init) {
                    (Some(_), _) => {
                        fill_base(&mut ex, opts)?;
                        match &opts.init_adapter {
                            Some(dir) => fill_adapter(&mut ex, dir)?,
                            None => {
                                // Fresh adapters (B = 0: the model starts as the base), drawn
                                // from a stream of their own.
                                let mut init = layout.initializer(adapter_seed(opts.seed));
                                ex.fill_params(|range, p| {
                                    init.fill(range, p);
                                    Ok(())
                                })?
                            }
                        }
                    }
                    (None, Some(dir)) => ckpt::load_params_by(dir, &layout, |copy| {
                        ex.fill_params(|r, p| copy(r, p))
                    })?,
                    (None, None) => {
                        let mut init = layout.initializer(opts.seed);
                        ex.fill_params(|range, p| {
                            init.fill(range, p);
                            Ok(())
                        })?
                    }
                }
                let _ = std::fs::remove_file(dir.metrics_of(rank));
                (0, 0)
            }
        };
        if step >= opts.steps {
            bail!(
                "the run in {} is already at step {step}; pass a larger --steps to continue",
                opts.out.display()
            );
        }

        // One loader batch is one optimizer step: grad_accum micro-batches of `batch` rows,
        // this rank's part of the step's rows.
        let rows = opts.batch * opts.strategies.grad_accum;
        // The data axis of the plan's mesh splits the rows.
        let part = Part::of_data_axis(&ex.plan.cfg.mesh);
        let loader = BatchLoader::part(
            data.train_source(packed),
            rows,
            opts.seq,
            opts.seed,
            data_position,
            part,
        )?;
        let batch = vec![0u32; rows * (opts.seq + 1)];
        let teacher = match &opts.distill_from {
            Some(dir) => Some(open_teacher(dir, opts, &spec, &data, &mut ex, progress)?),
            None => None,
        };
        // The teacher's own plan is held beside the student's, which counts it.
        if let (Some(t), Some(d)) = (&teacher, ex.plan.cfg.distill)
            && t.plan_bytes() != d.teacher_bytes
        {
            bail!(
                "internal error: the teacher's plan holds {} bytes, the student's plan counts {}",
                t.plan_bytes(),
                d.teacher_bytes
            );
        }
        if let Some((train, _)) = &data.examples {
            progress.message(&cut_examples(
                train.len(),
                train.longer_than(opts.seq + 1)?,
                opts.seq,
                packed,
            ));
        }
        let metrics = MetricsLog::append_to(&dir.metrics_of(rank))?;

        // Every rank profiles; rank 0 writes the files (the run directory's), with the
        // others' collectives (`profiling::gather_comm_spans`). The barrier lines up the
        // ranks' time zeros to within its own latency.
        if opts.profile_steps > 0 {
            ex.comm().barrier()?;
        }
        let epoch = Instant::now();
        let n_ops = ex.plan.schedule.ops.len();
        let profile = (opts.profile_steps > 0).then(|| Profile {
            baseline_rss: baseline,
            steps: Vec::new(),
        });
        let recorder = Some(OpRecorder::new(epoch, n_ops));
        let leak = LeakCheck::new(plan_total);
        progress.start(step, opts.steps);
        Ok(Run {
            opts,
            dir,
            spec,
            data,
            ex,
            teacher,
            scaler,
            loader,
            batch,
            metrics,
            step,
            first_step: step,
            baseline,
            plan_total,
            predicted_peak,
            warned_over_budget: false,
            // Every data rank's rows (tensor ranks and pipeline stages share theirs).
            tokens_per_step: (rows * opts.seq * opts.strategies.data_ranks()) as f64,
            epoch,
            n_ops,
            profile,
            recorder,
            leak,
            final_loss: f32::NAN,
            final_val: None,
            last_ckpt: None,
            timed_tokens: 0.0,
            timed_secs: 0.0,
            timed_comm_secs: 0.0,
            timed_comm_wait_secs: 0.0,
        })
    }
}

/// Opens distillation's teacher in `dir` (checked against the data's tokenizer) and fills its
/// head into the student's plan.
fn open_teacher(
    dir: &Path,
    opts: &TrainOptions,
    spec: &ModelSpec,
    data: &DataSet,
    ex: &mut Executor,
    progress: &mut dyn Progress,
) -> Result<crate::exec::teacher::Teacher> {
    let gpt2 = spec.family == Family::Gpt2;
    if let Some(id) = tokenizer::model_tokenizer_id(&[dir], gpt2)? {
        check_tokenizer(&id, &data.meta, &opts.data)
            .with_context(|| format!("--distill-from {}", dir.display()))?;
    }
    let teacher = crate::exec::teacher::Teacher::open(
        (dir, opts.distill_gguf.as_deref()),
        spec,
        (opts.seq, opts.threads, opts.device),
    )?;
    ex.fill_teacher_head(&mut |dst| teacher.copy_head(dst))?;
    let t = &teacher.spec;
    let held = match &opts.distill_gguf {
        Some(gguf) => format!("{}, kept as its blocks", gguf.display()),
        None => dir.display().to_string(),
    };
    progress.message(&format!(
        "distilling from {held} ({:.1}M parameters, width {}, {} held): loss = {} x \
         KL(teacher || model) + {} x cross-entropy; validation losses are the cross-entropy",
        t.num_params() as f64 / 1e6,
        t.n_embd,
        crate::util::bytes::fmt_bytes(teacher.plan_bytes()),
        opts.distill_alpha,
        1.0 - opts.distill_alpha
    ));
    Ok(teacher)
}

/// Refuses to start when this rank's configuration differs from rank 0's (ranks started
/// with different flags): every rank's hash of its options and resume point is gathered.
fn same_configuration(opts: &TrainOptions, resume: Option<&Path>, comm: &dyn Comm) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    use sha2::{Digest, Sha256};
    let mut mine = opts.clone();
    mine.strategies.rank = 0;
    let text = serde_json::to_string(&(mine, resume, env!("CARGO_PKG_VERSION")))?;
    let digest = Sha256::digest(text.as_bytes());
    let hash = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
    let mut all = vec![0u64; comm.size()];
    crate::dist::ring::gather_values(comm, &[hash], &mut all)?;
    if let Some(r) = all.iter().position(|&h| h != all[0]) {
        bail!(
            "rank {r} was started with a different configuration from rank 0's (flags, data, \
             run directory or memwall version differ); start every rank with the same command \
             (one `mpirun -np N memwall train ...`)"
        );
    }
    Ok(())
}

/// The model to train: the resumed checkpoint's, the `--init` checkpoint's, or `--model`;
/// `--model` must have the dimensions of the checkpoint it continues.
/// The process's resident memory once the run's model and data are open (the tokenizer
/// loaded and checked), as `Run::start` will measure it: what `--batch auto`, chosen
/// before the run starts, plans with (measured before opening them, it was lower than the
/// run's, and the choice could then fail the run's own budget check).
pub fn planning_baseline(opts: &TrainOptions) -> Result<u64> {
    with_data_open(opts, |_| Ok(rss::current_rss().unwrap_or(0)))
}

/// Runs `f` on the model of a new run with its data open, as `Run::start` will have them
/// (the tokenizer loaded and checked): what choices made before the run starts measure the
/// process with (`--batch auto`, `--fit`).
pub fn with_data_open<T>(
    opts: &TrainOptions,
    f: impl FnOnce(&ModelSpec) -> Result<T>,
) -> Result<T> {
    let spec = model_spec(opts, None)?;
    let data = open_data(opts, &spec)?;
    let out = f(&spec);
    drop(data);
    out
}

fn model_spec(opts: &TrainOptions, resume: Option<&Path>) -> Result<ModelSpec> {
    // A resumed full fine-tune holds its weights: its --init is not read again.
    let lora = opts.strategies.lora.is_some();
    let init_spec = match &opts.init {
        Some(dir) if resume.is_none() || lora => {
            Some(ckpt::load_spec(dir).with_context(|| format!("--init {}", dir.display()))?)
        }
        _ => None,
    };
    let spec = match (&init_spec, resume) {
        // A LoRA run's checkpoints hold adapters only: the base is its --init's (or --model).
        (Some(s), Some(_)) if opts.strategies.lora.is_some() => s.clone(),
        (None, Some(_)) if opts.strategies.lora.is_some() => ModelSpec::resolve(&opts.model)?,
        (_, Some(ck)) => {
            let saved = ckpt::load_spec(ck)?;
            let asked = ModelSpec::resolve(&opts.model)?;
            if !asked.same_dims(&saved) {
                bail!(
                    "--resume: the run in {} has model {} but the configuration asks for {}; model dimensions cannot change on resume",
                    opts.out.display(),
                    saved.describe(),
                    asked.describe()
                );
            }
            saved
        }
        (Some(s), None) => {
            let asked = ModelSpec::resolve(&opts.model)?;
            if !asked.same_dims(s) {
                bail!(
                    "--init checkpoint has model {} but --model is {}",
                    s.describe(),
                    asked.describe()
                );
            }
            s.clone()
        }
        (None, None) => ModelSpec::resolve(&opts.model)?,
    };
    spec.check_seq(opts.seq)?;
    Ok(spec)
}

/// The plan a run of `opts` trains from (with the calibration that priced it), on `ranks`
/// ranks with `baseline` bytes outside the plan, its rows packing examples when `packed`
/// ([`DataSet::packs`]): what the demos print is what runs.
pub fn plan_for(
    opts: &TrainOptions,
    spec: &ModelSpec,
    baseline: u64,
    ranks: usize,
    packed: bool,
) -> Result<(Plan, crate::plan::time::Calibration)> {
    let mut strategies = opts
        .strategies
        .with_offload_dir(&opts.out.join(crate::run_dir::OFFLOAD_DIR));
    strategies.packed = packed;
    strategies.distill = opts.distill(spec)?;
    // A GPU run is priced by the GPU's calibration where one is saved.
    let gpu = match opts.device.kind {
        crate::backend::DeviceKind::Cuda => {
            crate::exec::calibrate::for_device(opts.device, opts.threads)?
        }
        _ => None,
    };
    let calibration = match gpu {
        Some(c) => c,
        None => crate::exec::calibrate_transport::current(opts.threads, ranks)?,
    };
    let plan = strategies.plan(
        spec,
        (opts.batch, opts.seq, opts.threads),
        baseline,
        &calibration,
        opts.device.open()?,
    )?;
    Ok((plan, calibration))
}

/// Opens the prepared data and checks it suits the model and holds a sequence per split.
fn open_data(opts: &TrainOptions, spec: &ModelSpec) -> Result<DataSet> {
    let data = DataSet::open(&opts.data)?;
    // The model's tokenizer: a tokenizer.json beside --init or --model, else GPT-2's for GPT-2;
    // a model with neither gets only the vocabulary check below.
    let places: Vec<&Path> = opts
        .init
        .iter()
        .map(|p| p.as_path())
        .chain([Path::new(&opts.model)])
        .collect();
    if let Some(id) = tokenizer::model_tokenizer_id(&places, spec.family == Family::Gpt2)? {
        check_tokenizer(&id, &data.meta, &opts.data)?;
    }
    crate::data::check::check_vocabulary(&data.meta, spec.vocab_size, &opts.data)?;
    match &data.examples {
        // Examples are cut or padded to the sequence: any length fits, but a split whose
        // every trained token lies past a row would train (or measure) nothing.
        Some((train, val)) => {
            for (split, ex) in [("training", train), ("validation", val)] {
                if !ex.is_empty() && ex.first_trained_within(opts.seq + 1)?.is_none() {
                    bail!(
                        "--data {}: no {split} example has a trained token within a row of \
                         --seq {} (+ 1) tokens: each example is cut to a row, and every answer \
                         starts past it, so the run would {} nothing. Raise --seq (the \
                         examples' lengths: `memwall tokenize --chat`), or shorten what comes \
                         before the answers",
                        opts.data.display(),
                        opts.seq,
                        if split == "training" {
                            "train"
                        } else {
                            "measure"
                        }
                    );
                }
            }
        }
        None => {
            if opts.no_pack {
                bail!(
                    "--no-pack: the data in {} is raw text, drawn as windows of --seq tokens with \
                     nothing to pack; --no-pack is for chat data (examples, from `prepare` of \
                     .jsonl conversations): leave it out",
                    opts.data.display()
                );
            }
            check_fits(&data.train, "train", opts.seq)?;
            check_fits(&data.val, "val", opts.seq)?;
        }
    }
    Ok(data)
}

/// The line announcing how an examples data set's rows are made: packed or one example each,
/// examples longer than a row (`--seq + 1` tokens) cut to it (how many are), the loss on
/// trained tokens only.
fn cut_examples(examples: usize, cut: usize, seq: usize, packed: bool) -> String {
    let cut = match cut {
        0 => format!(
            "none is longer than a row (--seq {seq} tokens, and the one more that the last \
             predicts: {})",
            seq + 1
        ),
        n => format!(
            "{} {} longer than a row (--seq {seq} tokens, and the one more that the last \
             predicts: {}) and cut to it, losing what follows (a cut answer trains on its start \
             only; raise --seq to keep more)",
            crate::util::count(n as u64, "example"),
            if n == 1 { "is" } else { "are" },
            seq + 1
        ),
    };
    let rows = if packed {
        "packed several to a row, each attending only to itself (--no-pack: one a row)"
    } else {
        "one example per row, padded"
    };
    format!(
        "data: {} (chat): {rows}; the loss is on trained tokens only; {cut}",
        crate::util::count(examples as u64, "training example")
    )
}

/// Creates the run directory and checks it is writable; refuses to overwrite an earlier run.
/// What it removes (an interrupted save's temporaries) is said to `progress`.
fn prepare_run_dir(run: &RunDir, resuming: bool, progress: &mut dyn Progress) -> Result<()> {
    let out = run.root();
    if out.is_file() {
        bail!(
            "--out {}: is a file; give a directory for the run",
            out.display()
        );
    }
    // A directory memwall makes (new, or empty) is marked as its own: only then may a later
    // run replace it (the demos do), and only with nothing but a run's files in it.
    let fresh = std::fs::read_dir(out).map_or(true, |mut e| e.next().is_none());
    std::fs::create_dir_all(out)
        .with_context(|| format!("--out {}: cannot create the run directory", out.display()))?;
    if fresh {
        crate::util::owned_dir::mark(out, "memwall train")
            .with_context(|| format!("--out {}: directory is not writable", out.display()))?;
    }
    if !resuming {
        refuse_to_overwrite(out, fresh)?;
    }
    for stale in ckpt::retention::remove_stale_temporaries(out)? {
        progress.message(&format!(
            "memwall: removed {}, left by a save that was interrupted",
            stale.display()
        ));
    }
    let probe = run.write_probe();
    std::fs::write(&probe, b"ok")
        .with_context(|| format!("--out {}: directory is not writable", out.display()))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// What `prepare_run_dir` would refuse for a new run in `out`, checked before any work (a
/// GGUF `--init`'s conversion, the data opened): a file, an earlier run, files of a run's
/// names in a directory memwall did not make.
pub fn check_new_run_dir(out: &Path) -> Result<()> {
    if out.is_file() {
        bail!(
            "--out {}: is a file; give a directory for the run",
            out.display()
        );
    }
    let fresh = std::fs::read_dir(out).map_or(true, |mut e| e.next().is_none());
    refuse_to_overwrite(out, fresh).map_err(|e| match format!("{e}").starts_with("--out") {
        true => e,
        false => e.context(format!("--out {}", out.display())),
    })
}

/// What a new run in `out` (not resuming) must not overwrite: checkpoints (a run to continue
/// with `--resume`, or `step-N` directories it could not load, which it would write over), and
/// in a directory memwall did not make (no marker, and not empty before this run) any file of
/// the names a run writes (`plan.json`, `metrics.jsonl`, ...).
fn refuse_to_overwrite(out: &Path, fresh: bool) -> Result<()> {
    let dirs = ckpt::checkpoint_dirs(out)?;
    if dirs.iter().any(|d| d.is_complete()) {
        bail!(
            "--out {}: already holds a run with checkpoints; continue it with --resume {} or choose a new --out",
            out.display(),
            out.display()
        );
    }
    if let Some(d) = dirs.first() {
        bail!(
            "--out {}: {} is not a checkpoint memwall can load (missing or empty: {}), and a new \
             run would write over it; move it out of {} or choose a new --out",
            out.display(),
            d.path.display(),
            d.missing.join(", "),
            RunDir::new(out).checkpoints().display()
        );
    }
    if fresh || crate::util::owned_dir::is_marked(out) {
        return Ok(());
    }
    // Files only: in `checkpoints/` and `offload/` a run writes new names (the step
    // directories were checked above).
    let ours = |n: &str| {
        !crate::run_dir::is_run_entry(n)
            || n == crate::run_dir::WRITE_PROBE_FILE
            || n.starts_with('.')
            || out.join(n).is_dir()
    };
    let clash = crate::util::owned_dir::foreign_entries(out, &ours)?;
    if !clash.is_empty() {
        let names: Vec<String> = clash.iter().map(|p| p.display().to_string()).collect();
        bail!(
            "--out {}: a directory memwall did not make (it has no {} marker) holding {}, which \
             a run would overwrite; move them out, or choose a new --out",
            out.display(),
            crate::util::owned_dir::MARKER,
            names.join(", ")
        );
    }
    Ok(())
}

/// The lines that announce the plan: model, shape, strategies, memory, and the offload
/// file when there is one.
fn plan_line(opts: &TrainOptions, spec: &ModelSpec, plan: &Plan, baseline: u64) -> String {
    let offload = match (plan.nvme_bytes(), &plan.cfg.offload.dir) {
        (0, _) => String::new(),
        (bytes, Some(dir)) => format!(
            " ({} file in {})",
            fmt_bytes(bytes),
            dir.join(plan.program().disk_file()).display()
        ),
        (bytes, None) => format!(" ({} file)", fmt_bytes(bytes)),
    };
    let lora = match &plan.lora {
        Some(l) => format!(
            "\n      {}; base {}{}{}",
            l.describe(),
            plan.cfg.base_quant,
            match l.requantized.len() {
                0 => String::new(),
                n => format!(
                    " ({n} tensors as q8_0, converted from the file's blocks: parts of one \
                     product stored as different types, such as {})",
                    l.requantized[0]
                ),
            },
            match &opts.init {
                Some(_) => "",
                None => " (no --init: the base is randomly initialised, as for a benchmark)",
            }
        ),
        None => String::new(),
    };
    let update = crate::plan::report::describe_update(plan)
        .map(|u| format!("\n      {u}"))
        .unwrap_or_default();
    format!(
        "plan: {} | batch {} x grad-accum {} x seq {} | {} | recompute {} | optimizer state {} | offload {}{offload} | arena {} + outside the arena {} | predicted {} {}{lora}{update}",
        spec.describe(),
        opts.batch,
        opts.strategies.grad_accum,
        opts.seq,
        plan.cfg.precision,
        plan.cfg.recompute,
        plan.cfg.optim_state,
        plan.cfg.offload.set,
        fmt_bytes(plan.arena_bytes()),
        fmt_bytes(plan.external_bytes),
        match plan.compute_tier() {
            crate::ir::Tier::Device => "device peak",
            _ => "peak RSS",
        },
        fmt_bytes(plan.predicted_peak(baseline))
    )
}

/// Fills a LoRA plan's frozen base: the `--init` checkpoint's weights, or (planning and
/// benchmarks on a preset) the model's initialisation from the run's seed.
fn fill_base(ex: &mut Executor, opts: &TrainOptions) -> Result<()> {
    let Some(lora) = ex.plan.lora.clone() else {
        bail!("internal error: fill_base on a plan without LoRA");
    };
    // The GGUF file's own blocks, copied.
    if ex.plan.cfg.base_quant == crate::ir::BaseQuant::Keep {
        let Some(gguf) = &opts.init_gguf else {
            bail!("internal error: a kept base without its GGUF file");
        };
        let src = crate::gguf::base::BaseSource::open(gguf)?;
        return ex
            .fill_base_bytes(|t, storage, dst| src.copy(t, storage, dst))
            .with_context(|| format!("--init {}: loading the base's blocks", gguf.display()));
    }
    match &opts.init {
        Some(dir) => ckpt::load_params_by(dir, &lora.base, |copy| ex.fill_base(|r, p| copy(r, p)))
            .with_context(|| format!("--init {}: loading the base of --lora", dir.display())),
        None => {
            let mut init = lora.base.initializer(opts.seed);
            ex.fill_base(|range, p| {
                init.fill(range, p);
                Ok(())
            })
        }
    }
}

/// Fills a LoRA plan's adapters from the PEFT adapter in `dir` (a checkpoint of the run, or
/// `--init-adapter`), which must be the plan's adapters.
fn fill_adapter(ex: &mut Executor, dir: &Path) -> Result<()> {
    let Some(lora) = ex.plan.lora.clone() else {
        bail!("internal error: fill_adapter on a plan without LoRA");
    };
    ckpt::adapter::load_adapter_by(dir, &lora.base, |adapters, copy| {
        // The dropout is how the adapters train, not what they hold (`--lora-dropout` with
        // `--init-adapter` changes it).
        let held = LoraSpec {
            dropout: lora.adapters.spec.dropout,
            ..adapters.spec.clone()
        };
        if held != lora.adapters.spec {
            bail!(
                "{}: the adapter there ({:?}) is not the run's ({:?})",
                dir.display(),
                adapters.spec,
                lora.adapters.spec
            );
        }
        ex.fill_params(|r, p| copy(r, p))
    })?;
    Ok(())
}

/// The seed of fresh adapters' initialisation: not the base's stream (`seed`), so `A`
/// is not drawn from the numbers a randomly initialised base starts with.
fn adapter_seed(seed: u64) -> u64 {
    seed ^ 0x4c6f_5241 // "LoRA"
}

/// Loads checkpoint `ck` (weights, moments, loss scale) and cuts `metrics.jsonl` back to its
/// step; returns the step and the data position to continue from.
fn restore(
    ck: &Path,
    dir: &RunDir,
    opts: &TrainOptions,
    ex: &mut Executor,
    scaler: &mut Option<LossScaler>,
    progress: &mut dyn Progress,
) -> Result<(u64, u64)> {
    // Group by group where the state is offloaded: no host copy of the whole model.
    let layout = ex.plan.layout.clone();
    match ex.plan.lora.clone() {
        // The base as the run started (its --init), the adapters from the checkpoint.
        Some(_) => {
            fill_base(ex, opts)?;
            fill_adapter(ex, ck)?;
        }
        None => ckpt::load_params_by(ck, &layout, |copy| ex.fill_params(|r, p| copy(r, p)))?,
    }
    let format = ex.plan.cfg.optim_state;
    let model = match &ex.plan.lora {
        Some(l) => l.base.clone(),
        None => layout.clone(),
    };
    let st =
        ckpt::load_trainer_state_by(ck, (&layout, &model), format, |copy| ex.fill_moments(copy))?;
    run_dir::metrics::truncate(&dir.metrics_of(ex.comm().rank()), st.step)?;
    progress.message(&format!(
        "resuming from {} (step {})",
        ck.display(),
        st.step
    ));
    if let (Some(sc), Some(saved)) = (scaler.as_mut(), st.loss_scale) {
        sc.state = saved;
    }
    Ok((st.step, st.data_position))
}

/// The run's options with `tokenizer_dir` settled: a fresh run without one takes the `--init`
/// directory when it holds a `tokenizer.json`, else the `--model` argument when that is a
/// directory holding one; a resumed run keeps its own. A directory set (or kept) that holds
/// no `tokenizer.json` is refused before anything is written.
pub(super) fn with_tokenizer_dir(
    opts: &TrainOptions,
    resume: Option<&Path>,
) -> Result<TrainOptions> {
    let has_tokenizer = |d: &Path| d.join(ckpt::TOKENIZER_FILE).is_file();
    let mut o = opts.clone();
    if o.tokenizer_dir.is_none() && resume.is_none() {
        let model = Path::new(&o.model);
        o.tokenizer_dir = match &o.init {
            Some(init) if has_tokenizer(init) => Some(init.clone()),
            _ if model.is_dir() && has_tokenizer(model) => Some(model.to_path_buf()),
            _ => None,
        };
    }
    if let Some(d) = &o.tokenizer_dir
        && !has_tokenizer(d)
    {
        bail!(
            "tokenizer directory {} (the run's 'tokenizer_dir', whose tokenizer files every \
             checkpoint copies) has no {}; restore it, or for a resumed run remove \
             'tokenizer_dir' from the checkpoint's trainer_state.json to go on without them",
            d.display(),
            ckpt::TOKENIZER_FILE
        );
    }
    Ok(o)
}
