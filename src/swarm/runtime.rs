//! A swarm node for real: the protocol state machine (`protocol::Node`, the
//! same code the simulator drives) run on real time over the engine's
//! authenticated TCP connections, with a trainer behind one work interface.
//!
//! Threads: the *driver* ([`super::driver`]) owns the protocol node, turns
//! engine events into protocol inputs (a control frame becomes
//! `Input::Message`; a broken connection that does not come back within
//! the driver's grace, 200 ms, becomes `Input::PeerLost`),
//! performs the protocol's actions (messages go out through
//! `protocol::codec` as control frames, tensors as data frames; tasks
//! become [`Work`] for the trainer; events go to the caller) and runs its
//! timers. The trainer pulls work through a [`WorkPort`]: the built-in
//! trainers run on a thread of their own ([`Runtime::start`]); a trainer
//! behind the C API pulls from its own threads ([`Runtime::start_pulled`]).
//!
//! Tensors: an activation or gradient arrives as a data frame right after
//! its protocol message ([`super::bulk`] pairs them) and is handed to the
//! trainer as the same pool lease; what the trainer produces is kept
//! ([`super::store`]) for as long as the protocol's recovery may send it
//! again, and each send writes that same pool slot, not a copy.
//!
//! Aggregation: the protocol's aggregate task becomes a sum of the
//! granted microbatches' gradients by the trainer, an all-reduce among the
//! commit's members ([`super::aggregate`]: a butterfly up to 64 members, a
//! ring both ways beyond), and, on the coordinator's
//! word (`Applied`), the optimizer step; every member reports the digest
//! of its weights with its part, so replicas that drift apart are an
//! error, never silent. A joiner's state is exported by a member's
//! trainer, sent with its SHA-256 and imported before any other work.
//!
//! Addresses: the protocol names peers by `NodeId`; the engine's node id is
//! that same number. Each connection starts with a directory message
//! ([`super::directory`]).
pub use super::copies::KeptState;
pub use super::directory::{parse as parse_directory, Peer, DIRECTORY_MSG};
use super::driver::{NodeLoop, JOIN_DIRECTORY_WAIT};
pub use super::intake::{Refusal, Refused};
pub use super::work::{CompleteError, Output, TensorSizes, Work, WorkId, WorkKind, WorkPort};
use crate::engine::{EngineError, NodeOptions, Transport};
use crate::protocol::{Config, Event, Input, NodeId, Stage};
use crossbeam_channel::{unbounded, Receiver, Sender};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Runs the work of one node, one piece at a time. With the protocol's
/// `recompute` on (as [`realtime_config`] sets it) a relay's trainer is
/// told to drop what a forward kept (`WorkKind::Discard`); the forward is
/// given again, with the same input, before its backward.
pub trait Trainer: Send + 'static {
    /// Does `work`; output frames come from `port.alloc`.
    fn run(&mut self, work: Work, port: &WorkPort) -> Result<Output, String>;
}

/// A trainer without a model, for tests of the runtime itself: each
/// compute work takes `per_task` and yields zeros of the right size; its
/// "weights" are a digest of every update it applied, so replicas agree
/// exactly when they applied the same updates.
pub struct TimedTrainer {
    pub per_task: Duration,
    /// Elements of its gradient.
    pub params: usize,
    weights: [u8; 32],
}

impl TimedTrainer {
    pub fn new(per_task: Duration) -> TimedTrainer {
        TimedTrainer {
            per_task,
            params: 16,
            weights: [0; 32],
        }
    }
}

impl Trainer for TimedTrainer {
    fn run(&mut self, work: Work, port: &WorkPort) -> Result<Output, String> {
        let tensor = || {
            port.alloc(port.activation_bytes())
                .map_err(|e| e.to_string())
        };
        if work.kind.is_microbatch_compute() {
            std::thread::sleep(self.per_task);
        }
        Ok(match work.kind {
            WorkKind::Embed | WorkKind::Forward | WorkKind::Backward => Output::Tensor(tensor()?),
            WorkKind::Loss => Output::Loss {
                loss: 1.0,
                grad: tensor()?,
            },
            WorkKind::EmbedBackward | WorkKind::Forget { .. } | WorkKind::Discard => Output::None,
            WorkKind::Gradient { granted, .. } => Output::Gradient {
                sum: vec![granted.len() as f32; self.params],
                weights: self.weights,
            },
            WorkKind::Apply { mean, .. } => {
                let mut h = Sha256::new();
                h.update(self.weights);
                for x in mean.iter() {
                    h.update(x.to_le_bytes());
                }
                self.weights = h.finalize().into();
                Output::Weights(self.weights)
            }
            WorkKind::ExportState => {
                let mut f = port.alloc(32).map_err(|e| e.to_string())?;
                f.payload_mut().copy_from_slice(&self.weights);
                Output::State(f)
            }
            WorkKind::InitState { .. } => {
                self.weights = [0; 32];
                Output::Weights(self.weights)
            }
            // The digest of what it averaged: replicas built alike agree.
            WorkKind::AverageStates { states, .. } => {
                let mut h = Sha256::new();
                for (stage, s) in states.iter() {
                    h.update(stage.to_le_bytes());
                    h.update(s);
                }
                self.weights = h.finalize().into();
                Output::Rebuilt {
                    weights: self.weights,
                    averaged: 1,
                }
            }
            WorkKind::ImportState { .. } => {
                let input = work.input.ok_or("no state")?;
                self.weights = input
                    .payload()
                    .try_into()
                    .map_err(|_| format!("a state of {} bytes", input.len()))?;
                Output::Weights(self.weights)
            }
            // Its state is opaque to the runtime (no `weights_first`).
            WorkKind::ImportWeights { .. } | WorkKind::ImportRest { .. } => {
                return Err(format!("{} of an opaque state", work.kind.name()))
            }
        })
    }
}

/// What a node reports, in order.
#[derive(Clone, Debug)]
pub enum NodeEvent {
    /// The protocol's own events.
    Protocol(Event),
    /// The node applied iteration `iteration`'s update: the SHA-256 its
    /// trainer reports for the stage's weights (replicas agree).
    Applied {
        stage: Stage,
        iteration: u32,
        weights: [u8; 32],
        /// Microbatches the applied mean averages.
        microbatches: u64,
    },
    /// Data holder: iteration `iteration` is final; the mean loss of this
    /// holder's microbatches.
    Iteration {
        iteration: u32,
        loss: f32,
        microbatches: u32,
    },
    /// The connection to `peer` broke (it crashed, left, or is unreachable).
    PeerLost { peer: NodeId },
    /// Every attempt to connect to `addr` failed (nobody listens there, or
    /// it did not answer): a joiner's contact, a founding member, or a
    /// peer the directory named.
    ConnectFailed {
        addr: std::net::SocketAddr,
        attempts: u32,
        reason: String,
    },
    /// A data holder keeps a copy of relay stage `stage`'s state from
    /// `from` (`Config::keep_states_every`): the weights after the update
    /// of `iteration` (`version`: the protocol's hash of that version), and
    /// their optimizer state; it came `ms` after it was asked for.
    /// A data holder's checkpoint round (`Config::save_every`) is
    /// complete: every stage's state of the update of `iteration`, stage 0
    /// (its own) first.
    Checkpoint {
        iteration: u32,
        states: Vec<super::saves::SavedState>,
    },
    /// A data holder's checkpoint round of `iteration` will not complete
    /// (`why`): no member of a stage could be asked, or a newer round
    /// opened before its copies came.
    CheckpointDropped { iteration: u32, why: String },
    CopyKept {
        stage: Stage,
        iteration: u32,
        version: u64,
        from: NodeId,
        bytes: u64,
        ms: f64,
    },
    /// A joiner (or a member that missed an update) imported its stage's
    /// state from `from`: `ms` from its request to the whole state, its
    /// hash checked (the transfer as the joiner waited for it, a server's
    /// queue and export included), at `bytes_per_s`; then `import_ms` in
    /// its trainer.
    StateDownloaded {
        from: NodeId,
        bytes: u64,
        ms: f64,
        bytes_per_s: f64,
        import_ms: f64,
        /// The digest the trainer reported of the weights imported.
        weights: [u8; 32],
        /// From the request to the weights, when they were imported first
        /// and the node computed on them while the rest came.
        weights_ms: Option<f64>,
    },
    /// This joiner serves `stage`, which no live node held and of which no
    /// copy was kept, rebuilt from the states of neighbouring stages'
    /// members `from` (CheckFree): its trainer averaged `averaged` of them
    /// (0: none fitted, or it cannot average: the stage restarted from the
    /// initial weights), standing for the update of `applied`; `weights`
    /// is the digest it reported (zeros when it restarted).
    StageRebuilt {
        stage: Stage,
        from: Vec<NodeId>,
        applied: Option<u32>,
        averaged: u32,
        weights: [u8; 32],
    },
    /// Something a peer sent was refused (see [`super::intake`]): from
    /// whom (None: a connection not authenticated), why, and what it was.
    /// Counted in [`Runtime::refused`]; a flood is reported sparingly.
    Refused {
        peer: Option<NodeId>,
        reason: Refusal,
        detail: String,
    },
    /// Something went wrong (a failed work, replicas that disagree); the
    /// node goes on where it can.
    Error(String),
}

/// How a node on real time decides that a peer is gone: the one setting
/// from which the protocol's tick, the group's heartbeat and suspicion, the
/// transport's keepalive and dead-peer timeout, and the hops' timeouts
/// (ack, redo, last resort) all follow, so that they are changed together
/// and cannot drift apart.
///
/// The group's verdict is the one work waits on: a member silent for the
/// suspicion time is dropped by its coordinator (and told so when it speaks
/// again), a coordinator silent as long is replaced, and a peer the
/// protocol takes for gone leaves any all-reduce at once
/// (`Event::PeerDead`). The transport's timeout is a backstop for
/// connections only, several suspicions long: a connection carrying a long
/// bulk frame on a slow link can go that long without a keepalive getting
/// through, and closing it would throw the transfer away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Liveness {
    /// The protocol's tick.
    pub tick: Duration,
    /// Ticks between two heartbeats: the group's, and the transport's
    /// keepalive on an idle connection.
    pub heartbeat_ticks: u32,
    /// Ticks of silence after which the group takes a peer for gone (and
    /// a node whose own tick is that late knows it was paused).
    pub suspect_ticks: u32,
    /// Ticks of silence after which the transport closes a connection.
    pub transport_ticks: u32,
}

/// The slowest a node's driver was seen handling gradient bytes, with a
/// margin: a gpt2-small data holder (312 MB of gradient) held its driver
/// 2.9 s at the all-reduce's start, 108 MB/s, on 2 cores shared by a swarm
/// of three nodes (`gwtf node` logs a hold of 200 ms or more, with `--log`:
/// `waited N ms for (handling) ...`).
pub const DRIVER_BYTES_PER_S: u64 = 64 << 20;

impl Liveness {
    /// The runtime's: a 100 ms tick, heartbeats every 300 ms, a peer
    /// suspected after 0.8 s, a connection closed after 5 s.
    pub const RUNTIME: Liveness = Liveness {
        tick: Duration::from_millis(100),
        heartbeat_ticks: 3,
        suspect_ticks: 8,
        transport_ticks: 50,
    };

    /// The runtime's, for a swarm whose largest stage gradient is `bytes`
    /// (f32s of the stage's parameters). A node's driver holds its thread
    /// while it handles a gradient of that size (the all-reduce's start
    /// copies it into the operation's parts, a chunk that comes is summed
    /// in), hearing and sending nothing meanwhile; a suspicion time shorter
    /// than that takes a busy node for a paused one, and the node takes
    /// itself for one too and fences. So the suspicion grows by the time
    /// `bytes` take at [`DRIVER_BYTES_PER_S`], and the transport's timeout
    /// stays six suspicions long. Every node of a swarm computes the same
    /// from the same model.
    pub fn for_gradient_bytes(bytes: u64) -> Liveness {
        let mut l = Liveness::RUNTIME;
        let extra = Duration::from_secs_f64(bytes as f64 / DRIVER_BYTES_PER_S as f64);
        // Whole ticks only: a small model keeps the runtime's times.
        let ticks = (extra.as_micros() / l.tick.as_micros()).min(1 << 16) as u32;
        l.suspect_ticks += ticks;
        l.transport_ticks = l.transport_ticks.max(6 * l.suspect_ticks + 2);
        l
    }

    /// [`Liveness::for_gradient_bytes`] for a trainer that declared only
    /// its stages' state sizes (an embedded trainer's `state_bytes`): the
    /// states of this library's trainers hold 16 bytes per parameter (the
    /// parameters, two optimizer moments, and the parameters from before
    /// the last update), so a quarter of the largest stands for the
    /// largest gradient.
    pub fn for_state_bytes(largest_state: u64) -> Liveness {
        Liveness::for_gradient_bytes(largest_state / 4)
    }

    pub fn heartbeat(&self) -> Duration {
        self.tick * self.heartbeat_ticks
    }

    pub fn suspicion(&self) -> Duration {
        self.tick * self.suspect_ticks
    }

    pub fn transport_timeout(&self) -> Duration {
        self.tick * self.transport_ticks
    }

    /// The shortest a hop waits for its ack before it is sent elsewhere:
    /// the suspicion time and two ticks, so that a hop is never given up
    /// on a peer the group still counts alive (the ack of a hop whose
    /// transfer took longer is waited for: the timeout grows with the
    /// link's measured ack delay).
    pub fn min_ack_timeout(&self) -> Duration {
        self.suspicion() + 2 * self.tick
    }

    /// The ack timeout on a link whose delay was never measured: twice
    /// the shortest.
    pub fn initial_ack_timeout(&self) -> Duration {
        2 * self.min_ack_timeout()
    }

    /// A microbatch missing at aggregation is asked for again after the
    /// transport's timeout: by then a peer that held it and died is known
    /// dead to every layer.
    pub fn redo_timeout(&self) -> Duration {
        self.transport_timeout()
    }

    /// The iteration barrier reports a stage that applied nothing for two
    /// transport timeouts.
    pub fn stall_report(&self) -> Duration {
        2 * self.transport_timeout()
    }

    /// The last resort of a holder for a microbatch in flight, and how
    /// long a fenced holder waits for another holder alive: six transport
    /// timeouts (a slow state download or a long recomputation is not cut
    /// short by it).
    pub fn e2e_timeout(&self) -> Duration {
        6 * self.transport_timeout()
    }
}

/// The bandwidth probe's size on real time ([`Config::probe_bytes`]).
pub const REALTIME_PROBE_BYTES: u64 = 64 << 10;

/// The protocol's settings for nodes on real time, scaled for hosts a
/// few milliseconds apart (the simulator's defaults are for a planet):
/// a 100 ms tick, and timeouts of seconds rather than tens of seconds.
/// Broken connections are still what detects most crashes. A relay whose
/// memory is full recomputes ([`Config::recompute`]): a [`Trainer`] drops
/// a forward's activations on `WorkKind::Discard`.
pub fn realtime_config(relay_stages: Stage, activation_bytes: u64) -> Config {
    realtime_config_with(relay_stages, activation_bytes, Liveness::RUNTIME)
}

/// [`realtime_config`] with the liveness `l` (e.g.
/// [`Liveness::for_gradient_bytes`]); the transport's must be the same.
pub fn realtime_config_with(relay_stages: Stage, activation_bytes: u64, l: Liveness) -> Config {
    let mut c = Config::new(
        crate::protocol::Policy::Gwtf,
        relay_stages,
        activation_bytes,
    );
    c.tick = l.tick.as_micros() as crate::protocol::Time;
    c.heartbeat_ticks = l.heartbeat_ticks;
    c.suspect_ticks = l.suspect_ticks;
    c.start_delay = crate::protocol::SEC / 2;
    let us = |d: Duration| d.as_micros() as crate::protocol::Time;
    c.min_ack_timeout = us(l.min_ack_timeout());
    c.initial_ack_timeout = us(l.initial_ack_timeout());
    c.redo_timeout = us(l.redo_timeout());
    c.stall_report = us(l.stall_report());
    c.e2e_timeout = us(l.e2e_timeout());
    c.probe_bytes = REALTIME_PROBE_BYTES;
    c.restart_empty_stages = true;
    c.fence_on_pause = true;
    c.leave_out_stragglers = true;
    c.recompute = true;
    c
}

/// State the driver shares with the handle.
#[derive(Default)]
pub struct Shared {
    pub(super) stop: AtomicBool,
    /// Time the trainer spent on microbatch compute.
    pub(super) compute_ns: AtomicU64,
    /// The part of it that went into an applied update.
    pub(super) useful_ns: AtomicU64,
    /// What the node refused, by reason.
    pub(super) refused: super::intake::RefusedCounters,
    /// A holder's copies of the relay stages' states, newest per stage.
    pub(super) kept: std::sync::Mutex<std::collections::BTreeMap<Stage, KeptState>>,
}

/// Compute time of a node so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ComputeStats {
    pub compute: Duration,
    pub useful: Duration,
}

/// How to start a node.
#[derive(Clone)]
pub struct RuntimeOptions {
    pub id: NodeId,
    /// 0 for a data holder, else the relay stage.
    pub stage: Stage,
    pub listen: SocketAddr,
    pub swarm_key: Vec<u8>,
    /// Peers to start from.
    pub bootstrap: Vec<Peer>,
    /// Join a running swarm (else: a founding member).
    pub join: bool,
    pub protocol: Arc<Config>,
    /// Compute time of one microbatch on this node (the protocol's first
    /// estimate; it measures the real one).
    pub compute_s: f64,
    /// Microbatches this node can hold.
    pub capacity: u32,
    pub seed: u64,
    /// Options of the engine (listen and key are taken from above).
    pub net: NodeOptions,
    /// The trainer lays a relay's state out weights first and takes the two
    /// halves apart (`WorkKind::ImportWeights`, then `ImportRest`): given
    /// a state's first bytes and its length, how many leading bytes hold
    /// the weights (None: import it whole). A joiner restoring an emptied
    /// stage then computes once the weights came, while the optimizer
    /// state follows (at 100 Mbit/s a llama-small relay's weights take
    /// 1.7 s of its state's 6.8 s); `weights_first.rs` says why only then.
    /// The built-in trainer's is [`super::model_trainer::weights_prefix`];
    /// None for a trainer whose state is opaque (the C API's).
    pub weights_first: Option<WeightsPrefix>,
}

/// Leading bytes of a state that hold its weights: see
/// [`RuntimeOptions::weights_first`].
pub type WeightsPrefix = fn(head: &[u8], total: usize) -> Option<usize>;

/// A running node. Dropping it stops it abruptly (as a crash would, but
/// for the engine's goodbye); [`Runtime::leave`] leaves gracefully.
pub struct Runtime {
    net: Arc<Transport>,
    shared: Arc<Shared>,
    leave: Sender<()>,
    events: Receiver<NodeEvent>,
    port: WorkPort,
    driver: Option<JoinHandle<()>>,
    trainer: Option<JoinHandle<()>>,
}

impl Runtime {
    /// Starts a node whose work `trainer` runs on a thread of its own.
    pub fn start(opts: RuntimeOptions, mut trainer: impl Trainer) -> Result<Runtime, EngineError> {
        let mut rt = Runtime::start_pulled(opts)?;
        let port = rt.port.clone();
        let t = std::thread::Builder::new()
            .name("gwtf-trainer".into())
            .spawn(move || {
                while !port.is_stopped() {
                    let Some(w) = port.next_work(Duration::from_millis(100)) else {
                        continue;
                    };
                    let id = w.id;
                    let r = trainer.run(w, &port);
                    if let Err(super::work::CompleteError::BadOutput { reason, .. }) =
                        port.complete(id, r)
                    {
                        let _ = port.complete(id, Err(reason));
                    }
                }
            })
            .map_err(|e| EngineError::InvalidArgument(format!("cannot start a thread: {e}")))?;
        rt.trainer = Some(t);
        Ok(rt)
    }

    /// Starts a node whose work the caller pulls from [`Runtime::port`];
    /// every stage boundary carries tensors of the protocol's
    /// `activation_bytes`.
    pub fn start_pulled(opts: RuntimeOptions) -> Result<Runtime, EngineError> {
        let sizes = TensorSizes::uniform(
            opts.protocol.relay_stages,
            opts.protocol.activation_bytes as usize,
        );
        Runtime::start_pulled_sized(opts, sizes)
    }

    /// [`Runtime::start_pulled`] with the tensor sizes of each stage
    /// boundary (a model whose stages exchange tensors of different sizes);
    /// the protocol's `activation_bytes` is then only its cost estimate.
    pub fn start_pulled_sized(
        opts: RuntimeOptions,
        sizes: TensorSizes,
    ) -> Result<Runtime, EngineError> {
        sizes
            .check(opts.protocol.relay_stages)
            .map_err(EngineError::InvalidArgument)?;
        let net = Arc::new(Transport::new(NodeOptions {
            listen: Some(opts.listen),
            swarm_key: opts.swarm_key.clone(),
            node_id: opts.id as u64,
            ..opts.net.clone()
        })?);
        let addr = net
            .local_addr()
            .ok_or_else(|| EngineError::InvalidArgument("the node does not listen".into()))?;
        let port = WorkPort::new(net.clone(), sizes);
        let (events_tx, events) = unbounded();
        let (leave, leave_rx) = unbounded();
        let shared = Arc::new(Shared::default());
        let me = Peer {
            id: opts.id,
            // A joiner is at no stage until the swarm chooses one.
            stage: if opts.join {
                super::directory::NO_STAGE
            } else {
                opts.stage
            },
            addr,
        };
        let mut driver = NodeLoop {
            cfg: opts.protocol.clone(),
            pairing: Default::default(),
            node: crate::protocol::Node::new(
                opts.protocol.clone(),
                opts.id,
                opts.stage,
                opts.compute_s,
                opts.capacity,
                opts.seed,
            ),
            net: net.clone(),
            start: Instant::now(),
            // Bootstrap entries with id 0 are addresses only (a joiner's
            // contacts); the directory messages say who they are.
            dir: opts
                .bootstrap
                .iter()
                .filter(|p| p.id != 0)
                .map(|p| (p.id, p.clone()))
                .collect(),
            last_known: BTreeMap::new(),
            me,
            pending: HashMap::new(),
            lost: VecDeque::new(),
            port: port.clone(),
            events_tx,
            leave_rx,
            shared: shared.clone(),
            joining: None,
            joiner: opts.join,
            store: Default::default(),
            works: HashMap::new(),
            next_work: 1,
            // Early all-reduce chunks may hold a quarter of the pool.
            agg: super::aggregate::Aggregation::with_early_budget(opts.net.pool_bytes / 4),
            means: BTreeMap::new(),
            forgot_before: 0,
            losses: BTreeMap::new(),
            task_time: HashMap::new(),
            claimed_time: BTreeMap::new(),
            failed: false,
            resync: None,
            suspects: HashMap::new(),
            address_waits: HashMap::new(),
            // A founding member resumed from a checkpoint holds its updates.
            applied_through: opts.protocol.resume_from.filter(|_| !opts.join),
            gated: VecDeque::new(),
            cut_off: Default::default(),
            strangers: HashMap::new(),
            state_asked: Default::default(),
            rx_seen: Default::default(),
            rx_told: None,
            backlog: Default::default(),
            state_sender: Default::default(),
            state_receiver: Default::default(),
            weights_first: opts.weights_first,
            rest: None,
            weights_came: None,
            copies: Default::default(),
            copy_after: Vec::new(),
            neighbours: Default::default(),
            verifier: Default::default(),
            sealer: Default::default(),
            own_saved: Default::default(),
            saves: Default::default(),
            serving: Default::default(),
        };
        let bootstrap: Vec<(NodeId, Stage)> = opts
            .bootstrap
            .iter()
            .filter(|p| p.id != opts.id && p.id != 0)
            .map(|p| (p.id, p.stage))
            .collect();
        // A joiner first learns the swarm's directory from its bootstrap
        // peers: the protocol's join needs peers of every stage.
        let first = if opts.join {
            driver.joining = Some(Instant::now() + JOIN_DIRECTORY_WAIT);
            for p in &opts.bootstrap {
                let _ = net.connect(p.addr);
            }
            None
        } else {
            Some(Input::Start { peers: bootstrap })
        };
        let driver_port = port.clone();
        let driver_thread = std::thread::Builder::new()
            .name(format!("gwtf-driver-{:x}", opts.id))
            .spawn(move || {
                driver.run(first);
                driver_port.stop();
            })
            .map_err(|e| EngineError::InvalidArgument(format!("cannot start a thread: {e}")))?;
        Ok(Runtime {
            net,
            shared,
            leave,
            events,
            port,
            driver: Some(driver_thread),
            trainer: None,
        })
    }

    /// Where the trainer pulls its work from.
    pub fn port(&self) -> &WorkPort {
        &self.port
    }

    /// The node's events, in order.
    pub fn events(&self) -> &Receiver<NodeEvent> {
        &self.events
    }

    /// The engine's counters (frames and bytes moved, peers, pool).
    pub fn net_stats(&self) -> crate::engine::NodeStats {
        self.net.stats()
    }

    /// Compute time so far, and the part of it that went into an update.
    pub fn compute_stats(&self) -> ComputeStats {
        ComputeStats {
            compute: Duration::from_nanos(self.shared.compute_ns.load(Ordering::Relaxed)),
            useful: Duration::from_nanos(self.shared.useful_ns.load(Ordering::Relaxed)),
        }
    }

    /// What the node refused so far, by reason.
    pub fn refused(&self) -> Refused {
        self.shared.refused.get()
    }

    /// The copy of relay stage `stage`'s state this data holder keeps
    /// (`Config::keep_states_every`), if any.
    pub fn kept_state(&self, stage: Stage) -> Option<KeptState> {
        let kept = self.shared.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.get(&stage).cloned()
    }

    /// Where this node listens.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.net.local_addr()
    }

    /// Whether the node has stopped (left, or failed).
    pub fn is_stopped(&self) -> bool {
        self.port.is_stopped()
    }

    /// Test and demo aid: cuts this node's link or restores it, emulated in
    /// user space (see [`crate::engine::Transport::set_link_cut`]).
    pub fn set_link_cut(&self, cut: bool) {
        self.net.set_link_cut(cut);
    }

    /// Leaves gracefully (the protocol says goodbye) and waits until done.
    pub fn leave(mut self) {
        let _ = self.leave.send(());
        self.join_threads();
    }

    fn join_threads(&mut self) {
        if let Some(d) = self.driver.take() {
            let _ = d.join();
        }
        self.port.stop();
        self.net.shutdown();
        if let Some(t) = self.trainer.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.join_threads();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime's protocol configuration follows its liveness setting;
    /// the group hears at least two heartbeats within a suspicion time, and
    /// the transport's backstop is longer than the group's verdict.
    #[test]
    fn the_group_and_the_transport_follow_one_liveness_setting() {
        let l = Liveness::RUNTIME;
        let c = realtime_config(2, 1 << 20);
        assert_eq!(c.tick, l.tick.as_micros() as crate::protocol::Time);
        assert_eq!(c.heartbeat_ticks, l.heartbeat_ticks);
        assert_eq!(c.suspect_ticks, l.suspect_ticks);
        assert!(2 * l.heartbeat() < l.suspicion());
        assert!(l.transport_timeout() > l.suspicion());
        assert_eq!(l.heartbeat(), Duration::from_millis(300));
        assert_eq!(l.suspicion(), Duration::from_millis(800));
        // The hop timeouts follow from it too: no hop is given up on a
        // peer the group counts alive, and nothing is asked again before
        // every layer knows a dead peer dead.
        let us = |d: Duration| d.as_micros() as crate::protocol::Time;
        assert_eq!(c.min_ack_timeout, us(l.min_ack_timeout()));
        assert_eq!(c.initial_ack_timeout, us(l.initial_ack_timeout()));
        assert_eq!(c.redo_timeout, us(l.redo_timeout()));
        assert_eq!(c.stall_report, us(l.stall_report()));
        assert_eq!(c.e2e_timeout, us(l.e2e_timeout()));
        assert!(l.min_ack_timeout() > l.suspicion());
        assert!(l.initial_ack_timeout() > l.min_ack_timeout());
        assert!(l.redo_timeout() >= l.transport_timeout());
        assert!(l.e2e_timeout() > l.redo_timeout() && l.stall_report() > l.redo_timeout());
        // The values the runtime ran with before they were derived.
        assert_eq!(c.min_ack_timeout, crate::protocol::SEC);
        assert_eq!(c.initial_ack_timeout, 2 * crate::protocol::SEC);
        assert_eq!(c.redo_timeout, 5 * crate::protocol::SEC);
        assert_eq!(c.e2e_timeout, 30 * crate::protocol::SEC);
    }

    /// A swarm of a large model waits longer before it takes a node for
    /// gone (its driver is busy as long with a gradient); a small model's
    /// keeps the runtime's times; either keeps the relations above.
    #[test]
    fn the_suspicion_grows_with_the_gradient() {
        assert_eq!(Liveness::for_gradient_bytes(0), Liveness::RUNTIME);
        assert_eq!(
            Liveness::for_state_bytes(16 << 20),
            Liveness::for_gradient_bytes(4 << 20)
        );
        // llama-tiny's largest stage: well under a tick's worth.
        let tiny = Liveness::for_gradient_bytes(1 << 20);
        assert_eq!(tiny, Liveness::RUNTIME);
        // gpt2-small's relay stage of 3: 85M parameters, 340 MB.
        let big = Liveness::for_gradient_bytes(340 << 20);
        let secs = |d: Duration| d.as_secs_f64();
        assert!((secs(big.suspicion()) - (0.8 + 340.0 / 64.0)).abs() <= 0.1);
        for l in [tiny, big, Liveness::for_gradient_bytes(u64::MAX)] {
            assert!(2 * l.heartbeat() < l.suspicion());
            assert!(l.transport_timeout() >= 6 * l.suspicion());
            let c = realtime_config_with(2, 1 << 20, l);
            assert_eq!(c.suspect_ticks, l.suspect_ticks);
            assert_eq!(
                c.e2e_timeout,
                l.e2e_timeout().as_micros() as crate::protocol::Time
            );
        }
    }
}
