//! `gwtf_peer`: a swarm member whose model is the caller's. The library
//! runs everything that is not the model (membership, routing, transport,
//! crash recovery, aggregation, state transfer: `crate::swarm::runtime`);
//! the trainer pulls tasks and events from it and answers each task.
//!
//! This is the same work interface the built-in trainer of `gwtf node`
//! pulls from (`crate::swarm::work`): one runtime, two kinds of trainer.

use std::collections::HashMap;
use std::ffi::c_char;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};
use parking_lot::Mutex;

use super::boundary::{
    check_handle, copy_str_out, free_handle, guard, guard_handle, require_out, write_out,
    write_sized, FfiError, FfiHandle, FfiResult, HandleHeader,
};
use super::enums::CEnum;
use super::error::gwtf_error;
use super::frame::gwtf_frame;
use super::node::{c_str, engine_err, fill, flag, node_key_at, parse_addr};
use super::status::gwtf_status;
use crate::engine::{Frame, NodeOptions};
use crate::protocol::{Event, MbId, NodeId, Stage};
use crate::swarm::event_log::LogEvent;
use crate::swarm::runtime::{
    CompleteError, NodeEvent, Output, Peer, Runtime, RuntimeOptions, TensorSizes, Work, WorkId,
    WorkKind, WorkPort,
};
use crate::swarm::saves::SavedState;
use crate::swarm::sizing::{NodeNeeds, NodeSizing};

/// Current version of `gwtf_peer_options` (what `_init` writes).
pub const GWTF_PEER_OPTIONS_VERSION: u32 = 6;
/// Current version of `gwtf_peer_stats`.
pub const GWTF_PEER_STATS_VERSION: u32 = 1;
/// `gwtf_peer_options.stage`: let the swarm choose (a joining relay).
pub const GWTF_STAGE_AUTO: i32 = -1;
/// Bytes of a weights digest (`gwtf_peer_task.weights`, the `weights`
/// argument of the answers).
pub const GWTF_DIGEST_LEN: u32 = 32;
/// Most relay stages a swarm may have.
pub const GWTF_PEER_MAX_RELAY_STAGES: u32 = 1024;
/// Largest tensor at a stage boundary, and largest stage state, in bytes.
pub const GWTF_PEER_MAX_TENSOR_BYTES: u64 = 1 << 30;
/// Most bootstrap contacts.
pub const GWTF_PEER_MAX_BOOTSTRAP: u32 = 4096;

/// What a peer is (`gwtf_peer_options.role`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gwtf_peer_role {
    /// A data holder (stage 0): embeds its own data, computes the loss.
    Holder = 1,
    /// A relay: serves one stage of the model's middle.
    Relay = 2,
}

impl CEnum for gwtf_peer_role {
    const NAME: &'static str = "gwtf_peer_role";
    const ALL: &'static [Self] = &[Self::Holder, Self::Relay];
    fn to_i32(self) -> i32 {
        self as i32
    }
}

/// What `gwtf_peer_next_task` hands out (`gwtf_peer_task.kind`): a task
/// (values below 100) that the trainer answers exactly once, or an event
/// (100 and up) that needs no answer.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gwtf_task_kind {
    /// Holder: embed microbatch `mb` (the trainer draws its tokens from its
    /// own data by `mb`: a microbatch asked again must be the same one).
    /// Answer: `gwtf_peer_task_done` with the activation of boundary 0.
    Embed = 1,
    /// Relay: the stage's forward on `input`. Answer: `gwtf_peer_task_done`
    /// with the activation (`output_bytes` long).
    Forward = 2,
    /// Holder: head forward, loss and head backward on `input` (the last
    /// relay's activation); keep the head's parameter gradient for `mb`.
    /// Answer: `gwtf_peer_task_done_loss` with the loss and the gradient
    /// of `input`.
    Loss = 3,
    /// Relay: the stage's backward; `input` is the gradient of its output.
    /// Keep the parameter gradient for `mb`. Answer: `gwtf_peer_task_done`
    /// with the gradient of the stage's input.
    Backward = 4,
    /// Holder: the embedding's backward with `input`; keep its parameter
    /// gradient for `mb`. Answer: `gwtf_peer_task_done` with NULL.
    EmbedBackward = 5,
    /// Barrier: the sum of the kept parameter gradients of exactly the
    /// microbatches in `granted` (each once, in the order given, however
    /// often one was computed), for iteration `iteration`. Answer:
    /// `gwtf_peer_task_done_gradient` with the sum and the digest of the
    /// weights it was computed on.
    Gradient = 6,
    /// Barrier: apply `mean` (the stage's all-reduced mean gradient of
    /// iteration `iteration`, over `microbatches` microbatches) with the
    /// trainer's optimizer. Keep the parameters from before: a microbatch
    /// of iteration `iteration` may still come (a recovery) and must run
    /// on them. Answer: `gwtf_peer_task_done_weights` with the new digest.
    Apply = 7,
    /// Barrier: the stage's state (parameters and optimizer) for a joiner,
    /// with the parameters from before the last update: the joiner may be
    /// asked to run a microbatch of that update's iteration (a recovery)
    /// after every member that applied it is gone. Answer:
    /// `gwtf_peer_task_done` with a frame holding it (at most the stage's
    /// `state_bytes`).
    ExportState = 8,
    /// Barrier: replace the stage's state with `input` (as another
    /// member's trainer exported it; the library checked its SHA-256): the
    /// weights after the update of iteration `iteration` (`has_iteration`
    /// 0: before any update), and those from before it when the exporter
    /// included them. Answer: `gwtf_peer_task_done_weights`.
    ImportState = 9,
    /// Forget what is kept for microbatches of iterations before
    /// `iteration` (activations whose backward never came, gradients
    /// never granted). Answer: `gwtf_peer_task_done` with NULL.
    Forget = 10,
    /// Barrier: no live node holds the stage's state (its last node
    /// died): start it afresh from the model's initial weights, standing
    /// for the weights after the update of iteration `iteration`
    /// (`has_iteration` 0: before any); a microbatch of that iteration
    /// runs on them too. Answer: `gwtf_peer_task_done_weights`.
    InitState = 11,
    /// Relay, only with `recompute` set in the peer's options: drop what
    /// the forward of `mb` kept for its backward (its activations). Its
    /// backward still comes: first a `GWTF_TASK_KIND_FORWARD` of `mb` on
    /// the same input again (keep what it keeps, as for any forward), then
    /// the `GWTF_TASK_KIND_BACKWARD`. Answer: `gwtf_peer_task_done` with
    /// NULL.
    Discard = 12,
    /// Barrier, only with `rebuild_from_neighbours` set in the peer's
    /// options: no live node holds the stage's state and no data holder
    /// kept a copy of it. Rebuild it from the states of `microbatches`
    /// members of the neighbouring relay stages, as their trainers
    /// exported them (`GWTF_TASK_KIND_EXPORT_STATE`; the library checked
    /// each one's SHA-256), one after another in `input`, each one a
    /// header of 16 bytes (the stage it is of, as a little-endian
    /// `uint32_t`; 4 bytes of 0; its length in bytes, as a little-endian
    /// `uint64_t`) and then the state. CheckFree averages the parameters
    /// (and the optimizer's moments) of those whose shapes fit this
    /// stage's. The result stands for the weights after the update of
    /// iteration `iteration` (`has_iteration` 0: before any update).
    /// Answer: `gwtf_peer_task_done_rebuilt` with the digest of the
    /// rebuilt weights and how many states they average (0: none fitted,
    /// and the trainer took the initial weights), or
    /// `gwtf_peer_task_failed`: the stage then starts from the initial
    /// weights (a `GWTF_TASK_KIND_INIT_STATE` follows).
    AverageStates = 13,
    /// Event, holder: iteration `iteration` is final; `loss` is the mean
    /// loss of this holder's `microbatches` microbatches.
    EventIteration = 100,
    /// Event: the coordinator of `stage` committed iteration `iteration`
    /// with `microbatches` microbatches.
    EventCommitted = 101,
    /// Event: this peer applied iteration `iteration`'s update; `weights`
    /// is the digest the trainer reported (the stage's weights version).
    EventApplied = 102,
    /// Event: the connection to peer `peer` broke (crashed, left, or
    /// unreachable), or its stage's coordinator removed it.
    EventPeerLost = 103,
    /// Event: this peer serves stage `stage` (a joiner learns it here).
    EventActive = 104,
    /// Event: the stage's state (`bytes` bytes) came from peer `peer`, `ms`
    /// milliseconds after it was asked for (whole, its hash checked), and
    /// was imported (the message says the rate and the import's time).
    EventStateDownloaded = 105,
    /// Event: the iteration barrier has waited long for stage `stage`
    /// (no member of it answers: the stage is empty or stuck).
    EventStageStalled = 106,
    /// Event: a failure was recovered from (`message` says how): a
    /// microbatch redone (`mb`), or, at a stage's coordinator, an
    /// all-reduce that failed at member `peer` committed again
    /// (`iteration`).
    EventRecovered = 107,
    /// Event: something went wrong (`message`); the peer goes on where it
    /// can (a refused tensor, a failed task, replicas that disagree).
    EventError = 108,
    /// Event: the peer has left the swarm.
    EventLeft = 109,
    /// Event: no live node of stage `stage`, next to this peer's, is known
    /// any more: its microbatches wait (training pauses) until a node
    /// joins it.
    EventStageEmpty = 110,
    /// Event: a node of stage `stage` is known again after
    /// `EventStageEmpty`.
    EventStageResumed = 111,
    /// Event: bad input from peer `peer` (0: before it said who it is) was
    /// refused; `message` says what and why. Nothing was lost.
    EventRefused = 112,
    /// Event: this peer stopped serving its stage group (`stage`): it was
    /// paused or starved longer than the group's suspicion time, cut off,
    /// told it is no longer a member, or its group fell behind another
    /// node of its stage (`message` says which). What it
    /// held of the group is dropped (tasks given before are stale: their
    /// answers are refused), and it joins again: its next task for that
    /// stage is an `IMPORT_STATE` with a fresh download.
    EventFenced = 113,
    /// Event: an address this peer was given (`bootstrap`) or dialled
    /// could not be reached after several attempts; `message` names it and
    /// the reason. The peer goes on trying the others.
    EventConnectFailed = 114,
    /// Event: this joiner serves stage `stage`, which no live node held,
    /// from the copy of its state data holder `peer` kept (the weights of
    /// iteration `iteration`); its `IMPORT_STATE` task came before. The
    /// updates after that iteration are lost; the other stages keep theirs.
    EventStageRestored = 115,
    /// Event: this joiner serves stage `stage`, which no live node held and
    /// of which no data holder kept a copy, from the initial weights (its
    /// `INIT_STATE` task came before).
    EventStageRestarted = 116,
    /// Event, holder (`save_every`): a checkpoint of the whole model after
    /// the update of `iteration` is complete: `microbatches` is the number
    /// of protocol stages (0 to relay_stages), whose states, as each
    /// stage's trainer exported them, `gwtf_peer_checkpoint_state` gives.
    /// The library keeps the last two checkpoints' states.
    EventCheckpoint = 117,
    /// Event: this joiner serves stage `stage`, which no live node held
    /// and of which no data holder kept a copy, rebuilt from the average of
    /// `microbatches` neighbouring stage members' states (its
    /// `GWTF_TASK_KIND_AVERAGE_STATES` task came before; `message` names
    /// the members); `weights` is the digest its trainer reported, and
    /// `iteration` (with `has_iteration`) the update those weights stand
    /// for. The updates the stage had applied are lost; the other stages
    /// keep theirs. (A rebuild that averaged nothing is reported as
    /// `GWTF_TASK_KIND_EVENT_STAGE_RESTARTED`.)
    EventStageRebuilt = 118,
}

/// A microbatch: its data holder, iteration and index in the iteration.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct gwtf_microbatch {
    pub holder: u32,
    pub iteration: u32,
    pub index: u32,
}

impl From<MbId> for gwtf_microbatch {
    fn from(m: MbId) -> Self {
        gwtf_microbatch {
            holder: m.holder,
            iteration: m.iter,
            index: m.idx,
        }
    }
}

/// A swarm member to start from (`gwtf_peer_options.bootstrap`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct gwtf_peer_contact {
    /// Its node id; 0 for an address only (a joiner's contact).
    pub id: u32,
    /// Its stage (0: a data holder); ignored when `id` is 0.
    pub stage: u32,
    /// "IP:PORT", NUL-terminated.
    pub addr: *const c_char,
}

/// Options of `gwtf_peer_new`. Initialise with `gwtf_peer_options_init`,
/// then set at least the swarm key, the role, the bootstrap contacts and
/// the model's sizes. Fields are only ever appended (`version` says which
/// the caller knows).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct gwtf_peer_options {
    /// Must be `GWTF_PEER_OPTIONS_VERSION` (set by `_init`).
    pub version: u32,
    /// A `GWTF_PEER_ROLE_*` value. Default: relay.
    pub role: i32,
    /// "IP:PORT" to listen on (port 0: any free port). Default "127.0.0.1:0".
    pub listen_addr: *const c_char,
    /// This peer's id: 0 for the id of its node key (`node_key_path`); any
    /// other value must be that id, unless `chosen_ids`. Founding members
    /// give each other these ids in their bootstrap lists
    /// (`gwtf_node_key_id` tells a key file's id). Default 0.
    pub node_id: u32,
    /// The stage: 0 for a holder, 1..=relay_stages for a founding relay,
    /// `GWTF_STAGE_AUTO` for a relay joining a running swarm (the swarm
    /// chooses). Default `GWTF_STAGE_AUTO`.
    pub stage: i32,
    /// Founding members (every one given the same list, with ids and
    /// stages), or for a joiner the addresses of members (ids 0).
    pub bootstrap: *const gwtf_peer_contact,
    pub bootstrap_len: usize,
    /// The swarm key every member shares (at least 16 bytes); copied.
    pub swarm_key: *const u8,
    pub swarm_key_len: usize,
    /// Memory this peer may use for microbatches in flight (and its frame
    /// pool). Default 256 MiB.
    pub memory_budget_bytes: u64,
    /// Memory one microbatch in flight takes at this peer (the trainer's
    /// kept activations and gradients); with the budget it bounds how many
    /// microbatches the swarm routes through this peer. 0: four times the
    /// largest tensor at its boundaries. Default 0.
    pub microbatch_bytes: u64,
    /// Seed of the protocol's random choices. Default 1.
    pub seed: u64,
    /// Relay stages of the model cut (>= 1): holders run stage 0 (their
    /// embedding before stage 1, their head after the last relay stage).
    pub relay_stages: u32,
    /// Microbatches each data holder runs per iteration (the same on every
    /// member). Default 4.
    pub microbatches_per_iteration: u32,
    /// `relay_stages + 1` sizes in bytes: entry `b` is the activation that
    /// stage `b` sends to stage `b + 1` (entry 0: a holder's embedding;
    /// the last: the last relay's output, the input of the holders' loss).
    pub activation_bytes: *const u64,
    /// `relay_stages + 1` sizes of the gradients of those activations, or
    /// NULL when each is the size of its activation. Default NULL.
    pub gradient_bytes: *const u64,
    /// `relay_stages + 1` sizes of each stage's state for transfer, at most
    /// (entry 0, the holders', is not transferred and may be 0). The
    /// largest also sets how long the swarm waits before it takes a silent
    /// node for gone: a quarter of it is taken for the largest parameter
    /// gradient, whose all-reduce keeps a node busy (0.8 s, plus 0.1 s per
    /// 6.7 MB of it in whole ticks); every member must declare the same
    /// sizes.
    pub state_bytes: *const u64,
    /// A first estimate of one microbatch's compute on this peer, in
    /// microseconds (the protocol measures the real one). Default 10000.
    pub compute_estimate_us: u32,
    /// Log connections, refusals and recoveries to stderr when non-zero.
    pub log_to_stderr: u32,
    /// 1: this peer's trainer can run a forward again (activation
    /// recompute). A relay whose memory is full then runs a forward at once
    /// and drops what it kept (`GWTF_TASK_KIND_DISCARD`), and before its
    /// backward runs that forward again on the same input, instead of
    /// waiting for memory; the swarm routes as many microbatches through
    /// it as its GPU serves. 0: every forward keeps its activations, and a
    /// forward waits while memory is full. Default 0. (Version 2.)
    pub recompute: u32,
    /// 1: encrypt frame payloads (AES-256-GCM; a connection encrypts when
    /// either end asks). Every frame is authenticated either way. Default
    /// 0. (Version 3.)
    pub encrypt: u32,
    /// File holding this peer's private key (64 hex digits), created on
    /// first use; its public key is proved in every handshake and the
    /// peer's id follows from it. NULL: a fresh key (and so a new id) for
    /// this peer's lifetime. Default NULL. (Version 4.)
    pub node_key_path: *const c_char,
    /// 1, insecure, for test swarms with fixed ids: `node_id` may be any
    /// id, and members whose ids do not follow from their keys are
    /// accepted, so any holder of the swarm key can act as any member.
    /// Every member must then set it. Default 0. (Version 4.)
    pub chosen_ids: u32,
    /// A data holder keeps a copy of every relay stage's state, asked for
    /// from one of the stage's members after every this many of its
    /// updates, so that a stage whose last member dies is restored from it
    /// (`GWTF_TASK_KIND_EVENT_STAGE_RESTORED`) instead of starting afresh.
    /// 0: none. Holders only. Default 0. (Version 5.)
    pub keep_states_every: u32,
    /// A data holder assembles a checkpoint of the whole model after every
    /// this many of its updates: its own state and a copy of each relay
    /// stage's, all exported right after that update, handed over with
    /// `GWTF_TASK_KIND_EVENT_CHECKPOINT` (read them with
    /// `gwtf_peer_checkpoint_state`). 0: none. Holders only. Default 0.
    /// (Version 5.)
    pub save_every: u32,
    /// A founding member whose trainer starts from a checkpoint: the
    /// updates its weights hold (iterations 0..N-1); the swarm starts at
    /// iteration N. Every founding member gives the same. 0: a fresh start.
    /// Default 0. (Version 5.)
    pub resume_iterations_done: u32,
    /// 1: this relay's trainer can rebuild its stage from the states of
    /// its neighbouring relay stages' members
    /// (`GWTF_TASK_KIND_AVERAGE_STATES`, CheckFree's way): when it takes
    /// up a stage whose last member is gone and of which no data holder
    /// kept a copy, it rebuilds the stage from them instead of starting
    /// it from the initial weights (`GWTF_TASK_KIND_INIT_STATE`). Relays
    /// only. Default 0. (Version 6.)
    pub rebuild_from_neighbours: u32,
}

/// A task or an event, written by `gwtf_peer_next_task`. Which fields mean
/// something depends on `kind` (see `gwtf_task_kind`); the others are 0.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gwtf_peer_task {
    /// A `GWTF_TASK_KIND_*` value.
    pub kind: i32,
    /// The peer's stage (0: data holder) when the task was given; for an
    /// event, the stage it is about.
    pub stage: u32,
    /// The task's id, for the answer (0 for an event).
    pub id: u64,
    /// The microbatch of a compute task (embed, forward, loss, backward,
    /// embed backward).
    pub mb: gwtf_microbatch,
    /// The iteration of a gradient, apply, import (with `has_iteration`),
    /// forget (the first kept), or of an iteration/committed/applied event.
    pub iteration: u32,
    /// 1 when `iteration` is set (an import of a state before any update
    /// has 0).
    pub has_iteration: u32,
    /// Bytes the answer's frame must have (0: the answer has no tensor).
    pub output_bytes: u64,
    /// The input tensor (forward, loss, backward, embed backward) or state
    /// (import): a lease on the frame it arrived in, no copy. Valid until
    /// the task is answered (done or failed) or the peer is freed.
    pub input: *const u8,
    pub input_len: usize,
    /// Gradient: the granted microbatches, in the order to sum them. Valid
    /// until the task is answered.
    pub granted: *const gwtf_microbatch,
    pub granted_len: usize,
    /// Apply: the mean gradient. Valid until the task is answered.
    pub mean: *const f32,
    pub mean_len: usize,
    /// Apply: the microbatches averaged; committed and iteration events:
    /// the microbatches in it.
    pub microbatches: u64,
    /// Iteration event: the mean loss of this holder's microbatches.
    pub loss: f32,
    pub reserved0: u32,
    /// Peer-lost event: the peer; state-downloaded: where from; recovered
    /// all-reduce: the member it failed at.
    pub peer: u64,
    /// State-downloaded event: bytes, and milliseconds from the request to
    /// the whole state, its hash checked.
    pub bytes: u64,
    pub ms: f64,
    /// Applied event: the weights digest the trainer reported.
    pub weights: [u8; 32],
    /// A human-readable description, NUL-terminated (truncated).
    pub message: [c_char; 256],
}

/// Counters of a peer (see `gwtf_peer_get_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct gwtf_peer_stats {
    /// `GWTF_PEER_STATS_VERSION` of the library that wrote it.
    pub version: u32,
    pub reserved0: u32,
    /// Time between handing out and answering microbatch tasks.
    pub compute_ns: u64,
    /// The part of it whose result went into an applied update.
    pub useful_ns: u64,
    /// Tasks handed out, answered done, answered failed.
    pub tasks_given: u64,
    pub tasks_done: u64,
    pub tasks_failed: u64,
    /// Answers refused (unknown task, answered twice, wrong output, late).
    pub answers_refused: u64,
    /// Events handed out.
    pub events: u64,
    pub frames_sent: u64,
    pub frames_received: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Payload copies made in user space by the transport.
    pub user_copies: u64,
    pub peers_connected: u64,
    pub peers_lost: u64,
    pub pool_capacity_bytes: u64,
    pub pool_in_use_bytes: u64,
}

/// What the library keeps for a task until it is answered.
struct Held {
    kind: WorkKind,
    /// Kept alive for the pointers given to C.
    _input: Option<Frame>,
    /// An `AVERAGE_STATES` task's states, one after another, each after
    /// its header (the task's `input`).
    _packed: Vec<u8>,
    _granted: Vec<gwtf_microbatch>,
    _mean: Option<Arc<Vec<f32>>>,
}

#[derive(Default)]
struct Counters {
    given: AtomicU64,
    done: AtomicU64,
    failed: AtomicU64,
    refused: AtomicU64,
    events: AtomicU64,
}

/// A swarm member driven by the caller's trainer (opaque).
pub struct gwtf_peer {
    header: HandleHeader,
    id: NodeId,
    /// Its stage (a joiner's from its `Active` event).
    stage: AtomicU32,
    addr: Option<SocketAddr>,
    /// None once left.
    rt: Mutex<Option<Runtime>>,
    port: WorkPort,
    events: Receiver<NodeEvent>,
    held: Mutex<HashMap<WorkId, Held>>,
    counters: Counters,
    /// The runtime's counters when it left.
    last: Mutex<gwtf_peer_stats>,
    /// The last checkpoints handed out (`EventCheckpoint`), oldest first.
    checkpoints: Mutex<std::collections::VecDeque<(u32, Vec<SavedState>)>>,
}

/// Checkpoints whose states `gwtf_peer_checkpoint_state` still gives.
const CHECKPOINTS_KEPT: usize = 2;

impl FfiHandle for gwtf_peer {
    const MAGIC: u64 = 0x6777_7466_7065_6572; // "gwtfpeer"
    const NAME: &'static str = "gwtf_peer";
    fn header(&self) -> &HandleHeader {
        &self.header
    }
}

/// `n` values from `p` (checked against the limit per value).
///
/// # Safety
/// `p` must be NULL or valid for `n` reads.
unsafe fn sizes(p: *const u64, n: usize, what: &str, zero_ok: bool) -> FfiResult<Vec<usize>> {
    if p.is_null() {
        return Err(FfiError::null(what));
    }
    // SAFETY: per the function contract.
    let v = unsafe { std::slice::from_raw_parts(p, n) };
    v.iter()
        .enumerate()
        .map(|(i, &x)| {
            if x > GWTF_PEER_MAX_TENSOR_BYTES {
                Err(FfiError::new(
                    gwtf_status::LimitExceeded,
                    format!("{what}[{i}] = {x} is above GWTF_PEER_MAX_TENSOR_BYTES"),
                ))
            } else if x == 0 && !zero_ok {
                Err(FfiError::invalid(format!("{what}[{i}] is 0")))
            } else {
                Ok(x as usize)
            }
        })
        .collect()
}

/// Fills `opts` with the defaults of this library version (swarm key,
/// bootstrap contacts and the model's sizes unset).
///
/// Ownership: `opts` is caller memory; it is only written.
///
/// Thread safety: may be called from any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_peer_options_init(opts: *mut gwtf_peer_options) -> gwtf_status {
    guard(std::ptr::null_mut(), || {
        require_out(opts, "opts")?;
        let v = default_options();
        // SAFETY: checked non-NULL.
        unsafe { write_out(opts, v) };
        Ok(())
    })
}

/// The options `gwtf_peer_options_init` writes.
fn default_options() -> gwtf_peer_options {
    gwtf_peer_options {
        version: GWTF_PEER_OPTIONS_VERSION,
        role: gwtf_peer_role::Relay as i32,
        listen_addr: c"127.0.0.1:0".as_ptr(),
        node_id: 0,
        stage: GWTF_STAGE_AUTO,
        bootstrap: std::ptr::null(),
        bootstrap_len: 0,
        swarm_key: std::ptr::null(),
        swarm_key_len: 0,
        memory_budget_bytes: 256 << 20,
        microbatch_bytes: 0,
        seed: 1,
        relay_stages: 0,
        microbatches_per_iteration: 4,
        activation_bytes: std::ptr::null(),
        gradient_bytes: std::ptr::null(),
        state_bytes: std::ptr::null(),
        compute_estimate_us: 10_000,
        log_to_stderr: 0,
        recompute: 0,
        encrypt: 0,
        node_key_path: std::ptr::null(),
        chosen_ids: 0,
        keep_states_every: 0,
        save_every: 0,
        resume_iterations_done: 0,
        rebuild_from_neighbours: 0,
    }
}

/// The caller's options, of any version this library knows. A struct of an
/// older version is shorter: only its fields are read, and those appended
/// since keep their defaults.
///
/// # Safety
/// `opts` is non-NULL and points to a readable options struct of the
/// version its first field says.
unsafe fn read_options(opts: *const gwtf_peer_options) -> FfiResult<gwtf_peer_options> {
    // SAFETY: every version starts with its version.
    let version = unsafe { std::ptr::addr_of!((*opts).version).read() };
    let len = match version {
        1 => std::mem::offset_of!(gwtf_peer_options, recompute),
        2 => std::mem::offset_of!(gwtf_peer_options, encrypt),
        3 => std::mem::offset_of!(gwtf_peer_options, node_key_path),
        4 => std::mem::offset_of!(gwtf_peer_options, keep_states_every),
        5 => std::mem::offset_of!(gwtf_peer_options, rebuild_from_neighbours),
        GWTF_PEER_OPTIONS_VERSION => std::mem::size_of::<gwtf_peer_options>(),
        v => {
            return Err(FfiError::new(
                gwtf_status::UnsupportedVersion,
                format!(
                    "gwtf_peer_options.version is {v} but this library knows 1..={} \
                     (call gwtf_peer_options_init)",
                    GWTF_PEER_OPTIONS_VERSION
                ),
            ))
        }
    };
    let mut o = default_options();
    // SAFETY: the caller's struct of this version has `len` readable bytes;
    // `o` is a whole struct; every field is a plain integer or pointer.
    unsafe {
        std::ptr::copy_nonoverlapping(
            opts.cast::<u8>(),
            (&mut o as *mut gwtf_peer_options).cast::<u8>(),
            len,
        )
    };
    o.version = GWTF_PEER_OPTIONS_VERSION;
    Ok(o)
}

/// The runtime's options from C's (read by [`read_options`]), all checked
/// before anything starts.
fn runtime_options(o: &gwtf_peer_options) -> FfiResult<(RuntimeOptions, TensorSizes)> {
    let role = gwtf_peer_role::from_c(o.role)?;
    if o.relay_stages == 0 || o.relay_stages > GWTF_PEER_MAX_RELAY_STAGES {
        return Err(FfiError::invalid(format!(
            "relay_stages is {}: a swarm has 1..={GWTF_PEER_MAX_RELAY_STAGES}",
            o.relay_stages
        )));
    }
    let n = o.relay_stages as usize + 1;
    // SAFETY (three calls): the caller passes relay_stages + 1 values.
    let activation = unsafe { sizes(o.activation_bytes, n, "activation_bytes", false)? };
    let gradient = if o.gradient_bytes.is_null() {
        activation.clone()
    } else {
        // SAFETY: as above.
        unsafe { sizes(o.gradient_bytes, n, "gradient_bytes", false)? }
    };
    // SAFETY: as above.
    let state = unsafe { sizes(o.state_bytes, n, "state_bytes", true)? };
    if let Some(s) = state[1..].iter().position(|&x| x == 0) {
        return Err(FfiError::invalid(format!(
            "state_bytes[{}] is 0: every relay stage has a state to transfer",
            s + 1
        )));
    }
    let tensor = TensorSizes {
        activation,
        gradient,
    };
    let (stage, join) = match (role, o.stage) {
        (gwtf_peer_role::Holder, 0 | GWTF_STAGE_AUTO) => (0, false),
        (gwtf_peer_role::Holder, s) => {
            return Err(FfiError::invalid(format!(
                "a data holder is stage 0, not {s}"
            )))
        }
        (gwtf_peer_role::Relay, GWTF_STAGE_AUTO) => (0, true),
        (gwtf_peer_role::Relay, s) if s >= 1 && s as u32 <= o.relay_stages => (s as Stage, false),
        (gwtf_peer_role::Relay, s) => {
            return Err(FfiError::invalid(format!(
                "stage {s}: a relay serves 1..={} or GWTF_STAGE_AUTO (join)",
                o.relay_stages
            )))
        }
    };
    if o.swarm_key.is_null() {
        return Err(FfiError::null("opts->swarm_key"));
    }
    // SAFETY: non-NULL; the caller passes swarm_key_len readable bytes.
    let key = unsafe { std::slice::from_raw_parts(o.swarm_key, o.swarm_key_len) }.to_vec();
    if o.bootstrap_len == 0 {
        return Err(FfiError::invalid(
            "no bootstrap contacts: give the founding members, or a member's address to join",
        ));
    }
    if o.bootstrap_len > GWTF_PEER_MAX_BOOTSTRAP as usize {
        return Err(FfiError::new(
            gwtf_status::LimitExceeded,
            format!(
                "{} bootstrap contacts (most: {GWTF_PEER_MAX_BOOTSTRAP})",
                o.bootstrap_len
            ),
        ));
    }
    if o.bootstrap.is_null() {
        return Err(FfiError::null("opts->bootstrap"));
    }
    // SAFETY: non-NULL; the caller passes bootstrap_len contacts.
    let contacts = unsafe { std::slice::from_raw_parts(o.bootstrap, o.bootstrap_len) };
    let node_key = node_key_at(o.node_key_path, "opts->node_key_path")?;
    let chosen_ids = flag(o.chosen_ids, "chosen_ids")?;
    let id = match o.node_id {
        0 => node_key.node_id(),
        id if id == node_key.node_id() || chosen_ids => id,
        id => {
            return Err(FfiError::invalid(format!(
                "node_id {id} is not the id of this peer's key ({}): ids follow from node keys \
                 (leave it 0; chosen ids only with chosen_ids, in a test swarm)",
                node_key.node_id()
            )))
        }
    };
    let mut bootstrap = Vec::with_capacity(contacts.len());
    for (i, c) in contacts.iter().enumerate() {
        let addr = parse_addr(c.addr, &format!("bootstrap[{i}].addr"))?;
        if c.id == 0 && !join {
            return Err(FfiError::invalid(format!(
                "bootstrap[{i}] has id 0: a founding member is given every founding member's id"
            )));
        }
        if c.id != 0 && c.stage > o.relay_stages {
            return Err(FfiError::invalid(format!(
                "bootstrap[{i}]: stage {} does not exist (relay stages 1..={})",
                c.stage, o.relay_stages
            )));
        }
        if c.id == id && !join && c.stage != stage as u32 {
            return Err(FfiError::invalid(format!(
                "bootstrap[{i}] names this peer (id {id}) with stage {}, not {stage}",
                c.stage
            )));
        }
        bootstrap.push(Peer {
            id: if join { 0 } else { c.id },
            stage: if join { 0 } else { c.stage as Stage },
            addr,
        });
    }
    let listen = if o.listen_addr.is_null() {
        "127.0.0.1:0".parse().expect("valid")
    } else {
        parse_addr(o.listen_addr, "opts->listen_addr")?
    };
    // Memory one microbatch takes here: the caller's figure, or four times
    // the largest tensor at the boundaries of its stage(s).
    let per_mb = if o.microbatch_bytes > 0 {
        o.microbatch_bytes
    } else if join {
        4 * tensor.max() as u64
    } else {
        let kinds = [
            WorkKind::Embed,
            WorkKind::Forward,
            WorkKind::Loss,
            WorkKind::Backward,
            WorkKind::EmbedBackward,
        ];
        let mine = kinds
            .iter()
            .filter(|k| (stage == 0) == !matches!(k, WorkKind::Forward | WorkKind::Backward))
            .flat_map(|k| [tensor.input(k, stage), tensor.output(k, stage)])
            .flatten()
            .max()
            .unwrap_or(1);
        4 * mine as u64
    };
    // One sizing rule for every node (the tool's too): patience grows with
    // the largest state, capacity with the memory budget.
    let needs = NodeNeeds {
        stage_state_bytes: state.iter().map(|&x| x as u64).collect(),
        largest_tensor_bytes: tensor.max() as u64,
        microbatch_bytes: per_mb,
        memory_budget_bytes: o.memory_budget_bytes.max(1),
    };
    let sizing =
        NodeSizing::of(&needs).map_err(|e| FfiError::new(gwtf_status::LimitExceeded, e))?;
    let mut proto = sizing.protocol(&needs);
    proto.recompute = match o.recompute {
        0 => false,
        1 => true,
        x => return Err(FfiError::invalid(format!("recompute is {x}: 0 or 1"))),
    };
    proto.mb_per_iter = o.microbatches_per_iteration.max(1);
    if stage != 0 || join {
        for (v, what) in [
            (o.keep_states_every, "keep_states_every"),
            (o.save_every, "save_every"),
        ] {
            if v != 0 {
                return Err(FfiError::invalid(format!(
                    "{what} is {v}: data holders keep copies and checkpoints, not relays"
                )));
            }
        }
    }
    if join && o.resume_iterations_done != 0 {
        return Err(FfiError::invalid(
            "resume_iterations_done is for founding members: a joiner downloads its stage's state",
        ));
    }
    proto.rebuild_from_neighbours = match o.rebuild_from_neighbours {
        0 => false,
        1 if stage == 0 && !join => {
            return Err(FfiError::invalid(
                "rebuild_from_neighbours is 1: relays rebuild emptied stages, a data holder \
                 never takes one up",
            ))
        }
        1 => true,
        x => {
            return Err(FfiError::invalid(format!(
                "rebuild_from_neighbours is {x}: 0 or 1"
            )))
        }
    };
    proto.keep_states_every = o.keep_states_every;
    proto.save_every = o.save_every;
    proto.resume_from = o.resume_iterations_done.checked_sub(1);
    let mut opts = RuntimeOptions {
        id,
        stage,
        listen,
        swarm_key: key,
        bootstrap,
        join,
        protocol: Arc::new(proto),
        compute_s: o.compute_estimate_us.max(1) as f64 / 1e6,
        capacity: sizing.capacity,
        seed: o.seed ^ id as u64,
        net: NodeOptions {
            log: o.log_to_stderr != 0,
            encrypt: match o.encrypt {
                0 => false,
                1 => true,
                x => return Err(FfiError::invalid(format!("encrypt is {x}: 0 or 1"))),
            },
            node_key: Some(node_key),
            chosen_ids,
            ..NodeOptions::default()
        },
        // A C trainer's state is opaque: imported whole.
        weights_first: None,
    };
    sizing.apply(&mut opts.net);
    Ok((opts, tensor))
}

/// Creates a swarm member and starts it: it listens, meets its bootstrap
/// contacts (a founding member) or joins through them (a relay with
/// `GWTF_STAGE_AUTO`), and from then on has tasks and events for the
/// trainer (`gwtf_peer_next_task`).
///
/// Ownership: `opts` and the memory it points to are only read during the
/// call (the key and the sizes are copied). The caller owns `*out_peer` and
/// frees it with `gwtf_peer_free`.
///
/// Thread safety: may be called from any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_UNSUPPORTED_VERSION`,
/// `GWTF_STATUS_INVALID_ARGUMENT` (role, stage, sizes, contacts, short key,
/// bad address), `GWTF_STATUS_LIMIT_EXCEEDED` (a size above
/// `GWTF_PEER_MAX_TENSOR_BYTES`, too many contacts), `GWTF_STATUS_IO`
/// (cannot listen), `GWTF_STATUS_OUT_OF_MEMORY`.
#[no_mangle]
pub extern "C" fn gwtf_peer_new(
    opts: *const gwtf_peer_options,
    out_peer: *mut *mut gwtf_peer,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_peer, "out_peer")?;
        if opts.is_null() {
            return Err(FfiError::null("opts"));
        }
        // SAFETY: non-NULL; the caller passes a readable options struct.
        let o = unsafe { read_options(opts)? };
        let (ro, tensor) = runtime_options(&o)?;
        let (id, stage) = (ro.id, ro.stage as u32);
        let rt = Runtime::start_pulled_sized(ro, tensor).map_err(engine_err)?;
        let p = gwtf_peer {
            header: HandleHeader::new(gwtf_peer::MAGIC),
            id,
            stage: AtomicU32::new(stage),
            addr: rt.addr(),
            port: rt.port().clone(),
            events: rt.events().clone(),
            rt: Mutex::new(Some(rt)),
            held: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            last: Mutex::new(gwtf_peer_stats::default()),
            checkpoints: Mutex::new(Default::default()),
        };
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_peer, p.into_raw()) };
        Ok(())
    })
}

/// The state of protocol stage `stage` (0: the data holders') in this
/// holder's checkpoint of iteration `iteration`, announced by
/// `GWTF_TASK_KIND_EVENT_CHECKPOINT`: the bytes that stage's trainer
/// exported right after that update (`GWTF_TASK_KIND_EXPORT_STATE`), and
/// the node whose trainer it was (`out_from`, may be NULL).
///
/// Ownership: `*out_data` points into memory the library keeps until two
/// more checkpoint events have been handed out, or the peer is freed:
/// read (or copy) it, never free it. `out_data`, `out_len` and `out_from`
/// are caller memory, written on success.
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_NOT_FOUND` (no
/// checkpoint of that iteration is kept, or it has no such stage).
#[no_mangle]
pub extern "C" fn gwtf_peer_checkpoint_state(
    peer: *mut gwtf_peer,
    iteration: u32,
    stage: u32,
    out_data: *mut *const u8,
    out_len: *mut usize,
    out_from: *mut u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        require_out(out_data, "out_data")?;
        require_out(out_len, "out_len")?;
        let c = p.checkpoints.lock();
        let Some((_, states)) = c.iter().find(|(it, _)| *it == iteration) else {
            let kept: Vec<u32> = c.iter().map(|(it, _)| *it).collect();
            return Err(FfiError::new(
                gwtf_status::NotFound,
                format!("no checkpoint of iteration {iteration} is kept (kept: {kept:?})"),
            ));
        };
        let Some(s) = states.iter().find(|s| s.stage as u32 == stage) else {
            return Err(FfiError::new(
                gwtf_status::NotFound,
                format!(
                    "the checkpoint of iteration {iteration} has stages 0..={}, not {stage}",
                    states.len().saturating_sub(1)
                ),
            ));
        };
        // SAFETY: checked non-NULL; the bytes live in `p.checkpoints` until
        // two more checkpoints came, as documented.
        unsafe {
            write_out(out_data, s.state.as_ptr());
            write_out(out_len, s.state.len());
            if !out_from.is_null() {
                write_out(out_from, s.from);
            }
        }
        Ok(())
    })
}

/// This peer's node id (the one given, or the random one chosen).
///
/// Ownership: `peer` is only borrowed.
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_peer_id(
    peer: *const gwtf_peer,
    out_id: *mut u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        require_out(out_id, "out_id")?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_id, p.id) };
        Ok(())
    })
}

/// The "IP:PORT" the peer listens on (with the real port), NUL-terminated;
/// `*out_len` (may be NULL) receives the length without the NUL.
///
/// Ownership: `buf` is caller memory of `buf_len` bytes.
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: `GWTF_STATUS_BUFFER_TOO_SMALL`, `GWTF_STATUS_NOT_FOUND`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_peer_local_addr(
    peer: *const gwtf_peer,
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        let a = p
            .addr
            .ok_or_else(|| FfiError::new(gwtf_status::NotFound, "the peer does not listen"))?;
        // SAFETY: the caller passes a buffer of buf_len bytes (or NULL, 0).
        unsafe { copy_str_out(&a.to_string(), buf, buf_len, out_len) }
    })
}

fn blank_task() -> gwtf_peer_task {
    gwtf_peer_task {
        kind: 0,
        stage: 0,
        id: 0,
        mb: gwtf_microbatch::default(),
        iteration: 0,
        has_iteration: 0,
        output_bytes: 0,
        input: std::ptr::null(),
        input_len: 0,
        granted: std::ptr::null(),
        granted_len: 0,
        mean: std::ptr::null(),
        mean_len: 0,
        microbatches: 0,
        loss: 0.0,
        reserved0: 0,
        peer: 0,
        bytes: 0,
        ms: 0.0,
        weights: [0; 32],
        message: [0; 256],
    }
}

fn task_kind(k: &WorkKind) -> gwtf_task_kind {
    match k {
        WorkKind::Embed => gwtf_task_kind::Embed,
        WorkKind::Forward => gwtf_task_kind::Forward,
        WorkKind::Loss => gwtf_task_kind::Loss,
        WorkKind::Backward => gwtf_task_kind::Backward,
        WorkKind::EmbedBackward => gwtf_task_kind::EmbedBackward,
        WorkKind::Gradient { .. } => gwtf_task_kind::Gradient,
        WorkKind::Apply { .. } => gwtf_task_kind::Apply,
        WorkKind::ExportState => gwtf_task_kind::ExportState,
        // A C peer's runtime declares no weights-first state layout, so it
        // is never given the two halves of an import; were it, its import
        // would refuse the part as a state of the wrong length.
        WorkKind::ImportState { .. }
        | WorkKind::ImportWeights { .. }
        | WorkKind::ImportRest { .. } => gwtf_task_kind::ImportState,
        WorkKind::Forget { .. } => gwtf_task_kind::Forget,
        WorkKind::Discard => gwtf_task_kind::Discard,
        WorkKind::InitState { .. } => gwtf_task_kind::InitState,
        WorkKind::AverageStates { .. } => gwtf_task_kind::AverageStates,
    }
}

/// An `AVERAGE_STATES` task's input: each state after a header of 16
/// bytes (its stage as a little-endian u32, 4 bytes of 0, its length as a
/// little-endian u64).
fn pack_states(states: &[(Stage, Vec<u8>)]) -> Vec<u8> {
    let n = states.iter().map(|(_, s)| 16 + s.len()).sum();
    let mut v = Vec::with_capacity(n);
    for (stage, s) in states {
        v.extend_from_slice(&u32::from(*stage).to_le_bytes());
        v.extend_from_slice(&[0; 4]);
        v.extend_from_slice(&(s.len() as u64).to_le_bytes());
        v.extend_from_slice(s);
    }
    v
}

/// A task for C, and what must be kept for its pointers.
fn task_of(w: Work, sizes: &TensorSizes) -> (gwtf_peer_task, Held) {
    let mut t = blank_task();
    t.kind = task_kind(&w.kind) as i32;
    t.stage = w.stage as u32;
    t.id = w.id;
    if let Some(mb) = w.mb {
        t.mb = mb.into();
    }
    t.output_bytes = sizes.output(&w.kind, w.stage).unwrap_or(0) as u64;
    if let Some(f) = &w.input {
        t.input = f.payload_ptr();
        t.input_len = f.len();
    }
    let mut granted = Vec::new();
    let mut mean = None;
    let mut packed = Vec::new();
    let set_iter = |t: &mut gwtf_peer_task, it: u32| {
        t.iteration = it;
        t.has_iteration = 1;
    };
    match &w.kind {
        WorkKind::Gradient {
            iteration,
            granted: g,
        } => {
            set_iter(&mut t, *iteration);
            granted = g.iter().map(|&m| m.into()).collect();
        }
        WorkKind::Apply {
            iteration,
            mean: m,
            microbatches,
        } => {
            set_iter(&mut t, *iteration);
            t.microbatches = *microbatches;
            mean = Some(m.clone());
        }
        WorkKind::ImportState { applied: Some(a) } | WorkKind::InitState { applied: Some(a) } => {
            set_iter(&mut t, *a)
        }
        WorkKind::Forget { before } => set_iter(&mut t, *before),
        WorkKind::AverageStates { applied, states } => {
            if let Some(a) = applied {
                set_iter(&mut t, *a);
            }
            t.microbatches = states.len() as u64;
            packed = pack_states(states);
            t.input = packed.as_ptr();
            t.input_len = packed.len();
        }
        _ => {}
    }
    if !granted.is_empty() {
        t.granted = granted.as_ptr();
        t.granted_len = granted.len();
    }
    if let Some(m) = &mean {
        if !m.is_empty() {
            t.mean = m.as_ptr();
            t.mean_len = m.len();
        }
    }
    let what = match w.mb {
        Some(m) => format!(
            "{} of microbatch {}/{}/{}",
            w.kind.name(),
            m.holder,
            m.iter,
            m.idx
        ),
        None => w.kind.name().to_string(),
    };
    fill(&mut t.message, &what);
    let held = Held {
        kind: w.kind,
        _input: w.input,
        _packed: packed,
        _granted: granted,
        _mean: mean,
    };
    (t, held)
}

/// `e` as the trainer's event task, or `None` for events a trainer is not
/// told of. The typed fields and the text both come from the one event
/// schema ([`LogEvent::of`], [`LogEvent::sentence`]), as `gwtf node`'s
/// lines do.
fn event_of(e: &NodeEvent, me: NodeId, my_stage: u32) -> Option<gwtf_peer_task> {
    let log = LogEvent::of(me.into(), e, 0)?;
    let mut t = blank_task();
    t.stage = my_stage;
    let narrow = |x: u64| u32::try_from(x).unwrap_or(u32::MAX);
    let iteration = |t: &mut gwtf_peer_task, i: u64| {
        t.iteration = narrow(i);
        t.has_iteration = 1;
    };
    use gwtf_task_kind as K;
    let kind = match &log {
        // A kept copy is the holder's own business (it restores a stage);
        // checkpoints are handed out by `gwtf_peer::next`, which keeps
        // their states.
        LogEvent::CopyKept { .. } | LogEvent::CheckpointSkipped { .. } => return None,
        LogEvent::Iteration {
            iteration: i,
            loss,
            microbatches,
            ..
        } => {
            iteration(&mut t, *i);
            // The f32 the trainer reported: its shortest digits read back.
            t.loss = *loss as f32;
            t.microbatches = *microbatches;
            K::EventIteration
        }
        LogEvent::Applied {
            stage,
            iteration: i,
            weights_sha256,
            microbatches,
            ..
        } => {
            t.stage = *stage;
            iteration(&mut t, *i);
            t.weights = digest_of(weights_sha256);
            t.microbatches = *microbatches;
            K::EventApplied
        }
        LogEvent::Committed {
            stage,
            iteration: i,
            microbatches,
            ..
        } => {
            t.stage = *stage;
            iteration(&mut t, *i);
            t.microbatches = *microbatches;
            K::EventCommitted
        }
        LogEvent::PeerLost { peer, .. } => {
            t.peer = *peer;
            K::EventPeerLost
        }
        LogEvent::Active { stage, .. } => {
            t.stage = *stage;
            K::EventActive
        }
        LogEvent::StateDownload {
            from, bytes, ms, ..
        } => {
            t.peer = *from;
            t.bytes = *bytes;
            t.ms = *ms;
            K::EventStateDownloaded
        }
        LogEvent::Stalled {
            stage,
            iteration: i,
            ..
        } => {
            t.stage = *stage;
            iteration(&mut t, *i);
            K::EventStageStalled
        }
        LogEvent::Recovered {
            kind,
            stage,
            iteration: i,
            holder,
            index,
            ..
        } => {
            t.mb = gwtf_microbatch {
                holder: narrow(*holder),
                iteration: narrow(*i),
                index: narrow(*index),
            };
            if kind != "restarted" {
                t.stage = *stage;
            }
            K::EventRecovered
        }
        LogEvent::AggregateFailed {
            stage,
            iteration: i,
            member,
            ..
        } => {
            t.stage = *stage;
            iteration(&mut t, *i);
            t.peer = *member;
            K::EventRecovered
        }
        LogEvent::ReplicasDiverged {
            stage,
            iteration: i,
            ..
        } => {
            t.stage = *stage;
            iteration(&mut t, *i);
            K::EventError
        }
        LogEvent::Error { .. } => K::EventError,
        LogEvent::Left { .. } => K::EventLeft,
        LogEvent::StageEmpty { stage, .. } => {
            t.stage = *stage;
            K::EventStageEmpty
        }
        LogEvent::StageResumed { stage, .. } => {
            t.stage = *stage;
            K::EventStageResumed
        }
        LogEvent::Refused { peer, .. } => {
            t.peer = peer.unwrap_or(0);
            K::EventRefused
        }
        LogEvent::Fenced { .. } => K::EventFenced,
        LogEvent::ConnectFailed { .. } => K::EventConnectFailed,
        LogEvent::StageRestored {
            stage,
            from,
            iteration: i,
            ..
        } => {
            t.stage = *stage;
            t.peer = *from;
            iteration(&mut t, *i);
            K::EventStageRestored
        }
        LogEvent::StageRestarted { stage, applied, .. } => {
            t.stage = *stage;
            if let Some(a) = applied {
                iteration(&mut t, *a);
            }
            K::EventStageRestarted
        }
        LogEvent::StageRebuilt {
            stage,
            applied,
            averaged,
            weights_sha256,
            ..
        } => {
            t.stage = *stage;
            if let Some(a) = applied {
                iteration(&mut t, *a);
            }
            t.microbatches = *averaged;
            t.weights = digest_of(weights_sha256);
            K::EventStageRebuilt
        }
        _ => return None,
    };
    t.kind = kind as i32;
    fill(&mut t.message, &log.sentence());
    Some(t)
}

/// A SHA-256 as the event lines spell it (64 hex digits) back in bytes;
/// zeros for anything else.
fn digest_of(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    let b = hex.as_bytes();
    if b.len() != 64 {
        return out;
    }
    for (i, pair) in b.chunks(2).enumerate() {
        match std::str::from_utf8(pair)
            .ok()
            .and_then(|p| u8::from_str_radix(p, 16).ok())
        {
            Some(x) => out[i] = x,
            None => return [0; 32],
        }
    }
    out
}

impl gwtf_peer {
    fn stage(&self) -> u32 {
        self.stage.load(Ordering::Relaxed)
    }

    fn next(&self, timeout: Duration) -> FfiResult<gwtf_peer_task> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.events.try_recv() {
                Ok(e) => {
                    if let NodeEvent::Protocol(Event::Active { stage }) = &e {
                        self.stage.store(*stage as u32, Ordering::Relaxed);
                    }
                    if let NodeEvent::Checkpoint { iteration, states } = e {
                        let mut t = blank_task();
                        t.kind = gwtf_task_kind::EventCheckpoint as i32;
                        t.iteration = iteration;
                        t.has_iteration = 1;
                        t.microbatches = states.len() as u64;
                        t.bytes = states.iter().map(|s| s.state.len() as u64).sum();
                        let m = format!(
                            "a checkpoint of every stage's state after the update of \
                             iteration {iteration} ({} bytes)",
                            t.bytes
                        );
                        fill(&mut t.message, &m);
                        let mut c = self.checkpoints.lock();
                        c.push_back((iteration, states));
                        while c.len() > CHECKPOINTS_KEPT {
                            c.pop_front();
                        }
                        self.counters.events.fetch_add(1, Ordering::Relaxed);
                        return Ok(t);
                    }
                    if let Some(t) = event_of(&e, self.id, self.stage()) {
                        self.counters.events.fetch_add(1, Ordering::Relaxed);
                        return Ok(t);
                    }
                    continue;
                }
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => {}
            }
            if self.port.is_stopped() {
                return Err(FfiError::new(
                    gwtf_status::Closed,
                    "the peer has stopped (left, or failed: see its error events)",
                ));
            }
            let now = Instant::now();
            let slice = deadline
                .saturating_duration_since(now)
                .min(Duration::from_millis(20));
            if let Some(w) = self.port.next_work(slice) {
                let id = w.id;
                let (t, held) = task_of(w, self.port.sizes());
                self.held.lock().insert(id, held);
                self.counters.given.fetch_add(1, Ordering::Relaxed);
                return Ok(t);
            }
            if Instant::now() >= deadline {
                return Err(FfiError::new(
                    gwtf_status::Timeout,
                    "no task or event within the timeout",
                ));
            }
        }
    }

    /// Hands `result` to the runtime; a refused one comes back.
    #[allow(clippy::result_large_err)]
    fn answer(
        &self,
        id: WorkId,
        result: Result<Output, String>,
    ) -> Result<(), (FfiError, Result<Output, String>)> {
        if !self.held.lock().contains_key(&id) {
            let closed = self.port.is_stopped();
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            let e = if closed {
                FfiError::new(
                    gwtf_status::Closed,
                    format!("task {id}: the peer has stopped"),
                )
            } else {
                FfiError::new(
                    gwtf_status::NotFound,
                    format!("task {id} is not outstanding (never given, or answered already)"),
                )
            };
            return Err((e, result));
        }
        let failed = result.is_err();
        match self.port.try_complete(id, result) {
            Ok(()) => {
                self.held.lock().remove(&id);
                let c = if failed {
                    &self.counters.failed
                } else {
                    &self.counters.done
                };
                c.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err((e, back)) => {
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                let status = match e {
                    CompleteError::UnknownWork(_) => gwtf_status::NotFound,
                    CompleteError::BadOutput { .. } => gwtf_status::InvalidArgument,
                    CompleteError::Stopped => gwtf_status::Closed,
                };
                if status == gwtf_status::Closed {
                    // Nothing more will come for it.
                    self.held.lock().remove(&id);
                }
                Err((FfiError::new(status, e.to_string()), back))
            }
        }
    }

    fn held_kind(&self, id: WorkId) -> Option<WorkKind> {
        self.held.lock().get(&id).map(|h| h.kind.clone())
    }
}

/// The next task for the trainer, or the next event, waiting up to
/// `timeout_ms`. Events come first. Barrier tasks (gradient, apply,
/// export, import) are handed out only when every task before them is
/// answered, and no task while one is out; compute tasks may be taken by
/// several threads at once.
///
/// `task_size` is `sizeof(gwtf_peer_task)` as the caller knows it (a newer
/// library writes only that much).
///
/// Ownership: `out_task` is caller memory, written on success. Its
/// `input`, `granted` and `mean` point into memory the library keeps until
/// the task is answered (`gwtf_peer_task_done*` or `gwtf_peer_task_failed`,
/// whatever the answer's status) or the peer is freed: read them, never
/// free them.
///
/// Thread safety: any thread, concurrently with other calls on `peer`;
/// each task goes to exactly one caller.
///
/// Errors: `GWTF_STATUS_TIMEOUT` (nothing yet), `GWTF_STATUS_CLOSED` (the
/// peer left or failed; no more tasks will come), `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_INVALID_ARGUMENT` (`task_size` smaller than version 1's).
#[no_mangle]
pub extern "C" fn gwtf_peer_next_task(
    peer: *mut gwtf_peer,
    timeout_ms: u32,
    out_task: *mut gwtf_peer_task,
    task_size: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        require_out(out_task, "out_task")?;
        if task_size < std::mem::size_of::<gwtf_peer_task>() {
            return Err(FfiError::invalid(format!(
                "task_size {task_size} is smaller than gwtf_peer_task ({} bytes)",
                std::mem::size_of::<gwtf_peer_task>()
            )));
        }
        let t = p.next(Duration::from_millis(timeout_ms as u64))?;
        // SAFETY: out_task is valid for task_size bytes.
        unsafe { write_sized(out_task, task_size, &t) };
        Ok(())
    })
}

/// Allocates an output frame of `len` bytes from the peer's pool (waiting
/// up to `timeout_ms` when it is full), for an answer: fill its payload
/// through `gwtf_frame_get_view(...).data`, then pass it to
/// `gwtf_peer_task_done` or `gwtf_peer_task_done_loss`.
///
/// Ownership: the caller owns `*out_frame` until an answer accepts it (or
/// it releases it with `gwtf_frame_release`).
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: `GWTF_STATUS_LIMIT_EXCEEDED` (above the largest payload),
/// `GWTF_STATUS_TIMEOUT` (pool exhausted), `GWTF_STATUS_CLOSED`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_peer_alloc(
    peer: *mut gwtf_peer,
    len: u64,
    timeout_ms: u32,
    out_frame: *mut *mut gwtf_frame,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        require_out(out_frame, "out_frame")?;
        if p.port.is_stopped() {
            return Err(FfiError::new(gwtf_status::Closed, "the peer has stopped"));
        }
        let len = usize::try_from(len)
            .map_err(|_| FfiError::new(gwtf_status::LimitExceeded, "len too large"))?;
        let f = p
            .port
            .alloc_within(len, Duration::from_millis(timeout_ms as u64))
            .map_err(engine_err)?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_frame, gwtf_frame::boxed(f)) };
        Ok(())
    })
}

/// Runs an answer that may carry a frame: the frame passes to the library
/// only when the answer is accepted; a refused answer leaves it with the
/// caller, as it was.
fn answer_with_frame(
    p: &gwtf_peer,
    id: WorkId,
    frame: *mut gwtf_frame,
    make: impl FnOnce(Option<Frame>) -> Output,
) -> FfiResult<()> {
    let handle = if frame.is_null() {
        None
    } else {
        // SAFETY: the caller passes NULL or a live frame of ours.
        Some(unsafe { check_handle(frame as *const gwtf_frame)? })
    };
    let taken = match handle {
        Some(h) => Some(
            h.take()
                .ok_or_else(|| FfiError::invalid("frame was already consumed"))?,
        ),
        None => None,
    };
    match p.answer(id, Ok(make(taken))) {
        Ok(()) => {
            // SAFETY: the frame's contents passed to the runtime; its
            // (now empty) handle is freed, as the docs say.
            unsafe { free_handle(frame) };
            Ok(())
        }
        Err((e, back)) => {
            if let (
                Some(h),
                Ok(Output::Tensor(f) | Output::State(f) | Output::Loss { grad: f, .. }),
            ) = (handle, back)
            {
                h.put(f)
            }
            Err(e)
        }
    }
}

/// Answers a task with its output frame: the activation (embed, forward),
/// the input gradient (backward), the state (export), or NULL (embed
/// backward, forget). The frame must have `task.output_bytes` bytes (a
/// state any length but 0). Zero copy: the library keeps this frame (its
/// pool slot) for as long as the protocol may need to send it again after
/// a crash, and every send writes that same slot to the socket.
///
/// Ownership: on success `output` passes to the library (never use or
/// release it again) and the task's input, granted list and mean are
/// released. On failure nothing changed: `output` is still the caller's,
/// and the task is still outstanding unless the status is
/// `GWTF_STATUS_CLOSED` or `GWTF_STATUS_NOT_FOUND`.
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: `GWTF_STATUS_NOT_FOUND` (no such task outstanding: never given,
/// or answered already), `GWTF_STATUS_INVALID_ARGUMENT` (the output does
/// not fit the task: wrong size, a frame where none is due, or a task that
/// takes another answer function), `GWTF_STATUS_CLOSED` (the peer stopped:
/// a late answer), `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_peer_task_done(
    peer: *mut gwtf_peer,
    task_id: u64,
    output: *mut gwtf_frame,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        let kind = p.held_kind(task_id);
        answer_with_frame(p, task_id, output, |f| match (f, kind) {
            (None, _) => Output::None,
            (Some(f), Some(WorkKind::ExportState)) => Output::State(f),
            (Some(f), _) => Output::Tensor(f),
        })
    })
}

/// Answers a loss task: the microbatch's mean loss and the frame with the
/// gradient of the task's input (`task.output_bytes` bytes).
///
/// Ownership: as `gwtf_peer_task_done`: `grad` passes to the library only
/// on success.
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: as `gwtf_peer_task_done`; also `GWTF_STATUS_INVALID_ARGUMENT`
/// for a loss that is not finite.
#[no_mangle]
pub extern "C" fn gwtf_peer_task_done_loss(
    peer: *mut gwtf_peer,
    task_id: u64,
    loss: f32,
    grad: *mut gwtf_frame,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        if grad.is_null() {
            return Err(FfiError::null("grad"));
        }
        answer_with_frame(p, task_id, grad, |f| match f {
            Some(grad) => Output::Loss { loss, grad },
            None => Output::None,
        })
    })
}

/// # Safety
/// `p` must be NULL or valid for 32 reads.
unsafe fn digest(p: *const u8) -> FfiResult<[u8; 32]> {
    if p.is_null() {
        return Err(FfiError::null("weights"));
    }
    let mut d = [0u8; 32];
    // SAFETY: per the function contract.
    unsafe { std::ptr::copy_nonoverlapping(p, d.as_mut_ptr(), 32) };
    Ok(d)
}

/// Answers a gradient task: `sum` (`len` floats), the sum of the kept
/// parameter gradients of exactly the granted microbatches (all zeros when
/// none is granted: every member of the stage takes part, with the same
/// length), and `weights`
/// (`GWTF_DIGEST_LEN` bytes), the digest of the weights the gradients were
/// computed on (every member of the stage must report the same). The
/// library all-reduces the sum with the stage's other members and later
/// hands the mean back in an apply task.
///
/// This answer copies: `sum` is copied once into the library (the
/// all-reduce works on its own buffer); the caller's buffer is free again
/// when the call returns.
///
/// Ownership: `sum` and `weights` are only read during the call.
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: as `gwtf_peer_task_done`; `GWTF_STATUS_INVALID_ARGUMENT` also
/// for a sum with an element that is not finite, or of another length than
/// the stage's members agreed on in an earlier all-reduce (the task stays
/// open for a corrected answer).
#[no_mangle]
pub extern "C" fn gwtf_peer_task_done_gradient(
    peer: *mut gwtf_peer,
    task_id: u64,
    sum: *const f32,
    len: usize,
    weights: *const u8,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        // SAFETY: the caller passes 32 readable bytes.
        let weights = unsafe { digest(weights)? };
        let sum = if len == 0 {
            Vec::new()
        } else if sum.is_null() {
            return Err(FfiError::null("sum (with len > 0)"));
        } else {
            // SAFETY: non-NULL; the caller passes len readable floats.
            unsafe { std::slice::from_raw_parts(sum, len) }.to_vec()
        };
        p.answer(task_id, Ok(Output::Gradient { sum, weights }))
            .map_err(|(e, _)| e)
    })
}

/// Answers an apply or import task with the digest (`GWTF_DIGEST_LEN`
/// bytes) of the weights after it. Replicas of a stage that applied the
/// same updates must report the same digest: the library compares them.
///
/// Ownership: `weights` is only read during the call.
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: as `gwtf_peer_task_done`.
#[no_mangle]
pub extern "C" fn gwtf_peer_task_done_weights(
    peer: *mut gwtf_peer,
    task_id: u64,
    weights: *const u8,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        // SAFETY: the caller passes 32 readable bytes.
        let weights = unsafe { digest(weights)? };
        p.answer(task_id, Ok(Output::Weights(weights)))
            .map_err(|(e, _)| e)
    })
}

/// Answers an average-states task (`GWTF_TASK_KIND_AVERAGE_STATES`) with
/// the digest (`GWTF_DIGEST_LEN` bytes) of the rebuilt weights and how
/// many of the task's states they average (0: none fitted the stage's
/// shapes, and the trainer took the initial weights).
///
/// Ownership: `weights` is only read during the call.
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: as `gwtf_peer_task_done`; `GWTF_STATUS_INVALID_ARGUMENT` when
/// the task is of another kind or `averaged` exceeds the states it gave.
#[no_mangle]
pub extern "C" fn gwtf_peer_task_done_rebuilt(
    peer: *mut gwtf_peer,
    task_id: u64,
    weights: *const u8,
    averaged: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        // SAFETY: the caller passes 32 readable bytes.
        let weights = unsafe { digest(weights)? };
        let given = match p.held.lock().get(&task_id).map(|h| &h.kind) {
            Some(WorkKind::AverageStates { states, .. }) => Some(states.len()),
            _ => None,
        };
        if let Some(n) = given.filter(|&n| averaged as usize > n) {
            p.counters.refused.fetch_add(1, Ordering::Relaxed);
            return Err(FfiError::invalid(format!(
                "task {task_id}: {averaged} states averaged, but it gave {n}"
            )));
        }
        p.answer(task_id, Ok(Output::Rebuilt { weights, averaged }))
            .map_err(|(e, _)| e)
    })
}

/// Reports that the trainer could not do a task (`reason`, UTF-8). The
/// library reports it as an error event and the protocol's recovery redoes
/// the microbatch elsewhere; a failed import stops the peer.
///
/// Ownership: `reason` is only read during the call (NULL: no reason).
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: `GWTF_STATUS_NOT_FOUND`, `GWTF_STATUS_CLOSED`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_peer_task_failed(
    peer: *mut gwtf_peer,
    task_id: u64,
    reason: *const c_char,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        let reason = if reason.is_null() {
            "no reason given".to_string()
        } else {
            c_str(reason, "reason")?.to_string()
        };
        p.answer(task_id, Err(reason)).map_err(|(e, _)| e)
    })
}

fn stats_of(p: &gwtf_peer, rt: Option<&Runtime>) -> gwtf_peer_stats {
    let mut s = match rt {
        None => *p.last.lock(),
        Some(rt) => {
            let c = rt.compute_stats();
            let n = rt.net_stats();
            gwtf_peer_stats {
                compute_ns: c.compute.as_nanos() as u64,
                useful_ns: c.useful.as_nanos() as u64,
                frames_sent: n.frames_sent,
                frames_received: n.frames_received,
                bytes_sent: n.bytes_sent,
                bytes_received: n.bytes_received,
                user_copies: n.user_copies,
                peers_connected: n.peers_connected,
                peers_lost: n.peers_lost,
                pool_capacity_bytes: n.pool.capacity_bytes,
                pool_in_use_bytes: n.pool.in_use_bytes,
                ..Default::default()
            }
        }
    };
    s.version = GWTF_PEER_STATS_VERSION;
    s.tasks_given = p.counters.given.load(Ordering::Relaxed);
    s.tasks_done = p.counters.done.load(Ordering::Relaxed);
    s.tasks_failed = p.counters.failed.load(Ordering::Relaxed);
    s.answers_refused = p.counters.refused.load(Ordering::Relaxed);
    s.events = p.counters.events.load(Ordering::Relaxed);
    s
}

/// Writes the peer's counters into `out_stats`, of which the caller says
/// the size (`sizeof(gwtf_peer_stats)`): an older, smaller struct gets the
/// fields it knows. After `gwtf_peer_leave` the transport's and compute
/// counters are those at the time it left.
///
/// Ownership: `out_stats` is caller memory of `stats_size` bytes.
///
/// Thread safety: any thread, concurrently with other calls on `peer`.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_peer_get_stats(
    peer: *const gwtf_peer,
    out_stats: *mut gwtf_peer_stats,
    stats_size: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        require_out(out_stats, "out_stats")?;
        let v = {
            let rt = p.rt.lock();
            stats_of(p, rt.as_ref())
        };
        // SAFETY: out_stats is valid for stats_size bytes.
        unsafe { write_sized(out_stats, stats_size, &v) };
        Ok(())
    })
}

/// Leaves the swarm gracefully: the protocol says goodbye (the stage's
/// coordinator removes this member; its microbatches in flight are
/// redone elsewhere), and the peer's threads stop. Waits until done.
/// Afterwards `gwtf_peer_next_task` says `GWTF_STATUS_CLOSED`, answers are
/// refused with it, and the input leases of unanswered tasks stay valid
/// until `gwtf_peer_free`. Idempotent.
///
/// Ownership: `peer` is only borrowed; free it with `gwtf_peer_free`.
///
/// Thread safety: any thread; other threads may be in `next_task` (they
/// return `GWTF_STATUS_CLOSED`).
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_peer_leave(
    peer: *mut gwtf_peer,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, peer, |p| {
        let rt = {
            let mut g = p.rt.lock();
            if let Some(rt) = g.as_ref() {
                *p.last.lock() = stats_of(p, Some(rt));
            }
            g.take()
        };
        if let Some(rt) = rt {
            rt.leave();
        }
        Ok(())
    })
}

/// Frees a peer. Without `gwtf_peer_leave` first this is abrupt, as a
/// crash is for the others (they recover). `gwtf_peer_free(NULL)` does
/// nothing. Frames the caller still holds stay valid until released.
///
/// Ownership: takes ownership of `peer`; every pointer a task gave
/// (`input`, `granted`, `mean`) is invalid afterwards.
///
/// Thread safety: no other thread may use `peer` during or after this call.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_peer_free(peer: *mut gwtf_peer) {
    // SAFETY: the caller passes NULL or a peer from gwtf_peer_new, once.
    unsafe { free_handle(peer) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::FenceReason;

    fn message(t: &gwtf_peer_task) -> String {
        // SAFETY: `fill` always NUL-terminates within the array.
        unsafe { std::ffi::CStr::from_ptr(t.message.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    /// A trainer sees its peer fence itself and each address that cannot
    /// be reached, with what happened in `message`.
    #[test]
    fn fences_and_unreachable_addresses_reach_the_trainer() {
        let fenced = NodeEvent::Protocol(Event::Fenced {
            reason: FenceReason::Paused { gap: 2_000_000 },
            incarnation: 1,
        });
        let t = event_of(&fenced, 7, 2).expect("told");
        assert_eq!(t.kind, gwtf_task_kind::EventFenced as i32);
        assert_eq!(t.stage, 2);
        let m = message(&t);
        assert!(m.contains("paused") && m.contains("incarnation 1"), "{m}");

        let failed = NodeEvent::ConnectFailed {
            addr: "127.0.0.1:9".parse().unwrap(),
            attempts: 5,
            reason: "Connection refused".into(),
        };
        let t = event_of(&failed, 7, 0).expect("told");
        assert_eq!(t.kind, gwtf_task_kind::EventConnectFailed as i32);
        let m = message(&t);
        assert!(m.contains("127.0.0.1:9") && m.contains("refused"), "{m}");
    }

    /// A task's typed fields and its text are the schema's: the text is the
    /// line's sentence, the digest the bytes the trainer reported, and a
    /// divergence of replicas reaches the trainer as an error.
    #[test]
    fn event_tasks_are_made_from_the_event_schema() {
        let applied = NodeEvent::Applied {
            stage: 3,
            iteration: 41,
            weights: std::array::from_fn(|i| i as u8 * 7),
            microbatches: 6,
        };
        let t = event_of(&applied, 7, 0).expect("told");
        assert_eq!(t.kind, gwtf_task_kind::EventApplied as i32);
        assert_eq!((t.stage, t.iteration, t.has_iteration), (3, 41, 1));
        assert_eq!(t.microbatches, 6);
        assert_eq!(t.weights, std::array::from_fn(|i| i as u8 * 7));
        let line = LogEvent::of(7, &applied, 0).unwrap();
        assert_eq!(message(&t), line.sentence());

        let loss = 2.364_528_4_f32;
        let it = NodeEvent::Iteration {
            iteration: 2,
            loss,
            microbatches: 4,
        };
        let t = event_of(&it, 7, 1).expect("told");
        assert_eq!(t.loss.to_bits(), loss.to_bits());

        let diverged = NodeEvent::Protocol(Event::ReplicasDiverged {
            stage: 2,
            iter: 9,
            digests: vec![(1, 1), (2, 2)],
        });
        let t = event_of(&diverged, 7, 1).expect("told");
        assert_eq!(t.kind, gwtf_task_kind::EventError as i32);
        assert_eq!((t.stage, t.iteration), (2, 9));
        assert!(message(&t).contains("disagree"), "{}", message(&t));

        let kept = NodeEvent::CopyKept {
            stage: 1,
            iteration: 3,
            version: 5,
            from: 2,
            bytes: 10,
            ms: 1.0,
        };
        assert!(event_of(&kept, 7, 0).is_none());
    }

    #[test]
    fn digests_read_back_from_hex_or_are_zero() {
        let d: [u8; 32] = std::array::from_fn(|i| 255 - i as u8);
        let hex: String = d.iter().map(|x| format!("{x:02x}")).collect();
        assert_eq!(digest_of(&hex), d);
        assert_eq!(digest_of(&hex.to_uppercase()), d);
        assert_eq!(digest_of(""), [0; 32]);
        assert_eq!(digest_of(&hex[2..]), [0; 32]);
        assert_eq!(digest_of(&format!("zz{}", &hex[2..])), [0; 32]);
        assert_eq!(digest_of(&"é".repeat(32)), [0; 32]);
    }
}
