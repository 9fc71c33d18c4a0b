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
        memwall::ckpt::adapter::merge_into(&a, &layout, &mut want, &values);
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
    memwall::ckpt::adapter::merge(&base, &dir, &merged, false).unwrap();
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
            stop: Vec::new(),
        };
        generate_tokens(&opts, &[3, 14, 15, 92, 65], &mut |_| {}, &mut |_| {}).unwrap()
    };
    let with_adapter = tokens(&base, Some(&dir));
    assert_eq!(with_adapter, tokens(&merged, None));
    assert_ne!(
        with_adapter,
        tokens(&base, None),
        "the adapter changed no token"
    );
}

/// `train --lora` end to end on a small GPT-2 fine-tuned from a base checkpoint: the
/// checkpoints hold PEFT's files and no model; a run resumed from its first checkpoint ends
/// bitwise where the uninterrupted run does; `sample --adapter` and `merge` take a
/// checkpoint as the adapter; `--lora` is refused on resume.
#[test]
fn lora_runs_save_peft_adapters_and_resume_bitwise() {
    use common::{micro_config, prepared, small_corpus, train_args};
    let tmp = tempfile::tempdir().unwrap();
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let data = prepared(tmp.path(), &small_corpus(tmp.path()));
    let cfg = micro_config(tmp.path());
    let short = ["--batch", "2", "--seq", "16", "--eval-every", "0"];
    // The base: a couple of full steps, saved as a model checkpoint.
    let base_run = tmp.path().join("base");
    let mut args = train_args(
        &cfg,
        &data,
        &base_run,
        &["--steps", "2", "--save-every", "2"],
    );
    args.extend(short.map(String::from));
    ok(&args);
    let base = base_run.join("checkpoints/step-000002");
    let lora = |run: &Path, steps: &str| {
        let mut a: Vec<String> = [
            "train",
            "--init",
            &p(&base),
            "--lora",
            "4",
            "--lora-targets",
            "attn,fc",
            "--data",
            &p(&data),
            "--out",
            &p(run),
            "--steps",
            steps,
            "--save-every",
            "2",
            "--lr",
            "3e-3",
        ]
        .map(String::from)
        .to_vec();
        a.extend(short.map(String::from));
        a
    };
    let whole = tmp.path().join("whole");
    ok(&lora(&whole, "4"));
    let ck = whole.join("checkpoints/step-000004");
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(ck.join(f).is_file(), "{f} missing");
    }
    for f in ["config.json", "model.safetensors"] {
        assert!(!ck.join(f).exists(), "a LoRA checkpoint holds no {f}");
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    assert_eq!(config["fan_in_fan_out"], true);
    assert_eq!(
        config["target_modules"],
        serde_json::json!(["c_attn", "c_fc"])
    );
    assert_eq!(config["base_model_name_or_path"], p(&base));

    // Stopped at step 2 (its later checkpoint gone) and resumed to 4: bitwise the
    // uninterrupted run.
    let halves = tmp.path().join("halves");
    ok(&lora(&halves, "4"));
    std::fs::remove_dir_all(halves.join("checkpoints/step-000004")).unwrap();
    ok(&["train", "--resume", &p(&halves), "--steps", "4"]);
    for f in ["adapter_model.safetensors", "optimizer.safetensors"] {
        let (a, b) = (
            std::fs::read(ck.join(f)).unwrap(),
            std::fs::read(halves.join("checkpoints/step-000004").join(f)).unwrap(),
        );
        assert!(a == b, "{f} differs after resume");
    }
    // The base and the adapters' state on disk: the same checkpoint.
    let offloaded = tmp.path().join("offloaded");
    let mut args = lora(&offloaded, "4");
    args.extend(["--offload", "all"].map(String::from));
    ok(&args);
    for f in ["adapter_model.safetensors", "optimizer.safetensors"] {
        let (a, b) = (
            std::fs::read(ck.join(f)).unwrap(),
            std::fs::read(offloaded.join("checkpoints/step-000004").join(f)).unwrap(),
        );
        assert!(a == b, "{f} differs with --offload all");
    }
    let e = fails(&[
        "train",
        "--resume",
        &p(&halves),
        "--steps",
        "6",
        "--lora",
        "8",
    ]);
    assert!(e.contains("--lora") && e.contains("rank 4"), "{e}");

    // The adapter trained: the merged model differs from the base, and sampling with the
    // adapter runs.
    let merged = tmp.path().join("merged");
    let said = ok(&["merge", &p(&base), &p(&ck), "--out", &p(&merged)]);
    assert!(said.contains("4 layers (rank 4, scale 2)"), "{said}");
    let spec = load_spec(&base).unwrap();
    let layout = ParamLayout::new(&spec);
    let (mut a, mut b) = (vec![0f32; layout.total], vec![0f32; layout.total]);
    load_params(&base, &layout, &mut a).unwrap();
    load_params(&merged, &layout, &mut b).unwrap();
    assert_ne!(a, b, "the adapter learned nothing");
    ok(&[
        "sample",
        "--model",
        &p(&base),
        "--adapter",
        &p(&ck),
        "--tokens",
        "5",
        "--prompt",
        "ROMEO:",
    ]);
}

/// `train --lora 4 --lora-dropout 0.1` end to end: the loss falls, the adapter differs from
/// the same run's without dropout, the checkpoint's adapter_config.json says lora_dropout
/// 0.1, and a run resumed from its step-4 checkpoint ends bitwise where the uninterrupted
/// run does (each step's masks are a pure function of the seed and the step).
#[test]
fn lora_dropout_trains_and_resumes_bitwise() {
    use common::{micro_config, prepared, small_corpus, train_args};
    use memwall::run_dir::metrics;
    let tmp = tempfile::tempdir().unwrap();
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let data = prepared(tmp.path(), &small_corpus(tmp.path()));
    let cfg = micro_config(tmp.path());
    let short = ["--batch", "2", "--seq", "16", "--eval-every", "0"];
    let base_run = tmp.path().join("base");
    let mut args = train_args(
        &cfg,
        &data,
        &base_run,
        &["--steps", "2", "--save-every", "2"],
    );
    args.extend(short.map(String::from));
    ok(&args);
    let base = base_run.join("checkpoints/step-000002");
    let lora = |run: &Path, dropout: &str| {
        let mut a: Vec<String> = [
            "train",
            "--init",
            &p(&base),
            "--lora",
            "4",
            "--lora-dropout",
            dropout,
            "--data",
            &p(&data),
            "--out",
            &p(run),
            "--steps",
            "8",
            "--save-every",
            "4",
            "--lr",
            "1e-2",
        ]
        .map(String::from)
        .to_vec();
        a.extend(short.map(String::from));
        a
    };
    let whole = tmp.path().join("whole");
    ok(&lora(&whole, "0.1"));
    let losses: Vec<f32> = metrics::read(&whole.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .filter_map(|m| m.update.as_ref().map(|u| u.loss))
        .collect();
    assert_eq!(losses.len(), 8);
    assert!(losses[7] < losses[0], "the loss did not fall: {losses:?}");
    let ck = whole.join("checkpoints/step-000008");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["lora_dropout"], 0.1);
    let adapter = |dir: &Path| std::fs::read(dir.join("adapter_model.safetensors")).unwrap();

    let plain = tmp.path().join("plain");
    ok(&lora(&plain, "0"));
    assert!(
        adapter(&plain.join("checkpoints/step-000008")) != adapter(&ck),
        "dropout changed nothing"
    );

    let halves = tmp.path().join("halves");
    ok(&lora(&halves, "0.1"));
    std::fs::remove_dir_all(halves.join("checkpoints/step-000008")).unwrap();
    ok(&["train", "--resume", &p(&halves), "--steps", "8"]);
    let resumed = halves.join("checkpoints/step-000008");
    for f in ["adapter_model.safetensors", "optimizer.safetensors"] {
        let (a, b) = (
            std::fs::read(ck.join(f)).unwrap(),
            std::fs::read(resumed.join(f)).unwrap(),
        );
        assert!(a == b, "{f} differs after resume");
    }
}

/// `--init-adapter` starts the adapters from a PEFT adapter directory and trains them on:
/// the run takes its rank, alpha and targets, and with a learning rate too small to move them
/// its first checkpoint holds the adapter it started from; `--lora` that disagrees is refused.
#[test]
fn a_peft_adapter_given_to_init_adapter_trains_on() {
    use common::{micro_config, prepared, small_corpus, train_args};
    let tmp = tempfile::tempdir().unwrap();
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let data = prepared(tmp.path(), &small_corpus(tmp.path()));
    let cfg = micro_config(tmp.path());
    let short = ["--batch", "2", "--seq", "16", "--eval-every", "0"].map(String::from);
    let base_run = tmp.path().join("base");
    let mut args = train_args(
        &cfg,
        &data,
        &base_run,
        &["--steps", "1", "--save-every", "1"],
    );
    args.extend(short.clone());
    ok(&args);
    let base = base_run.join("checkpoints/step-000001");
    let adir = tmp.path().join("adapter");
    let (layout, a, values) = adapter(&base, &adir, "attn,mlp_proj");
    let run = tmp.path().join("run");
    let train = |extra: &[&str]| {
        let mut a: Vec<String> = [
            "train",
            "--init",
            &p(&base),
            "--init-adapter",
            &p(&adir),
            "--data",
            &p(&data),
            "--out",
            &p(&run),
            "--steps",
            "1",
            "--save-every",
            "1",
            "--lr",
            "1e-12",
            "--warmup",
            "0",
        ]
        .map(String::from)
        .to_vec();
        a.extend(short.clone());
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let e = fails(&train(&["--lora", "8"]));
    assert!(e.contains("--init-adapter") && e.contains("rank 2"), "{e}");
    assert!(!run.exists(), "the refused run wrote its directory");
    ok(&train(&[]));
    let ck = run.join("checkpoints/step-000001");
    let spec = load_spec(&base).unwrap();
    let (b, got) = memwall::ckpt::adapter::load_adapter(&ck, &ParamLayout::new(&spec)).unwrap();
    assert_eq!(b.spec, a.spec);
    let worst = got
        .iter()
        .zip(&values)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0f32, f32::max);
    assert!(worst < 1e-6, "the adapter moved by {worst} at lr 1e-12");

    // An adapter trained with dropout (PEFT's lora_dropout) trains on with it: the run's
    // plan has the adapters' dropout workspaces and its checkpoint says lora_dropout 0.05.
    let spec = LoraSpec {
        dropout: 0.05,
        ..a.spec.clone()
    };
    let with_dropout = AdapterLayout::new(&layout, spec).unwrap();
    save_adapter(&adir, &with_dropout, &values, &p(&base)).unwrap();
    std::fs::remove_dir_all(&run).unwrap();
    ok(&train(&[]));
    let plan = std::fs::read_to_string(run.join("plan.json")).unwrap();
    assert!(
        plan.contains(".lora_xd"),
        "no dropout workspace in the plan"
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["lora_dropout"], 0.05);
}

/// Bad LoRA flags are refused before anything is written, naming the flag.
#[test]
fn bad_lora_flags_are_refused_naming_the_flag() {
    use common::{micro_config, prepared, small_corpus, train_args};
    let tmp = tempfile::tempdir().unwrap();
    let data = prepared(tmp.path(), &small_corpus(tmp.path()));
    let cfg = micro_config(tmp.path());
    let run = tmp.path().join("run");
    for (extra, says) in [
        (&["--lora", "0"][..], "--lora 0"),
        (&["--lora", "17"][..], "--lora 17"),
        (
            &["--lora", "4", "--lora-targets", "q,v"][..],
            "has no layer 'q'",
        ),
        (&["--lora", "4", "--lora-alpha=-1"][..], "--lora-alpha"),
        (&["--lora-alpha", "8"][..], "--lora"),
        (&["--base-quant", "q4_1"][..], "--lora"),
        (
            &["--lora", "4", "--base-quant", "q5_k"][..],
            "--base-quant q5_k",
        ),
        (&["--lora", "4", "--base-quant", "q4_1"][..], "Conv1D"),
        (
            &["--lora", "4", "--lora-dropout", "1"][..],
            "--lora-dropout 1",
        ),
        (
            &["--lora", "4", "--lora-dropout=-0.1"][..],
            "--lora-dropout -0.1",
        ),
        (
            &["--lora", "4", "--lora-dropout", "NaN"][..],
            "--lora-dropout NaN",
        ),
    ] {
        let mut args = train_args(&cfg, &data, &run, &["--steps", "1", "--seq", "16"]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let e = fails(&args);
        assert!(e.contains(says), "{extra:?}: {e}");
        assert!(!run.exists(), "{extra:?}: the run directory was written");
    }
}

/// `merge --dtype bf16` writes the merged weights rounded to bfloat16 and says so in
/// config.json; the default keeps the base's dtype (the fixture's f32).
#[test]
fn merge_writes_the_dtype_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture("hf-tiny-llama");
    let dir = tmp.path().join("adapter");
    let (layout, a, values) = adapter(&base, &dir, "all");
    let mut want = vec![0f32; layout.total];
    load_params(&base, &layout, &mut want).unwrap();
    memwall::ckpt::adapter::merge_into(&a, &layout, &mut want, &values);
    let p = |x: &Path| x.to_str().unwrap().to_string();
    for (dtype, bf16) in [(None, false), (Some("bf16"), true)] {
        let out = tmp.path().join(format!("merged-{bf16}"));
        let mut args = vec![
            "merge".to_string(),
            p(&base),
            p(&dir),
            "--out".into(),
            p(&out),
        ];
        if let Some(d) = dtype {
            args.extend(["--dtype".to_string(), d.to_string()]);
        }
        ok(&args);
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(
            config["torch_dtype"],
            if bf16 { "bfloat16" } else { "float32" },
            "{dtype:?}"
        );
        let mut got = vec![0f32; layout.total];
        load_params(&out, &layout, &mut got).unwrap();
        let expect: Vec<f32> = match bf16 {
            true => want
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect(),
            false => want.clone(),
        };
        assert!(got == expect, "{dtype:?}: merged weights");
    }
}
