//! `diagnose --plot`: per-token error against token, as a PNG (plotters,
//! with a built-in font so no system fonts are needed).

use std::path::Path;

use deltaref_verify::diagnose::Diagnosis;

/// Draws per-token error against token (log scale) for every per-token
/// tensor, with rank cuts (black), sequence starts (grey), chunk boundaries
/// (light grey, when there are few enough to see) and the band (red).
pub fn plot(d: &Diagnosis, path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    register_font();
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    let series: Vec<(&str, &Vec<f64>)> = d
        .tensors
        .iter()
        .filter_map(|t| t.per_token.as_ref().map(|p| (t.name.as_str(), p)))
        .collect();
    let n = series.first().map_or(0, |s| s.1.len()).max(1);
    let floor = 1e-18;
    let ymax = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .chain(std::iter::once(d.band))
        .filter(|v| v.is_finite())
        .fold(floor, f64::max)
        * 10.0;
    let root = BitMapBackend::new(path, (1400, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("per-token error (rms diff / rms ref)", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..n as f64, (floor..ymax).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("token (batch rows laid end to end)")
        .y_desc("error")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0e}"))
        .draw()
        .map_err(|e| err(&e))?;
    let vline = |x: usize, style: ShapeStyle| {
        PathElement::new(vec![(x as f64, floor), (x as f64, ymax)], style)
    };
    let m = &d.map;
    let chunk_starts: Vec<usize> = m
        .sequences
        .iter()
        .flat_map(|&(b, s, e)| (s..e).step_by(m.chunk_size).map(move |t| b * m.t + t))
        .collect();
    if chunk_starts.len() <= 400 {
        let light = RGBColor(225, 225, 225).stroke_width(1);
        chart
            .draw_series(chunk_starts.iter().map(|&x| vline(x, light)))
            .map_err(|e| err(&e))?;
    }
    let grey = RGBColor(150, 150, 150).stroke_width(1);
    chart
        .draw_series(
            m.sequences
                .iter()
                .map(|&(b, s, _)| vline(b * m.t + s, grey)),
        )
        .map_err(|e| err(&e))?;
    let black = BLACK.stroke_width(2);
    chart
        .draw_series(
            (0..m.b)
                .flat_map(|b| {
                    m.rank_cuts[1..m.rank_cuts.len() - 1]
                        .iter()
                        .map(move |&c| b * m.t + c)
                })
                .map(|x| vline(x, black)),
        )
        .map_err(|e| err(&e))?;
    // The band each tensor was judged against, chunk by chunk (the floor,
    // or the noise reference's error × NOISE_FACTOR): drawn dashed in the
    // tensor's colour; flat (red) only when no noise reference set it.
    if d.noise_reference.is_none() {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, d.band), (n as f64, d.band)],
                RED.stroke_width(1),
            )))
            .map_err(|e| err(&e))?
            .label(format!("band {:.0e}", d.band))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    }
    let bands: Vec<Option<Vec<f64>>> = d
        .tensors
        .iter()
        .filter(|t| t.per_token.is_some())
        .map(|t| t.band_per_token(m))
        .collect();
    for (i, (name, p)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        if let Some(band) = bands
            .get(i)
            .and_then(|b| b.as_ref())
            .filter(|_| d.noise_reference.is_some())
        {
            chart
                .draw_series(DashedLineSeries::new(
                    band.iter()
                        .enumerate()
                        .map(move |(x, &v)| (x as f64, v.max(floor))),
                    6,
                    4,
                    color.stroke_width(1),
                ))
                .map_err(|e| err(&e))?
                .label(format!("{name}: band used"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .draw_series(LineSeries::new(
                p.iter().enumerate().map(|(x, &v)| (x as f64, v.max(floor))),
                color.stroke_width(1),
            ))
            .map_err(|e| err(&e))?
            .label(name.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

/// plotters draws text with a registered font; DejaVu Sans is built in so
/// plots need no system fonts.
fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Registration only fails on a malformed font, which the crate's bytes are not.
        let _ = plotters::style::register_font(
            "sans-serif",
            plotters::style::FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}
