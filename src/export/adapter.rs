//! `memwall export --adapter DIR`: a LoRA adapter merged into the weights as they stream
//! out, one tensor at a time ([`crate::ckpt::adapter::merge_tensor`], the update `memwall
//! merge` adds), so the file equals `merge` then `export` without a merged copy of the model
//! on disk or in memory. The adapter's chat template (`chat_template.jinja`, which a chat
//! run's checkpoints carry) replaces the base's `tokenizer.chat_template`.

use crate::ckpt::adapter::{load_adapter, merge_tensor, resolve_dir};
use crate::gguf::file::Value;
use crate::model::ParamLayout;
use crate::model::lora::AdapterLayout;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// An adapter to merge: where it was read, its layout and values.
pub(super) struct Adapter {
    pub dir: PathBuf,
    pub layout: AdapterLayout,
    /// Every adapter's A and B (`layout.params.total`).
    values: Vec<f32>,
}

impl Adapter {
    /// Reads `--adapter` (an adapter directory, or a LoRA run's directory: its newest
    /// checkpoint) for the base whose parameters are `base`, checked against it before the
    /// output is opened, and puts its chat template, when it has one, in `md`.
    pub fn load(
        dir: &Path,
        base_dir: &Path,
        base: &ParamLayout,
        md: &mut Vec<(String, Value)>,
    ) -> Result<Adapter> {
        let dir = resolve_dir(dir)?;
        let (layout, values) =
            load_adapter(&dir, base).with_context(|| format!("--adapter {}", dir.display()))?;
        if let Some(trained_on) = other_base(&dir, base_dir) {
            eprintln!(
                "note: the adapter {} was trained on {} (its adapter_config.json's \
                 base_model_name_or_path), not on {}; its update is merged into {} as asked",
                dir.display(),
                trained_on.display(),
                base_dir.display(),
                base_dir.display()
            );
        }
        let template = dir.join(crate::ckpt::CHAT_TEMPLATE_FILE);
        if template.is_file() {
            let text = std::fs::read_to_string(&template)
                .with_context(|| format!("cannot read {}", template.display()))?;
            md.retain(|(k, _)| k != "tokenizer.chat_template");
            md.push(("tokenizer.chat_template".into(), Value::String(text)));
        }
        Ok(Adapter {
            dir,
            layout,
            values,
        })
    }

    /// Adds into `w` (the values of `base.tensors[tensor]`) the update of every adapter on it.
    pub fn merge(&self, base: &ParamLayout, tensor: usize, w: &mut [f32]) {
        merge_tensor(&self.layout, base, tensor, w, &self.values);
    }
}

/// The base the adapter in `dir` records (`base_model_name_or_path`) when that is a
/// directory here other than `base_dir`: merging into another model of the same shapes (a
/// full fine-tune of it, say) is allowed but rarely meant. `None` when it records a hub
/// name, a path that no longer exists, or `base_dir` itself.
fn other_base(dir: &Path, base_dir: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(dir.join(crate::ckpt::ADAPTER_CONFIG_FILE)).ok()?;
    let config: serde_json::Value = serde_json::from_str(&text).ok()?;
    let recorded = PathBuf::from(config["base_model_name_or_path"].as_str()?);
    let (r, b) = (
        std::fs::canonicalize(&recorded).ok()?,
        std::fs::canonicalize(base_dir).ok()?,
    );
    // A GGUF file's conversion in the user cache is that file.
    let converted_from_it = crate::gguf::cache::sources_of(&b).contains(&r);
    (r != b && !converted_from_it).then_some(recorded)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{export_to_with, tiny_dir};
    use super::super::{ExportOptions, ExportType};
    use crate::ckpt::adapter::{merge, save_adapter};
    use crate::gguf::file::{GgufFile, Value};
    use crate::model::ParamLayout;
    use crate::model::lora::{AdapterLayout, LoraSpec, parse_targets};
    use std::fs;
    use std::path::Path;

    /// A PEFT adapter on `base` with values that are not the initial ones (B ≠ 0).
    fn adapter(base: &Path, dir: &Path, targets: &str) -> usize {
        let layout = ParamLayout::new(&crate::ckpt::load_spec(base).unwrap());
        let lora = LoraSpec {
            r: 2,
            alpha: 4.0,
            dropout: 0.0,
            targets: parse_targets(targets, layout.family).unwrap(),
        };
        let a = AdapterLayout::new(&layout, lora).unwrap();
        let values: Vec<f32> = (0..a.params.total)
            .map(|i| ((i * 7919) % 101) as f32 / 101.0 - 0.5)
            .collect();
        save_adapter(dir, &a, &values, &base.display().to_string()).unwrap();
        a.layers.len()
    }

    fn opts(input: &Path, out: &Path, adapter: Option<&Path>) -> ExportOptions {
        ExportOptions {
            input: input.to_path_buf(),
            out: out.to_path_buf(),
            ty: ExportType::F32,
            name: Some("m".into()),
            adapter: adapter.map(Path::to_path_buf),
            progress: false,
        }
    }

    #[test]
    fn an_adapter_merged_on_the_way_equals_merge_then_export() {
        for (arch, targets) in [
            ("llama", "q,k,v,o,gate,up,down"),
            ("qwen2", "q,v"),
            ("gpt2", "all"),
        ] {
            let tmp = tempfile::tempdir().unwrap();
            let base = tiny_dir(tmp.path(), arch);
            let ad = tmp.path().join("adapter");
            let layers = adapter(&base, &ad, targets);
            let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
            fs::write(ad.join(crate::ckpt::CHAT_TEMPLATE_FILE), template).unwrap();

            let merged_on_the_way = tmp.path().join("a.gguf");
            let s = export_to_with(&opts(&base, &merged_on_the_way, Some(&ad))).unwrap();
            assert_eq!(s.merged, Some((ad.clone(), layers)), "{arch}");
            let merged_dir = tmp.path().join("merged");
            merge(&base, &ad, &merged_dir, false).unwrap();
            let merged_first = tmp.path().join("b.gguf");
            export_to_with(&opts(&merged_dir, &merged_first, None)).unwrap();
            let plain = tmp.path().join("c.gguf");
            export_to_with(&opts(&base, &plain, None)).unwrap();

            let (a, b, c) = (
                GgufFile::open(&merged_on_the_way).unwrap(),
                GgufFile::open(&merged_first).unwrap(),
                GgufFile::open(&plain).unwrap(),
            );
            let mut changed = 0;
            for t in &a.tensors {
                let data = a.tensor_data(t);
                assert!(
                    data == b.tensor_data(b.tensor(&t.name).unwrap()),
                    "{arch} {}: merged on the way differs from merge then export",
                    t.name
                );
                changed += usize::from(data != c.tensor_data(c.tensor(&t.name).unwrap()));
            }
            assert_eq!(
                changed, layers,
                "{arch}: one changed tensor per adapted layer"
            );
            assert_eq!(
                a.get("tokenizer.chat_template"),
                Some(&Value::String(template.into())),
                "{arch}: the adapter's chat template"
            );
        }
    }

    #[test]
    fn an_adapter_trained_on_another_directory_is_noticed() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tiny_dir(tmp.path(), "llama");
        let ad = tmp.path().join("adapter");
        adapter(&base, &ad, "q,v"); // records `base`
        assert_eq!(super::other_base(&ad, &base), None);
        let copy = tmp.path().join("copy");
        fs::create_dir(&copy).unwrap();
        assert_eq!(super::other_base(&ad, &copy), Some(base.clone()));
        // A recorded hub name or a vanished path says nothing.
        let cfg = ad.join(crate::ckpt::ADAPTER_CONFIG_FILE);
        let text = fs::read_to_string(&cfg).unwrap();
        fs::write(
            &cfg,
            text.replace(&base.display().to_string(), "HuggingFaceTB/SmolLM2-135M"),
        )
        .unwrap();
        assert_eq!(super::other_base(&ad, &copy), None);
    }

    #[test]
    fn a_foreign_adapter_is_refused_before_the_file_is_written() {
        let tmp = tempfile::tempdir().unwrap();
        let llama = tiny_dir(tmp.path(), "llama");
        let gpt2 = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny-gpt2");
        let ad = tmp.path().join("gpt2-adapter");
        adapter(&gpt2, &ad, "attn");
        let out = tmp.path().join("out.gguf");
        let e = format!(
            "{:#}",
            export_to_with(&opts(&llama, &out, Some(&ad))).unwrap_err()
        );
        assert!(
            e.contains("--adapter") && e.contains("adapter_config.json"),
            "{e}"
        );
        assert!(!out.exists());
        let missing = tmp.path().join("nothing-here");
        let e = format!(
            "{:#}",
            export_to_with(&opts(&llama, &out, Some(&missing))).unwrap_err()
        );
        assert!(e.contains("nothing-here"), "{e}");
        assert!(!out.exists());
    }
}
