//! The GWTF node: a sans-I/O state machine.
//!
//! `handle(now, input)` and `on_timeout(now)` return the actions to carry
//! out; `timeout()` is the next instant `on_timeout` wants to run. The node
//! never reads a clock, never touches a socket and never sleeps.
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use super::rng::{mix, Rng};
use super::types::*;

/// What a node knows about another node.
#[derive(Clone, Debug)]
struct Peer {
    stage: Stage,
    /// One-way latency (s), EMA.
    lat: Option<f64>,
    /// Bandwidth (bytes/s), EMA.
    bw: Option<f64>,
    /// Ack delay (s) of hops to this peer, EMA (adaptive timeouts).
    ack: Option<f64>,
    /// The peer's compute time per microbatch (fwd + bwd), as gossiped.
    compute_s: f64,
    spare: u32,
    /// The peer's gossiped cost to each sink.
    costs: SinkCosts,
    /// Not used for routing before this instant (suspected / banned).
    banned_until: Time,
    dead: bool,
    last_heard: Time,
    /// SWARM: microbatches sent to this peer and not yet acknowledged.
    queued: u32,
    /// SWARM: EMA of microbatches per second through this peer.
    thr: Option<f64>,
    /// When the hops this node sent to the peer are through the link, by
    /// the bandwidth estimate (transfers on a link share it), and when that
    /// busy period of the link began.
    link_free: Time,
    link_busy_since: Time,
}

impl Peer {
    fn new(stage: Stage, now: Time) -> Peer {
        Peer {
            stage,
            lat: None,
            bw: None,
            ack: None,
            compute_s: 1.0,
            link_free: 0,
            link_busy_since: 0,
            spare: 1,
            costs: SinkCosts::default(),
            banned_until: 0,
            dead: false,
            last_heard: now,
            queued: 0,
            thr: None,
        }
    }
}

/// The peers this node knows, by id: two vectors kept in id order (the
/// ids, searched, and the entries, side by side), so that a lookup reads a
/// few hundred bytes of ids and one entry, and a walk over the view reads
/// one contiguous array. Iteration is in id order, like a `BTreeMap`.
#[derive(Clone, Debug, Default)]
struct PeerMap {
    ids: Vec<NodeId>,
    entries: Vec<Peer>,
}

impl PeerMap {
    fn get(&self, id: &NodeId) -> Option<&Peer> {
        self.ids.binary_search(id).ok().map(|i| &self.entries[i])
    }
    fn get_mut(&mut self, id: &NodeId) -> Option<&mut Peer> {
        self.ids
            .binary_search(id)
            .ok()
            .map(|i| &mut self.entries[i])
    }
    fn contains_key(&self, id: &NodeId) -> bool {
        self.ids.binary_search(id).is_ok()
    }
    fn get_or_insert_with(&mut self, id: NodeId, new: impl FnOnce() -> Peer) -> &mut Peer {
        let i = match self.ids.binary_search(&id) {
            Ok(i) => i,
            Err(i) => {
                self.ids.insert(i, id);
                self.entries.insert(i, new());
                i
            }
        };
        &mut self.entries[i]
    }
    fn iter(&self) -> std::iter::Zip<std::slice::Iter<'_, NodeId>, std::slice::Iter<'_, Peer>> {
        self.ids.iter().zip(self.entries.iter())
    }
    fn values(&self) -> std::slice::Iter<'_, Peer> {
        self.entries.iter()
    }
    fn retain(&mut self, mut keep: impl FnMut(&NodeId, &mut Peer) -> bool) {
        let mut w = 0;
        for r in 0..self.ids.len() {
            if keep(&self.ids[r], &mut self.entries[r]) {
                self.ids.swap(w, r);
                self.entries.swap(w, r);
                w += 1;
            }
        }
        self.ids.truncate(w);
        self.entries.truncate(w);
    }
}

impl std::ops::Index<&NodeId> for PeerMap {
    type Output = Peer;
    fn index(&self, id: &NodeId) -> &Peer {
        self.get(id).expect("known peer")
    }
}

impl<'a> IntoIterator for &'a PeerMap {
    type Item = (&'a NodeId, &'a Peer);
    type IntoIter = std::iter::Zip<std::slice::Iter<'a, NodeId>, std::slice::Iter<'a, Peer>>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// A peer's cost to each sink: a short list (at most `gossip_sinks`
/// entries), sinks unique, ordered by (cost, sink) as `my_costs` produces
/// it, so that it is shared with the CHANGE message that carried it (one
/// gossip round costs one allocation however many peers receive it) and
/// `my_costs` merges the lists instead of scanning them all.
/// One allocation (counts and entries together): reading a list's head
/// costs one cache miss, not two.
#[derive(Clone, Debug)]
struct SinkCosts(Arc<[(NodeId, f64)]>);

impl Default for SinkCosts {
    fn default() -> SinkCosts {
        SinkCosts(Arc::new([]))
    }
}

/// The order of a cost list: by cost, then by sink.
fn cost_order(a: &(NodeId, f64), b: &(NodeId, f64)) -> std::cmp::Ordering {
    a.1.total_cmp(&b.1).then(a.0.cmp(&b.0))
}

impl SinkCosts {
    /// The gossiped list as it came; a list out of order or with a sink
    /// twice (not what `my_costs` sends) is put in order, the last entry
    /// of a sink winning.
    fn from_gossip(costs: Arc<[(NodeId, f64)]>) -> SinkCosts {
        let ordered = costs
            .windows(2)
            .all(|w| cost_order(&w[0], &w[1]) == std::cmp::Ordering::Less);
        let unique = || {
            if costs.len() <= 32 {
                return costs
                    .iter()
                    .enumerate()
                    .all(|(i, a)| costs[i + 1..].iter().all(|b| b.0 != a.0));
            }
            let mut sinks: Vec<NodeId> = costs.iter().map(|x| x.0).collect();
            sinks.sort_unstable();
            sinks.windows(2).all(|w| w[0] != w[1])
        };
        if ordered && unique() {
            return SinkCosts(costs);
        }
        let last: BTreeMap<NodeId, f64> = costs.iter().copied().collect();
        let mut v: Vec<(NodeId, f64)> = last.into_iter().collect();
        v.sort_by(cost_order);
        SinkCosts(v.into())
    }
    fn get(&self, sink: NodeId) -> Option<f64> {
        self.0.iter().find(|x| x.0 == sink).map(|x| x.1)
    }
    /// Whether `new` has other sinks than this list or a cost that moved
    /// by more than 2% (what makes a CHANGE worth passing on).
    fn material_change(&self, new: &[(NodeId, f64)]) -> bool {
        let moved = |old: f64, v: f64| (old - v).abs() > 0.02 * old.abs().max(1e-9);
        if new.len() != self.0.len() {
            return true;
        }
        // Usually the same sinks in the same order: compare side by side.
        if new.iter().zip(self.0.iter()).all(|(a, b)| a.0 == b.0) {
            return new.iter().zip(self.0.iter()).any(|(a, b)| moved(b.1, a.1));
        }
        new.iter()
            .any(|&(k, v)| self.get(k).is_none_or(|old| moved(old, v)))
    }
    fn insert(&mut self, sink: NodeId, cost: f64) {
        let mut v: Vec<(NodeId, f64)> = self.0.iter().copied().filter(|x| x.0 != sink).collect();
        let at = v.partition_point(|x| cost_order(x, &(sink, cost)) == std::cmp::Ordering::Less);
        v.insert(at, (sink, cost));
        self.0 = v.into();
    }
    fn remove(&mut self, sink: NodeId) {
        if let Some(i) = self.0.iter().position(|x| x.0 == sink) {
            let mut v = self.0.to_vec();
            v.remove(i);
            self.0 = v.into();
        }
    }
}

/// The next entry of one candidate's cost list in `my_costs`' merge
/// (ordered for a min-heap on (cost through the candidate, sink, list)).
struct MergeHead {
    v: f64,
    sink: NodeId,
    list: u32,
    pos: u32,
}

impl PartialEq for MergeHead {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == std::cmp::Ordering::Equal
    }
}
impl Eq for MergeHead {}
impl PartialOrd for MergeHead {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for MergeHead {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.v.total_cmp(&self.v)
            .then(o.sink.cmp(&self.sink))
            .then(o.list.cmp(&self.list))
    }
}

/// The members of this node's stage group: an ordered set, with its list
/// (what heartbeats, claims answers and state downloads carry) built once
/// per change and shared, not once per message.
#[derive(Clone, Debug, Default)]
struct MemberSet {
    set: BTreeSet<NodeId>,
    list: Option<Arc<Vec<NodeId>>>,
}

impl MemberSet {
    fn insert(&mut self, m: NodeId) -> bool {
        let new = self.set.insert(m);
        if new {
            self.list = None;
        }
        new
    }
    fn remove(&mut self, m: &NodeId) -> bool {
        let had = self.set.remove(m);
        if had {
            self.list = None;
        }
        had
    }
    fn contains(&self, m: &NodeId) -> bool {
        self.set.contains(m)
    }
    fn len(&self) -> usize {
        self.set.len()
    }
    fn iter(&self) -> std::collections::btree_set::Iter<'_, NodeId> {
        self.set.iter()
    }
    /// The members in increasing order.
    fn list(&mut self) -> Arc<Vec<NodeId>> {
        let set = &self.set;
        self.list
            .get_or_insert_with(|| Arc::new(set.iter().copied().collect()))
            .clone()
    }
    /// Becomes `list` plus `me`; a list equal to the current group (the
    /// periodic announcement of an unchanged group) costs one comparison.
    fn assign(&mut self, list: &Arc<Vec<NodeId>>, me: NodeId) {
        if list.windows(2).all(|w| w[0] < w[1]) {
            let has_me = list.binary_search(&me).is_ok();
            let same = if has_me {
                self.set.len() == list.len() && self.set.iter().eq(list.iter())
            } else {
                self.set.len() == list.len() + 1
                    && self.set.contains(&me)
                    && self.set.iter().filter(|&&m| m != me).eq(list.iter())
            };
            if same {
                return;
            }
            self.set = list.iter().copied().collect();
            self.set.insert(me);
            self.list = has_me.then(|| list.clone());
        } else {
            self.set = list.iter().copied().collect();
            self.set.insert(me);
            self.list = None;
        }
    }
}

impl FromIterator<NodeId> for MemberSet {
    fn from_iter<I: IntoIterator<Item = NodeId>>(it: I) -> MemberSet {
        MemberSet {
            set: it.into_iter().collect(),
            list: None,
        }
    }
}

impl IntoIterator for MemberSet {
    type Item = NodeId;
    type IntoIter = std::collections::btree_set::IntoIter<NodeId>;
    fn into_iter(self) -> Self::IntoIter {
        self.set.into_iter()
    }
}

impl<'a> IntoIterator for &'a MemberSet {
    type Item = &'a NodeId;
    type IntoIter = std::collections::btree_set::Iter<'a, NodeId>;
    fn into_iter(self) -> Self::IntoIter {
        self.set.iter()
    }
}

/// One reserved flow through this node (GWTF).
#[derive(Clone, Debug)]
struct FlowEntry {
    in_label: Label,
    sink: NodeId,
    /// Upstream node (the holder itself for a holder's own flows).
    prev: NodeId,
    next: NodeId,
    out_label: Label,
    cost_from_source: f64,
    last_used: Time,
}

#[derive(Clone, Debug)]
struct PendingReq {
    /// None for a holder's own request.
    in_label: Option<Label>,
    prev: NodeId,
    sink: NodeId,
    next: NodeId,
    cost_from_source: f64,
    tried: Vec<NodeId>,
    expires: Time,
    /// A reroute of the existing flow `in_label` (see [`Node::reroute_flows`]):
    /// on acceptance the flow switches to the new next hop; on refusal the
    /// flow simply keeps its current one (nothing is said upstream).
    reroute: bool,
}

/// Lightweight snapshot of one microbatch at this node.
#[derive(Clone, Debug)]
struct Snap {
    attempt: u32,
    /// Path up to and including this node (index = stage), then the full
    /// path once the backward came through.
    path: Arc<Vec<NodeId>>,
    prev: NodeId,
    next: Option<NodeId>,
    label_in: Option<Label>,
    hint: Option<NodeId>,
    plan: Option<Arc<Vec<NodeId>>>,
    need_grad: bool,
    fwd_task: Option<TaskId>,
    fwd_done: bool,
    bwd_task: Option<TaskId>,
    /// Holder: loss task (head fwd+bwd).
    loss_task: Option<TaskId>,
    /// Gradient for `prev` is computed and stored (re-sent on recovery).
    grad_ready: bool,
    /// The gradient from `next` arrived.
    grad_in: bool,
    done: bool,
    /// Waiting for a replacement to appear (recovery found no candidate).
    stuck: bool,
    /// When this node took the microbatch (attempt) in.
    started: Time,
}

/// Holder's iteration state.
#[derive(Clone, Debug, Default)]
struct HolderState {
    iter: Option<u32>,
    next_idx: u32,
    done: BTreeSet<u32>,
    in_flight: BTreeMap<MbId, Option<Label>>,
    restarts: VecDeque<MbId>,
    reported: bool,
}

/// Syncs kept for a coordinator role not yet taken over, at most.
const MAX_EARLY_SYNCS: usize = 1024;

/// A member's accumulated (granted) contributions of one iteration.
#[derive(Clone, Debug, Default)]
struct Acc {
    granted: BTreeMap<MbId, (NodeId, NodeId, Vec<TaskId>)>,
    pending: BTreeMap<MbId, (NodeId, NodeId, Vec<TaskId>)>,
    /// Claims that were refused. A claim is re-sent when unanswered for a
    /// heartbeat period, so a late grant can follow a refusal (the holder
    /// of the first grant died in between): the grant is honoured, since
    /// the coordinator counts the microbatch as ours from then on.
    refused: BTreeMap<MbId, (NodeId, NodeId, Vec<TaskId>)>,
    agg_task: Option<(TaskId, u64)>,
}

#[derive(Clone, Debug)]
struct Lost {
    prev: Option<NodeId>,
    next: Option<NodeId>,
    dead: NodeId,
    since: Time,
    level: u8,
}

/// Coordinator's state of one iteration of its stage.
#[derive(Clone, Debug, Default)]
struct CoordIter {
    end: Option<(NodeId, Arc<Vec<NodeId>>)>,
    end_at: Time,
    granted: BTreeMap<MbId, (NodeId, NodeId, NodeId)>,
    lost: BTreeMap<MbId, Lost>,
    dropped: BTreeSet<MbId>,
    epoch: u64,
    commit: Option<BTreeSet<NodeId>>,
    agg_done: BTreeSet<NodeId>,
    applied: bool,
    /// Expected microbatches not granted (nor dropped), once the iteration ended.
    missing: Option<BTreeSet<MbId>>,
}

/// Holders' coordinator: the iteration barrier.
#[derive(Clone, Debug, Default)]
struct Barrier {
    iter: u32,
    participants: Arc<Vec<NodeId>>,
    done: BTreeSet<NodeId>,
    ended: Option<Arc<Vec<NodeId>>>,
    ended_at: Time,
    stage_done: BTreeSet<Stage>,
    last_bcast: Time,
    stall_reported: BTreeMap<Stage, Time>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Dl {
    /// Ack of a hop of `mb` (backward or forward) not received.
    Ack(MbId, bool),
}

#[derive(Clone, Debug)]
struct Outstanding {
    to: NodeId,
    sent_at: Time,
    deadline: Time,
    bytes: u64,
    attempt: u32,
}

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

/// `newer` (a path up to some stage) followed by what `older` knows beyond it.
fn merge_path(newer: &Arc<Vec<NodeId>>, older: &Arc<Vec<NodeId>>) -> Arc<Vec<NodeId>> {
    if older.len() <= newer.len() {
        return newer.clone();
    }
    let mut v = (**newer).clone();
    v.extend_from_slice(&older[newer.len()..]);
    Arc::new(v)
}

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

    /// A one-line summary of the member state (debugging aid).
    pub fn debug_member(&self) -> String {
        format!(
            "node {} coord {:?} last_commit {:?} last_applied {:?} acc {:?} tasks {:?}",
            self.id,
            self.coord,
            self.last_commit,
            self.last_applied,
            self.acc
                .iter()
                .map(|(k, a)| (*k, a.granted.len(), a.pending.len(), a.agg_task))
                .collect::<Vec<_>>(),
            self.tasks
                .iter()
                .filter(|t| matches!(t.1 .0, TaskKind::Aggregate { .. }))
                .map(|t| *t.0)
                .collect::<Vec<_>>()
        )
    }

    /// A one-line summary of the coordinator state (debugging aid).
    pub fn debug_coord(&self) -> String {
        let mut out = format!(
            "node {} stage {} coord {:?} members {}",
            self.id,
            self.stage,
            self.coord,
            self.members.len()
        );
        for (k, ci) in &self.coord_iters {
            let exp = ci.end.as_ref().map(|e| self.expected(*k, &e.1));
            let missing: Vec<MbId> = exp
                .unwrap_or_default()
                .into_iter()
                .filter(|m| !ci.granted.contains_key(m) && !ci.dropped.contains(m))
                .collect();
            out.push_str(&format!(
                " | iter {k}: end {} granted {} lost {:?} dropped {} missing {:?} commit {:?} done {:?} applied {}",
                ci.end.is_some(),
                ci.granted.len(),
                ci.lost.iter().map(|(m, l)| (m.holder, m.idx, l.prev, l.next, l.dead, l.level, l.since / SEC)).collect::<Vec<_>>(),
                ci.dropped.len(),
                missing,
                ci.commit,
                ci.agg_done,
                ci.applied
            ));
        }
        out
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

    // ------------------------------------------------------------ helpers

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

    /// Not known to be dead (members of the group need not be in `peers`).
    fn alive(&self, p: NodeId) -> bool {
        p == self.id || !self.peers.get(&p).is_some_and(|x| x.dead)
    }

    fn learn(&mut self, p: NodeId, stage: Stage) -> &mut Peer {
        let now = self.now;
        let e = self.peers.get_or_insert_with(p, || Peer::new(stage, now));
        e.stage = stage;
        e
    }

    /// d_ij of GWTF.md section 3 from this node's measurements.
    fn link_cost(&self, j: NodeId) -> f64 {
        if j == self.id {
            return self.compute_s;
        }
        match self.peers.get(&j) {
            None => INF,
            Some(p) => self.link_cost_to(p),
        }
    }

    /// [`Node::link_cost`] to a peer other than this node, from its entry.
    fn link_cost_to(&self, p: &Peer) -> f64 {
        let lat = p.lat.unwrap_or(0.05);
        let bw = p.bw.unwrap_or(self.cfg.prior_bandwidth);
        let c = if p.stage == 0 { 0.0 } else { p.compute_s };
        (self.compute_s + c) / 2.0 + lat + self.cfg.activation_bytes as f64 / bw
    }

    /// Whether peer `j` (entry `p`) is a next hop candidate: next stage,
    /// not dead, not banned (what `next_candidates` lists).
    fn is_next_candidate(&self, j: NodeId, p: &Peer) -> bool {
        p.stage == self.next_stage() && !p.dead && p.banned_until <= self.now && j != self.id
    }

    /// Cost from this node's output to `sink` through next-stage peer `j`.
    fn cost_via(&self, j: NodeId, sink: NodeId) -> f64 {
        if self.stage == self.s() {
            return if j == sink { self.link_cost(sink) } else { INF };
        }
        match self.peers.get(&j).and_then(|p| p.costs.get(sink)) {
            Some(c) => self.link_cost(j) + c,
            None => INF,
        }
    }

    fn next_candidates(&self) -> Vec<NodeId> {
        self.peers
            .iter()
            .filter(|(id, p)| self.is_next_candidate(**id, p))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Best cost to `sink` (GWTF routing), with the next hop.
    fn best_to_sink(
        &self,
        sink: NodeId,
        need_spare: bool,
        exclude: &[NodeId],
    ) -> Option<(NodeId, f64)> {
        if self.stage == self.s() {
            if self.alive(sink) && self.peers.contains_key(&sink) {
                return Some((sink, self.link_cost(sink)));
            }
            return None;
        }
        let mut best: Option<(NodeId, f64)> = None;
        for (&j, p) in &self.peers {
            if !self.is_next_candidate(j, p) || exclude.contains(&j) {
                continue;
            }
            if need_spare && p.spare == 0 {
                continue;
            }
            // cost_via(j, sink) from the entry at hand.
            let c = match p.costs.get(sink) {
                Some(c) => self.link_cost_to(p) + c,
                None => INF,
            };
            if c >= INF {
                continue;
            }
            if best.is_none_or(|b| c < b.1) {
                best = Some((j, c));
            }
        }
        best
    }

    fn ema(old: Option<f64>, x: f64, a: f64) -> Option<f64> {
        Some(match old {
            None => x,
            Some(o) => o * (1.0 - a) + x * a,
        })
    }

    fn add_deadline(&mut self, key: (MbId, bool), o: Outstanding) {
        if let Some(old) = self.outstanding.insert(key, o.clone()) {
            self.deadlines
                .remove(&(old.deadline, Dl::Ack(key.0, key.1)));
        }
        self.deadlines.insert((o.deadline, Dl::Ack(key.0, key.1)));
    }

    fn clear_deadline(&mut self, key: (MbId, bool)) -> Option<Outstanding> {
        let o = self.outstanding.remove(&key)?;
        self.deadlines.remove(&(o.deadline, Dl::Ack(key.0, key.1)));
        Some(o)
    }

    fn ack_timeout_for(&self, to: NodeId) -> Time {
        match self.peers.get(&to).and_then(|p| p.ack) {
            Some(a) => secs(a * self.cfg.ack_timeout_mult).max(self.cfg.min_ack_timeout),
            None => self.cfg.initial_ack_timeout,
        }
    }

    fn send_tracked(&mut self, to: NodeId, msg: Msg, mb: MbId, backward: bool, attempt: u32) {
        let bytes = self.cfg.activation_bytes;
        let deadline = self.now + self.ack_timeout_for(to);
        // Hops sent to one peer share the link: remember when what this
        // node queued on it is through, by the bandwidth estimate.
        let now = self.now;
        let prior = self.cfg.prior_bandwidth;
        if let Some(p) = self.peers.get_mut(&to) {
            let xfer = secs(bytes as f64 / p.bw.unwrap_or(prior).max(1.0));
            if p.link_free <= now {
                p.link_busy_since = now;
            }
            p.link_free = p.link_free.max(now) + xfer;
        }
        self.add_deadline(
            (mb, backward),
            Outstanding {
                to,
                sent_at: self.now,
                deadline,
                bytes,
                attempt,
            },
        );
        if !backward && self.cfg.policy == Policy::Swarm {
            if let Some(p) = self.peers.get_mut(&to) {
                p.queued += 1;
            }
        }
        self.send(to, msg);
    }

    // ------------------------------------------------------------ start / join / leave

    fn start(&mut self, peers: Vec<(NodeId, Stage)>) {
        for (p, s) in peers {
            if s == self.stage {
                self.members.insert(p);
            } else if p != self.id {
                self.learn(p, s);
            }
        }
        self.members.insert(self.id);
        self.become_active();
        if self.stage == 0 {
            // The holders' coordinator opens the first iteration after the
            // start delay (flows are being built meanwhile).
            self.next_tick = self.now + self.cfg.tick;
        }
    }

    fn become_active(&mut self) {
        self.phase = Phase::Active;
        self.next_tick = self.now + self.cfg.tick;
        self.recompute_coord();
        self.introduce_all(None);
        if let Some(c) = self.coord {
            if c != self.id {
                let st = self.stage;
                self.send(c, Msg::GroupJoin { stage: st });
            }
        }
        let st = self.stage;
        self.event(Event::Active { stage: st });
    }

    /// Introductions to the previous and next stage; periodic ones go only
    /// to peers not heard from for `stale` (liveness and RTT refresh).
    fn introduce_all(&mut self, stale: Option<Time>) {
        let (ps, ns) = (self.prev_stage(), self.next_stage());
        let now = self.now;
        let targets: Vec<NodeId> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.dead && (p.stage == ps || p.stage == ns))
            .filter(|(_, p)| stale.is_none_or(|d| p.last_heard + d < now))
            .map(|(id, _)| *id)
            .collect();
        for t in targets {
            let m = self.intro_msg(None);
            self.send(t, m);
        }
    }

    /// The iteration this node believes comes next (told to new holders):
    /// past the last one applied here, and past the last one whose end was
    /// announced (an ended iteration takes no new microbatches; the holders'
    /// stage may already have applied it).
    fn iter_hint(&self) -> u32 {
        let a = self.last_applied.map_or(0, |a| a + 1);
        let s = self.seen_iter.as_ref().map_or(0, |s| s.0);
        let e = self.end_fwd.keys().next_back().map_or(0, |k| k + 1);
        a.max(s).max(e).max(self.min_iter).max(self.known_iter)
    }

    fn intro_msg(&self, echo: Option<Time>) -> Msg {
        Msg::Introduce {
            iter: self.iter_hint(),
            stage: self.stage,
            spare: self.spare(),
            compute_s: self.compute_s,
            sent_at: self.now,
            echo,
        }
    }

    fn join(&mut self, peers: Vec<(NodeId, Stage)>) {
        for (p, s) in peers {
            if p != self.id {
                self.learn(p, s);
            }
        }
        self.phase = Phase::Querying { since: self.now };
        self.next_tick = self.now + self.cfg.tick;
        let targets: Vec<NodeId> = {
            // Up to two peers of every relay stage.
            let mut per: BTreeMap<Stage, Vec<NodeId>> = BTreeMap::new();
            for (id, p) in &self.peers {
                if p.stage > 0 {
                    let v = per.entry(p.stage).or_default();
                    if v.len() < 2 {
                        v.push(*id);
                    }
                }
            }
            per.into_values().flatten().collect()
        };
        for t in targets {
            self.send(t, Msg::StageQuery);
        }
    }

    fn choose_stage(&mut self) {
        // Bottleneck first: the stage with the smallest aggregate throughput
        // (largest predicted time per microbatch) gains the most from us.
        let mut best: Option<(f64, Stage)> = None;
        for (s, info) in &self.stage_infos {
            if info.members == 0 {
                continue;
            }
            let t = 1.0 / info.throughput.max(1e-9);
            if best.is_none_or(|b| t > b.0) {
                best = Some((t, *s));
            }
        }
        let Some((_, stage)) = best else {
            // Nobody answered: ask again next tick.
            self.phase = Phase::Querying { since: self.now };
            return;
        };
        let src = self
            .peers
            .iter()
            .filter(|(_, p)| p.stage == stage && !p.dead)
            .map(|(id, _)| *id)
            .next();
        match src {
            Some(src) => {
                self.stage = stage;
                self.phase = Phase::Downloading { stage };
                self.send(src, Msg::StateRequest);
            }
            None => self.phase = Phase::Querying { since: self.now },
        }
    }

    fn leave(&mut self) {
        let all: BTreeSet<NodeId> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.dead)
            .map(|(id, _)| *id)
            .chain(self.members.iter().copied())
            .filter(|&p| p != self.id)
            .collect();
        for p in all {
            self.send(p, Msg::Goodbye);
        }
        self.phase = Phase::Left;
        self.event(Event::Left);
    }

    fn spare(&self) -> u32 {
        // A pending reroute belongs to a flow already counted.
        let used = self.flows.len() + self.pending.values().filter(|r| !r.reroute).count();
        self.capacity.saturating_sub(used as u32)
    }

    // ------------------------------------------------------------ membership

    fn recompute_coord(&mut self) {
        let old = self.coord;
        let c = self.members.iter().copied().find(|&m| self.alive(m));
        self.coord = c;
        if old != c {
            self.last_coord_heard = self.now;
            if c == Some(self.id) {
                self.members_changed = true;
                // Members heartbeated the old coordinator, not us: each gets
                // a full suspicion period from now (what we heard while not
                // coordinating is stale).
                let now = self.now;
                for &m in &self.members {
                    self.member_heard.insert(m, now);
                }
                // A new coordinator of the holders reopens the barrier from
                // its own knowledge.
                if self.stage == 0 && self.barrier.is_none() {
                    if let Some((k, participants)) = self.seen_iter.clone() {
                        self.barrier = Some(Barrier {
                            iter: k,
                            participants,
                            ..Default::default()
                        });
                        if self.dh.reported && self.dh.iter == Some(k) {
                            self.barrier.as_mut().unwrap().done.insert(self.id);
                        }
                    }
                }
                if old.is_some() {
                    // Our own contributions go into the new coordinator state.
                    self.sync_to(self.id);
                }
                // The members' syncs that came before we knew.
                let keep = 2 * self.cfg.suspect_ticks as Time * self.cfg.tick;
                let now = self.now;
                for (t, from, m) in std::mem::take(&mut self.early_syncs) {
                    if t + keep >= now {
                        self.replay.push_back((from, m));
                    }
                }
            } else if let Some(c) = c {
                if old.is_some() {
                    self.sync_to(c);
                }
            }
        }
    }

    fn sync_to(&mut self, c: NodeId) {
        let iters: Vec<u32> = self.acc.keys().copied().collect();
        for k in iters {
            let a = &self.acc[&k];
            let granted: Vec<(MbId, NodeId, NodeId)> = a
                .granted
                .iter()
                .map(|(m, (p, n, _))| (*m, *p, *n))
                .collect();
            let pend: Vec<(MbId, NodeId, NodeId)> = a
                .pending
                .iter()
                .map(|(m, (p, n, _))| (*m, *p, *n))
                .collect();
            self.send(
                c,
                Msg::Sync {
                    iter: k,
                    granted,
                    end: None,
                },
            );
            for (mb, prev, next) in pend {
                self.send(
                    c,
                    Msg::Claim {
                        iter: k,
                        mb,
                        prev,
                        next,
                    },
                );
            }
        }
        if self.stage == 0 {
            if let Some(k) = self.dh.iter {
                if self.dh.reported {
                    self.send(c, Msg::HolderDone { iter: k });
                }
            }
        }
        self.send(c, Msg::GroupJoin { stage: self.stage });
    }

    fn peer_dead(&mut self, p: NodeId) {
        if p == self.id {
            return;
        }
        if !self.peers.contains_key(&p) {
            let st = self.stage;
            self.learn(p, st);
        }
        let peer = self.peers.get_mut(&p).unwrap();
        if peer.dead {
            return;
        }
        peer.dead = true;
        peer.queued = 0;
        if self.members.remove(&p) {
            self.member_gone(p);
        }
        // Flows through the dead node.
        let through: Vec<Label> = self
            .flows
            .iter()
            .filter(|(_, f)| f.next == p || f.prev == p)
            .map(|(l, _)| *l)
            .collect();
        for l in through {
            let f = self.flows[&l].clone();
            if f.next == p {
                self.drop_flow(l, true, false);
            } else {
                self.drop_flow(l, false, true);
            }
        }
        let pend: Vec<Label> = self
            .pending
            .iter()
            .filter(|(_, r)| r.next == p)
            .map(|(l, _)| *l)
            .collect();
        for l in pend {
            self.retry_pending(l, p);
        }
        // Hops waiting for the dead node's ack.
        let waiting: Vec<(MbId, bool)> = self
            .outstanding
            .iter()
            .filter(|(_, o)| o.to == p)
            .map(|(k, _)| *k)
            .collect();
        for (mb, back) in waiting {
            self.ack_timeout(mb, back);
        }
        // Microbatches whose output went to the dead node and whose gradient
        // has not come back: the forward or backward through it is broken.
        if self.cfg.policy != Policy::Swarm {
            let broken: Vec<MbId> = self
                .snaps
                .iter()
                .filter(|(_, s)| s.next == Some(p) && s.fwd_done && !s.grad_in && !s.done)
                .map(|(m, _)| *m)
                .collect();
            for mb in broken {
                self.recover(mb, p, None);
            }
        }
    }

    fn member_gone(&mut self, p: NodeId) {
        self.members_changed = true;
        if self.coord == Some(self.id) {
            self.event(Event::MemberRemoved { peer: p });
        }
        let was_coord = self.coord == Some(p);
        if self.coord == Some(self.id) {
            self.coord_member_dead(p);
        }
        if was_coord {
            self.recompute_coord();
        }
    }

    // ------------------------------------------------------------ ticks

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

    fn heartbeat(&mut self) {
        let Some(c) = self.coord else { return };
        let limit = self.cfg.suspect_ticks as Time * self.cfg.tick;
        if c == self.id {
            let members: Vec<NodeId> = self.members.iter().copied().collect();
            let list = if self.members_changed
                || self.tick_no % (8 * self.cfg.heartbeat_ticks as u64) == 0
            {
                self.members_changed = false;
                Some(Arc::new(members.clone()))
            } else {
                None
            };
            // Suspect silent members.
            let now = self.now;
            for &m in &members {
                self.member_heard.entry(m).or_insert(now);
            }
            let silent: Vec<NodeId> = members
                .iter()
                .copied()
                .filter(|&m| m != self.id && self.member_heard[&m] + limit < now)
                .collect();
            for m in silent {
                self.peer_dead(m);
            }
            for m in self.members.clone() {
                if m != self.id {
                    self.send(
                        m,
                        Msg::Heartbeat {
                            members: list.clone(),
                        },
                    );
                }
            }
        } else {
            if self.last_coord_heard + limit < self.now {
                self.peer_dead(c);
                if let Some(nc) = self.coord {
                    if nc != self.id {
                        self.send(nc, Msg::Heartbeat { members: None });
                    }
                }
                return;
            }
            self.send(c, Msg::Heartbeat { members: None });
            self.resend_stale_claims(c);
        }
    }

    /// A claim still unanswered after a whole heartbeat period reached a node
    /// that did not coordinate (yet): it came before that node heard that
    /// its coordinator left or died, and was answered with a member list
    /// only. It is sent again (a claim is idempotent at the coordinator: the
    /// same claimant gets the same answer).
    fn resend_stale_claims(&mut self, c: NodeId) {
        let pending: BTreeSet<MbId> = self
            .acc
            .values()
            .flat_map(|a| a.pending.keys().copied())
            .collect();
        let stale: Vec<MbId> = pending.intersection(&self.stale_claims).copied().collect();
        for mb in stale {
            let (prev, next, _) = &self.acc[&mb.iter].pending[&mb];
            let (prev, next) = (*prev, *next);
            self.send(
                c,
                Msg::Claim {
                    iter: mb.iter,
                    mb,
                    prev,
                    next,
                },
            );
        }
        self.stale_claims = pending;
    }

    // ------------------------------------------------------------ messages

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

    fn peer_suspect(&mut self, p: NodeId) {
        let ban = self.cfg.ban_ticks as Time * self.cfg.tick;
        let now = self.now;
        if let Some(x) = self.peers.get_mut(&p) {
            x.banned_until = now + ban;
        }
    }

    // ------------------------------------------------------------ flow protocol (GWTF)

    /// The best cost to each sink through the next stage, the
    /// `gossip_sinks` cheapest, ordered by (cost, sink).
    ///
    /// Each candidate's list is ordered by cost, and adding the link cost
    /// keeps that order, so a k-way merge of the lists meets every sink
    /// first at its smallest cost: it stops after the `gossip_sinks`-th
    /// distinct sink (and its ties) instead of reading every entry.
    fn my_costs(&self) -> Vec<(NodeId, f64)> {
        let k = self.cfg.gossip_sinks;
        if k == 0 {
            return Vec::new();
        }
        if self.stage == self.s() {
            let mut v: Vec<(NodeId, f64)> = self
                .peers
                .iter()
                .filter(|(_, p)| p.stage == 0 && !p.dead)
                .map(|(id, _)| (*id, self.link_cost(*id)))
                .filter(|x| x.1 < INF)
                .collect();
            if v.len() > k {
                v.select_nth_unstable_by(k - 1, cost_order);
                v.truncate(k);
            }
            v.sort_unstable_by(cost_order);
            return v;
        }
        let ns = self.next_stage();
        let mut lists: Vec<(f64, &[(NodeId, f64)])> = Vec::new();
        for (&j, p) in &self.peers {
            if p.stage != ns || p.dead || p.banned_until > self.now || j == self.id {
                continue;
            }
            lists.push((self.link_cost_to(p), &p.costs.0));
        }
        // The heads, read in a pass of their own: the lists live in their
        // senders' memory, and independent loads overlap their misses.
        let heads: Vec<MergeHead> = lists
            .iter()
            .enumerate()
            .filter_map(|(i, &(lc, list))| {
                list.first().map(|&(sink, c)| MergeHead {
                    v: lc + c,
                    sink,
                    list: i as u32,
                    pos: 0,
                })
            })
            .collect();
        let mut heap = std::collections::BinaryHeap::from(heads);
        let mut out: Vec<(NodeId, f64)> = Vec::with_capacity(k);
        let mut threshold: Option<f64> = None;
        while let Some(h) = heap.pop() {
            let (lc, list) = lists[h.list as usize];
            if let Some(&(sink, c)) = list.get(h.pos as usize + 1) {
                heap.push(MergeHead {
                    v: lc + c,
                    sink,
                    list: h.list,
                    pos: h.pos + 1,
                });
            }
            if h.v.is_nan() && h.v.is_sign_negative() {
                continue;
            }
            // Infinite (or NaN) costs and everything after them are out;
            // past the k-th sink, only ties of its cost still count.
            if h.v.partial_cmp(&INF) != Some(std::cmp::Ordering::Less)
                || threshold.is_some_and(|t| h.v > t)
            {
                break;
            }
            if !out.iter().any(|x| x.0 == h.sink) {
                out.push((h.sink, h.v));
                if out.len() == k {
                    threshold = Some(h.v);
                }
            }
        }
        out.sort_unstable_by(cost_order);
        out.truncate(k);
        out
    }

    fn gossip(&mut self) {
        self.gossip_costs(None)
    }

    /// CHANGE to the upstream peers; `costs` when the caller has just
    /// computed `my_costs()` (the node's state has not changed since).
    fn gossip_costs(&mut self, costs: Option<Vec<(NodeId, f64)>>) {
        let costs: Arc<[(NodeId, f64)]> = if self.cfg.policy == Policy::Gwtf && self.stage > 0 {
            costs.unwrap_or_else(|| self.my_costs()).into()
        } else {
            Arc::new([])
        };
        self.advertised = costs.clone();
        let spare = self.spare();
        let ps = self.prev_stage();
        let ups: Vec<NodeId> = self
            .peers
            .iter()
            .filter(|(_, p)| p.stage == ps && !p.dead)
            .map(|(id, _)| *id)
            .collect();
        // Bounded fanout: at most `gossip_fanout` upstream peers per round,
        // taken in turn (round robin), plus those whose flows pass here.
        let fan = self.cfg.gossip_fanout.max(1);
        let mut targets: BTreeSet<NodeId> = BTreeSet::new();
        if ups.len() <= fan {
            targets.extend(ups.iter().copied());
        } else {
            let start = self.gossip_round % ups.len();
            for i in 0..fan {
                targets.insert(ups[(start + i) % ups.len()]);
            }
            self.gossip_round = (start + fan) % ups.len();
        }
        for f in self.flows.values() {
            if f.prev != self.id {
                targets.insert(f.prev);
            }
        }
        for u in targets {
            self.send(
                u,
                Msg::Change {
                    spare,
                    compute_s: self.compute_s,
                    costs: costs.clone(),
                },
            );
        }
    }

    fn flow_maintenance(&mut self) {
        let now = self.now;
        // Expired reservations.
        let expired: Vec<Label> = self
            .pending
            .iter()
            .filter(|(_, r)| r.expires <= now)
            .map(|(l, _)| *l)
            .collect();
        for l in expired {
            let r = self.pending.remove(&l).unwrap();
            if r.reroute {
                continue;
            }
            if let Some(inl) = r.in_label {
                self.send(
                    r.prev,
                    Msg::FlowResponse {
                        label: inl,
                        accept: false,
                        cost: INF,
                        spare: self.spare(),
                    },
                );
            }
        }
        // Idle flows.
        let idle = self.cfg.flow_idle_expiry_ticks as Time * self.cfg.tick;
        let stale: Vec<Label> = self
            .flows
            .iter()
            .filter(|(_, f)| f.last_used + idle < now)
            .map(|(l, _)| *l)
            .collect();
        for l in stale {
            self.drop_flow(l, true, true);
        }
        // Holders reserve flows up to their in-flight bound (one request
        // per missing unit, each toward the best next hop with spare room).
        if self.stage == 0 {
            let have = self.flows.len() + self.pending.values().filter(|r| !r.reroute).count();
            for _ in have..self.cfg.max_in_flight as usize {
                if let Some((j, c)) = self.best_to_sink(self.id, true, &[]) {
                    let label = self.new_label();
                    let expected = c - self.link_cost(j);
                    self.pending.insert(
                        label,
                        PendingReq {
                            in_label: None,
                            prev: self.id,
                            sink: self.id,
                            next: j,
                            cost_from_source: 0.0,
                            tried: vec![j],
                            expires: now
                                + self.cfg.reservation_expiry_ticks as Time * self.cfg.tick,
                            reroute: false,
                        },
                    );
                    if let Some(p) = self.peers.get_mut(&j) {
                        p.spare = p.spare.saturating_sub(1);
                    }
                    self.send(
                        j,
                        Msg::FlowRequest {
                            label,
                            sink: self.id,
                            cost_from_source: 0.0,
                            expected_cost: expected,
                        },
                    );
                }
            }
        }
    }

    /// Rerouting of reserved flows (GWTF.md section 5: CHANGE gossip is
    /// there so that upstream nodes pick the next hop minimising
    /// d(me, j) + cost_to_sink(j)). Flows are reserved greedily when they
    /// are built, often right after a crash, through the cheapest next hop
    /// that had room at that moment; the gossip later shows cheaper next
    /// hops with spare capacity (a joiner, capacity released elsewhere), and
    /// the swap and redirect moves of the local search cannot use them (a
    /// swap needs a same-stage peer with a flow to the same sink, a redirect
    /// moves a flow into the proposer only). So, once per gossip period,
    /// this node moves the one flow that gains most to the cheapest next
    /// hop with spare capacity, when that lowers the flow's cost to its sink
    /// by more than `reroute_min_gain`. The new downstream segment is
    /// reserved first (FLOW_REQUEST with the cost expected); only when it is
    /// accepted is the old one cancelled, so the flow always has a path.
    /// Only local knowledge is used: own link costs and gossiped costs.
    fn reroute_flows(&mut self) {
        if self.stage == self.s() || self.pending.values().any(|r| r.reroute) {
            return;
        }
        let mut best: Option<(f64, Label, NodeId, f64)> = None;
        for f in self.flows.values() {
            let cur = self.cost_via(f.next, f.sink);
            if cur >= INF {
                continue;
            }
            let Some((j, c)) = self.best_to_sink(f.sink, true, &[f.next]) else {
                continue;
            };
            let gain = cur - c;
            if gain > self.cfg.reroute_min_gain * cur && best.is_none_or(|b| gain > b.0) {
                best = Some((gain, f.in_label, j, c));
            }
        }
        let Some((_, inl, j, c)) = best else { return };
        let f = self.flows[&inl].clone();
        let out = self.new_label();
        self.pending.insert(
            out,
            PendingReq {
                in_label: Some(f.in_label),
                prev: f.prev,
                sink: f.sink,
                next: j,
                cost_from_source: f.cost_from_source,
                tried: vec![j],
                expires: self.now + self.cfg.reservation_expiry_ticks as Time * self.cfg.tick,
                reroute: true,
            },
        );
        if let Some(p) = self.peers.get_mut(&j) {
            p.spare = p.spare.saturating_sub(1);
        }
        let expected = c - self.link_cost(j);
        self.send(
            j,
            Msg::FlowRequest {
                label: out,
                sink: f.sink,
                cost_from_source: f.cost_from_source,
                expected_cost: expected,
            },
        );
    }

    /// The new downstream segment `out` through `next` of a reroute was
    /// accepted: switch the flow to it and cancel the old segment, unless
    /// the flow is gone or the new segment is no longer cheaper (then the
    /// new one is cancelled instead).
    fn finish_reroute(&mut self, r: PendingReq, out: Label, next: NodeId) {
        let keep = r.in_label.and_then(|inl| self.flows.get(&inl)).filter(|f| {
            f.sink == r.sink
                && f.next != next
                && self.cost_via(next, f.sink) < self.cost_via(f.next, f.sink)
        });
        let Some(f) = keep.cloned() else {
            self.send(next, Msg::Cancel { label: out });
            return;
        };
        self.out_index.remove(&f.out_label);
        self.send(f.next, Msg::Cancel { label: f.out_label });
        let e = self.flows.get_mut(&f.in_label).unwrap();
        e.next = next;
        e.out_label = out;
        self.out_index.insert(out, f.in_label);
    }

    /// Removes a flow entry; tells upstream (PushBack) and/or downstream (Cancel).
    fn drop_flow(&mut self, in_label: Label, upstream: bool, downstream: bool) {
        let Some(f) = self.flows.remove(&in_label) else {
            return;
        };
        self.out_index.remove(&f.out_label);
        if upstream && f.prev != self.id {
            self.send(f.prev, Msg::PushBack { label: f.in_label });
        }
        if downstream && self.stage != self.s() {
            self.send(f.next, Msg::Cancel { label: f.out_label });
        }
    }

    fn insert_flow(&mut self, f: FlowEntry) {
        self.out_index.insert(f.out_label, f.in_label);
        self.flows.insert(f.in_label, f);
    }

    fn on_flow_request(
        &mut self,
        from: NodeId,
        label: Label,
        sink: NodeId,
        cfs: f64,
        expected: f64,
    ) {
        if self.phase != Phase::Active || self.stage == 0 {
            return;
        }
        let ps = self.prev_stage();
        self.learn(from, ps);
        let reject = |me: &mut Node, cost: f64| {
            let spare = me.spare();
            me.send(
                from,
                Msg::FlowResponse {
                    label,
                    accept: false,
                    cost,
                    spare,
                },
            );
        };
        if self.spare() == 0 {
            let c = self.best_to_sink(sink, false, &[]).map_or(INF, |b| b.1);
            return reject(self, c);
        }
        let Some((j, c)) = self.best_to_sink(sink, true, &[]) else {
            return reject(self, INF);
        };
        if c > expected * (1.0 + self.cfg.stale_cost_tolerance) + 1e-6 {
            return reject(self, c);
        }
        let cfs_here = cfs + self.link_cost(from);
        if self.stage == self.s() {
            self.insert_flow(FlowEntry {
                in_label: label,
                sink,
                prev: from,
                next: sink,
                out_label: label,
                cost_from_source: cfs_here,
                last_used: self.now,
            });
            let spare = self.spare();
            self.send(
                from,
                Msg::FlowResponse {
                    label,
                    accept: true,
                    cost: c,
                    spare,
                },
            );
            return;
        }
        let out = self.new_label();
        let expected_next = c - self.link_cost(j);
        self.pending.insert(
            out,
            PendingReq {
                in_label: Some(label),
                prev: from,
                sink,
                next: j,
                cost_from_source: cfs_here,
                tried: vec![j],
                expires: self.now + self.cfg.reservation_expiry_ticks as Time * self.cfg.tick,
                reroute: false,
            },
        );
        if let Some(p) = self.peers.get_mut(&j) {
            p.spare = p.spare.saturating_sub(1);
        }
        self.send(
            j,
            Msg::FlowRequest {
                label: out,
                sink,
                cost_from_source: cfs_here,
                expected_cost: expected_next,
            },
        );
    }

    fn on_flow_response(
        &mut self,
        from: NodeId,
        label: Label,
        accept: bool,
        cost: f64,
        spare: u32,
    ) {
        let ns = self.next_stage();
        let sink_known = self.pending.get(&label).map(|r| r.sink);
        {
            let p = self.learn(from, ns);
            p.spare = spare;
            if let Some(sink) = sink_known {
                if !accept {
                    if cost >= INF {
                        p.costs.remove(sink);
                    } else {
                        p.costs.insert(sink, cost);
                    }
                }
            }
        }
        let Some(r) = self.pending.remove(&label) else {
            if accept {
                self.send(from, Msg::Cancel { label });
            }
            return;
        };
        if accept && r.reroute {
            self.finish_reroute(r, label, from);
        } else if accept {
            let total = self.link_cost(from) + cost;
            match r.in_label {
                None => self.insert_flow(FlowEntry {
                    in_label: label,
                    sink: r.sink,
                    prev: self.id,
                    next: from,
                    out_label: label,
                    cost_from_source: 0.0,
                    last_used: self.now,
                }),
                Some(inl) => {
                    self.insert_flow(FlowEntry {
                        in_label: inl,
                        sink: r.sink,
                        prev: r.prev,
                        next: from,
                        out_label: label,
                        cost_from_source: r.cost_from_source,
                        last_used: self.now,
                    });
                    let spare = self.spare();
                    self.send(
                        r.prev,
                        Msg::FlowResponse {
                            label: inl,
                            accept: true,
                            cost: total,
                            spare,
                        },
                    );
                }
            }
        } else {
            self.pending.insert(label, r);
            self.retry_pending(label, from);
        }
    }

    /// A downstream candidate refused or died: try another, or give up.
    fn retry_pending(&mut self, label: Label, failed: NodeId) {
        let Some(mut r) = self.pending.remove(&label) else {
            return;
        };
        if r.reroute {
            // The flow still runs on its current next hop.
            return;
        }
        if !r.tried.contains(&failed) {
            r.tried.push(failed);
        }
        if r.tried.len() < 3 {
            if let Some((j, c)) = self.best_to_sink(r.sink, true, &r.tried) {
                r.tried.push(j);
                r.next = j;
                let expected = c - self.link_cost(j);
                let (sink, cfs) = (r.sink, r.cost_from_source);
                self.pending.insert(label, r);
                self.send(
                    j,
                    Msg::FlowRequest {
                        label,
                        sink,
                        cost_from_source: cfs,
                        expected_cost: expected,
                    },
                );
                return;
            }
        }
        if let Some(inl) = r.in_label {
            let c = self.best_to_sink(r.sink, false, &[]).map_or(INF, |b| b.1);
            let spare = self.spare();
            self.send(
                r.prev,
                Msg::FlowResponse {
                    label: inl,
                    accept: false,
                    cost: c,
                    spare,
                },
            );
        }
    }

    fn flow_info(&self, f: &FlowEntry) -> FlowInfo {
        FlowInfo {
            in_label: f.in_label,
            sink: f.sink,
            prev: f.prev,
            next: f.next,
            out_label: f.out_label,
            cost_from_source: f.cost_from_source,
            cost_to_sink: self.cost_via(f.next, f.sink),
        }
    }

    fn flow_infos(&self) -> Vec<FlowInfo> {
        self.flows.values().map(|f| self.flow_info(f)).collect()
    }

    fn local_search(&mut self) {
        if self.stage == 0 || self.flows.is_empty() || self.sa_busy_until > self.now {
            return;
        }
        // A random one of the candidates: the members, in id order, but
        // this node, those known dead and those skipped. The excluded ones
        // are few (a stage group can hold thousands): find their positions
        // in the member list and index around them.
        let list = self.members.list();
        let mut out: Vec<usize> = list.binary_search(&self.id).ok().into_iter().collect();
        for (id, p) in &self.peers {
            if p.dead {
                out.extend(list.binary_search(id).ok());
            }
        }
        for (id, &v) in &self.sa_skip {
            if v != 0 {
                out.extend(list.binary_search(id).ok());
            }
        }
        out.sort_unstable();
        out.dedup();
        let cands = list.len() - out.len();
        for v in self.sa_skip.values_mut() {
            *v = v.saturating_sub(1);
        }
        if cands == 0 {
            return;
        }
        // The r-th member not excluded.
        let mut at = self.rng.below(cands as u64) as usize;
        for &x in &out {
            if x > at {
                break;
            }
            at += 1;
        }
        let b = list[at];
        self.sa_busy_until = self.now + self.cfg.gossip_ticks as Time * self.cfg.tick;
        self.send(b, Msg::QueryFlows);
    }

    fn accept_move(&mut self, old: f64, new: f64, temperature: f64) -> bool {
        if new < old - 1e-9 {
            return true;
        }
        let gain = (old - new) / self.cfg.cost_unit_s;
        let t = temperature.max(1e-6);
        self.rng.next_f64() < (gain / t).exp()
    }

    fn on_flow_table(&mut self, from: NodeId, spare: u32, flows: Vec<FlowInfo>) {
        let _ = spare;
        // Best swap: my flow f and its flow g to the same sink.
        let mut best: Option<(f64, Msg)> = None;
        for f in self.flows.values() {
            let fi = self.flow_info(f);
            let f_full = fi.cost_from_source + fi.cost_to_sink;
            for g in &flows {
                if g.sink != f.sink || g.next == f.next {
                    continue;
                }
                let g_full = g.cost_from_source + g.cost_to_sink;
                let old_max = f_full.max(g_full);
                let f_new = f.cost_from_source + self.cost_via(g.next, f.sink);
                if f_new >= INF {
                    continue;
                }
                let score = f_new - old_max;
                if score < 0.0 && best.as_ref().is_none_or(|b| score < b.0) {
                    best = Some((
                        score,
                        Msg::ProposeSwap {
                            mine: fi.clone(),
                            yours: g.in_label,
                            mine_new_cost: f_new,
                            temperature: self.sa_temp,
                        },
                    ));
                }
            }
        }
        // Redirect: take over its worst flow when I have spare capacity.
        if best.is_none() && self.spare() > 0 {
            for g in &flows {
                if !self.peers.contains_key(&g.prev) && g.prev != self.id {
                    continue;
                }
                if g.prev == self.id {
                    continue;
                }
                let mine = self.link_cost_from(g.prev) + self.link_cost(g.next) - self.compute_s;
                let via_next = if self.stage == self.s() {
                    0.0
                } else {
                    match self.peers.get(&g.next).and_then(|p| p.costs.get(g.sink)) {
                        Some(c) => c,
                        None => continue,
                    }
                };
                let new_total = g.cost_from_source - 0.0 + mine + via_next;
                let old_total = g.cost_from_source + g.cost_to_sink;
                let score = new_total - old_total;
                if score < 0.0 && best.as_ref().is_none_or(|b| score < b.0) {
                    best = Some((
                        score,
                        Msg::ProposeRedirect {
                            yours: g.in_label,
                            new_cost: mine,
                            temperature: self.sa_temp,
                        },
                    ));
                }
            }
        }
        match best {
            Some((_, m)) => self.send(from, m),
            None => self.sa_busy_until = self.now,
        }
    }

    /// Cost of the hop from `p` into this node, from this node's view.
    fn link_cost_from(&self, p: NodeId) -> f64 {
        self.link_cost(p)
    }

    fn on_propose_swap(
        &mut self,
        from: NodeId,
        mine: FlowInfo,
        yours: Label,
        mine_new_cost: f64,
        temperature: f64,
    ) {
        let reject = |me: &mut Node| {
            me.send(
                from,
                Msg::RespondSwap {
                    accept: false,
                    mine: mine.in_label,
                    yours: None,
                },
            )
        };
        // Two concurrent moves between the same peers would undo each
        // other: while busy with its own move, a node only yields to a
        // smaller id.
        if self.sa_busy_until > self.now && from > self.id {
            return reject(self);
        }
        let Some(g) = self.flows.get(&yours).cloned() else {
            return reject(self);
        };
        if g.sink != mine.sink || g.next == mine.next {
            return reject(self);
        }
        let gi = self.flow_info(&g);
        let g_old = gi.cost_from_source + gi.cost_to_sink;
        let g_new = g.cost_from_source + self.cost_via(mine.next, g.sink);
        if g_new >= INF {
            return reject(self);
        }
        let old_max = g_old.max(mine.cost_from_source + mine.cost_to_sink);
        let new_max = g_new.max(mine_new_cost);
        if !self.accept_move(old_max, new_max, temperature) {
            return reject(self);
        }
        // Take the proposer's downstream segment.
        self.out_index.remove(&g.out_label);
        {
            let e = self.flows.get_mut(&yours).unwrap();
            e.next = mine.next;
            e.out_label = mine.out_label;
        }
        self.out_index.insert(mine.out_label, yours);
        self.send(
            mine.next,
            Msg::NotifySwitch {
                label: mine.out_label,
                new_prev: self.id,
            },
        );
        self.send(
            from,
            Msg::RespondSwap {
                accept: true,
                mine: mine.in_label,
                yours: Some(gi),
            },
        );
    }

    fn on_respond_swap(
        &mut self,
        from: NodeId,
        accept: bool,
        mine: Label,
        yours: Option<FlowInfo>,
    ) {
        self.sa_busy_until = self.now;
        if !accept {
            self.sa_skip.insert(from, self.cfg.sa_skip_attempts);
            return;
        }
        let Some(g) = yours else { return };
        if let Some(f) = self.flows.get(&mine).cloned().filter(|f| f.next != g.next) {
            self.out_index.remove(&f.out_label);
            let e = self.flows.get_mut(&mine).unwrap();
            e.next = g.next;
            e.out_label = g.out_label;
            self.out_index.insert(g.out_label, mine);
            self.send(
                g.next,
                Msg::NotifySwitch {
                    label: g.out_label,
                    new_prev: self.id,
                },
            );
            self.sa_temp *= self.cfg.sa_cooling;
        }
    }

    fn on_propose_redirect(&mut self, from: NodeId, yours: Label, new_cost: f64, temperature: f64) {
        let busy = self.sa_busy_until > self.now && from > self.id;
        let Some(g) = self.flows.get(&yours).cloned().filter(|_| !busy) else {
            self.send(
                from,
                Msg::RespondRedirect {
                    accept: false,
                    flow: None,
                },
            );
            return;
        };
        let old = self.link_cost_from(g.prev) + self.link_cost(g.next) - self.compute_s;
        if !self.accept_move(old, new_cost, temperature) {
            self.send(
                from,
                Msg::RespondRedirect {
                    accept: false,
                    flow: None,
                },
            );
            return;
        }
        let gi = self.flow_info(&g);
        self.flows.remove(&yours);
        self.out_index.remove(&g.out_label);
        self.ghosts.insert(g.in_label, (g.next, g.out_label));
        self.send(
            from,
            Msg::RespondRedirect {
                accept: true,
                flow: Some(gi),
            },
        );
    }

    fn on_respond_redirect(&mut self, from: NodeId, accept: bool, flow: Option<FlowInfo>) {
        self.sa_busy_until = self.now;
        let Some(g) = flow.filter(|_| accept) else {
            self.sa_skip.insert(from, self.cfg.sa_skip_attempts);
            return;
        };
        self.insert_flow(FlowEntry {
            in_label: g.in_label,
            sink: g.sink,
            prev: g.prev,
            next: g.next,
            out_label: g.out_label,
            cost_from_source: g.cost_from_source,
            last_used: self.now,
        });
        self.send(
            g.prev,
            Msg::NotifyRedirect {
                label: g.in_label,
                new_next: self.id,
            },
        );
        self.send(
            g.next,
            Msg::NotifySwitch {
                label: g.out_label,
                new_prev: self.id,
            },
        );
        self.sa_temp *= self.cfg.sa_cooling;
    }

    // ------------------------------------------------------------ routing of one microbatch

    /// Chooses the next hop of a microbatch; returns (node, label).
    fn route(
        &mut self,
        mb: MbId,
        label: Option<Label>,
        hint: Option<NodeId>,
        plan: Option<&Arc<Vec<NodeId>>>,
        exclude: &[NodeId],
    ) -> Option<(NodeId, Option<Label>)> {
        if self.stage == self.s() {
            // The last stage sends back to the holder, but the reserved flow
            // is still in use: without this refresh a last-stage relay would
            // release every flow as idle `flow_idle_expiry_ticks` after it
            // was reserved, pushing it back all the way to the holder, which
            // then rebuilds it greedily and loses what local search had
            // gained (every flow was torn down about every two minutes).
            if let Some(f) = label.and_then(|l| self.flows.get_mut(&l)) {
                f.last_used = self.now;
            }
            return Some((mb.holder, None));
        }
        // Candidates: next hops not excluded (looked up one by one; the
        // whole list is built only where all of them are compared).
        let is_cand = |me: &Node, c: NodeId| {
            !exclude.contains(&c) && me.peers.get(&c).is_some_and(|p| me.is_next_candidate(c, p))
        };
        if let Some(h) = hint {
            if is_cand(self, h) {
                return Some((h, None));
            }
        }
        match self.cfg.policy {
            Policy::Swarm => {
                let cands: Vec<NodeId> = self
                    .next_candidates()
                    .into_iter()
                    .filter(|c| !exclude.contains(c))
                    .collect();
                // Smallest expected finish time: queued work / throughput.
                let mut best: Option<(f64, NodeId)> = None;
                for c in cands {
                    let p = &self.peers[&c];
                    let thr = p.thr.unwrap_or(1.0 / p.compute_s.max(1e-6));
                    let eta = (p.queued as f64 + 1.0) / thr.max(1e-9);
                    if best.is_none_or(|b| eta < b.0) {
                        best = Some((eta, c));
                    }
                }
                best.map(|b| (b.1, None))
            }
            Policy::Optimal | Policy::Gwtf => {
                if let Some(plan) = plan {
                    let t = self.next_stage() as usize;
                    if let Some(&n) = plan.get(t) {
                        if is_cand(self, n) {
                            return Some((n, None));
                        }
                    }
                }
                if let Some(l) = label {
                    if let Some(f) = self.flows.get_mut(&l) {
                        f.last_used = self.now;
                        let (n, o) = (f.next, f.out_label);
                        if is_cand(self, n) {
                            return Some((n, Some(o)));
                        }
                    } else if let Some(&(n, o)) = self.ghosts.get(&l) {
                        if is_cand(self, n) {
                            return Some((n, Some(o)));
                        }
                    }
                }
                // No reservation: the cheapest next hop toward the sink,
                // preferring peers with spare capacity.
                let mut best: Option<(f64, NodeId)> = None;
                for (&c, p) in &self.peers {
                    if !self.is_next_candidate(c, p) || exclude.contains(&c) {
                        continue;
                    }
                    let lc = self.link_cost_to(p);
                    // cost_via(c, holder), from the entry at hand.
                    let mut v = match p.costs.get(mb.holder) {
                        Some(x) => lc + x,
                        None => INF,
                    };
                    if v >= INF {
                        v = lc + 1e6;
                    }
                    if p.spare == 0 {
                        v += 1e3;
                    }
                    if best.is_none_or(|b| v < b.0) {
                        best = Some((v, c));
                    }
                }
                best.map(|b| (b.1, None))
            }
        }
    }

    // ------------------------------------------------------------ microbatch lifecycle

    fn on_start_iter(&mut self, iter: u32, holders: Arc<Vec<NodeId>>) {
        if self.stage != 0 || self.phase != Phase::Active {
            return;
        }
        if self.seen_iter.as_ref().is_none_or(|s| s.0 < iter) {
            self.seen_iter = Some((iter, holders.clone()));
        }
        if self.dh.iter.is_some_and(|k| k >= iter) {
            // The barrier announces the iteration again to holders it has
            // not heard are done: our HolderDone went to a node that did not
            // coordinate yet (it had not heard the old coordinator leave).
            if self.dh.iter == Some(iter) && self.dh.reported {
                if let Some(c) = self.coord {
                    self.send(c, Msg::HolderDone { iter });
                }
            }
            return;
        }
        self.forget_before(iter);
        if !holders.contains(&self.id) {
            // Joined during the iteration: takes part from the next one.
            return;
        }
        self.dh = HolderState {
            iter: Some(iter),
            ..Default::default()
        };
        self.event(Event::IterStarted { iter });
        self.launch();
    }

    /// Drops snapshots and state of iterations before `iter` (they are final).
    fn forget_before(&mut self, iter: u32) {
        if iter <= self.min_iter {
            return;
        }
        self.min_iter = iter;
        self.snaps.retain(|m, _| m.iter >= iter);
        let old: Vec<(MbId, bool)> = self
            .outstanding
            .keys()
            .filter(|k| k.0.iter < iter)
            .copied()
            .collect();
        for k in old {
            self.clear_deadline(k);
        }
        self.ghosts.clear();
        self.end_fwd.retain(|k, _| *k >= iter);
        let keep = iter.saturating_sub(1);
        self.coord_iters.retain(|k, _| *k >= keep);
    }

    fn launch(&mut self) {
        if self.stage != 0 || self.phase != Phase::Active {
            return;
        }
        let Some(k) = self.dh.iter else { return };
        loop {
            let limit = match self.cfg.policy {
                // Microbatches ride on reserved flows when there are
                // enough; the others (flows being rebuilt after a crash)
                // are routed hop by hop by the gossiped costs.
                Policy::Gwtf => self.cfg.max_in_flight as usize,
                Policy::Optimal => {
                    if self.plan.is_empty() {
                        self.cfg.max_in_flight as usize
                    } else {
                        self.plan.len().min(self.cfg.max_in_flight as usize)
                    }
                }
                Policy::Swarm => self.cfg.max_in_flight as usize,
            };
            if self.dh.in_flight.len() >= limit {
                break;
            }
            let mb = if let Some(mb) = self.dh.restarts.pop_front() {
                mb
            } else if self.dh.next_idx < self.cfg.mb_per_iter {
                let mb = MbId {
                    holder: self.id,
                    iter: k,
                    idx: self.dh.next_idx,
                };
                self.dh.next_idx += 1;
                mb
            } else {
                break;
            };
            // A free reserved flow (GWTF), or a planned path (optimal).
            let label = if self.cfg.policy == Policy::Gwtf {
                let busy: BTreeSet<Label> = self.dh.in_flight.values().flatten().copied().collect();
                self.flows.keys().copied().find(|l| !busy.contains(l))
            } else {
                None
            };
            if let Some(l) = label {
                if self.better_wait(l) {
                    // Put the microbatch back: a busy flow finishes it sooner.
                    if mb.idx + 1 == self.dh.next_idx && !self.dh.restarts.contains(&mb) {
                        self.dh.next_idx -= 1;
                    } else {
                        self.dh.restarts.push_front(mb);
                    }
                    break;
                }
            }
            let plan = if self.cfg.policy == Policy::Optimal && !self.plan.is_empty() {
                Some(self.plan[self.dh.in_flight.len() % self.plan.len()].clone())
            } else {
                None
            };
            self.dh.in_flight.insert(mb, label);
            let attempt = self.snaps.get(&mb).map_or(0, |s| s.attempt + 1);
            let t = self.run(TaskKind::Embed, Some(mb), attempt);
            self.snaps.insert(
                mb,
                Snap {
                    attempt,
                    path: Arc::new(vec![self.id]),
                    prev: self.id,
                    next: None,
                    label_in: label,
                    hint: None,
                    plan,
                    need_grad: false,
                    fwd_task: Some(t),
                    fwd_done: false,
                    bwd_task: None,
                    loss_task: None,
                    grad_ready: false,
                    grad_in: false,
                    done: false,
                    stuck: false,
                    started: self.now,
                },
            );
        }
    }

    /// Holder (GWTF): whether the remaining microbatches of the iteration
    /// finish sooner without using the free flow `free` now. The flows of a
    /// holder have unequal costs (a flow rebuilt after a crash, a distant
    /// relay), and the iteration waits for the holder's last microbatch:
    /// list scheduling by earliest expected completion (each flow free at
    /// its current microbatch's start + its observed round trip) assigns
    /// the remaining microbatches one by one to the flow that would finish
    /// each first; when the free flow gets none, the holder waits for a
    /// faster one. Only the holder's own observations are used; with any
    /// round trip unknown it does not wait.
    fn better_wait(&self, free: Label) -> bool {
        let Some(&r_free) = self.flow_rtt.get(&free) else {
            return false;
        };
        let now = to_secs(self.now);
        // (time the flow is free, its round trip) of the busy flows.
        let mut flows: Vec<(f64, f64)> = Vec::new();
        for (m, l) in &self.dh.in_flight {
            let Some(l) = l else { continue };
            let (Some(&r), Some(s)) = (self.flow_rtt.get(l), self.snaps.get(m)) else {
                return false;
            };
            flows.push(((to_secs(s.started) + r).max(now), r));
        }
        if flows.is_empty() {
            return false;
        }
        // The microbatch at hand and those not started yet.
        let remaining = 1
            + self.dh.restarts.len()
            + self.cfg.mb_per_iter.saturating_sub(self.dh.next_idx) as usize;
        flows.push((now, r_free));
        let free_at = flows.len() - 1;
        for _ in 0..remaining {
            let (i, _) = flows
                .iter()
                .enumerate()
                .map(|(i, f)| (i, f.0 + f.1))
                .min_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
                .unwrap();
            if i == free_at {
                return false;
            }
            flows[i].0 += flows[i].1;
        }
        true
    }

    fn restart(&mut self, mb: MbId, failed: Option<u32>) {
        if self.stage != 0 || mb.holder != self.id || self.dh.iter != Some(mb.iter) {
            return;
        }
        if self.dh.restarts.contains(&mb) {
            return;
        }
        if self.dh.in_flight.contains_key(&mb) {
            let s = self.snaps.get(&mb);
            let stale = match failed {
                // The data path reports a failed attempt: only that one.
                Some(a) => s.is_some_and(|s| s.attempt != a),
                // An aggregate lost it: an attempt started recently is
                // already recomputing it.
                None => s.is_some_and(|s| s.started + self.cfg.redo_timeout > self.now),
            };
            if stale {
                return;
            }
            self.dh.in_flight.remove(&mb);
        } else if let (Some(a), Some(s)) = (failed, self.snaps.get(&mb)) {
            if s.attempt != a || s.done {
                return;
            }
        }
        for back in [false, true] {
            self.clear_deadline((mb, back));
        }
        self.event(Event::Restarted { mb });
        self.dh.restarts.push_back(mb);
        self.launch();
    }

    #[allow(clippy::too_many_arguments)]
    fn on_forward(
        &mut self,
        from: NodeId,
        mb: MbId,
        attempt: u32,
        path: Arc<Vec<NodeId>>,
        label: Option<Label>,
        hint: Option<NodeId>,
        need_grad: bool,
        plan: Option<Arc<Vec<NodeId>>>,
    ) {
        if self.phase != Phase::Active || mb.iter < self.min_iter {
            return;
        }
        if mb.iter > self.min_iter && self.stage != 0 {
            self.forget_before(mb.iter);
        }
        let ps = self.prev_stage();
        if !self.peers.contains_key(&from) {
            self.learn(from, ps);
        }
        if self.stage == 0 {
            // Sink: the output of the last stage came back.
            if mb.holder != self.id {
                return;
            }
            let Some(s) = self.snaps.get_mut(&mb) else {
                return;
            };
            if s.attempt != attempt {
                return;
            }
            s.prev = from;
            s.path = merge_path(&path, &s.path);
            if s.grad_ready {
                // Recovery: re-send the stored loss gradient.
                let p = s.path.clone();
                self.send(
                    from,
                    Msg::Ack {
                        mb,
                        attempt,
                        backward: false,
                        busy: 0,
                        bytes: 0,
                    },
                );
                self.send_tracked(
                    from,
                    Msg::Backward {
                        mb,
                        attempt,
                        path: p,
                    },
                    mb,
                    true,
                    attempt,
                );
                return;
            }
            if s.loss_task.is_none() {
                let t = self.run(TaskKind::Loss, Some(mb), attempt);
                self.snaps.get_mut(&mb).unwrap().loss_task = Some(t);
                self.arrivals.insert((mb, false), self.now);
            }
            self.notify_queued(from, mb, attempt, false);
            return;
        }
        if let Some(label) = label {
            if !self.flows.contains_key(&label)
                && !self.ghosts.contains_key(&label)
                && self.cfg.policy == Policy::Gwtf
            {
                // Unknown reservation: tell the sender to drop it.
                self.send(from, Msg::PushBack { label });
            }
        }
        if let Some(s) = self.snaps.get_mut(&mb) {
            if s.attempt == attempt {
                s.prev = from;
                s.need_grad = need_grad;
                s.path = merge_path(&path, &s.path);
                if s.grad_ready {
                    // We already hold this microbatch's gradient for our
                    // predecessor: re-send it, no recompute.
                    self.send(
                        from,
                        Msg::Ack {
                            mb,
                            attempt,
                            backward: false,
                            busy: 0,
                            bytes: 0,
                        },
                    );
                    if need_grad {
                        let p = self.snaps[&mb].path.clone();
                        self.send_tracked(
                            from,
                            Msg::Backward {
                                mb,
                                attempt,
                                path: p,
                            },
                            mb,
                            true,
                            attempt,
                        );
                    }
                } else if s.fwd_done {
                    self.send(
                        from,
                        Msg::Ack {
                            mb,
                            attempt,
                            backward: false,
                            busy: 0,
                            bytes: 0,
                        },
                    );
                } else {
                    // A re-sent hop whose work is still queued here.
                    self.notify_queued(from, mb, attempt, false);
                }
                return;
            }
            if s.attempt > attempt {
                return;
            }
        }
        let t = self.run(TaskKind::Forward, Some(mb), attempt);
        self.snaps.insert(
            mb,
            Snap {
                attempt,
                path,
                prev: from,
                next: None,
                label_in: label,
                hint,
                plan,
                need_grad,
                fwd_task: Some(t),
                fwd_done: false,
                bwd_task: None,
                loss_task: None,
                grad_ready: false,
                grad_in: false,
                done: false,
                stuck: false,
                started: self.now,
            },
        );
        // Queue wait starts now; remember when the input arrived.
        self.arrivals.insert((mb, false), self.now);
        self.notify_queued(from, mb, attempt, false);
    }

    fn task_done(&mut self, id: TaskId) {
        let Some((kind, mb, attempt)) = self.tasks.remove(&id) else {
            return;
        };
        if self.phase != Phase::Active {
            return;
        }
        match kind {
            TaskKind::Aggregate { .. } => {
                let found = self
                    .acc
                    .iter()
                    .find(|(_, a)| a.agg_task.is_some_and(|t| t.0 == id))
                    .map(|(k, a)| (*k, a.agg_task.unwrap().1));
                if let Some((iter, epoch)) = found {
                    if let Some(c) = self.coord {
                        self.send(c, Msg::AggDone { iter, epoch });
                    }
                }
            }
            TaskKind::Embed | TaskKind::Forward => {
                let mb = mb.unwrap();
                let Some(s) = self.snaps.get_mut(&mb) else {
                    return;
                };
                if s.attempt != attempt || s.fwd_task != Some(id) {
                    return;
                }
                s.fwd_done = true;
                let mut path = (*s.path).clone();
                path.truncate(self.stage as usize);
                path.push(self.id);
                let path = Arc::new(path);
                s.path = path.clone();
                let (label, hint, plan, prev) = (s.label_in, s.hint, s.plan.clone(), s.prev);
                if kind == TaskKind::Forward {
                    let busy = self
                        .arrivals
                        .remove(&(mb, false))
                        .map_or(0, |t| self.now - t);
                    self.send(
                        prev,
                        Msg::Ack {
                            mb,
                            attempt,
                            backward: false,
                            busy,
                            bytes: self.cfg.activation_bytes,
                        },
                    );
                }
                self.forward_out(mb, label, hint, plan, &[]);
            }
            TaskKind::Loss => {
                let mb = mb.unwrap();
                let Some(s) = self.snaps.get_mut(&mb) else {
                    return;
                };
                if s.attempt != attempt || s.loss_task != Some(id) {
                    return;
                }
                s.grad_ready = true;
                let (prev, path) = (s.prev, s.path.clone());
                let busy = self
                    .arrivals
                    .remove(&(mb, false))
                    .map_or(0, |t| self.now - t);
                self.send(
                    prev,
                    Msg::Ack {
                        mb,
                        attempt,
                        backward: false,
                        busy,
                        bytes: self.cfg.activation_bytes,
                    },
                );
                self.send_tracked(prev, Msg::Backward { mb, attempt, path }, mb, true, attempt);
            }
            TaskKind::Backward | TaskKind::EmbedBackward => {
                let mb = mb.unwrap();
                let Some(s) = self.snaps.get_mut(&mb) else {
                    return;
                };
                if s.attempt != attempt || s.bwd_task != Some(id) {
                    return;
                }
                s.grad_ready = true;
                s.done = true;
                let (prev, next, path, need) = (
                    s.prev,
                    s.next.unwrap_or(self.id),
                    s.path.clone(),
                    s.need_grad,
                );
                let busy = self
                    .arrivals
                    .remove(&(mb, true))
                    .map_or(0, |t| self.now - t);
                self.send(
                    next,
                    Msg::Ack {
                        mb,
                        attempt,
                        backward: true,
                        busy,
                        bytes: self.cfg.activation_bytes,
                    },
                );
                let mut used = vec![id];
                if let Some(f) = self.snaps[&mb].fwd_task {
                    used.push(f);
                }
                if let Some(l) = self.snaps[&mb].loss_task {
                    used.push(l);
                }
                if self.stage == 0 {
                    // The microbatch is complete.
                    if let Some(label) = self.dh.in_flight.remove(&mb) {
                        if let (Some(l), Some(s)) = (label, self.snaps.get(&mb)) {
                            let rtt = to_secs(self.now.saturating_sub(s.started));
                            let old = self.flow_rtt.get(&l).copied();
                            if let Some(v) = Self::ema(old, rtt, self.cfg.ema_alpha) {
                                self.flow_rtt.insert(l, v);
                            }
                            // Forget the round trips of flows that are gone
                            // (bounded by the flows a holder has, not by how
                            // many it ever had).
                            if self.flow_rtt.len() > 2 * self.flows.len() + 8 {
                                let flows = &self.flows;
                                self.flow_rtt.retain(|l, _| flows.contains_key(l));
                            }
                        }
                        let first = self.dh.done.insert(mb.idx);
                        if first {
                            self.event(Event::MbDone {
                                mb,
                                path: path.clone(),
                            });
                        }
                    }
                    self.claim(mb, self.id, next, used);
                    self.holder_progress();
                    self.launch();
                } else {
                    self.claim(mb, prev, next, used);
                    if need {
                        if !self.alive(prev) {
                            self.backward_failed(mb, prev);
                        } else {
                            self.send_tracked(
                                prev,
                                Msg::Backward { mb, attempt, path },
                                mb,
                                true,
                                attempt,
                            );
                        }
                    }
                }
            }
        }
    }

    fn holder_progress(&mut self) {
        if self.dh.reported {
            return;
        }
        let Some(k) = self.dh.iter else { return };
        if self.dh.done.len() as u32 >= self.cfg.mb_per_iter {
            self.dh.reported = true;
            if let Some(c) = self.coord {
                self.send(c, Msg::HolderDone { iter: k });
            }
        }
    }

    /// Sends this node's stored output for `mb` to the next hop.
    fn forward_out(
        &mut self,
        mb: MbId,
        label: Option<Label>,
        hint: Option<NodeId>,
        plan: Option<Arc<Vec<NodeId>>>,
        exclude: &[NodeId],
    ) {
        let Some(s) = self.snaps.get(&mb) else { return };
        let (attempt, path) = (s.attempt, s.path.clone());
        match self.route(mb, label, hint, plan.as_ref(), exclude) {
            None => {
                let s = self.snaps.get_mut(&mb).unwrap();
                s.stuck = true;
                self.maybe_stuck = true;
            }
            Some((n, out_label)) => {
                let s = self.snaps.get_mut(&mb).unwrap();
                s.next = Some(n);
                s.stuck = false;
                let msg = Msg::Forward {
                    mb,
                    attempt,
                    path,
                    label: out_label,
                    hint: None,
                    need_grad: true,
                    plan,
                };
                self.send_tracked(n, msg, mb, false, attempt);
            }
        }
    }

    fn on_backward(&mut self, from: NodeId, mb: MbId, attempt: u32, path: Arc<Vec<NodeId>>) {
        if self.phase != Phase::Active {
            return;
        }
        let Some(s) = self.snaps.get_mut(&mb) else {
            return;
        };
        if s.attempt != attempt || !s.fwd_done {
            return;
        }
        if s.grad_in {
            // Duplicate: already have it.
            if s.done {
                self.send(
                    from,
                    Msg::Ack {
                        mb,
                        attempt,
                        backward: true,
                        busy: 0,
                        bytes: 0,
                    },
                );
            } else {
                self.notify_queued(from, mb, attempt, true);
            }
            return;
        }
        s.grad_in = true;
        s.next = Some(from);
        s.path = path;
        self.clear_deadline((mb, false));
        let kind = if self.stage == 0 {
            TaskKind::EmbedBackward
        } else {
            TaskKind::Backward
        };
        let t = self.run(kind, Some(mb), attempt);
        self.snaps.get_mut(&mb).unwrap().bwd_task = Some(t);
        self.arrivals.insert((mb, true), self.now);
        self.notify_queued(from, mb, attempt, true);
    }

    /// A hop's work waits behind other work in this node's GPU queue: tell
    /// the sender it arrived and is queued, with the expected time until it
    /// is done (the compute queued here, by this node's own estimate of its
    /// speed), so that queueing is not taken for a crash. Nothing is sent
    /// when the GPU has nothing else to do first.
    fn notify_queued(&mut self, to: NodeId, mb: MbId, attempt: u32, backward: bool) {
        let mut n = 0usize;
        let mut wait = 0.0;
        for (kind, _, _) in self.tasks.values() {
            if !kind.is_compute() {
                continue;
            }
            n += 1;
            wait += match kind {
                TaskKind::Backward | TaskKind::EmbedBackward => 2.0 * self.compute_s / 3.0,
                _ => self.compute_s / 3.0,
            };
        }
        if n < 2 {
            return;
        }
        self.send(
            to,
            Msg::Queued {
                mb,
                attempt,
                backward,
                wait: secs(wait),
            },
        );
    }

    /// The receiver of a tracked hop has it queued: its ack is due after
    /// the queue it reported (with a margin for the estimate) plus the
    /// usual ack timeout. A crash of the receiver is still caught by the
    /// liveness checks (`peer_dead`) or by this later deadline.
    fn on_queued(&mut self, from: NodeId, mb: MbId, attempt: u32, backward: bool, wait: Time) {
        let Some(o) = self.outstanding.get(&(mb, backward)) else {
            return;
        };
        if o.to != from || o.attempt != attempt {
            return;
        }
        // The reported wait is the peer's word: capped at the holder's
        // last-resort timeout (no hostile or broken peer postpones a hop
        // further) and added without overflow.
        let wait = wait.min(self.cfg.e2e_timeout);
        let deadline = self
            .now
            .saturating_add(2 * wait)
            .saturating_add(self.ack_timeout_for(from));
        if deadline <= o.deadline {
            return;
        }
        let mut o = o.clone();
        o.deadline = deadline;
        self.add_deadline((mb, backward), o);
    }

    fn on_ack(
        &mut self,
        from: NodeId,
        mb: MbId,
        attempt: u32,
        backward: bool,
        busy: Time,
        bytes: u64,
    ) {
        let Some(o) = self.outstanding.get(&(mb, backward)) else {
            return;
        };
        if o.to != from || o.attempt != attempt {
            return;
        }
        let o = self.clear_deadline((mb, backward)).unwrap();
        let a = self.cfg.ema_alpha;
        let delay = to_secs(self.now - o.sent_at);
        let policy = self.cfg.policy;
        if let Some(p) = self.peers.get_mut(&from) {
            p.ack = Self::ema(p.ack, delay, a);
            let lat = p.lat.unwrap_or(0.0);
            let net = (delay - to_secs(busy) - 2.0 * lat).max(1e-4);
            if bytes > 0 && o.bytes > 0 {
                p.bw = Self::ema(p.bw, o.bytes as f64 / net, a);
            }
            if !backward && policy == Policy::Swarm {
                p.queued = p.queued.saturating_sub(1);
                // Service time of one microbatch through this peer:
                // transfer + its compute (queueing is what `queued` counts).
                let service = (delay - to_secs(busy)).max(0.0) + p.compute_s / 3.0;
                p.thr = Self::ema(p.thr, 1.0 / service.max(1e-6), a);
            }
        }
    }

    /// A hop's ack deadline passed. While the link to the peer is still
    /// busy with transfers this node queued on it since the hop was sent
    /// (a burst of hops to one peer shares its bandwidth, so each arrives
    /// late), the ack is not due yet: the deadline moves to the usual
    /// timeout after that busy period, by the bandwidth estimate.
    fn ack_deadline(&mut self, mb: MbId, backward: bool) {
        let Some(o) = self.outstanding.get(&(mb, backward)) else {
            return;
        };
        if let Some(p) = self.peers.get(&o.to) {
            // The usual timeout counts the hop's own transfer; what the
            // transfers queued with it add is the rest of the busy period.
            let xfer = secs(o.bytes as f64 / p.bw.unwrap_or(self.cfg.prior_bandwidth).max(1.0));
            let due = p.link_free.saturating_sub(xfer) + self.ack_timeout_for(o.to);
            if !p.dead && o.sent_at >= p.link_busy_since && due > self.now {
                let mut o = o.clone();
                o.deadline = due;
                self.add_deadline((mb, backward), o);
                return;
            }
        }
        self.ack_timeout(mb, backward);
    }

    fn ack_timeout(&mut self, mb: MbId, backward: bool) {
        let Some(o) = self.clear_deadline((mb, backward)) else {
            return;
        };
        let to = o.to;
        self.peer_suspect(to);
        if let Some(p) = self.peers.get_mut(&to) {
            p.queued = p.queued.saturating_sub(1);
        }
        if self.snaps.get(&mb).is_none_or(|s| s.attempt != o.attempt) {
            return;
        }
        if backward {
            self.backward_failed(mb, to);
        } else {
            self.forward_failed(mb, to);
        }
    }

    /// A forward hop got no ack: re-send the stored output to another node
    /// of the same stage (both policies).
    fn forward_failed(&mut self, mb: MbId, dead: NodeId) {
        if self.stage == self.s() {
            // The sink (holder) is gone: the microbatch is dropped with it.
            self.snaps.remove(&mb);
            return;
        }
        if self.cfg.policy == Policy::Gwtf {
            // Its reservations through the dead node are gone.
            let through: Vec<Label> = self
                .flows
                .iter()
                .filter(|(_, f)| f.next == dead)
                .map(|(l, _)| *l)
                .collect();
            for l in through {
                self.drop_flow(l, true, false);
            }
        }
        let st = self.next_stage();
        self.event(Event::Rerouted { mb, stage: st });
        let (hint, plan, redo) = {
            let s = &self.snaps[&mb];
            (s.hint.filter(|h| *h != dead), s.plan.clone(), s.grad_in)
        };
        if redo {
            // This node already has its gradient: it was re-running the
            // next stage for the aggregate (see `redo`).
            if let Some(h) = hint {
                self.redo(mb, dead, h);
            }
            return;
        }
        self.forward_out(mb, None, hint, plan, &[dead]);
    }

    /// A backward hop (to `dead`, our predecessor) got no ack.
    fn backward_failed(&mut self, mb: MbId, dead: NodeId) {
        // Index of this node in the path (a holder sends the first gradient,
        // after stage S).
        let my = if self.stage == 0 {
            self.s() as usize + 1
        } else {
            self.stage as usize
        };
        if my == 1 || dead == mb.holder {
            // The holder is gone: its microbatch is dropped.
            return;
        }
        match self.cfg.policy {
            Policy::Swarm => {
                // SWARM restarts the whole microbatch from its data holder.
                let attempt = Some(self.snaps[&mb].attempt);
                self.send(mb.holder, Msg::Restart { mb, attempt });
            }
            Policy::Gwtf | Policy::Optimal => {
                let path = self.snaps[&mb].path.clone();
                // The node before the dead one re-runs the dead node's stage
                // on a replacement.
                if my >= 2 && path.len() > my - 2 {
                    let before = path[my - 2];
                    if self.alive(before) || before == mb.holder {
                        let attempt = self.snaps[&mb].attempt;
                        self.send(
                            before,
                            Msg::CrashNotice {
                                mb,
                                attempt,
                                dead,
                                after: self.id,
                            },
                        );
                        return;
                    }
                }
                let attempt = Some(self.snaps[&mb].attempt);
                self.send(mb.holder, Msg::Restart { mb, attempt });
            }
        }
    }

    /// GWTF recovery: re-send this node's stored output for `mb` to a
    /// replacement of `dead`, asking it to pass on to `after`.
    fn recover(&mut self, mb: MbId, dead: NodeId, after: Option<NodeId>) {
        let Some(s) = self.snaps.get_mut(&mb) else {
            return;
        };
        if !s.fwd_done || s.grad_in {
            return;
        }
        s.hint = after;
        let plan = s.plan.clone();
        self.clear_deadline((mb, false));
        if self.stage == self.s() {
            return;
        }
        self.forward_out(mb, None, after, plan, &[dead]);
        if let Some(s) = self.snaps.get_mut(&mb) {
            s.hint = after;
        }
    }

    /// Stage `dead` lost its contribution for `mb` after the backward went
    /// through: re-run it on a replacement that gets the stored gradient
    /// from `next`; the result is not needed here (need_grad = false).
    fn redo(&mut self, mb: MbId, dead: NodeId, next: NodeId) {
        let Some(s) = self.snaps.get_mut(&mb) else {
            return;
        };
        s.hint = Some(next);
        let (attempt, path, plan) = (s.attempt, s.path.clone(), s.plan.clone());
        let mut p = (*path).clone();
        p.truncate(self.stage as usize + 1);
        match self.route(mb, None, None, plan.as_ref(), &[dead]) {
            None => {
                self.snaps.get_mut(&mb).unwrap().stuck = true;
                self.maybe_stuck = true;
            }
            Some((r, _)) => {
                let msg = Msg::Forward {
                    mb,
                    attempt,
                    path: Arc::new(p),
                    label: None,
                    hint: Some(next),
                    need_grad: false,
                    plan,
                };
                // Tracked like any forward hop: a silent replacement is
                // replaced in turn.
                self.send_tracked(r, msg, mb, false, attempt);
            }
        }
    }

    // ------------------------------------------------------------ claims and aggregation

    fn claim(&mut self, mb: MbId, prev: NodeId, next: NodeId, tasks: Vec<TaskId>) {
        let iter = mb.iter;
        self.acc
            .entry(iter)
            .or_default()
            .pending
            .insert(mb, (prev, next, tasks));
        if let Some(c) = self.coord {
            self.send(
                c,
                Msg::Claim {
                    iter,
                    mb,
                    prev,
                    next,
                },
            );
        }
    }

    fn on_claim_reply(&mut self, mb: MbId, granted: bool) {
        let Some(a) = self.acc.get_mut(&mb.iter) else {
            return;
        };
        let x = match a.pending.remove(&mb) {
            Some(x) => x,
            None if granted && !a.granted.contains_key(&mb) => {
                let Some(x) = a.refused.remove(&mb) else {
                    return;
                };
                x
            }
            None => return,
        };
        if granted {
            let tasks = x.2.clone();
            a.granted.insert(mb, x);
            self.event(Event::Claimed { mb, tasks });
        } else {
            a.refused.insert(mb, x);
        }
    }

    fn on_claim(&mut self, from: NodeId, iter: u32, mb: MbId, prev: NodeId, next: NodeId) {
        if self.coord != Some(self.id) {
            // Not the coordinator (any more): tell the member who is.
            let members = self.members.list();
            self.send(
                from,
                Msg::Heartbeat {
                    members: Some(members),
                },
            );
            return;
        }
        if iter + 1 < self.min_iter {
            self.send(from, Msg::ClaimReply { mb, granted: false });
            return;
        }
        // A node that claims takes us for its coordinator: it is a member
        // (its claim can overtake its GroupJoin). Every grant's owner must
        // be in the group, or a commit would leave its gradient out of the
        // all-reduce while counting its microbatch in.
        if from != self.id && self.members.insert(from) {
            self.members_changed = true;
        }
        let ci = self.coord_iters.entry(iter).or_default();
        let granted = if ci.applied || ci.commit.is_some() || ci.dropped.contains(&mb) {
            ci.granted.get(&mb).is_some_and(|g| g.0 == from)
        } else {
            match ci.granted.get(&mb) {
                Some(g) => g.0 == from,
                None => {
                    ci.granted.insert(mb, (from, prev, next));
                    ci.lost.remove(&mb);
                    if let Some(m) = ci.missing.as_mut() {
                        m.remove(&mb);
                    }
                    true
                }
            }
        };
        self.send(from, Msg::ClaimReply { mb, granted });
        self.coord_check(iter);
    }

    fn on_end_iter(&mut self, from: NodeId, iter: u32, origin: NodeId, holders: Arc<Vec<NodeId>>) {
        let _ = from;
        if self.phase != Phase::Active {
            return;
        }
        // Pass it on along the pipeline (once per heartbeat period).
        let period = self.cfg.heartbeat_ticks as Time * self.cfg.tick;
        let last = self.end_fwd.get(&iter).copied();
        if last.is_none_or(|t| t + period <= self.now) {
            self.end_fwd.insert(iter, self.now);
            // Holders also tell a few peers of the last stage: both stages
            // next to the holders then know the iteration is over before the
            // holders' stage can commit it, so a holders' coordinator that
            // starts over after every holder was gone opens a later one
            // (see `iter_hint`), even when stage 1 is empty.
            let mut stages = Vec::new();
            if self.stage < self.s() {
                stages.push(self.stage + 1);
            }
            if self.stage == 0 && self.s() > 1 {
                stages.push(self.s());
            }
            for ns in stages {
                let mut targets: Vec<NodeId> = self
                    .peers
                    .iter()
                    .filter(|(_, p)| p.stage == ns && !p.dead)
                    .map(|(id, _)| *id)
                    .collect();
                targets.truncate(3);
                for t in targets {
                    self.send(
                        t,
                        Msg::EndIter {
                            iter,
                            origin,
                            holders: holders.clone(),
                        },
                    );
                }
            }
            if let Some(c) = self.coord {
                if c != self.id {
                    self.send(
                        c,
                        Msg::EndIter {
                            iter,
                            origin,
                            holders: holders.clone(),
                        },
                    );
                }
            }
        }
        if self.coord == Some(self.id) {
            let now = self.now;
            let ci = self.coord_iters.entry(iter).or_default();
            if ci.applied {
                let st = self.stage;
                self.send(origin, Msg::StageDone { iter, stage: st });
                return;
            }
            if ci.end.is_none() {
                ci.end_at = now;
            }
            if ci.missing.is_none() {
                let mut m = BTreeSet::new();
                for &h in holders.iter() {
                    for idx in 0..self.cfg.mb_per_iter {
                        let mb = MbId {
                            holder: h,
                            iter,
                            idx,
                        };
                        if !ci.granted.contains_key(&mb) && !ci.dropped.contains(&mb) {
                            m.insert(mb);
                        }
                    }
                }
                ci.missing = Some(m);
            }
            ci.end = Some((origin, holders));
            self.coord_check(iter);
        }
    }

    /// Coordinator: a member is gone; its contributions not yet applied are lost.
    fn coord_member_dead(&mut self, p: NodeId) {
        let now = self.now;
        let iters: Vec<u32> = self.coord_iters.keys().copied().collect();
        for k in iters {
            let ci = self.coord_iters.get_mut(&k).unwrap();
            if ci.applied {
                continue;
            }
            let mine: Vec<(MbId, (NodeId, NodeId, NodeId))> = ci
                .granted
                .iter()
                .filter(|(_, g)| g.0 == p)
                .map(|(m, g)| (*m, *g))
                .collect();
            let ended: Option<BTreeSet<NodeId>> =
                ci.end.as_ref().map(|e| e.1.iter().copied().collect());
            for (mb, (_, prev, next)) in &mine {
                ci.granted.remove(mb);
                if let (Some(m), Some(h)) = (ci.missing.as_mut(), ended.as_ref()) {
                    if h.contains(&mb.holder) {
                        m.insert(*mb);
                    }
                }
                ci.lost.insert(
                    *mb,
                    Lost {
                        prev: Some(*prev),
                        next: Some(*next),
                        dead: p,
                        since: now,
                        level: 0,
                    },
                );
            }
            if let Some(c) = ci.commit.as_mut() {
                if !mine.is_empty() {
                    // The all-reduce lost a member's data: redo it without it.
                    ci.commit = None;
                    ci.agg_done.clear();
                } else {
                    c.remove(&p);
                }
            }
            self.redo_lost(k);
            self.coord_check(k);
        }
        if let Some(b) = self.barrier.as_mut() {
            let _ = b;
            self.barrier_check();
        }
    }

    /// Coordinator: the holder of a lost microbatch answered a restart
    /// request; it is alive and re-running it, so the microbatch is not
    /// given up: the request is repeated after a full `redo_timeout` (a
    /// holder that stops answering is taken for dead and its microbatch is
    /// dropped after the usual escalation).
    fn on_restarting(&mut self, from: NodeId, mb: MbId) {
        if self.coord != Some(self.id) || from != mb.holder {
            return;
        }
        let now = self.now;
        let Some(ci) = self.coord_iters.get_mut(&mb.iter) else {
            return;
        };
        if ci.applied || ci.commit.is_some() {
            return;
        }
        if let Some(l) = ci.lost.get_mut(&mb) {
            if l.level > 0 {
                l.level = l.level.min(3);
                l.since = now;
            }
        }
    }

    /// Coordinator: asks for the lost contributions to be recomputed.
    fn redo_lost(&mut self, iter: u32) {
        let now = self.now;
        let timeout = self.cfg.redo_timeout;
        let stage = self.stage;
        let policy = self.cfg.policy;
        // The holders' stage: its live members (the holders still here).
        let live: BTreeSet<NodeId> = if stage == 0 {
            self.members
                .iter()
                .copied()
                .filter(|&m| self.alive(m))
                .collect()
        } else {
            BTreeSet::new()
        };
        let alive = |h: NodeId| live.contains(&h);
        let Some(ci) = self.coord_iters.get_mut(&iter) else {
            return;
        };
        let mut sends: Vec<(NodeId, Msg)> = Vec::new();
        let mut drop: Vec<MbId> = Vec::new();
        for (mb, l) in ci.lost.iter_mut() {
            if l.level > 0 && l.since + timeout > now {
                continue;
            }
            if stage == 0 && (l.level == 0 || l.level > 3 || !alive(mb.holder)) {
                // A holder's own part cannot be redone without it. A live
                // holder is asked again (as at the relays' stages): it
                // answers while it re-runs the microbatch, which keeps it
                // from being dropped here while the other stages count it.
                drop.push(*mb);
                continue;
            }
            match l.level {
                0 => {
                    match (policy, l.prev, l.next) {
                        (Policy::Swarm, _, _) | (_, None, _) | (_, _, None) => {
                            sends.push((
                                mb.holder,
                                Msg::Restart {
                                    mb: *mb,
                                    attempt: None,
                                },
                            ));
                        }
                        (_, Some(prev), Some(next)) => {
                            sends.push((
                                prev,
                                Msg::Redo {
                                    mb: *mb,
                                    dead: l.dead,
                                    next,
                                },
                            ));
                        }
                    }
                    l.level = 1;
                    l.since = now;
                }
                1..=3 => {
                    sends.push((
                        mb.holder,
                        Msg::Restart {
                            mb: *mb,
                            attempt: None,
                        },
                    ));
                    l.level += 1;
                    l.since = now;
                }
                _ => drop.push(*mb),
            }
        }
        for mb in drop {
            ci.lost.remove(&mb);
            ci.dropped.insert(mb);
            if let Some(m) = ci.missing.as_mut() {
                m.remove(&mb);
            }
        }
        for (to, m) in sends {
            self.send(to, m);
        }
    }

    fn coord_tick(&mut self) {
        let iters: Vec<u32> = self.coord_iters.keys().copied().collect();
        let now = self.now;
        let timeout = self.cfg.redo_timeout;
        for k in iters {
            // Expected microbatches never claimed (their node died before it
            // could claim and the data path did not recover them in time).
            let missing: Vec<MbId> = {
                let ci = &self.coord_iters[&k];
                if ci.applied || ci.commit.is_some() {
                    Vec::new()
                } else if let (Some(_), Some(missing)) = (&ci.end, &ci.missing) {
                    if ci.end_at + timeout <= now {
                        missing
                            .iter()
                            .copied()
                            .filter(|m| !ci.lost.contains_key(m))
                            .collect()
                    } else {
                        Vec::new()
                    }
                } else {
                    Vec::new()
                }
            };
            let ci = self.coord_iters.get_mut(&k).unwrap();
            for &mb in &missing {
                ci.lost.insert(
                    mb,
                    Lost {
                        prev: None,
                        next: None,
                        dead: NodeId::MAX,
                        since: now,
                        level: 1,
                    },
                );
            }
            for mb in missing {
                // Level 1: restart from the holder now.
                self.send(mb.holder, Msg::Restart { mb, attempt: None });
            }
            self.redo_lost(k);
            self.coord_check(k);
        }
        if self.stage == 0 {
            self.barrier_tick();
        }
    }

    fn expected(&self, iter: u32, holders: &[NodeId]) -> Vec<MbId> {
        let mut v = Vec::with_capacity(holders.len() * self.cfg.mb_per_iter as usize);
        for &h in holders {
            for idx in 0..self.cfg.mb_per_iter {
                v.push(MbId {
                    holder: h,
                    iter,
                    idx,
                });
            }
        }
        v
    }

    /// Coordinator: commit when complete, apply when every member aggregated.
    fn coord_check(&mut self, iter: u32) {
        if self.coord != Some(self.id) {
            return;
        }
        if self.last_applied.is_some_and(|a| a >= iter) {
            // Applied under an earlier coordinator: only confirm.
            let ci = self.coord_iters.entry(iter).or_default();
            ci.applied = true;
            if let Some((origin, _)) = ci.end.clone() {
                let st = self.stage;
                self.send(origin, Msg::StageDone { iter, stage: st });
            }
            return;
        }
        let Some(ci) = self.coord_iters.get(&iter) else {
            return;
        };
        if ci.applied {
            return;
        }
        let Some((origin, holders)) = ci.end.clone() else {
            return;
        };
        if ci.commit.is_none() {
            if !ci.lost.is_empty() {
                return;
            }
            let _ = &holders;
            if ci.missing.as_ref().is_some_and(|m| !m.is_empty()) {
                return;
            }
            let members: BTreeSet<NodeId> = self
                .members
                .iter()
                .copied()
                .filter(|m| self.alive(*m))
                .collect();
            let ci = self.coord_iters.get_mut(&iter).unwrap();
            // Epochs are unique across coordinators.
            ci.epoch = ((self.id as u64) << 32) | ((ci.epoch & 0xffff_ffff) + 1);
            ci.agg_done.clear();
            ci.commit = Some(members.clone());
            let epoch = ci.epoch;
            let list = Arc::new(members.iter().copied().collect::<Vec<_>>());
            for m in members {
                self.send(
                    m,
                    Msg::Commit {
                        iter,
                        epoch,
                        members: list.clone(),
                    },
                );
            }
            return;
        }
        let ci = &self.coord_iters[&iter];
        let commit = ci.commit.as_ref().unwrap();
        if !commit
            .iter()
            .all(|m| ci.agg_done.contains(m) || !self.alive(*m))
        {
            return;
        }
        // Apply: the new weights version follows from the previous one and
        // exactly the contributions that are in the aggregate.
        let mut h = mix(self.version.1, iter as u64);
        for (mb, g) in &ci.granted {
            h = mix(h, ((mb.holder as u64) << 32) | mb.idx as u64);
            h = mix(h, g.0 as u64);
        }
        let mbs: Vec<(MbId, NodeId)> = ci.granted.iter().map(|(m, g)| (*m, g.0)).collect();
        let dropped: Vec<MbId> = ci.dropped.iter().copied().collect();
        let ci = self.coord_iters.get_mut(&iter).unwrap();
        ci.applied = true;
        let st = self.stage;
        self.event(Event::StageCommitted {
            stage: st,
            iter,
            mbs: Arc::new(mbs),
            dropped,
        });
        for m in self.members.clone() {
            self.send(m, Msg::Applied { iter, version: h });
        }
        self.send(origin, Msg::StageDone { iter, stage: st });
    }

    fn on_applied(&mut self, iter: u32, version: u64) {
        if self.last_applied.is_some_and(|a| a >= iter) {
            return;
        }
        self.version = (iter, version);
        self.last_applied = Some(self.last_applied.map_or(iter, |a| a.max(iter)));
        if let Some(ci) = self.coord_iters.get_mut(&iter) {
            ci.applied = true;
        }
        let st = self.stage;
        self.event(Event::Applied {
            stage: st,
            iter,
            version,
        });
        self.acc.retain(|k, _| *k > iter);
    }

    // ------------------------------------------------------------ iteration barrier (holders' coordinator)

    fn barrier_tick(&mut self) {
        if self.coord != Some(self.id) || self.stage != 0 {
            return;
        }
        if self.barrier.is_none() {
            if self.now < self.cfg.start_delay || self.seen_iter.is_some() {
                return;
            }
            // Open the first iteration (or, after every holder was gone, the
            // one the relays say comes next) only once the iteration is
            // known: from our own history (an applied aggregate) or from a
            // relay (its introduction says which iteration comes next; at a
            // fresh start that is 0). A coordinator that knows nothing (every
            // holder was gone and no relay answered yet, or the stages next
            // to us are empty) waits: opening iteration 0 there would re-run
            // iterations that are over.
            if !self.iter_heard && self.last_applied.is_none() {
                return;
            }
            let first = self.iter_hint();
            let holders: Arc<Vec<NodeId>> = Arc::new(
                self.members
                    .iter()
                    .copied()
                    .filter(|m| self.alive(*m))
                    .collect(),
            );
            self.barrier = Some(Barrier {
                iter: first,
                participants: holders.clone(),
                ..Default::default()
            });
            for h in holders.iter().copied() {
                self.send(
                    h,
                    Msg::StartIter {
                        iter: first,
                        holders: holders.clone(),
                    },
                );
            }
            return;
        }
        self.barrier_check();
        let period = self.cfg.heartbeat_ticks as Time * self.cfg.tick * 2;
        let b = self.barrier.as_ref().unwrap().clone();
        if let Some(ended) = &b.ended {
            if b.last_bcast + period <= self.now {
                self.barrier.as_mut().unwrap().last_bcast = self.now;
                self.bcast_end(b.iter, ended.clone());
            }
            if b.ended_at + self.cfg.stall_report <= self.now {
                for s in 0..=self.s() {
                    if !b.stage_done.contains(&s) {
                        let last = b.stall_reported.get(&s).copied();
                        if last.is_none_or(|t| t + self.cfg.stall_report <= self.now) {
                            self.barrier
                                .as_mut()
                                .unwrap()
                                .stall_reported
                                .insert(s, self.now);
                            self.event(Event::Stalled {
                                iter: b.iter,
                                stage: s,
                            });
                        }
                    }
                }
            }
        } else if b.last_bcast + period <= self.now {
            // Re-announce the iteration to holders that may have missed it.
            self.barrier.as_mut().unwrap().last_bcast = self.now;
            // To every member: those who joined meanwhile learn the iteration.
            for h in self.members.clone() {
                if self.alive(h) && !b.done.contains(&h) {
                    self.send(
                        h,
                        Msg::StartIter {
                            iter: b.iter,
                            holders: b.participants.clone(),
                        },
                    );
                }
            }
        }
    }

    fn bcast_end(&mut self, iter: u32, holders: Arc<Vec<NodeId>>) {
        let me = self.id;
        for m in self.members.clone() {
            self.send(
                m,
                Msg::EndIter {
                    iter,
                    origin: me,
                    holders: holders.clone(),
                },
            );
        }
    }

    fn barrier_check(&mut self) {
        if self.coord != Some(self.id) || self.stage != 0 {
            return;
        }
        let Some(b) = self.barrier.clone() else {
            return;
        };
        if b.ended.is_none() {
            let waiting = b
                .participants
                .iter()
                .any(|h| self.alive(*h) && self.members.contains(h) && !b.done.contains(h));
            if waiting {
                return;
            }
            let holders: Arc<Vec<NodeId>> = Arc::new(
                b.participants
                    .iter()
                    .copied()
                    .filter(|h| b.done.contains(h) && self.alive(*h))
                    .collect(),
            );
            let bm = self.barrier.as_mut().unwrap();
            bm.ended = Some(holders.clone());
            bm.ended_at = self.now;
            bm.last_bcast = self.now;
            self.bcast_end(b.iter, holders);
            return;
        }
        if (0..=self.s()).all(|s| b.stage_done.contains(&s)) {
            let ended = b.ended.clone().unwrap();
            self.event(Event::IterFinalized {
                iter: b.iter,
                holders: ended,
            });
            let next = b.iter + 1;
            let holders: Arc<Vec<NodeId>> = Arc::new(
                self.members
                    .iter()
                    .copied()
                    .filter(|m| self.alive(*m))
                    .collect(),
            );
            self.barrier = Some(Barrier {
                iter: next,
                participants: holders.clone(),
                last_bcast: self.now,
                ..Default::default()
            });
            for h in holders.iter().copied() {
                self.send(
                    h,
                    Msg::StartIter {
                        iter: next,
                        holders: holders.clone(),
                    },
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::rng::Rng;

    /// `my_costs` as first written: the per-sink minimum over every entry of
    /// every candidate, sorted by (cost, sink), the first `gossip_sinks`.
    fn my_costs_reference(n: &Node) -> Vec<(NodeId, f64)> {
        let mut m: BTreeMap<NodeId, f64> = BTreeMap::new();
        for j in n.next_candidates() {
            let lc = n.link_cost(j);
            for &(sink, c) in n.peers[&j].costs.0.iter() {
                let v = lc + c;
                let e = m.entry(sink).or_insert(INF);
                if v < *e {
                    *e = v;
                }
            }
        }
        let mut v: Vec<(NodeId, f64)> = m.into_iter().filter(|x| x.1 < INF).collect();
        v.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        v.truncate(n.cfg.gossip_sinks);
        v
    }

    /// A `Queued` notice postpones a hop's ack deadline by the reported
    /// wait, but a hostile wait (u64::MAX) neither overflows nor postpones
    /// it beyond the holder's last-resort timeout; a notice from another
    /// peer than the hop's receiver changes nothing.
    #[test]
    fn a_queued_notice_postpones_a_hop_within_bounds() {
        let cfg = Arc::new(Config::new(Policy::Gwtf, 4, 1 << 20));
        let mut n = Node::new(cfg.clone(), 5, 2, 0.5, 4, 1);
        n.now = 1_000 * SEC;
        let mb = MbId {
            holder: 0,
            iter: 3,
            idx: 1,
        };
        let o = Outstanding {
            to: 9,
            sent_at: n.now,
            deadline: n.now + SEC,
            bytes: 1 << 20,
            attempt: 0,
        };
        n.outstanding.insert((mb, false), o);
        n.on_queued(8, mb, 0, false, 10 * SEC);
        assert_eq!(n.outstanding[&(mb, false)].deadline, n.now + SEC);
        n.on_queued(9, mb, 0, false, 10 * SEC);
        let d = n.outstanding[&(mb, false)].deadline;
        assert!(d >= n.now + 20 * SEC, "{d}");
        for wait in [u64::MAX / 4, u64::MAX] {
            n.on_queued(9, mb, 0, false, wait);
            let d = n.outstanding[&(mb, false)].deadline;
            assert!(d > n.now + 20 * SEC && d <= n.now + 2 * cfg.e2e_timeout + 3600 * SEC);
        }
    }

    /// A claim re-sent after a heartbeat period can be granted after its
    /// first copy was refused (the first grant's owner died in between):
    /// the coordinator then counts the microbatch as ours, so the late grant
    /// must be honoured. A grant for a microbatch never claimed is ignored.
    #[test]
    fn a_grant_after_a_refusal_is_honoured() {
        let cfg = Config::new(Policy::Gwtf, 4, 1 << 20);
        let mut n = Node::new(Arc::new(cfg), 5, 2, 0.5, 4, 1);
        let mb = MbId {
            holder: 0,
            iter: 3,
            idx: 1,
        };
        let other = MbId { idx: 2, ..mb };
        n.acc
            .entry(3)
            .or_default()
            .pending
            .insert(mb, (1, 7, vec![11, 12]));
        n.on_claim_reply(mb, false);
        assert!(n.acc[&3].granted.is_empty());
        n.on_claim_reply(mb, true);
        assert_eq!(n.acc[&3].granted.get(&mb), Some(&(1, 7, vec![11, 12])));
        assert!(n.acc[&3].refused.is_empty());
        // Answers to a duplicate claim change nothing.
        n.on_claim_reply(mb, true);
        n.on_claim_reply(mb, false);
        assert_eq!(n.acc[&3].granted.len(), 1);
        n.on_claim_reply(other, true);
        assert!(!n.acc[&3].granted.contains_key(&other));
    }

    #[test]
    fn merged_cost_gossip_equals_the_full_scan() {
        for seed in 0..300 {
            let mut rng = Rng::new(seed);
            let mut cfg = Config::new(Policy::Gwtf, 4, 1 << 20);
            cfg.gossip_sinks = 1 + rng.below(20) as usize;
            let mut n = Node::new(Arc::new(cfg), 1000, 2, 0.5, 4, seed);
            n.now = 1_000;
            let sinks = 1 + rng.below(60) as u32;
            for j in 0..rng.below(40) as NodeId {
                // Costs from a few values (ties between sinks and lists).
                let list: Vec<(NodeId, f64)> = (0..rng.below(20))
                    .map(|_| {
                        (
                            rng.below(sinks as u64) as NodeId,
                            0.25 * rng.below(12) as f64,
                        )
                    })
                    .collect();
                let stage = if rng.below(5) == 0 { 1 } else { 3 };
                let p = n.peers.get_or_insert_with(j * 7, || Peer::new(stage, 0));
                p.costs = SinkCosts::from_gossip(list.into());
                p.dead = rng.below(8) == 0;
                p.banned_until = if rng.below(8) == 0 { 5_000 } else { 0 };
                p.lat = Some([0.0, 0.25, 0.5][rng.below(3) as usize]);
                p.bw = Some(1e9);
                p.compute_s = 0.5;
            }
            // Rejections edit a list in place.
            let ids = n.peers.ids.clone();
            for j in ids {
                if rng.below(3) == 0 {
                    let p = n.peers.get_mut(&j).unwrap();
                    let sink = rng.below(sinks as u64) as NodeId;
                    match rng.below(3) {
                        0 => p.costs.remove(sink),
                        1 => p.costs.insert(sink, INF),
                        _ => p.costs.insert(sink, 0.25 * rng.below(12) as f64),
                    }
                    p.costs.insert(sink, 0.25 * rng.below(12) as f64);
                }
            }
            assert_eq!(n.my_costs(), my_costs_reference(&n), "seed {seed}");
        }
    }

    #[test]
    fn gossiped_lists_are_kept_ordered_by_cost() {
        let ordered = |c: &SinkCosts| {
            c.0.windows(2)
                .all(|w| cost_order(&w[0], &w[1]) == std::cmp::Ordering::Less)
        };
        // Out of order, a sink twice (the last one wins, as in a map).
        let mut c = SinkCosts::from_gossip(vec![(3, 2.0), (1, 1.0), (3, 0.5), (2, 1.0)].into());
        assert_eq!(*c.0, [(3, 0.5), (1, 1.0), (2, 1.0)]);
        c.insert(1, 0.1);
        c.insert(9, 0.7);
        c.remove(2);
        assert_eq!(*c.0, [(1, 0.1), (3, 0.5), (9, 0.7)]);
        assert!(ordered(&c));
        assert_eq!(c.get(9), Some(0.7));
        assert_eq!(c.get(2), None);
        // What my_costs sends is shared as it is.
        let list: Arc<[(NodeId, f64)]> = vec![(5, 0.1), (4, 0.2), (6, 0.2)].into();
        let c = SinkCosts::from_gossip(list.clone());
        assert!(Arc::ptr_eq(&c.0, &list));
        assert!(!c.material_change(&[(5, 0.1), (4, 0.2), (6, 0.201)]));
        assert!(c.material_change(&[(5, 0.1), (4, 0.2), (6, 0.3)]));
        assert!(c.material_change(&[(5, 0.1), (4, 0.2)]));
        assert!(c.material_change(&[(5, 0.1), (4, 0.2), (7, 0.2)]));
        assert!(!c.material_change(&[(4, 0.2), (5, 0.1), (6, 0.2)]));
    }

    #[test]
    fn member_list_follows_the_set() {
        let mut m = MemberSet::default();
        for x in [5, 1, 9] {
            m.insert(x);
        }
        assert_eq!(*m.list(), vec![1, 5, 9]);
        m.remove(&5);
        assert_eq!(*m.list(), vec![1, 9]);
        let announced = Arc::new(vec![1, 2, 9]);
        m.assign(&announced, 9);
        assert!(Arc::ptr_eq(&m.list(), &announced));
        m.assign(&Arc::new(vec![1, 2]), 9);
        assert_eq!(*m.list(), vec![1, 2, 9]);
        m.assign(&Arc::new(vec![7, 3]), 9);
        assert_eq!(m.iter().copied().collect::<Vec<_>>(), vec![3, 7, 9]);
        assert_eq!(*m.list(), vec![3, 7, 9]);
    }
}
