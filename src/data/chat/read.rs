//! Reading chat data: a `.jsonl` or `.jsonl.gz` file, or a folder of them read in name
//! order, streamed a line at a time (one line in memory, whatever the file's size).
//!
//! Every line is handed on with its [`Place`] (file and 1-based line number), so that any
//! refusal downstream names where it is. Lines holding only whitespace are skipped.

use anyhow::{Context, Result, bail};
use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// Where a line is: its file and 1-based line number. Displays as `file:line`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    /// The file.
    pub file: PathBuf,
    /// The line number, from 1.
    pub line: usize,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file.display(), self.line)
    }
}

/// Whether `path` is named as chat data (`.jsonl` or `.jsonl.gz`).
fn is_chat_file(path: &Path) -> bool {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    name.is_some_and(|n| n.ends_with(".jsonl") || n.ends_with(".jsonl.gz"))
}

/// The files `path` names: itself, or the `.jsonl` and `.jsonl.gz` files directly in a folder,
/// in name order. A folder with none is refused.
pub fn chat_files(path: &Path) -> Result<Vec<PathBuf>> {
    let p = path.display();
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    if !path.is_dir() {
        bail!(
            "chat data '{p}' does not exist: pass a .jsonl or .jsonl.gz file, or a folder of them"
        );
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).with_context(|| format!("cannot list folder '{p}'"))? {
        let f = entry
            .with_context(|| format!("cannot list folder '{p}'"))?
            .path();
        if f.is_file() && is_chat_file(&f) {
            files.push(f);
        }
    }
    if files.is_empty() {
        bail!("folder '{p}' holds no .jsonl or .jsonl.gz file");
    }
    files.sort();
    Ok(files)
}

/// Calls `each` on every non-blank line of the files `path` names ([`chat_files`]), in order,
/// without its line ending; stops at the first error. A `.gz` file is decompressed as it is
/// read (concatenated gzip members included). Bytes that are not UTF-8 are refused with the
/// place.
pub fn for_each_line(path: &Path, each: &mut dyn FnMut(&Place, &str) -> Result<()>) -> Result<()> {
    for file in chat_files(path)? {
        let f = std::fs::File::open(&file)
            .with_context(|| format!("cannot open chat data '{}'", file.display()))?;
        let gz = file.extension().is_some_and(|e| e == "gz");
        let reader: Box<dyn Read> = if gz {
            Box::new(flate2::read::MultiGzDecoder::new(f))
        } else {
            Box::new(f)
        };
        read_lines(&file, BufReader::with_capacity(1 << 16, reader), each)?;
    }
    Ok(())
}

/// The lines of one file (see [`for_each_line`]).
fn read_lines(
    file: &Path,
    mut reader: impl BufRead,
    each: &mut dyn FnMut(&Place, &str) -> Result<()>,
) -> Result<()> {
    let mut buf = Vec::new();
    let mut place = Place {
        file: file.to_path_buf(),
        line: 0,
    };
    loop {
        buf.clear();
        place.line += 1;
        let n = reader
            .read_until(b'\n', &mut buf)
            .with_context(|| format!("{place}: cannot read (a damaged or truncated file?)"))?;
        if n == 0 {
            return Ok(());
        }
        let line = std::str::from_utf8(&buf)
            .with_context(|| format!("{place}: the line is not UTF-8 text"))?;
        let line = line.strip_suffix('\n').unwrap_or(line);
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.trim().is_empty() {
            continue;
        }
        each(&place, line)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn collect(path: &Path) -> Result<Vec<String>> {
        let mut got = Vec::new();
        for_each_line(path, &mut |p, l| {
            let name = p.file.file_name().unwrap().to_string_lossy().into_owned();
            got.push(format!("{name}:{}:{l}", p.line));
            Ok(())
        })?;
        Ok(got)
    }

    #[test]
    fn plain_gzip_and_folders_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("b.jsonl"), "b1\r\n\n  \nb4").unwrap();
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(d.join("a.jsonl.gz")).unwrap(),
            flate2::Compression::default(),
        );
        gz.write_all(b"a1\na2\n").unwrap();
        gz.finish().unwrap();
        std::fs::write(d.join("c.txt"), "ignored").unwrap();
        std::fs::write(d.join("0.jsonl"), "").unwrap();
        assert_eq!(
            collect(d).unwrap(),
            [
                "a.jsonl.gz:1:a1",
                "a.jsonl.gz:2:a2",
                "b.jsonl:1:b1",
                "b.jsonl:4:b4"
            ]
        );
        assert_eq!(
            collect(&d.join("a.jsonl.gz")).unwrap(),
            ["a.jsonl.gz:1:a1", "a.jsonl.gz:2:a2"]
        );
    }

    #[test]
    fn errors_name_the_place() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("x.jsonl"), b"ok\n\xff\xfe\n").unwrap();
        let e = format!("{:#}", collect(&d.join("x.jsonl")).unwrap_err());
        assert!(e.contains("x.jsonl:2") && e.contains("not UTF-8"), "{e}");
        // A callback's error stops the walk.
        let mut seen = 0;
        let e = for_each_line(&d.join("x.jsonl"), &mut |p, _| {
            seen += 1;
            bail!("{p}: refused")
        })
        .unwrap_err();
        assert_eq!(seen, 1);
        assert!(format!("{e}").ends_with("x.jsonl:1: refused"), "{e}");
        // A truncated gzip file.
        std::fs::write(d.join("t.jsonl.gz"), b"\x1f\x8b\x08\x00").unwrap();
        let e = format!("{:#}", collect(&d.join("t.jsonl.gz")).unwrap_err());
        assert!(
            e.contains("t.jsonl.gz:1") && e.contains("cannot read"),
            "{e}"
        );
        let empty = d.join("empty");
        std::fs::create_dir(&empty).unwrap();
        let e = format!("{:#}", collect(&empty).unwrap_err());
        assert!(e.contains("holds no .jsonl"), "{e}");
        let e = format!("{:#}", collect(&d.join("nope.jsonl")).unwrap_err());
        assert!(e.contains("does not exist"), "{e}");
    }
}
