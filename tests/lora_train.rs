//! LoRA training plans (`plan::lora`) run on the CPU backend: the adapters' gradients are
//! those of full fine-tuning of the merged model seen through the adapters, and match
//! finite differences; fresh adapters (B = 0) leave the model's losses bitwise the base's;
//! recomputation changes nothing.

use memwall::backend::under_test as backend;
use memwall::ckpt::load_spec;
use memwall::dtype::GgmlType;
use memwall::exec::executor::Executor;
use memwall::ir::BaseQuant;
use memwall::ir::{Precision, Recompute};
use memwall::model::lora::{LoraSpec, parse_targets};
use memwall::model::{Family, ModelSpec, ParamLayout};
use memwall::plan::{Mode, StepConfig, build_plan};
use memwall::util::rng::Rng;
use std::path::Path;

const B: usize = 2;
const T: usize = 8;

fn tiny_llama() -> ModelSpec {
    load_spec(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny-llama")).unwrap()
}

fn micro_gpt2() -> ModelSpec {
    memwall::model::gpt2::spec("micro", [61, 16, 16, 2, 2])
}

fn lora_spec(family: Family, targets: &str) -> LoraSpec {
    LoraSpec {
        r: 3,
        alpha: 6.0,
        dropout: 0.0,
        targets: parse_targets(targets, family).unwrap(),
    }
}

/// Random base weights with a wide spread (gradients well above f32 noise) and a batch.
fn base_and_batch(spec: &ModelSpec) -> (Vec<f32>, Vec<u32>) {
    let layout = ParamLayout::new(spec);
    let mut rng = Rng::new(11);
    let mut w = vec![0f32; layout.total];
    layout.init(&mut w, 5);
    for x in w.iter_mut() {
        *x += 0.1 * rng.normal();
    }
    let v = spec.vocab_size as u64;
    let batch = (0..B * (T + 1)).map(|_| rng.below(v) as u32).collect();
    (w, batch)
}

/// A LoRA executor on `base` with adapter values `adapter` (or the fresh initialisation).
fn lora_executor(
    spec: &ModelSpec,
    lora: &LoraSpec,
    cfg: &StepConfig,
    base: &[f32],
    adapter: Option<&[f32]>,
    batch: &[u32],
) -> Executor {
    let mut cfg = cfg.clone();
    cfg.lora = Some(lora.clone());
    let plan = build_plan(spec, &cfg, Mode::Train, backend()).unwrap();
    let mut ex = Executor::on(plan, backend()).unwrap();
    ex.fill_base(|r, p| {
        p.copy_from_slice(&base[r]);
        Ok(())
    })
    .unwrap();
    let layout = ex.plan.layout.clone();
    ex.with_params_mut(|p| match adapter {
        Some(a) => p.copy_from_slice(a),
        None => layout.init(p, 3),
    })
    .unwrap();
    ex.upload_batch(batch).unwrap();
    ex
}

fn full_executor(spec: &ModelSpec, cfg: &StepConfig, params: &[f32], batch: &[u32]) -> Executor {
    let plan = build_plan(spec, cfg, Mode::Train, backend()).unwrap();
    let mut ex = Executor::on(plan, backend()).unwrap();
    ex.with_params_mut(|p| p.copy_from_slice(params)).unwrap();
    ex.upload_batch(batch).unwrap();
    ex
}

/// Adapter values with B ≠ 0, so every adapter's gradients are non-zero.
fn random_adapter(total: usize) -> Vec<f32> {
    let mut rng = Rng::new(21);
    (0..total).map(|_| 0.3 * rng.normal()).collect()
}

/// For every adapter, dA and dB of the LoRA step equal what full fine-tuning of the merged
/// model W' = W + s·B·A gives through the chain rule (dB = s·G·Aᵀ, dA = s·Bᵀ·G with G the
/// merged weight's gradient), and the losses agree: a LoRA step is a full step whose base
/// gradients are discarded.
#[test]
fn adapter_gradients_are_full_fine_tuning_seen_through_the_adapters() {
    // Phi-3's layout: llama-tiny's shapes with q|k|v and gate|up one tensor each, so one
    // adapter each.
    let phi3 = ModelSpec {
        family: Family::Phi3,
        name: "phi3-tiny".into(),
        ..tiny_llama()
    };
    for (spec, targets) in [
        (tiny_llama(), "all"),
        (tiny_llama(), "q,v,down"),
        (micro_gpt2(), "all"),
        (phi3.clone(), "all"),
        (phi3, "qkv,down"),
    ] {
        check_against_full_fine_tuning(&spec, targets, BaseQuant::F32);
    }
}

/// With the base quantized on load (`--base-quant`), the LoRA step is full fine-tuning of
/// the dequantized base seen through the adapters: the frozen layers compute on the blocks
/// exactly as on the weights they decode to, embedding, tied head and all.
#[test]
fn a_quantized_base_is_its_dequantized_weights() {
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::BF16,
    ] {
        check_against_full_fine_tuning(&spec, "all", BaseQuant::Blocks(ty));
    }
    // Qwen2's q, k and v biases: f32 beside the blocks, added after the quantized product.
    let mut qwen = spec.clone();
    qwen.biases.qkv = true;
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
        check_against_full_fine_tuning(&qwen, "all", BaseQuant::Blocks(ty));
    }
    let mut cfg = StepConfig::new(B, T, 2);
    (cfg.lora, cfg.base_quant) = (
        Some(lora_spec(qwen.family, "all")),
        BaseQuant::Blocks(GgmlType::Q4_0),
    );
    let plan = build_plan(&qwen, &cfg, Mode::Train, backend()).unwrap();
    let added = (plan.schedule.ops.iter())
        .filter(|e| matches!(e.op, memwall::ir::Op::AddBias { .. }))
        .count();
    assert_eq!(added, qwen.n_layer, "one bias op per layer's q|k|v product");
    // Each base buffer's dtype says how it stores its segment's values: f32 elements, or
    // ggml blocks (q4_0, the tied embedding q8_0: its rows are not whole q6_k blocks) whose
    // bytes are the blocks'.
    let base = plan.schedule.implicit.base.as_ref().unwrap();
    let mut dtypes = std::collections::HashSet::new();
    for s in &base.segments {
        let b = plan.buffer(s.buf);
        assert_eq!(b.elems, s.range.len(), "{}", b.name);
        let want = match b.dtype.ggml() {
            Some(ty) => ty.bytes_for(b.elems as u64),
            None => Some(4 * b.elems as u64),
        };
        assert_eq!(Some(b.bytes), want, "{}", b.name);
        // Named `{group}.base.{dtype}` (a second run of one storage `….2`).
        let storage = b
            .name
            .split(".base.")
            .nth(1)
            .and_then(|s| s.split('.').next());
        assert_eq!(storage, Some(b.dtype.to_string().as_str()), "{}", b.name);
        dtypes.insert(b.dtype);
    }
    let q = |ty| memwall::dtype::DType::Ggml(ty);
    let want = [
        memwall::dtype::DType::F32,
        q(GgmlType::Q4_0),
        q(GgmlType::Q8_0),
    ];
    assert_eq!(dtypes, want.into(), "the base's storages");
    // Q4_K's blocks of 256: llama-tiny's MLP (352) is no multiple, so a model made of 256s.
    let mut wide = spec.clone();
    (wide.n_embd, wide.mlp_hidden, wide.head_dim, wide.n_layer) = (256, 512, 64, 2);
    check_against_full_fine_tuning(&wide, "all", BaseQuant::Blocks(GgmlType::Q4_K));
    // Untied: the embedding in the base's type (q4_k), the head in q6_k.
    wide.tied_embeddings = false;
    check_against_full_fine_tuning(&wide, "all", BaseQuant::Blocks(GgmlType::Q4_K));
    cfg.base_quant = BaseQuant::Blocks(GgmlType::Q4_K);
    let plan = build_plan(&wide, &cfg, Mode::Train, backend()).unwrap();
    let dtype = |name: &str| {
        plan.buffers
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.dtype)
    };
    assert_eq!(dtype("embed.base.q4_k"), Some(q(GgmlType::Q4_K)));
    assert_eq!(dtype("lm_head.base.q6_k"), Some(q(GgmlType::Q6_K)));
    // bf16 activations on the quantized GEMMs: the fp32 step's loss to bf16's precision,
    // and the same under full recomputation, bitwise.
    let lora = lora_spec(spec.family, "all");
    let (base, batch) = base_and_batch(&spec);
    let step = |precision: Precision, recompute: Recompute| {
        let mut cfg = StepConfig::new(B, T, 2);
        (cfg.base_quant, cfg.precision, cfg.recompute) =
            (BaseQuant::Blocks(GgmlType::Q4_1), precision, recompute);
        let mut ex = lora_executor(&spec, &lora, &cfg, &base, None, &batch);
        let loss = ex.compute_gradients().unwrap();
        let g: Vec<u32> = ex
            .download_grads()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        (loss, g)
    };
    let (f32_loss, _) = step(Precision::F32, Recompute::None);
    let (bf16_loss, g) = step(Precision::Bf16, Recompute::None);
    assert!(
        (bf16_loss - f32_loss).abs() <= 2e-2 * f32_loss.abs(),
        "bf16 {bf16_loss} vs fp32 {f32_loss}"
    );
    assert_eq!(step(Precision::Bf16, Recompute::Full).1, g);
}

/// `base` with every matrix replaced by its `quant` round trip (what a quantized base
/// computes with).
fn as_stored(spec: &ModelSpec, base: &[f32], quant: BaseQuant) -> Vec<f32> {
    let BaseQuant::Blocks(ty) = quant else {
        return base.to_vec();
    };
    let layout = ParamLayout::new(spec);
    let mut out = base.to_vec();
    for t in layout.tensors.iter().filter(|t| t.shape.len() == 2) {
        // The output (the head, or a tied embedding) in q6_k, or q8_0 where its rows are not
        // whole blocks of 256; an untied embedding in the base's type.
        let output = t.shape[0] == spec.vocab_size
            && (spec.tied_embeddings || !t.name.contains("embed_tokens"));
        let ty = match (output, ty == GgmlType::Q8_0 || t.shape[1] % 256 != 0) {
            (true, true) => GgmlType::Q8_0,
            (true, false) => GgmlType::Q6_K,
            (false, _) => ty,
        };
        let w = &base[t.range.clone()];
        let mut q = vec![0u8; ty.bytes_for(w.len() as u64).unwrap() as usize];
        memwall::gguf::quantize::quantize(ty, w, &mut q).unwrap();
        memwall::dtype::dequant::dequantize(ty, &q, &mut out[t.range.clone()]).unwrap();
    }
    out
}

fn check_against_full_fine_tuning(spec: &ModelSpec, targets: &str, quant: BaseQuant) {
    let mut cfg = StepConfig::new(B, T, 2);
    cfg.base_quant = quant;
    let lora = lora_spec(spec.family, targets);
    let (base, batch) = base_and_batch(spec);
    let layout = ParamLayout::new(spec);
    let ad = memwall::model::lora::AdapterLayout::new(&layout, lora.clone()).unwrap();
    let values = random_adapter(ad.params.total);
    let mut merged = as_stored(spec, &base, quant);
    if quant != BaseQuant::F32 {
        assert_ne!(merged, base, "{quant}: the round trip changed nothing");
    }
    memwall::ckpt::adapter::merge_into(&ad, &layout, &mut merged, &values);

    let mut lx = lora_executor(spec, &lora, &cfg, &base, Some(&values), &batch);
    let mut fx = full_executor(spec, &StepConfig::new(B, T, 2), &merged, &batch);
    let (ll, fl) = (
        lx.compute_gradients().unwrap(),
        fx.compute_gradients().unwrap(),
    );
    let what = format!("{} {targets} base {quant}", spec.name);
    assert!(
        (ll - fl).abs() <= 1e-5 * fl.abs(),
        "{what}: loss {ll} vs merged {fl}"
    );
    let (lg, fg) = (lx.download_grads().unwrap(), fx.download_grads().unwrap());
    let (r, s) = (lora.r, lora.scale() as f64);
    for (i, a) in ad.layers.iter().enumerate() {
        let (din, dout) = (a.in_features, a.out_features);
        let w = &layout.tensors[a.base_tensor];
        // G[o][j]: the merged weight's gradient as [out, in].
        let g = |o: usize, j: usize| -> f64 {
            let k = match spec.family {
                Family::Gpt2 => j * dout + o,
                _ => o * din + j,
            };
            fg[w.range.start + k] as f64
        };
        let (ar, br) = (
            &ad.params.tensors[2 * i].range,
            &ad.params.tensors[2 * i + 1].range,
        );
        let (av, bv) = (&values[ar.clone()], &values[br.clone()]);
        let mut worst = 0f64;
        let mut scale = 0f64;
        for k in 0..r {
            for j in 0..din {
                let want: f64 = s
                    * (0..dout)
                        .map(|o| bv[o * r + k] as f64 * g(o, j))
                        .sum::<f64>();
                let got = lg[ar.start + k * din + j] as f64;
                worst = worst.max((got - want).abs());
                scale = scale.max(want.abs());
            }
        }
        for o in 0..dout {
            for k in 0..r {
                let want: f64 = s
                    * (0..din)
                        .map(|j| g(o, j) * av[k * din + j] as f64)
                        .sum::<f64>();
                let got = lg[br.start + o * r + k] as f64;
                worst = worst.max((got - want).abs());
                scale = scale.max(want.abs());
            }
        }
        assert!(scale > 1e-4, "{what}: {} has vanishing gradients", a.module);
        // A quantized base's GEMMs sum over tiles of 256 rows: another order than the full
        // GEMM's, which the chain through the layers amplifies (measured up to 4.3e-4 with a
        // bf16 base, 2e-5 with q8_0, 9e-6 with an fp32 base).
        let tol = if quant == BaseQuant::F32 { 2e-4 } else { 1e-3 };
        assert!(
            worst <= tol * scale,
            "{what} {}: adapter gradients differ by {worst} (largest {scale})",
            a.module
        );
    }
}

/// Directional derivatives of the loss along random directions of the adapters, by finite
/// differences of evaluations, against the LoRA step's gradients.
#[test]
fn adapter_gradients_match_finite_differences() {
    let spec = tiny_llama();
    let cfg = StepConfig::new(B, T, 2);
    let lora = lora_spec(spec.family, "all");
    let (base, batch) = base_and_batch(&spec);
    let total = ParamLayout::new(&spec).total;
    assert_eq!(base.len(), total);
    let mut ex = lora_executor(&spec, &lora, &cfg, &base, None, &batch);
    let p0 = random_adapter(ex.plan.layout.total);
    ex.with_params_mut(|p| p.copy_from_slice(&p0)).unwrap();
    ex.compute_gradients().unwrap();
    let g = ex.download_grads().unwrap();
    let mut rng = Rng::new(99);
    for _ in 0..3 {
        let d: Vec<f32> = (0..p0.len()).map(|_| rng.normal()).collect();
        let eps = 1e-3f32;
        let mut eval = |s: f32| {
            ex.with_params_mut(|p| {
                for ((p, &q), &di) in p.iter_mut().zip(&p0).zip(&d) {
                    *p = q + s * di;
                }
            })
            .unwrap();
            ex.eval_loss().unwrap() as f64
        };
        let fd = (eval(eps) - eval(-eps)) / (2.0 * eps as f64);
        let an: f64 = g.iter().zip(&d).map(|(&a, &b)| a as f64 * b as f64).sum();
        assert!(
            (fd - an).abs() <= 2e-2 * an.abs().max(fd.abs()) + 1e-3,
            "directional derivative: analytic {an} vs finite difference {fd}"
        );
    }
}

/// With fresh adapters (B = 0) the LoRA plan's loss is bitwise the base model's.
#[test]
fn fresh_adapters_leave_the_loss_bitwise_the_base_models() {
    for spec in [tiny_llama(), micro_gpt2()] {
        let cfg = StepConfig::new(B, T, 2);
        let lora = lora_spec(spec.family, "all");
        let (base, batch) = base_and_batch(&spec);
        let mut lx = lora_executor(&spec, &lora, &cfg, &base, None, &batch);
        let mut fx = full_executor(&spec, &cfg, &base, &batch);
        let (ll, fl) = (lx.eval_loss().unwrap(), fx.eval_loss().unwrap());
        assert_eq!(ll.to_bits(), fl.to_bits(), "{}: {ll} vs {fl}", spec.name);
    }
}

/// Recomputation (selective and full) gives bitwise the gradients of keeping everything,
/// in fp32 and bf16.
#[test]
fn recomputation_leaves_adapter_gradients_bitwise() {
    let spec = tiny_llama();
    let lora = lora_spec(spec.family, "all");
    let (base, batch) = base_and_batch(&spec);
    let values = {
        let l = ParamLayout::new(&spec);
        let ad = memwall::model::lora::AdapterLayout::new(&l, lora.clone()).unwrap();
        random_adapter(ad.params.total)
    };
    for precision in [Precision::F32, Precision::Bf16] {
        let grads = |recompute: Recompute| {
            let mut cfg = StepConfig::new(B, T, 2);
            cfg.recompute = recompute;
            cfg.precision = precision;
            let mut ex = lora_executor(&spec, &lora, &cfg, &base, Some(&values), &batch);
            let loss = ex.compute_gradients().unwrap();
            let g: Vec<u32> = ex
                .download_grads()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            (loss.to_bits(), g)
        };
        let keep = grads(Recompute::None);
        assert!(keep.1.iter().any(|&b| b != 0));
        for policy in [Recompute::Selective, Recompute::Full] {
            assert!(
                grads(policy) == keep,
                "{precision:?}: {policy:?} changed the gradients"
            );
        }
    }
}

/// LoRA composes with accumulation (two micro-batches of one sequence give the gradients of
/// one batch of two), fp16 with loss scaling and int8 AdamW state (a repeated batch is
/// learned: its loss falls step after step).
#[test]
fn lora_composes_with_accumulation_fp16_and_int8_state() {
    use memwall::exec::{LossScaler, OptimHparams};
    use memwall::ir::OptimState;
    let spec = tiny_llama();
    let lora = lora_spec(spec.family, "all");
    let (base, batch) = base_and_batch(&spec);
    let values = {
        let l = ParamLayout::new(&spec);
        let ad = memwall::model::lora::AdapterLayout::new(&l, lora.clone()).unwrap();
        random_adapter(ad.params.total)
    };
    // Accumulation: [B, T] as B micro-batches of one row.
    let whole = {
        let mut ex = lora_executor(
            &spec,
            &lora,
            &StepConfig::new(B, T, 2),
            &base,
            Some(&values),
            &batch,
        );
        (
            ex.compute_gradients().unwrap(),
            ex.download_grads().unwrap(),
        )
    };
    let mut cfg = StepConfig::new(1, T, 2);
    cfg.grad_accum = B;
    let mut ex = lora_executor(&spec, &lora, &cfg, &base, Some(&values), &batch);
    let (loss, g) = (
        ex.compute_gradients().unwrap(),
        ex.download_grads().unwrap(),
    );
    assert!(
        (loss - whole.0).abs() <= 1e-5 * whole.0.abs(),
        "{loss} vs {}",
        whole.0
    );
    let scale = whole.1.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = g
        .iter()
        .zip(&whole.1)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst <= 1e-4 * scale,
        "accumulated gradients differ by {worst} of {scale}"
    );
    // fp16 and int8 state: three steps on one batch, each lowering its loss.
    for (precision, state) in [
        (Precision::F16, OptimState::F32),
        (Precision::F32, OptimState::Int8),
    ] {
        let mut cfg = StepConfig::new(B, T, 2);
        (cfg.precision, cfg.optim_state) = (precision, state);
        let mut ex = lora_executor(&spec, &lora, &cfg, &base, Some(&values), &batch);
        let mut losses = Vec::new();
        for step in 1..=3 {
            if precision == Precision::F16 {
                ex.set_loss_scale(LossScaler::INITIAL);
            }
            let hp = OptimHparams {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
                grad_clip: 1.0,
                step,
            };
            losses.push(ex.train_step(&hp).unwrap().loss);
        }
        assert!(
            losses.windows(2).all(|w| w[1] < w[0]) && losses.iter().all(|l| l.is_finite()),
            "{precision:?} {state:?}: losses {losses:?}"
        );
    }
}

/// The frozen base and the adapters' state on the disk tier (`--offload params`, `all`):
/// three steps give bitwise the losses and adapters of a run in RAM, for an f32 base and a
/// quantized one, and the base then lives on disk (its bytes leave the host tier).
#[test]
fn offloading_a_lora_run_changes_nothing_but_where_the_base_lives() {
    use memwall::exec::OptimHparams;
    use memwall::ir::Tier;
    use memwall::plan::{Offload, OffloadSet};
    let spec = ModelSpec::preset("llama-tiny").unwrap();
    let lora = lora_spec(spec.family, "all");
    let (base, batch) = base_and_batch(&spec);
    let values = {
        let l = ParamLayout::new(&spec);
        let ad = memwall::model::lora::AdapterLayout::new(&l, lora.clone()).unwrap();
        random_adapter(ad.params.total)
    };
    let tmp = tempfile::tempdir().unwrap();
    for quant in [BaseQuant::F32, BaseQuant::Blocks(GgmlType::Q4_0)] {
        let run = |set: OffloadSet| {
            let mut cfg = StepConfig::new(B, T, 2);
            cfg.base_quant = quant;
            cfg.offload = Offload {
                set,
                dir: Some(tmp.path().to_path_buf()),
            };
            let mut ex = lora_executor(&spec, &lora, &cfg, &base, Some(&values), &batch);
            let base_on_disk: u64 = (ex.plan.buffers.iter())
                .filter(|b| b.name.contains(".base") && b.placement.tier == Tier::Nvme)
                .map(|b| b.padded_bytes())
                .sum();
            let losses: Vec<u32> = (1..=3)
                .map(|step| {
                    let hp = OptimHparams {
                        lr: 1e-2,
                        beta1: 0.9,
                        beta2: 0.999,
                        eps: 1e-8,
                        weight_decay: 0.0,
                        grad_clip: 1.0,
                        step,
                    };
                    ex.train_step(&hp).unwrap().loss.to_bits()
                })
                .collect();
            ex.finish_update().unwrap();
            let adapters: Vec<u32> = ex
                .download_params()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            (losses, adapters, base_on_disk)
        };
        let ram = run(OffloadSet::NONE);
        assert_eq!(ram.2, 0);
        assert_ne!(
            ram.1,
            values.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        for set in [
            OffloadSet {
                params: true,
                ..OffloadSet::NONE
            },
            OffloadSet::ALL,
        ] {
            let off = run(set);
            assert!(off.0 == ram.0, "{quant} --offload {set}: losses differ");
            assert!(off.1 == ram.1, "{quant} --offload {set}: adapters differ");
            assert!(off.2 > 0, "{quant} --offload {set}: the base stayed in RAM");
        }
    }
}

/// `--lora-dropout 0.1` on every adapter of the tiny Llama.
fn dropout_spec(family: Family) -> LoraSpec {
    LoraSpec {
        dropout: 0.1,
        ..lora_spec(family, "all")
    }
}

/// A LoRA executor with dropout on random adapters (B ≠ 0), drawing the masks of `seed`.
fn dropout_executor(cfg: &StepConfig, lora: &LoraSpec, seed: u64) -> Executor {
    let spec = tiny_llama();
    let (base, batch) = base_and_batch(&spec);
    let l = ParamLayout::new(&spec);
    let ad = memwall::model::lora::AdapterLayout::new(&l, lora.clone()).unwrap();
    let values = random_adapter(ad.params.total);
    let mut ex = lora_executor(&spec, lora, cfg, &base, Some(&values), &batch);
    ex.set_dropout_seed(seed);
    ex
}

fn loss_and_grads(ex: &mut Executor) -> (f32, Vec<f32>) {
    (
        ex.compute_gradients().unwrap(),
        ex.download_grads().unwrap(),
    )
}

fn bits(g: &[f32]) -> Vec<u32> {
    g.iter().map(|x| x.to_bits()).collect()
}

/// Dropout is on in training steps: the loss and gradients differ from p = 0's and between
/// steps (seeds), and are a pure function of the seed (drawn twice, bitwise the same).
/// Evaluation uses no dropout: its loss is bitwise p = 0's.
#[test]
fn dropout_trains_with_a_mask_per_step_and_evaluates_without() {
    let spec = tiny_llama();
    let cfg = StepConfig::new(B, T, 2);
    let plain = loss_and_grads(&mut dropout_executor(
        &cfg,
        &lora_spec(spec.family, "all"),
        1,
    ));
    let drop = dropout_spec(spec.family);
    let mut ex = dropout_executor(&cfg, &drop, 1);
    let first = loss_and_grads(&mut ex);
    assert_ne!(first.0, plain.0, "dropout changed no loss");
    assert_ne!(bits(&first.1), bits(&plain.1));
    let again = loss_and_grads(&mut ex);
    assert_eq!(
        (first.0.to_bits(), bits(&first.1)),
        (again.0.to_bits(), bits(&again.1))
    );
    ex.set_dropout_seed(2);
    let other = loss_and_grads(&mut ex);
    assert_ne!(other.0, first.0, "another step drew the same masks");
    let mut p0 = dropout_executor(&cfg, &lora_spec(spec.family, "all"), 1);
    assert_eq!(
        ex.eval_loss().unwrap().to_bits(),
        p0.eval_loss().unwrap().to_bits()
    );
}

/// With dropout on, the adapters' gradients are those of the training loss with its masks
/// fixed by the seed: directional derivatives by finite differences of the training
/// forward (`compute_gradients`' loss, the same masks each time).
#[test]
fn dropout_gradients_match_finite_differences() {
    let spec = tiny_llama();
    let mut ex = dropout_executor(&StepConfig::new(B, T, 2), &dropout_spec(spec.family), 5);
    let p0 = ex.with_params(|p| p.to_vec()).unwrap();
    let (_, g) = loss_and_grads(&mut ex);
    let mut rng = Rng::new(98);
    for _ in 0..3 {
        let d: Vec<f32> = (0..p0.len()).map(|_| rng.normal()).collect();
        let eps = 1e-3f32;
        let mut eval = |s: f32| {
            ex.with_params_mut(|p| {
                for ((p, &q), &di) in p.iter_mut().zip(&p0).zip(&d) {
                    *p = q + s * di;
                }
            })
            .unwrap();
            ex.compute_gradients().unwrap() as f64
        };
        let fd = (eval(eps) - eval(-eps)) / (2.0 * eps as f64);
        let an: f64 = g.iter().zip(&d).map(|(&a, &b)| a as f64 * b as f64).sum();
        assert!(
            (fd - an).abs() <= 2e-2 * an.abs().max(fd.abs()) + 1e-3,
            "directional derivative: analytic {an} vs finite difference {fd}"
        );
    }
}

/// With dropout, recomputation (selective and full) draws the forward's masks again: the
/// gradients are bitwise those of keeping everything, in fp32 and bf16.
#[test]
fn dropout_recomputation_is_bitwise() {
    let spec = tiny_llama();
    for precision in [Precision::F32, Precision::Bf16] {
        let grads = |recompute: Recompute| {
            let mut cfg = StepConfig::new(B, T, 2);
            (cfg.recompute, cfg.precision) = (recompute, precision);
            let (loss, g) =
                loss_and_grads(&mut dropout_executor(&cfg, &dropout_spec(spec.family), 3));
            (loss.to_bits(), bits(&g))
        };
        let keep = grads(Recompute::None);
        for policy in [Recompute::Selective, Recompute::Full] {
            assert!(
                grads(policy) == keep,
                "{precision:?}: {policy:?} changed the gradients"
            );
        }
    }
}

/// Masks are drawn by an element's place in the step's batch: B micro-batches of one row
/// draw the masks of one batch of B rows, so accumulation gives its loss and gradients (to
/// rounding), as without dropout.
#[test]
fn dropout_with_accumulation_is_the_whole_batch() {
    let spec = tiny_llama();
    let drop = dropout_spec(spec.family);
    let whole = loss_and_grads(&mut dropout_executor(&StepConfig::new(B, T, 2), &drop, 4));
    let mut cfg = StepConfig::new(1, T, 2);
    cfg.grad_accum = B;
    let (loss, g) = loss_and_grads(&mut dropout_executor(&cfg, &drop, 4));
    assert!(
        (loss - whole.0).abs() <= 1e-5 * whole.0.abs(),
        "{loss} vs {}",
        whole.0
    );
    let scale = whole.1.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = (g.iter().zip(&whole.1)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst <= 1e-4 * scale,
        "accumulated gradients differ by {worst} of {scale}"
    );
}

/// `--lora-dropout` adds to the plan exactly one f32 workspace `[N, IC]` per adapter op (its
/// input's shape), and changes nothing else: the same ops in the same order, every other
/// buffer with its size. The arena holds it: the packing is verified with it, and the peak
/// is at least the p = 0 plan's.
#[test]
fn dropout_plans_one_workspace_per_adapter_op() {
    use memwall::ir::{Category, Op};
    let spec = tiny_llama();
    let plan = |lora: LoraSpec| {
        let mut cfg = StepConfig::new(B, T, 2);
        (cfg.recompute, cfg.lora) = (Recompute::Full, Some(lora));
        build_plan(&spec, &cfg, Mode::Train, backend()).unwrap()
    };
    let (plain, drop) = (
        plan(lora_spec(spec.family, "all")),
        plan(dropout_spec(spec.family)),
    );
    let (ops, dops) = (&plain.schedule.ops, &drop.schedule.ops);
    assert_eq!(ops.len(), dops.len());
    let mut workspaces = Vec::new();
    for (e, d) in ops.iter().zip(dops) {
        assert_eq!(e.name, d.name);
        let dropout = match (&e.op, &d.op) {
            (
                Op::LoraForward { dropout: None, .. },
                Op::LoraForward {
                    dropout, ic, rows, ..
                },
            )
            | (
                Op::LoraBackward { dropout: None, .. },
                Op::LoraBackward {
                    dropout, ic, rows, ..
                },
            ) => {
                let x = dropout.expect("an adapter op without dropout");
                assert_eq!((x.p, x.micro), (0.1, d.micro));
                Some((x.ws, rows.n() * ic))
            }
            _ => None,
        };
        workspaces.extend(dropout.map(|(ws, elems)| {
            let b = &drop.buffers[ws.0];
            assert_eq!(
                (b.category, b.elems, b.bytes),
                (Category::Workspace, elems, 4 * elems as u64)
            );
            assert_eq!(b.name, format!("{}_xd", d.name));
            b.name.clone()
        }));
    }
    // Forward and backward of each adapter, and recomputed forwards.
    let adapters = drop.lora.as_ref().unwrap().adapters.layers.len();
    assert!(
        workspaces.len() > 2 * adapters,
        "{} workspaces",
        workspaces.len()
    );
    let rest: Vec<_> = (drop.buffers.iter())
        .filter(|b| !workspaces.contains(&b.name))
        .map(|b| (&b.name, b.bytes))
        .collect();
    let before: Vec<_> = plain.buffers.iter().map(|b| (&b.name, b.bytes)).collect();
    assert_eq!(rest, before);
    assert!(drop.peak_live_bytes >= plain.peak_live_bytes);
}
