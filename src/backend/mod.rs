//! Backends compute; they do not decide. A backend never chooses placement or lifetime and
//! never allocates during a step: the plan says which buffers exist, where and when, and the
//! backend allocates each packed tier once ([`Backend::start`]) and runs the schedule's ops
//! on views of it. `cpu` runs everything; `cuda` plans anywhere and, with its feature, is
//! being built to run the same plans on a GPU.
//!
//! The seam has two sides:
//! - [`Sizing`], what the planner asks: the workspace the backend's
//!   kernels need and the scratch its libraries keep for themselves. The plan does not know
//!   which backend runs it beyond these answers; the trait is the planner's (a backend
//!   implements it), so the planner never imports a backend.
//! - [`Device`], a started backend: runs one [`Op`](crate::ir::Op) at a time, and moves
//!   bytes between the host and plan buffers ([`Device::download`], [`Device::upload`]), which
//!   is the only way anything outside the backend reads or writes a plan buffer. Transfers
//!   between tiers and collectives among ranks follow one rule: their op starts them, they
//!   run beside the ops that follow (the CPU device: on its I/O thread and its communication
//!   thread; a GPU's would be copy and NCCL streams), and an await op (`AwaitTransfers`,
//!   `AwaitCollective`) or [`Device::sync`] waits for them. The device times both for the
//!   profiler ([`Device::io_time`], [`Device::take_io_spans`], [`Device::comm_time`],
//!   [`Device::take_comm_spans`]).
//!
//! A device runs the compute ops by family ([`OpFamily`]): [`Kernels`] lists one method per
//! family, each running that family's ops, and dispatches to them
//! ([`Kernels::run_by_family`]), so a second backend implements families, not one match
//! over every op.

mod choice;
pub mod cpu;
pub mod cuda;
pub mod host;

pub use choice::{DeviceId, DeviceKind, under_test};

/// A device that cannot be used here: a backend this build lacks, a GPU or driver this
/// machine lacks. The CLI exits with status 2 for it (a usage error, not a failed run).
#[derive(Debug)]
pub struct Unavailable(pub String);

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unavailable {}

use crate::dist::Comms;
use crate::dtype::{DType, Elem};
use crate::ir::schedule::OpEntry;
use crate::ir::{BufId, OpFamily, Program, Sizing};
use anyhow::Result;

/// A backend that can run plans.
pub trait Backend: Sizing + Sync {
    /// Allocates the program's packed tiers (touching every page, so an impossible
    /// allocation fails here, before any step) and starts the backend's workers
    /// (`program.threads`). The program's collectives run among the ranks of `comms`'s axis
    /// each names (this process being the plan's rank; one process: every axis
    /// [`crate::dist::Single`]).
    fn start(&self, program: &Program, comms: Comms) -> Result<Box<dyn Device>>;
    /// The backend's f32 arithmetic ceiling, measured now on the calling thread pool (a
    /// throughput figure is a fraction of it); `None` where it cannot be measured.
    fn measure_peak(&self) -> Option<Peak>;
    /// A GPU's copies between pinned host RAM and its memory, measured: (host to device,
    /// device to host) bytes per second; `None` for a backend with no such bus (the CPU).
    fn measure_bus(&self) -> Result<Option<(f64, f64)>> {
        Ok(None)
    }
    /// The backend's facts a benchmark records beside its figures (for the CPU: the mixed
    /// precision path and whether the CPU has AVX512_BF16), as JSON fields.
    fn bench_facts(&self, storage: DType) -> serde_json::Map<String, serde_json::Value>;
    /// The processor the ops run on, by name (the CPU's model, the GPU's): what a calibration
    /// of this backend is kept for.
    fn processor(&self) -> String;
}

/// A measured arithmetic ceiling: the f32 one the GEMMs run against, and every loop the
/// device has.
#[derive(Clone, Debug, PartialEq)]
pub struct Peak {
    /// f32 multiply-adds per second of the whole pool, ×2 (GFLOP/s), on the widest f32
    /// instructions the device's GEMMs use: the ceiling of every fp32 figure.
    pub gflops_per_s: f64,
    /// Threads that ran the loop (the current rayon pool's).
    pub threads: usize,
    /// The instruction set of `gflops_per_s`.
    pub isa: &'static str,
    /// The clock `gflops_per_s` implies per thread, in GHz, for a core of two FMA pipes.
    pub implied_ghz: f64,
    /// Every loop measured (narrower f32 vectors, bf16 dot products), widest f32 first.
    pub by_isa: Vec<IsaPeak>,
}

/// One instruction set's measured rate.
#[derive(Clone, Debug, PartialEq)]
pub struct IsaPeak {
    /// `avx2+fma`, `avx512f` (f32 FMAs) or `avx512_bf16` (`vdpbf16ps`: 2 products and 2
    /// additions a lane).
    pub isa: &'static str,
    /// Multiply-adds per second of the whole pool, ×2 (GFLOP/s).
    pub gflops_per_s: f64,
    /// The clock it implies per thread (GHz), for two pipes issuing it each cycle.
    pub implied_ghz: f64,
}

/// The per-step values an op may need besides its buffers.
#[derive(Clone, Copy, Debug)]
pub struct StepCtx {
    /// Run on the first `t` positions of every sequence instead of the plan's (generation).
    pub seq: Option<usize>,
    /// Training step (the LM head also produces gradients); false for evaluation.
    pub training: bool,
    /// The loss is multiplied by this before backward (fp16 loss scaling; 1 otherwise).
    pub loss_scale: f32,
    /// The optimizer's values for this step (set for `AdamW` ops).
    pub update: Option<AdamWStep>,
    /// The seed of this step's dropout masks (`--lora-dropout`; drawn only when
    /// `training`): a pure function of the run's seed and the step.
    pub dropout_seed: u64,
    /// This process's first micro-batch in the step's batch (rank · micro-batches per rank):
    /// masks are drawn by an element's place in the whole batch, so ranks draw what one
    /// process accumulating their micro-batches draws.
    pub first_micro: usize,
    /// The targets the step's loss is the mean over: the trained targets of every
    /// micro-batch of the step on every rank (every target of raw text: B·T·micro-batches·
    /// ranks). The LM head scales its gradient by `loss_scale / max(loss_tokens, 1)`, so a
    /// step with nothing trained divides by nothing.
    pub loss_tokens: usize,
}

/// One AdamW step's hyperparameters, as every `AdamW` op of the step applies them (a
/// kernel gets them with `weight_decay` zeroed for tensors without decay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Applied to tensors whose [`crate::ir::ParamSlice::decay`] is set.
    pub weight_decay: f32,
    /// 1-based step number (bias correction).
    pub step: u64,
    /// Gradients are multiplied by this before the update (clipping factor / loss scale).
    pub grad_scale: f32,
}

/// The compute ops of a started backend, one method per [`OpFamily`]: each runs an op `e` of
/// its family (with the buffers its parameters and gradients are bound to), activations and
/// gradients stored as `T` (the plan's storage type; weights, statistics and workspaces are
/// f32). Transfers and collectives are no kernels' work: [`Device::run`] starts and awaits
/// them itself.
pub trait Kernels {
    /// [`OpFamily::Fill`].
    fn fill<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx);
    /// [`OpFamily::Embedding`].
    fn embedding<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx);
    /// [`OpFamily::Norm`].
    fn norm<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx);
    /// [`OpFamily::Linear`].
    fn linear<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx);
    /// [`OpFamily::Attention`].
    fn attention<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx);
    /// [`OpFamily::Activation`].
    fn activation<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx);
    /// [`OpFamily::LmHead`].
    fn lm_head<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx);
    /// [`OpFamily::Adapter`].
    fn adapter<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx);
    /// [`OpFamily::Optimizer`].
    fn optimizer<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx);

    /// Runs compute op `e` by its family's method (a transfer or a collective is an internal
    /// error here).
    fn run_by_family<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        match e.op.family() {
            OpFamily::Fill => self.fill::<T>(e, ctx),
            OpFamily::Embedding => self.embedding::<T>(e, ctx),
            OpFamily::Norm => self.norm::<T>(e, ctx),
            OpFamily::Linear => self.linear::<T>(e, ctx),
            OpFamily::Attention => self.attention::<T>(e, ctx),
            OpFamily::Activation => self.activation::<T>(e, ctx),
            OpFamily::LmHead => self.lm_head::<T>(e, ctx),
            OpFamily::Adapter => self.adapter::<T>(e, ctx),
            OpFamily::Optimizer => self.optimizer::<T>(e, ctx),
            OpFamily::Transfer => unreachable!("the device runs transfers itself"),
            OpFamily::Collective => {
                unreachable!("the device starts and awaits collectives itself")
            }
        }
    }
}

/// A started backend holding a plan's memory.
pub trait Device: Send + Sync {
    /// Runs op `e` (an op of the plan this device was started with, with the buffers its
    /// parameters and gradients are bound to). A [`crate::ir::Op::Transfer`] starts a
    /// transfer between tiers, and a collective ([`crate::ir::Op::AllReduce`],
    /// `ReduceScatter`, `AllGather`: among the ranks the device was started with, on the
    /// plan buffers it names, cut as its group's, [`crate::ir::Program::cuts`]) starts it;
    /// both run beside the ops that follow until the `AwaitTransfers` or `AwaitCollective`
    /// that names their buffer waits for them (with those started before them). Fails only
    /// where the op moves bytes to or from a tier that can fail (an await of a disk
    /// transfer, naming it) or among ranks (an await of a collective, or the collective
    /// itself when it runs inline, naming the rank when a peer is lost).
    fn run(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()>;
    /// Waits for every transfer and collective that ops started and no await has waited
    /// for (a run of part of a schedule, or one stopped by an error), so nothing works on
    /// plan memory after it; the first error among them.
    fn sync(&self) -> Result<()>;
    /// Whether [`Device::run`] returns before the op's work is done (a GPU's stream queues
    /// it): the executor then waits for each op ([`Device::sync`]) when it times ops, so a
    /// recorded op's span is its work, not its launch. `false` for the CPU.
    fn queues_ops(&self) -> bool {
        false
    }
    /// The device's memory in use now, by every process (a GPU's `cuMemGetInfo`: its context
    /// and the plan's one allocation, so after a step it is the run's peak); `None` where the
    /// plan lives in host memory (the CPU: its peak is the process's resident memory).
    fn memory_in_use(&self) -> Option<u64> {
        None
    }
    /// Whether collectives run beside the ops that follow them until their await (`true`,
    /// the default) or each one whole where its op starts it (for machines with no core to
    /// spare, [`crate::dist::comm_thread_wanted`]). The same bits either way: the plan keeps
    /// a collective's buffers apart until its await. Between runs only.
    fn overlap_collectives(&mut self, _on: bool) {}
    /// Runs `f` where the backend's ops are meant to be issued from (the CPU backend's worker
    /// pool), so a sequence of [`Device::run`] calls pays no hand-off per op.
    fn scope(&self, f: &mut (dyn FnMut() + Send));
    /// Hands `f` the bytes of `bufs`, in order (a device backend downloads them first; the
    /// CPU backend lends the arena's own bytes, and reads disk-tier buffers into copies).
    fn download(&self, bufs: &[BufId], f: &mut dyn FnMut(&[&[u8]])) -> Result<()>;
    /// Hands `f` the bytes of `bufs` to fill, in order; they are in the buffers when it returns
    /// (a device backend uploads them then; disk-tier buffers are written back).
    fn upload(&mut self, bufs: &[BufId], f: &mut dyn FnMut(&mut [&mut [u8]])) -> Result<()>;
    /// `bytes` of host memory in which the plan keeps nothing between steps (the CPU backend:
    /// arena bytes no persistent buffer holds), or `None` when there is not that much: a
    /// checkpoint gathers one parameter group's shards there without growing the process.
    ///
    /// # Safety
    /// Only between steps (no op runs while the slice lives), and one slice at a time.
    #[allow(clippy::mut_from_ref)]
    unsafe fn spare_between_steps(&self, _bytes: usize) -> Option<&mut [u8]> {
        None
    }
    /// A line to show the user about the disk tier once (a fallback it had to take).
    fn offload_note(&self) -> Option<String> {
        None
    }
    /// Time spent on transfers to and from the disk tier since the device started.
    fn io_time(&self) -> IoTime {
        IoTime::default()
    }
    /// Time spent in collectives, and waiting for them, since the device started.
    fn comm_time(&self) -> CommTime {
        CommTime::default()
    }
    /// Moves the transfers between tiers that finished since the last call (the ones that
    /// [`crate::ir::Op::Transfer`] ops started, in the order they ran) into `out`, as many
    /// as its spare capacity holds: `out` never grows, so a caller that reserved it before a
    /// step allocates nothing, and one that passes an empty vector discards them. Returns how
    /// many were not kept (for lack of room here or in the device's own log).
    fn take_io_spans(&self, _out: &mut Vec<IoSpan>) -> u64 {
        0
    }
    /// Moves the collectives that finished since the last call (in the order they ran) into
    /// `out`, as [`Device::take_io_spans`] moves transfers: within its spare capacity;
    /// returns how many were not kept.
    fn take_comm_spans(&self, _out: &mut Vec<CommSpan>) -> u64 {
        0
    }
}

/// One transfer between a slower tier and the host that a device performed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IoSpan {
    /// The host buffer it filled or emptied (a staging buffer of the plan).
    pub buf: BufId,
    /// Into the host buffer (else out of it).
    pub read: bool,
    /// Bytes moved (the buffer padded to its alignment, as the plan counts them).
    pub bytes: u64,
    pub start: std::time::Instant,
    pub end: std::time::Instant,
}

/// Where a device's disk-tier time went (seconds, since it started).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IoTime {
    /// The I/O thread was reading or writing.
    pub busy_s: f64,
    /// The ops waited for transfers to finish (`AwaitTransfers`): I/O not hidden by compute.
    pub stall_s: f64,
}

/// One collective a device ran.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CommSpan {
    /// The collective's buffer (its `buf`, which names it within a schedule).
    pub buf: BufId,
    pub start: std::time::Instant,
    pub end: std::time::Instant,
}

/// Where a device's time among ranks went (seconds, since it started).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommTime {
    /// In collectives.
    pub busy_s: f64,
    /// The ops waited for collectives (`AwaitCollective`, and collectives run inline):
    /// communication not hidden by compute.
    pub wait_s: f64,
}
