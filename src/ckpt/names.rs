//! Hugging Face GPT-2 tensor naming variants.
//!
//! memwall names parameters as `GPT2LMHeadModel` does (`transformer.h.0.attn.c_attn.weight`,
//! `transformer.wte.weight`). Checkpoints saved from `GPT2Model` (such as the hub's `gpt2`)
//! drop the `transformer.` prefix (`h.0.attn.c_attn.weight`, `wte.weight`). Both load.
//! Non-parameters are skipped: the causal-mask buffers `h.N.attn.bias` and
//! `h.N.attn.masked_bias` that older transformers versions saved, and `lm_head.weight`,
//! which GPT-2 ties to `wte` (checked separately, see [`LM_HEAD`]).

use super::safetensors_io::Resolved;

/// Prefix of `GPT2LMHeadModel` parameter names.
pub(crate) const PREFIX: &str = "transformer.";

/// The output projection, tied to `transformer.wte.weight` in GPT-2.
pub(crate) const LM_HEAD: &str = "lm_head.weight";

/// Prefixes of the optimizer moment tensors in `optimizer.safetensors`.
pub(crate) const EXP_AVG: &str = "exp_avg.";
pub(crate) const EXP_AVG_SQ: &str = "exp_avg_sq.";
/// Flat (whole-buffer) moment tensors of compressed optimizer state, and the suffix of their
/// block scales.
pub(crate) const FLAT_EXP_AVG: &str = "exp_avg";
pub(crate) const FLAT_EXP_AVG_SQ: &str = "exp_avg_sq";
pub(crate) const ABSMAX: &str = ".absmax";

/// Maps a tensor name from a model file to memwall's canonical (`GPT2LMHeadModel`) name.
pub(crate) fn resolve_model_name(name: &str) -> Resolved {
    if name == LM_HEAD {
        return Resolved::Ignore;
    }
    let bare = name.strip_prefix(PREFIX).unwrap_or(name);
    if bare.ends_with(".attn.bias") || bare.ends_with(".attn.masked_bias") {
        return Resolved::Ignore;
    }
    Resolved::Key(format!("{PREFIX}{bare}"))
}

/// Tensor names in an optimizer file are used as they are.
pub(crate) fn resolve_exact(name: &str) -> Resolved {
    Resolved::Key(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: &str) -> Option<String> {
        match resolve_model_name(n) {
            Resolved::Key(k) => Some(k),
            Resolved::Ignore => None,
        }
    }

    #[test]
    fn naming_variants_resolve_to_canonical_names() {
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
