//! `gwtf bench testbed` and `gwtf node --emulate`: real processes against
//! the simulator on the same scenario, seed and membership.
mod common;

use common::*;
use std::process::Command;

fn gwtf() -> Command {
    Command::new(common::gwtf_exe())
}

/// A small scenario: one holder and one relay per llama-124m relay stage
/// (4), one-sequence microbatches, geo10's latencies / 50. Each policy's
/// swarm of processes trains its iterations, and the simulator's run of
/// the same founders is beside it: both measured, both positive, the
/// real run within a (loose) factor of the simulated one, and the peak
/// memory of a node at least a relay stage's emulated state.
#[test]
fn the_testbed_runs_each_policy_in_processes_and_in_the_simulator() {
    let dir = scratch("testbed-small");
    let json = dir.join("out.json");
    let logs = dir.join("logs");
    let out = run_ok(gwtf().args([
        "bench",
        "testbed",
        "--holders",
        "1",
        "--relays",
        "4",
        "--sequences",
        "1",
        "--iterations",
        "3",
        "--microbatches",
        "2",
        "--latency-scale",
        "50",
        "--policies",
        "gwtf,swarm",
        "--deadline-s",
        "300",
        "--json",
        json.to_str().unwrap(),
        "--keep-logs",
        logs.to_str().unwrap(),
    ]));
    let text = stdout_of(&out);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = v["policies"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["gwtf", "swarm"], "{text}");
    for r in rows {
        let real = r["real_s_per_iteration"].as_f64().unwrap();
        let sim = r["simulated_s_per_iteration"].as_f64().unwrap();
        assert!(real > 0.0 && sim > 0.0, "{r}");
        // The links' delays and bandwidths and the emulated GPUs' times
        // are floors the processes cannot beat: a run much faster than the
        // simulated one would mean they were not applied. (How much slower
        // the processes are is what the bench reports; in a debug build the
        // runtime's own CPU work dominates.)
        assert!(
            real / sim > 0.5,
            "real {real} s against simulated {sim} s: {text}"
        );
        // 3 iterations made final, in the processes and in the simulator.
        assert_eq!(r["real_iterations_s"].as_array().unwrap().len(), 3, "{r}");
        assert_eq!(
            r["simulated_iterations_s"].as_array().unwrap().len(),
            3,
            "{r}"
        );
        // A relay holds llama-124m's stage state (16 bytes a parameter,
        // over 100 MB) at its real size when it exports it; at least the
        // gradient (4 bytes a parameter) is resident.
        assert!(r["peak_mb_max"].as_f64().unwrap() > 25.0, "{r}");
    }
    assert!(text.contains("| gwtf | "), "{text}");
    // Every node was an emulated process with the links of its region.
    let links = std::fs::read_to_string(logs.join("gwtf").join("links-1.txt")).unwrap();
    assert_eq!(links.lines().filter(|l| !l.starts_with('#')).count(), 4);
    let holder = std::fs::read_to_string(logs.join("gwtf").join("node-1.stdout")).unwrap();
    assert!(holder.contains("emulated llama-124m"), "{holder}");
    let relay = std::fs::read_to_string(logs.join("swarm").join("node-2.stdout")).unwrap();
    assert!(relay.contains("\"applied\""), "{relay}");
}

#[test]
fn the_testbed_and_emulated_nodes_refuse_bad_arguments() {
    let dir = scratch("testbed-refusals");
    let key = dir.join("swarm.key");
    std::fs::write(&key, "00112233445566778899aabbccddeeff\n").unwrap();
    let key = key.to_str().unwrap();
    let bad_links = dir.join("links.txt");
    std::fs::write(&bad_links, "# ID DELAY_MS MBIT_S\n7 10 100\n7 twelve 100\n").unwrap();
    let twice = dir.join("twice.txt");
    std::fs::write(&twice, "7 10 100\n7 12 100\n").unwrap();
    let node = |extra: &[&str]| -> Vec<String> {
        [
            "node",
            "--listen",
            "127.0.0.1:0",
            "--swarm-key-file",
            key,
            "--join",
            "127.0.0.1:9",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
    };
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (node(&["--emulate", "llama-7t"]), vec!["--emulate llama-7t"]),
        (node(&["--capacity", "3"]), vec!["--capacity", "--emulate"]),
        (
            node(&["--emulate", "llama-124m", "--tflops", "0"]),
            vec!["--tflops"],
        ),
        (
            node(&["--emulate", "llama-124m", "--save", "/tmp/x"]),
            vec!["--save needs a model"],
        ),
        (
            node(&["--peer-links", bad_links.to_str().unwrap()]),
            vec!["line 3", "DELAY_MS is a number"],
        ),
        (
            node(&["--peer-links", twice.to_str().unwrap()]),
            vec!["line 2", "named twice"],
        ),
        (
            node(&["--peer-links", "/nonexistent/links"]),
            vec!["--peer-links /nonexistent/links"],
        ),
        (
            ["bench", "testbed", "--policies", "gwtf,central-mcmf"]
                .map(String::from)
                .to_vec(),
            vec!["--policies", "central planner"],
        ),
        (
            ["bench", "testbed", "--iterations", "2"]
                .map(String::from)
                .to_vec(),
            vec!["--iterations", "got 2"],
        ),
        (
            ["bench", "testbed", "--model", "llama-7t"]
                .map(String::from)
                .to_vec(),
            vec!["--model llama-7t"],
        ),
        (
            ["bench", "testbed", "--scenario", "mars"]
                .map(String::from)
                .to_vec(),
            vec!["mars"],
        ),
    ];
    for (args, says) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        gwtf_refuses(&args, &says);
    }
}
