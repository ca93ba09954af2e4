//! Nodes that train libgwtf's model together over TCP (loopback, one
//! process): without crashes, the loss of every iteration equals the
//! single-process reference trained on the same microbatches, every stage
//! counts each microbatch exactly once, and the replicas of a stage hold
//! bit-identical weights after every update.
use gwtf::engine::NodeOptions;
use gwtf::model::dataset::Dataset;
use gwtf::model::preset;
use gwtf::protocol::{Config, Event, NodeId, Policy, Stage, SEC};
use gwtf::swarm::model_trainer::{reference_losses, ModelRun, ModelTrainer};
use gwtf::swarm::runtime::{NodeEvent, Peer, Runtime, RuntimeOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY: &[u8] = b"0123456789abcdef-model-swarm-key";
const MB_PER_ITER: u32 = 3;
const ITERATIONS: u32 = 6;

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn model_run() -> ModelRun {
    ModelRun::new(preset("llama-tiny").unwrap(), 4, 7, ITERATIONS as usize).unwrap()
}

fn protocol_config(run: &ModelRun) -> Arc<Config> {
    let mut c = Config::new(
        Policy::Gwtf,
        (run.stages - 2) as u16,
        run.activation_bytes() as u64,
    );
    c.tick = SEC / 10;
    c.start_delay = SEC / 2;
    c.mb_per_iter = MB_PER_ITER;
    c.max_in_flight = 2;
    c.stage_state_bytes = (0..=c.relay_stages)
        .map(|s| run.state_bytes(s).unwrap())
        .collect();
    Arc::new(c)
}

fn docs() -> Vec<Vec<u32>> {
    Dataset::synthetic(3, 16 << 10, 16).train
}

fn start(p: &Peer, all: &[Peer], cfg: &Arc<Config>, run: &ModelRun, join: bool) -> Runtime {
    let trainer = ModelTrainer::new(run.clone(), p.stage, docs()).unwrap();
    Runtime::start(
        RuntimeOptions {
            id: p.id,
            stage: p.stage,
            listen: p.addr,
            swarm_key: KEY.to_vec(),
            bootstrap: all.to_vec(),
            join,
            protocol: cfg.clone(),
            compute_s: 0.01,
            capacity: 4,
            seed: 1,
            net: NodeOptions {
                heartbeat_interval: Duration::from_millis(200),
                pool_bytes: 64 << 20,
                max_payload: 16 << 20,
                log: std::env::var_os("GWTF_TEST_TRACE").is_some(),
                ..NodeOptions::default()
            },
        },
        trainer,
    )
    .unwrap()
}

/// What the nodes reported.
#[derive(Default)]
struct Seen {
    /// Holder losses by iteration.
    losses: BTreeMap<u32, Vec<f32>>,
    /// (stage, iteration) -> digests reported by the members that applied.
    digests: BTreeMap<(Stage, u32), BTreeSet<[u8; 32]>>,
    /// (stage, iteration) -> microbatches committed.
    committed: BTreeMap<(Stage, u32), Vec<gwtf::protocol::MbId>>,
    errors: Vec<String>,
}

impl Seen {
    fn take(&mut self, id: NodeId, ev: NodeEvent) {
        if std::env::var_os("GWTF_TEST_TRACE").is_some() {
            eprintln!("{id:x}: {ev:?}");
        }
        match ev {
            NodeEvent::Iteration {
                iteration, loss, ..
            } => self.losses.entry(iteration).or_default().push(loss),
            NodeEvent::Applied {
                stage,
                iteration,
                weights,
            } => {
                self.digests
                    .entry((stage, iteration))
                    .or_default()
                    .insert(weights);
            }
            NodeEvent::Protocol(Event::StageCommitted {
                stage, iter, mbs, ..
            }) => {
                self.committed
                    .entry((stage, iter))
                    .or_default()
                    .extend(mbs.iter().map(|m| m.0));
            }
            NodeEvent::Error(e) => self.errors.push(format!("{id:x}: {e}")),
            _ => {}
        }
    }
}

fn layout() -> Vec<(NodeId, Stage)> {
    vec![(1, 0), (2, 0), (11, 1), (12, 1), (21, 2), (22, 2)]
}

#[test]
fn a_swarm_without_crashes_trains_exactly_the_reference() {
    let run = model_run();
    let cfg = protocol_config(&run);
    let peers: Vec<Peer> = layout()
        .into_iter()
        .map(|(id, stage)| Peer {
            id,
            stage,
            addr: free_addr(),
        })
        .collect();
    let nodes: Vec<(NodeId, Runtime)> = peers
        .iter()
        .map(|p| (p.id, start(p, &peers, &cfg, &run, false)))
        .collect();
    let mut seen = Seen::default();
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline && seen.losses.len() < ITERATIONS as usize {
        for (id, n) in &nodes {
            while let Ok(ev) = n.events().try_recv() {
                seen.take(*id, ev);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Let the last updates land at every node.
    std::thread::sleep(Duration::from_millis(300));
    for (id, n) in &nodes {
        while let Ok(ev) = n.events().try_recv() {
            seen.take(*id, ev);
        }
    }
    for (_, n) in nodes {
        n.leave();
    }
    assert!(seen.errors.is_empty(), "{:?}", seen.errors);
    assert!(
        seen.losses.len() >= ITERATIONS as usize,
        "only {} iterations in time",
        seen.losses.len()
    );
    // Exactly once: every stage commits each microbatch of each holder once.
    for s in 0..=2u16 {
        for k in 0..ITERATIONS {
            let mut got = seen.committed.get(&(s, k)).cloned().unwrap_or_default();
            let n = got.len();
            got.sort_unstable();
            got.dedup();
            assert_eq!(
                (n, got.len()),
                (2 * MB_PER_ITER as usize, 2 * MB_PER_ITER as usize),
                "stage {s} iteration {k}"
            );
        }
    }
    // Replicas agree after every update.
    for ((s, k), d) in &seen.digests {
        assert_eq!(d.len(), 1, "stage {s} iteration {k}: {} digests", d.len());
    }
    // The loss of each iteration is the reference's.
    let docs = docs();
    let holders: Vec<(NodeId, &[Vec<u32>])> = vec![(1, &docs[..]), (2, &docs[..])];
    let want = reference_losses(&run, &holders, MB_PER_ITER, ITERATIONS, |_, _| {}).unwrap();
    for (k, w) in want.iter().enumerate() {
        let l = &seen.losses[&(k as u32)];
        assert_eq!(l.len(), 2, "iteration {k}: {l:?}");
        let got = (l[0] + l[1]) / 2.0;
        assert!(
            (got - w).abs() <= 1e-4 * w.abs(),
            "iteration {k}: swarm {got} reference {w}"
        );
    }
    assert!(want[ITERATIONS as usize - 1] < want[0]);
}
