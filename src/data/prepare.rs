//! `memwall prepare`: turn text files into a tokenized data set (`train.bin`, `val.bin`,
//! `meta.json`) that [`crate::data::loader::DataSet`] opens.
//!
//! * **Inputs** are files or directories. A file named explicitly must be plain UTF-8 text
//!   (no NUL bytes), else it is an error. Directories are walked recursively in path order;
//!   hidden entries (names starting with `.`) and symlinked directories are skipped, and files
//!   that are not UTF-8 text are skipped with a warning on stderr. Files that are empty or only
//!   whitespace are skipped with a warning. A leading UTF-8 byte-order mark is dropped.
//! * **Tokenizer**: GPT-2's ([`prepare`]) or any [`Tokenizer`] ([`prepare_with`]; the CLI's
//!   `--tokenizer`). Its vocabulary fixes the token width of the shards (u16 up to 65536
//!   tokens, else u32) and `meta.json` records its name, content hash, vocabulary size and
//!   end-of-text token, so training can refuse data made for another model.
//! * **Documents**: each file is one document. The token stream is
//!   `EOT d₁ EOT d₂ … EOT dₙ` (the tokenizer's end-of-text token, [`EOT`] for GPT-2, before
//!   every document, as GPT-2's data preparation does), so a model always sees it before a
//!   document starts.
//! * **Split**: the last `val_fraction` of the concatenated stream (rounded to whole tokens) is
//!   the validation split, the rest the training split. With several documents this holds out
//!   the last documents in path order, which keeps validation text unseen in training.
//! * **Output**: `OUT/train.bin` and `OUT/val.bin` ([`crate::data::shard`] format) and
//!   `OUT/meta.json`, each written atomically. `meta.json` is removed first and written last,
//!   so a crash part-way leaves a directory that [`crate::data::loader::DataSet::open`] refuses
//!   rather than a mix of old and new shards.
//! * Tokenization runs in parallel (files, and pieces of large files, across rayon threads)
//!   with a deterministic result: the same inputs give byte-identical outputs. A file is cut
//!   into pieces only where the tokenizer allows it ([`Tokenizer::split_points`]); otherwise
//!   it is encoded whole.

use crate::data::shard::write_shard;
#[cfg(doc)]
use crate::data::tokenizer::EOT;
use crate::data::tokenizer::Tokenizer;
use crate::util::atomic;
use anyhow::{Context, Result, bail, ensure};
use rayon::prelude::*;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// What to prepare.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// Text files and/or directories of text files.
    pub inputs: Vec<PathBuf>,
    /// Output directory (created if missing).
    pub out: PathBuf,
    /// Fraction of tokens held out for validation, in (0, 0.5].
    pub val_fraction: f64,
}

/// What `prepare` wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareSummary {
    /// Documents (files) tokenized.
    pub files: usize,
    /// Bytes of text read from those files.
    pub bytes: u64,
    pub train_tokens: u64,
    pub val_tokens: u64,
    /// The output directory.
    pub out: PathBuf,
}

/// One entry of `meta.json`'s `sources`.
#[derive(Serialize)]
struct Source {
    path: String,
    bytes: u64,
    tokens: u64,
}

/// `meta.json` as written (the reader is [`crate::data::loader`]).
#[derive(Serialize)]
struct MetaOut<'a> {
    format: &'a str,
    version: u32,
    tokenizer: &'a str,
    tokenizer_hash: &'a str,
    vocab_size: usize,
    eot: u32,
    train_tokens: u64,
    val_tokens: u64,
    val_fraction: f64,
    sources: Vec<Source>,
}

/// `meta.json`'s `format` field.
pub const META_FORMAT: &str = "memwall-tokens";
/// `meta.json`'s `format` field for an examples data set (chat data,
/// [`crate::data::examples`]).
pub const EXAMPLES_FORMAT: &str = "memwall-examples";
/// `meta.json`'s `version` field.
pub const META_VERSION: u32 = 1;
/// `meta.json`'s `tokenizer` field for GPT-2.
pub const TOKENIZER_NAME: &str = crate::data::tokenizer::GPT2_NAME;

/// Size of the pieces a large document is cut into for parallel tokenization.
const PIECE_BYTES: usize = 1 << 20;
/// Text read per parallel batch; bounds memory for large corpora.
const BATCH_BYTES: u64 = 64 << 20;
/// Show a progress bar above this many bytes of input.
const PROGRESS_BYTES: u64 = 4 << 20;

/// A file found among the inputs.
struct Candidate {
    path: PathBuf,
    /// Named on the command line (errors) rather than found in a directory (warnings).
    explicit: bool,
    len: u64,
}

/// Tokenizes the inputs with GPT-2's tokenizer and writes `train.bin`, `val.bin` and
/// `meta.json` into `opts.out`.
pub fn prepare(opts: &PrepareOptions) -> Result<PrepareSummary> {
    prepare_with(opts, &Tokenizer::gpt2()?)
}

/// Tokenizes the inputs with `tok` and writes `train.bin`, `val.bin` and `meta.json` into
/// `opts.out`.
pub fn prepare_with(opts: &PrepareOptions, tok: &Tokenizer) -> Result<PrepareSummary> {
    let f = opts.val_fraction;
    check_val_fraction(f)?;
    ensure!(
        !opts.inputs.is_empty(),
        "no input files given: pass text files or directories, e.g. `memwall prepare book.txt --out data`"
    );

    // Check the inputs and the output directory before any work.
    let out = &opts.out;
    check_out(out)?;
    let candidates = collect_inputs(&opts.inputs)?;
    create_out(out)?;

    let id = tok.id();
    let eot = id.eot;
    let total: u64 = candidates.iter().map(|c| c.len).sum();
    let bar = if total >= PROGRESS_BYTES {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(total),
            indicatif::ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "tokenizing {bar:40} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta})",
        ) {
            bar.set_style(style);
        }
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };

    // GPT-2 BPE averages 3-4 bytes per token on English text.
    let mut stream: Vec<u32> = Vec::with_capacity((total / 3).min(1 << 28) as usize + 1);
    let mut sources: Vec<Source> = Vec::new();
    let mut bytes_used = 0u64;
    let mut i = 0;
    while i < candidates.len() {
        // Read a batch of files (sequentially: I/O), then tokenize it in parallel.
        let mut docs: Vec<(&Candidate, String)> = Vec::new();
        let mut batch_bytes = 0u64;
        while i < candidates.len() && (docs.is_empty() || batch_bytes < BATCH_BYTES) {
            let c = &candidates[i];
            i += 1;
            if let Some(text) = read_text(c)? {
                batch_bytes += c.len;
                docs.push((c, text));
            } else {
                bar.inc(c.len);
            }
        }
        let pieces: Vec<(usize, &str)> = docs
            .iter()
            .enumerate()
            .flat_map(|(d, (_, text))| {
                let mut bounds = vec![0];
                bounds.extend(tok.split_points(text, PIECE_BYTES));
                bounds.push(text.len());
                bounds
                    .windows(2)
                    .map(|w| (d, &text[w[0]..w[1]]))
                    .collect::<Vec<_>>()
            })
            .collect();
        let encoded: Vec<Vec<u32>> = pieces
            .par_iter()
            .map(|(d, piece)| {
                let ids = tok.encode(piece).with_context(|| {
                    format!(
                        "cannot tokenize '{}' with {}",
                        docs[*d].0.path.display(),
                        id.describe()
                    )
                })?;
                bar.inc(piece.len() as u64);
                Ok(ids)
            })
            .collect::<Result<_>>()?;
        let mut doc_tokens = vec![0u64; docs.len()];
        let mut current = usize::MAX;
        for ((d, _), ids) in pieces.iter().zip(encoded) {
            if *d != current {
                stream.push(eot);
                current = *d;
            }
            doc_tokens[*d] += ids.len() as u64;
            stream.extend_from_slice(&ids);
        }
        for ((c, text), n) in docs.iter().zip(doc_tokens) {
            bytes_used += c.len;
            // Account for a dropped byte-order mark so the bar ends at its total.
            bar.inc(c.len - text.len() as u64);
            sources.push(Source {
                path: c.path.display().to_string(),
                bytes: c.len,
                tokens: n,
            });
        }
    }
    bar.finish_and_clear();

    if sources.is_empty() {
        bail!(
            "no text to prepare in {}: every file was empty, whitespace or not UTF-8 text; pass plain UTF-8 text files",
            names(&opts.inputs)
        );
    }

    let n = stream.len() as u64;
    let val = ((n as f64 * f).round() as u64).min(n);
    let train = n - val;
    ensure!(
        train >= 2 && val >= 2,
        "corpus too small: {n} tokens from {} split into {train} training and {val} validation tokens \
         with --val-fraction {f}; each split needs at least 2 tokens (and the trainer needs --seq + 1): \
         add more text or change --val-fraction",
        names(&opts.inputs)
    );

    let meta_path = out.join("meta.json");
    if meta_path.exists() {
        std::fs::remove_file(&meta_path).with_context(|| {
            format!("cannot replace '{}': is it writable?", meta_path.display())
        })?;
    }
    let (train_toks, val_toks) = stream.split_at(train as usize);
    write_shard(&out.join("train.bin"), train_toks, id.vocab_size)?;
    write_shard(&out.join("val.bin"), val_toks, id.vocab_size)?;
    let files = sources.len();
    let meta = MetaOut {
        format: META_FORMAT,
        version: META_VERSION,
        tokenizer: &id.name,
        tokenizer_hash: &id.hash,
        vocab_size: id.vocab_size,
        eot,
        train_tokens: train,
        val_tokens: val,
        val_fraction: f,
        sources,
    };
    let json = serde_json::to_string_pretty(&meta).context("cannot serialise meta.json")?;
    atomic::write_with(&meta_path, |w| {
        w.write_all(json.as_bytes())
            .and_then(|_| w.write_all(b"\n"))
            .with_context(|| format!("cannot write '{}'", meta_path.display()))
    })?;

    Ok(PrepareSummary {
        files,
        bytes: bytes_used,
        train_tokens: train,
        val_tokens: val,
        out: out.clone(),
    })
}

/// Refuses an `--out` holding a `train.bin` or `val.bin` that memwall did not write (one
/// without the shard magic: another tool's shards, e.g. nanoGPT's, have the same names), so
/// that preparing never overwrites them.
/// `--val-fraction`: in (0, 0.5].
pub(crate) fn check_val_fraction(f: f64) -> Result<()> {
    ensure!(
        f.is_finite() && f > 0.0 && f <= 0.5,
        "--val-fraction {f} is out of range: it must be greater than 0 and at most 0.5 (e.g. 0.1)"
    );
    Ok(())
}

/// `--out` before any work: not a file, and not another program's shards.
pub(crate) fn check_out(out: &Path) -> Result<()> {
    if out.exists() && !out.is_dir() {
        bail!(
            "--out '{}' is an existing file, not a directory: choose a directory path",
            out.display()
        );
    }
    check_not_foreign_shards(out)
}

/// Creates `--out` (and its parents) and checks that it can be written.
pub(crate) fn create_out(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| {
        format!(
            "cannot create output directory '{}': choose a writable --out",
            out.display()
        )
    })?;
    check_writable(out)
}

pub(crate) fn check_not_foreign_shards(out: &Path) -> Result<()> {
    for name in ["train.bin", "val.bin"] {
        let path = out.join(name);
        if !path.exists() {
            continue;
        }
        let mut head = [0u8; 8];
        let ours = std::fs::File::open(&path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
            .is_ok()
            && head == crate::data::shard::MAGIC;
        if !ours {
            bail!(
                "--out '{}' holds {name}, which memwall did not write (not a memwall token \
                 shard); preparing would overwrite it: choose another --out",
                out.display()
            );
        }
    }
    Ok(())
}

/// Fails early, naming the directory, when `dir` cannot take new files.
pub(crate) fn check_writable(dir: &Path) -> Result<()> {
    let probe = dir.join(format!(".memwall-write-test.{}", std::process::id()));
    std::fs::write(&probe, b"").with_context(|| {
        format!(
            "output directory '{}' is not writable: choose a writable --out",
            dir.display()
        )
    })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// "'a', 'b' and 2 more" for error messages.
pub(crate) fn names(paths: &[PathBuf]) -> String {
    let shown: Vec<String> = paths
        .iter()
        .take(3)
        .map(|p| format!("'{}'", p.display()))
        .collect();
    let mut s = shown.join(", ");
    if paths.len() > 3 {
        s.push_str(&format!(" and {} more", paths.len() - 3));
    }
    s
}

/// The files [`prepare()`] reads for `inputs`, in its order: inputs in the order given, each
/// directory walked (hidden entries and symlinked directories skipped) and sorted by path.
pub(crate) fn input_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    Ok(collect_inputs(inputs)?
        .into_iter()
        .map(|c| c.path)
        .collect())
}

/// Expands the inputs into files, in a deterministic order: inputs in the order given, each
/// directory's files sorted by path.
fn collect_inputs(inputs: &[PathBuf]) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    for input in inputs {
        let meta = std::fs::metadata(input).with_context(|| {
            format!(
                "input '{}' does not exist or cannot be read: pass text files or directories",
                input.display()
            )
        })?;
        if meta.is_dir() {
            let mut found = Vec::new();
            walk(input, &mut found)?;
            found.sort_by(|a, b| a.path.cmp(&b.path));
            if found.is_empty() {
                eprintln!(
                    "memwall: warning: directory '{}' holds no files",
                    input.display()
                );
            }
            out.extend(found);
        } else if meta.is_file() {
            out.push(Candidate {
                path: input.clone(),
                explicit: true,
                len: meta.len(),
            });
        } else {
            bail!(
                "input '{}' is not a regular file or directory: pass plain UTF-8 text files",
                input.display()
            );
        }
    }
    if out.is_empty() {
        bail!(
            "no files found in {}: pass plain UTF-8 text files or directories holding them",
            names(inputs)
        );
    }
    Ok(out)
}

/// Recursively lists regular files under `dir`, skipping hidden entries and symlinked
/// directories (which could loop).
fn walk(dir: &Path, found: &mut Vec<Candidate>) -> Result<()> {
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list directory '{}'", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list directory '{}'", dir.display()))?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let ft = entry
            .file_type()
            .with_context(|| format!("cannot stat '{}'", path.display()))?;
        if ft.is_dir() {
            walk(&path, found)?;
        } else if ft.is_file() || ft.is_symlink() {
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => found.push(Candidate {
                    path,
                    explicit: false,
                    len: m.len(),
                }),
                Ok(m) if m.is_dir() => {
                    eprintln!(
                        "memwall: warning: skipping symlinked directory '{}'",
                        path.display()
                    )
                }
                Ok(_) => {}
                Err(e) => eprintln!("memwall: warning: skipping '{}': {e}", path.display()),
            }
        }
    }
    Ok(())
}

/// Reads a candidate as text. `Ok(None)` means skip it (a warning was printed); a file named
/// explicitly that is not text is an error.
fn read_text(c: &Candidate) -> Result<Option<String>> {
    let p = c.path.display();
    let bytes = std::fs::read(&c.path).with_context(|| format!("cannot read input '{p}'"))?;
    let text = if bytes.contains(&0) {
        None
    } else {
        String::from_utf8(bytes).ok()
    };
    let Some(mut text) = text else {
        if c.explicit {
            bail!("binary or non-UTF-8 file '{p}': pass plain UTF-8 text");
        }
        eprintln!("memwall: warning: skipping '{p}': binary or non-UTF-8");
        return Ok(None);
    };
    if text.trim().is_empty() {
        eprintln!("memwall: warning: skipping '{p}': empty or only whitespace");
        return Ok(None);
    }
    if text.starts_with('\u{FEFF}') {
        text.drain(..'\u{FEFF}'.len_utf8());
    }
    Ok(Some(text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard::Shard;
    use crate::data::tokenizer::fixture::Spec;
    use crate::data::tokenizer::{EOT, split_points};

    fn opts(inputs: Vec<PathBuf>, out: PathBuf, val_fraction: f64) -> PrepareOptions {
        PrepareOptions {
            inputs,
            out,
            val_fraction,
        }
    }

    fn all(s: &Shard) -> Vec<u32> {
        let mut v = vec![0; s.len()];
        s.read(0, &mut v).unwrap();
        v
    }

    const TEXTS: [(&str, &str); 3] = [
        (
            "a.txt",
            "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
        ),
        (
            "b.md",
            "# Notes\nO Romeo, Romeo! wherefore art thou Romeo? — naïve café ☕\n",
        ),
        (
            "sub/c",
            "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n",
        ),
    ];

    fn corpus() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in TEXTS {
            let p = dir.path().join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        std::fs::write(dir.path().join(".hidden.txt"), "should not be read").unwrap();
        std::fs::write(dir.path().join("blank.txt"), "  \n\t\n").unwrap();
        std::fs::write(
            dir.path().join("sub/image.png"),
            [0x89, b'P', b'N', b'G', 0, 0, 0xff],
        )
        .unwrap();
        dir
    }

    #[test]
    fn prepares_directory_counts_split_and_meta() {
        let src = corpus();
        let out = tempfile::tempdir().unwrap();
        let o = out.path().join("data");
        let s = prepare(&opts(vec![src.path().to_path_buf()], o.clone(), 0.25)).unwrap();
        let tok = Tokenizer::gpt2().unwrap();

        // Expected stream: EOT before each document, in sorted path order (a.txt, b.md, sub/c).
        let mut expect = Vec::new();
        for (_, text) in TEXTS {
            expect.push(EOT);
            expect.extend(tok.encode(text).unwrap());
        }
        let n = expect.len() as u64;
        assert_eq!(s.files, 3);
        assert_eq!(
            s.bytes,
            TEXTS.iter().map(|(_, t)| t.len() as u64).sum::<u64>()
        );
        assert_eq!(s.train_tokens + s.val_tokens, n);
        assert_eq!(s.val_tokens, (n as f64 * 0.25).round() as u64);
        assert_eq!(s.out, o);

        let train = Shard::open(&o.join("train.bin")).unwrap();
        let val = Shard::open(&o.join("val.bin")).unwrap();
        assert_eq!(train.len() as u64, s.train_tokens);
        assert_eq!(val.len() as u64, s.val_tokens);
        let mut got = all(&train);
        got.extend(all(&val));
        assert_eq!(got, expect);
        assert_eq!(got[0], EOT);

        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(o.join("meta.json")).unwrap()).unwrap();
        assert_eq!(meta["format"], "memwall-tokens");
        assert_eq!(meta["version"], 1);
        assert_eq!(meta["tokenizer"], "gpt2-r50k_base");
        assert_eq!(meta["tokenizer_hash"], "r50k_base");
        assert_eq!(meta["vocab_size"], 50257);
        assert_eq!(meta["eot"], 50256);
        assert_eq!(meta["train_tokens"], s.train_tokens);
        assert_eq!(meta["val_tokens"], s.val_tokens);
        assert_eq!(meta["val_fraction"], 0.25);
        let sources = meta["sources"].as_array().unwrap();
        assert_eq!(sources.len(), 3);
        assert!(sources[0]["path"].as_str().unwrap().ends_with("a.txt"));
        assert!(sources[2]["path"].as_str().unwrap().ends_with("c"));
        let token_sum: u64 = sources.iter().map(|s| s["tokens"].as_u64().unwrap()).sum();
        assert_eq!(token_sum + 3, n, "documents plus one EOT each");
        assert_eq!(sources[1]["bytes"], TEXTS[1].1.len());
        // Only the three outputs, no temporary files.
        let mut names: Vec<String> = std::fs::read_dir(&o)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["meta.json", "train.bin", "val.bin"]);

        // Preparing again replaces memwall's own shards; another tool's are never overwritten.
        prepare(&opts(vec![src.path().to_path_buf()], o.clone(), 0.25)).unwrap();
        std::fs::write(o.join("val.bin"), b"nanoGPT's uint16 tokens").unwrap();
        let e = format!(
            "{:#}",
            prepare(&opts(vec![src.path().to_path_buf()], o.clone(), 0.25)).unwrap_err()
        );
        assert!(e.contains("val.bin") && e.contains("did not write"), "{e}");
        assert_eq!(
            std::fs::read(o.join("val.bin")).unwrap(),
            b"nanoGPT's uint16 tokens"
        );
    }

    #[test]
    fn deterministic_output_bytes() {
        let src = corpus();
        let out = tempfile::tempdir().unwrap();
        let a = out.path().join("a");
        let b = out.path().join("b");
        prepare(&opts(vec![src.path().to_path_buf()], a.clone(), 0.1)).unwrap();
        prepare(&opts(vec![src.path().to_path_buf()], b.clone(), 0.1)).unwrap();
        for f in ["train.bin", "val.bin", "meta.json"] {
            assert_eq!(
                std::fs::read(a.join(f)).unwrap(),
                std::fs::read(b.join(f)).unwrap(),
                "{f}"
            );
        }
        // Re-running into the same directory replaces the outputs identically.
        prepare(&opts(vec![src.path().to_path_buf()], a.clone(), 0.1)).unwrap();
        assert_eq!(
            std::fs::read(a.join("train.bin")).unwrap(),
            std::fs::read(b.join("train.bin")).unwrap()
        );
    }

    #[test]
    fn explicit_files_keep_given_order_and_bom_is_dropped() {
        let src = corpus();
        let out = tempfile::tempdir().unwrap();
        let bom = src.path().join("bom.txt");
        std::fs::write(&bom, "\u{FEFF}Hello world, hello again and again.").unwrap();
        let s = prepare(&opts(
            vec![bom.clone(), src.path().join("a.txt")],
            out.path().to_path_buf(),
            0.2,
        ))
        .unwrap();
        let tok = Tokenizer::gpt2().unwrap();
        let mut expect = vec![EOT];
        expect.extend(tok.encode("Hello world, hello again and again.").unwrap());
        expect.push(EOT);
        expect.extend(tok.encode(TEXTS[0].1).unwrap());
        let mut got = all(&Shard::open(&out.path().join("train.bin")).unwrap());
        got.extend(all(&Shard::open(&out.path().join("val.bin")).unwrap()));
        assert_eq!(got, expect);
        assert_eq!(s.files, 2);
    }

    #[test]
    fn large_document_is_split_and_tokenized_identically() {
        let line = "Tomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day — ça va.\n";
        let text = line.repeat((3 * PIECE_BYTES) / line.len());
        assert!(split_points(&text, PIECE_BYTES).len() >= 2);
        let src = tempfile::tempdir().unwrap();
        let p = src.path().join("big.txt");
        std::fs::write(&p, &text).unwrap();
        let out = tempfile::tempdir().unwrap();
        prepare(&opts(vec![p], out.path().to_path_buf(), 0.5)).unwrap();
        let mut got = all(&Shard::open(&out.path().join("train.bin")).unwrap());
        got.extend(all(&Shard::open(&out.path().join("val.bin")).unwrap()));
        let mut expect = vec![EOT];
        expect.extend(Tokenizer::gpt2().unwrap().encode(&text).unwrap());
        assert_eq!(got, expect);
    }

    fn sha256_hex(p: &Path) -> String {
        use sha2::Digest;
        let d = sha2::Sha256::digest(std::fs::read(p).unwrap());
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// GPT-2 output is byte for byte what `memwall prepare` wrote before the tokenizer
    /// interface (digests taken with that binary on this corpus, --val-fraction 0.25).
    #[test]
    fn gpt2_output_bytes_unchanged() {
        let src = corpus();
        let out = tempfile::tempdir().unwrap();
        prepare(&opts(
            vec![src.path().to_path_buf()],
            out.path().to_path_buf(),
            0.25,
        ))
        .unwrap();
        assert_eq!(
            sha256_hex(&out.path().join("train.bin")),
            "dc500be9ee3d0d8ea73bab28af3429ed42eafa864714778c864eabd65501cdad"
        );
        assert_eq!(
            sha256_hex(&out.path().join("val.bin")),
            "af9ed19c09cd01d47f6f49ae6b47c86d6dff3db3f423176512101e0159c72cb8"
        );
        // prepare_with GPT-2 is the same thing.
        let again = tempfile::tempdir().unwrap();
        let o = opts(
            vec![src.path().to_path_buf()],
            again.path().to_path_buf(),
            0.25,
        );
        prepare_with(&o, &Tokenizer::gpt2().unwrap()).unwrap();
        for f in ["train.bin", "val.bin"] {
            assert_eq!(
                sha256_hex(&out.path().join(f)),
                sha256_hex(&again.path().join(f))
            );
        }
    }

    /// All tokens of a prepared directory, train then val.
    fn stream(dir: &Path) -> Vec<u32> {
        let mut got = all(&Shard::open(&dir.join("train.bin")).unwrap());
        got.extend(all(&Shard::open(&dir.join("val.bin")).unwrap()));
        got
    }

    #[test]
    fn prepare_with_hf_tokenizer_end_to_end() {
        let src = corpus();
        let tmp = tempfile::tempdir().unwrap();
        let tok =
            Tokenizer::from_file(Spec::llama3_style().write(&tmp.path().join("smol"))).unwrap();
        let id = tok.id();
        assert_eq!((id.vocab_size, id.eot), (267, 266));
        let o = tmp.path().join("data");
        let s = prepare_with(&opts(vec![src.path().to_path_buf()], o.clone(), 0.25), &tok).unwrap();

        // The tokenizer's encoding of each document, its end-of-text token before each.
        let mut expect = Vec::new();
        for (_, text) in TEXTS {
            expect.push(266);
            expect.extend(tok.encode(text).unwrap());
        }
        assert_eq!(stream(&o), expect);
        assert_eq!(s.train_tokens + s.val_tokens, expect.len() as u64);
        // u16 tokens for 267 ids.
        let train = Shard::open(&o.join("train.bin")).unwrap();
        assert_eq!(train.vocab_size(), 267);
        assert_eq!(
            std::fs::metadata(o.join("train.bin")).unwrap().len(),
            32 + 2 * s.train_tokens
        );

        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(o.join("meta.json")).unwrap()).unwrap();
        assert_eq!(meta["tokenizer"], "hf:smol");
        assert_eq!(meta["tokenizer_hash"], id.hash.as_str());
        assert_eq!(meta["vocab_size"], 267);
        assert_eq!(meta["eot"], 266);
        let ds = crate::data::DataSet::open(&o).unwrap();
        assert_eq!(ds.meta.tokenizer_hash, id.hash);
        assert_eq!((ds.meta.vocab_size, ds.meta.eot), (267, 266));
    }

    #[test]
    fn large_vocabulary_gives_u32_shards_and_eot_from_config() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = Spec {
            unused: 70_000,
            added: vec![("<|endoftext|>", true), ("<|im_end|>", true)],
            ..Spec::byte_level()
        };
        let dir = tmp.path().join("big");
        spec.write(&dir);
        let im_end = spec.first_added_id() + 1;
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": "<|im_end|>"}"#,
        )
        .unwrap();
        let tok = Tokenizer::load(dir.to_str().unwrap(), &mut |_| {}).unwrap();
        assert_eq!(tok.vocab_size(), im_end as usize + 1);
        assert_eq!(tok.eot(), im_end);

        let src = tmp.path().join("t.txt");
        std::fs::write(&src, "the cat and the hat. ".repeat(10)).unwrap();
        let o = tmp.path().join("data");
        let s = prepare_with(&opts(vec![src], o.clone(), 0.2), &tok).unwrap();
        let mut expect = vec![im_end];
        expect.extend(tok.encode(&"the cat and the hat. ".repeat(10)).unwrap());
        assert_eq!(stream(&o), expect);
        assert_eq!(
            std::fs::metadata(o.join("val.bin")).unwrap().len(),
            32 + 4 * s.val_tokens,
            "4-byte tokens above 65536 ids"
        );
    }

    #[test]
    fn split_unsafe_tokenizer_encodes_large_documents_whole() {
        // SentencePiece style: every encode call prepends `▁` (here via the normalizer), so a
        // document cut into pieces would get one `▁` per piece.
        let tmp = tempfile::tempdir().unwrap();
        let spec = Spec {
            normalizer: serde_json::json!({"type": "Prepend", "prepend": "Ġ"}),
            ..Spec::byte_level()
        };
        let tok = Tokenizer::from_file(spec.write(&tmp.path().join("sp"))).unwrap();
        let line =
            "Tomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day.\n";
        let text = line.repeat((2 * PIECE_BYTES) / line.len());
        assert!(tok.split_points(&text, PIECE_BYTES).is_empty());
        // Cut where GPT-2 may be cut, the tokens would differ (a prefix per piece).
        let cut = split_points(&text, PIECE_BYTES)[0];
        let mut pieces = tok.encode(&text[..cut]).unwrap();
        pieces.extend(tok.encode(&text[cut..]).unwrap());
        assert_ne!(pieces, tok.encode(&text).unwrap());
        let p = tmp.path().join("big.txt");
        std::fs::write(&p, &text).unwrap();
        let o = tmp.path().join("data");
        prepare_with(&opts(vec![p], o.clone(), 0.5), &tok).unwrap();
        let mut expect = vec![tok.eot()];
        expect.extend(tok.encode(&text).unwrap());
        assert_eq!(stream(&o), expect);
    }

    #[test]
    fn bad_tokenizer_files_are_errors_naming_them() {
        let tmp = tempfile::tempdir().unwrap();
        let e = format!(
            "{:#}",
            Tokenizer::load(tmp.path().join("none").to_str().unwrap(), &mut |_| {}).unwrap_err()
        );
        assert!(e.contains("none") && e.contains("gpt2"), "{e}");
        let p = tmp.path().join("tokenizer.json");
        std::fs::write(&p, "{\"model\": {\"type\": \"BPE\", \"vocab\": ").unwrap();
        let e = format!(
            "{:#}",
            Tokenizer::load(tmp.path().to_str().unwrap(), &mut |_| {}).unwrap_err()
        );
        assert!(
            e.contains(&p.display().to_string()) && e.contains("not valid JSON"),
            "{e}"
        );
    }

    fn err(o: &PrepareOptions) -> String {
        format!("{:#}", prepare(o).unwrap_err())
    }

    #[test]
    fn errors_empty_and_missing_inputs() {
        let out = tempfile::tempdir().unwrap();
        let empty = tempfile::tempdir().unwrap();
        let e = err(&opts(
            vec![empty.path().to_path_buf()],
            out.path().join("o"),
            0.1,
        ));
        assert!(
            e.contains("no files found") && e.contains(&empty.path().display().to_string()),
            "{e}"
        );

        std::fs::write(empty.path().join("ws.txt"), " \n\n ").unwrap();
        std::fs::write(empty.path().join("bin.dat"), [0u8, 1, 2, 0xff]).unwrap();
        let e = err(&opts(
            vec![empty.path().to_path_buf()],
            out.path().join("o"),
            0.1,
        ));
        assert!(e.contains("no text to prepare"), "{e}");

        let missing = out.path().join("nope.txt");
        let e = err(&opts(vec![missing.clone()], out.path().join("o2"), 0.1));
        assert!(
            e.contains("nope.txt") && e.contains("does not exist"),
            "{e}"
        );
        // Bad input is caught before the output directory is created.
        assert!(!out.path().join("o2").exists());

        let e = err(&opts(vec![], out.path().join("o"), 0.1));
        assert!(e.contains("no input files"), "{e}");
    }

    #[test]
    fn errors_binary_file_named_explicitly() {
        let src = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let nul = src.path().join("nul.txt");
        std::fs::write(&nul, b"hello\0world").unwrap();
        let e = err(&opts(vec![nul], out.path().to_path_buf(), 0.1));
        assert!(
            e.contains("nul.txt") && e.contains("binary or non-UTF-8") && e.contains("plain UTF-8"),
            "{e}"
        );
        let latin1 = src.path().join("latin1.txt");
        std::fs::write(&latin1, b"caf\xe9 au lait").unwrap();
        let e = err(&opts(vec![latin1], out.path().to_path_buf(), 0.1));
        assert!(
            e.contains("latin1.txt") && e.contains("binary or non-UTF-8"),
            "{e}"
        );
        assert!(!out.path().join("train.bin").exists());
    }

    #[test]
    fn errors_bad_val_fraction_and_tiny_corpus() {
        let src = corpus();
        let out = tempfile::tempdir().unwrap();
        for f in [0.0, -0.1, 0.51, 1.0, f64::NAN, f64::INFINITY] {
            let e = err(&opts(
                vec![src.path().to_path_buf()],
                out.path().to_path_buf(),
                f,
            ));
            assert!(e.contains("--val-fraction"), "{f}: {e}");
        }
        let tiny = src.path().join("tiny.txt");
        std::fs::write(&tiny, "Hi there").unwrap();
        let e = err(&opts(vec![tiny], out.path().to_path_buf(), 0.1));
        assert!(e.contains("too small") && e.contains("3 tokens"), "{e}");
    }

    #[test]
    fn errors_unwritable_output() {
        let src = corpus();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("regular");
        std::fs::write(&file, "x").unwrap();
        // OUT is an existing file.
        let e = err(&opts(vec![src.path().to_path_buf()], file.clone(), 0.1));
        assert!(e.contains("regular") && e.contains("existing file"), "{e}");
        // OUT under a regular file cannot be created.
        let under = file.join("data");
        let e = err(&opts(vec![src.path().to_path_buf()], under.clone(), 0.1));
        assert!(
            e.contains(&under.display().to_string()) && e.contains("--out"),
            "{e}"
        );
    }

    /// The corpus at ../shared/data/shakespeare, which CI has beside the repository: a
    /// missing corpus is a failure, not a skip.
    #[test]
    fn real_shakespeare() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/shakespeare");
        assert!(
            dir.is_dir(),
            "{} is missing: see ../shared/data/README.md for the 42 texts",
            dir.display()
        );
        let out = tempfile::tempdir().unwrap();
        let s = prepare(&opts(vec![dir.clone()], out.path().to_path_buf(), 0.1)).unwrap();
        assert!(s.files >= 40, "{s:?}");
        assert!(s.bytes > 4_000_000, "{s:?}");
        let n = s.train_tokens + s.val_tokens;
        assert!(n > 1_000_000 && n < 2_500_000, "{n}");
        assert_eq!(s.val_tokens, (n as f64 * 0.1).round() as u64);
        // One play tokenized whole matches its entry in meta.json (pieces cut correctly).
        let text = std::fs::read_to_string(dir.join("hamlet_gut.txt")).unwrap();
        let whole = Tokenizer::gpt2().unwrap().encode(&text).unwrap().len() as u64;
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.path().join("meta.json")).unwrap()).unwrap();
        let entry = meta["sources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["path"].as_str().unwrap().ends_with("hamlet_gut.txt"))
            .unwrap()
            .clone();
        assert_eq!(entry["tokens"].as_u64().unwrap(), whole);
    }
}
