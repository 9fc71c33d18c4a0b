//! Python behaviours chat templates rely on, as transformers supplies them to Jinja:
//! [`tojson`] (transformers' override of the filter: `json.dumps` with `ensure_ascii=False`,
//! not HTML-escaped, keys in insertion order) and [`strftime_now`] (`datetime.now()
//! .strftime(fmt)`, here in UTC: templates use it for a "today is" line).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// The `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, each of those a keyword argument as in transformers.
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([i, k]) => (i.clone(), k.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ));
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = Style {
        indent,
        item,
        key,
        ascii: ensure_ascii.unwrap_or(false),
        sort: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(value, 0, &mut out)?;
    Ok(out)
}

struct Style {
    indent: Option<usize>,
    item: String,
    key: String,
    ascii: bool,
    sort: bool,
}

impl Style {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    }

    fn write(&self, v: &Value, level: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&number(v)),
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.open_close('[', ']', items.len(), level, out, |i, out| {
                    self.write(&items[i], level + 1, out)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort {
                    keys.sort_by_key(|k| k.to_string());
                }
                self.open_close('{', '}', keys.len(), level, out, |i, out| {
                    let k = &keys[i];
                    self.string(k.as_str().unwrap_or(&k.to_string()), out);
                    out.push_str(&self.key);
                    self.write(&v.get_item(k)?, level + 1, out)
                })?;
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {} is not JSON serializable", v.kind()),
                ));
            }
        }
        Ok(())
    }

    fn open_close(
        &self,
        open: char,
        close: char,
        n: usize,
        level: usize,
        out: &mut String,
        mut each: impl FnMut(usize, &mut String) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        for i in 0..n {
            if i > 0 {
                out.push_str(&self.item);
            }
            self.newline(level + 1, out);
            each(i, out)?;
        }
        if n > 0 {
            self.newline(level, out);
        }
        out.push(close);
        Ok(())
    }

    /// A JSON string as Python writes it.
    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A number as Python's `json.dumps` writes it (`2`, `2.0`, `2.5`, `1e+20`, `NaN`).
fn number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else if f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        let s = format!("{f:?}");
        // Rust writes `1e20` where Python writes `1e+20`.
        match s.split_once('e') {
            Some((m, e)) if !e.starts_with('-') => format!("{m}e+{e}"),
            _ => s,
        }
    }
}

/// `strftime_now(fmt)`: the current UTC time formatted with Python's `%` directives `%Y %y %m
/// %d %H %M %S %b %B %a %A %j %p %I %%`; any other directive is kept as written.
pub fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(secs, fmt)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// [`strftime_now`] at `secs` after the Unix epoch.
fn strftime(secs: u64, fmt: &str) -> String {
    let (y, m, d, hh, mm, ss) = crate::util::clock::civil(secs);
    let days = secs / 86_400;
    let weekday = ((days + 3) % 7) as usize; // 1970-01-01 was a Thursday.
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let before: [u64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[m as usize - 1] + d + u64::from(leap && m > 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(k) = chars.next() else {
            out.push('%');
            break;
        };
        let month = MONTHS[m as usize - 1];
        match k {
            'Y' => out.push_str(&y.to_string()),
            'y' => out.push_str(&format!("{:02}", y % 100)),
            'm' => out.push_str(&format!("{m:02}")),
            'd' => out.push_str(&format!("{d:02}")),
            'H' => out.push_str(&format!("{hh:02}")),
            'I' => out.push_str(&format!("{:02}", (hh + 11) % 12 + 1)),
            'p' => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            'M' => out.push_str(&format!("{mm:02}")),
            'S' => out.push_str(&format!("{ss:02}")),
            'j' => out.push_str(&format!("{yday:03}")),
            'b' => out.push_str(&month[..3]),
            'B' => out.push_str(month),
            'a' => out.push_str(&DAYS[weekday][..3]),
            'A' => out.push_str(DAYS[weekday]),
            '%' => out.push('%'),
            other => {
                out.push('%');
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_as_python() {
        // datetime(2024, 7, 26, 13, 5, 9, tzinfo=utc).timestamp() == 1722000309
        let t = 1_721_999_109;
        assert_eq!(strftime(t, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            strftime(t, "%A %a %B %y-%m-%d %H:%M:%S %I%p %j %% %Q"),
            "Friday Fri July 24-07-26 13:05:09 01PM 208 % %Q"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %A"), "1970-01-01 Thursday");
        assert_eq!(strftime_now("%Y").len(), 4);
    }

    #[test]
    fn numbers_as_python() {
        let cases = [
            (Value::from(2), "2"),
            (Value::from(2.0), "2.0"),
            (Value::from(2.5), "2.5"),
            (Value::from(1e20), "1e+20"),
            (Value::from(1e-7), "1e-7"),
            (Value::from(-0.1), "-0.1"),
        ];
        for (v, want) in cases {
            assert_eq!(number(&v), want);
        }
    }
}
