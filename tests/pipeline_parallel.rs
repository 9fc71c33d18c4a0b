//! Pipeline parallelism (`--pp`) in one process: ranks as threads over `dist::Local`, the same
//! executor and collectives as MPI ranks. Each stage holds consecutive layers (the first the
//! embedding, the last the head and the loss, a tied embedding both) and runs its
//! micro-batches in the 1F1B order, sending activations on and gradients back. Together the
//! stages must train as one process does: losses within 1e-5 and weights within 1e-4 after
//! several steps, GPT-2 and Llama (grouped-query attention, tied and untied heads), under
//! every recomputation policy, with tensor and data ranks beside them, and with the stages
//! cut unevenly (`--pp-layers`, `auto` balancing GPT-2's stages by predicted time).

mod common;

use common::worst_tensor;
use memwall::backend::under_test as backend;
use memwall::dist::{Comm, Local};
use memwall::exec::{Executor, OptimHparams};
use memwall::ir::{Axis, BaseQuant, Mesh, PipelineStage, Recompute, Zero};
use memwall::model::lora::{AdapterLayout, LoraSpec, parse_targets};
use memwall::model::{Family, ModelSpec, ParamLayout};
use memwall::plan::stage_cut::{NOMINAL_PEAK_GFLOPS, balanced};
use memwall::plan::time::Calibration;
use memwall::plan::{Mode, OffloadSet, StepConfig, build_plan};
use std::path::Path;
use std::sync::Arc;

const SEQ: usize = 32;
/// A LoRA plan's base in f32 (`--base-quant fp32`).
const F32: BaseQuant = BaseQuant::F32;
const STEPS: u64 = 4;
/// Rows of one micro-batch.
const B: usize = 2;

/// How a mesh's ranks cut the model beyond their counts: each stage's count of layers
/// (`--pp-layers`; empty: as even as they divide), sequence parallelism on the tensor axis,
/// each stage's runs of layers (`--pp-chunks`: more than 1 interleaves them), and what each
/// rank puts on the disk tier in a directory they share (`--offload`, `--offload-dir`).
#[derive(Clone, Copy, Debug)]
struct Cut<'a> {
    layers: &'a [usize],
    sequence: bool,
    chunks: usize,
    offload: Option<(OffloadSet, &'a Path)>,
}

const EVEN: Cut<'static> = Cut {
    layers: &[],
    sequence: false,
    chunks: 1,
    offload: None,
};
const SP: Cut<'static> = Cut {
    sequence: true,
    ..EVEN
};

/// The even cut with `v` runs of layers a stage.
fn interleaved(v: usize) -> Cut<'static> {
    Cut { chunks: v, ..EVEN }
}

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

/// Trains `spec` for [`STEPS`] steps as `mesh`'s rank on `comm` (the model cut as `cut`
/// says), `micro` micro-batches of [`B`] rows per data rank and step.
fn train(
    (spec, lora, base): (&ModelSpec, Option<&LoraSpec>, BaseQuant),
    (mesh, zero, cut): (Mesh, Zero, Cut),
    comm: Arc<dyn Comm>,
    micro: usize,
    re: Recompute,
) -> Outcome {
    let mut cfg = StepConfig::new(B, SEQ, 1);
    cfg.mesh = mesh;
    cfg.stage_layers = cut.layers.to_vec();
    cfg.zero = zero;
    cfg.sequence_parallel = cut.sequence;
    cfg.pipeline_chunks = cut.chunks;
    if let Some((set, dir)) = cut.offload {
        cfg.offload.set = set;
        cfg.offload.dir = Some(dir.to_path_buf());
    }
    cfg.lora = lora.cloned();
    cfg.base_quant = base;
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
    // A deferred update (offloaded gradients) is applied before the weights are read.
    ex.finish_update().unwrap();
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

/// `data × tensor × pipeline` ranks as threads, ZeRO stage `zero` on the data axis, the
/// model cut as `cut` says.
fn ranks(
    spec: (&ModelSpec, Option<&LoraSpec>, BaseQuant),
    (data, tensor, pipeline, zero): (usize, usize, usize, Zero),
    cut: Cut,
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
                s.spawn(move || train(spec, (mesh, zero, cut), comm, micro, re))
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
    spec: (&ModelSpec, Option<&LoraSpec>),
    mesh: (usize, usize, usize, Zero),
    micro: usize,
    re: Recompute,
) {
    matches_one_process_cut(spec, mesh, &[], micro, re)
}

/// [`matches_one_process_at`] with the stages cut as `cut` gives (each stage's count of
/// layers; empty: as even as they divide), each stage holding those layers.
fn matches_one_process_cut(
    spec: (&ModelSpec, Option<&LoraSpec>),
    mesh: (usize, usize, usize, Zero),
    cut: &[usize],
    micro: usize,
    re: Recompute,
) {
    let (spec, lora) = spec;
    let cut = Cut {
        layers: cut,
        ..EVEN
    };
    matches_one_process_with((spec, lora, BaseQuant::F32), mesh, cut, micro, re)
}

/// [`matches_one_process_cut`] with the base of a LoRA plan stored as `base` (`--base-quant`),
/// and the model cut as `cut` says (sequence parallelism, interleaved runs).
fn matches_one_process_with(
    (spec, lora, base): (&ModelSpec, Option<&LoraSpec>, BaseQuant),
    mesh: (usize, usize, usize, Zero),
    cut: Cut,
    micro: usize,
    re: Recompute,
) {
    let (data, tensor, pipeline, zero) = mesh;
    let single: Arc<dyn Comm> = Arc::new(memwall::dist::Single);
    let one = (Mesh::SINGLE, Zero::DP, EVEN);
    let reference = train((spec, lora, base), one, single, micro * data, re);
    let out = ranks((spec, lora, base), mesh, cut, micro, re);
    let counts = match cut.layers.is_empty() {
        true => memwall::ir::mesh::even_layers(spec.n_layer, pipeline),
        false => cut.layers.to_vec(),
    };
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
        "{} data={data} tensor={tensor} pipeline={pipeline} {cut:?} zero={zero} micro={micro} {re:?}",
        spec.name
    );
    for (rank, o) in out.iter().enumerate() {
        assert_eq!(o.layout.stage.size, pipeline, "{what}: rank {rank}");
        let mesh = Mesh::new(out.len(), tensor, pipeline, rank);
        let stage = match cut.chunks {
            1 => mesh.pipeline_stage(&counts),
            v => PipelineStage::interleaved(pipeline, mesh.coord(Axis::Pipeline), v, spec.n_layer),
        };
        assert_eq!(o.layout.stage, stage, "{what}: rank {rank}");
        // The stage's layout holds its layers' blocks and no other's.
        let blocks: std::collections::BTreeSet<usize> = o
            .layout
            .tensors
            .iter()
            .filter_map(|t| block_of(&t.name))
            .collect();
        let held: Vec<usize> = stage
            .chunk_layers(spec.n_layer)
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(
            blocks.into_iter().collect::<Vec<_>>(),
            held,
            "{what} rank {rank}"
        );
        assert!(
            o.layout.total < whole.total || tensor * pipeline == 1,
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

/// The block a tensor belongs to (`h.3.attn...`, `model.layers.3.mlp...`), if any.
fn block_of(name: &str) -> Option<usize> {
    let rest = name
        .split_once(".h.")
        .or_else(|| name.split_once(".layers."))?
        .1;
    rest.split('.').next()?.parse().ok()
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

/// A tied embedding on the first and the last of more than two stages (its gradients summed
/// between the pipeline's ends alone, the middle stages holding none): Llama on 4 stages,
/// GPT-2 (`wpe` beside `wte` on both ends) on 3, and 3 stages of 2 data ranks under ZeRO 2.
#[test]
fn a_tied_embedding_on_the_ends_of_longer_pipelines_trains_like_one_process() {
    let llama = preset("llama-tiny");
    matches_one_process(&llama, (1, 1, 4), 4, Recompute::None);
    matches_one_process(&preset("gpt2-tiny"), (1, 1, 3), 3, Recompute::Selective);
    let none = Recompute::None;
    matches_one_process_at((&llama, None), (2, 1, 3, Zero(2)), 2, none);
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

/// LoRA on tensor ranks (adapters cut with their layers: `B`'s rows of a column-parallel
/// layer, `A`'s columns of a row-parallel one, the other whole with its gradient summed over
/// the tensor ranks), alone and on pipeline stages: GPT-2 (`c_attn`'s three ranges) and
/// Llama (grouped-query attention), with input dropout (a rank's columns of a row-parallel
/// input drawn as one process draws them), under no and full recomputation; with ZeRO 2 and 3
/// on data ranks, over one micro-batch and two.
#[test]
fn tensor_ranks_train_lora_adapters_like_one_process() {
    for (model, family) in [("gpt2-tiny", Family::Gpt2), ("llama-tiny", Family::Llama)] {
        let spec = preset(model);
        for (dropout, re) in [(0.0, Recompute::None), (0.1, Recompute::Full)] {
            let lora = LoraSpec {
                r: 4,
                alpha: 8.0,
                dropout,
                targets: parse_targets("all", family).unwrap(),
            };
            let l = Some(&lora);
            matches_one_process_at((&spec, l), (1, 2, 1, Zero::DP), 2, re);
        }
    }
    let lora = LoraSpec {
        r: 2,
        alpha: 4.0,
        dropout: 0.1,
        targets: parse_targets("q,v,o,down", Family::Llama).unwrap(),
    };
    let spec = preset("llama-tiny");
    let l = Some(&lora);
    matches_one_process_at((&spec, l), (1, 2, 2, Zero::DP), 3, Recompute::Selective);
    matches_one_process_at((&spec, l), (2, 2, 1, Zero(1)), 2, Recompute::None);
    // ZeRO 2 and 3 on the data axis: each micro-batch's gradients, their whole adapter
    // tensors summed over the tensor ranks first, reduce-scattered (one micro-batch, and
    // two).
    for zero in [2, 3] {
        for micro in [1, 2] {
            matches_one_process_at((&spec, l), (2, 2, 1, Zero(zero)), micro, Recompute::None);
        }
    }
}

/// Qwen3's q/k norms (held whole on every tensor rank, each computing a share of their
/// gradient) under ZeRO 2 and 3 over two micro-batches: each micro-batch's shares summed over
/// the tensor ranks before its gradients are reduce-scattered on the data axis.
#[test]
fn tensor_ranks_sum_qk_norm_gradients_per_micro_batch_under_zero_2_and_3() {
    let spec = ModelSpec {
        family: Family::Qwen3,
        ..preset("llama-tiny")
    };
    for zero in [2, 3] {
        matches_one_process_at((&spec, None), (2, 2, 1, Zero(zero)), 2, Recompute::None);
    }
}

/// Adapters of rank `r` on every layer of `family` with input dropout `dropout`.
fn adapters_everywhere(r: usize, dropout: f32, family: Family) -> LoraSpec {
    LoraSpec {
        r,
        alpha: 2.0 * r as f32,
        dropout,
        targets: parse_targets("all", family).unwrap(),
    }
}

/// QLoRA on tensor ranks: each rank's part of the base quantized as it loads (as one process
/// quantizes those rows and those columns, whole blocks), so they train as one process's
/// QLoRA does: q8_0 and q4_0 bases, alone, with sequence parallelism and on stages. The MLP
/// is widened to 384 channels so that a row-parallel part (192) is whole blocks of 32.
#[test]
fn tensor_ranks_train_qlora_adapters_like_one_process() {
    use memwall::dtype::GgmlType;
    let spec = ModelSpec {
        mlp_hidden: 384,
        ..preset("llama-tiny")
    };
    let lora = adapters_everywhere(2, 0.1, Family::Llama);
    let l = Some(&lora);
    let (q8, q4) = (
        BaseQuant::Blocks(GgmlType::Q8_0),
        BaseQuant::Blocks(GgmlType::Q4_0),
    );
    matches_one_process_with(
        (&spec, l, q8),
        (1, 2, 1, Zero::DP),
        EVEN,
        2,
        Recompute::None,
    );
    matches_one_process_with((&spec, l, q4), (1, 2, 1, Zero::DP), SP, 2, Recompute::Full);
    matches_one_process_with(
        (&spec, l, q4),
        (1, 2, 2, Zero::DP),
        EVEN,
        3,
        Recompute::Selective,
    );
}

/// tp 2 × pp 2 × dp 2: every axis at once, 8 ranks; with sequence parallelism (each stage
/// sending its tensor rank's rows of the stream) and LoRA too.
#[test]
fn eight_ranks_of_every_axis_train_llama_like_one_process() {
    matches_one_process(&preset("llama-tiny"), (2, 2, 2), 2, Recompute::None);
    let spec = preset("llama-tiny");
    matches_one_process_with(
        (&spec, None, F32),
        (2, 2, 2, Zero(1)),
        SP,
        2,
        Recompute::Selective,
    );
    let lora = adapters_everywhere(2, 0.1, Family::Llama);
    let l = Some(&lora);
    matches_one_process_with((&spec, l, F32), (2, 2, 2, Zero::DP), SP, 2, Recompute::Full);
}

/// Sequence parallelism on stages of tensor ranks (GPT-2: LayerNorm, learned positions, the
/// tied head on both ends), and with LoRA on tensor ranks (the frozen embedding's backward,
/// and the gather that would feed it, not emitted).
#[test]
fn sequence_parallel_stages_and_adapters_train_like_one_process() {
    let gpt2 = preset("gpt2-tiny");
    matches_one_process_with(
        (&gpt2, None, F32),
        (1, 2, 2, Zero::DP),
        SP,
        3,
        Recompute::None,
    );
    let lora = adapters_everywhere(4, 0.1, Family::Gpt2);
    let l = Some(&lora);
    matches_one_process_with(
        (&gpt2, l, F32),
        (1, 2, 1, Zero::DP),
        SP,
        2,
        Recompute::Selective,
    );
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
    let mut cfg = StepConfig::new(1, SEQ, 1);
    cfg.mesh = Mesh::new(8, 1, 8, 0);
    let e = build_plan(&preset("llama-tiny"), &cfg, Mode::Train, backend()).err();
    let msg = format!("{:#}", e.expect("refused"));
    assert!(msg.contains("--pp 8") && msg.contains("4 layers"), "{msg}");
}

/// Stages of uneven runs of layers (`--pp-layers`) train as one process does: the first or
/// the last stage holding all but one layer (GPT-2, Llama with its tied head), three stages
/// of an untied Llama, and uneven stages of tensor ranks.
#[test]
fn uneven_stages_train_like_one_process() {
    let (none, dp) = (Recompute::None, Zero::DP);
    for cut in [[3, 1], [1, 3]] {
        matches_one_process_cut((&preset("gpt2-tiny"), None), (1, 1, 2, dp), &cut, 4, none);
        matches_one_process_cut((&preset("llama-tiny"), None), (1, 1, 2, dp), &cut, 3, none);
    }
    let mut untied = preset("llama-tiny");
    untied.tied_embeddings = false;
    let selective = Recompute::Selective;
    matches_one_process_cut((&untied, None), (1, 1, 3, dp), &[1, 2, 1], 4, selective);
    matches_one_process_cut((&untied, None), (1, 2, 2, dp), &[3, 1], 2, none);
}

/// A cut that is not one run of one layer or more per stage, covering the model, is refused
/// before anything is planned, naming `--pp-layers`.
#[test]
fn a_bad_cut_is_refused_naming_the_flag() {
    let mut spec = preset("llama-tiny");
    spec.tied_embeddings = false;
    let refused = |p: usize, cut: &[usize]| {
        let mut cfg = StepConfig::new(1, SEQ, 1);
        cfg.mesh = Mesh::new(p, 1, p, 0);
        cfg.stage_layers = cut.to_vec();
        let e = build_plan(&spec, &cfg, Mode::Train, backend()).err();
        format!("{:#}", e.expect("refused"))
    };
    let msg = refused(2, &[3, 2]);
    assert!(
        msg.contains("--pp-layers 3,2 holds 5 layers, but the model has 4"),
        "{msg}"
    );
    let msg = refused(2, &[1, 1, 2]);
    assert!(
        msg.contains("--pp-layers 1,1,2 gives 3 stages, but --pp is 2"),
        "{msg}"
    );
    let msg = refused(3, &[4, 0, 0]);
    assert!(
        msg.contains("--pp-layers 4,0,0: every stage holds at least one layer"),
        "{msg}"
    );
}

/// GPT-2 on 2 stages, as `scripts/bench-pp.sh` runs it.
fn gpt2_stages(rank: usize) -> (ModelSpec, StepConfig) {
    let mut cfg = StepConfig::new(1, 256, 1);
    cfg.mesh = Mesh::new(2, 1, 2, rank);
    cfg.grad_accum = 8;
    (preset("gpt2"), cfg)
}

/// Each stage's predicted forward and backward of one micro-batch and its predicted peak,
/// from its own plan under the cut `counts`.
fn stage_figures(counts: &[usize], cal: &Calibration) -> Vec<(f64, u64)> {
    (0..counts.len())
        .map(|s| {
            let (spec, mut cfg) = gpt2_stages(s);
            cfg.stage_layers = counts.to_vec();
            let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
            let t = memwall::plan::time::predict(&plan, cal);
            let micro = (t.compute_s - t.update_s) / cfg.grad_accum as f64;
            (micro, plan.predicted_peak(0))
        })
        .collect()
}

/// `--pp-layers auto` puts fewer layers on GPT-2's last stage (its head costs about 5.5
/// layers), so its slowest stage is faster than the even cut's; the stages' times it
/// predicts are their own plans'. Under a budget below that cut's first stage, the cut
/// keeps every stage's planned peak within it.
#[test]
fn auto_puts_fewer_layers_on_gpt2s_last_stage_within_the_budget() {
    let (spec, cfg) = gpt2_stages(0);
    let cal = Calibration::estimate("test".into(), 1, NOMINAL_PEAK_GFLOPS);
    let b = balanced(&spec, &cfg, &cal, None, 0, backend()).unwrap();
    assert_eq!(b.counts.iter().sum::<usize>(), 12);
    assert!(b.counts[1] < b.counts[0], "{:?}", b.counts);
    let slowest = |t: &[f64]| t.iter().copied().fold(0.0, f64::max);
    assert!(slowest(&b.stage_s) < 0.9 * slowest(&b.even_s), "{b:?}");
    let real = stage_figures(&b.counts, &cal);
    for (s, ((t, peak), (bt, bpeak))) in real.iter().zip(b.stage_s.iter().zip(&b.peak)).enumerate()
    {
        assert!(
            (t - bt).abs() < 0.01 * t,
            "stage {s}: {t} s planned, {bt} s predicted"
        );
        assert!(
            peak.abs_diff(*bpeak) < peak / 100,
            "stage {s}: {peak} planned, {bpeak}"
        );
    }
    let even = stage_figures(&[6, 6], &cal);
    assert!(
        (even[0].0 - b.even_s[0]).abs() < 0.01 * even[0].0,
        "{even:?} {b:?}"
    );
    // A budget between the even cut's first stage and this cut's.
    let budget = (even[0].1 + real[0].1) / 2;
    let held = balanced(&spec, &cfg, &cal, Some(budget), 0, backend()).unwrap();
    assert!(held.counts[0] < b.counts[0], "{:?}", held.counts);
    assert!(held.counts[0] > 6, "{:?}", held.counts);
    for (s, (_, peak)) in stage_figures(&held.counts, &cal).iter().enumerate() {
        assert!(
            *peak <= budget,
            "stage {s} of {:?}: {peak} > {budget}",
            held.counts
        );
    }
}

/// `plan --ranks N`'s figures follow the cut: each rank lists its stage's layers, and 9,3
/// moves three blocks' parameters from the last stage to the first.
#[test]
fn every_rank_plan_reflects_the_cut() {
    use memwall::plan::ranks::every_rank;
    let (spec, even) = gpt2_stages(0);
    let cut = StepConfig {
        stage_layers: vec![9, 3],
        ..even.clone()
    };
    let (a, b) = (
        every_rank(&spec, &even, backend(), 0).unwrap(),
        every_rank(&spec, &cut, backend(), 0).unwrap(),
    );
    assert_eq!((a[0].layers.clone(), a[1].layers.clone()), (0..6, 6..12));
    assert_eq!((b[0].layers.clone(), b[1].layers.clone()), (0..9, 9..12));
    let whole = ParamLayout::new(&spec);
    let block: usize = (whole.tensors.iter())
        .filter(|t| block_of(&t.name) == Some(0))
        .map(|t| t.range.len())
        .sum();
    assert!(block > 0);
    assert_eq!(b[0].num_params, a[0].num_params + 3 * block);
    assert_eq!(b[1].num_params + 3 * block, a[1].num_params);
    assert!(b[0].predicted_peak_rss_bytes > a[0].predicted_peak_rss_bytes);
    assert!(b[1].predicted_peak_rss_bytes < a[1].predicted_peak_rss_bytes);
}

/// The interleaved schedule (`--pp-chunks V`): each stage holds V runs of layers, a
/// micro-batch passing every stage V times (the last stage sending on to the first), and
/// the stages train as one process does: GPT-2 under every recomputation policy, Llama with
/// its tied head on both ends, an untied Llama of 7 layers in 3 × 2 uneven runs, with tensor
/// and data ranks (ZeRO 1) beside the stages, and LoRA with dropout (each stage drawing the
/// masks of its runs' adapters as one process does).
#[test]
fn interleaved_stages_train_like_one_process() {
    let (none, dp) = (Recompute::None, Zero::DP);
    let gpt2 = preset("gpt2-tiny");
    for re in [Recompute::None, Recompute::Selective, Recompute::Full] {
        matches_one_process_with((&gpt2, None, F32), (1, 1, 2, dp), interleaved(2), 4, re);
    }
    let llama = preset("llama-tiny");
    matches_one_process_with((&llama, None, F32), (1, 1, 2, dp), interleaved(2), 2, none);
    let seven = ModelSpec {
        n_layer: 7,
        tied_embeddings: false,
        ..preset("llama-tiny")
    };
    matches_one_process_with((&seven, None, F32), (1, 1, 3, dp), interleaved(2), 3, none);
    matches_one_process_with(
        (&llama, None, F32),
        (2, 2, 2, Zero(1)),
        interleaved(2),
        2,
        none,
    );
    let lora = adapters_everywhere(2, 0.1, Family::Gpt2);
    let l = Some(&lora);
    let re = Recompute::Selective;
    matches_one_process_with((&gpt2, l, F32), (1, 1, 2, dp), interleaved(2), 2, re);
}

/// Interleaved, a stage holds its warm-up's runs of activations and one more (stage r of p:
/// 2(p − r − 1) + (V − 1)p + 1 runs, each of 1/V of its layers) where 1F1B holds p − r
/// micro-batches of all its layers: with p = 2, V = 2, m = 4, stage 0 holds 5 half-stage
/// runs (1.25 × 1F1B's 2 micro-batches) and stage 1 holds 3 (1.5 × 1F1B's one). Both idle
/// less of the step by the time model ((p − 1)/(V·m) of the work, not (p − 1)/m).
#[test]
fn interleaved_stages_hold_their_warm_up_and_idle_less() {
    use memwall::ir::Category;
    let mut spec = preset("llama-tiny");
    spec.tied_embeddings = false;
    let plan = |rank: usize, chunks: usize| {
        let mut cfg = StepConfig::new(B, SEQ, 1);
        cfg.mesh = Mesh::new(2, 1, 2, rank);
        cfg.grad_accum = 4;
        cfg.pipeline_chunks = chunks;
        build_plan(&spec, &cfg, Mode::Train, backend()).unwrap()
    };
    let acts = |rank: usize, chunks: usize| {
        let p = plan(rank, chunks);
        let by = p.peak_by_category();
        by.iter()
            .find(|(c, _)| *c == Category::Activation)
            .map_or(0, |(_, b)| *b) as f64
    };
    for (rank, want) in [(0, 1.25), (1, 1.5)] {
        let (one, two) = (acts(rank, 1), acts(rank, 2));
        let ratio = two / one;
        assert!(
            (ratio - want).abs() < 0.05 * want,
            "stage {rank}: {one} bytes under 1F1B, {two} interleaved: {ratio:.3}x, not {want}x"
        );
    }
    let cal = Calibration::estimate("test cpu".into(), 1, 100.0);
    let bubble = |chunks| memwall::plan::time::predict(&plan(0, chunks), &cal).bubble_s;
    let (one, two) = (bubble(1), bubble(2));
    assert!(
        two < 0.6 * one,
        "bubble {one} s under 1F1B, {two} s interleaved"
    );
}

/// `--pp-chunks` without stages, with more runs than layers, with `--pp-layers`, or with a
/// step's micro-batches not in groups of the stages: each refused naming the flags.
#[test]
fn a_bad_interleaving_is_refused_naming_the_flags() {
    let mut spec = preset("llama-tiny");
    spec.tied_embeddings = false;
    let refused = |p: usize, chunks: usize, micro: usize, cut: &[usize]| {
        let mut cfg = StepConfig::new(1, SEQ, 1);
        cfg.mesh = Mesh::new(p, 1, p, 0);
        cfg.pipeline_chunks = chunks;
        cfg.grad_accum = micro;
        cfg.stage_layers = cut.to_vec();
        let e = build_plan(&spec, &cfg, Mode::Train, backend()).err();
        format!("{:#}", e.expect("refused"))
    };
    let msg = refused(2, 0, 2, &[]);
    assert!(msg.contains("--pp-chunks must be at least 1"), "{msg}");
    let msg = refused(1, 2, 2, &[]);
    assert!(
        msg.contains("--pp-chunks 2") && msg.contains("--pp 2"),
        "{msg}"
    );
    let msg = refused(2, 3, 2, &[]);
    assert!(msg.contains("6 runs") && msg.contains("4 layers"), "{msg}");
    assert!(msg.contains("--pp-chunks 2 or less"), "{msg}");
    let msg = refused(2, 2, 2, &[3, 1]);
    assert!(msg.contains("--pp-layers"), "{msg}");
    let msg = refused(2, 2, 3, &[]);
    assert!(msg.contains("3") && msg.contains("multiple of 2"), "{msg}");
}

/// Every rank of a mesh offloads its own state (`--offload`: parameters, gradients, moments
/// and activations on the disk tier, one file per rank in the directory they share) and the
/// ranks train as one process does: data ranks at every ZeRO stage, tensor ranks, stages,
/// and all three together.
#[test]
fn ranks_that_offload_train_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let off = Cut {
        offload: Some((OffloadSet::ALL, dir.path())),
        ..EVEN
    };
    let (gpt2, llama) = (preset("gpt2-tiny"), preset("llama-tiny"));
    let none = Recompute::None;
    for zero in [Zero::DP, Zero(1), Zero(2), Zero(3)] {
        matches_one_process_with((&gpt2, None, F32), (2, 1, 1, zero), off, 2, none);
    }
    matches_one_process_with((&llama, None, F32), (1, 2, 1, Zero::DP), off, 2, none);
    matches_one_process_with((&gpt2, None, F32), (1, 1, 2, Zero::DP), off, 4, none);
    let selective = Recompute::Selective;
    matches_one_process_with((&llama, None, F32), (2, 2, 2, Zero(1)), off, 2, selective);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(
        left.is_empty(),
        "the ranks' offload files are scratch: {left:?}"
    );
}
