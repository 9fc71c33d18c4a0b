//! Plans of one rank among several (`--ranks N --zero K`): what each rank keeps against the
//! ZeRO paper's formulas at N = 64 and 1024, what it sends per step, that the ranks' updates
//! cover every parameter once, and the refusals.

mod common;

use memwall::backend::under_test as backend;
use memwall::ir::schedule::Op;
use memwall::ir::shard::Zero;
use memwall::ir::strategy::QBLOCK;
use memwall::ir::{Category, OptimState};
use memwall::model::ModelSpec;
use memwall::plan::zero::per_rank;
use memwall::plan::{Mode, OffloadSet, Plan, StepConfig, build_plan};

fn plan(
    model: &str,
    batch: usize,
    seq: usize,
    ranks: usize,
    zero: u8,
    f: impl Fn(&mut StepConfig),
) -> Plan {
    let spec = ModelSpec::preset(model).unwrap();
    let mut cfg = StepConfig::new(batch, seq, 1);
    cfg.mesh = memwall::ir::Mesh::data_parallel(ranks, 0);
    cfg.zero = Zero(zero);
    f(&mut cfg);
    build_plan(&spec, &cfg, Mode::Train, backend()).unwrap()
}

/// `a` is within `tol` (relative) of `b`.
fn close(a: u64, b: u64, tol: f64) -> bool {
    (a as f64 - b as f64).abs() <= tol * b as f64
}

#[test]
fn model_state_and_traffic_follow_the_zero_paper_at_64_and_1024_ranks() {
    for ranks in [64, 1024] {
        let dp = per_rank(&plan("gpt2-xl", 1, 64, ranks, 0, |_| {}));
        let psi = 1_557_611_200u64;
        // Plain data parallelism (fp32): 4 bytes of parameters, 4 of gradients, 8 of moments.
        assert_eq!(dp.zero_paper.total(), 16 * psi);
        // Padded to N·S per group: at most 16 elements per rank per group beyond.
        let pad = |x: u64| x + (ranks as u64 * 16 * 4 * 51);
        assert!(dp.model_state.params >= 4 * psi && dp.model_state.params <= pad(4 * psi));
        assert!(dp.model_state.grads >= 4 * psi && dp.model_state.grads <= pad(4 * psi));
        // Data parallelism all-reduces every gradient: 2(N-1)/N of them.
        let ar = 2.0 * (ranks - 1) as f64 / ranks as f64 * 4.0 * psi as f64;
        assert!(
            close(dp.comm_bytes_per_step, ar as u64, 2e-3),
            "{ranks}: {}",
            dp.comm_bytes_per_step
        );
        for zero in 1..=3u8 {
            let r = per_rank(&plan("gpt2-xl", 1, 64, ranks, zero, |_| {}));
            let (m, z) = (&r.model_state, &r.zero_paper);
            // Sharded state: 1/N of it, within the padding of the shards.
            assert!(
                close(m.optimizer, z.optimizer, 0.01),
                "{ranks}/{zero}: {m:?} {z:?}"
            );
            assert!(
                close(m.params, z.params, 0.01),
                "{ranks}/{zero}: {m:?} {z:?}"
            );
            // Gradients: never more than the formula's plus the whole gradients in flight:
            // the tied embedding's (live through the backward) and two blocks' (one being
            // reduce-scattered beside the backward of the other).
            let (wte, block) = (50257u64 * 1600 * 4, (12 * 1600 * 1600 + 13 * 1600) * 4);
            let in_flight = (wte + 2 * block) as f64 * 1.01;
            assert!(
                m.grads <= pad(z.grads) + in_flight as u64,
                "{ranks}/{zero}: {m:?} {z:?}"
            );
            // Stages 1 and 2 send what data parallelism sends (reduce-scatter + all-gather
            // in fp32); stage 3 gathers the parameters twice (forward, backward): 1.5x.
            let want = if zero == 3 { 1.5 } else { 1.0 };
            assert!(
                close(
                    r.comm_bytes_per_step,
                    (want * dp.comm_bytes_per_step as f64) as u64,
                    2e-3
                ),
                "{ranks}/{zero}: {} vs {}",
                r.comm_bytes_per_step,
                dp.comm_bytes_per_step
            );
        }
    }
}

#[test]
fn every_parameter_is_updated_by_exactly_one_rank() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let layout = memwall::model::ParamLayout::new(&spec);
    let (_, blocks) = layout.block_offsets(QBLOCK);
    for format in [OptimState::F32, OptimState::Int8] {
        for zero in [1u8, 2, 3] {
            for ranks in [3, 7] {
                let mut count = vec![0u8; layout.total];
                let mut block_count = vec![0u8; blocks];
                for rank in 0..ranks {
                    let p = plan("gpt2-tiny", 2, 32, ranks, zero, |c| {
                        c.mesh.rank = rank;
                        c.optim_state = format;
                    });
                    for e in &p.schedule.ops {
                        let Op::AdamW { tensors, state, .. } = &e.op else {
                            continue;
                        };
                        for t in tensors {
                            t.range.clone().for_each(|i| count[i] += 1);
                        }
                        // 8-bit state: the rank's moments are whole blocks, one scale each.
                        if let Some(scale) = state.m_scale {
                            let n = p.buffer(scale).elems;
                            let mine = state.block_base..state.block_base + n;
                            mine.for_each(|b| block_count[b] += 1);
                            for t in tensors {
                                let tensor = layout
                                    .tensors
                                    .iter()
                                    .find(|x| x.range.contains(&t.range.start))
                                    .unwrap();
                                assert_eq!(
                                    (t.range.start - tensor.range.start) % QBLOCK,
                                    0,
                                    "a block cut"
                                );
                            }
                        }
                    }
                }
                assert!(
                    count.iter().all(|&c| c == 1),
                    "zero {zero} {format} {ranks}"
                );
                if format == OptimState::Int8 {
                    assert!(
                        block_count.iter().all(|&c| c == 1),
                        "zero {zero} {ranks}: {block_count:?}"
                    );
                }
            }
        }
    }
}

/// 8-bit moments on tensor ranks × data ranks (ZeRO 1 and 3, 3 data ranks: uneven cuts):
/// each tensor rank's data ranks update each element of its part once, as even as the
/// blocks' edges let them, and hold each block of the model's numbering once (so tensor
/// rank 0 holds every scale a checkpoint writes); each group holding cut tensors agrees on
/// its scales (`AdamWBlockMax`, then a maximum over the tensor and the data ranks) before
/// its update, which encodes at them.
#[test]
fn tensor_ranks_shard_int8_moments_evenly_and_agree_on_their_blocks() {
    let (tensor, data) = (2, 3);
    for model in ["gpt2-tiny", "llama-tiny"] {
        for zero in [1u8, 3] {
            for t in 0..tensor {
                let (mut count, mut block_count, mut held) = (Vec::new(), Vec::new(), Vec::new());
                for d in 0..data {
                    let p = plan(model, 2, 32, tensor * data, zero, |c| {
                        c.mesh = memwall::ir::Mesh::new(tensor * data, tensor, 1, t + tensor * d);
                        c.optim_state = OptimState::Int8;
                    });
                    let (_, blocks) = p.layout.block_offsets(QBLOCK);
                    count.resize(p.layout.total, 0u8);
                    block_count.resize(blocks, 0u8);
                    let mut agreed = Vec::new();
                    for (i, e) in p.schedule.ops.iter().enumerate() {
                        match &e.op {
                            Op::AdamW {
                                tensors,
                                state,
                                scales,
                            } => {
                                tensors
                                    .iter()
                                    .for_each(|x| x.range.clone().for_each(|i| count[i] += 1));
                                let n = p.buffer(state.m_scale.unwrap()).elems;
                                (state.block_base..state.block_base + n)
                                    .for_each(|b| block_count[b] += 1);
                                held.push(tensors.iter().map(|x| x.range.len()).sum::<usize>());
                                if let Some(s) = scales {
                                    agreed.push((i, s.buf));
                                }
                            }
                            Op::AdamWBlockMax { out, .. } => agreed.push((i, out.buf)),
                            _ => {}
                        }
                    }
                    // Every group with a cut tensor: its maxima, two reductions, its update.
                    let groups = p.layout.groups.iter().filter(|g| {
                        p.layout.tensors[g.tensors.clone()]
                            .iter()
                            .any(|t| t.part.is_some())
                    });
                    assert_eq!(agreed.len(), 2 * groups.count(), "{model} zero {zero}");
                    for pair in agreed.chunks(2) {
                        let ((i, buf), (j, _)) = (pair[0], pair[1]);
                        let between = &p.schedule.ops[i + 1..j];
                        let axes: Vec<_> = between
                            .iter()
                            .filter_map(|e| match &e.op {
                                Op::AllReduce {
                                    buf: b,
                                    axis,
                                    reduce,
                                    ..
                                } if *b == buf => {
                                    assert_eq!(*reduce, memwall::ir::Reduce::Max);
                                    Some(*axis)
                                }
                                _ => None,
                            })
                            .collect();
                        use memwall::ir::Axis;
                        assert_eq!(axes, [Axis::Tensor, Axis::Data], "{model} zero {zero}");
                    }
                }
                let what = format!("{model} zero {zero} tensor rank {t}");
                assert!(
                    count.iter().all(|&c| c == 1),
                    "{what}: elements updated once"
                );
                assert!(
                    block_count.iter().all(|&c| c == 1),
                    "{what}: blocks held once"
                );
                // The data ranks' shares: within a block per group of a third.
                let total: usize = held.iter().sum::<usize>();
                let groups = held.len() / data;
                for d in 0..data {
                    let mine: usize = held[d * groups..(d + 1) * groups].iter().sum();
                    assert!(
                        mine.abs_diff(total / data) <= groups * QBLOCK,
                        "{what}: data rank {d} updates {mine} of {total}"
                    );
                }
            }
        }
    }
}

#[test]
fn int8_moments_follow_the_zero_paper_at_64_and_1024_ranks() {
    for ranks in [64, 1024] {
        for zero in 1..=3u8 {
            let r = per_rank(&plan("gpt2-xl", 1, 64, ranks, zero, |c| {
                c.optim_state = OptimState::Int8
            }));
            let (m, z) = (&r.model_state, &r.zero_paper);
            // Rank 0's shards end at the first block edge past 1/N of each group: at most a
            // block (2 KiB of codes and 8 bytes of scales) more per group than 1/N.
            let groups = 50u64;
            assert!(m.optimizer >= z.optimizer, "{ranks}/{zero}: {m:?} {z:?}");
            assert!(
                m.optimizer <= z.optimizer + groups * (QBLOCK as u64 * 2 + 8),
                "{ranks}/{zero}: {m:?} {z:?}"
            );
        }
    }
}

#[test]
fn each_stage_keeps_less_and_plain_plans_have_no_collectives() {
    let peak = |zero: u8| plan("gpt2", 1, 128, 4, zero, |c| c.grad_accum = 2).total_bytes();
    let (p0, p1, p2, p3) = (peak(0), peak(1), peak(2), peak(3));
    assert!(p0 > p1 && p1 > p2 && p2 > p3, "{p0} {p1} {p2} {p3}");
    let single = plan("gpt2", 1, 128, 1, 0, |_| {});
    assert_eq!(single.comm_bytes_per_step(), 0);
    assert!(
        single
            .buffers
            .iter()
            .all(|b| b.category != Category::Communication)
    );
}

/// A rank of a plan of several ranks offloads its own state: the disk tier holds what
/// `--offload all` names of it (its shard of the moments under ZeRO), so its RAM is less than
/// the same rank's in RAM, and its file one process's (ZeRO 0) or less.
#[test]
fn sharded_plans_offload_the_ranks_own_state() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let plan_of = |ranks: usize, zero: u8, offload: OffloadSet| {
        let mut cfg = StepConfig::new(1, 32, 1);
        cfg.mesh = memwall::ir::Mesh::data_parallel(ranks, 0);
        cfg.zero = Zero(zero);
        cfg.offload.set = offload;
        cfg.offload.dir = Some(dir.path().to_path_buf());
        build_plan(&spec, &cfg, Mode::Train, backend()).unwrap()
    };
    for zero in [0, 1, 2, 3] {
        let (ram, off) = (
            plan_of(2, zero, OffloadSet::NONE),
            plan_of(2, zero, OffloadSet::ALL),
        );
        assert!(off.total_bytes() < ram.total_bytes(), "zero {zero}");
        let one = plan_of(1, 0, OffloadSet::ALL).nvme_bytes();
        assert!(off.nvme_bytes() > 0, "zero {zero}");
        match zero {
            // Every rank holds the whole state: one process's file.
            0 => assert!(off.nvme_bytes().abs_diff(one) <= one / 10, "zero {zero}"),
            _ => assert!(
                off.nvme_bytes() < one,
                "zero {zero}: {} vs {one}",
                off.nvme_bytes()
            ),
        }
    }
}

#[test]
fn the_cli_plans_one_rank_and_refuses_zero_outside_mpirun() {
    let plan = [
        "plan",
        "--model",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "64",
    ];
    let json = common::ok(&[&plan[..], &["--ranks", "4", "--zero", "2", "--json"]].concat());
    let j: serde_json::Value = serde_json::from_str(&json).unwrap();
    let r = &j["per_rank"];
    assert_eq!(
        (r["ranks"].as_u64(), r["zero"].as_u64()),
        (Some(4), Some(2))
    );
    let sent = j["comm_bytes_per_step"].as_u64().unwrap();
    assert!(sent > 0 && r["comm_bytes_per_step"].as_u64() == Some(sent));
    let text = common::ok(&[&plan[..], &["--ranks", "4", "--zero", "3"]].concat());
    for want in [
        "one rank of 4 (--zero 3",
        "sent per step by each rank",
        "ZeRO paper's formula",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }
    let e = common::fails(&[&plan[..], &["--ranks", "0"]].concat());
    assert!(e.contains("--ranks"), "{e}");
    // Outside mpirun: --zero says how to run it; bench measures one process.
    let train = ["train", "--model", "gpt2-tiny", "--data", "d", "--out", "o"];
    let e = common::fails(&[&train[..], &["--zero", "1"]].concat());
    assert!(e.contains("mpirun -np N"), "{e}");
    let e = common::fails(&["bench", "--model", "gpt2-tiny", "--zero", "1"]);
    assert!(e.contains("bench measures one process"), "{e}");
}

#[test]
fn collectives_overlap_compute_and_the_time_model_hides_them() {
    use memwall::plan::time::{Calibration, predict};
    let cal = Calibration::estimate("test cpu".into(), 1, 100.0);
    for zero in 0..=3u8 {
        let p = plan("gpt2", 4, 256, 2, zero, |_| {});
        let ops = &p.schedule.ops;
        // Every collective but the last of each phase has compute between its start and its
        // await; at stage 3 the forward's gathers run one group ahead.
        let mut overlapped = 0;
        let mut collectives = 0;
        for (i, e) in ops.iter().enumerate() {
            let Some(buf) = e.op.collective_buf() else {
                continue;
            };
            collectives += 1;
            let end = i + ops[i..]
                .iter()
                .position(|x| matches!(&x.op, Op::AwaitCollective { bufs } if bufs[0] == buf))
                .expect("every collective is awaited");
            let compute = ops[i + 1..end].iter().any(|x| {
                x.op.collective_buf().is_none() && !matches!(x.op, Op::AwaitCollective { .. })
            });
            overlapped += usize::from(compute);
        }
        assert!(
            overlapped + 3 >= collectives,
            "zero {zero}: {overlapped} of {collectives} collectives beside compute"
        );
        // The time model runs them on their own clock: most of their time is hidden.
        let t = predict(&p, &cal);
        assert!(t.comm_s > 0.0, "zero {zero}");
        assert!(
            t.comm_wait_s < 0.5 * t.comm_s,
            "zero {zero}: {} s of {} s exposed",
            t.comm_wait_s,
            t.comm_s
        );
        assert!(t.step_s < t.compute_s + t.comm_s, "zero {zero}");
    }
}

#[test]
fn collectives_are_timed_on_the_transport_measured_for_that_many_ranks() {
    use memwall::plan::time::{
        Calibration, Cost, NOMINAL_COLLECTIVE_BYTES_PER_S, Transport, predict,
    };
    let nominal = Calibration::estimate("test cpu".into(), 1, 100.0);
    // Every collective at 1 GB/s and 1 ms a call, as if measured among 2 ranks.
    let cost = Cost {
        s_per_flop: 0.0,
        s_per_byte: 1e-9,
        s_per_op: 1e-3,
        samples: 5,
        fit_error_pct: 0.0,
    };
    let mut measured = nominal.clone();
    measured.transport = Some(Transport {
        at: "2026-11-24T00:00:00Z".into(),
        ranks: 2,
        transport: "test".into(),
        cpu: "test cpu".into(),
        kinds: ["all_reduce", "reduce_scatter", "all_gather"]
            .iter()
            .map(|k| (format!("{k}/f32"), cost))
            .collect(),
    });
    for zero in 0..=3 {
        for ranks in [2, 3] {
            let p = plan("gpt2-tiny", 2, 64, ranks, zero, |_| {});
            let calls = p
                .schedule
                .ops
                .iter()
                .filter(|e| p.schedule.in_step(e.phase) && e.op.collective_buf().is_some())
                .count() as f64;
            // The schedule's collectives (the step's scalars go outside the time model).
            let bytes = (p.comm_bytes_per_step() - p.scalar_comm_bytes()) as f64;
            let (b, c) = if ranks == 2 {
                (1e-9, 1e-3)
            } else {
                // Measured among 2 ranks, so not used for 3: the assumed bandwidth.
                (1.0 / NOMINAL_COLLECTIVE_BYTES_PER_S, 10e-6)
            };
            let t = predict(&p, &measured);
            let want = b * bytes + c * calls;
            assert!(
                (t.comm_s - want).abs() <= 1e-9 * want,
                "--zero {zero}, {ranks} ranks: {} s, want {want} s",
                t.comm_s
            );
            assert_eq!(predict(&p, &nominal).comm_s == t.comm_s, ranks == 3);
            let text = measured.describe_transport(ranks);
            let says = if ranks == 2 {
                "measured among 2 ranks"
            } else {
                "assumed"
            };
            assert!(text.contains(says), "{text}");
        }
    }
}
