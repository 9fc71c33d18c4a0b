//! The CUDA backend's device on a real GPU (ignored without one: `scripts/gpu-check.sh` runs
//! them with `--ignored`): opening GPU 0, a whole plan's device memory allocated and zeroed,
//! bytes up and down unchanged, and a `Zero` op run. Prints one JSON line of what it saw
//! (the card, its memory, the context's share) for the GPU run's log.
#![cfg(feature = "cuda")]

use memwall::backend::{DeviceId, StepCtx};
use memwall::ir::Op;
use memwall::model::ModelSpec;
use memwall::plan::{Mode, StepConfig, build_plan};

fn ctx() -> StepCtx {
    StepCtx {
        seq: None,
        training: true,
        loss_scale: 1.0,
        update: None,
        dropout_seed: 0,
        first_micro: 0,
        loss_tokens: 1,
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn a_plan_starts_on_the_gpu_and_its_buffers_round_trip() {
    let cuda: DeviceId = "cuda".parse().unwrap();
    let backend = cuda.open().expect("GPU 0 opens");
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let plan = build_plan(&spec, &StepConfig::new(2, 32, 1), Mode::Train, backend).unwrap();
    let facts = backend.bench_facts(plan.cfg.precision.storage());
    println!(
        "{}",
        serde_json::json!({"gpu": facts, "plan_device_bytes": plan.arena_bytes()})
    );
    let program = plan.program();
    let comms =
        memwall::dist::Comms::new(std::sync::Arc::new(memwall::dist::Single), &plan.cfg.mesh)
            .unwrap();
    let mut dev = backend.start(&program, comms).expect("the plan starts");
    // A buffer the schedule zeroes: filled from the host, read back, zeroed by its op.
    let (i, buf) = plan
        .schedule
        .ops
        .iter()
        .enumerate()
        .find_map(|(i, e)| match e.op {
            Op::Zero { buf } => Some((i, buf)),
            _ => None,
        })
        .expect("a training plan zeroes its gradients");
    let bytes = plan.buffer(buf).bytes as usize;
    let pattern: Vec<u8> = (0..bytes).map(|k| (k % 251) as u8 + 1).collect();
    dev.upload(&[buf], &mut |v| v[0].copy_from_slice(&pattern))
        .unwrap();
    let mut back = Vec::new();
    dev.download(&[buf], &mut |v| back = v[0].to_vec()).unwrap();
    assert_eq!(back, pattern, "bytes up and down");
    dev.run(&plan.schedule.ops[i], &ctx()).unwrap();
    dev.sync().unwrap();
    dev.download(&[buf], &mut |v| back = v[0].to_vec()).unwrap();
    assert!(back.iter().all(|&b| b == 0), "Zero left bytes");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn a_gpu_that_is_not_there_is_refused_by_number() {
    let e = format!(
        "{:#}",
        "cuda:63".parse::<DeviceId>().unwrap().open().err().unwrap()
    );
    assert!(
        e.contains("--device cuda:63") && e.contains("cuda:0"),
        "{e}"
    );
}
