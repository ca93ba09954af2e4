//! `gwtf flow ...` and `gwtf bench flow` (owned by the routing-solver work).
use clap::{Args, Subcommand};
use gwtf::flow::geo::GeoConfig;
use gwtf::flow::rng::SplitMix64;
use gwtf::flow::{dimacs, ArcId, MinCostFlow, NodeId, RoutingModel, Status};
use gwtf::sim::scenario::Scenario;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use super::checks;

#[derive(Subcommand)]
pub enum FlowCmd {
    /// Solve a DIMACS min-cost flow file; prints one JSON object
    /// (status, cost, flow, solve_ms, nodes, arcs).
    Solve {
        /// DIMACS `.min` file.
        file: PathBuf,
        /// Also print `arc_flows` (flow of every arc, in file order).
        #[arg(long)]
        arc_flows: bool,
    },
    /// Route microbatches over a scenario's regions: a built-in scenario (`geo10`,
    /// `geo10-gib`, `geo10-sparse`, `homogeneous`) or a scenario file (the format `gwtf sim --scenario` reads: README, section
    /// "Scenario files"; example: scenarios/example.scenario).
    Route(RouteArgs),
}

#[derive(Args)]
pub struct RouteArgs {
    /// `geo10`, `geo10-gib`, `geo10-sparse`, `homogeneous` or the path of a scenario file.
    scenario: String,
    /// Members per region, named REGION-0, REGION-1, ... (>= 1).
    #[arg(long, default_value_t = 4, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    nodes_per_region: usize,
    /// Pipeline stages (>= 1).
    #[arg(long, default_value_t = 6, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    stages: u32,
    /// Capacity range LO..HI (microbatches per member), 0 <= LO <= HI.
    #[arg(long, default_value = "1..4", allow_hyphen_values = true, value_parser = parse_range)]
    capacity: (i64, i64),
    /// Seed of the role/capacity assignment.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(0))]
    seed: u64,
    /// Number of data holders (default one per region; >= 1).
    #[arg(long, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    holders: Option<usize>,
    /// Crash this member (by name, e.g. `Tokyo-2`) after solving, then repair
    /// (repeatable; every name is checked before anything is solved).
    #[arg(long)]
    crash: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct BenchFlowArgs {
    /// Peer counts of the generated instances (holders + relays; >= 10, as the
    /// generator puts a tenth on data holders and the rest on 8 stages).
    #[arg(long, num_args = 1.., default_values_t = vec![100, 1000, 10000],
          allow_negative_numbers = true, value_parser = checks::int_at_least::<usize>(10))]
    sizes: Vec<usize>,
    /// Edge modes: dense, knnK.
    #[arg(long, num_args = 1.., default_values = ["dense", "knn16"])]
    edge_modes: Vec<String>,
    /// Interleaved cold-solve pairs after one warm-up pair (>= 1).
    #[arg(long, default_value_t = 5, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    reps: usize,
    /// Random flow-carrying victims for the repair comparison.
    #[arg(long, default_value_t = 100, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(0))]
    victims: usize,
    /// Stop adding victims once OR-tools re-solves took this long (at least 5 victims).
    #[arg(long, default_value_t = 60.0, allow_negative_numbers = true,
          value_parser = checks::float_in(0.0, f64::MAX))]
    victim_budget_s: f64,
    /// Skip instances with more arcs than this (dense 10k has 11M).
    #[arg(long, default_value_t = 12_000_000, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    max_arcs: usize,
    #[arg(long, default_value_t = 1, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(0))]
    seed: u64,
    /// One JSON object per instance instead of the table.
    #[arg(long)]
    json: bool,
    /// Python with ortools (default: $REPO/.venv/bin/python, made by scripts/python-deps).
    #[arg(long)]
    python: Option<PathBuf>,
}

pub fn run(cmd: FlowCmd) -> super::CliResult {
    match cmd {
        FlowCmd::Solve { file, arc_flows } => solve_file(&file, arc_flows),
        FlowCmd::Route(args) => route(args),
    }
}

fn solve_file(file: &Path, arc_flows: bool) -> super::CliResult {
    let f = std::fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let size = f.metadata().ok().map(|m| m.len());
    let mut p = dimacs::read(f, size).map_err(|e| format!("{}: {e}", file.display()))?;
    let t0 = Instant::now();
    let st = p.mcf.solve()?;
    let solve_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut obj = json!({
        "status": st.as_str(),
        "solve_ms": solve_ms,
        "nodes": p.mcf.node_count(),
        "arcs": p.mcf.arc_count(),
        "phases": p.mcf.stats().iterations,
    });
    if st == Status::Optimal {
        let cost = p.cost();
        obj["cost"] = match i64::try_from(cost) {
            Ok(c) => json!(c),
            Err(_) => json!(cost.to_string()),
        };
        obj["flow"] = json!(p.flow_value());
        if arc_flows {
            obj["arc_flows"] = json!(p.arc_flows());
        }
    } else {
        obj["cost"] = Value::Null;
        obj["flow"] = json!(0);
    }
    println!("{obj}");
    Ok(())
}

// ------------------------------------------------------------------------------ route

/// `LO..HI` (or `LO..=HI`), both inclusive, with 0 <= LO <= HI.
fn parse_range(s: &str) -> Result<(i64, i64), String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("`{s}` must look like LO..HI"))?;
    let num = |t: &str| {
        t.trim()
            .parse::<i64>()
            .map_err(|_| format!("`{}` in `{s}` is not a whole number", t.trim()))
    };
    let (lo, hi) = (num(a)?, num(b.trim_start_matches('='))?);
    if lo < 0 || hi < lo {
        return Err(format!("need 0 <= LO <= HI, got {lo}..{hi}"));
    }
    Ok((lo, hi))
}

fn routes_json(m: &RoutingModel) -> Value {
    let routes: Vec<Value> = m
        .routes()
        .iter()
        .map(|r| {
            json!({
                "nodes": r.nodes.iter().map(|&n| m.name(n).unwrap_or("?").to_string()).collect::<Vec<_>>(),
                "count": r.count,
                "cost_us": r.cost_us,
            })
        })
        .collect();
    json!({
        "flow": m.flow_value(),
        "unrouted": m.unrouted(),
        "total_cost_us": m.total_cost(),
        "critical_path_us": m.critical_path_us(),
        "t_iter_us": m.t_iter_us(),
        "t_iter_per_flow_us": if m.flow_value() > 0 { json!(m.t_iter_per_flow_us()) } else { Value::Null },
        "routes": routes,
    })
}

fn print_routes(title: &str, m: &RoutingModel) {
    println!("{title}");
    println!(
        "  flow {} (unrouted {}), total cost {} us, critical path {} us, T_iter {} us, T_iter/flow {:.0} us",
        m.flow_value(),
        m.unrouted(),
        m.total_cost(),
        m.critical_path_us(),
        m.t_iter_us(),
        m.t_iter_per_flow_us()
    );
    for r in m.routes() {
        let names: Vec<&str> = r.nodes.iter().map(|&n| m.name(n).unwrap_or("?")).collect();
        println!(
            "  {:>3} x {:>8} us  {}",
            r.count,
            r.cost_us,
            names.join(" -> ")
        );
    }
}

fn route(args: RouteArgs) -> super::CliResult {
    let scenario = Scenario::by_name(&args.scenario)?;
    let cfg = GeoConfig {
        nodes_per_region: args.nodes_per_region,
        stages: args.stages,
        cap_lo: args.capacity.0,
        cap_hi: args.capacity.1,
        seed: args.seed,
        holders: args.holders,
        ..Default::default()
    };
    let members = scenario.regions.len() * args.nodes_per_region;
    let holders = args.holders.unwrap_or(scenario.regions.len());
    if members < holders + args.stages as usize {
        return Err(format!(
            "scenario {} has {} region(s) x --nodes-per-region {} = {members} members, fewer than {holders} holder(s) + {} stage(s): raise --nodes-per-region",
            args.scenario,
            scenario.regions.len(),
            args.nodes_per_region,
            args.stages
        )
        .into());
    }
    let mut model = scenario
        .routing(&cfg)
        .map_err(|e| format!("scenario {}: {e}", args.scenario))?
        .model;
    // Every crash victim must exist before anything is solved or printed.
    let mut victims = Vec::new();
    for name in &args.crash {
        let idx = model.find(name).ok_or_else(|| {
            format!(
                "--crash {name}: no member of that name in {} (members are REGION-J with J in 0..{}, e.g. {}-0; regions: {})",
                args.scenario,
                args.nodes_per_region,
                scenario.regions[0],
                scenario.regions.join(", ")
            )
        })?;
        if victims.contains(&idx) {
            return Err(format!("--crash {name} is given twice").into());
        }
        victims.push(idx);
    }
    let t0 = Instant::now();
    model.solve()?;
    let solve_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut out =
        json!({ "scenario": args.scenario, "solve_ms": solve_ms, "initial": routes_json(&model) });
    if !args.json {
        println!("solved in {solve_ms:.3} ms");
        print_routes("routes:", &model);
    }
    if !args.crash.is_empty() {
        for &idx in &victims {
            model.remove_node(idx)?;
        }
        let t0 = Instant::now();
        model.solve()?;
        let repair_ms = t0.elapsed().as_secs_f64() * 1e3;
        out["crashed"] = json!(args.crash);
        out["repair_ms"] = json!(repair_ms);
        out["incremental"] = json!(model.solver().stats().warm);
        out["repaired"] = routes_json(&model);
        if !args.json {
            println!(
                "crashed {}: repaired in {repair_ms:.3} ms ({})",
                args.crash.join(", "),
                if model.solver().stats().warm {
                    "incremental"
                } else {
                    "cold"
                }
            );
            print_routes("repaired routes:", &model);
        }
    }
    if args.json {
        println!("{out}");
    }
    Ok(())
}

// ------------------------------------------------------------------------------ bench

struct Helper {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Helper {
    fn line(&mut self) -> Result<Value, Box<dyn std::error::Error>> {
        let mut s = String::new();
        if self.stdout.read_line(&mut s)? == 0 {
            return Err("OR-tools helper exited (see its stderr above)".into());
        }
        let v: Value = serde_json::from_str(&s).map_err(|e| format!("helper said '{s}': {e}"))?;
        if let Some(e) = v.get("error") {
            return Err(format!("helper error: {e}").into());
        }
        Ok(v)
    }
    fn ask(&mut self, cmd: &str) -> Result<(f64, i64), Box<dyn std::error::Error>> {
        writeln!(self.stdin, "{cmd}")?;
        self.stdin.flush()?;
        let v = self.line()?;
        Ok((
            v["ms"].as_f64().ok_or("no ms")?,
            v["cost"].as_i64().ok_or("no cost")?,
        ))
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// Instance arrays kept in memory so our timed cold solve includes building the solver.
struct Arrays {
    n: usize,
    supply: Vec<i64>,
    arcs: Vec<(u32, u32, i64, i64)>,
}

fn build_and_solve(x: &Arrays) -> Result<MinCostFlow, Box<dyn std::error::Error>> {
    let mut m = MinCostFlow::with_capacity(x.n, x.arcs.len());
    for &s in &x.supply {
        m.add_node(s)?;
    }
    for &(u, v, c, w) in &x.arcs {
        m.add_arc(NodeId(u), NodeId(v), c, w)?;
    }
    let st = m.solve()?;
    if st != Status::Optimal {
        return Err(format!("our solver says {st:?}").into());
    }
    Ok(m)
}

fn vm_hwm_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn p99(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn estimate_arcs(total: usize, k: Option<usize>) -> usize {
    let d = ((total as f64 * 0.1).round() as usize).max(1);
    let n = ((total - d) / 8).max(1);
    match k {
        None => d * n + 7 * n * n + n * d,
        Some(k) => d * k.min(n) + 7 * n * k.min(n) + n * k.min(d),
    }
}

/// `dense` -> None, `knnK` -> Some(K) with K >= 1.
fn edge_mode_k(mode: &str) -> Result<Option<usize>, String> {
    if mode == "dense" {
        return Ok(None);
    }
    match mode.strip_prefix("knn").map(str::parse::<usize>) {
        Some(Ok(k)) if k >= 1 => Ok(Some(k)),
        _ => Err(format!(
            "--edge-modes {mode}: not `dense` or `knnK` with K >= 1 (e.g. knn16)"
        )),
    }
}

/// Refuses what would fail or mean nothing halfway through the benchmark.
fn check_bench_args(a: &BenchFlowArgs) -> Result<(), String> {
    for mode in &a.edge_modes {
        edge_mode_k(mode)?;
    }
    Ok(())
}

/// The checkout the tool was built from (the tool's crate is one level below
/// it): where `scripts/python-deps` makes `.venv`, and where the OR-tools
/// script lives.
pub fn repo_dir() -> PathBuf {
    let tool = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    tool.parent().map(PathBuf::from).unwrap_or(tool)
}

pub fn bench(args: BenchFlowArgs) -> super::CliResult {
    check_bench_args(&args)?;
    let repo = repo_dir();
    let python = args
        .python
        .clone()
        .unwrap_or_else(|| repo.join(".venv/bin/python"));
    if !python.exists() {
        return Err(format!(
            "{} not found: run scripts/python-deps first (it creates the venv with ortools)",
            python.display()
        )
        .into());
    }
    let tmp = std::env::temp_dir().join(format!("gwtf-bench-flow-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut rows = Vec::new();
    if !args.json {
        eprintln!(
            "gwtf bench flow: {cores} cores; ours vs OR-tools SimpleMinCostFlow (python {}), interleaved A/B, {} pairs after warm-up",
            python.display(),
            args.reps
        );
    }
    for &size in &args.sizes {
        for mode in &args.edge_modes {
            let k = edge_mode_k(mode)?;
            if estimate_arcs(size, k) > args.max_arcs {
                eprintln!(
                    "[{size} {mode}] skipped: ~{} arcs > --max-arcs",
                    estimate_arcs(size, k)
                );
                continue;
            }
            let row = bench_one(&args, &python, &tmp, size, mode)?;
            if args.json {
                println!("{row}");
            } else {
                print_row(&row, rows.is_empty());
            }
            rows.push(row);
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}

fn print_row(r: &Value, header: bool) {
    if header {
        println!(
            "| peers | edges | arcs | F | ours ms | OR-tools ms | ratio med [min,max] | repair ms med / p99 | OR-tools re-solve ms | repair speedup med [min] | victims | same cost | our bytes | VmHWM MiB |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    }
    println!(
        "| {} | {} | {} | {} | {:.2} | {:.2} | {:.3} [{:.3}, {:.3}] | {:.3} / {:.3} | {:.1} | {:.0}x [{:.0}x] | {} | {} | {} | {:.0} |",
        r["peers"], r["edges"].as_str().unwrap_or(""), r["arcs"], r["F"],
        r["ours_ms"].as_f64().unwrap_or(f64::NAN), r["ortools_ms"].as_f64().unwrap_or(f64::NAN),
        r["ratio"].as_f64().unwrap_or(f64::NAN), r["ratio_min"].as_f64().unwrap_or(f64::NAN), r["ratio_max"].as_f64().unwrap_or(f64::NAN),
        r["repair_ms"].as_f64().unwrap_or(f64::NAN), r["repair_p99_ms"].as_f64().unwrap_or(f64::NAN),
        r["ortools_resolve_ms"].as_f64().unwrap_or(f64::NAN),
        r["repair_speedup"].as_f64().unwrap_or(f64::NAN), r["repair_speedup_min"].as_f64().unwrap_or(f64::NAN),
        r["victims"], r["same_cost"], r["our_bytes"], r["vm_hwm_kib"].as_f64().unwrap_or(0.0) / 1024.0,
    );
}

fn bench_one(
    args: &BenchFlowArgs,
    python: &Path,
    tmp: &Path,
    size: usize,
    mode: &str,
) -> Result<Value, Box<dyn std::error::Error>> {
    let file = tmp.join(format!("inst_{size}_{mode}.min"));
    let script = repo_dir().join("scripts/flow_ortools.py");
    let mut child = Command::new(python)
        .arg(&script)
        .args([
            "--size",
            &size.to_string(),
            "--mode",
            mode,
            "--seed",
            &args.seed.to_string(),
        ])
        .arg("--dimacs")
        .arg(&file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", python.display()))?;
    let stdin = child.stdin.take().ok_or("no stdin")?;
    let stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let mut h = Helper {
        child,
        stdin,
        stdout,
    };
    let info = h.line()?;
    let first = info["split_arc_first"]
        .as_u64()
        .ok_or("no split_arc_first")? as usize;
    let count = info["split_arc_count"]
        .as_u64()
        .ok_or("no split_arc_count")? as usize;
    let f = std::fs::File::open(&file)?;
    let sz = f.metadata().ok().map(|m| m.len());
    let p = dimacs::read(f, sz)?;
    let _ = std::fs::remove_file(&file);
    let m0 = &p.mcf;
    let arrays = Arrays {
        n: m0.node_count(),
        supply: (0..m0.node_count() as u32)
            .map(|i| m0.supply(NodeId(i)).unwrap_or(0))
            .collect(),
        arcs: (0..m0.arc_count() as u32)
            .map(|a| {
                let (u, v) = m0.arc_ends(ArcId(a)).unwrap_or((NodeId(0), NodeId(0)));
                (
                    u.0,
                    v.0,
                    m0.arc_capacity(ArcId(a)).unwrap_or(0),
                    m0.arc_cost(ArcId(a)).unwrap_or(0),
                )
            })
            .collect(),
    };
    drop(p);
    let label = format!("[{size} {mode}]");
    eprintln!(
        "{label} peers={} graph nodes={} arcs={} F={}",
        info["peers"], info["n_graph"], info["n_arcs"], info["F"]
    );

    // ---- cold: warm-up pair, then interleaved pairs
    let mut same_cost = true;
    let mut base = build_and_solve(&arrays)?;
    let (_, oc) = h.ask("cold")?;
    same_cost &= oc as i128 == base.cost_i128();
    let (mut ours, mut ort, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let t0 = Instant::now();
        let m = build_and_solve(&arrays)?;
        let a = t0.elapsed().as_secs_f64() * 1e3;
        let (b, oc) = h.ask("cold")?;
        same_cost &= oc as i128 == m.cost_i128();
        ours.push(a);
        ort.push(b);
        ratios.push(a / b);
        base = m;
    }
    let mut r2 = ratios.clone();
    let row_cold = (median(&mut ours), median(&mut ort), median(&mut r2));
    let rmin = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let rmax = ratios.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "{label} cold: ours {:.2} ms, OR-tools {:.2} ms, ratio {:.3} [{rmin:.3}, {rmax:.3}], cost {}",
        row_cold.0, row_cold.1, row_cold.2, base.cost()
    );

    // ---- repairs after removing one flow-carrying stage node
    let mut busy: Vec<usize> = (first..first + count)
        .filter(|&a| base.arc_flow(ArcId(a as u32)).unwrap_or(0) > 0)
        .collect();
    let mut rng = SplitMix64::new(args.seed.wrapping_add(1));
    for i in (1..busy.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        busy.swap(i, j);
    }
    let (mut rep, mut res, mut speed) = (Vec::new(), Vec::new(), Vec::new());
    let mut ort_spent = 0.0;
    let mut work = Vec::new();
    let mut searches = Vec::new();
    for &victim in busy.iter().take(args.victims) {
        if rep.len() >= 5 && ort_spent / 1e3 > args.victim_budget_s {
            break;
        }
        let mut m = base.clone();
        let (u, v) = m.arc_ends(ArcId(victim as u32))?;
        let t0 = Instant::now();
        m.remove_node(u)?;
        m.remove_node(v)?;
        let st = m.solve()?;
        let a = t0.elapsed().as_secs_f64() * 1e3;
        if st != Status::Optimal || !m.stats().warm {
            return Err(format!(
                "{label} repair of victim arc {victim}: {st:?}, warm {}",
                m.stats().warm
            )
            .into());
        }
        work.push(m.stats().work as f64);
        searches.push(m.stats().iterations as f64);
        let (b, oc) = h.ask(&format!("resolve {victim}"))?;
        ort_spent += b;
        if oc as i128 != m.cost_i128() {
            same_cost = false;
            eprintln!(
                "{label} victim {victim}: ours {} != OR-tools {oc}",
                m.cost()
            );
        }
        rep.push(a);
        res.push(b);
        speed.push(b / a);
    }
    let n_vict = rep.len();
    let mut s2 = speed.clone();
    let smin = speed.iter().copied().fold(f64::INFINITY, f64::min);
    let (rep_med, rep_p99) = (median(&mut rep.clone()), p99(&mut rep));
    let row = json!({
        "peers": info["peers"],
        "graph_nodes": info["n_graph"],
        "arcs": info["n_arcs"],
        "F": info["F"],
        "edges": mode,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "pairs": args.reps,
        "ours_ms": row_cold.0,
        "ortools_ms": row_cold.1,
        "ratio": row_cold.2,
        "ratio_min": rmin,
        "ratio_max": rmax,
        "victims": n_vict,
        "repair_ms": rep_med,
        "repair_p99_ms": rep_p99,
        "repair_settled_nodes_median": median(&mut work),
        "repair_searches_median": median(&mut searches),
        "ortools_resolve_ms": median(&mut res),
        "repair_speedup": median(&mut s2),
        "repair_speedup_min": smin,
        "same_cost": same_cost,
        "cost": base.cost(),
        "our_bytes": base.memory_bytes(),
        "vm_hwm_kib": vm_hwm_kib(),
    });
    eprintln!(
        "{label} repair over {n_vict} victims: median {rep_med:.3} ms, p99 {rep_p99:.3} ms; OR-tools re-solve median {:.1} ms; speedup median {:.0}x (min {smin:.0}x); same cost {same_cost}",
        row["ortools_resolve_ms"].as_f64().unwrap_or(0.0),
        row["repair_speedup"].as_f64().unwrap_or(0.0),
    );
    Ok(row)
}
