//! `--type`: the file types `memwall export` writes ([`ExportType`]), their
//! `general.file_type` (llama.cpp's `llama_ftype`) and the ggml type each starts from
//! (`llama_ftype_get_default_type` in llama-quant.cpp); which type each tensor gets is
//! [`super::mixing`]'s.

use crate::dtype::GgmlType;
use anyhow::{Result, bail};
use std::str::FromStr;

/// The file type `memwall export --type` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    /// llama-quantize's Q4_K_M (`--type q4_k_m`, alias `q4_k`): Q4_K, with Q6_K for the
    /// output and half the `attn_v` and `ffn_down` layers.
    Q4KM,
    /// llama-quantize's Q6_K.
    Q6K,
}

/// What `--type` accepts, for messages and help.
pub const EXPORT_TYPES: &str = "f32, f16, bf16, q8_0, q4_0, q4_1, q4_k_m (alias q4_k), q6_k";

impl ExportType {
    /// The type of a matrix before llama-quantize's per-tensor rules
    /// (`llama_ftype_get_default_type`): what every 2-D weight is, unless
    /// [`super::mixing::tensor_types`] picks another.
    pub fn ggml(self) -> GgmlType {
        match self {
            ExportType::F32 => GgmlType::F32,
            ExportType::F16 => GgmlType::F16,
            ExportType::Bf16 => GgmlType::BF16,
            ExportType::Q8_0 => GgmlType::Q8_0,
            ExportType::Q4_0 => GgmlType::Q4_0,
            ExportType::Q4_1 => GgmlType::Q4_1,
            ExportType::Q4KM => GgmlType::Q4_K,
            ExportType::Q6K => GgmlType::Q6_K,
        }
    }

    /// `general.file_type`, llama.cpp's `llama_ftype` (include/llama.h): ALL_F32 0,
    /// MOSTLY_F16 1, MOSTLY_Q4_0 2, MOSTLY_Q4_1 3, MOSTLY_Q8_0 7, MOSTLY_Q4_K_M 15,
    /// MOSTLY_Q6_K 18, MOSTLY_BF16 32.
    pub fn file_type(self) -> u32 {
        match self {
            ExportType::F32 => 0,
            ExportType::F16 => 1,
            ExportType::Q4_0 => 2,
            ExportType::Q4_1 => 3,
            ExportType::Q8_0 => 7,
            ExportType::Q4KM => 15,
            ExportType::Q6K => 18,
            ExportType::Bf16 => 32,
        }
    }
}

impl FromStr for ExportType {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<ExportType> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => ExportType::F32,
            "f16" => ExportType::F16,
            "bf16" => ExportType::Bf16,
            "q8_0" => ExportType::Q8_0,
            "q4_0" => ExportType::Q4_0,
            "q4_1" => ExportType::Q4_1,
            "q4_k_m" | "q4_k" => ExportType::Q4KM,
            "q6_k" => ExportType::Q6K,
            "q4_k_s" | "q5_0" | "q5_1" | "q5_k" | "q5_k_m" | "q5_k_s" | "q3_k" | "q3_k_m"
            | "q3_k_s" | "q3_k_l" | "q2_k" => bail!(
                "--type {s} is not written yet (it needs Q5_K, Q5_1 or lower-bit blocks): \
                 memwall exports {EXPORT_TYPES}; quantize the q8_0 or f16 file further with \
                 llama.cpp's llama-quantize"
            ),
            _ => bail!("--type {s:?} is not a GGUF type memwall writes: use one of {EXPORT_TYPES}"),
        })
    }
}
