//! The Llama family's parameter inventory: every tensor with its Hugging Face name, shape and
//! initialisation, in buffer order, grouped as the embedding, one group per block, the final
//! norm, and the LM head when it is not tied.
//!
//! Linear weights are stored as `torch.nn.Linear` does, `[out, in]` row-major, so checkpoints
//! are straight copies and the linear ops use `WeightLayout::OutIn`
//! (`crate::ir::schedule::WeightLayout`). Inside a block the tensors are placed so that
//! projections reading the same input are one matrix: `q_proj`, `k_proj` and `v_proj` rows
//! follow each other (`[(NH + 2·NKV)·hd, C]` together, one GEMM writing the fused q|k|v row),
//! as do `gate_proj` and `up_proj` (`[2H, C]`); their biases likewise. Phi-3's checkpoints
//! store them so: `self_attn.qkv_proj` and `mlp.gate_up_proj` are those ranges, one tensor
//! each ([`Family::fused_projections`](crate::model::Family::fused_projections)).
//! Qwen3's per-head norms (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, `[hd]` each)
//! follow `o_proj`, as `Qwen3Attention` declares them, side by side: `[2, hd]` together, the
//! one range the q/k norm ops read.
//! Gemma 3 ([`Family::post_norms`](crate::model::Family::post_norms)) has two norms more, after
//! the attention (`post_attention_layernorm`, a name Llama gives its pre-MLP norm, which is
//! Gemma's `pre_feedforward_layernorm`) and after the MLP (`post_feedforward_layernorm`).
//! Initialisation as transformers' `LlamaPreTrainedModel`: weights and embeddings
//! N(0, 0.02), biases 0, norm weights 1 (Gemma's 0: its gains are `1 + w`).
//!
//! A tensor-parallel rank ([`crate::ir::TensorSplit`]) keeps its part of the query heads, key/value
//! heads and MLP channels: the rows of `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`
//! (and their biases), the columns of `o_proj` and `down_proj`; so its fused q|k|v and
//! gate|up are its own heads' and channels', contiguous as on one rank (of Phi-3's fused
//! tensors, three runs of rows and two). The rest is whole.
//!
//! A pipeline stage ([`crate::ir::PipelineStage`]) holds its blocks; the first also the
//! embedding, the last the final norm and the LM head (a tied one: the embedding, kept equal
//! to the first stage's).

use crate::ir::ModelPart;
use crate::model::ParamLayout;
use crate::model::params::{Init, LayoutBuilder, TiedName};
use crate::model::spec::ModelSpec;
use std::ops::Range;

/// The untied output projection's name.
pub(crate) const LM_HEAD: &str = "lm_head.weight";

/// Element ranges of one block's parameters (C width, H MLP width, hd head size; QKV =
/// (NH + 2·NKV)·hd, A = NH·hd).
#[derive(Clone, Debug)]
pub struct LayerParams {
    pub attn_norm: Range<usize>,              // [C]
    pub qkv_w: Range<usize>,                  // [QKV, C]: q_proj, k_proj, v_proj
    pub qkv_b: Option<Range<usize>>,          // [QKV]
    pub o_w: Range<usize>,                    // [C, A]
    pub o_b: Option<Range<usize>>,            // [C]
    pub qk_norm: Option<Range<usize>>,        // [2, hd]: q_norm, k_norm (Qwen3, Gemma 3)
    pub post_attn_norm: Option<Range<usize>>, // [C] (Gemma 3)
    pub mlp_norm: Range<usize>,               // [C]
    pub gate_up_w: Range<usize>,              // [2H, C]: gate_proj, up_proj
    pub gate_up_b: Option<Range<usize>>,      // [2H]
    pub down_w: Range<usize>,                 // [C, H]
    pub down_b: Option<Range<usize>>,         // [C]
    pub post_mlp_norm: Option<Range<usize>>,  // [C] (Gemma 3)
}

/// Element ranges of every tensor, by role.
#[derive(Clone, Debug)]
pub struct LlamaParams {
    pub embed: Range<usize>, // [Vpart, C]: this rank's rows of the vocabulary
    /// The stage's blocks: those of its runs of the model's layers, `chunks`, in order.
    pub layers: Vec<LayerParams>,
    /// The model's layers the stage holds, run by run (one run but under the interleaved
    /// schedule: [`crate::ir::PipelineStage::chunk_layers`]).
    pub chunks: Vec<Range<usize>>,
    pub norm: Range<usize>,    // [C]
    pub lm_head: Range<usize>, // [Vpart, C]: `embed` when tied
}

/// The layout of `part` of the model and the ranges by role (the ranges of tensors `part`
/// does not hold are empty).
pub fn inventory(spec: &ModelSpec, part: ModelPart) -> (ParamLayout, LlamaParams) {
    let (split, stage) = (part.tensor, part.stage);
    let chunks = stage.chunk_layers(spec.n_layer);
    let held = |l: usize| chunks.iter().any(|r| r.contains(&l));
    let tied_here = spec.tied_embeddings && stage.is_last();
    let (v, c, h) = (spec.vocab_size, spec.n_embd, spec.mlp_hidden);
    let hd = spec.head_dim;
    let (q, kv) = (spec.n_head * hd, spec.n_kv_head * hd);
    // This rank's rows of q, of k and v, and of the MLP's channels.
    let heads = |n: usize| {
        let r = split.part(n);
        r.start * hd..r.end * hd
    };
    let (q_part, kv_part, h_part) = (heads(spec.n_head), heads(spec.n_kv_head), split.part(h));
    let rows = |r: &Range<usize>| (0, vec![r.clone()]);
    let cols = |r: &Range<usize>| (1, vec![r.clone()]);
    let normal = Init::Normal { std: 0.02 };
    let mut cur = LayoutBuilder::new(spec.family);
    cur.hold(stage.is_first() || tied_here);
    // This rank's rows of the vocabulary, of the embedding and of the head alike.
    let vocab = rows(&split.vocab_part(v));
    let embed = cur.push_cut(
        "model.embed_tokens.weight".into(),
        &[v, c],
        vocab.clone(),
        true,
        normal,
    );
    cur.group("embed");
    let join = |a: Range<usize>, b: Range<usize>| {
        debug_assert_eq!(a.end, b.start, "consecutive tensors");
        a.start..b.end
    };
    let mut layers = Vec::with_capacity(chunks.iter().map(|r| r.len()).sum());
    let post_norms = spec.family.post_norms();
    // Gemma's gains are 1 + w: its norm weights start at 0 (`Gemma3RMSNorm`).
    let norm_init = match spec.family.norm_offset() {
        0.0 => Init::Ones,
        _ => Init::Zeros,
    };
    for l in 0..spec.n_layer {
        cur.hold(held(l));
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let bias =
            |cur: &mut LayoutBuilder, s: &str, n: usize| cur.push(p(s), &[n], false, Init::Zeros);
        let bias_part = |cur: &mut LayoutBuilder, s: &str, n: usize, part: &Range<usize>| {
            cur.push_cut(p(s), &[n], rows(part), false, Init::Zeros)
        };
        let weight = |cur: &mut LayoutBuilder, s: &str, shape: [usize; 2], cut| {
            cur.push_cut(p(s), &shape, cut, true, normal)
        };
        let attn_norm = cur.push_norm(p("input_layernorm.weight"), c, norm_init, split);
        // A rank's rows of the fused q|k|v (`[QKV, C]`): its queries', keys' and values'.
        let shift = |r: &Range<usize>, by: usize| r.start + by..r.end + by;
        let qkv_w = if spec.family.fused_projections() {
            let cut = vec![q_part.clone(), shift(&kv_part, q), shift(&kv_part, q + kv)];
            weight(
                &mut cur,
                "self_attn.qkv_proj.weight",
                [q + 2 * kv, c],
                (0, cut),
            )
        } else {
            let q_w = weight(&mut cur, "self_attn.q_proj.weight", [q, c], rows(&q_part));
            let k_w = weight(&mut cur, "self_attn.k_proj.weight", [kv, c], rows(&kv_part));
            let v_w = weight(&mut cur, "self_attn.v_proj.weight", [kv, c], rows(&kv_part));
            join(join(q_w, k_w), v_w)
        };
        let qkv_b = spec.biases.qkv.then(|| {
            let qb = bias_part(&mut cur, "self_attn.q_proj.bias", q, &q_part);
            let kb = bias_part(&mut cur, "self_attn.k_proj.bias", kv, &kv_part);
            let vb = bias_part(&mut cur, "self_attn.v_proj.bias", kv, &kv_part);
            join(join(qb, kb), vb)
        });
        let o_w = weight(&mut cur, "self_attn.o_proj.weight", [c, q], cols(&q_part));
        let o_b = spec
            .biases
            .attn_out
            .then(|| bias(&mut cur, "self_attn.o_proj.bias", c));
        let qk_norm = spec.family.qk_norm().then(|| {
            // Whole on every tensor rank, each normalising its own heads.
            let qn = cur.push(p("self_attn.q_norm.weight"), &[hd], false, norm_init);
            cur.partial_grad(split);
            let kn = cur.push(p("self_attn.k_norm.weight"), &[hd], false, norm_init);
            cur.partial_grad(split);
            join(qn, kn)
        });
        let post_attn_norm = post_norms
            .then(|| cur.push_norm(p("post_attention_layernorm.weight"), c, norm_init, split));
        let mlp_norm = match post_norms {
            true => "pre_feedforward_layernorm.weight",
            false => "post_attention_layernorm.weight",
        };
        let mlp_norm = cur.push_norm(p(mlp_norm), c, norm_init, split);
        let gate_up_w = if spec.family.fused_projections() {
            let cut = vec![h_part.clone(), shift(&h_part, h)];
            weight(&mut cur, "mlp.gate_up_proj.weight", [2 * h, c], (0, cut))
        } else {
            let gate_w = weight(&mut cur, "mlp.gate_proj.weight", [h, c], rows(&h_part));
            let up_w = weight(&mut cur, "mlp.up_proj.weight", [h, c], rows(&h_part));
            join(gate_w, up_w)
        };
        let gate_up_b = spec.biases.mlp.then(|| {
            let gb = bias_part(&mut cur, "mlp.gate_proj.bias", h, &h_part);
            let ub = bias_part(&mut cur, "mlp.up_proj.bias", h, &h_part);
            join(gb, ub)
        });
        let down_w = weight(&mut cur, "mlp.down_proj.weight", [c, h], cols(&h_part));
        let down_b = spec
            .biases
            .mlp
            .then(|| bias(&mut cur, "mlp.down_proj.bias", c));
        let post_mlp_norm = post_norms
            .then(|| cur.push_norm(p("post_feedforward_layernorm.weight"), c, norm_init, split));
        cur.group(format!("h{l}"));
        if !held(l) {
            continue;
        }
        layers.push(LayerParams {
            attn_norm,
            qkv_w,
            qkv_b,
            o_w,
            o_b,
            qk_norm,
            post_attn_norm,
            mlp_norm,
            gate_up_w,
            gate_up_b,
            down_w,
            down_b,
            post_mlp_norm,
        });
    }
    cur.hold(stage.is_last());
    let norm = cur.push_norm("model.norm.weight".into(), c, norm_init, split);
    cur.group("norm");
    let (lm_head, tied) = if spec.tied_embeddings {
        // The head is the embedding, the first tensor wherever it is held.
        let tied = (stage.is_first() || stage.is_last())
            .then(|| TiedName {
                name: LM_HEAD.into(),
                tensor: 0,
            })
            .into_iter()
            .collect();
        (embed.clone(), tied)
    } else {
        let w = cur.push_cut(LM_HEAD.into(), &[v, c], vocab, true, normal);
        cur.group("lm_head");
        (w, vec![])
    };
    let params = LlamaParams {
        embed,
        layers,
        chunks,
        norm,
        lm_head,
    };
    (cur.finish(tied, part), params)
}
