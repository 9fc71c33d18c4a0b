//! Chat and instruction data: JSONL conversations → tokens and a trained-token mask, rendered
//! with the model's own chat template as Hugging Face renders it.
//!
//! * [`read`]: a `.jsonl` / `.jsonl.gz` file or a folder of them, streamed line by line, each
//!   line with its [`Place`] (file:line).
//! * [`format`](mod@format): a line's format from its keys (OpenAI `messages`, ShareGPT
//!   `conversations`, `prompt`/`completion`, Alpaca, raw `text`) → a [`Record`].
//! * [`template`]: the chat template, found and rendered as transformers finds and renders it
//!   (`minijinja`, `trim_blocks`/`lstrip_blocks`, `raise_exception`, special tokens, Python
//!   string methods); [`pyfmt`]: the Python behaviours it lends templates (`tojson`,
//!   `strftime_now`).
//! * [`encode`]: a record → `(ids, trained)`: the assistant spans found by rendering prefixes
//!   (as TRL), the rendering tokenized once, spans mapped to tokens by offsets.
//! * [`prepare`](mod@prepare): `memwall prepare chats.jsonl`: every line encoded, written as
//!   an examples data set ([`crate::data::examples`]) split by whole examples.
//! * [`show`]: `memwall tokenize --chat`: examples printed with their trained tokens marked,
//!   or as JSON lines.
//!
//! Flow: `Encoder::new(tokenizer, ChatTemplate::load(dir, file)?, TrainOn::Answers)`, then for
//! each line of `read::for_each_line(path, …)`, `encoder.encode_line(line)` (errors prefixed
//! with the line's place by the caller).
//!
//! **Invariant:** a chat template is rendered, never re-implemented, and the trained tokens
//! are found by rendering, never by searching for marker strings; a template whose renderings
//! are not prefixes of one another (but for a header written before a last answer only, as
//! Qwen3's thinking block: see [`encode`]), or that renders an answer differently from its
//! content, is refused. `tests/chat.rs` compares token for token with transformers on the
//! SmolLM2, Llama 3, Qwen2.5 and Qwen3 templates (fixtures made by
//! `tests/fixtures/chat/make_chat_fixtures.py`).

pub mod encode;
pub mod format;
pub mod prepare;
pub mod pyfmt;
pub mod read;
pub mod show;
pub mod template;

pub use encode::{Encoded, Encoder, Outcome, TrainOn};
pub use format::{Format, Message, Record, Role, parse_line};
pub use prepare::{ChatPrepareOptions, ChatPrepareSummary, is_chat_input, prepare_chat};
pub use read::{Place, chat_files, for_each_line};
pub use template::ChatTemplate;
