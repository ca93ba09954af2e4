//! Local search between same-stage relays (GWTF): simulated annealing
//! over swaps and redirects of reserved flows (QUERY_FLOWS, FLOW_TABLE,
//! PROPOSE_SWAP, PROPOSE_REDIRECT and their answers).
use super::*;

/// The simulated annealing of the local search (GWTF).
#[derive(Debug, Default)]
pub(super) struct LocalSearch {
    /// The temperature.
    pub(super) sa_temp: f64,
    /// Peers that refused a proposal, skipped for `sa_skip_attempts` rounds.
    pub(super) sa_skip: BTreeMap<NodeId, u32>,
    /// A proposal of ours is out until then (no other starts meanwhile).
    pub(super) sa_busy_until: Time,
}

impl Node {
    /// Tells `next` that the segment it receives on `out_label` now comes
    /// from this node (a swap or redirect moved it here).
    fn notify_switch(&mut self, next: NodeId, out_label: Label) {
        let new_prev = self.id;
        let msg = Msg::NotifySwitch {
            label: out_label,
            new_prev,
        };
        self.send(next, msg);
    }

    pub(super) fn flow_info(&self, f: &FlowEntry) -> FlowInfo {
        FlowInfo {
            in_label: f.in_label,
            sink: f.sink,
            prev: f.prev,
            next: f.next,
            out_label: f.out_label,
            cost_from_source: f.cost_from_source,
            cost_to_sink: self.cost_via(f.next, f.sink),
        }
    }

    pub(super) fn flow_infos(&self) -> Vec<FlowInfo> {
        self.reservations
            .flows
            .values()
            .map(|f| self.flow_info(f))
            .collect()
    }

    pub(super) fn local_search(&mut self) {
        if self.stage == 0
            || self.reservations.flows.is_empty()
            || self.search.sa_busy_until > self.now
        {
            return;
        }
        // A random one of the candidates: the members, in id order, but
        // this node, those known dead and those skipped. The excluded ones
        // are few (a stage group can hold thousands): find their positions
        // in the member list and index around them.
        let list = self.group.members.list();
        let mut out: Vec<usize> = list.binary_search(&self.id).ok().into_iter().collect();
        for (id, p) in &self.peers {
            if p.dead {
                out.extend(list.binary_search(id).ok());
            }
        }
        for (id, &v) in &self.search.sa_skip {
            if v != 0 {
                out.extend(list.binary_search(id).ok());
            }
        }
        out.sort_unstable();
        out.dedup();
        let cands = list.len() - out.len();
        for v in self.search.sa_skip.values_mut() {
            *v = v.saturating_sub(1);
        }
        if cands == 0 {
            return;
        }
        // The r-th member not excluded.
        let mut at = self.rng.below(cands as u64) as usize;
        for &x in &out {
            if x > at {
                break;
            }
            at += 1;
        }
        let b = list[at];
        self.search.sa_busy_until = self.now + self.cfg.gossip_ticks as Time * self.cfg.tick;
        self.send(b, Msg::QueryFlows);
    }

    pub(super) fn accept_move(&mut self, old: f64, new: f64, temperature: f64) -> bool {
        if new < old - 1e-9 {
            return true;
        }
        let gain = (old - new) / self.cfg.cost_unit_s;
        let t = temperature.max(1e-6);
        self.rng.next_f64() < (gain / t).exp()
    }

    pub(super) fn on_flow_table(&mut self, from: NodeId, spare: u32, flows: Vec<FlowInfo>) {
        let _ = spare;
        // Best swap: my flow f and its flow g to the same sink.
        let mut best: Option<(f64, Msg)> = None;
        for f in self.reservations.flows.values() {
            let fi = self.flow_info(f);
            let f_full = fi.cost_from_source + fi.cost_to_sink;
            for g in &flows {
                if g.sink != f.sink || g.next == f.next {
                    continue;
                }
                let g_full = g.cost_from_source + g.cost_to_sink;
                let old_max = f_full.max(g_full);
                let f_new = f.cost_from_source + self.cost_via(g.next, f.sink);
                if f_new >= INF {
                    continue;
                }
                let score = f_new - old_max;
                if score < 0.0 && best.as_ref().is_none_or(|b| score < b.0) {
                    best = Some((
                        score,
                        Msg::ProposeSwap {
                            mine: fi.clone(),
                            yours: g.in_label,
                            mine_new_cost: f_new,
                            temperature: self.search.sa_temp,
                        },
                    ));
                }
            }
        }
        // Redirect: take over its worst flow when I have spare capacity.
        if best.is_none() && self.spare() > 0 {
            for g in &flows {
                if !self.peers.contains_key(&g.prev) && g.prev != self.id {
                    continue;
                }
                if g.prev == self.id {
                    continue;
                }
                // The segment prev -> me -> next for one more flow here.
                let mine = self.loaded_link_cost(g.prev, false)
                    + self.loaded_link_cost(g.next, false)
                    - self.compute_s
                    + self.gpu_queue_s(false);
                let via_next = if self.stage == self.s() {
                    0.0
                } else {
                    match self.peers.get(&g.next).and_then(|p| p.costs.get(g.sink)) {
                        Some(c) => c,
                        None => continue,
                    }
                };
                let new_total = g.cost_from_source - 0.0 + mine + via_next;
                let old_total = g.cost_from_source + g.cost_to_sink;
                let score = new_total - old_total;
                if score < 0.0 && best.as_ref().is_none_or(|b| score < b.0) {
                    best = Some((
                        score,
                        Msg::ProposeRedirect {
                            yours: g.in_label,
                            new_cost: mine,
                            temperature: self.search.sa_temp,
                        },
                    ));
                }
            }
        }
        match best {
            Some((_, m)) => self.send(from, m),
            None => self.search.sa_busy_until = self.now,
        }
    }

    pub(super) fn on_propose_swap(
        &mut self,
        from: NodeId,
        mine: FlowInfo,
        yours: Label,
        mine_new_cost: f64,
        temperature: f64,
    ) {
        let reject = |me: &mut Node| {
            me.send(
                from,
                Msg::RespondSwap {
                    accept: false,
                    mine: mine.in_label,
                    yours: None,
                },
            )
        };
        // Two concurrent moves between the same peers would undo each
        // other: while busy with its own move, a node only yields to a
        // smaller id.
        if self.search.sa_busy_until > self.now && from > self.id {
            return reject(self);
        }
        let Some(g) = self.reservations.flows.get(&yours).cloned() else {
            return reject(self);
        };
        if g.sink != mine.sink || g.next == mine.next {
            return reject(self);
        }
        let gi = self.flow_info(&g);
        let g_old = gi.cost_from_source + gi.cost_to_sink;
        let g_new = g.cost_from_source + self.cost_via(mine.next, g.sink);
        if g_new >= INF {
            return reject(self);
        }
        let old_max = g_old.max(mine.cost_from_source + mine.cost_to_sink);
        let new_max = g_new.max(mine_new_cost);
        if !self.accept_move(old_max, new_max, temperature) {
            return reject(self);
        }
        // Take the proposer's downstream segment.
        self.reservations
            .switch_downstream(yours, mine.next, mine.out_label);
        self.notify_switch(mine.next, mine.out_label);
        self.send(
            from,
            Msg::RespondSwap {
                accept: true,
                mine: mine.in_label,
                yours: Some(gi),
            },
        );
    }

    pub(super) fn on_respond_swap(
        &mut self,
        from: NodeId,
        accept: bool,
        mine: Label,
        yours: Option<FlowInfo>,
    ) {
        self.search.sa_busy_until = self.now;
        if !accept {
            self.search.sa_skip.insert(from, self.cfg.sa_skip_attempts);
            return;
        }
        let Some(g) = yours else { return };
        if self
            .reservations
            .flows
            .get(&mine)
            .is_some_and(|f| f.next != g.next)
        {
            self.reservations
                .switch_downstream(mine, g.next, g.out_label);
            self.notify_switch(g.next, g.out_label);
            self.search.sa_temp *= self.cfg.sa_cooling;
        }
    }

    pub(super) fn on_propose_redirect(
        &mut self,
        from: NodeId,
        yours: Label,
        new_cost: f64,
        temperature: f64,
    ) {
        let reject = |me: &mut Node| {
            let refusal = Msg::RespondRedirect {
                accept: false,
                flow: None,
            };
            me.send(from, refusal)
        };
        let busy = self.search.sa_busy_until > self.now && from > self.id;
        let Some(g) = self
            .reservations
            .flows
            .get(&yours)
            .cloned()
            .filter(|_| !busy)
        else {
            return reject(self);
        };
        // The segment prev -> me -> next of a flow already here.
        let old = self.loaded_link_cost(g.prev, true) + self.loaded_link_cost(g.next, true)
            - self.compute_s
            + self.gpu_queue_s(true);
        if !self.accept_move(old, new_cost, temperature) {
            return reject(self);
        }
        let gi = self.flow_info(&g);
        self.reservations.flows.remove(&yours);
        self.reservations.out_index.remove(&g.out_label);
        self.reservations
            .ghosts
            .insert(g.in_label, (g.next, g.out_label));
        self.send(
            from,
            Msg::RespondRedirect {
                accept: true,
                flow: Some(gi),
            },
        );
    }

    pub(super) fn on_respond_redirect(
        &mut self,
        from: NodeId,
        accept: bool,
        flow: Option<FlowInfo>,
    ) {
        self.search.sa_busy_until = self.now;
        let Some(g) = flow.filter(|_| accept) else {
            self.search.sa_skip.insert(from, self.cfg.sa_skip_attempts);
            return;
        };
        self.insert_flow(FlowEntry {
            in_label: g.in_label,
            sink: g.sink,
            prev: g.prev,
            next: g.next,
            out_label: g.out_label,
            cost_from_source: g.cost_from_source,
            last_used: self.now,
        });
        self.send(
            g.prev,
            Msg::NotifyRedirect {
                label: g.in_label,
                new_next: self.id,
            },
        );
        self.notify_switch(g.next, g.out_label);
        self.search.sa_temp *= self.cfg.sa_cooling;
    }

    /// QUERY_FLOWS: answers with this node's flow table.
    pub(super) fn on_query_flows(&mut self, from: NodeId) {
        let flows = self.flow_infos();
        let spare = self.spare();
        self.send(from, Msg::FlowTable { spare, flows });
    }
}
