//! The names of a checkpoint directory's files (Hugging Face's where they have one); the
//! module doc of [`crate::ckpt`] says what each holds.

/// Model config file name (Hugging Face).
pub const CONFIG_FILE: &str = "config.json";
/// Model weights file name (Hugging Face), when the weights are one file.
pub const MODEL_FILE: &str = "model.safetensors";
/// Index of sharded weights (Hugging Face): which shard holds each tensor.
pub const MODEL_INDEX_FILE: &str = "model.safetensors.index.json";
/// Optimizer moments file name.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Trainer state file name.
pub const STATE_FILE: &str = "trainer_state.json";
/// The files every complete checkpoint has besides its weights. The weights are
/// [`MODEL_FILE`], or [`MODEL_INDEX_FILE`] and the shards it names ([`latest_checkpoint`](super::latest_checkpoint)
/// checks both).
pub const CHECKPOINT_FILES: [&str; 3] = [CONFIG_FILE, OPTIMIZER_FILE, STATE_FILE];
/// A chat template on its own beside a tokenizer (preferred to `tokenizer_config.json`'s, as
/// transformers prefers it): a model's, or the one chat data was prepared with (`prepare`
/// writes it beside the data, and training copies it into every checkpoint).
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// The GGUF tokenizer sidecar a conversion writes beside `tokenizer.json`
/// ([`crate::gguf::sidecar`]): the source file's vocabulary and tokenizer keys, for export.
pub const TOKENIZER_GGUF_FILE: &str = "tokenizer.gguf";
/// PEFT's adapter configuration file (a LoRA run's checkpoint, or an adapter directory).
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// PEFT's adapter weights file.
pub const ADAPTER_MODEL_FILE: &str = "adapter_model.safetensors";
/// The files every complete checkpoint of a LoRA run has: the adapter in PEFT's two files
/// in place of the model's config and weights.
pub const ADAPTER_CHECKPOINT_FILES: [&str; 4] = [
    ADAPTER_CONFIG_FILE,
    ADAPTER_MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
];
