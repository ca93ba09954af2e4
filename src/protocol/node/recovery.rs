//! Crash recovery of a microbatch (docs/SPEC.md section 5): a forward hop
//! rerouted around a dead node; a backward hop through a dead node re-run on
//! a replacement of only that stage (GWTF, central-mcmf, SWARM) or restarted from
//! the holder (SWARM-plus).
use super::*;

impl Node {
    /// A forward hop got no ack: re-send the stored output to another node
    /// of the same stage (both policies).
    pub(super) fn forward_failed(&mut self, mb: MbId, dead: NodeId) {
        if self.stage == self.s() {
            // The sink (holder) is gone: the microbatch is dropped with it.
            self.lifecycle.snaps.remove(&mb);
            self.admit_waiting();
            return;
        }
        if self.policy().reserves_flows() {
            // Its reservations through the dead node are gone.
            let through: Vec<Label> = self
                .reservations
                .flows()
                .iter()
                .filter(|(_, f)| f.next() == dead)
                .map(|(l, _)| *l)
                .collect();
            for l in through {
                self.drop_flow(l, true, false);
            }
        }
        let st = self.next_stage();
        self.event(Event::Rerouted { mb, stage: st });
        let (hint, plan, redo) = {
            let s = &self.lifecycle.snaps[&mb];
            (
                s.hint().filter(|h| *h != dead),
                s.plan().clone(),
                s.grad_in(),
            )
        };
        if redo {
            // This node already has its gradient: it was re-running the
            // next stage for the aggregate (see `redo`).
            if let Some(h) = hint {
                self.redo(mb, dead, h);
            }
            return;
        }
        self.forward_out(mb, None, hint, plan, &[dead]);
    }

    /// A backward hop (to `dead`, our predecessor) got no ack.
    pub(super) fn backward_failed(&mut self, mb: MbId, dead: NodeId) {
        // Index of this node in the path (a holder sends the first gradient,
        // after stage S).
        let my = if self.stage == 0 {
            self.s() as usize + 1
        } else {
            self.stage as usize
        };
        if my == 1 || dead == mb.holder {
            // The holder is gone: its microbatch is dropped.
            return;
        }
        if !self.policy().reruns_crashed_stage() {
            // SWARM-plus restarts the whole microbatch from its data holder.
            let attempt = Some(self.lifecycle.snaps[&mb].attempt());
            self.send(mb.holder, Msg::Restart { mb, attempt });
            return;
        }
        let path = self.lifecycle.snaps[&mb].path().clone();
        // The node before the dead one re-runs the dead node's stage
        // on a replacement.
        if my >= 2 && path.len() > my - 2 {
            let before = path[my - 2];
            if self.alive(before) || before == mb.holder {
                let attempt = self.lifecycle.snaps[&mb].attempt();
                self.send(
                    before,
                    Msg::CrashNotice {
                        mb,
                        attempt,
                        dead,
                        after: self.id,
                    },
                );
                return;
            }
        }
        let attempt = Some(self.lifecycle.snaps[&mb].attempt());
        self.send(mb.holder, Msg::Restart { mb, attempt });
    }

    /// GWTF recovery: re-send this node's stored output for `mb` to a
    /// replacement of `dead`, asking it to pass on to `after`.
    pub(super) fn recover(&mut self, mb: MbId, dead: NodeId, after: Option<NodeId>) {
        let Some(s) = self.lifecycle.snaps.get_mut(&mb) else {
            return;
        };
        if !s.fwd_done() || s.grad_in() {
            return;
        }
        s.set_hint(after);
        let plan = s.plan().clone();
        self.clear_deadline((mb, false));
        if self.stage == self.s() {
            return;
        }
        self.forward_out(mb, None, after, plan, &[dead]);
        if let Some(s) = self.lifecycle.snaps.get_mut(&mb) {
            s.set_hint(after);
        }
    }

    /// Stage `dead` lost its contribution for `mb` after the backward went
    /// through: re-run it on a replacement that gets the stored gradient
    /// from `next`; the result is not needed here (need_grad = false).
    pub(super) fn redo(&mut self, mb: MbId, dead: NodeId, next: NodeId) {
        let Some(s) = self.lifecycle.snaps.get_mut(&mb) else {
            return;
        };
        s.set_hint(Some(next));
        let (attempt, path, plan) = (s.attempt(), s.path().clone(), s.plan().clone());
        let mut p = (*path).clone();
        p.truncate(self.stage as usize + 1);
        match self.route(mb, None, None, plan.as_ref(), &[dead]) {
            None => {
                self.lifecycle.snaps.get_mut(&mb).unwrap().set_stuck(true);
                self.lifecycle.mark_maybe_stuck();
            }
            Some((r, _)) => {
                let msg = Msg::Forward {
                    mb,
                    attempt,
                    path: Arc::new(p),
                    label: None,
                    hint: Some(next),
                    need_grad: false,
                    plan,
                };
                // Tracked like any forward hop: a silent replacement is
                // replaced in turn.
                self.send_tracked(r, msg, mb, false, attempt);
            }
        }
    }

    /// The node after `dead` reports it dead: re-send our stored output to a
    /// replacement that passes it on to `after`.
    pub(super) fn on_crash_notice(&mut self, mb: MbId, attempt: u32, dead: NodeId, after: NodeId) {
        self.peer_failed(dead);
        let ok = self
            .lifecycle
            .snaps
            .get(&mb)
            .is_some_and(|s| s.attempt() == attempt && s.next() == Some(dead) && !s.grad_in());
        if ok {
            self.recover(mb, dead, Some(after));
        }
    }

    /// A coordinator asks to re-run stage of `dead` for `mb` from our stored
    /// activation (the aggregate lost that contribution).
    pub(super) fn on_redo(&mut self, mb: MbId, dead: NodeId, next: NodeId) {
        if self.lifecycle.snaps.get(&mb).is_some_and(|s| s.fwd_done()) {
            self.redo(mb, dead, next);
        } else if self.stage != 0 {
            // No snapshot left here: the holder restarts it.
            self.send(mb.holder, Msg::Restart { mb, attempt: None });
        }
    }

    /// Recoveries that found no replacement are tried again (looked for
    /// only when a microbatch got stuck since the last look).
    pub(super) fn retry_stuck(&mut self) {
        let stuck: Vec<MbId> = if self.lifecycle.take_maybe_stuck() {
            self.lifecycle
                .snaps
                .iter()
                .filter(|(_, s)| s.stuck())
                .map(|(m, _)| *m)
                .collect()
        } else {
            Vec::new()
        };
        for mb in stuck {
            let dead = self.lifecycle.snaps[&mb].next().unwrap_or(self.id);
            let (hint, redo) = (
                self.lifecycle.snaps[&mb].hint(),
                self.lifecycle.snaps[&mb].grad_in(),
            );
            self.lifecycle.snaps.get_mut(&mb).unwrap().set_stuck(false);
            match (redo, hint) {
                (true, Some(h)) => self.redo(mb, dead, h),
                _ => self.recover(mb, dead, hint),
            }
        }
    }

    /// Microbatches whose output went to dead `p` and whose gradient has
    /// not come back: the forward or backward through it is broken. GWTF
    /// re-runs the hop at once; SWARM-plus, which restarts a microbatch
    /// from its holder when a crash breaks it, restarts it now (waiting
    /// for the gradient that cannot come stalled it until the holder's
    /// last-resort restart when `p` died with the output it was sending
    /// on); SWARM's stateless backward needs nothing of `p` (an output
    /// lost with it fails the hop's call: see `acks_on_delivery`).
    pub(super) fn recover_hops_through(&mut self, p: NodeId) {
        let reruns = self.policy().reruns_before_the_gradient_is_due();
        let restarts = !self.policy().reruns_crashed_stage();
        if !reruns && !restarts {
            return;
        }
        let broken: Vec<(MbId, u32)> = self
            .lifecycle
            .snaps
            .iter()
            .filter(|(_, s)| s.next() == Some(p) && s.fwd_done() && !s.grad_in() && !s.done())
            .map(|(m, s)| (*m, s.attempt()))
            .collect();
        for (mb, attempt) in broken {
            if reruns {
                self.recover(mb, p, None);
            } else if mb.holder == self.id {
                self.restart(mb, Some(attempt));
            } else {
                let attempt = Some(attempt);
                self.send(mb.holder, Msg::Restart { mb, attempt });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// Relay 10 of stage 2: previous stage 20 and 21, next stage 30 and 31, and
    /// the snapshot of microbatch (0, 0, 0) forwarded from 20 to 30.
    fn relay(policy: Policy) -> (Node, MbId) {
        let peers = [(20, 1), (21, 1), (30, 3), (31, 3), (0, 0)];
        let mut n = started(policy, 10, 2, &[], &peers);
        let m = mb(0, 0, 0);
        let now = n.now;
        n.lifecycle
            .snaps
            .insert(m, forwarded(&[0, 20, 10], 30, now));
        (n, m)
    }

    fn forwards_to(acts: &[Action]) -> Vec<NodeId> {
        sends(acts)
            .into_iter()
            .filter(|(_, m)| matches!(m, Msg::Forward { .. }))
            .map(|(to, _)| to)
            .collect()
    }

    /// The next node dies before it acknowledged the forward hop: every
    /// policy sends the stored output to another node of its stage.
    #[test]
    fn a_next_hop_lost_before_its_ack_is_replaced() {
        for policy in [
            Policy::Gwtf,
            Policy::Swarm,
            Policy::SwarmPlus,
            Policy::CentralMcmf,
        ] {
            let (mut n, m) = relay(policy);
            awaiting_ack(&mut n, m, false, 30);
            let acts = n.handle(2 * SEC, Input::PeerLost { peer: 30 });
            assert_eq!(forwards_to(&acts), [31], "{policy:?}");
            assert_eq!(n.lifecycle.snaps[&m].next(), Some(31), "{policy:?}");
        }
    }

    /// A hop sent to a node already known dead (its failed connection is
    /// the news, one round trip later) is sent elsewhere then, not at its
    /// ack timeout (SWARM's fixed 75 s for a backward: a whole iteration).
    #[test]
    fn a_hop_sent_to_a_node_known_dead_fails_with_its_connection() {
        for policy in [Policy::Swarm, Policy::Gwtf] {
            let (mut n, m) = relay(policy);
            n.lifecycle.snaps.get_mut(&m).unwrap().set_next(Some(31));
            n.handle(2 * SEC, Input::PeerLost { peer: 30 });
            n.lifecycle.snaps.get_mut(&m).unwrap().set_next(Some(30));
            awaiting_ack(&mut n, m, false, 30);
            let acts = n.handle(3 * SEC, Input::PeerLost { peer: 30 });
            assert_eq!(forwards_to(&acts), [31], "{policy:?}");
        }
    }

    /// The next node dies after its ack, while the gradient is awaited: GWTF
    /// re-sends the stored activation to a replacement at once; SWARM-plus
    /// has its holder restart the microbatch at once (it waited for a
    /// gradient that could not come: when the node died while sending its
    /// output on, until the holder's last-resort restart, minutes later);
    /// SWARM's stateless backward needs nothing of the dead node (the
    /// backward recomputes its stage elsewhere).
    #[test]
    fn a_next_hop_lost_after_its_ack_is_replaced_by_gwtf_restarted_by_swarm_plus() {
        let restarts = |acts: &[Action]| {
            sends(acts)
                .iter()
                .filter(|(to, m)| {
                    *to == 0
                        && matches!(
                            m,
                            Msg::Restart {
                                attempt: Some(0),
                                ..
                            }
                        )
                })
                .count()
        };
        for policy in [Policy::Gwtf, Policy::Swarm, Policy::SwarmPlus] {
            let (mut n, _) = relay(policy);
            let acts = n.handle(2 * SEC, Input::PeerLost { peer: 30 });
            let (fwd, restart) = match policy {
                Policy::Gwtf => (vec![31], 0),
                Policy::SwarmPlus => (vec![], 1),
                _ => (vec![], 0),
            };
            assert_eq!(forwards_to(&acts), fwd, "{policy:?}");
            assert_eq!(restarts(&acts), restart, "{policy:?}");
        }
    }

    /// The previous node dies before it acknowledged the gradient: GWTF and
    /// SWARM ask the node before it (here the holder) to re-run only the
    /// dead stage; SWARM-plus restarts the microbatch from its holder.
    #[test]
    fn a_previous_hop_lost_in_the_backward_reruns_its_stage_or_restarts() {
        let lose_prev = |policy| {
            let (mut n, m) = relay(policy);
            n.lifecycle.snaps.get_mut(&m).unwrap().set_grad_in();
            awaiting_ack(&mut n, m, true, 20);
            n.handle(2 * SEC, Input::PeerLost { peer: 20 })
        };
        let rerun = |msg: &&Msg| {
            matches!(
                msg,
                Msg::CrashNotice {
                    dead: 20,
                    after: 10,
                    ..
                }
            )
        };
        for policy in [Policy::Gwtf, Policy::Swarm] {
            let acts = lose_prev(policy);
            let s = sends(&acts);
            assert!(s.iter().any(|(to, msg)| *to == 0 && rerun(msg)), "{s:?}");
            assert!(!s.iter().any(|(_, msg)| matches!(msg, Msg::Restart { .. })));
        }
        let acts = lose_prev(Policy::SwarmPlus);
        let s = sends(&acts);
        let restart = |msg: &&Msg| {
            matches!(
                msg,
                Msg::Restart {
                    attempt: Some(0),
                    ..
                }
            )
        };
        assert!(s.iter().any(|(to, msg)| *to == 0 && restart(msg)), "{s:?}");
    }

    /// The holder dies while its gradient is on the way back: the microbatch
    /// is dropped with it (nothing is sent).
    #[test]
    fn a_holder_lost_in_the_backward_drops_its_microbatch() {
        let mut n = started(Policy::Gwtf, 10, 1, &[], &[(0, 0), (20, 2)]);
        let m = mb(0, 0, 0);
        let now = n.now;
        let mut s = forwarded(&[0, 10], 20, now);
        s.set_grad_in();
        n.lifecycle.snaps.insert(m, s);
        awaiting_ack(&mut n, m, true, 0);
        let acts = n.handle(2 * SEC, Input::PeerLost { peer: 0 });
        assert!(sends(&acts).is_empty(), "{:?}", sends(&acts));
    }

    /// With no replacement alive, a re-run waits (stuck) and is tried again at
    /// a tick once a node of the stage is known.
    #[test]
    fn a_rerun_without_a_replacement_waits_for_one() {
        let mut n = started(Policy::Gwtf, 10, 2, &[], &[(20, 1), (30, 3), (40, 4)]);
        let m = mb(0, 0, 0);
        let now = n.now;
        let mut s = forwarded(&[0, 20, 10], 30, now);
        s.set_grad_in();
        n.lifecycle.snaps.insert(m, s);
        n.peer_dead(30);
        n.redo(m, 30, 40);
        assert!(n.lifecycle.snaps[&m].stuck());
        n.learn(31, 3);
        let t = n.next_tick;
        let acts = n.on_timeout(t);
        assert_eq!(forwards_to(&acts), [31]);
        assert!(!n.lifecycle.snaps[&m].stuck());
    }
}
