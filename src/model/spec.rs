//! Model dimensions for every family ([`ModelSpec`]): presets, Hugging Face `config.json` in
//! and out (dispatched on `model_type` to the family's module), validation naming the field.

pub use super::rope::{Llama3Scaling, LongRope, RopeScaling};
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::Path;

/// The names a family's `config.json` gives the generic dimensions (for error messages).
pub struct FieldNames {
    pub vocab: &'static str,
    pub positions: &'static str,
    pub embd: &'static str,
    pub layers: &'static str,
    pub heads: &'static str,
    pub kv_heads: &'static str,
    pub mlp: &'static str,
}

/// A model family memwall can build (its module is named in [`super::family`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// GPT-2: learned positions, pre-LN blocks with biases, tanh-GELU MLP, tied LM head.
    Gpt2,
    /// Llama (Llama 2/3, SmolLM2, TinyLlama): RMSNorm, rotary positions, grouped-query
    /// attention, SwiGLU MLP, Linear layers without biases unless the config asks.
    Llama,
    /// Qwen2/2.5: Llama's architecture with q/k/v biases (none on the output projection).
    Qwen2,
    /// Qwen3 (dense): Llama's architecture with an RMSNorm on each query and key head
    /// (`q_norm`, `k_norm`, weight `[head_dim]`) after the projections and before RoPE, no
    /// biases unless `attention_bias`, and `head_dim` given apart from width / heads
    /// (transformers' `modeling_qwen3.py`, `Qwen3Attention`).
    Qwen3,
    /// Mistral (7B v0.1–v0.3): Llama's architecture (no biases, SwiGLU, GQA) with an
    /// optional sliding attention window (`sliding_window`: each query sees the last
    /// `sliding_window` keys, itself included; transformers' `modeling_mistral.py`,
    /// `MistralModel.forward` masking with `create_sliding_window_causal_mask`).
    Mistral,
    /// Phi-3 and Phi-3.5 (mini): Llama's architecture with q, k and v stored as one
    /// `qkv_proj` and gate and up as one `gate_up_proj` (gate first), no biases, an optional
    /// sliding window, and LongRoPE scaling on the long-context models (transformers'
    /// `modeling_phi3.py`).
    Phi3,
    /// Gemma 3 (text: `gemma3_text`; transformers' `modeling_gemma3.py`, llama.cpp's
    /// `LLM_ARCH_GEMMA3`): Llama's layout with q/k norms as Qwen3's, every RMSNorm's gain
    /// `1 + w` ([`Family::norm_offset`]), a norm after the attention and after the MLP as well
    /// as before them ([`Family::post_norms`]), a GeGLU MLP (tanh GELU), embeddings multiplied
    /// by √C, and sliding-window layers between full-attention ones with their own RoPE base
    /// ([`ModelSpec::local_layers`]). Tied embeddings, no biases.
    Gemma3,
}

/// Gemma 3's interleaved attention: which layers attend within the sliding window
/// (`layer_types`' `"sliding_attention"`, the others `"full_attention"`: the whole prefix)
/// and the RoPE base of those (`rope_local_base_freq`, unscaled; the full layers take the
/// model's [`Position::Rotary`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LocalLayers {
    /// `[L]`: layer l attends within [`ModelSpec::sliding_window`].
    pub sliding: Vec<bool>,
    /// θ of the sliding layers' rotation.
    pub rope_theta: f32,
    /// Whether the sliding layers rotate by `rope_theta`, unscaled (Gemma 3's
    /// `rope_local_base_freq`), instead of as the full layers do (Qwen2's and Qwen3's).
    pub own_rotation: bool,
}

/// How a block normalises its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// Mean and variance, learned scale and bias (GPT-2).
    LayerNorm,
    /// Root mean square, learned scale, no bias (Llama).
    RmsNorm,
}

/// How positions enter the model.
#[derive(Clone, Debug, PartialEq)]
pub enum Position {
    /// A learned embedding per position, added to the token embedding (GPT-2).
    Learned,
    /// Rotary embeddings applied to queries and keys (rotate-half convention), with base
    /// `theta` and a frequency scaling (Llama 3's, LongRoPE) when set.
    Rotary {
        theta: f32,
        scaling: Option<RopeScaling>,
    },
}

/// Which linear layers have biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Biases {
    /// Query, key and value projections.
    pub qkv: bool,
    /// The attention output projection.
    pub attn_out: bool,
    /// The MLP's projections.
    pub mlp: bool,
}

impl Biases {
    pub const ALL: Biases = Biases {
        qkv: true,
        attn_out: true,
        mlp: true,
    };
    pub const NONE: Biases = Biases {
        qkv: false,
        attn_out: false,
        mlp: false,
    };
}

/// Special token ids a model's config names (generation stops at an end token).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    /// `eos_token_id`, which may be a list.
    pub eos: Vec<u32>,
    /// `pad_token_id` where the family's config has a default that must be overridden when
    /// absent (Phi3Config's 32000, outside a smaller vocabulary); `None` elsewhere.
    pub pad: Option<u32>,
}

/// The dimensions and architectural choices of a decoder-only transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Preset name or the config file it came from (for messages only).
    pub name: String,
    /// The family whose module builds it.
    pub family: Family,
    /// V: vocabulary size (GPT-2 BPE: 50257).
    pub vocab_size: usize,
    /// maxT: the longest sequence the model accepts (learned positions: their number).
    pub n_positions: usize,
    /// C: embedding width.
    pub n_embd: usize,
    /// L: number of transformer blocks.
    pub n_layer: usize,
    /// NH: attention heads.
    pub n_head: usize,
    /// NKV: key/value heads (grouped-query attention); `n_head` for multi-head attention.
    pub n_kv_head: usize,
    /// hd: channels per head (C / NH unless the config says otherwise).
    pub head_dim: usize,
    /// Width of the MLP's hidden layer (GPT-2: `n_inner`, 4·C by default).
    pub mlp_hidden: usize,
    pub norm: Norm,
    /// Normalisation epsilon.
    pub norm_eps: f32,
    pub position: Position,
    /// The LM head is the token embedding (stored once).
    pub tied_embeddings: bool,
    pub biases: Biases,
    /// Mistral's `sliding_window`: a query attends to the last this many keys, itself included
    /// (`None`: the whole causal prefix). Emitted into every layer's attention ops
    /// ([`crate::ir::Op::Attention`]'s `window`), which compute only inside it.
    pub sliding_window: Option<usize>,
    /// Gemma 3's sliding and full layers (`None`: every layer has [`Self::sliding_window`],
    /// if any, and the model's rotation).
    pub local_layers: Option<LocalLayers>,
    /// Gemma 3's `query_pre_attn_scalar` where it is not the head size: attention scores are
    /// q·k / √it (Gemma 3 27B's is hidden / heads, 168, with heads of 128). `None`: q·k /
    /// √head_dim. See [`ModelSpec::attention_scale_dim`].
    pub query_pre_attn_scalar: Option<f32>,
    /// Not architecture (ignored by [`ModelSpec::same_dims`]): written back into config.json.
    pub special_tokens: SpecialTokens,
}

/// Largest dimension a config may give (a width, a count, a context length).
const MAX_DIM: usize = 1 << 31;

/// Most parameters a model may have (about 1.1 trillion: 4.4 TB of f32 weights).
const MAX_PARAMS: u128 = 1 << 40;
/// Layers memwall plans at most (planning walks every layer's ops).
const MAX_LAYERS: usize = 1024;

impl ModelSpec {
    /// Names of the built-in presets, every family's.
    pub fn preset_names() -> Vec<&'static str> {
        Family::ALL.iter().flat_map(|f| f.preset_names()).collect()
    }

    /// A built-in preset by name.
    pub fn preset(name: &str) -> Result<ModelSpec> {
        let Some(spec) = Family::ALL.iter().find_map(|f| f.preset(name)) else {
            bail!(
                "unknown model preset '{name}': choose one of {}, or pass a directory or \
                 config.json of a Hugging Face model ({})",
                Self::preset_names().join(", "),
                Family::ALL.map(|f| f.model_type()).join(", ")
            );
        };
        spec.validate()?;
        Ok(spec)
    }

    /// Resolves a `--model` argument: a preset name, a directory holding `config.json`, or a
    /// path to a `config.json`.
    pub fn resolve(arg: &str) -> Result<ModelSpec> {
        let p = Path::new(arg);
        if p.is_dir() {
            Self::from_hf_config_file(&p.join("config.json"))
        } else if p.is_file() {
            if crate::util::sniff::is_gguf(p) {
                bail!(
                    "model '{arg}' is a GGUF file, which --model does not read: train from its \
                     weights with `memwall train --init {arg}`, sample with `memwall sample \
                     --model {arg}`, or convert it once (`memwall convert {arg} --out DIR`) and \
                     pass --model DIR"
                );
            }
            Self::from_hf_config_file(p)
        } else if Self::preset_names().contains(&arg) {
            Self::preset(arg)
        } else if arg.ends_with(".json") || arg.contains('/') {
            bail!(
                "model '{arg}': no such file or directory (expected a preset name, a checkpoint directory or a config.json)"
            )
        } else {
            Self::preset(arg)
        }
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_config_file(path: &Path) -> Result<ModelSpec> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read model config {}", path.display()))?;
        Self::from_hf_config_str(&text, &path.display().to_string())
    }

    /// Parses a Hugging Face config from JSON text, by its `model_type` (GPT-2 when absent);
    /// `source` names it in errors.
    pub fn from_hf_config_str(text: &str, source: &str) -> Result<ModelSpec> {
        let v: Value =
            serde_json::from_str(text).with_context(|| format!("{source}: not valid JSON"))?;
        let Some(obj) = v.as_object() else {
            bail!(
                "{source}: expected a JSON object with the model's fields (n_embd, n_layer, ...)"
            );
        };
        // Gemma 3's multimodal checkpoints (`gemma3`, the 4B and larger): their text model.
        let text_model;
        let obj = match Family::text_of_multimodal(obj, source)? {
            Some(text) => {
                text_model = text;
                &text_model
            }
            None => obj,
        };
        let family = match obj.get("model_type").and_then(Value::as_str) {
            None => Family::Gpt2,
            Some(mt) => match Family::ALL.iter().find(|f| f.model_type() == mt) {
                Some(&f) => f,
                None => bail!(
                    "{source}: field 'model_type' is '{mt}', but memwall trains {}",
                    Family::ALL
                        .map(|f| format!("'{}'", f.model_type()))
                        .join(", ")
                ),
            },
        };
        let spec = family.from_hf_config(obj, source)?;
        spec.validate()
            .with_context(|| format!("{source}: inconsistent model config"))?;
        Ok(spec)
    }

    /// The Hugging Face `config.json` for this model (loadable by transformers).
    pub fn to_hf_config(&self) -> Value {
        self.family.to_hf_config(self)
    }

    /// Checks that the dimensions describe a model we can build.
    pub fn validate(&self) -> Result<()> {
        let f = self.family.field_names();
        // Absurd sizes first: products of them would overflow (and a default derived from
        // one, GPT-2's 4·C MLP, wrap to 0).
        for (field, v) in [
            (f.positions, self.n_positions),
            (f.embd, self.n_embd),
            (f.layers, self.n_layer),
            (f.heads, self.n_head),
            (f.kv_heads, self.n_kv_head),
            (f.mlp, self.mlp_hidden),
            ("head_dim", self.head_dim),
        ] {
            if v > MAX_DIM {
                bail!("field '{field}' is {v}; no model has more than 2^31: the config is wrong");
            }
        }
        if self.vocab_size > u32::MAX as usize {
            bail!("field '{}' ({}) exceeds 2^32", f.vocab, self.vocab_size);
        }
        let params = self.parameter_bound();
        if params > MAX_PARAMS {
            bail!(
                "these dimensions make about {params} parameters, more than memwall plans \
                 (2^40); check the fields '{}', '{}', '{}' and '{}'",
                f.vocab,
                f.embd,
                f.layers,
                f.mlp
            );
        }
        if self.n_layer > MAX_LAYERS {
            bail!(
                "field '{}' is {}, more layers than memwall plans ({MAX_LAYERS}; the deepest \
                 published models have under 130)",
                f.layers,
                self.n_layer
            );
        }
        for (field, v) in [
            (f.vocab, self.vocab_size),
            (f.positions, self.n_positions),
            (f.embd, self.n_embd),
            (f.layers, self.n_layer),
            (f.heads, self.n_head),
            (f.kv_heads, self.n_kv_head),
            (f.mlp, self.mlp_hidden),
        ] {
            if v == 0 {
                bail!("field '{field}' is 0; it must be at least 1");
            }
        }
        if self.family == Family::Gpt2 && !self.n_embd.is_multiple_of(self.n_head) {
            bail!(
                "field '{}' ({}) is not divisible by '{}' ({}); each head needs {} / {} channels",
                f.embd,
                self.n_embd,
                f.heads,
                self.n_head,
                f.embd,
                f.heads
            );
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            bail!(
                "field '{}' ({}) is not divisible by '{}' ({}); each key/value head serves a \
                 whole group of query heads",
                f.heads,
                self.n_head,
                f.kv_heads,
                self.n_kv_head
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            bail!(
                "head size {} (width / heads, or 'head_dim') must be even and at least 2",
                self.head_dim
            );
        }
        self.family.validate(self)
    }

    /// An upper bound of the parameter count from the dimensions alone, without overflow
    /// (every weight, bias and norm of either family, learned positions, an untied head).
    fn parameter_bound(&self) -> u128 {
        let [v, p, c, l, h, kv, hd, m] = [
            self.vocab_size,
            self.n_positions,
            self.n_embd,
            self.n_layer,
            self.n_head,
            self.n_kv_head,
            self.head_dim,
            self.mlp_hidden,
        ]
        .map(|x| x as u128);
        let qkv = (h + 2 * kv) * hd;
        let per_layer = c * qkv + qkv + h * hd * c + c + 3 * c * m + 2 * m + 4 * c + 2 * hd;
        2 * v * c + p * c + l * per_layer + 2 * c
    }

    /// Checks a sequence length against the model; names the flag in the error.
    pub fn check_seq(&self, seq: usize) -> Result<()> {
        if seq == 0 {
            bail!("--seq must be at least 1");
        }
        if seq > self.n_positions {
            bail!(
                "--seq {seq} is longer than the model's {} ({}); use --seq {} or less",
                self.family.field_names().positions,
                self.n_positions,
                self.n_positions
            );
        }
        Ok(())
    }

    /// The longest sequence memwall computes for this model: its positions (a sliding window
    /// is computed as such, so it does not bound the sequence).
    pub fn max_seq(&self) -> usize {
        self.n_positions
    }

    /// Layer `l`'s attention window: the model's sliding window, except on Gemma 3's full
    /// layers (`None`: the whole causal prefix).
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        match &self.local_layers {
            Some(ll) if !ll.sliding[l] => None,
            _ => self.sliding_window,
        }
    }

    /// The widest attention window of any layer (`None`: some layer sees the whole prefix):
    /// what one attention workspace, shared by every layer, must hold.
    pub fn widest_window(&self) -> Option<usize> {
        (0..self.n_layer)
            .map(|l| self.layer_window(l))
            .try_fold(0, |w, l| l.map(|l| w.max(l)))
    }

    /// Layer `l`'s rotation: θ and the scaling (Gemma 3's sliding layers: their own θ,
    /// unscaled). `None` for learned positions.
    pub fn layer_rope(&self, l: usize) -> Option<(f32, Option<&RopeScaling>)> {
        let Position::Rotary { theta, scaling } = &self.position else {
            return None;
        };
        Some(match &self.local_layers {
            Some(ll) if ll.sliding[l] && ll.own_rotation => (ll.rope_theta, None),
            _ => (*theta, scaling.as_ref()),
        })
    }

    /// The length beyond which the rotary frequencies change (LongRoPE's pretraining
    /// context: longer sequences use its long factors), if any.
    pub fn rope_switch(&self) -> Option<usize> {
        match &self.position {
            Position::Rotary {
                scaling: Some(RopeScaling::LongRope(l)),
                ..
            } => Some(l.original_max_position_embeddings),
            _ => None,
        }
    }

    /// Checks that `--tp tensor` ranks can each hold an equal part of every layer: the
    /// attention heads, key/value heads and MLP channels divide among them (Megatron's
    /// layout; GQA is split by key/value head groups). The error names each number that
    /// does not divide and the sizes that would.
    pub fn check_tensor_split(&self, tensor: usize) -> Result<()> {
        if tensor == 0 {
            bail!("--tp must be at least 1");
        }
        let f = self.family.field_names();
        let mut counts = vec![(f.heads, self.n_head)];
        if f.kv_heads != f.heads {
            counts.push((f.kv_heads, self.n_kv_head));
        }
        counts.push((f.mlp, self.mlp_hidden));
        let bad: Vec<String> = counts
            .iter()
            .filter(|(_, n)| n % tensor != 0)
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        if !bad.is_empty() {
            let fits: Vec<String> = (2..=self.n_head)
                .filter(|t| counts.iter().all(|(_, n)| n % t == 0))
                .map(|t| t.to_string())
                .collect();
            bail!(
                "--tp {tensor}: each tensor rank holds an equal part of every layer, but {} \
                 do not divide by {tensor}; {}",
                bad.join(" and "),
                match fits.is_empty() {
                    true => "this model cannot be cut: use --tp 1".to_string(),
                    false => format!("use --tp 1 or {}", fits.join(", ")),
                }
            );
        }
        if self.vocab_size < tensor {
            bail!(
                "--tp {tensor}: each tensor rank holds rows of the vocabulary, but {} {} has \
                 fewer; use --tp {} or less",
                f.vocab,
                self.vocab_size,
                self.vocab_size
            );
        }
        Ok(())
    }

    /// Head size hd.
    pub fn head_size(&self) -> usize {
        self.head_dim
    }

    /// True when two specs describe the same architecture (names and special tokens may
    /// differ).
    pub fn same_dims(&self, o: &ModelSpec) -> bool {
        let bare = |s: &ModelSpec| ModelSpec {
            name: String::new(),
            special_tokens: SpecialTokens::default(),
            ..s.clone()
        };
        bare(self) == bare(o)
    }

    /// What attention scores are divided by the square root of ([`crate::ir::Op::Attention`]'s
    /// `scale_dim`): the head size, or Gemma 3's `query_pre_attn_scalar`.
    pub fn attention_scale_dim(&self) -> f32 {
        self.query_pre_attn_scalar.unwrap_or(self.head_dim as f32)
    }

    /// One-line description, e.g. `gpt2 (124.4M params: L=12 C=768 NH=12 V=50257 maxT=1024)`
    /// (grouped-query models also show `NKV`, and `hd` when it is not C / NH).
    pub fn describe(&self) -> String {
        let mut heads = format!("NH={}", self.n_head);
        if self.n_kv_head != self.n_head {
            heads += &format!(" NKV={}", self.n_kv_head);
        }
        if self.head_dim * self.n_head != self.n_embd {
            heads += &format!(" hd={}", self.head_dim);
        }
        format!(
            "{} ({:.1}M params: L={} C={} {heads} V={} maxT={})",
            self.name,
            self.num_params() as f64 / 1e6,
            self.n_layer,
            self.n_embd,
            self.vocab_size,
            self.n_positions
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_has_124m_params() {
        assert_eq!(ModelSpec::preset("gpt2").unwrap().num_params(), 124_439_808);
    }

    #[test]
    fn hf_config_round_trips() {
        let s = ModelSpec::preset("gpt2-medium").unwrap();
        let back = ModelSpec::from_hf_config_str(&s.to_hf_config().to_string(), "x").unwrap();
        assert!(s.same_dims(&back));
        let mut wide = s.clone();
        wide.mlp_hidden = 3 * s.n_embd;
        let back = ModelSpec::from_hf_config_str(&wide.to_hf_config().to_string(), "x").unwrap();
        assert!(wide.same_dims(&back) && !s.same_dims(&back));
    }

    #[test]
    fn bad_configs_name_the_field() {
        let e = |t: &str| {
            format!(
                "{:#}",
                ModelSpec::from_hf_config_str(t, "cfg.json").unwrap_err()
            )
        };
        assert!(e(r#"{"n_embd": 100, "n_layer": 2, "n_head": 3}"#).contains("n_embd"));
        assert!(e(r#"{"n_embd": 96, "n_layer": 0, "n_head": 3}"#).contains("n_layer"));
        assert!(e(r#"{"n_layer": 2, "n_head": 3}"#).contains("missing field 'n_embd'"));
        assert!(e(r#"{"n_embd": "wide", "n_layer": 2, "n_head": 3}"#).contains("'n_embd'"));
        assert!(
            e(r#"{"n_embd": 96, "n_layer": 2, "n_head": 3, "n_inner": 0}"#).contains("n_inner")
        );
        assert!(e("{not json").contains("not valid JSON"));
        assert!(
            e(r#"{"model_type": "bert", "n_embd": 96, "n_layer": 2, "n_head": 3}"#)
                .contains("model_type")
        );
        let unknown = format!("{:#}", ModelSpec::resolve("gpt5").unwrap_err());
        assert!(unknown.contains("unknown model preset 'gpt5'") && unknown.contains("gpt2-tiny"));
        let s = ModelSpec::preset("gpt2-tiny").unwrap();
        assert!(format!("{:#}", s.check_seq(257).unwrap_err()).contains("--seq 257"));
    }

    #[test]
    fn absurd_dimensions_are_refused_not_overflowed() {
        let e = |t: &str| {
            format!(
                "{:#}",
                ModelSpec::from_hf_config_str(t, "cfg.json").unwrap_err()
            )
        };
        let llama = |extra: &str| {
            format!(
                r#"{{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 100{extra}}}"#
            )
        };
        // Each once made the planner allocate petabytes or index past a range.
        let x = e(&llama(r#", "num_hidden_layers": 1099511627776"#));
        assert!(
            x.contains("cfg.json") && x.contains("'num_hidden_layers' is 1099511627776"),
            "{x}"
        );
        let x =
            e(r#"{"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 18446744073709551615}"#);
        assert!(x.contains("'n_positions' is 18446744073709551615"), "{x}");
        // 4·C would wrap to 0 and blame n_inner.
        let x = e(r#"{"n_embd": 4611686018427387904, "n_layer": 2, "n_head": 4}"#);
        assert!(x.contains("'n_embd' is 4611686018427387904"), "{x}");
        // Each size plausible, the product not.
        let x = e(&llama(
            r#", "hidden_size": 65536, "num_attention_heads": 512, "num_hidden_layers": 100000"#,
        ));
        assert!(x.contains("parameters, more than memwall plans"), "{x}");
        // The largest preset passes.
        ModelSpec::preset("llama-3-8b").unwrap();
    }

    #[test]
    fn a_gguf_file_as_model_says_how_to_use_it() {
        let dir = tempfile::tempdir().unwrap();
        // By its magic bytes (it was read as config.json: "not valid JSON").
        let f = dir.path().join("weights.bin");
        std::fs::write(&f, b"GGUF\x03\x00\x00\x00").unwrap();
        let e = format!("{:#}", ModelSpec::resolve(f.to_str().unwrap()).unwrap_err());
        assert!(
            e.contains("is a GGUF file") && e.contains("--init") && !e.contains("JSON"),
            "{e}"
        );
        let g = dir.path().join("m.gguf");
        std::fs::write(&g, "{}").unwrap();
        let e = format!("{:#}", ModelSpec::resolve(g.to_str().unwrap()).unwrap_err());
        assert!(e.contains("memwall convert"), "{e}");
    }
}
