//! The peer view: what this node knows of each other node (liveness,
//! measured latency and bandwidth, gossiped compute time, spare capacity and
//! costs to the sinks).
use super::*;

/// What a node knows about another node.
///
/// Laid out by use (`repr(C)`, one entry per three cache lines): the
/// first line holds what every message and every scan of the view reads
/// (liveness, the CHANGE gossip's fields, the latency), the second the rest
/// of what routing reads, the third SWARM's balancer. A simulation of
/// thousands of nodes is bound by the cache misses on these entries.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub(super) struct Peer {
    pub(super) last_heard: Time,
    /// Not used for routing before this instant (suspected / banned).
    pub(super) banned_until: Time,
    /// The peer's compute time per microbatch (fwd + bwd), as gossiped.
    pub(super) compute_s: f64,
    /// The peer's gossiped cost to each sink.
    pub(super) costs: SinkCosts,
    pub(super) spare: u32,
    pub(super) stage: Stage,
    pub(super) dead: bool,
    /// One-way latency (s), EMA.
    pub(super) lat: Option<f64>,
    // ---- second cache line
    /// Bandwidth (bytes/s), EMA.
    pub(super) bw: Option<f64>,
    /// SWARM-plus: EMA of microbatches per second through this peer.
    pub(super) thr: Option<f64>,
    /// Ack delay (s) of hops to this peer, EMA (adaptive timeouts).
    pub(super) ack: Option<f64>,
    /// When the hops this node sent to the peer are through the link, by
    /// the bandwidth estimate (transfers on a link share it), and when that
    /// busy period of the link began.
    pub(super) link_free: Time,
    pub(super) link_busy_since: Time,
    // ---- third cache line
    /// SWARM: this peer's entries in the cumulative-work heaps, one heap
    /// per data holder (trainer).
    pub(super) balancer: super::balancer::HeapEntries,
    /// SWARM-DecCom: the EMA of this peer's delay (s), from a hop sent to
    /// its acknowledgement.
    pub(super) delay: f64,
    /// SWARM-plus: microbatches sent to this peer and not yet acknowledged.
    pub(super) queued: u32,
}

impl Peer {
    pub(super) fn new(stage: Stage, now: Time) -> Peer {
        Peer {
            stage,
            lat: None,
            bw: None,
            ack: None,
            compute_s: 1.0,
            link_free: 0,
            link_busy_since: 0,
            spare: 1,
            costs: SinkCosts::default(),
            banned_until: 0,
            dead: false,
            last_heard: now,
            queued: 0,
            thr: None,
            balancer: Default::default(),
            delay: super::balancer::DECCOM_INITIAL_DELAY,
        }
    }
}

/// The peers this node knows, by id: vectors kept in id order (the ids,
/// searched, each peer's stage and the entries, side by side), so that a
/// lookup reads a few hundred bytes of ids and one entry, a walk over one
/// stage's peers reads the stages and only their entries (a node's view
/// holds its own stage's members too, whose links it measures), and a walk
/// over the view reads one contiguous array. Iteration is in id order,
/// like a `BTreeMap`.
#[derive(Clone, Debug, Default)]
pub(super) struct PeerMap {
    ids: Vec<NodeId>,
    /// `entries[i].stage`, apart: only [`PeerMap::learn`] sets a stage.
    stages: Vec<Stage>,
    entries: Vec<Peer>,
}

impl PeerMap {
    pub(super) fn get(&self, id: &NodeId) -> Option<&Peer> {
        self.ids.binary_search(id).ok().map(|i| &self.entries[i])
    }
    pub(super) fn get_mut(&mut self, id: &NodeId) -> Option<&mut Peer> {
        self.ids
            .binary_search(id)
            .ok()
            .map(|i| &mut self.entries[i])
    }
    pub(super) fn contains_key(&self, id: &NodeId) -> bool {
        self.ids.binary_search(id).is_ok()
    }
    /// Peer `id`, known to be of `stage` (a new entry if it was unknown).
    pub(super) fn learn(&mut self, id: NodeId, stage: Stage, now: Time) -> &mut Peer {
        let i = match self.ids.binary_search(&id) {
            Ok(i) => i,
            Err(i) => {
                self.ids.insert(i, id);
                self.stages.insert(i, stage);
                self.entries.insert(i, Peer::new(stage, now));
                i
            }
        };
        self.stages[i] = stage;
        let e = &mut self.entries[i];
        e.stage = stage;
        e
    }
    /// The peers of stage `st`, in id order.
    pub(super) fn of_stage(&self, st: Stage) -> impl Iterator<Item = (&NodeId, &Peer)> {
        (self.stages.iter().enumerate())
            .filter(move |&(_, &s)| s == st)
            .map(move |(i, _)| {
                debug_assert_eq!(self.entries[i].stage, st, "a stage set outside learn");
                (&self.ids[i], &self.entries[i])
            })
    }
    pub(super) fn iter(
        &self,
    ) -> std::iter::Zip<std::slice::Iter<'_, NodeId>, std::slice::Iter<'_, Peer>> {
        self.ids.iter().zip(self.entries.iter())
    }
    pub(super) fn values(&self) -> std::slice::Iter<'_, Peer> {
        self.entries.iter()
    }
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&NodeId, &mut Peer) -> bool) {
        let mut w = 0;
        for r in 0..self.ids.len() {
            if keep(&self.ids[r], &mut self.entries[r]) {
                self.ids.swap(w, r);
                self.stages.swap(w, r);
                self.entries.swap(w, r);
                w += 1;
            }
        }
        self.ids.truncate(w);
        self.stages.truncate(w);
        self.entries.truncate(w);
    }
}

impl std::ops::Index<&NodeId> for PeerMap {
    type Output = Peer;
    fn index(&self, id: &NodeId) -> &Peer {
        self.get(id).expect("known peer")
    }
}

impl<'a> IntoIterator for &'a PeerMap {
    type Item = (&'a NodeId, &'a Peer);
    type IntoIter = std::iter::Zip<std::slice::Iter<'a, NodeId>, std::slice::Iter<'a, Peer>>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// A peer's cost to each sink: a short list (at most `gossip_sinks`
/// entries), sinks unique, ordered by (cost, sink) as `my_costs` produces
/// it, so that it is shared with the CHANGE message that carried it (one
/// gossip round costs one allocation however many peers receive it) and
/// `my_costs` merges the lists instead of scanning them all.
/// One allocation (counts and entries together): reading a list's head
/// costs one cache miss, not two.
#[derive(Clone, Debug)]
pub(super) struct SinkCosts(pub(super) Arc<[(NodeId, f64)]>);

impl Default for SinkCosts {
    fn default() -> SinkCosts {
        SinkCosts(Arc::new([]))
    }
}

impl SinkCosts {
    /// The gossiped list as it came; a list out of order or with a sink
    /// twice (not what `my_costs` sends) is put in order, the last entry
    /// of a sink winning.
    pub(super) fn from_gossip(costs: Arc<[(NodeId, f64)]>) -> SinkCosts {
        let ordered = costs
            .windows(2)
            .all(|w| cost_order(&w[0], &w[1]) == std::cmp::Ordering::Less);
        let unique = || {
            if costs.len() <= 32 {
                return costs
                    .iter()
                    .enumerate()
                    .all(|(i, a)| costs[i + 1..].iter().all(|b| b.0 != a.0));
            }
            let mut sinks: Vec<NodeId> = costs.iter().map(|x| x.0).collect();
            sinks.sort_unstable();
            sinks.windows(2).all(|w| w[0] != w[1])
        };
        if ordered && unique() {
            return SinkCosts(costs);
        }
        let last: BTreeMap<NodeId, f64> = costs.iter().copied().collect();
        let mut v: Vec<(NodeId, f64)> = last.into_iter().collect();
        v.sort_by(cost_order);
        SinkCosts(v.into())
    }
    pub(super) fn get(&self, sink: NodeId) -> Option<f64> {
        self.0.iter().find(|x| x.0 == sink).map(|x| x.1)
    }
    /// Whether `new` has other sinks than this list or a cost that moved
    /// by more than 2% (what makes a CHANGE worth passing on).
    pub(super) fn material_change(&self, new: &[(NodeId, f64)]) -> bool {
        let moved = |old: f64, v: f64| (old - v).abs() > 0.02 * old.abs().max(1e-9);
        if new.len() != self.0.len() {
            return true;
        }
        // Usually the same sinks in the same order: compare side by side.
        if new.iter().zip(self.0.iter()).all(|(a, b)| a.0 == b.0) {
            return new.iter().zip(self.0.iter()).any(|(a, b)| moved(b.1, a.1));
        }
        new.iter()
            .any(|&(k, v)| self.get(k).is_none_or(|old| moved(old, v)))
    }
    pub(super) fn insert(&mut self, sink: NodeId, cost: f64) {
        let mut v: Vec<(NodeId, f64)> = self.0.iter().copied().filter(|x| x.0 != sink).collect();
        let at = v.partition_point(|x| cost_order(x, &(sink, cost)) == std::cmp::Ordering::Less);
        v.insert(at, (sink, cost));
        self.0 = v.into();
    }
    pub(super) fn remove(&mut self, sink: NodeId) {
        if let Some(i) = self.0.iter().position(|x| x.0 == sink) {
            let mut v = self.0.to_vec();
            v.remove(i);
            self.0 = v.into();
        }
    }
}

/// The order of a cost list: by cost, then by sink.
pub(super) fn cost_order(a: &(NodeId, f64), b: &(NodeId, f64)) -> std::cmp::Ordering {
    a.1.total_cmp(&b.1).then(a.0.cmp(&b.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gossiped_lists_are_kept_ordered_by_cost() {
        let ordered = |c: &SinkCosts| {
            c.0.windows(2)
                .all(|w| cost_order(&w[0], &w[1]) == std::cmp::Ordering::Less)
        };
        // Out of order, a sink twice (the last one wins, as in a map).
        let mut c = SinkCosts::from_gossip(vec![(3, 2.0), (1, 1.0), (3, 0.5), (2, 1.0)].into());
        assert_eq!(*c.0, [(3, 0.5), (1, 1.0), (2, 1.0)]);
        c.insert(1, 0.1);
        c.insert(9, 0.7);
        c.remove(2);
        assert_eq!(*c.0, [(1, 0.1), (3, 0.5), (9, 0.7)]);
        assert!(ordered(&c));
        assert_eq!(c.get(9), Some(0.7));
        assert_eq!(c.get(2), None);
        // What my_costs sends is shared as it is.
        let list: Arc<[(NodeId, f64)]> = vec![(5, 0.1), (4, 0.2), (6, 0.2)].into();
        let c = SinkCosts::from_gossip(list.clone());
        assert!(Arc::ptr_eq(&c.0, &list));
        assert!(!c.material_change(&[(5, 0.1), (4, 0.2), (6, 0.201)]));
        assert!(c.material_change(&[(5, 0.1), (4, 0.2), (6, 0.3)]));
        assert!(c.material_change(&[(5, 0.1), (4, 0.2)]));
        assert!(c.material_change(&[(5, 0.1), (4, 0.2), (7, 0.2)]));
        assert!(!c.material_change(&[(4, 0.2), (5, 0.1), (6, 0.2)]));
    }

    #[test]
    fn the_peer_view_is_kept_in_id_order() {
        let mut m = PeerMap::default();
        for id in [9, 2, 5, 7] {
            m.learn(id, id as Stage % 3, 0);
        }
        m.get_mut(&5).unwrap().spare = 4;
        assert_eq!(m.iter().map(|x| *x.0).collect::<Vec<_>>(), [2, 5, 7, 9]);
        let of_stage = |m: &PeerMap, st| m.of_stage(st).map(|x| *x.0).collect::<Vec<_>>();
        assert_eq!((of_stage(&m, 2), of_stage(&m, 1)), (vec![2, 5], vec![7]));
        m.learn(5, 1, 0);
        assert_eq!(m[&5].spare, 4, "learning a stage keeps the entry");
        assert_eq!((of_stage(&m, 2), of_stage(&m, 1)), (vec![2], vec![5, 7]));
        m.retain(|id, _| *id != 7);
        assert_eq!(m.iter().map(|x| *x.0).collect::<Vec<_>>(), [2, 5, 9]);
        assert_eq!((of_stage(&m, 0), of_stage(&m, 1)), (vec![9], vec![5]));
        assert_eq!(m[&5].spare, 4);
        assert!(!m.contains_key(&7) && m.get(&9).is_some());
    }
}
