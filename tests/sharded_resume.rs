//! A training run that writes sharded checkpoints (a small `max_shard_bytes`) with the model
//! directory's tokenizer files, resumed bitwise from a sharded checkpoint; and `--init` from
//! such a checkpoint taking its tokenizer files along.

mod common;

use memwall::ckpt;
use memwall::data::{PrepareOptions, Tokenizer, prepare_with};
use memwall::exec::train::{NoProgress, TrainOptions, resume_options, train};
use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

fn file_names(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

#[test]
fn sharded_checkpoints_resume_bitwise_and_carry_the_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    // A model directory: config.json and tokenizer files, as a Hugging Face download has, and
    // data prepared with that tokenizer (training refuses data from another one).
    let model = tmp.path().join("hf-model");
    fs::create_dir_all(&model).unwrap();
    fs::copy(common::micro_config(tmp.path()), model.join("config.json")).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-bpe");
    let tokenizer = fs::read(fixture.join("tokenizer.json")).unwrap();
    fs::write(model.join("tokenizer.json"), &tokenizer).unwrap();
    let data = tmp.path().join("data");
    prepare_with(
        &PrepareOptions {
            inputs: vec![common::small_corpus(tmp.path())],
            out: data.clone(),
            val_fraction: 0.05,
        },
        &Tokenizer::from_file(model.join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    fs::write(
        model.join("generation_config.json"),
        b"{\"eos_token_id\": 50256}",
    )
    .unwrap();

    let mut o = TrainOptions::new(model.to_str().unwrap(), &data, &tmp.path().join("full"));
    o.steps = 8;
    o.batch = 2;
    o.seq = 32;
    o.threads = 2;
    o.save_every = 4;
    o.eval_every = 4;
    o.warmup = 2;
    o.max_shard_bytes = 8192;
    train(&o, None, &mut NoProgress).unwrap();
    let full4 = tmp.path().join("full/checkpoints/step-000004");
    let names = file_names(&full4);
    assert!(!names.contains(ckpt::MODEL_FILE), "{names:?}");
    assert!(names.contains(ckpt::MODEL_INDEX_FILE), "{names:?}");
    let shards = names.iter().filter(|n| n.starts_with("model-")).count();
    assert!(shards >= 3, "{names:?}");
    assert_eq!(fs::read(full4.join("tokenizer.json")).unwrap(), tokenizer);
    assert!(names.contains("generation_config.json"), "{names:?}");

    // An interrupted twin: the run stopped after step 4, resumed from its sharded checkpoint.
    let cut = tmp.path().join("cut");
    let dst = cut.join("checkpoints/step-000004");
    fs::create_dir_all(&dst).unwrap();
    for f in &names {
        fs::copy(full4.join(f), dst.join(f)).unwrap();
    }
    let (opts, ck) = resume_options(&cut).unwrap();
    assert_eq!(opts.max_shard_bytes, 8192);
    assert_eq!(opts.tokenizer_dir.as_deref(), Some(model.as_path()));
    let s = train(&opts, Some(&ck), &mut NoProgress).unwrap();
    assert_eq!((s.first_step, s.last_step), (4, 8));
    let a = tmp.path().join("full/checkpoints/step-000008");
    let b = cut.join("checkpoints/step-000008");
    assert_eq!(file_names(&a), file_names(&b));
    for f in file_names(&a) {
        if f == ckpt::STATE_FILE {
            continue; // holds the run directory's path
        }
        assert!(
            fs::read(a.join(&f)).unwrap() == fs::read(b.join(&f)).unwrap(),
            "{f} differs between the resumed and the uninterrupted run"
        );
    }

    // Fine-tuning from that checkpoint (--init) takes its tokenizer files, not --model's
    // (a config.json file here, no directory).
    let mut f = TrainOptions::new(
        common::micro_config(tmp.path()).to_str().unwrap(),
        &data,
        &tmp.path().join("tuned"),
    );
    f.init = Some(a.clone());
    f.steps = 1;
    f.batch = 2;
    f.seq = 32;
    f.threads = 2;
    f.eval_batches = 1;
    train(&f, None, &mut NoProgress).unwrap();
    let (tuned, ck) = resume_options(&tmp.path().join("tuned")).unwrap();
    assert_eq!(tuned.tokenizer_dir.as_deref(), Some(a.as_path()));
    assert_eq!(tuned.max_shard_bytes, ckpt::DEFAULT_MAX_SHARD_BYTES);
    assert!(ck.join(ckpt::MODEL_FILE).is_file(), "one file below 5 GB");
    assert_eq!(fs::read(ck.join("tokenizer.json")).unwrap(), tokenizer);
}

#[test]
fn a_tokenizer_dir_without_tokenizer_json_is_refused_before_work() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = common::micro_config(tmp.path());
    let out = tmp.path().join("run");
    let mut o = TrainOptions::new(cfg.to_str().unwrap(), &tmp.path().join("data"), &out);
    let gone = tmp.path().join("no-tokenizer-here");
    fs::create_dir_all(&gone).unwrap();
    o.tokenizer_dir = Some(gone.clone());
    let e = format!("{:#}", train(&o, None, &mut NoProgress).unwrap_err());
    assert!(
        e.contains(&gone.display().to_string()) && e.contains("tokenizer.json"),
        "{e}"
    );
    assert!(!out.exists(), "nothing written");
}
