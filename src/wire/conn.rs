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
    prove, verify, Hello, Role, SwarmKey, Transcript, AUTH_LEN, HELLO_LEN, NONCE_LEN,
};
use super::header::{crc32c_append, FrameHeader, FrameKind, HEADER_LEN};
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
    /// The handshake completed; the peer proved the key.
    Established {
        peer_id: u64,
    },
    /// A data frame with a non-empty payload starts: lease `payload_len` bytes
    /// and read the payload into them.
    DataHeader(FrameHeader),
    /// A complete data frame (for a non-empty payload: it is in the lease,
    /// checksum verified).
    Data(FrameHeader),
    Heartbeat(Heartbeat),
    Goodbye(Goodbye),
    Control(ControlEnvelope),
}

#[derive(Debug)]
enum State {
    Hello,
    Auth,
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
}

/// One end of a connection.
pub struct Connection {
    role: Role,
    my_id: u64,
    key: SwarmKey,
    my_nonce: [u8; NONCE_LEN],
    max_payload: u64,
    state: State,
    buf: Vec<u8>,
    filled: usize,
    need: usize,
    outgoing: Vec<u8>,
    peer: Option<Hello>,
    peer_id: Option<u64>,
    data: Option<OpenData>,
}

impl Connection {
    /// A new connection; its Hello is queued in the outgoing bytes.
    pub fn new(
        role: Role,
        my_id: u64,
        key: SwarmKey,
        nonce: [u8; NONCE_LEN],
        max_payload: u64,
    ) -> Self {
        let hello = Hello {
            role,
            node_id: my_id,
            nonce,
        };
        let mut buf = Vec::with_capacity(HEADER_LEN);
        buf.resize(HELLO_LEN, 0);
        Self {
            role,
            my_id,
            key,
            my_nonce: nonce,
            max_payload,
            state: State::Hello,
            buf,
            filled: 0,
            need: HELLO_LEN,
            outgoing: hello.encode().to_vec(),
            peer: None,
            peer_id: None,
            data: None,
        }
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

    /// The connector's and the acceptor's nonces, the same at both ends
    /// (once the peer's hello is in): two connections between the same
    /// pair of nodes are told apart by them in the same way at both ends.
    pub fn nonces(&self) -> Option<([u8; NONCE_LEN], [u8; NONCE_LEN])> {
        let t = self.transcript(self.peer.as_ref()?);
        Some((t.connector_nonce, t.acceptor_nonce))
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
        Err(e)
    }

    fn expect(&mut self, n: usize) {
        // n is a fixed size or a length checked against MAX_CONTROL_PAYLOAD.
        self.buf.resize(n, 0);
        self.filled = 0;
        self.need = n;
    }

    fn transcript(&self, peer: &Hello) -> Transcript {
        let (c, a) = match self.role {
            Role::Connector => ((self.my_id, self.my_nonce), (peer.node_id, peer.nonce)),
            Role::Acceptor => ((peer.node_id, peer.nonce), (self.my_id, self.my_nonce)),
        };
        Transcript {
            connector_id: c.0,
            connector_nonce: c.1,
            acceptor_id: a.0,
            acceptor_nonce: a.1,
        }
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
        match std::mem::replace(&mut self.state, State::Failed) {
            State::Hello => {
                let hello = match Hello::decode(&self.buf[..HELLO_LEN]) {
                    Ok(h) => h,
                    Err(e) => return self.fail(e),
                };
                let expected = match self.role {
                    Role::Connector => Role::Acceptor,
                    Role::Acceptor => Role::Connector,
                };
                if hello.role != expected {
                    return self.fail(WireError::Handshake(format!(
                        "peer claims role {:?}, expected {:?}",
                        hello.role, expected
                    )));
                }
                if hello.node_id == self.my_id {
                    return self.fail(WireError::Handshake(format!(
                        "peer claims our own node id {}",
                        self.my_id
                    )));
                }
                if hello.nonce == self.my_nonce {
                    return self.fail(WireError::Handshake("peer echoed our nonce".into()));
                }
                let proof = prove(&self.key, self.role, &self.transcript(&hello));
                self.outgoing.extend_from_slice(&proof);
                self.peer = Some(hello);
                self.state = State::Auth;
                self.expect(AUTH_LEN);
                Ok(None)
            }
            State::Auth => {
                let peer = self.peer.expect("hello before auth");
                let prover = match self.role {
                    Role::Connector => Role::Acceptor,
                    Role::Acceptor => Role::Connector,
                };
                if let Err(e) = verify(
                    &self.key,
                    prover,
                    &self.transcript(&peer),
                    &self.buf[..AUTH_LEN],
                ) {
                    return self.fail(e);
                }
                self.peer_id = Some(peer.node_id);
                self.state = State::Header;
                self.expect(HEADER_LEN);
                Ok(Some(ConnEvent::Established {
                    peer_id: peer.node_id,
                }))
            }
            State::Header => {
                let h = match FrameHeader::decode(&self.buf[..HEADER_LEN], self.max_payload) {
                    Ok(h) => h,
                    Err(e) => return self.fail(e),
                };
                let kind = h.frame_kind().expect("decode checks the kind");
                match kind {
                    FrameKind::Data | FrameKind::Sliced if self.data.is_some() => {
                        return self.fail(WireError::Unexpected(
                            "a data frame inside a sliced data frame".into(),
                        ))
                    }
                    FrameKind::Data => return self.data_header(h),
                    FrameKind::Sliced => return self.sliced_header(h),
                    FrameKind::Slice => return self.slice_header(h),
                    FrameKind::Heartbeat | FrameKind::Goodbye | FrameKind::Control => {}
                }
                if h.payload_len > MAX_CONTROL_PAYLOAD as u64 {
                    return self.fail(WireError::PayloadTooLarge {
                        len: h.payload_len,
                        max: MAX_CONTROL_PAYLOAD as u64,
                    });
                }
                self.expect(h.payload_len as usize);
                self.state = State::Control(h);
                if h.payload_len == 0 {
                    return self.finish_control(h);
                }
                Ok(None)
            }
            State::Control(h) => self.finish_control(h),
            State::Payload { .. } | State::Failed => unreachable!("checked above"),
        }
    }

    /// A whole data frame's header: its payload follows at once.
    fn data_header(&mut self, h: FrameHeader) -> Result<Option<ConnEvent>, WireError> {
        self.expect(HEADER_LEN);
        self.state = State::Header;
        if h.payload_len == 0 {
            if h.payload_crc != 0 && h.payload_crc != crc32c_append(0, &[]) {
                return self.fail(WireError::PayloadChecksum {
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
        });
        Ok(Some(ConnEvent::DataHeader(h)))
    }

    /// A sliced data frame opens: its payload comes in `Slice` frames.
    fn sliced_header(&mut self, mut h: FrameHeader) -> Result<Option<ConnEvent>, WireError> {
        if h.payload_len == 0 {
            return self.fail(WireError::Unexpected(
                "a sliced data frame without payload".into(),
            ));
        }
        // Delivered as the data frame it is (with a header checksum
        // that matches its fields).
        h.kind = FrameKind::Data as u16;
        let enc = h.encode();
        h.header_crc = u32::from_le_bytes([enc[92], enc[93], enc[94], enc[95]]);
        self.expect(HEADER_LEN);
        self.state = State::Header;
        self.data = Some(OpenData {
            header: h,
            remaining: h.payload_len,
            crc: 0,
            sliced: true,
        });
        Ok(Some(ConnEvent::DataHeader(h)))
    }

    /// The next slice of the open sliced frame.
    fn slice_header(&mut self, h: FrameHeader) -> Result<Option<ConnEvent>, WireError> {
        let Some(d) = self.data.as_ref().filter(|d| d.sliced) else {
            return self.fail(WireError::Unexpected(
                "a slice without an open sliced data frame".into(),
            ));
        };
        let len = h.payload_len;
        if len == 0 || len > d.remaining || len > MAX_SLICE_LEN as u64 {
            return self.fail(WireError::BadField {
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
            return self.fail(WireError::ReservedNotZero("slice header fields"));
        }
        self.expect(HEADER_LEN);
        self.state = State::Payload { remaining: len };
        Ok(None)
    }

    fn finish_control(&mut self, h: FrameHeader) -> Result<Option<ConnEvent>, WireError> {
        let body = &self.buf[..self.need];
        if h.has_payload_crc() {
            let computed = crc32c_append(0, body);
            if computed != h.payload_crc {
                return self.fail(WireError::PayloadChecksum {
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
        };
        match ev {
            Ok(ev) => {
                self.state = State::Header;
                self.expect(HEADER_LEN);
                if self.buf.capacity() > 4 * HEADER_LEN {
                    self.buf.shrink_to(HEADER_LEN);
                }
                Ok(Some(ev))
            }
            Err(e) => self.fail(e),
        }
    }

    /// Reports payload bytes just read into the lease (`chunk` is exactly
    /// those bytes); returns `Data` when the payload is complete and verified.
    pub fn payload_read(&mut self, chunk: &[u8]) -> Result<Option<ConnEvent>, WireError> {
        let n = chunk.len() as u64;
        let (seg, d) = match (&mut self.state, &mut self.data) {
            (State::Payload { remaining }, Some(d)) if n <= *remaining => (remaining, d),
            _ => {
                return self.fail(WireError::Unexpected(format!(
                    "driver reported {} payload bytes in state {:?}",
                    chunk.len(),
                    self.state
                )))
            }
        };
        if d.header.has_payload_crc() {
            d.crc = crc32c_append(d.crc, chunk);
        }
        *seg -= n;
        d.remaining -= n;
        if *seg > 0 {
            return Ok(None);
        }
        if d.remaining > 0 {
            // Between slices: the next header is a slice or a control frame.
            self.state = State::Header;
            self.expect(HEADER_LEN);
            return Ok(None);
        }
        let d = self.data.take().expect("matched above");
        self.state = State::Header;
        self.expect(HEADER_LEN);
        if d.header.has_payload_crc() && d.crc != d.header.payload_crc {
            return self.fail(WireError::PayloadChecksum {
                expected: d.header.payload_crc,
                computed: d.crc,
            });
        }
        Ok(Some(ConnEvent::Data(d.header)))
    }
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
                let r = conn.payload_read(&payload[filled..filled + n]);
                filled += n;
                r
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

    /// Runs the handshake between two machines through memory.
    fn pair(ka: SwarmKey, kb: SwarmKey) -> (Connection, Connection, Option<WireError>) {
        let mut a = Connection::new(Role::Connector, 1, ka, [1; 32], 1 << 20);
        let mut b = Connection::new(Role::Acceptor, 2, kb, [2; 32], 1 << 20);
        for _ in 0..3 {
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

    #[test]
    fn handshake_then_frames() {
        let (a, mut b, err) = pair(key(7), key(7));
        assert!(err.is_none(), "{err:?}");
        assert!(a.is_established() && b.is_established());
        assert_eq!(a.peer_id(), Some(2));
        assert_eq!(b.peer_id(), Some(1));
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
        stream.extend(encode_control_frame(
            FrameKind::Heartbeat,
            1,
            &Heartbeat {
                seq: 1,
                sent_at_us: 2,
            }
            .encode(),
        ));
        let (ev, e) = drive_bytes(&mut b, &stream, &[7, 1, 300]);
        assert!(e.is_none(), "{e:?}");
        assert_eq!(ev.len(), 3, "{ev:?}");
        assert!(matches!(ev[1], ConnEvent::Data(_)));
        assert!(matches!(ev[2], ConnEvent::Heartbeat(_)));
        // A corrupted payload is caught.
        stream[HEADER_LEN + 5] ^= 1;
        let (_, mut b2, _) = pair(key(7), key(7));
        let (_, e) = drive_bytes(&mut b2, &stream, &[]);
        assert!(
            matches!(e, Some(WireError::PayloadChecksum { .. })),
            "{e:?}"
        );
    }

    #[test]
    fn wrong_key_is_refused() {
        let (_, _, err) = pair(key(7), key(8));
        assert_eq!(err, Some(WireError::AuthFailed));
    }

    #[test]
    fn replayed_handshake_is_refused() {
        // Record what a legitimate connector sent to an acceptor...
        let mut a = Connection::new(Role::Connector, 1, key(7), [1; 32], 1 << 20);
        let mut b = Connection::new(Role::Acceptor, 2, key(7), [2; 32], 1 << 20);
        let mut recorded = a.take_outgoing();
        drive_bytes(&mut a, &b.take_outgoing(), &[]);
        recorded.extend(a.take_outgoing());
        let (ev, e) = drive_bytes(&mut b, &recorded, &[]);
        assert!(e.is_none() && matches!(ev[0], ConnEvent::Established { .. }));
        // ...and replay it to an acceptor with a fresh nonce.
        let mut b2 = Connection::new(Role::Acceptor, 2, key(7), [3; 32], 1 << 20);
        let (_, e) = drive_bytes(&mut b2, &recorded, &[]);
        assert_eq!(e, Some(WireError::AuthFailed));
    }

    #[test]
    fn garbage_before_handshake_and_frames_before_auth() {
        let mut b = Connection::new(Role::Acceptor, 2, key(7), [2; 32], 1 << 20);
        let (_, e) = drive_bytes(
            &mut b,
            b"GET / HTTP/1.1\r\n\r\n-----------------------------------",
            &[],
        );
        assert!(matches!(e, Some(WireError::BadMagic { .. })), "{e:?}");
        let mut b = Connection::new(Role::Acceptor, 2, key(7), [2; 32], 1 << 20);
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
        let stream = sliced_stream(&payload, 3000);
        for cuts in [&[][..], &[1], &[7, 1, 300], &[96, 4096]] {
            let (_, mut b, _) = pair(key(7), key(7));
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
        // The payload checksum covers every slice.
        let mut bad = stream.clone();
        let n = bad.len();
        bad[n - 1] ^= 1;
        let (_, mut b, _) = pair(key(7), key(7));
        let (_, e) = drive_bytes(&mut b, &bad, &[]);
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
            let (_, mut b, _) = pair(key(7), key(7));
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
        for _ in 0..400 {
            let mut s = stream.clone();
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
            let cuts = [(next() % 500) as usize + 1, (next() % 7) as usize + 1];
            let (_, mut b, _) = pair(key(7), key(7));
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
