//! End-to-end training tests: gradients of the whole model against finite differences,
//! learning on real text, bitwise resume, and the plan against measured memory.

mod common;

use memwall::backend::under_test as backend;
use memwall::exec::executor::{Executor, OptimHparams};
use memwall::exec::train::{NoProgress, TrainOptions, resume_options, train};
use memwall::ir::{OptimState, Precision, Recompute, RecomputeChoice};
use memwall::model::ModelSpec;
use memwall::plan::{Mode, StepConfig, build_plan};
use memwall::util::rng::Rng;

fn micro_spec() -> ModelSpec {
    memwall::model::gpt2::spec("micro", [61, 16, 16, 2, 2])
}

/// Executor for the micro model with random batch and params drawn with a larger spread, so
/// every gradient is well above f32 noise.
fn micro_executor(threads: usize) -> Executor {
    let spec = micro_spec();
    let plan = build_plan(
        &spec,
        &StepConfig::new(3, 7, threads),
        Mode::Train,
        backend(),
    )
    .unwrap();
    let mut ex = Executor::on(plan, backend()).unwrap();
    let mut rng = Rng::new(11);
    let layout = ex.plan.layout.clone();
    ex.with_params_mut(|p| {
        layout.init(p, 5);
        for x in p.iter_mut() {
            *x += 0.1 * rng.normal();
        }
    })
    .unwrap();
    let batch: Vec<u32> = (0..3 * 8).map(|_| rng.below(61) as u32).collect();
    ex.upload_batch(&batch).unwrap();
    ex
}

#[test]
fn whole_model_gradients_match_finite_differences() {
    let mut ex = micro_executor(2);
    let loss = ex.compute_gradients().unwrap();
    assert!(loss.is_finite());
    let g: Vec<f32> = ex.download_grads().unwrap();
    let p0: Vec<f32> = ex.download_params().unwrap();
    let mut rng = Rng::new(99);
    // Directional derivatives along random directions (all parameters at once).
    for _ in 0..3 {
        let d: Vec<f32> = (0..p0.len()).map(|_| rng.normal()).collect();
        let eps = 1e-3f32;
        let eval = |ex: &mut Executor, s: f32| {
            ex.with_params_mut(|p| {
                for ((p, &q), &di) in p.iter_mut().zip(&p0).zip(&d) {
                    *p = q + s * di;
                }
            })
            .unwrap();
            ex.eval_loss().unwrap() as f64
        };
        let fd = (eval(&mut ex, eps) - eval(&mut ex, -eps)) / (2.0 * eps as f64);
        let an: f64 = g.iter().zip(&d).map(|(&a, &b)| a as f64 * b as f64).sum();
        assert!(
            (fd - an).abs() <= 2e-2 * an.abs().max(fd.abs()) + 1e-3,
            "directional derivative: analytic {an} vs finite difference {fd}"
        );
    }
    // The largest-gradient element of every tensor.
    let layout = ex.plan.layout.clone();
    for t in &layout.tensors {
        let i = t
            .range
            .clone()
            .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
            .unwrap();
        let eps = 2e-3f32;
        let mut at = |s: f32| {
            ex.with_params_mut(|p| {
                p.copy_from_slice(&p0);
                p[i] += s;
            })
            .unwrap();
            ex.eval_loss().unwrap() as f64
        };
        let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
        let an = g[i] as f64;
        assert!(
            (fd - an).abs() <= 3e-2 * an.abs().max(fd.abs()) + 2e-3,
            "{}[{}]: analytic {an} vs finite difference {fd}",
            t.name,
            i - t.range.start
        );
    }
}

#[test]
fn training_is_deterministic_for_a_thread_count() {
    let initial = micro_executor(2).download_params().unwrap();
    let run = || {
        let mut ex = micro_executor(2);
        let hp = OptimHparams {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            step: 1,
        };
        for s in 1..=3 {
            ex.train_step(&OptimHparams {
                step: s,
                ..hp.clone()
            })
            .unwrap();
        }
        ex.download_params().unwrap()
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    // Equal because the steps are deterministic, not because they did nothing: every
    // tensor moved (each has weight decay or a gradient) by more than rounding.
    let layout = micro_executor(2).plan.layout.clone();
    for t in &layout.tensors {
        let r = t.range.clone();
        let moved = a[r.clone()]
            .iter()
            .zip(&initial[r.clone()])
            .filter(|(x, y)| x != y)
            .count();
        assert!(
            moved * 2 > r.len(),
            "{}: only {moved} of {} values changed in 3 steps",
            t.name,
            r.len()
        );
    }
}

/// Real text: gpt2-tiny on three Shakespeare plays must beat a stated validation loss.
/// (Initial loss is ln(50257) ≈ 10.8; measured here: 5.53 after 150 steps of 8×64.)
#[test]
fn tiny_gpt_learns_shakespeare() {
    common::shakespeare_required();
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let mut o = TrainOptions::new("gpt2-tiny", &data, &tmp.path().join("run"));
    o.steps = 150;
    o.batch = 8;
    o.seq = 64;
    o.lr = 2e-3;
    o.warmup = 15;
    o.threads = 2;
    o.eval_every = 0;
    o.save_every = 0;
    o.eval_batches = 16;
    let s = train(&o, None, &mut NoProgress).unwrap();
    let val = s.final_val_loss.unwrap();
    eprintln!(
        "gpt2-tiny, 150 steps of 8x64: train loss {:.3}, val loss {val:.3}",
        s.final_loss
    );
    assert!(
        val < 5.9,
        "validation loss {val} after 150 steps; expected below 5.9"
    );
    // metrics.jsonl has one object per step with the documented fields.
    let metrics = std::fs::read_to_string(tmp.path().join("run/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 150);
    for k in ["step", "loss", "lr", "tokens_per_s", "rss_bytes"] {
        assert!(lines[0].get(k).is_some(), "metrics.jsonl lacks {k}");
    }
    assert!(lines[149]["val_loss"].as_f64().is_some());
}

#[test]
fn resume_continues_bitwise() {
    // Every optimizer-state format (its bytes are saved as stored), with strategies on.
    // fp16 resumes its loss scale too.
    for (state, accum, recompute, precision) in [
        (OptimState::F32, 1, Recompute::None, Precision::F32),
        (OptimState::Bf16, 2, Recompute::Selective, Precision::Bf16),
        (OptimState::Int8, 1, Recompute::Full, Precision::F16),
    ] {
        resume_bitwise(state, accum, recompute, precision);
    }
}

fn resume_bitwise(state: OptimState, accum: usize, recompute: Recompute, precision: Precision) {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let cfg = common::micro_config(tmp.path());
    let mut o = TrainOptions::new(cfg.to_str().unwrap(), &data, &tmp.path().join("full"));
    o.strategies.optim_state = state;
    o.strategies.precision = precision;
    o.strategies.grad_accum = accum;
    o.strategies.recompute = RecomputeChoice::Fixed(recompute);
    o.steps = 8;
    o.batch = 2;
    o.seq = 32;
    o.threads = 2;
    o.save_every = 4;
    o.eval_every = 4;
    o.warmup = 2;
    train(&o, None, &mut NoProgress).unwrap();
    // An interrupted twin: same run stopped after step 4 (its step-8 checkpoint removed).
    let cut = tmp.path().join("cut");
    std::fs::create_dir_all(cut.join("checkpoints")).unwrap();
    let src = tmp.path().join("full/checkpoints/step-000004");
    let dst = cut.join("checkpoints/step-000004");
    std::fs::create_dir_all(&dst).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dst.join(f.file_name())).unwrap();
    }
    let (opts, ck) = resume_options(&cut).unwrap();
    assert_eq!(opts.steps, 8);
    let s = train(&opts, Some(&ck), &mut NoProgress).unwrap();
    assert_eq!((s.first_step, s.last_step), (4, 8));
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(tmp.path().join("full/checkpoints/step-000008").join(f)).unwrap();
        let b = std::fs::read(cut.join("checkpoints/step-000008").join(f)).unwrap();
        assert!(
            a == b,
            "{state}: {f} differs between the resumed and the uninterrupted run"
        );
    }
}
