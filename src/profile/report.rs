//! Writes the reports of a run directory from what it holds: `plan.json` (required),
//! `metrics.jsonl` and `profile.json` (when present). Used at the end of a profiled
//! `train`/`bench` and by `memwall report RUN_DIR`; every file is written atomically.

use super::chart::{Line, line_svg, memory_svg};
use super::html::ReportPage;
use super::leak::LeakCheck;
use super::record::Profile;
use super::timeline::MemoryTimeline;
use super::trace;
use crate::run_dir::{self, Metric, PLAN_FILE, PlanJson, RunDir, Update};
use crate::util::atomic;
use anyhow::{Result, bail};
use plotters::style::RGBColor;
use std::path::{Path, PathBuf};

/// The files a report run wrote.
#[derive(Clone, Debug)]
pub struct Written {
    pub trace: Option<PathBuf>,
    pub memory_svg: PathBuf,
    pub html: PathBuf,
    /// The leak check's one-line verdict, when the metrics allow one.
    pub leak: Option<super::leak::LeakReport>,
    /// A few lines for the terminal: the peak, what is live there, where the time went.
    pub summary: String,
    /// The plan's peak of live bytes (arena and outside it) and the op where it is reached.
    pub peak_bytes: u64,
    pub peak_op: String,
}

/// The terminal summary of a report: the peak and its largest buffers, and (when profiled)
/// the time of the last profiled step by phase.
pub fn summary(plan: &PlanJson, tl: &MemoryTimeline, profile: Option<&Profile>) -> String {
    use crate::util::bytes::fmt_bytes;
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "peak of live bytes {} at op {} ({}); plan total {}",
        fmt_bytes(tl.peak_bytes),
        tl.peak_op,
        plan.schedule[tl.peak_op].name,
        fmt_bytes(plan.total_bytes)
    );
    let at_peak = super::timeline::live_buffers(plan, tl.peak_op);
    for b in at_peak.iter().take(5) {
        let _ = writeln!(
            s,
            "  {:>12}  {:5.1}%  {} ({})",
            fmt_bytes(b.bytes),
            100.0 * b.bytes as f64 / tl.peak_bytes.max(1) as f64,
            b.name,
            b.category.name()
        );
    }
    if at_peak.len() > 5 {
        let _ = writeln!(s, "  … and {} more buffers", at_peak.len() - 5);
    }
    if let Some(line) = super::timeline::disk_tier_line(plan, tl) {
        let _ = writeln!(s, "disk tier: {line}");
    }
    if let Some(step) = profile.and_then(|p| p.chart_step()) {
        let phases = super::timeline::StepTimes::new(plan, step).phases;
        let parts: Vec<String> = phases
            .iter()
            .map(|(ph, d)| format!("{ph} {:.1} ms", d / 1e3))
            .collect();
        let _ = writeln!(
            s,
            "step {}: {:.1} ms ({})",
            step.step,
            (step.end_us - step.start_us) / 1e3,
            parts.join(", ")
        );
        if let Some(io) = super::timeline::StepIo::new(step) {
            let _ = writeln!(
                s,
                "  disk transfers: {}",
                io.line(step.end_us - step.start_us)
            );
        }
    }
    s
}

/// The leak check over the metrics of the last process that wrote them (a resumed run starts
/// its warm-up again).
pub fn leak_check(metrics: &[Metric], plan_bytes: u64) -> Option<super::leak::LeakReport> {
    let updates: Vec<&Update> = metrics.iter().filter_map(|m| m.update.as_ref()).collect();
    let start = updates
        .iter()
        .rposition(|u| u.process_step == Some(1))
        .unwrap_or(0);
    let mut check = LeakCheck::new(plan_bytes);
    for (i, u) in updates[start..].iter().enumerate() {
        if let Some(rss) = u.rss_bytes {
            check.observe(u.process_step.unwrap_or(i as u64 + 1), rss);
        }
    }
    check.report()
}

fn curves(metrics: &[Metric]) -> Result<Vec<String>> {
    if metrics.is_empty() {
        return Ok(Vec::new());
    }
    let step = |m: &Metric| m.step as f64;
    fn update(m: &Metric) -> Option<(f64, &Update)> {
        m.update.as_ref().map(|u| (m.step as f64, u))
    }
    let mut loss = vec![Line {
        label: "train loss".into(),
        points: metrics
            .iter()
            .filter_map(update)
            .map(|(x, u)| (x, u.loss as f64))
            .collect(),
        color: RGBColor(31, 119, 180),
    }];
    let val: Vec<(f64, f64)> = metrics
        .iter()
        .filter_map(|m| Some((step(m), m.val_loss? as f64)))
        .collect();
    if !val.is_empty() {
        loss.push(Line {
            label: "val loss".into(),
            points: val,
            color: RGBColor(214, 39, 40),
        });
    }
    let tps = [Line {
        label: "tokens/s".into(),
        points: metrics
            .iter()
            .filter_map(update)
            .map(|(x, u)| (x, u.tokens_per_s))
            .collect(),
        color: RGBColor(44, 160, 44),
    }];
    let rss = [Line {
        label: "RSS after the step".into(),
        points: metrics
            .iter()
            .filter_map(update)
            .filter_map(|(x, u)| Some((x, u.rss_bytes? as f64 / (1u64 << 20) as f64)))
            .collect(),
        color: RGBColor(0, 0, 0),
    }];
    Ok(vec![
        line_svg("loss", "step", "cross-entropy", &loss, true)?,
        line_svg("throughput", "step", "tokens/s", &tps, false)?,
        line_svg(
            "resident memory per step (leak check)",
            "step",
            "MiB",
            &rss,
            false,
        )?,
    ])
}

/// Writes `memory.svg`, `report.html` and (when profiled) `trace.json` into `run_dir`.
pub fn write_reports(run_dir: &Path) -> Result<Written> {
    if !run_dir.is_dir() {
        bail!(
            "{} is not a directory; pass a run directory written by `memwall train --out` or `memwall bench --profile`",
            run_dir.display()
        );
    }
    let run = RunDir::new(run_dir);
    let plan_path = run.plan();
    if !plan_path.exists() {
        bail!(
            "{} has no {PLAN_FILE}; is it a memwall run directory (`memwall train --out DIR`)?",
            run_dir.display()
        );
    }
    let plan = PlanJson::load(&plan_path)?;
    let metrics = run_dir::metrics::read(&run.metrics())?;
    let profile = Profile::read(&run.profile())?;
    let tl = MemoryTimeline::new(&plan);
    let baseline = profile
        .as_ref()
        .map(|p| p.baseline_rss)
        .unwrap_or(plan.baseline_bytes);

    let trace = match &profile {
        Some(p) => {
            let path = run.trace();
            let t = trace::chrome_trace(&plan, p, &tl);
            atomic::write_file(&path, serde_json::to_string(&t)?.as_bytes())?;
            Some(path)
        }
        None => None,
    };
    let svg = memory_svg(
        &plan,
        &tl,
        profile.as_ref().and_then(|p| p.chart_step()),
        baseline,
    )?;
    let svg_path = run.memory_svg();
    atomic::write_file(&svg_path, svg.as_bytes())?;

    let measured = metrics
        .iter()
        .filter_map(|m| m.update.as_ref()?.rss_bytes)
        .chain(
            profile
                .iter()
                .flat_map(|p| p.steps.iter().flat_map(|s| s.ops.iter().map(|o| o.rss))),
        )
        .max();
    let leak = leak_check(&metrics, plan.total_bytes);
    let mut step_s: Vec<f64> = metrics
        .iter()
        .filter_map(|m| m.update.as_ref().map(|u| u.step_s))
        .skip(1)
        .collect();
    step_s.sort_by(f64::total_cmp);
    let page = ReportPage {
        plan: &plan,
        timeline: &tl,
        profile: profile.as_ref(),
        memory_svg: &svg,
        curves: curves(&metrics)?,
        measured_peak_rss: measured,
        leak: leak.clone(),
        steps: metrics.len(),
        measured_step_s: step_s.get(step_s.len() / 2).copied(),
    };
    let html_path = run.report_html();
    atomic::write_file(&html_path, page.render().as_bytes())?;
    Ok(Written {
        trace,
        memory_svg: svg_path,
        html: html_path,
        leak,
        summary: summary(&plan, &tl, profile.as_ref()),
        peak_bytes: tl.peak_bytes,
        peak_op: plan.schedule[tl.peak_op].name.clone(),
    })
}
