//! The user cache: `$XDG_CACHE_HOME/memwall` (an absolute `XDG_CACHE_HOME` only, as the XDG
//! specification says) or `$HOME/.cache/memwall`. It holds what memwall fetches or derives
//! once per machine: the Shakespeare corpus, converted GGUF models, the demo's SmolLM2 file.

use std::path::PathBuf;

/// `$XDG_CACHE_HOME` (if absolute) or `$HOME/.cache`; `None` when neither is set.
pub fn cache_home() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|h| !h.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })
}

/// memwall's own folder in the user cache (not created here).
pub fn memwall_cache() -> Option<PathBuf> {
    cache_home().map(|h| h.join("memwall"))
}
