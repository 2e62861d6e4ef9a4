//! The PNG chart: per record size, throughput against clients (top row)
//! and the acknowledgement latency CDF at one client count (bottom row).
//! Drawn with plotters; text uses DejaVu Sans (Debian's
//! `fonts-dejavu-core`), registered at run time.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::report::Report;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn colour(system: &str) -> RGBColor {
    match system {
        "walship-quorum" => RGBColor(0x1f, 0x77, 0xb4),
        crate::report::WALSHIP_UNARY => RGBColor(0x8c, 0x56, 0x4b),
        crate::report::WALSHIP_BATCHED => RGBColor(0xe3, 0x77, 0xc2),
        "walship-all" => RGBColor(0x17, 0xbe, 0xcf),
        crate::report::WALSHIP_PRODUCER => RGBColor(0x94, 0x67, 0xbd),
        "jetstream-r3" => RGBColor(0x2c, 0xa0, 0x2c),
        crate::report::JETSTREAM_DEDUPE => RGBColor(0xbc, 0xbd, 0x22),
        "postgres-sync" => RGBColor(0xd6, 0x27, 0x28),
        crate::report::BASELINE => RGBColor(0xff, 0x7f, 0x0e),
        _ => RGBColor(0x55, 0x55, 0x55),
    }
}

fn register_font() -> Result<()> {
    let bytes = std::fs::read(FONT).with_context(|| format!("reading {FONT} (Debian package fonts-dejavu-core)"))?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
        .map_err(|_| anyhow!("{FONT} is not a usable font"))
}

/// Axis labels: 25k, 1.2k, 350, 3.5, 0.35.
fn number(v: f64) -> String {
    match v.abs() {
        0.0 => "0".into(),
        a if a >= 10_000.0 => format!("{:.0}k", v / 1e3),
        a if a >= 1_000.0 => format!("{:.1}k", v / 1e3),
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 1.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

/// The client count whose latency CDF is drawn: 64 when measured, else
/// the largest measured below it, else the smallest.
pub fn cdf_clients(report: &Report) -> Option<usize> {
    let mut clients: Vec<usize> = report.cells.iter().map(|c| c.clients).collect();
    clients.sort();
    clients.dedup();
    clients.iter().rev().find(|&&c| c <= 64).or(clients.first()).copied()
}

pub fn draw(report: &Report, path: &Path) -> Result<()> {
    register_font()?;
    let mut sizes: Vec<usize> = report.cells.iter().map(|c| c.record_bytes).collect();
    sizes.sort();
    sizes.dedup();
    if sizes.is_empty() {
        anyhow::bail!("no cells to draw");
    }
    let systems = report.systems();
    let cdf_at = cdf_clients(report).expect("cells exist");
    let max_clients = report.cells.iter().map(|c| c.clients).max().unwrap_or(1).max(2) as f64 * 1.3;
    let width = (540 * sizes.len() as u32).max(1080);
    let root = BitMapBackend::new(path, (width, 880)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let (title, body) = root.split_vertically(40);
    title
        .draw_text(
            &format!(
                "walship vs NATS JetStream R3 vs PostgreSQL synchronous replication; one disk, loopback; {}",
                report.settings.started_utc
            ),
            &("sans-serif", 20).into_font().color(&BLACK),
            (12, 10),
        )
        .map_err(|e| anyhow!("{e}"))?;
    let rows = body.split_evenly((2, sizes.len()));
    for (i, &size) in sizes.iter().enumerate() {
        let top = &rows[i];
        let peak = report.cells.iter().filter(|c| c.record_bytes == size).map(|c| c.records_per_s).fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(top)
            .caption(format!("{size} B records: throughput"), ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d((1f64..max_clients).log_scale(), 0f64..peak * 1.1)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("concurrent clients")
            .y_desc("acknowledged records/s")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| number(*v))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        for system in &systems {
            let mut points: Vec<(f64, f64)> = report
                .cells
                .iter()
                .filter(|c| &c.system == system && c.record_bytes == size)
                .map(|c| (c.clients as f64, c.records_per_s))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let style = colour(system).stroke_width(2);
            chart
                .draw_series(LineSeries::new(points.clone(), style))
                .map_err(|e| anyhow!("{e}"))?
                .label(system.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
            chart
                .draw_series(points.into_iter().map(|p| Circle::new(p, 3, colour(system).filled())))
                .map_err(|e| anyhow!("{e}"))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;

        let bottom = &rows[sizes.len() + i];
        let cells: Vec<_> = report.cells.iter().filter(|c| c.record_bytes == size && c.clients == cdf_at).collect();
        let lo = cells.iter().flat_map(|c| c.cdf.iter().map(|p| p.1)).fold(f64::MAX, f64::min).max(1.0) / 1e3;
        let hi = cells.iter().flat_map(|c| c.cdf.iter().map(|p| p.1)).fold(1.0, f64::max) / 1e3;
        let mut chart = ChartBuilder::on(bottom)
            .caption(format!("{size} B records: ack latency CDF, {cdf_at} clients"), ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d((lo * 0.8..hi * 1.25).log_scale(), 0f64..100f64)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("latency, ms (log)")
            .y_desc("percentile")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .x_label_formatter(&|v| number(*v))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        for c in cells {
            let points: Vec<(f64, f64)> = c.cdf.iter().map(|&(q, us)| (us.max(1.0) / 1e3, q * 100.0)).collect();
            let style = colour(&c.system).stroke_width(2);
            chart
                .draw_series(LineSeries::new(points, style))
                .map_err(|e| anyhow!("{e}"))?
                .label(c.system.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
    }
    root.present().map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}
