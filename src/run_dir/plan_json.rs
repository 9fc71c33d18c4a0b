//! `plan.json`: the plan of one step — totals, bytes by category, every buffer with its live
//! interval and offset, and the schedule. `memwall train` and `bench --profile` write it into
//! the run directory and `memwall plan --json` prints it; the reports (`profile`) read it back,
//! so that `memwall report RUN_DIR` needs no model and no executor.
//!
//! One type, [`PlanJson`], is both sides: the writer serialises what
//! [`PlanJson::from_plan`] builds, the reader deserialises the same type, so a field cannot be
//! written under one name and read under another. Objects are written with their keys sorted
//! (as `plan.json` always was). Fields added as memwall grew have defaults, so run directories
//! of older versions still get a report.

use crate::ir::{Category, Tier};
use crate::plan::{Budgets, Plan, TierUse};
use crate::util::atomic;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::Path;

/// Bytes by category name (`"activations"`, …), in `Category::ALL` order when written.
pub type CategoryBytes = Map<String, Value>;

/// One buffer as `plan.json` lists it (the plan's `Buffer`, field by field).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BufferInfo {
    pub name: String,
    pub category: Category,
    /// `f32`, `bf16`, …, or the ggml block type of a quantized base (`q4_0`, `q6_k`; older
    /// files say `u8` and count its bytes as its elements).
    pub dtype: String,
    /// Elements (of ggml blocks: values).
    #[serde(default)]
    pub elems: usize,
    pub bytes: u64,
    pub persistent: bool,
    pub first_op: usize,
    pub last_op: usize,
    /// Byte offset in its tier's arena (0 for owned buffers).
    pub offset: u64,
    /// Allocated by its owner outside the arenas (the tier `owned`).
    #[serde(default)]
    pub external: bool,
    /// The memory tier (`host`, `owned`); files older than tiers have `external` alone.
    #[serde(default = "host")]
    pub tier: Tier,
}

fn host() -> Tier {
    Tier::Host
}

/// One op of the schedule as `plan.json` lists it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OpInfo {
    pub name: String,
    /// forward, recompute, backward, optimizer or deferred_update.
    pub phase: String,
    pub flops: u64,
    /// The op runs on the host's cores beside a GPU (an update whose state is in pinned RAM,
    /// `OpEntry::runs_on_host`); absent for the ops of the compute tier.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub on_host: bool,
}

/// The content of `plan.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PlanJson {
    /// The model's Hugging Face config (`ModelSpec::to_hf_config`).
    #[serde(default)]
    pub model: Value,
    pub model_name: String,
    pub num_params: usize,
    /// `train` or `generate`.
    #[serde(default)]
    pub mode: Value,
    /// The step configuration: batch, seq, threads, grad_accum, precision, recompute, ….
    pub config: Value,
    #[serde(default = "fp32")]
    pub precision: String,
    /// Arena plus the buffers outside it.
    pub total_bytes: u64,
    #[serde(default)]
    pub arena_bytes: u64,
    #[serde(default)]
    pub external_bytes: u64,
    /// The most arena bytes live at one op (the packing's lower bound).
    #[serde(default)]
    pub peak_live_bytes: u64,
    /// The name of the op where `peak_live_bytes` is reached.
    #[serde(default)]
    pub peak_op: String,
    /// The process's resident memory before the plan was allocated (measured).
    #[serde(default)]
    pub baseline_bytes: u64,
    /// What the run touches outside the plan after the baseline (`Plan::runtime_reserve`),
    /// counted in the predicted peak.
    #[serde(default)]
    pub runtime_reserve_bytes: u64,
    /// Plan + baseline + runtime reserve: what `--max-memory` is checked against.
    #[serde(default)]
    pub predicted_peak_rss_bytes: u64,
    /// The sum of each category's buffers.
    #[serde(default)]
    pub by_category: CategoryBytes,
    /// Each category's own peak (the most of its bytes live at one op).
    #[serde(default)]
    pub peak_by_category: CategoryBytes,
    /// Each category's bytes live at the plan's peak op.
    #[serde(default)]
    pub live_at_peak_by_category: CategoryBytes,
    #[serde(default)]
    pub flops_per_step: u64,
    #[serde(default)]
    pub recompute_flops_per_step: u64,
    /// Bytes per memory tier: `host` (the plan total in RAM) and `nvme` (the offload file).
    #[serde(default)]
    pub by_tier: CategoryBytes,
    /// Each tier the plan packs, fastest first (ops compute on the first): its name, packed
    /// bytes, predicted peak and, when known, its budget (absent in older files).
    #[serde(default)]
    pub tiers: Vec<TierUse>,
    /// Bytes read from and written to the disk tier per step (`--offload`).
    #[serde(default)]
    pub io_read_bytes_per_step: u64,
    #[serde(default)]
    pub io_write_bytes_per_step: u64,
    /// Predicted seconds of one training step (`plan::time`; absent in older files).
    #[serde(default)]
    pub predicted_step_s: Option<f64>,
    /// The prediction's parts (compute, I/O, stall, bound) and where its calibration came from.
    #[serde(default)]
    pub predicted: Option<Value>,
    /// The `--fit` search that chose this configuration: its budget, its ranked candidates
    /// with their predicted times, and what did not fit.
    #[serde(default)]
    pub fit: Option<Value>,
    /// Bytes this rank sends per step in collectives (0 for one process).
    #[serde(default)]
    pub comm_bytes_per_step: u64,
    /// Plans of one rank among several (`--ranks N`, `mpirun -np N`): ranks, ZeRO stage,
    /// what is sent by collective, the model state held and the ZeRO paper's figure for it
    /// ([`crate::plan::zero::PerRank`]).
    #[serde(default)]
    pub per_rank: Option<Value>,
    /// Every rank of the job (`memwall plan --ranks N`, N > 1), in MPI order: `rank`,
    /// `coords` (`dp`, `tp`, `pp`), `num_params`, `predicted_peak_rss_bytes` and
    /// `by_category` ([`crate::plan::ranks::RankPlan`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Value>,
    pub buffers: Vec<BufferInfo>,
    pub schedule: Vec<OpInfo>,
}

fn fp32() -> String {
    "fp32".into()
}

/// How a value serialises as a JSON string (a unit enum: `"bf16"`, `"forward"`).
fn spelling(v: &impl Serialize) -> Result<String> {
    Ok(serde_json::from_value(serde_json::to_value(v)?)?)
}

fn by_category(bytes: Vec<(Category, u64)>) -> CategoryBytes {
    bytes
        .into_iter()
        .map(|(c, b)| (c.name().to_string(), Value::from(b)))
        .collect()
}

impl PlanJson {
    /// The `plan.json` of `plan`, with the process's measured `baseline` memory.
    pub fn from_plan(plan: &Plan, baseline: u64) -> Result<PlanJson> {
        let buffers = plan
            .buffers
            .iter()
            .map(|b| {
                Ok(BufferInfo {
                    name: b.name.clone(),
                    category: b.category,
                    dtype: spelling(&b.dtype)?,
                    elems: b.elems,
                    bytes: b.bytes,
                    persistent: b.persistent,
                    first_op: b.first_op,
                    last_op: b.last_op,
                    offset: b.placement.offset,
                    external: b.is_owned(),
                    tier: b.placement.tier,
                })
            })
            .collect::<Result<_>>()?;
        let schedule = plan
            .schedule
            .ops
            .iter()
            .map(|o| {
                Ok(OpInfo {
                    name: o.name.clone(),
                    phase: spelling(&o.phase)?,
                    flops: o.flops,
                    on_host: o.runs_on_host(&plan.buffers, plan.compute_tier()),
                })
            })
            .collect::<Result<_>>()?;
        let (io_read, io_write) = plan.io_bytes_per_step();
        let p = PlanJson {
            model: plan.spec.to_hf_config(),
            model_name: plan.spec.name.clone(),
            num_params: plan.layout.total,
            mode: serde_json::to_value(plan.mode)?,
            config: serde_json::to_value(&plan.cfg)?,
            precision: plan.cfg.precision.to_string(),
            total_bytes: plan.total_bytes(),
            arena_bytes: plan.arena_bytes(),
            external_bytes: plan.external_bytes,
            peak_live_bytes: plan.peak_live_bytes,
            peak_op: plan.schedule.ops[plan.peak_op].name.clone(),
            baseline_bytes: baseline,
            runtime_reserve_bytes: plan.runtime_reserve(),
            predicted_peak_rss_bytes: plan.predicted_peak(baseline),
            by_category: by_category(plan.bytes_by_category()),
            peak_by_category: by_category(plan.peak_by_category()),
            live_at_peak_by_category: by_category(plan.live_by_category(plan.peak_op)),
            flops_per_step: plan.flops(),
            recompute_flops_per_step: plan.recompute_flops(),
            by_tier: plan.by_tier(),
            tiers: plan.tier_uses(baseline, &Budgets::NONE),
            io_read_bytes_per_step: io_read,
            io_write_bytes_per_step: io_write,
            predicted_step_s: None,
            predicted: None,
            fit: None,
            comm_bytes_per_step: plan.comm_bytes_per_step(),
            per_rank: (plan.cfg.mesh.data > 1 || plan.cfg.zero.0 > 0)
                .then(|| serde_json::to_value(crate::plan::zero::per_rank(plan)))
                .transpose()?,
            ranks: None,
            buffers,
            schedule,
        };
        p.check()?;
        Ok(p)
    }

    /// Records each tier's budget (`--max-memory`, the free space of `--offload-dir`).
    pub fn with_budgets(mut self, budgets: &Budgets) -> PlanJson {
        for u in &mut self.tiers {
            u.budget_bytes = budgets.of(u.tier);
        }
        self
    }

    /// Records the plan's predicted step time `t`, from calibration `cal`.
    pub fn with_prediction(
        mut self,
        t: &crate::plan::time::StepTime,
        cal: &crate::plan::time::Calibration,
    ) -> PlanJson {
        self.predicted_step_s = Some(t.step_s);
        self.predicted = Some(serde_json::json!({
            "compute_s": t.compute_s, "io_s": t.io_s, "stall_s": t.stall_s, "bound": t.bound,
            "comm_s": t.comm_s, "comm_wait_s": t.comm_wait_s, "bubble_s": t.bubble_s,
            "estimated": t.estimated, "calibration": cal.describe(),
        }));
        if self.comm_bytes_per_step > 0 {
            // The whole job's processes (the data ranks times the tensor and pipeline ones).
            let axis = |k: &str| self.config.get(k).and_then(Value::as_u64).unwrap_or(1);
            let data = (self.per_rank.as_ref()).and_then(|p| p["ranks"].as_u64());
            let ranks = data.unwrap_or(1) * axis("tensor") * axis("pipeline");
            if let Some(p) = self.predicted.as_mut() {
                p["collectives"] = cal.describe_transport(ranks as usize).into();
            }
        }
        self
    }

    /// The file's text: pretty-printed, every object's keys sorted.
    pub fn to_pretty_json(&self) -> Result<String> {
        // Through a `Value`, whose objects are sorted maps: the key order plan.json has always
        // had (scripts and diffs of older runs rely on it), not the declaration order.
        Ok(serde_json::to_string_pretty(&serde_json::to_value(self)?)?)
    }

    /// Writes `path` (atomically).
    pub fn write(&self, path: &Path) -> Result<()> {
        atomic::write_file(path, self.to_pretty_json()?.as_bytes())
    }

    /// Reads `plan.json`, naming the file in every error.
    pub fn load(path: &Path) -> Result<PlanJson> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let p: PlanJson = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a memwall plan.json (written by `memwall train`, `bench --profile` or `plan --json`)",
                path.display()
            )
        })?;
        p.check().with_context(|| format!("{}", path.display()))?;
        Ok(p)
    }

    /// Checks what the reports rely on: a schedule, and buffers living within it.
    fn check(&self) -> Result<()> {
        if self.schedule.is_empty() {
            bail!("field 'schedule' is empty");
        }
        let n = self.schedule.len();
        if let Some(b) = self
            .buffers
            .iter()
            .find(|b| b.first_op > b.last_op || b.last_op >= n)
        {
            bail!(
                "buffer '{}' lives over ops {}..={} but the schedule has {n} ops",
                b.name,
                b.first_op,
                b.last_op
            );
        }
        Ok(())
    }

    /// A configuration field as text (`"?"` when absent).
    pub fn config_str(&self, key: &str) -> String {
        match self.config.get(key) {
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
            None => "?".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::under_test as backend;
    use crate::ir::{OptimState, Precision, Recompute};
    use crate::model::ModelSpec;
    use crate::plan::{Mode, StepConfig, build_plan};

    fn plans() -> Vec<Plan> {
        let spec = ModelSpec::resolve("gpt2-tiny").unwrap();
        let mut out = Vec::new();
        for (r, accum, p, o) in [
            (Recompute::None, 1, Precision::F32, OptimState::F32),
            (Recompute::Full, 2, Precision::Bf16, OptimState::Int8),
            (Recompute::Selective, 1, Precision::F16, OptimState::Bf16),
        ] {
            let mut cfg = StepConfig::new(2, 32, 2);
            (
                cfg.recompute,
                cfg.grad_accum,
                cfg.precision,
                cfg.optim_state,
            ) = (r, accum, p, o);
            out.push(build_plan(&spec, &cfg, Mode::Train, backend()).unwrap());
        }
        out.push(build_plan(&spec, &StepConfig::new(1, 16, 1), Mode::Generate, backend()).unwrap());
        out
    }

    /// What is written reads back as itself, byte for byte, and keeps the plan's totals.
    #[test]
    fn written_plan_json_reads_back_as_itself() {
        for plan in plans() {
            let got = PlanJson::from_plan(&plan, 12345).unwrap();
            let want = got.to_pretty_json().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join(super::super::PLAN_FILE);
            got.write(&path).unwrap();
            assert_eq!(std::fs::read_to_string(&path).unwrap(), want);
            let back = PlanJson::load(&path).unwrap();
            assert_eq!(back.to_pretty_json().unwrap(), want);
            assert_eq!(back.total_bytes, plan.total_bytes());
            assert_eq!(back.arena_bytes, plan.arena_bytes());
            assert_eq!(back.buffers.len(), plan.buffers.len());
            let owned = back.buffers.iter().filter(|b| b.tier == Tier::Owned);
            assert!(owned.clone().all(|b| b.external) && owned.count() > 0);
        }
    }

    #[test]
    fn older_files_without_the_later_fields_still_load() {
        let plan = &plans()[0];
        let mut v = serde_json::to_value(PlanJson::from_plan(plan, 0).unwrap()).unwrap();
        let o = v.as_object_mut().unwrap();
        for k in [
            "model",
            "mode",
            "precision",
            "arena_bytes",
            "external_bytes",
            "peak_live_bytes",
            "peak_op",
            "baseline_bytes",
            "runtime_reserve_bytes",
            "predicted_peak_rss_bytes",
            "by_category",
            "peak_by_category",
            "live_at_peak_by_category",
            "flops_per_step",
            "recompute_flops_per_step",
            "tiers",
        ] {
            o.remove(k).unwrap();
        }
        for b in o["buffers"].as_array_mut().unwrap() {
            let b = b.as_object_mut().unwrap();
            b.remove("elems");
            b.remove("external");
            b.remove("tier");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        std::fs::write(&path, v.to_string()).unwrap();
        let p = PlanJson::load(&path).unwrap();
        assert_eq!((p.precision.as_str(), p.arena_bytes), ("fp32", 0));
        assert_eq!(p.total_bytes, plan.total_bytes());
        assert_eq!(p.buffers.len(), plan.buffers.len());
    }

    #[test]
    fn inconsistent_plan_json_is_refused_with_the_buffer_named() {
        let plan = &plans()[0];
        let mut v = serde_json::to_value(PlanJson::from_plan(plan, 0).unwrap()).unwrap();
        v["buffers"][3]["last_op"] = serde_json::json!(1_000_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        std::fs::write(&path, v.to_string()).unwrap();
        let e = format!("{:#}", PlanJson::load(&path).unwrap_err());
        assert!(
            e.contains("plan.json") && e.contains("lives over ops"),
            "{e}"
        );
        std::fs::write(&path, "{\"model_name\": 3}").unwrap();
        let e = format!("{:#}", PlanJson::load(&path).unwrap_err());
        assert!(e.contains("is not a memwall plan.json"), "{e}");
    }
}
