//! A checkpoint of offloaded state is streamed into its files: saving it takes about one
//! parameter group's buffer of host memory beyond what the process already holds, not a copy
//! of the parameters and moments.
//!
//! Alone in its own test binary: it reads the whole process's peak resident set, which tests
//! running beside it in one process (allocating and freeing) would move.

use memwall::backend::cpu::Cpu;
use memwall::ckpt::{SaveOptions, TrainerState};
use memwall::exec::executor::Executor;
use memwall::plan::{Category, Mode, OffloadSet, OptimState, StepConfig, Tier, build_plan};
use memwall::util::rss;

const MIB: u64 = 1 << 20;

#[test]
fn saving_offloaded_state_takes_one_group_not_a_copy_of_the_state() {
    let tmp = tempfile::tempdir().unwrap();
    // 24 blocks of 0.8M parameters: 19M parameters, 76 MB of weights, 152 MB of moments, each
    // group's buffer about 3 MB.
    let spec = memwall::model::gpt2::spec("deep", [256, 64, 256, 24, 4]);
    for format in [OptimState::F32, OptimState::Int8] {
        let mut cfg = StepConfig::new(1, 16, 2);
        cfg.optim_state = format;
        cfg.offload.set = OffloadSet::ALL;
        cfg.offload.dir = Some(tmp.path().join("offload"));
        let plan = build_plan(&spec, &cfg, Mode::Train, &Cpu).unwrap();
        let on_disk: Vec<u64> = plan
            .buffers
            .iter()
            .filter(|b| b.placement.tier == Tier::Nvme)
            .filter(|b| {
                let state = [Category::Param, Category::Master, Category::OptimizerState];
                b.persistent && state.contains(&b.category)
            })
            .map(|b| b.bytes)
            .collect();
        let state: u64 = on_disk.iter().sum();
        let largest = on_disk.iter().copied().max().unwrap();
        let mut ex = Executor::new(plan).unwrap();
        let layout = ex.plan.layout.clone();
        ex.with_params_mut(|p| layout.init(p, 7)).unwrap();
        let state_json = TrainerState {
            step: 1,
            data_position: 1,
            seed: 7,
            rng_state: 7,
            model: spec.to_hf_config(),
            train: serde_json::Value::Null,
            memwall_version: "test".into(),
            loss_scale: None,
        };
        let run = tmp.path().join(format!("run-{format}"));

        assert!(
            rss::reset_peak_rss(),
            "the kernel refused to reset the peak RSS (/proc/self/clear_refs)"
        );
        let before = rss::current_rss().expect("Linux /proc");
        let dir = ex
            .save_checkpoint(&run, &state_json, &SaveOptions::default())
            .unwrap();
        let extra = rss::peak_rss().unwrap().saturating_sub(before);

        let written: u64 = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert!(written >= state, "{written} bytes written, state {state}");
        // One group's buffer, the writer's 1 MiB staging, and slack for the allocator.
        let bound = largest + 8 * MIB;
        eprintln!(
            "{format}: state on disk {} MiB, largest buffer {:.1} MiB, peak RSS during the save +{:.1} MiB (bound {:.1} MiB)",
            state / MIB,
            largest as f64 / MIB as f64,
            extra as f64 / MIB as f64,
            bound as f64 / MIB as f64
        );
        assert!(state > 8 * bound, "the model is too small to tell");
        assert!(
            extra <= bound,
            "{format}: saving took {extra} bytes beyond the {before} resident; one group's \
             buffer is {largest}, the whole state {state}"
        );
    }
}
