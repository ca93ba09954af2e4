//! The GWTF node: a sans-I/O state machine.
//!
//! `handle(now, input)` and `on_timeout(now)` return the actions to carry
//! out; `timeout()` is the next instant `on_timeout` wants to run. The node
//! never reads a clock, never touches a socket and never sleeps.
//!
//! This file is the dispatcher: it hands each input, each tick and each
//! peer's death to the part that owns it (the map is in the documentation
//! of `crate::protocol`); each part lives in a file of its own.
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use super::rng::{mix, Rng};
use super::types::*;

mod acks;
mod balancer;
mod barrier;
mod coordinator;
mod costs;
mod deputy;
mod fencing;
mod flow;
mod group;
pub use group::{AggregatePlan, BUTTERFLY_MAX_MEMBERS};
mod holder;
mod iterations;
mod join;
mod lifecycle;
mod membership;
mod peers;
mod recovery;
mod restore;
mod ring_links;
mod routing;
mod search;

use acks::*;
use barrier::*;
use coordinator::*;
use costs::*;
use flow::*;
use group::*;
use holder::*;
use iterations::*;
use join::*;
use lifecycle::*;
use membership::*;
use peers::*;
use restore::*;
use search::*;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    Querying {
        since: Time,
    },
    /// Asking the holders for their copies of an emptied stage's state
    /// (`restore`), since `since`.
    Restoring {
        since: Time,
    },
    /// Waiting for the states of an emptied stage's neighbours to rebuild
    /// it from (`restore`), asked at `since`.
    Rebuilding {
        since: Time,
    },
    /// Downloading the state of `stage` from `src`, asked at `since`.
    Downloading {
        stage: Stage,
        src: NodeId,
        since: Time,
    },
    Active,
    Left,
}

/// A GWTF node (data holder or relay). The fields past the identity are
/// grouped by the part that owns them; the peer view and what the node
/// knows of the iterations are shared.
pub struct Node {
    cfg: Arc<Config>,
    id: NodeId,
    stage: Stage,
    phase: Phase,
    rng: Rng,
    now: Time,
    /// Own estimate of one microbatch's fwd+bwd time on this stage.
    compute_s: f64,
    /// Microbatches its memory holds at once.
    capacity: u32,
    // ---- the dispatcher: actions out, messages to itself, timers, tasks
    out: Vec<Action>,
    selfq: VecDeque<Msg>,
    /// Early syncs to handle now (this node took over).
    replay: VecDeque<(NodeId, Msg)>,
    next_tick: Time,
    tick_no: u64,
    /// Trainer tasks running: (kind, microbatch, attempt).
    tasks: BTreeMap<TaskId, (TaskKind, Option<MbId>, u32)>,
    next_task: TaskId,
    // ---- shared: the peer view and what this node knows of the iterations
    peers: PeerMap,
    iters: Iterations,
    // ---- the parts' own state
    group: Group,
    joining: JoinState,
    restoring: Restoring,
    /// Stages next to this node's that had a live node (and which of
    /// them have none now): see `watch_adjacent_stages`.
    adjacent: AdjacentStages,
    cost_gossip: CostGossip,
    reservations: Reservations,
    search: LocalSearch,
    /// The centrally planned paths (central-mcmf routing), from `Input::SetPlan`.
    plan: Vec<Arc<Vec<NodeId>>>,
    dh: HolderState,
    lifecycle: Microbatches,
    acks: AckTimers,
    member: GroupMember,
    coordinating: Coordinator,
    /// The coordinator's own grants, copied to the member that would take
    /// over (see `deputy`).
    deputy_state: deputy::DeputyState,
    /// Coordinator: the links between members, for the all-reduce ring.
    ring_links: ring_links::RingLinks,
    barrier: Option<Barrier>,
    /// Passes through the join path after a fence (0: the first life).
    incarnation: u32,
    /// When this node last heard from any peer (see `fencing`).
    last_heard_any: Time,
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
            out: Vec::new(),
            selfq: VecDeque::new(),
            replay: VecDeque::new(),
            next_tick: 0,
            tick_no: 0,
            tasks: BTreeMap::new(),
            next_task: 1,
            dh: HolderState::default(),
            barrier: None,
            plan: Vec::new(),
            cfg,
            reservations: Reservations::default(),
            search: LocalSearch::starting_at(t0),
            cost_gossip: CostGossip::default(),
            acks: AckTimers::default(),
            lifecycle: Microbatches::default(),
            member: GroupMember::default(),
            coordinating: Coordinator::default(),
            deputy_state: deputy::DeputyState::default(),
            ring_links: Default::default(),
            joining: JoinState::default(),
            restoring: Restoring::default(),
            adjacent: AdjacentStages::default(),
            iters: Iterations::default(),
            group: Group::default(),
            incarnation: 0,
            last_heard_any: 0,
        }
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The oldest iteration whose microbatches this node still keeps (its
    /// runtime may free the tensors of older ones).
    pub fn oldest_kept_iteration(&self) -> u32 {
        self.iters.min_iter()
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
        self.iters.version()
    }

    /// How many times this node fenced itself and came back through the
    /// join path (0: its first life).
    pub fn incarnation(&self) -> u32 {
        self.incarnation
    }

    /// Whether trainer task `id` still belongs to this node's current
    /// state: after a fence ([`Event::Fenced`]) the results of the tasks
    /// given before are dropped.
    pub fn task_live(&self, id: TaskId) -> bool {
        self.tasks.contains_key(&id)
    }

    /// The member this node is downloading its stage's state from (a
    /// joiner, or a fenced node coming back); None when it is not.
    pub fn downloading_from(&self) -> Option<NodeId> {
        match self.phase {
            Phase::Downloading { src, .. } => Some(src),
            _ => None,
        }
    }

    /// The weights version (iteration, hash) this node kept at its fence,
    /// to serve again if its stage's members turn out to miss updates it
    /// holds (see [`Event::StateKept`]).
    pub fn kept_version(&self) -> Option<(u32, u64)> {
        self.joining.kept().map(|k| k.2)
    }

    /// The runtime's weights are not the version kept at the fence (an
    /// update was still missing): they are never served again.
    pub fn forget_kept(&mut self) {
        self.joining.forget_kept();
    }

    /// The coordinator this node believes in.
    pub fn coordinator(&self) -> Option<NodeId> {
        self.group.coord()
    }

    /// The live members of this node's stage group as it knows them.
    pub fn stage_members(&self) -> Vec<NodeId> {
        self.group
            .members()
            .iter()
            .copied()
            .filter(|m| self.alive(*m))
            .collect()
    }

    /// Reserved flows through this node (GWTF), for reporting.
    pub fn flow_count(&self) -> usize {
        self.reservations.flows().len()
    }

    /// Microbatches this node's memory holds at once (the flows it can carry).
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Reserved flows through this node: (in label, prev, next, out label).
    pub fn flows(&self) -> Vec<(Label, NodeId, NodeId, Label)> {
        self.reservations
            .flows()
            .values()
            .map(|f| (f.in_label(), f.prev(), f.next(), f.out_label()))
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
        let now = self.now;
        self.insert_flow(FlowEntry::new(
            in_label, sink, prev, next, out_label, 0.0, now,
        ));
    }

    /// Next instant at which `on_timeout` must run.
    pub fn timeout(&self) -> Option<Time> {
        if self.phase == Phase::Left || self.phase == Phase::Idle {
            return None;
        }
        let d = self.acks.next_deadline();
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
        self.check_own_clock(now);
        self.now = self.now.max(now);
        if self.phase == Phase::Left || self.phase == Phase::Idle {
            return;
        }
        while let Some(dl) = self.acks.pop_due(self.now) {
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
        self.check_own_clock(now);
        self.now = self.now.max(now);
        if self.phase == Phase::Left {
            return;
        }
        match input {
            Input::Start { peers } => self.start(peers),
            Input::Join { peers } => self.join(peers),
            Input::Message { from, msg } => self.on_msg(from, msg),
            Input::TaskDone { id } => self.task_done(id),
            Input::TaskFailed { id } => self.task_failed(id),
            Input::PeerLost { peer } => self.peer_dead(peer),
            Input::Heard { peers } => {
                if self.phase != Phase::Left {
                    let me = self.id;
                    for p in peers.into_iter().filter(|&p| p != me) {
                        self.heard_bytes_from(p);
                    }
                }
            }
            Input::Located { peer, stage } => self.on_located(peer, stage),
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
        self.run_recomputing(kind, mb, attempt, false)
    }

    /// [`Node::run`] with the task's [`Task::recompute`] flag.
    fn run_recomputing(
        &mut self,
        kind: TaskKind,
        mb: Option<MbId>,
        attempt: u32,
        recompute: bool,
    ) -> TaskId {
        let id = self.next_task;
        self.next_task += 1;
        if kind.is_compute() && mb.is_some() {
            self.note_gpu_wait();
        }
        self.tasks.insert(id, (kind, mb, attempt));
        self.out.push(Action::Run(Task {
            id,
            kind,
            stage: self.stage,
            mb,
            attempt,
            recompute,
        }));
        id
    }

    /// Seconds of compute a task of `kind` takes here, by this node's own
    /// estimate of its speed (a backward is two forwards).
    fn expected_task_s(&self, kind: TaskKind) -> f64 {
        match kind {
            TaskKind::Backward | TaskKind::EmbedBackward => 2.0 * self.compute_s / 3.0,
            _ => self.compute_s / 3.0,
        }
    }

    /// Seconds of compute queued for this node's GPU (the tasks handed to
    /// its trainer and not done yet).
    fn gpu_backlog_s(&self) -> f64 {
        (self.tasks.values())
            .filter(|(k, _, _)| k.is_compute())
            .map(|(k, _, _)| self.expected_task_s(*k))
            .sum()
    }

    /// Bytes of this node's stage state (0: not configured).
    fn own_state_bytes(&self) -> u64 {
        self.cfg
            .stage_state_bytes
            .get(self.stage as usize)
            .copied()
            .unwrap_or(0)
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
        self.reservations.new_label(self.id)
    }

    /// A peer is dead (suspected, expired, gone with a goodbye, or lost by
    /// the transport): each part lets go of what went through it.
    fn peer_dead(&mut self, p: NodeId) {
        if !self.mark_dead(p) {
            // Known dead already: a hop sent to it since (its connection
            // failed) fails now, not at its ack timeout (SWARM's: 75 s).
            if p != self.id {
                self.hops_lost_to(p);
            }
            return;
        }
        self.release_flows_through(p);
        self.hops_lost_to(p);
        self.recover_hops_through(p);
        self.coord_holder_gone(p);
        if matches!(self.phase, Phase::Downloading { src, .. } if src == p) {
            // The member serving our download is gone: ask another one.
            self.download_from_another();
        }
        self.restore_holder_gone(p);
    }

    /// The periodic work of an active node, part by part.
    fn tick(&mut self) {
        self.sample_gpu_busy();
        match self.phase.clone() {
            Phase::Querying { since } => {
                if self.now >= since + self.cfg.tick {
                    self.choose_stage();
                }
                return;
            }
            Phase::Restoring { since } => {
                self.restore_query_timed_out(since);
                return;
            }
            Phase::Rebuilding { since } => {
                // Neighbours' states that never come: rebuilt from those
                // that did.
                if self.now >= since + self.cfg.e2e_timeout {
                    self.finish_rebuild();
                }
                return;
            }
            Phase::Downloading { since, .. } => {
                // A download that never comes is asked of another member.
                if self.now >= since + self.cfg.e2e_timeout {
                    self.download_from_another();
                }
                self.holder_stranded();
                return;
            }
            Phase::Idle | Phase::Left => return,
            Phase::Active => {}
        }
        self.announce_gap();
        self.tell_rival_groups();
        let hb = self.cfg.heartbeat_ticks as u64;
        if self.tick_no % hb == 0 {
            self.watch_adjacent_stages();
            self.heartbeat();
        }
        let gossip_tick = self.tick_no % self.cfg.gossip_ticks as u64 == 1;
        if self.policy().reserves_flows() && !gossip_tick && self.tick_no % 3 == 0 {
            self.triggered_gossip();
        }
        if gossip_tick {
            // Every policy keeps its upstream informed of liveness, compute
            // speed and capacity (SWARM peers publish their throughput);
            // GWTF adds its costs to the sinks.
            self.gossip();
            if self.policy().reserves_flows() {
                self.local_search();
                self.reroute_flows();
            }
        }
        if self.tick_no % (4 * hb) == 0 {
            let cycle = 4 * hb * self.cfg.tick;
            self.introduce_all(Some(cycle));
            self.measure_group_links();
            self.report_group_links();
        }
        self.report_fresh_links();
        self.expire_silent_next_stage();
        if self.policy().reserves_flows() {
            self.flow_maintenance();
        }
        self.retry_stuck();
        if self.lifecycle.any_waiting() {
            self.admit_waiting();
            self.notify_waiting();
        }
        if self.group.coord() == Some(self.id) {
            self.coord_tick();
        }
        if self.stage == 0 {
            self.holder_tick();
        }
    }

    fn on_msg(&mut self, from: NodeId, msg: Msg) {
        if from != self.id {
            self.heard_from(from, matches!(msg, Msg::Goodbye));
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
            } => self.on_introduce(from, iter, stage, spare, compute_s, sent_at, echo),
            Msg::Probe { bytes, sent_at } => self.send(from, Msg::ProbeAck { bytes, sent_at }),
            Msg::ProbeAck { bytes, sent_at } => self.on_probe_ack(from, bytes, sent_at),
            Msg::Heartbeat {
                members,
                coord,
                updates,
                version,
            } => self.on_heartbeat(from, members, coord, (updates, version)),
            Msg::Goodbye => self.peer_dead(from),
            Msg::GroupJoin { stage, incarnation } => self.on_group_join(from, stage, incarnation),
            Msg::Evicted { diverged, updates } => self.on_evicted(from, diverged, updates),
            Msg::Change {
                spare,
                compute_s,
                costs,
            } => self.on_change(from, spare, compute_s, costs),
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
            Msg::QueryFlows => self.on_query_flows(from),
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
            Msg::NotifySwitch { label, new_prev } => self.on_notify_switch(label, new_prev),
            Msg::NotifyRedirect { label, new_next } => self.on_notify_redirect(label, new_next),
            Msg::PushBack { label } => self.on_push_back(from, label),
            Msg::Cancel { label } => self.on_cancel(from, label),
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
            } => self.on_crash_notice(mb, attempt, dead, after),
            Msg::Restart { mb, attempt } => self.on_restart_request(from, mb, attempt),
            Msg::Restarting { mb } => self.on_restarting(from, mb),
            Msg::Redo { mb, dead, next } => self.on_redo(mb, dead, next),
            Msg::StartIter { iter, holders } => {
                self.on_iteration_opened(iter, &holders);
                self.on_start_iter(iter, holders)
            }
            Msg::HolderDone { iter } => self.on_holder_done(from, iter),
            Msg::LinkReport { links } => self.on_link_report(from, links),
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
            Msg::Sync { iter, granted, end } => self.on_sync(from, iter, granted, end),
            Msg::Deputy { iter, granted } => self.on_deputy(from, iter, granted),
            Msg::Commit {
                iter,
                epoch,
                members,
                digest,
                mine,
            } => self.on_commit(from, iter, epoch, members, digest, mine),
            Msg::AggDone {
                iter,
                epoch,
                weights,
            } => self.on_agg_done(from, iter, epoch, weights),
            Msg::AggFailed { iter, epoch } => self.on_agg_failed(from, iter, epoch),
            Msg::Applied { iter, version } => self.on_applied(iter, version),
            Msg::StageDone { iter, stage } => self.on_stage_done(iter, stage),
            Msg::Finalize { .. } => {}
            Msg::StageQuery => self.on_stage_query(from),
            Msg::StageInfo { summary } => self.on_stage_info(from, summary),
            Msg::StateRequest => self.on_state_request(from),
            // The runtime serves it (a holder's copy, not a join).
            Msg::CopyRequest { .. } | Msg::KeptRequest { .. } | Msg::RebuildRequest { .. } => {}
            Msg::KeptQuery { stage } => self.on_kept_query(from, stage),
            Msg::KeptInfo {
                stage,
                iteration,
                open_iter,
            } => self.on_kept_info(from, stage, iteration, open_iter),
            Msg::StateResponse {
                version,
                members,
                coord,
                ..
            } => self.on_state_response(from, version, members, coord),
        }
    }
}

#[cfg(test)]
mod testkit;
