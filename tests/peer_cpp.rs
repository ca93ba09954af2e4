//! Swarms of C++ trainers joined through `gwtf_peer` (built with
//! AddressSanitizer through the examples' Makefile).
//!
//! c-examples/cpp/swarm_mlp.cpp has its own model: two data holders and two
//! relays on each of two stages; one relay is SIGKILLed mid-training and a
//! new one joins; the holders still finish every iteration, the loss falls,
//! and the replicas of each stage report the same weights after every
//! update.
//!
//! c-examples/cpp/swarm_torch.cpp is the same trainer on libtorch (tensors
//! over the library's frames, autograd), through the same kill and join.
//!
//! c-examples/cpp/swarm_stage.cpp drives libgwtf's own model through
//! `gwtf_stage`: in a mixed swarm, `gwtf node` processes (the built-in Rust
//! trainer) and these C++ relays serve the same stages, and their replicas
//! agree bit for bit after every update.

mod common;

use common::skip::skipped;
use common::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const KEY: &str = "0123456789abcdef-cpp-swarm-key";
const ITERATIONS: u32 = 16;

fn tool_missing() -> Option<&'static str> {
    for (tool, arg) in [
        ("c++", "--version"),
        ("make", "--version"),
        ("pkg-config", "--version"),
    ] {
        if Command::new(tool).arg(arg).output().is_err() {
            return Some(tool);
        }
    }
    None
}

/// One process swarm at a time (two cores).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Builds `name` (swarm_mlp, swarm_stage) with the examples' Makefile (ASan
/// included).
fn build_trainer(name: &str) -> PathBuf {
    let build = scratch("peer-cpp");
    let exe = build.join(name);
    run_ok(
        Command::new("make")
            .arg("-C")
            .arg(repo_root().join("c-examples"))
            .arg(format!("LIBDIR={}", lib_dir().display()))
            .arg(format!("BUILD={}", build.display()))
            .arg(&exe),
    );
    exe
}

/// The turn, the built trainer `name`, a scratch directory and the key
/// file in it; None (the test skipped visibly) without a compiler.
fn prepare(
    name: &str,
) -> Option<(
    std::sync::MutexGuard<'static, ()>,
    PathBuf,
    tempfile::TempDir,
    PathBuf,
)> {
    if let Some(tool) = tool_missing() {
        skipped(&format!("{tool} is not installed"));
        return None;
    }
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let exe = build_trainer(name);
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, KEY).unwrap();
    Some((turn, exe, dir, key))
}

/// A founding member's own flags: its address, id and role.
fn member_args(id: u32, stage: u16, addr: &SocketAddr) -> Vec<String> {
    let mut args = vec![
        "--listen".to_string(),
        addr.to_string(),
        "--chosen-id".into(),
        id.to_string(),
    ];
    if stage == 0 {
        args.push("--holder".into());
    } else {
        args.extend(["--stage".to_string(), stage.to_string()]);
    }
    args
}

struct Proc {
    id: u32,
    child: Child,
    /// The thread reading its stdout (done once the process is gone).
    reader: Option<std::thread::JoinHandle<()>>,
}

/// Every child is killed when the test ends, whatever happened.
struct Procs(Vec<Proc>);

impl Drop for Procs {
    fn drop(&mut self) {
        for p in &mut self.0 {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }
}

fn spawn(
    exe: &Path,
    dir: &Path,
    id: u32,
    args: &[String],
    seen: &Arc<Mutex<Vec<(u32, Value)>>>,
) -> Proc {
    let mut child = asan_env(&mut Command::new(exe))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(
            std::fs::File::create(dir.join(format!("node-{id}.err"))).unwrap(),
        ))
        .spawn()
        .unwrap_or_else(|e| panic!("{} does not start: {e}", exe.display()));
    let out = child.stdout.take().unwrap();
    let seen = seen.clone();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            println!("{line}");
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                seen.lock().unwrap().push((id, v));
            }
        }
    });
    Proc {
        id,
        child,
        reader: Some(reader),
    }
}

#[test]
fn cpp_trainers_train_through_a_relay_kill_under_asan() {
    relay_kill_and_join("swarm_mlp");
}

/// The same swarm of the trainer on libtorch (swarm_torch.cpp: the same
/// model, its forward and backward by libtorch's autograd, tensors over
/// the library's frames), built against the `torch` package in the
/// checkout's .venv (scripts/python-deps installs it; where it is missing
/// the test is skipped visibly, or fails under `GWTF_REQUIRE_TORCH`).
#[test]
fn libtorch_trainers_train_through_a_relay_kill() {
    let python = repo_root().join(".venv/bin/python");
    let has_torch = Command::new(&python)
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_torch {
        if std::env::var_os("GWTF_REQUIRE_TORCH").is_some() {
            panic!(
                "GWTF_REQUIRE_TORCH is set but {} has no torch",
                python.display()
            );
        }
        skipped("no torch package in .venv (scripts/python-deps installs it)");
        return;
    }
    relay_kill_and_join("swarm_torch");
}

/// Two data holders and two relays on each of two stages of trainer
/// `name`; a stage-1 relay SIGKILLed in a forward, a relay joining; the
/// holders finish, the loss falls, replicas agree, the joiner trains.
fn relay_kill_and_join(name: &str) {
    let Some((_turn, exe, dir, key)) = prepare(name) else {
        return;
    };
    // id, stage (0: holder)
    let layout: [(u32, u16); 6] = [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2)];
    let addrs: Vec<SocketAddr> = layout.iter().map(|_| free_addr()).collect();
    let mut common: Vec<String> = vec![
        "--key-file".into(),
        key.display().to_string(),
        "--relay-stages".into(),
        "2".into(),
        "--iterations".into(),
        ITERATIONS.to_string(),
        "--microbatches".into(),
        "4".into(),
    ];
    let shared = common.clone();
    for ((id, stage), a) in layout.iter().zip(&addrs) {
        common.push("--peer".into());
        common.push(format!("{id}/{stage}/{a}"));
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut procs = Procs(Vec::new());
    for ((id, stage), a) in layout.iter().zip(&addrs) {
        let mut args = member_args(*id, *stage, a);
        // Microbatch work takes a while, and the stage-1 relays' shows:
        // the kill lands in the middle of a forward.
        args.extend(["--slow-ms", "20"].map(String::from));
        if *stage == 1 {
            args.push("--trace-work".into());
        }
        args.extend(common.iter().cloned());
        procs.0.push(spawn(&exe, dir.path(), *id, &args, &seen));
    }
    let deadline = Instant::now() + Duration::from_secs(240);
    // Mid-training: SIGKILL the stage-1 relay (3 or 4, whichever the
    // routing uses) in the middle of a forward of iteration 3 or later.
    let in_forward = |v: &Value| {
        v["event"] == "work" && v["kind"] == 2 && v["iteration"].as_u64().unwrap_or(0) >= 3
    };
    let victim: u32 = loop {
        let hit = seen
            .lock()
            .unwrap()
            .iter()
            .find(|(id, v)| (*id == 3 || *id == 4) && in_forward(v))
            .map(|(id, _)| *id);
        if let Some(id) = hit {
            break id;
        }
        assert!(
            Instant::now() < deadline,
            "no stage-1 forward of iteration 3 or later"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let survivor = 7 - victim;
    let p = procs.0.iter_mut().find(|p| p.id == victim).unwrap();
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    println!("test: SIGKILLed relay {victim} in a forward of iteration 3 or later");
    // A relay joins (the swarm chooses its stage; it downloads the state
    // from a member's trainer).
    const JOINER: u32 = 7;
    let mut args = vec![
        "--listen".to_string(),
        free_addr().to_string(),
        "--chosen-id".into(),
        JOINER.to_string(),
        "--join".into(),
        addrs[0].to_string(),
    ];
    args.extend(shared.iter().cloned());
    procs.0.push(spawn(&exe, dir.path(), JOINER, &args, &seen));
    // Both holders finish every iteration, the surviving relays leave on
    // SIGTERM, and all exit cleanly (ASan included).
    finish(&mut procs, dir.path(), deadline, &[victim], &seen);
    std::thread::sleep(Duration::from_millis(200));
    let seen = seen.lock().unwrap().clone();
    // Every holder: every iteration's loss, then done.
    let mut losses: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for holder in [1, 2] {
        let its: Vec<(u32, f64)> = seen
            .iter()
            .filter(|(id, v)| *id == holder && v["event"] == "iteration")
            .map(|(_, v)| {
                (
                    v["iteration"].as_u64().unwrap() as u32,
                    v["loss"].as_f64().unwrap(),
                )
            })
            .collect();
        let got: Vec<u32> = its.iter().map(|x| x.0).collect();
        assert_eq!(
            got,
            (0..ITERATIONS).collect::<Vec<_>>(),
            "holder {holder}'s iterations"
        );
        for (i, l) in its {
            losses.entry(i).or_default().push(l);
        }
        assert!(
            seen.iter()
                .any(|(id, v)| *id == holder && v["event"] == "done"),
            "holder {holder} printed no done"
        );
    }
    let mean = |i: u32| losses[&i].iter().sum::<f64>() / losses[&i].len() as f64;
    let first = mean(0);
    let last = (ITERATIONS - 3..ITERATIONS).map(mean).sum::<f64>() / 3.0;
    println!("test: mean loss of iteration 0 {first:.3}, of the last three {last:.3}");
    assert!(
        last < 0.6 * first,
        "the loss did not fall: {first:.3} -> {last:.3}"
    );
    // Replicas agree: per stage and iteration, one digest among the
    // members that applied it (the killed relay's are left out).
    let mut digests: BTreeMap<(u64, u64), BTreeMap<String, Vec<u32>>> = BTreeMap::new();
    for (id, v) in &seen {
        if v["event"] == "applied" && *id != victim {
            let k = (
                v["stage"].as_u64().unwrap(),
                v["iteration"].as_u64().unwrap(),
            );
            digests
                .entry(k)
                .or_default()
                .entry(v["weights"].as_str().unwrap().to_string())
                .or_default()
                .push(*id);
        }
    }
    for ((stage, it), d) in &digests {
        assert_eq!(
            d.len(),
            1,
            "stage {stage} iteration {it}: replicas disagree: {d:?}"
        );
    }
    for stage in 0..=2u64 {
        assert!(
            digests.keys().filter(|(s, _)| *s == stage).count() >= ITERATIONS as usize - 1,
            "stage {stage} applied too few updates"
        );
    }
    // The kill mattered: the victim served its stage, the others noticed
    // it gone, and its stage went on with the other relay alone.
    assert!(
        seen.iter()
            .any(|(id, v)| *id == victim && v["event"] == "applied"),
        "the victim never applied an update before the kill"
    );
    assert!(
        seen.iter()
            .any(|(_, v)| v["event"] == "peer_lost" && v["peer"] == victim),
        "nobody noticed the victim gone"
    );
    // The forward the kill interrupted (and any other in flight there) was
    // redone elsewhere.
    let recovered = seen
        .iter()
        .filter(|(_, v)| v["event"] == "recovered")
        .count();
    println!("test: {recovered} microbatches rerouted or restarted after the kill");
    assert!(recovered > 0, "no microbatch was redone after the kill");
    assert!(
        seen.iter()
            .any(|(id, v)| *id == JOINER && v["event"] == "state_download"),
        "the joiner downloaded no state"
    );
    assert!(
        seen.iter()
            .any(|(id, v)| *id == JOINER && v["event"] == "applied"),
        "the joiner applied no update"
    );
    let late: Vec<u64> = seen
        .iter()
        .filter(|(id, v)| *id == survivor && v["event"] == "applied")
        .map(|(_, v)| v["iteration"].as_u64().unwrap())
        .filter(|&i| i > 6)
        .collect();
    assert!(!late.is_empty(), "stage 1 stopped applying after the kill");
    assert!(
        !seen
            .iter()
            .any(|(_, v)| v["event"] == "error"
                && !v["message"].as_str().unwrap_or("").contains("peer")),
        "an error other than a lost peer"
    );
}

/// Waits until `p` exits and checks it exited cleanly.
fn wait_ok(p: &mut Proc, dir: &Path, deadline: Instant) {
    loop {
        if let Some(st) = p.child.try_wait().unwrap() {
            let err =
                std::fs::read_to_string(dir.join(format!("node-{}.err", p.id))).unwrap_or_default();
            assert!(st.success(), "node {} exited with {st}:\n{err}", p.id);
            if let Some(r) = p.reader.take() {
                let _ = r.join();
            }
            return;
        }
        assert!(
            Instant::now() < deadline,
            "node {} did not finish in time",
            p.id
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for the holders (ids 1 and 2) to finish, then has every other
/// process but `killed` leave with SIGTERM; each must exit cleanly.
fn finish(
    procs: &mut Procs,
    dir: &Path,
    deadline: Instant,
    killed: &[u32],
    seen: &Mutex<Vec<(u32, Value)>>,
) {
    for p in procs.0.iter_mut().filter(|p| p.id <= 2) {
        wait_ok(p, dir, deadline);
    }
    let relays = |p: &&mut Proc| p.id > 2 && !killed.contains(&p.id);
    // Each process prints on its own: a relay may apply the last update
    // after the holders are done (its coordinator tells the holders and
    // the members at once). It gets up to 10 s to print it before SIGTERM.
    let last = |ev: &[(u32, Value)]| {
        ev.iter()
            .filter(|(_, v)| v["event"] == "applied")
            .filter_map(|(_, v)| v["iteration"].as_u64())
            .max()
    };
    let ids: Vec<u32> = procs.0.iter_mut().filter(relays).map(|p| p.id).collect();
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let ev = seen.lock().unwrap().clone();
        let top = last(&ev);
        let settled = ids.iter().all(|id| {
            let mine: Vec<(u32, Value)> = ev.iter().filter(|(i, _)| i == id).cloned().collect();
            mine.is_empty() || last(&mine) == top
        });
        if settled {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in procs.0.iter_mut().filter(relays) {
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
    }
    for p in procs.0.iter_mut().filter(relays) {
        wait_ok(p, dir, Instant::now() + Duration::from_secs(30));
    }
}

/// A swarm of `gwtf node` processes and C++ `swarm_stage` relays
/// (`layout`: id, stage, C++ or else gwtf node) training llama-tiny for
/// `iters` iterations, members given their `extra` flags; every member's
/// JSON events once the holders finished and the relays left.
fn mixed_swarm(
    cpp: &Path,
    dir: &Path,
    key: &Path,
    layout: &[(u32, u16, bool)],
    iters: u32,
    extra: &dyn Fn(u32) -> Vec<String>,
) -> Vec<(u32, Value)> {
    let rust = common::gwtf_exe();
    let addrs: Vec<SocketAddr> = layout.iter().map(|_| free_addr()).collect();
    let mut model: Vec<String> = [
        "--model",
        "llama-tiny",
        "--stages",
        "4",
        "--iterations",
        &iters.to_string(),
        "--microbatches",
        "4",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for ((id, stage, _), a) in layout.iter().zip(&addrs) {
        model.push("--peer".into());
        model.push(format!("{id}/{stage}/{a}"));
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut procs = Procs(Vec::new());
    for ((id, stage, is_cpp), a) in layout.iter().zip(&addrs) {
        let mut args: Vec<String> = if *is_cpp {
            vec!["--key-file".into(), key.display().to_string()]
        } else {
            vec![
                "node".into(),
                "--json".into(),
                "--swarm-key-file".into(),
                key.display().to_string(),
            ]
        };
        args.extend(member_args(*id, *stage, a));
        args.extend(model.iter().cloned());
        args.extend(extra(*id));
        let exe = if *is_cpp { cpp } else { &rust };
        procs.0.push(spawn(exe, dir, *id, &args, &seen));
    }
    finish(
        &mut procs,
        dir,
        Instant::now() + Duration::from_secs(240),
        &[],
        &seen,
    );
    std::thread::sleep(Duration::from_millis(200));
    let events = seen.lock().unwrap().clone();
    events
}

#[test]
fn gwtf_node_and_cpp_gwtf_stage_relays_serve_the_same_stages() {
    let Some((_turn, cpp, dir, key)) = prepare("swarm_stage") else {
        return;
    };
    const ITERS: u32 = 6;
    // id, stage, C++ (else gwtf node): each relay stage has one of each.
    let layout: [(u32, u16, bool); 6] = [
        (1, 0, false),
        (2, 0, false),
        (3, 1, false),
        (4, 1, true),
        (5, 2, true),
        (6, 2, false),
    ];
    let seen = mixed_swarm(&cpp, dir.path(), &key, &layout, ITERS, &|_| Vec::new());
    // Per relay stage and iteration: the digest each member reported
    // (gwtf node names it weights_sha256, the C++ relay weights).
    let mut by: BTreeMap<(u64, u64), BTreeMap<u32, String>> = BTreeMap::new();
    for (id, v) in &seen {
        if v["event"] == "applied" {
            let w = v["weights_sha256"]
                .as_str()
                .or(v["weights"].as_str())
                .unwrap()
                .to_string();
            let k = (
                v["stage"].as_u64().unwrap(),
                v["iteration"].as_u64().unwrap(),
            );
            by.entry(k).or_default().insert(*id, w);
        }
    }
    for stage in 1..=2u64 {
        for it in 0..ITERS as u64 {
            let d = by.get(&(stage, it)).cloned().unwrap_or_default();
            let (cpp_id, rust_id) = if stage == 1 { (4, 3) } else { (5, 6) };
            let (c, r) = (d.get(&cpp_id), d.get(&rust_id));
            assert!(
                c.is_some() && c == r,
                "stage {stage} iteration {it}: C++ relay {cpp_id} {c:?}, gwtf node {rust_id} {r:?}"
            );
        }
    }
    // The C++ relays computed microbatches (routing may favour one replica).
    let cpp_ms: f64 = seen
        .iter()
        .filter(|(id, v)| [4, 5].contains(id) && v["event"] == "left")
        .map(|(_, v)| v["compute_ms"].as_f64().unwrap_or(0.0))
        .sum();
    assert!(cpp_ms > 0.0, "the C++ relays computed nothing");
    println!(
        "test: stages 1 and 2, iterations 0..{ITERS}: every C++ relay's digest equals its gwtf node replica's"
    );
    // The holders trained: every iteration final, the loss falls.
    for holder in [1, 2] {
        let losses: Vec<f64> = seen
            .iter()
            .filter(|(id, v)| *id == holder && v["event"] == "iteration")
            .map(|(_, v)| v["loss"].as_f64().unwrap())
            .collect();
        assert_eq!(losses.len(), ITERS as usize, "holder {holder}: {losses:?}");
        assert!(
            losses[ITERS as usize - 1] < losses[0],
            "holder {holder}: the loss did not fall: {losses:?}"
        );
    }
    assert!(
        !seen
            .iter()
            .any(|(_, v)| v["event"] == "error" || v["event"] == "task_failed"),
        "an error in the mixed swarm"
    );
}

/// A C++ relay with memory for one microbatch whose trainer recomputes
/// (`recompute` in its options) is its stage's only relay, so every
/// microbatch goes through it: forwards beyond its memory keep nothing
/// (`GWTF_TASK_KIND_DISCARD`) and run again before their backwards (which
/// fail, nothing kept, if they do not). The holders' losses are those of
/// the same swarm whose relay has memory to spare.
#[test]
fn a_cpp_relay_short_of_memory_recomputes_and_trains_the_same() {
    let Some((_turn, cpp, dir, key)) = prepare("swarm_stage") else {
        return;
    };
    const ITERS: u32 = 4;
    const RELAY: u32 = 3;
    let layout: [(u32, u16, bool); 4] = [
        (1, 0, false),
        (2, 0, false),
        (RELAY, 1, true),
        (4, 2, false),
    ];
    let run = |name: &str, short: bool| {
        let sub = dir.path().join(name);
        std::fs::create_dir_all(&sub).unwrap();
        let extra = |id: u32| {
            if short && id == RELAY {
                // 1 MiB of memory, 1 MiB a microbatch.
                [
                    "--memory-mb",
                    "1",
                    "--microbatch-bytes",
                    "1048576",
                    "--recompute",
                ]
                .map(String::from)
                .to_vec()
            } else {
                Vec::new()
            }
        };
        let seen = mixed_swarm(&cpp, &sub, &key, &layout, ITERS, &extra);
        assert!(
            !seen
                .iter()
                .any(|(_, v)| v["event"] == "error" || v["event"] == "task_failed"),
            "{name}: an error"
        );
        let discards = seen.iter().filter(|(_, v)| v["event"] == "discard").count();
        let losses: BTreeMap<(u32, u64), f64> = seen
            .iter()
            .filter(|(_, v)| v["event"] == "iteration")
            .map(|(id, v)| {
                (
                    (*id, v["iteration"].as_u64().unwrap()),
                    v["loss"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(losses.len(), 2 * ITERS as usize, "{name}: {losses:?}");
        (discards, losses)
    };
    let (none, roomy) = run("roomy", false);
    let (discards, short) = run("short", true);
    assert_eq!(none, 0, "a relay with memory to spare dropped a forward");
    assert!(
        discards > 0,
        "the relay short of memory recomputed no forward"
    );
    for (k, want) in &roomy {
        let got = short[k];
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
            "holder {} iteration {}: loss {got} with recompute, {want} without",
            k.0,
            k.1
        );
    }
    println!(
        "test: {discards} forwards recomputed by the C++ relay; the holders' {} losses equal the roomy run's",
        roomy.len()
    );
}
