//! Nodes that train libgwtf's model together over TCP (loopback, one
//! process): without crashes, the loss of every iteration equals the
//! single-process reference trained on the same microbatches, every stage
//! counts each microbatch exactly once, and the replicas of a stage hold
//! bit-identical weights after every update.
mod common;

use common::swarm_inproc::{free_addr, model_protocol_config, start_node, Seen};
use gwtf::engine::NodeOptions;
use gwtf::model::dataset::Dataset;
use gwtf::model::preset;
use gwtf::protocol::{Config, NodeId, Stage};
use gwtf::swarm::model_trainer::{reference_losses, ModelRun, ModelTrainer};
use gwtf::swarm::runtime::{Peer, Runtime};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY: &[u8] = b"0123456789abcdef-model-swarm-key";
const MB_PER_ITER: u32 = 3;
const ITERATIONS: u32 = 6;

fn model_run() -> ModelRun {
    ModelRun::new(preset("llama-tiny").unwrap(), 4, 7, ITERATIONS as usize).unwrap()
}

fn docs() -> Vec<Vec<u32>> {
    Dataset::synthetic(3, 16 << 10, 16).train
}

fn start(p: &Peer, all: &[Peer], cfg: &Arc<Config>, run: &ModelRun, join: bool) -> Runtime {
    let trainer = ModelTrainer::new(run.clone(), p.stage, docs()).unwrap();
    runtime(p, all, cfg, trainer, join)
}

fn runtime(
    p: &Peer,
    all: &[Peer],
    cfg: &Arc<Config>,
    trainer: ModelTrainer,
    join: bool,
) -> Runtime {
    let net = NodeOptions {
        heartbeat_interval: Duration::from_millis(200),
        pool_bytes: 64 << 20,
        max_payload: 16 << 20,
        log: std::env::var_os("GWTF_TEST_TRACE").is_some(),
        ..NodeOptions::default()
    };
    start_node(p, all, cfg, join, KEY, net, trainer)
}

fn layout() -> Vec<(NodeId, Stage)> {
    vec![(1, 0), (2, 0), (11, 1), (12, 1), (21, 2), (22, 2)]
}

/// A swarm in this process and what its nodes reported.
struct Swarm {
    run: ModelRun,
    cfg: Arc<Config>,
    peers: Vec<Peer>,
    nodes: Vec<(NodeId, Runtime)>,
    seen: Seen,
    deadline: Instant,
}

impl Swarm {
    fn start() -> Swarm {
        let run = model_run();
        let cfg = model_protocol_config(&run, MB_PER_ITER);
        let peers: Vec<Peer> = layout()
            .into_iter()
            .map(|(id, stage)| Peer {
                id,
                stage,
                addr: free_addr(),
            })
            .collect();
        let nodes = peers
            .iter()
            .map(|p| (p.id, start(p, &peers, &cfg, &run, false)))
            .collect();
        Swarm {
            run,
            cfg,
            peers,
            nodes,
            seen: Seen::default(),
            deadline: Instant::now() + Duration::from_secs(120),
        }
    }

    fn pump(&mut self) {
        for (id, n) in &self.nodes {
            while let Ok(ev) = n.events().try_recv() {
                self.seen.take(*id, ev);
            }
        }
    }

    /// Pumps events until `done`, or fails at the deadline.
    fn until(&mut self, what: &str, mut done: impl FnMut(&Seen) -> bool) {
        while !done(&self.seen) {
            assert!(
                Instant::now() < self.deadline,
                "timed out waiting for {what}"
            );
            assert!(self.seen.errors.is_empty(), "{:?}", self.seen.errors);
            self.pump();
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn iterations_done(&mut self, n: u32) {
        self.until(&format!("{n} iterations"), |s| {
            (0..n).all(|k| s.losses.get(&k).is_some_and(|l| l.len() == 2))
        });
    }

    /// Starts a node that joins through the first holder.
    fn join(&mut self, id: NodeId) {
        let p = Peer {
            id,
            stage: 0,
            addr: free_addr(),
        };
        let trainer = ModelTrainer::joiner(self.run.clone());
        let rt = runtime(&p, &self.peers[..1], &self.cfg, trainer, true);
        self.nodes.push((id, rt));
    }

    /// Every node leaves; the checks of a run: no errors, each microbatch
    /// committed once per stage, replicas agree, losses are the reference's.
    fn finish_and_check(mut self, iterations: u32) {
        std::thread::sleep(Duration::from_millis(300));
        self.pump();
        for (_, n) in self.nodes.drain(..) {
            n.leave();
        }
        let seen = &self.seen;
        assert!(seen.errors.is_empty(), "{:?}", seen.errors);
        for s in 0..=2u16 {
            for k in 0..iterations {
                let mut got = seen.committed.get(&(s, k)).cloned().unwrap_or_default();
                let n = got.len();
                got.sort_unstable();
                got.dedup();
                let want = 2 * MB_PER_ITER as usize;
                assert_eq!((n, got.len()), (want, want), "stage {s} iteration {k}");
            }
        }
        for ((s, k), d) in &seen.digests {
            assert_eq!(d.len(), 1, "stage {s} iteration {k}: {} digests", d.len());
        }
        let docs = docs();
        let holders: Vec<(NodeId, &[Vec<u32>])> = vec![(1, &docs[..]), (2, &docs[..])];
        let want =
            reference_losses(&self.run, &holders, MB_PER_ITER, iterations, |_, _| {}).unwrap();
        for (k, w) in want.iter().enumerate() {
            let l = &seen.losses[&(k as u32)];
            let got = (l[0] + l[1]) / 2.0;
            assert!(
                (got - w).abs() <= 1e-4 * w.abs(),
                "iteration {k}: swarm {got} reference {w}"
            );
        }
        assert!(want[iterations as usize - 1] < want[0]);
    }
}

#[test]
fn a_swarm_without_crashes_trains_exactly_the_reference() {
    let mut swarm = Swarm::start();
    swarm.iterations_done(ITERATIONS);
    // Tensors go from the socket to the trainer and from the trainer to the
    // socket in their pool slots: no node copied one.
    for (id, rt) in &swarm.nodes {
        let s = rt.net_stats();
        assert!(s.frames_sent > 0, "node {id} sent no tensor");
        assert_eq!(
            s.user_copies, 0,
            "node {id} copied {} bytes",
            s.user_copy_bytes
        );
    }
    swarm.finish_and_check(ITERATIONS);
}

/// A node joins the bottleneck stage, downloads the stage's state (weights
/// and optimizer, verified by hash) and trains on with bit-identical
/// weights; a relay then leaves gracefully. Neither changes the arithmetic:
/// the losses are still the reference's.
#[test]
fn a_joiner_downloads_the_state_and_a_leaver_changes_nothing() {
    let mut swarm = Swarm::start();
    // Stage 2 loses a relay: it becomes the bottleneck the joiner fills.
    swarm.iterations_done(1);
    let (_, old) = swarm.nodes.remove(5);
    old.leave();
    swarm.iterations_done(2);
    swarm.join(31);
    swarm.until("the joiner's state download", |s| {
        s.downloads.iter().any(|(j, _)| *j == 31)
    });
    swarm.until("the joiner's first update", |s| s.applied(31));
    swarm.iterations_done(ITERATIONS);
    assert!(
        swarm.seen.active.get(&31) == Some(&2),
        "{:?}",
        swarm.seen.active
    );
    swarm.finish_and_check(ITERATIONS);
}
