//! The tokenizer files a Hugging Face model directory carries next to its weights, copied into
//! every checkpoint so that `AutoTokenizer.from_pretrained(checkpoint)` and generation work
//! from the checkpoint alone.
//!
//! memwall does not read these files here: they are copied byte for byte (streamed, never read
//! whole), each written atomically (temporary file, fsync, rename, directory fsync), so inside
//! a checkpoint's temporary directory they are on disk before the directory is published.

use anyhow::{Context, Result, bail};
use std::fs::File;
use std::path::Path;

use super::files::{CHAT_TEMPLATE_FILE, TOKENIZER_GGUF_FILE};
use crate::util::atomic;

/// The files copied, those of them that the source directory holds.
pub const TOKENIZER_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    CHAT_TEMPLATE_FILE,
    TOKENIZER_GGUF_FILE,
];

/// The file whose presence makes a directory a tokenizer source (see `TrainOptions`).
pub const TOKENIZER_FILE: &str = TOKENIZER_FILES[0];

/// Copies the [`TOKENIZER_FILES`] that exist in `src_dir` into `dst_dir` (replacing files of
/// the same name), each streamed into a temporary file, fsynced and renamed; returns the
/// names copied. Errors name the file and the directory: `src_dir` not a directory, a file
/// unreadable, `dst_dir` unwritable.
pub fn copy_tokenizer_files(src_dir: &Path, dst_dir: &Path) -> Result<Vec<&'static str>> {
    if !src_dir.is_dir() {
        bail!(
            "tokenizer directory {}: no such directory (it should hold tokenizer.json and the \
             other tokenizer files of the model)",
            src_dir.display()
        );
    }
    let mut copied = Vec::new();
    for name in TOKENIZER_FILES {
        let src = src_dir.join(name);
        if !src.is_file() {
            continue;
        }
        let mut from =
            File::open(&src).with_context(|| format!("cannot open {}", src.display()))?;
        let dst = dst_dir.join(name);
        atomic::write_with(&dst, |f| {
            std::io::copy(&mut from, f)
                .with_context(|| format!("copying {}", src.display()))
                .map(|_| ())
        })?;
        copied.push(name);
    }
    Ok(copied)
}

/// Copies the chat template file `src` into `dst_dir` as [`CHAT_TEMPLATE_FILE`] (atomically,
/// replacing one copied with the tokenizer files).
pub fn copy_chat_template(src: &Path, dst_dir: &Path) -> Result<()> {
    let mut from = File::open(src).with_context(|| format!("cannot open {}", src.display()))?;
    atomic::write_with(&dst_dir.join(CHAT_TEMPLATE_FILE), |f| {
        std::io::copy(&mut from, f)
            .with_context(|| format!("copying {}", src.display()))
            .map(|_| ())
    })
}
