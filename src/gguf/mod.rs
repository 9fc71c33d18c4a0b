//! GGUF import and export: llama.cpp model files turned into Hugging Face model directories,
//! and model directories written as GGUF files.
//!
//! `memwall convert FILE.gguf --out DIR` ([`convert::convert`]) reads a GGUF file
//! ([`file::GgufFile`], memory-mapped), dequantizes every tensor to f32 ([`crate::dtype::dequant`]), maps
//! llama / qwen2 / gpt2 metadata and tensor names to a transformers `config.json` and HF names
//! and shapes ([`hf`], undoing llama.cpp's Q/K row permutation and GPT-2's transposed Conv1D
//! weights, reading Llama 3's [`rope_freqs`]), rebuilds the tokenizer from the
//! `tokenizer.ggml.*` metadata ([`tokenizer`]), and writes `config.json`,
//! `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` and the source's own
//! tokenizer keys ([`sidecar`]) into a temporary sibling directory that is renamed into place
//! once complete.
//!
//! `sample --model FILE.gguf` and `train --init FILE.gguf` convert once into the user cache
//! ([`cache::model_dir`]) and use that directory. [`quantize`] writes Q8_0, Q4_0, Q4_1, Q5_0,
//! Q4_K and Q6_K blocks as llama.cpp's reference quantizers (for a quantized base, and GGUF
//! out);
//! [`base`] reads a file's own blocks as a LoRA base (`--base-quant keep`).
//!
//! `memwall export DIR --gguf OUT.gguf --type T` ([`crate::export::export`]) goes the other way: a
//! llama/qwen2/gpt2 model directory written by [`write::write_gguf`] under llama.cpp's names,
//! with llama.cpp's Q/K order, hyper-parameter keys and tokenizer metadata.
//!
//! The output is a plain directory that `LlamaForCausalLM.from_pretrained` /
//! `Qwen2ForCausalLM.from_pretrained` load; the conversion knows nothing of memwall's own
//! model code (only [`base`] reads the parameter inventory, to lay a file's blocks out as the
//! plan's base). GGUF's block types and their decoding are [`crate::dtype::ggml`] and
//! [`crate::dtype::dequant`].
//!
//! **Invariants:** everything that can be checked is checked before a byte is written; memory
//! holds one tensor at a time, never the model; every tensor is checked finite as it is
//! dequantized, naming the tensor and the file; `convert --force` and `memwall cache --clear`
//! replace or remove only what memwall wrote (`util::owned_dir`'s marker).

pub mod base;
pub mod cache;
pub mod convert;

pub mod file;
pub mod hf;
pub mod quantize;
pub mod rope_freqs;
pub mod sidecar;
#[cfg(test)]
pub(crate) mod testutil;
pub mod tokenizer;

pub mod write;

pub use convert::{ConvertOptions, ConvertSummary, OutDtype, convert};
pub use file::{GgufFile, TensorInfo, Value};
