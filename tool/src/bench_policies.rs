//! `gwtf bench policies`: every routing policy of the simulator over a grid of
//! regimes x scenarios x churn rates x seeds, each run's training time over the lower
//! bound computed in the same run (`t/bound`) and GWTF's over the
//! baselines', as markdown tables: one row per run, then one per scenario and
//! churn rate with the range over the seeds. The tables of the project's
//! evaluation (docs/EVALUATION.md) are its output.
use clap::Args;
use gwtf::protocol::Policy;
use gwtf::sim::scenario::Scenario;
use gwtf::sim::{Sim, SimConfig, SimReport};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::checks;
use super::sim_cmd;

/// The policies every cell runs, in the tables' order.
const POLICIES: [Policy; 5] = Policy::ALL;

/// Runs at most, so that a typo in a list does not start a week of work.
const MAX_RUNS: usize = 10_000;

#[derive(Args)]
pub struct BenchPoliciesArgs {
    /// Scenarios, comma-separated: built-in names (geo10, geo10-gib,
    /// geo10-sparse, homogeneous) or scenario files.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "geo10,geo10-sparse,homogeneous"
    )]
    scenarios: Vec<String>,
    /// Churn rates, comma-separated: departures (and joins) per hour as a
    /// fraction of the nodes (0.16 = 16%), each 0..=100.
    #[arg(long, value_delimiter = ',', default_value = "0,0.16,0.33",
          allow_negative_numbers = true, value_parser = checks::float_in(0.0, 100.0))]
    churn: Vec<f64>,
    /// Seeds, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3",
          allow_negative_numbers = true, value_parser = checks::int_at_least::<u64>(0))]
    seeds: Vec<u64>,
    /// Training iterations per run (>= 1).
    #[arg(long, default_value_t = 100, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    iterations: u32,
    /// llama-124m, llama-500m or llama-1.5b.
    #[arg(long, default_value = "llama-500m")]
    model: String,
    /// Regimes, comma-separated: `project` (--scenarios, the model's
    /// microbatch of 2 sequences, 4 in flight, 8 microbatches per holder)
    /// and `paper` (--paper-scenarios, microbatches of 16 sequences, 16
    /// in flight, 32 per holder: closer to the GWTF paper's).
    #[arg(long, value_delimiter = ',', default_value = "project,paper")]
    regimes: Vec<String>,
    /// The paper regime's scenarios (the authors' simulators read geo10's
    /// bandwidths as GiB/s: geo10-gib).
    #[arg(long, value_delimiter = ',', default_value = "geo10-gib")]
    paper_scenarios: Vec<String>,
    /// Runs at once (>= 1; default: the cores).
    #[arg(long, allow_negative_numbers = true,
          value_parser = checks::int_in::<usize>(1, 1024))]
    jobs: Option<usize>,
    /// Write every run's report (one JSON array, the objects of `gwtf sim --json`).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// One run of the grid.
struct Job {
    cell: usize,
    config: SimConfig,
}

/// One (regime, scenario, churn, seed) of the grid: a run per policy.
struct Cell {
    regime: &'static Regime,
    scenario: String,
    churn: f64,
    seed: u64,
}

/// How the microbatches of a grid are cut and sent.
struct Regime {
    name: &'static str,
    /// Sequences per microbatch (`None`: the model's own).
    sequences: Option<usize>,
    /// Microbatches in flight per holder.
    in_flight: u32,
    /// Microbatches per holder per iteration (`None`: the scenario's).
    microbatches: Option<u32>,
    /// What its tables' heading says.
    what: &'static str,
}

/// The regimes of `--regimes`.
const REGIMES: [Regime; 2] = [
    Regime {
        name: "project",
        sequences: None,
        in_flight: 4,
        microbatches: None,
        what: "this project's: the model's microbatch (2 sequences), 4 in flight, \
               the scenario's microbatches per holder (8)",
    },
    Regime {
        name: "paper",
        sequences: Some(16),
        in_flight: 16,
        microbatches: Some(32),
        what: "closer to the GWTF paper's: microbatches of 16 sequences of the \
               model's 1024 tokens (16k tokens, as the paper's 64 sequences of 256), \
               16 in flight, 32 per holder",
    },
];

/// `xs` without repeats, in their first order (a value given twice would
/// run twice and count twice in its range).
fn distinct<T: PartialEq + Clone>(xs: &[T]) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(xs.len());
    for x in xs {
        if !out.contains(x) {
            out.push(x.clone());
        }
    }
    out
}

pub fn run(mut a: BenchPoliciesArgs) -> super::CliResult {
    // Everything that can be refused is refused before the first run.
    sim_cmd::model(&a.model)?;
    let trimmed =
        |xs: &[String]| distinct(&xs.iter().map(|s| s.trim().to_string()).collect::<Vec<_>>());
    a.churn = distinct(&a.churn);
    a.seeds = distinct(&a.seeds);
    let mut grids = Vec::new();
    for name in trimmed(&a.regimes) {
        let Some(regime) = REGIMES.iter().find(|r| r.name == name) else {
            return Err(format!("--regimes {name}: unknown regime (project, paper)").into());
        };
        let names = if regime.name == "paper" {
            trimmed(&a.paper_scenarios)
        } else {
            trimmed(&a.scenarios)
        };
        let scenarios = (names.iter())
            .map(|s| Scenario::by_name(s))
            .collect::<Result<Vec<_>, _>>()?;
        let model = sim_cmd::model_with(&a.model, regime.sequences)?;
        grids.push((regime, model, scenarios));
    }
    let scenarios: usize = grids.iter().map(|g| g.2.len()).sum();
    if scenarios == 0 || a.churn.is_empty() || a.seeds.is_empty() {
        return Err(
            "--regimes, their scenarios, --churn and --seeds each need at least one value".into(),
        );
    }
    let runs = scenarios * a.churn.len() * a.seeds.len() * POLICIES.len();
    if runs > MAX_RUNS {
        return Err(
            format!("{runs} runs: at most {MAX_RUNS} (fewer scenarios, rates or seeds)").into(),
        );
    }
    if let Some(path) = &a.json {
        checks::writable_output("--json", path)?;
    }
    let mut cells = Vec::new();
    let mut jobs = Vec::new();
    for (regime, model, scenarios) in &grids {
        for scenario in scenarios {
            for &churn in &a.churn {
                for &seed in &a.seeds {
                    for policy in POLICIES {
                        let mut c = SimConfig::new(scenario.clone(), model.clone(), policy);
                        c.churn_per_hour = churn;
                        c.iterations = a.iterations;
                        c.seed = seed;
                        c.max_in_flight = regime.in_flight;
                        c.mb_per_iter = regime.microbatches.unwrap_or(c.mb_per_iter);
                        c.reference_optimum = c.holders + c.relays <= 2000;
                        jobs.push(Job {
                            cell: cells.len(),
                            config: c,
                        });
                    }
                    cells.push(Cell {
                        regime,
                        scenario: scenario.name.clone(),
                        churn,
                        seed,
                    });
                }
            }
        }
    }
    let threads = a
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .min(jobs.len());
    let reports = run_all(&jobs, threads);
    for (regime, _, _) in &grids {
        let (lo, hi) = (
            cells.iter().position(|c| std::ptr::eq(c.regime, *regime)),
            cells.iter().rposition(|c| std::ptr::eq(c.regime, *regime)),
        );
        let (Some(lo), Some(hi)) = (lo, hi) else {
            continue;
        };
        println!("# The {} regime", regime.name);
        println!();
        println!("{} ({}).", capitalized(regime.what), a.model);
        println!();
        print_runs(&cells[lo..=hi], &reports[lo..=hi]);
        print_summary(&cells[lo..=hi], &reports[lo..=hi]);
        println!();
    }
    if let Some(path) = &a.json {
        let all: Vec<&SimReport> = reports.iter().flatten().collect();
        std::fs::write(path, serde_json::to_string_pretty(&all)? + "\n")
            .map_err(|e| format!("cannot write --json {}: {e}", path.display()))?;
    }
    let violations: Vec<String> = (reports.iter().flatten())
        .filter(|r| !r.violations.is_empty())
        .map(|r| {
            format!(
                "{} churn {} seed {} {}: {}",
                r.scenario,
                r.churn_per_hour,
                r.seed,
                r.policy,
                r.violations.join("; ")
            )
        })
        .collect();
    if !violations.is_empty() {
        return Err(format!("invariant violations:\n  {}", violations.join("\n  ")).into());
    }
    Ok(())
}

/// Runs every job on `threads` threads, the next job to the first free one;
/// the reports by cell, in the order of [`POLICIES`]. Progress goes to
/// stderr, so that stdout holds the tables alone.
fn run_all(jobs: &[Job], threads: usize) -> Vec<[SimReport; 5]> {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<SimReport>>> = Mutex::new(vec![None; jobs.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let t = std::time::Instant::now();
                let r = Sim::new(job.config.clone()).run();
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                eprintln!(
                    "[{n}/{}] {} churn {} seed {} {}: t/bound {:.3} ({:.0} s)",
                    jobs.len(),
                    r.scenario,
                    r.churn_per_hour,
                    r.seed,
                    r.policy,
                    r.time_over_bound,
                    t.elapsed().as_secs_f64()
                );
                out.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
            });
        }
    });
    let mut all = out
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter();
    let cells = jobs.last().map_or(0, |j| j.cell + 1);
    (0..cells)
        .map(|_| {
            std::array::from_fn(|_| {
                all.next()
                    .flatten()
                    .expect("every job ran (a panicking run ends the scope)")
            })
        })
        .collect()
}

/// `s` with its first letter upper-case.
fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().chain(c).collect())
        .unwrap_or_default()
}

/// `t/bound`, marked when the run did not finish its iterations.
fn over_bound(r: &SimReport) -> String {
    let mark = if r.completed { "" } else { " (incomplete)" };
    format!("{:.3}{mark}", r.time_over_bound)
}

/// Training time of `a` over that of `b`.
fn ratio(a: &SimReport, b: &SimReport) -> f64 {
    if b.training_time_s > 0.0 {
        a.training_time_s / b.training_time_s
    } else {
        f64::NAN
    }
}

fn lost(rs: &[SimReport]) -> u64 {
    rs.iter().map(|r| r.lost_microbatches).sum()
}

const HEADER: &str = "gwtf | swarm | swarm-plus | swarm-deccom | central-mcmf | gwtf/swarm | gwtf/swarm-plus | gwtf/swarm-deccom";

fn print_runs(cells: &[Cell], reports: &[[SimReport; 5]]) {
    println!("## Every run");
    println!();
    println!(
        "t/bound: the run's training time over the sum of its iterations' lower bounds; \
         gwtf/swarm, gwtf/swarm-plus, gwtf/swarm-deccom: GWTF's training time over theirs; \
         lost: all policies."
    );
    println!();
    println!("| scenario | churn/h | seed | bound s/it | {HEADER} | gwtf wasted % | gwtf all-reduces bypassed/aborted | lost |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (c, rs) in cells.iter().zip(reports) {
        let [g, s, p, d, m] = rs;
        println!(
            "| {} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.2} | {}/{} | {} |",
            c.scenario,
            c.churn,
            c.seed,
            g.bound_initial_s,
            over_bound(g),
            over_bound(s),
            over_bound(p),
            over_bound(d),
            over_bound(m),
            ratio(g, s),
            ratio(g, p),
            ratio(g, d),
            g.wasted_gpu_pct,
            g.allreduce_bypassed,
            g.allreduce_aborted,
            lost(rs)
        );
    }
    println!();
}

/// `lo-hi` of `xs` (one value when they agree to the digits shown).
fn range(xs: impl Iterator<Item = f64>) -> String {
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), x| {
        (l.min(x), h.max(x))
    });
    let (l, h) = (format!("{lo:.3}"), format!("{hi:.3}"));
    if l == h {
        l
    } else {
        format!("{l}-{h}")
    }
}

fn print_summary(cells: &[Cell], reports: &[[SimReport; 5]]) {
    println!("## Over the seeds (lowest-highest)");
    println!();
    println!("| scenario | churn/h | seeds | {HEADER} | gwtf wasted % (most) | lost |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut i = 0;
    while i < cells.len() {
        let c = &cells[i];
        let n = (cells[i..].iter())
            .take_while(|d| d.scenario == c.scenario && d.churn == c.churn)
            .count();
        let rs = &reports[i..i + n];
        let col = |p: usize| range(rs.iter().map(|r| r[p].time_over_bound));
        let incomplete = rs.iter().flatten().filter(|r| !r.completed).count();
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {}{} |",
            c.scenario,
            c.churn,
            n,
            col(0),
            col(1),
            col(2),
            col(3),
            col(4),
            range(rs.iter().map(|r| ratio(&r[0], &r[1]))),
            range(rs.iter().map(|r| ratio(&r[0], &r[2]))),
            range(rs.iter().map(|r| ratio(&r[0], &r[3]))),
            rs.iter().map(|r| r[0].wasted_gpu_pct).fold(0.0, f64::max),
            rs.iter().map(|r| lost(r)).sum::<u64>(),
            if incomplete > 0 {
                format!(" ({incomplete} runs incomplete)")
            } else {
                String::new()
            }
        );
        i += n;
    }
}
