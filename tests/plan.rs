//! The planner seen from outside: plans of the real CPU backend's sizing are valid, pack
//! tightly, hold what their mode needs, refuse bad step configurations and over-budget plans
//! with the flag to change. (These live here, not in `src/plan`, so that the planner's code
//! and its own tests import nothing from `backend::cpu`.)

use memwall::backend::under_test as backend;
use memwall::ir::{Category, Recompute};
use memwall::model::ModelSpec;
use memwall::plan::fit::{check_budget, largest_batch};
use memwall::plan::{Mode, StepConfig, build_plan};

#[test]
fn gpt2_plan_is_valid_and_packs_tightly() {
    let spec = ModelSpec::preset("gpt2").unwrap();
    let plan = build_plan(&spec, &StepConfig::new(4, 256, 2), Mode::Train, backend()).unwrap();
    let p = 124_439_808u64 * 4;
    let by = plan.bytes_by_category();
    let get = |c: Category| by.iter().find(|x| x.0 == c).unwrap().1;
    assert_eq!(get(Category::Param), p);
    assert_eq!(get(Category::Grad), p);
    assert_eq!(get(Category::OptimizerState), 2 * p);
    // Packing reuses backward scratch: the arena is far below the sum of all buffers, and
    // within 2% of the lower bound.
    let sum: u64 = plan.buffers.iter().map(|b| b.bytes).sum();
    assert!(plan.arena_bytes() < sum);
    assert!(
        plan.arena_bytes() as f64 <= plan.peak_live_bytes as f64 * 1.02,
        "{} vs {}",
        plan.arena_bytes(),
        plan.peak_live_bytes
    );
}

#[test]
fn generate_plan_has_no_training_state() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let plan = build_plan(&spec, &StepConfig::new(1, 64, 2), Mode::Generate, backend()).unwrap();
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
            build_plan(&spec, &cfg, Mode::Train, backend()).unwrap_err()
        )
    };
    assert!(e(StepConfig::new(0, 64, 2)).contains("--batch"));
    assert!(e(StepConfig::new(1, 1000, 2)).contains("--seq"));
    assert!(e(StepConfig::new(1, 64, 0)).contains("--threads"));
}

#[test]
fn over_budget_names_flag_and_largest_batch() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let plan = build_plan(&spec, &StepConfig::new(32, 256, 2), Mode::Train, backend()).unwrap();
    let budget = plan.total_bytes() / 2;
    let msg = format!(
        "{:#}",
        check_budget(&plan, budget, 0, backend()).unwrap_err()
    );
    assert!(
        msg.contains("--max-memory") && msg.contains("--batch"),
        "{msg}"
    );
    let (b, p) = largest_batch(&spec, &plan.cfg, Mode::Train, budget, 0, backend())
        .unwrap()
        .unwrap();
    assert!(b < 32 && p <= budget);
    let next = build_plan(
        &spec,
        &StepConfig::new(b + 1, 256, 2),
        Mode::Train,
        backend(),
    )
    .unwrap();
    assert!(next.predicted_peak(0) > budget);
    // The budget counts the runtime reserve beside the plan's bytes.
    assert!(check_budget(&plan, plan.predicted_peak(0), 0, backend()).is_ok());
    let e = format!(
        "{:#}",
        check_budget(&plan, plan.total_bytes(), 0, backend()).unwrap_err()
    );
    assert!(e.contains("runtime reserve"), "{e}");
    let tiny = format!(
        "{:#}",
        check_budget(&plan, 1 << 20, 0, backend()).unwrap_err()
    );
    assert!(tiny.contains("even --batch 1"), "{tiny}");
}

/// A group's gradients are live from a `Zero` just before the group's first gradient write
/// to its `AdamW` op, so where the forward's activations peak only the head's exist; under
/// accumulation they live from the first micro-batch's backward through the second's forward.
#[test]
fn gradient_buffers_live_from_first_write_to_update() {
    use memwall::ir::schedule::{Op, Phase};
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    for accum in [1, 2] {
        let mut cfg = StepConfig::new(2, 32, 1);
        cfg.grad_accum = accum;
        let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
        let ops = &plan.schedule.ops;
        let grads = plan.schedule.implicit.grads.as_ref().unwrap();
        assert_eq!(grads.segments.len(), plan.layout.groups.len());
        let total: usize = grads.segments.iter().map(|s| s.range.len()).sum();
        assert_eq!(total, plan.layout.total);
        let first_backward = ops.iter().position(|o| o.phase == Phase::Backward).unwrap();
        for (seg, group) in grads.segments.iter().zip(&plan.layout.groups) {
            let b = plan.buffer(seg.buf);
            assert_eq!(b.category, Category::Grad);
            assert!(matches!(ops[b.first_op].op, Op::Zero { buf } if buf == seg.buf));
            // The next op is the group's first gradient write.
            assert_eq!(ops[b.first_op + 1].grads.map(|g| g.buf), Some(seg.buf));
            assert_eq!(ops[b.last_op].name, format!("{}.adamw", group.name));
            if group.name.starts_with('h') {
                // Blocks: born in micro-batch 0's backward, never before.
                assert!(b.first_op > first_backward, "{}", b.name);
                assert!(ops[b.first_op].name.starts_with("zero_"));
            }
        }
        if accum == 1 {
            // At the end of the forward (the LM head, where activations peak) no block's
            // gradients exist yet.
            let head = ops.iter().rposition(|o| o.phase == Phase::Forward).unwrap();
            let live: Vec<&str> = grads
                .segments
                .iter()
                .map(|s| plan.buffer(s.buf))
                .filter(|b| b.first_op <= head && head <= b.last_op)
                .map(|b| b.name.as_str())
                .collect();
            assert!(live.iter().all(|n| !n.starts_with('h')), "{live:?}");
        }
    }
}

/// Staging (`--offload all`): between a transfer and the wait naming its host copy, no
/// other op touches the copy (the I/O thread owns its bytes then); every transfer is waited
/// for within its own phase, so evaluation and the gradient/update split of a step never
/// leave one in flight; and every op that reads a disk-tier home does so through a copy.
#[test]
fn staged_transfers_own_their_copies_until_waited() {
    use memwall::ir::schedule::Op;
    use memwall::ir::{Phase, Tier};
    use memwall::plan::{OffloadSet, Plan};
    // Walks the ops the executor runs together (those whose phase `runs` keeps): no op
    // touches a copy while it is in flight or reads a disk-tier buffer directly, every
    // transfer is awaited in its own phase and before the run ends. Returns the transfers.
    fn walk(plan: &Plan, what: &str, runs: &dyn Fn(Phase) -> bool) -> usize {
        let mut in_flight: Vec<(memwall::ir::BufId, Phase)> = Vec::new();
        let mut transfers = 0;
        for (i, e) in plan.schedule.ops.iter().enumerate() {
            if !runs(e.phase) {
                continue;
            }
            let mut touched = Vec::new();
            e.buffers(|id, _| touched.push(id));
            match &e.op {
                Op::Transfer { from, to } => {
                    transfers += 1;
                    let host = if plan.buffer(*from).placement.tier == Tier::Host {
                        *from
                    } else {
                        *to
                    };
                    assert!(
                        !in_flight.iter().any(|x| x.0 == host),
                        "{what}: op {i} {} starts a second transfer of one copy",
                        e.name
                    );
                    in_flight.push((host, e.phase));
                }
                Op::AwaitTransfers { bufs } => {
                    for b in bufs {
                        let k = in_flight.iter().position(|x| x.0 == *b);
                        let k = k.unwrap_or_else(|| panic!("{what}: {} waits for nothing", e.name));
                        assert_eq!(
                            in_flight[k].1, e.phase,
                            "{what}: {} in another phase",
                            e.name
                        );
                        in_flight.remove(k);
                    }
                }
                _ => {
                    for id in &touched {
                        assert!(
                            !in_flight.iter().any(|x| x.0 == *id),
                            "{what}: op {i} {} touches {} while it is being transferred",
                            e.name,
                            plan.buffer(*id).name
                        );
                        assert_eq!(
                            plan.buffer(*id).placement.tier,
                            Tier::Host,
                            "{what}: op {} reads a disk-tier buffer directly",
                            e.name
                        );
                    }
                }
            }
        }
        assert!(
            in_flight.is_empty(),
            "{what}: transfers left in flight at the end"
        );
        transfers
    }
    for (model, accum, recompute, placement) in [
        ("gpt2-tiny", 1, Recompute::Selective, "all"),
        ("llama-tiny", 2, Recompute::Full, "all"),
        ("gpt2", 1, Recompute::Selective, "all"),
        ("gpt2-tiny", 2, Recompute::None, "optimizer,params"),
    ] {
        let spec = ModelSpec::preset(model).unwrap();
        let mut cfg = StepConfig::new(2, 32, 1);
        cfg.grad_accum = accum;
        cfg.recompute = recompute;
        cfg.offload.set = placement.parse().unwrap();
        let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
        let what = format!("{model} --offload {placement}");
        let s = &plan.schedule;
        // Gradients on disk defer each update into the next step's forward.
        assert_eq!(s.deferred_update, cfg.offload.set.grads, "{what}");
        let update = |p| matches!(p, Phase::Optimizer | Phase::DeferredUpdate);
        // The runs of the executor: a step (with its update, or in a deferred plan with the
        // previous step's, or none), the update alone, an evaluation.
        let step = walk(&plan, &what, &|p| s.in_step(p));
        walk(&plan, &what, &|p| !update(p));
        walk(&plan, &what, &|p| p == Phase::Optimizer);
        walk(&plan, &what, &|p| p == Phase::Forward);
        assert!(
            step > 4 * plan.layout.groups.len(),
            "{what}: {step} transfers"
        );
        if s.deferred_update {
            // Each group's deferred update comes before any other op of the step touches
            // its parameters or gradients.
            let mut seen = vec![false; plan.layout.groups.len()];
            for e in s.ops.iter().filter(|e| s.in_step(e.phase)) {
                let group = |r: &std::ops::Range<usize>| {
                    let g = &plan.layout.groups;
                    g.partition_point(|g| plan.layout.group_range(g).end <= r.start)
                };
                let ranges = e.op.param_ranges().into_iter().chain(e.op.grad_ranges());
                for k in ranges.map(|r| group(&r)) {
                    match e.phase {
                        Phase::DeferredUpdate => seen[k] = true,
                        _ => assert!(seen[k], "{what}: {} before its group's update", e.name),
                    }
                }
            }
        }
        // GPT-2 124M: the host arena holds under half of what it holds with everything in
        // RAM (the tiny models' embeddings, staged whole for their update, outweigh the rest).
        cfg.offload.set = OffloadSet::NONE;
        let ram = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
        if model == "gpt2" {
            assert!(2 * plan.arena_bytes() < ram.arena_bytes(), "{model}");
        }
    }
}

/// A budget too small for `--batch 1` with everything already offloaded: the refusal says what
/// the peak is made of and the smallest budget that fits, never that state "kept in RAM
/// alone takes 0 B" nor to offload (already on).
#[test]
fn too_small_a_budget_with_everything_offloaded_names_what_does_not_fit() {
    use memwall::ir::{OptimState, Precision, Recompute};
    use memwall::plan::OffloadSet;
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let mut cfg = StepConfig::new(4, 128, 2);
    cfg.offload.set = OffloadSet::ALL;
    let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
    let e = format!(
        "{:#}",
        check_budget(&plan, 10_000_000, 0, backend()).unwrap_err()
    );
    assert!(
        !e.contains("take 0 B")
            && !e.contains("RAM 0 B")
            && !e.contains("offload all")
            && !e.contains("or offload"),
        "{e}"
    );
    assert!(
        e.contains("even --batch 1 does not fit: it needs")
            && e.contains("at its peak, op ")
            && e.contains(
                "with --precision bf16 --optim-state int8 --recompute full --batch 1 needs"
            )
            && e.contains("the least budget that fits gpt2-tiny at --seq 128"),
        "{e}"
    );
    // Every strategy already taken: that plan's peak is the least budget.
    cfg.precision = Precision::Bf16;
    cfg.optim_state = OptimState::Int8;
    cfg.recompute = Recompute::Full;
    cfg.batch = 1;
    let smallest = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
    let e = format!(
        "{:#}",
        check_budget(&smallest, 10_000_000, 0, backend()).unwrap_err()
    );
    let least = memwall::util::bytes::fmt_bytes(smallest.predicted_peak(0));
    assert!(
        e.contains(&format!(
            "this is already the smallest plan of gpt2-tiny at --seq 128: --max-memory {least} is the least that fits"
        )),
        "{e}"
    );
}

/// A Mistral model with a sliding window shorter than `--seq` plans (no longer refused): its
/// attention ops carry the window, their FLOPs are min(W, i + 1) keys a query (not the
/// T²/2 triangle), their workspace follows the window, and the predicted time of the
/// attention ops drops with them; a window of `--seq` or more plans exactly as none.
#[test]
fn sliding_window_plan_follows_the_window() {
    use memwall::ir::Op;
    use memwall::plan::time::{Calibration, predict};
    let mistral = |window: &str| {
        ModelSpec::from_hf_config_str(
            &format!(
                r#"{{"model_type": "mistral", "hidden_size": 128, "intermediate_size": 256,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 300, "sliding_window": {window}}}"#
            ),
            "config.json",
        )
        .unwrap()
    };
    let (b, t, w) = (1, 1024, 128);
    let plan = |window: &str| {
        build_plan(
            &mistral(window),
            &StepConfig::new(b, t, 2),
            Mode::Train,
            backend(),
        )
        .unwrap()
    };
    let attention = |p: &memwall::plan::Plan| -> (u64, u64, Vec<Option<usize>>) {
        let (mut flops, mut ws, mut windows) = (0, 0, vec![]);
        for e in &p.schedule.ops {
            if let Op::Attention { ws: id, window, .. }
            | Op::AttentionBackward { ws: id, window, .. } = &e.op
            {
                flops += e.flops;
                ws = ws.max(p.buffer(*id).bytes);
                windows.push(*window);
            }
        }
        (flops, ws, windows)
    };
    let (full, windowed) = (plan("null"), plan(&w.to_string()));
    let (f_full, ws_full, win_full) = attention(&full);
    let (f_win, ws_win, win_win) = attention(&windowed);
    assert!(win_full.iter().all(|x| x.is_none()) && !win_full.is_empty());
    assert!(win_win.iter().all(|&x| x == Some(w)) && win_win.len() == win_full.len());
    // Forward + backward (2.5×) per layer, 4·hd a pair and head: the pairs are
    // W(W+1)/2 + (T − W)·W with the window, T²/2 without.
    let (nh, hd, layers) = (4u64, 32u64, 2u64);
    let (tt, ww) = (t as u64, w as u64);
    let per_pair = layers * nh * hd * 4 * 7 / 2;
    assert_eq!(f_win, per_pair * (ww * (ww + 1) / 2 + (tt - ww) * ww));
    assert_eq!(f_full, per_pair * tt * tt / 2);
    assert!(ws_win < ws_full, "workspace {ws_win} vs {ws_full}");
    let cal = Calibration::estimate("test cpu".into(), 2, 100.0);
    let (s_full, s_win) = (predict(&full, &cal), predict(&windowed, &cal));
    assert!(s_win.compute_s < s_full.compute_s);
    // A window as long as the sequence is no window.
    let same = plan(&t.to_string());
    assert_eq!(attention(&same).0, f_full);
    assert_eq!(attention(&same).1, ws_full);
}

/// A distilled step's plan holds the teacher's plan as one owned buffer, and its predicted
/// time adds the teacher's forward over each of the step's rows, at the rate of the
/// student's own forward.
#[test]
fn a_distilled_plan_counts_the_teachers_bytes_and_forward() {
    use memwall::plan::Distill;
    use memwall::plan::time::{Calibration, predict};
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    let cal = Calibration::estimate("test cpu".into(), 2, 100.0);
    let plan = |accum: usize, flops: u64| {
        let mut cfg = StepConfig::new(2, 32, 2);
        cfg.grad_accum = accum;
        cfg.distill = (flops > 0).then_some(Distill {
            teacher_width: spec.n_embd,
            alpha: 0.5,
            teacher_bytes: 10 << 20,
            teacher_flops: flops,
        });
        build_plan(&spec, &cfg, Mode::Train, backend()).unwrap()
    };
    let teacher_s = |accum: usize, flops: u64| {
        let t = predict(&plan(accum, flops), &cal);
        let s = (t.by_kind.iter()).find(|(k, _)| k == "teacher forward");
        (s.map_or(0.0, |x| x.1), t)
    };
    let (plain, pair) = (plan(3, 0), plan(3, 5_000_000_000));
    let by = pair.bytes_by_category();
    let teacher_bytes = by.iter().find(|x| x.0 == Category::Teacher).unwrap().1;
    assert_eq!(teacher_bytes, 10 << 20);
    assert!(pair.total_bytes() >= plain.total_bytes() + (10 << 20));
    let (none, _) = teacher_s(3, 0);
    assert_eq!(none, 0.0);
    // 6 rows (2 × 3 micro-batches) of 5 GFLOP: at most the 100 GFLOP/s peak.
    let (s, t) = teacher_s(3, 5_000_000_000);
    assert!(s >= 6.0 * 5e9 / 100e9, "{s} s");
    assert!(t.step_s >= predict(&plain, &cal).step_s + s);
    // Proportional to the teacher's arithmetic and to the rows.
    let (half, _) = teacher_s(3, 2_500_000_000);
    assert!((s - 2.0 * half).abs() < 1e-9 * s, "{s} vs {half}");
    let (one, _) = teacher_s(1, 5_000_000_000);
    assert!((s - 3.0 * one).abs() < 0.05 * s, "{s} vs {one}");
}
