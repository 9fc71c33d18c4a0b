//! memwall: train neural networks that do not fit in memory.
//!
//! The pipeline (see ARCHITECTURE.md):
//! what the user asked (`exec::resolve`) → `model` (what to train) + `plan::StepConfig` (how)
//! → `plan` (every byte of a step, before step 1) → `exec` (walks the plan's schedule with a
//! `backend`'s kernels) → reports. `ir` is the vocabulary a step is written in (buffers, ops,
//! the builder, strategies), imported by the planner, the families and the backends alike;
//! `dtype` is the element types every layer shares (ggml's block types among them).
//! `data` feeds tokens, `ckpt` saves and restores Hugging Face–compatible checkpoints,
//! `run_dir` names the files of a run directory and owns their formats; `gguf` imports
//! llama.cpp GGUF files as Hugging Face model directories and `export` writes them; `demo`
//! holds `memwall demo`'s tours. The modules import each other one way
//! (`scripts/import-cycles.py --order` lists them, lowest first).

pub mod backend;
pub mod ckpt;
pub mod data;
pub mod demo;
pub mod dist;
pub mod dtype;
pub mod exec;
pub mod export;
pub mod gguf;
pub mod ir;
pub mod mem;
pub mod model;
pub mod plan;
pub mod profile;
pub mod prune;
pub mod run_dir;
pub mod util;
