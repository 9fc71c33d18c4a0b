//! The mesh shapes `--fit` searches for a job of several ranks (`plan --ranks N --fit`), and
//! a configuration's plans on every distinct rank of its mesh.
//!
//! A shape is a tensor size `t`, a pipeline size `p` and a ZeRO stage: `t · p` divides the
//! ranks, the rest (`d = N / (t · p)`) split the batch. The tensor sizes are those that divide
//! the model's heads, key/value heads and MLP channels (`ModelSpec::check_tensor_split`), the
//! pipeline sizes at most one stage per layer, the ZeRO stages 0–3 where there are data ranks
//! to shard over (0 alone where `d = 1`). What the user gives (`--tp`, `--pp`, `--zero`) is
//! kept. Shapes that the other strategies rule out (`plan::build::check_mesh`: distillation
//! with `--tp` or `--pp`, rows that sequence parallelism cannot cut, …) are dropped where the
//! search forms its groups.
//!
//! Ranks differ (pipeline stages hold their own layers, the first and last the embedding and
//! head; the first tensor rank adds the row-parallel biases), so a configuration is a plan per
//! distinct rank ([`Built`]; `plan::ranks::distinct_ranks`): it fits when the heaviest rank
//! fits, and its step takes the slowest rank's predicted time (each stage's prediction counts
//! the 1F1B bubble of its own forward and backward).

use super::build::{Verify, build};
use super::ranks::distinct_ranks;
use super::tiers::TierUse;
use super::time::{Calibration, StepTime, predict};
use super::{Budgets, Mode, Plan, StepConfig};
use crate::ir::shard::Zero;
use crate::ir::{Mesh, Sizing};
use crate::model::ModelSpec;
use anyhow::{Result, bail};
use rayon::prelude::*;

/// The (mesh, ZeRO stage) shapes of `ranks` ranks for `spec`, the sizes given (`Some`) kept:
/// one process's alone for one rank. Refuses, naming the flag, a given size that cannot be.
pub(super) fn meshes(
    spec: &ModelSpec,
    ranks: usize,
    (tensor, pipeline, zero): (Option<usize>, Option<usize>, Option<Zero>),
) -> Result<Vec<(Mesh, Zero)>> {
    let n = ranks.max(1);
    let divisors = |m: usize| (1..=m).filter(move |d| m.is_multiple_of(*d));
    let tensors: Vec<usize> = match tensor {
        Some(t) => {
            if t == 0 || !n.is_multiple_of(t) {
                bail!(
                    "--tp {t} does not divide the {n} ranks (plan --ranks N, or mpirun -np N): \
                     --fit keeps the size given; give one that divides {n}, or leave it to --fit"
                );
            }
            spec.check_tensor_split(t)?;
            vec![t]
        }
        None => divisors(n)
            .filter(|&t| spec.check_tensor_split(t).is_ok())
            .collect(),
    };
    let mut out = Vec::new();
    for t in tensors {
        let pipelines: Vec<usize> = match pipeline {
            Some(p) => vec![p],
            None => divisors(n / t).filter(|&p| p <= spec.n_layer).collect(),
        };
        for p in pipelines {
            if p == 0 || !n.is_multiple_of(t * p) {
                bail!(
                    "--tp {t} × --pp {p} does not divide the {n} ranks (plan --ranks N, or mpirun -np N): --fit keeps \
                     the sizes given; give sizes whose product divides {n}, or leave them to it"
                );
            }
            let mesh = Mesh::new(n, t, p, 0);
            let zeros = match zero {
                Some(z) => vec![z],
                None if mesh.data > 1 => (0..=3).map(Zero).collect(),
                None => vec![Zero::DP],
            };
            out.extend(zeros.into_iter().map(|z| (mesh, z)));
        }
    }
    if out.is_empty() {
        bail!(
            "--fit: no tensor size divides both the {n} ranks and the model's heads, key/value \
             heads and MLP channels; give --tp 1"
        );
    }
    Ok(out)
}

/// A configuration's plans, one per distinct rank of its mesh (rank 0's first; one plan for
/// one process).
pub(super) struct Built {
    plans: Vec<Plan>,
}

impl Built {
    /// Builds, unverified, the plan of each distinct rank of `cfg`'s mesh.
    pub fn new(spec: &ModelSpec, cfg: &StepConfig, backend: &(dyn Sizing + Sync)) -> Result<Built> {
        let plans = distinct_ranks(spec, cfg)
            .into_par_iter()
            .map(|rank| {
                let mut c = cfg.clone();
                c.mesh.rank = rank;
                build(spec, &c, Mode::Train, backend, Verify::No)
            })
            .collect::<Result<Vec<Plan>>>()?;
        Ok(Built { plans })
    }

    /// How many plans were built.
    pub fn count(&self) -> usize {
        self.plans.len()
    }

    /// Rank 0's configuration.
    pub fn cfg(&self) -> &StepConfig {
        &self.plans[0].cfg
    }

    /// The heaviest rank's predicted peak.
    pub fn peak(&self, baseline: u64) -> u64 {
        (self.plans.iter())
            .map(|p| p.predicted_peak(baseline))
            .max()
            .unwrap_or(0)
    }

    /// The first tier over its budget on any rank.
    pub fn over_budget(&self, baseline: u64, budgets: &Budgets) -> Option<TierUse> {
        (self.plans.iter()).find_map(|p| p.over_budget(baseline, budgets))
    }

    /// The slowest rank's predicted step.
    pub fn time(&self, cal: &Calibration) -> StepTime {
        (self.plans.iter())
            .map(|p| predict(p, cal))
            .max_by(|a, b| a.step_s.total_cmp(&b.step_s))
            .expect("a mesh has a rank")
    }
}

/// The micro-batches a search builds for a step of `accum` micro-batches on `mesh`: two
/// (more repeat their buffers and ops, so the peak is the same), or, on a pipeline, as many as
/// its first stage holds at once (1F1B keeps `min(p, m)` in flight there).
pub(super) fn micro_batches_built(mesh: &Mesh, accum: usize) -> usize {
    accum.min(mesh.pipeline.max(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four ranks of llama-tiny (4 heads, 2 KV heads, 4 layers): every tensor size the
    /// heads allow, every pipeline size, ZeRO 0–3 only where data ranks remain; the sizes
    /// given are kept, and impossible ones refused naming the flag.
    #[test]
    fn the_shapes_are_those_the_ranks_and_the_model_allow() {
        let spec = ModelSpec::preset("llama-tiny").unwrap();
        let shapes = |ranks, given| -> Vec<(usize, usize, usize, u8)> {
            (meshes(&spec, ranks, given).unwrap().into_iter())
                .map(|(m, z)| (m.tensor, m.pipeline, m.data, z.0))
                .collect()
        };
        let all = shapes(4, (None, None, None));
        let mut want = Vec::new();
        for (t, p) in [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)] {
            let d = 4 / (t * p);
            let zs: Vec<u8> = if d > 1 { vec![0, 1, 2, 3] } else { vec![0] };
            want.extend(zs.into_iter().map(|z| (t, p, d, z)));
        }
        // KV heads 2: no --tp 4.
        assert_eq!(all, want);
        assert_eq!(
            shapes(4, (Some(2), None, Some(Zero(1)))),
            vec![(2, 1, 2, 1), (2, 2, 1, 1)]
        );
        assert_eq!(shapes(1, (None, None, None)), vec![(1, 1, 1, 0)]);
        let e = meshes(&spec, 4, (Some(3), None, None)).unwrap_err();
        assert!(e.to_string().contains("--tp 3"), "{e}");
        let e = meshes(&spec, 4, (None, Some(3), None)).unwrap_err();
        assert!(e.to_string().contains("--pp 3"), "{e}");
    }
}
