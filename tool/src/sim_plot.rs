//! The SVG of `gwtf sim --plot`: throughput over time per policy, the
//! throughput the bound allows (dotted, the first run's membership), and the
//! churn events (crashes, graceful leaves, joins) marked across the chart.
//!
//! Made to be read without the source at hand: every mark has a legend entry,
//! the policies differ in colour, width, dash and point marker (so that a line
//! hidden under another where they coincide still shows), and integer ticks
//! print as integers. The legend has its own panel right of the chart so it
//! never covers data.
use gwtf::sim::SimReport;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type Res = Result<(), Box<dyn std::error::Error>>;

const WIDTH: u32 = 1100;
const HEIGHT: u32 = 560;
const LEGEND_WIDTH: u32 = 170;

const GWTF: RGBColor = RGBColor(31, 119, 180);
const SWARM: RGBColor = RGBColor(255, 127, 14);
const OPTIMAL: RGBColor = RGBColor(44, 160, 44);
const OTHER: RGBColor = RGBColor(90, 90, 90);
const DECCOM: RGBColor = RGBColor(188, 189, 34);
const BOUND: RGBColor = RGBColor(0, 0, 0);
const CRASH: RGBColor = RGBColor(214, 39, 40);
const JOIN: RGBColor = RGBColor(23, 190, 207);
const LEAVE: RGBColor = RGBColor(148, 103, 189);

/// How one policy's line looks. The central plan is a wide pale band drawn first,
/// SWARM a dashed line with triangles, GWTF a solid line with dots on top.
#[derive(Clone, Copy)]
struct LineLook {
    color: RGBColor,
    width: u32,
    alpha: f64,
    dashed: bool,
    marker: Marker,
}

#[derive(Clone, Copy, PartialEq)]
enum Marker {
    None,
    Dot,
    Triangle,
    Square,
}

fn look(policy: &str) -> LineLook {
    match policy {
        "central-mcmf" => LineLook {
            color: OPTIMAL,
            width: 8,
            alpha: 0.35,
            dashed: false,
            marker: Marker::None,
        },
        "swarm" => LineLook {
            color: SWARM,
            width: 2,
            alpha: 1.0,
            dashed: true,
            marker: Marker::Triangle,
        },
        "swarm-deccom" => LineLook {
            color: DECCOM,
            width: 2,
            alpha: 1.0,
            dashed: true,
            marker: Marker::Square,
        },
        "gwtf" => LineLook {
            color: GWTF,
            width: 2,
            alpha: 1.0,
            dashed: false,
            marker: Marker::Dot,
        },
        _ => LineLook {
            color: OTHER,
            width: 2,
            alpha: 1.0,
            dashed: false,
            marker: Marker::Square,
        },
    }
}

/// Draw order: the widest, palest line first so the narrow ones stay visible.
fn draw_rank(policy: &str) -> u8 {
    match policy {
        "central-mcmf" => 0,
        "swarm" => 1,
        "gwtf" => 3,
        _ => 2,
    }
}

/// Churn event kinds in legend order, with their colour and whether the
/// triangle at the top of the chart points down (departures) or up (joins).
const CHURN: [(&str, RGBColor, bool); 3] = [
    ("crash", CRASH, true),
    ("leave", LEAVE, true),
    ("join", JOIN, false),
];

/// A tick label: integers without a fractional part, others with at most 2
/// decimals (trailing zeros dropped).
pub fn tick(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        let s = format!("{v:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Writes the SVG. `subtitle` describes the run (scenario, churn).
pub fn plot(path: &std::path::Path, subtitle: &str, reports: &[SimReport]) -> Res {
    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let (chart_area, legend_area) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
    // Churn of the first run (every policy's run uses the same seed and rates).
    let churn: &[(f64, String)] = reports.first().map_or(&[], |r| &r.churn);
    chart(&chart_area, subtitle, reports, churn)?;
    legend(&legend_area, reports, churn)?;
    root.present()?;
    Ok(())
}

/// The throughput the first run's bound allows (the iteration's microbatches
/// per bound), as steps from each bound change to the next and on to `tmax`.
fn bound_line(reports: &[SimReport], tmax: f64) -> Vec<(f64, f64)> {
    let Some(r) = reports.first() else {
        return Vec::new();
    };
    let mut pts: Vec<(f64, f64)> = Vec::new();
    for &(t, b, mbs) in r.bound_series.iter().filter(|x| x.1 > 0.0) {
        if let Some(&(_, last)) = pts.last() {
            pts.push((t, last));
        }
        pts.push((t, mbs as f64 / b * 3600.0));
    }
    if let Some(&(_, last)) = pts.last() {
        pts.push((tmax, last));
    }
    pts
}

fn chart(area: &Area, subtitle: &str, reports: &[SimReport], churn: &[(f64, String)]) -> Res {
    let tmax = reports
        .iter()
        .flat_map(|r| r.series.iter().map(|x| x.0))
        .chain(churn.iter().map(|c| c.0))
        .fold(1.0f64, f64::max);
    let bound = bound_line(reports, tmax);
    let ymax = reports
        .iter()
        .flat_map(|r| r.series.iter().map(|x| x.1))
        .chain(bound.iter().map(|x| x.1))
        .fold(1.0f64, f64::max)
        * 1.12;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("Throughput over time: {subtitle}"),
            ("sans-serif", 24),
        )
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..tmax, 0.0..ymax)?;
    chart
        .configure_mesh()
        .x_desc("simulated time (s)")
        .y_desc("microbatches per hour (last iteration)")
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .light_line_style(BLACK.mix(0.04))
        .bold_line_style(BLACK.mix(0.15))
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 17))
        .draw()?;

    // Full-height churn lines, then a triangle at the top of each.
    for (t, kind) in churn {
        let (color, down) = churn_style(kind);
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(*t, 0.0), (*t, ymax)],
            color.mix(0.55).stroke_width(1),
        )))?;
        chart.draw_series(std::iter::once(
            EmptyElement::at((*t, ymax)) + churn_marker(color, down, 7, 8),
        ))?;
    }

    chart.draw_series(DashedLineSeries::new(bound, 3, 4, BOUND.stroke_width(2)))?;
    let mut order: Vec<&SimReport> = reports.iter().collect();
    order.sort_by_key(|r| draw_rank(&r.policy));
    for r in order {
        let l = look(&r.policy);
        let style = l.color.mix(l.alpha).stroke_width(l.width);
        let pts = r.series.iter().copied();
        if l.dashed {
            chart.draw_series(DashedLineSeries::new(pts, 9, 5, style))?;
        } else {
            chart.draw_series(LineSeries::new(pts, style))?;
        }
        if l.marker != Marker::None {
            chart.draw_series(r.series.iter().filter_map(|&p| {
                point_marker(l.marker, l.color).map(|shape| EmptyElement::at(p) + shape)
            }))?;
        }
    }
    Ok(())
}

fn churn_style(kind: &str) -> (RGBColor, bool) {
    CHURN
        .iter()
        .find(|c| c.0 == kind)
        .map_or((OTHER, true), |c| (c.1, c.2))
}

/// A filled triangle of half-size `s`, pointing down for a departure and up
/// for a join, centred `dy` pixels below the anchor.
fn churn_marker(color: RGBColor, down: bool, s: i32, dy: i32) -> Polygon<(i32, i32)> {
    let pts = if down {
        vec![(-s, dy - s), (s, dy - s), (0, dy + s)]
    } else {
        vec![(-s, dy + s), (s, dy + s), (0, dy - s)]
    };
    Polygon::new(pts, color.filled())
}

/// The point marker of a policy as a small filled polygon around the anchor
/// (none for the optimum's band). Polygons keep every marker one element type.
fn point_marker(m: Marker, color: RGBColor) -> Option<Polygon<(i32, i32)>> {
    let pts: Vec<(i32, i32)> = match m {
        Marker::None => return None,
        Marker::Dot => (0..10)
            .map(|i| {
                let a = i as f64 * std::f64::consts::TAU / 10.0;
                (
                    (4.0 * a.cos()).round() as i32,
                    (4.0 * a.sin()).round() as i32,
                )
            })
            .collect(),
        Marker::Triangle => vec![(-6, 5), (6, 5), (0, -6)],
        Marker::Square => vec![(-3, -3), (3, -3), (3, 3), (-3, 3)],
    };
    Some(Polygon::new(pts, color.filled()))
}

/// The legend panel: one row per policy drawn, then one per churn kind that
/// occurred (crash and join always, so a reader knows what would mark them).
fn legend(area: &Area, reports: &[SimReport], churn: &[(f64, String)]) -> Res {
    let text = ("sans-serif", 18).into_font().color(&BLACK);
    let row = 28;
    let (x0, mut y) = (10, 66);
    area.draw(&Text::new("policy", (x0, y - 32), text.clone()))?;
    for r in reports {
        let l = look(&r.policy);
        let style = l.color.mix(l.alpha).stroke_width(l.width);
        let line = vec![(x0, y), (x0 + 44, y)];
        if l.dashed {
            area.draw(&DashedPathElement::new(line, 9, 5, style))?;
        } else {
            area.draw(&PathElement::new(line, style))?;
        }
        if let Some(shape) = point_marker(l.marker, l.color) {
            area.draw(&(EmptyElement::at((x0 + 22, y)) + shape))?;
        }
        area.draw(&Text::new(r.policy.clone(), (x0 + 56, y - 8), text.clone()))?;
        y += row;
    }
    if reports.first().is_some_and(|r| !r.bound_series.is_empty()) {
        let line = vec![(x0, y), (x0 + 44, y)];
        area.draw(&DashedPathElement::new(line, 3, 4, BOUND.stroke_width(2)))?;
        area.draw(&Text::new("bound", (x0 + 56, y - 8), text.clone()))?;
        y += row;
    }
    y += 26;
    area.draw(&Text::new("churn event", (x0, y - 32), text.clone()))?;
    for (kind, color, down) in CHURN {
        let count = churn.iter().filter(|c| c.1 == kind).count();
        if count == 0 && kind == "leave" {
            continue;
        }
        area.draw(&PathElement::new(
            vec![(x0 + 22, y - 11), (x0 + 22, y + 11)],
            color.mix(0.55).stroke_width(1),
        ))?;
        area.draw(&(EmptyElement::at((x0 + 22, y)) + churn_marker(color, down, 7, 0)))?;
        area.draw(&Text::new(
            format!("{kind} ({count})"),
            (x0 + 56, y - 8),
            text.clone(),
        ))?;
        y += row;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn ticks_print_integers_as_integers() {
        assert_eq!(super::tick(&200.0), "200");
        assert_eq!(super::tick(&0.0), "0");
        assert_eq!(super::tick(&2.5), "2.5");
        assert_eq!(super::tick(&0.1), "0.1");
    }
}
