//! `gwtf node` processes on loopback, SIGKILLed in the middle of a forward,
//! a backward, an aggregation; a data holder killed. After each run: every
//! microbatch of every committed iteration was counted exactly once per
//! stage and none was lost, the replicas of each stage agree after every
//! update, nothing hangs, and (where no data holder died, so the
//! microbatches are the same) the loss of every iteration equals the
//! single-process reference's.
mod common;

use common::swarm_procs::{
    check_run, llama_tiny_args, llama_tiny_reference, two_holders_and_two_by_three_relays, Swarm,
};

const ITERATIONS: u32 = 8;
const MB: u32 = 3;
const SEED: u64 = 5;

fn common_args(iterations: u32) -> Vec<String> {
    llama_tiny_args(iterations, MB, SEED, &[])
}

fn layout() -> Vec<(u32, u16)> {
    two_holders_and_two_by_three_relays()
}

fn start(extra: &[(u32, &[&str])]) -> Swarm {
    start_for(ITERATIONS, extra)
}

fn start_for(iterations: u32, extra: &[(u32, &[&str])]) -> Swarm {
    let args = common_args(iterations);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Swarm::start(&layout(), &args, extra)
}

/// The reference losses of this run's microbatches (both holders train on
/// the generated corpus of `gwtf node`'s default).
fn reference(iterations: u32) -> Vec<f32> {
    llama_tiny_reference(iterations, MB, SEED)
}

/// Every iteration's loss equals the reference's to float tolerance: a
/// crash changes who computes a microbatch, never what (a microbatch redone
/// after its stage's update runs on the weights from before the update).
fn assert_reference(losses: &[f64]) {
    let want = reference(losses.len() as u32);
    for (k, (got, w)) in losses.iter().zip(&want).enumerate() {
        let w = *w as f64;
        assert!(
            (got - w).abs() <= 1e-4 * w.abs(),
            "iteration {k}: swarm {got} reference {w}"
        );
    }
    assert!(want[want.len() - 1] < want[0]);
}

/// Kills a relay of `stage` while it is in the middle of a `kind` work
/// (every relay of the stage is slowed in that kind, so the kill lands
/// inside it), after the swarm finished its first iteration.
fn kill_mid(stage: u16, kind: &str) {
    let slow = format!("{kind}=300");
    let relays: Vec<u32> = layout()
        .into_iter()
        .filter(|(_, s)| *s == stage)
        .map(|(id, _)| id)
        .collect();
    let args: &[&str] = &["--slow-work", &slow];
    let extra: Vec<(u32, &[&str])> = relays.iter().map(|&id| (id, args)).collect();
    let mut swarm = start(&extra);
    swarm.until("iteration 1", |ev| {
        ev.iter()
            .any(|e| e.event() == "iteration" && e.u("iteration") >= 1)
    });
    let after = swarm.count();
    let ev = swarm.until(&format!("a stage-{stage} relay starting {kind}"), |ev| {
        ev.iter().skip(after).any(|e| {
            relays.contains(&e.node)
                && e.event() == "work"
                && e.v["kind"] == kind
                && e.v["phase"] == "start"
        })
    });
    let victim = ev
        .iter()
        .skip(after)
        .find(|e| relays.contains(&e.node) && e.event() == "work" && e.v["kind"] == kind)
        .unwrap()
        .node;
    swarm.kill(victim);
    let ev = swarm.until_done(&[1, 2]);
    let losses = check_run(&ev, ITERATIONS, MB, 2);
    assert!(
        ev.iter()
            .any(|e| e.event() == "peer_lost" && e.u("peer") == victim as u64),
        "nobody noticed the crash"
    );
    assert_reference(&losses);
}

#[test]
fn a_relay_killed_mid_forward_is_survived() {
    kill_mid(1, "forward");
}

#[test]
fn a_relay_killed_mid_backward_is_survived() {
    kill_mid(2, "backward");
}

#[test]
fn a_relay_killed_mid_aggregation_is_survived() {
    kill_mid(1, "gradient");
}

#[test]
fn a_data_holder_killed_is_survived() {
    let mut swarm = start(&[]);
    swarm.until("iteration 2", |ev| {
        ev.iter()
            .any(|e| e.event() == "iteration" && e.u("iteration") >= 2)
    });
    swarm.kill(2);
    let ev = swarm.until_done(&[1]);
    let losses = check_run(&ev, ITERATIONS, MB, 2);
    assert!(losses[ITERATIONS as usize - 1] < losses[0], "{losses:?}");
}
/// A node joins; the member serving its state download is killed in the
/// middle of exporting it; the joiner gets the state elsewhere and trains
/// with bit-identical weights. Then a relay leaves gracefully.
#[test]
fn a_killed_state_server_and_a_graceful_leave_are_survived() {
    let slow: &[&str] = &["--slow-work", "export_state=500"];
    let extra: Vec<(u32, &[&str])> = [11, 12, 13, 21, 22, 23]
        .iter()
        .map(|&i| (i, slow))
        .collect();
    // Long enough for the joiner to take part in many updates.
    const LONG: u32 = 40;
    let mut swarm = start_for(LONG, &extra);
    swarm.until("iteration 0", |ev| {
        ev.iter().any(|e| e.event() == "iteration")
    });
    let after = swarm.count();
    swarm.join(31, 1, &[]);
    let ev = swarm.until("a member exporting its state", |ev| {
        ev.iter()
            .skip(after)
            .any(|e| e.event() == "work" && e.v["kind"] == "export_state")
    });
    let server = ev
        .iter()
        .skip(after)
        .find(|e| e.event() == "work" && e.v["kind"] == "export_state")
        .unwrap()
        .node;
    swarm.kill(server);
    swarm.until("the joiner's download", |ev| {
        ev.iter()
            .any(|e| e.node == 31 && e.event() == "state_download")
    });
    swarm.until("the joiner's first update", |ev| {
        ev.iter().any(|e| e.node == 31 && e.event() == "applied")
    });
    let leaver = [11, 12, 13, 21, 22, 23]
        .into_iter()
        .find(|&i| i != server)
        .unwrap();
    swarm.terminate(leaver);
    let ev = swarm.until_done(&[1, 2]);
    let losses = check_run(&ev, LONG, MB, 2);
    assert!(ev.iter().any(|e| e.node == leaver && e.event() == "left"));
    assert_reference(&losses);
}

/// The last node of a stage is killed: its neighbours say the stage is
/// empty and training pauses (no iteration is final without it); a node
/// that joins takes the stage up (nobody can serve its state and no holder
/// keeps a copy: it rebuilds it from its neighbouring stage's weights, and
/// says so), the neighbours say it resumed, and the run finishes with
/// every invariant.
#[test]
fn a_stages_last_node_killed_pauses_training_until_a_node_joins_it() {
    const LONG: u32 = 20;
    let args = common_args(LONG);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let layout = vec![(1, 0), (2, 0), (11, 1), (12, 1), (21, 2)];
    let mut swarm = Swarm::start(&layout, &args, &[]);
    swarm.until("iteration 1", |ev| {
        ev.iter()
            .any(|e| e.event() == "iteration" && e.u("iteration") >= 1)
    });
    let after = swarm.count();
    swarm.kill(21);
    // Every neighbour of stage 2 (both holders, both stage-1 relays) says so.
    let ev = swarm.until("stage 2 reported empty by its neighbours", |ev| {
        [1, 2, 11, 12].iter().all(|n| {
            ev.iter()
                .skip(after)
                .any(|e| e.node == *n && e.event() == "stage_empty" && e.u("stage") == 2)
        })
    });
    let last_final = ev
        .iter()
        .filter(|e| e.event() == "iteration")
        .map(|e| e.u("iteration"))
        .max()
        .unwrap();
    // Paused: nothing becomes final while the stage is empty.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let paused = swarm.snapshot();
    let during: Vec<u64> = paused
        .iter()
        .skip(ev.len())
        .filter(|e| e.event() == "iteration")
        .map(|e| e.u("iteration"))
        .collect();
    assert!(
        during.iter().all(|k| *k <= last_final),
        "iterations {during:?} became final while stage 2 was empty"
    );
    let joined = swarm.count();
    swarm.join(31, 1, &[]);
    let ev = swarm.until_done(&[1, 2]);
    assert!(
        ev.iter()
            .skip(joined)
            .any(|e| e.node == 31 && e.event() == "stage_rebuilt" && e.u("stage") == 2),
        "the joiner did not say it rebuilt stage 2"
    );
    for n in [1, 2, 11, 12] {
        assert!(
            ev.iter()
                .skip(joined)
                .any(|e| e.node == n && e.event() == "stage_resumed" && e.u("stage") == 2),
            "node {n} did not say stage 2 resumed"
        );
    }
    let losses = check_run(&ev, LONG, MB, 2);
    assert!(
        ev.iter()
            .any(|e| e.node == 31 && e.event() == "applied" && e.u("stage") == 2),
        "the joiner never applied an update of stage 2"
    );
    eprintln!("losses per iteration: {losses:?}");
    assert!(losses[LONG as usize - 1] < losses[0], "{losses:?}");
}

/// A node that joins goes to the bottleneck: the stage with the fewest
/// members (the least throughput) gets it, downloads its state from the
/// member there, and its replicas agree from then on.
#[test]
fn a_joiner_goes_to_the_bottleneck_stage() {
    const LONG: u32 = 12;
    let args = common_args(LONG);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let layout = vec![(1, 0), (2, 0), (11, 1), (12, 1), (13, 1), (21, 2)];
    let mut swarm = Swarm::start(&layout, &args, &[]);
    swarm.until("iteration 0", |ev| {
        ev.iter().any(|e| e.event() == "iteration")
    });
    swarm.join(31, 1, &[]);
    let ev = swarm.until_done(&[1, 2]);
    let active: Vec<u64> = ev
        .iter()
        .filter(|e| e.node == 31 && e.event() == "active")
        .map(|e| e.u("stage"))
        .collect();
    assert_eq!(
        active,
        [2],
        "the joiner did not join the bottleneck stage 2"
    );
    assert!(
        ev.iter()
            .any(|e| e.node == 31 && e.event() == "state_download" && e.u("from") == 21),
        "the joiner did not download stage 2's state from its member"
    );
    let losses = check_run(&ev, LONG, MB, 2);
    assert!(
        ev.iter()
            .any(|e| e.node == 31 && e.event() == "applied" && e.u("stage") == 2),
        "the joiner never applied an update"
    );
    assert_reference(&losses);
}
