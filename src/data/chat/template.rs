//! A model's chat template, loaded as transformers loads it and rendered by a real Jinja
//! engine (`minijinja`) configured as transformers configures Jinja2, so that a template is
//! never re-implemented by hand.
//!
//! **Where the template comes from** ([`ChatTemplate::load`]), as `AutoTokenizer` finds it:
//! `--chat-template FILE` if given; else `chat_template.jinja` beside the `tokenizer.json`
//! (which transformers prefers); else `chat_template` of `tokenizer_config.json`, a string or
//! a list of `{"name", "template"}` of which `default` is used. `memwall convert` of a GGUF
//! writes the file's `tokenizer.chat_template` there, so a converted directory has one.
//!
//! **How it is rendered** ([`ChatTemplate::render`]), as `apply_chat_template` renders:
//! `trim_blocks` and `lstrip_blocks`, no trailing newline kept, loop controls
//! (`break`/`continue`); variables `messages` (`[{"role", "content"}]`),
//! `add_generation_prompt`, `tools` and `documents` (none), and the special tokens named in
//! `tokenizer_config.json` (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
//! `cls_token`, `mask_token`: strings or `{"content"}` objects); functions
//! `raise_exception(msg)` (rendering fails with `msg`) and `strftime_now(fmt)` (the time in
//! UTC where transformers uses local time: see [`super::pyfmt`]); the `tojson` filter as
//! transformers overrides it (Python's `json.dumps`, not HTML-escaped); Python's string and
//! dict methods (`.strip()`, `.startswith()`, `.items()`, …) through `minijinja-contrib`'s
//! `pycompat`. Undefined values are lenient as in Jinja2: printed as nothing, false in tests,
//! an error when an attribute of one is read.
//!
//! `{% generation %}` … `{% endgeneration %}` (transformers' own tag, which marks the assistant
//! text for `return_assistant_tokens_mask`) renders its body unchanged, as transformers renders
//! it: the tags are read as `{% if true %}` … `{% endif %}` with the same whitespace control
//! ([`without_generation_tags`]). memwall finds the assistant spans by rendering prefixes
//! whatever the tags say (see [`super::encode`]). Any Jinja feature `minijinja` lacks fails at
//! load, naming the template's origin.

use super::format::Message;
use super::pyfmt;
use anyhow::{Context, Result, anyhow, bail};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

/// `source` with transformers' `{% generation %}` and `{% endgeneration %}` tags read as
/// `{% if true %}` and `{% endif %}`, their `-` whitespace controls kept: a block that renders
/// its body unchanged, as transformers' extension does.
pub fn without_generation_tags(source: &str) -> String {
    static TAG: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"\{%(-|\+)?\s*(end)?generation\s*(-|\+)?%\}").expect("a valid regex")
    });
    TAG.replace_all(source, |c: &regex::Captures| {
        let (open, close) = (
            c.get(1).map_or("", |m| m.as_str()),
            c.get(3).map_or("", |m| m.as_str()),
        );
        let tag = if c.get(2).is_some() {
            "endif"
        } else {
            "if true"
        };
        format!("{{%{open} {tag} {close}%}}")
    })
    .into_owned()
}

/// The special-token fields of `tokenizer_config.json` passed to templates, as transformers'
/// `SPECIAL_TOKENS_ATTRIBUTES`.
pub const SPECIAL_TOKEN_FIELDS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The start of a `raise_exception` error's detail, so it is told from engine errors.
const RAISED: &str = "raise_exception: ";

/// A loaded chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: String,
    specials: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChatTemplate({})", self.origin)
    }
}

/// What `--chat-template` is for, named where a template is missing.
pub const MISSING_HINT: &str = "pass --chat-template FILE (a Jinja chat template, such as the \
     model's chat_template.jinja) or use a tokenizer directory whose tokenizer_config.json has a \
     chat_template";

impl ChatTemplate {
    /// The template for the tokenizer whose files are in `dir` (see the module docs for the
    /// order), or from `file` when given (`--chat-template`). `Ok(None)` when `dir` has none
    /// (or is `None`: GPT-2's built-in tokenizer) and no `file` is given.
    pub fn load(dir: Option<&Path>, file: Option<&Path>) -> Result<Option<ChatTemplate>> {
        let config = match dir {
            Some(d) => read_config(&d.join("tokenizer_config.json"))?,
            None => None,
        };
        let specials = match &config {
            Some((path, v)) => special_tokens(path, v)?,
            None => BTreeMap::new(),
        };
        if let Some(f) = file {
            let source = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read chat template file '{}'", f.display()))?;
            // A tokenizer_config.json (or any JSON object) given as the template: its
            // chat_template, as when it is found in the model's directory.
            let json = serde_json::from_str::<Json>(&source)
                .ok()
                .filter(|v| v.is_object());
            let Some(v) = json else {
                return ChatTemplate::new(source, f.display().to_string(), specials).map(Some);
            };
            let specials = match specials.is_empty() {
                true => special_tokens(f, &v)?,
                false => specials,
            };
            return match Self::from_config(f, &v, specials)? {
                Some(t) => Ok(Some(t)),
                None => bail!(
                    "--chat-template '{}': a JSON file without a chat_template; give a Jinja \
                     template file (chat_template.jinja) or a tokenizer_config.json that has one",
                    f.display()
                ),
            };
        }
        let Some(dir) = dir else { return Ok(None) };
        let jinja = dir.join(crate::ckpt::CHAT_TEMPLATE_FILE);
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja)
                .with_context(|| format!("cannot read '{}'", jinja.display()))?;
            return ChatTemplate::new(source, jinja.display().to_string(), specials).map(Some);
        }
        let Some((path, v)) = config else {
            return Ok(None);
        };
        Self::from_config(&path, &v, specials)
    }

    /// The `chat_template` of a `tokenizer_config.json`'s content `v` read from `path`
    /// (`None` when it has none).
    fn from_config(
        path: &Path,
        v: &Json,
        specials: BTreeMap<String, String>,
    ) -> Result<Option<ChatTemplate>> {
        let origin = format!("{} (chat_template)", path.display());
        let source = match v.get("chat_template") {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(list)) => named_default(path, list)?,
            Some(other) => bail!(
                "'{}': chat_template is {other}; expected a string or a list of \
                 {{\"name\", \"template\"}}",
                path.display()
            ),
        };
        ChatTemplate::new(source, origin, specials).map(Some)
    }

    /// A template from its Jinja `source`; `origin` names it in errors; `specials` are the
    /// special-token variables (`bos_token` → `<s>`, …).
    pub fn new(
        source: String,
        origin: String,
        specials: BTreeMap<String, String>,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED}{msg}"),
            ))
        });
        env.add_function("strftime_now", |fmt: String| -> Result<Value, Error> {
            Ok(Value::from(pyfmt::strftime_now(&fmt)))
        });
        env.add_filter("tojson", pyfmt::tojson);
        env.add_template_owned("chat_template", without_generation_tags(&source))
            .map_err(|e| {
                anyhow!("chat template {origin} is not a template memwall can read: {e:#}")
            })?;
        Ok(ChatTemplate {
            env,
            source,
            origin,
            specials,
        })
    }

    /// Renders `messages` as `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=…)` does. A template's `raise_exception(msg)` is an error whose
    /// message says "the chat template raised: msg".
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        for (k, v) in &self.specials {
            ctx.insert(k, Value::from(v.as_str()));
        }
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        let tmpl = self
            .env
            .get_template("chat_template")
            .map_err(|e| anyhow!("chat template {}: {e}", self.origin))?;
        tmpl.render(ctx).map_err(|e| match e.detail() {
            Some(d) if e.kind() == ErrorKind::InvalidOperation && d.starts_with(RAISED) => {
                anyhow!("the chat template raised: {}", &d[RAISED.len()..])
            }
            _ => anyhow!(
                "the chat template ({}) failed to render: {e:#}",
                self.origin
            ),
        })
    }

    /// Where the template came from (a file, or `tokenizer_config.json (chat_template)`).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Hex SHA-256 of the template's source (what a data set's metadata can record).
    pub fn hash(&self) -> String {
        Sha256::digest(self.source.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The special-token variables the template sees.
    pub fn specials(&self) -> &BTreeMap<String, String> {
        &self.specials
    }
}

/// `tokenizer_config.json` as JSON, `None` when it does not exist.
fn read_config(path: &Path) -> Result<Option<(std::path::PathBuf, Json)>> {
    if !path.is_file() {
        return Ok(None);
    }
    let p = path.display();
    let raw = std::fs::read(path).with_context(|| format!("cannot read '{p}'"))?;
    let v = serde_json::from_slice(&raw)
        .with_context(|| format!("'{p}' is not valid JSON: it is corrupt; copy it again"))?;
    Ok(Some((path.to_path_buf(), v)))
}

/// The special tokens of `tokenizer_config.json` that are set (strings, or objects with a
/// string `content`).
fn special_tokens(path: &Path, v: &Json) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for field in SPECIAL_TOKEN_FIELDS {
        let token = match v.get(field) {
            None | Some(Json::Null) => continue,
            Some(Json::String(s)) => s.clone(),
            Some(Json::Object(o)) => match o.get("content") {
                Some(Json::String(s)) => s.clone(),
                _ => bail!("'{}': {field} has no string \"content\"", path.display()),
            },
            Some(other) => bail!(
                "'{}': {field} is {other}; expected a token string or {{\"content\": …}}",
                path.display()
            ),
        };
        out.insert(field.to_owned(), token);
    }
    Ok(out)
}

/// The template named `default` of a list of `{"name", "template"}`.
fn named_default(path: &Path, list: &[Json]) -> Result<String> {
    let mut names = Vec::new();
    for item in list {
        let name = item.get("name").and_then(Json::as_str);
        let template = item.get("template").and_then(Json::as_str);
        match (name, template) {
            (Some("default"), Some(t)) => return Ok(t.to_owned()),
            (Some(n), Some(_)) => names.push(n.to_owned()),
            _ => bail!(
                "'{}': chat_template lists an entry that is not {{\"name\", \"template\"}}",
                path.display()
            ),
        }
    }
    bail!(
        "'{}': chat_template lists templates {names:?} but none named \"default\"; save the \
         one you want as a file and pass --chat-template FILE",
        path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::super::format::Role;
    use super::*;

    fn t(source: &str) -> ChatTemplate {
        let specials = BTreeMap::from([
            ("bos_token".to_owned(), "<s>".to_owned()),
            ("eos_token".to_owned(), "</s>".to_owned()),
        ]);
        ChatTemplate::new(source.into(), "test".into(), specials).unwrap()
    }

    fn msgs() -> Vec<Message> {
        vec![
            Message::new(Role::User, "  Hi  "),
            Message::new(Role::Assistant, "Hello"),
        ]
    }

    #[test]
    fn renders_as_transformers_configures_jinja() {
        // trim_blocks and lstrip_blocks: the block lines leave nothing behind.
        let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m['content'].strip() }}]\n    {% else %}\n{{ m.content + eos_token }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}>{% endif %}\n";
        let tm = t(src);
        assert_eq!(tm.render(&msgs(), false).unwrap(), "<s>\n[Hi]\nHello</s>\n");
        assert_eq!(tm.render(&msgs(), true).unwrap(), "<s>\n[Hi]\nHello</s>\n>");
        // Python string methods, namespaces, loop controls, undefined fields and `tools`.
        let src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role.startswith('ass') %}{% set ns.n = ns.n + 1 %}{% continue %}{% endif %}{{ m.content|trim|upper }}{% endfor %}{{ ns.n }}{% if messages[0].tool_calls %}T{% endif %}{% if tools is none %}-{% endif %}";
        assert_eq!(t(src).render(&msgs(), false).unwrap(), "HI1-");
        // tojson as Python's json.dumps (not HTML-escaped), keys in order.
        let src = "{{ messages[0] | tojson }}|{{ {'b': [1, 2.5, none, true], 'a': '<é>'} | tojson(indent=2) }}";
        assert_eq!(
            t(src).render(&msgs(), false).unwrap(),
            "{\"role\": \"user\", \"content\": \"  Hi  \"}|{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": \"<é>\"\n}"
        );
        assert_eq!(tm.hash().len(), 64);
    }

    /// `{% generation %}` blocks render their body, whitespace controls included.
    #[test]
    fn generation_blocks_render_their_body() {
        let with = "{% for m in messages %}{% if m.role == 'assistant' %}<a>\n  {%- generation -%}\n  {{ m.content }}\n  {%- endgeneration %}</a>{% else %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}{% endfor %}";
        let without = "{% for m in messages %}{% if m.role == 'assistant' %}<a>{{ m.content }}</a>{% else %}{{ m.content }}{% endif %}{% endfor %}";
        assert_eq!(
            t(with).render(&msgs(), false).unwrap(),
            t(without).render(&msgs(), false).unwrap()
        );
        assert_eq!(
            without_generation_tags("{%- generation %}x{% endgeneration -%}"),
            "{%- if true %}x{% endif -%}"
        );
        // The hash is the template's own text.
        assert_ne!(t(with).hash(), t(without).hash());
    }

    #[test]
    fn raise_exception_fails_with_its_message() {
        let src = "{% if messages[0].role != 'system' %}{{ raise_exception('Conversations must start with a system turn') }}{% endif %}";
        let e = format!("{:#}", t(src).render(&msgs(), false).unwrap_err());
        assert_eq!(
            e,
            "the chat template raised: Conversations must start with a system turn"
        );
        let e = format!(
            "{:#}",
            t("{{ messages[5].content }}")
                .render(&msgs(), false)
                .unwrap_err()
        );
        assert!(e.contains("failed to render") && e.contains("test"), "{e}");
        let e = ChatTemplate::new("{% for %}".into(), "bad.jinja".into(), BTreeMap::new());
        let e = format!("{:#}", e.unwrap_err());
        assert!(e.contains("bad.jinja") && e.contains("syntax"), "{e}");
    }

    #[test]
    fn found_where_transformers_finds_it() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        assert!(ChatTemplate::load(Some(d), None).unwrap().is_none());
        assert!(ChatTemplate::load(None, None).unwrap().is_none());
        let cfg = d.join("tokenizer_config.json");
        std::fs::write(
            &cfg,
            r#"{"eos_token": {"content": "</s>"}, "bos_token": null}"#,
        )
        .unwrap();
        assert!(ChatTemplate::load(Some(d), None).unwrap().is_none());
        std::fs::write(
            &cfg,
            r#"{"eos_token": {"content": "</s>"}, "chat_template": "A{{ eos_token }}{{ bos_token }}"}"#,
        )
        .unwrap();
        let tm = ChatTemplate::load(Some(d), None).unwrap().unwrap();
        assert_eq!(tm.render(&[], false).unwrap(), "A</s>");
        assert!(
            tm.origin()
                .ends_with("tokenizer_config.json (chat_template)")
        );
        std::fs::write(
            &cfg,
            r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        let tm = ChatTemplate::load(Some(d), None).unwrap().unwrap();
        assert_eq!(tm.render(&[], false).unwrap(), "D");
        std::fs::write(
            &cfg,
            r#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#,
        )
        .unwrap();
        let e = format!("{:#}", ChatTemplate::load(Some(d), None).unwrap_err());
        assert!(
            e.contains("tool_use") && e.contains("--chat-template"),
            "{e}"
        );
        // chat_template.jinja beside it wins, and --chat-template over both.
        std::fs::write(d.join("chat_template.jinja"), "J\n").unwrap();
        let tm = ChatTemplate::load(Some(d), None).unwrap().unwrap();
        assert_eq!(tm.render(&[], false).unwrap(), "J");
        let own = d.join("own.jinja");
        std::fs::write(&own, "O").unwrap();
        let tm = ChatTemplate::load(Some(d), Some(&own)).unwrap().unwrap();
        assert_eq!(tm.render(&[], false).unwrap(), "O");
        let tm = ChatTemplate::load(None, Some(&own)).unwrap().unwrap();
        assert_eq!(tm.render(&[], false).unwrap(), "O");
        // A tokenizer_config.json given as --chat-template is read as one (its
        // chat_template and special tokens), never rendered as the template's text.
        let given = d.join("given_config.json");
        std::fs::write(
            &given,
            r#"{"eos_token": "<e>", "chat_template": "G{{ eos_token }}"}"#,
        )
        .unwrap();
        let tm = ChatTemplate::load(None, Some(&given)).unwrap().unwrap();
        assert_eq!(tm.render(&[], false).unwrap(), "G<e>");
        std::fs::write(&given, r#"{"eos_token": "<e>"}"#).unwrap();
        let e = format!("{:#}", ChatTemplate::load(None, Some(&given)).unwrap_err());
        assert!(
            e.contains("given_config.json") && e.contains("without a chat_template"),
            "{e}"
        );
        std::fs::write(&cfg, "{oops").unwrap();
        let e = format!("{:#}", ChatTemplate::load(Some(d), None).unwrap_err());
        assert!(
            e.contains("tokenizer_config.json") && e.contains("not valid JSON"),
            "{e}"
        );
    }
}
