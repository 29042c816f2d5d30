//! The crossover map the study asked for and did not draw: the (batch × prompt length)
//! plane of one device, each point coloured by the strategy `kvbench recommend` ranks
//! first there, with its budget and predicted throughput written in it.

use crate::style::{self, engine_color, font, DrawResult, INK, MUTED};
use crate::Error;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// The winner at one point of the plane.
#[derive(Debug, Clone, PartialEq)]
pub struct Winner {
    pub engine: String,
    /// `b=0.3`, `chunked`: what else names the configuration.
    pub detail: String,
    /// Predicted output tokens per second.
    pub tok_s: f64,
}

/// The plane: `cells[i][j]` is the winner at `batches[i]` and `prompt_lens[j]`, `None`
/// where no configuration fits in memory.
#[derive(Debug, Clone)]
pub struct CrossoverMap {
    /// The title's second line (model, device, output length, calibration).
    pub context: String,
    pub batches: Vec<usize>,
    pub prompt_lens: Vec<usize>,
    pub cells: Vec<Vec<Option<Winner>>>,
    /// Written under the plot.
    pub notes: Vec<String>,
}

/// `128K` for 128,000 tokens (a thousand, as `--prompt-len 1K-10K` reads it).
fn tokens(n: usize) -> String {
    if n >= 1000 && n.is_multiple_of(1000) {
        format!("{}K", n / 1000)
    } else {
        n.to_string()
    }
}

fn lighter(c: RGBColor) -> RGBColor {
    let l = |v: u8| (v as f64 + (255.0 - v as f64) * 0.55).round() as u8;
    RGBColor(l(c.0), l(c.1), l(c.2))
}

fn paint<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    map: &CrossoverMap,
) -> Result<(), Error> {
    let title = style::Title {
        heading: "Crossover map — the strategy ranked first, by batch and prompt length".into(),
        context: map.context.clone(),
    };
    let body = style::frame(root, &title, &map.notes)?;
    let (plot, legend) = style::with_legend(&body);
    let (w, h) = plot.dim_in_pixel();
    let (left, bottom, top, right) = (130i32, 90i32, 20i32, 20i32);
    let cols = map.prompt_lens.len().max(1) as i32;
    let rows = map.batches.len().max(1) as i32;
    let cw = (w as i32 - left - right) / cols;
    let ch = (h as i32 - top - bottom) / rows;
    for (i, &b) in map.batches.iter().enumerate() {
        // Batch grows upwards.
        let y0 = top + (rows - 1 - i as i32) * ch;
        plot.draw_text(
            &b.to_string(),
            &font(18).pos(Pos::new(HPos::Right, VPos::Center)),
            (left - 12, y0 + ch / 2),
        )
        .drawn()?;
        for (j, _) in map.prompt_lens.iter().enumerate() {
            let x0 = left + j as i32 * cw;
            let cell = map.cells.get(i).and_then(|r| r.get(j)).cloned().flatten();
            let fill = match &cell {
                Some(win) => lighter(engine_color(&win.engine)),
                None => style::FAIL_BAND,
            };
            plot.draw(&Rectangle::new(
                [(x0 + 1, y0 + 1), (x0 + cw - 1, y0 + ch - 1)],
                fill.filled(),
            ))
            .drawn()?;
            let centre = (x0 + cw / 2, y0 + ch / 2);
            let lines: Vec<String> = match &cell {
                Some(win) => vec![
                    win.engine.clone(),
                    win.detail.clone(),
                    format!("{:.0} tok/s", win.tok_s),
                ],
                None => vec!["OOM".into()],
            };
            let n = lines.len() as i32;
            for (k, l) in lines.iter().enumerate() {
                let size = if k == 0 { 17 } else { 14 };
                let color = if k == 0 { INK } else { MUTED };
                plot.draw_text(
                    l,
                    &font(size)
                        .color(&color)
                        .pos(Pos::new(HPos::Center, VPos::Center)),
                    (
                        centre.0,
                        centre.1 + (k as i32 - (n - 1) / 2) * 18 - 9 * ((n + 1) % 2),
                    ),
                )
                .drawn()?;
            }
        }
    }
    for (j, &l) in map.prompt_lens.iter().enumerate() {
        plot.draw_text(
            &tokens(l),
            &font(18).pos(Pos::new(HPos::Center, VPos::Top)),
            (left + j as i32 * cw + cw / 2, top + rows * ch + 10),
        )
        .drawn()?;
    }
    plot.draw_text(
        "prompt length (tokens)",
        &font(20).pos(Pos::new(HPos::Center, VPos::Top)),
        (left + cols * cw / 2, top + rows * ch + 46),
    )
    .drawn()?;
    plot.draw_text(
        "batch",
        &font(20).pos(Pos::new(HPos::Center, VPos::Center)),
        (40, top + rows * ch / 2),
    )
    .drawn()?;
    // Legend: every engine that wins somewhere, then the OOM colour.
    let mut engines: Vec<&str> = map
        .cells
        .iter()
        .flatten()
        .flatten()
        .map(|w| w.engine.as_str())
        .collect();
    engines.sort_unstable();
    engines.dedup();
    let mut y = 40;
    legend
        .draw_text("ranked first", &font(18).color(&MUTED), (20, y - 30))
        .drawn()?;
    for e in engines {
        legend
            .draw(&Rectangle::new(
                [(20, y), (44, y + 20)],
                lighter(engine_color(e)).filled(),
            ))
            .drawn()?;
        legend.draw_text(e, &font(18), (54, y + 1)).drawn()?;
        y += 32;
    }
    legend
        .draw(&Rectangle::new(
            [(20, y), (44, y + 20)],
            style::FAIL_BAND.filled(),
        ))
        .drawn()?;
    legend
        .draw_text("nothing fits", &font(18), (54, y + 1))
        .drawn()?;
    Ok(())
}

/// Draw the map as `base`.png and `base`.svg.
pub fn draw_crossover(base: &Path, map: &CrossoverMap) -> Result<(PathBuf, PathBuf), Error> {
    style::register_font()?;
    if let Some(dir) = base.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::Io {
            path: dir.to_path_buf(),
            msg: format!("cannot create the directory: {e}"),
        })?;
    }
    // Appended, not swapped: a name such as `llama-3.1-8b` has a dot of its own. A
    // base given with either extension (`map.png`) loses it first.
    let base = match base.extension().and_then(|e| e.to_str()) {
        Some("png" | "svg") => base.with_extension(""),
        _ => base.to_path_buf(),
    };
    let with = |ext: &str| {
        let mut s = base.as_os_str().to_owned();
        s.push(ext);
        PathBuf::from(s)
    };
    let (png, svg) = (with(".png"), with(".svg"));
    {
        let root = BitMapBackend::new(&png, style::SIZE).into_drawing_area();
        paint(&root, map)?;
        root.present().drawn()?;
    }
    {
        let root = SVGBackend::new(&svg, style::SIZE).into_drawing_area();
        paint(&root, map)?;
        root.present().drawn()?;
    }
    Ok((png, svg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_draws_with_winners_and_an_empty_point() {
        let dir = tempfile::tempdir().unwrap();
        let win = |e: &str| {
            Some(Winner {
                engine: e.into(),
                detail: "b=0.3 · sequential".into(),
                tok_s: 123.0,
            })
        };
        let map = CrossoverMap {
            context: "test".into(),
            batches: vec![1, 16],
            prompt_lens: vec![1024, 8192],
            cells: vec![vec![win("full"), win("h2o")], vec![win("h2o"), None]],
            notes: vec!["a note".into()],
        };
        let (png, svg) = draw_crossover(&dir.path().join("map-3.1"), &map).unwrap();
        assert!(png.ends_with("map-3.1.png") && svg.ends_with("map-3.1.svg"));
        // A base given with its extension keeps one.
        let (png, _) = draw_crossover(&dir.path().join("map.png"), &map).unwrap();
        assert!(png.ends_with("map.png"), "{}", png.display());
        assert!(std::fs::metadata(&png).unwrap().len() > 1000);
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.contains("h2o") && text.contains("nothing fits"));
    }
}
