//! Chat data sets end to end: `prepare` of the chat fixtures writes exactly what `Encoder`
//! gives (tokens, trained bits, example offsets, counts), split by whole examples, refuses a
//! bad line with its file:line leaving the directory as it was; `train` on it (full and
//! LoRA) lowers the loss and resumes bitwise.

mod common;
use common::memwall;
use memwall::data::Tokenizer;
use memwall::data::chat::{ChatPrepareOptions, ChatTemplate, Encoder, Outcome, TrainOn};
use memwall::data::examples::UNTRAINED;
use memwall::data::loader::Part;
use memwall::data::{DataSet, Shard};
use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

fn conversations() -> PathBuf {
    fixtures().join("conversations.jsonl")
}

/// The SmolLM2 tokenizer directory of the fixtures (as `tests/chat.rs` makes it).
fn smollm2_dir(dir: &Path) {
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("expected/smollm2.json")).unwrap(),
    )
    .unwrap();
    let mut raw = String::new();
    let gz = std::fs::File::open(fixtures().join("smollm2-tokenizer.json.gz")).unwrap();
    flate2::read::GzDecoder::new(gz)
        .read_to_string(&mut raw)
        .unwrap();
    let mut tok: Value = serde_json::from_str(&raw).unwrap();
    let added = tok["added_tokens"].as_array_mut().unwrap();
    added.extend(fixture["added_tokens"].as_array().unwrap().iter().cloned());
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let template = fixtures()
        .join("templates")
        .join(fixture["template"].as_str().unwrap());
    let mut config = fixture["tokenizer_config"].clone();
    config["chat_template"] = Value::from(std::fs::read_to_string(template).unwrap());
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

fn encoder(dir: &Path) -> Encoder {
    let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let template = ChatTemplate::load(Some(dir), None).unwrap().unwrap();
    Encoder::new(tok, Some(template), TrainOn::Answers)
}

/// Every example of the fixture file, as `Encoder` gives it: (ids, trained).
fn encoded(enc: &Encoder, path: &Path) -> Vec<(Vec<u32>, Vec<u8>)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|l| match enc.encode_line(l).unwrap() {
            Outcome::Example(e) => Some((e.ids, e.trained)),
            Outcome::NoAssistant(_) => None,
        })
        .collect()
}

fn all_tokens(s: &Shard) -> Vec<u32> {
    let mut v = vec![0; s.len()];
    s.read(0, &mut v).unwrap();
    v
}

/// The bits of a `.mask` file, one byte per token.
fn mask_bits(path: &Path) -> Vec<u8> {
    let raw = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(raw[16..24].try_into().unwrap()) as usize;
    (0..n).map(|i| (raw[24 + i / 8] >> (i % 8)) & 1).collect()
}

/// The offsets of an `.idx` file.
fn offsets(path: &Path) -> Vec<u64> {
    let raw = std::fs::read(path).unwrap();
    raw[24..]
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn prepare_writes_the_encoders_ids_bits_and_offsets_split_by_examples() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("smol");
    smollm2_dir(&tok);
    let enc = encoder(&tok);
    // The fixtures, and a conversation without an answer (warned, counted, left out).
    let input = tmp.path().join("chats.jsonl");
    let mut text = std::fs::read_to_string(conversations()).unwrap();
    text.truncate(text.trim_end().len());
    text.push_str("\n{\"messages\": [{\"role\": \"user\", \"content\": \"Anyone?\"}]}\n");
    std::fs::write(&input, text).unwrap();
    let want = encoded(&enc, &input);
    assert_eq!(want.len(), 8);

    let out = tmp.path().join("data");
    let mut warn = Vec::new();
    let s = memwall::data::chat::prepare_chat(
        &ChatPrepareOptions {
            inputs: vec![input.clone()],
            out: out.clone(),
            val_fraction: 0.25,
        },
        &enc,
        &mut warn,
    )
    .unwrap();
    let warn = String::from_utf8(warn).unwrap();
    assert!(
        warn.contains("chats.jsonl:9") && warn.contains("without an assistant turn"),
        "{warn}"
    );

    // The last quarter of the examples is the validation split.
    let (train, val) = want.split_at(6);
    let ds = DataSet::open(&out).unwrap();
    for (split, shard, examples) in [("train", &ds.train, train), ("val", &ds.val, val)] {
        let ids: Vec<u32> = examples.iter().flat_map(|e| e.0.clone()).collect();
        let bits: Vec<u8> = examples.iter().flat_map(|e| e.1.clone()).collect();
        assert_eq!(all_tokens(shard), ids, "{split} tokens");
        assert_eq!(
            mask_bits(&out.join(format!("{split}.mask"))),
            bits,
            "{split} bits"
        );
        let mut starts = vec![0u64];
        for e in examples {
            starts.push(starts.last().unwrap() + e.0.len() as u64);
        }
        assert_eq!(
            offsets(&out.join(format!("{split}.idx"))),
            starts,
            "{split} offsets"
        );
    }
    let count = |ex: &[(Vec<u32>, Vec<u8>)]| {
        (
            ex.iter().map(|e| e.0.len() as u64).sum::<u64>(),
            ex.iter()
                .map(|e| e.1.iter().map(|&b| b as u64).sum::<u64>())
                .sum::<u64>(),
        )
    };
    let ((tt, ttr), (vt, vtr)) = (count(train), count(val));
    assert_eq!(
        (s.train.examples, s.train.tokens, s.train.trained_tokens),
        (6, tt, ttr)
    );
    assert_eq!(
        (s.val.examples, s.val.tokens, s.val.trained_tokens),
        (2, vt, vtr)
    );
    assert_eq!(s.no_assistant, 1);
    let meta: Value =
        serde_json::from_slice(&std::fs::read(out.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["format"], "memwall-examples");
    assert_eq!(meta["data"], "chat");
    assert_eq!(meta["train_examples"], 6);
    assert_eq!(meta["val_examples"], 2);
    assert_eq!(meta["train_tokens"], tt);
    assert_eq!(meta["train_trained_tokens"], ttr);
    assert_eq!(meta["val_trained_tokens"], vtr);
    assert_eq!(meta["chat"]["train_on"], "answers");
    assert_eq!(meta["chat"]["no_assistant"], 1);
    assert_eq!(meta["chat"]["formats"]["messages"], 4);
    assert_eq!(
        meta["chat"]["template_hash"].as_str().unwrap(),
        enc.template().unwrap().hash()
    );
    assert_eq!(ds.meta.examples.unwrap().train, 6);

    // A row: the example's tokens, its untrained ones marked, then padding.
    let (ex, _) = ds.examples.as_ref().unwrap();
    let (ids, bits) = &train[1];
    let mut row = vec![0u32; ids.len() + 3];
    ex.fill_row(1, ds.meta.eot, &mut row).unwrap();
    for (j, (&id, &b)) in ids.iter().zip(bits).enumerate() {
        assert_eq!(
            row[j],
            if b == 1 { id } else { id | UNTRAINED },
            "token {j}"
        );
    }
    assert!(
        row[ids.len()..]
            .iter()
            .all(|&x| x == ds.meta.eot | UNTRAINED)
    );
    // Cut at the row's length.
    let mut short = vec![0u32; 5];
    ex.fill_row(1, ds.meta.eot, &mut short).unwrap();
    assert_eq!(short, row[..5]);
    assert!(ex.longer_than(ids.len() - 1).unwrap() >= 1);

    // Batches: a pure function of (seed, index); a rank's part is its rows of the whole;
    // packed or one example a row.
    for pack in [false, true] {
        let source = ds.train_source(pack);
        assert_eq!(source.packed(), pack);
        let (b, t) = (3, 20);
        let mut whole = vec![0u32; 2 * b * (t + 1)];
        source
            .fill((2 * b, t), 5, 9, Part::WHOLE, &mut whole)
            .unwrap();
        let mut again = vec![0u32; 2 * b * (t + 1)];
        source
            .fill((2 * b, t), 5, 9, Part::WHOLE, &mut again)
            .unwrap();
        assert_eq!(whole, again);
        for k in 0..2 {
            let mut part = vec![0u32; b * (t + 1)];
            source
                .fill((b, t), 5, 9, Part { index: k, of: 2 }, &mut part)
                .unwrap();
            assert_eq!(part, whole[k * b * (t + 1)..][..b * (t + 1)], "part {k}");
        }
    }
}

#[test]
fn a_bad_line_is_refused_with_its_place_and_nothing_is_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("smol");
    smollm2_dir(&tok);
    let enc = encoder(&tok);
    let out = tmp.path().join("data");
    let opts = |input: PathBuf| ChatPrepareOptions {
        inputs: vec![input],
        out: out.clone(),
        val_fraction: 0.25,
    };
    memwall::data::chat::prepare_chat(&opts(conversations()), &enc, &mut Vec::new()).unwrap();
    let before: Vec<(PathBuf, Vec<u8>)> = files(&out);

    let bad = tmp.path().join("bad.jsonl");
    let mut text = std::fs::read_to_string(conversations()).unwrap();
    text.push_str("{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"wizard\", \"content\": \"x\"}]}\n");
    std::fs::write(&bad, text).unwrap();
    let e = format!(
        "{:#}",
        memwall::data::chat::prepare_chat(&opts(bad.clone()), &enc, &mut Vec::new()).unwrap_err()
    );
    assert!(e.contains("bad.jsonl:9"), "{e}");
    let bad_json = tmp.path().join("broken.jsonl");
    std::fs::write(&bad_json, "{\"messages\": [\n").unwrap();
    let e = format!(
        "{:#}",
        memwall::data::chat::prepare_chat(&opts(bad_json), &enc, &mut Vec::new()).unwrap_err()
    );
    assert!(e.contains("broken.jsonl:1"), "{e}");
    // The earlier data set is whole, and no temporary file is left.
    assert_eq!(files(&out), before);
    DataSet::open(&out).unwrap();
}

/// Every file of `dir` with its bytes, by name.
fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

fn ok(args: &[&str]) -> String {
    let out = memwall(args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "memwall {args:?}: {text}");
    text
}

/// The training losses of a run's metrics.jsonl, by step.
fn losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|m| m["loss"].as_f64().or(m["update"]["loss"].as_f64()))
        .collect()
}

#[test]
fn prepare_and_train_on_chats_full_and_lora_resuming_bitwise() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("smol");
    smollm2_dir(&tok);
    let data = tmp.path().join("data");
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let said = ok(&[
        "prepare",
        &p(&conversations()),
        "--tokenizer",
        &p(&tok),
        "--out",
        &p(&data),
        "--val-fraction",
        "0.25",
    ]);
    assert!(said.contains("prepared 8 examples"), "{said}");
    // The template the examples were rendered with is kept beside them.
    let template = std::fs::read_to_string(data.join("chat_template.jinja")).unwrap();
    assert_eq!(
        template,
        ChatTemplate::load(Some(&tok), None)
            .unwrap()
            .unwrap()
            .source()
    );
    // Text flags are refused for text and chat flags for text.
    let e = memwall(&[
        "prepare",
        &p(&tok.join("tokenizer.json")),
        "--out",
        &p(&tmp.path().join("x")),
        "--train-on",
        "all",
    ]);
    assert!(!e.status.success());

    let train = |run: &Path, steps: &str, extra: &[&str]| {
        let mut a = vec![
            "train",
            "--model",
            "llama-tiny",
            "--data",
            &p(&data),
            "--out",
            &p(run),
            "--steps",
            steps,
            "--batch",
            "4",
            "--seq",
            "48",
            "--lr",
            "3e-3",
            "--save-every",
            "6",
            "--eval-every",
            "6",
            "--threads",
            "2",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
        a.extend(extra.iter().map(|s| s.to_string()));
        let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
        ok(&a)
    };
    let whole = tmp.path().join("whole");
    let said = train(&whole, "12", &[]);
    assert!(
        said.contains("6 training examples (chat)") && said.contains("cut"),
        "{said}"
    );
    let l = losses(&whole);
    assert_eq!(l.len(), 12, "{l:?}");
    // Each step's record counts the targets its loss is the mean over.
    let text = std::fs::read_to_string(whole.join("metrics.jsonl")).unwrap();
    let counted = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["loss"].is_number())
        .all(|m| m["trained_tokens"].as_u64().is_some_and(|n| n > 0));
    assert!(counted, "{text}");
    assert!(l[11] < 0.8 * l[0], "the loss falls: {l:?}");

    // Stopped at step 6 and resumed: bitwise the uninterrupted run.
    let halves = tmp.path().join("halves");
    train(&halves, "12", &[]);
    std::fs::remove_dir_all(halves.join("checkpoints/step-000012")).unwrap();
    ok(&["train", "--resume", &p(&halves), "--steps", "12"]);
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(whole.join("checkpoints/step-000012").join(f)).unwrap();
        let b = std::fs::read(halves.join("checkpoints/step-000012").join(f)).unwrap();
        assert!(a == b, "{f} differs after resume");
    }
    assert_eq!(losses(&halves), l);
    // Every checkpoint renders conversations as the run was trained on them.
    let saved = whole.join("checkpoints/step-000012/chat_template.jinja");
    assert_eq!(std::fs::read_to_string(saved).unwrap(), template);

    // LoRA on the same data (a random base: the adapters still lower the loss).
    let lora = tmp.path().join("lora");
    train(&lora, "12", &["--lora", "8"]);
    let ll = losses(&lora);
    assert!(ll.iter().all(|x| x.is_finite()) && ll[11] < ll[0], "{ll:?}");
    assert!(
        lora.join("checkpoints/step-000012/adapter_model.safetensors")
            .is_file()
    );
    let saved = lora.join("checkpoints/step-000012/chat_template.jinja");
    assert_eq!(std::fs::read_to_string(saved).unwrap(), template);

    // The validation loss walks the same examples once, packed or not: the same figure.
    let val0 = |run: &Path| -> f64 {
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        let first: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["step"], 0, "{first}");
        first["val_loss"].as_f64().unwrap()
    };
    let (packed, padded) = (tmp.path().join("packed"), tmp.path().join("padded"));
    train(&packed, "1", &[]);
    train(&padded, "1", &["--no-pack"]);
    let (a, b) = (val0(&packed), val0(&padded));
    assert!(
        (a - b).abs() <= 1e-5 * b.abs(),
        "packed {a} vs one a row {b}"
    );
}

#[test]
fn damaged_example_files_are_refused_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("smol");
    smollm2_dir(&tok);
    let enc = encoder(&tok);
    let out = tmp.path().join("data");
    let opts = ChatPrepareOptions {
        inputs: vec![conversations()],
        out: out.clone(),
        val_fraction: 0.25,
    };
    memwall::data::chat::prepare_chat(&opts, &enc, &mut Vec::new()).unwrap();
    let err = || format!("{:#}", DataSet::open(&out).unwrap_err());
    let keep = |name: &str| std::fs::read(out.join(name)).unwrap();
    let (idx, mask, meta) = (keep("train.idx"), keep("val.mask"), keep("meta.json"));

    // A truncated index.
    std::fs::write(out.join("train.idx"), &idx[..idx.len() - 1]).unwrap();
    let e = err();
    assert!(e.contains("train.idx") && e.contains("truncated"), "{e}");
    // Offsets that go back.
    let mut bad = idx.clone();
    bad[24 + 8..24 + 16].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(out.join("train.idx"), &bad).unwrap();
    let e = err();
    assert!(e.contains("train.idx") && e.contains("corrupt"), "{e}");
    std::fs::write(out.join("train.idx"), &idx).unwrap();
    // A mask missing.
    std::fs::remove_file(out.join("val.mask")).unwrap();
    let e = err();
    assert!(e.contains("val.mask"), "{e}");
    std::fs::write(out.join("val.mask"), &mask).unwrap();
    // meta.json's example count disagreeing with the index.
    let mut m: Value = serde_json::from_slice(&meta).unwrap();
    m["train_examples"] = 5.into();
    std::fs::write(out.join("meta.json"), m.to_string()).unwrap();
    let e = err();
    assert!(e.contains("inconsistent") && e.contains("train"), "{e}");
    std::fs::write(out.join("meta.json"), &meta).unwrap();
    DataSet::open(&out).unwrap();
}

/// Which inputs `prepare` reads as chat data: a folder's own `.jsonl` files beside a README
/// (named in a note), never a `.json` file or `.jsonl` files only in subfolders (refused,
/// naming them), and text otherwise.
#[test]
fn chat_inputs_are_told_from_text_and_odd_layouts_are_named() {
    use memwall::data::chat::is_chat_input;
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let line = "{\"prompt\": \"Hi\", \"completion\": \"Hello\"}\n";
    let folder = d.join("with-readme");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("a.jsonl"), line).unwrap();
    std::fs::write(folder.join("README.md"), "# data\n").unwrap();
    let mut notes = Vec::new();
    assert!(is_chat_input(std::slice::from_ref(&folder), &mut |n| notes.push(n)).unwrap());
    assert!(
        notes.len() == 1 && notes[0].contains("README.md") && notes[0].contains("not read"),
        "{notes:?}"
    );
    let refused =
        |inputs: &[PathBuf]| format!("{:#}", is_chat_input(inputs, &mut |_| {}).unwrap_err());
    let json = d.join("chats.json");
    std::fs::write(&json, line).unwrap();
    let e = refused(std::slice::from_ref(&json));
    assert!(e.contains("chats.json") && e.contains(".jsonl"), "{e}");
    let nested = d.join("nest");
    std::fs::create_dir_all(nested.join("sub")).unwrap();
    std::fs::write(nested.join("sub").join("b.jsonl"), line).unwrap();
    let e = refused(std::slice::from_ref(&nested));
    assert!(e.contains("sub") && e.contains("subfolder"), "{e}");
    let text = d.join("t.txt");
    std::fs::write(&text, "Some text.\n").unwrap();
    assert!(!is_chat_input(std::slice::from_ref(&text), &mut |_| {}).unwrap());
    let e = refused(&[folder, text]);
    assert!(e.contains("mix chat data"), "{e}");
}
