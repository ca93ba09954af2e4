//! Plain data types of the protocol: identifiers, configuration, messages,
//! inputs, actions, trainer tasks and events.
//!
//! Messages are plain Rust enums; [`super::codec`] encodes them as control
//! envelopes of the v1 wire format.
use std::sync::Arc;

/// Virtual or real time in microseconds. The protocol never reads a clock:
/// the driver passes `now` in.
pub type Time = u64;
/// A node's identity (unique for the lifetime of the swarm; a rejoining
/// machine gets a new one).
pub type NodeId = u32;
/// Pipeline stage: 0 is the data holders' stage (embedding, head and loss),
/// 1..=S are the relay stages.
pub type Stage = u16;
/// Identifier of one unit of reserved flow on one link (GWTF policy).
pub type Label = u64;
/// Identifier of a trainer task, unique per node.
pub type TaskId = u64;

/// Microseconds in one second.
pub const SEC: Time = 1_000_000;

/// Seconds (f64) to [`Time`].
pub fn secs(s: f64) -> Time {
    if s <= 0.0 {
        0
    } else {
        (s * SEC as f64).round() as Time
    }
}

/// [`Time`] to seconds.
pub fn to_secs(t: Time) -> f64 {
    t as f64 / SEC as f64
}

/// One microbatch: owned by a data holder, in one iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MbId {
    pub holder: NodeId,
    pub iter: u32,
    pub idx: u32,
}

/// The routing policy a node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Policy {
    /// The decentralized flow protocol of GWTF.
    Gwtf,
    /// The SWARM baseline as SWARM's public code behaves (docs/SPEC.md
    /// section 8).
    Swarm,
    /// A stronger SWARM-like baseline of this project's own, not SWARM: the
    /// next hop with the least own outstanding work over its throughput
    /// (latency-aware), a crash restarting the microbatch from its holder.
    SwarmPlus,
    /// SWARM as the GWTF paper's first author re-implemented it
    /// (NikolayBlagoev/DecCom-Python, `swarmprotocol.py`): hops go relay
    /// to relay, each to the next-stage peer of the lowest measured delay
    /// (docs/SPEC.md section 8).
    SwarmDeccom,
    /// Source routing along paths computed centrally (a min-cost max-flow
    /// with global knowledge and load-dependent costs) and handed to the
    /// data holders by the driver: a plan, not an optimum.
    CentralMcmf,
}

impl Policy {
    /// Whether a relay keeps a microbatch's activations from its forward
    /// to its backward (memory its capacity bounds). SWARM's backward is
    /// stateless: it recomputes the forward (`swarm/pipeline/src/moe/
    /// server/expert_backend.py`), so its forward keeps nothing and its
    /// backward costs a forward more.
    pub fn keeps_activations(self) -> bool {
        self != Policy::Swarm
    }

    /// Every policy, in the order tables and plots show them.
    pub const ALL: [Policy; 5] = [
        Policy::Gwtf,
        Policy::Swarm,
        Policy::SwarmPlus,
        Policy::SwarmDeccom,
        Policy::CentralMcmf,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Gwtf => "gwtf",
            Policy::Swarm => "swarm",
            Policy::SwarmPlus => "swarm-plus",
            Policy::SwarmDeccom => "swarm-deccom",
            Policy::CentralMcmf => "central-mcmf",
        }
    }

    /// The policy of [`Policy::name`] `name`.
    pub fn by_name(name: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// Why a node fenced itself off its stage group ([`Event::Fenced`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceReason {
    /// Its own clock jumped: it ran none of its timers for this many
    /// microseconds, longer than the suspicion time (it was paused or
    /// starved), so its view of the group is stale and the group has
    /// dropped it.
    Paused { gap: Time },
    /// Its coordinator told it that it is no longer a member
    /// ([`Msg::Evicted`]).
    Evicted { diverged: bool },
    /// It heard from nobody at all for the isolation time while its
    /// coordinator went silent: it is the node cut off, not its group.
    Isolated,
    /// It coordinated a commit whose members held different weights and
    /// its own were in the minority.
    Diverged,
    /// A node of its stage outside its group holds weights with more
    /// updates (`updates`) than its own: its group was left behind (a
    /// split while links were cut), so it joins again and downloads the
    /// newer state rather than evict the node that holds it.
    Behind { updates: u32, holder: NodeId },
}

impl FenceReason {
    /// A short name for logs and JSON events.
    pub fn name(&self) -> &'static str {
        match self {
            FenceReason::Paused { .. } => "paused",
            FenceReason::Evicted { diverged: false } => "evicted",
            FenceReason::Evicted { diverged: true } => "evicted_diverged",
            FenceReason::Isolated => "isolated",
            FenceReason::Diverged => "diverged",
            FenceReason::Behind { .. } => "behind",
        }
    }
}

/// Protocol configuration. Every constant of docs/SPEC.md section 4 is here.
#[derive(Clone, Debug)]
pub struct Config {
    pub policy: Policy,
    /// Number of relay stages S (relays serve stages 1..=S).
    pub relay_stages: Stage,
    /// Period of the protocol tick (prototype: 2 s).
    pub tick: Time,
    /// Cost gossip (CHANGE) and local search every this many ticks (prototype: 6).
    pub gossip_ticks: u32,
    /// Liveness cycle: heartbeats to the group coordinator, re-introductions,
    /// re-broadcast of iteration barriers (prototype: 12-tick cycle; we beat
    /// more often than we re-introduce).
    pub heartbeat_ticks: u32,
    /// A group peer silent for this many ticks is suspected dead.
    pub suspect_ticks: u32,
    /// Unmatched reservations expire after this many ticks (prototype: 10-12).
    pub reservation_expiry_ticks: u32,
    /// A reserved flow unused for this many ticks is released.
    pub flow_idle_expiry_ticks: u32,
    /// Microbatches per data holder per iteration.
    pub mb_per_iter: u32,
    /// Iterations to train (None: no end). Holders start no microbatch of
    /// a later iteration: work nobody would apply is not computed.
    pub iterations: Option<u32>,
    /// Bound on microbatches in flight per data holder.
    pub max_in_flight: u32,
    /// Bytes of one activation (the gradient has the same size).
    pub activation_bytes: u64,
    /// Bytes of one stage's weights + optimizer state (state download on
    /// join), indexed by stage 0..=S.
    pub stage_state_bytes: Vec<u64>,
    /// Ack timeout = max(min, mult * EMA of the hop's ack delay).
    pub ack_timeout_mult: f64,
    pub min_ack_timeout: Time,
    /// Ack timeout before any delay was observed on a link.
    pub initial_ack_timeout: Time,
    /// EMA weight of a new sample.
    pub ema_alpha: f64,
    /// Simulated annealing: initial temperature (cost units) of relays.
    pub sa_t0_relay: f64,
    /// Initial temperature of data holders.
    pub sa_t0_holder: f64,
    /// Temperature factor per accepted move.
    pub sa_cooling: f64,
    /// One cost unit in seconds (the temperature is in these units).
    pub cost_unit_s: f64,
    /// A peer that rejected a proposal is skipped for this many attempts.
    pub sa_skip_attempts: u32,
    /// Cost-to-sink entries carried by one CHANGE message (the nearest sinks).
    pub gossip_sinks: usize,
    /// Upstream peers one gossip round reaches (taken in turn).
    pub gossip_fanout: usize,
    /// A CHANGE goes upstream between periodic rounds only when a cost this
    /// node advertises moved by more than this fraction (or a sink came or
    /// went): the drift of a reservation's load waits for the next round.
    pub triggered_gossip_threshold: f64,
    /// A reservation is rejected when the downstream cost grew by more than
    /// this fraction over the cost the requester assumed.
    pub stale_cost_tolerance: f64,
    /// GWTF rerouting: a flow moves to a cheaper next hop only when that
    /// lowers its cost to the sink by more than this fraction (hysteresis
    /// against flapping on measurement noise).
    pub reroute_min_gain: f64,
    /// GWTF cost of a hop for one more flow: the link's transfer term is
    /// counted once more, times this weight, for each flow already on the
    /// link (0: costs ignore the load of links).
    pub link_load_weight: f64,
    /// GWTF cost of a relay for one more flow: its compute time, times this
    /// weight, for each flow it already carries (0: costs ignore the load of
    /// GPUs).
    pub gpu_load_weight: f64,
    /// GWTF: a new flow's next hop is drawn at random among those whose
    /// cost is within this fraction of the cheapest (0: always the
    /// cheapest), so that nodes seeing the same costs spread their flows.
    pub route_tie_tolerance: f64,
    /// A joiner that finds a stage without any live node restarts it from
    /// the initial weights (the real swarm: training goes on). Off in the
    /// simulator, whose yardsticks assume a live node per stage and report
    /// a pause instead.
    pub restart_empty_stages: bool,
    /// A relay stage that empties with no copy of its state kept is
    /// rebuilt from its neighbouring relay stages' weights (CheckFree: the
    /// joiner asks one member of each for its state, and its trainer
    /// averages those that fit, `WorkKind::AverageStates`) rather than
    /// restarted from the initial weights. On where the trainer can
    /// average (the built-in model's); the runtime's.
    pub rebuild_from_neighbours: bool,
    /// SWARM: a peer that failed is banned for this many ticks.
    pub ban_ticks: u32,
    /// Bandwidth assumed for a link before it is measured (bytes/s).
    pub prior_bandwidth: f64,
    /// Bytes of the probe transfer sent after an introduction.
    pub probe_bytes: u64,
    /// A missing microbatch at aggregation is re-requested after this long,
    /// then the whole microbatch is restarted from its data holder (asked
    /// again every period while the holder answers that it is on it), then
    /// it is dropped (only a holder that stopped answering, a dead one, has
    /// its microbatch end there).
    pub redo_timeout: Time,
    /// A holder restarts a microbatch in flight for this long (last resort).
    pub e2e_timeout: Time,
    /// The iteration barrier reports a stalled stage after this long.
    pub stall_report: Time,
    /// Delay before the first iteration (flows are being built).
    pub start_delay: Time,
    /// The trainer can run a relay's forward keeping only its input and
    /// recompute it at the backward (activation checkpointing at stage
    /// granularity). With it a relay whose memory is full runs a forward
    /// at once that way instead of waiting for a backward to free memory:
    /// one forward more of GPU time against a wait of a pipeline round
    /// trip. Off: the forward waits.
    pub recompute: bool,
    /// Fencing: a node that finds its own timers late by more than the
    /// suspicion time (`suspect_ticks` ticks: it was paused or starved, and
    /// its group has dropped it) stops serving its group and rejoins
    /// ([`FenceReason::Paused`]); one that heard from nobody for
    /// `isolation_ticks` while its coordinator went silent does the same
    /// instead of coordinating a group of its own
    /// ([`FenceReason::Isolated`]). Off in the simulator (its nodes are
    /// never paused nor cut off; crashes are clean).
    pub fence_on_pause: bool,
    /// See `fence_on_pause`: ticks without a word from any peer after which
    /// a node whose coordinator is silent takes itself for the one cut off.
    pub isolation_ticks: u32,
    /// A relay stage's coordinator leaves out of a commit the members
    /// with no grant in it whose best measured link is far slower than
    /// its usual ones ([`crate::protocol::SLOW_LINK_RATIO`]): their
    /// all-reduce would hold the stage up for nothing of theirs. A member
    /// that did not step with a commit (left out, or its all-reduce
    /// failed) counts its weights without that update (its heartbeats
    /// say so, and it serves no state) until its runtime downloads the
    /// state again ([`crate::protocol::Node::caught_up`]). Off in the
    /// simulator, whose nodes download no state after joining.
    pub leave_out_stragglers: bool,
    /// Data holders keep a copy of every relay stage's state (weights and
    /// optimizer state), asked for after every this many of their own
    /// updates, so that a stage's state outlives its nodes (0: none). The
    /// runtime's; the simulator's nodes keep none.
    pub keep_states_every: u32,
    /// Data holders assemble a checkpoint, every stage's state of one
    /// iteration, after every this many of their own updates (0: none):
    /// their own state and a copy from each relay stage, exported right
    /// after that update. The runtime's.
    pub save_every: u32,
    /// A founding member starts from weights that hold the updates through
    /// this iteration (a swarm resumed from a checkpoint): the first
    /// iteration is the next one. Every founding member is given the same.
    pub resume_from: Option<u32>,
}

/// `Config::leave_out_stragglers`: a member whose best measured link is
/// this many times slower than the median of its coordinator's links is
/// far slower than the others...
pub const SLOW_LINK_RATIO: f64 = 4.0;
/// ...when its share of the stage's all-reduce over that link takes at
/// least this long (seconds): a slow link that costs less is waited for.
pub const SLOW_LINK_MIN_S: f64 = 0.1;

impl Config {
    /// Defaults from docs/SPEC.md (prototype constants where they exist).
    pub fn new(policy: Policy, relay_stages: Stage, activation_bytes: u64) -> Config {
        let tick = 2 * SEC;
        Config {
            policy,
            relay_stages,
            tick,
            gossip_ticks: 6,
            heartbeat_ticks: 3,
            suspect_ticks: 8,
            reservation_expiry_ticks: 10,
            flow_idle_expiry_ticks: 60,
            mb_per_iter: 8,
            iterations: None,
            max_in_flight: 4,
            activation_bytes,
            stage_state_bytes: vec![0; relay_stages as usize + 1],
            ack_timeout_mult: 4.0,
            min_ack_timeout: 5 * SEC,
            initial_ack_timeout: 8 * SEC,
            ema_alpha: 0.3,
            sa_t0_relay: 1.7,
            sa_t0_holder: 2.0,
            sa_cooling: 0.95,
            cost_unit_s: 0.1,
            sa_skip_attempts: 3,
            gossip_sinks: 16,
            gossip_fanout: 12,
            triggered_gossip_threshold: 0.10,
            stale_cost_tolerance: 0.25,
            reroute_min_gain: 0.10,
            link_load_weight: 0.1,
            gpu_load_weight: 0.1,
            route_tie_tolerance: 0.05,
            restart_empty_stages: false,
            rebuild_from_neighbours: false,
            ban_ticks: 15,
            prior_bandwidth: 0.5e9 / 8.0,
            probe_bytes: 1 << 20,
            redo_timeout: 30 * SEC,
            stall_report: 60 * SEC,
            e2e_timeout: 180 * SEC,
            start_delay: 6 * SEC,
            recompute: false,
            fence_on_pause: false,
            isolation_ticks: 8,
            leave_out_stragglers: false,
            keep_states_every: 0,
            save_every: 0,
            resume_from: None,
        }
    }

    pub fn is_last_stage(&self, s: Stage) -> bool {
        s == self.relay_stages
    }
}

/// One reserved flow as seen by a same-stage peer during local search.
#[derive(Clone, Debug, PartialEq)]
pub struct FlowInfo {
    /// The label on the link into the owner.
    pub in_label: Label,
    pub sink: NodeId,
    pub prev: NodeId,
    pub next: NodeId,
    /// Label on the link out of the owner.
    pub out_label: Label,
    /// Cost from the source up to the owner's input.
    pub cost_from_source: f64,
    /// The owner's cost from its input to the sink along this flow.
    pub cost_to_sink: f64,
    /// The owner's cost of its segment of this flow, from `prev`'s output
    /// through the owner to `next` (the hops both sides, loaded, and the
    /// owner's GPU queue): what a same-stage peer that would take the flow
    /// over (a redirect) must beat.
    pub segment: f64,
}

/// A stage's summary, answered to a joining node.
#[derive(Clone, Debug, PartialEq)]
pub struct StageSummary {
    pub stage: Stage,
    pub members: u32,
    /// Sum over members of microbatches per second (1 / compute time).
    pub throughput: f64,
    /// The iteration in progress as far as the member knows: the latest
    /// one opened (an iteration opens only once the one before is final,
    /// so this never runs ahead), or its oldest kept one if it heard of
    /// none. Where a restarted stage begins.
    pub open_iter: u32,
    /// Stages next to the member's with no live node it knows of: a joiner
    /// restarts such a stage (nobody can serve its state).
    pub empty_neighbors: Vec<Stage>,
}

/// Messages between nodes.
#[derive(Clone, Debug, PartialEq)]
pub enum Msg {
    // ---- membership
    /// Discovery; `reply` asks for an introduction back (RTT probe).
    Introduce {
        /// The iteration the sender believes comes next.
        iter: u32,
        stage: Stage,
        spare: u32,
        compute_s: f64,
        sent_at: Time,
        echo: Option<Time>,
    },
    /// Bandwidth probe (payload of `bytes`), acknowledged with [`Msg::ProbeAck`].
    Probe {
        bytes: u64,
        sent_at: Time,
    },
    ProbeAck {
        bytes: u64,
        sent_at: Time,
    },
    /// Liveness of a group link; `members` is set when the coordinator
    /// announces the group (only when it changed), or when a member tells
    /// a node that took it for its coordinator who is. `coord` is the
    /// coordinator the sender follows (itself when it coordinates): with
    /// a coordinator that stays while it lives, the smallest id of a list
    /// is not the coordinator.
    ///
    /// `updates` is how many iterations' updates the sender's weights
    /// hold (the last one applied plus one; 0: none): of two groups of one
    /// stage that hear of each other, the one behind dissolves and joins
    /// again, never the one ahead (see `fencing`). `version` is the
    /// sender's weights version (the second half of its group's last
    /// `Applied`, or of the state it took up): as many updates in another
    /// version are other weights (two joiners that took up one emptied
    /// stage apart, each from its own), and of two such groups the larger
    /// coordinator's dissolves instead of merging.
    Heartbeat {
        members: Option<Arc<Vec<NodeId>>>,
        coord: NodeId,
        updates: u32,
        version: u64,
    },
    /// Graceful leave: peers drop the sender at once.
    Goodbye,
    /// Ask a group member (or coordinator) to be added to the group.
    /// `incarnation` counts the sender's passes through the join path (0
    /// for a founding member): a coordinator that evicted incarnation `k`
    /// admits the sender again only as `k + 1` or later, so a member that
    /// was dropped cannot slip back with its old state (see
    /// [`Msg::Evicted`]).
    GroupJoin {
        stage: Stage,
        incarnation: u32,
    },
    /// Fencing: the coordinator no longer counts the receiver as a member
    /// of its stage group (it was silent for the suspicion time, or its
    /// weights differed from the commit's): it stops serving the group at
    /// once and comes back through the join path (stage choice, state
    /// download) as its next incarnation.
    Evicted {
        /// Its weights' digest differed from the other members' (else: it
        /// was silent).
        diverged: bool,
        /// The updates the sender's weights hold (as in
        /// [`Msg::Heartbeat`]): a silent member that holds more than its
        /// evictor does not fence itself; it answers in kind, and the
        /// group that is behind dissolves instead.
        updates: u32,
    },

    // ---- decentralized flow protocol
    /// Cost gossip upstream: spare capacity and best cost to each sink.
    Change {
        spare: u32,
        compute_s: f64,
        costs: Arc<[(NodeId, f64)]>,
    },
    FlowRequest {
        label: Label,
        sink: NodeId,
        cost_from_source: f64,
        expected_cost: f64,
    },
    FlowResponse {
        label: Label,
        accept: bool,
        cost: f64,
        spare: u32,
    },
    QueryFlows,
    FlowTable {
        spare: u32,
        flows: Vec<FlowInfo>,
    },
    /// Move 1: the proposer's flow `mine` and the receiver's flow `yours`
    /// (same sink) swap next hops.
    ProposeSwap {
        mine: FlowInfo,
        yours: Label,
        /// Cost of `mine` after the swap, as the proposer computes it.
        mine_new_cost: f64,
        temperature: f64,
    },
    RespondSwap {
        accept: bool,
        mine: Label,
        yours: Option<FlowInfo>,
    },
    /// Move 2: the proposer (with spare capacity) takes over the receiver's
    /// flow `yours`.
    ProposeRedirect {
        yours: Label,
        new_cost: f64,
        temperature: f64,
    },
    RespondRedirect {
        accept: bool,
        flow: Option<FlowInfo>,
    },
    /// The upstream (`new_prev`) of the flow arriving with `label` changed.
    NotifySwitch {
        label: Label,
        new_prev: NodeId,
    },
    /// The downstream of the flow on `label` changed: send to `new_next`.
    NotifyRedirect {
        label: Label,
        new_next: NodeId,
    },
    /// Release a reserved outflow (sent upstream) ...
    PushBack {
        label: Label,
    },
    /// ... or a reserved inflow (sent downstream).
    Cancel {
        label: Label,
    },

    // ---- microbatch lifecycle
    Forward {
        mb: MbId,
        attempt: u32,
        path: Arc<Vec<NodeId>>,
        label: Option<Label>,
        /// Preferred next hop (crash recovery: the unchanged next node).
        hint: Option<NodeId>,
        /// False when re-running a stage whose upstream already has the gradient.
        need_grad: bool,
        /// Planned full path (central-mcmf policy).
        plan: Option<Arc<Vec<NodeId>>>,
    },
    Backward {
        mb: MbId,
        attempt: u32,
        path: Arc<Vec<NodeId>>,
    },
    /// Per-hop acknowledgement, sent when the hop's work is done.
    Ack {
        mb: MbId,
        attempt: u32,
        backward: bool,
        busy: Time,
        bytes: u64,
    },
    /// A hop arrived and waits in the receiver's GPU queue: it is alive
    /// and holds the work; `wait` is its estimate of the time until the
    /// hop's work is done (the full `Ack` follows then). The sender pushes
    /// the hop's ack deadline back by that much instead of taking queueing
    /// for a crash.
    Queued {
        mb: MbId,
        attempt: u32,
        backward: bool,
        wait: Time,
    },
    /// The node after `dead` could not hand it a gradient: the node before
    /// `dead` re-runs `dead`'s stage on a replacement (GWTF).
    CrashNotice {
        mb: MbId,
        attempt: u32,
        dead: NodeId,
        after: NodeId,
    },
    /// Restart the whole microbatch (to its holder): `attempt` is the failed
    /// attempt (data path), None when an aggregate lost its contribution.
    Restart {
        mb: MbId,
        attempt: Option<u32>,
    },
    /// The holder's answer to a [`Msg::Restart`] without an attempt: it is
    /// alive and re-running `mb` (queued or in flight), so the aggregate
    /// that lost it keeps waiting instead of dropping it.
    Restarting {
        mb: MbId,
    },
    /// The stage of `dead` lost its contribution for `mb`: re-send the stored
    /// activation to a replacement that sends to `next`.
    Redo {
        mb: MbId,
        dead: NodeId,
        next: NodeId,
    },

    // ---- iteration barrier and aggregation
    /// Holders start iteration `iter` (from the holders' coordinator).
    StartIter {
        iter: u32,
        holders: Arc<Vec<NodeId>>,
    },
    HolderDone {
        iter: u32,
    },
    /// Iteration `iter` is over for the holders in `holders`.
    EndIter {
        iter: u32,
        origin: NodeId,
        holders: Arc<Vec<NodeId>>,
    },
    Claim {
        iter: u32,
        mb: MbId,
        prev: NodeId,
        next: NodeId,
    },
    ClaimReply {
        mb: MbId,
        granted: bool,
    },
    /// A member re-sends its state to a new coordinator.
    Sync {
        iter: u32,
        granted: Vec<(MbId, NodeId, NodeId)>,
        end: Option<(NodeId, Arc<Vec<NodeId>>)>,
    },
    /// The coordinator's own grants of `iter` (microbatch, the hop it came
    /// from, the hop it went to), to the member that would take over if it
    /// died: with them, its death costs one stage of those microbatches
    /// (as any member's does), not their restart from the holders.
    Deputy {
        iter: u32,
        granted: Vec<(MbId, NodeId, NodeId)>,
    },
    /// The coordinator commits `iter` (a new `epoch`): `members` all-reduce
    /// in this order. `digest` names exactly what the commit covers (its
    /// grants with their owners, and what it gave up), so that a successor
    /// can tell whether what it knows of it is all of it (see `deputy`).
    /// `mine` lists the microbatches the commit counts as the receiving
    /// member's: exactly what its contribution sums (a grant it holds that
    /// the coordinator counts as another member's is left out, so no
    /// microbatch is summed twice).
    Commit {
        iter: u32,
        epoch: u64,
        members: Arc<Vec<NodeId>>,
        digest: u64,
        mine: Arc<Vec<MbId>>,
    },
    /// A member finished its part of the all-reduce of `iter` (commit
    /// `epoch`); `weights` digests the weights it aggregated on (0: not
    /// known), so the coordinator can tell replicas that drifted apart.
    AggDone {
        iter: u32,
        epoch: u64,
        weights: u64,
    },
    /// A member's part of the all-reduce of `iter` (commit `epoch`) ended
    /// without the mean although no member is known lost (a member sent
    /// what did not fit, its trainer failed the gradient, a send failed):
    /// the coordinator commits again.
    AggFailed {
        iter: u32,
        epoch: u64,
    },
    /// A member's measured links to other members of its group, to its
    /// coordinator, which orders the all-reduce ring by them: (member,
    /// one-way latency s, bandwidth bytes/s).
    LinkReport {
        links: Vec<(NodeId, f64, f64)>,
    },
    Applied {
        iter: u32,
        version: u64,
    },
    StageDone {
        iter: u32,
        stage: Stage,
    },
    Finalize {
        iter: u32,
        holders: Arc<Vec<NodeId>>,
    },

    // ---- join
    StageQuery,
    StageInfo {
        summary: StageSummary,
    },
    StateRequest,
    /// A data holder asks a relay for a copy of its stage's state to keep
    /// ([`Config::keep_states_every`], [`Config::save_every`]), exported
    /// right after the relay applies the update of `iteration` (at once
    /// when it did already); answered with a `StateResponse` by the
    /// relay's runtime, outside the protocol's join.
    CopyRequest {
        iteration: u32,
    },
    /// A joiner restoring an emptied stage asks a data holder which copy
    /// of `stage`'s state it keeps.
    KeptQuery {
        stage: Stage,
    },
    /// A holder's answer: the iteration whose update the copy of `stage`
    /// it keeps includes last, if it keeps one, and the iteration the
    /// holders run now (the relays next to an empty stage may not have
    /// heard of its opening: the news travels through the stage).
    KeptInfo {
        stage: Stage,
        iteration: Option<u32>,
        open_iter: u32,
    },
    /// The joiner asks the holder for its copy of `stage`: answered by the
    /// holder's runtime with a `StateResponse` (the copy's version, no
    /// members), or with a `KeptInfo` of no copy.
    KeptRequest {
        stage: Stage,
    },
    /// A joiner rebuilds emptied relay stage `stage` from the weights of
    /// its neighbouring stages (`Config::rebuild_from_neighbours`): a
    /// member of stage `stage - 1` or `stage + 1` answers with its state,
    /// sent like a download (its runtime serves it).
    RebuildRequest {
        stage: Stage,
    },
    StateResponse {
        version: (u32, u64),
        members: Arc<Vec<NodeId>>,
        bytes: u64,
        /// The server's coordinator (the server itself when it has none):
        /// the joiner follows it instead of taking coordination over
        /// because its id is smaller.
        coord: NodeId,
    },
}

impl Msg {
    /// The message kind's name.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Introduce { .. } => "Introduce",
            Msg::Probe { .. } => "Probe",
            Msg::ProbeAck { .. } => "ProbeAck",
            Msg::Heartbeat { .. } => "Heartbeat",
            Msg::Goodbye => "Goodbye",
            Msg::GroupJoin { .. } => "GroupJoin",
            Msg::Evicted { .. } => "Evicted",
            Msg::Change { .. } => "Change",
            Msg::FlowRequest { .. } => "FlowRequest",
            Msg::FlowResponse { .. } => "FlowResponse",
            Msg::QueryFlows => "QueryFlows",
            Msg::FlowTable { .. } => "FlowTable",
            Msg::ProposeSwap { .. } => "ProposeSwap",
            Msg::RespondSwap { .. } => "RespondSwap",
            Msg::ProposeRedirect { .. } => "ProposeRedirect",
            Msg::RespondRedirect { .. } => "RespondRedirect",
            Msg::NotifySwitch { .. } => "NotifySwitch",
            Msg::NotifyRedirect { .. } => "NotifyRedirect",
            Msg::PushBack { .. } => "PushBack",
            Msg::Cancel { .. } => "Cancel",
            Msg::Forward { .. } => "Forward",
            Msg::Backward { .. } => "Backward",
            Msg::Ack { .. } => "Ack",
            Msg::Queued { .. } => "Queued",
            Msg::CrashNotice { .. } => "CrashNotice",
            Msg::Restart { .. } => "Restart",
            Msg::Restarting { .. } => "Restarting",
            Msg::Redo { .. } => "Redo",
            Msg::StartIter { .. } => "StartIter",
            Msg::HolderDone { .. } => "HolderDone",
            Msg::EndIter { .. } => "EndIter",
            Msg::Claim { .. } => "Claim",
            Msg::ClaimReply { .. } => "ClaimReply",
            Msg::Sync { .. } => "Sync",
            Msg::Commit { .. } => "Commit",
            Msg::AggDone { .. } => "AggDone",
            Msg::Deputy { .. } => "Deputy",
            Msg::AggFailed { .. } => "AggFailed",
            Msg::LinkReport { .. } => "LinkReport",
            Msg::Applied { .. } => "Applied",
            Msg::StageDone { .. } => "StageDone",
            Msg::Finalize { .. } => "Finalize",
            Msg::StageQuery => "StageQuery",
            Msg::StageInfo { .. } => "StageInfo",
            Msg::StateRequest => "StateRequest",
            Msg::CopyRequest { .. } => "CopyRequest",
            Msg::KeptQuery { .. } => "KeptQuery",
            Msg::KeptInfo { .. } => "KeptInfo",
            Msg::KeptRequest { .. } => "KeptRequest",
            Msg::RebuildRequest { .. } => "RebuildRequest",
            Msg::StateResponse { .. } => "StateResponse",
        }
    }

    /// Bytes this message occupies on a link, for drivers that model links:
    /// its encoded control frame plus, for a bulk message, the data frame
    /// with its tensor or state (exact: see [`super::codec::link_bytes`]).
    pub fn wire_bytes(&self, cfg: &Config) -> u64 {
        let payload = match self {
            Msg::Forward { .. } | Msg::Backward { .. } => cfg.activation_bytes,
            Msg::Probe { bytes, .. } | Msg::StateResponse { bytes, .. } => *bytes,
            _ => 0,
        };
        super::codec::link_bytes(self, payload)
    }

    /// True for messages that carry bulk data (activations, gradients, state).
    pub fn is_bulk(&self) -> bool {
        matches!(
            self,
            Msg::Forward { .. }
                | Msg::Backward { .. }
                | Msg::Probe { .. }
                | Msg::StateResponse { .. }
        )
    }
}

/// Work for the trainer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// Holder: embedding forward (stage 0 input side).
    Embed,
    /// Relay: forward of its stage.
    Forward,
    /// Holder: head forward, loss and head backward.
    Loss,
    /// Relay: backward of its stage.
    Backward,
    /// Holder: embedding backward.
    EmbedBackward,
    /// All-reduce of the stage's accumulated gradients among `members` and
    /// the optimizer step.
    Aggregate { members: u32 },
}

impl TaskKind {
    /// Compute tasks use the GPU; aggregation is network work.
    pub fn is_compute(self) -> bool {
        !matches!(self, TaskKind::Aggregate { .. })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Task {
    pub id: TaskId,
    pub kind: TaskKind,
    pub stage: Stage,
    pub mb: Option<MbId>,
    /// The microbatch's attempt (0 for tasks without a microbatch).
    pub attempt: u32,
    /// Activation recompute (only with [`Config::recompute`]): on a
    /// `Forward`, keep only the input, not the activations (this relay's
    /// memory is full); on a `Backward`, run the stage's forward again
    /// from that input first (one forward more of GPU time).
    pub recompute: bool,
}

/// What the driver feeds into a node.
#[derive(Clone, Debug)]
pub enum Input {
    /// Start as a founding member: `peers` is the bootstrap view (node, stage).
    Start { peers: Vec<(NodeId, Stage)> },
    /// Join a running swarm (stage chosen by the protocol) through `peers`.
    Join { peers: Vec<(NodeId, Stage)> },
    /// A message arrived.
    Message { from: NodeId, msg: Msg },
    /// The trainer finished a task.
    TaskDone { id: TaskId },
    /// A task could not be finished (the trainer failed it, or an
    /// aggregate's all-reduce ended without the mean). An aggregate task
    /// is committed again; the other kinds are recovered by the protocol's
    /// timeouts.
    TaskFailed { id: TaskId },
    /// The connection to `peer` broke (or the driver knows it is gone).
    PeerLost { peer: NodeId },
    /// Bytes came from these peers since the driver last said so, with no
    /// message yet perhaps (a large frame streaming in over a slow link
    /// keeps the messages queued behind it): signs of life, like messages.
    Heard { peers: Vec<NodeId> },
    /// The runtime's directory says `peer` serves `stage` (a peer it had
    /// not heard of, or one whose stage changed). Introductions reach only
    /// the nodes a node knows: without this, two joiners that took up one
    /// emptied stage at once coordinated a group of one each and never
    /// heard of each other, and the one that got no microbatch stood by
    /// with weights that were no longer the stage's.
    Located { peer: NodeId, stage: Stage },
    /// Leave gracefully.
    Leave,
    /// Central-mcmf policy: the routes of this data holder (full paths, stage
    /// 1..=S), from the central solver.
    SetPlan { paths: Vec<Arc<Vec<NodeId>>> },
}

/// What a node asks its driver to do.
#[derive(Clone, Debug)]
pub enum Action {
    Send { to: NodeId, msg: Msg },
    Run(Task),
    Event(Event),
}

/// Observable facts, for statistics and invariant checks.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Joined stage `stage` (after the state download).
    Active { stage: Stage },
    /// A holder finished the backward of one of its microbatches.
    MbDone { mb: MbId, path: Arc<Vec<NodeId>> },
    /// Holder: iteration `iter` started.
    IterStarted { iter: u32 },
    /// The holders' coordinator finalized iteration `iter` (all stages
    /// applied): `holders` finished it; `next` take part in the next one,
    /// which opens now (a holder that joined since trains from the one
    /// after).
    IterFinalized {
        iter: u32,
        holders: Arc<Vec<NodeId>>,
        next: Arc<Vec<NodeId>>,
    },
    /// The coordinator of `stage` committed `iter`: the microbatches whose
    /// stage-`stage` gradient is in the aggregate (each exactly once).
    StageCommitted {
        stage: Stage,
        iter: u32,
        /// (microbatch, the member whose result is in the aggregate).
        mbs: Arc<Vec<(MbId, NodeId)>>,
        dropped: Vec<MbId>,
    },
    /// A member applied the aggregate of `iter`: new weights version.
    Applied {
        stage: Stage,
        iter: u32,
        version: u64,
    },
    /// The coordinator granted this node's result for `mb`, computed by
    /// `tasks` (useful compute once the stage commits it).
    Claimed { mb: MbId, tasks: Vec<TaskId> },
    /// A whole microbatch was restarted from its holder.
    Restarted { mb: MbId },
    /// A forward was re-sent to another node of the same stage.
    Rerouted { mb: MbId, stage: Stage },
    /// The iteration barrier has waited long for `stage`.
    Stalled { iter: u32, stage: Stage },
    /// No live node of `stage`, next to this node's, is known any more:
    /// its microbatches wait (training pauses) until a node joins it.
    StageEmpty { stage: Stage },
    /// A node of `stage` is known again after [`Event::StageEmpty`].
    StageResumed { stage: Stage },
    /// This joiner serves `stage`, which no live node held: from the
    /// model's initial weights, standing for the weights after the update
    /// of iteration `applied` (None: before any). The stage's trained
    /// weights were lost with its last node.
    StageRestarted { stage: Stage, applied: Option<u32> },
    /// This joiner serves `stage`, which no live node held, from the copy
    /// of its state that data holder `from` kept (the weights after the
    /// update of iteration `iteration`, the freshest copy the holders
    /// offered), standing for the weights after the update of `applied`:
    /// the updates between are lost with the stage's nodes, and the other
    /// stages keep theirs, as CheckFree restores a stage.
    StageRestored {
        stage: Stage,
        from: NodeId,
        iteration: u32,
        applied: u32,
    },
    /// This joiner serves `stage`, which no live node held and of which no
    /// holder kept a copy, rebuilt from the states of its neighbouring
    /// stages' members `from` (CheckFree): its trainer averages them
    /// (`WorkKind::AverageStates`), standing for the weights after the
    /// update of `applied`.
    StageRebuilt {
        stage: Stage,
        from: Vec<NodeId>,
        applied: Option<u32>,
    },
    /// This fenced node serves `stage` again with the weights it kept at
    /// its fence (the update of iteration `applied`): the members left
    /// miss that update, or none is left and no holder keeps a fresher
    /// copy, and no live node holds a newer state. The trainer keeps its
    /// weights; the members behind download them.
    StateKept { stage: Stage, applied: u32 },
    /// The node has left (goodbye sent).
    Left,
    /// A data holder that fenced itself found no live holder to download
    /// the holders' state from for `waited` microseconds (the others
    /// finished and left, or are gone): it cannot train on and stops.
    Stranded { stage: Stage, waited: Time },
    /// The all-reduce of `iter` at `stage` failed at `member` (see
    /// [`Msg::AggFailed`]): its coordinator commits again.
    AggregateFailed {
        stage: Stage,
        iter: u32,
        member: NodeId,
    },
    /// A coordinator removed `peer` from its stage's group.
    MemberRemoved { peer: NodeId },
    /// This node takes `peer` for gone (a failed connection, a goodbye, a
    /// suspicion): work it shares with it outside the protocol (an
    /// all-reduce in progress) must not wait for it any longer than the
    /// group does (the transport's own timeout is longer).
    PeerDead { peer: NodeId },
    /// This node stopped serving its stage group (fencing): what it held of
    /// the group (claims, grants, commits, flows, microbatches in flight)
    /// is dropped, and it comes back through the join path as incarnation
    /// `incarnation`. Its runtime must drop every result of work given
    /// before (see [`crate::protocol::Node::task_live`]).
    Fenced {
        reason: FenceReason,
        incarnation: u32,
    },
    /// The coordinator of `stage` committed `iter` without the members
    /// `slow`, which had no grant in it and are behind links far slower
    /// than the others' (`Config::leave_out_stragglers`): they download
    /// the state again. Raised when that set changes.
    LeftOut {
        stage: Stage,
        iter: u32,
        slow: Vec<NodeId>,
    },
    /// The coordinator of `stage` found that the members of the aggregate of
    /// `iter` did not hold the same weights (digest per member): an error,
    /// replicas must be bit-identical after every apply.
    ReplicasDiverged {
        stage: Stage,
        iter: u32,
        digests: Vec<(NodeId, u64)>,
    },
}
