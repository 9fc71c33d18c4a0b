//! `memwall prepare chats.jsonl --tokenizer DIR --out DIR`: chat data → an *examples* data
//! set ([`crate::data::examples`]): per split the tokens (`train.bin`, `val.bin`, the shard
//! format), the examples' boundaries (`.idx`) and one trained bit per token (`.mask`), and
//! `meta.json` (format `memwall-examples`) with the template's hash, `--train-on` and the
//! counts.
//!
//! * **Streamed.** Lines are read a batch at a time ([`super::read::for_each_line`]), encoded
//!   in parallel by [`Encoder`] (order kept), and their tokens appended to a temporary file in
//!   `--out`; memory holds one batch of lines, one bit per token and one offset per example
//!   (a 100 MB JSONL file of ~25 M tokens: ~3 MB of bits).
//! * **Split by whole examples**: the last `val_fraction` of the examples (rounded, at least
//!   one each side) is the validation split, as text `prepare` holds out its last documents.
//! * **Refusals**: the first line that cannot be used (bad JSON, unknown role, a template that
//!   raises, …) stops with its file:line, before anything in `--out` is replaced; a
//!   conversation without an assistant turn is warned about, counted and left out.
//! * **Atomic**, as text `prepare`: once every line is encoded, `meta.json` is removed, the
//!   shards, indexes and masks are written atomically, and `meta.json` last.

use super::encode::{Encoder, Outcome, TrainOn};
use super::format::Format;
use super::read::{Place, chat_files, for_each_line};
use crate::data::examples::{BitVec, write_index, write_mask};
use crate::data::prepare::{
    EXAMPLES_FORMAT, META_VERSION, check_out, check_val_fraction, create_out, names,
};
use crate::data::shard::{HEADER_BYTES, MAGIC, VERSION, token_width};
use crate::util::atomic;
use anyhow::{Context, Result, bail, ensure};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Lines encoded together (in parallel).
const BATCH_LINES: usize = 1024;
/// Bytes of lines encoded together, at most (about).
const BATCH_BYTES: usize = 16 << 20;

/// What to prepare.
#[derive(Clone, Debug)]
pub struct ChatPrepareOptions {
    /// `.jsonl` / `.jsonl.gz` files, or folders of them.
    pub inputs: Vec<PathBuf>,
    /// Output directory (created if missing).
    pub out: PathBuf,
    /// Fraction of examples held out for validation, in (0, 0.5].
    pub val_fraction: f64,
}

/// One split's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SplitCounts {
    pub examples: u64,
    pub tokens: u64,
    pub trained_tokens: u64,
}

/// What [`prepare_chat`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatPrepareSummary {
    pub train: SplitCounts,
    pub val: SplitCounts,
    /// Examples by the format their line was in.
    pub formats: BTreeMap<Format, u64>,
    /// Conversations without an assistant turn (warned, left out).
    pub no_assistant: u64,
    /// The output directory.
    pub out: PathBuf,
}

/// `meta.json`'s `chat` object.
#[derive(Serialize)]
struct ChatMeta<'a> {
    /// SHA-256 of the chat template's source (`None`: raw text only, no template needed).
    template_hash: Option<String>,
    /// Where the template came from.
    template: Option<&'a str>,
    train_on: &'a str,
    /// Examples by input format.
    formats: BTreeMap<&'a str, u64>,
    /// Conversations without an assistant turn: warned, counted, not trained.
    no_assistant: u64,
}

/// `meta.json` of an examples data set (read by [`crate::data::loader`]).
#[derive(Serialize)]
struct MetaOut<'a> {
    format: &'a str,
    version: u32,
    /// What the examples are: `chat`.
    data: &'a str,
    tokenizer: &'a str,
    tokenizer_hash: &'a str,
    vocab_size: usize,
    eot: u32,
    train_tokens: u64,
    val_tokens: u64,
    train_examples: u64,
    val_examples: u64,
    train_trained_tokens: u64,
    val_trained_tokens: u64,
    val_fraction: f64,
    chat: ChatMeta<'a>,
    sources: Vec<String>,
}

/// Whether `inputs` are chat data: each a `.jsonl`/`.jsonl.gz` file, or a folder holding such
/// files directly (read in name order; its other files, a README say, are not read and
/// `notes` names them). Anything else is text for [`crate::data::prepare()`]. Refused, each
/// naming the path: a mix of the two kinds; a `.json` file (chat data is JSON Lines); a folder
/// whose `.jsonl` files are only in its subfolders.
pub fn is_chat_input(inputs: &[PathBuf], notes: &mut dyn FnMut(String)) -> Result<bool> {
    let chat_name = |p: &Path| {
        let n = p.file_name().map(|n| n.to_string_lossy().into_owned());
        n.is_some_and(|n| n.ends_with(".jsonl") || n.ends_with(".jsonl.gz"))
    };
    let hidden = |p: &Path| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
    };
    let files_in = |dir: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|entries| entries.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default();
        v.retain(|p| !hidden(p));
        v.sort();
        v
    };
    // The first chat file anywhere below `dir` (depth-first, name order).
    fn nested_chat(dir: &Path, chat_name: &dyn Fn(&Path) -> bool, depth: usize) -> Option<PathBuf> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .collect();
        entries.sort();
        entries
            .iter()
            .find(|p| p.is_file() && chat_name(p))
            .cloned()
            .or_else(|| {
                (depth < 8)
                    .then(|| {
                        entries
                            .iter()
                            .filter(|p| p.is_dir())
                            .find_map(|d| nested_chat(d, chat_name, depth + 1))
                    })
                    .flatten()
            })
    }
    let mut chat = 0;
    for p in inputs {
        let shown = p.display();
        if p.is_file() {
            let name = p.file_name().map(|n| n.to_string_lossy().to_lowercase());
            if name
                .as_deref()
                .is_some_and(|n| n.ends_with(".json") || n.ends_with(".json.gz"))
            {
                bail!(
                    "'{shown}': a .json file; memwall reads chat data as JSON Lines, one \
                     conversation per line: if it holds one object per line, name it .jsonl; if it \
                     holds one JSON array, convert it (`jq -c '.[]' FILE.json > FILE.jsonl`)"
                );
            }
            chat += chat_name(p) as usize;
            continue;
        }
        if !p.is_dir() {
            continue; // refused by the preparation that reads it, with its own message
        }
        let files = files_in(p);
        let (direct, other): (Vec<&PathBuf>, Vec<&PathBuf>) = files
            .iter()
            .filter(|f| f.is_file())
            .partition(|f| chat_name(f));
        if !direct.is_empty() {
            chat += 1;
            if !other.is_empty() {
                let other: Vec<PathBuf> = other.into_iter().cloned().collect();
                notes(format!(
                    "note: folder '{shown}': reading its {} .jsonl/.jsonl.gz file(s); {} not read",
                    direct.len(),
                    names(&other)
                ));
            }
        } else if let Some(nested) = nested_chat(p, &chat_name, 0) {
            bail!(
                "folder '{shown}' holds chat data only in a subfolder ('{}'): pass that \
                 subfolder (or the files) instead; a folder's .jsonl files are read from the \
                 folder itself, not its subfolders",
                nested.display()
            );
        }
    }
    if chat > 0 && chat < inputs.len() {
        bail!(
            "the inputs mix chat data (.jsonl, .jsonl.gz, or folders of them) with text: prepare \
             each kind into its own --out"
        );
    }
    Ok(chat > 0)
}

/// A temporary file in `--out`, removed when dropped.
struct Temp {
    path: PathBuf,
    file: File,
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Encodes the chat data of `opts.inputs` with `encoder` and writes the examples data set
/// (see the module docs); `warn` gets a line per conversation without an assistant turn.
pub fn prepare_chat(
    opts: &ChatPrepareOptions,
    encoder: &Encoder,
    warn: &mut dyn Write,
) -> Result<ChatPrepareSummary> {
    let f = opts.val_fraction;
    check_val_fraction(f)?;
    ensure!(
        !opts.inputs.is_empty(),
        "no input files given: pass .jsonl or .jsonl.gz files, or folders of them"
    );
    let out = &opts.out;
    check_out(out)?;
    for input in &opts.inputs {
        chat_files(input)?;
    }
    create_out(out)?;

    let id = encoder.tokenizer().id();
    ensure!(
        id.vocab_size <= (crate::data::examples::UNTRAINED as usize),
        "the tokenizer's vocabulary of {} tokens is too large for chat data (at most 2^31)",
        id.vocab_size
    );
    let width = token_width(id.vocab_size);
    let tmp_path = out.join(format!(".chat-tokens.{}", atomic::tmp_suffix()));
    let file = File::create_new(&tmp_path)
        .with_context(|| format!("cannot create '{}'", tmp_path.display()))?;
    let tmp = Temp {
        path: tmp_path,
        file,
    };

    // ---- every line encoded; tokens to the temporary file, bits and offsets kept ----
    let mut w = BufWriter::with_capacity(1 << 20, &tmp.file);
    let mut bits = BitVec::default();
    let mut offsets = vec![0u64];
    let mut formats: BTreeMap<Format, u64> = BTreeMap::new();
    let mut no_assistant = 0u64;
    let mut lines: Vec<(Place, String)> = Vec::new();
    let mut bytes = 0usize;
    let mut flush = |lines: &mut Vec<(Place, String)>| -> Result<()> {
        let encoded: Vec<Result<Outcome>> = lines
            .par_iter()
            .map(|(place, line)| {
                encoder
                    .encode_line(line)
                    .with_context(|| format!("{place}"))
            })
            .collect();
        for ((place, _), outcome) in lines.iter().zip(encoded) {
            let e = match outcome? {
                Outcome::NoAssistant(fmt) => {
                    no_assistant += 1;
                    writeln!(
                        warn,
                        "warning: {place}: a {} conversation without an assistant turn: nothing \
                         to train, left out",
                        fmt.name()
                    )?;
                    continue;
                }
                Outcome::Example(e) => e,
            };
            if let Some(bad) = e.ids.iter().find(|&&t| t as usize >= id.vocab_size) {
                bail!(
                    "{place}: token {bad} is not below the tokenizer's vocabulary size {}",
                    id.vocab_size
                );
            }
            let ctx = || format!("cannot write '{}' (disk full?)", tmp.path.display());
            for &t in &e.ids {
                if width == 2 {
                    w.write_all(&(t as u16).to_le_bytes()).with_context(ctx)?;
                } else {
                    w.write_all(&t.to_le_bytes()).with_context(ctx)?;
                }
            }
            for &b in &e.trained {
                bits.push(b);
            }
            offsets.push(bits.len());
            *formats.entry(e.format).or_default() += 1;
        }
        lines.clear();
        Ok(())
    };
    for input in &opts.inputs {
        for_each_line(input, &mut |place, line| {
            bytes += line.len();
            lines.push((place.clone(), line.to_string()));
            if lines.len() >= BATCH_LINES || bytes >= BATCH_BYTES {
                flush(&mut lines)?;
                bytes = 0;
            }
            Ok(())
        })?;
    }
    flush(&mut lines)?;
    w.flush()
        .with_context(|| format!("cannot write '{}' (disk full?)", tmp.path.display()))?;
    drop(w);

    // ---- the split: the last examples held out ----
    let n = offsets.len() as u64 - 1;
    let val = ((n as f64 * f).round() as u64).clamp(1, n.max(1));
    ensure!(
        n >= 2 && n - val >= 1,
        "too few examples: {} from {} (and {} without an assistant turn); each split needs at \
         least one: add conversations",
        n,
        names(&opts.inputs),
        no_assistant
    );
    let train = n - val;
    let cut = offsets[train as usize];
    let total = bits.len();
    let trained_in = |a: u64, b: u64| -> u64 {
        (a..b)
            .filter(|&i| (bits.bytes()[(i / 8) as usize] >> (i % 8)) & 1 == 1)
            .count() as u64
    };
    let counts = |ex: u64, a: u64, b: u64| SplitCounts {
        examples: ex,
        tokens: b - a,
        trained_tokens: trained_in(a, b),
    };
    let (train_c, val_c) = (counts(train, 0, cut), counts(val, cut, total));

    // ---- written: meta.json removed first, written last ----
    let meta_path = out.join("meta.json");
    if meta_path.exists() {
        std::fs::remove_file(&meta_path).with_context(|| {
            format!("cannot replace '{}': is it writable?", meta_path.display())
        })?;
    }
    let w64 = width as u64;
    copy_shard(&tmp, &out.join("train.bin"), (0, cut * w64), id.vocab_size)?;
    copy_shard(
        &tmp,
        &out.join("val.bin"),
        (cut * w64, total * w64),
        id.vocab_size,
    )?;
    drop(tmp);
    write_index(&out.join("train.idx"), &offsets[..=train as usize])?;
    let val_offsets: Vec<u64> = offsets[train as usize..].iter().map(|o| o - cut).collect();
    write_index(&out.join("val.idx"), &val_offsets)?;
    let train_bits = bits.range(0, cut);
    write_mask(&out.join("train.mask"), train_bits.bytes(), cut)?;
    let val_bits = bits.range(cut, total);
    write_mask(&out.join("val.mask"), val_bits.bytes(), total - cut)?;

    let template = encoder.template();
    // The template the examples were rendered with, beside them: training copies it into its
    // checkpoints, so they render conversations as they were trained on them.
    let template_path = out.join(crate::ckpt::CHAT_TEMPLATE_FILE);
    match template {
        Some(t) => atomic::write_file(&template_path, t.source().as_bytes())?,
        None => {
            let _ = std::fs::remove_file(&template_path);
        }
    }
    let meta = MetaOut {
        format: EXAMPLES_FORMAT,
        version: META_VERSION,
        data: "chat",
        tokenizer: &id.name,
        tokenizer_hash: &id.hash,
        vocab_size: id.vocab_size,
        eot: id.eot,
        train_tokens: train_c.tokens,
        val_tokens: val_c.tokens,
        train_examples: train,
        val_examples: val,
        train_trained_tokens: train_c.trained_tokens,
        val_trained_tokens: val_c.trained_tokens,
        val_fraction: f,
        chat: ChatMeta {
            template_hash: template.map(|t| t.hash()),
            template: template.map(|t| t.origin()),
            train_on: match encoder.train_on() {
                TrainOn::Answers => "answers",
                TrainOn::All => "all",
            },
            formats: formats.iter().map(|(f, n)| (f.name(), *n)).collect(),
            no_assistant,
        },
        sources: opts
            .inputs
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
    };
    let json = serde_json::to_string_pretty(&meta).context("cannot serialise meta.json")?;
    atomic::write_with(&meta_path, |w| {
        w.write_all(json.as_bytes())
            .and_then(|_| w.write_all(b"\n"))
            .with_context(|| format!("cannot write '{}'", meta_path.display()))
    })?;
    Ok(ChatPrepareSummary {
        train: train_c,
        val: val_c,
        formats,
        no_assistant,
        out: out.clone(),
    })
}

/// Writes bytes `a..b` of the temporary token file as the shard `path` (atomically).
fn copy_shard(tmp: &Temp, path: &Path, (a, b): (u64, u64), vocab_size: usize) -> Result<()> {
    let width = token_width(vocab_size) as u64;
    let mut h = [0u8; HEADER_BYTES];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(width as u32).to_le_bytes());
    h[16..20].copy_from_slice(&(vocab_size as u32).to_le_bytes());
    h[24..32].copy_from_slice(&((b - a) / width).to_le_bytes());
    atomic::write_with(path, |f| {
        let ctx = || format!("cannot write shard '{}' (disk full?)", path.display());
        let mut w = BufWriter::with_capacity(1 << 20, f);
        w.write_all(&h).with_context(ctx)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut at = a;
        while at < b {
            let n = ((b - at) as usize).min(buf.len());
            tmp.file
                .read_exact_at(&mut buf[..n], at)
                .with_context(|| format!("cannot read '{}'", tmp.path.display()))?;
            w.write_all(&buf[..n]).with_context(ctx)?;
            at += n as u64;
        }
        w.flush().with_context(ctx)
    })
}
