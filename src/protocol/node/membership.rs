//! Membership: the partial view of the neighbouring stages (introductions,
//! RTT and bandwidth probes, suspicion, goodbyes) and the stage group
//! (members, coordinator election, heartbeats).
use super::*;

/// The stage group as this node sees it.
#[derive(Debug)]
pub(super) struct Group {
    members: MemberSet,
    /// The member list changed since the coordinator last sent it.
    members_changed: bool,
    /// The coordinator: the live member with the smallest id.
    coord: Option<NodeId>,
    last_coord_heard: Time,
    /// Coordinator: when each member was last heard from.
    member_heard: BTreeMap<NodeId, Time>,
    /// Coordinator: the incarnation each member joined as (see
    /// [`Msg::GroupJoin`]; 0 when it never said).
    incarnations: BTreeMap<NodeId, u32>,
    /// Members this node dropped (any member: it may coordinate next),
    /// with the first incarnation admitted again (see `fencing`).
    evicted: BTreeMap<NodeId, u32>,
}

impl Default for Group {
    fn default() -> Group {
        Group {
            members_changed: true,
            members: Default::default(),
            coord: Default::default(),
            last_coord_heard: Default::default(),
            member_heard: Default::default(),
            incarnations: Default::default(),
            evicted: Default::default(),
        }
    }
}

impl Group {
    /// Adds `m` to the group; whether it is new (the coordinator then sends
    /// the list again).
    pub(super) fn admit(&mut self, m: NodeId) -> bool {
        let new = self.members.insert(m);
        if new {
            self.members_changed = true;
        }
        new
    }

    /// The coordinator as this node knows it.
    pub(super) fn coord(&self) -> Option<NodeId> {
        self.coord
    }

    /// The members as this node knows them.
    pub(super) fn members(&self) -> &MemberSet {
        &self.members
    }

    /// The members in increasing order (built once per change).
    pub(super) fn member_list(&mut self) -> Arc<Vec<NodeId>> {
        self.members.list()
    }

    /// Follows `coord`, heard of at `now` (a joiner taking the group's
    /// coordinator for its own).
    pub(super) fn follow(&mut self, coord: NodeId, now: Time) {
        self.coord = Some(coord);
        self.last_coord_heard = now;
    }

    /// Whether this node dropped `m` (and answers its group messages with
    /// an eviction until a newer incarnation of it comes).
    pub(super) fn is_evicted(&self, m: &NodeId) -> bool {
        self.evicted.contains_key(m)
    }

    /// Remembers `m` as dropped: its current incarnation (the one it
    /// joined as, 0 when it never said) and older are evicted.
    pub(super) fn evict(&mut self, m: NodeId) {
        let inc = self.incarnations.get(&m).copied().unwrap_or(0);
        let e = self.evicted.entry(m).or_insert(inc + 1);
        *e = (*e).max(inc + 1);
    }

    /// Takes `m` back: no longer evicted.
    pub(super) fn forgive(&mut self, m: &NodeId) {
        self.evicted.remove(m);
    }

    /// The members, to be changed by a test.
    #[cfg(test)]
    pub(super) fn members_mut(&mut self) -> &mut MemberSet {
        &mut self.members
    }

    /// The group a starting or joining node finds: `members` and itself.
    pub(super) fn adopt(&mut self, members: impl IntoIterator<Item = NodeId>, me: NodeId) {
        for m in members {
            self.members.insert(m);
        }
        self.members.insert(me);
    }
}

/// The members of this node's stage group: an ordered set, with its list
/// (what heartbeats, claims answers and state downloads carry) built once
/// per change and shared, not once per message.
#[derive(Clone, Debug, Default)]
pub(super) struct MemberSet {
    set: BTreeSet<NodeId>,
    list: Option<Arc<Vec<NodeId>>>,
    /// Bumped at every change (for what is derived from the members).
    version: u64,
}

impl MemberSet {
    pub(super) fn insert(&mut self, m: NodeId) -> bool {
        let new = self.set.insert(m);
        if new {
            self.list = None;
            self.version += 1;
        }
        new
    }
    pub(super) fn remove(&mut self, m: &NodeId) -> bool {
        let had = self.set.remove(m);
        if had {
            self.list = None;
            self.version += 1;
        }
        had
    }
    pub(super) fn contains(&self, m: &NodeId) -> bool {
        self.set.contains(m)
    }
    /// Bumped at every change (for what is derived from the members).
    pub(super) fn version(&self) -> u64 {
        self.version
    }
    /// The members as a set.
    pub(super) fn as_set(&self) -> &BTreeSet<NodeId> {
        &self.set
    }
    pub(super) fn len(&self) -> usize {
        self.set.len()
    }
    pub(super) fn iter(&self) -> std::collections::btree_set::Iter<'_, NodeId> {
        self.set.iter()
    }
    /// The members in increasing order.
    pub(super) fn list(&mut self) -> Arc<Vec<NodeId>> {
        let set = &self.set;
        self.list
            .get_or_insert_with(|| Arc::new(set.iter().copied().collect()))
            .clone()
    }
    /// Becomes `list` plus `me`; a list equal to the current group (the
    /// periodic announcement of an unchanged group) costs one comparison.
    pub(super) fn assign(&mut self, list: &Arc<Vec<NodeId>>, me: NodeId) {
        if list.windows(2).all(|w| w[0] < w[1]) {
            let has_me = list.binary_search(&me).is_ok();
            let same = if has_me {
                self.set.len() == list.len() && self.set.iter().eq(list.iter())
            } else {
                self.set.len() == list.len() + 1
                    && self.set.contains(&me)
                    && self.set.iter().filter(|&&m| m != me).eq(list.iter())
            };
            if same {
                return;
            }
            self.set = list.iter().copied().collect();
            self.set.insert(me);
            self.list = has_me.then(|| list.clone());
            self.version += 1;
        } else {
            self.set = list.iter().copied().collect();
            self.set.insert(me);
            self.list = None;
            self.version += 1;
        }
    }
}

impl FromIterator<NodeId> for MemberSet {
    fn from_iter<I: IntoIterator<Item = NodeId>>(it: I) -> MemberSet {
        MemberSet {
            set: it.into_iter().collect(),
            list: None,
            version: 0,
        }
    }
}

impl IntoIterator for MemberSet {
    type Item = NodeId;
    type IntoIter = std::collections::btree_set::IntoIter<NodeId>;
    fn into_iter(self) -> Self::IntoIter {
        self.set.into_iter()
    }
}

impl<'a> IntoIterator for &'a MemberSet {
    type Item = &'a NodeId;
    type IntoIter = std::collections::btree_set::Iter<'a, NodeId>;
    fn into_iter(self) -> Self::IntoIter {
        self.set.iter()
    }
}

impl Node {
    /// Not known to be dead (members of the group need not be in `peers`).
    /// Says when a stage next to this node's loses its last live node
    /// known here, and when one is known again: a pause with a reason
    /// instead of a silent stall.
    pub(super) fn watch_adjacent_stages(&mut self) {
        let s = self.s();
        let watched: Vec<Stage> = if self.stage == 0 {
            vec![1, s]
        } else {
            vec![self.stage - 1, self.stage + 1]
        };
        for st in watched {
            if st == 0 || st > s || st == self.stage {
                continue;
            }
            let live = self.peers.of_stage(st).any(|(_, p)| !p.dead);
            if live {
                self.adjacent.seen.insert(st);
                if self.adjacent.empty.remove(&st) {
                    self.event(Event::StageResumed { stage: st });
                }
            } else if self.adjacent.seen.contains(&st) && self.adjacent.empty.insert(st) {
                self.event(Event::StageEmpty { stage: st });
            }
        }
    }

    pub(super) fn alive(&self, p: NodeId) -> bool {
        p == self.id || !self.peers.get(&p).is_some_and(|x| x.dead)
    }

    pub(super) fn learn(&mut self, p: NodeId, stage: Stage) -> &mut Peer {
        self.peers.learn(p, stage, self.now)
    }

    pub(super) fn ema(old: Option<f64>, x: f64, a: f64) -> Option<f64> {
        Some(match old {
            None => x,
            Some(o) => o * (1.0 - a) + x * a,
        })
    }

    /// Introductions to the previous and next stage; periodic ones go only
    /// to peers not heard from for `stale` (liveness and RTT refresh).
    pub(super) fn introduce_all(&mut self, stale: Option<Time>) {
        let (ps, ns) = (self.prev_stage(), self.next_stage());
        let now = self.now;
        let targets: Vec<NodeId> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.dead && (p.stage == ps || p.stage == ns))
            .filter(|(_, p)| stale.is_none_or(|d| p.last_heard + d < now))
            .map(|(id, _)| *id)
            .collect();
        for t in targets {
            let m = self.intro_msg(None);
            self.send(t, m);
        }
    }

    pub(super) fn intro_msg(&self, echo: Option<Time>) -> Msg {
        Msg::Introduce {
            iter: self.iters.next_hint(),
            stage: self.stage,
            spare: self.spare(),
            compute_s: self.compute_s,
            sent_at: self.now,
            echo,
        }
    }

    /// Every live peer and member drops this node at once (a leave, a
    /// fence): the flows and hops through it are recovered now.
    pub(super) fn goodbye_to_all(&mut self) {
        let all: BTreeSet<NodeId> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.dead)
            .map(|(id, _)| *id)
            .chain(self.group.members.iter().copied())
            .filter(|&p| p != self.id)
            .collect();
        for p in all {
            self.send(p, Msg::Goodbye);
        }
    }

    pub(super) fn leave(&mut self) {
        self.goodbye_to_all();
        self.phase = Phase::Left;
        self.event(Event::Left);
    }

    /// The coordinator stays while it lives and is a member (a joiner with
    /// a smaller id, or a fenced node coming back, does not take over in
    /// the middle of an iteration); when it is gone, the live member with
    /// the smallest id takes over, which every member computes alike.
    pub(super) fn recompute_coord(&mut self) {
        let keep = (self.group.coord).filter(|&c| self.group.members.contains(&c) && self.alive(c));
        let c = keep.or_else(|| self.group.members.iter().copied().find(|&m| self.alive(m)));
        self.set_coord(c);
    }

    /// Follows `c` as the coordinator: a new coordinator takes over what
    /// the old one left; a member tells a new coordinator everything.
    pub(super) fn set_coord(&mut self, c: Option<NodeId>) {
        let old = self.group.coord;
        self.group.coord = c;
        if old != c {
            self.group.last_coord_heard = self.now;
            if c == Some(self.id) {
                self.group.members_changed = true;
                // Members heartbeated the old coordinator, not us: each gets
                // a full suspicion period from the moment it may itself
                // notice the change (up to one suspicion period after us),
                // so that a member still following the old coordinator is
                // not dropped, and evicted, for it.
                let grace = match old {
                    Some(_) => self.now + self.suspicion(),
                    None => self.now,
                };
                for &m in &self.group.members {
                    self.group.member_heard.insert(m, grace);
                }
                self.take_over(old);
            } else if let Some(c) = c {
                if old.is_some() {
                    self.sync_to(c);
                }
            }
        }
    }

    pub(super) fn member_gone(&mut self, p: NodeId) {
        self.group.members_changed = true;
        if self.group.coord == Some(self.id) {
            self.event(Event::MemberRemoved { peer: p });
        }
        let was_coord = self.group.coord == Some(p);
        if self.group.coord == Some(self.id) {
            self.coord_member_dead(p);
        }
        if was_coord {
            self.recompute_coord();
        }
    }

    pub(super) fn heartbeat(&mut self) {
        let Some(c) = self.group.coord else { return };
        let limit = self.cfg.suspect_ticks as Time * self.cfg.tick;
        if c == self.id {
            self.refresh_deputy();
            let members: Vec<NodeId> = self.group.members.iter().copied().collect();
            let list = if self.group.members_changed
                || self.tick_no % (8 * self.cfg.heartbeat_ticks as u64) == 0
            {
                self.group.members_changed = false;
                Some(Arc::new(members.clone()))
            } else {
                None
            };
            // Suspect silent members.
            let now = self.now;
            for &m in &members {
                self.group.member_heard.entry(m).or_insert(now);
            }
            let silent: Vec<NodeId> = members
                .iter()
                .copied()
                .filter(|&m| m != self.id && self.silent_for_sure(self.group.member_heard[&m]))
                .collect();
            let suspected = (members.iter())
                .any(|&m| m != self.id && self.group.member_heard[&m] + limit < now);
            if suspected && self.isolated() {
                // Nobody at all was heard: this node is the one cut off,
                // not its members.
                self.fence(FenceReason::Isolated);
                return;
            }
            for m in silent {
                // Dropped: told so when it speaks again (see `fencing`).
                self.remember_evicted(m);
                // A silent member is not lost to the others' transport:
                // an all-reduce running with it would wait for its part
                // until the last resort, so its commit is given up now
                // (its grants are then recomputed like any lost member's).
                self.abandon_commits_with(m);
                self.peer_dead(m);
            }
            let updates = self.iters.updates();
            for m in self.group.members.clone() {
                if m != self.id {
                    self.send(
                        m,
                        Msg::Heartbeat {
                            members: list.clone(),
                            coord: c,
                            updates,
                            version: self.iters.version().1,
                        },
                    );
                }
            }
        } else {
            if self.group.last_coord_heard + limit < self.now {
                if self.isolated() {
                    // Nobody at all was heard: this node is the one cut
                    // off; it does not coordinate a group of its own.
                    self.fence(FenceReason::Isolated);
                    return;
                }
                if !self.silent_for_sure(self.group.last_coord_heard) {
                    // Not known yet whether the coordinator or this node
                    // went silent: it keeps following until either
                    // someone else is heard or it is isolated.
                    let m = Msg::Heartbeat {
                        members: None,
                        coord: c,
                        updates: self.iters.updates(),
                        version: self.iters.version().1,
                    };
                    self.send(c, m);
                    return;
                }
                self.peer_dead(c);
                if let Some(nc) = self.group.coord {
                    if nc != self.id {
                        let m = Msg::Heartbeat {
                            members: None,
                            coord: nc,
                            updates: self.iters.updates(),
                            version: self.iters.version().1,
                        };
                        self.send(nc, m);
                    }
                }
                return;
            }
            let m = Msg::Heartbeat {
                members: None,
                coord: c,
                updates: self.iters.updates(),
                version: self.iters.version().1,
            };
            self.send(c, m);
            self.resend_stale_claims(c);
        }
    }

    /// Whether a group peer last heard at `heard` is silent, and silent on
    /// its side: suspected for the suspicion time, and, where fencing is
    /// on, someone else was heard after that time. A node cut off just
    /// after hearing a neighbour would otherwise take its coordinator (or
    /// its members) for dead before it finds itself isolated, and run
    /// alone as a group of one that nothing fences; waiting costs at most
    /// the isolation time, after which it fences itself instead.
    pub(super) fn silent_for_sure(&self, heard: Time) -> bool {
        let limit = self.suspicion();
        heard + limit < self.now
            && (!self.cfg.fence_on_pause || self.last_heard_any > heard + limit)
    }

    pub(super) fn peer_suspect(&mut self, p: NodeId) {
        let ban = self.cfg.ban_ticks as Time * self.cfg.tick;
        let now = self.now;
        if let Some(x) = self.peers.get_mut(&p) {
            x.banned_until = now + ban;
        }
    }

    /// The members of this node's group not known to be dead, in id order.
    pub(super) fn live_members(&self) -> Arc<Vec<NodeId>> {
        Arc::new(
            self.group
                .members
                .iter()
                .copied()
                .filter(|m| self.alive(*m))
                .collect(),
        )
    }

    /// Any message is a sign of life: a member heard by its coordinator, a
    /// peer heard (a suspected one was alive after all, unless it says
    /// goodbye), the coordinator heard by a member.
    pub(super) fn heard_from(&mut self, from: NodeId, goodbye: bool) {
        self.last_heard_any = self.now;
        if self.group.coord == Some(self.id) {
            self.group.member_heard.insert(from, self.now);
        }
        if let Some(p) = self.peers.get_mut(&from) {
            p.last_heard = self.now;
            if p.dead && !goodbye {
                // False suspicion: it is alive after all.
                p.dead = false;
            }
        }
        if Some(from) == self.group.coord {
            self.group.last_coord_heard = self.now;
        }
    }

    /// Bytes came from `from` (`Input::Heard`): a sign of life that keeps a
    /// live peer from being suspected, and this node from taking itself
    /// for cut off. Unlike a message it revives no peer taken for gone:
    /// the bytes may be those of its goodbye, or of a frame it sent before
    /// it was dropped.
    pub(super) fn heard_bytes_from(&mut self, from: NodeId) {
        self.last_heard_any = self.now;
        if self.peers.get(&from).is_some_and(|p| p.dead) {
            return;
        }
        if self.group.coord == Some(self.id) && self.group.members.contains(&from) {
            self.group.member_heard.insert(from, self.now);
        }
        if let Some(p) = self.peers.get_mut(&from) {
            p.last_heard = self.now;
        }
        if Some(from) == self.group.coord {
            self.group.last_coord_heard = self.now;
        }
    }

    /// INTRODUCE: learns the peer, measures the RTT (an echo answers ours; a
    /// first introduction is echoed) and probes the bandwidth on first contact.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_introduce(
        &mut self,
        from: NodeId,
        iter: u32,
        stage: Stage,
        spare: u32,
        compute_s: f64,
        sent_at: Time,
        echo: Option<Time>,
    ) {
        self.iters.hear_next(iter, stage == 0);
        let now = self.now;
        let a = self.cfg.ema_alpha;
        let bytes = self.cfg.probe_bytes;
        let moved = self.peers.get(&from).is_some_and(|p| p.stage != stage);
        let p = self.learn(from, stage);
        p.spare = spare;
        p.compute_s = compute_s;
        p.last_heard = now;
        match echo {
            Some(t0) => {
                let rtt = to_secs(now.saturating_sub(t0));
                p.lat = Self::ema(p.lat, rtt / 2.0, a);
                // Bandwidth probe on first contact only; data hops
                // keep the estimate fresh afterwards.
                if p.bw.is_none() {
                    self.send(
                        from,
                        Msg::Probe {
                            bytes,
                            sent_at: now,
                        },
                    );
                }
            }
            None => {
                let m = Msg::Introduce {
                    iter: self.iters.next_hint(),
                    stage: self.stage,
                    spare: self.spare(),
                    compute_s: self.compute_s,
                    sent_at: now,
                    echo: Some(sent_at),
                };
                self.send(from, m);
            }
        }
        if moved {
            // It serves another stage now (it fenced itself and joined
            // that one): what went to it for the old one is lost, and
            // fails over now, not at its ack timeout.
            self.release_flows_through(from);
            self.hops_lost_to(from);
        }
        // A node of this stage that introduces itself is a member, unless
        // this coordinator dropped it: a fenced node joining again still
        // names its old stage (and its old incarnation's introductions may
        // come late over a slow link); only its GroupJoin, of a newer
        // incarnation, brings it back. Admitted, it held the stage's next
        // commit for good while it joined another stage, whose claims this
        // node then refused as a member's.
        if stage == self.stage
            && self.group.coord == Some(self.id)
            && self.phase == Phase::Active
            && !self.group.evicted.contains_key(&from)
        {
            self.group.admit(from);
        }
    }

    /// The runtime's directory says `peer` serves `stage`
    /// ([`Input::Located`]). An active node introduces itself to a node of
    /// its own relay stage outside its group, when it coordinates one (the
    /// other coordinator admits it, as it admits any node of its stage that
    /// introduces itself, and of two coordinators the smaller id keeps the
    /// group; when their weights differ the larger one's group downloads
    /// the smaller's state instead of following its list:
    /// `gives_way_to_other_weights`), and to a node of a neighbouring stage it never heard of
    /// (a stage taken up after this node joined is otherwise unknown to
    /// it, and its microbatches never go there).
    pub(super) fn on_located(&mut self, peer: NodeId, stage: Stage) {
        if peer == self.id {
            return;
        }
        if matches!(self.phase, Phase::Querying { .. }) {
            self.located_while_querying(peer, stage);
            return;
        }
        if self.phase != Phase::Active {
            return;
        }
        let introduce = if stage == self.stage {
            self.stage > 0
                && self.group.coord == Some(self.id)
                && !self.group.members.contains(&peer)
                && !self.group.evicted.contains_key(&peer)
        } else {
            (stage == self.prev_stage() || stage == self.next_stage())
                && self.peers.get(&peer).is_none()
        };
        if introduce {
            self.learn(peer, stage);
            let m = self.intro_msg(None);
            self.send(peer, m);
        }
    }

    /// A joiner choosing its stage hears of `peer`, a node of relay stage
    /// `stage` it did not know: it asks it for the stage's summary. When
    /// the neighbours said that stage was empty (and nobody of it
    /// answered), the choice waits a suspicion period for the answer: the
    /// stage may have been taken up since (a joiner that took the sticky
    /// word of the neighbours rebuilt a stage 1.4 s after another had,
    /// from weights 9 updates older, and then had to download the state).
    fn located_while_querying(&mut self, peer: NodeId, stage: Stage) {
        if stage == 0 || stage > self.s() || self.peers.get(&peer).is_some() {
            return;
        }
        self.learn(peer, stage);
        self.send(peer, Msg::StageQuery);
        let infos = self.joining.stage_infos();
        let said_empty = !infos.contains_key(&stage)
            && infos.values().any(|i| i.empty_neighbors.contains(&stage));
        if said_empty {
            self.phase = Phase::Querying { since: self.now };
        }
    }

    /// The bandwidth probe came back: the transfer time beyond the RTT gives
    /// the bandwidth.
    pub(super) fn on_probe_ack(&mut self, from: NodeId, bytes: u64, sent_at: Time) {
        let a = self.cfg.ema_alpha;
        let now = self.now;
        if let Some(p) = self.peers.get_mut(&from) {
            let rtt = to_secs(now.saturating_sub(sent_at));
            let lat = p.lat.unwrap_or(0.0);
            let xfer = (rtt - 2.0 * lat).max(1e-4);
            let first = p.bw.is_none();
            p.bw = Self::ema(p.bw, bytes as f64 / xfer, a);
            if first {
                self.link_measured(from);
            }
        }
    }

    /// A heartbeat: from the coordinator (with the member list when it
    /// changed) or from a member.
    pub(super) fn on_heartbeat(
        &mut self,
        from: NodeId,
        members: Option<Arc<Vec<NodeId>>>,
        coord: NodeId,
        (updates, version): (u32, u64),
    ) {
        if members.is_none() && self.downloading_from() == Some(from) {
            // The answer of a member whose weights miss an update.
            self.source_behind(from, coord, updates);
            return;
        }
        if self.behind_outsider(from, updates) {
            return;
        }
        if members.is_none() {
            if self.yield_to_even_rival(from, coord, updates, version) {
                return;
            }
            self.answer_a_group_behind(from, coord, updates);
        }
        let mine = self.group.coord;
        if let Some(ms) = members {
            // A coordinator's list (`coord == from`) is followed when it
            // is ours, or smaller than ours (of two coordinators that hear
            // of each other, the smaller id wins); a member's answer
            // naming the coordinator when we took that member for it.
            // The node we follow naming us closes a loop of two nodes each
            // taking the other for the coordinator: we coordinate.
            // A list that lacks the coordinator it names is no group's;
            // one from a coordinator that is not ours and lacks this node
            // is a group this node is not in: neither is followed.
            let ours = Some(from) == mine;
            let well_formed = ms.contains(&coord) && (ours || ms.contains(&self.id));
            let follow = well_formed
                && if coord == from {
                    ours || from < mine.unwrap_or(NodeId::MAX)
                } else {
                    ours
                };
            if follow && !ours && updates < self.iters.updates() && self.phase == Phase::Active {
                // Another group of this stage, behind this node's weights:
                // joining it would put the newer weights in the minority
                // of its digests (and evict them). Not answered: the list
                // may be one a node sent before it was paused, and an
                // eviction would hit its next incarnation; a group behind
                // finds this node through its gap (`announce_gap`).
                return;
            }
            if follow && !ours && self.gives_way_to_other_weights(from, updates, version) {
                return;
            }
            if follow {
                // The coordinator vouches for its members: one this node
                // took for gone is not held against it should this node
                // coordinate later.
                for m in ms.iter() {
                    self.group.evicted.remove(m);
                }
                self.group.members.assign(&ms, self.id);
                if coord == self.id || self.group.members.contains(&coord) && self.alive(coord) {
                    self.set_coord(Some(coord));
                } else {
                    self.recompute_coord();
                }
            }
        } else if mine == Some(self.id) {
            // A member we dropped (silent, lost) that went on as one.
            self.heartbeat_from_outsider(from);
        } else if coord == self.id
            && self.phase == Phase::Active
            && self.group.members.contains(&from)
        {
            // A member takes us for its coordinator (a joiner that
            // reached us while our own coordinator was failing): tell
            // it who is, so it does not suspect a live member and
            // coordinate a group of its own.
            self.name_the_coordinator_to(from);
        }
    }

    /// Tells `to`, which takes this node for its coordinator, who is, with
    /// the member list. Only an active member that knows its coordinator
    /// answers: a node joining again (fenced, its group forgotten) naming
    /// itself would draw `to` into a group of its own.
    pub(super) fn name_the_coordinator_to(&mut self, to: NodeId) {
        if let (Phase::Active, Some(coord)) = (&self.phase, self.group.coord) {
            let members = self.group.members.list();
            let updates = self.iters.updates();
            self.send(
                to,
                Msg::Heartbeat {
                    members: Some(members),
                    coord,
                    updates,
                    version: self.iters.version().1,
                },
            );
        }
    }

    /// A node joins (or rejoins) this stage's group.
    pub(super) fn on_group_join(&mut self, from: NodeId, stage: Stage, incarnation: u32) {
        let st = self.stage;
        if stage == st {
            if let Some(&min) = self.group.evicted.get(&from) {
                if incarnation < min {
                    // The incarnation this coordinator dropped: it comes
                    // back only through the join path.
                    self.refuse_evicted(from);
                    return;
                }
                self.group.evicted.remove(&from);
            }
            self.group.incarnations.insert(from, incarnation);
            if let Some(p) = self.peers.get_mut(&from) {
                p.dead = false;
            }
            self.group.member_heard.insert(from, self.now);
            self.group.admit(from);
            if self.group.coord == Some(self.id) && self.iters.version().0 > 0 {
                let (iter, version) = self.iters.version();
                self.send(from, Msg::Applied { iter, version });
            }
            self.recompute_coord();
        }
    }

    /// Next-stage peers publish themselves (CHANGE) every gossip period;
    /// one silent for three periods has left the view (like an expired DHT
    /// record).
    pub(super) fn expire_silent_next_stage(&mut self) {
        let ns = self.next_stage();
        // With a bounded fanout a peer reaches each of its upstream peers
        // every ceil(view / fanout) rounds; three of those is the expiry.
        // One pass counts the view and finds its longest silence; a second
        // one runs only when someone has expired.
        let (view, oldest) = self
            .peers
            .values()
            .filter(|p| p.stage == ns && !p.dead)
            .fold((0usize, Time::MAX), |(n, o), p| {
                (n + 1, o.min(p.last_heard))
            });
        let view = view.max(1);
        let rounds = view.div_ceil(self.cfg.gossip_fanout.max(1)).max(1) as Time;
        let expiry = 3 * rounds * self.cfg.gossip_ticks as Time * self.cfg.tick;
        let now = self.now;
        if oldest.saturating_add(expiry) >= now {
            return;
        }
        let expired: Vec<NodeId> = self
            .peers
            .iter()
            .filter(|(_, p)| p.stage == ns && !p.dead && p.last_heard + expiry < now)
            .map(|(id, _)| *id)
            .collect();
        for p in expired {
            self.peer_dead(p);
        }
    }

    /// Marks `p` dead (it leaves the group, and a coordinator is elected
    /// again if it was ours); false when it is this node or already dead.
    pub(super) fn mark_dead(&mut self, p: NodeId) -> bool {
        if p == self.id {
            return false;
        }
        if !self.peers.contains_key(&p) {
            let st = self.stage;
            self.learn(p, st);
        }
        let peer = self.peers.get_mut(&p).unwrap();
        if peer.dead {
            return false;
        }
        peer.dead = true;
        peer.queued = 0;
        self.event(Event::PeerDead { peer: p });
        // Remembered by every member, not only the coordinator: this node
        // may coordinate next (the dead member may be the coordinator),
        // and then only the dropped node's GroupJoin brings it back, not
        // its introduction while it joins again. A coordinator that took
        // over from a paused one admitted it so while it downloaded the
        // state, committed with it, and waited for its part for good.
        if self.group.members.contains(&p) {
            self.remember_evicted(p);
        }
        if self.group.members.remove(&p) {
            self.member_gone(p);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// Two joiners that took up one emptied stage at once each coordinate
    /// a group of one and know nothing of each other. Told by the
    /// directory, they introduce themselves and end in one group, the
    /// smaller id its coordinator. A neighbour never heard of is
    /// introduced to; a node known, a member, and (by a member) a node of
    /// its stage are not.
    #[test]
    fn two_groups_of_one_stage_told_of_each_other_merge() {
        let cfg = config(Policy::Gwtf);
        let near = [(10, 1), (30, 3)];
        let mut a = started_with(cfg.clone(), 5, 2, &[], &near);
        let mut b = started_with(cfg, 7, 2, &[], &near);
        assert_eq!((a.coordinator(), b.coordinator()), (Some(5), Some(7)));
        // Without the directory's word, ticks alone never bring them
        // together.
        let mut t = a.now;
        for _ in 0..50 {
            t += a.cfg.tick;
            for n in [&mut a, &mut b] {
                let other = if n.id == 5 { 7 } else { 5 };
                let acts = n.on_timeout(t);
                assert!(sends(&acts).iter().all(|(to, _)| *to != other));
            }
        }
        let located = |peer, stage| Input::Located { peer, stage };
        let mut queue: Vec<(NodeId, NodeId, Msg)> = Vec::new();
        let keep = |from: NodeId, acts: Vec<Action>, q: &mut Vec<(NodeId, NodeId, Msg)>| {
            for (to, m) in sends(&acts) {
                if to == 5 || to == 7 {
                    q.push((from, to, m.clone()));
                }
            }
        };
        keep(5, a.handle(t, located(7, 2)), &mut queue);
        keep(7, b.handle(t, located(5, 2)), &mut queue);
        assert_eq!(queue.len(), 2, "each introduces itself to the other");
        for round in 0..200 {
            t += a.cfg.tick / 4;
            for (from, to, m) in std::mem::take(&mut queue) {
                let n = if to == 5 { &mut a } else { &mut b };
                keep(to, n.handle(t, Input::Message { from, msg: m }), &mut queue);
            }
            if round % 4 == 0 {
                keep(5, a.on_timeout(t), &mut queue);
                keep(7, b.on_timeout(t), &mut queue);
            }
        }
        assert!(a.is_active() && b.is_active());
        assert_eq!((a.coordinator(), b.coordinator()), (Some(5), Some(5)));
        assert!(a.group.members.contains(&7) && b.group.members.contains(&5));
        // A neighbour never heard of is introduced to, once known no more.
        let intro_to = |acts: &[Action], who: NodeId| {
            (sends(acts).iter()).any(|(to, m)| *to == who && matches!(m, Msg::Introduce { .. }))
        };
        assert!(intro_to(&a.handle(t, located(31, 3)), 31));
        assert!(!intro_to(&a.handle(t, located(31, 3)), 31));
        assert!(!intro_to(&a.handle(t, located(10, 1)), 10));
        // Nor is a member, nor by a member a node of its stage elsewhere.
        assert!(!intro_to(&a.handle(t, located(7, 2)), 7));
        assert!(!intro_to(&b.handle(t, located(9, 2)), 9));
        // Nor a stage that is not a neighbour's.
        assert!(!intro_to(&a.handle(t, located(40, 4)), 40));
    }

    #[test]
    fn member_list_follows_the_set() {
        let mut m = MemberSet::default();
        for x in [5, 1, 9] {
            m.insert(x);
        }
        assert_eq!(*m.list(), vec![1, 5, 9]);
        m.remove(&5);
        assert_eq!(*m.list(), vec![1, 9]);
        let announced = Arc::new(vec![1, 2, 9]);
        m.assign(&announced, 9);
        assert!(Arc::ptr_eq(&m.list(), &announced));
        m.assign(&Arc::new(vec![1, 2]), 9);
        assert_eq!(*m.list(), vec![1, 2, 9]);
        m.assign(&Arc::new(vec![7, 3]), 9);
        assert_eq!(m.iter().copied().collect::<Vec<_>>(), vec![3, 7, 9]);
        assert_eq!(*m.list(), vec![3, 7, 9]);
    }

    /// The coordinator is the live member with the smallest id; when it dies
    /// the next one takes over, and only a coordinator reports members removed.
    #[test]
    fn the_coordinator_is_the_smallest_live_member() {
        let mut n = started(Policy::Gwtf, 5, 2, &[3, 7], &[]);
        assert_eq!(n.coordinator(), Some(3));
        let a = n.handle(2 * SEC, Input::PeerLost { peer: 3 });
        assert_eq!(n.coordinator(), Some(5));
        assert!(!a
            .iter()
            .any(|x| matches!(x, Action::Event(Event::MemberRemoved { .. }))));
        let a = n.handle(3 * SEC, Input::PeerLost { peer: 7 });
        assert!(a
            .iter()
            .any(|x| matches!(x, Action::Event(Event::MemberRemoved { peer: 7 }))));
        assert_eq!(n.group.members.iter().copied().collect::<Vec<_>>(), [5]);
    }

    /// A coordinator declares a member that stays silent for `suspect_ticks`
    /// dead; a member heard from in time stays.
    #[test]
    fn a_silent_member_is_suspected_by_its_coordinator() {
        let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[]);
        hear_only_from(&mut n, 3, SEC);
        assert!(!n.group.members.contains(&2));
        assert!(n.group.members.contains(&3));
        assert!(!n.alive(2) && n.alive(3));
    }

    /// Bytes streaming in from a member whose messages are queued behind
    /// them (a state over a slow link) keep it a member; bytes from a peer
    /// that said goodbye do not bring it back.
    #[test]
    fn bytes_keep_a_member_alive_but_revive_no_peer_gone() {
        let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[(10, 1)]);
        let cfg = n.cfg.clone();
        let mut t = SEC;
        for _ in 0..(cfg.suspect_ticks + 2 * cfg.heartbeat_ticks) {
            t += cfg.tick;
            deliver(
                &mut n,
                3,
                Msg::Heartbeat {
                    members: None,
                    coord: 1,
                    updates: 0,
                    version: 0,
                },
            );
            n.handle(t, Input::Heard { peers: vec![2] });
            n.on_timeout(t);
        }
        assert!(n.group.members.contains(&2) && n.alive(2));
        deliver(&mut n, 10, Msg::Goodbye);
        assert!(!n.alive(10));
        n.handle(t + cfg.tick, Input::Heard { peers: vec![10] });
        assert!(!n.alive(10));
    }

    /// A peer taken for dead is said so (`PeerDead`), once: the runtime's
    /// all-reduce stops waiting for it then, not at the transport's longer
    /// timeout (a stage whose coordinator was paused in its all-reduce
    /// stood still 5.7 s).
    #[test]
    fn a_peer_taken_for_dead_is_said_so_once() {
        let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[]);
        let cfg = n.cfg.clone();
        let mut said = Vec::new();
        let mut t = SEC;
        for _ in 0..(cfg.suspect_ticks + 4 * cfg.heartbeat_ticks) {
            t += cfg.tick;
            let hb = Msg::Heartbeat {
                members: None,
                coord: 1,
                updates: 0,
                version: 0,
            };
            let mut a = deliver(&mut n, 3, hb);
            a.extend(n.on_timeout(t));
            said.extend(a.iter().filter_map(|x| match x {
                Action::Event(Event::PeerDead { peer }) => Some(*peer),
                _ => None,
            }));
        }
        assert_eq!(said, vec![2]);
    }

    /// A message from a peer taken for dead lifts the suspicion, except a
    /// goodbye.
    #[test]
    fn any_message_lifts_a_false_suspicion() {
        let mut n = started(Policy::Gwtf, 5, 2, &[], &[(30, 3)]);
        n.handle(2 * SEC, Input::PeerLost { peer: 30 });
        assert!(!n.alive(30));
        deliver(&mut n, 30, Msg::QueryFlows);
        assert!(n.alive(30));
        deliver(&mut n, 30, Msg::Goodbye);
        assert!(!n.alive(30));
    }
}

/// Stages next to a node's: which had a live node, which have none now.
#[derive(Debug, Default)]
pub(super) struct AdjacentStages {
    seen: BTreeSet<Stage>,
    empty: BTreeSet<Stage>,
}

impl AdjacentStages {
    /// The neighbouring stages known to have no live node.
    pub(super) fn empty_stages(&self) -> impl Iterator<Item = Stage> + '_ {
        self.empty.iter().copied()
    }
}
