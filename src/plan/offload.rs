//! `--offload`: which state lives on the disk tier ([`super::Tier::Nvme`]) between its uses,
//! and where that tier's file is. A placement is a plan transformation like the others: the
//! planner puts the chosen buffers on the disk tier and emits the transfers that bring each
//! into a host staging buffer before its use and write it back after, so the staging bytes
//! are in the plan and the host peak stays predicted exactly.
//!
//! Today: `optimizer` (the AdamW moments, streamed one parameter group at a time through the
//! optimizer phase). Parameters, gradients and activations come next.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// What lives on the disk tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadSet {
    /// The AdamW moments (and their 8-bit block scales).
    pub optimizer: bool,
}

impl OffloadSet {
    pub const NONE: OffloadSet = OffloadSet { optimizer: false };

    /// Whether anything is offloaded.
    pub fn any(self) -> bool {
        self.optimizer
    }
}

impl FromStr for OffloadSet {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<OffloadSet> {
        let mut set = OffloadSet::NONE;
        for part in s.split(',').map(str::trim) {
            match part {
                "none" => {}
                "optimizer" => set.optimizer = true,
                "params" | "grads" | "activations" | "all" | "auto" => bail!(
                    "--offload {part}: not implemented yet; this version offloads `optimizer` \
                     (the AdamW moments) only"
                ),
                other => bail!(
                    "--offload {other}: expected none or optimizer (a comma list of what to keep \
                     on disk)"
                ),
            }
        }
        Ok(set)
    }
}

impl fmt::Display for OffloadSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.optimizer { "optimizer" } else { "none" })
    }
}

impl Serialize for OffloadSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for OffloadSet {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<OffloadSet, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(|e| serde::de::Error::custom(format!("{e:#}")))
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

/// Name of the disk tier's file inside the offload directory.
pub const OFFLOAD_FILE: &str = "memwall-offload.bin";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses_by_name() {
        assert_eq!("none".parse::<OffloadSet>().unwrap(), OffloadSet::NONE);
        assert!("optimizer".parse::<OffloadSet>().unwrap().optimizer);
        assert_eq!(OffloadSet { optimizer: true }.to_string(), "optimizer");
        let e = format!("{:#}", "params".parse::<OffloadSet>().unwrap_err());
        assert!(
            e.contains("--offload params") && e.contains("optimizer"),
            "{e}"
        );
        let e = format!("{:#}", "disk".parse::<OffloadSet>().unwrap_err());
        assert!(e.contains("--offload disk"), "{e}");
    }
}
