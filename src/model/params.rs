//! The parameter inventory: every tensor of a GPT-2 model, its Hugging Face name and shape,
//! and its offset in the one flat parameter buffer (llm.c style: all parameters in one
//! allocation, pointed into by a cursor). Gradients and optimizer moments use the same layout.
//!
//! Linear weights are stored as Hugging Face's Conv1D does, `[in, out]` row-major, so a
//! checkpoint is a straight copy and `out[N, OC] = inp[N, IC] @ w[IC, OC] + b[OC]`.

use super::ModelSpec;
use std::ops::Range;

/// One parameter tensor inside the flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamTensor {
    /// Hugging Face name, e.g. `transformer.h.0.attn.c_attn.weight`.
    pub name: String,
    /// Shape as Hugging Face stores it.
    pub shape: Vec<usize>,
    /// Element range in the flat buffer.
    pub range: Range<usize>,
    /// Whether AdamW applies weight decay (matrices and embeddings; not biases or norms).
    pub decay: bool,
}

/// Element ranges of one transformer block's parameters (C = n_embd).
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
    pub fc_w: Range<usize>,     // [C, 4C]
    pub fc_b: Range<usize>,     // [4C]
    pub fcproj_w: Range<usize>, // [4C, C]
    pub fcproj_b: Range<usize>, // [C]
}

/// Consecutive parameter tensors updated together (an embedding, a block, the final norm):
/// the unit the optimizer phase is emitted in, so a strategy can stream or shard by group.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamGroup {
    /// Short name, e.g. `h3` (the optimizer op is `adamw.h3`).
    pub name: String,
    /// Indices into [`ParamLayout::tensors`].
    pub tensors: Range<usize>,
}

/// All parameter tensors of a model, in buffer order.
#[derive(Clone, Debug)]
pub struct ParamLayout {
    pub tensors: Vec<ParamTensor>,
    /// The tensors cut into consecutive groups, in order, covering every tensor once.
    pub groups: Vec<ParamGroup>,
    pub wte: Range<usize>, // [V, C], tied with the LM head
    pub wpe: Range<usize>, // [maxT, C]
    pub layers: Vec<LayerParams>,
    pub lnf_w: Range<usize>, // [C]
    pub lnf_b: Range<usize>, // [C]
    /// Total number of elements.
    pub total: usize,
}

struct Cursor {
    tensors: Vec<ParamTensor>,
    at: usize,
}

impl Cursor {
    fn push(&mut self, name: String, shape: &[usize], decay: bool) -> Range<usize> {
        let n: usize = shape.iter().product();
        let range = self.at..self.at + n;
        self.at += n;
        self.tensors.push(ParamTensor {
            name,
            shape: shape.to_vec(),
            range: range.clone(),
            decay,
        });
        range
    }
}

impl ParamLayout {
    pub fn new(spec: &ModelSpec) -> ParamLayout {
        let (v, c, t) = (spec.vocab_size, spec.n_embd, spec.n_positions);
        let mut cur = Cursor {
            tensors: Vec::new(),
            at: 0,
        };
        let mut groups = Vec::with_capacity(spec.n_layer + 2);
        let mut group = |cur: &Cursor, name: String, from: usize| {
            groups.push(ParamGroup {
                name,
                tensors: from..cur.tensors.len(),
            })
        };
        let wte = cur.push("transformer.wte.weight".into(), &[v, c], true);
        let wpe = cur.push("transformer.wpe.weight".into(), &[t, c], true);
        group(&cur, "embed".into(), 0);
        let mut layers = Vec::with_capacity(spec.n_layer);
        for l in 0..spec.n_layer {
            let from = cur.tensors.len();
            let p = |s: &str| format!("transformer.h.{l}.{s}");
            layers.push(LayerParams {
                ln1_w: cur.push(p("ln_1.weight"), &[c], false),
                ln1_b: cur.push(p("ln_1.bias"), &[c], false),
                qkv_w: cur.push(p("attn.c_attn.weight"), &[c, 3 * c], true),
                qkv_b: cur.push(p("attn.c_attn.bias"), &[3 * c], false),
                proj_w: cur.push(p("attn.c_proj.weight"), &[c, c], true),
                proj_b: cur.push(p("attn.c_proj.bias"), &[c], false),
                ln2_w: cur.push(p("ln_2.weight"), &[c], false),
                ln2_b: cur.push(p("ln_2.bias"), &[c], false),
                fc_w: cur.push(p("mlp.c_fc.weight"), &[c, 4 * c], true),
                fc_b: cur.push(p("mlp.c_fc.bias"), &[4 * c], false),
                fcproj_w: cur.push(p("mlp.c_proj.weight"), &[4 * c, c], true),
                fcproj_b: cur.push(p("mlp.c_proj.bias"), &[c], false),
            });
            group(&cur, format!("h{l}"), from);
        }
        let from = cur.tensors.len();
        let lnf_w = cur.push("transformer.ln_f.weight".into(), &[c], false);
        let lnf_b = cur.push("transformer.ln_f.bias".into(), &[c], false);
        group(&cur, "ln_f".into(), from);
        ParamLayout {
            groups,
            tensors: cur.tensors,
            wte,
            wpe,
            layers,
            lnf_w,
            lnf_b,
            total: cur.at,
        }
    }

    /// Whether `other` has the same tensors (names and shapes) in the same order.
    pub fn same_layout(&self, other: &ParamLayout) -> bool {
        self.total == other.total
            && self.tensors.len() == other.tensors.len()
            && self
                .tensors
                .iter()
                .zip(&other.tensors)
                .all(|(a, b)| a.name == b.name && a.shape == b.shape)
    }

    /// Looks a tensor up by its Hugging Face name.
    pub fn get(&self, name: &str) -> Option<&ParamTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// GPT-2 initialisation into `params` (len = total): weights ~ N(0, 0.02), residual output
    /// projections scaled by 1/sqrt(2L) (GPT-2 paper), biases 0, layer-norm weights 1.
    pub fn init(&self, params: &mut [f32], n_layer: usize, seed: u64) {
        assert_eq!(params.len(), self.total);
        let mut rng = crate::util::rng::Rng::new(seed);
        let resid_scale = 1.0 / ((2 * n_layer) as f32).sqrt();
        for t in &self.tensors {
            let dst = &mut params[t.range.clone()];
            let name = t.name.as_str();
            if name.ends_with(".bias") {
                dst.fill(0.0);
            } else if name.contains("ln_") {
                dst.fill(1.0);
            } else {
                let std = if name.ends_with("c_proj.weight") {
                    0.02 * resid_scale
                } else {
                    0.02
                };
                for x in dst.iter_mut() {
                    *x = rng.normal() * std;
                }
            }
        }
    }
}

impl ParamLayout {
    /// Cutting each tensor into blocks of `block` values (its last block partial): the index
    /// of every tensor's first block, and the total number of blocks.
    pub fn block_offsets(&self, block: usize) -> (Vec<usize>, usize) {
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut total = 0;
        for t in &self.tensors {
            offsets.push(total);
            total += t.range.len().div_ceil(block);
        }
        (offsets, total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_contiguous_and_named() {
        let spec = ModelSpec::preset("gpt2-tiny").unwrap();
        let lay = ParamLayout::new(&spec);
        let mut at = 0;
        for t in &lay.tensors {
            assert_eq!(t.range.start, at, "{}", t.name);
            assert_eq!(t.range.len(), t.shape.iter().product::<usize>());
            at = t.range.end;
        }
        assert_eq!(at, lay.total);
        assert_eq!(lay.tensors.len(), 2 + 12 * spec.n_layer + 2);
        assert_eq!(
            lay.get("transformer.h.3.mlp.c_fc.weight").unwrap().shape,
            vec![128, 512]
        );
    }
}
