//! Checkpoints: Hugging Face–compatible safetensors weights, optimizer moments and trainer
//! state, written atomically, loaded without doubling memory.
//!
//! A checkpoint directory (`RUN_DIR/checkpoints/step-000100/`, named by [`crate::run_dir`])
//! holds:
//!
//! | file                     | content                                                       |
//! |--------------------------|---------------------------------------------------------------|
//! | `config.json`            | `ModelSpec::to_hf_config()`: `GPT2LMHeadModel.from_pretrained(dir)` loads the directory |
//! | `model.safetensors`      | every parameter under its HF name, F32, HF shape (Conv1D weights `[in, out]`); no `lm_head.weight` (tied to `wte`) |
//! | `optimizer.safetensors`  | AdamW moments: `exp_avg.<name>` and `exp_avg_sq.<name>` (F32), or flat bf16/int8 state as stored (see `moments.rs`) |
//! | `trainer_state.json`     | [`TrainerState`]: step, data position, seed, RNG state, model and training config |
//!
//! **Architecture Invariant: nothing is lost.** A checkpoint is written into a temporary
//! sibling (`step-000100.tmp-<pid>-<n>`), every file fsynced, the directory fsynced, renamed
//! into place, the parent fsynced. A crash or a full disk leaves earlier checkpoints intact
//! and at worst a `*.tmp-*` directory that [`latest_checkpoint`] ignores.
//!
//! **Architecture Invariant: no whole-file copies.** Saving streams each tensor from its
//! slice of the flat buffer; loading memory-maps the file and copies tensor by tensor into
//! the destination, releasing the mapped pages as it goes (see `safetensors_io.rs`).
//!
//! Loading accepts the hub's naming variants (see `names.rs`) and F32/F16/BF16 data; every
//! error names the file and the tensor or field.

mod atomic;
mod load;
mod moments;
mod names;
mod safetensors_io;
mod save;
mod state;
#[cfg(test)]
mod tests;

pub use load::{latest_checkpoint, load_params, load_spec, load_trainer_state};
pub use moments::{Moments, MomentsMut};
pub use save::{save_checkpoint, save_model};
pub use state::{LossScaleState, TrainerState};

/// Model config file name (Hugging Face).
pub const CONFIG_FILE: &str = "config.json";
/// Model weights file name (Hugging Face).
pub const MODEL_FILE: &str = "model.safetensors";
/// Optimizer moments file name.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Trainer state file name.
pub const STATE_FILE: &str = "trainer_state.json";
/// The files a checkpoint is complete with.
pub const CHECKPOINT_FILES: [&str; 4] = [CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE];

/// One-line description of a layout for messages, e.g. `gpt2: 14 parameter groups, 148
/// tensors, 124439808 parameters (transformer.wte.weight [50257, 768], ...)`.
pub(crate) fn layout_summary(layout: &crate::model::ParamLayout) -> String {
    let first: Vec<String> = layout
        .tensors
        .iter()
        .take(2)
        .map(|t| format!("{} {:?}", t.name, t.shape))
        .collect();
    format!(
        "{}: {} parameter groups, {} tensors, {} parameters ({}, ...)",
        layout.family.model_type(),
        layout.groups.len(),
        layout.tensors.len(),
        layout.total,
        first.join(", ")
    )
}
