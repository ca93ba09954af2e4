//! The member side of the stage group: claims of backward results, the
//! granted contributions, syncs to a new coordinator.
use super::*;

/// This node as a member of its stage group.
#[derive(Debug, Default)]
pub(super) struct GroupMember {
    /// Contributions claimed and granted, by iteration.
    acc: BTreeMap<u32, Acc>,
    /// Last commit (coordinator, epoch) this member ran.
    last_commit: Option<(u32, u64)>,
    /// Claims that were pending at the last heartbeat (re-sent at the next
    /// one if still unanswered).
    stale_claims: BTreeSet<MbId>,
    /// Digest of the weights this member holds (set by its runtime after
    /// every apply or state import; 0: not known, as in the simulator).
    weights: u64,
}

impl GroupMember {
    /// The digest of the weights this member holds (0: not known).
    pub(super) fn weights(&self) -> u64 {
        self.weights
    }

    /// Whether this member's all-reduce of a commit of `iter` ended with
    /// the mean.
    pub(super) fn ran_commit_of(&self, iter: u32) -> bool {
        self.acc
            .get(&iter)
            .is_some_and(|a| a.agg_finished.is_some())
    }

    /// Forgets the contributions of `iter` and before (applied).
    pub(super) fn forget_upto(&mut self, iter: u32) {
        self.acc.retain(|k, _| *k > iter);
    }

    /// The commit (iteration, epoch) aggregate task `id` runs.
    pub(super) fn commit_of(&self, id: TaskId) -> Option<(u32, u64)> {
        self.acc
            .iter()
            .find_map(|(k, a)| a.agg_task.filter(|t| t.0 == id).map(|t| (*k, t.1)))
    }

    /// The all-reduce of commit `epoch` of `iter` ended here with the mean.
    pub(super) fn aggregate_finished(&mut self, iter: u32, epoch: u64) {
        if let Some(a) = self.acc.get_mut(&iter) {
            a.agg_finished = Some(epoch);
        }
    }

    /// The all-reduce of commit `epoch` of `iter` failed here.
    pub(super) fn aggregate_failed(&mut self, iter: u32, epoch: u64) {
        if let Some(a) = self.acc.get_mut(&iter) {
            a.agg_failed = Some(epoch);
        }
    }

    /// The commits of coordinator `coord` this member runs: (iteration,
    /// epoch, members, digest); an epoch names its coordinator in its high
    /// half.
    pub(super) fn runs_of(&self, coord: NodeId) -> Vec<(u32, u64, Arc<Vec<NodeId>>, u64)> {
        (self.acc.iter())
            .filter_map(|(&k, a)| {
                let (_, epoch) = a.agg_task?;
                let members = a.agg_members.clone()?;
                let ours = epoch >> 32 == coord as u64 && members.contains(&coord);
                ours.then_some((k, epoch, members, a.agg_digest))
            })
            .collect()
    }

    /// The commit of `iter` this member runs: its task, and how many
    /// microbatches the commit counts as its own.
    #[cfg(test)]
    pub(super) fn running(&self, iter: u32) -> Option<(Option<(TaskId, u64)>, usize)> {
        self.acc.get(&iter).map(|a| (a.agg_task, a.agg_mine.len()))
    }
}

/// What one aggregate task must reduce: the commit it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AggregatePlan {
    pub iter: u32,
    /// The commit's epoch (a new commit of the same iteration has a new one).
    pub epoch: u64,
    /// The members that reduce together, in the commit's order (every
    /// member is given the same list).
    pub members: Arc<Vec<NodeId>>,
    /// This member's granted microbatches of `iter`: exactly what its
    /// contribution must sum, each once.
    pub granted: Vec<MbId>,
}

/// Stage groups of at most this many members all-reduce by the butterfly
/// (`crate::swarm::butterfly`: every member reduces one part of the
/// gradients, two message rounds over all of a member's links at once);
/// larger ones by the hierarchy (`crate::swarm::hierarchy`: butterflies in
/// groups of at most this many, then across the groups), which needs a
/// member's connections to its group and its column only, and pays five
/// message rounds where a ring pays `2 (n-1)` latencies in sequence.
pub const BUTTERFLY_MAX_MEMBERS: usize = 64;

/// Syncs kept for a coordinator role not yet taken over, at most.
pub(super) const MAX_EARLY_SYNCS: usize = 1024;

/// A member's accumulated (granted) contributions of one iteration.
#[derive(Clone, Debug, Default)]
pub(super) struct Acc {
    granted: BTreeMap<MbId, (NodeId, NodeId, Vec<TaskId>)>,
    pending: BTreeMap<MbId, (NodeId, NodeId, Vec<TaskId>)>,
    /// Claims that were refused. A claim is re-sent when unanswered for a
    /// heartbeat period, so a late grant can follow a refusal (the holder
    /// of the first grant died in between): the grant is honoured, since
    /// the coordinator counts the microbatch as ours from then on.
    refused: BTreeMap<MbId, (NodeId, NodeId, Vec<TaskId>)>,
    agg_task: Option<(TaskId, u64)>,
    /// The members of the commit `agg_task` runs, and its digest.
    agg_members: Option<Arc<Vec<NodeId>>>,
    agg_digest: u64,
    /// What that commit counts as this member's: its contribution sums
    /// exactly these (see `Msg::Commit`).
    agg_mine: Arc<Vec<MbId>>,
    /// The epoch whose all-reduce ended here with the mean (told again to
    /// a new coordinator, which may take the commit over: see `deputy`).
    agg_finished: Option<u64>,
    /// The epoch whose all-reduce failed here (told again to a new
    /// coordinator: the `AggFailed` may have gone to one that died, and a
    /// successor taking its commit over would wait `redo_timeout` for a
    /// result that never comes).
    agg_failed: Option<u64>,
}

/// Each microbatch of `claims` with the hop it came from and went to.
fn hops(claims: &BTreeMap<MbId, (NodeId, NodeId, Vec<TaskId>)>) -> Vec<(MbId, NodeId, NodeId)> {
    claims.iter().map(|(m, (p, n, _))| (*m, *p, *n)).collect()
}

impl Node {
    /// The commit an aggregate task `id` runs, with this member's granted
    /// microbatches (None: not a live aggregate task).
    pub fn aggregate_plan(&self, id: TaskId) -> Option<AggregatePlan> {
        self.member.acc.iter().find_map(|(iter, a)| {
            let (t, epoch) = a.agg_task?;
            (t == id).then(|| AggregatePlan {
                iter: *iter,
                epoch,
                members: a.agg_members.clone().unwrap_or_default(),
                granted: a.agg_mine.iter().copied().collect(),
            })
        })
    }

    /// The runtime applied, after downloading the stage's state again, the
    /// updates through `iter` that the stage applied meanwhile, from the
    /// means it kept (see `Config::leave_out_stragglers`): its weights
    /// hold them all, and it may serve them.
    pub fn caught_up(&mut self, iter: u32) {
        self.iters.caught_up(iter);
    }

    /// Sets the digest of the weights this member holds (see `Msg::AggDone`).
    pub fn set_weights_digest(&mut self, digest: u64) {
        self.member.weights = digest;
    }

    /// A one-line summary of the member state (debugging aid).
    pub fn debug_member(&self) -> String {
        format!(
            "node {} coord {:?} last_commit {:?} last_applied {:?} acc {:?} tasks {:?}",
            self.id,
            self.group.coord(),
            self.member.last_commit,
            self.iters.last_applied(),
            self.member
                .acc
                .iter()
                .map(|(k, a)| (*k, a.granted.len(), a.pending.len(), a.agg_task))
                .collect::<Vec<_>>(),
            self.tasks
                .iter()
                .filter(|t| matches!(t.1 .0, TaskKind::Aggregate { .. }))
                .map(|t| *t.0)
                .collect::<Vec<_>>()
        )
    }

    /// Tells coordinator `c` (new, or this node itself) everything it had
    /// from this member: its claims not answered yet, then its grants, per
    /// iteration (a Sync even with none). On one connection they arrive in
    /// that order, so once a member's Sync is in, so are its claims: a
    /// coordinator that took over from a dead one knows it has heard all
    /// a member had to say ([`Node::all_synced`]).
    pub(super) fn sync_to(&mut self, c: NodeId) {
        let iters: Vec<u32> = self.member.acc.keys().copied().collect();
        for &k in &iters {
            for (mb, prev, next) in hops(&self.member.acc[&k].pending) {
                self.send(
                    c,
                    Msg::Claim {
                        iter: k,
                        mb,
                        prev,
                        next,
                    },
                );
            }
        }
        for &k in &iters {
            let granted = hops(&self.member.acc[&k].granted);
            self.send(
                c,
                Msg::Sync {
                    iter: k,
                    granted,
                    end: None,
                },
            );
        }
        // An all-reduce that ended here, with the mean or failed, is told
        // again: the new coordinator may take its commit over (see
        // `deputy`), and a failure it does not hear of would keep that
        // commit waiting `redo_timeout`.
        for &k in &iters {
            self.tell_agg_result(c, k);
        }
        if iters.is_empty() {
            let iter = self.iters.next_hint();
            self.send(
                c,
                Msg::Sync {
                    iter,
                    granted: Vec::new(),
                    end: None,
                },
            );
        }
        if self.stage == 0 {
            if let Some(k) = self.dh.reported_iter() {
                self.send(c, Msg::HolderDone { iter: k });
            }
        }
        // The last update applied here: a new coordinator that lacks it (it
        // joined again while the stage applied it) learns that its own
        // weights are behind, and downloads them again before its next
        // gradient, instead of aggregating on stale weights.
        if c != self.id {
            if let Some(iter) = self.iters.last_applied() {
                let version = self.iters.version().1;
                self.send(c, Msg::Applied { iter, version });
            }
        }
        let (stage, incarnation) = (self.stage, self.incarnation);
        self.send(c, Msg::GroupJoin { stage, incarnation });
        // A new coordinator knows no member's links: without them it would
        // order its first ring blind (the slowest ring there is).
        if c != self.id && self.group.coord() == Some(c) {
            self.report_group_links();
        }
    }

    /// A claim still unanswered after a whole heartbeat period reached a node
    /// that did not coordinate (yet): it came before that node heard that
    /// its coordinator left or died, and was answered with a member list
    /// only. It is sent again (a claim is idempotent at the coordinator: the
    /// same claimant gets the same answer).
    pub(super) fn resend_stale_claims(&mut self, c: NodeId) {
        let pending: BTreeSet<MbId> = self
            .member
            .acc
            .values()
            .flat_map(|a| a.pending.keys().copied())
            .collect();
        let stale: Vec<MbId> = pending
            .intersection(&self.member.stale_claims)
            .copied()
            .collect();
        for mb in stale {
            let (prev, next, _) = &self.member.acc[&mb.iter].pending[&mb];
            let (prev, next) = (*prev, *next);
            self.send(
                c,
                Msg::Claim {
                    iter: mb.iter,
                    mb,
                    prev,
                    next,
                },
            );
        }
        self.member.stale_claims = pending;
    }

    pub(super) fn claim(&mut self, mb: MbId, prev: NodeId, next: NodeId, tasks: Vec<TaskId>) {
        let iter = mb.iter;
        self.member
            .acc
            .entry(iter)
            .or_default()
            .pending
            .insert(mb, (prev, next, tasks));
        if let Some(c) = self.group.coord() {
            self.send(
                c,
                Msg::Claim {
                    iter,
                    mb,
                    prev,
                    next,
                },
            );
        }
    }

    pub(super) fn on_claim_reply(&mut self, mb: MbId, granted: bool) {
        let Some(a) = self.member.acc.get_mut(&mb.iter) else {
            return;
        };
        let x = match a.pending.remove(&mb) {
            Some(x) => x,
            None if granted && !a.granted.contains_key(&mb) => {
                let Some(x) = a.refused.remove(&mb) else {
                    return;
                };
                x
            }
            // A new coordinator refuses a grant we synced to it: it gave
            // the microbatch to another member (a re-run, after it took our
            // grant for lost with its predecessor) or gave it up. It is not
            // ours in the aggregate any more.
            None if !granted => match a.granted.remove(&mb) {
                Some(x) => x,
                None => return,
            },
            None => return,
        };
        if granted {
            let tasks = x.2.clone();
            a.granted.insert(mb, x);
            self.event(Event::Claimed { mb, tasks });
        } else {
            a.refused.insert(mb, x);
        }
    }

    /// The coordinator commits `iter`: run the all-reduce (once per epoch).
    /// Tells `c` how the all-reduce of this member's last commit of `iter`
    /// ended, if it did (nothing while it runs).
    fn tell_agg_result(&mut self, c: NodeId, k: u32) {
        let Some(a) = self.member.acc.get(&k) else {
            return;
        };
        let Some((task, e)) = a.agg_task else { return };
        if a.agg_finished == Some(e) {
            let weights = self.member.weights;
            self.send(
                c,
                Msg::AggDone {
                    iter: k,
                    epoch: e,
                    weights,
                },
            );
        } else if a.agg_failed == Some(e) || !self.tasks.contains_key(&task) {
            // Failed, or its task ended with no result kept: either way
            // the coordinator must commit again, not wait.
            self.send(c, Msg::AggFailed { iter: k, epoch: e });
        }
    }

    pub(super) fn on_commit(
        &mut self,
        from: NodeId,
        iter: u32,
        epoch: u64,
        members: Arc<Vec<NodeId>>,
        digest: u64,
        mine: Arc<Vec<MbId>>,
    ) {
        if self.phase != Phase::Active {
            // Not a member (fenced, joining again): its part would not be
            // reported (a task of a node not active ends unheard), and the
            // coordinator would wait for it. It commits again without it
            // or, once this node's GroupJoin is in, with it.
            self.send(from, Msg::AggFailed { iter, epoch });
            return;
        }
        if self.member.last_commit == Some((iter, epoch)) {
            // Sent again: the coordinator has not heard how it ended.
            self.tell_agg_result(from, iter);
            return;
        }
        if self.iters.applied_through(iter) {
            // A new coordinator commits what its predecessor had applied
            // here before it died (its Applied did not reach the new one):
            // applying it twice would fork the stage. Tell it instead.
            let (iter, version) = self.iters.version();
            self.send(from, Msg::Applied { iter, version });
            return;
        }
        self.member.last_commit = Some((iter, epoch));
        let a = self.member.acc.entry(iter).or_default();
        // The commit counts these as ours: a claim not answered yet or
        // refused is granted (a reply may be on its way or lost). What it
        // does not count as ours stays out of the sum: another member
        // sums it (two members each granted the same microbatch by a
        // coordinator and its successor summed it twice, the update
        // counting 8 microbatches of 4). One it counts that this node
        // never computed cannot be summed: the mean then counts fewer.
        let mut summed = Vec::with_capacity(mine.len());
        for mb in mine.iter() {
            if let Some(c) = (a.pending.remove(mb)).or_else(|| a.refused.remove(mb)) {
                a.granted.insert(*mb, c);
            }
            if a.granted.contains_key(mb) {
                summed.push(*mb);
            }
        }
        let n = members.len() as u32;
        let t = self.run(TaskKind::Aggregate { members: n }, None, 0);
        let a = self.member.acc.get_mut(&iter).unwrap();
        a.agg_task = Some((t, epoch));
        a.agg_members = Some(members);
        a.agg_digest = digest;
        a.agg_mine = Arc::new(summed);
        a.agg_finished = None;
        a.agg_failed = None;
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// A claim re-sent after a heartbeat period can be granted after its
    /// first copy was refused (the first grant's owner died in between):
    /// the coordinator then counts the microbatch as ours, so the late grant
    /// must be honoured. A grant for a microbatch never claimed is ignored.
    #[test]
    fn a_grant_after_a_refusal_is_honoured() {
        let cfg = Config::new(Policy::Gwtf, 4, 1 << 20);
        let mut n = Node::new(Arc::new(cfg), 5, 2, 0.5, 4, 1);
        let mb = MbId {
            holder: 0,
            iter: 3,
            idx: 1,
        };
        let other = MbId { idx: 2, ..mb };
        n.member
            .acc
            .entry(3)
            .or_default()
            .pending
            .insert(mb, (1, 7, vec![11, 12]));
        n.on_claim_reply(mb, false);
        assert!(n.member.acc[&3].granted.is_empty());
        n.on_claim_reply(mb, true);
        assert_eq!(
            n.member.acc[&3].granted.get(&mb),
            Some(&(1, 7, vec![11, 12]))
        );
        assert!(n.member.acc[&3].refused.is_empty());
        // A repeated grant changes nothing; a refusal of a synced grant
        // (a new coordinator gave the microbatch to someone else) takes it
        // out of our contribution.
        n.on_claim_reply(mb, true);
        assert_eq!(n.member.acc[&3].granted.len(), 1);
        n.on_claim_reply(mb, false);
        assert!(n.member.acc[&3].granted.is_empty());
        assert!(n.member.acc[&3].refused.contains_key(&mb));
        n.on_claim_reply(other, true);
        assert!(!n.member.acc[&3].granted.contains_key(&other));
    }

    /// A member sums exactly what the commit counts as its own: a grant
    /// it holds that the coordinator counts as another member's stays out
    /// (two members, each granted a microbatch by a coordinator and its
    /// successor, summed it twice); a claim whose grant has not come yet
    /// is in; a microbatch it never computed cannot be.
    #[test]
    fn a_member_sums_exactly_what_the_commit_counts_as_its_own() {
        let mut n = started(Policy::Gwtf, 5, 2, &[3, 7], &[]);
        let a = n.member.acc.entry(4).or_default();
        for idx in [0, 1] {
            a.granted.insert(mb(9, 4, idx), (1, 2, vec![]));
        }
        a.pending.insert(mb(9, 4, 2), (1, 2, vec![]));
        let commit = Msg::Commit {
            iter: 4,
            epoch: 1,
            members: Arc::new(vec![3, 5, 7]),
            digest: 0,
            mine: Arc::new(vec![mb(9, 4, 1), mb(9, 4, 2), mb(9, 4, 3)]),
        };
        let acts = deliver(&mut n, 3, commit);
        let task = runs(&acts)
            .iter()
            .find(|t| t.kind == TaskKind::Aggregate { members: 3 })
            .unwrap()
            .id;
        let plan = n.aggregate_plan(task).unwrap();
        assert_eq!(plan.granted, vec![mb(9, 4, 1), mb(9, 4, 2)]);
        assert!(n.member.acc[&4].granted.contains_key(&mb(9, 4, 2)));
    }

    /// A commit runs the all-reduce once per (iteration, epoch): a repeated
    /// commit is ignored, a new epoch (a member was lost) runs it again.
    #[test]
    fn a_commit_runs_the_all_reduce_once_per_epoch() {
        let mut n = started(Policy::Gwtf, 5, 2, &[3, 7], &[]);
        let members = Arc::new(vec![3, 5, 7]);
        let commit = |e| Msg::Commit {
            iter: 4,
            epoch: e,
            members: members.clone(),
            digest: 0,
            mine: Arc::new(Vec::new()),
        };
        let aggregates = |a: &[Action]| {
            runs(a)
                .iter()
                .filter(|t| t.kind == TaskKind::Aggregate { members: 3 })
                .count()
        };
        assert_eq!(aggregates(&deliver(&mut n, 3, commit(1))), 1);
        assert_eq!(aggregates(&deliver(&mut n, 3, commit(1))), 0);
        assert_eq!(aggregates(&deliver(&mut n, 3, commit(2))), 1);
        assert_eq!(n.member.last_commit, Some((4, 2)));
    }

    /// A commit always gets an answer. A node that is not active (fenced,
    /// joining again) runs none and says it failed at once: the result of
    /// a task that ends while it is not active is not reported, and its
    /// coordinator waited for it for good (a swarm test's stage stood
    /// still 150 s so). A commit sent again whose task ended with no
    /// result kept is answered so too.
    #[test]
    fn a_commit_always_gets_an_answer() {
        let commit = |e| Msg::Commit {
            iter: 4,
            epoch: e,
            members: Arc::new(vec![3, 5, 7]),
            digest: 0,
            mine: Arc::new(Vec::new()),
        };
        let failed = |acts: &[Action], e: u64| {
            sends(acts).iter().any(|(to, m)| {
                *to == 3 && matches!(m, Msg::AggFailed { iter: 4, epoch } if *epoch == e)
            })
        };
        let mut j = Node::new(config(Policy::Gwtf), 5, 2, 0.5, 4, 1);
        j.handle(
            SEC,
            Input::Join {
                peers: vec![(3, 2), (7, 2)],
            },
        );
        assert!(!j.is_active());
        let acts = deliver(&mut j, 3, commit(1));
        assert!(runs(&acts).is_empty());
        assert!(failed(&acts, 1));
        // An active member: running, it says nothing more; its task gone
        // with no result, it says it failed.
        let mut n = started(Policy::Gwtf, 5, 2, &[3, 7], &[]);
        let acts = deliver(&mut n, 3, commit(1));
        assert_eq!(runs(&acts).len(), 1);
        assert!(sends(&deliver(&mut n, 3, commit(1))).is_empty());
        n.tasks.clear();
        assert!(failed(&deliver(&mut n, 3, commit(1)), 1));
    }
}
