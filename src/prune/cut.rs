//! Which channels, heads and layers a shape keeps (the highest scores), and the pruned
//! weights: every tensor of the pruned model is its namesake's rows and columns at the kept
//! indices, in their order (so each kept head, channel and layer computes what it did).
//!
//! Heads are kept by key/value group, as grouped-query attention shares keys: the groups of
//! the highest summed query-head scores, then within each the query heads of the highest
//! scores, so new key/value head j still serves new query heads j·g'..(j+1)·g'.
//!
//! A norm over the residual stream divides by the root mean square of the channels it
//! sees: with fewer (and the strongest) channels kept, that root mean square grows and every
//! kept channel's output shrinks. Each such norm's gain is multiplied by the ratio measured
//! on the calibration data ([`norm_gains`]), so its kept channels put out on average what
//! they did before the cut.

use super::score::Scores;
use super::shape::Shape;
use crate::model::{Family, ModelSpec, ParamLayout, ParamTensor};
use anyhow::{Result, bail};
use std::ops::Range;

/// The kept indices of the original model, each list ascending.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Kept {
    /// Residual-stream channels `[C']`.
    pub hidden: Vec<usize>,
    /// The original layers kept `[L']`.
    pub layers: Vec<usize>,
    /// Per kept layer: query heads `[NH']` and key/value heads `[NKV']`.
    pub heads: Vec<Vec<usize>>,
    pub kv_heads: Vec<Vec<usize>>,
    /// Per kept layer: MLP channels `[I']`.
    pub mlp: Vec<Vec<usize>>,
    /// Per norm over the residual stream (its original weight's name): the factor its gain
    /// is multiplied by (none when every channel is kept).
    #[serde(default)]
    pub norm_gains: std::collections::BTreeMap<String, f64>,
}

/// The `k` indices of the highest `scores`, ascending (ties: the lower index first).
pub fn top(scores: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_unstable();
    order
}

/// What `shape` keeps of `spec` by `scores`.
pub fn choose(spec: &ModelSpec, scores: &Scores, shape: &Shape) -> Kept {
    let layers = top(&scores.block_influence, shape.layers);
    let g = spec.n_head / spec.n_kv_head;
    let per_group = shape.heads / shape.kv_heads;
    let mut heads = Vec::new();
    let mut kv_heads = Vec::new();
    for &l in &layers {
        let h = &scores.heads[l];
        let groups: Vec<f64> = (0..spec.n_kv_head)
            .map(|j| h[j * g..(j + 1) * g].iter().sum())
            .collect();
        let kv = top(&groups, shape.kv_heads);
        let q = kv
            .iter()
            .flat_map(|&j| {
                top(&h[j * g..(j + 1) * g], per_group)
                    .into_iter()
                    .map(move |i| j * g + i)
            })
            .collect();
        heads.push(q);
        kv_heads.push(kv);
    }
    let hidden = top(&scores.hidden, shape.hidden);
    Kept {
        norm_gains: norm_gains(&scores.norm_energy, &hidden),
        hidden,
        mlp: layers
            .iter()
            .map(|&l| top(&scores.mlp[l], shape.mlp))
            .collect(),
        layers,
        heads,
        kv_heads,
    }
}

/// Per norm of `energy` (its input's mean (x_c / rms(x))² per channel c): the factor that
/// keeps its output's scale when only the channels `hidden` are kept, √(mean over the kept
/// channels / mean over all). The norm then divides by rms(x_kept) ≈ factor · rms(x), and
/// its gain times the factor undoes it. Empty when every channel is kept.
pub fn norm_gains(
    energy: &[(String, Vec<f64>)],
    hidden: &[usize],
) -> std::collections::BTreeMap<String, f64> {
    let mut gains = std::collections::BTreeMap::new();
    for (name, e) in energy {
        if hidden.len() == e.len() {
            continue;
        }
        let all = e.iter().sum::<f64>() / e.len() as f64;
        let kept = hidden.iter().map(|&c| e[c]).sum::<f64>() / hidden.len() as f64;
        if all > 0.0 && kept > 0.0 {
            gains.insert(name.clone(), (kept / all).sqrt());
        }
    }
    gains
}

/// The axis a tensor dimension runs along.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ax {
    /// The residual stream's channels.
    Hidden,
    /// Query heads' channels (head-major).
    Q,
    /// Key/value heads' channels.
    Kv,
    Mlp,
    /// Kept whole (the vocabulary, a head's channels).
    All,
}

/// The axes of a tensor of a Llama-layout family by its Hugging Face name (`model.layers.N.`
/// stripped); an unknown name is refused, so a family's new tensor never goes through
/// uncut.
fn axes(name: &str) -> Result<&'static [Ax]> {
    use Ax::*;
    let kind = name.rsplit('.').nth(1).unwrap_or("");
    let bias = name.ends_with(".bias");
    Ok(match (kind, bias) {
        ("embed_tokens" | "lm_head", false) => &[All, Hidden],
        ("q_norm" | "k_norm", false) => &[All],
        (k, false) if k == "norm" || k.ends_with("_layernorm") => &[Hidden],
        ("q_proj", false) => &[Q, Hidden],
        ("q_proj", true) => &[Q],
        ("k_proj" | "v_proj", false) => &[Kv, Hidden],
        ("k_proj" | "v_proj", true) => &[Kv],
        ("o_proj", false) => &[Hidden, Q],
        ("o_proj" | "down_proj", true) => &[Hidden],
        ("gate_proj" | "up_proj", false) => &[Mlp, Hidden],
        ("gate_proj" | "up_proj", true) => &[Mlp],
        ("down_proj", false) => &[Hidden, Mlp],
        _ => bail!("internal error: prune does not know the axes of tensor {name}"),
    })
}

/// The families `prune` handles: those of Llama's layout (separate q, k, v, o, gate, up and
/// down projections).
pub fn check_family(spec: &ModelSpec) -> Result<()> {
    match spec.family {
        Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Mistral | Family::Gemma3 => Ok(()),
        f => bail!(
            "prune handles Llama, Qwen2, Qwen3, Mistral and Gemma 3 models; this one is {} \
             ({}), whose fused or coupled projections it does not cut yet",
            f.model_type(),
            spec.name
        ),
    }
}

/// `model.layers.N.rest` as (N, rest); `None` for a tensor outside the layers.
fn layer_name(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (n, rest) = rest.split_once('.')?;
    Some((n.parse().ok()?, rest))
}

/// The pruned model's tensor `name` as (its layer among the kept ones, the name of the
/// original's tensor it is cut from).
pub fn original_name(name: &str, kept: &Kept) -> (Option<usize>, String) {
    match layer_name(name) {
        Some((l, rest)) => (Some(l), format!("model.layers.{}.{rest}", kept.layers[l])),
        None => (None, name.to_string()),
    }
}

/// The kept indices along `ax` of layer `l` (index among the kept layers), `hd` the head
/// size.
fn indices(kept: &Kept, ax: Ax, l: Option<usize>, n: usize, hd: usize) -> Vec<usize> {
    let heads = |hs: &[usize]| hs.iter().flat_map(|&h| h * hd..(h + 1) * hd).collect();
    match (ax, l) {
        (Ax::Hidden, _) => kept.hidden.clone(),
        (Ax::Q, Some(l)) => heads(&kept.heads[l]),
        (Ax::Kv, Some(l)) => heads(&kept.kv_heads[l]),
        (Ax::Mlp, Some(l)) => kept.mlp[l].clone(),
        _ => (0..n).collect(),
    }
}

/// Reads elements `range` of the original model's parameters (its layout's order) into
/// `dst` (`range.len()` values): a checkpoint's files ([`crate::ckpt::load_params_by`]) or
/// a slice.
pub type Read<'a> = dyn FnMut(Range<usize>, &mut [f32]) -> Result<()> + 'a;

/// Values a cut tensor is handed over in: whole rows, about this many (4 MiB of f32).
pub const PIECE: usize = 1 << 20;

/// The cut of every tensor of the pruned model from the original's, streamed: a tensor is
/// read a run of kept rows at a time and handed over a piece of whole rows at a time, so
/// cutting a model holds a few pieces, never a whole tensor of either model.
pub struct Cut<'a> {
    spec: &'a ModelSpec,
    kept: &'a Kept,
    old: &'a ParamLayout,
    /// The original's rows read at once `[rows, W]`.
    rows: Vec<f32>,
    /// The cut rows handed over `[rows, W']`.
    piece: Vec<f32>,
    /// Values per piece ([`PIECE`]).
    per_piece: usize,
}

impl<'a> Cut<'a> {
    /// The cut by `kept` of the model `spec` whose parameters are laid out as `old`.
    pub fn new(spec: &'a ModelSpec, kept: &'a Kept, old: &'a ParamLayout) -> Cut<'a> {
        Cut {
            spec,
            kept,
            old,
            rows: Vec::new(),
            piece: Vec::new(),
            per_piece: PIECE,
        }
    }

    /// Tensor `t` of the pruned model, its namesake's of the original at the kept indices
    /// (a norm's gain rescaled, [`norm_gains`]), handed to `put` in order as pieces of whole
    /// rows (at most [`PIECE`] values, or one row where a row is longer); the original's
    /// values come from `read`.
    pub fn tensor(
        &mut self,
        t: &ParamTensor,
        read: &mut Read<'_>,
        put: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let (l, old_name) = original_name(&t.name, self.kept);
        let Some(src) = self.old.get(&old_name) else {
            bail!(
                "internal error: the pruned model's {} has no {old_name}",
                t.name
            );
        };
        let ax = axes(&t.name)?;
        if ax.len() != src.shape.len() {
            bail!("internal error: {old_name} has shape {:?}", src.shape);
        }
        let idx: Vec<Vec<usize>> = ax
            .iter()
            .zip(&src.shape)
            .map(|(&a, &n)| indices(self.kept, a, l, n, self.spec.head_dim))
            .collect();
        let want: Vec<usize> = idx.iter().map(Vec::len).collect();
        if want != t.shape {
            bail!(
                "internal error: {} cut to {want:?}, the pruned model's is {:?}",
                t.name,
                t.shape
            );
        }
        let base = src.range.start;
        match idx.as_slice() {
            [cols] => {
                // A vector (a norm's gain, a bias): small, whole.
                self.rows.resize(src.range.len(), 0.0);
                read(src.range.clone(), &mut self.rows)?;
                let out: Vec<f32> = cols.iter().map(|&c| self.rows[c]).collect();
                let out = match self.kept.norm_gains.get(&old_name) {
                    // The gain is offset + w (Gemma's 1 + w).
                    Some(&gain) => {
                        let offset = self.spec.family.norm_offset();
                        (out.iter())
                            .map(|&w| ((offset + w) as f64 * gain) as f32 - offset)
                            .collect()
                    }
                    None => out,
                };
                put(&out)
            }
            [rows, cols] => {
                let w = src.shape[1];
                let piece = self.per_piece;
                for chunk in rows.chunks((piece / cols.len().max(1)).max(1)) {
                    self.piece.clear();
                    let (first, last) = (chunk[0], chunk[chunk.len() - 1]);
                    if (last + 1 - first) * w <= 2 * piece.max(w) {
                        // The span of the chunk's rows at once, the rows between skipped.
                        self.rows.resize((last + 1 - first) * w, 0.0);
                        read(base + first * w..base + (last + 1) * w, &mut self.rows)?;
                        for &r in chunk {
                            let row = &self.rows[(r - first) * w..(r - first + 1) * w];
                            self.piece.extend(cols.iter().map(|&c| row[c]));
                        }
                        put(&self.piece)?;
                        continue;
                    }
                    // Sparse rows: runs of consecutive rows, each read at once.
                    let mut i = 0;
                    while i < chunk.len() {
                        let mut n = 1;
                        while i + n < chunk.len() && chunk[i + n] == chunk[i] + n {
                            n += 1;
                        }
                        let r0 = chunk[i];
                        self.rows.resize(n * w, 0.0);
                        read(base + r0 * w..base + (r0 + n) * w, &mut self.rows)?;
                        for row in self.rows.chunks_exact(w) {
                            self.piece.extend(cols.iter().map(|&c| row[c]));
                        }
                        i += n;
                    }
                    put(&self.piece)?;
                }
                Ok(())
            }
            _ => bail!("internal error: {old_name} has {} dimensions", idx.len()),
        }
    }
}

/// The pruned model's weights (`new_layout`'s order), each tensor its namesake's of `old`
/// (`old_layout`) at the kept indices: [`Cut`] over a whole model in memory.
pub fn weights(
    spec: &ModelSpec,
    kept: &Kept,
    (old_layout, old): (&ParamLayout, &[f32]),
    new_layout: &ParamLayout,
) -> Result<Vec<f32>> {
    let cut = Cut::new(spec, kept, old_layout);
    weights_by(cut, old, new_layout)
}

/// [`weights`] by `cut`.
fn weights_by(mut cut: Cut<'_>, old: &[f32], new_layout: &ParamLayout) -> Result<Vec<f32>> {
    let mut out = vec![0f32; new_layout.total];
    let mut read = |r: Range<usize>, dst: &mut [f32]| {
        dst.copy_from_slice(&old[r]);
        Ok(())
    };
    for t in &new_layout.tensors {
        let mut at = t.range.start;
        cut.tensor(t, &mut read, &mut |piece| {
            out[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
            Ok(())
        })?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_keeps_the_highest_in_order_and_breaks_ties_by_index() {
        assert_eq!(top(&[0.1, 0.9, 0.5, 0.9], 2), vec![1, 3]);
        assert_eq!(top(&[0.1, 0.9, 0.5, 0.9], 3), vec![1, 2, 3]);
        assert_eq!(top(&[1.0, 1.0, 1.0], 2), vec![0, 1]);
    }

    #[test]
    fn heads_are_kept_by_group_and_stay_group_major() {
        let spec = ModelSpec::preset("llama-tiny").unwrap();
        let (nh, nkv) = (spec.n_head, spec.n_kv_head);
        let g = nh / nkv;
        assert!(nkv >= 2 && g >= 2, "llama-tiny has grouped heads");
        let mut scores = Scores {
            hidden: vec![1.0; spec.n_embd],
            heads: vec![(0..nh).map(|h| h as f64).collect(); spec.n_layer],
            mlp: vec![vec![1.0; spec.mlp_hidden]; spec.n_layer],
            block_influence: (0..spec.n_layer).map(|l| l as f64).collect(),
            sequences: 1,
            seq: 1,
            norm_energy: Vec::new(),
        };
        scores.heads[0][0] = 100.0; // group 0 now outscores the last group
        let shape = Shape {
            heads: nkv - 1,
            kv_heads: nkv - 1,
            ..Shape::of(&spec)
        };
        let k = choose(&spec, &scores, &shape);
        // Layer 0 keeps group 0 (its head 0) and the last groups' highest heads.
        assert_eq!(k.kv_heads[0][0], 0);
        assert_eq!(k.heads[0][0], 0);
        for (q, kv) in k.heads[0].iter().zip(&k.kv_heads[0]) {
            assert_eq!(q / g, *kv, "query head {q} served by its own group");
        }
        // Other layers drop group 0, the lowest.
        assert!(!k.kv_heads[1].contains(&0));
    }

    #[test]
    fn a_norm_keeping_its_strongest_channels_gains_the_ratio_of_their_root_mean_squares() {
        // Channel energies 3, 1, 0, 0 (mean 1): keeping channels 0 and 1 raises the root mean
        // square by √2; keeping all changes nothing.
        let energy = vec![("n.weight".to_string(), vec![3.0, 1.0, 0.0, 0.0])];
        let g = norm_gains(&energy, &[0, 1]);
        assert!((g["n.weight"] - 2f64.sqrt()).abs() < 1e-12);
        assert!(norm_gains(&energy, &[0, 1, 2, 3]).is_empty());
        // A row x = (√3, 1, 0, 0)·s: the kept norm with the gain puts out what the whole did.
        let x = [3f64.sqrt(), 1.0];
        let rms_all = ((3.0 + 1.0) / 4.0f64).sqrt();
        let rms_kept = ((3.0 + 1.0) / 2.0f64).sqrt();
        for (a, b) in x
            .iter()
            .map(|v| v / rms_all)
            .zip(x.iter().map(|v| v / rms_kept * g["n.weight"]))
        {
            assert!((a - b).abs() < 1e-12);
        }
    }

    /// The naive cut: every value of the pruned model looked up by its indices.
    fn naive(
        spec: &ModelSpec,
        kept: &Kept,
        old: &ParamLayout,
        p: &[f32],
        new: &ParamLayout,
    ) -> Vec<f32> {
        let mut out = vec![0f32; new.total];
        for t in &new.tensors {
            let (l, name) = original_name(&t.name, kept);
            let src = old.get(&name).unwrap();
            let ax = axes(&t.name).unwrap();
            let idx: Vec<Vec<usize>> = (ax.iter().zip(&src.shape))
                .map(|(&a, &n)| indices(kept, a, l, n, spec.head_dim))
                .collect();
            let dst = &mut out[t.range.clone()];
            match idx.as_slice() {
                [c] => (0..c.len()).for_each(|j| dst[j] = p[src.range.start + c[j]]),
                [r, c] => {
                    for (i, &ri) in r.iter().enumerate() {
                        for (j, &cj) in c.iter().enumerate() {
                            dst[i * c.len() + j] = p[src.range.start + ri * src.shape[1] + cj];
                        }
                    }
                }
                _ => unreachable!(),
            }
        }
        out
    }

    #[test]
    fn the_streamed_cut_is_the_naive_one_for_every_piece_size() {
        let spec = ModelSpec::preset("llama-tiny").unwrap();
        let old = ParamLayout::new(&spec);
        let mut p = vec![0f32; old.total];
        old.init(&mut p, 5);
        // Every other embedding channel and MLP channel, a kv group, the first and last
        // layers: sparse rows and dense ones.
        let every_other = |n: usize| (0..n).step_by(2).collect::<Vec<_>>();
        let g = spec.n_head / spec.n_kv_head;
        let layers = vec![0, spec.n_layer - 1];
        let kept = Kept {
            hidden: every_other(spec.n_embd),
            heads: vec![(g..2 * g).collect(); 2],
            kv_heads: vec![vec![1]; 2],
            mlp: vec![
                every_other(spec.mlp_hidden),
                (0..spec.mlp_hidden / 2).collect(),
            ],
            layers,
            norm_gains: Default::default(),
        };
        let shape = Shape {
            hidden: kept.hidden.len(),
            heads: g,
            kv_heads: 1,
            mlp: spec.mlp_hidden / 2,
            layers: 2,
        };
        let new = ParamLayout::new(&shape.apply(&spec));
        let want = naive(&spec, &kept, &old, &p, &new);
        // Pieces of one value (a row at a time, runs of rows), a few rows, the default.
        for piece in [1, 40, 3000, PIECE] {
            let mut cut = Cut::new(&spec, &kept, &old);
            cut.per_piece = piece;
            assert!(
                weights_by(cut, &p, &new).unwrap() == want,
                "pieces of {piece}"
            );
        }
    }

    #[test]
    fn every_tensor_of_a_llama_layout_has_axes() {
        for name in [
            "llama-tiny",
            "qwen2.5-0.5b",
            "qwen3-0.6b",
            "gemma-3-270m",
            "mistral-7b",
        ] {
            let spec = ModelSpec::preset(name).unwrap();
            for t in &ParamLayout::new(&spec).tensors {
                let ax = axes(&t.name).unwrap();
                assert_eq!(ax.len(), t.shape.len(), "{}", t.name);
            }
        }
    }
}
