//! `memwall demo`: train a small GPT-2 (`gpt2-tiny`) from scratch on the Shakespeare corpus
//! from a static memory plan, then sample from it. Needs no arguments: the corpus is found or
//! fetched by [`crate::data::corpus`].

use super::print_sample;
use crate::data::{corpus, prepare};
use crate::exec::generate::SampleOptions;
use crate::exec::train::{self, ConsoleProgress, TrainOptions};
use crate::model::ModelSpec;
use crate::plan;
use crate::run_dir::RunDir;
use crate::util::rss;
use anyhow::{Context, Result};
use std::path::PathBuf;

/// What `memwall demo` takes.
#[derive(Clone, Debug)]
pub struct ShakespeareOptions {
    /// Where the prepared data (`data/`) and the run (`run/`, cleared first) go.
    pub out: PathBuf,
    /// Training steps.
    pub steps: u64,
    /// Worker threads.
    pub threads: usize,
}

/// Runs the demo, printing its steps to stdout.
pub fn run(a: &ShakespeareOptions) -> Result<()> {
    let threads = a.threads;
    println!("memwall demo: train a small GPT-2 on Shakespeare from a static memory plan\n");
    let corpus = corpus::demo_corpus()?;
    let data = a.out.join("data");
    let run = a.out.join("run");
    // Only a run this demo (or any memwall run) wrote is replaced; anything else is refused,
    // before the data is prepared.
    let what = format!("the previous demo run {}", run.display());
    RunDir::new(&run).check_previous(&what)?;
    if !data.join("meta.json").exists() {
        let s = prepare::prepare(&prepare::PrepareOptions {
            inputs: vec![corpus],
            out: data.clone(),
            val_fraction: 0.05,
        })?;
        println!(
            "1. prepared {}: {} train / {} val tokens -> {}",
            crate::util::count(s.files as u64, "file"),
            s.train_tokens,
            s.val_tokens,
            data.display()
        );
    } else {
        println!("1. using prepared data in {}", data.display());
    }
    RunDir::new(&run).replace_previous(&what, &mut |m| eprintln!("{m}"))?;
    let mut o = TrainOptions::new("gpt2-tiny", &data, &run);
    o.steps = a.steps;
    o.batch = 8;
    o.seq = 128;
    o.lr = 1e-3;
    o.warmup = 30;
    o.threads = threads;
    o.eval_every = 100.min(a.steps);
    o.save_every = 0;
    o.profile_steps = 3;
    let spec = ModelSpec::preset("gpt2-tiny")?;
    // The plan the run below trains from (its strategies, not the library's defaults).
    let (plan, _) = train::plan_for(&o, &spec, rss::current_rss().unwrap_or(0), 1, false)?;
    println!("\n2. the memory plan, before any step runs:\n");
    print!(
        "{}",
        plan::report::table(
            &plan,
            rss::current_rss().unwrap_or(0),
            &plan::Budgets::NONE,
            o.device.open()?
        )
    );
    println!(
        "\n3. training {} steps (loss should fall from ~10.8):\n",
        o.steps
    );
    let summary = train::train(&o, None, &mut ConsoleProgress::new(25))?;
    println!("{}", summary.describe());
    let ck = summary
        .last_checkpoint
        .context("the demo run saved no checkpoint")?;
    println!("\n4. a sample from the trained model (temperature 0.8, top-k 40):\n");
    print_sample(&SampleOptions {
        checkpoint: ck.clone(),
        prompt: "ROMEO:".into(),
        tokens: 120,
        temperature: 0.8,
        top_k: 40,
        seed: 1,
        threads,
        device: o.device,
        adapter: None,
        stop: Vec::new(),
    })?;
    println!(
        "\n\nfiles: {}, {}, {}\nmore: memwall sample --model {} --prompt \"JULIET:\"",
        RunDir::new(&run).plan().display(),
        RunDir::new(&run).metrics().display(),
        ck.display(),
        ck.display()
    );
    Ok(())
}
