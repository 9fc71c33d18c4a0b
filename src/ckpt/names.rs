//! Tensor names of the checkpoint files that are not the model family's: the optimizer
//! moments in `optimizer.safetensors`. Parameter names and their Hugging Face variants are
//! the family's ([`crate::model::Family::canonical_name`]).

use super::safetensors_io::Resolved;

/// Prefixes of the optimizer moment tensors in `optimizer.safetensors`.
pub(crate) const EXP_AVG: &str = "exp_avg.";
pub(crate) const EXP_AVG_SQ: &str = "exp_avg_sq.";
/// Flat (whole-buffer) moment tensors of compressed optimizer state, and the suffix of their
/// block scales.
pub(crate) const FLAT_EXP_AVG: &str = "exp_avg";
pub(crate) const FLAT_EXP_AVG_SQ: &str = "exp_avg_sq";
pub(crate) const ABSMAX: &str = ".absmax";

/// Tensor names in an optimizer file are used as they are.
pub(crate) fn resolve_exact(name: &str) -> Resolved {
    Resolved::Key(name.to_string())
}
