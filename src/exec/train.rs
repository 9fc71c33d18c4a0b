//! The training loop: validate everything up front, plan, allocate once, then for each step
//! draw a batch, run the schedule, log metrics, evaluate and checkpoint.
//!
//! A run directory holds `plan.json`, `metrics.jsonl` (one JSON object per step) and
//! `checkpoints/step-NNNNNN/`. `--resume RUN_DIR` continues from the newest checkpoint with
//! the run's own configuration and is bitwise identical to an uninterrupted run.

use super::executor::{Executor, OptimHparams};
use super::lr::cosine_with_warmup;
use crate::ckpt::{self, LossScaleState, TrainerState};
use crate::data::loader::{BatchLoader, DataSet, check_fits, fill_batch};
use crate::model::ModelSpec;
use crate::plan::Precision;
use crate::plan::fit::Strategies;
use crate::profile::leak::{LeakCheck, LeakReport};
use crate::profile::record::micros;
use crate::profile::{OpRecorder, Profile, Span, StepProfile, Track};
use crate::run_dir::{self, Metric, MetricsLog, PlanJson, RunDir};
use crate::util::bytes::fmt_bytes;
use crate::util::rss;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Salt separating the validation batch stream from the training stream.
const VAL_STREAM: u64 = 0x5641_4C5F_5354_524D;

/// Everything that defines a training run (saved in checkpoints; `--resume` reuses it).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainOptions {
    /// Preset name, checkpoint directory or config.json.
    pub model: String,
    pub data: PathBuf,
    pub out: PathBuf,
    /// Total optimizer steps of the run.
    pub steps: u64,
    pub batch: usize,
    pub seq: usize,
    pub lr: f32,
    /// Final learning rate as a fraction of `lr` (cosine decay).
    pub min_lr_frac: f32,
    pub warmup: u64,
    pub weight_decay: f32,
    pub grad_clip: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub seed: u64,
    pub threads: usize,
    /// Evaluate validation loss every N steps (0: only at the end).
    pub eval_every: u64,
    /// Number of validation batches per evaluation.
    pub eval_batches: u64,
    /// Save a checkpoint every N steps (0: only at the end).
    pub save_every: u64,
    /// Start from this Hugging Face GPT-2 checkpoint directory (fine-tuning).
    pub init: Option<PathBuf>,
    /// Memory strategies and budget (flattened: the same keys as separate fields).
    #[serde(flatten)]
    pub strategies: Strategies,
    /// Profile the first N steps of this invocation (0: off): `profile.json`, `trace.json`,
    /// `memory.svg` and `report.html` in the run directory.
    #[serde(default)]
    pub profile_steps: u64,
}

/// Dynamic loss scaling for fp16 (as `torch.cuda.amp.GradScaler`): start at 2^16, halve and
/// skip the update when the gradients overflow, double after 2000 clean steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    pub state: LossScaleState,
}

impl LossScaler {
    pub const INITIAL: f32 = 65536.0;
    pub const GROWTH_INTERVAL: u64 = 2000;

    pub fn new() -> LossScaler {
        LossScaler {
            state: LossScaleState {
                scale: Self::INITIAL,
                clean_steps: 0,
            },
        }
    }

    /// Updates the scale after a step that did (`skipped`) or did not overflow.
    pub fn update(&mut self, skipped: bool) {
        let s = &mut self.state;
        if skipped {
            s.scale = (s.scale * 0.5).max(f32::MIN_POSITIVE);
            s.clean_steps = 0;
        } else {
            s.clean_steps += 1;
            if s.clean_steps >= Self::GROWTH_INTERVAL {
                s.scale = (s.scale * 2.0).min(f32::MAX / 2.0);
                s.clean_steps = 0;
            }
        }
    }
}

impl Default for LossScaler {
    fn default() -> LossScaler {
        LossScaler::new()
    }
}

impl TrainOptions {
    /// Defaults matching `memwall train --help`.
    pub fn new(model: &str, data: &Path, out: &Path) -> TrainOptions {
        TrainOptions {
            model: model.to_string(),
            data: data.to_path_buf(),
            out: out.to_path_buf(),
            steps: 500,
            batch: 8,
            seq: 128,
            lr: 6e-4,
            min_lr_frac: 0.1,
            warmup: 50,
            weight_decay: 0.1,
            grad_clip: 1.0,
            beta1: 0.9,
            beta2: 0.95,
            seed: 1,
            threads: default_threads(),
            eval_every: 100,
            eval_batches: 8,
            save_every: 100,
            init: None,
            strategies: Strategies::default(),
            profile_steps: 0,
        }
    }

    fn check(&self) -> Result<()> {
        if self.steps == 0 {
            bail!("--steps must be at least 1");
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            bail!("--lr must be a positive number, got {}", self.lr);
        }
        if !(0.0..1.0).contains(&self.min_lr_frac) {
            bail!("--min-lr-frac must be in [0, 1), got {}", self.min_lr_frac);
        }
        if self.weight_decay < 0.0 || !self.weight_decay.is_finite() {
            bail!("--weight-decay must be >= 0, got {}", self.weight_decay);
        }
        if self.grad_clip < 0.0 || !self.grad_clip.is_finite() {
            bail!(
                "--grad-clip must be >= 0 (0 disables clipping), got {}",
                self.grad_clip
            );
        }
        if self.eval_batches == 0 {
            bail!("--eval-batches must be at least 1");
        }
        if self.strategies.grad_accum == 0 {
            bail!("--grad-accum must be at least 1 (micro-batches per optimizer step)");
        }
        Ok(())
    }
}

/// Worker threads by default: the machine's cores.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// What a finished run reports.
#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    pub out: PathBuf,
    pub first_step: u64,
    pub last_step: u64,
    pub final_loss: f32,
    pub final_val_loss: Option<f32>,
    pub tokens_per_s: f64,
    pub plan_total_bytes: u64,
    pub baseline_bytes: u64,
    pub peak_rss_bytes: Option<u64>,
    pub last_checkpoint: Option<PathBuf>,
    /// The leak check's verdict (`None` when the run had too few steps for one).
    pub leak: Option<LeakReport>,
    /// The reports written when profiling (`report.html` and its siblings).
    pub report: Option<PathBuf>,
}

/// How a run reports progress.
pub trait Progress {
    fn start(&mut self, first_step: u64, total: u64);
    fn step(&mut self, step: u64, loss: f32, tokens_per_s: f64, rss: Option<u64>);
    fn message(&mut self, msg: &str);
    fn finish(&mut self);
}

/// Terminal progress: a bar on a terminal, periodic lines otherwise (logs, CI).
pub struct ConsoleProgress {
    bar: Option<indicatif::ProgressBar>,
    total: u64,
    log_every: u64,
}

impl ConsoleProgress {
    pub fn new(log_every: u64) -> ConsoleProgress {
        ConsoleProgress {
            bar: None,
            total: 0,
            log_every: log_every.max(1),
        }
    }
}

impl Progress for ConsoleProgress {
    fn start(&mut self, first_step: u64, total: u64) {
        self.total = total;
        let bar = indicatif::ProgressBar::new(total);
        if bar.is_hidden() {
            return;
        }
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} eta {eta}")
                .expect("valid template"),
        );
        bar.set_position(first_step);
        self.bar = Some(bar);
    }

    fn step(&mut self, step: u64, loss: f32, tps: f64, rss: Option<u64>) {
        let mem = rss.map(fmt_bytes).unwrap_or_else(|| "?".into());
        let msg = format!("loss {loss:.4} | {tps:.0} tok/s | rss {mem}");
        match &self.bar {
            Some(bar) => {
                bar.set_position(step);
                bar.set_message(msg);
            }
            None => {
                if step.is_multiple_of(self.log_every) || step == self.total || step == 1 {
                    eprintln!("step {step:>6}/{} | {msg}", self.total);
                }
            }
        }
    }

    fn message(&mut self, msg: &str) {
        match &self.bar {
            Some(bar) => bar.println(msg),
            None => eprintln!("{msg}"),
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish();
        }
    }
}

/// Silent progress (tests, benchmarks).
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&mut self, _: u64, _: u64) {}
    fn step(&mut self, _: u64, _: f32, _: f64, _: Option<u64>) {}
    fn message(&mut self, _: &str) {}
    fn finish(&mut self) {}
}

/// Reads the options of the run in `run_dir` from its newest checkpoint, with `--steps`
/// optionally extended. Errors when the run has no checkpoint.
pub fn resume_options(run_dir: &Path) -> Result<(TrainOptions, PathBuf)> {
    let Some(latest) = ckpt::latest_checkpoint(run_dir)? else {
        bail!(
            "--resume {}: no checkpoint found under {}; nothing to resume",
            run_dir.display(),
            RunDir::new(run_dir).checkpoints().display()
        );
    };
    let state_path = latest.join(ckpt::STATE_FILE);
    let text = std::fs::read_to_string(&state_path)
        .with_context(|| format!("cannot read {}", state_path.display()))?;
    let state: TrainerState = serde_json::from_str(&text)
        .with_context(|| format!("{}: corrupt trainer state", state_path.display()))?;
    let mut opts: TrainOptions =
        serde_json::from_value(state.train.clone()).with_context(|| {
            format!(
                "{}: field 'train' is not a memwall training configuration",
                latest.display()
            )
        })?;
    opts.out = run_dir.to_path_buf();
    Ok((opts, latest))
}

/// Runs (or resumes, when `resume` is the checkpoint to continue from) a training run.
pub fn train(
    opts: &TrainOptions,
    resume: Option<&Path>,
    progress: &mut dyn Progress,
) -> Result<TrainSummary> {
    opts.check()?;
    // ---- everything that can be checked before work starts ----
    let init_spec = match &opts.init {
        Some(dir) => {
            Some(ckpt::load_spec(dir).with_context(|| format!("--init {}", dir.display()))?)
        }
        None => None,
    };
    let spec = match (&init_spec, resume) {
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
    let data = DataSet::open(&opts.data)?;
    if data.meta.vocab_size > spec.vocab_size {
        bail!(
            "--data {}: prepared for a vocabulary of {} tokens but the model has vocab_size {}",
            opts.data.display(),
            data.meta.vocab_size,
            spec.vocab_size
        );
    }
    check_fits(&data.train, "train", opts.seq)?;
    check_fits(&data.val, "val", opts.seq)?;

    // ---- plan (refused before anything is written if over budget), then allocate once ----
    let baseline = rss::current_rss().unwrap_or(0);
    let plan = opts
        .strategies
        .plan(&spec, (opts.batch, opts.seq, opts.threads), baseline)?;
    let run = RunDir::new(&opts.out);
    prepare_run_dir(&run, resume.is_some())?;
    PlanJson::from_plan(&plan, baseline)?.write(&run.plan())?;
    progress.message(&format!(
        "plan: {} | batch {} x grad-accum {} x seq {} | recompute {} | arena {} + outside the arena {} | predicted peak RSS {}",
        spec.describe(),
        opts.batch,
        opts.strategies.grad_accum,
        opts.seq,
        plan.cfg.recompute,
        fmt_bytes(plan.arena_bytes),
        fmt_bytes(plan.external_bytes),
        fmt_bytes(plan.total_bytes() + baseline)
    ));
    let plan_total = plan.total_bytes();
    let mut ex = Executor::new(plan)?;

    // ---- initial state ----
    let fp16 = opts.strategies.precision == Precision::F16;
    let mut scaler = fp16.then(LossScaler::new);
    let (mut step, data_position) = match resume {
        Some(ck) => {
            let layout = ex.plan.layout.clone();
            ckpt::load_params(ck, &layout, ex.params_mut())?;
            let st = ckpt::load_trainer_state(ck, &layout, ex.moments_mut())?;
            run_dir::metrics::truncate(&run.metrics(), st.step)?;
            progress.message(&format!(
                "resuming from {} (step {})",
                ck.display(),
                st.step
            ));
            if let (Some(sc), Some(saved)) = (scaler.as_mut(), st.loss_scale) {
                sc.state = saved;
            }
            (st.step, st.data_position)
        }
        None => {
            let layout = ex.plan.layout.clone();
            match &opts.init {
                Some(dir) => ckpt::load_params(dir, &layout, ex.params_mut())?,
                None => layout.init(ex.params_mut(), spec.n_layer, opts.seed),
            }
            let _ = std::fs::remove_file(run.metrics());
            (0, 0)
        }
    };
    if step >= opts.steps {
        bail!(
            "the run in {} is already at step {step}; pass a larger --steps to continue",
            opts.out.display()
        );
    }

    // One loader batch is one optimizer step: grad_accum micro-batches of `batch` rows.
    let rows = opts.batch * opts.strategies.grad_accum;
    let mut loader = BatchLoader::new(data.train.clone(), rows, opts.seq, opts.seed, data_position);
    let mut batch = vec![0u32; rows * (opts.seq + 1)]; // [accum·B, T+1], counted in plan staging
    let mut metrics = MetricsLog::append_to(&run.metrics())?;

    let first_step = step;
    let epoch = Instant::now();
    let n_ops = ex.plan.schedule.ops.len();
    let mut profile = (opts.profile_steps > 0).then(|| Profile {
        baseline_rss: baseline,
        steps: Vec::new(),
    });
    let mut recorder = Some(OpRecorder::new(epoch, n_ops));
    let mut leak = LeakCheck::new(plan_total);
    progress.start(step, opts.steps);
    let tokens_per_step = (rows * opts.seq) as f64;
    let (mut final_loss, mut final_val, mut last_ckpt) = (f32::NAN, None, None);
    let (mut timed_tokens, mut timed_secs) = (0.0f64, 0.0f64);
    while step < opts.steps {
        let t0 = Instant::now();
        let profiling = profile.is_some() && step - first_step < opts.profile_steps;
        let mut spans = Vec::new();
        loader.next_into(&mut batch);
        let t_loaded = Instant::now();
        ex.set_batch(&batch)?;
        if profiling {
            spans.push(Span {
                track: Track::Io,
                name: "loader: next batch".into(),
                start_us: micros(epoch, t0),
                end_us: micros(epoch, t_loaded),
                bytes: None,
            });
            spans.push(Span {
                track: Track::Io,
                name: "stage batch into the arena".into(),
                start_us: micros(epoch, t_loaded),
                end_us: micros(epoch, Instant::now()),
                bytes: Some(std::mem::size_of_val(batch.as_slice()) as u64),
            });
            ex.record_ops(recorder.take());
        }
        let lr = cosine_with_warmup(step, opts.steps, opts.warmup, opts.lr, opts.min_lr_frac);
        let hp = OptimHparams {
            lr,
            beta1: opts.beta1,
            beta2: opts.beta2,
            eps: 1e-8,
            weight_decay: opts.weight_decay,
            grad_clip: opts.grad_clip,
            step: step + 1,
        };
        let scale = scaler.map(|s| s.state.scale);
        ex.set_loss_scale(scale.unwrap_or(1.0));
        let stats = ex.train_step(&hp);
        let mut step_profile = None;
        if profiling {
            recorder = ex.record_ops(None);
            step_profile = Some(StepProfile {
                step: step + 1,
                start_us: micros(epoch, t0),
                end_us: micros(epoch, Instant::now()),
                ops: recorder.as_mut().map(|r| r.take(n_ops)).unwrap_or_default(),
                spans,
            });
        }
        if let Some(sc) = scaler.as_mut() {
            sc.update(stats.skipped);
        } else if stats.skipped {
            bail!(
                "the gradients became {} at step {}; try a lower --lr (now {}) or --grad-clip",
                stats.grad_norm,
                step + 1,
                opts.lr
            );
        }
        let secs = t0.elapsed().as_secs_f64();
        step += 1;
        if !stats.loss.is_finite() {
            bail!(
                "loss became {} at step {step}; try a lower --lr (now {}) or --grad-clip; the last checkpoint is {}",
                stats.loss,
                opts.lr,
                last_ckpt
                    .as_ref()
                    .map(|p: &PathBuf| p.display().to_string())
                    .unwrap_or_else(|| "none".into())
            );
        }
        if step > first_step + 1 {
            timed_tokens += tokens_per_step;
            timed_secs += secs;
        }
        final_loss = stats.loss;
        let val_loss = if (opts.eval_every > 0 && step % opts.eval_every == 0) || step == opts.steps
        {
            let te = Instant::now();
            let v = evaluate(&mut ex, &data, opts, &mut batch)?;
            if let Some(sp) = step_profile.as_mut() {
                sp.spans.push(Span {
                    track: Track::Compute,
                    name: format!("evaluate ({} validation batches)", opts.eval_batches),
                    start_us: micros(epoch, te),
                    end_us: micros(epoch, Instant::now()),
                    bytes: None,
                });
            }
            progress.message(&format!(
                "step {step}: train loss {:.4}, val loss {v:.4}",
                stats.loss
            ));
            final_val = Some(v);
            Some(v)
        } else {
            None
        };
        let rss_now = rss::current_rss();
        let m = Metric {
            step,
            loss: stats.loss,
            lr,
            grad_norm: stats.grad_norm,
            loss_scale: scale,
            skipped: stats.skipped,
            tokens_per_s: tokens_per_step / secs,
            step_s: secs,
            rss_bytes: rss_now,
            process_step: Some(step - first_step),
            val_loss,
        };
        if let Some(w) = rss_now.and_then(|r| leak.observe(step - first_step, r)) {
            progress.message(&w.message());
        }
        metrics.push(&m)?;
        progress.step(step, stats.loss, tokens_per_step / secs, rss_now);
        if (opts.save_every > 0 && step % opts.save_every == 0) || step == opts.steps {
            let ts = Instant::now();
            let state = TrainerState {
                step,
                data_position: loader.position(),
                seed: opts.seed,
                // No op draws random numbers (no dropout) and batch k is a pure function of
                // (seed, k), so the whole RNG state is the seed.
                rng_state: opts.seed,
                model: spec.to_hf_config(),
                train: serde_json::to_value(opts)?,
                memwall_version: env!("CARGO_PKG_VERSION").to_string(),
                loss_scale: scaler.map(|s| s.state),
            };
            let dir = ckpt::save_checkpoint(
                &opts.out,
                &spec,
                &ex.plan.layout,
                ex.params(),
                &ex.moments(),
                &state,
            )
            .with_context(|| {
                format!("saving the checkpoint of step {step} (earlier checkpoints are intact)")
            })?;
            if let Some(sp) = step_profile.as_mut() {
                sp.spans.push(Span {
                    track: Track::Io,
                    name: format!("write checkpoint {}", dir.display()),
                    start_us: micros(epoch, ts),
                    end_us: micros(epoch, Instant::now()),
                    bytes: Some(dir_bytes(&dir)),
                });
            }
            last_ckpt = Some(dir);
        }
        if let (Some(p), Some(sp)) = (profile.as_mut(), step_profile) {
            p.steps.push(sp);
            // Write the reports as soon as the profiled steps are done, so they exist even
            // if the run stops later; they are refreshed at the end with the whole curves.
            if p.steps.len() as u64 == opts.profile_steps || step == opts.steps {
                metrics.flush()?;
                // A report that cannot be written (a full disk, say) must not end the run.
                match write_profile(&run, p) {
                    Ok(html) => progress.message(&format!(
                        "profile: {} written (trace.json, memory.svg, profile.json)",
                        html.display()
                    )),
                    Err(e) => progress.message(&format!(
                        "warning: the profile could not be written ({e:#}); training goes on"
                    )),
                }
            }
        }
    }
    progress.finish();
    metrics.flush()?;
    let report = match &profile {
        Some(p) if !p.steps.is_empty() => match write_profile(&run, p) {
            Ok(html) => Some(html),
            Err(e) => {
                progress.message(&format!(
                    "warning: the report could not be written ({e:#}); `memwall report {}` retries",
                    opts.out.display()
                ));
                None
            }
        },
        _ => None,
    };
    let leak = leak.report();
    if let Some(l) = &leak {
        progress.message(&l.message());
    }
    Ok(TrainSummary {
        out: opts.out.clone(),
        first_step,
        last_step: step,
        final_loss,
        final_val_loss: final_val,
        tokens_per_s: if timed_secs > 0.0 {
            timed_tokens / timed_secs
        } else {
            0.0
        },
        plan_total_bytes: plan_total,
        baseline_bytes: baseline,
        peak_rss_bytes: rss::peak_rss(),
        last_checkpoint: last_ckpt,
        leak,
        report,
    })
}

/// Saves `profile.json` and regenerates the reports from the run directory; returns the
/// path of `report.html`.
fn write_profile(run: &RunDir, profile: &Profile) -> Result<PathBuf> {
    profile.write(&run.profile())?;
    Ok(crate::profile::report::write_reports(run.root())?.html)
}

/// Bytes of the files directly in `dir` (a checkpoint's size, for the I/O track).
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Mean validation loss over `eval_batches` fixed batches of the validation split.
fn evaluate(
    ex: &mut Executor,
    data: &DataSet,
    opts: &TrainOptions,
    batch: &mut [u32],
) -> Result<f32> {
    let mut sum = 0.0f64;
    for k in 0..opts.eval_batches {
        fill_batch(
            &data.val,
            opts.batch * opts.strategies.grad_accum,
            opts.seq,
            opts.seed ^ VAL_STREAM,
            k,
            batch,
        );
        ex.set_batch(batch)?;
        sum += ex.eval_loss() as f64;
    }
    Ok((sum / opts.eval_batches as f64) as f32)
}

/// Creates the run directory and checks it is writable; refuses to overwrite an earlier run.
fn prepare_run_dir(run: &RunDir, resuming: bool) -> Result<()> {
    let out = run.root();
    if out.is_file() {
        bail!(
            "--out {}: is a file; give a directory for the run",
            out.display()
        );
    }
    std::fs::create_dir_all(out)
        .with_context(|| format!("--out {}: cannot create the run directory", out.display()))?;
    if !resuming && ckpt::latest_checkpoint(out)?.is_some() {
        bail!(
            "--out {}: already holds a run with checkpoints; continue it with --resume {} or choose a new --out",
            out.display(),
            out.display()
        );
    }
    let probe = run.write_probe();
    std::fs::write(&probe, b"ok")
        .with_context(|| format!("--out {}: directory is not writable", out.display()))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::LossScaler;

    #[test]
    fn loss_scale_halves_on_overflow_and_doubles_after_clean_steps() {
        let mut s = LossScaler::new();
        assert_eq!(s.state.scale, 65536.0);
        s.update(true);
        assert_eq!((s.state.scale, s.state.clean_steps), (32768.0, 0));
        for _ in 0..LossScaler::GROWTH_INTERVAL - 1 {
            s.update(false);
        }
        assert_eq!(s.state.scale, 32768.0);
        s.update(false);
        assert_eq!((s.state.scale, s.state.clean_steps), (65536.0, 0));
        // An overflow resets the count of clean steps.
        for _ in 0..10 {
            s.update(false);
        }
        s.update(true);
        assert_eq!((s.state.scale, s.state.clean_steps), (32768.0, 0));
    }
}
