//! `gwtf sim` (the discrete-event simulator) and `gwtf bench sim`.
use clap::Args;
use gwtf::protocol::Policy;
use gwtf::sim::model::ModelPreset;
use gwtf::sim::scenario::Scenario;
use gwtf::sim::{Sim, SimConfig, SimReport};

#[derive(Args)]
pub struct SimArgs {
    /// geo10, homogeneous, or the path of a scenario file (format in the
    /// documentation of gwtf::sim::scenario).
    #[arg(long, default_value = "geo10")]
    scenario: String,
    /// llama-124m, llama-500m or llama-1.5b.
    #[arg(long, default_value = "llama-500m")]
    model: String,
    /// Departures (and joins) per hour as a fraction of the nodes (0.16 = 16%).
    #[arg(long, default_value_t = 0.0)]
    churn_per_hour: f64,
    /// Fraction of departures that are graceful leaves; the rest crash.
    #[arg(long, default_value_t = 0.25)]
    leave_fraction: f64,
    /// gwtf, swarm, optimal or all.
    #[arg(long, default_value = "all")]
    policy: String,
    #[arg(long, default_value_t = 20)]
    iterations: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Data holders.
    #[arg(long, default_value_t = 10)]
    holders: u32,
    /// Relays (spread over the stages and regions).
    #[arg(long, default_value_t = 60)]
    relays: u32,
    /// Microbatches per holder per iteration.
    #[arg(long, default_value_t = 8)]
    microbatches: u32,
    /// Microbatches in flight per holder.
    #[arg(long, default_value_t = 4)]
    in_flight: u32,
    /// Write one JSON object per policy (an array) to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write an SVG of throughput over time with churn events.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

fn policies(p: &str) -> Result<Vec<Policy>, String> {
    Ok(match p {
        "gwtf" => vec![Policy::Gwtf],
        "swarm" => vec![Policy::Swarm],
        "optimal" => vec![Policy::Optimal],
        "all" => vec![Policy::Gwtf, Policy::Swarm, Policy::Optimal],
        other => {
            return Err(format!(
                "unknown policy `{other}` (gwtf, swarm, optimal, all)"
            ))
        }
    })
}

fn config(a: &SimArgs, policy: Policy) -> Result<SimConfig, String> {
    let scenario = Scenario::by_name(&a.scenario)?;
    let model = ModelPreset::by_name(&a.model).ok_or_else(|| {
        format!(
            "unknown model `{}` (llama-124m, llama-500m, llama-1.5b)",
            a.model
        )
    })?;
    if !(0.0..=100.0).contains(&a.churn_per_hour) || !a.churn_per_hour.is_finite() {
        return Err("--churn-per-hour must be in 0..=100".into());
    }
    if !(0.0..=1.0).contains(&a.leave_fraction) {
        return Err("--leave-fraction must be in 0..=1".into());
    }
    if a.holders == 0 || a.relays < model.relay_stages as u32 {
        return Err(format!(
            "need at least one holder and one relay per stage ({} relay stages)",
            model.relay_stages
        ));
    }
    if a.iterations == 0 || a.microbatches == 0 || a.in_flight == 0 {
        return Err("--iterations, --microbatches and --in-flight must be > 0".into());
    }
    let mut c = SimConfig::new(scenario, model, policy);
    c.churn_per_hour = a.churn_per_hour;
    c.leave_fraction = a.leave_fraction;
    c.iterations = a.iterations;
    c.seed = a.seed;
    c.holders = a.holders;
    c.relays = a.relays;
    c.mb_per_iter = a.microbatches;
    c.max_in_flight = a.in_flight;
    c.reference_optimum = a.holders + a.relays <= 2000;
    Ok(c)
}

pub fn run(a: SimArgs) -> super::CliResult {
    let pols = policies(&a.policy)?;
    let mut reports = Vec::new();
    for p in pols {
        let cfg = config(&a, p)?;
        reports.push(Sim::new(cfg).run());
    }
    print_table(&a, &reports);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&reports)? + "\n")?;
    }
    if let Some(path) = &a.plot {
        plot(path, &reports)?;
    }
    Ok(())
}

fn print_table(a: &SimArgs, reports: &[SimReport]) {
    println!(
        "scenario {} | model {} | {} holders + {} relays | churn {:.0}%/h | {} iterations x {} microbatches/holder | seed {}",
        a.scenario,
        a.model,
        a.holders,
        a.relays,
        a.churn_per_hour * 100.0,
        a.iterations,
        a.microbatches,
        a.seed
    );
    println!(
        "{:<8} {:>10} {:>10} {:>9} {:>9} {:>8} {:>7} {:>6} {:>7} {:>6} {:>12} {:>16}",
        "policy",
        "train_s",
        "mb/hour",
        "it_p50_s",
        "it_p95_s",
        "s/mb",
        "waste%",
        "lost",
        "recomp",
        "crash",
        "flow/opt",
        "critpath/opt_s"
    );
    for r in reports {
        println!(
            "{:<8} {:>10.0} {:>10.0} {:>9.1} {:>9.1} {:>8.2} {:>7.2} {:>6} {:>7} {:>6} {:>12} {:>16}",
            r.policy,
            r.training_time_s,
            r.throughput_microbatches_per_hour,
            r.iteration_time_p50_s,
            r.iteration_time_p95_s,
            r.time_per_microbatch_s,
            r.wasted_gpu_pct,
            r.lost_microbatches,
            r.recomputed_stages,
            r.crashes,
            format!("{:.0}/{:.0}", r.flow_value, r.optimal_flow_value),
            format!("{:.2}/{:.2}", r.critical_path_s, r.optimal_critical_path_s),
        );
    }
    for r in reports {
        let mut notes = Vec::new();
        if !r.completed {
            notes.push(format!(
                "finished {} of {} iterations",
                r.iterations_done, r.iterations_requested
            ));
        }
        if let Some(p) = &r.paused {
            notes.push(p.clone());
        }
        for (t, s) in &r.empty_stages {
            notes.push(format!("stage {s} empty at {t:.0} s"));
        }
        if let Some((t, it, st)) = r.stalls.first() {
            notes.push(format!(
                "{} stall reports (first: iteration {it} waiting for stage {st} at {t:.0} s)",
                r.stalls.len()
            ));
        }
        for v in &r.violations {
            notes.push(format!("INVARIANT VIOLATED: {v}"));
        }
        if r.joins + r.leaves > 0 || r.restarts > 0 || r.dropped_with_holder > 0 {
            notes.push(format!(
                "joins {} leaves {} restarts {} reroutes {} dropped-with-holder {}",
                r.joins, r.leaves, r.restarts, r.reroutes, r.dropped_with_holder
            ));
        }
        if !notes.is_empty() {
            println!("{}: {}", r.policy, notes.join("; "));
        }
    }
}

fn plot(path: &std::path::Path, reports: &[SimReport]) -> super::CliResult {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let tmax = reports
        .iter()
        .flat_map(|r| r.series.iter().map(|x| x.0))
        .fold(1.0f64, f64::max);
    let ymax = reports
        .iter()
        .flat_map(|r| r.series.iter().map(|x| x.1))
        .fold(1.0f64, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Throughput over time (microbatches/hour)",
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..tmax, 0.0..ymax)?;
    chart
        .configure_mesh()
        .x_desc("simulated time (s)")
        .y_desc("microbatches / hour")
        .draw()?;
    let colors = [BLUE, RED, GREEN];
    for (i, r) in reports.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(r.series.iter().copied(), c.stroke_width(2)))?
            .label(r.policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    // Churn events of the first run (all runs use the same seed and rates).
    if let Some(r) = reports.first() {
        for (t, kind) in &r.churn {
            let c = match kind.as_str() {
                "crash" => RED.mix(0.35),
                "leave" => MAGENTA.mix(0.35),
                _ => BLACK.mix(0.2),
            };
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(*t, 0.0), (*t, ymax * 0.05)],
                c,
            )))?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[derive(Args)]
pub struct BenchSimArgs {
    /// Node counts of the geo10 runs to time.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    nodes: Vec<u32>,
    #[arg(long, default_value_t = 20)]
    iterations: u32,
    #[arg(long, default_value = "gwtf")]
    policy: String,
}

pub fn bench(a: BenchSimArgs) -> super::CliResult {
    let pol = match policies(&a.policy)?.as_slice() {
        [p] => *p,
        _ => return Err("bench sim takes one policy".into()),
    };
    println!(
        "cores: {}",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>7} {:>6} {:>10} {:>11} {:>13} {:>11}",
        "nodes", "iters", "events", "wall_s", "events/s", "sim_time_s"
    );
    for &n in &a.nodes {
        let holders = (n / 10).max(1);
        let mut c = SimConfig::new(Scenario::geo10(), ModelPreset::llama_500m(), pol);
        c.holders = holders;
        c.relays = n - holders;
        c.iterations = a.iterations;
        c.reference_optimum = false;
        let t = std::time::Instant::now();
        let r = Sim::new(c).run();
        let wall = t.elapsed().as_secs_f64();
        println!(
            "{:>7} {:>6} {:>10} {:>11.2} {:>13.0} {:>11.0}{}",
            n,
            r.iterations_done,
            r.events,
            wall,
            r.events as f64 / wall,
            r.training_time_s,
            if r.completed {
                ""
            } else {
                "  (did not complete)"
            }
        );
    }
    Ok(())
}
