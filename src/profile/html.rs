//! `report.html`: one self-contained page (no network, no external files) with the strategies
//! used, the plan table, the peak attribution, the memory chart, where the step's time went,
//! the loss and throughput curves, and the leak check. Charts are inline SVG; the small script
//! filters and sorts the tables, and reports any script error on the page itself.

use super::chart::category_hex;
use super::leak::LeakReport;
use super::record::Profile;
use super::timeline::{MemoryTimeline, StepIo, StepTimes, disk_tier_line, live_buffers};
use crate::plan::Budgets;
use crate::run_dir::PlanJson;
use crate::util::bytes::fmt_bytes;
use std::fmt::Write;

/// What the page shows.
pub struct ReportPage<'a> {
    pub plan: &'a PlanJson,
    pub timeline: &'a MemoryTimeline,
    pub profile: Option<&'a Profile>,
    /// The memory chart (SVG markup).
    pub memory_svg: &'a str,
    /// Loss, throughput and RSS-per-step charts (SVG markup), when the run has metrics.
    pub curves: Vec<String>,
    /// Highest resident memory the run recorded (bytes), if any.
    pub measured_peak_rss: Option<u64>,
    pub leak: Option<LeakReport>,
    /// Steps in metrics.jsonl.
    pub steps: usize,
    /// Median seconds of the recorded steps after the first (warm-up), if any.
    pub measured_step_s: Option<f64>,
}

/// HTML-escapes text.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// Strips an XML declaration so the SVG can be inlined.
fn inline_svg(svg: &str) -> &str {
    match svg.find("<svg") {
        Some(i) => &svg[i..],
        None => svg,
    }
}

/// A table cell holding bytes, sortable by its exact value.
fn bytes_cell(b: u64) -> String {
    format!("<td class=\"num\" data-v=\"{b}\">{}</td>", fmt_bytes(b))
}

const STYLE: &str = r#"
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1240px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; } td, th { padding: 3px 10px; border-bottom: 1px solid #eee; }
th { text-align: left; cursor: pointer; background: #f6f6f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px; }
.kv td:first-child { color: #666; } .warn { color: #b00; font-weight: bold; } .ok { color: #070; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; } #script-errors { color: #b00; }
input { font-size: 13px; padding: 3px; margin: 6px 0; }
"#;

/// Registered first, so an error in any later script is shown on the page and counted.
const ERROR_HOOK: &str = r#"
window.addEventListener('error', function (e) {
  var b = document.body; b.dataset.errors = String(Number(b.dataset.errors || 0) + 1);
  var ul = document.getElementById('script-errors');
  if (ul) { var li = document.createElement('li'); li.textContent = 'script error: ' + e.message; ul.appendChild(li); }
});
"#;

const SCRIPT: &str = r#"
(function () {
  var filter = document.getElementById('buffer-filter');
  var rows = Array.prototype.slice.call(document.querySelectorAll('#peak-buffers tbody tr'));
  filter.addEventListener('input', function () {
    var q = filter.value.toLowerCase(), shown = 0;
    rows.forEach(function (r) {
      var hit = r.textContent.toLowerCase().indexOf(q) >= 0;
      r.style.display = hit ? '' : 'none'; if (hit) shown++;
    });
    document.getElementById('buffer-count').textContent = shown + ' of ' + rows.length;
  });
  document.querySelectorAll('table.sortable').forEach(function (table) {
    table.querySelectorAll('th').forEach(function (th, col) {
      th.addEventListener('click', function () {
        var body = table.tBodies[0], desc = th.dataset.desc !== '1';
        th.dataset.desc = desc ? '1' : '0';
        var key = function (r) {
          var c = r.cells[col]; if (!c) return '';
          return c.dataset.v !== undefined ? Number(c.dataset.v) : c.textContent;
        };
        Array.prototype.slice.call(body.rows).sort(function (a, b) {
          var x = key(a), y = key(b), o = x < y ? -1 : x > y ? 1 : 0; return desc ? -o : o;
        }).forEach(function (r) { body.appendChild(r); });
      });
    });
  });
  document.body.dataset.ready = '1';
})();
"#;

impl ReportPage<'_> {
    pub fn render(&self) -> String {
        let p = self.plan;
        let tl = self.timeline;
        let mut h = String::new();
        let title = format!("memwall report: {}", p.model_name);
        let _ = write!(
            h,
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\
             <style>{STYLE}</style><script>{ERROR_HOOK}</script></head><body>\n<h1>{}</h1>\n\
             <ul id=\"script-errors\"></ul>\n",
            esc(&title),
            esc(&title)
        );

        // ---- strategies and totals ----
        let _ = write!(
            h,
            "<h2>Configuration and strategies</h2><table class=\"kv\" id=\"strategies\">"
        );
        let mut kv = |k: &str, v: String| {
            let _ = write!(h, "<tr><td>{}</td><td>{}</td></tr>", esc(k), esc(&v));
        };
        kv(
            "model",
            format!("{} ({} parameters)", p.model_name, p.num_params),
        );
        kv(
            "step",
            format!(
                "micro-batch {} × seq {} × grad-accum {}, {}",
                p.config_str("batch"),
                p.config_str("seq"),
                p.config_str("grad_accum"),
                match p.config_str("threads").as_str() {
                    "1" => "1 thread".to_string(),
                    n => format!("{n} threads"),
                }
            ),
        );
        kv("precision", p.precision.clone());
        kv("recompute", p.config_str("recompute"));
        kv("optimizer state", p.config_str("optim_state"));
        if let Some(l) = p.config.get("lora").filter(|l| l.is_object()) {
            let num = |k: &str| l.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
            let targets: Vec<&str> = (l.get("targets").and_then(|t| t.as_array()))
                .map(|t| t.iter().filter_map(|x| x.as_str()).collect())
                .unwrap_or_default();
            kv(
                "LoRA",
                format!(
                    "rank {}, alpha {} (scale {}), dropout {}, on {}; the base frozen, kept as {}",
                    num("r"),
                    num("alpha"),
                    num("alpha") / num("r").max(1.0),
                    num("dropout"),
                    targets.join(","),
                    p.config_str("base_quant")
                ),
            );
        }
        if let Some(r) = &p.per_rank {
            let num = |k: &str| r.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
            let by: Vec<String> = r
                .get("comm_by_collective")
                .and_then(|v| v.as_object())
                .map(|o| {
                    o.iter()
                        .map(|(k, v)| {
                            format!(
                                "{} {}",
                                k.replace('_', "-"),
                                fmt_bytes(v.as_u64().unwrap_or(0))
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            kv(
                "ranks",
                format!(
                    "{} processes, --zero {}; this page is rank 0's; each rank sends {} per step ({})",
                    num("ranks"),
                    num("zero"),
                    fmt_bytes(p.comm_bytes_per_step),
                    by.join(", ")
                ),
            );
        }
        kv(
            "arithmetic per step",
            format!(
                "{:.1} GFLOP, of which recomputation {:.1} GFLOP",
                p.flops_per_step as f64 / 1e9,
                p.recompute_flops_per_step as f64 / 1e9
            ),
        );
        kv(
            "plan total",
            format!(
                "{} (arena {} packed by lifetime, {} outside the arena)",
                fmt_bytes(p.total_bytes),
                fmt_bytes(p.arena_bytes),
                fmt_bytes(p.external_bytes)
            ),
        );
        if !p.tiers.is_empty() {
            let tiers: Vec<String> = p
                .tiers
                .iter()
                .map(|u| {
                    let budget = u.budget_bytes.map_or(String::new(), |b| {
                        let compute = p.tiers[0].tier;
                        format!(
                            " of {} ({})",
                            fmt_bytes(b),
                            Budgets::source(u.tier, compute)
                        )
                    });
                    format!("{} peak {}{budget}", u.name, fmt_bytes(u.peak_bytes))
                })
                .collect();
            kv("tiers (fastest first)", tiers.join("; "));
        }
        if let Some(line) = disk_tier_line(p, tl) {
            kv("disk tier", line);
        }
        if let Some(step) = self.profile.and_then(|pr| pr.chart_step())
            && let Some(io) = StepIo::new(step)
        {
            kv(
                &format!("disk transfers in step {}", step.step),
                io.line(step.end_us - step.start_us),
            );
        }
        kv(
            "predicted peak RSS",
            format!(
                "{} (plan + process baseline {} + runtime reserve {})",
                fmt_bytes(p.total_bytes + p.baseline_bytes + p.runtime_reserve_bytes),
                fmt_bytes(p.baseline_bytes),
                fmt_bytes(p.runtime_reserve_bytes)
            ),
        );
        if let Some(m) = self.measured_peak_rss {
            let above = m.saturating_sub(p.baseline_bytes);
            kv(
                "measured peak RSS",
                format!(
                    "{} ({} above baseline: plan error {:+.2}%)",
                    fmt_bytes(m),
                    fmt_bytes(above),
                    100.0 * (p.total_bytes as f64 - above as f64) / above.max(1) as f64
                ),
            );
        }
        if let Some(t) = p.predicted_step_s {
            let how = p
                .predicted
                .as_ref()
                .and_then(|v| v["calibration"].as_str())
                .unwrap_or("");
            kv("predicted step time", format!("{t:.3} s ({how})"));
        }
        if let Some(m) = self.measured_step_s {
            let err = p
                .predicted_step_s
                .map(|t| format!(" (prediction error {:+.1}%)", 100.0 * (t - m) / m))
                .unwrap_or_default();
            kv(
                "measured step time",
                format!("{m:.3} s, median after the first step{err}"),
            );
        }
        if let Some(fit) = &p.fit {
            let first = &fit["candidates"][0];
            kv(
                "chosen by --fit",
                format!(
                    "{} (the fastest of {} candidates that fit --max-memory {}, {} plans built)",
                    first["flags"].as_str().unwrap_or(""),
                    fit["candidates"].as_array().map_or(0, |a| a.len()),
                    fmt_bytes(fit["max_memory"].as_u64().unwrap_or(0)),
                    fit["plans_built"]
                ),
            );
        }
        kv("steps recorded", self.steps.to_string());
        let _ = write!(h, "</table>");
        if let Some(l) = &self.leak {
            let _ = write!(
                h,
                "<p id=\"leak-check\" class=\"{}\">{}</p>",
                if l.leaking { "warn" } else { "ok" },
                esc(&l.message())
            );
        }

        // ---- memory chart ----
        let _ = write!(
            h,
            "<h2>Memory over one step</h2><div id=\"memory-chart\">{}</div>",
            inline_svg(self.memory_svg)
        );

        // ---- plan table ----
        let _ = write!(
            h,
            "<h2>The plan by category</h2><table class=\"sortable\" id=\"plan-table\"><thead><tr>\
             <th>category</th><th>buffers</th><th>sum of bytes</th><th>own peak</th><th>live at peak</th>\
             <th>share of peak</th></tr></thead><tbody>"
        );
        for (k, &c) in tl.categories.iter().enumerate() {
            let bufs = p.buffers.iter().filter(|b| b.category == c);
            let (count, sum) = bufs.fold((0usize, 0u64), |(n, s), b| (n + 1, s + b.bytes));
            let own = tl.live.iter().map(|r| r[k]).max().unwrap_or(0);
            let at_peak = tl.live[tl.peak_op][k];
            let _ = write!(
                h,
                "<tr><td><span class=\"swatch\" style=\"background:{}\"></span>{}</td><td class=\"num\" data-v=\"{count}\">{count}</td>{}{}{}<td class=\"num\" data-v=\"{at_peak}\">{:.1}%</td></tr>",
                category_hex(c),
                c.name(),
                bytes_cell(sum),
                bytes_cell(own),
                bytes_cell(at_peak),
                100.0 * at_peak as f64 / tl.peak_bytes.max(1) as f64
            );
        }
        let _ = write!(
            h,
            "</tbody><tfoot><tr><td>peak of live bytes</td><td></td><td></td><td></td>{}<td>at op {} ({})</td></tr></tfoot></table>",
            bytes_cell(tl.peak_bytes),
            tl.peak_op,
            esc(&p.schedule[tl.peak_op].name)
        );

        // ---- time ----
        if let Some(step) = self.profile.and_then(|pr| pr.chart_step()) {
            let StepTimes {
                phases,
                kinds,
                total_us: total,
            } = StepTimes::new(p, step);
            let _ = write!(
                h,
                "<h2>Where step {}'s time went ({:.1} ms in ops, {:.1} ms wall)</h2><p>",
                step.step,
                total / 1e3,
                (step.end_us - step.start_us) / 1e3
            );
            for (ph, d) in &phases {
                let _ = write!(
                    h,
                    "{}: {:.1} ms ({:.1}%) · ",
                    esc(ph),
                    d / 1e3,
                    100.0 * d / total.max(1e-9)
                );
            }
            let _ = write!(
                h,
                "</p><table class=\"sortable\" id=\"time-by-op\"><thead><tr><th>op kind</th><th>ms</th><th>share</th><th>GFLOP/s</th></tr></thead><tbody>"
            );
            for (k, d, f) in &kinds {
                let _ = write!(
                    h,
                    "<tr><td>{}</td><td class=\"num\" data-v=\"{d}\">{:.2}</td><td class=\"num\" data-v=\"{d}\">{:.1}%</td><td class=\"num\" data-v=\"{g}\">{g:.1}</td></tr>",
                    esc(k),
                    d / 1e3,
                    100.0 * d / total.max(1e-9),
                    g = if *d > 0.0 { *f as f64 / d / 1e3 } else { 0.0 }
                );
            }
            let _ = write!(h, "</tbody></table>");
        }

        // ---- curves ----
        if !self.curves.is_empty() {
            let _ = write!(
                h,
                "<h2>Training curves</h2><div class=\"charts\" id=\"curves\">"
            );
            for c in &self.curves {
                let _ = write!(h, "<div>{}</div>", inline_svg(c));
            }
            let _ = write!(h, "</div>");
        }
        // ---- peak attribution ----
        let at_peak = live_buffers(p, tl.peak_op);
        let _ = write!(
            h,
            "<h2>Peak attribution: the buffers live at the peak</h2>\
             <input id=\"buffer-filter\" placeholder=\"filter by name or category\"> \
             <span id=\"buffer-count\">{n} of {n}</span>\
             <table class=\"sortable\" id=\"peak-buffers\"><thead><tr><th>buffer</th><th>category</th>\
             <th>dtype</th><th>bytes</th><th>share</th><th>live over ops</th></tr></thead><tbody>",
            n = at_peak.len()
        );
        for b in &at_peak {
            let _ = write!(
                h,
                "<tr><td>{}</td><td><span class=\"swatch\" style=\"background:{}\"></span>{}</td><td>{}</td>{}<td class=\"num\" data-v=\"{}\">{:.2}%</td><td>{}</td></tr>",
                esc(&b.name),
                category_hex(b.category),
                b.category.name(),
                esc(&b.dtype),
                bytes_cell(b.bytes),
                b.bytes,
                100.0 * b.bytes as f64 / tl.peak_bytes.max(1) as f64,
                if b.persistent {
                    "whole step (persistent)".to_string()
                } else {
                    format!("{} – {}", b.first_op, b.last_op)
                }
            );
        }
        let _ = write!(h, "</tbody></table>");

        let _ = writeln!(
            h,
            "<p style=\"color:#888\">written by memwall {}; regenerate with <code>memwall report RUN_DIR</code></p>\
             <script>{SCRIPT}</script></body></html>",
            env!("CARGO_PKG_VERSION")
        );
        h
    }
}
