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
use common::timeline::{longest_gap, stall_bound, timeline};
use std::time::{Duration, Instant};

const ITERATIONS: u32 = 40;
const MB: u32 = 3;

/// As in the probes (about 7 iterations/s in a release build).
fn common_args(iterations: u32) -> Vec<String> {
    llama_tiny_args(iterations, MB, 5, &["--link-delay-ms", "8"])
}

fn layout() -> Vec<(u32, u16)> {
    two_holders_and_two_by_three_relays()
}

fn start(iterations: u32) -> Swarm {
    let args = common_args(iterations);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut swarm = Swarm::start(&layout(), &args, &[]);
    // Longer runs get longer (at least 2 iterations/s on a loaded host).
    swarm.deadline = Instant::now() + Duration::from_secs(240.max(iterations as u64 / 2));
    swarm
}

/// Pauses `victim` for `pause` right after the swarm applied iteration
/// `after`, then checks the run.
fn pause_after_applied(victim: u32, after: u64, pause: Duration, iterations: u32) -> Vec<Seen> {
    pause_when(
        victim,
        iterations,
        &format!("iteration {after} applied at node {victim}"),
        |ev| {
            ev.iter()
                .any(|e| e.node == victim && e.event() == "applied" && e.u("iteration") >= after)
        },
        pause,
    )
}

/// Pauses `victim` for `pause` as soon as the events so far satisfy `at`
/// (`what` says how), then checks the run.
fn pause_when(
    victim: u32,
    iterations: u32,
    what: &str,
    at: impl Fn(&[Seen]) -> bool,
    pause: Duration,
) -> Vec<Seen> {
    let mut swarm = start(iterations);
    swarm.until(what, at);
    swarm.pause(victim, pause);
    let ev = swarm.until_done(&[1, 2]);
    check_run(&ev, iterations, MB, 2);
    let (gap, _) = longest_gap(&ev);
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

/// Pauses `victim` as [`pause_after_applied`] does and checks that it
/// fenced itself and came back (applied an update or downloaded the state
/// after its fence).
fn pause_and_come_back(victim: u32, pause: Duration) {
    // The run outlasts the pause (a debug build trains 2-3 iterations/s
    // here, a release build about 7): the node comes back to a swarm
    // still training, not to one whose other holder finished the run
    // during the pause.
    let per_s = if cfg!(debug_assertions) { 4 } else { 14 };
    let iterations = ITERATIONS.max(per_s * pause.as_secs() as u32 + 40);
    let ev = pause_after_applied(victim, 2, pause, iterations);
    came_back(&ev, victim);
}

/// Checks that `victim` fenced itself and came back (applied an update or
/// downloaded the state after its fence).
fn came_back(ev: &[Seen], victim: u32) {
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
fn a_relay_paused_60_s_after_an_update_rejoins_and_nothing_diverges() {
    pause_and_come_back(13, Duration::from_secs(60));
}

#[test]
fn a_relay_paused_10_s_in_its_stages_all_reduce_rejoins_and_nothing_diverges() {
    // Its gradient sum is done: the all-reduce of that commit is running
    // (a few milliseconds on loopback) when it stops.
    let ev = pause_when(
        21,
        ITERATIONS,
        "node 21's gradient sum after it applied iteration 2",
        |ev| {
            let applied = ev
                .iter()
                .position(|e| e.node == 21 && e.event() == "applied" && e.u("iteration") >= 2);
            applied.is_some_and(|i| {
                ev[i..].iter().any(|e| {
                    e.node == 21
                        && e.event() == "work"
                        && e.s("kind") == "gradient"
                        && e.s("phase") == "end"
                })
            })
        },
        Duration::from_secs(10),
    );
    came_back(&ev, 21);
}

#[test]
fn a_data_holder_paused_2_s_trains_on_and_ends_with_done() {
    // Node 2 is not the holders' coordinator; the other holder never waits
    // for it beyond the detection time, and it prints `done` (until_done).
    pause_and_come_back(2, Duration::from_secs(2));
}

#[test]
fn a_stage_coordinator_paused_2_s_rejoins_and_nothing_diverges() {
    // Node 11 coordinates stage 1 (the smallest id of the founding group) and
    // serves its state; the stage goes on under another coordinator.
    pause_and_come_back(11, Duration::from_secs(2));
}

#[test]
fn the_holders_coordinator_paused_10_s_trains_on_and_ends_with_done() {
    // Node 1 coordinates the holders' stage (its barrier opens and closes
    // every iteration): the other holder trains on under its own
    // coordination, and node 1 comes back or ends with an error.
    pause_and_come_back(1, Duration::from_secs(10));
}

#[test]
fn a_data_holder_paused_past_the_end_of_the_run_ends_with_an_error() {
    // Node 2 sleeps until the other holder has finished the run and left:
    // on waking it fences itself and finds no holder to download the
    // holders' state from; it must not wait for ever (the probe:
    // it never printed `done` and never ended).
    let mut swarm = start(ITERATIONS);
    swarm.until("iteration 2 applied at node 2", |ev| {
        ev.iter()
            .any(|e| e.node == 2 && e.event() == "applied" && e.u("iteration") >= 2)
    });
    swarm.signal_pause(2, true);
    swarm.until("node 1's done", |ev| {
        ev.iter().any(|e| e.node == 1 && e.event() == "done")
    });
    let woke = Instant::now();
    swarm.signal_pause(2, false);
    let status = swarm.wait_exit(2);
    let ev = swarm.snapshot();
    let error = ev
        .iter()
        .find(|e| e.node == 2 && e.event() == "error")
        .map(|e| e.v["message"].as_str().unwrap_or("").to_string());
    eprintln!(
        "node 2 woke after the run and exited {status} {:.1} s later: {error:?}",
        woke.elapsed().as_secs_f64()
    );
    assert!(!status.success(), "node 2 exited 0 without training on");
    let error = error.expect("node 2 printed an error");
    assert!(
        error.contains("no live node of stage 0"),
        "the error says why: {error}"
    );
}
