//! `gwtf sim` (the discrete-event simulator) and `gwtf bench sim`.
use clap::Args;
use gwtf::protocol::Policy;
use gwtf::sim::model::ModelPreset;
use gwtf::sim::scenario::Scenario;
use gwtf::sim::{Sim, SimConfig, SimReport};

use super::checks;

#[derive(Args)]
pub struct SimArgs {
    /// geo10, homogeneous, or the path of a scenario file (format: README,
    /// section "Scenario files"; example: scenarios/example.scenario).
    #[arg(long, default_value = "geo10")]
    scenario: String,
    /// llama-124m, llama-500m or llama-1.5b.
    #[arg(long, default_value = "llama-500m")]
    model: String,
    /// Departures (and joins) per hour as a fraction of the nodes (0.16 = 16%), 0..=100.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true,
          value_parser = checks::float_in(0.0, 100.0))]
    churn_per_hour: f64,
    /// Fraction of departures that are graceful leaves; the rest crash (0..=1).
    #[arg(long, default_value_t = 0.25, allow_negative_numbers = true,
          value_parser = checks::float_in(0.0, 1.0))]
    leave_fraction: f64,
    /// gwtf, swarm, swarm-plus, optimal or all.
    #[arg(long, default_value = "all")]
    policy: String,
    /// Training iterations to simulate (>= 1).
    #[arg(long, default_value_t = 20, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    iterations: u32,
    #[arg(long, default_value_t = 1, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(0))]
    seed: u64,
    /// Data holders (>= 1).
    #[arg(long, default_value_t = 10, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    holders: u32,
    /// Relays, spread over the stages and regions (at least one per stage).
    #[arg(long, default_value_t = 60, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    relays: u32,
    /// Microbatches per holder per iteration (>= 1).
    #[arg(long, default_value_t = 8, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    microbatches: u32,
    /// Microbatches in flight per holder (>= 1).
    #[arg(long, default_value_t = 4, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    in_flight: u32,
    /// Write one JSON object per policy (an array) to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write an SVG of throughput over time per policy, with crashes, leaves
    /// and joins marked.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

fn policies(p: &str) -> Result<Vec<Policy>, String> {
    Ok(match p {
        "gwtf" => vec![Policy::Gwtf],
        "swarm" => vec![Policy::Swarm],
        "swarm-plus" => vec![Policy::SwarmPlus],
        "optimal" => vec![Policy::Optimal],
        "all" => vec![
            Policy::Gwtf,
            Policy::Swarm,
            Policy::SwarmPlus,
            Policy::Optimal,
        ],
        other => {
            return Err(format!(
                "--policy {other}: unknown policy (gwtf, swarm, swarm-plus, optimal, all)"
            ))
        }
    })
}

fn model(name: &str) -> Result<ModelPreset, String> {
    ModelPreset::by_name(name).ok_or_else(|| {
        format!("--model {name}: unknown model (llama-124m, llama-500m, llama-1.5b)")
    })
}

/// The configuration of one run; the ranges of the numbers are checked by
/// their value parsers, what depends on two arguments here.
fn config(a: &SimArgs, scenario: &Scenario, policy: Policy) -> Result<SimConfig, String> {
    let model = model(&a.model)?;
    if a.relays < model.relay_stages as u32 {
        return Err(format!(
            "--relays {}: {} has {} relay stages and each needs at least one relay",
            a.relays, a.model, model.relay_stages
        ));
    }
    let mut c = SimConfig::new(scenario.clone(), model, policy);
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
    // Everything that can be refused is refused before the first run.
    let pols = policies(&a.policy)?;
    let scenario = Scenario::by_name(&a.scenario)?;
    let configs = pols
        .into_iter()
        .map(|p| config(&a, &scenario, p))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(path) = &a.json {
        checks::writable_output("--json", path)?;
    }
    if let Some(path) = &a.plot {
        checks::writable_output("--plot", path)?;
    }
    let reports: Vec<SimReport> = configs.into_iter().map(|c| Sim::new(c).run()).collect();
    print_table(&a, &reports);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&reports)? + "\n")
            .map_err(|e| format!("cannot write --json {}: {e}", path.display()))?;
    }
    if let Some(path) = &a.plot {
        let subtitle = format!(
            "{}, churn {}%/h",
            a.scenario,
            super::sim_plot::tick(&(a.churn_per_hour * 100.0))
        );
        super::sim_plot::plot(path, &subtitle, &reports)
            .map_err(|e| format!("cannot write --plot {}: {e}", path.display()))?;
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
        "{:<10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>7} {:>6} {:>7} {:>6} {:>12} {:>16}",
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
            "{:<10} {:>10.0} {:>10.0} {:>9.1} {:>9.1} {:>8.2} {:>7.2} {:>6} {:>7} {:>6} {:>12} {:>16}",
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
        if r.dropped_contributions > 0 {
            notes.push(format!("dropped-contributions {}", r.dropped_contributions));
        }
        if !notes.is_empty() {
            println!("{}: {}", r.policy, notes.join("; "));
        }
    }
}

#[derive(Args)]
pub struct BenchSimArgs {
    /// Node counts of the geo10 runs to time (a tenth of them, at least one, hold data).
    #[arg(long, value_delimiter = ',', default_value = "1000,10000", allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    nodes: Vec<u32>,
    /// Training iterations per run (>= 1).
    #[arg(long, default_value_t = 20, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    iterations: u32,
    /// gwtf, swarm or optimal.
    #[arg(long, default_value = "gwtf")]
    policy: String,
}

/// Holders and relays of a `bench sim` run of `n` nodes.
fn bench_split(n: u32) -> (u32, u32) {
    let holders = (n / 10).max(1);
    (holders, n.saturating_sub(holders))
}

pub fn bench(a: BenchSimArgs) -> super::CliResult {
    let pol = match policies(&a.policy)?.as_slice() {
        [p] => *p,
        _ => return Err(format!("--policy {}: bench sim takes one policy", a.policy).into()),
    };
    let stages = ModelPreset::llama_500m().relay_stages as u32;
    if let Some(n) = a.nodes.iter().find(|&&n| bench_split(n).1 < stages) {
        return Err(format!(
            "--nodes {n}: too few for llama-500m (one relay per each of its {stages} stages plus the holders)"
        )
        .into());
    }
    println!(
        "cores: {}",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>7} {:>6} {:>10} {:>11} {:>13} {:>11}",
        "nodes", "iters", "events", "wall_s", "events/s", "sim_time_s"
    );
    for &n in &a.nodes {
        let (holders, relays) = bench_split(n);
        let mut c = SimConfig::new(Scenario::geo10(), ModelPreset::llama_500m(), pol);
        c.holders = holders;
        c.relays = relays;
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
