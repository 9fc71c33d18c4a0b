//! The Llama family (Llama 2/3, SmolLM2, TinyLlama) and its siblings Qwen2 (q/k/v biases),
//! Qwen3 (an RMSNorm on each query and key head before RoPE, [`Family::qk_norm`]) and Mistral
//! (Llama's layout, no biases, an optional sliding window: [`ModelSpec::sliding_window`]): pre-norm
//! blocks with RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP,
//! `torch.nn.Linear` weights (`[out, in]`), a tied or separate LM head. Presets,
//! `config.json` as `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` /
//! `MistralForCausalLM` read it, the
//! parameter inventory ([`params`]) and the emission of a step (`emit`).

pub(crate) mod emit;
pub mod params;

use super::ParamLayout;
use super::rope::{Llama3Scaling, LongRope, RopeScaling};
use super::spec::{
    Biases, Family, FieldNames, LocalLayers, ModelSpec, Norm, Position, SpecialTokens,
};
use anyhow::{Context, Result, bail};
use params::LM_HEAD;
use serde_json::{Map, Value, json};

pub use params::{LayerParams, LlamaParams};

pub(super) const FIELDS: FieldNames = FieldNames {
    vocab: "vocab_size",
    positions: "max_position_embeddings",
    embd: "hidden_size",
    layers: "num_hidden_layers",
    heads: "num_attention_heads",
    kv_heads: "num_key_value_heads",
    mlp: "intermediate_size",
};

/// A preset's dimensions.
struct Preset {
    name: &'static str,
    family: Family,
    vocab: usize,
    positions: usize,
    embd: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    mlp: usize,
    eps: f32,
    theta: f32,
    /// Llama 3.2's scaling (factor 32, low 1, high 4, original 8192) when set.
    llama32_scaling: bool,
    tied: bool,
    bos: u32,
    eos: u32,
    /// `sliding_window` (Phi-3-mini's 2047).
    window: Option<usize>,
}

/// Presets, from the models' published `config.json` files (`llama-tiny` is memwall's own,
/// for tests: a few million parameters with GPT-2's vocabulary, so GPT-2-tokenized data fits).
/// Qwen3's are the instruct models' (`Qwen/Qwen3-0.6B` … `Qwen/Qwen3-8B`: `head_dim` 128 at
/// every width, θ 10⁶, 40960 positions, eos `<|im_end|>`; tied embeddings but on the 8B).
const PRESETS: &[Preset] = &[
    Preset {
        name: "llama-tiny",
        family: Family::Llama,
        vocab: 50257,
        positions: 256,
        embd: 128,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        mlp: 352,
        eps: 1e-5,
        theta: 10_000.0,
        llama32_scaling: false,
        tied: true,
        bos: 50256,
        eos: 50256,
        window: None,
    },
    Preset {
        name: "smollm2-135m",
        family: Family::Llama,
        vocab: 49152,
        positions: 8192,
        embd: 576,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        mlp: 1536,
        eps: 1e-5,
        theta: 100_000.0,
        llama32_scaling: false,
        tied: true,
        bos: 0,
        eos: 0,
        window: None,
    },
    Preset {
        name: "smollm2-360m",
        family: Family::Llama,
        vocab: 49152,
        positions: 8192,
        embd: 960,
        layers: 32,
        heads: 15,
        kv_heads: 5,
        head_dim: 64,
        mlp: 2560,
        eps: 1e-5,
        theta: 100_000.0,
        llama32_scaling: false,
        tied: true,
        bos: 0,
        eos: 0,
        window: None,
    },
    Preset {
        name: "qwen2.5-0.5b",
        family: Family::Qwen2,
        vocab: 151936,
        positions: 32768,
        embd: 896,
        layers: 24,
        heads: 14,
        kv_heads: 2,
        head_dim: 64,
        mlp: 4864,
        eps: 1e-6,
        theta: 1_000_000.0,
        llama32_scaling: false,
        tied: true,
        bos: 151643,
        eos: 151643,
        window: None,
    },
    Preset {
        name: "qwen3-0.6b",
        family: Family::Qwen3,
        vocab: 151936,
        positions: 40960,
        embd: 1024,
        layers: 28,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        mlp: 3072,
        eps: 1e-6,
        theta: 1_000_000.0,
        llama32_scaling: false,
        tied: true,
        bos: 151643,
        eos: 151645,
        window: None,
    },
    Preset {
        name: "qwen3-1.7b",
        family: Family::Qwen3,
        vocab: 151936,
        positions: 40960,
        embd: 2048,
        layers: 28,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        mlp: 6144,
        eps: 1e-6,
        theta: 1_000_000.0,
        llama32_scaling: false,
        tied: true,
        bos: 151643,
        eos: 151645,
        window: None,
    },
    Preset {
        name: "qwen3-4b",
        family: Family::Qwen3,
        vocab: 151936,
        positions: 40960,
        embd: 2560,
        layers: 36,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        mlp: 9728,
        eps: 1e-6,
        theta: 1_000_000.0,
        llama32_scaling: false,
        tied: true,
        bos: 151643,
        eos: 151645,
        window: None,
    },
    Preset {
        name: "qwen3-8b",
        family: Family::Qwen3,
        vocab: 151936,
        positions: 40960,
        embd: 4096,
        layers: 36,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        mlp: 12288,
        eps: 1e-6,
        theta: 1_000_000.0,
        llama32_scaling: false,
        tied: false,
        bos: 151643,
        eos: 151645,
        window: None,
    },
    // Mistral-7B-v0.3 (mistralai/Mistral-7B-v0.3's config.json: vocab 32768, θ 10⁶, 32768
    // positions, rms_norm_eps 1e-5, sliding_window null, untied).
    Preset {
        name: "mistral-7b",
        family: Family::Mistral,
        vocab: 32768,
        positions: 32768,
        embd: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        mlp: 14336,
        eps: 1e-5,
        theta: 1_000_000.0,
        llama32_scaling: false,
        tied: false,
        bos: 1,
        eos: 2,
        window: None,
    },
    Preset {
        name: "llama-3.2-1b",
        family: Family::Llama,
        vocab: 128256,
        positions: 131072,
        embd: 2048,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        mlp: 8192,
        eps: 1e-5,
        theta: 500_000.0,
        llama32_scaling: true,
        tied: true,
        bos: 128000,
        eos: 128001,
        window: None,
    },
    Preset {
        name: "tinyllama-1.1b",
        family: Family::Llama,
        vocab: 32000,
        positions: 2048,
        embd: 2048,
        layers: 22,
        heads: 32,
        kv_heads: 4,
        head_dim: 64,
        mlp: 5632,
        eps: 1e-5,
        theta: 10_000.0,
        llama32_scaling: false,
        tied: false,
        bos: 1,
        eos: 2,
        window: None,
    },
    Preset {
        name: "llama-3.2-3b",
        family: Family::Llama,
        vocab: 128256,
        positions: 131072,
        embd: 3072,
        layers: 28,
        heads: 24,
        kv_heads: 8,
        head_dim: 128,
        mlp: 8192,
        eps: 1e-5,
        theta: 500_000.0,
        llama32_scaling: true,
        tied: true,
        bos: 128000,
        eos: 128001,
        window: None,
    },
    Preset {
        name: "llama-2-7b",
        family: Family::Llama,
        vocab: 32000,
        positions: 4096,
        embd: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        mlp: 11008,
        eps: 1e-5,
        theta: 10_000.0,
        llama32_scaling: false,
        tied: false,
        bos: 1,
        eos: 2,
        window: None,
    },
    Preset {
        name: "llama-3-8b",
        family: Family::Llama,
        vocab: 128256,
        positions: 8192,
        embd: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        mlp: 14336,
        eps: 1e-5,
        theta: 500_000.0,
        llama32_scaling: false,
        tied: false,
        bos: 128000,
        eos: 128001,
        window: None,
    },
    Preset {
        name: "llama-3-70b",
        family: Family::Llama,
        vocab: 128256,
        positions: 8192,
        embd: 8192,
        layers: 80,
        heads: 64,
        kv_heads: 8,
        head_dim: 128,
        mlp: 28672,
        eps: 1e-5,
        theta: 500_000.0,
        llama32_scaling: false,
        tied: false,
        bos: 128000,
        eos: 128001,
        window: None,
    },
    // microsoft/Phi-3-mini-4k-instruct: 32064 tokens (32000 and the chat's specials), 32 heads
    // of 96 without grouping, a sliding window of 2047, eos <|endoftext|> 32000.
    Preset {
        name: "phi-3-mini",
        family: Family::Phi3,
        vocab: 32064,
        positions: 4096,
        embd: 3072,
        layers: 32,
        heads: 32,
        kv_heads: 32,
        head_dim: 96,
        mlp: 8192,
        eps: 1e-5,
        theta: 10_000.0,
        llama32_scaling: false,
        tied: false,
        bos: 1,
        eos: 32000,
        window: Some(2047),
    },
];

/// Llama 3.2's rope scaling.
const LLAMA32_SCALING: Llama3Scaling = Llama3Scaling {
    factor: 32.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 8192,
};

/// The biases a family's linear layers have (`attention_bias` / `mlp_bias` for Llama).
fn biases(family: Family, attention_bias: bool, mlp_bias: bool) -> Biases {
    match family {
        // Qwen3: `attention_bias` puts biases on q, k, v and o alike; the MLP has none
        // (`Qwen3Attention`, `Qwen3MLP` in transformers' modeling_qwen3.py).
        Family::Qwen3 => Biases {
            qkv: attention_bias,
            attn_out: attention_bias,
            mlp: false,
        },
        // Mistral, Phi-3: no bias anywhere, whatever the config says (`MistralAttention`,
        // `MistralMLP`, `Phi3Attention` and `Phi3MLP` build every Linear with bias=False).
        Family::Mistral | Family::Phi3 => Biases::NONE,
        // Qwen2: q/k/v biases always, none on o_proj, none in the MLP.
        Family::Qwen2 => Biases {
            qkv: true,
            attn_out: false,
            mlp: false,
        },
        _ => Biases {
            qkv: attention_bias,
            attn_out: attention_bias,
            mlp: mlp_bias,
        },
    }
}

fn from_preset(p: &Preset) -> ModelSpec {
    ModelSpec {
        name: p.name.to_string(),
        family: p.family,
        vocab_size: p.vocab,
        n_positions: p.positions,
        n_embd: p.embd,
        n_layer: p.layers,
        n_head: p.heads,
        n_kv_head: p.kv_heads,
        head_dim: p.head_dim,
        mlp_hidden: p.mlp,
        norm: Norm::RmsNorm,
        norm_eps: p.eps,
        position: Position::Rotary {
            theta: p.theta,
            scaling: p
                .llama32_scaling
                .then_some(RopeScaling::Llama3(LLAMA32_SCALING)),
        },
        tied_embeddings: p.tied,
        biases: biases(p.family, false, false),
        sliding_window: p.window,
        local_layers: None,
        query_pre_attn_scalar: None,
        special_tokens: SpecialTokens {
            bos: Some(p.bos),
            eos: vec![p.eos],
            // Phi-3's released configs: the eos, <|endoftext|>.
            pad: (p.family == Family::Phi3).then_some(p.eos),
        },
    }
}

pub(super) fn preset_names(family: Family) -> Vec<&'static str> {
    PRESETS
        .iter()
        .filter(|p| p.family == family)
        .map(|p| p.name)
        .collect()
}

pub(super) fn preset(family: Family, name: &str) -> Option<ModelSpec> {
    PRESETS
        .iter()
        .find(|p| p.family == family && p.name == name)
        .map(from_preset)
}

/// Reads a `config.json` of `model_type` `llama`, `qwen2`, `qwen3` or `mistral`.
pub(super) fn from_hf_config(
    family: Family,
    obj: &Map<String, Value>,
    source: &str,
) -> Result<ModelSpec> {
    let f = Fields { obj, source };
    let field = |key: &str| f.get(key);
    let uint = |key: &str, default: Option<usize>| f.uint(key, default);
    let float = |key: &str, default: f64| f.float(key, default);
    let flag = |key: &str, default: bool| f.flag(key, default);
    if let Some(act) = field("hidden_act")
        && act.as_str() != Some("silu")
    {
        bail!("{source}: field 'hidden_act' is {act}; memwall's Llama MLP is SwiGLU (\"silu\")");
    }
    let qwen = matches!(family, Family::Qwen2 | Family::Qwen3);
    // Dropout memwall does not apply (Phi-3's residual and embedding dropout among them):
    // 0, or absent, only.
    for key in ["attention_dropout", "resid_pdrop", "embd_pdrop"] {
        if let Some(x) = field(key)
            && x.as_f64() != Some(0.0)
        {
            bail!(
                "{source}: field '{key}' is {x}; memwall trains without dropout there (set it \
                 to 0.0; for adapters, --lora-dropout)"
            );
        }
    }
    let n_layer = uint("num_hidden_layers", None)?;
    let kinds = layer_kinds(field("layer_types"), n_layer, source)?;
    // `sliding_window` where the family reads one: `default` when absent, none when null.
    let window = |default: Option<usize>| -> Result<Option<usize>> {
        match obj.get("sliding_window") {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(x) => match x.as_u64() {
                Some(w) if w > 0 => Ok(Some(w as usize)),
                _ => bail!(
                    "{source}: field 'sliding_window' must be a positive integer or null, found {x}"
                ),
            },
        }
    };
    // Qwen2's and Qwen3's sliding layers (configuration_qwen2.py, configuration_qwen3.py):
    // only with `use_sliding_window` and a window (default 4096), the layers `layer_types`
    // names "sliding_attention" (by default those from `max_window_layers` on); otherwise
    // every layer sees the whole prefix, whatever the other fields say. A window no layer
    // has is none.
    let (qwen_window, sliding) = match qwen && flag("use_sliding_window", false)? {
        false => (None, None),
        true => {
            let w = window(Some(4096))?;
            let sliding: Vec<bool> = match &kinds {
                Some(k) => k.clone(),
                None => {
                    let first = uint("max_window_layers", Some(28))?;
                    (0..n_layer).map(|l| l >= first).collect()
                }
            };
            let sliding = Some(sliding).filter(|s| w.is_some() && s.contains(&true));
            (w.filter(|_| sliding.is_some()), sliding)
        }
    };
    if !qwen && kinds.as_ref().is_some_and(|k| k.contains(&true)) {
        bail!(
            "{source}: field 'layer_types' lists \"sliding_attention\" layers; memwall's {} \
             layers all attend alike (list \"full_attention\" for every layer, or remove \
             the field)",
            family.model_type()
        );
    }
    let c = uint("hidden_size", None)?;
    let nh = uint("num_attention_heads", None)?;
    // Qwen3Config's defaults (configuration_qwen3.py): 32 key/value heads and head_dim 128,
    // whatever the width; MistralConfig's (configuration_mistral.py): 8 key/value heads;
    // Llama and Qwen2 derive them from the heads and the width.
    // Phi3Config's: as many key/value heads as heads.
    let (kv_default, hd_default) = match family {
        Family::Qwen3 => (32, 128),
        Family::Mistral => (8, c.checked_div(nh).unwrap_or(0)),
        _ => (nh, c.checked_div(nh).unwrap_or(0)),
    };
    let nkv = uint("num_key_value_heads", Some(kv_default))?;
    if family != Family::Qwen3 && nh > 0 && field("head_dim").is_none() && !c.is_multiple_of(nh) {
        bail!(
            "{source}: field 'hidden_size' ({c}) is not divisible by 'num_attention_heads' \
             ({nh}), and no 'head_dim' is given; each head needs hidden_size / heads channels"
        );
    }
    let head_dim = uint("head_dim", Some(hd_default))?;
    // The configs' defaults where the Llama path's differ: MistralConfig's 4096·32
    // positions, Phi3Config's 4096.
    let positions_default = match family {
        Family::Mistral => 4096 * 32,
        Family::Phi3 => 4096,
        _ => 2048,
    };
    let n_positions = uint("max_position_embeddings", Some(positions_default))?;
    let (theta, scaling) = rope(family, obj, source, head_dim, n_positions)?;
    let eos = f.token_ids("eos_token_id")?.unwrap_or_default();
    let bos = field("bos_token_id")
        .map(|x| token_id(x, "bos_token_id", source))
        .transpose()?;
    // Phi3Config pads with 32000 when the field is absent; written back as read (null too).
    let pad = match family {
        Family::Phi3 => match obj.get("pad_token_id") {
            None => Some(32000),
            Some(Value::Null) => None,
            Some(x) => Some(token_id(x, "pad_token_id", source)?),
        },
        _ => None,
    };
    // Mistral's and Phi-3's one window for every layer: MistralConfig's default is 4096
    // when the field is absent, Phi3Config's none (configuration_mistral.py,
    // configuration_phi3.py); Qwen's as read above. The other families here have none.
    let sliding_window = match family {
        Family::Qwen2 | Family::Qwen3 => qwen_window,
        Family::Mistral => window(Some(4096))?,
        Family::Phi3 => window(None)?,
        _ => None,
    };
    Ok(ModelSpec {
        name: source.to_string(),
        family,
        vocab_size: uint("vocab_size", None)?,
        n_positions,
        n_embd: c,
        n_layer,
        n_head: nh,
        n_kv_head: nkv,
        head_dim,
        mlp_hidden: uint("intermediate_size", None)?,
        norm: Norm::RmsNorm,
        norm_eps: float("rms_norm_eps", 1e-6)? as f32,
        position: Position::Rotary { theta, scaling },
        tied_embeddings: flag("tie_word_embeddings", false)?,
        biases: biases(
            family,
            flag("attention_bias", false)?,
            flag("mlp_bias", false)?,
        ),
        sliding_window,
        local_layers: sliding.map(|sliding| LocalLayers {
            sliding,
            rope_theta: theta,
            own_rotation: false,
        }),
        query_pre_attn_scalar: None,
        special_tokens: SpecialTokens { bos, eos, pad },
    })
}

/// `layer_types` (transformers' list of each layer's attention), read: whether each layer is
/// a "sliding_attention" one (else "full_attention"); `None` when absent.
fn layer_kinds(types: Option<&Value>, n_layer: usize, source: &str) -> Result<Option<Vec<bool>>> {
    let Some(types) = types else {
        return Ok(None);
    };
    let kinds = (types.as_array())
        .filter(|a| a.len() == n_layer)
        .and_then(|a| {
            a.iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Some(false),
                    Some("sliding_attention") => Some(true),
                    _ => None,
                })
                .collect::<Option<Vec<bool>>>()
        });
    match kinds {
        Some(k) => Ok(Some(k)),
        None => bail!(
            "{source}: field 'layer_types' is {types}; expected one of \"full_attention\" or \
             \"sliding_attention\" for each of the {n_layer} layers"
        ),
    }
}

/// A `config.json` object's fields, read with errors naming the file and the field (a null
/// field is an absent one).
pub(super) struct Fields<'a> {
    pub obj: &'a Map<String, Value>,
    /// The file, for errors.
    pub source: &'a str,
}

impl Fields<'_> {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// A count; `default` when absent (`None`: required).
    pub fn uint(&self, key: &str, default: Option<usize>) -> Result<usize> {
        let source = self.source;
        match self.get(key) {
            None => default.with_context(|| format!("{source}: missing field '{key}'")),
            Some(x) => match x.as_u64() {
                Some(n) => Ok(n as usize),
                None => bail!("{source}: field '{key}' must be a non-negative integer, found {x}"),
            },
        }
    }

    /// A positive number; `default` when absent.
    pub fn float(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => match x.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => Ok(f),
                _ => bail!(
                    "{}: field '{key}' must be a positive number, found {x}",
                    self.source
                ),
            },
        }
    }

    pub fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(x) => bail!(
                "{}: field '{key}' must be true or false, found {x}",
                self.source
            ),
        }
    }

    /// A token id or a list of them (`eos_token_id`), `None` when absent.
    pub fn token_ids(&self, key: &str) -> Result<Option<Vec<u32>>> {
        Ok(match self.get(key) {
            None => None,
            Some(Value::Array(a)) => Some(
                a.iter()
                    .map(|x| token_id(x, key, self.source))
                    .collect::<Result<_>>()?,
            ),
            Some(x) => Some(vec![token_id(x, key, self.source)?]),
        })
    }
}

pub(super) fn token_id(x: &Value, key: &str, source: &str) -> Result<u32> {
    x.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .with_context(|| {
            format!("{source}: field '{key}' must be a token id (or a list of them), found {x}")
        })
}

/// θ and the scaling, from `rope_theta` / `rope_scaling` or the newer `rope_parameters`
/// (`head_dim` and the context `positions` check and complete LongRoPE's).
fn rope(
    family: Family,
    obj: &Map<String, Value>,
    source: &str,
    head_dim: usize,
    positions: usize,
) -> Result<(f32, Option<RopeScaling>)> {
    let params = obj.get("rope_parameters").filter(|v| !v.is_null());
    let (scaling_key, scaling) = match params {
        Some(p) => ("rope_parameters", Some(p)),
        None => (
            "rope_scaling",
            obj.get("rope_scaling").filter(|v| !v.is_null()),
        ),
    };
    let theta_value = params
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| obj.get("rope_theta"))
        .filter(|v| !v.is_null());
    let theta = match theta_value {
        None => 10_000.0,
        Some(x) => match x.as_f64() {
            Some(t) if t > 1.0 && t.is_finite() => t as f32,
            _ => bail!("{source}: field 'rope_theta' must be a number above 1, found {x}"),
        },
    };
    // Rotating a fraction of each head (Phi-4-mini's 0.75) is not implemented.
    let partial = params
        .and_then(|p| p.get("partial_rotary_factor"))
        .or_else(|| obj.get("partial_rotary_factor"))
        .filter(|v| !v.is_null());
    if let Some(x) = partial
        && x.as_f64() != Some(1.0)
    {
        bail!(
            "{source}: field 'partial_rotary_factor' is {x}; memwall rotates whole heads (1.0) \
             only"
        );
    }
    let Some(s) = scaling else {
        return Ok((theta, None));
    };
    let Some(s) = s.as_object() else {
        bail!("{source}: field '{scaling_key}' must be an object, found {s}");
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |k: &str| -> Result<Option<f64>> {
        match s.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(x) => match x.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => Ok(Some(f)),
                _ => bail!(
                    "{source}: field '{scaling_key}.{k}' must be a positive number, found {x}"
                ),
            },
        }
    };
    let need = |k: &str| -> Result<f64> {
        num(k)?.with_context(|| {
            format!("{source}: field '{scaling_key}.{k}' is missing (rope_type {kind})")
        })
    };
    match kind {
        "default" => Ok((theta, None)),
        "llama3" => {
            let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
            if high <= low {
                bail!(
                    "{source}: '{scaling_key}': high_freq_factor ({high}) must exceed low_freq_factor ({low})"
                );
            }
            Ok((
                theta,
                Some(RopeScaling::Llama3(Llama3Scaling {
                    factor: need("factor")? as f32,
                    low_freq_factor: low as f32,
                    high_freq_factor: high as f32,
                    original_max_position_embeddings: need("original_max_position_embeddings")?
                        as usize,
                })),
            ))
        }
        // Phi3Config reads its older names `su` and `yarn` as `longrope`
        // (configuration_phi3.py); elsewhere `yarn` is another scaling.
        "su" | "yarn" if family == Family::Phi3 => Ok((
            theta,
            Some(longrope(s, source, scaling_key, head_dim, positions, obj)?),
        )),
        "longrope" => Ok((
            theta,
            Some(longrope(s, source, scaling_key, head_dim, positions, obj)?),
        )),
        other => bail!(
            "{source}: field '{scaling_key}' has rope_type '{other}'; memwall supports 'default', \
             'llama3' and 'longrope'"
        ),
    }
}

/// LongRoPE's parameters as transformers' `_compute_longrope_parameters` reads them: the
/// factor lists (`[hd/2]` each), the pretraining context (in the scaling object or at the
/// config's top level, as Phi-3's configs give it), and `attention_factor` (given, or
/// √(1 + ln f / ln original) with f the given `factor` or positions / original).
fn longrope(
    s: &Map<String, Value>,
    source: &str,
    key: &str,
    head_dim: usize,
    positions: usize,
    obj: &Map<String, Value>,
) -> Result<RopeScaling> {
    let list = |k: &str| -> Result<Vec<f32>> {
        let bad = || {
            format!(
                "{source}: field '{key}.{k}' must be a list of {} positive numbers (one per \
                 rotated pair of a head of {head_dim})",
                head_dim / 2
            )
        };
        let a = s.get(k).and_then(Value::as_array).with_context(bad)?;
        let v: Vec<f32> = a
            .iter()
            .map(|x| x.as_f64().filter(|f| f.is_finite() && *f > 0.0))
            .collect::<Option<Vec<f64>>>()
            .with_context(bad)?
            .into_iter()
            .map(|f| f as f32)
            .collect();
        if v.len() != head_dim / 2 {
            bail!("{}, found {}", bad(), v.len());
        }
        Ok(v)
    };
    let pos = |x: Option<&Value>| x.filter(|v| !v.is_null()).map(|v| v.as_u64());
    let original = match pos(s.get("original_max_position_embeddings"))
        .or_else(|| pos(obj.get("original_max_position_embeddings")))
    {
        Some(Some(n)) if n > 1 => n as usize,
        Some(_) => {
            bail!("{source}: field 'original_max_position_embeddings' must be an integer above 1")
        }
        None => bail!(
            "{source}: rope_type longrope needs 'original_max_position_embeddings' (the \
             pretraining context)"
        ),
    };
    let positive = |k: &str| -> Result<Option<f64>> {
        match s.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(x) => match x.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => Ok(Some(f)),
                _ => bail!("{source}: field '{key}.{k}' must be a positive number, found {x}"),
            },
        }
    };
    let factor = positive("factor")?.unwrap_or(positions as f64 / original as f64);
    let attention_factor = match positive("attention_factor")? {
        Some(f) => f as f32,
        None => LongRope::default_attention_factor(factor, original),
    };
    Ok(RopeScaling::LongRope(LongRope {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    }))
}

/// The `config.json` transformers loads (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
/// `Qwen3ForCausalLM` or `MistralForCausalLM`).
pub(super) fn to_hf_config(s: &ModelSpec) -> Value {
    let Position::Rotary { theta, scaling } = &s.position else {
        unreachable!("validated: Llama-family models use rotary positions")
    };
    let rope_scaling = match scaling {
        None => Value::Null,
        Some(RopeScaling::Llama3(r)) => json!({
            "rope_type": "llama3",
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        }),
        // `type` as Phi-3's configs write it; the attention factor given, so it is the one
        // read whatever the context.
        Some(RopeScaling::Linear { factor }) => json!({"rope_type": "linear", "factor": factor}),
        Some(RopeScaling::LongRope(l)) => json!({
            "type": "longrope",
            "short_factor": l.short_factor,
            "long_factor": l.long_factor,
            "original_max_position_embeddings": l.original_max_position_embeddings,
            "attention_factor": l.attention_factor,
        }),
    };
    let eos = match s.special_tokens.eos.as_slice() {
        [] => Value::Null,
        [one] => json!(one),
        many => json!(many),
    };
    let mut v = json!({
        "architectures": [match s.family {
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Phi3 => "Phi3ForCausalLM",
            _ => "LlamaForCausalLM",
        }],
        "model_type": s.family.model_type(),
        "vocab_size": s.vocab_size,
        "hidden_size": s.n_embd,
        "intermediate_size": s.mlp_hidden,
        "num_hidden_layers": s.n_layer,
        "num_attention_heads": s.n_head,
        "num_key_value_heads": s.n_kv_head,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.n_positions,
        "rms_norm_eps": s.norm_eps,
        "rope_theta": *theta,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": s.tied_embeddings,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": s.special_tokens.bos,
        "eos_token_id": eos,
        "use_cache": true,
        "torch_dtype": "float32",
    });
    let obj = v.as_object_mut().expect("an object");
    if matches!(s.family, Family::Qwen2 | Family::Qwen3) {
        // Windows as Qwen2Config / Qwen3Config read them: the window, and each layer's kind.
        obj.insert(
            "use_sliding_window".into(),
            json!(s.sliding_window.is_some()),
        );
        if let Some(w) = s.sliding_window {
            let sliding = |l: usize| s.layer_window(l).is_some();
            let leading_full = (0..s.n_layer).take_while(|&l| !sliding(l)).count();
            let kinds: Vec<&str> = (0..s.n_layer)
                .map(|l| match sliding(l) {
                    true => "sliding_attention",
                    false => "full_attention",
                })
                .collect();
            obj.insert("sliding_window".into(), json!(w));
            obj.insert("max_window_layers".into(), json!(leading_full));
            obj.insert("layer_types".into(), json!(kinds));
        }
    }
    if s.family == Family::Qwen3 {
        obj.insert("attention_bias".into(), json!(s.biases.qkv));
    } else if s.family == Family::Mistral {
        // Written always: an absent field means 4096 to MistralConfig.
        obj.insert("sliding_window".into(), json!(s.sliding_window));
    } else if s.family == Family::Phi3 {
        obj.insert("sliding_window".into(), json!(s.sliding_window));
        obj.insert("pad_token_id".into(), json!(s.special_tokens.pad));
        let original = match scaling {
            Some(RopeScaling::LongRope(l)) => l.original_max_position_embeddings,
            _ => s.n_positions,
        };
        obj.insert("original_max_position_embeddings".into(), json!(original));
        for key in ["resid_pdrop", "embd_pdrop"] {
            obj.insert(key.into(), json!(0.0));
        }
    } else {
        obj.insert("attention_bias".into(), json!(s.biases.qkv));
        obj.insert("mlp_bias".into(), json!(s.biases.mlp));
        obj.insert("pretraining_tp".into(), json!(1));
    }
    v
}

/// What the family fixes beyond the generic dimensions.
pub(super) fn validate(s: &ModelSpec) -> Result<()> {
    if s.norm != Norm::RmsNorm || !matches!(s.position, Position::Rotary { .. }) {
        bail!(
            "{} models use RMSNorm and rotary positions",
            s.family.model_type()
        );
    }
    if s.family == Family::Qwen3 && (s.biases.mlp || s.biases.qkv != s.biases.attn_out) {
        bail!(
            "qwen3 models have biases on all of q, k, v and o ('attention_bias': true) or on \
             none, and none in the MLP"
        );
    }
    if s.family == Family::Mistral && s.biases != Biases::NONE {
        bail!("mistral models have no biases (transformers' modeling_mistral.py)");
    }
    if s.family == Family::Phi3 && s.biases != Biases::NONE {
        bail!("phi3 models have no biases (transformers' modeling_phi3.py)");
    }
    if let Some(pad) = s.special_tokens.pad
        && pad as usize >= s.vocab_size
    {
        bail!(
            "field 'pad_token_id' is {pad} (Phi3Config's default when absent is 32000), outside \
             the vocabulary of {}: transformers cannot build the model; set it to a token id \
             below {} (the eos id, say) or to null",
            s.vocab_size,
            s.vocab_size
        );
    }
    if !matches!(
        s.family,
        Family::Mistral | Family::Phi3 | Family::Gemma3 | Family::Qwen2 | Family::Qwen3
    ) && s.sliding_window.is_some()
    {
        bail!(
            "{} models have no sliding window in memwall; only mistral's, phi3's, gemma3's, \
             qwen2's and qwen3's are read",
            s.family.model_type()
        );
    }
    if let Position::Rotary {
        scaling: Some(RopeScaling::LongRope(l)),
        ..
    } = &s.position
        && (l.short_factor.len() != s.head_dim / 2 || l.long_factor.len() != s.head_dim / 2)
    {
        bail!(
            "longrope needs {} short and long factors (half the head size {}), found {} and {}",
            s.head_dim / 2,
            s.head_dim,
            l.short_factor.len(),
            l.long_factor.len()
        );
    }
    if !matches!(s.family, Family::Gemma3 | Family::Qwen2 | Family::Qwen3)
        && s.local_layers.is_some()
    {
        bail!(
            "{} models attend alike in every layer ('layer_types' with sliding layers is \
             Gemma 3's, Qwen2's and Qwen3's)",
            s.family.model_type()
        );
    }
    if s.head_dim > 512 {
        bail!(
            "head size {} exceeds the 512 channels memwall's RoPE kernel supports",
            s.head_dim
        );
    }
    Ok(())
}

/// The parameter inventory of `part` of the model (see [`params`]).
pub(super) fn layout(s: &ModelSpec, part: crate::ir::ModelPart) -> ParamLayout {
    params::inventory(s, part).0
}

/// Hugging Face Llama names are used as they are; `model.`-less names (from a bare
/// `LlamaModel`) get the prefix; the rotary `inv_freq` buffers old checkpoints saved are not
/// parameters.
pub(super) fn canonical_name(name: &str) -> Option<String> {
    if name.ends_with("rotary_emb.inv_freq") {
        return None;
    }
    if name == LM_HEAD || name.starts_with("model.") {
        return Some(name.to_string());
    }
    Some(format!("model.{name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameter counts of the released models (their model cards and `num_parameters()`).
    #[test]
    fn presets_have_the_released_parameter_counts() {
        for (name, want) in [
            ("smollm2-135m", 134_515_008),
            ("smollm2-360m", 361_821_120),
            ("qwen2.5-0.5b", 494_032_768),
            ("llama-3.2-1b", 1_235_814_400),
            ("tinyllama-1.1b", 1_100_048_384),
            ("llama-3.2-3b", 3_212_749_824),
            ("llama-2-7b", 6_738_415_616),
            ("llama-3-8b", 8_030_261_248),
            ("llama-3-70b", 70_553_706_496),
            // Qwen3 (KerasHub's presets of the released weights, `params`).
            ("qwen3-0.6b", 596_049_920),
            ("qwen3-1.7b", 1_720_574_976),
            ("qwen3-4b", 4_022_468_096),
            ("qwen3-8b", 8_190_735_360),
            // Mistral-7B-v0.3 (its 32768-token vocabulary): 7.25B.
            ("mistral-7b", 7_248_023_552),
            // Phi-3-mini: 3.82B.
            ("phi-3-mini", 3_821_079_552),
        ] {
            let s = ModelSpec::preset(name).unwrap();
            assert_eq!(s.num_params(), want, "{name}");
        }
        let tiny = ModelSpec::preset("llama-tiny").unwrap();
        assert!((1_000_000..10_000_000).contains(&tiny.num_params()));
        assert!(
            tiny.n_kv_head < tiny.n_head,
            "llama-tiny exercises grouped-query attention"
        );
    }

    #[test]
    fn configs_round_trip() {
        for name in preset_names(Family::Llama)
            .into_iter()
            .chain(preset_names(Family::Qwen2))
            .chain(preset_names(Family::Qwen3))
            .chain(preset_names(Family::Mistral))
            .chain(preset_names(Family::Phi3))
        {
            let s = ModelSpec::preset(name).unwrap();
            let text = s.to_hf_config().to_string();
            let back = ModelSpec::from_hf_config_str(&text, "config.json").unwrap();
            assert!(s.same_dims(&back), "{name}: {s:?} vs {back:?}");
            assert_eq!(s.special_tokens, back.special_tokens, "{name}");
        }
    }

    /// The fields of a published config, and the variants transformers accepts.
    #[test]
    fn reads_hugging_face_configs() {
        let smollm = r#"{"architectures": ["LlamaForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64,
            "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
            "intermediate_size": 1536, "is_llama_config": true, "max_position_embeddings": 8192,
            "mlp_bias": false, "model_type": "llama", "num_attention_heads": 9,
            "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": false,
            "rope_scaling": null, "rope_theta": 100000, "tie_word_embeddings": true,
            "torch_dtype": "bfloat16", "transformers_version": "4.42.3", "use_cache": true,
            "vocab_size": 49152}"#;
        let s = ModelSpec::from_hf_config_str(smollm, "smollm2/config.json").unwrap();
        assert!(s.same_dims(&ModelSpec::preset("smollm2-135m").unwrap()));
        assert_eq!(s.special_tokens.eos, vec![2]);
        // Llama 3.2: rope scaling, eos a list; the newer rope_parameters form the same.
        let llama32 = |rope: &str| {
            format!(
                r#"{{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "vocab_size": 128256,
                "tie_word_embeddings": true, "bos_token_id": 128000,
                "eos_token_id": [128001, 128008, 128009], {rope}}}"#
            )
        };
        let scaling = r#""factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3""#;
        let old = llama32(&format!(
            r#""rope_theta": 500000.0, "rope_scaling": {{{scaling}}}"#
        ));
        let new = llama32(&format!(
            r#""rope_parameters": {{"rope_theta": 500000.0, {scaling}}}"#
        ));
        let preset = ModelSpec::preset("llama-3.2-1b").unwrap();
        for text in [old, new] {
            let s = ModelSpec::from_hf_config_str(&text, "c.json").unwrap();
            assert!(s.same_dims(&preset), "{s:?}");
            assert_eq!(s.special_tokens.eos, vec![128001, 128008, 128009]);
        }
        // No num_key_value_heads: as many as heads; no head_dim: width / heads.
        let mha = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10}"#;
        let s = ModelSpec::from_hf_config_str(mha, "c.json").unwrap();
        assert_eq!((s.n_kv_head, s.head_dim), (4, 16));
        // Qwen2: q/k/v biases, none on o_proj.
        let qwen = r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 10, "use_sliding_window": false}"#;
        let s = ModelSpec::from_hf_config_str(qwen, "c.json").unwrap();
        assert!(s.biases.qkv && !s.biases.attn_out && !s.biases.mlp);
        let lay = s.family.layout(&s, crate::ir::ModelPart::WHOLE);
        assert!(lay.get("model.layers.0.self_attn.k_proj.bias").is_some());
        assert!(lay.get("model.layers.0.self_attn.o_proj.bias").is_none());
    }

    /// Mistral-7B-v0.3's published config.json is the preset; MistralConfig's defaults where a
    /// field is absent (8 KV heads, a 4096-token window); the window is written back, null
    /// included, and a --seq longer than it is refused naming both numbers.
    #[test]
    fn reads_mistral_configs() {
        let published = r#"{"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 32768, "model_type": "mistral",
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "transformers_version": "4.42.0.dev0", "use_cache": true, "vocab_size": 32768}"#;
        let s = ModelSpec::from_hf_config_str(published, "mistral/config.json").unwrap();
        let preset = ModelSpec::preset("mistral-7b").unwrap();
        assert!(s.same_dims(&preset), "{s:?}");
        assert_eq!(s.special_tokens, preset.special_tokens);
        assert_eq!((s.sliding_window, s.biases), (None, Biases::NONE));
        let back = preset.to_hf_config();
        assert_eq!(back["architectures"][0], "MistralForCausalLM");
        assert!(back["sliding_window"].is_null());
        let tiny = |extra: &str| {
            format!(
                r#"{{"model_type": "mistral", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 1, "num_attention_heads": 8, "vocab_size": 10{extra}}}"#
            )
        };
        let s =
            ModelSpec::from_hf_config_str(&tiny(r#", "attention_bias": true"#), "c.json").unwrap();
        assert_eq!(
            (s.n_kv_head, s.sliding_window, s.n_positions, s.biases),
            (8, Some(4096), 131072, Biases::NONE)
        );
        // A sequence longer than the window is computed with the window (no longer refused).
        s.check_seq(4097).unwrap();
        let s =
            ModelSpec::from_hf_config_str(&tiny(r#", "sliding_window": 512"#), "c.json").unwrap();
        assert_eq!(s.to_hf_config()["sliding_window"], 512);
        assert_eq!(s.max_seq(), s.n_positions);
        let e = format!(
            "{:#}",
            ModelSpec::from_hf_config_str(&tiny(r#", "sliding_window": "big""#), "c.json")
                .unwrap_err()
        );
        assert!(
            e.contains("'sliding_window'") && e.contains("c.json"),
            "{e}"
        );
    }

    /// Qwen3-0.6B's published config.json: q/k norms in the layout, no biases, head_dim apart
    /// from width / heads; Qwen3Config's defaults where a field is absent.
    #[test]
    fn reads_qwen3_configs() {
        let published = r#"{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
            "initializer_range": 0.02, "intermediate_size": 3072,
            "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
            "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
            "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
            "vocab_size": 151936}"#;
        let s = ModelSpec::from_hf_config_str(published, "qwen3/config.json").unwrap();
        let preset = ModelSpec::preset("qwen3-0.6b").unwrap();
        assert!(s.same_dims(&preset), "{s:?}");
        assert_eq!(s.special_tokens, preset.special_tokens);
        assert_eq!(s.biases, Biases::NONE);
        let lay = s.family.layout(&s, crate::ir::ModelPart::WHOLE);
        let qn = lay.get("model.layers.27.self_attn.q_norm.weight").unwrap();
        assert_eq!(qn.shape, vec![128]);
        let (_, p) = params::inventory(&s, crate::ir::ModelPart::WHOLE);
        let kn = lay.range("model.layers.3.self_attn.k_norm.weight");
        assert_eq!(p.layers[3].qk_norm.clone().unwrap().end, kn.end);
        assert!(lay.get("model.layers.0.self_attn.q_proj.bias").is_none());
        // attention_bias: q, k, v and o.
        let tiny = |extra: &str| {
            format!(
                r#"{{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10{extra}}}"#
            )
        };
        let s = ModelSpec::from_hf_config_str(
            &tiny(r#", "attention_bias": true, "num_key_value_heads": 4"#),
            "c.json",
        )
        .unwrap();
        assert!(s.biases.qkv && s.biases.attn_out && !s.biases.mlp);
        // Absent head_dim and num_key_value_heads: Qwen3Config's 128 and 32.
        let e = format!(
            "{:#}",
            ModelSpec::from_hf_config_str(&tiny(""), "c.json").unwrap_err()
        );
        assert!(e.contains("'num_key_value_heads' (32)"), "{e}");
        let s = ModelSpec::from_hf_config_str(&tiny(r#", "num_key_value_heads": 2"#), "c.json")
            .unwrap();
        assert_eq!((s.n_kv_head, s.head_dim), (2, 128));
        // Windows: only with use_sliding_window (Qwen3Config's default window 4096, from
        // max_window_layers on, or as layer_types lists them); a malformed list is refused.
        let kv = r#", "num_key_value_heads": 2"#;
        let read =
            |extra: &str| ModelSpec::from_hf_config_str(&tiny(&format!("{kv}{extra}")), "c.json");
        let ignored = read(r#", "layer_types": ["sliding_attention"]"#).unwrap();
        assert_eq!(
            (ignored.sliding_window, ignored.layer_window(0)),
            (None, None)
        );
        let from = read(r#", "use_sliding_window": true, "max_window_layers": 0"#).unwrap();
        assert_eq!(from.layer_window(0), Some(4096));
        let none = read(r#", "use_sliding_window": true, "max_window_layers": 1"#).unwrap();
        assert_eq!((none.sliding_window, none.local_layers), (None, None));
        let listed = read(
            r#", "use_sliding_window": true, "sliding_window": 5, "layer_types": ["sliding_attention"]"#,
        )
        .unwrap();
        assert_eq!(listed.layer_window(0), Some(5));
        let back =
            ModelSpec::from_hf_config_str(&listed.to_hf_config().to_string(), "back").unwrap();
        assert_eq!(back.layer_window(0), Some(5));
        let e = format!("{:#}", read(r#", "layer_types": ["local"]"#).unwrap_err());
        assert!(e.contains("layer_types"), "{e}");
        // --tp splits it (its q/k norms whole on every rank); the config round-trips.
        preset.check_tensor_split(2).unwrap();
        let back = preset.to_hf_config();
        assert_eq!(back["architectures"][0], "Qwen3ForCausalLM");
        assert_eq!(back["model_type"], "qwen3");
    }

    #[test]
    fn bad_configs_name_the_field() {
        let e = |extra: &str| {
            let text = format!(
                r#"{{"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 1, "vocab_size": 10, {extra}}}"#
            );
            format!(
                "{:#}",
                ModelSpec::from_hf_config_str(&text, "cfg.json").unwrap_err()
            )
        };
        let m = e(r#""num_attention_heads": 5"#);
        assert!(
            m.contains("'hidden_size' (64) is not divisible by 'num_attention_heads' (5)"),
            "{m}"
        );
        let m = e(r#""num_attention_heads": 4, "num_key_value_heads": 3"#);
        assert!(
            m.contains("'num_attention_heads' (4) is not divisible by 'num_key_value_heads' (3)"),
            "{m}"
        );
        let m =
            e(r#""num_attention_heads": 4, "rope_scaling": {"rope_type": "yarn", "factor": 4}"#);
        assert!(m.contains("rope_type 'yarn'"), "{m}");
        let m = e(r#""num_attention_heads": 4, "hidden_act": "gelu""#);
        assert!(m.contains("hidden_act"), "{m}");
        let m = e(r#""num_attention_heads": 4, "eos_token_id": "end""#);
        assert!(m.contains("eos_token_id"), "{m}");
        let m = e(r#""num_attention_heads": 4, "tie_word_embeddings": "yes""#);
        assert!(m.contains("tie_word_embeddings"), "{m}");
        let m = e(r#""num_attention_heads": 0"#);
        assert!(m.contains("num_attention_heads"), "{m}");
        let m =
            e(r#""num_attention_heads": 4, "rope_scaling": {"rope_type": "llama3", "factor": 8}"#);
        assert!(m.contains("low_freq_factor"), "{m}");
    }

    #[test]
    fn layout_fuses_projections_that_share_an_input() {
        let s = ModelSpec::preset("llama-tiny").unwrap();
        let (lay, p) = params::inventory(&s, crate::ir::ModelPart::WHOLE);
        let l0 = &p.layers[0];
        let q = lay.range("model.layers.0.self_attn.q_proj.weight");
        let v = lay.range("model.layers.0.self_attn.v_proj.weight");
        assert_eq!(l0.qkv_w, q.start..v.end);
        assert_eq!(
            l0.qkv_w.len(),
            (s.n_head + 2 * s.n_kv_head) * s.head_dim * s.n_embd
        );
        let g = lay.range("model.layers.0.mlp.gate_proj.weight");
        let u = lay.range("model.layers.0.mlp.up_proj.weight");
        assert_eq!(l0.gate_up_w, g.start..u.end);
        assert_eq!(
            lay.get("model.layers.0.self_attn.o_proj.weight")
                .unwrap()
                .shape,
            vec![s.n_embd, s.n_head * s.head_dim]
        );
        // Tied: the head is the embedding, stored once; untied: its own group at the end.
        assert_eq!(p.lm_head, p.embed);
        assert_eq!(lay.tied[0].name, "lm_head.weight");
        let untied = ModelSpec {
            tied_embeddings: false,
            ..s.clone()
        };
        let (lay, p) = params::inventory(&untied, crate::ir::ModelPart::WHOLE);
        assert_eq!(lay.range("lm_head.weight"), p.lm_head);
        assert_eq!(lay.groups.last().unwrap().name, "lm_head");
        assert!(lay.tied.is_empty());
    }

    /// Phi-3-mini-4k-instruct's config.json (no scaling, a window of 2047) and a 128k one's
    /// LongRoPE (`type` longrope, the pretraining context at the top level); both written back
    /// and read again unchanged.
    #[test]
    fn reads_phi3_configs() {
        let mini = |extra: &str| {
            format!(
                r#"{{"architectures": ["Phi3ForCausalLM"], "attention_bias": false,
                "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0,
                "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
                "initializer_range": 0.02, "intermediate_size": 8192,
                "max_position_embeddings": 4096, "model_type": "phi3",
                "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
                "original_max_position_embeddings": 4096, "pad_token_id": 32000,
                "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                "sliding_window": 2047, "tie_word_embeddings": false, "vocab_size": 32064{extra}}}"#
            )
        };
        let s =
            ModelSpec::from_hf_config_str(&mini(r#", "rope_scaling": null"#), "c.json").unwrap();
        let preset = ModelSpec::preset("phi-3-mini").unwrap();
        assert!(s.same_dims(&preset), "{s:?} vs {preset:?}");
        assert_eq!((s.family, s.sliding_window), (Family::Phi3, Some(2047)));
        assert_eq!(s.to_hf_config()["architectures"][0], "Phi3ForCausalLM");
        let factors = |v: f32| format!("[{}]", vec![v.to_string(); 48].join(", "));
        let long = mini(&format!(
            r#", "rope_scaling": {{"type": "longrope", "short_factor": {}, "long_factor": {}}}"#,
            factors(1.0),
            factors(2.5)
        ))
        .replace(
            r#""max_position_embeddings": 4096"#,
            r#""max_position_embeddings": 131072"#,
        );
        let s = ModelSpec::from_hf_config_str(&long, "c.json").unwrap();
        let Position::Rotary {
            scaling: Some(RopeScaling::LongRope(l)),
            ..
        } = &s.position
        else {
            panic!("longrope expected: {:?}", s.position)
        };
        // √(1 + ln 32 / ln 4096), as transformers computes it.
        let want = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt() as f32;
        assert_eq!(l.attention_factor, want);
        assert_eq!(l.original_max_position_embeddings, 4096);
        assert_eq!((l.short_factor[0], l.long_factor[47]), (1.0, 2.5));
        assert_eq!(s.rope_switch(), Some(4096));
        let back = ModelSpec::from_hf_config_str(&s.to_hf_config().to_string(), "c.json").unwrap();
        assert_eq!(back.position, s.position);
        assert_eq!(back.sliding_window, s.sliding_window);
    }

    /// What Phi-3 configs may ask that memwall does not compute is refused by its field.
    #[test]
    fn phi3_options_memwall_lacks_are_refused() {
        let base = r#""model_type": "phi3", "hidden_size": 32, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 48, "vocab_size": 10,
            "pad_token_id": 0"#;
        let e = |extra: &str| {
            let text = format!("{{{base}{extra}}}");
            format!(
                "{:#}",
                ModelSpec::from_hf_config_str(&text, "c.json").unwrap_err()
            )
        };
        let x = e(r#", "partial_rotary_factor": 0.75"#);
        assert!(
            x.contains("'partial_rotary_factor'") && x.contains("0.75"),
            "{x}"
        );
        let x = e(r#", "resid_pdrop": 0.1"#);
        assert!(x.contains("'resid_pdrop'") && x.contains("c.json"), "{x}");
        let x = e(
            r#", "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1],
            "long_factor": [1, 1, 1, 1]}, "original_max_position_embeddings": 16"#,
        );
        assert!(
            x.contains("short_factor") && x.contains("4 positive"),
            "{x}"
        );
        let x = e(
            r#", "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1],
            "long_factor": [1, 1, 1, 1]}"#,
        );
        assert!(x.contains("original_max_position_embeddings"), "{x}");
        // Phi3Config's pad, 32000 when absent, would fall outside this vocabulary.
        let text = format!("{{{base}}}").replace(r#""pad_token_id": 0"#, r#""rms_norm_eps": 1e-5"#);
        let x = format!(
            "{:#}",
            ModelSpec::from_hf_config_str(&text, "c.json").unwrap_err()
        );
        assert!(
            x.contains("'pad_token_id'") && x.contains("32000") && x.contains("c.json"),
            "{x}"
        );
        // Without a scaling, the fused model reads with Phi3Config's defaults.
        let s = ModelSpec::from_hf_config_str(&format!("{{{base}}}"), "c.json").unwrap();
        assert_eq!(
            (s.n_kv_head, s.n_positions, s.sliding_window),
            (4, 4096, None)
        );
    }

    /// Phi-3's layout names the fused tensors, at the ranges Llama's separate ones take, and
    /// a tensor rank keeps three runs of q|k|v rows and two of gate|up.
    #[test]
    fn phi3_stores_fused_projections() {
        let mut s = ModelSpec::preset("llama-tiny").unwrap();
        s.family = Family::Phi3;
        let (lay, p) = params::inventory(&s, crate::ir::ModelPart::WHOLE);
        assert_eq!(
            lay.range("model.layers.0.self_attn.qkv_proj.weight"),
            p.layers[0].qkv_w
        );
        assert_eq!(
            lay.range("model.layers.0.mlp.gate_up_proj.weight"),
            p.layers[0].gate_up_w
        );
        assert!(lay.get("model.layers.0.self_attn.q_proj.weight").is_none());
        let mut llama = s.clone();
        llama.family = Family::Llama;
        let (_, lp) = params::inventory(&llama, crate::ir::ModelPart::WHOLE);
        assert_eq!(
            (lp.layers[1].qkv_w.clone(), lp.layers[1].gate_up_w.clone()),
            (p.layers[1].qkv_w.clone(), p.layers[1].gate_up_w.clone())
        );
        let part = crate::ir::ModelPart {
            tensor: crate::ir::TensorSplit::new(2, 1),
            stage: crate::ir::PipelineStage::WHOLE,
        };
        let (lay, _) = params::inventory(&s, part);
        let qkv = lay.get("model.layers.0.self_attn.qkv_proj.weight").unwrap();
        let cut = qkv.part.as_ref().unwrap();
        let (q, kv) = (s.n_head * s.head_dim, s.n_kv_head * s.head_dim);
        assert_eq!(
            cut.ranges,
            vec![q / 2..q, q + kv / 2..q + kv, q + kv + kv / 2..q + 2 * kv]
        );
        let gu = lay.get("model.layers.0.mlp.gate_up_proj.weight").unwrap();
        let h = s.mlp_hidden;
        assert_eq!(
            gu.part.as_ref().unwrap().ranges,
            vec![h / 2..h, h + h / 2..2 * h]
        );
    }
}
