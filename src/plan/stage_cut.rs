//! How a pipeline's stages cut the model's layers (`--pp-layers`): as even as they divide
//! (the default), each stage's count as given (`9,3`), or `auto`: the cut whose slowest
//! stage is fastest by predicted time ([`balanced`]), each stage within `--max-memory`.
//!
//! A 1F1B step takes about (m + p − 1) × its slowest stage's forward and backward of one
//! micro-batch, so the stages' times, not their layer counts, should be equal. The first
//! stage also runs the embedding, the last the final norm, the LM head and the loss: on
//! GPT-2 (V = 50257, C = 768) the head's GEMMs cost about 5.5 layers, so the even cut 6,6
//! leaves 2/3 of the work on the last stage and `auto` cuts 9,3.
//!
//! [`balanced`] prices stages cheaply: every layer of a family costs the same, so each
//! stage's predicted time and peak are affine in its layer count. It plans each stage twice,
//! holding one layer and two (the others one each, on a model of p + 1 layers at most), and
//! takes both figures from those plans ([`super::time::predict`]'s forward and backward per
//! micro-batch, [`super::Plan::predicted_peak`]); then it hands out the layers one at a time
//! to the stage that stays fastest with it (among those that still fit the budget), which
//! minimises the slowest stage (each stage's time grows with its layers). Ties go to the
//! earlier stage, so stages of equal costs get the even cut.
//!
//! Every rank must cut alike: the figures come from the calibration the ranks share (a
//! measured one, the same file on one machine), or from the estimate's coefficients at a
//! nominal FMA peak ([`NOMINAL_PEAK_GFLOPS`]), never from a peak each process measures for
//! itself. The run's options record the counts, so a resumed run keeps its cut.

pub use super::stage_layers::{check, list};
use super::time::{Calibration, Source, predict};
use super::{Mode, StepConfig, build_plan};
use crate::ir::{Axis, Mesh, Sizing, mesh::even_layers};
use crate::model::ModelSpec;
use crate::util::bytes::fmt_bytes;
use anyhow::{Result, bail};

/// How the layers are cut into pipeline stages (`--pp-layers`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum StageCut {
    /// As even as they divide: the first `n % p` stages one layer more.
    #[default]
    Even,
    /// By predicted time, within the budget ([`balanced`]); resolved into `Layers` before a
    /// plan is built.
    Auto,
    /// Each stage's count of consecutive layers, in order.
    Layers(Vec<usize>),
}

impl std::fmt::Display for StageCut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StageCut::Even => f.write_str("even"),
            StageCut::Auto => f.write_str("auto"),
            StageCut::Layers(c) => f.write_str(&list(c)),
        }
    }
}

impl std::str::FromStr for StageCut {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<StageCut> {
        match s.trim() {
            "even" => return Ok(StageCut::Even),
            "auto" => return Ok(StageCut::Auto),
            _ => {}
        }
        let counts = s
            .split(',')
            .map(|c| c.trim().parse::<usize>())
            .collect::<Result<Vec<_>, _>>();
        match counts {
            Ok(c) if c.contains(&0) => bail!(
                "--pp-layers {s}: every stage holds at least one layer; give each stage's \
                 count of layers (1 or more), or even, or auto"
            ),
            Ok(c) => Ok(StageCut::Layers(c)),
            Err(_) => bail!(
                "--pp-layers {s}: expected even, auto, or each stage's count of layers as a \
                 comma list (e.g. 9,3 for 12 layers in 2 stages)"
            ),
        }
    }
}

crate::ir::serde_as_flag_text!(StageCut);

impl StageCut {
    /// The counts of `p` stages of a model of `n` layers (`Even`'s: [`even_layers`]; an
    /// empty list for one stage), a given cut checked ([`check`]); `Auto` must have been
    /// resolved ([`balanced`]).
    pub fn counts(&self, n: usize, p: usize) -> Result<Vec<usize>> {
        match self {
            _ if p <= 1 => Ok(Vec::new()),
            StageCut::Even => Ok(even_layers(n, p)),
            StageCut::Layers(c) => {
                check(c, p, n)?;
                Ok(c.clone())
            }
            StageCut::Auto => {
                bail!("internal error: --pp-layers auto planned before it was resolved")
            }
        }
    }
}

/// The FMA peak (GFLOP/s) [`balanced`] prices an estimated calibration at: any fixed figure
/// would do (only the stages' ratios matter), so that every rank cuts alike.
pub const NOMINAL_PEAK_GFLOPS: f64 = 100.0;

/// What [`balanced`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct Balanced {
    /// Each stage's count of layers.
    pub counts: Vec<usize>,
    /// Each stage's predicted forward and backward of one micro-batch (seconds, at the
    /// calibration [`balanced`] priced with).
    pub stage_s: Vec<f64>,
    /// Each stage's predicted peak (bytes, with the baseline given).
    pub peak: Vec<u64>,
    /// Each stage's predicted forward and backward of one micro-batch under the even cut
    /// ([`even_layers`]), to compare.
    pub even_s: Vec<f64>,
}

/// One stage's figures holding one layer (`[0]`) and two (`[1]`).
struct Probe {
    time_s: [f64; 2],
    peak: [u64; 2],
}

impl Probe {
    /// The affine extension to `c` layers.
    fn time(&self, c: usize) -> f64 {
        self.time_s[0] + (c - 1) as f64 * (self.time_s[1] - self.time_s[0])
    }

    fn peak(&self, c: usize) -> u64 {
        let per = self.peak[1].saturating_sub(self.peak[0]);
        self.peak[0] + (c - 1) as u64 * per
    }
}

/// The cut of `spec`'s layers into `cfg`'s pipeline stages whose slowest stage is fastest
/// by predicted time (each stage's forward and backward of one micro-batch, at `cal`), each
/// stage's predicted peak (with `baseline`) within `budget` where one is given.
pub fn balanced(
    spec: &ModelSpec,
    cfg: &StepConfig,
    cal: &Calibration,
    budget: Option<u64>,
    baseline: u64,
    backend: &dyn Sizing,
) -> Result<Balanced> {
    let (n, p) = (spec.n_layer, cfg.mesh.pipeline);
    if p <= 1 {
        return Ok(Balanced {
            counts: Vec::new(),
            stage_s: Vec::new(),
            peak: Vec::new(),
            even_s: Vec::new(),
        });
    }
    if p > n {
        bail!(
            "--pp {p}: the model has {n} layers, so at most --pp {n} stages (each holds one \
             layer or more)"
        );
    }
    let cal = shared(cal);
    let probes = (0..p)
        .map(|s| {
            let at = |c: usize| probe(spec, cfg, s, c, &cal, baseline, backend);
            let (one, two) = (at(1)?, at(2)?);
            Ok(Probe {
                time_s: [one.0, two.0],
                peak: [one.1, two.1],
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let fits = |s: usize, c: usize| budget.is_none_or(|b| probes[s].peak(c) <= b);
    if let Some(s) = (0..p).find(|&s| !fits(s, 1)) {
        bail!(
            "--pp-layers auto: stage {s} does not fit --max-memory {} even with one layer (its \
             predicted peak is {}); more --pp stages or --tp ranks, --zero 1-3, --recompute \
             full or a smaller --batch lower it",
            fmt_bytes(budget.unwrap_or_default()),
            fmt_bytes(probes[s].peak(1))
        );
    }
    let time = |s: usize, c: usize| probes[s].time(c);
    let Some(counts) = hand_out(n, p, time, fits) else {
        bail!(
            "--pp-layers auto: no cut of the {n} layers into {p} stages fits --max-memory {} \
             (each stage's predicted peak grows with its layers); more --pp stages or --tp \
             ranks, --zero 1-3, --recompute full or a smaller --batch lower it",
            fmt_bytes(budget.unwrap_or_default()),
        );
    };
    let even = even_layers(n, p);
    Ok(Balanced {
        stage_s: (0..p).map(|s| probes[s].time(counts[s])).collect(),
        peak: (0..p).map(|s| probes[s].peak(counts[s])).collect(),
        even_s: (0..p).map(|s| probes[s].time(even[s])).collect(),
        counts,
    })
}

/// Hands out `n` layers to `p` stages, one each to begin with, then each to the stage that
/// stays fastest with it (`time(s, c)`: stage `s` holding `c` layers; ties to the earlier
/// stage) among those that still fit (`fits(s, c)`): the cut whose slowest stage is fastest
/// where each stage's time grows with its layers. `None` when no stage can take the next.
fn hand_out(
    n: usize,
    p: usize,
    time: impl Fn(usize, usize) -> f64,
    fits: impl Fn(usize, usize) -> bool,
) -> Option<Vec<usize>> {
    let mut counts = vec![1; p];
    for _ in p..n {
        let mut best: Option<(usize, f64)> = None;
        for s in (0..p).filter(|&s| fits(s, counts[s] + 1)) {
            let t = time(s, counts[s] + 1);
            // Equal within rounding: the earlier stage keeps it.
            if best.is_none_or(|(_, b)| t < b - 1e-9 * b.abs()) {
                best = Some((s, t));
            }
        }
        counts[best?.0] += 1;
    }
    Some(counts)
}

/// The calibration every rank prices with alike: a measured one as it is (the ranks read
/// the same file), an estimate at [`NOMINAL_PEAK_GFLOPS`] (each process measures its own
/// peak, which differs between them in the last digits).
fn shared(cal: &Calibration) -> Calibration {
    match cal.source {
        Source::Estimate => Calibration::estimate(String::new(), cal.threads, NOMINAL_PEAK_GFLOPS),
        Source::Measured { .. } => cal.clone(),
    }
}

/// Stage `s`'s predicted forward and backward of one micro-batch and its predicted peak,
/// holding `c` layers, every other stage one (on a model of `p − 1 + c` layers).
fn probe(
    spec: &ModelSpec,
    cfg: &StepConfig,
    s: usize,
    c: usize,
    cal: &Calibration,
    baseline: u64,
    backend: &dyn Sizing,
) -> Result<(f64, u64)> {
    let p = cfg.mesh.pipeline;
    let mut counts = vec![1; p];
    counts[s] = c;
    let small = ModelSpec {
        n_layer: p - 1 + c,
        ..spec.clone()
    };
    // Tensor and data rank 0 of stage s.
    let mesh = cfg.mesh;
    let rank = (0..mesh.world())
        .find(|&r| {
            let m = Mesh { rank: r, ..mesh };
            m.coord(Axis::Pipeline) == s && m.coord(Axis::Tensor) == 0 && m.coord(Axis::Data) == 0
        })
        .expect("every stage has ranks");
    let probe_cfg = StepConfig {
        mesh: Mesh { rank, ..mesh },
        stage_layers: counts,
        ..cfg.clone()
    };
    let plan = build_plan(&small, &probe_cfg, Mode::Train, backend)?;
    let t = predict(&plan, cal);
    let micro = (t.compute_s - t.update_s) / probe_cfg.grad_accum.max(1) as f64;
    Ok((micro, plan.predicted_peak(baseline)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_read_as_the_flag_writes_them_and_bad_ones_are_refused_naming_it() {
        for text in ["even", "auto", "9,3", "1,2,3,4"] {
            let c: StageCut = text.parse().unwrap();
            assert_eq!(c.to_string(), text);
        }
        for (bad, says) in [
            ("9,x", "expected even, auto"),
            ("9,0,3", "at least one layer"),
            ("", "expected even, auto"),
        ] {
            let e = format!("{:#}", bad.parse::<StageCut>().unwrap_err());
            assert!(e.contains("--pp-layers") && e.contains(says), "{bad}: {e}");
        }
        let e = format!("{:#}", check(&[9, 3], 3, 12).unwrap_err());
        assert!(
            e.contains("gives 2 stages, but --pp is 3") && e.contains("4,4,4"),
            "{e}"
        );
        let e = format!("{:#}", check(&[9, 4], 2, 12).unwrap_err());
        assert!(e.contains("holds 13 layers, but the model has 12"), "{e}");
        assert!(check(&[9, 3], 2, 12).is_ok());
        assert_eq!(StageCut::Even.counts(12, 2).unwrap(), vec![6, 6]);
        assert_eq!(StageCut::Even.counts(7, 3).unwrap(), vec![3, 2, 2]);
        assert!(StageCut::Auto.counts(12, 2).is_err());
    }

    #[test]
    fn layers_go_to_the_stage_that_stays_fastest() {
        let any = |_: usize, _: usize| true;
        // Equal stages: the even cut, the first stages one more.
        for (n, p) in [(12, 2), (7, 3), (4, 4), (80, 4)] {
            let got = hand_out(n, p, |_, c| c as f64, any).unwrap();
            assert_eq!(got, even_layers(n, p), "{n} layers, {p} stages");
        }
        // GPT-2's pp 2: the embedding a tenth of a layer, the head 5.5 layers.
        let gpt2 = |s: usize, c: usize| c as f64 + if s == 0 { 0.1 } else { 5.5 };
        assert_eq!(hand_out(12, 2, gpt2, any).unwrap(), vec![9, 3]);
        // Held to 8 layers by memory, stage 0 gives the rest back.
        let small = |s: usize, c: usize| s != 0 || c <= 8;
        assert_eq!(hand_out(12, 2, gpt2, small).unwrap(), vec![8, 4]);
        // No stage takes the last layer: refused.
        assert_eq!(hand_out(12, 2, gpt2, |_, c| c <= 5), None);
        // Four stages, the head (two layers' worth) on the last, which takes fewer; of the
        // cuts as fast (the slowest stage 5 layers' worth), the earlier stages take more.
        let llama = |s: usize, c: usize| c as f64 + if s == 3 { 2.0 } else { 0.0 };
        assert_eq!(hand_out(16, 4, llama, any).unwrap(), vec![5, 5, 4, 2]);
        // The affine extension of a stage's two plans.
        let probe = Probe {
            time_s: [1.5, 2.0],
            peak: [10, 13],
        };
        assert_eq!((probe.time(4), probe.peak(4)), (3.0, 19));
    }
}
