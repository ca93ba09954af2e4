//! Local search between same-stage relays (GWTF): simulated annealing
//! over swaps and redirects of reserved flows (QUERY_FLOWS, FLOW_TABLE,
//! PROPOSE_SWAP, PROPOSE_REDIRECT and their answers).
use super::*;

/// The simulated annealing of the local search (GWTF).
#[derive(Debug, Default)]
pub(super) struct LocalSearch {
    /// The temperature.
    sa_temp: f64,
    /// Peers that refused a proposal, skipped for `sa_skip_attempts` rounds.
    sa_skip: BTreeMap<NodeId, u32>,
    /// A proposal of ours is out until then (no other starts meanwhile).
    sa_busy_until: Time,
}

impl LocalSearch {
    /// A search that has proposed nothing yet, at temperature `temp`.
    pub(super) fn starting_at(temp: f64) -> LocalSearch {
        LocalSearch {
            sa_temp: temp,
            ..Default::default()
        }
    }
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

    /// A flow table entry; `links`: [`Node::all_link_flows`].
    fn flow_info_with(&self, f: &FlowEntry, links: &BTreeMap<NodeId, u32>) -> FlowInfo {
        FlowInfo {
            in_label: f.in_label(),
            sink: f.sink(),
            prev: f.prev(),
            next: f.next(),
            out_label: f.out_label(),
            cost_from_source: f.cost_from_source(),
            cost_to_sink: self.cost_via(f.next(), f.sink()),
            segment: self.segment_cost_with(f.prev(), f.next(), links, true),
        }
    }

    pub(super) fn flow_info(&self, f: &FlowEntry) -> FlowInfo {
        self.flow_info_with(f, &self.all_link_flows())
    }

    /// The cost of the segment `prev` -> this node -> `next` of a flow: both
    /// hops loaded with the other flows on their links, this node's GPU
    /// queue, its compute counted once (each hop's cost holds half of it).
    /// `existing`: for a flow already here (else for one more).
    pub(super) fn segment_cost(&self, prev: NodeId, next: NodeId, existing: bool) -> f64 {
        self.segment_cost_with(prev, next, &self.all_link_flows(), existing)
    }

    /// [`Node::segment_cost`] with the flows on each link counted once
    /// ([`Node::all_link_flows`]) for a whole table.
    fn segment_cost_with(
        &self,
        prev: NodeId,
        next: NodeId,
        links: &BTreeMap<NodeId, u32>,
        existing: bool,
    ) -> f64 {
        let on = |j: NodeId| links.get(&j).copied().unwrap_or(0);
        self.loaded_link_cost_with(prev, on(prev), existing)
            + self.loaded_link_cost_with(next, on(next), existing)
            - self.compute_s
            + self.gpu_queue_s(existing)
    }

    pub(super) fn flow_infos(&self) -> Vec<FlowInfo> {
        let links = self.all_link_flows();
        self.reservations
            .flows()
            .values()
            .map(|f| self.flow_info_with(f, &links))
            .collect()
    }

    pub(super) fn local_search(&mut self) {
        // A relay without flows searches too while it has room: it is the
        // one that can take a flow over from a loaded peer (a redirect).
        if self.stage == 0
            || (self.reservations.flows().is_empty() && self.spare() == 0)
            || self.search.sa_busy_until > self.now
        {
            return;
        }
        // A random one of the candidates: the members, in id order, but
        // this node, those known dead and those skipped. The excluded ones
        // are few (a stage group can hold thousands): find their positions
        // in the member list and index around them.
        let list = self.group.member_list();
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
        let links = self.all_link_flows();
        for f in self.reservations.flows().values() {
            let fi = self.flow_info_with(f, &links);
            let f_full = fi.cost_from_source + fi.cost_to_sink;
            for g in &flows {
                if g.sink != f.sink() || g.next == f.next() {
                    continue;
                }
                let g_full = g.cost_from_source + g.cost_to_sink;
                let old_max = f_full.max(g_full);
                let f_new = f.cost_from_source() + self.cost_via(g.next, f.sink());
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
        // Redirect: take over the flow whose segment this node would carry
        // cheapest against its owner, when it has room (a swap only trades
        // next hops; only a redirect moves load between same-stage relays).
        if self.spare() > 0 {
            for g in &flows {
                if !self.peers.contains_key(&g.prev) && g.prev != self.id {
                    continue;
                }
                if g.prev == self.id {
                    continue;
                }
                // The segment prev -> me -> next for one more flow here,
                // against the owner's for the flow (the rest of the path
                // is the same: `next` stays).
                let mine = self.segment_cost_with(g.prev, g.next, &links, false);
                if self.stage != self.s()
                    && self
                        .peers
                        .get(&g.next)
                        .and_then(|p| p.costs.get(g.sink))
                        .is_none()
                {
                    continue;
                }
                let score = mine - g.segment;
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
        let Some(g) = self.reservations.flows().get(&yours).cloned() else {
            return reject(self);
        };
        if g.sink() != mine.sink || g.next() == mine.next {
            return reject(self);
        }
        let gi = self.flow_info(&g);
        let g_old = gi.cost_from_source + gi.cost_to_sink;
        let g_new = g.cost_from_source() + self.cost_via(mine.next, g.sink());
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
            .flows()
            .get(&mine)
            .is_some_and(|f| f.next() != g.next)
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
            .flows()
            .get(&yours)
            .cloned()
            .filter(|_| !busy)
        else {
            return reject(self);
        };
        // The segment prev -> me -> next of a flow already here.
        let old = self.segment_cost(g.prev(), g.next(), true);
        if !self.accept_move(old, new_cost, temperature) {
            return reject(self);
        }
        let gi = self.flow_info(&g);
        self.reservations.redirect_away(yours);
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
        let now = self.now;
        self.insert_flow(FlowEntry::new(
            g.in_label,
            g.sink,
            g.prev,
            g.next,
            g.out_label,
            g.cost_from_source,
            now,
        ));
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

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// Relay `id` of stage 2 (compute 0.5 s) in a group with `other`; its
    /// links to 20 (stage 1) and 30 (stage 3) take 10 ms + 1 s per 1 MiB
    /// activation, 30 costs 1.0 to sink 0; `flows` flows of sink 0 go
    /// 20 -> it -> 30. GPU load weight 0.5, link load weight 0 (the
    /// segments then differ by the GPU queue only).
    fn relay(id: NodeId, other: NodeId, flows: u64) -> Node {
        let mut cfg = Config::new(Policy::Gwtf, 4, 1 << 20);
        cfg.gpu_load_weight = 0.5;
        cfg.link_load_weight = 0.0;
        let mut n = Node::new(Arc::new(cfg), id, 2, 0.5, 8, 1);
        n.handle(
            SEC,
            Input::Start {
                peers: vec![(other, 2), (20, 1), (30, 3)],
            },
        );
        for j in [20, 30] {
            let p = n.peers.get_mut(&j).unwrap();
            p.lat = Some(0.01);
            p.bw = Some((1 << 20) as f64);
            p.compute_s = 0.5;
            p.spare = 4;
            if j == 30 {
                p.costs = SinkCosts::from_gossip(Arc::new([(0, 1.0)]));
            }
        }
        for l in 0..flows {
            n.test_add_flow(l + 1, 0, 20, 30, 100 + l);
        }
        n
    }

    /// The messages among `actions`.
    fn messages(actions: Vec<Action>) -> Vec<(NodeId, Msg)> {
        actions
            .into_iter()
            .filter_map(|a| match a {
                Action::Send { to, msg } => Some((to, msg)),
                _ => None,
            })
            .collect()
    }

    /// The one message among `actions`, to `to`.
    fn only_to(actions: Vec<Action>, to: NodeId) -> Msg {
        let mut m = messages(actions);
        assert_eq!(m.len(), 1, "{m:?}");
        let (t, msg) = m.pop().unwrap();
        assert_eq!(t, to);
        msg
    }

    /// What `n` sent from a call made outside `handle`.
    fn sent(n: &mut Node) -> Vec<Action> {
        std::mem::take(&mut n.out)
    }

    fn flow_table_of(b: &mut Node, asker: NodeId) -> Msg {
        only_to(deliver(b, asker, Msg::QueryFlows), asker)
    }

    /// An idle relay takes a flow over from a loaded peer of its stage:
    /// both reach 20 and 30 alike, so the segment 20 -> relay -> 30 differs
    /// by the GPU queue only: 0.5 x 0.5 s x 2 other flows = 0.5 s at the
    /// owner of 3 flows, 0 at the idle one. The idle relay searches (it has
    /// room), proposes the redirect with its segment (1.51 + 1.51 - 0.5),
    /// the owner gives the flow up, and the taker tells 20 (the new next
    /// hop) and 30 (the new previous). Before, an idle relay never searched,
    /// and a proposer counted the hop from 20 twice (it never proposed).
    #[test]
    fn an_idle_relay_takes_a_flow_over_from_a_loaded_peer() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let mut owner = relay(10, 11, 3);
        let mut idle = relay(11, 10, 0);
        assert!(close(
            owner.segment_cost(20, 30, true),
            1.51 + 1.51 - 0.5 + 0.5
        ));
        assert!(close(idle.segment_cost(20, 30, false), 1.51 + 1.51 - 0.5));
        sent(&mut idle);
        idle.local_search();
        assert!(matches!(only_to(sent(&mut idle), 10), Msg::QueryFlows));
        let Msg::FlowTable { spare, flows } = flow_table_of(&mut owner, 11) else {
            panic!("no flow table")
        };
        assert_eq!(flows.len(), 3);
        assert!(flows.iter().all(|f| close(f.segment, 3.02)));
        idle.on_flow_table(10, spare, flows);
        let proposal = only_to(sent(&mut idle), 10);
        let Msg::ProposeRedirect { new_cost, .. } = proposal else {
            panic!("{proposal:?}")
        };
        assert!(close(new_cost, 2.52), "{new_cost}");
        let answer = only_to(deliver(&mut owner, 11, proposal), 11);
        assert!(matches!(answer, Msg::RespondRedirect { accept: true, .. }));
        assert_eq!(owner.reservations.flows().len(), 2);
        let told: Vec<(NodeId, &'static str)> = messages(deliver(&mut idle, 10, answer))
            .iter()
            .map(|(t, m)| (*t, m.name()))
            .collect();
        assert_eq!(idle.reservations.flows().len(), 1);
        assert_eq!(told, vec![(20, "NotifyRedirect"), (30, "NotifySwitch")]);
    }

    /// No redirect when it gains nothing: the owner carries one flow (no
    /// queue behind it), or the would-be taker is farther from the flow's
    /// previous hop than its queue saves (link to 20 0.6 s slower).
    #[test]
    fn no_redirect_without_a_gain() {
        let mut owner = relay(10, 11, 1);
        let mut idle = relay(11, 10, 0);
        let Msg::FlowTable { spare, flows } = flow_table_of(&mut owner, 11) else {
            panic!("no flow table")
        };
        sent(&mut idle);
        idle.on_flow_table(10, spare, flows);
        assert!(messages(sent(&mut idle)).is_empty());
        let mut owner = relay(10, 11, 3);
        idle.peers.get_mut(&20).unwrap().lat = Some(0.61);
        let Msg::FlowTable { spare, flows } = flow_table_of(&mut owner, 11) else {
            panic!("no flow table")
        };
        idle.on_flow_table(10, spare, flows);
        assert!(messages(sent(&mut idle)).is_empty());
    }
}
