//! `--offload` from the command line: the same checkpoints as a run that keeps everything in
//! RAM, a resumed offloaded run bitwise equal to an uninterrupted one, a measured peak as
//! planned, and clear errors (bad directory, `auto` without a budget or with one nothing
//! reaches, a disk failure mid-step that leaves the last checkpoint loadable).

mod common;

use common::{fails, memwall_env, ok, train_args};
use std::path::Path;

const STEPS: &[&str] = &[
    "--batch",
    "4",
    "--seq",
    "32",
    "--threads",
    "2",
    "--warmup",
    "2",
    "--eval-every",
    "5",
    "--eval-batches",
    "2",
    "--save-every",
    "5",
];

fn args(cfg: &Path, data: &Path, run: &Path, steps: &str, extra: &[&str]) -> Vec<String> {
    let mut a = train_args(cfg, data, run, &["--steps", steps]);
    a.extend(STEPS.iter().chain(extra).map(|s| s.to_string()));
    a
}

fn same_file(a: &Path, b: &Path) -> bool {
    std::fs::read(a).unwrap() == std::fs::read(b).unwrap()
}

/// The offloaded run (everything on disk), and one whose disk fails mid-run (an injected
/// I/O error after the step-5 checkpoint) resumed from its last checkpoint, end with the
/// same checkpoint files as the run that keeps everything in RAM.
#[test]
fn offloaded_runs_and_a_failed_run_resumed_are_bitwise_those_in_ram() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let (ram, off, failed) = (
        tmp.path().join("ram"),
        tmp.path().join("off"),
        tmp.path().join("failed"),
    );
    ok(&args(&cfg, &data, &ram, "10", &["--optim-state", "int8"]));
    let offload = ["--optim-state", "int8", "--offload", "all"];
    ok(&args(&cfg, &data, &off, "10", &offload));
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(off.join("plan.json")).unwrap()).unwrap();
    // Transfers a step (with gradients on disk, the `optimizer` ops only finish an update
    // between steps: before an evaluation or a checkpoint); evaluation and the step-5
    // checkpoint add fewer than two steps' worth, so failing after seven steps' worth fails
    // in step 6 to 9.
    let per_step = plan["schedule"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| {
            let n = o["name"].as_str().unwrap();
            o["phase"] != "optimizer" && (n.ends_with(".read") || n.ends_with(".write"))
        })
        .count();
    assert!(per_step > 20, "{per_step} transfers a step");
    let o = memwall_env(
        &[("MEMWALL_OFFLOAD_FAIL_AFTER", &(7 * per_step).to_string())],
        &args(&cfg, &data, &failed, "10", &offload),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("memwall-offload.bin")
            && err.contains("at offset")
            && ["step 6: op", "step 7: op", "step 8: op", "step 9: op"]
                .iter()
                .any(|s| err.contains(s)),
        "{err}"
    );
    assert!(failed.join("checkpoints/step-000005").is_dir());
    assert!(!failed.join("checkpoints/step-000010").exists());
    ok(&[
        "train",
        "--resume",
        failed.to_str().unwrap(),
        "--steps",
        "10",
        "--threads",
        "2",
    ]);

    for run in [&off, &failed] {
        for f in ["model.safetensors", "optimizer.safetensors"] {
            let a = ram.join("checkpoints/step-000010").join(f);
            let b = run.join("checkpoints/step-000010").join(f);
            assert!(
                same_file(&a, &b),
                "{} differs from {}",
                b.display(),
                a.display()
            );
        }
        // The offload file is scratch: gone when the run ends, with the run's own
        // `offload/` directory it was made in (the default --offload-dir).
        let dir = run.join("offload");
        assert!(!dir.exists(), "{} is left", dir.display());
    }
    assert!(
        plan["by_tier"]["nvme"].as_u64().unwrap() > 0,
        "{}",
        plan["by_tier"]
    );
    assert!(plan["io_read_bytes_per_step"].as_u64().unwrap() > 0);
    assert!(plan["io_write_bytes_per_step"].as_u64().unwrap() > 0);
}

#[test]
fn offloaded_bench_peak_rss_matches_the_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    let bench = [
        "bench",
        "--model",
        "gpt2-tiny",
        "--batch",
        "8",
        "--seq",
        "128",
        "--steps",
        "2",
        "--threads",
        "2",
    ];
    let ram: serde_json::Value = serde_json::from_str(&ok(&bench)).unwrap();
    let offloaded = [&bench[..], &["--offload", "all", "--offload-dir", dir]].concat();
    let out = ok(&offloaded);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let err = v["plan_error_pct"].as_f64().unwrap();
    assert!(err.abs() <= 3.0, "plan vs measured: {err:.2}% ({v})");
    // Parameters, gradients and moments (16 bytes per parameter) left RAM; a few groups'
    // staging copies came back.
    let saved = ram["plan_total_bytes"].as_u64().unwrap() - v["plan_total_bytes"].as_u64().unwrap();
    let nvme = v["by_tier"]["nvme"].as_u64().unwrap();
    assert!(
        saved as f64 > 0.3 * nvme as f64,
        "saved {saved} of {nvme} bytes on disk"
    );
    assert_eq!(v["losses"], ram["losses"], "offloading changed the losses");
    assert!(v["io_read_bytes_per_step"].as_u64().unwrap() >= nvme);
    // The I/O thread worked; compute waited for it at most the whole step.
    let (busy, stall) = (
        v["io_busy_s"].as_f64().unwrap(),
        v["stall_s"].as_f64().unwrap(),
    );
    let step = v["step_s_median"].as_f64().unwrap();
    assert!(
        busy > 0.0 && (0.0..=step * 1.5).contains(&stall),
        "busy {busy} stall {stall}"
    );
    assert_eq!(ram["io_busy_s"], 0.0);
}

#[test]
fn offload_errors_name_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let file = tmp.path().join("a_file");
    std::fs::write(&file, "x").unwrap();
    let run = tmp.path().join("run");
    let dir = file.to_str().unwrap();
    let e = fails(&args(
        &cfg,
        &data,
        &run,
        "2",
        &["--offload", "optimizer", "--offload-dir", dir],
    ));
    assert!(e.contains("--offload-dir"), "{e}");
    let e = fails(&args(&cfg, &data, &run, "2", &["--offload", "auto"]));
    assert!(
        e.contains("--offload auto") && e.contains("--max-memory"),
        "{e}"
    );
    let e = fails(&args(&cfg, &data, &run, "2", &["--offload", "auto,params"]));
    assert!(e.contains("auto"), "{e}");
    let e = fails(&[
        "plan",
        "--model",
        "gpt2",
        "--offload",
        "auto",
        "--max-memory",
        "50MiB",
    ]);
    assert!(
        e.contains("--offload auto: nothing fits --max-memory")
            && e.contains("smallest plan is --offload"),
        "{e}"
    );
    let e = fails(&args(&cfg, &data, &run, "2", &["--offload", "disk"]));
    assert!(e.contains("--offload disk"), "{e}");
}

/// `kill -9` in the middle of an offloaded run (everything on disk): the last checkpoint is
/// loadable, and `--resume` ends with the checkpoint files of an uninterrupted run.
#[test]
fn a_killed_offloaded_run_resumes_bitwise() {
    use std::process::{Command, Stdio};
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let (whole, killed) = (tmp.path().join("whole"), tmp.path().join("killed"));
    let offload = [
        "--offload",
        "all",
        "--recompute",
        "full",
        "--grad-accum",
        "2",
    ];
    let steps = "60";
    ok(&args(&cfg, &data, &whole, steps, &offload));

    let mut child = Command::new(env!("CARGO_BIN_EXE_memwall"))
        .args(args(&cfg, &data, &killed, steps, &offload))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let first = killed.join("checkpoints/step-000005");
    let t0 = std::time::Instant::now();
    while !first.is_dir() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(t0.elapsed().as_secs() < 300, "no checkpoint after 300 s");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Killed mid-run: still running, its last checkpoint not yet written.
    assert!(
        child.try_wait().unwrap().is_none(),
        "the run ended before the kill"
    );
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let last = killed.join("checkpoints/step-000060");
    assert!(!last.exists(), "the run finished before it was killed");
    assert!(
        killed.join("offload/memwall-offload.bin").exists(),
        "a killed run leaves its scratch file (the next start replaces it)"
    );

    ok(&[
        "train",
        "--resume",
        killed.to_str().unwrap(),
        "--steps",
        steps,
        "--threads",
        "2",
    ]);
    assert!(
        !killed.join("offload").exists(),
        "the finished run leaves no empty offload directory"
    );
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let a = whole.join("checkpoints/step-000060").join(f);
        let b = last.join(f);
        assert!(
            same_file(&a, &b),
            "{} differs from {}",
            b.display(),
            a.display()
        );
    }
}

/// `plan` with an offload directory measures that disk and predicts a step's I/O time; the
/// probe leaves nothing behind, and a directory it cannot use is named.
#[test]
fn plan_probes_the_offload_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("disk");
    let plan = |dir: &str| {
        vec![
            "plan".to_string(),
            "--model".into(),
            "gpt2-tiny".into(),
            "--offload".into(),
            "all".into(),
            "--offload-dir".into(),
            dir.into(),
        ]
    };
    let out = ok(&plan(dir.to_str().unwrap()));
    assert!(
        out.contains("probed 512.00 MiB") && out.contains("a step's transfers take at least"),
        "{out}"
    );
    // The probe's file is gone, and the directory it created for it.
    assert!(!dir.exists(), "probe file or directory left");
    let file = tmp.path().join("a_file");
    std::fs::write(&file, "x").unwrap();
    let e = fails(&plan(file.to_str().unwrap()));
    assert!(e.contains("--offload-dir") && e.contains("a_file"), "{e}");
    let out = ok(&["plan", "--model", "gpt2-tiny", "--offload", "all"]);
    assert!(out.contains("pass --offload-dir DIR"), "{out}");
}

/// A LoRA run with its quantized base on the disk tier (`--offload params`): the base leaves
/// RAM, the peak stays planned and the losses are those of the base in RAM.
#[test]
fn a_lora_base_on_disk_leaves_ram_and_the_peak_planned() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    let bench = [
        "bench",
        "--model",
        "smollm2-135m",
        "--lora",
        "8",
        "--base-quant",
        "q4_0",
        "--batch",
        "4",
        "--seq",
        "128",
        "--steps",
        "2",
        "--threads",
        "2",
    ];
    let ram: serde_json::Value = serde_json::from_str(&ok(&bench)).unwrap();
    let offloaded = [&bench[..], &["--offload", "params", "--offload-dir", dir]].concat();
    let v: serde_json::Value = serde_json::from_str(&ok(&offloaded)).unwrap();
    let err = v["plan_error_pct"].as_f64().unwrap();
    assert!(err.abs() <= 3.0, "plan vs measured: {err:.2}% ({v})");
    assert_eq!(v["losses"], ram["losses"], "offloading changed the losses");
    // The base (q4_0 blocks, the embedding in q8_0) and the adapters went to disk; a few
    // groups' staging copies came back.
    let nvme = v["by_tier"]["nvme"].as_u64().unwrap();
    let saved = ram["plan_total_bytes"].as_u64().unwrap() - v["plan_total_bytes"].as_u64().unwrap();
    assert!(nvme > 90 << 20, "{nvme} bytes on disk");
    assert!(
        saved as f64 > 0.5 * nvme as f64,
        "saved {saved} of {nvme} bytes on disk"
    );
    // Read twice a step (forward, then backward), never written.
    assert!(v["io_read_bytes_per_step"].as_u64().unwrap() >= 2 * (90 << 20));
    assert!(v["io_write_bytes_per_step"].as_u64().unwrap() < nvme / 4);
}
