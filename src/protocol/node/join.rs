//! Start and join: a starting node becomes active at once; a joining node
//! asks each stage for a summary, picks the bottleneck stage, downloads its
//! state from a member and joins its group.
use super::*;

/// Join: what a joining node learns, and whom a member served.
#[derive(Debug, Default)]
pub(super) struct JoinState {
    /// The stages' summaries (a joining node chooses from them).
    stage_infos: BTreeMap<Stage, StageSummary>,
    /// Nodes this node sent its stage state to (when), not yet seen as
    /// members: told to later joiners with the member list, so that two
    /// joiners whose only live contact dies meanwhile still find each other.
    joiners: BTreeMap<NodeId, Time>,
    /// When a joiner that takes every relay peer for dead asks them all
    /// again.
    redial_at: Time,
    /// Since when a data holder downloading the holders' state has known
    /// no live holder to download it from (see [`Node::holder_stranded`]).
    no_source_since: Option<Time>,
    /// A node of a stage (stage, updates, node) known to hold weights with
    /// more updates than this node's group had when it fenced itself
    /// ([`FenceReason::Behind`]): that stage's state is downloaded from it,
    /// and an older one is refused while it lives.
    newer: Option<(Stage, u32, NodeId)>,
    /// The weights this node held when it fenced itself, whole and not
    /// known wrong: (stage, updates, version). The trainer keeps them until
    /// a state is imported; they are served again only when the stage's
    /// members hold fewer updates and none can serve a newer state (its
    /// last holders of an update were all fenced), see
    /// [`Node::source_behind`].
    kept: Option<(Stage, u32, (u32, u64))>,
}

impl JoinState {
    /// A fenced node of `stage` starts joining again, holding `kept` (see
    /// the field) and, when it fenced itself for being behind, knowing
    /// `newer`: a node of its stage with more updates.
    pub(super) fn fenced(
        &mut self,
        kept: Option<(Stage, u32, (u32, u64))>,
        newer: Option<(Stage, u32, NodeId)>,
    ) {
        self.kept = kept;
        if newer.is_some() {
            self.newer = newer;
        }
    }

    /// The weights kept at the fence: (stage, updates, version).
    pub(super) fn kept(&self) -> Option<(Stage, u32, (u32, u64))> {
        self.kept
    }

    /// The runtime's weights are not those kept: never served again.
    pub(super) fn forget_kept(&mut self) {
        self.kept = None;
    }

    /// The node of `stage` known to hold more updates than this node's
    /// group had at its fence.
    pub(super) fn newer_in(&self, stage: Stage) -> Option<NodeId> {
        self.newer.filter(|n| n.0 == stage).map(|n| n.2)
    }

    /// Whether this node sent its state to `id` less than `expiry` before
    /// `now` (a joiner not yet seen as a member).
    pub(super) fn recently_served(&self, id: &NodeId, now: Time, expiry: Time) -> bool {
        self.joiners.get(id).is_some_and(|&t| t + expiry > now)
    }

    /// The stages' summaries a joining node chooses from.
    pub(super) fn stage_infos(&self) -> &BTreeMap<Stage, StageSummary> {
        &self.stage_infos
    }
}

impl Node {
    pub(super) fn start(&mut self, peers: Vec<(NodeId, Stage)>) {
        if let Some(a) = self.cfg.resume_from {
            // Resumed from a checkpoint: every founding member of a stage
            // holds the same weights, under the same version.
            self.iters
                .downloaded((a, mix(u64::MAX - 2, mix(a as u64, self.stage as u64))));
            self.iters.hear_next(a + 1, false);
        }
        let mut group = Vec::new();
        for (p, s) in peers {
            if s == self.stage {
                group.push(p);
            } else if p != self.id {
                self.learn(p, s);
            }
        }
        self.group.adopt(group, self.id);
        self.become_active();
        if self.stage == 0 {
            // The holders' coordinator opens the first iteration after the
            // start delay (flows are being built meanwhile).
            self.next_tick = self.now + self.cfg.tick;
        }
    }

    pub(super) fn become_active(&mut self) {
        self.phase = Phase::Active;
        self.last_heard_any = self.now;
        self.next_tick = self.now + self.cfg.tick;
        self.recompute_coord();
        self.introduce_all(None);
        // The ring's order needs the links among members: a joiner's (and
        // the first iteration's) are measured now, not a cycle later.
        self.measure_group_links();
        if let Some(c) = self.group.coord() {
            if c != self.id {
                let (stage, incarnation) = (self.stage, self.incarnation);
                self.send(c, Msg::GroupJoin { stage, incarnation });
            }
        }
        let st = self.stage;
        self.event(Event::Active { stage: st });
    }

    pub(super) fn join(&mut self, peers: Vec<(NodeId, Stage)>) {
        for (p, s) in peers {
            if p != self.id {
                self.learn(p, s);
            }
        }
        self.phase = Phase::Querying { since: self.now };
        self.next_tick = self.now + self.cfg.tick;
        self.query_stages();
    }

    /// Asks up to two live peers of every relay stage for its summary.
    fn query_stages(&mut self) {
        let targets: Vec<NodeId> = {
            let mut per: BTreeMap<Stage, Vec<NodeId>> = BTreeMap::new();
            for (id, p) in &self.peers {
                if p.stage > 0 && !p.dead {
                    let v = per.entry(p.stage).or_default();
                    if v.len() < 2 {
                        v.push(*id);
                    }
                }
            }
            per.into_values().flatten().collect()
        };
        for t in targets {
            self.send(t, Msg::StageQuery);
        }
    }

    /// A joiner that takes every relay peer for dead was most likely the
    /// one cut off (its own connections failed while its link was down):
    /// every suspicion period or two it gives them all another chance, so
    /// it comes back once the link does instead of waiting for ever.
    fn redial_if_all_dead(&mut self) {
        let any_live = self.peers.iter().any(|(_, p)| p.stage > 0 && !p.dead);
        if any_live || self.now < self.joining.redial_at {
            return;
        }
        self.joining.redial_at = self.now + 2 * self.suspicion();
        self.peers.retain(|_, p| {
            p.dead = false;
            true
        });
    }

    pub(super) fn choose_stage(&mut self) {
        // A stage its neighbours know empty first: training waits for it.
        let since = match self.phase {
            Phase::Querying { since } => since,
            _ => self.now,
        };
        let infos = &self.joining.stage_infos;
        let empty = infos
            .values()
            .flat_map(|i| i.empty_neighbors.iter().copied())
            .filter(|s| (1..=self.s()).contains(s) && !infos.contains_key(s))
            .filter(|&s| {
                self.cfg.restart_empty_stages || !self.peers.of_stage(s).any(|(_, p)| !p.dead)
            })
            .min();
        if let Some(stage) = empty.filter(|_| self.cfg.restart_empty_stages) {
            // Nodes of it this joiner knows of (a directory's entries of
            // nodes dead since) that did not answer its query: taken for
            // gone after a suspicion period, as its neighbours took them;
            // meanwhile asked again (a slow answer stands).
            let silent: Vec<NodeId> = (self.peers.of_stage(stage))
                .filter(|(_, p)| !p.dead)
                .map(|(id, _)| *id)
                .collect();
            if !silent.is_empty() && self.now < since + self.suspicion() {
                for p in silent {
                    self.send(p, Msg::StageQuery);
                }
                return;
            }
            // The iteration in progress: none is final while a stage is
            // empty, so none opens after it; what the members know of it
            // only lags.
            let next = infos.values().map(|i| i.open_iter).max().unwrap_or(0);
            self.restore_stage(stage, next);
            return;
        }
        // A relay stage whose known nodes have not answered may have just
        // lost its last one (a directory names the nodes that died since;
        // the neighbours mark the stage empty only at their next tick): it
        // is waited for, for a suspicion period, asking every stage again
        // (a refreshed summary carries its neighbours' word), before the
        // bottleneck is taken among the stages that answered. Without
        // this, a joiner that came right after a stage's last node left
        // joined a stage that answered, and the empty one stayed empty.
        let unanswered = (1..=self.s()).any(|s| {
            !self.joining.stage_infos.contains_key(&s)
                && self.peers.of_stage(s).any(|(_, p)| !p.dead)
        });
        if unanswered && self.now < since + self.suspicion() {
            self.query_stages();
            return;
        }
        // Bottleneck first: the stage with the smallest aggregate throughput
        // (largest predicted time per microbatch) gains the most from us.
        let mut best: Option<(f64, Stage)> = None;
        for (s, info) in &self.joining.stage_infos {
            if info.members == 0 {
                continue;
            }
            let t = 1.0 / info.throughput.max(1e-9);
            if best.is_none_or(|b| t > b.0) {
                best = Some((t, *s));
            }
        }
        let Some((_, stage)) = best else {
            // Nobody answered (the peers asked may have died): ask the live
            // ones again, and choose at the next tick.
            self.phase = Phase::Querying { since: self.now };
            self.redial_if_all_dead();
            self.query_stages();
            return;
        };
        let src = self.newest_source(stage).or_else(|| {
            (self.peers.iter())
                .filter(|(_, p)| p.stage == stage && !p.dead)
                .map(|(id, _)| *id)
                .next()
        });
        match src {
            Some(src) => {
                self.stage = stage;
                self.download(stage, src);
            }
            None => {
                self.phase = Phase::Querying { since: self.now };
                self.query_stages();
            }
        }
    }

    /// No live node holds `stage`'s state: this node serves it from the
    /// model's initial weights (its trainer is told so through
    /// [`Event::StageRestarted`]), as of iteration `next`. What the stage had
    /// of unfinished iterations is gone with its nodes: as a coordinator
    /// that took over from a dead one, it has what is missing at an
    /// iteration's end recomputed after a short grace.
    pub(super) fn restart_stage(&mut self, stage: Stage, next: u32) {
        // A version of its own: these weights descend from no update.
        self.serve_afresh(stage, next, u64::MAX, |stage, applied| {
            Event::StageRestarted { stage, applied }
        });
    }

    /// Serves `stage`, which no live node held, as of iteration `next`
    /// with weights that descend from no update (their version mixed from
    /// `salt`); `event` tells the trainer where they come from.
    pub(super) fn serve_afresh(
        &mut self,
        stage: Stage,
        next: u32,
        salt: u64,
        event: impl FnOnce(Stage, Option<u32>) -> Event,
    ) {
        self.stage = stage;
        let applied = next.checked_sub(1);
        if let Some(a) = applied {
            self.iters.downloaded((a, mix(salt, stage as u64)));
        }
        self.iters.hear_next(next, false);
        self.coordinating.inherit(self.now, next);
        self.group.adopt([], self.id);
        // Only the views that matter to this stage.
        let (ps, ns) = (self.prev_stage(), self.next_stage());
        self.peers
            .retain(|_, p| p.stage == ps || p.stage == ns || p.stage == stage);
        self.event(event(stage, applied));
        self.become_active();
    }

    /// The member this node downloads from answered that its weights miss
    /// an update (`updates`: what they hold; `coord`: its group's
    /// coordinator). When this node kept weights of that stage with more
    /// updates, and the answer comes from a coordinator (nobody in its
    /// group holds more) while no other live node of the stage is known,
    /// the stage's newest state is the one kept: this node serves it
    /// again ([`Event::StateKept`]), and the group behind finds it through
    /// its gap and downloads it. Otherwise another member is asked.
    pub(super) fn source_behind(&mut self, from: NodeId, coord: NodeId, updates: u32) {
        let Phase::Downloading { stage, .. } = self.phase else {
            return;
        };
        let others =
            (self.peers.of_stage(stage)).any(|(id, p)| !p.dead && *id != from && *id != self.id);
        match self.joining.kept {
            Some((st, kept, version))
                if st == stage && kept > updates && coord == from && !others =>
            {
                self.resume_kept(stage, version, 0)
            }
            _ => self.download_from_another(),
        }
    }

    /// Serves `stage` again with the weights kept at the fence (`version`),
    /// as a stage restarted from them: the iteration in progress is the
    /// latest any member told of (at least `next`), and what is missing of
    /// it is recomputed after a grace, as by a coordinator that took over.
    /// The weights keep their own version: a member of the stage that
    /// comes back with more updates is ahead of them, and they give way.
    pub(super) fn resume_kept(&mut self, stage: Stage, version: (u32, u64), next: u32) {
        self.joining.kept = None;
        self.stage = stage;
        let told = self
            .joining
            .stage_infos
            .get(&stage)
            .map_or(0, |i| i.open_iter);
        let next = (version.0 + 1)
            .max(told)
            .max(self.iters.known_iter())
            .max(next);
        self.iters.downloaded(version);
        self.iters.hear_next(next, false);
        self.coordinating.inherit(self.now, next);
        self.group.adopt([], self.id);
        self.event(Event::StateKept {
            stage,
            applied: version.0,
        });
        self.become_active();
    }

    pub(super) fn download(&mut self, stage: Stage, src: NodeId) {
        self.phase = Phase::Downloading {
            stage,
            src,
            since: self.now,
        };
        self.send(src, Msg::StateRequest);
    }

    /// A data holder that fenced itself downloads the holders' state from
    /// another holder; with no live holder known for `e2e_timeout` (the
    /// others finished the run and left, or are all gone) it cannot train
    /// on: [`Event::Stranded`], and it stops waiting (the runtime ends it
    /// with an error) instead of asking the same dead address for ever.
    pub(super) fn holder_stranded(&mut self) {
        let Phase::Downloading { stage: 0, .. } = self.phase else {
            return;
        };
        let any_live = (self.peers.iter()).any(|(id, p)| p.stage == 0 && !p.dead && *id != self.id);
        if any_live {
            self.joining.no_source_since = None;
            return;
        }
        let since = *self.joining.no_source_since.get_or_insert(self.now);
        if since + self.cfg.e2e_timeout <= self.now {
            self.phase = Phase::Idle;
            let waited = self.now - since;
            self.event(Event::Stranded { stage: 0, waited });
        }
    }

    /// The download's source died or did not answer: another live member of
    /// the stage serves it (or the stages are asked again).
    pub(super) fn download_from_another(&mut self) {
        let Phase::Downloading { stage, src, .. } = self.phase else {
            return;
        };
        if self.restoring.is_restoring() {
            // A kept copy: the next freshest offer, or a restart.
            self.restore_from_next_offer();
            return;
        }
        let next = self.newest_source(stage).filter(|&n| n != src).or_else(|| {
            (self.peers.iter())
                .filter(|(id, p)| p.stage == stage && !p.dead && **id != src)
                .map(|(id, _)| *id)
                .next()
        });
        match next {
            Some(n) => self.download(stage, n),
            // A data holder stays one (it holds the data): it asks the
            // holders it knows again rather than choose a relay stage.
            None if stage == 0 => {
                let again = (self.peers.iter())
                    .filter(|(id, p)| p.stage == 0 && !p.dead && **id != self.id)
                    .map(|(id, _)| *id)
                    .next()
                    .unwrap_or(src);
                self.download(0, again);
            }
            None => {
                // Nobody of that stage is left: choose again from fresh
                // summaries.
                self.joining.stage_infos.remove(&stage);
                self.phase = Phase::Querying { since: self.now };
                self.query_stages();
            }
        }
    }

    /// A joiner asks for this stage's summary.
    pub(super) fn on_stage_query(&mut self, from: NodeId) {
        if self.phase == Phase::Active && self.stage > 0 {
            let members = self.group.members().len() as u32;
            let summary = StageSummary {
                stage: self.stage,
                members,
                throughput: members as f64 / self.compute_s.max(1e-9),
                open_iter: self.iters.in_progress(),
                empty_neighbors: self.adjacent.empty_stages().collect(),
            };
            self.send(from, Msg::StageInfo { summary });
        }
    }

    /// A stage's summary, for a joining node choosing its stage.
    /// Several members of a stage may answer: the latest summary stands,
    /// but the iteration in progress is the largest any of them knows (a
    /// member only lags it, and a stage restarted too early would wait for
    /// updates that were made before it existed), and a neighbouring stage
    /// any of them knows empty stays empty (a member that joined after the
    /// stage emptied never saw its nodes, and does not know).
    pub(super) fn on_stage_info(&mut self, from: NodeId, mut summary: StageSummary) {
        self.learn(from, summary.stage);
        if let Some(old) = self.joining.stage_infos.get(&summary.stage) {
            summary.open_iter = summary.open_iter.max(old.open_iter);
            for s in &old.empty_neighbors {
                if !summary.empty_neighbors.contains(s) {
                    summary.empty_neighbors.push(*s);
                }
            }
        }
        self.joining.stage_infos.insert(summary.stage, summary);
    }

    /// A joiner downloads this stage's state (with the member list).
    pub(super) fn on_state_request(&mut self, from: NodeId) {
        if self.phase != Phase::Active {
            // Fenced or joining itself: its state is not the stage's. The
            // goodbye has the joiner ask another member at once.
            self.send(from, Msg::Goodbye);
            return;
        }
        if self.iters.gap() {
            // Its weights miss an update the stage applied: not the
            // stage's state. It says how many updates it holds instead
            // (as to a group ahead, `announce_gap`): the joiner asks
            // another member, or serves the newer weights it kept.
            let (coord, updates) = (self.group.coord().unwrap_or(self.id), self.iters.updates());
            let m = Msg::Heartbeat {
                members: None,
                coord,
                updates,
                version: self.iters.version().1,
            };
            self.send(from, m);
            return;
        }
        // The joiners served before (still downloading, or whose
        // GroupJoin may have reached nobody alive) go with the member
        // list: if every member this joiner hears of dies before it
        // is done, it still knows them and does not coordinate a
        // group of its own beside theirs (two groups of one stage
        // committing the same iterations). A download longer than
        // `e2e_timeout` is as good as gone.
        let now = self.now;
        let expiry = self.cfg.e2e_timeout;
        let joiners = std::mem::take(&mut self.joining.joiners);
        self.joining.joiners = joiners
            .into_iter()
            .filter(|&(j, t)| {
                t + expiry > now && !self.group.members().contains(&j) && self.alive(j)
            })
            .collect();
        let members = if self.joining.joiners.is_empty() {
            self.group.member_list()
        } else {
            let mut all: BTreeSet<NodeId> = self.group.members().iter().copied().collect();
            all.extend(self.joining.joiners.keys().copied());
            Arc::new(all.into_iter().collect())
        };
        self.joining.joiners.insert(from, now);
        let bytes = self.own_state_bytes();
        let version = self.iters.version();
        let coord = self.group.coord().unwrap_or(self.id);
        self.send(
            from,
            Msg::StateResponse {
                version,
                members,
                bytes,
                coord,
            },
        );
    }

    /// The state download is done: join the group.
    pub(super) fn on_state_response(
        &mut self,
        from: NodeId,
        version: (u32, u64),
        members: Arc<Vec<NodeId>>,
        coord: NodeId,
    ) {
        if let Phase::Rebuilding { .. } = self.phase {
            self.on_neighbour_state(from, version);
            return;
        }
        if self.phase == Phase::Active {
            // A member that missed an update downloaded the state again.
            self.iters.resynced(version);
            return;
        }
        if let Phase::Downloading { stage, src, .. } = self.phase {
            if self.restoring.is_restoring() {
                if from == src {
                    self.restored(from, version);
                }
                return;
            }
            let got = if version == (0, 0) { 0 } else { version.0 + 1 };
            if let Some((st, need, _)) = self.joining.newer {
                if st == stage && got < need {
                    // Older than weights known to exist: asked again of
                    // the node that holds them, while it lives.
                    if let Some(h) = self.newest_source(stage).filter(|&h| h != src) {
                        self.download(stage, h);
                        return;
                    }
                } else if st == stage {
                    self.joining.newer = None;
                }
            }
            self.iters.downloaded(version);
            // Members that joined us while we downloaded (a later
            // joiner that took us for its coordinator) stay.
            self.group.adopt(members.iter().copied(), self.id);
            // The group's coordinator stays while it lives: a joiner (a
            // fenced node coming back among them) follows it, whatever
            // its own id, instead of taking coordination over in the
            // middle of an iteration it knows nothing of.
            if coord != self.id && self.group.members().contains(&coord) && self.alive(coord) {
                self.group.follow(coord, self.now);
            }
            // Keep only the views that matter to this stage.
            let (ps, ns) = (self.prev_stage(), self.next_stage());
            self.peers
                .retain(|_, p| p.stage == ps || p.stage == ns || p.stage == stage);
            self.become_active();
            // Every member hears from the joiner, not only the coordinator:
            // one that took this node's goodbye (a fenced node coming back)
            // or lost its connection counts it out of every all-reduce it
            // starts until it hears from it again, and a joiner talks to
            // nobody else of its group. Its first commit would fail there,
            // and every commit after it, while the coordinator, which heard
            // the join, commits with it again and again. Every member the
            // state's server named is greeted, even one this node took for
            // dead: its own view is the stale one (it was paused, or cut
            // off, and lost its connections meanwhile).
            let incarnation = self.incarnation;
            let members: Vec<NodeId> = (self.group.members().iter().copied())
                .filter(|&m| m != self.id)
                .collect();
            for m in members {
                self.send(m, Msg::GroupJoin { stage, incarnation });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// A joiner asks the stages, then joins the bottleneck (the smallest
    /// throughput) and downloads its state from one of its members.
    #[test]
    fn a_joiner_picks_the_bottleneck_stage() {
        let mut n = Node::new(config(Policy::Gwtf), 50, 0, 0.5, 4, 1);
        let peers = vec![(11, 1), (21, 2), (31, 3), (41, 4)];
        let acts = n.handle(SEC, Input::Join { peers });
        assert_eq!(sends(&acts).len(), 4);
        for (from, stage, thr) in [(11, 1, 8.0), (21, 2, 2.0), (31, 3, 5.0), (41, 4, 3.0)] {
            let summary = StageSummary {
                stage,
                members: 2,
                throughput: thr,
                open_iter: 0,
                empty_neighbors: Vec::new(),
            };
            deliver(&mut n, from, Msg::StageInfo { summary });
        }
        let acts = n.on_timeout(3 * SEC);
        assert_eq!(n.stage(), 2);
        assert!(matches!(sends(&acts)[..], [(21, Msg::StateRequest)]));
        assert!(!n.is_active());
        let members = Arc::new(vec![21, 22]);
        let done = Msg::StateResponse {
            version: (3, 9),
            members,
            bytes: 0,
            coord: 21,
        };
        deliver(&mut n, 21, done);
        assert!(n.is_active());
        assert_eq!(n.version(), (3, 9));
        assert_eq!(n.coordinator(), Some(21));
    }

    /// A joiner whose every peer failed (its own link was down: a fenced
    /// node cut off) asks them all again after a while instead of waiting
    /// for ever, at most once per redial period.
    #[test]
    fn a_joiner_that_lost_every_peer_asks_them_again() {
        let mut n = Node::new(config(Policy::Gwtf), 50, 0, 0.5, 4, 1);
        let tick = n.cfg.tick;
        let period = 2 * n.suspicion();
        n.handle(
            SEC,
            Input::Join {
                peers: vec![(11, 1), (21, 2)],
            },
        );
        let lose_all = |n: &mut Node| {
            n.handle(n.now, Input::PeerLost { peer: 11 });
            n.handle(n.now, Input::PeerLost { peer: 21 });
        };
        let queried = |acts: &[Action]| -> Vec<NodeId> {
            sends(acts)
                .iter()
                .filter(|(_, m)| matches!(m, Msg::StageQuery))
                .map(|(to, _)| *to)
                .collect()
        };
        lose_all(&mut n);
        let mut t = SEC + tick;
        assert_eq!(queried(&n.on_timeout(t)), vec![11, 21]);
        let redialled = t;
        lose_all(&mut n);
        while t + tick < redialled + period {
            t += tick;
            assert!(
                queried(&n.on_timeout(t)).is_empty(),
                "asked before the period"
            );
        }
        t = redialled + period;
        assert_eq!(queried(&n.on_timeout(t)), vec![11, 21]);
    }

    /// A joiner (a fenced node coming back) greets every live member of
    /// its group, not only the coordinator: a member that took its goodbye
    /// counts it out of every all-reduce until it hears from it again (a
    /// CI run stood still 150 s so). The member admits it and keeps its
    /// coordinator.
    #[test]
    fn a_joiner_greets_every_member_of_its_group() {
        let mut j = Node::new(config(Policy::Gwtf), 11, 0, 0.5, 4, 1);
        j.handle(
            SEC,
            Input::Join {
                peers: vec![(12, 1), (13, 1), (14, 1)],
            },
        );
        for from in [12, 13, 14] {
            let summary = StageSummary {
                stage: 1,
                members: 3,
                throughput: 1.0,
                open_iter: 0,
                empty_neighbors: Vec::new(),
            };
            deliver(&mut j, from, Msg::StageInfo { summary });
        }
        j.on_timeout(3 * SEC);
        assert_eq!(j.stage(), 1);
        // Its link to member 14 broke while it was away: the server's list
        // is fresher than its own view, and 14 is greeted too.
        j.handle(3 * SEC, Input::PeerLost { peer: 14 });
        let done = Msg::StateResponse {
            version: (3, 9),
            members: Arc::new(vec![12, 13, 14]),
            bytes: 0,
            coord: 12,
        };
        let acts = deliver(&mut j, 12, done);
        assert!(j.is_active());
        let greeted: BTreeSet<NodeId> = (sends(&acts).iter())
            .filter(|(_, m)| matches!(m, Msg::GroupJoin { stage: 1, .. }))
            .map(|(to, _)| *to)
            .collect();
        assert_eq!(greeted, BTreeSet::from([12, 13, 14]));
        // The member: it took 11's goodbye, then hears its join.
        let mut m = started(Policy::Gwtf, 13, 1, &[11, 12], &[]);
        deliver(&mut m, 11, Msg::Goodbye);
        assert!(!m.stage_members().contains(&11));
        let coord = m.coordinator();
        deliver(
            &mut m,
            11,
            Msg::GroupJoin {
                stage: 1,
                incarnation: 1,
            },
        );
        assert!(m.stage_members().contains(&11));
        assert_eq!(m.coordinator(), coord);
    }

    /// A member that took its coordinator for gone and took over admits
    /// it again only through its GroupJoin, not through its introduction
    /// while it joins again: admitted so (a paused coordinator, fenced,
    /// downloading the state), it was in the next commit, where its part
    /// never came (a swarm test's stage stood still 150 s).
    #[test]
    fn a_successor_admits_its_old_coordinator_only_on_its_group_join() {
        let mut n = started(Policy::Gwtf, 22, 2, &[21, 23], &[]);
        assert_eq!(n.coordinator(), Some(21));
        let t = n.now;
        n.handle(t, Input::PeerLost { peer: 21 });
        assert_eq!(n.coordinator(), Some(22));
        let intro = Msg::Introduce {
            iter: 0,
            stage: 2,
            spare: 1,
            compute_s: 0.5,
            sent_at: t,
            echo: None,
        };
        deliver(&mut n, 21, intro);
        assert!(!n.stage_members().contains(&21));
        let join = Msg::GroupJoin {
            stage: 2,
            incarnation: 1,
        };
        deliver(&mut n, 21, join);
        assert!(n.stage_members().contains(&21));
        // A member the coordinator's list names again is not held against
        // it: here 23, taken for gone by 22 while 21 coordinated.
        let mut m = started(Policy::Gwtf, 22, 2, &[21, 23], &[]);
        let t = m.now;
        m.handle(t, Input::PeerLost { peer: 23 });
        let list = Msg::Heartbeat {
            members: Some(Arc::new(vec![21, 22, 23])),
            coord: 21,
            updates: 0,
            version: 0,
        };
        deliver(&mut m, 21, list);
        assert!(m.group.members().contains(&23));
        m.handle(t, Input::PeerLost { peer: 21 });
        assert_eq!(m.coordinator(), Some(22));
        assert!(!m.group.is_evicted(&23));
    }

    /// A joiner whose id is the smallest (a fenced node coming back) follows
    /// the coordinator its state server names instead of taking over; the
    /// coordinator and the members keep it when they admit the joiner.
    #[test]
    fn a_joiner_with_the_smallest_id_does_not_take_coordination_over() {
        let mut j = Node::new(config(Policy::Gwtf), 11, 0, 0.5, 4, 1);
        let acts = j.handle(
            SEC,
            Input::Join {
                peers: vec![(12, 1), (13, 1)],
            },
        );
        assert!(!sends(&acts).is_empty());
        for from in [12, 13] {
            let summary = StageSummary {
                stage: 1,
                members: 2,
                throughput: 1.0,
                open_iter: 0,
                empty_neighbors: Vec::new(),
            };
            deliver(&mut j, from, Msg::StageInfo { summary });
        }
        j.on_timeout(3 * SEC);
        assert_eq!(j.stage(), 1);
        let done = Msg::StateResponse {
            version: (3, 9),
            members: Arc::new(vec![12, 13]),
            bytes: 0,
            coord: 12,
        };
        let acts = deliver(&mut j, 13, done);
        assert!(j.is_active());
        assert_eq!(j.coordinator(), Some(12));
        assert!(sends(&acts)
            .iter()
            .any(|(to, m)| *to == 12 && matches!(m, Msg::GroupJoin { stage: 1, .. })));
        // Its coordinator's plain heartbeat is not a member taking it for
        // the coordinator: no member list goes back (a list from a smaller
        // id took coordination over, and two nodes followed each other).
        let hb = Msg::Heartbeat {
            members: None,
            coord: 12,
            updates: 0,
            version: 0,
        };
        let acts = deliver(&mut j, 12, hb);
        assert!(!sends(&acts).iter().any(|(_, m)| matches!(
            m,
            Msg::Heartbeat {
                members: Some(_),
                ..
            }
        )));
        // The coordinator admits it and stays; a member hears the list.
        let mut c = started(Policy::Gwtf, 12, 1, &[13], &[]);
        assert_eq!(c.coordinator(), Some(12));
        deliver(
            &mut c,
            11,
            Msg::GroupJoin {
                stage: 1,
                incarnation: 1,
            },
        );
        assert_eq!(c.coordinator(), Some(12));
        assert!(c.stage_members().contains(&11));
        // A member's list naming the coordinator changes nothing there.
        let naming_12 = Msg::Heartbeat {
            members: Some(Arc::new(vec![11, 12, 13])),
            coord: 12,
            updates: 0,
            version: 0,
        };
        deliver(&mut c, 11, naming_12);
        assert_eq!(c.coordinator(), Some(12));
        let mut m = started(Policy::Gwtf, 13, 1, &[12], &[]);
        let list = Arc::new(vec![11, 12, 13]);
        deliver(
            &mut m,
            12,
            Msg::Heartbeat {
                members: Some(list),
                coord: 12,
                updates: 0,
                version: 0,
            },
        );
        assert_eq!(m.coordinator(), Some(12));
        // Without the coordinator the smallest live id takes over, as every
        // member computes it.
        m.handle(2 * SEC, Input::PeerLost { peer: 12 });
        assert_eq!(m.coordinator(), Some(11));
    }

    /// Stage 2's neighbours say it has no live node: a joiner of the real
    /// swarm restarts it from the initial weights at the iteration in
    /// progress (no download: nobody holds its state) and says so; with
    /// restarts off (the simulator) it joins the bottleneck as usual.
    #[test]
    fn a_joiner_restarts_a_stage_its_neighbours_know_empty() {
        for restart in [true, false] {
            let mut cfg = (*config(Policy::Gwtf)).clone();
            cfg.restart_empty_stages = restart;
            let mut n = Node::new(Arc::new(cfg), 50, 0, 0.5, 4, 1);
            let peers = vec![(11, 1), (31, 3), (41, 4)];
            n.handle(SEC, Input::Join { peers });
            for (from, stage, thr, open, empty) in [
                (11, 1, 8.0, 6, vec![2]),
                (31, 3, 2.0, 7, vec![2]),
                (41, 4, 5.0, 6, vec![]),
            ] {
                let summary = StageSummary {
                    stage,
                    members: 2,
                    throughput: thr,
                    open_iter: open,
                    empty_neighbors: empty,
                };
                deliver(&mut n, from, Msg::StageInfo { summary });
            }
            let acts = n.on_timeout(3 * SEC);
            if restart {
                assert_eq!(n.stage(), 2);
                assert!(n.is_active());
                assert_eq!(n.version().0, 6);
                assert_eq!(n.coordinator(), Some(50));
                assert!(acts.iter().any(|a| matches!(
                    a,
                    Action::Event(Event::StageRestarted {
                        stage: 2,
                        applied: Some(6)
                    })
                )));
                assert!(!sends(&acts)
                    .iter()
                    .any(|(_, m)| matches!(m, Msg::StateRequest)));
            } else {
                assert_eq!(n.stage(), 3);
                assert!(matches!(sends(&acts)[..], [(31, Msg::StateRequest)]));
            }
        }
    }

    /// Stage 2's only node (21, in the joiner's directory) does not answer:
    /// it may have just left, before its neighbours marked the stage empty.
    /// The joiner asks every stage again instead of joining the bottleneck
    /// among those that answered; told by a neighbour that stage 2 is
    /// empty, it takes it up. Where nobody says so, it joins the bottleneck
    /// of the others after a suspicion period.
    #[test]
    fn a_stage_that_does_not_answer_is_waited_for_before_another_is_joined() {
        for told_empty in [true, false] {
            let mut cfg = (*config(Policy::Gwtf)).clone();
            cfg.restart_empty_stages = true;
            let mut n = Node::new(Arc::new(cfg), 50, 0, 0.5, 4, 1);
            let peers = vec![(11, 1), (21, 2), (31, 3), (41, 4)];
            n.handle(SEC, Input::Join { peers });
            let answer = |n: &mut Node, from: NodeId, stage: Stage, empty: Vec<Stage>| {
                let summary = StageSummary {
                    stage,
                    members: 1,
                    throughput: [8.0, 4.0, 2.0, 5.0][stage as usize - 1],
                    open_iter: 5,
                    empty_neighbors: empty,
                };
                deliver(n, from, Msg::StageInfo { summary });
            };
            for (from, stage) in [(11, 1), (31, 3), (41, 4)] {
                answer(&mut n, from, stage, vec![]);
            }
            let mut t = SEC + n.cfg.tick;
            let acts = n.on_timeout(t);
            assert!(!n.is_active() && n.stage() == 0, "it waits for stage 2");
            let asked: Vec<NodeId> = (sends(&acts).iter())
                .filter(|(_, m)| matches!(m, Msg::StageQuery))
                .map(|(to, _)| *to)
                .collect();
            assert!(
                [11, 21, 31, 41].iter().all(|p| asked.contains(p)),
                "{asked:?}"
            );
            if told_empty {
                // Node 11 has seen its neighbour leave since.
                answer(&mut n, 11, 1, vec![2]);
            }
            let mut chose = None;
            for _ in 0..1000 {
                t += n.cfg.tick;
                let acts = n.on_timeout(t);
                let restarted = (acts.iter())
                    .any(|a| matches!(a, Action::Event(Event::StageRestarted { stage: 2, .. })));
                let download = sends(&acts)
                    .iter()
                    .any(|(_, m)| matches!(m, Msg::StateRequest));
                if restarted || download {
                    chose = Some((n.stage(), restarted, t));
                    break;
                }
            }
            let (stage, restarted, at) = chose.expect("a stage chosen");
            assert!(at >= SEC + n.suspicion(), "chose before a suspicion period");
            if told_empty {
                assert_eq!((stage, restarted), (2, true));
            } else {
                assert_eq!(
                    (stage, restarted),
                    (3, false),
                    "the bottleneck of the others"
                );
            }
        }
    }

    /// Joiner 50 of a swarm that restarts empty stages, joining through
    /// `peers`, whom stages 1 and 3 (nodes 11 and 31) told that stage 2
    /// is empty.
    fn told_stage_2_is_empty(peers: &[(NodeId, Stage)]) -> Node {
        let mut cfg = (*config(Policy::Gwtf)).clone();
        cfg.restart_empty_stages = true;
        let mut n = Node::new(Arc::new(cfg), 50, 0, 0.5, 4, 1);
        let peers = peers.to_vec();
        n.handle(SEC, Input::Join { peers });
        for (from, stage) in [(11, 1), (31, 3)] {
            let summary = StageSummary {
                stage,
                members: 2,
                throughput: 4.0,
                open_iter: 5,
                empty_neighbors: vec![2],
            };
            deliver(&mut n, from, Msg::StageInfo { summary });
        }
        n
    }

    /// The joiner's directory still names a node of the empty stage (dead
    /// since): it is asked again, and after a suspicion period without an
    /// answer the stage is taken up; before, every joiner took that node
    /// for alive and joined another stage, and the stage stayed empty.
    #[test]
    fn a_silent_node_of_a_stage_known_empty_is_waited_for_then_taken_for_gone() {
        let mut n = told_stage_2_is_empty(&[(11, 1), (21, 2), (31, 3)]);
        let restarted = |acts: &[Action]| {
            acts.iter()
                .any(|a| matches!(a, Action::Event(Event::StageRestarted { stage: 2, .. })))
        };
        let acts = n.on_timeout(SEC + 2 * n.cfg.tick);
        assert!(!restarted(&acts) && !n.is_active());
        assert!(sends(&acts)
            .iter()
            .any(|(to, m)| *to == 21 && matches!(m, Msg::StageQuery)));
        assert!(!sends(&acts)
            .iter()
            .any(|(_, m)| matches!(m, Msg::StateRequest)));
        let mut t = SEC + 2 * n.cfg.tick;
        let mut done = false;
        for _ in 0..1000 {
            t += n.cfg.tick;
            if restarted(&n.on_timeout(t)) {
                done = true;
                break;
            }
        }
        assert!(done && n.is_active() && n.stage() == 2);
        assert!(t >= SEC + n.suspicion(), "taken for gone after {t}");
    }

    /// The neighbours say stage 2 is empty, but the directory tells the
    /// joiner of a node of it (another joiner took it up meanwhile): the
    /// joiner asks it, waits for its answer, and downloads its state
    /// instead of rebuilding the stage a second time.
    #[test]
    fn a_stage_taken_up_meanwhile_is_joined_not_rebuilt_again() {
        let mut n = told_stage_2_is_empty(&[(11, 1), (31, 3)]);
        let t = n.now;
        let acts = n.handle(t, Input::Located { peer: 21, stage: 2 });
        assert!(matches!(sends(&acts)[..], [(21, Msg::StageQuery)]));
        // Its answer is waited for: no restart at the next ticks.
        let mut t = t;
        for _ in 0..3 {
            t += n.cfg.tick;
            let acts = n.on_timeout(t);
            assert!(!n.is_active(), "took the stage up before 21 answered");
            assert!(!acts.iter().any(|a| matches!(a, Action::Event(_))));
        }
        let summary = StageSummary {
            stage: 2,
            members: 1,
            throughput: 1.0,
            open_iter: 8,
            empty_neighbors: Vec::new(),
        };
        deliver(&mut n, 21, Msg::StageInfo { summary });
        let acts = n.on_timeout(t + n.cfg.tick);
        assert_eq!(n.stage(), 2);
        assert!(matches!(sends(&acts)[..], [(21, Msg::StateRequest)]));
        // A node of a stage not said empty is asked, without a wait; one
        // known, or of no relay stage, is not.
        let mut m = Node::new(config(Policy::Gwtf), 60, 0, 0.5, 4, 1);
        m.handle(
            SEC,
            Input::Join {
                peers: vec![(11, 1)],
            },
        );
        let q = |m: &mut Node, peer, stage| {
            let acts = m.handle(SEC, Input::Located { peer, stage });
            sends(&acts)
                .iter()
                .any(|(to, msg)| *to == peer && matches!(msg, Msg::StageQuery))
        };
        assert!(q(&mut m, 41, 4));
        assert!(!q(&mut m, 41, 4));
        assert!(!q(&mut m, 11, 1));
        assert!(!q(&mut m, 70, 0));
        assert!(!q(&mut m, 71, 5));
    }

    /// Two members of the stage before the empty one answer, the second
    /// lagging (it heard of no iteration opened after 0): the joiner
    /// restarts the stage at the iteration in progress the first one knows,
    /// not at the lagging one (its trainer would wait for updates made
    /// before the stage existed).
    #[test]
    fn a_restart_begins_at_the_latest_iteration_a_member_knows() {
        let mut cfg = (*config(Policy::Gwtf)).clone();
        cfg.restart_empty_stages = true;
        let mut n = Node::new(Arc::new(cfg), 50, 0, 0.5, 2, 1);
        n.handle(
            SEC,
            Input::Join {
                peers: vec![(11, 1), (12, 1)],
            },
        );
        for (from, open) in [(11, 2), (12, 0)] {
            let summary = StageSummary {
                stage: 1,
                members: 2,
                throughput: 4.0,
                open_iter: open,
                empty_neighbors: vec![2],
            };
            deliver(&mut n, from, Msg::StageInfo { summary });
        }
        let acts = n.on_timeout(3 * SEC);
        assert_eq!(n.stage(), 2);
        assert!(acts.iter().any(|a| matches!(
            a,
            Action::Event(Event::StageRestarted {
                stage: 2,
                applied: Some(1)
            })
        )));
    }

    /// Of two members of stage 1, the one that joined after stage 2
    /// emptied does not know it is empty, and answers last: the stage is
    /// taken up all the same (the demo's joiners all went to stage 1 and
    /// left stage 2 empty for good).
    #[test]
    fn a_member_that_does_not_know_a_stage_empty_does_not_hide_it() {
        let mut cfg = (*config(Policy::Gwtf)).clone();
        cfg.restart_empty_stages = true;
        let mut n = Node::new(Arc::new(cfg), 50, 0, 0.5, 2, 1);
        let peers = vec![(11, 1), (12, 1)];
        n.handle(SEC, Input::Join { peers });
        for (from, empty) in [(11, vec![2]), (12, vec![])] {
            let summary = StageSummary {
                stage: 1,
                members: 2,
                throughput: 4.0,
                open_iter: 5,
                empty_neighbors: empty,
            };
            deliver(&mut n, from, Msg::StageInfo { summary });
        }
        let acts = n.on_timeout(3 * SEC);
        assert_eq!(n.stage(), 2);
        assert!(acts
            .iter()
            .any(|a| matches!(a, Action::Event(Event::StageRestarted { stage: 2, .. }))));
    }

    /// The member serving a download dies: the joiner asks another member of
    /// the stage at once (its broken connection says so), and when none is
    /// left it asks the stages again.
    #[test]
    fn a_joiner_whose_state_server_dies_asks_another_member() {
        let mut n = Node::new(config(Policy::Gwtf), 50, 0, 0.5, 4, 1);
        let peers = vec![(11, 1), (21, 2), (22, 2)];
        n.handle(SEC, Input::Join { peers });
        for (from, stage, thr) in [(11, 1, 8.0), (21, 2, 2.0)] {
            let summary = StageSummary {
                stage,
                members: 2,
                throughput: thr,
                open_iter: 0,
                empty_neighbors: Vec::new(),
            };
            deliver(&mut n, from, Msg::StageInfo { summary });
        }
        let acts = n.on_timeout(3 * SEC);
        let first = match sends(&acts)[..] {
            [(to, Msg::StateRequest)] => to,
            ref s => panic!("{s:?}"),
        };
        let other = if first == 21 { 22 } else { 21 };
        let acts = n.handle(4 * SEC, Input::PeerLost { peer: first });
        assert!(
            matches!(sends(&acts)[..], [(to, Msg::StateRequest)] if to == other),
            "{:?}",
            sends(&acts)
        );
        n.handle(5 * SEC, Input::PeerLost { peer: other });
        assert!(!n.is_active());
        assert_eq!(
            n.stage(),
            2,
            "still joining stage 2 until the stages answer again"
        );
    }

    /// A member serving its state names the joiners it served before, so that
    /// joiners whose contact dies still know each other.
    #[test]
    fn a_state_download_names_the_earlier_joiners() {
        let mut n = started(Policy::Gwtf, 21, 2, &[22], &[]);
        deliver(&mut n, 50, Msg::StateRequest);
        let acts = deliver(&mut n, 51, Msg::StateRequest);
        let s = sends(&acts);
        let Some((51, Msg::StateResponse { members, .. })) = s.first() else {
            panic!("{s:?}")
        };
        assert_eq!(members[..], [21, 22, 50]);
    }
}
