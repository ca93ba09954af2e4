//! The stage group's coordinator: exactly-once grants of claims, the end of
//! an iteration, commits, aggregation done, recomputation of lost grants.
use super::*;

/// The coordinator's state (when this node coordinates its stage).
#[derive(Debug, Default)]
pub(super) struct Coordinator {
    pub(super) coord_iters: BTreeMap<u32, CoordIter>,
    /// Syncs and claims that reached this node before it knew it
    /// coordinates (a member saw the old coordinator leave or die first):
    /// (when, from, message), replayed in order once it takes over.
    early_syncs: Vec<(Time, NodeId, Msg)>,
    /// When this node took over from a coordinator that is gone, and the
    /// iteration it believed came next then: the grants of that
    /// coordinator's own contributions (to these iterations) are lost with it
    /// and nobody can sync them, so what is still missing at their end is
    /// recomputed after a short grace for the members' syncs, not after
    /// `redo_timeout`.
    inherited: Option<(Time, u32)>,
    /// By iteration, the members whose sync of it reached this node since
    /// it took over from a coordinator that is gone: once every live
    /// member's has, nothing more can come for it, and its grace is over.
    /// (A member with nothing left of an iteration, applied already, syncs
    /// none: that iteration keeps its grace, time for this node's own
    /// apply.)
    synced: BTreeMap<u32, BTreeSet<NodeId>>,
    /// The members the last commit left out (see `without_stragglers`).
    left_out: BTreeSet<NodeId>,
}

#[derive(Clone, Debug)]
pub(super) struct Lost {
    prev: Option<NodeId>,
    next: Option<NodeId>,
    dead: NodeId,
    since: Time,
    level: u8,
}

/// Coordinator's state of one iteration of its stage.
#[derive(Clone, Debug, Default)]
pub(super) struct CoordIter {
    end: Option<(NodeId, Arc<Vec<NodeId>>)>,
    end_at: Time,
    granted: BTreeMap<MbId, (NodeId, NodeId, NodeId)>,
    lost: BTreeMap<MbId, Lost>,
    dropped: BTreeSet<MbId>,
    epoch: u64,
    commit: Option<BTreeSet<NodeId>>,
    /// The commit's member list as sent (the ring's order) and its digest,
    /// and when it was last sent: a member that has not reported its
    /// all-reduce a heartbeat period later is sent it again.
    commit_sent: Option<(Arc<Vec<NodeId>>, u64, Time)>,
    /// Members done with the commit's all-reduce, with their weights digest.
    agg_done: BTreeMap<NodeId, u64>,
    /// Members whose part of it failed, under a policy that then steps
    /// without it (SWARM: see `skips_failed_aggregation`).
    agg_failed: BTreeSet<NodeId>,
    applied: bool,
    /// A commit's all-reduce failed: the next commit waits until then (a
    /// failure that repeats must not spin).
    retry_at: Time,
    /// Expected microbatches not granted (nor dropped), once the iteration ended.
    missing: Option<BTreeSet<MbId>>,
    /// When a member of the running commit was lost and its grants kept for
    /// the survivors' all-reduce to finish without it: if neither their
    /// `AggDone` nor an `AggFailed` comes within `redo_timeout`, the commit
    /// is abandoned (the last resort: the runtime's all-reduce ends either
    /// way).
    bypass_since: Option<Time>,
}

impl CoordIter {
    /// Whether the stage applied this iteration's update.
    pub(super) fn is_applied(&self) -> bool {
        self.applied
    }

    /// The grants given to `owner` (this coordinator itself, for its
    /// deputy): (microbatch, the hop it came from, the hop it went to).
    pub(super) fn grants_of(&self, owner: NodeId) -> Vec<(MbId, NodeId, NodeId)> {
        (self.granted.iter())
            .filter(|(_, g)| g.0 == owner)
            .map(|(mb, g)| (*mb, g.1, g.2))
            .collect()
    }

    /// Whether `mb` is granted or dropped already.
    pub(super) fn settled(&self, mb: &MbId) -> bool {
        self.granted.contains_key(mb) || self.dropped.contains(mb)
    }

    /// Whether the commit under way counts on member `m`.
    pub(super) fn commit_counts_on(&self, m: NodeId) -> bool {
        self.commit.as_ref().is_some_and(|c| c.contains(&m))
    }

    /// The next commit waits until `at` (a failure must not spin).
    pub(super) fn retry_not_before(&mut self, at: Time) {
        self.retry_at = at;
    }

    /// The members done with the commit's all-reduce, with the digests of
    /// their weights.
    pub(super) fn digests(&self) -> Vec<(NodeId, u64)> {
        self.agg_done.iter().map(|(m, d)| (*m, *d)).collect()
    }

    /// The digest member `m` reported, if it is done.
    pub(super) fn digest_of(&self, m: NodeId) -> Option<u64> {
        self.agg_done.get(&m).copied()
    }

    /// The digests of the all-reduce that are compared: those of the
    /// members whose gradients are in its mean (they own a grant) and the
    /// coordinator's (`me`); 0 (unknown) left out.
    pub(super) fn compared_digests(&self, me: NodeId) -> Vec<(NodeId, u64)> {
        let owners: BTreeSet<NodeId> = self.granted.values().map(|g| g.0).collect();
        (self.agg_done.iter())
            .filter(|(m, d)| **d != 0 && (owners.contains(m) || **m == me))
            .map(|(m, d)| (*m, *d))
            .collect()
    }

    /// A deputy takes over the commit (`epoch`, `members`, `digest`) its
    /// coordinator `old` (gone) was running: with `old`'s own grants
    /// `held` (as copied to it) added to those known here, the commit is
    /// the same only if nothing failed, no commit runs here already, and
    /// the digests agree. Then it is this iteration's commit, its members'
    /// reports (`Some(weights)`: done) in, its survivors' all-reduce left
    /// to finish (`now`); true. Otherwise nothing changes; false.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn take_over(
        &mut self,
        old: NodeId,
        held: &BTreeMap<MbId, (NodeId, NodeId)>,
        members: &[NodeId],
        epoch: u64,
        digest: u64,
        reports: BTreeMap<NodeId, Option<u64>>,
        now: Time,
    ) -> bool {
        let failed = reports.values().any(Option::is_none);
        let mut known = self.granted.clone();
        for (mb, (prev, next)) in held {
            known.entry(*mb).or_insert((old, *prev, *next));
        }
        let whole =
            !failed && self.commit.is_none() && commit_digest(&known, &self.dropped) == digest;
        if !whole {
            return false;
        }
        for mb in held.keys() {
            self.lost.remove(mb);
            if let Some(m) = self.missing.as_mut() {
                m.remove(mb);
            }
        }
        self.granted = known;
        self.commit = Some(members.iter().copied().collect());
        self.epoch = epoch;
        self.agg_done = (reports.into_iter())
            .filter_map(|(m, w)| w.map(|w| (m, w)))
            .collect();
        self.bypass_since = Some(now);
        true
    }

    /// A commit under way (a test's coordinator).
    #[cfg(test)]
    pub(super) fn running(
        epoch: u64,
        commit: BTreeSet<NodeId>,
        agg_done: BTreeMap<NodeId, u64>,
        granted: BTreeMap<MbId, (NodeId, NodeId, NodeId)>,
    ) -> CoordIter {
        CoordIter {
            epoch,
            commit: Some(commit),
            agg_done,
            granted,
            ..Default::default()
        }
    }

    /// Sets the members' reports of the all-reduce (a test's).
    #[cfg(test)]
    pub(super) fn set_digests(&mut self, agg_done: BTreeMap<NodeId, u64>) {
        self.agg_done = agg_done;
    }
}

impl Coordinator {
    /// This node coordinates from `now` on, in place of a coordinator that
    /// is gone, believing iteration `next` comes next: the grace for the
    /// members' syncs starts (see `inherited`).
    pub(super) fn inherit(&mut self, now: Time, next: u32) {
        self.inherited = Some((now, next));
        self.synced.clear();
    }

    /// Forgets the iterations before `iter`.
    pub(super) fn forget_before(&mut self, iter: u32) {
        self.coord_iters.retain(|k, _| *k >= iter);
        self.synced.retain(|k, _| *k >= iter);
    }

    /// When the microbatches still missing at the end of `iter` (which ended
    /// at `end_at`) are taken for lost: after `redo_timeout` (the last resort
    /// for claims that never came), or a short `grace` after the end when the
    /// previous coordinator is known gone with its grants to `iter`.
    pub(super) fn missing_deadline(
        &self,
        iter: u32,
        end_at: Time,
        grace: Time,
        redo_timeout: Time,
    ) -> Time {
        match self.inherited {
            Some((at, upto)) if iter <= upto => end_at.max(at) + grace,
            _ => end_at + redo_timeout,
        }
    }
}

/// The microbatches of a commit that each of `members` owns (its part of
/// the sum), in grant order; one pass over the grants, not one per member
/// (a stage of a thousand members commits thousands of grants).
fn owned_by_each<'a>(
    ci: &CoordIter,
    members: impl IntoIterator<Item = &'a NodeId>,
) -> Vec<Arc<Vec<MbId>>> {
    let mut by_owner: BTreeMap<NodeId, Vec<MbId>> = BTreeMap::new();
    for (mb, g) in &ci.granted {
        by_owner.entry(g.0).or_default().push(*mb);
    }
    (members.into_iter())
        .map(|m| Arc::new(by_owner.remove(m).unwrap_or_default()))
        .collect()
}

/// What a commit covers, as one number: its grants with their owners, then
/// what it gave up (a successor that knows the same digests the same).
pub(super) fn commit_digest(
    granted: &BTreeMap<MbId, (NodeId, NodeId, NodeId)>,
    dropped: &BTreeSet<MbId>,
) -> u64 {
    let with =
        |h: u64, mb: &MbId| mix(mix(mix(h, mb.holder as u64), mb.iter as u64), mb.idx as u64);
    let mut h = mix(0x636f_6d6d_6974, granted.len() as u64);
    for (mb, g) in granted {
        h = mix(with(h, mb), g.0 as u64);
    }
    h = mix(h, dropped.len() as u64);
    for mb in dropped {
        h = with(h, mb);
    }
    h
}

/// The grace a new coordinator leaves the members' syncs before it takes
/// the microbatches still missing for lost with its predecessor: a
/// heartbeat period (members notice a coordinator gone within about one of
/// each other; a sync later than that finds its microbatch re-run and
/// refused, and the member leaves it out: see `on_claim_reply`).
fn sync_grace(cfg: &Config) -> Time {
    cfg.heartbeat_ticks as Time * cfg.tick
}

impl Node {
    /// A one-line summary of the coordinator state (debugging aid).
    pub fn debug_coord(&self) -> String {
        let mut out = format!(
            "node {} stage {} coord {:?} members {}",
            self.id,
            self.stage,
            self.group.coord(),
            self.group.members().len()
        );
        for (k, ci) in &self.coordinating.coord_iters {
            let exp = ci.end.as_ref().map(|e| self.expected(*k, &e.1));
            let missing: Vec<MbId> = exp
                .unwrap_or_default()
                .into_iter()
                .filter(|m| !ci.granted.contains_key(m) && !ci.dropped.contains(m))
                .collect();
            out.push_str(&format!(
                " | iter {k}: end {} granted {} lost {:?} dropped {} missing {:?} commit {:?} done {:?} applied {}",
                ci.end.is_some(),
                ci.granted.len(),
                ci.lost.iter().map(|(m, l)| (m.holder, m.idx, l.prev, l.next, l.dead, l.level, l.since / SEC)).collect::<Vec<_>>(),
                ci.dropped.len(),
                missing,
                ci.commit,
                ci.agg_done,
                ci.applied
            ));
        }
        out
    }

    pub(super) fn on_claim(
        &mut self,
        from: NodeId,
        iter: u32,
        mb: MbId,
        prev: NodeId,
        next: NodeId,
    ) {
        if self.group.coord() != Some(self.id) {
            // Not the coordinator (any more): tell the member who is; kept
            // in case it is the coordinator-to-be (see `keep_early`).
            self.keep_early(
                from,
                Msg::Claim {
                    iter,
                    mb,
                    prev,
                    next,
                },
            );
            self.name_the_coordinator_to(from);
            return;
        }
        if self.refuse_evicted(from) {
            self.send(from, Msg::ClaimReply { mb, granted: false });
            return;
        }
        if iter + 1 < self.iters.min_iter() {
            self.send(from, Msg::ClaimReply { mb, granted: false });
            return;
        }
        // A node that claims takes us for its coordinator: it is a member
        // (its claim can overtake its GroupJoin). Every grant's owner must
        // be in the group, or a commit would leave its gradient out of the
        // all-reduce while counting its microbatch in.
        if from != self.id {
            self.group.admit(from);
        }
        let ci = self.coordinating.coord_iters.entry(iter).or_default();
        let mut new = false;
        let granted = if ci.applied || ci.commit.is_some() || ci.dropped.contains(&mb) {
            ci.granted.get(&mb).is_some_and(|g| g.0 == from)
        } else {
            match ci.granted.get(&mb) {
                Some(g) => g.0 == from,
                None => {
                    ci.granted.insert(mb, (from, prev, next));
                    ci.lost.remove(&mb);
                    if let Some(m) = ci.missing.as_mut() {
                        m.remove(&mb);
                    }
                    new = true;
                    true
                }
            }
        };
        if new && from == self.id {
            self.tell_deputy(iter, mb, prev, next);
        }
        self.send(from, Msg::ClaimReply { mb, granted });
        self.coord_check(iter);
    }

    pub(super) fn on_end_iter(
        &mut self,
        from: NodeId,
        iter: u32,
        origin: NodeId,
        holders: Arc<Vec<NodeId>>,
    ) {
        let _ = from;
        if self.phase != Phase::Active {
            return;
        }
        let news = self.iters.ended(iter, origin, &holders);
        // Pass it on along the pipeline (once per heartbeat period, and at
        // once when it is news).
        let period = self.cfg.heartbeat_ticks as Time * self.cfg.tick;
        if self.iters.pass_on_end(iter, self.now, period, news) {
            // Holders also tell a few peers of the last stage: both stages
            // next to the holders then know the iteration is over before the
            // holders' stage can commit it, so a holders' coordinator that
            // starts over after every holder was gone opens a later one
            // (see `iter_hint`), even when stage 1 is empty.
            let mut stages = Vec::new();
            if self.stage < self.s() {
                stages.push(self.stage + 1);
            }
            if self.stage == 0 && self.s() > 1 {
                stages.push(self.s());
            }
            for ns in stages {
                for t in self.live_peers_of(ns, 3) {
                    self.send(
                        t,
                        Msg::EndIter {
                            iter,
                            origin,
                            holders: holders.clone(),
                        },
                    );
                }
            }
            if let Some(c) = self.group.coord() {
                if c != self.id {
                    self.send(
                        c,
                        Msg::EndIter {
                            iter,
                            origin,
                            holders: holders.clone(),
                        },
                    );
                }
            }
        }
        if self.group.coord() == Some(self.id) {
            let now = self.now;
            let ci = self.coordinating.coord_iters.entry(iter).or_default();
            if ci.applied {
                let st = self.stage;
                self.send(origin, Msg::StageDone { iter, stage: st });
                return;
            }
            if ci.end.is_none() {
                ci.end_at = now;
            }
            if ci.missing.is_none() {
                let mut m = BTreeSet::new();
                for &h in holders.iter() {
                    for idx in 0..self.cfg.mb_per_iter {
                        let mb = MbId {
                            holder: h,
                            iter,
                            idx,
                        };
                        if !ci.granted.contains_key(&mb) && !ci.dropped.contains(&mb) {
                            m.insert(mb);
                        }
                    }
                }
                ci.missing = Some(m);
            }
            ci.end = Some((origin, holders));
            if self.syncs_all_in(iter) {
                self.settle_missing(iter);
            } else {
                self.coord_check(iter);
            }
        }
    }

    /// Coordinator: a member is gone; its contributions not yet applied are
    /// lost, unless it is part of a commit whose all-reduce can still
    /// finish without it: the ring bypasses a member lost in its all-gather
    /// half (`crate::swarm::allreduce`), and then the survivors' result
    /// holds its contributions. Its grants stand until a survivor reports
    /// the all-reduce failed (`on_agg_failed`); the survivors' `AggDone`
    /// apply them.
    pub(super) fn coord_member_dead(&mut self, p: NodeId) {
        let iters: Vec<u32> = self.coordinating.coord_iters.keys().copied().collect();
        for k in iters {
            let ci = &self.coordinating.coord_iters[&k];
            if ci.applied {
                continue;
            }
            let in_commit = ci.commit.as_ref().is_some_and(|c| c.contains(&p));
            let survivors = ci
                .commit
                .as_ref()
                .is_some_and(|c| c.iter().any(|&m| m != p && self.alive(m)));
            if in_commit && survivors {
                let now = self.now;
                let ci = self.coordinating.coord_iters.get_mut(&k).unwrap();
                ci.bypass_since.get_or_insert(now);
                self.coord_check(k);
                continue;
            }
            if in_commit {
                self.abandon_commit(k);
            } else {
                self.lose_grants(k, p);
            }
            self.redo_lost(k);
            self.coord_check(k);
        }
        if let Some(b) = self.barrier.as_mut() {
            let _ = b;
            self.barrier_check();
        }
    }

    /// Coordinator of a relays' stage: `p`, gone, may be the holder of lost
    /// contributions that only a restart from it could redo: given up now
    /// (see `redo_lost`), not after four unanswered restarts.
    pub(super) fn coord_holder_gone(&mut self, p: NodeId) {
        if self.group.coord() != Some(self.id) || self.stage == 0 {
            return;
        }
        let iters: Vec<u32> = (self.coordinating.coord_iters.iter())
            .filter(|(_, ci)| !ci.applied && ci.lost.keys().any(|m| m.holder == p))
            .map(|(k, _)| *k)
            .collect();
        for k in iters {
            self.redo_lost(k);
            self.coord_check(k);
        }
    }

    /// Coordinator: the grants of `p` (gone) to `iter` are lost, to be
    /// recomputed.
    fn lose_grants(&mut self, iter: u32, p: NodeId) {
        let Some(ci) = self.coordinating.coord_iters.get_mut(&iter) else {
            return;
        };
        let mine: Vec<(MbId, NodeId, NodeId)> = (ci.granted.iter())
            .filter(|(_, g)| g.0 == p)
            .map(|(m, g)| (*m, g.1, g.2))
            .collect();
        for (mb, ..) in &mine {
            ci.granted.remove(mb);
        }
        self.mark_lost(iter, p, mine);
    }

    /// Coordinator: `mbs` (microbatch, the hop before, the hop after) of
    /// `iter`, whose contributions died with `dead`, are lost: missing once
    /// the iteration ended, and to be recomputed from those hops.
    pub(super) fn mark_lost(&mut self, iter: u32, dead: NodeId, mbs: Vec<(MbId, NodeId, NodeId)>) {
        let now = self.now;
        let Some(ci) = self.coordinating.coord_iters.get_mut(&iter) else {
            return;
        };
        let ended: Option<BTreeSet<NodeId>> =
            ci.end.as_ref().map(|e| e.1.iter().copied().collect());
        for (mb, prev, next) in mbs {
            if let (Some(m), Some(h)) = (ci.missing.as_mut(), ended.as_ref()) {
                if h.contains(&mb.holder) {
                    m.insert(mb);
                }
            }
            ci.lost.entry(mb).or_insert(Lost {
                prev: Some(prev),
                next: Some(next),
                dead,
                since: now,
                level: 0,
            });
        }
    }

    /// Coordinator: the commit of `iter` will not be applied (its
    /// all-reduce failed, or every member is gone): the grants of its
    /// members that are gone are lost with them, and the live members
    /// commit again, under a new epoch, once those are recomputed.
    pub(super) fn abandon_commit(&mut self, iter: u32) {
        let Some(ci) = self.coordinating.coord_iters.get_mut(&iter) else {
            return;
        };
        let Some(commit) = ci.commit.take() else {
            return;
        };
        ci.agg_done.clear();
        ci.agg_failed.clear();
        ci.bypass_since = None;
        for m in commit {
            if !self.alive(m) {
                self.lose_grants(iter, m);
            }
        }
    }

    /// Coordinator: a commit that kept a lost member's grants for its
    /// all-reduce to finish without it, and heard nothing for
    /// `redo_timeout`, is abandoned.
    fn give_up_bypass(&mut self, iter: u32) {
        let Some(ci) = self.coordinating.coord_iters.get(&iter) else {
            return;
        };
        let due = ci
            .bypass_since
            .is_some_and(|t| t + self.cfg.redo_timeout <= self.now);
        if ci.applied || !due {
            return;
        }
        self.abandon_commit(iter);
        self.redo_lost(iter);
        self.coord_check(iter);
    }

    /// Coordinator: the holder of a lost microbatch answered a restart
    /// request; it is alive and re-running it, so the microbatch is not
    /// given up: the request is repeated after a full `redo_timeout` (a
    /// holder that stops answering is taken for dead and its microbatch is
    /// dropped after the usual escalation).
    pub(super) fn on_restarting(&mut self, from: NodeId, mb: MbId) {
        if self.group.coord() != Some(self.id) || from != mb.holder {
            return;
        }
        let now = self.now;
        let Some(ci) = self.coordinating.coord_iters.get_mut(&mb.iter) else {
            return;
        };
        if ci.applied || ci.commit.is_some() {
            return;
        }
        if let Some(l) = ci.lost.get_mut(&mb) {
            if l.level > 0 {
                l.level = l.level.min(3);
                l.since = now;
            }
        }
    }

    /// Coordinator: asks for the lost contributions to be recomputed.
    pub(super) fn redo_lost(&mut self, iter: u32) {
        let now = self.now;
        let timeout = self.cfg.redo_timeout;
        let stage = self.stage;
        let reruns_stage = self.policy().reruns_crashed_stage();
        let drops = stage != 0 && self.policy().drops_lost_contributions();
        // The holders' stage: its live members (the holders still here).
        let live: BTreeSet<NodeId> = if stage == 0 {
            self.group
                .members()
                .iter()
                .copied()
                .filter(|&m| self.alive(m))
                .collect()
        } else {
            BTreeSet::new()
        };
        let alive = |h: NodeId| live.contains(&h);
        // The nodes that could re-send a lost contribution's input and are
        // gone: asking them would only cost a `redo_timeout`.
        let dead_prevs: BTreeSet<NodeId> = self
            .coordinating
            .coord_iters
            .get(&iter)
            .map(|ci| {
                ci.lost
                    .values()
                    .filter(|l| l.level == 0)
                    .filter_map(|l| l.prev)
                    .filter(|&p| !self.alive(p))
                    .collect()
            })
            .unwrap_or_default();
        // At a relays' stage, the lost contributions only a restart from
        // their holder could redo (now or at their next step: no `Redo`
        // from a live node before is pending), whose holder is known gone
        // (a failed connection told us, or its `Goodbye`): that restart
        // cannot come.
        let give_up: BTreeSet<MbId> = match self.coordinating.coord_iters.get(&iter) {
            Some(ci) if stage != 0 => (ci.lost.iter())
                .filter(|(mb, l)| {
                    let redo = reruns_stage && l.prev.is_some_and(|p| self.alive(p));
                    let due = l.since + timeout <= now;
                    !self.alive(mb.holder) && (!redo || l.level >= 2 || (l.level == 1 && due))
                })
                .map(|(mb, _)| *mb)
                .collect(),
            _ => BTreeSet::new(),
        };
        let Some(ci) = self.coordinating.coord_iters.get_mut(&iter) else {
            return;
        };
        let mut sends: Vec<(NodeId, Msg)> = Vec::new();
        let mut drop: Vec<MbId> = Vec::new();
        for (mb, l) in ci.lost.iter_mut() {
            if stage == 0 && !alive(mb.holder) {
                // A holder's own part cannot be redone without it, and a
                // holder that is gone answers no restart: given up at once.
                drop.push(*mb);
                continue;
            }
            if give_up.contains(mb) {
                // Only a restart from its holder could redo it, and the
                // holder is gone: given up at once, not after the restarts
                // nobody answers (four `redo_timeout`s).
                drop.push(*mb);
                continue;
            }
            if l.level > 0 && l.since + timeout > now {
                continue;
            }
            if stage == 0 && (l.level == 0 || l.level > 3) {
                // A holder's own part cannot be redone without it. A live
                // holder is asked again (as at the relays' stages): it
                // answers while it re-runs the microbatch, which keeps it
                // from being dropped here while the other stages count it.
                drop.push(*mb);
                continue;
            }
            if drops {
                // SWARM: the stage aggregates what it has.
                drop.push(*mb);
                continue;
            }
            match l.level {
                0 => {
                    match (l.prev, l.next) {
                        (Some(prev), Some(next)) if reruns_stage && !dead_prevs.contains(&prev) => {
                            sends.push((
                                prev,
                                Msg::Redo {
                                    mb: *mb,
                                    dead: l.dead,
                                    next,
                                },
                            ));
                        }
                        _ => {
                            sends.push((
                                mb.holder,
                                Msg::Restart {
                                    mb: *mb,
                                    attempt: None,
                                },
                            ));
                        }
                    }
                    l.level = 1;
                    l.since = now;
                }
                1..=3 => {
                    sends.push((
                        mb.holder,
                        Msg::Restart {
                            mb: *mb,
                            attempt: None,
                        },
                    ));
                    l.level += 1;
                    l.since = now;
                }
                _ => drop.push(*mb),
            }
        }
        for mb in drop {
            ci.lost.remove(&mb);
            ci.dropped.insert(mb);
            if let Some(m) = ci.missing.as_mut() {
                m.remove(&mb);
            }
        }
        for (to, m) in sends {
            self.send(to, m);
        }
    }

    pub(super) fn coord_tick(&mut self) {
        let iters: Vec<u32> = self.coordinating.coord_iters.keys().copied().collect();
        for k in iters {
            self.settle_missing(k);
            self.give_up_bypass(k);
            self.commit_again_to_the_silent(k);
        }
        if self.stage == 0 {
            self.barrier_tick();
        }
    }

    /// A commit whose all-reduce a live member has not reported a
    /// heartbeat period after it was sent goes to that member again: the
    /// commit or its report may have been lost (a connection replaced as
    /// the member came back), and nothing else would end the wait. A
    /// member that ran that epoch's all-reduce answers with its result
    /// again; one that never got the commit starts it.
    fn commit_again_to_the_silent(&mut self, iter: u32) {
        let period = self.cfg.heartbeat_ticks as Time * self.cfg.tick;
        let now = self.now;
        let Some(ci) = self.coordinating.coord_iters.get(&iter) else {
            return;
        };
        let (Some(commit), Some((list, digest, at))) = (&ci.commit, &ci.commit_sent) else {
            return;
        };
        if ci.applied || at + period > now {
            return;
        }
        let silent: Vec<NodeId> = (commit.iter().copied())
            .filter(|m| !ci.agg_done.contains_key(m) && !ci.agg_failed.contains(m))
            .filter(|&m| self.alive(m))
            .collect();
        let (list, digest, epoch) = (list.clone(), *digest, ci.epoch);
        let mine = owned_by_each(ci, &silent);
        let ci = self.coordinating.coord_iters.get_mut(&iter).unwrap();
        ci.commit_sent = Some((list.clone(), digest, now));
        for (m, mine) in silent.into_iter().zip(mine) {
            let members = list.clone();
            self.send(
                m,
                Msg::Commit {
                    iter,
                    epoch,
                    members,
                    digest,
                    mine,
                },
            );
        }
    }

    /// Whether `iter`'s grants were partly lost with a coordinator that is
    /// gone (see [`Coordinator::inherited`]) and every live member has
    /// synced its own since: nothing more can come for it.
    fn syncs_all_in(&self, iter: u32) -> bool {
        matches!(self.coordinating.inherited, Some((_, upto)) if iter <= upto)
            && self.all_synced(iter)
    }

    /// Whether every live member of the group synced `iter` with this node
    /// since it took over from a coordinator that is gone: itself too (its
    /// own sync, sent to itself, comes after its own claims).
    pub(super) fn all_synced(&self, iter: u32) -> bool {
        let Some(synced) = self.coordinating.synced.get(&iter) else {
            return false;
        };
        (self.group.members().iter()).all(|&m| !self.alive(m) || synced.contains(&m))
    }

    /// Iteration `k`'s expected microbatches never claimed (their node died
    /// before it could claim and the data path did not recover them in
    /// time) are taken for lost once their deadline passed (see
    /// [`Coordinator::missing_deadline`]; no grace once every live member
    /// synced); then what is lost is redone, and a commit tried.
    fn settle_missing(&mut self, k: u32) {
        if self.deputy_state.taking_over(k) {
            self.settle_takeover(k);
            if self.deputy_state.taking_over(k) {
                return;
            }
        }
        let now = self.now;
        let timeout = self.cfg.redo_timeout;
        let grace = if self.all_synced(k) {
            0
        } else {
            sync_grace(&self.cfg)
        };
        let missing: Vec<MbId> = {
            let ci = &self.coordinating.coord_iters[&k];
            if ci.applied || ci.commit.is_some() {
                Vec::new()
            } else if let (Some(_), Some(missing)) = (&ci.end, &ci.missing) {
                let due = self
                    .coordinating
                    .missing_deadline(k, ci.end_at, grace, timeout);
                if due <= now {
                    missing
                        .iter()
                        .copied()
                        .filter(|m| !ci.lost.contains_key(m))
                        .collect()
                } else {
                    Vec::new()
                }
            } else {
                Vec::new()
            }
        };
        let ci = self.coordinating.coord_iters.get_mut(&k).unwrap();
        for &mb in &missing {
            ci.lost.insert(
                mb,
                Lost {
                    prev: None,
                    next: None,
                    dead: NodeId::MAX,
                    since: now,
                    level: 1,
                },
            );
        }
        // Level 1: restart from the holder now (SWARM: `redo_lost`
        // drops it).
        let drops = self.stage != 0 && self.policy().drops_lost_contributions();
        for mb in missing.into_iter().filter(|_| !drops) {
            self.send(mb.holder, Msg::Restart { mb, attempt: None });
        }
        self.redo_lost(k);
        self.coord_check(k);
    }

    pub(super) fn expected(&self, iter: u32, holders: &[NodeId]) -> Vec<MbId> {
        let mut v = Vec::with_capacity(holders.len() * self.cfg.mb_per_iter as usize);
        for &h in holders {
            for idx in 0..self.cfg.mb_per_iter {
                v.push(MbId {
                    holder: h,
                    iter,
                    idx,
                });
            }
        }
        v
    }

    /// Coordinator: commit when complete, apply when every member aggregated.
    pub(super) fn coord_check(&mut self, iter: u32) {
        if self.group.coord() != Some(self.id) {
            return;
        }
        if self.iters.applied_through(iter) {
            // Applied under an earlier coordinator: only confirm.
            let ci = self.coordinating.coord_iters.entry(iter).or_default();
            ci.applied = true;
            if let Some((origin, _)) = ci.end.clone() {
                let st = self.stage;
                self.send(origin, Msg::StageDone { iter, stage: st });
            }
            return;
        }
        let Some(ci) = self.coordinating.coord_iters.get(&iter) else {
            return;
        };
        if ci.applied {
            return;
        }
        let origin = ci.end.as_ref().map(|e| e.0);
        if ci.commit.is_none() {
            // A dead predecessor's commit this node may take over decides
            // first (see `deputy`).
            if !ci.lost.is_empty() || self.deputy_state.taking_over(iter) {
                return;
            }
            let done = match &ci.missing {
                // Ended: every microbatch of the holders done is granted.
                Some(missing) => missing.is_empty(),
                // Not ended yet: this stage's own work is done when every
                // microbatch of every participant is granted here (a holder
                // that leaves or dies makes the stage wait for the end).
                None => self.own_work_done(iter),
            };
            if !done || self.now < ci.retry_at || self.nobody_to_commit_for(iter) {
                return;
            }
            let alive: BTreeSet<NodeId> = self
                .group
                .members()
                .iter()
                .copied()
                .filter(|m| self.alive(*m))
                .collect();
            // Every grant's owner reduces in the commit: a grant of a node
            // outside it would be counted in the commit and left out of the
            // mean. Such grants (a view that changed without a death being
            // noticed here) are recomputed first.
            let outside: BTreeSet<NodeId> = (ci.granted.values())
                .map(|g| g.0)
                .filter(|o| !alive.contains(o))
                .collect();
            if !outside.is_empty() {
                for o in outside {
                    self.lose_grants(iter, o);
                }
                self.redo_lost(iter);
                return;
            }
            // Every grant's owner is among them still.
            let members = self.without_stragglers(iter, alive);
            let ci = self.coordinating.coord_iters.get_mut(&iter).unwrap();
            // Epochs are unique across coordinators.
            ci.epoch = ((self.id as u64) << 32) | ((ci.epoch & 0xffff_ffff) + 1);
            ci.agg_done.clear();
            ci.agg_failed.clear();
            ci.bypass_since = None;
            ci.commit = Some(members.clone());
            let epoch = ci.epoch;
            // The ring in the order that keeps its slowest link fast.
            let list = Arc::new(self.ring_order(&members));
            let ci = &self.coordinating.coord_iters[&iter];
            let digest = commit_digest(&ci.granted, &ci.dropped);
            let now = self.now;
            let mine = owned_by_each(ci, &members);
            let ci = self.coordinating.coord_iters.get_mut(&iter).unwrap();
            ci.commit_sent = Some((list.clone(), digest, now));
            for (m, mine) in members.into_iter().zip(mine) {
                self.send(
                    m,
                    Msg::Commit {
                        iter,
                        epoch,
                        members: list.clone(),
                        digest,
                        mine,
                    },
                );
            }
            return;
        }
        let ci = &self.coordinating.coord_iters[&iter];
        let commit = ci.commit.as_ref().unwrap();
        // Every live member done, and at least one (a member gone during
        // the all-reduce was bypassed: the survivors hold the result).
        let reported = |m: &NodeId| ci.agg_done.contains_key(m) || ci.agg_failed.contains(m);
        if (ci.agg_done.is_empty() && ci.agg_failed.is_empty())
            || !commit.iter().all(|m| reported(m) || !self.alive(*m))
        {
            return;
        }
        let diverged = self.diverged_members(iter);
        if !diverged.is_empty() {
            self.evict_diverged(iter, diverged);
            return;
        }
        let ci = &self.coordinating.coord_iters[&iter];
        if !ci.agg_failed.is_empty() {
            // SWARM: the all-reduce failed; the live members step on what
            // each has, and the gone members' contributions are gone with
            // them (dropped).
            let commit = ci.commit.as_ref().unwrap();
            let gone: Vec<NodeId> = commit.iter().copied().filter(|m| !self.alive(*m)).collect();
            for m in gone {
                self.lose_grants(iter, m);
            }
            self.redo_lost(iter);
            if !self.coordinating.coord_iters[&iter].lost.is_empty() {
                return;
            }
        }
        self.apply_commit(iter, origin);
    }

    /// The members of `alive` to commit `iter` with: with
    /// `Config::leave_out_stragglers`, a relay stage's members with no
    /// grant in it whose links are far slower than the others'
    /// ([`Node::slow_members`]) are left out. Their all-reduce would hold
    /// the stage up for nothing of theirs to sum; left out, they download
    /// the state again, off the stage's path. (A member whose weights are
    /// behind, a joiner downloading the state again, stays in: its zero
    /// share needs no weights, and the means it gets bring it up to date
    /// after the download.)
    fn without_stragglers(&mut self, iter: u32, alive: BTreeSet<NodeId>) -> BTreeSet<NodeId> {
        if !self.cfg.leave_out_stragglers || self.stage == 0 {
            return alive;
        }
        let ci = &self.coordinating.coord_iters[&iter];
        let granted: BTreeSet<NodeId> = ci.granted.values().map(|g| g.0).collect();
        let slow = self.slow_members(&alive);
        let (members, left_out): (BTreeSet<NodeId>, BTreeSet<NodeId>) = (alive.into_iter())
            .partition(|m| *m == self.id || granted.contains(m) || !slow.contains(m));
        // Told when the set changes, not at every commit (a member behind
        // a slow link stays out for as long as it is).
        let told = std::mem::replace(&mut self.coordinating.left_out, left_out.clone());
        if !left_out.is_empty() && told != left_out {
            let st = self.stage;
            self.event(Event::LeftOut {
                stage: st,
                iter,
                slow: left_out.into_iter().collect(),
            });
        }
        members
    }

    /// Applies `iter`'s commit: the new weights version follows from the
    /// previous one and exactly the contributions that are in the
    /// aggregate; the members and the iteration's origin are told.
    fn apply_commit(&mut self, iter: u32, origin: Option<NodeId>) {
        let ci = &self.coordinating.coord_iters[&iter];
        let mut h = mix(self.iters.version().1, iter as u64);
        for (mb, g) in &ci.granted {
            h = mix(h, ((mb.holder as u64) << 32) | mb.idx as u64);
            h = mix(h, g.0 as u64);
        }
        let mbs: Vec<(MbId, NodeId)> = ci.granted.iter().map(|(m, g)| (*m, g.0)).collect();
        // Replicas aggregate on the same weights, or something is wrong:
        // every member reports the digest of what it holds (0: unknown).
        let digests = ci.compared_digests(self.id);
        let diverged = digests.windows(2).any(|w| w[0].1 != w[1].1);
        let dropped: Vec<MbId> = ci.dropped.iter().copied().collect();
        let ci = self.coordinating.coord_iters.get_mut(&iter).unwrap();
        ci.applied = true;
        let st = self.stage;
        if diverged {
            self.event(Event::ReplicasDiverged {
                stage: st,
                iter,
                digests,
            });
        }
        self.event(Event::StageCommitted {
            stage: st,
            iter,
            mbs: Arc::new(mbs),
            dropped,
        });
        for m in self.group.members().clone() {
            self.send(m, Msg::Applied { iter, version: h });
        }
        // Applied before the end: the stage is reported done when the end
        // comes (`on_end_iter`).
        if let Some(origin) = origin {
            self.send(origin, Msg::StageDone { iter, stage: st });
        }
    }

    /// Whether a relays' commit of `iter` would apply nothing (no grant)
    /// and tell nobody: every holder of the iteration is gone. Such a
    /// commit only gives up the microbatches its holders took with them,
    /// and a node cut off from its stage's group (a relay behind a slow
    /// link that lost its connections) committed them as a group of its
    /// own once the holders finished and said goodbye, iterations the
    /// real group had committed long before.
    fn nobody_to_commit_for(&self, iter: u32) -> bool {
        let Some(ci) = self.coordinating.coord_iters.get(&iter) else {
            return false;
        };
        let holders = (ci.end.as_ref().map(|e| &e.1)).or_else(|| self.iters.participants_of(iter));
        self.stage != 0
            && ci.granted.is_empty()
            && holders.is_some_and(|h| !h.is_empty() && h.iter().all(|&h| !self.alive(h)))
    }

    /// Whether every microbatch of the participants of `iter` is granted
    /// (or given up) at this stage, before the iteration ended.
    fn own_work_done(&self, iter: u32) -> bool {
        let (Some(holders), Some(ci)) = (
            self.iters.participants_of(iter),
            self.coordinating.coord_iters.get(&iter),
        ) else {
            return false;
        };
        // Checked on every claim: the counts first, so that only a check
        // that may pass walks every microbatch (at thousands of holders,
        // building the list each time was a twelfth of a simulation).
        let want = holders.len() * self.cfg.mb_per_iter as usize;
        let mb_per_iter = self.cfg.mb_per_iter;
        !holders.is_empty()
            && ci.granted.len() + ci.dropped.len() >= want
            && holders.iter().all(|&holder| {
                (0..mb_per_iter).all(|idx| {
                    let mb = MbId { holder, iter, idx };
                    ci.granted.contains_key(&mb) || ci.dropped.contains(&mb)
                })
            })
    }

    pub(super) fn on_applied(&mut self, iter: u32, version: u64) {
        if self.iters.applied_through(iter) {
            return;
        }
        // Only a member whose all-reduce of the commit ended with the mean
        // steps with it; one left out of the commit (or whose part failed)
        // downloads the state again (the runtime), and holds no more
        // updates meanwhile: what its heartbeats tell the coordinator.
        let ran = self.member.ran_commit_of(iter);
        if self.cfg.leave_out_stragglers && !ran {
            self.iters.missed(iter, version);
        } else {
            self.iters.applied(iter, version);
        }
        let mut adopted = None;
        if let Some(ci) = self.coordinating.coord_iters.get_mut(&iter) {
            if !ci.applied && self.group.coord() == Some(self.id) {
                // A member tells this coordinator that `iter` was applied
                // under its predecessor: the members that missed it learn
                // it too, and the holders that the stage is done.
                adopted = Some(ci.end.as_ref().map(|e| e.0));
            }
            ci.applied = true;
        }
        let st = self.stage;
        self.event(Event::Applied {
            stage: st,
            iter,
            version,
        });
        self.member.forget_upto(iter);
        self.deputy_forget_upto(iter);
        if let Some(origin) = adopted {
            for m in self.group.members().clone() {
                if m != self.id {
                    self.send(m, Msg::Applied { iter, version });
                }
            }
            if let Some(origin) = origin {
                self.send(origin, Msg::StageDone { iter, stage: st });
            }
        }
    }

    /// A member's contributions, sent to a new coordinator.
    pub(super) fn on_sync(
        &mut self,
        from: NodeId,
        iter: u32,
        granted: Vec<(MbId, NodeId, NodeId)>,
        end: Option<(NodeId, Arc<Vec<NodeId>>)>,
    ) {
        if self.refuse_evicted(from) {
            return;
        }
        if self.group.coord() == Some(self.id) {
            for (mb, prev, next) in granted {
                self.on_claim(from, iter, mb, prev, next);
            }
            if let Some((origin, holders)) = end {
                self.on_end_iter(from, iter, origin, holders);
            }
            let c = &mut self.coordinating;
            if c.inherited.is_some() && c.synced.entry(iter).or_default().insert(from) {
                // The last live member's sync of `iter`: what is still
                // missing there is lost now, not a heartbeat period later.
                if self.coordinating.coord_iters.contains_key(&iter) && self.syncs_all_in(iter) {
                    self.settle_missing(iter);
                }
            }
        } else {
            self.keep_early(from, Msg::Sync { iter, granted, end });
        }
    }

    /// A member takes this node, which does not coordinate, for its
    /// coordinator: it saw ours leave or die before we did (a Goodbye or a
    /// suspicion can reach us later than its Sync or Claim). Dropping its
    /// Sync would lose its grants (the new coordinator would take its
    /// microbatches for missing and, at the holders' stage, drop them);
    /// dropping its Claim would leave it unanswered for a heartbeat period
    /// (see `resend_stale_claims`); dropping its `AggDone` (or `AggFailed`)
    /// would leave the dead coordinator's commit, which this node takes
    /// over, waiting `redo_timeout` for it. Kept until this node takes over (or
    /// stale), then replayed in order: with them, every member's Sync
    /// means its claims are in ([`Node::all_synced`]).
    fn keep_early(&mut self, from: NodeId, msg: Msg) {
        if self.phase != Phase::Active || from == self.id {
            return;
        }
        let keep = 2 * self.cfg.suspect_ticks as Time * self.cfg.tick;
        let now = self.now;
        let early = &mut self.coordinating.early_syncs;
        early.retain(|(t, _, _)| t + keep >= now);
        // Bounded: a flood is not kept (a real group sends one Sync per
        // member per coordinator change, and its claims in flight).
        if early.len() < MAX_EARLY_SYNCS {
            early.push((now, from, msg));
        }
    }

    /// A member finished its part of the all-reduce of `iter`.
    pub(super) fn on_agg_done(&mut self, from: NodeId, iter: u32, epoch: u64, weights: u64) {
        if self.group.coord() != Some(self.id) {
            // A member that saw our coordinator die before we did: kept for
            // when this node takes its commit over (see `keep_early`).
            self.keep_early(
                from,
                Msg::AggDone {
                    iter,
                    epoch,
                    weights,
                },
            );
            return;
        }
        if self.refuse_evicted(from) {
            return;
        }
        if self.takeover_report(from, iter, epoch, Some(weights)) {
            return;
        }
        if let Some(ci) = self.coordinating.coord_iters.get_mut(&iter) {
            if ci.epoch == epoch && ci.commit.is_some() {
                ci.agg_done.insert(from, weights);
            }
        }
        self.coord_check(iter);
    }

    /// A member's part of the commit's all-reduce failed (a chunk that
    /// did not fit, its trainer failed the gradient, or a member was lost
    /// where the ring cannot go on without it): commit again, from the next
    /// heartbeat tick on (a new epoch, the live members; their grants
    /// stand, the lost members' are recomputed first).
    pub(super) fn on_agg_failed(&mut self, from: NodeId, iter: u32, epoch: u64) {
        if self.group.coord() != Some(self.id) {
            self.keep_early(from, Msg::AggFailed { iter, epoch });
            return;
        }
        if self.refuse_evicted(from) {
            return;
        }
        if self.takeover_report(from, iter, epoch, None) {
            return;
        }
        let retry_at = self.now + self.cfg.tick;
        let skips = self.policy().skips_failed_aggregation();
        let Some(ci) = self.coordinating.coord_iters.get_mut(&iter) else {
            return;
        };
        // Only a member of the commit can have failed its all-reduce.
        if ci.applied || ci.epoch != epoch || !ci.commit.as_ref().is_some_and(|c| c.contains(&from))
        {
            return;
        }
        let stage = self.stage;
        if skips {
            // SWARM: no new all-reduce; once every live member reported,
            // each steps on what it has (`coord_check`).
            if ci.agg_failed.insert(from) && ci.agg_failed.len() == 1 {
                self.event(Event::AggregateFailed {
                    stage,
                    iter,
                    member: from,
                });
            }
            self.coord_check(iter);
            return;
        }
        ci.retry_at = retry_at;
        // Members lost during it are no longer bypassed: their grants are
        // recomputed before the next commit.
        self.abandon_commit(iter);
        self.redo_lost(iter);
        self.event(Event::AggregateFailed {
            stage,
            iter,
            member: from,
        });
    }

    /// This node became its stage's coordinator in place of `old` (if any):
    /// the holders' barrier reopens from its own knowledge, its own
    /// contributions go into the new coordinator state, and the members'
    /// syncs that came before it knew are handled. When `old` is gone, what
    /// it had granted to itself is lost: see `Coordinator::inherited`.
    pub(super) fn take_over(&mut self, old: Option<NodeId>) {
        self.reopen_barrier();
        self.deputy_reset();
        if let Some(old) = old {
            if !self.alive(old) {
                self.coordinating.inherited = Some((self.now, self.iters.next_hint()));
                self.coordinating.synced.clear();
            }
            self.sync_to(self.id);
            if !self.alive(old) {
                self.inherit_deputy_grants(old);
            }
        }
        // The ends this node heard of as a member: what is missing there is
        // known now, not when the holders announce the end again.
        for (k, (origin, holders)) in self.iters.ends_not_applied() {
            self.on_end_iter(self.id, k, origin, holders);
        }
        let keep = 2 * self.cfg.suspect_ticks as Time * self.cfg.tick;
        let now = self.now;
        for (t, from, m) in std::mem::take(&mut self.coordinating.early_syncs) {
            if t + keep >= now {
                self.replay.push_back((from, m));
            }
        }
    }
}

#[cfg(test)]
#[path = "coordinator_tests.rs"]
mod tests;
