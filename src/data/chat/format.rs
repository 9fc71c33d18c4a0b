//! The formats of a chat JSONL line, found from its keys, and their conversion to a
//! conversation of [`Message`]s (or raw text).
//!
//! | keys | format | becomes |
//! |---|---|---|
//! | `messages: [{role, content}, …]` (optional `system`) | OpenAI | the messages; roles `system`, `user`, `assistant`, `tool` |
//! | `conversations: [{from, value}, …]` (optional `system`) | ShareGPT | `human`/`user` → user, `gpt`/`assistant` → assistant, `system` → system, in any case; turns keyed `role`/`content` read too |
//! | `prompt`, `completion` (optional `system`) | prompt/completion | a user turn, then an assistant turn; TRL's conversational form (two lists of `{role, content}`) their turns in order |
//! | `instruction`, `output` (optional `input`, `system`) | Alpaca | see below |
//! | `text` | raw text | trained whole, no template |
//!
//! The keys are tried in that order; other keys (`id`, `source`, …) are ignored. A
//! prompt/completion pair is rendered with the chat template as one user and one assistant
//! turn (as the model will be asked at inference), not concatenated raw.
//!
//! **Alpaca convention**: the user turn is `instruction`, followed by `"\n\n"` and `input`
//! when `input` is present and not empty; the assistant turn is `output`. No "Below is an
//! instruction…" preamble is added: the chat template frames the turns.
//!
//! A top-level `system` becomes the first turn. A byte-order mark before a line is skipped.
//! A content given as a list of parts (`[{"type": "text", "text": …}]`) is its text parts
//! joined; `tool` turns (ShareGPT's `tool` or `observation`) are rendered as the template
//! renders them and never trained.
//!
//! Refused (the caller adds the file and line): JSON that does not parse or is not an object,
//! keys that fit no format, an empty conversation, a role that is none of the above, a content
//! that is not a string, a top-level `system` beside a system turn, a turn's `weight` (axolotl)
//! other than 1 (memwall trains every assistant turn). A conversation without an assistant turn parses; the encoder counts
//! it and trains nothing from it.

use anyhow::{Result, anyhow, bail};
use serde::Serialize;
use serde_json::{Map, Value};

/// Who speaks a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions before the conversation.
    System,
    /// The human's turn.
    User,
    /// The model's turn: what is trained with `--train-on answers`.
    Assistant,
    /// A tool's result, fed back to the model (rendered as the template renders `tool`
    /// turns; never trained).
    Tool,
}

impl Role {
    /// The role's name as chat templates read it (`message['role']`).
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One turn, as a chat template sees it: `{"role": …, "content": …}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: String,
}

impl Message {
    /// A turn of `role` saying `content`.
    pub fn new(role: Role, content: impl Into<String>) -> Message {
        Message {
            role,
            content: content.into(),
        }
    }
}

/// Which format a line was found to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// `{"messages": [{"role", "content"}, …]}`.
    Messages,
    /// `{"conversations": [{"from", "value"}, …]}`.
    ShareGpt,
    /// `{"prompt", "completion"}`.
    PromptCompletion,
    /// `{"instruction", "input", "output"}`.
    Alpaca,
    /// `{"text"}`.
    Text,
}

impl Format {
    /// The format's name as reports print it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Messages => "messages",
            Format::ShareGpt => "sharegpt",
            Format::PromptCompletion => "prompt/completion",
            Format::Alpaca => "alpaca",
            Format::Text => "text",
        }
    }
}

/// A parsed line: a conversation to render with the chat template, or raw text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// Turns, rendered with the chat template.
    Chat {
        /// The format the line was in.
        format: Format,
        /// The turns, in order (never empty).
        messages: Vec<Message>,
    },
    /// Raw text, tokenized as `prepare` tokenizes a document and trained whole.
    Text(String),
}

impl Record {
    /// The format the line was in.
    pub fn format(&self) -> Format {
        match self {
            Record::Chat { format, .. } => *format,
            Record::Text(_) => Format::Text,
        }
    }
}

/// What the formats expect, for the error on keys that fit none.
const EXPECTED: &str = "expected one of {\"messages\": [{\"role\", \"content\"}, …]}, \
     {\"conversations\": [{\"from\", \"value\"}, …]}, {\"prompt\", \"completion\"}, \
     {\"instruction\", \"input\", \"output\"} or {\"text\"}";

/// Parses one JSONL line (without its newline). Errors say what is wrong but not where: the
/// caller names the file and line.
pub fn parse_line(line: &str) -> Result<Record> {
    // A byte-order mark (a file saved by some editors) is not part of the JSON.
    let line = line.strip_prefix('\u{feff}').unwrap_or(line);
    let value: Value = serde_json::from_str(line).map_err(|e| anyhow!("not valid JSON ({e})"))?;
    let Value::Object(obj) = value else {
        bail!("the line is JSON but not an object; {EXPECTED}");
    };
    if let Some(v) = obj.get("messages") {
        let messages = turns(v, "messages", ("role", "content"), openai_role)?;
        return Ok(Record::Chat {
            format: Format::Messages,
            messages: with_system(&obj, messages, "messages")?,
        });
    }
    if let Some(v) = obj.get("conversations") {
        let messages = turns(v, "conversations", ("from", "value"), sharegpt_role)?;
        return Ok(Record::Chat {
            format: Format::ShareGpt,
            messages: with_system(&obj, messages, "conversations")?,
        });
    }
    // TRL's conversational prompt/completion: two lists of turns, the completion's trained.
    if let (Some(p @ Value::Array(_)), Some(c @ Value::Array(_))) =
        (obj.get("prompt"), obj.get("completion"))
    {
        let mut messages = turns(p, "prompt", ("role", "content"), openai_role)?;
        messages.extend(turns(c, "completion", ("role", "content"), openai_role)?);
        return Ok(Record::Chat {
            format: Format::PromptCompletion,
            messages: with_system(&obj, messages, "prompt")?,
        });
    }
    if obj.contains_key("prompt") && obj.contains_key("completion") {
        let mut messages = system(&obj)?;
        messages.push(Message::new(Role::User, string(&obj, "prompt")?));
        messages.push(Message::new(Role::Assistant, string(&obj, "completion")?));
        return Ok(Record::Chat {
            format: Format::PromptCompletion,
            messages,
        });
    }
    if obj.contains_key("instruction") && obj.contains_key("output") {
        let mut user = string(&obj, "instruction")?.to_owned();
        match obj.get("input") {
            None | Some(Value::Null) => {}
            Some(_) => {
                let input = string(&obj, "input")?;
                if !input.is_empty() {
                    user.push_str("\n\n");
                    user.push_str(input);
                }
            }
        }
        let mut messages = system(&obj)?;
        messages.push(Message::new(Role::User, user));
        messages.push(Message::new(Role::Assistant, string(&obj, "output")?));
        return Ok(Record::Chat {
            format: Format::Alpaca,
            messages,
        });
    }
    if obj.contains_key("text") {
        return Ok(Record::Text(string(&obj, "text")?.to_owned()));
    }
    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    bail!("keys {keys:?} fit no format; {EXPECTED}")
}

/// The string field `key` of `obj`.
fn string<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<&'a str> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => bail!("\"{key}\" is {}, not a string", kind(other)),
        None => bail!("\"{key}\" is missing"),
    }
}

/// A turn's content: a string, or a list of parts (`[{"type": "text", "text": …}, …]`, as
/// OpenAI and transformers' multimodal messages give it) of text only, joined: what the
/// templates that take parts render for text. Other part types (an image) are refused.
fn text_of(turn: &Map<String, Value>, key: &str) -> Result<String> {
    let Some(Value::Array(parts)) = turn.get(key) else {
        return Ok(string(turn, key)?.to_owned());
    };
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let Value::Object(p) = part else {
            bail!(
                "\"{key}\"[{j}] is {}, not a part ({{\"type\": \"text\", \"text\": …}})",
                kind(part)
            );
        };
        match p.get("type").and_then(Value::as_str) {
            Some("text") => {
                text.push_str(string(p, "text").map_err(|e| anyhow!("\"{key}\"[{j}]: {e}"))?)
            }
            other => bail!(
                "\"{key}\"[{j}] is a part of type {}: memwall trains on text; only \"text\" parts are read",
                other.map_or("(none)".to_string(), |t| format!("\"{t}\""))
            ),
        }
    }
    Ok(text)
}

/// The optional `system` turn of a prompt/completion or Alpaca line.
fn system(obj: &Map<String, Value>) -> Result<Vec<Message>> {
    Ok(match obj.get("system") {
        None | Some(Value::Null) => Vec::new(),
        Some(_) => vec![Message::new(Role::System, string(obj, "system")?)],
    })
}

/// `messages` after the line's top-level `system` field, if it has one (ShareGPT exports often
/// keep the system prompt there); a line with both that field and a system turn is refused.
fn with_system(
    obj: &Map<String, Value>,
    messages: Vec<Message>,
    field: &str,
) -> Result<Vec<Message>> {
    let mut all = system(obj)?;
    if all.is_empty() {
        return Ok(messages);
    }
    if messages.iter().any(|m| m.role == Role::System) {
        bail!("both a top-level \"system\" and a system turn in \"{field}\": keep one of them");
    }
    all.extend(messages);
    Ok(all)
}

/// A JSON value's kind, for errors.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn openai_role(r: &str) -> Option<Role> {
    match r {
        "system" => Some(Role::System),
        "user" => Some(Role::User),
        "assistant" => Some(Role::Assistant),
        "tool" => Some(Role::Tool),
        _ => None,
    }
}

fn sharegpt_role(r: &str) -> Option<Role> {
    match r.to_ascii_lowercase().as_str() {
        "system" => Some(Role::System),
        "human" | "user" => Some(Role::User),
        "gpt" | "assistant" => Some(Role::Assistant),
        "tool" | "observation" => Some(Role::Tool),
        _ => None,
    }
}

/// The turns of a `messages` or `conversations` list, each an object with a `who` and a
/// `what` string (or `role` and `content`, which some ShareGPT exports use). A turn's
/// `weight` (axolotl's) other than 1 is refused: memwall would train the turn regardless.
fn turns(
    list: &Value,
    field: &str,
    (who, what): (&str, &str),
    role_of: fn(&str) -> Option<Role>,
) -> Result<Vec<Message>> {
    let Value::Array(items) = list else {
        bail!("\"{field}\" is {}, not a list of turns", kind(list));
    };
    if items.is_empty() {
        bail!("\"{field}\" is an empty conversation");
    }
    let known = match field {
        "messages" => "system, user, assistant, tool",
        _ => "system, human (or user), gpt (or assistant), tool (or observation)",
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let Value::Object(turn) = item else {
                bail!("\"{field}\"[{i}] is {}, not an object", kind(item));
            };
            let (who, what) = if !turn.contains_key(who) && turn.contains_key("role") {
                ("role", "content")
            } else {
                (who, what)
            };
            if let Some(w) = turn.get("weight")
                && w.as_f64() != Some(1.0)
            {
                bail!(
                    "\"{field}\"[{i}]: a \"weight\" of {w} (axolotl's per-turn training \
                     switch) is not supported: every assistant turn is trained; drop the turns \
                     not to learn from, or the field"
                );
            }
            let name = string(turn, who).map_err(|e| anyhow!("\"{field}\"[{i}]: {e}"))?;
            let role = role_of(name).ok_or_else(|| {
                anyhow!("\"{field}\"[{i}]: unknown role \"{name}\" (known: {known})")
            })?;
            let content = text_of(turn, what).map_err(|e| anyhow!("\"{field}\"[{i}]: {e}"))?;
            Ok(Message::new(role, content))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(format: Format, turns: &[(Role, &str)]) -> Record {
        Record::Chat {
            format,
            messages: turns.iter().map(|&(r, c)| Message::new(r, c)).collect(),
        }
    }

    #[test]
    fn each_format_is_found_from_its_keys() {
        use Role::*;
        let cases = [
            (
                r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], "id": 7}"#,
                chat(
                    Format::Messages,
                    &[(System, "Be brief."), (User, "Hi"), (Assistant, "Hello!")],
                ),
            ),
            (
                r#"{"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}"#,
                chat(
                    Format::ShareGpt,
                    &[(System, "S"), (User, "Q"), (Assistant, "A")],
                ),
            ),
            (
                r#"{"prompt": "2+2?", "completion": "4"}"#,
                chat(
                    Format::PromptCompletion,
                    &[(User, "2+2?"), (Assistant, "4")],
                ),
            ),
            (
                r#"{"instruction": "Translate.", "input": "chat", "output": "cat", "system": "S"}"#,
                chat(
                    Format::Alpaca,
                    &[
                        (System, "S"),
                        (User, "Translate.\n\nchat"),
                        (Assistant, "cat"),
                    ],
                ),
            ),
            (
                r#"{"instruction": "Name a colour.", "input": "", "output": "Red"}"#,
                chat(
                    Format::Alpaca,
                    &[(User, "Name a colour."), (Assistant, "Red")],
                ),
            ),
            (
                r#"{"instruction": "Name a colour.", "output": "Red"}"#,
                chat(
                    Format::Alpaca,
                    &[(User, "Name a colour."), (Assistant, "Red")],
                ),
            ),
            (
                r#"{"text": "Once upon a time"}"#,
                Record::Text("Once upon a time".into()),
            ),
            // ShareGPT exports: a top-level system prompt, capitalised roles, role/content
            // keys, axolotl's weight of 1; a byte-order mark before the line.
            (
                "\u{feff}{\"system\": \"S\", \"conversations\": [{\"from\": \"Human\", \"value\": \"Q\"}, {\"role\": \"GPT\", \"content\": \"A\", \"weight\": 1}]}",
                chat(
                    Format::ShareGpt,
                    &[(System, "S"), (User, "Q"), (Assistant, "A")],
                ),
            ),
        ];
        for (line, want) in cases {
            assert_eq!(parse_line(line).unwrap(), want, "{line}");
        }
        // Tool turns; content as a list of text parts; TRL's conversational prompt/completion.
        let r = parse_line(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}, {"role": "assistant", "content": "Calling"}, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42"}]}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            chat(
                Format::Messages,
                &[
                    (User, "Hi there"),
                    (Assistant, "Calling"),
                    (Tool, "42"),
                    (Assistant, "It is 42")
                ]
            )
        );
        let r = parse_line(
            r#"{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": "A"}]}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            chat(
                Format::PromptCompletion,
                &[(System, "S"), (User, "Q"), (Assistant, "A")]
            )
        );
        // A conversation without an assistant turn parses (the encoder counts it).
        let r = parse_line(r#"{"messages": [{"role": "user", "content": "Hi"}]}"#).unwrap();
        assert_eq!(r, chat(Format::Messages, &[(User, "Hi")]));
    }

    #[test]
    fn bad_lines_are_refused_saying_why() {
        let cases = [
            (r#"{"messages": [{"role": "user""#, "not valid JSON"),
            ("[1, 2]", "not an object"),
            (r#"{"question": "q", "answer": "a"}"#, "fit no format"),
            (r#"{"messages": []}"#, "empty conversation"),
            (
                r#"{"messages": [{"role": "function", "content": "x"}]}"#,
                "unknown role \"function\"",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}"#,
                "\"content\"[0] is a part of type \"image\"",
            ),
            (
                r#"{"conversations": [{"from": "bot", "value": "x"}]}"#,
                "unknown role \"bot\"",
            ),
            (
                r#"{"messages": [{"role": "user", "content": null}]}"#,
                "\"messages\"[0]: \"content\" is null, not a string",
            ),
            (r#"{"messages": [{"content": "x"}]}"#, "\"role\" is missing"),
            (r#"{"messages": "hi"}"#, "not a list of turns"),
            (
                r#"{"prompt": 1, "completion": "a"}"#,
                "\"prompt\" is a number",
            ),
            (r#"{"text": ["a"]}"#, "\"text\" is a list"),
            (
                r#"{"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A", "weight": 0}]}"#,
                "\"conversations\"[1]: a \"weight\" of 0",
            ),
            (
                r#"{"system": "S", "messages": [{"role": "system", "content": "T"}, {"role": "user", "content": "Q"}]}"#,
                "both a top-level \"system\" and a system turn",
            ),
        ];
        for (line, want) in cases {
            let e = format!("{:#}", parse_line(line).unwrap_err());
            assert!(e.contains(want), "{line}: {e}");
        }
    }
}
