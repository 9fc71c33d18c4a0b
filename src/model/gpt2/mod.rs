//! The GPT-2 family: learned positions, pre-LN blocks (layer norm with bias), fused QKV
//! attention, tanh-GELU MLP of width `n_inner` (4·C by default), LM head tied to the token
//! embedding. Presets, `config.json` as `GPT2LMHeadModel` reads it, Hugging Face naming
//! variants (`canonical_name`), the parameter inventory ([`params`]) and the emission of
//! a step (`emit`).

pub(crate) mod emit;
pub mod params;

use super::ParamLayout;
use super::spec::{Biases, Family, FieldNames, ModelSpec, Norm, Position, SpecialTokens};
use anyhow::{Context, Result, bail};
use params::LM_HEAD;
use serde_json::{Map, Value, json};

pub use params::{Gpt2Params, LayerParams};

/// Presets: name, (vocab, positions, embd, layers, heads).
const PRESETS: &[(&str, [usize; 5])] = &[
    ("gpt2-tiny", [50257, 256, 128, 4, 4]),
    ("gpt2", [50257, 1024, 768, 12, 12]),
    ("gpt2-medium", [50257, 1024, 1024, 24, 16]),
    ("gpt2-large", [50257, 1024, 1280, 36, 20]),
    ("gpt2-xl", [50257, 1024, 1600, 48, 25]),
];

pub(super) const FIELDS: FieldNames = FieldNames {
    vocab: "vocab_size",
    positions: "n_positions",
    embd: "n_embd",
    layers: "n_layer",
    heads: "n_head",
    kv_heads: "n_head",
    mlp: "n_inner",
};

/// Prefix of `GPT2LMHeadModel` parameter names.
const PREFIX: &str = "transformer.";

/// GPT-2's `<|endoftext|>`, its config's `bos_token_id` and `eos_token_id`.
const EOT: u32 = 50256;

/// A GPT-2 of these dimensions (vocabulary, positions, width, layers, heads), MLP width 4·C.
pub fn spec(name: &str, [v, t, c, l, h]: [usize; 5]) -> ModelSpec {
    ModelSpec {
        name: name.to_string(),
        family: Family::Gpt2,
        vocab_size: v,
        n_positions: t,
        n_embd: c,
        n_layer: l,
        n_head: h,
        n_kv_head: h,
        head_dim: c.checked_div(h).unwrap_or(0),
        mlp_hidden: 4 * c,
        norm: Norm::LayerNorm,
        norm_eps: 1e-5,
        position: Position::Learned,
        tied_embeddings: true,
        biases: Biases::ALL,
        sliding_window: None,
        local_layers: None,
        query_pre_attn_scalar: None,
        special_tokens: SpecialTokens {
            bos: Some(EOT),
            eos: vec![EOT],
            pad: None,
        },
    }
}

pub(super) fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.0).collect()
}

pub(super) fn preset(name: &str) -> Option<ModelSpec> {
    PRESETS
        .iter()
        .find(|p| p.0 == name)
        .map(|(n, d)| spec(n, *d))
}

/// Reads a Hugging Face GPT-2 config's fields.
pub(super) fn from_hf_config(obj: &Map<String, Value>, source: &str) -> Result<ModelSpec> {
    let get = |key: &str, alias: Option<&str>, default: Option<usize>| -> Result<usize> {
        let val = obj.get(key).or_else(|| alias.and_then(|a| obj.get(a)));
        match val {
            // `null` means "the default", as transformers reads `n_inner: null`.
            None | Some(Value::Null) => {
                default.with_context(|| format!("{source}: missing field '{key}'"))
            }
            Some(x) => match x.as_u64() {
                Some(n) => Ok(n as usize),
                None => {
                    bail!("{source}: field '{key}' must be a non-negative integer, found {x}")
                }
            },
        }
    };
    let eps = match obj.get("layer_norm_epsilon") {
        None => 1e-5,
        Some(x) => match x.as_f64() {
            Some(e) if e > 0.0 && e < 1.0 => e as f32,
            _ => {
                bail!("{source}: field 'layer_norm_epsilon' must be a number in (0, 1), found {x}")
            }
        },
    };
    if obj.get("tie_word_embeddings").and_then(Value::as_bool) == Some(false) {
        bail!(
            "{source}: field 'tie_word_embeddings' is false; memwall's GPT-2 ties the LM head to wte"
        );
    }
    check_gpt2_variant(obj, source)?;
    let c = get("n_embd", None, None)?;
    let h = get("n_head", None, None)?;
    let mut s = spec(
        source,
        [
            get("vocab_size", None, Some(50257))?,
            get("n_positions", Some("n_ctx"), Some(1024))?,
            c,
            get("n_layer", None, None)?,
            h,
        ],
    );
    s.mlp_hidden = get("n_inner", None, Some(4 * c))?;
    s.norm_eps = eps;
    Ok(s)
}

/// Refuses the settings of `GPT2Config` that change the arithmetic from the GPT-2 memwall
/// computes (the tanh GELU, scores scaled by 1/sqrt(head size) and nothing else), naming the
/// field: computed as plain GPT-2, such a model would silently be another model.
fn check_gpt2_variant(obj: &Map<String, Value>, source: &str) -> Result<()> {
    // transformers' names for the tanh approximation memwall's GELU computes.
    const TANH_GELU: [&str; 2] = ["gelu_new", "gelu_pytorch_tanh"];
    match obj.get("activation_function") {
        None | Some(Value::Null) => {}
        Some(Value::String(a)) if TANH_GELU.contains(&a.as_str()) => {}
        Some(other) => bail!(
            "{source}: field 'activation_function' is {other}; memwall's GPT-2 computes the \
             tanh GELU (\"gelu_new\" or \"gelu_pytorch_tanh\") only"
        ),
    }
    for (field, plain) in [
        ("scale_attn_weights", true),
        ("scale_attn_by_inverse_layer_idx", false),
    ] {
        match obj.get(field) {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) if *b == plain => {}
            Some(other) => bail!(
                "{source}: field '{field}' is {other}; memwall's GPT-2 computes it as {plain} \
                 (GPT-2's own setting) only"
            ),
        }
    }
    Ok(())
}

/// The `config.json` `GPT2LMHeadModel.from_pretrained` loads (`n_inner` null when 4·C).
pub(super) fn to_hf_config(s: &ModelSpec) -> Value {
    let n_inner = if s.mlp_hidden == 4 * s.n_embd {
        Value::Null
    } else {
        json!(s.mlp_hidden)
    };
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": s.vocab_size,
        "n_positions": s.n_positions,
        "n_ctx": s.n_positions,
        "n_embd": s.n_embd,
        "n_layer": s.n_layer,
        "n_head": s.n_head,
        "n_inner": n_inner,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": s.norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": EOT,
        "eos_token_id": EOT,
        "tie_word_embeddings": true,
        "torch_dtype": "float32"
    })
}

/// What GPT-2 fixes beyond the generic dimensions.
pub(super) fn validate(s: &ModelSpec) -> Result<()> {
    if s.n_kv_head != s.n_head {
        bail!(
            "GPT-2 has as many key/value heads as heads (n_head {}), not {}",
            s.n_head,
            s.n_kv_head
        );
    }
    if s.norm != Norm::LayerNorm
        || s.position != Position::Learned
        || !s.tied_embeddings
        || s.biases != Biases::ALL
        || s.head_dim * s.n_head != s.n_embd
    {
        bail!(
            "GPT-2 uses layer norm, learned positions, biases on every linear layer, a tied \
             LM head and heads of n_embd / n_head channels"
        );
    }
    Ok(())
}

/// The parameter inventory of `part` of the model (see [`params`]).
pub(super) fn layout(s: &ModelSpec, part: crate::ir::ModelPart) -> ParamLayout {
    params::inventory(s, part).0
}

/// Hugging Face GPT-2 naming variants. memwall names parameters as `GPT2LMHeadModel` does
/// (`transformer.h.0.attn.c_attn.weight`, `transformer.wte.weight`). Checkpoints saved from
/// `GPT2Model` (such as the hub's `gpt2`) drop the `transformer.` prefix. Both load. Not
/// parameters: the causal-mask buffers `h.N.attn.bias` and `h.N.attn.masked_bias` that older
/// transformers versions saved, and `lm_head.weight`, tied to `wte` (the layout's
/// [`super::params::TiedName`]; checked separately).
pub(super) fn canonical_name(name: &str) -> Option<String> {
    if name == LM_HEAD {
        return None;
    }
    let bare = name.strip_prefix(PREFIX).unwrap_or(name);
    if bare.ends_with(".attn.bias") || bare.ends_with(".attn.masked_bias") {
        return None;
    }
    Some(format!("{PREFIX}{bare}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_computed_otherwise_are_refused_naming_the_field() {
        let cfg = |extra: &str| {
            let text = format!(r#"{{"n_embd": 16, "n_layer": 1, "n_head": 2{extra}}}"#);
            let v: Value = serde_json::from_str(&text).unwrap();
            from_hf_config(v.as_object().unwrap(), "config.json")
        };
        assert!(cfg("").is_ok());
        for ok in [
            r#", "activation_function": "gelu_new""#,
            r#", "activation_function": "gelu_pytorch_tanh", "scale_attn_weights": true"#,
            r#", "scale_attn_by_inverse_layer_idx": false"#,
        ] {
            assert!(cfg(ok).is_ok(), "{ok}");
        }
        for (bad, field) in [
            (r#", "activation_function": "relu""#, "activation_function"),
            (r#", "activation_function": "gelu""#, "activation_function"),
            (r#", "scale_attn_weights": false"#, "scale_attn_weights"),
            (
                r#", "scale_attn_by_inverse_layer_idx": true"#,
                "scale_attn_by_inverse_layer_idx",
            ),
        ] {
            let e = format!("{:#}", cfg(bad).unwrap_err());
            assert!(e.contains(field) && e.contains("config.json"), "{bad}: {e}");
        }
    }

    #[test]
    fn naming_variants_resolve_to_canonical_names() {
        let key = canonical_name;
        let full = "transformer.h.0.attn.c_attn.weight";
        assert_eq!(key(full).as_deref(), Some(full));
        assert_eq!(key("h.0.attn.c_attn.weight").as_deref(), Some(full));
        assert_eq!(key("wte.weight").as_deref(), Some("transformer.wte.weight"));
        assert_eq!(
            key("h.3.attn.c_attn.bias").as_deref(),
            Some("transformer.h.3.attn.c_attn.bias")
        );
        assert_eq!(key("h.3.attn.bias"), None);
        assert_eq!(key("transformer.h.3.attn.masked_bias"), None);
        assert_eq!(key("lm_head.weight"), None);
    }
}
