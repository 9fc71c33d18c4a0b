//! An *examples* data set (chat and instruction data, `memwall prepare chats.jsonl`): each
//! split's tokens in a token shard ([`crate::data::shard`]) as for raw text, and beside it
//! where each example starts and which tokens are trained; batches of whole examples, one per
//! row, cut or padded to the sequence.
//!
//! # Files (version 1, little-endian)
//!
//! `{split}.idx`: the examples' boundaries.
//!
//! | offset | size | field   | value                                                      |
//! |-------:|-----:|---------|------------------------------------------------------------|
//! | 0      | 8    | magic   | `b"MWEXIDX\0"`                                             |
//! | 8      | 4    | version | `u32`, `1`                                                 |
//! | 12     | 4    | reserved| `u32`, `0`                                                 |
//! | 16     | 8    | count   | `u64`, examples                                            |
//! | 24     | 8·(count+1) | offsets | `u64`: example `k` is tokens `offsets[k]..offsets[k+1]` of the shard; `offsets[0] = 0`, the last is the shard's length |
//!
//! `{split}.mask`: one bit per token, 1 where the token is trained (as a target: predicted
//! from the tokens before it).
//!
//! | offset | size | field   | value                                                      |
//! |-------:|-----:|---------|------------------------------------------------------------|
//! | 0      | 8    | magic   | `b"MWMASK\0\0"`                                            |
//! | 8      | 4    | version | `u32`, `1`                                                 |
//! | 12     | 4    | reserved| `u32`, `0`                                                 |
//! | 16     | 8    | count   | `u64`, tokens (the shard's length)                         |
//! | 24     | ⌈count/8⌉ | bits | token `i` is bit `i % 8` (least significant first) of byte `i / 8` |
//!
//! Both are checked when opened (sizes, offsets rising from 0 to the shard's length) and read
//! with positioned reads a row at a time, never mapped and never held whole: a run's memory
//! for its data is the loader's staging, as for raw text.
//!
//! # Rows
//!
//! Row `r` of batch `k` is example `e`, drawn uniformly from `Rng::stream(seed, k)` (the
//! `r`-th draw: a pure function of (seed, k), so a resumed run draws the same rows): its first
//! `min(len, T + 1)` tokens (an example longer than `T + 1` is cut; [`Examples::longer_than`]
//! counts them), then padding. A token whose bit is 0 (a prompt's) and every padding position
//! carry [`UNTRAINED`] in the row (padding's id is the end-of-text token), so the executor
//! gives their targets no loss ([`crate::exec::Executor::upload_examples`]).
//!
//! # Packed rows (the default for training; `--no-pack` gives the rows above)
//!
//! Batch `k`'s rows, every rank's together, are filled first-fit: examples are drawn from
//! `Rng::stream(seed, k)` and each goes into the first row with room for it (one longer than
//! a row is cut, alone in its row), until 16 draws in a row fit nowhere or every row is full
//! ([`fill_packed_rows`]); rank r takes its rows of that packing. Each example's first token
//! is untrained (nothing of its example precedes it) and, after a row's first example,
//! carries [`EXAMPLE_START`]; so does the padding's first token. The executor turns these
//! marks into each token's place in its example (`positions`), which restarts the position
//! embeddings (RoPE, GPT-2's wpe) and confines attention to the example: a packed row's loss
//! and gradients are those of its examples run one by one.

use crate::data::shard::Shard;
use crate::util::atomic;
use crate::util::rng::Rng;
use anyhow::{Context, Result, bail, ensure};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Set in a batch token that is not trained as a target (a prompt token, padding); the id is
/// the other bits. Vocabularies stay below 2³¹.
pub const UNTRAINED: u32 = 1 << 31;

/// Set in a batch token that begins an example packed after another in the same row: the
/// row's positions restart there ([`crate::exec::Executor::upload_examples`]). Vocabularies
/// stay below 2³⁰.
pub const EXAMPLE_START: u32 = 1 << 30;

/// The magic of an `.idx` file.
pub const INDEX_MAGIC: [u8; 8] = *b"MWEXIDX\0";
/// The magic of a `.mask` file.
pub const MASK_MAGIC: [u8; 8] = *b"MWMASK\0\0";
/// The version of both.
pub const VERSION: u32 = 1;
/// Header bytes of both.
pub const HEADER_BYTES: usize = 24;

/// The 24-byte header of an `.idx` or `.mask` file.
fn header(magic: [u8; 8], count: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(&magic);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&count.to_le_bytes());
    h
}

/// Writes `{split}.idx` atomically: `offsets` are the examples' starts and, last, the
/// number of tokens (so `offsets.len()` is examples + 1).
pub fn write_index(path: &Path, offsets: &[u64]) -> Result<()> {
    ensure!(
        offsets.first() == Some(&0) && offsets.windows(2).all(|w| w[0] <= w[1]),
        "internal error: example offsets must rise from 0"
    );
    atomic::write_with(path, |f| {
        let ctx = || format!("cannot write '{}' (disk full?)", path.display());
        let mut w = BufWriter::with_capacity(1 << 20, f);
        w.write_all(&header(INDEX_MAGIC, offsets.len() as u64 - 1))
            .with_context(ctx)?;
        for o in offsets {
            w.write_all(&o.to_le_bytes()).with_context(ctx)?;
        }
        w.flush().with_context(ctx)
    })
}

/// Writes `{split}.mask` atomically: `count` tokens' bits, packed as the module docs say.
pub fn write_mask(path: &Path, bits: &[u8], count: u64) -> Result<()> {
    ensure!(
        bits.len() as u64 == count.div_ceil(8),
        "internal error: {} bytes of bits for {count} tokens",
        bits.len()
    );
    atomic::write_with(path, |f| {
        let ctx = || format!("cannot write '{}' (disk full?)", path.display());
        let mut w = BufWriter::with_capacity(1 << 20, f);
        w.write_all(&header(MASK_MAGIC, count)).with_context(ctx)?;
        w.write_all(bits).with_context(ctx)?;
        w.flush().with_context(ctx)
    })
}

/// Bits packed least significant first, grown a token at a time (what `prepare` keeps: one
/// bit per token).
#[derive(Clone, Debug, Default)]
pub struct BitVec {
    bytes: Vec<u8>,
    len: u64,
}

impl BitVec {
    /// Appends one bit (`trained != 0`).
    pub fn push(&mut self, trained: u8) {
        if self.len.is_multiple_of(8) {
            self.bytes.push(0);
        }
        if trained != 0 {
            *self.bytes.last_mut().expect("a byte was pushed") |= 1 << (self.len % 8);
        }
        self.len += 1;
    }

    /// Bits pushed.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when no bit was pushed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bits `start..end`, packed from bit 0 (a split's own mask).
    pub fn range(&self, start: u64, end: u64) -> BitVec {
        let mut out = BitVec::default();
        for i in start..end {
            out.push((self.bytes[(i / 8) as usize] >> (i % 8)) & 1);
        }
        out
    }

    /// The packed bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// One split of an examples data set: its tokens, boundaries and trained bits.
#[derive(Debug)]
pub struct Examples {
    /// The split's tokens.
    pub tokens: Arc<Shard>,
    index: File,
    index_path: PathBuf,
    mask: File,
    mask_path: PathBuf,
    count: usize,
}

/// Reads `out.len()` bytes at `at` of `file`, naming `path`.
fn read_at(file: &File, path: &Path, at: u64, out: &mut [u8]) -> Result<()> {
    file.read_exact_at(out, at).with_context(|| {
        format!(
            "cannot read '{}' (was it changed or truncated? re-run `memwall prepare`)",
            path.display()
        )
    })
}

/// Opens a file and checks its header (magic, version) and size; returns it and its count.
fn open_checked(
    path: &Path,
    magic: [u8; 8],
    size: impl Fn(u64) -> Option<u64>,
) -> Result<(File, u64)> {
    let p = path.display();
    let file = File::open(path).with_context(|| format!("cannot open '{p}'"))?;
    let actual = file
        .metadata()
        .with_context(|| format!("cannot stat '{p}'"))?
        .len();
    ensure!(
        actual >= HEADER_BYTES as u64,
        "'{p}' is truncated: {actual} bytes, shorter than its {HEADER_BYTES}-byte header"
    );
    let mut h = [0u8; HEADER_BYTES];
    read_at(&file, path, 0, &mut h)?;
    ensure!(
        h[..8] == magic,
        "'{p}' is not a memwall examples file (bad magic)"
    );
    let version = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
    ensure!(
        version == VERSION,
        "'{p}' has format version {version}, but this memwall reads version {VERSION}"
    );
    let count = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
    let expected = size(count).with_context(|| format!("'{p}' is corrupt: count {count}"))?;
    ensure!(
        actual == expected,
        "'{p}' is truncated or corrupt: its header promises {expected} bytes, the file has {actual}"
    );
    Ok((file, count))
}

impl Examples {
    /// Opens `{split}.idx` and `{split}.mask` in `dir` beside the split's `tokens`, and checks
    /// them against each other (each error names the file).
    pub fn open(dir: &Path, split: &str, tokens: Arc<Shard>) -> Result<Examples> {
        let index_path = dir.join(format!("{split}.idx"));
        let mask_path = dir.join(format!("{split}.mask"));
        let (index, count) = open_checked(&index_path, INDEX_MAGIC, |n| {
            n.checked_add(1)?
                .checked_mul(8)?
                .checked_add(HEADER_BYTES as u64)
        })?;
        let (mask, bits) = open_checked(&mask_path, MASK_MAGIC, |n| {
            Some(n.div_ceil(8) + HEADER_BYTES as u64)
        })?;
        let n = tokens.len() as u64;
        ensure!(
            bits == n,
            "'{}' has bits for {bits} tokens, but '{}' holds {n}",
            mask_path.display(),
            tokens.path().display()
        );
        let count = usize::try_from(count).context("too many examples for this platform")?;
        let ex = Examples {
            tokens,
            index,
            index_path,
            mask,
            mask_path,
            count,
        };
        // Offsets rise from 0 to the shard's length.
        let (mut prev, mut k) = (0u64, 0usize);
        ex.for_each_offset(&mut |o| {
            ensure!(
                (k == 0 && o == 0) || (k > 0 && o >= prev),
                "'{}' is corrupt: example offset {k} is {o} after {prev}",
                ex.index_path.display()
            );
            prev = o;
            k += 1;
            Ok(())
        })?;
        ensure!(
            prev == n,
            "'{}' is corrupt: its examples end at token {prev}, but '{}' holds {n}",
            ex.index_path.display(),
            ex.tokens.path().display()
        );
        Ok(ex)
    }

    /// Calls `f` on every offset (`count + 1` of them), reading the file a block at a time.
    fn for_each_offset(&self, f: &mut dyn FnMut(u64) -> Result<()>) -> Result<()> {
        let total = self.count + 1;
        let mut buf = vec![0u8; 8 << 12];
        let mut at = 0;
        while at < total {
            let n = (total - at).min(1 << 12);
            read_at(
                &self.index,
                &self.index_path,
                (HEADER_BYTES + 8 * at) as u64,
                &mut buf[..8 * n],
            )?;
            for c in buf[..8 * n].chunks_exact(8) {
                f(u64::from_le_bytes(c.try_into().expect("8 bytes")))?;
            }
            at += n;
        }
        Ok(())
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.count
    }

    /// True when the split holds no example.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Examples longer than `tokens` tokens (cut to a row of that many).
    pub fn longer_than(&self, tokens: usize) -> Result<usize> {
        let (mut prev, mut first, mut n) = (0u64, true, 0usize);
        self.for_each_offset(&mut |o| {
            if !first && o - prev > tokens as u64 {
                n += 1;
            }
            (prev, first) = (o, false);
            Ok(())
        })?;
        Ok(n)
    }

    /// The first example with a trained target among its first `w` tokens (what a row of
    /// `w` tokens keeps of it; its first token is never a target): `None` when no example
    /// trains anything within a row. Stops at the first it finds.
    pub fn first_trained_within(&self, w: usize) -> Result<Option<usize>> {
        let mut row = vec![0u32; w];
        for k in 0..self.count {
            let len = self.fill_example(k, &mut row)?;
            if row[..len].iter().skip(1).any(|t| t & UNTRAINED == 0) {
                return Ok(Some(k));
            }
        }
        Ok(None)
    }

    /// Example `k`'s tokens in the shard.
    pub fn bounds(&self, k: usize) -> Result<(usize, usize)> {
        assert!(k < self.count, "example {k} of {}", self.count);
        let mut b = [0u8; 16];
        read_at(
            &self.index,
            &self.index_path,
            (HEADER_BYTES + 8 * k) as u64,
            &mut b,
        )?;
        let start = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let end = u64::from_le_bytes(b[8..].try_into().expect("8 bytes"));
        Ok((start as usize, end as usize))
    }

    /// Fills `row` (`T + 1` tokens) with example `k` as the module docs say: its first
    /// tokens, untrained ones marked with [`UNTRAINED`], then padding `pad | UNTRAINED`.
    pub fn fill_row(&self, k: usize, pad: u32, row: &mut [u32]) -> Result<()> {
        let len = self.fill_example(k, row)?;
        row[len..].fill(pad | UNTRAINED);
        Ok(())
    }

    /// Writes example `k`'s first `min(len, dst.len())` tokens into `dst`, untrained ones
    /// marked with [`UNTRAINED`]; returns how many.
    fn fill_example(&self, k: usize, dst: &mut [u32]) -> Result<usize> {
        let (start, end) = self.bounds(k)?;
        let len = (end - start).min(dst.len());
        self.tokens.read(start, &mut dst[..len])?;
        // The bits of tokens start..start+len, a block of bytes at a time.
        let mut bytes = [0u8; 512];
        let mut i = 0;
        while i < len {
            let first_byte = (start + i) / 8;
            let last_byte = ((start + len - 1) / 8).min(first_byte + bytes.len() - 1);
            let block = &mut bytes[..last_byte - first_byte + 1];
            read_at(
                &self.mask,
                &self.mask_path,
                (HEADER_BYTES + first_byte) as u64,
                block,
            )?;
            while i < len && (start + i) / 8 <= last_byte {
                let p = start + i;
                if (block[p / 8 - first_byte] >> (p % 8)) & 1 == 0 {
                    dst[i] |= UNTRAINED;
                }
                i += 1;
            }
        }
        Ok(len)
    }
}

/// Consecutive draws that fit no row before a packed batch stops drawing.
const PACK_MISSES: usize = 16;

/// The examples of each of the `rows` rows of packed batch `index` (`T + 1` tokens a row), as
/// the module docs say: drawn from `Rng::stream(seed, index)`, each into the first row with
/// room for it (first-fit; one longer than a row is cut to the row, alone in it), until
/// [`PACK_MISSES`] draws in a row fit nowhere or every row is full.
fn pack_rows(
    ex: &Examples,
    (rows, t): (usize, usize),
    (seed, index): (u64, u64),
) -> Result<Vec<Vec<usize>>> {
    let w = t + 1;
    let mut rng = Rng::stream(seed, index);
    let mut placed: Vec<Vec<usize>> = vec![Vec::new(); rows];
    let mut free = vec![w; rows];
    let mut misses = 0;
    while misses < PACK_MISSES && free.iter().any(|&f| f > 0) {
        let k = rng.below(ex.len() as u64) as usize;
        let (start, end) = ex.bounds(k)?;
        let len = (end - start).min(w);
        match free.iter().position(|&f| f >= len).filter(|_| len > 0) {
            Some(r) => {
                placed[r].push(k);
                free[r] -= len;
                misses = 0;
            }
            None => misses += 1,
        }
    }
    Ok(placed)
}

/// Fills `out` (`[B, T+1]`) with rows `skip..skip + B` of packed batch `index`, whose rows
/// number `total` (every rank's; packed as the module docs say). Each example's tokens follow the previous
/// one's; an example's first token is [`UNTRAINED`] (nothing before it in its example
/// predicts it) and, after the row's first example, also [`EXAMPLE_START`], where the row's
/// positions restart. The rest of the row is padding, `pad | UNTRAINED`, its first token
/// also an [`EXAMPLE_START`] (padding attends to no example).
pub fn fill_packed_rows(
    ex: &Examples,
    (b, t): (usize, usize),
    (seed, index): (u64, u64),
    (skip, total): (usize, usize),
    pad: u32,
    out: &mut [u32],
) -> Result<()> {
    let w = t + 1;
    assert_eq!(
        out.len(),
        b * w,
        "fill_packed_rows: out must hold B*(T+1) tokens"
    );
    assert!(
        skip + b <= total,
        "fill_packed_rows: rows {skip}..{} of {total}",
        skip + b
    );
    if ex.is_empty() {
        bail!("'{}' holds no example", ex.index_path.display());
    }
    let placed = pack_rows(ex, (total, t), (seed, index))?;
    for (row, examples) in out.chunks_exact_mut(w).zip(&placed[skip..skip + b]) {
        write_row(ex, examples, pad, true, row)?;
    }
    Ok(())
}

/// Writes `examples` one after another into `row`, then padding `pad | UNTRAINED`: each
/// example's first token [`UNTRAINED`], the first token of every later example also
/// [`EXAMPLE_START`], and, in packed rows (`pack`), the padding's first token after an example
/// too (padding attends to no example). Rows of one example each (`pack` false) carry no mark.
fn write_row(
    ex: &Examples,
    examples: &[usize],
    pad: u32,
    pack: bool,
    row: &mut [u32],
) -> Result<()> {
    let mut at = 0;
    for &k in examples {
        let n = ex.fill_example(k, &mut row[at..])?;
        row[at] |= UNTRAINED;
        if at > 0 {
            row[at] |= EXAMPLE_START;
        }
        at += n;
    }
    if at < row.len() {
        row[at..].fill(pad | UNTRAINED);
        if at > 0 && pack {
            row[at] |= EXAMPLE_START;
        }
    }
    Ok(())
}

/// Fills `out` (`[B, T+1]`) with rows `skip..skip + B` of an evaluation batch of `total` rows
/// (every rank's) holding examples `start..` of the split in order, at most up to `end`: one
/// per row, or with `pack` as many as fit in a row before the next row starts (next-fit, so
/// the order stays), marked as in [`fill_packed_rows`]. Rows past the last example are
/// padding. Returns the first example not placed (`end` when all are): an evaluation walks
/// `start = 0, returned, …` until it reaches `end`, seeing each example exactly once whether
/// packed or not.
#[allow(clippy::too_many_arguments)]
pub fn fill_eval_rows(
    ex: &Examples,
    (b, t): (usize, usize),
    (start, end): (usize, usize),
    (skip, total): (usize, usize),
    pack: bool,
    pad: u32,
    out: &mut [u32],
) -> Result<usize> {
    let w = t + 1;
    assert_eq!(
        out.len(),
        b * w,
        "fill_eval_rows: out must hold B*(T+1) tokens"
    );
    assert!(
        skip + b <= total && end <= ex.len(),
        "fill_eval_rows: rows or examples out of range"
    );
    // Which examples each row holds.
    let mut rows: Vec<Vec<usize>> = vec![Vec::new(); total];
    let (mut k, mut r, mut free) = (start, 0, w);
    while k < end && r < total {
        let (a, z) = ex.bounds(k)?;
        let len = (z - a).min(w);
        if len == 0 {
            k += 1;
            continue;
        }
        if !rows[r].is_empty() && (!pack || len > free) {
            (r, free) = (r + 1, w);
            continue;
        }
        rows[r].push(k);
        free -= len;
        k += 1;
    }
    for (row, examples) in out.chunks_exact_mut(w).zip(&rows[skip..skip + b]) {
        write_row(ex, examples, pad, pack, row)?;
    }
    Ok(k)
}

/// Fills `out` (`[B, T+1]`) with rows `skip..skip + B` of batch `index`: one example per
/// row, drawn as the module docs say (the first `skip` rows are drawn and dropped: those of
/// the ranks before this one, [`crate::data::loader::Part`]).
pub fn fill_rows(
    ex: &Examples,
    (b, t): (usize, usize),
    (seed, index): (u64, u64),
    skip: usize,
    pad: u32,
    out: &mut [u32],
) -> Result<()> {
    let w = t + 1;
    assert_eq!(out.len(), b * w, "fill_rows: out must hold B*(T+1) tokens");
    if ex.is_empty() {
        bail!("'{}' holds no example", ex.index_path.display());
    }
    let mut rng = Rng::stream(seed, index);
    for _ in 0..skip {
        rng.below(ex.len() as u64);
    }
    for row in out.chunks_exact_mut(w) {
        let k = rng.below(ex.len() as u64) as usize;
        ex.fill_row(k, pad, row)?;
    }
    Ok(())
}
