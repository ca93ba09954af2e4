//! The `gwtf` command-line tool: version and the CUDA probe.

mod common;

use common::*;
use std::process::Command;

fn gwtf() -> Command {
    Command::new(common::gwtf_exe())
}

#[test]
fn version_matches_cargo() {
    let out = stdout_of(&run_ok(gwtf().arg("version")));
    assert_eq!(out, format!("gwtf {} (ABI 1)\n", env!("CARGO_PKG_VERSION")));
}

/// `gwtf bench transport` measures raw TCP, tagged and encrypted frames
/// side by side, and counts the copies: none on the tagged path (the tag
/// is computed over the pool slot in place), one per sealed unit of an
/// encrypted frame (its slices).
#[test]
fn bench_transport_measures_raw_tagged_and_encrypted_paths() {
    let out = stdout_of(&run_ok(gwtf().args([
        "bench",
        "transport",
        "--sizes",
        "1M",
        "--conns",
        "1",
        "--pairs",
        "1",
        "--bytes",
        "8M",
        "--rtt-iters",
        "4",
        "--rtt-rounds",
        "1",
        "--json",
    ])));
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        lines[0]["one_core_gbps"]["keyed_blake3"].as_f64().unwrap() > 0.0,
        "{out}"
    );
    let case = &lines[1];
    for k in ["raw_gbps", "framed_gbps", "encrypted_gbps"] {
        assert!(case[k].as_f64().unwrap() > 0.0, "{k}: {out}");
    }
    assert_eq!(case["copies_per_frame"].as_f64(), Some(0.0), "{out}");
    // What each path costs in CPU, and the ratio the tag passes allow.
    for k in ["raw", "tagged", "encrypted"] {
        let busy = case["cores_busy"][k].as_f64().unwrap();
        assert!(
            busy > 0.0 && busy <= 1.5 * case["cores"].as_f64().unwrap(),
            "{k}: {out}"
        );
        assert!(
            case["cpu_ns_per_byte"][k].as_f64().unwrap() > 0.0,
            "{k}: {out}"
        );
    }
    let ceiling = case["tagged_ratio_ceiling"].as_f64().unwrap();
    assert!(ceiling > 0.0 && ceiling < 1.0, "{out}");
    // 1 MiB goes in 256 KiB slices: four sealed copies per frame.
    assert_eq!(
        case["encrypted_copies_per_frame"].as_f64(),
        Some(4.0),
        "{out}"
    );
}

#[test]
fn benches_and_echo_refuse_bad_arguments_before_working() {
    let key = scratch("cli-short-key").join("key");
    std::fs::write(&key, "short\n").unwrap();
    let key = key.to_str().unwrap();
    let echo = ["echo", "--listen", "127.0.0.1:0", "--swarm-key-file"];
    let with = |extra: &[&'static str]| -> Vec<&str> {
        echo.iter()
            .copied()
            .chain([key])
            .chain(extra.iter().copied())
            .collect()
    };
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            with(&[]),
            vec!["--swarm-key-file", key, "5 bytes, at least 16"],
        ),
        (
            vec![
                "echo",
                "--listen",
                "127.0.0.1:0",
                "--swarm-key-file",
                "/nonexistent/key",
            ],
            vec!["cannot read --swarm-key-file /nonexistent/key"],
        ),
        (
            with(&["--heartbeat-ms", "0"]),
            vec!["--heartbeat-ms", "got 0"],
        ),
        (
            with(&["--max-payload", "-1"]),
            vec!["--max-payload", "got -1"],
        ),
        (
            vec!["bench", "transport", "--sizes", "64K,0"],
            vec!["--sizes 0: must be > 0"],
        ),
        (
            vec!["bench", "transport", "--bytes", "lots"],
            vec!["--bytes lots", "not a byte count"],
        ),
        (
            vec!["bench", "transport", "--conns", "0"],
            vec!["--conns", "got 0"],
        ),
        (
            vec!["bench", "transport", "--rtt-iters", "0"],
            vec!["--rtt-iters", "got 0"],
        ),
        (
            vec![
                "bench",
                "transport",
                "--rtt-iters",
                "5",
                "--rtt-rounds",
                "6",
            ],
            vec!["--rtt-rounds 6 is more than --rtt-iters 5"],
        ),
        (
            vec!["bench", "kernels", "--min-secs", "-1"],
            vec!["--min-secs", "must be > 0, got -1"],
        ),
        (
            vec!["bench", "kernels", "--elements", "0"],
            vec!["--elements", "got 0"],
        ),
        (
            vec!["bench", "allreduce", "--members", "1"],
            vec!["--members", "1"],
        ),
        (
            vec!["bench", "allreduce", "--mb", "300"],
            vec!["--mb", "300"],
        ),
        (
            vec!["bench", "kernels", "--train-model", "nope"],
            vec!["--train-model nope"],
        ),
        (
            vec!["bench", "swarm", "--node-threads", "100000"],
            vec!["--node-threads", "must be <= 1024, got 100000"],
        ),
        (
            vec!["bench", "swarm", "--node-threads", "-2"],
            vec!["--node-threads", "must be >= 0, got -2"],
        ),
        (
            vec!["bench", "swarm", "--copies-every", "-1"],
            vec!["--copies-every", "must be >= 0, got -1"],
        ),
        (
            vec![
                "node",
                "--listen",
                "127.0.0.1:0",
                "--swarm-key-file",
                key,
                "--threads",
                "5000",
            ],
            vec!["--threads", "must be <= 1024, got 5000"],
        ),
    ];
    for (args, names) in cases {
        gwtf_refuses(&args, &names);
    }
}

#[test]
fn probe_without_driver_and_with_stub_driver() {
    if !std::path::Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() {
        let out = stdout_of(&run_ok(gwtf().arg("probe")));
        assert_eq!(out, "no CUDA driver library (libcuda.so) found\n");
        let out = gwtf().args(["probe", "--require-gpu"]).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
    }
    let stub = stub_libcuda_dir();
    let out = stdout_of(&run_ok(gwtf().arg("probe").env("LD_LIBRARY_PATH", &stub)));
    assert_eq!(
        out,
        "CUDA driver present but no device (CUDA_ERROR_NO_DEVICE)\n"
    );
    let out = stdout_of(&run_ok(
        gwtf()
            .args(["probe", "--json"])
            .env("LD_LIBRARY_PATH", &stub),
    ));
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["state"], "no-device");
    assert_eq!(v["error_name"], "CUDA_ERROR_NO_DEVICE");
    assert_eq!(v["device_count"], 0);
}

#[test]
fn probe_with_a_broken_driver_reports_init_error() {
    // A "driver" without cuInit: the probe must report it, not crash.
    let dir = scratch("broken-libcuda");
    let src = dir.join("broken.c");
    std::fs::write(&src, "int cuSomethingElse(void) { return 0; }\n").unwrap();
    run_ok(
        Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join("libcuda.so.1"))
            .arg(&src),
    );
    let out = run_ok(
        gwtf()
            .args(["probe", "--json"])
            .env("LD_LIBRARY_PATH", &dir),
    );
    let v: serde_json::Value = serde_json::from_str(stdout_of(&out).trim()).unwrap();
    assert_eq!(v["state"], "init-error", "{v}");
}

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn gpu_ready() -> bool {
    let out = run_ok(gwtf().args(["probe", "--json"]));
    let v: serde_json::Value = serde_json::from_str(stdout_of(&out).trim()).unwrap();
    v["state"] == "ready"
}

/// The command failed with the stand-in driver's reason: a driver, no device.
fn assert_no_device(out: &std::process::Output) {
    let err = stderr_of(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err,
        "gwtf: error: device unavailable: CUDA driver present but no device \
         (CUDA_ERROR_NO_DEVICE)\n"
    );
}

#[test]
fn train_on_cuda_without_a_gpu_fails_with_the_probe_message() {
    let train = [
        "train", "--model", "gpt-tiny", "--steps", "2", "--device", "cuda",
    ];
    // With the stand-in driver (present, no device): on every machine.
    let stub = stub_libcuda_dir();
    for json in [false, true] {
        let mut cmd = gwtf();
        cmd.args(train).env("LD_LIBRARY_PATH", &stub);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        assert_no_device(&out);
        if json {
            assert_eq!(stdout_of(&out), "", "no step was logged");
        }
    }
    // Without any driver library, where there is none.
    if !std::path::Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() && !gpu_ready() {
        let out = gwtf().args(train).output().unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(
            stderr_of(&out),
            "gwtf: error: device unavailable: no CUDA driver library (libcuda.so) found\n"
        );
    }
}

/// `gwtf node --device cuda` without a device stops before it listens,
/// with the probe's reason (the swarm on a GPU: tests/swarm_cuda.rs).
#[test]
fn node_on_cuda_without_a_gpu_fails_with_the_probe_message() {
    let dir = scratch("cli-node-cuda");
    std::fs::write(dir.join("key"), "0123456789abcdef-cli-cuda").unwrap();
    let out = gwtf()
        .args([
            "node",
            "--listen",
            "127.0.0.1:0",
            "--holder",
            "--device",
            "cuda",
        ])
        .args(["--chosen-id", "1", "--peer", "1/0/127.0.0.1:9", "--json"])
        .arg("--swarm-key-file")
        .arg(dir.join("key"))
        .env("LD_LIBRARY_PATH", stub_libcuda_dir())
        .output()
        .unwrap();
    assert_no_device(&out);
    assert_eq!(stdout_of(&out), "", "it never listened");
}

#[test]
fn train_on_cuda_with_a_gpu_logs_every_step() {
    if !gpu_ready() {
        if std::env::var_os("GWTF_REQUIRE_GPU").is_some() {
            panic!("GWTF_REQUIRE_GPU is set but the probe finds no GPU");
        }
        common::skip::skipped("no GPU: the probe finds no usable device");
        return;
    }
    for model in ["gpt-tiny", "llama-tiny"] {
        let out = run_ok(gwtf().args([
            "train", "--model", model, "--steps", "3", "--device", "cuda", "--json",
        ]));
        let lines: Vec<serde_json::Value> = stdout_of(&out)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "{model}");
        let loss = |i: usize| lines[i]["loss"].as_f64().unwrap();
        assert!(loss(0) > 5.0 && loss(0) < 6.0, "{model}: {lines:?}");
        assert!(loss(2) < loss(0), "{model}: {lines:?}");
    }
}

#[test]
fn bench_kernels_reports_training_on_cpu_and_cuda() {
    let out = run_ok(gwtf().args([
        "bench",
        "kernels",
        "--elements",
        "4096",
        "--min-secs",
        "0.001",
        "--train-steps",
        "2",
        "--train-model",
        "llama-tiny",
        "--json",
    ]));
    let lines: Vec<serde_json::Value> = stdout_of(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let train: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|v| v["name"] == "train llama-tiny")
        .collect();
    assert_eq!(train.len(), 2, "{lines:?}");
    assert_eq!(train[0]["device"], "cpu");
    assert!(train[0]["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(train[1]["device"], "cuda");
    if gpu_ready() {
        assert!(
            train[1]["tokens_per_s"].as_f64().unwrap() > 0.0,
            "{lines:?}"
        );
        assert!(train[1]["ratio_vs_cpu"].as_f64().unwrap() > 0.0);
    } else {
        let why = train[1]["skipped"].as_str().unwrap();
        assert!(why.starts_with("device unavailable: "), "{why}");
    }
    let bad = gwtf()
        .args(["bench", "kernels", "--train-model", "llama-124m"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr_of(&bad).contains("--train-model llama-124m"));
}

#[test]
fn demo_refuses_bad_arguments_before_starting_a_node() {
    let dir = scratch("cli-demo-refuses");
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let file = file.to_str().unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "too short").unwrap();
    let short = short.to_str().unwrap();
    let same = dir.join("same.out");
    let same = same.to_str().unwrap();
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["--nodes", "0"], vec!["--nodes", "got 0"]),
        (vec!["--holders", "-1"], vec!["--holders", "got -1"]),
        (
            vec!["--stages", "2"],
            vec!["--stages", "must be >= 3, got 2"],
        ),
        (
            vec!["--stages", "4", "--nodes", "1"],
            vec!["--nodes 1 is fewer than the 2 relay stages of --stages 4"],
        ),
        (
            vec!["--stages", "9"],
            vec!["--stages 9 does not cut llama-tiny"],
        ),
        (vec!["--model", "nope"], vec!["--model nope"]),
        (
            vec!["--model", "llama-500m"],
            vec![
                "--model llama-500m",
                "only gpt-tiny, llama-tiny and llama-small",
            ],
        ),
        (vec!["--iterations", "0"], vec!["--iterations", "got 0"]),
        (vec!["--microbatches", "0"], vec!["--microbatches", "got 0"]),
        (
            vec!["--crash-every", "-1"],
            vec!["--crash-every", "must be >= 0, got -1"],
        ),
        (vec!["--join-every", "soon"], vec!["--join-every", "`soon`"]),
        (vec!["--deadline", "0"], vec!["--deadline", "must be > 0"]),
        (vec!["--links", "mars"], vec!["--links", "mars"]),
        (
            vec!["--json", "/nonexistent/out.json"],
            vec!["cannot write --json /nonexistent/out.json"],
        ),
        (
            vec!["--report", "/nonexistent/out.html"],
            vec!["cannot write --report /nonexistent/out.html"],
        ),
        (
            vec!["--json", same, "--report", same],
            vec!["--json and --report are the same file"],
        ),
        (
            vec!["--keep-logs", file],
            vec!["--keep-logs", file, "not a directory"],
        ),
        (
            vec!["--data", "/nonexistent/corpus.txt"],
            vec!["--data", "/nonexistent/corpus.txt"],
        ),
        (vec!["--data", short], vec!["--data", short]),
    ];
    for (extra, names) in cases {
        let args: Vec<&str> = std::iter::once("demo").chain(extra).collect();
        gwtf_refuses(&args, &names);
    }
    // Nothing was written.
    assert!(!std::path::Path::new(same).exists());
}

/// A swarm key file in `scratch(name)`.
fn key_file(name: &str) -> std::path::PathBuf {
    let key = scratch(name).join("swarm.key");
    std::fs::write(&key, "00112233445566778899aabbccddeeff\n").unwrap();
    key
}

#[test]
fn node_refuses_a_bad_join_timeout() {
    let key = key_file("cli-node-join-timeout");
    let key = key.to_str().unwrap();
    for (value, says) in [
        ("0", "must be > 0, got 0"),
        ("-3", "must be > 0, got -3"),
        ("NaN", "must be a finite number"),
        ("inf", "must be a finite number"),
        ("1e9", "must be <= 604800"),
        ("soon", "`soon` is not a number"),
    ] {
        gwtf_refuses(
            &[
                "node",
                "--listen",
                "127.0.0.1:0",
                "--swarm-key-file",
                key,
                "--join",
                "127.0.0.1:9",
                "--join-timeout",
                value,
            ],
            &["--join-timeout", says],
        );
    }
}

/// A process runs the policies it can: central-mcmf needs a planner that
/// knows the whole swarm, which only the simulator has.
#[test]
fn node_and_demo_refuse_a_policy_they_cannot_run() {
    let key = key_file("cli-node-policy");
    let key = key.to_str().unwrap();
    for (value, says) in [
        ("central-mcmf", "needs a central planner"),
        (
            "swarmish",
            "expected one of gwtf, swarm, swarm-plus, swarm-deccom",
        ),
    ] {
        gwtf_refuses(
            &[
                "node",
                "--listen",
                "127.0.0.1:0",
                "--swarm-key-file",
                key,
                "--join",
                "127.0.0.1:9",
                "--policy",
                value,
            ],
            &["--policy", says],
        );
        gwtf_refuses(&["demo", "--policy", value], &["--policy", says]);
    }
}

/// Only data holders keep copies of the stages' states.
#[test]
fn node_keeps_states_only_as_a_holder() {
    let key = key_file("cli-node-keep-states");
    let me = free_addr().to_string();
    gwtf_refuses(
        &[
            "node",
            "--listen",
            &me,
            "--swarm-key-file",
            key.to_str().unwrap(),
            "--chosen-id",
            "5",
            "--stage",
            "1",
            "--peer",
            &format!("5/1/{me}"),
            "--keep-states-every",
            "5",
        ],
        &["--keep-states-every is for data holders (--holder)"],
    );
}

/// Checkpoints are written by data holders, with a period; a joiner
/// cannot resume (it downloads); a checkpoint of another model or run is
/// refused, naming the difference.
#[test]
fn node_saves_and_resumes_only_where_it_makes_sense() {
    let key = key_file("cli-node-save");
    let me = free_addr().to_string();
    let base = |role: &[&str], more: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "node",
            "--listen",
            &me,
            "--swarm-key-file",
            key.to_str().unwrap(),
            "--chosen-id",
            "5",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(role.iter().chain(more).map(|s| s.to_string()));
        v
    };
    let peer = format!("5/0/{me}");
    let holder: &[&str] = &["--holder", "--peer", &peer];
    let relay_peer = format!("5/1/{me}");
    let relay: &[&str] = &["--stage", "1", "--peer", &relay_peer];
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for (args, want) in [
        (
            base(relay, &["--save", d, "--save-every", "5"]),
            "--save is for data holders (--holder)",
        ),
        (base(holder, &["--save", d]), "--save needs --save-every K"),
        (
            base(holder, &["--save-every", "5"]),
            "--save-every needs --save DIR",
        ),
        (
            base(&["--join", "127.0.0.1:9"], &["--resume", d]),
            "--resume is for founding members",
        ),
    ] {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        gwtf_refuses(&a, &[want]);
    }
    // A checkpoint of a 3-stage cut, resumed in a 4-stage swarm; then one
    // of another --iterations.
    let ck = dir.path().join("ck");
    let c = ck.to_str().unwrap();
    run_ok(gwtf().args([
        "train",
        "--model",
        "llama-tiny",
        "--stages",
        "3",
        "--steps",
        "2",
        "--save",
        c,
    ]));
    let a = base(holder, &["--model", "llama-tiny", "--resume", c]);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    gwtf_refuses(&a, &["a checkpoint of another model or cut", "n_stages"]);
    run_ok(gwtf().args([
        "train",
        "--model",
        "llama-tiny",
        "--stages",
        "4",
        "--steps",
        "2",
        "--save",
        c,
    ]));
    let a = base(
        holder,
        &["--model", "llama-tiny", "--iterations", "7", "--resume", c],
    );
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    gwtf_refuses(&a, &["written by a run of --iterations 2", "give the same"]);
}

/// Runs `gwtf node` with `args` (and --json) until it ends on its own
/// (within a generous 30 s; it is killed and the test fails otherwise):
/// its exit status, stdout's events and stderr, and how long it ran.
fn node_until_it_gives_up(
    args: &[String],
) -> (
    std::process::ExitStatus,
    Vec<serde_json::Value>,
    String,
    std::time::Duration,
) {
    use std::time::{Duration, Instant};
    let t = Instant::now();
    let mut child = gwtf()
        .arg("node")
        .args(args)
        .arg("--json")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the node still runs {:?} after it started", t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let ran = t.elapsed();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (stdout_of(&out), stderr_of(&out));
    let events = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}\n{stderr}")))
        .collect();
    (out.status, events, stderr, ran)
}

/// The node gave up after 3 s with an error naming `given` (`--join ADDR`
/// or `--peer ID/STAGE/ADDR`), which it reported as refused: on stderr, and
/// as exactly one `connect_failed` event for `dead`.
fn assert_gave_up_on(
    (status, events, stderr, ran): (
        std::process::ExitStatus,
        Vec<serde_json::Value>,
        String,
        std::time::Duration,
    ),
    given: &str,
    dead: &str,
    what: &str,
) {
    let shown = format!("{events:?}\n{stderr}");
    assert!(!status.success(), "{shown}");
    assert!(
        ran >= std::time::Duration::from_secs(3),
        "gave up before --join-timeout: {ran:?}"
    );
    // The reason is the system's (e.g. "Connection refused (os error 111)").
    let lower = stderr.to_lowercase();
    assert!(
        lower.contains(&format!("cannot reach {given} (connection refused"))
            && stderr.contains(&format!(
                "gwtf: error: no {what} was reached within --join-timeout 3 s"
            ))
            && lower.contains(&format!("{given} (connection refused")),
        "{stderr}"
    );
    let failed: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["event"] == "connect_failed")
        .collect();
    assert_eq!(failed.len(), 1, "{shown}");
    assert_eq!(failed[0]["addr"], dead, "{shown}");
    assert_eq!(failed[0]["given"], given, "{shown}");
    let reason = failed[0]["reason"].as_str().unwrap_or("").to_lowercase();
    assert!(reason.contains("connection refused"), "{shown}");
    let last = events.last().unwrap();
    assert_eq!(last["event"], "error", "{shown}");
    assert!(last["message"].as_str().unwrap().contains(given), "{shown}");
}

/// A joiner whose only --join address refuses every connection reports it
/// (a `connect_failed` event, a line on stderr) and gives up after
/// --join-timeout with an error naming it, instead of waiting forever.
#[test]
fn a_joiner_that_reaches_nobody_reports_the_address_and_exits() {
    let key = key_file("cli-node-unreachable");
    // Bound and released: nobody listens there.
    let dead = free_addr().to_string();
    let args: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--swarm-key-file",
        key.to_str().unwrap(),
        "--join",
        &dead,
        "--join-timeout",
        "3",
    ]
    .map(String::from)
    .to_vec();
    assert_gave_up_on(
        node_until_it_gives_up(&args),
        &format!("--join {dead}"),
        &dead,
        "--join address",
    );
}

/// The same for a founding member none of whose fellow founding members
/// (--peer) is there.
/// Its id is the one of its node key, `node-PORT.key` next to the swarm
/// key by default, which `gwtf keygen` creates first and tells.
#[test]
fn a_founding_member_that_reaches_no_other_reports_it_and_exits() {
    let key = key_file("cli-node-unreachable-founder");
    let (me, dead) = (free_addr(), free_addr().to_string());
    let node_key = key.with_file_name(format!("node-{}.key", me.port()));
    let _ = std::fs::remove_file(&node_key);
    let id = keygen_id(&node_key);
    let me = me.to_string();
    let args: Vec<String> = [
        "--listen".into(),
        me.clone(),
        "--swarm-key-file".into(),
        key.to_str().unwrap().to_string(),
        "--holder".into(),
        "--stages".into(),
        "3".into(),
        "--peer".into(),
        format!("{id}/0/{me}"),
        "--peer".into(),
        format!("2/1/{dead}"),
        "--join-timeout".into(),
        "3".into(),
    ]
    .to_vec();
    assert_gave_up_on(
        node_until_it_gives_up(&args),
        &format!("--peer 2/1/{dead}"),
        &dead,
        "founding member (--peer)",
    );
}

/// `gwtf keygen FILE --json`: the id of the node key in FILE (created when
/// missing).
fn keygen_id(file: &std::path::Path) -> u64 {
    let out = gwtf()
        .args(["keygen", "--json"])
        .arg(file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_str(stdout_of(&out).trim()).unwrap();
    v["id"].as_u64().unwrap()
}

/// `gwtf keygen` creates a node key file (owner read and write only) and
/// prints its id, the same every time, in decimal and hex; a file that is
/// not a key is refused with what is wrong. A node whose --peer list gives
/// its own address another id (another key file than its own) is refused
/// before it starts, saying which key it has.
#[test]
fn keygen_tells_the_id_a_node_takes_from_its_key() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("cli-keygen");
    let file = dir.join("a.key");
    let _ = std::fs::remove_file(&file);
    let out = gwtf().arg("keygen").arg(&file).output().unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let text = stdout_of(&out);
    assert!(text.contains("of new key"), "{text}");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let id = keygen_id(&file);
    assert!(
        text.starts_with(&format!("node id {id} (0x{id:x}) of new key")),
        "{text}"
    );
    assert_eq!(keygen_id(&file), id);
    std::fs::write(dir.join("bad.key"), "not a key\n").unwrap();
    gwtf_refuses(
        &["keygen", dir.join("bad.key").to_str().unwrap()],
        &["node key", "not the 64 hex digits of a node key"],
    );
    let key = key_file("cli-keygen-node");
    let me = free_addr().to_string();
    gwtf_refuses(
        &[
            "node",
            "--listen",
            &me,
            "--swarm-key-file",
            key.to_str().unwrap(),
            "--node-key",
            file.to_str().unwrap(),
            "--holder",
            "--stages",
            "3",
            "--peer",
            &format!("{}/0/{me}", id ^ 1),
        ],
        &[
            &format!("has this node's address, but this node is id {id}"),
            file.to_str().unwrap(),
        ],
    );
}

/// `gwtf bench sim --allreduce ring|hierarchy`: 700 nodes put over 100
/// relays in each stage, beyond one butterfly; both ways complete the
/// iteration, and the ring (2 (n-1) steps) simulates more events and more
/// time than the hierarchy (five rounds).
#[test]
fn bench_sim_runs_large_stages_by_the_hierarchy_or_the_ring() {
    let row = |how: &str| -> (u64, f64) {
        let out = stdout_of(&run_ok(gwtf().args([
            "bench",
            "sim",
            "--nodes",
            "700",
            "--iterations",
            "1",
            "--allreduce",
            how,
        ])));
        let line = out
            .lines()
            .find(|l| l.trim_start().starts_with("700 "))
            .unwrap_or_else(|| panic!("no row in {out}"));
        assert!(!line.contains("did not complete"), "{line}");
        // Where the events go: the kinds of message sent most.
        assert!(
            (out.lines()).any(|l| l.trim_start().starts_with("messages ") && l.contains("Change")),
            "no message counts in {out}"
        );
        let cols: Vec<&str> = line.split_whitespace().collect();
        (cols[2].parse().unwrap(), cols[5].parse().unwrap())
    };
    let (ring_events, ring_secs) = row("ring");
    let (events, secs) = row("hierarchy");
    eprintln!("700 nodes, 1 iteration: ring {ring_events} events {ring_secs} s simulated, hierarchy {events} events {secs} s");
    assert!(ring_events > events && ring_secs > secs);
}

/// `gwtf bench allreduce --no-gloo`: three member processes on loopback
/// all-reduce 1 MB by the butterfly and print their time (every member
/// ended with the same bits, or the command fails).
#[test]
fn bench_allreduce_runs_member_processes() {
    let out = stdout_of(&run_ok(gwtf().args([
        "bench",
        "allreduce",
        "--members",
        "3",
        "--mb",
        "1",
        "--reps",
        "1",
        "--no-gloo",
    ])));
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("3 "))
        .unwrap_or_else(|| panic!("no row in {out}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[..3], ["3", "1", "butterfly"], "{row}");
    let secs: f64 = cols[3].parse().unwrap();
    assert!(secs > 0.0, "{row}");
}
