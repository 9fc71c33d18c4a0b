//! The memory plan: every byte of a training (or inference) step, decided before step 1.
//!
//! [`build_plan`] turns a model and a step configuration into a [`Plan`]: a [`Schedule`] (the
//! ordered ops of one step) and the buffers those ops touch, each with a category, dtype, size
//! and live interval derived from the schedule itself (first op that touches it to last).
//! [`packing`] then assigns every buffer an offset in one arena so that buffers whose intervals
//! overlap never share bytes. The executor allocates that arena once and hands out views; so the
//! plan's arena size *is* the step's memory, and `memwall plan` answers "will it fit?" up front.

mod block_scales;
pub mod build;
mod config;
pub mod fit;
pub mod lora;
pub mod offload;
pub mod operands;
pub mod packing;
mod pipeline;
pub mod ranks;
pub mod report;
pub mod search;
mod search_mesh;
mod stage;
pub mod stage_cut;
pub mod stage_layers;
pub mod tiers;
pub mod time;
mod update;
pub mod zero;

pub use build::build_plan;
pub use config::{Distill, Mode, StepConfig};
pub use lora::LoraPlan;
pub use offload::{Offload, OffloadChoice, OffloadSet};
pub use tiers::{Budgets, TierUse};

use crate::ir::{BufId, Buffer, Category, Op, OpEntry, Phase, Program, Schedule, Tier, TierSize};
use crate::model::{ModelSpec, ParamLayout};

/// The fixed part of [`Plan::runtime_reserve`]: 4 MiB.
pub const RESERVE_FIXED: u64 = 4 << 20;
/// The reserve's part that grows with the plan: 1/128 of its bytes (0.8%).
pub const RESERVE_PLAN_DIV: u64 = 128;

/// A complete plan for one step: schedule, buffers with offsets, and totals.
#[derive(Clone, Debug)]
pub struct Plan {
    pub spec: ModelSpec,
    /// The trainable parameters: the model's, or a LoRA plan's adapters ([`Plan::lora`]).
    pub layout: ParamLayout,
    /// A LoRA plan's frozen base and adapters (`--lora`); `None` trains the whole model.
    pub lora: Option<LoraPlan>,
    pub cfg: StepConfig,
    pub mode: Mode,
    pub schedule: Schedule,
    pub buffers: Vec<Buffer>,
    /// Largest sum of simultaneously live buffer bytes over the schedule (packing lower bound).
    pub peak_live_bytes: u64,
    /// Index of the op at which `peak_live_bytes` is reached.
    pub peak_op: usize,
    /// Bytes of the owned buffers ([`Tier::Owned`]: allocated once, outside the arena, by
    /// their owners).
    pub external_bytes: u64,
    /// The size of each tier the backend declared, after lifetime packing, in its order
    /// (fastest first: the first is the compute tier, [`Plan::arena_bytes`]).
    pub tiers: Vec<TierSize>,
    /// With ranks: how each parameter group's buffers are split among them (indexed by
    /// group, as the collective ops name them; empty for one process).
    pub cuts: Vec<crate::ir::Cut>,
}

impl Plan {
    pub fn buffer(&self, id: BufId) -> &Buffer {
        &self.buffers[id.0]
    }

    /// The tier ops compute on: the first the backend declared (the CPU's: RAM).
    pub fn compute_tier(&self) -> Tier {
        self.tiers[0].tier
    }

    /// Bytes by tier as `plan.json` and `bench` give them (`by_tier`): on the CPU, `host`
    /// (the arena and the owned buffers) and `nvme` (the offload file); on a GPU, `device`
    /// (its arena), `host` (the pinned arena and the owned buffers) and `nvme`.
    pub fn by_tier(&self) -> serde_json::Map<String, serde_json::Value> {
        let host = self.tier_bytes(Tier::Host) + self.external_bytes;
        let mut m = serde_json::Map::new();
        if self.compute_tier() != Tier::Host {
            m.insert("device".into(), self.arena_bytes().into());
        }
        m.insert("host".into(), host.into());
        m.insert("nvme".into(), self.nvme_bytes().into());
        m
    }

    /// Bytes packed in tier `t` (0 for a tier the plan does not use).
    pub fn tier_bytes(&self, t: Tier) -> u64 {
        crate::ir::program::tier_bytes(&self.tiers, t)
    }

    /// Size of the compute tier's arena (bytes), after lifetime packing.
    pub fn arena_bytes(&self) -> u64 {
        self.tiers[0].bytes
    }

    /// Size of the disk tier's file (`--offload`; 0 when nothing is offloaded).
    pub fn nvme_bytes(&self) -> u64 {
        self.tier_bytes(Tier::Nvme)
    }

    /// The plan as a backend runs it ([`Program`]).
    pub fn program(&self) -> Program<'_> {
        Program {
            buffers: &self.buffers,
            schedule: &self.schedule,
            tiers: &self.tiers,
            cuts: &self.cuts,
            storage: self.cfg.precision.storage(),
            threads: self.cfg.threads,
            disk_dir: self.cfg.offload.dir.as_deref(),
            rank: (self.cfg.mesh.world() > 1).then_some(self.cfg.mesh.rank),
        }
    }

    /// Total predicted bytes of the step: the arena plus the external buffers.
    pub fn total_bytes(&self) -> u64 {
        self.arena_bytes() + self.external_bytes
    }

    /// Predicted peak of the tier ops compute on ([`Plan::tier_peak`]); on the CPU, the
    /// resident memory of a process running the plan: its bytes, the measured process
    /// `baseline` (code, tokenizer tables, thread stacks, allocator, what is resident when
    /// the plan is made) and the [`Plan::runtime_reserve`]. What `--max-memory` bounds.
    pub fn predicted_peak(&self, baseline: u64) -> u64 {
        self.tier_peak(self.compute_tier(), baseline)
    }

    /// What a process touches after its baseline is measured that no plan buffer holds:
    /// code and library pages the first steps run, evaluation, checkpoint and report writers,
    /// allocator bookkeeping, the loader's and I/O thread's stacks. [`RESERVE_FIXED`] plus
    /// 1/[`RESERVE_PLAN_DIV`] of the plan's bytes (measured: 1–3 MiB beyond the plan and the
    /// baseline on gpt2-tiny and llama-tiny runs, 6.7 MiB on gpt2's 1.37 GB plan). Every
    /// `--max-memory` check and search counts it, so a plan that fits keeps this margin.
    pub fn runtime_reserve(&self) -> u64 {
        RESERVE_FIXED + self.total_bytes() / RESERVE_PLAN_DIV
    }

    /// Sum of buffer bytes per category (before packing), in `Category::ALL` order.
    pub fn bytes_by_category(&self) -> Vec<(Category, u64)> {
        Category::ALL
            .iter()
            .map(|&c| {
                (
                    c,
                    self.buffers
                        .iter()
                        .filter(|b| b.category == c)
                        .map(|b| b.bytes)
                        .sum(),
                )
            })
            .collect()
    }

    /// Per category, the most bytes in the compute tier (the CPU's RAM, a GPU's memory) live
    /// at any one op (each category's own high-water mark; what a strategy such as
    /// recomputation shrinks). Buffers on the tiers beneath are left out: see
    /// [`Plan::tier_bytes`].
    pub fn peak_by_category(&self) -> Vec<(Category, u64)> {
        let n_ops = self.schedule.ops.len();
        let compute = self.compute_tier();
        Category::ALL
            .iter()
            .map(|&c| {
                let of_c = self
                    .buffers
                    .iter()
                    .filter(|b| b.category == c && b.placement.tier.held_in(compute));
                let live = packing::live_bytes_per_op(
                    of_c.map(|b| (b.first_op, b.last_op, b.bytes)),
                    n_ops,
                );
                (c, live.into_iter().max().unwrap_or(0))
            })
            .collect()
    }

    /// Arithmetic of the whole step (FLOPs, multiply-add = 2).
    pub fn flops(&self) -> u64 {
        self.schedule.ops.iter().map(|o| o.flops).sum()
    }

    /// Arithmetic spent recomputing activations (the `Recompute` phase).
    pub fn recompute_flops(&self) -> u64 {
        self.schedule
            .ops
            .iter()
            .filter(|o| o.phase == Phase::Recompute)
            .map(|o| o.flops)
            .sum()
    }

    /// Bytes of transfers per step: (read from the tier beneath the compute tier, written
    /// to it: the CPU's disk, a GPU's pinned RAM). With a deferred update, a step's
    /// transfers are those of its forward (with the previous step's update) and backward.
    pub fn io_bytes_per_step(&self) -> (u64, u64) {
        let compute = self.compute_tier();
        let (mut read, mut written) = (0, 0);
        let in_step = self
            .schedule
            .ops
            .iter()
            .filter(|e| self.schedule.in_step(e.phase));
        for e in in_step {
            if let Op::Transfer { from, to } = e.op {
                let (f, t) = (self.buffer(from), self.buffer(to));
                if t.placement.tier == compute {
                    read += f.padded_bytes();
                } else {
                    written += t.padded_bytes();
                }
            }
        }
        (read, written)
    }

    /// Bytes this rank sends in collective op `e` (0 for other ops): the ring's figure
    /// ([`crate::ir::Cut::sent`]), which the transport's counter confirms.
    pub fn comm_bytes(&self, e: &OpEntry) -> u64 {
        use crate::ir::Collective;
        let (c, buf) = match e.op {
            Op::AllReduce { buf, .. } => (Collective::AllReduce, buf),
            Op::ReduceScatter { buf, .. } => (Collective::ReduceScatter, buf),
            Op::AllGather { buf, .. } => (Collective::AllGather, buf),
            Op::StageSend { buf, .. } => {
                let b = self.buffer(buf);
                return b.dtype.bytes_for(b.elems as u64).unwrap_or(b.bytes);
            }
            _ => return 0,
        };
        let (cut, axis) = e.op.collective_cut().expect("a collective");
        let mesh = &self.cfg.mesh;
        let len = match &e.op {
            Op::AllReduce {
                elems: Some(elems), ..
            } => elems.len(),
            _ => self.buffer(buf).elems,
        };
        let cut = cut.resolve(&self.cuts, len, mesh.size(axis));
        let elems = cut.sent(c, mesh.coord(axis));
        let dtype = self.buffer(buf).dtype;
        dtype.bytes_for(elems as u64).unwrap_or_else(|| {
            panic!("internal error: a collective moves {elems} elements of {dtype}")
        })
    }

    /// Bytes this rank sends per step in collectives (every rank sends as much): the
    /// schedule's, and the step's scalars ([`Plan::scalar_comm_bytes`]).
    pub fn comm_bytes_per_step(&self) -> u64 {
        let s = &self.schedule;
        let ops: u64 = s
            .ops
            .iter()
            .filter(|e| s.in_step(e.phase))
            .map(|e| self.comm_bytes(e))
            .sum();
        ops + self.scalar_comm_bytes()
    }

    /// Bytes of scalars this rank sends per training step: its loss sum and row count
    /// (two f64, gathered by every data rank), with sharded gradients its share of the norm
    /// per parameter group (f64 each), under tensor parallelism every norm share (f64
    /// each, gathered by every tensor rank), under pipeline parallelism the stage's loss sum
    /// and sum of squares (two f64); each gathered around the ring of its axis, so sent N−1
    /// times.
    pub fn scalar_comm_bytes(&self) -> u64 {
        if self.mode != Mode::Train {
            return 0;
        }
        let slots = self
            .schedule
            .ops
            .iter()
            .filter(|e| matches!(e.op, Op::GradNorm { .. }))
            .count() as u64;
        let (d, t) = (
            self.cfg.mesh.data as u64,
            self.cfg.mesh.tensor.max(1) as u64,
        );
        let sharded = self.cfg.zero.shards_optimizer();
        let data = (d - 1) * (16 + if sharded { 8 * slots } else { 0 });
        // Pipeline stages: the loss sum and the sum of squares (one f64 each).
        let pipeline = (self.cfg.mesh.pipeline.max(1) as u64 - 1) * 16;
        data + (t - 1) * 8 * slots + pipeline
    }

    /// Bytes per category of the compute tier's buffers live at op `op`.
    pub fn live_by_category(&self, op: usize) -> Vec<(Category, u64)> {
        let compute = self.compute_tier();
        Category::ALL
            .iter()
            .map(|&c| {
                let s = self
                    .buffers
                    .iter()
                    .filter(|b| {
                        b.category == c && b.live_at(op) && b.placement.tier.held_in(compute)
                    })
                    .map(|b| b.bytes)
                    .sum();
                (c, s)
            })
            .collect()
    }
}
