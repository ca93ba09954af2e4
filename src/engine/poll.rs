//! The poll thread: owns the listener and every connection, drives the
//! sans-I/O [`Connection`] machines over nonblocking sockets.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, IoSlice, Read};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::admission::{Admission, Limits};
use super::{
    add, CloseReason, Cmd, Frame, LinkEmulation, OutPayload, PeerSlot, Shared, TransportEvent,
};
use crate::pool::Lease;
use crate::wire::{
    encode_control_frame, slice_head, sliced_head, ConnEvent, ConnOptions, Connection, FrameKind,
    Goodbye, GoodbyeReason, Heartbeat, NodeKey, ReadTarget, Role, SwarmKey, HEADER_LEN, HEAD_LEN,
    MAX_SLICE_LEN, TAG_LEN,
};

pub(crate) const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);
const FIRST_CONN: usize = 2;
/// Node ids whose keys are remembered (see `Driver::keys_seen`): a few MiB.
const KEYS_KEPT: usize = 1 << 16;
/// Most bytes read from one connection per turn before serving the others.
const READ_BUDGET: usize = 16 << 20;
const MAX_IOV: usize = 64;
const GOODBYE_FLUSH: Duration = Duration::from_secs(2);
/// Largest receive low-water mark asked of the kernel while a payload is
/// being read: the poll thread then wakes once per this many bytes, not once
/// per segment (fewer epoll round trips per frame).
const RCVLOWAT_MAX: usize = 1 << 20;
/// Largest slice of a sliced data frame: a data payload longer than the
/// slice length goes out in slices, and a control frame waits at most one.
const SLICE_MAX: usize = 256 << 10;
const SLICE_MIN: usize = 16 << 10;
const _: () = assert!(SLICE_MAX <= MAX_SLICE_LEN);
/// Units (whole frames, slices: header, tag, payload) planned per write
/// round.
const MAX_UNITS: usize = MAX_IOV / 3 - 1;
/// Most bytes written to one connection per turn before serving the
/// others (the rest goes out on the next turn, at once).
const WRITE_BUDGET: usize = 8 << 20;
/// Unsent bytes the kernel may hold per socket (TCP_NOTSENT_LOWAT): what a
/// control frame may still wait behind once it is written.
const NOTSENT_LOWAT: usize = 256 << 10;

struct OutItem {
    head: Box<[u8; HEADER_LEN]>,
    payload: OutPayload,
    data_len: u64,
    /// Counts against the peer's send queue (user frames).
    counted: bool,
    /// A control frame (counted in the control lane's room); else a data frame.
    control: bool,
    ready_at: Option<Instant>,
}

/// A piece of the byte stream, planned in order: a whole frame, the header
/// that opens a sliced data frame, or one slice of it. Each is sealed when
/// planned (its tag; with encryption, `enc` is the payload to send).
enum Unit {
    Item {
        item: OutItem,
        tag: [u8; TAG_LEN],
        enc: Option<Vec<u8>>,
    },
    Open {
        head: Box<[u8; HEADER_LEN]>,
        tag: [u8; TAG_LEN],
    },
    Slice {
        head: [u8; HEADER_LEN],
        tag: [u8; TAG_LEN],
        start: usize,
        len: usize,
        last: bool,
        enc: Option<Vec<u8>>,
    },
}

impl Unit {
    /// Its bytes; a slice's payload is in `sliced`, the open sliced frame.
    fn parts<'a>(&'a self, sliced: Option<&'a OutItem>) -> [&'a [u8]; 3] {
        match self {
            Unit::Item { item, tag, enc } => [
                &item.head[..],
                &tag[..],
                enc.as_deref().unwrap_or(item.payload()),
            ],
            Unit::Open { head, tag } => [&head[..], &tag[..], &[]],
            Unit::Slice {
                head,
                tag,
                start,
                len,
                enc,
                ..
            } => [
                &head[..],
                &tag[..],
                match enc {
                    Some(e) => &e[..],
                    None => sliced.map_or(&[][..], |s| &s.payload()[*start..*start + *len]),
                },
            ],
        }
    }
    fn total(&self) -> usize {
        HEAD_LEN
            + match self {
                Unit::Item { item, .. } => item.payload().len(),
                Unit::Open { .. } => 0,
                Unit::Slice { len, .. } => *len,
            }
    }
}

/// Seals the next frame of `machine` (established: `plan` runs only then).
fn seal(
    machine: &mut Connection,
    copies: &mut u64,
    head: &[u8; HEADER_LEN],
    payload: &[u8],
) -> ([u8; TAG_LEN], Option<Vec<u8>>) {
    let (tag, enc) = machine
        .seal(head, payload)
        .expect("frames are planned on established connections only");
    *copies += enc.is_some() as u64;
    (tag, enc)
}

impl OutItem {
    fn payload(&self) -> &[u8] {
        match &self.payload {
            OutPayload::None => &[],
            OutPayload::Lease(l) => l.as_slice(),
            OutPayload::Shared(l) => l.as_slice(),
            OutPayload::Range(l, start, len) => &l.as_slice()[*start..*start + *len],
            OutPayload::Bytes(b) => b,
        }
    }
    fn ready(&self, now: Instant) -> bool {
        self.ready_at.is_none_or(|r| r <= now)
    }
    fn control(kind: FrameKind, sender: u64, body: &[u8]) -> Self {
        let bytes = encode_control_frame(kind, sender, body);
        let mut head = Box::new([0u8; HEADER_LEN]);
        head.copy_from_slice(&bytes[..HEADER_LEN]);
        OutItem {
            head,
            payload: OutPayload::Bytes(bytes[HEADER_LEN..].to_vec()),
            data_len: 0,
            counted: false,
            control: true,
            ready_at: None,
        }
    }
}

struct Outbound {
    addr: SocketAddr,
    attempt: u32,
    reply: Option<Sender<Result<u64, String>>>,
}

struct Bucket {
    tokens: f64,
    last: Instant,
    rate: f64,
    burst: f64,
}

impl Bucket {
    /// The token bucket of link emulation `l` (None: no bandwidth cap).
    fn of(l: Option<LinkEmulation>, now: Instant) -> Option<Bucket> {
        l.and_then(|l| {
            (l.bandwidth_bytes_per_s > 0).then(|| {
                let rate = l.bandwidth_bytes_per_s as f64;
                let burst = (rate / 100.0).max(16384.0);
                Bucket {
                    tokens: burst,
                    last: now,
                    rate,
                    burst,
                }
            })
        })
    }
}

struct Conn {
    stream: TcpStream,
    addr: SocketAddr,
    machine: Connection,
    connecting: bool,
    outbound: Option<Outbound>,
    peer: Option<u64>,
    slot: Option<Arc<PeerSlot>>,
    hs_out: Vec<u8>,
    hs_off: usize,
    /// Control frames to send: ahead of data, between slices.
    ctrlq: VecDeque<OutItem>,
    /// Data frames (and a goodbye, after them) to send, in order.
    dataq: VecDeque<OutItem>,
    /// What is being written, in order; `wire_off` bytes of the first are out.
    wire: VecDeque<Unit>,
    wire_off: usize,
    /// The data frame being sent in slices (its slices are in `wire` or
    /// still to plan).
    sliced: Option<OutItem>,
    /// Payload bytes of `sliced` already planned into slices.
    sliced_next: usize,
    /// Payloads copied to be encrypted, not yet counted in the stats.
    copies: u64,
    rx_lease: Option<Lease>,
    rx_filled: usize,
    awaiting_slot: bool,
    started: Instant,
    /// Deadline of the header or control frame being received.
    frame_deadline: Option<Instant>,
    /// Deadline of the data frame being received (sliced or not).
    data_deadline: Option<Instant>,
    last_rx: Instant,
    last_tx: Instant,
    hb_seq: u64,
    closing: Option<Instant>,
    bucket: Option<Bucket>,
    write_at: Option<Instant>,
    got_bytes: bool,
    shut: bool,
    /// The socket's current SO_RCVLOWAT (1 = the kernel default).
    rcvlowat: usize,
    /// A duplicate connection to a peer that has another one: it takes no
    /// new frames, sends what it had started, and is read until the peer's
    /// end of stream (see [`Driver::retire`]).
    retired: bool,
    /// The peer ended its side (a retired connection that still sends).
    peer_eof: bool,
    /// The source address an inbound connection counts against.
    admitted_ip: Option<std::net::IpAddr>,
    /// Counted among the handshakes in progress (until established).
    handshake_counted: bool,
    /// A frame arrived after the handshake: the peer has this connection
    /// up too (a retired duplicate ends its side only once the kept
    /// connection has heard from the peer, so the peer never sees the end
    /// of its only connection).
    heard: bool,
}

impl Conn {
    /// Nothing to send.
    fn idle(&self) -> bool {
        self.ctrlq.is_empty()
            && self.dataq.is_empty()
            && self.wire.is_empty()
            && self.sliced.is_none()
    }

    /// Length of a slice: at most `SLICE_MAX`, and about 10 ms of an
    /// emulated link's bandwidth (a control frame waits at most that long).
    fn slice_len(&self) -> usize {
        match &self.bucket {
            Some(b) => ((b.rate / 100.0) as usize).clamp(SLICE_MIN, SLICE_MAX),
            None => SLICE_MAX,
        }
    }

    /// Seals a whole frame and plans it.
    fn push_item(&mut self, item: OutItem) {
        let (tag, enc) = seal(
            &mut self.machine,
            &mut self.copies,
            &item.head,
            item.payload(),
        );
        self.wire.push_back(Unit::Item { item, tag, enc });
    }

    /// Plans the next units when none is left to write: every ready
    /// control frame first, then data, up to one slice's worth. Returns
    /// when a frame that is not ready yet (link delay) will be.
    fn plan(&mut self, sender: u64, now: Instant) -> Option<Instant> {
        if !self.wire.is_empty() {
            return None;
        }
        let mut later: Option<Instant> = None;
        let mut note = |i: &OutItem| {
            if let Some(r) = i.ready_at.filter(|r| *r > now) {
                later = Some(later.map_or(r, |l: Instant| l.min(r)));
            }
        };
        while self.wire.len() < MAX_UNITS {
            match self.ctrlq.front() {
                Some(i) if i.ready(now) => {
                    let item = self.ctrlq.pop_front().expect("non-empty");
                    self.push_item(item);
                }
                Some(i) => {
                    note(i);
                    break;
                }
                None => break,
            }
        }
        let slice = self.slice_len();
        let mut budget = slice;
        while self.wire.len() < MAX_UNITS && budget > 0 {
            if let Some(s) = &self.sliced {
                let total = s.payload().len();
                let len = (total - self.sliced_next).min(slice);
                let start = self.sliced_next;
                self.sliced_next += len;
                let head = slice_head(sender, len as u64);
                let (tag, enc) = seal(
                    &mut self.machine,
                    &mut self.copies,
                    &head,
                    &s.payload()[start..start + len],
                );
                self.wire.push_back(Unit::Slice {
                    head,
                    tag,
                    start,
                    len,
                    last: self.sliced_next == total,
                    enc,
                });
                // One slice per round; a sliced frame's last slice must be
                // out before the next data frame is planned.
                break;
            }
            let Some(front) = self.dataq.front() else {
                break;
            };
            if !front.ready(now) {
                note(front);
                break;
            }
            let item = self.dataq.pop_front().expect("non-empty");
            if item.payload().len() > slice {
                let head = Box::new(sliced_head(&item.head));
                let (tag, _) = seal(&mut self.machine, &mut self.copies, &head, &[]);
                self.wire.push_back(Unit::Open { head, tag });
                self.sliced = Some(item);
                self.sliced_next = 0;
                continue;
            }
            budget = budget.saturating_sub(item.payload().len() + HEAD_LEN);
            self.push_item(item);
        }
        if self.wire.is_empty() {
            later
        } else {
            None
        }
    }
}

/// What leaving the send queue means for an item: its lane's room, and the
/// counters of data frames sent (`sent`) or dropped.
fn item_done(shared: &Shared, slot: Option<&Arc<PeerSlot>>, item: &OutItem, sent: bool) {
    if !item.counted {
        return;
    }
    if let Some(s) = slot {
        s.done(1, item.control);
    }
    if sent && !item.control {
        add(&shared.counters.frames_sent, 1);
        add(&shared.counters.bytes_sent, item.data_len);
    }
}

/// Best effort: the kernel keeps at most `NOTSENT_LOWAT` unsent bytes of
/// this socket, so a control frame never waits behind megabytes queued in
/// the kernel (a socket that refuses only costs that bound).
fn set_notsent_lowat(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let v = NOTSENT_LOWAT as libc::c_int;
    // SAFETY: a valid socket descriptor owned by `stream`, and a c_int option value.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NOTSENT_LOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

pub(crate) struct Driver {
    shared: Arc<Shared>,
    poll: Poll,
    listener: Option<TcpListener>,
    key: SwarmKey,
    node_key: NodeKey,
    conn_opts: ConnOptions,
    cmd_rx: Receiver<Cmd>,
    frames_tx: Sender<Frame>,
    events_tx: Sender<TransportEvent>,
    conns: HashMap<Token, Conn>,
    by_peer: HashMap<u64, Token>,
    /// The key each node id connected with (bound ids only): a later key
    /// under the same id (found by trying keys until one hashes to it) is
    /// refused. At most `KEYS_KEPT` ids; beyond, new ids are not pinned.
    keys_seen: HashMap<u64, [u8; 32]>,
    next_token: usize,
    retries: Vec<(Instant, Outbound)>,
    readable: HashSet<Token>,
    shutting_down: Option<Instant>,
    /// When the poll thread expected to run its timers again; a turn that
    /// comes much later means this node itself did not run (paused, a
    /// starved host, a long stop of the process).
    due_back: Option<Instant>,
    /// Whether the link was cut (emulated) at the last turn.
    was_cut: bool,
    /// Connections closed while the link was cut: a duplicate of each
    /// socket keeps it open (no FIN leaves) until the link is back.
    held_closed: Vec<std::os::fd::OwnedFd>,
    admission: Admission,
}

/// A turn later than this is this node's own stall, not its peers'.
const OWN_STALL_MIN: Duration = Duration::from_millis(250);

/// Before waiting for more bytes: inside a payload, ask the kernel to wake
/// the poll thread only once `min(remaining, RCVLOWAT_MAX)` bytes are queued
/// (never more than the frame still needs, so the frame always completes);
/// between frames, back to one byte so headers and control messages wake at
/// once. Best effort: a kernel that refuses only costs extra wake-ups.
fn set_rcvlowat(c: &mut Conn) {
    let want = match c.machine.read_target() {
        ReadTarget::Payload { remaining, .. } => (remaining as usize).clamp(1, RCVLOWAT_MAX),
        _ => 1,
    };
    if want == c.rcvlowat {
        return;
    }
    use std::os::fd::AsRawFd;
    let v = want as libc::c_int;
    // SAFETY: a valid socket descriptor owned by `c.stream`, and a c_int option value.
    let r = unsafe {
        libc::setsockopt(
            c.stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        c.rcvlowat = want;
    }
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl Driver {
    /// The emulated link to `peer` of [`super::NodeOptions::peer_links`].
    fn peer_link(&self, peer: u64) -> Option<LinkEmulation> {
        self.shared.opts.peer_links.as_ref()?.get(&peer).copied()
    }

    /// The emulated link to `peer`: its own, else every link's.
    fn link_to(&self, peer: u64) -> Option<LinkEmulation> {
        self.peer_link(peer).or(self.shared.opts.link)
    }

    pub(crate) fn new(
        shared: Arc<Shared>,
        poll: Poll,
        mut listener: Option<TcpListener>,
        key: SwarmKey,
        cmd_rx: Receiver<Cmd>,
        frames_tx: Sender<Frame>,
        events_tx: Sender<TransportEvent>,
    ) -> io::Result<Self> {
        if let Some(l) = listener.as_mut() {
            poll.registry().register(l, LISTENER, Interest::READABLE)?;
        }
        let node_key = shared
            .opts
            .node_key
            .clone()
            .expect("Transport::new sets the node key");
        let limits = Limits {
            per_address: shared.opts.max_connections_per_address,
            handshakes_per_address: shared.opts.max_handshakes_per_address,
            handshakes: shared.opts.max_handshakes,
        };
        let conn_opts = ConnOptions {
            encrypt: shared.opts.encrypt,
            chosen_ids: shared.opts.chosen_ids,
            ..ConnOptions::new(shared.opts.max_payload)
        };
        Ok(Self {
            shared,
            poll,
            listener,
            key,
            node_key,
            conn_opts,
            cmd_rx,
            frames_tx,
            events_tx,
            conns: HashMap::new(),
            by_peer: HashMap::new(),
            keys_seen: HashMap::new(),
            next_token: FIRST_CONN,
            retries: Vec::new(),
            readable: HashSet::new(),
            shutting_down: None,
            due_back: None,
            was_cut: false,
            held_closed: Vec::new(),
            admission: Admission::new(limits),
        })
    }

    /// A connection refused (before or during its handshake, or by a
    /// limit): counted; reported as an event and logged unless it is one
    /// of a flood from one address (a few per second are, with the count
    /// of those not reported). Outbound refusals are always reported (the
    /// caller waits on each dial).
    fn refused(&mut self, addr: SocketAddr, inbound: bool, reason: CloseReason) {
        add(&self.shared.counters.connections_refused, 1);
        let hidden = if inbound {
            match self.admission.sample(addr.ip(), Instant::now()) {
                Some(h) => h,
                None => {
                    add(&self.shared.counters.refusals_unreported, 1);
                    return;
                }
            }
        } else {
            0
        };
        let more = if hidden > 0 {
            format!(" ({hidden} more from this address not reported)")
        } else {
            String::new()
        };
        self.shared.log(format!(
            "refused {} connection {addr}: {reason}{more}",
            if inbound { "inbound" } else { "outbound" },
        ));
        self.emit(TransportEvent::Refused {
            addr,
            inbound,
            reason,
        });
    }

    fn emit(&self, ev: TransportEvent) {
        match self.events_tx.try_send(ev) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                add(&self.shared.counters.events_dropped, 1)
            }
        }
    }

    pub(crate) fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            let now = Instant::now();
            let next = self.timers(now);
            if let Some(t) = self.shutting_down {
                if self.conns.is_empty() || now >= t {
                    break;
                }
            }
            let mut timeout = next.map(|t| t.saturating_duration_since(now));
            // (Nothing is read while the link is cut: no busy turn.)
            if !self.readable.is_empty() && !self.cut() {
                timeout = Some(Duration::ZERO);
            }
            if self.conns.values().any(|c| c.awaiting_slot) {
                timeout = Some(timeout.map_or(Duration::from_millis(50), |t| {
                    t.min(Duration::from_millis(50))
                }));
            }
            self.shared.parked.store(true, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            if !self.cmd_rx.is_empty() {
                timeout = Some(Duration::ZERO);
            }
            self.due_back = timeout.map(|t| Instant::now() + t);
            let r = self.poll.poll(&mut events, timeout);
            self.shared.parked.store(false, Ordering::SeqCst);
            if let Err(e) = r {
                if e.kind() != io::ErrorKind::Interrupted {
                    self.shared.log(format!("poll failed: {e}"));
                    break;
                }
            }
            for ev in events.iter() {
                match ev.token() {
                    WAKER => {}
                    LISTENER => self.accept(),
                    t => {
                        if ev.is_writable() || ev.is_error() {
                            self.on_writable(t);
                        }
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.readable.insert(t);
                        }
                    }
                }
            }
            self.commands();
            if self.link_turn() {
                continue;
            }
            // Connections waiting for a pool slot retry (a release may have woken us).
            let waiting: Vec<Token> = self
                .conns
                .iter()
                .filter(|(_, c)| c.awaiting_slot)
                .map(|(t, _)| *t)
                .collect();
            self.readable.extend(waiting);
            let ready: Vec<Token> = self.readable.drain().collect();
            for t in ready {
                self.on_readable(t);
            }
            let any_waiting = self.conns.values().any(|c| c.awaiting_slot);
            self.shared.pool.want_release_hook(any_waiting);
        }
        // Close whatever is left.
        let tokens: Vec<Token> = self.conns.keys().copied().collect();
        for t in tokens {
            self.close(t, CloseReason::Local);
        }
        for (_, ob) in self.retries.drain(..) {
            if let Some(r) = ob.reply {
                let _ = r.send(Err("node shut down".into()));
            }
        }
    }

    fn new_conn(
        &mut self,
        stream: TcpStream,
        addr: SocketAddr,
        role: Role,
        outbound: Option<Outbound>,
        connecting: bool,
    ) {
        let inbound = outbound.is_none();
        let admitted_ip = inbound.then_some(addr.ip());
        let refusal = if self.conns.len() >= self.shared.opts.max_connections {
            Some(CloseReason::TooManyConnections)
        } else {
            self.admission
                .admit(admitted_ip)
                .err()
                .map(|r| CloseReason::Limit(r.0))
        };
        if let Some(reason) = refusal {
            // Nothing allocated for it yet; the socket closes here.
            if let Some(r) = outbound.and_then(|o| o.reply) {
                let _ = r.send(Err(reason.to_string()));
            }
            self.refused(addr, inbound, reason);
            return;
        }
        let token = Token(self.next_token);
        self.next_token += 1;
        let mut stream = stream;
        set_notsent_lowat(&stream);
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            token,
            Interest::READABLE | Interest::WRITABLE,
        ) {
            self.shared.log(format!("cannot register {addr}: {e}"));
            self.admission.closed(admitted_ip, true);
            return;
        }
        let mut machine = Connection::new(
            role,
            self.shared.node_id,
            &self.key,
            &self.node_key,
            &self.conn_opts,
        );
        let now = Instant::now();
        let hs_out = machine.take_outgoing();
        let bucket = Bucket::of(self.shared.opts.link, now);
        let conn = Conn {
            stream,
            addr,
            machine,
            connecting,
            outbound,
            peer: None,
            slot: None,
            hs_out,
            hs_off: 0,
            ctrlq: VecDeque::new(),
            dataq: VecDeque::new(),
            wire: VecDeque::new(),
            wire_off: 0,
            sliced: None,
            sliced_next: 0,
            copies: 0,
            rx_lease: None,
            rx_filled: 0,
            awaiting_slot: false,
            started: now,
            frame_deadline: None,
            data_deadline: None,
            last_rx: now,
            last_tx: now,
            hb_seq: 0,
            closing: None,
            bucket,
            write_at: None,
            got_bytes: false,
            shut: false,
            rcvlowat: 1,
            retired: false,
            peer_eof: false,
            admitted_ip,
            handshake_counted: true,
            heard: false,
        };
        self.conns.insert(token, conn);
        if !connecting {
            self.flush(token);
            self.readable.insert(token);
        }
    }

    fn cut(&self) -> bool {
        self.shared.link_cut.load(Ordering::Relaxed)
    }

    /// The emulated cut ([`super::Transport::set_link_cut`]): true while the
    /// link is cut (nothing is read this turn). On restore every
    /// connection is read and flushed again (readiness is edge-triggered:
    /// what came meanwhile raised no new event), the listener accepts, and
    /// the connections closed meanwhile close for their peers.
    fn link_turn(&mut self) -> bool {
        let cut = self.cut();
        if cut == self.was_cut {
            return cut;
        }
        self.was_cut = cut;
        if cut {
            return true;
        }
        self.held_closed.clear();
        let tokens: Vec<Token> = self.conns.keys().copied().collect();
        for t in tokens {
            self.readable.insert(t);
            self.on_writable(t);
        }
        self.accept();
        false
    }

    fn accept(&mut self) {
        if self.cut() {
            return;
        }
        loop {
            let Some(l) = self.listener.as_ref() else {
                return;
            };
            match l.accept() {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    if self.shutting_down.is_some() {
                        continue;
                    }
                    self.new_conn(stream, addr, Role::Acceptor, None, false);
                }
                Err(e) if would_block(&e) => return,
                Err(e) => {
                    self.shared.log(format!("accept failed: {e}"));
                    return;
                }
            }
        }
    }

    fn start_connect(&mut self, ob: Outbound) {
        if self.cut() {
            self.connect_failed(ob, "network is unreachable (link cut, emulated)".into());
            return;
        }
        match TcpStream::connect(ob.addr) {
            Ok(stream) => {
                let addr = ob.addr;
                self.new_conn(stream, addr, Role::Connector, Some(ob), true);
            }
            Err(e) => self.connect_failed(ob, e.to_string()),
        }
    }

    fn connect_failed(&mut self, mut ob: Outbound, why: String) {
        ob.attempt += 1;
        let opts = &self.shared.opts;
        if ob.attempt >= opts.connect_attempts || self.shutting_down.is_some() {
            self.shared.log(format!(
                "connect to {} failed after {} attempts: {why}",
                ob.addr, ob.attempt
            ));
            self.emit(TransportEvent::ConnectFailed {
                addr: ob.addr,
                attempts: ob.attempt,
                reason: why.clone(),
            });
            if let Some(r) = ob.reply {
                let _ = r.send(Err(format!("failed after {} attempts: {why}", ob.attempt)));
            }
            return;
        }
        let backoff = opts
            .connect_backoff
            .saturating_mul(1u32 << (ob.attempt - 1).min(16))
            .min(opts.connect_backoff_max);
        self.retries.push((Instant::now() + backoff, ob));
    }

    fn commands(&mut self) {
        while let Ok(cmd) = self.cmd_rx.try_recv() {
            match cmd {
                Cmd::Connect { addr, reply } => {
                    if self.shutting_down.is_some() {
                        if let Some(r) = reply {
                            let _ = r.send(Err("node shut down".into()));
                        }
                        continue;
                    }
                    self.start_connect(Outbound {
                        addr,
                        attempt: 0,
                        reply,
                    })
                }
                Cmd::Send {
                    peer,
                    head,
                    payload,
                    data_len,
                    control,
                } => {
                    let Some(&t) = self.by_peer.get(&peer) else {
                        // The peer left after the sender reserved room; the slot is closed.
                        continue;
                    };
                    let delay = self.link_to(peer).map(|l| l.delay).filter(|d| !d.is_zero());
                    let c = self.conns.get_mut(&t).expect("by_peer is consistent");
                    let item = OutItem {
                        head,
                        payload,
                        data_len,
                        counted: true,
                        control,
                        ready_at: delay.map(|d| Instant::now() + d),
                    };
                    if control {
                        c.ctrlq.push_back(item);
                    } else {
                        c.dataq.push_back(item);
                    }
                    self.flush(t);
                }
                Cmd::Disconnect { peer } => {
                    if let Some(&t) = self.by_peer.get(&peer) {
                        self.say_goodbye(t, GoodbyeReason::Disconnect, "disconnect");
                    }
                }
                Cmd::Shutdown => {
                    self.shutting_down = Some(Instant::now() + GOODBYE_FLUSH);
                    self.listener = None;
                    let tokens: Vec<Token> = self.conns.keys().copied().collect();
                    for t in tokens {
                        if self.conns[&t].peer.is_some() {
                            self.say_goodbye(t, GoodbyeReason::Shutdown, "node shutting down");
                        } else {
                            self.close(t, CloseReason::Local);
                        }
                    }
                }
            }
        }
    }

    fn say_goodbye(&mut self, t: Token, reason: GoodbyeReason, msg: &str) {
        let id = self.shared.node_id;
        if let Some(c) = self.conns.get_mut(&t) {
            if c.closing.is_some() {
                return;
            }
            let body = Goodbye {
                reason,
                message: msg.into(),
            }
            .encode();
            // After the data queued before it (a goodbye ends the stream).
            c.dataq
                .push_back(OutItem::control(FrameKind::Goodbye, id, &body));
            c.closing = Some(Instant::now() + GOODBYE_FLUSH);
            self.flush(t);
        }
    }

    fn on_writable(&mut self, t: Token) {
        if self.cut() {
            return;
        }
        let Some(c) = self.conns.get_mut(&t) else {
            return;
        };
        if c.connecting {
            match c.stream.take_error() {
                Ok(Some(e)) | Err(e) => {
                    self.connect_refused(t, e.to_string());
                    return;
                }
                Ok(None) => {}
            }
            match c.stream.peer_addr() {
                Ok(_) => {
                    c.connecting = false;
                    let _ = c.stream.set_nodelay(true);
                    c.started = Instant::now();
                    c.last_rx = c.started;
                }
                Err(e) if e.kind() == io::ErrorKind::NotConnected => return,
                Err(e) => {
                    self.connect_refused(t, e.to_string());
                    return;
                }
            }
        }
        self.flush(t);
    }

    /// The outbound connection `t` failed before it connected: its
    /// handshake slot is given back (before, each refused dial kept one,
    /// and a node that dialed a peer gone for good, attempt after attempt,
    /// refused every connection once it had leaked 256), and it is tried
    /// again or given up.
    fn connect_refused(&mut self, t: Token, why: String) {
        let Some(mut c) = self.conns.remove(&t) else {
            return;
        };
        self.admission.closed(c.admitted_ip, c.handshake_counted);
        let _ = self.poll.registry().deregister(&mut c.stream);
        self.connect_failed(c.outbound.expect("connecting conns are outbound"), why);
    }

    /// Writes handshake bytes and queued frames until the socket would block.
    fn flush(&mut self, t: Token) {
        if self.cut() {
            return;
        }
        let shared = self.shared.clone();
        let may_shut = self.may_shut(t);
        let Some(c) = self.conns.get_mut(&t) else {
            return;
        };
        if c.connecting {
            return;
        }
        let mut failure = None;
        // Handshake bytes first.
        while c.hs_off < c.hs_out.len() {
            match send_vectored(&c.stream, &[IoSlice::new(&c.hs_out[c.hs_off..])]) {
                Ok(n) => {
                    c.hs_off += n;
                    add(&shared.counters.wire_bytes_sent, n as u64);
                }
                Err(e) if would_block(&e) => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    failure = Some(CloseReason::Io(e.to_string()));
                    break;
                }
            }
        }
        if failure.is_none() && c.hs_off == c.hs_out.len() {
            c.hs_out.clear();
            c.hs_off = 0;
        }
        let mut blocked = false;
        let mut written = 0usize;
        let sender = shared.node_id;
        while failure.is_none() && c.machine.is_established() {
            let now = Instant::now();
            if c.wire.is_empty() {
                if let Some(at) = c.plan(sender, now) {
                    c.write_at = Some(at);
                }
                add(&shared.counters.user_copies, std::mem::take(&mut c.copies));
                if c.wire.is_empty() {
                    break;
                }
            }
            if written >= WRITE_BUDGET {
                // Serve the other connections; go on at the next turn.
                c.write_at = Some(now);
                break;
            }
            let mut allowed = usize::MAX;
            if let Some(b) = c.bucket.as_mut() {
                b.tokens =
                    (b.tokens + now.duration_since(b.last).as_secs_f64() * b.rate).min(b.burst);
                b.last = now;
                // Write once a useful amount is allowed (a quarter of the
                // burst, or all that is planned), never byte by byte: the
                // poll thread must not spin here, pacing one connection.
                let pending: usize = c.wire.iter().map(Unit::total).sum::<usize>() - c.wire_off;
                let need = (pending as f64).min((b.burst / 4.0).max(1.0));
                if b.tokens < need {
                    c.write_at =
                        Some(now + Duration::from_secs_f64((need - b.tokens) / b.rate + 0.0005));
                    break;
                }
                allowed = b.tokens as usize;
            }
            let r = {
                let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(8);
                let mut total = 0usize;
                let mut skip = c.wire_off;
                for u in c.wire.iter() {
                    if iov.len() + 3 > MAX_IOV || total >= allowed {
                        break;
                    }
                    for p in u.parts(c.sliced.as_ref()) {
                        let cut = skip.min(p.len());
                        skip -= cut;
                        let p = &p[cut..];
                        if p.is_empty() || total >= allowed {
                            continue;
                        }
                        let take = p.len().min(allowed - total);
                        iov.push(IoSlice::new(&p[..take]));
                        total += take;
                    }
                }
                if iov.is_empty() {
                    break;
                }
                add(&shared.counters.write_calls, 1);
                send_vectored(&c.stream, &iov)
            };
            match r {
                Ok(0) => {
                    failure = Some(CloseReason::Io("write returned 0".into()));
                }
                Ok(mut n) => {
                    add(&shared.counters.wire_bytes_sent, n as u64);
                    written += n;
                    c.last_tx = now;
                    if let Some(b) = c.bucket.as_mut() {
                        b.tokens -= n as f64;
                    }
                    while n > 0 {
                        let left = c.wire[0].total() - c.wire_off;
                        if n < left {
                            c.wire_off += n;
                            break;
                        }
                        n -= left;
                        c.wire_off = 0;
                        match c.wire.pop_front().expect("non-empty") {
                            Unit::Item { item, .. } => {
                                item_done(&shared, c.slot.as_ref(), &item, true)
                            }
                            Unit::Slice { last: true, .. } => {
                                if let Some(item) = c.sliced.take() {
                                    item_done(&shared, c.slot.as_ref(), &item, true);
                                }
                                c.sliced_next = 0;
                            }
                            Unit::Open { .. } | Unit::Slice { .. } => {}
                        }
                    }
                }
                Err(e) if would_block(&e) => {
                    blocked = true;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => failure = Some(CloseReason::Io(e.to_string())),
            }
        }
        if let Some(s) = c.slot.as_ref().filter(|_| !c.retired) {
            s.set_write_blocked(blocked && !c.idle());
        }
        if failure.is_none() && c.closing.is_some() && c.idle() && !c.shut && may_shut {
            // Half-close after the goodbye and wait for the peer's EOF, so
            // that closing never turns into a reset that loses the goodbye.
            c.shut = true;
            let _ = c.stream.shutdown(std::net::Shutdown::Write);
        }
        if failure.is_none() && c.shut && c.peer_eof {
            failure = Some(CloseReason::Duplicate);
        }
        if let Some(r) = failure {
            self.close(t, r);
        }
    }

    /// A retired duplicate may end its side once the kept connection has
    /// heard from the peer (or is gone); any other closing connection may.
    fn may_shut(&self, t: Token) -> bool {
        match self.conns.get(&t) {
            Some(c) if c.retired => c
                .peer
                .and_then(|p| self.by_peer.get(&p))
                .and_then(|k| self.conns.get(k))
                .is_none_or(|k| k.heard),
            _ => true,
        }
    }

    /// The peer has `t` up: duplicates of it that wait for that may end
    /// their side now.
    fn heard_on(&mut self, t: Token) {
        let Some(peer) = self.conns.get(&t).and_then(|c| c.peer) else {
            return;
        };
        if self.by_peer.get(&peer) != Some(&t) {
            return;
        }
        let retired: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| c.retired && c.peer == Some(peer))
            .map(|(k, _)| *k)
            .collect();
        for r in retired {
            self.flush(r);
        }
    }

    /// Queues a heartbeat on `t` (not flushed).
    fn queue_heartbeat(&mut self, t: Token, now: Instant) {
        let id = self.shared.node_id;
        if let Some(c) = self.conns.get_mut(&t) {
            c.hb_seq += 1;
            let hb = Heartbeat {
                seq: c.hb_seq,
                sent_at_us: now.duration_since(c.started).as_micros() as u64,
            };
            c.ctrlq
                .push_back(OutItem::control(FrameKind::Heartbeat, id, &hb.encode()));
            c.last_tx = now;
            add(&self.shared.counters.heartbeats_sent, 1);
        }
    }

    fn on_readable(&mut self, t: Token) {
        if self.cut() {
            return;
        }
        let shared = self.shared.clone();
        let mut budget = READ_BUDGET;
        let mut outcome: Result<(), CloseReason> = Ok(());
        let mut established = None;
        let mut delivered = Vec::new();
        let mut controls = Vec::new();
        let mut handshake_out = false;
        let mut drained = false;
        let mut newly_heard = false;
        {
            let Some(c) = self.conns.get_mut(&t) else {
                return;
            };
            if c.connecting {
                return;
            }
            c.awaiting_slot = false;
            loop {
                if budget == 0 {
                    self.readable.insert(t);
                    break;
                }
                // The caller is behind on its events: stop reading (TCP
                // pushes back on the peer) rather than drop a control
                // message; retried like a wait for a pool slot.
                if self.events_tx.len() + controls.len() >= super::EVENT_QUEUE - super::EVENT_ROOM {
                    c.awaiting_slot = true;
                    break;
                }
                let r = match c.machine.read_target() {
                    ReadTarget::Closed => break,
                    ReadTarget::Small(buf) => {
                        add(&shared.counters.read_calls, 1);
                        match c.stream.read(buf) {
                            Ok(0) if c.retired && !c.shut && !c.machine.in_frame() => {
                                // The peer is done with this duplicate; what
                                // we still hold for it goes out first.
                                c.peer_eof = true;
                                break;
                            }
                            Ok(0) => {
                                outcome = Err(if c.shut {
                                    CloseReason::Local
                                } else if c.machine.awaiting_confirmation() {
                                    // The acceptor checked our proof and
                                    // closed instead of confirming.
                                    CloseReason::Protocol(crate::wire::WireError::Handshake(
                                        "the peer closed after our proof of the swarm key \
                                         (its swarm key differs from ours, or a limit refused us)"
                                            .into(),
                                    ))
                                } else {
                                    CloseReason::Eof {
                                        mid_frame: c.machine.in_frame(),
                                        in_handshake: !c.machine.is_established(),
                                    }
                                });
                                break;
                            }
                            Ok(n) => {
                                c.got_bytes = true;
                                budget = budget.saturating_sub(n);
                                add(&shared.counters.wire_bytes_received, n as u64);
                                c.last_rx = Instant::now();
                                if let Some(s) = &c.slot {
                                    s.received.fetch_add(n as u64, Ordering::Relaxed);
                                }
                                if c.frame_deadline.is_none() && c.machine.is_established() {
                                    c.frame_deadline = Some(c.last_rx + shared.opts.frame_timeout);
                                }
                                c.machine.small_read(n)
                            }
                            Err(e) if would_block(&e) => {
                                drained = true;
                                break;
                            }
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                            Err(e) => {
                                outcome = Err(CloseReason::Io(e.to_string()));
                                break;
                            }
                        }
                    }
                    ReadTarget::Payload { header, remaining } => {
                        if c.rx_lease.is_none() {
                            match shared.pool.try_alloc(header.payload_len as usize) {
                                Ok(Some(l)) => {
                                    c.rx_lease = Some(l);
                                    c.rx_filled = 0;
                                }
                                Ok(None) => {
                                    c.awaiting_slot = true;
                                    break;
                                }
                                Err(e) => {
                                    outcome = Err(CloseReason::Io(e.to_string()));
                                    break;
                                }
                            }
                        }
                        let lease = c.rx_lease.as_mut().expect("leased above");
                        let start = c.rx_filled;
                        let want = (remaining as usize).min(budget.max(1 << 16));
                        let buf = &mut lease.as_mut_slice()[start..start + want];
                        add(&shared.counters.read_calls, 1);
                        match c.stream.read(buf) {
                            Ok(0) => {
                                outcome = Err(CloseReason::Eof {
                                    mid_frame: true,
                                    in_handshake: false,
                                });
                                break;
                            }
                            Ok(n) => {
                                budget = budget.saturating_sub(n);
                                add(&shared.counters.wire_bytes_received, n as u64);
                                c.last_rx = Instant::now();
                                if let Some(s) = &c.slot {
                                    s.received.fetch_add(n as u64, Ordering::Relaxed);
                                }
                                c.rx_filled += n;
                                if let Some(d) = c.data_deadline.as_mut() {
                                    *d += Duration::from_secs_f64(
                                        n as f64 / shared.opts.min_frame_rate.max(1) as f64,
                                    );
                                }
                                let filled = &mut lease.as_mut_slice()[..c.rx_filled];
                                c.machine.payload_read(filled, n)
                            }
                            Err(e) if would_block(&e) => {
                                drained = true;
                                break;
                            }
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                            Err(e) => {
                                outcome = Err(CloseReason::Io(e.to_string()));
                                break;
                            }
                        }
                    }
                };
                if c.machine.has_outgoing() {
                    let out = c.machine.take_outgoing();
                    c.hs_out.extend_from_slice(&out);
                    handshake_out = true;
                }
                match r {
                    Ok(None) => {}
                    Ok(Some(ev)) => match ev {
                        ConnEvent::Established { peer_id } => {
                            established = Some(peer_id);
                            c.frame_deadline = None;
                        }
                        ConnEvent::DataHeader(_) => {
                            newly_heard |= !std::mem::replace(&mut c.heard, true);
                            // Every payload byte received earns its time
                            // at the slowest accepted rate (below): a
                            // half-sent frame holds its pool slot only
                            // while its bytes keep coming.
                            c.data_deadline = Some(Instant::now() + shared.opts.frame_timeout);
                        }
                        ConnEvent::Data(h) => {
                            newly_heard |= !std::mem::replace(&mut c.heard, true);
                            c.data_deadline = None;
                            let lease = c.rx_lease.take();
                            c.rx_filled = 0;
                            add(&shared.counters.frames_received, 1);
                            add(&shared.counters.bytes_received, h.payload_len);
                            delivered.push(Frame {
                                header: h,
                                lease,
                                peer: c.peer.or(established).unwrap_or(0),
                            });
                        }
                        ConnEvent::Heartbeat(_) => {
                            newly_heard |= !std::mem::replace(&mut c.heard, true);
                            c.frame_deadline = None;
                            add(&shared.counters.heartbeats_received, 1);
                        }
                        ConnEvent::Goodbye(g) => {
                            outcome = Err(CloseReason::Goodbye {
                                reason: g.reason,
                                message: g.message,
                            });
                            break;
                        }
                        ConnEvent::Control(msg) => {
                            newly_heard |= !std::mem::replace(&mut c.heard, true);
                            c.frame_deadline = None;
                            controls.push(msg);
                        }
                    },
                    Err(e) => {
                        outcome = Err(CloseReason::Protocol(e));
                        break;
                    }
                }
                if c.machine.is_established() && !c.machine.in_small_frame() {
                    // Between frames, in a payload or between the slices
                    // of a sliced frame: the data frame's deadline holds.
                    c.frame_deadline = None;
                }
                if established.is_some() {
                    // Register the peer before reading its frames.
                    self.readable.insert(t);
                    break;
                }
            }
            if drained && outcome.is_ok() {
                set_rcvlowat(c);
            }
        }
        for f in delivered {
            let _ = self.frames_tx.send(f);
        }
        if newly_heard {
            self.heard_on(t);
        }
        if let Some(peer) = established {
            self.on_established(t, peer);
        }
        if let Some(&peer) = self.conns.get(&t).and_then(|c| c.peer.as_ref()) {
            for msg in controls {
                self.emit(TransportEvent::Control { peer, msg });
            }
        }
        if let Err(reason) = outcome {
            if handshake_out {
                // Best effort: let the peer see our proof too, so that both
                // sides report the failed authentication.
                if let Some(c) = self.conns.get_mut(&t) {
                    let _ = send_vectored(&c.stream, &[IoSlice::new(&c.hs_out[c.hs_off..])]);
                }
            }
            self.close(t, reason);
            return;
        }
        if handshake_out {
            self.flush(t);
        }
    }

    /// A connection to `peer` is authenticated.
    fn on_established(&mut self, t: Token, peer: u64) {
        if let Some(c) = self.conns.get_mut(&t) {
            c.handshake_counted = false;
            self.admission.established(c.admitted_ip);
        }
        if !self.shared.opts.chosen_ids {
            let key = self.conns.get(&t).and_then(|c| c.machine.peer_key());
            if let Some(key) = key {
                match self.keys_seen.get(&peer) {
                    Some(k) if *k != key => {
                        self.close(
                            t,
                            CloseReason::Protocol(crate::wire::WireError::KeyChanged { id: peer }),
                        );
                        return;
                    }
                    Some(_) => {}
                    None if self.keys_seen.len() < KEYS_KEPT => {
                        self.keys_seen.insert(peer, key);
                    }
                    None => {}
                }
            }
        }
        let of_peer = self.conns.values().filter(|c| c.peer == Some(peer)).count();
        if of_peer >= self.shared.opts.max_connections_per_id {
            self.close(
                t,
                CloseReason::Limit(format!(
                    "{of_peer} connections of node {peer:x} already (the most per node id)"
                )),
            );
            return;
        }
        self.connected(t, peer);
        self.reply_connected(t, peer);
    }

    /// Tells a caller waiting in `connect_wait` (after the peer can take frames).
    fn reply_connected(&mut self, t: Token, peer: u64) {
        if let Some(r) = self
            .conns
            .get_mut(&t)
            .and_then(|c| c.outbound.as_mut())
            .and_then(|o| o.reply.take())
        {
            let _ = r.send(Ok(peer));
        }
    }

    /// Takes `t` into use for `peer`. When the peer has another connection
    /// (both dialled at once), both sides keep the one whose connector has
    /// the smaller id and retire the other; of two dialled by the same
    /// side, the one with the smaller handshake nonces. Both ends decide
    /// the same from what both know: the order in which two connections
    /// finish their handshakes may differ between the ends ("keep the
    /// older" had the ends keep different ones, each silent on the one the
    /// other kept until the peer timeout).
    fn connected(&mut self, t: Token, peer: u64) {
        let outbound = self.conns[&t].outbound.is_some();
        if let Some(l) = self.peer_link(peer) {
            let c = self.conns.get_mut(&t).expect("present");
            c.bucket = Bucket::of(Some(l), Instant::now());
        }
        let Some(&other) = self.by_peer.get(&peer) else {
            let slot = Arc::new(PeerSlot::new(self.shared.opts.send_queue_depth));
            self.shared.peers.write().insert(peer, slot.clone());
            self.by_peer.insert(peer, t);
            add(&self.shared.counters.peers_connected, 1);
            let c = self.conns.get_mut(&t).expect("present");
            c.peer = Some(peer);
            c.slot = Some(slot);
            let addr = c.addr;
            let sealing = if c.machine.encrypted() {
                "encrypted"
            } else {
                "tagged"
            };
            self.shared.log(format!(
                "peer {peer:x} connected ({addr}, {}, {sealing})",
                if outbound { "outbound" } else { "inbound" }
            ));
            self.emit(TransportEvent::PeerConnected {
                peer,
                addr,
                outbound,
            });
            return;
        };
        let me = self.shared.node_id;
        let other_outbound = self.conns[&other].outbound.is_some();
        let connector = |ob: bool| if ob { me } else { peer };
        let keep_new = if outbound != other_outbound {
            connector(outbound) < connector(other_outbound)
        } else {
            let hash = |k: Token| self.conns[&k].machine.handshake_hash();
            hash(t) < hash(other)
        };
        // One peer, one send-queue account: the kept connection takes over
        // the slot (senders waiting for room keep waiting, nothing fails).
        let slot = self.conns[&other].slot.clone();
        let c = self.conns.get_mut(&t).expect("present");
        c.peer = Some(peer);
        c.slot = slot;
        if !keep_new {
            // Tell the peer at once that the kept connection is up here
            // (see `Conn::heard`).
            self.queue_heartbeat(other, Instant::now());
            self.flush(other);
            self.retire(t);
            return;
        }
        // Frames the old connection has not started writing move, in order,
        // to the kept one; it finishes what it has started (`wire`, and a
        // sliced frame to its last slice).
        let (ctrl, data): (Vec<OutItem>, Vec<OutItem>) = {
            let o = self.conns.get_mut(&other).expect("present");
            (o.ctrlq.drain(..).collect(), o.dataq.drain(..).collect())
        };
        self.by_peer.insert(peer, t);
        let c = self.conns.get_mut(&t).expect("present");
        c.ctrlq.extend(ctrl);
        c.dataq.extend(data);
        self.queue_heartbeat(t, Instant::now());
        self.shared.log(format!(
            "peer {peer:x}: duplicate connection, now using the {} one",
            if outbound { "outbound" } else { "inbound" }
        ));
        self.retire(other);
        self.flush(t);
    }

    /// Winds down a duplicate connection without losing what travels on
    /// it: it sends what it holds, then ends its side; the peer does the
    /// same, and it closes at the peer's end of stream (or after a bounded
    /// wait without progress). Its close is not a lost peer.
    fn retire(&mut self, t: Token) {
        let Some(c) = self.conns.get_mut(&t) else {
            return;
        };
        c.retired = true;
        c.closing = Some(Instant::now() + GOODBYE_FLUSH);
        add(&self.shared.counters.duplicates_retired, 1);
        self.flush(t);
    }

    /// The connection `t` (already out of `conns`), kept for its peer, is
    /// closing: a retired duplicate of it that is still whole (this side
    /// has not ended it, the peer has not either) takes over instead of the
    /// peer being lost. Both sides pick the same connection only when both
    /// see the same two; a side whose kept one was already dead at the
    /// peer (the peer gave up on its handshake while this node was paused,
    /// then this node dialled) retired the one the peer uses, and without
    /// this the peer times it out as silent and the swarm sees a live
    /// member lost. Frames not yet started move to the duplicate, in
    /// order; the caller is told of a lost peer connected again (what was
    /// on the wire may be gone). Returns whether it did.
    fn promote_duplicate(&mut self, t: Token, c: &mut Conn, reason: &CloseReason) -> bool {
        // Only a connection that failed under it: not one this node ended
        // (a disconnect, a goodbye, a shutdown) or that broke the protocol.
        let failed = matches!(
            reason,
            CloseReason::Eof { .. } | CloseReason::Io(_) | CloseReason::PeerTimeout { .. }
        );
        let Some(peer) = c
            .peer
            .filter(|_| failed && !c.retired && c.closing.is_none())
        else {
            return false;
        };
        if self.by_peer.get(&peer) != Some(&t) {
            return false;
        }
        let Some((&d, _)) = self.conns.iter().find(|(_, o)| {
            o.retired && o.peer == Some(peer) && !o.shut && !o.peer_eof && !o.connecting
        }) else {
            return false;
        };
        let (ctrl, data): (Vec<OutItem>, Vec<OutItem>) =
            (c.ctrlq.drain(..).collect(), c.dataq.drain(..).collect());
        let now = Instant::now();
        let o = self.conns.get_mut(&d).expect("present");
        o.retired = false;
        o.closing = None;
        o.ctrlq.extend(ctrl);
        o.dataq.extend(data);
        let (addr, outbound) = (o.addr, o.outbound.is_some());
        self.by_peer.insert(peer, d);
        add(&self.shared.counters.duplicates_promoted, 1);
        self.shared.log(format!(
            "peer {peer:x}: kept connection ({}) closed: {reason}; now using its duplicate ({addr})",
            c.addr
        ));
        // What was on the wire of the failed one may be lost: the caller
        // sees the peer lost and connected again at once (an all-reduce
        // that had chunks on it starts over, see `Aggregation`).
        self.emit(TransportEvent::PeerLost {
            peer,
            addr: c.addr,
            reason: reason.clone(),
        });
        self.emit(TransportEvent::PeerConnected {
            peer,
            addr,
            outbound,
        });
        self.queue_heartbeat(d, now);
        self.flush(d);
        true
    }

    fn close(&mut self, t: Token, reason: CloseReason) {
        let Some(mut c) = self.conns.remove(&t) else {
            return;
        };
        self.admission.closed(c.admitted_ip, c.handshake_counted);
        if matches!(
            reason,
            CloseReason::Protocol(crate::wire::WireError::Mac { .. })
        ) {
            add(&self.shared.counters.tag_failures, 1);
        }
        let _ = self.poll.registry().deregister(&mut c.stream);
        if self.cut() {
            use std::os::fd::AsFd;
            if let Ok(fd) = c.stream.as_fd().try_clone_to_owned() {
                self.held_closed.push(fd);
            }
        }
        let promoted = self.promote_duplicate(t, &mut c, &reason);
        let units = c.wire.drain(..).filter_map(|u| match u {
            Unit::Item { item, .. } => Some(item),
            _ => None,
        });
        let items: Vec<OutItem> = c
            .ctrlq
            .drain(..)
            .chain(c.dataq.drain(..))
            .chain(units)
            .chain(c.sliced.take())
            .collect();
        for item in &items {
            item_done(&self.shared, c.slot.as_ref(), item, false);
        }
        drop(c.rx_lease.take());
        if promoted {
            return;
        }
        if c.retired {
            // The peer stays connected through its other connection.
            if let Some(peer) = c.peer {
                self.shared.log(format!(
                    "peer {peer:x}: duplicate connection ({}) closed: {reason}",
                    c.addr
                ));
            }
            return;
        }
        match c.peer {
            Some(peer) => {
                if self.by_peer.get(&peer) == Some(&t) {
                    self.by_peer.remove(&peer);
                    if let Some(s) = self.shared.peers.write().remove(&peer) {
                        s.close();
                    }
                }
                if let Some(s) = &c.slot {
                    s.close();
                }
                self.shared
                    .counters
                    .peers_connected
                    .fetch_sub(1, Ordering::Relaxed);
                if reason != CloseReason::Local {
                    add(&self.shared.counters.peers_lost, 1);
                }
                self.shared
                    .log(format!("peer {peer:x} ({}) closed: {reason}", c.addr));
                if reason != CloseReason::Duplicate {
                    self.emit(TransportEvent::PeerLost {
                        peer,
                        addr: c.addr,
                        reason,
                    });
                }
            }
            None => {
                if reason == CloseReason::Local || reason == CloseReason::Duplicate {
                    if let Some(r) = c.outbound.and_then(|o| o.reply) {
                        let _ = r.send(Err(reason.to_string()));
                    }
                    return;
                }
                // A connector whose peer closed before sending anything may
                // retry (the listener may be restarting); other failures are refusals.
                if let (Some(ob), CloseReason::Eof { .. } | CloseReason::Io(_)) =
                    (&c.outbound, &reason)
                {
                    if !c.got_bytes && ob.attempt + 1 < self.shared.opts.connect_attempts {
                        let ob = c.outbound.take().expect("checked");
                        self.connect_failed(ob, reason.to_string());
                        return;
                    }
                }
                let inbound = c.outbound.is_none();
                if let Some(r) = c.outbound.and_then(|o| o.reply) {
                    let _ = r.send(Err(reason.to_string()));
                }
                self.refused(c.addr, inbound, reason);
            }
        }
    }

    /// This node did not run for `late` (its poll thread came back that
    /// much after it was due): whatever its peers sent meanwhile still
    /// waits unread in the sockets, so their silence is measured in the
    /// time this node ran. Without this, a node waking from a pause longer
    /// than the peer timeout declared every peer dead before reading what
    /// they had sent, and forgot them (one notion of "gone": the peers'
    /// own timers judge the paused node, not the other way round).
    fn credit_own_stall(&mut self, now: Instant, late: Duration) {
        self.shared.log(format!(
            "this node did not run for {late:?}: its peers' silence meanwhile is not held against them"
        ));
        let later = |t: Instant| (t + late).min(now);
        for c in self.conns.values_mut() {
            c.started = later(c.started);
            c.last_rx = later(c.last_rx);
            for d in [c.frame_deadline.as_mut(), c.data_deadline.as_mut()]
                .into_iter()
                .flatten()
            {
                *d += late;
            }
        }
    }

    /// Runs due timers; returns the next deadline.
    fn timers(&mut self, now: Instant) -> Option<Instant> {
        if let Some(due) = self.due_back.take() {
            let late = now.saturating_duration_since(due);
            if late >= OWN_STALL_MIN.max(self.shared.opts.heartbeat_interval) {
                self.credit_own_stall(now, late);
            }
        }
        let mut next: Option<Instant> = self.shutting_down;
        let min = |t: Instant, next: &mut Option<Instant>| {
            *next = Some(next.map_or(t, |n| n.min(t)));
        };
        // Connection retries.
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retries)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.retries = later;
        for (at, _) in &self.retries {
            min(*at, &mut next);
        }
        if !due.is_empty() {
            for (_, ob) in due {
                self.start_connect(ob);
            }
            // New connections have their own deadlines: look again soon.
            min(now, &mut next);
        }
        let opts = &self.shared.opts;
        let mut to_close = Vec::new();
        let mut heartbeats = Vec::new();
        let mut flushes = Vec::new();
        for (&t, c) in self.conns.iter_mut() {
            if c.connecting {
                let d = c.started + opts.handshake_timeout;
                if now >= d {
                    to_close.push((t, CloseReason::HandshakeTimeout));
                } else {
                    min(d, &mut next);
                }
                continue;
            }
            if !c.machine.is_established() {
                let d = c.started + opts.handshake_timeout;
                if now >= d {
                    to_close.push((t, CloseReason::HandshakeTimeout));
                } else {
                    min(d, &mut next);
                }
                continue;
            }
            if c.retired {
                // A duplicate drains as long as it makes progress.
                let busy_until = c.last_tx.max(c.last_rx) + GOODBYE_FLUSH;
                c.closing = c.closing.map(|cl| cl.max(busy_until));
            }
            if let Some(cl) = c.closing {
                if now >= cl {
                    to_close.push((t, CloseReason::Local));
                    continue;
                }
                min(cl, &mut next);
            }
            if c.awaiting_slot {
                // Our own back-pressure (no pool slot, or no room for
                // events): the peer is not at fault.
                c.last_rx = now;
                for d in [c.frame_deadline.as_mut(), c.data_deadline.as_mut()]
                    .into_iter()
                    .flatten()
                {
                    *d = (*d).max(now + opts.frame_timeout);
                }
            }
            let dead_at = c.last_rx + opts.peer_timeout;
            if now >= dead_at {
                to_close.push((
                    t,
                    CloseReason::PeerTimeout {
                        silent_for: now - c.last_rx,
                    },
                ));
                continue;
            }
            min(dead_at, &mut next);
            if let Some(d) = c.data_deadline {
                if c.machine.data_open() {
                    if now >= d {
                        to_close.push((t, CloseReason::FrameTimeout));
                        continue;
                    }
                    min(d, &mut next);
                } else {
                    c.data_deadline = None;
                }
            }
            if let Some(d) = c.frame_deadline {
                if c.machine.in_small_frame() {
                    if now >= d {
                        to_close.push((t, CloseReason::FrameTimeout));
                        continue;
                    }
                    min(d, &mut next);
                } else {
                    c.frame_deadline = None;
                }
            }
            let hb_at = c.last_tx + opts.heartbeat_interval;
            if c.idle() && c.closing.is_none() {
                if now >= hb_at {
                    heartbeats.push(t);
                    min(now + opts.heartbeat_interval, &mut next);
                } else {
                    min(hb_at, &mut next);
                }
            }
            if let Some(w) = c.write_at {
                if now >= w {
                    c.write_at = None;
                    flushes.push(t);
                } else {
                    min(w, &mut next);
                }
            }
        }
        for (t, r) in to_close {
            self.close(t, r);
        }
        for t in heartbeats {
            self.queue_heartbeat(t, now);
            flushes.push(t);
        }
        for t in flushes {
            self.flush(t);
            // A flush paced by the link emulation goes on later.
            if let Some(w) = self.conns.get(&t).and_then(|c| c.write_at) {
                min(w, &mut next);
            }
        }
        next
    }
}

/// `writev` without SIGPIPE: a peer that reset the connection must be a
/// closed connection, not the death of the process that embeds the library
/// (C programs keep SIGPIPE's default action).
fn send_vectored(stream: &mio::net::TcpStream, iov: &[IoSlice<'_>]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero msghdr is valid; it points at `iov` (IoSlice is
    // ABI-compatible with iovec), which outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len() as _;
    // SAFETY: a valid socket descriptor and message.
    let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}
