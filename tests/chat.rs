//! Chat data against transformers: for the SmolLM2, Llama 3, Qwen2.5, Qwen3, Phi-3.5 and Gemma 3
//! chat templates, every conversation of `tests/fixtures/chat/conversations.jsonl` renders to the
//! same text and the same token ids as `apply_chat_template(…, tokenize=True)`, with the
//! trained-token mask that `make_chat_fixtures.py` computed (TRL's prefix method, checked there
//! against transformers' `return_assistant_tokens_mask` on a `{% generation %}` copy of the
//! SmolLM2, Qwen3, Phi-3.5 and Gemma 3 templates); and templates that raise, are not
//! prefix-stable or rewrite an answer are refused.

mod common;
use common::memwall;
use memwall::data::Tokenizer;
use memwall::data::chat::{ChatTemplate, Encoder, Format, Outcome, TrainOn};
use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

fn expected(name: &str) -> Value {
    let path = fixtures().join(format!("expected/{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A tokenizer directory as the fixture script made it: SmolLM2's tokenizer.json with the
/// fixture's added tokens, and a tokenizer_config.json with its special tokens and template.
fn tokenizer_dir(fixture: &Value, dir: &Path) {
    let mut raw = String::new();
    let gz = std::fs::File::open(fixtures().join("smollm2-tokenizer.json.gz")).unwrap();
    flate2::read::GzDecoder::new(gz)
        .read_to_string(&mut raw)
        .unwrap();
    let mut tok: Value = serde_json::from_str(&raw).unwrap();
    let added = tok["added_tokens"].as_array_mut().unwrap();
    added.extend(fixture["added_tokens"].as_array().unwrap().iter().cloned());
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let template = fixtures()
        .join("templates")
        .join(fixture["template"].as_str().unwrap());
    let mut config = fixture["tokenizer_config"].clone();
    config["chat_template"] = Value::from(std::fs::read_to_string(template).unwrap());
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

fn encoder(name: &str, train_on: TrainOn) -> (Encoder, Value, tempfile::TempDir) {
    let fixture = expected(name);
    let dir = tempfile::tempdir().unwrap();
    tokenizer_dir(&fixture, dir.path());
    let tok = Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    let template = ChatTemplate::load(Some(dir.path()), None).unwrap().unwrap();
    (Encoder::new(tok, Some(template), train_on), fixture, dir)
}

fn example(enc: &Encoder, line: &str) -> memwall::data::chat::Encoded {
    match enc.encode_line(line).unwrap() {
        Outcome::Example(e) => e,
        other => panic!("{line}: {other:?}"),
    }
}

fn check_against_transformers(name: &str) {
    let (enc, fixture, _dir) = encoder(name, TrainOn::Answers);
    let examples = fixture["examples"].as_array().unwrap();
    assert!(examples.len() >= 7, "{name}");
    let mut formats = std::collections::BTreeSet::new();
    for ex in examples {
        let line = ex["line"].as_str().unwrap();
        let got = example(&enc, line);
        formats.insert(got.format);
        assert_eq!(got.text, ex["text"].as_str().unwrap(), "{name}: {line}");
        let ids: Vec<u32> = serde_json::from_value(ex["ids"].clone()).unwrap();
        assert_eq!(got.ids, ids, "{name}: {line}");
        let trained: Vec<u8> = serde_json::from_value(ex["trained"].clone()).unwrap();
        assert_eq!(got.trained, trained, "{name}: {line}");
        if got.format != Format::Text {
            // The trained tokens are the answers: some but not all, and each span decodes to
            // text that holds an answer.
            assert!(
                trained.contains(&0) && trained.contains(&1),
                "{name}: {line}"
            );
            // Each ends a turn: a newline, Llama 3's end of turn, or (the last answer, with
            // Phi-3's template) the eos the rendering closes with.
            let eos = fixture["tokenizer_config"]["eos_token"].as_str().unwrap();
            for &(s, e) in &got.spans {
                let span = &got.text[s..e];
                assert!(
                    span.ends_with('\n') || span.ends_with("<|eot_id|>") || span.ends_with(eos),
                    "{span:?}"
                );
            }
        }
    }
    // Every format of the conversations file was exercised.
    assert_eq!(formats.len(), 5, "{name}: {formats:?}");
    // --train-on all: the same tokens, every one trained.
    let (all, _, _dir) = encoder(name, TrainOn::All);
    for ex in examples {
        let got = example(&all, ex["line"].as_str().unwrap());
        let ids: Vec<u32> = serde_json::from_value(ex["ids"].clone()).unwrap();
        assert_eq!(got.ids, ids);
        assert!(got.trained.iter().all(|&t| t == 1));
    }
}

#[test]
fn smollm2_template_as_transformers() {
    check_against_transformers("smollm2");
}

#[test]
fn llama3_template_as_transformers() {
    check_against_transformers("llama3");
    // Llama 3 trims every content: an answer with surrounding spaces would train on text
    // other than the answer as written, and is refused.
    let (enc, fixture, _dir) = encoder("llama3", TrainOn::Answers);
    let refused = fixture["refused"].as_array().unwrap();
    assert_eq!(refused.len(), 1);
    let e = format!(
        "{:#}",
        enc.encode_line(refused[0].as_str().unwrap()).unwrap_err()
    );
    assert!(
        e.contains("renders assistant turn 3 differently from its content")
            && e.contains("\" yes, kept \""),
        "{e}"
    );
}

#[test]
fn qwen25_template_as_transformers() {
    check_against_transformers("qwen2.5");
}

/// Qwen3's template (thinking handling: an empty `<think>` block before an answer after the
/// last user turn, none before the earlier ones) renders as transformers renders it, with the
/// mask the fixture script checked against `return_assistant_tokens_mask`.
#[test]
fn qwen3_template_as_transformers() {
    check_against_transformers("qwen3");
    let (enc, fixture, _dir) = encoder("qwen3", TrainOn::Answers);
    // Two answers: the first without the block, the last with it, each trained with its end
    // of turn.
    let ex = &fixture["examples"][1];
    let got = example(&enc, ex["line"].as_str().unwrap());
    let spans: Vec<&str> = got.spans.iter().map(|&(s, e)| &got.text[s..e]).collect();
    assert_eq!(
        spans,
        [
            "2 + 2 = 4.<|im_end|>\n",
            "<think>\n\n</think>\n\n(2 + 2) × 10 = 40.<|im_end|>\n"
        ]
    );
    // An earlier answer whose text the template rewrites (its reasoning dropped) is refused.
    let e = format!(
        "{:#}",
        enc.encode_line(r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>hmm</think>Hello"}, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye"}]}"#)
            .unwrap_err()
    );
    assert!(e.contains("assistant turn 2"), "{e}");
}

/// Phi-3.5's template (each turn closed by `<|end|>`, the eos after the last one only when no
/// generation prompt follows) renders as transformers renders it; an earlier answer is
/// trained with its `<|end|>\n`, the last with the closing eos too, the mask the fixture script
/// checked against `return_assistant_tokens_mask`.
#[test]
fn phi35_template_as_transformers() {
    check_against_transformers("phi3.5");
    let (enc, fixture, _dir) = encoder("phi3.5", TrainOn::Answers);
    let ex = &fixture["examples"][1];
    let got = example(&enc, ex["line"].as_str().unwrap());
    let spans: Vec<&str> = got.spans.iter().map(|&(s, e)| &got.text[s..e]).collect();
    assert_eq!(
        spans,
        [
            "2 + 2 = 4.<|end|>\n",
            "(2 + 2) × 10 = 40.<|end|>\n<|endoftext|>"
        ]
    );
}

/// Gemma 3's template (google/gemma-3-*-it's: `<bos>` first, a system message folded into the
/// first user turn, the assistant named `model`, every content trimmed, roles that do not
/// alternate raised on) renders as transformers renders it; an answer is trained with its
/// `<end_of_turn>\n` and nothing of `<start_of_turn>model\n`, the mask the fixture script
/// checked against `return_assistant_tokens_mask`.
#[test]
fn gemma3_template_as_transformers() {
    check_against_transformers("gemma3");
    let (enc, fixture, _dir) = encoder("gemma3", TrainOn::Answers);
    let ex = &fixture["examples"][1];
    let got = example(&enc, ex["line"].as_str().unwrap());
    assert!(
        got.text.starts_with(
            "<bos><start_of_turn>user\nYou answer in one short sentence.\n\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n"
        ),
        "{:?}",
        got.text
    );
    let spans: Vec<&str> = got.spans.iter().map(|&(s, e)| &got.text[s..e]).collect();
    assert_eq!(
        spans,
        [
            "2 + 2 = 4.<end_of_turn>\n",
            "(2 + 2) × 10 = 40.<end_of_turn>\n"
        ]
    );
    // The trained tokens are exactly those spans' (the answer's first token starts after
    // `model\n`; <end_of_turn> and the newline after it are tokens of their own), and of the
    // four <end_of_turn> tokens only the answers' two are trained.
    let marked: Vec<&str> = got.marked.iter().map(|&(s, e)| &got.text[s..e]).collect();
    assert_eq!(marked, spans);
    let trained: Vec<u32> = (got.ids.iter().zip(&got.trained))
        .filter(|&(_, &t)| t == 1)
        .map(|(&id, _)| id)
        .collect();
    assert_eq!(enc.tokenizer().decode(&trained), spans.concat());
    let (end_of_turn, _) = enc.tokenizer().encode_rendered("<end_of_turn>").unwrap();
    let [end_of_turn] = end_of_turn[..] else {
        panic!("{end_of_turn:?}")
    };
    assert_eq!(got.ids.iter().filter(|&&id| id == end_of_turn).count(), 4);
    assert_eq!(trained.iter().filter(|&&id| id == end_of_turn).count(), 2);
    // The template trims an answer with surrounding whitespace: refused, as with Llama 3.
    let refused = fixture["refused"].as_array().unwrap();
    assert_eq!(refused.len(), 1);
    let e = format!(
        "{:#}",
        enc.encode_line(refused[0].as_str().unwrap()).unwrap_err()
    );
    assert!(
        e.contains("renders assistant turn 3 differently from its content")
            && e.contains("\" yes, kept \""),
        "{e}"
    );
    // Roles that do not alternate: the template's own exception.
    let e = format!(
        "{:#}",
        enc.encode_line(r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Hello"}]}"#)
            .unwrap_err()
    );
    assert_eq!(
        e,
        "the chat template raised: Conversation roles must alternate user/assistant/user/assistant/..."
    );
}

fn inline(source: &str) -> Encoder {
    let (enc, _, _dir) = encoder("smollm2", TrainOn::Answers);
    let t = ChatTemplate::new(source.into(), "inline.jinja".into(), Default::default()).unwrap();
    Encoder::new(enc.tokenizer().clone(), Some(t), TrainOn::Answers)
}

const TWO_TURNS: &str = r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Hello again"}]}"#;

#[test]
fn refusals_and_conversations_without_answers() {
    // A template that raises is refused with its message.
    let raising = inline(
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{{ m.content }}{% endfor %}",
    );
    let e = format!(
        "{:#}",
        raising
            .encode_line(r#"{"messages": [{"role": "assistant", "content": "x"}]}"#)
            .unwrap_err()
    );
    assert_eq!(
        e,
        "the chat template raised: Conversation roles must alternate user/assistant/user/assistant/..."
    );
    assert!(raising.encode_line(TWO_TURNS).is_ok());

    // A template that renders a turn differently when another follows it.
    let unstable = inline(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last %}|{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    );
    let e = format!("{:#}", unstable.encode_line(TWO_TURNS).unwrap_err());
    assert!(
        e.contains("not prefix-stable") && e.contains("turn 2"),
        "{e}"
    );

    // A template that rewrites the answer.
    let upper = inline(
        "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    );
    let e = format!("{:#}", upper.encode_line(TWO_TURNS).unwrap_err());
    assert!(
        e.contains("renders assistant turn 2 differently") && e.contains("\"HELLO\""),
        "{e}"
    );

    // No assistant turn: nothing to train, reported for counting (whatever --train-on).
    let (enc, _, _dir) = encoder("smollm2", TrainOn::All);
    let line = r#"{"conversations": [{"from": "human", "value": "Hi"}]}"#;
    assert_eq!(
        enc.encode_line(line).unwrap(),
        Outcome::NoAssistant(Format::ShareGpt)
    );

    // A tokenizer without a template: conversations are refused naming --chat-template, raw
    // text is still encoded.
    let bare = Encoder::new(enc.tokenizer().clone(), None, TrainOn::Answers);
    let e = format!("{:#}", bare.encode_line(TWO_TURNS).unwrap_err());
    assert!(e.contains("--chat-template FILE"), "{e}");
    assert!(matches!(
        bare.encode_line(r#"{"text": "plain"}"#).unwrap(),
        Outcome::Example(_)
    ));
}

#[test]
fn tokenize_command_prints_what_transformers_gives() {
    let fixture = expected("qwen2.5");
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("qwen");
    std::fs::create_dir(&tok).unwrap();
    tokenizer_dir(&fixture, &tok);
    // A folder: b.jsonl.gz holds the second half of the examples, a.jsonl the first.
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let examples = fixture["examples"].as_array().unwrap();
    let lines: Vec<&str> = examples
        .iter()
        .map(|e| e["line"].as_str().unwrap())
        .collect();
    let half = lines.len() / 2;
    std::fs::write(data.join("a.jsonl"), lines[..half].join("\n")).unwrap();
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(data.join("b.jsonl.gz")).unwrap(),
        flate2::Compression::default(),
    );
    std::io::Write::write_all(&mut gz, lines[half..].join("\n").as_bytes()).unwrap();
    gz.finish().unwrap();

    let (t, d) = (tok.to_str().unwrap(), data.to_str().unwrap());
    let out = memwall(&["tokenize", "--tokenizer", t, "--chat", d, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(got.len(), examples.len());
    for (g, e) in got.iter().zip(examples) {
        for key in ["text", "ids", "trained"] {
            assert_eq!(g[key], e[key], "{key}: {}", e["line"]);
        }
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{} examples", examples.len())),
        "{stderr}"
    );

    // Not a terminal: trained text between ⟦ and ⟧, each example headed by its place.
    let out = memwall(&["tokenize", "--tokenizer", t, "--chat", d]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("a.jsonl:1 (messages"), "{text}");
    assert!(
        text.contains("<|im_start|>assistant\n⟦William Shakespeare, around 1600.<|im_end|>\n⟧"),
        "{text}"
    );

    // A template that raises: refused with its message, the file and the line.
    let raising = tmp.path().join("raising.jinja");
    std::fs::write(
        &raising,
        "{% if messages[0].role != 'system' %}{{ raise_exception('System turn required') }}{% endif %}",
    )
    .unwrap();
    let out = memwall(&[
        "tokenize",
        "--tokenizer",
        t,
        "--chat",
        d,
        "--chat-template",
        raising.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("a.jsonl:1") && stderr.contains("raised: System turn required"),
        "{stderr}"
    );
    // A malformed line: refused with its place.
    std::fs::write(data.join("c.jsonl"), "{\"text\": \"ok\"}\n{\"messages\": [").unwrap();
    let out = memwall(&["tokenize", "--tokenizer", t, "--chat", d]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("c.jsonl:2") && stderr.contains("not valid JSON"),
        "{stderr}"
    );
}
