//! LoRA adapters end to end through the command line: `memwall merge` of a PEFT adapter into
//! its base (the tiny Llama and GPT-2 fixtures), checked against the library's merge and
//! loadable as a model; and the refusals.

mod common;

use common::{fails, ok};
use memwall::ckpt::adapter::save_adapter;
use memwall::ckpt::{load_params, load_spec};
use memwall::model::ParamLayout;
use memwall::model::lora::{AdapterLayout, LoraSpec, parse_targets};
use std::path::Path;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A PEFT adapter on `base` with values that are not the initial ones (B ≠ 0).
fn adapter(base: &Path, dir: &Path, targets: &str) -> (ParamLayout, AdapterLayout, Vec<f32>) {
    let spec = load_spec(base).unwrap();
    let layout = ParamLayout::new(&spec);
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
    (layout, a, values)
}

#[test]
fn merge_writes_the_base_with_its_adapter_merged() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, targets) in [
        ("hf-tiny-llama", "q,v,down"),
        ("hf-tiny-gpt2", "attn,mlp_proj"),
    ] {
        let base = fixture(model);
        let dir = tmp.path().join(format!("{model}-adapter"));
        let (layout, a, values) = adapter(&base, &dir, targets);
        let out = tmp.path().join(format!("{model}-merged"));
        let said = ok(&[
            "merge",
            base.to_str().unwrap(),
            dir.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(
            said.contains(&format!("{} layers (rank 2, scale 2)", a.layers.len())),
            "{said}"
        );
        let mut want = vec![0f32; layout.total];
        load_params(&base, &layout, &mut want).unwrap();
        let before = want.clone();
        a.merge_into(&layout, &mut want, &values);
        let mut got = vec![0f32; layout.total];
        load_params(&out, &layout, &mut got).unwrap();
        assert_eq!(got, want, "{model}");
        assert_ne!(got, before, "{model}: the merge changed nothing");
        assert_eq!(
            load_spec(&out).unwrap().n_embd,
            load_spec(&base).unwrap().n_embd
        );
    }
}

#[test]
fn merge_refuses_a_foreign_adapter_and_a_used_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("adapter");
    adapter(&fixture("hf-tiny-llama"), &dir, "q");
    let out = tmp.path().join("out");
    // An adapter of a Llama base put on GPT-2.
    let e = fails(&[
        "merge",
        fixture("hf-tiny-gpt2").to_str().unwrap(),
        dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        e.contains("adapter_config.json") && e.contains("q_proj"),
        "{e}"
    );
    assert!(!out.exists(), "nothing is written");
    // An output directory that holds something.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let e = fails(&[
        "merge",
        fixture("hf-tiny-llama").to_str().unwrap(),
        dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(e.contains("--out") && e.contains("not empty"), "{e}");
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).unwrap(),
        "mine"
    );
}

/// `sample --adapter` computes with the adapter applied: greedy tokens from the base with
/// its adapter are those of the merged model, and differ from the base's own.
#[test]
fn generation_with_an_adapter_is_generation_from_the_merged_model() {
    use memwall::exec::generate::{SampleOptions, generate_tokens};
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture("hf-tiny-llama");
    let dir = tmp.path().join("adapter");
    adapter(&base, &dir, "all");
    let merged = tmp.path().join("merged");
    memwall::ckpt::adapter::merge(&base, &dir, &merged).unwrap();
    let tokens = |model: &Path, adapter: Option<&Path>| {
        let opts = SampleOptions {
            checkpoint: model.to_path_buf(),
            prompt: String::new(),
            tokens: 12,
            temperature: 0.0,
            top_k: 0,
            seed: 1,
            threads: 2,
            device: Default::default(),
            adapter: adapter.map(Path::to_path_buf),
        };
        generate_tokens(&opts, &[3, 14, 15, 92, 65], &mut |_| {}).unwrap()
    };
    let with_adapter = tokens(&base, Some(&dir));
    assert_eq!(with_adapter, tokens(&merged, None));
    assert_ne!(
        with_adapter,
        tokens(&base, None),
        "the adapter changed no token"
    );
}
