//! `memwall demo chat`: teach a pretrained chat model a new task with LoRA, from a static
//! memory plan, and show what changed.
//!
//! **The conversation set** ([`ConversationSet`]) is built from the Shakespeare corpus, the
//! same text `memwall demo` trains on ([`crate::data::corpus`]), deterministically:
//!
//! * a *speech* ([`speeches`]) is a speaker line (`HAMLET.`, `Romeo.`, `Ham.`: a short line of
//!   capitalised words ending in a full stop, after a blank line) and the lines under it, up
//!   to a blank line or a stage direction (`[Exit.]`). The speaker is kept as the play writes
//!   it, upper-cased, without the full stop (Hamlet and King Lear abbreviate: `HAM`, `GLOU`).
//!   Speeches start at a play's first act or scene heading (the list of persons before it
//!   looks like speeches); inline stage directions (`[Aside.]`) are removed from the lines.
//! * a speech of at least [`PROMPT_LINES`] + [`ANSWER_LINES`] lines, none longer than
//!   [`MAX_LINE_CHARS`], is one conversation: the user asks `Continue this speech of ROMEO:`
//!   followed by its first two lines, and the assistant answers with the next two. Short
//!   answers, so that a few minutes of training on 2 cores visibly changes them.
//! * a conversation whose question was already asked (a repeated speech opening) is left out,
//!   so no question is in both splits; every [`VAL_EVERY`]-th of the others is validation,
//!   which spreads the validation set over every play.
//! * the held-out question ([`ConversationSet::held_out`]) is the first validation
//!   conversation of [`HELD_OUT_SPEAKER`] (else the first validation conversation): never
//!   trained on, asked before and after.
//!
//! It is written as OpenAI `messages` JSONL ([`ConversationSet::write_jsonl`]; the training
//! conversations, then the validation ones) into `OUT/chat-shakespeare.jsonl`, where the user
//! can read it or reuse it with `memwall prepare`.
//!
//! **The steps** ([`run`]): find SmolLM2-135M-Instruct ([`super::smollm2`]) and its
//! conversion, build the conversation set, prepare it with the model's tokenizer and chat
//! template ([`crate::data::chat::prepare_chat`]: the loss on the answers only), ask the
//! held-out question greedily through the chat template (the code of `memwall sample --chat`,
//! [`crate::exec::generate::chat_text`]), print the memory plan, train LoRA adapters on the
//! file's own quantized blocks (QLoRA, as `memwall train --init FILE.gguf --lora R`) with the
//! validation loss on the answers before the first step and after the last, then ask the
//! question again through the adapters. [`ChatOptions`] sizes the run, so tests can keep it
//! tiny.

use super::finetune::val_losses;
use super::smollm2;
use crate::data::Tokenizer;
use crate::data::chat::{
    ChatPrepareOptions, ChatTemplate, Encoder, Message, Role, TrainOn, prepare_chat,
};
use crate::exec::generate::{ChatRequest, SampleOptions, chat_text};
use crate::exec::resolve::{self, LoraRequest, StepRequest, StrategyRequest, TrainRequest};
use crate::exec::train::{self, ConsoleProgress};
use crate::plan;
use crate::plan::search::Pick;
use crate::run_dir::RunDir;
use crate::util::{atomic, rss};
use anyhow::{Context, Result, bail};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Lines of a speech the user quotes.
pub const PROMPT_LINES: usize = 2;
/// Lines of a speech the assistant answers with (the ones after the quoted lines).
pub const ANSWER_LINES: usize = 2;
/// Speeches with a longer line (prose wrapped oddly, a list of names) are left out.
pub const MAX_LINE_CHARS: usize = 80;
/// Every `VAL_EVERY`-th conversation is a validation one.
pub const VAL_EVERY: usize = 20;
/// Whose speech the held-out question continues, when the validation set has one.
pub const HELD_OUT_SPEAKER: &str = "ROMEO";
/// The conversation file's name in `--out`.
pub const JSONL_NAME: &str = "chat-shakespeare.jsonl";

/// One speech of a play: who speaks, and the lines (trimmed, none empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Speech {
    /// The speaker as the play names them, upper-cased, without the full stop.
    pub speaker: String,
    pub lines: Vec<String>,
}

/// Whether a line is an act or scene heading (`ACT I.`, `SCENE.--England.`, `Scene II.`).
fn is_heading(line: &str) -> bool {
    let word: String = line
        .trim_start()
        .chars()
        .take_while(char::is_ascii_alphabetic)
        .collect();
    matches!(word.to_ascii_uppercase().as_str(), "ACT" | "SCENE")
}

/// The speaker a line names, if it is a speaker line: at most four words of letters (and
/// `'`, `-`, `&`, `.` inside), starting with a capital, ending in a full stop, not an act or
/// scene heading.
fn speaker_of(line: &str) -> Option<String> {
    let name = line.trim().strip_suffix('.')?;
    let first = name.chars().next()?;
    let words = name.split_whitespace().count();
    let allowed = |c: char| c.is_ascii_alphabetic() || " '-&.".contains(c);
    if !first.is_ascii_uppercase() || words > 4 || name.len() > 40 || is_heading(name) {
        return None;
    }
    if !name.chars().all(allowed) {
        return None;
    }
    Some(
        name.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_uppercase(),
    )
}

/// A line of a speech without its inline stage directions (`[Aside.]`) and with its spaces
/// collapsed.
fn spoken(line: &str) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    for c in line.chars() {
        match c {
            '[' => depth += 1,
            ']' if depth > 0 => depth -= 1,
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The speeches of a play's text, in order (see the module docs): from its first act or scene
/// heading on (what comes before is the list of persons), or the whole text when it has none.
/// Text that is no play (the sonnets, the poems) has none.
pub fn speeches(text: &str) -> Vec<Speech> {
    let all: Vec<&str> = text.lines().map(str::trim_end).collect();
    let lines = match all.iter().position(|l| is_heading(l)) {
        Some(h) => &all[h..],
        None => &all[..],
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let after_blank = i == 0 || lines[i - 1].trim().is_empty();
        let speaker = after_blank.then(|| speaker_of(lines[i])).flatten();
        let Some(speaker) = speaker else {
            i += 1;
            continue;
        };
        let mut speech = Vec::new();
        let mut j = i + 1;
        while j < lines.len() {
            let l = lines[j].trim();
            if l.is_empty() || l.starts_with('[') {
                break;
            }
            let l = spoken(l);
            if !l.is_empty() {
                speech.push(l);
            }
            j += 1;
        }
        if !speech.is_empty() {
            out.push(Speech {
                speaker,
                lines: speech,
            });
        }
        i = j.max(i + 1);
    }
    out
}

/// One question and its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conversation {
    /// The user's turn: `Continue this speech of SPEAKER:` and the speech's first lines.
    pub user: String,
    /// The assistant's turn: the lines that follow.
    pub assistant: String,
}

impl Conversation {
    /// The conversation of a speech long enough (see the module docs), else `None`.
    pub fn of(speech: &Speech) -> Option<Conversation> {
        let n = PROMPT_LINES + ANSWER_LINES;
        if speech.lines.len() < n || speech.lines[..n].iter().any(|l| l.len() > MAX_LINE_CHARS) {
            return None;
        }
        Some(Conversation {
            user: format!(
                "Continue this speech of {}:\n{}",
                speech.speaker,
                speech.lines[..PROMPT_LINES].join("\n")
            ),
            assistant: speech.lines[PROMPT_LINES..n].join("\n"),
        })
    }

    /// The turns, as the chat template sees them.
    pub fn messages(&self) -> Vec<Message> {
        vec![
            Message::new(Role::User, self.user.as_str()),
            Message::new(Role::Assistant, self.assistant.as_str()),
        ]
    }

    /// The conversation as one JSONL line (no newline): `{"messages": [...]}`.
    pub fn json_line(&self) -> String {
        serde_json::json!({ "messages": self.messages() }).to_string()
    }
}

/// The demo's conversations, split (see the module docs).
#[derive(Clone, Debug)]
pub struct ConversationSet {
    pub train: Vec<Conversation>,
    pub val: Vec<Conversation>,
    /// Index in `val` of the held-out question.
    pub held_out: usize,
    /// Files read, and speeches found in them.
    pub files: usize,
    pub speeches: usize,
}

impl ConversationSet {
    /// The set from the texts of a corpus, in the order given; `source` names it in errors.
    pub fn from_texts(texts: &[String], source: &str) -> Result<ConversationSet> {
        let mut seen = HashSet::new();
        let (mut train, mut val) = (Vec::new(), Vec::new());
        let mut speech_count = 0;
        for text in texts {
            let found = speeches(text);
            speech_count += found.len();
            for c in found.iter().filter_map(Conversation::of) {
                if !seen.insert(c.user.clone()) {
                    continue;
                }
                if seen.len() % VAL_EVERY == 0 {
                    val.push(c);
                } else {
                    train.push(c);
                }
            }
        }
        if val.is_empty() || train.is_empty() {
            bail!(
                "{source}: {} distinct speeches of at least {} lines found, too few for a conversation \
                 set (at least {VAL_EVERY} are needed): the chat demo needs plays, each speech under a \
                 line naming its speaker (\"HAMLET.\") after a blank line; set MEMWALL_CORPUS to \
                 such text, or unset it to use the Shakespeare corpus",
                seen.len(),
                PROMPT_LINES + ANSWER_LINES
            );
        }
        let prefix = format!("Continue this speech of {HELD_OUT_SPEAKER}:\n");
        let held_out = val
            .iter()
            .position(|c| c.user.starts_with(&prefix))
            .unwrap_or(0);
        Ok(ConversationSet {
            train,
            val,
            held_out,
            files: texts.len(),
            speeches: speech_count,
        })
    }

    /// The set from a corpus directory (its files in path order, as `prepare` reads them) or
    /// file.
    pub fn from_corpus(corpus: &Path) -> Result<ConversationSet> {
        let files = crate::data::prepare::input_files(&[corpus.to_path_buf()])?;
        let texts = files
            .iter()
            .map(|f| {
                std::fs::read_to_string(f).with_context(|| {
                    format!(
                        "cannot read '{}' as UTF-8 text: set MEMWALL_CORPUS to a folder of plays",
                        f.display()
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Self::from_texts(&texts, &corpus.display().to_string())
    }

    /// The question asked before and after training (a validation conversation).
    pub fn held_out(&self) -> &Conversation {
        &self.val[self.held_out]
    }

    /// The fraction of the file's conversations that `prepare` holds out, exactly the
    /// validation ones (they are written last).
    pub fn val_fraction(&self) -> f64 {
        self.val.len() as f64 / (self.train.len() + self.val.len()) as f64
    }

    /// Writes the training conversations, then the validation ones, one JSONL line each,
    /// atomically.
    pub fn write_jsonl(&self, path: &Path) -> Result<()> {
        atomic::write_file(path, self.jsonl_text().as_bytes())
            .with_context(|| format!("cannot write the conversation set '{}'", path.display()))
    }

    /// The JSONL text [`ConversationSet::write_jsonl`] writes.
    pub fn jsonl_text(&self) -> String {
        let mut text = String::new();
        for c in self.train.iter().chain(&self.val) {
            text.push_str(&c.json_line());
            text.push('\n');
        }
        text
    }
}

/// How big a run `memwall demo chat` makes.
#[derive(Clone, Debug)]
pub struct ChatOptions {
    /// Where the conversations (`chat-shakespeare.jsonl`), their prepared data (`data-chat/`)
    /// and the run (`run-chat/`, cleared first) go.
    pub out: PathBuf,
    /// Optimizer steps.
    pub steps: u64,
    pub threads: usize,
    /// Conversations per step.
    pub batch: usize,
    /// Tokens per conversation (longer ones are cut: at 128, one of the demo's 6,734 training
    /// conversations).
    pub seq: usize,
    /// Validation batches per evaluation (before the first step and after the last).
    pub eval_batches: u64,
    /// LoRA rank.
    pub lora_r: usize,
    pub lr: f32,
    /// Tokens of each answer at most (an answer ends at the end-of-turn token).
    pub answer_tokens: usize,
}

impl ChatOptions {
    /// The demo's defaults: 100 steps of 4 conversations of at most 128 tokens, LoRA r 16,
    /// a few minutes on 2 cores.
    pub fn new(out: &Path, threads: usize) -> ChatOptions {
        ChatOptions {
            out: out.to_path_buf(),
            steps: 100,
            threads,
            batch: 4,
            seq: 128,
            eval_batches: 8,
            lora_r: 16,
            lr: 1e-3,
            answer_tokens: 48,
        }
    }
}

/// What the demo measured.
#[derive(Clone, Debug)]
pub struct ChatReport {
    /// The held-out conversation (question and the play's own answer).
    pub held_out: Conversation,
    /// The greedy answers to it before and after training.
    pub answer_before: String,
    pub answer_after: String,
    /// Validation loss on the answers before the first update and after the last step.
    pub val_before: f32,
    pub val_after: f32,
    /// The conversation file and the trained adapter's checkpoint.
    pub jsonl: PathBuf,
    pub checkpoint: PathBuf,
    /// The whole demo.
    pub elapsed: Duration,
}

/// Runs the demo, printing its steps to stdout.
pub fn run(o: &ChatOptions) -> Result<ChatReport> {
    let t0 = Instant::now();
    if o.steps == 0 {
        bail!("--steps must be at least 1");
    }
    println!(
        "memwall demo chat: teach SmolLM2-135M-Instruct to continue Shakespeare's speeches (LoRA) from a static memory plan\n"
    );
    let corpus = crate::data::corpus::demo_corpus()?;
    let set = ConversationSet::from_corpus(&corpus)?;
    // Everything the demo writes is checked before it writes anything: the conversations
    // replace only the demo's own (the same text), the data only memwall's shards, the run
    // only a run memwall wrote.
    let jsonl = o.out.join(JSONL_NAME);
    let data = o.out.join("data-chat");
    let run = o.out.join("run-chat");
    let lines = set.jsonl_text();
    if jsonl.exists() && std::fs::read(&jsonl).ok().as_deref() != Some(lines.as_bytes()) {
        bail!(
            "--out {}: holds {JSONL_NAME}, which is not this demo's conversation set (its \
             content differs); memwall replaces only what it wrote: move the file, or choose \
             another --out",
            o.out.display()
        );
    }
    crate::data::prepare::check_out(&data)?;
    RunDir::new(&run).check_previous(&format!("the previous demo run {}", run.display()))?;
    let (gguf, dir, spec) = smollm2::pretrained()?;
    println!(
        "   converted once to {} ({:.1}M parameters, with its tokenizer and chat template)",
        dir.display(),
        spec.num_params() as f64 / 1e6
    );

    std::fs::create_dir_all(&o.out)
        .with_context(|| format!("cannot create --out '{}'", o.out.display()))?;
    if !jsonl.exists() {
        set.write_jsonl(&jsonl)?;
    }
    let example = &set.train[0];
    println!(
        "\n2. a conversation set from {} ({} speeches in {}): {} train / {} validation conversations -> {}\n   for example:\n\n{}\n{}",
        corpus.display(),
        set.speeches,
        crate::util::count(set.files as u64, "file"),
        set.train.len(),
        set.val.len(),
        jsonl.display(),
        turn("user:", &example.user),
        turn("assistant:", &example.assistant),
    );

    prepare(&dir, &jsonl, &data, set.val_fraction())?;

    let held = set.held_out().clone();
    println!(
        "\n4. the held-out question (a validation conversation, never trained on), answered by the original model (greedy, as `memwall sample --chat`):\n\n{}",
        turn("user:", &held.user)
    );
    let answer_before = print_answer(&dir, None, &held.user, "assistant:", o)?;

    // Only a run this demo (or any memwall run) wrote is replaced; anything else is refused.
    let what = format!("the previous demo run {}", run.display());
    RunDir::new(&run).replace_previous(&what, &mut |m| eprintln!("{m}"))?;
    let req = train_request(o, &gguf, &data, &run);
    let mut progress = ConsoleProgress::new(10);
    let t = resolve::new_run(&req, o.threads, &crate::dist::Single, &mut progress)?;
    for note in &t.notes {
        eprintln!("{note}");
    }
    // The plan the run below trains from (its strategies, not the library's defaults; rows
    // packing the conversations).
    let (plan, _) = train::plan_for(&t, &spec, rss::current_rss().unwrap_or(0), 1, true)?;
    println!(
        "\n5. the memory plan of a LoRA step (rank {}, on the file's own quantized blocks), before any step runs:\n",
        o.lora_r
    );
    print!(
        "{}",
        plan::report::table(
            &plan,
            rss::current_rss().unwrap_or(0),
            &plan::Budgets::NONE,
            t.device.open()?
        )
    );
    println!(
        "\n   training {} steps of {} x {} tokens (AdamW, lr {}), validation loss on the answers before and after:\n",
        t.steps, t.batch, t.seq, t.lr
    );
    let summary = train::train(&t, None, &mut progress)?;
    println!("{}", summary.describe());
    let checkpoint = summary
        .last_checkpoint
        .context("the LoRA run saved no checkpoint")?;

    let (val_before, val_after) = val_losses(&RunDir::new(&run).metrics())?;
    println!(
        "\n6. validation loss on the answers only: {val_before:.3} before, {val_after:.3} after ({:+.3})",
        val_after - val_before
    );

    println!(
        "\n7. the held-out question again, answered through the trained adapters (greedy):\n\n{}\n{}",
        turn("user:", &held.user),
        turn("before:", &answer_before),
    );
    let answer_after = print_answer(&dir, Some(&checkpoint), &held.user, "after:", o)?;
    println!("{}", turn("the play:", &held.assistant));
    let elapsed = t0.elapsed();
    println!(
        "\nfiles: {}, {}, {}\nmore: memwall sample --model {} --adapter {} --chat \"$(printf 'Continue this speech of JULIET:\\nO Romeo, Romeo! wherefore art thou Romeo?\\nDeny thy father and refuse thy name;')\"\ntook {:.0} s",
        jsonl.display(),
        RunDir::new(&run).metrics().display(),
        checkpoint.display(),
        gguf.display(),
        checkpoint.display(),
        elapsed.as_secs_f64()
    );
    Ok(ChatReport {
        held_out: held,
        answer_before,
        answer_after,
        val_before,
        val_after,
        jsonl,
        checkpoint,
        elapsed,
    })
}

/// The run as `memwall train --init FILE.gguf --lora R` asks for it (the base kept in the
/// file's blocks), evaluated before the first step and after the last, saved at the end.
fn train_request(o: &ChatOptions, gguf: &Path, data: &Path, run: &Path) -> TrainRequest {
    TrainRequest {
        step: StepRequest {
            batch: Some(Pick::Fixed(o.batch)),
            seq: Some(o.seq),
            threads: Some(o.threads),
            strategy: StrategyRequest {
                lora: Some(LoraRequest {
                    r: o.lora_r,
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        },
        data: Some(data.to_path_buf()),
        out: Some(run.to_path_buf()),
        steps: Some(o.steps),
        lr: o.lr,
        warmup: Some((o.steps / 10).min(10)),
        weight_decay: 0.0,
        grad_clip: 1.0,
        seed: 1,
        eval_every: o.steps,
        eval_batches: o.eval_batches,
        save_every: 0,
        init: Some(gguf.to_path_buf()),
        ..Default::default()
    }
}

/// Step 3: the conversations prepared with the model's tokenizer and chat template into
/// `data` (the answers trained, the rest masked), the validation conversations held out.
fn prepare(model: &Path, jsonl: &Path, data: &Path, val_fraction: f64) -> Result<()> {
    let tok = Tokenizer::from_file(model.join("tokenizer.json"))?;
    let described = tok.id().describe();
    let template = ChatTemplate::load(Some(model), None)?;
    let encoder = Encoder::new(tok, template, TrainOn::Answers);
    let s = prepare_chat(
        &ChatPrepareOptions {
            inputs: vec![jsonl.to_path_buf()],
            out: data.to_path_buf(),
            val_fraction,
        },
        &encoder,
        &mut std::io::stderr(),
    )?;
    println!(
        "\n3. prepared with the model's tokenizer ({described}) and chat template, the loss on the answers only: train {} tokens ({} trained), validation {} tokens ({} trained) -> {}",
        s.train.tokens,
        s.train.trained_tokens,
        s.val.tokens,
        s.val.trained_tokens,
        data.display()
    );
    Ok(())
}

/// Answers `user` greedily with the model in `dir` (through `adapter` when given), streaming
/// the answer to stdout after `label`, its lines aligned; returns it.
fn print_answer(
    dir: &Path,
    adapter: Option<&Path>,
    user: &str,
    label: &str,
    o: &ChatOptions,
) -> Result<String> {
    let opts = SampleOptions {
        checkpoint: dir.to_path_buf(),
        prompt: String::new(),
        tokens: o.answer_tokens,
        temperature: 0.0,
        top_k: 0,
        seed: 1,
        threads: o.threads,
        device: Default::default(),
        adapter: adapter.map(Path::to_path_buf),
        stop: Vec::new(),
    };
    let chat = ChatRequest {
        user: user.into(),
        ..Default::default()
    };
    let mut out = std::io::stdout();
    let _ = write!(out, "   {label:<LABEL$}");
    let mut lines = Aligned::default();
    let answer = chat_text(
        &opts,
        &chat,
        &mut |s| {
            let _ = out.write_all(lines.push(s).as_bytes());
            let _ = out.flush();
        },
        &mut |m| eprintln!("{m}"),
    )?;
    println!();
    Ok(answer)
}

/// The width of the labels (`user:`, `assistant:`) the turns are printed after.
const LABEL: usize = 11;

/// `label` before the first line of `text`, the others aligned under it.
fn turn(label: &str, text: &str) -> String {
    format!("   {label:<LABEL$}{}", Aligned::default().push(text.trim()))
}

/// Text streamed after a label: leading white space dropped, each line after the first
/// aligned under the first (blank lines left blank).
#[derive(Default)]
struct Aligned {
    started: bool,
    at_line_start: bool,
}

impl Aligned {
    /// `s`, the next piece of the text, as printed.
    fn push(&mut self, s: &str) -> String {
        let mut out = String::new();
        for c in s.chars() {
            if !self.started {
                if c.is_whitespace() {
                    continue;
                }
                self.started = true;
            }
            if c == '\n' {
                self.at_line_start = true;
                out.push('\n');
                continue;
            }
            if self.at_line_start {
                out.push_str(&" ".repeat(LABEL + 3));
                self.at_line_start = false;
            }
            out.push(c);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::chat::{Format, Record, parse_line};

    #[test]
    fn speaker_lines_are_told_from_headings_and_verse() {
        assert_eq!(speaker_of("HAMLET."), Some("HAMLET".into()));
        assert_eq!(speaker_of("Ham."), Some("HAM".into()));
        assert_eq!(speaker_of("Lady Capulet."), Some("LADY CAPULET".into()));
        assert_eq!(speaker_of("MRS. PAGE."), Some("MRS. PAGE".into()));
        for no in [
            "ACT I.",
            "Scene II. Elsinore.",
            "SCENE.--England.",
            "O, speak!",
            "Hamlet, Son to the former.",
            "[Exit.]",
            "the cat sat.",
            ".",
        ] {
            assert_eq!(speaker_of(no), None, "{no}");
        }
        assert_eq!(
            spoken("Read on this book; [To Ophelia.]  fare"),
            "Read on this book; fare"
        );
    }

    #[test]
    fn answers_are_printed_aligned_under_their_label() {
        let pad = " ".repeat(LABEL + 3);
        assert_eq!(turn("user:", " a\nb "), format!("   user:      a\n{pad}b"));
        // Streamed in pieces: the same, blank lines left without trailing spaces.
        let mut a = Aligned::default();
        let pieces = ["\n ", "I am", "\n", "\nthe", " moon\n"];
        let printed: String = pieces.iter().map(|s| a.push(s)).collect();
        assert_eq!(printed, format!("I am\n\n{pad}the moon\n"));
    }

    /// A play of `n` speeches of 5 lines each, by three speakers in turn (FRIAR LAURENCE
    /// first), after a list of persons (which is no speech) and an act heading; speech 7
    /// repeats speech 1's opening (both ROMEO's).
    fn play(n: usize) -> String {
        let mut t = String::from("A PLAY\n\nPERSONS.\n\nKING OF FRANCE.\nA LORD.\nA LADY.\n\n");
        t.push_str("ACT I.\n\nScene I. A street.\n\n[Enter ROMEO and JULIET.]\n\n");
        for i in 0..n {
            let speaker = ["ROMEO.", "Juliet.", "Friar Laurence."][(i + 2) % 3];
            let opening = if i == 7 { 1 } else { i };
            t.push_str(&format!(
                "{speaker}\nFirst line of speech {opening}, [Aside.] spoken,\n"
            ));
            t.push_str(&format!("second line of speech {opening};\n"));
            for k in 3..=5 {
                t.push_str(&format!("line {k} of speech {i}.\n"));
            }
            t.push_str("\n[Exit.]\n\n");
        }
        t
    }

    #[test]
    fn the_conversation_set_is_deterministic_well_formed_and_holds_its_question_out() {
        let texts = vec![
            play(50),
            "Sonnet.\n\nNo speeches here\nat all.\n".to_string(),
            play(40),
        ];
        let set = ConversationSet::from_texts(&texts, "plays").unwrap();
        assert_eq!((set.files, set.speeches), (3, 90));
        // The list of persons is no speech; speech 7 (and its twin in the second play) and
        // the second play's repeats of the first's are left out: 50 - 1 conversations.
        let n = set.train.len() + set.val.len();
        assert_eq!(n, 49);
        assert_eq!(set.val.len(), n / VAL_EVERY);
        let first = &set.train[0];
        assert_eq!(
            first.user,
            "Continue this speech of FRIAR LAURENCE:\nFirst line of speech 0, spoken,\nsecond line of speech 0;"
        );
        assert_eq!(first.assistant, "line 3 of speech 0.\nline 4 of speech 0.");
        // The held-out question is ROMEO's first validation conversation (the second: the
        // first is JULIET's), and no training one.
        assert_eq!(set.held_out, 1);
        let held = set.held_out();
        assert!(
            held.user.starts_with("Continue this speech of ROMEO:\n"),
            "{held:?}"
        );
        assert!(set.train.iter().all(|c| c.user != held.user));
        let questions: HashSet<&str> = set
            .train
            .iter()
            .chain(&set.val)
            .map(|c| c.user.as_str())
            .collect();
        assert_eq!(questions.len(), n, "a question asked twice");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JSONL_NAME);
        set.write_jsonl(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        // Deterministic: built and written again, the same bytes.
        let again = ConversationSet::from_texts(&texts, "plays").unwrap();
        again.write_jsonl(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);

        // Every line is a conversation in the `messages` format, train first, then val.
        let text = String::from_utf8(bytes).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), n);
        for (line, c) in lines.iter().zip(set.train.iter().chain(&set.val)) {
            let record = parse_line(line).unwrap();
            assert_eq!(record.format(), Format::Messages);
            let Record::Chat { messages, .. } = record else {
                panic!("not a chat: {line}")
            };
            assert_eq!(messages, c.messages());
        }
        // `prepare`'s split (the last round(n * f) examples) is exactly the validation set.
        let f = set.val_fraction();
        assert_eq!((n as f64 * f).round() as usize, set.val.len());
        for (train, val) in [(6734usize, 354usize), (19, 1), (999_999, 52_631)] {
            let f = val as f64 / (train + val) as f64;
            assert_eq!(((train + val) as f64 * f).round() as usize, val);
        }
    }

    #[test]
    fn a_corpus_without_speeches_is_refused_naming_it() {
        let e = ConversationSet::from_texts(&["Sonnet.\nShall I compare thee".into()], "my-texts")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("my-texts") && e.contains("MEMWALL_CORPUS"),
            "{e}"
        );
        // Fewer than VAL_EVERY conversations (one speech of VAL_EVERY - 1 repeats another):
        // no validation one.
        let e = ConversationSet::from_texts(&[play(VAL_EVERY - 1)], "short").unwrap_err();
        let want = format!("short: {} distinct speeches", VAL_EVERY - 2);
        assert!(e.to_string().contains(&want), "{e}");
    }
}
