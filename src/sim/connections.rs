//! The simulated nodes' connections (as the runtime's: opened by the first
//! message either way, kept until one end is gone), kept for the
//! `Input::PeerLost` a crash sends to each node that had one with the
//! crashed node.
//!
//! Nearly every message goes between two nodes that are connected already,
//! so a message only appends its receiver to its sender's short buffer of
//! recent sends (a write next to the last one); a full buffer is sorted and
//! merged into the sender's set in one sequential pass, and the pairs new to
//! it are added at both ends. A crash reads the crashed node's set and every
//! buffer not merged yet (crashes are rare). The connections are exactly
//! those of a set updated at every message, at a fraction of the cost of
//! two searches per message in per-node sets (cache misses at 10,000 nodes).
use crate::protocol::NodeId;

/// Sends buffered per node before a merge.
const RECENT: usize = 64;

#[derive(Default)]
pub(super) struct Connections {
    /// Per node: the nodes it has a connection with as of its last merge,
    /// in id order, distinct; `b` is in `a`'s set when `a` is in `b`'s.
    set: Vec<Vec<NodeId>>,
    /// Per node: the nodes it sent to since its last merge (any order,
    /// repeats).
    recent: Vec<Vec<NodeId>>,
}

impl Connections {
    /// Makes room for node `id` (ids are given in order, from 0).
    pub(super) fn add_node(&mut self, id: NodeId) {
        let n = id as usize + 1;
        if self.set.len() < n {
            self.set.resize_with(n, Vec::new);
            self.recent.resize_with(n, Vec::new);
        }
    }

    /// `a` and `b` (both alive, distinct) exchanged a message.
    pub(super) fn note(&mut self, a: NodeId, b: NodeId) {
        let r = &mut self.recent[a as usize];
        r.push(b);
        if r.len() >= RECENT {
            self.merge(a);
        }
    }

    /// Moves `a`'s recent sends into the sets of both ends.
    fn merge(&mut self, a: NodeId) {
        let mut r = std::mem::take(&mut self.recent[a as usize]);
        r.sort_unstable();
        r.dedup();
        let set = &self.set[a as usize];
        // The sends not in `a`'s set yet: one pass over both sorted lists.
        let mut new: Vec<NodeId> = Vec::new();
        let mut i = 0;
        for &x in &r {
            while i < set.len() && set[i] < x {
                i += 1;
            }
            if i == set.len() || set[i] != x {
                new.push(x);
            }
        }
        if !new.is_empty() {
            let set = &mut self.set[a as usize];
            set.extend_from_slice(&new);
            set.sort_unstable();
            for x in new {
                let s = &mut self.set[x as usize];
                if let Err(i) = s.binary_search(&a) {
                    s.insert(i, a);
                }
            }
        }
        r.clear();
        self.recent[a as usize] = r;
    }

    /// `v` is gone: the nodes it had a connection with, in id order, each
    /// once; `v` is no longer in any set or buffer (a node that is gone
    /// has no connection).
    pub(super) fn take(&mut self, v: NodeId) -> Vec<NodeId> {
        self.merge(v);
        let mut out = std::mem::take(&mut self.set[v as usize]);
        for &c in &out {
            let s = &mut self.set[c as usize];
            if let Ok(i) = s.binary_search(&v) {
                s.remove(i);
            }
        }
        for (c, r) in self.recent.iter_mut().enumerate() {
            if r.contains(&v) {
                r.retain(|&x| x != v);
                out.push(c as NodeId);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The nodes `a` has a connection with, in id order (tests).
    #[cfg(test)]
    pub(super) fn of(&mut self, a: NodeId) -> Vec<NodeId> {
        let mut v = self.set[a as usize].clone();
        for (c, r) in self.recent.iter().enumerate() {
            if c == a as usize {
                v.extend_from_slice(r);
            } else if r.contains(&a) {
                v.push(c as NodeId);
            }
        }
        v.sort_unstable();
        v.dedup();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::rng::Rng;
    use std::collections::BTreeSet;

    /// Against a set of pairs updated at every message: random messages
    /// among 40 nodes (enough to fill and merge the buffers many times)
    /// and crashes; each crash gives exactly the nodes that exchanged a
    /// message with the crashed one while both were alive.
    #[test]
    fn connections_are_those_of_a_set_updated_at_every_message() {
        for seed in 0..20 {
            let mut rng = Rng::new(seed);
            let n = 40;
            let mut c = Connections::default();
            for id in 0..n {
                c.add_node(id);
            }
            let mut alive = vec![true; n as usize];
            let mut pairs: BTreeSet<(NodeId, NodeId)> = BTreeSet::new();
            for step in 0..20_000 {
                let a = rng.below(n as u64) as NodeId;
                // Skewed toward a few peers, as real traffic is.
                let b = if rng.below(4) == 0 {
                    rng.below(n as u64) as NodeId
                } else {
                    (a + 1 + rng.below(3) as NodeId) % n
                };
                if a == b || !alive[a as usize] || !alive[b as usize] {
                    continue;
                }
                c.note(a, b);
                pairs.insert((a.min(b), a.max(b)));
                if step % 1000 == 999 {
                    let live: Vec<NodeId> = (0..n).filter(|&x| alive[x as usize]).collect();
                    let v = live[rng.below(live.len() as u64) as usize];
                    let want: Vec<NodeId> = pairs
                        .iter()
                        .filter_map(|&(x, y)| (x == v).then_some(y).or((y == v).then_some(x)))
                        .collect();
                    let other = live[rng.below(live.len() as u64) as usize];
                    if other != v {
                        let want_other: Vec<NodeId> = pairs
                            .iter()
                            .filter_map(|&(x, y)| {
                                (x == other).then_some(y).or((y == other).then_some(x))
                            })
                            .collect();
                        assert_eq!(c.of(other), want_other, "seed {seed} step {step}");
                    }
                    assert_eq!(c.take(v), want, "seed {seed} step {step}");
                    alive[v as usize] = false;
                    pairs.retain(|&(x, y)| x != v && y != v);
                }
            }
        }
    }
}
