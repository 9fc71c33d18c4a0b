//! The options of a training run ([`TrainOptions`]): their defaults, their validation, and
//! reading them back from a run's newest checkpoint for `--resume`.
//!
//! They are saved as JSON in every checkpoint's `trainer_state.json` (field `train`), so their
//! serialised keys are a file format: runs resume from saved options.

use crate::backend::DeviceId;
use crate::ckpt::{self, TrainerState};
use crate::data::loader::DataSet;
use crate::ir::Update;
use crate::plan::fit::Strategies;
use crate::run_dir::RunDir;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Everything that defines a training run (saved in checkpoints; `--resume` reuses it).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainOptions {
    /// Preset name, checkpoint directory or config.json.
    pub model: String,
    /// The prepared data: absolute for runs started by the CLI ([`TrainOptions::pin_data`]),
    /// as typed in runs saved before.
    pub data: PathBuf,
    /// The data relative to the run directory, so a run moved with its data resumes
    /// (`None` in runs saved before the field existed).
    #[serde(default)]
    pub data_from_run: Option<PathBuf>,
    /// What the data holds (tokenizer and token counts): `--resume --data DIR` accepts data
    /// moved elsewhere only when they match (`None` in runs saved before).
    #[serde(default)]
    pub data_fingerprint: Option<DataFingerprint>,
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
    /// Keep only the newest N checkpoints (0: keep all); older ones are removed once a newer
    /// one is written.
    #[serde(default)]
    pub keep_last: u64,
    /// Start from this Hugging Face checkpoint directory (fine-tuning).
    pub init: Option<PathBuf>,
    /// The GGUF file `--init` named (converted into `init`), whose own blocks a LoRA base
    /// kept with `--base-quant keep` is read from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_gguf: Option<PathBuf>,
    /// The content fingerprint of the base (`init_gguf`, else `init`;
    /// [`crate::util::fingerprint::of_model`]): `--resume`, and `export`, `merge` and
    /// `sample` given one of the run's adapters, refuse a base that now holds another model
    /// (`None` in runs saved before the field existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_fingerprint: Option<String>,
    /// Start the LoRA adapters from this PEFT adapter directory (`--init-adapter`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_adapter: Option<PathBuf>,
    /// Distillation's teacher (`--distill-from`, a model directory: a GGUF file's
    /// conversion) and its weight in the loss (`--distill-alpha`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distill_from: Option<PathBuf>,
    #[serde(default = "one_f32", skip_serializing_if = "is_one_f32")]
    pub distill_alpha: f32,
    /// The teacher's GGUF file, when `--distill-from` gave one: the teacher keeps its blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distill_gguf: Option<PathBuf>,
    /// Copy this directory's tokenizer files (`tokenizer.json`, ...) into every checkpoint.
    /// When `None` on a fresh run, training sets it to the `--init` directory if it holds a
    /// `tokenizer.json`, else to the `--model` directory if that holds one; `--resume` keeps
    /// the run's own (`None` for runs saved before the field existed).
    #[serde(default)]
    pub tokenizer_dir: Option<PathBuf>,
    /// Checkpoint weights above this many bytes are written as shards of at most this size
    /// (see [`crate::ckpt::SaveOptions`]); runs saved before the field existed get the default.
    #[serde(default = "default_max_shard_bytes")]
    pub max_shard_bytes: u64,
    /// `--no-pack`: an examples data set's rows hold one example each, padded, instead of
    /// several packed ([`crate::data::examples`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_pack: bool,
    /// Memory strategies and budget (flattened: the same keys as separate fields).
    #[serde(flatten)]
    pub strategies: Strategies,
    /// Profile the first N steps of this invocation (0: off): `profile.json`, `trace.json`,
    /// `memory.svg` and `report.html` in the run directory.
    #[serde(default)]
    pub profile_steps: u64,
    /// The `--fit` search that chose `batch` and `strategies` (recorded in plan.json).
    #[serde(default)]
    pub fit: Option<serde_json::Value>,
    /// `--fit`: the process's resident memory its search measured, with the data open and
    /// the search's memory handed back; the run plans with it (else it measures its own).
    #[serde(skip)]
    pub planned_baseline: Option<u64>,
    /// What resolving the request has to tell the user (a second rounding of a GGUF's
    /// blocks, a schedule stretched by a resume, a changed thread count): the library
    /// returns them, the command line prints them before the run starts.
    #[serde(skip)]
    pub notes: Vec<String>,
    /// The backend that plans and runs the steps (`--device`; left out of the record when
    /// it is the CPU, so the trainer states of CPU runs are as before the field existed).
    #[serde(default, skip_serializing_if = "DeviceId::is_default")]
    pub device: DeviceId,
}

impl TrainOptions {
    /// Defaults matching `memwall train --help`.
    pub fn new(model: &str, data: &Path, out: &Path) -> TrainOptions {
        TrainOptions {
            model: model.to_string(),
            data: data.to_path_buf(),
            data_from_run: None,
            data_fingerprint: None,
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
            keep_last: 0,
            init: None,
            init_adapter: None,
            distill_from: None,
            distill_alpha: 1.0,
            distill_gguf: None,
            init_gguf: None,
            base_fingerprint: None,
            tokenizer_dir: None,
            max_shard_bytes: ckpt::DEFAULT_MAX_SHARD_BYTES,
            no_pack: false,
            strategies: Strategies::default(),
            fit: None,
            planned_baseline: None,
            notes: Vec::new(),
            profile_steps: 0,
            device: DeviceId::CPU,
        }
    }

    /// The base model's name a LoRA checkpoint records (`base_model_name_or_path`): the
    /// `--init` directory, else `--model`.
    pub fn base_name(&self) -> String {
        match (&self.init_gguf, &self.init) {
            (Some(p), _) | (None, Some(p)) => p.display().to_string(),
            (None, None) => self.model.clone(),
        }
    }

    /// The path the base was given as: the GGUF file `--init` named, else the `--init`
    /// directory.
    pub fn base_path(&self) -> Option<&Path> {
        self.init_gguf.as_deref().or(self.init.as_deref())
    }

    /// Records the base's fingerprint (a new run, before anything is written).
    pub fn pin_base(&mut self) -> Result<()> {
        self.base_fingerprint = match self.base_path() {
            Some(p) => Some(
                crate::util::fingerprint::of_model(p)
                    .with_context(|| format!("--init {}", p.display()))?,
            ),
            None => None,
        };
        Ok(())
    }

    /// A resumed run's base, found and checked: a LoRA run's base must hold what the run
    /// trained on (its fingerprint); a GGUF base is converted again into the user cache when
    /// its conversion is gone (`memwall cache --clear`), and the run's paths to the old
    /// conversion (`init`, `model`, `tokenizer_dir`) follow the new one (the conversion says
    /// what it does to `say`). A full fine-tune resumes from `checkpoint` alone.
    pub fn locate_base(
        &mut self,
        checkpoint: &Path,
        model_given: bool,
        say: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let run = self.out.display().to_string();
        let lora = self.strategies.lora.is_some();
        if !lora {
            // A full fine-tune's checkpoint holds its weights, config and tokenizer files: its
            // base (gone, changed, or a GGUF file whose conversion was cleared) is not read
            // again, and the paths that named it take the checkpoint.
            let init = self.init.clone();
            let is_base = |p: &Path| init.as_deref() == Some(p) || !p.exists();
            // The model named by --init (not a preset, nor a --model given now).
            if !model_given && init.as_deref() == Some(Path::new(&self.model)) {
                self.model = checkpoint.to_string_lossy().into_owned();
            }
            if self.tokenizer_dir.as_deref().is_some_and(is_base)
                && checkpoint.join(ckpt::TOKENIZER_FILE).is_file()
            {
                self.tokenizer_dir = Some(checkpoint.to_path_buf());
            }
            return Ok(());
        }
        let Some(base) = self.base_path().map(Path::to_path_buf) else {
            return Ok(());
        };
        if !base.exists() {
            bail!(
                "--resume {run}: the run's base {} (its --init) is not there; its LoRA adapters \
                 train on that model: put it back at that path",
                base.display()
            );
        }
        if let Some(want) = &self.base_fingerprint {
            let found = crate::util::fingerprint::of_model(&base)
                .with_context(|| format!("--resume {run}: the run's base {}", base.display()))?;
            if found != *want {
                bail!(
                    "--resume {run}: the run's base {} (its --init) holds another model than the \
                     run trained on (content fingerprint {}, not {}): the adapters would go on \
                     training on other weights. Put the original back at that path, or start a \
                     new run on this base (`--init {} --init-adapter {run}`)",
                    base.display(),
                    crate::util::fingerprint::short(&found),
                    crate::util::fingerprint::short(want),
                    base.display()
                );
            }
        }
        if let Some(gguf) = self.init_gguf.clone() {
            let dir = crate::gguf::cache::model_dir(&gguf, "--init", say)?;
            let old = self.init.replace(dir.clone());
            if let Some(old) = old {
                if Path::new(&self.model) == old {
                    self.model = dir.to_string_lossy().into_owned();
                }
                if self.tokenizer_dir.as_deref() == Some(old.as_path()) {
                    self.tokenizer_dir = Some(dir);
                }
            }
        }
        Ok(())
    }

    /// Refuses values the loop cannot run with, naming the flag.
    pub(crate) fn check(&self) -> Result<()> {
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
        // AdamW scales each weight by 1 − lr · weight decay every step, before the update.
        if self.lr * self.weight_decay >= 1.0 {
            bail!(
                "--weight-decay {} with --lr {}: every step would scale the weights by 1 − lr · \
                 weight decay = {}, which is not positive; use a --weight-decay below {}",
                self.weight_decay,
                self.lr,
                1.0 - self.lr * self.weight_decay,
                1.0 / self.lr
            );
        }
        if self.grad_clip < 0.0 || !self.grad_clip.is_finite() {
            bail!(
                "--grad-clip must be >= 0 (0 disables clipping), got {}",
                self.grad_clip
            );
        }
        if self.strategies.update == Update::InBackward && self.grad_clip != 0.0 {
            bail!(
                "--update in-backward with --grad-clip {}: clipping by the global gradient norm \
                 needs every gradient before the first update; use --grad-clip 0 (the default \
                 with --update in-backward; a resumed run keeps its own) or --update end",
                self.grad_clip
            );
        }
        crate::exec::resolve::check_in_backward_device(
            Some(self.strategies.update),
            self.device,
            Some(self.strategies.offload),
        )?;
        if self.eval_batches == 0 {
            bail!("--eval-batches must be at least 1");
        }
        if self.max_shard_bytes == 0 {
            bail!("max_shard_bytes must be at least 1 (bytes of checkpoint weights per shard)");
        }
        if self.strategies.grad_accum == 0 {
            bail!("--grad-accum must be at least 1 (micro-batches per optimizer step)");
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            bail!(
                "AdamW's beta1 and beta2 must be in [0, 1), got {} and {}",
                self.beta1,
                self.beta2
            );
        }
        if self.strategies.zero.0 > 3 {
            bail!(
                "--zero must be 0, 1, 2 or 3, got {}",
                self.strategies.zero.0
            );
        }
        if self.strategies.ranks == 0 {
            bail!("ranks must be at least 1 (processes training together)");
        }
        Ok(())
    }
}

/// What a prepared data set holds, as far as a run's batches depend on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataFingerprint {
    pub tokenizer: String,
    pub tokenizer_hash: String,
    pub vocab_size: usize,
    pub train_tokens: u64,
    pub val_tokens: u64,
    /// An examples data set's examples per split (absent for raw text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples: Option<crate::data::loader::ExampleCounts>,
    /// An examples data set's boundaries and trained bits (`{train,val}.{idx,mask}`, SHA-256
    /// over the four files): the same tokens prepared with another `--train-on` train
    /// another objective (absent for raw text, and in runs saved before the field existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples_sha256: Option<String>,
}

impl DataFingerprint {
    /// The fingerprint of the data set in `dir` (its meta.json, checked).
    pub fn of(dir: &Path) -> Result<DataFingerprint> {
        let m = DataSet::open(dir)?.meta;
        Ok(DataFingerprint {
            tokenizer: m.tokenizer,
            tokenizer_hash: m.tokenizer_hash,
            vocab_size: m.vocab_size,
            train_tokens: m.train_tokens,
            val_tokens: m.val_tokens,
            examples_sha256: match m.examples {
                Some(_) => Some(examples_sha256(dir)?),
                None => None,
            },
            examples: m.examples,
        })
    }

    /// Whether `found` (the data as it is now) is the data this fingerprint recorded; a field
    /// the record lacks (a run saved before it existed) is not compared.
    pub fn matches(&self, found: &DataFingerprint) -> bool {
        let mut now = found.clone();
        if self.examples_sha256.is_none() {
            now.examples_sha256 = None;
        }
        *self == now
    }

    /// Whether `found` has this record's tokenizer and counts (its content may differ).
    fn same_counts(&self, found: &DataFingerprint) -> bool {
        DataFingerprint {
            examples_sha256: self.examples_sha256.clone(),
            ..found.clone()
        } == *self
    }
}

/// SHA-256 over an examples data set's `.idx` and `.mask` files (each file's hash, as
/// [`crate::util::fingerprint::file_sha256`] remembers it), train then val.
fn examples_sha256(dir: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for name in ["train.idx", "train.mask", "val.idx", "val.mask"] {
        h.update(name.as_bytes());
        h.update(crate::util::fingerprint::file_sha256(&dir.join(name))?.as_bytes());
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

impl TrainOptions {
    /// The run's distillation (`--distill-from`): its teacher's width and plan bytes at the
    /// run's sequence length, or `None` without a teacher.
    pub fn distill(&self, spec: &crate::model::ModelSpec) -> Result<Option<crate::plan::Distill>> {
        let at = (self.seq, self.threads, self.device);
        (self.distill_from.as_deref())
            .map(|dir| {
                let from = (dir, self.distill_gguf.as_deref());
                crate::exec::teacher::distill(from, spec, self.distill_alpha, at)
            })
            .transpose()
    }

    /// Makes a new run's data path absolute, records it relative to the run directory too,
    /// and records what the data holds, so that `--resume` finds it from any directory.
    pub fn pin_data(&mut self) -> Result<()> {
        let data = std::path::absolute(&self.data)
            .with_context(|| format!("--data {}: cannot resolve the path", self.data.display()))?;
        let out = std::path::absolute(&self.out)
            .with_context(|| format!("--out {}: cannot resolve the path", self.out.display()))?;
        self.data_from_run = Some(relative_path(&data, &out));
        self.data_fingerprint = Some(DataFingerprint::of(&data)?);
        self.data = data;
        Ok(())
    }

    /// Where a resumed run's data is: `given` (`--resume --data DIR`, accepted when it holds
    /// what the run trained on), else the recorded path, else the path relative to the run
    /// directory (a run moved with its data). Errors say to pass `--data`.
    pub fn locate_data(&mut self, given: Option<&Path>) -> Result<()> {
        let run = self.out.display().to_string();
        // The data in `dir` must be what the run trained on (when the run recorded it).
        let check = |dir: &Path, named: &str| -> Result<DataFingerprint> {
            let found = DataFingerprint::of(dir).with_context(|| named.to_string())?;
            if let Some(want) = &self.data_fingerprint
                && !want.matches(&found)
            {
                // Same tokenizer and counts, so the examples' bits or boundaries differ.
                if want.same_counts(&found) {
                    bail!(
                        "{named}: holds as many tokens as the run in {run} trained on, but other \
                         trained tokens or example boundaries (prepared again, with another --train-on?): \
                         the run would go on training another objective; resume with the data as \
                         it was prepared (--data DIR), or start a new run on this data"
                    );
                }
                bail!(
                    "{named}: holds other data than the run in {run} trained on ({} with {} \
                     training tokens, not {} with {}); resume with the same prepared data \
                     (--data DIR)",
                    found.tokenizer,
                    found.train_tokens,
                    want.tokenizer,
                    want.train_tokens
                );
            }
            Ok(found)
        };
        if let Some(dir) = given {
            let found = check(dir, &format!("--data {}", dir.display()))?;
            self.data = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
            let out = std::path::absolute(&self.out).unwrap_or_else(|_| self.out.clone());
            self.data_from_run = Some(relative_path(&self.data, &out));
            self.data_fingerprint = Some(found);
            return Ok(());
        }
        if self.data.is_dir() {
            check(
                &self.data,
                &format!("the run's data {}", self.data.display()),
            )?;
            return Ok(());
        }
        if let Some(rel) = &self.data_from_run {
            let moved = self.out.join(rel);
            if moved.is_dir() {
                check(&moved, &format!("the run's data {}", moved.display()))?;
                self.data = std::path::absolute(&moved).unwrap_or(moved);
                return Ok(());
            }
        }
        bail!(
            "--resume {run}: the run's data {} is not there (from {}); point the run at it \
             with --data DIR",
            self.data.display(),
            std::env::current_dir()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|_| "here".into())
        )
    }
}

/// `path` relative to `base` (both absolute), lexically: `../data` for `/w/data` from `/w/run`.
fn relative_path(path: &Path, base: &Path) -> PathBuf {
    let (p, b): (Vec<_>, Vec<_>) = (path.components().collect(), base.components().collect());
    let common = p.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut rel = PathBuf::new();
    for _ in common..b.len() {
        rel.push("..");
    }
    for c in &p[common..] {
        rel.push(c);
    }
    if rel.as_os_str().is_empty() {
        rel.push(".");
    }
    rel
}

/// `distill_alpha` where a run's options do not say (runs without a teacher).
fn one_f32() -> f32 {
    1.0
}

fn is_one_f32(x: &f32) -> bool {
    *x == 1.0
}

/// The shard limit of runs saved before `max_shard_bytes` existed: the default.
fn default_max_shard_bytes() -> u64 {
    ckpt::DEFAULT_MAX_SHARD_BYTES
}

/// Worker threads by default: the machine's cores.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Reads the options of the run in `run_dir` from its newest checkpoint, with `--steps`
/// optionally extended. Errors when the run has no checkpoint.
pub fn resume_options(run_dir: &Path) -> Result<(TrainOptions, PathBuf)> {
    let Some(latest) = ckpt::latest_checkpoint(run_dir)? else {
        // A checkpoint given for its run: --resume takes the run directory.
        let run_hint = match run_dir.parent() {
            Some(parent)
                if parent
                    .file_name()
                    .is_some_and(|n| n == crate::run_dir::CHECKPOINTS_DIR)
                    && run_dir.join(ckpt::STATE_FILE).is_file() =>
            {
                let run = parent.parent().unwrap_or(Path::new("."));
                format!(
                    "; {} is a checkpoint of the run in {}: give --resume {} (it continues from \
                     the newest checkpoint)",
                    run_dir.display(),
                    run.display(),
                    run.display()
                )
            }
            _ => String::new(),
        };
        bail!(
            "--resume {}: no checkpoint found under {}; nothing to resume{run_hint}",
            run_dir.display(),
            RunDir::new(run_dir).checkpoints().display()
        );
    };
    // A newer step-N directory that cannot be loaded would be written over when the resumed
    // run reaches its step (with other weights, if the schedule changed): refuse, naming it.
    let dirs = ckpt::checkpoint_dirs(run_dir)?;
    let resumed_step = dirs.iter().rev().find(|d| d.is_complete()).map(|d| d.step);
    if let Some(d) = dirs.iter().rev().find(|d| Some(d.step) > resumed_step) {
        bail!(
            "--resume {}: the newest checkpoint directory {} is incomplete (missing or empty: \
             {}); resuming from {} would write over it at step {}. If it is damaged beyond \
             repair, move it out of {} (or delete it) and resume again",
            run_dir.display(),
            d.path.display(),
            d.missing.join(", "),
            latest.display(),
            d.step,
            RunDir::new(run_dir).checkpoints().display()
        );
    }
    let state_path = latest.join(ckpt::STATE_FILE);
    let text = std::fs::read_to_string(&state_path)
        .with_context(|| format!("cannot read {}", state_path.display()))?;
    let state: TrainerState = serde_json::from_str(&text)
        .with_context(|| format!("{}: corrupt trainer state", state_path.display()))
        .with_context(|| ckpt::unloadable_checkpoint_hint(run_dir, &latest))?;
    let mut opts: TrainOptions =
        serde_json::from_value(state.train.clone()).with_context(|| {
            format!(
                "{}: field 'train' is not a memwall training configuration",
                latest.display()
            )
        })?;
    opts.out = run_dir.to_path_buf();
    opts.check().with_context(|| {
        format!(
            "{}: field 'train' holds options no run can have (edited by hand?)",
            state_path.display()
        )
    })?;
    Ok((opts, latest))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys are a file format: every checkpoint's `trainer_state.json` holds them, and
    /// `--resume` reads them back.
    #[test]
    fn serialised_keys_are_stable() {
        let o = TrainOptions::new("gpt2-tiny", Path::new("data"), Path::new("run"));
        let v = serde_json::to_value(&o).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "batch",
                "beta1",
                "beta2",
                "data",
                "data_fingerprint",
                "data_from_run",
                "eval_batches",
                "eval_every",
                "fit",
                "grad_accum",
                "grad_clip",
                "init",
                "keep_last",
                "lr",
                "max_memory",
                "max_shard_bytes",
                "min_lr_frac",
                "model",
                "offload",
                "offload_dir",
                "optim_state",
                "out",
                "pipeline",
                "precision",
                "profile_steps",
                "ranks",
                "recompute",
                "save_every",
                "seed",
                "seq",
                "steps",
                "tensor",
                "threads",
                "tokenizer_dir",
                "warmup",
                "weight_decay",
                "zero",
            ]
        );
        let back: TrainOptions = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(serde_json::to_value(&back).unwrap(), v);
    }

    #[test]
    fn relative_paths_climb_to_the_common_folder() {
        let r = |a: &str, b: &str| relative_path(Path::new(a), Path::new(b));
        assert_eq!(r("/w/data", "/w/run"), Path::new("../data"));
        assert_eq!(r("/w/run/data", "/w/run"), Path::new("data"));
        assert_eq!(r("/a/b/data", "/w/x/run"), Path::new("../../../a/b/data"));
        assert_eq!(r("/w", "/w"), Path::new("."));
    }

    /// Options saved before `tokenizer_dir` and `max_shard_bytes` existed still read back,
    /// with no tokenizer directory and the default shard limit.
    #[test]
    fn options_saved_before_sharding_read_back() {
        let mut o = TrainOptions::new("gpt2-tiny", Path::new("data"), Path::new("run"));
        o.max_shard_bytes = 1234;
        o.tokenizer_dir = Some(PathBuf::from("tok"));
        let mut v = serde_json::to_value(&o).unwrap();
        let obj = v.as_object_mut().unwrap();
        obj.remove("tokenizer_dir").unwrap();
        obj.remove("max_shard_bytes").unwrap();
        let back: TrainOptions = serde_json::from_value(v).unwrap();
        assert_eq!(back.tokenizer_dir, None);
        assert_eq!(back.max_shard_bytes, ckpt::DEFAULT_MAX_SHARD_BYTES);
    }

    /// The CPU, the default device, is left out of the record (as before `--device` took a
    /// number); a record naming it, as a kind or with its number, reads back as it.
    #[test]
    fn the_cpu_device_is_left_out_and_its_names_read_back() {
        let o = TrainOptions::new("gpt2-tiny", Path::new("data"), Path::new("run"));
        let v = serde_json::to_value(&o).unwrap();
        assert!(v.get("device").is_none(), "{v}");
        for name in ["cpu", "cpu:0"] {
            let mut named = v.clone();
            named["device"] = name.into();
            let back: TrainOptions = serde_json::from_value(named).unwrap();
            assert_eq!(back.device, DeviceId::CPU, "{name}");
        }
        let mut other = v.clone();
        other["device"] = "cpu:3".into();
        let e = serde_json::from_value::<TrainOptions>(other).unwrap_err();
        assert!(e.to_string().contains("--device cpu:3"), "{e}");
    }
}
