//! Flow reservations (GWTF): FLOW_REQUEST / FLOW_RESPONSE, idle expiry,
//! push-backs and cancels, and the reroute of a reserved flow to a cheaper
//! next hop.
use super::*;

/// The flow reservations through this node (GWTF).
#[derive(Debug)]
pub(super) struct Reservations {
    /// Reserved flows, by in label.
    flows: BTreeMap<Label, FlowEntry>,
    /// The in label of the flow that goes out on each out label.
    out_index: BTreeMap<Label, Label>,
    /// Flows redirected away, by in label (next hop, out label): microbatches
    /// already on them still pass, until the iteration is final.
    ghosts: BTreeMap<Label, (NodeId, Label)>,
    /// Requests waiting for the next hop's answer, by out label.
    pending: BTreeMap<Label, PendingReq>,
    next_label: u64,
    /// Holder: EMA of the observed round trip (launch to gradient back) of a
    /// microbatch on each of its reserved flows, in seconds.
    flow_rtt: BTreeMap<Label, f64>,
}

impl Default for Reservations {
    fn default() -> Reservations {
        Reservations {
            next_label: 1,
            flows: Default::default(),
            out_index: Default::default(),
            ghosts: Default::default(),
            pending: Default::default(),
            flow_rtt: Default::default(),
        }
    }
}

/// One reserved flow through this node (GWTF).
#[derive(Clone, Debug)]
pub(super) struct FlowEntry {
    in_label: Label,
    sink: NodeId,
    /// Upstream node (the holder itself for a holder's own flows).
    prev: NodeId,
    next: NodeId,
    out_label: Label,
    cost_from_source: f64,
    last_used: Time,
}

impl FlowEntry {
    /// Flow `in_label` toward `sink`, from `prev` to `next` (out on
    /// `out_label`), costing `cost_from_source` so far, used at `last_used`.
    pub(super) fn new(
        in_label: Label,
        sink: NodeId,
        prev: NodeId,
        next: NodeId,
        out_label: Label,
        cost_from_source: f64,
        last_used: Time,
    ) -> FlowEntry {
        FlowEntry {
            in_label,
            sink,
            prev,
            next,
            out_label,
            cost_from_source,
            last_used,
        }
    }
    /// Its `in_label`.
    pub(super) fn in_label(&self) -> Label {
        self.in_label
    }
    /// Its `sink`.
    pub(super) fn sink(&self) -> NodeId {
        self.sink
    }
    /// Its `prev`.
    pub(super) fn prev(&self) -> NodeId {
        self.prev
    }
    /// Its `next`.
    pub(super) fn next(&self) -> NodeId {
        self.next
    }
    /// Its `out_label`.
    pub(super) fn out_label(&self) -> Label {
        self.out_label
    }
    /// Its `cost_from_source`.
    pub(super) fn cost_from_source(&self) -> f64 {
        self.cost_from_source
    }
}

#[derive(Clone, Debug)]
pub(super) struct PendingReq {
    /// None for a holder's own request.
    in_label: Option<Label>,
    prev: NodeId,
    sink: NodeId,
    next: NodeId,
    cost_from_source: f64,
    tried: Vec<NodeId>,
    expires: Time,
    /// A reroute of the existing flow `in_label` (see [`Node::reroute_flows`]):
    /// on acceptance the flow switches to the new next hop; on refusal the
    /// flow simply keeps its current one (nothing is said upstream).
    reroute: bool,
}

impl Reservations {
    /// The flows reserved through this node, by in label (changed only
    /// through the reservations' own operations).
    pub(super) fn flows(&self) -> &BTreeMap<Label, FlowEntry> {
        &self.flows
    }

    /// Where microbatches on flow `in_label`, redirected away, still go:
    /// (next hop, out label).
    pub(super) fn ghost(&self, in_label: Label) -> Option<(NodeId, Label)> {
        self.ghosts.get(&in_label).copied()
    }

    /// Whether `in_label` names a flow here, or one redirected away.
    pub(super) fn knows(&self, in_label: Label) -> bool {
        self.flows.contains_key(&in_label) || self.ghosts.contains_key(&in_label)
    }

    /// No flows, requests or round trips any more; the labels issued stay
    /// issued (a label is never reused by a node).
    pub(super) fn clear_keeping_labels(&mut self) {
        *self = Reservations {
            next_label: self.next_label,
            ..Reservations::default()
        };
    }

    /// Holder: the observed round trip of flow `label`, in seconds.
    pub(super) fn round_trip(&self, label: &Label) -> Option<f64> {
        self.flow_rtt.get(label).copied()
    }

    /// Flow `in_label` was redirected away (a swap): microbatches already
    /// on it still pass to its old next hop until the iteration is final.
    pub(super) fn redirect_away(&mut self, in_label: Label) -> Option<FlowEntry> {
        let g = self.flows.remove(&in_label)?;
        self.out_index.remove(&g.out_label);
        self.ghosts.insert(g.in_label, (g.next, g.out_label));
        Some(g)
    }

    /// The next hops of the requests still out (one per request).
    pub(super) fn pending_next_hops(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.pending.values().map(|r| r.next)
    }

    /// A new label, unique to this node `me`.
    pub(super) fn new_label(&mut self, me: NodeId) -> Label {
        let l = ((me as u64) << 32) | self.next_label;
        self.next_label += 1;
        l
    }

    /// A microbatch goes out on flow `in_label`: its (next hop, out label),
    /// and the flow is in use (not idle) now.
    pub(super) fn use_flow(&mut self, in_label: Label, now: Time) -> Option<(NodeId, Label)> {
        let f = self.flows.get_mut(&in_label)?;
        f.last_used = now;
        Some((f.next, f.out_label))
    }

    /// Flow `in_label` (which exists) goes on through `next` on `out_label`
    /// from now on (a swap of downstream segments).
    pub(super) fn switch_downstream(&mut self, in_label: Label, next: NodeId, out_label: Label) {
        let f = self.flows.get_mut(&in_label).expect("flow switched");
        self.out_index.remove(&f.out_label);
        f.next = next;
        f.out_label = out_label;
        self.out_index.insert(out_label, in_label);
    }

    /// Units of capacity reserved: the flows and the requests waiting for
    /// an answer (a pending reroute belongs to a flow already counted).
    pub(super) fn in_use(&self) -> usize {
        self.flows.len() + self.pending.values().filter(|r| !r.reroute).count()
    }

    /// Flows redirected away are forgotten (their iteration is final).
    pub(super) fn forget_ghosts(&mut self) {
        self.ghosts.clear();
    }

    /// Holder: a microbatch came back `rtt` seconds after it went out on
    /// flow `label`; round trips of flows gone are forgotten (bounded by the
    /// flows a holder has, not by how many it ever had).
    pub(super) fn observe_round_trip(&mut self, label: Label, rtt: f64, alpha: f64) {
        let old = self.flow_rtt.get(&label).copied();
        if let Some(v) = Node::ema(old, rtt, alpha) {
            self.flow_rtt.insert(label, v);
        }
        if self.flow_rtt.len() > 2 * self.flows.len() + 8 {
            let flows = &self.flows;
            self.flow_rtt.retain(|l, _| flows.contains_key(l));
        }
    }
}

/// The most flows a relay that recomputes takes, however fast its GPU.
const FLOW_CAPACITY_MAX: u32 = 64;

/// How busy a relay that recomputes lets its GPU become with flows
/// (measured) before it offers no more: 0.6 and 0.8 gave the same in the
/// paper regime (docs/EVALUATION.md).
const TARGET_BUSY: f64 = 0.8;

impl Node {
    /// Flows this node can still take. None while its weights miss an
    /// update the stage applied (a joiner downloading the state again,
    /// with `Config::leave_out_stragglers`): a microbatch routed here would
    /// wait for the download, and its iteration with it.
    pub(super) fn spare(&self) -> u32 {
        if self.cfg.leave_out_stragglers && self.stage != 0 && self.iters.gap() {
            return 0;
        }
        let used = self.reservations.in_use();
        self.flow_capacity().saturating_sub(used as u32)
    }

    /// Flows this node can carry at once. Its memory bounds them
    /// (`capacity`), unless its trainer can recompute a forward
    /// ([`Config::recompute`]): then its GPU does, at about one stay of a
    /// microbatch here (the measured hold, less its waits for the GPU) per
    /// compute time, or as many as keep it [`TARGET_BUSY`] busy, whichever
    /// is more, and never fewer than its memory allows.
    pub(super) fn flow_capacity(&self) -> u32 {
        let hold = match self.lifecycle.hold_s() {
            // Less the time its forward and backward waited for the GPU:
            // a queue here lengthens the stay, and counted in it, more
            // flows would lengthen the queue further.
            Some(h) if self.cfg.recompute && self.stage != 0 => {
                (h - 2.0 * self.lifecycle.gpu_wait_s().unwrap_or(0.0)).max(self.compute_s)
            }
            _ => return self.capacity,
        };
        let stay = (hold / self.compute_s.max(1e-6)).floor();
        // Or as many as keep its GPU at most `TARGET_BUSY` busy, measured
        // (each flow's share of it taken as alike): a short stay (the last
        // stage's: its forward, the holder's loss, its backward) says
        // little of how often a flow comes back.
        let flows = self.reservations.flows.len() as f64;
        let busy = match self.lifecycle.gpu_busy() {
            Some(u) if u > 0.01 && flows > 0.0 => (flows * TARGET_BUSY / u).floor(),
            _ => 0.0,
        };
        let gpu = stay.max(busy).min(FLOW_CAPACITY_MAX as f64);
        self.capacity.max(gpu as u32)
    }

    pub(super) fn flow_maintenance(&mut self) {
        let now = self.now;
        // Expired reservations.
        let expired: Vec<Label> = self
            .reservations
            .pending
            .iter()
            .filter(|(_, r)| r.expires <= now)
            .map(|(l, _)| *l)
            .collect();
        for l in expired {
            let r = self.reservations.pending.remove(&l).unwrap();
            if r.reroute {
                continue;
            }
            if let Some(inl) = r.in_label {
                self.send(
                    r.prev,
                    Msg::FlowResponse {
                        label: inl,
                        accept: false,
                        cost: INF,
                        spare: self.spare(),
                    },
                );
            }
        }
        // Idle flows.
        let idle = self.cfg.flow_idle_expiry_ticks as Time * self.cfg.tick;
        let stale: Vec<Label> = self
            .reservations
            .flows
            .iter()
            .filter(|(_, f)| f.last_used + idle < now)
            .map(|(l, _)| *l)
            .collect();
        for l in stale {
            self.drop_flow(l, true, true);
        }
        // Holders reserve flows up to their in-flight bound (one request
        // per missing unit, each toward the best next hop with spare room).
        if self.stage == 0 {
            let have = self.reservations.in_use();
            for _ in have..self.cfg.max_in_flight as usize {
                if let Some(hop) = self.pick_next_hop(self.id, &[]) {
                    self.request_flow(None, self.id, self.id, 0.0, hop, false);
                }
            }
        }
    }

    /// Rerouting of reserved flows (docs/SPEC.md section 4: CHANGE gossip is
    /// there so that upstream nodes pick the next hop minimising
    /// d(me, j) + cost_to_sink(j)). Flows are reserved greedily when they
    /// are built, often right after a crash, through the cheapest next hop
    /// that had room at that moment; the gossip later shows cheaper next
    /// hops with spare capacity (a joiner, capacity released elsewhere), and
    /// the swap and redirect moves of the local search cannot use them (a
    /// swap needs a same-stage peer with a flow to the same sink, a redirect
    /// moves a flow into the proposer only). So, once per gossip period,
    /// this node moves the one flow that gains most to the cheapest next
    /// hop with spare capacity, when that lowers the flow's cost to its sink
    /// by more than `reroute_min_gain`. The new downstream segment is
    /// reserved first (FLOW_REQUEST with the cost expected); only when it is
    /// accepted is the old one cancelled, so the flow always has a path.
    /// Only local knowledge is used: own link costs and gossiped costs.
    pub(super) fn reroute_flows(&mut self) {
        if self.stage == self.s() || self.reservations.pending.values().any(|r| r.reroute) {
            return;
        }
        let mut best: Option<(f64, Label, NodeId, f64)> = None;
        for f in self.reservations.flows.values() {
            let cur = self.cost_via(f.next, f.sink);
            if cur >= INF {
                continue;
            }
            let Some((j, c)) = self.best_to_sink(f.sink, true, &[f.next]) else {
                continue;
            };
            let gain = cur - c;
            if gain > self.cfg.reroute_min_gain * cur && best.is_none_or(|b| gain > b.0) {
                best = Some((gain, f.in_label, j, c));
            }
        }
        let Some((_, inl, j, c)) = best else { return };
        let f = self.reservations.flows[&inl].clone();
        let (sink, cfs) = (f.sink, f.cost_from_source);
        self.request_flow(Some(f.in_label), f.prev, sink, cfs, (j, c), true);
    }

    /// The new downstream segment `out` through `next` of a reroute was
    /// accepted: switch the flow to it and cancel the old segment, unless
    /// the flow is gone or the new segment is no longer cheaper (then the
    /// new one is cancelled instead).
    pub(super) fn finish_reroute(&mut self, r: PendingReq, out: Label, next: NodeId) {
        let keep = r
            .in_label
            .and_then(|inl| self.reservations.flows.get(&inl))
            .filter(|f| {
                f.sink == r.sink
                    && f.next != next
                    && self.cost_via_new(next, f.sink) < self.cost_via(f.next, f.sink)
            });
        let Some(f) = keep.cloned() else {
            self.send(next, Msg::Cancel { label: out });
            return;
        };
        self.reservations.out_index.remove(&f.out_label);
        self.send(f.next, Msg::Cancel { label: f.out_label });
        let e = self.reservations.flows.get_mut(&f.in_label).unwrap();
        e.next = next;
        e.out_label = out;
        self.reservations.out_index.insert(out, f.in_label);
    }

    /// Removes a flow entry; tells upstream (PushBack) and/or downstream (Cancel).
    pub(super) fn drop_flow(&mut self, in_label: Label, upstream: bool, downstream: bool) {
        let Some(f) = self.reservations.flows.remove(&in_label) else {
            return;
        };
        self.reservations.out_index.remove(&f.out_label);
        if upstream && f.prev != self.id {
            self.send(f.prev, Msg::PushBack { label: f.in_label });
        }
        if downstream && self.stage != self.s() {
            self.send(f.next, Msg::Cancel { label: f.out_label });
        }
    }

    pub(super) fn insert_flow(&mut self, f: FlowEntry) {
        self.reservations.out_index.insert(f.out_label, f.in_label);
        self.reservations.flows.insert(f.in_label, f);
    }

    pub(super) fn on_flow_request(
        &mut self,
        from: NodeId,
        label: Label,
        sink: NodeId,
        cfs: f64,
        expected: f64,
    ) {
        if self.phase != Phase::Active || self.stage == 0 {
            return;
        }
        let ps = self.prev_stage();
        self.learn(from, ps);
        let reject = |me: &mut Node, cost: f64| {
            let spare = me.spare();
            me.send(
                from,
                Msg::FlowResponse {
                    label,
                    accept: false,
                    cost,
                    spare,
                },
            );
        };
        if self.spare() == 0 {
            let c = self.offer(sink, false).map_or(INF, |b| b.1);
            return reject(self, c);
        }
        let Some((_, best)) = self.best_to_sink(sink, true, &[]) else {
            return reject(self, INF);
        };
        // What this node offers now (with its GPU queue), against what the
        // requester assumed.
        let offered = best + self.gpu_queue_s(false);
        if offered > expected * (1.0 + self.cfg.stale_cost_tolerance) + 1e-6 {
            return reject(self, offered);
        }
        let cfs_here = cfs + self.loaded_link_cost(from, false);
        if self.stage == self.s() {
            self.insert_flow(FlowEntry {
                in_label: label,
                sink,
                prev: from,
                next: sink,
                out_label: label,
                cost_from_source: cfs_here,
                last_used: self.now,
            });
            let spare = self.spare();
            self.send(
                from,
                Msg::FlowResponse {
                    label,
                    accept: true,
                    cost: best,
                    spare,
                },
            );
            return;
        }
        if let Some(hop) = self.pick_next_hop(sink, &[]) {
            self.request_flow(Some(label), from, sink, cfs_here, hop, false);
        }
    }

    /// Asks next hop `next` (cost `c` to `sink` through it, from here) to
    /// reserve a flow for `in_label` from `prev` (none: a holder's own
    /// flow); the request waits for the answer under a new out label, and
    /// `next` is taken to have one unit of spare capacity less meanwhile.
    fn request_flow(
        &mut self,
        in_label: Option<Label>,
        prev: NodeId,
        sink: NodeId,
        cost_from_source: f64,
        (next, c): (NodeId, f64),
        reroute: bool,
    ) {
        let out = self.new_label();
        let expected = self.expected_of(next, sink, c);
        self.reservations.pending.insert(
            out,
            PendingReq {
                in_label,
                prev,
                sink,
                next,
                cost_from_source,
                tried: vec![next],
                expires: self.now + self.cfg.reservation_expiry_ticks as Time * self.cfg.tick,
                reroute,
            },
        );
        if let Some(p) = self.peers.get_mut(&next) {
            p.spare = p.spare.saturating_sub(1);
        }
        self.send(
            next,
            Msg::FlowRequest {
                label: out,
                sink,
                cost_from_source,
                expected_cost: expected,
            },
        );
    }

    pub(super) fn on_flow_response(
        &mut self,
        from: NodeId,
        label: Label,
        accept: bool,
        cost: f64,
        spare: u32,
    ) {
        let ns = self.next_stage();
        let sink_known = self.reservations.pending.get(&label).map(|r| r.sink);
        {
            let p = self.learn(from, ns);
            p.spare = spare;
            if let Some(sink) = sink_known {
                if !accept {
                    if cost >= INF {
                        p.costs.remove(sink);
                    } else {
                        p.costs.insert(sink, cost);
                    }
                }
            }
        }
        let Some(r) = self.reservations.pending.remove(&label) else {
            if accept {
                self.send(from, Msg::Cancel { label });
            }
            return;
        };
        if accept && r.reroute {
            self.finish_reroute(r, label, from);
        } else if accept {
            // This node's cost to the sink through `from` for the flow now
            // reserved (the request no longer counts as pending).
            let total = self.loaded_link_cost(from, false) + cost + self.gpu_queue_s(false);
            match r.in_label {
                None => self.insert_flow(FlowEntry {
                    in_label: label,
                    sink: r.sink,
                    prev: self.id,
                    next: from,
                    out_label: label,
                    cost_from_source: 0.0,
                    last_used: self.now,
                }),
                Some(inl) => {
                    self.insert_flow(FlowEntry {
                        in_label: inl,
                        sink: r.sink,
                        prev: r.prev,
                        next: from,
                        out_label: label,
                        cost_from_source: r.cost_from_source,
                        last_used: self.now,
                    });
                    let spare = self.spare();
                    self.send(
                        r.prev,
                        Msg::FlowResponse {
                            label: inl,
                            accept: true,
                            cost: total,
                            spare,
                        },
                    );
                }
            }
        } else {
            self.reservations.pending.insert(label, r);
            self.retry_pending(label, from);
        }
    }

    /// A downstream candidate refused or died: try another, or give up.
    pub(super) fn retry_pending(&mut self, label: Label, failed: NodeId) {
        let Some(mut r) = self.reservations.pending.remove(&label) else {
            return;
        };
        if r.reroute {
            // The flow still runs on its current next hop.
            return;
        }
        if !r.tried.contains(&failed) {
            r.tried.push(failed);
        }
        if r.tried.len() < 3 {
            if let Some((j, c)) = self.pick_next_hop(r.sink, &r.tried) {
                r.tried.push(j);
                r.next = j;
                let expected = self.expected_of(j, r.sink, c);
                let (sink, cfs) = (r.sink, r.cost_from_source);
                self.reservations.pending.insert(label, r);
                self.send(
                    j,
                    Msg::FlowRequest {
                        label,
                        sink,
                        cost_from_source: cfs,
                        expected_cost: expected,
                    },
                );
                return;
            }
        }
        if let Some(inl) = r.in_label {
            let c = self.offer(r.sink, false).map_or(INF, |b| b.1);
            let spare = self.spare();
            self.send(
                r.prev,
                Msg::FlowResponse {
                    label: inl,
                    accept: false,
                    cost: c,
                    spare,
                },
            );
        }
    }

    /// The upstream end of flow `label` moved to `new_prev` (a swap).
    pub(super) fn on_notify_switch(&mut self, label: Label, new_prev: NodeId) {
        if let Some(f) = self.reservations.flows.get_mut(&label) {
            f.prev = new_prev;
        }
    }

    /// The downstream end of our flow out on `label` moved to `new_next`.
    pub(super) fn on_notify_redirect(&mut self, label: Label, new_next: NodeId) {
        if let Some(&inl) = self.reservations.out_index.get(&label) {
            if let Some(f) = self.reservations.flows.get_mut(&inl) {
                f.next = new_next;
            }
        }
    }

    /// The next hop dropped our reservation `label`.
    pub(super) fn on_push_back(&mut self, from: NodeId, label: Label) {
        if let Some(&inl) = self.reservations.out_index.get(&label) {
            if self
                .reservations
                .flows
                .get(&inl)
                .is_some_and(|f| f.next == from)
            {
                self.drop_flow(inl, true, false);
            }
        }
    }

    /// The previous hop released its reservation `label` with us.
    pub(super) fn on_cancel(&mut self, from: NodeId, label: Label) {
        if self
            .reservations
            .flows
            .get(&label)
            .is_some_and(|f| f.prev == from)
        {
            self.drop_flow(label, false, true);
        }
    }

    /// The flows through dead `p` are released (the other end is told), and
    /// reservations waiting for its answer try another next hop.
    pub(super) fn release_flows_through(&mut self, p: NodeId) {
        let through: Vec<Label> = self
            .reservations
            .flows
            .iter()
            .filter(|(_, f)| f.next == p || f.prev == p)
            .map(|(l, _)| *l)
            .collect();
        for l in through {
            let f = self.reservations.flows[&l].clone();
            if f.next == p {
                self.drop_flow(l, true, false);
            } else {
                self.drop_flow(l, false, true);
            }
        }
        let pend: Vec<Label> = self
            .reservations
            .pending
            .iter()
            .filter(|(_, r)| r.next == p)
            .map(|(l, _)| *l)
            .collect();
        for l in pend {
            self.retry_pending(l, p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// Relay 10 of stage 2 with room for `capacity` flows, next-stage peer 30
    /// offering cost 1 to sink 0.
    fn relay(capacity: u32) -> Node {
        let mut n = Node::new(config(Policy::Gwtf), 10, 2, 0.5, capacity, 1);
        n.handle(
            SEC,
            Input::Start {
                peers: vec![(20, 1), (30, 3)],
            },
        );
        let change = Msg::Change {
            spare: 4,
            compute_s: 0.5,
            costs: Arc::new([(0, 1.0)]),
        };
        deliver(&mut n, 30, change);
        n
    }

    fn request(label: Label) -> Msg {
        Msg::FlowRequest {
            label,
            sink: 0,
            cost_from_source: 0.0,
            expected_cost: 1e9,
        }
    }

    /// A reservation is accepted upstream only once reserved downstream: the
    /// request goes on to the next hop, and its acceptance installs the flow
    /// and answers upstream.
    #[test]
    fn a_flow_is_reserved_downstream_before_it_is_accepted() {
        let mut n = relay(4);
        let acts = deliver(&mut n, 20, request(5));
        let s = sends(&acts);
        assert!(matches!(s[..], [(30, Msg::FlowRequest { .. })]), "{s:?}");
        let Msg::FlowRequest { label: out, .. } = s[0].1 else {
            unreachable!()
        };
        let out = *out;
        assert_eq!(n.flow_count(), 0);
        let reply = Msg::FlowResponse {
            label: out,
            accept: true,
            cost: 1.0,
            spare: 3,
        };
        let acts = deliver(&mut n, 30, reply);
        assert!(sends(&acts).iter().any(|(to, m)| *to == 20
            && matches!(
                m,
                Msg::FlowResponse {
                    label: 5,
                    accept: true,
                    ..
                }
            )));
        assert_eq!(n.flows(), [(5, 20, 30, out)]);
    }

    /// Rerouting counts the load: of two flows through next hop 30, one
    /// moves to the idle 31 (its cost there, 1.51 + 1.0, is below its cost
    /// through 30 by the other flow's transfer, 1 s, more than 10 %); the
    /// new segment is reserved first, and only once accepted is the old one
    /// cancelled. With the load not counted, nothing moves.
    #[test]
    fn a_flow_moves_off_a_loaded_next_hop_to_an_idle_one() {
        let mut n = super::super::costs::tests::loaded_relay(0.0, 0.0, 2);
        n.reroute_flows();
        assert!(n.out.is_empty(), "{:?}", n.out);
        let mut n = super::super::costs::tests::loaded_relay(1.0, 0.0, 2);
        n.reroute_flows();
        let acts = std::mem::take(&mut n.out);
        let s = sends(&acts);
        let out = match s[..] {
            [(31, Msg::FlowRequest { label, .. })] => *label,
            _ => panic!("{s:?}"),
        };
        assert_eq!(n.flow_count(), 2);
        let reply = Msg::FlowResponse {
            label: out,
            accept: true,
            cost: 1.0,
            spare: 3,
        };
        let acts = deliver(&mut n, 31, reply);
        assert!(sends(&acts)
            .iter()
            .any(|(to, m)| *to == 30 && matches!(m, Msg::Cancel { .. })));
        let mut next: Vec<NodeId> = n.flows().iter().map(|f| f.2).collect();
        next.sort();
        assert_eq!(next, [30, 31]);
    }

    /// A relay with no spare capacity refuses, and tells its cost.
    #[test]
    fn a_full_relay_refuses_a_reservation() {
        let mut n = relay(1);
        n.test_add_flow(1, 0, 21, 30, 2);
        let acts = deliver(&mut n, 20, request(5));
        assert!(matches!(
            sends(&acts)[..],
            [(
                20,
                Msg::FlowResponse {
                    label: 5,
                    accept: false,
                    ..
                }
            )]
        ));
    }

    /// A dead next hop releases the flows through it (push-back upstream), and
    /// a cancel from the previous hop releases the flow downstream.
    #[test]
    fn flows_through_a_dead_or_cancelling_peer_are_released() {
        let mut n = relay(4);
        n.test_add_flow(1, 0, 20, 30, 2);
        n.test_add_flow(3, 0, 21, 31, 4);
        let acts = n.handle(2 * SEC, Input::PeerLost { peer: 30 });
        assert!(sends(&acts)
            .iter()
            .any(|(to, m)| *to == 20 && matches!(m, Msg::PushBack { label: 1 })));
        assert_eq!(n.flows(), [(3, 21, 31, 4)]);
        let acts = deliver(&mut n, 21, Msg::Cancel { label: 3 });
        assert!(sends(&acts)
            .iter()
            .any(|(to, m)| *to == 31 && matches!(m, Msg::Cancel { label: 4 })));
        assert_eq!(n.flow_count(), 0);
    }

    /// A relay carries as many flows as its memory holds microbatches; one
    /// whose trainer recomputes carries as many as its GPU serves during a
    /// microbatch's stay (measured, less its waits for the GPU) or as many
    /// as keep its GPU 80 % busy (measured), capped, never fewer than its
    /// memory's.
    #[test]
    fn a_relay_that_recomputes_carries_what_its_gpu_serves() {
        let mut n = relay(2);
        n.lifecycle.set_timings(Some(4.0), None, None);
        assert_eq!(n.flow_capacity(), 2, "no recompute: memory bounds");
        let mut cfg = (*n.cfg).clone();
        cfg.recompute = true;
        let mut r = Node::new(Arc::new(cfg), 10, 2, 0.5, 2, 1);
        assert_eq!(r.flow_capacity(), 2, "no hold measured yet");
        r.lifecycle.set_timings(Some(4.0), None, None);
        assert_eq!(r.flow_capacity(), 8, "4 s stay / 0.5 s compute");
        r.lifecycle.set_timings(Some(4.0), Some(1.0), None);
        assert_eq!(
            r.flow_capacity(),
            4,
            "a queue here lengthens the stay, not the capacity: (4 - 2 x 1) / 0.5"
        );
        // Or as many as keep its GPU 80 % busy, measured, when more.
        r.lifecycle.set_timings(Some(1.0), None, None);
        for l in 1..=4 {
            r.test_add_flow(l, 0, 20, 30, 100 + l);
        }
        assert_eq!(
            r.flow_capacity(),
            2,
            "no busy measured yet: 1 s stay / 0.5 s"
        );
        r.lifecycle.set_timings(Some(1.0), None, Some(0.2));
        assert_eq!(r.flow_capacity(), 16, "4 flows at 20 % busy: 16 at 80 %");
        r.lifecycle.set_timings(Some(1.0), None, Some(0.9));
        assert_eq!(r.flow_capacity(), 3, "4 flows at 90 %: 3 at 80 %");
        r.reservations = Default::default();
        r.lifecycle.set_timings(Some(0.2), None, None);
        assert_eq!(r.flow_capacity(), 2, "never below its memory's");
        r.lifecycle.set_timings(Some(1e6), None, None);
        assert_eq!(r.flow_capacity(), FLOW_CAPACITY_MAX);
        assert_eq!(r.spare(), FLOW_CAPACITY_MAX);
    }

    /// A relay whose weights miss an update (it downloads the state again)
    /// takes no flow until it holds it: a reservation is refused.
    #[test]
    fn a_relay_behind_an_update_takes_no_flow_until_it_catches_up() {
        let mut cfg = (*config(Policy::Gwtf)).clone();
        cfg.leave_out_stragglers = true;
        let mut n = Node::new(Arc::new(cfg), 10, 2, 0.5, 4, 1);
        n.handle(
            SEC,
            Input::Start {
                peers: vec![(20, 1), (30, 3)],
            },
        );
        n.iters.downloaded((4, 9));
        assert_eq!(n.spare(), 4);
        n.iters.missed(5, 10);
        assert_eq!(n.spare(), 0);
        let ask = Msg::FlowRequest {
            label: 1,
            sink: 30,
            cost_from_source: 0.0,
            expected_cost: 1.0,
        };
        let acts = deliver(&mut n, 20, ask);
        assert!(
            (sends(&acts).iter()).any(|(to, m)| *to == 20
                && matches!(
                    m,
                    Msg::FlowResponse {
                        accept: false,
                        spare: 0,
                        ..
                    }
                )),
            "{acts:?}"
        );
        n.caught_up(5);
        assert_eq!(n.spare(), 4);
    }
}
