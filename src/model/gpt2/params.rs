//! GPT-2's parameter inventory: every tensor with its Hugging Face name, shape and
//! initialisation, in buffer order, grouped as embeddings, one group per block, final norm.
//!
//! Linear weights are stored as Hugging Face's Conv1D does, `[in, out]` row-major, so a
//! checkpoint is a straight copy and `out[N, OC] = inp[N, IC] @ w[IC, OC] + b[OC]`.
//! Initialisation as the GPT-2 paper: weights ~ N(0, 0.02), residual output projections
//! scaled by 1/sqrt(2L), biases 0, layer-norm weights 1.
//!
//! A tensor-parallel rank ([`crate::ir::TensorSplit`]) keeps its part of the heads and MLP channels:
//! of `c_attn` (and its bias) its heads' q, k and v columns (three ranges, contiguous in its
//! own layout as `[C, 3·C/t]`), of `c_fc` its channels' columns, of the two `c_proj`s the
//! matching rows (their inputs). The rest is whole.
//!
//! A pipeline stage ([`crate::ir::PipelineStage`]) holds its blocks; the first also the
//! embeddings, the last `ln_f` and, for the tied LM head, the embeddings' group (`wte`, and
//! `wpe` with a zero gradient), kept equal to the first's.

use crate::ir::ModelPart;
use crate::model::ParamLayout;
use crate::model::params::{Init, LayoutBuilder, TiedName};
use crate::model::spec::{Family, ModelSpec};
use std::ops::Range;

/// The output projection, tied to `transformer.wte.weight`.
pub(crate) const LM_HEAD: &str = "lm_head.weight";

/// Element ranges of one transformer block's parameters (C = n_embd, H = MLP width).
#[derive(Clone, Debug)]
pub struct LayerParams {
    pub ln1_w: Range<usize>,    // [C]
    pub ln1_b: Range<usize>,    // [C]
    pub qkv_w: Range<usize>,    // [C, 3C]
    pub qkv_b: Range<usize>,    // [3C]
    pub proj_w: Range<usize>,   // [C, C]
    pub proj_b: Range<usize>,   // [C]
    pub ln2_w: Range<usize>,    // [C]
    pub ln2_b: Range<usize>,    // [C]
    pub fc_w: Range<usize>,     // [C, H]
    pub fc_b: Range<usize>,     // [H]
    pub fcproj_w: Range<usize>, // [H, C]
    pub fcproj_b: Range<usize>, // [C]
}

/// Element ranges of every GPT-2 tensor, by role.
#[derive(Clone, Debug)]
pub struct Gpt2Params {
    pub wte: Range<usize>, // [Vpart, C], tied with the LM head: this rank's rows of the vocabulary
    pub wpe: Range<usize>, // [maxT, C]
    /// The stage's blocks: those of its runs of the model's layers, `chunks`, in order.
    pub layers: Vec<LayerParams>,
    /// The model's layers the stage holds, run by run (one run but under the interleaved
    /// schedule: [`crate::ir::PipelineStage::chunk_layers`]).
    pub chunks: Vec<Range<usize>>,
    pub lnf_w: Range<usize>, // [C]
    pub lnf_b: Range<usize>, // [C]
}

/// The layout of `part` of the model and the ranges by role (the ranges of tensors `part`
/// does not hold are empty).
pub fn inventory(spec: &ModelSpec, part: ModelPart) -> (ParamLayout, Gpt2Params) {
    let (split, stage) = (part.tensor, part.stage);
    let chunks = stage.chunk_layers(spec.n_layer);
    let held = |l: usize| chunks.iter().any(|r| r.contains(&l));
    let (v, c, t, h) = (
        spec.vocab_size,
        spec.n_embd,
        spec.n_positions,
        spec.mlp_hidden,
    );
    let normal = Init::Normal { std: 0.02 };
    let resid = Init::Normal {
        std: 0.02 * (1.0 / ((2 * spec.n_layer) as f32).sqrt()),
    };
    // This rank's channels of the attention (its heads') and of the MLP.
    let (a, m) = (split.part(c), split.part(h));
    let qkv_cols = vec![
        a.clone(),
        c + a.start..c + a.end,
        2 * c + a.start..2 * c + a.end,
    ];
    let mut cur = LayoutBuilder::new(Family::Gpt2);
    cur.hold(stage.is_first() || stage.is_last());
    // This rank's rows of the vocabulary (of the embedding and the tied head).
    let vocab = (0, vec![split.vocab_part(v)]);
    let wte = cur.push_cut(
        "transformer.wte.weight".into(),
        &[v, c],
        vocab,
        true,
        normal,
    );
    // The last stage keeps wpe too (its gradient zero there), so both ends hold the same
    // "embed" group, whose gradients are summed between them as one buffer; the one op
    // that reads the two (the encoder) keeps its ranges in one group.
    let wpe = cur.push("transformer.wpe.weight".into(), &[t, c], true, normal);
    cur.group("embed");
    let mut layers = Vec::with_capacity(chunks.iter().map(|r| r.len()).sum());
    for l in 0..spec.n_layer {
        cur.hold(held(l));
        let p = |s: &str| format!("transformer.h.{l}.{s}");
        let weight = |cur: &mut LayoutBuilder, s: &str, shape: &[usize], cut, init| {
            cur.push_cut(p(s), shape, cut, true, init)
        };
        let bias = |cur: &mut LayoutBuilder, s: &str, n: usize, ranges: Vec<Range<usize>>| {
            cur.push_cut(p(s), &[n], (0, ranges), false, Init::Zeros)
        };
        let ln1_w = cur.push_norm(p("ln_1.weight"), c, Init::Ones, split);
        let ln1_b = cur.push_norm(p("ln_1.bias"), c, Init::Zeros, split);
        let cut = (1, qkv_cols.clone());
        let qkv_w = weight(&mut cur, "attn.c_attn.weight", &[c, 3 * c], cut, normal);
        let qkv_b = bias(&mut cur, "attn.c_attn.bias", 3 * c, qkv_cols.clone());
        let cut = (0, vec![a.clone()]);
        let proj_w = weight(&mut cur, "attn.c_proj.weight", &[c, c], cut, resid);
        let proj_b = cur.push(p("attn.c_proj.bias"), &[c], false, Init::Zeros);
        let ln2_w = cur.push_norm(p("ln_2.weight"), c, Init::Ones, split);
        let ln2_b = cur.push_norm(p("ln_2.bias"), c, Init::Zeros, split);
        let cut = (1, vec![m.clone()]);
        let fc_w = weight(&mut cur, "mlp.c_fc.weight", &[c, h], cut, normal);
        let fc_b = bias(&mut cur, "mlp.c_fc.bias", h, vec![m.clone()]);
        let cut = (0, vec![m.clone()]);
        let fcproj_w = weight(&mut cur, "mlp.c_proj.weight", &[h, c], cut, resid);
        let fcproj_b = cur.push(p("mlp.c_proj.bias"), &[c], false, Init::Zeros);
        cur.group(format!("h{l}"));
        if !held(l) {
            continue;
        }
        layers.push(LayerParams {
            ln1_w,
            ln1_b,
            qkv_w,
            qkv_b,
            proj_w,
            proj_b,
            ln2_w,
            ln2_b,
            fc_w,
            fc_b,
            fcproj_w,
            fcproj_b,
        });
    }
    cur.hold(stage.is_last());
    let lnf_w = cur.push_norm("transformer.ln_f.weight".into(), c, Init::Ones, split);
    let lnf_b = cur.push_norm("transformer.ln_f.bias".into(), c, Init::Zeros, split);
    cur.group("ln_f");
    // The head is tied to wte, the first tensor wherever it is held.
    let tied = (stage.is_first() || stage.is_last())
        .then(|| TiedName {
            name: LM_HEAD.into(),
            tensor: 0,
        })
        .into_iter()
        .collect();
    let params = Gpt2Params {
        wte,
        wpe,
        layers,
        chunks,
        lnf_w,
        lnf_b,
    };
    (cur.finish(tied, part), params)
}
