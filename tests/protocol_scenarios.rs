//! Protocol tests without the simulator: a few nodes wired through an
//! in-memory network with a virtual clock (fixed latencies, fixed task
//! times), small deterministic scenarios.
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::Arc;

use gwtf::protocol::{
    Action, Config, Event, Input, MbId, Msg, Node, NodeId, Policy, Stage, Task, TaskKind, Time, SEC,
};

const MS: Time = 1_000;

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Timer(NodeId),
    Done(NodeId, u64),
    Deliver(NodeId, NodeId, usize),
}

type KillWhen = Box<dyn Fn(NodeId, &Task) -> bool>;

/// A tiny driver: every message takes `lat(a, b)`, every task `task_ms`.
struct Net {
    nodes: BTreeMap<NodeId, Node>,
    dead: BTreeSet<NodeId>,
    q: BinaryHeap<Reverse<(Time, u64, Ev)>>,
    msgs: Vec<Option<Msg>>,
    now: Time,
    seq: u64,
    lat: Box<dyn Fn(NodeId, NodeId) -> Time>,
    tasks: Vec<(Time, NodeId, Task)>,
    sent: Vec<(Time, NodeId, NodeId, Msg)>,
    events: Vec<(Time, NodeId, Event)>,
    /// Kill a node when it starts a task matching this predicate.
    kill_on: Option<KillWhen>,
    timers: BTreeMap<NodeId, Time>,
    /// Tasks that end failed (an all-reduce that lost a member).
    failing: BTreeSet<(NodeId, u64)>,
}

impl Net {
    fn new(lat: impl Fn(NodeId, NodeId) -> Time + 'static) -> Net {
        Net {
            nodes: BTreeMap::new(),
            dead: BTreeSet::new(),
            q: BinaryHeap::new(),
            msgs: Vec::new(),
            now: 0,
            seq: 0,
            lat: Box::new(lat),
            tasks: Vec::new(),
            sent: Vec::new(),
            events: Vec::new(),
            kill_on: None,
            timers: BTreeMap::new(),
            failing: BTreeSet::new(),
        }
    }

    fn push(&mut self, t: Time, e: Ev) {
        self.seq += 1;
        self.q.push(Reverse((t, self.seq, e)));
    }

    fn add(&mut self, node: Node) {
        self.nodes.insert(node.id(), node);
    }

    fn input(&mut self, id: NodeId, input: Input) {
        if self.dead.contains(&id) {
            return;
        }
        let acts = self.nodes.get_mut(&id).unwrap().handle(self.now, input);
        self.apply(id, acts);
    }

    fn kill(&mut self, id: NodeId) {
        self.dead.insert(id);
    }

    /// The all-reduces running now end without the mean, as the runtime's
    /// ring does when a member is lost before its reduced chunk went on.
    fn abort_aggregates(&mut self) {
        for (_, id, t) in &self.tasks {
            if matches!(t.kind, TaskKind::Aggregate { .. }) {
                self.failing.insert((*id, t.id));
            }
        }
    }

    /// Every live node hears that `id` is gone.
    fn tell_lost(&mut self, id: NodeId) {
        let live: Vec<NodeId> = (self.nodes.keys())
            .copied()
            .filter(|n| !self.dead.contains(n))
            .collect();
        for n in live {
            self.input(n, Input::PeerLost { peer: id });
        }
    }

    fn apply(&mut self, id: NodeId, acts: Vec<Action>) {
        for a in acts {
            match a {
                Action::Send { to, msg } => {
                    self.sent.push((self.now, id, to, msg.clone()));
                    let t = self.now + (self.lat)(id, to);
                    self.msgs.push(Some(msg));
                    let i = self.msgs.len() - 1;
                    self.push(t, Ev::Deliver(id, to, i));
                }
                Action::Run(task) => {
                    if self.kill_on.as_ref().is_some_and(|k| k(id, &task)) {
                        self.kill_on = None;
                        self.kill(id);
                        return;
                    }
                    // A part started after a member of its ring died
                    // fails (the runtime's ring learns of it at its start).
                    if matches!(task.kind, TaskKind::Aggregate { .. }) {
                        let plan = self.nodes[&id].aggregate_plan(task.id);
                        if plan.is_some_and(|p| p.members.iter().any(|m| self.dead.contains(m))) {
                            self.failing.insert((id, task.id));
                        }
                    }
                    self.tasks.push((self.now, id, task));
                    let d = match task.kind {
                        TaskKind::Aggregate { .. } => 500 * MS,
                        TaskKind::Backward => 200 * MS,
                        _ => 100 * MS,
                    };
                    self.push(self.now + d, Ev::Done(id, task.id));
                }
                Action::Event(e) => self.events.push((self.now, id, e)),
            }
        }
        if let Some(t) = self.nodes[&id].timeout() {
            if self
                .timers
                .get(&id)
                .is_none_or(|&old| t < old || old < self.now)
            {
                self.timers.insert(id, t);
                self.push(t, Ev::Timer(id));
            }
        }
    }

    /// Runs until `until` (virtual time) or until `stop` holds.
    fn run(&mut self, until: Time, stop: impl Fn(&Net) -> bool) {
        let mut steps = 0u64;
        while let Some(Reverse((t, _, e))) = self.q.pop() {
            steps += 1;
            assert!(steps < 5_000_000, "runaway scenario");
            if t > until {
                self.push(t, e);
                break;
            }
            self.now = t;
            match e {
                Ev::Timer(id) => {
                    if self.dead.contains(&id) || self.timers.get(&id) != Some(&t) {
                        continue;
                    }
                    self.timers.remove(&id);
                    let acts = self.nodes.get_mut(&id).unwrap().on_timeout(t);
                    self.apply(id, acts);
                }
                Ev::Done(id, task) if self.failing.contains(&(id, task)) => {
                    self.input(id, Input::TaskFailed { id: task })
                }
                Ev::Done(id, task) => self.input(id, Input::TaskDone { id: task }),
                Ev::Deliver(from, to, i) => {
                    let msg = self.msgs[i].take().unwrap();
                    self.input(to, Input::Message { from, msg });
                }
            }
            if stop(self) {
                break;
            }
        }
    }

    fn finalized(&self, iter: u32) -> Option<Arc<Vec<NodeId>>> {
        self.events.iter().find_map(|(_, _, e)| match e {
            Event::IterFinalized {
                iter: k, holders, ..
            } if *k == iter => Some(holders.clone()),
            _ => None,
        })
    }

    fn forwards(&self, mb: MbId, stage: Stage) -> Vec<NodeId> {
        self.tasks
            .iter()
            .filter(|(_, _, t)| {
                t.mb == Some(mb)
                    && t.stage == stage
                    && matches!(t.kind, TaskKind::Forward | TaskKind::Embed)
            })
            .map(|x| x.1)
            .collect()
    }

    fn count(&self, mb: MbId, kind: TaskKind) -> usize {
        self.tasks
            .iter()
            .filter(|(_, _, t)| t.mb == Some(mb) && t.kind == kind)
            .count()
    }

    fn committed(&self, stage: Stage, iter: u32) -> Vec<(MbId, NodeId)> {
        self.events
            .iter()
            .find_map(|(_, _, e)| match e {
                Event::StageCommitted {
                    stage: s,
                    iter: k,
                    mbs,
                    ..
                } if *s == stage && *k == iter => Some((**mbs).clone()),
                _ => None,
            })
            .unwrap_or_default()
    }
}

fn config(policy: Policy, stages: Stage, mb: u32, in_flight: u32) -> Arc<Config> {
    let mut c = Config::new(policy, stages, 1 << 20);
    c.mb_per_iter = mb;
    c.max_in_flight = in_flight;
    c.stage_state_bytes = vec![1 << 20; stages as usize + 1];
    c.start_delay = 10 * SEC;
    Arc::new(c)
}

/// Starts `layout` (node id -> stage) with full views.
fn start(net: &mut Net, cfg: &Arc<Config>, layout: &[(NodeId, Stage)]) {
    for &(id, st) in layout {
        let compute = if st == 0 { 0.1 } else { 0.3 };
        net.add(Node::new(cfg.clone(), id, st, compute, 4, 7));
    }
    for &(id, _) in layout {
        let peers: Vec<(NodeId, Stage)> = layout.iter().copied().filter(|p| p.0 != id).collect();
        net.input(id, Input::Start { peers });
    }
}

fn flat(_: NodeId, _: NodeId) -> Time {
    10 * MS
}

#[test]
fn relay_crash_mid_backward_recomputes_only_its_stage() {
    // SWARM too: its backward is stateless, so another peer of the stage
    // recomputes the forward and runs the backward; nothing restarts.
    for policy in [Policy::Gwtf, Policy::CentralMcmf, Policy::Swarm] {
        let cfg = config(policy, 3, 1, 1);
        let mut net = Net::new(flat);
        // Holder 0; stage 1: 1, 2; stage 2: 3, 4; stage 3: 5, 6.
        let layout = [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (6, 3)];
        start(&mut net, &cfg, &layout);
        // The stage-2 relay dies the moment it starts the backward.
        net.kill_on = Some(Box::new(|_, t: &Task| {
            t.kind == TaskKind::Backward && t.stage == 2
        }));
        net.run(600 * SEC, |n| n.finalized(0).is_some());
        assert_eq!(
            net.finalized(0).as_deref(),
            Some(&vec![0]),
            "{policy:?}: iteration 0 finished"
        );
        let mb = MbId {
            holder: 0,
            iter: 0,
            idx: 0,
        };
        let dead = *net.dead.iter().next().expect("a relay was killed");
        let f2 = net.forwards(mb, 2);
        assert_eq!(
            f2.len(),
            2,
            "{policy:?}: stage 2 computed twice (crash + replacement)"
        );
        assert_eq!(f2[0], dead);
        let replacement = f2[1];
        assert_ne!(replacement, dead);
        for st in [0, 1, 3] {
            assert_eq!(
                net.forwards(mb, st).len(),
                1,
                "{policy:?}: stage {st} not recomputed"
            );
        }
        // The stage-3 node did not recompute: it re-sent its stored gradient.
        assert_eq!(net.count(mb, TaskKind::Loss), 1);
        let s3 = net.forwards(mb, 3)[0];
        let b3 = net
            .tasks
            .iter()
            .filter(|(_, id, t)| *id == s3 && t.kind == TaskKind::Backward && t.mb == Some(mb))
            .count();
        assert_eq!(b3, 1, "{policy:?}: stage 3 ran its backward once");
        let grads_to_repl = net
            .sent
            .iter()
            .filter(|(_, from, to, m)| {
                *from == s3 && *to == replacement && matches!(m, Msg::Backward { .. })
            })
            .count();
        assert_eq!(
            grads_to_repl, 1,
            "{policy:?}: stored gradient re-sent to the replacement"
        );
        // No restart of the whole microbatch, and the aggregate of stage 2
        // counts the replacement's result once.
        assert!(!net
            .events
            .iter()
            .any(|e| matches!(e.2, Event::Restarted { .. })));
        assert_eq!(net.committed(2, 0), vec![(mb, replacement)]);
        for st in 0..=3 {
            assert_eq!(net.committed(st, 0).len(), 1, "stage {st}");
        }
    }
}

#[test]
fn swarm_plus_restarts_the_whole_microbatch_after_a_backward_crash() {
    let cfg = config(Policy::SwarmPlus, 3, 1, 1);
    let mut net = Net::new(flat);
    let layout = [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (6, 3)];
    start(&mut net, &cfg, &layout);
    net.kill_on = Some(Box::new(|_, t: &Task| {
        t.kind == TaskKind::Backward && t.stage == 2
    }));
    net.run(600 * SEC, |n| n.finalized(0).is_some());
    assert!(net.finalized(0).is_some());
    let mb = MbId {
        holder: 0,
        iter: 0,
        idx: 0,
    };
    assert!(net
        .events
        .iter()
        .any(|e| matches!(e.2, Event::Restarted { .. })));
    // Every stage ran the forward again.
    for st in 0..=3 {
        assert!(net.forwards(mb, st).len() >= 2, "stage {st}");
    }
    // Still counted once per stage.
    for st in 0..=3 {
        assert_eq!(net.committed(st, 0).len(), 1, "stage {st}");
    }
}

#[test]
fn data_holder_crash_drops_its_microbatches_and_nobody_waits() {
    for policy in [Policy::Gwtf, Policy::Swarm] {
        let cfg = config(policy, 2, 4, 2);
        let mut net = Net::new(flat);
        let layout = [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2)];
        start(&mut net, &cfg, &layout);
        // Holder 1 dies when it computes its first loss.
        net.kill_on = Some(Box::new(|id, t: &Task| id == 1 && t.kind == TaskKind::Loss));
        net.run(900 * SEC, |n| n.finalized(0).is_some());
        assert!(net.dead.contains(&1));
        assert_eq!(net.finalized(0).as_deref(), Some(&vec![0]), "{policy:?}");
        for st in 0..=2 {
            let c = net.committed(st, 0);
            let mine: BTreeSet<u32> = c
                .iter()
                .filter(|x| x.0.holder == 0)
                .map(|x| x.0.idx)
                .collect();
            assert_eq!(
                mine,
                (0..4).collect(),
                "{policy:?} stage {st}: holder 0's microbatches once each"
            );
            assert!(c.iter().filter(|x| x.0.holder == 1).count() <= 4);
        }
        // The next iteration runs without the dead holder.
        net.run(net.now + 900 * SEC, |n| n.finalized(1).is_some());
        assert_eq!(net.finalized(1).as_deref(), Some(&vec![0]), "{policy:?}");
    }
}

#[test]
fn a_joining_node_picks_the_bottleneck_stage_and_downloads_its_state() {
    let cfg = config(Policy::Gwtf, 3, 2, 1);
    let mut net = Net::new(flat);
    // Stage 2 has one relay, the others two.
    let layout = [(0, 0), (1, 1), (2, 1), (3, 2), (5, 3), (6, 3)];
    start(&mut net, &cfg, &layout);
    net.run(60 * SEC, |_| false);
    net.add(Node::new(cfg.clone(), 9, 0, 0.3, 4, 7));
    let peers: Vec<(NodeId, Stage)> = layout.to_vec();
    net.input(9, Input::Join { peers });
    net.run(net.now + 120 * SEC, |n| {
        n.events
            .iter()
            .any(|(_, id, e)| *id == 9 && matches!(e, Event::Active { .. }))
    });
    let active = net.events.iter().find_map(|(_, id, e)| match e {
        Event::Active { stage } if *id == 9 => Some(*stage),
        _ => None,
    });
    assert_eq!(active, Some(2));
    assert!(net
        .sent
        .iter()
        .any(|(_, from, to, m)| *from == 3 && *to == 9 && matches!(m, Msg::StateResponse { .. })));
    // It then serves stage 2: training goes on and stage 2 applies with it.
    net.run(net.now + 600 * SEC, |n| n.finalized(2).is_some());
    assert!(net.finalized(2).is_some());
    assert_eq!(net.nodes[&9].version(), net.nodes[&3].version());
}

#[test]
fn crossed_flows_are_swapped_and_the_critical_path_drops() {
    // Holder 0; stage 1: relays 1, 2; stage 2 (last): relays 3, 4.
    // 1-3 and 2-4 are close, 1-4 and 2-3 are far.
    let lat = |a: NodeId, b: NodeId| -> Time {
        let (x, y) = (a.min(b), a.max(b));
        match (x, y) {
            (1, 3) | (2, 4) => MS,
            (1, 4) | (2, 3) => 200 * MS,
            _ => 20 * MS,
        }
    };
    let mut c = Config::new(Policy::Gwtf, 2, 1024);
    c.mb_per_iter = 1;
    c.max_in_flight = 0; // no reservations by the holder: the flows are set by hand
    let cfg = Arc::new(c);
    let mut net = Net::new(lat);
    let layout = [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2)];
    start(&mut net, &cfg, &layout);
    // Let measurements and cost gossip settle.
    net.run(30 * SEC, |_| false);
    // Crossed routing: 0 -> 1 -> 4 -> 0 and 0 -> 2 -> 3 -> 0.
    let add = |net: &mut Net, id: NodeId, inl, prev, next, outl| {
        net.nodes
            .get_mut(&id)
            .unwrap()
            .test_add_flow(inl, 0, prev, next, outl);
    };
    add(&mut net, 0, 100, 0, 1, 100);
    add(&mut net, 0, 200, 0, 2, 200);
    add(&mut net, 1, 100, 0, 4, 101);
    add(&mut net, 2, 200, 0, 3, 201);
    add(&mut net, 4, 101, 1, 0, 101);
    add(&mut net, 3, 201, 2, 0, 201);
    let cost = |path: &[NodeId]| -> Time {
        let mut c = 0;
        for w in path.windows(2) {
            c += lat(w[0], w[1]);
        }
        c + lat(*path.last().unwrap(), path[0])
    };
    let critical = |net: &Net| -> Time {
        let mut worst = 0;
        for r in [1, 2] {
            for (_, prev, next, _) in net.nodes[&r].flows() {
                worst = worst.max(cost(&[prev, r, next]));
            }
        }
        worst
    };
    let before = critical(&net);
    net.run(net.now + 120 * SEC, |n| {
        n.nodes[&1].flows().iter().all(|f| f.2 == 3) && n.nodes[&2].flows().iter().all(|f| f.2 == 4)
    });
    // Let the notifications to the next hops arrive.
    net.run(net.now + 5 * SEC, |_| false);
    assert_eq!(net.nodes[&1].flows().len(), 1);
    assert_eq!(net.nodes[&1].flows()[0].2, 3, "relay 1 now sends to 3");
    assert_eq!(net.nodes[&2].flows()[0].2, 4, "relay 2 now sends to 4");
    let after = critical(&net);
    assert!(after < before, "critical path {before} -> {after}");
    // The next hops learned their new upstream.
    let prev_of = |net: &Net, id: NodeId| net.nodes[&id].flows()[0].1;
    assert_eq!(prev_of(&net, 3), 1);
    assert_eq!(prev_of(&net, 4), 2);
}

/// Every holder is gone; a new holder takes over the holders' barrier. Its
/// links are slow (3 s each way), so at its first tick no relay has told it
/// which iteration comes next yet: it must wait for that rather than open
/// iteration 0 again (which the holders' stage already committed), and then
/// open the iteration the relays are at.
#[test]
fn a_new_holders_coordinator_waits_for_the_relays_iteration() {
    for policy in [Policy::Gwtf, Policy::Swarm] {
        let cfg = config(policy, 2, 2, 1);
        let mut net = Net::new(|a, b| if a == 9 || b == 9 { 3 * SEC } else { 10 * MS });
        let layout = [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2)];
        start(&mut net, &cfg, &layout);
        net.run(900 * SEC, |n| n.finalized(1).is_some());
        assert!(net.finalized(1).is_some(), "{policy:?}");
        net.kill(0);
        net.run(net.now + 30 * SEC, |_| false);
        net.add(Node::new(cfg.clone(), 9, 0, 0.1, 2, 7));
        let t0 = net.now;
        net.input(
            9,
            Input::Start {
                peers: layout[1..].to_vec(),
            },
        );
        net.run(net.now + 900 * SEC, |n| n.finalized(2).is_some());
        let started: Vec<(Time, u32)> = net
            .events
            .iter()
            .filter_map(|(t, id, e)| match e {
                Event::IterStarted { iter } if *id == 9 => Some((*t, *iter)),
                _ => None,
            })
            .collect();
        assert_eq!(started.first().map(|s| s.1), Some(2), "{policy:?}");
        // Not before a relay's answer (one round trip) came back.
        assert!(started[0].0 >= t0 + 6 * SEC, "{policy:?}");
        assert_eq!(net.finalized(2).as_deref(), Some(&vec![9]), "{policy:?}");
        // No stage committed an iteration twice.
        let mut seen = BTreeSet::new();
        for (_, _, e) in &net.events {
            if let Event::StageCommitted { stage, iter, .. } = e {
                assert!(
                    seen.insert((*stage, *iter)),
                    "{policy:?}: stage {stage} committed {iter} twice"
                );
            }
        }
    }
}

/// Two nodes join the stage of a single relay at once and download its
/// state; the relay dies right after serving them, before their GroupJoins
/// reach it. Neither hears of a live member from the relay's member list:
/// each coordinated a group of its own and both committed the same
/// iterations. The relay tells the second joiner of the first one, so they
/// form one group.
#[test]
fn joiners_whose_state_server_dies_form_one_group() {
    for policy in [Policy::Gwtf, Policy::Swarm] {
        let cfg = config(policy, 2, 2, 1);
        let mut net = Net::new(flat);
        // Stage 1 has one relay (the bottleneck), stage 2 two.
        let layout = [(0, 0), (1, 1), (3, 2), (4, 2)];
        start(&mut net, &cfg, &layout);
        net.run(900 * SEC, |n| n.finalized(1).is_some());
        assert!(net.finalized(1).is_some(), "{policy:?}");
        for id in [9, 10] {
            net.add(Node::new(cfg.clone(), id, 0, 0.3, 4, 7));
            net.input(
                id,
                Input::Join {
                    peers: layout.to_vec(),
                },
            );
        }
        let served = |n: &Net| {
            [9, 10].iter().all(|j| {
                n.sent.iter().any(|(_, from, to, m)| {
                    *from == 1 && to == j && matches!(m, Msg::StateResponse { .. })
                })
            })
        };
        net.run(net.now + 120 * SEC, served);
        assert!(served(&net), "{policy:?}: both joiners were served");
        net.kill(1);
        net.run(net.now + 900 * SEC, |n| n.finalized(4).is_some());
        assert!(net.finalized(4).is_some(), "{policy:?}");
        assert_eq!(net.nodes[&9].coordinator(), Some(9), "{policy:?}");
        assert_eq!(net.nodes[&10].coordinator(), Some(9), "{policy:?}");
        let mut seen = BTreeSet::new();
        for (_, _, e) in &net.events {
            if let Event::StageCommitted { stage, iter, .. } = e {
                assert!(
                    seen.insert((*stage, *iter)),
                    "{policy:?}: stage {stage} committed {iter} twice"
                );
            }
        }
    }
}

/// The holders' coordinator leaves while a holder's microbatch is granted;
/// the holder hears the Goodbye first and syncs its grants to the next
/// coordinator, whose own Goodbye is slower (1 s): the Sync reaches it before
/// it knows it coordinates. The Sync was dropped, the new coordinator took
/// the microbatch for missing and had it run again (at the holders' stage,
/// after a timeout, dropped). It is kept and counted once.
#[test]
fn a_sync_that_overtakes_the_coordinators_goodbye_is_kept() {
    use std::cell::Cell;
    use std::rc::Rc;
    for policy in [Policy::Gwtf, Policy::Swarm] {
        let cfg = config(policy, 2, 2, 1);
        let slow = Rc::new(Cell::new(false));
        let s = slow.clone();
        let mut net = Net::new(move |a, b| {
            if s.get() && a.min(b) == 0 && a.max(b) == 1 {
                SEC
            } else {
                10 * MS
            }
        });
        let layout = [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2)];
        start(&mut net, &cfg, &layout);
        net.run(900 * SEC, |n| n.finalized(1).is_some());
        assert!(net.finalized(1).is_some(), "{policy:?}");
        let granted = |n: &Net| {
            n.sent.iter().find_map(|(_, from, to, m)| match m {
                Msg::ClaimReply { mb, granted: true } if *from == 0 && *to == 2 && mb.iter >= 2 => {
                    Some(*mb)
                }
                _ => None,
            })
        };
        net.run(net.now + 300 * SEC, |n| granted(n).is_some());
        let mb = granted(&net).expect("holder 2 got a grant");
        slow.set(true);
        net.input(0, Input::Leave);
        net.kill(0);
        net.run(net.now + 900 * SEC, |n| n.finalized(mb.iter).is_some());
        assert!(net.finalized(mb.iter).is_some(), "{policy:?}");
        assert!(
            net.committed(0, mb.iter).contains(&(mb, 2)),
            "{policy:?}: {mb:?} in the holders' aggregate"
        );
        assert_eq!(net.count(mb, TaskKind::Embed), 1, "{policy:?}: run once");
        assert!(
            !net.sent
                .iter()
                .any(|(_, _, _, m)| matches!(m, Msg::Restart { mb: x, .. } if *x == mb)),
            "{policy:?}: nobody asked to restart {mb:?}"
        );
    }
}

/// When `stage`'s coordinator first sent a commit of iteration `iter`.
fn first_commit(net: &Net, layout: &[(NodeId, Stage)], stage: Stage, iter: u32) -> Option<Time> {
    net.sent
        .iter()
        .find(|(_, from, _, m)| {
            layout.contains(&(*from, stage))
                && matches!(m, Msg::Commit { iter: k, .. } if *k == iter)
        })
        .map(|x| x.0)
}

/// Each stage starts its all-reduce as soon as every microbatch of the
/// iteration is granted there: the last stage (the first to see the
/// backwards) commits before the holders' barrier ends the iteration and
/// before stage 1; every stage still counts each microbatch once.
#[test]
fn a_stage_whose_work_is_done_commits_before_the_iteration_ends() {
    let cfg = config(Policy::Gwtf, 3, 2, 2);
    let mut net = Net::new(flat);
    let layout = [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (6, 3)];
    start(&mut net, &cfg, &layout);
    net.run(600 * SEC, |n| n.finalized(0).is_some());
    assert!(net.finalized(0).is_some());
    let end = net
        .sent
        .iter()
        .find(|(_, from, _, m)| *from == 0 && matches!(m, Msg::EndIter { iter: 0, .. }))
        .map(|x| x.0)
        .expect("the iteration ended");
    let last = first_commit(&net, &layout, 3, 0).expect("stage 3 committed");
    let first = first_commit(&net, &layout, 1, 0).expect("stage 1 committed");
    assert!(last < end, "stage 3 committed at {last}, the end at {end}");
    assert!(last < first, "stage 3 at {last}, stage 1 at {first}");
    for st in 0..=3 {
        assert_eq!(net.committed(st, 0).len(), 2, "stage {st}");
    }
}

/// A stage's coordinator dies as it starts its part of the all-reduce (the
/// ring cannot go on without it: the survivors' parts fail) and the
/// transport reports it lost at once: a member takes over, the dead
/// coordinator's own contribution is recomputed and the survivors run the
/// all-reduce again, within a few ticks (not after `redo_timeout`).
#[test]
fn a_coordinator_lost_during_aggregation_is_recovered_within_a_few_ticks() {
    let cfg = config(Policy::Gwtf, 3, 8, 4);
    let mut net = Net::new(flat);
    let layout = [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (6, 3)];
    start(&mut net, &cfg, &layout);
    // Node 3 (stage 2's coordinator: the smallest id) dies when it starts
    // its part of the all-reduce, with contributions of its own granted.
    net.kill_on = Some(Box::new(|id, t: &Task| {
        id == 3 && matches!(t.kind, TaskKind::Aggregate { .. })
    }));
    net.run(600 * SEC, |n| !n.dead.is_empty());
    assert_eq!(net.dead.iter().copied().collect::<Vec<_>>(), [3]);
    let lost_at = net.now;
    net.abort_aggregates();
    net.tell_lost(3);
    net.run(lost_at + 600 * SEC, |n| n.finalized(0).is_some());
    assert!(net.finalized(0).is_some());
    let done_at = net.now;
    assert!(
        done_at - lost_at < cfg.redo_timeout / 2,
        "recovered {} s after the loss",
        (done_at - lost_at) / SEC
    );
    let stage2 = net.committed(2, 0);
    assert_eq!(stage2.len(), cfg.mb_per_iter as usize);
    assert!(stage2.iter().all(|(_, m)| *m == 4));
    for st in [0, 1, 3] {
        assert_eq!(net.committed(st, 0).len(), cfg.mb_per_iter as usize);
    }
}

/// The stage-2 relay that computed the microbatch's contribution dies
/// right after it claimed it, before the stage commits: GWTF has
/// the contribution recomputed; SWARM drops it (the stage aggregates what
/// it has), reported as dropped at that stage, never committed twice.
#[test]
fn a_lost_contribution_is_recomputed_by_gwtf_and_dropped_by_swarm() {
    for policy in [Policy::Gwtf, Policy::Swarm] {
        let cfg = config(policy, 3, 1, 1);
        let mut net = Net::new(flat);
        let layout = [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (6, 3)];
        start(&mut net, &cfg, &layout);
        // The stage-2 relay that ran the backward: it claimed its
        // contribution and sent the gradient on at the same instant.
        let claimant = |n: &Net| {
            n.sent.iter().find_map(|(_, from, _, m)| {
                ([3, 4].contains(from) && matches!(m, Msg::Backward { .. })).then_some(*from)
            })
        };
        net.run(600 * SEC, |n| claimant(n).is_some());
        let dead = claimant(&net).expect("stage 2 ran the backward");
        net.kill(dead);
        // An all-reduce it was to take part in cannot finish without it.
        net.abort_aggregates();
        net.run(900 * SEC, |n| n.finalized(0).is_some());
        assert!(net.finalized(0).is_some(), "{policy:?}");
        let mb = MbId {
            holder: 0,
            iter: 0,
            idx: 0,
        };
        let redos = net
            .sent
            .iter()
            .filter(|(_, _, _, m)| matches!(m, Msg::Redo { .. } | Msg::Restart { .. }))
            .count();
        let dropped_at_2 = net.events.iter().any(|(_, _, e)| {
            matches!(e, Event::StageCommitted { stage: 2, iter: 0, dropped, .. } if dropped.contains(&mb))
        });
        let committed = net.committed(2, 0);
        if policy == Policy::Swarm {
            assert_eq!(redos, 0, "SWARM recomputes nothing");
            assert!(dropped_at_2, "SWARM reports the contribution dropped");
            assert!(committed.is_empty(), "{committed:?}");
        } else {
            assert!(redos >= 1, "GWTF has it recomputed");
            assert!(!dropped_at_2);
            assert_eq!(committed.len(), 1);
            assert_ne!(committed[0].1, dead);
        }
    }
}

/// A stage's coordinator dies in the all-gather half of its all-reduce:
/// the ring goes on without it (the survivors' parts end with the mean, its
/// gradients in it), and its successor, which kept a copy of the grants it
/// gave itself, takes the commit over: the stage applies it with the dead
/// coordinator's microbatches, nothing recomputed, no new all-reduce.
#[test]
fn a_coordinator_lost_late_in_the_all_reduce_has_its_commit_taken_over() {
    let cfg = config(Policy::Gwtf, 3, 8, 4);
    let mut net = Net::new(flat);
    let layout = [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (6, 3)];
    start(&mut net, &cfg, &layout);
    let started = |n: &Net| {
        n.tasks
            .iter()
            .any(|(_, id, t)| *id == 3 && matches!(t.kind, TaskKind::Aggregate { .. }))
    };
    net.run(600 * SEC, started);
    let own = |n: &Net| {
        n.sent
            .iter()
            .filter(|(_, from, to, m)| *from == 3 && *to == 4 && matches!(m, Msg::Deputy { .. }))
            .count()
    };
    assert!(own(&net) > 0, "node 4 got copies of node 3's own grants");
    // 400 of its 500 ms in: node 3 is gone, the others' parts go on.
    let t = net.now + 400 * MS;
    net.run(t, |_| false);
    net.kill(3);
    net.tell_lost(3);
    let lost_at = net.now;
    net.run(lost_at + 600 * SEC, |n| n.finalized(0).is_some());
    assert!(net.finalized(0).is_some());
    let stage2 = net.committed(2, 0);
    assert_eq!(stage2.len(), cfg.mb_per_iter as usize);
    assert!(
        stage2.iter().any(|(_, m)| *m == 3),
        "the dead coordinator's microbatches are in: {stage2:?}"
    );
    let redone = net
        .sent
        .iter()
        .filter(|(t, _, _, m)| *t >= lost_at && matches!(m, Msg::Redo { .. } | Msg::Restart { .. }))
        .count();
    assert_eq!(redone, 0, "nothing recomputed");
    let commits = net
        .sent
        .iter()
        .filter(|(t, _, _, m)| *t >= lost_at && matches!(m, Msg::Commit { iter: 0, .. }))
        .count();
    assert_eq!(commits, 0, "no new all-reduce");
}
