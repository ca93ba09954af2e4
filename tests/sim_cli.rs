//! `gwtf sim`: table, JSON and SVG outputs, argument checking.
mod common;

use common::*;
use std::process::Command;

fn gwtf() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gwtf"))
}

#[test]
fn sim_prints_a_table_and_writes_json_and_svg() {
    let dir = scratch("sim-cli");
    let json = dir.join("out.json");
    let svg = dir.join("out.svg");
    let out = stdout_of(&run_ok(gwtf().args([
        "sim",
        "--model",
        "llama-124m",
        "--holders",
        "3",
        "--relays",
        "8",
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
    for p in ["gwtf", "swarm", "optimal"] {
        assert!(out.lines().any(|l| l.starts_with(p)), "{out}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let arr = v.as_array().unwrap();
    assert_eq!(arr.len(), 3);
    for r in arr {
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
fn sim_rejects_bad_arguments() {
    for args in [
        vec!["sim", "--policy", "nope"],
        vec!["sim", "--model", "nope"],
        vec!["sim", "--scenario", "/nonexistent/file"],
        vec!["sim", "--churn-per-hour", "-1"],
        vec!["sim", "--relays", "2"],
        vec!["sim", "--iterations", "0"],
    ] {
        let out = gwtf().args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error"), "{args:?}: {err}");
    }
}
