//! Hop acknowledgements: every hop is acknowledged once its work is done;
//! adaptive ack deadlines (fixed ones for SWARM); QUEUED notices for work
//! waiting in a GPU queue.
use super::*;

/// Hops sent and not yet acknowledged, with their deadlines.
#[derive(Debug, Default)]
pub(super) struct AckTimers {
    deadlines: BTreeSet<(Time, Dl)>,
    outstanding: BTreeMap<(MbId, bool), Outstanding>,
    /// Acks held until this node's output of the hop reached the next hop
    /// (policies that ack on delivery): the sender and attempt, by hop.
    held: BTreeMap<(MbId, bool), (NodeId, u32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Dl {
    /// Ack of a hop of `mb` (backward or forward) not received.
    Ack(MbId, bool),
}

#[derive(Clone, Debug)]
pub(super) struct Outstanding {
    to: NodeId,
    sent_at: Time,
    deadline: Time,
    bytes: u64,
    attempt: u32,
}

impl Outstanding {
    /// Attempt `attempt` of a hop of `bytes` sent to `to` at `sent_at`,
    /// whose ack is due by `deadline`.
    pub(super) fn new(to: NodeId, sent_at: Time, deadline: Time, bytes: u64, attempt: u32) -> Self {
        Outstanding {
            to,
            sent_at,
            deadline,
            bytes,
            attempt,
        }
    }
}

impl AckTimers {
    /// Forgets the hops of iterations before `iter`: their acks, awaited
    /// or held, and their deadlines.
    pub(super) fn forget_before(&mut self, iter: u32) {
        let deadlines = &mut self.deadlines;
        self.outstanding.retain(|k, o| {
            let keep = k.0.iter >= iter;
            if !keep {
                deadlines.remove(&(o.deadline, Dl::Ack(k.0, k.1)));
            }
            keep
        });
        self.held.retain(|k, _| k.0.iter >= iter);
    }

    /// Whether the ack of this node's hop of `mb` (`backward` or forward)
    /// is still awaited.
    pub(super) fn awaits(&self, mb: MbId, backward: bool) -> bool {
        self.outstanding.contains_key(&(mb, backward))
    }

    /// Whether acks are held for outputs not yet delivered.
    #[cfg(test)]
    pub(super) fn holds_any(&self) -> bool {
        !self.held.is_empty()
    }

    /// The earliest deadline, if any.
    pub(super) fn next_deadline(&self) -> Option<Time> {
        self.deadlines.iter().next().map(|x| x.0)
    }

    /// The earliest deadline due at `now`, removed.
    pub(super) fn pop_due(&mut self, now: Time) -> Option<Dl> {
        let &(t, dl) = self.deadlines.iter().next()?;
        if t > now {
            return None;
        }
        self.deadlines.remove(&(t, dl));
        Some(dl)
    }
}

impl Node {
    /// Acknowledges the hop of `mb` (`attempt`) that came from `to`, its
    /// work done here: `busy` is how long it waited and ran here (the
    /// sender's ack timeout and bandwidth estimate discount it).
    pub(super) fn ack(&mut self, to: NodeId, mb: MbId, attempt: u32, backward: bool, busy: Time) {
        let bytes = self.cfg.activation_bytes;
        self.send(
            to,
            Msg::Ack {
                mb,
                attempt,
                backward,
                busy,
                bytes,
            },
        );
    }

    /// The work of the hop of `mb` (`attempt`) that came from `to` is done
    /// and its output sent on (`sent_on`): acknowledged now, or, by a
    /// policy that acks on delivery, once the output reached the next hop
    /// (`release_held_ack`).
    pub(super) fn ack_done(
        &mut self,
        to: NodeId,
        mb: MbId,
        attempt: u32,
        backward: bool,
        sent_on: bool,
    ) {
        if sent_on && self.policy().acks_on_delivery() {
            self.acks.held.insert((mb, backward), (to, attempt));
            return;
        }
        let busy = self.busy_since_arrival(mb, backward);
        self.ack(to, mb, attempt, backward, busy);
    }

    /// The next hop has this node's output of the hop of `mb`: its held
    /// ack goes out (its `busy` counts the whole stay here, the output's
    /// delivery included, so that the sender's bandwidth estimate counts
    /// only the input's transfer).
    pub(super) fn release_held_ack(&mut self, mb: MbId, backward: bool) {
        if let Some((to, attempt)) = self.acks.held.remove(&(mb, backward)) {
            let busy = self.busy_since_arrival(mb, backward);
            self.ack(to, mb, attempt, backward, busy);
        }
    }

    /// Sends the gradient of `mb` (`attempt`) back to `to`, tracked like
    /// every hop.
    pub(super) fn send_backward(
        &mut self,
        to: NodeId,
        mb: MbId,
        attempt: u32,
        path: Arc<Vec<NodeId>>,
    ) {
        let msg = Msg::Backward { mb, attempt, path };
        self.send_tracked(to, msg, mb, true, attempt);
    }

    /// Acknowledges again a hop whose work was done before (a re-sent hop):
    /// nothing to measure.
    pub(super) fn ack_again(&mut self, to: NodeId, mb: MbId, attempt: u32, backward: bool) {
        self.send(
            to,
            Msg::Ack {
                mb,
                attempt,
                backward,
                busy: 0,
                bytes: 0,
            },
        );
    }

    pub(super) fn add_deadline(&mut self, key: (MbId, bool), o: Outstanding) {
        if let Some(old) = self.acks.outstanding.insert(key, o.clone()) {
            self.acks
                .deadlines
                .remove(&(old.deadline, Dl::Ack(key.0, key.1)));
        }
        self.acks
            .deadlines
            .insert((o.deadline, Dl::Ack(key.0, key.1)));
    }

    pub(super) fn clear_deadline(&mut self, key: (MbId, bool)) -> Option<Outstanding> {
        let o = self.acks.outstanding.remove(&key)?;
        self.acks
            .deadlines
            .remove(&(o.deadline, Dl::Ack(key.0, key.1)));
        Some(o)
    }

    /// How long the ack of a hop to `to` may take: fixed for SWARM's calls,
    /// else a multiple of the link's measured ack delay.
    pub(super) fn ack_timeout_for(&self, to: NodeId, backward: bool) -> Time {
        if let Some((fwd, bwd)) = self.policy().fixed_timeouts() {
            return if backward { bwd } else { fwd };
        }
        match self.peers.get(&to).and_then(|p| p.ack) {
            Some(a) => secs(a * self.cfg.ack_timeout_mult).max(self.cfg.min_ack_timeout),
            None => self.cfg.initial_ack_timeout,
        }
    }

    pub(super) fn send_tracked(
        &mut self,
        to: NodeId,
        msg: Msg,
        mb: MbId,
        backward: bool,
        attempt: u32,
    ) {
        let bytes = self.cfg.activation_bytes;
        let deadline = self.now + self.ack_timeout_for(to, backward);
        // Hops sent to one peer share the link: remember when what this
        // node queued on it is through, by the bandwidth estimate.
        let now = self.now;
        let prior = self.cfg.prior_bandwidth;
        if let Some(p) = self.peers.get_mut(&to) {
            let xfer = secs(bytes as f64 / p.bw.unwrap_or(prior).max(1.0));
            if p.link_free <= now {
                p.link_busy_since = now;
            }
            p.link_free = p.link_free.max(now) + xfer;
        }
        self.add_deadline(
            (mb, backward),
            Outstanding::new(to, self.now, deadline, bytes, attempt),
        );
        if !backward && self.policy().counts_queues() {
            if let Some(p) = self.peers.get_mut(&to) {
                p.queued += 1;
            }
        }
        self.send(to, msg);
    }

    /// A hop's work waits behind other work in this node's GPU queue: tell
    /// the sender it arrived and is queued, with the expected time until it
    /// is done (the compute queued here, by this node's own estimate of its
    /// speed), so that queueing is not taken for a crash. Nothing is sent
    /// when the GPU has nothing else to do first.
    pub(super) fn notify_queued(&mut self, to: NodeId, mb: MbId, attempt: u32, backward: bool) {
        let n = (self.tasks.values())
            .filter(|(k, _, _)| k.is_compute())
            .count();
        let mut wait = self.gpu_backlog_s();
        // A forward waiting for memory also waits for backwards to free it:
        // about one stay of a microbatch here per `capacity` ahead of it.
        let ahead = (!backward)
            .then(|| self.lifecycle.waiting_position(mb))
            .flatten();
        if let Some(k) = ahead {
            let hold = self.lifecycle.hold_s().unwrap_or(3.0 * self.compute_s);
            wait += (k / self.capacity.max(1) as usize + 1) as f64 * hold;
        } else if n < 2 && !self.policy().acks_on_delivery() {
            // (A policy that acks on delivery hears of every receipt.)
            return;
        }
        self.send(
            to,
            Msg::Queued {
                mb,
                attempt,
                backward,
                wait: secs(wait),
            },
        );
    }

    /// The receiver of a tracked hop has it queued: its ack is due after
    /// the queue it reported (with a margin for the estimate) plus the
    /// usual ack timeout. A crash of the receiver is still caught by the
    /// liveness checks (`peer_dead`) or by this later deadline.
    pub(super) fn on_queued(
        &mut self,
        from: NodeId,
        mb: MbId,
        attempt: u32,
        backward: bool,
        wait: Time,
    ) {
        let Some(o) = self.acks.outstanding.get(&(mb, backward)) else {
            return;
        };
        if o.to != from || o.attempt != attempt {
            return;
        }
        // The receiver has this node's output: a held ack goes out.
        self.release_held_ack(mb, backward);
        if self.policy().fixed_timeouts().is_some() {
            return;
        }
        let Some(o) = self.acks.outstanding.get(&(mb, backward)) else {
            return;
        };
        // The reported wait is the peer's word: capped at the holder's
        // last-resort timeout (no hostile or broken peer postpones a hop
        // further) and added without overflow.
        let wait = wait.min(self.cfg.e2e_timeout);
        let deadline = self
            .now
            .saturating_add(2 * wait)
            .saturating_add(self.ack_timeout_for(from, backward));
        if deadline <= o.deadline {
            return;
        }
        let mut o = o.clone();
        o.deadline = deadline;
        self.add_deadline((mb, backward), o);
    }

    pub(super) fn on_ack(
        &mut self,
        from: NodeId,
        mb: MbId,
        attempt: u32,
        backward: bool,
        busy: Time,
        bytes: u64,
    ) {
        let Some(o) = self.acks.outstanding.get(&(mb, backward)) else {
            return;
        };
        if o.to != from || o.attempt != attempt {
            return;
        }
        let o = self.clear_deadline((mb, backward)).unwrap();
        self.release_held_ack(mb, backward);
        self.balancer_observe(from, mb, backward, o.sent_at, o.bytes);
        let a = self.cfg.ema_alpha;
        let delay = to_secs(self.now - o.sent_at);
        let counts_queues = self.policy().counts_queues();
        if let Some(p) = self.peers.get_mut(&from) {
            p.ack = Self::ema(p.ack, delay, a);
            let lat = p.lat.unwrap_or(0.0);
            let net = (delay - to_secs(busy) - 2.0 * lat).max(1e-4);
            if bytes > 0 && o.bytes > 0 {
                p.bw = Self::ema(p.bw, o.bytes as f64 / net, a);
            }
            if !backward && counts_queues {
                p.queued = p.queued.saturating_sub(1);
                // Service time of one microbatch through this peer:
                // transfer + its compute (queueing is what `queued` counts).
                let service = (delay - to_secs(busy)).max(0.0) + p.compute_s / 3.0;
                p.thr = Self::ema(p.thr, 1.0 / service.max(1e-6), a);
            }
        }
    }

    /// A hop's ack deadline passed. While the link to the peer is still
    /// busy with transfers this node queued on it since the hop was sent
    /// (a burst of hops to one peer shares its bandwidth, so each arrives
    /// late), the ack is not due yet: the deadline moves to the usual
    /// timeout after that busy period, by the bandwidth estimate.
    pub(super) fn ack_deadline(&mut self, mb: MbId, backward: bool) {
        let Some(o) = self.acks.outstanding.get(&(mb, backward)) else {
            return;
        };
        let fixed = self.policy().fixed_timeouts().is_some();
        if let Some(p) = self.peers.get(&o.to).filter(|_| !fixed) {
            // The usual timeout counts the hop's own transfer; what the
            // transfers queued with it add is the rest of the busy period.
            let xfer = secs(o.bytes as f64 / p.bw.unwrap_or(self.cfg.prior_bandwidth).max(1.0));
            let due = p.link_free.saturating_sub(xfer) + self.ack_timeout_for(o.to, backward);
            if !p.dead && o.sent_at >= p.link_busy_since && due > self.now {
                let mut o = o.clone();
                o.deadline = due;
                self.add_deadline((mb, backward), o);
                return;
            }
        }
        self.ack_timeout(mb, backward);
    }

    pub(super) fn ack_timeout(&mut self, mb: MbId, backward: bool) {
        let Some(o) = self.clear_deadline((mb, backward)) else {
            return;
        };
        let to = o.to;
        self.peer_failed(to);
        if let Some(p) = self.peers.get_mut(&to) {
            p.queued = p.queued.saturating_sub(1);
        }
        if self
            .lifecycle
            .snaps
            .get(&mb)
            .is_none_or(|s| s.attempt() != o.attempt)
        {
            return;
        }
        if backward {
            self.backward_failed(mb, to);
        } else {
            self.forward_failed(mb, to);
        }
    }

    /// Hops waiting for dead `p`'s ack time out now.
    pub(super) fn hops_lost_to(&mut self, p: NodeId) {
        let waiting: Vec<(MbId, bool)> = self
            .acks
            .outstanding
            .iter()
            .filter(|(_, o)| o.to == p)
            .map(|(k, _)| *k)
            .collect();
        for (mb, back) in waiting {
            self.ack_timeout(mb, back);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// A `Queued` notice postpones a hop's ack deadline by the reported
    /// wait, but a hostile wait (u64::MAX) neither overflows nor postpones
    /// it beyond the holder's last-resort timeout; a notice from another
    /// peer than the hop's receiver changes nothing.
    #[test]
    fn a_queued_notice_postpones_a_hop_within_bounds() {
        let cfg = Arc::new(Config::new(Policy::Gwtf, 4, 1 << 20));
        let mut n = Node::new(cfg.clone(), 5, 2, 0.5, 4, 1);
        n.now = 1_000 * SEC;
        let mb = MbId {
            holder: 0,
            iter: 3,
            idx: 1,
        };
        let o = Outstanding::new(9, n.now, n.now + SEC, 1 << 20, 0);
        n.acks.outstanding.insert((mb, false), o);
        n.on_queued(8, mb, 0, false, 10 * SEC);
        assert_eq!(n.acks.outstanding[&(mb, false)].deadline, n.now + SEC);
        n.on_queued(9, mb, 0, false, 10 * SEC);
        let d = n.acks.outstanding[&(mb, false)].deadline;
        assert!(d >= n.now + 20 * SEC, "{d}");
        for wait in [u64::MAX / 4, u64::MAX] {
            n.on_queued(9, mb, 0, false, wait);
            let d = n.acks.outstanding[&(mb, false)].deadline;
            assert!(d > n.now + 20 * SEC && d <= n.now + 2 * cfg.e2e_timeout + 3600 * SEC);
        }
    }

    /// Due deadlines come out earliest first, and none before it is due.
    #[test]
    fn due_deadlines_pop_in_time_order() {
        let mut t = AckTimers::default();
        let (a, b) = (mb(0, 1, 0), mb(0, 1, 1));
        t.deadlines.insert((5 * SEC, Dl::Ack(b, true)));
        t.deadlines.insert((3 * SEC, Dl::Ack(a, false)));
        assert_eq!(t.pop_due(2 * SEC), None);
        assert_eq!(t.pop_due(6 * SEC), Some(Dl::Ack(a, false)));
        assert_eq!(t.pop_due(4 * SEC), None);
        assert_eq!(t.pop_due(5 * SEC), Some(Dl::Ack(b, true)));
        assert!(t.deadlines.is_empty());
    }
}
