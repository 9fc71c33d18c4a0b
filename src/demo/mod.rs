//! `memwall demo`: the guided tours, printed as numbered steps.
//!
//! * [`shakespeare`]: `memwall demo` — prepare the Shakespeare corpus (GPT-2 BPE), print the
//!   memory plan, train `gpt2-tiny` from scratch, sample from it.
//! * [`finetune`]: `memwall demo finetune` — find or fetch the pretrained SmolLM2-135M-Instruct
//!   ([`smollm2`]), convert it, ask it a question, fine-tune it on Shakespeare with its own
//!   tokenizer, and show the validation loss and a sample before and after.
//! * [`chat`]: `memwall demo chat` — build a conversation set from the Shakespeare corpus
//!   ("Continue this speech of ROMEO: …" → the next lines), prepare it with the same model's
//!   chat template, train LoRA adapters on it, and show the validation loss on the answers
//!   and the answer to a held-out question before and after.
//!
//! The demos are library code over the same APIs as the commands (`data`, `gguf`, `exec`,
//! `plan`); they print to stdout, and the CLI only parses their flags.

pub mod chat;
pub mod finetune;
pub mod shakespeare;
pub mod smollm2;

use crate::exec::generate::{SampleOptions, sample_text};
use anyhow::Result;
use std::io::Write;

/// Prints the prompt, then streams the continuation to stdout as it is generated; returns
/// the continuation.
pub(crate) fn print_sample(opts: &SampleOptions) -> Result<String> {
    let mut out = std::io::stdout();
    let _ = write!(out, "{}", opts.prompt);
    let _ = out.flush();
    sample_text(
        opts,
        &mut |s| {
            let _ = out.write_all(s.as_bytes());
            let _ = out.flush();
        },
        &mut |m| eprintln!("{m}"),
    )
}
