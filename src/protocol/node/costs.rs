//! The cost model (docs/SPEC.md section 2) and the CHANGE gossip of the
//! costs to the sinks (section 4).
use super::*;

/// What this node last told upstream (CHANGE).
#[derive(Debug)]
pub(super) struct CostGossip {
    /// Costs last gossiped upstream.
    pub(super) advertised: Arc<[(NodeId, f64)]>,
    /// Round robin position over the upstream peers (bounded fanout).
    pub(super) gossip_round: usize,
    /// Downstream costs changed: gossip at the next tick (triggered update).
    pub(super) gossip_dirty: bool,
}

impl Default for CostGossip {
    fn default() -> CostGossip {
        CostGossip {
            advertised: Arc::new([]),
            gossip_round: Default::default(),
            gossip_dirty: Default::default(),
        }
    }
}

/// The next entry of one candidate's cost list in `my_costs`' merge
/// (ordered for a min-heap on (cost through the candidate, sink, list)).
pub(super) struct MergeHead {
    pub(super) v: f64,
    pub(super) sink: NodeId,
    pub(super) list: u32,
    pub(super) pos: u32,
}

impl PartialEq for MergeHead {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == std::cmp::Ordering::Equal
    }
}

impl Eq for MergeHead {}

impl PartialOrd for MergeHead {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl Ord for MergeHead {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.v.total_cmp(&self.v)
            .then(o.sink.cmp(&self.sink))
            .then(o.list.cmp(&self.list))
    }
}

impl Node {
    /// d_ij of docs/SPEC.md section 2 from this node's measurements.
    pub(super) fn link_cost(&self, j: NodeId) -> f64 {
        if j == self.id {
            return self.compute_s;
        }
        match self.peers.get(&j) {
            None => INF,
            Some(p) => self.link_cost_to(p),
        }
    }

    /// [`Node::link_cost`] to a peer other than this node, from its entry.
    pub(super) fn link_cost_to(&self, p: &Peer) -> f64 {
        let lat = p.lat.unwrap_or(0.05);
        let bw = p.bw.unwrap_or(self.cfg.prior_bandwidth);
        let c = if p.stage == 0 { 0.0 } else { p.compute_s };
        (self.compute_s + c) / 2.0 + lat + self.cfg.activation_bytes as f64 / bw
    }

    /// Whether peer `j` (entry `p`) is a next hop candidate: next stage,
    /// not dead, not banned (what `next_candidates` lists).
    pub(super) fn is_next_candidate(&self, j: NodeId, p: &Peer) -> bool {
        p.stage == self.next_stage() && !p.dead && p.banned_until <= self.now && j != self.id
    }

    /// Cost from this node's output to `sink` through next-stage peer `j`.
    pub(super) fn cost_via(&self, j: NodeId, sink: NodeId) -> f64 {
        if self.stage == self.s() {
            return if j == sink { self.link_cost(sink) } else { INF };
        }
        match self.peers.get(&j).and_then(|p| p.costs.get(sink)) {
            Some(c) => self.link_cost(j) + c,
            None => INF,
        }
    }

    pub(super) fn next_candidates(&self) -> Vec<NodeId> {
        self.peers
            .iter()
            .filter(|(id, p)| self.is_next_candidate(**id, p))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Best cost to `sink` (GWTF routing), with the next hop.
    pub(super) fn best_to_sink(
        &self,
        sink: NodeId,
        need_spare: bool,
        exclude: &[NodeId],
    ) -> Option<(NodeId, f64)> {
        if self.stage == self.s() {
            if self.alive(sink) && self.peers.contains_key(&sink) {
                return Some((sink, self.link_cost(sink)));
            }
            return None;
        }
        let mut best: Option<(NodeId, f64)> = None;
        for (&j, p) in &self.peers {
            if !self.is_next_candidate(j, p) || exclude.contains(&j) {
                continue;
            }
            if need_spare && p.spare == 0 {
                continue;
            }
            // cost_via(j, sink) from the entry at hand.
            let c = match p.costs.get(sink) {
                Some(c) => self.link_cost_to(p) + c,
                None => INF,
            };
            if c >= INF {
                continue;
            }
            if best.is_none_or(|b| c < b.1) {
                best = Some((j, c));
            }
        }
        best
    }

    /// The best cost to each sink through the next stage, the
    /// `gossip_sinks` cheapest, ordered by (cost, sink).
    ///
    /// Each candidate's list is ordered by cost, and adding the link cost
    /// keeps that order, so a k-way merge of the lists meets every sink
    /// first at its smallest cost: it stops after the `gossip_sinks`-th
    /// distinct sink (and its ties) instead of reading every entry.
    pub(super) fn my_costs(&self) -> Vec<(NodeId, f64)> {
        let k = self.cfg.gossip_sinks;
        if k == 0 {
            return Vec::new();
        }
        if self.stage == self.s() {
            let mut v: Vec<(NodeId, f64)> = self
                .peers
                .iter()
                .filter(|(_, p)| p.stage == 0 && !p.dead)
                .map(|(id, _)| (*id, self.link_cost(*id)))
                .filter(|x| x.1 < INF)
                .collect();
            if v.len() > k {
                v.select_nth_unstable_by(k - 1, cost_order);
                v.truncate(k);
            }
            v.sort_unstable_by(cost_order);
            return v;
        }
        let ns = self.next_stage();
        let mut lists: Vec<(f64, &[(NodeId, f64)])> = Vec::new();
        for (&j, p) in &self.peers {
            if p.stage != ns || p.dead || p.banned_until > self.now || j == self.id {
                continue;
            }
            lists.push((self.link_cost_to(p), &p.costs.0));
        }
        // The heads, read in a pass of their own: the lists live in their
        // senders' memory, and independent loads overlap their misses.
        let heads: Vec<MergeHead> = lists
            .iter()
            .enumerate()
            .filter_map(|(i, &(lc, list))| {
                list.first().map(|&(sink, c)| MergeHead {
                    v: lc + c,
                    sink,
                    list: i as u32,
                    pos: 0,
                })
            })
            .collect();
        let mut heap = std::collections::BinaryHeap::from(heads);
        let mut out: Vec<(NodeId, f64)> = Vec::with_capacity(k);
        let mut threshold: Option<f64> = None;
        while let Some(h) = heap.pop() {
            let (lc, list) = lists[h.list as usize];
            if let Some(&(sink, c)) = list.get(h.pos as usize + 1) {
                heap.push(MergeHead {
                    v: lc + c,
                    sink,
                    list: h.list,
                    pos: h.pos + 1,
                });
            }
            if h.v.is_nan() && h.v.is_sign_negative() {
                continue;
            }
            // Infinite (or NaN) costs and everything after them are out;
            // past the k-th sink, only ties of its cost still count.
            if h.v.partial_cmp(&INF) != Some(std::cmp::Ordering::Less)
                || threshold.is_some_and(|t| h.v > t)
            {
                break;
            }
            if !out.iter().any(|x| x.0 == h.sink) {
                out.push((h.sink, h.v));
                if out.len() == k {
                    threshold = Some(h.v);
                }
            }
        }
        out.sort_unstable_by(cost_order);
        out.truncate(k);
        out
    }

    /// The periodic CHANGE (it makes a pending triggered update moot).
    pub(super) fn gossip(&mut self) {
        self.cost_gossip.gossip_dirty = false;
        self.gossip_costs(None)
    }

    /// CHANGE to the upstream peers; `costs` when the caller has just
    /// computed `my_costs()` (the node's state has not changed since).
    pub(super) fn gossip_costs(&mut self, costs: Option<Vec<(NodeId, f64)>>) {
        let costs: Arc<[(NodeId, f64)]> = if self.policy().reserves_flows() && self.stage > 0 {
            costs.unwrap_or_else(|| self.my_costs()).into()
        } else {
            Arc::new([])
        };
        self.cost_gossip.advertised = costs.clone();
        let spare = self.spare();
        let ps = self.prev_stage();
        let ups: Vec<NodeId> = self
            .peers
            .iter()
            .filter(|(_, p)| p.stage == ps && !p.dead)
            .map(|(id, _)| *id)
            .collect();
        // Bounded fanout: at most `gossip_fanout` upstream peers per round,
        // taken in turn (round robin), plus those whose flows pass here.
        let fan = self.cfg.gossip_fanout.max(1);
        let mut targets: BTreeSet<NodeId> = BTreeSet::new();
        if ups.len() <= fan {
            targets.extend(ups.iter().copied());
        } else {
            let start = self.cost_gossip.gossip_round % ups.len();
            for i in 0..fan {
                targets.insert(ups[(start + i) % ups.len()]);
            }
            self.cost_gossip.gossip_round = (start + fan) % ups.len();
        }
        for f in self.reservations.flows.values() {
            if f.prev != self.id {
                targets.insert(f.prev);
            }
        }
        for u in targets {
            self.send(
                u,
                Msg::Change {
                    spare,
                    compute_s: self.compute_s,
                    costs: costs.clone(),
                },
            );
        }
    }

    /// Cost of the hop from `p` into this node, from this node's view.
    pub(super) fn link_cost_from(&self, p: NodeId) -> f64 {
        self.link_cost(p)
    }

    /// CHANGE from a next-stage peer: its capacity, speed and costs to the sinks.
    pub(super) fn on_change(
        &mut self,
        from: NodeId,
        spare: u32,
        compute_s: f64,
        costs: Arc<[(NodeId, f64)]>,
    ) {
        let ns = self.next_stage();
        let p = self.learn(from, ns);
        p.spare = spare;
        p.compute_s = compute_s;
        // Only a material change (another sink set, or a cost moved
        // by more than 2%) triggers our own update upstream.
        if p.costs.material_change(&costs) {
            p.costs = SinkCosts::from_gossip(costs);
            self.cost_gossip.gossip_dirty = true;
        }
    }

    /// A triggered update: the costs downstream changed since the last
    /// gossip; a CHANGE goes upstream only when what this node advertises
    /// really changed.
    pub(super) fn triggered_gossip(&mut self) {
        if !self.cost_gossip.gossip_dirty {
            return;
        }
        self.cost_gossip.gossip_dirty = false;
        let now_costs = self.my_costs();
        let changed = now_costs.len() != self.cost_gossip.advertised.len()
            || now_costs
                .iter()
                .zip(self.cost_gossip.advertised.iter())
                .any(|(a, b)| a.0 != b.0 || (a.1 - b.1).abs() > 0.02 * b.1.max(1e-9));
        if changed {
            self.gossip_costs(Some(now_costs));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::rng::Rng;

    /// `my_costs` as first written: the per-sink minimum over every entry of
    /// every candidate, sorted by (cost, sink), the first `gossip_sinks`.
    fn my_costs_reference(n: &Node) -> Vec<(NodeId, f64)> {
        let mut m: BTreeMap<NodeId, f64> = BTreeMap::new();
        for j in n.next_candidates() {
            let lc = n.link_cost(j);
            for &(sink, c) in n.peers[&j].costs.0.iter() {
                let v = lc + c;
                let e = m.entry(sink).or_insert(INF);
                if v < *e {
                    *e = v;
                }
            }
        }
        let mut v: Vec<(NodeId, f64)> = m.into_iter().filter(|x| x.1 < INF).collect();
        v.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        v.truncate(n.cfg.gossip_sinks);
        v
    }

    #[test]
    fn merged_cost_gossip_equals_the_full_scan() {
        for seed in 0..300 {
            let mut rng = Rng::new(seed);
            let mut cfg = Config::new(Policy::Gwtf, 4, 1 << 20);
            cfg.gossip_sinks = 1 + rng.below(20) as usize;
            let mut n = Node::new(Arc::new(cfg), 1000, 2, 0.5, 4, seed);
            n.now = 1_000;
            let sinks = 1 + rng.below(60) as u32;
            for j in 0..rng.below(40) as NodeId {
                // Costs from a few values (ties between sinks and lists).
                let list: Vec<(NodeId, f64)> = (0..rng.below(20))
                    .map(|_| {
                        (
                            rng.below(sinks as u64) as NodeId,
                            0.25 * rng.below(12) as f64,
                        )
                    })
                    .collect();
                let stage = if rng.below(5) == 0 { 1 } else { 3 };
                let p = n.peers.get_or_insert_with(j * 7, || Peer::new(stage, 0));
                p.costs = SinkCosts::from_gossip(list.into());
                p.dead = rng.below(8) == 0;
                p.banned_until = if rng.below(8) == 0 { 5_000 } else { 0 };
                p.lat = Some([0.0, 0.25, 0.5][rng.below(3) as usize]);
                p.bw = Some(1e9);
                p.compute_s = 0.5;
            }
            // Rejections edit a list in place.
            let ids = n.peers.ids.clone();
            for j in ids {
                if rng.below(3) == 0 {
                    let p = n.peers.get_mut(&j).unwrap();
                    let sink = rng.below(sinks as u64) as NodeId;
                    match rng.below(3) {
                        0 => p.costs.remove(sink),
                        1 => p.costs.insert(sink, INF),
                        _ => p.costs.insert(sink, 0.25 * rng.below(12) as f64),
                    }
                    p.costs.insert(sink, 0.25 * rng.below(12) as f64);
                }
            }
            assert_eq!(n.my_costs(), my_costs_reference(&n), "seed {seed}");
        }
    }
}
