//! Text generation from a checkpoint: greedy (`temperature 0`, the argmax a reference
//! implementation picks) or sampled with temperature and top-k.

use super::executor::Executor;
use crate::backend::DeviceId;
use crate::backend::host::softmax_row;
use crate::ckpt;
use crate::data::tokenizer::{Tokenizer, model_tokenizer};
use crate::model::Family;
use crate::plan::{Mode, StepConfig, build_plan};
use crate::util::rng::Rng;
use anyhow::{Result, anyhow, bail};
use std::path::{Path, PathBuf};

/// What to generate.
#[derive(Clone, Debug)]
pub struct SampleOptions {
    /// Checkpoint directory (config.json + model.safetensors).
    pub checkpoint: PathBuf,
    pub prompt: String,
    /// Number of new tokens.
    pub tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    pub seed: u64,
    pub threads: usize,
    /// The backend that runs the model.
    pub device: DeviceId,
    /// A LoRA adapter (PEFT's files) applied to the model: merged into its weights in memory,
    /// which computes what base and adapter compute together.
    pub adapter: Option<PathBuf>,
    /// Tokens that end generation (not printed): a chat's end-of-turn tokens. Empty: generate
    /// `tokens` tokens.
    pub stop: Vec<u32>,
}

/// A chat turn to answer (`sample --chat`).
#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    /// The user's message.
    pub user: String,
    /// A system turn before it (`--system`).
    pub system: Option<String>,
    /// A Jinja chat template overriding the model's (`--chat-template`).
    pub template: Option<PathBuf>,
}

/// Generates `opts.tokens` tokens after the prompt; returns the new token ids. `on_token`
/// is called with each new token as it is produced (for streaming output); `say`, before
/// the first, with what the reader should know (the prompt and the new tokens exceeding the
/// model's context), a line each.
pub fn generate_tokens(
    opts: &SampleOptions,
    prompt: &[u32],
    on_token: &mut dyn FnMut(u32),
    say: &mut dyn FnMut(&str),
) -> Result<Vec<u32>> {
    if !(opts.temperature >= 0.0 && opts.temperature.is_finite()) {
        bail!(
            "--temperature must be >= 0 (0 is greedy), got {}",
            opts.temperature
        );
    }
    if prompt.is_empty() {
        bail!("--prompt is empty; give at least one character of text");
    }
    let spec = ckpt::load_spec(&opts.checkpoint)?;
    if let Some(w) = context_warning(prompt.len(), opts.tokens, spec.max_seq()) {
        say(&format!("memwall: warning: {w}"));
    }
    let ctx = spec
        .max_seq()
        .min(prompt.len().saturating_add(opts.tokens))
        .max(1);
    // Each token is computed from a forward over the sequence so far, as transformers
    // computes it without a cache; LongRoPE picks its factors by that length, so a plan for
    // the pretraining context serves until the sequence outgrows it, and one for the whole
    // context after.
    let first_ctx = match spec.rope_switch() {
        Some(o) if prompt.len() <= o => ctx.min(o.max(1)),
        _ => ctx,
    };
    let open = |ctx: usize| -> Result<Executor> {
        let plan = build_plan(
            &spec,
            &StepConfig::new(1, ctx, opts.threads),
            Mode::Generate,
            opts.device.open()?,
        )?;
        let layout = plan.layout.clone();
        let mut ex = Executor::on(plan, opts.device.open()?)?;
        let adapter = match &opts.adapter {
            Some(dir) => Some(ckpt::adapter::load_adapter(
                &ckpt::adapter::resolve_dir(dir)?,
                &layout,
            )?),
            None => None,
        };
        ex.with_params_mut(|p| -> Result<()> {
            ckpt::load_params(&opts.checkpoint, &layout, p)?;
            if let Some((adapters, values)) = &adapter {
                crate::ckpt::adapter::merge_into(adapters, &layout, p, values);
            }
            Ok(())
        })??;
        Ok(ex)
    };
    let (mut ex, mut ex_ctx) = (open(first_ctx)?, first_ctx);
    let mut rng = Rng::new(opts.seed);
    let mut all: Vec<u32> = prompt.to_vec();
    let mut probs = vec![0f32; spec.vocab_size];
    let mut order: Vec<u32> = Vec::with_capacity(spec.vocab_size);
    // Grown as tokens come: --tokens may ask for more than memory holds ids of.
    let mut out = Vec::with_capacity(opts.tokens.min(1 << 16));
    for _ in 0..opts.tokens {
        if all.len() > ex_ctx && ex_ctx < ctx {
            // One executor at a time: the first's memory is freed before the second's.
            drop(ex);
            ex = open(ctx)?;
            ex_ctx = ctx;
        }
        let start = all.len().saturating_sub(ex_ctx);
        let logits = ex.next_token_logits(&all[start..])?;
        let next = if opts.temperature == 0.0 {
            argmax(logits)
        } else {
            pick(
                logits,
                opts.temperature,
                opts.top_k,
                &mut probs,
                &mut order,
                &mut rng,
            )
        };
        if opts.stop.contains(&next) {
            break;
        }
        all.push(next);
        out.push(next);
        on_token(next);
    }
    Ok(out)
}

/// What a reader should know when the prompt and the new tokens exceed the model's context
/// of `context` tokens (generation then sees only the newest `context` tokens).
fn context_warning(prompt: usize, tokens: usize, context: usize) -> Option<String> {
    if prompt > context {
        Some(format!(
            "--prompt is {prompt} tokens, more than the model's context of {context}: its first \
             {} tokens are not seen",
            prompt - context
        ))
    } else if prompt.saturating_add(tokens) > context {
        Some(format!(
            "--prompt ({prompt} tokens) and --tokens {tokens} exceed the model's context of \
             {context}: after {} new tokens, the oldest slide out of view",
            context - prompt
        ))
    } else {
        None
    }
}

/// Generates text: the decoded continuation of `opts.prompt`, streamed to `on_text`;
/// warnings go to `say` (see [`generate_tokens`]).
pub fn sample_text(
    opts: &SampleOptions,
    on_text: &mut dyn FnMut(&str),
    say: &mut dyn FnMut(&str),
) -> Result<String> {
    let tok = checkpoint_tokenizer(&opts.checkpoint)?;
    let prompt = tok.encode(&opts.prompt)?;
    stream_text(opts, &tok, &prompt, on_text, say)
}

/// Answers one chat turn: `chat` rendered with the model's chat template (or
/// `chat.template`) and `add_generation_prompt`, as `apply_chat_template` does, then
/// generated until an end-of-turn token (the tokenizer's `eos_token` and the end-of-turn
/// tokens of the common templates that the vocabulary has) or `opts.tokens`. Returns the
/// answer, which `on_text` receives as it comes; the prompt is not printed. Warnings go to
/// `say` (see [`generate_tokens`]).
pub fn chat_text(
    opts: &SampleOptions,
    chat: &ChatRequest,
    on_text: &mut dyn FnMut(&str),
    say: &mut dyn FnMut(&str),
) -> Result<String> {
    use crate::data::chat::template::MISSING_HINT;
    use crate::data::chat::{ChatTemplate, Message, Role};
    let tok = checkpoint_tokenizer(&opts.checkpoint)?;
    // An adapter trained on chat data carries the template it was trained with.
    let trained_with = (opts.adapter.as_ref())
        .map(|a| a.join(crate::ckpt::CHAT_TEMPLATE_FILE))
        .filter(|p| p.is_file());
    let file = chat.template.as_deref().or(trained_with.as_deref());
    let template = ChatTemplate::load(Some(&opts.checkpoint), file)?.ok_or_else(|| {
        anyhow!(
            "--chat: the model '{}' has no chat template; {MISSING_HINT}",
            opts.checkpoint.display()
        )
    })?;
    let mut messages = Vec::new();
    if let Some(system) = &chat.system {
        messages.push(Message::new(Role::System, system.as_str()));
    }
    messages.push(Message::new(Role::User, chat.user.as_str()));
    let text = template.render(&messages, true)?;
    let (prompt, _) = tok.encode_rendered(&text)?;
    let mut opts = opts.clone();
    opts.stop = stop_tokens(&tok, template.specials());
    stream_text(&opts, &tok, &prompt, on_text, say)
}

/// The tokens that end a chat answer: the template's `eos_token`, and the end-of-turn tokens
/// of the ChatML, Llama 3 and Gemma templates and the end-of-text token where the vocabulary
/// has them as single tokens.
fn stop_tokens(tok: &Tokenizer, specials: &std::collections::BTreeMap<String, String>) -> Vec<u32> {
    let mut names: Vec<&str> = vec![
        "<|im_end|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        "<end_of_turn>",
    ];
    if let Some(eos) = specials.get("eos_token") {
        names.push(eos);
    }
    let mut stop: Vec<u32> = names
        .into_iter()
        .filter_map(|n| match tok.encode_rendered(n) {
            Ok((ids, _)) if ids.len() == 1 => Some(ids[0]),
            _ => None,
        })
        .collect();
    stop.push(tok.eot());
    stop.sort_unstable();
    stop.dedup();
    stop
}

/// Generates after `prompt` and streams the decoded new text to `on_text`.
fn stream_text(
    opts: &SampleOptions,
    tok: &Tokenizer,
    prompt: &[u32],
    on_text: &mut dyn FnMut(&str),
    say: &mut dyn FnMut(&str),
) -> Result<String> {
    // Stream whole decoded text incrementally (tokens may split UTF-8 characters).
    let mut ids = Vec::new();
    let mut printed = String::new();
    let out = generate_tokens(
        opts,
        prompt,
        &mut |t| {
            ids.push(t);
            let text = tok.decode(&ids);
            if let Some(new) = text.strip_prefix(printed.as_str())
                && !new.ends_with('\u{FFFD}')
            {
                on_text(new);
                printed = text;
            }
        },
        say,
    )?;
    let text = tok.decode(&out);
    if let Some(rest) = text.strip_prefix(printed.as_str()) {
        on_text(rest);
    }
    Ok(text)
}

/// The checkpoint's tokenizer: its `tokenizer.json` when it has one, else GPT-2's for a
/// GPT-2 model.
fn checkpoint_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let spec = ckpt::load_spec(dir)?;
    model_tokenizer(&[dir], spec.family == Family::Gpt2)?.ok_or_else(|| {
        anyhow!(
            "checkpoint '{}' ({}) has no tokenizer.json: copy the model's tokenizer.json into it",
            dir.display(),
            spec.describe()
        )
    })
}

/// Index of the largest logit (the first on ties, as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn pick(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    probs: &mut [f32],
    order: &mut Vec<u32>,
    rng: &mut Rng,
) -> u32 {
    softmax_row(probs, logits, temperature);
    order.clear();
    order.extend(0..logits.len() as u32);
    if top_k > 0 && top_k < logits.len() {
        order.select_nth_unstable_by(top_k - 1, |&a, &b| {
            probs[b as usize].total_cmp(&probs[a as usize])
        });
        order.truncate(top_k);
        order.sort_unstable();
    }
    let total: f64 = order.iter().map(|&i| probs[i as usize] as f64).sum();
    let mut u = rng.next_f32() as f64 * total;
    for &i in order.iter() {
        u -= probs[i as usize] as f64;
        if u <= 0.0 {
            return i;
        }
    }
    *order.last().expect("non-empty vocabulary")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt longer than the context was once cut without a word.
    #[test]
    fn a_prompt_beyond_the_context_is_said() {
        assert_eq!(context_warning(10, 10, 64), None);
        let w = context_warning(100, 5, 64).unwrap();
        assert!(w.contains("first 36 tokens are not seen"), "{w}");
        let w = context_warning(60, 10, 64).unwrap();
        assert!(w.contains("after 4 new tokens"), "{w}");
    }
}
