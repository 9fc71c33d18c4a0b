//! A plan's tiers as the user sees them: for each tier the backend declared (fastest
//! first; the CPU's: RAM, then the disk), what the plan packs there, its predicted peak and
//! the budget it must fit ([`Budgets`]: `--max-memory` for the tier ops compute on, the free
//! space of `--offload-dir` for the disk). `plan`, `--fit`, the reports and `plan.json` speak
//! of tiers by these names ([`TierUse`]).

use super::Plan;
use crate::ir::Tier;
use serde::{Deserialize, Serialize};

/// What each tier may hold, where the user or the machine says (a tier absent here is not
/// limited).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Budgets(Vec<(Tier, u64)>);

impl Budgets {
    /// No tier limited.
    pub const NONE: Budgets = Budgets(Vec::new());

    /// `compute` (`--max-memory`) for the tier ops compute on, `compute_tier`, and `disk`
    /// (the free space of `--offload-dir`) for the disk tier.
    pub fn new(compute_tier: Tier, compute: Option<u64>, disk: Option<u64>) -> Budgets {
        let limits = [(compute_tier, compute), (Tier::Nvme, disk)];
        Budgets(
            limits
                .into_iter()
                .filter_map(|(t, b)| Some((t, b?)))
                .collect(),
        )
    }

    /// These budgets, and `host` (`--max-host-memory`) for host RAM where it is not the
    /// compute tier (the pinned tier beneath a GPU).
    pub fn with_host(mut self, compute_tier: Tier, host: Option<u64>) -> Budgets {
        if let Some(b) = host.filter(|_| compute_tier != Tier::Host) {
            self.0.push((Tier::Host, b));
        }
        self
    }

    /// The budget of tier `t`, if it has one.
    pub fn of(&self, t: Tier) -> Option<u64> {
        self.0.iter().find(|(x, _)| *x == t).map(|&(_, b)| b)
    }

    /// The flag or fact a tier's budget comes from, for messages, in a plan computing on
    /// `compute`.
    pub fn source(t: Tier, compute: Tier) -> &'static str {
        match t {
            Tier::Nvme => "free at --offload-dir",
            t if t == compute => "--max-memory",
            _ => "--max-host-memory",
        }
    }
}

/// One tier of a plan: `plan.json`'s `tiers`, a line of `plan`'s tier table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierUse {
    pub tier: Tier,
    /// Its name in reports: `RAM`, `disk`, `device memory`, `host RAM` (beneath a GPU).
    pub name: String,
    /// Bytes the plan packs there: the size of the tier's arena or file.
    pub packed_bytes: u64,
    /// The most the tier holds while the plan runs ([`Plan::tier_peak`]).
    pub peak_bytes: u64,
    /// What it must fit, when known ([`Budgets`]).
    #[serde(default)]
    pub budget_bytes: Option<u64>,
}

impl TierUse {
    /// Bytes over its budget (0 when it fits or has none).
    pub fn over_by(&self) -> u64 {
        self.budget_bytes
            .map_or(0, |b| self.peak_bytes.saturating_sub(b))
    }
}

impl Plan {
    /// The most tier `t` holds while the plan runs: what the plan packs there; RAM also holds
    /// the owned buffers; the compute tier (the CPU's RAM, a GPU's memory) also holds the
    /// `baseline` (the CPU's: the process, measured; a GPU's: its context,
    /// [`crate::ir::Sizing::baseline_bytes`]) and the [`Plan::runtime_reserve`]. So, on the
    /// CPU, RAM's peak is the predicted peak RSS.
    pub fn tier_peak(&self, t: Tier, baseline: u64) -> u64 {
        let mut peak = self.tier_bytes(t);
        if t == Tier::Host {
            peak += self.external_bytes;
        }
        if t == self.compute_tier() {
            peak += baseline + self.runtime_reserve();
        }
        peak
    }

    /// Tier `t`'s name in this plan's reports: its own ([`Tier::describe`]), or `host RAM`
    /// beneath a GPU (its arena page-locked, so the GPU copies it directly; the loader's
    /// buffers beside it).
    pub fn tier_name(&self, t: Tier) -> &'static str {
        match t {
            Tier::Host if self.compute_tier() != Tier::Host => "host RAM",
            t => t.describe(),
        }
    }

    /// Each tier the plan packs, in the backend's order, with its peak and budget.
    pub fn tier_uses(&self, baseline: u64, budgets: &Budgets) -> Vec<TierUse> {
        self.tiers
            .iter()
            .map(|s| TierUse {
                tier: s.tier,
                name: self.tier_name(s.tier).to_string(),
                packed_bytes: s.bytes,
                peak_bytes: self.tier_peak(s.tier, baseline),
                budget_bytes: budgets.of(s.tier),
            })
            .collect()
    }

    /// The first tier whose peak exceeds its budget, if any.
    pub fn over_budget(&self, baseline: u64, budgets: &Budgets) -> Option<TierUse> {
        self.tier_uses(baseline, budgets)
            .into_iter()
            .find(|u| u.over_by() > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::under_test;
    use crate::model::ModelSpec;
    use crate::plan::{Mode, OffloadSet, StepConfig, build_plan};

    fn offloaded() -> Plan {
        let spec = ModelSpec::preset("gpt2-tiny").unwrap();
        let mut cfg = StepConfig::new(2, 32, 1);
        cfg.offload.set = OffloadSet::ALL;
        build_plan(&spec, &cfg, Mode::Train, under_test()).unwrap()
    }

    #[test]
    fn ram_peak_is_the_predicted_peak_and_the_disk_holds_its_file() {
        let plan = offloaded();
        let uses = plan.tier_uses(1000, &Budgets::NONE);
        let names: Vec<&str> = uses.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["RAM", "disk"]);
        assert_eq!(uses[0].peak_bytes, plan.predicted_peak(1000));
        assert_eq!(uses[0].packed_bytes, plan.arena_bytes());
        assert!(plan.nvme_bytes() > 0);
        assert_eq!(
            (uses[1].packed_bytes, uses[1].peak_bytes),
            (plan.nvme_bytes(), plan.nvme_bytes())
        );
    }

    #[test]
    fn the_first_tier_over_its_budget_is_named() {
        let plan = offloaded();
        let (ram, disk) = (plan.predicted_peak(0), plan.nvme_bytes());
        let fits = Budgets::new(Tier::Host, Some(ram), Some(disk));
        assert_eq!(plan.over_budget(0, &fits), None);
        let small_disk = Budgets::new(Tier::Host, Some(ram), Some(disk - 1));
        let over = plan.over_budget(0, &small_disk).unwrap();
        assert_eq!((over.name.as_str(), over.over_by()), ("disk", 1));
        let small_ram = Budgets::new(Tier::Host, Some(ram - 5), None);
        let over = plan.over_budget(0, &small_ram).unwrap();
        assert_eq!((over.tier, over.over_by()), (Tier::Host, 5));
    }
}
