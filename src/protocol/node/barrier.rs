//! The iteration barrier, run by the holders' coordinator: an iteration
//! ends when every holder is done, and is final when every stage applied it.
use super::*;

/// Holders' coordinator: the iteration barrier.
#[derive(Clone, Debug, Default)]
pub(super) struct Barrier {
    iter: u32,
    participants: Arc<Vec<NodeId>>,
    done: BTreeSet<NodeId>,
    ended: Option<Arc<Vec<NodeId>>>,
    ended_at: Time,
    stage_done: BTreeSet<Stage>,
    last_bcast: Time,
    stall_reported: BTreeMap<Stage, Time>,
}

impl Node {
    pub(super) fn barrier_tick(&mut self) {
        if self.group.coord() != Some(self.id) || self.stage != 0 {
            return;
        }
        if self.barrier.is_none() {
            if self.now < self.cfg.start_delay || self.iters.seen_iter().is_some() {
                return;
            }
            // Open the first iteration (or, after every holder was gone, the
            // one the relays say comes next) only once the iteration is
            // known: from our own history (an applied aggregate) or from a
            // relay (its introduction says which iteration comes next; at a
            // fresh start that is 0). A coordinator that knows nothing (every
            // holder was gone and no relay answered yet, or the stages next
            // to us are empty) waits: opening iteration 0 there would re-run
            // iterations that are over.
            if !self.iters.iter_heard() && self.iters.last_applied().is_none() {
                return;
            }
            let first = self.iters.next_hint();
            let holders = self.live_members();
            self.barrier = Some(Barrier {
                iter: first,
                participants: holders.clone(),
                ..Default::default()
            });
            for h in holders.iter().copied() {
                self.send(
                    h,
                    Msg::StartIter {
                        iter: first,
                        holders: holders.clone(),
                    },
                );
            }
            return;
        }
        self.barrier_check();
        let period = self.cfg.heartbeat_ticks as Time * self.cfg.tick * 2;
        let b = self.barrier.as_ref().unwrap().clone();
        if let Some(ended) = &b.ended {
            if b.last_bcast + period <= self.now {
                self.barrier.as_mut().unwrap().last_bcast = self.now;
                self.bcast_end(b.iter, ended.clone());
            }
            if b.ended_at + self.cfg.stall_report <= self.now {
                for s in 0..=self.s() {
                    if !b.stage_done.contains(&s) {
                        let last = b.stall_reported.get(&s).copied();
                        if last.is_none_or(|t| t + self.cfg.stall_report <= self.now) {
                            self.barrier
                                .as_mut()
                                .unwrap()
                                .stall_reported
                                .insert(s, self.now);
                            self.event(Event::Stalled {
                                iter: b.iter,
                                stage: s,
                            });
                        }
                    }
                }
            }
        } else if b.last_bcast + period <= self.now {
            // Re-announce the iteration to holders that may have missed it.
            self.barrier.as_mut().unwrap().last_bcast = self.now;
            // To every member: those who joined meanwhile learn the iteration.
            for h in self.group.members().clone() {
                if self.alive(h) && !b.done.contains(&h) {
                    self.send(
                        h,
                        Msg::StartIter {
                            iter: b.iter,
                            holders: b.participants.clone(),
                        },
                    );
                }
            }
        }
    }

    pub(super) fn bcast_end(&mut self, iter: u32, holders: Arc<Vec<NodeId>>) {
        let me = self.id;
        for m in self.group.members().clone() {
            self.send(
                m,
                Msg::EndIter {
                    iter,
                    origin: me,
                    holders: holders.clone(),
                },
            );
        }
    }

    pub(super) fn barrier_check(&mut self) {
        if self.group.coord() != Some(self.id) || self.stage != 0 {
            return;
        }
        let Some(b) = self.barrier.clone() else {
            return;
        };
        if b.ended.is_none() {
            let waiting = b
                .participants
                .iter()
                .any(|h| self.alive(*h) && self.group.members().contains(h) && !b.done.contains(h));
            if waiting {
                return;
            }
            let holders: Arc<Vec<NodeId>> = Arc::new(
                b.participants
                    .iter()
                    .copied()
                    .filter(|h| b.done.contains(h) && self.alive(*h))
                    .collect(),
            );
            let bm = self.barrier.as_mut().unwrap();
            bm.ended = Some(holders.clone());
            bm.ended_at = self.now;
            bm.last_bcast = self.now;
            self.bcast_end(b.iter, holders);
            return;
        }
        if (0..=self.s()).all(|s| b.stage_done.contains(&s)) {
            let ended = b.ended.clone().unwrap();
            let next = b.iter + 1;
            let holders = self.live_members();
            self.event(Event::IterFinalized {
                iter: b.iter,
                holders: ended,
                next: holders.clone(),
            });
            self.barrier = Some(Barrier {
                iter: next,
                participants: holders.clone(),
                last_bcast: self.now,
                ..Default::default()
            });
            for h in holders.iter().copied() {
                self.send(
                    h,
                    Msg::StartIter {
                        iter: next,
                        holders: holders.clone(),
                    },
                );
            }
        }
    }

    /// A holder finished its microbatches of `iter`: the last one ends the
    /// iteration at once (not at the next tick).
    pub(super) fn on_holder_done(&mut self, from: NodeId, iter: u32) {
        if let Some(b) = self.barrier.as_mut() {
            if b.iter == iter {
                b.done.insert(from);
            }
        }
        self.barrier_check();
    }

    /// An iteration opened (the holders' `StartIter`): its participants are
    /// passed along the pipeline once, as its end is, so that each stage's
    /// coordinator knows what its stage must aggregate and commits as soon
    /// as its own work is done instead of at the end of the iteration.
    pub(super) fn on_iteration_opened(&mut self, iter: u32, holders: &Arc<Vec<NodeId>>) {
        if self.phase != Phase::Active || !self.iters.opened(iter, holders) {
            return;
        }
        let mut targets: Vec<NodeId> = Vec::new();
        if self.stage < self.s() {
            targets = self.live_peers_of(self.stage + 1, 3);
        }
        // The holders' coordinator is where the news comes from.
        if let Some(c) = self
            .group
            .coord()
            .filter(|&c| c != self.id && self.stage != 0)
        {
            targets.push(c);
        }
        for t in targets {
            self.send(
                t,
                Msg::StartIter {
                    iter,
                    holders: holders.clone(),
                },
            );
        }
        self.coord_check(iter);
    }

    /// Up to `n` live peers of `stage` (in id order): where the opening and
    /// the end of an iteration are passed on.
    pub(super) fn live_peers_of(&self, stage: Stage, n: usize) -> Vec<NodeId> {
        self.peers
            .iter()
            .filter(|(_, p)| p.stage == stage && !p.dead)
            .map(|(id, _)| *id)
            .take(n)
            .collect()
    }

    /// A stage applied `iter`.
    pub(super) fn on_stage_done(&mut self, iter: u32, stage: Stage) {
        if let Some(b) = self.barrier.as_mut() {
            if b.iter == iter {
                b.stage_done.insert(stage);
            }
        }
        self.barrier_check();
    }

    /// A new coordinator of the holders reopens the barrier from its own
    /// knowledge (the latest iteration announced, and whether it is done).
    pub(super) fn reopen_barrier(&mut self) {
        if self.stage == 0 && self.barrier.is_none() {
            if let Some((k, participants)) = self.iters.seen_iter().cloned() {
                self.barrier = Some(Barrier {
                    iter: k,
                    participants,
                    ..Default::default()
                });
                if self.dh.reported_iter() == Some(k) {
                    self.barrier.as_mut().unwrap().done.insert(self.id);
                }
                self.barrier_check();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// The holders' barrier counts a holder done once, for the iteration it
    /// runs only.
    #[test]
    fn the_barrier_counts_the_holders_done() {
        let mut n = started(Policy::Gwtf, 0, 0, &[1, 2], &[]);
        n.barrier = Some(Barrier {
            iter: 3,
            participants: Arc::new(vec![0, 1, 2]),
            ..Default::default()
        });
        deliver(&mut n, 1, Msg::HolderDone { iter: 2 });
        deliver(&mut n, 1, Msg::HolderDone { iter: 3 });
        deliver(&mut n, 1, Msg::HolderDone { iter: 3 });
        let b = n.barrier.as_ref().unwrap();
        assert_eq!(b.done.iter().copied().collect::<Vec<_>>(), [1]);
    }

    /// The last holder's `HolderDone` ends the iteration on arrival: the
    /// end goes out with it, not at the next tick.
    #[test]
    fn the_last_holder_done_ends_the_iteration_at_once() {
        let mut n = started(Policy::Gwtf, 0, 0, &[1, 2], &[]);
        n.barrier = Some(Barrier {
            iter: 3,
            participants: Arc::new(vec![0, 1, 2]),
            done: [0, 1].into_iter().collect(),
            ..Default::default()
        });
        let ends = |acts: &[Action]| {
            sends(acts)
                .iter()
                .filter(|(_, m)| matches!(m, Msg::EndIter { iter: 3, .. }))
                .count()
        };
        assert_eq!(ends(&deliver(&mut n, 1, Msg::HolderDone { iter: 3 })), 0);
        assert_eq!(ends(&deliver(&mut n, 2, Msg::HolderDone { iter: 3 })), 2);
        assert!(n.barrier.as_ref().unwrap().ended.is_some());
    }
}
