//! Importance from calibration data, forward passes only: Minitron's activation-based scores
//! (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge
//! Distillation", §2.2) and ShortGPT's Block Influence (Men et al. 2024).
//!
//! The model runs as `sample` runs it (a generation plan over one sequence: its weights and
//! one sequence's activations, nothing else), and [`Executor::forward_watching`] hands over
//! the activations the scores read, op by op:
//!
//! - **embedding channels:** the mean |x| of each channel of every pre-norm's output (the
//!   norms before attention and MLP, and the final one; not Gemma's post-norms, whose
//!   output is the residual stream again), summed over the norms;
//! - **attention heads:** the mean L2 norm of each query head's slice of the attention
//!   output (the o projection's input), per token;
//! - **MLP channels:** the mean |a| of each channel of the down projection's input (the
//!   GLU's or GELU's output);
//! - **layers:** Block Influence, 1 − the mean cosine between a block's input row and its
//!   output row (the next block's input, or the final norm's).
//!
//! Every mean is over every token of every calibration sequence.
//!
//! Beside the scores, each RMSNorm over the residual stream's channels records the mean
//! square of each channel of its normalised input (x / rms(x)), so the cut can rescale the
//! norm's gain for the channels it keeps (see [`super::cut::norm_gains`]).

use crate::data::DataSet;
use crate::data::examples::{EXAMPLE_START, UNTRAINED};
use crate::data::loader::{Part, Source};
use crate::exec::Executor;
use crate::ir::BufId;
use crate::ir::schedule::{Op, Phase};
use crate::model::{ModelSpec, ParamLayout};
use crate::plan::Plan;
use anyhow::{Result, bail};
use serde::Serialize;

/// The scores of one model on its calibration data (each a mean per token).
#[derive(Clone, Debug, Serialize)]
pub struct Scores {
    /// Per residual-stream channel `[C]`.
    pub hidden: Vec<f64>,
    /// Per layer, per query head `[L][NH]`.
    pub heads: Vec<Vec<f64>>,
    /// Per layer, per MLP channel `[L][I]`.
    pub mlp: Vec<Vec<f64>>,
    /// Per layer `[L]`: Block Influence (0: the block leaves its input's direction as it is).
    pub block_influence: Vec<f64>,
    /// Calibration sequences and their length.
    pub sequences: usize,
    pub seq: usize,
    /// Per RMSNorm over the residual stream's channels (by its weight's Hugging Face name):
    /// the mean of (x_c / rms(x))² per channel c of its input `[C]`; the channels' mean is
    /// 1 (less the norm's ε).
    #[serde(skip)]
    pub norm_energy: Vec<(String, Vec<f64>)>,
}

/// What a watched buffer is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Watch {
    /// Block `l`'s input `[T, C]` (its first norm's input).
    BlockIn(usize),
    /// The last block's output `[T, C]` (the final norm's input).
    FinalIn,
    /// A pre-norm's output `[T, C]`.
    Norm,
    /// The input `[T, C]` of norm `k` of [`Scores::norm_energy`], its ε.
    NormIn(usize, f32),
    /// Block `l`'s attention output `[T, NH·hd]`.
    Heads(usize),
    /// Block `l`'s MLP activations `[T, I]`.
    Mlp(usize),
}

/// A watched buffer: the op after which it is read, the buffer, what it is.
type Watched = (usize, BufId, Watch);

/// The layer of a block's op (its name's `h{l}.`), if any.
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix('h')?;
    let (digits, _) = rest.split_once('.')?;
    digits.parse().ok()
}

/// The buffers of `plan`'s forward the scores read, in schedule order, and the names of
/// the norms over the residual stream's channels (the weights of the `NormIn` watches).
fn watches(plan: &Plan, spec: &ModelSpec) -> Result<(Vec<Watched>, Vec<String>)> {
    let c = spec.n_embd;
    let layout = ParamLayout::new(spec);
    let mut norms = Vec::new();
    let mut out = Vec::new();
    let mut first_norm = vec![false; spec.n_layer];
    let (mut heads, mut mlp) = (vec![false; spec.n_layer], vec![false; spec.n_layer]);
    let mut final_in = false;
    for (i, e) in plan.schedule.ops.iter().enumerate() {
        if e.phase != Phase::Forward {
            continue;
        }
        let layer = layer_of(&e.name);
        if let Op::RmsNorm {
            inp, w, c: nc, eps, ..
        } = &e.op
            && *nc == c
        {
            let Some(t) = layout.tensors.iter().find(|t| t.range == *w) else {
                bail!(
                    "internal error: no tensor of the model holds norm {}'s weights",
                    e.name
                );
            };
            out.push((i, *inp, Watch::NormIn(norms.len(), *eps)));
            norms.push(t.name.clone());
        }
        match (&e.op, layer) {
            (
                Op::RmsNorm {
                    inp,
                    out: o,
                    residual: None,
                    c: nc,
                    ..
                }
                | Op::LayerNorm {
                    inp, out: o, c: nc, ..
                },
                _,
            ) if *nc == c => {
                match layer {
                    Some(l) if !first_norm[l] => {
                        first_norm[l] = true;
                        out.push((i, *inp, Watch::BlockIn(l)));
                    }
                    None if first_norm.iter().all(|&s| s) && !final_in => {
                        final_in = true;
                        out.push((i, *inp, Watch::FinalIn));
                    }
                    _ => {}
                }
                out.push((i, *o, Watch::Norm));
            }
            (Op::Attention { out: o, .. }, Some(l)) => {
                heads[l] = true;
                out.push((i, *o, Watch::Heads(l)));
            }
            (Op::Glu { out: o, .. } | Op::Gelu { out: o, .. }, Some(l)) => {
                mlp[l] = true;
                out.push((i, *o, Watch::Mlp(l)));
            }
            _ => {}
        }
    }
    let missing = |seen: &[bool]| seen.iter().position(|&s| !s);
    for (what, seen) in [
        ("input norm", &first_norm),
        ("attention", &heads),
        ("MLP activation", &mlp),
    ] {
        if let Some(l) = missing(seen) {
            bail!("internal error: no {what} op found for layer {l} of the plan");
        }
    }
    if !final_in {
        bail!("internal error: no final norm found in the plan");
    }
    Ok((out, norms))
}

/// Accumulates the scores of sequences (sums per token; [`Acc::finish`] divides).
struct Acc {
    scores: Scores,
    /// The input of the block whose output is awaited, and its layer `[T, C]`.
    pending: Option<(usize, Vec<f32>)>,
    rows: usize,
}

impl Acc {
    fn new(spec: &ModelSpec, seq: usize, norms: Vec<String>) -> Acc {
        let l = spec.n_layer;
        Acc {
            scores: Scores {
                hidden: vec![0.0; spec.n_embd],
                heads: vec![vec![0.0; spec.n_head]; l],
                mlp: vec![vec![0.0; spec.mlp_hidden]; l],
                block_influence: vec![0.0; l],
                sequences: 0,
                seq,
                norm_energy: norms
                    .into_iter()
                    .map(|n| (n, vec![0.0; spec.n_embd]))
                    .collect(),
            },
            pending: None,
            rows: 0,
        }
    }

    /// Adds what watch `w` shows of one sequence, `x` `[T, width]`.
    fn add(&mut self, w: Watch, x: &[f32], spec: &ModelSpec) {
        match w {
            Watch::BlockIn(_) | Watch::FinalIn => {
                if let Some((pl, prev)) = self.pending.take() {
                    self.scores.block_influence[pl] += one_minus_cos(&prev, x, spec.n_embd);
                }
                if let Watch::BlockIn(l) = w {
                    self.pending = Some((l, x.to_vec()));
                }
            }
            Watch::Norm => add_abs(&mut self.scores.hidden, x),
            Watch::NormIn(k, eps) => {
                add_normalised_square(&mut self.scores.norm_energy[k].1, x, eps)
            }
            Watch::Mlp(l) => add_abs(&mut self.scores.mlp[l], x),
            Watch::Heads(l) => {
                let hd = spec.head_dim;
                let nh = spec.n_head;
                for row in x.chunks_exact(nh * hd) {
                    for (h, s) in self.scores.heads[l].iter_mut().enumerate() {
                        let v = &row[h * hd..(h + 1) * hd];
                        *s += v
                            .iter()
                            .map(|&a| (a as f64) * (a as f64))
                            .sum::<f64>()
                            .sqrt();
                    }
                }
            }
        }
    }

    fn finish(mut self) -> Scores {
        let n = self.rows.max(1) as f64;
        let s = &mut self.scores;
        let all = s.hidden.iter_mut().chain(s.block_influence.iter_mut());
        let all = all.chain(s.heads.iter_mut().flatten());
        let all = all.chain(s.mlp.iter_mut().flatten());
        for v in all.chain(s.norm_energy.iter_mut().flat_map(|(_, e)| e)) {
            *v /= n;
        }
        self.scores
    }
}

/// Adds |x| per channel of `x` `[rows, acc.len()]` into `acc`.
fn add_abs(acc: &mut [f64], x: &[f32]) {
    for row in x.chunks_exact(acc.len()) {
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += v.abs() as f64;
        }
    }
}

/// Adds (x_c / rms(x))² per channel c of each row of `x` `[rows, acc.len()]` into `acc`,
/// rms(x) = √(mean(x²) + ε) as the norm computes it.
fn add_normalised_square(acc: &mut [f64], x: &[f32], eps: f32) {
    for row in x.chunks_exact(acc.len()) {
        let ms = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / row.len() as f64;
        let inv = 1.0 / (ms + eps as f64);
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += (v as f64) * (v as f64) * inv;
        }
    }
}

/// Σ over rows of 1 − cos(a row, b row), both `[rows, c]`.
fn one_minus_cos(a: &[f32], b: &[f32], c: usize) -> f64 {
    a.chunks_exact(c)
        .zip(b.chunks_exact(c))
        .map(|(x, y)| {
            let (mut xy, mut xx, mut yy) = (0.0f64, 0.0f64, 0.0f64);
            for (&p, &q) in x.iter().zip(y) {
                let (p, q) = (p as f64, q as f64);
                xy += p * q;
                xx += p * p;
                yy += q * q;
            }
            let d = (xx * yy).sqrt();
            if d > 0.0 { 1.0 - xy / d } else { 0.0 }
        })
        .sum()
}

/// The token ids of calibration sequence `index` of `source` (`seq` tokens, the markers of
/// chat data removed), drawn as training draws its rows under `seed`.
pub fn calibration_row(source: &Source, seq: usize, seed: u64, index: u64) -> Result<Vec<u32>> {
    let mut row = calibration_window(source, seq, seed, index)?;
    row.truncate(seq);
    Ok(row)
}

/// [`calibration_row`] with the token after it: `seq + 1` ids (each input's next token).
pub fn calibration_window(source: &Source, seq: usize, seed: u64, index: u64) -> Result<Vec<u32>> {
    let mut row = vec![0u32; seq + 1];
    source.fill((1, seq), seed, index, Part::WHOLE, &mut row)?;
    for x in &mut row {
        *x &= !(UNTRAINED | EXAMPLE_START);
    }
    Ok(row)
}

/// Scores the model `ex` runs (a generation plan of `seq` tokens of `spec`) on `n`
/// sequences of `data`'s training split; `tick` is called after each.
pub fn score(
    ex: &mut Executor,
    spec: &ModelSpec,
    data: &DataSet,
    (n, seed): (usize, u64),
    tick: &mut dyn FnMut(),
) -> Result<Scores> {
    let seq = ex.plan.cfg.seq;
    let (watch, norms) = watches(&ex.plan, spec)?;
    let ids: Vec<(usize, BufId)> = watch.iter().map(|&(i, b, _)| (i, b)).collect();
    let source = data.train_source(false);
    let mut acc = Acc::new(spec, seq, norms);
    for k in 0..n {
        let row = calibration_row(&source, seq, seed, k as u64)?;
        ex.forward_watching(&row, &ids, &mut |w, x| {
            acc.add(watch[w].2, x, spec);
            Ok(())
        })?;
        acc.rows += seq;
        acc.scores.sequences += 1;
        tick();
    }
    Ok(acc.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names_parse() {
        assert_eq!(layer_of("h12.attn"), Some(12));
        assert_eq!(layer_of("h0.re.attn"), Some(0));
        assert_eq!(layer_of("ln_f"), None);
        assert_eq!(layer_of("head"), None);
    }

    #[test]
    fn block_influence_is_zero_for_a_scaled_row_and_one_for_an_orthogonal_one() {
        let a = [1.0, 2.0, 0.0, 0.0];
        let b = [2.0, 4.0, 0.0, 0.0];
        assert!(one_minus_cos(&a, &b, 4).abs() < 1e-12);
        let c = [0.0, 0.0, 3.0, 1.0];
        assert!((one_minus_cos(&a, &c, 4) - 1.0).abs() < 1e-12);
        // Two rows: their sum.
        let (a2, bc) = ([a, a].concat(), [b, c].concat());
        assert!((one_minus_cos(&a2, &bc, 4) - 1.0).abs() < 1e-12);
    }
}
