//! A checkpoint of offloaded state is streamed into its files and back: saving it, and
//! resuming from it, take about one parameter group's buffer of host memory beyond what the
//! process already holds, not a copy of the parameters and moments.
//!
//! Alone in its own test binary: it reads the whole process's peak resident set, which tests
//! running beside it in one process (allocating and freeing) would move.

use memwall::backend::under_test as backend;
use memwall::ckpt::{SaveOptions, TrainerState};
use memwall::exec::executor::Executor;
use memwall::ir::Moments;
use memwall::ir::{Category, OptimState, Tier};
use memwall::plan::{Mode, OffloadSet, StepConfig, build_plan};
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
        let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
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
        let mut ex = Executor::on(plan, backend()).unwrap();
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

        // Resuming streams the other way: into a fresh executor of the same plan, group by
        // group, to the same bits.
        let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
        let mut back = Executor::on(plan, backend()).unwrap();
        assert!(rss::reset_peak_rss());
        let before = rss::current_rss().unwrap();
        memwall::ckpt::load_params_by(&dir, &layout, |copy| back.fill_params(|r, p| copy(r, p)))
            .unwrap();
        let st = memwall::ckpt::load_trainer_state_by(&dir, (&layout, &layout), format, |copy| {
            back.fill_moments(copy)
        })
        .unwrap();
        let extra = rss::peak_rss().unwrap().saturating_sub(before);
        eprintln!(
            "{format}: peak RSS during the resume +{:.1} MiB (bound {:.1} MiB)",
            extra as f64 / MIB as f64,
            bound as f64 / MIB as f64
        );
        assert!(
            extra <= bound,
            "{format}: resuming took {extra} bytes beyond the {before} resident; one group's \
             buffer is {largest}, the whole state {state}"
        );
        assert_eq!(st.step, 1);
        let bits = |ex: &Executor| {
            let p = ex.with_params(|p| p.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            (p.unwrap(), ex.with_moments(moment_bits).unwrap())
        };
        assert!(
            bits(&back) == bits(&ex),
            "{format}: the resumed state differs"
        );
    }
}

/// Every moment value's bits, m then v (then the int8 scales).
fn moment_bits(m: Moments<'_>) -> Vec<u32> {
    match m {
        Moments::F32 { m, v } => m.iter().chain(v).map(|x| x.to_bits()).collect(),
        Moments::Bf16 { m, v } => m.iter().chain(v).map(|x| x.to_bits() as u32).collect(),
        Moments::Int8 {
            m,
            m_absmax,
            v,
            v_absmax,
        } => (m.iter().map(|&x| x as u8 as u32))
            .chain(v.iter().map(|&x| x as u32))
            .chain(m_absmax.iter().chain(v_absmax).map(|x| x.to_bits()))
            .collect(),
    }
}
