//! One example → `(ids, trained)`: a conversation rendered with the chat template and
//! tokenized once, or raw text tokenized as `prepare` tokenizes a document.
//!
//! **Which tokens are trained** (`--train-on answers`): the assistant turns, found by
//! rendering, the way TRL does, never by searching for marker strings. For each assistant turn
//! `i`, the conversation before it is rendered with `add_generation_prompt=true` (the prompt the
//! model will see at inference) and the conversation through it without; the assistant's span
//! is the text between, so it holds the answer and whatever the template writes after it up to
//! the next turn: its end-of-turn token (`<|im_end|>`, `<|eot_id|>`) and, for ChatML, the
//! newline after it (a template that ends every rendering without a generation prompt with the
//! end-of-sequence token, as Phi-3's, writes it after the last turn only: a turn followed by
//! more is taken without it). Each rendering must be a prefix of the whole conversation's, and each span
//! must contain its turn's content as written; a template that renders differently (one that
//! trims or rewrites the answer, or depends on what follows) is refused, as the mask would not
//! match the text. One dependence on what follows is taken: a header the template writes
//! before an answer only when it is the last turn (Qwen3's empty `<think>\n\n</think>\n\n`
//! block, dropped from answers before the last user turn) — such a turn is, in the whole
//! conversation, its answer as written and what follows it up to the next turn.
//!
//! The whole rendering is then tokenized once (as `apply_chat_template(tokenize=True)`:
//! special tokens parsed, nothing added), and spans are mapped to tokens as transformers maps
//! `{% generation %}` spans (`return_assistant_tokens_mask`): from the token holding the span's
//! first character to the token holding its last, by the tokenizer's offsets.
//!
//! `--train-on all` trains every token of a conversation. A conversation without an assistant
//! turn trains nothing and is reported as [`Outcome::NoAssistant`] for the caller to count.
//! Raw text (`{"text"}`) is the tokenizer's end-of-text token followed by the text's tokens
//! (special tokens not parsed), as `prepare` writes a document, all trained.

use super::format::{Format, Message, Record, Role, parse_line};
use super::template::{ChatTemplate, MISSING_HINT};
use crate::data::tokenizer::Tokenizer;
use anyhow::{Result, anyhow, bail};
use serde::Serialize;

/// Which tokens are trained (`--train-on`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TrainOn {
    /// The assistant turns, with their end-of-turn token.
    #[default]
    Answers,
    /// Every token.
    All,
}

impl std::str::FromStr for TrainOn {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<TrainOn> {
        match s {
            "answers" => Ok(TrainOn::Answers),
            "all" => Ok(TrainOn::All),
            _ => bail!("--train-on must be `answers` or `all`, not '{s}'"),
        }
    }
}

/// One encoded example.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Encoded {
    /// The text tokenized: the rendered conversation, or the raw text.
    pub text: String,
    /// The tokens.
    pub ids: Vec<u32>,
    /// 1 where the token is trained, else 0; as long as `ids`.
    pub trained: Vec<u8>,
    /// The format the line was in.
    #[serde(skip)]
    pub format: Format,
    /// The assistant spans of `text` as byte ranges (empty for raw text and `--train-on all`).
    #[serde(skip)]
    pub spans: Vec<(usize, usize)>,
    /// The byte ranges of `text` that the trained tokens cover, merged where adjacent (what
    /// `memwall tokenize` marks).
    #[serde(skip)]
    pub marked: Vec<(usize, usize)>,
}

/// What became of one line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// An example to train on.
    Example(Encoded),
    /// A conversation in this format without an assistant turn: nothing to train.
    NoAssistant(Format),
}

/// Turns lines into examples: a tokenizer, its chat template (if any) and `--train-on`.
pub struct Encoder {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    train_on: TrainOn,
}

impl Encoder {
    /// An encoder; `template` may be `None` for data of raw text only (a conversation is then
    /// refused, naming `--chat-template`).
    pub fn new(tokenizer: Tokenizer, template: Option<ChatTemplate>, train_on: TrainOn) -> Encoder {
        Encoder {
            tokenizer,
            template,
            train_on,
        }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template, if any.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Which tokens are trained.
    pub fn train_on(&self) -> TrainOn {
        self.train_on
    }

    /// One JSONL line (see [`super::format`]) → its outcome. Errors say what is wrong; the
    /// caller names the file and line.
    pub fn encode_line(&self, line: &str) -> Result<Outcome> {
        self.encode(&parse_line(line)?)
    }

    /// One parsed record → its outcome.
    pub fn encode(&self, record: &Record) -> Result<Outcome> {
        match record {
            Record::Text(text) => {
                let mut ids = vec![self.tokenizer.eot()];
                ids.extend(self.tokenizer.encode(text)?);
                Ok(Outcome::Example(Encoded {
                    text: text.clone(),
                    trained: vec![1; ids.len()],
                    ids,
                    format: Format::Text,
                    spans: Vec::new(),
                    marked: vec![(0, text.len())],
                }))
            }
            Record::Chat { format, messages } => {
                if !messages.iter().any(|m| m.role == Role::Assistant) {
                    return Ok(Outcome::NoAssistant(*format));
                }
                let Some(template) = &self.template else {
                    bail!(
                        "a conversation needs a chat template, and the tokenizer {} has none: \
                         {MISSING_HINT}",
                        self.tokenizer.id().name
                    );
                };
                let encoded = self.conversation(template, messages)?;
                Ok(Outcome::Example(Encoded {
                    format: *format,
                    ..encoded
                }))
            }
        }
    }

    fn conversation(&self, template: &ChatTemplate, messages: &[Message]) -> Result<Encoded> {
        let text = template.render(messages, false)?;
        let (ids, offsets) = self.tokenizer.encode_rendered(&text)?;
        let (trained, spans) = match self.train_on {
            TrainOn::All => (vec![1; ids.len()], Vec::new()),
            TrainOn::Answers => {
                let spans = assistant_spans(template, messages, &text)?;
                (mask(&text, &offsets, &spans)?, spans)
            }
        };
        let marked = marked(&offsets, &trained);
        Ok(Encoded {
            text,
            ids,
            trained,
            format: Format::Messages,
            spans,
            marked,
        })
    }
}

/// The byte ranges of `full` (the whole conversation rendered) that are the assistant turns,
/// found by rendering prefixes (see the module docs).
pub fn assistant_spans(
    template: &ChatTemplate,
    messages: &[Message],
    full: &str,
) -> Result<Vec<(usize, usize)>> {
    let mut spans = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role != Role::Assistant {
            continue;
        }
        let turn = i + 1;
        let prompt = template.render(&messages[..i], true)?;
        let mut through = template.render(&messages[..=i], false)?;
        // Templates that close a conversation with the end-of-sequence token when no
        // generation prompt follows (Phi-3's) write it after the last turn only: a turn
        // followed by more is the same rendering without it.
        if !full.starts_with(&through)
            && let Some(eos) = template
                .specials()
                .get("eos_token")
                .filter(|e| !e.is_empty())
            && let Some(open) = through.strip_suffix(eos.as_str())
            && full.starts_with(open)
        {
            through.truncate(open.len());
        }
        // Before any user turn: templates that add a default system turn (SmolLM2's, Qwen's)
        // render such a prefix differently; the order is the likelier fault.
        let first = messages.iter().position(|m| m.role != Role::System);
        let hint = if first == Some(i) {
            " (this conversation opens with an assistant turn, before any user turn: most \
             templates expect the user to speak first; drop or reorder that turn)"
        } else {
            ""
        };
        let unstable = |what: &str| {
            anyhow!(
                "the chat template is not prefix-stable: {what} (turn {turn}, an assistant \
                 turn){hint}; memwall finds the trained tokens by rendering the conversation turn \
                 by turn, so it cannot mask this template: pass --chat-template FILE with one \
                 that renders each turn the same whatever follows, or --train-on all"
            )
        };
        if !through.starts_with(&prompt) {
            return Err(unstable(
                "the conversation up to this turn, with the generation prompt, is not the start \
                 of the conversation through it",
            ));
        }
        let span = &through[prompt.len()..];
        let Some(at) = span.find(m.content.as_str()) else {
            bail!(
                "the chat template renders assistant turn {turn} differently from its content \
                 (it renders {span:?} for the content {:?}): the trained tokens would not be the \
                 answer as written; fix the data (for example, whitespace the template trims) \
                 or pass --chat-template FILE",
                m.content
            );
        };
        let mut end = through.len();
        if !full.starts_with(&through) {
            // Templates that write a header before the answer only when it is the last turn
            // (Qwen3's empty thinking block `<think>\n\n</think>\n\n`, which its template
            // writes after the last user turn and drops before: Qwen3-0.6B's
            // tokenizer_config.json, llama.cpp's models/templates/Qwen-Qwen3-0.6B.jinja): in
            // the whole conversation the turn is the answer as written and what follows it up
            // to the next turn (`<|im_end|>\n`), taken where the whole rendering has it.
            let answer_on = &span[at..];
            if !full[prompt.len()..].starts_with(answer_on) {
                return Err(if full[prompt.len()..].starts_with(m.content.as_str()) {
                    unstable(
                        "the conversation through this turn is not the start of the whole \
                         conversation",
                    )
                } else {
                    anyhow!(
                        "the chat template renders assistant turn {turn} differently from its \
                         content when more turns follow (the content {:?} is not where the \
                         turn starts in the whole conversation): the trained tokens would not \
                         be the answer as written; fix the data (for example, reasoning the \
                         template drops from earlier answers) or pass --chat-template FILE",
                        m.content
                    )
                });
            }
            end = prompt.len() + answer_on.len();
        }
        if end > prompt.len() {
            spans.push((prompt.len(), end));
        }
    }
    Ok(spans)
}

/// The byte ranges covered by the trained tokens, adjacent ones merged.
fn marked(offsets: &[(usize, usize)], trained: &[u8]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (&(s, e), &t) in offsets.iter().zip(trained) {
        if t == 0 || s >= e {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.1 >= s => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// 1 for the tokens that `spans` (byte ranges of `text`) cover, as transformers maps a
/// `{% generation %}` span: from the token holding its first character to the token holding
/// its last (`Encoding::char_to_token`: the first token whose offsets contain the position).
pub fn mask(text: &str, offsets: &[(usize, usize)], spans: &[(usize, usize)]) -> Result<Vec<u8>> {
    let token_at = |pos: usize| offsets.iter().position(|&(s, e)| s <= pos && pos < e);
    let mut trained = vec![0u8; offsets.len()];
    for &(start, end) in spans {
        let last = text[..end]
            .char_indices()
            .next_back()
            .map_or(start, |(i, _)| i);
        let (Some(first), Some(last)) = (token_at(start), token_at(last)) else {
            bail!(
                "the tokenizer's offsets cover no token at byte {start} or {last} of the rendered \
                 conversation, so its trained span cannot be mapped to tokens"
            );
        };
        for t in &mut trained[first..=last.max(first)] {
            *t = 1;
        }
    }
    Ok(trained)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn mask_takes_the_tokens_holding_the_first_and_last_character() {
        // "ab|cd|é|f": é is two bytes.
        let text = "abcdéf";
        let offsets = [(0, 2), (2, 4), (4, 6), (6, 7)];
        assert_eq!(mask(text, &offsets, &[(2, 7)]).unwrap(), [0, 1, 1, 1]);
        assert_eq!(mask(text, &offsets, &[(3, 6)]).unwrap(), [0, 1, 1, 0]);
        assert_eq!(
            mask(text, &offsets, &[(0, 1), (6, 7)]).unwrap(),
            [1, 0, 0, 1]
        );
        assert!(mask(text, &[(0, 2)], &[(3, 4)]).is_err());
    }

    #[test]
    fn spans_hold_the_answer_and_its_end_of_turn() {
        let chatml = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::new(chatml.into(), "chatml".into(), BTreeMap::new()).unwrap();
        let m = [
            Message::new(Role::User, "Hi"),
            Message::new(Role::Assistant, "Hello"),
            Message::new(Role::User, "Bye"),
            Message::new(Role::Assistant, ""),
        ];
        let full = t.render(&m, false).unwrap();
        let spans = assistant_spans(&t, &m, &full).unwrap();
        let texts: Vec<&str> = spans.iter().map(|&(s, e)| &full[s..e]).collect();
        assert_eq!(texts, ["Hello<|im_end|>\n", "<|im_end|>\n"]);
    }

    /// Phi-3's template ends a rendering without a generation prompt with the EOS token:
    /// an answer followed by more turns is taken without it, the last one with it.
    #[test]
    fn a_closing_eos_belongs_to_the_last_turn() {
        let phi3 = "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}";
        let specials = BTreeMap::from([("eos_token".to_string(), "<|endoftext|>".to_string())]);
        let t = ChatTemplate::new(phi3.into(), "phi3".into(), specials).unwrap();
        let m = [
            Message::new(Role::User, "Hi"),
            Message::new(Role::Assistant, "Hello"),
            Message::new(Role::User, "Bye"),
            Message::new(Role::Assistant, "Later"),
        ];
        let full = t.render(&m, false).unwrap();
        let spans = assistant_spans(&t, &m, &full).unwrap();
        let texts: Vec<&str> = spans.iter().map(|&(s, e)| &full[s..e]).collect();
        assert_eq!(texts, ["Hello<|end|>\n", "Later<|end|>\n<|endoftext|>"]);
    }
}
