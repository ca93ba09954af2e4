//! A swarm of `gwtf node` processes, one per network namespace, joined
//! through a bridge in a hub namespace by rate-limited links (tbf on both
//! ends of every veth pair): 2 data holders and 2 relays for each of the 2
//! relay stages of llama-tiny cut into 4 stages. One relay is SIGKILLed
//! mid-run; the holders must still finish, every committed stage-iteration
//! must count each microbatch exactly once, the replicas of a stage must
//! report the same weights after every update, and the loss must fall.
//!
//! Needs root and `ip` / `tc` (iproute2); elsewhere the test is skipped
//! visibly (tests/common/skip.rs) with the reason.
mod common;

use common::netns::{wait_exit, Lab, Unavailable};
use common::skip;
use common::swarm_procs::Seen;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

const ITERATIONS: u32 = 10;
const MICROBATCHES: u32 = 4;
const HOLDERS: [u32; 2] = [1, 2];
/// (id, stage) of the relays.
const RELAYS: [(u32, u32); 4] = [(11, 1), (12, 1), (21, 2), (22, 2)];
/// The nodes' /24.
const SUBNET: &str = "10.77.0";
/// Every link, in each direction: a token bucket (tbf; netem is not
/// available everywhere).
const TBF: &[&str] = &["rate", "20mbit", "burst", "32kb", "latency", "200ms"];
/// Kill the victim once holder 1 reports this iteration final.
const KILL_AFTER_ITERATION: u64 = 2;
/// Generous bounds: a debug build on a loaded 2-core machine.
const RUN_DEADLINE: Duration = Duration::from_secs(300);
const EXIT_DEADLINE: Duration = Duration::from_secs(30);

/// What one node printed (a JSON object per line), in order.
type Line = (u32, Value);

/// What every node is started with.
struct Launch {
    /// `--peer ID/STAGE/ADDR` for every founding member.
    peers: Vec<String>,
    key: std::path::PathBuf,
    /// Where each node's stderr goes.
    log_dir: std::path::PathBuf,
    tx: Sender<Seen>,
}

fn spawn_node(lab: &mut Lab, l: &Launch, id: u32, role: &[String], addr: &str) {
    let mut args: Vec<String> = vec![
        "--listen".into(),
        addr.into(),
        "--chosen-id".into(),
        id.to_string(),
        "--swarm-key-file".into(),
        l.key.display().to_string(),
    ];
    args.extend(l.peers.iter().cloned());
    args.extend(role.iter().cloned());
    for a in [
        "--stages",
        "4",
        "--model",
        "llama-tiny",
        "--iterations",
        &ITERATIONS.to_string(),
        "--microbatches",
        &MICROBATCHES.to_string(),
        "--json",
        "--log",
    ] {
        args.push(a.to_string());
    }
    lab.spawn(id, &args, &l.log_dir, &l.tx);
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("no number {k:?} in {v}"))
}

fn ev(v: &Value) -> &str {
    v["event"].as_str().unwrap_or("")
}

#[test]
fn a_swarm_across_namespaces_survives_a_killed_relay() {
    let ids: Vec<u32> = HOLDERS
        .iter()
        .copied()
        .chain(RELAYS.iter().map(|r| r.0))
        .collect();
    let mut lab = match Lab::start("", SUBNET, &ids, TBF) {
        Ok(lab) => lab,
        Err(Unavailable::Skip(why)) => {
            skip::skipped(&why);
            return;
        }
        Err(Unavailable::Fail(e)) => panic!("{e}"),
    };
    let addrs = lab.addrs.clone();
    let pid = std::process::id();
    let dir = common::scratch(&format!("swarm-netns-{pid}"));
    let key = dir.join("key");
    std::fs::write(&key, "0123456789abcdef-netns-swarm-key\n").unwrap();
    let stage_of = |id: u32| -> u32 { RELAYS.iter().find(|r| r.0 == id).map_or(0, |r| r.1) };
    let mut peers = Vec::new();
    for &id in &ids {
        peers.push("--peer".to_string());
        peers.push(format!("{id}/{}/{}", stage_of(id), addrs[&id]));
    }
    let (tx, rx) = channel::<Seen>();
    let launch = Launch {
        peers,
        key,
        log_dir: dir.clone(),
        tx,
    };
    for &id in &ids {
        let role: Vec<String> = if stage_of(id) == 0 {
            vec!["--holder".into()]
        } else {
            vec!["--stage".into(), stage_of(id).to_string()]
        };
        spawn_node(&mut lab, &launch, id, &role, &addrs[&id]);
    }
    drop(launch);

    let mut lines: Vec<Line> = Vec::new();
    let mut done: BTreeSet<u32> = BTreeSet::new();
    let mut victim: Option<u32> = None;
    let deadline = Instant::now() + RUN_DEADLINE;
    let summary = |lines: &[Line]| -> String {
        let mut s = String::new();
        for (id, v) in lines.iter().rev().take(40).rev() {
            s.push_str(&format!("\n  {id}: {v}"));
        }
        s
    };
    while done.len() < HOLDERS.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let (id, v) = match rx.recv_timeout(left) {
            Ok(l) => (l.node, l.v),
            Err(RecvTimeoutError::Timeout) => panic!(
                "the holders did not finish within {RUN_DEADLINE:?} (done: {done:?}); \
                 node logs in {}; last lines:{}",
                dir.display(),
                summary(&lines)
            ),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("every node's output ended; last lines:{}", summary(&lines))
            }
        };
        match ev(&v) {
            "done" => {
                done.insert(id);
            }
            "iteration"
                if id == HOLDERS[0]
                    && victim.is_none()
                    && u(&v, "iteration") >= KILL_AFTER_ITERATION =>
            {
                // The stage-1 relay that carried the most microbatches so far.
                let mut by: BTreeMap<u64, usize> = BTreeMap::new();
                for (_, c) in lines.iter().filter(|(_, c)| ev(c) == "committed") {
                    if u(c, "stage") == 1 {
                        for m in c["mbs"].as_array().unwrap() {
                            *by.entry(m[2].as_u64().unwrap()).or_default() += 1;
                        }
                    }
                }
                let v = by
                    .iter()
                    .max_by_key(|(id, n)| (**n, std::cmp::Reverse(**id)))
                    .map_or(RELAYS[0].0, |(id, _)| *id as u32);
                assert!(done.is_empty(), "a holder finished before the kill");
                lab.child(v).kill().unwrap();
                victim = Some(v);
            }
            _ => {}
        }
        lines.push((id, v));
    }
    let victim = victim.expect("holder 1 reported no iteration to kill after");
    for h in HOLDERS {
        let s = wait_exit(lab.child(h), EXIT_DEADLINE)
            .unwrap_or_else(|| panic!("holder {h} printed done but did not exit"));
        assert!(s.success(), "holder {h} exited with {s}");
    }
    // The surviving relays run until told to leave.
    for (id, _) in RELAYS {
        if id != victim {
            // SAFETY: kill(2) on a child of ours that has not been reaped.
            unsafe {
                libc::kill(lab.child(id).id() as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    for (id, _) in RELAYS {
        let s = wait_exit(lab.child(id), EXIT_DEADLINE)
            .unwrap_or_else(|| panic!("relay {id} did not exit within {EXIT_DEADLINE:?}"));
        if id != victim {
            assert!(s.success(), "relay {id} exited with {s} after SIGTERM");
        }
    }
    // Every process has exited: the readers see the end of their output.
    let rest_deadline = Instant::now() + EXIT_DEADLINE;
    loop {
        match rx.recv_timeout(rest_deadline.saturating_duration_since(Instant::now())) {
            Ok(l) => lines.push((l.node, l.v)),
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => panic!("node output did not end"),
        }
    }
    let of = |e: &'static str| lines.iter().filter(move |(_, v)| ev(v) == e);

    // Nothing went wrong that the nodes noticed.
    let errors: Vec<String> = of("error")
        .chain(of("unparsed"))
        .map(|(id, v)| format!("{id}: {v}"))
        .collect();
    assert!(errors.is_empty(), "errors: {errors:#?}");
    // The crash was seen.
    assert!(
        of("peer_lost").any(|(id, v)| *id != victim && u(v, "peer") == victim as u64),
        "no survivor reported {victim} lost"
    );

    // Exactly once: each committed stage-iteration holds every microbatch
    // of every holder once, computed by a member of that stage.
    // (stage, iteration) -> the (holder, index) sets of its commits.
    type Mbs = BTreeSet<(u64, u64)>;
    let mut commits: BTreeMap<(u64, u64), Vec<Mbs>> = BTreeMap::new();
    for (id, v) in of("committed") {
        let (stage, k) = (u(v, "stage"), u(v, "iteration"));
        assert_eq!(u(v, "dropped"), 0, "{id}: {v}");
        let mut set = BTreeSet::new();
        for m in v["mbs"].as_array().unwrap() {
            let (h, i, by) = (
                m[0].as_u64().unwrap(),
                m[1].as_u64().unwrap(),
                m[2].as_u64(),
            );
            assert!(
                HOLDERS.contains(&(h as u32)) && i < MICROBATCHES as u64,
                "{id}: unknown microbatch {m} in {v}"
            );
            let by = by.unwrap() as u32;
            let member = if stage == 0 {
                by == h as u32
            } else {
                stage_of(by) as u64 == stage
            };
            assert!(
                member,
                "{id}: {m} computed by {by}, not of stage {stage}: {v}"
            );
            assert!(set.insert((h, i)), "{id}: {m} counted twice in {v}");
        }
        assert_eq!(
            set.len(),
            HOLDERS.len() * MICROBATCHES as usize,
            "{id}: stage {stage} iteration {k} committed {} microbatches: {v}",
            set.len()
        );
        commits.entry((stage, k)).or_default().push(set);
    }
    for stage in 0..=2u64 {
        for k in 0..ITERATIONS as u64 {
            let c = commits.get(&(stage, k));
            assert!(c.is_some(), "stage {stage} iteration {k}: never committed");
            let c = c.unwrap();
            assert!(
                c.windows(2).all(|w| w[0] == w[1]),
                "stage {stage} iteration {k}: commits disagree: {c:?}"
            );
        }
    }

    // Replicas agree after every update.
    let mut digests: BTreeMap<(u64, u64), BTreeMap<u32, String>> = BTreeMap::new();
    for (id, v) in of("applied") {
        let d = v["weights_sha256"].as_str().unwrap().to_string();
        digests
            .entry((u(v, "stage"), u(v, "iteration")))
            .or_default()
            .insert(*id, d);
    }
    for ((stage, k), by_node) in &digests {
        let distinct: BTreeSet<&String> = by_node.values().collect();
        assert_eq!(
            distinct.len(),
            1,
            "stage {stage} iteration {k}: replicas hold different weights: {by_node:?}"
        );
    }
    // Not vacuous: the replicas were compared at every iteration but the
    // last (a holder exits at `done`, a relay at SIGTERM, maybe before
    // printing it); the victim's stage up to the kill.
    let victim_stage = stage_of(victim) as u64;
    for stage in 0..=2u64 {
        let upto = if stage == victim_stage {
            KILL_AFTER_ITERATION - 1
        } else {
            ITERATIONS as u64 - 1
        };
        for k in 0..upto {
            let n = digests.get(&(stage, k)).map_or(0, |d| d.len());
            assert!(
                n >= 2,
                "stage {stage} iteration {k}: applied by {n} replicas: {:?}",
                digests.get(&(stage, k))
            );
        }
    }

    // Every iteration is final at both holders, with all their
    // microbatches, and the loss falls.
    let mut losses: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for (id, v) in of("iteration") {
        assert_eq!(u(v, "microbatches"), MICROBATCHES as u64, "{id}: {v}");
        losses
            .entry(u(v, "iteration"))
            .or_default()
            .push(v["loss"].as_f64().unwrap());
    }
    for k in 0..ITERATIONS as u64 {
        let n = losses.get(&k).map_or(0, |l| l.len());
        assert_eq!(n, HOLDERS.len(), "iteration {k}: {n} holders reported it");
    }
    let mean = |k: u64| losses[&k].iter().sum::<f64>() / losses[&k].len() as f64;
    let (first, last) = (mean(0), mean(ITERATIONS as u64 - 1));
    assert!(
        last < 0.9 * first,
        "the loss did not fall: {first} -> {last}"
    );
    eprintln!(
        "swarm_netns: killed relay {victim} after iteration {KILL_AFTER_ITERATION}; \
         loss {first:.3} -> {last:.3}; {} recoveries",
        of("recovered").count()
    );
}
