//! The driver thread of a runtime node: owns the protocol state machine,
//! the kept tensors and the stage all-reduce in progress; turns engine
//! events and trainer completions into protocol inputs and the protocol's
//! actions into frames and work.
use super::aggregate::Aggregation;
use super::background::Background;
use super::bulk::{self, Pairing};
use super::copies::{Copies, CopyHead, KeptState, Verified, Verifier};
use super::directory::{self, Peer, DIRECTORY_MSG};
use super::intake::{self, FrameUse, Refusal};
use super::rebuild::NeighbourStates;
use super::runtime::{NodeEvent, Shared};
use super::saves::{SavedState, Saves};
use super::serving::{self, Admit, StateServer, DIGEST_LEN};
use super::state_stream::{self, ChunkError, Received, StateReceiver, StateSender};
use super::states_asked::StatesAsked;
use super::store::{Slot, TensorStore};
use super::weights_first::RestAwaited;
use super::work::{Completion, Output, Work, WorkId, WorkKind, WorkPort};
use crate::engine::{EngineError, Frame, Incoming, SharedFrame, Transport, TransportEvent};
use crate::protocol::{
    codec, Action, AggregatePlan, Config, Event, FenceReason, Input, MbId, Msg, Node, NodeId,
    Stage, Task, TaskId, TaskKind, Time,
};
use crossbeam_channel::{Receiver, Sender};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Holders' copy requests waiting for an update or for room, at most (one
/// per holder is kept: a holder asks each member once per round).
const COPY_REQUESTS_WAITING_MAX: usize = 16;

/// Messages kept for a peer whose connection is being set up.
const PENDING_MAX: usize = 4096;
/// How long a joiner waits for its bootstrap peers' directories.
pub(super) const JOIN_DIRECTORY_WAIT: Duration = Duration::from_secs(10);
/// How long a node waits for a state it asked for again before asking anew.
const RESYNC_RETRY: Duration = Duration::from_secs(3);
/// A broken connection that comes back within this is not a lost peer.
const LOST_GRACE: Duration = Duration::from_millis(200);
/// How long a message waits for a peer whose address is not known yet (a
/// joiner announced by its coordinator connects to its stage's members
/// just after): it goes when the peer connects, or the peer is lost.
const ADDRESS_WAIT: Duration = Duration::from_secs(2);
/// How long a state's copy waits for a pool slot (see [`NodeLoop::send_state`]).
const COPY_WAIT: Duration = Duration::from_millis(50);
/// Time allowed to enqueue one frame.
const SEND_WAIT: Duration = Duration::from_secs(5);
/// A wait in the engine this long is logged ([`NodeLoop::waited`]).
const SLOW_WAIT: Duration = Duration::from_millis(200);
/// A peer whose data frames came before its directory message (the engine
/// hands frames over before the control messages read with them) is a
/// stranger if the directory has not come within this.
const STRANGER_GRACE: Duration = Duration::from_secs(5);

/// A state download again after a missed update. The node stays in its
/// stage's all-reduces meanwhile (a zero share: it has no grant while its
/// work is held), and keeps their means: a state older than the stage's
/// latest update ends it when the means of every update after the state's
/// are kept (applied after the import, in order), so a download longer
/// than an iteration still ends, and the stage never waits for it.
pub(super) struct Resync {
    /// Work held until the state is in.
    held: VecDeque<Work>,
    retry_at: Instant,
    /// The latest update the stage applied: the weights must hold it.
    need: u32,
    /// Since when no other member could be asked for the state (reported
    /// as an error after [`NO_SOURCE_ERROR`]: a member that leaves at the
    /// end of a run is no loss, and one that joins brings the state).
    no_source_since: Option<Instant>,
}

/// A node that missed an update and finds no member to download the state
/// from this long reports an error.
const NO_SOURCE_ERROR: Duration = Duration::from_secs(10);

/// Means kept for updates to apply after a state download, at most (the
/// oldest go first: a state newer than them is then needed).
const MEANS_KEPT_MAX: usize = 32;

/// Something to send once the connection is up.
pub(super) enum Out {
    Msg(Msg),
    /// A data frame of its own (an all-reduce chunk).
    Frame(Frame),
}

/// What a work given to the trainer is for.
pub(super) enum Pending {
    Task(Task),
    Gradient {
        task: TaskId,
        plan: AggregatePlan,
    },
    Apply {
        iter: u32,
        microbatches: u64,
    },
    Export {
        to: NodeId,
        msg: Msg,
    },
    Import {
        from: NodeId,
        bytes: usize,
        /// When it was asked for (the first request still awaited).
        asked: Instant,
        /// When it had come whole and its hash was checked.
        verified: Instant,
        /// The iteration whose update the state includes last.
        iteration: u32,
        /// When its weights had come, imported first (the import of the
        /// rest of it).
        weights_at: Option<Instant>,
    },
    /// The weights of a state imported first (`RestAwaited`).
    ImportWeights,
    /// The stage's state exported for a holder to keep (`copies.rs`), of
    /// `version` (the protocol's when the export was given: every update
    /// given before it is in, none after).
    Copy {
        to: NodeId,
        version: (u32, u64),
        /// A holder's copy, whose digest is taken on a background thread
        /// (nobody waits for it); a rebuilder's is sent at once.
        background: bool,
    },
    /// A holder's own state exported for the checkpoint round of
    /// `iteration` (`saves.rs`).
    SaveOwn {
        iteration: u32,
    },
    /// The stage's state started afresh (`WorkKind::InitState`).
    Init,
    /// The stage rebuilt from its neighbours' states `from`
    /// (`WorkKind::AverageStates`, `rebuild.rs`).
    Rebuild {
        from: Vec<NodeId>,
        applied: Option<u32>,
    },
    Forget,
    /// The forward of a recomputing backward (its output is not needed):
    /// the backward follows.
    Recompute(Task),
    /// The trainer dropped what a forward kept (`WorkKind::Discard`).
    Discard,
}

/// The loop of one swarm node's driver thread: it owns the protocol node
/// and turns transport events, trainer answers and timers into its inputs,
/// and its actions into frames, work and events. (Named apart from the
/// engine's poll thread, which owns the sockets.)
pub(super) struct NodeLoop {
    pub(super) cfg: Arc<Config>,
    /// Bulk messages and data frames waiting for each other.
    pub(super) pairing: Pairing<Frame>,
    pub(super) node: Node,
    pub(super) net: Arc<Transport>,
    pub(super) start: Instant,
    pub(super) me: Peer,
    pub(super) dir: BTreeMap<NodeId, Peer>,
    /// The last known entries of peers taken out of `dir` when their
    /// connection broke: no longer passed on to others, but still dialled
    /// when the protocol sends to them (a peer that was only unreachable
    /// for a while, or this node's own pause, does not make an address
    /// wrong, and a message with no address would be lost).
    pub(super) last_known: BTreeMap<NodeId, Peer>,
    /// What waits for a connection being set up.
    pub(super) pending: HashMap<NodeId, VecDeque<Out>>,
    /// Peers found unreachable, to tell the protocol.
    pub(super) lost: VecDeque<NodeId>,
    pub(super) port: WorkPort,
    pub(super) events_tx: Sender<NodeEvent>,
    pub(super) leave_rx: Receiver<()>,
    pub(super) shared: Arc<Shared>,
    /// A joiner waiting for a directory, until this time.
    pub(super) joining: Option<Instant>,
    /// This node joined a running swarm (it was not a founding member).
    pub(super) joiner: bool,
    pub(super) store: TensorStore,
    pub(super) works: HashMap<WorkId, Pending>,
    pub(super) next_work: WorkId,
    pub(super) agg: Aggregation,
    /// All-reduced mean gradients waiting for the coordinator's word.
    pub(super) means: BTreeMap<u32, (Arc<Vec<f32>>, u64)>,
    /// Iterations before this one are forgotten (tensors and trainer state).
    pub(super) forgot_before: u32,
    /// Holder: the loss of each of its microbatches (latest attempt).
    pub(super) losses: BTreeMap<MbId, f32>,
    /// Compute time of each task, until claimed or forgotten.
    pub(super) task_time: HashMap<TaskId, (u32, Duration)>,
    /// Claimed compute time by iteration, useful once the stage applies it.
    pub(super) claimed_time: BTreeMap<u32, Duration>,
    pub(super) failed: bool,
    pub(super) resync: Option<Resync>,
    /// Peers whose connection broke, lost at the given time unless back.
    pub(super) suspects: HashMap<NodeId, Instant>,
    /// Peers messages wait for whose address is not known yet, until when.
    pub(super) address_waits: HashMap<NodeId, Instant>,
    /// The last update given to the trainer (applied or imported).
    pub(super) applied_through: Option<u32>,
    /// Microbatch work waiting for the update before its iteration.
    pub(super) gated: VecDeque<Work>,
    /// Peers cut off for breaking the rules, not heard until they connect
    /// again (what they sent before the cut may still be queued).
    pub(super) cut_off: HashSet<NodeId>,
    /// Peers not in the directory that sent data frames: strangers unless
    /// introduced by then.
    pub(super) strangers: HashMap<NodeId, Instant>,
    /// Peers this node asked for the stage's state, with the answers still
    /// to come (a request and its retries: a peer that had sent the first
    /// answer already sends one per request): a state from them that is no
    /// longer needed is dropped, not taken for a hostile peer's.
    pub(super) state_asked: StatesAsked,
    /// The states this node serves (one per requester, a few at once).
    pub(super) serving: StateServer,
    /// Bytes read from each peer when last told to the protocol, and when
    /// ([`NodeLoop::tell_bytes_heard`]).
    pub(super) rx_seen: HashMap<NodeId, u64>,
    pub(super) rx_told: Option<Instant>,
    /// Data frames waiting for room in a peer's send queue, in order (what
    /// each is, for the log): this thread never waits for a slow peer. It
    /// heard nothing while it waited (up to 5 s for a joiner's queue behind
    /// an 85 MB state), and took itself for paused.
    pub(super) backlog: HashMap<NodeId, VecDeque<(SharedFrame, &'static str)>>,
    /// The states this node sends, chunk by chunk, and those it receives.
    pub(super) state_sender: StateSender,
    pub(super) state_receiver: StateReceiver,
    /// The trainer's rule for the leading bytes of a state that hold its
    /// weights ([`super::runtime::RuntimeOptions::weights_first`]).
    pub(super) weights_first: Option<super::runtime::WeightsPrefix>,
    /// A download whose weights were imported first, its rest awaited.
    pub(super) rest: Option<RestAwaited>,
    /// The data of the bulk message from this peer, when it comes, is a
    /// state's weights only (its rest follows).
    pub(super) weights_came: Option<NodeId>,
    /// A holder's copies of the relay stages' states (`copies.rs`).
    pub(super) copies: Copies,
    /// Holders' copy requests waiting for the update they name
    /// (`Msg::CopyRequest`): (holder, iteration), at most
    /// [`COPY_REQUESTS_WAITING_MAX`].
    pub(super) copy_after: Vec<(NodeId, u32)>,
    /// A holder's checkpoint rounds (`saves.rs`).
    pub(super) saves: Saves,
    /// The neighbours' states of a stage this node rebuilds (`rebuild.rs`).
    pub(super) neighbours: NeighbourStates,
    /// A holder's copies being checked off this thread (`copies.rs`).
    pub(super) verifier: Verifier,
    /// The copies this member sends holders, their digests being taken
    /// off this thread.
    pub(super) sealer: Background<Sealed>,
    /// A holder's own states for its checkpoints, being copied out of the
    /// frame pool off this thread: (iteration, state).
    pub(super) own_saved: Background<(u32, SavedState)>,
}

/// A copy for holder `to` with its digest taken, ready to send.
pub(super) struct Sealed {
    to: NodeId,
    version: (u32, u64),
    state: Frame,
    digest: [u8; DIGEST_LEN],
}

/// Data frames waiting for one peer, at most (beyond, the newest are
/// dropped: its hops and all-reduce chunks are recovered as lost).
const BACKLOG_MAX: usize = 1024;

/// How often the bytes read from peers are told to the protocol (a tick
/// of the runtime's, at most: what its suspicion counts in).
const RX_TELL_EVERY: Duration = Duration::from_millis(50);

/// The peers whose time in `m` has come by `now`.
fn due(m: &HashMap<NodeId, Instant>, now: Instant) -> Vec<NodeId> {
    m.iter()
        .filter(|(_, t)| **t <= now)
        .map(|(id, _)| *id)
        .collect()
}

/// The longest a state of `bytes` may take to arrive: at the slowest rate
/// the engine lets a frame take (1 MiB/s; see `NodeOptions::min_frame_rate`).
fn state_transfer_allowance(bytes: u64) -> Duration {
    Duration::from_secs_f64(bytes as f64 / (1u64 << 20) as f64)
}

/// The first 8 bytes of a digest, as the protocol compares them.
pub fn digest_u64(d: &[u8; 32]) -> u64 {
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes")).max(1)
}

impl NodeLoop {
    fn now(&self) -> Time {
        self.start.elapsed().as_micros() as Time
    }

    pub(super) fn input(&mut self, input: Input) {
        let now = self.now();
        let actions = self.node.handle(now, input);
        self.perform(actions);
    }

    pub(super) fn emit(&self, e: NodeEvent) {
        let _ = self.events_tx.send(e);
    }

    pub(super) fn error(&mut self, message: String) {
        self.log(message.clone());
        self.emit(NodeEvent::Error(message));
    }

    /// Refuses what `peer` sent: counted, logged and reported.
    pub(super) fn refuse(&mut self, peer: Option<NodeId>, reason: Refusal, detail: String) {
        let n = self.shared.refused.add(reason);
        if intake::worth_reporting(n) {
            self.log(format!("refused {detail} ({}, {n} so far)", reason.name()));
            self.emit(NodeEvent::Refused {
                peer,
                reason,
                detail,
            });
        }
    }

    /// Refuses what `peer` sent and cuts it off: a peer that breaks the
    /// rules is not heard any more (if it is a member, the protocol takes
    /// it for lost and recovers what it held).
    pub(super) fn refuse_and_cut(&mut self, peer: NodeId, reason: Refusal, detail: String) {
        self.rest_lost(peer, &detail);
        self.refuse(Some(peer), reason, detail);
        self.pairing.forget(peer);
        self.strangers.remove(&peer);
        self.cut_off.insert(peer);
        let _ = self.net.disconnect(peer as u64);
    }

    pub(super) fn log(&self, line: String) {
        if self.net.options().log {
            eprintln!("gwtf node {:x}: {line}", self.me.id);
        }
    }

    fn perform(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Send { to, msg } => self.send(to, msg),
                Action::Run(task) => self.run_task(task),
                Action::Event(e) => self.on_protocol_event(e),
            }
        }
        self.forget_old();
    }

    pub(super) fn give(
        &mut self,
        kind: WorkKind,
        mb: Option<MbId>,
        input: Option<Frame>,
        p: Pending,
    ) {
        let id = self.next_work;
        self.next_work += 1;
        self.works.insert(id, p);
        let w = Work {
            id,
            kind,
            stage: self.node.stage(),
            mb,
            input,
        };
        self.dispatch(w);
    }

    /// Hands `w` to the trainer, unless it must wait: nothing runs on
    /// weights that are about to be replaced (a state download again), and
    /// the microbatches of iteration `j` run on the weights of update
    /// `j - 1` (its `Applied` and a forward of iteration `j` come from
    /// different nodes, in either order).
    pub(super) fn dispatch(&mut self, w: Work) {
        // A whole state replaces one whose rest was awaited (this node was
        // fenced and joined again, or downloads again): what waited for
        // that rest goes after it.
        let superseded = match &w.kind {
            WorkKind::ImportState { .. }
            | WorkKind::InitState { .. }
            | WorkKind::AverageStates { .. } => self.rest.take(),
            _ => None,
        };
        self.dispatch_one(w);
        if let Some(r) = superseded {
            self.log(format!(
                "a whole state replaces the one from {:x} whose rest was awaited: {} works held go on",
                r.from,
                r.held.len()
            ));
            for h in r.held {
                self.dispatch(h);
            }
        }
    }

    fn dispatch_one(&mut self, w: Work) {
        if let Some(r) = self.rest.as_mut() {
            if !r.passes(&w) {
                r.held.push_back(w);
                return;
            }
        }
        if let Some(r) = self.resync.as_mut() {
            // A gradient of no grant is a zero share: it needs no weights.
            let passes = match &w.kind {
                WorkKind::ImportState { .. }
                | WorkKind::ImportWeights { .. }
                | WorkKind::ImportRest { .. }
                | WorkKind::InitState { .. }
                | WorkKind::AverageStates { .. } => true,
                WorkKind::Gradient { granted, .. } => granted.is_empty(),
                _ => false,
            };
            if !passes {
                r.held.push_back(w);
                return;
            }
        }
        let update = match &w.kind {
            WorkKind::Apply { iteration, .. } => Some(Some(*iteration)),
            WorkKind::ImportState { applied }
            | WorkKind::ImportWeights { applied }
            | WorkKind::InitState { applied }
            | WorkKind::AverageStates { applied, .. } => Some(*applied),
            _ => None,
        };
        match &w.kind {
            _ if update.is_some() => {
                self.port.push(w);
                match update.flatten() {
                    Some(it) if self.applied_through.is_none_or(|a| a < it) => {
                        self.applied_through = Some(it)
                    }
                    // An import before any update: nothing applied yet.
                    None => self.applied_through = None,
                    _ => {}
                }
                self.copies_after_update();
                let gated = std::mem::take(&mut self.gated);
                for g in gated {
                    self.dispatch(g);
                }
            }
            k if k.is_microbatch_compute() && !self.may_run(w.mb) => self.gated.push_back(w),
            _ => self.port.push(w),
        }
    }

    /// Whether a microbatch's work has the weights it needs.
    fn may_run(&self, mb: Option<MbId>) -> bool {
        match mb {
            Some(mb) if mb.iter > 0 => self.applied_through.is_some_and(|a| a + 1 >= mb.iter),
            _ => true,
        }
    }

    /// This node missed an update (it joined while the aggregate ran, so
    /// it was not in the commit): it downloads the stage's state again from
    /// its coordinator, and holds all work until the state is in.
    pub(super) fn start_resync(&mut self, iter: u32) {
        let now = Instant::now();
        match self.resync.as_mut() {
            Some(r) if now < r.retry_at && r.need >= iter => return,
            Some(r) => {
                r.retry_at = now + RESYNC_RETRY;
                r.need = r.need.max(iter);
            }
            None => {
                self.log(format!(
                    "missed the update of iteration {iter}: downloading the state again"
                ));
                self.resync = Some(Resync {
                    held: VecDeque::new(),
                    retry_at: now + RESYNC_RETRY,
                    need: iter,
                    no_source_since: None,
                });
                // The state to come replaces one whose rest was awaited:
                // what waited for that rest waits for it.
                if let Some(r) = self.rest.take() {
                    for w in r.held {
                        self.dispatch(w);
                    }
                }
            }
        }
        let me = self.me.id;
        let src = self
            .node
            .coordinator()
            .filter(|&c| c != me)
            .or_else(|| self.node.stage_members().into_iter().find(|&m| m != me));
        let Some(r) = self.resync.as_mut() else {
            return;
        };
        match (src, r.no_source_since) {
            (Some(c), _) => {
                r.no_source_since = None;
                self.send(c, Msg::StateRequest);
            }
            (None, None) => {
                r.no_source_since = Some(now);
                self.log(format!(
                    "missed the update of iteration {iter} and no other member can serve the state now"
                ));
            }
            (None, Some(t)) if now.duration_since(t) >= NO_SOURCE_ERROR => {
                r.no_source_since = Some(now);
                self.error(format!(
                    "missed the update of iteration {iter} and no other member could serve the state for {} s",
                    NO_SOURCE_ERROR.as_secs()
                ));
            }
            (None, Some(_)) => {}
        }
    }

    /// Whether the state imported, with the means kept, holds every update
    /// through `need`.
    fn caught_up_to(&self, need: u32) -> bool {
        let after = self.applied_through.map_or(0, |a| a + 1);
        (after..=need).all(|k| self.means.contains_key(&k))
    }

    /// The state is in again: the updates after it are applied from their
    /// means, and the held work goes to the trainer.
    fn end_resync(&mut self) {
        if let Some(r) = self.resync.take() {
            let after = self.applied_through.map_or(0, |a| a + 1);
            self.log(format!(
                "the state holds the update of iteration {}{}: {} works held go on",
                r.need,
                if after <= r.need {
                    format!(" with the means of {after}..={} kept", r.need)
                } else {
                    String::new()
                },
                r.held.len()
            ));
            for k in after..=r.need {
                self.apply(k);
            }
            self.node.caught_up(r.need);
            // A microbatch of iteration j runs on the weights of update
            // j - 1: held past a later update, those weights are gone. The
            // work is dropped (as a trainer's failure would be): the
            // protocol sends the hop elsewhere.
            let through = self.applied_through;
            let (stale, held): (Vec<Work>, Vec<Work>) = r.held.into_iter().partition(|w| {
                w.kind.is_microbatch_compute()
                    && w.mb.is_some_and(|mb| through.is_some_and(|a| a >= mb.iter))
            });
            if !stale.is_empty() {
                self.log(format!(
                    "{} works held for microbatches whose weights are gone: dropped",
                    stale.len()
                ));
            }
            for w in stale {
                self.works.remove(&w.id);
            }
            for w in held {
                self.dispatch(w);
            }
        }
    }

    fn run_task(&mut self, task: Task) {
        let (kind, input) = match (task.kind, task.mb) {
            (TaskKind::Aggregate { .. }, _) => {
                match self.node.aggregate_plan(task.id) {
                    Some(plan) => {
                        self.connect_all(&plan.members);
                        let kind = WorkKind::Gradient {
                            iteration: plan.iter,
                            granted: plan.granted.clone(),
                        };
                        let p = Pending::Gradient {
                            task: task.id,
                            plan,
                        };
                        self.give(kind, None, None, p);
                    }
                    None => self.error(format!("aggregate task {} has no commit", task.id)),
                }
                return;
            }
            (TaskKind::Embed, _) => (WorkKind::Embed, None),
            (TaskKind::Forward, Some(mb)) => {
                let input = self.store.take(mb, Slot::Input);
                if task.recompute && !self.checkpoint(task, input.as_ref()) {
                    return;
                }
                (WorkKind::Forward, input)
            }
            // The forward kept only its input: it runs again first.
            (TaskKind::Backward, Some(mb)) if task.recompute => {
                match self.store.take(mb, Slot::Checkpoint) {
                    Some(input) => {
                        let p = Pending::Recompute(task);
                        self.give(WorkKind::Forward, Some(mb), Some(input), p);
                    }
                    None => {
                        self.error(format!("no input kept to recompute the forward of {mb:?}"));
                        self.input(Input::TaskFailed { id: task.id });
                    }
                }
                return;
            }
            (TaskKind::Loss, Some(mb)) => (WorkKind::Loss, self.store.take(mb, Slot::Input)),
            (TaskKind::Backward, Some(mb)) => {
                (WorkKind::Backward, self.store.take(mb, Slot::GradIn))
            }
            (TaskKind::EmbedBackward, Some(mb)) => {
                (WorkKind::EmbedBackward, self.store.take(mb, Slot::GradIn))
            }
            (k, None) => {
                self.error(format!("{k:?} task without a microbatch"));
                return;
            }
        };
        if kind != WorkKind::Embed && input.is_none() {
            self.error(format!(
                "no input tensor for the {} of {:?}",
                kind.name(),
                task.mb
            ));
            return;
        }
        self.give(kind, task.mb, input, Pending::Task(task));
    }

    /// Keeps a copy of a forward's `input` for its backward, which runs the
    /// forward again (the protocol's `recompute`: this node's memory is
    /// full). False, the task failed, when the pool has no room for it.
    fn checkpoint(&mut self, task: Task, input: Option<&Frame>) -> bool {
        let (Some(mb), Some(f)) = (task.mb, input) else {
            return true;
        };
        match self.port.alloc(f.len()) {
            Ok(mut copy) => {
                copy.payload_mut().copy_from_slice(f.payload());
                self.store.put(mb, task.attempt, Slot::Checkpoint, copy);
                true
            }
            Err(e) => {
                self.error(format!("no room to keep the input of {mb:?}: {e}"));
                self.input(Input::TaskFailed { id: task.id });
                false
            }
        }
    }

    fn on_protocol_event(&mut self, e: Event) {
        match &e {
            // A joiner's stage is chosen on join: the directory says it.
            Event::Active { stage } => {
                self.me.stage = *stage;
                self.announce_stage();
                // The members of its stage hear of a joiner from their
                // coordinator, but not where it is: it connects to each,
                // which sends them its directory entry.
                if self.joiner {
                    let members = self.node.stage_members();
                    self.connect_all(&members);
                }
            }
            // Nobody holds the stage's state: the trainer starts it afresh
            // (before any work of the stage reaches it).
            Event::StageRestarted { stage, applied } => {
                self.me.stage = *stage;
                self.announce_stage();
                self.log(format!(
                    "stage {stage} had no live node: restarting it from the initial weights"
                ));
                let kind = WorkKind::InitState { applied: *applied };
                self.give(kind, None, None, Pending::Init);
            }
            // The trainer averages the neighbours' states before any work
            // of the stage reaches it.
            Event::StageRebuilt {
                stage,
                from,
                applied,
            } => {
                self.me.stage = *stage;
                self.announce_stage();
                self.rebuild(*stage, from, *applied);
            }
            // The kept copy was imported before the protocol heard of it.
            Event::StageRestored {
                stage,
                from,
                iteration,
                applied,
            } => {
                self.me.stage = *stage;
                self.announce_stage();
                let line = super::copies::restored_line(*stage, *from, *iteration, *applied);
                self.log(line);
            }
            // The weights kept since the fence are the stage's newest:
            // the trainer goes on with them (nothing to load).
            Event::StateKept { stage, applied } => {
                self.me.stage = *stage;
                self.announce_stage();
                self.log(format!(
                    "no live node of stage {stage} holds its update of iteration {applied}: \
                     serving the weights kept since the fence again"
                ));
            }
            Event::Applied { iter, .. } => self.apply(*iter),
            // The group took it for gone (a suspicion comes well before
            // the transport's dead-peer timeout): an all-reduce waiting for
            // its part ends now, and its coordinator commits again.
            Event::PeerDead { peer } => {
                self.agg.on_peer_lost(*peer as u64);
                self.drive_aggregation();
            }
            Event::Stranded { stage, waited } => {
                self.error(format!(
                    "fenced, and no live node of stage {stage} to download its state from \
                     for {:.1} s (the others finished or are gone): this node cannot train on",
                    crate::protocol::to_secs(*waited)
                ));
                self.failed = true;
            }
            Event::Fenced {
                reason,
                incarnation,
            } => self.fenced(*reason, *incarnation),
            Event::Claimed { mb, tasks } => {
                let t: Duration = tasks
                    .iter()
                    .filter_map(|t| self.task_time.remove(t))
                    .map(|(_, d)| d)
                    .sum();
                *self.claimed_time.entry(mb.iter).or_default() += t;
            }
            // A holder knows an iteration is final when its barrier
            // coordinator finalizes it or starts the next one.
            Event::IterFinalized { iter, .. } if self.me.stage == 0 => self.iteration_final(*iter),
            Event::IterStarted { iter } if self.me.stage == 0 && *iter > 0 => {
                self.iteration_final(*iter - 1)
            }
            Event::ReplicasDiverged {
                stage,
                iter,
                digests,
            } => {
                let m = format!(
                    "the replicas of stage {stage} held different weights at iteration {iter}: {digests:x?}"
                );
                self.error(m);
            }
            _ => {}
        }
        self.emit(NodeEvent::Protocol(e));
    }

    /// The protocol stopped serving the stage group (fencing): everything
    /// this node held for it is dropped, so that nothing of the old view is
    /// sent, applied or counted again; the node comes back through the join
    /// path (its state download replaces the weights).
    fn fenced(&mut self, reason: FenceReason, incarnation: u32) {
        self.log(format!(
            "fenced ({}): leaving the stage group, joining again as incarnation {incarnation}",
            reason.name()
        ));
        self.joiner = true;
        // Its state is no longer the stage's to copy.
        self.copy_after.clear();
        // The weights the protocol keeps to serve again must be the
        // trainer's: not while an update is missing or on its way.
        let whole =
            self.resync.is_none() && self.node.kept_version().map(|v| v.0) == self.applied_through;
        if !whole {
            self.node.forget_kept();
        }
        self.means.clear();
        self.gated.clear();
        self.resync = None;
        self.losses.clear();
        self.task_time.clear();
        self.claimed_time.clear();
        self.store.forget_before(u32::MAX);
        let budget = self.net.options().pool_bytes / 4;
        self.agg = Aggregation::with_early_budget(budget);
    }

    /// Holder: iterations up to `iter` are final: report their losses.
    fn iteration_final(&mut self, iter: u32) {
        let mut by_iter: BTreeMap<u32, Vec<f32>> = BTreeMap::new();
        for (mb, l) in self.losses.range(..) {
            if mb.iter <= iter && mb.holder == self.me.id {
                by_iter.entry(mb.iter).or_default().push(*l);
            }
        }
        self.losses.retain(|mb, _| mb.iter > iter);
        for (k, ls) in by_iter {
            let loss = ls.iter().map(|&l| l as f64).sum::<f64>() / ls.len() as f64;
            self.emit(NodeEvent::Iteration {
                iteration: k,
                loss: loss as f32,
                microbatches: ls.len() as u32,
            });
        }
    }

    /// The coordinator's word: apply the aggregate of `iter`.
    fn apply(&mut self, iter: u32) {
        if self.applied_through.is_some_and(|a| a >= iter) {
            // The state imported already has it.
            self.means.remove(&iter);
            return;
        }
        if let Some(r) = self.resync.as_mut() {
            // A state is on its way: this update is applied after it (from
            // its mean, kept) unless the state holds it.
            r.need = r.need.max(iter);
            self.keep_means_bounded();
            return;
        }
        if self.applied_through.map_or(iter > 0, |a| a + 1 < iter) {
            // The weights miss an update before this one (a state
            // downloaded stale): applying it, or taking a commit of no
            // microbatch for it, would leave weights that hold neither.
            // The state is downloaded again (this mean is kept for after).
            self.start_resync(iter);
            return;
        }
        match self.means.remove(&iter) {
            // A commit of no microbatch (nothing was granted at this
            // stage): no optimizer step, which would still move the
            // weights (momentum); the weights stand for this iteration's.
            Some((_, 0)) => {
                self.means.retain(|k, _| *k > iter);
                self.log(format!(
                    "iteration {iter} committed no microbatch here: the weights stay as they are"
                ));
                self.applied_through = Some(iter);
                self.copies_after_update();
                let gated = std::mem::take(&mut self.gated);
                for g in gated {
                    self.dispatch(g);
                }
            }
            Some((mean, microbatches)) => {
                self.means.retain(|k, _| *k > iter);
                let kind = WorkKind::Apply {
                    iteration: iter,
                    mean,
                    microbatches,
                };
                self.give(kind, None, None, Pending::Apply { iter, microbatches });
            }
            // A node that joined while the aggregate ran (it was not in
            // the commit): its weights are one update behind.
            None => self.start_resync(iter),
        }
        if let Some(t) = self.claimed_time.remove(&iter) {
            self.shared
                .useful_ns
                .fetch_add(t.as_nanos() as u64, Ordering::Relaxed);
        }
        self.claimed_time.retain(|k, _| *k > iter);
    }

    /// At most [`MEANS_KEPT_MAX`] means wait for a state download.
    fn keep_means_bounded(&mut self) {
        while self.means.len() > MEANS_KEPT_MAX {
            self.means.pop_first();
        }
    }

    /// Frees what the protocol no longer keeps.
    fn forget_old(&mut self) {
        let m = self.node.oldest_kept_iteration();
        if m > self.forgot_before {
            self.forgot_before = m;
            self.store.forget_before(m);
            self.task_time.retain(|_, (k, _)| *k >= m);
            self.give(WorkKind::Forget { before: m }, None, None, Pending::Forget);
        }
    }

    // ---- trainer completions

    pub(super) fn on_completions(&mut self) {
        for c in self.port.take_done() {
            self.on_completion(c);
        }
    }

    fn on_completion(&mut self, c: Completion) {
        let Some(p) = self.works.remove(&c.id) else {
            return;
        };
        if c.kind.is_microbatch_compute() {
            self.shared
                .compute_ns
                .fetch_add(c.took.as_nanos() as u64, Ordering::Relaxed);
        }
        let out = match c.result {
            Ok(out) => out,
            Err(reason) => {
                // The work is lost here; the protocol's timeouts send the
                // microbatch's hop elsewhere.
                self.error(format!("the trainer failed {}: {reason}", c.kind.name()));
                match p {
                    Pending::Import { .. } | Pending::ImportWeights => self.failed = true,
                    // Started from the initial weights instead.
                    Pending::Rebuild { from, applied } => self.rebuilt(from, applied, None),
                    // The coordinator commits again (and the gradient is
                    // asked for again).
                    Pending::Gradient { task, .. } => self.input(Input::TaskFailed { id: task }),
                    // A request again is served afresh.
                    Pending::Export { to, .. } | Pending::Copy { to, .. } => {
                        self.serving.failed(to)
                    }
                    _ => {}
                }
                return;
            }
        };
        let stale = match &p {
            Pending::Task(task) | Pending::Recompute(task) => !self.node.task_live(task.id),
            Pending::Gradient { task, .. } => !self.node.task_live(*task),
            _ => false,
        };
        if stale {
            // Given before this node fenced itself: its result belongs to
            // a view of the group that is gone.
            return;
        }
        match p {
            Pending::Task(task) => self.task_done(task, out, c.took),
            Pending::Gradient { task, plan } => {
                if let Output::Gradient { sum, weights } = out {
                    self.node.set_weights_digest(digest_u64(&weights));
                    let (me, stage) = (self.me.id, self.me.stage as u32);
                    let outcome = self.agg.start(stage, me, task, plan, &sum);
                    if let Err(e) = outcome {
                        self.error(format!("cannot start the all-reduce: {e}"));
                        self.input(Input::TaskFailed { id: task });
                    }
                    self.drive_aggregation();
                }
            }
            Pending::Apply { iter, microbatches } => {
                if let Output::Weights(w) = out {
                    self.node.set_weights_digest(digest_u64(&w));
                    self.emit(NodeEvent::Applied {
                        stage: self.me.stage,
                        iteration: iter,
                        weights: w,
                        microbatches,
                    });
                    if self.me.stage == 0 {
                        self.holder_rounds(iter);
                    }
                }
            }
            Pending::SaveOwn { iteration } => {
                if let Output::State(f) = out {
                    // Out of the frame pool on a thread of its own: the
                    // copy of a whole state (85 MB for llama-small, into
                    // fresh pages) held this holder's driver, and with it
                    // the microbatches it routes, for about 0.2 s.
                    let from = self.me.id;
                    self.own_saved.start("gwtf-save-own", move || {
                        let state = Arc::new(f.payload().to_vec());
                        let s = SavedState {
                            stage: 0,
                            from,
                            state,
                        };
                        (iteration, s)
                    });
                }
            }
            Pending::Copy {
                to,
                version,
                background,
            } => match out {
                Output::State(f) if background => {
                    self.sealer.start("gwtf-copy-seal", move || {
                        let digest = serving::state_digest(&f);
                        Sealed {
                            to,
                            version,
                            state: f,
                            digest,
                        }
                    });
                }
                Output::State(f) => {
                    let d = serving::state_digest(&f);
                    self.send_copy(to, version, f, d);
                }
                _ => self.serving.failed(to),
            },
            Pending::Export { to, msg } => match out {
                Output::State(f) => {
                    let stage = self.me.stage;
                    self.send_state(to, msg, f, stage)
                }
                _ => self.serving.failed(to),
            },
            Pending::ImportWeights => {}
            Pending::Import {
                from,
                bytes,
                asked,
                verified,
                iteration,
                weights_at,
            } => {
                if let Output::Weights(w) = out {
                    self.node.set_weights_digest(digest_u64(&w));
                    let took = verified.duration_since(asked).as_secs_f64();
                    self.emit(NodeEvent::StateDownloaded {
                        from,
                        bytes: bytes as u64,
                        ms: took * 1e3,
                        bytes_per_s: bytes as f64 / took.max(1e-6),
                        import_ms: verified.elapsed().as_secs_f64() * 1e3,
                        weights: w,
                        weights_ms: weights_at.map(|t| t.duration_since(asked).as_secs_f64() * 1e3),
                    });
                }
                if weights_at.is_some() {
                    // The whole state is in: what waited for it goes on.
                    if let Some(r) = self.rest.take() {
                        for w in r.held {
                            self.dispatch(w);
                        }
                    }
                }
                // A state older than the update that was missed does not
                // end a download again (the one asked for is on its way).
                let need = self.resync.as_ref().map(|r| r.need);
                if let Some(need) = need {
                    if iteration >= need || self.caught_up_to(need) {
                        self.end_resync();
                    } else if let Some(r) = self.resync.as_mut() {
                        // An update was applied while it came (its server
                        // answered the retries with the state on its way,
                        // not with newer ones): asked again at once, not
                        // after the transfer allowance its arrival set.
                        r.retry_at = Instant::now();
                        let need = r.need;
                        self.log(format!(
                            "the state from {from:x} holds iteration {iteration}: the update of {need} is still missing"
                        ));
                    }
                }
            }
            Pending::Rebuild { from, applied } => self.rebuilt(from, applied, Some(out)),
            Pending::Init => {
                if let Output::Weights(w) = out {
                    self.node.set_weights_digest(digest_u64(&w));
                }
            }
            Pending::Forget | Pending::Discard => {}
            Pending::Recompute(task) => {
                // Counted with the backward's own time.
                if let Some(mb) = task.mb {
                    self.task_time.insert(task.id, (mb.iter, c.took));
                    let grad = self.store.take(mb, Slot::GradIn);
                    self.give(WorkKind::Backward, Some(mb), grad, Pending::Task(task));
                }
            }
        }
    }

    fn task_done(&mut self, task: Task, out: Output, took: Duration) {
        let mb = task.mb;
        match (mb, out) {
            (Some(mb), Output::Tensor(f)) => {
                let slot = if task.kind == TaskKind::Backward {
                    Slot::GradOut
                } else {
                    Slot::Output
                };
                self.store.put(mb, task.attempt, slot, f);
                if task.kind == TaskKind::Forward && task.recompute {
                    // Only the input is kept: the trainer drops the rest.
                    self.give(WorkKind::Discard, Some(mb), None, Pending::Discard);
                }
            }
            (Some(mb), Output::Loss { loss, grad }) => {
                self.store.put(mb, task.attempt, Slot::GradOut, grad);
                self.log(format!(
                    "loss of {mb:?} (attempt {}): {loss:.4}",
                    task.attempt
                ));
                self.losses.insert(mb, loss);
            }
            _ => {}
        }
        if let Some(mb) = mb {
            let t = self
                .task_time
                .entry(task.id)
                .or_insert((mb.iter, Duration::ZERO));
            t.1 += took;
        }
        self.input(Input::TaskDone { id: task.id });
    }

    // ---- the all-reduce

    fn drive_aggregation(&mut self) {
        // Sending can find a peer gone, which aborts the operation and
        // queues aborts to send in turn.
        for _ in 0..4 {
            let t = Instant::now();
            let out = self.agg.outgoing(&self.net);
            self.waited(t, || "the all-reduce's frames (pool)".into());
            if out.is_empty() {
                break;
            }
            for (to, f) in out {
                match NodeId::try_from(to) {
                    Ok(id) => {
                        let t = Instant::now();
                        self.send_frame(id, f);
                        self.waited(t, || format!("an all-reduce frame to {id:x}"));
                    }
                    Err(_) => self.agg.on_peer_lost(to),
                }
            }
        }
        if let Some((task, iter, result)) = self.agg.finished() {
            match result {
                Ok((mean, microbatches)) => {
                    // The members agreed on the gradient's length: later
                    // answers of another length are refused at once.
                    self.port.agree_gradient_len(self.me.stage, mean.len());
                    self.means.insert(iter, (Arc::new(mean), microbatches));
                    self.input(Input::TaskDone { id: task });
                }
                // The coordinator commits again (without a lost member).
                Err(reason) => {
                    self.log(format!("all-reduce of iteration {iter}: {reason}"));
                    self.input(Input::TaskFailed { id: task });
                }
            }
        }
    }

    // ---- sending

    fn send(&mut self, to: NodeId, msg: Msg) {
        // A member's state, or a holder's copy restoring an emptied stage:
        // either download is timed from its request.
        if matches!(msg, Msg::StateRequest | Msg::KeptRequest { .. }) {
            self.state_asked.asked(to);
        }
        if matches!(msg, Msg::StateResponse { .. }) {
            match self.serving.admit(to, Instant::now()) {
                Admit::Export => {}
                Admit::OnItsWay => {
                    self.log(format!("a state for {to:x} is on its way already"));
                    return;
                }
                Admit::Queued => {
                    self.log(format!("a state for {to:x} waits for its turn"));
                    return;
                }
            }
            // The state goes out once the trainer has exported it (after
            // every update queued before this request).
            self.give(
                WorkKind::ExportState,
                None,
                None,
                Pending::Export { to, msg },
            );
            return;
        }
        if let Some(q) = self.pending.get_mut(&to) {
            if q.len() < PENDING_MAX {
                q.push_back(Out::Msg(msg));
            }
            return;
        }
        let data = if msg.is_bulk() {
            match self.bulk_data(&msg) {
                Ok(f) => Some(f),
                Err(e) => {
                    self.error(format!("no data for {} to {to:x}: {e}", msg.name()));
                    return;
                }
            }
        } else {
            None
        };
        self.send_now(to, msg, data);
    }

    /// Logs a wait of this thread in the engine (a full send queue, an
    /// exhausted pool) long enough to matter: it hears and sends nothing
    /// meanwhile, its own timers run late (fencing takes a wait beyond the
    /// suspicion time for a pause).
    fn waited(&self, since: Instant, what: impl FnOnce() -> String) {
        let w = since.elapsed();
        if w >= SLOW_WAIT {
            self.log(format!("waited {} ms for {}", w.as_millis(), what()));
        }
    }

    fn send_now(&mut self, to: NodeId, msg: Msg, data: Option<SharedFrame>) {
        let (t, name) = (Instant::now(), msg.name());
        self.send_now_inner(to, msg, data);
        self.waited(t, || format!("{name} to {to:x}"));
    }

    fn send_now_inner(&mut self, to: NodeId, msg: Msg, data: Option<SharedFrame>) {
        let env = match codec::encode(&msg) {
            Ok(env) => env,
            Err(e) => {
                self.error(format!("cannot encode {} for {to:x}: {e}", msg.name()));
                return;
            }
        };
        match self.net.send_control(to as u64, &env, SEND_WAIT) {
            Ok(()) => {
                if let Some(f) = data {
                    if let Err(e) = self.send_data(to, f, msg.name()) {
                        self.log(format!("data of {} to {to:x}: {e}", msg.name()));
                    }
                }
            }
            Err(EngineError::NotFound(_)) => self.connect(to, Out::Msg(msg)),
            Err(e) => {
                self.log(format!("send to {to:x}: {e}"));
                self.lost.push_back(to);
            }
        }
    }

    /// Sends a data frame of its own, connecting first if need be.
    fn send_frame(&mut self, to: NodeId, f: Frame) {
        if let Some(q) = self.pending.get_mut(&to) {
            if q.len() < PENDING_MAX {
                q.push_back(Out::Frame(f));
            }
            return;
        }
        if !self.net.is_connected(to as u64) {
            self.connect(to, Out::Frame(f));
            return;
        }
        if let Err(e) = self.send_data(to, f.into(), "an all-reduce chunk") {
            self.log(format!("all-reduce frame to {to:x}: {e}"));
            self.agg.on_peer_lost(to as u64);
        }
    }

    /// Queues data frame `f` to `to` without waiting: behind the frames
    /// already waiting for it, or in its backlog when its send queue is
    /// full ([`NodeLoop::flush_backlog`] sends it on).
    fn send_data(
        &mut self,
        to: NodeId,
        f: SharedFrame,
        what: &'static str,
    ) -> Result<(), EngineError> {
        if let Some(q) = self.backlog.get_mut(&to) {
            if q.len() >= BACKLOG_MAX {
                return Err(EngineError::Timeout(format!(
                    "{BACKLOG_MAX} data frames wait for room already"
                )));
            }
            q.push_back((f, what));
            return Ok(());
        }
        match self
            .net
            .send_shared(to as u64, f.header, &f, Duration::ZERO)
        {
            Err(EngineError::Timeout(_)) => {
                self.backlog.entry(to).or_default().push_back((f, what));
                Ok(())
            }
            r => r,
        }
    }

    /// Sends what waits in the backlogs as far as the peers' send queues
    /// have room; a peer gone takes its backlog with it.
    fn flush_backlog(&mut self) {
        if self.backlog.is_empty() {
            return;
        }
        let mut gone = Vec::new();
        for (&to, q) in self.backlog.iter_mut() {
            while let Some((f, what)) = q.front() {
                match self.net.send_shared(to as u64, f.header, f, Duration::ZERO) {
                    Ok(()) => {
                        q.pop_front();
                    }
                    Err(EngineError::Timeout(_)) => break,
                    Err(e) => {
                        gone.push((to, format!("{} frames ({what} first): {e}", q.len())));
                        break;
                    }
                }
            }
        }
        self.backlog.retain(|_, q| !q.is_empty());
        for (to, why) in gone {
            self.backlog.remove(&to);
            self.log(format!("dropped the data frames waiting for {to:x}: {why}"));
            self.agg.on_peer_lost(to as u64);
        }
    }

    /// Opens the connections an all-reduce among `members` will use.
    fn connect_all(&mut self, members: &[NodeId]) {
        let connected = self.net.peers();
        for &m in members {
            if m != self.me.id && !connected.contains(&(m as u64)) && !self.pending.contains_key(&m)
            {
                if let Some(p) = self.address_of(m) {
                    if self.net.connect(p.addr).is_ok() {
                        self.pending.entry(m).or_default();
                    }
                }
            }
        }
    }

    /// The data frame that follows a bulk message: the kept tensor itself
    /// (shared, not copied: the protocol may send it again, so it stays
    /// kept).
    fn bulk_data(&self, msg: &Msg) -> Result<SharedFrame, String> {
        let (microbatch, iteration) = bulk::header_fields(msg);
        let mut f: SharedFrame = match msg {
            Msg::Forward { mb, .. } | Msg::Backward { mb, .. } => {
                let slot = if matches!(msg, Msg::Forward { .. }) {
                    Slot::Output
                } else {
                    Slot::GradOut
                };
                self.store
                    .kept(*mb, slot)
                    .cloned()
                    .ok_or_else(|| format!("no {slot:?} tensor kept for {mb:?}"))?
            }
            _ => {
                let len = bulk::payload_len(msg, &self.cfg).min(self.net.options().max_payload);
                self.net
                    .alloc(len as usize, SEND_WAIT)
                    .map_err(|e| e.to_string())?
                    .into()
            }
        };
        f.header.stage = self.me.stage as u32;
        f.header.microbatch = microbatch;
        f.header.iteration = iteration;
        Ok(f)
    }

    /// Sends this stage's exported state as a copy (a holder's or a
    /// rebuilder's), of `version`, followed by its SHA-256 `digest`.
    fn send_copy(
        &mut self,
        to: NodeId,
        version: (u32, u64),
        state: Frame,
        digest: [u8; DIGEST_LEN],
    ) {
        let msg = Msg::StateResponse {
            version,
            members: Default::default(),
            bytes: 0,
            coord: self.me.id,
        };
        let stage = self.me.stage;
        self.send_digested(to, msg, state, digest, stage);
    }

    /// The holders' copies whose digest was taken since the last call:
    /// sent now.
    fn copies_sealed(&mut self) {
        for Sealed {
            to,
            version,
            state,
            digest,
        } in self.sealer.done()
        {
            self.send_copy(to, version, state, digest);
        }
    }

    /// Sends the exported state, followed by its SHA-256.
    fn send_state(&mut self, to: NodeId, msg: Msg, state: Frame, stage: Stage) {
        let d = serving::state_digest(&state);
        self.send_digested(to, msg, state, d, stage);
    }

    /// [`NodeLoop::send_state`] with the state's digest `d` taken.
    fn send_digested(
        &mut self,
        to: NodeId,
        msg: Msg,
        state: Frame,
        d: [u8; DIGEST_LEN],
        stage: Stage,
    ) {
        let (n, t) = (state.len(), Instant::now());
        // A copy only where the digest does not fit the state's slot: a
        // full pool is not waited for (this thread would hear nothing).
        let f = serving::append_digest(state, d, |len| self.net.alloc(len, COPY_WAIT));
        self.waited(t, || "the state's digest".into());
        let mut f = match f {
            Ok(f) => f,
            Err(e) => {
                // Its request again (a joiner's next source, a retry) is
                // served afresh.
                self.serving.failed(to);
                self.log(format!("cannot send the state ({n} bytes) to {to:x}: {e}"));
                return;
            }
        };
        let msg = match msg {
            Msg::StateResponse {
                version,
                members,
                coord,
                ..
            } => Msg::StateResponse {
                version,
                members,
                bytes: (n + DIGEST_LEN) as u64,
                coord,
            },
            m => m,
        };
        let (microbatch, iteration) = bulk::header_fields(&msg);
        f.header.stage = stage as u32;
        f.header.microbatch = microbatch;
        f.header.iteration = iteration;
        let f = SharedFrame::from(f);
        if !self.net.is_connected(to as u64) {
            self.serving.failed(to);
            self.log(format!(
                "the state for {to:x} not sent: it is not connected"
            ));
            return;
        }
        self.serving.sending(to, f.clone());
        // The message, then its bytes in chunks (`state_stream`): the other
        // data frames to `to` go between them.
        self.send_now(to, msg, None);
        self.state_sender.start(to, f);
        self.pump_states();
    }

    /// Queues the next chunk of the states being sent where the peer's
    /// data lane is empty.
    fn pump_states(&mut self) {
        if self.state_sender.is_empty() {
            return;
        }
        for (to, why) in self.state_sender.pump(&self.net) {
            self.serving.failed(to);
            self.log(format!("the state for {to:x} went no further: {why}"));
        }
    }

    /// Opens a connection to `to` and keeps `first` until it is up.
    fn connect(&mut self, to: NodeId, first: Out) {
        // Two nodes dialling each other at once make two connections; the
        // engine keeps one and winds the other down without losing what
        // travelled on it.
        match self.address_of(to) {
            Some(p) => {
                if self.net.connect(p.addr).is_ok() {
                    self.pending.entry(to).or_default().push_back(first);
                } else {
                    self.lost.push_back(to);
                }
            }
            None => {
                if !self.address_waits.contains_key(&to) {
                    self.log(format!("no address for {to:x} yet"));
                    self.address_waits.insert(to, Instant::now() + ADDRESS_WAIT);
                }
                self.pending.entry(to).or_default().push_back(first);
            }
        }
    }

    /// Whether `id` is in the directory; a peer whose broken connection
    /// took it out and that connects again is put back (what it sends may
    /// overtake its directory message: its queued messages go out as soon
    /// as the connection is up).
    fn known(&mut self, id: NodeId) -> bool {
        if let Some(p) = self.last_known.remove(&id) {
            self.dir.insert(id, p);
        }
        self.dir.contains_key(&id)
    }

    /// Where to dial `id`: its directory entry, or the last one known.
    fn address_of(&self, id: NodeId) -> Option<&Peer> {
        self.dir.get(&id).or_else(|| self.last_known.get(&id))
    }

    // ---- receiving

    /// A directory message: its sender's own entry is taken in (or
    /// updated), others only when new; entries naming a stage this swarm
    /// does not have, or contradicting the protocol's view, are refused.
    fn on_directory(&mut self, from: NodeId, body: &[u8]) {
        let checked = directory::parse(body).and_then(|peers| {
            let members = self.node.stage_members();
            let last = self.cfg.relay_stages;
            intake::check_directory(from, peers, last, self.me.stage, &members)
        });
        let (peers, refused) = match checked {
            Ok(c) => c,
            Err(e) => {
                self.refuse_and_cut(
                    from,
                    Refusal::Message,
                    format!("a directory from {from:x}: {e}"),
                );
                return;
            }
        };
        for e in refused {
            self.refuse(Some(from), Refusal::Stage, e);
        }
        self.strangers.remove(&from);
        let mut news = Vec::new();
        for p in peers {
            if p.id == self.me.id {
                continue;
            }
            let known = self.dir.get(&p.id);
            // A joiner's entry learns its stage from whoever knows it.
            let staged = known
                .is_some_and(|k| k.stage == directory::NO_STAGE && p.stage != directory::NO_STAGE);
            if known.is_none() || staged || (p.id == from && known != Some(&p)) {
                news.push(p.clone());
                self.last_known.remove(&p.id);
                self.dir.insert(p.id, p);
            }
        }
        self.pass_on_directory(from, &news);
        // The protocol hears where they serve: a node of its own stage in
        // another group, or of a neighbouring stage it never heard of, is
        // introduced to (two joiners that took up an emptied stage at once
        // find each other only so).
        if self.joining.is_none() {
            for p in news.iter().filter(|p| p.stage != directory::NO_STAGE) {
                let (peer, stage) = (p.id, p.stage);
                self.input(Input::Located { peer, stage });
            }
        }
        if self.joining.is_some() && self.dir.contains_key(&from) {
            self.join_now();
        }
    }

    /// Tells the connected peers (but `from` and the news themselves) of
    /// peers new to this node: a member that has never talked to a joiner
    /// can still reach it when the protocol names it (an all-reduce ring,
    /// a recovery). Each node passes an entry on once, so it spreads once.
    fn pass_on_directory(&mut self, from: NodeId, news: &[Peer]) {
        if news.is_empty() {
            return;
        }
        let env = directory::message(&self.me, news.iter());
        for peer in self.net.peers() {
            let skip = peer == from as u64 || news.iter().any(|p| p.id as u64 == peer);
            if !skip {
                let _ = self.net.send_control(peer, &env, SEND_WAIT);
            }
        }
    }

    /// This node's stage changed (a joiner's was chosen): its entry goes
    /// to every connected peer, which passes it on once, so that a later
    /// joiner learns from any bootstrap peer where this node serves (and
    /// introduces itself to it when it is a neighbour).
    fn announce_stage(&mut self) {
        let env = directory::message(&self.me, std::iter::empty());
        for peer in self.net.peers() {
            let _ = self.net.send_control(peer, &env, SEND_WAIT);
        }
    }

    /// Joins through every peer the directory knows.
    pub(super) fn join_now(&mut self) {
        self.joining = None;
        self.log(format!("joining through {} known peers", self.dir.len()));
        let peers = self
            .dir
            .values()
            .filter(|p| p.stage != directory::NO_STAGE)
            .map(|p| (p.id, p.stage))
            .collect();
        self.input(Input::Join { peers });
    }

    fn on_net(&mut self, ev: TransportEvent) {
        match ev {
            TransportEvent::PeerConnected { peer, .. } => {
                if self.agg.on_peer_back(peer) {
                    self.drive_aggregation();
                }
                if let Ok(id) = NodeId::try_from(peer) {
                    self.suspects.remove(&id);
                    self.address_waits.remove(&id);
                    self.cut_off.remove(&id);
                }
                let env = directory::message(&self.me, self.dir.values());
                let _ = self.net.send_control(peer, &env, SEND_WAIT);
                let Ok(id) = NodeId::try_from(peer) else {
                    let _ = self.net.disconnect(peer);
                    return;
                };
                if let Some(q) = self.pending.remove(&id) {
                    for o in q {
                        match o {
                            Out::Msg(m) => self.send(id, m),
                            Out::Frame(f) => self.send_frame(id, f),
                        }
                    }
                }
            }
            TransportEvent::PeerLost { peer, .. } => {
                // Lost, unless it connects again at once (a connection that
                // broke while both ends live, e.g. on a frame timeout).
                self.agg.on_link_broken(peer);
                if let Ok(id) = NodeId::try_from(peer) {
                    self.state_sender.forget(id);
                    self.state_receiver.forget(id);
                    self.rest_lost(id, "its connection broke");
                    if let Some(q) = self.backlog.remove(&id) {
                        self.log(format!(
                            "{} data frames waiting for {id:x} dropped with its connection",
                            q.len()
                        ));
                    }
                    if self.pending.contains_key(&id) {
                        // What waits for it was queued for a connection
                        // dialled after this one broke (a node waking from
                        // a pause sends before it reads that its old
                        // connections closed): dialled again, so that it
                        // goes out, or fails with the dial.
                        match self.address_of(id).map(|p| p.addr) {
                            Some(addr) if self.net.connect(addr).is_ok() => {}
                            _ => {
                                self.pending.remove(&id);
                            }
                        }
                    }
                    self.pairing.forget(id);
                    self.strangers.remove(&id);
                    // A peer never in the directory (cut off as a
                    // stranger) was never heard by the protocol.
                    if self.dir.contains_key(&id) {
                        self.suspects.insert(id, Instant::now() + LOST_GRACE);
                    }
                }
            }
            TransportEvent::ConnectFailed {
                addr,
                attempts,
                reason,
            } => {
                self.log(format!(
                    "cannot reach {addr} after {attempts} attempts: {reason}"
                ));
                self.emit(NodeEvent::ConnectFailed {
                    addr,
                    attempts,
                    reason,
                });
                self.dial_failed(addr);
            }
            TransportEvent::Control { peer, msg } => {
                let Ok(from) = NodeId::try_from(peer) else {
                    return;
                };
                if self.cut_off.contains(&from) {
                    return;
                }
                if msg.msg_type == DIRECTORY_MSG {
                    self.on_directory(from, &msg.body);
                    return;
                }
                if !self.known(from) {
                    let what = codec::decode(&msg).map_or("an undecodable message", |m| m.name());
                    let e = format!("{what} from {from:x}, which is not in the swarm's directory");
                    self.refuse_and_cut(from, Refusal::Stranger, e);
                    return;
                }
                let decoded = codec::decode(&msg);
                if let Some(claim) = decoded.as_ref().ok().and_then(intake::stage_claim) {
                    let mut members = self.node.stage_members();
                    let last = self.cfg.relay_stages;
                    if intake::left_for_another_stage(from, claim, last, self.me.stage, &members) {
                        // A member says it serves another stage now: it
                        // fenced itself and joined that one. It left this
                        // node's group (as with a goodbye); its message is
                        // taken. Only a third party's word about a member
                        // (a directory entry) is refused.
                        self.log(format!(
                            "member {from:x} serves stage {claim} now: it left the group"
                        ));
                        self.agg.on_peer_lost(from as u64);
                        self.drive_aggregation();
                        self.input(Input::Message {
                            from,
                            msg: Msg::Goodbye,
                        });
                        members.retain(|&m| m != from);
                    }
                    if let Err(e) = intake::check_stage(from, claim, last, self.me.stage, &members)
                    {
                        let name = decoded.as_ref().map_or("", |m| m.name());
                        self.refuse(Some(from), Refusal::Stage, format!("{name}: {e}"));
                        return;
                    }
                }
                match decoded {
                    Ok(m) if m.is_bulk() => {
                        if let Msg::StateResponse { bytes, .. } = &m {
                            // Its chunks that came first go on now, whole
                            // only: weights handed on before the message is
                            // in would wait for it while the rest came.
                            for f in self.state_receiver.expect(from, *bytes) {
                                self.on_bulk_frame(from, f, false);
                            }
                        }
                        if let (Msg::StateResponse { bytes, .. }, Some(r)) =
                            (&m, self.resync.as_mut())
                        {
                            // Its data is on the way (control messages go
                            // ahead of data): no new request before it could
                            // have come at the slowest rate a frame may take.
                            let allowance = RESYNC_RETRY + state_transfer_allowance(*bytes);
                            r.retry_at = r.retry_at.max(Instant::now() + allowance);
                        }
                        let key = bulk::key_of_msg(from, &m);
                        if let Some((m, data)) = self.pairing.on_msg(key, m) {
                            self.on_bulk(from, m, data);
                        }
                    }
                    Ok(Msg::CopyRequest { iteration }) => self.serve_copy(from, iteration),
                    Ok(Msg::KeptRequest { stage }) => self.serve_kept(from, stage),
                    Ok(Msg::RebuildRequest { stage }) => self.serve_rebuild(from, stage),
                    Ok(m) => {
                        if matches!(m, Msg::Goodbye) {
                            // A peer that leaves or fences itself keeps its
                            // connection open for a while (or for good, if
                            // it joins again): the all-reduce in progress
                            // must not wait for its part until then.
                            self.agg.on_peer_lost(from as u64);
                            self.drive_aggregation();
                        } else {
                            // Heard again after a goodbye (a fenced node
                            // that joins again): a commit may count on it.
                            if self.agg.on_peer_back(from as u64) {
                                self.drive_aggregation();
                            }
                        }
                        self.input(Input::Message { from, msg: m })
                    }
                    Err(e) => {
                        let e = format!("a message from {from:x}: {e}");
                        self.refuse_and_cut(from, Refusal::Message, e);
                    }
                }
            }
            TransportEvent::Refused {
                addr,
                inbound,
                reason,
            } => {
                let way = if inbound { "from" } else { "to" };
                let e = format!("a connection {way} {addr}: {reason}");
                self.refuse(None, Refusal::Connection, e);
                if !inbound {
                    // A dial whose handshake failed (the peer was paused
                    // meanwhile) is not retried by the engine: what waited
                    // for it would wait for ever, and every later message
                    // to that peer behind it.
                    self.dial_failed(addr);
                }
            }
        }
    }

    /// A dial to `addr` failed for good: what waited for it is dropped and
    /// the peer lost (the protocol recovers what went through it; a later
    /// message to it dials again).
    fn dial_failed(&mut self, addr: std::net::SocketAddr) {
        let ids: Vec<NodeId> = (self.dir.values())
            .chain(self.last_known.values())
            .filter(|p| p.addr == addr)
            .map(|p| p.id)
            .collect();
        for id in ids {
            if self.pending.remove(&id).is_some() {
                self.agg.on_peer_lost(id as u64);
                self.drive_aggregation();
                self.input(Input::PeerLost { peer: id });
            }
        }
    }

    /// A data frame: an all-reduce chunk, or the second half of a bulk
    /// message.
    fn on_frame(&mut self, f: Frame) {
        let Ok(from) = NodeId::try_from(f.peer()) else {
            return;
        };
        if self.cut_off.contains(&from) {
            return;
        }
        if !self.known(from) {
            // Its directory may be among the control messages read with
            // this frame; a frame never reaches the protocol without a
            // message, which strangers do not get past.
            let due = Instant::now() + STRANGER_GRACE;
            self.strangers.entry(from).or_insert(due);
        }
        let want_state = !self.node.is_active()
            || self.resync.is_some()
            || self.rest.as_ref().is_some_and(|r| r.from == from)
            || self.state_asked.awaits(from)
            || self.copies.awaits(from);
        let sizes = self.port.sizes();
        match intake::check_frame(
            &f.header,
            f.len(),
            self.me.stage,
            &self.cfg,
            sizes,
            want_state,
        ) {
            Err(e) => self.refuse_and_cut(from, Refusal::Frame, format!("{e} from {from:x}")),
            Ok(FrameUse::AllReduce) => {
                self.agg.on_frame(f);
                self.drive_aggregation();
            }
            Ok(FrameUse::Bulk) => self.on_bulk_frame(from, f, true),
        }
    }

    /// A data frame that goes with a message: a state's chunk is put
    /// together with the others first (`state_stream`).
    fn on_bulk_frame(&mut self, from: NodeId, f: Frame, weights_first: bool) {
        let f = if bulk::is_state_frame(&f.header) {
            let net = &self.net;
            let rule = self.weights_rule(from).filter(|_| weights_first);
            let rule = rule.as_ref().map(|r| r as state_stream::WeightsRule);
            match (self.state_receiver).chunk(from, rule, f, |len| net.alloc(len, COPY_WAIT)) {
                Ok(Received::Whole(whole)) => whole,
                Ok(Received::Weights(weights)) => {
                    self.weights_came = Some(from);
                    weights
                }
                Ok(Received::Nothing) => return,
                Ok(Received::Rest(whole)) => {
                    self.on_rest(from, whole);
                    return;
                }
                Err(ChunkError::NoRoom(e)) => {
                    // Asked for again (a joiner's retry, a resync's).
                    self.log(format!("the state from {from:x} dropped: {e}"));
                    self.rest_lost(from, &e);
                    return;
                }
                Err(ChunkError::Refused(e)) => {
                    // Refused, not cut off: chunks split over a
                    // connection and its duplicate come out of
                    // order. The state is asked for again.
                    let e = format!("the state from {from:x}: {e}");
                    self.rest_lost(from, &e);
                    self.refuse(Some(from), Refusal::State, e);
                    return;
                }
            }
        } else {
            f
        };
        let key = bulk::key_of_frame(from, f.header.microbatch, f.header.iteration);
        let dropped = self.pairing.dropped;
        if let Some((msg, data)) = self.pairing.on_data(key, f) {
            self.on_bulk(from, msg, data);
        } else if self.pairing.dropped > dropped {
            let e = format!(
                "a data frame from {from:x}: {} of its frames wait for their messages already",
                bulk::DATA_WAITING_MAX
            );
            self.refuse_and_cut(from, Refusal::Flood, e);
        }
    }

    /// A bulk message with its data: keep the tensor, then tell the protocol.
    fn on_bulk(&mut self, from: NodeId, msg: Msg, data: Frame) {
        let weights_only = matches!(msg, Msg::StateResponse { .. })
            && self.weights_came.take_if(|&mut w| w == from).is_some();
        if let Msg::StateResponse { bytes, .. } = &msg {
            if self.node.rebuild_awaits(from) {
                // A neighbour's state to rebuild an emptied stage from.
                if self.keep_neighbour_state(from, *bytes, data) {
                    self.input(Input::Message { from, msg });
                }
                return;
            }
        }
        match &msg {
            Msg::StateResponse { version, bytes, .. }
                if self.copies.awaits(from) && data.header.stage != self.me.stage as u32 =>
            {
                self.keep_copy(from, *version, *bytes, data);
                return;
            }
            // Its size was checked on arrival (`intake::check_frame`).
            Msg::Forward { mb, attempt, .. } => {
                self.store.put(*mb, *attempt, Slot::Input, data);
            }
            Msg::Backward { mb, attempt, .. } => {
                self.store.put(*mb, *attempt, Slot::GradIn, data);
            }
            Msg::StateResponse { .. }
                if self.node.is_active()
                    && self.resync.is_none()
                    && self.state_asked.answered(from).is_some() =>
            {
                // Asked for, and no longer needed (a retry's answer came
                // first): dropped, its slot back to the pool.
                self.log(format!("a state from {from:x} no longer needed: dropped"));
            }
            Msg::StateResponse { .. }
                if (!self.node.is_active()
                    && self.resync.is_none()
                    && self.node.downloading_from() != Some(from))
                    || data.header.stage != self.node.stage() as u32 =>
            {
                // Not the download this node waits for: one asked before
                // a fence, of the stage it served then (importing it in
                // another stage failed the trainer), or of a source it
                // gave up.
                self.state_asked.answered(from);
                self.log(format!(
                    "a state of stage {} from {from:x} not waited for: dropped",
                    data.header.stage
                ));
                return;
            }
            Msg::StateResponse { version, bytes, .. }
                if weights_only && !self.node.is_active() && self.resync.is_none() =>
            {
                // Its weights, the rest to come (`on_rest`). Each frame's
                // tag checked them as they came; the state's hash checks
                // them again with the rest.
                let asked = self.state_asked.answered(from);
                let applied = match self.node.restore_applied(*version) {
                    Some(a) => Some(a),
                    None => (*version != (0, 0)).then_some(version.0),
                };
                self.log(format!(
                    "the weights of the state from {from:x} came ({} of {bytes} bytes): \
                     computing on them while the rest comes",
                    data.len()
                ));
                let now = Instant::now();
                self.rest = Some(RestAwaited {
                    from,
                    bytes: *bytes,
                    asked: asked.unwrap_or(now),
                    weights_at: now,
                    applied,
                    iteration: version.0,
                    held: VecDeque::new(),
                });
                self.give(
                    WorkKind::ImportWeights { applied },
                    None,
                    Some(data),
                    Pending::ImportWeights,
                );
            }
            Msg::StateResponse { version, bytes, .. }
                if !self.node.is_active() || self.resync.is_some() =>
            {
                let asked = self.state_asked.answered(from);
                match self.verify_state(data, *bytes) {
                    Ok(state) => {
                        let bytes = state.len();
                        let verified = Instant::now();
                        let p = Pending::Import {
                            from,
                            bytes,
                            // An answer not asked for (a server's own
                            // push after a fence) is timed from now.
                            asked: asked.unwrap_or(verified),
                            verified,
                            iteration: version.0,
                            weights_at: None,
                        };
                        // Version (0, 0): nothing applied yet in this swarm.
                        // A kept copy restoring an emptied stage stands for
                        // the iteration before the one in progress.
                        let applied = match self.node.restore_applied(*version) {
                            Some(a) => Some(a),
                            None => (*version != (0, 0)).then_some(version.0),
                        };
                        let kind = WorkKind::ImportState { applied };
                        self.give(kind, None, Some(state), p);
                    }
                    Err(e) => {
                        // A cut or corrupted download: its server is cut
                        // off, and lost to the protocol, which asks another
                        // member (a joiner) or the coordinator again (a
                        // node that missed an update).
                        let e = format!("the state from {from:x}: {e}");
                        self.refuse_and_cut(from, Refusal::State, e);
                        return;
                    }
                }
            }
            _ => {}
        }
        self.input(Input::Message { from, msg });
    }

    /// Peers whose connection broke and did not come back in time are lost.
    fn connections_due(&mut self) {
        let now = Instant::now();
        for id in due(&self.strangers, now) {
            let e = format!(
                "data frames from {id:x}, which is not in the swarm's directory {} s on",
                STRANGER_GRACE.as_secs()
            );
            self.refuse_and_cut(id, Refusal::Stranger, e);
        }
        for id in due(&self.suspects, now) {
            self.suspects.remove(&id);
            self.copies.gone(id);
            if self.state_asked.gone(id) {
                // The state it was sending will not come: ask again now.
                if let Some(r) = self.resync.as_mut() {
                    r.retry_at = now;
                }
            }
            // Not passed on to joiners in directory messages any more,
            // but still dialled if the protocol sends to it again.
            if let Some(p) = self.dir.remove(&id) {
                self.last_known.insert(id, p);
            }
            self.agg.on_peer_lost(id as u64);
            self.serving.lost(id);
            self.drive_aggregation();
            self.emit(NodeEvent::PeerLost { peer: id });
            self.input(Input::PeerLost { peer: id });
        }
        // What waits for a connection that is up (it came up before the
        // wait began, or as a duplicate the engine merged) goes now.
        if !self.pending.is_empty() {
            let connected = self.net.peers();
            let ready: Vec<NodeId> = self
                .pending
                .keys()
                .copied()
                .filter(|id| connected.contains(&(*id as u64)))
                .collect();
            for id in ready {
                for o in self.pending.remove(&id).unwrap_or_default() {
                    match o {
                        Out::Msg(m) => self.send(id, m),
                        Out::Frame(f) => self.send_frame(id, f),
                    }
                }
            }
        }
        for id in due(&self.address_waits, now) {
            self.address_waits.remove(&id);
            if self.pending.contains_key(&id) && !self.net.is_connected(id as u64) {
                let ok = self
                    .address_of(id)
                    .is_some_and(|p| self.net.connect(p.addr).is_ok());
                if !ok {
                    self.pending.remove(&id);
                    self.lost.push_back(id);
                }
            }
        }
    }

    /// Tells the protocol which peers sent bytes since it was last told
    /// (liveness counts any bytes, not only messages: a heartbeat queued
    /// behind a state streaming over a slow link arrives seconds late, and
    /// its sender was taken for silent). Peers cut off are not heard.
    fn tell_bytes_heard(&mut self) {
        let now = Instant::now();
        if self.rx_told.is_some_and(|t| now < t + RX_TELL_EVERY) {
            return;
        }
        self.rx_told = Some(now);
        let mut heard = Vec::new();
        let mut seen = HashMap::with_capacity(self.rx_seen.len());
        for (peer, bytes) in self.net.received_from() {
            let Ok(id) = NodeId::try_from(peer) else {
                continue;
            };
            if bytes > 0 && self.rx_seen.get(&id) != Some(&bytes) && !self.cut_off.contains(&id) {
                heard.push(id);
            }
            seen.insert(id, bytes);
        }
        self.rx_seen = seen;
        if !heard.is_empty() {
            heard.sort_unstable();
            self.input(Input::Heard { peers: heard });
        }
    }

    /// A holder applied the update of `iter`: a checkpoint round opens
    /// (its own state exported now, before any later update) when one is
    /// due, and copies of the relay stages' states of `iter` are asked for
    /// when copies or a checkpoint are due.
    fn holder_rounds(&mut self, iter: u32) {
        let (keep, save) = (self.cfg.keep_states_every, self.cfg.save_every);
        let saving = Copies::due(iter, save);
        if saving {
            for it in self.saves.open(iter) {
                let why = "a stage's copy of that iteration did not come in time".to_string();
                self.checkpoint_dropped(it, why);
            }
            let p = Pending::SaveOwn { iteration: iter };
            self.give(WorkKind::ExportState, None, None, p);
        }
        if saving || Copies::due(iter, keep) {
            let every = [keep, save]
                .into_iter()
                .filter(|&k| k > 0)
                .min()
                .unwrap_or(1);
            let missed = self.ask_copies(iter, iter / every, saving);
            if saving && !missed.is_empty() {
                // The round cannot complete: said now, not after a wait.
                self.saves.close(iter);
                let why = format!("no member of stage(s) {missed:?} could be asked for a copy");
                self.checkpoint_dropped(iter, why);
            }
        }
    }

    /// The checkpoint round of `iteration` will not complete.
    fn checkpoint_dropped(&mut self, iteration: u32, why: String) {
        self.log(format!(
            "the checkpoint of iteration {iteration} is dropped: {why}"
        ));
        self.emit(NodeEvent::CheckpointDropped { iteration, why });
    }

    /// A state of the checkpoint round of `iteration` is in: the round is
    /// handed on once every stage's is.
    fn saved(&mut self, iteration: u32, s: SavedState) {
        if let Some(states) = self.saves.add(iteration, s, self.cfg.relay_stages) {
            self.emit(NodeEvent::Checkpoint { iteration, states });
        }
    }

    /// A holder that applied the update of `iter` asks one member of each
    /// relay stage (the `round`-th in turn, or the next one not busy with
    /// an earlier request of ours) for a copy of its state after that
    /// update (`copies.rs`): of every stage for a checkpoint (`all`),
    /// else of the stages this holder keeps this round
    /// ([`Copies::keeps`]). Returns the stages none could be asked of.
    fn ask_copies(&mut self, iter: u32, round: u32, all: bool) -> Vec<Stage> {
        let now = Instant::now();
        let holders: Vec<NodeId> = (self.dir.values())
            .filter(|p| p.stage == 0 && (p.id == self.me.id || self.net.is_connected(p.id as u64)))
            .map(|p| p.id)
            .collect();
        let rank = holders.iter().position(|&h| h == self.me.id).unwrap_or(0);
        let mut missed = Vec::new();
        for stage in 1..=self.cfg.relay_stages {
            if !all && !Copies::keeps(stage, rank, holders.len(), round) {
                continue;
            }
            let members: Vec<NodeId> = (self.dir.values())
                .filter(|p| p.stage == stage && self.net.is_connected(p.id as u64))
                .map(|p| p.id)
                .collect();
            let picked = (0..members.len() as u32)
                .filter_map(|k| Copies::pick(&members, rank, round + k))
                .find(|&m| self.copies.may_ask(m, now));
            let Some(m) = picked else {
                self.log(format!(
                    "no member of stage {stage} to copy its state from now"
                ));
                missed.push(stage);
                continue;
            };
            self.copies.asked(m, stage, now);
            self.send(m, Msg::CopyRequest { iteration: iter });
        }
        missed
    }

    /// A holder asks for a copy of this node's stage's state after the
    /// update of `iteration`: exported right after that update (at once
    /// when it is in) and sent like a joiner's download, when this node
    /// serves its stage (else the holder asks again later); with no room
    /// among the states it serves, once a state served is out.
    fn serve_copy(&mut self, from: NodeId, iteration: u32) {
        let holder = self.dir.get(&from).is_some_and(|p| p.stage == 0);
        if !holder {
            let e = format!("a copy request from {from:x}, which is not a data holder");
            self.refuse(Some(from), Refusal::Message, e);
            return;
        }
        if self.me.stage == 0 || !self.node.is_active() || self.resync.is_some() {
            self.log(format!(
                "a copy request from {from:x} not served: this node holds no stage state now"
            ));
            return;
        }
        self.copy_after.retain(|&(h, _)| h != from);
        if self.applied_through.is_some_and(|a| a >= iteration) && self.export_copy(from) {
            return;
        }
        if self.copy_after.len() < COPY_REQUESTS_WAITING_MAX {
            self.copy_after.push((from, iteration));
        }
    }

    /// The copy requests waiting for an update given now, or for room
    /// among the states this node serves.
    fn copies_after_update(&mut self) {
        let Some(a) = self.applied_through else {
            return;
        };
        if !self.copy_after.iter().any(|&(_, it)| it <= a) {
            return;
        }
        let (due, wait): (Vec<_>, Vec<_>) =
            (self.copy_after.drain(..)).partition(|&(_, it)| it <= a);
        self.copy_after = wait;
        for (holder, it) in due {
            if !self.export_copy(holder) {
                // Asked again when a state served is out (the run loop).
                self.copy_after.push((holder, it));
            }
        }
    }

    /// Exports this node's state for holder `to` (after every update given
    /// so far) when it has room to serve it; false when it has none now.
    fn export_copy(&mut self, to: NodeId) -> bool {
        if !self.serving.has_room(to, Instant::now()) {
            return false;
        }
        self.serving.admit(to, Instant::now());
        self.export_copy_for(to, true);
        true
    }

    /// Exports this node's state now and sends it to `to` (admitted) as
    /// a copy: a holder's (its digest taken in the `background`), or a
    /// rebuilder's.
    pub(super) fn export_copy_for(&mut self, to: NodeId, background: bool) {
        let version = self.node.version();
        let p = Pending::Copy {
            to,
            version,
            background,
        };
        self.give(WorkKind::ExportState, None, None, p);
    }

    /// A joiner restoring emptied `stage` asks for the copy of its state
    /// this holder keeps: sent like a state download (its version, no
    /// members), or answered that there is none. Served even when other
    /// states are (training waits for the stage), never twice at once.
    fn serve_kept(&mut self, to: NodeId, stage: Stage) {
        let copy = {
            let k = self.shared.kept.lock().unwrap_or_else(|e| e.into_inner());
            k.get(&stage).map(|c| (c.version, c.state.len()))
        };
        let Some((version, n)) = copy else {
            self.send(
                to,
                Msg::KeptInfo {
                    stage,
                    iteration: None,
                    open_iter: 0,
                },
            );
            return;
        };
        if !self.serving.admit_urgent(to, Instant::now()) {
            self.log(format!(
                "the copy of stage {stage} for {to:x} is on its way already"
            ));
            return;
        }
        let mut f = match self.net.alloc(n, COPY_WAIT) {
            Ok(f) => f,
            Err(e) => {
                self.serving.failed(to);
                self.log(format!(
                    "cannot send the copy of stage {stage} to {to:x}: {e}"
                ));
                return;
            }
        };
        {
            let k = self.shared.kept.lock().unwrap_or_else(|e| e.into_inner());
            match k.get(&stage) {
                Some(c) if c.state.len() == n => f.payload_mut().copy_from_slice(&c.state),
                // Replaced meanwhile by one of another size: asked again.
                _ => {
                    drop(k);
                    self.serving.failed(to);
                    return;
                }
            }
        }
        self.log(format!(
            "sending the copy of stage {stage} (iteration {}) to {to:x}, restoring it",
            version.0
        ));
        let msg = Msg::StateResponse {
            version,
            members: Default::default(),
            bytes: 0,
            coord: self.me.id,
        };
        self.send_state(to, msg, f, stage);
    }

    /// A holder's copy of a relay stage's state came from `from`.
    fn keep_copy(&mut self, from: NodeId, version: (u32, u64), announced: u64, data: Frame) {
        let Some((stage, asked)) = self.copies.answered(from) else {
            return;
        };
        if data.header.stage != stage as u32 {
            let e = format!(
                "a copy of stage {}'s state from {from:x}, asked for stage {stage}",
                data.header.stage
            );
            self.refuse_and_cut(from, Refusal::State, e);
            return;
        }
        let head = CopyHead {
            from,
            stage,
            version,
            asked,
        };
        self.verifier.start(head, data, announced);
    }

    /// The copies checked off this thread since the last call: each kept
    /// (and added to its checkpoint round), or refused.
    fn copies_checked(&mut self) {
        for Verified { head, state } in self.verifier.done() {
            let CopyHead {
                from,
                stage,
                version,
                asked,
            } = head;
            let state = match state {
                Ok(s) => s,
                Err(e) => {
                    let e = format!("a copy of stage {stage}'s state from {from:x}: {e}");
                    self.refuse_and_cut(from, Refusal::State, e);
                    continue;
                }
            };
            let ms = asked.elapsed().as_secs_f64() * 1e3;
            let copy = KeptState {
                version,
                from,
                state,
            };
            if self.saves.is_open(version.0) {
                let s = SavedState {
                    stage,
                    from,
                    state: copy.state.clone(),
                };
                self.saved(version.0, s);
            }
            let bytes = copy.state.len() as u64;
            let kept = {
                let mut k = self.shared.kept.lock().unwrap_or_else(|e| e.into_inner());
                super::copies::keep(&mut k, stage, copy)
            };
            if kept {
                self.node.copy_kept(stage, version.0);
                self.emit(NodeEvent::CopyKept {
                    stage,
                    iteration: version.0,
                    version: version.1,
                    from,
                    bytes,
                    ms,
                });
            }
        }
    }

    /// Checks the length (`announced`, the message's) and the digest at
    /// the end of a state transfer, and strips the digest.
    pub(super) fn verify_state(&self, f: Frame, announced: u64) -> Result<Frame, String> {
        serving::verify_state(f, announced)
    }

    pub(super) fn run(&mut self, first: Option<Input>) {
        if let Some(first) = first {
            self.input(first);
        }
        let mut leaving = false;
        while !self.shared.stop.load(Ordering::SeqCst) && !self.failed {
            if self.joining.is_some_and(|t| Instant::now() >= t) {
                self.join_now();
            }
            self.connections_due();
            while let Some(id) = self.lost.pop_front() {
                self.input(Input::PeerLost { peer: id });
            }
            if !leaving && self.leave_rx.try_recv().is_ok() {
                leaving = true;
                self.input(Input::Leave);
            }
            self.on_completions();
            if !self.copy_after.is_empty() {
                self.copies_after_update();
            }
            if let Some(to) = self.serving.next_turn(Instant::now()) {
                // Its request, put to the protocol again: the answer
                // describes the state exported now.
                self.input(Input::Message {
                    from: to,
                    msg: Msg::StateRequest,
                });
            }
            if self
                .resync
                .as_ref()
                .is_some_and(|r| Instant::now() >= r.retry_at)
            {
                let v = self.node.version().0;
                self.start_resync(v);
            }
            self.tell_bytes_heard();
            self.flush_backlog();
            self.pump_states();
            self.copies_checked();
            self.copies_sealed();
            for (iteration, s) in self.own_saved.done() {
                self.saved(iteration, s);
            }
            let now = self.now();
            if let Some(t) = self.node.timeout() {
                if t <= now {
                    let actions = self.node.on_timeout(now);
                    self.perform(actions);
                    continue;
                }
            }
            if leaving && !self.node.is_active() {
                // Goodbyes are queued; the engine sends them at shutdown.
                return;
            }
            // Wait for the network or the trainer's next answer, but not
            // past the next timer.
            let until_timer = self.node.timeout().map_or(Duration::from_millis(20), |t| {
                Duration::from_micros(t.saturating_sub(now))
            });
            let wait = until_timer.min(Duration::from_millis(20));
            let mut next = self.net.next_incoming_or_wake(self.port.answers(), wait);
            while let Some(incoming) = next {
                match incoming {
                    Incoming::Event(ev) => self.on_net(ev),
                    Incoming::Frame(f) => self.on_frame(f),
                }
                next = self.net.next_incoming(Duration::ZERO);
            }
        }
    }
}
