//! The source file's tokenizer metadata, kept beside a converted model: `tokenizer.gguf`.
//!
//! `memwall convert` rebuilds `tokenizer.json` from a GGUF file's `tokenizer.*` keys, but
//! `tokenizer.json` cannot say everything those keys say (SentencePiece scores, token types,
//! the pre-tokenizer's llama.cpp name, ...). So convert also writes the keys themselves, every
//! `tokenizer.*` key of the source with its exact GGUF type and value, as a GGUF file with no
//! tensors ([`write()`]): the format that holds them without a translation (scores stay f32,
//! types i32, ids u32, merges and templates strings), readable by gguf-py and llama.cpp's
//! `gguf-dump`. Training copies it into checkpoints with the tokenizer files
//! (`ckpt::TOKENIZER_FILES`), and `export` writes the keys back verbatim ([`read()`]) when the
//! file's token list is `tokenizer.json`'s vocabulary (see `export::vocab`).

use super::file::{GgufFile, Value};
use super::write::write_gguf;
use anyhow::{Context, Result};
use std::path::Path;

/// The `tokenizer.*` keys of `f`, in file order.
pub fn tokenizer_keys(f: &GgufFile) -> Vec<(String, Value)> {
    f.metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .cloned()
        .collect()
}

/// Writes `keys` into `dir/tokenizer.gguf` (atomically); returns the file's size.
pub fn write(keys: &[(String, Value)], dir: &Path) -> Result<u64> {
    let path = dir.join(crate::ckpt::TOKENIZER_GGUF_FILE);
    write_gguf(&path, keys, &[], |_, _| Ok(()))?;
    Ok(std::fs::metadata(&path)
        .with_context(|| format!("cannot stat {}", path.display()))?
        .len())
}

/// The `tokenizer.*` keys of `dir/tokenizer.gguf`; `None` when the directory has no such
/// file. A file that is not GGUF is an error naming it.
pub fn read(dir: &Path) -> Result<Option<Vec<(String, Value)>>> {
    let path = dir.join(crate::ckpt::TOKENIZER_GGUF_FILE);
    if !path.is_file() {
        return Ok(None);
    }
    let f = GgufFile::open(&path).with_context(|| {
        format!(
            "{} holds the tokenizer metadata of the GGUF file the model was converted from; \
             delete it to rebuild the metadata from tokenizer.json",
            path.display()
        )
    })?;
    Ok(Some(tokenizer_keys(&f)))
}
