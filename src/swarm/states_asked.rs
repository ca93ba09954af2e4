//! The states this node asked for and has not received yet, per peer. A
//! state download is retried while it takes long (a slow link), and a
//! server that had sent its answer before the retry came sends one per
//! request: every answer of a request is expected, and one no longer
//! needed is dropped quietly, not refused as a hostile peer's. The time
//! of the first request still awaited is kept: a download's time runs
//! from it to the verified state.
use crate::protocol::NodeId;
use std::collections::HashMap;
use std::time::Instant;

/// Peers asked at most (a node asks its coordinator and a few members).
const PEERS_MAX: usize = 4096;
/// Answers awaited from one peer at most (retries beyond are not counted:
/// their answers are refused like any state not asked for).
const PER_PEER_MAX: u32 = 16;

#[derive(Debug, Default)]
pub(super) struct StatesAsked {
    /// Per peer: answers awaited, and when the first of them was asked.
    awaited: HashMap<NodeId, (u32, Instant)>,
}

impl StatesAsked {
    /// A state request went to `peer`.
    pub(super) fn asked(&mut self, peer: NodeId) {
        if self.awaited.len() >= PEERS_MAX && !self.awaited.contains_key(&peer) {
            return;
        }
        let (n, _) = self.awaited.entry(peer).or_insert((0, Instant::now()));
        *n = (*n + 1).min(PER_PEER_MAX);
    }

    /// Whether a state from `peer` is awaited.
    pub(super) fn awaits(&self, peer: NodeId) -> bool {
        self.awaited.contains_key(&peer)
    }

    /// A state from `peer` came: when it was asked for (the first request
    /// still awaited), or None when it was not awaited.
    pub(super) fn answered(&mut self, peer: NodeId) -> Option<Instant> {
        match self.awaited.get_mut(&peer) {
            Some((n, at)) if *n > 1 => {
                *n -= 1;
                Some(*at)
            }
            Some(&mut (_, at)) => {
                self.awaited.remove(&peer);
                Some(at)
            }
            None => None,
        }
    }

    /// `peer` is gone: none of its answers will come. Whether any was
    /// awaited.
    pub(super) fn gone(&mut self, peer: NodeId) -> bool {
        self.awaited.remove(&peer).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every answer to a request and its retries is expected, then none.
    #[test]
    fn each_request_awaits_one_answer() {
        let mut a = StatesAsked::default();
        let before = Instant::now();
        a.asked(7);
        std::thread::sleep(std::time::Duration::from_millis(2));
        a.asked(7);
        assert!(a.awaits(7) && !a.awaits(8));
        // Both answers are timed from the first request.
        let first = a.answered(7).unwrap();
        assert!(first >= before && first.elapsed() >= std::time::Duration::from_millis(2));
        assert!(a.awaits(7));
        assert_eq!(a.answered(7), Some(first));
        assert!(!a.awaits(7) && a.answered(7).is_none());
        for _ in 0..100 {
            a.asked(9);
        }
        assert_eq!(a.awaited[&9].0, PER_PEER_MAX);
        assert!(a.gone(9) && !a.gone(9) && !a.awaits(9));
    }
}
