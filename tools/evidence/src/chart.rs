//! The article's figure: duplicate and lost credits per run (median), per broker and variant.

use std::path::Path;

use inbox_core::BoxError;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::VariantResult;

const DUPLICATES: RGBColor = RGBColor(214, 96, 77);
const LOST: RGBColor = RGBColor(67, 147, 195);

/// Writes an SVG bar chart to `path`.
pub(crate) fn write(path: &Path, results: &[VariantResult]) -> Result<(), BoxError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let n = results.len().max(1);
    // Losses of an ack on receipt run to hundreds or thousands, duplicates of `b` to a few: a log scale
    // (of 1 + v, so that 0 sits on the axis) keeps both readable.
    let highest = results
        .iter()
        .map(|r| r.duplicates().median.max(r.lost().median))
        .fold(10.0, f64::max);
    let top = scaled(highest) * 1.15;
    let width = (160 + 110 * n as u32).max(640);
    let root = SVGBackend::new(path, (width, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let kills = results.first().map_or(0, |r| r.kills_per_run());
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Duplicate and lost credits per run of {kills} hard kills (median)"),
            ("sans-serif", 20),
        )
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..n as f64, 0f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .disable_y_mesh()
        .x_labels(0)
        .y_labels(0)
        .y_desc("per run (log scale)")
        .draw()?;
    // The scale's ticks: 0, 1, 10, 100, ...
    let text = |size, h, v| {
        ("sans-serif", size)
            .into_font()
            .into_text_style(&root)
            .pos(Pos::new(h, v))
    };
    let tick_style = text(12, HPos::Right, VPos::Center);
    let mut tick = 0.0;
    while scaled(tick) <= top {
        let y = scaled(tick);
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(0.0, y), (n as f64, y)],
            RGBColor(220, 220, 220),
        )))?;
        chart.draw_series(std::iter::once(
            EmptyElement::at((0.0, y)) + Text::new(format!("{tick}"), (-6, 0), tick_style.clone()),
        ))?;
        tick = if tick == 0.0 { 1.0 } else { tick * 10.0 };
    }
    // Duplicates left in each pair, losses right.
    for (left, name, color, of) in [
        (
            0.1,
            "duplicate credits",
            DUPLICATES,
            VariantResult::duplicates as fn(&_) -> _,
        ),
        (0.52, "lost messages", LOST, VariantResult::lost),
    ] {
        let bars = results.iter().enumerate().map(|(i, r)| {
            let x = i as f64 + left;
            Rectangle::new([(x, 0.0), (x + 0.38, scaled(of(r).median))], color.filled())
        });
        chart
            .draw_series(bars)?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    // The values above the bars, and broker + variant under each pair.
    for (i, r) in results.iter().enumerate() {
        let x = i as f64;
        for (left, value) in [(0.29, r.duplicates().median), (0.71, r.lost().median)] {
            chart.draw_series(std::iter::once(Text::new(
                format!("{value}"),
                (x + left, scaled(value)),
                text(12, HPos::Center, VPos::Bottom),
            )))?;
        }
        let label = format!("{} {}", r.broker, r.variant.name());
        chart.draw_series(std::iter::once(
            EmptyElement::at((x + 0.5, 0.0))
                + Text::new(label, (0, 8), text(13, HPos::Center, VPos::Top)),
        ))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Where `value` sits on the chart's log scale.
fn scaled(value: f64) -> f64 {
    (1.0 + value.max(0.0)).log10()
}
