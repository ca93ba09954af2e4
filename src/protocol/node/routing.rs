//! The next hop of one microbatch, and what else the routing policies
//! (GWTF, SWARM, SWARM-plus, centrally planned; docs/SPEC.md sections 3, 4
//! and 8) decide differently, behind one small trait: the rest of the node
//! is the same for all.
use super::*;

/// What a routing policy decides.
pub(super) trait RoutingPolicy: Sync {
    /// Reserves flows, gossips its costs to the sinks and runs the local
    /// search (GWTF).
    fn reserves_flows(&self) -> bool {
        false
    }
    /// Counts the microbatches queued at each next hop and measures its
    /// throughput (SWARM-plus chooses the smallest expected finish time).
    fn counts_queues(&self) -> bool {
        false
    }
    /// Fixed ack timeouts (forward, backward), as SWARM's calls have;
    /// `None`: adaptive ones, postponed by `Queued` notices.
    fn fixed_timeouts(&self) -> Option<(Time, Time)> {
        None
    }
    /// A crashed stage is re-run alone, from the activation stored before
    /// it and the gradient stored after it; otherwise (SWARM-plus) the
    /// microbatch restarts from its data holder.
    fn reruns_crashed_stage(&self) -> bool {
        true
    }
    /// A hop through a peer found dead is re-run at once, before the
    /// gradient is due (GWTF). SWARM finds a dead peer only when it calls
    /// it: the backward through it fails, then its stage is re-run.
    fn reruns_before_the_gradient_is_due(&self) -> bool {
        self.reruns_crashed_stage()
    }
    /// Microbatches a holder keeps in flight, given its planned paths.
    fn in_flight_limit(&self, max_in_flight: usize, _plan: &[Arc<Vec<NodeId>>]) -> usize {
        max_in_flight
    }
    /// The planned path of the `n`-th microbatch in flight, if any.
    fn planned_path(&self, _plan: &[Arc<Vec<NodeId>>], _n: usize) -> Option<Arc<Vec<NodeId>>> {
        None
    }
    /// A hop is acknowledged once its output has reached the next hop (the
    /// next hop's receipt, `Queued`, or its ack), not when its work is
    /// done: SWARM's trainer calls each peer and the call returns the
    /// peer's output (`swarm/pipeline/src/moe/client/balanced_expert.py`),
    /// so a peer that dies while it sends its output fails the call, and
    /// the stage is run again at another peer. Acked at the end of the
    /// work, the output lost with the peer was waited for by nobody: the
    /// microbatch stalled until its holder's last-resort restart.
    fn acks_on_delivery(&self) -> bool {
        false
    }
    /// A stage whose all-reduce failed steps on what each member has
    /// instead of committing again: SWARM's butterfly all-reduce ends for
    /// every peer at the first error (`swarm/pipeline/src/averaging/allreduce.py`,
    /// `finalize` tells the group), and its optimizer then "skipped
    /// averaging" and steps with the local gradients
    /// (`swarm/pipeline/src/optim/collaborative.py`, `step`).
    fn skips_failed_aggregation(&self) -> bool {
        false
    }
    /// A relay stage's coordinator drops a lost contribution (the stage
    /// aggregates what it has) instead of having it recomputed (SWARM's
    /// stages collect samples up to a target batch size,
    /// `swarm/pipeline/src/optim/collaborative.py`).
    fn drops_lost_contributions(&self) -> bool {
        false
    }
    /// How the next hop is chosen when no hint applies.
    fn next_hop_rule(&self) -> NextHopRule {
        NextHopRule::Cost
    }
}

/// How a policy chooses the next hop of a microbatch when no hint applies.
pub(super) enum NextHopRule {
    /// The planned one, else the reserved flow's, else the cheapest by the
    /// gossiped costs (GWTF, planned).
    Cost,
    /// The smallest expected finish time (SWARM-plus).
    ShortestExpectedDelay,
    /// The smallest cumulative expected work in the heap of the
    /// microbatch's holder (SWARM, `balancer.rs`): it also times each next
    /// hop's calls end to end and bans a failed peer for the lifetime of
    /// its DHT record.
    CumulativeWork,
    /// The lowest delay, an EMA of the time from a forward to its ack; a
    /// hop that timed out gives its peer a prohibitive delay
    /// (SWARM-DecCom, `balancer.rs`).
    LowestDelay,
}

/// GWTF: reserved flows, cost gossip, stage-only crash recovery.
struct Gwtf;

impl RoutingPolicy for Gwtf {
    fn reserves_flows(&self) -> bool {
        true
    }
}

/// SWARM as its public code behaves (yandex-research/swarm; each rule's
/// source is cited in `balancer.rs`): the cumulative-work heap, a ban on
/// failure, fixed timeouts; a crash during the backward re-runs only that
/// stage at another peer of it, which recomputes the forward (SWARM's
/// backward is stateless: `swarm/pipeline/src/moe/client/balanced_expert.py`
/// keeps the inputs at the trainer and calls any peer of the stage again;
/// `swarm/pipeline/src/moe/server/expert_backend.py` recomputes the forward
/// inside the backward).
struct Swarm;

impl RoutingPolicy for Swarm {
    fn fixed_timeouts(&self) -> Option<(Time, Time)> {
        Some((
            super::balancer::FORWARD_TIMEOUT,
            super::balancer::BACKWARD_TIMEOUT,
        ))
    }
    fn reruns_before_the_gradient_is_due(&self) -> bool {
        false
    }
    fn drops_lost_contributions(&self) -> bool {
        true
    }
    fn acks_on_delivery(&self) -> bool {
        true
    }
    fn skips_failed_aggregation(&self) -> bool {
        true
    }
    fn next_hop_rule(&self) -> NextHopRule {
        NextHopRule::CumulativeWork
    }
}

/// SWARM-plus, this project's own stronger baseline (not SWARM): the next
/// hop with the smallest expected finish time, own outstanding work over
/// measured throughput (latency-aware); a crash restarts the microbatch
/// from its holder.
struct SwarmPlus;

impl RoutingPolicy for SwarmPlus {
    fn counts_queues(&self) -> bool {
        true
    }
    fn reruns_crashed_stage(&self) -> bool {
        false
    }
    fn next_hop_rule(&self) -> NextHopRule {
        NextHopRule::ShortestExpectedDelay
    }
}

/// SWARM as the GWTF paper's first author re-implemented it
/// (NikolayBlagoev/DecCom-Python, `swarmprotocol.py`; each rule's source
/// is cited in `balancer.rs`): direct hops between relays, the next hop of
/// the lowest measured delay, a fixed 20 s timeout after which the hop is
/// sent again from the relay that holds its input (the crashed stage alone
/// is run again), activations kept for the backward.
struct SwarmDeccom;

impl RoutingPolicy for SwarmDeccom {
    fn fixed_timeouts(&self) -> Option<(Time, Time)> {
        Some((
            super::balancer::DECCOM_TIMEOUT,
            super::balancer::DECCOM_TIMEOUT,
        ))
    }
    fn next_hop_rule(&self) -> NextHopRule {
        NextHopRule::LowestDelay
    }
}

/// Centrally planned (central-mcmf): the holders follow the paths
/// of `Input::SetPlan`, at most one microbatch in flight per path.
struct Planned;

impl RoutingPolicy for Planned {
    fn in_flight_limit(&self, max_in_flight: usize, plan: &[Arc<Vec<NodeId>>]) -> usize {
        if plan.is_empty() {
            max_in_flight
        } else {
            plan.len().min(max_in_flight)
        }
    }
    fn planned_path(&self, plan: &[Arc<Vec<NodeId>>], n: usize) -> Option<Arc<Vec<NodeId>>> {
        (!plan.is_empty()).then(|| plan[n % plan.len()].clone())
    }
}

/// The policy of `p`.
pub(super) fn routing_policy(p: Policy) -> &'static dyn RoutingPolicy {
    match p {
        Policy::Gwtf => &Gwtf,
        Policy::Swarm => &Swarm,
        Policy::SwarmPlus => &SwarmPlus,
        Policy::SwarmDeccom => &SwarmDeccom,
        Policy::CentralMcmf => &Planned,
    }
}

impl Node {
    /// Chooses the next hop of a microbatch; returns (node, label).
    pub(super) fn route(
        &mut self,
        mb: MbId,
        label: Option<Label>,
        hint: Option<NodeId>,
        plan: Option<&Arc<Vec<NodeId>>>,
        exclude: &[NodeId],
    ) -> Option<(NodeId, Option<Label>)> {
        if self.stage == self.s() {
            // The last stage sends back to the holder, but the reserved flow
            // is still in use: without this refresh a last-stage relay would
            // release every flow as idle `flow_idle_expiry_ticks` after it
            // was reserved, pushing it back all the way to the holder, which
            // then rebuilds it greedily and loses what local search had
            // gained (every flow was torn down about every two minutes).
            if let Some(l) = label {
                self.reservations.use_flow(l, self.now);
            }
            return Some((mb.holder, None));
        }
        if let Some(h) = hint {
            if self.is_candidate(h, exclude) {
                return Some((h, None));
            }
        }
        match self.policy().next_hop_rule() {
            NextHopRule::Cost => self.next_hop_by_cost(mb, label, plan, exclude),
            NextHopRule::ShortestExpectedDelay => self.next_hop_by_queue(exclude),
            NextHopRule::CumulativeWork => self.next_hop_by_cumulative_work(mb.holder, exclude),
            NextHopRule::LowestDelay => self.next_hop_by_lowest_delay(exclude),
        }
    }

    /// The routing policy this node runs.
    pub(super) fn policy(&self) -> &'static dyn RoutingPolicy {
        routing_policy(self.cfg.policy)
    }

    /// Whether `c` is a next hop candidate not in `exclude` (looked up
    /// alone; the whole list is built only where all are compared).
    fn is_candidate(&self, c: NodeId, exclude: &[NodeId]) -> bool {
        !exclude.contains(&c)
            && self
                .peers
                .get(&c)
                .is_some_and(|p| self.is_next_candidate(c, p))
    }

    /// SWARM-plus: the candidate with the smallest expected finish time.
    fn next_hop_by_queue(&self, exclude: &[NodeId]) -> Option<(NodeId, Option<Label>)> {
        let cands: Vec<NodeId> = self
            .next_candidates()
            .into_iter()
            .filter(|c| !exclude.contains(c))
            .collect();
        // Smallest expected finish time: queued work / throughput.
        let mut best: Option<(f64, NodeId)> = None;
        for c in cands {
            let p = &self.peers[&c];
            let thr = p.thr.unwrap_or(1.0 / p.compute_s.max(1e-6));
            let eta = (p.queued as f64 + 1.0) / thr.max(1e-9);
            if best.is_none_or(|b| eta < b.0) {
                best = Some((eta, c));
            }
        }
        best.map(|b| (b.1, None))
    }

    /// GWTF and planned: the planned next hop, else the reserved flow's, else
    /// the cheapest toward the holder by the gossiped costs.
    fn next_hop_by_cost(
        &mut self,
        mb: MbId,
        label: Option<Label>,
        plan: Option<&Arc<Vec<NodeId>>>,
        exclude: &[NodeId],
    ) -> Option<(NodeId, Option<Label>)> {
        if let Some(plan) = plan {
            let t = self.next_stage() as usize;
            if let Some(&n) = plan.get(t) {
                if self.is_candidate(n, exclude) {
                    return Some((n, None));
                }
            }
        }
        if let Some(l) = label {
            if let Some((n, o)) = self.reservations.use_flow(l, self.now) {
                if self.is_candidate(n, exclude) {
                    return Some((n, Some(o)));
                }
            } else if let Some((n, o)) = self.reservations.ghost(l) {
                if self.is_candidate(n, exclude) {
                    return Some((n, Some(o)));
                }
            }
        }
        // No reservation: the cheapest next hop toward the sink,
        // preferring peers with spare capacity.
        let mut best: Option<(f64, NodeId)> = None;
        for (&c, p) in self.peers.of_stage(self.next_stage()) {
            if !self.is_next_candidate(c, p) || exclude.contains(&c) {
                continue;
            }
            let lc = self.link_cost_to(p);
            // cost_via(c, holder), from the entry at hand.
            let mut v = match p.costs.get(mb.holder) {
                Some(x) => lc + x,
                None => INF,
            };
            if v >= INF {
                v = lc + 1e6;
            }
            if p.spare == 0 {
                v += 1e3;
            }
            if best.is_none_or(|b| v < b.0) {
                best = Some((v, c));
            }
        }
        best.map(|b| (b.1, None))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    #[test]
    fn the_policies_differ_where_the_trait_says() {
        let (g, s, p, w) = (
            routing_policy(Policy::Gwtf),
            routing_policy(Policy::SwarmPlus),
            routing_policy(Policy::CentralMcmf),
            routing_policy(Policy::Swarm),
        );
        let d = routing_policy(Policy::SwarmDeccom);
        assert!(matches!(w.next_hop_rule(), NextHopRule::CumulativeWork));
        assert!(matches!(d.next_hop_rule(), NextHopRule::LowestDelay));
        assert!(matches!(
            s.next_hop_rule(),
            NextHopRule::ShortestExpectedDelay
        ));
        assert!(d.fixed_timeouts() == Some((20 * SEC, 20 * SEC)) && d.reruns_crashed_stage());
        assert!(!d.acks_on_delivery() && !d.reserves_flows() && !d.counts_queues());
        assert!(!d.drops_lost_contributions() && !d.skips_failed_aggregation());
        assert!(w.drops_lost_contributions() && !s.drops_lost_contributions());
        assert!(w.acks_on_delivery() && !s.acks_on_delivery());
        assert!(w.skips_failed_aggregation() && !s.skips_failed_aggregation());
        assert!(!g.skips_failed_aggregation() && !p.skips_failed_aggregation());
        assert!(!g.acks_on_delivery() && !p.acks_on_delivery());
        assert!(!g.drops_lost_contributions() && !p.drops_lost_contributions());
        assert!(w.fixed_timeouts() == Some((30 * SEC, 75 * SEC)) && s.fixed_timeouts().is_none());
        assert!(w.reruns_crashed_stage() && !w.reruns_before_the_gradient_is_due());
        assert!(g.reruns_before_the_gradient_is_due() && !w.reserves_flows());
        assert!(g.reserves_flows() && !s.reserves_flows() && !p.reserves_flows());
        assert!(s.counts_queues() && !g.counts_queues() && !p.counts_queues());
        assert!(g.reruns_crashed_stage() && p.reruns_crashed_stage() && !s.reruns_crashed_stage());
        let plan = vec![Arc::new(vec![1]), Arc::new(vec![2])];
        assert_eq!(p.in_flight_limit(4, &plan), 2);
        assert_eq!(p.in_flight_limit(4, &[]), 4);
        assert_eq!(g.in_flight_limit(4, &plan), 4);
        assert_eq!(p.planned_path(&plan, 3), Some(plan[1].clone()));
        assert_eq!(g.planned_path(&plan, 3), None);
    }

    /// SWARM-plus sends to the next hop that finishes first (fewest queued at
    /// equal throughput); GWTF follows the reserved flow, and another next hop when
    /// the flow's is excluded; the last stage sends back to the holder.
    #[test]
    fn each_policy_picks_its_next_hop() {
        let m = mb(0, 0, 0);
        let mut n = started(Policy::SwarmPlus, 10, 2, &[], &[(30, 3), (31, 3)]);
        n.peers.get_mut(&30).unwrap().queued = 3;
        assert_eq!(n.route(m, None, None, None, &[]), Some((31, None)));
        n.peers.get_mut(&31).unwrap().queued = 5;
        assert_eq!(n.route(m, None, None, None, &[]), Some((30, None)));
        assert_eq!(n.route(m, None, Some(31), None, &[]), Some((31, None)));

        let mut n = started(Policy::Gwtf, 10, 2, &[], &[(30, 3), (31, 3)]);
        n.test_add_flow(7, 0, 20, 31, 99);
        assert_eq!(n.route(m, Some(7), None, None, &[]), Some((31, Some(99))));
        assert_eq!(n.route(m, Some(7), None, None, &[31]), Some((30, None)));

        let mut n = started(Policy::Gwtf, 40, 4, &[], &[(0, 0)]);
        assert_eq!(n.route(m, None, None, None, &[]), Some((0, None)));
    }
}
