//! Partial failures of `gwtf node` processes on loopback: a node paused
//! (SIGSTOP, then SIGCONT) with its connections open, as a laptop whose lid
//! closes or a starved machine. After each run: it finished, every
//! (stage, iteration) that nodes applied has one weights digest, every
//! microbatch was counted exactly once per stage, the paused node fenced
//! itself and came back through the join path, and the swarm never stood
//! still longer than the stall bound.
mod common;

use common::swarm_procs::{
    check_run, llama_tiny_args, two_holders_and_two_by_three_relays, Seen, Swarm,
};
use std::time::{Duration, Instant};

const ITERATIONS: u32 = 40;
const MB: u32 = 3;

/// As in the probes: about 7 iterations/s on this machine.
fn common_args(iterations: u32) -> Vec<String> {
    llama_tiny_args(iterations, MB, 5, &["--link-delay-ms", "8"])
}

fn layout() -> Vec<(u32, u16)> {
    two_holders_and_two_by_three_relays()
}

fn start(extra: &[(u32, &[&str])]) -> Swarm {
    let args = common_args(ITERATIONS);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut swarm = Swarm::start(&layout(), &args, extra);
    swarm.deadline = Instant::now() + Duration::from_secs(240);
    swarm
}

/// The longest time between two iterations becoming final (any holder's
/// `iteration` line), from the first one on.
fn longest_gap(ev: &[Seen]) -> Duration {
    let mut finals: Vec<(u64, Instant)> = Vec::new();
    for e in ev.iter().filter(|e| e.event() == "iteration") {
        let k = e.u("iteration");
        if !finals.iter().any(|(j, _)| *j == k) {
            finals.push((k, e.at));
        }
    }
    finals.sort();
    finals
        .windows(2)
        .map(|w| w[1].1.saturating_duration_since(w[0].1))
        .max()
        .unwrap_or_default()
}

/// The stall bound of the issue: 5 s, or three of the run's own
/// iteration times where those are longer (this machine is shared).
fn stall_bound(ev: &[Seen]) -> Duration {
    let mut finals: Vec<Instant> = ev
        .iter()
        .filter(|e| e.event() == "iteration" && e.u("iteration") <= 2)
        .map(|e| e.at)
        .collect();
    finals.sort();
    let normal = match (finals.first(), finals.last()) {
        (Some(a), Some(b)) if finals.len() > 1 => b.saturating_duration_since(*a) / 2,
        _ => Duration::ZERO,
    };
    Duration::from_secs(5).max(3 * normal)
}

/// Pauses `victim` for `pause` right after the swarm applied iteration
/// `after`, then checks the run.
fn pause_after_applied(victim: u32, after: u64, pause: Duration) -> Vec<Seen> {
    let mut swarm = start(&[]);
    swarm.until(
        &format!("iteration {after} applied at node {victim}"),
        |ev| {
            ev.iter()
                .any(|e| e.node == victim && e.event() == "applied" && e.u("iteration") >= after)
        },
    );
    swarm.pause(victim, pause);
    let ev = swarm.until_done(&[1, 2]);
    check_run(&ev, ITERATIONS, MB, 2);
    let gap = longest_gap(&ev);
    let bound = stall_bound(&ev);
    eprintln!("paused node {victim} {pause:?}: longest gap {gap:?} (bound {bound:?})");
    if gap > bound {
        for n in layout() {
            eprintln!("node {} stderr:\n{}", n.0, swarm.stderr(n.0));
        }
    }
    assert!(
        gap <= bound,
        "the swarm stood still {gap:?} (bound {bound:?})\n{}",
        timeline(&ev)
    );
    ev
}

/// The run's event lines in time order, without the chatty ones: what a
/// failure report shows.
fn timeline(ev: &[Seen]) -> String {
    let Some(t0) = ev.iter().map(|e| e.at).min() else {
        return String::new();
    };
    let mut v: Vec<&Seen> = ev
        .iter()
        .filter(|e| !matches!(e.event(), "work" | "stats" | "mb_done"))
        .collect();
    v.sort_by_key(|e| e.at);
    v.iter()
        .map(|e| {
            let t = e.at.saturating_duration_since(t0).as_secs_f64();
            format!("{t:8.3} node {:>2} {}\n", e.node, e.v)
        })
        .collect()
}

/// Pauses `victim` as [`pause_after_applied`] does and checks that it
/// fenced itself and came back (applied an update or downloaded the state
/// after its fence).
fn pause_and_come_back(victim: u32, pause: Duration) {
    let ev = pause_after_applied(victim, 2, pause);
    let fence = ev
        .iter()
        .position(|e| e.node == victim && e.event() == "fenced");
    let back = fence.is_some_and(|at| {
        ev[at..]
            .iter()
            .any(|e| e.node == victim && matches!(e.event(), "applied" | "state_download"))
    });
    assert!(back, "node {victim} did not fence itself and come back");
}

#[test]
fn a_relay_paused_2_s_after_an_update_rejoins_and_nothing_diverges() {
    pause_and_come_back(12, Duration::from_secs(2));
}

#[test]
fn a_relay_paused_10_s_after_an_update_rejoins_and_nothing_diverges() {
    pause_and_come_back(22, Duration::from_secs(10));
}

#[test]
fn a_data_holder_paused_2_s_trains_on_and_ends_with_done() {
    // Node 2 is not the holders' coordinator; the other holder never waits
    // for it beyond the detection time, and it prints `done` (until_done).
    pause_and_come_back(2, Duration::from_secs(2));
}
