//! What a plan is built for: the step's [`Mode`] and its [`StepConfig`] (shape, threads and
//! every memory strategy). The builder ([`super::build`]) turns one into a plan; the
//! search ([`super::search`]) and the ZeRO sharding ([`super::zero`]) read it.

use super::Offload;
use crate::ir::shard::{Sharding, Zero};
use crate::ir::{
    BaseQuant, BaseTypes, EmitOptions, Mesh, ModelPart, OptimState, PipelineStage, Precision,
    Recompute, TensorSplit, Update,
};
use crate::model::lora::LoraSpec;
use serde::Serialize;

/// What the step does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Forward, backward and optimizer step (also runs forward-only evaluation).
    Train,
    /// Forward only with next-token logits of one position (sampling).
    Generate,
}

/// The step's shape and resources.
#[derive(Clone, Debug, Serialize)]
pub struct StepConfig {
    /// Micro-batch size B.
    pub batch: usize,
    /// Sequence length T.
    pub seq: usize,
    /// Worker threads (kernel workspace is sized per thread).
    pub threads: usize,
    /// Upper bound for the LM head's logits chunk (bytes); smaller saves memory, larger
    /// makes fewer passes over wte.
    pub logits_chunk_bytes: u64,
    /// Activation recomputation policy.
    pub recompute: Recompute,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub grad_accum: usize,
    /// Storage of the AdamW moments.
    pub optim_state: OptimState,
    /// Format of compute weights, activations and gradients.
    pub precision: Precision,
    /// What lives on the disk tier, and where its file is.
    pub offload: Offload,
    /// The job's ranks and this process's place among them ([`Mesh`]; serialised as
    /// `ranks` and `rank`, the data axis). Along the data axis each rank runs this plan on
    /// its own rows and keeps its shard of sharded state.
    #[serde(flatten)]
    pub mesh: Mesh,
    /// Each pipeline stage's count of consecutive layers (`--pp-layers`, resolved); empty:
    /// as even as they divide ([`StepConfig::stage_counts`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stage_layers: Vec<usize>,
    /// Runs of layers each pipeline stage holds (`--pp-chunks`): 1, or V > 1 for the
    /// interleaved 1F1B schedule ([`PipelineStage::interleaved`]; its runs cut evenly).
    #[serde(skip_serializing_if = "is_one")]
    pub pipeline_chunks: usize,
    /// Sequence parallelism on the tensor axis (`--sequence-parallel`): the residual stream
    /// between the tensor-parallel regions cut by token rows among the tensor ranks
    /// ([`crate::ir::TensorSplit::sequence`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub sequence_parallel: bool,
    /// What each rank keeps of the model's state (`--zero`).
    pub zero: Zero,
    /// LoRA (`--lora`): train adapters on a frozen base instead of every weight
    /// ([`super::lora`]). Training plans only; `None` trains the whole model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSpec>,
    /// How a LoRA plan keeps its frozen base (`--base-quant`).
    #[serde(skip_serializing_if = "is_f32")]
    pub base_quant: BaseQuant,
    /// `--base-quant keep`: the GGUF `--init`'s storage type of each base tensor.
    #[serde(skip)]
    pub base_types: Option<std::sync::Arc<BaseTypes>>,
    /// Rows pack several examples (chat data; `--no-pack` clears it): each micro-batch gets a
    /// `positions` buffer `[B, T]` (each row's place in its example), which the position
    /// embeddings and attention read, so examples neither see each other nor their places in
    /// the row. Training plans only.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub packed: bool,
    /// Distillation (`train --distill-from`): the head's loss against a teacher's logits.
    /// Training plans only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distill: Option<Distill>,
    /// When each parameter group's AdamW step runs (`--update`; [`Update::InBackward`]:
    /// inside the backward, `plan::update`). Training plans only.
    #[serde(skip_serializing_if = "is_end")]
    pub update: Update,
}

fn is_end(u: &Update) -> bool {
    *u == Update::End
}

/// Distillation's loss at the LM head: `alpha` · KL(teacher ‖ student) + (1 − `alpha`) ·
/// cross-entropy. The teacher runs apart (its own plan, of `teacher_bytes`, which the
/// student's plan counts as one owned buffer of [`crate::ir::Category::Teacher`]); the step
/// takes its final-norm output `[B·T, teacher_width]` per micro-batch and its head
/// `[V, teacher_width]` as inputs, and computes its logits a chunk of rows at a time beside
/// the student's.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Distill {
    pub teacher_width: usize,
    pub alpha: f32,
    /// The teacher's plan's bytes ([`crate::plan::Plan::total_bytes`]).
    #[serde(default)]
    pub teacher_bytes: u64,
    /// The arithmetic of the teacher's forward over one sequence (its plan's FLOPs), which
    /// runs for every row of a step ([`crate::plan::time::predict`] times it).
    #[serde(default)]
    pub teacher_flops: u64,
}

fn is_f32(q: &BaseQuant) -> bool {
    *q == BaseQuant::F32
}

impl StepConfig {
    pub fn new(batch: usize, seq: usize, threads: usize) -> StepConfig {
        StepConfig {
            batch,
            seq,
            threads,
            logits_chunk_bytes: 64 << 20,
            recompute: Recompute::None,
            grad_accum: 1,
            optim_state: OptimState::F32,
            precision: Precision::F32,
            offload: Offload::default(),
            mesh: Mesh::SINGLE,
            stage_layers: Vec::new(),
            pipeline_chunks: 1,
            sequence_parallel: false,
            zero: Zero::DP,
            lora: None,
            base_quant: BaseQuant::F32,
            base_types: None,
            packed: false,
            distill: None,
            update: Update::End,
        }
    }

    /// What a model family's emission of a model of `n_layer` layers reads of this
    /// configuration.
    pub fn emit_options(&self, n_layer: usize) -> EmitOptions {
        EmitOptions {
            recompute: self.recompute,
            logits_chunk_bytes: self.logits_chunk_bytes,
            tensor: self.tensor_split(),
            stage: self.pipeline_stage(n_layer),
            frozen_embedding: self.lora.is_some(),
        }
    }

    /// This rank's share of every layer along the tensor axis, with the sequence
    /// parallelism asked for.
    pub fn tensor_split(&self) -> TensorSplit {
        TensorSplit {
            sequence: self.sequence_parallel,
            ..self.mesh.tensor_split()
        }
    }

    /// Each pipeline stage's count of a model's `n_layer` layers: [`StepConfig::stage_layers`]
    /// as given, or as even as they divide (empty for one stage).
    pub fn stage_counts(&self, n_layer: usize) -> Vec<usize> {
        match (self.mesh.pipeline, self.stage_layers.is_empty()) {
            (0 | 1, _) => Vec::new(),
            (p, true) => crate::ir::mesh::even_layers(n_layer, p),
            (_, false) => self.stage_layers.clone(),
        }
    }

    /// This rank's pipeline stage of a model of `n_layer` layers.
    pub fn pipeline_stage(&self, n_layer: usize) -> PipelineStage {
        match self.pipeline_chunks > 1 && self.mesh.pipeline > 1 {
            true => PipelineStage::interleaved(
                self.mesh.pipeline,
                self.mesh.coord(crate::ir::Axis::Pipeline),
                self.pipeline_chunks,
                n_layer,
            ),
            false => self.mesh.pipeline_stage(&self.stage_counts(n_layer)),
        }
    }

    /// This rank's part of a model of `n_layer` layers: its tensor share of its stage.
    pub fn model_part(&self, n_layer: usize) -> ModelPart {
        ModelPart {
            tensor: self.tensor_split(),
            stage: self.pipeline_stage(n_layer),
        }
    }

    /// How state is split among ranks, for plans with more than one rank or a ZeRO stage.
    pub fn sharding(&self) -> Option<Sharding> {
        (self.mesh.data > 1 || self.zero != Zero::DP).then_some(Sharding {
            ranks: self.mesh.data,
            rank: self.mesh.data_rank(),
            zero: self.zero,
        })
    }
}

fn is_one(n: &usize) -> bool {
    *n == 1
}
