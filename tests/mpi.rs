//! Ranks as processes under `mpirun` (cargo feature `mpi`; `.ci/run` installs Open MPI and
//! runs these): the same mathematics as one process with accumulation at every ZeRO stage
//! (2 and 4 ranks), each rank's memory as planned, resume on the same and on another number
//! of ranks, a killed rank, ranks started with different flags; tensor-parallel ranks
//! (`--tp`, with `--zero` 0–3 on the data axis) training, saving and resuming on one
//! process, and one process resuming on them, like one process; pipeline stages, evenly and
//! unevenly cut, likewise.
#![cfg(feature = "mpi")]

mod common;

use common::worst_tensor;
use memwall::backend::under_test as backend;

use memwall::model::{ModelSpec, ParamLayout};
use memwall::run_dir::metrics;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_memwall");

/// `mpirun -np N memwall ARGS` as root in a container, more ranks than cores allowed,
/// threaded ranks unbound; `env` passed to every rank.
fn mpirun(np: usize, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
    ]);
    c.args(["-np", &np.to_string()]);
    for (k, v) in env {
        c.env(k, v).args(["-x", k]);
    }
    c.arg(BIN).args(args);
    c.output().unwrap_or_else(|e| {
        panic!(
            "cannot run mpirun ({e}): these tests need Open MPI (apt-get install openmpi-bin libopenmpi-dev)"
        )
    })
}

/// What a command printed, standard output then standard error.
fn output_text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ok(o: &Output) -> String {
    let text = output_text(o);
    assert!(o.status.success(), "failed:\n{text}");
    text
}

/// A prepared corpus shared by the tests of this file.
fn data(dir: &Path) -> PathBuf {
    common::prepared(dir, &common::small_corpus(dir))
}

/// The flags of a run of `steps` steps of gpt2-tiny, 1 thread, micro-batch `b`.
fn run_args(data: &Path, out: &Path, b: usize, steps: u64) -> Vec<String> {
    [
        "train",
        "--model",
        "gpt2-tiny",
        "--seq",
        "64",
        "--threads",
        "1",
        "--lr",
        "2e-3",
        "--warmup",
        "2",
        "--eval-every",
        "0",
        "--save-every",
        "10",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--data".into(),
        data.display().to_string(),
        "--out".into(),
        out.display().to_string(),
        "--batch".into(),
        b.to_string(),
        "--steps".into(),
        steps.to_string(),
    ])
    .collect()
}

/// `train --resume RUN`.
fn resume(run: &Path) -> Vec<String> {
    vec![
        "train".to_string(),
        "--resume".into(),
        run.display().to_string(),
    ]
}

/// The plan.json a run wrote.
fn plan_json(run: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(run.join("plan.json")).unwrap()).unwrap()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(|s| s.as_str()).collect()
}

fn losses(run: &Path) -> Vec<f32> {
    metrics::read(&run.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .filter_map(|m| m.update.as_ref().map(|u| u.loss))
        .collect()
}

fn weights(run: &Path, step: u64) -> (ParamLayout, Vec<f32>) {
    let dir = run.join(format!("checkpoints/step-{step:06}"));
    let layout = ParamLayout::new(&ModelSpec::preset("gpt2-tiny").unwrap());
    let mut p = vec![0.0f32; layout.total];
    memwall::ckpt::load_params(&dir, &layout, &mut p).unwrap();
    (layout, p)
}

fn assert_same_training(what: &str, run: &Path, reference: &Path, steps: u64) {
    assert_close_training(what, run, reference, steps, 1e-3);
}

/// Losses within 1e-5 relative, weights within `tol` (worst tensor).
fn assert_close_training(what: &str, run: &Path, reference: &Path, steps: u64, tol: f64) {
    let (a, b) = (losses(run), losses(reference));
    assert_eq!(a.len() as u64, steps, "{what}");
    for (k, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "{what}: step {} loss {x} vs {y}",
            k + 1
        );
    }
    let (layout, w) = weights(run, steps);
    let (_, r) = weights(reference, steps);
    let worst = worst_tensor(&layout, &w, &r);
    assert!(worst < tol, "{what}: weights differ by {worst}");
}

#[test]
fn ranks_train_like_one_process_with_accumulation_at_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let steps = 20;
    for (ranks, b) in [(2usize, 4usize), (4, 2)] {
        let reference = dir.path().join(format!("ref{ranks}"));
        let mut args = run_args(&data, &reference, b, steps);
        args.extend(["--grad-accum".into(), ranks.to_string()]);
        ok(&common::memwall(&strs(&args)));
        for zero in 0..=3 {
            let out = dir.path().join(format!("n{ranks}z{zero}"));
            let mut args = run_args(&data, &out, b, steps);
            args.extend(["--zero".into(), zero.to_string()]);
            // Profiling changes nothing that runs: one stage is profiled (rank 0's files).
            if zero == 1 {
                args.extend(["--profile".into(), "--profile-steps".into(), "2".into()]);
            }
            // Collectives on a communication thread at stages 2 and 3 (forced: this machine
            // may have no core to spare for it), inline at 0 and 1 (forced too).
            let thread = if zero >= 2 { "1" } else { "0" };
            let text = ok(&mpirun(
                ranks,
                &strs(&args),
                &[("MEMWALL_COMM_THREAD", thread)],
            ));
            let mode = if zero >= 2 {
                "beside compute"
            } else {
                "inline"
            };
            assert!(text.contains(&format!("collectives {mode}")), "{text}");
            if zero == 1 {
                let trace = std::fs::read_to_string(out.join("trace.json")).unwrap();
                assert!(trace.contains("reduce_scatter"), "collectives on the trace");
                assert!(trace.contains("\"communication\""), "a communication track");
                for r in 1..ranks {
                    assert!(
                        trace.contains(&format!("communication, rank {r}")),
                        "rank {r}'s communication track"
                    );
                }
                let html = std::fs::read_to_string(out.join("report.html")).unwrap();
                assert!(
                    html.contains(&format!("{ranks} processes, --zero 1")),
                    "ranks in the report"
                );
            }
            assert!(text.contains(&format!("ranks: {ranks} (MPI")), "{text}");
            assert_same_training(
                &format!("{ranks} ranks, --zero {zero}"),
                &out,
                &reference,
                steps,
            );
            // Every rank wrote its own metrics (rank 0 the run's), and sent per step what the
            // plan says, as MPI's transport counted it.
            let plan = plan_json(&out);
            let planned = plan["comm_bytes_per_step"].as_u64().unwrap();
            assert!(planned > 0);
            for r in 0..ranks {
                let name = match r {
                    0 => "metrics.jsonl".to_string(),
                    r => format!("metrics.rank{r}.jsonl"),
                };
                let steps = metrics::read(&out.join(name)).unwrap();
                let sent: Vec<u64> = steps
                    .iter()
                    .filter_map(|m| m.update.as_ref()?.comm_bytes)
                    .collect();
                assert_eq!(sent.len(), steps.len(), "rank {r}: every step counted");
                assert!(
                    sent.iter().all(|&b| b == planned),
                    "rank {r}: sent {sent:?}, planned {planned}"
                );
            }
        }
    }
}

/// (peak RSS, plan + baseline) from a rank's summary line.
fn peaks(text: &str) -> Vec<(f64, f64)> {
    let bytes = |s: &str| memwall::util::bytes::parse_bytes(s.trim()).unwrap() as f64;
    text.lines()
        .filter_map(|l| {
            let rest = l.split("peak RSS ").nth(1)?;
            let (peak, rest) = rest.split_once(" (plan ")?;
            let (plan, rest) = rest.split_once(" + baseline ")?;
            let base = rest.split(')').next()?;
            Some((bytes(peak), bytes(plan) + bytes(base)))
        })
        .collect()
}

/// Each of `ranks` ranks' summary in `text` has its peak RSS within 3% of its plan.
fn assert_peaks_as_planned(text: &str, ranks: usize, what: &str) {
    let p = peaks(text);
    assert_eq!(p.len(), ranks, "{what}: a summary per rank:\n{text}");
    for (peak, planned) in p {
        let err = (peak - planned).abs() / planned;
        assert!(
            err <= 0.03,
            "{what}: peak RSS {peak} vs plan {planned} ({:.1}%)",
            err * 100.0
        );
    }
}

#[test]
fn each_rank_peaks_as_planned() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    // Checkpoints at steps 10 and 12 included: rank 0 gathers the others' shards piece by
    // piece into arena bytes free between steps (bf16 leaves the least of them).
    let cases: [&[&str]; 4] = [
        &["--zero", "0"],
        &["--zero", "1"],
        &["--zero", "3"],
        &["--zero", "2", "--precision", "bf16", "--grad-accum", "2"],
    ];
    for extra in cases {
        let zero = extra.join(" ");
        let out = dir.path().join(zero.replace(' ', "_"));
        let mut args = run_args(&data, &out, 4, 12);
        args.extend(extra.iter().map(|s| s.to_string()));
        let text = ok(&mpirun(2, &strs(&args), &[]));
        assert_peaks_as_planned(&text, 2, &zero);
    }
}

#[test]
fn a_killed_rank_stops_the_run_which_resumes_bitwise_or_re_sharded() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let args = |out: &Path| {
        let mut a = run_args(&data, out, 2, 20);
        a.extend(["--zero".into(), "1".into()]);
        a
    };
    let whole = dir.path().join("whole");
    ok(&mpirun(4, &strs(&args(&whole)), &[]));
    // Rank 1 killed in step 15: every rank ends, non-zero, within a minute, the lost rank
    // named; the checkpoint of step 10 stays loadable.
    let killed = dir.path().join("killed");
    let t0 = Instant::now();
    let o = mpirun(4, &strs(&args(&killed)), &[("MEMWALL_KILL_RANK", "1:15")]);
    let took = t0.elapsed();
    let text = output_text(&o);
    assert!(!o.status.success(), "{text}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert!(text.contains("rank 1"), "the lost rank is named:\n{text}");
    let (_, w) = weights(&killed, 10);
    assert!(w.iter().all(|x| x.is_finite()));
    let copy = dir.path().join("copy");
    copy_dir(&killed, &copy);
    // Resumed on the same 4 ranks: bitwise the uninterrupted run.
    ok(&mpirun(4, &strs(&resume(&killed)), &[]));
    let file =
        |run: &Path| std::fs::read(run.join("checkpoints/step-000020/model.safetensors")).unwrap();
    assert!(
        file(&killed) == file(&whole),
        "resumed on the same ranks: bitwise"
    );
    assert_eq!(losses(&killed), losses(&whole));
    // Resumed on 2 ranks of 2 micro-batches at stage 3 (the same global batch): the
    // state re-sharded, the same mathematics.
    let mut other = resume(&copy);
    other.extend([
        "--grad-accum".into(),
        "2".into(),
        "--zero".into(),
        "3".into(),
    ]);
    let text = ok(&mpirun(2, &strs(&other), &[]));
    assert!(
        text.contains("ranks: 2") && text.contains("--zero 3"),
        "{text}"
    );
    assert_same_training("resumed on 2 ranks", &copy, &whole, 20);
}

/// `--tp 2` as processes: 2 tensor ranks × 2 data ranks train like one process with
/// accumulation 2; 2 tensor ranks killed after their step-5 checkpoint resume on one
/// process (`--tp 1`) and finish like an uninterrupted one process. GPT-2's key bias is
/// held to the noise bound (`common::key_biases_within_noise`), every other tensor to 1e-4.
#[test]
fn tensor_ranks_train_like_one_process_and_resume_on_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let steps = 20;
    let close = |what: &str, run: &Path, reference: &Path| {
        assert_close_tensor_ranks(what, run, reference, steps)
    };
    let tp = |out: &Path| {
        let mut a = run_args(&data, out, 2, steps);
        let at = a.iter().position(|f| f == "--save-every").unwrap();
        a[at + 1] = "5".into();
        a.extend(["--tp".into(), "2".into()]);
        a
    };
    // 4 processes: 2 copies of the model, each cut in 2.
    let accum = dir.path().join("accum");
    let mut a = run_args(&data, &accum, 2, steps);
    a.extend(["--grad-accum".into(), "2".into()]);
    ok(&common::memwall(&strs(&a)));
    let four = dir.path().join("tp2dp2");
    ok(&mpirun(4, &strs(&tp(&four)), &[]));
    let plan = plan_json(&four);
    assert_eq!(
        (&plan["config"]["tensor"], &plan["config"]["ranks"]),
        (&serde_json::json!(2), &serde_json::json!(2)),
        "the run planned 2 tensor ranks of 2 copies"
    );
    close("tp 2 x dp 2", &four, &accum);
    // 2 processes, one copy cut in 2, killed in step 7: resumed on one process.
    let one = dir.path().join("one");
    ok(&common::memwall(&strs(&run_args(&data, &one, 2, steps))));
    let killed = dir.path().join("killed");
    let o = mpirun(2, &strs(&tp(&killed)), &[("MEMWALL_KILL_RANK", "1:7")]);
    assert!(!o.status.success(), "{}", output_text(&o));
    let mut again = resume(&killed);
    again.extend(["--tp".into(), "1".into()]);
    ok(&common::memwall(&strs(&again)));
    close("tp 2 resumed on one process", &killed, &one);
}

/// `--tp 2 --lora` as processes: 2 tensor ranks train GPT-2's adapters (cut with their
/// layers, input dropout on) like one process, save the whole adapter as PEFT's files at step
/// 5, are killed in step 7 and resume on one process (`--tp 1`), finishing like an
/// uninterrupted one process: losses within 1e-5, the adapter within 1e-4.
#[test]
fn lora_on_tensor_ranks_resumes_on_one_process_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let steps = 20;
    let lora = |out: &Path, extra: &[&str]| {
        let mut a = run_args(&data, out, 2, steps);
        let at = a.iter().position(|f| f == "--save-every").unwrap();
        a[at + 1] = "5".into();
        let flags = ["--lora", "4", "--lora-dropout", "0.1"];
        a.extend(flags.iter().chain(extra).map(|s| s.to_string()));
        a
    };
    let one = dir.path().join("one");
    ok(&common::memwall(&strs(&lora(&one, &[]))));
    let killed = dir.path().join("killed");
    let o = mpirun(
        2,
        &strs(&lora(&killed, &["--tp", "2"])),
        &[("MEMWALL_KILL_RANK", "1:7")],
    );
    assert!(!o.status.success(), "{}", output_text(&o));
    let saved = killed.join("checkpoints/step-000005");
    assert!(saved.join("adapter_model.safetensors").is_file());
    let mut again = resume(&killed);
    again.extend(["--tp".into(), "1".into()]);
    ok(&common::memwall(&strs(&again)));
    let what = "tp 2 LoRA resumed on one process";
    let (a, b) = (losses(&killed), losses(&one));
    assert_eq!(a.len() as u64, steps, "{what}");
    for (k, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "{what}: step {} loss {x} vs {y}",
            k + 1
        );
    }
    let base = ParamLayout::new(&ModelSpec::preset("gpt2-tiny").unwrap());
    let adapter = |run: &Path| {
        let dir = run.join(format!("checkpoints/step-{steps:06}"));
        memwall::ckpt::adapter::load_adapter(&dir, &base).unwrap()
    };
    let ((layout, w), (_, r)) = (adapter(&killed), adapter(&one));
    let worst = worst_tensor(&layout.params, &w, &r);
    assert!(worst < 1e-4, "{what}: adapters differ by {worst}");
    // B starts at zero: it moved.
    let b = (layout.params.tensors.iter()).filter(|t| t.name.contains("lora_B"));
    assert!(
        b.flat_map(|t| &r[t.range.clone()]).any(|&x| x != 0.0),
        "{what}: the adapters trained"
    );
}

/// `--pp 2` as processes: 2 stages × 2 tensor ranks (4 processes, 4 micro-batches in the
/// 1F1B order) train like one process with the same accumulation, each rank peaking at its
/// own stage's plan (the stages differ); 2 stages killed in step 7 resume on one process
/// and finish like an uninterrupted one.
#[test]
fn pipeline_stages_train_like_one_process_peak_as_planned_and_resume_on_one() {
    let steps = 20;
    let (dir, data, one) = staged_reference(steps);
    let close = |what: &str, run: &Path, reference: &Path| {
        assert_close_tensor_ranks(what, run, reference, steps)
    };
    let args = |out: &Path, extra: &[&str]| staged_args(&data, out, steps, extra);
    let four = dir.path().join("tp2pp2");
    let text = ok(&mpirun(
        4,
        &strs(&args(&four, &["--tp", "2", "--pp", "2"])),
        &[],
    ));
    let plan = plan_json(&four);
    assert_eq!(plan["config"]["pipeline"], serde_json::json!(2), "{plan}");
    close("tp 2 x pp 2", &four, &one);
    peaks_as_planned("tp 2 x pp 2", &text, 4);
    let killed = dir.path().join("killed");
    let o = mpirun(
        2,
        &strs(&args(&killed, &["--pp", "2"])),
        &[("MEMWALL_KILL_RANK", "1:7")],
    );
    assert!(!o.status.success(), "{}", output_text(&o));
    let mut again = resume(&killed);
    again.extend(["--pp".into(), "1".into()]);
    ok(&common::memwall(&strs(&again)));
    close("pp 2 resumed on one process", &killed, &one);
}

/// tp 2 × pp 2 × dp 2 as 8 processes with ZeRO 1 on the data axis train like one process
/// with the data ranks' accumulation (their peaks: on gpt2 124M,
/// [`ranks_of_a_124m_model_peak_within_2_percent_of_their_plans`]).
#[test]
fn eight_ranks_of_every_axis_train_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let steps = 20;
    let args = |out: &Path, extra: &[&str]| staged_args(&data, out, steps, extra);
    let one = dir.path().join("one");
    // One process takes both data ranks' 4 micro-batches a step.
    let mut alone = args(&one, &[]);
    let at = alone.iter().position(|f| f == "--grad-accum").unwrap();
    alone[at + 1] = "8".into();
    ok(&common::memwall(&strs(&alone)));
    let eight = dir.path().join("tp2pp2dp2");
    let mesh = ["--tp", "2", "--pp", "2", "--zero", "1"];
    ok(&mpirun(8, &strs(&args(&eight, &mesh)), &[]));
    let plan = plan_json(&eight);
    let c = &plan["config"];
    assert_eq!(
        (&c["ranks"], &c["tensor"], &c["pipeline"]),
        (
            &serde_json::json!(2),
            &serde_json::json!(2),
            &serde_json::json!(2)
        ),
        "{plan}"
    );
    assert_close_tensor_ranks("tp 2 x pp 2 x dp 2", &eight, &one, steps);
}

/// The bound on a model whose plans dwarf the process's fixed bytes: gpt2 (124M) as
/// tp 2 × pp 2 (4 processes) and tp 2 × pp 2 × dp 2 with ZeRO 1 (8 processes), each rank's
/// measured peak within 2% of its own plan and baseline (they measured 0.5–0.9% over).
#[test]
fn ranks_of_a_124m_model_peak_within_2_percent_of_their_plans() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    for (np, zero) in [(4, "0"), (8, "1")] {
        let out = dir.path().join(format!("gpt2-{np}"));
        let mut a = run_args(&data, &out, 1, 3);
        let model = a.iter().position(|f| f == "--model").unwrap();
        a[model + 1] = "gpt2".into();
        let seq = a.iter().position(|f| f == "--seq").unwrap();
        a[seq + 1] = "128".into();
        let save = a.iter().position(|f| f == "--save-every").unwrap();
        a[save + 1] = "0".into();
        let mesh = [
            "--grad-accum",
            "2",
            "--tp",
            "2",
            "--pp",
            "2",
            "--zero",
            zero,
        ];
        a.extend(mesh.map(String::from));
        let text = ok(&mpirun(np, &strs(&a), &[]));
        peaks_within(&format!("gpt2 on {np} ranks"), &text, np, 0.02);
    }
}

/// `--pp 3` as processes on GPT-2's tied embedding: the first and the last stage hold it and
/// sum its gradients between the two of them alone (the middle stage holds none), and the
/// three train like one process.
#[test]
fn a_tied_embedding_on_three_stages_trains_like_one_process() {
    let steps = 20;
    let (dir, data, one) = staged_reference(steps);
    let args = |out: &Path, extra: &[&str]| staged_args(&data, out, steps, extra);
    let three = dir.path().join("pp3");
    ok(&mpirun(3, &strs(&args(&three, &["--pp", "3"])), &[]));
    assert_close_tensor_ranks("pp 3, tied", &three, &one, steps);
}

/// `--tp 2 --sequence-parallel` as processes: 2 stages × 2 tensor ranks (the residual stream,
/// the norms and what each stage sends cut by rows among the tensor ranks) train like one
/// process, each rank peaking at its own plan; 2 tensor ranks killed in step 7 resume on one
/// process (`--tp 1`: sequence parallelism off, a note says so) and finish like an
/// uninterrupted one.
#[test]
fn sequence_parallel_ranks_train_peak_as_planned_and_resume_on_one() {
    let steps = 20;
    let (dir, data, one) = staged_reference(steps);
    let args = |out: &Path, extra: &[&str]| staged_args(&data, out, steps, extra);
    let four = dir.path().join("tp2pp2sp");
    let sp = ["--tp", "2", "--pp", "2", "--sequence-parallel"];
    let text = ok(&mpirun(4, &strs(&args(&four, &sp)), &[]));
    let plan = plan_json(&four);
    assert_eq!(
        plan["config"]["sequence_parallel"],
        serde_json::json!(true),
        "{plan}"
    );
    assert_close_tensor_ranks("tp 2 sp x pp 2", &four, &one, steps);
    peaks_as_planned("tp 2 sp x pp 2", &text, 4);
    let killed = dir.path().join("killed");
    let o = mpirun(
        2,
        &strs(&args(&killed, &["--tp", "2", "--sequence-parallel"])),
        &[("MEMWALL_KILL_RANK", "1:7")],
    );
    assert!(!o.status.success(), "{}", output_text(&o));
    let mut again = resume(&killed);
    again.extend(["--tp".into(), "1".into()]);
    let text = ok(&common::memwall(&strs(&again)));
    assert!(text.contains("--sequence-parallel"), "{text}");
    assert_close_tensor_ranks("tp 2 sp resumed on one process", &killed, &one, steps);
}

/// `train --fit` under mpirun: rank 0 searches the job's meshes (tensor and pipeline sizes,
/// sequence parallelism, ZeRO stage, the micro-batch and the rest) with its calibration, and
/// every rank trains its choice: the ranks' options agree (a rank whose options differed from
/// rank 0's would stop the run), and plan.json holds the choice the table names.
#[test]
fn train_fit_under_mpirun_trains_rank_0s_choice_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let out = dir.path().join("fit");
    let mut a = run_args(&data, &out, 2, 4);
    let at = a.iter().position(|f| f == "--batch").unwrap();
    a.drain(at..at + 2);
    a.extend(["--global-batch", "8", "--fit", "--max-memory", "1GiB"].map(String::from));
    let text = ok(&mpirun(4, &strs(&a), &[]));
    let chosen = (text.lines())
        .find_map(|l| l.split("training with the fastest: ").nth(1))
        .unwrap_or_else(|| panic!("the choice named:\n{text}"));
    let plan = plan_json(&out);
    let c = &plan["config"];
    let flag = |f: &str| {
        let v = chosen
            .split(&format!("{f} "))
            .nth(1)
            .unwrap_or_else(|| panic!("{f} in {chosen}"));
        v.split_whitespace().next().unwrap().to_string()
    };
    assert_eq!(
        c["tensor"].as_u64().unwrap_or(1).to_string(),
        flag("--tp"),
        "{c}"
    );
    assert_eq!(
        c["pipeline"].as_u64().unwrap_or(1).to_string(),
        flag("--pp"),
        "{c}"
    );
    assert_eq!(c["batch"].to_string(), flag("--batch"), "{c}");
    assert!(
        plan["fit"]["candidates"].is_array(),
        "the search's record: {plan}"
    );
    for r in 1..4 {
        let m = metrics::read(&out.join(format!("metrics.rank{r}.jsonl"))).unwrap();
        assert_eq!(
            m.iter().filter(|s| s.update.is_some()).count(),
            4,
            "rank {r}"
        );
    }
}

/// `--pp 2 --pp-layers 3,1` as processes: stages of 3 layers and of 1 (with the head),
/// killed in step 7, resume on their own cut (which `--resume` keeps), and a copy resumes on
/// another (`--pp-layers 1,3`: checkpoints are whole models); both finish like the
/// uninterrupted one process, each rank peaking at its own stage's plan.
#[test]
fn uneven_stages_resume_on_their_cut_or_another_and_peak_as_planned() {
    let steps = 20;
    let (dir, data, one) = staged_reference(steps);
    let args = |out: &Path, extra: &[&str]| staged_args(&data, out, steps, extra);
    let cut = |run: &Path| plan_json(run)["config"]["stage_layers"].clone();
    let as_planned = |what: &str, text: &str| peaks_as_planned(what, text, 2);
    let killed = dir.path().join("killed");
    let uneven = args(&killed, &["--pp", "2", "--pp-layers", "3,1"]);
    let o = mpirun(2, &strs(&uneven), &[("MEMWALL_KILL_RANK", "1:7")]);
    assert!(!o.status.success(), "{}", output_text(&o));
    assert_eq!(cut(&killed), serde_json::json!([3, 1]));
    let copy = dir.path().join("copy");
    copy_dir(&killed, &copy);
    let text = ok(&mpirun(2, &strs(&resume(&killed)), &[]));
    assert_eq!(
        cut(&killed),
        serde_json::json!([3, 1]),
        "--resume keeps the cut"
    );
    as_planned("3,1 resumed", &text);
    assert_close_tensor_ranks("pp 2 cut 3,1 resumed", &killed, &one, steps);
    let mut other = resume(&copy);
    other.extend(["--pp-layers".into(), "1,3".into()]);
    let text = ok(&mpirun(2, &strs(&other), &[]));
    assert_eq!(cut(&copy), serde_json::json!([1, 3]), "{text}");
    as_planned("3,1 resumed on 1,3", &text);
    assert_close_tensor_ranks("pp 2 cut 3,1 resumed on 1,3", &copy, &one, steps);
}

/// `--pp 2 --pp-chunks 2` as processes: the interleaved schedule (each stage two runs of
/// layers, the last stage sending on to the first) trains like one process, each rank
/// peaking at its own plan; killed in step 7, it resumes on its own schedule (which
/// `--resume` keeps) and a copy resumes on one process (`--pp 1`: the interleaving off, a
/// note says so), both finishing like the uninterrupted one process.
#[test]
fn interleaved_stages_train_peak_as_planned_and_resume_on_one() {
    let steps = 20;
    let (dir, data, one) = staged_reference(steps);
    let args = |out: &Path, extra: &[&str]| staged_args(&data, out, steps, extra);
    let chunks = |run: &Path| plan_json(run)["config"]["pipeline_chunks"].clone();
    let killed = dir.path().join("killed");
    let interleaved = args(&killed, &["--pp", "2", "--pp-chunks", "2"]);
    let o = mpirun(2, &strs(&interleaved), &[("MEMWALL_KILL_RANK", "1:7")]);
    assert!(!o.status.success(), "{}", output_text(&o));
    assert_eq!(chunks(&killed), serde_json::json!(2));
    let copy = dir.path().join("copy");
    copy_dir(&killed, &copy);
    let text = ok(&mpirun(2, &strs(&resume(&killed)), &[]));
    assert_eq!(chunks(&killed), serde_json::json!(2), "--resume keeps it");
    peaks_as_planned("pp 2 x 2 runs resumed", &text, 2);
    assert_close_tensor_ranks("pp 2 x 2 runs resumed", &killed, &one, steps);
    let mut alone = resume(&copy);
    alone.extend(["--pp".into(), "1".into()]);
    let text = ok(&common::memwall(&strs(&alone)));
    assert!(text.contains("--pp-chunks 2"), "{text}");
    assert_close_tensor_ranks("pp 2 x 2 runs resumed on one", &copy, &one, steps);
}

/// Every rank of tp 2 × pp 2, then of dp 2 (ZeRO 1) × pp 2, offloads its state
/// (`--offload all`: one file per rank in the directory they share) and trains as the same
/// ranks do in RAM, checkpoints byte for byte; each rank peaks as planned; the offload
/// files are gone when the run ends; a run whose rank is killed resumes offloaded and ends
/// as the run in RAM.
#[test]
fn ranks_that_offload_train_as_in_ram_peak_as_planned_and_resume() {
    let steps = 10;
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let scratch = dir.path().join("scratch");
    let offload = [
        "--offload",
        "all",
        "--offload-dir",
        scratch.to_str().unwrap(),
    ];
    let args = |out: &Path, extra: &[&str]| staged_args(&data, out, steps, extra);
    for (what, mesh) in [
        ("tp 2 x pp 2", ["--tp", "2", "--pp", "2", "--zero", "0"]),
        (
            "dp 2 x pp 2 zero 1",
            ["--tp", "1", "--pp", "2", "--zero", "1"],
        ),
    ] {
        let ram = dir.path().join(format!("{what} ram"));
        ok(&mpirun(4, &strs(&args(&ram, &mesh)), &[]));
        let off = dir.path().join(format!("{what} offloaded"));
        let text = ok(&mpirun(
            4,
            &strs(&args(&off, &[&mesh[..], &offload].concat())),
            &[],
        ));
        assert!(text.contains("offload all"), "{what}: {text}");
        same_checkpoints(what, &off, &ram, steps);
        peaks_as_planned(&format!("{what} offloaded"), &text, 4);
        let left: Vec<_> = std::fs::read_dir(&scratch).into_iter().flatten().collect();
        assert!(left.is_empty(), "{what}: offload files left: {left:?}");
        let killed = dir.path().join(format!("{what} killed"));
        let o = mpirun(
            4,
            &strs(&args(&killed, &[&mesh[..], &offload].concat())),
            &[("MEMWALL_KILL_RANK", "1:7")],
        );
        assert!(!o.status.success(), "{what}: {}", output_text(&o));
        ok(&mpirun(4, &strs(&resume(&killed)), &[]));
        same_checkpoints(&format!("{what} killed and resumed"), &killed, &ram, steps);
    }
}

/// Asserts that runs `a` and `b` saved the same checkpoint at `step`, byte for byte.
fn same_checkpoints(what: &str, a: &Path, b: &Path, step: u64) {
    let at = |run: &Path| run.join(format!("checkpoints/step-{step:06}"));
    for name in ["model.safetensors", "optimizer.safetensors"] {
        let (x, y) = (at(a).join(name), at(b).join(name));
        let (x, y) = (std::fs::read(&x).unwrap(), std::fs::read(&y).unwrap());
        assert!(x == y, "{what}: {name} differs");
    }
}

/// A temporary directory with prepared data and the one-process run the pipeline tests
/// compare with ([`staged_args`], `steps` steps): (the directory, the data, the run).
fn staged_reference(steps: u64) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let one = dir.path().join("one");
    ok(&common::memwall(&strs(&staged_args(
        &data,
        &one,
        steps,
        &[],
    ))));
    (dir, data, one)
}

/// [`run_args`] for the pipeline tests: 2 rows of 4 micro-batches a step, saved every 5
/// steps, then `extra`.
fn staged_args(data: &Path, out: &Path, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut a = run_args(data, out, 2, steps);
    let at = a.iter().position(|f| f == "--save-every").unwrap();
    a[at + 1] = "5".into();
    a.extend(
        ["--grad-accum", "4"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string()),
    );
    a
}

/// Each of the `ranks` summaries in `text` of a gpt2-tiny run peaks within 4% of its own
/// rank's plan and baseline. Those plans are 75–150 MiB, where the 1.5–4.5 MiB that the MPI
/// library and the runtime touch outside the plan (its runtime reserve, not counted here) are
/// 2–3.5% (rank 0 of a resumed run the most); the 2% is held on a 124M model,
/// [`ranks_of_a_124m_model_peak_within_2_percent_of_their_plans`].
fn peaks_as_planned(what: &str, text: &str, ranks: usize) {
    peaks_within(what, text, ranks, 0.04)
}

/// Each of the `ranks` summaries in `text` peaks within `bound` of its own rank's plan and
/// baseline.
fn peaks_within(what: &str, text: &str, ranks: usize, bound: f64) {
    let p = peaks(text);
    assert_eq!(p.len(), ranks, "{what}: a summary per rank:\n{text}");
    for (rank, (peak, planned)) in p.into_iter().enumerate() {
        let err = (peak - planned).abs() / planned;
        assert!(
            err <= bound,
            "{what} rank {rank}: peak RSS {peak} vs its plan {planned} ({:.1}%)",
            err * 100.0
        );
    }
}

/// [`assert_close_training`] for tensor ranks (lr 2e-3): losses within 1e-5 relative, GPT-2's
/// key bias held to the noise bound (`common::key_biases_within_noise`), every other tensor
/// to 1e-4.
fn assert_close_tensor_ranks(what: &str, run: &Path, reference: &Path, steps: u64) {
    let (a, b) = (losses(run), losses(reference));
    assert_eq!(a.len() as u64, steps, "{what}");
    for (k, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "{what}: step {} loss {x} vs {y}",
            k + 1
        );
    }
    let (layout, mut w) = weights(run, steps);
    let (_, r) = weights(reference, steps);
    common::key_biases_within_noise(&layout, &mut w, &r, 2.0 * 2e-3 * steps as f32, what);
    let worst = worst_tensor(&layout, &w, &r);
    assert!(worst < 1e-4, "{what}: weights differ by {worst}");
}

/// `--tp 2` with `--zero` on the data axis as processes (2 tensor ranks x 2 data ranks),
/// each run of 4 processes saving the whole model through rank 0: at stage 3 they train
/// like one process with accumulation 2; at stage 1, killed in step 7, they resume on one
/// process; one process killed in step 7 resumes on them at stage 2. Every run finishes
/// like the uninterrupted one process.
#[test]
fn tensor_ranks_with_zero_save_and_resume_on_other_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let steps = 10;
    let args = |out: &Path, extra: &[&str]| {
        let mut a = run_args(&data, out, 2, steps);
        let at = a.iter().position(|f| f == "--save-every").unwrap();
        a[at + 1] = "5".into();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let accum = dir.path().join("accum");
    ok(&common::memwall(&strs(&args(
        &accum,
        &["--grad-accum", "2"],
    ))));
    // Stage 3: parameters sharded along the data axis and cut along the tensor axis.
    let four = dir.path().join("zero3");
    let text = ok(&mpirun(
        4,
        &strs(&args(&four, &["--tp", "2", "--zero", "3"])),
        &[],
    ));
    assert!(text.contains("--zero 3"), "{text}");
    assert_close_tensor_ranks("tp 2 x dp 2 zero 3", &four, &accum, steps);
    // Stage 1, rank 3 (data rank 1's second tensor rank) killed in step 7: one process
    // resumes the step-5 checkpoint.
    let killed = dir.path().join("zero1");
    let o = mpirun(
        4,
        &strs(&args(&killed, &["--tp", "2", "--zero", "1"])),
        &[("MEMWALL_KILL_RANK", "3:7")],
    );
    assert!(!o.status.success(), "{}", output_text(&o));
    let mut again = resume(&killed);
    again.extend(["--tp", "1", "--zero", "0", "--grad-accum", "2"].map(String::from));
    ok(&common::memwall(&strs(&again)));
    assert_close_tensor_ranks(
        "tp 2 x dp 2 zero 1 resumed on one process",
        &killed,
        &accum,
        steps,
    );
    // One process killed in step 7: 4 processes at stage 2 resume its step-5 checkpoint.
    let alone = dir.path().join("alone");
    let o = common::memwall_env(
        &[("MEMWALL_KILL_RANK", "0:7")],
        &strs(&args(&alone, &["--grad-accum", "2"])),
    );
    assert!(!o.status.success(), "{}", output_text(&o));
    let mut again = resume(&alone);
    again.extend(["--tp", "2", "--zero", "2", "--grad-accum", "1"].map(String::from));
    ok(&mpirun(4, &strs(&again), &[]));
    assert_close_tensor_ranks(
        "one process resumed on tp 2 x dp 2 zero 2",
        &alone,
        &accum,
        steps,
    );
}

#[test]
fn int8_state_sharded_at_block_edges_trains_saves_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    // 3 ranks: uneven cuts at the 8-bit blocks' edges, a rank owning none of a group.
    let args = |out: &Path, zero: &str| {
        let mut a = run_args(&data, out, 2, 20);
        a.extend(["--optim-state", "int8", "--zero", zero].map(String::from));
        a
    };
    let reference = dir.path().join("reference");
    let mut one = args(&reference, "0");
    one.extend(["--grad-accum".into(), "3".into()]);
    ok(&common::memwall(&strs(&one)));
    let whole = dir.path().join("whole");
    ok(&mpirun(
        3,
        &strs(&args(&whole, "2")),
        &[("MEMWALL_COMM_THREAD", "1")],
    ));
    // 8-bit moments round the sums' last bits into whole codes now and then: one process
    // with batch 2 x 3 micro-batches against batch 6 or 3 x 2 differs by 1.8e-3 and 4.5e-3
    // (worst tensor, step 20), so the weights are held to 1e-2 here; the losses to 1e-5.
    let int8_tol = 1e-2;
    assert_close_training("3 ranks, int8, --zero 2", &whole, &reference, 20, int8_tol);
    // Killed after the step-10 checkpoint, resumed on the same ranks: bitwise (the scales
    // and codes of every rank's blocks were gathered and loaded back exactly).
    let killed = dir.path().join("killed");
    let o = mpirun(
        3,
        &strs(&args(&killed, "2")),
        &[("MEMWALL_KILL_RANK", "2:15")],
    );
    assert!(!o.status.success());
    let copy = dir.path().join("copy");
    copy_dir(&killed, &copy);
    ok(&mpirun(3, &strs(&resume(&killed)), &[]));
    let file = |run: &Path| {
        std::fs::read(run.join("checkpoints/step-000020/optimizer.safetensors")).unwrap()
    };
    assert!(
        file(&killed) == file(&whole),
        "resumed on the same ranks: bitwise"
    );
    // Resumed in one process of 3 micro-batches (`--zero 0`): the same mathematics.
    let mut alone = resume(&copy);
    alone.extend(["--grad-accum", "3", "--zero", "0"].map(String::from));
    ok(&common::memwall(&strs(&alone)));
    assert_close_training("int8 resumed in one process", &copy, &whole, 20, int8_tol);
}

#[test]
fn an_error_on_one_rank_ends_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    // Rank 0 cannot write the checkpoint of step 10 (a file stands where its directory
    // goes) while the others send it their shards: every rank ends, the error printed.
    let out = dir.path().join("run");
    std::fs::create_dir_all(out.join("checkpoints")).unwrap();
    std::fs::write(out.join("checkpoints/step-000010"), "in the way").unwrap();
    let mut args = run_args(&data, &out, 2, 12);
    args.extend(["--zero".into(), "1".into()]);
    let t0 = Instant::now();
    let o = mpirun(2, &strs(&args), &[]);
    let text = output_text(&o);
    assert!(!o.status.success(), "{text}");
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "no rank waits for ever"
    );
    assert!(
        text.contains("error (rank 0): saving the checkpoint of step 10"),
        "{text}"
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn ranks_with_different_flags_and_zero_without_mpirun_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let out = dir.path().join("run");
    let a = run_args(&data, &out, 2, 4);
    let mut b = a.clone();
    b.extend(["--seed".into(), "5".into()]);
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        "1",
        BIN,
    ])
    .args(&a)
    .args([":", "-np", "1", BIN])
    .args(&b);
    let o = c.output().unwrap();
    let text = output_text(&o);
    assert!(!o.status.success());
    assert!(
        text.contains("rank 1 was started with a different configuration"),
        "{text}"
    );
    assert!(
        !out.join("plan.json").exists(),
        "refused before anything is written"
    );
    // --zero outside mpirun says how to run it.
    let mut z = run_args(&data, &dir.path().join("z"), 2, 4);
    z.extend(["--zero".into(), "1".into()]);
    let o = common::memwall(&strs(&z));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("mpirun -np N"), "{err}");
}

#[test]
fn calibrating_under_mpirun_measures_the_collectives_that_plans_for_as_many_ranks_use() {
    let cache = tempfile::tempdir().unwrap();
    let xdg = cache.path().to_str().unwrap();
    let env = [("XDG_CACHE_HOME", xdg)];
    let text = ok(&mpirun(2, &["calibrate"], &env));
    assert!(
        text.contains("collectives among 2 ranks over MPI"),
        "{text}"
    );
    assert!(text.contains("all_reduce/bf16"), "{text}");
    let saved = cache.path().join("memwall/calibration/ranks-2.json");
    let t: memwall::plan::time::Transport =
        serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    assert_eq!((t.ranks, t.kinds.len()), (2, 9), "{t:?}");
    // Fitted on every size (the slope is not checked: the tests beside this one share the
    // cores, and a stalled small size can flatten a fit).
    let valid = |v: f64| v.is_finite() && v >= 0.0;
    assert!(t.kinds.values().all(|c| c.samples == 5
        && valid(c.s_per_byte)
        && valid(c.s_per_op)
        && c.seconds(0, 1 << 26) > 0.0));

    // `plan --ranks 2` times its collectives with it; `--ranks 3` has none measured.
    let plan = |ranks: &str| -> serde_json::Value {
        let o = common::memwall_env(
            &env,
            &[
                "plan",
                "--model",
                "gpt2-tiny",
                "--seq",
                "64",
                "--batch",
                "2",
                "--ranks",
                ranks,
                "--zero",
                "1",
                "--json",
            ],
        );
        serde_json::from_str(&ok(&o)).unwrap()
    };
    let two = plan("2");
    let said = two["predicted"]["collectives"].as_str().unwrap();
    assert!(
        said.starts_with("measured among 2 ranks over MPI"),
        "{said}"
    );
    let three = plan("3");
    let said = three["predicted"]["collectives"].as_str().unwrap();
    assert!(
        said.contains("assumed") && said.contains("mpirun -np 3 memwall calibrate"),
        "{said}"
    );

    // The predicted seconds are the fitted costs' (the plan rebuilt here, the same way).
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let mut cfg = memwall::plan::StepConfig::new(2, 64, 2);
    cfg.mesh = memwall::ir::Mesh::data_parallel(2, 0);
    cfg.zero = memwall::ir::shard::Zero(1);
    let p = memwall::plan::build_plan(&spec, &cfg, memwall::plan::Mode::Train, backend()).unwrap();
    let mut cal = memwall::plan::time::Calibration::estimate("any".into(), 2, 100.0);
    cal.transport = Some(t);
    let want = memwall::plan::time::predict(&p, &cal).comm_s;
    let got = two["predicted"]["comm_s"].as_f64().unwrap();
    assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");

    // Under mpirun, calibrate measures the transport only.
    let o = mpirun(2, &["calibrate", "--offload-dir", xdg], &env);
    assert!(!o.status.success());
    assert!(
        output_text(&o).contains("--offload-dir"),
        "{}",
        output_text(&o)
    );
}

/// Distillation on data ranks (`--distill-from` under mpirun, ZeRO 0 and 2): each rank runs
/// the teacher over its own rows, and the ranks train as one process accumulating them, each
/// rank's peak as its plan (teacher included) predicts.
#[test]
fn distilling_ranks_train_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    // The teacher: gpt2-tiny trained a little.
    let teacher = dir.path().join("teacher");
    ok(&common::memwall(&strs(&run_args(&data, &teacher, 4, 10))));
    let teacher = teacher.join("checkpoints/step-000010");
    let distill = ["--distill-from".to_string(), teacher.display().to_string()];
    let steps = 6;
    let reference = dir.path().join("ref");
    let mut args = run_args(&data, &reference, 2, steps);
    args.extend(distill.clone());
    args.extend(["--grad-accum".into(), "2".into()]);
    ok(&common::memwall(&strs(&args)));
    for zero in [0, 2] {
        let out = dir.path().join(format!("z{zero}"));
        let mut args = run_args(&data, &out, 2, steps);
        args.extend(distill.clone());
        args.extend(["--zero".into(), zero.to_string()]);
        let text = ok(&mpirun(2, &strs(&args), &[]));
        assert!(text.contains("distilling from"), "{text}");
        assert_same_training(
            &format!("distilled, --zero {zero}"),
            &out,
            &reference,
            steps,
        );
        assert_peaks_as_planned(&text, 2, &format!("distilled, --zero {zero}"));
        let json = plan_json(&out);
        assert!(json["by_category"]["teacher"].as_u64().unwrap() > 0);
    }
}
