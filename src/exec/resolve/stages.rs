//! `--pp-layers`: the cut of the layers into pipeline stages, checked against the model, and
//! `auto` resolved into each stage's count by prediction ([`balanced`]), so that a run's
//! options (and a resumed run) hold the counts, never `auto`.

use crate::ir::{Recompute, RecomputeChoice, Sizing};
use crate::model::ModelSpec;
use crate::plan::fit::Strategies;
use crate::plan::stage_cut::{StageCut, balanced, check, list};
use anyhow::{Result, bail};

/// Resolves `s.pipeline_layers` for `spec` on `batch` × `seq` micro-batches on `threads`: a
/// given cut checked (naming `--pp-layers`), `auto` replaced by the counts [`balanced`]
/// finds, within `budget` with `baseline` (a note in `notes` says the cut and each stage's
/// share of the predicted work, the even cut's beside it). An `auto` recomputation is
/// priced as none.
pub fn resolve_cut(
    s: &mut Strategies,
    spec: &ModelSpec,
    (batch, seq, threads): (usize, usize, usize),
    (budget, baseline): (Option<u64>, u64),
    backend: &dyn Sizing,
    notes: &mut Vec<String>,
) -> Result<()> {
    let (n, p) = (spec.n_layer, s.pipeline);
    match &s.pipeline_layers {
        StageCut::Even => Ok(()),
        cut if p <= 1 => bail!(
            "--pp-layers {cut} cuts the layers into pipeline stages, but --pp is {p}: give \
             --pp P (2 or more), or leave out --pp-layers"
        ),
        StageCut::Layers(c) => check(c, p, n),
        StageCut::Auto => {
            let mut even = s.clone();
            even.pipeline_layers = StageCut::Even;
            let mut cfg = even.step_config(batch, seq, threads);
            if let RecomputeChoice::Fixed(r) = s.recompute {
                cfg.recompute = r;
            } else {
                cfg.recompute = Recompute::None;
            }
            let cal = crate::exec::calibrate::current(threads)?;
            let b = balanced(spec, &cfg, &cal, budget, baseline, backend)?;
            let shares = |t: &[f64]| {
                let sum: f64 = t.iter().sum();
                let each: Vec<String> = (t.iter())
                    .map(|x| format!("{:.0}%", 100.0 * x / sum))
                    .collect();
                each.join(", ")
            };
            let slowest = |t: &[f64]| t.iter().copied().fold(0.0, f64::max);
            notes.push(format!(
                "memwall: --pp-layers auto cuts the {n} layers {}: the stages' shares of the \
                 predicted forward and backward {} (the even cut {}: {}), the slowest stage \
                 {:.2}x the even cut's",
                list(&b.counts),
                shares(&b.stage_s),
                list(&crate::ir::mesh::even_layers(n, p)),
                shares(&b.even_s),
                slowest(&b.stage_s) / slowest(&b.even_s)
            ));
            s.pipeline_layers = StageCut::Layers(b.counts);
            Ok(())
        }
    }
}
