//! What a path holds, by its name and first bytes, for the modules that must tell a GGUF file
//! from a `config.json` or a model directory before reading it (the model resolver, the
//! tokenizer loader, the GGUF cache).

use std::fs;
use std::io::Read;
use std::path::Path;

/// The first four bytes of a GGUF file.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";

/// Whether `path` is a GGUF file (by its `.gguf` extension or its magic bytes). Directories,
/// missing paths and other files (a config.json) are not.
pub fn is_gguf(path: &Path) -> bool {
    if !path.is_file() {
        return false;
    }
    let by_name = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let mut head = [0u8; 4];
    let by_magic = fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok()
        && &head == GGUF_MAGIC;
    by_name || by_magic
}
