//! Nodes that train libgwtf's model together over TCP (loopback, one
//! process): without crashes, the loss of every iteration equals the
//! single-process reference trained on the same microbatches, every stage
//! counts each microbatch exactly once, and the replicas of a stage hold
//! bit-identical weights after every update.
mod common;

use common::swarm_inproc::{free_addr, model_protocol_config, node_options, Seen};
use gwtf::engine::NodeOptions;
use gwtf::model::dataset::Dataset;
use gwtf::model::gpu::HostBackend;
use gwtf::model::preset;
use gwtf::protocol::{Config, MbId, NodeId, Stage};
use gwtf::swarm::model_pieces::OnBackend;
use gwtf::swarm::model_trainer::{reference_losses, ModelRun, ModelTrainer};
use gwtf::swarm::runtime::{Peer, Runtime, Trainer};
use gwtf::swarm::work::{Output, Work, WorkKind, WorkPort};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

/// The model's trainer, whose gradient of one iteration can be held back
/// (the stage's aggregation of it waits) until the test lets it go.
struct Gated {
    inner: ModelTrainer,
    gate: Option<Gate>,
    /// Forwards whose activations it dropped (to recompute them).
    discards: Arc<AtomicUsize>,
}

#[derive(Clone)]
struct Gate {
    iteration: u32,
    closed: Arc<AtomicBool>,
    /// Set when the gradient is held: 1 + the microbatches granted.
    holding: Arc<AtomicUsize>,
}

impl Trainer for Gated {
    fn run(&mut self, work: Work, port: &WorkPort) -> Result<Output, String> {
        if work.kind == WorkKind::Discard {
            self.discards.fetch_add(1, Ordering::SeqCst);
        }
        if let (WorkKind::Gradient { iteration, granted }, Some(g)) = (&work.kind, &self.gate) {
            let until = Instant::now() + Duration::from_secs(120);
            if *iteration == g.iteration {
                g.holding.store(1 + granted.len(), Ordering::SeqCst);
            }
            while *iteration == g.iteration
                && g.closed.load(Ordering::SeqCst)
                && Instant::now() < until
            {
                if port.is_stopped() {
                    return Err("stopped while its gradient was held".into());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        self.inner.run(work, port)
    }
}

fn runtime(p: &Peer, all: &[Peer], cfg: &Arc<Config>, trainer: Gated, join: bool) -> Runtime {
    runtime_holding(p, all, cfg, trainer, join, 4)
}

/// A node whose memory holds `capacity` microbatches.
fn runtime_holding(
    p: &Peer,
    all: &[Peer],
    cfg: &Arc<Config>,
    trainer: Gated,
    join: bool,
    capacity: u32,
) -> Runtime {
    let net = NodeOptions {
        heartbeat_interval: Duration::from_millis(200),
        pool_bytes: 64 << 20,
        max_payload: 16 << 20,
        log: std::env::var_os("GWTF_TEST_TRACE").is_some(),
        ..NodeOptions::default()
    };
    let mut o = node_options(p, all, cfg, join, KEY, net);
    o.capacity = capacity;
    Runtime::start(o, trainer).unwrap()
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
    /// A node was killed: a stage may have committed an iteration again.
    killed: bool,
    /// Forwards the trainers dropped to recompute them.
    discards: Arc<AtomicUsize>,
    /// Joiners run their model stages as device stages.
    joiners_on_device: bool,
}

/// `t`, with its model stages as device stages on the host backend when
/// `on_device` (the device trainer of `gwtf node --device cuda`, whose
/// bookkeeping this checks on any machine).
fn place(t: ModelTrainer, on_device: bool) -> ModelTrainer {
    if !on_device {
        return t;
    }
    let t = t
        .placed(Arc::new(OnBackend(Arc::new(HostBackend))))
        .unwrap();
    assert!(t.placement().starts_with("host"), "{}", t.placement());
    t
}

impl Swarm {
    fn start() -> Swarm {
        Swarm::start_gated(&layout(), |_| None)
    }

    /// `gate(id)`: the gradient node `id` holds back, if any.
    fn start_gated(layout: &[(NodeId, Stage)], gate: impl Fn(NodeId) -> Option<Gate>) -> Swarm {
        Swarm::start_with(layout, gate, 4)
    }

    /// Relays whose memory holds `capacity` microbatches.
    fn start_with(
        layout: &[(NodeId, Stage)],
        gate: impl Fn(NodeId) -> Option<Gate>,
        capacity: u32,
    ) -> Swarm {
        Swarm::start_with_bootstrap(layout, gate, capacity, |_, all| all.to_vec(), 0, &[])
    }

    /// `bootstrap(node, founders)`: the founders as `node` is told of them;
    /// the nodes in `on_device` (and every joiner, then) run their model
    /// stages as device stages on the host backend.
    fn start_with_bootstrap(
        layout: &[(NodeId, Stage)],
        gate: impl Fn(NodeId) -> Option<Gate>,
        capacity: u32,
        bootstrap: impl Fn(&Peer, &[Peer]) -> Vec<Peer>,
        keep_states_every: u32,
        on_device: &[NodeId],
    ) -> Swarm {
        let run = model_run();
        let mut cfg = model_protocol_config(&run, MB_PER_ITER);
        Arc::make_mut(&mut cfg).keep_states_every = keep_states_every;
        let peers: Vec<Peer> = layout
            .iter()
            .copied()
            .map(|(id, stage)| Peer {
                id,
                stage,
                addr: free_addr(),
            })
            .collect();
        let discards = Arc::new(AtomicUsize::new(0));
        let nodes = peers
            .iter()
            .map(|p| {
                let inner = ModelTrainer::new(run.clone(), p.stage, docs()).unwrap();
                let trainer = Gated {
                    inner: place(inner, on_device.contains(&p.id)),
                    gate: gate(p.id),
                    discards: discards.clone(),
                };
                let cap = if p.stage == 0 { 4 } else { capacity };
                let told = bootstrap(p, &peers);
                let rt = runtime_holding(p, &told, &cfg, trainer, false, cap);
                (p.id, rt)
            })
            .collect();
        Swarm {
            run,
            cfg,
            peers,
            nodes,
            seen: Seen::default(),
            deadline: Instant::now() + Duration::from_secs(120),
            killed: false,
            discards,
            joiners_on_device: !on_device.is_empty(),
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
        let inner = ModelTrainer::joiner(self.run.clone());
        let trainer = Gated {
            inner: place(inner, self.joiners_on_device),
            gate: None,
            discards: self.discards.clone(),
        };
        let rt = runtime(&p, &self.peers[..1], &self.cfg, trainer, true);
        self.nodes.push((id, rt));
    }

    /// Stops node `id` without a goodbye, as a crash would.
    fn kill(&mut self, id: NodeId) {
        let at = self.nodes.iter().position(|(n, _)| *n == id).unwrap();
        let (_, rt) = self.nodes.remove(at);
        let events = rt.events().clone();
        drop(rt);
        // What it reported before it stopped (a killed process's last
        // lines are read too).
        while let Ok(ev) = events.try_recv() {
            self.seen.take(id, ev);
        }
        self.killed = true;
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
        let want = 2 * MB_PER_ITER as usize;
        for s in 0..=2u16 {
            for k in 0..iterations {
                let mut last: Vec<MbId> = seen.last_commit[&(s, k)].iter().map(|m| m.0).collect();
                let n = last.len();
                last.sort_unstable();
                last.dedup();
                assert_eq!((n, last.len()), (want, want), "stage {s} iteration {k}");
                // Without a crash, a stage commits each iteration once.
                let all = seen.committed[&(s, k)].len();
                assert!(all == want || self.killed, "stage {s} iteration {k}: {all}");
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

/// Someone on the path between a holder and the first stage's relays lets
/// the handshakes through, then flips one byte of an activation: the relay
/// refuses the frame (its tag does not verify) and closes the connection
/// with the reason `mac`; the protocol sends the hop again, and the run
/// trains exactly the reference: nothing tampered was trained on.
#[test]
fn a_tampered_activation_is_refused_and_the_hop_sent_again() {
    use common::tamper_proxy::TamperProxy;
    let tampered = Arc::new(AtomicUsize::new(0));
    let proxies = std::sync::Mutex::new(Vec::new());
    // Holder 1 reaches the stage-1 relays through proxies (it dials them:
    // its id is the smaller, so both ends keep its connections).
    let mut swarm = Swarm::start_with_bootstrap(
        &layout(),
        |_| None,
        4,
        |p, all| {
            all.iter()
                .map(|q| {
                    let mut q = q.clone();
                    if p.id == 1 && q.stage == 1 {
                        let proxy = TamperProxy::start(q.addr, tampered.clone(), 1);
                        q.addr = proxy.addr;
                        proxies.lock().unwrap().push(proxy);
                    }
                    q
                })
                .collect()
        },
        0,
        &[],
    );
    swarm.iterations_done(ITERATIONS);
    assert_eq!(
        tampered.load(Ordering::SeqCst),
        1,
        "no activation was tampered"
    );
    let refused: u64 = swarm
        .nodes
        .iter()
        .filter(|(id, _)| *id == 11 || *id == 12)
        .map(|(_, rt)| rt.net_stats().tag_failures)
        .sum();
    assert_eq!(refused, 1, "the tampered frame was not refused for its tag");
    drop(proxies);
    swarm.finish_and_check(ITERATIONS);
}

/// Relays whose memory holds one microbatch, with two in flight per
/// holder: a forward beyond it keeps only its input, its activations are
/// dropped and recomputed before its backward. The arithmetic is the
/// same: the losses are still the reference's, the replicas agree.
#[test]
fn relays_short_of_memory_recompute_and_train_exactly_the_reference() {
    let mut swarm = Swarm::start_with(&layout(), |_| None, 1);
    swarm.iterations_done(ITERATIONS);
    let discards = swarm.discards.load(Ordering::SeqCst);
    assert!(discards > 0, "no forward was recomputed");
    eprintln!("{discards} forwards recomputed");
    swarm.finish_and_check(ITERATIONS);
}

/// A node joins the bottleneck stage, downloads the stage's state (weights
/// and optimizer, verified by hash) and trains on with bit-identical
/// weights; a relay then leaves gracefully. Neither changes the arithmetic:
/// the losses are still the reference's.
/// With `keep_states_every` 2, each data holder asks a member of every
/// relay stage for its state after every second update of its own, and
/// keeps the newest copy: each copy, imported into a trainer of its stage,
/// has the weights digest that stage's replicas reported for the copy's
/// iteration, and training is still exactly the reference's.
#[test]
fn holders_keep_a_verified_copy_of_every_relay_stage() {
    let mut swarm =
        Swarm::start_with_bootstrap(&layout(), |_| None, 4, |_, all| all.to_vec(), 2, &[]);
    swarm.iterations_done(ITERATIONS);
    // Rounds after the updates of iterations 1, 3 and 5: a copy of each
    // stage at each holder from the round after 3 at least.
    swarm.until("copies of both relay stages at both holders", |s| {
        [1, 2].iter().all(|&h| {
            [1, 2].iter().all(|&st| {
                s.copies
                    .iter()
                    .any(|&(n, stage, it)| n == h && stage == st && it >= 3)
            })
        })
    });
    for h in [1, 2] {
        for stage in [1, 2] {
            let rt = &swarm.nodes.iter().find(|(n, _)| *n == h).unwrap().1;
            let kept = rt.kept_state(stage).expect("a copy kept");
            // Both replicas' reports of that iteration (the copy may be
            // of an update whose events are still to be read).
            let it = kept.version.0;
            let members = [10 * stage as NodeId + 1, 10 * stage as NodeId + 2];
            swarm.until("the replicas' digests of the copy's iteration", |s| {
                members.iter().all(|m| s.digests_by.contains_key(&(*m, it)))
            });
            let mut t = ModelTrainer::new(swarm.run.clone(), stage, Vec::new()).unwrap();
            t.import_bytes(&kept.state, Some(kept.version.0)).unwrap();
            let d = t.digest().unwrap();
            let replicas = &swarm.seen.digests[&(stage, kept.version.0)];
            assert_eq!(
                replicas.iter().collect::<Vec<_>>(),
                [&d],
                "holder {h}, stage {stage}, iteration {}",
                kept.version.0
            );
            assert!([11, 12, 21, 22].contains(&kept.from));
        }
        let rt = &swarm.nodes.iter().find(|(n, _)| *n == h).unwrap().1;
        assert!(rt.kept_state(0).is_none());
    }
    swarm.finish_and_check(ITERATIONS);
}

/// The device trainer (`gwtf node --device cuda`'s, here on the host
/// backend, whose ops are the CPU's) at a holder and one relay of each
/// stage, beside CPU trainers: every stage's replicas print the same
/// weights digest after every update, CPU or device, and the losses are
/// the reference's; a device joiner takes a stage's state and trains on.
#[test]
fn cpu_and_device_trainers_are_bit_identical_replicas() {
    let all = |_: &Peer, all: &[Peer]| all.to_vec();
    let mut swarm = Swarm::start_with_bootstrap(&layout(), |_| None, 4, all, 0, &[2, 12, 22]);
    swarm.iterations_done(2);
    let (_, old) = swarm.nodes.remove(4);
    old.leave();
    swarm.join(31);
    swarm.until("the device joiner's first update", |s| s.applied(31));
    swarm.iterations_done(ITERATIONS);
    swarm.finish_and_check(ITERATIONS);
}

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

/// The stage's only member that applied an iteration dies after a joiner
/// took its state, and then that iteration's microbatches must be run
/// through the stage again: another stage lost its contribution (a member
/// died in the middle of its aggregation, and the node that had sent it
/// the activations is dead too, so the holder restarts them). The joiner
/// never held the weights that iteration saw, but its state download
/// brought them: it runs the restarted microbatches on them, and the losses
/// stay the reference's. (Before, it could not: "its weights are gone",
/// and the swarm never finished the iteration.)
#[test]
fn a_joiner_runs_a_restarted_microbatch_on_the_weights_its_iteration_saw() {
    restarted_microbatch_on_the_weights_its_iteration_saw(&[]);
}

/// The same with the device trainer (`gwtf node --device cuda`'s, on the
/// host backend) at stage 2's members and the joiner: it runs the
/// restarted microbatches on the earlier weights it swaps onto the device.
#[test]
fn a_device_joiner_runs_a_restarted_microbatch_on_the_weights_its_iteration_saw() {
    restarted_microbatch_on_the_weights_its_iteration_saw(&[21, 22]);
}

fn restarted_microbatch_on_the_weights_its_iteration_saw(on_device: &[NodeId]) {
    const HELD: u32 = 2;
    let gates: Vec<(NodeId, Gate)> = [21, 22]
        .into_iter()
        .map(|id| {
            let g = Gate {
                iteration: HELD,
                closed: Arc::new(AtomicBool::new(true)),
                holding: Arc::new(AtomicUsize::new(0)),
            };
            (id, g)
        })
        .collect();
    let gate = |id: NodeId| gates.iter().find(|(g, _)| *g == id).map(|(_, g)| g.clone());
    // Stage 1 has one relay (the joiner fills it); stage 2 holds back its
    // aggregation of iteration HELD.
    let layout = vec![(1, 0), (2, 0), (11, 1), (21, 2), (22, 2)];
    let all = |_: &Peer, all: &[Peer]| all.to_vec();
    let mut swarm = Swarm::start_with_bootstrap(&layout, gate, 4, all, 0, on_device);
    swarm.until("stage 1's update of the held iteration", |s| {
        s.digests_by.contains_key(&(11, HELD))
    });
    let holding = |id: usize| gates[id].1.holding.load(Ordering::SeqCst);
    swarm.until("stage 2's members holding their gradients", |_| {
        holding(0) > 0 && holding(1) > 0
    });
    swarm.join(12);
    swarm.until("the joiner's state download", |s| {
        s.downloads.iter().any(|(j, _)| *j == 12)
    });
    assert_eq!(
        swarm.seen.active.get(&12),
        Some(&1),
        "{:?}",
        swarm.seen.active
    );
    // The victim at stage 2: a member with microbatches in the commit.
    let victim = if holding(0) > 1 { 21 } else { 22 };
    swarm.kill(11);
    swarm.kill(victim);
    for (_, g) in &gates {
        g.closed.store(false, Ordering::SeqCst);
    }
    swarm.iterations_done(ITERATIONS);
    let last = &swarm.seen.last_commit[&(2, HELD)];
    assert!(last.iter().all(|m| m.1 != victim), "{last:?}");
    swarm.finish_and_check(ITERATIONS);
}

/// Joiners find each other: one joins stage 1, a later one stage 2, then
/// every founding relay dies, so each stage's only member is a joiner that
/// must know the other (the later joiner learns from the directory where
/// the earlier one serves, and introduces itself). Training goes on with
/// the reference's losses.
#[test]
fn joiners_in_neighbouring_stages_find_each_other() {
    let layout = vec![(1, 0), (2, 0), (11, 1), (21, 2), (22, 2)];
    let mut swarm = Swarm::start_gated(&layout, |_| None);
    swarm.iterations_done(1);
    // Stage 1 (one relay) is the bottleneck the first joiner fills.
    swarm.join(12);
    swarm.until("the first joiner's first update", |s| s.applied(12));
    assert_eq!(swarm.seen.active.get(&12), Some(&1));
    // Stage 2 down to one relay: the second joiner goes there.
    swarm.kill(22);
    swarm.until("stage 2 knowing it lost a relay", |s| {
        s.lost.contains(&(21, 22)) && s.lost.contains(&(1, 22))
    });
    swarm.join(23);
    swarm.until("the second joiner's first update", |s| s.applied(23));
    assert_eq!(swarm.seen.active.get(&23), Some(&2));
    swarm.kill(11);
    swarm.kill(21);
    swarm.iterations_done(ITERATIONS);
    swarm.finish_and_check(ITERATIONS);
}
