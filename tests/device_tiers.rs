//! Tiers beneath a GPU, planned without one ([gpu-offload]): `--device cuda --offload X`
//! keeps what X names in pinned host RAM between its uses, and stages each use into device
//! memory by transfers the plan schedules. The transformation is the CPU's disk tier's, one
//! tier up: the same ops in the same order, the same transfers at the same places, so the
//! arithmetic (bitwise the weights of a run that offloads nothing, on the CPU) is unchanged.
//! Where the update's whole state is in pinned RAM (parameters, gradients and moments), the
//! update runs on the host's cores in place instead: every op still reads the values the
//! CPU's plan gives it.

mod common;

use memwall::backend::DeviceKind;
use memwall::ir::schedule::{Op, OpEntry, Phase};
use memwall::ir::{Category, OptimState, Precision, Recompute, Tier};
use memwall::model::ModelSpec;
use memwall::plan::{Budgets, Mode, OffloadSet, Plan, StepConfig, build_plan};

fn cfg(set: OffloadSet, precision: Precision, optim: OptimState, accum: usize) -> StepConfig {
    let mut c = StepConfig::new(2, 64, 2);
    c.offload.set = set;
    c.precision = precision;
    c.optim_state = optim;
    c.grad_accum = accum;
    c.recompute = Recompute::Full;
    c
}

fn plan_on(kind: DeviceKind, spec: &ModelSpec, c: &StepConfig) -> Plan {
    build_plan(spec, c, Mode::Train, kind.sizing())
        .unwrap_or_else(|e| panic!("{} on {kind}: {e:#}", c.offload.set))
}

/// Whether a placement keeps the update's whole state in pinned RAM (so the update runs on
/// the host's cores).
fn update_on_host(set: OffloadSet) -> bool {
    set.params && set.grads && set.optimizer
}

/// The categories a placement keeps beneath the compute tier.
fn homes_of(set: OffloadSet) -> Vec<Category> {
    let mut v = Vec::new();
    if set.params {
        v.extend([Category::Param, Category::Master]);
    }
    if set.grads {
        v.push(Category::Grad);
    }
    if set.optimizer {
        v.push(Category::OptimizerState);
    }
    if set.activations {
        v.push(Category::Activation);
    }
    v
}

/// Every placement, on GPT-2 and Llama shapes, fp32 and bf16, fp32 and int8 moments, with and
/// without accumulation: the GPU's plan has two tiers, device memory and pinned RAM; what
/// the placement names lives in pinned RAM and nothing else does; every op but a transfer
/// computes on device memory, but the updates where the placement keeps their whole state
/// in pinned RAM, which run there (and touch nothing else); every transfer moves one buffer
/// between the two.
#[test]
fn every_placement_keeps_its_homes_in_pinned_ram_and_computes_on_the_device() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let spec = ModelSpec::preset(model).unwrap();
        for (precision, optim, accum) in [
            (Precision::F32, OptimState::F32, 1),
            (Precision::Bf16, OptimState::Int8, 2),
        ] {
            for set in OffloadSet::every() {
                let plan = plan_on(DeviceKind::Cuda, &spec, &cfg(set, precision, optim, accum));
                let what = format!("{model} {precision:?} {optim:?} accum {accum} --offload {set}");
                let tiers: Vec<Tier> = plan.tiers.iter().map(|t| t.tier).collect();
                assert_eq!(tiers, [Tier::Device, Tier::Host], "{what}");
                assert_eq!(plan.tier_bytes(Tier::Host) > 0, set.any(), "{what}");
                let homes = homes_of(set);
                for b in &plan.buffers {
                    match b.placement.tier {
                        Tier::Host => assert!(
                            homes.contains(&b.category),
                            "{what}: {} ({:?}) in pinned RAM",
                            b.name,
                            b.category
                        ),
                        Tier::Device | Tier::Owned => {}
                        Tier::Nvme => panic!("{what}: {} on disk", b.name),
                    }
                }
                for e in &plan.schedule.ops {
                    if let Op::Transfer { from, to } = e.op {
                        let mut ends =
                            [plan.buffer(from), plan.buffer(to)].map(|b| b.placement.tier);
                        ends.sort();
                        assert_eq!(ends, [Tier::Device, Tier::Host], "{what}: {}", e.name);
                        assert_eq!(plan.buffer(from).bytes, plan.buffer(to).bytes);
                        continue;
                    }
                    if matches!(e.op, Op::AwaitTransfers { .. }) {
                        continue;
                    }
                    let on_host = e.runs_on_host(&plan.buffers, Tier::Device);
                    let update = matches!(e.op, Op::AdamW { .. });
                    assert_eq!(on_host, update && update_on_host(set), "{what}: {}", e.name);
                    let tier = if on_host { Tier::Host } else { Tier::Device };
                    e.buffers(|id, _| {
                        let t = plan.buffer(id).placement.tier;
                        assert!(
                            t == tier || t == Tier::Owned,
                            "{what}: op {} touches {} on {t:?}",
                            e.name,
                            plan.buffer(id).name
                        );
                    });
                }
            }
        }
    }
}

/// The GPU's staging is the CPU's disk tier's, one tier up: the same ops, transfers and
/// waits in the same order, each transfer moving the same buffer (by name) in the same
/// direction, for every placement whose update stays on the device.
#[test]
fn the_gpu_stages_as_the_cpu_does_one_tier_up() {
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    for set in OffloadSet::every()
        .into_iter()
        .filter(|&s| !update_on_host(s))
    {
        let c = cfg(set, Precision::Bf16, OptimState::F32, 2);
        let (cpu, gpu) = (
            plan_on(DeviceKind::Cpu, &spec, &c),
            plan_on(DeviceKind::Cuda, &spec, &c),
        );
        let moves = |p: &Plan| -> Vec<String> {
            p.schedule
                .ops
                .iter()
                .map(|e| match e.op {
                    Op::Transfer { from, to } => {
                        let (f, t) = (p.buffer(from), p.buffer(to));
                        let up = t.placement.tier == p.compute_tier();
                        format!("{} {} {}", e.name, if up { "in" } else { "out" }, f.name)
                    }
                    _ => e.name.clone(),
                })
                .collect()
        };
        assert_eq!(moves(&cpu), moves(&gpu), "--offload {set}");
        assert_eq!(cpu.tier_bytes(Tier::Nvme) > 0, set.any(), "--offload {set}");
    }
}

/// A value's writer: the op and the step (`None`: the value the run started with).
type Writer = Option<(String, usize)>;

/// What each op of one step reads, as the value's writer: for every read of a buffer by an
/// op (a staging copy read as its home), the op that last wrote it, and in which of two
/// steps run in a row (`None`: the value the run started with). Transfers copy the value
/// where they start (nothing touches either end until their await, and they run in order).
/// `logical`: as the plan means it, each staging copy being its home and transfers moving
/// nothing; staging is right when every op reads the same either way.
fn reads(p: &Plan, logical: bool) -> Vec<(String, String, Writer)> {
    let mut home: Vec<usize> = (0..p.buffers.len()).collect();
    for e in &p.schedule.ops {
        if let Op::Transfer { from, to } = e.op {
            let (stage, h) = match p.buffer(from).placement.tier == p.compute_tier() {
                true => (from, to),
                false => (to, from),
            };
            home[stage.0] = h.0;
        }
    }
    let mut value: Vec<Writer> = vec![None; p.buffers.len()];
    let at = |id: memwall::ir::BufId| if logical { home[id.0] } else { id.0 };
    let mut out = Vec::new();
    let in_step = |e: &&OpEntry| p.schedule.in_step(e.phase);
    for step in 0..2 {
        for e in p.schedule.ops.iter().filter(in_step) {
            match e.op {
                Op::Transfer { .. } | Op::AwaitTransfers { .. } if logical => {}
                Op::Transfer { from, to } => value[to.0] = value[from.0].clone(),
                Op::AwaitTransfers { .. } => {}
                _ => {
                    let mut written = Vec::new();
                    e.buffers(|id, access| {
                        if access.reads() && step == 1 {
                            let what = p.buffers[home[id.0]].name.clone();
                            out.push((e.name.clone(), what, value[at(id)].clone()));
                        }
                        if access.writes() {
                            written.push(id);
                        }
                    });
                    for id in written {
                        value[at(id)] = Some((e.name.clone(), step));
                    }
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Every placement, fp32 and bf16, with and without accumulation, on GPT-2 and Llama shapes:
/// each op of a GPU's step reads the value the CPU's plan (its disk tier, bitwise the plan
/// that offloads nothing) gives it, written by the same op in the same step, whether the
/// update runs on the device or on the host (there a group early: each forward still reads
/// the weights its update just wrote, never the step before's).
#[test]
fn every_op_reads_what_the_cpu_plan_gives_it() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let spec = ModelSpec::preset(model).unwrap();
        for (precision, accum) in [(Precision::F32, 1), (Precision::Bf16, 2)] {
            for set in OffloadSet::every() {
                let c = cfg(set, precision, OptimState::F32, accum);
                let (cpu, gpu) = (
                    plan_on(DeviceKind::Cpu, &spec, &c),
                    plan_on(DeviceKind::Cuda, &spec, &c),
                );
                let what = format!("{model} {precision:?} accum {accum} --offload {set}");
                same_reads(&reads(&cpu, false), &reads(&gpu, false), &what);
                same_reads(&reads(&gpu, true), &reads(&gpu, false), &what);
            }
        }
    }
}

/// Fails naming the first read that differs between `want` and `got`.
fn same_reads(want: &[(String, String, Writer)], got: &[(String, String, Writer)], what: &str) {
    if let Some(k) = (0..want.len().min(got.len())).find(|&k| want[k] != got[k]) {
        panic!("{what}: {:?} where {:?} was meant", got[k], want[k]);
    }
    assert_eq!(want.len(), got.len(), "{what}");
}

/// `--update in-backward` beneath a GPU, with the update's state in pinned RAM: each group's
/// update runs on the host inside the backward (a group late, so the GPU has the next
/// group's backward to run meanwhile), and every op, updates included, reads what the plan
/// means it to (each staging copy its home, transfers moving nothing): the gradients of this
/// step's backward, the weights of the last step's update.
#[test]
fn updates_inside_the_backward_run_on_the_host_and_read_what_they_should() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let spec = ModelSpec::preset(model).unwrap();
        for precision in [Precision::F32, Precision::Bf16] {
            let mut set = OffloadSet::ALL;
            for activations in [true, false] {
                set.activations = activations;
                let mut c = cfg(set, precision, OptimState::F32, 1);
                c.update = memwall::ir::Update::InBackward;
                let p = plan_on(DeviceKind::Cuda, &spec, &c);
                let what = format!("{model} {precision:?} --offload {set} --update in-backward");
                let ops = &p.schedule.ops;
                let updates: Vec<usize> = (0..ops.len())
                    .filter(|&i| matches!(ops[i].op, Op::AdamW { .. }))
                    .collect();
                assert!(
                    updates
                        .iter()
                        .all(|&i| ops[i].runs_on_host(&p.buffers, Tier::Device))
                );
                // Inside the backward: all but the last two (each goes a group late) come
                // before its last op.
                let computes = |e: &OpEntry| {
                    e.phase == Phase::Backward
                        && !matches!(e.op, Op::Transfer { .. } | Op::AwaitTransfers { .. })
                };
                let last_backward = ops.iter().rposition(computes).unwrap();
                let after = updates.iter().filter(|&&i| i > last_backward).count();
                assert_eq!(after, 2, "{what}");
                same_reads(&reads(&p, true), &reads(&p, false), &what);
            }
        }
    }
}

/// With parameters, gradients and moments in pinned RAM the update runs on the host, in
/// place: no moment crosses the bus, and the bus carries less than the CPU's disk tier does
/// for the same placement (which stages the update's state in and out). The time model
/// puts those updates on the host's clock at its own rate (`host_adamw`), beside the GPU's.
#[test]
fn updates_in_pinned_ram_run_on_the_host_and_on_its_clock() {
    use memwall::plan::time::{Bound, Calibration, Cost, op_kind, predict};
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let c = cfg(OffloadSet::ALL, Precision::Bf16, OptimState::F32, 1);
    let (cpu, gpu) = (
        plan_on(DeviceKind::Cpu, &spec, &c),
        plan_on(DeviceKind::Cuda, &spec, &c),
    );
    let on_host: Vec<&OpEntry> = (gpu.schedule.ops.iter())
        .filter(|e| e.runs_on_host(&gpu.buffers, Tier::Device))
        .collect();
    let updates = gpu
        .schedule
        .ops
        .iter()
        .filter(|e| matches!(e.op, Op::AdamW { .. }));
    assert_eq!(on_host.len(), updates.count());
    for e in &gpu.schedule.ops {
        if let Op::Transfer { from, to } = e.op {
            for b in [from, to] {
                assert_ne!(
                    gpu.buffer(b).category,
                    Category::OptimizerState,
                    "{}",
                    e.name
                );
            }
        }
    }
    let (gpu_in, gpu_out) = gpu.io_bytes_per_step();
    let (cpu_in, cpu_out) = cpu.io_bytes_per_step();
    assert!(gpu_in < cpu_in && gpu_out < cpu_out);
    // The host's AdamW, made slow: the step waits for it.
    let mut cal = Calibration::estimate("an H200".into(), 1, 1000.0);
    cal.gpu = true;
    let kind = op_kind(&gpu, on_host[0]).unwrap();
    assert!(kind.starts_with("host_adamw."), "{kind}");
    let slow = Cost {
        s_per_flop: 0.0,
        s_per_byte: 1e-6,
        s_per_op: 0.0,
        samples: 1,
        fit_error_pct: 0.0,
    };
    cal.kinds.insert(kind, slow);
    let t = predict(&gpu, &cal);
    let host: f64 = on_host
        .iter()
        .filter(|e| gpu.schedule.in_step(e.phase))
        .map(|e| slow.seconds(e.flops, memwall::plan::time::op_bytes(&gpu, e)))
        .sum();
    assert!((t.host_s - host).abs() <= 1e-9 * host && host > 0.0);
    assert_eq!(t.bound, Bound::Host);
    assert!(t.step_s >= t.host_s && t.compute_s + t.io_s < t.host_s);
}

/// On a 124M model the device holds less for each thing offloaded: the optimizer's moments
/// leave it whole (beside one group's staging copy), and what stays is under the plan that
/// offloads nothing.
#[test]
fn offloading_moves_bytes_from_the_device_to_pinned_ram() {
    let spec = ModelSpec::preset("gpt2").unwrap();
    let c = |set| {
        let mut c = cfg(set, Precision::Bf16, OptimState::F32, 1);
        c.batch = 4;
        c.seq = 1024;
        c
    };
    let none = plan_on(DeviceKind::Cuda, &spec, &c(OffloadSet::NONE));
    let moments = 2 * 4 * spec.num_params() as u64;
    let mut optimizer = OffloadSet::NONE;
    optimizer.optimizer = true;
    let off = plan_on(DeviceKind::Cuda, &spec, &c(optimizer));
    // Each home is aligned for direct I/O (4 KiB), as the disk tier's are.
    let host = off.tier_bytes(Tier::Host);
    let homes = off
        .buffers
        .iter()
        .filter(|b| b.placement.tier == Tier::Host);
    assert!(
        moments <= host && host < moments + 4096 * homes.count() as u64,
        "{host} bytes in pinned RAM for {moments} of moments"
    );
    // The state is counted once, wherever it lives (not again in its staging copies).
    let state = |p: &Plan| memwall::plan::zero::per_rank(p).model_state.optimizer;
    assert_eq!(state(&off), state(&none));
    let (d0, d1) = (none.arena_bytes(), off.arena_bytes());
    // The largest group's moments (the token embedding's, 8 bytes a parameter) are staged
    // whole; a block's beside them.
    let wte = 8 * (spec.vocab_size * spec.n_embd) as u64;
    assert!(
        d1 + moments <= d0 + wte + moments / 8,
        "device {d1} with the moments in pinned RAM, {d0} without"
    );
    // State offloaded (with or without the activations) lowers the device's peak. The kept
    // activations alone do not here: under full recomputation they are the block inputs
    // (25 MiB), and the peak is the backward's working set, which they are not part of.
    let state = |s: &OffloadSet| s.params || s.grads || s.optimizer;
    for set in OffloadSet::every().into_iter().filter(state) {
        let p = plan_on(DeviceKind::Cuda, &spec, &c(set));
        assert!(
            p.arena_bytes() < d0,
            "--offload {set}: device {} of {d0}",
            p.arena_bytes()
        );
    }
}

/// `--max-host-memory` is the pinned tier's budget: a plan over it is named with the flag;
/// where host RAM is the compute tier (the CPU) it adds nothing.
#[test]
fn the_pinned_tier_has_its_own_budget() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let plan = plan_on(
        DeviceKind::Cuda,
        &spec,
        &cfg(OffloadSet::ALL, Precision::F32, OptimState::F32, 1),
    );
    let host = plan.tier_peak(Tier::Host, 0);
    assert_eq!(host, plan.tier_bytes(Tier::Host) + plan.external_bytes);
    let fits = Budgets::new(Tier::Device, None, None).with_host(Tier::Device, Some(host));
    assert_eq!(plan.over_budget(0, &fits), None);
    let small = Budgets::new(Tier::Device, None, None).with_host(Tier::Device, Some(host - 1));
    let over = plan.over_budget(0, &small).unwrap();
    assert_eq!((over.name.as_str(), over.over_by()), ("host RAM", 1));
    assert_eq!(
        Budgets::source(Tier::Host, Tier::Device),
        "--max-host-memory"
    );
    assert_eq!(Budgets::source(Tier::Host, Tier::Host), "--max-memory");
    assert_eq!(
        Budgets::new(Tier::Host, None, None).with_host(Tier::Host, Some(1)),
        Budgets::NONE
    );
}

/// The time model prices a GPU's transfers at its bus's rates (measured, or 25 GB/s each
/// way), a CPU's at its disk's: the I/O clock's busy seconds are the step's bytes each way
/// over them.
#[test]
fn transfers_to_pinned_ram_are_priced_at_the_bus_rates() {
    use memwall::plan::time::{Bandwidth, Calibration, NOMINAL_BUS, NOMINAL_DISK, predict};
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    // Everything but the moments: the update stays on the device, as on the CPU.
    let mut set = OffloadSet::ALL;
    set.optimizer = false;
    let c = cfg(set, Precision::F32, OptimState::F32, 1);
    let busy = |p: &Plan, rates: Bandwidth| {
        let (read, written) = p.io_bytes_per_step();
        assert!(read > 0 && written > 0);
        read as f64 / rates.read_bytes_per_s + written as f64 / rates.write_bytes_per_s
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.max(1e-12);
    let gpu = plan_on(DeviceKind::Cuda, &spec, &c);
    let mut cal = Calibration::estimate("an H200".into(), 1, 1000.0);
    cal.gpu = true;
    let t = predict(&gpu, &cal);
    assert!(close(t.io_s, busy(&gpu, NOMINAL_BUS)), "{} s", t.io_s);
    let measured = Bandwidth {
        read_bytes_per_s: 50e9,
        write_bytes_per_s: 40e9,
    };
    cal.bus = Some(measured);
    // A disk measured too changes nothing beneath a GPU.
    cal.disk = Some(Bandwidth {
        read_bytes_per_s: 1e6,
        write_bytes_per_s: 1e6,
    });
    let t = predict(&gpu, &cal);
    assert!(close(t.io_s, busy(&gpu, measured)), "{} s", t.io_s);
    let cpu = plan_on(DeviceKind::Cpu, &spec, &c);
    let mut cal = Calibration::estimate("a CPU".into(), 1, 100.0);
    cal.bus = Some(measured);
    assert!(close(predict(&cpu, &cal).io_s, busy(&cpu, NOMINAL_DISK)));
    assert_eq!(gpu.io_bytes_per_step(), cpu.io_bytes_per_step());
}

/// `--fit` beneath a GPU: under a device budget and a pinned-RAM budget, the search finds the
/// fastest of every candidate (micro-batch, recomputation, placement) built one by one that
/// fits both, and every plan it keeps fits both.
#[test]
fn the_search_picks_the_fastest_placement_within_both_budgets() {
    use memwall::plan::search::{self, Space};
    use memwall::plan::time::{Bandwidth, Calibration, predict};
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let gpu = DeviceKind::Cuda.sizing();
    let mut cal = Calibration::estimate("an H200".into(), 1, 2000.0);
    cal.gpu = true;
    // A slow bus, so offloading costs time and the search weighs it.
    cal.bus = Some(Bandwidth {
        read_bytes_per_s: 2e8,
        write_bytes_per_s: 2e8,
    });
    let space = |host_budget| Space {
        host_budget,
        ..common::one_process_space(2, 64)
    };
    let plan = |b: usize, r: Recompute, o: OffloadSet| {
        let mut c = StepConfig::new(b, 64, 2);
        c.grad_accum = 2 / b;
        c.recompute = r;
        c.offload.set = o;
        build_plan(&spec, &c, Mode::Train, gpu).unwrap()
    };
    let free = plan(2, Recompute::None, OffloadSet::NONE);
    let small = plan(1, Recompute::Full, OffloadSet::ALL);
    let (hi, lo) = (free.predicted_peak(0), small.predicted_peak(0));
    let all_host = small.tier_peak(Tier::Host, 0);
    // Only the moments in pinned RAM: a budget pair this placement fits exactly.
    let mut optimizer = OffloadSet::NONE;
    optimizer.optimizer = true;
    let moments = plan(1, Recompute::Full, optimizer);
    let mut policies = vec![Recompute::None, Recompute::Selective];
    policies.extend((2..=spec.n_layer).map(Recompute::Every));
    policies.push(Recompute::Full);
    let mut found_some = 0;
    for (budget, host) in [
        ((hi + lo) / 2, None),
        ((hi + lo) / 2, Some(all_host / 2)),
        (
            moments.predicted_peak(0),
            Some(moments.tier_peak(Tier::Host, 0)),
        ),
        (lo + (hi - lo) / 8, Some(all_host)),
    ] {
        let found = search::search(&spec, &space(host), budget, 0, &cal, gpu).unwrap();
        let mut want = (f64::INFINITY, String::new());
        for b in [1, 2] {
            for &r in &policies {
                for o in OffloadSet::every() {
                    let p = plan(b, r, o);
                    let fits = p.predicted_peak(0) <= budget
                        && host.is_none_or(|h| p.tier_peak(Tier::Host, 0) <= h);
                    let t = predict(&p, &cal).step_s;
                    if fits && t < want.0 {
                        want = (t, format!("--batch {b} --recompute {r} --offload {o}"));
                    }
                }
            }
        }
        let what = format!("device {budget}, pinned {host:?}");
        if want.0.is_infinite() {
            assert!(found.ranked.is_empty(), "{what}: no candidate fits");
            continue;
        }
        found_some += 1;
        let best = found
            .ranked
            .first()
            .unwrap_or_else(|| panic!("{what}: none found"));
        assert!(
            (best.time.step_s - want.0).abs() <= 1e-9 * want.0,
            "{what}: the search's {} ({}) against every candidate's {} ({})",
            best.time.step_s,
            best.flags(),
            want.0,
            want.1
        );
        for k in &found.ranked {
            let p = build_plan(&spec, &k.cfg, Mode::Train, gpu).unwrap();
            assert!(p.predicted_peak(0) <= budget, "{what}: {}", k.flags());
            assert!(
                host.is_none_or(|h| p.tier_peak(Tier::Host, 0) <= h),
                "{what}: {} keeps {} in pinned RAM",
                k.flags(),
                p.tier_peak(Tier::Host, 0)
            );
        }
    }
    assert!(
        found_some >= 3,
        "the budgets leave too few searches to check"
    );
    // Too little host RAM for what the device budget needs offloaded: nothing fits, and the
    // refusal names --max-host-memory.
    let budget = lo + (hi - lo) / 8;
    let found = search::search(&spec, &space(Some(1 << 10)), budget, 0, &cal, gpu).unwrap();
    assert!(found.ranked.is_empty());
    assert_eq!(found.host, Some(1 << 10));
    let e = search::nothing_fits(&found, budget).to_string();
    assert!(e.contains("--max-host-memory 1.00 KiB"), "{e}");
}

/// The time model's host clock: each update on the host runs while the GPU works through
/// what was queued before it. With the host's AdamW as long as the GPU's arithmetic, a
/// deferred update hides some of it behind the next forward, and one inside the backward
/// hides more, behind the backward (layers dominate this model): the step is longer than
/// either, shorter than both one after the other.
#[test]
fn the_host_update_overlaps_the_gpus_work() {
    use memwall::plan::time::{Calibration, Cost, op_kind, predict};
    let spec = ModelSpec::preset("smollm2-135m").unwrap();
    let mut hidden = Vec::new();
    for update in [memwall::ir::Update::End, memwall::ir::Update::InBackward] {
        let mut c = cfg(OffloadSet::ALL, Precision::Bf16, OptimState::F32, 1);
        c.update = update;
        let p = plan_on(DeviceKind::Cuda, &spec, &c);
        let mut cal = Calibration::estimate("an H200".into(), 1, 1000.0);
        cal.gpu = true;
        let base = predict(&p, &cal);
        let host = p
            .schedule
            .ops
            .iter()
            .find(|e| e.runs_on_host(&p.buffers, Tier::Device));
        let kind = op_kind(&p, host.unwrap()).unwrap();
        // The host's AdamW made as long as the GPU's arithmetic.
        let scale = base.compute_s / base.host_s;
        let as_long = Cost {
            s_per_flop: 0.0,
            s_per_byte: scale / 20e9,
            s_per_op: scale * 10e-6,
            samples: 1,
            fit_error_pct: 0.0,
        };
        cal.kinds.insert(kind, as_long);
        let t = predict(&p, &cal);
        let what = format!("{update:?}: {t:?}");
        assert!(
            (t.host_s - t.compute_s).abs() < 1e-9 * t.compute_s,
            "{what}"
        );
        assert!(t.step_s >= t.host_s.max(t.compute_s), "{what}");
        assert!(t.step_s < t.host_s + t.compute_s, "{what}");
        hidden.push((t.host_s + t.compute_s - t.step_s) / t.compute_s);
    }
    assert!(hidden[1] > 0.5 && hidden[1] > 2.0 * hidden[0], "{hidden:?}");
}

/// Over its device budget, a GPU plan is told what fits: the update's state offloaded, whose
/// moments then leave device memory in any format (so no 8-bit advice).
#[test]
fn over_its_budget_a_gpu_plan_is_told_to_offload_the_update() {
    use memwall::plan::fit::{check_budget, predicted_peak};
    let spec = ModelSpec::preset("gpt2").unwrap();
    let mut optimizer = OffloadSet::NONE;
    optimizer.optimizer = true;
    let c = |set| {
        let mut c = cfg(set, Precision::Bf16, OptimState::F32, 1);
        c.batch = 1;
        c.seq = 256;
        c
    };
    let gpu = DeviceKind::Cuda.sizing();
    let plan = plan_on(DeviceKind::Cuda, &spec, &c(optimizer));
    let all = plan_on(DeviceKind::Cuda, &spec, &c(OffloadSet::ALL));
    let budget = predicted_peak(&all, 0);
    assert!(budget < predicted_peak(&plan, 0));
    let e = format!("{:#}", check_budget(&plan, budget, 0, gpu).unwrap_err());
    assert!(
        e.contains("with --offload all --batch 1 needs") && e.contains("and fits"),
        "{e}"
    );
    assert!(!e.contains("int8"), "{e}");
}
