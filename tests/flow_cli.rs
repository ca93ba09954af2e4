//! Runs the built `gwtf` binary on small inputs and checks its JSON.
mod common;

use std::process::Command;

fn gwtf(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(common::gwtf_exe())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn tmp_file(name: &str, text: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("gwtf-flow-cli-{}-{name}", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn solve_prints_json() {
    let f = tmp_file(
        "a.min",
        "c tiny\np min 4 5\nn 1 4\nn 4 -4\na 1 2 0 4 2\na 1 3 0 2 2\na 2 3 0 2 1\na 2 4 0 3 3\na 3 4 0 5 1\n",
    );
    let (ok, out, err) = gwtf(&["flow", "solve", f.to_str().unwrap(), "--arc-flows"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["status"], "optimal");
    assert_eq!(v["cost"], 14);
    assert_eq!(v["flow"], 4);
    assert!(v["solve_ms"].as_f64().unwrap() >= 0.0);
    let flows: Vec<i64> = serde_json::from_value(v["arc_flows"].clone()).unwrap();
    assert_eq!(flows.len(), 5);
    assert_eq!(
        flows
            .iter()
            .zip([2, 2, 1, 3, 1])
            .map(|(f, c)| f * c)
            .sum::<i64>(),
        14
    );

    let g = tmp_file("b.min", "p min 2 1\nn 1 5\nn 2 -5\na 1 2 0 3 1\n");
    let (ok, out, _) = gwtf(&["flow", "solve", g.to_str().unwrap()]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["status"], "infeasible");

    let h = tmp_file("c.min", "p min 2 1\na 1 2 0 1\n");
    let (ok, _, err) = gwtf(&["flow", "solve", h.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("line 2"), "{err}");
    for p in [f, g, h] {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn route_geo10_with_crash() {
    let (ok, out, err) = gwtf(&[
        "flow",
        "route",
        "geo10",
        "--nodes-per-region",
        "4",
        "--stages",
        "6",
        "--capacity",
        "1..4",
        "--seed",
        "1",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let routes = v["initial"]["routes"].as_array().unwrap();
    assert!(!routes.is_empty());
    let victim = routes[0]["nodes"][1].as_str().unwrap().to_string();
    let (ok, out, err) = gwtf(&[
        "flow",
        "route",
        "geo10",
        "--nodes-per-region",
        "4",
        "--stages",
        "6",
        "--capacity",
        "1..4",
        "--seed",
        "1",
        "--crash",
        &victim,
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["incremental"], true);
    for r in v["repaired"]["routes"].as_array().unwrap() {
        assert!(r["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n.as_str() != Some(victim.as_str())));
    }
    assert!(v["repair_ms"].as_f64().unwrap() >= 0.0);
}

#[test]
fn route_checks_crash_names_and_arguments_before_solving() {
    let err = common::gwtf_refuses(
        &["flow", "route", "geo10", "--crash", "Atlantis-9"],
        &[
            "--crash Atlantis-9: no member of that name in geo10",
            "Tokyo",
        ],
    );
    assert!(!err.contains("routes"), "{err}");
    common::gwtf_refuses(
        &[
            "flow", "route", "geo10", "--crash", "Tokyo-1", "--crash", "Tokyo-1",
        ],
        &["--crash Tokyo-1 is given twice"],
    );
    for (args, names) in [
        (
            vec!["flow", "route", "geo10", "--capacity", "5..2"],
            vec!["--capacity", "need 0 <= LO <= HI, got 5..2"],
        ),
        (
            vec!["flow", "route", "geo10", "--capacity", "-1..2"],
            vec!["--capacity", "got -1..2"],
        ),
        (
            vec!["flow", "route", "geo10", "--capacity", "x"],
            vec!["--capacity", "LO..HI"],
        ),
        (
            vec!["flow", "route", "geo10", "--nodes-per-region", "0"],
            vec!["--nodes-per-region", "got 0"],
        ),
        (
            vec!["flow", "route", "geo10", "--stages", "-2"],
            vec!["--stages", "got -2"],
        ),
        (
            vec!["flow", "route", "homogeneous"],
            vec!["--nodes-per-region 4", "raise --nodes-per-region"],
        ),
        (
            vec!["flow", "route", "/nonexistent/file"],
            vec!["/nonexistent/file"],
        ),
        (
            vec!["bench", "flow", "--edge-modes", "knnx"],
            vec!["--edge-modes knnx"],
        ),
        (
            vec!["bench", "flow", "--sizes", "5"],
            vec!["--sizes", "must be >= 10, got 5"],
        ),
        (
            vec!["bench", "flow", "--sizes", "-5"],
            vec!["--sizes", "must be >= 10, got -5"],
        ),
        (
            vec!["bench", "flow", "--reps", "0"],
            vec!["--reps", "got 0"],
        ),
        (
            vec!["bench", "flow", "--victim-budget-s", "-1"],
            vec!["--victim-budget-s", "got -1"],
        ),
    ] {
        common::gwtf_refuses(&args, &names);
    }
}

#[test]
fn route_reads_the_example_scenario_shared_with_the_simulator() {
    let example = common::repo_root().join("scenarios/example.scenario");
    let (ok, out, err) = gwtf(&[
        "flow",
        "route",
        example.to_str().unwrap(),
        "--nodes-per-region",
        "8",
        "--crash",
        "Tokyo-1",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["initial"]["flow"].as_i64().unwrap() > 0, "{v}");
    assert_eq!(v["crashed"][0], "Tokyo-1");
    let bad = tmp_file("bad.scenario", "intra 2 1\nregion a 4\nregion b x\n");
    let bad_s = bad.to_str().unwrap();
    common::gwtf_refuses(
        &["flow", "route", bad_s],
        &[bad_s, "line 3: compute time `x` is not a number"],
    );
    let _ = std::fs::remove_file(bad);
}
