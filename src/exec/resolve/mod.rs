//! The one place where what the user asked becomes what runs: a [`StepRequest`] (the step
//! flags of `plan`, `train` and `bench`, as given, `None` where left out) is resolved into
//! the final micro-batch and strategies ([`Resolved`]), and a [`TrainRequest`] into the
//! [`TrainOptions`](crate::exec::train::TrainOptions) of a new run or of a resumed one
//! (with the rules of what a resume may change). The command line only maps its arguments
//! onto these requests; the demos build their options directly.
//!
//! - `request.rs`: the requests and the defaults of what is left out.
//! - `step.rs`: the micro-batch (fixed, `--batch auto`, `--global-batch`) and strategies,
//!   or the `--fit` search's choice; the one place that decides them.
//! - `stages.rs`: `--pp-layers` checked against the model, `auto` resolved into each
//!   stage's count of layers.
//! - `base.rs`: how a LoRA plan keeps its frozen base (train's and plan's one decision).
//! - `plan.rs`: `memwall plan`'s request: its model (a GGUF file as its conversion), ranks
//!   and base, then the step as `train` resolves it.
//! - `train.rs`: a new run's options, and a resumed run's (its own configuration, with the
//!   changes a resume allows checked).

pub mod base;
mod plan;
mod request;
mod stages;
mod step;
mod train;

pub use plan::{PlanTarget, plan_target};
pub use request::{
    DEFAULT_BATCH, DEFAULT_MODEL, DEFAULT_SEQ, LoraRequest, StepRequest, StrategyRequest,
    TrainRequest,
};
pub use step::{
    Frozen, Resolved, check_host_memory_flag, check_in_backward_device, fit_space, fixed,
    resolve_step,
};
pub use train::{new_run, resume};
