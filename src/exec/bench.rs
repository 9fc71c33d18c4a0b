//! `memwall bench`: time training steps of a configuration on synthetic tokens and report
//! throughput, step times, peak RSS and the plan's prediction, as JSON.

use super::executor::{Executor, OptimHparams};
use crate::model::ModelSpec;
use crate::plan::fit::plan_with_recompute;
use crate::plan::{Mode, OptimState, Precision, RecomputeChoice, StepConfig};
use crate::util::rng::Rng;
use crate::util::rss;
use anyhow::{Result, bail};
use serde_json::{Value, json};
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
    pub recompute: RecomputeChoice,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Storage of the AdamW moments.
    pub optim_state: OptimState,
    /// Format of compute weights, activations and gradients.
    pub precision: Precision,
    /// Budget for `--recompute auto`.
    pub max_memory: Option<u64>,
}

/// Runs the benchmark; returns the JSON report.
pub fn run(opts: &BenchOptions, on_step: &mut dyn FnMut(usize, f64)) -> Result<Value> {
    if opts.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let spec = ModelSpec::resolve(&opts.model)?;
    let baseline = rss::current_rss().unwrap_or(0);
    let mut cfg = StepConfig::new(opts.batch, opts.seq, opts.threads);
    cfg.grad_accum = opts.grad_accum;
    cfg.optim_state = opts.optim_state;
    cfg.precision = opts.precision;
    let plan = plan_with_recompute(
        &spec,
        &cfg,
        Mode::Train,
        opts.recompute,
        opts.max_memory,
        baseline,
    )?;
    let recompute = plan.cfg.recompute;
    let (plan_total, flops, recompute_flops) =
        (plan.total_bytes(), plan.flops(), plan.recompute_flops());
    let by_category: serde_json::Map<String, Value> = plan
        .peak_by_category()
        .into_iter()
        .filter(|&(_, b)| b > 0)
        .map(|(c, b)| (c.name().to_string(), json!(b)))
        .collect();
    let layout = plan.layout.clone();
    let mut ex = Executor::new(plan)?;
    ex.time_ops(opts.time_ops);
    layout.init(ex.params_mut(), spec.n_layer, opts.seed);
    let mut rng = Rng::new(opts.seed);
    let mut batch = vec![0u32; opts.grad_accum * opts.batch * (opts.seq + 1)];
    let mut times = Vec::with_capacity(opts.steps);
    let mut losses = Vec::new();
    for step in 0..=opts.steps {
        for x in batch.iter_mut() {
            *x = rng.below(spec.vocab_size as u64) as u32;
        }
        ex.set_batch(&batch)?;
        let t0 = Instant::now();
        if opts.precision == Precision::F16 {
            ex.set_loss_scale(crate::exec::train::LossScaler::INITIAL);
        }
        let st = ex.train_step(&OptimHparams {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            step: step as u64 + 1,
        });
        let dt = t0.elapsed().as_secs_f64();
        losses.push(st.loss);
        if step > 0 {
            times.push(dt);
        } else if opts.time_ops {
            ex.time_ops(true); // discard the warm-up step's times
        }
        on_step(step, dt);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let tokens = (opts.grad_accum * opts.batch * opts.seq) as f64;
    let peak = rss::peak_rss();
    // Time by op kind (the name without its layer prefix), largest first.
    let by_kind: Vec<Value> = match ex.op_seconds() {
        None => Vec::new(),
        Some(secs) => {
            let mut kinds: Vec<(String, f64, u64)> = Vec::new();
            for (e, s) in ex.plan.schedule.ops.iter().zip(secs) {
                // Strip the micro-batch (`mb1.`) and layer (`h3.`) prefixes.
                let strip = |s: &'static str, name: &str| -> Option<usize> {
                    let (h, _) = name.split_once('.')?;
                    let digits = h.strip_prefix(s)?;
                    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
                        .then_some(h.len() + 1)
                };
                let mut kind = e.name.as_str();
                for p in ["mb", "h"] {
                    if let Some(k) = strip(p, kind) {
                        kind = &kind[k..];
                    }
                }
                match kinds.iter_mut().find(|k| k.0 == kind) {
                    Some(k) => {
                        k.1 += s / opts.steps as f64;
                        k.2 += e.flops;
                    }
                    None => kinds.push((kind.to_string(), s / opts.steps as f64, e.flops)),
                }
            }
            kinds.sort_by(|a, b| b.1.total_cmp(&a.1));
            kinds
                .into_iter()
                .map(|(k, s, f)| json!({"op": k, "s_per_step": s, "gflops_per_s": if s > 0.0 { f as f64 / s / 1e9 } else { 0.0 }}))
                .collect()
        }
    };
    let measured = peak.map(|p| p.saturating_sub(baseline));
    Ok(json!({
        "config": {
            "model": spec.name, "num_params": layout.total, "batch": opts.batch, "seq": opts.seq,
            "steps": opts.steps, "warmup_steps": 1, "threads": opts.threads, "precision": opts.precision.to_string(),
            "mixed_compute": crate::backend::cpu::gemm_mixed::COMPUTE_PATH,
            "cpu_has_avx512_bf16": crate::backend::cpu::gemm_mixed::cpu_has_bf16_dot(),
            "recompute": recompute.to_string(), "grad_accum": opts.grad_accum,
            "optim_state": opts.optim_state.to_string(),
            "optimizer": "adamw", "data": "uniform random tokens", "seed": opts.seed,
        },
        "tokens_per_s": tokens / median,
        "step_s_median": median,
        "step_s": times,
        "gflops_per_s": flops as f64 / median / 1e9,
        "flops_per_step": flops,
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": baseline,
        "plan_total_bytes": plan_total,
        "plan_peak_by_category": by_category,
        "recompute_flops_per_step": recompute_flops,
        "measured_minus_baseline_bytes": measured,
        "plan_error_pct": measured.map(|m| 100.0 * (plan_total as f64 - m as f64) / m as f64),
        "losses": losses,
        "time_by_op": by_kind,
    }))
}
