//! SWARM's load balancer as its public code behaves (repository
//! yandex-research/swarm), used by the `swarm` policy, and the next-hop
//! rule of the GWTF paper's authors' own SWARM (`swarm-deccom`).
//!
//! SWARM:
//! - every trainer (data holder) keeps a balancer of its own per stage,
//!   and calls the stage's peers itself
//!   (`swarm/pipeline/src/moe/client/balanced_expert.py`: the trainer's
//!   `_RemoteMoECall` takes the next expert from its own
//!   `ExpertBalancer`); so here a relay routing a holder's microbatch uses
//!   that holder's heap, fed only by that holder's calls;
//! - the next task goes to the peer with the smallest key, the cumulative
//!   expected time of every task it was ever given; its key then grows by
//!   the task's expected time, the task size over the peer's measured
//!   throughput (`swarm/pipeline/src/moe/client/balancer.py`,
//!   `ExpertBalancer.use_another_expert`). Keys only grow, so each peer
//!   gets a share of the traffic proportional to its throughput as the
//!   trainer measures it;
//! - a peer enters at the smallest key then in the heap, so that it is
//!   tried soon (`balancer.py`, `_add_expert`);
//! - the throughput is a bias-corrected EMA (alpha 0.1) of the seconds per
//!   task of the trainer's whole calls, end to end (the input to the peer,
//!   queue, compute, the output back to the trainer;
//!   `swarm/pipeline/src/optim/performance_ema.py`, `update_threadsafe`).
//!   A relay times the hop from its own send, which adds its leg to the
//!   trainer: that leg (latency plus the hop's bytes over the measured
//!   bandwidth) is taken off, so near peers of the trainer answer sooner
//!   and get more of its work, as in SWARM. Before the first measurement
//!   a task is expected to take `initial_throughput * task_size` (1 s per
//!   microbatch);
//! - a peer whose call failed is banned until its DHT record expires, and
//!   its keys and throughputs are forgotten (`balancer.py`, `_ban_expert`;
//!   records live 300 s, `swarm/pipeline/src/moe/server/dht_handler.py`,
//!   `declare_experts`). A relay bans it for every trainer at once (each
//!   trainer's own call would fail the same way);
//! - call timeouts are fixed: 30 s forward, 2.5 times that (75 s) backward
//!   (`swarm/train_pipeline.py`, `TIMEOUT` and `BACKWARD_TIMEOUT`).
//!
//! SWARM-DecCom (NikolayBlagoev/DecCom-Python, `swarmprotocol.py`):
//! - a relay sends its output straight to a peer of the next stage, the one
//!   of the lowest delay (`choose_next`); a peer newly known starts at
//!   15 s (`PeerClassification(nodeid, 15000.0)`, in ms);
//! - the delay is an EMA, 0.6 old and 0.4 new, of the time from sending a
//!   forward to the peer's `COMPLETE`, which the peer sends once it has run
//!   its forward (`process_datagram`; the code counts whole seconds, here
//!   the fraction is kept);
//! - a forward not completed within 20 s is sent again, to the peer of the
//!   lowest delay then, and the late peer's delay becomes 8000 s
//!   (`send_forward`'s `call_later(20, ...)`, `timeout`). The code sets no
//!   timeout on a backward; here it has the same 20 s.
use super::routing::NextHopRule;
use super::*;

/// Expected seconds of one microbatch at a peer not measured yet
/// (`initial_throughput` = 1.0 times a task size of one).
const INITIAL_SECS_PER_TASK: f64 = 1.0;
/// Weight of a new sample in the throughput EMA.
const EMA_ALPHA: f64 = 0.1;
/// Timeout of a forward call.
pub(super) const FORWARD_TIMEOUT: Time = 30 * SEC;
/// Timeout of a backward call.
pub(super) const BACKWARD_TIMEOUT: Time = 75 * SEC;
/// How long a failed peer stays banned: the lifetime of its DHT record.
pub(super) const BAN: Time = 300 * SEC;

/// SWARM-DecCom: the delay (s) of a peer not measured yet.
pub(super) const DECCOM_INITIAL_DELAY: f64 = 15.0;
/// SWARM-DecCom: the weight of a new delay sample.
const DECCOM_ALPHA: f64 = 0.4;
/// SWARM-DecCom: the delay (s) a peer gets when a hop to it timed out.
const DECCOM_TIMED_OUT_DELAY: f64 = 8000.0;
/// SWARM-DecCom: a hop's timeout, forward and backward.
pub(super) const DECCOM_TIMEOUT: Time = 20 * SEC;

/// One peer's entry in one trainer's balancer: its key in the heap and
/// its measured time per task.
#[derive(Clone, Debug, Default)]
pub(super) struct BalancerEntry {
    /// Cumulative expected seconds of the tasks given to the peer; `None`
    /// until the peer enters the heap (again, after a ban).
    load: Option<f64>,
    /// Random tie-break drawn with the key (the heap entries' `random()`).
    tie: f64,
    /// EMA of seconds per task, not yet bias-corrected.
    ema_secs: f64,
    updates: i32,
}

impl BalancerEntry {
    /// Expected seconds of the next task at this peer.
    pub(super) fn secs_per_task(&self) -> f64 {
        if self.updates == 0 {
            return INITIAL_SECS_PER_TASK;
        }
        let correction = 1.0 - (1.0 - EMA_ALPHA).powi(self.updates);
        (self.ema_secs / correction).max(1e-9)
    }

    /// A call to this peer took `secs` end to end.
    pub(super) fn observe(&mut self, secs: f64) {
        self.ema_secs = EMA_ALPHA * secs.max(0.0) + (1.0 - EMA_ALPHA) * self.ema_secs;
        self.updates = self.updates.saturating_add(1);
    }
}

/// A peer's entries in the trainers' heaps, by trainer (a handful: one
/// per data holder whose microbatches this node routed to the peer).
#[derive(Clone, Debug, Default)]
pub(super) struct HeapEntries(Vec<(NodeId, BalancerEntry)>);

impl HeapEntries {
    /// The peer's entry in `trainer`'s heap, if it has one.
    pub(super) fn of(&self, trainer: NodeId) -> Option<&BalancerEntry> {
        self.0.iter().find(|(t, _)| *t == trainer).map(|(_, e)| e)
    }

    /// The peer's entry in `trainer`'s heap, made on first use.
    pub(super) fn of_mut(&mut self, trainer: NodeId) -> &mut BalancerEntry {
        let i = match self.0.iter().position(|(t, _)| *t == trainer) {
            Some(i) => i,
            None => {
                self.0.push((trainer, BalancerEntry::default()));
                self.0.len() - 1
            }
        };
        &mut self.0[i].1
    }

    /// Banned: out of every heap, its throughputs forgotten.
    fn forget(&mut self) {
        self.0.clear();
    }
}

impl Node {
    /// SWARM: the candidate with the smallest cumulative expected work in
    /// the heap of `trainer` (the microbatch's holder); its key grows by
    /// the expected time of this task.
    pub(super) fn next_hop_by_cumulative_work(
        &mut self,
        trainer: NodeId,
        exclude: &[NodeId],
    ) -> Option<(NodeId, Option<Label>)> {
        let cands: Vec<NodeId> = self
            .next_candidates()
            .into_iter()
            .filter(|c| !exclude.contains(c))
            .collect();
        let load = |n: &Node, c: &NodeId| n.peers[c].balancer.of(trainer).and_then(|e| e.load);
        let base = cands
            .iter()
            .filter_map(|c| load(self, c))
            .reduce(f64::min)
            .unwrap_or(0.0);
        for &c in &cands {
            if load(self, &c).is_none() {
                let tie = self.rng.next_f64();
                let e = self.peers.get_mut(&c).unwrap().balancer.of_mut(trainer);
                e.load = Some(base);
                e.tie = tie;
            }
        }
        let key = |n: &Node, c: &NodeId| {
            let e = n.peers[c].balancer.of(trainer);
            (
                e.and_then(|e| e.load).unwrap_or(base),
                e.map_or(0.0, |e| e.tie),
            )
        };
        let best = cands.into_iter().min_by(|a, b| {
            let (ka, kb) = (key(self, a), key(self, b));
            ka.partial_cmp(&kb).unwrap_or(std::cmp::Ordering::Equal)
        })?;
        let tie = self.rng.next_f64();
        let e = self.peers.get_mut(&best).unwrap().balancer.of_mut(trainer);
        e.load = Some(e.load.unwrap_or(base) + e.secs_per_task());
        e.tie = tie;
        Some((best, None))
    }

    /// SWARM-DecCom: the candidate of the lowest delay (the first in id
    /// order of equals).
    pub(super) fn next_hop_by_lowest_delay(
        &self,
        exclude: &[NodeId],
    ) -> Option<(NodeId, Option<Label>)> {
        let mut best: Option<(f64, NodeId)> = None;
        for c in self.next_candidates() {
            if exclude.contains(&c) {
                continue;
            }
            let d = self.peers[&c].delay;
            if best.is_none_or(|b| d < b.0) {
                best = Some((d, c));
            }
        }
        best.map(|b| (b.1, None))
    }

    /// The hop of `mb` to `to`, sent at `sent_at` with `bytes`, was
    /// acknowledged now: what the balancing rules measure of it.
    pub(super) fn balancer_observe(
        &mut self,
        to: NodeId,
        mb: MbId,
        backward: bool,
        sent_at: Time,
        bytes: u64,
    ) {
        if backward {
            return; // both time forward calls only
        }
        let delay = to_secs(self.now - sent_at);
        match self.policy().next_hop_rule() {
            NextHopRule::CumulativeWork => {
                // The trainer's own call: this node's leg to the trainer
                // (the hop goes through it) is not part of it.
                let leg = match self.peers.get(&mb.holder) {
                    Some(h) if mb.holder != self.id => {
                        h.lat.unwrap_or(0.0) + bytes as f64 / h.bw.unwrap_or(f64::INFINITY)
                    }
                    _ => 0.0,
                };
                if let Some(p) = self.peers.get_mut(&to) {
                    p.balancer.of_mut(mb.holder).observe((delay - leg).max(0.0));
                }
            }
            NextHopRule::LowestDelay => {
                if let Some(p) = self.peers.get_mut(&to) {
                    p.delay = DECCOM_ALPHA * delay + (1.0 - DECCOM_ALPHA) * p.delay;
                }
            }
            NextHopRule::Cost | NextHopRule::ShortestExpectedDelay => {}
        }
    }

    /// A hop to `p` failed (no ack in time, or reported crashed): SWARM
    /// bans it for the lifetime of its DHT record and forgets its entries,
    /// SWARM-DecCom gives it its timed-out delay; the other policies
    /// suspect it for a few ticks.
    pub(super) fn peer_failed(&mut self, p: NodeId) {
        match self.policy().next_hop_rule() {
            NextHopRule::CumulativeWork => {
                let until = self.now + BAN;
                if let Some(x) = self.peers.get_mut(&p) {
                    x.banned_until = x.banned_until.max(until);
                    x.balancer.forget();
                }
            }
            NextHopRule::LowestDelay => {
                if let Some(x) = self.peers.get_mut(&p) {
                    x.delay = DECCOM_TIMED_OUT_DELAY;
                }
            }
            NextHopRule::Cost | NextHopRule::ShortestExpectedDelay => self.peer_suspect(p),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// The data holder whose microbatches the tests route.
    const H: NodeId = 1;

    /// Relay 10 of stage 2 with next-stage peers 30, 31, 32 measured by
    /// holder `H`'s calls at 1, 2 and 4 microbatches per second.
    fn three_peers() -> Node {
        let mut n = started(Policy::Swarm, 10, 2, &[], &[(30, 3), (31, 3), (32, 3)]);
        for (p, thr) in [(30, 1.0), (31, 2.0), (32, 4.0)] {
            let e = n.peers.get_mut(&p).unwrap().balancer.of_mut(H);
            e.observe(1.0 / thr);
        }
        n
    }

    fn shares_of(n: &mut Node, trainer: NodeId, tasks: usize) -> [usize; 3] {
        let mut count = [0; 3];
        for _ in 0..tasks {
            let (p, _) = n.next_hop_by_cumulative_work(trainer, &[]).unwrap();
            count[(p - 30) as usize] += 1;
        }
        count
    }

    fn shares(n: &mut Node, tasks: usize) -> [usize; 3] {
        shares_of(n, H, tasks)
    }

    fn entry(n: &Node, p: NodeId) -> &BalancerEntry {
        n.peers[&p].balancer.of(H).unwrap()
    }

    /// Throughputs 1, 2, 4: keys grow by 1, 0.5 and 0.25 s per task, so
    /// after 70 tasks the heap gave 10, 20 and 40 (shares 1:2:4).
    #[test]
    fn the_heap_shares_tasks_in_proportion_to_throughput() {
        let mut n = three_peers();
        let c = shares(&mut n, 70);
        assert!(
            c[0].abs_diff(10) <= 1 && c[1].abs_diff(20) <= 1 && c[2].abs_diff(40) <= 1,
            "{c:?}"
        );
        assert_eq!(c.iter().sum::<usize>(), 70);
    }

    /// Each trainer has a heap of its own: holder 2, which never measured
    /// the peers, shares its tasks evenly (1 s each, untried), whatever
    /// holder `H` measured and sent; and its tasks do not move `H`'s keys.
    #[test]
    fn every_trainer_has_a_heap_of_its_own() {
        let mut n = three_peers();
        shares(&mut n, 35);
        let keys: Vec<f64> = (30..33).map(|p| entry(&n, p).load.unwrap()).collect();
        let c = shares_of(&mut n, 2, 30);
        assert_eq!(c, [10, 10, 10]);
        let after: Vec<f64> = (30..33).map(|p| entry(&n, p).load.unwrap()).collect();
        assert_eq!(keys, after);
        assert_eq!(shares(&mut n, 35).iter().sum::<usize>(), 35);
    }

    /// A call is timed for the trainer that owns the heap: a relay's hop
    /// goes through the trainer, so its leg to the trainer (latency plus
    /// bytes over bandwidth, as measured) is taken off the hop's delay.
    /// The holder's own hops are taken as they are.
    #[test]
    fn a_call_is_timed_without_the_relays_leg_to_the_trainer() {
        let mut n = started(Policy::Swarm, 10, 2, &[], &[(30, 3), (H, 0)]);
        let h = n.peers.get_mut(&H).unwrap();
        h.lat = Some(0.05);
        h.bw = Some(1e6);
        n.now = 10 * SEC;
        // 0.75 s from the relay's send to the ack: 0.05 + 0.2 s of it
        // were the relay's leg to the trainer (200 kB at 1 MB/s).
        n.balancer_observe(30, mb(H, 0, 0), false, n.now - 3 * SEC / 4, 200_000);
        assert!((entry(&n, 30).secs_per_task() - 0.5).abs() < 1e-9);
        // The backward is not timed.
        n.balancer_observe(30, mb(H, 0, 0), true, n.now - 5 * SEC, 0);
        assert!((entry(&n, 30).secs_per_task() - 0.5).abs() < 1e-9);
        let mut holder = started(Policy::Swarm, H, 0, &[], &[(30, 1)]);
        holder.now = 10 * SEC;
        holder.balancer_observe(30, mb(H, 0, 0), false, holder.now - 3 * SEC / 4, 200_000);
        let e = holder.peers[&30].balancer.of(H).unwrap();
        assert!((e.secs_per_task() - 0.75).abs() < 1e-9);
    }

    /// Distance does not matter beyond the calls' times: a far fast peer
    /// gets the same share as a near one of the same measured time.
    #[test]
    fn the_heap_ignores_distance() {
        let mut n = three_peers();
        n.peers.get_mut(&31).unwrap().lat = Some(0.2);
        n.peers.get_mut(&32).unwrap().lat = Some(0.001);
        n.peers.get_mut(&32).unwrap().balancer = HeapEntries::default();
        n.peers
            .get_mut(&32)
            .unwrap()
            .balancer
            .of_mut(H)
            .observe(0.5);
        let c = shares(&mut n, 50);
        assert!(c[1].abs_diff(c[2]) <= 1, "{c:?}");
    }

    /// A peer that joins late enters at the smallest key, so it is tried
    /// next, not after catching up with the others' cumulative work.
    #[test]
    fn a_new_peer_enters_at_the_smallest_key() {
        let mut n = three_peers();
        shares(&mut n, 30);
        n.learn(33, 3);
        let (p, _) = n.next_hop_by_cumulative_work(H, &[]).unwrap();
        let min_other = [30, 31, 32]
            .iter()
            .map(|c| entry(&n, *c).load.unwrap())
            .reduce(f64::min)
            .unwrap();
        assert!(p == 33 || entry(&n, 33).load.unwrap() <= min_other + 1e-9);
    }

    /// A failed peer is not chosen until its ban (300 s) expires; then it
    /// comes back with its throughput forgotten, at the smallest key.
    #[test]
    fn a_failed_peer_is_banned_until_its_record_expires() {
        let mut n = three_peers();
        let start = n.now;
        n.peer_failed(32);
        assert!(n.peers[&32].balancer.of(H).is_none());
        let c = shares(&mut n, 30);
        assert_eq!(c[2], 0, "{c:?}");
        n.now = start + BAN - SEC;
        assert_eq!(shares(&mut n, 10)[2], 0);
        n.now = start + BAN;
        assert_eq!(n.next_hop_by_cumulative_work(H, &[]).unwrap().0, 32);
        assert_eq!(entry(&n, 32).secs_per_task(), INITIAL_SECS_PER_TASK);
    }

    /// The throughput estimate is SWARM's bias-corrected EMA: one sample is
    /// taken as is; then each new sample weighs 0.1.
    #[test]
    fn the_throughput_is_a_bias_corrected_ema() {
        let mut e = BalancerEntry::default();
        assert_eq!(e.secs_per_task(), INITIAL_SECS_PER_TASK);
        e.observe(2.0);
        assert!((e.secs_per_task() - 2.0).abs() < 1e-12);
        e.observe(4.0);
        // (0.1*4 + 0.9*0.2) / (1 - 0.81) = 0.58 / 0.19
        assert!((e.secs_per_task() - 0.58 / 0.19).abs() < 1e-12);
    }

    /// SWARM-DecCom: every peer starts at 15 s, a forward's ack time moves
    /// the delay by 0.4 of the difference, the lowest delay is the next hop
    /// (all of them: no share for the others), and a timed-out peer is
    /// passed over until all others are slower than 8000 s.
    #[test]
    fn deccom_sends_to_the_lowest_delay() {
        let mut n = started(
            Policy::SwarmDeccom,
            10,
            2,
            &[],
            &[(30, 3), (31, 3), (32, 3)],
        );
        assert!((30..33).all(|p| n.peers[&p].delay == DECCOM_INITIAL_DELAY));
        assert_eq!(
            n.next_hop_by_lowest_delay(&[]).unwrap().0,
            30,
            "the first of equals"
        );
        n.now = 100 * SEC;
        n.balancer_observe(31, mb(H, 0, 0), false, n.now - 5 * SEC, 1000);
        assert!((n.peers[&31].delay - (0.6 * 15.0 + 0.4 * 5.0)).abs() < 1e-9);
        n.balancer_observe(30, mb(H, 0, 1), true, n.now - SEC, 1000);
        assert_eq!(
            n.peers[&30].delay, DECCOM_INITIAL_DELAY,
            "backward not timed"
        );
        for _ in 0..5 {
            assert_eq!(n.route(mb(H, 0, 2), None, None, None, &[]).unwrap().0, 31);
        }
        assert_eq!(n.next_hop_by_lowest_delay(&[31]).unwrap().0, 30);
        n.peer_failed(31);
        assert_eq!(n.peers[&31].delay, DECCOM_TIMED_OUT_DELAY);
        assert!(n.peers[&31].banned_until <= n.now, "not banned, only slow");
        assert_eq!(n.next_hop_by_lowest_delay(&[]).unwrap().0, 30);
        assert_eq!(n.next_hop_by_lowest_delay(&[30, 32]).unwrap().0, 31);
    }
}
