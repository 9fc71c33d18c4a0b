//! Memory strategies, each a transformation of the plan the builder emits (never a special
//! case in the executor):
//!
//! - [`Recompute`] (`--recompute none|selective|full|every:K|auto`): which forward activations
//!   a block keeps for its backward. A family emits a block as stages (GPT-2: ln1, qkv, attn,
//!   attn_proj, ln2, fc, gelu, then the mlp_proj output; Llama: attn_norm, qkv + rope, attn,
//!   attn_out, mlp_norm, gate_up, swiglu, then the down output). A policy re-emits some stages
//!   into fresh `h{l}.re.*` buffers as `Phase::Recompute` ops just before the block's
//!   backward (`model::block_emit`), and the backward reads those; what is not kept dies at
//!   its last forward reader and packing reuses the freed bytes. `selective` re-runs the
//!   norms and the GELU/SwiGLU product (elementwise stages, no matmul); `full` a block's whole
//!   forward from its input; `every:K` keeps blocks K, 2K, … whole and recomputes the others
//!   fully. The CLI's default is `selective`, whose cost is within run-to-run noise;
//!   [`StepConfig::new`](crate::plan::StepConfig::new) (the library's) keeps `none`. `auto`
//!   ([`RecomputeChoice`], resolved by [`crate::plan::fit::plan_fitting`]) keeps the fastest policy
//!   that fits `--max-memory` by predicted step time (the least recomputation, unless
//!   activations go to a disk that bounds the step).
//! - gradient accumulation (`--grad-accum N`, `StepConfig::grad_accum`): the forward/backward
//!   of the step is unrolled once per micro-batch, each with its own token, target and loss
//!   buffers (`mb{k}.*`; packing reuses micro-batch k−1's bytes for k's); the gradients
//!   accumulate, the loss is the mean over every micro-batch's rows (scaled by 1/(N·B·T), and
//!   by the ranks too), and the optimizer runs once.
//! - [`Precision`] (`--precision fp32|bf16|fp16`): activations, their gradients and the
//!   parameter gradients are stored in the storage type; the parameters stay fp32 as master
//!   weights (category `master`), which kernels read directly and convert per tile: no
//!   reduced-precision copy of the weights is stored (the `vdpbf16ps` path rounds them to bf16
//!   while packing a tile). Layer-norm statistics, attention log-sum-exps, losses and logits
//!   stay f32; every sum, norm and statistic is accumulated in f32 and rounded once when
//!   stored. fp16 adds dynamic loss scaling (`LossScaler`, in the trainer): the executor
//!   multiplies the loss gradient by the scale, the AdamW step divides it out, and the update
//!   is skipped when the gradient norm is not finite.
//! - [`OptimState`] (`--optim-state fp32|bf16|int8`): how the AdamW moments are stored (fp32,
//!   bf16, or 8-bit blockwise codes, i8 for the first moment and u8 for the second, with one
//!   f32 absmax per block of [`QBLOCK`] values of a tensor). Checkpoints store the bytes as
//!   they are ([`super::moments`]), so a resumed run stays bitwise.
//!
//! Offload ([`crate::plan::offload`], applied by `plan::stage`) and ranks ([`crate::plan::zero`]) are
//! transformations of the same kind, in their own modules.
//!
//! Kernels are deterministic for a thread count, so recomputed activations are bitwise the
//! forward's and every recompute policy gives bitwise the same weights as `none`.

use crate::dtype::{DType, GgmlType};

/// Values per block of 8-bit optimizer state: each tensor's moments are cut into blocks of
/// this many consecutive values (the last one possibly shorter), each with one f32 absmax.
/// Part of the state's format (checkpoints store it as is), so every backend uses it.
pub const QBLOCK: usize = 2048;
use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Activation recomputation policy (`--recompute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep every activation the backward reads.
    #[default]
    None,
    /// Keep matmul outputs; recompute layernorm outputs and GELU (cheap, memory-heavy). The
    /// attention probabilities are always recomputed (flash-style attention keeps only lse).
    Selective,
    /// Keep each block's input only; recompute the block's forward before its backward.
    Full,
    /// Full recomputation for every block except blocks K, 2K, … (1-based), which keep all.
    Every(usize),
}

/// What one block keeps under a policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockPolicy {
    KeepAll,
    Selective,
    Full,
}

impl Recompute {
    /// The policy of block `l` (0-based).
    pub fn block(self, l: usize) -> BlockPolicy {
        match self {
            Recompute::None => BlockPolicy::KeepAll,
            Recompute::Selective => BlockPolicy::Selective,
            Recompute::Full => BlockPolicy::Full,
            Recompute::Every(k) if (l + 1).is_multiple_of(k.max(1)) => BlockPolicy::KeepAll,
            Recompute::Every(_) => BlockPolicy::Full,
        }
    }

    /// The candidates `--recompute auto` considers, least recomputation first: none,
    /// selective, every:2 … every:L, full.
    pub fn candidates(n_layer: usize) -> Vec<Recompute> {
        let mut c = vec![Recompute::None, Recompute::Selective];
        c.extend((2..=n_layer).map(Recompute::Every));
        c.push(Recompute::Full);
        c
    }
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recompute::None => write!(f, "none"),
            Recompute::Selective => write!(f, "selective"),
            Recompute::Full => write!(f, "full"),
            Recompute::Every(k) => write!(f, "every:{k}"),
        }
    }
}

/// The `--recompute` flag: a policy, or `auto` (the fastest that fits `--max-memory`, by
/// predicted step time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeChoice {
    Fixed(Recompute),
    Auto,
}

/// `selective`: it re-runs only elementwise stages (norms, the activation function), whose
/// cost is lost in the step's time (measured: within run-to-run noise for GPT-2 124M and
/// SmolLM2-135M at 4 × 256), and keeps a tenth or more of the activations out of the peak.
impl Default for RecomputeChoice {
    fn default() -> RecomputeChoice {
        RecomputeChoice::Fixed(Recompute::Selective)
    }
}

impl FromStr for RecomputeChoice {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<RecomputeChoice> {
        let p = match s.trim() {
            "none" => Recompute::None,
            "selective" => Recompute::Selective,
            "full" => Recompute::Full,
            "auto" => return Ok(RecomputeChoice::Auto),
            other => match other.strip_prefix("every:") {
                Some(k) => match k.parse::<usize>() {
                    Ok(k) if k >= 1 => Recompute::Every(k),
                    _ => bail!(
                        "--recompute {other}: K must be a whole number >= 1 (every:K keeps blocks K, 2K, ... and recomputes the others)"
                    ),
                },
                None => bail!(
                    "--recompute {other}: expected none, selective, full, every:K (K >= 1) or auto"
                ),
            },
        };
        Ok(RecomputeChoice::Fixed(p))
    }
}

impl fmt::Display for RecomputeChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecomputeChoice::Fixed(p) => p.fmt(f),
            RecomputeChoice::Auto => write!(f, "auto"),
        }
    }
}

impl Serialize for Recompute {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Recompute {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Recompute, D::Error> {
        let s = String::deserialize(d)?;
        match s.parse::<RecomputeChoice>() {
            Ok(RecomputeChoice::Fixed(p)) => Ok(p),
            Ok(RecomputeChoice::Auto) => Err(serde::de::Error::custom(
                "recompute 'auto' must be resolved to a policy",
            )),
            Err(e) => Err(serde::de::Error::custom(format!("{e:#}"))),
        }
    }
}

serde_as_flag_text!(RecomputeChoice);

/// Numeric format of weights used in compute, activations and gradients (`--precision`).
/// Mixed precision keeps the weights in fp32 (category `master`); kernels convert them per
/// tile, and the optimizer updates them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    #[default]
    F32,
    /// bfloat16 storage, f32 compute and accumulation; no loss scaling needed.
    Bf16,
    /// IEEE half storage, f32 compute; dynamic loss scaling against its narrow range.
    F16,
}

impl Precision {
    /// The element type of activations, compute weights and gradients.
    pub fn storage(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::Bf16,
            Precision::F16 => DType::F16,
        }
    }

    /// Bytes of one element of [`Precision::storage`].
    pub fn storage_size(self) -> usize {
        match self.storage().size() {
            Some(size) => size,
            None => unreachable!("a precision stores elements, not blocks"),
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "fp16",
        })
    }
}

impl FromStr for Precision {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Precision> {
        Ok(match s.trim() {
            "fp32" | "f32" => Precision::F32,
            "bf16" => Precision::Bf16,
            "fp16" | "f16" => Precision::F16,
            other => bail!("--precision {other}: expected fp32, bf16 or fp16"),
        })
    }
}

serde_as_flag_text!(Precision);

/// Storage of the AdamW moments (`--optim-state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OptimState {
    /// f32 moments (8 bytes per parameter).
    #[default]
    F32,
    /// bf16 moments (4 bytes per parameter).
    Bf16,
    /// 8-bit log-scale codes per block with an f32 absmax per block (~2 bytes per parameter).
    Int8,
}

impl fmt::Display for OptimState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OptimState::F32 => "fp32",
            OptimState::Bf16 => "bf16",
            OptimState::Int8 => "int8",
        })
    }
}

impl FromStr for OptimState {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<OptimState> {
        Ok(match s.trim() {
            "fp32" | "f32" => OptimState::F32,
            "bf16" => OptimState::Bf16,
            "int8" => OptimState::Int8,
            other => bail!("--optim-state {other}: expected fp32, bf16 or int8"),
        })
    }
}

serde_as_flag_text!(OptimState);

/// When each parameter group's AdamW step runs (`--update`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Update {
    /// After the whole backward: every group's gradients are live together at its end.
    #[default]
    End,
    /// As soon as the group's gradients are final, inside the backward (PyTorch's
    /// optimizer-in-backward, LOMO's fused update): each group's gradients live only from
    /// its backward to its update, and the LM head's weight gradient is taken after the
    /// backward a slice of the vocabulary at a time, each slice updated as it is done
    /// (`plan::update`). The same arithmetic as [`Update::End`] without clipping by the
    /// global norm, which needs every gradient first (`--grad-clip 0`).
    InBackward,
}

impl fmt::Display for Update {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Update::End => "end",
            Update::InBackward => "in-backward",
        })
    }
}

impl FromStr for Update {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Update> {
        Ok(match s.trim() {
            "end" => Update::End,
            "in-backward" | "in_backward" | "backward" => Update::InBackward,
            other => bail!("--update {other}: expected end or in-backward"),
        })
    }
}

serde_as_flag_text!(Update);

/// How a LoRA plan keeps its frozen base (`--base-quant`): f32, or its matrices (the
/// linear layers' weights and the embeddings, whose rows are whole blocks) as ggml blocks,
/// quantized once when the base is loaded (llama.cpp's reference quantizers, bitwise), the
/// norms' weights in f32 beside them. The frozen layers then read their weights quantized
/// (their buffers' dtype is [`DType::Ggml`]): a forward and an input-gradient GEMM that
/// decode a tile of rows at a time, and the embedding rows decoded as they are gathered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BaseQuant {
    #[default]
    F32,
    Blocks(GgmlType),
    /// Each tensor as a GGUF `--init` stores it ([`BaseTypes`]): its blocks copied, never
    /// re-quantized.
    Keep,
}

/// The storage type of each base tensor, by its Hugging Face name, as a GGUF file holds it
/// (`--base-quant keep`; read from the file by `gguf::hf::tensor_types`).
pub type BaseTypes = std::collections::BTreeMap<String, GgmlType>;

impl BaseQuant {
    /// The `--base-quant` values.
    pub const NAMES: &'static str = "fp32, bf16, q8_0, q4_0, q4_1, q4_k, keep";
}

impl std::str::FromStr for BaseQuant {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<BaseQuant> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" => BaseQuant::F32,
            "bf16" => BaseQuant::Blocks(GgmlType::BF16),
            "q8_0" => BaseQuant::Blocks(GgmlType::Q8_0),
            "q4_0" => BaseQuant::Blocks(GgmlType::Q4_0),
            "q4_1" => BaseQuant::Blocks(GgmlType::Q4_1),
            "q4_k" => BaseQuant::Blocks(GgmlType::Q4_K),
            "keep" => BaseQuant::Keep,
            _ => bail!(
                "--base-quant {s}: memwall keeps a base as {} (keep: a GGUF file's own \
                 blocks, Q6_K and the others among them)",
                BaseQuant::NAMES
            ),
        })
    }
}

impl std::fmt::Display for BaseQuant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BaseQuant::F32 => f.write_str("fp32"),
            BaseQuant::Blocks(t) => f.write_str(&t.name.to_ascii_lowercase()),
            BaseQuant::Keep => f.write_str("keep"),
        }
    }
}

impl serde::Serialize for BaseQuant {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for BaseQuant {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse()
            .map_err(|e: anyhow::Error| serde::de::Error::custom(format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_policy() {
        for s in ["none", "selective", "full", "every:3", "auto"] {
            let c: RecomputeChoice = s.parse().unwrap();
            assert_eq!(c.to_string(), s);
        }
        for bad in ["every:0", "every:", "every:x", "most", ""] {
            let e = format!("{:#}", bad.parse::<RecomputeChoice>().unwrap_err());
            assert!(e.contains("--recompute"), "{e}");
        }
    }

    #[test]
    fn optimizer_state_formats_parse() {
        for s in ["fp32", "bf16", "int8"] {
            assert_eq!(s.parse::<OptimState>().unwrap().to_string(), s);
        }
        let e = format!("{:#}", "fp8".parse::<OptimState>().unwrap_err());
        assert!(e.contains("--optim-state"), "{e}");
    }

    #[test]
    fn every_k_keeps_every_kth_block() {
        let p = Recompute::Every(3);
        let kept: Vec<usize> = (0..12)
            .filter(|&l| p.block(l) == BlockPolicy::KeepAll)
            .collect();
        assert_eq!(kept, vec![2, 5, 8, 11]);
        assert!((0..12).all(|l| Recompute::Every(1).block(l) == BlockPolicy::KeepAll));
    }
}
