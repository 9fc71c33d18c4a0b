//! `memwall tokenize --chat FILE`: every example of chat data printed as rendered, with its
//! trained tokens marked, or as JSON lines (`{"text", "ids", "trained"}`).
//!
//! Marks: green on a terminal (unless `NO_COLOR` is set), else `⟦` and `⟧` around each run of
//! trained text. Each example is headed by its place, format and counts. Conversations without
//! an assistant turn are warned about on stderr, with their place, and counted; the first line
//! that cannot be used stops the command with its place.

use super::encode::{Encoded, Encoder, Outcome};
use super::format::Format;
use super::read::for_each_line;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// How examples are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// One JSON object per line: `{"text", "ids", "trained"}`.
    Json,
    /// The text, trained runs in green.
    Color,
    /// The text, trained runs between `⟦` and `⟧`.
    Brackets,
}

/// What [`show`] saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Examples printed, by format.
    pub examples: BTreeMap<Format, usize>,
    /// Conversations without an assistant turn (warned, not trained).
    pub no_assistant: usize,
    /// Tokens of the examples printed.
    pub tokens: usize,
    /// Of those, the trained ones.
    pub trained: usize,
}

impl Counts {
    /// One line: examples (by format), tokens, trained tokens, conversations skipped.
    pub fn describe(&self) -> String {
        let n: usize = self.examples.values().sum();
        let by: Vec<String> = self
            .examples
            .iter()
            .map(|(f, k)| format!("{k} {}", f.name()))
            .collect();
        format!(
            "{} ({}), {} tokens, {} trained; {} without an assistant turn (not trained)",
            crate::util::count(n as u64, "example"),
            by.join(", "),
            self.tokens,
            self.trained,
            crate::util::count(self.no_assistant as u64, "conversation"),
        )
    }
}

/// Prints every example of the chat data at `path` to `out` in `style`; warnings go to `warn`.
pub fn show(
    path: &Path,
    encoder: &Encoder,
    style: Style,
    out: &mut dyn Write,
    warn: &mut dyn Write,
) -> Result<Counts> {
    let mut counts = Counts::default();
    for_each_line(path, &mut |place, line| {
        let outcome = encoder
            .encode_line(line)
            .with_context(|| format!("{place}"))?;
        let e = match outcome {
            Outcome::NoAssistant(f) => {
                counts.no_assistant += 1;
                writeln!(
                    warn,
                    "warning: {place}: a {} conversation without an assistant turn: nothing to train, skipped",
                    f.name()
                )?;
                return Ok(());
            }
            Outcome::Example(e) => e,
        };
        *counts.examples.entry(e.format).or_default() += 1;
        counts.tokens += e.ids.len();
        counts.trained += e.trained.iter().filter(|&&t| t == 1).count();
        match style {
            Style::Json => {
                serde_json::to_writer(&mut *out, &e)?;
                writeln!(out)?;
            }
            Style::Color | Style::Brackets => {
                let trained = e.trained.iter().filter(|&&t| t == 1).count();
                writeln!(
                    out,
                    "── {place} ({}, {} tokens, {trained} trained) ──",
                    e.format.name(),
                    e.ids.len()
                )?;
                writeln!(out, "{}", marked_text(&e, style == Style::Color))?;
            }
        }
        Ok(())
    })?;
    Ok(counts)
}

/// The example's text with its trained runs marked.
pub fn marked_text(e: &Encoded, color: bool) -> String {
    let (open, close) = if color {
        ("\x1b[32m", "\x1b[0m")
    } else {
        ("⟦", "⟧")
    };
    let mut s = String::with_capacity(e.text.len() + 16 * e.marked.len());
    let text = e.text.as_str();
    // Offsets of byte-level tokens may cut a character: widen to whole characters.
    let floor = |mut i: usize| {
        while !text.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let ceil = |mut i: usize| {
        while !text.is_char_boundary(i) {
            i += 1;
        }
        i
    };
    let mut at = 0;
    for &(a, b) in &e.marked {
        let (a, b) = (
            floor(a.min(text.len())).max(at),
            ceil(b.min(text.len())).max(at),
        );
        if a >= b {
            continue;
        }
        s.push_str(&e.text[at..a]);
        s.push_str(open);
        s.push_str(&e.text[a..b]);
        s.push_str(close);
        at = b;
    }
    s.push_str(&e.text[at..]);
    s
}
