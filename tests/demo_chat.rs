//! `memwall demo chat` end to end on the real SmolLM2-135M-Instruct, kept tiny (2 LoRA steps
//! of 1 conversation): the GGUF is found through `$MEMWALL_SMOLLM2_GGUF` (`.ci/run` fetches
//! it), the conversation set built from the Shakespeare corpus, prepared with the model's chat
//! template, the held-out question answered before and after, the losses on the answers
//! recorded.

use memwall::data::chat::{Format, parse_line};
use memwall::demo::chat::{ChatOptions, run};
use memwall::run_dir::{RunDir, metrics};

#[test]
#[ignore = "needs the SmolLM2 GGUF (set MEMWALL_SMOLLM2_GGUF)"]
fn smollm2_chat_demo_answers_before_and_after_and_records_losses_on_answers() {
    let gguf = std::env::var_os("MEMWALL_SMOLLM2_GGUF").filter(|v| !v.is_empty());
    let gguf = gguf.expect("set MEMWALL_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        std::path::Path::new(&gguf).is_file(),
        "MEMWALL_SMOLLM2_GGUF={} is not a file",
        gguf.to_string_lossy()
    );
    let tmp = tempfile::tempdir().unwrap();
    let mut o = ChatOptions::new(tmp.path(), 2);
    o.steps = 2;
    o.batch = 1;
    o.eval_batches = 2;
    o.answer_tokens = 6;
    let r = run(&o).unwrap();

    // The loss on answers only: finite, and that of a pretrained model (far below the 10.8 of
    // a uniform guess over 49,152 tokens).
    assert!(
        r.val_before.is_finite() && r.val_after.is_finite(),
        "{} -> {}",
        r.val_before,
        r.val_after
    );
    assert!(r.val_before > 1.0 && r.val_before < 8.0, "{}", r.val_before);
    let recorded = metrics::read(&RunDir::new(&tmp.path().join("run-chat")).metrics()).unwrap();
    assert_eq!(recorded.first().unwrap().val_loss, Some(r.val_before));
    assert_eq!(recorded.last().unwrap().step, 2);
    assert_eq!(recorded.last().unwrap().val_loss, Some(r.val_after));

    assert!(!r.answer_before.trim().is_empty() && !r.answer_after.trim().is_empty());
    assert!(r.checkpoint.join("adapter_config.json").is_file());
    assert!(r.checkpoint.join("adapter_model.safetensors").is_file());

    // The conversations the user can reuse: `messages` lines, the held-out question among
    // the validation ones (the last lines), not the training ones.
    let text = std::fs::read_to_string(&r.jsonl).unwrap();
    let held = r.held_out.user.as_str();
    let mut positions = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let record = parse_line(line).unwrap();
        assert_eq!(record.format(), Format::Messages, "line {}", i + 1);
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["messages"][0]["content"] == held {
            positions.push(i);
        }
    }
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("data-chat/meta.json")).unwrap(),
    )
    .unwrap();
    let train = meta["train_examples"].as_u64().unwrap() as usize;
    let val = meta["val_examples"].as_u64().unwrap() as usize;
    assert_eq!(train + val, text.lines().count());
    assert_eq!(positions.len(), 1, "{held:?} at lines {positions:?}");
    assert!(
        positions[0] >= train,
        "the held-out question is a training example"
    );
}
