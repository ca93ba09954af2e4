//! The data holder's side of the microbatch lifecycle: iterations opened,
//! microbatches launched (at most `max_in_flight` at once) and restarted.
use super::*;

/// Holder's iteration state.
#[derive(Clone, Debug, Default)]
pub(super) struct HolderState {
    iter: Option<u32>,
    next_idx: u32,
    done: BTreeSet<u32>,
    in_flight: BTreeMap<MbId, Option<Label>>,
    restarts: VecDeque<MbId>,
    reported: bool,
    /// Microbatches an aggregate asked to restart while their attempt in
    /// flight was already in its backward: that attempt may have passed
    /// the stage that lost it, so once it is done that stage is re-run
    /// (see [`Node::redo_a_stage`]; the coordinator that asked, when
    /// known) or the microbatch restarted.
    recheck: BTreeMap<MbId, Option<NodeId>>,
    /// The node asked to re-run a stage of each microbatch (see
    /// [`Node::redo_a_stage`]): its own restart request for it (it holds
    /// no activation any more) restarts the microbatch instead.
    redo_asked: BTreeMap<MbId, NodeId>,
}

impl HolderState {
    /// The iteration whose microbatches this holder has all done and said
    /// so (`HolderDone`), if the one it works on.
    pub(super) fn reported_iter(&self) -> Option<u32> {
        self.iter.filter(|_| self.reported)
    }

    /// Microbatch `mb`'s backward is done at this holder: the label of the
    /// flow it went out on (`None` if it was not in flight), whether it is
    /// the first attempt of its index to be done, and the recheck an
    /// aggregate asked for it while it was in its backward (`Some(asker)`).
    pub(super) fn finish(
        &mut self,
        mb: MbId,
    ) -> (Option<Option<Label>>, bool, Option<Option<NodeId>>) {
        let label = self.in_flight.remove(&mb);
        let first = label.is_some() && self.done.insert(mb.idx);
        (label, first, self.recheck.remove(&mb))
    }
}

impl Node {
    pub(super) fn on_start_iter(&mut self, iter: u32, holders: Arc<Vec<NodeId>>) {
        if self.stage != 0 || self.phase != Phase::Active {
            return;
        }
        self.iters.announced(iter, &holders);
        if self.dh.iter.is_some_and(|k| k >= iter) {
            // The barrier announces the iteration again to holders it has
            // not heard are done: our HolderDone went to a node that did not
            // coordinate yet (it had not heard the old coordinator leave).
            if self.dh.iter == Some(iter) && self.dh.reported {
                if let Some(c) = self.group.coord() {
                    self.send(c, Msg::HolderDone { iter });
                }
            }
            return;
        }
        self.forget_before(iter);
        if !holders.contains(&self.id) {
            // Joined during the iteration: takes part from the next one.
            return;
        }
        self.dh = HolderState {
            iter: Some(iter),
            ..Default::default()
        };
        self.event(Event::IterStarted { iter });
        self.launch();
    }

    /// Drops snapshots and state of iterations before `iter` (they are final).
    pub(super) fn forget_before(&mut self, iter: u32) {
        if !self.iters.finalize_before(iter) {
            return;
        }
        self.lifecycle.snaps.retain(|m, _| m.iter >= iter);
        self.acks.forget_before(iter);
        self.reservations.forget_ghosts();
        self.iters.forget_ends_before(iter);
        let keep = iter.saturating_sub(1);
        self.coordinating.forget_before(keep);
        self.admit_waiting();
    }

    pub(super) fn launch(&mut self) {
        if self.stage != 0 || self.phase != Phase::Active {
            return;
        }
        let Some(k) = self.dh.iter else { return };
        if self.cfg.iterations.is_some_and(|n| k >= n) {
            return;
        }
        loop {
            // GWTF: microbatches ride on reserved flows when there are
            // enough; the others (flows being rebuilt after a crash) are
            // routed hop by hop by the gossiped costs.
            let limit = self
                .policy()
                .in_flight_limit(self.cfg.max_in_flight as usize, &self.plan);
            if self.dh.in_flight.len() >= limit {
                break;
            }
            let mb = if let Some(mb) = self.dh.restarts.pop_front() {
                mb
            } else if self.dh.next_idx < self.cfg.mb_per_iter {
                let mb = MbId {
                    holder: self.id,
                    iter: k,
                    idx: self.dh.next_idx,
                };
                self.dh.next_idx += 1;
                mb
            } else {
                break;
            };
            // A free reserved flow (GWTF), or a planned path (central-mcmf).
            let label = if self.policy().reserves_flows() {
                let busy: BTreeSet<Label> = self.dh.in_flight.values().flatten().copied().collect();
                self.reservations
                    .flows()
                    .keys()
                    .copied()
                    .find(|l| !busy.contains(l))
            } else {
                None
            };
            if let Some(l) = label {
                if self.better_wait(l) {
                    // Put the microbatch back: a busy flow finishes it sooner.
                    if mb.idx + 1 == self.dh.next_idx && !self.dh.restarts.contains(&mb) {
                        self.dh.next_idx -= 1;
                    } else {
                        self.dh.restarts.push_front(mb);
                    }
                    break;
                }
            }
            let plan = self
                .policy()
                .planned_path(&self.plan, self.dh.in_flight.len());
            self.dh.in_flight.insert(mb, label);
            let attempt = self.lifecycle.snaps.get(&mb).map_or(0, |s| s.attempt() + 1);
            let t = self.run(TaskKind::Embed, Some(mb), attempt);
            let snap = Snap::new(attempt, Arc::new(vec![self.id]), self.id, Some(t), self.now);
            self.lifecycle.snaps.insert(mb, snap.on_route(label, plan));
        }
    }

    /// Holder (GWTF): whether the remaining microbatches of the iteration
    /// finish sooner without using the free flow `free` now. The flows of a
    /// holder have unequal costs (a flow rebuilt after a crash, a distant
    /// relay), and the iteration waits for the holder's last microbatch:
    /// list scheduling by earliest expected completion (each flow free at
    /// its current microbatch's start + its observed round trip) assigns
    /// the remaining microbatches one by one to the flow that would finish
    /// each first; when the free flow gets none, the holder waits for a
    /// faster one. Only the holder's own observations are used; with any
    /// round trip unknown it does not wait.
    pub(super) fn better_wait(&self, free: Label) -> bool {
        let Some(r_free) = self.reservations.round_trip(&free) else {
            return false;
        };
        let now = to_secs(self.now);
        // (time the flow is free, its round trip) of the busy flows.
        let mut flows: Vec<(f64, f64)> = Vec::new();
        for (m, l) in &self.dh.in_flight {
            let Some(l) = l else { continue };
            let (Some(r), Some(s)) = (self.reservations.round_trip(l), self.lifecycle.snaps.get(m))
            else {
                return false;
            };
            flows.push(((to_secs(s.started()) + r).max(now), r));
        }
        if flows.is_empty() {
            return false;
        }
        // The microbatch at hand and those not started yet.
        let remaining = 1
            + self.dh.restarts.len()
            + self.cfg.mb_per_iter.saturating_sub(self.dh.next_idx) as usize;
        flows.push((now, r_free));
        let free_at = flows.len() - 1;
        for _ in 0..remaining {
            let (i, _) = flows
                .iter()
                .enumerate()
                .map(|(i, f)| (i, f.0 + f.1))
                .min_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
                .unwrap();
            if i == free_at {
                return false;
            }
            flows[i].0 += flows[i].1;
        }
        true
    }

    pub(super) fn restart(&mut self, mb: MbId, failed: Option<u32>) {
        if self.stage != 0 || mb.holder != self.id || self.dh.iter != Some(mb.iter) {
            return;
        }
        if self.dh.restarts.contains(&mb) {
            return;
        }
        if self.dh.in_flight.contains_key(&mb) {
            let s = self.lifecycle.snaps.get(&mb);
            let stale = match failed {
                // The data path reports a failed attempt: only that one.
                Some(a) => s.is_some_and(|s| s.attempt() != a),
                // An aggregate lost it: an attempt started recently is
                // already recomputing it, unless its backward has begun
                // (it may be past that stage: checked when it is done).
                None => s.is_some_and(|s| s.started() + self.cfg.redo_timeout > self.now),
            };
            if stale {
                if failed.is_none()
                    && self
                        .lifecycle
                        .snaps
                        .get(&mb)
                        .is_some_and(|s| s.grad_ready())
                {
                    self.dh.recheck.entry(mb).or_insert(None);
                }
                return;
            }
            self.dh.in_flight.remove(&mb);
        } else if let (Some(a), Some(s)) = (failed, self.lifecycle.snaps.get(&mb)) {
            if s.attempt() != a || s.done() {
                return;
            }
        }
        for back in [false, true] {
            self.clear_deadline((mb, back));
        }
        self.event(Event::Restarted { mb });
        self.dh.restarts.push_back(mb);
        self.launch();
    }

    pub(super) fn holder_progress(&mut self) {
        if self.dh.reported {
            return;
        }
        let Some(k) = self.dh.iter else { return };
        if self.dh.done.len() as u32 >= self.cfg.mb_per_iter {
            self.dh.reported = true;
            if let Some(c) = self.group.coord() {
                self.send(c, Msg::HolderDone { iter: k });
            }
        }
    }

    /// A microbatch of ours must start again (its path or its aggregate lost it).
    pub(super) fn on_restart_request(&mut self, from: NodeId, mb: MbId, attempt: Option<u32>) {
        if attempt.is_none() && self.redo_a_stage(from, mb) {
            return;
        }
        self.restart(mb, attempt);
        if attempt.is_none() {
            if let Some(asker) = self.dh.recheck.get_mut(&mb) {
                *asker = Some(from);
            }
        }
        // An aggregate lost its contribution: tell that stage's
        // coordinator we are alive and on it (queued restarts wait
        // for a free in-flight slot, which can take long).
        if attempt.is_none()
            && from != self.id
            && self.stage == 0
            && mb.holder == self.id
            && self.dh.iter == Some(mb.iter)
            && (self.dh.restarts.contains(&mb) || self.dh.in_flight.contains_key(&mb))
        {
            self.send(from, Msg::Restarting { mb });
        }
    }

    /// The coordinator of a relay stage (`from`) lost that stage's
    /// contribution to `mb`, which is done here: its loss is counted and
    /// the holders may have applied its iteration, so restarting it would
    /// recompute it on other weights and report its loss twice. This holder
    /// knows the whole path: the node before that stage re-runs it from its
    /// stored activation on a replacement (`Redo`), and the node after
    /// re-sends its stored gradient, as when the coordinator knows the
    /// hops. False (the caller restarts it) when `mb` is not done here, the
    /// asker's stage is not known, or the node before is gone.
    pub(super) fn redo_a_stage(&mut self, from: NodeId, mb: MbId) -> bool {
        if self.stage != 0 || mb.holder != self.id {
            return false;
        }
        if !self.policy().reruns_crashed_stage() || self.dh.redo_asked.get(&mb) == Some(&from) {
            // The node asked holds no activation of it any more.
            return false;
        }
        let Some(st) = self.peers.get(&from).map(|p| p.stage as usize) else {
            return false;
        };
        let Some(s) = self.lifecycle.snaps.get(&mb).filter(|s| s.done()) else {
            return false;
        };
        let (path, last) = (s.path().clone(), self.s() as usize);
        if st == 0 || st > last || path.len() != last + 1 {
            return false;
        }
        let (prev, dead) = (path[st - 1], path[st]);
        let next = if st == last { self.id } else { path[st + 1] };
        if prev == self.id {
            self.redo(mb, dead, next);
        } else if self.alive(prev) {
            self.dh.redo_asked.insert(mb, prev);
            self.send(prev, Msg::Redo { mb, dead, next });
        } else {
            return false;
        }
        true
    }

    /// The holder's periodic work: the last resort (every policy), a
    /// microbatch with no news for `e2e_timeout` is started again from
    /// here; then launches what the in-flight bound allows.
    pub(super) fn holder_tick(&mut self) {
        let e2e = self.cfg.e2e_timeout;
        let now = self.now;
        let late: Vec<(MbId, u32)> = self
            .dh
            .in_flight
            .keys()
            .filter_map(|mb| self.lifecycle.snaps.get(mb).map(|s| (*mb, s)))
            .filter(|(_, s)| s.started() + e2e <= now)
            .map(|(mb, s)| (mb, s.attempt()))
            .collect();
        for (mb, attempt) in late {
            self.restart(mb, Some(attempt));
        }
        self.launch();
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// The embed tasks among `acts`.
    fn embeds(acts: &[Action]) -> usize {
        runs(acts)
            .iter()
            .filter(|t| t.kind == TaskKind::Embed)
            .count()
    }

    /// A holder keeps `max_in_flight` microbatches in flight, or one per
    /// planned path when fewer paths are planned (central-mcmf routing).
    #[test]
    fn a_holder_launches_up_to_its_in_flight_bound() {
        let start_iter = Msg::StartIter {
            iter: 0,
            holders: Arc::new(vec![0]),
        };
        let mut n = started(Policy::Gwtf, 0, 0, &[], &[(10, 1)]);
        assert_eq!(embeds(&deliver(&mut n, 0, start_iter.clone())), 4);
        assert_eq!(n.dh.in_flight.len(), 4);
        let mut n = started(Policy::CentralMcmf, 0, 0, &[], &[(10, 1)]);
        let path = Arc::new(vec![0, 10, 11, 12, 13]);
        n.handle(
            SEC,
            Input::SetPlan {
                paths: vec![path.clone(), path],
            },
        );
        assert_eq!(embeds(&deliver(&mut n, 0, start_iter)), 2);
    }

    /// A swarm told to train `iterations` starts no microbatch after the
    /// last one: the next iteration opens (the other holders learn from it
    /// that the last is final) but nothing is computed for it.
    #[test]
    fn a_holder_starts_nothing_after_the_last_iteration() {
        let start = |iter| Msg::StartIter {
            iter,
            holders: Arc::new(vec![0]),
        };
        let mut cfg = (*config(Policy::Gwtf)).clone();
        cfg.iterations = Some(2);
        let mut n = Node::new(Arc::new(cfg), 0, 0, 0.5, 4, 1);
        n.handle(
            SEC,
            Input::Start {
                peers: vec![(10, 1)],
            },
        );
        assert_eq!(embeds(&deliver(&mut n, 0, start(1))), 4);
        n.dh.in_flight.clear();
        assert_eq!(embeds(&deliver(&mut n, 0, start(2))), 0);
        assert!(n.dh.in_flight.is_empty());
    }

    /// Holder 0 (peers: `peers`) in iteration 0, its microbatch (0, 0, 0)
    /// embedded and its forward back from the last stage along 0, 10, 20,
    /// 30, 40: the node, the microbatch, its path and the loss task (not
    /// done yet).
    fn at_the_loss(
        policy: Policy,
        peers: &[(NodeId, Stage)],
    ) -> (Node, MbId, Arc<Vec<NodeId>>, TaskId) {
        let mut n = started(policy, 0, 0, &[], peers);
        let start = Msg::StartIter {
            iter: 0,
            holders: Arc::new(vec![0]),
        };
        let acts = deliver(&mut n, 0, start);
        let m = mb(0, 0, 0);
        let embed = runs(&acts).iter().find(|t| t.mb == Some(m)).unwrap().id;
        n.handle(2 * SEC, Input::TaskDone { id: embed });
        let path = Arc::new(vec![0, 10, 20, 30, 40]);
        let fwd = Msg::Forward {
            mb: m,
            attempt: 0,
            path: path.clone(),
            label: None,
            hint: None,
            need_grad: true,
            plan: None,
        };
        let loss = runs(&deliver(&mut n, 40, fwd))[0].id;
        (n, m, path, loss)
    }

    /// A stage's coordinator lost a contribution of a microbatch whose
    /// attempt is in flight: before its backward began, that attempt will
    /// contribute it (nothing restarted); once its backward began, it may
    /// be past that stage, so the microbatch is restarted when the attempt
    /// is done (it used to wait for the coordinator to ask again, a
    /// `redo_timeout` later).
    #[test]
    fn a_restart_asked_during_the_backward_follows_the_attempt() {
        for in_backward in [false, true] {
            let peers = [(10, 1), (20, 2), (40, 4)];
            let (mut n, m, path, loss) = at_the_loss(Policy::SwarmPlus, &peers);
            let restart = Msg::Restart {
                mb: m,
                attempt: None,
            };
            if in_backward {
                n.handle(3 * SEC, Input::TaskDone { id: loss });
            }
            let acts = deliver(&mut n, 20, restart);
            assert!(sends(&acts)
                .iter()
                .any(|(to, m)| *to == 20 && matches!(m, Msg::Restarting { .. })));
            assert!(runs(&acts).is_empty(), "the attempt in flight goes on");
            if !in_backward {
                n.handle(3 * SEC, Input::TaskDone { id: loss });
            }
            let back = Msg::Backward {
                mb: m,
                attempt: 0,
                path,
            };
            let bwd = runs(&deliver(&mut n, 10, back))[0].id;
            let acts = n.handle(4 * SEC, Input::TaskDone { id: bwd });
            let again = runs(&acts)
                .iter()
                .any(|t| t.kind == TaskKind::Embed && t.mb == Some(m));
            assert_eq!(again, in_backward, "restarted when done: {in_backward}");
        }
    }

    /// A relay stage's coordinator lost its contribution to a microbatch
    /// that is done at its holder (the holders may have applied its
    /// iteration): the holder, which knows the path, has the node before
    /// that stage re-run it (`Redo`, the node after re-sending its stored
    /// gradient) instead of restarting it on other weights and reporting
    /// its loss twice. The node asked that holds no activation any more
    /// asks for a restart: then the microbatch is restarted.
    #[test]
    fn a_stage_that_lost_a_done_microbatch_is_rerun_from_the_node_before() {
        let peers = [(10, 1), (11, 1), (20, 2), (30, 3), (40, 4), (41, 4)];
        let done_holder = || {
            let (mut n, m, path, loss) = at_the_loss(Policy::Gwtf, &peers);
            n.handle(3 * SEC, Input::TaskDone { id: loss });
            let back = Msg::Backward {
                mb: m,
                attempt: 0,
                path,
            };
            let bwd = runs(&deliver(&mut n, 10, back))[0].id;
            n.handle(4 * SEC, Input::TaskDone { id: bwd });
            assert!(n.lifecycle.snaps[&m].done());
            (n, m)
        };
        let restart = |m| Msg::Restart {
            mb: m,
            attempt: None,
        };
        let redos = |a: &[Action]| -> Vec<(NodeId, NodeId, NodeId)> {
            (sends(a).into_iter())
                .filter_map(|(to, m)| match m {
                    Msg::Redo { dead, next, .. } => Some((to, *dead, *next)),
                    _ => None,
                })
                .collect()
        };
        // Restarted (launched when the in-flight bound allows).
        let embeds = |a: &[Action]| {
            (a.iter())
                .filter(|x| matches!(x, Action::Event(Event::Restarted { .. })))
                .count()
        };

        // Stage 3's coordinator (30): node 20 re-runs stage 3 (not 30) and
        // the result goes to 40, which holds the gradient.
        let (mut n, m) = done_holder();
        let a = deliver(&mut n, 30, restart(m));
        assert_eq!(redos(&a), vec![(20, 30, 40)]);
        assert_eq!(embeds(&a), 0, "not restarted");
        // Node 20 holds no activation any more: it asks for a restart.
        let a = deliver(&mut n, 20, restart(m));
        assert_eq!(redos(&a), vec![]);
        assert_eq!(embeds(&a), 1, "restarted");

        // The last stage's: its result comes back to the holder.
        let (mut n, m) = done_holder();
        let a = deliver(&mut n, 41, restart(m));
        assert_eq!(redos(&a), vec![(30, 40, 0)]);
        // Stage 1's: the holder re-sends its own output to another node of
        // stage 1, on to 20.
        let (mut n, m) = done_holder();
        let a = deliver(&mut n, 11, restart(m));
        let fwd: Vec<(NodeId, Option<NodeId>, bool)> = (sends(&a).into_iter())
            .filter_map(|(to, m)| match m {
                Msg::Forward {
                    hint, need_grad, ..
                } => Some((to, *hint, *need_grad)),
                _ => None,
            })
            .collect();
        assert_eq!(fwd, vec![(11, Some(20), false)]);
        assert_eq!(embeds(&a), 0);
        // An asker of no known stage: restarted, as before.
        let (mut n, m) = done_holder();
        let a = deliver(&mut n, 99, restart(m));
        assert_eq!((redos(&a).len(), embeds(&a)), (0, 1));
    }
}
