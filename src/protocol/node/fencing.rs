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

impl Node {
    /// Microseconds of silence after which a group peer is suspected.
    pub(super) fn suspicion(&self) -> Time {
        self.cfg.suspect_ticks as Time * self.cfg.tick
    }

    /// The live members of this node's stage besides itself, as it knows
    /// them (someone to come back to).
    fn others_in_stage(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = (self.group.members.iter())
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
            return;
        }
        // Everyone it may have dealt with drops it at once, as at a leave.
        self.goodbye_to_all();
        self.incarnation += 1;
        let incarnation = self.incarnation;
        self.event(Event::Fenced {
            reason,
            incarnation,
        });
        self.forget_all();
        self.last_heard_any = self.now;
        if self.stage == 0 {
            // Holders hold the embedding and the head: another holder's
            // state, then training from the iteration open then.
            let src = others[0];
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
        let next_label = self.reservations.next_label;
        self.reservations = Reservations::default();
        self.reservations.next_label = next_label;
        let t0 = if self.stage == 0 {
            self.cfg.sa_t0_holder
        } else {
            self.cfg.sa_t0_relay
        };
        self.search = LocalSearch {
            sa_temp: t0,
            ..Default::default()
        };
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
        let inc = self.group.incarnations.get(&m).copied().unwrap_or(0);
        let e = self.group.evicted.entry(m).or_insert(inc + 1);
        *e = (*e).max(inc + 1);
    }

    /// Coordinator: the commits not applied yet whose all-reduce counts on
    /// `m` are given up (a new epoch follows once its grants are redone).
    pub(super) fn abandon_commits_with(&mut self, m: NodeId) {
        let iters: Vec<u32> = (self.coordinating.coord_iters.iter())
            .filter(|(_, ci)| !ci.applied && ci.commit.as_ref().is_some_and(|c| c.contains(&m)))
            .map(|(k, _)| *k)
            .collect();
        let retry_at = self.now + self.cfg.tick;
        for k in iters {
            if let Some(ci) = self.coordinating.coord_iters.get_mut(&k) {
                ci.retry_at = retry_at;
            }
            self.abandon_commit(k);
        }
    }

    /// Coordinator: whether a group message from `from` comes from an
    /// incarnation it dropped; if so it is told (and the message ignored).
    pub(super) fn refuse_evicted(&mut self, from: NodeId) -> bool {
        if from == self.id
            || self.group.coord != Some(self.id)
            || !self.group.evicted.contains_key(&from)
        {
            return false;
        }
        self.send(from, Msg::Evicted { diverged: false });
        true
    }

    /// Coordinator: a heartbeat from a node of this stage that is not a
    /// member (dropped as silent or lost while it went on): it is told.
    pub(super) fn heartbeat_from_outsider(&mut self, from: NodeId) {
        if self.group.coord != Some(self.id)
            || self.phase != Phase::Active
            || self.group.members.contains(&from)
        {
            return;
        }
        let of_stage = self.peers.get(&from).is_some_and(|p| p.stage == self.stage);
        if of_stage || self.group.evicted.contains_key(&from) {
            self.remember_evicted(from);
            self.send(from, Msg::Evicted { diverged: false });
        }
    }

    /// The coordinator (or a node of this stage that coordinates: this
    /// node's view may be the stale one) says this node is not a member.
    pub(super) fn on_evicted(&mut self, from: NodeId, diverged: bool) {
        let of_stage = self.group.coord == Some(from)
            || self.group.members.contains(&from)
            || self.peers.get(&from).is_some_and(|p| p.stage == self.stage);
        if !of_stage || self.phase != Phase::Active {
            return;
        }
        self.fence(FenceReason::Evicted { diverged });
    }

    /// The members of a commit whose weights differ from the majority's
    /// (ties: the coordinator's own, else the smallest digest): empty when
    /// every member that reported a digest holds the same weights.
    pub(super) fn diverged_members(&self, iter: u32) -> Vec<NodeId> {
        let Some(ci) = self.coordinating.coord_iters.get(&iter) else {
            return Vec::new();
        };
        let known: Vec<(NodeId, u64)> = (ci.agg_done.iter())
            .filter(|(_, d)| **d != 0)
            .map(|(m, d)| (*m, *d))
            .collect();
        if known.windows(2).all(|w| w[0].1 == w[1].1) {
            return Vec::new();
        }
        let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
        for (_, d) in &known {
            *counts.entry(*d).or_default() += 1;
        }
        let most = counts.values().copied().max().unwrap_or(0);
        let mine = ci.agg_done.get(&self.id).copied();
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
            .map(|ci| ci.agg_done.iter().map(|(m, d)| (*m, *d)).collect())
            .unwrap_or_default();
        self.event(Event::ReplicasDiverged {
            stage,
            iter,
            digests,
        });
        let retry_at = self.now + self.cfg.tick;
        if let Some(ci) = self.coordinating.coord_iters.get_mut(&iter) {
            ci.retry_at = retry_at;
        }
        self.abandon_commit(iter);
        if diverged.contains(&self.id) {
            self.fence(FenceReason::Diverged);
            return;
        }
        for m in diverged {
            self.remember_evicted(m);
            self.send(m, Msg::Evicted { diverged: true });
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

    fn evictions(a: &[Action]) -> Vec<(NodeId, bool)> {
        sends(a)
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Evicted { diverged } => Some((to, *diverged)),
                _ => None,
            })
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
    fn a_dropped_member_is_told_and_comes_back_only_as_a_new_incarnation() {
        let cfg = fencing();
        let mut c = started_with(cfg.clone(), 1, 2, &[2, 3], &[]);
        hear_only_from(&mut c, 3, SEC);
        assert!(!c.group.members.contains(&2));
        let a = deliver(
            &mut c,
            2,
            Msg::Heartbeat {
                members: None,
                coord: 1,
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
        assert!(!c.group.members.contains(&2));
        // Its old incarnation's GroupJoin (a sync to a coordinator it took
        // for new) does not bring it back; the next one does.
        let join = |incarnation| Msg::GroupJoin {
            stage: 2,
            incarnation,
        };
        let a = deliver(&mut c, 2, join(0));
        assert_eq!(evictions(&a), vec![(2, false)]);
        assert!(!c.group.members.contains(&2));
        deliver(&mut c, 2, join(1));
        assert!(c.group.members.contains(&2));
        let a = deliver(&mut c, 2, claim);
        assert!(evictions(&a).is_empty());
        assert!(sends(&a)
            .iter()
            .any(|(to, m)| *to == 2 && matches!(m, Msg::ClaimReply { granted: true, .. })));

        // The member's side: told by its coordinator, it fences itself.
        let mut m = started_with(cfg, 2, 2, &[1, 3], &[(30, 3)]);
        let a = deliver(&mut m, 1, Msg::Evicted { diverged: false });
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
        assert!(n.group.members.contains(&7), "dropped during the grace");
        let a = deliver(
            &mut n,
            7,
            Msg::Heartbeat {
                members: None,
                coord: 5,
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
                    };
                    deliver(&mut n, peer, hb);
                }
                if i == cfg.suspect_ticks / 2 || (later && i > cfg.suspect_ticks) {
                    deliver(&mut n, 30, Msg::QueryFlows);
                }
                reason = reason.or(fenced(&n.on_timeout(t)));
                if reason.is_none() && n.group.members.len() == 1 {
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
        assert_eq!(n.group.members.iter().copied().collect::<Vec<_>>(), [21]);
    }

    /// The members' digests after the all-reduce: a member in the minority
    /// is evicted before anything is applied, and the others commit again
    /// without it; its grants are recomputed.
    #[test]
    fn a_member_whose_weights_differ_is_evicted_before_the_apply() {
        let cfg = fencing();
        let mut c = started_with(cfg, 1, 2, &[2, 3], &[(10, 1), (30, 3)]);
        c.coordinating.coord_iters.insert(
            4,
            CoordIter {
                epoch: 9,
                commit: Some(BTreeSet::from([1, 2, 3])),
                agg_done: BTreeMap::from([(1, 77), (2, 77)]),
                ..Default::default()
            },
        );
        assert!(c.diverged_members(4).is_empty());
        let a = deliver(
            &mut c,
            3,
            Msg::AggDone {
                iter: 4,
                epoch: 9,
                weights: 55,
            },
        );
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
        assert!(!c.group.members.contains(&3));
        assert!(!c.coordinating.coord_iters[&4].applied);
        // A tie goes to the coordinator's own weights.
        c.coordinating.coord_iters.get_mut(&4).unwrap().agg_done = BTreeMap::from([(1, 5), (2, 6)]);
        assert_eq!(c.diverged_members(4), vec![2]);
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
            };
            deliver(&mut m, 11, hb);
            assert_eq!(m.coordinator(), Some(12), "followed 11's list {members:?}");
            assert!(m.group.members.contains(&12));
        }
        // A smaller coordinator's group that holds it is still joined.
        let hb = Msg::Heartbeat {
            members: Some(Arc::new(vec![11, 12, 13])),
            coord: 11,
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
}
