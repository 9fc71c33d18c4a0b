//! Presenting a plan: the category table `memwall plan` prints, and `plan.json`.
//!
//! Per category, three figures: the sum of its buffers' bytes (as if nothing were reused),
//! its own peak (the most of its bytes live at one op), and its bytes live at the plan's peak
//! op (the attribution of the peak).

use super::{Category, Plan};
use crate::util::bytes::fmt_bytes;
use serde_json::{Value, json};
use std::fmt::Write;

/// The human-readable table: bytes by category, packing, baseline and predicted peak.
pub fn table(plan: &Plan, baseline: u64) -> String {
    let mut s = String::new();
    let cfg = &plan.cfg;
    let micro = if cfg.grad_accum > 1 {
        format!(
            "micro-batch {} x grad-accum {} x seq {}",
            cfg.batch, cfg.grad_accum, cfg.seq
        )
    } else {
        format!("batch {} x seq {}", cfg.batch, cfg.seq)
    };
    let _ = writeln!(
        s,
        "plan: {}\n      {:?}, {micro} = {} tokens/step, {}, recompute {}, optimizer state {}, {} threads, {} ops",
        plan.spec.describe(),
        plan.mode,
        cfg.batch * cfg.grad_accum * cfg.seq,
        cfg.precision,
        cfg.recompute,
        cfg.optim_state,
        cfg.threads,
        plan.schedule.ops.len()
    );
    let _ = writeln!(
        s,
        "\n  {:<18} {:>8} {:>14} {:>14} {:>14}",
        "category", "buffers", "sum of bytes", "own peak", "live at peak"
    );
    let at_peak = plan.live_by_category(plan.peak_op);
    let own_peak = plan.peak_by_category();
    for (((cat, bytes), (_, live)), (_, own)) in plan
        .bytes_by_category()
        .into_iter()
        .zip(at_peak)
        .zip(own_peak)
    {
        let count = plan.buffers.iter().filter(|b| b.category == cat).count();
        if count == 0 {
            continue;
        }
        let _ = writeln!(
            s,
            "  {:<18} {:>8} {:>14} {:>14} {:>14}",
            cat.name(),
            count,
            fmt_bytes(bytes),
            fmt_bytes(own),
            fmt_bytes(live)
        );
    }
    let sum: u64 = plan.buffers.iter().map(|b| b.bytes).sum();
    let _ = writeln!(
        s,
        "  {:<18} {:>8} {:>14}",
        "sum of buffers",
        plan.buffers.len(),
        fmt_bytes(sum)
    );
    let _ = writeln!(
        s,
        "\n  arena (packed by lifetime)  {:>12}   lower bound {} (peak live, at op {})",
        fmt_bytes(plan.arena_bytes),
        fmt_bytes(plan.peak_live_bytes),
        plan.schedule.ops[plan.peak_op].name
    );
    for b in plan.buffers.iter().filter(|b| b.external) {
        let _ = writeln!(
            s,
            "  + outside the arena: {:<15} {:>12}",
            b.name,
            fmt_bytes(b.bytes)
        );
    }
    let _ = writeln!(
        s,
        "  plan total                  {:>12}",
        fmt_bytes(plan.total_bytes())
    );
    let _ = writeln!(
        s,
        "  process baseline (measured) {:>12}",
        fmt_bytes(baseline)
    );
    let _ = writeln!(
        s,
        "  predicted peak RSS          {:>12}",
        fmt_bytes(plan.total_bytes() + baseline)
    );
    let flops = plan.flops();
    let _ = writeln!(
        s,
        "  arithmetic per step         {:>10.1} GFLOP",
        flops as f64 / 1e9
    );
    if cfg.precision != crate::plan::Precision::F32 {
        let _ = writeln!(
            s,
            "  {} compute                {} (this CPU {} AVX512_BF16)",
            cfg.precision,
            crate::backend::cpu::gemm::mixed::compute_path(cfg.precision == super::Precision::Bf16),
            if crate::backend::cpu::features::cpu_has_bf16_dot() {
                "has"
            } else {
                "lacks"
            }
        );
    }
    let re = plan.recompute_flops();
    if re > 0 {
        let _ = writeln!(
            s,
            "    of which recomputation    {:>10.1} GFLOP ({:.1}%)",
            re as f64 / 1e9,
            100.0 * re as f64 / flops as f64
        );
    }
    s
}

/// `plan.json`: totals, bytes by category, every buffer, and the schedule.
pub fn to_json(plan: &Plan, baseline: u64) -> Value {
    let by_category: serde_json::Map<String, Value> = plan
        .bytes_by_category()
        .into_iter()
        .map(|(c, b)| (c.name().to_string(), json!(b)))
        .collect();
    let peak_by_category: serde_json::Map<String, Value> = plan
        .peak_by_category()
        .into_iter()
        .map(|(c, b)| (c.name().to_string(), json!(b)))
        .collect();
    let live_at_peak: serde_json::Map<String, Value> = plan
        .live_by_category(plan.peak_op)
        .into_iter()
        .map(|(c, b)| (c.name().to_string(), json!(b)))
        .collect();
    let ops: Vec<Value> = plan
        .schedule
        .ops
        .iter()
        .map(|o| json!({"name": o.name, "phase": o.phase, "flops": o.flops}))
        .collect();
    json!({
        "model": plan.spec.to_hf_config(),
        "model_name": plan.spec.name,
        "num_params": plan.layout.total,
        "mode": plan.mode,
        "config": plan.cfg,
        "precision": plan.cfg.precision.to_string(),
        "total_bytes": plan.total_bytes(),
        "arena_bytes": plan.arena_bytes,
        "external_bytes": plan.external_bytes,
        "peak_live_bytes": plan.peak_live_bytes,
        "peak_op": plan.schedule.ops[plan.peak_op].name,
        "baseline_bytes": baseline,
        "predicted_peak_rss_bytes": plan.total_bytes() + baseline,
        "by_category": by_category,
        "peak_by_category": peak_by_category,
        "live_at_peak_by_category": live_at_peak,
        "flops_per_step": plan.flops(),
        "recompute_flops_per_step": plan.recompute_flops(),
        "buffers": plan.buffers,
        "schedule": ops,
    })
}

/// Category names in report order (for scripts that read `by_category`).
pub fn category_names() -> Vec<&'static str> {
    Category::ALL.iter().map(|c| c.name()).collect()
}
