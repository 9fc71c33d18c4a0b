//! Agreement with PEFT: LoRA adapters made by PEFT (`get_peft_model` + `save_pretrained` on
//! the tiny random Llama and GPT-2, every linear layer of the blocks) load in memwall, compute
//! what PEFT computes with them, merge into what `merge_and_unload()` gives, and are written
//! back by memwall as the same files. Fixtures: tests/fixtures/peft-tiny-llama and
//! peft-tiny-gpt2 (made by make_peft_fixtures.py, with torch 2.15, transformers 5.24 and
//! peft 0.21.2), so no Python runs in CI.

use memwall::backend::under_test as backend;
use memwall::ckpt::adapter::{load_adapter, save_adapter};
use memwall::ckpt::{load_params, load_spec};
use memwall::exec::Executor;
use memwall::model::{ModelSpec, ParamLayout};
use memwall::plan::{Mode, StepConfig, build_plan};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

const CASES: [(&str, &str); 2] = [
    ("peft-tiny-llama", "hf-tiny-llama"),
    ("peft-tiny-gpt2", "hf-tiny-gpt2"),
];

struct Case {
    spec: ModelSpec,
    layout: ParamLayout,
    base: Vec<f32>,
    prompt: Vec<u32>,
    /// PEFT's logits `[T, V]` of the prompt with the adapter applied.
    logits: Vec<Vec<f64>>,
}

fn case(adapter: &str, base: &str) -> Case {
    let dir = fixture(base);
    let spec = load_spec(&dir).unwrap();
    let layout = ParamLayout::new(&spec);
    let mut values = vec![0f32; layout.total];
    load_params(&dir, &layout, &mut values).unwrap();
    let exp: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(adapter).join("expected.json")).unwrap(),
    )
    .unwrap();
    let prompt = exp["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let logits = exp["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect();
    Case {
        spec,
        layout,
        base: values,
        prompt,
        logits,
    }
}

/// memwall's merge of PEFT's adapter is `merge_and_unload()`'s model, and the merged model's
/// next-token logits are PEFT's with the adapter applied.
#[test]
fn peft_adapters_merge_as_merge_and_unload() {
    for (adapter, base) in CASES {
        let c = case(adapter, base);
        let (ad, values) = load_adapter(&fixture(adapter), &c.layout).unwrap();
        assert_eq!((ad.spec.r, ad.spec.alpha), (4, 8.0), "{adapter}");
        let mut merged = c.base.clone();
        memwall::ckpt::adapter::merge_into(&ad, &c.layout, &mut merged, &values);
        // PEFT's merged model, loaded as a model directory.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::copy(
            fixture(base).join("config.json"),
            tmp.path().join("config.json"),
        )
        .unwrap();
        std::fs::copy(
            fixture(adapter).join("merged.safetensors"),
            tmp.path().join("model.safetensors"),
        )
        .unwrap();
        let mut want = vec![0f32; c.layout.total];
        load_params(tmp.path(), &c.layout, &mut want).unwrap();
        assert_ne!(want, c.base, "{adapter}: the adapter changes nothing");
        for t in &c.layout.tensors {
            for i in t.range.clone() {
                let (a, b) = (merged[i], want[i]);
                assert!(
                    (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                    "{adapter}: {}[{}]: memwall {a} vs merge_and_unload {b}",
                    t.name,
                    i - t.range.start
                );
            }
        }
        // Next-token logits of the merged model against PEFT's with the adapter.
        let t = c.prompt.len();
        let plan = build_plan(
            &c.spec,
            &StepConfig::new(1, t, 2),
            Mode::Generate,
            backend(),
        )
        .unwrap();
        let mut ex = Executor::on(plan, backend()).unwrap();
        ex.with_params_mut(|p| p.copy_from_slice(&merged)).unwrap();
        let got = ex.next_token_logits(&c.prompt).unwrap().to_vec();
        for (v, (&a, &b)) in got.iter().zip(&c.logits[t - 1]).enumerate() {
            assert!(
                (a as f64 - b).abs() < 1e-4,
                "{adapter}: logit {v}: memwall {a} vs PEFT {b}"
            );
        }
    }
}

/// A LoRA training plan (the base frozen, the adapter's ops beside its layers) computes the
/// loss PEFT's logits give on the prompt: its forward is PEFT's forward.
#[test]
fn lora_plans_compute_what_peft_computes() {
    for (adapter, base) in CASES {
        let c = case(adapter, base);
        let (ad, values) = load_adapter(&fixture(adapter), &c.layout).unwrap();
        // PEFT's mean cross-entropy of predicting prompt[1..] from its logits.
        let t = c.prompt.len() - 1;
        let want: f64 = (0..t)
            .map(|i| {
                let row = &c.logits[i];
                let max = row.iter().cloned().fold(f64::MIN, f64::max);
                let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                lse - row[c.prompt[i + 1] as usize]
            })
            .sum::<f64>()
            / t as f64;
        let mut cfg = StepConfig::new(1, t, 2);
        cfg.lora = Some(ad.spec.clone());
        let plan = build_plan(&c.spec, &cfg, Mode::Train, backend()).unwrap();
        let mut ex = Executor::on(plan, backend()).unwrap();
        ex.fill_base(|r, p| {
            p.copy_from_slice(&c.base[r]);
            Ok(())
        })
        .unwrap();
        ex.with_params_mut(|p| p.copy_from_slice(&values)).unwrap();
        ex.upload_batch(&c.prompt).unwrap();
        let loss = ex.eval_loss().unwrap() as f64;
        assert!(
            (loss - want).abs() < 1e-5,
            "{adapter}: memwall {loss} vs PEFT {want}"
        );
    }
}

/// What memwall writes for PEFT's adapter is PEFT's file: the same tensor names, shapes,
/// dtype and bytes, and a config with PEFT's values for every field PEFT reads back.
#[test]
fn memwall_writes_the_files_peft_wrote() {
    for (adapter, base) in CASES {
        let c = case(adapter, base);
        let (ad, values) = load_adapter(&fixture(adapter), &c.layout).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        save_adapter(tmp.path(), &ad, &values, base).unwrap();
        let read = |dir: &Path| std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
        let (ours, theirs) = (read(tmp.path()), read(&fixture(adapter)));
        let (ours, theirs) = (
            safetensors::SafeTensors::deserialize(&ours).unwrap(),
            safetensors::SafeTensors::deserialize(&theirs).unwrap(),
        );
        let mut names: Vec<String> = theirs.names().into_iter().map(String::from).collect();
        names.sort();
        let mut our_names: Vec<String> = ours.names().into_iter().map(String::from).collect();
        our_names.sort();
        assert_eq!(our_names, names, "{adapter}: tensor names");
        for n in &names {
            let (a, b) = (ours.tensor(n).unwrap(), theirs.tensor(n).unwrap());
            assert_eq!(a.shape(), b.shape(), "{adapter}: {n}");
            assert_eq!(a.dtype(), b.dtype(), "{adapter}: {n}");
            assert!(a.data() == b.data(), "{adapter}: {n}: values");
        }
        let json = |dir: &Path| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(dir.join("adapter_config.json")).unwrap())
                .unwrap()
        };
        let (ours, theirs) = (json(tmp.path()), json(&fixture(adapter)));
        for key in [
            "peft_type",
            "task_type",
            "r",
            "lora_alpha",
            "lora_dropout",
            "bias",
            "fan_in_fan_out",
            "use_rslora",
            "use_dora",
        ] {
            assert_eq!(ours[key], theirs[key], "{adapter}: {key}");
        }
        let set = |v: &serde_json::Value| {
            let mut s: Vec<String> = v
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap().to_string())
                .collect();
            s.sort();
            s
        };
        assert_eq!(
            set(&ours["target_modules"]),
            set(&theirs["target_modules"]),
            "{adapter}: target_modules"
        );
    }
}
