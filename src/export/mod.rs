//! `memwall export DIR --gguf OUT.gguf --type T`: a model directory (a checkpoint, or any
//! Hugging Face directory memwall loads) as one GGUF file that llama.cpp runs.
//!
//! Families: Llama (`llama`: Llama 3, SmolLM2, Mistral), Qwen2 (`qwen2`), Qwen3 (`qwen3`),
//! Phi-3 (`phi3`), Gemma 3 (`gemma3`, see `gemma3_metadata`) and GPT-2 (`gpt2`, see
//! [`gpt2`]). What is written follows llama.cpp's `convert_hf_to_gguf.py`:
//!
//! - metadata: `general.architecture`, `.type` `model`, `.name` (the directory's name unless given), `.file_type`
//!   (`llama_ftype`), `.quantization_version` 2; `memwall.exported_by` (memwall's version: a
//!   later export replaces only a file that has it, [`inputs::check_replaceable`]); `{arch}.vocab_size`, `.context_length`,
//!   `.embedding_length`, `.block_count`, `.feed_forward_length`, `.rope.dimension_count`,
//!   `.attention.head_count`, `.head_count_kv`, `.rope.freq_base`,
//!   `.attention.layer_norm_rms_epsilon` (and `.attention.key_length` / `.value_length` when
//!   the head size is not width / heads); the tokenizer ([`vocab`]).
//! - tensors under GGUF's names ([`crate::gguf::hf::gguf_tensor_name`]), in the directory's order,
//!   dims innermost first; `llama` Q and K rows permuted to llama.cpp's order
//!   ([`crate::gguf::hf::permute_rows`], the inverse of what `convert` undoes); each tensor's type
//!   as llama.cpp's llama-quantize picks it for `--type` ([`ftype`], [`mixing`]: 1-D tensors
//!   F32; Q4_K_M's Q6_K layers, the output tensor's Q6_K or Q8_0, the K-quants' fallbacks for
//!   rows that are not whole super-blocks), written by [`crate::gguf::quantize`]'s reference
//!   quantizers; a tied LM head is not written (llama.cpp reuses `token_embd`).
//!
//! - Llama 3 rope scaling: the `rope_freqs.weight` tensor (F32, `head_dim / 2` factors) first,
//!   as the converter yields it ([`crate::gguf::rope_freqs`]); no other metadata.
//! - Gemma 3: every norm written as `1 + w` (`Gemma3Model.norm_shift`), its four norms a
//!   layer under their GGUF names ([`crate::gguf::hf::gguf_tensor_name_in`]); what a llama.cpp
//!   file cannot say is refused by name ([`check_gemma3`]).
//!
//! Every check that can fail is made before the file is opened: the family, the tokenizer,
//! every tensor's name and block fit. The weights are then read tensor by tensor from the
//! directory's safetensors ([`crate::ckpt::load_params_by`], NaN and infinity refused) and
//! written as they come ([`crate::gguf::write::write_gguf`]: atomic, one tensor in memory).
//!
//! The tokenizer metadata is [`vocab`]'s: the source file's own keys when the directory
//! holds them ([`crate::gguf::sidecar`]), else rebuilt from `tokenizer.json`.
//!
//! A GGUF file given as the input is read in place (its tensors dequantized one at a time,
//! its own tokenizer keys kept, no f32 copy on disk): byte for byte its conversion's export.
//! What the command line names is resolved first ([`inputs`]): a run's newest checkpoint, an
//! adapter's recorded base, the file's name, an output that is a directory or the input.
//! `--adapter` merges a LoRA adapter into each weight as it streams out (`adapter`).
//!
//! **Invariant:** an export writes neither inside the model it reads (a GGUF base's file, and
//! the GGUF files a cached conversion was made from, included) nor over a file it did not
//! export (`memwall.exported_by`).

mod adapter;
pub mod ftype;
pub mod gpt2;
mod gpt2_vocab;
pub mod inputs;
pub mod mixing;
mod spm;
mod tokens;
pub mod vocab;

pub use ftype::{EXPORT_TYPES, ExportType};

use crate::dtype::GgmlType;
use crate::gguf::file::Value;
use crate::gguf::hf::{Arch, gguf_tensor_name, gguf_tensor_name_in, permute_rows};
use crate::gguf::write::{TensorSpec, write_gguf};
use crate::model::{Family, ModelSpec, Position, RopeScaling};
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
    /// A PEFT adapter (or a LoRA run's directory: its newest checkpoint) for the model in
    /// `input`, merged into each weight as it is written, as `memwall merge` would; its
    /// chat template, when it has one, replaces the base's.
    pub adapter: Option<PathBuf>,
    /// A progress bar on stderr (for models of 100 MB or more, on a terminal).
    pub progress: bool,
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct ExportSummary {
    pub out: PathBuf,
    pub architecture: &'static str,
    pub tensors: usize,
    pub metadata_keys: usize,
    pub bytes: u64,
    /// The adapter merged on the way: its directory and how many weights took its update.
    pub merged: Option<(PathBuf, usize)>,
}

/// GGUF's architecture name for a family.
fn arch_of(spec: &ModelSpec) -> &'static str {
    match spec.family {
        Family::Llama => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        // llama.cpp's convert_hf_to_gguf.py registers MistralForCausalLM on its LlamaModel
        // (`model_arch = gguf.MODEL_ARCH.LLAMA`): a Mistral GGUF is a `llama` one, Q and K
        // permuted alike.
        Family::Mistral => "llama",
        // convert_hf_to_gguf.py's `Phi3MiniModel`: `MODEL_ARCH.PHI3`, q|k|v and gate|up kept
        // fused, no permutation (llama.cpp rotates phi3 NEOX-style, as HF does).
        Family::Phi3 => "phi3",
        Family::Gemma3 => "gemma3",
        Family::Gpt2 => "gpt2",
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
    let mut md = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name.into())),
        ("general.file_type".into(), Value::U32(ty.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        inputs::export_mark(),
    ];
    if spec.family == Family::Gpt2 {
        md.extend(gpt2::metadata(spec));
        return Ok(md);
    }
    let theta = match spec.position {
        Position::Rotary { theta, .. } => theta,
        Position::Learned => bail!("{}: a rotary model was expected", dir.display()),
    };
    let u = |x: usize| Value::U32(x as u32);
    let k = |s: &str| format!("{arch}.{s}");
    if spec.family == Family::Phi3 {
        md.extend(phi3_metadata(spec, theta));
        return Ok(md);
    }
    if spec.family == Family::Gemma3 {
        md.extend(gemma3_metadata(spec, theta));
        return Ok(md);
    }
    md.extend([
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
    ]);
    // llama.cpp's converter writes the lengths whenever config.json has `head_dim`, which
    // every Qwen3 config has (convert_hf_to_gguf.py, `TextModel.set_gguf_parameters`).
    if spec.family == Family::Qwen3 || spec.head_dim * spec.n_head != spec.n_embd {
        md.push((k("attention.key_length"), u(spec.head_dim)));
        md.push((k("attention.value_length"), u(spec.head_dim)));
    }
    Ok(md)
}

/// The `phi3.*` keys `Phi3MiniModel.set_gguf_parameters` writes (no `vocab_size`, no key
/// lengths; the sliding window 0 when there is none; LongRoPE's attention factor).
fn phi3_metadata(spec: &ModelSpec, theta: f32) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    let k = |s: &str| format!("phi3.{s}");
    let longrope = match &spec.position {
        Position::Rotary {
            scaling: Some(RopeScaling::LongRope(l)),
            ..
        } => Some(l),
        _ => None,
    };
    // The pretraining context: LongRoPE's, else the context (Phi-3-mini-4k's configs give
    // `original_max_position_embeddings` equal to it).
    let original = longrope.map_or(spec.n_positions, |l| l.original_max_position_embeddings);
    let mut md = vec![
        (k("context_length"), u(spec.n_positions)),
        (k("rope.scaling.original_context_length"), u(original)),
        (k("embedding_length"), u(spec.n_embd)),
        (k("feed_forward_length"), u(spec.mlp_hidden)),
        (k("block_count"), u(spec.n_layer)),
        (k("attention.head_count"), u(spec.n_head)),
        (k("attention.head_count_kv"), u(spec.n_kv_head)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(spec.norm_eps),
        ),
        (k("rope.dimension_count"), u(spec.head_dim)),
        (k("rope.freq_base"), Value::F32(theta)),
        (
            k("attention.sliding_window"),
            u(spec.sliding_window.unwrap_or(0)),
        ),
    ];
    if let Some(l) = longrope {
        md.push((
            k("rope.scaling.attn_factor"),
            Value::F32(l.attention_factor),
        ));
    }
    md
}

/// llama.cpp's layer pattern for Gemma 3: `llama_model::load_hparams` (`LLM_ARCH_GEMMA3`)
/// calls `hparams.set_swa_pattern(6)` whenever `gemma3.attention.sliding_window` is there and
/// not 0, and `set_swa_pattern` makes layer `l` a sliding one when `l % 6 < 5`
/// (`llama-hparams.cpp`). The converter writes no pattern key for Gemma 3.
const GEMMA3_PATTERN: usize = 6;

/// The θ llama.cpp rotates Gemma 3's sliding layers with (`load_hparams`, `LLM_ARCH_GEMMA3`:
/// `rope_freq_base_train_swa = 10000.0f`, scale 1), whatever the file says.
const GEMMA3_LOCAL_THETA: f32 = 10_000.0;

/// What llama.cpp's file cannot say of a Gemma 3, refused by name before anything is
/// written: a layer pattern other than the one llama.cpp derives (`GEMMA3_PATTERN`; a model
/// whose layers are all full is written without a window, which llama.cpp reads as no
/// sliding layer), a sliding layers' θ other than the one it assumes
/// (`GEMMA3_LOCAL_THETA`), and an attention scale other than llama.cpp's
/// `f_attention_scale`: `(n_embd / n_head)^-½` for 62 layers (it takes those for Gemma 3
/// 27B), `head_dim^-½` else, against the model's `query_pre_attn_scalar^-½`.
pub fn check_gemma3(spec: &ModelSpec) -> Result<()> {
    let Some(ll) = &spec.local_layers else {
        bail!("internal error: a Gemma 3 without layer types");
    };
    let pattern: Vec<bool> = (0..spec.n_layer)
        .map(|l| l % GEMMA3_PATTERN < GEMMA3_PATTERN - 1)
        .collect();
    let all_full = ll.sliding.iter().all(|&s| !s);
    if ll.sliding != pattern && !all_full {
        let kinds = |v: &[bool]| -> String {
            v.iter()
                .map(|&s| if s { "s" } else { "F" })
                .collect::<Vec<_>>()
                .join("")
        };
        bail!(
            "field 'layer_types' is {} (s: sliding, F: full); a gemma3 GGUF file has no layer \
             pattern: llama.cpp makes every 6th layer full ({}), so it would compute another \
             model. llama.cpp cannot run this model",
            kinds(&ll.sliding),
            kinds(&pattern)
        );
    }
    if !all_full && ll.rope_theta != GEMMA3_LOCAL_THETA {
        bail!(
            "field 'rope_local_base_freq' is {}; llama.cpp rotates Gemma 3's sliding layers \
             with θ {GEMMA3_LOCAL_THETA} whatever the file says, so it would compute another \
             model",
            ll.rope_theta
        );
    }
    // llama.cpp's `f_attention_scale`: (n_embd / n_head)^-½ for 62 layers, head_dim^-½ else.
    let (scalar, why) = match spec.n_layer {
        62 => (
            spec.n_embd / spec.n_head,
            "the model has 62 layers, which llama.cpp takes for Gemma 3 27B: it divides \
             scores by the root of hidden_size / num_attention_heads",
        ),
        _ => (
            spec.head_dim,
            "llama.cpp divides a Gemma 3's scores by the root of head_dim (but for 27B's 62 \
             layers)",
        ),
    };
    if spec.attention_scale_dim() != scalar as f32 {
        bail!(
            "field 'query_pre_attn_scalar' is {}; {why}, {scalar}, so it would compute another \
             model. llama.cpp cannot run this model",
            spec.attention_scale_dim()
        );
    }
    Ok(())
}

/// The `gemma3.*` keys `convert_hf_to_gguf.py` writes for a Gemma 3 text model: those of
/// `TextModel.set_gguf_parameters` (block count, context, width, MLP width, head counts, the
/// full layers' linear scaling as `rope.scaling.type` / `.factor`, `rope.freq_base`, the
/// sliding layers' θ as `rope.freq_base_swa` (from `rope_local_base_freq`, mirrored into
/// `rope_parameters` by `TextModel.__init__`), the RMS epsilon, `attention.key_length` /
/// `.value_length` from `head_dim`), then `Gemma3Model.set_gguf_parameters`' (the same keys
/// again, in place, and `attention.sliding_window` unless `sliding_window_pattern` is 1,
/// i.e. unless no layer slides). No `vocab_size`, no `rope.dimension_count` (llama.cpp's
/// default is the key length), no layer pattern.
fn gemma3_metadata(spec: &ModelSpec, theta: f32) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    let k = |s: &str| format!("gemma3.{s}");
    let mut md = vec![
        (k("block_count"), u(spec.n_layer)),
        (k("context_length"), u(spec.n_positions)),
        (k("embedding_length"), u(spec.n_embd)),
        (k("feed_forward_length"), u(spec.mlp_hidden)),
        (k("attention.head_count"), u(spec.n_head)),
        (k("attention.head_count_kv"), u(spec.n_kv_head)),
    ];
    if let Position::Rotary {
        scaling: Some(RopeScaling::Linear { factor }),
        ..
    } = &spec.position
    {
        md.push((k("rope.scaling.type"), Value::String("linear".into())));
        md.push((k("rope.scaling.factor"), Value::F32(*factor)));
    }
    md.push((k("rope.freq_base"), Value::F32(theta)));
    let ll = spec.local_layers.as_ref();
    if let Some(ll) = ll {
        md.push((k("rope.freq_base_swa"), Value::F32(ll.rope_theta)));
    }
    md.extend([
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(spec.norm_eps),
        ),
        (k("attention.key_length"), u(spec.head_dim)),
        (k("attention.value_length"), u(spec.head_dim)),
    ]);
    // llama.cpp's window is transformers': a key `n_swa` or more positions back is masked
    // (`llama_hparams::is_masked_swa`, `LLAMA_SWA_TYPE_STANDARD`: `p1 - p0 >= n_swa`).
    let slides = ll.is_some_and(|ll| ll.sliding.iter().any(|&s| s));
    if let (true, Some(w)) = (slides, spec.sliding_window) {
        md.push((k("attention.sliding_window"), u(w)));
    }
    md
}

/// Phi-3's `rope_factors_long` and `rope_factors_short` tensors (F32 `[hd/2]`, in that order,
/// before the model's, as `Phi3MiniModel.generate_extra_tensors` yields them) when the model
/// has LongRoPE.
fn rope_factor_tensors(spec: &ModelSpec) -> Vec<Planned> {
    let Position::Rotary {
        scaling: Some(RopeScaling::LongRope(l)),
        ..
    } = &spec.position
    else {
        return vec![];
    };
    [("long", &l.long_factor), ("short", &l.short_factor)]
        .into_iter()
        .map(|(which, f)| Planned {
            spec: TensorSpec {
                name: format!("rope_factors_{which}.weight"),
                dims: vec![f.len() as u64],
                ty: GgmlType::F32,
            },
            source: Source::Values(f.clone()),
            reorder: Reorder::None,
        })
        .collect()
}

/// Where a tensor's values come from.
enum Source {
    /// A layout tensor, by index.
    Layout(usize),
    /// Values computed here (`rope_freqs`).
    Values(Vec<f32>),
}

/// How a layout tensor's values are rearranged on their way out.
#[derive(Clone, Copy)]
enum Reorder {
    None,
    /// llama.cpp's Q/K row permutation with this many heads.
    Permute(usize),
    /// A GPT-2 Conv1D weight `[in, out]` written `[out, in]`.
    Transpose,
    /// Gemma 3's norms: this added to every value (`Gemma3Model.norm_shift`, 1).
    Shift(f32),
}

/// One tensor to write: its info, where its values come from and how they are reordered.
struct Planned {
    spec: TensorSpec,
    source: Source,
    reorder: Reorder,
}

/// Llama 3's `rope_freqs` tensor when the model has that scaling.
fn rope_freqs_tensor(spec: &ModelSpec) -> Option<Planned> {
    let Position::Rotary {
        theta,
        scaling: Some(RopeScaling::Llama3(s)),
    } = spec.position
    else {
        return None;
    };
    let p = crate::gguf::rope_freqs::Llama3Params {
        factor: s.factor,
        low_freq_factor: s.low_freq_factor,
        high_freq_factor: s.high_freq_factor,
        original_max_position_embeddings: s.original_max_position_embeddings,
    };
    let vals = crate::gguf::rope_freqs::factors(spec.head_dim, theta, &p);
    Some(Planned {
        spec: TensorSpec {
            name: crate::gguf::rope_freqs::TENSOR.into(),
            dims: vec![vals.len() as u64],
            ty: GgmlType::F32,
        },
        source: Source::Values(vals),
        reorder: Reorder::None,
    })
}

/// Exports `o.input` to `o.out` (see the module doc).
pub fn export(o: &ExportOptions) -> Result<ExportSummary> {
    let dir = &o.input;
    // A GGUF file is read in place: its tensors dequantized one at a time, its own
    // tokenizer keys kept, no f32 copy on disk.
    let gguf = match crate::util::sniff::is_gguf(dir) {
        true => Some(GgufInput::open(dir)?),
        false if dir.is_file() => bail!(
            "{}: a file, and not a GGUF file; `memwall export` takes a model or checkpoint \
             directory (config.json, model.safetensors, tokenizer.json) or a GGUF file",
            dir.display()
        ),
        false => None,
    };
    let spec = match &gguf {
        Some(g) => g.spec.clone(),
        None => crate::ckpt::load_spec(dir)?,
    };
    inputs::check_replaceable(&o.out)?;
    if spec.family == Family::Gemma3 {
        check_gemma3(&spec).with_context(|| {
            format!(
                "{}: this Gemma 3 cannot be written as a gemma3 GGUF file",
                dir.display()
            )
        })?;
    }
    // llama.cpp's qwen2 and qwen3 read no window (its converter writes none for them), so
    // the file would compute another model.
    if matches!(spec.family, Family::Qwen2 | Family::Qwen3) && spec.sliding_window.is_some() {
        bail!(
            "{}: a {} with sliding-window layers ('use_sliding_window' true) cannot be written \
             as a GGUF file: llama.cpp's {} attends over the whole context in every layer",
            dir.display(),
            spec.family.model_type(),
            spec.family.model_type()
        );
    }
    let arch = arch_of(&spec);
    let name = o.name.clone().unwrap_or_else(|| fs_name(dir));
    let mut md = model_metadata(&spec, arch, &name, o.ty, dir)?;
    match &gguf {
        Some(g) => md.extend(crate::gguf::sidecar::tokenizer_keys(&g.file)),
        None => md.extend(vocab::metadata(dir, &spec)?),
    }
    let layout = crate::model::ParamLayout::new(&spec);
    let mut plan: Vec<Planned> = rope_freqs_tensor(&spec).into_iter().collect();
    plan.extend(rope_factor_tensors(&spec));
    // Each tensor's GGUF name, whether it is transposed (GPT-2's Conv1D weights), and its
    // dims innermost first, as GGUF stores them: [cols, rows] (a transposed [in, out]
    // weight is written [out, in]).
    let mut named = Vec::with_capacity(layout.tensors.len());
    for t in &layout.tensors {
        let (g, transpose) = if arch == "gpt2" {
            gpt2::tensor_name(&t.name)?
        } else {
            let name = match spec.family {
                Family::Gemma3 => gguf_tensor_name_in(Arch::Gemma3, &t.name),
                _ => gguf_tensor_name(&t.name),
            };
            let g = name.with_context(|| {
                format!(
                    "tensor {} has no GGUF name (memwall's {arch} layout)",
                    t.name
                )
            })?;
            (g, false)
        };
        let dims: Vec<u64> = if transpose {
            t.shape.iter().map(|&d| d as u64).collect()
        } else {
            t.shape.iter().rev().map(|&d| d as u64).collect()
        };
        named.push((g, transpose, dims));
    }
    let list: Vec<(&str, &[u64])> = named
        .iter()
        .map(|(g, _, d)| (g.as_str(), d.as_slice()))
        .collect();
    let mix = mixing::MixModel {
        arch,
        n_layer: spec.n_layer,
        n_head: spec.n_head,
        n_kv_head: spec.n_kv_head,
    };
    let types = mixing::tensor_types(o.ty, mix, &list)
        .with_context(|| format!("--type {:?} for {}", o.ty, dir.display()))?;
    for (i, ((g, transpose, dims), ty)) in named.into_iter().zip(types).enumerate() {
        let hf = &layout.tensors[i].name;
        let reorder = match arch {
            "llama" if g.contains(".attn_q.") => Reorder::Permute(spec.n_head),
            "llama" if g.contains(".attn_k.") => Reorder::Permute(spec.n_kv_head),
            // `Gemma3Model.norm_shift`: 1 for every HF name ending in `norm.weight`.
            "gemma3" if hf.ends_with("norm.weight") => Reorder::Shift(1.0),
            _ if transpose => Reorder::Transpose,
            _ => Reorder::None,
        };
        let ts = TensorSpec { name: g, dims, ty };
        ts.n_bytes()
            .with_context(|| format!("--type {:?} for {}", o.ty, dir.display()))?;
        plan.push(Planned {
            spec: ts,
            source: Source::Layout(i),
            reorder,
        });
    }
    let adapter = match &o.adapter {
        Some(a) => Some(adapter::Adapter::load(a, dir, &layout, &mut md)?),
        None => None,
    };
    let specs: Vec<TensorSpec> = plan.iter().map(|p| p.spec.clone()).collect();
    let bar = progress_bar(o.progress, &specs);
    let fill = |copy: &mut crate::ckpt::CopyParams<'_>| {
        write_gguf(&o.out, &md, &specs, |i, buf| {
            let p = &plan[i];
            bar.set_message(p.spec.name.clone());
            let t = match &p.source {
                Source::Values(v) => {
                    bar.inc(1);
                    return encode(v, p.spec.ty, buf);
                }
                Source::Layout(j) => &layout.tensors[*j],
            };
            let mut vals = vec![0f32; t.range.len()];
            copy(t.range.clone(), &mut vals)?;
            if let (Some(a), Source::Layout(j)) = (&adapter, &p.source) {
                a.merge(&layout, *j, &mut vals);
            }
            let cols = t.shape.get(1).copied().unwrap_or(1);
            match p.reorder {
                Reorder::None => {}
                Reorder::Permute(heads) => {
                    let mut out = vec![0f32; vals.len()];
                    permute_rows(&vals, &mut out, heads, cols)
                        .with_context(|| format!("tensor {}", t.name))?;
                    vals = out;
                }
                Reorder::Transpose => vals = transpose(&vals, cols),
                Reorder::Shift(x) => vals.iter_mut().for_each(|v| *v += x),
            }
            encode(&vals, p.spec.ty, buf).with_context(|| format!("tensor {}", t.name))?;
            bar.inc(1);
            Ok(())
        })
    };
    match &gguf {
        Some(g) => g.values_by(&layout, fill),
        None => crate::ckpt::load_params_by(dir, &layout, fill),
    }
    .with_context(|| format!("exporting {} to {}", dir.display(), o.out.display()))?;
    bar.finish_and_clear();
    let bytes = std::fs::metadata(&o.out)
        .with_context(|| format!("cannot stat {}", o.out.display()))?
        .len();
    Ok(ExportSummary {
        out: o.out.clone(),
        architecture: arch,
        tensors: plan.len(),
        metadata_keys: md.len(),
        bytes,
        merged: adapter.map(|a| (a.dir, a.layout.layers.len())),
    })
}

/// A bar over the tensors to write, drawn when asked for and the model is 100 MB or more.
fn progress_bar(progress: bool, specs: &[TensorSpec]) -> indicatif::ProgressBar {
    let bytes: u64 = specs.iter().filter_map(|s| s.n_bytes().ok()).sum();
    if !progress || bytes < 100_000_000 {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(specs.len() as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} tensors {msg} eta {eta}")
            .expect("a valid template"),
    );
    bar
}

/// The directory's own name, or a file's stem (`general.name`), `model` when it has none.
fn fs_name(dir: &Path) -> String {
    std::fs::canonicalize(dir)
        .ok()
        .and_then(|p| match p.is_file() {
            true => p.file_stem().map(|n| n.to_string_lossy().into_owned()),
            false => p.file_name().map(|n| n.to_string_lossy().into_owned()),
        })
        .unwrap_or_else(|| "model".into())
}

/// A GGUF file exported in place: the file, its tensors under Hugging Face names, and the
/// model they make.
struct GgufInput {
    file: crate::gguf::GgufFile,
    model: crate::gguf::hf::HfModel,
    spec: ModelSpec,
}

impl GgufInput {
    /// Opens and maps the file; every tensor type checked decodable before anything is
    /// written.
    fn open(path: &Path) -> Result<GgufInput> {
        let file = crate::gguf::GgufFile::open(path)?;
        let model = crate::gguf::hf::map_model(&file)?;
        for t in &file.tensors {
            crate::dtype::dequant::check_supported(t.ty)
                .with_context(|| format!("{}: tensor {}", path.display(), t.name))?;
        }
        let config = model.config_json("float32").to_string();
        let spec = ModelSpec::from_hf_config_str(&config, &path.display().to_string())?;
        Ok(GgufInput { file, model, spec })
    }

    /// Lends `fill` a copier of the layout's values, as [`crate::ckpt::load_params_by`]
    /// does for a directory: a range is one tensor's, dequantized when it is asked for.
    fn values_by(
        &self,
        layout: &crate::model::ParamLayout,
        fill: impl FnOnce(&mut crate::ckpt::CopyParams<'_>) -> Result<()>,
    ) -> Result<()> {
        let path = self.file.path().display().to_string();
        let mut copy = |range: std::ops::Range<usize>, dst: &mut [f32]| -> Result<()> {
            let t = (layout.tensors.iter())
                .find(|t| t.range == range)
                .with_context(|| format!("internal error: {range:?} is no tensor's range"))?;
            let hf = (self.model.tensors.iter())
                .find(|h| h.name == t.name)
                .with_context(|| format!("{path}: no tensor maps to {}", t.name))?;
            let vals = crate::gguf::convert::hf_values(&self.file, hf)
                .with_context(|| format!("{path}: tensor {}", hf.gguf))?;
            if vals.len() != dst.len() {
                bail!(
                    "{path}: tensor {} holds {} values, {} takes {}",
                    hf.gguf,
                    vals.len(),
                    t.name,
                    dst.len()
                );
            }
            dst.copy_from_slice(&vals);
            Ok(())
        };
        fill(&mut copy)
    }
}

/// `vals` `[rows, cols]` row-major as `[cols, rows]`.
fn transpose(vals: &[f32], cols: usize) -> Vec<f32> {
    let rows = vals.len() / cols;
    let mut out = vec![0f32; vals.len()];
    for (r, row) in vals.chunks_exact(cols).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            out[c * rows + r] = v;
        }
    }
    out
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
            crate::gguf::quantize::quantize(ty, vals, buf)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
