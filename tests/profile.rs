//! The profiler as a user meets it: `train --profile` and `bench --profile` write a valid Chrome
//! trace, a valid SVG memory chart and a report page that renders in a real browser (headless
//! Chromium, installed by `.ci/run`) with its chart and plan table and no script errors;
//! `memwall report` regenerates the same page; `plan --svg` draws without training; an
//! offloaded run's trace has every disk transfer of a step, adding up to the plan's traffic.

mod common;

use common::{memwall, ok};
use memwall::profile::trace;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Parses `path` as XML and checks it is an SVG document with text in it.
fn check_svg(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text)
        .unwrap_or_else(|e| panic!("{} is not well-formed XML: {e}", path.display()));
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg", "{}", path.display());
    assert!(root.attribute("width").is_some() && root.attribute("height").is_some());
    assert!(doc.descendants().any(|n| n.has_tag_name("text")));
    text
}

/// A Chromium binary: `MEMWALL_CHROMIUM`, else the first of the usual names on PATH.
fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("MEMWALL_CHROMIUM") {
        return p.into();
    }
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(o) = Command::new("which").arg(name).output()
            && o.status.success()
        {
            return String::from_utf8_lossy(&o.stdout).trim().into();
        }
    }
    panic!(
        "no Chromium found: the report test opens report.html in a real browser. Install Debian's \
         `chromium` (.ci/run does: apt-get install -y chromium) or set MEMWALL_CHROMIUM"
    );
}

/// Loads `page` in headless Chromium and returns the DOM after its scripts ran.
fn rendered_dom(page: &Path, scratch: &Path) -> String {
    let url = format!("file://{}", page.canonicalize().unwrap().display());
    let o = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--enable-logging=stderr",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", scratch.display()))
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .expect("start chromium");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "chromium failed on {url}:\n{stderr}");
    // Console errors (uncaught exceptions) are logged to stderr with --enable-logging.
    assert!(
        !stderr.contains("Uncaught"),
        "script errors while rendering {url}:\n{stderr}"
    );
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// The rendered page has its chart and plan table, its script finished, and no script error.
fn check_report_renders(html: &Path, scratch: &Path) {
    let dom = rendered_dom(html, scratch);
    let doc_start = dom.find("<body").expect("a body");
    let body_tag = &dom[doc_start..doc_start + dom[doc_start..].find('>').unwrap()];
    assert!(
        body_tag.contains("data-ready=\"1\""),
        "the page's script did not finish: {body_tag}"
    );
    assert!(
        !body_tag.contains("data-errors"),
        "script errors on the page: {body_tag}"
    );
    let chart = dom.find("id=\"memory-chart\"").expect("memory chart");
    assert!(
        dom[chart..].trim_start().contains("<svg"),
        "chart has no svg"
    );
    let table = dom.find("id=\"plan-table\"").expect("plan table");
    for cat in ["param", "grad", "optimizer_state", "activation"] {
        assert!(dom[table..].contains(cat), "plan table lacks {cat}");
    }
    assert!(dom.contains("id=\"peak-buffers\""));
}

#[test]
fn train_profile_writes_trace_svg_and_a_report_that_renders_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::prepared(dir.path(), &common::small_corpus(dir.path()));
    let cfg = common::micro_config(dir.path());
    let run = dir.path().join("run");
    let args = common::train_args(
        &cfg,
        &data,
        &run,
        &[
            "--steps",
            "8",
            "--batch",
            "2",
            "--seq",
            "32",
            "--threads",
            "1",
            "--eval-every",
            "4",
            "--save-every",
            "2",
            "--profile",
            "--profile-steps",
            "2",
        ],
    );
    let out = ok(&args);
    assert!(out.contains("report.html"), "{out}");

    // profile.json: two steps, every op of the schedule once per step, in order, with RSS.
    let plan = json(&run.join("plan.json"));
    let n_ops = plan["schedule"].as_array().unwrap().len();
    let profile = json(&run.join("profile.json"));
    let steps = profile["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    for (k, s) in steps.iter().enumerate() {
        assert_eq!(s["step"], k as u64 + 1);
        let ops = s["ops"].as_array().unwrap();
        let idx: Vec<u64> = ops.iter().map(|o| o["op"].as_u64().unwrap()).collect();
        assert_eq!(idx, (0..n_ops as u64).collect::<Vec<_>>());
        let baseline = profile["baseline_rss"].as_u64().unwrap();
        assert!(ops.iter().all(|o| o["rss"].as_u64().unwrap() > baseline));
        assert!(
            ops.windows(2)
                .all(|w| w[0]["end_us"].as_f64() <= w[1]["start_us"].as_f64())
        );
    }
    // Step 2 wrote a checkpoint: it is on the I/O track with its bytes.
    assert!(
        steps[1]["spans"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["track"] == "io" && s["name"].as_str().unwrap().contains("checkpoint"))
    );

    // trace.json: valid Chrome trace, one complete event per profiled op, the three tracks,
    // and the two counter tracks.
    let t = json(&run.join("trace.json"));
    let n = trace::validate(&t).unwrap_or_else(|e| panic!("trace.json: {e}"));
    let ev = t["traceEvents"].as_array().unwrap();
    assert_eq!(n, ev.len());
    let ops = ev
        .iter()
        .filter(|e| e["ph"] == "X" && e["tid"] == 1 && e["cat"] != "step")
        .count();
    assert_eq!(ops, 2 * n_ops);
    for track in ["compute", "io", "communication"] {
        assert!(
            ev.iter()
                .any(|e| e["name"] == "thread_name" && e["args"]["name"] == track)
        );
    }
    assert!(ev.iter().any(|e| e["ph"] == "C"
        && e["name"] == "plan: host RAM by category"
        && e["args"]["param"].as_u64().unwrap() > 0));
    assert!(
        ev.iter()
            .any(|e| e["ph"] == "C" && e["name"] == "measured: RSS above baseline")
    );

    // memory.svg is SVG and marks the peak; the report renders in a browser.
    let svg = check_svg(&run.join("memory.svg"));
    assert!(svg.contains("peak "), "no peak label");
    assert!(svg.contains("live at the peak"));
    let html = run.join("report.html");
    check_report_renders(&html, &dir.path().join("chromium"));

    // The metrics carry the leak check's clock (the step-0 line, the validation loss before
    // the first update, has no update and no clock), and this run does not leak.
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .collect();
    assert_eq!(lines[0]["step"], 0);
    assert!(lines[0]["val_loss"].is_number() && lines[0].get("loss").is_none());
    let clock: Vec<u64> = lines[1..]
        .iter()
        .map(|l| l["process_step"].as_u64().unwrap())
        .collect();
    assert_eq!(clock, (1..=8).collect::<Vec<_>>());
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains("memory check: resident memory flat"),
        "leak verdict missing"
    );

    // `memwall report` regenerates the same page from the run directory alone.
    std::fs::remove_file(&html).unwrap();
    std::fs::remove_file(run.join("trace.json")).unwrap();
    let out = ok(&["report", run.to_str().unwrap()]);
    assert!(
        out.contains("report.html") && out.contains("trace.json"),
        "{out}"
    );
    // The terminal summary names the peak, its largest buffer and the step's phases.
    assert!(out.contains("peak of live bytes"), "{out}");
    assert!(
        out.contains("params (param)") || out.contains("(optimizer_state)"),
        "{out}"
    );
    assert!(out.contains("forward") && out.contains("backward"), "{out}");
    assert_eq!(std::fs::read_to_string(&html).unwrap(), page);
    // And for scripts, JSON: the peak agrees with plan.json's accounting.
    let v: Value = serde_json::from_str(&ok(&["report", run.to_str().unwrap(), "--json"])).unwrap();
    assert_eq!(
        v["peak_live_bytes"].as_u64().unwrap(),
        plan["peak_live_bytes"].as_u64().unwrap() + plan["external_bytes"].as_u64().unwrap()
    );
    assert_eq!(v["peak_op"], plan["peak_op"]);
    assert_eq!(v["leak_check"]["leaking"], false);
}

/// An offloaded run's profile shows every disk transfer of a step on the I/O track, with its
/// bytes, direction and rate, adding up to the plan's traffic per step, and the trace, chart
/// and report show the disk tier. Gradients on disk defer each update into the next step's
/// forward, so step 1 (nothing pending yet) runs all but the deferred update's transfers,
/// and step 2 all of a step's.
#[test]
fn offloaded_profile_shows_every_disk_transfer_and_the_disk_tier() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::prepared(dir.path(), &common::small_corpus(dir.path()));
    let cfg = common::micro_config(dir.path());
    let run = dir.path().join("run");
    let args = common::train_args(
        &cfg,
        &data,
        &run,
        &[
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq",
            "16",
            "--threads",
            "1",
            "--eval-every",
            "0",
            "--eval-batches",
            "1",
            "--offload",
            "all",
            "--profile",
            "--profile-steps",
            "2",
        ],
    );
    ok(&args);
    let plan = json(&run.join("plan.json"));
    let (read, written) = (
        plan["io_read_bytes_per_step"].as_u64().unwrap(),
        plan["io_write_bytes_per_step"].as_u64().unwrap(),
    );
    assert!(read > 0 && written > 0, "not offloaded: {read} / {written}");
    let schedule = plan["schedule"].as_array().unwrap();
    let transfers = |phases: &[&str]| {
        schedule
            .iter()
            .filter(|o| {
                let n = o["name"].as_str().unwrap();
                let phase = o["phase"].as_str().unwrap();
                phases.contains(&phase) && (n.ends_with(".read") || n.ends_with(".write"))
            })
            .count()
    };
    let gradients = ["forward", "recompute", "backward"];
    let in_step = ["forward", "recompute", "backward", "deferred_update"];
    assert!(transfers(&gradients) < transfers(&in_step));
    let staging: Vec<&str> = plan["buffers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["tier"] == "host")
        .map(|b| b["name"].as_str().unwrap())
        .collect();

    // profile.json: per step, one span per transfer op, named after its host buffer.
    let profile = json(&run.join("profile.json"));
    let steps = profile["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    for s in steps {
        let io: Vec<&Value> = s["spans"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|sp| sp.get("direction").is_some())
            .collect();
        let first = s["step"] == 1;
        let want = transfers(if first { &gradients } else { &in_step });
        assert_eq!(io.len(), want, "step {}", s["step"]);
        let sum = |dir: &str| -> u64 {
            io.iter()
                .filter(|sp| sp["direction"] == dir)
                .map(|sp| sp["bytes"].as_u64().unwrap())
                .sum()
        };
        if !first {
            assert_eq!((sum("read"), sum("write")), (read, written), "step 2");
        }
        for sp in &io {
            assert_eq!(sp["track"], "io");
            let name = sp["name"].as_str().unwrap();
            let (dir, buf) = name.split_once(' ').unwrap();
            assert_eq!(sp["direction"], dir, "{name}");
            assert!(staging.contains(&buf), "{name}: no host buffer {buf}");
            let (a, b) = (
                sp["start_us"].as_f64().unwrap(),
                sp["end_us"].as_f64().unwrap(),
            );
            assert!(
                s["start_us"].as_f64().unwrap() <= a
                    && a <= b
                    && b <= s["end_us"].as_f64().unwrap(),
                "{name} outside its step"
            );
        }
    }

    // trace.json: the transfers as complete events on the I/O track, per step, with their
    // bytes, direction and rate; the disk tier's live bytes as a counter.
    let t = json(&run.join("trace.json"));
    trace::validate(&t).unwrap();
    let ev = t["traceEvents"].as_array().unwrap();
    let io_tid = ev
        .iter()
        .find(|e| e["name"] == "thread_name" && e["args"]["name"] == "io")
        .unwrap()["tid"]
        .clone();
    let step_events: Vec<&Value> = ev.iter().filter(|e| e["cat"] == "step").collect();
    assert_eq!(step_events.len(), 2);
    for st in step_events {
        let (a, b) = (
            st["ts"].as_f64().unwrap(),
            st["ts"].as_f64().unwrap() + st["dur"].as_f64().unwrap(),
        );
        let mut bytes = 0;
        for e in ev.iter().filter(|e| {
            e["ph"] == "X"
                && e["tid"] == io_tid
                && e["args"].get("direction").is_some()
                && (a..=b).contains(&e["ts"].as_f64().unwrap())
        }) {
            assert!(["read", "write"].contains(&e["args"]["direction"].as_str().unwrap()));
            assert!(e["args"]["gb_per_s"].as_f64().unwrap() > 0.0, "{e}");
            bytes += e["args"]["bytes"].as_u64().unwrap();
        }
        if st["name"] == "step 2" {
            assert_eq!(bytes, read + written, "{}", st["name"]);
        } else {
            assert!(0 < bytes && bytes < read + written, "{}", st["name"]);
        }
    }
    let disk: Vec<u64> = ev
        .iter()
        .filter(|e| e["ph"] == "C" && e["name"] == trace::DISK_COUNTER)
        .map(|e| e["args"]["bytes"].as_u64().unwrap())
        .collect();
    let file = plan["by_tier"]["nvme"].as_u64().unwrap();
    assert!(
        !disk.is_empty() && disk.iter().all(|&d| d > 0 && d <= file),
        "{disk:?} (file {file})"
    );

    // The chart, the page and the terminal summary name the disk tier and its traffic.
    let svg = check_svg(&run.join("memory.svg"));
    assert!(svg.contains("disk tier (offload file)"), "chart");
    let page = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(
        page.contains("on disk (offload file") && page.contains("disk transfers in step 2"),
        "report.html lacks the disk tier"
    );
    let out = ok(&["report", run.to_str().unwrap()]);
    assert!(
        out.contains("disk tier: ") && out.contains("read/written per step"),
        "{out}"
    );
    assert!(out.contains("  disk transfers: "), "{out}");
}

#[test]
fn bench_profile_and_plan_svg() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::micro_config(dir.path());
    let prof = dir.path().join("bench-prof");
    let out = ok(&[
        "bench",
        "--model",
        cfg.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "3",
        "--threads",
        "1",
        "--profile",
        prof.to_str().unwrap(),
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["config"]["profile"], true);
    assert_eq!(v["profile"]["dir"], prof.to_str().unwrap());
    let t = json(&prof.join("trace.json"));
    trace::validate(&t).unwrap();
    check_svg(&prof.join("memory.svg"));
    assert_eq!(
        json(&prof.join("profile.json"))["steps"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
    check_report_renders(&prof.join("report.html"), &dir.path().join("chromium"));
    // The browser check is not blind: the same page with a failing script is caught.
    let page = std::fs::read_to_string(prof.join("report.html")).unwrap();
    let broken = dir.path().join("broken.html");
    std::fs::write(
        &broken,
        page.replacen("</ul>", "</ul><script>no_such_function();</script>", 1),
    )
    .unwrap();
    let scratch = dir.path().join("chromium2");
    let caught = std::panic::catch_unwind(|| check_report_renders(&broken, &scratch));
    assert!(caught.is_err(), "a script error went unnoticed");

    // The predicted timeline, without training anything.
    let svg = dir.path().join("plan.svg");
    let out = ok(&[
        "plan",
        "--model",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "64",
        "--recompute",
        "full",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(out.contains("memory timeline drawn to"), "{out}");
    let text = check_svg(&svg);
    assert!(text.contains("op of the schedule") && text.contains("recompute full"));
}

#[test]
fn report_refuses_what_is_not_a_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let o = memwall(&["report", dir.path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("has no plan.json") && !err.contains("panicked"),
        "{err}"
    );
    std::fs::write(dir.path().join("plan.json"), "{not json").unwrap();
    let o = memwall(&["report", dir.path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("is not a memwall plan.json"), "{err}");
    let missing = dir.path().join("nope");
    let o = memwall(&["report", missing.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("is not a directory"));
}

#[test]
fn a_report_that_cannot_be_written_does_not_end_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::prepared(dir.path(), &common::small_corpus(dir.path()));
    let cfg = common::micro_config(dir.path());
    let run = dir.path().join("run");
    // report.html is taken by a non-empty directory: the atomic rename onto it fails.
    std::fs::create_dir_all(run.join("report.html/x")).unwrap();
    let args = common::train_args(
        &cfg,
        &data,
        &run,
        &[
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq",
            "16",
            "--threads",
            "1",
            "--profile",
            "--profile-steps",
            "1",
        ],
    );
    let o = memwall(&args);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{all}");
    assert!(
        all.contains("warning: the profile could not be written"),
        "{all}"
    );
    assert!(
        run.join("checkpoints/step-000003/model.safetensors")
            .exists()
    );
    // What could be written was: the profile and the trace.
    trace::validate(&json(&run.join("trace.json"))).unwrap();
}
