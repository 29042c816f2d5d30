//! The legend column on the right of the plot area.

use super::*;

/// One legend entry.
pub enum LegendItem {
    /// A heading (bold-ish text, no glyph).
    Heading(String),
    Line(String, LineStyle),
    Fill(String, RGBColor),
    Fail(String),
    /// A thin horizontal tick (an observed value marked on a bar).
    Tick(String, RGBColor),
    Dashed(String, RGBColor),
    /// A hatched box (bars of cells that did not finish).
    Hatch(String),
}

/// Draw a legend in its own area (right of the plots, so it never covers data).
pub fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    items: &[LegendItem],
) -> Result<(), Error> {
    let mut y = 70;
    let row = 30;
    // Long labels take two lines (or more) instead of running off the canvas.
    let text = |area: &DrawingArea<DB, Shift>, t: &str, y: i32| -> Result<i32, Error> {
        let lines = wrap(t, 25);
        for (i, l) in lines.iter().enumerate() {
            area.draw_text(l.trim(), &font(18), (62, y + 22 * i as i32))
                .drawn()?;
        }
        Ok(22 * (lines.len().max(1) as i32 - 1))
    };
    // Items past the column's foot are not drawn off the canvas: the last row says
    // how many were left out (their series are still drawn, and named in the notes
    // where a figure notes its variants).
    let foot = area.dim_in_pixel().1 as i32 - row;
    for (i, it) in items.iter().enumerate() {
        if y + row > foot && i + 1 < items.len() {
            area.draw_text(
                &format!("… and {} more", items.len() - i),
                &font(18).color(&MUTED),
                (8, y),
            )
            .drawn()?;
            break;
        }
        let mut extra = 0;
        match it {
            LegendItem::Heading(t) => {
                y += 6;
                area.draw_text(t, &font(19).color(&MUTED), (8, y)).drawn()?;
            }
            LegendItem::Line(t, s) => {
                let st = s.color.stroke_width(3);
                let cy = y + 10;
                match s.dash {
                    Dash::Solid => area
                        .draw(&PathElement::new(vec![(8, cy), (52, cy)], st))
                        .drawn()?,
                    Dash::Dashed => {
                        for x0 in [8, 30] {
                            area.draw(&PathElement::new(vec![(x0, cy), (x0 + 14, cy)], st))
                                .drawn()?
                        }
                    }
                    Dash::Dotted => {
                        for x0 in (8..52).step_by(10) {
                            area.draw(&PathElement::new(vec![(x0, cy), (x0 + 4, cy)], st))
                                .drawn()?
                        }
                    }
                }
                let fill = s.color.filled();
                let c = (30, cy);
                match s.marker {
                    Marker::Circle => area.draw(&Circle::new(c, 6, fill)).drawn()?,
                    Marker::Triangle => area.draw(&TriangleMarker::new(c, 8, fill)).drawn()?,
                    Marker::Square => area
                        .draw(&Rectangle::new([(24, cy - 6), (36, cy + 6)], fill))
                        .drawn()?,
                    Marker::Diamond => area
                        .draw(&Polygon::new(
                            vec![(30, cy - 8), (38, cy), (30, cy + 8), (22, cy)],
                            fill,
                        ))
                        .drawn()?,
                }
                extra = text(area, t, y)?;
            }
            LegendItem::Fill(t, color) => {
                area.draw(&Rectangle::new([(12, y + 1), (48, y + 19)], color.filled()))
                    .drawn()?;
                extra = text(area, t, y)?;
            }
            LegendItem::Fail(t) => {
                let cy = y + 10;
                let st = INK.stroke_width(3);
                area.draw(&PathElement::new(vec![(22, cy - 8), (38, cy + 8)], st))
                    .drawn()?;
                area.draw(&PathElement::new(vec![(22, cy + 8), (38, cy - 8)], st))
                    .drawn()?;
                extra = text(area, t, y)?;
            }
            LegendItem::Tick(t, color) => {
                let cy = y + 10;
                area.draw(&PathElement::new(
                    vec![(10, cy), (50, cy)],
                    color.stroke_width(4),
                ))
                .drawn()?;
                extra = text(area, t, y)?;
            }
            LegendItem::Hatch(t) => {
                area.draw(&Rectangle::new(
                    [(12, y + 1), (48, y + 19)],
                    MUTED.stroke_width(2),
                ))
                .drawn()?;
                for k in 0..4 {
                    let x0 = 12 + 9 * k;
                    area.draw(&PathElement::new(
                        vec![(x0, y + 19), (x0 + 9, y + 1)],
                        MUTED.stroke_width(1),
                    ))
                    .drawn()?;
                }
                extra = text(area, t, y)?;
            }
            LegendItem::Dashed(t, color) => {
                let cy = y + 10;
                for x0 in [8, 30] {
                    area.draw(&PathElement::new(
                        vec![(x0, cy), (x0 + 14, cy)],
                        color.stroke_width(3),
                    ))
                    .drawn()?;
                }
                extra = text(area, t, y)?;
            }
        }
        y += row + extra;
    }
    Ok(())
}

/// The figure's title lines: its heading (`Fig. 4 — …`) and what the data is.
pub struct Title {
    pub heading: String,
    pub context: String,
}

/// Split `body` into the plot area and the legend column on its right.
pub fn with_legend<DB: DrawingBackend>(
    body: &DrawingArea<DB, Shift>,
) -> (DrawingArea<DB, Shift>, DrawingArea<DB, Shift>) {
    let (w, _) = body.dim_in_pixel();
    body.split_horizontally(w.saturating_sub(LEGEND_W))
}
