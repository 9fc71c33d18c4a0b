//! LoRA adapters on disk as PEFT keeps them, so that `peft.PeftModel.from_pretrained(base,
//! dir)` loads what memwall writes and memwall trains on what PEFT wrote:
//!
//! | file                        | content                                                 |
//! |-----------------------------|---------------------------------------------------------|
//! | `adapter_config.json`       | [`AdapterConfig`]: `peft_type` LORA, `r`, `lora_alpha`, `target_modules`, `fan_in_fan_out`, ... |
//! | `adapter_model.safetensors` | every adapter's `lora_A.weight` / `lora_B.weight` under PEFT's name, F32 |
//!
//! Each file is written atomically. Loading reads the config, checks the adapters against
//! the base they are put on (its family, every adapted layer present with the adapter's
//! shapes), then copies tensor by tensor as model weights are loaded (F32, F16 or BF16,
//! every value checked finite); an error names the file and what does not fit.

use super::names::resolve_exact;
use super::safetensors_io::{
    OutData, OutTensor, Sources, StFile, Target, Whole, check_targets, copy_targets,
    write_safetensors,
};
use crate::model::ParamLayout;
use crate::model::lora::{AdapterConfig, AdapterLayout, LoraSpec};
use crate::util::atomic;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

pub use super::files::{ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE};

/// Writes `adapters` with their values `params` (`adapters.params.total` elements) into `dir`
/// (created if needed) as PEFT does; `base` is recorded as `base_model_name_or_path`.
pub fn save_adapter(
    dir: &Path,
    adapters: &AdapterLayout,
    params: &[f32],
    base: &str,
) -> Result<()> {
    let what = || format!("saving the adapter to {}", dir.display());
    if params.len() != adapters.params.total {
        bail!(
            "internal error: {} adapter values for a layout of {}",
            params.len(),
            adapters.params.total
        );
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create directory {}", dir.display()))?;
    let config = serde_json::to_vec_pretty(&adapters.config(base))?;
    atomic::write_file(&dir.join(ADAPTER_CONFIG_FILE), &config).with_context(what)?;
    let values = Whole(OutData::F32(params));
    let tensors: Vec<OutTensor> = adapters
        .params
        .tensors
        .iter()
        .map(|t| OutTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            from: &values,
            range: t.range.clone(),
        })
        .collect();
    atomic::write_with(&dir.join(ADAPTER_MODEL_FILE), |f| {
        let mut w = std::io::BufWriter::new(f);
        write_safetensors(&mut w, &tensors)?;
        std::io::Write::flush(&mut w).context("writing the adapter weights")
    })
    .with_context(what)
}

/// Adds every adapter's update into the base weight it adapts, as PEFT's
/// `merge_and_unload` does ([`merge_tensor`] for each base tensor an adapter adapts).
/// `base_values` are the base's parameters (`base.total`), `values` the adapters'
/// (`adapters.params.total`).
pub fn merge_into(
    adapters: &AdapterLayout,
    base: &ParamLayout,
    base_values: &mut [f32],
    values: &[f32],
) {
    assert_eq!(base_values.len(), base.total);
    for (i, t) in base.tensors.iter().enumerate() {
        merge_tensor(adapters, base, i, &mut base_values[t.range.clone()], values);
    }
}

/// Adds into `w`, the values of the base's tensor `tensor` (`base.tensors[tensor]`), the
/// update of every adapter on it: `W += (alpha / r) · B A` for a `[out, in]` weight, its
/// transpose for GPT-2's `[in, out]` Conv1D, computed by the f32 GEMM (PEFT computes it in
/// f32 too). A tensor no adapter adapts is left as it is. What [`merge_into`] does for the
/// whole model, one tensor at a time (an export merges as it streams).
pub fn merge_tensor(
    adapters: &AdapterLayout,
    base: &ParamLayout,
    tensor: usize,
    w: &mut [f32],
    values: &[f32],
) {
    use crate::backend::host::sgemm_acc;
    assert_eq!(values.len(), adapters.params.total);
    assert_eq!(w.len(), base.tensors[tensor].range.len());
    let (r, scale) = (adapters.spec.r, adapters.spec.scale());
    for (i, a) in adapters.layers.iter().enumerate() {
        if a.base_tensor != tensor {
            continue;
        }
        let am = &values[adapters.params.tensors[2 * i].range.clone()]; // A [r, in]
        let bm = &values[adapters.params.tensors[2 * i + 1].range.clone()]; // B [out, r]
        let (din, dout) = (a.in_features, a.out_features);
        if base.family == crate::model::Family::Gpt2 {
            // W [in, out] += scale · Aᵀ Bᵀ.
            sgemm_acc(
                (din, dout, r),
                scale,
                (am, din, true),
                (bm, r, true),
                w,
                dout,
            );
        } else {
            // W [out, in] += scale · B A.
            sgemm_acc(
                (dout, din, r),
                scale,
                (bm, r, false),
                (am, din, false),
                w,
                din,
            );
        }
    }
}

/// `--adapter DIR`: an adapter directory, or a LoRA run's directory (its newest checkpoint).
pub fn resolve_dir(dir: &Path) -> Result<PathBuf> {
    if dir.join(ADAPTER_CONFIG_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    match super::latest_checkpoint(dir) {
        Ok(Some(newest)) => Ok(newest),
        _ => Ok(dir.to_path_buf()),
    }
}

/// [`resolve_dir`], checked to hold an adapter (`flag` names the option in the error): a
/// model directory or a full fine-tune's run is named for what it is.
pub fn check_adapter_dir(dir: &Path, flag: &str) -> Result<PathBuf> {
    let resolved = resolve_dir(dir)?;
    if resolved.join(ADAPTER_CONFIG_FILE).is_file() {
        return Ok(resolved);
    }
    let what = if !dir.exists() {
        "no such directory".to_string()
    } else if resolved.join(super::CONFIG_FILE).is_file() {
        format!(
            "{} is a whole model (config.json), not a LoRA adapter: pass it as the model \
             (--model, --init or BASE), or give a checkpoint of a `train --lora` run",
            resolved.display()
        )
    } else {
        format!(
            "no {ADAPTER_CONFIG_FILE} in {} (an adapter is a checkpoint of `memwall train \
             --lora`, its run directory, or a PEFT adapter directory)",
            resolved.display()
        )
    };
    bail!("{flag} {}: {what}", dir.display())
}

/// Refuses to apply the adapter in `adapter` (resolved) to `base` (the model path as the
/// user gave it: a GGUF file or a directory) when the adapter is a checkpoint of a memwall
/// run that recorded its base's fingerprint, `base` is that same path, and it now holds
/// another model: the adapter's update would land on other weights. Adapters from elsewhere
/// (no `trainer_state.json`) and runs saved before fingerprints pass.
pub fn check_base(adapter: &Path, base: &Path) -> Result<()> {
    let state = adapter.join(super::STATE_FILE);
    let Ok(text) = std::fs::read_to_string(&state) else {
        return Ok(());
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Ok(());
    };
    let train = &v["train"];
    let (Some(want), Some(recorded)) = (
        train["base_fingerprint"].as_str(),
        train["init_gguf"].as_str().or(train["init"].as_str()),
    ) else {
        return Ok(());
    };
    let same_path = matches!(
        (std::fs::canonicalize(recorded), std::fs::canonicalize(base)),
        (Ok(a), Ok(b)) if a == b
    );
    if !base.exists() {
        return Ok(());
    }
    let found = crate::util::fingerprint::of_model(base)?;
    if !same_path {
        // Another base, named on purpose: applied as asked, said when it holds other weights.
        if found != want {
            eprintln!(
                "note: the adapter {} was trained on {} (content fingerprint {}); {} holds \
                 another model ({}): the adapter's update is applied to it as asked",
                adapter.display(),
                recorded,
                crate::util::fingerprint::short(want),
                base.display(),
                crate::util::fingerprint::short(&found)
            );
        }
        return Ok(());
    }
    if found != want {
        bail!(
            "{}: the adapter was trained on {}, which now holds another model (content \
             fingerprint {}, not {} as recorded in {}): its update would land on other weights. \
             Put the original model back at that path",
            adapter.display(),
            base.display(),
            crate::util::fingerprint::short(&found),
            crate::util::fingerprint::short(want),
            state.display()
        );
    }
    Ok(())
}

/// Whether the model directory `dir` says its weights are bfloat16 (`config.json`'s
/// `torch_dtype`, or transformers 5's `dtype`).
pub fn stored_as_bf16(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join(super::CONFIG_FILE)) else {
        return false;
    };
    let config: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    ["torch_dtype", "dtype"]
        .iter()
        .any(|k| config[*k].as_str() == Some("bfloat16"))
}

/// What [`merge`] wrote.
#[derive(Clone, Debug)]
pub struct Merged {
    /// Linear layers that took their adapter's update.
    pub layers: usize,
    /// The adapters' rank and scale.
    pub r: usize,
    pub scale: f32,
}

/// Writes into `out` the model `base` (a Hugging Face model directory) with the PEFT adapter
/// in `adapter` merged into its weights, as `merge_and_unload` does: `config.json`, the
/// weights (in bf16 with `bf16`: pass [`stored_as_bf16`]`(base)` to keep the base's dtype; F32
/// otherwise) and the base's tokenizer files. `out` must not exist or be empty. The base
/// is held in f32 while merging, and refused up front when that does not fit the memory
/// available.
pub fn merge(base: &Path, adapter: &Path, out: &Path, bf16: bool) -> Result<Merged> {
    let adapter = &resolve_dir(adapter)?;
    check_new_out_dir(out)?;
    let spec = super::load_spec(base)?;
    let layout = ParamLayout::new(&spec);
    let bytes = layout.total as u64 * 4;
    if let Some(free) = crate::util::rss::available_memory()
        && bytes > free
    {
        bail!(
            "merging holds the base in f32: {} for {}, but {} is available",
            crate::util::bytes::fmt_bytes(bytes),
            base.display(),
            crate::util::bytes::fmt_bytes(free)
        );
    }
    let (adapters, values) = load_adapter(adapter, &layout)?;
    let mut params = vec![0f32; layout.total];
    super::load_params(base, &layout, &mut params)?;
    merge_into(&adapters, &layout, &mut params, &values);
    // The chat template the adapter was trained with (a chat run's checkpoint carries it)
    // replaces the base's.
    let template = Some(adapter.join(super::CHAT_TEMPLATE_FILE)).filter(|p| p.is_file());
    let opts = super::SaveOptions {
        tokenizer_dir: Some(base),
        chat_template: template.as_deref(),
        ..Default::default()
    };
    // Written whole into a temporary sibling and renamed, so a merge killed half-way leaves
    // no partial model under `out` (and its temporary is swept by the next merge).
    let tmp = crate::util::atomic_dir::TempDir::create_for(out)?;
    super::save_model_as(&tmp.path, &spec, &layout, &params, bf16, &opts)?;
    check_new_out_dir(out)?;
    tmp.publish(out)?;
    Ok(Merged {
        layers: adapters.layers.len(),
        r: adapters.spec.r,
        scale: adapters.spec.scale(),
    })
}

/// `--out` of a command that writes a whole model directory at once (`merge`, `prune`): a
/// directory that does not exist or is empty, once what killed runs left is gone (their
/// temporary siblings `OUT.tmp-<pid>-<n>`, and the hidden temporaries older versions wrote
/// inside `OUT`, whose process no longer runs).
pub fn check_new_out_dir(out: &Path) -> Result<()> {
    use crate::util::atomic::writer_is_gone;
    let parent = crate::util::atomic::parent_dir(out);
    if let (Some(name), Ok(entries)) = (out.file_name(), std::fs::read_dir(parent)) {
        let prefix = format!("{}.tmp-", name.to_string_lossy());
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.strip_prefix(&prefix).is_some_and(writer_is_gone) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(out) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let dead = n.starts_with('.')
                && n.rsplit_once(".tmp-")
                    .is_some_and(|(_, w)| writer_is_gone(w));
            if dead {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    if out.exists() && !out.is_dir() {
        bail!("--out {}: a file; give a new directory", out.display());
    }
    if out.is_dir()
        && std::fs::read_dir(out)
            .with_context(|| format!("--out {}: cannot read the directory", out.display()))?
            .next()
            .is_some()
    {
        bail!(
            "--out {} exists and is not empty; give a new directory",
            out.display()
        );
    }
    Ok(())
}

/// The adapters `adapter_config.json` in `dir` describes, for a base of `family`.
pub fn read_config(dir: &Path, family: crate::model::Family) -> Result<LoraSpec> {
    let config_path = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&config_path).with_context(|| {
        format!(
            "{}: cannot read it (an adapter directory holds {ADAPTER_CONFIG_FILE} and {ADAPTER_MODEL_FILE})",
            config_path.display()
        )
    })?;
    let config: AdapterConfig = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a PEFT adapter config", config_path.display()))?;
    config.spec(family, &config_path.display().to_string())
}

/// Reads the PEFT adapter in `dir` for the base whose parameters are `base`: its layout
/// (from `adapter_config.json`, checked against the base) and its values.
pub fn load_adapter(dir: &Path, base: &ParamLayout) -> Result<(AdapterLayout, Vec<f32>)> {
    let mut values = Vec::new();
    let adapters = load_adapter_by(dir, base, |a, copy| {
        values = vec![0f32; a.params.total];
        copy(0..a.params.total, &mut values)
    })?;
    Ok((adapters, values))
}

/// [`load_adapter`] without a copy of its own: checks the files, then lends `fill` the
/// adapters found and a copier that reads the values of an element range of them into a
/// caller's buffer (a run's parameters, group by group where they are offloaded), the file's
/// pages released after each range.
pub fn load_adapter_by(
    dir: &Path,
    base: &ParamLayout,
    fill: impl FnOnce(&AdapterLayout, &mut super::CopyParams<'_>) -> Result<()>,
) -> Result<AdapterLayout> {
    let label = dir.join(ADAPTER_CONFIG_FILE).display().to_string();
    let spec = read_config(dir, base.family)?;
    let adapters = AdapterLayout::new(base, spec).with_context(|| {
        format!(
            "{label}: the adapter does not fit this {} base",
            base.family.model_type()
        )
    })?;
    let file = StFile::open(&dir.join(ADAPTER_MODEL_FILE))?;
    let src = Sources::single(&file);
    let targets: Vec<Target> = Target::whole_tensors(&adapters.params, "", 0).collect();
    // A pipeline stage's adapters: the other stages' are theirs to load.
    let absent = &adapters.params.absent;
    let resolve = |name: &str| match absent.iter().any(|a| a.name == name) {
        true => super::safetensors_io::Resolved::Ignore,
        false => resolve_exact(name),
    };
    let located = check_targets(&src, &resolve, &targets)?;
    let mut copy = |range: std::ops::Range<usize>, dst: &mut [f32]| -> Result<()> {
        if dst.len() != range.len() {
            bail!(
                "internal error: {} elements for adapters {range:?}",
                dst.len()
            );
        }
        let within: Vec<Target> = (targets.iter())
            .filter(|t| range.start <= t.range.start && t.range.end <= range.end)
            .map(|t| Target {
                range: t.range.start - range.start..t.range.end - range.start,
                ..t.clone()
            })
            .collect();
        let copied = copy_targets(&src, &located, &within, &mut [dst]);
        src.release_all();
        copied
    };
    fill(&adapters, &mut copy)?;
    Ok(adapters)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::{LoraSpec, parse_targets};
    use crate::model::{Family, ModelSpec};

    fn adapters(model: &str, family: Family, targets: &str) -> (ParamLayout, AdapterLayout) {
        let spec = ModelSpec::preset(model).unwrap();
        let base = ParamLayout::new(&spec);
        let lora = LoraSpec {
            r: 4,
            alpha: 8.0,
            dropout: 0.05,
            targets: parse_targets(targets, family).unwrap(),
        };
        let a = AdapterLayout::new(&base, lora).unwrap();
        (base, a)
    }

    #[test]
    fn an_adapter_saved_loads_back_bitwise_on_its_base() {
        let dir = tempfile::tempdir().unwrap();
        for (model, family) in [("llama-tiny", Family::Llama), ("gpt2-tiny", Family::Gpt2)] {
            let (base, a) = adapters(model, family, "all");
            let mut values = vec![0f32; a.params.total];
            a.params.initializer(3).fill(0..a.params.total, &mut values);
            // B is zero at the start: give it values, so the round trip sees them.
            values
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v += i as f32 * 1e-3);
            let at = dir.path().join(model);
            save_adapter(&at, &a, &values, model).unwrap();
            let config: serde_json::Value =
                serde_json::from_slice(&std::fs::read(at.join(ADAPTER_CONFIG_FILE)).unwrap())
                    .unwrap();
            assert_eq!(config["base_model_name_or_path"], model);
            assert_eq!(config["fan_in_fan_out"], family == Family::Gpt2);
            let (back, got) = load_adapter(&at, &base).unwrap();
            assert_eq!(back.spec, a.spec);
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                values.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn an_adapter_for_another_base_or_a_damaged_one_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (_, a) = adapters("llama-tiny", Family::Llama, "q,v");
        let values = vec![0.5f32; a.params.total];
        save_adapter(dir.path(), &a, &values, "llama-tiny").unwrap();
        // A GPT-2 base has no q_proj.
        let gpt2 = ParamLayout::new(&ModelSpec::preset("gpt2-tiny").unwrap());
        let e = format!("{:#}", load_adapter(dir.path(), &gpt2).unwrap_err());
        assert!(
            e.contains(ADAPTER_CONFIG_FILE) && e.contains("q_proj"),
            "{e}"
        );
        // A Llama base of other widths: the shapes differ.
        let mut wide = ModelSpec::preset("llama-tiny").unwrap();
        wide.n_embd *= 2;
        wide.head_dim *= 2;
        let e = format!(
            "{:#}",
            load_adapter(dir.path(), &ParamLayout::new(&wide)).unwrap_err()
        );
        assert!(e.contains(ADAPTER_MODEL_FILE) && e.contains("shape"), "{e}");
        // No config at all.
        std::fs::remove_file(dir.path().join(ADAPTER_CONFIG_FILE)).unwrap();
        let base = ParamLayout::new(&ModelSpec::preset("llama-tiny").unwrap());
        let e = format!("{:#}", load_adapter(dir.path(), &base).unwrap_err());
        assert!(
            e.contains(ADAPTER_CONFIG_FILE) && e.contains("cannot read"),
            "{e}"
        );
    }

    /// A merged weight computes what the base and its adapter compute together:
    /// `x W'ᵀ = x Wᵀ + (alpha / r) (x Aᵀ) Bᵀ`, for a Llama `[out, in]` and a GPT-2 Conv1D
    /// `[in, out]` weight.
    #[test]
    fn a_merged_weight_is_the_base_plus_its_adapter() {
        for (model, family) in [("llama-tiny", Family::Llama), ("gpt2-tiny", Family::Gpt2)] {
            let base = ModelSpec::preset(model).unwrap();
            let layout = crate::model::ParamLayout::new(&base);
            let a = AdapterLayout::new(
                &layout,
                LoraSpec {
                    r: 3,
                    alpha: 32.0,
                    dropout: 0.0,
                    targets: parse_targets("all", family).unwrap(),
                },
            )
            .unwrap();
            let mut rng = crate::util::rng::Rng::new(11);
            let mut w: Vec<f32> = (0..layout.total).map(|_| rng.next_f32() - 0.5).collect();
            let v: Vec<f32> = (0..a.params.total).map(|_| rng.next_f32() - 0.5).collect();
            let before = w.clone();
            merge_into(&a, &layout, &mut w, &v);
            for (i, l) in a.layers.iter().enumerate().step_by(5) {
                let (din, dout, r) = (l.in_features, l.out_features, a.spec.r);
                let x: Vec<f32> = (0..din).map(|_| rng.next_f32() - 0.5).collect();
                let t = &layout.tensors[l.base_tensor];
                let weight = |m: &[f32], o: usize, j: usize| match family {
                    Family::Gpt2 => m[t.range.start + j * dout + o],
                    _ => m[t.range.start + o * din + j],
                };
                let am = &v[a.params.tensors[2 * i].range.clone()];
                let bm = &v[a.params.tensors[2 * i + 1].range.clone()];
                let xa: Vec<f64> = (0..r)
                    .map(|k| (0..din).map(|j| x[j] as f64 * am[k * din + j] as f64).sum())
                    .collect();
                for o in (0..dout).step_by(7) {
                    let merged: f64 = (0..din)
                        .map(|j| x[j] as f64 * weight(&w, o, j) as f64)
                        .sum();
                    let base_y: f64 = (0..din)
                        .map(|j| x[j] as f64 * weight(&before, o, j) as f64)
                        .sum();
                    let lora: f64 = (0..r).map(|k| xa[k] * bm[o * r + k] as f64).sum();
                    let want = base_y + a.spec.scale() as f64 * lora;
                    assert!(
                        (merged - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{model} {}: output {o}: {merged} against {want}",
                        l.module
                    );
                }
            }
            // Every weight not adapted is untouched.
            let adapted: Vec<usize> = a.layers.iter().map(|l| l.base_tensor).collect();
            for (k, t) in layout.tensors.iter().enumerate() {
                if !adapted.contains(&k) {
                    assert_eq!(w[t.range.clone()], before[t.range.clone()], "{}", t.name);
                }
            }
        }
    }
}
