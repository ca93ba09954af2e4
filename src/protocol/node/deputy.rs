//! The coordinator's own grants, kept by its deputy: the member that would
//! take over if it died (the next live member by id). The other members'
//! grants survive a coordinator's death (each syncs its own to the
//! successor); without a copy, the coordinator's own were known to nobody,
//! and their microbatches were restarted from the holders, through every
//! stage. With the copy the successor takes them for lost with the hops
//! they came from and went to, and has one stage of each rerun (`Redo`), as
//! for any member that dies; and when the coordinator died while its
//! commit's all-reduce ran on without it, the successor takes the commit
//! over ([`Takeover`]) and applies the ring's result, nothing rerun.
use super::*;

/// Grants kept per iteration, at most (a coordinator grants itself at most
/// the iteration's microbatches; more is a peer that misbehaves).
const MAX_KEPT: usize = 1 << 16;
/// Iterations kept, at most (those not applied yet: one or two).
const MAX_ITERS: usize = 8;

/// Microbatches with the hop each came from and went to.
type Hops = Vec<(MbId, NodeId, NodeId)>;

#[derive(Debug, Default)]
pub(super) struct DeputyState {
    /// As coordinator: the member last sent all of this node's own grants.
    sent_to: Option<NodeId>,
    /// As deputy: whose grants these are, and which, by iteration.
    of: Option<NodeId>,
    grants: BTreeMap<u32, BTreeMap<MbId, (NodeId, NodeId)>>,
    /// As successor: the dead coordinator's commits this node may take
    /// over, by iteration.
    takeovers: BTreeMap<u32, Takeover>,
}

impl DeputyState {
    pub(super) fn taking_over(&self, iter: u32) -> bool {
        self.takeovers.contains_key(&iter)
    }
}

/// A commit of a coordinator that died, whose all-reduce runs on (the ring
/// goes on without a member lost in its all-gather half, the dead
/// coordinator's gradients in its result). Once the members' syncs are in,
/// if they and the copy of the dead coordinator's own grants are all the
/// commit covered (its digest), the successor applies its result as it
/// would its own commit's; otherwise, or when a member's part failed, the
/// copied grants are lost and one stage of each is rerun.
#[derive(Debug)]
pub(super) struct Takeover {
    old: NodeId,
    epoch: u64,
    members: Arc<Vec<NodeId>>,
    digest: u64,
    /// The dead coordinator's own grants, as copied to this node.
    held: BTreeMap<MbId, (NodeId, NodeId)>,
    since: Time,
    /// Members' reports of its all-reduce: the weights they aggregated on
    /// (done), or `None` (failed).
    reports: BTreeMap<NodeId, Option<u64>>,
}

impl Node {
    /// The member that would coordinate if this node, coordinating, died.
    fn deputy(&self) -> Option<NodeId> {
        (self.group.members().iter())
            .copied()
            .find(|&m| m != self.id && self.alive(m))
    }

    /// Coordinator: it granted itself `mb` of `iter`; its deputy keeps a
    /// copy (a new deputy gets them all at the next heartbeat).
    pub(super) fn tell_deputy(&mut self, iter: u32, mb: MbId, prev: NodeId, next: NodeId) {
        if let Some(d) = self
            .deputy()
            .filter(|&d| Some(d) == self.deputy_state.sent_to)
        {
            let granted = vec![(mb, prev, next)];
            self.send(d, Msg::Deputy { iter, granted });
        }
    }

    /// Coordinator, each heartbeat: a new deputy gets every grant of this
    /// node's own that is not applied yet.
    pub(super) fn refresh_deputy(&mut self) {
        let d = self.deputy();
        if d == self.deputy_state.sent_to {
            return;
        }
        self.deputy_state.sent_to = d;
        let Some(d) = d else {
            return;
        };
        let me = self.id;
        let mine: Vec<(u32, Hops)> = (self.coordinating.coord_iters.iter())
            .filter(|(_, ci)| !ci.is_applied())
            .map(|(k, ci)| (*k, ci.grants_of(me)))
            .collect();
        for (iter, granted) in mine {
            if !granted.is_empty() {
                self.send(d, Msg::Deputy { iter, granted });
            }
        }
    }

    /// This node took over coordinating (it must tell its own deputy
    /// everything, whoever was told before).
    pub(super) fn deputy_reset(&mut self) {
        self.deputy_state.sent_to = None;
    }

    /// Our coordinator's own grants of `iter`, kept in case it dies. From
    /// anyone else, or for an iteration applied here, ignored.
    pub(super) fn on_deputy(&mut self, from: NodeId, iter: u32, granted: Hops) {
        if self.group.coord() != Some(from) || from == self.id {
            return;
        }
        if self.iters.applied_through(iter) {
            return;
        }
        let st = &mut self.deputy_state;
        if st.of != Some(from) {
            st.of = Some(from);
            st.grants.clear();
        }
        if !st.grants.contains_key(&iter) && st.grants.len() >= MAX_ITERS {
            return;
        }
        let kept = st.grants.entry(iter).or_default();
        for (mb, prev, next) in granted {
            if mb.iter == iter && kept.len() < MAX_KEPT {
                kept.insert(mb, (prev, next));
            }
        }
    }

    /// Iterations up to `iter` are applied: nothing of them is needed.
    pub(super) fn deputy_forget_upto(&mut self, iter: u32) {
        self.deputy_state.grants.retain(|k, _| *k > iter);
    }

    /// This node took over from `old`, which is gone: the grants `old` gave
    /// itself, as this node kept them, are lost, and one stage of each is
    /// rerun (`redo_lost`: from the hop before, with the gradient of the
    /// hop after) instead of the whole microbatch.
    pub(super) fn inherit_deputy_grants(&mut self, old: NodeId) {
        let mut grants = if self.deputy_state.of == Some(old) {
            self.deputy_state.of = None;
            std::mem::take(&mut self.deputy_state.grants)
        } else {
            BTreeMap::new()
        };
        // The commits of `old` this node runs as a member (an epoch names
        // its coordinator in its high half).
        let runs = self.member.runs_of(old);
        let now = self.now;
        for (iter, epoch, members, digest) in runs {
            if self.iters.applied_through(iter) {
                continue;
            }
            self.coordinating.coord_iters.entry(iter).or_default();
            let held = grants.remove(&iter).unwrap_or_default();
            let t = Takeover {
                old,
                epoch,
                members,
                digest,
                held,
                since: now,
                reports: BTreeMap::new(),
            };
            self.deputy_state.takeovers.insert(iter, t);
        }
        for (iter, mbs) in grants {
            self.lose_copied_grants(iter, old, mbs);
        }
    }

    /// The grants `old` (gone) gave itself of `iter`, as copied here, are
    /// lost: one stage of each is rerun.
    fn lose_copied_grants(
        &mut self,
        iter: u32,
        old: NodeId,
        mbs: BTreeMap<MbId, (NodeId, NodeId)>,
    ) {
        if self.iters.applied_through(iter) {
            return;
        }
        let ci = self.coordinating.coord_iters.entry(iter).or_default();
        if ci.is_applied() {
            return;
        }
        let lost: Vec<(MbId, NodeId, NodeId)> = (mbs.into_iter())
            .filter(|(mb, _)| !ci.settled(mb))
            .map(|(mb, (prev, next))| (mb, prev, next))
            .collect();
        self.mark_lost(iter, old, lost);
        self.redo_lost(iter);
    }

    /// A member's report on the all-reduce of a commit this node may take
    /// over (`weights`: done; `None`: failed). False if it is not one.
    pub(super) fn takeover_report(
        &mut self,
        from: NodeId,
        iter: u32,
        epoch: u64,
        weights: Option<u64>,
    ) -> bool {
        let Some(t) = self.deputy_state.takeovers.get_mut(&iter) else {
            return false;
        };
        if t.epoch != epoch || !t.members.contains(&from) {
            return false;
        }
        t.reports.insert(from, weights);
        self.settle_takeover(iter);
        true
    }

    /// Decides a takeover once every live member's sync is in (or a
    /// heartbeat period passed), or at once when a member's part failed.
    pub(super) fn settle_takeover(&mut self, iter: u32) {
        let Some(t) = self.deputy_state.takeovers.get(&iter) else {
            return;
        };
        let failed = t.reports.values().any(Option::is_none);
        let due = t.since + self.cfg.heartbeat_ticks as Time * self.cfg.tick;
        if !failed && !self.all_synced(iter) && self.now < due {
            return;
        }
        let t = self
            .deputy_state
            .takeovers
            .remove(&iter)
            .expect("taking over");
        let ci = self.coordinating.coord_iters.entry(iter).or_default();
        if ci.is_applied() {
            return;
        }
        let (members, now) = (&t.members, self.now);
        if !ci.take_over(t.old, &t.held, members, t.epoch, t.digest, t.reports, now) {
            self.lose_copied_grants(iter, t.old, t.held);
        }
        self.coord_check(iter);
    }
}
