//! `memwall demo finetune`: fine-tune a pretrained model on Shakespeare from a static memory
//! plan, and show what changed.
//!
//! The steps ([`run`]): find or fetch SmolLM2-135M-Instruct's GGUF file ([`super::smollm2`]),
//! convert it once into the user cache ([`crate::gguf::cache::model_dir`]), answer a question
//! greedily and sample "ROMEO:" from the original weights, prepare the Shakespeare corpus with
//! the model's own `tokenizer.json` (kept while its tokenizer hash matches), print the memory
//! plan, fine-tune with the trainer's step-0 and final validation losses, then print the losses
//! before and after (read back from `metrics.jsonl`) and the same sample from the fine-tuned
//! checkpoint. [`FinetuneOptions`] sizes the run, so tests can keep it tiny.

use super::{print_sample, smollm2};
use crate::data::loader::DataSet;
use crate::data::{Tokenizer, check_tokenizer, corpus, prepare};
use crate::exec::generate::SampleOptions;
use crate::exec::train::{self, ConsoleProgress, TrainOptions};
use crate::plan;
use crate::run_dir::{RunDir, metrics};
use crate::util::rss;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The question answered greedily before fine-tuning.
pub const QUESTION: &str = "The capital of France is";
/// The prompt sampled before and after fine-tuning.
pub const PROMPT: &str = "ROMEO:";

/// How big a fine-tune `memwall demo finetune` runs.
#[derive(Clone, Debug)]
pub struct FinetuneOptions {
    /// Where the prepared data (`data-smollm2/`) and the run (`run-smollm2/`, cleared first) go.
    pub out: PathBuf,
    /// Optimizer steps.
    pub steps: u64,
    pub threads: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Validation batches per evaluation (before the first step and after the last).
    pub eval_batches: u64,
    /// Tokens of the greedy answer.
    pub answer_tokens: usize,
    /// Tokens of each "ROMEO:" sample.
    pub sample_tokens: usize,
}

impl FinetuneOptions {
    /// The demo's defaults: 40 steps of 4 x 128 tokens, a few minutes on 2 cores.
    pub fn new(out: &Path, threads: usize) -> FinetuneOptions {
        FinetuneOptions {
            out: out.to_path_buf(),
            steps: 40,
            threads,
            batch: 4,
            seq: 128,
            eval_batches: 8,
            answer_tokens: 12,
            sample_tokens: 80,
        }
    }
}

/// What the demo measured.
#[derive(Clone, Debug)]
pub struct FinetuneReport {
    /// The greedy continuation of [`QUESTION`].
    pub answer: String,
    /// Validation loss before the first update (the run's step-0 record).
    pub val_before: f32,
    /// Validation loss after the last step.
    pub val_after: f32,
    /// Continuations of [`PROMPT`] from the original and the fine-tuned weights.
    pub sample_before: String,
    pub sample_after: String,
    /// The fine-tuned checkpoint.
    pub checkpoint: PathBuf,
    /// The whole demo, fetching and converting included.
    pub elapsed: Duration,
}

/// Runs the demo, printing its steps to stdout.
pub fn run(o: &FinetuneOptions) -> Result<FinetuneReport> {
    let t0 = Instant::now();
    if o.steps == 0 {
        bail!("--steps must be at least 1");
    }
    println!(
        "memwall demo finetune: fine-tune a pretrained SmolLM2-135M-Instruct on Shakespeare from a static memory plan\n"
    );
    let (_, dir, spec) = smollm2::pretrained()?;
    println!(
        "\n2. converted to a Hugging Face model directory: {} ({:.1}M parameters)",
        dir.display(),
        spec.num_params() as f64 / 1e6
    );

    println!("\n3. the original model, greedy (temperature 0):\n");
    let answer = print_sample(&sample(&dir, QUESTION, o.answer_tokens, 0.0, o.threads))?;
    println!("\n\n   and sampled (temperature 0.8, top-k 40):\n");
    let sample_before = print_sample(&sample(&dir, PROMPT, o.sample_tokens, 0.8, o.threads))?;
    println!();

    let data = o.out.join("data-smollm2");
    let run = o.out.join("run-smollm2");
    // Only a run this demo (or any memwall run) wrote is replaced; anything else is refused,
    // before the data is prepared.
    let what = format!("the previous demo run {}", run.display());
    RunDir::new(&run).check_previous(&what)?;
    prepare_data(&dir, &data)?;
    RunDir::new(&run).replace_previous(&what, &mut |m| eprintln!("{m}"))?;
    let mut t = TrainOptions::new(&dir.to_string_lossy(), &data, &run);
    t.init = Some(dir.clone());
    t.steps = o.steps;
    t.batch = o.batch;
    t.seq = o.seq;
    t.lr = 1e-4;
    t.warmup = 5.min(o.steps);
    t.threads = o.threads;
    t.eval_every = o.steps;
    t.eval_batches = o.eval_batches;
    t.save_every = 0;
    // The plan the run below trains from (its strategies, not the library's defaults).
    let (plan, _) = train::plan_for(&t, &spec, rss::current_rss().unwrap_or(0), 1, false)?;
    println!("\n5. the memory plan of a fine-tuning step, before any step runs:\n");
    print!(
        "{}",
        plan::report::table(
            &plan,
            rss::current_rss().unwrap_or(0),
            &plan::Budgets::NONE,
            t.device.open()?
        )
    );
    println!(
        "\n   fine-tuning {} steps of {} x {} tokens (AdamW, lr {}), validation loss before and after:\n",
        t.steps, t.batch, t.seq, t.lr
    );
    let summary = train::train(&t, None, &mut ConsoleProgress::new(5))?;
    println!("{}", summary.describe());
    let checkpoint = summary
        .last_checkpoint
        .context("the fine-tune saved no checkpoint")?;

    let (val_before, val_after) = val_losses(&RunDir::new(&run).metrics())?;
    println!(
        "\n6. validation loss on Shakespeare: {val_before:.3} before, {val_after:.3} after ({:+.3})",
        val_after - val_before
    );

    println!(
        "\n7. \"{PROMPT}\" before fine-tuning (temperature 0.8, top-k 40):\n\n{PROMPT}{sample_before}"
    );
    println!("\n   and after:\n");
    let sample_after = print_sample(&sample(
        &checkpoint,
        PROMPT,
        o.sample_tokens,
        0.8,
        o.threads,
    ))?;
    let elapsed = t0.elapsed();
    println!(
        "\n\nfiles: {}, {}\nmore: memwall sample --model {} --prompt \"JULIET:\"\ntook {:.0} s",
        RunDir::new(&run).metrics().display(),
        checkpoint.display(),
        checkpoint.display(),
        elapsed.as_secs_f64()
    );
    Ok(FinetuneReport {
        answer,
        val_before,
        val_after,
        sample_before,
        sample_after,
        checkpoint,
        elapsed,
    })
}

/// Sampling options for `prompt` from the model in `dir` (seed 1; top-k 40 when sampled).
fn sample(
    dir: &Path,
    prompt: &str,
    tokens: usize,
    temperature: f32,
    threads: usize,
) -> SampleOptions {
    SampleOptions {
        checkpoint: dir.to_path_buf(),
        prompt: prompt.into(),
        tokens,
        temperature,
        top_k: if temperature > 0.0 { 40 } else { 0 },
        seed: 1,
        threads,
        device: Default::default(),
        adapter: None,
        stop: Vec::new(),
    }
}

/// Step 4: the Shakespeare corpus tokenized with the model's `tokenizer.json` into `data`,
/// unless `data` already holds it prepared with that same tokenizer.
fn prepare_data(model: &Path, data: &Path) -> Result<()> {
    let tok = Tokenizer::from_file(model.join("tokenizer.json"))?;
    let ready =
        DataSet::open(data).is_ok_and(|d| check_tokenizer(&tok.id(), &d.meta, data).is_ok());
    if ready {
        println!(
            "\n4. using Shakespeare prepared with the model's tokenizer in {}",
            data.display()
        );
        return Ok(());
    }
    let corpus = corpus::demo_corpus()?;
    let s = prepare::prepare_with(
        &prepare::PrepareOptions {
            inputs: vec![corpus],
            out: data.to_path_buf(),
            val_fraction: 0.05,
        },
        &tok,
    )?;
    println!(
        "\n4. prepared Shakespeare with the model's own tokenizer ({}): {} files, {} train / {} val tokens -> {}",
        tok.id().describe(),
        s.files,
        s.train_tokens,
        s.val_tokens,
        data.display()
    );
    Ok(())
}

/// The validation losses of a fresh run's `metrics.jsonl`: the step-0 record (before the
/// first update) and the last step's.
pub(crate) fn val_losses(path: &Path) -> Result<(f32, f32)> {
    let records = metrics::read(path)?;
    let before = records
        .iter()
        .find(|m| m.step == 0)
        .and_then(|m| m.val_loss)
        .with_context(|| {
            format!(
                "{}: no step-0 validation loss (the loss before the first update)",
                path.display()
            )
        })?;
    let last = records.iter().map(|m| m.step).max().unwrap_or(0);
    let after = records
        .iter()
        .filter(|m| m.step == last && last > 0)
        .find_map(|m| m.val_loss)
        .with_context(|| {
            format!(
                "{}: no validation loss after the last step ({last})",
                path.display()
            )
        })?;
    Ok((before, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_before_and_after_are_read_from_the_metrics() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("metrics.jsonl");
        let step = |s: u64, v: Option<f32>| {
            let mut line = format!(
                r#"{{"step":{s},"loss":4.0,"lr":0.0001,"grad_norm":1.0,"tokens_per_s":100.0,"step_s":1.0,"rss_bytes":null"#
            );
            if let Some(v) = v {
                line.push_str(&format!(r#","val_loss":{v}"#));
            }
            line + "}\n"
        };
        let start = "{\"step\":0,\"val_loss\":4.5}\n".to_string();
        std::fs::write(&p, start.clone() + &step(1, None) + &step(2, Some(4.25))).unwrap();
        assert_eq!(val_losses(&p).unwrap(), (4.5, 4.25));

        // No evaluation after the last step, or none before the first: named.
        std::fs::write(&p, start.clone() + &step(1, None)).unwrap();
        let e = val_losses(&p).unwrap_err().to_string();
        assert!(e.contains("after the last step (1)"), "{e}");
        std::fs::write(&p, step(1, Some(4.0))).unwrap();
        let e = val_losses(&p).unwrap_err().to_string();
        assert!(e.contains("step-0") && e.contains("metrics.jsonl"), "{e}");
        std::fs::write(&p, &start).unwrap();
        assert!(val_losses(&p).is_err());
    }
}
