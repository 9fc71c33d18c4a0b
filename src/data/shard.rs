//! Token shard files: the on-disk form of a tokenized corpus, read window by window with
//! positioned reads (`pread`) into the caller's buffer.
//!
//! # Format (version 1)
//!
//! A shard is a 32-byte header followed by the tokens. Every integer is little-endian.
//!
//! | offset | size | field         | value                                                   |
//! |-------:|-----:|---------------|---------------------------------------------------------|
//! | 0      | 8    | magic         | `b"MWTOKEN\0"`                                          |
//! | 8      | 4    | version       | `u32`, `1`                                              |
//! | 12     | 4    | token_width   | `u32`, bytes per token: `2` or `4`                      |
//! | 16     | 4    | vocab_size    | `u32`, every token is `< vocab_size`                    |
//! | 20     | 4    | reserved      | `u32`, `0`                                              |
//! | 24     | 8    | token_count   | `u64`, number of tokens that follow                     |
//! | 32     | n·w  | tokens        | `token_count` tokens of `token_width` bytes each        |
//!
//! The width is fixed by the vocabulary: `u16` when `vocab_size <= 65536` (GPT-2's 50257 tokens
//! take 2 bytes each), `u32` otherwise. The file size is exactly `32 + token_count * token_width`;
//! a reader rejects anything else, so a truncated copy is caught on open, not mid-training.
//! The token data starts at offset 32, so a page-aligned map keeps it aligned for either width.
//!
//! [`write_shard`] writes atomically (temporary file in the same directory, fsync, rename: see
//! [`crate::util::atomic`]), so a crash leaves either the old shard or the new one. [`Shard::open`]
//! checks the header and the size, and scans the tokens once to check each is below
//! `vocab_size`: a corrupt token becomes an error naming the file instead of an out-of-range
//! embedding lookup in the trainer.
//!
//! The shard is not memory-mapped: every page of a mapped file that a random window touched
//! would stay in the process's resident set (read-ahead maps whole runs of pages), so a run's
//! RSS would grow towards the size of its data set, outside the plan and past `--max-memory`.
//! [`Shard::read`] copies each window with one positioned read into the `u32` tokens it fills
//! (widened in place), so the data set costs no resident memory beyond the loader's buffers.

use anyhow::{Context, Result, bail, ensure};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::util::atomic;

/// The 8 bytes every shard starts with.
pub const MAGIC: [u8; 8] = *b"MWTOKEN\0";
/// The format version this code writes and reads.
pub const VERSION: u32 = 1;
/// Size of the header in bytes.
pub const HEADER_BYTES: usize = 32;

/// Bytes per token for a vocabulary of `vocab_size` tokens: 2 up to 65536 tokens, else 4.
pub fn token_width(vocab_size: usize) -> usize {
    if vocab_size <= 1 << 16 { 2 } else { 4 }
}

/// Encodes the 32-byte header.
fn header(width: usize, vocab_size: usize, count: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(width as u32).to_le_bytes());
    h[16..20].copy_from_slice(&(vocab_size as u32).to_le_bytes());
    h[20..24].copy_from_slice(&0u32.to_le_bytes());
    h[24..32].copy_from_slice(&count.to_le_bytes());
    h
}

/// Writes `tokens` as a shard at `path` (atomically; see the module docs for the format).
///
/// Errors when `vocab_size` is 0 or above `u32::MAX`, when a token is `>= vocab_size` (naming
/// its position), or when the file cannot be written.
pub fn write_shard(path: &Path, tokens: &[u32], vocab_size: usize) -> Result<()> {
    ensure!(
        vocab_size > 0 && vocab_size <= u32::MAX as usize,
        "cannot write shard '{}': vocabulary size {vocab_size} is out of range (1..=4294967295)",
        path.display()
    );
    if let Some(i) = tokens.iter().position(|&t| t as usize >= vocab_size) {
        bail!(
            "cannot write shard '{}': token {} at position {i} is not below the vocabulary size {vocab_size}",
            path.display(),
            tokens[i]
        );
    }
    let width = token_width(vocab_size);
    atomic::write_with(path, |f| {
        let ctx = || format!("cannot write shard '{}' (disk full?)", path.display());
        let mut w = BufWriter::with_capacity(1 << 20, f);
        w.write_all(&header(width, vocab_size, tokens.len() as u64))
            .with_context(ctx)?;
        let mut buf = Vec::with_capacity(64 * 1024 * width);
        for chunk in tokens.chunks(64 * 1024) {
            buf.clear();
            if width == 2 {
                chunk
                    .iter()
                    .for_each(|&t| buf.extend_from_slice(&(t as u16).to_le_bytes()));
            } else {
                chunk
                    .iter()
                    .for_each(|&t| buf.extend_from_slice(&t.to_le_bytes()));
            }
            w.write_all(&buf).with_context(ctx)?;
        }
        w.flush().with_context(ctx)
    })
}

/// A read-only token shard, validated on open, read by positioned reads.
#[derive(Debug)]
pub struct Shard {
    path: PathBuf,
    /// The open file; tokens start at [`HEADER_BYTES`].
    file: File,
    width: usize,
    vocab_size: usize,
    len: usize,
}

impl Shard {
    /// Opens and validates a shard: magic, version, width (consistent with the vocabulary),
    /// exact file size, and every token below the vocabulary size. Each error names the file.
    pub fn open(path: &Path) -> Result<Shard> {
        let p = path.display();
        let mut file =
            File::open(path).with_context(|| format!("cannot open token shard '{p}'"))?;
        let actual = file
            .metadata()
            .with_context(|| format!("cannot stat token shard '{p}'"))?
            .len();
        ensure!(
            actual >= HEADER_BYTES as u64,
            "token shard '{p}' is truncated: {actual} bytes, shorter than the {HEADER_BYTES}-byte header \
             (re-run `memwall prepare` to rebuild it)"
        );
        let mut h = [0u8; HEADER_BYTES];
        file.read_exact(&mut h)
            .with_context(|| format!("cannot read the header of token shard '{p}'"))?;
        let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        ensure!(
            h[0..8] == MAGIC,
            "'{p}' is not a memwall token shard (bad magic {:?}, expected \"MWTOKEN\\0\"): \
             create shards with `memwall prepare <FILES> --out DIR`",
            String::from_utf8_lossy(&h[0..8])
        );
        let version = u32_at(8);
        ensure!(
            version == VERSION,
            "token shard '{p}' has format version {version}, but this memwall reads version {VERSION}: \
             re-run `memwall prepare` with this memwall"
        );
        let width = u32_at(12) as usize;
        let vocab_size = u32_at(16) as usize;
        ensure!(
            vocab_size > 0,
            "token shard '{p}' is corrupt: vocabulary size 0 in the header"
        );
        ensure!(
            width == token_width(vocab_size),
            "token shard '{p}' is corrupt: token width {width} bytes does not match vocabulary size \
             {vocab_size} (expected {} bytes)",
            token_width(vocab_size)
        );
        let count = u64::from_le_bytes(h[24..32].try_into().expect("8-byte slice"));
        let expected = count
            .checked_mul(width as u64)
            .and_then(|n| n.checked_add(HEADER_BYTES as u64))
            .with_context(|| {
                format!("token shard '{p}' is corrupt: token count {count} overflows")
            })?;
        if actual != expected {
            let what = if actual < expected {
                "truncated"
            } else {
                "corrupt (trailing bytes)"
            };
            bail!(
                "token shard '{p}' is {what}: the header promises {count} tokens, so {expected} bytes, \
                 but the file has {actual} bytes (re-run `memwall prepare` to rebuild it)"
            );
        }
        let len = usize::try_from(count).with_context(|| {
            format!("token shard '{p}' has {count} tokens, too many for this platform")
        })?;

        // Range check with plain reads (not through the map, see the module docs).
        let mut buf = vec![0u8; (1 << 20) * width];
        let mut pos = 0usize;
        while pos < len {
            let n = (len - pos).min(1 << 20);
            let bytes = &mut buf[..n * width];
            file.read_exact(bytes)
                .with_context(|| format!("cannot read token shard '{p}'"))?;
            let bad = if width == 2 {
                bytes
                    .chunks_exact(2)
                    .position(|c| u16::from_le_bytes([c[0], c[1]]) as usize >= vocab_size)
            } else {
                bytes.chunks_exact(4).position(|c| {
                    u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize >= vocab_size
                })
            };
            if let Some(i) = bad {
                let c = &bytes[i * width..(i + 1) * width];
                let value = match width {
                    2 => u16::from_le_bytes([c[0], c[1]]) as u64,
                    _ => u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64,
                };
                bail!(
                    "token shard '{p}' is corrupt: token {} (id {value}) is not below the \
                     vocabulary size {vocab_size} (re-run `memwall prepare` to rebuild it)",
                    pos + i
                );
            }
            pos += n;
        }

        // memwall never writes a shard in place (writers replace files by rename), so the
        // open file's bytes stay those just checked.
        Ok(Shard {
            path: path.to_path_buf(),
            file,
            width,
            vocab_size,
            len,
        })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the shard holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Vocabulary size recorded in the header; every token is below it.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The file this shard was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Copies tokens `start..start + out.len()` into `out`, with one positioned read (no
    /// map: nothing of the file stays resident). Errors name the file when the read fails (a
    /// disk error, or a shard truncated since it was opened).
    ///
    /// Panics when the range is outside the shard: callers check sizes up front
    /// (see [`crate::data::loader::check_fits`]), so this is internal misuse, not bad input.
    pub fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let end = start.checked_add(out.len());
        assert!(
            end.is_some_and(|e| e <= self.len),
            "Shard::read({start}, len {}) is out of range for '{}' with {} tokens",
            out.len(),
            self.path.display(),
            self.len
        );
        if out.is_empty() {
            return Ok(());
        }
        let (w, n) = (self.width, out.len());
        // The file's bytes land in the first n·w bytes of `out`, then widen in place.
        let bytes: &mut [u8] = bytemuck_u32(out);
        self.file
            .read_exact_at(&mut bytes[..n * w], (HEADER_BYTES + start * w) as u64)
            .with_context(|| {
                format!(
                    "cannot read tokens {start}..{} of token shard '{}' (was it changed or \
                     truncated after training started? re-run `memwall prepare`)",
                    start + n,
                    self.path.display()
                )
            })?;
        if w == 2 {
            // Back to front: token i's two bytes sit at 2i, its u32 goes to 4i >= 2i.
            for i in (0..n).rev() {
                let v = u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]) as u32;
                out_u32_at(bytes, i, v);
            }
        } else {
            for x in out.iter_mut() {
                *x = u32::from_le(*x);
            }
        }
        Ok(())
    }
}

/// The bytes of `v` (a `u32` slice may be viewed as bytes: no padding, any bit pattern of
/// `u8` is valid, alignment 1).
fn bytemuck_u32(v: &mut [u32]) -> &mut [u8] {
    let len = std::mem::size_of_val(v);
    // SAFETY: the same memory, exclusively borrowed for the result's lifetime.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), len) }
}

/// Stores `v` as the native-endian `u32` at index `i` of bytes viewing a `u32` slice.
fn out_u32_at(bytes: &mut [u8], i: usize, v: u32) {
    bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_ne_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(s: &Shard) -> Vec<u32> {
        let mut v = vec![0; s.len()];
        s.read(0, &mut v).unwrap();
        v
    }

    #[test]
    fn round_trip_u16() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        let toks: Vec<u32> = (0..50257u32)
            .rev()
            .step_by(7)
            .chain([0, 50256, 1])
            .collect();
        write_shard(&p, &toks, 50257).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().len(),
            32 + 2 * toks.len() as u64
        );
        let raw = std::fs::read(&p).unwrap();
        assert_eq!(&raw[0..8], b"MWTOKEN\0");
        assert_eq!(u32::from_le_bytes(raw[12..16].try_into().unwrap()), 2);
        assert_eq!(u32::from_le_bytes(raw[16..20].try_into().unwrap()), 50257);
        assert_eq!(
            u64::from_le_bytes(raw[24..32].try_into().unwrap()),
            toks.len() as u64
        );
        let s = Shard::open(&p).unwrap();
        assert_eq!(s.len(), toks.len());
        assert_eq!(s.vocab_size(), 50257);
        assert_eq!(s.path(), p.as_path());
        assert_eq!(read_all(&s), toks);
        let mut mid = [0u32; 5];
        s.read(10, &mut mid).unwrap();
        assert_eq!(&mid, &toks[10..15]);
        // No temporary files left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn round_trip_u32_and_boundary_width() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.bin");
        let toks = vec![0, 65535, 65536, 99_999, 12345];
        write_shard(&p, &toks, 100_000).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 32 + 4 * 5);
        let s = Shard::open(&p).unwrap();
        assert_eq!(read_all(&s), toks);
        // 65536 tokens still fit in u16.
        let q = dir.path().join("c.bin");
        write_shard(&q, &[65535, 0], 65536).unwrap();
        assert_eq!(std::fs::metadata(&q).unwrap().len(), 32 + 4);
        assert_eq!(read_all(&Shard::open(&q).unwrap()), vec![65535, 0]);
    }

    #[test]
    fn empty_shard() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e.bin");
        write_shard(&p, &[], 50257).unwrap();
        let s = Shard::open(&p).unwrap();
        assert!(s.is_empty());
        s.read(0, &mut []).unwrap();
    }

    #[test]
    fn overwrite_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("o.bin");
        write_shard(&p, &[1, 2, 3], 10).unwrap();
        write_shard(&p, &[4, 5], 10).unwrap();
        assert_eq!(read_all(&Shard::open(&p).unwrap()), vec![4, 5]);
    }

    #[test]
    fn refuses_out_of_vocab_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.bin");
        let e = write_shard(&p, &[1, 2, 50257], 50257)
            .unwrap_err()
            .to_string();
        assert!(e.contains("position 2") && e.contains("50257"), "{e}");
        assert!(!p.exists());
        assert!(write_shard(&p, &[0], 0).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn truncated_shard_names_file_and_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        write_shard(&p, &[7; 100], 50257).unwrap();
        let raw = std::fs::read(&p).unwrap();
        std::fs::write(&p, &raw[..raw.len() - 3]).unwrap();
        let e = format!("{:#}", Shard::open(&p).unwrap_err());
        assert!(e.contains("t.bin") && e.contains("truncated"), "{e}");
        assert!(e.contains("232") && e.contains("229"), "{e}");
        // Shorter than the header.
        std::fs::write(&p, &raw[..10]).unwrap();
        let e = format!("{:#}", Shard::open(&p).unwrap_err());
        assert!(e.contains("t.bin") && e.contains("truncated"), "{e}");
        // Trailing garbage is also rejected.
        let mut long = raw.clone();
        long.extend_from_slice(&[0, 0]);
        std::fs::write(&p, &long).unwrap();
        assert!(Shard::open(&p).is_err());
    }

    #[test]
    fn bad_magic_version_width_and_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.bin");
        write_shard(&p, &[1, 2, 3, 4], 50257).unwrap();
        let raw = std::fs::read(&p).unwrap();

        let mut bad = raw.clone();
        bad[0] = b'X';
        std::fs::write(&p, &bad).unwrap();
        let e = format!("{:#}", Shard::open(&p).unwrap_err());
        assert!(e.contains("m.bin") && e.contains("magic"), "{e}");

        let mut bad = raw.clone();
        bad[8..12].copy_from_slice(&2u32.to_le_bytes());
        std::fs::write(&p, &bad).unwrap();
        let e = format!("{:#}", Shard::open(&p).unwrap_err());
        assert!(e.contains("m.bin") && e.contains("version 2"), "{e}");

        let mut bad = raw.clone();
        bad[12..16].copy_from_slice(&4u32.to_le_bytes());
        std::fs::write(&p, &bad).unwrap();
        let e = format!("{:#}", Shard::open(&p).unwrap_err());
        assert!(e.contains("width"), "{e}");

        let mut bad = raw.clone();
        bad[34..36].copy_from_slice(&60000u16.to_le_bytes());
        std::fs::write(&p, &bad).unwrap();
        let e = format!("{:#}", Shard::open(&p).unwrap_err());
        assert!(
            e.contains("m.bin") && e.contains("token 1 (id 60000)"),
            "{e}"
        );

        let e = format!(
            "{:#}",
            Shard::open(&dir.path().join("missing.bin")).unwrap_err()
        );
        assert!(e.contains("missing.bin"), "{e}");
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn read_out_of_range_panics() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.bin");
        write_shard(&p, &[1, 2, 3], 10).unwrap();
        let s = Shard::open(&p).unwrap();
        let _ = s.read(1, &mut [0; 3]);
    }

    /// Reading windows keeps nothing of the file resident: the shard is not mapped (a map's
    /// touched pages stayed in the resident set, growing a run's RSS towards its data set's
    /// size, outside the plan).
    #[test]
    fn reads_map_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("unmapped-shard.bin");
        let tokens: Vec<u32> = (0..300_000u32).map(|i| i % 50_000).collect();
        write_shard(&p, &tokens, 50_257).unwrap();
        let s = Shard::open(&p).unwrap();
        let mut out = vec![0u32; 129];
        for k in 0..200 {
            let start = k * 1_499;
            s.read(start, &mut out).unwrap();
            assert_eq!(out, tokens[start..start + 129]);
        }
        let maps = std::fs::read_to_string("/proc/self/maps").expect("Linux /proc");
        let name = p.to_string_lossy();
        assert!(
            !maps.lines().any(|l| l.ends_with(name.as_ref())),
            "the shard is mapped into the process"
        );
    }

    /// A shard cut short after it was opened is an error naming the file, not a crash (a
    /// mapped file's missing pages raised SIGBUS).
    #[test]
    fn truncated_after_open_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cut.bin");
        let tokens: Vec<u32> = (0..100_000u32).collect();
        write_shard(&p, &tokens, 200_000).unwrap();
        let s = Shard::open(&p).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(HEADER_BYTES as u64 + 4)
            .unwrap();
        let mut out = vec![0u32; 10];
        let e = format!("{:#}", s.read(90_000, &mut out).unwrap_err());
        assert!(e.contains("cut.bin") && e.contains("90000..90010"), "{e}");
    }
}
