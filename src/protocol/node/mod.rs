//! The GWTF node: a sans-I/O state machine.
//!
//! `handle(now, input)` and `on_timeout(now)` return the actions to carry
//! out; `timeout()` is the next instant `on_timeout` wants to run. The node
//! never reads a clock, never touches a socket and never sleeps.
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use super::rng::{mix, Rng};
use super::types::*;

mod acks;
mod barrier;
mod coordinator;
mod costs;
mod flow;
mod group;
mod holder;
mod join;
mod lifecycle;
mod membership;
mod peers;
mod recovery;
mod routing;
mod search;

use acks::*;
use barrier::*;
use coordinator::*;
use flow::*;
use group::*;
use holder::*;
use lifecycle::*;
use membership::*;
use peers::*;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    Querying { since: Time },
    Downloading { stage: Stage },
    Active,
    Left,
}

/// A GWTF node (data holder or relay).
pub struct Node {
    cfg: Arc<Config>,
    id: NodeId,
    stage: Stage,
    phase: Phase,
    rng: Rng,
    now: Time,
    compute_s: f64,
    capacity: u32,
    peers: PeerMap,
    members: MemberSet,
    members_changed: bool,
    coord: Option<NodeId>,
    /// Nodes this node sent its stage state to (when), not yet seen as
    /// members: told to later joiners with the member list, so that two
    /// joiners whose only live contact dies meanwhile still find each other.
    joiners: BTreeMap<NodeId, Time>,
    out: Vec<Action>,
    selfq: VecDeque<Msg>,
    /// Syncs that reached this node before it knew it coordinates (a
    /// member saw the old coordinator leave or die first): (when, from,
    /// message), replayed once it takes over.
    early_syncs: Vec<(Time, NodeId, Msg)>,
    /// Early syncs to handle now (this node took over).
    replay: VecDeque<(NodeId, Msg)>,
    /// Claims that were pending at the last heartbeat (re-sent at the next
    /// one if still unanswered).
    stale_claims: BTreeSet<MbId>,
    next_tick: Time,
    tick_no: u64,
    deadlines: BTreeSet<(Time, Dl)>,
    outstanding: BTreeMap<(MbId, bool), Outstanding>,
    tasks: BTreeMap<TaskId, (TaskKind, Option<MbId>, u32)>,
    next_task: TaskId,
    snaps: BTreeMap<MbId, Snap>,
    flows: BTreeMap<Label, FlowEntry>,
    out_index: BTreeMap<Label, Label>,
    ghosts: BTreeMap<Label, (NodeId, Label)>,
    pending: BTreeMap<Label, PendingReq>,
    next_label: u64,
    sa_temp: f64,
    sa_skip: BTreeMap<NodeId, u32>,
    /// Holder (GWTF): EMA of the observed round trip (launch to gradient
    /// back) of a microbatch on each of its reserved flows, in seconds.
    flow_rtt: BTreeMap<Label, f64>,
    sa_busy_until: Time,
    dh: HolderState,
    acc: BTreeMap<u32, Acc>,
    coord_iters: BTreeMap<u32, CoordIter>,
    barrier: Option<Barrier>,
    end_fwd: BTreeMap<u32, Time>,
    version: (u32, u64),
    plan: Vec<Arc<Vec<NodeId>>>,
    last_coord_heard: Time,
    stage_infos: BTreeMap<Stage, StageSummary>,
    min_iter: u32,
    /// When the input of a hop arrived (for the busy time reported in acks).
    arrivals: BTreeMap<(MbId, bool), Time>,
    /// Last commit (coordinator, epoch) this member ran.
    last_commit: Option<(u32, u64)>,
    /// Downstream costs changed: gossip at the next tick (triggered update).
    gossip_dirty: bool,
    /// Last iteration whose aggregate this node applied.
    last_applied: Option<u32>,
    /// Coordinator: when each member was last heard from.
    member_heard: BTreeMap<NodeId, Time>,
    /// Holders: the latest iteration announced and its participants.
    seen_iter: Option<(u32, Arc<Vec<NodeId>>)>,
    /// Largest next iteration peers told us about.
    known_iter: u32,
    /// A relay told us which iteration comes next (`known_iter`): a holders'
    /// coordinator without a history of its own opens no iteration before.
    iter_heard: bool,
    /// A snapshot was marked stuck since the tick last looked for them.
    maybe_stuck: bool,
    /// Costs last gossiped upstream.
    advertised: Arc<[(NodeId, f64)]>,
    gossip_round: usize,
}

const INF: f64 = 1e12;

impl Node {
    /// A node with identity `id` serving `stage` (0 = data holder; a joining
    /// relay passes 0 and `joining = true`: its stage is chosen on join).
    /// `compute_s` is the node's own estimate of one microbatch's fwd+bwd
    /// time on its stage (from a local benchmark), `capacity` the number of
    /// microbatches its memory holds at once.
    pub fn new(
        cfg: Arc<Config>,
        id: NodeId,
        stage: Stage,
        compute_s: f64,
        capacity: u32,
        seed: u64,
    ) -> Node {
        let t0 = if stage == 0 {
            cfg.sa_t0_holder
        } else {
            cfg.sa_t0_relay
        };
        Node {
            id,
            stage,
            phase: Phase::Idle,
            rng: Rng::derive(seed, id as u64 + 1),
            now: 0,
            compute_s,
            capacity: capacity.max(1),
            peers: PeerMap::default(),
            members: MemberSet::default(),
            members_changed: true,
            joiners: BTreeMap::new(),
            coord: None,
            out: Vec::new(),
            selfq: VecDeque::new(),
            early_syncs: Vec::new(),
            replay: VecDeque::new(),
            stale_claims: BTreeSet::new(),
            next_tick: 0,
            tick_no: 0,
            deadlines: BTreeSet::new(),
            outstanding: BTreeMap::new(),
            tasks: BTreeMap::new(),
            next_task: 1,
            snaps: BTreeMap::new(),
            flows: BTreeMap::new(),
            out_index: BTreeMap::new(),
            ghosts: BTreeMap::new(),
            pending: BTreeMap::new(),
            next_label: 1,
            sa_temp: t0,
            sa_skip: BTreeMap::new(),
            flow_rtt: BTreeMap::new(),
            sa_busy_until: 0,
            dh: HolderState::default(),
            acc: BTreeMap::new(),
            coord_iters: BTreeMap::new(),
            barrier: None,
            end_fwd: BTreeMap::new(),
            version: (0, 0),
            plan: Vec::new(),
            last_coord_heard: 0,
            stage_infos: BTreeMap::new(),
            min_iter: 0,
            arrivals: BTreeMap::new(),
            last_commit: None,
            gossip_dirty: false,
            last_applied: None,
            member_heard: BTreeMap::new(),
            seen_iter: None,
            known_iter: 0,
            iter_heard: false,
            maybe_stuck: false,
            advertised: Arc::new([]),
            gossip_round: 0,
            cfg,
        }
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    pub fn is_holder(&self) -> bool {
        self.stage == 0 && self.phase == Phase::Active
    }

    /// Active: serving its stage (not joining, not gone).
    pub fn is_active(&self) -> bool {
        self.phase == Phase::Active
    }

    /// The weights version (iteration, hash) this node holds.
    pub fn version(&self) -> (u32, u64) {
        self.version
    }

    /// The coordinator this node believes in.
    pub fn coordinator(&self) -> Option<NodeId> {
        self.coord
    }

    /// Reserved flows through this node (GWTF), for reporting.
    pub fn flow_count(&self) -> usize {
        self.flows.len()
    }

    /// Holder: its reserved flows' first hops (GWTF).
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Reserved flows through this node: (in label, prev, next, out label).
    pub fn flows(&self) -> Vec<(Label, NodeId, NodeId, Label)> {
        self.flows
            .values()
            .map(|f| (f.in_label, f.prev, f.next, f.out_label))
            .collect()
    }

    /// Test support: installs a reserved flow as if the flow protocol had
    /// made it (to set up a given routing in protocol tests).
    #[doc(hidden)]
    pub fn test_add_flow(
        &mut self,
        in_label: Label,
        sink: NodeId,
        prev: NodeId,
        next: NodeId,
        out_label: Label,
    ) {
        self.insert_flow(FlowEntry {
            in_label,
            sink,
            prev,
            next,
            out_label,
            cost_from_source: 0.0,
            last_used: self.now,
        });
    }

    /// Next instant at which `on_timeout` must run.
    pub fn timeout(&self) -> Option<Time> {
        if self.phase == Phase::Left || self.phase == Phase::Idle {
            return None;
        }
        let d = self.deadlines.iter().next().map(|x| x.0);
        Some(match d {
            Some(d) => d.min(self.next_tick),
            None => self.next_tick,
        })
    }

    /// Runs timers that are due.
    pub fn on_timeout(&mut self, now: Time) -> Vec<Action> {
        let mut out = Vec::new();
        self.on_timeout_into(now, &mut out);
        out
    }

    /// [`Node::on_timeout`] appending its actions to `out` (a driver reuses
    /// one buffer instead of allocating one per call).
    pub fn on_timeout_into(&mut self, now: Time, out: &mut Vec<Action>) {
        self.now = self.now.max(now);
        if self.phase == Phase::Left || self.phase == Phase::Idle {
            return;
        }
        while let Some(&(t, dl)) = self.deadlines.iter().next() {
            if t > self.now {
                break;
            }
            self.deadlines.remove(&(t, dl));
            match dl {
                Dl::Ack(mb, back) => self.ack_deadline(mb, back),
            }
        }
        if self.now >= self.next_tick {
            self.next_tick = self.now + self.cfg.tick;
            self.tick_no += 1;
            self.tick();
        }
        self.drain_into(out)
    }

    /// Handles one input.
    pub fn handle(&mut self, now: Time, input: Input) -> Vec<Action> {
        let mut out = Vec::new();
        self.handle_into(now, input, &mut out);
        out
    }

    /// [`Node::handle`] appending its actions to `out`.
    pub fn handle_into(&mut self, now: Time, input: Input, out: &mut Vec<Action>) {
        self.now = self.now.max(now);
        if self.phase == Phase::Left {
            return;
        }
        match input {
            Input::Start { peers } => self.start(peers),
            Input::Join { peers } => self.join(peers),
            Input::Message { from, msg } => self.on_msg(from, msg),
            Input::TaskDone { id } => self.task_done(id),
            Input::PeerLost { peer } => self.peer_dead(peer),
            Input::Leave => self.leave(),
            Input::SetPlan { paths } => {
                self.plan = paths;
                if self.stage == 0 {
                    self.launch();
                }
            }
        }
        self.drain_into(out)
    }

    fn drain_into(&mut self, out: &mut Vec<Action>) {
        let mut guard = 0;
        loop {
            guard += 1;
            if guard > 100_000 {
                break;
            }
            if let Some(m) = self.selfq.pop_front() {
                self.on_msg(self.id, m);
            } else if let Some((from, m)) = self.replay.pop_front() {
                // A member that died since is not made a member again (its
                // grants were not in the aggregate).
                if self.alive(from) {
                    self.on_msg(from, m);
                }
            } else {
                break;
            }
        }
        out.append(&mut self.out);
    }

    fn send(&mut self, to: NodeId, msg: Msg) {
        if to == self.id {
            self.selfq.push_back(msg);
        } else {
            self.out.push(Action::Send { to, msg });
        }
    }

    fn event(&mut self, e: Event) {
        self.out.push(Action::Event(e));
    }

    fn run(&mut self, kind: TaskKind, mb: Option<MbId>, attempt: u32) -> TaskId {
        let id = self.next_task;
        self.next_task += 1;
        self.tasks.insert(id, (kind, mb, attempt));
        self.out.push(Action::Run(Task {
            id,
            kind,
            stage: self.stage,
            mb,
        }));
        id
    }

    fn s(&self) -> u16 {
        self.cfg.relay_stages
    }

    fn next_stage(&self) -> Stage {
        if self.stage == self.s() {
            0
        } else {
            self.stage + 1
        }
    }

    fn prev_stage(&self) -> Stage {
        if self.stage == 0 {
            self.s()
        } else {
            self.stage - 1
        }
    }

    fn new_label(&mut self) -> Label {
        let l = ((self.id as u64) << 32) | self.next_label;
        self.next_label += 1;
        l
    }

    fn tick(&mut self) {
        match self.phase.clone() {
            Phase::Querying { since } => {
                if self.now >= since + self.cfg.tick {
                    self.choose_stage();
                }
                return;
            }
            Phase::Downloading { .. } | Phase::Idle | Phase::Left => return,
            Phase::Active => {}
        }
        let hb = self.cfg.heartbeat_ticks as u64;
        if self.tick_no % hb == 0 {
            self.heartbeat();
        }
        let gossip_tick = self.tick_no % self.cfg.gossip_ticks as u64 == 1;
        if self.cfg.policy == Policy::Gwtf
            && self.gossip_dirty
            && !gossip_tick
            && self.tick_no % 3 == 0
        {
            self.gossip_dirty = false;
            // Triggered update only when what we advertise really changed.
            let now_costs = self.my_costs();
            let changed = now_costs.len() != self.advertised.len()
                || now_costs
                    .iter()
                    .zip(self.advertised.iter())
                    .any(|(a, b)| a.0 != b.0 || (a.1 - b.1).abs() > 0.02 * b.1.max(1e-9));
            if changed {
                self.gossip_costs(Some(now_costs));
            }
        }
        if gossip_tick {
            // Every policy keeps its upstream informed of liveness, compute
            // speed and capacity (SWARM peers publish their throughput);
            // GWTF adds its costs to the sinks.
            self.gossip_dirty = false;
            self.gossip();
            if self.cfg.policy == Policy::Gwtf {
                self.local_search();
                self.reroute_flows();
            }
        }
        if self.tick_no % (4 * hb) == 0 {
            let cycle = 4 * hb * self.cfg.tick;
            self.introduce_all(Some(cycle));
        }
        // Next-stage peers publish themselves (CHANGE) every gossip period;
        // one silent for three periods has left the view (like an expired
        // DHT record).
        let ns = self.next_stage();
        // With a bounded fanout a peer reaches each of its upstream peers
        // every ceil(view / fanout) rounds; three of those is the expiry.
        let view = self
            .peers
            .values()
            .filter(|p| p.stage == ns && !p.dead)
            .count()
            .max(1);
        let rounds = view.div_ceil(self.cfg.gossip_fanout.max(1)).max(1) as Time;
        let expiry = 3 * rounds * self.cfg.gossip_ticks as Time * self.cfg.tick;
        let now = self.now;
        let expired: Vec<NodeId> = self
            .peers
            .iter()
            .filter(|(_, p)| p.stage == ns && !p.dead && p.last_heard + expiry < now)
            .map(|(id, _)| *id)
            .collect();
        for p in expired {
            self.peer_dead(p);
        }
        if self.cfg.policy == Policy::Gwtf {
            self.flow_maintenance();
        }
        // Stuck recoveries (looked for only when a microbatch got stuck
        // since the last look).
        let stuck: Vec<MbId> = if std::mem::take(&mut self.maybe_stuck) {
            self.snaps
                .iter()
                .filter(|(_, s)| s.stuck)
                .map(|(m, _)| *m)
                .collect()
        } else {
            Vec::new()
        };
        for mb in stuck {
            let dead = self.snaps[&mb].next.unwrap_or(self.id);
            let (hint, redo) = (self.snaps[&mb].hint, self.snaps[&mb].grad_in);
            self.snaps.get_mut(&mb).unwrap().stuck = false;
            match (redo, hint) {
                (true, Some(h)) => self.redo(mb, dead, h),
                _ => self.recover(mb, dead, hint),
            }
        }
        if self.coord == Some(self.id) {
            self.coord_tick();
        }
        if self.stage == 0 {
            // Last resort (both policies): a microbatch with no news for
            // `e2e_timeout` is started again from here.
            let e2e = self.cfg.e2e_timeout;
            let now = self.now;
            let late: Vec<(MbId, u32)> = self
                .dh
                .in_flight
                .keys()
                .filter_map(|mb| self.snaps.get(mb).map(|s| (*mb, s)))
                .filter(|(_, s)| s.started + e2e <= now)
                .map(|(mb, s)| (mb, s.attempt))
                .collect();
            for (mb, attempt) in late {
                self.restart(mb, Some(attempt));
            }
            self.launch();
        }
    }

    fn on_msg(&mut self, from: NodeId, msg: Msg) {
        if from != self.id {
            if self.coord == Some(self.id) {
                self.member_heard.insert(from, self.now);
            }
            if let Some(p) = self.peers.get_mut(&from) {
                p.last_heard = self.now;
                if p.dead && !matches!(msg, Msg::Goodbye) {
                    // False suspicion: it is alive after all.
                    p.dead = false;
                }
            }
            if Some(from) == self.coord {
                self.last_coord_heard = self.now;
            }
        }
        if self.phase == Phase::Left {
            return;
        }
        match msg {
            Msg::Introduce {
                iter,
                stage,
                spare,
                compute_s,
                sent_at,
                echo,
            } => {
                self.known_iter = self.known_iter.max(iter);
                if stage != 0 {
                    self.iter_heard = true;
                }
                let now = self.now;
                let a = self.cfg.ema_alpha;
                let bytes = self.cfg.probe_bytes;
                let p = self.learn(from, stage);
                p.spare = spare;
                p.compute_s = compute_s;
                p.last_heard = now;
                match echo {
                    Some(t0) => {
                        let rtt = to_secs(now.saturating_sub(t0));
                        p.lat = Self::ema(p.lat, rtt / 2.0, a);
                        // Bandwidth probe on first contact only; data hops
                        // keep the estimate fresh afterwards.
                        if p.bw.is_none() {
                            self.send(
                                from,
                                Msg::Probe {
                                    bytes,
                                    sent_at: now,
                                },
                            );
                        }
                    }
                    None => {
                        let m = Msg::Introduce {
                            iter: self.iter_hint(),
                            stage: self.stage,
                            spare: self.spare(),
                            compute_s: self.compute_s,
                            sent_at: now,
                            echo: Some(sent_at),
                        };
                        self.send(from, m);
                    }
                }
                if stage == self.stage
                    && self.coord == Some(self.id)
                    && self.phase == Phase::Active
                    && self.members.insert(from)
                {
                    self.members_changed = true;
                }
            }
            Msg::Probe { bytes, sent_at } => self.send(from, Msg::ProbeAck { bytes, sent_at }),
            Msg::ProbeAck { bytes, sent_at } => {
                let a = self.cfg.ema_alpha;
                let now = self.now;
                if let Some(p) = self.peers.get_mut(&from) {
                    let rtt = to_secs(now.saturating_sub(sent_at));
                    let lat = p.lat.unwrap_or(0.0);
                    let xfer = (rtt - 2.0 * lat).max(1e-4);
                    p.bw = Self::ema(p.bw, bytes as f64 / xfer, a);
                }
            }
            Msg::Heartbeat { members } => {
                if let Some(ms) = members {
                    if Some(from) == self.coord || from < self.coord.unwrap_or(NodeId::MAX) {
                        self.members.assign(&ms, self.id);
                        self.recompute_coord();
                    }
                } else if self.coord != Some(self.id)
                    && self.phase == Phase::Active
                    && self.members.contains(&from)
                {
                    // A member takes us for its coordinator (a joiner that
                    // reached us while our own coordinator was failing): tell
                    // it who is, so it does not suspect a live member and
                    // coordinate a group of its own.
                    let members = self.members.list();
                    self.send(
                        from,
                        Msg::Heartbeat {
                            members: Some(members),
                        },
                    );
                }
            }
            Msg::Goodbye => self.peer_dead(from),
            Msg::GroupJoin { stage } => {
                let st = self.stage;
                if stage == st {
                    if let Some(p) = self.peers.get_mut(&from) {
                        p.dead = false;
                    }
                    self.member_heard.insert(from, self.now);
                    if self.members.insert(from) {
                        self.members_changed = true;
                    }
                    if self.coord == Some(self.id) && self.version.0 > 0 {
                        let (iter, version) = self.version;
                        self.send(from, Msg::Applied { iter, version });
                    }
                    self.recompute_coord();
                }
            }
            Msg::Change {
                spare,
                compute_s,
                costs,
            } => {
                let ns = self.next_stage();
                let p = self.learn(from, ns);
                p.spare = spare;
                p.compute_s = compute_s;
                // Only a material change (another sink set, or a cost moved
                // by more than 2%) triggers our own update upstream.
                if p.costs.material_change(&costs) {
                    p.costs = SinkCosts::from_gossip(costs);
                    self.gossip_dirty = true;
                }
            }
            Msg::FlowRequest {
                label,
                sink,
                cost_from_source,
                expected_cost,
            } => self.on_flow_request(from, label, sink, cost_from_source, expected_cost),
            Msg::FlowResponse {
                label,
                accept,
                cost,
                spare,
            } => self.on_flow_response(from, label, accept, cost, spare),
            Msg::QueryFlows => {
                let flows = self.flow_infos();
                let spare = self.spare();
                self.send(from, Msg::FlowTable { spare, flows });
            }
            Msg::FlowTable { spare, flows } => self.on_flow_table(from, spare, flows),
            Msg::ProposeSwap {
                mine,
                yours,
                mine_new_cost,
                temperature,
            } => self.on_propose_swap(from, mine, yours, mine_new_cost, temperature),
            Msg::RespondSwap {
                accept,
                mine,
                yours,
            } => self.on_respond_swap(from, accept, mine, yours),
            Msg::ProposeRedirect {
                yours,
                new_cost,
                temperature,
            } => self.on_propose_redirect(from, yours, new_cost, temperature),
            Msg::RespondRedirect { accept, flow } => self.on_respond_redirect(from, accept, flow),
            Msg::NotifySwitch { label, new_prev } => {
                if let Some(f) = self.flows.get_mut(&label) {
                    f.prev = new_prev;
                }
            }
            Msg::NotifyRedirect { label, new_next } => {
                if let Some(&inl) = self.out_index.get(&label) {
                    if let Some(f) = self.flows.get_mut(&inl) {
                        f.next = new_next;
                    }
                }
            }
            Msg::PushBack { label } => {
                if let Some(&inl) = self.out_index.get(&label) {
                    if self.flows.get(&inl).is_some_and(|f| f.next == from) {
                        self.drop_flow(inl, true, false);
                    }
                }
            }
            Msg::Cancel { label } => {
                if self.flows.get(&label).is_some_and(|f| f.prev == from) {
                    self.drop_flow(label, false, true);
                }
            }
            Msg::Forward {
                mb,
                attempt,
                path,
                label,
                hint,
                need_grad,
                plan,
            } => self.on_forward(from, mb, attempt, path, label, hint, need_grad, plan),
            Msg::Backward { mb, attempt, path } => self.on_backward(from, mb, attempt, path),
            Msg::Ack {
                mb,
                attempt,
                backward,
                busy,
                bytes,
            } => self.on_ack(from, mb, attempt, backward, busy, bytes),
            Msg::Queued {
                mb,
                attempt,
                backward,
                wait,
            } => self.on_queued(from, mb, attempt, backward, wait),
            Msg::CrashNotice {
                mb,
                attempt,
                dead,
                after,
            } => {
                self.peer_suspect(dead);
                let ok = self
                    .snaps
                    .get(&mb)
                    .is_some_and(|s| s.attempt == attempt && s.next == Some(dead) && !s.grad_in);
                if ok {
                    self.recover(mb, dead, Some(after));
                }
            }
            Msg::Restart { mb, attempt } => {
                self.restart(mb, attempt);
                // An aggregate lost its contribution: tell that stage's
                // coordinator we are alive and on it (queued restarts wait
                // for a free in-flight slot, which can take long).
                if attempt.is_none()
                    && from != self.id
                    && self.stage == 0
                    && mb.holder == self.id
                    && self.dh.iter == Some(mb.iter)
                    && (self.dh.restarts.contains(&mb) || self.dh.in_flight.contains_key(&mb))
                {
                    self.send(from, Msg::Restarting { mb });
                }
            }
            Msg::Restarting { mb } => self.on_restarting(from, mb),
            Msg::Redo { mb, dead, next } => {
                if self.snaps.get(&mb).is_some_and(|s| s.fwd_done) {
                    self.redo(mb, dead, next);
                } else if self.stage != 0 {
                    // No snapshot left here: the holder restarts it.
                    self.send(mb.holder, Msg::Restart { mb, attempt: None });
                }
            }
            Msg::StartIter { iter, holders } => self.on_start_iter(iter, holders),
            Msg::HolderDone { iter } => {
                if let Some(b) = self.barrier.as_mut() {
                    if b.iter == iter {
                        b.done.insert(from);
                    }
                }
            }
            Msg::EndIter {
                iter,
                origin,
                holders,
            } => self.on_end_iter(from, iter, origin, holders),
            Msg::Claim {
                iter,
                mb,
                prev,
                next,
            } => self.on_claim(from, iter, mb, prev, next),
            Msg::ClaimReply { mb, granted } => self.on_claim_reply(mb, granted),
            Msg::Sync { iter, granted, end } => {
                if self.coord == Some(self.id) {
                    for (mb, prev, next) in granted {
                        self.on_claim(from, iter, mb, prev, next);
                    }
                    if let Some((origin, holders)) = end {
                        self.on_end_iter(from, iter, origin, holders);
                    }
                } else if self.phase == Phase::Active && from != self.id {
                    // The member takes us for its coordinator: it saw ours
                    // leave or die before we did (a Goodbye or a suspicion
                    // can reach us later than its Sync). Dropping the Sync
                    // would lose its grants: the new coordinator would take
                    // its microbatches for missing and, at the holders'
                    // stage, drop them. Kept until we take over (or stale).
                    let keep = 2 * self.cfg.suspect_ticks as Time * self.cfg.tick;
                    let now = self.now;
                    self.early_syncs.retain(|(t, _, _)| t + keep >= now);
                    // Bounded: a flood of syncs is not kept (a real group
                    // sends one per member per coordinator change).
                    if self.early_syncs.len() < MAX_EARLY_SYNCS {
                        self.early_syncs
                            .push((now, from, Msg::Sync { iter, granted, end }));
                    }
                }
            }
            Msg::Commit {
                iter,
                epoch,
                members,
            } => {
                if self.last_commit == Some((iter, epoch)) {
                    return;
                }
                self.last_commit = Some((iter, epoch));
                self.acc.entry(iter).or_default();
                let n = members.len() as u32;
                let t = self.run(TaskKind::Aggregate { members: n }, None, 0);
                self.acc.get_mut(&iter).unwrap().agg_task = Some((t, epoch));
            }
            Msg::AggDone { iter, epoch } => {
                if let Some(ci) = self.coord_iters.get_mut(&iter) {
                    if ci.epoch == epoch && ci.commit.is_some() {
                        ci.agg_done.insert(from);
                    }
                }
                self.coord_check(iter);
            }
            Msg::Applied { iter, version } => self.on_applied(iter, version),
            Msg::StageDone { iter, stage } => {
                if let Some(b) = self.barrier.as_mut() {
                    if b.iter == iter {
                        b.stage_done.insert(stage);
                    }
                }
                self.barrier_check();
            }
            Msg::Finalize { .. } => {}
            Msg::StageQuery => {
                if self.phase == Phase::Active && self.stage > 0 {
                    let members = self.members.len() as u32;
                    let summary = StageSummary {
                        stage: self.stage,
                        members,
                        throughput: members as f64 / self.compute_s.max(1e-9),
                    };
                    self.send(from, Msg::StageInfo { summary });
                }
            }
            Msg::StageInfo { summary } => {
                self.learn(from, summary.stage);
                self.stage_infos.insert(summary.stage, summary);
            }
            Msg::StateRequest => {
                // The joiners served before (still downloading, or whose
                // GroupJoin may have reached nobody alive) go with the member
                // list: if every member this joiner hears of dies before it
                // is done, it still knows them and does not coordinate a
                // group of its own beside theirs (two groups of one stage
                // committing the same iterations). A download longer than
                // `e2e_timeout` is as good as gone.
                let now = self.now;
                let expiry = self.cfg.e2e_timeout;
                let joiners = std::mem::take(&mut self.joiners);
                self.joiners = joiners
                    .into_iter()
                    .filter(|&(j, t)| {
                        t + expiry > now && !self.members.contains(&j) && self.alive(j)
                    })
                    .collect();
                let members = if self.joiners.is_empty() {
                    self.members.list()
                } else {
                    let mut all: BTreeSet<NodeId> = self.members.iter().copied().collect();
                    all.extend(self.joiners.keys().copied());
                    Arc::new(all.into_iter().collect())
                };
                self.joiners.insert(from, now);
                let bytes = self
                    .cfg
                    .stage_state_bytes
                    .get(self.stage as usize)
                    .copied()
                    .unwrap_or(0);
                let version = self.version;
                self.send(
                    from,
                    Msg::StateResponse {
                        version,
                        members,
                        bytes,
                    },
                );
            }
            Msg::StateResponse {
                version, members, ..
            } => {
                if let Phase::Downloading { stage } = self.phase {
                    self.version = version;
                    if version != (0, 0) {
                        self.last_applied = Some(version.0);
                    }
                    // Members that joined us while we downloaded (a later
                    // joiner that took us for its coordinator) stay.
                    for &m in members.iter() {
                        self.members.insert(m);
                    }
                    self.members.insert(self.id);
                    // Keep only the views that matter to this stage.
                    let (ps, ns) = (self.prev_stage(), self.next_stage());
                    self.peers
                        .retain(|_, p| p.stage == ps || p.stage == ns || p.stage == stage);
                    self.become_active();
                    if let Some(c) = self.coord {
                        if c != self.id {
                            self.send(c, Msg::GroupJoin { stage });
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
