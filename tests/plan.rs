//! The planner seen from outside: plans of the real CPU backend's sizing are valid, pack
//! tightly, hold what their mode needs, refuse bad step configurations and over-budget plans
//! with the flag to change. (These live here, not in `src/plan`, so that the planner's code
//! and its own tests import nothing from `backend::cpu`.)

use memwall::backend::cpu::Cpu;
use memwall::model::ModelSpec;
use memwall::plan::fit::{check_budget, largest_batch};
use memwall::plan::{Category, Mode, StepConfig, build_plan};

#[test]
fn gpt2_plan_is_valid_and_packs_tightly() {
    let spec = ModelSpec::preset("gpt2").unwrap();
    let plan = build_plan(&spec, &StepConfig::new(4, 256, 2), Mode::Train, &Cpu).unwrap();
    let p = 124_439_808u64 * 4;
    let by = plan.bytes_by_category();
    let get = |c: Category| by.iter().find(|x| x.0 == c).unwrap().1;
    assert_eq!(get(Category::Param), p);
    assert_eq!(get(Category::Grad), p);
    assert_eq!(get(Category::OptimizerState), 2 * p);
    // Packing reuses backward scratch: the arena is far below the sum of all buffers, and
    // within 2% of the lower bound.
    let sum: u64 = plan.buffers.iter().map(|b| b.bytes).sum();
    assert!(plan.arena_bytes < sum);
    assert!(
        plan.arena_bytes as f64 <= plan.peak_live_bytes as f64 * 1.02,
        "{} vs {}",
        plan.arena_bytes,
        plan.peak_live_bytes
    );
}

#[test]
fn generate_plan_has_no_training_state() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let plan = build_plan(&spec, &StepConfig::new(1, 64, 2), Mode::Generate, &Cpu).unwrap();
    assert!(
        plan.buffers
            .iter()
            .all(|b| !matches!(b.category, Category::Grad | Category::OptimizerState))
    );
}

#[test]
fn bad_step_configs_name_the_flag() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let e = |cfg: StepConfig| {
        format!(
            "{:#}",
            build_plan(&spec, &cfg, Mode::Train, &Cpu).unwrap_err()
        )
    };
    assert!(e(StepConfig::new(0, 64, 2)).contains("--batch"));
    assert!(e(StepConfig::new(1, 1000, 2)).contains("--seq"));
    assert!(e(StepConfig::new(1, 64, 0)).contains("--threads"));
}

#[test]
fn over_budget_names_flag_and_largest_batch() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let plan = build_plan(&spec, &StepConfig::new(32, 256, 2), Mode::Train, &Cpu).unwrap();
    let budget = plan.total_bytes() / 2;
    let msg = format!("{:#}", check_budget(&plan, budget, 0, &Cpu).unwrap_err());
    assert!(
        msg.contains("--max-memory") && msg.contains("--batch"),
        "{msg}"
    );
    let (b, p) = largest_batch(&spec, &plan.cfg, Mode::Train, budget, 0, &Cpu)
        .unwrap()
        .unwrap();
    assert!(b < 32 && p <= budget);
    let next = build_plan(&spec, &StepConfig::new(b + 1, 256, 2), Mode::Train, &Cpu).unwrap();
    assert!(next.total_bytes() > budget);
    assert!(check_budget(&plan, plan.total_bytes(), 0, &Cpu).is_ok());
    let tiny = format!("{:#}", check_budget(&plan, 1 << 20, 0, &Cpu).unwrap_err());
    assert!(tiny.contains("even --batch 1"), "{tiny}");
}
