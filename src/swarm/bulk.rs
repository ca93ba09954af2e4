//! Bulk messages and their data frames.
//!
//! A bulk protocol message (forward activation, backward gradient, bandwidth
//! probe, state download: `Msg::is_bulk`) travels as its control frame
//! followed by one data frame on the same connection. The engine hands the
//! two over on different channels, so the receiver pairs them again by a key
//! the data frame's header carries: `microbatch` = the microbatch's holder
//! (high 32 bits) and index (low 32 bits), `iteration` = the message kind
//! (high 32 bits) and the microbatch's iteration (low 32 bits); both 0 for
//! messages without a microbatch, which pair in arrival order. Whichever half
//! comes first waits, bounded per peer; a peer that is lost takes its
//! waiting halves with it.
use crate::protocol::{codec, Config, MbId, Msg, NodeId};
use std::collections::{HashMap, VecDeque};

/// Messages kept waiting for their data, per peer, at most.
pub const WAITING_MAX: usize = 1024;
/// Data frames kept waiting for their message, per peer, at most: each
/// holds a pool slot, and a frame waits only until the message sent just
/// before it on the same connection is read (a peer with more waiting
/// sends frames without messages).
pub const DATA_WAITING_MAX: usize = 32;

/// What pairs a control message with its data frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub peer: NodeId,
    pub kind: u16,
    pub mb: Option<MbId>,
}

fn mb_of(msg: &Msg) -> Option<MbId> {
    match msg {
        Msg::Forward { mb, .. } | Msg::Backward { mb, .. } => Some(*mb),
        _ => None,
    }
}

/// The key of a bulk message received from `peer`.
pub fn key_of_msg(peer: NodeId, msg: &Msg) -> Key {
    Key {
        peer,
        kind: codec::msg_type(msg),
        mb: mb_of(msg),
    }
}

/// Bytes of the data frame that follows a bulk message.
pub fn payload_len(msg: &Msg, cfg: &Config) -> u64 {
    match msg {
        Msg::Forward { .. } | Msg::Backward { .. } => cfg.activation_bytes,
        Msg::Probe { bytes, .. } | Msg::StateResponse { bytes, .. } => *bytes,
        _ => 0,
    }
}

/// `(microbatch, iteration)` header fields of the data frame that follows `msg`.
pub fn header_fields(msg: &Msg) -> (u64, u64) {
    let kind = (codec::msg_type(msg) as u64) << 32;
    match mb_of(msg) {
        Some(mb) => (
            ((mb.holder as u64) << 32) | mb.idx as u64,
            kind | mb.iter as u64,
        ),
        None => (0, kind),
    }
}

/// The key of a data frame from `peer` with these header fields.
pub fn key_of_frame(peer: NodeId, microbatch: u64, iteration: u64) -> Key {
    let kind = (iteration >> 32) as u16;
    let with_mb = kind == codec::KIND_FORWARD || kind == codec::KIND_BACKWARD;
    Key {
        peer,
        kind,
        mb: with_mb.then_some(MbId {
            holder: (microbatch >> 32) as NodeId,
            idx: microbatch as u32,
            iter: iteration as u32,
        }),
    }
}

/// Whether a data frame with this header is an all-reduce message
/// (`super::allreduce_net`: `iteration` is a chunk's step below 2^32, or
/// the abort, resume or complete marker near 2^64) rather than the second
/// half of a bulk message (whose `iteration` names its message kind in the
/// high 32 bits, never 0 and at most 2^16 - 1).
/// Whether `h` is a frame of a state download's data (one chunk of it,
/// see `state_stream`).
pub fn is_state_frame(h: &crate::wire::FrameHeader) -> bool {
    let state = codec::msg_type(&Msg::StateResponse {
        version: (0, 0),
        members: Default::default(),
        bytes: 0,
        coord: 0,
    });
    (h.iteration >> 32) == state as u64
}

pub fn is_allreduce_frame(h: &crate::wire::FrameHeader) -> bool {
    let kind = h.iteration >> 32;
    kind == 0 || kind > u16::MAX as u64
}

/// One side's waiting halves, and how many each peer has.
#[derive(Debug)]
struct Waiting<T> {
    by_key: HashMap<Key, VecDeque<T>>,
    per_peer: HashMap<NodeId, usize>,
    /// Kept per peer at most.
    max: usize,
}

impl<T> Waiting<T> {
    fn new(max: usize) -> Self {
        Waiting {
            by_key: HashMap::new(),
            per_peer: HashMap::new(),
            max,
        }
    }
}

impl<T> Waiting<T> {
    fn take(&mut self, key: &Key) -> Option<T> {
        let q = self.by_key.get_mut(key)?;
        let v = q.pop_front();
        if q.is_empty() {
            self.by_key.remove(key);
        }
        if let Some(n) = self.per_peer.get_mut(&key.peer) {
            *n -= 1;
        }
        v
    }

    /// Keeps `v` unless its peer already has `max` waiting.
    fn keep(&mut self, key: Key, v: T) -> bool {
        let n = self.per_peer.entry(key.peer).or_default();
        if *n >= self.max {
            return false;
        }
        *n += 1;
        self.by_key.entry(key).or_default().push_back(v);
        true
    }

    fn forget(&mut self, peer: NodeId) {
        self.by_key.retain(|k, _| k.peer != peer);
        self.per_peer.remove(&peer);
    }

    fn len(&self) -> usize {
        self.per_peer.values().sum()
    }
}

/// The halves waiting for each other.
#[derive(Debug)]
pub struct Pairing<F> {
    msgs: Waiting<Msg>,
    data: Waiting<F>,
    /// Halves dropped because a peer had too many waiting.
    pub dropped: u64,
}

impl<F> Default for Pairing<F> {
    fn default() -> Self {
        Pairing {
            msgs: Waiting::new(WAITING_MAX),
            data: Waiting::new(DATA_WAITING_MAX),
            dropped: 0,
        }
    }
}

impl<F> Pairing<F> {
    /// A bulk message arrived: the pair if its data is already here.
    pub fn on_msg(&mut self, key: Key, msg: Msg) -> Option<(Msg, F)> {
        if let Some(f) = self.data.take(&key) {
            return Some((msg, f));
        }
        if !self.msgs.keep(key, msg) {
            self.dropped += 1;
        }
        None
    }

    /// A data frame arrived: the pair if its message is already here.
    pub fn on_data(&mut self, key: Key, f: F) -> Option<(Msg, F)> {
        if let Some(m) = self.msgs.take(&key) {
            return Some((m, f));
        }
        if !self.data.keep(key, f) {
            self.dropped += 1;
        }
        None
    }

    /// `peer` is gone: what it sent and was not paired is dropped.
    pub fn forget(&mut self, peer: NodeId) {
        self.msgs.forget(peer);
        self.data.forget(peer);
    }

    /// Halves waiting, both sides.
    pub fn waiting(&self) -> usize {
        self.msgs.len() + self.data.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn fwd(holder: NodeId, iter: u32, idx: u32) -> Msg {
        Msg::Forward {
            mb: MbId { holder, iter, idx },
            attempt: 0,
            path: Arc::new(vec![holder]),
            label: None,
            hint: None,
            need_grad: true,
            plan: None,
        }
    }

    fn frame_key(peer: NodeId, msg: &Msg) -> Key {
        let (m, i) = header_fields(msg);
        key_of_frame(peer, m, i)
    }

    #[test]
    fn a_data_frame_carries_its_message_key() {
        let m = fwd(7, 3, 5);
        assert_eq!(frame_key(2, &m), key_of_msg(2, &m));
        let p = Msg::Probe {
            bytes: 10,
            sent_at: 0,
        };
        assert_eq!(frame_key(2, &p), key_of_msg(2, &p));
        assert_ne!(frame_key(2, &m), frame_key(2, &fwd(7, 3, 6)));
    }

    #[test]
    fn halves_pair_in_either_order_and_by_microbatch() {
        let mut p: Pairing<u32> = Pairing::default();
        let (a, b) = (fwd(1, 0, 0), fwd(1, 0, 1));
        // Data of b first, then message a, then data a, then message b.
        assert!(p.on_data(frame_key(9, &b), 20).is_none());
        assert!(p.on_msg(key_of_msg(9, &a), a.clone()).is_none());
        let (m, f) = p.on_data(frame_key(9, &a), 10).unwrap();
        assert_eq!((m, f), (a, 10));
        let (m, f) = p.on_msg(key_of_msg(9, &b), b.clone()).unwrap();
        assert_eq!((m, f), (b, 20));
        assert_eq!(p.waiting(), 0);
    }

    #[test]
    fn a_lost_peer_takes_its_halves_and_waiting_is_bounded() {
        let mut p: Pairing<u32> = Pairing::default();
        for i in 0..WAITING_MAX as u32 + 5 {
            let m = fwd(1, 0, i);
            p.on_msg(key_of_msg(4, &m), m);
        }
        assert_eq!(p.waiting(), WAITING_MAX);
        assert_eq!(p.dropped, 5);
        for i in 0..DATA_WAITING_MAX as u32 + 3 {
            let m = fwd(1, 0, i);
            p.on_data(frame_key(5, &m), 1);
        }
        assert_eq!(p.dropped, 5 + 3);
        p.forget(4);
        assert_eq!(p.waiting(), DATA_WAITING_MAX);
        let m = fwd(1, 0, 0);
        // The same key from another peer does not pair with peer 5's frame.
        assert!(p.on_msg(key_of_msg(6, &m), m.clone()).is_none());
    }
}
