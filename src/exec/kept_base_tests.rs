//! Tests of a LoRA base kept as a GGUF file's own blocks (`--base-quant keep`): computing on
//! the file's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, F16 and BF16 tensors as they are is computing on
//! the f32 weights `memwall convert` decodes them to, tied head or not.

use crate::backend::under_test as backend;
use crate::dtype::GgmlType;
use crate::exec::Executor;
use crate::gguf::base::BaseSource;
use crate::gguf::testutil::{tiny_model, write_temp};
use crate::ir::{BaseQuant, BaseTypes};
use crate::model::lora::{LoraSpec, Target};
use crate::model::{ModelSpec, ParamLayout};
use crate::plan::{Mode, StepConfig, build_plan};
use crate::util::rng::Rng;

/// The test model with every fused projection's parts of one type (q, k, v Q4_1; gate and
/// up Q8_0; o BF16, down Q4_K and Q6_K, the embedding Q8_0, an untied head Q4_0); its layer
/// 1's o in F16.
fn uniform(tied: bool) -> Vec<u8> {
    let mut w = tiny_model("llama", tied);
    let (h, q, kv, ffn) = (32u64, 32u64, 16u64, 256u64);
    for l in 0..2u64 {
        let t = |n: &str| format!("blk.{l}.{n}");
        for (name, dims, ty) in [
            ("attn_k.weight", [h, kv], GgmlType::Q4_1),
            ("attn_v.weight", [h, kv], GgmlType::Q4_1),
            ("ffn_up.weight", [h, ffn], GgmlType::Q8_0),
        ] {
            w.remove_tensor(&t(name));
            w.random_tensor(&t(name), &dims, ty, 300 + l);
        }
    }
    w.remove_tensor("blk.1.attn_output.weight");
    w.random_tensor("blk.1.attn_output.weight", &[q, h], GgmlType::F16, 400);
    w.to_bytes()
}

/// Fused projections stored as different types (the test model's q Q4_1, k Q4_0, v F16;
/// gate Q8_0, up Q4_1) are stored as q8_0, converted from the file's blocks: the step
/// computes as on the conversion with those tensors rounded through q8_0, and the plan names
/// them. Qwen2's q, k and v biases stay f32 beside the blocks.
#[test]
fn a_kept_base_stores_mixed_fused_projections_as_q8_0() {
    for arch in ["llama", "qwen2", "qwen3"] {
        kept_is_its_conversion(&tiny_model(arch, true).to_bytes(), true, fused_as_q8_0);
    }
}

/// Rounds the fused projections' weights of `base` through q8_0 where the file does not
/// hold them as q8_0 already (what storing them as q8_0 does); returns their names.
fn fused_as_q8_0(layout: &ParamLayout, base: &mut [f32], types: &BaseTypes) -> Vec<String> {
    let mut names = Vec::new();
    let fused = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"];
    for t in (layout.tensors.iter()).filter(|t| t.shape.len() == 2) {
        if !fused.iter().any(|f| t.name.contains(f)) {
            continue;
        }
        names.push(t.name.clone());
        // Blocks the file holds as q8_0 are copied, not quantized again.
        if types[&t.name] == GgmlType::Q8_0 {
            continue;
        }
        let w = &mut base[t.range.clone()];
        let mut blocks = vec![0u8; GgmlType::Q8_0.bytes_for(w.len() as u64).unwrap() as usize];
        crate::gguf::quantize::quantize(GgmlType::Q8_0, w, &mut blocks).unwrap();
        crate::dtype::dequant::dequantize(GgmlType::Q8_0, &blocks, w).unwrap();
    }
    names
}

/// Rank-4 adapters on every layer `spec`'s family has, without dropout.
fn adapters(spec: &ModelSpec) -> LoraSpec {
    LoraSpec {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: Target::all(spec.family).to_vec(),
    }
}

#[test]
fn a_kept_base_computes_as_its_conversion() {
    for tied in [true, false] {
        kept_is_its_conversion(&uniform(tied), tied, |_, _, _| Vec::new());
    }
}

/// A LoRA step on the GGUF file `gguf` kept as it is equals one on its conversion to f32
/// (with `amend` applied to it: what storing differs from the file's blocks does), and the
/// plan names as requantized what `amend` returns.
fn kept_is_its_conversion(
    gguf: &[u8],
    tied: bool,
    amend: impl Fn(&ParamLayout, &mut [f32], &BaseTypes) -> Vec<String>,
) {
    {
        let (_tmp, gguf) = write_temp(gguf);
        let cache = tempfile::tempdir().unwrap();
        let dir =
            crate::gguf::cache::model_dir_in(cache.path(), &gguf, "--init", &mut |_| {}).unwrap();
        let spec: ModelSpec = crate::ckpt::load_spec(&dir).unwrap();
        let layout = ParamLayout::new(&spec);
        let mut base = vec![0f32; layout.total];
        crate::ckpt::load_params(&dir, &layout, &mut base).unwrap();
        let src = BaseSource::open(&gguf).unwrap();
        let mut requantized = amend(&layout, &mut base, &src.types());
        requantized.sort();
        let lora = adapters(&spec);
        let (b, t) = (2, 8);
        let mut rng = Rng::new(3);
        let batch: Vec<u32> = (0..b * (t + 1))
            .map(|_| rng.below(spec.vocab_size as u64) as u32)
            .collect();
        let run = |keep: bool| {
            let mut cfg = StepConfig::new(b, t, 2);
            cfg.lora = Some(lora.clone());
            if keep {
                cfg.base_quant = BaseQuant::Keep;
                cfg.base_types = Some(std::sync::Arc::new(src.types()));
            }
            let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
            if keep {
                let l = plan.lora.as_ref().unwrap();
                assert_eq!(
                    l.requantized, requantized,
                    "tied {tied}: requantized tensors"
                );
            }
            let quantized = plan
                .buffers
                .iter()
                .filter(|b| b.name.contains(".base.q"))
                .count();
            assert_eq!(keep, quantized > 0, "tied {tied}: quantized base buffers");
            let mut ex = Executor::on(plan, backend()).unwrap();
            if keep {
                ex.fill_base_bytes(|t, storage, dst| src.copy(t, storage, dst))
                    .unwrap();
            } else {
                ex.fill_base(|r, p| {
                    p.copy_from_slice(&base[r]);
                    Ok(())
                })
                .unwrap();
            }
            let mut rng = Rng::new(5);
            ex.with_params_mut(|p| p.iter_mut().for_each(|x| *x = 0.2 * rng.normal()))
                .unwrap();
            ex.upload_batch(&batch).unwrap();
            let loss = ex.compute_gradients().unwrap();
            (loss, ex.download_grads().unwrap())
        };
        let ((kl, kg), (fl, fg)) = (run(true), run(false));
        assert!(
            (kl - fl).abs() <= 1e-5 * fl.abs(),
            "tied {tied}: {kl} vs {fl}"
        );
        let scale = fg.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = kg
            .iter()
            .zip(&fg)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            scale > 0.0 && worst <= 1e-4 * scale,
            "tied {tied}: {worst} of {scale}"
        );
    }
}

/// The test model with row-parallel weights whose columns cut in two are whole blocks (down
/// in Q8_0; o in BF16 already): what `--tp 2` keeps.
fn tensor_rank_friendly(arch: &str, tied: bool) -> Vec<u8> {
    let mut w = tiny_model(arch, tied);
    for l in 0..2u64 {
        let name = format!("blk.{l}.ffn_down.weight");
        w.remove_tensor(&name);
        w.random_tensor(&name, &[256, 32], GgmlType::Q8_0, 500 + l);
    }
    w.to_bytes()
}

/// Two tensor ranks (`--tp 2`) keep their parts of the file's blocks (rows of a
/// column-parallel weight, whole blocks of a row-parallel one's columns, a fused
/// projection's parts of other types as q8_0, Qwen2's biases cut as f32) and train the
/// adapters as one process keeping the whole file does: the same losses and gradient norms.
#[test]
fn tensor_ranks_keep_their_parts_of_the_file_blocks_and_train_as_one_process() {
    use crate::dist::{Comm, Local};
    use crate::ir::Mesh;
    use std::sync::Arc;
    for (arch, tied) in [("llama", false), ("qwen2", true)] {
        let (_tmp, gguf) = write_temp(&tensor_rank_friendly(arch, tied));
        let cache = tempfile::tempdir().unwrap();
        let dir =
            crate::gguf::cache::model_dir_in(cache.path(), &gguf, "--init", &mut |_| {}).unwrap();
        let spec: ModelSpec = crate::ckpt::load_spec(&dir).unwrap();
        let src = BaseSource::open(&gguf).unwrap();
        let lora = adapters(&spec);
        let (b, t) = (2, 8);
        let run = |mesh: Mesh, comm: Arc<dyn Comm>| {
            let mut cfg = StepConfig::new(b, t, 1);
            cfg.lora = Some(lora.clone());
            cfg.base_quant = BaseQuant::Keep;
            cfg.base_types = Some(std::sync::Arc::new(src.types()));
            cfg.mesh = mesh;
            let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
            let layout = plan.layout.clone();
            let mut ex = Executor::among(plan, backend(), comm).unwrap();
            ex.fill_base_bytes(|t, storage, dst| src.copy(t, storage, dst))
                .unwrap();
            let mut init = layout.initializer(9);
            ex.fill_params(|r, p| {
                init.fill(r, p);
                Ok(())
            })
            .unwrap();
            (1..=3u64)
                .map(|step| {
                    let mut rng = Rng::new(step);
                    let batch: Vec<u32> = (0..b * (t + 1))
                        .map(|_| rng.below(spec.vocab_size as u64) as u32)
                        .collect();
                    ex.upload_batch(&batch).unwrap();
                    let hp = crate::exec::OptimHparams {
                        lr: 1e-2,
                        beta1: 0.9,
                        beta2: 0.95,
                        eps: 1e-8,
                        weight_decay: 0.0,
                        grad_clip: 0.0,
                        step,
                    };
                    let s = ex.train_step(&hp).unwrap();
                    (s.loss, s.grad_norm)
                })
                .collect::<Vec<_>>()
        };
        let one = run(Mesh::SINGLE, Arc::new(crate::dist::Single));
        let ranks: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (Local::group(2).into_iter().enumerate())
                .map(|(rank, comm)| {
                    let run = &run;
                    s.spawn(move || run(Mesh::new(2, 2, 1, rank), Arc::new(comm)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, steps) in ranks.iter().enumerate() {
            for (k, ((l, n), (l1, n1))) in steps.iter().zip(&one).enumerate() {
                let what = format!("{arch} tensor rank {rank} step {}", k + 1);
                assert!(
                    (l - l1).abs() <= 1e-5 * l1.abs(),
                    "{what}: loss {l} vs {l1}"
                );
                assert!(
                    (n - n1).abs() <= 1e-4 * n1.abs(),
                    "{what}: norm {n} vs {n1}"
                );
            }
        }
    }
}

/// A row-parallel weight whose columns cut among the tensor ranks are not whole blocks of
/// the file's type (the test model's down in Q4_K: 128 of its 256 columns a rank) is
/// refused before any rank loads, naming the tensor.
#[test]
fn a_kept_part_of_partial_blocks_is_refused_naming_the_tensor() {
    let (_tmp, gguf) = write_temp(&tiny_model("llama", false).to_bytes());
    let cache = tempfile::tempdir().unwrap();
    let dir = crate::gguf::cache::model_dir_in(cache.path(), &gguf, "--init", &mut |_| {}).unwrap();
    let spec: ModelSpec = crate::ckpt::load_spec(&dir).unwrap();
    let src = BaseSource::open(&gguf).unwrap();
    let mut cfg = StepConfig::new(2, 8, 1);
    cfg.lora = Some(adapters(&spec));
    cfg.base_quant = BaseQuant::Keep;
    cfg.base_types = Some(std::sync::Arc::new(src.types()));
    cfg.mesh = crate::ir::Mesh::new(2, 2, 1, 0);
    let e = build_plan(&spec, &cfg, Mode::Train, backend()).expect_err("refused");
    let e = format!("{e:#}");
    assert!(e.contains("down_proj"), "{e}");
}

/// A generation plan of a model kept as its GGUF file's blocks (no adapters: the frozen base
/// alone) gives the logits of its conversion to f32, in a fraction of its bytes.
#[test]
fn a_model_kept_as_its_file_blocks_generates_as_its_conversion() {
    for tied in [true, false] {
        let (_tmp, gguf) = write_temp(&uniform(tied));
        let cache = tempfile::tempdir().unwrap();
        let dir =
            crate::gguf::cache::model_dir_in(cache.path(), &gguf, "--model", &mut |_| {}).unwrap();
        let spec: ModelSpec = crate::ckpt::load_spec(&dir).unwrap();
        let src = BaseSource::open(&gguf).unwrap();
        let t = 8;
        let mut rng = Rng::new(3);
        let context: Vec<u32> = (0..t)
            .map(|_| rng.below(spec.vocab_size as u64) as u32)
            .collect();
        let run = |keep: bool| {
            let mut cfg = StepConfig::new(1, t, 2);
            if keep {
                cfg.base_quant = BaseQuant::Keep;
                cfg.base_types = Some(std::sync::Arc::new(src.types()));
            }
            let plan = build_plan(&spec, &cfg, Mode::Generate, backend()).unwrap();
            // The weights' bytes (the tiny model's are fewer than its workspace's).
            let by = plan.bytes_by_category();
            let bytes = by
                .iter()
                .find(|x| x.0 == crate::ir::Category::Param)
                .unwrap()
                .1;
            let layout = plan.layout.clone();
            assert_eq!(keep, layout.total == 0, "tied {tied}: nothing trainable");
            let mut ex = Executor::on(plan, backend()).unwrap();
            if keep {
                ex.fill_base_bytes(|t, storage, dst| src.copy(t, storage, dst))
                    .unwrap();
            } else {
                ex.with_params_mut(|p| crate::ckpt::load_params(&dir, &layout, p))
                    .unwrap()
                    .unwrap();
            }
            (ex.next_token_logits(&context).unwrap().to_vec(), bytes)
        };
        let ((kept, kept_bytes), (f32s, f32_bytes)) = (run(true), run(false));
        let scale = f32s.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = (kept.iter().zip(&f32s)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            scale > 0.0 && worst <= 1e-5 * scale,
            "tied {tied}: {worst} of {scale}"
        );
        assert!(
            kept_bytes < f32_bytes,
            "tied {tied}: {kept_bytes} vs {f32_bytes}"
        );
    }
}
