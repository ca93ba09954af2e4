//! A relay whose network link is cut: swarms of `gwtf node` processes, one
//! per network namespace, joined through a bridge by rate-limited links
//! (tests/common/netns.rs): 2 data holders and 2 relays for each of the 2
//! relay stages of llama-tiny cut into 4.
//!
//! - A relay's link goes down for 3 s, and for 15 s, once it applied
//!   iteration 2, then up again. The run must finish (every holder prints
//!   `done` and exits; every relay leaves on SIGTERM); no node reports an
//!   error, every (stage, iteration) that nodes applied has one weights
//!   digest and every microbatch is counted once per stage (`check_run`);
//!   the swarm never goes longer without a final iteration than the stall
//!   bound (5 s, or three of its first iteration times on a slow machine);
//!   the cut relay applies an update again within 10 s of link-up (it
//!   fences itself while cut off and comes back through the join path).
//!   Printed: its fences and state downloads, the time from link-up to its
//!   first update, the longest time without a final iteration, the
//!   iterations/s and the test's wall time.
//!
//! Each test has its own namespaces (tagged), its own /24 and, for the
//! cuts, a blackhole route for it in the root namespace while it runs. One
//! swarm runs at a time in this binary (six processes are load enough for
//! two cores). On a failure the run's timeline is printed and written to
//! `timeline.txt` beside the nodes' logs (`GWTF_LOG=1`). Needs root and
//! `ip` / `tc`; elsewhere the tests are skipped visibly
//! (tests/common/skip.rs).
mod common;

use common::netns::{Lab, NetSwarm, Unavailable};
use common::skip;
use common::swarm_procs::{check_run, llama_tiny_args, Seen};
use common::timeline::{iterations_per_s, longest_gap, stall_bound};
use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const MB: u32 = 3;
const SEED: u64 = 5;
/// (id, stage): 2 data holders, 2 relays in each relay stage.
const LAYOUT: [(u32, u16); 6] = [(1, 0), (2, 0), (11, 1), (12, 1), (21, 2), (22, 2)];
/// Every link, in each direction.
const LINK: &[&str] = &["rate", "20mbit", "burst", "32kb", "latency", "200ms"];
/// The link is cut once the victim applied this iteration.
const CUT_AFTER: u64 = 2;
/// Generous bounds: a debug build on a loaded 2-core machine.
const RUN_DEADLINE: Duration = Duration::from_secs(300);
const EXIT_DEADLINE: Duration = Duration::from_secs(30);
/// From link-up to the cut relay's first update after it.
const BACK_WITHIN: Duration = Duration::from_secs(10);
const KEY: &str = "0123456789abcdef-netns-cut-swarm-key\n";

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn ids(layout: &[(u32, u16)]) -> Vec<u32> {
    layout.iter().map(|n| n.0).collect()
}

/// The namespaces of `layout`, or None when the test is skipped here.
fn lab(tag: &str, subnet: &str, layout: &[(u32, u16)]) -> Option<Lab> {
    match Lab::start(tag, subnet, &ids(layout), LINK) {
        Ok(lab) => Some(lab),
        Err(Unavailable::Skip(why)) => {
            skip::skipped(&why);
            None
        }
        Err(Unavailable::Fail(e)) => panic!("{e}"),
    }
}

/// `check_run` over a finished run; on failure the run's timeline and the
/// nodes' logs are printed first.
fn check(swarm: &NetSwarm, ev: &[Seen], iterations: u32) {
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| check_run(ev, iterations, MB, 2)));
    if let Err(p) = r {
        eprintln!("{}", swarm.evidence());
        std::panic::resume_unwind(p);
    }
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// Cuts `victim`'s link for `cut` once it applied iteration
/// [`CUT_AFTER`], restores it, and checks the run (see the module's
/// documentation).
fn cut_and_restore(tag: &str, subnet: &str, victim: u32, cut: Duration, iterations: u32) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let Some(mut lab) = lab(tag, subnet, &LAYOUT) else {
        return;
    };
    lab.hold_blackhole()
        .unwrap_or_else(|e| panic!("cannot hold a blackhole route: {e}"));
    let args = llama_tiny_args(iterations, MB, SEED, &[]);
    let name = format!("swarm-netns-cut-{tag}");
    let mut swarm = NetSwarm::start(lab, &name, KEY, &LAYOUT, &args, RUN_DEADLINE);
    swarm.until(
        &format!("node {victim} applying iteration {CUT_AFTER}"),
        |ev| {
            ev.iter().any(|e| {
                e.node == victim && e.event() == "applied" && e.u("iteration") >= CUT_AFTER
            })
        },
    );
    if let Err(e) = swarm.lab.cut(victim) {
        swarm.fail(&format!("cannot cut node {victim}'s link: {e}"));
    }
    let down = Instant::now();
    swarm.wait(cut);
    if let Err(e) = swarm.lab.restore(victim) {
        swarm.fail(&format!("cannot restore node {victim}'s link: {e}"));
    }
    let up = Instant::now();
    let ev = swarm.finish(EXIT_DEADLINE);
    let wall = started.elapsed();

    // The figures first: a failure below still shows them.
    let mine = |what: &'static str| {
        ev.iter()
            .filter(move |e| e.node == victim && e.event() == what)
    };
    let since = |t: Instant, e: &Seen| {
        if e.at >= t {
            format!("+{}", secs(e.at - t))
        } else {
            format!("-{}", secs(t - e.at))
        }
    };
    let fences: Vec<String> = mine("fenced")
        .map(|e| format!("{} after the cut: {}", since(down, e), e.v["reason"]))
        .collect();
    let downloads: Vec<String> = mine("state_download")
        .map(|e| format!("{} after link-up from {}", since(up, e), e.v["from"]))
        .collect();
    let back = mine("applied").find(|e| e.at > up);
    let (gap, gap_at) = longest_gap(&ev);
    let bound = stall_bound(&ev);
    eprintln!(
        "swarm_netns_cut: node {victim} cut {}: fenced {fences:?}; state downloads {downloads:?}; \
         first update after link-up: {}; longest gap without a final iteration {} \
         (ending at iteration {gap_at}; bound {}); {:.2} iterations/s; test wall time {}",
        secs(cut),
        back.map_or("none".into(), |e| format!(
            "{} (iteration {})",
            secs(e.at - up),
            e.u("iteration")
        )),
        secs(gap),
        secs(bound),
        iterations_per_s(&ev).unwrap_or(0.0),
        secs(wall),
    );

    swarm.assert_exits();
    check(&swarm, &ev, iterations);
    if gap > bound {
        swarm.fail(&format!(
            "the swarm went {} without a final iteration (bound {})",
            secs(gap),
            secs(bound)
        ));
    }
    let Some(back) = back else {
        let end = ev
            .iter()
            .filter(|e| e.event() == "done")
            .map(|e| e.at)
            .min();
        let after = end.map_or(Duration::ZERO, |t| t.saturating_duration_since(up));
        if after < 2 * BACK_WITHIN {
            swarm.fail(&format!(
                "the run ended {} after link-up, too soon to tell whether node {victim} \
                 comes back: give it more iterations",
                secs(after)
            ));
        }
        swarm.fail(&format!(
            "node {victim} applied no update after its link came back \
             (the holders went on for {} after link-up)",
            secs(after)
        ));
    };
    if back.at - up > BACK_WITHIN {
        swarm.fail(&format!(
            "node {victim} applied its first update {} after link-up (bound {})",
            secs(back.at - up),
            secs(BACK_WITHIN)
        ));
    }
}

#[test]
fn a_relay_cut_off_for_3_s_is_a_member_again_and_nothing_diverges() {
    cut_and_restore("cutthree", "10.77.1", 12, Duration::from_secs(3), 80);
}

#[test]
fn a_relay_cut_off_for_15_s_is_a_member_again_and_nothing_diverges() {
    // Longer than the transport's peer timeout (5 s): every connection of
    // the relay fails and its dialling gives up while the link is down; as
    // a joiner that takes every peer for dead it asks them all again.
    cut_and_restore("cutfifteen", "10.77.2", 22, Duration::from_secs(15), 120);
}
