//! The pruned model's shape: the same heads, MLP width, embedding width and layer count in
//! every layer, so the result is an ordinary config of its family that transformers,
//! llama.cpp and memwall load unchanged (per-layer widths are what made LLM-Pruner's models
//! unloadable: LLM-Pruner #16, #68; llama.cpp #9483).
//!
//! Chosen from flags ([`ShapeRequest`]): widths given, or candidates under a budget: a
//! parameter fraction to keep (`--keep`) or a memory budget (`--fit-memory`: the plan of
//! the use). The candidates are the budget's frontier of embedding and MLP widths
//! ([`frontier`]: for each embedding width, the widest MLP that fits), heads and layers kept
//! unless given, as Minitron's best width-pruned models keep them; `prune` chooses among
//! them by the calibration loss of each pruned model ([`super::select`]).

use crate::model::{Family, ModelSpec};
use anyhow::{Result, bail};
use serde::Serialize;

/// What every layer of the pruned model keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shape {
    /// Embedding (residual stream) width C.
    pub hidden: usize,
    /// Query heads (each of the model's head size).
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// MLP width.
    pub mlp: usize,
    /// Layers.
    pub layers: usize,
}

/// The shape flags as given (`None`: not given).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShapeRequest {
    /// `--keep F`: this fraction of the parameters.
    pub keep: Option<f64>,
    pub hidden: Option<usize>,
    pub heads: Option<usize>,
    pub kv_heads: Option<usize>,
    pub mlp: Option<usize>,
    /// `--depth N`: layers kept (those of the highest Block Influence).
    pub depth: Option<usize>,
}

impl Shape {
    /// The model's own shape.
    pub fn of(spec: &ModelSpec) -> Shape {
        Shape {
            hidden: spec.n_embd,
            heads: spec.n_head,
            kv_heads: spec.n_kv_head,
            mlp: spec.mlp_hidden,
            layers: spec.n_layer,
        }
    }

    /// The spec of `spec` pruned to this shape: the same family, head size, vocabulary,
    /// positions and options.
    pub fn apply(&self, spec: &ModelSpec) -> ModelSpec {
        let mut s = spec.clone();
        s.n_embd = self.hidden;
        s.n_head = self.heads;
        s.n_kv_head = self.kv_heads;
        s.mlp_hidden = self.mlp;
        s.n_layer = self.layers;
        s
    }

    /// Parameters of `spec` pruned to this shape.
    pub fn params(&self, spec: &ModelSpec) -> usize {
        self.apply(spec).num_params()
    }

    /// Checks this shape against `spec`, naming the flag of a width that is not there.
    pub fn check(&self, spec: &ModelSpec) -> Result<()> {
        let w = |flag: &str, v: usize, max: usize, what: &str| -> Result<()> {
            if v == 0 || v > max {
                bail!(
                    "{flag} {v}: the model has {max} {what}; keep 1 to {max} (fewer prunes more)"
                );
            }
            Ok(())
        };
        w("--hidden", self.hidden, spec.n_embd, "embedding channels")?;
        w("--mlp", self.mlp, spec.mlp_hidden, "MLP channels")?;
        w("--depth", self.layers, spec.n_layer, "layers")?;
        w(
            "--kv-heads",
            self.kv_heads,
            spec.n_kv_head,
            "key/value heads",
        )?;
        w("--heads", self.heads, spec.n_head, "query heads")?;
        let g = spec.n_head / spec.n_kv_head;
        if !self.heads.is_multiple_of(self.kv_heads) || self.heads / self.kv_heads > g {
            bail!(
                "--heads {} with --kv-heads {}: grouped-query attention needs the query heads a \
                 multiple of the key/value heads, at most {g} each (the model's groups: {} query \
                 heads on {} key/value heads); e.g. --heads {} --kv-heads {}",
                self.heads,
                self.kv_heads,
                spec.n_head,
                spec.n_kv_head,
                self.kv_heads * g.min((self.heads / self.kv_heads).max(1)),
                self.kv_heads
            );
        }
        if self.layers != spec.n_layer && spec.family == Family::Gemma3 {
            bail!(
                "--depth {}: Gemma 3's sliding and full layers follow a fixed pattern (llama.cpp \
                 derives it from the layer index), which removing layers would break; prune its \
                 widths (--keep, --hidden, --mlp, --heads) instead",
                self.layers
            );
        }
        Ok(())
    }
}

/// Widths are kept multiples of this where the model's are (32 if its embedding and MLP
/// widths are multiples of 32, else 8, else 1; a step of at most an eighth of the
/// embedding): the shapes kernels and quantized formats handle best (GGUF's 32-value blocks;
/// a k-quant needs rows of multiples of 256, which the exporter checks per tensor).
fn align(spec: &ModelSpec) -> usize {
    let (c, i) = (spec.n_embd, spec.mlp_hidden);
    [32, 8]
        .into_iter()
        .find(|&a| c.is_multiple_of(a) && i.is_multiple_of(a) && c >= 8 * a)
        .unwrap_or(1)
}

/// `x` rounded down to a multiple of `a`, at least `a`.
fn down(x: f64, a: usize) -> usize {
    ((x / a as f64).floor() as usize).max(1) * a
}

/// The widest MLP (a multiple of `a`, or `base.mlp`) that `fits` with `base`'s other
/// widths, by bisection (a wider MLP never needs less); `None` when even `a` does not fit.
fn widest_mlp(
    base: Shape,
    a: usize,
    fits: &mut dyn FnMut(&Shape) -> Result<bool>,
) -> Result<Option<usize>> {
    let with = |m: usize| Shape { mlp: m, ..base };
    if fits(&with(base.mlp))? {
        return Ok(Some(base.mlp));
    }
    // Bisect the widths k·a, k = 1..=mlp/a: k = lo fits (or lo = 0), k = hi does not.
    let (mut lo, mut hi) = (0, base.mlp / a + 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(&with(mid * a))? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok((lo > 0).then_some(lo * a))
}

/// The embedding widths the frontier tries on `base`: its own, then multiples of the
/// alignment down to a quarter of it.
fn embedding_widths(spec: &ModelSpec, base: Shape) -> Vec<usize> {
    let (a, c) = (align(spec), base.hidden);
    let mut widths = vec![c];
    let mut h = down(c as f64 - 1.0, a);
    while h < c && h * 4 >= c {
        widths.push(h);
        if h <= a {
            break;
        }
        h -= a;
    }
    widths
}

/// The most shapes a frontier holds (each is cut and run to choose among them).
pub const MAX_CANDIDATES: usize = 8;

/// The budget's frontier of embedding and MLP widths on `base`: for embedding widths from
/// the model's down (multiples of the alignment, to a quarter of it) to the widest that
/// keeps `base`'s whole MLP (a narrower embedding then only loses), at most
/// [`MAX_CANDIDATES`] of them evenly spaced, the widest MLP that `fits`. Widest embedding
/// first; `None` when `base` itself fits. Each is the largest of its kind: its
/// [`next_larger`] does not fit.
pub fn frontier(
    spec: &ModelSpec,
    base: Shape,
    fits: &mut dyn FnMut(&Shape) -> Result<bool>,
) -> Result<Option<Vec<Shape>>> {
    if fits(&base)? {
        return Ok(None);
    }
    let a = align(spec);
    let widths = embedding_widths(spec, base);
    // The widest embedding under the whole MLP, by bisection (a narrower one fits more
    // easily): widths[lo] does not fit it, widths[hi] does (or hi is past the end).
    let whole = |h: usize| Shape { hidden: h, ..base };
    let (mut lo, mut hi) = (0, widths.len());
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(&whole(widths[mid]))? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let span = &widths[..hi.min(widths.len() - 1) + 1];
    let mut out = Vec::new();
    for h in evenly(span, MAX_CANDIDATES) {
        let at = Shape { hidden: h, ..base };
        if let Some(m) = widest_mlp(at, a, fits)? {
            out.push(Shape { mlp: m, ..at });
        }
    }
    if out.is_empty() {
        bail!(
            "no embedding width down to a quarter of the model's ({}) gives a shape that fits; \
             prune heads (--heads, --kv-heads) or layers (--depth) as well",
            base.hidden / 4
        );
    }
    Ok(Some(out))
}

/// At most `n` of `xs`, evenly spaced, the first and last included.
fn evenly(xs: &[usize], n: usize) -> Vec<usize> {
    if xs.len() <= n {
        return xs.to_vec();
    }
    let last = xs.len() - 1;
    let mut picked: Vec<usize> = (0..n).map(|k| xs[(k * last).div_ceil(n - 1)]).collect();
    picked.dedup();
    picked
}

/// The next larger shape than `s` of `base`'s [`frontier`]: one alignment step wider MLP,
/// or (at `base`'s MLP) one step wider embedding.
pub fn next_larger(spec: &ModelSpec, s: Shape, base: Shape) -> Shape {
    let a = align(spec);
    if s.mlp < base.mlp {
        return Shape {
            mlp: (s.mlp + a).min(base.mlp),
            ..s
        };
    }
    let widths = embedding_widths(spec, base);
    let above = (widths.iter().rev())
        .find(|&&h| h > s.hidden)
        .copied()
        .unwrap_or(base.hidden);
    Shape { hidden: above, ..s }
}

/// The shapes `req` allows on `spec`: the widths given, the rest the model's; with `--keep`,
/// the widths not given chosen under the parameter budget (the [`frontier`], or the one
/// width left shrunk alone). One shape unless there is a frontier to choose from.
pub fn resolve(spec: &ModelSpec, req: &ShapeRequest) -> Result<Vec<Shape>> {
    let mut s = Shape::of(spec);
    if let Some(v) = req.hidden {
        s.hidden = v;
    }
    if let Some(v) = req.mlp {
        s.mlp = v;
    }
    if let Some(v) = req.heads {
        s.heads = v;
    }
    if let Some(v) = req.kv_heads {
        s.kv_heads = v;
        if req.heads.is_none() {
            s.heads = v * (spec.n_head / spec.n_kv_head);
        }
    }
    if let Some(v) = req.depth {
        s.layers = v;
    }
    s.check(spec)?;
    let Some(keep) = req.keep else {
        return Ok(vec![s]);
    };
    if !(keep > 0.0 && keep <= 1.0) {
        bail!("--keep {keep}: give the fraction of the parameters to keep, above 0 and at most 1");
    }
    if req.hidden.is_some() && req.mlp.is_some() {
        bail!(
            "--keep with both --hidden and --mlp: nothing is left for --keep to choose; leave \
             out --keep (or one of the widths)"
        );
    }
    let budget = (keep * spec.num_params() as f64).floor() as usize;
    if s.params(spec) <= budget {
        return Ok(vec![s]);
    }
    let mut fits = |x: &Shape| Ok(x.params(spec) <= budget);
    let chosen = match (req.hidden, req.mlp) {
        (None, None) => frontier(spec, s, &mut fits)?,
        // One width given: the other shrinks alone.
        (Some(_), None) => shrink_one(spec, s, false, &mut fits)?.map(|x| vec![x]),
        (None, Some(_)) => shrink_one(spec, s, true, &mut fits)?.map(|x| vec![x]),
        (Some(_), Some(_)) => unreachable!(),
    };
    let Some(chosen) = chosen else {
        return Ok(vec![s]);
    };
    for x in &chosen {
        x.check(spec)?;
    }
    Ok(chosen)
}

/// The widest shape with `s`'s other widths whose embedding width (`hidden`) or MLP width
/// (else) fits; `None` when `s` itself does.
fn shrink_one(
    spec: &ModelSpec,
    s: Shape,
    hidden: bool,
    fits: &mut dyn FnMut(&Shape) -> Result<bool>,
) -> Result<Option<Shape>> {
    if fits(&s)? {
        return Ok(None);
    }
    let a = align(spec);
    let max = if hidden { s.hidden } else { s.mlp };
    let mut w = down(max as f64 - 1.0, a);
    loop {
        let x = match hidden {
            true => Shape { hidden: w, ..s },
            false => Shape { mlp: w, ..s },
        };
        if fits(&x)? {
            return Ok(Some(x));
        }
        if w <= a {
            let flag = if hidden { "--hidden" } else { "--mlp" };
            bail!(
                "--keep: with the widths given, even {flag} {w} leaves more than the budget; \
                 prune more of the others"
            );
        }
        w -= a;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smol() -> ModelSpec {
        ModelSpec::preset("smollm2-135m").unwrap()
    }

    #[test]
    fn keep_gives_the_frontier_of_embedding_and_mlp_widths_within_the_budget() {
        let spec = smol();
        let req = ShapeRequest {
            keep: Some(0.75),
            ..Default::default()
        };
        let all = resolve(&spec, &req).unwrap();
        let budget = 0.75 * spec.num_params() as f64;
        // From the whole embedding down, until the whole MLP fits.
        assert_eq!(all[0].hidden, 576);
        assert_eq!(all.last().unwrap().mlp, 1536);
        assert!(
            all.windows(2)
                .all(|w| w[0].hidden > w[1].hidden && w[0].mlp < w[1].mlp)
        );
        let base = Shape::of(&spec);
        for &s in &all {
            let p = s.params(&spec);
            assert!(p as f64 <= budget, "{s:?}: {p} > {budget}");
            assert!(p as f64 > 0.70 * spec.num_params() as f64, "{s:?}: {p}");
            assert_eq!((s.heads, s.kv_heads, s.layers), (9, 3, 30));
            assert!(
                s.hidden.is_multiple_of(32) && s.mlp.is_multiple_of(32),
                "{s:?}"
            );
            // The next larger shape would not fit.
            let larger = next_larger(&spec, s, base);
            assert!(larger.params(&spec) as f64 > budget, "{larger:?} fits too");
        }
    }

    #[test]
    fn a_frontier_of_many_widths_tries_a_few_evenly_spaced() {
        assert_eq!(evenly(&[9, 8, 7], 8), vec![9, 8, 7]);
        let xs: Vec<usize> = (0..20).rev().collect();
        let e = evenly(&xs, 8);
        assert_eq!((e.len(), e[0], e[7]), (8, 19, 0));
        assert!(
            e.windows(2).all(|w| w[0] > w[1] && w[0] - w[1] <= 3),
            "{e:?}"
        );
        // A 7B at 60%: a frontier of at most MAX_CANDIDATES shapes, each within the budget.
        let spec = ModelSpec::preset("llama-2-7b").unwrap();
        let req = ShapeRequest {
            keep: Some(0.6),
            ..Default::default()
        };
        let all = resolve(&spec, &req).unwrap();
        assert!(all.len() > 2 && all.len() <= MAX_CANDIDATES, "{all:?}");
        let budget = 0.6 * spec.num_params() as f64;
        assert!(all.iter().all(|s| (s.params(&spec) as f64) <= budget));
        assert_eq!(all.last().unwrap().mlp, spec.mlp_hidden);
    }

    #[test]
    fn a_shape_that_breaks_grouped_query_attention_is_refused_naming_the_flags() {
        let spec = smol(); // 9 heads on 3 KV heads
        let bad = |req: ShapeRequest| resolve(&spec, &req).unwrap_err().to_string();
        let e = bad(ShapeRequest {
            heads: Some(7),
            ..Default::default()
        });
        assert!(e.contains("--heads 7") && e.contains("--kv-heads 3"), "{e}");
        let e = bad(ShapeRequest {
            heads: Some(0),
            ..Default::default()
        });
        assert!(e.contains("--heads 0"), "{e}");
        let e = bad(ShapeRequest {
            kv_heads: Some(4),
            ..Default::default()
        });
        assert!(
            e.contains("--kv-heads 4") && e.contains("3 key/value heads"),
            "{e}"
        );
        let e = bad(ShapeRequest {
            keep: Some(0.0),
            ..Default::default()
        });
        assert!(e.contains("--keep 0"), "{e}");
        let e = bad(ShapeRequest {
            keep: Some(0.5),
            hidden: Some(256),
            mlp: Some(512),
            ..Default::default()
        });
        assert!(e.contains("--keep with both"), "{e}");
        // Whole KV groups: --kv-heads 2 keeps their 3 query heads each.
        let s = resolve(
            &spec,
            &ShapeRequest {
                kv_heads: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!((s[0].heads, s[0].kv_heads), (6, 2));
    }

    #[test]
    fn gemma3_depth_is_refused() {
        let spec = ModelSpec::preset("gemma-3-270m").unwrap();
        let e = resolve(
            &spec,
            &ShapeRequest {
                depth: Some(10),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--depth 10") && e.contains("Gemma 3"), "{e}");
    }
}
