//! What a new user broke (issue [hardening-2]), each case from its reproduction through the
//! command line: no command writes over or deletes what memwall did not write, and a run, an
//! export, a merge or a sample refuses a base that is no longer the model it trained on.
//!
//! The models are tiny Llamas with the `tiny-bpe` fixture's tokenizer; a "downloaded" GGUF
//! file is one memwall exported with its export mark renamed away (a file memwall did not
//! write, as far as memwall can tell).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A sandbox: a user cache of its own and the tiny models, data and files of a trial.
struct Trial {
    tmp: tempfile::TempDir,
}

impl Trial {
    fn new() -> Trial {
        Trial {
            tmp: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    fn s(&self, name: &str) -> String {
        self.path(name).to_str().unwrap().to_string()
    }

    /// memwall in `cwd` with the trial's user cache.
    fn run_in(&self, cwd: &Path, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_memwall"))
            .env("XDG_CACHE_HOME", self.path("cache"))
            .current_dir(cwd)
            .args(args)
            .output()
            .expect("run memwall")
    }

    fn ok_in(&self, cwd: &Path, args: &[&str]) -> String {
        let o = self.run_in(cwd, args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "memwall {args:?} failed:\n{err}");
        format!("{}{err}", String::from_utf8_lossy(&o.stdout))
    }

    fn ok(&self, args: &[&str]) -> String {
        self.ok_in(self.tmp.path(), args)
    }

    /// memwall failing cleanly (status 1 or 2, an `error:` line, no panic); its stderr.
    fn fails_in(&self, cwd: &Path, args: &[&str]) -> String {
        let o = self.run_in(cwd, args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            matches!(o.status.code(), Some(1 | 2)),
            "memwall {args:?} should fail cleanly ({:?}):\n{err}",
            o.status
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.lines().any(|l| l.starts_with("error: ")), "{err}");
        err
    }

    fn fails(&self, args: &[&str]) -> String {
        self.fails_in(self.tmp.path(), args)
    }

    /// A tiny Llama model directory `name` (config.json, tokenizer.json; no weights).
    fn llama_config(&self, name: &str) -> PathBuf {
        let dir = self.path(name);
        std::fs::create_dir_all(&dir).unwrap();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-bpe");
        std::fs::copy(fixture.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"model_type": "llama", "vocab_size": 267, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "tie_word_embeddings": false, "bos_token_id": 1,
                "eos_token_id": 2}"#,
        )
        .unwrap();
        dir
    }

    /// Text lines prepared with `tokenizer` (a directory or GGUF file) into `out`.
    fn text_data(&self, tokenizer: &str, out: &str) {
        let text = self.path("text.txt");
        if !text.exists() {
            let lines: String = (0..400)
                .map(|i| format!("Line {i}: the cat and the hat sat on the mat.\n"))
                .collect();
            std::fs::write(&text, lines).unwrap();
        }
        self.ok(&[
            "prepare",
            text.to_str().unwrap(),
            "--tokenizer",
            tokenizer,
            "--out",
            &self.s(out),
        ]);
    }

    /// A tiny Llama (`base`, made if missing) trained from scratch on `data` (prepared with
    /// its tokenizer if missing) into `run` for `steps` steps at `lr`, saved at the end: the
    /// checkpoint's path.
    fn scratch_run(&self, data: &str, run: &str, steps: &str, lr: &str) -> String {
        let base = self.llama_config("base");
        if !self.path(data).exists() {
            self.text_data(base.to_str().unwrap(), data);
        }
        self.ok(&[
            "train",
            "--model",
            &self.s("base"),
            "--data",
            &self.s(data),
            "--out",
            &self.s(run),
            "--steps",
            steps,
            "--batch",
            "2",
            "--seq",
            "32",
            "--lr",
            lr,
            "--save-every",
            steps,
            "--threads",
            "2",
        ]);
        let step: u64 = steps.parse().unwrap();
        self.s(&format!("{run}/checkpoints/step-{step:06}"))
    }

    /// A tiny Llama trained from scratch for `steps` steps at `lr`, exported as the GGUF
    /// file `gguf` (f32) with memwall's export mark renamed away: a "downloaded" model.
    fn downloaded_gguf(&self, gguf: &str, steps: &str, lr: &str) -> PathBuf {
        let run = format!("scratch-{gguf}");
        self.scratch_run("data-base", &run, steps, lr);
        let exported = self.path(&format!("{gguf}.exported"));
        self.ok(&[
            "export",
            &self.s(&run),
            "--gguf",
            exported.to_str().unwrap(),
            "--type",
            "f32",
        ]);
        let bytes = std::fs::read(&exported).unwrap();
        let mark = memwall::export::inputs::EXPORT_MARK.as_bytes();
        let at = bytes
            .windows(mark.len())
            .position(|w| w == mark)
            .expect("an export carries memwall's mark");
        let mut foreign = bytes.clone();
        foreign[at..at + mark.len()].copy_from_slice(b"general.downloaded_");
        let out = self.path(gguf);
        std::fs::write(&out, foreign).unwrap();
        out
    }

    /// A LoRA run `run` on `init` (rank 2) over `data`, `steps` steps, saved at the end.
    fn lora_run(&self, init: &str, data: &str, run: &str, steps: &str) {
        self.ok(&[
            "train",
            "--init",
            init,
            "--lora",
            "2",
            "--data",
            &self.s(data),
            "--out",
            &self.s(run),
            "--steps",
            steps,
            "--batch",
            "2",
            "--seq",
            "32",
            "--save-every",
            steps,
            "--threads",
            "2",
        ]);
    }
}

/// Item 1: `export --gguf` replaces an earlier export of memwall's, never a GGUF file memwall
/// did not write (a downloaded model), which it leaves byte for byte.
#[test]
fn export_replaces_only_its_own_earlier_export() {
    let t = Trial::new();
    let dl = t.downloaded_gguf("dl.gguf", "2", "1e-3");
    let kept = std::fs::read(&dl).unwrap();
    let e = t.fails(&["export", &t.s("scratch-dl.gguf"), "--gguf", &t.s("dl.gguf")]);
    assert!(
        e.contains("--gguf") && e.contains("memwall did not export"),
        "{e}"
    );
    assert!(
        std::fs::read(&dl).unwrap() == kept,
        "the download is intact"
    );
    // A GGUF file is exported in place: nothing is converted into the user cache.
    let said = t.ok(&[
        "export",
        &t.s("dl.gguf"),
        "--gguf",
        &t.s("re.gguf"),
        "--type",
        "f16",
    ]);
    assert!(said.contains("exported"), "{said}");
    assert!(
        !t.path("cache/memwall/gguf").exists(),
        "an export made a conversion"
    );
    let f = memwall::gguf::GgufFile::open(&t.path("re.gguf")).unwrap();
    assert_eq!(
        f.get("general.name"),
        Some(&memwall::gguf::Value::String("dl".into()))
    );
    // Its own earlier export is replaced.
    t.ok(&[
        "export",
        &t.s("scratch-dl.gguf"),
        "--gguf",
        &t.s("dl.gguf.exported"),
        "--type",
        "f16",
    ]);
}

/// Item 2: `export --adapter RUN --gguf BASE.gguf`, RUN trained on BASE.gguf, is refused as
/// the model being read, as is exporting BASE.gguf's conversion over it.
#[test]
fn an_adapter_export_never_writes_over_its_gguf_base() {
    let t = Trial::new();
    let dl = t.downloaded_gguf("dl.gguf", "2", "1e-3");
    let kept = std::fs::read(&dl).unwrap();
    t.text_data(dl.to_str().unwrap(), "data-gguf");
    t.lora_run(dl.to_str().unwrap(), "data-gguf", "lora", "2");
    let e = t.fails(&[
        "export",
        "--adapter",
        &t.s("lora"),
        "--gguf",
        &t.s("dl.gguf"),
    ]);
    assert!(e.contains("being read"), "{e}");
    let conversion = (std::fs::read_dir(t.path("cache/memwall/gguf")).unwrap())
        .flatten()
        .map(|e| e.path())
        .find(|p| p.is_dir())
        .expect("the GGUF's conversion");
    let e = t.fails(&[
        "export",
        conversion.to_str().unwrap(),
        "--gguf",
        &t.s("dl.gguf"),
    ]);
    assert!(e.contains("converted from"), "{e}");
    assert!(std::fs::read(&dl).unwrap() == kept);
}

/// Items 5, 6 and 11: a LoRA run on a GGUF file records it absolute with its fingerprint.
/// From another directory, after `cache --clear`, it resumes and exports (the file converted
/// again); once the file holds another model of the same shape (the old modification time
/// kept), resume, export, merge and sample refuse it, naming both fingerprints.
#[test]
fn a_run_keeps_to_its_base_from_anywhere_and_refuses_a_replaced_one() {
    let t = Trial::new();
    let dl = t.downloaded_gguf("dl.gguf", "2", "1e-3");
    t.text_data(dl.to_str().unwrap(), "data-gguf");
    t.lora_run(dl.to_str().unwrap(), "data-gguf", "lora", "2");
    let config =
        std::fs::read_to_string(t.path("lora/checkpoints/step-000002/adapter_config.json"))
            .unwrap();
    let v: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(v["base_model_name_or_path"], t.s("dl.gguf"));

    let elsewhere = t.path("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let said = t.ok_in(&elsewhere, &["cache", "--clear"]);
    assert!(said.contains("1 conversion removed"), "{said}");
    t.ok_in(
        &elsewhere,
        &["train", "--resume", &t.s("lora"), "--steps", "3"],
    );
    t.ok_in(
        &elsewhere,
        &[
            "export",
            "--adapter",
            &t.s("lora"),
            "--gguf",
            &t.s("merged.gguf"),
        ],
    );

    // Another model of the same shape over the file, its modification time set back.
    let other = t.downloaded_gguf("other.gguf", "3", "1e-2");
    let when = std::fs::metadata(&dl).unwrap().modified().unwrap();
    std::fs::copy(&other, &dl).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&dl)
        .unwrap()
        .set_modified(when)
        .unwrap();
    let e = t.fails_in(
        &elsewhere,
        &["train", "--resume", &t.s("lora"), "--steps", "4"],
    );
    assert!(
        e.contains("holds another model") && e.contains("--init-adapter"),
        "{e}"
    );
    for args in [
        vec![
            "export",
            "--adapter",
            &t.s("lora"),
            "--gguf",
            &t.s("m2.gguf"),
        ],
        vec![
            "merge",
            &t.s("dl.gguf"),
            &t.s("lora"),
            "--out",
            &t.s("merged-dir"),
        ],
        vec![
            "sample",
            "--model",
            &t.s("dl.gguf"),
            "--adapter",
            &t.s("lora"),
            "--prompt",
            "a",
            "--tokens",
            "2",
        ],
    ] {
        let e = t.fails_in(&elsewhere, &args);
        assert!(e.contains("now holds another model"), "{args:?}: {e}");
    }
    assert!(!t.path("m2.gguf").exists() && !t.path("merged-dir").exists());
}

/// Item 5 for a model directory: `--init base` given relative resumes from any directory on
/// that base, not on a `base` where the resume is started.
#[test]
fn a_relative_init_is_recorded_absolute() {
    let t = Trial::new();
    t.scratch_run("data-base", "scratch", "1", "6e-4");
    t.ok(&[
        "train",
        "--init",
        "scratch/checkpoints/step-000001",
        "--lora",
        "2",
        "--data",
        "data-base",
        "--out",
        "lora",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "32",
        "--save-every",
        "1",
        "--threads",
        "2",
    ]);
    // Elsewhere, a directory of the same relative name holding another model.
    let elsewhere = t.path("elsewhere");
    std::fs::create_dir_all(elsewhere.join("scratch/checkpoints")).unwrap();
    t.ok_in(
        &elsewhere,
        &["train", "--resume", &t.s("lora"), "--steps", "2"],
    );
    let state =
        std::fs::read_to_string(t.path("lora/checkpoints/step-000002/trainer_state.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&state).unwrap();
    assert_eq!(
        v["train"]["init"],
        t.s("scratch/checkpoints/step-000001"),
        "{state}"
    );
    assert!(v["train"]["base_fingerprint"].is_string(), "{state}");
}

/// A chat line whose answer follows `prompt_words` words of prompt.
fn chat_lines(n: usize, prompt_words: usize) -> String {
    (0..n)
        .map(|i| {
            let user = format!("{i} {}", "the cat sat ".repeat(prompt_words / 3));
            format!(
                "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}, {{\"role\": \
                 \"assistant\", \"content\": \"on the mat and the hat\"}}]}}\n",
                user.trim()
            )
        })
        .collect()
}

const TEMPLATE: &str = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}\
    {% if add_generation_prompt %}assistant:{% endif %}";

/// Items 7 and 8: chat data prepared again in place with `--train-on all` is other data to
/// a resumed run; data whose every answer lies past `--seq` is refused before training.
#[test]
fn chat_data_masks_are_part_of_the_data_and_an_untrainable_set_is_refused() {
    let t = Trial::new();
    t.llama_config("base");
    std::fs::write(t.path("chat.jsonl"), chat_lines(60, 3)).unwrap();
    std::fs::write(t.path("t.jinja"), TEMPLATE).unwrap();
    let prepare = |extra: &[&str]| {
        let mut args = vec![
            "prepare",
            "chat.jsonl",
            "--tokenizer",
            "base",
            "--chat-template",
            "t.jinja",
            "--out",
            "chat",
        ];
        args.extend_from_slice(extra);
        t.ok(&args);
    };
    prepare(&[]);
    t.ok(&[
        "train",
        "--model",
        "base",
        "--data",
        "chat",
        "--out",
        "run",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "32",
        "--save-every",
        "1",
        "--threads",
        "2",
    ]);
    prepare(&["--train-on", "all"]);
    let e = t.fails(&["train", "--resume", "run", "--steps", "2"]);
    assert!(e.contains("other trained tokens"), "{e}");
    prepare(&[]);
    t.ok(&["train", "--resume", "run", "--steps", "2"]);

    std::fs::write(t.path("long.jsonl"), chat_lines(60, 30)).unwrap();
    t.ok(&[
        "prepare",
        "long.jsonl",
        "--tokenizer",
        "base",
        "--chat-template",
        "t.jinja",
        "--out",
        "long",
    ]);
    let e = t.fails(&[
        "train",
        "--model",
        "base",
        "--data",
        "long",
        "--out",
        "long-run",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--threads",
        "2",
    ]);
    assert!(e.contains("no training example has a trained token"), "{e}");
    assert!(
        !t.path("long-run").exists(),
        "refused before anything is written"
    );
}

/// Item 3 and 17: `cache --clear` removes memwall's conversions and a killed conversion's
/// temporary; a directory memwall did not write is listed as such and left.
#[test]
fn cache_clear_removes_only_what_memwall_wrote() {
    let t = Trial::new();
    let dl = t.downloaded_gguf("dl.gguf", "1", "1e-3");
    t.text_data(dl.to_str().unwrap(), "data-gguf");
    let cache = t.path("cache/memwall/gguf");
    let mine = cache.join("mine-0123456789abcdef");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("model.safetensors"), b"the user's").unwrap();
    // A conversion killed half-way: its process (a child that has ended) is gone.
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    // A user's folder whose name only looks like a temporary: left.
    let lookalike = cache.join(format!("proj.tmp-{dead}-0"));
    std::fs::create_dir_all(lookalike.join("src")).unwrap();
    std::fs::write(lookalike.join("src/main.rs"), b"fn main() {}").unwrap();
    let killed = cache.join(format!("dl-0000000000000000.tmp-{dead}-0"));
    std::fs::create_dir_all(&killed).unwrap();
    std::fs::write(killed.join("model.safetensors"), vec![0u8; 4096]).unwrap();

    let listed = t.ok(&["cache"]);
    assert!(listed.contains("not written by memwall"), "{listed}");
    assert!(listed.contains("killed before it finished"), "{listed}");
    let o = t.run_in(t.tmp.path(), &["cache", "--clear", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut kinds: Vec<&str> = (v["conversions"].as_array().unwrap().iter())
        .map(|c| c["kind"].as_str().unwrap())
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        ["conversion", "foreign", "foreign", "interrupted"],
        "{v}"
    );
    assert!(lookalike.join("src/main.rs").is_file());
    assert!(!killed.exists());
    assert_eq!(
        std::fs::read(mine.join("model.safetensors")).unwrap(),
        b"the user's"
    );
    let dirs: Vec<_> = (std::fs::read_dir(&cache).unwrap().flatten())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name())
        .collect();
    let mut dirs = dirs;
    dirs.sort();
    assert_eq!(
        dirs,
        [mine.file_name().unwrap(), lookalike.file_name().unwrap()]
    );
}

/// Item 12: two commands using a new GGUF file at once both succeed (one converts, the other
/// waits for it and uses its conversion).
#[test]
fn two_first_uses_of_a_gguf_at_once_convert_it_once() {
    let t = Trial::new();
    let dl = t.downloaded_gguf("dl.gguf", "1", "1e-3");
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_memwall"))
            .env("XDG_CACHE_HOME", t.path("cache"))
            .args(["sample", "--model", dl.to_str().unwrap(), "--tokens", "2"])
            .args(["--prompt", "the cat", "--threads", "1"])
            .output()
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(spawn);
        let b = s.spawn(spawn);
        (a.join().unwrap().unwrap(), b.join().unwrap().unwrap())
    });
    for o in [a, b] {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let conversions = (std::fs::read_dir(t.path("cache/memwall/gguf"))
        .unwrap()
        .flatten())
    .filter(|e| e.path().is_dir())
    .count();
    assert_eq!(conversions, 1);
}

/// Items 14, 16, 19 and 22: a LoRA checkpoint given to `--init` names the right form;
/// `--init-adapter` takes a run directory and `--lora-dropout` alone; a merge's killed
/// temporaries do not block the next; `--resume RUN --out RUN` is the same run.
#[test]
fn adapters_take_the_forms_users_give() {
    let t = Trial::new();
    let base = t.scratch_run("data", "scratch", "1", "6e-4");
    t.lora_run(&base, "data", "lora", "1");
    let e = t.fails(&[
        "train",
        "--init",
        &t.s("lora/checkpoints/step-000001"),
        "--data",
        &t.s("data"),
        "--out",
        &t.s("x"),
    ]);
    assert!(
        e.contains("LoRA adapter") && e.contains("--init-adapter"),
        "{e}"
    );
    assert!(!t.path("x").exists());
    t.ok(&[
        "train",
        "--init",
        &base,
        "--init-adapter",
        &t.s("lora"),
        "--lora-dropout",
        "0.1",
        "--data",
        &t.s("data"),
        "--out",
        &t.s("lora2"),
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "32",
        "--save-every",
        "1",
        "--threads",
        "2",
    ]);
    let config =
        std::fs::read_to_string(t.path("lora2/checkpoints/step-000001/adapter_config.json"))
            .unwrap();
    assert!(config.contains("\"lora_dropout\": 0.1"), "{config}");
    let e = t.fails(&["plan", "--lora-dropout", "0.1"]);
    assert!(e.contains("--lora-dropout needs --lora"), "{e}");
    t.ok(&[
        "train",
        "--resume",
        &t.s("lora"),
        "--out",
        &t.s("lora"),
        "--steps",
        "2",
    ]);
    // The report shows the LoRA settings.
    t.ok(&["report", &t.s("lora")]);
    let page = std::fs::read_to_string(t.path("lora/report.html")).unwrap();
    assert!(
        page.contains("<td>LoRA</td><td>rank 2, alpha 4"),
        "no LoRA row"
    );

    // What a killed merge left: a temporary sibling and, from older versions, a hidden
    // temporary inside the output.
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let out = t.path("merged");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join(format!(".model.safetensors.tmp-{dead}-0")), b"x").unwrap();
    std::fs::create_dir_all(t.path(&format!("merged.tmp-{dead}-0"))).unwrap();
    t.ok(&["merge", &base, &t.s("lora"), "--out", &t.s("merged")]);
    assert!(out.join("model.safetensors").is_file());
    assert!(!t.path(&format!("merged.tmp-{dead}-0")).exists());
}

/// Item 4: `demo chat --out DIR` never writes over a `chat-shakespeare.jsonl` of the user's,
/// and checks its run directory before writing anything.
#[test]
fn the_chat_demo_leaves_the_users_files() {
    let corpus = common::shakespeare_required();
    let t = Trial::new();
    let out = t.path("demo");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("chat-shakespeare.jsonl"), "mine\n").unwrap();
    let args = ["demo", "chat", "--out", out.to_str().unwrap()];
    let o = Command::new(env!("CARGO_BIN_EXE_memwall"))
        .env("XDG_CACHE_HOME", t.path("cache"))
        .env("MEMWALL_CORPUS", &corpus)
        .env("MEMWALL_SMOLLM2_GGUF", t.path("no-model.gguf"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("chat-shakespeare.jsonl"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("chat-shakespeare.jsonl")).unwrap(),
        "mine\n"
    );
    // A run directory of someone else's where the demo's run goes: refused before the
    // conversations are written.
    std::fs::remove_file(out.join("chat-shakespeare.jsonl")).unwrap();
    std::fs::create_dir_all(out.join("run-chat")).unwrap();
    std::fs::write(out.join("run-chat/notes.txt"), "mine").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_memwall"))
        .env("XDG_CACHE_HOME", t.path("cache"))
        .env("MEMWALL_CORPUS", &corpus)
        .env("MEMWALL_SMOLLM2_GGUF", t.path("no-model.gguf"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("run-chat"), "{err}");
    assert!(!out.join("chat-shakespeare.jsonl").exists());
}

/// Item 18: a missing adapter, a used `--out` or a run already there are refused before a
/// GGUF base is converted (an f32 copy, 4 bytes a parameter, in the user cache).
#[test]
fn the_cheap_checks_come_before_a_gguf_conversion() {
    let t = Trial::new();
    let dl = t.downloaded_gguf("dl.gguf", "1", "1e-3");
    let dl = dl.to_str().unwrap();
    std::fs::create_dir_all(t.path("not-an-adapter")).unwrap();
    std::fs::create_dir_all(t.path("old-run/checkpoints/step-000001")).unwrap();
    std::fs::create_dir_all(t.path("used")).unwrap();
    std::fs::write(t.path("used/notes.txt"), "mine").unwrap();
    for (args, says) in [
        (
            vec!["merge", dl, &t.s("not-an-adapter"), "--out", &t.s("m")],
            "adapter_config.json",
        ),
        (
            vec!["merge", dl, &t.s("scratch-dl.gguf"), "--out", &t.s("m")],
            "is a whole model",
        ),
        (
            vec![
                "sample",
                "--model",
                dl,
                "--adapter",
                &t.s("not-an-adapter"),
                "--prompt",
                "a",
            ],
            "adapter_config.json",
        ),
        (
            vec![
                "train",
                "--init",
                dl,
                "--lora",
                "2",
                "--data",
                &t.s("data-base"),
                "--out",
                &t.s("old-run"),
            ],
            "step-000001",
        ),
    ] {
        let e = t.fails(&args);
        assert!(e.contains(says), "{args:?}: {e}");
    }
    let converted = std::fs::read_dir(t.path("cache/memwall/gguf"))
        .map(|d| d.flatten().filter(|e| e.path().is_dir()).count())
        .unwrap_or(0);
    assert_eq!(converted, 0, "nothing was converted");
}

/// Item 20: raw text lines need no chat template; an input given twice is refused (its
/// validation lines would copy training ones); `--no-pack` on raw text is refused, not
/// ignored.
#[test]
fn prepare_and_train_take_what_they_can_use_and_refuse_the_rest() {
    let t = Trial::new();
    let lines: String = (0..100)
        .map(|i| format!("{{\"text\": \"line {i} of the play, spoken well\"}}\n"))
        .collect();
    std::fs::write(t.path("text.jsonl"), lines).unwrap();
    let said = t.ok(&["prepare", "text.jsonl", "--tokenizer", "gpt2", "--out", "d"]);
    assert!(said.contains("100 examples"), "{said}");
    let e = t.fails(&["prepare", "text.jsonl", "text.jsonl", "--out", "d2"]);
    assert!(e.contains("given twice"), "{e}");
    let e = t.fails(&["prepare", "text.jsonl", &t.s("."), "--out", "d3"]);
    assert!(e.contains("given twice") && e.contains("inside"), "{e}");
    let cfg = common::micro_config(t.tmp.path());
    t.text_data("gpt2", "raw");
    let e = t.fails(&[
        "train",
        "--model",
        cfg.to_str().unwrap(),
        "--data",
        "raw",
        "--out",
        "r",
        "--no-pack",
        "--steps",
        "1",
        "--seq",
        "16",
    ]);
    assert!(e.contains("--no-pack") && e.contains("raw text"), "{e}");
}

/// What a resumed run does with the flags it is given: the optimizer settings and seed are
/// refused, naming the flag; when it evaluates and saves may change. A full fine-tune
/// resumes from its checkpoint alone, its --init gone.
#[test]
fn a_resumed_run_takes_or_refuses_every_flag_and_needs_no_base() {
    let t = Trial::new();
    t.scratch_run("data", "scratch", "1", "6e-4");
    std::fs::create_dir_all(t.path("gone")).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(
            t.path("scratch/checkpoints/step-000001").join(f),
            t.path("gone").join(f),
        )
        .unwrap();
    }
    t.ok(&[
        "train",
        "--init",
        "gone",
        "--data",
        "data",
        "--out",
        "full",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "32",
        "--save-every",
        "1",
        "--threads",
        "2",
    ]);
    for flag in [
        ["--lr", "0.01"],
        ["--seed", "9"],
        ["--warmup", "3"],
        ["--weight-decay", "0.2"],
    ] {
        let e = t.fails(&[
            "train", "--resume", "full", "--steps", "2", flag[0], flag[1],
        ]);
        assert!(e.contains(&format!("{} with --resume", flag[0])), "{e}");
    }
    // The base gone: the checkpoint is enough.
    std::fs::remove_dir_all(t.path("gone")).unwrap();
    t.ok(&[
        "train",
        "--resume",
        "full",
        "--steps",
        "2",
        "--save-every",
        "2",
    ]);
    let state =
        std::fs::read_to_string(t.path("full/checkpoints/step-000002/trainer_state.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&state).unwrap();
    assert_eq!(v["train"]["save_every"], 2, "{state}");
}
