//! Reading a prepared data set and drawing training batches from it.
//!
//! A batch is `B` windows of `T + 1` consecutive tokens, laid out `[B, T+1]`: row `b` gives
//! the inputs `out[b][0..T]` and the next-token targets `out[b][1..T+1]`. Window offsets are
//! uniform in `[0, len - (T+1)]` and drawn from [`Rng::stream`]`(seed, index)`, so batch
//! `index` is a pure function of `(seed, index)`: a resumed run that restarts at the saved
//! [`BatchLoader::position`] sees exactly the batches it would have seen.
//!
//! An *examples* data set (`meta.json` format `memwall-examples`: chat data) draws whole
//! examples instead, one per row, cut or padded, untrained targets marked
//! ([`crate::data::examples`]); [`Source`] is either kind of split.
//!
//! [`BatchLoader`] prefetches on a worker thread into two staging buffers allocated once at
//! construction (the data loader's whole "I/O staging" footprint, [`BatchLoader::staging_bytes`]);
//! nothing is allocated per batch.

use crate::data::examples::{Examples, fill_eval_rows, fill_packed_rows, fill_rows};
use crate::data::prepare::{EXAMPLES_FORMAT, META_FORMAT, META_VERSION};
use crate::data::shard::Shard;
use crate::data::tokenizer::{EOT, GPT2_HASH, GPT2_NAME};
use crate::util::rng::Rng;
use crate::util::threads;
use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// The parts of `meta.json` the trainer needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    pub vocab_size: usize,
    pub train_tokens: u64,
    pub val_tokens: u64,
    /// Tokenizer name, e.g. `gpt2-r50k_base` or `hf:SmolLM2-135M`.
    pub tokenizer: String,
    /// Tokenizer content hash ([`crate::data::TokenizerId::hash`]); a `meta.json` written
    /// before hashes were recorded is GPT-2's, `r50k_base`.
    pub tokenizer_hash: String,
    /// The end-of-text token between documents (and an examples data set's padding).
    pub eot: u32,
    /// An examples data set's examples per split (chat data); `None` for raw text.
    pub examples: Option<ExampleCounts>,
}

/// The examples of each split of an examples data set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct ExampleCounts {
    pub train: u64,
    pub val: u64,
}

#[derive(Deserialize)]
struct MetaIn {
    format: String,
    version: u32,
    tokenizer: String,
    #[serde(default)]
    tokenizer_hash: Option<String>,
    vocab_size: usize,
    #[serde(default)]
    eot: Option<u32>,
    train_tokens: u64,
    val_tokens: u64,
    #[serde(default)]
    train_examples: Option<u64>,
    #[serde(default)]
    val_examples: Option<u64>,
}

/// A prepared data set: `meta.json` plus the two shards, validated against each other (and,
/// for examples, each split's boundaries and trained bits).
#[derive(Debug)]
pub struct DataSet {
    pub dir: PathBuf,
    pub meta: Meta,
    pub train: Arc<Shard>,
    pub val: Arc<Shard>,
    /// An examples data set's splits (`None`: raw text, drawn as windows).
    pub examples: Option<(Arc<Examples>, Arc<Examples>)>,
}

/// Where a split's rows come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// Raw text: windows of `T + 1` consecutive tokens at random offsets.
    Windows(Arc<Shard>),
    /// Examples: packed several to a row (`pack`) or one per row, padded with `pad` (see
    /// [`crate::data::examples`]).
    Examples {
        split: Arc<Examples>,
        pad: u32,
        pack: bool,
    },
}

impl Source {
    /// Fills `out` (`[B, T+1]`) with `part`'s rows of batch `index` (a pure function of
    /// `(seed, index)`).
    pub fn fill(
        &self,
        (b, t): (usize, usize),
        seed: u64,
        index: u64,
        part: Part,
        out: &mut [u32],
    ) -> Result<()> {
        match self {
            Source::Windows(shard) => fill_batch_part(shard, b, t, seed, index, part, out),
            Source::Examples {
                split,
                pad,
                pack: true,
            } => fill_packed_rows(
                split,
                (b, t),
                (seed, index),
                (part.index * b, part.of * b),
                *pad,
                out,
            ),
            Source::Examples {
                split,
                pad,
                pack: false,
            } => fill_rows(split, (b, t), (seed, index), part.index * b, *pad, out),
        }
    }

    /// An examples split's evaluation rows: `part`'s rows of the batch holding examples
    /// `start..` in order, up to the first `limit` (see [`fill_eval_rows`]); returns the first
    /// example not placed. `None` for raw text (evaluated on drawn windows).
    pub fn fill_eval(
        &self,
        (b, t): (usize, usize),
        (start, limit): (usize, usize),
        part: Part,
        out: &mut [u32],
    ) -> Option<Result<usize>> {
        let Source::Examples { split, pad, pack } = self else {
            return None;
        };
        let end = limit.min(split.len());
        let rows = (part.index * b, part.of * b);
        Some(fill_eval_rows(
            split,
            (b, t),
            (start, end),
            rows,
            *pack,
            *pad,
            out,
        ))
    }

    /// Whether rows mark untrained targets ([`crate::data::examples::UNTRAINED`]).
    pub fn marked(&self) -> bool {
        matches!(self, Source::Examples { .. })
    }

    /// Whether rows pack several examples (and mark where each starts,
    /// [`crate::data::examples::EXAMPLE_START`]).
    pub fn packed(&self) -> bool {
        matches!(self, Source::Examples { pack: true, .. })
    }
}

impl DataSet {
    /// The training split's rows; an examples data set's packed when `pack`.
    pub fn train_source(&self, pack: bool) -> Source {
        match &self.examples {
            Some((train, _)) => Source::Examples {
                split: train.clone(),
                pad: self.meta.eot,
                pack,
            },
            None => Source::Windows(self.train.clone()),
        }
    }

    /// The validation split's rows; an examples data set's packed when `pack`.
    pub fn val_source(&self, pack: bool) -> Source {
        match &self.examples {
            Some((_, val)) => Source::Examples {
                split: val.clone(),
                pad: self.meta.eot,
                pack,
            },
            None => Source::Windows(self.val.clone()),
        }
    }

    /// Whether training on this data packs examples into rows: an examples data set,
    /// unless `--no-pack`.
    pub fn packs(&self, no_pack: bool) -> bool {
        self.examples.is_some() && !no_pack
    }
}

const HOW_TO_PREPARE: &str =
    "run `memwall prepare <FILES> --out DIR` to create a data set, then pass --data DIR";

impl DataSet {
    /// Opens `dir/meta.json`, `dir/train.bin` and `dir/val.bin` and checks that they agree.
    pub fn open(dir: &Path) -> Result<DataSet> {
        let d = dir.display();
        ensure!(
            dir.is_dir(),
            "data directory '{d}' does not exist or is not a directory: {HOW_TO_PREPARE}"
        );
        let meta_path = dir.join("meta.json");
        ensure!(
            meta_path.is_file(),
            "'{d}' is not a memwall data set: it has no meta.json (or a previous prepare was interrupted): {HOW_TO_PREPARE}"
        );
        let raw = std::fs::read(&meta_path)
            .with_context(|| format!("cannot read '{}'", meta_path.display()))?;
        let m: MetaIn = serde_json::from_slice(&raw).with_context(|| {
            format!(
                "'{}' is corrupt or not a memwall meta.json: {HOW_TO_PREPARE}",
                meta_path.display()
            )
        })?;
        ensure!(
            (m.format == META_FORMAT || m.format == EXAMPLES_FORMAT) && m.version == META_VERSION,
            "'{}' has format '{}' version {}, but this memwall reads '{META_FORMAT}' and \
             '{EXAMPLES_FORMAT}' version {META_VERSION}: {HOW_TO_PREPARE}",
            meta_path.display(),
            m.format,
            m.version
        );
        // Files from before tokenizer hashes were recorded hold GPT-2 tokens.
        let gpt2 = m.tokenizer == GPT2_NAME;
        let (tokenizer_hash, eot) = match (m.tokenizer_hash, m.eot) {
            (Some(h), Some(e)) => (h, e),
            (None, e) if gpt2 => (GPT2_HASH.to_string(), e.unwrap_or(EOT)),
            (h, _) => bail!(
                "'{}' records tokenizer '{}' without its '{}': {HOW_TO_PREPARE}",
                meta_path.display(),
                m.tokenizer,
                if h.is_none() { "tokenizer_hash" } else { "eot" }
            ),
        };
        let open = |name: &str, expect: u64| -> Result<Arc<Shard>> {
            let p = dir.join(name);
            let s = Shard::open(&p).with_context(|| {
                format!("data set '{d}' is incomplete or corrupt: {HOW_TO_PREPARE}")
            })?;
            ensure!(
                s.len() as u64 == expect && s.vocab_size() == m.vocab_size,
                "data set '{d}' is inconsistent: '{}' has {} tokens (vocabulary {}) but meta.json says {expect} \
                 (vocabulary {}): {HOW_TO_PREPARE}",
                p.display(),
                s.len(),
                s.vocab_size(),
                m.vocab_size
            );
            Ok(Arc::new(s))
        };
        let train = open("train.bin", m.train_tokens)?;
        let val = open("val.bin", m.val_tokens)?;
        let (examples, counts) = if m.format == EXAMPLES_FORMAT {
            // Batch rows mark tokens in the two high bits (`UNTRAINED`, `EXAMPLE_START`).
            ensure!(
                m.vocab_size <= crate::data::examples::EXAMPLE_START as usize,
                "data set '{d}': a vocabulary of {} tokens is too large for chat data (at most 2^30)",
                m.vocab_size
            );
            let split = |name: &str, shard: &Arc<Shard>, expect: Option<u64>| {
                let ex = Examples::open(dir, name, shard.clone()).with_context(|| {
                    format!("data set '{d}' is incomplete or corrupt: {HOW_TO_PREPARE}")
                })?;
                ensure!(
                    Some(ex.len() as u64) == expect && !ex.is_empty(),
                    "data set '{d}' is inconsistent: its {name} split has {} examples but \
                     meta.json says {expect:?}: {HOW_TO_PREPARE}",
                    ex.len()
                );
                Ok(Arc::new(ex))
            };
            let tr = split("train", &train, m.train_examples)?;
            let va = split("val", &val, m.val_examples)?;
            let counts = ExampleCounts {
                train: tr.len() as u64,
                val: va.len() as u64,
            };
            (Some((tr, va)), Some(counts))
        } else {
            (None, None)
        };
        let meta = Meta {
            examples: counts,
            vocab_size: m.vocab_size,
            train_tokens: m.train_tokens,
            val_tokens: m.val_tokens,
            tokenizer: m.tokenizer,
            tokenizer_hash,
            eot,
        };
        Ok(DataSet {
            dir: dir.to_path_buf(),
            meta,
            train,
            val,
            examples,
        })
    }
}

/// Checks that `shard` can serve windows of `t + 1` tokens (sequence length `t`).
/// The error names the split, its token count and `--seq`.
pub fn check_fits(shard: &Shard, split: &str, t: usize) -> Result<()> {
    let need = t as u64 + 1;
    if (shard.len() as u64) < need {
        bail!(
            "the {split} split ('{}') has {} tokens, too few for --seq {t} (a window needs {need} tokens): \
             use a smaller --seq, or add text{}",
            shard.path().display(),
            shard.len(),
            if split == "val" {
                " or raise --val-fraction in `memwall prepare`"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// Fills `out` (`[B, T+1]`, so `b * (t + 1)` tokens) with batch `index` of `shard`:
/// `b` windows at offsets drawn uniformly in `[0, len - (t+1)]` from `Rng::stream(seed, index)`.
///
/// Panics when `out` has the wrong length or the shard is shorter than `t + 1` tokens
/// (call [`check_fits`] first; that is where bad input becomes an error).
pub fn fill_batch(
    shard: &Shard,
    b: usize,
    t: usize,
    seed: u64,
    index: u64,
    out: &mut [u32],
) -> Result<()> {
    fill_batch_part(shard, b, t, seed, index, Part::WHOLE, out)
}

/// Which rows of each batch a process takes: batch `index` has `b · of` rows, drawn in
/// order from one stream, and process `index` of `of` (a rank) takes rows
/// `index·b .. (index+1)·b`. So N ranks of batch B see, together, the rows one process of
/// batch B × accumulation N sees, rank k those of micro-batch k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    pub index: usize,
    pub of: usize,
}

impl Part {
    /// One process takes every row.
    pub const WHOLE: Part = Part { index: 0, of: 1 };

    /// The part of this rank along the data axis of `mesh` (ranks on the other axes of one
    /// data index take the same rows).
    pub fn of_data_axis(mesh: &crate::ir::Mesh) -> Part {
        Part {
            index: mesh.data_rank(),
            of: mesh.data,
        }
    }
}

/// [`fill_batch`] of `part`'s rows: the windows of rows before it are drawn and dropped.
pub fn fill_batch_part(
    shard: &Shard,
    b: usize,
    t: usize,
    seed: u64,
    index: u64,
    part: Part,
    out: &mut [u32],
) -> Result<()> {
    let w = t + 1;
    assert_eq!(
        out.len(),
        b * w,
        "fill_batch: out has {} tokens, expected B*(T+1) = {b}*{w}",
        out.len()
    );
    assert!(
        shard.len() >= w,
        "fill_batch: '{}' has {} tokens, fewer than T+1 = {w} (call check_fits first)",
        shard.path().display(),
        shard.len()
    );
    let positions = (shard.len() - w) as u64 + 1;
    let mut rng = Rng::stream(seed, index);
    for _ in 0..part.index * b {
        rng.below(positions);
    }
    for row in out.chunks_exact_mut(w) {
        let start = rng.below(positions) as usize;
        shard.read(start, row)?;
    }
    Ok(())
}

/// Prefetching batch source: a worker thread fills batch `k + 1` while the trainer uses `k`.
///
/// Two `[B, T+1]` buffers are allocated at construction and passed back and forth between the
/// trainer and the worker over two channels (`free` → worker fills → `ready` → copied out →
/// `free`). Batches come out in index order whatever the timing, so the `k`-th call to
/// [`next_into`](Self::next_into) yields `fill_batch(.., start_index + k, ..)`.
pub struct BatchLoader {
    /// Filled buffers, or the error that stopped the worker (a failed read).
    ready_rx: Option<Receiver<Result<Vec<u32>>>>,
    free_tx: Option<SyncSender<Vec<u32>>>,
    worker: Option<JoinHandle<()>>,
    position: u64,
    batch_len: usize,
}

impl BatchLoader {
    /// Starts the worker at batch `start_index`, drawing windows of `shard`.
    ///
    /// Panics when the shard is shorter than `t + 1` tokens (call [`check_fits`] first); an
    /// error when the system refuses the worker thread.
    pub fn new(
        shard: Arc<Shard>,
        b: usize,
        t: usize,
        seed: u64,
        start_index: u64,
    ) -> Result<BatchLoader> {
        BatchLoader::part(Source::Windows(shard), b, t, seed, start_index, Part::WHOLE)
    }

    /// [`BatchLoader::new`] drawing `part`'s rows of each batch (a rank's) from `source`.
    pub fn part(
        source: Source,
        b: usize,
        t: usize,
        seed: u64,
        start_index: u64,
        part: Part,
    ) -> Result<BatchLoader> {
        if let Source::Windows(shard) = &source {
            assert!(
                shard.len() > t,
                "BatchLoader: '{}' has {} tokens, fewer than T+1 = {} (call check_fits first)",
                shard.path().display(),
                shard.len(),
                t + 1
            );
        }
        let batch_len = b * (t + 1);
        let (free_tx, free_rx) = sync_channel::<Vec<u32>>(2);
        let (ready_tx, ready_rx) = sync_channel::<Result<Vec<u32>>>(2);
        for _ in 0..2 {
            free_tx
                .send(vec![0u32; batch_len])
                .expect("receiver is alive");
        }
        let worker = threads::spawn("memwall-data", "the data loader thread", move || {
            let mut index = start_index;
            // Ends when the loader drops its sender (recv fails) or its receiver (send fails).
            while let Ok(mut buf) = free_rx.recv() {
                let filled = source
                    .fill((b, t), seed, index, part, &mut buf)
                    .with_context(|| format!("drawing training batch {index}"));
                let failed = filled.is_err();
                index += 1;
                if ready_tx.send(filled.map(|()| buf)).is_err() || failed {
                    break;
                }
            }
        })?;
        Ok(BatchLoader {
            ready_rx: Some(ready_rx),
            free_tx: Some(free_tx),
            worker: Some(worker),
            position: start_index,
            batch_len,
        })
    }

    /// Copies the next batch into `out` (`[B, T+1]`) and hands its buffer back to the worker;
    /// the error of a failed read of the shard (naming the file and the batch) otherwise.
    pub fn next_into(&mut self, out: &mut [u32]) -> Result<()> {
        assert_eq!(
            out.len(),
            self.batch_len,
            "BatchLoader::next_into: out must hold B*(T+1) tokens"
        );
        let rx = self.ready_rx.as_ref().expect("loader is running");
        let buf = rx
            .recv()
            .context("the data loader thread stopped after an earlier error")??;
        out.copy_from_slice(&buf);
        self.position += 1;
        // The worker only stops after we drop our ends, so this send cannot fail now; if it
        // did, the next recv reports it.
        let _ = self.free_tx.as_ref().expect("loader is running").send(buf);
        Ok(())
    }

    /// `start_index` plus the number of batches handed out: the index of the next batch
    /// (saved in checkpoints so a resumed run continues the same sequence).
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Bytes a loader for `[B, T+1]` batches allocates: two staging buffers of u32 tokens.
    pub fn staging_bytes(b: usize, t: usize) -> u64 {
        2 * (b as u64) * (t as u64 + 1) * 4
    }
}

impl Drop for BatchLoader {
    fn drop(&mut self) {
        // Closing both channel ends wakes the worker wherever it waits.
        self.free_tx.take();
        self.ready_rx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::prepare::{PrepareOptions, prepare};
    use crate::data::shard::write_shard;

    /// A shard whose token at position i is i (mod vocab), so windows are easy to check.
    fn counting_shard(dir: &Path, n: usize) -> Shard {
        let p = dir.join("count.bin");
        let toks: Vec<u32> = (0..n as u32).collect();
        write_shard(&p, &toks, n.max(2)).unwrap();
        Shard::open(&p).unwrap()
    }

    #[test]
    fn fill_batch_windows_and_determinism() {
        let dir = tempfile::tempdir().unwrap();
        let s = counting_shard(dir.path(), 1000);
        let (b, t) = (4, 16);
        let mut x = vec![0; b * (t + 1)];
        let mut y = vec![0; b * (t + 1)];
        fill_batch(&s, b, t, 42, 7, &mut x).unwrap();
        fill_batch(&s, b, t, 42, 7, &mut y).unwrap();
        assert_eq!(x, y, "pure function of (seed, index)");
        for row in x.chunks_exact(t + 1) {
            // Consecutive tokens: targets row[1..] are inputs row[..T] shifted by one.
            assert!(row.windows(2).all(|p| p[1] == p[0] + 1), "{row:?}");
            assert!(row[t] < 1000);
            let (inputs, targets) = (&row[..t], &row[1..]);
            assert_eq!(&inputs[1..], &targets[..t - 1]);
        }
        fill_batch(&s, b, t, 42, 8, &mut y).unwrap();
        assert_ne!(x, y, "different index, different batch");
        fill_batch(&s, b, t, 43, 7, &mut y).unwrap();
        assert_ne!(x, y, "different seed, different batch");
    }

    #[test]
    fn parts_of_a_batch_are_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let s = counting_shard(dir.path(), 5000);
        let (b, t) = (2, 16);
        let mut whole = vec![0u32; 3 * b * (t + 1)];
        fill_batch(&s, 3 * b, t, 4, 11, &mut whole).unwrap();
        for k in 0..3 {
            let mut part = vec![0u32; b * (t + 1)];
            fill_batch_part(&s, b, t, 4, 11, Part { index: k, of: 3 }, &mut part).unwrap();
            assert_eq!(part, whole[k * b * (t + 1)..][..b * (t + 1)], "part {k}");
        }
    }

    #[test]
    fn fill_batch_covers_both_ends() {
        let dir = tempfile::tempdir().unwrap();
        let s = counting_shard(dir.path(), 10);
        let t = 7; // windows of 8 in 10 tokens: offsets 0, 1, 2
        let mut seen = [false; 3];
        let mut out = vec![0; 8];
        for i in 0..200 {
            fill_batch(&s, 1, t, 1, i, &mut out).unwrap();
            seen[out[0] as usize] = true;
        }
        assert_eq!(seen, [true; 3]);
        // Exact fit: T+1 == len, the only window is the whole shard.
        let mut out = vec![0; 10];
        fill_batch(&s, 1, 9, 5, 0, &mut out).unwrap();
        assert_eq!(out, (0..10).collect::<Vec<u32>>());
    }

    #[test]
    fn batch_loader_matches_fill_batch_sequence() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(counting_shard(dir.path(), 5000));
        let (b, t, seed) = (3, 32, 9);
        for start in [0u64, 17] {
            let mut loader = BatchLoader::new(s.clone(), b, t, seed, start).unwrap();
            assert_eq!(loader.position(), start);
            let mut got = vec![0; b * (t + 1)];
            let mut want = vec![0; b * (t + 1)];
            for k in 0..25 {
                if k % 5 == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                loader.next_into(&mut got).unwrap();
                fill_batch(&s, b, t, seed, start + k, &mut want).unwrap();
                assert_eq!(got, want, "start {start}, batch {k}");
                assert_eq!(loader.position(), start + k + 1);
            }
        }
        assert_eq!(BatchLoader::staging_bytes(b, t), 2 * 3 * 33 * 4);
    }

    #[test]
    fn batch_loader_drops_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(counting_shard(dir.path(), 100));
        // Dropped before any batch is taken (worker blocked with both buffers full).
        drop(BatchLoader::new(s.clone(), 2, 8, 1, 0).unwrap());
        // Dropped mid-stream.
        let mut l = BatchLoader::new(s.clone(), 2, 8, 1, 0).unwrap();
        let mut out = vec![0; 18];
        l.next_into(&mut out).unwrap();
        drop(l);
        // The worker released its reference to the shard.
        assert_eq!(Arc::strong_count(&s), 1);
    }

    #[test]
    fn check_fits_errors() {
        let dir = tempfile::tempdir().unwrap();
        let s = counting_shard(dir.path(), 100);
        assert!(check_fits(&s, "train", 99).is_ok());
        let e = check_fits(&s, "val", 100).unwrap_err().to_string();
        assert!(
            e.contains("val") && e.contains("100 tokens") && e.contains("--seq 100"),
            "{e}"
        );
        assert!(e.contains("--val-fraction"), "{e}");
        let e = check_fits(&s, "train", 1024).unwrap_err().to_string();
        assert!(e.contains("train") && e.contains("--seq 1024"), "{e}");
    }

    #[test]
    fn dataset_open_round_trip_and_errors() {
        let src = tempfile::tempdir().unwrap();
        std::fs::write(
            src.path().join("a.txt"),
            "To be, or not to be, that is the question. ".repeat(20),
        )
        .unwrap();
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("data");
        let sum = prepare(&PrepareOptions {
            inputs: vec![src.path().into()],
            out: dir.clone(),
            val_fraction: 0.2,
        })
        .unwrap();
        let ds = DataSet::open(&dir).unwrap();
        assert_eq!(ds.dir, dir);
        assert_eq!(
            ds.meta,
            Meta {
                vocab_size: 50257,
                train_tokens: sum.train_tokens,
                val_tokens: sum.val_tokens,
                tokenizer: "gpt2-r50k_base".into(),
                tokenizer_hash: "r50k_base".into(),
                eot: 50256,
                examples: None,
            }
        );
        assert_eq!(ds.train.len() as u64, sum.train_tokens);
        assert_eq!(ds.val.len() as u64, sum.val_tokens);

        let hint = "memwall prepare <FILES> --out DIR";
        let e = format!(
            "{:#}",
            DataSet::open(&out.path().join("missing")).unwrap_err()
        );
        assert!(e.contains("missing") && e.contains(hint), "{e}");

        // A meta.json from before tokenizer hashes were recorded is GPT-2's.
        let meta_path = dir.join("meta.json");
        let fresh = std::fs::read_to_string(&meta_path).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&fresh).unwrap();
        v.as_object_mut().unwrap().remove("tokenizer_hash");
        std::fs::write(&meta_path, v.to_string()).unwrap();
        let old = DataSet::open(&dir).unwrap();
        assert_eq!(old.meta, ds.meta);
        // Another tokenizer's name without a hash is refused.
        v["tokenizer"] = "hf:smol".into();
        std::fs::write(&meta_path, v.to_string()).unwrap();
        let e = format!("{:#}", DataSet::open(&dir).unwrap_err());
        assert!(
            e.contains("hf:smol") && e.contains("tokenizer_hash") && e.contains(hint),
            "{e}"
        );
        std::fs::write(&meta_path, fresh).unwrap();
        DataSet::open(&dir).unwrap();

        // Inconsistent: val.bin replaced by a shard of another length.
        write_shard(&dir.join("val.bin"), &[1, 2, 3], 50257).unwrap();
        let e = format!("{:#}", DataSet::open(&dir).unwrap_err());
        assert!(e.contains("val.bin") && e.contains(hint), "{e}");

        // Truncated train.bin.
        let raw = std::fs::read(dir.join("train.bin")).unwrap();
        std::fs::write(dir.join("train.bin"), &raw[..raw.len() - 1]).unwrap();
        let e = format!("{:#}", DataSet::open(&dir).unwrap_err());
        assert!(
            e.contains("train.bin") && e.contains("truncated") && e.contains(hint),
            "{e}"
        );

        std::fs::write(dir.join("meta.json"), "{not json").unwrap();
        let e = format!("{:#}", DataSet::open(&dir).unwrap_err());
        assert!(e.contains("meta.json") && e.contains(hint), "{e}");

        std::fs::remove_file(dir.join("meta.json")).unwrap();
        let e = format!("{:#}", DataSet::open(&dir).unwrap_err());
        assert!(e.contains("meta.json") && e.contains(hint), "{e}");
    }
}
