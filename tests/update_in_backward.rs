//! `--update in-backward` against its promises: each group's AdamW step inside the backward
//! trains bitwise as the update after the backward does (without clipping, which it
//! refuses), for a
//! tied GPT-2 (learned positions), an untied Llama and a tied one, under the strategies it
//! composes with; its plans hold far fewer gradient bytes; what it does not compose with is
//! refused, naming the flags.

use memwall::backend::under_test as backend;
use memwall::exec::executor::{Executor, OptimHparams};
use memwall::ir::schedule::Op;
use memwall::ir::{Category, OptimState, Precision, Recompute, Update};
use memwall::model::ModelSpec;
use memwall::plan::{Mode, StepConfig, build_plan};
use memwall::util::rng::Rng;

/// GPT-2 of four blocks: a tied head and learned positions (in the embedding's group).
fn gpt2() -> ModelSpec {
    memwall::model::gpt2::spec("small", [97, 32, 32, 4, 4])
}

/// A small Llama (grouped-query attention), its head untied or tied.
fn llama(tied: bool) -> ModelSpec {
    let mut s = ModelSpec::preset("llama-tiny").unwrap();
    s.name = format!("small-llama-{}", if tied { "tied" } else { "untied" });
    (s.vocab_size, s.n_positions, s.n_embd, s.n_layer) = (97, 32, 32, 4);
    (s.n_head, s.n_kv_head, s.head_dim, s.mlp_hidden) = (4, 2, 8, 48);
    s.tied_embeddings = tied;
    s.validate().unwrap();
    s
}

fn hp(step: u64) -> OptimHparams {
    OptimHparams {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        grad_clip: 0.0,
        step,
    }
}

/// Trains `steps` steps of `cfg` on learnable sequences (x[t+1] = 3·x[t] + 1 mod V);
/// returns the weights, the losses and the gradient norms.
fn train(spec: &ModelSpec, cfg: &StepConfig, steps: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let plan = build_plan(spec, cfg, Mode::Train, backend()).unwrap();
    let mut ex = Executor::on(plan, backend()).unwrap();
    let layout = ex.plan.layout.clone();
    ex.with_params_mut(|p| layout.init(p, 7)).unwrap();
    let mut rng = Rng::new(3);
    let rows = cfg.batch * cfg.grad_accum;
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 1..=steps {
        let v = spec.vocab_size as u32;
        let mut batch = Vec::with_capacity(rows * (cfg.seq + 1));
        for _ in 0..rows {
            let mut x = rng.below(v as u64) as u32;
            for _ in 0..=cfg.seq {
                batch.push(x);
                x = (3 * x + 1) % v;
            }
        }
        ex.upload_batch(&batch).unwrap();
        let st = ex.train_step(&hp(step)).unwrap();
        losses.push(st.loss);
        norms.push(st.grad_norm);
    }
    (ex.download_params().unwrap(), losses, norms)
}

/// The configurations checked: fp32 with each recompute policy, bf16, int8 moments,
/// accumulation (no sliced head then); each with a head cut into several slices (a small
/// logits chunk) and in one.
fn configs() -> Vec<(String, StepConfig)> {
    let base = StepConfig::new(2, 16, 2);
    let mut out = Vec::new();
    for (what, cfg) in [
        ("fp32", base.clone()),
        (
            "full recompute",
            StepConfig {
                recompute: Recompute::Full,
                ..base.clone()
            },
        ),
        (
            "bf16",
            StepConfig {
                precision: Precision::Bf16,
                ..base.clone()
            },
        ),
        (
            "int8 moments",
            StepConfig {
                optim_state: OptimState::Int8,
                ..base.clone()
            },
        ),
        (
            "2 micro-batches",
            StepConfig {
                grad_accum: 2,
                ..base.clone()
            },
        ),
    ] {
        // 64 words of 32 f32 a slice: 97 words in two slices (one partial); or in one.
        for chunk in [64 * 32 * 4, 64 << 20] {
            let cfg = StepConfig {
                logits_chunk_bytes: chunk,
                ..cfg.clone()
            };
            out.push((format!("{what}, logits chunk {chunk} B"), cfg));
        }
    }
    out
}

#[test]
fn the_update_inside_the_backward_trains_as_the_update_at_the_end() {
    for spec in [gpt2(), llama(false), llama(true)] {
        for (what, end) in configs() {
            let name = format!("{} {what}", spec.name);
            let inside = StepConfig {
                update: Update::InBackward,
                ..end.clone()
            };
            // The plan really moves the updates into the backward.
            let plan = build_plan(&spec, &inside, Mode::Train, backend()).unwrap();
            let ops = &plan.schedule.ops;
            let first_update = ops.iter().position(|e| matches!(e.op, Op::AdamW { .. }));
            let last_backward = ops
                .iter()
                .rposition(|e| matches!(e.op, Op::MatmulBackward { .. }));
            assert!(
                first_update < last_backward,
                "{name}: no update runs inside the backward"
            );
            let sliced = ops
                .iter()
                .filter(|e| matches!(e.op, Op::LmHeadWeightGrad { .. }))
                .count();
            let want_slices = match (end.grad_accum, end.logits_chunk_bytes) {
                (2, _) => 0,
                (_, c) if c < 1 << 20 => 2,
                _ => 1,
            };
            assert_eq!(sliced, want_slices, "{name}: head slices");
            let (want, want_losses, want_norms) = train(&spec, &end, 12);
            let (got, losses, norms) = train(&spec, &inside, 12);
            assert!(
                want_losses[11] < want_losses[0],
                "{name}: the model must learn: {want_losses:?}"
            );
            // The same ops on the same values: the same bits.
            assert_eq!(losses, want_losses, "{name}: losses");
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{name}: weights are not bitwise those of --update end"
            );
            // The norm's shares are the slices' (summed in f64 in another grouping).
            for (a, b) in norms.iter().zip(&want_norms) {
                assert!((a - b).abs() <= 1e-6 * b, "{name}: norm {a} against {b}");
            }
        }
    }
}

/// Bytes of gradients the plan holds at its peak, by category.
fn grad_peak(spec: &ModelSpec, cfg: &StepConfig) -> u64 {
    let plan = build_plan(spec, cfg, Mode::Train, backend()).unwrap();
    plan.peak_by_category()
        .into_iter()
        .find(|(c, _)| *c == Category::Grad)
        .unwrap()
        .1
}

#[test]
fn a_step_holds_a_group_of_gradients_and_a_slice_of_the_head() {
    // Qwen3 0.6B's shape, 4 × 256, full recompute: the whole model's gradients (2.2 GiB,
    // 0.58 of it the tied embedding's) against one block's and one slice's.
    let spec = ModelSpec::preset("qwen3-0.6b").unwrap();
    let end = StepConfig {
        recompute: Recompute::Full,
        ..StepConfig::new(4, 256, 2)
    };
    let inside = StepConfig {
        update: Update::InBackward,
        ..end.clone()
    };
    let params = spec.num_params() as u64;
    let (all, some) = (grad_peak(&spec, &end), grad_peak(&spec, &inside));
    assert_eq!(
        all,
        4 * params,
        "at the end of the backward, every gradient"
    );
    // A block's gradients (15.7M parameters) or a slice's (64 MiB by default), and the
    // final norm's.
    let block = 4 * 15_730_944;
    let slice = end.logits_chunk_bytes;
    assert!(
        some <= block.max(slice) + 4 * 1024 + 4096,
        "in the backward, {some} B of gradients"
    );
    let (p_end, p_in) = (
        build_plan(&spec, &end, Mode::Train, backend()).unwrap(),
        build_plan(&spec, &inside, Mode::Train, backend()).unwrap(),
    );
    assert!(
        p_end.predicted_peak(0) - p_in.predicted_peak(0) > 2 << 30,
        "the peak falls by the gradients: {} against {}",
        p_in.predicted_peak(0),
        p_end.predicted_peak(0)
    );
}

#[test]
fn what_it_does_not_compose_with_is_refused_naming_the_flags() {
    let spec = llama(true);
    let inside = StepConfig {
        update: Update::InBackward,
        ..StepConfig::new(2, 16, 2)
    };
    let err = |cfg: StepConfig| {
        format!(
            "{:#}",
            build_plan(&spec, &cfg, Mode::Train, backend()).unwrap_err()
        )
    };
    let e = err(StepConfig {
        precision: Precision::F16,
        ..inside.clone()
    });
    assert!(
        e.contains("--update in-backward") && e.contains("fp16"),
        "{e}"
    );
    let mut offload = inside.clone();
    offload.offload.set.optimizer = true;
    offload.offload.dir = Some(std::env::temp_dir());
    let e = err(offload);
    assert!(
        e.contains("--update in-backward") && e.contains("--offload"),
        "{e}"
    );
    let mut ranks = inside.clone();
    ranks.mesh = memwall::ir::Mesh::new(2, 1, 1, 0);
    let e = err(ranks);
    assert!(e.contains("one process"), "{e}");
    // A plan over its budget is told what would fit, offload only with the update after
    // the backward.
    let plan = build_plan(&spec, &inside, Mode::Train, backend()).unwrap();
    let e = format!(
        "{:#}",
        memwall::plan::fit::check_budget(&plan, 1 << 20, 0, backend()).unwrap_err()
    );
    assert!(e.contains("--update end --offload all"), "{e}");
    // Clipping by the global norm needs every gradient first.
    let mut ex = Executor::on(plan, backend()).unwrap();
    let layout = ex.plan.layout.clone();
    ex.with_params_mut(|p| layout.init(p, 7)).unwrap();
    ex.upload_batch(&[1u32; 2 * 17]).unwrap();
    let e = format!(
        "{:#}",
        ex.train_step(&OptimHparams {
            grad_clip: 1.0,
            ..hp(1)
        })
        .unwrap_err()
    );
    assert!(e.contains("--grad-clip 0"), "{e}");
    // Its gradients do not outlive the backward: there are none to read after it.
    assert!(ex.compute_gradients().is_err());
    // Gradients that are not finite stop the run (part of the update is applied): an
    // error, where the update after the backward would skip the step.
    ex.with_params_mut(|p| p[0] = f32::NAN).unwrap();
    let e = format!("{:#}", ex.train_step(&hp(1)).unwrap_err());
    assert!(
        e.contains("not finite") && e.contains("--update end"),
        "{e}"
    );
}
