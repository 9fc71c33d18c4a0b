//! What the user asked, as given: every field `None` (or false) where the flag was left out,
//! so resolution can tell a default from a choice (a resumed run keeps its own values for
//! what is left out). The command line fills these from its flags.

use crate::backend::DeviceId;
use crate::ir::BaseQuant;
use crate::ir::shard::Zero;
use crate::ir::{OptimState, Precision, RecomputeChoice, Update};
use crate::model::Family;
use crate::model::lora::{LoraSpec, parse_targets};
use crate::plan::OffloadChoice;
use crate::plan::search::Pick;
use crate::plan::stage_cut::StageCut;
use anyhow::Result;
use std::path::PathBuf;

/// `--model` of `plan` and `train` when left out (and no `--init` gives one).
pub const DEFAULT_MODEL: &str = "gpt2-tiny";
/// `--batch` of `plan` when left out (`train` takes `TrainOptions::new`'s).
pub const DEFAULT_BATCH: usize = 8;
/// `--seq` of `plan` when left out (`train` takes `TrainOptions::new`'s).
pub const DEFAULT_SEQ: usize = 128;

/// The memory strategies asked for (`plan`, `train` and `bench`).
#[derive(Clone, Debug, Default)]
pub struct StrategyRequest {
    /// `--recompute`.
    pub recompute: Option<RecomputeChoice>,
    /// `--grad-accum`.
    pub grad_accum: Option<usize>,
    /// `--optim-state` (`auto` only with `--fit`).
    pub optim_state: Option<Pick<OptimState>>,
    /// `--precision` (`auto` only with `--fit`).
    pub precision: Option<Pick<Precision>>,
    /// `--offload`.
    pub offload: Option<OffloadChoice>,
    /// `--offload-dir`.
    pub offload_dir: Option<PathBuf>,
    /// `--zero`.
    pub zero: Option<Zero>,
    /// `--tp`.
    pub tp: Option<usize>,
    /// `--sequence-parallel`.
    pub sequence_parallel: Option<bool>,
    /// `--pp`.
    pub pp: Option<usize>,
    /// `--pp-layers`.
    pub pp_layers: Option<StageCut>,
    /// `--pp-chunks`.
    pub pp_chunks: Option<usize>,
    /// `--lora R` and its companions.
    pub lora: Option<LoraRequest>,
    /// `--base-quant`.
    pub base_quant: Option<BaseQuant>,
    /// `--update`.
    pub update: Option<Update>,
    /// `--lora-dropout` without `--lora`: the dropout `train --init-adapter` continues the
    /// adapter with (refused elsewhere, naming the flag).
    pub adapter_dropout: Option<f32>,
}

/// `--lora R`, `--lora-alpha`, `--lora-targets`, `--lora-dropout` as given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraRequest {
    pub r: usize,
    /// Default: 2·r (torchtune's and Unsloth's usual ratio).
    pub alpha: Option<f32>,
    /// A comma list of a family's layer names, or `all` (the default).
    pub targets: Option<String>,
    /// Default: 0 (PEFT's).
    pub dropout: Option<f32>,
}

impl LoraRequest {
    /// The adapters for a base of `family`: the targets parsed by the family's names,
    /// the defaults filled in.
    pub fn spec(&self, family: Family) -> Result<LoraSpec> {
        Ok(LoraSpec {
            r: self.r,
            alpha: self.alpha.unwrap_or(2.0 * self.r as f32),
            dropout: self.dropout.unwrap_or(0.0),
            targets: parse_targets(self.targets.as_deref().unwrap_or("all"), family)?,
        })
    }
}

/// A training step asked for (`plan`, `train`).
#[derive(Clone, Debug, Default)]
pub struct StepRequest {
    /// `--model`: a preset, a model directory or a config.json.
    pub model: Option<String>,
    /// `--batch N|auto`.
    pub batch: Option<Pick<usize>>,
    /// `--global-batch`: sequences per optimizer step.
    pub global_batch: Option<usize>,
    /// `--fit`: search the fastest plan that fits `max_memory`.
    pub fit: bool,
    /// `--seq`.
    pub seq: Option<usize>,
    /// `--threads`.
    pub threads: Option<usize>,
    /// `--max-memory`.
    pub max_memory: Option<u64>,
    /// `--max-host-memory`: the pinned host tier's budget beneath a GPU.
    pub max_host_memory: Option<u64>,
    /// `--device`.
    pub device: DeviceId,
    pub strategy: StrategyRequest,
    /// `--distill-from`: a teacher (model directory or GGUF file) and `--distill-alpha`.
    pub distill_from: Option<PathBuf>,
    pub distill_alpha: Option<f32>,
}

/// A training run asked for (`train`): a new one (`data` and `out` given), or the
/// continuation of one (`resume`).
#[derive(Clone, Debug, Default)]
pub struct TrainRequest {
    pub step: StepRequest,
    /// `--data`: the prepared data (with `--resume`: where the run's data is now).
    pub data: Option<PathBuf>,
    /// `--out`: the run directory.
    pub out: Option<PathBuf>,
    /// `--steps`: the run's total optimizer steps.
    pub steps: Option<u64>,
    /// `--lr`.
    pub lr: f32,
    /// `--warmup`.
    pub warmup: Option<u64>,
    /// `--weight-decay`.
    pub weight_decay: f32,
    /// `--grad-clip`.
    pub grad_clip: f32,
    /// `--seed`.
    pub seed: u64,
    /// `--eval-every`.
    pub eval_every: u64,
    /// `--eval-batches`.
    pub eval_batches: u64,
    /// `--save-every`.
    pub save_every: u64,
    /// `--keep-last`.
    pub keep_last: Option<u64>,
    /// `--no-pack`: chat data one example per row.
    pub no_pack: bool,
    /// `--init`: a model directory or GGUF file to start from.
    pub init: Option<PathBuf>,
    /// `--init-adapter`: a PEFT adapter to start the adapters from.
    pub init_adapter: Option<PathBuf>,
    /// `--resume`: the run directory to continue.
    pub resume: Option<PathBuf>,
    /// Steps to profile (`--profile --profile-steps N`; 0: not profiling).
    pub profile_steps: u64,
    /// The flags among `--lr`, `--warmup`, `--weight-decay`, `--grad-clip`, `--seed`,
    /// `--eval-every`, `--eval-batches`, `--save-every` and `--device` given on the command
    /// line (the fields above hold their defaults otherwise): a resumed run applies or refuses
    /// each.
    pub given: Vec<&'static str>,
}
