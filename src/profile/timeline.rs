//! The plan's memory over one step, computed from `plan.json` ([`PlanJson`]): bytes live per
//! category at every op, the peak op, and the buffers live there. Reports are drawn from this (and from
//! `profile.json` when a run was profiled), so `memwall report RUN_DIR` needs nothing but the
//! run directory.

use crate::ir::{Category, Tier};
use crate::plan::packing::live_bytes_per_op;
use crate::run_dir::{BufferInfo, PlanJson};

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
    /// `disk[op]`: bytes of the disk tier's buffers (`--offload`: the offload file) live at
    /// op `op`; empty when the plan has no disk tier. Not memory, so not in `live`.
    pub disk: Vec<u64>,
}

impl MemoryTimeline {
    pub fn new(plan: &PlanJson) -> MemoryTimeline {
        let n = plan.schedule.len();
        let categories: Vec<Category> = Category::ALL
            .into_iter()
            .filter(|c| in_ram(plan).any(|b| b.category == *c && b.bytes > 0))
            .collect();
        // One sweep per category (the planner's own), transposed to rows per op.
        let per_category: Vec<Vec<u64>> = categories
            .iter()
            .map(|&c| {
                let of_c = in_ram(plan).filter(|b| b.category == c);
                live_bytes_per_op(of_c.map(|b| (b.first_op, b.last_op, b.bytes)), n)
            })
            .collect();
        let live: Vec<Vec<u64>> = (0..n)
            .map(|op| per_category.iter().map(|l| l[op]).collect())
            .collect();
        let (mut peak_op, mut peak_bytes) = (0, 0);
        for (op, row) in live.iter().enumerate() {
            let total: u64 = row.iter().sum();
            if total > peak_bytes {
                (peak_op, peak_bytes) = (op, total);
            }
        }
        let on_disk = plan.buffers.iter().filter(|b| b.tier == Tier::Nvme);
        let disk = match on_disk.clone().next() {
            None => Vec::new(),
            Some(_) => live_bytes_per_op(on_disk.map(|b| (b.first_op, b.last_op, b.bytes)), n),
        };
        MemoryTimeline {
            categories,
            live,
            peak_op,
            peak_bytes,
            disk,
        }
    }

    /// Total bytes live at `op`.
    pub fn total_at(&self, op: usize) -> u64 {
        self.live[op].iter().sum()
    }
}

/// The buffers in the compute tier's memory (the CPU's RAM, a GPU's: the tiers beneath are
/// not stacked with it; `plan.json`'s `by_tier` has them).
fn in_ram(plan: &PlanJson) -> impl Iterator<Item = &BufferInfo> {
    let compute = plan.tiers.first().map_or(Tier::Host, |u| u.tier);
    plan.buffers.iter().filter(move |b| b.tier.held_in(compute))
}

/// The buffers live at `op`, largest first.
pub fn live_buffers(plan: &PlanJson, op: usize) -> Vec<&BufferInfo> {
    let mut v: Vec<&BufferInfo> = in_ram(plan)
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
    pub fn new(plan: &PlanJson, step: &super::record::StepProfile) -> StepTimes {
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

/// The disk tier in one line, when the plan has one (`--offload`): the offload file's size,
/// the most of it live at once, and the bytes read and written per step.
pub fn disk_tier_line(plan: &PlanJson, tl: &MemoryTimeline) -> Option<String> {
    use crate::util::bytes::fmt_bytes;
    let file = plan
        .by_tier
        .get("nvme")
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    if file == 0 && tl.disk.is_empty() {
        return None;
    }
    Some(format!(
        "{} on disk (offload file; {} live at most), read/written per step: {} / {}",
        fmt_bytes(file),
        fmt_bytes(tl.disk.iter().copied().max().unwrap_or(0)),
        fmt_bytes(plan.io_read_bytes_per_step),
        fmt_bytes(plan.io_write_bytes_per_step)
    ))
}

/// The disk tier's transfers in one profiled step (its I/O spans with a direction).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepIo {
    pub reads: usize,
    pub read_bytes: u64,
    /// Sum of the reads' durations (microseconds).
    pub read_us: f64,
    pub writes: usize,
    pub write_bytes: u64,
    pub write_us: f64,
}

impl StepIo {
    /// `None` when the step recorded no transfer of a tier.
    pub fn new(step: &super::record::StepProfile) -> Option<StepIo> {
        use super::record::Direction;
        let mut io = StepIo::default();
        for sp in &step.spans {
            let b = sp.bytes.unwrap_or(0);
            let d = sp.end_us - sp.start_us;
            match sp.direction {
                Some(Direction::Read) => {
                    (io.reads, io.read_bytes, io.read_us) =
                        (io.reads + 1, io.read_bytes + b, io.read_us + d)
                }
                Some(Direction::Write) => {
                    (io.writes, io.write_bytes, io.write_us) =
                        (io.writes + 1, io.write_bytes + b, io.write_us + d)
                }
                None => {}
            }
        }
        (io.reads + io.writes > 0).then_some(io)
    }

    /// One line: counts, bytes and rates of the reads and writes, and the I/O thread's busy
    /// time against the step's `step_us`.
    pub fn line(&self, step_us: f64) -> String {
        use crate::util::bytes::fmt_bytes;
        let rate = |b: u64, us: f64| if us > 0.0 { b as f64 / us / 1e3 } else { 0.0 };
        format!(
            "{} reads, {} at {:.2} GB/s; {} writes, {} at {:.2} GB/s; disk busy {:.1} ms of the step's {:.1} ms",
            self.reads,
            fmt_bytes(self.read_bytes),
            rate(self.read_bytes, self.read_us),
            self.writes,
            fmt_bytes(self.write_bytes),
            rate(self.write_bytes, self.write_us),
            (self.read_us + self.write_us) / 1e3,
            step_us / 1e3
        )
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
    use crate::backend::under_test as backend;
    use crate::ir::Recompute;
    use crate::model::ModelSpec;
    use crate::plan::{Mode, StepConfig, build_plan};

    #[test]
    fn timeline_matches_the_plan_it_was_read_from() {
        let spec = ModelSpec::resolve("gpt2-tiny").unwrap();
        for r in [Recompute::None, Recompute::Full] {
            let mut cfg = StepConfig::new(2, 32, 1);
            cfg.recompute = r;
            let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
            let data = PlanJson::from_plan(&plan, 0).unwrap();
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
}
