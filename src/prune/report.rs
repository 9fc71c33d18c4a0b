//! What `prune` prints: the shape before and after, how much of each kind's importance the
//! kept part holds, the fit's figures, and (`--report`) every layer's scores.

use super::{Pruned, Shape};
use crate::util::bytes::fmt_bytes;
use std::fmt::Write;

/// A parameter count: `99.7M`, or `37.2K` under a million.
fn millions(n: usize) -> String {
    match n {
        0..1_000_000 => format!("{:.1}K", n as f64 / 1e3),
        _ => format!("{:.1}M", n as f64 / 1e6),
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// One shape as flags would give it.
pub fn describe(s: &Shape) -> String {
    format!(
        "hidden {}, heads {} (kv {}), mlp {}, layers {}",
        s.hidden, s.heads, s.kv_heads, s.mlp, s.layers
    )
}

/// The lines every run prints.
pub fn summary(p: &Pruned) -> String {
    let mut o = String::new();
    let (b, a) = (&p.before, &p.after);
    let _ = writeln!(
        o,
        "pruned {} parameters to {} ({} kept)",
        millions(p.params_before),
        millions(p.params_after),
        pct(p.params_after as f64 / p.params_before as f64)
    );
    let _ = writeln!(o, "  before: {}", describe(b));
    let _ = writeln!(o, "  after:  {}", describe(a));
    if !p.candidates.is_empty() {
        let _ = writeln!(
            o,
            "  candidates (embedding and MLP widths the budget allows; the lowest loss on {} \
             held-out calibration sequences kept):",
            super::select::SEQUENCES
        );
        for c in &p.candidates {
            let _ = writeln!(
                o,
                "    {} hidden {:>5}, mlp {:>6}: {:>7} parameters, loss {:.4} ({} held)",
                if c.shape == *a { "*" } else { " " },
                c.shape.hidden,
                c.shape.mlp,
                millions(c.params),
                c.loss,
                fmt_bytes(c.bytes)
            );
        }
    }
    let k = &p.kept_importance;
    let _ = writeln!(
        o,
        "  importance kept: embedding {}, heads {}, MLP {} (mean per layer), layers {} \
         (Block Influence), over {} calibration sequences of {} tokens",
        pct(k.hidden),
        pct(k.heads),
        pct(k.mlp),
        pct(k.layers),
        p.scores.sequences,
        p.scores.seq
    );
    let _ = writeln!(
        o,
        "  held while scored: {}, {} planned ({} of weights)",
        p.held.storage,
        fmt_bytes(p.held.bytes),
        fmt_bytes(p.held.weight_bytes)
    );
    if let Some(c) = p.candidates.iter().max_by_key(|c| c.bytes)
        && c.bytes > p.held.bytes
    {
        let _ = writeln!(
            o,
            "  the most held at once: {}, candidate hidden {}, mlp {} (planned, with its head)",
            fmt_bytes(c.bytes),
            c.shape.hidden,
            c.shape.mlp
        );
    }
    let gains = p.kept.norm_gains.values();
    if let (Some(lo), Some(hi)) = (
        gains.clone().copied().reduce(f64::min),
        gains.copied().reduce(f64::max),
    ) {
        let _ = writeln!(
            o,
            "  norms over the residual stream: gains scaled by {lo:.3} to {hi:.3} (the kept \
             channels' root-mean-square ratio), {} norms",
            p.kept.norm_gains.len()
        );
    }
    if let Some(f) = &p.fit {
        let _ = write!(
            o,
            "  fit: the {} plan (batch {} x seq {}) peaks at {} of {}",
            f.for_use.name(),
            f.batch,
            f.seq,
            fmt_bytes(f.peak_bytes),
            fmt_bytes(f.budget_bytes)
        );
        if let Some(flags) = f.for_use.plan_flags() {
            let _ = write!(
                o,
                " (`memwall plan --model {}{flags} --batch {} --seq {}`)",
                p.out.display(),
                f.batch,
                f.seq
            );
        }
        match &f.larger {
            Some((s, peak)) => {
                let _ = writeln!(
                    o,
                    "; the next larger ({}) at {}",
                    describe(s),
                    fmt_bytes(*peak)
                );
            }
            None => {
                let _ = writeln!(o, "; the model's own widths fit");
            }
        }
    }
    o
}

/// Every layer's scores and what was kept of it (`--report`).
pub fn layers(p: &Pruned) -> String {
    let mut o = String::new();
    let s = &p.scores;
    let _ = writeln!(
        o,
        "layer  block-influence  kept  query heads kept (of {})  head scores (x100)  MLP importance kept",
        p.before.heads
    );
    for l in 0..s.block_influence.len() {
        let at = p.kept.layers.iter().position(|&k| k == l);
        let heads = match at {
            Some(k) => (p.kept.heads[k].iter())
                .map(|h| h.to_string())
                .collect::<Vec<_>>()
                .join(" "),
            None => "-".into(),
        };
        let mlp = match at {
            Some(k) => pct(super::fraction(&s.mlp[l], &p.kept.mlp[k])),
            None => "-".into(),
        };
        let scores = (s.heads[l].iter())
            .map(|x| format!("{:.0}", 100.0 * x))
            .collect::<Vec<_>>()
            .join(" ");
        let _ = writeln!(
            o,
            "{l:>5}  {:>15.4}  {:>4}  {heads:<24}  {scores:<18}  {mlp}",
            s.block_influence[l],
            if at.is_some() { "yes" } else { "no" },
        );
    }
    let _ = writeln!(
        o,
        "embedding: {} of {} channels kept, {} of their importance",
        p.after.hidden,
        p.before.hidden,
        pct(p.kept_importance.hidden)
    );
    o
}
