//! What a node knows of the iterations (shared by the parts: read by all,
//! changed only through these methods): the weights it holds, the
//! iterations it knows of, and which are final.
use super::*;

/// The end of an iteration: who announced it, and the holders done.
pub(super) type End = (NodeId, Arc<Vec<NodeId>>);

#[derive(Debug, Default)]
pub(super) struct Iterations {
    /// The weights version (iteration, hash) this node holds.
    version: (u32, u64),
    /// Last iteration whose aggregate this node applied.
    last_applied: Option<u32>,
    /// The last iteration whose update the weights hold together with
    /// every one before it. An update the stage applies on top of weights
    /// that missed the one before (a node that downloaded a stale state)
    /// is not applied by the runtime (it downloads again), so the weights
    /// hold no more than before the gap: this is what `updates` counts,
    /// not `last_applied`.
    held: Option<u32>,
    /// Iterations before this one are final (their state is forgotten).
    min_iter: u32,
    /// When the end of each iteration was last passed on.
    end_fwd: BTreeMap<u32, Time>,
    /// Holders: the latest iteration announced and its participants.
    seen_iter: Option<(u32, Arc<Vec<NodeId>>)>,
    /// Largest next iteration peers told us about.
    known_iter: u32,
    /// A relay told us which iteration comes next (`known_iter`): a holders'
    /// coordinator without a history of its own opens no iteration before.
    iter_heard: bool,
    /// The holders taking part in each iteration opened (the holders'
    /// `StartIter`, passed along the pipeline): a stage knows the
    /// microbatches it must aggregate before the iteration ends.
    participants: BTreeMap<u32, Arc<Vec<NodeId>>>,
    /// The end of each iteration heard of (origin, holders done): a member
    /// that becomes coordinator knows at once which iterations ended.
    ends: BTreeMap<u32, End>,
}

impl Iterations {
    /// The weights version: (iteration applied, hash).
    pub(super) fn version(&self) -> (u32, u64) {
        self.version
    }

    /// The last iteration whose update this node applied.
    pub(super) fn last_applied(&self) -> Option<u32> {
        self.last_applied
    }

    /// Whether this node applied the update of `iter` (or a later one).
    pub(super) fn applied_through(&self, iter: u32) -> bool {
        self.last_applied.is_some_and(|a| a >= iter)
    }

    /// The oldest iteration this node still takes work of.
    pub(super) fn min_iter(&self) -> u32 {
        self.min_iter
    }

    /// The iteration this node saw begin, with its holders.
    pub(super) fn seen_iter(&self) -> Option<&(u32, Arc<Vec<NodeId>>)> {
        self.seen_iter.as_ref()
    }

    /// The highest iteration this node knows of.
    pub(super) fn known_iter(&self) -> u32 {
        self.known_iter
    }

    /// Whether this node heard of an iteration at all.
    pub(super) fn iter_heard(&self) -> bool {
        self.iter_heard
    }

    /// The holders that take part in `iter`, as announced.
    pub(super) fn participants_of(&self, iter: u32) -> Option<&Arc<Vec<NodeId>>> {
        self.participants.get(&iter)
    }

    /// The iteration this node believes comes next (told to new holders):
    /// past the last one applied here, and past the last one whose end was
    /// announced (an ended iteration takes no new microbatches; the holders'
    /// stage may already have applied it).
    pub(super) fn next_hint(&self) -> u32 {
        let a = self.last_applied.map_or(0, |a| a + 1);
        let s = self.seen_iter.as_ref().map_or(0, |s| s.0);
        let e = self.end_fwd.keys().next_back().map_or(0, |k| k + 1);
        a.max(s).max(e).max(self.min_iter).max(self.known_iter)
    }

    /// The iteration in progress as far as this node knows: the latest one
    /// opened, never before the oldest one kept. Iterations open one at a
    /// time (the barrier opens the next when the last is final), so this
    /// can lag the swarm (news of the opening missed) but never lead it.
    pub(super) fn in_progress(&self) -> u32 {
        let opened = self.participants.keys().next_back().copied();
        opened.map_or(self.min_iter, |o| o.max(self.min_iter))
    }

    /// A peer (a relay unless `from_holder`) says `iter` comes next.
    pub(super) fn hear_next(&mut self, iter: u32, from_holder: bool) {
        self.known_iter = self.known_iter.max(iter);
        if !from_holder {
            self.iter_heard = true;
        }
    }

    /// Holders: iteration `iter` was announced with these participants.
    pub(super) fn announced(&mut self, iter: u32, holders: &Arc<Vec<NodeId>>) {
        if self.seen_iter.as_ref().is_none_or(|s| s.0 < iter) {
            self.seen_iter = Some((iter, holders.clone()));
        }
    }

    /// Iteration `iter` opened with these holders; false when already known
    /// (the news is then not passed on again).
    pub(super) fn opened(&mut self, iter: u32, holders: &Arc<Vec<NodeId>>) -> bool {
        if iter < self.min_iter || self.participants.contains_key(&iter) {
            return false;
        }
        self.participants.insert(iter, holders.clone());
        true
    }

    /// Iteration `iter` ended for `holders` (announced by `origin`); true
    /// when that is news: the first end heard of, or one announced by
    /// another origin (the holders' coordinator changed: the stages must
    /// tell the new one they are done, and soon).
    pub(super) fn ended(&mut self, iter: u32, origin: NodeId, holders: &Arc<Vec<NodeId>>) -> bool {
        if iter < self.min_iter {
            return false;
        }
        let news = self.ends.get(&iter).is_none_or(|e| e.0 != origin);
        self.ends.insert(iter, (origin, holders.clone()));
        news
    }

    /// The ends heard of iterations not applied here.
    pub(super) fn ends_not_applied(&self) -> Vec<(u32, End)> {
        self.ends
            .iter()
            .filter(|(k, _)| self.last_applied.is_none_or(|a| **k > a))
            .map(|(k, e)| (*k, e.clone()))
            .collect()
    }

    /// Whether the end of `iter` is to be passed on now: once per
    /// `period`, and at once when it is `news` (see [`Self::ended`]).
    pub(super) fn pass_on_end(&mut self, iter: u32, now: Time, period: Time, news: bool) -> bool {
        let last = self.end_fwd.get(&iter).copied();
        if news || last.is_none_or(|t| t + period <= now) {
            self.end_fwd.insert(iter, now);
            return true;
        }
        false
    }

    /// The aggregate of `iter` was applied: weights `version`.
    pub(super) fn applied(&mut self, iter: u32, version: u64) {
        self.version = (iter, version);
        self.last_applied = Some(self.last_applied.map_or(iter, |a| a.max(iter)));
        if self.held.map_or(iter == 0, |h| h + 1 >= iter) {
            self.held = Some(self.held.map_or(iter, |h| h.max(iter)));
        }
    }

    /// The stage applied the aggregate of `iter` without this node (it was
    /// left out of the commit, or its part of the all-reduce failed): the
    /// weights do not hold that update, and the runtime downloads the
    /// state again ([`Self::resynced`]).
    pub(super) fn missed(&mut self, iter: u32, version: u64) {
        self.version = (iter, version);
        self.last_applied = Some(self.last_applied.map_or(iter, |a| a.max(iter)));
    }

    /// The runtime applied, after a state download, the updates through
    /// `iter` from the means it kept: the weights hold them all.
    pub(super) fn caught_up(&mut self, iter: u32) {
        if self.last_applied.is_some_and(|a| a >= iter) && self.held.is_none_or(|h| h < iter) {
            self.held = Some(iter);
        }
    }

    /// How many iterations' updates the weights hold: the last one applied
    /// plus one (0: none). What heartbeats and evictions carry, so that
    /// of two groups of one stage the one behind gives way.
    pub(super) fn updates(&self) -> u32 {
        self.held.map_or(0, |a| a + 1)
    }

    /// Whether the weights miss an update the stage applied (see
    /// `held`): they are not the stage's state, and are not served.
    pub(super) fn gap(&self) -> bool {
        self.last_applied
            .is_some_and(|a| self.held.is_none_or(|h| h < a))
    }

    /// A joining node downloaded weights `version`.
    pub(super) fn downloaded(&mut self, version: (u32, u64)) {
        self.version = version;
        if version != (0, 0) {
            self.last_applied = Some(version.0);
            self.held = Some(version.0);
        }
    }

    /// A member that missed an update downloaded the stage's state again:
    /// weights `version` (an older state than held changes nothing).
    pub(super) fn resynced(&mut self, version: (u32, u64)) {
        if version != (0, 0) && self.held.is_none_or(|h| h <= version.0) {
            self.held = Some(version.0);
            if self.last_applied.is_none_or(|a| a <= version.0) {
                self.version = version;
                self.last_applied = Some(version.0);
            }
        }
    }

    /// Iterations before `iter` are final; false when they were already.
    pub(super) fn finalize_before(&mut self, iter: u32) -> bool {
        if iter <= self.min_iter {
            return false;
        }
        self.min_iter = iter;
        true
    }

    /// The ends passed on of the iterations before `iter` are forgotten.
    pub(super) fn forget_ends_before(&mut self, iter: u32) {
        self.end_fwd.retain(|k, _| *k >= iter);
        self.participants.retain(|k, _| *k >= iter);
        self.ends.retain(|k, _| *k >= iter);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weights' updates count only those applied without a gap: a
    /// stale download followed by the stage's next update holds the
    /// download's, and a download again closes the gap.
    #[test]
    fn updates_applied_over_a_gap_are_not_counted() {
        let mut k = Iterations::default();
        k.applied(0, 5);
        k.applied(1, 6);
        assert_eq!((k.updates(), k.gap()), (2, false));
        let mut j = Iterations::default();
        j.downloaded((11, 7));
        assert_eq!(j.updates(), 12);
        j.applied(12, 8);
        assert_eq!((j.updates(), j.gap()), (13, false));
        // The stage applied 13..17 elsewhere: 18 is applied over a gap.
        j.applied(18, 9);
        assert_eq!((j.updates(), j.gap(), j.last_applied), (13, true, Some(18)));
        j.resynced((10, 1));
        assert_eq!((j.updates(), j.gap()), (13, true));
        j.resynced((18, 9));
        assert_eq!((j.updates(), j.gap(), j.version), (19, false, (18, 9)));
    }

    /// An update applied without this node leaves a gap that the next
    /// update does not close; the state downloaded again does.
    #[test]
    fn an_update_missed_is_not_counted_until_the_state_is_downloaded_again() {
        let mut k = Iterations::default();
        k.applied(0, 5);
        k.applied(1, 6);
        k.missed(2, 7);
        assert_eq!((k.updates(), k.gap(), k.last_applied), (2, true, Some(2)));
        k.applied(3, 8);
        assert_eq!((k.updates(), k.gap(), k.last_applied), (2, true, Some(3)));
        k.resynced((3, 8));
        assert_eq!((k.updates(), k.gap(), k.version), (4, false, (3, 8)));
        // A state of update 3, then the means of 4 and 5 kept while it came.
        k.missed(4, 9);
        k.applied(5, 10);
        k.resynced((3, 8));
        assert_eq!((k.updates(), k.gap()), (4, true));
        k.caught_up(5);
        assert_eq!((k.updates(), k.gap(), k.version), (6, false, (5, 10)));
        // Never past what the stage applied.
        k.caught_up(9);
        assert_eq!(k.updates(), 6);
    }

    /// The iteration in progress is the latest one opened, and never one
    /// before the oldest kept.
    #[test]
    fn the_iteration_in_progress_is_the_latest_opened() {
        let mut k = Iterations::default();
        assert_eq!(k.in_progress(), 0);
        let h = Arc::new(vec![1, 2]);
        assert!(k.opened(3, &h));
        assert_eq!(k.in_progress(), 3);
        assert!(k.finalize_before(5));
        k.forget_ends_before(5);
        assert_eq!(k.in_progress(), 5);
        assert!(k.opened(6, &h));
        assert_eq!(k.in_progress(), 6);
    }

    /// The next iteration is past everything known: applied, announced,
    /// ended, final, or heard of.
    #[test]
    fn the_next_iteration_is_past_all_that_is_known() {
        let mut k = Iterations::default();
        assert_eq!(k.next_hint(), 0);
        k.applied(4, 77);
        assert_eq!((k.next_hint(), k.version), (5, (4, 77)));
        k.applied(2, 9);
        assert_eq!(k.last_applied, Some(4));
        assert_eq!((k.held, k.updates(), k.gap()), (None, 0, true));
        assert!(k.pass_on_end(6, 10 * SEC, SEC, false));
        assert!(!k.pass_on_end(6, 10 * SEC + SEC / 2, SEC, false));
        assert!(k.pass_on_end(6, 10 * SEC + SEC / 2, SEC, true));
        assert!(!k.pass_on_end(6, 11 * SEC, SEC, false));
        assert!(k.pass_on_end(6, 23 * SEC / 2, SEC, false));
        assert_eq!(k.next_hint(), 7);
        k.hear_next(9, true);
        assert_eq!((k.next_hint(), k.iter_heard), (9, false));
        k.hear_next(3, false);
        assert!(k.iter_heard);
        assert!(k.finalize_before(12) && !k.finalize_before(11));
        assert_eq!(k.next_hint(), 12);
        let h = Arc::new(vec![1, 2]);
        assert!(k.opened(12, &h) && !k.opened(12, &h) && !k.opened(11, &h));
        // An end is news the first time, and when another origin announces it.
        assert!(k.ended(12, 1, &h) && !k.ended(12, 1, &h) && k.ended(12, 2, &h));
        assert!(!k.ended(11, 3, &h));
        assert_eq!(k.participants.get(&12), Some(&h));
        k.forget_ends_before(13);
        assert!(k.end_fwd.is_empty() && k.participants.is_empty());
    }
}
