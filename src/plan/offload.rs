//! `--offload`: which state lives on the disk tier ([`crate::ir::Tier::Nvme`]) between its uses,
//! and where that tier's file is. A placement is a plan transformation like the others: the
//! planner puts the chosen buffers on the disk tier and emits the transfers that bring each
//! into a host staging buffer before its use and write it back after, so the staging bytes
//! are in the plan and the host peak stays predicted exactly.
//!
//! The transformation itself is `plan::stage`; this module names what it applies to:
//! `optimizer` (the AdamW moments), `params` (read one parameter group at a time before its
//! forward, its backward and its update; a LoRA plan's frozen base too, read and never
//! written), `grads` (written after each group's backward, read
//! back for the update; with them the update is deferred into the next step's forward, see
//! [`super::build`]), `activations` (what the forward keeps for the backward), `all`, or
//! `auto` ([`OffloadChoice::Auto`]: the fastest placement that fits `--max-memory` by
//! predicted step time, [`super::fit::plan_fitting`]).
//!
//! What the rest of memwall does with it: the disk tier is one preallocated file
//! ([`crate::mem::disk`]) whose transfers run in order on the device's one I/O thread, so a
//! read queued after a write of the same bytes sees them. `plan.json` and `bench` give
//! `by_tier`, `io_read_bytes_per_step` and `io_write_bytes_per_step` (a step's I/O,
//! `Plan::io_bytes_per_step`, counts the phases a step runs), `bench` the I/O thread's busy
//! time and the time ops waited (`io_busy_s`, `stall_s`). Profiled steps show every transfer on
//! the trace's I/O track (timed on the I/O thread, taken after each executor run through
//! `Device::take_io_spans`); they add up to the plan's bytes read and written per step.
//! Checkpoints stream offloaded parameters and moments one group's buffer at a time, fresh
//! parameters are initialised group by group, and `--resume` and `--init` load group by group
//! ([`crate::exec::executor`]'s `fill_params`, `fill_moments` and `save_checkpoint`), so
//! neither a save nor a load needs the state whole in RAM (`tests/ckpt_memory.rs` bounds it: a
//! save and a resume of 217 MiB of offloaded state each took about 2 MiB beyond the plan).
//!
//! **Invariant:** offload changes no value: every placement gives bitwise the weights of a run
//! in RAM (`tests/strategies.rs`, `tests/offload.rs`).

use crate::ir::serde_as_flag_text;
use anyhow::{Result, bail};
use serde::Serialize;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// What lives on the disk tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct OffloadSet {
    /// The AdamW moments (and their 8-bit block scales).
    pub optimizer: bool,
    /// The parameters (the fp32 master weights under mixed precision), streamed one group
    /// at a time through the forward, the backward and the optimizer.
    pub params: bool,
    /// The parameter gradients, written after each group's backward and read back for the
    /// next micro-batch's and for the update.
    pub grads: bool,
    /// Activations kept from the forward for the backward (under recomputation, the block
    /// inputs), written after their last forward use and read back before the backward's.
    pub activations: bool,
}

impl OffloadSet {
    pub const NONE: OffloadSet = OffloadSet {
        optimizer: false,
        params: false,
        grads: false,
        activations: false,
    };
    pub const ALL: OffloadSet = OffloadSet {
        optimizer: true,
        params: true,
        grads: true,
        activations: true,
    };

    /// Whether it keeps the update's whole state (parameters, gradients, moments) beneath
    /// the compute tier: beneath a GPU the update then runs on the host's cores, in place.
    pub fn holds_the_update(self) -> bool {
        self.params && self.grads && self.optimizer
    }

    /// Whether anything is offloaded.
    pub fn any(self) -> bool {
        self != OffloadSet::NONE
    }

    /// Every placement, from nothing offloaded to everything (what `--offload auto` tries).
    pub fn every() -> Vec<OffloadSet> {
        (0..16u8)
            .map(|bits| OffloadSet {
                optimizer: bits & 1 != 0,
                params: bits & 2 != 0,
                grads: bits & 4 != 0,
                activations: bits & 8 != 0,
            })
            .collect()
    }

    fn parts(self) -> [(bool, &'static str); 4] {
        [
            (self.optimizer, "optimizer"),
            (self.params, "params"),
            (self.grads, "grads"),
            (self.activations, "activations"),
        ]
    }
}

impl FromStr for OffloadSet {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<OffloadSet> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        if parts.len() > 1
            && let Some(alone) = parts.iter().find(|p| matches!(**p, "none" | "all"))
        {
            bail!(
                "--offload {s}: {alone} stands alone (it names every part, or none); give it \
                 by itself, or a comma list of optimizer, params, grads, activations"
            );
        }
        let mut set = OffloadSet::NONE;
        for part in s.split(',').map(str::trim) {
            match part {
                "none" => {}
                "all" => set = OffloadSet::ALL,
                "optimizer" => set.optimizer = true,
                "params" => set.params = true,
                "grads" => set.grads = true,
                "activations" => set.activations = true,
                "auto" => {
                    bail!("--offload auto cannot be combined with other placements (it picks one)")
                }
                other => bail!(
                    "--offload {other}: expected none, all, auto, or a comma list of optimizer, \
                     params, grads, activations (what to keep beneath the compute tier: on disk, \
                     or in host RAM beneath a GPU)"
                ),
            }
        }
        Ok(set)
    }
}

impl fmt::Display for OffloadSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == OffloadSet::NONE {
            return f.write_str("none");
        }
        if *self == OffloadSet::ALL {
            return f.write_str("all");
        }
        let names: Vec<&str> = self
            .parts()
            .into_iter()
            .filter(|p| p.0)
            .map(|p| p.1)
            .collect();
        f.write_str(&names.join(","))
    }
}

serde_as_flag_text!(OffloadSet);

/// `--offload`: a placement, or `auto` (the placement with the least I/O per step that fits
/// `--max-memory`, chosen by `plan::fit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffloadChoice {
    Set(OffloadSet),
    Auto,
}

impl Default for OffloadChoice {
    fn default() -> OffloadChoice {
        OffloadChoice::Set(OffloadSet::NONE)
    }
}

impl FromStr for OffloadChoice {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<OffloadChoice> {
        if s.trim() == "auto" {
            return Ok(OffloadChoice::Auto);
        }
        s.parse().map(OffloadChoice::Set)
    }
}

serde_as_flag_text!(OffloadChoice);

impl OffloadChoice {
    /// Whether this may put anything on disk (so an offload directory is needed).
    pub fn may_offload(self) -> bool {
        self != OffloadChoice::Set(OffloadSet::NONE)
    }

    /// Whether this is a placement that keeps the update's whole state beneath the compute
    /// tier ([`OffloadSet::holds_the_update`]), so that beneath a GPU `--update in-backward`
    /// runs (each update on the host's cores).
    pub fn holds_the_update(self) -> bool {
        matches!(self, OffloadChoice::Set(s) if s.holds_the_update())
    }

    /// The placements to try: the one asked for, or every one for `auto`.
    pub fn candidates(self) -> Vec<OffloadSet> {
        match self {
            OffloadChoice::Set(s) => vec![s],
            OffloadChoice::Auto => OffloadSet::every(),
        }
    }
}

impl fmt::Display for OffloadChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OffloadChoice::Set(s) => s.fmt(f),
            OffloadChoice::Auto => f.write_str("auto"),
        }
    }
}

/// The offload placement of a plan and the directory of its disk tier's file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Offload {
    pub set: OffloadSet,
    /// Directory of the offload file (`--offload-dir`; the trainer's default is `offload/` in
    /// the run directory). `None` only for plans that offload nothing or are never started
    /// (`memwall plan`).
    pub dir: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prints_and_refuses_by_name() {
        assert_eq!("none".parse::<OffloadSet>().unwrap(), OffloadSet::NONE);
        assert_eq!("all".parse::<OffloadSet>().unwrap(), OffloadSet::ALL);
        let s: OffloadSet = "params, optimizer".parse().unwrap();
        assert!(s.optimizer && s.params && !s.grads && !s.activations);
        assert_eq!(s.to_string(), "optimizer,params");
        for set in OffloadSet::every() {
            assert_eq!(set.to_string().parse::<OffloadSet>().unwrap(), set);
        }
        assert_eq!(OffloadSet::every().len(), 16);
        assert_eq!(
            "auto".parse::<OffloadChoice>().unwrap(),
            OffloadChoice::Auto
        );
        let e = format!("{:#}", "disk".parse::<OffloadSet>().unwrap_err());
        assert!(e.contains("--offload disk") && e.contains("params"), "{e}");
        let e = format!("{:#}", "auto,params".parse::<OffloadChoice>().unwrap_err());
        assert!(e.contains("auto"), "{e}");
        for both in ["none,all", "params,none", "all, grads"] {
            let e = format!("{:#}", both.parse::<OffloadSet>().unwrap_err());
            assert!(e.contains("stands alone"), "{both}: {e}");
        }
    }
}
