//! Tensor parallelism (`--tp`) in one process: ranks as threads over `dist::Local`, the same
//! executor and ring collectives as MPI ranks. Each tensor rank holds its part of every
//! layer (Megatron's layout); together they must train as one process does: losses within
//! 1e-5 and weights within 1e-4 after several steps, GPT-2 and Llama (grouped-query
//! attention), under every recomputation policy, and with data-parallel ranks beside them
//! (tp 2 × dp 2). The parts gathered back are the one-process model's tensors.

mod common;

use common::worst_tensor;
use memwall::backend::under_test as backend;
use memwall::dist::{Comm, Local};
use memwall::exec::{Executor, OptimHparams};
use memwall::ir::{Mesh, Recompute, Zero};
use memwall::model::spec::LocalLayers;
use memwall::model::{Family, ModelSpec, ParamLayout};
use memwall::plan::{Mode, StepConfig, build_plan};
use std::sync::Arc;

const SEQ: usize = 32;
const STEPS: u64 = 4;

/// Step `step`'s global batch: `rows` rows of SEQ+1 tokens below `vocab`.
fn global_batch(step: u64, rows: usize, vocab: usize) -> Vec<u32> {
    common::random_batch(11, step, (rows, SEQ), vocab)
}

fn hparams(step: u64) -> OptimHparams {
    common::rank_test_hparams(step)
}

/// One rank's run: per-step losses and grad norms, its parameters (its parts), the bytes
/// its transport sent per step and the plan's figure.
struct Outcome {
    losses: Vec<f32>,
    norms: Vec<f32>,
    /// Its parameters (its parts), unless they are sharded (`--zero 3`).
    params: Option<Vec<f32>>,
    layout: ParamLayout,
    sent: u64,
    planned: u64,
    /// Bytes of the residual stream between the first two blocks (`h0.out`, of the first
    /// micro-batch).
    stream_bytes: u64,
}

/// Trains `model` with batch `b` per data rank for [`STEPS`] steps on `comm` as `mesh`'s
/// rank, ZeRO stage `zero`, with sequence parallelism or not (one process: `Single` and
/// [`Mesh::SINGLE`], batch `b` with accumulation `accum`).
fn train(
    model: &str,
    (mesh, zero, sequence): (Mesh, Zero, bool),
    comm: Arc<dyn Comm>,
    b: usize,
    accum: usize,
    re: Recompute,
) -> Outcome {
    let spec = spec_of(model);
    let mut cfg = StepConfig::new(b, SEQ, 1);
    cfg.mesh = mesh;
    cfg.zero = zero;
    cfg.sequence_parallel = sequence;
    cfg.grad_accum = accum;
    cfg.recompute = re;
    let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
    let planned = plan.comm_bytes_per_step();
    let stream_bytes = (plan.buffers.iter())
        .find(|b| b.name.ends_with("h0.out"))
        .expect("the first block's output")
        .bytes;
    let layout = plan.layout.clone();
    let mut ex = Executor::among(plan, backend(), comm.clone()).unwrap();
    let mut init = layout.initializer(3);
    ex.fill_params(|r, p| {
        init.fill(r, p);
        Ok(())
    })
    .unwrap();
    let (mut losses, mut norms) = (vec![], vec![]);
    let before = comm.bytes_sent();
    let rows = b * accum;
    for step in 1..=STEPS {
        // Every tensor rank of a data rank reads that data rank's rows.
        let all = global_batch(step, rows * mesh.data, spec.vocab_size);
        let (w, d) = (rows * (SEQ + 1), mesh.data_rank());
        ex.upload_batch(&all[d * w..(d + 1) * w]).unwrap();
        let s = ex.train_step(&hparams(step)).unwrap();
        losses.push(s.loss);
        norms.push(s.grad_norm);
    }
    Outcome {
        losses,
        norms,
        params: (zero.0 < 3).then(|| ex.download_params().unwrap()),
        layout,
        sent: (comm.bytes_sent() - before) / STEPS,
        planned,
        stream_bytes,
    }
}

/// `data × tensor` ranks as threads, ZeRO stage `zero` on the data axis, with sequence
/// parallelism or not.
fn ranks(
    model: &str,
    (data, tensor, zero, sequence): (usize, usize, Zero, bool),
    b: usize,
    re: Recompute,
) -> Vec<Outcome> {
    let group: Vec<Arc<dyn Comm>> = Local::group(data * tensor)
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Comm>)
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let mesh = Mesh {
                    data,
                    tensor,
                    pipeline: 1,
                    rank,
                };
                s.spawn(move || train(model, (mesh, zero, sequence), comm, b, 1, re))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A preset, or `"P as phi3"` / `"P as qwen3"` / `"P as gemma3"`: preset P's shapes in Phi-3's
/// layout (q|k|v and gate|up one tensor each, so a tensor rank keeps three runs of one and two
/// of the other), with Qwen3's per-head q/k norms (whole on every tensor rank, their gradients
/// summed among them), or with Gemma 3's (its post-norms after the joins, whole and alike on
/// every rank; its √C embedding summed over the vocabulary's parts).
fn spec_of(model: &str) -> ModelSpec {
    let family = |m: &str, family| ModelSpec {
        family,
        ..ModelSpec::preset(m).unwrap()
    };
    if let Some(m) = model.strip_suffix(" as gemma3") {
        // Gemma 3's arithmetic, its layers alternating sliding (a window of 5) and full.
        let spec = family(m, Family::Gemma3);
        ModelSpec {
            sliding_window: Some(5),
            local_layers: Some(LocalLayers {
                sliding: (0..spec.n_layer).map(|l| l % 2 == 0).collect(),
                rope_theta: 100.0,
                own_rotation: true,
            }),
            ..spec
        }
    } else if let Some(m) = model.strip_suffix(" as phi3") {
        family(m, Family::Phi3)
    } else if let Some(m) = model.strip_suffix(" as qwen3") {
        family(m, Family::Qwen3)
    } else {
        ModelSpec::preset(model).unwrap()
    }
}

fn rel(a: f32, b: f32) -> f32 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// `data × tensor` ranks against one process of batch `b × data` (as accumulation).
fn matches_one_process(model: &str, data: usize, tensor: usize, re: Recompute) {
    matches_one_process_at(model, (data, tensor, Zero::DP), re)
}

/// [`matches_one_process`] with ZeRO stage `zero` on the data axis (at stage 3 the
/// parameters are shards, so the losses and norms are compared, not the weights).
fn matches_one_process_at(model: &str, (data, tensor, zero): (usize, usize, Zero), re: Recompute) {
    matches_one_process_with(model, (data, tensor, zero, false), re)
}

/// [`matches_one_process_at`] with sequence parallelism or not.
fn matches_one_process_with(
    model: &str,
    (data, tensor, zero, sequence): (usize, usize, Zero, bool),
    re: Recompute,
) {
    let b = 2;
    let single: Arc<dyn Comm> = Arc::new(memwall::dist::Single);
    let reference = train(model, (Mesh::SINGLE, Zero::DP, false), single, b, data, re);
    let out = ranks(model, (data, tensor, zero, sequence), b, re);
    let whole = ParamLayout::new(&spec_of(model));
    let what =
        format!("{model} data={data} tensor={tensor} zero={zero} sequence={sequence} {re:?}");
    for (rank, o) in out.iter().enumerate() {
        assert!(o.layout.split.is_split(), "{what}: rank {rank} holds parts");
        assert!(o.layout.total < whole.total, "{what}: a part is smaller");
        for (k, (a, b)) in o.losses.iter().zip(&reference.losses).enumerate() {
            assert!(
                rel(*a, *b) < 1e-5,
                "{what} rank {rank} step {}: loss {a} vs {b}",
                k + 1
            );
        }
        for (a, b) in o.norms.iter().zip(&reference.norms) {
            assert!(rel(*a, *b) < 1e-4, "{what} rank {rank}: norm {a} vs {b}");
        }
        assert_eq!(o.sent, o.planned, "{what} rank {rank}: bytes sent per step");
        // Each rank holds its rows of the stream under sequence parallelism, all of it else.
        let rows = if sequence { tensor } else { 1 } as u64;
        assert_eq!(o.stream_bytes * rows, reference.stream_bytes, "{what}");
        assert!(o.planned > 0);
    }
    if zero.shards_params() {
        return;
    }
    let reference_params = reference.params.as_ref().unwrap();
    for d in 0..data {
        let parts: Vec<&Outcome> = out[d * tensor..(d + 1) * tensor].iter().collect();
        let held: Vec<_> = (parts.iter())
            .map(|o| {
                (
                    &o.layout,
                    o.params.as_deref().expect("parameters downloaded"),
                )
            })
            .collect();
        let mut params = common::gathered(&whole, &held);
        common::key_biases_within_noise(
            &whole,
            &mut params,
            reference_params,
            2.0 * hparams(1).lr * STEPS as f32,
            &what,
        );
        // Gemma's norm weights start at 0 and are gains 1 + w: compared as the gains, or the
        // relative measure would divide rounding noise by weights a few steps from 0.
        let offset = spec_of(model).family.norm_offset();
        let gains = |p: &[f32]| {
            let mut p = p.to_vec();
            for t in whole
                .tensors
                .iter()
                .filter(|t| t.name.ends_with("norm.weight"))
            {
                p[t.range.clone()].iter_mut().for_each(|x| *x += offset);
            }
            p
        };
        let w = worst_tensor(&whole, &gains(&params), &gains(reference_params));
        assert!(w < 1e-4, "{what} data rank {d}: weights differ by {w}");
    }
}

#[test]
fn two_tensor_ranks_train_gpt2_like_one_process_under_every_recompute_policy() {
    for re in [Recompute::None, Recompute::Selective, Recompute::Full] {
        matches_one_process("gpt2-tiny", 1, 2, re);
    }
}

#[test]
fn two_tensor_ranks_train_llama_with_grouped_query_attention_like_one_process() {
    // 4 query heads over 2 key/value heads: each tensor rank holds one key/value head and
    // the two query heads it serves (4 ways is refused, below).
    matches_one_process("llama-tiny", 1, 2, Recompute::None);
    matches_one_process("llama-tiny", 1, 2, Recompute::Full);
    matches_one_process("llama-tiny", 2, 2, Recompute::Selective);
    matches_one_process("llama-tiny as phi3", 1, 2, Recompute::None);
    matches_one_process("llama-tiny as qwen3", 1, 2, Recompute::Full);
    matches_one_process("llama-tiny as qwen3", 2, 2, Recompute::None);
    matches_one_process("llama-tiny as gemma3", 1, 2, Recompute::Full);
    matches_one_process("llama-tiny as gemma3", 2, 2, Recompute::Selective);
}

/// Sequence parallelism: the residual stream, the norms and their outputs cut by rows among
/// the tensor ranks (all-gathers and reduce-scatters in place of the all-reduces, the norms'
/// gradients summed), under every recomputation policy, for GPT-2 (LayerNorm, biases,
/// learned positions), Llama with grouped-query attention, Qwen3's q/k norms and Gemma 3's
/// post-norms; with data ranks and ZeRO beside it.
#[test]
fn sequence_parallel_tensor_ranks_train_like_one_process() {
    let sp = |model, (data, tensor, zero), re| {
        matches_one_process_with(model, (data, tensor, Zero(zero), true), re)
    };
    for re in [Recompute::None, Recompute::Selective, Recompute::Full] {
        sp("gpt2-tiny", (1, 2, 0), re);
        sp("llama-tiny", (1, 2, 0), re);
    }
    sp("llama-tiny as qwen3", (1, 2, 0), Recompute::Selective);
    sp("llama-tiny as gemma3", (1, 2, 0), Recompute::None);
    sp("llama-tiny as gemma3", (1, 2, 0), Recompute::Full);
    sp("llama-tiny as phi3", (2, 2, 1), Recompute::None);
    sp("gpt2-tiny", (2, 2, 2), Recompute::Selective);
}

/// Sequence parallelism without tensor ranks, or with rows the tensor ranks do not divide,
/// is refused before anything is allocated, naming the flags.
#[test]
fn sequence_parallelism_it_cannot_do_is_refused_naming_the_flags() {
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    let refused = |(b, t, tensor): (usize, usize, usize)| {
        let mut cfg = StepConfig::new(b, t, 1);
        cfg.mesh = Mesh::new(tensor, tensor, 1, 0);
        cfg.sequence_parallel = true;
        let e = build_plan(&spec, &cfg, Mode::Train, backend()).err();
        format!("{:#}", e.expect("refused"))
    };
    let e = refused((1, SEQ, 1));
    assert!(
        e.contains("--sequence-parallel") && e.contains("--tp 2"),
        "{e}"
    );
    // 1 x 33 rows among 2 tensor ranks.
    let e = refused((1, SEQ + 1, 2));
    assert!(
        e.contains("1 x 33 = 33 token rows") && e.contains("--tp 2"),
        "{e}"
    );
    // Generation runs on one rank.
    let mut cfg = StepConfig::new(1, SEQ, 1);
    cfg.mesh = Mesh::new(2, 2, 1, 0);
    cfg.sequence_parallel = true;
    assert!(build_plan(&spec, &cfg, Mode::Generate, backend()).is_err());
}

#[test]
fn tensor_and_data_ranks_together_train_gpt2_like_one_process() {
    matches_one_process("gpt2-tiny", 2, 2, Recompute::None);
}

#[test]
fn tensor_ranks_with_zero_on_the_data_axis_train_like_one_process_at_every_stage() {
    for zero in 1..=3 {
        matches_one_process_at("llama-tiny", (2, 2, Zero(zero)), Recompute::None);
    }
    matches_one_process_at("gpt2-tiny", (2, 2, Zero(2)), Recompute::Selective);
}

#[test]
fn a_tensor_size_that_does_not_divide_the_heads_is_refused_naming_both() {
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    let mut cfg = StepConfig::new(1, SEQ, 1);
    cfg.mesh = Mesh {
        data: 1,
        tensor: 4,
        pipeline: 1,
        rank: 0,
    };
    let e = build_plan(&spec, &cfg, Mode::Train, backend())
        .err()
        .unwrap();
    let msg = format!("{e:#}");
    assert!(msg.contains("--tp 4"), "{msg}");
    assert!(msg.contains("num_key_value_heads 2"), "{msg}");
    assert!(msg.contains("use --tp 1 or 2"), "{msg}");
    cfg.mesh.tensor = 3;
    let e = build_plan(&spec, &cfg, Mode::Train, backend())
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("num_attention_heads 4"), "{e:#}");
}

/// 8 ranks of tp 2 × dp 4 (`plan --ranks 8 --tp 2`): every rank listed in MPI order with its
/// coordinates; the copies of a tensor rank hold the same bytes, and of the parameters a
/// part: about half of the model's (the norms are whole) and less than all. The two tensor
/// ranks differ by one row of the vocabulary (50257 = 25128 + 25129 rows).
#[test]
fn every_rank_of_a_job_is_planned_with_its_place_and_its_part() {
    use memwall::plan::ranks::{by_peak, every_rank};
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    let mut cfg = StepConfig::new(1, SEQ, 1);
    cfg.mesh = Mesh::new(8, 2, 1, 0);
    let ranks = every_rank(&spec, &cfg, backend(), 0).unwrap();
    assert_eq!(ranks.len(), 8);
    for (r, p) in ranks.iter().enumerate() {
        assert_eq!(p.rank, r);
        assert_eq!((p.coords.tp, p.coords.dp, p.coords.pp), (r % 2, r / 2, 0));
        assert_eq!(
            (p.predicted_peak_rss_bytes, p.num_params),
            (
                ranks[r % 2].predicted_peak_rss_bytes,
                ranks[r % 2].num_params
            )
        );
    }
    assert_eq!(spec.vocab_size, 25128 + 25129);
    assert_eq!(ranks[1].num_params - ranks[0].num_params, spec.n_embd);
    assert!(ranks[1].predicted_peak_rss_bytes > ranks[0].predicted_peak_rss_bytes);
    // Each rank's own plan says the same.
    let own = build_plan(
        &spec,
        &StepConfig {
            mesh: Mesh::new(8, 2, 1, 5),
            ..cfg.clone()
        },
        Mode::Train,
        backend(),
    )
    .unwrap();
    assert_eq!(ranks[5].num_params, own.layout.total);
    assert_eq!(ranks[5].predicted_peak_rss_bytes, own.predicted_peak(0));
    let whole = spec.num_params();
    assert!(ranks[0].num_params < whole && ranks[0].num_params > whole * 2 / 5);
    let peaks = [0, 1].map(|r| ranks[r].predicted_peak_rss_bytes);
    assert_eq!(
        by_peak(&ranks),
        vec![(peaks[1], vec![1, 3, 5, 7]), (peaks[0], vec![0, 2, 4, 6])]
    );
    let json = serde_json::to_value(&ranks[3]).unwrap();
    assert_eq!(
        json["coords"],
        serde_json::json!({"dp": 1, "tp": 1, "pp": 0})
    );
    assert!(json["by_category"]["param"].as_u64().unwrap() > 0);
}

/// No tensor rank holds a whole row of logits (Megatron's vocabulary-parallel head): each
/// holds its rows of the tied embedding (GPT-2's 50257 among 2: 25128 and 25129), its head
/// computes logits of those token ids only, and three numbers a row (maximum, sum of
/// exponentials, target logit) are gathered among the tensor ranks before the loss.
#[test]
fn the_vocabulary_is_cut_among_tensor_ranks_and_no_rank_holds_whole_logits() {
    use memwall::ir::{Axis, Op};
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let v = spec.vocab_size;
    for rank in 0..2 {
        let mut cfg = StepConfig::new(2, SEQ, 1);
        cfg.mesh = Mesh::new(2, 2, 1, rank);
        let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
        let rows = [0..v / 2, v / 2..v][rank].clone();
        let wte = &plan.layout.tensors[0];
        assert_eq!(wte.name, "transformer.wte.weight");
        assert_eq!(wte.shape, [rows.len(), spec.n_embd], "rank {rank}");
        let (mut stats, mut gathers) = (0, 0);
        for e in &plan.schedule.ops {
            match &e.op {
                Op::Encoder { first_token, .. } | Op::EncoderBackward { first_token, .. } => {
                    assert_eq!(*first_token, rows.start)
                }
                Op::LmHeadStats { v: part, .. } => {
                    assert_eq!(*part, rows.len());
                    stats += 1;
                }
                Op::LmHeadLoss { v: part, vocab, .. } => {
                    assert_eq!(*part, rows.len());
                    let share = vocab.expect("a vocabulary share");
                    assert_eq!((share.first_token, share.ranks), (rows.start, 2));
                    let n = cfg.batch * SEQ;
                    assert_eq!(plan.buffer(share.stats).elems, 2 * n * 3);
                }
                Op::AllGather {
                    axis: Axis::Tensor, ..
                } => gathers += 1,
                _ => {}
            }
        }
        assert_eq!((stats, gathers), (1, 1), "rank {rank}");
        // The largest buffer of the head is a chunk of the rank's logits.
        let widest = (plan.buffers.iter())
            .filter(|b| b.name.contains("logits"))
            .map(|b| b.elems)
            .max()
            .unwrap();
        assert_eq!(widest % rows.len(), 0);
        assert!(widest < cfg.batch * SEQ * v / 2 + v);
    }
}
