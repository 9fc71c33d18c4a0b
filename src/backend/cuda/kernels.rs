//! The CUDA C sources of the backend's kernels, compiled by NVRTC (each after the prelude
//! [`PRELUDE`], `kernels/common.cuh`), and the entries each declares. A source's entries are
//! the `extern "C" __global__` functions the host launches: plain ones, and template kernels
//! instantiated for each storage type (`name_f32`, `name_bf16`, `name_f16`, by the prelude's
//! `MW_STORAGE_ENTRIES`). Pure data: every build has it, so CI compiles every source
//! (`tests/cuda_kernels.rs`) on machines without a GPU.

/// The prelude compiled before every source: storage types, conversions, reductions.
pub const PRELUDE: &str = include_str!("kernels/common.cuh");

/// The suffixes of the storage types a template kernel is instantiated for, in the order of
/// `MW_STORAGE_ENTRIES`.
pub const STORAGE_SUFFIXES: [&str; 3] = ["f32", "bf16", "f16"];

/// One kernel source.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    /// Its file name under `src/backend/cuda/kernels/` (NVRTC's name for it in messages).
    pub name: &'static str,
    /// The CUDA C text (without the prelude).
    pub text: &'static str,
    /// Entries instantiated for every storage type (`stem_f32`, `stem_bf16`, `stem_f16`).
    pub per_storage: &'static [&'static str],
    /// Entries with no storage type.
    pub plain: &'static [&'static str],
}

impl Source {
    /// What NVRTC compiles: the prelude, then the source numbered from its own line 1 (so
    /// NVRTC's messages name the file and its line).
    pub fn full_text(&self) -> String {
        format!("{PRELUDE}\n#line 1 \"{}\"\n{}", self.name, self.text)
    }

    /// Every entry the source declares.
    pub fn entries(&self) -> Vec<String> {
        let mut out: Vec<String> = self.plain.iter().map(|s| s.to_string()).collect();
        for stem in self.per_storage {
            out.extend(STORAGE_SUFFIXES.iter().map(|s| format!("{stem}_{s}")));
        }
        out
    }
}

/// Every source the backend compiles.
pub const SOURCES: &[Source] = &[
    Source {
        name: "activation.cu",
        text: include_str!("kernels/activation.cu"),
        per_storage: &[
            "gelu_backward",
            "gelu_forward",
            "glu_backward",
            "glu_forward",
        ],
        plain: &[],
    },
    Source {
        name: "attention.cu",
        text: include_str!("kernels/attention.cu"),
        per_storage: &[
            "attention_backward_dkv_hd128",
            "attention_backward_dkv_hd256",
            "attention_backward_dkv_hd64",
            "attention_backward_dot",
            "attention_backward_dq_hd128",
            "attention_backward_dq_hd256",
            "attention_backward_dq_hd64",
            "attention_backward_naive",
            "attention_forward_hd128",
            "attention_forward_hd256",
            "attention_forward_hd64",
            "attention_forward_naive",
        ],
        plain: &[],
    },
    Source {
        name: "attention_mma.cu",
        text: include_str!("kernels/attention_mma.cu"),
        // bf16 and f16 only (the tensor cores' operand types): plain entries.
        per_storage: &[],
        plain: &[
            "attention_backward_dkv_mma_hd128_bf16",
            "attention_backward_dkv_mma_hd128_f16",
            "attention_backward_dkv_mma_hd64_bf16",
            "attention_backward_dkv_mma_hd64_f16",
            "attention_backward_dq_mma_hd128_bf16",
            "attention_backward_dq_mma_hd128_f16",
            "attention_backward_dq_mma_hd64_bf16",
            "attention_backward_dq_mma_hd64_f16",
            "attention_forward_mma_hd128_bf16",
            "attention_forward_mma_hd128_f16",
            "attention_forward_mma_hd64_bf16",
            "attention_forward_mma_hd64_f16",
        ],
    },
    Source {
        name: "bias.cu",
        text: include_str!("kernels/bias.cu"),
        per_storage: &["add_bias"],
        plain: &[],
    },
    Source {
        name: "convert.cu",
        text: include_str!("kernels/convert.cu"),
        per_storage: &["col_sum_partials", "f32_to_storage"],
        plain: &[],
    },
    Source {
        name: "dequant.cu",
        text: include_str!("kernels/dequant.cu"),
        per_storage: &[
            "dequant_bf16",
            "dequant_f16",
            "dequant_f32",
            "dequant_q4_0",
            "dequant_q4_1",
            "dequant_q4_k",
            "dequant_q5_0",
            "dequant_q6_k",
            "dequant_q8_0",
            "dequant_gather_bf16",
            "dequant_gather_f16",
            "dequant_gather_f32",
            "dequant_gather_q4_0",
            "dequant_gather_q4_1",
            "dequant_gather_q4_k",
            "dequant_gather_q5_0",
            "dequant_gather_q6_k",
            "dequant_gather_q8_0",
        ],
        plain: &[],
    },
    Source {
        name: "embedding.cu",
        text: include_str!("kernels/embedding.cu"),
        per_storage: &[
            "encoder_backward_accumulate",
            "encoder_backward_naive",
            "encoder_forward",
        ],
        plain: &["encoder_link_rows", "encoder_mark_rows"],
    },
    Source {
        name: "fill.cu",
        text: include_str!("kernels/fill.cu"),
        per_storage: &[],
        plain: &["zero_bytes"],
    },
    Source {
        name: "lora.cu",
        text: include_str!("kernels/lora.cu"),
        per_storage: &[
            "lora_add_cols",
            "lora_add_masked",
            "lora_dropout",
            "lora_narrow_scale",
            "lora_scale",
            "lora_widen",
        ],
        plain: &[],
    },
    Source {
        name: "norm.cu",
        text: include_str!("kernels/norm.cu"),
        per_storage: &[
            "layernorm_backward_input",
            "layernorm_backward_input_naive",
            "layernorm_backward_params_naive",
            "layernorm_backward_partials",
            "layernorm_forward",
            "layernorm_forward_naive",
            "norm_reduce_partials",
            "qk_norm_backward_input",
            "qk_norm_backward_input_naive",
            "qk_norm_backward_params_naive",
            "qk_norm_backward_partials",
            "qk_norm_forward",
            "qk_norm_forward_naive",
            "rmsnorm_backward_input",
            "rmsnorm_backward_input_naive",
            "rmsnorm_backward_params_naive",
            "rmsnorm_backward_partials",
            "rmsnorm_forward",
            "rmsnorm_forward_naive",
        ],
        plain: &[],
    },
    Source {
        name: "optimizer.cu",
        text: include_str!("kernels/optimizer.cu"),
        per_storage: &[
            "adamw_m32",
            "adamw_m8",
            "adamw_m8_naive",
            "adamw_mbf16",
            "gradnorm_naive",
            "gradnorm_partials",
        ],
        plain: &["gradnorm_finish"],
    },
    Source {
        name: "rope.cu",
        text: include_str!("kernels/rope.cu"),
        per_storage: &["rope"],
        plain: &[],
    },
    Source {
        name: "xent.cu",
        text: include_str!("kernels/xent.cu"),
        per_storage: &[],
        plain: &["xent_fused", "xent_fused_naive"],
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `.cu` file in the kernels folder is listed, and every listed entry is declared in
    /// its text (as an `extern "C"` function or a stem the storage macro instantiates).
    #[test]
    fn every_source_is_listed_with_its_entries() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda/kernels");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        files.sort();
        let mut listed: Vec<String> = SOURCES.iter().map(|s| s.name.to_string()).collect();
        listed.sort();
        assert_eq!(files, listed, "kernels/*.cu and SOURCES differ");
        for s in SOURCES {
            for p in s.plain {
                assert!(
                    s.text.contains(&format!("void {p}(")),
                    "{}: no entry {p}",
                    s.name
                );
            }
            for stem in s.per_storage {
                assert!(
                    s.text.contains(&format!("void {stem}_##S(")),
                    "{}: no storage entry {stem}_##S",
                    s.name
                );
            }
        }
    }
}
