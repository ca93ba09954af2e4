//! The transport engine: one poll thread (mio) owns every socket of a node;
//! trainer threads talk to it through channels.
//!
//! - Commands (connect, send, disconnect, shutdown) go in through a crossbeam
//!   channel plus one mio `Waker` (woken only when the poll thread sleeps).
//! - Received frames and events come out through channels; no user code runs
//!   on the poll thread.
//! - A frame to send is a pool [`Lease`] the trainer filled; the poll thread
//!   writes header + lease with vectored writes (no staging copy). A received
//!   payload is read from the socket straight into a lease.
//! - Back-pressure: each peer has a bounded send queue; [`Transport::send`] waits
//!   up to its timeout for room (timeout 0: would-block). Receiving stops when
//!   the pool is full, so memory stays bounded and TCP pushes back.
//! - Two lanes per connection: control frames (heartbeats, control
//!   messages) never wait behind data. They have a queue of their own
//!   ([`CONTROL_QUEUE_DEPTH`] frames, apart from the data frames' room) and
//!   go out first; a data payload longer than a slice (at most 256 KiB, and
//!   about 10 ms of an emulated link's bandwidth) is sent as a sliced frame
//!   ([`crate::wire::conn`]), so control frames wait at most one slice. Data
//!   frames stay in order among themselves, as do control frames; a control
//!   message sent after a data frame may arrive before it (the simulator's
//!   links behave the same way). A goodbye goes after the data queued before
//!   it. Any byte received counts as a sign of life for the dead-peer timeout.
//! - Connections start with the authenticated handshake of [`crate::wire`];
//!   heartbeats, dead-peer detection, handshake and frame deadlines, graceful
//!   goodbye, and an optional user-space link emulation (delay, bandwidth).
//! - Few wake-ups per frame, since on small machines they cost more than the
//!   bytes: inside a payload the socket's receive low-water mark is raised
//!   to what the frame still needs (up to 1 MiB), so the poll thread wakes
//!   once per MiB, not once per segment; a sender blocked on a full queue
//!   resumes at half depth and refills several frames at once; and a send to
//!   a peer whose socket is full does not wake the poll thread (the socket's
//!   writable event will).

mod admission;
mod poll;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::{Condvar, Mutex, RwLock};

use crate::pool::{Lease, Pool, PoolError, PoolStats};
use crate::wire::{
    crc32c, ControlEnvelope, FrameHeader, FrameKind, GoodbyeReason, NodeKey, SwarmKey, WireError,
    FLAG_PAYLOAD_CRC, FRAME_MAGIC, WIRE_VERSION,
};

/// User-space emulation of a slow, far link, applied on the send side of
/// every connection of a node (the kernel here has no netem).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkEmulation {
    /// Added one-way delay: a frame may start leaving this long after `send`.
    pub delay: Duration,
    /// Bandwidth cap in bytes per second (0: unlimited), a token bucket.
    pub bandwidth_bytes_per_s: u64,
}

/// How a node is set up.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// Address to accept peers on (None: outbound connections only).
    pub listen: Option<SocketAddr>,
    /// The swarm key (at least 16 bytes) every participant shares.
    pub swarm_key: Vec<u8>,
    /// This node's id: 0 for the one that follows from `node_key`; any
    /// other value must be that id, unless `chosen_ids`.
    pub node_id: u64,
    /// Largest data payload sent or accepted.
    pub max_payload: u64,
    /// Bytes of the frame pool (rounded up to whole largest slots).
    pub pool_bytes: usize,
    /// Frames queued per peer before `send` waits.
    pub send_queue_depth: usize,
    /// Most connections (handshaking or established) at once.
    pub max_connections: usize,
    /// Most inbound connections from one source address.
    pub max_connections_per_address: usize,
    /// Most inbound handshakes in progress from one source address.
    pub max_handshakes_per_address: usize,
    /// Most handshakes in progress at once (inbound and outbound).
    pub max_handshakes: usize,
    /// Most connections one node id may have at once (two when both ends
    /// dial; more only while a broken one is being replaced).
    pub max_connections_per_id: usize,
    /// Send a heartbeat after this much idle time on a link.
    pub heartbeat_interval: Duration,
    /// A peer silent for this long is reported lost.
    pub peer_timeout: Duration,
    /// A handshake must complete within this.
    pub handshake_timeout: Duration,
    /// A frame must arrive within this from its first byte; a data frame's
    /// payload earns `bytes / min_frame_rate` more per byte received (a
    /// half-sent frame holds its pool slot only while its bytes keep
    /// coming at that rate).
    pub frame_timeout: Duration,
    /// Slowest accepted payload rate in bytes per second (see `frame_timeout`).
    pub min_frame_rate: u64,
    /// Outbound connection attempts before giving up.
    pub connect_attempts: u32,
    /// First retry delay; doubles up to `connect_backoff_max`.
    pub connect_backoff: Duration,
    pub connect_backoff_max: Duration,
    /// Payloads up to this many bytes get a CRC32C; larger ones only when
    /// the frame's flags ask for it (the header always has its own CRC).
    pub payload_crc_max: u64,
    /// Optional link emulation (tests and demos).
    pub link: Option<LinkEmulation>,
    /// Per-peer link emulation: the connection to a peer named here, once
    /// the handshake names the peer, takes its delay and bandwidth instead
    /// of `link`'s (a testbed's pairwise latencies between regions).
    pub peer_links: Option<Arc<BTreeMap<u64, LinkEmulation>>>,
    /// Log connection events and refusals to stderr.
    pub log: bool,
    /// This node's key pair, proved in every handshake (None: a fresh one
    /// for this node's lifetime).
    pub node_key: Option<NodeKey>,
    /// Encrypt frame payloads (a connection encrypts when either end asks;
    /// every frame is authenticated either way).
    pub encrypt: bool,
    /// Insecure, for test swarms with fixed ids: this node may take any
    /// id, and accepts peers whose ids do not follow from their keys, so
    /// any holder of the swarm key can act as any node. Off (the default):
    /// every id is the one of its node key, checked in every handshake.
    pub chosen_ids: bool,
}

impl Default for NodeOptions {
    fn default() -> Self {
        Self {
            listen: None,
            swarm_key: Vec::new(),
            node_id: 0,
            max_payload: 64 << 20,
            pool_bytes: 256 << 20,
            send_queue_depth: 8,
            max_connections: 1024,
            max_connections_per_address: 64,
            max_handshakes_per_address: 16,
            max_handshakes: 256,
            max_connections_per_id: 4,
            heartbeat_interval: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(10),
            min_frame_rate: 1 << 20,
            connect_attempts: 5,
            connect_backoff: Duration::from_millis(100),
            connect_backoff_max: Duration::from_secs(2),
            payload_crc_max: u64::MAX,
            link: None,
            peer_links: None,
            log: false,
            node_key: None,
            encrypt: false,
            chosen_ids: false,
        }
    }
}

/// Why a connection was closed (or refused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// The peer said goodbye.
    Goodbye {
        reason: GoodbyeReason,
        message: String,
    },
    /// Nothing arrived for longer than the peer timeout.
    PeerTimeout { silent_for: Duration },
    /// The handshake did not complete in time (slow or silent peer).
    HandshakeTimeout,
    /// A frame did not complete in time (slowloris).
    FrameTimeout,
    /// The peer closed the connection; `mid_frame` when inside a frame.
    Eof { mid_frame: bool, in_handshake: bool },
    /// An I/O error on the socket.
    Io(String),
    /// The peer broke the protocol or failed authentication.
    Protocol(WireError),
    /// A second connection to an already connected peer.
    Duplicate,
    /// Too many connections.
    TooManyConnections,
    /// This node closed it (disconnect or shutdown).
    Local,
    /// Refused by an intake limit (per address, handshakes at once, per
    /// node id); says which.
    Limit(String),
}

impl CloseReason {
    /// Stable numeric code (`GWTF_CLOSE_REASON_*`).
    pub fn code(&self) -> i32 {
        match self {
            CloseReason::Goodbye { .. } => 1,
            CloseReason::PeerTimeout { .. } => 2,
            CloseReason::HandshakeTimeout => 3,
            CloseReason::FrameTimeout => 4,
            CloseReason::Eof { .. } => 5,
            CloseReason::Io(_) => 6,
            CloseReason::Protocol(
                WireError::AuthFailed | WireError::IdNotBound { .. } | WireError::KeyChanged { .. },
            ) => 8,
            CloseReason::Protocol(WireError::Mac { .. }) => 12,
            CloseReason::Protocol(_) => 7,
            CloseReason::Duplicate => 9,
            CloseReason::TooManyConnections => 10,
            CloseReason::Local => 11,
            CloseReason::Limit(_) => 13,
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::Goodbye { reason, message } => {
                write!(f, "peer said goodbye ({reason:?}): {message}")
            }
            CloseReason::PeerTimeout { silent_for } => {
                write!(f, "peer silent for {silent_for:?} (dead peer timeout)")
            }
            CloseReason::HandshakeTimeout => write!(f, "handshake deadline passed"),
            CloseReason::FrameTimeout => write!(f, "frame deadline passed (peer too slow)"),
            CloseReason::Eof {
                mid_frame,
                in_handshake,
            } => {
                if *in_handshake {
                    write!(f, "connection closed by peer during the handshake")
                } else if *mid_frame {
                    write!(f, "connection closed by peer in the middle of a frame")
                } else {
                    write!(f, "connection closed by peer")
                }
            }
            CloseReason::Io(e) => write!(f, "i/o error: {e}"),
            CloseReason::Protocol(e) => write!(f, "protocol violation: {e}"),
            CloseReason::Duplicate => write!(f, "duplicate connection to the same peer"),
            CloseReason::TooManyConnections => write!(f, "too many connections"),
            CloseReason::Local => write!(f, "closed by this node"),
            CloseReason::Limit(why) => write!(f, "intake limit: {why}"),
        }
    }
}

/// Something that happened to a node's connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportEvent {
    /// A peer completed the handshake.
    PeerConnected {
        peer: u64,
        addr: SocketAddr,
        outbound: bool,
    },
    /// An authenticated peer is gone (its queued frames were dropped). A
    /// `PeerConnected` for it follows at once when another connection to
    /// it takes over (both had dialled; what was on the wire of the broken
    /// one may be lost).
    PeerLost {
        peer: u64,
        addr: SocketAddr,
        reason: CloseReason,
    },
    /// A connection was refused before it was authenticated.
    Refused {
        addr: SocketAddr,
        inbound: bool,
        reason: CloseReason,
    },
    /// An outbound connection failed after every attempt.
    ConnectFailed {
        addr: SocketAddr,
        attempts: u32,
        reason: String,
    },
    /// A typed control message from a peer.
    Control { peer: u64, msg: ControlEnvelope },
}

/// Control frames queued per peer before [`Transport::send_control`] waits (apart
/// from the data frames' `send_queue_depth`: control never waits for data).
pub const CONTROL_QUEUE_DEPTH: usize = 256;

/// Events a node queues for its caller. Past `EVENT_QUEUE - EVENT_ROOM`
/// queued events the poll thread stops reading control messages (TCP pushes
/// back on the peers) instead of dropping them; the room left is for
/// connection events.
pub(crate) const EVENT_QUEUE: usize = 4096;
pub(crate) const EVENT_ROOM: usize = 64;

/// What [`Transport::next_incoming`] hands over.
#[derive(Debug)]
pub enum Incoming {
    Frame(Frame),
    Event(TransportEvent),
}

/// Errors of the engine API.
#[derive(Debug)]
pub enum EngineError {
    InvalidArgument(String),
    LimitExceeded(String),
    Pool(PoolError),
    /// Timed out (with a zero timeout: would block).
    Timeout(String),
    NotFound(String),
    Closed(String),
    Io(std::io::Error),
    Wire(WireError),
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineError::InvalidArgument(s) => write!(f, "invalid argument: {s}"),
            EngineError::LimitExceeded(s) => write!(f, "limit exceeded: {s}"),
            EngineError::Pool(e) => write!(f, "{e}"),
            EngineError::Timeout(s) => write!(f, "timeout: {s}"),
            EngineError::NotFound(s) => write!(f, "not found: {s}"),
            EngineError::Closed(s) => write!(f, "closed: {s}"),
            EngineError::Io(e) => write!(f, "i/o error: {e}"),
            EngineError::Wire(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for EngineError {}

impl From<PoolError> for EngineError {
    fn from(e: PoolError) -> Self {
        EngineError::Pool(e)
    }
}

/// A frame: header plus payload in a pool lease. Allocated by [`Transport::alloc`]
/// to be filled and sent, or received by [`Transport::recv`]. Dropping it releases
/// the lease.
pub struct Frame {
    pub header: FrameHeader,
    lease: Option<Lease>,
    peer: u64,
}

impl fmt::Debug for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Frame")
            .field("peer", &self.peer)
            .field("len", &self.len())
            .field("header", &self.header)
            .finish()
    }
}

impl Frame {
    /// The sender (for received frames; 0 for allocated ones).
    pub fn peer(&self) -> u64 {
        self.peer
    }
    pub fn len(&self) -> usize {
        self.lease.as_ref().map_or(0, Lease::len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn payload(&self) -> &[u8] {
        self.lease.as_ref().map_or(&[], Lease::as_slice)
    }
    pub fn payload_mut(&mut self) -> &mut [u8] {
        self.lease.as_mut().map_or(&mut [], Lease::as_mut_slice)
    }
    /// Shortens the payload to `len` bytes (no effect if it is not longer).
    pub fn truncate(&mut self, len: usize) {
        if let Some(l) = self.lease.as_mut() {
            l.truncate(len);
        }
    }
    /// Lengthens the payload to `len` bytes within its pool slot (the added
    /// bytes are not cleared); false, and unchanged, where the slot is
    /// shorter or there is no payload.
    pub fn grow_within_slot(&mut self, len: usize) -> bool {
        self.lease.as_mut().is_some_and(|l| l.grow_within_slot(len))
    }
    /// Pointer to the payload (NULL for an empty one).
    pub fn payload_ptr(&self) -> *mut u8 {
        self.lease
            .as_ref()
            .map_or(std::ptr::null_mut(), Lease::as_ptr)
    }
}

/// A frame whose payload is shared and read-only: kept by its owner while
/// [`Transport::send_shared`] sends it (no copy), as often as needed. The lease
/// returns to the pool when the last holder lets go.
#[derive(Clone)]
pub struct SharedFrame {
    pub header: FrameHeader,
    lease: Option<Arc<Lease>>,
}

impl fmt::Debug for SharedFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedFrame")
            .field("len", &self.len())
            .field("header", &self.header)
            .finish()
    }
}

impl SharedFrame {
    /// A frame with no payload (a default header), for tests and for
    /// messages whose data is empty.
    pub fn empty() -> SharedFrame {
        SharedFrame {
            header: FrameHeader::default(),
            lease: None,
        }
    }
    pub fn len(&self) -> usize {
        self.lease.as_ref().map_or(0, |l| l.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn payload(&self) -> &[u8] {
        self.lease.as_ref().map_or(&[], |l| l.as_slice())
    }
    /// Whether another holder still has this payload: a send queue that
    /// has not written it out yet (the engine lets go of its share once
    /// the frame is on the socket, or dropped with its connection).
    pub fn held_elsewhere(&self) -> bool {
        self.lease
            .as_ref()
            .is_some_and(|l| Arc::strong_count(l) > 1)
    }
}

impl From<Frame> for SharedFrame {
    fn from(f: Frame) -> SharedFrame {
        SharedFrame {
            header: f.header,
            lease: f.lease.map(Arc::new),
        }
    }
}

/// Counters of a node (monotonic unless noted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    pub frames_sent: u64,
    pub frames_received: u64,
    /// Data payload bytes.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Every byte written to / read from sockets (headers, handshakes, control).
    pub wire_bytes_sent: u64,
    pub wire_bytes_received: u64,
    /// Payload bytes copied in user space by the library (its only copy sites
    /// count here; the data path has none).
    pub user_copies: u64,
    pub user_copy_bytes: u64,
    pub heartbeats_sent: u64,
    pub heartbeats_received: u64,
    pub write_calls: u64,
    pub read_calls: u64,
    /// Peers connected now (gauge).
    pub peers_connected: u64,
    pub peers_lost: u64,
    pub connections_refused: u64,
    /// Refusals of inbound connections counted but not reported as events
    /// (a flood from one address is sampled: a few events per second).
    pub refusals_unreported: u64,
    /// Connections closed because a frame's tag did not verify.
    pub tag_failures: u64,
    pub events_dropped: u64,
    /// Duplicate connections (both sides dialled at once) wound down
    /// without losing what travelled on them.
    pub duplicates_retired: u64,
    /// Retired duplicates that took over when the kept connection to
    /// their peer failed (the two sides had kept different ones).
    pub duplicates_promoted: u64,
    pub pool: PoolStats,
}

#[derive(Default)]
pub(crate) struct Counters {
    frames_sent: AtomicU64,
    frames_received: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    wire_bytes_sent: AtomicU64,
    wire_bytes_received: AtomicU64,
    user_copies: AtomicU64,
    user_copy_bytes: AtomicU64,
    heartbeats_sent: AtomicU64,
    heartbeats_received: AtomicU64,
    write_calls: AtomicU64,
    read_calls: AtomicU64,
    peers_connected: AtomicU64,
    peers_lost: AtomicU64,
    connections_refused: AtomicU64,
    refusals_unreported: AtomicU64,
    tag_failures: AtomicU64,
    events_dropped: AtomicU64,
    duplicates_retired: AtomicU64,
    duplicates_promoted: AtomicU64,
}

fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Ordering::Relaxed);
}

/// Per-peer send-queue accounting shared by trainer threads and the poll thread.
pub(crate) struct PeerSlot {
    queued: Mutex<SendQueue>,
    room: Condvar,
    open: AtomicBool,
    /// A sender blocked on a full queue resumes once the queue has drained
    /// to this many frames: it then refills several at once, instead of
    /// waking (and waking the poll thread) once per frame sent.
    resume_at: usize,
    /// Set by the poll thread while this peer's socket refused bytes with
    /// frames still queued: the coming writable event will pick up new
    /// frames, so a sender need not wake the poll thread for them.
    write_blocked: AtomicBool,
    /// Bytes read from this peer (its frames' too, as they come in): a
    /// peer whose large frame streams in over a slow link is alive though
    /// none of its messages got through yet ([`Transport::received_from`]).
    pub(crate) received: AtomicU64,
}

#[derive(Default)]
struct SendQueue {
    /// Data frames queued.
    queued: usize,
    waiting: usize,
    /// Control frames queued (their own room, see [`CONTROL_QUEUE_DEPTH`]).
    control: usize,
}

impl PeerSlot {
    pub(crate) fn new(depth: usize) -> Self {
        Self {
            queued: Mutex::new(SendQueue::default()),
            room: Condvar::new(),
            open: AtomicBool::new(true),
            resume_at: depth / 2,
            write_blocked: AtomicBool::new(false),
            received: AtomicU64::new(0),
        }
    }
    /// `n` frames of a lane left the queue (sent or dropped).
    pub(crate) fn done(&self, n: usize, control: bool) {
        let mut q = self.queued.lock();
        let wake = if control {
            q.control = q.control.saturating_sub(n);
            q.waiting > 0 && q.control < CONTROL_QUEUE_DEPTH
        } else {
            q.queued = q.queued.saturating_sub(n);
            q.waiting > 0 && q.queued <= self.resume_at
        };
        drop(q);
        if wake {
            self.room.notify_all();
        }
    }
    pub(crate) fn close(&self) {
        self.open.store(false, Ordering::SeqCst);
        let _g = self.queued.lock();
        self.room.notify_all();
    }
    pub(crate) fn set_write_blocked(&self, blocked: bool) {
        self.write_blocked.store(blocked, Ordering::SeqCst);
    }
}

/// State shared between the trainer-facing [`Transport`] and the poll thread.
pub(crate) struct Shared {
    pub(crate) node_id: u64,
    pub(crate) opts: NodeOptions,
    pub(crate) pool: Pool,
    pub(crate) peers: RwLock<HashMap<u64, Arc<PeerSlot>>>,
    pub(crate) counters: Counters,
    parked: AtomicBool,
    waker: mio::Waker,
    /// The emulated cut of this node's link ([`Transport::set_link_cut`]).
    pub(crate) link_cut: AtomicBool,
}

impl Shared {
    /// Wakes the poll thread if it sleeps (Dekker pairing with `poll`).
    pub(crate) fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.parked.swap(false, Ordering::SeqCst) {
            let _ = self.waker.wake();
        }
    }
    pub(crate) fn log(&self, msg: impl fmt::Display) {
        if self.opts.log {
            eprintln!("gwtf[node {:x}]: {msg}", self.node_id);
        }
    }
}

/// An item on a connection's send queue.
pub(crate) enum OutPayload {
    None,
    Lease(Lease),
    Shared(Arc<Lease>),
    /// `len` bytes of a shared payload from `start` ([`Transport::send_shared_range`]).
    Range(Arc<Lease>, usize, usize),
    Bytes(Vec<u8>),
}

pub(crate) enum Cmd {
    Connect {
        addr: SocketAddr,
        reply: Option<Sender<Result<u64, String>>>,
    },
    Send {
        peer: u64,
        head: Box<[u8; crate::wire::HEADER_LEN]>,
        payload: OutPayload,
        data_len: u64,
        /// The control lane (heartbeats, control messages): ahead of data.
        control: bool,
    },
    Disconnect {
        peer: u64,
    },
    Shutdown,
}

/// One node's transport: its sockets, connections and frames (see the
/// module docs). Named apart from `protocol::Node`, the state machine whose
/// messages it carries. All methods take `&self` and may be called from any
/// thread.
pub struct Transport {
    shared: Arc<Shared>,
    cmd_tx: Sender<Cmd>,
    frames_rx: Receiver<Frame>,
    events_rx: Receiver<TransportEvent>,
    local_addr: Option<SocketAddr>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stopped: AtomicBool,
}

impl Transport {
    /// Creates a node and starts its poll thread.
    pub fn new(mut opts: NodeOptions) -> Result<Transport, EngineError> {
        let key = SwarmKey::new(&opts.swarm_key)
            .map_err(|e| EngineError::InvalidArgument(e.to_string()))?;
        if opts.max_payload == 0 || opts.max_payload > (1 << 40) {
            return Err(EngineError::InvalidArgument(format!(
                "max_payload {} must be in 1..=2^40",
                opts.max_payload
            )));
        }
        if (opts.pool_bytes as u64) < opts.max_payload {
            return Err(EngineError::InvalidArgument(format!(
                "pool of {} bytes cannot hold one frame of max_payload {} bytes",
                opts.pool_bytes, opts.max_payload
            )));
        }
        if opts.send_queue_depth == 0 {
            return Err(EngineError::InvalidArgument(
                "send_queue_depth must be at least 1".into(),
            ));
        }
        if opts.peer_timeout.is_zero() || opts.heartbeat_interval.is_zero() {
            return Err(EngineError::InvalidArgument(
                "peer_timeout and heartbeat_interval must be positive".into(),
            ));
        }
        if opts.heartbeat_interval >= opts.peer_timeout {
            return Err(EngineError::InvalidArgument(format!(
                "heartbeat_interval {:?} must be shorter than peer_timeout {:?}",
                opts.heartbeat_interval, opts.peer_timeout
            )));
        }
        if opts.node_key.is_none() {
            opts.node_key =
                Some(NodeKey::generate().map_err(|e| EngineError::InvalidArgument(e.to_string()))?);
        }
        let key_id = opts.node_key.as_ref().expect("set above").node_id() as u64;
        if opts.node_id == 0 {
            opts.node_id = key_id;
        } else if opts.node_id != key_id && !opts.chosen_ids {
            return Err(EngineError::InvalidArgument(format!(
                "node id {:x} is not the id of this node's key ({key_id:x}): ids follow from \
                 node keys (leave the id 0, or choose ids only in a test swarm, chosen_ids)",
                opts.node_id
            )));
        }
        let pool = Pool::new(opts.pool_bytes, opts.max_payload as usize)?;
        let poll = mio::Poll::new().map_err(EngineError::Io)?;
        let waker = mio::Waker::new(poll.registry(), poll::WAKER).map_err(EngineError::Io)?;
        let listener = match opts.listen {
            Some(addr) => Some(mio::net::TcpListener::bind(addr).map_err(EngineError::Io)?),
            None => None,
        };
        let local_addr = match &listener {
            Some(l) => Some(l.local_addr().map_err(EngineError::Io)?),
            None => None,
        };
        let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded();
        let (frames_tx, frames_rx) = crossbeam_channel::unbounded();
        let (events_tx, events_rx) = crossbeam_channel::bounded(EVENT_QUEUE);
        let shared = Arc::new(Shared {
            node_id: opts.node_id,
            opts,
            pool,
            peers: RwLock::new(HashMap::new()),
            counters: Counters::default(),
            parked: AtomicBool::new(false),
            waker,
            link_cut: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&shared);
        shared.pool.set_release_hook(Box::new(move || {
            if let Some(s) = weak.upgrade() {
                s.wake();
            }
        }));
        let mut driver = poll::Driver::new(
            shared.clone(),
            poll,
            listener,
            key,
            cmd_rx,
            frames_tx,
            events_tx,
        )
        .map_err(EngineError::Io)?;
        let thread = std::thread::Builder::new()
            .name(format!("gwtf-poll-{:x}", shared.node_id))
            .spawn(move || driver.run())
            .map_err(EngineError::Io)?;
        Ok(Transport {
            shared,
            cmd_tx,
            frames_rx,
            events_rx,
            local_addr,
            thread: Mutex::new(Some(thread)),
            stopped: AtomicBool::new(false),
        })
    }

    pub fn node_id(&self) -> u64 {
        self.shared.node_id
    }

    /// The address peers can connect to (with the real port when 0 was asked).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    pub fn options(&self) -> &NodeOptions {
        &self.shared.opts
    }

    fn command(&self, cmd: Cmd) -> Result<(), EngineError> {
        if self.stopped.load(Ordering::SeqCst) {
            return Err(EngineError::Closed("node is shut down".into()));
        }
        self.cmd_tx
            .send(cmd)
            .map_err(|_| EngineError::Closed("node is shut down".into()))?;
        self.shared.wake();
        Ok(())
    }

    /// Starts connecting to `addr` (with retries); the outcome arrives as an
    /// event (`PeerConnected`, `Refused` or `ConnectFailed`).
    pub fn connect(&self, addr: SocketAddr) -> Result<(), EngineError> {
        self.command(Cmd::Connect { addr, reply: None })
    }

    /// Connects to `addr` and waits until the peer is authenticated; returns
    /// its node id.
    pub fn connect_wait(&self, addr: SocketAddr, timeout: Duration) -> Result<u64, EngineError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.command(Cmd::Connect {
            addr,
            reply: Some(tx),
        })?;
        match rx.recv_timeout(timeout) {
            Ok(Ok(peer)) => Ok(peer),
            Ok(Err(why)) => Err(EngineError::Closed(format!("connect to {addr}: {why}"))),
            Err(RecvTimeoutError::Timeout) => Err(EngineError::Timeout(format!(
                "connect to {addr} not authenticated within {timeout:?}"
            ))),
            Err(RecvTimeoutError::Disconnected) => {
                Err(EngineError::Closed("node is shut down".into()))
            }
        }
    }

    /// A frame with a `len`-byte payload to fill and send, waiting up to
    /// `timeout` for pool space.
    pub fn alloc(&self, len: usize, timeout: Duration) -> Result<Frame, EngineError> {
        if len as u64 > self.shared.opts.max_payload {
            return Err(EngineError::LimitExceeded(format!(
                "payload of {len} bytes exceeds max_payload {}",
                self.shared.opts.max_payload
            )));
        }
        let lease = if len == 0 {
            None
        } else {
            Some(self.shared.pool.alloc(len, timeout)?)
        };
        Ok(Frame {
            header: FrameHeader::data(),
            lease,
            peer: 0,
        })
    }

    /// A frame holding a copy of `data` (one user-space copy, counted in the
    /// stats: use [`Transport::alloc`] and fill the lease to avoid it).
    pub fn alloc_copy(&self, data: &[u8], timeout: Duration) -> Result<Frame, EngineError> {
        let mut f = self.alloc(data.len(), timeout)?;
        f.payload_mut().copy_from_slice(data);
        if !data.is_empty() {
            add(&self.shared.counters.user_copies, 1);
            add(&self.shared.counters.user_copy_bytes, data.len() as u64);
        }
        Ok(f)
    }

    fn reserve(
        &self,
        peer: u64,
        timeout: Duration,
        control: bool,
    ) -> Result<Arc<PeerSlot>, EngineError> {
        let slot = self
            .shared
            .peers
            .read()
            .get(&peer)
            .cloned()
            .ok_or_else(|| EngineError::NotFound(format!("no connected peer {peer:x}")))?;
        let deadline = Instant::now().checked_add(timeout);
        let depth = if control {
            CONTROL_QUEUE_DEPTH
        } else {
            self.shared.opts.send_queue_depth
        };
        let mut q = slot.queued.lock();
        loop {
            if !slot.open.load(Ordering::SeqCst) {
                return Err(EngineError::Closed(format!("peer {peer:x} is gone")));
            }
            let n = if control {
                &mut q.control
            } else {
                &mut q.queued
            };
            if *n < depth {
                *n += 1;
                break;
            }
            q.waiting += 1;
            let timed_out = match deadline {
                Some(d) => slot.room.wait_until(&mut q, d).timed_out(),
                None => {
                    slot.room.wait(&mut q);
                    false
                }
            };
            q.waiting -= 1;
            let n = if control { q.control } else { q.queued };
            if timed_out && n >= depth {
                return Err(EngineError::Timeout(format!(
                    "{} queue to peer {peer:x} is full ({depth} frames)",
                    if control { "control" } else { "send" }
                )));
            }
        }
        drop(q);
        Ok(slot)
    }

    /// Sends a data frame to `peer`. The library fills magic, version,
    /// sender, payload length and checksums; the caller's kind must be data.
    /// The frame is consumed, also on failure (its lease is released). Waits
    /// up to `timeout` for room in the peer's send queue (zero: would-block
    /// returns `Timeout` at once).
    pub fn send(&self, peer: u64, frame: Frame, timeout: Duration) -> Result<(), EngineError> {
        let Frame { header, lease, .. } = frame;
        let payload = lease.map_or(OutPayload::None, OutPayload::Lease);
        self.send_payload(peer, header, payload, timeout)
    }

    /// Sends `frame`'s payload under `header` without copying it: the
    /// caller keeps its share (to send it again later, e.g. after a crash
    /// downstream). As [`Transport::send`] otherwise.
    pub fn send_shared(
        &self,
        peer: u64,
        header: FrameHeader,
        frame: &SharedFrame,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        let payload = frame
            .lease
            .clone()
            .map_or(OutPayload::None, OutPayload::Shared);
        self.send_payload(peer, header, payload, timeout)
    }

    /// Sends bytes `range` of `frame`'s payload under `header` as a data
    /// frame of its own, without copying (the caller keeps its share): a
    /// large payload in several frames, so that other data frames can go
    /// between them. As [`Transport::send_shared`] otherwise; a range outside
    /// the payload is `InvalidArgument`.
    pub fn send_shared_range(
        &self,
        peer: u64,
        header: FrameHeader,
        frame: &SharedFrame,
        range: std::ops::Range<usize>,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        let Some(lease) = frame.lease.clone() else {
            return Err(EngineError::InvalidArgument(
                "a range of a frame without payload".into(),
            ));
        };
        if range.start > range.end || range.end > lease.as_slice().len() {
            return Err(EngineError::InvalidArgument(format!(
                "bytes {range:?} of a payload of {} bytes",
                lease.as_slice().len()
            )));
        }
        let payload = OutPayload::Range(lease, range.start, range.end - range.start);
        self.send_payload(peer, header, payload, timeout)
    }

    /// Data frames queued to `peer` and not written out yet (None: not
    /// connected).
    pub fn queued_data(&self, peer: u64) -> Option<usize> {
        let slot = self.shared.peers.read().get(&peer).cloned()?;
        let n = slot.queued.lock().queued;
        Some(n)
    }

    fn send_payload(
        &self,
        peer: u64,
        mut header: FrameHeader,
        payload: OutPayload,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        let bytes: &[u8] = match &payload {
            OutPayload::Lease(l) => l.as_slice(),
            OutPayload::Shared(l) => l.as_slice(),
            OutPayload::Range(l, start, len) => &l.as_slice()[*start..*start + *len],
            OutPayload::None | OutPayload::Bytes(_) => &[],
        };
        let len = bytes.len() as u64;
        if header.kind != FrameKind::Data as u16 {
            return Err(EngineError::InvalidArgument(format!(
                "frame kind {} cannot be sent as data (use GWTF_FRAME_KIND_DATA)",
                header.kind
            )));
        }
        header.magic = FRAME_MAGIC;
        header.version = WIRE_VERSION;
        header.sender = self.shared.node_id;
        header.payload_len = len;
        header.payload_crc = 0;
        if len <= self.shared.opts.payload_crc_max {
            header.flags |= FLAG_PAYLOAD_CRC;
        }
        if header.flags & FLAG_PAYLOAD_CRC != 0 {
            header.payload_crc = crc32c(bytes);
        }
        header
            .validate(self.shared.opts.max_payload)
            .map_err(|e| EngineError::InvalidArgument(e.to_string()))?;
        let slot = self.reserve(peer, timeout, false)?;
        let cmd = Cmd::Send {
            peer,
            head: Box::new(header.encode()),
            payload,
            data_len: len,
            control: false,
        };
        if self.stopped.load(Ordering::SeqCst) || self.cmd_tx.send(cmd).is_err() {
            slot.done(1, false);
            return Err(EngineError::Closed("node is shut down".into()));
        }
        // A peer whose socket is full gets its frames picked up by the
        // coming writable event; waking the poll thread now would only
        // meet the same full socket.
        fence(Ordering::SeqCst);
        if !slot.write_blocked.load(Ordering::SeqCst) {
            self.shared.wake();
        }
        Ok(())
    }

    /// Sends a received frame on to `peer` unchanged but for the sender
    /// field (zero-copy forwarding, as `gwtf echo` does).
    pub fn forward(&self, peer: u64, frame: Frame, timeout: Duration) -> Result<(), EngineError> {
        self.send(peer, frame, timeout)
    }

    /// Sends a typed control message. It goes out ahead of the data frames
    /// queued to `peer` (and between the slices of a long one), so it may
    /// arrive before data frames sent earlier; control messages stay in
    /// order among themselves. Waits up to `timeout` for room in the peer's
    /// control queue ([`CONTROL_QUEUE_DEPTH`]), never for data.
    pub fn send_control(
        &self,
        peer: u64,
        msg: &ControlEnvelope,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        let body = msg.encode().map_err(EngineError::Wire)?;
        let frame =
            crate::wire::encode_control_frame(FrameKind::Control, self.shared.node_id, &body);
        let mut head = Box::new([0u8; crate::wire::HEADER_LEN]);
        head.copy_from_slice(&frame[..crate::wire::HEADER_LEN]);
        let slot = self.reserve(peer, timeout, true)?;
        let cmd = Cmd::Send {
            peer,
            head,
            payload: OutPayload::Bytes(frame[crate::wire::HEADER_LEN..].to_vec()),
            data_len: 0,
            control: true,
        };
        if let Err(e) = self.command(cmd) {
            slot.done(1, true);
            return Err(e);
        }
        Ok(())
    }

    /// The next received data frame, waiting up to `timeout`.
    pub fn recv(&self, timeout: Duration) -> Result<Frame, EngineError> {
        match self.frames_rx.recv_timeout(timeout) {
            Ok(f) => Ok(f),
            Err(RecvTimeoutError::Timeout) => Err(EngineError::Timeout("no frame received".into())),
            Err(RecvTimeoutError::Disconnected) => {
                Err(EngineError::Closed("node is shut down".into()))
            }
        }
    }

    /// The next event, waiting up to `timeout`.
    pub fn poll_event(&self, timeout: Duration) -> Option<TransportEvent> {
        self.events_rx.recv_timeout(timeout).ok()
    }

    /// Whichever comes first, a received data frame or an event, waiting up
    /// to `timeout` (a driver that handles both waits on both at once).
    pub fn next_incoming(&self, timeout: Duration) -> Option<Incoming> {
        crossbeam_channel::select! {
            recv(self.frames_rx) -> f => f.ok().map(Incoming::Frame),
            recv(self.events_rx) -> e => e.ok().map(Incoming::Event),
            default(timeout) => None,
        }
    }

    /// [`Transport::next_incoming`], returning None early when `wake` receives
    /// (or is closed): for a driver that also waits on work of its own,
    /// such as a trainer's answers.
    pub fn next_incoming_or_wake(
        &self,
        wake: &crossbeam_channel::Receiver<()>,
        timeout: Duration,
    ) -> Option<Incoming> {
        crossbeam_channel::select! {
            recv(self.frames_rx) -> f => f.ok().map(Incoming::Frame),
            recv(self.events_rx) -> e => e.ok().map(Incoming::Event),
            recv(wake) -> _ => None,
            default(timeout) => None,
        }
    }

    /// Closes the connection to `peer` after a goodbye.
    pub fn disconnect(&self, peer: u64) -> Result<(), EngineError> {
        if !self.shared.peers.read().contains_key(&peer) {
            return Err(EngineError::NotFound(format!("no connected peer {peer:x}")));
        }
        self.command(Cmd::Disconnect { peer })
    }

    /// Ids of the connected peers.
    /// Whether `peer` is connected now (cheaper than [`Transport::peers`]).
    pub fn is_connected(&self, peer: u64) -> bool {
        self.shared.peers.read().contains_key(&peer)
    }

    /// Bytes read so far from each connected peer (counted from its
    /// current connection's start): what changed since the last call says
    /// who is sending, frames still in flight included.
    pub fn received_from(&self) -> Vec<(u64, u64)> {
        (self.shared.peers.read().iter())
            .map(|(p, s)| (*p, s.received.load(Ordering::Relaxed)))
            .collect()
    }

    pub fn peers(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.shared.peers.read().keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub fn stats(&self) -> NodeStats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NodeStats {
            frames_sent: l(&c.frames_sent),
            frames_received: l(&c.frames_received),
            bytes_sent: l(&c.bytes_sent),
            bytes_received: l(&c.bytes_received),
            wire_bytes_sent: l(&c.wire_bytes_sent),
            wire_bytes_received: l(&c.wire_bytes_received),
            user_copies: l(&c.user_copies),
            user_copy_bytes: l(&c.user_copy_bytes),
            heartbeats_sent: l(&c.heartbeats_sent),
            heartbeats_received: l(&c.heartbeats_received),
            write_calls: l(&c.write_calls),
            read_calls: l(&c.read_calls),
            peers_connected: l(&c.peers_connected),
            peers_lost: l(&c.peers_lost),
            connections_refused: l(&c.connections_refused),
            refusals_unreported: l(&c.refusals_unreported),
            tag_failures: l(&c.tag_failures),
            events_dropped: l(&c.events_dropped),
            duplicates_retired: l(&c.duplicates_retired),
            duplicates_promoted: l(&c.duplicates_promoted),
            pool: self.shared.pool.stats(),
        }
    }

    /// Test and demo aid: cuts this node's link (`true`) or restores it,
    /// in user space, as a cable pulled out and put back would: while cut
    /// the node writes and reads none of its sockets, accepts no
    /// connection and dials none (a dial fails as unreachable and is
    /// retried as usual); what its peers sent meanwhile waits in its
    /// kernel buffers (TCP would resend it after a real cut), and a
    /// connection it closes meanwhile (its peer timed out) reaches the
    /// peer closed only once the link is back. Its timers run on: its
    /// peers fall silent for it, and it for them.
    pub fn set_link_cut(&self, cut: bool) {
        let was = self.shared.link_cut.swap(cut, Ordering::SeqCst);
        if was != cut {
            self.shared.log(if cut {
                "link cut (emulated)"
            } else {
                "link restored (emulated)"
            });
            self.shared.parked.store(true, Ordering::SeqCst);
            self.shared.wake();
        }
    }

    /// Says goodbye to every peer (bounded wait for the queues to drain) and
    /// stops the poll thread. Idempotent; also run on drop.
    pub fn shutdown(&self) {
        if !self.stopped.swap(true, Ordering::SeqCst) {
            let _ = self.cmd_tx.send(Cmd::Shutdown);
            self.shared.wake();
        }
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        self.shutdown();
    }
}
