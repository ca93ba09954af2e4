//! The connection as a sans-I/O byte-stream state machine: handshake, then
//! framing. It never touches a socket. The driver asks where the next bytes go
//! ([`Connection::read_target`]): into a small internal buffer (handshake
//! messages, headers, control payloads), or into a payload buffer the driver
//! leased for a data frame (so payload bytes go from the socket straight to
//! their final place). The driver then reports what it read. Handshake bytes
//! to send come out of [`Connection::take_outgoing`].
//!
//! A data frame's payload comes either right after its header (kind
//! `Data`), or in slices: a `Sliced` header opens the frame, and `Slice`
//! frames carry its payload, at most [`MAX_SLICE_LEN`] bytes each, with
//! heartbeats, control messages and a goodbye allowed between them (never
//! another data frame: one data frame at a time, in order). The driver
//! sees the same thing either way: a `DataHeader`, payload reads into one
//! lease, then `Data`.
//!
//! The same machine is driven by the engine over TCP and by the fuzzer over
//! arbitrary byte streams.

use super::control::{ControlEnvelope, Goodbye, Heartbeat, MAX_CONTROL_PAYLOAD};
use super::handshake::{
    node_id_of, Hello, NodeKey, Noise, Preamble, Role, SwarmKey, CONFIRM_LEN, HELLO_FLAG_ENCRYPT,
    MSG1_LEN, MSG2_LEN, MSG3_LEN, NODE_KEY_LEN, PREAMBLE_LEN,
};
use super::header::{crc32c_append, FrameHeader, FrameKind, HEADER_LEN};
use super::seal::{confirmation, Opener, Sealer, HEAD_LEN, TAG_LEN};
use super::WireError;

/// Largest slice of a sliced data frame's payload.
pub const MAX_SLICE_LEN: usize = 1 << 20;

/// Where the driver must put the next bytes it reads.
pub enum ReadTarget<'a> {
    /// Read at most `buf.len()` bytes into `buf`, then call [`Connection::small_read`].
    Small(&'a mut [u8]),
    /// Read at most `remaining` payload bytes into the leased payload buffer
    /// (after the bytes already there), then call [`Connection::payload_read`].
    Payload { header: FrameHeader, remaining: u64 },
    /// The connection failed; read nothing more.
    Closed,
}

/// What a completed read produced.
#[derive(Debug, PartialEq, Eq)]
pub enum ConnEvent {
    /// The handshake completed; the peer proved the swarm key and its node
    /// key.
    Established {
        peer_id: u64,
    },
    /// A data frame with a non-empty payload starts: lease `payload_len` bytes
    /// and read the payload into them. (Its header is checked with its
    /// payload: nothing but the lease's size may follow from it yet.)
    DataHeader(FrameHeader),
    /// A complete data frame (for a non-empty payload: it is in the lease,
    /// tag and checksum verified, decrypted).
    Data(FrameHeader),
    Heartbeat(Heartbeat),
    Goodbye(Goodbye),
    Control(ControlEnvelope),
}

#[derive(Debug)]
enum State {
    /// The peer's preamble (magic, version, role).
    Preamble,
    /// Acceptor: the connector's ephemeral key.
    Msg1,
    /// Connector: the acceptor's keys and hello.
    Msg2,
    /// Acceptor: the connector's static key and hello (its proof).
    Msg3,
    /// Connector: the acceptor's proof.
    Confirm,
    Header,
    Control(FrameHeader),
    /// Payload bytes of the open data frame: `remaining` of this segment
    /// (the whole payload, or one slice).
    Payload {
        remaining: u64,
    },
    Failed,
}

/// The data frame whose payload is being received.
#[derive(Debug)]
struct OpenData {
    /// As delivered: kind `Data`.
    header: FrameHeader,
    /// Payload bytes still to come (all segments).
    remaining: u64,
    crc: u32,
    /// Sliced: its payload comes in `Slice` frames.
    sliced: bool,
    /// The frame (whole data frame or slice) whose payload is coming: its
    /// header and tag as received, and where its payload starts.
    seg_head: [u8; HEADER_LEN],
    seg_tag: [u8; TAG_LEN],
    seg_start: usize,
}

/// Settings of one connection.
#[derive(Clone, Debug)]
pub struct ConnOptions {
    /// Largest data payload accepted.
    pub max_payload: u64,
    /// Ask for encrypted payloads (on when either side asks).
    pub encrypt: bool,
    /// A fixed ephemeral key, for reproducible tests only.
    pub test_ephemeral: Option<[u8; 32]>,
    /// Accept a peer id that does not follow from the peer's key (test
    /// swarms with fixed ids: any holder of the swarm key may then claim
    /// any id). Off: a claimed id must be [`node_id_of`] the proved key.
    pub chosen_ids: bool,
}

impl ConnOptions {
    pub fn new(max_payload: u64) -> Self {
        Self {
            max_payload,
            encrypt: false,
            test_ephemeral: None,
            chosen_ids: false,
        }
    }
}

/// One end of a connection.
pub struct Connection {
    role: Role,
    my_id: u64,
    encrypt: bool,
    chosen_ids: bool,
    noise: Option<Noise>,
    max_payload: u64,
    state: State,
    buf: Vec<u8>,
    filled: usize,
    need: usize,
    outgoing: Vec<u8>,
    peer_id: Option<u64>,
    peer_key: Option<[u8; NODE_KEY_LEN]>,
    handshake_hash: Option<[u8; 32]>,
    /// The acceptor's expected confirmation (connector, until it arrives).
    confirm: Option<[u8; CONFIRM_LEN]>,
    sealer: Option<Sealer>,
    opener: Option<Opener>,
    data: Option<OpenData>,
}

impl Connection {
    /// A new connection; its first handshake bytes are queued in the
    /// outgoing bytes.
    pub fn new(
        role: Role,
        my_id: u64,
        key: &SwarmKey,
        node_key: &NodeKey,
        opts: &ConnOptions,
    ) -> Self {
        let mut outgoing = Preamble { role }.encode().to_vec();
        let (noise, state) = match Noise::new(role, key, node_key, opts.test_ephemeral.as_ref()) {
            Ok(mut n) => {
                let state = match role {
                    Role::Connector => match n.write(&[], &mut outgoing) {
                        Ok(()) => State::Preamble,
                        Err(_) => State::Failed,
                    },
                    Role::Acceptor => State::Preamble,
                };
                (Some(n), state)
            }
            Err(_) => (None, State::Failed),
        };
        let mut buf = Vec::with_capacity(HEAD_LEN);
        buf.resize(PREAMBLE_LEN, 0);
        Self {
            role,
            my_id,
            encrypt: opts.encrypt,
            chosen_ids: opts.chosen_ids,
            noise,
            max_payload: opts.max_payload,
            state,
            buf,
            filled: 0,
            need: PREAMBLE_LEN,
            outgoing,
            peer_id: None,
            peer_key: None,
            handshake_hash: None,
            confirm: None,
            sealer: None,
            opener: None,
            data: None,
        }
    }

    /// A copy of an established connection between frames (same keys,
    /// same place in both streams); None during the handshake or inside
    /// a frame. For the fuzzer, which runs the handshake once.
    pub(crate) fn copy_established(&self) -> Option<Connection> {
        if !matches!(self.state, State::Header) || self.filled > 0 || self.data.is_some() {
            return None;
        }
        Some(Connection {
            role: self.role,
            my_id: self.my_id,
            encrypt: self.encrypt,
            chosen_ids: self.chosen_ids,
            noise: None,
            max_payload: self.max_payload,
            state: State::Header,
            buf: self.buf.clone(),
            filled: 0,
            need: self.need,
            outgoing: self.outgoing.clone(),
            peer_id: self.peer_id,
            peer_key: self.peer_key,
            handshake_hash: self.handshake_hash,
            confirm: None,
            sealer: self.sealer.clone(),
            opener: self.opener.clone(),
            data: None,
        })
    }

    /// Bytes to send (handshake messages), emptied by the call.
    pub fn take_outgoing(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.outgoing)
    }

    pub fn has_outgoing(&self) -> bool {
        !self.outgoing.is_empty()
    }

    pub fn is_established(&self) -> bool {
        matches!(
            self.state,
            State::Header | State::Control(_) | State::Payload { .. }
        )
    }

    /// The authenticated peer id (after `Established`).
    pub fn peer_id(&self) -> Option<u64> {
        self.peer_id
    }

    /// The peer's node key, proved in the handshake (after `Established`).
    pub fn peer_key(&self) -> Option<[u8; NODE_KEY_LEN]> {
        self.peer_key
    }

    /// Frame payloads are encrypted on this connection.
    pub fn encrypted(&self) -> bool {
        self.sealer.as_ref().is_some_and(Sealer::encrypts)
    }

    /// The handshake hash, the same at both ends (once established): two
    /// connections between the same pair of nodes are told apart by it in
    /// the same way at both ends.
    pub fn handshake_hash(&self) -> Option<[u8; 32]> {
        self.handshake_hash
    }

    /// Seals the next frame to send (header bytes as they go out): its
    /// tag, and with encryption the encrypted payload to send instead.
    /// Frames must go on the wire in the order they are sealed.
    pub fn seal(
        &mut self,
        head: &[u8; HEADER_LEN],
        payload: &[u8],
    ) -> Result<([u8; TAG_LEN], Option<Vec<u8>>), WireError> {
        let established = self.is_established();
        match self.sealer.as_mut() {
            Some(s) if established => Ok(s.seal(head, payload)),
            _ => Err(WireError::Unexpected(
                "a frame to seal before the handshake completed".into(),
            )),
        }
    }

    /// The connector sent its proof of the swarm key and waits for the
    /// acceptor's: a close now is most likely the acceptor refusing it.
    pub fn awaiting_confirmation(&self) -> bool {
        matches!(self.state, State::Confirm)
    }

    /// True while a frame is partly received (a header, control or data
    /// payload, or a sliced data frame between its slices).
    pub fn in_frame(&self) -> bool {
        self.data.is_some() || self.in_small_frame()
    }

    /// True while a header or a control payload is partly received.
    pub fn in_small_frame(&self) -> bool {
        match self.state {
            State::Header => self.filled > 0,
            State::Control(_) => true,
            _ => false,
        }
    }

    /// True from a data frame's header to its last payload byte (sliced
    /// or not).
    pub fn data_open(&self) -> bool {
        self.data.is_some()
    }

    /// Where the next bytes go.
    pub fn read_target(&mut self) -> ReadTarget<'_> {
        match (&self.state, &self.data) {
            (State::Failed, _) => ReadTarget::Closed,
            (State::Payload { remaining }, Some(d)) => ReadTarget::Payload {
                header: d.header,
                remaining: *remaining,
            },
            (State::Payload { .. }, None) => ReadTarget::Closed,
            _ => ReadTarget::Small(&mut self.buf[self.filled..self.need]),
        }
    }

    fn fail(&mut self, e: WireError) -> Result<Option<ConnEvent>, WireError> {
        self.state = State::Failed;
        self.noise = None;
        Err(e)
    }

    fn expect(&mut self, n: usize) {
        // n is a fixed size or a length checked against MAX_CONTROL_PAYLOAD.
        self.buf.resize(n, 0);
        self.filled = 0;
        self.need = n;
    }

    /// Reads message 2 or 3 and checks the peer's hello in it.
    fn read_peer_hello(&mut self, msg: &[u8]) -> Result<Hello, WireError> {
        let noise = self.noise.as_mut().expect("handshake in progress");
        let payload = noise.read(msg)?;
        let hello = Hello::decode(&payload)?;
        if !self.chosen_ids {
            let key = noise
                .remote_static()
                .ok_or_else(|| WireError::Handshake("the peer proved no static key".into()))?;
            let key_id = node_id_of(&key) as u64;
            if hello.node_id != key_id {
                return Err(WireError::IdNotBound {
                    claimed: hello.node_id,
                    key_id,
                });
            }
        }
        if hello.node_id == self.my_id {
            return Err(WireError::Handshake(format!(
                "peer claims our own node id {}",
                self.my_id
            )));
        }
        Ok(hello)
    }

    /// The handshake is done at this end: keys for both directions.
    fn finish_handshake(&mut self, peer: Hello) {
        let noise = self.noise.as_mut().expect("handshake in progress");
        self.peer_key = noise.remote_static();
        let hh = noise.handshake_hash();
        let (c2a, a2c) = noise.split();
        self.noise = None;
        let encrypt = self.encrypt || peer.flags & HELLO_FLAG_ENCRYPT != 0;
        let (send, recv) = match self.role {
            Role::Connector => (c2a, a2c),
            Role::Acceptor => (a2c, c2a),
        };
        self.sealer = Some(Sealer::new(&send, encrypt));
        self.opener = Some(Opener::new(&recv, encrypt));
        self.handshake_hash = Some(hh);
        self.peer_id = Some(peer.node_id);
        match self.role {
            Role::Acceptor => self.outgoing.extend_from_slice(&confirmation(&send, &hh)),
            Role::Connector => self.confirm = Some(confirmation(&recv, &hh)),
        }
    }

    fn my_hello(&self) -> [u8; super::handshake::HELLO_PAYLOAD_LEN] {
        Hello {
            node_id: self.my_id,
            flags: if self.encrypt { HELLO_FLAG_ENCRYPT } else { 0 },
        }
        .encode()
    }

    /// One handshake message is in `buf`.
    fn handshake_step(&mut self, state: State) -> Result<Option<ConnEvent>, WireError> {
        let msg = self.buf[..self.need].to_vec();
        match state {
            State::Preamble => {
                let p = Preamble::decode(&msg)?;
                if p.role != self.role.other() {
                    return Err(WireError::Handshake(format!(
                        "peer claims role {:?}, expected {:?}",
                        p.role,
                        self.role.other()
                    )));
                }
                let (next, len) = match self.role {
                    Role::Acceptor => (State::Msg1, MSG1_LEN),
                    Role::Connector => (State::Msg2, MSG2_LEN),
                };
                self.state = next;
                self.expect(len);
                Ok(None)
            }
            State::Msg1 => {
                let hello = self.my_hello();
                let noise = self.noise.as_mut().expect("handshake in progress");
                let payload = noise.read(&msg)?;
                if !payload.is_empty() {
                    return Err(WireError::TrailingBytes {
                        what: "handshake message 1",
                        extra: payload.len(),
                    });
                }
                noise.write(&hello, &mut self.outgoing)?;
                self.state = State::Msg3;
                self.expect(MSG3_LEN);
                Ok(None)
            }
            State::Msg2 => {
                let peer = self.read_peer_hello(&msg)?;
                let hello = self.my_hello();
                self.noise
                    .as_mut()
                    .expect("handshake in progress")
                    .write(&hello, &mut self.outgoing)?;
                self.finish_handshake(peer);
                self.state = State::Confirm;
                self.expect(CONFIRM_LEN);
                Ok(None)
            }
            State::Msg3 => {
                let peer = self.read_peer_hello(&msg)?;
                self.finish_handshake(peer);
                self.established()
            }
            State::Confirm => {
                let want = self.confirm.take().expect("set with message 3");
                let same =
                    blake3::Hash::from_bytes(pad32(&want)) == blake3::Hash::from_bytes(pad32(&msg));
                if !same {
                    return Err(WireError::AuthFailed);
                }
                self.established()
            }
            _ => unreachable!("only handshake states come here"),
        }
    }

    fn established(&mut self) -> Result<Option<ConnEvent>, WireError> {
        self.state = State::Header;
        self.expect(HEAD_LEN);
        Ok(Some(ConnEvent::Established {
            peer_id: self.peer_id.expect("set with the hello"),
        }))
    }

    /// Checks the tag of a frame without payload bytes of its own.
    fn open_empty(
        &mut self,
        head: &[u8; HEADER_LEN],
        tag: &[u8; TAG_LEN],
    ) -> Result<(), WireError> {
        self.opener
            .as_mut()
            .expect("established")
            .open(head, tag, &mut [])
    }

    /// Reports `n` bytes read into the slice of the last `ReadTarget::Small`.
    pub fn small_read(&mut self, n: usize) -> Result<Option<ConnEvent>, WireError> {
        if matches!(self.state, State::Failed | State::Payload { .. })
            || n > self.need - self.filled
        {
            return self.fail(WireError::Unexpected(format!(
                "driver reported {n} bytes in state {:?}",
                self.state
            )));
        }
        self.filled += n;
        if self.filled < self.need {
            return Ok(None);
        }
        let r = match std::mem::replace(&mut self.state, State::Failed) {
            s @ (State::Preamble | State::Msg1 | State::Msg2 | State::Msg3 | State::Confirm) => {
                self.handshake_step(s)
            }
            State::Header => self.header(),
            State::Control(h) => self.finish_control(h),
            State::Payload { .. } | State::Failed => unreachable!("checked above"),
        };
        match r {
            Err(e) => self.fail(e),
            ok => ok,
        }
    }

    /// A frame's header and tag are in `buf`.
    fn header(&mut self) -> Result<Option<ConnEvent>, WireError> {
        let head: [u8; HEADER_LEN] = self.buf[..HEADER_LEN].try_into().expect("head read");
        let tag: [u8; TAG_LEN] = self.buf[HEADER_LEN..HEAD_LEN]
            .try_into()
            .expect("head read");
        let h = FrameHeader::decode(&head, self.max_payload)?;
        let kind = h.frame_kind().expect("decode checks the kind");
        match kind {
            FrameKind::Data | FrameKind::Sliced if self.data.is_some() => {
                return Err(WireError::Unexpected(
                    "a data frame inside a sliced data frame".into(),
                ))
            }
            FrameKind::Data => return self.data_header(h, head, tag),
            FrameKind::Sliced => return self.sliced_header(h, head, tag),
            FrameKind::Slice => return self.slice_header(h, head, tag),
            FrameKind::Heartbeat | FrameKind::Goodbye | FrameKind::Control => {}
        }
        if h.payload_len > MAX_CONTROL_PAYLOAD as u64 {
            return Err(WireError::PayloadTooLarge {
                len: h.payload_len,
                max: MAX_CONTROL_PAYLOAD as u64,
            });
        }
        // The control payload goes after the head in `buf`.
        self.buf.resize(HEAD_LEN + h.payload_len as usize, 0);
        self.filled = HEAD_LEN;
        self.need = HEAD_LEN + h.payload_len as usize;
        self.state = State::Control(h);
        if h.payload_len == 0 {
            return self.finish_control(h);
        }
        Ok(None)
    }

    /// A whole data frame's header: its payload follows at once.
    fn data_header(
        &mut self,
        h: FrameHeader,
        head: [u8; HEADER_LEN],
        tag: [u8; TAG_LEN],
    ) -> Result<Option<ConnEvent>, WireError> {
        self.expect(HEAD_LEN);
        self.state = State::Header;
        if h.payload_len == 0 {
            self.open_empty(&head, &tag)?;
            if h.payload_crc != 0 && h.payload_crc != crc32c_append(0, &[]) {
                return Err(WireError::PayloadChecksum {
                    expected: h.payload_crc,
                    computed: 0,
                });
            }
            return Ok(Some(ConnEvent::Data(h)));
        }
        self.state = State::Payload {
            remaining: h.payload_len,
        };
        self.data = Some(OpenData {
            header: h,
            remaining: h.payload_len,
            crc: 0,
            sliced: false,
            seg_head: head,
            seg_tag: tag,
            seg_start: 0,
        });
        Ok(Some(ConnEvent::DataHeader(h)))
    }

    /// A sliced data frame opens: its payload comes in `Slice` frames.
    fn sliced_header(
        &mut self,
        mut h: FrameHeader,
        head: [u8; HEADER_LEN],
        tag: [u8; TAG_LEN],
    ) -> Result<Option<ConnEvent>, WireError> {
        self.open_empty(&head, &tag)?;
        if h.payload_len == 0 {
            return Err(WireError::Unexpected(
                "a sliced data frame without payload".into(),
            ));
        }
        // Delivered as the data frame it is (with a header checksum
        // that matches its fields).
        h.kind = FrameKind::Data as u16;
        let enc = h.encode();
        h.header_crc = u32::from_le_bytes([enc[92], enc[93], enc[94], enc[95]]);
        self.expect(HEAD_LEN);
        self.state = State::Header;
        self.data = Some(OpenData {
            header: h,
            remaining: h.payload_len,
            crc: 0,
            sliced: true,
            seg_head: [0; HEADER_LEN],
            seg_tag: [0; TAG_LEN],
            seg_start: 0,
        });
        Ok(Some(ConnEvent::DataHeader(h)))
    }

    /// The next slice of the open sliced frame.
    fn slice_header(
        &mut self,
        h: FrameHeader,
        head: [u8; HEADER_LEN],
        tag: [u8; TAG_LEN],
    ) -> Result<Option<ConnEvent>, WireError> {
        let Some(d) = self.data.as_mut().filter(|d| d.sliced) else {
            return Err(WireError::Unexpected(
                "a slice without an open sliced data frame".into(),
            ));
        };
        let len = h.payload_len;
        if len == 0 || len > d.remaining || len > MAX_SLICE_LEN as u64 {
            return Err(WireError::BadField {
                field: "slice payload_len",
                value: len,
            });
        }
        if h.flags != 0
            || h.payload_crc != 0
            || h.stage != 0
            || h.microbatch != 0
            || h.iteration != 0
        {
            return Err(WireError::ReservedNotZero("slice header fields"));
        }
        d.seg_head = head;
        d.seg_tag = tag;
        d.seg_start = (d.header.payload_len - d.remaining) as usize;
        self.expect(HEAD_LEN);
        self.state = State::Payload { remaining: len };
        Ok(None)
    }

    fn finish_control(&mut self, h: FrameHeader) -> Result<Option<ConnEvent>, WireError> {
        let head: [u8; HEADER_LEN] = self.buf[..HEADER_LEN].try_into().expect("head read");
        let tag: [u8; TAG_LEN] = self.buf[HEADER_LEN..HEAD_LEN]
            .try_into()
            .expect("head read");
        let need = self.need;
        self.opener.as_mut().expect("established").open(
            &head,
            &tag,
            &mut self.buf[HEAD_LEN..need],
        )?;
        let body = &self.buf[HEAD_LEN..need];
        if h.has_payload_crc() {
            let computed = crc32c_append(0, body);
            if computed != h.payload_crc {
                return Err(WireError::PayloadChecksum {
                    expected: h.payload_crc,
                    computed,
                });
            }
        }
        let ev = match h.frame_kind() {
            Some(FrameKind::Heartbeat) => Heartbeat::decode(body).map(ConnEvent::Heartbeat),
            Some(FrameKind::Goodbye) => Goodbye::decode(body).map(ConnEvent::Goodbye),
            Some(FrameKind::Control) => ControlEnvelope::decode(body).map(ConnEvent::Control),
            _ => Err(WireError::UnknownKind(h.kind)),
        }?;
        self.state = State::Header;
        self.expect(HEAD_LEN);
        if self.buf.capacity() > 4 * HEAD_LEN {
            self.buf.shrink_to(HEAD_LEN);
        }
        Ok(Some(ev))
    }

    /// Reports payload bytes just read into the lease: `filled` is every
    /// payload byte of the open data frame received so far (the lease's
    /// filled part), the last `n` of them new. When a frame's payload is
    /// complete its tag is checked (and with encryption the payload
    /// decrypted in place); returns `Data` when the whole payload is in.
    pub fn payload_read(
        &mut self,
        filled: &mut [u8],
        n: usize,
    ) -> Result<Option<ConnEvent>, WireError> {
        let r = self.payload_read_inner(filled, n);
        match r {
            Err(e) => self.fail(e),
            ok => ok,
        }
    }

    fn payload_read_inner(
        &mut self,
        filled: &mut [u8],
        n: usize,
    ) -> Result<Option<ConnEvent>, WireError> {
        let (seg, d) = match (&mut self.state, &mut self.data) {
            (State::Payload { remaining }, Some(d))
                if n as u64 <= *remaining
                    && filled.len() as u64 == d.header.payload_len - d.remaining + n as u64 =>
            {
                (remaining, d)
            }
            _ => {
                return Err(WireError::Unexpected(format!(
                    "driver reported {n} payload bytes ({} in all) in state {:?}",
                    filled.len(),
                    self.state
                )))
            }
        };
        *seg -= n as u64;
        d.remaining -= n as u64;
        if *seg > 0 {
            return Ok(None);
        }
        // This frame's payload is complete: check (and decrypt) it.
        let part = &mut filled[d.seg_start..];
        self.opener
            .as_mut()
            .expect("established")
            .open(&d.seg_head, &d.seg_tag, part)?;
        if d.header.has_payload_crc() {
            d.crc = crc32c_append(d.crc, part);
        }
        if d.remaining > 0 {
            // Between slices: the next header is a slice or a control frame.
            self.state = State::Header;
            self.expect(HEAD_LEN);
            return Ok(None);
        }
        let d = self.data.take().expect("matched above");
        self.state = State::Header;
        self.expect(HEAD_LEN);
        if d.header.has_payload_crc() && d.crc != d.header.payload_crc {
            return Err(WireError::PayloadChecksum {
                expected: d.header.payload_crc,
                computed: d.crc,
            });
        }
        Ok(Some(ConnEvent::Data(d.header)))
    }
}

fn pad32(b: &[u8]) -> [u8; 32] {
    let mut p = [0u8; 32];
    let n = b.len().min(32);
    p[..n].copy_from_slice(&b[..n]);
    p
}

/// Encodes a control frame (heartbeat, goodbye, control) with its payload
/// checksum: header bytes followed by the payload.
pub fn encode_control_frame(kind: FrameKind, sender: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = FrameHeader::new(kind, sender, payload.len() as u64);
    h.flags = super::header::FLAG_PAYLOAD_CRC;
    h.payload_crc = crc32c_append(0, payload);
    let mut v = Vec::with_capacity(HEADER_LEN + payload.len());
    v.extend_from_slice(&h.encode());
    v.extend_from_slice(payload);
    v
}

/// The header that opens `data_head`'s frame as a sliced one (the same
/// fields, kind `Sliced`, its checksum recomputed). `data_head` is an
/// encoded data frame header.
pub fn sliced_head(data_head: &[u8; HEADER_LEN]) -> [u8; HEADER_LEN] {
    let mut h = *data_head;
    h[6..8].copy_from_slice(&(FrameKind::Sliced as u16).to_le_bytes());
    let crc = super::header::crc32c(&h[..HEADER_LEN - 4]);
    h[HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// The header of a slice of `len` payload bytes (1..=[`MAX_SLICE_LEN`]).
pub fn slice_head(sender: u64, len: u64) -> [u8; HEADER_LEN] {
    FrameHeader::new(FrameKind::Slice, sender, len).encode()
}

/// Seals a stream of plain frames (each header followed by its payload,
/// `payload_len` bytes, none for a `Sliced` header) as `conn` would send
/// them: a tag after each header, payloads encrypted when the connection
/// encrypts. A header cut short at the end passes as it is. For tests and
/// the fuzzer (which plays an honest sender with it).
pub fn seal_frames(conn: &mut Connection, mut plain: &[u8]) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(plain.len() + plain.len() / 64);
    while plain.len() >= HEADER_LEN {
        let head: [u8; HEADER_LEN] = plain[..HEADER_LEN].try_into().expect("checked");
        plain = &plain[HEADER_LEN..];
        let kind = u16::from_le_bytes([head[6], head[7]]);
        let len = if kind == FrameKind::Sliced as u16 {
            0
        } else {
            u64::from_le_bytes(head[80..88].try_into().expect("8 bytes"))
        };
        let len = (len.min(plain.len() as u64)) as usize;
        let (tag, enc) = conn.seal(&head, &plain[..len])?;
        out.extend_from_slice(&head);
        out.extend_from_slice(&tag);
        out.extend_from_slice(enc.as_deref().unwrap_or(&plain[..len]));
        plain = &plain[len..];
    }
    out.extend_from_slice(plain);
    Ok(out)
}

/// Drives a connection over an in-memory byte stream (`input`), cutting reads
/// at the sizes in `cuts` (cycled; 0 counts as 1), with payloads copied into a
/// scratch buffer. For tests and the fuzzer; returns the events and the
/// error that ended the stream, if any.
pub fn drive_bytes(
    conn: &mut Connection,
    mut input: &[u8],
    cuts: &[usize],
) -> (Vec<ConnEvent>, Option<WireError>) {
    let mut events = Vec::new();
    let mut cut_i = 0usize;
    let mut payload: Vec<u8> = Vec::new();
    let mut filled = 0usize;
    loop {
        if input.is_empty() {
            return (events, None);
        }
        let cut = if cuts.is_empty() {
            usize::MAX
        } else {
            cuts[cut_i % cuts.len()].max(1)
        };
        cut_i += 1;
        let r = match conn.read_target() {
            ReadTarget::Closed => return (events, None),
            ReadTarget::Small(buf) => {
                let n = buf.len().min(input.len()).min(cut);
                buf[..n].copy_from_slice(&input[..n]);
                input = &input[n..];
                conn.small_read(n)
            }
            ReadTarget::Payload { remaining, .. } => {
                let n = (remaining.min(usize::MAX as u64) as usize)
                    .min(input.len())
                    .min(cut);
                payload.extend_from_slice(&input[..n]);
                input = &input[n..];
                filled += n;
                conn.payload_read(&mut payload[..filled], n)
            }
        };
        match r {
            Ok(Some(ev)) => {
                if let ConnEvent::Data(_) = ev {
                    payload.clear();
                    filled = 0;
                }
                events.push(ev);
            }
            Ok(None) => {}
            Err(e) => return (events, Some(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Dtype, FLAG_PAYLOAD_CRC};
    use super::*;

    fn key(b: u8) -> SwarmKey {
        SwarmKey::new(&[b; 32]).unwrap()
    }

    fn node_key(b: u8) -> NodeKey {
        NodeKey::from_private(&[b; 32]).unwrap()
    }

    /// The id of node key `b` (every machine here claims its key's id).
    fn id(b: u8) -> u64 {
        node_key(b).node_id() as u64
    }

    /// Machine `n`: node key `n`, under its id.
    fn conn(role: Role, n: u8, k: &SwarmKey, encrypt: bool) -> Connection {
        let opts = ConnOptions {
            encrypt,
            ..ConnOptions::new(1 << 20)
        };
        Connection::new(role, id(n), k, &node_key(n), &opts)
    }

    /// Runs the handshake between two machines through memory.
    fn pair(ka: SwarmKey, kb: SwarmKey) -> (Connection, Connection, Option<WireError>) {
        pair_with(ka, kb, false)
    }

    fn pair_with(
        ka: SwarmKey,
        kb: SwarmKey,
        encrypt: bool,
    ) -> (Connection, Connection, Option<WireError>) {
        let a = conn(Role::Connector, 1, &ka, encrypt);
        let b = conn(Role::Acceptor, 2, &kb, false);
        run_handshake(a, b)
    }

    fn run_handshake(
        mut a: Connection,
        mut b: Connection,
    ) -> (Connection, Connection, Option<WireError>) {
        for _ in 0..4 {
            let out_a = a.take_outgoing();
            let out_b = b.take_outgoing();
            if let (_, Some(e)) = drive_bytes(&mut b, &out_a, &[]) {
                return (a, b, Some(e));
            }
            if let (_, Some(e)) = drive_bytes(&mut a, &out_b, &[]) {
                return (a, b, Some(e));
            }
        }
        (a, b, None)
    }

    /// A data frame of 1000 bytes and a heartbeat, plain.
    fn frame_and_heartbeat() -> Vec<u8> {
        let payload: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let mut h = FrameHeader::data();
        h.sender = 1;
        h.payload_len = 1000;
        h.dtype = Dtype::U8 as u16;
        h.ndim = 1;
        h.shape[0] = 1000;
        h.flags = FLAG_PAYLOAD_CRC;
        h.payload_crc = crc32c_append(0, &payload);
        let mut stream = h.encode().to_vec();
        stream.extend_from_slice(&payload);
        stream.extend(heartbeat(1));
        stream
    }

    #[test]
    fn handshake_then_frames() {
        for encrypt in [false, true] {
            let (mut a, mut b, err) = pair_with(key(7), key(7), encrypt);
            assert!(err.is_none(), "{err:?}");
            assert!(a.is_established() && b.is_established());
            assert_eq!(a.peer_id(), Some(id(2)));
            assert_eq!(b.peer_id(), Some(id(1)));
            assert_eq!((a.encrypted(), b.encrypted()), (encrypt, encrypt));
            assert_eq!(a.peer_key(), Some(*node_key(2).public()));
            assert_eq!(b.peer_key(), Some(*node_key(1).public()));
            assert_eq!(a.handshake_hash(), b.handshake_hash());
            let plain = frame_and_heartbeat();
            let stream = seal_frames(&mut a, &plain).unwrap();
            // Encrypted: the payload is not on the wire as it is.
            let on_wire = stream
                .windows(100)
                .any(|w| w == &plain[HEADER_LEN..HEADER_LEN + 100]);
            assert_eq!(on_wire, !encrypt);
            let (ev, e) = drive_bytes(&mut b, &stream, &[7, 1, 300]);
            assert!(e.is_none(), "{e:?}");
            assert_eq!(ev.len(), 3, "{ev:?}");
            assert!(matches!(ev[1], ConnEvent::Data(_)));
            assert!(matches!(ev[2], ConnEvent::Heartbeat(_)));
        }
    }

    #[test]
    fn every_changed_byte_is_refused_with_mac() {
        for encrypt in [false, true] {
            let (mut a, _, _) = fixed_pair_with(encrypt);
            let stream = seal_frames(&mut a, &frame_and_heartbeat()).unwrap();
            // Any byte of the first frame's header, tag or payload.
            for at in (0..HEAD_LEN + 1000).step_by(7) {
                let (_, mut b, _) = fixed_pair_with(encrypt);
                let mut bad = stream.clone();
                bad[at] ^= 0x10;
                let (ev, e) = drive_bytes(&mut b, &bad, &[]);
                assert!(
                    !ev.iter().any(|e| matches!(e, ConnEvent::Data(_))),
                    "byte {at}: {ev:?}"
                );
                // A changed header field may be refused before its tag is
                // checked (bad checksum); everything else by the tag.
                assert!(e.is_some(), "byte {at} accepted");
                if at >= HEADER_LEN {
                    assert!(matches!(e, Some(WireError::Mac { seq: 0 })), "{at}: {e:?}");
                }
            }
        }
    }

    #[test]
    fn replayed_reordered_and_dropped_frames_are_refused() {
        let (mut a, _, _) = fixed_pair();
        let mut hb = |seq| seal_frames(&mut a, &heartbeat(seq)).unwrap();
        let (f0, f1, f2) = (hb(0), hb(1), hb(2));
        let cases: [(&str, Vec<&[u8]>, u64); 3] = [
            ("replayed", vec![&f0, &f0], 1),
            ("reordered", vec![&f1, &f0], 0),
            ("dropped", vec![&f0, &f2], 1),
        ];
        // The receiver's machine has its own keys: run each case on a
        // fresh pair made from the same handshake transcript (fixed keys).
        for (what, frames, seq) in cases {
            let stream: Vec<u8> = frames.concat();
            let (_, mut b, _) = fixed_pair();
            let (_, e) = drive_bytes(&mut b, &stream, &[]);
            assert_eq!(e, Some(WireError::Mac { seq }), "{what}");
        }
        // In order: all three pass.
        let (_, mut b, _) = fixed_pair();
        let (ev, e) = drive_bytes(&mut b, &[f0, f1, f2].concat(), &[]);
        assert!(e.is_none() && ev.len() == 3, "{ev:?} {e:?}");
    }

    /// A pair whose handshake is the same every time (fixed ephemeral
    /// keys), so that frames sealed by one run's connector open at another
    /// run's acceptor: the tests can replay across connections.
    fn fixed_pair() -> (Connection, Connection, Option<WireError>) {
        fixed_pair_with(false)
    }

    fn fixed_pair_with(encrypt: bool) -> (Connection, Connection, Option<WireError>) {
        let k = key(7);
        let mut oa = ConnOptions::new(1 << 20);
        oa.encrypt = encrypt;
        oa.test_ephemeral = Some([0x31; 32]);
        let mut ob = ConnOptions::new(1 << 20);
        ob.test_ephemeral = Some([0x32; 32]);
        let a = Connection::new(Role::Connector, id(1), &k, &node_key(1), &oa);
        let b = Connection::new(Role::Acceptor, id(2), &k, &node_key(2), &ob);
        run_handshake(a, b)
    }

    #[test]
    fn frames_of_another_connection_are_refused() {
        // Same swarm key, same nodes, another handshake: other keys.
        let (mut a, _, _) = pair(key(7), key(7));
        let stream = seal_frames(&mut a, &heartbeat(0)).unwrap();
        let (_, mut b, _) = pair(key(7), key(7));
        let (_, e) = drive_bytes(&mut b, &stream, &[]);
        assert_eq!(e, Some(WireError::Mac { seq: 0 }));
    }

    #[test]
    fn wrong_key_is_refused() {
        let (_, _, err) = pair(key(7), key(8));
        assert_eq!(err, Some(WireError::AuthFailed));
    }

    #[test]
    fn the_acceptor_proves_nothing_before_the_connector_does() {
        // What an acceptor sends to a stranger that knows no key: the same
        // bytes whatever the acceptor's swarm key is (a fixed ephemeral
        // key makes them comparable).
        let stranger_sees = |swarm: u8| {
            let mut o = ConnOptions::new(1 << 20);
            o.test_ephemeral = Some([0x44; 32]);
            let mut b = Connection::new(Role::Acceptor, id(2), &key(swarm), &node_key(2), &o);
            let mut oc = ConnOptions::new(1 << 20);
            oc.test_ephemeral = Some([0x45; 32]);
            let mut c = Connection::new(Role::Connector, id(1), &key(99), &node_key(1), &oc);
            let mut seen = b.take_outgoing();
            let (_, e) = drive_bytes(&mut b, &c.take_outgoing(), &[]);
            assert!(e.is_none());
            seen.extend(b.take_outgoing());
            // The stranger's message 3 fails; the acceptor adds nothing.
            let (_, _) = drive_bytes(&mut c, &seen, &[]);
            let (_, e) = drive_bytes(&mut b, &c.take_outgoing(), &[]);
            assert_eq!(e, Some(WireError::AuthFailed));
            assert!(!b.has_outgoing());
            seen
        };
        let (s1, s2) = (stranger_sees(7), stranger_sees(8));
        assert_eq!(s1.len(), PREAMBLE_LEN + MSG2_LEN);
        assert_eq!(s1, s2, "the acceptor's messages depend on its swarm key");
    }

    /// A holder of the swarm key claiming another node's id (with its own
    /// key) is refused by either end: the acceptor at message 3 (before it
    /// proves anything: no confirmation follows), the connector at message
    /// 2 (before its message 3, so it proves nothing either). A side with
    /// `chosen_ids` takes the claim as it comes.
    #[test]
    fn a_claimed_id_that_is_not_the_key_s_is_refused() {
        let k = key(7);
        let claim = |role: Role, chosen: bool| {
            let o = ConnOptions::new(1 << 20);
            // Key 1 claims key 3's id.
            let liar = Connection::new(role, id(3), &k, &node_key(1), &o);
            let o = ConnOptions {
                chosen_ids: chosen,
                ..ConnOptions::new(1 << 20)
            };
            let honest = Connection::new(role.other(), id(2), &k, &node_key(2), &o);
            match role {
                Role::Connector => run_handshake(liar, honest),
                Role::Acceptor => {
                    let (h, l, e) = run_handshake(honest, liar);
                    (l, h, e)
                }
            }
        };
        for role in [Role::Connector, Role::Acceptor] {
            let (_, mut honest, e) = claim(role, false);
            assert_eq!(
                e,
                Some(WireError::IdNotBound {
                    claimed: id(3),
                    key_id: id(1)
                }),
                "liar as {role:?}"
            );
            assert!(!honest.is_established());
            assert!(honest.take_outgoing().is_empty(), "liar as {role:?}");
            let (_, honest, e) = claim(role, true);
            assert!(e.is_none(), "{e:?}");
            assert_eq!(honest.peer_id(), Some(id(3)));
        }
    }

    /// A node id is a fixed function of the public key (pinned here: a
    /// change would split every swarm whose members disagree on it), and a
    /// key file round-trips, owner-only, never overwritten.
    #[test]
    fn node_ids_follow_from_keys_and_key_files_round_trip() {
        assert_eq!(
            node_key(1).node_id(),
            0xdb90_1378,
            "{:x}",
            node_key(1).node_id()
        );
        assert_ne!(node_key(1).node_id(), node_key(2).node_id());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.key");
        let (a, created) = NodeKey::load_or_create(&path).unwrap();
        assert!(created);
        let (b, created) = NodeKey::load_or_create(&path).unwrap();
        assert!(!created);
        assert_eq!((a.public(), a.node_id()), (b.public(), b.node_id()));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(a.store_new(&path).is_err(), "a key file was overwritten");
        for bad in [&b"short"[..], &[b'g'; 64][..], &[0xff; 64][..]] {
            std::fs::write(&path, bad).unwrap();
            let e = NodeKey::load_or_create(&path).unwrap_err();
            assert!(e.contains("node key"), "{e}");
        }
    }

    #[test]
    fn replayed_handshake_is_refused() {
        // Record what a legitimate connector sent to an acceptor...
        let k = key(7);
        let mut a = conn(Role::Connector, 1, &k, false);
        let mut b = conn(Role::Acceptor, 2, &k, false);
        let mut recorded = a.take_outgoing();
        drive_bytes(&mut b, &recorded.clone(), &[]);
        drive_bytes(&mut a, &b.take_outgoing(), &[]);
        recorded.extend(a.take_outgoing());
        // ...and replay it to an acceptor with a fresh ephemeral key.
        let mut b2 = conn(Role::Acceptor, 2, &k, false);
        let (_, e) = drive_bytes(&mut b2, &recorded, &[]);
        assert_eq!(e, Some(WireError::AuthFailed));
    }

    #[test]
    fn a_version_1_peer_gets_a_clear_refusal() {
        // A version-1 hello: magic, version 1, role, id, nonce.
        let mut v1 = b"GWHS".to_vec();
        v1.extend(1u16.to_le_bytes());
        v1.extend(0u16.to_le_bytes());
        v1.extend([0u8; 40]);
        let mut b = conn(Role::Acceptor, 2, &key(7), false);
        let (_, e) = drive_bytes(&mut b, &v1, &[]);
        let e = e.expect("refused");
        assert_eq!(
            e,
            WireError::UnsupportedVersion {
                what: "hello",
                got: 1
            }
        );
        assert!(e.to_string().contains("speaks version 2"), "{e}");
    }

    #[test]
    fn garbage_before_handshake_and_frames_before_auth() {
        let mut b = conn(Role::Acceptor, 2, &key(7), false);
        let (_, e) = drive_bytes(
            &mut b,
            b"GET / HTTP/1.1\r\n\r\n-----------------------------------",
            &[],
        );
        assert!(matches!(e, Some(WireError::BadMagic { .. })), "{e:?}");
        let mut b = conn(Role::Acceptor, 2, &key(7), false);
        let mut h = FrameHeader::data();
        h.payload_len = 4;
        let (ev, e) = drive_bytes(&mut b, &h.encode(), &[]);
        assert!(ev.is_empty());
        assert!(e.is_some());
    }

    /// A data header for `payload` (with its checksum) from node 1.
    fn data_head(payload: &[u8]) -> [u8; HEADER_LEN] {
        let mut h = FrameHeader::data();
        h.sender = 1;
        h.stage = 3;
        h.microbatch = 77;
        h.payload_len = payload.len() as u64;
        h.flags = FLAG_PAYLOAD_CRC;
        h.payload_crc = crc32c_append(0, payload);
        h.encode()
    }

    fn heartbeat(seq: u64) -> Vec<u8> {
        encode_control_frame(
            FrameKind::Heartbeat,
            1,
            &Heartbeat { seq, sent_at_us: 0 }.encode(),
        )
    }

    /// `payload` as a sliced frame in slices of `slice` bytes, a heartbeat
    /// between every two slices.
    fn sliced_stream(payload: &[u8], slice: usize) -> Vec<u8> {
        let mut v = sliced_head(&data_head(payload)).to_vec();
        for (i, part) in payload.chunks(slice).enumerate() {
            v.extend(heartbeat(i as u64));
            v.extend(slice_head(1, part.len() as u64));
            v.extend_from_slice(part);
        }
        v
    }

    #[test]
    fn sliced_frame_with_control_frames_between_slices() {
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let plain = sliced_stream(&payload, 3000);
        for cuts in [&[][..], &[1], &[7, 1, 300], &[96, 4096]] {
            let (mut a, mut b, _) = pair(key(7), key(7));
            let stream = seal_frames(&mut a, &plain).unwrap();
            let (ev, e) = drive_bytes(&mut b, &stream, cuts);
            assert!(e.is_none(), "{e:?}");
            // DataHeader, 4 heartbeats (one before each slice), Data.
            assert_eq!(ev.len(), 6, "{ev:?}");
            let ConnEvent::DataHeader(h) = &ev[0] else {
                panic!("{ev:?}")
            };
            assert_eq!(h.frame_kind(), Some(FrameKind::Data));
            assert_eq!((h.payload_len, h.stage, h.microbatch), (10_000, 3, 77));
            assert!(ev[1..5]
                .iter()
                .all(|e| matches!(e, ConnEvent::Heartbeat(_))));
            let ConnEvent::Data(d) = &ev[5] else {
                panic!("{ev:?}")
            };
            assert_eq!(d, h);
            // The delivered header is a valid data header.
            assert_eq!(FrameHeader::decode(&d.encode(), 1 << 20).unwrap(), *d);
            assert!(!b.in_frame());
        }
        // The tag covers every slice: a byte changed on the way is refused.
        let (mut a, mut b, _) = pair(key(7), key(7));
        let mut bad = seal_frames(&mut a, &plain).unwrap();
        let n = bad.len();
        bad[n - 1] ^= 1;
        let (_, e) = drive_bytes(&mut b, &bad, &[]);
        assert!(matches!(e, Some(WireError::Mac { .. })), "{e:?}");
        // The payload checksum covers every slice too: a sender's wrong
        // byte (sealed as it is) is refused.
        let mut wrong = plain.clone();
        let n = wrong.len();
        wrong[n - 1] ^= 1;
        let (mut a, mut b, _) = pair(key(7), key(7));
        let stream = seal_frames(&mut a, &wrong).unwrap();
        let (_, e) = drive_bytes(&mut b, &stream, &[]);
        assert!(
            matches!(e, Some(WireError::PayloadChecksum { .. })),
            "{e:?}"
        );
    }

    #[test]
    fn sliced_frame_violations_are_refused() {
        let payload = vec![5u8; 4000];
        let open = sliced_head(&data_head(&payload)).to_vec();
        let refuse = |stream: Vec<u8>, what: &str| {
            let (mut a, mut b, _) = pair(key(7), key(7));
            let stream = seal_frames(&mut a, &stream).unwrap();
            let (ev, e) = drive_bytes(&mut b, &stream, &[]);
            assert!(e.is_some(), "{what}: accepted, {ev:?}");
            assert!(
                !ev.iter().any(|e| matches!(e, ConnEvent::Data(_))),
                "{what}: {ev:?}"
            );
        };
        // A slice with no open sliced frame, and inside a whole data frame's place.
        let mut s = slice_head(1, 10).to_vec();
        s.extend([0u8; 10]);
        refuse(s, "stray slice");
        // A data frame (whole or sliced) while a sliced one is open.
        let mut s = open.clone();
        s.extend(data_head(&[1, 2, 3]));
        s.extend([1, 2, 3]);
        refuse(s, "data inside sliced");
        let mut s = open.clone();
        s.extend(open.clone());
        refuse(s, "sliced inside sliced");
        // Slices of 0 bytes, beyond the payload, beyond the largest slice.
        for len in [0u64, 4001, MAX_SLICE_LEN as u64 + 1] {
            let mut s = open.clone();
            s.extend(slice_head(1, len));
            s.extend(vec![5u8; 4001]);
            refuse(s, &format!("slice of {len}"));
        }
        // A slice header with fields that must be 0.
        let mut h = FrameHeader::new(FrameKind::Slice, 1, 100);
        h.microbatch = 1;
        let mut s = open.clone();
        s.extend(h.encode());
        s.extend([5u8; 100]);
        refuse(s, "slice with a microbatch");
        // A sliced frame without payload.
        refuse(sliced_head(&data_head(&[])).to_vec(), "empty sliced");
        // A slice may not carry a shape.
        let mut h = FrameHeader::new(FrameKind::Slice, 1, 4);
        h.dtype = Dtype::U8 as u16;
        h.ndim = 1;
        h.shape[0] = 4;
        let mut s = open;
        s.extend(h.encode());
        s.extend([5u8; 4]);
        refuse(s, "slice with a shape");
    }

    #[test]
    fn mangled_sliced_streams_never_panic() {
        // A small deterministic fuzz of the sliced path: flip, drop and
        // repeat bytes of a valid stream and drive it with odd cuts.
        let payload: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let stream = sliced_stream(&payload, 700);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..400 {
            // Mangled on the way (after sealing), or by the sender.
            let (mut a, mut b, _) = pair(key(7), key(7));
            let mut s = if round % 2 == 0 {
                seal_frames(&mut a, &stream).unwrap()
            } else {
                stream.clone()
            };
            let at = (next() % s.len() as u64) as usize;
            match next() % 3 {
                0 => s[at] ^= 1 << (next() % 8),
                1 => {
                    s.drain(at..(at + (next() % 200) as usize).min(s.len()));
                }
                _ => {
                    let piece = s[at..(at + 300).min(s.len())].to_vec();
                    s.splice(at..at, piece);
                }
            }
            if round % 2 == 1 {
                s = seal_frames(&mut a, &s).unwrap();
            }
            let cuts = [(next() % 500) as usize + 1, (next() % 7) as usize + 1];
            let (ev, e) = drive_bytes(&mut b, &s, &cuts);
            // Whatever happens, a delivered frame is the right one.
            for ev in &ev {
                if let ConnEvent::Data(h) = ev {
                    assert_eq!(h.payload_len, 5000);
                }
            }
            let _ = e;
        }
    }
}
