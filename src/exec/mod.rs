//! The step executor and the programs built on it: training, evaluation, sampling.
//!
//! [`executor::Executor`] starts a plan on a backend (which allocates its memory once) and
//! walks its schedule, one op at a time. [`train`] is the training loop (data, schedule of
//! learning rates, metrics, checkpoints, resume); [`generate`] samples text.

pub mod bench;
pub mod calibrate;
mod calibrate_fit;
mod calibrate_host;
pub mod calibrate_transport;
pub mod executor;
pub mod generate;
#[cfg(test)]
mod kept_base_tests;
pub mod loss_scale;
pub mod lr;
pub mod resolve;
pub mod teacher;
pub mod train;

pub use executor::{Executor, OptimHparams, StepStats, dropout_seed};
pub use loss_scale::LossScaler;
