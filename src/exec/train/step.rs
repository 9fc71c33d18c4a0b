//! One optimizer step of a run, and what falls due after it: the validation loss, the
//! metrics line, a checkpoint, and (for the first `--profile-steps` steps) the profile.

use super::profiling::{dir_bytes, span, write_profile};
use super::run::Run;
use super::{Progress, TrainOptions};
use crate::ckpt::{self, TrainerState};
use crate::data::loader::{DataSet, Part};
use crate::exec::executor::{Executor, OptimHparams, StepStats, dropout_seed};
use crate::exec::lr::cosine_with_warmup;
use crate::profile::record::micros;
use crate::profile::{Span, StepProfile, Track};
use crate::run_dir::{MEMORY_SVG_FILE, Metric, PROFILE_FILE, TRACE_FILE, Update};
use crate::util::rss;
use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::time::Instant;

/// Fault injection for tests: with `MEMWALL_KILL_RANK=R:S` in the environment, rank R kills
/// itself (SIGKILL: no unwinding, no goodbye to its peers) in step S, after drawing its batch,
/// while the other ranks wait in the step's collectives.
pub const KILL_RANK_ENV: &str = "MEMWALL_KILL_RANK";

/// Kills this process when [`KILL_RANK_ENV`] names its rank and `step`.
fn injected_kill(rank: usize, step: u64) {
    let Ok(v) = std::env::var(KILL_RANK_ENV) else {
        return;
    };
    let parsed = v
        .split_once(':')
        .and_then(|(r, s)| Some((r.parse::<usize>().ok()?, s.parse::<u64>().ok()?)));
    if parsed == Some((rank, step)) {
        // SAFETY: sending a signal to this process.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// Salt separating the validation batch stream from the training stream.
const VAL_STREAM: u64 = 0x5641_4C5F_5354_524D;

/// Whether something done every `every` steps (0: only at the end) is due at `step` of `last`.
fn due(every: u64, step: u64, last: u64) -> bool {
    (every > 0 && step.is_multiple_of(every)) || step == last
}

impl Run<'_> {
    /// Runs step `self.step + 1`: batch, schedule, loss scale; then evaluation, metrics,
    /// checkpoint and profile as due. Errors when the loss or the gradients stop being finite.
    pub(super) fn next_step(&mut self, progress: &mut dyn Progress) -> Result<()> {
        let opts = self.opts;
        let t0 = Instant::now();
        let profiling = self.profile.is_some() && self.step - self.first_step < opts.profile_steps;
        let spans = self.load_batch(t0, profiling)?;
        injected_kill(self.ex.comm().rank(), self.step + 1);
        let lr = cosine_with_warmup(
            self.step,
            opts.steps,
            opts.warmup,
            opts.lr,
            opts.min_lr_frac,
        );
        let hp = OptimHparams {
            lr,
            beta1: opts.beta1,
            beta2: opts.beta2,
            eps: 1e-8,
            weight_decay: opts.weight_decay,
            grad_clip: opts.grad_clip,
            step: self.step + 1,
        };
        let scale = self.scaler.map(|s| s.state.scale);
        self.ex.set_loss_scale(scale.unwrap_or(1.0));
        self.ex
            .set_dropout_seed(dropout_seed(opts.seed, self.step + 1));
        let stats = self
            .ex
            .train_step(&hp)
            .with_context(|| format!("step {}", self.step + 1))?;
        let mut step_profile = profiling.then(|| self.end_recording(t0, spans));
        if stats.loss_tokens == 0 {
            // A step whose rows train nothing (every row a prompt or padding): no update,
            // and no word about the loss scale or the gradients.
            progress.message(&format!(
                "step {}: no trained token in the batch; the update is skipped",
                self.step + 1
            ));
        } else if let Some(sc) = self.scaler.as_mut() {
            sc.update(stats.skipped);
        } else if stats.skipped {
            bail!(
                "the gradients became {} at step {}; try a lower --lr (now {}) or --grad-clip",
                stats.grad_norm,
                self.step + 1,
                opts.lr
            );
        }
        let secs = t0.elapsed().as_secs_f64();
        self.step += 1;
        let step = self.step;
        if !stats.loss.is_finite() {
            bail!(
                "loss became {} at step {step}; try a lower --lr (now {}) or --grad-clip; the last checkpoint is {}",
                stats.loss,
                opts.lr,
                self.last_ckpt
                    .as_ref()
                    .map(|p: &PathBuf| p.display().to_string())
                    .unwrap_or_else(|| "none".into())
            );
        }
        if step > self.first_step + 1 {
            self.timed_tokens += self.tokens_per_step;
            self.timed_secs += secs;
            self.timed_comm_secs += stats.comm_s;
            self.timed_comm_wait_secs += stats.comm_wait_s;
        }
        // A step that trained no token has no loss: the last one that did is reported.
        let trained = (stats.loss_tokens > 0).then_some(stats.loss);
        if let Some(l) = trained {
            self.final_loss = l;
        }
        let val_loss = if due(opts.eval_every, step, opts.steps) {
            self.evaluate(trained, step_profile.as_mut(), progress)?
        } else {
            None
        };
        self.log(&stats, lr, scale, secs, val_loss, progress)?;
        if due(opts.save_every, step, opts.steps) {
            self.save_checkpoint(step_profile.as_mut())?;
        }
        if let Some(sp) = step_profile {
            self.add_profiled_step(sp, progress)?;
        }
        Ok(())
    }

    /// The validation loss before the first update (runs with `--eval-every`), recorded as
    /// `metrics.jsonl`'s step-0 line, so a fine-tune shows where it started.
    pub(super) fn evaluate_initial(&mut self, progress: &mut dyn Progress) -> Result<()> {
        match evaluate(&mut self.ex, &self.data, self.opts, &mut self.batch)? {
            Some(v) => {
                progress.message(&format!(
                    "step 0: val loss {v:.4} (before the first update)"
                ));
                self.metrics.push(&Metric::initial(v))?;
            }
            None => progress.message(&format!("step 0: {NO_VAL_TOKENS}")),
        }
        Ok(())
    }

    /// Draws the step's batch and stages it into the arena; when profiling, returns the two
    /// I/O spans and lends the recorder to the executor.
    fn load_batch(&mut self, t0: Instant, profiling: bool) -> Result<Vec<Span>> {
        let mut spans = Vec::new();
        self.loader.next_into(&mut self.batch)?;
        let t_loaded = Instant::now();
        upload(&mut self.ex, &self.data, &self.batch)?;
        if let Some(t) = &mut self.teacher {
            let hidden = t.outputs(&self.batch, self.opts.seq)?;
            self.ex.upload_teacher(hidden)?;
        }
        if profiling {
            spans.push(span(
                self.epoch,
                Track::Io,
                "loader: next batch".into(),
                (t0, t_loaded),
                None,
            ));
            spans.push(span(
                self.epoch,
                Track::Io,
                "stage batch into the arena".into(),
                (t_loaded, Instant::now()),
                Some(std::mem::size_of_val(self.batch.as_slice()) as u64),
            ));
            self.ex.record_ops(self.recorder.take());
        }
        Ok(spans)
    }

    /// Takes the recorder back after a profiled step; the step's ops, `spans` and the disk
    /// tier's transfers.
    fn end_recording(&mut self, t0: Instant, mut spans: Vec<Span>) -> StepProfile {
        let end_us = micros(self.epoch, Instant::now());
        self.recorder = self.ex.record_ops(None);
        spans.extend(self.ex.take_io_spans(self.epoch));
        StepProfile {
            step: self.step + 1,
            start_us: micros(self.epoch, t0),
            end_us,
            ops: self
                .recorder
                .as_mut()
                .map(|r| r.take(self.n_ops))
                .unwrap_or_default(),
            spans,
        }
    }

    /// The validation loss after the step that trained to `train_loss`, announced.
    fn evaluate(
        &mut self,
        train_loss: Option<f32>,
        step_profile: Option<&mut StepProfile>,
        progress: &mut dyn Progress,
    ) -> Result<Option<f32>> {
        let te = Instant::now();
        let v = evaluate(&mut self.ex, &self.data, self.opts, &mut self.batch)?;
        if let Some(sp) = step_profile {
            sp.spans.push(span(
                self.epoch,
                Track::Compute,
                format!("evaluate ({} validation batches)", self.opts.eval_batches),
                (te, Instant::now()),
                None,
            ));
        }
        let val = match v {
            Some(v) => format!("val loss {v:.4}"),
            None => NO_VAL_TOKENS.to_string(),
        };
        progress.message(&format!(
            "step {}: {}, {val}",
            self.step,
            match train_loss {
                Some(l) => format!("train loss {l:.4}"),
                None => "no train loss (no trained token in the batch)".to_string(),
            }
        ));
        self.final_val = v;
        Ok(v)
    }

    /// Appends the step's line to `metrics.jsonl` (with the leak check's warning, if any) and
    /// reports progress.
    fn log(
        &mut self,
        stats: &StepStats,
        lr: f32,
        loss_scale: Option<f32>,
        secs: f64,
        val_loss: Option<f32>,
        progress: &mut dyn Progress,
    ) -> Result<()> {
        let step = self.step;
        let rss_now = rss::current_rss();
        let peak = rss::peak_rss();
        // On a GPU, --max-memory is the device's: its memory in use is what is held to it.
        let device = self.ex.device_memory_in_use();
        let held = device.or(peak);
        let over = super::over_max_memory(held, self.opts.strategies.max_memory);
        if let (Some(by), false) = (over, self.warned_over_budget) {
            self.warned_over_budget = true;
            progress.message(&super::over_max_memory_warning(
                match device {
                    Some(_) => ("device memory in use", "context"),
                    None => ("peak RSS", "baseline"),
                },
                held.unwrap_or(0),
                self.opts.strategies.max_memory.unwrap_or(0),
                self.predicted_peak,
                by,
            ));
        }
        let m = Metric {
            step,
            update: Some(Update {
                loss: stats.loss,
                lr,
                grad_norm: stats.grad_norm,
                loss_scale,
                skipped: stats.skipped,
                tokens_per_s: self.tokens_per_step / secs,
                trained_tokens: self
                    .data
                    .examples
                    .is_some()
                    .then_some(stats.loss_tokens as u64),
                step_s: secs,
                rss_bytes: rss_now,
                peak_rss_bytes: peak,
                over_max_memory_bytes: over,
                process_step: Some(step - self.first_step),
                comm_s: (self.ex.comm().size() > 1).then_some(stats.comm_s),
                comm_wait_s: (self.ex.comm().size() > 1).then_some(stats.comm_wait_s),
                comm_bytes: (self.ex.comm().size() > 1).then_some(stats.comm_bytes),
            }),
            val_loss,
        };
        if let Some(w) = rss_now.and_then(|r| self.leak.observe(step - self.first_step, r)) {
            progress.message(&w.message());
        }
        self.metrics.push(&m)?;
        progress.step(step, stats.loss, self.tokens_per_step / secs, rss_now);
        Ok(())
    }

    /// Saves `checkpoints/step-NNNNNN/`: weights (sharded above `max_shard_bytes`), moments,
    /// the trainer state and the tokenizer files of `tokenizer_dir`.
    fn save_checkpoint(&mut self, step_profile: Option<&mut StepProfile>) -> Result<()> {
        let (opts, step) = (self.opts, self.step);
        let ts = Instant::now();
        let state = TrainerState {
            step,
            data_position: self.loader.position(),
            seed: opts.seed,
            // Batch k is a pure function of (seed, k) and step k's dropout masks of (seed,
            // k, op, element) (`executor::dropout_seed`): no op keeps a random state, so the
            // whole RNG state is the seed.
            rng_state: opts.seed,
            model: self.spec.to_hf_config(),
            train: serde_json::to_value(opts)?,
            memwall_version: env!("CARGO_PKG_VERSION").to_string(),
            loss_scale: self.scaler.map(|s| s.state),
        };
        let lora = self.ex.plan.lora.clone();
        let base = opts.base_name();
        // Chat data's template (`prepare` writes it beside the data), if the data has one.
        let template = Some(opts.data.join(ckpt::CHAT_TEMPLATE_FILE)).filter(|p| p.is_file());
        let save = ckpt::SaveOptions {
            max_shard_bytes: opts.max_shard_bytes,
            tokenizer_dir: opts.tokenizer_dir.as_deref(),
            chat_template: template.as_deref(),
            adapter: lora.as_ref().map(|l| ckpt::AdapterCheckpoint {
                adapters: &l.adapters,
                base: &base,
            }),
        };
        self.ex
            .finish_update()
            .with_context(|| format!("finishing step {step}'s update before its checkpoint"))?;
        let dir = self
            .ex
            .save_checkpoint(&opts.out, &state, &save)
            .with_context(|| {
                format!("saving the checkpoint of step {step} (earlier checkpoints are intact)")
            })?;
        if let Some(sp) = step_profile {
            sp.spans.push(span(
                self.epoch,
                Track::Io,
                format!("write checkpoint {}", dir.display()),
                (ts, Instant::now()),
                Some(dir_bytes(&dir)),
            ));
        }
        if self.ex.comm().rank() == 0 {
            crate::ckpt::retention::keep_last(&opts.out, opts.keep_last)?;
        }
        self.last_ckpt = Some(dir);
        Ok(())
    }

    /// Adds a profiled step; after the last one, writes the reports at once, so they exist
    /// even if the run stops later (they are refreshed at the end with the whole curves).
    fn add_profiled_step(&mut self, sp: StepProfile, progress: &mut dyn Progress) -> Result<()> {
        let Some(p) = self.profile.as_mut() else {
            return Ok(());
        };
        p.steps.push(sp);
        if p.steps.len() as u64 == self.opts.profile_steps || self.step == self.opts.steps {
            // Every rank profiles; rank 0 alone writes, with the others' collectives.
            super::profiling::gather_comm_spans(self.ex.comm(), p)?;
            if self.ex.comm().rank() != 0 {
                return Ok(());
            }
            self.metrics.flush()?;
            // A report that cannot be written (a full disk, say) must not end the run.
            match write_profile(&self.dir, p) {
                Ok(html) => progress.message(&format!(
                    "profile: {} written ({TRACE_FILE}, {MEMORY_SVG_FILE}, {PROFILE_FILE})",
                    html.display()
                )),
                Err(e) => progress.message(&format!(
                    "warning: the profile could not be written ({e:#}); training goes on"
                )),
            }
        }
        Ok(())
    }
}

/// Stages `batch` for the step: raw text, or examples whose untrained targets are marked.
fn upload(ex: &mut Executor, data: &DataSet, batch: &[u32]) -> Result<()> {
    match data.examples {
        Some(_) => ex.upload_examples(batch),
        None => ex.upload_batch(batch),
    }
}

/// Mean validation loss: for raw text over `eval_batches` fixed batches of windows drawn from
/// the validation split (the mean of the batches' means: every batch has as many targets); for
/// examples over the split's first `eval_batches` × rows examples, each once, in order, the
/// mean over their trained targets (the same figure packed or not, up to rounding).
/// What is said in place of a validation loss over no trained token.
const NO_VAL_TOKENS: &str = "no val loss (the validation examples evaluated have no trained \
    token within a row of --seq + 1 tokens)";

/// `None` when the examples evaluated hold no trained token (a mean over nothing).
fn evaluate(
    ex: &mut Executor,
    data: &DataSet,
    opts: &TrainOptions,
    batch: &mut [u32],
) -> Result<Option<f32>> {
    let (mut sum, mut tokens) = (0.0f64, 0.0f64);
    // Each rank evaluates its part of every validation batch; the executor averages the
    // ranks' losses.
    let part = Part::of_data_axis(&ex.plan.cfg.mesh);
    let source = data.val_source(data.packs(opts.no_pack));
    let rows = opts.batch * opts.strategies.grad_accum;
    // Examples: the first `eval_batches` × rows validation examples, each exactly once, in
    // order (packed rows hold several: fewer batches, the same loss), the mean over their
    // trained targets.
    let limit = opts.eval_batches as usize * rows * part.of;
    let end = limit.min(data.examples.as_ref().map_or(0, |(_, v)| v.len()));
    let mut start = 0;
    while let Some(next) = source.fill_eval((rows, opts.seq), (start, limit), part, batch) {
        let next = next.context("drawing a validation batch")?;
        upload(ex, data, batch)?;
        let loss = ex.eval_loss()? as f64;
        let n = ex.loss_tokens() as f64;
        sum += loss * n;
        tokens += n;
        if next == start {
            bail!("internal error: a validation batch placed no example");
        }
        start = next;
        if start >= end {
            return Ok((tokens > 0.0).then(|| (sum / tokens) as f32));
        }
    }
    // Raw text: `eval_batches` windows drawn from (seed, k).
    for k in 0..opts.eval_batches {
        source
            .fill((rows, opts.seq), opts.seed ^ VAL_STREAM, k, part, batch)
            .context("drawing a validation batch")?;
        upload(ex, data, batch)?;
        sum += ex.eval_loss()? as f64;
    }
    Ok(Some((sum / opts.eval_batches as f64) as f32))
}
