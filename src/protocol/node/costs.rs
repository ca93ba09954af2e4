//! The cost model (docs/SPEC.md section 2) and the CHANGE gossip of the
//! costs to the sinks (section 4).
use super::*;

/// What this node last told upstream (CHANGE).
#[derive(Debug)]
pub(super) struct CostGossip {
    /// Costs last gossiped upstream.
    advertised: Arc<[(NodeId, f64)]>,
    /// Round robin position over the upstream peers (bounded fanout).
    gossip_round: usize,
    /// Downstream costs changed: gossip at the next tick (triggered update).
    gossip_dirty: bool,
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

/// The next hops of this node's flows and pending reservations, sorted
/// (one entry per flow): the load of each of its links downstream. Up to
/// `LinkFlows::INLINE` of them (a relay's memory holds a few microbatches)
/// are kept without an allocation: the costs are computed at every gossip.
pub(super) struct LinkFlows {
    inline: [NodeId; LinkFlows::INLINE],
    len: usize,
    more: Vec<NodeId>,
}

impl LinkFlows {
    const INLINE: usize = 32;

    fn new(next_hops: impl Iterator<Item = NodeId>) -> LinkFlows {
        let mut l = LinkFlows {
            inline: [0; LinkFlows::INLINE],
            len: 0,
            more: Vec::new(),
        };
        for j in next_hops {
            if l.len < LinkFlows::INLINE {
                l.inline[l.len] = j;
                l.len += 1;
            } else {
                if l.more.is_empty() {
                    l.more.extend_from_slice(&l.inline);
                }
                l.more.push(j);
            }
        }
        if l.more.is_empty() {
            l.inline[..l.len].sort_unstable();
        } else {
            l.more.sort_unstable();
        }
        l
    }

    fn sorted(&self) -> &[NodeId] {
        if self.more.is_empty() {
            &self.inline[..self.len]
        } else {
            &self.more
        }
    }

    /// Flows on the link to `j`.
    pub(super) fn on(&self, j: NodeId) -> u32 {
        let v = self.sorted();
        let lo = v.partition_point(|&x| x < j);
        let hi = v.partition_point(|&x| x <= j);
        (hi - lo) as u32
    }
}

/// A next-stage peer's gossiped costs as [`Node::my_costs`] merges them:
/// each entry `c` costs `hop + max(c - own_share, 0)` from this node
/// ([`Node::cost_through`]), which grows with `c`, so the list stays in
/// order.
struct PeerCosts<'a> {
    /// The loaded hop to the peer, and this node's own GPU queue.
    hop: f64,
    /// The part of the peer's queue that is this node's own flows.
    own_share: f64,
    list: &'a [(NodeId, f64)],
}

impl PeerCosts<'_> {
    fn through(&self, c: f64) -> f64 {
        self.hop + (c - self.own_share).max(0.0)
    }
}

/// The next entry of one candidate's cost list in `my_costs`' merge
/// (ordered for a min-heap on (cost through the candidate, sink, list)).
pub(super) struct MergeHead {
    v: f64,
    sink: NodeId,
    list: u32,
    pos: u32,
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

/// A microbatch's wait for a relay's GPU, in its compute times (forward
/// and backward), that the relay's cost leaves out: the burst at the start
/// of a wave (every holder launches at once) queues a few microbatches at
/// every relay alike, and counting it moved flows to longer paths for
/// nothing (1-3 % slower at 1 compute time on `geo10-sparse` and
/// `homogeneous`, the same at 2 as without the measured wait).
const QUEUE_PASSING: f64 = 2.0;

impl Node {
    /// d_ij of docs/SPEC.md section 2 to peer `p`, from this node's
    /// measurements (the link unloaded).
    pub(super) fn link_cost_to(&self, p: &Peer) -> f64 {
        let lat = p.lat.unwrap_or(0.05);
        let c = if p.stage == 0 { 0.0 } else { p.compute_s };
        (self.compute_s + c) / 2.0 + lat + self.transfer_to(p)
    }

    /// Seconds to move one activation to peer `p` (the transfer term of
    /// d_ij), from this node's bandwidth estimate.
    pub(super) fn transfer_to(&self, p: &Peer) -> f64 {
        let bw = p.bw.unwrap_or(self.cfg.prior_bandwidth);
        self.cfg.activation_bytes as f64 / bw
    }

    /// This node's flows on its link with `j` (docs/SPEC.md section 2, the
    /// load of a link): reserved flows whose previous or next hop is `j`,
    /// and reservations asked of `j` that wait for its answer (a reroute's
    /// new segment included: it holds a unit there until answered).
    pub(super) fn link_flows(&self, j: NodeId) -> u32 {
        let r = &self.reservations;
        let flows = r
            .flows()
            .values()
            .filter(|f| f.next() == j || (f.prev() == j && f.prev() != self.id))
            .count();
        let pending = r.pending_next_hops().filter(|&n| n == j).count();
        (flows + pending) as u32
    }

    /// [`Node::link_flows`] of every peer at once (one pass over the
    /// reservations, for a flow table's segments).
    pub(super) fn all_link_flows(&self) -> BTreeMap<NodeId, u32> {
        let r = &self.reservations;
        let mut n: BTreeMap<NodeId, u32> = BTreeMap::new();
        for f in r.flows().values() {
            *n.entry(f.next()).or_default() += 1;
            if f.prev() != self.id && f.prev() != f.next() {
                *n.entry(f.prev()).or_default() += 1;
            }
        }
        for next in r.pending_next_hops() {
            *n.entry(next).or_default() += 1;
        }
        n
    }

    /// [`Node::loaded_link_cost`] to `j` whose link carries `n` flows (from
    /// [`Node::all_link_flows`]).
    pub(super) fn loaded_link_cost_with(&self, j: NodeId, n: u32, existing: bool) -> f64 {
        match self.peers.get(&j) {
            None => INF,
            Some(p) => self.loaded_link_cost_to(p, if existing { n.saturating_sub(1) } else { n }),
        }
    }

    /// [`Node::link_flows`] of every next-stage peer at once, by id (one
    /// pass over the reservations where all candidates are compared).
    fn next_link_flows(&self) -> LinkFlows {
        let r = &self.reservations;
        LinkFlows::new(
            r.flows()
                .values()
                .map(|f| f.next())
                .chain(r.pending_next_hops()),
        )
    }

    /// The cost of the hop to peer `p` for a flow that shares the link with
    /// `others` flows of this node: d_ij, its transfer term counted once more
    /// for each of them (their microbatches move on the same link at the
    /// same time and share it), times `link_load_weight`.
    pub(super) fn loaded_link_cost_to(&self, p: &Peer, others: u32) -> f64 {
        self.link_cost_to(p) + self.cfg.link_load_weight * others as f64 * self.transfer_to(p)
    }

    /// [`Node::loaded_link_cost_to`] to `j` for one more flow (`existing`:
    /// for one of the flows already on the link).
    pub(super) fn loaded_link_cost(&self, j: NodeId, existing: bool) -> f64 {
        match self.peers.get(&j) {
            None => INF,
            Some(p) => {
                let n = self.link_flows(j);
                self.loaded_link_cost_to(p, if existing { n.saturating_sub(1) } else { n })
            }
        }
    }

    /// The wait of one more flow's microbatch behind the flows this relay
    /// already carries on its GPU (docs/SPEC.md section 2, the load of a
    /// node): `gpu_load_weight` x its compute time x those flows (reserved
    /// or being reserved), plus the wait a microbatch's forward and
    /// backward met here lately beyond [`QUEUE_PASSING`] compute times.
    /// The model alone is right while the GPUs mostly idle; with busy GPUs
    /// it let a relay gather flows whose microbatches then queued 10-25 s
    /// (docs/EVALUATION.md, the paper regime). Included in the costs this
    /// node offers upstream; a holder offers none.
    pub(super) fn gpu_queue_s(&self, existing: bool) -> f64 {
        if self.stage == 0 {
            return 0.0;
        }
        let n = self.reservations.in_use();
        let n = if existing { n.saturating_sub(1) } else { n };
        // A microbatch's forward and backward each wait the queue measured.
        let measured = 2.0 * self.lifecycle.gpu_wait_s().unwrap_or(0.0);
        let model = self.cfg.gpu_load_weight * self.compute_s * n as f64;
        model + (measured - QUEUE_PASSING * self.compute_s).max(0.0)
    }

    /// The part of next-stage peer `p`'s gossiped costs that is its GPU
    /// queue behind this node's own `on_link` flows through it: their
    /// microbatches reach `p` one after another on this node's link (the
    /// link's load counts their wait), so a flow of this node does not wait
    /// behind them on `p`'s GPU too; only flows from other upstream nodes,
    /// which arrive at the same time over links of their own, do.
    fn own_share_of_queue(&self, p: &Peer, on_link: u32) -> f64 {
        if p.stage == 0 {
            0.0
        } else {
            self.cfg.gpu_load_weight * p.compute_s * on_link as f64
        }
    }

    /// Cost from this node's output to a sink through next-stage peer `p`,
    /// whose gossiped cost to it is `c`, for a flow that shares this node's
    /// link to `p` with `on_link` other flows: the loaded hop and `c` less
    /// the queue behind this node's own flows there.
    fn cost_through(&self, p: &Peer, on_link: u32, c: f64) -> f64 {
        self.loaded_link_cost_to(p, on_link) + (c - self.own_share_of_queue(p, on_link)).max(0.0)
    }

    /// Whether peer `j` (entry `p`) is a next hop candidate: next stage,
    /// not dead, not banned (what `next_candidates` lists).
    pub(super) fn is_next_candidate(&self, j: NodeId, p: &Peer) -> bool {
        p.stage == self.next_stage() && !p.dead && p.banned_until <= self.now && j != self.id
    }

    /// Cost from this node's output to `sink` of a flow it already has
    /// through next-stage peer `j`: the hop loaded with the other flows on
    /// the link, and `j`'s gossiped cost less the wait behind itself.
    pub(super) fn cost_via(&self, j: NodeId, sink: NodeId) -> f64 {
        if self.stage == self.s() {
            return if j == sink {
                self.loaded_link_cost(sink, true)
            } else {
                INF
            };
        }
        match self.peers.get(&j) {
            Some(p) => match p.costs.get(sink) {
                Some(c) => {
                    // Its microbatches go behind the others on the link
                    // and behind none of this node's flows on `j`'s GPU
                    // (itself included).
                    let on_link = self.link_flows(j);
                    self.loaded_link_cost_to(p, on_link.saturating_sub(1))
                        + (c - self.own_share_of_queue(p, on_link)).max(0.0)
                }
                None => INF,
            },
            None => INF,
        }
    }

    /// Cost from this node's output to `sink` of one more flow through
    /// next-stage peer `j` (the hop loaded with the flows on the link).
    pub(super) fn cost_via_new(&self, j: NodeId, sink: NodeId) -> f64 {
        if self.stage == self.s() {
            return if j == sink {
                self.loaded_link_cost(sink, false)
            } else {
                INF
            };
        }
        match self.peers.get(&j) {
            Some(p) => match p.costs.get(sink) {
                Some(c) => self.cost_through(p, self.link_flows(j), c),
                None => INF,
            },
            None => INF,
        }
    }

    /// What next-stage peer `j` asked for on a reservation toward `sink`
    /// that costs `c` through it from here: its gossiped cost (the rest).
    pub(super) fn expected_of(&self, j: NodeId, sink: NodeId, c: f64) -> f64 {
        match self.peers.get(&j).and_then(|p| p.costs.get(sink)) {
            Some(x) => x,
            None => c - self.loaded_link_cost(j, false),
        }
    }

    /// The cost this node offers upstream for one more flow to `sink`: the
    /// best through a next hop ([`Node::best_to_sink`]) plus its own GPU
    /// queue (what its CHANGE gossip says).
    pub(super) fn offer(&self, sink: NodeId, need_spare: bool) -> Option<(NodeId, f64)> {
        self.best_to_sink(sink, need_spare, &[])
            .map(|(j, c)| (j, c + self.gpu_queue_s(false)))
    }

    pub(super) fn next_candidates(&self) -> Vec<NodeId> {
        self.peers
            .of_stage(self.next_stage())
            .filter(|(id, p)| self.is_next_candidate(**id, p))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Best cost to `sink` (GWTF routing) of one more flow from this node's
    /// output, with the next hop: each hop loaded with the flows already on
    /// its link ([`Node::loaded_link_cost_to`]).
    pub(super) fn best_to_sink(
        &self,
        sink: NodeId,
        need_spare: bool,
        exclude: &[NodeId],
    ) -> Option<(NodeId, f64)> {
        let mut best: Option<(NodeId, f64)> = None;
        self.hops_to_sink(sink, need_spare, exclude, |j, c| {
            if best.is_none_or(|b| c < b.1) {
                best = Some((j, c));
            }
        });
        best
    }

    /// The next hop of a new flow to `sink`: drawn at random among those
    /// within `route_tie_tolerance` of the cheapest. Nodes that see the same
    /// costs at the same moment (every holder when the swarm starts, relays
    /// of one region) would otherwise all reserve through the one cheapest
    /// relay, and their microbatches, which start together, would queue
    /// there while its equals idle.
    pub(super) fn pick_next_hop(
        &mut self,
        sink: NodeId,
        exclude: &[NodeId],
    ) -> Option<(NodeId, f64)> {
        let mut hops = Vec::new();
        self.hops_to_sink(sink, true, exclude, |j, c| hops.push((j, c)));
        let best = hops.iter().map(|h| h.1).fold(INF, f64::min);
        // A tolerance that makes no sense (negative, not a number) is 0:
        // the cheapest is always among the drawn.
        let tolerance = self.cfg.route_tie_tolerance;
        let tolerance = if tolerance > 0.0 {
            tolerance.min(1e6)
        } else {
            0.0
        };
        let near: Vec<(NodeId, f64)> = hops
            .into_iter()
            .filter(|h| h.1 <= best * (1.0 + tolerance))
            .collect();
        if near.is_empty() {
            return None;
        }
        Some(near[self.rng.below(near.len() as u64) as usize])
    }

    /// Every next hop toward `sink` with its cost from this node's output
    /// for one more flow, given to `hop` (finite costs only; `need_spare`:
    /// only peers with room for it; never those in `exclude`), in the peer
    /// view's order. A callback, not a list: [`Node::best_to_sink`] runs
    /// for every offer and reroute, and allocates nothing.
    fn hops_to_sink(
        &self,
        sink: NodeId,
        need_spare: bool,
        exclude: &[NodeId],
        mut hop: impl FnMut(NodeId, f64),
    ) {
        if self.stage == self.s() {
            if self.alive(sink) && self.peers.contains_key(&sink) {
                hop(sink, self.loaded_link_cost(sink, false));
            }
            return;
        }
        let load = self.next_link_flows();
        for (&j, p) in self.peers.of_stage(self.next_stage()) {
            if !self.is_next_candidate(j, p) || exclude.contains(&j) {
                continue;
            }
            if need_spare && p.spare == 0 {
                continue;
            }
            if let Some(c) = p.costs.get(sink) {
                let c = self.cost_through(p, load.on(j), c);
                if c < INF {
                    hop(j, c);
                }
            }
        }
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
        let queue = self.gpu_queue_s(false);
        let load = self.next_link_flows();
        if self.stage == self.s() {
            let mut v: Vec<(NodeId, f64)> = self
                .peers
                .of_stage(0)
                .filter(|(_, p)| !p.dead)
                .map(|(id, p)| (*id, self.loaded_link_cost_to(p, load.on(*id)) + queue))
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
        let mut lists: Vec<PeerCosts> = Vec::new();
        for (&j, p) in self.peers.of_stage(ns) {
            if p.dead || p.banned_until > self.now || j == self.id {
                continue;
            }
            let on = load.on(j);
            lists.push(PeerCosts {
                hop: self.loaded_link_cost_to(p, on) + queue,
                own_share: self.own_share_of_queue(p, on),
                list: &p.costs.0,
            });
        }
        // The heads, read in a pass of their own: the lists live in their
        // senders' memory, and independent loads overlap their misses.
        let heads: Vec<MergeHead> = lists
            .iter()
            .enumerate()
            .filter_map(|(i, l)| {
                l.list.first().map(|&(sink, c)| MergeHead {
                    v: l.through(c),
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
            let l = &lists[h.list as usize];
            if let Some(&(sink, c)) = l.list.get(h.pos as usize + 1) {
                heap.push(MergeHead {
                    v: l.through(c),
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
        let mut targets: Vec<NodeId> = Vec::with_capacity(fan + self.reservations.flows().len());
        if ups.len() <= fan {
            targets.extend(ups.iter().copied());
        } else {
            let start = self.cost_gossip.gossip_round % ups.len();
            for i in 0..fan {
                targets.push(ups[(start + i) % ups.len()]);
            }
            self.cost_gossip.gossip_round = (start + fan) % ups.len();
        }
        for f in self.reservations.flows().values() {
            if f.prev() != self.id {
                targets.push(f.prev());
            }
        }
        // In id order, each once.
        targets.sort_unstable();
        targets.dedup();
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
        let threshold = self.cfg.triggered_gossip_threshold;
        let changed = now_costs.len() != self.cost_gossip.advertised.len()
            || now_costs
                .iter()
                .zip(self.cost_gossip.advertised.iter())
                .any(|(a, b)| a.0 != b.0 || (a.1 - b.1).abs() > threshold * b.1.max(1e-9));
        if changed {
            self.gossip_costs(Some(now_costs));
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::protocol::rng::Rng;

    /// `my_costs` as first written: the per-sink minimum over every entry of
    /// every candidate, sorted by (cost, sink), the first `gossip_sinks`.
    fn my_costs_reference(n: &Node) -> Vec<(NodeId, f64)> {
        let mut m: BTreeMap<NodeId, f64> = BTreeMap::new();
        for j in n.next_candidates() {
            let p = &n.peers[&j];
            for &(sink, c) in p.costs.0.iter() {
                let v = n.cost_through(p, n.link_flows(j), c) + n.gpu_queue_s(false);
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

    /// Relay 10 of stage 2 (compute 0.5 s) with the load weights given; next
    /// stage peers 30 and 31 (compute 0.5 s, 10 ms away, 1 MiB/s: one 1 MiB
    /// activation takes 1 s) with spare room and cost 1.0 to sink 0, and
    /// `flows` flows of sink 0 through 30.
    pub(in crate::protocol::node) fn loaded_relay(link_w: f64, gpu_w: f64, flows: u64) -> Node {
        let mut cfg = Config::new(Policy::Gwtf, 4, 1 << 20);
        cfg.link_load_weight = link_w;
        cfg.gpu_load_weight = gpu_w;
        let mut n = Node::new(Arc::new(cfg), 10, 2, 0.5, 8, 1);
        n.handle(
            SEC,
            Input::Start {
                peers: vec![(20, 1), (30, 3), (31, 3)],
            },
        );
        for j in [30, 31] {
            let p = n.peers.get_mut(&j).unwrap();
            p.lat = Some(0.01);
            p.bw = Some((1 << 20) as f64);
            p.compute_s = 0.5;
            p.spare = 4;
            p.costs = SinkCosts::from_gossip(Arc::new([(0, 1.0)]));
        }
        for l in 0..flows {
            n.test_add_flow(l + 1, 0, 20, 30, 100 + l);
        }
        n
    }

    /// The hop to a next hop costs d_ij (here 0.25 + 0.25 + 0.01 + 1) plus
    /// the link's transfer (1 s) x `link_load_weight` for each flow already
    /// on it: with one flow through 30, one more costs 3.51 through 30 and
    /// 2.51 through the idle 31 (3.41 when 31 is 0.9 s farther from the
    /// sink), so the next flow goes to 31; with the weight 0 the load does
    /// not count and the nearer 30 wins.
    #[test]
    fn the_next_flow_avoids_a_loaded_link() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let n = loaded_relay(1.0, 0.0, 1);
        let (j, c) = n.best_to_sink(0, true, &[]).unwrap();
        assert!(j == 31 && close(c, 2.51), "{j} {c}");
        assert!(close(n.cost_via_new(30, 0), 3.51));
        // The flow already on the link does not wait behind itself.
        assert!(close(n.cost_via(30, 0), 2.51));
        let mut n = loaded_relay(1.0, 0.0, 1);
        n.peers.get_mut(&31).unwrap().costs = SinkCosts::from_gossip(Arc::new([(0, 1.9)]));
        let (j, c) = n.best_to_sink(0, true, &[]).unwrap();
        assert!(j == 31 && close(c, 3.41), "{j} {c}");
        let mut n = loaded_relay(0.0, 0.0, 1);
        n.peers.get_mut(&31).unwrap().costs = SinkCosts::from_gossip(Arc::new([(0, 1.9)]));
        assert_eq!(n.best_to_sink(0, true, &[]).map(|b| b.0), Some(30));
    }

    /// A new flow's next hop is drawn among the near-cheapest: with 30 at
    /// 2.51 and 31 at 2.56 (2 % dearer) both are drawn under a tolerance of
    /// 5 %, about evenly; 31 at 2.71 (8 %) never is; with tolerance 0 (or
    /// one that makes no sense: negative, not a number) the cheapest always
    /// wins, as `best_to_sink` says; a peer without spare room or excluded
    /// is never drawn.
    #[test]
    fn a_new_flow_goes_to_one_of_the_near_cheapest_next_hops() {
        let draws = |n: &mut Node, exclude: &[NodeId]| {
            let mut got = BTreeMap::new();
            for _ in 0..200 {
                let (j, _) = n.pick_next_hop(0, exclude).unwrap();
                *got.entry(j).or_insert(0) += 1;
            }
            got
        };
        let with = |tolerance: f64, cost31: f64| {
            let mut n = loaded_relay(0.0, 0.0, 0);
            Arc::make_mut(&mut n.cfg).route_tie_tolerance = tolerance;
            n.peers.get_mut(&31).unwrap().costs = SinkCosts::from_gossip(Arc::new([(0, cost31)]));
            n
        };
        let got = draws(&mut with(0.05, 1.05), &[]);
        assert!(got[&30] >= 70 && got[&31] >= 70, "{got:?}");
        assert_eq!(
            draws(&mut with(0.05, 1.2), &[]),
            BTreeMap::from([(30, 200)])
        );
        for nonsense in [0.0, -1.0, f64::NAN] {
            let mut n = with(nonsense, 1.05);
            assert_eq!(draws(&mut n, &[]), BTreeMap::from([(30, 200)]));
        }
        let n = with(0.0, 1.05);
        assert_eq!(n.best_to_sink(0, true, &[]).map(|b| b.0), Some(30));
        let mut n = with(0.05, 1.05);
        assert_eq!(draws(&mut n, &[30]), BTreeMap::from([(31, 200)]));
        n.peers.get_mut(&31).unwrap().spare = 0;
        assert_eq!(draws(&mut n, &[]), BTreeMap::from([(30, 200)]));
    }

    /// A relay offers upstream its cost to each sink plus its GPU queue:
    /// `gpu_load_weight` (0.5) x its compute (0.5 s) x the flows it carries
    /// (2): 2.51 + 0.5. Its 2 flows go through 30, whose gossip counts
    /// them in its own queue (1.0 + 0.5 x 0.5 x 2 = 1.5); 31 gossips 1.0.
    #[test]
    fn a_relay_offers_its_gpu_queue_upstream() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let n = loaded_relay(0.0, 0.5, 0);
        assert!(close(n.my_costs()[0].1, 2.51), "{:?}", n.my_costs());
        let mut n = loaded_relay(0.0, 0.5, 2);
        n.peers.get_mut(&30).unwrap().costs = SinkCosts::from_gossip(Arc::new([(0, 1.5)]));
        let c = n.my_costs();
        assert!(c.len() == 1 && close(c[0].1, 3.01), "{c:?}");
        assert!(close(n.offer(0, true).unwrap().1, 3.01));
        assert_eq!(c, my_costs_reference(&n));
    }

    /// This node's own flows through a next hop reach it one after another
    /// on this node's link (the link's load counts that wait), so a flow of
    /// this node waits behind none of them on that hop's GPU, only behind
    /// the flows other upstream nodes send there at the same time. Relay
    /// 10 has 2 flows through 30; 30 and 31 both gossip 1.0 + a queue of 2
    /// flows (0.5 x 0.5 x 2) = 1.5, 30's being relay 10's own: one more
    /// flow costs 1.51 + 1.0 through 30 and 1.51 + 1.5 through 31, and an
    /// existing one 2.51 through 30. Their wait is the link's: counted
    /// (weight 0.5: 0.5 s a flow ahead on it), the 2 flows ahead cost 1.0
    /// more through 30, and 31 wins.
    #[test]
    fn a_flow_waits_behind_other_nodes_flows_not_its_own() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let with = |link_w: f64| {
            let mut n = loaded_relay(link_w, 0.5, 2);
            for j in [30, 31] {
                n.peers.get_mut(&j).unwrap().costs = SinkCosts::from_gossip(Arc::new([(0, 1.5)]));
            }
            n
        };
        let n = with(0.0);
        assert!(
            close(n.cost_via_new(30, 0), 2.51),
            "{}",
            n.cost_via_new(30, 0)
        );
        assert!(close(n.cost_via_new(31, 0), 3.01));
        assert!(close(n.cost_via(30, 0), 2.51));
        let (j, c) = n.best_to_sink(0, true, &[]).unwrap();
        assert!(j == 30 && close(c, 2.51), "{j} {c}");
        assert!(close(n.my_costs()[0].1, 2.51 + 0.5));
        assert_eq!(n.my_costs(), my_costs_reference(&n));
        // Each flow ahead on the link adds 0.5 x its 1 s transfer.
        let n = with(0.5);
        assert!(close(n.cost_via_new(30, 0), 2.51 + 1.0));
        assert!(close(n.cost_via(30, 0), 2.51 + 0.5));
        assert_eq!(n.best_to_sink(0, true, &[]).map(|b| b.0), Some(31));
        // A gossip older than the flows (no queue in it) costs no less
        // than the hop.
        let mut n = with(0.0);
        n.peers.get_mut(&30).unwrap().costs = SinkCosts::from_gossip(Arc::new([(0, 0.2)]));
        assert!(close(n.cost_via_new(30, 0), 1.51));
        assert_eq!(n.my_costs(), my_costs_reference(&n));
    }

    /// Between periodic rounds a relay tells upstream only of a change
    /// that matters: a cost moved by more than `triggered_gossip_threshold`
    /// (10 %) or a sink came or went; a smaller drift waits for the round.
    #[test]
    fn only_a_material_change_triggers_a_change_upstream() {
        let mut n = loaded_relay(0.0, 0.0, 0);
        n.gossip();
        assert_eq!(n.cost_gossip.advertised.len(), 1);
        let triggered = |n: &mut Node, costs: &[(NodeId, f64)]| {
            for j in [30, 31] {
                n.peers.get_mut(&j).unwrap().costs = SinkCosts::from_gossip(costs.into());
            }
            n.out.clear();
            n.cost_gossip.gossip_dirty = true;
            n.triggered_gossip();
            n.out
                .iter()
                .filter(|a| {
                    matches!(
                        a,
                        Action::Send {
                            to: 20,
                            msg: Msg::Change { .. }
                        }
                    )
                })
                .count()
        };
        // 2.51 -> 2.61 (+4 %): not yet.
        assert_eq!(triggered(&mut n, &[(0, 1.1)]), 0);
        // 2.51 -> 3.01 (+20 %): at once.
        assert_eq!(triggered(&mut n, &[(0, 1.5)]), 1);
        // A new sink: at once, however near the old costs.
        assert_eq!(triggered(&mut n, &[(0, 1.5), (1, 9.0)]), 1);
        // Back by less than 10 % of what was last advertised: not yet.
        assert_eq!(triggered(&mut n, &[(0, 1.3), (1, 9.0)]), 0);
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
                let p = n.peers.learn(j * 7, stage, 0);
                p.costs = SinkCosts::from_gossip(list.into());
                p.dead = rng.below(8) == 0;
                p.banned_until = if rng.below(8) == 0 { 5_000 } else { 0 };
                p.lat = Some([0.0, 0.25, 0.5][rng.below(3) as usize]);
                p.bw = Some(1e9);
                p.compute_s = 0.5;
            }
            // Rejections edit a list in place.
            let ids: Vec<NodeId> = n.peers.iter().map(|(id, _)| *id).collect();
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

    /// A relay's cost counts the wait its GPU queue made microbatches meet
    /// lately, beyond `QUEUE_PASSING` compute times: a short burst (two
    /// microbatches at once) is left out, a lasting queue is counted.
    #[test]
    fn a_relay_s_cost_counts_a_lasting_gpu_queue() {
        use super::super::testkit::{config, mb};
        let mut n = Node::new(config(Policy::Gwtf), 10, 2, 0.5, 4, 1);
        let model = n.gpu_queue_s(false);
        for i in 0..2 {
            n.run(TaskKind::Forward, Some(mb(0, 0, i)), 0);
        }
        assert!(n.lifecycle.gpu_wait_s().unwrap() > 0.0);
        assert_eq!(n.gpu_queue_s(false), model, "a burst passes");
        for i in 2..40 {
            n.run(TaskKind::Backward, Some(mb(0, 0, i)), 0);
        }
        let w = n.lifecycle.gpu_wait_s().unwrap();
        assert!(w > 4.0, "38 backwards queued: {w}");
        let expect = model + 2.0 * w - QUEUE_PASSING * 0.5;
        assert!((n.gpu_queue_s(false) - expect).abs() < 1e-9);
        // A holder offers no GPU queue and measures none.
        let mut h = Node::new(config(Policy::Gwtf), 0, 0, 0.5, 4, 1);
        for i in 0..40 {
            h.run(TaskKind::Embed, Some(mb(0, 0, i)), 0);
        }
        assert_eq!(
            (h.gpu_queue_s(false), h.lifecycle.gpu_wait_s()),
            (0.0, None)
        );
    }
}
