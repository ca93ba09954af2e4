//! `gwtf_node`: a transport node for C callers (see `crate::engine`).

use std::ffi::{c_char, CStr};
use std::net::SocketAddr;
use std::time::Duration;

use super::boundary::{
    copy_str_out, free_handle, guard, guard_handle, require_out, write_out, write_sized, FfiError,
    FfiHandle, FfiResult, HandleHeader,
};
use super::error::gwtf_error;
use super::frame::{gwtf_frame, take_frame};
use super::status::gwtf_status;
use crate::engine::{EngineError, LinkEmulation, NodeOptions, Transport, TransportEvent};
use crate::pool::PoolError;
use crate::wire::NodeKey;

/// Current version of `gwtf_node_options` (what `_init` writes).
pub const GWTF_NODE_OPTIONS_VERSION: u32 = 2;
/// Current version of `gwtf_node_stats`.
pub const GWTF_NODE_STATS_VERSION: u32 = 1;

/// Options of `gwtf_node_new`. Initialise with `gwtf_node_options_init`, then
/// set `swarm_key`/`swarm_key_len` (required) and change what you need.
/// Fields are only ever appended.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct gwtf_node_options {
    /// Must be `GWTF_NODE_OPTIONS_VERSION` (set by `_init`).
    pub version: u32,
    /// Log connection events and refusals to stderr when non-zero. Default 0.
    pub log_to_stderr: u32,
    /// "IP:PORT" to accept peers on (port 0: any free port), or NULL for
    /// outbound connections only. Default NULL.
    pub listen_addr: *const c_char,
    /// The swarm key shared by all participants (at least 16 bytes).
    pub swarm_key: *const u8,
    pub swarm_key_len: usize,
    /// This node's id: 0 for the id of its node key (see `node_key_path`);
    /// any other value must be that id, unless `chosen_ids`. Default 0.
    pub node_id: u64,
    /// Largest data payload in bytes. Default 64 MiB.
    pub max_payload_bytes: u64,
    /// Frame pool size in bytes (at least max_payload_bytes). Default 256 MiB.
    pub pool_bytes: u64,
    /// Frames queued per peer before `gwtf_node_send` waits. Default 8.
    pub send_queue_depth: u32,
    /// Most connections at once. Default 1024.
    pub max_connections: u32,
    /// Heartbeat after this much idle time on a link. Default 1000.
    pub heartbeat_interval_ms: u32,
    /// A peer silent this long is reported lost. Default 10000.
    pub peer_timeout_ms: u32,
    /// A handshake must complete within this. Default 5000.
    pub handshake_timeout_ms: u32,
    /// A frame must arrive within this from its first byte, plus its length
    /// at 1 MiB/s. Default 10000.
    pub frame_timeout_ms: u32,
    /// Outbound connection attempts. Default 5.
    pub connect_attempts: u32,
    /// First retry delay (doubles, up to 2 s). Default 100.
    pub connect_backoff_ms: u32,
    /// Payloads up to this size get a CRC32C. Default UINT64_MAX (all).
    pub payload_crc_max_bytes: u64,
    /// Emulated one-way delay on the send side (tests, demos). Default 0.
    pub link_delay_ms: u32,
    /// 1: encrypt frame payloads (AES-256-GCM; a connection encrypts when
    /// either end asks). Every frame is authenticated either way. Default 0.
    /// (Was a reserved field that had to be 0: older callers get 0.)
    pub encrypt: u32,
    /// Emulated bandwidth cap on the send side, bytes/s (0: none). Default 0.
    pub link_bandwidth_bytes_per_s: u64,
    /// File holding this node's private key (64 hex digits), created on
    /// first use; its public key is proved in every handshake and the
    /// node's id follows from it (`gwtf_node_key_id`). NULL: a fresh key
    /// for this node's lifetime. Default NULL. (Version 2.)
    pub node_key_path: *const c_char,
    /// 1, insecure, for test swarms with fixed ids: `node_id` may be any
    /// id, and peers whose ids do not follow from their keys are accepted,
    /// so any holder of the swarm key can act as any node. Default 0.
    /// (Version 2.)
    pub chosen_ids: u32,
}

/// What `gwtf_node_poll_event` returns (`gwtf_event.kind`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gwtf_event_kind {
    /// A peer completed the authenticated handshake.
    PeerConnected = 1,
    /// An authenticated peer is gone (`reason` says why); frames queued to
    /// it were dropped.
    PeerLost = 2,
    /// A connection was refused before authentication (`reason`).
    Refused = 3,
    /// An outbound connection failed after every attempt.
    ConnectFailed = 4,
    /// A control message arrived (`reason` holds its type).
    Control = 5,
}

/// Why a connection closed (`gwtf_event.reason` for lost/refused).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gwtf_close_reason {
    None = 0,
    Goodbye = 1,
    PeerTimeout = 2,
    HandshakeTimeout = 3,
    FrameTimeout = 4,
    Eof = 5,
    Io = 6,
    Protocol = 7,
    /// The peer's proof of the swarm key failed, or the node id it claimed
    /// is not the one of the key it proved.
    AuthFailed = 8,
    Duplicate = 9,
    TooManyConnections = 10,
    Local = 11,
    /// A frame's tag did not verify (changed, replayed or reordered on
    /// the way).
    Mac = 12,
    /// Refused by an intake limit (connections or handshakes per address,
    /// handshakes at once, connections per node id).
    Limit = 13,
}

/// An event, with its text inline (no ownership to manage).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gwtf_event {
    /// A `GWTF_EVENT_KIND_*` value.
    pub kind: i32,
    /// A `GWTF_CLOSE_REASON_*` value (0 when not a close).
    pub reason: i32,
    /// The peer's node id (0 when not known).
    pub peer_id: u64,
    /// The peer's "IP:PORT", NUL-terminated.
    pub addr: [c_char; 64],
    /// A human-readable description, NUL-terminated (truncated).
    pub message: [c_char; 256],
}

/// Counters of a node (see `gwtf_node_get_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct gwtf_node_stats {
    /// `GWTF_NODE_STATS_VERSION` of the library that wrote it.
    pub version: u32,
    pub reserved0: u32,
    pub frames_sent: u64,
    pub frames_received: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub wire_bytes_sent: u64,
    pub wire_bytes_received: u64,
    /// Payload copies made in user space by the library (0 on the data path).
    pub user_copies: u64,
    pub heartbeats_sent: u64,
    pub heartbeats_received: u64,
    pub peers_connected: u64,
    pub peers_lost: u64,
    pub connections_refused: u64,
    pub pool_capacity_bytes: u64,
    pub pool_in_use_bytes: u64,
    pub pool_high_water_bytes: u64,
    pub pool_slots_total: u64,
    pub pool_slots_in_use: u64,
    pub pool_slots_high_water: u64,
    pub pool_alloc_failures: u64,
}

/// A transport node (opaque).
pub struct gwtf_node {
    header: HandleHeader,
    node: Transport,
}

impl FfiHandle for gwtf_node {
    const MAGIC: u64 = 0x6777_7466_6e6f_6465; // "gwtfnode"
    const NAME: &'static str = "gwtf_node";
    fn header(&self) -> &HandleHeader {
        &self.header
    }
}

fn ms(v: u32) -> Duration {
    Duration::from_millis(v as u64)
}

pub(crate) fn engine_err(e: EngineError) -> FfiError {
    let status = match &e {
        EngineError::InvalidArgument(_) => gwtf_status::InvalidArgument,
        EngineError::LimitExceeded(_) => gwtf_status::LimitExceeded,
        EngineError::Pool(PoolError::TooLarge { .. }) => gwtf_status::LimitExceeded,
        EngineError::Pool(PoolError::Exhausted { .. }) => gwtf_status::Timeout,
        EngineError::Pool(PoolError::Map(_)) => gwtf_status::OutOfMemory,
        EngineError::Timeout(_) => gwtf_status::Timeout,
        EngineError::NotFound(_) => gwtf_status::NotFound,
        EngineError::Closed(_) => gwtf_status::Closed,
        EngineError::Io(_) => gwtf_status::Io,
        EngineError::Wire(_) => gwtf_status::Protocol,
    };
    FfiError::new(status, e.to_string())
}

pub(crate) fn c_str<'a>(p: *const c_char, what: &str) -> FfiResult<&'a str> {
    if p.is_null() {
        return Err(FfiError::null(what));
    }
    // SAFETY: non-NULL; the caller passes a NUL-terminated string.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| FfiError::invalid(format!("{what} is not UTF-8")))
}

pub(crate) fn parse_addr(p: *const c_char, what: &str) -> FfiResult<SocketAddr> {
    let s = c_str(p, what)?;
    s.parse()
        .map_err(|_| FfiError::invalid(format!("{what} {s:?} is not IP:PORT")))
}

/// Fills `opts` with the defaults of this library version (swarm key unset).
///
/// Ownership: `opts` is caller memory; it is only written.
///
/// Thread safety: may be called from any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_node_options_init(opts: *mut gwtf_node_options) -> gwtf_status {
    guard(std::ptr::null_mut(), || {
        require_out(opts, "opts")?;
        let d = NodeOptions::default();
        let v = gwtf_node_options {
            version: GWTF_NODE_OPTIONS_VERSION,
            log_to_stderr: 0,
            listen_addr: std::ptr::null(),
            swarm_key: std::ptr::null(),
            swarm_key_len: 0,
            node_id: 0,
            max_payload_bytes: d.max_payload,
            pool_bytes: d.pool_bytes as u64,
            send_queue_depth: d.send_queue_depth as u32,
            max_connections: d.max_connections as u32,
            heartbeat_interval_ms: d.heartbeat_interval.as_millis() as u32,
            peer_timeout_ms: d.peer_timeout.as_millis() as u32,
            handshake_timeout_ms: d.handshake_timeout.as_millis() as u32,
            frame_timeout_ms: d.frame_timeout.as_millis() as u32,
            connect_attempts: d.connect_attempts,
            connect_backoff_ms: d.connect_backoff.as_millis() as u32,
            payload_crc_max_bytes: d.payload_crc_max,
            link_delay_ms: 0,
            encrypt: 0,
            link_bandwidth_bytes_per_s: 0,
            node_key_path: std::ptr::null(),
            chosen_ids: 0,
        };
        // SAFETY: checked non-NULL.
        unsafe { write_out(opts, v) };
        Ok(())
    })
}

/// Creates a node and starts its poll thread (and its listener when
/// `opts->listen_addr` is set).
///
/// Ownership: `opts` and the memory it points to are only read during the
/// call (the key is copied). The caller owns `*out_node` and frees it with
/// `gwtf_node_free`.
///
/// Thread safety: may be called from any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_UNSUPPORTED_VERSION`,
/// `GWTF_STATUS_INVALID_ARGUMENT` (short key, bad address, inconsistent
/// limits), `GWTF_STATUS_IO` (cannot listen), `GWTF_STATUS_OUT_OF_MEMORY`.
#[no_mangle]
pub extern "C" fn gwtf_node_new(
    opts: *const gwtf_node_options,
    out_node: *mut *mut gwtf_node,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_node, "out_node")?;
        if opts.is_null() {
            return Err(FfiError::null("opts"));
        }
        // SAFETY: non-NULL; the caller passes a readable options struct of
        // the version its first field says.
        let o = unsafe { read_node_options(opts) }?;
        let o = &o;
        if o.version == 0 || o.version > GWTF_NODE_OPTIONS_VERSION {
            return Err(FfiError::new(
                gwtf_status::UnsupportedVersion,
                format!(
                    "gwtf_node_options.version is {} but this library knows 1..={} (call gwtf_node_options_init)",
                    o.version, GWTF_NODE_OPTIONS_VERSION
                ),
            ));
        }
        if o.swarm_key.is_null() {
            return Err(FfiError::null("opts->swarm_key"));
        }
        // SAFETY: non-NULL; the caller passes swarm_key_len readable bytes.
        let key = unsafe { std::slice::from_raw_parts(o.swarm_key, o.swarm_key_len) }.to_vec();
        let listen = if o.listen_addr.is_null() {
            None
        } else {
            Some(parse_addr(o.listen_addr, "opts->listen_addr")?)
        };
        let link =
            (o.link_delay_ms > 0 || o.link_bandwidth_bytes_per_s > 0).then(|| LinkEmulation {
                delay: ms(o.link_delay_ms),
                bandwidth_bytes_per_s: o.link_bandwidth_bytes_per_s,
            });
        let pool_bytes = usize::try_from(o.pool_bytes)
            .map_err(|_| FfiError::invalid("pool_bytes does not fit in memory"))?;
        let node = Transport::new(NodeOptions {
            listen,
            swarm_key: key,
            node_id: o.node_id,
            max_payload: o.max_payload_bytes,
            pool_bytes,
            send_queue_depth: o.send_queue_depth as usize,
            max_connections: o.max_connections as usize,
            heartbeat_interval: ms(o.heartbeat_interval_ms),
            peer_timeout: ms(o.peer_timeout_ms),
            handshake_timeout: ms(o.handshake_timeout_ms),
            frame_timeout: ms(o.frame_timeout_ms),
            connect_attempts: o.connect_attempts.max(1),
            connect_backoff: ms(o.connect_backoff_ms),
            payload_crc_max: o.payload_crc_max_bytes,
            link,
            log: o.log_to_stderr != 0,
            encrypt: match o.encrypt {
                0 => false,
                1 => true,
                x => return Err(FfiError::invalid(format!("encrypt is {x}: 0 or 1"))),
            },
            node_key: Some(node_key_at(o.node_key_path, "opts->node_key_path")?),
            chosen_ids: flag(o.chosen_ids, "chosen_ids")?,
            ..NodeOptions::default()
        })
        .map_err(engine_err)?;
        let h = gwtf_node {
            header: HandleHeader::new(gwtf_node::MAGIC),
            node,
        };
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_node, h.into_raw()) };
        Ok(())
    })
}

/// The caller's options of version 1 or 2: a version-1 struct is shorter
/// (its appended fields keep their defaults); other versions pass through
/// for the caller's check.
///
/// # Safety
/// `opts` is non-NULL and points to a readable options struct of the
/// version its first field says.
unsafe fn read_node_options(opts: *const gwtf_node_options) -> FfiResult<gwtf_node_options> {
    // SAFETY: every version starts with its version.
    let version = unsafe { std::ptr::addr_of!((*opts).version).read() };
    let len = match version {
        1 => std::mem::offset_of!(gwtf_node_options, node_key_path),
        GWTF_NODE_OPTIONS_VERSION => std::mem::size_of::<gwtf_node_options>(),
        _ => std::mem::size_of::<u32>(),
    };
    // SAFETY: every field is an integer or a raw pointer, for which all
    // zeroes is a valid value (the appended fields' defaults: NULL, 0).
    let mut o: gwtf_node_options = unsafe { std::mem::zeroed() };
    o.version = version;
    // SAFETY: the caller's struct of this version has `len` readable bytes;
    // `o` is a whole struct; every field is a plain integer or pointer.
    unsafe {
        std::ptr::copy_nonoverlapping(
            opts.cast::<u8>(),
            (&mut o as *mut gwtf_node_options).cast::<u8>(),
            len,
        )
    };
    Ok(o)
}

/// 0 or 1, else an error that names `what`.
pub(crate) fn flag(v: u32, what: &str) -> FfiResult<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        x => Err(FfiError::invalid(format!("{what} is {x}: 0 or 1"))),
    }
}

/// The node key in the file at `path` (created there when missing), or a
/// fresh one for NULL.
pub(crate) fn node_key_at(path: *const c_char, what: &str) -> FfiResult<NodeKey> {
    if path.is_null() {
        return NodeKey::generate().map_err(|e| FfiError::new(gwtf_status::Io, e.to_string()));
    }
    let p = c_path(path, what)?;
    NodeKey::load_or_create(&p)
        .map(|(k, _)| k)
        .map_err(|e| FfiError::new(gwtf_status::Io, e))
}

/// A NUL-terminated UTF-8 path from C.
fn c_path(path: *const c_char, what: &str) -> FfiResult<std::path::PathBuf> {
    // SAFETY: non-NULL (the callers check); the caller passes a
    // NUL-terminated string.
    let s = unsafe { std::ffi::CStr::from_ptr(path) }
        .to_str()
        .map_err(|_| FfiError::invalid(format!("{what} is not UTF-8")))?;
    if s.is_empty() {
        return Err(FfiError::invalid(format!("{what} is empty")));
    }
    Ok(std::path::PathBuf::from(s))
}

/// The node id that follows from the node key in the file at `path`,
/// creating the file (a fresh key, owner read and write only) when there
/// is none: how founding members learn the ids to give each other.
///
/// Ownership: `path` is only read during the call; `*out_id` is caller
/// memory.
///
/// Thread safety: any thread; of two callers creating the same file at
/// once, one writes it and the other reads it (rarely before it is whole:
/// then `GWTF_STATUS_IO`); never two keys.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT` (not
/// UTF-8, empty), `GWTF_STATUS_IO` (cannot read or create it, or it holds
/// no node key).
#[no_mangle]
pub extern "C" fn gwtf_node_key_id(
    path: *const c_char,
    out_id: *mut u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_id, "out_id")?;
        if path.is_null() {
            return Err(FfiError::null("path"));
        }
        let key = node_key_at(path, "path")?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_id, key.node_id()) };
        Ok(())
    })
}

/// This node's id.
///
/// Ownership: `node` is only borrowed.
///
/// Thread safety: any thread, concurrently with other calls on `node`.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_node_id(
    node: *const gwtf_node,
    out_id: *mut u64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, node, |n| {
        require_out(out_id, "out_id")?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_id, n.node.node_id()) };
        Ok(())
    })
}

/// The "IP:PORT" the node listens on (with the real port), NUL-terminated.
/// `*out_len` (may be NULL) receives the length without the NUL.
///
/// Ownership: `buf` is caller memory of `buf_len` bytes.
///
/// Thread safety: any thread, concurrently with other calls on `node`.
///
/// Errors: `GWTF_STATUS_NOT_FOUND` (no listener), `GWTF_STATUS_BUFFER_TOO_SMALL`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_node_local_addr(
    node: *const gwtf_node,
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, node, |n| {
        let addr = n
            .node
            .local_addr()
            .ok_or_else(|| FfiError::new(gwtf_status::NotFound, "node has no listener"))?;
        // SAFETY: the caller passes a buffer of buf_len bytes (or NULL, 0).
        unsafe { copy_str_out(&addr.to_string(), buf, buf_len, out_len) }
    })
}

/// Connects to the node at `addr` ("IP:PORT") and waits until it is
/// authenticated (retrying the TCP connection per the options); writes the
/// peer's node id.
///
/// Ownership: `addr` is only read during the call.
///
/// Thread safety: any thread, concurrently with other calls on `node`.
///
/// Errors: `GWTF_STATUS_TIMEOUT`, `GWTF_STATUS_CLOSED` (refused: wrong key,
/// protocol error, or every attempt failed; the message says which),
/// `GWTF_STATUS_INVALID_ARGUMENT`, `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_node_connect(
    node: *mut gwtf_node,
    addr: *const c_char,
    timeout_ms: u32,
    out_peer_id: *mut u64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, node, |n| {
        require_out(out_peer_id, "out_peer_id")?;
        let addr = parse_addr(addr, "addr")?;
        let peer = n
            .node
            .connect_wait(addr, ms(timeout_ms))
            .map_err(engine_err)?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_peer_id, peer) };
        Ok(())
    })
}

/// Allocates a frame with a `payload_len`-byte payload from the node's pool,
/// waiting up to `timeout_ms` when the pool is full. Fill it through
/// `gwtf_frame_get_view(...).data` and `gwtf_frame_set_header`, then send it.
///
/// Ownership: the caller owns `*out_frame` until it passes it to
/// `gwtf_node_send` or `gwtf_frame_release`.
///
/// Thread safety: any thread, concurrently with other calls on `node`.
///
/// Errors: `GWTF_STATUS_LIMIT_EXCEEDED` (above max_payload_bytes),
/// `GWTF_STATUS_TIMEOUT` (pool exhausted for the whole timeout),
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_node_frame_alloc(
    node: *mut gwtf_node,
    payload_len: u64,
    timeout_ms: u32,
    out_frame: *mut *mut gwtf_frame,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, node, |n| {
        require_out(out_frame, "out_frame")?;
        let len = usize::try_from(payload_len)
            .map_err(|_| FfiError::new(gwtf_status::LimitExceeded, "payload_len too large"))?;
        let f = n.node.alloc(len, ms(timeout_ms)).map_err(engine_err)?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_frame, gwtf_frame::boxed(f)) };
        Ok(())
    })
}

/// Sends `frame` to the connected peer `peer_id`, waiting up to `timeout_ms`
/// for room in that peer's send queue (0: return `GWTF_STATUS_TIMEOUT` at once
/// when full, a would-block). A received frame may be sent on as it is.
///
/// Ownership: `frame` passes to the library **even when the call fails**;
/// never use or release it afterwards. Its slot returns to the pool once
/// written to the socket (or dropped with the peer).
///
/// Thread safety: any thread, concurrently with other calls on `node`.
///
/// Errors: `GWTF_STATUS_NOT_FOUND` (no such peer), `GWTF_STATUS_CLOSED` (peer
/// gone), `GWTF_STATUS_TIMEOUT` (queue full), `GWTF_STATUS_INVALID_ARGUMENT`
/// (bad header or frame), `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_node_send(
    node: *mut gwtf_node,
    peer_id: u64,
    frame: *mut gwtf_frame,
    timeout_ms: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    // Take the frame first so that it is consumed whatever happens next.
    // SAFETY: the caller passes NULL or a live frame, whose ownership passes.
    let taken = guard_value_frame(frame);
    guard_handle(out_err, node, |n| {
        let f = taken?;
        n.node.send(peer_id, f, ms(timeout_ms)).map_err(engine_err)
    })
}

fn guard_value_frame(frame: *mut gwtf_frame) -> FfiResult<crate::engine::Frame> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: per gwtf_node_send's contract.
        unsafe { take_frame(frame) }
    }))
    .unwrap_or_else(|_| Err(FfiError::new(gwtf_status::Panic, "panic taking the frame")))
}

/// Receives the next data frame from any peer, waiting up to `timeout_ms`.
///
/// Ownership: the caller owns `*out_frame` (a lease on a pool slot) and
/// gives it back with `gwtf_frame_release` (or sends it on).
///
/// Thread safety: any thread, concurrently with other calls on `node`; each
/// frame goes to exactly one caller.
///
/// Errors: `GWTF_STATUS_TIMEOUT` (nothing arrived), `GWTF_STATUS_CLOSED`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_node_recv(
    node: *mut gwtf_node,
    timeout_ms: u32,
    out_frame: *mut *mut gwtf_frame,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, node, |n| {
        require_out(out_frame, "out_frame")?;
        let f = n.node.recv(ms(timeout_ms)).map_err(engine_err)?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_frame, gwtf_frame::boxed(f)) };
        Ok(())
    })
}

pub(crate) fn fill(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len() - 1);
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as c_char;
    }
    dst[n] = 0;
}

/// The next event (peer connected, lost with reason, refused, connect
/// failed), waiting up to `timeout_ms`.
///
/// Ownership: `out_event` is caller memory; it is written on success.
///
/// Thread safety: any thread; each event goes to exactly one caller.
///
/// Errors: `GWTF_STATUS_TIMEOUT` (no event), `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_node_poll_event(
    node: *mut gwtf_node,
    timeout_ms: u32,
    out_event: *mut gwtf_event,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, node, |n| {
        require_out(out_event, "out_event")?;
        let ev = n
            .node
            .poll_event(ms(timeout_ms))
            .ok_or_else(|| FfiError::new(gwtf_status::Timeout, "no event"))?;
        let mut out = gwtf_event {
            kind: 0,
            reason: 0,
            peer_id: 0,
            addr: [0; 64],
            message: [0; 256],
        };
        let (kind, reason, peer, addr, msg) = match &ev {
            TransportEvent::PeerConnected {
                peer,
                addr,
                outbound,
            } => (
                gwtf_event_kind::PeerConnected,
                0,
                *peer,
                Some(*addr),
                format!(
                    "peer connected ({})",
                    if *outbound { "outbound" } else { "inbound" }
                ),
            ),
            TransportEvent::PeerLost { peer, addr, reason } => (
                gwtf_event_kind::PeerLost,
                reason.code(),
                *peer,
                Some(*addr),
                reason.to_string(),
            ),
            TransportEvent::Refused { addr, reason, .. } => (
                gwtf_event_kind::Refused,
                reason.code(),
                0,
                Some(*addr),
                reason.to_string(),
            ),
            TransportEvent::ConnectFailed {
                addr,
                reason,
                attempts,
            } => (
                gwtf_event_kind::ConnectFailed,
                0,
                0,
                Some(*addr),
                format!("after {attempts} attempts: {reason}"),
            ),
            TransportEvent::Control { peer, msg } => (
                gwtf_event_kind::Control,
                msg.msg_type as i32,
                *peer,
                None,
                format!("control message type {} v{}", msg.msg_type, msg.msg_version),
            ),
        };
        out.kind = kind as i32;
        out.reason = reason;
        out.peer_id = peer;
        if let Some(a) = addr {
            fill(&mut out.addr, &a.to_string());
        }
        fill(&mut out.message, &msg);
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_event, out) };
        Ok(())
    })
}

/// Writes the node's counters into `out_stats`, of which the caller says the
/// size (`sizeof(gwtf_node_stats)`): an older, smaller struct gets the fields
/// it knows.
///
/// Ownership: `out_stats` is caller memory of `stats_size` bytes.
///
/// Thread safety: any thread, concurrently with other calls on `node`.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_node_get_stats(
    node: *const gwtf_node,
    out_stats: *mut gwtf_node_stats,
    stats_size: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, node, |n| {
        require_out(out_stats, "out_stats")?;
        let s = n.node.stats();
        let v = gwtf_node_stats {
            version: GWTF_NODE_STATS_VERSION,
            reserved0: 0,
            frames_sent: s.frames_sent,
            frames_received: s.frames_received,
            bytes_sent: s.bytes_sent,
            bytes_received: s.bytes_received,
            wire_bytes_sent: s.wire_bytes_sent,
            wire_bytes_received: s.wire_bytes_received,
            user_copies: s.user_copies,
            heartbeats_sent: s.heartbeats_sent,
            heartbeats_received: s.heartbeats_received,
            peers_connected: s.peers_connected,
            peers_lost: s.peers_lost,
            connections_refused: s.connections_refused,
            pool_capacity_bytes: s.pool.capacity_bytes,
            pool_in_use_bytes: s.pool.in_use_bytes,
            pool_high_water_bytes: s.pool.high_water_bytes,
            pool_slots_total: s.pool.slots_total,
            pool_slots_in_use: s.pool.slots_in_use,
            pool_slots_high_water: s.pool.slots_high_water,
            pool_alloc_failures: s.pool.failures,
        };
        // SAFETY: out_stats is valid for stats_size bytes.
        unsafe { write_sized(out_stats, stats_size, &v) };
        Ok(())
    })
}

/// Says goodbye to `peer_id` and closes that connection.
///
/// Ownership: `node` is only borrowed.
///
/// Thread safety: any thread, concurrently with other calls on `node`.
///
/// Errors: `GWTF_STATUS_NOT_FOUND`, `GWTF_STATUS_CLOSED`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_node_disconnect(
    node: *mut gwtf_node,
    peer_id: u64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, node, |n| {
        n.node.disconnect(peer_id).map_err(engine_err)
    })
}

/// Says goodbye to every peer (waiting at most about 2 s for the queues) and
/// stops the node's thread. Later sends fail with `GWTF_STATUS_CLOSED`;
/// frames already received stay valid. Idempotent.
///
/// Ownership: `node` is only borrowed; free it with `gwtf_node_free`.
///
/// Thread safety: any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_node_shutdown(
    node: *mut gwtf_node,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, node, |n| {
        n.node.shutdown();
        Ok(())
    })
}

/// Shuts the node down (as `gwtf_node_shutdown`) and frees it.
/// `gwtf_node_free(NULL)` does nothing. Frames still held stay valid until
/// released.
///
/// Ownership: takes ownership of `node`.
///
/// Thread safety: no other thread may use `node` during or after this call.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_node_free(node: *mut gwtf_node) {
    // SAFETY: the caller passes NULL or a node from gwtf_node_new, once.
    unsafe { free_handle(node) }
}
