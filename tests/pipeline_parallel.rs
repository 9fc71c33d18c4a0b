//! Pipeline parallelism (`--pp`) in one process: ranks as threads over `dist::Local`, the same
//! executor and collectives as MPI ranks. Each stage holds consecutive layers (the first the
//! embedding, the last the head and the loss, a tied embedding both) and runs its
//! micro-batches in the 1F1B order, sending activations on and gradients back. Together the
//! stages must train as one process does: losses within 1e-5 and weights within 1e-4 after
//! several steps, GPT-2 and Llama (grouped-query attention, tied and untied heads), under
//! every recomputation policy, with tensor and data ranks beside them.

mod common;

use common::worst_tensor;
use memwall::backend::under_test as backend;
use memwall::dist::{Comm, Local};
use memwall::exec::{Executor, OptimHparams};
use memwall::ir::{Mesh, Recompute, Zero};
use memwall::model::lora::{AdapterLayout, LoraSpec, parse_targets};
use memwall::model::{Family, ModelSpec, ParamLayout};
use memwall::plan::{Mode, StepConfig, build_plan};
use std::sync::Arc;

const SEQ: usize = 32;
const STEPS: u64 = 4;
/// Rows of one micro-batch.
const B: usize = 2;

fn hparams(step: u64) -> OptimHparams {
    common::rank_test_hparams(step)
}

/// One rank's run: per-step losses and grad norms, its parameters, the bytes its transport
/// sent per step and the plan's figure.
struct Outcome {
    losses: Vec<f32>,
    norms: Vec<f32>,
    params: Vec<f32>,
    layout: ParamLayout,
    sent: u64,
    planned: u64,
}

/// Trains `spec` for [`STEPS`] steps as `mesh`'s rank on `comm`, `micro` micro-batches of
/// [`B`] rows per data rank and step.
fn train(
    (spec, lora): (&ModelSpec, Option<&LoraSpec>),
    (mesh, zero): (Mesh, Zero),
    comm: Arc<dyn Comm>,
    micro: usize,
    re: Recompute,
) -> Outcome {
    let mut cfg = StepConfig::new(B, SEQ, 1);
    cfg.mesh = mesh;
    cfg.zero = zero;
    cfg.lora = lora.cloned();
    cfg.grad_accum = micro;
    cfg.recompute = re;
    let plan = build_plan(spec, &cfg, Mode::Train, backend()).unwrap();
    let planned = plan.comm_bytes_per_step();
    let layout = plan.layout.clone();
    let mut ex = Executor::among(plan, backend(), comm.clone()).unwrap();
    let mut init = layout.initializer(3);
    ex.fill_params(|r, p| {
        init.fill(r, p);
        Ok(())
    })
    .unwrap();
    // A LoRA plan's base: the stage's part of the whole model's initialisation.
    if let Some(lora) = ex.plan.lora.clone() {
        let mut init = lora.base.initializer(4);
        ex.fill_base(|r, p| {
            init.fill(r, p);
            Ok(())
        })
        .unwrap();
    }
    let (mut losses, mut norms) = (vec![], vec![]);
    let before = comm.bytes_sent();
    let rows = B * micro;
    for step in 1..=STEPS {
        // Every stage and tensor rank of a data rank reads that data rank's rows.
        let all = common::random_batch(11, step, (rows * mesh.data, SEQ), spec.vocab_size);
        let (w, d) = (rows * (SEQ + 1), mesh.data_rank());
        ex.upload_batch(&all[d * w..(d + 1) * w]).unwrap();
        let s = ex.train_step(&hparams(step)).unwrap();
        losses.push(s.loss);
        norms.push(s.grad_norm);
    }
    Outcome {
        losses,
        norms,
        params: match zero.shards_params() {
            true => vec![],
            false => ex.download_params().unwrap(),
        },
        layout,
        sent: (comm.bytes_sent() - before) / STEPS,
        planned,
    }
}

/// `data × tensor × pipeline` ranks as threads, ZeRO stage `zero` on the data axis.
fn ranks(
    spec: (&ModelSpec, Option<&LoraSpec>),
    (data, tensor, pipeline, zero): (usize, usize, usize, Zero),
    micro: usize,
    re: Recompute,
) -> Vec<Outcome> {
    let n = data * tensor * pipeline;
    let group: Vec<Arc<dyn Comm>> = Local::group(n)
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Comm>)
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let mesh = Mesh::new(n, tensor, pipeline, rank);
                s.spawn(move || train(spec, (mesh, zero), comm, micro, re))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn rel(a: f32, b: f32) -> f32 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// `data × tensor × pipeline` ranks, `micro` micro-batches each, against one process of
/// `micro × data` micro-batches.
fn matches_one_process(spec: &ModelSpec, mesh: (usize, usize, usize), micro: usize, re: Recompute) {
    let (data, tensor, pipeline) = mesh;
    matches_one_process_at((spec, None), (data, tensor, pipeline, Zero::DP), micro, re)
}

/// [`matches_one_process`] with ZeRO stage `zero` on the data axis (at stage 3 the
/// parameters are shards, so the losses and norms are compared, not the weights).
fn matches_one_process_at(
    (spec, lora): (&ModelSpec, Option<&LoraSpec>),
    mesh: (usize, usize, usize, Zero),
    micro: usize,
    re: Recompute,
) {
    let (data, tensor, pipeline, zero) = mesh;
    let single: Arc<dyn Comm> = Arc::new(memwall::dist::Single);
    let one = (Mesh::SINGLE, Zero::DP);
    let reference = train((spec, lora), one, single, micro * data, re);
    let out = ranks((spec, lora), mesh, micro, re);
    // What is trained: the model, or the adapters on it.
    let whole = match lora {
        Some(l) => {
            AdapterLayout::new(&ParamLayout::new(spec), l.clone())
                .unwrap()
                .params
        }
        None => ParamLayout::new(spec),
    };
    let what = format!(
        "{} data={data} tensor={tensor} pipeline={pipeline} zero={zero} micro={micro} {re:?}",
        spec.name
    );
    for (rank, o) in out.iter().enumerate() {
        assert_eq!(o.layout.stage.size, pipeline, "{what}: rank {rank}");
        assert!(
            o.layout.total < whole.total,
            "{what}: a stage holds part of the model"
        );
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
        assert!(o.planned > 0);
    }
    if zero.shards_params() {
        return;
    }
    let per_data = tensor * pipeline;
    for d in 0..data {
        // The ranks of data rank d: tensor fastest, then data, then pipeline (Megatron's order).
        let mine: Vec<&Outcome> = (0..pipeline)
            .flat_map(|p| (0..tensor).map(move |t| t + tensor * (d + data * p)))
            .map(|r| &out[r])
            .collect();
        assert_eq!(mine.len(), per_data);
        let held: Vec<_> = mine.iter().map(|o| (&o.layout, &o.params[..])).collect();
        let mut params = common::gathered(&whole, &held);
        let reference_params = &reference.params;
        common::key_biases_within_noise(
            &whole,
            &mut params,
            reference_params,
            2.0 * hparams(1).lr * STEPS as f32,
            &what,
        );
        common::lone_noise_steps_within(
            &whole,
            &mut params,
            reference_params,
            2.0 * hparams(1).lr * STEPS as f32,
            &what,
        );
        let w = worst_tensor(&whole, &params, reference_params);
        assert!(w < 1e-4, "{what} data rank {d}: weights differ by {w}");
    }
}

fn preset(name: &str) -> ModelSpec {
    ModelSpec::preset(name).unwrap()
}

#[test]
fn two_stages_train_gpt2_like_one_process_under_every_recompute_policy() {
    for re in [Recompute::None, Recompute::Selective, Recompute::Full] {
        matches_one_process(&preset("gpt2-tiny"), (1, 1, 2), 4, re);
    }
}

#[test]
fn two_stages_train_llama_with_a_tied_head_like_one_process() {
    // Fewer micro-batches than stages, one, and many.
    for micro in [1, 2, 5] {
        matches_one_process(&preset("llama-tiny"), (1, 1, 2), micro, Recompute::None);
    }
}

#[test]
fn four_stages_train_an_untied_llama_like_one_process() {
    let mut spec = preset("llama-tiny");
    spec.tied_embeddings = false;
    matches_one_process(&spec, (1, 1, 4), 6, Recompute::Selective);
}

#[test]
fn stages_of_tensor_ranks_train_like_one_process() {
    matches_one_process(&preset("llama-tiny"), (1, 2, 2), 3, Recompute::None);
    matches_one_process(&preset("gpt2-tiny"), (1, 2, 2), 2, Recompute::Full);
}

#[test]
fn stages_with_data_ranks_train_like_one_process() {
    matches_one_process(&preset("gpt2-tiny"), (2, 1, 2), 2, Recompute::None);
}

/// ZeRO 1, 2 and 3 on the data axis of a pipeline (DeepSpeed refuses pipeline parallelism
/// with stages 2 and 3), tied and untied heads, several micro-batches (ZeRO 2
/// reduce-scatters each one's gradients).
#[test]
fn stages_with_zero_on_the_data_axis_train_like_one_process_at_every_stage() {
    let mut untied = preset("llama-tiny");
    untied.tied_embeddings = false;
    for zero in 1..=3 {
        let none = Recompute::None;
        matches_one_process_at((&untied, None), (2, 1, 2, Zero(zero)), 3, none);
        matches_one_process_at((&preset("gpt2-tiny"), None), (2, 1, 2, Zero(zero)), 3, none);
    }
}

/// LoRA on pipeline stages: each stage adapts its own layers (its adapters drawn where one
/// process draws them), the base frozen; with data ranks and ZeRO 2 too.
#[test]
fn stages_train_lora_adapters_like_one_process() {
    for (model, family) in [("gpt2-tiny", Family::Gpt2), ("llama-tiny", Family::Llama)] {
        let lora = LoraSpec {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: parse_targets("all", family).unwrap(),
        };
        let spec = preset(model);
        matches_one_process_at(
            (&spec, Some(&lora)),
            (1, 1, 2, Zero::DP),
            3,
            Recompute::Full,
        );
    }
    let lora = LoraSpec {
        r: 2,
        alpha: 4.0,
        dropout: 0.1,
        targets: parse_targets("q,v", Family::Llama).unwrap(),
    };
    let spec = preset("llama-tiny");
    matches_one_process_at((&spec, Some(&lora)), (2, 1, 2, Zero(2)), 2, Recompute::None);
}

/// tp 2 × pp 2 × dp 2: every axis at once, 8 ranks.
#[test]
fn eight_ranks_of_every_axis_train_llama_like_one_process() {
    matches_one_process(&preset("llama-tiny"), (2, 2, 2), 2, Recompute::None);
}

/// Under 1F1B, stage s holds at most min(p − s, m) micro-batches of activations: the first
/// stage's planned activations grow with the micro-batches up to p, the last's do not.
#[test]
fn a_stage_holds_the_activations_of_at_most_p_minus_s_micro_batches() {
    use memwall::ir::Category;
    let mut spec = preset("llama-tiny");
    spec.tied_embeddings = false;
    let acts = |rank: usize, micro: usize| {
        let mut cfg = StepConfig::new(B, SEQ, 1);
        cfg.mesh = Mesh::new(4, 1, 4, rank);
        cfg.grad_accum = micro;
        let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
        plan.peak_by_category()
            .iter()
            .find(|(c, _)| *c == Category::Activation)
            .map_or(0, |(_, b)| *b)
    };
    // Stage 0 of 4: 1, 2, 3, 4 micro-batches in flight, then no more.
    let first: Vec<u64> = (1..=6).map(|m| acts(0, m)).collect();
    for m in 1..4 {
        assert!(first[m] > first[m - 1], "stage 0: {first:?}");
    }
    assert_eq!(first[3], first[4], "stage 0: {first:?}");
    assert_eq!(first[4], first[5], "stage 0: {first:?}");
    // The last stage holds one at a time.
    let last: Vec<u64> = (1..=4).map(|m| acts(3, m)).collect();
    assert!(last.iter().all(|&b| b == last[0]), "stage 3: {last:?}");
}

#[test]
fn a_pipeline_longer_than_the_model_is_refused_naming_both() {
    let mut spec = preset("llama-tiny");
    let mut cfg = StepConfig::new(1, SEQ, 1);
    cfg.mesh = Mesh::new(8, 1, 8, 0);
    let refused = |spec: &ModelSpec, cfg: &StepConfig| {
        let e = build_plan(spec, cfg, Mode::Train, backend()).err();
        format!("{:#}", e.expect("refused"))
    };
    // A tied embedding first: only 2 stages hold it so far.
    let msg = refused(&spec, &cfg);
    assert!(
        msg.contains("--pp 8") && msg.contains("use --pp 2"),
        "{msg}"
    );
    spec.tied_embeddings = false;
    let msg = refused(&spec, &cfg);
    assert!(msg.contains("--pp 8") && msg.contains("4 layers"), "{msg}");
}
