//! The vocabulary a step is written in: what the planner emits, the model families write
//! their layers in, and every backend runs. It imports nothing of the crate but
//! [`crate::dtype`], so the module graph runs one way (`scripts/import-cycles.py` checks it):
//! the planner, the model families, the backends and the checkpoints all stand on it, and
//! none of them on each other through it.
//!
//! - [`buffer`]: a plan buffer ([`Buffer`], [`BufId`]): its [`Category`], element type, size,
//!   live interval, [`Tier`] and offset; a packed tier's size ([`TierSize`]); the alignments
//!   ([`ALIGN`], [`IO_ALIGN`]).
//! - [`schedule`]: the ops ([`Op`], [`OpEntry`] with its [`Phase`]), how they name their
//!   operands ([`Rows`], [`WeightLayout`], [`ParamSlice`], [`Binding`]) and the step's
//!   ordered list ([`Schedule`]).
//! - [`family`]: the ops grouped by the kernels a backend needs ([`OpFamily`], [`Op::family`]).
//! - [`builder`]: [`Builder`], which declares buffers and appends ops (the planner and the
//!   model families write through it), and what one micro-batch emits ([`MicroBatch`],
//!   [`Emitted`], [`EmitOptions`]).
//! - [`strategy`]: the memory strategies' values ([`Precision`], [`Recompute`],
//!   [`OptimState`], [`BaseQuant`]) and the 8-bit state's block ([`QBLOCK`]).
//! - [`mesh`]: how a job's ranks are arranged ([`Mesh`]: data × tensor × pipeline) and
//!   the [`Axis`] a collective runs along.
//! - [`shard`]: how a parameter group is cut among the data-parallel ranks ([`Cut`],
//!   [`Sharding`]) and the ZeRO stage ([`Zero`]).
//! - [`moments`]: the AdamW moments as stored, borrowed ([`Moments`], [`MomentsMut`]).
//! - [`part`]: a tensor-parallel rank's part of a tensor ([`TensorPart`]) and its 8-bit
//!   blocks.
//! - [`sizing`]: what the planner asks of a backend ([`Sizing`]).
//! - [`program`]: what a backend starts on ([`Program`]: a plan's buffers, schedule, tier
//!   sizes and cuts), so no backend imports the planner.

/// Serialises a strategy type as its flag text (`Display`) and reads it back with its flag
/// parser (`FromStr`), so `plan.json`, a run's options and the CLI share one spelling.
macro_rules! serde_as_flag_text {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<$t, D::Error> {
                <String as serde::Deserialize>::deserialize(d)?
                    .parse()
                    .map_err(|e| serde::de::Error::custom(format!("{e:#}")))
            }
        }
    };
}
pub(crate) use serde_as_flag_text;

pub mod buffer;
pub mod builder;
pub mod family;
pub mod mesh;
pub mod moments;
pub mod part;
pub mod program;
pub mod schedule;
pub mod shard;
pub mod sizing;
pub mod strategy;

pub use buffer::{ALIGN, BufId, Buffer, Category, IO_ALIGN, Placement, Tier, TierSize};
pub use builder::{Builder, EmitOptions, Emitted, Loss, MicroBatch};
pub use family::OpFamily;
pub use mesh::{Axis, Mesh, ModelPart, Peer, PipelineStage, TensorSplit};
pub use moments::{Moments, MomentsMut};
pub use part::TensorPart;
pub use program::{DISK_TIER_FILE, Program, disk_tier_file};
pub use schedule::{
    Binding, BlockScales, IGNORE_TARGET, ImplicitBufs, LoraDropout, Op, OpEntry, OptimBufs,
    ParamSlice, Phase, Reduce, Rows, Schedule, Segment, Segments, VocabShare, WeightLayout,
};
pub use shard::{Collective, Cut, CutOf, Sharding, Zero};
pub use sizing::Sizing;
pub use strategy::{
    BaseQuant, BaseTypes, BlockPolicy, OptimState, Precision, QBLOCK, Recompute, RecomputeChoice,
    Update,
};
