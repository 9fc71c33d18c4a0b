//! The `memwall` command line: thin wrappers over the library (see `memwall --help`); the
//! arguments are `cli.rs`'s, and what they ask is resolved by [`memwall::exec::resolve`].

mod cli;

use anyhow::{Context, Result, bail};
use clap::Parser;
use cli::{
    BenchArgs, CacheArgs, CalibrateArgs, Cli, Cmd, ConvertArgs, DemoArgs, DemoWhat, ExportArgs,
    MergeArgs, PlanArgs, PrepareArgs, PruneArgs, ReportArgs, SampleArgs, TokenizeArgs, TrainArgs,
};
use memwall::data::{Tokenizer, prepare};
use memwall::demo::{
    self, chat::ChatOptions, finetune::FinetuneOptions, shakespeare::ShakespeareOptions,
};
use memwall::exec::bench::{self, BenchOptions};
use memwall::exec::generate::{ChatRequest, SampleOptions, chat_text, sample_text};
use memwall::exec::resolve::{self, DEFAULT_BATCH, DEFAULT_SEQ};
use memwall::exec::train::{self, ConsoleProgress};
use memwall::gguf::{self, ConvertOptions};
use memwall::ir::RecomputeChoice;
use memwall::plan::{self, Mode, OffloadChoice, StepConfig, build_plan};
use memwall::run_dir::PlanJson;
use memwall::util::bytes::fmt_bytes;
use memwall::util::rss;
use std::io::Write;

/// The system allocator, with over-aligned heap blocks padded so that equal requests reuse
/// their chunk (the `gemm` crate's packing scratch; see `util::malloc`).
#[global_allocator]
static ALLOCATOR: memwall::util::malloc::PaddedAligned = memwall::util::malloc::PaddedAligned;

fn main() {
    // A reader that goes away (`memwall plan | head`) ends memwall as it ends any Unix tool,
    // quietly with status 141, instead of a panic at the next print (Rust ignores SIGPIPE).
    // SAFETY: sets the disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Demo(a) => demo_cmd(a),
        Cmd::Prepare(a) => prepare_cmd(a),
        Cmd::Tokenize(a) => tokenize_cmd(a),
        Cmd::Plan(a) => plan_cmd(a),
        Cmd::Train(a) => train_cmd(a),
        Cmd::Sample(a) => sample_cmd(a),
        Cmd::Bench(a) => bench_cmd(a),
        Cmd::Calibrate(a) => calibrate_cmd(a),
        Cmd::Report(a) => report_cmd(a),
        Cmd::Convert(a) => convert_cmd(a),
        Cmd::Export(a) => export_cmd(a),
        Cmd::Cache(a) => cache_cmd(a),
        Cmd::Merge(a) => merge_cmd(a),
        Cmd::Prune(a) => prune_cmd(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        // A device this build or machine lacks is a usage error, as clap's are.
        let unavailable = e.chain().any(|c| c.is::<memwall::backend::Unavailable>());
        std::process::exit(if unavailable { 2 } else { 1 });
    }
}

/// The `--threads` of a command that runs on this machine (checked, with a warning above
/// its cores), or all its cores.
fn threads(t: Option<usize>) -> Result<usize> {
    checked_threads(t, true)
}

/// [`threads`] for a command that may plan for another machine (`runs_here` false): no
/// warning above this machine's cores, only absurd counts refused.
fn checked_threads(t: Option<usize>, runs_here: bool) -> Result<usize> {
    let cores = train::default_threads();
    let Some(n) = t else { return Ok(cores) };
    if let Some(warning) = memwall::util::threads::check_count(n, cores, runs_here)? {
        eprintln!("memwall: warning: {warning}");
    }
    Ok(n)
}

fn demo_cmd(a: DemoArgs) -> Result<()> {
    match a.what {
        None => demo::shakespeare::run(&ShakespeareOptions {
            out: a.out,
            steps: a.steps,
            threads: threads(a.threads)?,
        }),
        Some(DemoWhat::Finetune(f)) => {
            let mut o = FinetuneOptions::new(&f.out, threads(f.threads)?);
            o.steps = f.steps;
            demo::finetune::run(&o).map(|_| ())
        }
        Some(DemoWhat::Chat(c)) => {
            let mut o = ChatOptions::new(&c.out, threads(c.threads)?);
            o.steps = c.steps;
            demo::chat::run(&o).map(|_| ())
        }
    }
}

fn prepare_cmd(a: PrepareArgs) -> Result<()> {
    // An input given twice (or a file and the folder holding it) would be read twice: its
    // validation lines would copy training ones.
    let canonical: Vec<_> = (a.inputs.iter())
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
        .collect();
    for (i, p) in canonical.iter().enumerate() {
        if let Some(j) = (0..canonical.len()).find(|&j| j != i && p.starts_with(&canonical[j])) {
            anyhow::bail!(
                "{}: given twice (it is {}): each input is read once; give it once",
                a.inputs[i].display(),
                match p == &canonical[j] {
                    true => format!("also {}", a.inputs[j].display()),
                    false => format!("inside {}", a.inputs[j].display()),
                }
            );
        }
    }
    let tok = Tokenizer::load(&a.tokenizer, &mut say).context("--tokenizer")?;
    if memwall::data::chat::is_chat_input(&a.inputs, &mut |n| eprintln!("{n}"))? {
        return prepare_chat_cmd(a, tok);
    }
    if a.chat_template.is_some() || a.train_on.is_some() {
        anyhow::bail!(
            "--chat-template and --train-on are for chat data (.jsonl or .jsonl.gz files, or \
             folders of them), and the inputs are text"
        );
    }
    let s = prepare::prepare_with(
        &prepare::PrepareOptions {
            inputs: a.inputs,
            out: a.out,
            val_fraction: a.val_fraction,
        },
        &tok,
    )?;
    println!(
        "prepared {} ({}): {} train tokens, {} val tokens in {} with tokenizer {}",
        memwall::util::count(s.files as u64, "file"),
        fmt_bytes(s.bytes),
        s.train_tokens,
        s.val_tokens,
        s.out.display(),
        tok.id().describe()
    );
    Ok(())
}

fn prepare_chat_cmd(a: PrepareArgs, tok: Tokenizer) -> Result<()> {
    use memwall::data::chat::{ChatPrepareOptions, ChatTemplate, Encoder, prepare_chat};
    let file = Tokenizer::file_of(&a.tokenizer, &mut say)?;
    let dir = file.as_deref().and_then(std::path::Path::parent);
    let template = ChatTemplate::load(dir, a.chat_template.as_deref())?;
    // Raw `text` lines need no template; a conversation without one is refused at its line.
    let described = tok.id().describe();
    let encoder = Encoder::new(tok, template, a.train_on.unwrap_or_default());
    let s = prepare_chat(
        &ChatPrepareOptions {
            inputs: a.inputs,
            out: a.out,
            val_fraction: a.val_fraction,
        },
        &encoder,
        &mut std::io::stderr(),
    )?;
    let by: Vec<String> = s
        .formats
        .iter()
        .map(|(f, n)| format!("{n} {}", f.name()))
        .collect();
    println!(
        "prepared {} ({}) in {} with tokenizer {described}: train {} ({} tokens, {} trained), val \
         {} ({} tokens, {} trained); {} without an assistant turn left out",
        memwall::util::count(s.train.examples + s.val.examples, "example"),
        by.join(", "),
        s.out.display(),
        memwall::util::count(s.train.examples, "example"),
        s.train.tokens,
        s.train.trained_tokens,
        memwall::util::count(s.val.examples, "example"),
        s.val.tokens,
        s.val.trained_tokens,
        memwall::util::count(s.no_assistant, "conversation"),
    );
    Ok(())
}

fn tokenize_cmd(a: TokenizeArgs) -> Result<()> {
    use memwall::data::chat::{ChatTemplate, Encoder, show};
    use std::io::IsTerminal;
    let tok = Tokenizer::load(&a.tokenizer, &mut say).context("--tokenizer")?;
    let file = Tokenizer::file_of(&a.tokenizer, &mut say)?;
    let dir = file.as_deref().and_then(std::path::Path::parent);
    let template = ChatTemplate::load(dir, a.chat_template.as_deref())?;
    let encoder = Encoder::new(tok, template, a.train_on);
    let style = if a.json {
        show::Style::Json
    } else if std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none() {
        show::Style::Color
    } else {
        show::Style::Brackets
    };
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let counts = show::show(&a.chat, &encoder, style, &mut out, &mut std::io::stderr())?;
    out.flush()?;
    eprintln!("{}", counts.describe());
    Ok(())
}

/// One line: the plan's predicted step time, its bound, and where the calibration came from.
fn time_line(plan: &plan::Plan, t: &plan::time::StepTime, cal: &plan::time::Calibration) -> String {
    let tokens = (plan.cfg.batch * plan.cfg.grad_accum * plan.cfg.seq) as f64;
    let mut comm = if plan.cfg.mesh.world() > 1 {
        format!(
            "\n  predicted collectives         {:.2} s beside compute, {:.2} s of it exposed ({})",
            t.comm_s,
            t.comm_wait_s,
            cal.describe_transport(plan.cfg.mesh.world())
        )
    } else {
        String::new()
    };
    if t.bubble_s > 0.0 {
        let per = match plan.cfg.pipeline_chunks {
            0 | 1 => "micro-batches".to_string(),
            v => format!("({v} x micro-batches)"),
        };
        comm.push_str(&format!(
            "\n  predicted pipeline bubble     {:.2} s idle in the step ((pp - 1)/{per} of its forward and backward)",
            t.bubble_s
        ));
    }
    // Beneath a GPU the transfers cross its bus, and updates may run on the host's cores.
    let gpu = plan.compute_tier() == memwall::ir::Tier::Device;
    let host = match t.host_s > 0.0 {
        true => format!(", host AdamW {:.2} s", t.host_s),
        false => String::new(),
    };
    format!(
        "  predicted step time          {:.2} s ({:.0} tokens/s; {}-bound: compute {:.2} s, {} {:.2} s{host}, waiting {:.2} s){comm}\n  time model                   {}",
        t.step_s,
        tokens / t.step_s,
        format!("{:?}", t.bound).to_lowercase(),
        t.compute_s,
        if gpu { "bus" } else { "disk" },
        t.io_s,
        t.stall_s,
        cal.describe()
    )
}

fn plan_cmd(a: PlanArgs) -> Result<()> {
    let req = resolve::StepRequest {
        distill_from: a.distill_from.clone(),
        distill_alpha: a.distill_alpha,
        ..a.step.request()
    };
    // A plan needs only the device's sizing: made for a GPU on any machine.
    let backend = req.device.sizing();
    let threads = checked_threads(req.threads, false)?;
    let baseline = backend
        .baseline_bytes()
        .unwrap_or_else(|| rss::current_rss().unwrap_or(0));
    let resolve::PlanTarget { spec, resolved: r } =
        resolve::plan_target(&req, a.ranks, threads, baseline, DEFAULT_BATCH, &mut say)?;
    print_notes(&r.notes);
    let cfg = r
        .strategies
        .step_config(r.batch, a.step.seq.unwrap_or(DEFAULT_SEQ), threads);
    let (recompute, offload) = (r.strategies.recompute, r.strategies.offload);
    // A GPU's times come from its own calibration, or are not given (never the CPU's).
    let gpu = req.device.kind == memwall::backend::DeviceKind::Cuda;
    let gpu_cal = match gpu {
        true => memwall::exec::calibrate::for_device(req.device, threads)?,
        false => None,
    };
    let cal = match (&r.cal, &gpu_cal) {
        (Some(c), _) | (None, Some(c)) => c.clone(),
        (None, None) => memwall::exec::calibrate_transport::current(threads, a.ranks)?,
    };
    let timed = !gpu || r.cal.is_some() || gpu_cal.is_some();
    // An over-budget fixed choice still prints its plan, then the refusal.
    let plan = match (recompute, offload) {
        (RecomputeChoice::Fixed(rc), OffloadChoice::Set(_)) => build_plan(
            &spec,
            &StepConfig {
                recompute: rc,
                ..cfg.clone()
            },
            Mode::Train,
            backend,
        )?,
        choice => plan::fit::plan_fitting(
            &spec,
            &cfg,
            Mode::Train,
            choice,
            (a.step.max_memory, a.step.max_host_memory, baseline),
            &cal,
            backend,
        )?,
    };
    let predicted = plan::time::predict(&plan, &cal);
    // Each tier's budget: --max-memory for the tier ops compute on, the free space of
    // --offload-dir for the disk (when the plan puts anything there).
    let disk_free = match a.step.strategy.offload_dir.as_deref() {
        Some(dir) if plan.nvme_bytes() > 0 => Some(memwall::mem::disk::free_bytes_for(dir)?),
        _ => None,
    };
    let budgets = plan::Budgets::new(plan.compute_tier(), a.step.max_memory, disk_free)
        .with_host(plan.compute_tier(), a.step.max_host_memory);
    // Every rank of a job of several, planned once per distinct plan.
    let every = match plan.cfg.mesh.world() > 1 {
        true => Some(plan::ranks::every_rank_timed(
            &spec,
            &plan.cfg,
            backend,
            baseline,
            timed.then_some(&cal),
        )?),
        false => None,
    };
    let plan_json = || -> Result<PlanJson> {
        let mut p = PlanJson::from_plan(&plan, baseline)?.with_budgets(&budgets);
        p.ranks = every.as_ref().map(serde_json::to_value).transpose()?;
        if timed {
            p = p.with_prediction(&predicted, &cal);
        }
        p.fit = r.fit.clone();
        Ok(p)
    };
    if let Some(path) = &a.svg {
        let data = plan_json()?;
        let tl = memwall::profile::timeline::MemoryTimeline::new(&data);
        let svg = memwall::profile::chart::memory_svg(&data, &tl, None, baseline)?;
        std::fs::write(path, svg)
            .with_context(|| format!("--svg {}: cannot write the file", path.display()))?;
    }
    if a.json {
        println!("{}", plan_json()?.to_pretty_json()?);
    } else {
        if let (Some(found), Some(budget)) = (&r.found, a.step.max_memory) {
            print!("{}", found.table(budget));
            println!("plan of the fastest:");
        }
        print!(
            "{}",
            plan::report::table(&plan, baseline, &budgets, backend)
        );
        if !timed {
            // No GPU calibration: no figure rather than the CPU's.
            println!(
                "  predicted step time          not modelled: no GPU calibration here (run \
                 `memwall calibrate --device cuda` on the GPU machine; it saves \
                 calibration/cuda-<gpu>.json in the user cache, which plans anywhere use \
                 when copied there)"
            );
        } else {
            println!("{}", time_line(&plan, &predicted, &cal));
        }
        if plan.nvme_bytes() > 0 {
            print_disk_time(&plan, a.step.strategy.offload_dir.as_deref())?;
        }
        if plan.compute_tier() != memwall::ir::Tier::Host
            && plan.tier_bytes(memwall::ir::Tier::Host) > 0
        {
            print_bus_time(&plan, &cal);
        }
        if let Some(every) = &every {
            print_every_rank(every);
            print!(
                "{}",
                plan::ranks::describe_stages(every, &plan.cfg, spec.n_layer)
            );
        }
        if let Some(path) = &a.svg {
            println!("  memory timeline drawn to {}", path.display());
        }
        if a.step.max_memory.is_none() && backend.baseline_bytes().is_some() {
            println!(
                "  give --max-memory with the card's memory (e.g. 80GiB, 24GiB) to check it fits"
            );
        }
    }
    if let Some(budget) = a.step.max_memory {
        plan::fit::check_budget(&plan, budget, baseline, backend)?;
        // The ranks differ (pipeline stages, the first tensor rank): the heaviest decides.
        if let Some(heaviest) = every
            .iter()
            .flatten()
            .max_by_key(|r| r.predicted_peak_rss_bytes)
            .filter(|r| r.predicted_peak_rss_bytes > budget)
        {
            let c = &heaviest.coords;
            anyhow::bail!(
                "rank {} (pipeline stage {}, tensor rank {}, data rank {}) does not fit \
                 --max-memory {}: its predicted peak is {}; more --pp stages or --tp ranks, \
                 --zero 1-3, --recompute full or a smaller --batch (with --grad-accum) lower it",
                heaviest.rank,
                c.pp,
                c.tp,
                c.dp,
                fmt_bytes(budget),
                fmt_bytes(heaviest.predicted_peak_rss_bytes)
            );
        }
        if !a.json {
            println!("  fits --max-memory {}", fmt_bytes(budget));
        }
    } else if !a.json
        && backend.baseline_bytes().is_none()
        && let Some(available) = rss::available_memory()
    {
        // The heaviest rank's peak (ranks differ: pipeline stages, the first tensor rank).
        let peak = (every.iter().flatten())
            .map(|r| r.predicted_peak_rss_bytes)
            .max()
            .unwrap_or_else(|| plan::fit::predicted_peak(&plan, baseline));
        println!("{}", fits_this_machine(peak, available, a.ranks));
    }
    if let Some(host) = a.step.max_host_memory {
        plan::fit::check_host_budget(&plan, Some(host))?;
        if !a.json {
            println!("  fits --max-host-memory {}", fmt_bytes(host));
        }
    }
    Ok(())
}

/// The job's ranks by predicted peak, heaviest first (`plan --ranks N`).
fn print_every_rank(every: &[plan::ranks::RankPlan]) {
    println!("  every rank's predicted peak (heaviest first; --json lists each rank):");
    for (peak, ranks) in plan::ranks::by_peak(every) {
        let r = &every[ranks[0]];
        println!(
            "    {:>10}  {} ({} parameters{})",
            fmt_bytes(peak),
            plan::ranks::describe_ranks(&ranks),
            r.num_params,
            if ranks.len() > 1 { " each" } else { "" }
        );
    }
}

/// What resolving a request had to tell the user, on stderr.
fn print_notes(notes: &[String]) {
    for note in notes {
        eprintln!("{note}");
    }
}

/// What the library says while it works (a GGUF file's conversion, a wait for another
/// process's): each line on stderr, when it is said.
fn say(line: &str) {
    eprintln!("{line}");
}

/// Whether a plan's predicted peak fits the memory available on this machine now, and
/// what to do when it does not (`plan` without `--max-memory`).
fn fits_this_machine(peak: u64, available: u64, ranks: usize) -> String {
    let per = if ranks > 1 {
        " (the heaviest rank's)"
    } else {
        ""
    };
    if peak <= available {
        format!(
            "  fits this machine: predicted peak{per} {} of {} available now",
            fmt_bytes(peak),
            fmt_bytes(available)
        )
    } else {
        format!(
            "  does NOT fit this machine: predicted peak{per} {} but {} available now; \
             `--max-memory {} --fit` finds the fastest plan that does",
            fmt_bytes(peak),
            fmt_bytes(available),
            fmt_gib_floor(available)
        )
    }
}

/// `bytes` as a `--max-memory` value: whole GiB, rounded down (at least 1GiB).
fn fmt_gib_floor(bytes: u64) -> String {
    format!("{}GiB", (bytes >> 30).max(1))
}

/// A GPU plan's traffic with pinned RAM a step, and what it takes at the bus's rates (its
/// calibration's, or the nominal ones, said so): the copies run in turn on one stream, so
/// the two directions add up.
fn print_bus_time(plan: &plan::Plan, cal: &plan::time::Calibration) {
    let (read, written) = plan.io_bytes_per_step();
    let rates = cal.rates_to(memwall::ir::Tier::Host);
    let seconds = read as f64 / rates.read_bytes_per_s + written as f64 / rates.write_bytes_per_s;
    println!(
        "  host RAM counts              the pinned arena and the loader's buffers; the process's \
         own resident memory (CUDA's libraries: not planned yet) comes on top"
    );
    println!(
        "  pinned RAM <-> device        {} in, {} out a step: {:.3} s of copies at {:.0} / {:.0} GB/s (one copy stream: in and out in turn){}",
        fmt_bytes(read),
        fmt_bytes(written),
        seconds,
        rates.read_bytes_per_s / 1e9,
        rates.write_bytes_per_s / 1e9,
        match cal.bus {
            Some(_) => " (measured)",
            None => " (assumed: `memwall calibrate --device cuda` measures the bus)",
        }
    );
}

/// Checks that the plan's offload file fits the free space of `--offload-dir`, probes that
/// disk (512 MiB written and read back, or half its free space where less) and prints how
/// long the plan's transfers of a step take on it; without the flag, says how to get that.
fn print_disk_time(plan: &plan::Plan, dir: Option<&std::path::Path>) -> Result<()> {
    let Some(dir) = dir else {
        println!(
            "  disk time                    pass --offload-dir DIR to measure that disk and predict a step's I/O time"
        );
        return Ok(());
    };
    let free = memwall::mem::disk::check_room(dir, plan.nvme_bytes(), "the plan's offload file")?;
    println!(
        "  offload file fits the disk   {} of {} free at {}",
        fmt_bytes(plan.nvme_bytes()),
        fmt_bytes(free),
        dir.display()
    );
    let speed = memwall::mem::probe::probe(dir, memwall::mem::probe::probe_size(dir)?)?;
    let (read, written) = plan.io_bytes_per_step();
    let gbs = |x: f64| format!("{:.2} GB/s", x / 1e9);
    println!(
        "  disk at {} (probed {}{})   read {}, write {}: a step's transfers take at least {:.1} s",
        dir.display(),
        fmt_bytes(speed.bytes),
        if speed.direct {
            ", direct I/O"
        } else {
            ", buffered"
        },
        gbs(speed.read_bytes_per_s),
        gbs(speed.write_bytes_per_s),
        speed.io_seconds(read, written)
    );
    Ok(())
}

fn train_cmd(a: TrainArgs) -> Result<()> {
    let comm = memwall::dist::world(a.step.strategy.zero)?;
    let result = train_rank(a, comm.clone());
    if let Err(e) = &result
        && comm.size() > 1
    {
        // The other ranks may be waiting on this one: the error is printed, then every
        // rank's process ends (MPI would otherwise wait, even in finalising).
        eprintln!("error (rank {}): {e:#}", comm.rank());
        comm.abort(1);
    }
    result
}

/// `train` as this process's rank of `comm`.
fn train_rank(a: TrainArgs, comm: std::sync::Arc<dyn memwall::dist::Comm>) -> Result<()> {
    let rank = comm.rank();
    let world = comm.clone();
    // Rank 0 reports, every rank's memory line included (the others send it theirs).
    let mut console = ConsoleProgress::new(10);
    let mut quiet = train::NoProgress;
    let progress: &mut dyn train::Progress = if rank == 0 { &mut console } else { &mut quiet };
    let req = a.request();
    let summary = if let Some(run) = &req.resume {
        let (opts, ck) = resolve::resume(&req, run, comm.size(), progress)?;
        print_notes(&opts.notes);
        checked_threads(Some(opts.threads), true).with_context(|| {
            format!(
                "--resume {}: the run's thread count (its trainer state's, unless --threads \
                 gives another)",
                run.display()
            )
        })?;
        train::train_among(&opts, Some(&ck), comm, progress)?
    } else {
        let o = resolve::new_run(&req, threads(req.step.threads)?, &*comm, progress)?;
        print_notes(&o.notes);
        train::train_among(&o, None, comm, progress)?
    };
    let lines = ranks_memory_lines(&*world, &summary)?;
    if rank == 0 {
        print_summary(&summary);
        for line in lines {
            println!("{line}");
        }
    }
    Ok(())
}

/// Rank 0's lines for the other ranks' memory, in rank order: each rank sends rank 0 its peak
/// (0 where unmeasured), plan and baseline; the others get an empty list.
fn ranks_memory_lines(
    comm: &dyn memwall::dist::Comm,
    summary: &train::TrainSummary,
) -> Result<Vec<String>> {
    let (rank, size) = (comm.rank(), comm.size());
    let mine: Vec<u8> = [
        summary.peak_rss_bytes.unwrap_or(0),
        summary.plan_total_bytes,
        summary.baseline_bytes,
    ]
    .iter()
    .flat_map(|v| v.to_le_bytes())
    .collect();
    if rank != 0 {
        comm.send(&mine, 0)?;
        return Ok(Vec::new());
    }
    let mut lines = Vec::with_capacity(size.saturating_sub(1));
    let mut theirs = [0u8; 24];
    for from in 1..size {
        comm.recv(&mut theirs, from)?;
        let v = |i: usize| u64::from_le_bytes(theirs[8 * i..8 * i + 8].try_into().unwrap());
        lines.push(format!(
            "rank {from}: peak RSS {} (plan {} + baseline {})",
            match v(0) {
                0 => "?".to_string(),
                peak => fmt_bytes(peak),
            },
            fmt_bytes(v(1)),
            fmt_bytes(v(2))
        ));
    }
    Ok(lines)
}

fn print_summary(s: &train::TrainSummary) {
    println!("{}", s.describe());
}

fn sample_cmd(a: SampleArgs) -> Result<()> {
    // clap drops `requires = "chat"` when --prompt (which conflicts with --chat) is given.
    if a.chat.is_none() && (a.system.is_some() || a.chat_template.is_some()) {
        bail!(
            "--system and --chat-template shape a chat turn: give the message with --chat TEXT \
             (--prompt continues raw text, with no template)"
        );
    }
    // The adapter is checked before a GGUF model's conversion.
    if let Some(dir) = &a.adapter {
        let ad = memwall::ckpt::adapter::check_adapter_dir(dir, "--adapter")?;
        memwall::ckpt::adapter::check_base(&ad, &a.model)?;
    }
    let opts = SampleOptions {
        checkpoint: gguf::cache::model_dir(&a.model, "--model", &mut say)?,
        prompt: a.prompt.clone(),
        tokens: a.tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        threads: threads(a.threads)?,
        device: a.device,
        adapter: a.adapter.clone(),
        stop: Vec::new(),
    };
    let mut out = std::io::stdout();
    // The prompt is printed with the first new text, so a run that fails before it (a
    // missing tokenizer, a foreign adapter) prints nothing on stdout.
    let mut head = match &a.chat {
        Some(_) => None,
        None => Some(a.prompt.clone()),
    };
    let mut print = |s: &str| {
        if let Some(h) = head.take() {
            let _ = out.write_all(h.as_bytes());
        }
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    };
    match &a.chat {
        Some(user) => {
            let chat = ChatRequest {
                user: user.clone(),
                system: a.system.clone(),
                template: a.chat_template.clone(),
            };
            chat_text(&opts, &chat, &mut print, &mut say)?;
        }
        None => {
            sample_text(&opts, &mut print, &mut say)?;
        }
    }
    print("");
    println!();
    Ok(())
}

fn bench_cmd(a: BenchArgs) -> Result<()> {
    if let Some(z) = a.strategy.zero {
        bail!(
            "--zero {z}: bench measures one process; time ranks with `mpirun -np N memwall train ... --zero {z} --eval-every 0` (its summary gives tokens/s and the time in collectives; metrics.jsonl has comm_s and comm_bytes per step), or see a rank's plan with `memwall plan --ranks N --zero {z}`"
        );
    }
    if memwall::dist::launched() {
        bail!(
            "bench measures one process; under mpirun each rank would bench alone: time ranks with `mpirun -np N memwall train ... --eval-every 0`"
        );
    }
    let mut strategies = a.strategy.request().strategies(a.max_memory)?;
    resolve::check_host_memory_flag(a.max_host_memory, a.device)?;
    strategies.max_host_memory = a.max_host_memory;
    if let Some(l) = a.strategy.request().lora {
        let family = memwall::model::ModelSpec::resolve(&a.model)?.family;
        strategies.lora = Some(l.spec(family)?);
    }
    let opts = BenchOptions {
        model: a.model,
        batch: a.batch,
        seq: a.seq,
        steps: a.steps,
        threads: threads(a.threads)?,
        seed: a.seed,
        time_ops: a.time_ops,
        packed: a.packed.map(|n| n as usize),
        strategies,
        profile: a.profile,
        device: a.device,
    };
    eprintln!(
        "bench: model {} batch {} x grad-accum {} seq {} threads {} {} recompute {} optimizer state {}{}{}, 1 warm-up + {} timed steps",
        opts.model,
        opts.batch,
        opts.strategies.grad_accum,
        opts.seq,
        opts.threads,
        opts.strategies.precision,
        opts.strategies.recompute,
        opts.strategies.optim_state,
        match opts.strategies.update {
            memwall::ir::Update::End => "",
            memwall::ir::Update::InBackward => " update in-backward",
        },
        opts.profile
            .as_ref()
            .map(|d| format!(", profiling into {}", d.display()))
            .unwrap_or_default(),
        opts.steps
    );
    let report = bench::run(&opts, &mut |i, dt| {
        eprintln!(
            "  step {i}: {dt:.3} s{}",
            if i == 0 { " (warm-up)" } else { "" }
        )
    })?;
    eprintln!("  {}", bench::summary(&report));
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

fn calibrate_cmd(a: CalibrateArgs) -> Result<()> {
    use memwall::exec::calibrate;
    if memwall::dist::launched() {
        return calibrate_transport_cmd(a);
    }
    let opts = calibrate::CalibrateOptions {
        threads: threads(a.threads)?,
        offload_dir: a.offload_dir,
        quick: a.quick,
        device: a.device,
    };
    // Checked before the minute of measuring, so a machine with no cache fails at once.
    calibrate::cache_file(opts.threads)
        .context("no user cache to save the calibration in: set HOME or XDG_CACHE_HOME")?;
    match opts.device.kind {
        memwall::backend::DeviceKind::Cuda => eprintln!(
            "calibrating the GPU {} (its ops, at a GPU's sizes: a minute or two)",
            opts.device
        ),
        _ => eprintln!(
            "calibrating {} on {} threads (about a minute on 2 cores)",
            memwall::util::machine::cpu_name(),
            opts.threads
        ),
    }
    let cal = calibrate::run(&opts, &mut |s| eprintln!("  {s}"))?;
    let path = calibrate::cache_file_of(&cal)
        .context("no user cache to save the calibration in: set HOME or XDG_CACHE_HOME")?;
    calibrate::save(&cal, &path)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&cal)?);
        return Ok(());
    }
    println!("{}", cal.describe());
    print_costs(&cal.kinds);
    println!("saved to {}", path.display());
    Ok(())
}

/// `calibrate` under mpirun: the collectives among the ranks, saved by rank 0.
fn calibrate_transport_cmd(a: CalibrateArgs) -> Result<()> {
    use memwall::exec::calibrate_transport as transport;
    if let Some(dir) = &a.offload_dir {
        bail!(
            "--offload-dir {}: under mpirun `calibrate` measures the transport only; measure the disk with `memwall calibrate --offload-dir {}` alone",
            dir.display(),
            dir.display()
        );
    }
    let comm = memwall::dist::world(None)?;
    let rank = comm.rank();
    let result = (|| -> Result<()> {
        let path = transport::cache_file(comm.size())
            .context("no user cache to save the calibration in: set HOME or XDG_CACHE_HOME")?;
        if rank == 0 {
            eprintln!(
                "measuring the collectives among {} ranks over {} (about 10 s on 2 ranks)",
                comm.size(),
                comm.describe()
            );
        }
        let t = transport::measure(comm.as_ref(), &mut |s| {
            if rank == 0 {
                eprintln!("  {s}");
            }
        })?;
        if rank != 0 {
            return Ok(());
        }
        transport::save(&t, &path)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&t)?);
            return Ok(());
        }
        println!(
            "collectives among {} ranks over {}, measured {}",
            t.ranks, t.transport, t.at
        );
        print_costs(&t.kinds);
        println!("saved to {}", path.display());
        Ok(())
    })();
    if let Err(e) = &result
        && comm.size() > 1
    {
        eprintln!("error (rank {rank}): {e:#}");
        comm.abort(1);
    }
    result
}

/// A table of fitted costs by op kind (GB/s: bytes moved, or for a collective, sent).
fn print_costs(kinds: &std::collections::BTreeMap<String, plan::time::Cost>) {
    println!(
        "  {:<26} {:>10} {:>12} {:>9} {:>8} {:>8}",
        "op kind", "GFLOP/s", "GB/s", "us/call", "ops", "fit err"
    );
    for (k, c) in kinds {
        let rate = |s: f64, unit: f64| {
            if s > 0.0 {
                format!("{:.1}", 1.0 / s / unit)
            } else {
                "-".into()
            }
        };
        println!(
            "  {:<26} {:>10} {:>12} {:>9.1} {:>8} {:>7.1}%",
            k,
            rate(c.s_per_flop, 1e9),
            rate(c.s_per_byte, 1e9),
            c.s_per_op * 1e6,
            c.samples,
            c.fit_error_pct
        );
    }
}

fn convert_cmd(a: ConvertArgs) -> Result<()> {
    let s = gguf::convert(&ConvertOptions {
        input: a.input,
        out: a.out,
        dtype: a.dtype,
        force: a.force,
        progress: true,
    })?;
    println!("{}", s.describe());
    Ok(())
}

fn export_cmd(a: ExportArgs) -> Result<()> {
    use memwall::export::inputs;
    let given = match (&a.input, &a.adapter) {
        (Some(m), _) => m.clone(),
        (None, Some(adapter)) => inputs::recorded_base(adapter)?,
        (None, None) => bail!(
            "give the MODEL to export (or --adapter, to export it merged into the base it records)"
        ),
    };
    inputs::check_output(&a.gguf, &given, a.adapter.as_deref())?;
    if let Some(dir) = &a.adapter {
        let ad = memwall::ckpt::adapter::check_adapter_dir(dir, "--adapter")?;
        memwall::ckpt::adapter::check_base(&ad, &given)?;
    }
    if let Some(note) = inputs::requantize_note(&given, a.ty) {
        eprintln!("note: {note}");
    }
    let (input, named) = inputs::resolve_model(&given)?;
    // --name, else the model's name (a checkpoint as RUN-step-N), the adapter's after a `-`.
    let name = a.name.clone().or_else(|| {
        let base = inputs::display_name(&named)?;
        Some(match a.adapter.as_deref().and_then(inputs::display_name) {
            Some(adapter) => format!("{base}-{adapter}"),
            None => base,
        })
    });
    let s = memwall::export::export(&memwall::export::ExportOptions {
        input,
        out: a.gguf,
        ty: a.ty,
        name,
        adapter: a.adapter.clone(),
        progress: true,
    })?;
    let merged = match &s.merged {
        Some((dir, layers)) => format!(
            " with the adapter {} merged into {}",
            dir.display(),
            memwall::util::count(*layers as u64, "weight")
        ),
        None => String::new(),
    };
    println!(
        "exported {} ({}){merged} to {}: {} tensors, {} metadata keys, {}",
        given.display(),
        s.architecture,
        s.out.display(),
        s.tensors,
        s.metadata_keys,
        fmt_bytes(s.bytes)
    );
    Ok(())
}

fn cache_cmd(a: CacheArgs) -> Result<()> {
    let cache = memwall::util::cache::memwall_cache()
        .context("no user cache: neither XDG_CACHE_HOME nor HOME is set")?
        .join("gguf");
    let list = if a.clear {
        gguf::cache::clear_in(&cache)?
    } else {
        gguf::cache::conversions_in(&cache)?
    };
    use gguf::cache::EntryKind;
    let removable: Vec<_> = list.iter().filter(|c| c.removable()).collect();
    let total: u64 = removable.iter().map(|c| c.bytes).sum();
    if a.json {
        let v = serde_json::json!({
            "cache": cache, "cleared": a.clear, "total_bytes": total, "conversions": list,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    for c in &list {
        let from = match c.kind {
            EntryKind::Conversion if c.sources.is_empty() => "<- (no file indexed)".to_string(),
            EntryKind::Conversion => format!("<- {}", c.sources.join(", ")),
            EntryKind::Interrupted => "(a conversion killed before it finished)".into(),
            EntryKind::InProgress => "(a conversion running now: left as it is)".into(),
            EntryKind::Foreign => {
                "(not written by memwall: no .memwall marker, or other files in it; left as it \
                 is, remove it yourself if you want it gone)"
                    .into()
            }
        };
        println!("{:>10}  {}  {from}", fmt_bytes(c.bytes), c.dir.display());
    }
    let what = if a.clear { "removed from" } else { "in" };
    println!(
        "{} {what} {}: {}",
        memwall::util::count(removable.len() as u64, "conversion"),
        cache.display(),
        fmt_bytes(total)
    );
    if a.clear && !removable.is_empty() {
        println!(
            "the next use of each GGUF file converts it again (runs trained on one convert it \
             again when they resume or export)"
        );
    }
    Ok(())
}

fn merge_cmd(a: MergeArgs) -> Result<()> {
    use memwall::ckpt::adapter;
    // The cheap checks before a GGUF base's conversion.
    let ad = adapter::check_adapter_dir(&a.adapter, "ADAPTER")?;
    adapter::check_new_out_dir(&a.out)?;
    adapter::check_base(&ad, &a.base)?;
    let base = gguf::cache::model_dir(&a.base, "BASE", &mut say)?;
    let bf16 = match a.dtype {
        Some(d) => d == gguf::OutDtype::Bf16,
        None => memwall::ckpt::adapter::stored_as_bf16(&base),
    };
    let m = memwall::ckpt::adapter::merge(&base, &a.adapter, &a.out, bf16)?;
    println!(
        "merged {} into {}: {} (rank {}, scale {}), written to {}",
        a.adapter.display(),
        a.base.display(),
        memwall::util::count(m.layers as u64, "layer"),
        m.r,
        m.scale,
        a.out.display()
    );
    Ok(())
}

fn prune_cmd(a: PruneArgs) -> Result<()> {
    use memwall::prune::{self, FitMemory, PruneOptions, shape::ShapeRequest};
    // The process before anything is loaded: the baseline `memwall plan` counts.
    let baseline = rss::current_rss().unwrap_or(0);
    let opts = PruneOptions {
        model: gguf::cache::model_dir(&a.model, "--model", &mut say)?,
        gguf: memwall::util::sniff::is_gguf(&a.model).then(|| a.model.clone()),
        base_quant: a.base_quant,
        data: a.data.clone(),
        out: a.out.clone(),
        shape: ShapeRequest {
            keep: a.keep,
            hidden: a.hidden,
            heads: a.heads,
            kv_heads: a.kv_heads,
            mlp: a.mlp,
            depth: a.depth,
        },
        fit: a.fit_memory.map(|bytes| FitMemory {
            bytes,
            for_use: a.for_use,
            batch: a.batch,
            baseline,
        }),
        sequences: a.calibration,
        seq: a.seq,
        seed: a.seed,
        threads: threads(a.threads)?,
        device: a.device,
    };
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(a.calibration as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} sequences (scoring, then each candidate shape) eta {eta}",
        )
        .expect("valid template"),
    );
    let result = prune::prune(&opts, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64)
    });
    bar.finish_and_clear();
    let p = result?;
    for n in &p.notes {
        eprintln!("{n}");
    }
    if a.json {
        let mut v = serde_json::to_value(&p)?;
        if let Some(o) = v.as_object_mut() {
            o.remove("scores");
            o.remove("kept");
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if a.report {
        print!("{}", prune::report::layers(&p));
    }
    print!("{}", prune::report::summary(&p));
    println!(
        "written to {} ({} beside the model); heal it with `memwall train --init {} \
         --distill-from {} --data {} --out RUN`",
        a.out.display(),
        prune::REPORT_FILE,
        a.out.display(),
        a.model.display(),
        a.data.display()
    );
    Ok(())
}

fn report_cmd(a: ReportArgs) -> Result<()> {
    let w = memwall::profile::report::write_reports(&a.run_dir)?;
    if a.json {
        let v = serde_json::json!({
            "report_html": w.html,
            "memory_svg": w.memory_svg,
            "trace_json": w.trace,
            "peak_live_bytes": w.peak_bytes,
            "peak_op": w.peak_op,
            "leak_check": w.leak.as_ref().map(|l| serde_json::json!({
                "leaking": l.leaking, "growth_bytes": l.growth(), "message": l.message(),
            })),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print!("{}", w.summary);
    println!("report: {}", w.html.display());
    println!("memory timeline: {}", w.memory_svg.display());
    match &w.trace {
        Some(t) => println!("trace (Perfetto / chrome://tracing): {}", t.display()),
        None => println!("no trace.json: the run was not profiled (train with --profile)"),
    }
    if let Some(l) = &w.leak {
        println!("{}", l.message());
    }
    Ok(())
}
