//! `gwtf sim`: table, JSON and SVG outputs, argument checking.
mod common;

use common::*;
use std::process::Command;

fn gwtf() -> Command {
    Command::new(common::gwtf_exe())
}

/// `gwtf sim` on a small world (llama-124m, 3 holders) that runs in moments.
fn small_sim(relays: &str) -> Command {
    let mut c = gwtf();
    c.args([
        "sim",
        "--model",
        "llama-124m",
        "--holders",
        "3",
        "--relays",
        relays,
    ]);
    c
}

#[test]
fn sim_prints_a_table_and_writes_json_and_svg() {
    let dir = scratch("sim-cli");
    let json = dir.join("out.json");
    let svg = dir.join("out.svg");
    let out = stdout_of(&run_ok(small_sim("8").args([
        "--microbatches",
        "2",
        "--in-flight",
        "2",
        "--iterations",
        "2",
        "--churn-per-hour",
        "0.5",
        "--policy",
        "all",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ])));
    for p in [
        "bound",
        "gwtf",
        "swarm",
        "swarm-plus",
        "swarm-deccom",
        "central-mcmf",
    ] {
        assert!(out.lines().any(|l| l.starts_with(p)), "{out}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let arr = v.as_array().unwrap();
    assert_eq!(arr.len(), 6);
    let names: Vec<&str> = arr.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "gwtf",
            "swarm",
            "swarm-plus",
            "swarm-deccom",
            "central-mcmf",
            "bound"
        ]
    );
    let bound = &arr[5];
    let b = bound["iteration_time_s"].as_f64().unwrap();
    assert!(b > 0.0);
    for r in &arr[..5] {
        assert!(r["time_over_bound"].as_f64().unwrap() >= 1.0 - 1e-6);
        assert!(r["bound_training_time_s"].as_f64().unwrap() > 0.0);
    }
    for r in &arr[..5] {
        for k in [
            "policy",
            "training_time_s",
            "throughput_microbatches_per_hour",
            "iteration_time_p50_s",
            "iteration_time_p95_s",
            "wasted_gpu_pct",
            "lost_microbatches",
            "recomputed_stages",
            "crashes",
            "joins",
        ] {
            assert!(r.get(k).is_some(), "missing {k}");
        }
        assert_eq!(r["lost_microbatches"], 0);
    }
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("gwtf") && svg.contains("swarm"));
}

#[test]
fn sim_refuses_bad_arguments_before_simulating() {
    // 100,000 iterations: a check made after the simulation would time out.
    let long = ["sim", "--iterations", "100000"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        long.iter().chain(extra).copied().collect()
    };
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            with(&["--json", "/nonexistent/dir/x.json"]),
            vec!["cannot write --json /nonexistent/dir/x.json: directory /nonexistent/dir does not exist"],
        ),
        (
            with(&["--plot", "/nonexistent/dir/x.svg"]),
            vec!["cannot write --plot /nonexistent/dir/x.svg: directory /nonexistent/dir does not exist"],
        ),
        (with(&["--json", "/"]), vec!["cannot write --json /"]),
        (
            with(&["--churn-per-hour", "-1"]),
            vec!["--churn-per-hour", "must be >= 0, got -1"],
        ),
        (
            with(&["--churn-per-hour", "NaN"]),
            vec!["--churn-per-hour", "finite"],
        ),
        (
            with(&["--churn-per-hour", "101"]),
            vec!["--churn-per-hour", "must be <= 100, got 101"],
        ),
        (
            with(&["--leave-fraction", "1.5"]),
            vec!["--leave-fraction", "must be <= 1, got 1.5"],
        ),
        (
            vec!["sim", "--iterations", "0"],
            vec!["--iterations", "must be >= 1, got 0"],
        ),
        (
            vec!["sim", "--iterations", "-3"],
            vec!["--iterations", "must be >= 1, got -3"],
        ),
        (with(&["--holders", "0"]), vec!["--holders", "got 0"]),
        (with(&["--microbatches", "0"]), vec!["--microbatches", "got 0"]),
        (with(&["--in-flight", "0"]), vec!["--in-flight", "got 0"]),
        (with(&["--sequences", "0"]), vec!["--sequences", "got 0"]),
        (with(&["--sequences", "5000"]), vec!["--sequences", "got 5000"]),
        (
            with(&["--policy", "swarm-deccomm"]),
            vec!["--policy swarm-deccomm: unknown policy (gwtf, swarm, swarm-plus, swarm-deccom, central-mcmf, all)"],
        ),
        (with(&["--seed", "-1"]), vec!["--seed", "got -1"]),
        (
            with(&["--relays", "2"]),
            vec!["--relays 2", "llama-500m has 6 relay stages"],
        ),
        (with(&["--policy", "nope"]), vec!["--policy nope"]),
        (with(&["--model", "nope"]), vec!["--model nope"]),
        (
            with(&["--scenario", "/nonexistent/file"]),
            vec!["/nonexistent/file", "No such file"],
        ),
    ];
    for (args, names) in cases {
        gwtf_refuses(&args, &names);
    }
    assert_eq!(
        std::fs::metadata("/nonexistent/dir")
            .ok()
            .map(|m| m.is_dir()),
        None
    );
}

#[test]
fn sim_reads_the_example_scenario_and_refuses_a_malformed_one() {
    let example = repo_root().join("scenarios/example.scenario");
    let out = stdout_of(&run_ok(small_sim("8").args([
        "--scenario",
        example.to_str().unwrap(),
        "--iterations",
        "2",
        "--policy",
        "gwtf",
    ])));
    assert!(out.lines().any(|l| l.starts_with("gwtf")), "{out}");
    let dir = scratch("sim-cli-bad-scenario");
    let bad = dir.join("bad.scenario");
    std::fs::write(&bad, "intra 2 1\nregion a 4\n\nlink a b 30 0.5\n").unwrap();
    let bad = bad.to_str().unwrap();
    gwtf_refuses(
        &["sim", "--iterations", "100000", "--scenario", bad],
        &[bad, "line 4: unknown region b"],
    );
}

#[test]
fn sim_runs_every_built_in_scenario_and_takes_optimal_as_an_alias() {
    for name in ["geo10", "geo10-gib", "geo10-sparse", "homogeneous"] {
        let out = stdout_of(&run_ok(gwtf().args([
            "sim",
            "--scenario",
            name,
            "--model",
            "llama-124m",
            "--iterations",
            "2",
            "--policy",
            "optimal",
        ])));
        assert!(out.contains(&format!("scenario {name} ")), "{out}");
        assert!(out.lines().any(|l| l.starts_with("central-mcmf")), "{out}");
        assert!(out.lines().any(|l| l.starts_with("bound")), "{out}");
        assert!(!out.contains("INVARIANT"), "{out}");
    }
    // geo10-sparse brings its own population; the command line overrides it.
    let sparse = |extra: &[&str]| {
        let mut c = gwtf();
        c.args([
            "sim",
            "--scenario",
            "geo10-sparse",
            "--model",
            "llama-124m",
            "--iterations",
            "1",
            "--policy",
            "gwtf",
        ]);
        stdout_of(&run_ok(c.args(extra)))
    };
    let out = sparse(&[]);
    assert!(out.contains("10 holders + 30 relays"), "{out}");
    let out = sparse(&["--relays", "12", "--holders", "4"]);
    assert!(out.contains("4 holders + 12 relays"), "{out}");
}

#[test]
fn a_scenario_file_sets_the_global_batch_and_the_nic() {
    let dir = scratch("sim-cli-batch");
    let file = dir.join("batch.scenario");
    std::fs::write(
        &file,
        "intra 2 1\nregion a 4\nregion b 4.4\nlink a b 30 0.5\nnic 25\nbatch 12\n",
    )
    .unwrap();
    let out = stdout_of(&run_ok(small_sim("8").args([
        "--scenario",
        file.to_str().unwrap(),
        "--iterations",
        "1",
        "--policy",
        "gwtf",
    ])));
    // 12 microbatches over 3 holders: 4 each.
    assert!(
        out.contains("4 microbatches/holder of 4 sequences, 4 in flight (global batch 12)"),
        "{out}"
    );
    assert!(out.contains("NIC 25 Gbit/s"), "{out}");
}

#[test]
fn sim_bench_refuses_bad_arguments() {
    gwtf_refuses(&["bench", "sim", "--nodes", "3"], &["--nodes 3", "too few"]);
    gwtf_refuses(&["bench", "sim", "--nodes", "-5"], &["--nodes", "got -5"]);
    gwtf_refuses(&["bench", "sim", "--iterations", "0"], &["--iterations"]);
    gwtf_refuses(&["bench", "sim", "--policy", "all"], &["--policy all"]);
}

#[test]
fn sim_plot_is_readable() {
    let dir = scratch("sim-cli-plot");
    let svg = dir.join("plot.svg");
    run_ok(small_sim("12").args([
        "--iterations",
        "6",
        "--churn-per-hour",
        "2",
        "--policy",
        "all",
        "--plot",
        svg.to_str().unwrap(),
    ]));
    let svg = std::fs::read_to_string(&svg).unwrap();
    // plotters writes each text on a line of its own.
    let texts: Vec<&str> = svg
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('<'))
        .collect();
    // Legend entries for the policies and for both kinds of churn marks.
    for entry in [
        "gwtf",
        "swarm",
        "central-mcmf",
        "bound",
        "crash (",
        "join (",
    ] {
        assert!(
            texts.iter().any(|t| t.starts_with(entry)),
            "no legend entry {entry}: {texts:?}"
        );
    }
    // Integer ticks print as integers.
    assert!(
        !texts
            .iter()
            .any(|t| t.ends_with(".0") && t.parse::<f64>().is_ok()),
        "a tick label ends in .0: {texts:?}"
    );
}

/// `gwtf bench policies` on a small grid: a row per run and one per
/// (scenario, churn), the `t/bound` printed is the run's (its JSON), the
/// tables do not depend on how many runs go at once, and the grid's runs are
/// those of `gwtf sim` with the same scenario, churn and seed.
#[test]
fn bench_policies_prints_a_row_per_run_and_the_range_over_the_seeds() {
    let dir = scratch("bench-policies");
    let json = dir.join("runs.json");
    let grid = |jobs: &str, json: Option<&std::path::Path>| {
        let mut c = gwtf();
        c.args([
            "bench",
            "policies",
            "--scenarios",
            "homogeneous,geo10",
            "--churn",
            "0,0.5",
            "--seeds",
            "1,2,1",
            "--iterations",
            "3",
            "--model",
            "llama-124m",
            "--regimes",
            "project",
            "--jobs",
            jobs,
        ]);
        if let Some(j) = json {
            c.arg("--json").arg(j);
        }
        let out = c.output().expect("runs gwtf");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let table = grid("3", Some(&json));
    assert_eq!(table, grid("1", None), "the tables depend on --jobs");
    let rows: Vec<Vec<String>> = (table.lines())
        .filter(|l| l.starts_with("| homogeneous") || l.starts_with("| geo10"))
        .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
        .collect();
    // 2 scenarios x 2 rates x 2 seeds runs (seed 1 given twice runs once),
    // then 2 x 2 ranges.
    assert_eq!(rows.len(), 8 + 4, "{table}");
    let runs: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(runs.len(), 8 * 5, "a report per run and policy");
    let report = |sc: &str, churn: f64, seed: u64, policy: &str| {
        (runs.iter())
            .find(|r| {
                r["scenario"] == sc
                    && r["churn_per_hour"].as_f64() == Some(churn)
                    && r["seed"] == seed
                    && r["policy"] == policy
            })
            .unwrap_or_else(|| panic!("no report of {sc} {churn} {seed} {policy}"))
    };
    for row in &rows[..8] {
        let (sc, churn, seed) = (&row[1], row[2].parse().unwrap(), row[3].parse().unwrap());
        for (col, policy) in [
            (5, "gwtf"),
            (6, "swarm"),
            (7, "swarm-plus"),
            (8, "swarm-deccom"),
            (9, "central-mcmf"),
        ] {
            let r = report(sc, churn, seed, policy);
            let printed: f64 = row[col].split(' ').next().unwrap().parse().unwrap();
            assert!(
                (printed - r["time_over_bound"].as_f64().unwrap()).abs() < 6e-4,
                "{row:?} {policy}"
            );
        }
        let (g, s) = (
            report(sc, churn, seed, "gwtf"),
            report(sc, churn, seed, "swarm"),
        );
        let want = g["training_time_s"].as_f64().unwrap() / s["training_time_s"].as_f64().unwrap();
        assert!(
            (row[10].parse::<f64>().unwrap() - want).abs() < 6e-4,
            "{row:?}"
        );
        let d = report(sc, churn, seed, "swarm-deccom");
        let want = g["training_time_s"].as_f64().unwrap() / d["training_time_s"].as_f64().unwrap();
        assert!(
            (row[12].parse::<f64>().unwrap() - want).abs() < 6e-4,
            "{row:?}"
        );
        assert_eq!(
            (g["sequences"].as_u64(), g["max_in_flight"].as_u64()),
            (Some(4), Some(4))
        );
    }
    // A range covers its seeds' values.
    for row in &rows[8..] {
        assert_eq!(row[3], "2", "{row:?}");
        let (sc, churn) = (&row[1], row[2].parse::<f64>().unwrap());
        let vals: Vec<f64> = [1, 2]
            .iter()
            .map(|&s| {
                report(sc, churn, s, "gwtf")["time_over_bound"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        let lo = vals.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(row[4].starts_with(&format!("{lo:.3}")), "{row:?} {vals:?}");
    }
    // The same run as `gwtf sim` with that scenario, churn and seed.
    let sim_json = dir.join("sim.json");
    let out = gwtf()
        .args([
            "sim",
            "--scenario",
            "geo10",
            "--churn-per-hour",
            "0.5",
            "--seed",
            "2",
            "--iterations",
            "3",
            "--model",
            "llama-124m",
            "--policy",
            "gwtf",
            "--json",
        ])
        .arg(&sim_json)
        .output()
        .unwrap();
    assert!(out.status.success());
    let sim: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&sim_json).unwrap()).unwrap();
    assert_eq!(
        sim[0]["training_time_s"],
        report("geo10", 0.5, 2, "gwtf")["training_time_s"]
    );
}

/// The paper's regime: microbatches of 16 sequences, 16 in flight, 32 per
/// holder, on its own scenarios, under a heading of its own.
#[test]
fn bench_policies_runs_the_papers_regime_on_its_own_scenarios() {
    let dir = scratch("bench-policies-paper");
    let json = dir.join("runs.json");
    let out = gwtf()
        .args([
            "bench",
            "policies",
            "--regimes",
            "project,paper",
            "--scenarios",
            "homogeneous",
            "--paper-scenarios",
            "geo10-gib",
            "--churn",
            "0",
            "--seeds",
            "1",
            "--iterations",
            "1",
            "--model",
            "llama-124m",
        ])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    let project = table
        .find("# The project regime")
        .expect("no project heading");
    let paper = table.find("# The paper regime").expect("no paper heading");
    assert!(project < paper, "{table}");
    assert!(table[..paper].contains("| homogeneous |"), "{table}");
    assert!(!table[..paper].contains("| geo10-gib |"), "{table}");
    assert!(table[paper..].contains("| geo10-gib |"), "{table}");
    let runs: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(runs.len(), 10, "two cells of five policies");
    for r in &runs {
        let paper = r["scenario"] == "geo10-gib";
        // llama-124m's own microbatch: 4 sequences.
        let want = if paper { (16, 16, 32) } else { (4, 4, 8) };
        let got = (
            r["sequences"].as_u64().unwrap(),
            r["max_in_flight"].as_u64().unwrap(),
            r["microbatches_per_holder"].as_u64().unwrap(),
        );
        assert_eq!(got, want, "{}", r["policy"]);
    }
}

#[test]
fn bench_policies_refuses_bad_arguments_before_running() {
    // 100,000 iterations: a check made after the runs would time out.
    let long = ["bench", "policies", "--iterations", "100000"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        long.iter().chain(extra).copied().collect()
    };
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (with(&["--scenarios", "geo10,nowhere"]), vec!["nowhere"]),
        (
            with(&["--churn", "0,-1"]),
            vec!["--churn", "must be >= 0, got -1"],
        ),
        (with(&["--churn", "0,NaN"]), vec!["--churn", "finite"]),
        (
            with(&["--seeds", "1,x"]),
            vec!["--seeds", "`x` is not a whole number"],
        ),
        (with(&["--jobs", "0"]), vec!["--jobs", "got 0"]),
        (with(&["--model", "nope"]), vec!["--model nope"]),
        (with(&["--seeds", "1,"]), vec!["--seeds"]),
        (
            with(&["--regimes", "project,ours"]),
            vec!["--regimes ours: unknown regime (project, paper)"],
        ),
        (with(&["--paper-scenarios", "nowhere"]), vec!["nowhere"]),
        (
            with(&["--json", "/nonexistent/dir/x.json"]),
            vec!["cannot write --json /nonexistent/dir/x.json"],
        ),
        (
            vec!["bench", "policies", "--iterations", "0"],
            vec!["--iterations", "must be >= 1, got 0"],
        ),
    ];
    for (args, names) in cases {
        gwtf_refuses(&args, &names);
    }
}
