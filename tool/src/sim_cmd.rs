//! `gwtf sim` (the discrete-event simulator) and `gwtf bench sim`.
use clap::Args;
use gwtf::protocol::Policy;
use gwtf::sim::model::ModelPreset;
use gwtf::sim::scenario::Scenario;
use gwtf::sim::{Sim, SimConfig, SimReport};

use super::checks;

#[derive(Args)]
pub struct SimArgs {
    /// geo10, geo10-gib, geo10-sparse, homogeneous, or the path of a scenario
    /// file (format: README, section "Scenario files"; example:
    /// scenarios/example.scenario).
    #[arg(long, default_value = "geo10")]
    scenario: String,
    /// llama-124m, llama-500m or llama-1.5b.
    #[arg(long, default_value = "llama-500m")]
    model: String,
    /// Sequences per microbatch (default: the model's, 2; the GWTF paper's
    /// configurations use about 64).
    #[arg(long, allow_negative_numbers = true,
          value_parser = checks::int_in::<usize>(1, 4096))]
    sequences: Option<usize>,
    /// Departures (and joins) per hour as a fraction of the nodes (0.16 = 16%), 0..=100.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true,
          value_parser = checks::float_in(0.0, 100.0))]
    churn_per_hour: f64,
    /// Fraction of departures that are graceful leaves; the rest crash (0..=1).
    #[arg(long, default_value_t = 0.25, allow_negative_numbers = true,
          value_parser = checks::float_in(0.0, 1.0))]
    leave_fraction: f64,
    /// gwtf, swarm, swarm-plus, swarm-deccom, central-mcmf (alias:
    /// optimal) or all.
    #[arg(long, default_value = "all")]
    policy: String,
    /// Training iterations to simulate (>= 1).
    #[arg(long, default_value_t = 20, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    iterations: u32,
    #[arg(long, default_value_t = 1, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(0))]
    seed: u64,
    /// Data holders (>= 1; default: the scenario's, else 10).
    #[arg(long, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    holders: Option<u32>,
    /// Relays, spread over the stages and regions (at least one per stage;
    /// default: the scenario's, else 60).
    #[arg(long, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    relays: Option<u32>,
    /// Microbatches per holder per iteration (>= 1; default: the scenario's
    /// global batch over the holders, rounded up, else 8).
    #[arg(long, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    microbatches: Option<u32>,
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
    match p {
        "all" => Ok(Policy::ALL.to_vec()),
        "optimal" => Ok(vec![Policy::CentralMcmf]),
        other => Policy::by_name(other).map(|p| vec![p]).ok_or_else(|| {
            let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
            format!(
                "--policy {other}: unknown policy ({}, all)",
                names.join(", ")
            )
        }),
    }
}

pub(super) fn model(name: &str) -> Result<ModelPreset, String> {
    model_with(name, None)
}

/// The model `name` with microbatches of `sequences` sequences (`None`:
/// its own).
pub(super) fn model_with(name: &str, sequences: Option<usize>) -> Result<ModelPreset, String> {
    ModelPreset::with_sequences(name, sequences).ok_or_else(|| {
        format!("--model {name}: unknown model (llama-124m, llama-500m, llama-1.5b)")
    })
}

/// The configuration of one run; the ranges of the numbers are checked by
/// their value parsers, what depends on two arguments here.
fn config(a: &SimArgs, scenario: &Scenario, policy: Policy) -> Result<SimConfig, String> {
    let model = model_with(&a.model, a.sequences)?;
    let stages = model.relay_stages as u32;
    let mut c = SimConfig::new(scenario.clone(), model, policy);
    c.holders = a.holders.unwrap_or(c.holders);
    c.relays = a.relays.unwrap_or(c.relays);
    if c.relays < stages {
        return Err(format!(
            "--relays {}: {} has {stages} relay stages and each needs at least one relay",
            c.relays, a.model
        ));
    }
    c.mb_per_iter = a
        .microbatches
        .or(scenario.microbatches_per_holder(c.holders))
        .unwrap_or(c.mb_per_iter);
    c.churn_per_hour = a.churn_per_hour;
    c.leave_fraction = a.leave_fraction;
    c.iterations = a.iterations;
    c.seed = a.seed;
    c.max_in_flight = a.in_flight;
    c.reference_optimum = c.holders + c.relays <= 2000;
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
    let first = configs[0].clone();
    let reports: Vec<SimReport> = configs.into_iter().map(|c| Sim::new(c).run()).collect();
    print_table(&a, &first, &reports);
    if let Some(path) = &a.json {
        let mut rows = serde_json::to_value(&reports)?;
        if let (Some(rows), Some(r)) = (rows.as_array_mut(), reports.first()) {
            rows.push(serde_json::to_value(BoundRow::of(r, a.iterations))?);
        }
        std::fs::write(path, serde_json::to_string_pretty(&rows)? + "\n")
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

/// The `bound` row of the table and of `--json`: what no policy can beat
/// with the founding membership (see `gwtf::sim::bound`).
#[derive(serde::Serialize)]
struct BoundRow {
    policy: &'static str,
    iteration_time_s: f64,
    training_time_s: f64,
    throughput_microbatches_per_hour: f64,
    time_per_microbatch_s: f64,
}

impl BoundRow {
    /// The founding membership's bound (the same in every run of a seed).
    fn of(r: &SimReport, iterations: u32) -> BoundRow {
        let it = r.bound_initial_s;
        let per_hour = if it > 0.0 {
            r.global_batch as f64 / it * 3600.0
        } else {
            0.0
        };
        BoundRow {
            policy: "bound",
            iteration_time_s: it,
            training_time_s: it * iterations as f64,
            throughput_microbatches_per_hour: per_hour,
            time_per_microbatch_s: it / r.global_batch.max(1) as f64,
        }
    }
}

fn print_table(a: &SimArgs, c: &SimConfig, reports: &[SimReport]) {
    println!(
        "scenario {} | model {} | {} holders + {} relays | churn {:.0}%/h | {} iterations x {} microbatches/holder of {} sequences, {} in flight (global batch {}) | NIC {} Gbit/s | seed {}",
        a.scenario,
        a.model,
        c.holders,
        c.relays,
        a.churn_per_hour * 100.0,
        a.iterations,
        c.mb_per_iter,
        c.model.sequences,
        c.max_in_flight,
        c.holders * c.mb_per_iter,
        c.scenario.nic_bandwidth * 8.0 / 1e9,
        a.seed
    );
    println!(
        "{:<12} {:>10} {:>10} {:>9} {:>9} {:>8} {:>7} {:>7} {:>6} {:>7} {:>6} {:>10} {:>17} {:>16} {:>6}",
        "policy",
        "train_s",
        "mb/hour",
        "it_p50_s",
        "it_p95_s",
        "s/mb",
        "t/bound",
        "waste%",
        "lost",
        "recomp",
        "crash",
        "flow/mcmf",
        "critpath/mcmf_s",
        "queue_gpu/link_s",
        "near%"
    );
    if let Some(r) = reports.first() {
        let b = BoundRow::of(r, a.iterations);
        println!(
            "{:<12} {:>10.0} {:>10.0} {:>9.1} {:>9.1} {:>8.2} {:>7.2}",
            b.policy,
            b.training_time_s,
            b.throughput_microbatches_per_hour,
            b.iteration_time_s,
            b.iteration_time_s,
            b.time_per_microbatch_s,
            1.0
        );
    }
    for r in reports {
        println!(
            "{:<12} {:>10.0} {:>10.0} {:>9.1} {:>9.1} {:>8.2} {:>7.2} {:>7.2} {:>6} {:>7} {:>6} {:>10} {:>17} {:>16} {:>6.1}",
            r.policy,
            r.training_time_s,
            r.throughput_microbatches_per_hour,
            r.iteration_time_p50_s,
            r.iteration_time_p95_s,
            r.time_per_microbatch_s,
            r.time_over_bound,
            r.wasted_gpu_pct,
            r.lost_microbatches,
            r.recomputed_stages,
            r.crashes,
            format!("{:.0}/{:.0}", r.flow_value, r.optimal_flow_value),
            format!("{:.2}/{:.2}", r.critical_path_s, r.optimal_critical_path_s),
            format!(
                "{:.3}/{:.3}",
                r.gpu_queue_per_microbatch_s, r.link_queue_per_microbatch_s
            ),
            100.0 * r.relay_forwards_in_holder_region as f64 / r.relay_forwards.max(1) as f64,
        );
    }
    println!(
        "bound: no iteration of the founding membership is shorter; t/bound: a run's time over the sum of its iterations' bounds (each that of the membership it started with); near%: forwards to a relay in the region of the microbatch's data holder"
    );
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
    /// gwtf, swarm, swarm-plus, swarm-deccom or central-mcmf (alias:
    /// optimal).
    #[arg(long, default_value = "gwtf")]
    policy: String,
    /// How stages beyond 64 members all-reduce: hierarchy (what the
    /// runtime runs) or ring (both ways round, as before the hierarchy:
    /// for comparison).
    #[arg(long, value_enum, default_value_t = LargeAllReduce::Hierarchy)]
    allreduce: LargeAllReduce,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LargeAllReduce {
    Hierarchy,
    Ring,
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
        c.ring_beyond_butterfly = a.allreduce == LargeAllReduce::Ring;
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
        println!("{:>7} {}", "", busiest_messages(&r.messages, 6));
    }
    Ok(())
}

/// Where the events go: the `top` kinds of message sent most, with their
/// counts and their share of all messages.
fn busiest_messages(messages: &std::collections::BTreeMap<String, u64>, top: usize) -> String {
    let total: u64 = messages.values().sum();
    let mut by_count: Vec<(&String, &u64)> = messages.iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let shown: Vec<String> = (by_count.iter().take(top))
        .map(|(k, v)| format!("{k} {v} ({:.0}%)", 100.0 * **v as f64 / total.max(1) as f64))
        .collect();
    format!("messages {total}: {}", shown.join(", "))
}
