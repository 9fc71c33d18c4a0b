//! The step-time model and `--fit`: transfers overlapped as the schedule allows, the search
//! against every candidate built one by one, `--batch auto`, calibration end to end.

mod common;

use common::{fails, memwall_env};
use memwall::backend::under_test as backend;
use memwall::ir::Recompute;
use memwall::model::ModelSpec;
use memwall::plan::fit::predicted_peak;
use memwall::plan::search::{self, Pick, Space};
use memwall::plan::time::{Bandwidth, Bound, Calibration, predict};
use memwall::plan::{Mode, OffloadSet, StepConfig, build_plan};

fn estimate() -> Calibration {
    Calibration::estimate("test cpu".into(), 2, 100.0)
}

fn with_disk(bytes_per_s: f64) -> Calibration {
    let mut c = estimate();
    c.disk = Some(Bandwidth {
        read_bytes_per_s: bytes_per_s,
        write_bytes_per_s: bytes_per_s,
    });
    c
}

#[test]
fn transfers_hide_behind_compute_on_a_fast_disk_and_bound_a_slow_one() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let mut cfg = StepConfig::new(4, 64, 2);
    cfg.offload.set = OffloadSet::ALL;
    let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
    let (read, written) = plan.io_bytes_per_step();
    assert!(read > 0 && written > 0);

    let fast = predict(&plan, &with_disk(1e15));
    assert_eq!(fast.bound, Bound::Compute);
    assert!(fast.stall_s < 1e-6 * fast.step_s, "{fast:?}");
    assert!((fast.step_s - fast.compute_s).abs() < 1e-6 * fast.step_s);

    let rate = 1e6;
    let slow = predict(&plan, &with_disk(rate));
    let io = (read + written) as f64 / rate;
    assert_eq!(slow.bound, Bound::Io);
    assert!((slow.io_s - io).abs() < 1e-9 * io, "{} vs {io}", slow.io_s);
    // The I/O thread works through every transfer, and compute cannot end before it.
    assert!(slow.step_s >= io && slow.step_s <= io + slow.compute_s + 1e-9);
    assert!((slow.step_s - (slow.compute_s + slow.stall_s)).abs() < 1e-6 * slow.step_s);
    // The same compute either way.
    assert!((slow.compute_s - fast.compute_s).abs() < 1e-12);
}

#[test]
fn more_work_is_predicted_slower() {
    let spec = ModelSpec::preset("gpt2").unwrap();
    let cal = estimate();
    let time = |f: &dyn Fn(&mut StepConfig)| {
        let mut cfg = StepConfig::new(4, 256, 2);
        f(&mut cfg);
        predict(
            &build_plan(&spec, &cfg, Mode::Train, backend()).unwrap(),
            &cal,
        )
        .step_s
    };
    let base = time(&|_| {});
    assert!(time(&|c| c.recompute = Recompute::Full) > base);
    assert!(time(&|c| c.batch = 8) > 1.8 * base);
    assert!(time(&|c| c.grad_accum = 2) > 1.8 * base);
}

/// The best configuration over every micro-batch, policy and placement, built one by one.
fn exhaustive(spec: &ModelSpec, space: &Space, budget: u64, cal: &Calibration) -> (f64, String) {
    let mut best = (f64::INFINITY, String::new());
    let mut policies = vec![Recompute::None, Recompute::Selective];
    policies.extend((2..=spec.n_layer).map(Recompute::Every));
    policies.push(Recompute::Full);
    for b in (1..=space.global_batch).filter(|&b| space.global_batch.is_multiple_of(b)) {
        for &r in &policies {
            for o in OffloadSet::every() {
                let mut cfg = StepConfig::new(b, space.seq, space.threads);
                cfg.grad_accum = space.global_batch / b;
                cfg.recompute = r;
                cfg.offload.set = o;
                let plan = build_plan(spec, &cfg, Mode::Train, backend()).unwrap();
                if predicted_peak(&plan, 0) <= budget {
                    let t = predict(&plan, cal).step_s;
                    if t < best.0 {
                        best = (t, format!("{b} {r} {o}"));
                    }
                }
            }
        }
    }
    best
}

fn space(global_batch: usize) -> Space {
    common::one_process_space(global_batch, 64)
}

#[test]
fn the_search_finds_what_building_every_candidate_finds() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let cal = with_disk(2e8);
    let sp = space(2);
    // Budgets from roomy to tight: below the unconstrained plan's peak, and near the smallest.
    let free = build_plan(&spec, &StepConfig::new(2, 64, 2), Mode::Train, backend()).unwrap();
    let mut smallest = StepConfig::new(1, 64, 2);
    smallest.grad_accum = 2;
    smallest.recompute = Recompute::Full;
    smallest.offload.set = OffloadSet::ALL;
    let small = build_plan(&spec, &smallest, Mode::Train, backend()).unwrap();
    let (hi, lo) = (predicted_peak(&free, 0), predicted_peak(&small, 0));
    for budget in [hi, hi - 1, (hi + lo) / 2, lo + (hi - lo) / 8, lo] {
        let found = search::search(&spec, &sp, budget, 0, &cal, backend()).unwrap();
        let (want, what) = exhaustive(&spec, &sp, budget, &cal);
        let best = &found.ranked[0];
        assert!(
            (best.time.step_s - want).abs() <= 1e-9 * want,
            "budget {budget}: search {} ({}) vs every candidate {want} ({what})",
            best.time.step_s,
            best.flags()
        );
        for k in &found.ranked {
            // Every candidate fits, with the peak and time of its plan built afresh.
            let plan = build_plan(&spec, &k.cfg, Mode::Train, backend()).unwrap();
            assert_eq!(predicted_peak(&plan, 0), k.peak);
            assert!(k.peak <= budget);
            assert_eq!(predict(&plan, &cal).step_s, k.time.step_s);
        }
        assert!(
            found
                .ranked
                .windows(2)
                .all(|w| w[0].time.step_s <= w[1].time.step_s)
        );
    }
}

/// With `--lora` (and a quantized base) the search keeps the adapters and the base's storage
/// in every candidate and finds the fastest plan every candidate built one by one finds;
/// below what fits in RAM, it puts the base on disk.
#[test]
fn the_search_keeps_lora_and_finds_the_fastest_candidate() {
    use memwall::ir::BaseQuant;
    use memwall::model::lora::{LoraSpec, parse_targets};
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    let cal = with_disk(2e8);
    let lora = LoraSpec {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: parse_targets("all", spec.family).unwrap(),
    };
    let quant = BaseQuant::Blocks(memwall::dtype::GgmlType::Q4_0);
    let mut sp = space(4);
    (sp.lora, sp.base_quant) = (Some(lora.clone()), quant);
    let build = |b: usize, r: Recompute, o: OffloadSet| {
        let mut cfg = StepConfig::new(b, sp.seq, sp.threads);
        (cfg.grad_accum, cfg.recompute, cfg.offload.set) = (4 / b, r, o);
        (cfg.lora, cfg.base_quant) = (Some(lora.clone()), quant);
        build_plan(&spec, &cfg, Mode::Train, backend()).unwrap()
    };
    let (hi, lo, least) = (
        predicted_peak(&build(4, Recompute::None, OffloadSet::NONE), 0),
        predicted_peak(&build(1, Recompute::Full, OffloadSet::NONE), 0),
        predicted_peak(&build(1, Recompute::Full, OffloadSet::ALL), 0),
    );
    assert!(least < lo);
    for budget in [(hi + lo) / 2, (lo + least) / 2] {
        let found = search::search(&spec, &sp, budget, 0, &cal, backend()).unwrap();
        let mut want = f64::INFINITY;
        for b in [1, 2, 4] {
            let mut policies = vec![Recompute::None, Recompute::Selective, Recompute::Full];
            policies.extend((2..=spec.n_layer).map(Recompute::Every));
            for r in policies {
                for o in OffloadSet::every() {
                    let plan = build(b, r, o);
                    if predicted_peak(&plan, 0) <= budget {
                        want = want.min(predict(&plan, &cal).step_s);
                    }
                }
            }
        }
        let best = &found.ranked[0];
        assert!(
            best.time.step_s <= want * (1.0 + 1e-9),
            "search {} ({}) vs every candidate {want}",
            best.time.step_s,
            best.flags()
        );
        for k in &found.ranked {
            assert_eq!(k.cfg.lora.as_ref(), Some(&lora));
            assert_eq!(k.cfg.base_quant, quant);
            assert!(k.peak <= budget);
            // Below the smallest plan in RAM, every candidate offloads.
            assert!(budget >= lo || k.cfg.offload.set.any(), "{}", k.flags());
        }
    }
}

#[test]
fn the_search_with_accumulation_reports_exact_plans() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let cal = with_disk(2e8);
    let sp = space(8);
    let free = build_plan(&spec, &StepConfig::new(8, 64, 2), Mode::Train, backend()).unwrap();
    let budget = predicted_peak(&free, 0) * 3 / 4;
    let found = search::search(&spec, &sp, budget, 0, &cal, backend()).unwrap();
    let (want, what) = exhaustive(&spec, &sp, budget, &cal);
    let best = &found.ranked[0];
    // Plans of more than two micro-batches are ranked from two and rebuilt when kept.
    assert!(
        best.time.step_s <= want * 1.02,
        "search {} ({}) vs every candidate {want} ({what})",
        best.time.step_s,
        best.flags()
    );
    for k in &found.ranked {
        assert_eq!(k.cfg.batch * k.cfg.grad_accum, 8);
        let plan = build_plan(&spec, &k.cfg, Mode::Train, backend()).unwrap();
        assert_eq!(predicted_peak(&plan, 0), k.peak);
        assert!(k.peak <= budget);
    }
}

#[test]
fn a_budget_nothing_reaches_is_refused_with_the_smallest_plan() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let found = search::search(&spec, &space(2), 1 << 20, 0, &estimate(), backend()).unwrap();
    assert!(found.ranked.is_empty());
    let e = format!("{:#}", search::nothing_fits(&found, 1 << 20));
    assert!(
        e.contains("nothing fits --max-memory 1.00 MiB") && e.contains("needs"),
        "{e}"
    );
    let e = fails(&["plan", "--model", "gpt2", "--fit", "--max-memory", "100MiB"]);
    assert!(
        e.contains("nothing fits") && e.contains("smallest plan"),
        "{e}"
    );
}

fn cache_env(dir: &std::path::Path) -> [(&'static str, String); 1] {
    [("XDG_CACHE_HOME", dir.display().to_string())]
}

fn run_ok(env: &[(&str, String)], args: &[&str]) -> String {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let o = memwall_env(&env, args);
    assert!(
        o.status.success(),
        "memwall {args:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).to_string()
}

#[test]
fn fit_and_batch_auto_from_the_command_line() {
    let cache = tempfile::tempdir().unwrap();
    let env = cache_env(cache.path());
    let args = [
        "plan",
        "--model",
        "gpt2-tiny",
        "--seq",
        "64",
        "--threads",
        "2",
        "--max-memory",
    ];
    // --fit: the five best, then the plan of the first; --json records the search.
    let mut a = args.to_vec();
    a.extend(["150MiB", "--global-batch", "8", "--fit"]);
    let table = run_ok(&env, &a);
    assert!(
        table.contains("fastest plans that fit --max-memory 150.00 MiB"),
        "{table}"
    );
    assert!(table.contains("predicted step time") && table.contains("estimated from the FMA peak"));
    a.push("--json");
    let p: serde_json::Value = serde_json::from_str(&run_ok(&env, &a)).unwrap();
    let fit = &p["fit"];
    let first = &fit["candidates"][0];
    assert_eq!(p["predicted_step_s"], first["predicted_step_s"]);
    assert_eq!(p["config"]["batch"], first["batch"]);
    assert_eq!(p["config"]["grad_accum"], first["grad_accum"]);
    assert_eq!(
        first["batch"].as_u64().unwrap() * first["grad_accum"].as_u64().unwrap(),
        8
    );
    assert!(p["predicted_peak_rss_bytes"].as_u64().unwrap() <= 150 << 20);

    // --batch auto: the largest micro-batch that fits; one more does not.
    let mut a = args.to_vec();
    a.extend(["160MiB", "--recompute", "none", "--batch", "auto", "--json"]);
    let p: serde_json::Value = serde_json::from_str(&run_ok(&env, &a)).unwrap();
    let b = p["config"]["batch"].as_u64().unwrap();
    assert!(b >= 1 && p["predicted_peak_rss_bytes"].as_u64().unwrap() <= 160 << 20);
    let e = fails(&[
        "plan",
        "--model",
        "gpt2-tiny",
        "--seq",
        "64",
        "--threads",
        "2",
        "--recompute",
        "none",
        "--max-memory",
        "160MiB",
        "--batch",
        &(b + 1).to_string(),
    ]);
    assert!(e.contains("over by"), "{e}");

    // --global-batch with --batch sets the accumulation.
    let p: serde_json::Value = serde_json::from_str(&run_ok(
        &env,
        &[
            "plan",
            "--model",
            "gpt2-tiny",
            "--seq",
            "64",
            "--batch",
            "2",
            "--global-batch",
            "8",
            "--json",
        ],
    ))
    .unwrap();
    assert_eq!(p["config"]["grad_accum"], 4);

    // Bad combinations say what to do.
    let e = fails(&["plan", "--precision", "auto"]);
    assert!(e.contains("--precision auto needs --fit"), "{e}");
    let e = fails(&["plan", "--batch", "auto"]);
    assert!(e.contains("--batch auto needs --max-memory"), "{e}");
    let e = fails(&["plan", "--batch", "3", "--global-batch", "8"]);
    assert!(e.contains("not a multiple of --batch 3"), "{e}");
    let e = fails(&["plan", "--batch", "many"]);
    assert!(e.contains("'many' is not a batch size"), "{e}");
}

/// `plan --ranks 4 --fit` from the command line: the table shows each candidate's mesh and
/// its heaviest rank, the plan printed is the chosen mesh's with every rank's peak, and
/// `--json` records the mesh of each candidate and every rank within the budget.
#[test]
fn fit_over_mesh_shapes_from_the_command_line() {
    let cache = tempfile::tempdir().unwrap();
    let env = cache_env(cache.path());
    let args = [
        "plan",
        "--model",
        "llama-tiny",
        "--ranks",
        "4",
        "--seq",
        "64",
        "--threads",
        "2",
        "--global-batch",
        "8",
        "--max-memory",
        "140MiB",
        "--fit",
    ];
    let table = run_ok(&env, &args);
    assert!(table.contains("tp x pp x dp, zero"), "{table}");
    assert!(table.contains("every rank's predicted peak"), "{table}");
    let mut json = args.to_vec();
    json.push("--json");
    let v: serde_json::Value = serde_json::from_str(&run_ok(&env, &json)).unwrap();
    let best = &v["fit"]["candidates"][0];
    let (tp, pp, dp) = (
        best["tp"].as_u64(),
        best["pp"].as_u64(),
        best["dp"].as_u64(),
    );
    assert_eq!(tp.unwrap() * pp.unwrap() * dp.unwrap(), 4, "{best}");
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    for r in ranks {
        assert!(
            r["predicted_peak_rss_bytes"].as_u64().unwrap() <= 140 << 20,
            "{r}"
        );
        assert!(r["coords"]["tp"].as_u64().unwrap() < tp.unwrap(), "{r}");
    }
    // Given sizes are kept; sizes the ranks cannot make are refused naming the flag.
    let mut given = args.to_vec();
    given.extend(["--tp", "1", "--zero", "0"]);
    let v: serde_json::Value =
        serde_json::from_str(&run_ok(&env, &[&given[..], &["--json"]].concat())).unwrap();
    for k in v["fit"]["candidates"].as_array().unwrap() {
        assert_eq!(
            (k["tp"].as_u64(), k["zero"].as_u64()),
            (Some(1), Some(0)),
            "{k}"
        );
    }
    let mut bad = args.to_vec();
    bad.extend(["--tp", "3"]);
    let e = fails(&bad);
    assert!(e.contains("--tp 3"), "{e}");
}

#[test]
fn a_hand_broken_calibration_is_refused_naming_the_file() {
    // What `memwall calibrate` would save on this CPU, with a negative coefficient.
    let cache = tempfile::tempdir().unwrap();
    let mut cal = Calibration::estimate(memwall::util::machine::cpu_name(), 2, 100.0);
    cal.kinds.insert(
        "matmul/f32".into(),
        memwall::plan::time::Cost {
            s_per_flop: -1e-11,
            s_per_byte: 0.0,
            s_per_op: 1e-5,
            samples: 5,
            fit_error_pct: 1.0,
        },
    );
    let dir = cache.path().join("memwall/calibration");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("threads-2.json");
    std::fs::write(&file, serde_json::to_string(&cal).unwrap()).unwrap();
    let o = memwall_env(
        &[("XDG_CACHE_HOME", cache.path().to_str().unwrap())],
        &["plan", "--model", "gpt2-tiny", "--threads", "2"],
    );
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && e.contains(&file.display().to_string())
            && e.contains("memwall calibrate")
            && e.contains("s_per_flop is -0.00000000001"),
        "{e}"
    );
}

#[test]
fn calibration_is_saved_and_used() {
    let cache = tempfile::tempdir().unwrap();
    let disk = tempfile::tempdir().unwrap();
    let env = cache_env(cache.path());
    let out = run_ok(
        &env,
        &[
            "calibrate",
            "--quick",
            "--threads",
            "2",
            "--offload-dir",
            &disk.path().display().to_string(),
            "--json",
        ],
    );
    let cal: Calibration = serde_json::from_str(&out).unwrap();
    assert_eq!(cal.threads, 2);
    let mm = cal.kinds.get("matmul/f32").expect("matmuls were timed");
    assert!(mm.samples > 0 && mm.s_per_flop > 0.0, "{mm:?}");
    assert!(cal.kinds.contains_key("adamw.int8/f32") && cal.kinds.contains_key("rmsnorm/f32"));
    let d = cal.disk.expect("the disk was measured");
    assert!(d.read_bytes_per_s > 0.0 && d.write_bytes_per_s > 0.0);
    let saved = cache.path().join("memwall/calibration/threads-2.json");
    assert!(saved.is_file());
    // plan and bench now use it.
    let table = run_ok(&env, &["plan", "--model", "gpt2-tiny", "--threads", "2"]);
    assert!(
        table.contains("calibrated 20") && table.contains("predicted step time"),
        "{table}"
    );
    let bench: serde_json::Value = serde_json::from_str(&run_ok(
        &env,
        &[
            "bench",
            "--model",
            "gpt2-tiny",
            "--batch",
            "2",
            "--seq",
            "32",
            "--steps",
            "1",
            "--threads",
            "2",
        ],
    ))
    .unwrap();
    assert!(bench["predicted_step_s"].as_f64().unwrap() > 0.0);
    assert!(bench["time_error_pct"].as_f64().unwrap().is_finite());
    assert_eq!(
        bench["predicted"]["estimated"], false,
        "{}",
        bench["predicted"]
    );
    // A damaged file is named, with what to do.
    std::fs::write(&saved, "{").unwrap();
    let o = memwall_env(
        &[("XDG_CACHE_HOME", cache.path().to_str().unwrap())],
        &["plan", "--model", "gpt2-tiny", "--threads", "2"],
    );
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("threads-2.json") && e.contains("memwall calibrate"),
        "{e}"
    );
}

/// `--max-memory` is a ceiling for what the process measures, not only for the plan: runs
/// whose strategies `--batch auto` and `--fit` chose peak at most at the predicted peak
/// (plan + the baseline measured when the run plans + the runtime reserve), so within the
/// budget; every metrics line records the peak so far and none is over. (A baseline taken
/// before the search or before the data was open, a mapped token shard and no reserve for
/// the code and allocator pages touched later had both runs peak 2–7 MiB above the budget.)
#[test]
fn the_measured_peak_stays_within_max_memory() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let env = cache_env(cache.path());
    let data = common::prepared(dir.path(), &common::small_corpus(dir.path()));
    let data = data.to_str().unwrap();
    for (k, (budget, choose)) in [
        (200u64 << 20, &["--batch", "auto"][..]),
        (128 << 20, &["--fit", "--global-batch", "8"][..]),
    ]
    .into_iter()
    .enumerate()
    {
        let run = dir.path().join(format!("run{k}"));
        let budget_flag = format!("{budget}B");
        let mut args = vec![
            "train",
            "--model",
            "gpt2-tiny",
            "--data",
            data,
            "--out",
            run.to_str().unwrap(),
            "--steps",
            "3",
            "--threads",
            "2",
            "--eval-every",
            "2",
            "--max-memory",
            &budget_flag,
        ];
        args.extend(choose);
        let out = run_ok(&env, &args);
        let line = out
            .lines()
            .find(|l| l.starts_with("trained steps"))
            .unwrap_or_else(|| panic!("no summary:\n{out}"));
        let peak = line.split("peak RSS ").nth(1).unwrap();
        let peak =
            memwall::util::bytes::parse_bytes(peak.split(" (").next().unwrap().trim()).unwrap();
        let plan: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("plan.json")).unwrap()).unwrap();
        let predicted = plan["predicted_peak_rss_bytes"].as_u64().unwrap();
        assert!(
            predicted <= budget,
            "{choose:?}: predicted {predicted} > {budget}"
        );
        // fmt_bytes rounds to 0.01 MiB.
        assert!(
            peak <= predicted + (6 << 10),
            "{choose:?}: measured peak {peak} above the predicted {predicted} (budget {budget}):\n{out}"
        );
        assert!(!out.contains("exceeds --max-memory"), "{out}");
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        for l in metrics.lines().filter(|l| l.contains("\"loss\"")) {
            let m: serde_json::Value = serde_json::from_str(l).unwrap();
            assert!(m["peak_rss_bytes"].as_u64().unwrap() <= budget, "{l}");
            assert!(m.get("over_max_memory_bytes").is_none(), "{l}");
        }
    }
}

/// `--fit` counts the disk of `--offload-dir`: with room for no offload file (a small disk,
/// `MEMWALL_DISK_FREE_BYTES`), a budget that only offloading meets is refused naming the
/// disk, and with room for some the chosen plan's file fits it (it chose a file the disk could
/// not hold, which the run then refused or could not write).
#[test]
fn fit_keeps_the_offload_file_within_the_free_disk() {
    let cache = tempfile::tempdir().unwrap();
    let off = tempfile::tempdir().unwrap();
    let base = cache_env(cache.path());
    let args = [
        "plan",
        "--model",
        "gpt2-tiny",
        "--seq",
        "128",
        "--threads",
        "2",
        "--global-batch",
        "8",
        "--fit",
        "--max-memory",
        "120MiB",
        "--json",
        "--offload-dir",
        off.path().to_str().unwrap(),
    ];
    // With the whole disk, the fastest plan under 120 MiB offloads.
    let p: serde_json::Value = serde_json::from_str(&run_ok(&base, &args)).unwrap();
    let file = p["by_tier"]["nvme"].as_u64().unwrap();
    assert!(file > 0, "expected an offloading plan: {}", p["config"]);
    // A disk with room for less than that file: the plan chosen keeps to the room, or none is.
    let room = file / 2;
    let env: Vec<(&str, String)> = base
        .iter()
        .cloned()
        .chain([("MEMWALL_DISK_FREE_BYTES", room.to_string())])
        .collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let o = memwall_env(&env, &args);
    if o.status.success() {
        let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(
            p["by_tier"]["nvme"].as_u64().unwrap() <= room,
            "{}",
            p["config"]
        );
    } else {
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            e.contains("--offload-dir") && e.contains("free") && !e.contains("panicked"),
            "{e}"
        );
    }
    // No room at all: nothing that offloads is kept, and the refusal names the disk.
    let env: Vec<(&str, &str)> = base
        .iter()
        .map(|(k, v)| (*k, v.as_str()))
        .chain([("MEMWALL_DISK_FREE_BYTES", "0")])
        .collect();
    let o = memwall_env(&env, &args);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(
        e.contains("offload files must also fit the 0 B free at --offload-dir"),
        "{e}"
    );
}

/// `plan --offload ... --offload-dir` on a small disk (`MEMWALL_DISK_FREE_BYTES`): the probe
/// measures what is free (half of it) instead of refusing for its own 512 MiB, which it called
/// what "the offload file needs"; the plan's file is checked against the free space, and a
/// file larger than it is refused as the offload file's, with both sizes.
#[test]
fn plan_probes_a_small_disk_and_names_which_file_needs_what() {
    let cache = tempfile::tempdir().unwrap();
    let off = tempfile::tempdir().unwrap();
    let env: Vec<(&str, String)> = cache_env(cache.path())
        .into_iter()
        .chain([("MEMWALL_DISK_FREE_BYTES", (100u64 << 20).to_string())])
        .collect();
    let args = |what: &'static str| {
        vec![
            "plan",
            "--model",
            "gpt2-tiny",
            "--threads",
            "2",
            "--offload",
            what,
            "--offload-dir",
            off.path().to_str().unwrap(),
        ]
    };
    let out = run_ok(&env, &args("optimizer"));
    assert!(
        out.contains("of 100.00 MiB free") && out.contains("probed 48.00 MiB"),
        "{out}"
    );
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let o = memwall_env(&env, &args("all"));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        e.contains("the plan's offload file needs")
            && e.contains("but the disk has 100.00 MiB free")
            && !e.contains("512"),
        "{e}"
    );
}

/// A GPU's step time comes from its own calibration (`memwall calibrate --device cuda`,
/// saved as `calibration/cuda-<gpu>.json`), never from the CPU's: without one, `plan
/// --device cuda` gives no figure, `--fit --device cuda` is refused naming the command, and
/// `bench` reports no prediction; with one (copied from a GPU machine; here a CPU calibration
/// relabelled, since this test has no GPU), plans for the GPU are priced by it, `--fit`
/// searches with it, and CPU plans keep the CPU's.
#[test]
fn a_gpu_plan_is_timed_by_the_gpus_own_calibration() {
    let cache = tempfile::tempdir().unwrap();
    let env = cache_env(cache.path());
    let gpu_plan = [
        "plan",
        "--device",
        "cuda",
        "--model",
        "gpt2-tiny",
        "--seq",
        "64",
        "--threads",
        "2",
    ];
    let table = run_ok(&env, &gpu_plan);
    assert!(
        table.contains("not modelled: no GPU calibration"),
        "{table}"
    );
    let p: serde_json::Value =
        serde_json::from_str(&run_ok(&env, &[&gpu_plan[..], &["--json"]].concat())).unwrap();
    assert!(p["predicted_step_s"].is_null(), "{}", p["predicted_step_s"]);
    let fit = [&gpu_plan[..], &["--fit", "--max-memory", "24GiB"]].concat();
    let envs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let o = memwall_env(&envs, &fit);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("memwall calibrate --device cuda"),
        "{e}"
    );
    // A GPU machine's calibration, copied here.
    let out = run_ok(&env, &["calibrate", "--quick", "--threads", "2", "--json"]);
    let mut cal: serde_json::Value = serde_json::from_str(&out).unwrap();
    cal["cpu"] = "NVIDIA H200".into();
    cal["gpu"] = true.into();
    let dir = cache.path().join("memwall/calibration");
    std::fs::write(dir.join("cuda-nvidia-h200.json"), cal.to_string()).unwrap();
    let table = run_ok(&env, &gpu_plan);
    assert!(
        table.contains("predicted step time") && table.contains("on the GPU NVIDIA H200"),
        "{table}"
    );
    let p: serde_json::Value =
        serde_json::from_str(&run_ok(&env, &[&gpu_plan[..], &["--json"]].concat())).unwrap();
    assert!(p["predicted_step_s"].as_f64().unwrap() > 0.0, "{p}");
    let table = run_ok(&env, &fit);
    assert!(
        table.contains("fastest plans that fit --max-memory 24.00 GiB"),
        "{table}"
    );
    // The CPU's plans keep the CPU's calibration.
    let table = run_ok(
        &env,
        &[
            "plan",
            "--model",
            "gpt2-tiny",
            "--seq",
            "64",
            "--threads",
            "2",
        ],
    );
    assert!(
        table.contains("predicted step time") && !table.contains("NVIDIA H200"),
        "{table}"
    );
    // A damaged GPU calibration is named, with what to do.
    std::fs::write(dir.join("cuda-nvidia-h200.json"), "{").unwrap();
    let o = memwall_env(&envs, &gpu_plan);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && e.contains("cuda-nvidia-h200.json")
            && e.contains("memwall calibrate --device cuda"),
        "{e}"
    );
}

/// The best configuration of `ranks` ranks over every mesh shape, ZeRO stage, micro-batch and
/// policy (nothing offloaded), each rank's plan built one by one: the heaviest rank within
/// the budget, the slowest rank's time. With every fitting candidate's peak, for budgets.
fn exhaustive_mesh(
    spec: &ModelSpec,
    space: &Space,
    budget: u64,
    cal: &Calibration,
) -> ((f64, String), Vec<u64>) {
    use memwall::ir::shard::Zero;
    use memwall::ir::{Mesh, mesh::even_layers};
    use memwall::plan::stage_cut::balanced;
    let mut best = (f64::INFINITY, String::new());
    let mut peaks = Vec::new();
    let mut policies = vec![Recompute::None, Recompute::Selective];
    policies.extend((2..=spec.n_layer).map(Recompute::Every));
    policies.push(Recompute::Full);
    let n = space.ranks;
    let given = |t: usize| match space.tensor {
        Pick::Fixed(x) => t == x,
        Pick::Auto => true,
    };
    let pipe_given = |p: usize| match space.pipeline {
        Pick::Fixed(x) => p == x,
        Pick::Auto => true,
    };
    let zero_given = |z: u8| match space.zero {
        Pick::Fixed(x) => z == x.0,
        Pick::Auto => true,
    };
    for t in (1..=n).filter(|&t| n.is_multiple_of(t) && given(t)) {
        for p in (1..=n / t).filter(|&p| (n / t).is_multiple_of(p) && pipe_given(p)) {
            let mesh = Mesh::new(n, t, p, 0);
            let per_rank = space.global_batch / mesh.data;
            let zeros = if mesh.data > 1 { 0..=3 } else { 0..=0 };
            // Sequence parallelism where there are tensor ranks, both ways unless given.
            let sequences: Vec<bool> = match space.sequence_parallel {
                Pick::Fixed(s) => vec![s],
                Pick::Auto if t > 1 => vec![false, true],
                Pick::Auto => vec![false],
            };
            for (z, sequence) in (zeros.filter(|&z| zero_given(z)))
                .flat_map(|z| sequences.iter().map(move |&s| (z, s)))
            {
                for b in (1..=per_rank).filter(|&b| per_rank.is_multiple_of(b)) {
                    // The even cut, and with the cut left to the search the one balanced by
                    // predicted time (priced with no recomputation, one micro-batch).
                    let mut cuts = vec![Vec::new()];
                    if p > 1 && space.stage_layers == Pick::Auto {
                        let mut one = StepConfig::new(b, space.seq, space.threads);
                        one.mesh = mesh;
                        one.zero = Zero(z);
                        one.sequence_parallel = sequence;
                        if let Ok(b) = balanced(spec, &one, cal, None, 0, backend())
                            && b.counts != even_layers(spec.n_layer, p)
                        {
                            cuts.push(b.counts);
                        }
                    }
                    // The interleaved schedule (2 runs a stage) where it divides, unless
                    // given.
                    let interleaves = p > 1 && 2 * p <= spec.n_layer;
                    let chunks = |cut: &Vec<usize>| match space.pipeline_chunks {
                        Pick::Fixed(v) if p > 1 => vec![v],
                        Pick::Auto
                            if interleaves
                                && cut.is_empty()
                                && (per_rank / b).is_multiple_of(p) =>
                        {
                            vec![1, 2]
                        }
                        _ => vec![1],
                    };
                    for (r, cut, v) in (policies.iter()).flat_map(|&r| {
                        cuts.iter()
                            .flat_map(move |c| chunks(c).into_iter().map(move |v| (r, c, v)))
                    }) {
                        let mut cfg = StepConfig::new(b, space.seq, space.threads);
                        cfg.pipeline_chunks = v;
                        cfg.grad_accum = per_rank / b;
                        cfg.recompute = r;
                        cfg.zero = Zero(z);
                        cfg.sequence_parallel = sequence;
                        cfg.stage_layers = cut.clone();
                        let mut worst = (0u64, 0f64);
                        let mut ok = true;
                        for rank in 0..n {
                            cfg.mesh = Mesh { rank, ..mesh };
                            // Shapes the model or the strategies refuse are not candidates.
                            let Ok(plan) = build_plan(spec, &cfg, Mode::Train, backend()) else {
                                ok = false;
                                break;
                            };
                            worst.0 = worst.0.max(predicted_peak(&plan, 0));
                            worst.1 = worst.1.max(predict(&plan, cal).step_s);
                        }
                        if !ok {
                            continue;
                        }
                        peaks.push(worst.0);
                        if worst.0 <= budget && worst.1 < best.0 {
                            let sp = if sequence { " sp" } else { "" };
                            let what =
                                format!("tp {t}{sp} pp {p}(v{v}) {cut:?} zero {z} batch {b} {r}");
                            best = (worst.1, what);
                        }
                    }
                }
            }
        }
    }
    (best, peaks)
}

/// `plan --ranks 4 --fit`: the search over mesh shapes (tensor and pipeline sizes, ZeRO
/// stages, interleaved or not) finds the time that building every shape's every rank finds,
/// at budgets from roomy to the smallest shape's; each candidate's peak is its heaviest
/// rank's, built afresh.
#[test]
fn the_mesh_search_finds_what_building_every_shape_finds() {
    use memwall::ir::Mesh;
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    let cal = estimate();
    let all = Space {
        ranks: 4,
        tensor: Pick::Auto,
        pipeline: Pick::Auto,
        zero: Pick::Auto,
        sequence_parallel: Pick::Auto,
        stage_layers: Pick::Auto,
        pipeline_chunks: Pick::Auto,
        offload: Pick::Fixed(OffloadSet::NONE),
        ..space(8)
    };
    // Tensor parallelism given (none): the pipeline and ZeRO searched.
    let no_tp = Space {
        tensor: Pick::Fixed(1),
        sequence_parallel: Pick::Fixed(false),
        ..all.clone()
    };
    // Neither tensor parallelism nor ZeRO: the tight budgets leave pipelines alone, whose
    // stages differ (the embedding on the first, the head on the last).
    let pipelines = Space {
        zero: Pick::Fixed(Default::default()),
        ..no_tp.clone()
    };
    // Two pipeline stages, nothing else: the interleaved schedule halves their bubble.
    let two_stages = Space {
        ranks: 2,
        pipeline: Pick::Fixed(2),
        ..pipelines.clone()
    };
    let mut shapes_chosen = std::collections::BTreeSet::new();
    for sp in [all, no_tp, pipelines, two_stages] {
        let (_, mut peaks) = exhaustive_mesh(&spec, &sp, u64::MAX, &cal);
        peaks.sort_unstable();
        let (lo, hi) = (peaks[0], peaks[peaks.len() - 1]);
        for budget in [hi, peaks[peaks.len() / 2], lo + (hi - lo) / 16, lo] {
            let found = search::search(&spec, &sp, budget, 0, &cal, backend()).unwrap();
            let ((want, what), _) = exhaustive_mesh(&spec, &sp, budget, &cal);
            let best = &found.ranked[0];
            assert!(
                (best.time.step_s - want).abs() <= 1e-9 * want,
                "budget {budget}: search {} ({}) vs every shape {want} ({what})",
                best.time.step_s,
                best.flags()
            );
            let c = &best.cfg;
            let shape = (c.mesh.tensor, c.sequence_parallel, c.mesh.pipeline);
            shapes_chosen.insert((shape, c.stage_layers.clone(), c.pipeline_chunks));
            for k in &found.ranked {
                let mut heaviest = 0;
                for rank in 0..k.cfg.mesh.world() {
                    let cfg = StepConfig {
                        mesh: Mesh { rank, ..k.cfg.mesh },
                        ..k.cfg.clone()
                    };
                    let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
                    heaviest = heaviest.max(predicted_peak(&plan, 0));
                }
                assert_eq!(heaviest, k.peak, "{}", k.flags());
                assert!(k.peak <= budget);
            }
        }
    }
    // The budgets make it choose more than one shape (else this would test one mesh).
    assert!(shapes_chosen.len() > 1, "{shapes_chosen:?}");
    assert!(
        shapes_chosen.iter().any(|(_, _, chunks)| *chunks == 2),
        "the interleaved schedule never chosen: {shapes_chosen:?}"
    );
    eprintln!("{shapes_chosen:?}");
}
