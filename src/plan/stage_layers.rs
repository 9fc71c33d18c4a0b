//! A pipeline's cut as counts of layers per stage (`--pp-layers 9,3`): how it is written, and
//! the check that it cuts the model (p runs of one layer or more covering its layers). Pure,
//! so the planner's checks use it without the cut's search ([`super::stage_cut`]).

use crate::ir::mesh::even_layers;
use anyhow::{Result, bail};

/// `9,3`.
pub fn list(counts: &[usize]) -> String {
    let c: Vec<String> = counts.iter().map(|c| c.to_string()).collect();
    c.join(",")
}

/// Refuses a cut that is not `p` runs of one layer or more covering the model's `n`,
/// naming `--pp-layers` and what would do.
pub fn check(counts: &[usize], p: usize, n: usize) -> Result<()> {
    let given = list(counts);
    if counts.len() != p {
        bail!(
            "--pp-layers {given} gives {} stages, but --pp is {p}: give one count per stage \
             (e.g. --pp-layers {}), or even, or auto",
            counts.len(),
            list(&even_layers(n, p))
        );
    }
    if counts.contains(&0) {
        bail!("--pp-layers {given}: every stage holds at least one layer");
    }
    let sum: usize = counts.iter().sum();
    if sum != n {
        bail!(
            "--pp-layers {given} holds {sum} layers, but the model has {n}: the counts must \
             add up to {n} (e.g. --pp-layers {})",
            list(&even_layers(n, p))
        );
    }
    Ok(())
}
