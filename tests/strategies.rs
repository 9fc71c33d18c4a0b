//! Memory strategies against their promises: recomputation changes memory but not one bit of
//! the weights; gradient accumulation trains like the larger batch; compressed optimizer
//! state and mixed precision train close to fp32. Each for a small GPT-2 and a small Llama
//! (grouped-query attention, rotary positions, SwiGLU).

use memwall::backend::under_test as backend;
use memwall::exec::executor::{Executor, OptimHparams};
use memwall::ir::{Category, OptimState, Phase, Precision, Recompute};
use memwall::model::ModelSpec;
use memwall::plan::{Mode, StepConfig, build_plan};
use memwall::util::rng::Rng;

mod common;

/// Four blocks, so that every:2 and every:3 differ from both none and full.
fn small_spec() -> ModelSpec {
    memwall::model::gpt2::spec("small", [97, 32, 32, 4, 4])
}

/// A Llama of the same size: 4 query heads sharing 2 key/value heads, untied head.
fn small_llama() -> ModelSpec {
    let mut s = ModelSpec::preset("llama-tiny").unwrap();
    s.name = "small-llama".into();
    (s.vocab_size, s.n_positions, s.n_embd, s.n_layer) = (97, 32, 32, 4);
    (s.n_head, s.n_kv_head, s.head_dim, s.mlp_hidden) = (4, 2, 8, 48);
    s.tied_embeddings = false;
    s.validate().unwrap();
    s
}

/// The models every strategy is checked on.
fn specs() -> [ModelSpec; 2] {
    [small_spec(), small_llama()]
}

fn hp(step: u64) -> OptimHparams {
    OptimHparams {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        grad_clip: 1.0,
        step,
    }
}

/// Trains `steps` steps of `cfg` on learnable sequences (x[t+1] = 3·x[t] + 1 mod V from random
/// starts) drawn from one seed, so step k sees the same `rows` sequences whatever the
/// micro-batching; returns the weights and the losses.
fn train(spec: &ModelSpec, cfg: &StepConfig, steps: u64) -> (Vec<f32>, Vec<f32>) {
    let plan = build_plan(spec, cfg, Mode::Train, backend()).unwrap();
    let mut ex = Executor::on(plan, backend()).unwrap();
    let layout = ex.plan.layout.clone();
    ex.with_params_mut(|p| layout.init(p, 7)).unwrap();
    let mut rng = Rng::new(3);
    let rows = cfg.batch * cfg.grad_accum;
    let mut losses = Vec::new();
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
        losses.push(ex.train_step(&hp(step)).unwrap().loss);
    }
    ex.finish_update().unwrap();
    (ex.download_params().unwrap(), losses)
}

fn activation_peak(spec: &ModelSpec, cfg: &StepConfig) -> u64 {
    let plan = build_plan(spec, cfg, Mode::Train, backend()).unwrap();
    plan.peak_by_category()
        .into_iter()
        .find(|(c, _)| *c == Category::Activation)
        .unwrap()
        .1
}

#[test]
fn every_recompute_policy_gives_bitwise_identical_weights() {
    for spec in specs() {
        let name = &spec.name;
        let base = StepConfig::new(2, 16, 2);
        let (want, want_losses) = train(&spec, &base, 20);
        assert!(
            want_losses[19] < 0.9 * want_losses[0],
            "{name}: the model must learn: {want_losses:?}"
        );
        let none_peak = activation_peak(&spec, &base);
        for r in [
            Recompute::Selective,
            Recompute::Full,
            Recompute::Every(2),
            Recompute::Every(3),
        ] {
            let cfg = StepConfig {
                recompute: r,
                ..base.clone()
            };
            // The plan really recomputes, and keeps fewer activation bytes.
            let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
            let re_ops = plan
                .schedule
                .ops
                .iter()
                .filter(|o| o.phase == Phase::Recompute)
                .count();
            assert!(re_ops > 0, "{name} {r}: no recompute ops");
            assert!(
                activation_peak(&spec, &cfg) < none_peak,
                "{name} {r}: no memory saved"
            );
            let (got, losses) = train(&spec, &cfg, 20);
            assert_eq!(losses, want_losses, "{name} {r}: losses differ");
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{name} {r}: weights are not bitwise identical to none"
            );
        }
    }
}

#[test]
fn gradient_accumulation_matches_the_larger_batch() {
    for spec in specs() {
        let name = &spec.name;
        let big = StepConfig::new(8, 16, 2);
        let accum = StepConfig {
            grad_accum: 2,
            ..StepConfig::new(4, 16, 2)
        };
        let (a, la) = train(&spec, &big, 20);
        let (b, lb) = train(&spec, &accum, 20);
        let norm = |x: &[f32]| x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        let diff: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
        let rel = norm(&diff) / norm(&a);
        eprintln!(
            "{name}: batch 8 vs 4 x accum 2: relative weight difference {rel:.3e}; losses {la:?} vs {lb:?}"
        );
        assert!(rel <= 1e-5, "{name}: relative weight difference {rel:e}");
        // Two micro-batches sum their gradients in another order than one batch of 8: the
        // weights must differ in rounding, or the accumulated run did not run as micro-batches.
        assert!(
            diff.iter().any(|&d| d != 0.0),
            "{name}: weights bitwise identical to the batch-8 run: the micro-batches were not accumulated"
        );
        for (step, (x, y)) in la.iter().zip(&lb).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * x.abs(),
                "{name} step {}: loss {x} (batch 8) vs {y} (4 x accum 2)",
                step + 1
            );
        }
        // The micro-batched plan holds activations for 4 sequences, not 8.
        assert!(activation_peak(&spec, &accum) < activation_peak(&spec, &big));
    }
}

#[test]
fn activation_bytes_shrink_sixfold_with_full_recompute_on_gpt2() {
    let spec = ModelSpec::preset("gpt2").unwrap();
    let act = |r: Recompute| {
        let cfg = StepConfig {
            recompute: r,
            ..StepConfig::new(8, 512, 2)
        };
        let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
        plan.peak_by_category()
            .into_iter()
            .find(|(c, _)| *c == Category::Activation)
            .unwrap()
            .1 as f64
    };
    let (none, sel, full) = (
        act(Recompute::None),
        act(Recompute::Selective),
        act(Recompute::Full),
    );
    eprintln!(
        "gpt2 8x512 activation bytes: none {none}, selective {sel} ({:.3}), full {full} ({:.3})",
        sel / none,
        full / none
    );
    assert!(full <= none / 6.0);
    assert!(sel < none && full < sel);
}

#[test]
fn compressed_optimizer_state_shrinks_its_category() {
    let spec = ModelSpec::preset("gpt2").unwrap();
    let state_bytes = |f: OptimState| {
        let cfg = StepConfig {
            optim_state: f,
            ..StepConfig::new(4, 256, 2)
        };
        let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
        plan.bytes_by_category()
            .into_iter()
            .find(|(c, _)| *c == Category::OptimizerState)
            .unwrap()
            .1 as f64
    };
    let fp32 = state_bytes(OptimState::F32);
    assert_eq!(fp32, 8.0 * 124_439_808.0);
    let (bf16, int8) = (state_bytes(OptimState::Bf16), state_bytes(OptimState::Int8));
    eprintln!(
        "optimizer state: fp32 {fp32}, bf16 {bf16} ({:.3}), int8 {int8} ({:.4})",
        bf16 / fp32,
        int8 / fp32
    );
    assert_eq!(bf16, fp32 / 2.0);
    assert!(int8 <= 0.27 * fp32);
}

#[test]
fn compressed_optimizer_state_trains_close_to_fp32() {
    for spec in specs() {
        let name = &spec.name;
        let run = |f: OptimState| {
            let cfg = StepConfig {
                optim_state: f,
                ..StepConfig::new(4, 16, 2)
            };
            train(&spec, &cfg, 30).1
        };
        let fp32 = run(OptimState::F32);
        for f in [OptimState::Bf16, OptimState::Int8] {
            let l = run(f);
            let (a, b) = (fp32[29], l[29]);
            eprintln!("{name} {f}: final loss {b} vs fp32 {a}");
            assert!(b < 0.8 * l[0], "{name} {f} must learn: {l:?}");
            assert!((b - a).abs() <= 0.05 * a, "{name} {f}: {b} vs fp32 {a}");
        }
    }
}

#[test]
fn mixed_precision_trains_close_to_fp32() {
    for spec in specs() {
        let name = &spec.name;
        let run = |p: Precision| {
            let cfg = StepConfig {
                precision: p,
                ..StepConfig::new(4, 16, 2)
            };
            train(&spec, &cfg, 30).1
        };
        let fp32 = run(Precision::F32);
        for p in [Precision::Bf16, Precision::F16] {
            let l = run(p);
            let (a, b) = (fp32[29], l[29]);
            eprintln!("{name} {p}: final loss {b} vs fp32 {a}");
            assert!(b < 0.8 * l[0], "{name} {p} must learn: {l:?}");
            assert!((b - a).abs() <= 0.05 * a, "{name} {p}: {b} vs fp32 {a}");
            assert!(
                l != fp32,
                "{name} {p} computed exactly like fp32: not mixed precision"
            );
        }
    }
}

#[test]
fn overflowing_gradients_skip_the_update() {
    let spec = small_spec();
    let cfg = StepConfig {
        precision: Precision::F16,
        ..StepConfig::new(2, 16, 2)
    };
    let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
    let mut ex = Executor::on(plan, backend()).unwrap();
    let layout = ex.plan.layout.clone();
    ex.with_params_mut(|p| layout.init(p, 7)).unwrap();
    let batch: Vec<u32> = (0..2 * 17).map(|i| (i * 5 % 97) as u32).collect();
    ex.upload_batch(&batch).unwrap();
    let before = ex.download_params().unwrap();
    // A loss scale far beyond f16's range: the gradients overflow, the step is skipped.
    ex.set_loss_scale(1e30);
    let st = ex.train_step(&hp(1)).unwrap();
    assert!(st.skipped && !st.grad_norm.is_finite(), "{st:?}");
    assert_eq!(
        ex.download_params().unwrap(),
        before,
        "a skipped step must not move the weights"
    );
    // A sane scale: the step runs and the weights move.
    ex.set_loss_scale(1024.0);
    let st = ex.train_step(&hp(1)).unwrap();
    assert!(!st.skipped && st.grad_norm.is_finite(), "{st:?}");
    assert_ne!(ex.download_params().unwrap(), before);
}

#[test]
fn mixed_precision_plans_halve_activations_and_keep_fp32_masters() {
    let spec = ModelSpec::preset("gpt2").unwrap();
    let plan = |p: Precision| {
        let cfg = StepConfig {
            precision: p,
            ..StepConfig::new(4, 256, 2)
        };
        build_plan(&spec, &cfg, Mode::Train, backend()).unwrap()
    };
    let (f, b) = (plan(Precision::F32), plan(Precision::Bf16));
    let cat = |p: &memwall::plan::Plan, c: Category| {
        p.peak_by_category()
            .into_iter()
            .find(|x| x.0 == c)
            .unwrap()
            .1
    };
    let n = 124_439_808u64;
    // Kernels read the fp32 masters (converting per tile): no bf16 copy of the weights.
    assert_eq!(cat(&b, Category::Master), 4 * n);
    assert_eq!(cat(&b, Category::Param), 0);
    assert_eq!(cat(&b, Category::Grad), 2 * n);
    assert_eq!(cat(&b, Category::OptimizerState), 8 * n);
    assert_eq!(cat(&f, Category::Master), 0);
    assert_eq!(cat(&f, Category::Param), 4 * n);
    // bf16 at 4 x 256 fits the 2.2 GB the issue asks of GPT-2 124M.
    assert!(b.total_bytes() < 2_200_000_000, "{}", b.total_bytes());
    let (fa, ba) = (
        cat(&f, Category::Activation) as f64,
        cat(&b, Category::Activation) as f64,
    );
    eprintln!(
        "activations fp32 {fa}, bf16 {ba}; totals {} vs {}",
        f.total_bytes(),
        b.total_bytes()
    );
    // Layernorm statistics and attention lse stay f32: a little over half.
    assert!(ba < 0.55 * fa && ba > 0.45 * fa);
}

/// Final train loss of `memwall train` on `data` in bf16 with `MEMWALL_BF16_DOT=dot`.
fn bf16_run_loss(dir: &std::path::Path, data: &std::path::Path, dot: &str) -> (f64, f64) {
    let cfg = common::micro_config(dir);
    let out = dir.join(format!("run-{dot}"));
    let args = common::train_args(
        &cfg,
        data,
        &out,
        &[
            "--steps",
            "40",
            "--batch",
            "4",
            "--seq",
            "32",
            "--precision",
            "bf16",
            "--threads",
            "2",
            "--eval-every",
            "0",
            "--lr",
            "1e-2",
            "--warmup",
            "3",
        ],
    );
    let o = common::memwall_env(&[("MEMWALL_BF16_DOT", dot)], &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    // The step-0 line (validation loss before the first update) has no training loss.
    let losses: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
        .collect();
    (losses[0], *losses.last().unwrap())
}

#[test]
#[ignore = "needs AVX-512F/BW/VL: .ci/run runs it on CPUs that have them"]
fn bf16_dot_product_path_trains_like_the_widening_path() {
    // The vdpbf16ps path (emulated here when the CPU lacks AVX512_BF16) in a whole training
    // run: every matmul of the step on the dot-product kernel, f32 masters rounded to bf16
    // as they are packed. It must learn as the widening path does, not bit for bit.
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has = |f: &str| cpuinfo.split_whitespace().any(|w| w == f);
    assert!(
        has("avx512f") && has("avx512bw") && has("avx512vl"),
        "the emulated bf16 dot-product kernel needs AVX-512F, BW and VL, which this CPU lacks"
    );
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let (first_w, last_w) = bf16_run_loss(tmp.path(), &data, "off");
    let (first_d, last_d) = bf16_run_loss(tmp.path(), &data, "emulated");
    eprintln!("bf16 loss: widening {first_w} -> {last_w}, dot product {first_d} -> {last_d}");
    assert!(
        last_w < 0.9 * first_w && last_d < 0.9 * first_d,
        "both must learn"
    );
    assert!(
        (last_d - last_w).abs() <= 0.01 * last_w,
        "{last_d} vs {last_w}"
    );
    assert_ne!(last_d, last_w, "the dot-product path did not run");
}

/// The AdamW moments of a trained executor, as checkpoints see them (bytes per buffer).
fn moment_bytes(ex: &Executor) -> Vec<Vec<u8>> {
    use memwall::ir::Moments;
    fn raw<T: Copy>(x: &[T]) -> Vec<u8> {
        // SAFETY: plain element types; viewing their bytes.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
            .to_vec()
    }
    ex.with_moments(|m| match m {
        Moments::F32 { m, v } => vec![raw(m), raw(v)],
        Moments::Bf16 { m, v } => vec![raw(m), raw(v)],
        Moments::Int8 {
            m,
            v,
            m_absmax,
            v_absmax,
        } => vec![raw(m), raw(v), raw(m_absmax), raw(v_absmax)],
    })
    .unwrap()
}

/// The files of a checkpoint of `ex`, saved by [`Executor::save_checkpoint`] (streamed from
/// where the state lives, sharded small so that shards cut through parameter groups) under
/// `run`, after checking them byte for byte against those that `ckpt::save_checkpoint_with`
/// writes from the host copies of `with_params` and `with_moments`; `run` is removed.
fn checkpoint_files(ex: &Executor, run: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    use memwall::ckpt::{SaveOptions, TrainerState, save_checkpoint_with};
    let state = TrainerState {
        step: 2,
        data_position: 2,
        seed: 7,
        rng_state: 7,
        model: ex.plan.spec.to_hf_config(),
        train: serde_json::Value::Null,
        memwall_version: "test".into(),
        loss_scale: None,
    };
    let opts = SaveOptions {
        max_shard_bytes: 40_000,
        ..SaveOptions::default()
    };
    let files = |dir: &std::path::Path| {
        let mut f: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let name = e.file_name().into_string().unwrap();
                (name, std::fs::read(e.path()).unwrap())
            })
            .collect();
        f.sort();
        f
    };
    let (streamed, copied) = (run.join("streamed"), run.join("copied"));
    let dir = ex.save_checkpoint(&streamed, &state, &opts).unwrap();
    let (spec, layout) = (&ex.plan.spec, &ex.plan.layout);
    let want = ex
        .with_params(|p| {
            ex.with_moments(|m| save_checkpoint_with(&copied, spec, layout, p, &m, &state, &opts))
        })
        .unwrap()
        .unwrap()
        .unwrap();
    let got = files(&dir);
    assert!(got.len() > 5, "{} files: not sharded", got.len());
    assert!(
        got == files(&want),
        "streamed and copied checkpoints differ"
    );
    std::fs::remove_dir_all(run).unwrap();
    got
}

/// Every `--offload` placement moves its state to the disk tier and streams it through
/// staging buffers: weights, losses and moments stay bitwise those of the run that keeps
/// everything in RAM, for every moment format and with accumulation and recomputation.
#[test]
fn offloading_changes_no_bit() {
    use memwall::ir::Tier;
    use memwall::plan::OffloadSet;
    let dir = tempfile::tempdir().unwrap();
    let placements = ["optimizer", "params", "grads", "activations", "all"];
    for spec in specs() {
        let name = &spec.name;
        for (what, base) in [
            ("fp32", StepConfig::new(2, 16, 2)),
            ("int8 state, selective recompute", {
                let mut c = StepConfig::new(2, 16, 2);
                c.optim_state = OptimState::Int8;
                c.recompute = Recompute::Selective;
                c
            }),
            ("bf16 state, accum 2, full recompute", {
                let mut c = StepConfig::new(2, 16, 2);
                c.optim_state = OptimState::Bf16;
                c.grad_accum = 2;
                c.recompute = Recompute::Full;
                c
            }),
        ] {
            let run = |cfg: &StepConfig| train(&spec, cfg, 6);
            let (want_w, want_l) = run(&base);
            let in_ram = build_plan(&spec, &base, Mode::Train, backend()).unwrap();
            for placement in placements {
                let mut off = base.clone();
                off.offload.set = placement.parse::<OffloadSet>().unwrap();
                off.offload.dir = Some(dir.path().to_path_buf());
                let set = off.offload.set;
                let what = format!("{what}, --offload {placement}");
                let plan = build_plan(&spec, &off, Mode::Train, backend()).unwrap();
                assert!(plan.nvme_bytes() > 0, "{name} {what}: nothing on disk");
                for b in plan.buffers.iter().filter(|b| b.persistent) {
                    let on_disk = match b.category {
                        Category::OptimizerState => set.optimizer,
                        Category::Param | Category::Master => set.params,
                        _ => continue,
                    };
                    let tier = if on_disk { Tier::Nvme } else { Tier::Host };
                    assert_eq!(b.placement.tier, tier, "{name} {what}: {}", b.name);
                }
                if set.optimizer || set.params {
                    assert!(
                        plan.arena_bytes() < in_ram.arena_bytes(),
                        "{name} {what}: no RAM saved"
                    );
                }
                let (got_w, got_l) = run(&off);
                assert_eq!(got_l, want_l, "{name} {what}: losses differ");
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got_w), bits(&want_w), "{name} {what}: weights differ");
                let moments = |cfg: &StepConfig| {
                    let plan = build_plan(&spec, cfg, Mode::Train, backend()).unwrap();
                    let mut ex = Executor::on(plan, backend()).unwrap();
                    let layout = ex.plan.layout.clone();
                    ex.with_params_mut(|p| layout.init(p, 7)).unwrap();
                    let batch: Vec<u32> = (0..2 * cfg.grad_accum as u32 * 17)
                        .map(|i| i % 97)
                        .collect();
                    ex.upload_batch(&batch).unwrap();
                    for s in 1..=2 {
                        ex.train_step(&hp(s)).unwrap();
                    }
                    ex.finish_update().unwrap();
                    let ckpt = dir.path().join(format!("ckpt-{}", cfg.offload.set));
                    (moment_bytes(&ex), checkpoint_files(&ex, &ckpt))
                };
                let (off_moments, off_files) = moments(&off);
                let (ram_moments, ram_files) = moments(&base);
                assert_eq!(off_moments, ram_moments, "{name} {what}: moments differ");
                assert!(off_files == ram_files, "{name} {what}: checkpoints differ");
            }
        }
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "the offload file is removed"
    );
}
