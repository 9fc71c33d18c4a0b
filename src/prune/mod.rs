//! `memwall prune`: a smaller model of the same family, chosen by the parameters or the
//! memory it must fit, that loads anywhere its family loads.
//!
//! 1. **Scores** ([`score`]): a forward pass over calibration sequences of the user's data
//!    (the model run as `sample` runs it, nothing else in memory) gives each embedding
//!    channel, attention head, MLP channel and layer an importance.
//! 2. **Shape** ([`shape`]): one width per kind for every layer (an ordinary config),
//!    from flags, a parameter fraction (`--keep`), or a memory budget for a use
//!    (`--fit-memory` with `--for`: the plan of that use, as `memwall plan` makes it). A
//!    budget allows a frontier of embedding and MLP widths; [`select`] keeps the candidate
//!    whose pruned model has the lowest loss on held-out calibration sequences.
//! 3. **Weights** ([`cut`]): every tensor cut to the kept channels, heads and layers of the
//!    highest scores, written as a Hugging Face directory with the model's tokenizer, and
//!    `prune.json` (the scores, what was kept, the shape and its plan).
//!
//! The pruned model is meant to be healed by training (`train --init OUT`).

pub mod cut;
pub mod held;
pub mod report;
pub mod score;
pub mod select;
pub mod shape;
mod write;

pub use write::REPORT_FILE;

use crate::backend::DeviceId;
use crate::ckpt;
use crate::data::DataSet;
use crate::data::tokenizer::model_tokenizer_id;
use crate::model::{ModelSpec, ParamLayout, ParamTensor};
use crate::plan::{Mode, StepConfig, build_plan};
use anyhow::{Context, Result, bail};
use cut::Kept;
use score::Scores;
use serde::Serialize;
use shape::{Shape, ShapeRequest};
use std::path::PathBuf;

/// What the pruned model must fit (`--fit-memory` with `--for`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Use {
    /// Full fine-tuning (fp32 weights and AdamW moments).
    Train,
    /// LoRA (rank 16 on every layer) on an f32 base.
    Lora,
    /// QLoRA: LoRA on a base kept in q4_0 blocks (4.5 bits a weight, rows of any multiple of 32).
    Qlora,
    /// Generation (`memwall sample`).
    Sample,
}

impl Use {
    /// The `--for` values.
    pub const NAMES: &'static str = "train, lora, qlora, sample";

    /// Its `--for` name.
    pub fn name(self) -> &'static str {
        match self {
            Use::Train => "train",
            Use::Lora => "lora",
            Use::Qlora => "qlora",
            Use::Sample => "sample",
        }
    }

    /// The `memwall plan` flags of the same plan (`None`: `plan` does not plan generation).
    pub fn plan_flags(self) -> Option<&'static str> {
        match self {
            Use::Train => Some(""),
            Use::Lora => Some(" --lora 16"),
            Use::Qlora => Some(" --lora 16 --base-quant q4_0"),
            Use::Sample => None,
        }
    }
}

impl std::str::FromStr for Use {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Use> {
        Ok(match s {
            "train" => Use::Train,
            "lora" => Use::Lora,
            "qlora" => Use::Qlora,
            "sample" => Use::Sample,
            _ => bail!("--for {s}: choose one of {}", Use::NAMES),
        })
    }
}

/// A memory budget for the pruned model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitMemory {
    pub bytes: u64,
    pub for_use: Use,
    /// The step's micro-batch the budget is for (1 when sampling; its sequences are the
    /// calibration's length).
    pub batch: usize,
    /// The process's memory before planning (`memwall plan`'s baseline).
    pub baseline: u64,
}

/// What to prune and how.
#[derive(Clone, Debug)]
pub struct PruneOptions {
    /// A Hugging Face model directory (a GGUF is converted into one first).
    pub model: PathBuf,
    /// The GGUF file `model` was converted from, whose blocks the original is held as
    /// unless `base_quant` says otherwise.
    pub gguf: Option<PathBuf>,
    /// How the original is held while scored (`--base-quant`; `None`: a GGUF's own blocks,
    /// else f32 where the memory available holds it, else q8_0), and so each candidate
    /// ([`held`]).
    pub base_quant: Option<crate::ir::BaseQuant>,
    pub data: PathBuf,
    pub out: PathBuf,
    pub shape: ShapeRequest,
    pub fit: Option<FitMemory>,
    /// Calibration sequences and their length (`None`: [`DEFAULT_SEQ`] or the model's
    /// context if shorter), which is also the `fit`'s step's.
    pub sequences: usize,
    pub seq: Option<usize>,
    pub seed: u64,
    pub threads: usize,
    pub device: DeviceId,
}

/// Tokens per calibration sequence unless `--seq` says.
pub const DEFAULT_SEQ: usize = 256;

impl PruneOptions {
    /// The calibration's (and the fit's) sequence length for `spec`, checked.
    pub fn seq_for(&self, spec: &ModelSpec) -> Result<usize> {
        let seq = self.seq.unwrap_or(DEFAULT_SEQ.min(spec.max_seq()));
        if seq == 0 || seq > spec.max_seq() {
            bail!(
                "--seq {seq}: calibration sequences must be 1 to {} tokens (the model's context)",
                spec.max_seq()
            );
        }
        Ok(seq)
    }
}

/// The plan of `fit`'s use of `spec` with sequences of `seq` tokens: its predicted peak
/// (bytes).
pub fn planned_peak(
    spec: &ModelSpec,
    fit: &FitMemory,
    (seq, threads): (usize, usize),
    device: DeviceId,
) -> Result<u64> {
    let (mut cfg, mode) = match fit.for_use {
        Use::Sample => (StepConfig::new(1, seq, threads), Mode::Generate),
        _ => {
            let mut cfg = StepConfig::new(fit.batch, seq, threads);
            // `train`'s default recomputation (selective), as `memwall plan` plans it.
            if let crate::ir::RecomputeChoice::Fixed(r) = crate::ir::RecomputeChoice::default() {
                cfg.recompute = r;
            }
            (cfg, Mode::Train)
        }
    };
    if matches!(fit.for_use, Use::Lora | Use::Qlora) {
        let lora = crate::exec::resolve::LoraRequest {
            r: 16,
            ..Default::default()
        };
        cfg.lora = Some(lora.spec(spec.family)?);
    }
    if fit.for_use == Use::Qlora {
        cfg.base_quant = crate::ir::BaseQuant::Blocks(crate::dtype::GgmlType::Q4_0);
    }
    let plan = build_plan(spec, &cfg, mode, device.sizing())?;
    Ok(plan.predicted_peak(fit.baseline))
}

/// The shapes `opts` allows (before any scoring: every flag is checked first): the one its
/// flags give, or the frontier of embedding and MLP widths its budget allows, widest
/// embedding first (`--keep`, or `--fit-memory`: each the largest of its kind whose plan for
/// the use fits).
pub fn resolve_shapes(spec: &ModelSpec, opts: &PruneOptions) -> Result<Vec<Shape>> {
    let Some(fit) = &opts.fit else {
        return shape::resolve(spec, &opts.shape);
    };
    if opts.shape.keep.is_some() || opts.shape.hidden.is_some() || opts.shape.mlp.is_some() {
        bail!(
            "--fit-memory chooses the embedding and MLP widths: leave out --keep, --hidden and \
             --mlp (--heads, --kv-heads and --depth may be given with it)"
        );
    }
    let base = fit_base(spec, opts)?;
    let seq = opts.seq_for(spec)?;
    let peak = |s: &Shape| planned_peak(&s.apply(spec), fit, (seq, opts.threads), opts.device);
    let mut fits = |s: &Shape| Ok(peak(s)? <= fit.bytes);
    Ok(shape::frontier(spec, base, &mut fits)?.unwrap_or(vec![base]))
}

/// The shape `--fit-memory` shrinks: the model's, with the heads and depth given.
fn fit_base(spec: &ModelSpec, opts: &PruneOptions) -> Result<Shape> {
    let one = shape::resolve(spec, &opts.shape)?;
    Ok(one[0])
}

/// `--fit-memory`'s figures for the shape `chosen` (one of [`resolve_shapes`]): its planned
/// peak and the next larger shape's (`None` without `--fit-memory`).
pub fn fit_report(
    spec: &ModelSpec,
    opts: &PruneOptions,
    chosen: Shape,
) -> Result<Option<FitReport>> {
    let Some(fit) = &opts.fit else {
        return Ok(None);
    };
    let base = fit_base(spec, opts)?;
    let seq = opts.seq_for(spec)?;
    let peak = |s: &Shape| planned_peak(&s.apply(spec), fit, (seq, opts.threads), opts.device);
    let larger = match chosen == base {
        true => None,
        false => {
            let l = shape::next_larger(spec, chosen, base);
            Some((l, peak(&l)?))
        }
    };
    Ok(Some(FitReport {
        budget_bytes: fit.bytes,
        for_use: fit.for_use,
        batch: fit.batch,
        seq,
        peak_bytes: peak(&chosen)?,
        larger,
    }))
}

/// `--fit-memory`'s result: the budget, the chosen shape's planned peak and the next larger
/// shape's (over the budget; `None` when the model's own widths fit).
#[derive(Clone, Debug, Serialize)]
pub struct FitReport {
    pub budget_bytes: u64,
    pub for_use: Use,
    pub batch: usize,
    pub seq: usize,
    pub peak_bytes: u64,
    pub larger: Option<(Shape, u64)>,
}

/// What `prune` did (also written as `prune.json` beside the model).
#[derive(Clone, Debug, Serialize)]
pub struct Pruned {
    pub model: PathBuf,
    pub out: PathBuf,
    pub before: Shape,
    pub after: Shape,
    pub params_before: usize,
    pub params_after: usize,
    /// How the original was held while it was scored.
    pub held: Held,
    /// Of each kind's total importance, the fraction kept (heads and MLP: the mean over the
    /// kept layers; layers: of the total Block Influence).
    pub kept_importance: KeptImportance,
    pub fit: Option<FitReport>,
    /// The shapes the budget allowed and each one's calibration loss ([`select`]; empty
    /// when the flags gave one shape). The chosen one has the lowest.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<select::Candidate>,
    /// What the pruned model's layers keep of the original's.
    pub kept: Kept,
    pub scores: Scores,
    /// What the user should know (a GGUF quantized again by `--base-quant`).
    #[serde(skip)]
    pub notes: Vec<String>,
}

/// How `prune` held the original while it scored it ([`held`]).
#[derive(Clone, Debug, Serialize)]
pub struct Held {
    /// `f32`, `q8_0 blocks`, `the blocks of FILE`.
    pub storage: String,
    /// The scoring plan's bytes (the weights as held, one sequence's activations).
    pub bytes: u64,
    /// Of which the weights.
    pub weight_bytes: u64,
}

/// Fractions of the importance kept, per kind.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct KeptImportance {
    pub hidden: f64,
    pub heads: f64,
    pub mlp: f64,
    pub layers: f64,
}

fn fraction(all: &[f64], kept: &[usize]) -> f64 {
    let total: f64 = all.iter().sum();
    if total > 0.0 {
        kept.iter().map(|&i| all[i]).sum::<f64>() / total
    } else {
        1.0
    }
}

fn kept_importance(scores: &Scores, kept: &Kept) -> KeptImportance {
    let mean = |per: &dyn Fn(usize, usize) -> f64| {
        let n = kept.layers.len().max(1) as f64;
        kept.layers
            .iter()
            .enumerate()
            .map(|(k, &l)| per(k, l))
            .sum::<f64>()
            / n
    };
    KeptImportance {
        hidden: fraction(&scores.hidden, &kept.hidden),
        heads: mean(&|k, l| fraction(&scores.heads[l], &kept.heads[k])),
        mlp: mean(&|k, l| fraction(&scores.mlp[l], &kept.mlp[k])),
        layers: fraction(&scores.block_influence, &kept.layers),
    }
}

/// Prunes `opts.model` to the shape asked for; `tick(done, total)` follows the
/// sequences run (scoring, then each candidate's calibration loss).
///
/// One model is held at a time ([`held`]): the original while it is scored, then each
/// candidate; the pruned weights are cut from the original's files as they are written.
pub fn prune(opts: &PruneOptions, tick: &mut dyn FnMut(usize, usize)) -> Result<Pruned> {
    let spec = ckpt::load_spec(&opts.model)?;
    cut::check_family(&spec)?;
    let shapes = resolve_shapes(&spec, opts)?;
    ckpt::adapter::check_new_out_dir(&opts.out)?;
    let seq = opts.seq_for(&spec)?;
    if opts.sequences == 0 {
        bail!("--calibration 0: give at least one sequence to score the model on");
    }
    let data = open_data(opts, &spec, seq)?;
    let mut notes = Vec::new();
    let gguf = opts.gguf.as_deref();
    let at = (opts.threads, opts.device);
    let available = crate::util::rss::available_memory();
    let (given, on) = ((gguf, opts.base_quant), (seq, at));
    let storage = held::original_storage(&spec, given, on, available, &mut notes)?;
    let blocks = match (storage.quant, gguf) {
        (crate::ir::BaseQuant::Keep, Some(g)) => Some(crate::gguf::base::BaseSource::open(g)?),
        _ => None,
    };
    let n = opts.sequences;
    let choosing = shapes.len() > 1;
    let total = n + if choosing {
        shapes.len() * select::SEQUENCES
    } else {
        0
    };
    let mut done = 0;
    let mut tick = || {
        done += 1;
        tick(done, total);
    };
    let layout = ParamLayout::new(&spec);
    let mut pruned = None;
    ckpt::load_params_by(&opts.model, &layout, |read| {
        let plan = held::plan(&spec, seq, &storage, at)?;
        let held_bytes = plan.total_bytes();
        let weight_bytes = (plan.bytes_by_category().into_iter())
            .filter(|(c, _)| *c == crate::ir::Category::Param)
            .map(|(_, b)| b)
            .sum();
        let mut values =
            |t: &ParamTensor, put: &mut dyn FnMut(&[f32]) -> Result<()>| held::rows(t, read, put);
        let mut ex = held::open(plan, opts.device, blocks.as_ref(), &mut values)?;
        let scores = score::score(&mut ex, &spec, &data, (n, opts.seed), &mut tick)?;
        let held = held::storage_of(&ex.plan);
        drop(ex);
        let (after, candidates) = match choosing {
            false => (shapes[0], Vec::new()),
            true => {
                // Sequences drawn after the scored ones.
                let source = data.train_source(false);
                let rows = (n..n + select::SEQUENCES)
                    .map(|k| score::calibration_window(&source, seq, opts.seed, k as u64))
                    .collect::<Result<Vec<_>>>()?;
                let on = (seq, opts.threads, opts.device);
                let what = (&spec, &scores, held.as_ref());
                let c = select::by_loss(read, what, &shapes, &rows, on, &mut tick)?;
                let best = (c.iter())
                    .min_by(|a, b| a.loss.total_cmp(&b.loss))
                    .expect("candidates")
                    .shape;
                (best, c)
            }
        };
        let fit = fit_report(&spec, opts, after)?;
        let kept = cut::choose(&spec, &scores, &after);
        let mut new_spec = after.apply(&spec);
        new_spec.name = opts.out.display().to_string();
        let new_layout = ParamLayout::new(&new_spec);
        let p = Pruned {
            model: opts.model.clone(),
            out: opts.out.clone(),
            before: Shape::of(&spec),
            after,
            params_before: spec.num_params(),
            params_after: new_layout.total,
            held: Held {
                storage: storage.describe(gguf),
                bytes: held_bytes,
                weight_bytes,
            },
            kept_importance: kept_importance(&scores, &kept),
            fit,
            candidates,
            kept: kept.clone(),
            scores,
            notes: std::mem::take(&mut notes),
        };
        let cut = cut::Cut::new(&spec, &kept, &layout);
        let report = serde_json::to_vec_pretty(&p)?;
        let to = (opts.model.as_path(), opts.out.as_path());
        write::write(to, (&new_spec, &new_layout), (cut, read), &report)?;
        pruned = Some(p);
        Ok(())
    })?;
    pruned.context("internal error: prune wrote nothing")
}

/// Opens the calibration data, checked against the model's tokenizer and long enough.
fn open_data(opts: &PruneOptions, spec: &ModelSpec, seq: usize) -> Result<DataSet> {
    let data = DataSet::open(&opts.data)?;
    if let Some(id) = model_tokenizer_id(&[opts.model.as_path()], false)? {
        crate::data::check::check_tokenizer(&id, &data.meta, &opts.data)?;
    }
    crate::data::check::check_vocabulary(&data.meta, spec.vocab_size, &opts.data)?;
    if data.examples.is_none() {
        crate::data::loader::check_fits(&data.train, "train", seq)?;
    }
    Ok(data)
}
