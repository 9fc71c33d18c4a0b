//! `memwall export DIR --gguf OUT.gguf --type T`: a model directory (a checkpoint, or any
//! Hugging Face directory memwall loads) as one GGUF file that llama.cpp runs.
//!
//! Families: Llama (`llama`: Llama 3, SmolLM2) and Qwen2 (`qwen2`); others (GPT-2) are
//! refused by name. What is written follows llama.cpp's `convert_hf_to_gguf.py`:
//!
//! - metadata: `general.architecture`, `.type` `model`, `.name` (the directory's name unless given), `.file_type`
//!   (`llama_ftype`), `.quantization_version` 2; `{arch}.vocab_size`, `.context_length`,
//!   `.embedding_length`, `.block_count`, `.feed_forward_length`, `.rope.dimension_count`,
//!   `.attention.head_count`, `.head_count_kv`, `.rope.freq_base`,
//!   `.attention.layer_norm_rms_epsilon` (and `.attention.key_length` / `.value_length` when
//!   the head size is not width / heads); the tokenizer ([`vocab`]).
//! - tensors under GGUF's names ([`super::hf::gguf_tensor_name`]), in the directory's order,
//!   dims innermost first; `llama` Q and K rows permuted to llama.cpp's order
//!   ([`super::hf::permute_rows`], the inverse of what `convert` undoes); each tensor's type
//!   as llama.cpp's llama-quantize picks it for `--type` ([`ftype`], [`mixing`]: 1-D tensors
//!   F32; Q4_K_M's Q6_K layers, the output tensor's Q6_K or Q8_0, the K-quants' fallbacks for
//!   rows that are not whole super-blocks), written by [`super::quantize`]'s reference
//!   quantizers; a tied LM head is not written (llama.cpp reuses `token_embd`).
//!
//! Every check that can fail is made before the file is opened: the family, the RoPE
//! scaling (Llama 3's is a `rope_freqs` tensor in llama.cpp, not written yet), the tokenizer,
//! every tensor's name and block fit. The weights are then read tensor by tensor from the
//! directory's safetensors ([`crate::ckpt::load_params_by`], NaN and infinity refused) and
//! written as they come ([`super::write::write_gguf`]: atomic, one tensor in memory).
//!
//! Doubt: a directory `convert` made from a GGUF file does not record that file, so its
//! tokenizer metadata is rebuilt from `tokenizer.json`, not copied from the source.

pub mod ftype;
pub mod mixing;
pub mod vocab;

pub use ftype::{EXPORT_TYPES, ExportType};

use super::file::Value;
use super::hf::{gguf_tensor_name, permute_rows};
use super::types::GgmlType;
use super::write::{TensorSpec, write_gguf};
use crate::model::{Family, ModelSpec, Position};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

/// What to export and where.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// A model directory: `config.json`, the safetensors weights, `tokenizer.json`.
    pub input: PathBuf,
    /// The GGUF file to write (replaced atomically if it exists).
    pub out: PathBuf,
    pub ty: ExportType,
    /// `general.name`; `None`: the directory's name.
    pub name: Option<String>,
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct ExportSummary {
    pub out: PathBuf,
    pub architecture: &'static str,
    pub tensors: usize,
    pub metadata_keys: usize,
    pub bytes: u64,
}

/// GGUF's architecture name for a family, or an error naming it.
fn arch_of(spec: &ModelSpec, dir: &Path) -> Result<&'static str> {
    match spec.family {
        Family::Llama => Ok("llama"),
        Family::Qwen2 => Ok("qwen2"),
        Family::Gpt2 => bail!(
            "{}: model_type gpt2 cannot be exported to GGUF yet (memwall exports llama and qwen2)",
            dir.display()
        ),
    }
}

/// The `general.*` and `{arch}.*` metadata.
fn model_metadata(
    spec: &ModelSpec,
    arch: &str,
    name: &str,
    ty: ExportType,
    dir: &Path,
) -> Result<Vec<(String, Value)>> {
    let theta = match spec.position {
        Position::Rotary {
            scaling: Some(_), ..
        } => bail!(
            "{}: the model has Llama 3 rope scaling (rope_type llama3), which llama.cpp keeps \
             as a rope_freqs tensor that memwall does not write yet",
            dir.join("config.json").display()
        ),
        Position::Rotary { theta, .. } => theta,
        Position::Learned => bail!("{}: a rotary model was expected", dir.display()),
    };
    let u = |x: usize| Value::U32(x as u32);
    let k = |s: &str| format!("{arch}.{s}");
    let mut md = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name.into())),
        ("general.file_type".into(), Value::U32(ty.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (k("vocab_size"), u(spec.vocab_size)),
        (k("context_length"), u(spec.n_positions)),
        (k("embedding_length"), u(spec.n_embd)),
        (k("block_count"), u(spec.n_layer)),
        (k("feed_forward_length"), u(spec.mlp_hidden)),
        (k("rope.dimension_count"), u(spec.head_dim)),
        (k("attention.head_count"), u(spec.n_head)),
        (k("attention.head_count_kv"), u(spec.n_kv_head)),
        (k("rope.freq_base"), Value::F32(theta)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(spec.norm_eps),
        ),
    ];
    if spec.head_dim * spec.n_head != spec.n_embd {
        md.push((k("attention.key_length"), u(spec.head_dim)));
        md.push((k("attention.value_length"), u(spec.head_dim)));
    }
    Ok(md)
}

/// One tensor to write: its info, the layout tensor it comes from, the heads of a Q/K permute.
struct Planned {
    spec: TensorSpec,
    layout_index: usize,
    permute_heads: Option<usize>,
}

/// Exports `o.input` to `o.out` (see the module doc).
pub fn export(o: &ExportOptions) -> Result<ExportSummary> {
    let dir = &o.input;
    if dir.is_file() {
        bail!(
            "{}: a file; `memwall export` takes a model or checkpoint directory (config.json, \
             model.safetensors, tokenizer.json)",
            dir.display()
        );
    }
    let spec = crate::ckpt::load_spec(dir)?;
    let arch = arch_of(&spec, dir)?;
    let name = o.name.clone().unwrap_or_else(|| fs_name(dir));
    let mut md = model_metadata(&spec, arch, &name, o.ty, dir)?;
    md.extend(vocab::metadata(dir, &spec)?);
    let layout = spec.family.layout(&spec);
    let mut plan = Vec::with_capacity(layout.tensors.len());
    let mut names = Vec::with_capacity(layout.tensors.len());
    for t in &layout.tensors {
        names.push(gguf_tensor_name(&t.name).with_context(|| {
            format!(
                "tensor {} has no GGUF name (memwall's {arch} layout)",
                t.name
            )
        })?);
    }
    // dims innermost first, as GGUF stores them: [cols, rows].
    let dims: Vec<Vec<u64>> = layout
        .tensors
        .iter()
        .map(|t| t.shape.iter().rev().map(|&d| d as u64).collect())
        .collect();
    let list: Vec<(&str, &[u64])> = names
        .iter()
        .map(|n| n.as_str())
        .zip(dims.iter().map(|d| d.as_slice()))
        .collect();
    let mix = mixing::MixModel {
        arch,
        n_layer: spec.n_layer,
        n_head: spec.n_head,
        n_kv_head: spec.n_kv_head,
    };
    let types = mixing::tensor_types(o.ty, mix, &list)
        .with_context(|| format!("--type {:?} for {}", o.ty, dir.display()))?;
    for (i, (g, ty)) in names.into_iter().zip(types).enumerate() {
        let permute_heads = match arch {
            "llama" if g.contains(".attn_q.") => Some(spec.n_head),
            "llama" if g.contains(".attn_k.") => Some(spec.n_kv_head),
            _ => None,
        };
        let ts = TensorSpec {
            name: g,
            dims: dims[i].clone(),
            ty,
        };
        ts.n_bytes()
            .with_context(|| format!("--type {:?} for {}", o.ty, dir.display()))?;
        plan.push(Planned {
            spec: ts,
            layout_index: i,
            permute_heads,
        });
    }
    let specs: Vec<TensorSpec> = plan.iter().map(|p| p.spec.clone()).collect();
    crate::ckpt::load_params_by(dir, &layout, |copy| {
        write_gguf(&o.out, &md, &specs, |i, buf| {
            let p = &plan[i];
            let t = &layout.tensors[p.layout_index];
            let mut vals = vec![0f32; t.range.len()];
            copy(t.range.clone(), &mut vals)?;
            if let Some(heads) = p.permute_heads {
                let cols = t.shape.get(1).copied().unwrap_or(1);
                let mut out = vec![0f32; vals.len()];
                permute_rows(&vals, &mut out, heads, cols)
                    .with_context(|| format!("tensor {}", t.name))?;
                vals = out;
            }
            encode(&vals, p.spec.ty, buf).with_context(|| format!("tensor {}", t.name))
        })
    })
    .with_context(|| format!("exporting {} to {}", dir.display(), o.out.display()))?;
    let bytes = std::fs::metadata(&o.out)
        .with_context(|| format!("cannot stat {}", o.out.display()))?
        .len();
    Ok(ExportSummary {
        out: o.out.clone(),
        architecture: arch,
        tensors: plan.len(),
        metadata_keys: md.len(),
        bytes,
    })
}

/// The directory's own name (`general.name`), `model` when it has none.
fn fs_name(dir: &Path) -> String {
    std::fs::canonicalize(dir)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}

/// `vals` as `ty`'s bytes, appended to `buf`.
fn encode(vals: &[f32], ty: GgmlType, buf: &mut Vec<u8>) -> Result<()> {
    match ty.name {
        "F32" => buf.extend(vals.iter().flat_map(|v| v.to_le_bytes())),
        "F16" => {
            for (i, &v) in vals.iter().enumerate() {
                let h = half::f16::from_f32(v);
                if h.is_infinite() {
                    bail!(
                        "value {v} at element {i} does not fit in f16; export with --type bf16 or f32"
                    );
                }
                buf.extend_from_slice(&h.to_le_bytes());
            }
        }
        _ => {
            let n = ty
                .bytes_for(vals.len() as u64)
                .context("not whole blocks")? as usize;
            buf.resize(n, 0);
            super::quantize::quantize(ty, vals, buf)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
