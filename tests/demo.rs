//! `gwtf demo` end to end: a local swarm of `gwtf node` processes trains
//! while relays are killed and others join; the demo checks what came of it.
//! And no node outlives the demo: not when it finishes, not at its deadline,
//! not on Ctrl-C, not when the demo itself is killed.
//!
//! Bounded: a few iterations of llama-tiny, deadlines far above what a run
//! takes on a loaded two-core machine.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn gwtf() -> Command {
    Command::new(common::gwtf_exe())
}

/// Whether this build has `gwtf node` (the demo's nodes); skips visibly if not.
fn node_command_exists() -> bool {
    let ok = gwtf()
        .args(["node", "--help"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        common::skip::skipped("this build has no `gwtf node` to run the demo's nodes with");
    }
    ok
}

/// The pids of the nodes the demo started, from its demo.log.
fn node_pids(logs: &Path) -> Vec<i32> {
    std::fs::read_to_string(logs.join("demo.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            w.next()?;
            (w.next()? == "pid").then_some(())?;
            w.next()?.parse().ok()
        })
        .collect()
}

/// A process that runs (exists and is not a zombie).
fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // pid (comm) state ...: the state follows the last ')'.
            let state = stat
                .rsplit_once(')')
                .map(|x| x.1.trim_start().chars().next());
            !matches!(state, Some(Some('Z')) | Some(Some('X')))
        }
        Err(_) => false,
    }
}

/// Every node the demo started has ended (within `within`).
fn assert_no_node_left(logs: &Path, within: Duration) {
    let pids = node_pids(logs);
    assert!(!pids.is_empty(), "demo.log names no node");
    let until = Instant::now() + within;
    loop {
        let left: Vec<i32> = pids.iter().copied().filter(|&p| running(p)).collect();
        if left.is_empty() {
            return;
        }
        if Instant::now() > until {
            for &p in &left {
                // SAFETY: cleaning up after a failed test; p was our grandchild.
                unsafe {
                    libc::kill(p, libc::SIGKILL);
                }
            }
            panic!("nodes {left:?} outlived the demo");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until the demo has started `n` nodes and `settle` has passed.
fn wait_for_nodes(demo: &mut Child, logs: &Path, n: usize, settle: Duration) {
    let until = Instant::now() + Duration::from_secs(60);
    while node_pids(logs).len() < n {
        assert!(demo.try_wait().unwrap().is_none(), "the demo ended early");
        assert!(Instant::now() < until, "the demo started no nodes");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(settle);
}

fn wait_with_timeout(demo: &mut Child, within: Duration) -> std::process::ExitStatus {
    let until = Instant::now() + within;
    loop {
        if let Some(st) = demo.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > until {
            let _ = demo.kill();
            panic!("the demo did not end within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `gwtf demo` with a crash a second and a join every 1.5 s over 12
/// iterations (and `extra`, whose options replace these) in
/// `scratch(name)`: its output, its --json and its --report.
fn demo_with_churn(
    name: &str,
    extra: &[&str],
) -> (std::process::Output, serde_json::Value, String, PathBuf) {
    let dir = scratch(name);
    let (json, report, logs) = (dir.join("run.json"), dir.join("run.html"), dir.join("logs"));
    // `extra` may replace an option of these.
    let base = [
        ("--nodes", "4"),
        ("--holders", "2"),
        ("--iterations", "12"),
        ("--microbatches", "2"),
        ("--crash-every", "1"),
        ("--join-every", "1.5"),
        ("--seed", "3"),
        ("--deadline", "400"),
    ];
    let out = gwtf()
        .arg("demo")
        .args(
            base.iter()
                .filter(|(k, _)| !extra.contains(k))
                .flat_map(|(k, v)| [*k, *v]),
        )
        .args(extra)
        .arg("--json")
        .arg(&json)
        .arg("--report")
        .arg(&report)
        .arg("--keep-logs")
        .arg(&logs)
        .output()
        .unwrap();
    assert_no_node_left(&logs, Duration::from_secs(5));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap_or_else(|e| {
            panic!("no --json: {e}\n{}", String::from_utf8_lossy(&out.stderr))
        }))
        .unwrap();
    let html = std::fs::read_to_string(&report).unwrap();
    (out, v, html, logs)
}

/// The demo's own job, whatever the swarm does: it runs the swarm to the end
/// through crashes and joins, reports every fact, exits 0 exactly when the
/// checks pass, and leaves no node behind.
#[test]
fn the_demo_runs_a_swarm_through_crashes_and_joins_and_reports() {
    if !node_command_exists() {
        return;
    }
    let (out, v, html, logs) = demo_with_churn("demo-e2e-report", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.success(), v["ok"] == true, "{stdout}\n{v}");
    assert_eq!(v["finished"], true, "{stdout}");
    assert_eq!(v["iterations"], 12);
    assert!(v["crashes"].as_u64().unwrap() >= 1, "{v}");
    assert!(v["joins"].as_u64().unwrap() >= 1, "{v}");
    assert!(v["replica_checks"].as_u64().unwrap() > 0, "{v}");
    for key in [
        "lost_microbatches",
        "replicas_agree",
        "loss_first",
        "loss_last",
        "reference_loss_last",
        "wasted_compute_pct",
        "recovery_ms_median",
        "tokens_per_s",
    ] {
        assert!(v.get(key).is_some(), "--json lacks {key}: {v}");
    }
    assert_eq!(v["per_iteration"].as_array().unwrap().len(), 12);
    assert_eq!(v["reference_loss"].as_array().unwrap().len(), 12);
    assert!(v["loss_last"].as_f64().unwrap() < v["loss_first"].as_f64().unwrap());
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(html.matches("</svg>").count(), 3);
    assert!(stdout.contains("crash: SIGKILL node"), "{stdout}");
    // Each kill says what it hit: the microbatches in flight on its victim.
    assert!(stdout.contains("in flight"), "{stdout}");
    for k in v["kills"].as_array().unwrap() {
        assert!(k["carrying"].is_u64(), "{k}");
    }
    assert_eq!(v["pause_count"], 0, "{v}");
    // events.log: every node's lines, each once, in the order read, with
    // the time and the node.
    let events = std::fs::read_to_string(logs.join("events.log")).unwrap();
    let mut last = 0.0;
    let mut per_node: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for l in events.lines() {
        let mut f = l.splitn(4, ' ');
        let t: f64 = f.next().unwrap().parse().unwrap();
        assert!(t >= last, "not in order: {l}");
        last = t;
        assert_eq!(f.next(), Some("node"), "{l}");
        let node = f.next().unwrap().to_string();
        per_node
            .entry(node)
            .or_default()
            .push(f.next().unwrap().to_string());
    }
    assert!(per_node.len() >= 6, "{per_node:?}");
    for (node, lines) in per_node {
        let own = std::fs::read_to_string(logs.join(format!("node-{node}.stdout"))).unwrap();
        assert_eq!(own.lines().collect::<Vec<_>>(), lines, "node {node}");
    }
}

/// The swarm's job: through the same crashes and joins every microbatch is
/// counted exactly once at every stage, every stage's replicas hold the same
/// weights, and the loss is the single-process reference's.
#[test]
fn the_swarm_trains_exactly_through_crashes_and_joins() {
    if !node_command_exists() {
        return;
    }
    // With encrypted links: every node's connections encrypt.
    let (out, v, _, logs) = demo_with_churn("demo-e2e-exact", &["--encrypt"]);
    trained_exactly(&out, &v);
    assert_eq!(v["encrypt"], true, "{v}");
    let started = std::fs::read_to_string(logs.join("demo.log")).unwrap();
    assert!(started.contains("--encrypt"), "{started}");
}

/// Every baseline the simulator compares GWTF with runs in real processes
/// too (`--policy`, passed to every node). `swarm-plus` and `swarm-deccom`
/// aggregate as GWTF does, so they train exactly through crashes and
/// joins; `swarm` follows SWARM's rules, which drop a crashed relay's
/// contributions and skip a failed all-reduce (docs/SPEC.md section 8), so
/// it trains exactly only without crashes (with joins).
#[test]
fn each_baseline_policy_trains_exactly_in_processes() {
    if !node_command_exists() {
        return;
    }
    for (policy, crashes) in [
        ("swarm", false),
        ("swarm-plus", true),
        ("swarm-deccom", true),
    ] {
        let mut extra = vec!["--policy", policy];
        if !crashes {
            extra.extend(["--crash-every", "0"]);
        }
        let (out, v, _, logs) = demo_with_churn(&format!("demo-policy-{policy}"), &extra);
        trained_exactly(&out, &v);
        assert_eq!(v["policy"], policy, "{v}");
        assert_eq!(v["crashes"].as_u64().unwrap() > 0, crashes, "{v}");
        assert!(v["joins"].as_u64().unwrap() > 0, "{v}");
        let started = std::fs::read_to_string(logs.join("demo.log")).unwrap();
        assert!(started.contains(&format!("--policy {policy}")), "{started}");
    }
}

/// A demo run that trained exactly: it passed, no microbatch was lost or
/// counted twice, the replicas agree, and the loss is the reference's.
fn trained_exactly(out: &std::process::Output, v: &serde_json::Value) {
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["lost_microbatches"], 0);
    assert_eq!(v["double_counted_microbatches"], 0);
    assert_eq!(v["replicas_agree"], true);
    let gap = v["loss_max_diff_vs_reference"].as_f64().unwrap();
    assert!(
        gap < 1e-3,
        "the loss departs from the reference by {gap}: {stdout}"
    );
}

#[test]
fn no_node_outlives_the_deadline() {
    if !node_command_exists() {
        return;
    }
    let dir = scratch("demo-deadline");
    let (json, logs) = (dir.join("run.json"), dir.join("logs"));
    let t = Instant::now();
    let out = gwtf()
        .args(["demo", "--iterations", "100000", "--deadline", "4"])
        .arg("--json")
        .arg(&json)
        .arg("--keep-logs")
        .arg(&logs)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the deadline of 4 s passed"), "{stderr}");
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    assert_no_node_left(&logs, Duration::from_secs(5));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["finished"], false);
}

#[test]
fn ctrl_c_stops_every_node() {
    if !node_command_exists() {
        return;
    }
    let logs = scratch("demo-interrupt").join("logs");
    let mut demo = gwtf()
        .args(["demo", "--iterations", "100000", "--keep-logs"])
        .arg(&logs)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_nodes(&mut demo, &logs, 8, Duration::from_secs(2));
    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(demo.id() as i32, libc::SIGINT);
    }
    let st = wait_with_timeout(&mut demo, Duration::from_secs(60));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut demo.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(st.code(), Some(1), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert_no_node_left(&logs, Duration::from_secs(5));
}

#[test]
fn a_killed_demo_takes_its_nodes_along() {
    if !node_command_exists() {
        return;
    }
    let logs = scratch("demo-killed").join("logs");
    let mut demo = gwtf()
        .args(["demo", "--iterations", "100000", "--keep-logs"])
        .arg(&logs)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_nodes(&mut demo, &logs, 8, Duration::from_secs(1));
    demo.kill().unwrap();
    demo.wait().unwrap();
    assert_no_node_left(&logs, Duration::from_secs(10));
}

/// `--pause-every`, `--pause-for`, `--cut-every` and `--cut-for` are
/// checked before any node starts.
/// `--empty-stage-at 7`: every relay of one stage is killed once iteration
/// 7 is final; the next joiner restores the stage from a holder's copy (the
/// holders keep one every 5 updates: of iteration 4 or later), the run
/// finishes with every microbatch counted once, and the report marks the
/// restore on the loss chart and says the loss after it.
#[test]
fn the_demo_empties_a_stage_and_a_joiner_restores_it() {
    if !node_command_exists() {
        return;
    }
    let (out, v, html, _) = demo_with_churn(
        "demo-empty-stage",
        &["--crash-every", "0", "--empty-stage-at", "7"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert_eq!(v["lost_microbatches"], 0, "{v}");
    assert_eq!(v["double_counted_microbatches"], 0, "{v}");
    assert_eq!(v["replicas_agree"], true, "{v}");
    let restores = v["restores"].as_array().unwrap();
    assert_eq!(restores.len(), 1, "{v}");
    let r = &restores[0];
    assert!(r["from"].is_u64(), "restarted instead of restored: {r}");
    let (it, applied) = (
        r["iteration"].as_u64().unwrap(),
        r["applied"].as_u64().unwrap(),
    );
    assert!(it >= 4 && it <= applied && applied >= 7, "{r}");
    // Training resumed on the restored stage, after its joiner started and
    // after the restore (the run went on to its last iteration).
    let (started, at, resumed) = (
        r["joiner_started_s"].as_f64().unwrap(),
        r["t_s"].as_f64().unwrap(),
        r["resumed_s"].as_f64().unwrap_or(-1.0),
    );
    assert!(started <= at && at <= resumed, "{r}");
    assert!(stdout.contains("training resumed"), "{stdout}");
    assert!(stdout.contains("emptying stage"), "{stdout}");
    assert!(stdout.contains("restored stage"), "{stdout}");
    assert!(html.contains("emptied stages taken up"), "report");
    assert!(html.contains("restored (copy of iteration"), "report");
}

/// The run must reach past the emptying, and someone must take it up.
#[test]
fn empty_stage_flags_are_refused_before_a_node_starts() {
    gwtf_refuses(
        &["demo", "--iterations", "10", "--empty-stage-at", "9"],
        &["--empty-stage-at 9", "before its last"],
    );
    gwtf_refuses(
        &["demo", "--empty-stage-at", "3", "--join-every", "0"],
        &["--empty-stage-at needs joiners"],
    );
}

#[test]
fn pause_flags_are_refused_before_a_node_starts() {
    for (args, says) in [
        (["--pause-every", "-1"], "must be >= 0, got -1"),
        (["--pause-every", "often"], "`often` is not a number"),
        (["--pause-every", "NaN"], "must be a finite number"),
        (["--pause-for", "0"], "must be > 0, got 0"),
        (["--pause-for", "-2"], "must be > 0, got -2"),
        (["--pause-for", "inf"], "must be a finite number"),
        (["--pause-for", "7200"], "must be <= 3600, got 7200"),
        (["--cut-every", "-1"], "must be >= 0, got -1"),
        (["--cut-for", "0"], "must be > 0, got 0"),
        (["--cut-for", "7200"], "must be <= 3600, got 7200"),
    ] {
        let all: Vec<&str> = std::iter::once("demo").chain(args).collect();
        gwtf_refuses(&all, &[args[0], says]);
    }
}

/// `--cut-every`: relays' links are cut (emulated by the node) and restored
/// while the swarm trains; the run still finishes exactly (no microbatch
/// lost or counted twice, replicas agree), every cut is reported with what
/// it hit and marked in the report, and a cut-off relay comes back.
#[test]
fn the_demo_cuts_links_and_the_swarm_trains_exactly() {
    if !node_command_exists() {
        return;
    }
    let dir = scratch("demo-cut");
    let (json, report) = (dir.join("run.json"), dir.join("run.html"));
    let out = gwtf()
        .args([
            "demo",
            "--nodes",
            "6",
            "--holders",
            "2",
            "--iterations",
            "24",
            "--microbatches",
            "2",
            "--crash-every",
            "0",
            "--join-every",
            "0",
            "--cut-every",
            "2",
            "--cut-for",
            "2",
            "--seed",
            "2",
            "--deadline",
            "400",
        ])
        .arg("--json")
        .arg(&json)
        .arg("--report")
        .arg(&report)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("no --json: {e}\n{stderr}")),
    )
    .unwrap();
    trained_exactly(&out, &v);
    assert_eq!(v["cut_every_s"], 2.0);
    let cuts = v["cut_count"].as_u64().unwrap();
    assert!(cuts >= 1, "no link was cut: {stdout}");
    assert_eq!(v["pause_count"], 0, "{v}");
    assert!(stdout.contains("cut: link of node"), "{stdout}");
    assert!(stdout.contains("restore: link of node"), "{stdout}");
    for p in v["pauses"].as_array().unwrap() {
        assert_eq!(p["kind"], "cut", "{p}");
        assert!(p["carrying"].is_u64(), "{p}");
    }
    // A node cut off longer than the suspicion time fences itself.
    assert!(v["fences"].as_u64().unwrap() >= 1, "{stdout}");
    let html = std::fs::read_to_string(&report).unwrap();
    assert!(
        html.contains("link cut, then restored"),
        "no cut in the report's legend"
    );
}
