//! The protocol over real TCP: nodes on loopback, each a driver thread over
//! the engine and a trainer thread, run iterations together; a relay that
//! disappears is noticed through its broken connection and the iterations go
//! on. The trainer here only takes time (no model): this tests the runtime.
mod common;

use common::swarm_inproc::{free_addr, peers_of};
use gwtf::engine::NodeOptions;
use gwtf::protocol::{Config, Event, NodeId, Policy, Stage, SEC};
use gwtf::swarm::runtime::{
    parse_directory, NodeEvent, Peer, Runtime, RuntimeOptions, TimedTrainer,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY: &[u8] = b"0123456789abcdef-runtime-test-key";

fn protocol_config() -> Arc<Config> {
    let mut c = Config::new(Policy::Gwtf, 2, 64 << 10);
    // Real time: a fast tick keeps the test short.
    c.tick = SEC / 10;
    c.start_delay = SEC / 2;
    c.mb_per_iter = 4;
    c.max_in_flight = 2;
    Arc::new(c)
}

fn start(id: NodeId, stage: Stage, addr: SocketAddr, all: &[Peer], cfg: &Arc<Config>) -> Runtime {
    start_as(id, stage, addr, all, cfg, false)
}

fn start_as(
    id: NodeId,
    stage: Stage,
    addr: SocketAddr,
    all: &[Peer],
    cfg: &Arc<Config>,
    join: bool,
) -> Runtime {
    Runtime::start(
        RuntimeOptions {
            id,
            stage,
            listen: addr,
            swarm_key: KEY.to_vec(),
            bootstrap: all.to_vec(),
            join,
            protocol: cfg.clone(),
            compute_s: 0.01,
            capacity: 4,
            seed: 1,
            net: NodeOptions {
                heartbeat_interval: Duration::from_millis(200),
                peer_timeout: Duration::from_secs(10),
                log: std::env::var_os("GWTF_TEST_TRACE").is_some(),
                // Chosen ids (1, 11, ...): a test swarm's insecure mode.
                chosen_ids: true,
                ..NodeOptions::default()
            },
            weights_first: None,
        },
        TimedTrainer::new(Duration::from_millis(5)),
    )
    .unwrap()
}

/// Reads the holder's events until `stop` says so; returns the last
/// iteration finalized and the microbatch paths seen.
fn watch(
    holder: &Runtime,
    deadline: Instant,
    mut stop: impl FnMut(&Event) -> bool,
) -> (u32, Vec<Vec<NodeId>>) {
    let (mut last, mut paths) = (0, Vec::new());
    while Instant::now() < deadline {
        let Ok(ev) = holder.events().recv_timeout(Duration::from_millis(100)) else {
            continue;
        };
        if std::env::var_os("GWTF_TEST_TRACE").is_some() {
            eprintln!("{:?} {ev:?}", Instant::now());
        }
        let ev = match ev {
            NodeEvent::Protocol(ev) => ev,
            NodeEvent::Error(e) => panic!("the holder reported an error: {e}"),
            _ => continue,
        };
        match &ev {
            Event::IterFinalized { iter, .. } => last = last.max(*iter),
            Event::MbDone { path, .. } => paths.push(path.to_vec()),
            _ => {}
        }
        if stop(&ev) {
            return (last, paths);
        }
    }
    panic!("the swarm stalled (last iteration finalized: {last})");
}

/// Watches until the second microbatch of iteration 3 came back; returns
/// the paths of the microbatches done so far.
fn until_mid_iteration_3(holder: &Runtime, deadline: Instant) -> Vec<Vec<NodeId>> {
    watch(
        holder,
        deadline,
        |ev| matches!(ev, Event::MbDone { mb, .. } if mb.iter == 3 && mb.idx == 1),
    )
    .1
}

/// Iterations go on to 7 after `victim` is gone, and from the fifth
/// iteration on (past the iteration it was lost in) no microbatch passes
/// through it. Returns the paths seen.
fn trains_on_without(holder: &Runtime, deadline: Instant, victim: NodeId) -> Vec<Vec<NodeId>> {
    let (reached, after) = watch(
        holder,
        deadline,
        |ev| matches!(ev, Event::IterFinalized { iter, .. } if *iter >= 7),
    );
    assert!(reached >= 7);
    let late: Vec<&Vec<NodeId>> = after.iter().skip(8).collect();
    assert!(!late.is_empty());
    assert!(late.iter().all(|p| !p.contains(&victim)), "{late:?}");
    after
}

#[test]
fn nodes_train_iterations_over_tcp_and_survive_a_lost_relay() {
    let cfg = protocol_config();
    // One data holder (stage 0) and three relays in each of two stages.
    let layout: Vec<(NodeId, Stage)> =
        vec![(1, 0), (11, 1), (12, 1), (13, 1), (21, 2), (22, 2), (23, 2)];
    let peers = peers_of(&layout);
    let mut nodes: Vec<Option<Runtime>> = peers
        .iter()
        .map(|p| Some(start(p.id, p.stage, p.addr, &peers, &cfg)))
        .collect();
    let holder = nodes[0].take().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    // Mid-iteration 3, after its second microbatch came back, the stage-1
    // relay that carried it goes away without a word from its protocol.
    let paths = until_mid_iteration_3(&holder, deadline);
    let victim = paths.last().unwrap()[1];
    let k = layout.iter().position(|&(id, _)| id == victim).unwrap();
    drop(nodes[k].take());
    let after = trains_on_without(&holder, deadline, victim);
    // Activations and gradients crossed the wire as data frames: the holder
    // received the last stage's output and stage 1's gradient of every
    // microbatch it finished.
    let done = (paths.len() + after.len()) as u64;
    let got = holder.net_stats();
    assert!(
        got.bytes_received >= 2 * done * cfg.activation_bytes,
        "{} bytes received for {done} microbatches",
        got.bytes_received
    );
    holder.leave();
    for n in nodes.into_iter().flatten() {
        n.leave();
    }
}

/// Founding members `layout`, the first a holder, trained until iteration
/// `until` is final: the holder, the others, their peers and the deadline.
fn swarm_until(
    layout: &[(NodeId, Stage)],
    cfg: &Arc<Config>,
    until: u32,
) -> (Runtime, Vec<Runtime>, Vec<Peer>, Instant) {
    let peers = peers_of(layout);
    let mut nodes: Vec<Runtime> = peers
        .iter()
        .map(|p| start(p.id, p.stage, p.addr, &peers, cfg))
        .collect();
    let holder = nodes.remove(0);
    let deadline = Instant::now() + Duration::from_secs(120);
    watch(
        &holder,
        deadline,
        |ev| matches!(ev, Event::IterFinalized { iter, .. } if *iter >= until),
    );
    (holder, nodes, peers, deadline)
}

#[test]
fn a_joiner_takes_over_flows_and_a_relay_leaves_gracefully() {
    let cfg = protocol_config();
    // Stage 2 has a single relay: everything goes through it.
    let layout = [(1, 0), (11, 1), (12, 1), (21, 2)];
    let (holder, mut nodes, peers, deadline) = swarm_until(&layout, &cfg, 2);
    // A new node joins through the holder; the protocol picks its stage
    // (the bottleneck: stage 2, which has one relay).
    let joiner_addr = free_addr();
    let joiner = start_as(31, 2, joiner_addr, &peers[..1], &cfg, true);
    let mut active = None;
    while Instant::now() < deadline && active.is_none() {
        if let Ok(NodeEvent::Protocol(Event::Active { stage })) =
            joiner.events().recv_timeout(Duration::from_millis(100))
        {
            active = Some(stage);
        }
    }
    assert_eq!(
        active,
        Some(2),
        "the joiner did not become active in stage 2"
    );
    // Then the old stage-2 relay leaves gracefully: the joiner carries on.
    let old = nodes.pop().unwrap();
    old.leave();
    // The holder's events queued while the joiner came up tell of
    // iterations the old relay served (on a loaded machine the join can
    // take several iterations): judge only those begun after it left.
    let gone = std::iter::from_fn(|| holder.events().try_recv().ok())
        .filter_map(|ev| match ev {
            NodeEvent::Protocol(Event::IterFinalized { iter, .. }) => Some(iter),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let until = (gone + 4).max(8);
    let (_, paths) = watch(
        &holder,
        deadline,
        |ev| matches!(ev, Event::IterFinalized { iter, .. } if *iter >= until),
    );
    let tail = &paths[paths.len().saturating_sub(4)..];
    assert!(tail.iter().all(|p| p[2] == 31), "{tail:?}");
    holder.leave();
    joiner.leave();
    for n in nodes {
        n.leave();
    }
}

/// A node joins through a relay into a stage of two members: the member
/// that is not the stage's coordinator hears of the joiner from the
/// coordinator before it knows where the joiner is, and must wait for its
/// address (the joiner connects to its stage's members) rather than take
/// it for lost; the stage's all-reduce then includes the joiner.
#[test]
fn a_joiner_into_a_stage_of_several_members_is_reached_by_each() {
    let cfg = protocol_config();
    let layout = [(1, 0), (11, 1), (12, 1), (21, 2), (22, 2)];
    let (holder, nodes, peers, deadline) = swarm_until(&layout, &cfg, 1);
    let contact = Peer {
        id: 0,
        stage: 0,
        addr: peers[1].addr,
    };
    let joiner = start_as(31, 0, free_addr(), &[contact], &cfg, true);
    let mut applied = None;
    while Instant::now() < deadline && applied.is_none() {
        if let Ok(NodeEvent::Applied { stage, .. }) =
            joiner.events().recv_timeout(Duration::from_millis(100))
        {
            applied = Some(stage);
        }
    }
    assert!(applied.is_some(), "the joiner applied no update");
    watch(
        &holder,
        deadline,
        |ev| matches!(ev, Event::IterFinalized { iter, .. } if *iter >= 6),
    );
    holder.leave();
    joiner.leave();
    for n in nodes {
        n.leave();
    }
}

#[test]
fn directory_messages_are_parsed_defensively() {
    let ok = {
        let mut b = vec![1, 0];
        b.extend_from_slice(&7u32.to_le_bytes());
        b.extend_from_slice(&2u16.to_le_bytes());
        let a = b"127.0.0.1:9";
        b.push(a.len() as u8);
        b.extend_from_slice(a);
        b
    };
    let p = parse_directory(&ok).unwrap();
    assert_eq!(p.len(), 1);
    assert_eq!((p[0].id, p[0].stage), (7, 2));
    for bad in [&ok[..ok.len() - 1], &[0xff, 0xff][..], &[][..]] {
        assert!(parse_directory(bad).is_err());
    }
    let mut trailing = ok.clone();
    trailing.push(0);
    assert!(parse_directory(&trailing).is_err());
    let mut not_addr = ok.clone();
    let n = not_addr.len();
    not_addr[n - 1] = b'x';
    assert!(parse_directory(&not_addr).is_err());
}

/// Not a test of its own: the entry point of a node process for
/// `a_node_process_killed_with_sigkill_is_survived` (run with --ignored by
/// that test, with the swarm in the environment). Does nothing otherwise.
#[test]
#[ignore]
fn node_process() {
    let (Ok(id), Ok(spec)) = (
        std::env::var("GWTF_TEST_NODE_ID"),
        std::env::var("GWTF_TEST_SWARM"),
    ) else {
        return;
    };
    let id: NodeId = id.parse().unwrap();
    let peers: Vec<Peer> = spec
        .split(';')
        .map(|p| {
            let f: Vec<&str> = p.split(',').collect();
            Peer {
                id: f[0].parse().unwrap(),
                stage: f[1].parse().unwrap(),
                addr: f[2].parse().unwrap(),
            }
        })
        .collect();
    let me = peers.iter().find(|p| p.id == id).unwrap().clone();
    let _node = start(me.id, me.stage, me.addr, &peers, &protocol_config());
    // Lives until killed (bounded, so a forgotten process ends by itself).
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn a_node_process_killed_with_sigkill_is_survived() {
    let cfg = protocol_config();
    let layout: Vec<(NodeId, Stage)> =
        vec![(1, 0), (11, 1), (12, 1), (13, 1), (21, 2), (22, 2), (23, 2)];
    let peers = peers_of(&layout);
    let spec: Vec<String> = peers
        .iter()
        .map(|p| format!("{},{},{}", p.id, p.stage, p.addr))
        .collect();
    let spec = spec.join(";");
    // Every relay is a process of its own; the holder runs here.
    let mut children: Vec<(NodeId, std::process::Child)> = peers[1..]
        .iter()
        .map(|p| {
            let child = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--ignored", "--exact", "node_process", "--nocapture"])
                .env("GWTF_TEST_NODE_ID", p.id.to_string())
                .env("GWTF_TEST_SWARM", &spec)
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap();
            (p.id, child)
        })
        .collect();
    let holder = start(1, 0, peers[0].addr, &peers, &cfg);
    let deadline = Instant::now() + Duration::from_secs(120);
    let paths = until_mid_iteration_3(&holder, deadline);
    // SIGKILL the stage-2 relay that carried the last microbatch.
    let victim = paths.last().unwrap()[2];
    let k = children.iter().position(|(id, _)| *id == victim).unwrap();
    let (_, mut child) = children.remove(k);
    child.kill().unwrap();
    child.wait().unwrap();
    trains_on_without(&holder, deadline, victim);
    holder.leave();
    for (_, mut c) in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}
