//! Deterministic discrete-event simulator driving many protocol nodes.
//!
//! - Virtual clock (microseconds); one event queue (a calendar queue)
//!   ordered by (time, sequence number), so the same seed gives
//!   bit-identical output. No hash-map iteration reaches an output (hash
//!   maps are only looked up).
//! - Compute model: a node's GPU runs one task at a time, in the order
//!   its protocol node gave them (as the runtime's work queue hands its
//!   trainer work); task time = FLOPs / node speed, from the model
//!   presets of `crate::model` ([`model`]); memory bounds each relay's
//!   capacity.
//! - Link model: one-way latency + size / bandwidth per region pair
//!   ([`scenario`]), the bandwidth capped by the scenario's NIC; bulk
//!   transfers between two nodes go one after another in each direction
//!   (the runtime has one connection per pair and writes its frames in
//!   order); small control messages take latency + size / bandwidth.
//! - Churn: departures (crash, or graceful leave with probability
//!   `leave_fraction`) and joins as Poisson processes, each at
//!   `churn_per_hour` x the initial population per hour; a crash can hit a
//!   node at any moment, in the middle of a forward, a backward or an
//!   aggregation.
//! - Connections: two nodes have one once they exchanged a message (either
//!   way; a SWARM hop through its data holder connects each end with the
//!   holder). When a node is gone, every node it had a connection with gets
//!   `Input::PeerLost` one link latency later, and a message to a node that
//!   is gone gets its sender `Input::PeerLost` one round trip later: what
//!   the runtime does with a broken connection or a failed connect.
//! - Aggregation (all-reduce) time of a stage: the runtime's all-reduce in
//!   f32 among the commit's members: the butterfly up to 64 members, the
//!   hierarchy beyond (or the ring both ways in the commit's order, with
//!   `ring_beyond_butterfly`) ([`allreduce`]). This is a model of the
//!   runtime's machines (`swarm::butterfly`, `swarm::hierarchy`,
//!   `swarm::allreduce`), not those machines: its timing and loss rules
//!   are written again here. Each loss rule is tested against its
//!   machines (the ring's, the butterfly's and the hierarchy's tests in
//!   `swarm`).
//! - Yardstick: a lower bound on the iteration time of the current
//!   membership ([`bound`]), recomputed when the membership changed, that
//!   every policy's time is reported against.
//!
//! The simulator checks invariants as it runs (see [`SimReport::violations`]),
//! among them that no iteration beats its bound.
pub mod allreduce;
pub mod bound;
mod connections;
pub mod model;
pub mod optimal;
mod queue;
mod rings;
pub mod scenario;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use crate::protocol::rng::Rng;
use crate::protocol::{
    secs, to_secs, Action, Config, Event, Input, MbId, Msg, Node, NodeId, Policy, Stage, Task,
    TaskId, TaskKind, Time, SEC,
};
use model::ModelPreset;
use optimal::{CentralRouter, FlowRouter, RouteInstance, RoutePlan};
use queue::EventQueue;
use scenario::Scenario;

/// (microbatch, member whose result is in the aggregate) of one stage's commit.
type Committed = Arc<Vec<(MbId, NodeId)>>;

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub scenario: Scenario,
    pub model: ModelPreset,
    pub policy: Policy,
    /// Stop after this many finalized iterations.
    pub iterations: u32,
    pub seed: u64,
    /// Departures (and joins) per hour, as a fraction of the initial population.
    pub churn_per_hour: f64,
    /// Fraction of departures that are graceful leaves (the rest crash).
    pub leave_fraction: f64,
    pub holders: u32,
    pub relays: u32,
    pub mb_per_iter: u32,
    pub max_in_flight: u32,
    /// Speed of a node with relative compute time 1.0 (TFLOP/s); a node of
    /// relative time f runs at base / f, times a per-node factor in [0.8, 1.2].
    pub base_tflops: f64,
    /// GPU memory choices (GiB), one drawn per node.
    pub gpu_mem_gib: Vec<u64>,
    /// Bootstrap view: peers of the previous and of the next stage.
    pub view_size: usize,
    /// Give up (and report a stall) after this much simulated time.
    pub max_sim_time_s: f64,
    /// Compute the centralized optimum at every finalized iteration (for the
    /// "against the optimum" columns). Costly on very large swarms.
    pub reference_optimum: bool,
    /// Seconds between throughput samples in the time series.
    pub sample_every_s: f64,
    /// Stages beyond `BUTTERFLY_MAX_MEMBERS` members all-reduce around the
    /// two-way ring, as the runtime did before the hierarchy (its tests,
    /// and comparisons); by default they run the hierarchy.
    pub ring_beyond_butterfly: bool,
    /// The protocol's settings (timers, flags) instead of the simulator's
    /// planet-scale defaults: a testbed gives the runtime's, so that both
    /// run one protocol. The policy, the model's sizes, the microbatches
    /// and the in-flight bound are still this config's.
    pub protocol: Option<Arc<Config>>,
}

/// A founding member of a simulated run ([`Sim::founders`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Founder {
    pub id: NodeId,
    /// 0: a data holder.
    pub stage: Stage,
    /// Index into the scenario's regions.
    pub region: usize,
    /// Its GPU's speed (FLOP/s).
    pub flops: f64,
    /// Microbatches it holds at once.
    pub capacity: u32,
}

impl SimConfig {
    /// The scenario's population, GPU memory and global batch where it sets
    /// them, the defaults otherwise.
    pub fn new(scenario: Scenario, model: ModelPreset, policy: Policy) -> SimConfig {
        let holders = scenario.holders.unwrap_or(10);
        SimConfig {
            holders,
            relays: scenario.relays.unwrap_or(60),
            mb_per_iter: scenario.microbatches_per_holder(holders).unwrap_or(8),
            gpu_mem_gib: scenario.gpu_mem_gib.clone().unwrap_or(vec![16, 24, 48]),
            scenario,
            model,
            policy,
            iterations: 10,
            seed: 1,
            churn_per_hour: 0.0,
            leave_fraction: 0.25,
            max_in_flight: 4,
            base_tflops: 40.0,
            view_size: 16,
            max_sim_time_s: 0.0,
            reference_optimum: true,
            sample_every_s: 0.0,
            ring_beyond_butterfly: false,
            protocol: None,
        }
    }
}

/// Hasher for small keys of maps that are only looked up (never iterated
/// into an output): one multiply per word.
#[derive(Default)]
struct WordHasher(u64);

impl std::hash::Hasher for WordHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_u32(&mut self, x: u32) {
        self.write_u64(x as u64);
    }
    fn write_isize(&mut self, x: isize) {
        self.write_u64(x as u64);
    }
}

type FastHash = std::hash::BuildHasherDefault<WordHasher>;

/// Results of one run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SimReport {
    pub policy: String,
    pub scenario: String,
    pub model: String,
    pub seed: u64,
    pub initial_nodes: u32,
    pub churn_per_hour: f64,
    pub iterations_requested: u32,
    pub iterations_done: u32,
    pub completed: bool,
    pub training_time_s: f64,
    pub throughput_microbatches_per_hour: f64,
    pub time_per_microbatch_s: f64,
    pub iteration_time_p50_s: f64,
    pub iteration_time_p95_s: f64,
    pub microbatches_trained: u64,
    pub wasted_gpu_pct: f64,
    pub gpu_time_total_s: f64,
    pub gpu_time_useful_s: f64,
    pub gpu_time_wasted_s: f64,
    /// Seconds compute tasks of microbatches waited for a busy GPU, and
    /// activations and gradients for a busy link before their own
    /// transfer, in all: where a policy's microbatches queue.
    pub gpu_queue_s: f64,
    pub link_queue_s: f64,
    /// Those waits per microbatch trained (s).
    pub gpu_queue_per_microbatch_s: f64,
    pub link_queue_per_microbatch_s: f64,
    pub lost_microbatches: u64,
    pub dropped_with_holder: u64,
    /// Microbatches a relay stage's coordinator dropped (SWARM aggregates
    /// what it has instead of recomputing a lost contribution): not
    /// trained, not lost.
    pub dropped_contributions: u64,
    pub recomputed_stages: u64,
    /// Stage all-reduces that went on without a member lost in their
    /// all-gather half, and those that a loss aborted (redone once its
    /// contributions are recomputed).
    pub allreduce_bypassed: u64,
    pub allreduce_aborted: u64,
    pub restarts: u64,
    pub reroutes: u64,
    pub crashes: u64,
    pub leaves: u64,
    pub joins: u64,
    /// Mean over iterations of the microbatches routed at once.
    pub flow_value: f64,
    /// Mean over iterations of the largest flow cost of the paths used (s).
    pub critical_path_s: f64,
    /// The same for the central min-cost max-flow plan of the membership.
    pub optimal_flow_value: f64,
    pub optimal_critical_path_s: f64,
    /// Lower bound on the iteration time of the founding membership (s; see
    /// [`bound`]).
    pub bound_initial_s: f64,
    /// Sum over the iterations of the bound of the membership each started with.
    pub bound_training_time_s: f64,
    /// `training_time_s / bound_training_time_s` (1 = no routing can do better).
    pub time_over_bound: f64,
    /// (time s, bound s, microbatches of the iteration) at each iteration
    /// start where the bound changed.
    pub bound_series: Vec<(f64, f64, u32)>,
    /// Microbatches per aggregation at the start (holders x microbatches per holder).
    pub global_batch: u32,
    /// Sequences per microbatch, microbatches per holder per iteration,
    /// and at most in flight per holder.
    pub sequences: usize,
    pub microbatches_per_holder: u32,
    pub max_in_flight: u32,
    pub events: u64,
    pub empty_stages: Vec<(f64, Stage)>,
    /// Why training did not finish, when a stage was left empty.
    pub paused: Option<String>,
    pub stalls: Vec<(f64, u32, Stage)>,
    pub violations: Vec<String>,
    /// Live members a coordinator removed from its group (false suspicions).
    pub false_suspicions: u64,
    /// (time s, microbatches/hour over the last iteration).
    pub series: Vec<(f64, f64)>,
    /// (time s, "crash" | "leave" | "join").
    pub churn: Vec<(f64, String)>,
    pub iteration_times_s: Vec<f64>,
    /// Messages sent, by kind.
    pub messages: BTreeMap<String, u64>,
    /// Forwards sent to a relay, and those of them to a relay in the
    /// region of the microbatch's data holder: how much a policy keeps a
    /// trainer's work near it (SWARM's trainer-owned heaps do).
    pub relay_forwards: u64,
    pub relay_forwards_in_holder_region: u64,
}

#[derive(Debug)]
enum Ev {
    Deliver {
        to: NodeId,
        from: NodeId,
        msg: Msg,
    },
    /// A SWARM hop reached the data holder (the trainer), which sends it on.
    Relay {
        via: NodeId,
        to: NodeId,
        from: NodeId,
        msg: Msg,
    },
    Timer {
        node: NodeId,
        at: Time,
    },
    GpuDone {
        node: NodeId,
        gen: u64,
    },
    /// An aggregate task ends, unless its ring (`None`: not followed) moved
    /// or failed it since.
    AggDone {
        node: NodeId,
        task: TaskId,
        ring: Option<rings::RingKey>,
    },
    /// An aggregate task's ring aborted (a member lost in its
    /// reduce-scatter half): the runtime's `Input::TaskFailed`.
    AggFailed {
        node: NodeId,
        task: TaskId,
    },
    LinkDone {
        key: (NodeId, NodeId),
        gen: u64,
    },
    /// `to`'s connection with crashed `peer` broke (the runtime's
    /// `Input::PeerLost`).
    PeerLost {
        to: NodeId,
        peer: NodeId,
    },
    Depart,
    Join,
}

struct Xfer {
    /// The message's sender, as its receiver sees it.
    from: NodeId,
    to: NodeId,
    /// The link's source: `from`, or the data holder relaying the message.
    src: NodeId,
    remaining: f64,
    /// When it was handed to the link (its wait: until it was done, less
    /// its own transfer).
    sent: Time,
    msg: Msg,
    /// The message goes on from `to` to this node (SWARM's trainer hop).
    then: Option<NodeId>,
}

struct Link {
    /// Transfers in the order they were sent; the first is on the wire.
    active: VecDeque<Xfer>,
    last: Time,
    gen: u64,
}

struct SimNode {
    node: Node,
    region: usize,
    flops: f64,
    /// Seconds its GPU computed (debug output).
    busy_s: f64,
    queue_s: f64,
    tasks: u64,
    /// Compute tasks waiting for the GPU, run in the order given (the
    /// runtime's work queue hands its trainer work in order), each with
    /// the time it was queued.
    gpu_queue: VecDeque<(Task, Time)>,
    running: Option<(Task, Time)>,
    gpu_gen: u64,
    timer_at: Option<Time>,
}

/// The simulator.
pub struct Sim {
    cfg: SimConfig,
    pcfg: Arc<Config>,
    now: Time,
    seq: u64,
    queue: EventQueue<Ev>,
    /// Reusable buffer for the actions of one node call.
    acts: Vec<Action>,
    nodes: Vec<SimNode>,
    /// Whether each node is alive (index = node id), apart from `nodes`:
    /// checked for every delivery and connection, and a `SimNode` is
    /// large, so a dense vector saves a cache miss per check.
    alive: Vec<bool>,
    /// Which nodes have a connection with which (for `Input::PeerLost`).
    conns: connections::Connections,
    /// Region of each node (index = node id).
    region_of: Vec<u32>,
    /// (latency, bandwidth) of each region pair, row-major.
    link_table: Vec<(f64, f64)>,
    links: HashMap<(NodeId, NodeId), Link, FastHash>,
    rng: Rng,
    rep: SimReport,
    ledger: HashMap<(NodeId, TaskId), f64, FastHash>,
    claimed: HashMap<(NodeId, MbId), Vec<TaskId>, FastHash>,
    fwd_count: HashMap<(MbId, Stage), u32, FastHash>,
    committed: BTreeMap<(u32, Stage), Committed>,
    dropped: BTreeMap<(u32, Stage), Vec<MbId>>,
    versions: BTreeMap<(Stage, u32), BTreeSet<u64>>,
    crit: BTreeMap<u32, f64>,
    first_start: Option<Time>,
    last_final: Option<Time>,
    finalized: u32,
    stop: bool,
    useful_tasks: u64,
    empty_now: BTreeSet<Stage>,
    router: Box<dyn CentralRouter>,
    opt_samples: Vec<(f64, f64)>,
    flow_samples: Vec<f64>,
    initial: u32,
    holder_share: f64,
    joining_relay: bool,
    debug: bool,
    trace: bool,
    /// Messages sent, by kind (name, count).
    msg_counts: HashMap<std::mem::Discriminant<Msg>, (&'static str, u64), FastHash>,
    population_version: u64,
    /// All-reduce time per (stage, members), for a population version.
    agg_cache: BTreeMap<(Stage, u32, u64), (u64, f64)>,
    /// The all-reduces running, member by member (what a loss does to them).
    rings: rings::Rings,
    /// The bound of the membership of `population_version` (when computed).
    bound_cache: Option<BoundCache>,
    /// The bound the running iteration started with, and the population
    /// version then.
    iter_bound: Option<(f64, u64)>,
}

/// The last iteration bound: of (population version, the holders that
/// train), the bound and the iteration's microbatches.
type BoundCache = (u64, Option<Arc<Vec<NodeId>>>, Option<(f64, u32)>);

impl Sim {
    pub fn new(cfg: SimConfig) -> Sim {
        let m = &cfg.model;
        let mut pc = match &cfg.protocol {
            Some(p) => Config {
                policy: cfg.policy,
                relay_stages: m.relay_stages,
                activation_bytes: m.activation_bytes(),
                ..(**p).clone()
            },
            None => {
                let mut pc = Config::new(cfg.policy, m.relay_stages, m.activation_bytes());
                pc.start_delay = 20 * SEC;
                // The simulated trainers can recompute a forward (as the
                // runtime's can): every policy whose relays keep
                // activations uses it when a relay's memory is full.
                pc.recompute = cfg.policy.keeps_activations();
                pc
            }
        };
        pc.mb_per_iter = cfg.mb_per_iter;
        pc.max_in_flight = cfg.max_in_flight;
        pc.stage_state_bytes = (0..=m.relay_stages)
            .map(|s| m.stage_state_bytes(s))
            .collect();
        let initial = cfg.holders + cfg.relays;
        let sc = &cfg.scenario;
        let mut link_table = Vec::new();
        for a in 0..sc.regions.len() {
            for b in 0..sc.regions.len() {
                let bw = sc.bandwidth[a][b].min(sc.nic_bandwidth);
                link_table.push((sc.latency[a][b], bw));
            }
        }
        let mut sim = Sim {
            pcfg: Arc::new(pc),
            now: 0,
            seq: 0,
            queue: EventQueue::new(),
            acts: Vec::new(),
            nodes: Vec::new(),
            conns: Default::default(),
            region_of: Vec::new(),
            alive: Vec::new(),
            link_table,
            links: HashMap::default(),
            rng: Rng::derive(cfg.seed, 0x5151),
            rep: SimReport::default(),
            ledger: HashMap::default(),
            claimed: HashMap::default(),
            fwd_count: HashMap::default(),
            committed: BTreeMap::new(),
            dropped: BTreeMap::new(),
            versions: BTreeMap::new(),
            crit: BTreeMap::new(),
            first_start: None,
            last_final: None,
            finalized: 0,
            stop: false,
            useful_tasks: 0,
            empty_now: BTreeSet::new(),
            router: Box::new(FlowRouter),
            opt_samples: Vec::new(),
            flow_samples: Vec::new(),
            initial,
            holder_share: cfg.holders as f64 / initial.max(1) as f64,
            joining_relay: false,
            msg_counts: HashMap::default(),
            population_version: 0,
            agg_cache: BTreeMap::new(),
            rings: rings::Rings::default(),
            bound_cache: None,
            iter_bound: None,
            debug: std::env::var_os("GWTF_SIM_DEBUG").is_some(),
            trace: std::env::var_os("GWTF_SIM_TRACE").is_some(),
            cfg,
        };
        sim.rep.policy = sim.cfg.policy.name().into();
        sim.rep.global_batch = sim.cfg.holders * sim.cfg.mb_per_iter;
        sim.rep.sequences = sim.cfg.model.sequences;
        sim.rep.microbatches_per_holder = sim.cfg.mb_per_iter;
        sim.rep.max_in_flight = sim.cfg.max_in_flight;
        sim.rep.scenario = sim.cfg.scenario.name.clone();
        sim.rep.model = sim.cfg.model.name.clone();
        sim.rep.seed = sim.cfg.seed;
        sim.rep.initial_nodes = initial;
        sim.rep.churn_per_hour = sim.cfg.churn_per_hour;
        sim.rep.iterations_requested = sim.cfg.iterations;
        sim
    }

    /// The links of the world, for [`allreduce`] and [`bound`].
    fn with_links<R>(&self, f: impl FnOnce(&allreduce::Links) -> R) -> R {
        links_of(&self.cfg, &self.link_table, f)
    }

    /// Replaces the centralized router (the central-mcmf policy and the reference).
    pub fn set_router(&mut self, r: Box<dyn CentralRouter>) {
        self.router = r;
    }

    fn push(&mut self, t: Time, ev: Ev) {
        self.seq += 1;
        self.queue.push(t, self.seq, ev);
    }

    fn new_node(&mut self, stage: Stage, region: usize) -> NodeId {
        let id = self.nodes.len() as NodeId;
        let m = &self.cfg.model;
        let factor = self.cfg.scenario.compute_factor[region];
        let jitter = 0.8 + 0.4 * self.rng.next_f64();
        let flops = self.cfg.base_tflops * 1e12 / factor * jitter;
        let mem =
            self.cfg.gpu_mem_gib[self.rng.below(self.cfg.gpu_mem_gib.len() as u64) as usize] << 30;
        let (compute_s, cap) = if stage == 0 && !self.joining_relay {
            (
                (m.loss_flops() + 3.0 * m.embed_flops()) / flops,
                self.cfg.max_in_flight,
            )
        } else {
            // A joining relay does not know its stage yet: mean of the stages.
            let f = if stage == 0 {
                m.mean_stage_fwd_flops()
            } else {
                m.stage_fwd_flops(stage)
            };
            (3.0 * f / flops, m.relay_capacity(stage.max(1), mem))
        };
        let node = Node::new(self.pcfg.clone(), id, stage, compute_s, cap, self.cfg.seed);
        if self.trace {
            eprintln!(
                "T {:.2} node {id} st {stage} region {region} tflops {:.1} cap {cap}",
                to_secs(self.now),
                flops / 1e12
            );
        }
        self.region_of.push(region as u32);
        self.alive.push(true);
        self.nodes.push(SimNode {
            node,
            region,
            flops,
            gpu_queue: VecDeque::new(),
            running: None,
            gpu_gen: 0,
            busy_s: 0.0,
            queue_s: 0.0,
            tasks: 0,
            timer_at: None,
        });
        self.conns.add_node(id);
        id
    }

    /// A uniformly random sample of up to `k` live, active nodes of `stage`.
    fn sample(&mut self, stage: Stage, k: usize, exclude: NodeId) -> Vec<NodeId> {
        let mut all: Vec<NodeId> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(i, n)| {
                self.alive[*i]
                    && n.node.is_active()
                    && n.node.stage() == stage
                    && *i as NodeId != exclude
            })
            .map(|(i, _)| i as NodeId)
            .collect();
        // Partial Fisher-Yates.
        let k = k.min(all.len());
        for i in 0..k {
            let j = i + self.rng.below((all.len() - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }

    fn members_of(&self, stage: Stage) -> Vec<NodeId> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(i, n)| self.alive[*i] && n.node.is_active() && n.node.stage() == stage)
            .map(|(i, _)| i as NodeId)
            .collect()
    }

    /// The founding members a run of `cfg` starts with, as it draws them
    /// (region, GPU speed, capacity): what a run of real processes must
    /// start with to be compared with it (`gwtf bench testbed`).
    pub fn founders(cfg: &SimConfig) -> Vec<Founder> {
        let mut sim = Sim::new(cfg.clone());
        sim.found()
            .into_iter()
            .map(|(id, stage)| {
                let n = &sim.nodes[id as usize];
                Founder {
                    id,
                    stage,
                    region: n.region,
                    flops: n.flops,
                    capacity: n.node.capacity(),
                }
            })
            .collect()
    }

    /// Founding population: holders and relays spread over the regions,
    /// relays round-robin over the stages.
    fn found(&mut self) -> Vec<(NodeId, Stage)> {
        let s = self.cfg.model.relay_stages;
        let r = self.cfg.scenario.regions.len();
        let mut ids: Vec<(NodeId, Stage)> = Vec::new();
        for i in 0..self.cfg.holders {
            let id = self.new_node(0, i as usize % r);
            ids.push((id, 0));
        }
        for j in 0..self.cfg.relays {
            let stage = 1 + ((j as usize / r) % s as usize) as Stage;
            let stage = if self.cfg.relays as usize >= r * s as usize {
                stage
            } else {
                1 + (j % s as u32) as Stage
            };
            let id = self.new_node(stage, j as usize % r);
            ids.push((id, stage));
        }
        ids
    }

    /// Runs to completion and returns the report.
    pub fn run(mut self) -> SimReport {
        let s = self.cfg.model.relay_stages;
        let ids = self.found();
        let by_stage: BTreeMap<Stage, Vec<NodeId>> =
            ids.iter().fold(BTreeMap::new(), |mut m, (id, st)| {
                m.entry(*st).or_insert_with(Vec::new).push(*id);
                m
            });
        for (id, st) in ids.clone() {
            let prev = if st == 0 { s } else { st - 1 };
            let next = if st == s { 0 } else { st + 1 };
            let mut peers: Vec<(NodeId, Stage)> = by_stage
                .get(&st)
                .map(|v| v.iter().map(|x| (*x, st)).collect())
                .unwrap_or_default();
            for other in [prev, next] {
                let pool = by_stage.get(&other).cloned().unwrap_or_default();
                let mut pool = pool;
                let k = self.cfg.view_size.min(pool.len());
                for i in 0..k {
                    let j = i + self.rng.below((pool.len() - i) as u64) as usize;
                    pool.swap(i, j);
                }
                pool.truncate(k);
                peers.extend(pool.into_iter().map(|x| (x, other)));
            }
            self.input(id, Input::Start { peers });
        }
        if self.cfg.churn_per_hour > 0.0 {
            let t = self.next_churn_delay();
            self.push(t, Ev::Depart);
            let t = self.next_churn_delay();
            self.push(t, Ev::Join);
        }
        if self.cfg.policy == Policy::CentralMcmf {
            self.replan();
        }
        let limit = if self.cfg.max_sim_time_s > 0.0 {
            secs(self.cfg.max_sim_time_s)
        } else {
            secs(3600.0 + 900.0 * self.cfg.iterations as f64)
        };
        while let Some((t, ev)) = self.queue.pop() {
            if t > limit || self.stop {
                break;
            }
            self.now = t;
            self.rep.events += 1;
            self.dispatch(ev);
        }
        self.finish()
    }

    fn next_churn_delay(&mut self) -> Time {
        let rate_per_s = self.cfg.churn_per_hour * self.initial as f64 / 3600.0;
        self.now + secs(self.rng.exp(1.0 / rate_per_s))
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::Deliver { to, from, msg } => {
                if self.alive[to as usize] {
                    self.input(to, Input::Message { from, msg });
                }
            }
            Ev::Relay { via, to, from, msg } => {
                // A holder that is gone takes the microbatch with it.
                if self.alive[via as usize] {
                    self.transfer(via, to, from, msg, None);
                }
            }
            Ev::Timer { node, at } => {
                let n = &mut self.nodes[node as usize];
                if !self.alive[node as usize] || n.timer_at != Some(at) {
                    return;
                }
                n.timer_at = None;
                let mut acts = std::mem::take(&mut self.acts);
                n.node.on_timeout_into(self.now, &mut acts);
                self.apply(node, acts);
            }
            Ev::GpuDone { node, gen } => {
                let n = &mut self.nodes[node as usize];
                if !self.alive[node as usize] || n.gpu_gen != gen {
                    return;
                }
                let (task, start) = n.running.take().unwrap();
                let dur = to_secs(self.now - start);
                n.busy_s += dur;
                self.rep.gpu_time_total_s += dur;
                self.ledger.insert((node, task.id), dur);
                if matches!(task.kind, TaskKind::Embed | TaskKind::Forward) {
                    if let Some(mb) = task.mb {
                        let c = self.fwd_count.entry((mb, task.stage)).or_insert(0);
                        *c += 1;
                        if *c > 1 {
                            self.rep.recomputed_stages += 1;
                        }
                    }
                }
                self.gpu_next(node);
                self.input(node, Input::TaskDone { id: task.id });
            }
            Ev::AggDone { node, task, ring } => {
                let current = ring.is_none_or(|k| self.rings.ends_at(&k, node, task, self.now));
                if self.alive[node as usize] && current {
                    self.input(node, Input::TaskDone { id: task });
                }
            }
            Ev::AggFailed { node, task } => {
                if self.alive[node as usize] {
                    self.input(node, Input::TaskFailed { id: task });
                }
            }
            Ev::LinkDone { key, gen } => self.link_done(key, gen),
            Ev::PeerLost { to, peer } => {
                if self.alive[to as usize] {
                    self.input(to, Input::PeerLost { peer });
                }
            }
            Ev::Depart => {
                self.depart();
                let t = self.next_churn_delay();
                self.push(t, Ev::Depart);
            }
            Ev::Join => {
                self.join();
                let t = self.next_churn_delay();
                self.push(t, Ev::Join);
            }
        }
    }

    fn input(&mut self, node: NodeId, input: Input) {
        let mut acts = std::mem::take(&mut self.acts);
        self.nodes[node as usize]
            .node
            .handle_into(self.now, input, &mut acts);
        self.apply(node, acts);
    }

    /// Carries out a node's actions; `acts` is the reusable action buffer
    /// (taken from `self.acts`, given back empty; a nested call while it is
    /// out works on a fresh one).
    fn apply(&mut self, node: NodeId, mut acts: Vec<Action>) {
        for a in acts.drain(..) {
            match a {
                Action::Send { to, msg } => self.send(node, to, msg),
                Action::Run(task) => self.run_task(node, task),
                Action::Event(e) => self.on_event(node, e),
            }
        }
        if acts.capacity() > self.acts.capacity() {
            self.acts = acts;
        }
        if !self.alive[node as usize] {
            return;
        }
        let n = &mut self.nodes[node as usize];
        if let Some(t) = n.node.timeout() {
            let t = t.max(self.now);
            if n.timer_at.is_none_or(|old| t < old) {
                n.timer_at = Some(t);
                self.push(t, Ev::Timer { node, at: t });
            }
        }
    }

    /// (latency s, bandwidth bytes/s) from `a` to `b`: two small arrays,
    /// no visit to the (large) node states.
    fn link_params(&self, a: NodeId, b: NodeId) -> (f64, f64) {
        let r = self.cfg.scenario.regions.len();
        let (ra, rb) = (
            self.region_of[a as usize] as usize,
            self.region_of[b as usize] as usize,
        );
        self.link_table[ra * r + rb]
    }

    fn send(&mut self, from: NodeId, to: NodeId, msg: Msg) {
        if to as usize >= self.nodes.len() {
            return;
        }
        self.msg_counts
            .entry(std::mem::discriminant(&msg))
            .or_insert((msg.name(), 0))
            .1 += 1;
        if let Msg::Forward { mb, .. } = &msg {
            if to != mb.holder && (mb.holder as usize) < self.nodes.len() {
                self.rep.relay_forwards += 1;
                if self.region_of[to as usize] == self.region_of[mb.holder as usize] {
                    self.rep.relay_forwards_in_holder_region += 1;
                }
            }
        }
        if !msg.is_bulk() {
            self.connect(from, to);
            let bytes = msg.wire_bytes(&self.pcfg) as f64;
            let (lat, bw) = self.link_params(from, to);
            let t = self.now + secs(lat + bytes / bw);
            self.push(t, Ev::Deliver { to, from, msg });
            return;
        }
        match self.trainer_hop(from, to, &msg) {
            Some(h) => {
                // The call is the trainer's, over its own connection to the
                // callee; the sender plays the caller here, so it hears at
                // once when that connection breaks (not after the call's
                // fixed timeout).
                self.connect(from, to);
                self.transfer(from, h, from, msg, Some(to))
            }
            None => self.transfer(from, to, from, msg, None),
        }
    }

    /// SWARM's data path: the trainer (the microbatch's data holder) calls
    /// each stage and gets its output back, so an activation or gradient
    /// between two relays goes through the holder (two link transfers;
    /// swarm/pipeline/src/moe/client/balanced_expert.py in
    /// yandex-research/swarm). The holder to relay through, if any.
    fn trainer_hop(&self, from: NodeId, to: NodeId, msg: &Msg) -> Option<NodeId> {
        if self.cfg.policy != Policy::Swarm {
            return None;
        }
        let mb = match msg {
            Msg::Forward { mb, .. } | Msg::Backward { mb, .. } => mb,
            _ => return None,
        };
        let h = mb.holder;
        (h != from && h != to && (h as usize) < self.nodes.len()).then_some(h)
    }

    /// `a` and `b` have a connection (as the runtime's: opened by the first
    /// message either way, kept until one of them is gone).
    /// A message to a node that is gone opens no connection: the attempt
    /// fails (`PeerLost`, as the runtime's failed connect) one round trip later.
    fn connect(&mut self, a: NodeId, b: NodeId) {
        if a == b {
            return;
        }
        if !self.alive[b as usize] {
            if self.alive[a as usize] {
                let (lat, _) = self.link_params(a, b);
                let t = self.now + secs(2.0 * lat).max(1);
                self.push(t, Ev::PeerLost { to: a, peer: b });
            }
            return;
        }
        self.conns.note(a, b);
    }

    /// A bulk transfer on link `src` -> `to` of a message sent by `from`,
    /// going on to `then` once it arrived.
    fn transfer(&mut self, src: NodeId, to: NodeId, from: NodeId, msg: Msg, then: Option<NodeId>) {
        self.connect(src, to);
        let bytes = msg.wire_bytes(&self.pcfg) as f64;
        let (_, bw) = self.link_params(src, to);
        let key = (src, to);
        self.link_advance(key, bw);
        let l = self.links.entry(key).or_insert(Link {
            active: VecDeque::new(),
            last: self.now,
            gen: 0,
        });
        l.active.push_back(Xfer {
            from,
            to,
            src,
            remaining: bytes,
            sent: self.now,
            msg,
            then,
        });
        self.link_schedule(key, bw);
    }

    fn link_advance(&mut self, key: (NodeId, NodeId), bw: f64) {
        let now = self.now;
        let Some(l) = self.links.get_mut(&key) else {
            return;
        };
        // FIFO: only the head of the queue is on the wire.
        if let Some(head) = l.active.front_mut() {
            head.remaining -= bw * to_secs(now - l.last);
        }
        l.last = now;
        let alive = &self.alive;
        l.active
            .retain(|x| alive[x.src as usize] && alive[x.to as usize]);
    }

    fn link_schedule(&mut self, key: (NodeId, NodeId), bw: f64) {
        let now = self.now;
        let Some(l) = self.links.get_mut(&key) else {
            return;
        };
        l.gen += 1;
        if let Some(head) = l.active.front() {
            let t = now + secs(head.remaining.max(0.0) / bw).max(1);
            let gen = l.gen;
            self.push(t, Ev::LinkDone { key, gen });
        }
    }

    fn link_done(&mut self, key: (NodeId, NodeId), gen: u64) {
        if self.links.get(&key).is_none_or(|l| l.gen != gen) {
            return;
        }
        let (lat, bw) = self.link_params(key.0, key.1);
        self.link_advance(key, bw);
        let l = self.links.get_mut(&key).unwrap();
        let tol = bw * 2e-6 + 1.0;
        let head_done = l.active.front().is_some_and(|x| x.remaining <= tol);
        if let Some(x) = head_done.then(|| l.active.pop_front()).flatten() {
            if matches!(x.msg, Msg::Forward { .. } | Msg::Backward { .. }) {
                let own = x.msg.wire_bytes(&self.pcfg) as f64 / bw;
                self.rep.link_queue_s += (to_secs(self.now - x.sent) - own).max(0.0);
            }
            let t = self.now + secs(lat);
            let ev = match x.then {
                Some(next) => Ev::Relay {
                    via: x.to,
                    to: next,
                    from: x.from,
                    msg: x.msg,
                },
                None => Ev::Deliver {
                    to: x.to,
                    from: x.from,
                    msg: x.msg,
                },
            };
            self.push(t, ev);
        }
        self.link_schedule(key, bw);
    }

    fn task_time(&mut self, node: NodeId, t: &Task) -> f64 {
        let m = &self.cfg.model;
        let f = self.nodes[node as usize].flops;
        match t.kind {
            TaskKind::Embed => m.embed_flops() / f,
            TaskKind::EmbedBackward => 2.0 * m.embed_flops() / f,
            TaskKind::Loss => m.loss_flops() / f,
            TaskKind::Forward => m.stage_fwd_flops(t.stage) / f,
            // SWARM's stateless backward runs the forward again first, and
            // so does a backward whose forward kept only its input.
            TaskKind::Backward if !self.cfg.policy.keeps_activations() || t.recompute => {
                3.0 * m.stage_fwd_flops(t.stage) / f
            }
            TaskKind::Backward => 2.0 * m.stage_fwd_flops(t.stage) / f,
            TaskKind::Aggregate { members } => self.agg_time(node, t, members),
        }
    }

    /// The stage's all-reduce that `node`'s aggregate task `task` runs: the
    /// butterfly of its commit's members, or the hierarchy (or the ring)
    /// in the commit's order for a large group (what the runtime's
    /// all-reduce is given), over the actual pairs' links; cached
    /// per commit (every member runs the same). A task without a commit
    /// (none is known) falls back to the stage's `members` live members in
    /// id order.
    fn agg_time(&mut self, node: NodeId, task: &Task, members: u32) -> f64 {
        let stage = task.stage;
        let plan = self.nodes[node as usize].node.aggregate_plan(task.id);
        let key = plan
            .as_ref()
            .map_or((stage, u32::MAX, 0), |p| (stage, p.iter, p.epoch));
        if let Some(&(v, t)) = self.agg_cache.get(&key) {
            if v == self.population_version || plan.is_some() {
                return t;
            }
        }
        let ids: Vec<NodeId> = match &plan {
            Some(p) => p.members.to_vec(),
            None => self
                .members_of(stage)
                .into_iter()
                .take(members as usize)
                .collect(),
        };
        let regions: Vec<usize> = ids.iter().map(|&i| self.nodes[i as usize].region).collect();
        let params = self.cfg.model.stage_params(stage);
        let t = self.with_links(|l| allreduce::allreduce_secs(&regions, params, l));
        if self.agg_cache.len() > 4096 {
            self.agg_cache.clear();
        }
        self.agg_cache.insert(key, (self.population_version, t));
        t
    }

    /// The iteration bound of the current membership (`None` while a stage
    /// is empty), recomputed when the membership changed, with the holders
    /// that train the iteration (`train`, of those alive; `None`: all; a
    /// holder that joined during the iteration before only takes part in
    /// the holders' all-reduce). With the iteration's microbatches
    /// (holders that train x microbatches per holder).
    fn current_bound(&mut self, train: Option<Arc<Vec<NodeId>>>) -> Option<(f64, u32)> {
        if let Some((v, t, b)) = &self.bound_cache {
            if *v == self.population_version && *t == train {
                return *b;
            }
        }
        let member = |i: NodeId| bound::Member {
            region: self.nodes[i as usize].region,
            flops: self.nodes[i as usize].flops,
            capacity: self.nodes[i as usize].node.capacity(),
        };
        let group = self.members_of(0);
        let trains = |h: &NodeId| train.as_ref().is_none_or(|t| t.contains(h));
        let holders: Vec<bound::Member> = group
            .iter()
            .filter(|h| trains(h))
            .map(|&h| member(h))
            .collect();
        let holder_group: Vec<bound::Member> = group.into_iter().map(member).collect();
        let relays: Vec<Vec<bound::Member>> = (1..=self.cfg.model.relay_stages)
            .map(|k| self.members_of(k).into_iter().map(member).collect())
            .collect();
        let b = self.with_links(|links| {
            bound::iteration_bound(&bound::World {
                model: &self.cfg.model,
                holders: &holders,
                holder_group: &holder_group,
                relays: &relays,
                mb_per_holder: self.cfg.mb_per_iter,
                in_flight: self.cfg.max_in_flight,
                links,
            })
        });
        let mbs = holders.len() as u32 * self.cfg.mb_per_iter;
        let b = b.map(|b| (b.secs, mbs));
        self.bound_cache = Some((self.population_version, train, b));
        b
    }

    /// An iteration starts now, trained by `train` (`None`: every holder):
    /// note the bound it is held to.
    fn start_bound(&mut self, train: Option<Arc<Vec<NodeId>>>) {
        let Some((b, mbs)) = self.current_bound(train) else {
            self.iter_bound = None;
            return;
        };
        self.iter_bound = Some((b, self.population_version));
        if self.rep.bound_initial_s == 0.0 {
            self.rep.bound_initial_s = b;
        }
        if self
            .rep
            .bound_series
            .last()
            .is_none_or(|l| (l.1, l.2) != (b, mbs))
        {
            self.rep.bound_series.push((to_secs(self.now), b, mbs));
        }
    }

    /// An iteration of `dt` seconds ended: count its bound, and check that it
    /// did not beat it when the membership stayed the same throughout.
    fn end_bound(&mut self, iter: u32, dt: f64) {
        let Some((b, version)) = self.iter_bound.take() else {
            return;
        };
        self.rep.bound_training_time_s += b;
        // Tolerance: task times are rounded to the microsecond.
        if version == self.population_version && dt < b * (1.0 - 1e-6) - 1e-3 {
            self.rep.violations.push(format!(
                "iteration {iter} took {dt:.3} s, below its lower bound {b:.3} s"
            ));
        }
    }

    fn run_task(&mut self, node: NodeId, task: Task) {
        if !task.kind.is_compute() {
            let d = self.task_time(node, &task);
            if self.trace {
                eprintln!(
                    "T {:.2} agg {node} st {} {:.3}",
                    to_secs(self.now),
                    task.stage,
                    d
                );
            }
            if self.debug && d > 100.0 {
                eprintln!(
                    "t={:.1} node {node} aggregate {:?} lasts {d:.0} s",
                    to_secs(self.now),
                    task
                );
            }
            self.start_aggregate(node, &task, d);
            return;
        }
        let n = &mut self.nodes[node as usize];
        n.gpu_queue.push_back((task, self.now));
        if n.running.is_none() {
            self.gpu_next(node);
        }
    }

    /// `node` starts its part of its commit's all-reduce, `d` s long unless
    /// a member is lost on the way ([`rings`]).
    fn start_aggregate(&mut self, node: NodeId, task: &Task, d: f64) {
        let plan = self.nodes[node as usize].node.aggregate_plan(task.id);
        let Some(plan) = plan.filter(|p| p.members.len() >= 2) else {
            let t = self.now + secs(d);
            let (task, ring) = (task.id, None);
            self.push(t, Ev::AggDone { node, task, ring });
            return;
        };
        let n = plan.members.len();
        let key = (task.stage, plan.iter, plan.epoch);
        let params = self.cfg.model.stage_params(task.stage);
        // Worked out once per commit (its first member to start): every
        // member of a large stage's commit runs the same hierarchy.
        let (nodes, cfg, table) = (&self.nodes, &self.cfg, &self.link_table);
        let members = &plan.members;
        let shape = || {
            if allreduce::is_butterfly(n) {
                rings::Shape::Butterfly {
                    part: allreduce::part_bytes(params, n),
                }
            } else if cfg.ring_beyond_butterfly {
                rings::Shape::Ring {
                    step: d / (2 * (n - 1)) as f64,
                    chunk: allreduce::chunk_bytes(params, n),
                }
            } else {
                let regions: Vec<usize> = (members.iter())
                    .map(|&m| nodes[m as usize].region)
                    .collect();
                let h = links_of(cfg, table, |l| {
                    allreduce::hierarchy_secs(&regions, params, l)
                });
                rings::Shape::Hierarchy { groups: h.groups }
            }
        };
        let end = self
            .rings
            .start(key, members, shape, node, task.id, self.now, d);
        let (task, ring) = (task.id, Some(key));
        match end {
            Some(t) => self.push(t, Ev::AggDone { node, task, ring }),
            None => {
                let t = self.now + 1;
                self.push(t, Ev::AggFailed { node, task });
            }
        }
        // A member gone before it started (the commit reached it too late):
        // the ring cannot pass its reduce-scatter (the runtime's member
        // learns of it at its start).
        let gone = plan
            .members
            .iter()
            .copied()
            .find(|&m| !self.alive[m as usize] && !self.rings.started(&key, m));
        if let Some(m) = gone {
            self.ring_member_lost(m);
        }
    }

    /// `v` is gone: the all-reduces it is part of go on without it (later,
    /// for a ring's bypass), or fail, as the runtime's do.
    fn ring_member_lost(&mut self, v: NodeId) {
        struct SimWire<'a>(&'a Sim);
        impl rings::Wire for SimWire<'_> {
            fn latency(&self, a: NodeId, b: NodeId) -> f64 {
                self.0.link_params(a, b).0
            }
            fn send_secs(&self, a: NodeId, b: NodeId, bytes: f64, streams: f64) -> f64 {
                let (lat, bw) = self.0.link_params(a, b);
                lat + bytes / bw.min(self.0.cfg.scenario.nic_bandwidth / streams.max(1.0))
            }
        }
        let mut rings = std::mem::take(&mut self.rings);
        let alive = |m: NodeId| self.alive[m as usize];
        let changes = rings.lose(v, self.now, &alive, &SimWire(self));
        self.rings = rings;
        for c in changes {
            if self.trace {
                eprintln!("T {:.2} ring-loss {v} {c:?}", to_secs(self.now));
            }
            match c {
                rings::Change::EndsAt {
                    node,
                    task,
                    at,
                    ring,
                } => {
                    let ring = Some(ring);
                    self.push(at, Ev::AggDone { node, task, ring });
                }
                rings::Change::FailsAt { node, task, at } => {
                    self.push(at, Ev::AggFailed { node, task })
                }
            }
        }
    }

    fn gpu_next(&mut self, node: NodeId) {
        let n = &mut self.nodes[node as usize];
        let Some((task, queued)) = n.gpu_queue.pop_front() else {
            return;
        };
        if task.mb.is_some() {
            n.queue_s += to_secs(self.now - queued);
            n.tasks += 1;
            self.rep.gpu_queue_s += to_secs(self.now - queued);
        }
        n.running = Some((task, self.now));
        n.gpu_gen += 1;
        let gen = n.gpu_gen;
        let d = self.task_time(node, &task);
        if self.trace {
            eprintln!(
                "T {:.2} gpu {node} st {} {:?} {:?} {:.3}",
                to_secs(self.now),
                task.stage,
                task.kind,
                task.mb.map(|m| (m.holder, m.iter, m.idx)),
                d
            );
        }
        let t = self.now + secs(d).max(1);
        self.push(t, Ev::GpuDone { node, gen });
    }

    // ------------------------------------------------------------ churn

    fn depart(&mut self) {
        let alive: Vec<NodeId> = (0..self.alive.len())
            .filter(|&i| self.alive[i])
            .map(|i| i as NodeId)
            .collect();
        if alive.is_empty() {
            return;
        }
        let v = alive[self.rng.below(alive.len() as u64) as usize];
        let graceful = self.rng.next_f64() < self.cfg.leave_fraction;
        if graceful {
            self.rep.leaves += 1;
            self.rep.churn.push((to_secs(self.now), "leave".into()));
            self.input(v, Input::Leave);
        } else {
            self.rep.crashes += 1;
            self.rep.churn.push((to_secs(self.now), "crash".into()));
        }
        self.kill(v);
        self.check_empty();
        if self.cfg.policy == Policy::CentralMcmf {
            self.replan();
        }
    }

    fn kill(&mut self, v: NodeId) {
        self.population_version += 1;
        if self.trace {
            eprintln!(
                "T {:.2} kill {v} st {}",
                to_secs(self.now),
                self.nodes[v as usize].node.stage()
            );
        }
        self.alive[v as usize] = false;
        self.ring_member_lost(v);
        let n = &mut self.nodes[v as usize];
        if let Some((_, start)) = n.running.take() {
            // Interrupted compute is wasted.
            self.rep.gpu_time_total_s += to_secs(self.now - start);
        }
        n.gpu_queue.clear();
        n.gpu_gen += 1;
        // Its connections break: each peer it had one with gets
        // `Input::PeerLost` once the broken connection shows at its end, one
        // link latency later (the runtime turns a broken connection into
        // `PeerLost` at once).
        for c in self.conns.take(v) {
            if !self.alive[c as usize] {
                continue;
            }
            let (lat, _) = self.link_params(v, c);
            let t = self.now + secs(lat).max(1);
            self.push(t, Ev::PeerLost { to: c, peer: v });
        }
    }

    fn join(&mut self) {
        let r = self.cfg.scenario.regions.len();
        let region = self.rng.below(r as u64) as usize;
        let holder = self.rng.next_f64() < self.holder_share;
        let s = self.cfg.model.relay_stages;
        self.rep.joins += 1;
        self.rep.churn.push((to_secs(self.now), "join".into()));
        if holder {
            let id = self.new_node(0, region);
            let mut peers: Vec<(NodeId, Stage)> =
                self.members_of(0).into_iter().map(|x| (x, 0)).collect();
            let k = self.cfg.view_size;
            for st in [1, s] {
                let smp = self.sample(st, k, id);
                peers.extend(smp.into_iter().map(|x| (x, st)));
            }
            self.input(id, Input::Start { peers });
        } else {
            self.joining_relay = true;
            let id = self.new_node(0, region);
            self.joining_relay = false;
            let mut peers = Vec::new();
            let k = self.cfg.view_size;
            for st in 0..=s {
                let smp = self.sample(st, k, id);
                peers.extend(smp.into_iter().map(|x| (x, st)));
            }
            self.input(id, Input::Join { peers });
        }
    }

    fn check_empty(&mut self) {
        let s = self.cfg.model.relay_stages;
        let mut counts = vec![0u32; s as usize + 1];
        for (n, &alive) in self.nodes.iter().zip(&self.alive) {
            if alive && n.node.is_active() {
                counts[n.node.stage() as usize] += 1;
            }
        }
        for (st, &c) in counts.iter().enumerate() {
            let st = st as Stage;
            if c == 0 && !self.empty_now.contains(&st) {
                self.empty_now.insert(st);
                self.rep.empty_stages.push((to_secs(self.now), st));
            } else if c > 0 {
                self.empty_now.remove(&st);
            }
        }
    }

    // ------------------------------------------------------------ optimal / reference

    fn true_cost(&self, a: NodeId, b: NodeId) -> f64 {
        let m = &self.cfg.model;
        let c = |i: NodeId| {
            let n = &self.nodes[i as usize];
            if n.node.stage() == 0 {
                (m.loss_flops() + 3.0 * m.embed_flops()) / n.flops
            } else {
                3.0 * m.stage_fwd_flops(n.node.stage()) / n.flops
            }
        };
        let (lat, bw) = self.link_params(a, b);
        (c(a) + c(b)) / 2.0 + lat + m.activation_bytes() as f64 / bw
    }

    fn optimum(&mut self) -> RoutePlan {
        let holders: Vec<(NodeId, u32)> = self
            .members_of(0)
            .into_iter()
            .map(|h| (h, self.cfg.max_in_flight))
            .collect();
        let mut relays = Vec::new();
        for st in 1..=self.cfg.model.relay_stages {
            for r in self.members_of(st) {
                relays.push((r, st, self.nodes[r as usize].node.capacity()));
            }
        }
        let mut router = std::mem::replace(&mut self.router, Box::new(FlowRouter));
        let plan = {
            let cost = |a: NodeId, b: NodeId| self.true_cost(a, b);
            let relay_secs = |r: NodeId| {
                let n = &self.nodes[r as usize];
                3.0 * self.cfg.model.stage_fwd_flops(n.node.stage()) / n.flops
            };
            let inst = RouteInstance {
                holders,
                relays,
                stages: self.cfg.model.relay_stages,
                cost: &cost,
                relay_secs: &relay_secs,
            };
            router.route(&inst)
        };
        self.router = router;
        plan
    }

    /// Central-mcmf policy: recompute the central plan with global knowledge and
    /// hand each holder its paths.
    fn replan(&mut self) {
        let plan = self.optimum();
        for h in self.members_of(0) {
            let paths: Vec<Arc<Vec<NodeId>>> = plan
                .paths
                .get(&h)
                .map(|v| v.iter().map(|p| Arc::new(p.clone())).collect())
                .unwrap_or_default();
            self.input(h, Input::SetPlan { paths });
        }
    }

    fn path_cost(&self, path: &[NodeId]) -> f64 {
        let mut c = 0.0;
        for w in path.windows(2) {
            c += self.true_cost(w[0], w[1]);
        }
        if let (Some(&last), Some(&first)) = (path.last(), path.first()) {
            if path.len() > 1 {
                c += self.true_cost(last, first);
            }
        }
        c
    }

    // ------------------------------------------------------------ events and invariants

    fn on_event(&mut self, node: NodeId, e: Event) {
        match e {
            // Nodes of the simulator are never paused nor cut off, and
            // hold no weights digest: a fence means a false suspicion.
            Event::Fenced { reason, .. } => {
                self.rep.violations.push(format!(
                    "node {node} fenced itself ({}): a false suspicion",
                    reason.name()
                ));
            }
            Event::Active { .. } => {
                self.population_version += 1;
                if self.now > 0 {
                    self.check_empty();
                }
                if self.cfg.policy == Policy::CentralMcmf && self.now > 0 {
                    self.replan();
                }
            }
            Event::MbDone { mb, path } => {
                let c = self.path_cost(&path);
                if self.trace {
                    eprintln!(
                        "T {:.2} done {} {} {} {:.2} {:?}",
                        to_secs(self.now),
                        mb.holder,
                        mb.iter,
                        mb.idx,
                        c,
                        path
                    );
                }
                let e = self.crit.entry(mb.iter).or_insert(0.0);
                *e = e.max(c);
            }
            Event::IterStarted { .. } => {
                if self.first_start.is_none() {
                    self.first_start = Some(self.now);
                    self.start_bound(None);
                }
            }
            Event::IterFinalized {
                iter,
                holders,
                next,
            } => {
                if self.trace {
                    eprintln!("T {:.2} final {iter}", to_secs(self.now));
                }
                self.on_finalized(iter, holders, next)
            }
            Event::StageCommitted {
                stage,
                iter,
                mbs,
                dropped,
            } => {
                if self.committed.contains_key(&(iter, stage)) {
                    self.rep
                        .violations
                        .push(format!("stage {stage} committed iteration {iter} twice"));
                    return;
                }
                for (mb, member) in mbs.iter() {
                    if let Some(tasks) = self.claimed.remove(&(*member, *mb)) {
                        for t in tasks {
                            if let Some(d) = self.ledger.remove(&(*member, t)) {
                                self.rep.gpu_time_useful_s += d;
                                self.useful_tasks += 1;
                            }
                        }
                    } else {
                        self.rep.violations.push(format!(
                            "stage {stage} iteration {iter}: {mb:?} committed for node {member} which never claimed it"
                        ));
                    }
                }
                self.committed.insert((iter, stage), mbs);
                self.dropped.insert((iter, stage), dropped);
            }
            Event::Applied {
                stage,
                iter,
                version,
            } => {
                let set = self.versions.entry((stage, iter)).or_default();
                set.insert(version);
                if set.len() > 1 {
                    self.rep.violations.push(format!(
                        "stage {stage} iteration {iter}: members applied different weights versions"
                    ));
                }
            }
            Event::Claimed { mb, tasks } => {
                self.claimed.insert((node, mb), tasks);
            }
            Event::Restarted { .. } => self.rep.restarts += 1,
            Event::Rerouted { .. } => self.rep.reroutes += 1,
            Event::Stalled { iter, stage } => {
                if std::env::var_os("GWTF_SIM_DEBUG").is_some() && self.rep.stalls.len() < 3 {
                    eprintln!("t={:.1} stall iter {iter} stage {stage}", to_secs(self.now));
                    for (i, n) in self.nodes.iter().enumerate() {
                        if self.alive[i]
                            && n.node.stage() == stage
                            && n.node.coordinator() == Some(i as NodeId)
                        {
                            eprintln!("  {}", n.node.debug_coord());
                        }
                        if self.alive[i] && n.node.stage() == stage {
                            eprintln!("    {}", n.node.debug_member());
                        }
                    }
                }
                self.rep.stalls.push((to_secs(self.now), iter, stage))
            }
            // The simulator never fences a node: never raised. Its
            // all-reduce learns of deaths from its global view.
            Event::Left | Event::Stranded { .. } | Event::PeerDead { .. } => {}
            // The simulator finds empty stages from its global view.
            Event::StageEmpty { .. }
            | Event::StageResumed { .. }
            | Event::StageRestarted { .. }
            | Event::StageRestored { .. }
            | Event::StageRebuilt { .. }
            | Event::StateKept { .. } => {}
            // The simulator's nodes hold no weights (digest 0): never raised.
            Event::ReplicasDiverged { .. } => {}
            // Off in the simulator (`Config::leave_out_stragglers`).
            Event::LeftOut { .. } => {}
            // Counted where the ring aborts (`Rings::aborted`).
            Event::AggregateFailed { .. } => {}
            Event::MemberRemoved { peer } => {
                if self.alive[peer as usize] {
                    self.rep.false_suspicions += 1;
                    if self.debug {
                        eprintln!(
                            "t={:.1} coordinator {node} removed live member {peer}",
                            to_secs(self.now)
                        );
                    }
                }
            }
        }
    }

    fn on_finalized(&mut self, iter: u32, holders: Arc<Vec<NodeId>>, next: Arc<Vec<NodeId>>) {
        let s = self.cfg.model.relay_stages;
        let start = self.last_final.or(self.first_start).unwrap_or(0);
        let dt = to_secs(self.now - start);
        self.last_final = Some(self.now);
        self.rings.forget_upto(iter);
        self.rep.iteration_times_s.push(dt);
        self.end_bound(iter, dt);
        // Every microbatch of a holder that finished the iteration is in
        // every stage's aggregate exactly once.
        let mut trained = 0u64;
        // How many times each microbatch is in each stage's aggregate
        // (one pass over the commits, not one per microbatch).
        let counts: Vec<BTreeMap<MbId, usize>> = (0..=s)
            .map(|st| {
                let mut m = BTreeMap::new();
                for x in self
                    .committed
                    .get(&(iter, st))
                    .iter()
                    .flat_map(|v| v.iter())
                {
                    *m.entry(x.0).or_insert(0) += 1;
                }
                m
            })
            .collect();
        for &h in holders.iter() {
            for idx in 0..self.cfg.mb_per_iter {
                let mb = MbId {
                    holder: h,
                    iter,
                    idx,
                };
                let mut ok = true;
                for st in 0..=s {
                    let n = counts[st as usize].get(&mb).copied().unwrap_or(0);
                    if n > 1 {
                        self.rep
                            .violations
                            .push(format!("{mb:?} counted {n} times at stage {st}"));
                    }
                    if n != 1 {
                        ok = false;
                    }
                }
                let dropped_at_a_stage = (1..=s).any(|st| {
                    self.dropped
                        .get(&(iter, st))
                        .is_some_and(|v| v.contains(&mb))
                });
                if ok {
                    trained += 1;
                } else if dropped_at_a_stage && self.cfg.policy == Policy::Swarm {
                    self.rep.dropped_contributions += 1;
                } else if self.alive[h as usize] {
                    if self.debug {
                        let per: Vec<usize> = counts
                            .iter()
                            .map(|c| c.get(&mb).copied().unwrap_or(0))
                            .collect();
                        let dropped: Vec<bool> = (0..=s)
                            .map(|st| {
                                self.dropped
                                    .get(&(iter, st))
                                    .is_some_and(|v| v.contains(&mb))
                            })
                            .collect();
                        eprintln!(
                            "t={:.1} LOST {mb:?} per-stage {per:?} dropped {dropped:?}",
                            to_secs(self.now)
                        );
                    }
                    self.rep.lost_microbatches += 1;
                } else {
                    self.rep.dropped_with_holder += 1;
                }
            }
        }
        self.rep.microbatches_trained += trained;
        if dt > 0.0 {
            self.rep
                .series
                .push((to_secs(self.now), trained as f64 / dt * 3600.0));
        }
        // Weights agree inside each stage (checked on every apply), and no
        // member that was active at the previous iteration lags behind.
        for st in 0..=s {
            if !self.versions.contains_key(&(st, iter)) && !self.members_of(st).is_empty() {
                self.rep
                    .violations
                    .push(format!("stage {st}: no member applied iteration {iter}"));
            }
        }
        // Flow value and critical path of this iteration, and the optimum.
        let flow: f64 = match self.cfg.policy {
            Policy::Swarm | Policy::SwarmPlus | Policy::SwarmDeccom => {
                holders.len() as f64 * self.cfg.max_in_flight as f64
            }
            Policy::Gwtf | Policy::CentralMcmf => holders
                .iter()
                .map(|&h| {
                    let n = &self.nodes[h as usize].node;
                    let f = if self.cfg.policy == Policy::Gwtf {
                        n.flow_count()
                    } else {
                        self.cfg.max_in_flight as usize
                    };
                    let f = if f == 0 {
                        self.cfg.max_in_flight as usize
                    } else {
                        f
                    };
                    f.min(self.cfg.max_in_flight as usize) as f64
                })
                .sum(),
        };
        self.flow_samples.push(flow);
        if self.cfg.reference_optimum {
            let plan = self.optimum();
            self.opt_samples
                .push((plan.flow as f64, plan.critical_path_s));
        }
        self.finalized += 1;
        if self.finalized >= self.cfg.iterations {
            self.stop = true;
        } else {
            self.start_bound(Some(next));
        }
    }

    fn finish(mut self) -> SimReport {
        if self.debug {
            let t = to_secs(self.now).max(1e-9);
            for (i, n) in self.nodes.iter().enumerate() {
                if self.alive[i] {
                    eprintln!(
                        "LOAD node {i} stage {} region {} flops {:.3e} busy {:.1}% flows {} cap {} tasks {} wait {:.2}",
                        n.node.stage(),
                        n.region,
                        n.flops,
                        100.0 * n.busy_s / t,
                        n.node.flow_count(),
                        n.node.capacity(),
                        n.tasks,
                        n.queue_s / n.tasks.max(1) as f64
                    );
                }
            }
        }
        self.rep.messages = self
            .msg_counts
            .values()
            .map(|(k, v)| (k.to_string(), *v))
            .collect();
        let r = &mut self.rep;
        r.iterations_done = self.finalized;
        r.completed = self.finalized >= self.cfg.iterations;
        let t0 = self.first_start.unwrap_or(0);
        let t1 = self.last_final.unwrap_or(self.now);
        r.training_time_s = to_secs(t1.saturating_sub(t0));
        if r.training_time_s > 0.0 {
            r.throughput_microbatches_per_hour =
                r.microbatches_trained as f64 / r.training_time_s * 3600.0;
        }
        if r.microbatches_trained > 0 {
            let trained = r.microbatches_trained as f64;
            r.time_per_microbatch_s = r.training_time_s / trained;
            r.gpu_queue_per_microbatch_s = r.gpu_queue_s / trained;
            r.link_queue_per_microbatch_s = r.link_queue_s / trained;
        }
        let mut it = r.iteration_times_s.clone();
        it.sort_by(f64::total_cmp);
        let pct = |p: f64| -> f64 {
            if it.is_empty() {
                0.0
            } else {
                let i = ((it.len() as f64 - 1.0) * p).round() as usize;
                it[i]
            }
        };
        r.iteration_time_p50_s = pct(0.5);
        r.iteration_time_p95_s = pct(0.95);
        r.gpu_time_wasted_s = (r.gpu_time_total_s - r.gpu_time_useful_s).max(0.0);
        if r.gpu_time_total_s > 0.0 {
            r.wasted_gpu_pct = 100.0 * r.gpu_time_wasted_s / r.gpu_time_total_s;
        }
        // Exact accounting: every committed (microbatch, stage) contributed
        // exactly its forward and backward (holders: embedding, loss,
        // embedding backward) as useful compute, nothing else did.
        let expected_useful: u64 = self
            .committed
            .iter()
            .map(|((_, st), v)| v.len() as u64 * if *st == 0 { 3 } else { 2 })
            .sum();
        if expected_useful != self.useful_tasks {
            r.violations.push(format!(
                "useful compute accounting: {} tasks counted, {} expected",
                self.useful_tasks, expected_useful
            ));
        }
        let crit: Vec<f64> = self.crit.values().copied().collect();
        if !crit.is_empty() {
            r.critical_path_s = crit.iter().sum::<f64>() / crit.len() as f64;
        }
        if !self.flow_samples.is_empty() {
            r.flow_value = self.flow_samples.iter().sum::<f64>() / self.flow_samples.len() as f64;
        }
        if r.bound_training_time_s > 0.0 {
            r.time_over_bound = r.training_time_s / r.bound_training_time_s;
        }
        r.allreduce_bypassed = self.rings.bypassed;
        r.allreduce_aborted = self.rings.aborted;
        if !self.opt_samples.is_empty() {
            let n = self.opt_samples.len() as f64;
            r.optimal_flow_value = self.opt_samples.iter().map(|x| x.0).sum::<f64>() / n;
            r.optimal_critical_path_s = self.opt_samples.iter().map(|x| x.1).sum::<f64>() / n;
        }
        if !r.completed {
            let stalled: Vec<String> = self.empty_now.iter().map(|s| s.to_string()).collect();
            if stalled.is_empty() {
                r.violations.push(format!(
                    "iteration {} did not finish although every stage had a live node",
                    self.finalized
                ));
            } else {
                r.paused = Some(format!(
                    "training paused: stage(s) {} empty",
                    stalled.join(", ")
                ));
            }
        }
        self.rep
    }
}

/// The links of the world, for [`allreduce`] and [`bound`]: the
/// per-region-pair `table` of the scenario `cfg` runs.
fn links_of<R>(cfg: &SimConfig, table: &[(f64, f64)], f: impl FnOnce(&allreduce::Links) -> R) -> R {
    let r = cfg.scenario.regions.len();
    let link = move |a: usize, b: usize| table[a * r + b];
    f(&allreduce::Links {
        link: &link,
        nic: cfg.scenario.nic_bandwidth,
        ring_beyond_butterfly: cfg.ring_beyond_butterfly,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim() -> Sim {
        let mut c = SimConfig::new(
            Scenario::geo10(),
            ModelPreset::by_name("llama-124m").unwrap(),
            Policy::Gwtf,
        );
        c.holders = 1;
        c.relays = 3;
        Sim::new(c)
    }

    /// A relay's backward costs two forwards, SWARM's three: its server
    /// keeps no activations and runs the forward again inside the backward
    /// (`expert_backend.py`); so does a GWTF backward whose forward kept
    /// only its input; the holders' work is the same for all.
    #[test]
    fn swarms_stateless_backward_runs_the_forward_again() {
        let mut costs = Vec::new();
        for policy in [Policy::Gwtf, Policy::Swarm] {
            let mut c = SimConfig::new(
                Scenario::geo10(),
                ModelPreset::by_name("llama-124m").unwrap(),
                policy,
            );
            c.holders = 1;
            c.relays = 3;
            let mut s = Sim::new(c);
            let task = |kind, recompute| Task {
                id: 1,
                kind,
                stage: 1,
                mb: None,
                attempt: 0,
                recompute,
            };
            let (holder, relay) = (s.new_node(0, 0), s.new_node(1, 0));
            let fwd = s.task_time(relay, &task(TaskKind::Forward, false));
            let bwd = s.task_time(relay, &task(TaskKind::Backward, false));
            let again = s.task_time(relay, &task(TaskKind::Backward, true));
            let embed = s.task_time(holder, &task(TaskKind::EmbedBackward, false));
            costs.push((bwd / fwd, again / fwd, embed));
        }
        assert!((costs[0].0 - 2.0).abs() < 1e-9, "{costs:?}");
        assert!((costs[0].1 - 3.0).abs() < 1e-9, "{costs:?}");
        assert!((costs[1].0 - 3.0).abs() < 1e-9, "{costs:?}");
        assert_eq!(costs[0].2, costs[1].2);
    }

    /// Bulk messages between two nodes go one after another in each
    /// direction, as the runtime writes frames on its one connection per
    /// pair: sent at the same instant, the first arrives after its own
    /// transfer, the second after both (not both after both, as with an
    /// equal share); a message to a third node has its own link.
    #[test]
    fn bulk_messages_to_one_peer_arrive_one_after_another() {
        let mut s = sim();
        let (a, b, c) = (s.new_node(1, 0), s.new_node(2, 1), s.new_node(2, 1));
        let probe = |n: u64| Msg::Probe {
            bytes: 50_000_000,
            sent_at: n,
        };
        s.now = SEC;
        for (to, n) in [(b, 1), (b, 2), (c, 3)] {
            s.send(a, to, probe(n));
        }
        let mut arrived = Vec::new();
        while let Some((t, ev)) = s.queue.pop() {
            s.now = t;
            match ev {
                Ev::LinkDone { key, gen } => s.link_done(key, gen),
                Ev::Deliver {
                    to,
                    msg: Msg::Probe { sent_at, .. },
                    ..
                } => arrived.push((sent_at, to, t)),
                _ => {}
            }
        }
        arrived.sort();
        let (lat, bw) = s.link_params(a, b);
        let one = probe(0).wire_bytes(&s.pcfg) as f64 / bw;
        let want = [
            SEC + secs(lat + one),
            SEC + secs(lat + 2.0 * one),
            SEC + secs(lat + one),
        ];
        assert_eq!(arrived.len(), 3, "{arrived:?}");
        for ((n, to, t), (want_to, w)) in arrived.iter().zip([b, b, c].into_iter().zip(want)) {
            assert_eq!(*to, want_to, "message {n}");
            assert!(t.abs_diff(w) <= 2, "message {n}: {t} against {w}");
        }
    }

    /// The report's link queue counts what an activation waits behind
    /// others on its link, not its own transfer: of two sent to one peer at
    /// once the second waits one transfer, one to a third node none.
    #[test]
    fn an_activation_queued_on_a_link_is_counted_once() {
        let mut s = sim();
        let (a, b, c) = (s.new_node(1, 0), s.new_node(2, 1), s.new_node(2, 1));
        let forward = |idx: u32| Msg::Forward {
            mb: MbId {
                holder: a,
                iter: 0,
                idx,
            },
            attempt: 0,
            path: Arc::new(vec![a]),
            label: None,
            hint: None,
            need_grad: true,
            plan: None,
        };
        s.now = SEC;
        for (to, idx) in [(b, 0), (b, 1), (c, 2)] {
            s.send(a, to, forward(idx));
        }
        while let Some((t, ev)) = s.queue.pop() {
            s.now = t;
            if let Ev::LinkDone { key, gen } = ev {
                s.link_done(key, gen);
            }
        }
        let (_, bw) = s.link_params(a, b);
        let one = forward(0).wire_bytes(&s.pcfg) as f64 / bw;
        assert!(
            (s.rep.link_queue_s - one).abs() < 1e-5,
            "{} against {one}",
            s.rep.link_queue_s
        );
    }

    /// A GPU runs its tasks in the order given, as the runtime's work
    /// queue hands them to its trainer: a backward that comes after two
    /// forwards waits for both (and the report's GPU queue counts the
    /// waits of microbatches' tasks: the second forward's and the
    /// backward's).
    #[test]
    fn a_gpu_runs_its_tasks_in_the_order_given() {
        let mut s = sim();
        let relay = s.new_node(1, 0);
        let task = |id, kind| Task {
            id,
            kind,
            stage: 1,
            mb: Some(MbId {
                holder: 0,
                iter: 0,
                idx: id as u32,
            }),
            attempt: 0,
            recompute: false,
        };
        s.run_task(relay, task(1, TaskKind::Forward));
        s.run_task(relay, task(2, TaskKind::Forward));
        s.run_task(relay, task(3, TaskKind::Backward));
        let mut order = Vec::new();
        while let Some((t, ev)) = s.queue.pop() {
            s.now = t;
            if let Ev::GpuDone { node, gen } = ev {
                if s.nodes[node as usize].gpu_gen == gen {
                    order.extend(s.nodes[node as usize].running.take().map(|r| r.0.id));
                    s.gpu_next(node);
                }
            }
        }
        assert_eq!(order, [1, 2, 3]);
        let fwd = s.task_time(relay, &task(1, TaskKind::Forward));
        let want = fwd + 2.0 * fwd;
        assert!(
            (s.rep.gpu_queue_s - want).abs() < 1e-5,
            "{} against {want}",
            s.rep.gpu_queue_s
        );
    }

    /// The peer-lost notices in the queue: (time, to, peer).
    fn lost(s: &mut Sim) -> Vec<(Time, NodeId, NodeId)> {
        let mut v = Vec::new();
        while let Some((t, ev)) = s.queue.pop() {
            if let Ev::PeerLost { to, peer } = ev {
                v.push((t, to, peer));
            }
        }
        v
    }

    /// A crash breaks the connections of the crashed node: each node it
    /// exchanged a message with (either way) hears of it one link latency
    /// later, the others do not; a message sent to it afterwards fails one
    /// round trip later.
    #[test]
    fn a_crash_is_peer_lost_one_latency_later_at_each_connected_node() {
        let mut s = sim();
        // Regions 0 (Oregon), 1 (Virginia), 2 (Ohio), 3 (Tokyo).
        let ids: Vec<NodeId> = (0..4).map(|r| s.new_node(1, r)).collect();
        s.connect(ids[1], ids[0]);
        s.connect(ids[0], ids[2]);
        let lat = |s: &Sim, a: NodeId, b: NodeId| secs(s.link_params(a, b).0);
        let (l01, l02, l30) = (
            lat(&s, ids[0], ids[1]),
            lat(&s, ids[0], ids[2]),
            lat(&s, ids[3], ids[0]),
        );
        assert!(l01 > 0 && l01 < SEC);
        s.now = 10 * SEC;
        s.kill(ids[0]);
        let mut got = lost(&mut s);
        got.sort();
        let mut want = vec![
            (10 * SEC + l02, ids[2], ids[0]),
            (10 * SEC + l01, ids[1], ids[0]),
        ];
        want.sort();
        assert_eq!(got, want);
        s.connect(ids[3], ids[0]);
        assert_eq!(lost(&mut s), [(10 * SEC + 2 * l30, ids[3], ids[0])]);
    }
}
