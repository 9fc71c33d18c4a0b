//! The plan's memory over one step, read back from `plan.json`: bytes live per category at
//! every op, the peak op, and the buffers live there. Reports are drawn from this (and from
//! `profile.json` when a run was profiled), so `memwall report RUN_DIR` needs nothing but the
//! run directory.

use crate::plan::Category;
use anyhow::{Context, Result, bail};
use serde::Deserialize;
use std::path::Path;

/// One buffer as `plan.json` lists it.
#[derive(Clone, Debug, Deserialize)]
pub struct BufferInfo {
    pub name: String,
    pub category: Category,
    pub dtype: String,
    pub bytes: u64,
    pub persistent: bool,
    pub first_op: usize,
    pub last_op: usize,
    pub offset: u64,
    #[serde(default)]
    pub external: bool,
}

/// One op of the schedule as `plan.json` lists it.
#[derive(Clone, Debug, Deserialize)]
pub struct OpInfo {
    pub name: String,
    /// forward, recompute, backward or optimizer.
    pub phase: String,
    pub flops: u64,
}

/// The parts of `plan.json` the reports use.
#[derive(Clone, Debug, Deserialize)]
pub struct PlanData {
    pub model_name: String,
    pub num_params: usize,
    /// The step configuration: batch, seq, threads, grad_accum, precision, recompute, ….
    pub config: serde_json::Value,
    // Fields added as memwall grew default to zero or "fp32", so older run directories
    // still get a report.
    #[serde(default = "fp32")]
    pub precision: String,
    pub total_bytes: u64,
    #[serde(default)]
    pub arena_bytes: u64,
    #[serde(default)]
    pub external_bytes: u64,
    #[serde(default)]
    pub peak_live_bytes: u64,
    #[serde(default)]
    pub baseline_bytes: u64,
    #[serde(default)]
    pub flops_per_step: u64,
    #[serde(default)]
    pub recompute_flops_per_step: u64,
    pub buffers: Vec<BufferInfo>,
    pub schedule: Vec<OpInfo>,
}

fn fp32() -> String {
    "fp32".into()
}

impl PlanData {
    /// Reads `plan.json`, naming the file in every error.
    pub fn load(path: &Path) -> Result<PlanData> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let p: PlanData = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a memwall plan.json (written by `memwall train`, `bench --profile` or `plan --json`)",
                path.display()
            )
        })?;
        p.check().with_context(|| format!("{}", path.display()))?;
        Ok(p)
    }

    /// From a plan in memory (`memwall plan --svg`), through the same JSON as `plan.json`.
    pub fn from_plan(plan: &crate::plan::Plan, baseline: u64) -> Result<PlanData> {
        let p: PlanData = serde_json::from_value(crate::plan::report::to_json(plan, baseline))?;
        p.check()?;
        Ok(p)
    }

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
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
            None => "?".into(),
        }
    }
}

/// Bytes live per category at every op of the schedule, the buffers outside the arena (which
/// live over the whole step) included.
#[derive(Clone, Debug)]
pub struct MemoryTimeline {
    /// Categories with any bytes, in `Category::ALL` order.
    pub categories: Vec<Category>,
    /// `live[op][k]`: bytes of `categories[k]` live at op `op`.
    pub live: Vec<Vec<u64>>,
    /// The op with the most bytes live (the first, if several).
    pub peak_op: usize,
    pub peak_bytes: u64,
}

impl MemoryTimeline {
    pub fn new(plan: &PlanData) -> MemoryTimeline {
        let n = plan.schedule.len();
        let categories: Vec<Category> = Category::ALL
            .into_iter()
            .filter(|c| plan.buffers.iter().any(|b| b.category == *c && b.bytes > 0))
            .collect();
        // Difference arrays per category: +bytes at first_op, -bytes after last_op.
        let mut delta = vec![vec![0i128; n + 1]; categories.len()];
        for b in &plan.buffers {
            if let Some(k) = categories.iter().position(|&c| c == b.category) {
                delta[k][b.first_op] += b.bytes as i128;
                delta[k][b.last_op + 1] -= b.bytes as i128;
            }
        }
        let mut cur = vec![0i128; categories.len()];
        let mut live = Vec::with_capacity(n);
        for op in 0..n {
            for (c, d) in cur.iter_mut().zip(&delta) {
                *c += d[op];
            }
            live.push(cur.iter().map(|&x| x as u64).collect::<Vec<u64>>());
        }
        let (mut peak_op, mut peak_bytes) = (0, 0);
        for (op, row) in live.iter().enumerate() {
            let total: u64 = row.iter().sum();
            if total > peak_bytes {
                (peak_op, peak_bytes) = (op, total);
            }
        }
        MemoryTimeline {
            categories,
            live,
            peak_op,
            peak_bytes,
        }
    }

    /// Total bytes live at `op`.
    pub fn total_at(&self, op: usize) -> u64 {
        self.live[op].iter().sum()
    }
}

/// The buffers live at `op`, largest first.
pub fn live_buffers(plan: &PlanData, op: usize) -> Vec<&BufferInfo> {
    let mut v: Vec<&BufferInfo> = plan
        .buffers
        .iter()
        .filter(|b| b.first_op <= op && op <= b.last_op)
        .collect();
    v.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
    v
}

/// Where one profiled step's op time went (microseconds): by phase in schedule order, and by
/// op kind (see [`op_kind`]) with the kind's FLOPs, largest time first.
pub struct StepTimes {
    pub phases: Vec<(String, f64)>,
    pub kinds: Vec<(String, f64, u64)>,
    /// Sum of the ops' durations.
    pub total_us: f64,
}

impl StepTimes {
    pub fn new(plan: &PlanData, step: &super::record::StepProfile) -> StepTimes {
        let mut t = StepTimes {
            phases: Vec::new(),
            kinds: Vec::new(),
            total_us: 0.0,
        };
        for o in &step.ops {
            let Some(info) = plan.schedule.get(o.op as usize) else {
                continue;
            };
            let d = o.end_us - o.start_us;
            t.total_us += d;
            match t.phases.iter_mut().find(|x| x.0 == info.phase) {
                Some(x) => x.1 += d,
                None => t.phases.push((info.phase.clone(), d)),
            }
            let kind = op_kind(&info.name);
            match t.kinds.iter_mut().find(|x| x.0 == kind) {
                Some(x) => (x.1, x.2) = (x.1 + d, x.2 + info.flops),
                None => t.kinds.push((kind.to_string(), d, info.flops)),
            }
        }
        t.kinds.sort_by(|a, b| b.1.total_cmp(&a.1));
        t
    }
}

/// An op's kind: its name without the micro-batch (`mb1.`) and layer (`h3.`) prefixes, so
/// `mb1.h3.fc` and `h0.fc` are both `fc`.
pub fn op_kind(name: &str) -> &str {
    let strip = |prefix: &str, name: &str| -> Option<usize> {
        let (head, _) = name.split_once('.')?;
        let digits = head.strip_prefix(prefix)?;
        (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then_some(head.len() + 1)
    };
    let mut kind = name;
    for p in ["mb", "h"] {
        if let Some(k) = strip(p, kind) {
            kind = &kind[k..];
        }
    }
    kind
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::model::ModelSpec;
    use crate::plan::{Mode, Recompute, StepConfig, build_plan};

    #[test]
    fn timeline_matches_the_plan_it_was_read_from() {
        let spec = ModelSpec::resolve("gpt2-tiny").unwrap();
        for r in [Recompute::None, Recompute::Full] {
            let mut cfg = StepConfig::new(2, 32, 1);
            cfg.recompute = r;
            let plan = build_plan(&spec, &cfg, Mode::Train, &Cpu).unwrap();
            let data = PlanData::from_plan(&plan, 0).unwrap();
            let tl = MemoryTimeline::new(&data);
            // The timeline also counts the buffers outside the arena, live over the whole step.
            let peak = plan.peak_live_bytes + plan.external_bytes;
            assert_eq!(tl.peak_bytes, peak, "{r}");
            assert_eq!(tl.total_at(tl.peak_op), peak);
            // Per category, the timeline at any op equals the plan's own accounting.
            for op in [0, plan.schedule.ops.len() / 2, plan.peak_op] {
                let want: Vec<u64> = plan
                    .live_by_category(op)
                    .into_iter()
                    .filter(|(c, _)| tl.categories.contains(c))
                    .map(|(_, b)| b)
                    .collect();
                assert_eq!(tl.live[op], want, "op {op}");
            }
            let at_peak = live_buffers(&data, tl.peak_op);
            assert_eq!(at_peak.iter().map(|b| b.bytes).sum::<u64>(), peak);
            assert!(at_peak.windows(2).all(|w| w[0].bytes >= w[1].bytes));
        }
    }

    #[test]
    fn op_kind_strips_micro_batch_and_layer() {
        assert_eq!(op_kind("mb1.h3.fc"), "fc");
        assert_eq!(op_kind("h11.re.gelu"), "re.gelu");
        assert_eq!(op_kind("lm_head"), "lm_head");
        assert_eq!(op_kind("hx.fc"), "hx.fc");
    }

    #[test]
    fn inconsistent_plan_json_is_refused_with_the_buffer_named() {
        let spec = ModelSpec::resolve("gpt2-tiny").unwrap();
        let plan = build_plan(&spec, &StepConfig::new(1, 16, 1), Mode::Train, &Cpu).unwrap();
        let mut v = crate::plan::report::to_json(&plan, 0);
        v["buffers"][3]["last_op"] = serde_json::json!(1_000_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        std::fs::write(&path, v.to_string()).unwrap();
        let e = format!("{:#}", PlanData::load(&path).unwrap_err());
        assert!(
            e.contains("plan.json") && e.contains("lives over ops"),
            "{e}"
        );
        std::fs::write(&path, "{\"model_name\": 3}").unwrap();
        let e = format!("{:#}", PlanData::load(&path).unwrap_err());
        assert!(e.contains("is not a memwall plan.json"), "{e}");
    }
}
