//! The step executor and the programs built on it: training, evaluation, sampling.
//!
//! [`executor::Executor`] allocates a plan's arena once and walks its schedule, calling
//! backend kernels on views of the arena. [`train`] is the training loop (data, schedule of
//! learning rates, metrics, checkpoints, resume); [`generate`] samples text.

pub mod bench;
pub mod executor;
pub mod generate;
pub mod lr;
mod ops;
pub mod train;

pub use executor::{Executor, OptimHparams, StepStats};
