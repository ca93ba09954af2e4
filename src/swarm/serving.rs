//! The states a member serves: to joiners, and to members that missed an
//! update. A state is as large as its stage's weights and optimizer state
//! (85 MB for llama-small, 40x that for the paper's models) and takes
//! seconds on a home uplink, so serving is bounded:
//!
//! - one state per requester at a time: a request again while one is being
//!   exported or is still queued to that peer (its retry, because the
//!   transfer takes longer than the retry time) is answered by the state
//!   already on its way, not by another copy;
//! - at most [`MAX_SERVES`] requesters at once: later ones wait their turn,
//!   and their request is put to the protocol again when it comes (the
//!   answer describes the state exported then, not the one of the request);
//! - the digest that ends a state goes into the exported frame's own slot
//!   ([`append_digest`]): serving takes one pool slot, not two.
//!
//! Copies beyond that fill the frame pool, and the thread that waits for a
//! pool slot hears nothing meanwhile and takes itself for paused.
use crate::engine::{Frame, SharedFrame};
use crate::protocol::NodeId;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Bytes of the SHA-256 that ends a state transfer.
pub(super) const DIGEST_LEN: usize = 32;
/// Requesters served at once.
pub(super) const MAX_SERVES: usize = 2;
/// An export not done by then is taken for lost (the trainer dropped it
/// when this node fenced itself): it no longer holds later requests back.
const EXPORT_WAIT_MAX: Duration = Duration::from_secs(60);
/// Requesters waiting for their turn, at most (a flood of requests does not
/// grow memory; the protocol's retries ask again).
const WAITING_MAX: usize = 256;

/// A state served to one requester.
enum Serving {
    /// Given to the trainer to export at this time.
    Exporting(Instant),
    /// Handed to the engine: its share of the frame tells when it is out
    /// (written to the socket, or dropped with the connection).
    Sending(SharedFrame),
}

/// What to do with a state the protocol answers a request with.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Admit {
    /// Export it now.
    Export,
    /// One is on its way to this requester already.
    OnItsWay,
    /// Too many requesters are served: it waits its turn.
    Queued,
}

#[derive(Default)]
pub(super) struct StateServer {
    serving: HashMap<NodeId, Serving>,
    waiting: VecDeque<NodeId>,
}

impl StateServer {
    /// Whether a state for `to` would be exported at once (none on its
    /// way to it, fewer than [`MAX_SERVES`] served): a holder's copy is
    /// served only then, never queued (it is asked for again later).
    pub(super) fn has_room(&mut self, to: NodeId, now: Instant) -> bool {
        self.forget_done(now);
        !self.serving.contains_key(&to) && self.serving.len() < MAX_SERVES
    }

    /// A state for `to` is to be exported.
    pub(super) fn admit(&mut self, to: NodeId, now: Instant) -> Admit {
        self.forget_done(now);
        if self.serving.contains_key(&to) {
            return Admit::OnItsWay;
        }
        if self.serving.len() >= MAX_SERVES {
            if !self.waiting.contains(&to) && self.waiting.len() < WAITING_MAX {
                self.waiting.push_back(to);
            }
            return Admit::Queued;
        }
        self.waiting.retain(|&w| w != to);
        self.serving.insert(to, Serving::Exporting(now));
        Admit::Export
    }

    /// A state for `to` that does not wait its turn (a kept copy restoring
    /// an emptied stage, for which training waits): whether it is to be
    /// sent (false: one is on its way to `to` already).
    pub(super) fn admit_urgent(&mut self, to: NodeId, now: Instant) -> bool {
        self.forget_done(now);
        if self.serving.contains_key(&to) {
            return false;
        }
        self.serving.insert(to, Serving::Exporting(now));
        true
    }

    /// The state for `to` is exported and handed to the engine as `f`.
    pub(super) fn sending(&mut self, to: NodeId, f: SharedFrame) {
        self.serving.insert(to, Serving::Sending(f));
    }

    /// The export for `to` failed, or its state could not be sent: a
    /// request again is served afresh.
    pub(super) fn failed(&mut self, to: NodeId) {
        self.serving.remove(&to);
    }

    /// A requester gone: it no longer waits for its turn.
    pub(super) fn lost(&mut self, to: NodeId) {
        self.waiting.retain(|&w| w != to);
    }

    /// The next requester whose turn has come (its request goes to the
    /// protocol again), if any serving is done.
    pub(super) fn next_turn(&mut self, now: Instant) -> Option<NodeId> {
        if self.waiting.is_empty() {
            return None;
        }
        self.forget_done(now);
        if self.serving.len() >= MAX_SERVES {
            return None;
        }
        self.waiting.pop_front()
    }

    /// How many requesters are served now (exporting or sending).
    #[cfg(test)]
    fn serving_count(&mut self, now: Instant) -> usize {
        self.forget_done(now);
        self.serving.len()
    }

    fn forget_done(&mut self, now: Instant) {
        self.serving.retain(|_, s| match s {
            Serving::Exporting(since) => now < *since + EXPORT_WAIT_MAX,
            Serving::Sending(f) => f.held_elsewhere(),
        });
    }
}

/// Checks the length (`announced`, the message's) and the SHA-256 at the
/// end of a state transfer (as [`append_digest`] put it), and strips it.
pub(super) fn verify_state(mut f: Frame, announced: u64) -> Result<Frame, String> {
    let n = f.len();
    if n as u64 != announced {
        return Err(format!("cut off: {n} of the {announced} bytes announced"));
    }
    if n <= DIGEST_LEN {
        return Err(format!("{n} bytes"));
    }
    let (state, digest) = f.payload().split_at(n - DIGEST_LEN);
    if Sha256::digest(state).as_slice() != digest {
        return Err("its SHA-256 does not match (cut or corrupted)".into());
    }
    f.truncate(n - DIGEST_LEN);
    Ok(f)
}

/// The SHA-256 a state is sent with (the long part of sending one, which
/// a holder's copy has taken off the driver).
pub(super) fn state_digest(state: &Frame) -> [u8; DIGEST_LEN] {
    Sha256::digest(state.payload()).into()
}

/// `state` followed by its SHA-256 `d` ([`state_digest`]), in `state`'s
/// own slot where it has room (pool slots are powers of two, so it nearly
/// always has); otherwise in a frame from `alloc`, copied.
pub(super) fn append_digest<E>(
    mut state: Frame,
    d: [u8; DIGEST_LEN],
    alloc: impl FnOnce(usize) -> Result<Frame, E>,
) -> Result<Frame, E> {
    let n = state.len();
    if state.grow_within_slot(n + DIGEST_LEN) {
        state.payload_mut()[n..].copy_from_slice(&d);
        return Ok(state);
    }
    let mut f = alloc(n + DIGEST_LEN)?;
    let p = f.payload_mut();
    p[..n].copy_from_slice(state.payload());
    p[n..].copy_from_slice(&d);
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{NodeOptions, Transport};

    fn net() -> Transport {
        let opts = NodeOptions {
            max_payload: 1 << 20,
            pool_bytes: 4 << 20,
            swarm_key: b"state-server-unit-test-key".to_vec(),
            ..NodeOptions::default()
        };
        Transport::new(opts).unwrap()
    }

    #[test]
    fn one_state_per_requester_and_two_requesters_at_once() {
        let mut s = StateServer::default();
        let t = Instant::now();
        assert_eq!(s.admit(7, t), Admit::Export);
        assert_eq!(s.admit(7, t), Admit::OnItsWay);
        assert_eq!(s.admit(8, t), Admit::Export);
        assert_eq!(s.admit(9, t), Admit::Queued);
        assert_eq!(s.admit(9, t), Admit::Queued);
        assert_eq!(s.next_turn(t), None);
        // 7's export failed: 9's turn, once.
        s.failed(7);
        assert_eq!(s.next_turn(t), Some(9));
        assert_eq!(s.next_turn(t), None);
        assert_eq!(s.admit(9, t), Admit::Export);
    }

    #[test]
    fn a_state_on_the_wire_holds_its_requesters_turn_until_the_engine_lets_go() {
        let net = net();
        let mut s = StateServer::default();
        let t = Instant::now();
        assert_eq!(s.admit(7, t), Admit::Export);
        let f = SharedFrame::from(net.alloc(100, Duration::ZERO).unwrap());
        let engine_share = f.clone();
        s.sending(7, f);
        assert_eq!(s.admit(7, t), Admit::OnItsWay);
        drop(engine_share);
        assert_eq!(s.serving_count(t), 0);
        assert_eq!(s.admit(7, t), Admit::Export);
    }

    #[test]
    fn an_export_never_finished_stops_counting_after_a_minute() {
        let mut s = StateServer::default();
        let t = Instant::now();
        s.admit(7, t);
        s.admit(8, t);
        assert_eq!(s.admit(9, t), Admit::Queued);
        assert_eq!(s.next_turn(t + Duration::from_secs(59)), None);
        assert_eq!(s.next_turn(t + EXPORT_WAIT_MAX), Some(9));
    }

    #[test]
    fn a_lost_requester_leaves_the_queue() {
        let mut s = StateServer::default();
        let t = Instant::now();
        s.admit(1, t);
        s.admit(2, t);
        s.admit(3, t);
        s.lost(3);
        s.failed(1);
        assert_eq!(s.next_turn(t), None);
    }

    #[test]
    fn the_digest_goes_into_the_states_own_slot() {
        let net = net();
        let mut state = net.alloc(5000, Duration::ZERO).unwrap();
        state.payload_mut().fill(3);
        let d = state_digest(&state);
        let f = append_digest(state, d, |_| -> Result<Frame, ()> { panic!("no copy") }).unwrap();
        assert_eq!(f.len(), 5000 + DIGEST_LEN);
        assert_eq!(&f.payload()[5000..], &Sha256::digest([3u8; 5000])[..]);
    }

    #[test]
    fn a_state_that_fills_its_slot_is_copied_with_its_digest() {
        let net = net();
        let mut state = net.alloc(4096, Duration::ZERO).unwrap();
        state.payload_mut().fill(5);
        let d = state_digest(&state);
        let f = append_digest(state, d, |n| net.alloc(n, Duration::ZERO)).unwrap();
        assert_eq!(f.len(), 4096 + DIGEST_LEN);
        assert_eq!(&f.payload()[..4096], &[5u8; 4096][..]);
        assert_eq!(&f.payload()[4096..], &Sha256::digest([5u8; 4096])[..]);
    }
}
