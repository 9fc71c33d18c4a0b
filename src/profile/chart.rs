//! SVG charts, drawn with `plotters` (SVG backend; text is emitted as SVG `<text>`, so no
//! system fonts are needed): the memory timeline of one step, stacked by category, with the
//! peak marked, the measured RSS over the prediction, the disk tier's size and traffic
//! (`--offload`) and the buffers live at the peak; and
//! the line charts of a run (loss, throughput, resident memory per step).

use super::record::StepProfile;
use super::timeline::{MemoryTimeline, live_buffers};
use crate::ir::Category;
use crate::run_dir::PlanJson;
use crate::util::bytes::fmt_bytes;
use anyhow::{Result, anyhow};
use plotters::prelude::*;

const MIB: f64 = (1u64 << 20) as f64;
const FONT: &str = "sans-serif";

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart: {e}")
}

/// The colour of a category, the same in every chart and table.
pub fn category_color(c: Category) -> RGBColor {
    match c {
        Category::Param => RGBColor(31, 119, 180),
        Category::Grad => RGBColor(255, 127, 14),
        Category::Master => RGBColor(44, 160, 44),
        Category::Adapter => RGBColor(140, 86, 75),
        Category::OptimizerState => RGBColor(148, 103, 189),
        Category::Activation => RGBColor(214, 39, 40),
        Category::ActivationGrad => RGBColor(227, 119, 194),
        Category::Workspace => RGBColor(127, 127, 127),
        Category::IoStaging => RGBColor(188, 189, 34),
        Category::Communication => RGBColor(23, 190, 207),
        Category::Teacher => RGBColor(96, 96, 160),
    }
}

/// Hex form of [`category_color`], for HTML.
pub fn category_hex(c: Category) -> String {
    let RGBColor(r, g, b) = category_color(c);
    format!("#{r:02x}{g:02x}{b:02x}")
}

/// The x extent of every op: milliseconds into the step when `step` was profiled (ops it did
/// not record keep zero width), else the op's index.
fn op_extents(n_ops: usize, step: Option<&StepProfile>) -> (Vec<(f64, f64)>, &'static str) {
    match step {
        Some(s) if !s.ops.is_empty() => {
            let t0 = s.ops[0].start_us;
            let mut x = vec![(f64::NAN, f64::NAN); n_ops];
            for span in &s.ops {
                if let Some(e) = x.get_mut(span.op as usize) {
                    *e = ((span.start_us - t0) / 1e3, (span.end_us - t0) / 1e3);
                }
            }
            // An op that did not run in this step sits at its predecessor's end.
            let mut prev = 0.0;
            for e in x.iter_mut() {
                if e.0.is_nan() {
                    *e = (prev, prev);
                }
                prev = e.1;
            }
            (x, "time into the step (ms, measured)")
        }
        _ => (
            (0..n_ops).map(|i| (i as f64, i as f64 + 1.0)).collect(),
            "op of the schedule",
        ),
    }
}

/// The memory timeline of one step as SVG.
pub fn memory_svg(
    plan: &PlanJson,
    tl: &MemoryTimeline,
    step: Option<&StepProfile>,
    baseline_rss: u64,
) -> Result<String> {
    let n = tl.live.len();
    let (x, x_label) = op_extents(n, step);
    let x_max = x.last().map(|e| e.1).unwrap_or(1.0).max(1e-9);
    let rss: Vec<(f64, f64)> = match step {
        Some(s) => {
            let t0 = s.ops.first().map(|o| o.start_us).unwrap_or(0.0);
            s.ops
                .iter()
                .filter(|o| o.rss > 0)
                .map(|o| {
                    (
                        (o.end_us - t0) / 1e3,
                        o.rss.saturating_sub(baseline_rss) as f64 / MIB,
                    )
                })
                .collect()
        }
        None => Vec::new(),
    };
    let total = plan.total_bytes as f64 / MIB;
    let y_max = rss.iter().map(|p| p.1).fold(total, f64::max) * 1.12;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1180, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let (left, right) = root.split_horizontally(800);
        let title = format!(
            "{} · {} · recompute {} · batch {}x{} — memory over one step",
            plan.model_name,
            plan.precision,
            plan.config_str("recompute"),
            plan.config_str("batch"),
            plan.config_str("seq")
        );
        let mut chart = ChartBuilder::on(&left)
            .caption(title, (FONT, 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc("MiB")
            .label_style((FONT, 12))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(plot_err)?;

        // Segments of ops over which nothing changes, as (x0, x1, row).
        let mut segs: Vec<(f64, f64, &[u64])> = Vec::new();
        for (op, row) in tl.live.iter().enumerate() {
            match segs.last_mut() {
                Some(s) if s.2 == row.as_slice() => s.1 = x[op].1,
                _ => segs.push((x[op].0, x[op].1, row)),
            }
        }
        // Stacked areas: draw the cumulative sums from the top down, each filling to zero.
        for k in (0..tl.categories.len()).rev() {
            let c = tl.categories[k];
            let pts: Vec<(f64, f64)> = segs
                .iter()
                .flat_map(|&(x0, x1, row)| {
                    let v = row[..=k].iter().sum::<u64>() as f64 / MIB;
                    [(x0, v), (x1, v)]
                })
                .collect();
            let color = category_color(c);
            chart
                .draw_series(AreaSeries::new(pts, 0.0, color.mix(0.85)).border_style(color))
                .map_err(plot_err)?;
        }
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, total), (x_max, total)],
                6,
                4,
                BLACK.mix(0.6).stroke_width(2),
            ))
            .map_err(plot_err)?;
        if !rss.is_empty() {
            let rss_color = RGBColor(0, 0, 0);
            chart
                .draw_series(LineSeries::new(rss, rss_color.stroke_width(2)))
                .map_err(plot_err)?;
        }
        // The peak: a marker and its label.
        let peak_x = 0.5 * (x[tl.peak_op].0 + x[tl.peak_op].1);
        let peak_y = tl.peak_bytes as f64 / MIB;
        chart
            .draw_series([PathElement::new(
                [(peak_x, 0.0), (peak_x, peak_y)],
                RGBColor(200, 0, 0).stroke_width(2),
            )])
            .map_err(plot_err)?;
        chart
            .draw_series([Circle::new(
                (peak_x, peak_y),
                5,
                RGBColor(200, 0, 0).filled(),
            )])
            .map_err(plot_err)?;
        let peak_label = format!(
            "peak {} at {}",
            fmt_bytes(tl.peak_bytes),
            plan.schedule[tl.peak_op].name
        );
        let anchor_x = if peak_x > 0.6 * x_max {
            peak_x - 0.45 * x_max
        } else {
            peak_x
        };
        chart
            .draw_series([Text::new(
                peak_label,
                (anchor_x, peak_y + 0.04 * y_max),
                (FONT, 13).into_font().color(&RGBColor(200, 0, 0)),
            )])
            .map_err(plot_err)?;
        // Right panel: the legend, then the buffers live at the peak, largest first.
        let style = (FONT, 12).into_font();
        let mut y = 30;
        for &c in tl.categories.iter().rev() {
            let at_peak =
                tl.live[tl.peak_op][tl.categories.iter().position(|&k| k == c).unwrap_or(0)];
            right
                .draw(&Rectangle::new(
                    [(8, y - 9), (20, y + 1)],
                    category_color(c).filled(),
                ))
                .map_err(plot_err)?;
            right
                .draw(&Text::new(
                    format!("{} ({} at peak)", c.name(), fmt_bytes(at_peak)),
                    (26, y - 9),
                    style.clone(),
                ))
                .map_err(plot_err)?;
            y += 16;
        }
        let lines = [
            (
                format!("plan total {}", fmt_bytes(plan.total_bytes)),
                BLACK.mix(0.6),
            ),
            ("measured RSS above baseline".to_string(), BLACK.mix(1.0)),
        ];
        for (label, color) in lines.into_iter().take(if step.is_some() { 2 } else { 1 }) {
            right
                .draw(&PathElement::new(
                    [(8, y - 4), (20, y - 4)],
                    color.stroke_width(2),
                ))
                .map_err(plot_err)?;
            right
                .draw(&Text::new(label, (26, y - 9), style.clone()))
                .map_err(plot_err)?;
            y += 16;
        }
        // The disk tier is not memory: named here, with its traffic, not stacked.
        let file = plan
            .by_tier
            .get("nvme")
            .and_then(|v| v.as_u64())
            .unwrap_or(0);
        if file > 0 {
            let disk = [
                format!("disk tier (offload file): {}", fmt_bytes(file)),
                format!(
                    "  read {}, written {} per step",
                    fmt_bytes(plan.io_read_bytes_per_step),
                    fmt_bytes(plan.io_write_bytes_per_step)
                ),
            ];
            for label in disk {
                right
                    .draw(&Text::new(label, (8, y - 9), style.clone()))
                    .map_err(plot_err)?;
                y += 16;
            }
        }
        y += 14;
        let at_peak = live_buffers(plan, tl.peak_op);
        right
            .draw(&Text::new(
                format!("live at the peak ({} buffers):", at_peak.len()),
                (8, y - 9),
                (FONT, 14).into_font(),
            ))
            .map_err(plot_err)?;
        y += 20;
        let shown = ((590 - y) / 17).max(1) as usize - 1;
        for b in at_peak.iter().take(shown) {
            right
                .draw(&Rectangle::new(
                    [(8, y - 9), (18, y + 1)],
                    category_color(b.category).filled(),
                ))
                .map_err(plot_err)?;
            right
                .draw(&Text::new(
                    format!("{:>10}  {}", fmt_bytes(b.bytes), b.name),
                    (24, y - 9),
                    style.clone(),
                ))
                .map_err(plot_err)?;
            y += 17;
        }
        if at_peak.len() > shown {
            let rest: u64 = at_peak[shown..].iter().map(|b| b.bytes).sum();
            right
                .draw(&Text::new(
                    format!("… {} more, {}", at_peak.len() - shown, fmt_bytes(rest)),
                    (24, y - 9),
                    style,
                ))
                .map_err(plot_err)?;
        }
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

/// One line of a line chart.
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub color: RGBColor,
}

/// A line chart (x from the data, y from zero unless `y_from_data`).
pub fn line_svg(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    lines: &[Line],
    y_from_data: bool,
) -> Result<String> {
    let all = || lines.iter().flat_map(|l| l.points.iter());
    let (mut x0, mut x1) = (f64::INFINITY, f64::NEG_INFINITY);
    let (mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in all() {
        if x.is_finite() && y.is_finite() {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
    }
    if !x0.is_finite() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.08).max(1e-6);
    let (ylo, yhi) = if y_from_data {
        (y0 - pad, y1 + pad)
    } else {
        (0.0, y1 * 1.1 + 1e-6)
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (580, 320)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 15))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1, ylo..yhi)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .label_style((FONT, 11))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(plot_err)?;
        for l in lines {
            let color = l.color;
            let pts: Vec<(f64, f64)> = l
                .points
                .iter()
                .copied()
                .filter(|p| p.0.is_finite() && p.1.is_finite())
                .collect();
            let single = pts.len() == 1;
            let series = chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(plot_err)?;
            series.label(l.label.clone()).legend(move |(x, y)| {
                PathElement::new([(x, y), (x + 12, y)], color.stroke_width(2))
            });
            if single || l.label.contains("val") {
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(plot_err)?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font((FONT, 11))
            .draw()
            .map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}
