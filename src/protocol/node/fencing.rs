//! Fencing: a node whose view of its stage group may be stale stops serving
//! the group at once and comes back through the join path, and a
//! coordinator makes sure that nobody it dropped acts as a member again.
//!
//! A paused process, a starved one or one behind a cut link wakes up with a
//! view its group has already left behind: its coordinator dropped it after
//! the suspicion time and had its grants recomputed elsewhere. Acting on
//! that view (coordinating a group of its own, committing, applying) splits
//! the stage and lets the replicas diverge silently. So:
//! - a node that finds its own timers late by more than the suspicion time
//!   (it was paused) fences itself ([`FenceReason::Paused`]);
//! - a node that heard from nobody at all for the isolation time while its
//!   group went silent takes itself, not its group, for the one cut off
//!   ([`FenceReason::Isolated`]) instead of coordinating alone;
//! - a coordinator remembers the incarnation of every member it dropped and
//!   answers any group message of that incarnation with [`Msg::Evicted`];
//!   it admits the node again only through a `GroupJoin` of a later
//!   incarnation, sent after a fresh state download;
//! - two groups of one relay stage that hear of each other (a coordinator
//!   tells the other groups of its stage how many updates its weights hold,
//!   and in which version, every two suspicion times) never merge two
//!   weights: the group behind, or of two even ones in other versions the
//!   larger coordinator's, dissolves and downloads the other's state;
//! - after every all-reduce the members' weight digests are compared: the
//!   members whose weights differ from the majority's are evicted before
//!   the commit is applied, the commit is run again without them, and
//!   their grants are recomputed ([`Node::diverged_members`]).
//!
//! A fenced node says goodbye to every peer (its flows and the hops through
//! it are recovered at once, as for a leave), forgets everything it held of
//! the group and the microbatches, and joins again as its next incarnation:
//! a relay chooses a stage and downloads its state, a data holder downloads
//! the holders' state from another holder and trains on from the iteration
//! then open. A node alone in its stage never fences itself: its weights are
//! the stage's only copy.
use super::*;

/// Suspicion times between a relay coordinator's words to the other
/// groups of its stage ([`Node::tell_rival_groups`]).
const RIVAL_TELL_SUSPICIONS: u64 = 2;

impl Node {
    /// Microseconds of silence after which a group peer is suspected.
    pub(super) fn suspicion(&self) -> Time {
        self.cfg.suspect_ticks as Time * self.cfg.tick
    }

    /// The live members of this node's stage besides itself, as it knows
    /// them (someone to come back to).
    fn others_in_stage(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = (self.group.members().iter())
            .copied()
            .filter(|&m| m != self.id && self.alive(m))
            .collect();
        if v.is_empty() {
            // Peers filed under this stage that the group view lacks.
            let st = self.stage;
            v = (self.peers.iter())
                .filter(|(id, p)| p.stage == st && !p.dead && **id != self.id)
                .map(|(id, _)| *id)
                .collect();
        }
        v
    }

    /// Called with the time of every input before it is handled: a node
    /// whose own tick is overdue by more than the suspicion time did not
    /// run for that long (paused, starved): its group has dropped it.
    pub(super) fn check_own_clock(&mut self, now: Time) {
        if !self.cfg.fence_on_pause || self.phase != Phase::Active {
            return;
        }
        let late = now.saturating_sub(self.next_tick);
        if late > self.suspicion() {
            self.now = self.now.max(now);
            self.fence(FenceReason::Paused {
                gap: late + self.cfg.tick,
            });
        }
    }

    /// Whether this node heard from nobody for the isolation time, while
    /// others of its stage exist to come back to: it is the one cut off.
    pub(super) fn isolated(&self) -> bool {
        let window = self.cfg.isolation_ticks as Time * self.cfg.tick;
        self.cfg.fence_on_pause
            && self.last_heard_any + window < self.now
            && !self.others_in_stage().is_empty()
    }

    /// Stops serving the stage group and comes back through the join path
    /// as the next incarnation (see the module's documentation). Nothing
    /// when this node is alone in its stage (nobody else holds its state):
    /// it re-announces itself instead.
    pub(super) fn fence(&mut self, reason: FenceReason) {
        if self.phase != Phase::Active {
            return;
        }
        let others = self.others_in_stage();
        if others.is_empty() {
            self.last_heard_any = self.now;
            self.next_tick = self.now + self.cfg.tick;
            self.introduce_all(None);
            // The nodes of its stage it took for dead while it was away may
            // serve the stage meanwhile (one that came back first restored
            // it from weights with fewer updates): each hears how many
            // updates this node's weights hold, and the group behind gives
            // way (`behind_outsider`, `answer_a_group_behind`). Nothing
            // else would make them speak: neither is in the other's group.
            self.tell_stage_outsiders();
            return;
        }
        // Weights whole and not known wrong are kept (the trainer holds
        // them until a state is imported): they may be the stage's newest.
        let known_wrong = matches!(
            reason,
            FenceReason::Diverged | FenceReason::Evicted { diverged: true }
        );
        let kept =
            (self.stage > 0 && !known_wrong && !self.iters.gap() && self.iters.updates() > 0)
                .then(|| (self.stage, self.iters.updates(), self.iters.version()));
        // Everyone it may have dealt with drops it at once, as at a leave.
        self.goodbye_to_all();
        self.incarnation += 1;
        let incarnation = self.incarnation;
        self.event(Event::Fenced {
            reason,
            incarnation,
        });
        self.forget_all();
        // The state to download is the newer one it heard of.
        let newer = match reason {
            FenceReason::Behind { updates, holder } => Some((self.stage, updates, holder)),
            _ => None,
        };
        self.joining.fenced(kept, newer);
        self.last_heard_any = self.now;
        if self.stage == 0 {
            // Holders hold the embedding and the head: another holder's
            // state, then training from the iteration open then.
            let src = self.newest_source(0).unwrap_or(others[0]);
            // The other holders are the sources to ask (and whose loss
            // strands it): in its peer view from now on.
            for &o in &others {
                self.learn(o, 0);
            }
            self.next_tick = self.now + self.cfg.tick;
            self.download(0, src);
        } else {
            self.join(Vec::new());
        }
    }

    /// Forgets everything of the group, the iterations and the microbatches
    /// (kept: identity, configuration, the peer view, the label counter,
    /// the task counter, so that nothing old is taken for new).
    fn forget_all(&mut self) {
        self.tasks.clear();
        self.selfq.clear();
        self.replay.clear();
        self.reservations.clear_keeping_labels();
        let t0 = if self.stage == 0 {
            self.cfg.sa_t0_holder
        } else {
            self.cfg.sa_t0_relay
        };
        self.search = LocalSearch::starting_at(t0);
        self.cost_gossip = CostGossip::default();
        self.dh = HolderState::default();
        self.lifecycle = Microbatches::default();
        self.acks = AckTimers::default();
        self.member = GroupMember::default();
        self.coordinating = Coordinator::default();
        self.deputy_state = deputy::DeputyState::default();
        self.ring_links = Default::default();
        self.barrier = None;
        self.group = Group::default();
        self.joining = JoinState::default();
        self.adjacent = AdjacentStages::default();
        self.iters = Iterations::default();
        // Who is dead is part of the stale view too (while it was paused,
        // its transport may have timed out live peers): every peer starts
        // alive again, and one that is gone fails again.
        let now = self.now;
        self.peers.retain(|_, p| {
            p.queued = 0;
            p.banned_until = 0;
            p.dead = false;
            p.last_heard = now;
            true
        });
    }

    /// Coordinator: `m` is no longer a member; any group message of its
    /// current incarnation is answered with [`Msg::Evicted`].
    pub(super) fn remember_evicted(&mut self, m: NodeId) {
        if m == self.id {
            return;
        }
        self.group.evict(m);
    }

    /// Coordinator: the commits not applied yet whose all-reduce counts on
    /// `m` are given up (a new epoch follows once its grants are redone).
    pub(super) fn abandon_commits_with(&mut self, m: NodeId) {
        let iters: Vec<u32> = (self.coordinating.coord_iters.iter())
            .filter(|(_, ci)| !ci.is_applied() && ci.commit_counts_on(m))
            .map(|(k, _)| *k)
            .collect();
        let retry_at = self.now + self.cfg.tick;
        for k in iters {
            if let Some(ci) = self.coordinating.coord_iters.get_mut(&k) {
                ci.retry_not_before(retry_at);
            }
            self.abandon_commit(k);
        }
    }

    /// Coordinator: whether a group message from `from` comes from an
    /// incarnation it dropped; if so it is told (and the message ignored).
    pub(super) fn refuse_evicted(&mut self, from: NodeId) -> bool {
        if from == self.id || self.group.coord() != Some(self.id) || !self.group.is_evicted(&from) {
            return false;
        }
        self.evict_for_silence(from);
        true
    }

    /// Tells `to` it is no member (not for diverged weights), with the
    /// updates this node's weights hold: an evictee ahead answers in kind.
    fn evict_for_silence(&mut self, to: NodeId) {
        let updates = self.iters.updates();
        self.send(
            to,
            Msg::Evicted {
                diverged: false,
                updates,
            },
        );
    }

    /// Coordinator: a heartbeat from a node of this stage that is not a
    /// member (dropped as silent or lost while it went on): it is told.
    pub(super) fn heartbeat_from_outsider(&mut self, from: NodeId) {
        if self.group.coord() != Some(self.id)
            || self.phase != Phase::Active
            || self.group.members().contains(&from)
        {
            return;
        }
        let of_stage = self.peers.get(&from).is_some_and(|p| p.stage == self.stage);
        if of_stage || self.group.is_evicted(&from) {
            self.remember_evicted(from);
            self.evict_for_silence(from);
        }
    }

    /// Whether `from`, a node of this stage outside this node's group,
    /// holds weights with more `updates` than this node's: then this
    /// node's group is the one left behind (the stage split while links
    /// were cut, and the other side trained on). It dissolves: a
    /// coordinator tells its members they are evicted (they join again
    /// and download from whoever serves the stage), and this node fences
    /// itself and downloads `from`'s state. Evicting `from` instead would
    /// throw away the only weights that hold those updates.
    pub(super) fn behind_outsider(&mut self, from: NodeId, updates: u32) -> bool {
        // A coordinator applies each update first: anyone ahead of it is
        // in another group. A member may lag its own group by the update
        // in flight (a joiner that downloaded it from the coordinator
        // speaks to a member that has not applied it yet): it gives way
        // only to two updates more.
        let slack = u32::from(self.group.coord() != Some(self.id));
        let mine = self.iters.updates().saturating_add(slack);
        if self.phase != Phase::Active
            || updates <= mine
            || from == self.id
            || self.group.coord() == Some(from)
            || self.group.members().contains(&from)
        {
            return false;
        }
        let of_stage = self.peers.get(&from).is_some_and(|p| p.stage == self.stage);
        if !of_stage && !self.group.is_evicted(&from) {
            return false;
        }
        self.fall_behind(from, updates);
        true
    }

    /// This node's group is behind `holder`'s weights (`updates`): a
    /// coordinator tells its members (they fence and join again), and
    /// this node fences itself and downloads `holder`'s state.
    fn fall_behind(&mut self, holder: NodeId, updates: u32) {
        if self.group.coord() == Some(self.id) {
            for m in self.group.members().clone() {
                if m != self.id && m != holder {
                    self.send(
                        m,
                        Msg::Evicted {
                            diverged: false,
                            updates,
                        },
                    );
                }
            }
        }
        // A source to come back to, should the group hold nobody else.
        let (from, st) = (holder, self.stage);
        self.learn(from, st);
        self.group.forgive(&from);
        self.fence(FenceReason::Behind {
            updates,
            holder: from,
        });
    }

    /// A heartbeat from `from`, a node outside this node's group that
    /// follows another coordinator, whose weights hold fewer updates than
    /// this node's ([`Node::announce_gap`]: a group behind looking for the
    /// stage's state): it is told this node's updates with an eviction,
    /// and dissolves. A node known to serve another stage is not answered.
    pub(super) fn answer_a_group_behind(&mut self, from: NodeId, coord: NodeId, updates: u32) {
        let mine = self.iters.updates();
        if self.phase != Phase::Active
            || updates >= mine
            || from == self.id
            || coord == self.id
            || self.group.coord() == Some(coord)
            || self.group.members().contains(&from)
            || self.peers.get(&from).is_some_and(|p| p.stage != self.stage)
        {
            return;
        }
        self.evict_for_silence(from);
    }

    /// A node whose weights miss an update its group applied (it came
    /// back on a stale state, and so did its group: nobody in it can serve
    /// the current one) tells every node of its stage it knows outside its
    /// group, once per suspicion time, how many updates it holds. A
    /// coordinator ahead of it answers with an eviction carrying its own,
    /// and this node's group, the one behind, dissolves and downloads from
    /// it. Without this, a node ahead that came back alone from a cut link
    /// and a group behind would never hear of each other again (neither
    /// has the other in its group), and the stage would stand still.
    pub(super) fn announce_gap(&mut self) {
        if !self.cfg.fence_on_pause
            || self.phase != Phase::Active
            || !self.iters.gap()
            || self.tick_no % self.cfg.suspect_ticks.max(1) as u64 != 0
        {
            return;
        }
        self.tell_stage_outsiders();
    }

    /// A relay coordinator tells the live nodes of its stage outside its
    /// group how many updates its weights hold, every
    /// [`RIVAL_TELL_SUSPICIONS`] suspicion times. Two groups of one stage
    /// that formed without hearing of each other (two joiners that took up
    /// one emptied stage at once, each as a group of one) otherwise never
    /// speak: the one the upstream stage does not send to stands by for
    /// good, counted as a member, its weights further behind with every
    /// update, and serves them should the working group die. Told so, the
    /// group behind dissolves and downloads the other's state
    /// (`answer_a_group_behind`, `behind_outsider`), and of two even in
    /// updates the larger coordinator's does ([`Node::yield_to_even_rival`]).
    /// A stage with one group has no such node: nothing is sent there. The
    /// joiners this node serves a state to are not told (a member list's
    /// silence would have them ask another member).
    pub(super) fn tell_rival_groups(&mut self) {
        let every = RIVAL_TELL_SUSPICIONS * self.cfg.suspect_ticks.max(1) as u64;
        if !self.cfg.fence_on_pause
            || self.phase != Phase::Active
            || self.stage == 0
            || self.group.coord() != Some(self.id)
            || self.tick_no % every != every / 2
        {
            return;
        }
        let (st, now, expiry) = (self.stage, self.now, self.cfg.e2e_timeout);
        let targets: Vec<NodeId> = (self.peers.iter())
            .filter(|(id, p)| p.stage == st && !p.dead && **id != self.id)
            .map(|(id, _)| *id)
            .filter(|id| !self.group.members().contains(id))
            .filter(|id| !self.joining.recently_served(id, now, expiry))
            .collect();
        let updates = self.iters.updates();
        for t in targets {
            let m = Msg::Heartbeat {
                members: None,
                coord: self.id,
                updates,
                version: self.iters.version().1,
            };
            self.send(t, m);
        }
    }

    /// The coordinator of another group of this relay stage told how many
    /// updates its weights hold ([`Node::tell_rival_groups`]): as many as
    /// this node's group's, in another weights version (`version`). Of two
    /// coordinators even in updates the smaller keeps its group (as when
    /// they evict each other), so this node's group, the larger's,
    /// dissolves and downloads its state. True when it did.
    pub(super) fn yield_to_even_rival(
        &mut self,
        from: NodeId,
        coord: NodeId,
        updates: u32,
        version: u64,
    ) -> bool {
        let of_stage = self.peers.get(&from).is_some_and(|p| p.stage == self.stage);
        if coord != from || !of_stage || self.group.members().contains(&from) {
            return false;
        }
        self.gives_way_to_other_weights(from, updates, version)
    }

    /// The coordinator `from` of another group of this relay stage, with
    /// a smaller id, says its weights hold as many updates as this
    /// coordinator's group's, in another version: equal updates need not
    /// be equal weights (two joiners that took up one emptied stage apart,
    /// each from its own weights; two sides of a split that both
    /// trained). Following its member list would put two weights in one
    /// group, which only a later all-reduce's digests would tell (and only
    /// of members that own a grant), with updates applied to both
    /// meanwhile. This node's group gives way instead: it dissolves and
    /// downloads `from`'s state. True when it did.
    pub(super) fn gives_way_to_other_weights(
        &mut self,
        from: NodeId,
        updates: u32,
        version: u64,
    ) -> bool {
        if !self.cfg.fence_on_pause
            || self.phase != Phase::Active
            || self.stage == 0
            || from >= self.id
            || self.group.coord() != Some(self.id)
            || updates != self.iters.updates()
            || version == self.iters.version().1
        {
            return false;
        }
        self.fall_behind(from, updates);
        true
    }

    /// Tells every node filed under this node's stage outside its group,
    /// dead or alive in its view, how many updates its weights hold (a
    /// heartbeat without a member list). Of two groups of one stage that
    /// hear of each other so, the one behind dissolves and downloads the
    /// other's state.
    fn tell_stage_outsiders(&mut self) {
        let st = self.stage;
        let targets: Vec<NodeId> = (self.peers.iter())
            .filter(|(id, p)| p.stage == st && **id != self.id)
            .map(|(id, _)| *id)
            .filter(|&id| !self.group.members().contains(&id) || !self.alive(id))
            .collect();
        let coord = self.group.coord().unwrap_or(self.id);
        let updates = self.iters.updates();
        for t in targets {
            let m = Msg::Heartbeat {
                members: None,
                coord,
                updates,
                version: self.iters.version().1,
            };
            self.send(t, m);
        }
    }

    /// The live node of `stage` known to hold newer weights than this
    /// node had when it fenced itself ([`FenceReason::Behind`]): the state
    /// to download.
    pub(super) fn newest_source(&self, stage: Stage) -> Option<NodeId> {
        let holder = self.joining.newer_in(stage)?;
        (holder != self.id && self.alive(holder)).then_some(holder)
    }

    /// The coordinator (or a node of this stage that coordinates: this
    /// node's view may be the stale one) says this node is not a member.
    /// A silent member whose weights hold more updates than the evictor's
    /// keeps them: it answers with an eviction of its own, so that the
    /// group behind dissolves ([`Node::behind_outsider`]'s rule).
    pub(super) fn on_evicted(&mut self, from: NodeId, diverged: bool, updates: u32) {
        let of_stage = self.group.coord() == Some(from)
            || self.group.members().contains(&from)
            || self.group.is_evicted(&from)
            || self.peers.get(&from).is_some_and(|p| p.stage == self.stage);
        if !of_stage || self.phase != Phase::Active {
            return;
        }
        let mine = self.iters.updates();
        // Ahead of the evictor, or (two coordinators of one stage, neither
        // behind) the smaller id, which keeps its group as when their
        // heartbeats meet: evicted in return. An evictor that took this
        // node for silent may be the one behind a slow link, hearing
        // everyone late (in a swarm, a relay at 1 Mbit/s evicted the other
        // relay of its stage and served the stage alone, at a sixth of the
        // swarm's pace).
        let smaller_coordinator = self.group.coord() == Some(self.id) && self.id < from;
        if !diverged && (updates < mine || (updates == mine && smaller_coordinator)) {
            self.evict_for_silence(from);
            return;
        }
        if !diverged && self.behind_outsider(from, updates) {
            return;
        }
        if !diverged && updates > mine && self.group.coord() != Some(from) {
            // A member of this node's group that holds newer weights
            // refused to follow it (see `on_heartbeat`): this group is the
            // one behind, and that member's state is the one to download.
            self.fall_behind(from, updates);
            return;
        }
        self.fence(FenceReason::Evicted { diverged });
    }

    /// The weights digests of `iter`'s all-reduce that are compared: those
    /// of the members whose gradients are in its mean (they own a grant)
    /// and the coordinator's own. A member that granted nothing added a
    /// zero share: its weights change nothing in the mean, and may be
    /// behind for a good reason (a joiner whose state was exported just
    /// before an update it has not heard of yet); it learns of the gap
    /// when the update is applied and downloads the state again instead
    /// of applying it. 0: unknown.
    pub(super) fn compared_digests(&self, ci: &CoordIter) -> Vec<(NodeId, u64)> {
        ci.compared_digests(self.id)
    }

    /// The members of a commit whose weights differ from the majority's
    /// (ties: the coordinator's own, else the smallest digest), among those
    /// compared ([`Node::compared_digests`]): empty when they all hold the
    /// same weights.
    pub(super) fn diverged_members(&self, iter: u32) -> Vec<NodeId> {
        let Some(ci) = self.coordinating.coord_iters.get(&iter) else {
            return Vec::new();
        };
        let known = self.compared_digests(ci);
        if known.windows(2).all(|w| w[0].1 == w[1].1) {
            return Vec::new();
        }
        let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
        for (_, d) in &known {
            *counts.entry(*d).or_default() += 1;
        }
        let most = counts.values().copied().max().unwrap_or(0);
        let mine = ci.digest_of(self.id);
        let winner = match mine {
            Some(d) if counts.get(&d) == Some(&most) => d,
            _ => (counts.iter())
                .find(|(_, c)| **c == most)
                .map(|(d, _)| *d)
                .unwrap_or(0),
        };
        (known.into_iter())
            .filter(|(_, d)| *d != winner)
            .map(|(m, _)| m)
            .collect()
    }

    /// Coordinator: the commit of `iter` holds gradients of members whose
    /// weights differ from the majority's (`diverged`): it is not applied.
    /// Those members are evicted (told, and their grants recomputed), and
    /// the others commit again. A coordinator in the minority fences
    /// itself: its successor commits again.
    pub(super) fn evict_diverged(&mut self, iter: u32, diverged: Vec<NodeId>) {
        let stage = self.stage;
        let digests: Vec<(NodeId, u64)> = (self.coordinating.coord_iters.get(&iter))
            .map(|ci| ci.digests())
            .unwrap_or_default();
        self.event(Event::ReplicasDiverged {
            stage,
            iter,
            digests,
        });
        let retry_at = self.now + self.cfg.tick;
        if let Some(ci) = self.coordinating.coord_iters.get_mut(&iter) {
            ci.retry_not_before(retry_at);
        }
        self.abandon_commit(iter);
        if diverged.contains(&self.id) {
            self.fence(FenceReason::Diverged);
            return;
        }
        let updates = self.iters.updates();
        for m in diverged {
            self.remember_evicted(m);
            self.send(
                m,
                Msg::Evicted {
                    diverged: true,
                    updates,
                },
            );
            // Gone from the group: its grants are recomputed, its flows and
            // hops recovered, and it is not in the next commit.
            self.peer_dead(m);
        }
        self.coord_check(iter);
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// The test configuration with fencing on (as the runtime runs it).
    fn fencing() -> Arc<Config> {
        let mut cfg = (*config(Policy::Gwtf)).clone();
        cfg.fence_on_pause = true;
        Arc::new(cfg)
    }

    fn fenced(a: &[Action]) -> Option<FenceReason> {
        a.iter().find_map(|x| match x {
            Action::Event(Event::Fenced { reason, .. }) => Some(*reason),
            _ => None,
        })
    }

    /// The `Evicted` messages among `a`: receiver, diverged, updates.
    fn evicted_msgs(a: &[Action]) -> Vec<(NodeId, bool, u32)> {
        sends(a)
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Evicted { diverged, updates } => Some((to, *diverged, *updates)),
                _ => None,
            })
            .collect()
    }

    fn evictions(a: &[Action]) -> Vec<(NodeId, bool)> {
        evicted_msgs(a)
            .into_iter()
            .map(|(t, d, _)| (t, d))
            .collect()
    }

    /// A node whose own tick comes later than the suspicion time (it was
    /// paused) stops serving its group and joins again; one on time does
    /// not; a node alone in its stage keeps serving.
    #[test]
    fn a_paused_node_fences_itself_and_rejoins() {
        let cfg = fencing();
        let mut n = started_with(cfg.clone(), 5, 2, &[3, 7], &[(30, 3), (10, 1)]);
        let t = n.timeout().unwrap();
        assert_eq!(fenced(&n.on_timeout(t)), None);
        let t = n.timeout().unwrap() + n.suspicion() + 1;
        let a = n.on_timeout(t);
        assert!(matches!(fenced(&a), Some(FenceReason::Paused { .. })));
        // It said goodbye to everyone, holds no group, and asks the stages.
        let goodbyes: BTreeSet<NodeId> = (sends(&a).into_iter())
            .filter(|(_, m)| matches!(m, Msg::Goodbye))
            .map(|(to, _)| to)
            .collect();
        assert_eq!(goodbyes, BTreeSet::from([3, 7, 10, 30]));
        assert!(!n.is_active());
        assert!(sends(&a).iter().any(|(_, m)| matches!(m, Msg::StageQuery)));
        assert_eq!(n.incarnation, 1);
        // Alone in its stage: nothing to come back to, it serves on.
        let mut alone = started_with(cfg, 5, 2, &[], &[(30, 3)]);
        let t = alone.timeout().unwrap() + alone.suspicion() + 1;
        assert_eq!(fenced(&alone.on_timeout(t)), None);
        assert!(alone.is_active());
    }

    /// Two relays of one stage paused a few seconds apart: the first back
    /// serves the weights it kept (fewer updates), the second wakes alone
    /// in its own view (it took the first for dead) and does not fence.
    /// Neither is in the other's group: the one alone tells the node it
    /// took for dead how many updates it holds, and the one behind gives
    /// way (a local run stood as two groups for the rest of the run).
    #[test]
    fn a_node_alone_after_a_pause_tells_its_stage_and_the_group_behind_gives_way() {
        let cfg = fencing();
        let mut b = started_with(cfg.clone(), 5, 2, &[6], &[(30, 3)]);
        b.iters.downloaded((14, 77));
        b.handle(b.now, Input::PeerLost { peer: 6 });
        let t = b.timeout().unwrap() + b.suspicion() + 1;
        let a = b.on_timeout(t);
        assert_eq!(fenced(&a), None);
        assert!(b.is_active());
        let told: Vec<(NodeId, u32)> = (sends(&a).into_iter())
            .filter_map(|(to, m)| match m {
                Msg::Heartbeat {
                    members: None,
                    coord: 5,
                    updates,
                    ..
                } => Some((to, *updates)),
                _ => None,
            })
            .collect();
        assert_eq!(told, vec![(6, 15)]);
        // Node 6 serves the stage alone from weights with 5 updates: it
        // dissolves and downloads node 5's state.
        let mut k = started_with(cfg, 6, 2, &[], &[(30, 3)]);
        k.learn(5, 2);
        k.iters.downloaded((4, 99));
        let a = deliver(&mut k, 5, heartbeat(5, 15));
        assert_eq!(
            fenced(&a),
            Some(FenceReason::Behind {
                updates: 15,
                holder: 5
            })
        );
    }

    /// Without `fence_on_pause` (the simulator) a late tick fences nothing.
    #[test]
    fn the_simulator_never_fences_on_a_late_tick() {
        let mut n = started(Policy::Gwtf, 5, 2, &[3, 7], &[]);
        let t = n.timeout().unwrap() + 10 * n.suspicion();
        assert_eq!(fenced(&n.on_timeout(t)), None);
        assert!(n.is_active());
    }

    /// A coordinator that drops a silent member answers its next group
    /// messages with `Evicted` (its claims are refused) until it comes back
    /// as a later incarnation; the member that hears it fences itself.
    #[test]
    fn a_member_lost_that_introduces_itself_again_is_no_member() {
        let mut c = started_with(fencing(), 1, 2, &[2, 3], &[]);
        assert!(c.group.members().contains(&2));
        deliver(&mut c, 2, Msg::Goodbye);
        assert!(!c.group.members().contains(&2));
        // Fenced, it joins again and introduces itself with its old stage
        // before it chose one: still no member (it may choose another).
        let intro = Msg::Introduce {
            iter: 0,
            stage: 2,
            spare: 1,
            compute_s: 0.5,
            sent_at: SEC,
            echo: None,
        };
        deliver(&mut c, 2, intro.clone());
        assert!(!c.group.members().contains(&2));
        assert!(!c.stage_members().contains(&2));
        // A node never dropped that introduces itself is one.
        deliver(&mut c, 4, intro);
        assert!(c.group.members().contains(&4));
    }

    #[test]
    fn a_dropped_member_is_told_and_comes_back_only_as_a_new_incarnation() {
        let cfg = fencing();
        let mut c = started_with(cfg.clone(), 1, 2, &[2, 3], &[]);
        hear_only_from(&mut c, 3, SEC);
        assert!(!c.group.members().contains(&2));
        let a = deliver(
            &mut c,
            2,
            Msg::Heartbeat {
                members: None,
                coord: 1,
                updates: 0,
                version: 0,
            },
        );
        assert_eq!(evictions(&a), vec![(2, false)]);
        let mb = MbId {
            holder: 0,
            iter: 0,
            idx: 0,
        };
        let claim = Msg::Claim {
            iter: 0,
            mb,
            prev: 10,
            next: 30,
        };
        let a = deliver(&mut c, 2, claim.clone());
        assert_eq!(evictions(&a), vec![(2, false)]);
        assert!(!c.group.members().contains(&2));
        // Its old incarnation's GroupJoin (a sync to a coordinator it took
        // for new) does not bring it back; the next one does.
        let join = |incarnation| Msg::GroupJoin {
            stage: 2,
            incarnation,
        };
        let a = deliver(&mut c, 2, join(0));
        assert_eq!(evictions(&a), vec![(2, false)]);
        assert!(!c.group.members().contains(&2));
        deliver(&mut c, 2, join(1));
        assert!(c.group.members().contains(&2));
        let a = deliver(&mut c, 2, claim);
        assert!(evictions(&a).is_empty());
        assert!(sends(&a)
            .iter()
            .any(|(to, m)| *to == 2 && matches!(m, Msg::ClaimReply { granted: true, .. })));

        // The member's side: told by its coordinator, it fences itself.
        let mut m = started_with(cfg, 2, 2, &[1, 3], &[(30, 3)]);
        let a = deliver(
            &mut m,
            1,
            Msg::Evicted {
                diverged: false,
                updates: 0,
            },
        );
        assert_eq!(fenced(&a), Some(FenceReason::Evicted { diverged: false }));
        assert!(!m.is_active());
    }

    /// A member that takes over from a dead coordinator does not drop (and
    /// evict) a member that still follows the old one: that member notices
    /// the death up to a suspicion period later, and only then turns to
    /// the new coordinator.
    #[test]
    fn a_new_coordinator_gives_its_members_time_to_notice_the_change() {
        let cfg = fencing();
        let mut n = started_with(cfg.clone(), 5, 2, &[3, 7], &[(30, 3)]);
        n.handle(2 * SEC, Input::PeerLost { peer: 3 });
        assert_eq!(n.coordinator(), Some(5));
        // Member 7 says nothing for more than one suspicion period (it
        // still heartbeats the dead coordinator), then turns to us.
        let mut t = 2 * SEC;
        let until = t + n.suspicion() + cfg.tick;
        while t < until {
            t += cfg.tick;
            deliver(&mut n, 30, Msg::QueryFlows);
            n.on_timeout(t);
        }
        assert!(n.group.members().contains(&7), "dropped during the grace");
        let a = deliver(
            &mut n,
            7,
            Msg::Heartbeat {
                members: None,
                coord: 5,
                updates: 0,
                version: 0,
            },
        );
        assert!(evictions(&a).is_empty());
    }

    /// A member whose coordinator went silent, and which heard from nobody
    /// else either, is the one cut off: it fences itself instead of
    /// coordinating a group of its own. One that still hears others takes
    /// over as before.
    #[test]
    fn a_cut_off_member_does_not_coordinate_a_group_of_its_own() {
        let cfg = fencing();
        let run = |hear_others: bool| {
            let mut n = started_with(cfg.clone(), 5, 2, &[3], &[(30, 3)]);
            let mut t = SEC;
            let mut reason = None;
            for _ in 0..(cfg.suspect_ticks + 2 * cfg.heartbeat_ticks) {
                t += cfg.tick;
                if hear_others {
                    deliver(&mut n, 30, Msg::QueryFlows);
                }
                reason = reason.or(fenced(&n.on_timeout(t)));
            }
            (n, reason)
        };
        let (n, reason) = run(false);
        assert_eq!(reason, Some(FenceReason::Isolated));
        assert_eq!(n.coordinator(), None);
        let (n, reason) = run(true);
        assert_eq!(reason, None);
        assert_eq!(n.coordinator(), Some(5));
    }

    /// A node cut off just after it heard a neighbour (its coordinator's
    /// or its member's last heartbeat came earlier) is not isolated yet
    /// when the group peer's silence trips: it must not take that peer for
    /// dead and run on as a group of one (alone, it could never fence
    /// itself; in a swarm the cut relay never came back). It waits, and
    /// fences itself once isolated; hearing anyone after the peer's
    /// silence began shows that the peer is the silent one.
    #[test]
    fn a_node_cut_off_after_hearing_a_neighbour_does_not_run_alone() {
        let cfg = fencing();
        // (this node, its group, the group peer that falls silent, the
        // neighbour heard just before the cut, whether it hears one after)
        let run = |id: NodeId, group: &[NodeId], peer: NodeId, later: bool| {
            let mut n = started_with(cfg.clone(), id, 2, group, &[(30, 3), (10, 1)]);
            let coord = n.coordinator().unwrap();
            let mut t = n.now;
            let mut alone_at = None;
            let mut reason = None;
            for i in 0..(3 * cfg.suspect_ticks + 2 * cfg.heartbeat_ticks) {
                t += cfg.tick;
                if i == 0 {
                    let hb = Msg::Heartbeat {
                        members: None,
                        coord,
                        updates: 0,
                        version: 0,
                    };
                    deliver(&mut n, peer, hb);
                }
                if i == cfg.suspect_ticks / 2 || (later && i > cfg.suspect_ticks) {
                    deliver(&mut n, 30, Msg::QueryFlows);
                }
                reason = reason.or(fenced(&n.on_timeout(t)));
                if reason.is_none() && n.group.members().len() == 1 {
                    alone_at = alone_at.or(Some(i));
                }
            }
            (reason, alone_at, n)
        };
        // A member whose coordinator 21 falls silent.
        let (reason, alone, n) = run(22, &[21], 21, false);
        assert_eq!(alone, None, "took its coordinator for dead while cut off");
        assert_eq!(reason, Some(FenceReason::Isolated));
        assert_eq!(n.coordinator(), None);
        // A coordinator whose member 22 falls silent.
        let (reason, alone, _) = run(21, &[22], 22, false);
        assert_eq!(alone, None, "dropped its member while cut off");
        assert_eq!(reason, Some(FenceReason::Isolated));
        // Heard from after the silence: the peer is the silent one.
        let (reason, alone, n) = run(22, &[21], 21, true);
        assert_eq!(reason, None);
        assert!(alone.is_some());
        assert_eq!(n.coordinator(), Some(22));
        let (reason, _, n) = run(21, &[22], 22, true);
        assert_eq!(reason, None);
        assert_eq!(n.group.members().iter().copied().collect::<Vec<_>>(), [21]);
    }

    /// Coordinator 1 of members 2 and 3, its commit of iteration 4 (epoch
    /// 9) all-reduced, with one grant per owner in `owners`; 1 and 2 report
    /// weights 77, then 3 reports 55: the coordinator and what it did.
    fn commit_with_digests_77_77_55(owners: &[NodeId]) -> (Node, Vec<Action>) {
        let mut c = started_with(fencing(), 1, 2, &[2, 3], &[(10, 1), (30, 3)]);
        let granted = (owners.iter().enumerate())
            .map(|(i, &o)| (mb(10, 4, i as u32), (o, 10, 30)))
            .collect();
        c.coordinating.coord_iters.insert(
            4,
            CoordIter::running(
                9,
                BTreeSet::from([1, 2, 3]),
                BTreeMap::from([(1, 77), (2, 77)]),
                granted,
            ),
        );
        assert!(c.diverged_members(4).is_empty());
        let done = Msg::AggDone {
            iter: 4,
            epoch: 9,
            weights: 55,
        };
        let a = deliver(&mut c, 3, done);
        (c, a)
    }

    /// The members' digests after the all-reduce: a member in the minority
    /// is evicted before anything is applied, and the others commit again
    /// without it; its grants are recomputed.
    #[test]
    fn a_member_whose_weights_differ_is_evicted_before_the_apply() {
        // Each member's gradients are in the mean.
        let (mut c, a) = commit_with_digests_77_77_55(&[1, 2, 3]);
        assert_eq!(evictions(&a), vec![(3, true)]);
        assert!(!a.iter().any(|x| matches!(
            x,
            Action::Send {
                msg: Msg::Applied { .. },
                ..
            }
        )));
        assert!(a
            .iter()
            .any(|x| matches!(x, Action::Event(Event::ReplicasDiverged { iter: 4, .. }))));
        assert!(!c.group.members().contains(&3));
        assert!(!c.coordinating.coord_iters[&4].is_applied());
        // A tie goes to the coordinator's own weights.
        c.coordinating
            .coord_iters
            .get_mut(&4)
            .unwrap()
            .set_digests(BTreeMap::from([(1, 5), (2, 6)]));
        assert_eq!(c.diverged_members(4), vec![2]);
    }

    /// A member that granted nothing in a commit (a zero share) is not
    /// compared: its weights may be behind by an update it has not heard
    /// of yet (a joiner's state exported just before it); the commit is
    /// applied and the member stays. In a swarm such a joiner was evicted
    /// as diverged and had to download the state a third time.
    #[test]
    fn a_member_that_granted_nothing_is_not_taken_for_diverged() {
        // Member 3 granted nothing.
        let (c, a) = commit_with_digests_77_77_55(&[1, 2]);
        assert!(evictions(&a).is_empty(), "{:?}", evictions(&a));
        assert!(c.group.members().contains(&3));
        assert!(c.coordinating.coord_iters[&4].is_applied());
        assert!(!a
            .iter()
            .any(|x| matches!(x, Action::Event(Event::ReplicasDiverged { .. }))));
        assert!(sends(&a)
            .iter()
            .any(|(to, m)| *to == 3 && matches!(m, Msg::Applied { iter: 4, .. })));
    }

    /// Two coordinators of one stage whose weights hold as many updates:
    /// the one with the larger id that evicts the other is evicted in
    /// return and the smaller keeps its group; an eviction from a smaller
    /// coordinator is obeyed.
    #[test]
    fn of_two_coordinators_even_in_updates_the_smaller_keeps_its_group() {
        let mut c = started_with(fencing(), 1, 2, &[3], &[(30, 3)]);
        c.learn(2, 2);
        c.iters.downloaded((4, 77));
        assert_eq!(c.coordinator(), Some(1));
        let evict = |updates| Msg::Evicted {
            diverged: false,
            updates,
        };
        let a = deliver(&mut c, 2, evict(5));
        assert_eq!(fenced(&a), None);
        assert_eq!(evicted_msgs(&a), vec![(2, false, 5)]);
        assert!(c.is_active() && c.group.members().contains(&3));
        // The larger one obeys the smaller's eviction.
        let mut d = started_with(fencing(), 2, 2, &[4], &[(30, 3)]);
        d.learn(1, 2);
        d.iters.downloaded((4, 77));
        let a = deliver(&mut d, 1, evict(5));
        assert!(fenced(&a).is_some());
    }

    /// A coordinator paused and fenced gets a member's claim sent before it
    /// woke: it names no coordinator (its group is forgotten), and a member
    /// handed a list that lacks the coordinator it names, or lacks the
    /// member, by a smaller id that is not its coordinator, keeps its group
    /// (in a swarm, member 13 took such an answer from the fenced node 11
    /// for a smaller coordinator's and ran alone as a group of one).
    #[test]
    fn a_fenced_node_draws_no_member_into_a_group_of_its_own() {
        let cfg = fencing();
        let mut old = started_with(cfg.clone(), 11, 2, &[12, 13], &[(30, 3), (10, 1)]);
        let t = old.timeout().unwrap() + old.suspicion() + 1;
        assert!(fenced(&old.on_timeout(t)).is_some());
        let claim = Msg::Claim {
            iter: 3,
            mb: mb(1, 3, 0),
            prev: 10,
            next: 30,
        };
        let a = deliver(&mut old, 13, claim);
        assert!(
            !sends(&a)
                .iter()
                .any(|(_, m)| matches!(m, Msg::Heartbeat { .. })),
            "a fenced node answers as if it knew a group: {:?}",
            sends(&a)
        );

        // Member 13 follows 12; lists from 11 that are no group it is in.
        let mut m = started_with(cfg, 13, 2, &[12], &[(30, 3)]);
        assert_eq!(m.coordinator(), Some(12));
        for members in [vec![], vec![11, 12], vec![12, 13]] {
            let hb = Msg::Heartbeat {
                members: Some(Arc::new(members.clone())),
                coord: 11,
                updates: 0,
                version: 0,
            };
            deliver(&mut m, 11, hb);
            assert_eq!(m.coordinator(), Some(12), "followed 11's list {members:?}");
            assert!(m.group.members().contains(&12));
        }
        // A smaller coordinator's group that holds it is still joined.
        let hb = Msg::Heartbeat {
            members: Some(Arc::new(vec![11, 12, 13])),
            coord: 11,
            updates: 0,
            version: 0,
        };
        deliver(&mut m, 11, hb);
        assert_eq!(m.coordinator(), Some(11));
    }

    /// A data holder that fenced itself waits for another holder's state
    /// only while one lives: with every other holder gone for
    /// `e2e_timeout` it is stranded (an event; the runtime ends it with an
    /// error) instead of asking a dead address for ever.
    #[test]
    fn a_fenced_holder_with_no_live_holder_left_is_stranded() {
        let cfg = fencing();
        let mut h = started_with(cfg.clone(), 1, 0, &[2], &[(10, 1), (20, 2)]);
        let t = h.timeout().unwrap() + h.suspicion() + 1;
        assert!(fenced(&h.on_timeout(t)).is_some());
        assert_eq!(h.downloading_from(), Some(2));
        let stranded = |a: &[Action]| {
            a.iter()
                .any(|x| matches!(x, Action::Event(Event::Stranded { stage: 0, .. })))
        };
        // Holder 2 finished and left.
        let mut t = t + cfg.tick;
        assert!(!stranded(&h.handle(t, Input::PeerLost { peer: 2 })));
        let until = t + cfg.e2e_timeout + 2 * cfg.tick;
        let mut seen = None;
        while t < until && seen.is_none() {
            t += cfg.tick;
            if stranded(&h.on_timeout(t)) {
                seen = Some(t);
            }
        }
        let at = seen.expect("stranded");
        assert!(at >= until - 2 * cfg.tick, "stranded before e2e_timeout");
        assert!(!h.is_active());
        // While another holder lives, it waits for its state.
        let mut w = started_with(cfg.clone(), 1, 0, &[2, 3], &[(10, 1)]);
        let t = w.timeout().unwrap() + w.suspicion() + 1;
        assert!(fenced(&w.on_timeout(t)).is_some());
        let mut t = t + cfg.tick;
        w.handle(t, Input::PeerLost { peer: 2 });
        for _ in 0..(cfg.e2e_timeout / cfg.tick + 5) {
            t += cfg.tick;
            assert!(!stranded(&w.on_timeout(t)), "stranded with holder 3 alive");
        }
    }

    /// A member's heartbeat naming coordinator `coord`.
    fn heartbeat(coord: NodeId, updates: u32) -> Msg {
        Msg::Heartbeat {
            members: None,
            coord,
            updates,
            version: 0,
        }
    }

    /// A stage split while links were cut: the group that stayed behind
    /// hears a node of its stage outside it whose weights hold more
    /// updates. It dissolves (its members are told, its coordinator
    /// fences itself) instead of evicting that node, and downloads that
    /// node's state, refusing an older one while that node lives. An
    /// outsider that is not ahead is evicted as before.
    #[test]
    fn a_group_left_behind_dissolves_instead_of_evicting_the_node_ahead() {
        let cfg = fencing();
        let mut c = started_with(cfg.clone(), 1, 2, &[3], &[(30, 3)]);
        c.learn(2, 2);
        c.iters.downloaded((4, 77));
        let hb = |updates| heartbeat(2, updates);
        // Not ahead (5 updates, as many as the group's): evicted.
        let a = deliver(&mut c, 2, hb(5));
        assert_eq!(evicted_msgs(&a), vec![(2, false, 5)]);
        assert!(c.is_active());
        // Ahead (8 updates): the group dissolves and nobody evicts node 2.
        let a = deliver(&mut c, 2, hb(8));
        assert_eq!(evicted_msgs(&a), vec![(3, false, 8)]);
        assert_eq!(
            fenced(&a),
            Some(FenceReason::Behind {
                updates: 8,
                holder: 2
            })
        );
        assert!(!c.is_active());
        assert_eq!(c.newest_source(2), Some(2));
        // A download from another node of the stage that serves weights
        // older than node 2's is refused: node 2 is asked.
        c.download(2, 3);
        let old = Msg::StateResponse {
            version: (4, 77),
            members: Arc::new(vec![3]),
            bytes: 0,
            coord: 3,
        };
        let a = deliver(&mut c, 3, old);
        assert!(!c.is_active());
        assert!(sends(&a)
            .iter()
            .any(|(to, m)| *to == 2 && matches!(m, Msg::StateRequest)));
        let new = Msg::StateResponse {
            version: (7, 99),
            members: Arc::new(vec![2]),
            bytes: 0,
            coord: 2,
        };
        deliver(&mut c, 2, new);
        assert!(c.is_active());
        assert_eq!((c.version(), c.newest_source(2)), ((7, 99), None));

        // A member may lag by the update in flight: a node outside its
        // group one update ahead is no sign of a split, two are.
        let mut m = started_with(cfg.clone(), 3, 2, &[1], &[(30, 3)]);
        m.learn(4, 2);
        m.iters.downloaded((4, 77));
        let hb = |updates| heartbeat(1, updates);
        assert_eq!(fenced(&deliver(&mut m, 4, hb(6))), None);
        let a = deliver(&mut m, 4, hb(7));
        assert!(matches!(
            fenced(&a),
            Some(FenceReason::Behind { holder: 4, .. })
        ));

        // A member of the dissolved group, told by its coordinator that
        // weights with 8 updates exist, fences itself too.
        let mut m = started_with(cfg, 3, 2, &[1], &[(30, 3)]);
        m.iters.downloaded((4, 77));
        let a = deliver(
            &mut m,
            1,
            Msg::Evicted {
                diverged: false,
                updates: 8,
            },
        );
        assert!(fenced(&a).is_some() && !m.is_active());
    }

    /// A member dropped as silent whose weights hold more updates than its
    /// evictor's (the evictor's group fell behind while this node's link
    /// was cut) keeps them and answers in kind: the evictor, now behind,
    /// fences itself. An eviction for diverged weights is always obeyed.
    #[test]
    fn a_member_ahead_of_its_evictor_keeps_its_weights() {
        let cfg = fencing();
        let evicted = |diverged, updates| Msg::Evicted { diverged, updates };
        let mut m = started_with(cfg.clone(), 2, 2, &[1, 3], &[(30, 3)]);
        m.iters.downloaded((7, 99));
        let a = deliver(&mut m, 1, evicted(false, 5));
        assert_eq!((fenced(&a), evicted_msgs(&a)), (None, vec![(1, false, 8)]));
        assert!(m.is_active());
        // Equal weights: the coordinator's word stands.
        let a = deliver(&mut m, 1, evicted(false, 8));
        assert_eq!(fenced(&a), Some(FenceReason::Evicted { diverged: false }));
        let mut d = started_with(cfg.clone(), 2, 2, &[1, 3], &[(30, 3)]);
        d.iters.downloaded((7, 99));
        let a = deliver(&mut d, 1, evicted(true, 5));
        assert_eq!(fenced(&a), Some(FenceReason::Evicted { diverged: true }));

        // The evictor's side: the answer says it is behind.
        let mut c = started_with(cfg, 1, 2, &[3], &[(30, 3)]);
        c.learn(2, 2);
        c.iters.downloaded((4, 77));
        let a = deliver(&mut c, 2, evicted(false, 8));
        assert_eq!(
            fenced(&a),
            Some(FenceReason::Behind {
                updates: 8,
                holder: 2
            })
        );
    }

    /// A node ahead never joins a group behind it: of two coordinators
    /// that hear of each other the smaller id's list is followed (by a
    /// download when both groups hold as many updates), but not when its
    /// group's weights hold fewer updates (the newer weights
    /// would be the minority of its digests, and evicted as diverged).
    /// Told by a member of its list that holds more, the group behind
    /// dissolves and downloads from it.
    #[test]
    fn a_node_ahead_never_follows_a_group_behind_it() {
        let cfg = fencing();
        let mut ahead = started_with(cfg.clone(), 7, 2, &[], &[(30, 3)]);
        ahead.learn(3, 2);
        ahead.iters.downloaded((7, 99));
        let list_of = |updates, version| Msg::Heartbeat {
            members: Some(Arc::new(vec![3, 5, 7])),
            coord: 3,
            updates,
            version,
        };
        let list = |updates| list_of(updates, 0);
        deliver(&mut ahead, 3, list(5));
        assert_eq!(ahead.group.coord(), Some(7));
        assert!(!ahead.group.members().contains(&3) && ahead.is_active());
        // As many updates in the same weights version: the smaller id's
        // group is followed, as before.
        let mut same = started_with(cfg.clone(), 7, 2, &[], &[(30, 3)]);
        same.learn(3, 2);
        same.iters.downloaded((7, 99));
        let a = deliver(&mut same, 3, list_of(8, 99));
        assert!(evicted_msgs(&a).is_empty() && fenced(&a).is_none());
        assert_eq!(same.group.coord(), Some(3));
        // As many updates in another version: equal updates need not be
        // equal weights, so the larger coordinator does not follow the
        // smaller's list into one group with two weights; it gives way and
        // downloads its state.
        let a = deliver(&mut ahead, 3, list(8));
        assert_eq!(
            fenced(&a),
            Some(FenceReason::Behind {
                updates: 8,
                holder: 3
            })
        );
        assert!(!ahead.group.members().contains(&3) && !ahead.is_active());

        // The group behind: its coordinator, told by a member of its list
        // that holds 8 updates, tells its other members and downloads
        // from that member.
        let mut behind = started_with(cfg, 3, 2, &[5, 7], &[(30, 3)]);
        behind.iters.downloaded((4, 77));
        let a = deliver(
            &mut behind,
            7,
            Msg::Evicted {
                diverged: false,
                updates: 8,
            },
        );
        assert_eq!(evicted_msgs(&a), vec![(5, false, 8)]);
        assert_eq!(
            fenced(&a),
            Some(FenceReason::Behind {
                updates: 8,
                holder: 7
            })
        );
        assert_eq!(behind.newest_source(2), Some(7));
    }

    /// A node whose weights miss an update the stage applied (it joined on
    /// a stale state; its runtime downloads again) counts the updates it
    /// holds, not the iterations it was told of, and serves no state
    /// meanwhile: a joiner would take that state for the stage's.
    #[test]
    fn a_node_whose_weights_miss_an_update_serves_no_state() {
        let mut m = started_with(fencing(), 3, 2, &[1], &[(30, 3)]);
        m.iters.downloaded((11, 7));
        deliver(
            &mut m,
            1,
            Msg::Applied {
                iter: 18,
                version: 9,
            },
        );
        assert_eq!(m.iters.updates(), 12, "{:?}", m.iters);
        assert!(m.iters.gap(), "{:?}", m.iters);
        let a = deliver(&mut m, 40, Msg::StateRequest);
        let to_40: Vec<&str> = (sends(&a).into_iter())
            .filter(|(to, _)| *to == 40)
            .map(|(_, m)| m.name())
            .collect();
        // It says how many updates it holds instead (the joiner asks
        // another member, or serves newer weights it kept).
        assert_eq!(to_40, ["Heartbeat"]);
        assert!(sends(&a).iter().any(|(to, m)| *to == 40
            && matches!(
                m,
                Msg::Heartbeat {
                    members: None,
                    updates: 12,
                    coord: 1,
                    ..
                }
            )));
        // The state downloaded again closes the gap: it serves again.
        deliver(
            &mut m,
            1,
            Msg::StateResponse {
                version: (18, 9),
                members: Arc::new(vec![1, 3]),
                bytes: 0,
                coord: 1,
            },
        );
        assert_eq!(m.iters.updates(), 19);
        let a = deliver(&mut m, 40, Msg::StateRequest);
        assert!(sends(&a)
            .iter()
            .any(|(to, m)| *to == 40 && matches!(m, Msg::StateResponse { .. })));
    }

    /// Two joiners took up one emptied relay stage at once, each as a group
    /// of one: each coordinator tells the live nodes of its stage outside
    /// its group, now and then, how many updates its weights hold (not a
    /// joiner it serves a state to, nor anyone in a stage with one group);
    /// of two even in updates, the larger coordinator's group dissolves
    /// and downloads the smaller's state, and the smaller keeps its group.
    /// (The group behind dissolving is `a_group_behind_finds_the_node_ahead`.)
    #[test]
    fn two_groups_of_one_stage_find_each_other_and_the_larger_gives_way() {
        let cfg = fencing();
        let mut big = started_with(cfg.clone(), 9, 2, &[], &[(30, 3)]);
        big.learn(5, 2);
        big.learn(8, 2);
        big.iters.downloaded((10, 77));
        assert_eq!(big.coordinator(), Some(9));
        // Node 8 downloads this node's state: it is not told.
        deliver(&mut big, 8, Msg::StateRequest);
        let mut t = big.now;
        let mut told = Vec::new();
        for _ in 0..2 * RIVAL_TELL_SUSPICIONS * cfg.suspect_ticks as u64 {
            t += cfg.tick;
            deliver(&mut big, 30, Msg::QueryFlows);
            let a = big.on_timeout(t);
            for (to, m) in sends(&a) {
                if let Msg::Heartbeat {
                    members: None,
                    coord: 9,
                    updates,
                    ..
                } = m
                {
                    told.push((to, *updates));
                }
            }
        }
        assert_eq!(told, vec![(5, 11), (5, 11)]);

        // Node 5, the smaller coordinator even in updates, keeps its group.
        let mut small = started_with(cfg.clone(), 5, 2, &[], &[(30, 3)]);
        small.learn(9, 2);
        small.iters.downloaded((10, 78));
        let a = deliver(&mut small, 9, heartbeat(9, 11));
        assert_eq!(fenced(&a), None);
        assert!(small.is_active() && small.coordinator() == Some(5));
        // Node 9 keeps its group when node 5's weights are its own version
        // (the same weights: the smaller's eviction merges them) ...
        let same = Msg::Heartbeat {
            members: None,
            coord: 5,
            updates: 11,
            version: 77,
        };
        let a = deliver(&mut big, 5, same);
        assert_eq!(fenced(&a), None);
        assert!(big.is_active());
        // ... and gives way to other weights.
        let a = deliver(&mut big, 5, heartbeat(5, 11));
        assert_eq!(
            fenced(&a),
            Some(FenceReason::Behind {
                updates: 11,
                holder: 5
            })
        );
        assert_eq!(big.newest_source(2), Some(5));
        // A member's word (it names another coordinator) is no rival's.
        let mut other = started_with(cfg.clone(), 9, 2, &[], &[(30, 3)]);
        other.learn(5, 2);
        other.iters.downloaded((10, 77));
        let a = deliver(&mut other, 5, heartbeat(4, 11));
        assert_eq!(fenced(&a), None);
    }

    /// A group behind (its weights miss updates its coordinator committed:
    /// it came back on a stale state) looks for the stage's state: it
    /// tells the nodes of its stage outside its group how many updates it
    /// holds; a node ahead, a member of another group, answers with an
    /// eviction carrying its own, and the group behind downloads from it.
    #[test]
    fn a_group_behind_finds_the_node_ahead() {
        let cfg = fencing();
        let mut behind = started_with(cfg.clone(), 3, 2, &[], &[(30, 3)]);
        behind.learn(7, 2);
        behind.iters.downloaded((11, 7));
        let applied = Msg::Applied {
            iter: 18,
            version: 9,
        };
        deliver(&mut behind, 3, applied);
        assert!(behind.iters.gap());
        let mut t = behind.now;
        let mut told = None;
        for _ in 0..2 * cfg.suspect_ticks {
            t += cfg.tick;
            // A neighbour heard: not cut off.
            deliver(&mut behind, 30, Msg::QueryFlows);
            let a = behind.on_timeout(t);
            told = told.or(sends(&a).into_iter().find_map(|(to, m)| match m {
                Msg::Heartbeat { updates, .. } if to == 7 => Some(*updates),
                _ => None,
            }));
        }
        assert_eq!(told, Some(12));

        // Node 7, a member of another group, holds 18 updates.
        let mut ahead = started_with(cfg.clone(), 7, 2, &[5], &[(30, 3)]);
        ahead.iters.downloaded((17, 9));
        let hb = |updates| heartbeat(3, updates);
        let a = deliver(&mut ahead, 3, hb(12));
        assert_eq!(evicted_msgs(&a), vec![(3, false, 18)]);
        // Not behind: nothing to say.
        let a = deliver(&mut ahead, 3, hb(18));
        assert!(evicted_msgs(&a).is_empty());

        let a = deliver(
            &mut behind,
            7,
            Msg::Evicted {
                diverged: false,
                updates: 18,
            },
        );
        assert_eq!(
            fenced(&a),
            Some(FenceReason::Behind {
                updates: 18,
                holder: 7
            })
        );
        assert_eq!(behind.newest_source(2), Some(7));
        // Without a gap, no announcement: node 7 hears only the word every
        // coordinator says to the other groups of its stage, once per
        // `RIVAL_TELL_SUSPICIONS` suspicion times (`tell_rival_groups`),
        // not the gap's, once per suspicion time.
        let mut fine = started_with(cfg.clone(), 3, 2, &[], &[(30, 3)]);
        fine.learn(7, 2);
        let mut t = fine.now;
        let mut told = 0;
        for _ in 0..RIVAL_TELL_SUSPICIONS * cfg.suspect_ticks as u64 {
            t += cfg.tick;
            deliver(&mut fine, 30, Msg::QueryFlows);
            let a = fine.on_timeout(t);
            told += sends(&a).iter().filter(|(to, _)| *to == 7).count();
        }
        assert_eq!(told, 1);
    }

    /// The members holding a stage's latest update were all cut off and
    /// fenced; the member left missed that update. A fenced node keeps its
    /// weights (whole, not known wrong): when the member it downloads from
    /// answers with fewer updates, coordinates its group and no other live
    /// node of the stage is known, it serves the kept weights again, and
    /// the member behind, announcing its gap, is told to download them.
    #[test]
    fn a_fenced_node_serves_its_kept_weights_when_the_stage_is_behind_them() {
        let cfg = fencing();
        let fenced_node = |reason| {
            let mut n = started_with(cfg.clone(), 3, 2, &[5], &[(30, 3)]);
            n.iters.downloaded((13, 77));
            n.fence(reason);
            let v = n.kept_version();
            n.download(2, 5);
            (n, v)
        };
        let kept_event = |a: &[Action]| {
            a.iter().find_map(|x| match x {
                Action::Event(Event::StateKept { stage, applied }) => Some((*stage, *applied)),
                _ => None,
            })
        };
        let (mut n, kept) = fenced_node(FenceReason::Isolated);
        assert_eq!(kept, Some((13, 77)));
        assert_eq!(n.downloading_from(), Some(5));
        let a = deliver(&mut n, 5, heartbeat(5, 13));
        assert_eq!(kept_event(&a), Some((2, 13)));
        assert!(n.is_active() && n.group.coord() == Some(3), "{:?}", n.phase);
        assert_eq!(
            (n.iters.version(), n.iters.updates(), n.iters.gap()),
            ((13, 77), 14, false)
        );
        assert_eq!(n.kept_version(), None);
        // The member behind announces its gap: told to download ours.
        let a = deliver(&mut n, 5, heartbeat(5, 13));
        assert_eq!(evicted_msgs(&a), vec![(5, false, 14)]);

        // The source holds as many updates: the stage has them, asked of
        // another member (none here: the stages are asked again).
        let (mut n, _) = fenced_node(FenceReason::Isolated);
        let a = deliver(&mut n, 5, heartbeat(5, 14));
        assert_eq!(kept_event(&a), None);
        assert!(!n.is_active() && n.downloading_from().is_none());
        // The source's coordinator is another node (it may hold more).
        let (mut n, _) = fenced_node(FenceReason::Paused { gap: SEC });
        let a = deliver(&mut n, 5, heartbeat(9, 13));
        assert_eq!(kept_event(&a), None);
        // Another live node of the stage is known: it may serve more.
        let (mut n, _) = fenced_node(FenceReason::Isolated);
        n.learn(6, 2);
        let a = deliver(&mut n, 5, heartbeat(5, 13));
        assert_eq!(kept_event(&a), None);
        assert_eq!(n.downloading_from(), Some(6));
        // Weights known wrong are never kept.
        let (_, kept) = fenced_node(FenceReason::Diverged);
        assert_eq!(kept, None);
        let (_, kept) = fenced_node(FenceReason::Evicted { diverged: true });
        assert_eq!(kept, None);
    }
}
