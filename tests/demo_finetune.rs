//! `memwall demo finetune` end to end on the real SmolLM2-135M-Instruct, kept tiny (2 steps of
//! 1 x 32 tokens): the GGUF is found through `$MEMWALL_SMOLLM2_GGUF` (`.ci/run` fetches it),
//! converted into the user cache, answers, is fine-tuned on Shakespeare, and samples.

use memwall::demo::finetune::{FinetuneOptions, run};
use memwall::run_dir::{RunDir, metrics};

#[test]
#[ignore = "needs the SmolLM2 GGUF (set MEMWALL_SMOLLM2_GGUF)"]
fn smollm2_finetune_demo_records_losses_before_and_after_and_samples() {
    let gguf = std::env::var_os("MEMWALL_SMOLLM2_GGUF").filter(|v| !v.is_empty());
    let gguf = gguf.expect("set MEMWALL_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        std::path::Path::new(&gguf).is_file(),
        "MEMWALL_SMOLLM2_GGUF={} is not a file",
        gguf.to_string_lossy()
    );
    let tmp = tempfile::tempdir().unwrap();
    let mut o = FinetuneOptions::new(tmp.path(), 2);
    o.steps = 2;
    o.batch = 1;
    o.seq = 32;
    o.eval_batches = 2;
    o.answer_tokens = 4;
    o.sample_tokens = 8;
    let r = run(&o).unwrap();

    assert!(
        r.val_before.is_finite() && r.val_after.is_finite(),
        "{} -> {}",
        r.val_before,
        r.val_after
    );
    // A pretrained model: far below the 10.8 of a uniform guess over 49,152 tokens.
    assert!(r.val_before > 1.0 && r.val_before < 6.0, "{}", r.val_before);
    let recorded = metrics::read(&RunDir::new(&tmp.path().join("run-smollm2")).metrics()).unwrap();
    assert_eq!(recorded.first().unwrap().val_loss, Some(r.val_before));
    assert_eq!(recorded.last().unwrap().step, 2);
    assert_eq!(recorded.last().unwrap().val_loss, Some(r.val_after));
    assert!(r.answer.contains("Paris"), "greedy answer: {:?}", r.answer);
    assert!(!r.sample_before.trim().is_empty() && !r.sample_after.trim().is_empty());
    assert!(r.checkpoint.join("tokenizer.json").is_file());

    // A second run reuses the data prepared with the model's tokenizer.
    let meta = tmp.path().join("data-smollm2/meta.json");
    let written = std::fs::metadata(&meta).unwrap().modified().unwrap();
    o.steps = 1;
    let again = run(&o).unwrap();
    assert!(again.val_after.is_finite());
    assert_eq!(
        std::fs::metadata(&meta).unwrap().modified().unwrap(),
        written
    );
}
