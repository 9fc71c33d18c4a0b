//! `memwall prune` on tiny models of each Llama-layout family: what contributes nothing is
//! what is pruned (and pruning it leaves the logits where they were), the kept weights are
//! the original's at the kept indices, a memory budget picks a shape whose plan fits while
//! the next larger one's does not, and bad input is refused naming the flag.

mod common;

use common::{fails, ok};
use memwall::backend::DeviceId;
use memwall::ckpt;
use memwall::data::{PrepareOptions, Tokenizer, prepare_with};
use memwall::exec::Executor;
use memwall::model::{ModelSpec, ParamLayout};
use memwall::plan::{Mode, StepConfig, build_plan};
use memwall::prune::shape::{Shape, ShapeRequest};
use memwall::prune::{self, FitMemory, PruneOptions, Pruned, Use};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A tiny config of `model_type` (4 layers, 4 query heads on 2 KV heads of 8, MLP 64)
/// beside the 267-token fixture tokenizer.
fn config(model_type: &str) -> String {
    let extra = match model_type {
        "gemma3_text" => {
            r#", "sliding_window": 8, "layer_types": ["sliding_attention", "sliding_attention",
               "sliding_attention", "full_attention"], "query_pre_attn_scalar": 8,
               "hidden_activation": "gelu_pytorch_tanh""#
        }
        _ => r#", "hidden_act": "silu""#,
    };
    format!(
        r#"{{"model_type": "{model_type}", "vocab_size": 267, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true{extra}}}"#
    )
}

/// Writes a model of `spec` with weights `params` and the fixture tokenizer into `dir`.
fn write_model(dir: &Path, spec: &ModelSpec, params: &[f32]) {
    let layout = ParamLayout::new(spec);
    let opts = ckpt::SaveOptions {
        tokenizer_dir: Some(&fixture("tiny-bpe")),
        ..Default::default()
    };
    ckpt::save_model_with(dir, spec, &layout, params, &opts).unwrap();
}

/// Calibration text prepared with the fixture tokenizer.
fn data(dir: &Path) -> PathBuf {
    let text = dir.join("text.txt");
    let lines: String = (0..300)
        .map(|i| format!("Line {i}: the cat and the hat sat on the mat.\n"))
        .collect();
    std::fs::write(&text, lines).unwrap();
    let tok = Tokenizer::from_file(fixture("tiny-bpe").join("tokenizer.json")).unwrap();
    let out = dir.join("data");
    let opts = PrepareOptions {
        inputs: vec![text],
        out: out.clone(),
        val_fraction: 0.1,
    };
    prepare_with(&opts, &tok).unwrap();
    out
}

fn options(model: &Path, data: &Path, out: &Path, shape: ShapeRequest) -> PruneOptions {
    PruneOptions {
        model: model.to_path_buf(),
        gguf: None,
        base_quant: None,
        data: data.to_path_buf(),
        out: out.to_path_buf(),
        shape,
        fit: None,
        sequences: 6,
        seq: Some(24),
        seed: 3,
        threads: 2,
        device: DeviceId::CPU,
    }
}

/// The last position's logits of `context` under the model in `dir`.
fn logits(dir: &Path, context: &[u32]) -> Vec<f32> {
    let spec = ckpt::load_spec(dir).unwrap();
    let cfg = StepConfig::new(1, context.len(), 2);
    let plan = build_plan(&spec, &cfg, Mode::Generate, DeviceId::CPU.open().unwrap()).unwrap();
    let layout = plan.layout.clone();
    let mut ex = Executor::on(plan, DeviceId::CPU.open().unwrap()).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(dir, &layout, p))
        .unwrap()
        .unwrap();
    ex.next_token_logits(context).unwrap().to_vec()
}

/// The parameters of `spec` drawn at random, then: in layer l, KV head l % 2's values zeroed
/// (its query heads output nothing), 8 MLP channels of `up` zeroed (their activations are
/// 0), and (with `identity`) layer 2's output projections zeroed (the block passes its
/// input on). Returns them with the zeroed channels per layer.
fn with_dead_parts(spec: &ModelSpec, identity: bool) -> (Vec<f32>, Vec<Vec<usize>>) {
    let layout = ParamLayout::new(spec);
    let mut p = vec![0f32; layout.total];
    layout.init(&mut p, 11);
    let hd = spec.head_dim;
    let mut dead_mlp = Vec::new();
    for l in 0..spec.n_layer {
        let name = |t: &str| format!("model.layers.{l}.{t}.weight");
        let c = spec.n_embd;
        let v = layout.range(&name("self_attn.v_proj"));
        let j = l % spec.n_kv_head;
        p[v.start + j * hd * c..v.start + (j + 1) * hd * c].fill(0.0);
        let up = layout.range(&name("mlp.up_proj"));
        let mut dead: Vec<usize> = (0..8).map(|k| (l * 5 + k * 7) % spec.mlp_hidden).collect();
        dead.sort_unstable();
        for &ch in &dead {
            p[up.start + ch * c..up.start + (ch + 1) * c].fill(0.0);
        }
        dead_mlp.push(dead);
        if identity && l == 2 {
            for t in ["self_attn.o_proj", "mlp.down_proj"] {
                let r = layout.range(&name(t));
                p[r].fill(0.0);
            }
        }
    }
    (p, dead_mlp)
}

fn prune_dead_parts(model_type: &str, depth: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let spec = ModelSpec::from_hf_config_str(&config(model_type), "config.json").unwrap();
    let (params, dead_mlp) = with_dead_parts(&spec, depth);
    let model = tmp.path().join("model");
    write_model(&model, &spec, &params);
    let data = data(tmp.path());
    let out = tmp.path().join("pruned");
    let shape = ShapeRequest {
        kv_heads: Some(1),
        mlp: Some(spec.mlp_hidden - 8),
        depth: depth.then_some(3),
        ..Default::default()
    };
    let p: Pruned = prune::prune(&options(&model, &data, &out, shape), &mut |_, _| {}).unwrap();
    let k = &p.kept;
    let layers: Vec<usize> = if depth {
        vec![0, 1, 3]
    } else {
        vec![0, 1, 2, 3]
    };
    assert_eq!(
        k.layers, layers,
        "{model_type}: the identity layer is dropped"
    );
    for (at, &l) in k.layers.iter().enumerate() {
        let live = 1 - l % 2;
        assert_eq!(k.kv_heads[at], vec![live], "{model_type} layer {l}");
        assert_eq!(
            k.heads[at],
            vec![2 * live, 2 * live + 1],
            "{model_type} layer {l}"
        );
        let kept: Vec<usize> = (0..spec.mlp_hidden)
            .filter(|c| !dead_mlp[l].contains(c))
            .collect();
        assert_eq!(k.mlp[at], kept, "{model_type} layer {l}");
    }
    assert!(p.scores.block_influence[2] < 1e-5 || !depth);
    let pruned = ckpt::load_spec(&out).unwrap();
    assert_eq!(
        (pruned.n_head, pruned.n_kv_head, pruned.n_layer),
        (2, 1, layers.len())
    );
    assert_eq!(pruned.family, spec.family);
    // What contributed nothing is gone, and nothing else moved.
    let context: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 267).collect();
    let (a, b) = (logits(&model, &context), logits(&out, &context));
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-5, "{model_type}: logits moved by {worst}");
    assert!(out.join("tokenizer.json").is_file());
    assert!(out.join(prune::REPORT_FILE).is_file());
}

#[test]
fn what_contributes_nothing_is_pruned_and_the_logits_stay() {
    prune_dead_parts("llama", true);
    prune_dead_parts("qwen3", true);
    prune_dead_parts("mistral", true);
}

/// Gemma 3 (1 + w norms, post-norms, GeGLU): widths only, its layer pattern kept.
#[test]
fn gemma3_widths_are_pruned_the_same_way() {
    prune_dead_parts("gemma3_text", false);
}

/// `--keep` with the embedding pruned: the files hold an ordinary config of the family with
/// the shape chosen, and every tensor is the original's at the kept rows and columns.
#[test]
fn kept_weights_are_the_originals_at_the_kept_indices() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = ModelSpec::from_hf_config_str(&config("qwen2"), "config.json").unwrap();
    let layout = ParamLayout::new(&spec);
    let mut params = vec![0f32; layout.total];
    layout.init(&mut params, 5);
    let model = tmp.path().join("model");
    write_model(&model, &spec, &params);
    let data = data(tmp.path());
    let out = tmp.path().join("pruned");
    // The embedding width given, the MLP shrinks alone to the budget.
    let shape = ShapeRequest {
        keep: Some(0.7),
        hidden: Some(24),
        ..Default::default()
    };
    let p = prune::prune(&options(&model, &data, &out, shape), &mut |_, _| {}).unwrap();
    assert!(p.params_after as f64 <= 0.7 * p.params_before as f64);
    assert!(p.after.hidden < 32 && p.after.mlp < 64, "{:?}", p.after);
    let new = ckpt::load_spec(&out).unwrap();
    assert_eq!(Shape::of(&new), p.after);
    assert_eq!(new.head_dim, 8, "heads keep their size");
    let new_layout = ParamLayout::new(&new);
    let mut got = vec![0f32; new_layout.total];
    ckpt::load_params(&out, &new_layout, &mut got).unwrap();
    let k = &p.kept;
    let (c, hd) = (spec.n_embd, spec.head_dim);
    for (at, &l) in k.layers.iter().enumerate() {
        // q_proj [NH·hd, C]: kept heads' rows, kept channels' columns; its bias the rows.
        let q_old = layout.range(&format!("model.layers.{l}.self_attn.q_proj.weight"));
        let q_new = new_layout.range(&format!("model.layers.{at}.self_attn.q_proj.weight"));
        let rows: Vec<usize> = (k.heads[at].iter())
            .flat_map(|&h| h * hd..(h + 1) * hd)
            .collect();
        for (i, &r) in rows.iter().enumerate() {
            for (j, &col) in k.hidden.iter().enumerate() {
                let want = params[q_old.start + r * c + col];
                assert_eq!(got[q_new.start + i * k.hidden.len() + j], want);
            }
        }
        let b_old = layout.range(&format!("model.layers.{l}.self_attn.q_proj.bias"));
        let b_new = new_layout.range(&format!("model.layers.{at}.self_attn.q_proj.bias"));
        for (i, &r) in rows.iter().enumerate() {
            assert_eq!(got[b_new.start + i], params[b_old.start + r]);
        }
        // down_proj [C, I]: kept channels' rows, kept MLP channels' columns.
        let d_old = layout.range(&format!("model.layers.{l}.mlp.down_proj.weight"));
        let d_new = new_layout.range(&format!("model.layers.{at}.mlp.down_proj.weight"));
        let i_new = k.mlp[at].len();
        for (i, &r) in k.hidden.iter().enumerate() {
            for (j, &m) in k.mlp[at].iter().enumerate() {
                let want = params[d_old.start + r * spec.mlp_hidden + m];
                assert_eq!(got[d_new.start + i * i_new + j], want);
            }
        }
    }
    // The norms over the residual stream: their kept channels, the gain scaled by the
    // ratio of root mean squares the calibration measured (> 1: the strongest channels
    // stay).
    let norms = (k.layers.iter())
        .flat_map(|l| {
            ["input_layernorm", "post_attention_layernorm"]
                .map(|n| (format!("model.layers.{l}.{n}.weight"), l))
        })
        .chain([("model.norm.weight".to_string(), &usize::MAX)]);
    for (name, &l) in norms {
        let gain = k.norm_gains[&name];
        assert!(gain > 1.0 && gain < 2.0, "{name}: {gain}");
        let new_name = match k.layers.iter().position(|&x| x == l) {
            Some(at) => name.replace(&format!(".{l}."), &format!(".{at}.")),
            None => name.clone(),
        };
        let (old, new) = (layout.range(&name), new_layout.range(&new_name));
        for (j, &col) in k.hidden.iter().enumerate() {
            let want = (params[old.start + col] as f64 * gain) as f32;
            assert_eq!(got[new.start + j], want, "{new_name}[{j}]");
        }
    }
    // The embedding: every token's kept channels.
    let e_old = layout.range("model.embed_tokens.weight");
    let e_new = new_layout.range("model.embed_tokens.weight");
    for t in [0, 100, 266] {
        for (j, &col) in k.hidden.iter().enumerate() {
            let want = params[e_old.start + t * c + col];
            assert_eq!(got[e_new.start + t * k.hidden.len() + j], want);
        }
    }
    // The shape is what prune.json says.
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join(prune::REPORT_FILE)).unwrap()).unwrap();
    assert_eq!(report["after"]["hidden"], p.after.hidden);
    assert_eq!(report["params_after"], new_layout.total);
}

/// `--fit-memory`: the chosen shape's plan for the use fits the budget and the next larger
/// shape's does not, each as `planned_peak` (the plan `memwall plan` prints) counts it.
#[test]
fn fit_memory_picks_a_shape_whose_plan_fits_and_the_next_larger_does_not() {
    let spec = ModelSpec::preset("smollm2-135m").unwrap();
    for (for_use, bytes) in [(Use::Qlora, 200u64 << 20), (Use::Train, 900 << 20)] {
        let fit = FitMemory {
            bytes,
            for_use,
            batch: 1,
            baseline: 8 << 20,
        };
        let mut opts = options(
            Path::new("m"),
            Path::new("d"),
            Path::new("o"),
            Default::default(),
        );
        opts.fit = Some(fit);
        opts.seq = Some(128);
        // The frontier: each embedding width with the widest MLP that fits.
        let shapes = prune::resolve_shapes(&spec, &opts).unwrap();
        assert!(shapes.len() > 1, "{for_use:?}: {shapes:?}");
        for shape in shapes {
            let report = prune::fit_report(&spec, &opts, shape).unwrap().unwrap();
            let peak =
                prune::planned_peak(&shape.apply(&spec), &fit, (128, 2), DeviceId::CPU).unwrap();
            assert_eq!(peak, report.peak_bytes);
            assert!(peak <= bytes, "{for_use:?}: {peak} > {bytes}");
            let (larger, larger_peak) = report.larger.unwrap();
            assert!(larger_peak > bytes, "{for_use:?}: {larger:?} fits too");
            assert!(larger.params(&spec) > shape.params(&spec));
            assert_eq!((shape.heads, shape.layers), (9, 30));
        }
    }
}

#[test]
fn bad_input_is_refused_naming_what_to_change() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let spec = ModelSpec::from_hf_config_str(&config("llama"), "config.json").unwrap();
    let layout = ParamLayout::new(&spec);
    let mut params = vec![0f32; layout.total];
    layout.init(&mut params, 1);
    let model = tmp.path().join("model");
    write_model(&model, &spec, &params);
    let out = tmp.path().join("out");
    let err = |opts: &PruneOptions| {
        let e = prune::prune(opts, &mut |_, _| {}).unwrap_err();
        format!("{e:#}")
    };
    // Heads that break grouped-query attention (4 on 2: groups of 2).
    let e = err(&options(
        &model,
        &data,
        &out,
        ShapeRequest {
            heads: Some(3),
            kv_heads: Some(1),
            ..Default::default()
        },
    ));
    assert!(e.contains("--heads 3") && e.contains("--kv-heads 1"), "{e}");
    // No head left.
    let e = err(&options(
        &model,
        &data,
        &out,
        ShapeRequest {
            kv_heads: Some(0),
            ..Default::default()
        },
    ));
    assert!(e.contains("--kv-heads 0"), "{e}");
    // A non-empty --out, before any scoring.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("x"), "keep me").unwrap();
    let e = err(&options(&model, &data, &out, Default::default()));
    assert!(e.contains("--out") && e.contains("not empty"), "{e}");
    assert_eq!(std::fs::read_to_string(out.join("x")).unwrap(), "keep me");
    let out = tmp.path().join("out2");
    // Data prepared with another tokenizer (GPT-2's).
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, "the cat and the hat sat on the mat. ".repeat(200)).unwrap();
    let gpt2_data = tmp.path().join("gpt2-data");
    memwall::data::prepare(&PrepareOptions {
        inputs: vec![text],
        out: gpt2_data.clone(),
        val_fraction: 0.1,
    })
    .unwrap();
    let e = err(&options(&model, &gpt2_data, &out, Default::default()));
    assert!(e.contains("--data") && e.contains("tokenizer"), "{e}");
    // --fit-memory with --keep.
    let mut opts = options(
        &model,
        &data,
        &out,
        ShapeRequest {
            keep: Some(0.5),
            ..Default::default()
        },
    );
    opts.fit = Some(FitMemory {
        bytes: 1 << 30,
        for_use: Use::Train,
        batch: 1,
        baseline: 0,
    });
    let e = err(&opts);
    assert!(e.contains("--fit-memory") && e.contains("--keep"), "{e}");
    // A family prune does not cut.
    let gpt2 = fixture("hf-tiny-gpt2");
    let e = err(&options(&gpt2, &data, &out, Default::default()));
    assert!(e.contains("gpt2") && e.contains("prune handles"), "{e}");
    assert!(!out.exists(), "nothing is written on refusal");
}

/// The pruned fixture transformers decodes (`memwall-llama-pruned`, checked in
/// `hf_reference.rs`) is what `prune` cuts from its original (`memwall-llama-ckpt`) at the
/// kept indices its prune.json records, byte for byte as `prune` writes it.
#[test]
fn the_fixture_transformers_decodes_is_what_prune_writes() {
    use memwall::prune::cut::{Kept, weights};
    let (orig, pruned) = (
        fixture("memwall-llama-ckpt"),
        fixture("memwall-llama-pruned"),
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(pruned.join(prune::REPORT_FILE)).unwrap()).unwrap();
    let kept: Kept = serde_json::from_value(report["kept"].clone()).unwrap();
    let spec = ckpt::load_spec(&orig).unwrap();
    let layout = ParamLayout::new(&spec);
    let mut params = vec![0f32; layout.total];
    ckpt::load_params(&orig, &layout, &mut params).unwrap();
    let new_spec = ckpt::load_spec(&pruned).unwrap();
    let new_layout = ParamLayout::new(&new_spec);
    let cut = weights(&spec, &kept, (&layout, &params), &new_layout).unwrap();
    let out = tempfile::tempdir().unwrap();
    ckpt::save_model(out.path(), &new_spec, &new_layout, &cut).unwrap();
    for file in ["config.json", "model.safetensors"] {
        assert!(
            std::fs::read(out.path().join(file)).unwrap()
                == std::fs::read(pruned.join(file)).unwrap(),
            "{file}: prune now writes it otherwise; make the fixture again (check_memwall_checkpoint.py)"
        );
    }
}

/// A pruned model exports to GGUF with the keys llama.cpp's converter writes for its shape:
/// the head size apart from width / heads (`attention.key_length`), the kept widths and
/// counts, and each tensor's kept shape.
#[test]
fn a_pruned_model_exports_the_keys_llama_cpp_reads_its_shape_from() {
    use memwall::export::{ExportOptions, ExportType, export};
    use memwall::gguf::file::GgufFile;
    let tmp = tempfile::tempdir().unwrap();
    let dir = with_tokenizer(tmp.path(), "memwall-llama-pruned");
    let out = tmp.path().join("pruned.gguf");
    export(&ExportOptions {
        input: dir,
        out: out.clone(),
        ty: ExportType::F32,
        name: None,
        adapter: None,
        progress: false,
    })
    .unwrap();
    let f = GgufFile::open(&out).unwrap();
    for (key, want) in [
        ("llama.embedding_length", 38),
        ("llama.feed_forward_length", 77),
        ("llama.attention.head_count", 2),
        ("llama.attention.head_count_kv", 1),
        ("llama.attention.key_length", 12),
        ("llama.attention.value_length", 12),
        ("llama.block_count", 3),
    ] {
        assert_eq!(f.get_u64(key).unwrap(), Some(want), "{key}");
    }
    assert_eq!(f.tensor("blk.0.attn_q.weight").unwrap().dims, vec![38, 24]);
    assert_eq!(f.tensor("blk.0.attn_k.weight").unwrap().dims, vec![38, 12]);
    assert_eq!(
        f.tensor("blk.2.ffn_down.weight").unwrap().dims,
        vec![77, 38]
    );
}

/// The command: the summary and (`--report`) every layer's scores, `--json` for scripts,
/// and flags that cannot work refused before anything runs.
#[test]
fn the_command_prints_its_choice_its_report_and_json() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let (model, data) = llama_model_and_data(tmp.path());
    let (m, d) = (p(&model), p(&data));
    let out = p(&tmp.path().join("a"));
    let flags = ["--seq", "32", "--calibration", "4"];
    let mut args = vec![
        "prune", "--model", &m, "--data", &d, "--out", &out, "--keep", "0.6",
    ];
    args.extend(flags);
    args.push("--report");
    let text = ok(&args);
    assert!(text.contains("layer  block-influence"), "{text}");
    assert!(
        text.contains("before: hidden 48, heads 4 (kv 2), mlp 96, layers 3"),
        "{text}"
    );
    assert!(
        text.contains("heal it with `memwall train --init"),
        "{text}"
    );
    let out = p(&tmp.path().join("b"));
    let mut args = vec![
        "prune", "--model", &m, "--data", &d, "--out", &out, "--depth", "2",
    ];
    args.extend(flags);
    args.push("--json");
    let json: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
    assert_eq!(json["after"]["layers"], 2);
    assert_eq!(json["after"]["hidden"], 48);
    assert!(json["params_after"].as_u64() < json["params_before"].as_u64());
    assert!(
        json.get("scores").is_none(),
        "--json leaves the per-channel scores to prune.json"
    );
    let out = p(&tmp.path().join("c"));
    let e = fails(&[
        "prune", "--model", &m, "--data", &d, "--out", &out, "--for", "qlora",
    ]);
    assert!(e.contains("--fit-memory"), "{e}");
    let e = fails(&[
        "prune",
        "--model",
        &m,
        "--data",
        &d,
        "--out",
        &out,
        "--fit-memory",
        "1KiB",
    ]);
    assert!(e.contains("gives a shape that fits"), "{e}");
    assert!(!tmp.path().join("c").exists());
}

/// The model in a fresh directory (the fixture's config and weights beside the fixture
/// tokenizer), and data prepared with that tokenizer, under `tmp`.
fn llama_model_and_data(tmp: &Path) -> (PathBuf, PathBuf) {
    (with_tokenizer(tmp, "memwall-llama-ckpt"), data(tmp))
}

/// Fixture `name`'s config and weights beside the fixture tokenizer, in `tmp/name`.
fn with_tokenizer(tmp: &Path, name: &str) -> PathBuf {
    let dir = tmp.join(name);
    std::fs::create_dir(&dir).unwrap();
    for (from, file) in [
        (fixture(name), "config.json"),
        (fixture(name), "model.safetensors"),
        (fixture("tiny-bpe"), "tokenizer.json"),
    ] {
        std::fs::copy(from.join(file), dir.join(file)).unwrap();
    }
    dir
}

/// The fixture Llama and its data in `tmp`, and that model pruned to 60% (`tmp/pruned`).
fn pruned_llama(tmp: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let (model, data) = llama_model_and_data(tmp);
    let pruned = tmp.join("pruned");
    let shape = ShapeRequest {
        keep: Some(0.6),
        ..Default::default()
    };
    prune::prune(&options(&model, &data, &pruned, shape), &mut |_, _| {}).unwrap();
    (model, data, pruned)
}

/// `train` on `model` for 3 steps (or `--steps` in `extra`) with `extra` flags; the losses
/// of its steps.
fn train_losses(tmp: &Path, name: &str, model: &Path, data: &Path, extra: &[&str]) -> Vec<f64> {
    train_run(tmp, (name, model, data), extra, &[]).0
}

/// [`train_losses`] with the environment `env`; also returns what the run printed to stderr.
fn train_run(
    tmp: &Path,
    (name, model, data): (&str, &Path, &Path),
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Vec<f64>, String) {
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let out = tmp.join(name);
    let (m, d, o) = (p(model), p(data), p(&out));
    let mut args = vec![
        "train",
        "--init",
        &m,
        "--data",
        &d,
        "--out",
        &o,
        "--batch",
        "2",
        "--seq",
        "24",
        "--eval-every",
        "0",
        "--lr",
        "1e-3",
        "--threads",
        "2",
    ];
    if !extra.contains(&"--steps") {
        args.extend(["--steps", "3"]);
    }
    args.extend(extra);
    let o = common::memwall_env(env, &args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "memwall {args:?} failed:\n{err}");
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let losses = (text.lines())
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|m| m["loss"].as_f64())
        .collect();
    (losses, err)
}

/// Distillation's loss as the step computes it: with the model as its own teacher, the KL is
/// 0 (α = 1) and α = ½ is half the data's cross-entropy; α = 0 is a run without a teacher.
#[test]
fn distillation_from_itself_has_no_kl_and_alpha_weighs_the_cross_entropy() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, data) = llama_model_and_data(tmp.path());
    let teacher = model.to_str().unwrap().to_string();
    let plain = train_losses(tmp.path(), "plain", &model, &data, &[]);
    let kl = ["--distill-from", &teacher, "--distill-alpha", "1"];
    let kl = train_losses(tmp.path(), "kl", &model, &data, &kl);
    assert!(kl[0].abs() < 1e-5, "step 1: KL to itself {}", kl[0]);
    let half = ["--distill-from", &teacher, "--distill-alpha", "0.5"];
    let half = train_losses(tmp.path(), "half", &model, &data, &half);
    assert!(
        (half[0] - 0.5 * plain[0]).abs() < 1e-5 * plain[0],
        "{half:?} vs {plain:?}"
    );
    let zero = ["--distill-from", &teacher, "--distill-alpha", "0"];
    let zero = train_losses(tmp.path(), "zero", &model, &data, &zero);
    for (a, b) in zero.iter().zip(&plain) {
        assert!(
            (a - b).abs() < 1e-5 * b,
            "alpha 0 {zero:?} vs no teacher {plain:?}"
        );
    }
}

/// A pruned model distilled from its original: the KL to the teacher falls, and the
/// checkpoint is an ordinary one (it loads as the pruned shape).
#[test]
fn a_pruned_model_distilled_from_its_original_moves_toward_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, data, pruned) = pruned_llama(tmp.path());
    let teacher = model.to_str().unwrap().to_string();
    let args = [
        "--distill-from",
        teacher.as_str(),
        "--distill-alpha",
        "1",
        "--steps",
        "12",
    ];
    let losses = train_losses(tmp.path(), "healed", &pruned, &data, &args);
    assert_eq!(losses.len(), 12);
    let (first, last) = (losses[0], losses[11]);
    assert!(last < 0.7 * first, "KL {first} -> {last}");
    let ck = tmp.path().join("healed/checkpoints/step-000012");
    assert_eq!(
        Shape::of(&ckpt::load_spec(&ck).unwrap()),
        Shape::of(&ckpt::load_spec(&pruned).unwrap())
    );
}

#[test]
fn a_teacher_that_cannot_teach_is_refused_naming_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, data) = llama_model_and_data(tmp.path());
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let (m, d, out) = (p(&model), p(&data), p(&tmp.path().join("a")));
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train", "--init", &m, "--data", &d, "--out", &out, "--seq", "24",
        ];
        args.extend(extra);
        fails(&args)
    };
    // Another vocabulary (GPT-2's tiny fixture).
    let gpt2 = p(&fixture("hf-tiny-gpt2"));
    let e = train(&["--distill-from", &gpt2]);
    assert!(
        e.contains("--distill-from") && e.contains("vocabulary"),
        "{e}"
    );
    let e = train(&["--distill-from", &m, "--distill-alpha", "1.5"]);
    assert!(e.contains("--distill-alpha 1.5"), "{e}");
    let e = train(&["--distill-alpha", "0.5"]);
    assert!(e.contains("--distill-from"), "{e}");
}

/// A distilled run resumed from its checkpoint continues bitwise (the teacher is reopened
/// from the run's options).
#[test]
fn a_distilled_run_resumes_bitwise() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, data, pruned) = pruned_llama(tmp.path());
    let teacher = model.to_str().unwrap().to_string();
    let flags = [
        "--distill-from",
        teacher.as_str(),
        "--distill-alpha",
        "0.7",
        "--steps",
        "4",
    ];
    let mut flags = flags.to_vec();
    flags.extend(["--save-every", "2"]);
    train_losses(tmp.path(), "full", &pruned, &data, &flags);
    let (full, resumed) = (tmp.path().join("full"), tmp.path().join("resumed"));
    let copy = std::process::Command::new("cp")
        .args(["-r", full.to_str().unwrap(), resumed.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(copy.success());
    std::fs::remove_dir_all(resumed.join("checkpoints/step-000004")).unwrap();
    ok(&["train", "--resume", resumed.to_str().unwrap()]);
    let weights = |run: &Path| std::fs::read(run.join("checkpoints/step-000004/model.safetensors"));
    assert!(weights(&full).unwrap() == weights(&resumed).unwrap());
}

/// `plan --distill-from`: the teacher's own plan is one buffer of the student's (its
/// category `teacher`), so the peak counts it and `--batch auto` fits the pair.
#[test]
fn a_distilled_plan_holds_the_teachers_plan_and_fits_the_pair() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, _) = llama_model_and_data(tmp.path());
    let m = model.to_str().unwrap();
    let plan = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "plan",
            "--model",
            m,
            "--seq",
            "24",
            "--threads",
            "2",
            "--json",
        ];
        args.extend(extra);
        serde_json::from_str(&ok(&args)).unwrap()
    };
    let bytes = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    let teacher = build_plan(
        &ckpt::load_spec(&model).unwrap(),
        &StepConfig::new(1, 24, 2),
        Mode::Generate,
        DeviceId::CPU.sizing(),
    )
    .unwrap()
    .total_bytes();
    let plain = plan(&["--batch", "2"]);
    let pair = plan(&["--batch", "2", "--distill-from", m]);
    assert_eq!(plain["by_category"]["teacher"].as_u64(), Some(0));
    assert_eq!(pair["by_category"]["teacher"].as_u64(), Some(teacher));
    // (Each process measures its own baseline: the totals are the plans'.)
    assert!(bytes(&pair, "total_bytes") >= bytes(&plain, "total_bytes") + teacher);
    let peak = "predicted_peak_rss_bytes";
    // A budget that holds 32 rows alone holds fewer beside the teacher.
    let budget = bytes(&plan(&["--batch", "32"]), peak).to_string();
    let auto = ["--batch", "auto", "--max-memory", budget.as_str()];
    let alone = plan(&auto);
    let mut with = auto.to_vec();
    with.extend(["--distill-from", m]);
    let with = plan(&with);
    let batch = |v: &serde_json::Value| v["config"]["batch"].as_u64().unwrap();
    assert!(
        batch(&with) < batch(&alone),
        "{} {}",
        batch(&with),
        batch(&alone)
    );
    assert!(bytes(&with, peak) <= budget.parse().unwrap());
    assert_eq!(with["by_category"]["teacher"].as_u64(), Some(teacher));
}

/// `--keep` without widths: every shape of the budget's frontier is tried, and the one kept
/// has the lowest calibration loss, which is the written model's own (each position's
/// cross-entropy from the last-position logits `sample` computes, prefix by prefix).
#[test]
fn a_budget_keeps_the_candidate_of_the_lowest_calibration_loss() {
    use memwall::prune::{score, select};
    let tmp = tempfile::tempdir().unwrap();
    let (model, data) = llama_model_and_data(tmp.path());
    let out = tmp.path().join("pruned");
    let shape = ShapeRequest {
        keep: Some(0.7),
        ..Default::default()
    };
    let opts = options(&model, &data, &out, shape);
    let p = prune::prune(&opts, &mut |_, _| {}).unwrap();
    assert!(p.candidates.len() > 1, "{:?}", p.candidates);
    let chosen = p.candidates.iter().find(|c| c.shape == p.after).unwrap();
    for c in &p.candidates {
        assert!(chosen.loss <= c.loss, "{:?} kept over {c:?}", chosen);
        assert!(c.params as f64 <= 0.7 * p.params_before as f64, "{c:?}");
    }
    // The held-out rows: drawn after the scored ones.
    let source = memwall::data::DataSet::open(&data)
        .unwrap()
        .train_source(false);
    let (seq, n) = (24, opts.sequences);
    let rows: Vec<Vec<u32>> = (n..n + select::SEQUENCES)
        .map(|k| score::calibration_window(&source, seq, opts.seed, k as u64).unwrap())
        .collect();
    let mut sum = 0.0f64;
    for row in &rows[..2] {
        for t in 0..seq {
            let l = logits(&out, &row[..t + 1]);
            let max = l.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            let z: f64 = l.iter().map(|&x| (x as f64 - max).exp()).sum();
            sum += max + z.ln() - l[row[t + 1] as usize] as f64;
        }
    }
    let want = sum / (2 * seq) as f64;
    let spec = ckpt::load_spec(&out).unwrap();
    let plan = build_plan(
        &spec,
        &StepConfig::new(1, seq, 2),
        Mode::Generate,
        DeviceId::CPU.open().unwrap(),
    )
    .unwrap();
    let layout = plan.layout.clone();
    let mut ex = Executor::on(plan, DeviceId::CPU.open().unwrap()).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(&out, &layout, p))
        .unwrap()
        .unwrap();
    let params = ex.download_params().unwrap();
    let f32s = prune::held::Storage {
        quant: Default::default(),
        types: None,
    };
    let mut values = |t: &memwall::model::ParamTensor, put: &mut dyn FnMut(&[f32]) -> _| {
        put(&params[t.range.clone()])
    };
    let head = select::Head::of(&ex.plan, &layout, &f32s, &mut values).unwrap();
    let got = select::calibration_loss(&mut ex, &head, &rows[..2], &mut || {}).unwrap();
    assert!((got - want).abs() < 1e-4 * want, "{got} vs {want}");
    let all = select::calibration_loss(&mut ex, &head, &rows, &mut || {}).unwrap();
    assert!(
        (all - chosen.loss).abs() < 1e-6 * all,
        "{all} vs {}",
        chosen.loss
    );
}

/// A teacher given as a GGUF file is kept as the file's blocks (f16 here): its plan holds
/// fewer bytes than its f32 conversion's, and distilling from it trains as distilling from
/// that conversion does.
#[test]
fn a_gguf_teacher_is_kept_as_its_blocks_and_teaches_as_its_conversion() {
    let tmp = tempfile::tempdir().unwrap();
    let model = with_tokenizer(tmp.path(), "memwall-llama-ckpt");
    let (gguf, conv, data, cache) = gguf_and_conversion(tmp.path(), &model, "f16");
    let env = [("XDG_CACHE_HOME", cache.to_str().unwrap())];
    let run = |args: &[&str]| {
        let o = common::memwall_env(&env, args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "memwall {args:?}:\n{err}");
        (String::from_utf8_lossy(&o.stdout).to_string(), err)
    };
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let m = p(&conv);
    let teacher_bytes = |teacher: &str| {
        let (out, _) = run(&[
            "plan",
            "--model",
            &m,
            "--seq",
            "24",
            "--batch",
            "2",
            "--threads",
            "2",
            "--json",
            "--distill-from",
            teacher,
        ]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["by_category"]["teacher"].as_u64().unwrap()
    };
    let (kept, f32s) = (teacher_bytes(&p(&gguf)), teacher_bytes(&p(&conv)));
    assert!(kept < f32s, "{kept} vs {f32s}");
    let losses = |name: &str, teacher: &str| {
        let extra = ["--distill-from", teacher];
        train_run(tmp.path(), (name, &conv, &data), &extra, &env)
    };
    let ((from_gguf, said), (from_conv, _)) = (losses("a", &p(&gguf)), losses("b", &p(&conv)));
    assert!(said.contains("kept as its blocks"), "{said}");
    assert_eq!(from_gguf.len(), 3);
    for (a, b) in from_gguf.iter().zip(&from_conv) {
        assert!((a - b).abs() < 1e-5 * b, "{from_gguf:?} vs {from_conv:?}");
    }
}

/// Distillation composes with the other strategies: offloading everything and recomputing
/// every layer train bitwise as in RAM; LoRA adapters start as the base (B = 0), so their
/// first step's loss is the full model's.
#[test]
fn distillation_composes_with_offload_recomputation_and_lora() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, data, pruned) = pruned_llama(tmp.path());
    let teacher = model.to_str().unwrap().to_string();
    let run = |name: &str, extra: &[&str]| {
        let mut args = vec!["--distill-from", teacher.as_str(), "--steps", "4"];
        args.extend(extra);
        train_losses(tmp.path(), name, &pruned, &data, &args)
    };
    let plain = run("plain", &[]);
    assert_eq!(run("offload", &["--offload", "all"]), plain);
    assert_eq!(run("recompute", &["--recompute", "full"]), plain);
    let lora = run("lora", &["--lora", "4"]);
    assert_eq!(lora[0], plain[0], "{lora:?} vs {plain:?}");
    assert!(lora[3] < lora[0], "{lora:?}");
}

/// `model` exported as a GGUF file of `ty` (`f16`, `q8_0`), its conversion (by
/// `memwall convert`) and data prepared with the conversion's tokenizer (the GGUF's), in
/// `tmp`; and the user cache it used, in `tmp`.
fn gguf_and_conversion(tmp: &Path, model: &Path, ty: &str) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    use memwall::export::{ExportOptions, export};
    data(tmp); // writes tmp/text.txt
    let gguf = tmp.join(format!("model.{ty}.gguf"));
    export(&ExportOptions {
        input: model.to_path_buf(),
        out: gguf.clone(),
        ty: ty.parse().unwrap(),
        name: None,
        adapter: None,
        progress: false,
    })
    .unwrap();
    let cache = tmp.join("cache");
    let conv = tmp.join("conv");
    let o = common::memwall_env(
        &[("XDG_CACHE_HOME", cache.to_str().unwrap())],
        &[
            "convert",
            gguf.to_str().unwrap(),
            "--out",
            conv.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let data = tmp.join("data-gguf");
    let tok = Tokenizer::from_file(conv.join("tokenizer.json")).unwrap();
    let text = tmp.join("text.txt");
    let prep = PrepareOptions {
        inputs: vec![text],
        out: data.clone(),
        val_fraction: 0.1,
    };
    prepare_with(&prep, &tok).unwrap();
    (gguf, conv, data, cache)
}

/// A model given as a GGUF file is scored as its blocks (a fraction of the f32 plan's
/// bytes) and keeps what its f32 conversion keeps, cut from that conversion; its candidates
/// are held in q8_0 (bf16 where rows are not whole blocks) and lose what f32 ones lose.
#[test]
fn a_gguf_model_is_scored_as_its_blocks_and_pruned_as_its_conversion() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = ModelSpec::from_hf_config_str(&config("llama"), "config.json").unwrap();
    let model = tmp.path().join("model");
    write_model(&model, &spec, &with_dead_parts(&spec, false).0);
    let (gguf, conv, data, _) = gguf_and_conversion(tmp.path(), &model, "q8_0");
    let shape = ShapeRequest {
        keep: Some(0.7),
        ..Default::default()
    };
    let run = |name: &str, gguf: Option<&Path>, quant: Option<&str>| {
        let out = tmp.path().join(name);
        let mut o = options(&conv, &data, &out, shape.clone());
        o.gguf = gguf.map(Path::to_path_buf);
        o.base_quant = quant.map(|q| q.parse().unwrap());
        (prune::prune(&o, &mut |_, _| {}).unwrap(), out)
    };
    let (blocks, a) = run("from-blocks", Some(&gguf), None);
    let (f32s, b) = run("from-f32", None, None);
    // A checkpoint quantized on load (--base-quant) is held so too.
    let (q4, _) = run("q4", None, Some("q4_0"));
    assert_eq!(q4.held.storage, "q4_0 blocks");
    assert!(q4.held.weight_bytes < blocks.held.weight_bytes);
    assert_eq!(q4.candidates.len(), f32s.candidates.len());
    assert!(
        blocks.held.storage.contains("blocks of"),
        "{:?}",
        blocks.held
    );
    assert_eq!(f32s.held.storage, "f32");
    // Q8_0: 8.5 bits a weight (the norms f32).
    assert!(
        blocks.held.weight_bytes * 3 < f32s.held.weight_bytes,
        "{:?} vs {:?}",
        blocks.held,
        f32s.held
    );
    assert_eq!(blocks.kept, f32s.kept);
    assert_eq!(blocks.after, f32s.after);
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(weights(&a) == weights(&b), "the same cut of the same files");
    assert!(blocks.candidates.len() > 1);
    for (q, f) in blocks.candidates.iter().zip(&f32s.candidates) {
        assert_eq!(q.shape, f.shape);
        assert!((q.loss - f.loss).abs() < 1e-2 * f.loss, "{q:?} vs {f:?}");
    }
}

/// Planning only: a Llama-2-7B held as q4_0 blocks while it is scored (one sequence of 256
/// tokens) plans less than its QLoRA step (rank 16 on a q4_0 base, 1 × 256), and a quarter
/// of what it would hold in f32; so does each candidate of `--keep 0.75` held in q8_0:
/// pruning a 7B takes no more memory than fine-tuning it so.
#[test]
fn scoring_a_7b_held_as_blocks_plans_less_than_its_qlora_step() {
    use memwall::dtype::GgmlType;
    use memwall::ir::BaseQuant;
    use prune::held::{Storage, plan};
    let spec = ModelSpec::preset("llama-2-7b").unwrap();
    let held = |quant| {
        let s = Storage { quant, types: None };
        plan(&spec, 256, &s, (2, DeviceId::CPU))
            .unwrap()
            .total_bytes()
    };
    let (blocks, f32s) = (
        held(BaseQuant::Blocks(GgmlType::Q4_0)),
        held(BaseQuant::F32),
    );
    let fit = FitMemory {
        bytes: u64::MAX,
        for_use: Use::Qlora,
        batch: 1,
        baseline: 0,
    };
    let qlora = prune::planned_peak(&spec, &fit, (256, 2), DeviceId::CPU).unwrap();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    assert!(
        blocks < qlora && 4 * blocks < f32s,
        "scoring {:.2} GiB, QLoRA step {:.2} GiB, f32 {:.2} GiB",
        gib(blocks),
        gib(qlora),
        gib(f32s)
    );
    let shape = ShapeRequest {
        keep: Some(0.75),
        ..Default::default()
    };
    let none = Path::new("unused");
    let shapes = prune::resolve_shapes(&spec, &options(none, none, none, shape)).unwrap();
    assert!(shapes.len() > 1);
    let q8 = Storage {
        quant: BaseQuant::Blocks(GgmlType::Q8_0),
        types: None,
    };
    for s in shapes {
        let c = plan(&s.apply(&spec), 256, &q8, (2, DeviceId::CPU)).unwrap();
        // With the head's copy the loss is computed with, in q8_0.
        let b = c.total_bytes() + (spec.vocab_size * s.hidden) as u64 * 34 / 32;
        assert!(b < qlora, "{s:?}: {:.2} GiB", gib(b));
    }
}
