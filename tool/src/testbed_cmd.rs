//! `gwtf bench testbed`: real processes against the simulator on the same
//! scenario, seed and membership.
//!
//! For each policy, the simulator draws its founding members
//! (`Sim::founders`: region, GPU speed, capacity) and runs; then one
//! `gwtf node --emulate` process per founder runs the same swarm on
//! loopback: each node waits the time its GPU would take for each piece of
//! work while every activation, gradient and state travels at its real
//! size, and each link to a peer takes the scenario's latency and bandwidth
//! between the two regions (`--peer-links`). Both are timed the same way:
//! the seconds between consecutive iterations made final (the first, which
//! includes the start, left out). It prints, per policy, real against
//! simulated seconds per iteration, each baseline's ratio to GWTF in both,
//! and each node's peak memory.
use super::checks;
use clap::Args;
use gwtf::protocol::Policy;
use gwtf::sim::model::ModelPreset;
use gwtf::sim::scenario::Scenario;
use gwtf::sim::{Founder, Sim, SimConfig};
use gwtf::swarm::event_log::{parse_line, LogEvent};
use gwtf::swarm::sizing::NodeSizing;
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Args)]
pub struct BenchTestbedArgs {
    /// Scenario of regions, links and GPU speeds (geo10, geo10-gib,
    /// geo10-sparse, homogeneous).
    #[arg(long, default_value = "geo10")]
    scenario: String,
    /// Every latency divided by this, in the processes and in the simulator
    /// alike, so that a run on one machine stays short.
    #[arg(long, default_value_t = 10.0, value_parser = checks::float_in(1.0, 1e4))]
    latency_scale: f64,
    /// Simulator model whose sizes and compute the nodes emulate
    /// (llama-124m, llama-500m, llama-1.5b, ...).
    #[arg(long, default_value = "llama-124m")]
    model: String,
    /// Sequences per microbatch [default: the model's].
    #[arg(long, value_parser = checks::int_at_least::<usize>(1),
          allow_negative_numbers = true)]
    sequences: Option<usize>,
    #[arg(long, default_value_t = 2, value_parser = checks::int_in::<u32>(1, 64),
          allow_negative_numbers = true)]
    holders: u32,
    #[arg(long, default_value_t = 8, value_parser = checks::int_in::<u32>(1, 256),
          allow_negative_numbers = true)]
    relays: u32,
    /// Iterations of each run (at least 3: the first is left out).
    #[arg(long, default_value_t = 6, value_parser = checks::int_at_least::<u32>(3),
          allow_negative_numbers = true)]
    iterations: u32,
    /// Microbatches per holder per iteration.
    #[arg(long, default_value_t = 4, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    microbatches: u32,
    /// Microbatches a holder keeps in flight.
    #[arg(long, default_value_t = 4, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    in_flight: u32,
    /// Policies, comma-separated (gwtf, swarm, swarm-plus, swarm-deccom).
    #[arg(long, value_delimiter = ',', default_value = "gwtf,swarm,swarm-plus,swarm-deccom",
          value_parser = super::node_cmd::parse_policy)]
    policies: Vec<Policy>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Give up on a run of processes after this many seconds.
    #[arg(long, default_value_t = 600.0, value_parser = checks::float_in(1.0, 86400.0))]
    deadline_s: f64,
    /// Run the simulator with its own protocol settings (timers for a
    /// planet: a 2 s tick, timeouts of tens of seconds) instead of the
    /// runtime's, which the processes run.
    #[arg(long)]
    simulator_timers: bool,
    /// Write the results as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Keep each node's output here (else a scratch directory, removed).
    #[arg(long, value_name = "DIR")]
    keep_logs: Option<PathBuf>,
}

/// One policy's two runs.
struct Row {
    policy: Policy,
    sim_s: f64,
    real_s: f64,
    sim_iterations: Vec<f64>,
    real_iterations: Vec<f64>,
    /// Peak resident memory of each process (MB), the largest and the mean.
    peak_mb: (f64, f64),
}

/// Median of the gaps between iterations, the first left out.
fn per_iteration(times: &[f64]) -> f64 {
    let mut x: Vec<f64> = times.iter().skip(1).copied().collect();
    if x.is_empty() {
        return f64::NAN;
    }
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

/// `s` with every latency divided by `k`.
fn scaled(mut s: Scenario, k: f64) -> Scenario {
    for row in &mut s.latency {
        for l in row.iter_mut() {
            *l /= k;
        }
    }
    s
}

fn config(a: &BenchTestbedArgs, policy: Policy) -> Res<SimConfig> {
    let scenario = scaled(Scenario::by_name(&a.scenario)?, a.latency_scale);
    let model = ModelPreset::with_sequences(&a.model, a.sequences).ok_or_else(|| {
        format!(
            "--model {}: not a model preset of at least 3 stages",
            a.model
        )
    })?;
    let mut c = SimConfig::new(scenario, model, policy);
    c.holders = a.holders;
    c.relays = a.relays;
    c.mb_per_iter = a.microbatches;
    c.max_in_flight = a.in_flight;
    c.iterations = a.iterations;
    c.seed = a.seed;
    c.reference_optimum = false;
    if !a.simulator_timers {
        // The settings every `gwtf node --emulate` of this swarm derives.
        let needs = gwtf::swarm::emulated::node_needs(&c.model, 256 << 20);
        let mut p = NodeSizing::of(&needs)?.protocol(&needs);
        p.iterations = Some(a.iterations);
        p.rebuild_from_neighbours = true;
        c.protocol = Some(std::sync::Arc::new(p));
    }
    Ok(c)
}

/// The simulator's run: its seconds per iteration and each iteration's.
fn simulate(cfg: &SimConfig) -> Res<(f64, Vec<f64>)> {
    let r = Sim::new(cfg.clone()).run();
    if !r.completed {
        return Err(format!(
            "the simulator did not finish {} iterations of {}",
            cfg.iterations, r.policy
        )
        .into());
    }
    Ok((per_iteration(&r.iteration_times_s), r.iteration_times_s))
}

/// A process's id: the simulator's, plus one (a node id is never 0).
fn pid_of(f: &Founder) -> u32 {
    f.id + 1
}

/// The links from `me` to every other founder: the scenario's latency and
/// bandwidth between their regions (bounded by the NIC, as the simulator's).
fn links_file(sc: &Scenario, me: &Founder, all: &[Founder]) -> String {
    let mut s = String::from("# ID DELAY_MS MBIT_S\n");
    for f in all.iter().filter(|f| f.id != me.id) {
        let lat = sc.latency[me.region][f.region];
        let bw = sc.bandwidth[me.region][f.region].min(sc.nic_bandwidth);
        s += &format!("{} {:.3} {:.3}\n", pid_of(f), lat * 1e3, bw * 8.0 / 1e6);
    }
    s
}

/// Peak resident memory of process `pid` (MB), from /proc.
fn peak_mb(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

struct Procs {
    children: BTreeMap<u32, Child>,
    peaks: BTreeMap<u32, f64>,
}

impl Procs {
    fn sample(&mut self) {
        for (id, c) in &self.children {
            if let Some(mb) = peak_mb(c.id()) {
                let p = self.peaks.entry(*id).or_insert(0.0);
                *p = p.max(mb);
            }
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in self.children.values_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs the founders of `cfg` as processes; each iteration's seconds (the
/// first holder's report of it final) and each process's peak memory.
fn run_processes(
    a: &BenchTestbedArgs,
    cfg: &SimConfig,
    founders: &[Founder],
    dir: &Path,
) -> Res<(Vec<f64>, Vec<f64>)> {
    std::fs::create_dir_all(dir)?;
    let key = dir.join("swarm.key");
    std::fs::write(&key, "00112233445566778899aabbccddeeff\n")?;
    let exe = std::env::current_exe()?;
    let addrs: BTreeMap<u32, String> = founders
        .iter()
        .map(|f| {
            Ok((
                pid_of(f),
                format!("127.0.0.1:{}", super::demo_procs::free_port()?),
            ))
        })
        .collect::<Res<_>>()?;
    let peers: Vec<String> = founders
        .iter()
        .flat_map(|f| {
            [
                "--peer".to_string(),
                format!("{}/{}/{}", pid_of(f), f.stage, addrs[&pid_of(f)]),
            ]
        })
        .collect();
    let (tx, rx) = channel();
    let mut procs = Procs {
        children: BTreeMap::new(),
        peaks: BTreeMap::new(),
    };
    let started = Instant::now();
    for f in founders {
        let id = pid_of(f);
        let links = dir.join(format!("links-{id}.txt"));
        std::fs::write(&links, links_file(&cfg.scenario, f, founders))?;
        let mut cmd = Command::new(&exe);
        cmd.arg("node")
            .args(["--listen", &addrs[&id]])
            .arg("--swarm-key-file")
            .arg(&key)
            .args(["--chosen-id", &id.to_string()])
            .args(&peers)
            .args(["--emulate", &a.model])
            .args(["--tflops", &format!("{}", f.flops / 1e12)])
            .args(["--policy", cfg.policy.name()])
            .args(["--iterations", &a.iterations.to_string()])
            .args(["--microbatches", &a.microbatches.to_string()])
            .args(["--in-flight", &a.in_flight.to_string()])
            .args(["--seed", &a.seed.to_string()])
            .arg("--peer-links")
            .arg(&links)
            .args(["--threads", "1", "--json"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(
                dir.join(format!("node-{id}.stderr")),
            )?));
        if let Some(n) = a.sequences {
            cmd.args(["--sequences", &n.to_string()]);
        }
        if f.stage == 0 {
            cmd.arg("--holder");
        } else {
            cmd.args(["--stage", &f.stage.to_string()])
                .args(["--capacity", &f.capacity.to_string()]);
        }
        super::demo_procs::die_with_parent(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
        let out = child.stdout.take().expect("piped");
        let tx = tx.clone();
        let mut log = std::io::LineWriter::new(std::fs::File::create(
            dir.join(format!("node-{id}.stdout")),
        )?);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                // Each line kept with the seconds since the run started.
                let at = Instant::now();
                let _ = writeln!(
                    log,
                    "{:.3} {line}",
                    at.duration_since(started).as_secs_f64()
                );
                if tx.send((id, at, parse_line(&line))).is_err() {
                    break;
                }
            }
        });
        procs.children.insert(id, child);
    }
    drop(tx);
    let holders: BTreeSet<u32> = founders
        .iter()
        .filter(|f| f.stage == 0)
        .map(pid_of)
        .collect();
    let t0 = started;
    let deadline = t0 + Duration::from_secs_f64(a.deadline_s);
    let mut finals: BTreeMap<u32, f64> = BTreeMap::new();
    let mut done = BTreeSet::new();
    let mut last_sample = t0;
    let rx: Receiver<_> = rx;
    while done.len() < holders.len() {
        if Instant::now() > deadline {
            return Err(format!(
                "{}: {} of {} iterations final after {} s (node logs: {})",
                cfg.policy.name(),
                finals.len(),
                a.iterations,
                a.deadline_s,
                dir.display()
            )
            .into());
        }
        if last_sample.elapsed() >= Duration::from_millis(500) {
            last_sample = Instant::now();
            procs.sample();
        }
        let (id, at, ev) = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(x) => x,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(format!(
                    "{}: every node's output ended (node logs: {})",
                    cfg.policy.name(),
                    dir.display()
                )
                .into())
            }
        };
        match ev {
            Some(LogEvent::Iteration { iteration, .. }) if holders.contains(&id) => {
                let t = at.duration_since(t0).as_secs_f64();
                finals.entry(iteration as u32).or_insert(t);
            }
            Some(LogEvent::Done { .. }) if holders.contains(&id) => {
                done.insert(id);
            }
            Some(LogEvent::Error { message, .. }) => {
                return Err(format!(
                    "{}: node {id}: {message} (node logs: {})",
                    cfg.policy.name(),
                    dir.display()
                )
                .into())
            }
            _ => {}
        }
    }
    procs.sample();
    let times: Vec<f64> = finals.values().copied().collect();
    let gaps: Vec<f64> = std::iter::once(times.first().copied().unwrap_or(0.0))
        .chain(times.windows(2).map(|w| w[1] - w[0]))
        .collect();
    Ok((gaps, procs.peaks.values().copied().collect()))
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::NAN
    }
}

pub fn run(a: BenchTestbedArgs) -> super::CliResult {
    if let Some(p) = &a.json {
        checks::writable_output("--json", p)?;
    }
    // Every argument checked before anything runs.
    for &p in &a.policies {
        config(&a, p)?;
    }
    // Without --keep-logs the nodes' output goes to a scratch directory,
    // removed when every run succeeded (an error names it).
    let dir = match &a.keep_logs {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("gwtf-testbed-{}", std::process::id())),
    };
    println!(
        "gwtf bench testbed: {} (latencies / {}), {} ({} sequences per microbatch), {} holders + \
         {} relays, {} iterations of {} microbatches per holder, {} in flight",
        a.scenario,
        a.latency_scale,
        a.model,
        config(&a, Policy::Gwtf)?.model.sequences,
        a.holders,
        a.relays,
        a.iterations,
        a.microbatches,
        a.in_flight
    );
    let mut rows = Vec::new();
    for &policy in &a.policies {
        let cfg = config(&a, policy)?;
        let founders = Sim::founders(&cfg);
        let (sim_s, sim_iterations) = simulate(&cfg)?;
        let t = Instant::now();
        let (real_iterations, peaks) =
            run_processes(&a, &cfg, &founders, &dir.join(policy.name()))?;
        let real_s = per_iteration(&real_iterations);
        let peak = (
            peaks.iter().copied().fold(0.0, f64::max),
            peaks.iter().sum::<f64>() / peaks.len().max(1) as f64,
        );
        println!(
            "  {:<13} real {:>7.3} s/iteration, simulated {:>7.3} (real / simulated {:.2}); \
             peak memory per node {:.0} MB max, {:.0} MB mean; {:.0} s",
            policy.name(),
            real_s,
            sim_s,
            ratio(real_s, sim_s),
            peak.0,
            peak.1,
            t.elapsed().as_secs_f64()
        );
        rows.push(Row {
            policy,
            sim_s,
            real_s,
            sim_iterations,
            real_iterations,
            peak_mb: peak,
        });
    }
    println!();
    println!("| policy | real s/iteration | simulated | real / simulated | gwtf / policy, real | gwtf / policy, simulated | peak MB per node (max, mean) |");
    println!("|---|---|---|---|---|---|---|");
    let gwtf = rows.iter().find(|r| r.policy == Policy::Gwtf);
    let mut out = Vec::new();
    for r in &rows {
        let (gr, gs) = gwtf.map_or((f64::NAN, f64::NAN), |g| {
            (ratio(g.real_s, r.real_s), ratio(g.sim_s, r.sim_s))
        });
        println!(
            "| {} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {:.0}, {:.0} |",
            r.policy.name(),
            r.real_s,
            r.sim_s,
            ratio(r.real_s, r.sim_s),
            gr,
            gs,
            r.peak_mb.0,
            r.peak_mb.1
        );
        out.push(json!({
            "policy": r.policy.name(),
            "real_s_per_iteration": r.real_s,
            "simulated_s_per_iteration": r.sim_s,
            "real_iterations_s": r.real_iterations,
            "simulated_iterations_s": r.sim_iterations,
            "gwtf_over_policy_real": gr,
            "gwtf_over_policy_simulated": gs,
            "peak_mb_max": r.peak_mb.0,
            "peak_mb_mean": r.peak_mb.1,
        }));
    }
    if a.keep_logs.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    if let Some(p) = &a.json {
        let v = json!({
            "scenario": a.scenario,
            "latency_scale": a.latency_scale,
            "model": a.model,
            "holders": a.holders,
            "relays": a.relays,
            "iterations": a.iterations,
            "microbatches": a.microbatches,
            "in_flight": a.in_flight,
            "seed": a.seed,
            "policies": out,
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)? + "\n")
            .map_err(|e| format!("cannot write --json {}: {e}", p.display()))?;
    }
    Ok(())
}
