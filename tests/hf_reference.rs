//! Agreement with the reference implementation: a tiny random GPT-2 saved by Hugging Face
//! transformers (tests/fixtures/hf-tiny-gpt2, made by make_hf_fixture.py) loads, and memwall
//! computes the same logits, the same loss and the same greedy continuation as transformers.

use memwall::backend::cpu::Cpu;
use memwall::ckpt;
use memwall::exec::Executor;
use memwall::exec::generate::{SampleOptions, generate_tokens};
use memwall::plan::{Mode, StepConfig, build_plan};
use std::path::PathBuf;

fn fixture() -> (PathBuf, serde_json::Value) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny-gpt2");
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

#[test]
fn logits_and_loss_match_transformers() {
    let (dir, exp) = fixture();
    let spec = ckpt::load_spec(&dir).unwrap();
    let prompt = ids(&exp["prompt"]);
    let plan = build_plan(&spec, &StepConfig::new(1, 16, 2), Mode::Generate, &Cpu).unwrap();
    let layout = plan.layout.clone();
    let mut ex = Executor::new(plan).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(&dir, &layout, p))
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
    let plan = build_plan(&spec, &StepConfig::new(1, t, 2), Mode::Train, &Cpu).unwrap();
    let mut ex = Executor::new(plan).unwrap();
    ex.with_params_mut(|p| ckpt::load_params(&dir, &layout, p))
        .unwrap();
    ex.upload_batch(&seq).unwrap();
    let loss = ex.eval_loss() as f64;
    let want = exp["loss_on_greedy_sequence"].as_f64().unwrap();
    assert!(
        (loss - want).abs() < 1e-4,
        "loss: memwall {loss} vs transformers {want}"
    );
}

#[test]
fn greedy_decoding_picks_the_reference_tokens() {
    let (dir, exp) = fixture();
    let want = ids(&exp["greedy"]);
    let opts = SampleOptions {
        checkpoint: dir,
        prompt: String::new(),
        tokens: want.len(),
        temperature: 0.0,
        top_k: 0,
        seed: 1,
        threads: 2,
    };
    let got = generate_tokens(&opts, &ids(&exp["prompt"]), &mut |_| {}).unwrap();
    assert_eq!(got, want);
}
