//! Gemma 3's text models (`gemma3_text`: `Gemma3ForCausalLM`; transformers'
//! `modeling_gemma3.py` and `configuration_gemma3.py`, llama.cpp's `LLM_ARCH_GEMMA3`): presets,
//! `config.json` in and out, and what the family fixes. Its parameters and blocks are
//! [`super::llama`]'s, with the family's knobs ([`Family::qk_norm`], [`Family::norm_offset`],
//! [`Family::post_norms`], [`Family::glu_act`], [`Family::embed_scale`]) and its interleaved
//! attention ([`ModelSpec::local_layers`]):
//!
//!   x1 = norm(x); o = attention(rope(qk_norm(x1 @ [Wq; Wk; Wv]ᵀ))) @ Woᵀ; r = x + norm(o);
//!   x2 = norm(r); m = (gelu_tanh(x2 @ Wgateᵀ) · (x2 @ Wupᵀ)) @ Wdownᵀ; out = r + norm(m),
//!
//! every norm an RMSNorm with gain `1 + w`, the embedding's rows multiplied by √C, the
//! attention scaled by `query_pre_attn_scalar^-½` (`head_dim^-½` in every Gemma 3 up to 12B,
//! `(hidden / heads)^-½` in 27B: [`ModelSpec::query_pre_attn_scalar`]), sliding layers attending to the last
//! `sliding_window` keys (themselves included) with RoPE base `rope_local_base_freq`, full
//! layers to the whole prefix with `rope_theta` (and the config's scaling: linear, by
//! `factor`, on the 4B and larger).

use super::llama::{self, Fields};
use super::rope::RopeScaling;
use super::spec::{Biases, Family, LocalLayers, ModelSpec, Norm, Position, SpecialTokens};
use anyhow::{Result, bail};
use serde_json::{Map, Value, json};

/// Gemma3TextConfig's default layer pattern: five sliding layers, then a full one.
const PATTERN: usize = 6;

/// A preset's dimensions (the published `config.json`s; the 4B's is its `text_config`).
struct Preset {
    name: &'static str,
    vocab: usize,
    positions: usize,
    embd: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    mlp: usize,
    window: usize,
    /// Linear RoPE scaling of the full layers (the 4B's 8), if any.
    linear_factor: Option<f32>,
}

const PRESETS: &[Preset] = &[
    // google/gemma-3-270m: 268M parameters, 170M of them the embedding.
    Preset {
        name: "gemma-3-270m",
        vocab: 262_144,
        positions: 32_768,
        embd: 640,
        layers: 18,
        heads: 4,
        kv_heads: 1,
        mlp: 2048,
        window: 512,
        linear_factor: None,
    },
    // google/gemma-3-1b-pt / -it.
    Preset {
        name: "gemma-3-1b",
        vocab: 262_144,
        positions: 32_768,
        embd: 1152,
        layers: 26,
        heads: 4,
        kv_heads: 1,
        mlp: 6912,
        window: 512,
        linear_factor: None,
    },
    // google/gemma-3-4b-it's text model (`text_config`).
    Preset {
        name: "gemma-3-4b",
        vocab: 262_208,
        positions: 131_072,
        embd: 2560,
        layers: 34,
        heads: 8,
        kv_heads: 4,
        mlp: 10_240,
        window: 1024,
        linear_factor: Some(8.0),
    },
];

/// `[L]` sliding flags of Gemma3TextConfig's default pattern: every `pattern`-th layer full.
fn default_layers(layers: usize, pattern: usize) -> Vec<bool> {
    (0..layers).map(|l| (l + 1) % pattern != 0).collect()
}

fn from_preset(p: &Preset) -> ModelSpec {
    ModelSpec {
        name: p.name.to_string(),
        family: Family::Gemma3,
        vocab_size: p.vocab,
        n_positions: p.positions,
        n_embd: p.embd,
        n_layer: p.layers,
        n_head: p.heads,
        n_kv_head: p.kv_heads,
        head_dim: 256,
        mlp_hidden: p.mlp,
        norm: Norm::RmsNorm,
        norm_eps: 1e-6,
        position: Position::Rotary {
            theta: 1_000_000.0,
            scaling: p.linear_factor.map(|factor| RopeScaling::Linear { factor }),
        },
        tied_embeddings: true,
        biases: Biases::NONE,
        sliding_window: Some(p.window),
        local_layers: Some(LocalLayers {
            sliding: default_layers(p.layers, PATTERN),
            rope_theta: 10_000.0,
            own_rotation: true,
        }),
        query_pre_attn_scalar: None,
        special_tokens: SpecialTokens {
            bos: Some(2),
            eos: vec![1, 106], // <eos>, <end_of_turn>
            pad: Some(0),
        },
    }
}

pub(super) fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.name).collect()
}

pub(super) fn preset(name: &str) -> Option<ModelSpec> {
    PRESETS.iter().find(|p| p.name == name).map(from_preset)
}

/// Reads a `config.json` of `model_type` `gemma3_text`, with Gemma3TextConfig's defaults for
/// what it leaves out.
pub(super) fn from_hf_config(obj: &Map<String, Value>, source: &str) -> Result<ModelSpec> {
    let f = Fields { obj, source };
    if let Some(act) = f.get("hidden_activation")
        && !matches!(act.as_str(), Some("gelu_pytorch_tanh" | "gelu_new"))
    {
        bail!(
            "{source}: field 'hidden_activation' is {act}; memwall's Gemma MLP is GeGLU with \
             the tanh GELU (\"gelu_pytorch_tanh\")"
        );
    }
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(x) = f.get(key) {
            bail!(
                "{source}: field '{key}' is {x}; memwall computes Gemma 3's logits without \
                 softcapping (null, as every released Gemma 3 config has it)"
            );
        }
    }
    if f.flag("use_bidirectional_attention", false)? {
        bail!(
            "{source}: field 'use_bidirectional_attention' is true; memwall trains causal models only"
        );
    }
    if f.flag("attention_bias", false)? {
        bail!("{source}: field 'attention_bias' is true; memwall's Gemma 3 has no biases");
    }
    if let Some(x) = f.get("attention_dropout")
        && x.as_f64() != Some(0.0)
    {
        bail!(
            "{source}: field 'attention_dropout' is {x}; memwall trains without dropout there (set it to 0.0)"
        );
    }
    let c = f.uint("hidden_size", Some(2304))?;
    let nh = f.uint("num_attention_heads", Some(8))?;
    let head_dim = f.uint("head_dim", Some(256))?;
    // Attention scores are q·k / √query_pre_attn_scalar (`Gemma3Attention.scaling`).
    let scalar = f.float("query_pre_attn_scalar", head_dim as f64)?;
    if !(scalar.is_finite() && scalar > 0.0) {
        bail!(
            "{source}: field 'query_pre_attn_scalar' is {scalar}; it must be a positive number \
             (attention scores are divided by its square root)"
        );
    }
    let query_pre_attn_scalar = (scalar != head_dim as f64).then_some(scalar as f32);
    let layers = f.uint("num_hidden_layers", Some(26))?;
    let sliding = layer_types(&f, layers)?;
    let window = match obj.get("sliding_window") {
        None => 4096,
        Some(x) => match x.as_u64() {
            Some(w) if w > 0 => w as usize,
            _ => bail!("{source}: field 'sliding_window' must be a positive integer, found {x}"),
        },
    };
    let (theta, local_theta, scaling) = rope(&f)?;
    let eos = f.token_ids("eos_token_id")?.unwrap_or_else(|| vec![1]);
    let bos = f
        .token_ids("bos_token_id")?
        .map_or(Ok(Some(2)), |v| match v[..] {
            [one] => Ok(Some(one)),
            _ => bail!("{source}: field 'bos_token_id' must be one token id"),
        })?;
    let pad = match obj.get("pad_token_id") {
        None => Some(0),
        Some(Value::Null) => None,
        Some(x) => Some(llama::token_id(x, "pad_token_id", source)?),
    };
    Ok(ModelSpec {
        name: source.to_string(),
        family: Family::Gemma3,
        vocab_size: f.uint("vocab_size", Some(262_208))?,
        n_positions: f.uint("max_position_embeddings", Some(131_072))?,
        n_embd: c,
        n_layer: layers,
        n_head: nh,
        n_kv_head: f.uint("num_key_value_heads", Some(4))?,
        head_dim,
        mlp_hidden: f.uint("intermediate_size", Some(9216))?,
        norm: Norm::RmsNorm,
        norm_eps: f.float("rms_norm_eps", 1e-6)? as f32,
        position: Position::Rotary { theta, scaling },
        tied_embeddings: f.flag("tie_word_embeddings", true)?,
        biases: Biases::NONE,
        sliding_window: Some(window),
        local_layers: Some(LocalLayers {
            sliding,
            rope_theta: local_theta,
            own_rotation: true,
        }),
        query_pre_attn_scalar,
        special_tokens: SpecialTokens { bos, eos, pad },
    })
}

/// The text model's config of a multimodal Gemma 3 config (`model_type` `gemma3`,
/// `Gemma3ForConditionalGeneration`: google/gemma-3-4b-it and larger), or `None` for any other
/// config. Its `text_config`, completed by the top level's token ids where it has none; its
/// weights are found by [`canonical_name`], the vision tower's left aside.
pub(super) fn text_of_multimodal(
    obj: &Map<String, Value>,
    source: &str,
) -> Result<Option<Map<String, Value>>> {
    if obj.get("model_type").and_then(Value::as_str) != Some("gemma3") {
        return Ok(None);
    }
    let Some(text) = obj.get("text_config").and_then(Value::as_object) else {
        bail!(
            "{source}: a multimodal Gemma 3 config (model_type 'gemma3') without a \
             'text_config' object; memwall trains its text model, described there"
        );
    };
    let mut text = text.clone();
    text.insert("model_type".into(), json!("gemma3_text"));
    for key in [
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
    ] {
        if let (None, Some(v)) = (text.get(key), obj.get(key)) {
            text.insert(key.into(), v.clone());
        }
    }
    Ok(Some(text))
}

/// The canonical (text model's) name of a tensor in a Gemma 3 file: a multimodal checkpoint's
/// `language_model.model.*` (as the hub's files and transformers 5's `save_pretrained` write
/// it) or `model.language_model.*` (transformers' module names) is the text model's `model.*`;
/// the vision tower's and the projector's tensors are not the text model's (`None`).
pub(super) fn canonical_name(name: &str) -> Option<String> {
    let vision = ["vision_tower.", "multi_modal_projector."];
    let bare = name.strip_prefix("model.").unwrap_or(name);
    if vision.iter().any(|v| bare.starts_with(v)) {
        return None;
    }
    if let Some(rest) = name
        .strip_prefix("language_model.model.")
        .or_else(|| name.strip_prefix("model.language_model."))
    {
        return Some(format!("model.{rest}"));
    }
    if let Some(rest) = name.strip_prefix("language_model.") {
        return llama::canonical_name(rest);
    }
    llama::canonical_name(name)
}

/// `layer_types` (`"sliding_attention"` / `"full_attention"` per layer), or the pattern
/// Gemma3TextConfig derives when it is absent (`sliding_window_pattern`, 6 by default).
fn layer_types(f: &Fields, layers: usize) -> Result<Vec<bool>> {
    let source = f.source;
    let Some(types) = f.get("layer_types") else {
        let key = ["sliding_window_pattern", "_sliding_window_pattern"]
            .into_iter()
            .find(|k| f.get(k).is_some())
            .unwrap_or("sliding_window_pattern");
        let pattern = f.uint(key, Some(PATTERN))?;
        if pattern == 0 {
            bail!("{source}: field '{key}' must be at least 1");
        }
        return Ok(default_layers(layers, pattern));
    };
    let bad = || {
        format!(
            "{source}: field 'layer_types' must list {layers} entries (num_hidden_layers), each \
             \"sliding_attention\" or \"full_attention\", found {types}"
        )
    };
    let Some(list) = types.as_array().filter(|a| a.len() == layers) else {
        bail!("{}", bad());
    };
    list.iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => bail!("{}", bad()),
        })
        .collect()
}

/// (θ of the full layers, θ of the sliding layers, the full layers' scaling), from the
/// released configs' `rope_theta`, `rope_local_base_freq` and `rope_scaling`, or
/// transformers 5's `rope_parameters` (`{"full_attention": {...}, "sliding_attention":
/// {...}}`).
fn rope(f: &Fields) -> Result<(f32, f32, Option<RopeScaling>)> {
    let source = f.source;
    let theta_of = |x: Option<&Value>, key: &str, default: f32| -> Result<f32> {
        match x.filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(x) => match x.as_f64() {
                Some(t) if t > 1.0 && t.is_finite() => Ok(t as f32),
                _ => bail!("{source}: field '{key}' must be a number above 1, found {x}"),
            },
        }
    };
    let (full, local) = match f.get("rope_parameters") {
        Some(p) => (p.get("full_attention"), p.get("sliding_attention")),
        None => (f.get("rope_scaling"), None),
    };
    let key = match f.get("rope_parameters") {
        Some(_) => "rope_parameters.full_attention",
        None => "rope_scaling",
    };
    let theta = theta_of(
        full.and_then(|p| p.get("rope_theta"))
            .or_else(|| f.get("rope_theta")),
        "rope_theta",
        1_000_000.0,
    )?;
    let local_theta = theta_of(
        local
            .and_then(|p| p.get("rope_theta"))
            .or_else(|| f.get("rope_local_base_freq")),
        "rope_local_base_freq",
        10_000.0,
    )?;
    if let Some(kind) = local
        .and_then(|p| p.get("rope_type"))
        .and_then(Value::as_str)
        && kind != "default"
    {
        bail!(
            "{source}: field 'rope_parameters.sliding_attention' has rope_type '{kind}'; \
             memwall rotates Gemma 3's sliding layers unscaled ('default')"
        );
    }
    let kind = full
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match kind {
        "default" => None,
        "linear" => match full.and_then(|p| p.get("factor")).and_then(Value::as_f64) {
            Some(factor) if factor.is_finite() && factor >= 1.0 => Some(RopeScaling::Linear {
                factor: factor as f32,
            }),
            _ => bail!(
                "{source}: field '{key}.factor' must be a number of at least 1 (rope_type linear)"
            ),
        },
        other => bail!(
            "{source}: field '{key}' has rope_type '{other}'; memwall supports 'default' and \
             'linear' for Gemma 3"
        ),
    };
    Ok((theta, local_theta, scaling))
}

/// `query_pre_attn_scalar` as the released configs write it: an integer (256, 168) where it
/// is one.
fn scalar_json(x: f32) -> Value {
    match x.fract() == 0.0 && x >= 0.0 && x < u32::MAX as f32 {
        true => json!(x as u32),
        false => json!(x),
    }
}

/// The `config.json` transformers loads (`Gemma3ForCausalLM`), in the released configs'
/// form (which transformers 5 reads into its `rope_parameters`).
pub(super) fn to_hf_config(s: &ModelSpec) -> Value {
    let Position::Rotary { theta, scaling } = &s.position else {
        unreachable!("validated: Gemma 3 uses rotary positions")
    };
    let ll = s
        .local_layers
        .as_ref()
        .expect("validated: Gemma 3 has local layers");
    let rope_scaling = match scaling {
        Some(RopeScaling::Linear { factor }) => json!({"rope_type": "linear", "factor": factor}),
        _ => Value::Null,
    };
    let types: Vec<&str> = ll
        .sliding
        .iter()
        .map(|&sl| match sl {
            true => "sliding_attention",
            false => "full_attention",
        })
        .collect();
    let eos = match s.special_tokens.eos.as_slice() {
        [] => Value::Null,
        [one] => json!(one),
        many => json!(many),
    };
    json!({
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": s.family.model_type(),
        "vocab_size": s.vocab_size,
        "hidden_size": s.n_embd,
        "intermediate_size": s.mlp_hidden,
        "num_hidden_layers": s.n_layer,
        "num_attention_heads": s.n_head,
        "num_key_value_heads": s.n_kv_head,
        "head_dim": s.head_dim,
        "query_pre_attn_scalar": scalar_json(s.attention_scale_dim()),
        "max_position_embeddings": s.n_positions,
        "rms_norm_eps": s.norm_eps,
        "rope_theta": *theta,
        "rope_local_base_freq": ll.rope_theta,
        "rope_scaling": rope_scaling,
        "sliding_window": s.sliding_window,
        "layer_types": types,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": null,
        "attn_logit_softcapping": null,
        "use_bidirectional_attention": false,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "tie_word_embeddings": s.tied_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": s.special_tokens.bos,
        "eos_token_id": eos,
        "pad_token_id": s.special_tokens.pad,
        "use_cache": true,
        "torch_dtype": "float32",
    })
}

/// What the family fixes beyond the generic dimensions.
pub(super) fn validate(s: &ModelSpec) -> Result<()> {
    llama::validate(s)?;
    if s.biases != Biases::NONE {
        bail!("gemma3 models have no biases (transformers' modeling_gemma3.py)");
    }
    let Some(ll) = &s.local_layers else {
        bail!("gemma3 models name each layer's attention ('layer_types')");
    };
    if ll.sliding.len() != s.n_layer {
        bail!(
            "field 'layer_types' lists {} layers; the model has {} ('num_hidden_layers')",
            ll.sliding.len(),
            s.n_layer
        );
    }
    if s.sliding_window.is_none() {
        bail!("gemma3 models need a 'sliding_window' for their sliding layers");
    }
    if let Position::Rotary {
        scaling: Some(RopeScaling::Llama3(_) | RopeScaling::LongRope(_)),
        ..
    } = &s.position
    {
        bail!("gemma3 models scale RoPE linearly or not at all");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameter counts from the shapes of the released models (the embedding 262,144 × C,
    /// tied; per layer q, k, v, o, the MLP, four norms of C and two of head_dim).
    #[test]
    fn presets_have_the_released_parameter_counts() {
        for (name, want) in [
            ("gemma-3-270m", 268_098_176),
            ("gemma-3-1b", 999_885_952),
            ("gemma-3-4b", 3_880_263_168),
        ] {
            let s = ModelSpec::preset(name).unwrap();
            assert_eq!(s.num_params(), want, "{name}");
            let ll = s.local_layers.as_ref().unwrap();
            // Layers 5, 11, 17, … are full; the rest slide.
            assert!(!ll.sliding[5] && ll.sliding[4] && ll.sliding[6], "{name}");
            assert_eq!(s.layer_window(5), None);
            assert_eq!(s.layer_window(0), s.sliding_window);
            assert_eq!(s.layer_rope(0).unwrap().0, 10_000.0);
            assert_eq!(s.layer_rope(5).unwrap().0, 1_000_000.0);
        }
    }

    #[test]
    fn configs_round_trip() {
        for name in preset_names() {
            let s = ModelSpec::preset(name).unwrap();
            let text = s.to_hf_config().to_string();
            let back = ModelSpec::from_hf_config_str(&text, "config.json").unwrap();
            assert!(back.same_dims(&s), "{name}");
            assert_eq!(back.special_tokens, s.special_tokens, "{name}");
        }
    }

    /// gemma-3-270m's released config.json (transformers 4.55), and the same model saved by
    /// transformers 5 (`rope_parameters` per layer type, `layer_types` listed).
    #[test]
    fn reads_released_and_transformers5_configs() {
        let released = r#"{"_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"],
            "attention_bias": false, "attention_dropout": 0.0, "attn_logit_softcapping": null,
            "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": null,
            "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640,
            "initializer_range": 0.02, "intermediate_size": 2048, "max_position_embeddings": 32768,
            "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 18,
            "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": null,
            "rope_theta": 1000000.0, "sliding_window": 512, "torch_dtype": "bfloat16",
            "use_bidirectional_attention": false, "use_cache": true, "vocab_size": 262144}"#;
        let s = ModelSpec::from_hf_config_str(released, "c.json").unwrap();
        assert!(s.same_dims(&ModelSpec::preset("gemma-3-270m").unwrap()));
        let v5 = r#"{"model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
            "vocab_size": 100, "layer_types": ["sliding_attention", "full_attention",
            "sliding_attention"], "sliding_window": 16, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}"#;
        let s = ModelSpec::from_hf_config_str(v5, "c.json").unwrap();
        assert_eq!(
            s.position,
            Position::Rotary {
                theta: 1e6,
                scaling: Some(RopeScaling::Linear { factor: 8.0 })
            }
        );
        assert_eq!(s.sliding_window, Some(16));
        let ll = s.local_layers.unwrap();
        assert_eq!(
            (ll.sliding, ll.rope_theta),
            (vec![true, false, true], 10_000.0)
        );
    }

    /// A multimodal checkpoint's names are its text model's; the vision tower's are left aside.
    #[test]
    fn multimodal_names_are_the_text_models() {
        for (name, want) in [
            (
                "language_model.model.layers.0.mlp.up_proj.weight",
                Some("model.layers.0.mlp.up_proj.weight"),
            ),
            (
                "model.language_model.embed_tokens.weight",
                Some("model.embed_tokens.weight"),
            ),
            ("language_model.lm_head.weight", Some("lm_head.weight")),
            (
                "model.layers.1.self_attn.q_norm.weight",
                Some("model.layers.1.self_attn.q_norm.weight"),
            ),
            (
                "vision_tower.vision_model.embeddings.patch_embedding.weight",
                None,
            ),
            (
                "model.multi_modal_projector.mm_input_projection_weight",
                None,
            ),
        ] {
            assert_eq!(canonical_name(name).as_deref(), want, "{name}");
        }
        let mm = r#"{"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}, "vision_config": {"hidden_size": 1152}}"#;
        let s = ModelSpec::from_hf_config_str(mm, "c.json").unwrap();
        // google/gemma-3-4b-it's config.json: its text_config leaves the rest to
        // Gemma3TextConfig's defaults, which are the 4B's.
        assert!(s.same_dims(&ModelSpec::preset("gemma-3-4b").unwrap()));
        assert_eq!(s.special_tokens.eos, vec![1, 106]);
        let e = ModelSpec::from_hf_config_str(r#"{"model_type": "gemma3"}"#, "m.json").unwrap_err();
        assert!(format!("{e:#}").contains("text_config"));
    }

    #[test]
    fn refusals_name_the_field() {
        let base = r#"{"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "query_pre_attn_scalar": 32, "vocab_size": 100"#;
        for (extra, field) in [
            (
                r#", "final_logit_softcapping": 30.0"#,
                "final_logit_softcapping",
            ),
            (r#", "hidden_activation": "silu""#, "hidden_activation"),
            (r#", "query_pre_attn_scalar": 0"#, "query_pre_attn_scalar"),
            (r#", "layer_types": ["full_attention"]"#, "layer_types"),
            (
                r#", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}"#,
                "rope_scaling",
            ),
            (
                r#", "use_bidirectional_attention": true"#,
                "use_bidirectional_attention",
            ),
            (r#", "attention_bias": true"#, "attention_bias"),
        ] {
            let text = format!("{base}{extra}}}");
            let e = format!(
                "{:#}",
                ModelSpec::from_hf_config_str(&text, "g.json").unwrap_err()
            );
            assert!(e.contains(field) && e.contains("g.json"), "{field}: {e}");
        }
        let ok = ModelSpec::from_hf_config_str(&format!("{base}}}"), "g.json").unwrap();
        // Defaults: tied, the pattern of six, a window of 4096.
        assert!(ok.tied_embeddings);
        assert_eq!(ok.sliding_window, Some(4096));
        assert_eq!(ok.local_layers.unwrap().sliding, vec![true, true]);
    }
}
