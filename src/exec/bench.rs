//! `memwall bench`: time training steps of a configuration on synthetic tokens and report
//! throughput, step times, peak RSS and the plan's prediction, as JSON.

use super::executor::{Executor, OptimHparams};
use crate::backend::{Backend, DeviceId, IoTime, Peak};
use crate::ir::{Precision, Recompute};
use crate::model::{ModelSpec, ParamLayout};
use crate::plan::Plan;
use crate::plan::fit::Strategies;
use crate::plan::time::{Calibration, StepTime};
use crate::profile::leak::LeakCheck;
use crate::profile::record::micros;
use crate::profile::{OpRecorder, Profile, StepProfile};
use crate::run_dir::{self, Metric, PlanJson, RunDir, Update};
use crate::util::rng::Rng;
use crate::util::rss;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Instant;

/// A benchmark configuration.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub model: String,
    pub batch: usize,
    pub seq: usize,
    /// Timed steps (after one warm-up step).
    pub steps: usize,
    pub threads: usize,
    pub seed: u64,
    /// Time every op and report where the step's time goes (adds a clock read per op).
    pub time_ops: bool,
    /// Rows pack synthetic examples of this many tokens (`--packed LEN`), as `train` packs
    /// chat data; `None`: every row one sequence, every target trained.
    pub packed: Option<usize>,
    /// Memory strategies; `max_memory` is the budget the plan must fit (and `auto` choices fit).
    pub strategies: Strategies,
    /// Profile every step into this directory (plan.json, metrics.jsonl, profile.json,
    /// trace.json, memory.svg, report.html).
    pub profile: Option<PathBuf>,
    /// The backend measured.
    pub device: DeviceId,
}

/// Marks rows of `w` tokens as packed examples of `len` tokens (the last one of a row
/// shorter), as the loader marks chat data: each example's first token starts it (after the
/// row's first) and its first third is untrained.
fn mark_packed(batch: &mut [u32], w: usize, len: usize) {
    use crate::data::examples::{EXAMPLE_START, UNTRAINED};
    for row in batch.chunks_mut(w) {
        for (i, x) in row.iter_mut().enumerate() {
            let j = i % len;
            if j == 0 && i > 0 {
                *x |= EXAMPLE_START;
            }
            if j < len.div_ceil(3) {
                *x |= UNTRAINED;
            }
        }
    }
}

/// Runs the benchmark; returns the JSON report. In parts: the set-up (`set_up`: the plan,
/// the executor, the weights), one warm-up step (`warm_up`), the measured steps (`measure`),
/// and the report (`report`).
pub fn run(opts: &BenchOptions, on_step: &mut dyn FnMut(usize, f64)) -> Result<Value> {
    if opts.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let mut bench = set_up(opts)?;
    warm_up(opts, &mut bench, on_step)?;
    measure(opts, &mut bench, on_step)?;
    report(opts, bench)
}

/// A benchmark under way: what the set-up made, and what the steps record.
struct Bench {
    spec: ModelSpec,
    backend: &'static dyn Backend,
    /// The process's resident memory before the plan's.
    baseline: u64,
    calibration: Calibration,
    predicted: StepTime,
    /// Whether `predicted` is the device's own (false: a GPU with no calibration).
    timed: bool,
    plan: PlanFigures,
    ex: Executor,
    /// The FMA ceiling, measured before the steps.
    peak_before: Option<Peak>,
    /// Where recorded times start.
    epoch: Instant,
    profile: Profile,
    metrics: Vec<Metric>,
    leak: LeakCheck,
    rng: Rng,
    /// A step's tokens, `[accum·B, T+1]`.
    batch: Vec<u32>,
    /// The measured steps' times (s).
    times: Vec<f64>,
    /// Every step's loss, the warm-up's first.
    losses: Vec<f32>,
    /// The disk tier's time when the warm-up step was done.
    io_after_warmup: IoTime,
}

/// What the report gives of the plan, read before the executor takes it.
struct PlanFigures {
    recompute: Recompute,
    io_read: u64,
    io_write: u64,
    by_tier: Value,
    total: u64,
    flops: u64,
    recompute_flops: u64,
    by_category: serde_json::Map<String, Value>,
    /// Each tier's packed bytes and predicted peak (`plan.json`'s `tiers`; a GPU's host RAM
    /// is the pinned arena and the loader's buffers).
    tiers: Value,
    layout: ParamLayout,
    n_ops: usize,
}

impl PlanFigures {
    /// The figures of `plan`, its compute tier's peak over `baseline`.
    fn of(plan: &Plan, baseline: u64) -> PlanFigures {
        let recompute = plan.cfg.recompute;
        let (io_read, io_write) = plan.io_bytes_per_step();
        let by_tier = json!(plan.by_tier());
        let (total, flops, recompute_flops) =
            (plan.total_bytes(), plan.flops(), plan.recompute_flops());
        let by_category: serde_json::Map<String, Value> = plan
            .peak_by_category()
            .into_iter()
            .filter(|&(_, b)| b > 0)
            .map(|(c, b)| (c.name().to_string(), json!(b)))
            .collect();
        PlanFigures {
            recompute,
            io_read,
            io_write,
            by_tier,
            total,
            flops,
            recompute_flops,
            by_category,
            tiers: json!(plan.tier_uses(baseline, &crate::plan::Budgets::NONE)),
            layout: plan.layout.clone(),
            n_ops: plan.schedule.ops.len(),
        }
    }
}

/// The set-up: resolves the model and the backend, plans the configuration (into
/// `--profile`'s directory too, with its prediction), starts the executor, measures the FMA
/// ceiling, starts recording op times where asked, and fills the weights.
fn set_up(opts: &BenchOptions) -> Result<Bench> {
    let spec = ModelSpec::resolve(&opts.model)?;
    let backend = opts.device.open()?;
    let baseline = rss::current_rss().unwrap_or(0);
    // On a GPU, its own calibration (none: the step is timed, not predicted).
    let (calibration, timed) = match super::calibrate::for_device(opts.device, opts.threads)? {
        Some(c) => (c, true),
        None => (super::calibrate::current(opts.threads)?, false),
    };
    let mut strategies = opts
        .strategies
        .with_offload_dir(std::path::Path::new("memwall-offload"));
    strategies.packed = opts.packed.is_some();
    let plan = strategies.plan(
        &spec,
        (opts.batch, opts.seq, opts.threads),
        baseline,
        &calibration,
        backend,
    )?;
    let predicted = crate::plan::time::predict(&plan, &calibration);
    if let Some(dir) = &opts.profile {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--profile {}: cannot create the directory", dir.display()))?;
        let budgets =
            crate::plan::Budgets::new(plan.compute_tier(), opts.strategies.max_memory, None);
        let mut p = PlanJson::from_plan(&plan, baseline)?.with_budgets(&budgets);
        if timed {
            p = p.with_prediction(&predicted, &calibration);
        }
        p.write(&RunDir::new(dir).plan())?;
    }
    let figures = PlanFigures::of(&plan, backend.baseline_bytes().unwrap_or(baseline));
    let mut ex = Executor::on(plan, backend)?;
    // The sitting's arithmetic ceiling, measured on as many threads as the steps run on,
    // before and after them (a shared machine's ceiling moves; a fraction of it is what a
    // figure means).
    let peak_before = super::calibrate::peak_on(opts.threads, backend)?;
    let epoch = Instant::now();
    if opts.time_ops || opts.profile.is_some() {
        ex.record_ops(Some(OpRecorder::new(
            epoch,
            figures.n_ops * (opts.steps + 1),
        )));
    }
    let profile = Profile {
        baseline_rss: baseline,
        steps: Vec::new(),
    };
    let leak = LeakCheck::new(figures.total);
    fill_weights(&mut ex, &figures.layout, opts.seed)?;
    Ok(Bench {
        spec,
        backend,
        baseline,
        calibration,
        predicted,
        timed,
        plan: figures,
        ex,
        peak_before,
        epoch,
        profile,
        metrics: Vec::new(),
        leak,
        rng: Rng::new(opts.seed),
        batch: vec![0u32; opts.strategies.grad_accum * opts.batch * (opts.seq + 1)],
        times: Vec::with_capacity(opts.steps),
        losses: Vec::new(),
        io_after_warmup: Default::default(),
    })
}

/// Fills the parameters with the model's initialisation (seeded by `seed`), and a LoRA
/// plan's frozen base too (the bytes and FLOPs are the same as a pretrained base's).
fn fill_weights(ex: &mut Executor, layout: &ParamLayout, seed: u64) -> Result<()> {
    let mut init = layout.initializer(seed);
    ex.fill_params(|range, p| {
        init.fill(range, p);
        Ok(())
    })?;
    // A LoRA plan's frozen base: the model's initialisation (the bytes and FLOPs are the
    // same as a pretrained base's).
    if let Some(lora) = ex.plan.lora.clone() {
        let mut init = lora.base.initializer(seed ^ 1);
        ex.fill_base(|range, p| {
            init.fill(range, p);
            Ok(())
        })?;
    }
    Ok(())
}

/// The warm-up step: run and recorded as the others are, but its time, its disk-tier time
/// and its ops' times stay out of the figures.
fn warm_up(
    opts: &BenchOptions,
    bench: &mut Bench,
    on_step: &mut dyn FnMut(usize, f64),
) -> Result<()> {
    let dt = bench.step(opts, 0)?;
    bench.io_after_warmup = bench.ex.io_time();
    if let Some(r) = bench.ex.recorder_mut() {
        r.take(bench.plan.n_ops * opts.steps); // the warm-up step's times stay out of time_by_op
    }
    on_step(0, dt);
    Ok(())
}

/// The measured steps (`--steps`), each one's time kept.
fn measure(
    opts: &BenchOptions,
    bench: &mut Bench,
    on_step: &mut dyn FnMut(usize, f64),
) -> Result<()> {
    for step in 1..=opts.steps {
        let dt = bench.step(opts, step)?;
        bench.times.push(dt);
        on_step(step, dt);
    }
    Ok(())
}

impl Bench {
    /// Step `step` (0: the warm-up) on fresh random tokens: uploads them, trains, and
    /// records the loss, the step's profile, the resident memory and the metrics. Returns
    /// the step's time (s), upload left out.
    fn step(&mut self, opts: &BenchOptions, step: usize) -> Result<f64> {
        let Bench {
            spec,
            plan,
            ex,
            epoch,
            profile,
            metrics,
            leak,
            rng,
            batch,
            losses,
            ..
        } = self;
        let (epoch, n_ops) = (*epoch, plan.n_ops);
        for x in batch.iter_mut() {
            *x = rng.below(spec.vocab_size as u64) as u32;
        }
        match opts.packed {
            Some(len) => {
                mark_packed(batch, opts.seq + 1, len);
                ex.upload_examples(batch)?;
            }
            None => ex.upload_batch(batch)?,
        }
        let t0 = Instant::now();
        if opts.strategies.precision == Precision::F16 {
            ex.set_loss_scale(crate::exec::LossScaler::INITIAL);
        }
        let st = ex.train_step(&OptimHparams {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: grad_clip(opts.strategies.update),
            step: step as u64 + 1,
        })?;
        let dt = t0.elapsed().as_secs_f64();
        losses.push(st.loss);
        let end_us = micros(epoch, Instant::now());
        let io_spans = ex.take_io_spans(epoch);
        if opts.profile.is_some()
            && let Some(r) = ex.recorder_mut()
        {
            profile.steps.push(StepProfile {
                step: step as u64 + 1,
                start_us: micros(epoch, t0),
                end_us,
                ops: r.spans[r.spans.len().saturating_sub(n_ops)..].to_vec(),
                spans: io_spans,
            });
        }
        let rss_now = rss::current_rss();
        if let Some(r) = rss_now {
            leak.observe(step as u64 + 1, r);
        }
        metrics.push(Metric {
            step: step as u64 + 1,
            update: Some(Update {
                loss: st.loss,
                lr: 3e-4,
                grad_norm: st.grad_norm,
                loss_scale: None,
                skipped: st.skipped,
                tokens_per_s: (opts.strategies.grad_accum * opts.batch * opts.seq) as f64 / dt,
                trained_tokens: opts.packed.map(|_| st.loss_tokens as u64),
                step_s: dt,
                rss_bytes: rss_now,
                peak_rss_bytes: None,
                over_max_memory_bytes: None,
                process_step: Some(step as u64 + 1),
                comm_s: None,
                comm_wait_s: None,
                comm_bytes: None,
            }),
            val_loss: None,
        });
        Ok(dt)
    }
}

/// The report: the measured steps' times against the plan's prediction and the FMA ceiling
/// (measured again), the disk tier's time, time by op kind, peak memory against the plan
/// (after a deferred update is finished), the leak check, and `--profile`'s files.
fn report(opts: &BenchOptions, bench: Bench) -> Result<Value> {
    let Bench {
        spec,
        backend,
        baseline,
        calibration,
        predicted,
        timed,
        plan,
        mut ex,
        peak_before,
        profile,
        metrics,
        leak,
        times,
        losses,
        io_after_warmup,
        ..
    } = bench;
    let PlanFigures {
        recompute,
        io_read,
        io_write,
        by_tier,
        tiers,
        total: plan_total,
        flops,
        recompute_flops,
        by_category,
        layout,
        n_ops,
    } = plan;
    let io: crate::backend::IoTime = ex.io_time();
    let offload_note = ex.offload_note();
    let per_step = |x: f64| x / opts.steps as f64;
    let (io_busy_s, stall_s) = (
        per_step(io.busy_s - io_after_warmup.busy_s),
        per_step(io.stall_s - io_after_warmup.stall_s),
    );
    let peak_after = super::calibrate::peak_on(opts.threads, backend)?;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let tokens = (opts.strategies.grad_accum * opts.batch * opts.seq) as f64;
    let by_kind = time_by_op(&mut ex, n_ops, opts.steps);
    // A deferred update is finished as a run's end finishes it (untimed), so the peak
    // covers the ops that do it.
    ex.finish_update()?;
    let peak = rss::peak_rss();
    let measured = peak.map(|p| p.saturating_sub(baseline));
    // A GPU's plan: the device's memory in use after the steps (one allocation: the peak).
    let device_in_use = ex.device_memory_in_use();
    let leak = leak.report();
    let report = write_profile(opts, &metrics, &profile)?;
    let mut report = json!({
        "config": {
            "profile": opts.profile.is_some(),
            "model": spec.name, "num_params": layout.total, "batch": opts.batch, "seq": opts.seq,
            "steps": opts.steps, "warmup_steps": 1, "threads": opts.threads, "precision": opts.strategies.precision.to_string(),
            "recompute": recompute.to_string(), "grad_accum": opts.strategies.grad_accum,
            "optim_state": opts.strategies.optim_state.to_string(),
            "offload": ex.plan.cfg.offload.set.to_string(),
            "optimizer": "adamw", "seed": opts.seed,
            "update": opts.strategies.update.to_string(),
            "grad_clip": grad_clip(opts.strategies.update),
            "data": match opts.packed {
                Some(len) => format!("uniform random tokens, rows packing examples of {len} (first third untrained)"),
                None => "uniform random tokens".into(),
            },
        },
        "tokens_per_s": tokens / median,
        "step_s_median": median,
        "step_s": times,
        "predicted_step_s": timed.then_some(predicted.step_s),
        "time_error_pct": timed.then(|| 100.0 * (predicted.step_s - median) / median),
        "predicted": {
            "compute_s": predicted.compute_s, "io_s": predicted.io_s, "stall_s": predicted.stall_s,
            "bound": predicted.bound, "estimated": predicted.estimated,
            "calibration": match timed {
                true => calibration.describe(),
                false => "none for this GPU: `memwall calibrate --device cuda` measures one".into(),
            },
        },
        "gflops_per_s": flops as f64 / median / 1e9,
        "flops_per_step": flops,
        // On a GPU: the model's FLOPs (recomputation left out) per second, as a share of the
        // card's bf16 GEMM rate (its calibration's).
        "mfu": (timed && calibration.gpu && calibration.fma_peak_gflops > 0.0).then(|| {
            (flops - recompute_flops) as f64 / median / 1e9 / calibration.fma_peak_gflops
        }),
        "fma_peak": peak_before.zip(peak_after).map(|(b, a)| json!({
            "gflops_per_s_before": b.gflops_per_s, "gflops_per_s_after": a.gflops_per_s,
            "isa": b.isa, "threads": b.threads,
            "implied_ghz": b.implied_ghz.max(a.implied_ghz),
            "fraction_reached": flops as f64 / median / 1e9 / b.gflops_per_s.max(a.gflops_per_s),
            // Every loop the CPU has, the better of the two measurements.
            "by_isa": b.by_isa.iter().zip(&a.by_isa).map(|(x, y)| (x.isa.to_string(), json!({
                "gflops_per_s": x.gflops_per_s.max(y.gflops_per_s),
                "implied_ghz": x.implied_ghz.max(y.implied_ghz),
            }))).collect::<serde_json::Map<_, _>>(),
        })),
        "peak_rss_bytes": peak,
        "max_memory_bytes": opts.strategies.max_memory,
        "over_max_memory_bytes": crate::exec::train::over_max_memory(peak, opts.strategies.max_memory),
        "baseline_rss_bytes": baseline,
        "plan_total_bytes": plan_total,
        "plan_peak_by_category": by_category,
        "by_tier": by_tier,
        "tiers": tiers,
        "io_read_bytes_per_step": io_read,
        "io_write_bytes_per_step": io_write,
        "io_busy_s": io_busy_s,
        "offload_note": offload_note,
        "stall_s": stall_s,
        "recompute_flops_per_step": recompute_flops,
        "device_memory_in_use_bytes": device_in_use,
        "measured_minus_baseline_bytes": measured,
        "plan_error_pct": measured.map(|m| 100.0 * (plan_total as f64 - m as f64) / m as f64),
        "losses": losses,
        "time_by_op": by_kind,
        "leak_check": leak.map(|l| json!({"leaking": l.leaking, "message": l.message(), "growth_bytes": l.growth()})),
        "profile": report,
        "profile_overhead": (opts.profile.is_some() || opts.time_ops).then(|| {
            let per_op = crate::profile::record::seconds_per_record(20_000);
            json!({"recorded_ops_per_step": n_ops, "s_per_recorded_op": per_op,
                   "share_of_step": per_op * n_ops as f64 / median})
        }),
    });
    // What the backend says of itself (the CPU: its mixed-precision path, AVX512_BF16).
    if let Some(config) = report["config"].as_object_mut() {
        config.extend(backend.bench_facts(opts.strategies.precision.storage()));
    }
    Ok(report)
}

/// Time by op kind (the name without its layer prefix) per measured step, largest first;
/// empty where ops were not timed.
fn time_by_op(ex: &mut Executor, n_ops: usize, steps: usize) -> Vec<Value> {
    match ex.record_ops(None) {
        None => Vec::new(),
        Some(rec) => {
            let mut secs = vec![0.0f64; n_ops];
            for s in &rec.spans {
                secs[s.op as usize] += (s.end_us - s.start_us) * 1e-6;
            }
            let mut kinds: Vec<(String, f64, u64)> = Vec::new();
            for (e, s) in ex.plan.schedule.ops.iter().zip(secs) {
                let kind = crate::profile::timeline::op_kind(&e.name);
                match kinds.iter_mut().find(|k| k.0 == kind) {
                    Some(k) => {
                        k.1 += s / steps as f64;
                        k.2 += e.flops;
                    }
                    None => kinds.push((kind.to_string(), s / steps as f64, e.flops)),
                }
            }
            kinds.sort_by(|a, b| b.1.total_cmp(&a.1));
            kinds
                .into_iter()
                .map(|(k, s, f)| json!({"op": k, "s_per_step": s, "gflops_per_s": if s > 0.0 { f as f64 / s / 1e9 } else { 0.0 }}))
                .collect()
        }
    }
}

/// Writes `--profile`'s metrics, profile and reports into its directory; returns where they
/// are (`None` without `--profile`).
fn write_profile(
    opts: &BenchOptions,
    metrics: &[Metric],
    profile: &Profile,
) -> Result<Option<Value>> {
    Ok(match &opts.profile {
        Some(dir) => {
            let run = RunDir::new(dir);
            run_dir::metrics::write(&run.metrics(), metrics)?;
            profile.write(&run.profile())?;
            let w = crate::profile::report::write_reports(dir)?;
            Some(
                json!({"dir": dir, "report_html": w.html, "trace_json": w.trace, "memory_svg": w.memory_svg}),
            )
        }
        None => None,
    })
}

/// The report's headline for people at a terminal (the JSON on stdout has everything):
/// throughput, the share of the sitting's FMA ceiling it reached, and memory against the
/// plan, e.g. `310.2 tokens/s (median step 3.301 s) · 235.1 GFLOP/s, 0.844 of the avx2+fma
/// peak (278.4 GFLOP/s on 2 threads) · peak RSS 1.96 GiB above a 7.03 MiB baseline, planned
/// 1.96 GiB (+0.35%)`.
pub fn summary(report: &Value) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let mut parts = vec![format!(
        "{:.1} tokens/s (median step {:.3} s)",
        f(&report["tokens_per_s"]),
        f(&report["step_s_median"])
    )];
    let peak = &report["fma_peak"];
    let gpu = report["config"]["gpu"].as_str();
    parts.push(if let Some(gpu) = gpu.filter(|_| peak.is_null()) {
        format!(
            "{:.1} GFLOP/s on the {gpu} (its ceiling is not measured yet)",
            f(&report["gflops_per_s"])
        )
    } else if peak.is_null() {
        format!(
            "{:.1} GFLOP/s (no FMA ceiling: the CPU has neither AVX2 + FMA nor AVX-512)",
            f(&report["gflops_per_s"])
        )
    } else {
        let threads = peak["threads"].as_u64().unwrap_or(0);
        format!(
            "{:.1} GFLOP/s, {:.3} of the {} peak ({:.1} GFLOP/s on {threads} thread{})",
            f(&report["gflops_per_s"]),
            f(&peak["fraction_reached"]),
            peak["isa"].as_str().unwrap_or("?"),
            f(&peak["gflops_per_s_before"]).max(f(&peak["gflops_per_s_after"])),
            if threads == 1 { "" } else { "s" }
        )
    });
    let bytes = |v: &Value| v.as_u64().map(crate::util::bytes::fmt_bytes);
    // On a GPU the plan is device memory: the device's use against the plan and the
    // context the device held when it was opened (the host's RSS says nothing of it).
    if let (Some(in_use), Some(at_open), Some(plan)) = (
        report["device_memory_in_use_bytes"].as_u64(),
        report["config"]["gpu_used_at_open_bytes"].as_u64(),
        report["plan_total_bytes"].as_u64(),
    ) {
        let planned = plan + at_open;
        parts.push(format!(
            "device memory in use {} after the steps, planned {} + {} at open ({:+.2}%)",
            crate::util::bytes::fmt_bytes(in_use),
            crate::util::bytes::fmt_bytes(plan),
            crate::util::bytes::fmt_bytes(at_open),
            100.0 * (planned as f64 - in_use as f64) / in_use as f64
        ));
        return parts.join(" · ");
    }
    if let (Some(measured), Some(baseline), Some(plan)) = (
        bytes(&report["measured_minus_baseline_bytes"]),
        bytes(&report["baseline_rss_bytes"]),
        bytes(&report["plan_total_bytes"]),
    ) {
        parts.push(format!(
            "peak RSS {measured} above a {baseline} baseline, planned {plan} ({:+.2}%)",
            f(&report["plan_error_pct"])
        ));
    }
    parts.join(" · ")
}

/// The steps' gradient clipping: none, as the PyTorch reference's, and as an update inside
/// the backward (`--update in-backward`) must, so `--update end` and `in-backward` compute
/// the same weights.
fn grad_clip(_update: crate::ir::Update) -> f32 {
    0.0
}

#[cfg(test)]
mod tests {
    use super::summary;
    use serde_json::json;

    #[test]
    fn the_summary_gives_throughput_ceiling_and_memory() {
        let report = json!({
            "tokens_per_s": 310.24, "step_s_median": 3.3007, "gflops_per_s": 235.1,
            "fma_peak": {"fraction_reached": 0.8443, "isa": "avx2+fma", "threads": 2,
                         "gflops_per_s_before": 278.4, "gflops_per_s_after": 272.9},
            "measured_minus_baseline_bytes": 2u64 << 30, "baseline_rss_bytes": 7u64 << 20,
            "plan_total_bytes": (2u64 << 30) + (7u64 << 20), "plan_error_pct": 0.3418,
        });
        assert_eq!(
            summary(&report),
            "310.2 tokens/s (median step 3.301 s) · 235.1 GFLOP/s, 0.844 of the avx2+fma peak \
             (278.4 GFLOP/s on 2 threads) · peak RSS 2.00 GiB above a 7.00 MiB baseline, \
             planned 2.01 GiB (+0.34%)"
        );
    }

    /// On a GPU the memory line is the device's, against the plan and the context at open
    /// (the figures of the H200 run of 2026-11-28: nvidia-smi's 5335 MiB).
    #[test]
    fn the_summary_gives_the_devices_memory_on_a_gpu() {
        let report = json!({
            "tokens_per_s": 83276.1, "step_s_median": 0.19674, "gflops_per_s": 67225.0,
            "fma_peak": null, "config": {"gpu": "NVIDIA H200", "gpu_used_at_open_bytes": 552402944u64},
            "device_memory_in_use_bytes": 5335u64 << 20, "plan_total_bytes": 5034646016u64,
            "measured_minus_baseline_bytes": 500u64 << 20, "baseline_rss_bytes": 100u64 << 20,
            "plan_error_pct": 831.0,
        });
        assert_eq!(
            summary(&report),
            "83276.1 tokens/s (median step 0.197 s) · 67225.0 GFLOP/s on the NVIDIA H200 (its \
             ceiling is not measured yet) · device memory in use 5.21 GiB after the steps, \
             planned 4.69 GiB + 526.81 MiB at open (-0.13%)"
        );
    }

    #[test]
    fn the_summary_says_when_there_is_no_ceiling_or_no_rss() {
        let report = json!({
            "tokens_per_s": 12.0, "step_s_median": 0.5, "gflops_per_s": 1.5,
            "fma_peak": null, "measured_minus_baseline_bytes": null,
            "baseline_rss_bytes": 1, "plan_total_bytes": 1, "plan_error_pct": null,
        });
        let s = summary(&report);
        assert!(s.contains("no FMA ceiling"), "{s}");
        assert!(!s.contains("RSS"), "{s}");
    }
}
