//! Checkpoints: Hugging Face–compatible safetensors weights (one file or shards), optimizer
//! moments, trainer state and the model's tokenizer files, written atomically, loaded without
//! doubling memory.
//!
//! A checkpoint directory (`RUN_DIR/checkpoints/step-000100/`, named by [`crate::run_dir`])
//! holds:
//!
//! | file                     | content                                                       |
//! |--------------------------|---------------------------------------------------------------|
//! | `config.json`            | `ModelSpec::to_hf_config()`: `AutoModelForCausalLM.from_pretrained(dir)` loads the directory |
//! | `model.safetensors`      | every parameter under its HF name, F32, HF shape (GPT-2 Conv1D weights `[in, out]`, Linear weights `[out, in]`); a tied LM head is not stored (it is the embedding). Written while the tensors total at most `max_shard_bytes` (5 GB by default, as transformers) |
//! | `model-00001-of-0000n.safetensors` ... | instead of `model.safetensors` above `max_shard_bytes`: the same tensors in layout order, cut into shards of at most that size (a larger tensor alone in its shard), as transformers' `save_pretrained` |
//! | `model.safetensors.index.json` | with the shards: `{"metadata": {"total_size": tensor bytes}, "weight_map": {"name": "shard file"}}` |
//! | `optimizer.safetensors`  | AdamW moments: `exp_avg.<name>` and `exp_avg_sq.<name>` (F32), or flat bf16/int8 state as stored (see `ir::moments`) |
//! | `trainer_state.json`     | [`TrainerState`]: step, data position, seed, RNG state, model and training config |
//! | `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json`, `chat_template.jinja`, `tokenizer.gguf` (a converted GGUF's own tokenizer keys, `gguf::sidecar`) | those of them the run's tokenizer directory holds (`--init` or `--model` directory), copied byte for byte (see `tokenizer.rs`); absent for preset models. A run on chat data puts the template its data was prepared with in `chat_template.jinja` instead ([`copy_chat_template`]), which `sample --adapter`, `merge` and `export --adapter` then use |
//!
//! A LoRA run's checkpoint (`--lora`) holds the adapter in PEFT's two files in place of
//! `config.json` and the weights: `adapter_config.json` and `adapter_model.safetensors`
//! ([`adapter`]); `optimizer.safetensors` then holds the adapters' moments under their PEFT
//! names, and the frozen base is the run's `--init` (its path is the config's
//! `base_model_name_or_path`). `peft.PeftModel.from_pretrained(base, dir)` and `memwall sample
//! --adapter dir` read the directory as it is.
//!
//! Loading weights ([`load_params`], `--init`, `generate`) reads `model.safetensors` when the
//! directory has it, else the index and its shards: **a directory with both loads
//! `model.safetensors`** and ignores the index. Sharded weights are checked against their
//! index (every shard present, every mapped tensor in its shard, no unmapped parameter in a
//! shard) before anything is copied (see `shards.rs`).
//!
//! **Architecture Invariant: nothing is lost.** A checkpoint is written into a temporary
//! sibling (`step-000100.tmp-<pid>-<n>`), every file fsynced, the directory fsynced, renamed
//! into place, the parent fsynced. A crash or a full disk leaves earlier checkpoints intact
//! and at worst a `*.tmp-*` directory that [`latest_checkpoint`] ignores.
//!
//! **Architecture Invariant: no whole-file copies.** Saving streams each tensor from its
//! flat array: a slice in place, or state the executor lends one parameter group's buffer
//! at a time when it is offloaded (`Executor::save_checkpoint`); loading memory-maps the file (every shard) and copies tensor by
//! tensor into the destination, releasing the mapped pages as it goes (see
//! `safetensors_io.rs`). Tokenizer files are streamed too.
//!
//! **Checkpoints never depend on the number of ranks.** Ranks that split the state (ZeRO's
//! shards, tensor parallelism's parts of each layer) save the whole model as one process
//! does (rank 0 gathers it: `Executor::save_checkpoint`), and each rank loads its share from
//! the whole files (a tensor-parallel part from its runs of each tensor, see `load.rs`).
//!
//! Loading accepts the hub's naming variants (see `names.rs`) and F32/F16/BF16 data; every
//! error names the file and the tensor or field.

pub mod adapter;
mod files;
mod load;

mod names;
pub mod retention;
mod safetensors_io;
mod save;
mod shards;
mod state;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_sharded;
mod tokenizer;

pub use files::{
    ADAPTER_CHECKPOINT_FILES, ADAPTER_CONFIG_FILE, CHAT_TEMPLATE_FILE, CHECKPOINT_FILES,
    CONFIG_FILE, MODEL_FILE, MODEL_INDEX_FILE, OPTIMIZER_FILE, STATE_FILE, TOKENIZER_GGUF_FILE,
};
pub use load::{
    CheckpointDir, CopyMoments, CopyParams, checkpoint_dirs, latest_checkpoint, load_params,
    load_params_by, load_spec, load_trainer_state, load_trainer_state_by,
    unloadable_checkpoint_hint,
};

pub(crate) use safetensors_io::{Lend, OutData};
pub use save::{
    AdapterCheckpoint, SaveOptions, save_checkpoint, save_checkpoint_with, save_model,
    save_model_as, save_model_with,
};
pub(crate) use save::{LentMoments, LentState, save_checkpoint_lent, save_model_lent};
pub use shards::DEFAULT_MAX_SHARD_BYTES;
pub use state::{LossScaleState, TrainerState};
pub use tokenizer::{TOKENIZER_FILE, TOKENIZER_FILES, copy_chat_template, copy_tokenizer_files};
