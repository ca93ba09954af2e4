//! An emptied stage restored from the copies the data holders keep
//! (`Config::keep_states_every`): the joiner that would restart a stage no
//! live node holds first asks every live holder which copy of the stage's
//! state it keeps (`KeptQuery`, `KeptInfo`), downloads the freshest
//! (`KeptRequest`, answered with a `StateResponse` by the holder's
//! runtime), and serves the stage from it ([`Event::StageRestored`]).
//! With no copy offered (or every offer failing) it rebuilds the stage
//! from its neighbouring relay stages' weights (CheckFree, where the
//! trainer can: `Config::rebuild_from_neighbours`): it asks one live member
//! of each for its state (`RebuildRequest`, answered like a download by
//! the member's runtime) and serves the stage from what came
//! ([`Event::StageRebuilt`]: its trainer averages the states that fit).
//! With neither, it restarts the stage from the initial weights
//! ([`Event::StageRestarted`]), as before.
//!
//! The restored weights are those of the copy's iteration; they stand for
//! the weights of the iteration before the one in progress: the updates
//! between are lost with the stage's nodes, and the other stages keep
//! their newer weights (as CheckFree restores a stage). The joiner then
//! coordinates the stage as a restarted one does.
use super::*;

/// Holders asked at once, at most (the first ones the joiner knows).
const HOLDERS_ASKED_MAX: usize = 16;

/// A restore in progress.
#[derive(Debug, Clone)]
pub(super) struct Restore {
    stage: Stage,
    /// The iteration in progress when the stage was found empty.
    next: u32,
    /// Holders asked and not answered yet.
    waiting: BTreeSet<NodeId>,
    /// Copies offered: (iteration, holder); the freshest is tried first.
    offers: BTreeSet<(u32, NodeId)>,
    /// Rebuilding from the neighbours: those asked whose state has not
    /// come (and their stage), every one asked, and those whose state came.
    neighbours: BTreeMap<NodeId, Stage>,
    asked: BTreeSet<NodeId>,
    rebuilt_from: Vec<NodeId>,
    /// The weights versions of the states that came: the rebuilt weights'
    /// version is mixed from them, so two rebuilds share a version only
    /// when they averaged the same weights.
    source_versions: Vec<(u32, u64)>,
}

/// What this node knows of copies: the ones its runtime keeps (a holder
/// answers `KeptQuery` from them) and the restore it runs.
#[derive(Debug, Default)]
pub(super) struct Restoring {
    /// The copies this node's runtime keeps: stage -> iteration.
    copies: BTreeMap<Stage, u32>,
    pending: Option<Restore>,
}

impl Restoring {
    /// Whether this joiner is taking up an emptied stage (asking for
    /// copies or its neighbours' states).
    pub(super) fn is_restoring(&self) -> bool {
        self.pending.is_some()
    }
}

impl Node {
    /// Whether this joiner is taking up an emptied stage (its download, if
    /// any, is a kept copy or a neighbour's state).
    pub fn restores_emptied_stage(&self) -> bool {
        self.restoring.is_restoring()
    }

    /// Its runtime keeps a copy of `stage`'s state of `iteration`.
    pub fn copy_kept(&mut self, stage: Stage, iteration: u32) {
        self.restoring.copies.insert(stage, iteration);
    }

    /// When the state this node is downloading is a kept copy of version
    /// `version` restoring an emptied stage: the iteration whose update
    /// the restored weights stand for (the trainer imports them as such).
    pub fn restore_applied(&self, version: (u32, u64)) -> Option<u32> {
        let r = self.restoring.pending.as_ref()?;
        let next = r.next.max(version.0 + 1).max(self.iters.known_iter());
        Some(next.saturating_sub(1))
    }

    /// `stage` has no live node: ask the live holders for their copies of
    /// it; with none to ask, rebuild or restart it at once.
    pub(super) fn restore_stage(&mut self, stage: Stage, next: u32) {
        let holders: BTreeSet<NodeId> = (self.peers.of_stage(0))
            .filter(|(id, p)| !p.dead && **id != self.id)
            .map(|(id, _)| *id)
            .take(HOLDERS_ASKED_MAX)
            .collect();
        for &h in &holders {
            self.send(h, Msg::KeptQuery { stage });
        }
        let none = holders.is_empty();
        self.restoring.pending = Some(Restore {
            stage,
            next,
            waiting: holders,
            offers: BTreeSet::new(),
            neighbours: BTreeMap::new(),
            asked: BTreeSet::new(),
            rebuilt_from: Vec::new(),
            source_versions: Vec::new(),
        });
        self.phase = Phase::Restoring { since: self.now };
        if none {
            self.restore_from_next_offer();
        }
    }

    /// A joiner asks which copy of `stage` this node keeps.
    pub(super) fn on_kept_query(&mut self, from: NodeId, stage: Stage) {
        let iteration = self.restoring.copies.get(&stage).copied();
        let open_iter = if self.stage == 0 {
            self.iters.next_hint()
        } else {
            0
        };
        let m = Msg::KeptInfo {
            stage,
            iteration,
            open_iter,
        };
        self.send(from, m);
    }

    /// A holder's answer to `KeptQuery` (or to `KeptRequest`: its copy is
    /// gone). The holders know the iteration in progress best: the relays
    /// that told of the empty stage may not have heard of its opening.
    pub(super) fn on_kept_info(
        &mut self,
        from: NodeId,
        stage: Stage,
        iteration: Option<u32>,
        open_iter: u32,
    ) {
        let Some(r) = self.restoring.pending.as_mut() else {
            return;
        };
        if r.stage != stage {
            return;
        }
        r.next = r.next.max(open_iter);
        match self.phase {
            Phase::Restoring { .. } => {
                if !r.waiting.remove(&from) {
                    return;
                }
                if let Some(i) = iteration {
                    r.offers.insert((i, from));
                }
                if r.waiting.is_empty() {
                    self.restore_from_next_offer();
                }
            }
            Phase::Downloading { src, .. } if src == from && iteration.is_none() => {
                self.restore_from_next_offer()
            }
            _ => {}
        }
    }

    /// Not every holder answered in time: the offers made stand.
    pub(super) fn restore_query_timed_out(&mut self, since: Time) {
        if self.now >= since + self.suspicion() {
            self.restore_from_next_offer();
        }
    }

    /// A holder (or a neighbour) asked died: it answers no more.
    pub(super) fn restore_holder_gone(&mut self, p: NodeId) {
        let Some(r) = self.restoring.pending.as_mut() else {
            return;
        };
        match self.phase {
            Phase::Restoring { .. } => {
                r.offers.retain(|&(_, h)| h != p);
                if r.waiting.remove(&p) && r.waiting.is_empty() {
                    self.restore_from_next_offer();
                }
            }
            Phase::Rebuilding { .. } => {
                // Another member of its stage is asked in its place.
                if let Some(s) = r.neighbours.remove(&p) {
                    self.ask_neighbour(s);
                }
                if (self.restoring.pending.as_ref()).is_some_and(|r| r.neighbours.is_empty()) {
                    self.finish_rebuild();
                }
            }
            _ => {}
        }
    }

    /// Downloads the freshest copy offered by a live holder; with none
    /// left, rebuilds the stage from its neighbours, or restarts it from
    /// the initial weights.
    pub(super) fn restore_from_next_offer(&mut self) {
        let Some(r) = self.restoring.pending.as_mut() else {
            return;
        };
        r.waiting.clear();
        // Weights this node kept of the stage at its fence are the stage's
        // own lineage: served again unless a holder offers a fresher copy
        // (a stage emptied by pauses whose first member back fenced itself
        // restarted from the initial weights, and its members that came
        // back later found their training gone).
        if let Some((st, _, version)) = self.joining.kept() {
            let freshest = r.offers.last().map(|&(i, _)| i);
            if st == r.stage && freshest.is_none_or(|i| i <= version.0) {
                let (stage, next) = (r.stage, r.next);
                self.restoring.pending = None;
                self.resume_kept(stage, version, next);
                return;
            }
        }
        while let Some((_, h)) = r.offers.pop_last() {
            if !self.peers.get(&h).is_some_and(|p| p.dead) {
                let stage = r.stage;
                self.stage = stage;
                self.phase = Phase::Downloading {
                    stage,
                    src: h,
                    since: self.now,
                };
                self.send(h, Msg::KeptRequest { stage });
                return;
            }
        }
        let (stage, next) = (r.stage, r.next);
        if !self.ask_neighbours(stage) {
            self.restoring.pending = None;
            self.restart_stage(stage, next);
        }
    }

    /// The neighbouring relay stages of relay stage `stage` (the data
    /// holders' stage 0 holds the embedding and head: its shapes never fit).
    fn relay_neighbours(&self, stage: Stage) -> Vec<Stage> {
        let relays = 1..=self.cfg.relay_stages;
        [stage.checked_sub(1), stage.checked_add(1)]
            .into_iter()
            .flatten()
            .filter(|s| relays.contains(s) && relays.contains(&stage))
            .collect()
    }

    /// Asks one live member of each neighbouring relay stage for its state
    /// to rebuild `stage` from (`Config::rebuild_from_neighbours`). False
    /// when it is off or there is none to ask.
    fn ask_neighbours(&mut self, stage: Stage) -> bool {
        if !self.cfg.rebuild_from_neighbours {
            return false;
        }
        let Some(r) = self.restoring.pending.as_mut() else {
            return false;
        };
        r.neighbours.clear();
        r.asked.clear();
        r.rebuilt_from.clear();
        r.source_versions.clear();
        for s in self.relay_neighbours(stage) {
            self.ask_neighbour(s);
        }
        if (self.restoring.pending.as_ref()).is_some_and(|r| r.neighbours.is_empty()) {
            return false;
        }
        self.stage = stage;
        self.phase = Phase::Rebuilding { since: self.now };
        true
    }

    /// Asks the live member of neighbouring stage `s` with the smallest id
    /// not asked yet for its state (none left: nothing is sent).
    fn ask_neighbour(&mut self, s: Stage) {
        let Some(r) = self.restoring.pending.as_ref() else {
            return;
        };
        let stage = r.stage;
        let next = (self.peers.of_stage(s))
            .filter(|(id, p)| !p.dead && **id != self.id && !r.asked.contains(id))
            .map(|(id, _)| *id)
            .min();
        let (Some(m), Some(r)) = (next, self.restoring.pending.as_mut()) else {
            return;
        };
        r.asked.insert(m);
        r.neighbours.insert(m, s);
        self.send(m, Msg::RebuildRequest { stage });
    }

    /// Whether this node waits for `from`'s state to rebuild a stage from
    /// (its runtime keeps it for the trainer).
    pub fn rebuild_awaits(&self, from: NodeId) -> bool {
        matches!(self.phase, Phase::Rebuilding { .. })
            && (self.restoring.pending.as_ref()).is_some_and(|r| r.neighbours.contains_key(&from))
    }

    /// A neighbour's state of weights `version` came (its runtime
    /// verified and kept it).
    pub(super) fn on_neighbour_state(&mut self, from: NodeId, version: (u32, u64)) {
        let Some(r) = self.restoring.pending.as_mut() else {
            return;
        };
        if r.neighbours.remove(&from).is_some() {
            r.rebuilt_from.push(from);
            r.source_versions.push(version);
            if r.neighbours.is_empty() {
                self.finish_rebuild();
            }
        }
    }

    /// Every neighbour asked answered, died, or was waited for long
    /// enough: the stage is rebuilt from the states that came, or
    /// restarted when none did.
    pub(super) fn finish_rebuild(&mut self) {
        let Some(mut r) = self.restoring.pending.take() else {
            return;
        };
        if r.rebuilt_from.is_empty() {
            self.restart_stage(r.stage, r.next);
            return;
        }
        r.rebuilt_from.sort_unstable();
        let from = r.rebuilt_from;
        // A version of its own: these weights descend from no update. It
        // is mixed from the sources' versions: two joiners that rebuilt
        // one stage from the same weights hold the same weights (their
        // groups merge as one), from other weights another version (the
        // group behind gives way and downloads the other's state).
        r.source_versions.sort_unstable();
        let salt =
            (r.source_versions.iter()).fold(u64::MAX - 2, |h, &(i, v)| mix(h, mix(i as u64, v)));
        self.serve_afresh(r.stage, r.next, salt, |stage, applied| {
            Event::StageRebuilt {
                stage,
                from,
                applied,
            }
        });
    }

    /// The kept copy (`version`) came from holder `from` and is imported:
    /// this node serves the stage from it, as of the iteration in progress.
    pub(super) fn restored(&mut self, from: NodeId, version: (u32, u64)) {
        let Some(applied) = self.restore_applied(version) else {
            return;
        };
        let Some(r) = self.restoring.pending.take() else {
            return;
        };
        let stage = r.stage;
        self.stage = stage;
        // The copy's own version when it holds every update; else one of
        // its own (these weights descend from no update of `applied`).
        let v = if version.0 == applied {
            version
        } else {
            (applied, mix(version.1, mix(u64::MAX - 1, stage as u64)))
        };
        self.iters.downloaded(v);
        self.iters.hear_next(applied + 1, false);
        self.coordinating.inherit(self.now, applied + 1);
        self.group.adopt([], self.id);
        let (ps, ns) = (self.prev_stage(), self.next_stage());
        self.peers
            .retain(|_, p| p.stage == ps || p.stage == ns || p.stage == stage);
        self.event(Event::StageRestored {
            stage,
            from,
            iteration: version.0,
            applied,
        });
        self.become_active();
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// A joiner that knows holders 1 and 2, and of stages 1 and 3 whose
    /// members say stage 2 is empty (iteration 7 in progress), timed out
    /// on its query: it asks the holders for their copies of stage 2.
    fn joiner_asking_holders() -> (Node, Vec<Action>) {
        joiner_asking_holders_with(false, &[])
    }

    /// As [`joiner_asking_holders`], rebuilding from the neighbours when no
    /// copy is offered (`rebuild`), knowing `more` peers too.
    fn joiner_asking_holders_with(rebuild: bool, more: &[(NodeId, Stage)]) -> (Node, Vec<Action>) {
        let mut cfg = (*config(Policy::Gwtf)).clone();
        cfg.restart_empty_stages = true;
        cfg.rebuild_from_neighbours = rebuild;
        let mut n = Node::new(Arc::new(cfg), 50, 0, 0.5, 4, 1);
        let mut peers = vec![(1, 0), (2, 0), (11, 1), (31, 3)];
        peers.extend_from_slice(more);
        n.handle(SEC, Input::Join { peers });
        for (from, stage) in [(11, 1), (31, 3)] {
            let summary = StageSummary {
                stage,
                members: 2,
                throughput: 4.0,
                open_iter: 7,
                empty_neighbors: vec![2],
            };
            deliver(&mut n, from, Msg::StageInfo { summary });
        }
        let acts = n.on_timeout(3 * SEC);
        (n, acts)
    }

    /// Holder `from` offers its copy of stage 2 of `iteration`.
    fn offer(n: &mut Node, from: NodeId, iteration: Option<u32>) -> Vec<Action> {
        deliver(
            n,
            from,
            Msg::KeptInfo {
                stage: 2,
                iteration,
                open_iter: 0,
            },
        )
    }

    /// The copy (`version`) sent by holder `coord`.
    fn copy(version: (u32, u64), coord: NodeId) -> Msg {
        Msg::StateResponse {
            version,
            members: Default::default(),
            bytes: 1,
            coord,
        }
    }

    fn restored_event(acts: &[Action]) -> Option<(Stage, NodeId, u32, u32)> {
        acts.iter().find_map(|a| match a {
            Action::Event(Event::StageRestored {
                stage,
                from,
                iteration,
                applied,
            }) => Some((*stage, *from, *iteration, *applied)),
            _ => None,
        })
    }

    fn restarted(acts: &[Action]) -> bool {
        acts.iter()
            .any(|a| matches!(a, Action::Event(Event::StageRestarted { .. })))
    }

    /// Both holders offer a copy: the freshest is downloaded, and the stage
    /// is served from it as of the iteration in progress.
    #[test]
    fn an_empty_stage_is_restored_from_the_freshest_copy_offered() {
        let (mut n, acts) = joiner_asking_holders();
        let mut asked: Vec<NodeId> = sends(&acts)
            .iter()
            .filter(|(_, m)| matches!(m, Msg::KeptQuery { stage: 2 }))
            .map(|(to, _)| *to)
            .collect();
        asked.sort_unstable();
        assert_eq!(asked, [1, 2]);
        assert!(!n.is_active() && !restarted(&acts));
        offer(&mut n, 1, Some(4));
        let acts = offer(&mut n, 2, Some(6));
        assert!(matches!(
            sends(&acts)[..],
            [(2, Msg::KeptRequest { stage: 2 })]
        ));
        assert_eq!(n.downloading_from(), Some(2));
        assert_eq!(n.stage(), 2);
        // The copy holds the update of 6, the last before iteration 7: the
        // weights are the stage's own, with their version.
        assert_eq!(n.restore_applied((6, 99)), Some(6));
        let response = copy((6, 99), 2);
        let acts = deliver(&mut n, 2, response);
        assert_eq!(restored_event(&acts), Some((2, 2, 6, 6)));
        assert!(n.is_active() && !restarted(&acts));
        assert_eq!(n.version(), (6, 99));
        assert_eq!(n.coordinator(), Some(50));
        assert_eq!(n.restore_applied((6, 99)), None);
    }

    /// An older copy stands for the iteration before the one in progress,
    /// under a version of its own (it misses updates the stage made).
    #[test]
    fn an_older_copy_stands_for_the_iteration_in_progress() {
        let (mut n, _) = joiner_asking_holders();
        offer(&mut n, 1, Some(4));
        offer(&mut n, 2, None);
        assert_eq!(n.downloading_from(), Some(1));
        assert_eq!(n.restore_applied((4, 99)), Some(6));
        let response = copy((4, 99), 1);
        // Not from the holder asked: ignored.
        let acts = deliver(&mut n, 2, response.clone());
        assert!(restored_event(&acts).is_none() && !n.is_active());
        let acts = deliver(&mut n, 1, response);
        assert_eq!(restored_event(&acts), Some((2, 1, 4, 6)));
        assert_eq!(n.version().0, 6);
        assert_ne!(n.version(), (6, 99));
    }

    /// The holder serving the copy dies: the next offer is downloaded; a
    /// holder whose copy is gone says so, and with no offer left the stage
    /// restarts from the initial weights.
    #[test]
    fn failed_offers_fall_back_to_the_next_then_to_a_restart() {
        let (mut n, _) = joiner_asking_holders();
        offer(&mut n, 1, Some(4));
        offer(&mut n, 2, Some(6));
        assert_eq!(n.downloading_from(), Some(2));
        let now = n.now;
        let acts = n.handle(now, Input::PeerLost { peer: 2 });
        assert!(matches!(
            sends(&acts)[..],
            [(1, Msg::KeptRequest { stage: 2 })]
        ));
        let acts = offer(&mut n, 1, None);
        assert!(restarted(&acts) && restored_event(&acts).is_none());
        assert!(n.is_active() && n.stage() == 2);
    }

    /// The relays next to the empty stage had not heard that iteration 9
    /// opened (the news goes through the stage); the holders say so, and
    /// the restored weights stand for iteration 8.
    #[test]
    fn the_holders_tell_the_iteration_in_progress() {
        let (mut n, _) = joiner_asking_holders();
        let late = Msg::KeptInfo {
            stage: 2,
            iteration: Some(4),
            open_iter: 9,
        };
        deliver(&mut n, 1, late);
        offer(&mut n, 2, None);
        assert_eq!(n.restore_applied((4, 99)), Some(8));
        let acts = deliver(&mut n, 1, copy((4, 99), 1));
        assert_eq!(restored_event(&acts), Some((2, 1, 4, 8)));
    }

    /// Holders that do not answer are not waited for beyond the suspicion
    /// time: with no offer, the stage restarts.
    #[test]
    fn silent_holders_are_not_waited_for() {
        let (mut n, _) = joiner_asking_holders();
        let t = n.now;
        let acts = n.on_timeout(t + n.cfg.tick);
        assert!(!restarted(&acts) && !n.is_active());
        let acts = n.on_timeout(t + n.suspicion() + 2 * n.cfg.tick);
        assert!(restarted(&acts) && n.is_active());
    }

    fn rebuilt_event(acts: &[Action]) -> Option<(Stage, Vec<NodeId>, Option<u32>)> {
        acts.iter().find_map(|a| match a {
            Action::Event(Event::StageRebuilt {
                stage,
                from,
                applied,
            }) => Some((*stage, from.clone(), *applied)),
            _ => None,
        })
    }

    /// No holder keeps a copy: the joiner asks a member of each
    /// neighbouring relay stage for its state, and once both came serves
    /// the stage rebuilt from them (CheckFree), as of the iteration in
    /// progress, under a version of its own.
    #[test]
    fn with_no_copy_the_stage_is_rebuilt_from_its_neighbours() {
        let (mut n, _) = joiner_asking_holders_with(true, &[]);
        offer(&mut n, 1, None);
        let acts = offer(&mut n, 2, None);
        let mut asked = sends(&acts);
        asked.sort_unstable_by_key(|(to, _)| *to);
        assert!(matches!(
            asked[..],
            [
                (11, &Msg::RebuildRequest { stage: 2 }),
                (31, &Msg::RebuildRequest { stage: 2 })
            ]
        ));
        assert!(!restarted(&acts) && !n.is_active() && n.stage() == 2);
        assert!(n.rebuild_awaits(11) && n.rebuild_awaits(31) && !n.rebuild_awaits(1));
        let acts = deliver(&mut n, 31, copy((6, 7), 31));
        assert!(rebuilt_event(&acts).is_none() && !n.is_active());
        assert!(!n.rebuild_awaits(31));
        let acts = deliver(&mut n, 11, copy((6, 5), 11));
        assert_eq!(rebuilt_event(&acts), Some((2, vec![11, 31], Some(6))));
        assert!(n.is_active() && !restarted(&acts));
        assert_eq!(n.version().0, 6);
        assert!(![(6, 5), (6, 7)].contains(&n.version()));
        assert_eq!(n.coordinator(), Some(50));
    }

    /// Two joiners that rebuilt the stage from the same neighbours'
    /// weights hold the same weights and share their version (their groups
    /// may merge as one); from other weights (a neighbour that applied an
    /// update between the two rebuilds), the versions differ, and the
    /// group behind gives way instead of following the other's list.
    #[test]
    fn a_rebuild_s_version_is_mixed_from_its_sources_versions() {
        let rebuilt = |first: ((u32, u64), NodeId), second: ((u32, u64), NodeId)| {
            let (mut n, _) = joiner_asking_holders_with(true, &[(32, 3)]);
            offer(&mut n, 1, None);
            offer(&mut n, 2, None);
            let now = n.now;
            n.handle(now, Input::PeerLost { peer: 31 });
            deliver(&mut n, first.1, copy(first.0, first.1));
            let acts = deliver(&mut n, second.1, copy(second.0, second.1));
            assert!(rebuilt_event(&acts).is_some());
            n.version()
        };
        let a = rebuilt(((6, 5), 11), ((6, 7), 32));
        // The same weights, arrived in the other order.
        assert_eq!(a, rebuilt(((6, 7), 32), ((6, 5), 11)));
        assert_ne!(a, rebuilt(((6, 5), 11), ((6, 8), 32)));
        assert_ne!(a, rebuilt(((6, 5), 11), ((5, 7), 32)));
        assert_eq!(a.0, 6);
    }

    /// A neighbour that dies is not waited for: the stage is rebuilt from
    /// the other, or from another member of its stage when one is known;
    /// with none answering in time, it restarts.
    #[test]
    fn a_rebuild_goes_on_without_neighbours_that_do_not_answer() {
        let (mut n, _) = joiner_asking_holders_with(true, &[]);
        offer(&mut n, 1, None);
        offer(&mut n, 2, None);
        deliver(&mut n, 11, copy((6, 5), 11));
        let now = n.now;
        let acts = n.handle(now, Input::PeerLost { peer: 31 });
        assert_eq!(rebuilt_event(&acts), Some((2, vec![11], Some(6))));
        assert!(n.is_active());

        let (mut n, _) = joiner_asking_holders_with(true, &[(32, 3)]);
        offer(&mut n, 1, None);
        offer(&mut n, 2, None);
        let now = n.now;
        let acts = n.handle(now, Input::PeerLost { peer: 31 });
        assert!(matches!(
            sends(&acts)[..],
            [(32, Msg::RebuildRequest { stage: 2 })]
        ));
        assert!(n.rebuild_awaits(32) && !n.is_active());
        deliver(&mut n, 32, copy((6, 7), 32));
        let acts = deliver(&mut n, 11, copy((6, 5), 11));
        assert_eq!(rebuilt_event(&acts), Some((2, vec![11, 32], Some(6))));

        let (mut n, _) = joiner_asking_holders_with(true, &[]);
        offer(&mut n, 1, None);
        offer(&mut n, 2, None);
        let t = n.now;
        let acts = n.on_timeout(t + n.cfg.tick);
        assert!(!restarted(&acts) && !n.is_active());
        let acts = n.on_timeout(t + n.cfg.e2e_timeout + 2 * n.cfg.tick);
        assert!(restarted(&acts) && rebuilt_event(&acts).is_none() && n.is_active());
    }

    /// Off (a trainer that cannot average): no neighbour is asked, the
    /// stage restarts.
    #[test]
    fn without_rebuilding_no_neighbour_is_asked() {
        let (mut n, _) = joiner_asking_holders_with(false, &[]);
        offer(&mut n, 1, None);
        let acts = offer(&mut n, 2, None);
        assert!(restarted(&acts) && n.is_active());
        assert!(!sends(&acts)
            .iter()
            .any(|(_, m)| matches!(m, Msg::RebuildRequest { .. })));
    }

    /// A holder answers from the copies its runtime keeps.
    #[test]
    fn a_holder_tells_the_copies_it_keeps() {
        let mut h = started(Policy::Gwtf, 1, 0, &[2], &[(11, 1)]);
        h.copy_kept(2, 9);
        let acts = deliver(&mut h, 50, Msg::KeptQuery { stage: 2 });
        assert!(matches!(
            sends(&acts)[..],
            [(
                50,
                Msg::KeptInfo {
                    stage: 2,
                    iteration: Some(9),
                    ..
                }
            )]
        ));
        let acts = deliver(&mut h, 50, Msg::KeptQuery { stage: 3 });
        assert!(matches!(
            sends(&acts)[..],
            [(
                50,
                Msg::KeptInfo {
                    stage: 3,
                    iteration: None,
                    ..
                }
            )]
        ));
    }

    fn kept_event(acts: &[Action]) -> Option<(Stage, u32)> {
        acts.iter().find_map(|a| match a {
            Action::Event(Event::StateKept { stage, applied }) => Some((*stage, *applied)),
            _ => None,
        })
    }

    /// A node that fenced itself (paused) kept its weights of stage 2 (the
    /// update of iteration 5) and finds the stage empty: the holders' copies
    /// are older, so it serves its kept weights again, with their own
    /// version, as of the iteration in progress; a fresher copy offered is
    /// downloaded instead; kept weights of another stage change nothing.
    #[test]
    fn a_fenced_node_serves_its_kept_weights_of_an_emptied_stage() {
        let (mut n, _) = joiner_asking_holders();
        n.joining.fenced(Some((2, 6, (5, 77))), None);
        offer(&mut n, 1, Some(4));
        let acts = offer(&mut n, 2, None);
        assert_eq!(kept_event(&acts), Some((2, 5)));
        assert!(n.is_active() && !restarted(&acts));
        assert!(!sends(&acts)
            .iter()
            .any(|(_, m)| matches!(m, Msg::KeptRequest { .. })));
        assert_eq!(
            (n.stage(), n.version(), n.coordinator()),
            (2, (5, 77), Some(50))
        );
        assert_eq!(n.iters.next_hint(), 7);
        assert_eq!(n.kept_version(), None);

        let (mut n, _) = joiner_asking_holders();
        n.joining.fenced(Some((2, 6, (5, 77))), None);
        offer(&mut n, 1, Some(6));
        let acts = offer(&mut n, 2, Some(4));
        assert!(kept_event(&acts).is_none());
        assert_eq!(n.downloading_from(), Some(1));

        let (mut n, _) = joiner_asking_holders();
        n.joining.fenced(Some((1, 6, (5, 77))), None);
        offer(&mut n, 1, None);
        let acts = offer(&mut n, 2, None);
        assert!(kept_event(&acts).is_none() && restarted(&acts));
    }
}
