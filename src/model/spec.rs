//! GPT-2 family model dimensions: presets, Hugging Face `config.json` in and out, validation.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::Path;

/// The dimensions of a GPT-2 architecture model (tied input/output embeddings, pre-LN blocks,
/// learned positions, tanh-GELU MLP of width 4·C).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Preset name or the config file it came from (for messages only).
    pub name: String,
    /// V: vocabulary size (GPT-2 BPE: 50257).
    pub vocab_size: usize,
    /// maxT: number of learned positions, the longest sequence the model accepts.
    pub n_positions: usize,
    /// C: embedding width.
    pub n_embd: usize,
    /// L: number of transformer blocks.
    pub n_layer: usize,
    /// NH: attention heads; head size is C / NH.
    pub n_head: usize,
    /// Layer-norm epsilon.
    pub layer_norm_epsilon: f32,
}

/// Presets: name, (vocab, positions, embd, layers, heads).
const PRESETS: &[(&str, [usize; 5])] = &[
    ("gpt2-tiny", [50257, 256, 128, 4, 4]),
    ("gpt2", [50257, 1024, 768, 12, 12]),
    ("gpt2-medium", [50257, 1024, 1024, 24, 16]),
    ("gpt2-large", [50257, 1024, 1280, 36, 20]),
    ("gpt2-xl", [50257, 1024, 1600, 48, 25]),
];

impl ModelSpec {
    /// Names of the built-in presets.
    pub fn preset_names() -> Vec<&'static str> {
        PRESETS.iter().map(|p| p.0).collect()
    }

    /// A built-in preset by name.
    pub fn preset(name: &str) -> Result<ModelSpec> {
        let Some((n, d)) = PRESETS.iter().find(|p| p.0 == name) else {
            bail!(
                "unknown model preset '{name}': choose one of {}, or pass a directory or \
                 config.json of a Hugging Face GPT-2 model",
                Self::preset_names().join(", ")
            );
        };
        let spec = ModelSpec {
            name: n.to_string(),
            vocab_size: d[0],
            n_positions: d[1],
            n_embd: d[2],
            n_layer: d[3],
            n_head: d[4],
            layer_norm_epsilon: 1e-5,
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
            Self::from_hf_config_file(p)
        } else if PRESETS.iter().any(|x| x.0 == arg) {
            Self::preset(arg)
        } else if arg.ends_with(".json") || arg.contains('/') {
            bail!(
                "model '{arg}': no such file or directory (expected a preset name, a checkpoint directory or a config.json)"
            )
        } else {
            Self::preset(arg)
        }
    }

    /// Reads a Hugging Face GPT-2 `config.json`.
    pub fn from_hf_config_file(path: &Path) -> Result<ModelSpec> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read model config {}", path.display()))?;
        Self::from_hf_config_str(&text, &path.display().to_string())
    }

    /// Parses a Hugging Face GPT-2 config from JSON text; `source` names it in errors.
    pub fn from_hf_config_str(text: &str, source: &str) -> Result<ModelSpec> {
        let v: Value =
            serde_json::from_str(text).with_context(|| format!("{source}: not valid JSON"))?;
        let Some(obj) = v.as_object() else {
            bail!(
                "{source}: expected a JSON object with GPT-2 fields (n_embd, n_layer, n_head, ...)"
            );
        };
        if let Some(mt) = obj.get("model_type").and_then(Value::as_str)
            && mt != "gpt2"
        {
            bail!(
                "{source}: field 'model_type' is '{mt}', but memwall trains the GPT-2 architecture ('gpt2')"
            );
        }
        let get = |key: &str, alias: Option<&str>, default: Option<usize>| -> Result<usize> {
            let val = obj.get(key).or_else(|| alias.and_then(|a| obj.get(a)));
            match val {
                None => default.with_context(|| format!("{source}: missing field '{key}'")),
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
                _ => bail!(
                    "{source}: field 'layer_norm_epsilon' must be a number in (0, 1), found {x}"
                ),
            },
        };
        if obj.get("tie_word_embeddings").and_then(Value::as_bool) == Some(false) {
            bail!(
                "{source}: field 'tie_word_embeddings' is false; memwall's GPT-2 ties the LM head to wte"
            );
        }
        let spec = ModelSpec {
            name: source.to_string(),
            vocab_size: get("vocab_size", None, Some(50257))?,
            n_positions: get("n_positions", Some("n_ctx"), Some(1024))?,
            n_embd: get("n_embd", None, None)?,
            n_layer: get("n_layer", None, None)?,
            n_head: get("n_head", None, None)?,
            layer_norm_epsilon: eps,
        };
        spec.validate()
            .with_context(|| format!("{source}: inconsistent model config"))?;
        Ok(spec)
    }

    /// Checks that the dimensions describe a model we can build.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
            ("n_embd", self.n_embd),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
        ] {
            if v == 0 {
                bail!("field '{field}' is 0; it must be at least 1");
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            bail!(
                "field 'n_embd' ({}) is not divisible by 'n_head' ({}); each head needs n_embd / n_head channels",
                self.n_embd,
                self.n_head
            );
        }
        if self.vocab_size > u32::MAX as usize {
            bail!("field 'vocab_size' ({}) exceeds 2^32", self.vocab_size);
        }
        Ok(())
    }

    /// Checks a sequence length against the model; names the flag in the error.
    pub fn check_seq(&self, seq: usize) -> Result<()> {
        if seq == 0 {
            bail!("--seq must be at least 1");
        }
        if seq > self.n_positions {
            bail!(
                "--seq {seq} is longer than the model's n_positions ({}); use --seq {} or less",
                self.n_positions,
                self.n_positions
            );
        }
        Ok(())
    }

    /// Head size C / NH.
    pub fn head_size(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Total number of parameters (tied LM head counted once).
    pub fn num_params(&self) -> usize {
        super::ParamLayout::new(self).total
    }

    /// The Hugging Face `config.json` for this model (loadable by `GPT2LMHeadModel`).
    pub fn to_hf_config(&self) -> Value {
        json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": null,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "initializer_range": 0.02,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "tie_word_embeddings": true,
            "torch_dtype": "float32"
        })
    }

    /// True when two specs have the same dimensions (names may differ).
    pub fn same_dims(&self, o: &ModelSpec) -> bool {
        (
            self.vocab_size,
            self.n_positions,
            self.n_embd,
            self.n_layer,
            self.n_head,
        ) == (o.vocab_size, o.n_positions, o.n_embd, o.n_layer, o.n_head)
            && self.layer_norm_epsilon == o.layer_norm_epsilon
    }

    /// One-line description, e.g. `gpt2 (124.4M params: L=12 C=768 NH=12 V=50257 maxT=1024)`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({:.1}M params: L={} C={} NH={} V={} maxT={})",
            self.name,
            self.num_params() as f64 / 1e6,
            self.n_layer,
            self.n_embd,
            self.n_head,
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
        assert!(e("{not json").contains("not valid JSON"));
        assert!(
            e(r#"{"model_type": "llama", "n_embd": 96, "n_layer": 2, "n_head": 3}"#)
                .contains("model_type")
        );
        let unknown = format!("{:#}", ModelSpec::resolve("gpt5").unwrap_err());
        assert!(unknown.contains("unknown model preset 'gpt5'") && unknown.contains("gpt2-tiny"));
        let s = ModelSpec::preset("gpt2-tiny").unwrap();
        assert!(format!("{:#}", s.check_seq(257).unwrap_err()).contains("--seq 257"));
    }
}
