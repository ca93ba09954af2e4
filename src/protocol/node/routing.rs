//! The next hop of one microbatch.
use super::*;

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
            if let Some(f) = label.and_then(|l| self.flows.get_mut(&l)) {
                f.last_used = self.now;
            }
            return Some((mb.holder, None));
        }
        // Candidates: next hops not excluded (looked up one by one; the
        // whole list is built only where all of them are compared).
        let is_cand = |me: &Node, c: NodeId| {
            !exclude.contains(&c) && me.peers.get(&c).is_some_and(|p| me.is_next_candidate(c, p))
        };
        if let Some(h) = hint {
            if is_cand(self, h) {
                return Some((h, None));
            }
        }
        match self.cfg.policy {
            Policy::Swarm => {
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
            Policy::Optimal | Policy::Gwtf => {
                if let Some(plan) = plan {
                    let t = self.next_stage() as usize;
                    if let Some(&n) = plan.get(t) {
                        if is_cand(self, n) {
                            return Some((n, None));
                        }
                    }
                }
                if let Some(l) = label {
                    if let Some(f) = self.flows.get_mut(&l) {
                        f.last_used = self.now;
                        let (n, o) = (f.next, f.out_label);
                        if is_cand(self, n) {
                            return Some((n, Some(o)));
                        }
                    } else if let Some(&(n, o)) = self.ghosts.get(&l) {
                        if is_cand(self, n) {
                            return Some((n, Some(o)));
                        }
                    }
                }
                // No reservation: the cheapest next hop toward the sink,
                // preferring peers with spare capacity.
                let mut best: Option<(f64, NodeId)> = None;
                for (&c, p) in &self.peers {
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
    }
}
