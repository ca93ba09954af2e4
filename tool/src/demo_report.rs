//! `gwtf demo --report out.html`: one self-contained page (no script, no
//! external file) with three SVG plots drawn by plotters and inlined, and a
//! table of the run's facts:
//!
//! - the loss per iteration of the swarm against the single-process reference;
//! - throughput (tokens/s of each iteration, at the time it ended) with every
//!   crash (red, pointing down), pause (purple) and cut link (brown; both
//!   pointing down, their length shaded) and join (cyan, pointing up) marked;
//! - live members of each stage over time (holders and each relay stage).
use super::sim_plot::tick;
use gwtf::swarm::audit::Summary;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use std::fmt::Write as _;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const W: u32 = 900;
const H: u32 = 420;
const SWARM: RGBColor = RGBColor(31, 119, 180);
const REFERENCE: RGBColor = RGBColor(0, 0, 0);
const RESTORE: RGBColor = RGBColor(214, 39, 40);
const CRASH: RGBColor = RGBColor(214, 39, 40);
const JOIN: RGBColor = RGBColor(23, 190, 207);
const PAUSE: RGBColor = RGBColor(148, 103, 189);
const CUT: RGBColor = RGBColor(140, 86, 75);
const STAGES: [RGBColor; 8] = [
    RGBColor(90, 90, 90),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(188, 189, 34),
];

fn font(size: u32) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&BLACK)
}

/// A filled triangle, pointing down (departure) or up (join), `dy` pixels
/// below the anchor.
fn triangle(color: RGBColor, down: bool, dy: i32) -> Polygon<(i32, i32)> {
    let s = 6;
    let pts = if down {
        vec![(-s, dy - s), (s, dy - s), (0, dy + s)]
    } else {
        vec![(-s, dy + s), (s, dy + s), (0, dy - s)]
    };
    Polygon::new(pts, color.filled())
}

/// Loss per iteration: the swarm's (mean over all holders' microbatches) and
/// the reference's.
pub fn loss_svg(s: &Summary) -> Res<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (W, H)).into_drawing_area();
        root.fill(&WHITE)?;
        let swarm: Vec<(u64, f64)> = s
            .per_iteration
            .iter()
            .enumerate()
            .map(|(i, r)| (i as u64 + 1, r.loss))
            .collect();
        let reference: Vec<(u64, f64)> = s
            .reference_loss
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, &l)| (i as u64 + 1, l))
            .collect();
        let all = swarm.iter().chain(&reference);
        let xmax = all.clone().map(|p| p.0).fold(2, u64::max);
        let (lo, hi) = all
            .map(|p| p.1)
            .filter(|v| v.is_finite())
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
                (a.min(v), b.max(v))
            });
        let (lo, hi) = if lo.is_finite() {
            let pad = ((hi - lo) * 0.08).max(0.05);
            ((lo - pad).max(0.0), hi + pad)
        } else {
            (0.0, 1.0)
        };
        let mut chart = ChartBuilder::on(&root)
            .caption("Training loss per iteration", font(22))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(1..xmax, lo..hi)?;
        chart
            .configure_mesh()
            .x_desc("iteration")
            .y_desc("loss")
            .x_labels((xmax as usize).min(16))
            .y_label_formatter(&tick)
            .light_line_style(BLACK.mix(0.04))
            .label_style(font(14))
            .axis_desc_style(font(15))
            .draw()?;
        if !reference.is_empty() {
            chart
                .draw_series(DashedLineSeries::new(
                    reference,
                    6,
                    4,
                    REFERENCE.stroke_width(2),
                ))?
                .label("single process (same model, seed, batch)")
                .legend(|(x, y)| {
                    DashedPathElement::new(
                        vec![(x, y), (x + 24, y)],
                        6,
                        4,
                        REFERENCE.stroke_width(2),
                    )
                });
        }
        // Where an emptied stage was taken up: the first iteration on its
        // restored (or fresh) weights.
        for (n, r) in s.restores.iter().enumerate() {
            let x = r.applied.map_or(1, |a| a + 2);
            let what = match r.iteration {
                Some(k) => format!("stage {} restored (copy of iteration {k})", r.stage),
                None if !r.rebuilt_from.is_empty() => {
                    format!("stage {} rebuilt (average of its neighbours)", r.stage)
                }
                None => format!("stage {} restarted (initial weights)", r.stage),
            };
            let s = chart.draw_series(DashedLineSeries::new(
                [(x, lo), (x, hi)],
                3,
                3,
                RESTORE.stroke_width(2),
            ))?;
            if n == 0 {
                s.label(what).legend(|(x, y)| {
                    DashedPathElement::new(vec![(x, y), (x + 24, y)], 3, 3, RESTORE.stroke_width(2))
                });
            }
        }
        chart
            .draw_series(LineSeries::new(swarm.clone(), SWARM.stroke_width(2)))?
            .label("swarm (mean over the holders' microbatches)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], SWARM.stroke_width(2)));
        chart.draw_series(swarm.iter().map(|&p| Circle::new(p, 3, SWARM.filled())))?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.3))
            .label_font(font(14))
            .draw()?;
        root.present()?;
    }
    Ok(out)
}

/// Throughput over time with the crashes and joins marked.
pub fn throughput_svg(s: &Summary) -> Res<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (W, H)).into_drawing_area();
        root.fill(&WHITE)?;
        let tmax = s
            .throughput
            .iter()
            .map(|p| p.0)
            .chain(s.kills.iter().map(|k| k.t_s))
            .chain(s.pauses.iter().map(|p| p.t_s + p.for_s))
            .chain(s.join_times_s.iter().copied())
            .fold(1.0, f64::max);
        let ymax = s.throughput.iter().map(|p| p.1).fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(&root)
            .caption("Throughput over time", font(22))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(72)
            .build_cartesian_2d(0.0..tmax * 1.02, 0.0..ymax)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the demo started")
            .y_desc("tokens/s (iteration ending then)")
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .light_line_style(BLACK.mix(0.04))
            .label_style(font(14))
            .axis_desc_style(font(15))
            .draw()?;
        // Each pause's (cut's) length, shaded.
        chart.draw_series(s.pauses.iter().map(|p| {
            let end = p.resumed_s.unwrap_or(p.t_s + p.for_s);
            let color = if p.kind == "cut" { CUT } else { PAUSE };
            Rectangle::new([(p.t_s, 0.0), (end, ymax)], color.mix(0.08).filled())
        }))?;
        let mut marks = vec![(
            s.kills.iter().map(|k| k.t_s).collect::<Vec<_>>(),
            CRASH,
            true,
            "crash (SIGKILL)",
        )];
        for (kind, color, name) in [
            ("pause", PAUSE, "pause (SIGSTOP, then SIGCONT)"),
            ("cut", CUT, "link cut, then restored"),
        ] {
            let times: Vec<f64> = (s.pauses.iter())
                .filter(|p| p.kind == kind)
                .map(|p| p.t_s)
                .collect();
            if !times.is_empty() {
                marks.push((times, color, true, name));
            }
        }
        marks.push((s.join_times_s.clone(), JOIN, false, "join"));
        for (times, color, down, name) in marks {
            let n = times.len();
            chart
                .draw_series(times.iter().map(|&t| {
                    PathElement::new(vec![(t, 0.0), (t, ymax)], color.mix(0.5).stroke_width(1))
                }))?
                .label(format!("{name} ({n})"))
                .legend(move |(x, y)| EmptyElement::at((x + 10, y)) + triangle(color, down, 0));
            chart.draw_series(
                times
                    .iter()
                    .map(|&t| EmptyElement::at((t, ymax)) + triangle(color, down, 8)),
            )?;
        }
        chart
            .draw_series(LineSeries::new(
                s.throughput.iter().copied(),
                SWARM.stroke_width(2),
            ))?
            .label("tokens/s")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], SWARM.stroke_width(2)));
        chart.draw_series(
            s.throughput
                .iter()
                .map(|&p| Circle::new(p, 3, SWARM.filled())),
        )?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.3))
            .label_font(font(14))
            .draw()?;
        root.present()?;
    }
    Ok(out)
}

/// Live members per stage over time, as steps.
pub fn membership_svg(s: &Summary) -> Res<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (W, H)).into_drawing_area();
        root.fill(&WHITE)?;
        let stages = s
            .membership
            .iter()
            .map(|m| m.members.len())
            .max()
            .unwrap_or(0);
        let tmax = s
            .membership
            .iter()
            .map(|m| m.t_s)
            .chain(std::iter::once(s.wall_s))
            .fold(1.0, f64::max);
        let ymax = s
            .membership
            .iter()
            .flat_map(|m| m.members.iter().copied())
            .max()
            .unwrap_or(1)
            .max(1) as f64
            + 1.0;
        let mut chart = ChartBuilder::on(&root)
            .caption("Live members per stage", font(22))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..tmax * 1.02, 0.0..ymax)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the demo started")
            .y_desc("live members")
            .x_label_formatter(&tick)
            .y_labels(ymax as usize + 1)
            .y_label_formatter(&|v: &f64| {
                if (v - v.round()).abs() < 1e-9 {
                    tick(v)
                } else {
                    String::new()
                }
            })
            .light_line_style(BLACK.mix(0.04))
            .label_style(font(14))
            .axis_desc_style(font(15))
            .draw()?;
        for stage in 0..stages {
            let mut pts: Vec<(f64, f64)> = Vec::new();
            for m in &s.membership {
                let v = m.members.get(stage).copied().unwrap_or(0) as f64;
                if let Some(&(_, last)) = pts.last() {
                    pts.push((m.t_s, last));
                }
                pts.push((m.t_s, v));
            }
            if let Some(&(_, last)) = pts.last() {
                pts.push((tmax, last));
            }
            // Lines of equal stages would hide each other: shift each a little.
            let dy = (stage as f64 - (stages as f64 - 1.0) / 2.0) * 0.04;
            let color = STAGES[stage % STAGES.len()];
            let name = if stage == 0 {
                "holders (stage 0)".to_string()
            } else {
                format!("stage {stage} relays")
            };
            chart
                .draw_series(LineSeries::new(
                    pts.into_iter().map(|(x, y)| (x, y + dy)),
                    color.stroke_width(2),
                ))?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.3))
            .label_font(font(14))
            .draw()?;
        root.present()?;
    }
    Ok(out)
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.digits$}"))
}

/// The rows of the facts table.
pub fn fact_rows(s: &Summary) -> Vec<(&'static str, String)> {
    let mut rows = vec![
        (
            "result",
            if s.ok {
                "ok".into()
            } else {
                format!("FAILED ({} problems)", s.failures.len())
            },
        ),
        (
            "swarm",
            format!(
                "{}, {} pipeline stages; {} holders, {} founding relays, {} microbatches per \
                 holder per iteration",
                s.model, s.model_stages, s.holders, s.relays_founding, s.microbatches_per_holder
            ),
        ),
        (
            "iterations",
            format!("{} of {}", s.iterations, s.iterations_planned),
        ),
        (
            "loss first / last",
            format!("{} / {}", opt(s.loss_first, 4), opt(s.loss_last, 4)),
        ),
        (
            "reference loss first / last",
            format!(
                "{} / {}",
                opt(s.reference_loss_first, 4),
                opt(s.reference_loss_last, 4)
            ),
        ),
        (
            "largest loss difference from the reference",
            opt(s.loss_max_diff_vs_reference, 4),
        ),
        (
            "microbatches lost / counted twice / dropped",
            format!(
                "{} / {} / {} ({} commits made again after losing a member)",
                s.lost_microbatches,
                s.double_counted_microbatches,
                s.dropped_microbatches,
                s.recommits
            ),
        ),
        (
            "replicas agree",
            format!(
                "{} ({} stage-iterations compared)",
                if s.replicas_agree { "yes" } else { "NO" },
                s.replica_checks
            ),
        ),
        (
            "crashes / joins (became members)",
            format!("{} / {} ({})", s.crashes, s.joins, s.joins_active),
        ),
        (
            "recovered hops (rerouted / restarted)",
            format!(
                "{} ({} / {})",
                s.recovered_hops, s.recovered_rerouted, s.recovered_restarted
            ),
        ),
        (
            "kills of a node carrying microbatches",
            format!("{} of {}", s.kills_carrying, s.kills.len()),
        ),
        (
            "recovery after a kill, median / max",
            format!(
                "{} ms / {} ms ({} kills without a recovery)",
                opt(s.recovery_ms_median, 0),
                opt(s.recovery_ms_max, 0),
                s.kills_without_recovery
            ),
        ),
        (
            "wasted compute",
            format!("{} %", opt(s.wasted_compute_pct, 1)),
        ),
        ("tokens/s", format!("{:.0}", s.tokens_per_s)),
        (
            "state downloads",
            gwtf::swarm::audit::downloads_line(&s.state_downloads),
        ),
        ("wall time", format!("{:.1} s", s.wall_s)),
    ];
    if !s.restores.is_empty() {
        rows.push((
            "emptied stages taken up",
            gwtf::swarm::audit::restores_line(s),
        ));
    }
    if s.pause_count + s.cut_count > 0 {
        // After the recovery after a kill.
        let at = rows
            .iter()
            .position(|r| r.0.starts_with("recovery after a kill"))
            .map_or(rows.len(), |i| i + 1);
        rows.insert(
            at,
            (
                "pauses (SIGSTOP, then SIGCONT) and cut links",
                format!(
                    "{} pauses, {} cuts ({} carrying microbatches, {} without a recovery; \
                     {} fences)",
                    s.pause_count,
                    s.cut_count,
                    s.pauses_carrying,
                    s.pauses.iter().filter(|p| p.recovery_ms.is_none()).count(),
                    s.fences
                ),
            ),
        );
    }
    rows
}

/// The whole page.
pub fn render_html(s: &Summary, command: &str) -> Res<String> {
    let mut h = String::new();
    h.push_str(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>gwtf demo</title>\n<style>\n\
         body{font-family:sans-serif;max-width:960px;margin:2em auto;color:#222}\n\
         table{border-collapse:collapse;margin:1em 0}\n\
         td,th{border:1px solid #ccc;padding:4px 10px;text-align:left;vertical-align:top}\n\
         .ok{color:#2a7d2a}.bad{color:#b22}\n\
         figure{margin:1.5em 0}svg{max-width:100%;height:auto}\n\
         code{background:#f4f4f4;padding:1px 4px}\n</style>\n</head>\n<body>\n",
    );
    let _ = writeln!(h, "<h1>gwtf demo: {}</h1>", esc(&s.model));
    let _ = writeln!(h, "<p><code>{}</code></p>", esc(command));
    let _ = writeln!(
        h,
        "<p class=\"{}\">{}</p>",
        if s.ok { "ok" } else { "bad" },
        if s.ok {
            "Every microbatch was counted exactly once at every stage and every stage's \
             replicas applied the same weights."
        } else {
            "The run failed:"
        }
    );
    if !s.failures.is_empty() {
        h.push_str("<ul class=\"bad\">\n");
        for f in &s.failures {
            let _ = writeln!(h, "<li>{}</li>", esc(f));
        }
        h.push_str("</ul>\n");
    }
    h.push_str("<table>\n");
    for (k, v) in fact_rows(s) {
        let _ = writeln!(h, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(&v));
    }
    h.push_str("</table>\n");
    if !s.warnings.is_empty() {
        h.push_str("<p>Warnings:</p>\n<ul>\n");
        for w in &s.warnings {
            let _ = writeln!(h, "<li>{}</li>", esc(w));
        }
        h.push_str("</ul>\n");
    }
    if !s.unverified.is_empty() {
        h.push_str("<p>Not checked:</p>\n<ul>\n");
        for u in &s.unverified {
            let _ = writeln!(h, "<li>{}</li>", esc(u));
        }
        h.push_str("</ul>\n");
    }
    for svg in [loss_svg(s)?, throughput_svg(s)?, membership_svg(s)?] {
        let _ = writeln!(h, "<figure>\n{}\n</figure>", svg.trim());
    }
    if !s.kills.is_empty() {
        h.push_str(
            "<h2>Crashes</h2>\n<table>\n<tr><th>t (s)</th><th>node</th><th>stage</th>\
             <th>timed to hit</th><th>microbatches in flight on it</th>\
             <th>recovery (ms)</th></tr>\n",
        );
        for k in &s.kills {
            let _ = writeln!(
                h,
                "<tr><td>{:.2}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                k.t_s,
                k.node,
                k.stage.map_or("-".into(), |x| x.to_string()),
                esc(&k.aim),
                k.carrying.map_or("-".into(), |x| x.to_string()),
                opt(k.recovery_ms, 0)
            );
        }
        h.push_str("</table>\n");
    }
    if !s.pauses.is_empty() {
        h.push_str(
            "<h2>Pauses and cut links</h2>\n<table>\n<tr><th>t (s)</th><th>what</th>\
             <th>node</th><th>stage</th><th>for (s)</th><th>resumed at (s)</th><th>timed to hit</th>\
             <th>microbatches in flight on it</th><th>recovery (ms)</th></tr>\n",
        );
        for p in &s.pauses {
            let _ = writeln!(
                h,
                "<tr><td>{:.2}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td>{}</td><td>{}</td><td>{}</td></tr>",
                p.t_s,
                p.kind,
                p.node,
                p.stage.map_or("-".into(), |x| x.to_string()),
                p.for_s,
                p.resumed_s.map_or("-".into(), |x| format!("{x:.2}")),
                esc(&p.aim),
                p.carrying.map_or("-".into(), |x| x.to_string()),
                opt(p.recovery_ms, 0)
            );
        }
        h.push_str("</table>\n");
    }
    h.push_str(
        "<p>Recovery: from the kill to the first <code>recovered</code> line for the killed \
         node's stage, before another node of that stage is killed. Wasted compute: \
         (compute &minus; useful) / compute over every node's last <code>stats</code> line, \
         killed nodes included. Tokens/s: tokens of the completed iterations over the time \
         from the last founding member's <code>active</code> to the last iteration.</p>\n\
         </body>\n</html>\n",
    );
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gwtf::swarm::audit::{parse_line, Entry, Facts, Plan, What};

    /// A small run: two holders, one relay per stage of a 4-stage cut, a
    /// crash, a join, two iterations.
    pub fn summary() -> Summary {
        let mut f = Facts::new(4);
        let push = |f: &mut Facts, t: f64, what: What| f.push(&Entry { t, what });
        for (id, holder, stage) in [(0, true, 0), (1, true, 0), (2, false, 1), (3, false, 2)] {
            push(
                &mut f,
                0.0,
                What::Launched {
                    node: id,
                    holder,
                    joiner: false,
                    stage: Some(stage),
                },
            );
        }
        let line = |f: &mut Facts, t: f64, node: u64, text: String| {
            f.push(&Entry {
                t,
                what: What::Line {
                    node,
                    event: parse_line(&text),
                },
            })
        };
        for (id, stage) in [(0, 0), (1, 0), (2, 1), (3, 2)] {
            line(
                &mut f,
                0.3,
                id,
                format!(r#"{{"event":"active","node":{id},"stage":{stage}}}"#),
            );
        }
        push(
            &mut f,
            0.9,
            What::Launched {
                node: 4,
                holder: false,
                joiner: true,
                stage: None,
            },
        );
        line(
            &mut f,
            1.2,
            4,
            r#"{"event":"active","node":4,"stage":2}"#.into(),
        );
        push(
            &mut f,
            1.5,
            What::Killed {
                node: 3,
                aim: "backward <&>".into(),
                joiner: None,
                carrying: Some(2),
            },
        );
        push(
            &mut f,
            1.6,
            What::Paused {
                node: 2,
                aim: "microbatches in flight".into(),
                for_s: 0.5,
                carrying: Some(1),
                cut: false,
            },
        );
        push(&mut f, 2.1, What::Resumed { node: 2 });
        line(
            &mut f,
            1.7,
            0,
            r#"{"event":"recovered","node":0,"kind":"rerouted","stage":2,"iteration":1}"#.into(),
        );
        for i in 0..2u64 {
            let t = 1.0 + i as f64;
            for (stage, node) in [(1, 2), (2, 4)] {
                line(
                    &mut f,
                    t,
                    node,
                    format!(
                        r#"{{"event":"committed","node":{node},"stage":{stage},"iteration":{i},"microbatches":2,"dropped":0}}"#
                    ),
                );
            }
            for h in 0..2u64 {
                line(
                    &mut f,
                    t,
                    h,
                    format!(
                        r#"{{"event":"iteration","node":{h},"iteration":{i},"loss":{},"microbatches":1,"tokens":128}}"#,
                        5.5 - i as f64
                    ),
                );
            }
        }
        for h in 0..2u64 {
            line(&mut f, 2.5, h, format!(r#"{{"event":"done","node":{h}}}"#));
        }
        let plan = Plan {
            model: "llama-tiny".into(),
            stages: 4,
            iterations: 2,
            microbatches: 1,
        };
        f.summary(&plan, Some(&[5.5, 4.8]), 3.0)
    }

    #[test]
    fn the_report_is_one_page_with_three_svgs() {
        let s = summary();
        assert!(s.ok, "{:?}", s.failures);
        let html = render_html(&s, "gwtf demo --nodes 2 <x>").unwrap();
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.trim_end().ends_with("</html>"));
        assert_eq!(html.matches("<svg").count(), 3);
        assert_eq!(html.matches("</svg>").count(), 3);
        assert!(
            !html.contains("<?xml"),
            "inline SVG carries no XML declaration"
        );
        // Nothing is fetched from elsewhere.
        assert!(!html.contains("src=") && !html.contains("href="));
        // Text is escaped.
        assert!(html.contains("gwtf demo --nodes 2 &lt;x&gt;"));
        assert!(html.contains("backward &lt;&amp;&gt;"));
        assert!(!html.contains("<x>"));
        // Balanced tags of the page's own structure.
        for tag in ["table", "figure", "tr", "ul", "p", "body", "html", "head"] {
            let open = html.matches(&format!("<{tag}>")).count()
                + html.matches(&format!("<{tag} ")).count();
            let close = html.matches(&format!("</{tag}>")).count();
            assert_eq!(open, close, "<{tag}>");
        }
        // The plots name what they show.
        for label in [
            "Training loss per iteration",
            "single process",
            "Throughput over time",
            "crash (SIGKILL) (1)",
            "pause (SIGSTOP, then SIGCONT) (1)",
            "join (1)",
            "Live members per stage",
            "stage 2 relays",
        ] {
            assert!(html.contains(label), "{label}");
        }
    }

    #[test]
    fn an_empty_run_still_renders() {
        let f = Facts::new(4);
        let plan = Plan {
            model: "llama-tiny".into(),
            stages: 4,
            iterations: 3,
            microbatches: 1,
        };
        let s = f.summary(&plan, None, 0.0);
        assert!(!s.ok);
        let html = render_html(&s, "gwtf demo").unwrap();
        assert_eq!(html.matches("</svg>").count(), 3);
        assert!(html.contains("did not finish"));
        assert!(
            !html.contains("pause (SIGSTOP"),
            "no pause, no legend entry"
        );
    }

    /// With `GWTF_DEMO_REPORT_SAMPLES=DIR`, writes the test run's SVGs and page
    /// there for a look (`rsvg-convert -o x.png x.svg`).
    #[test]
    fn writes_samples_for_a_look_when_asked() {
        let Some(dir) = std::env::var_os("GWTF_DEMO_REPORT_SAMPLES") else {
            return;
        };
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).unwrap();
        let s = summary();
        std::fs::write(dir.join("loss.svg"), loss_svg(&s).unwrap()).unwrap();
        std::fs::write(dir.join("throughput.svg"), throughput_svg(&s).unwrap()).unwrap();
        std::fs::write(dir.join("membership.svg"), membership_svg(&s).unwrap()).unwrap();
        std::fs::write(
            dir.join("report.html"),
            render_html(&s, "gwtf demo").unwrap(),
        )
        .unwrap();
    }
}
