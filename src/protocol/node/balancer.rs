//! SWARM's load balancer as its public code behaves (repository
//! yandex-research/swarm), used by the `swarm` policy:
//!
//! - the next task goes to the peer with the smallest key, the cumulative
//!   expected time of every task it was ever given; its key then grows by
//!   the task's expected time, the task size over the peer's measured
//!   throughput (`swarm/pipeline/src/moe/client/balancer.py`,
//!   `ExpertBalancer.use_another_expert`). Keys only grow, so each peer
//!   gets a share of the traffic proportional to its throughput, whatever
//!   its distance;
//! - a peer enters at the smallest key then in the heap, so that it is
//!   tried soon (`balancer.py`, `_add_expert`);
//! - the throughput is a bias-corrected EMA (alpha 0.1) of the seconds per
//!   task of whole calls, end to end (transfer, queue and compute;
//!   `swarm/pipeline/src/optim/performance_ema.py`, `update_threadsafe`);
//!   before the first measurement a task is expected to take
//!   `initial_throughput * task_size` (1 s per microbatch);
//! - a peer whose call failed is banned until its DHT record expires, and
//!   its key and throughput are forgotten (`balancer.py`, `_ban_expert`;
//!   records live 300 s, `swarm/pipeline/src/moe/server/dht_handler.py`,
//!   `declare_experts`);
//! - call timeouts are fixed: 30 s forward, 2.5 times that (75 s) backward
//!   (`swarm/train_pipeline.py`, `TIMEOUT` and `BACKWARD_TIMEOUT`).
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

/// One peer's entry in the balancer: its key in the heap and its measured
/// time per task.
#[derive(Clone, Debug, Default)]
pub(super) struct BalancerEntry {
    /// Cumulative expected seconds of the tasks given to the peer; `None`
    /// until the peer enters the heap (again, after a ban).
    pub(super) load: Option<f64>,
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

    /// Banned: out of the heap, its throughput forgotten.
    fn forget(&mut self) {
        *self = BalancerEntry::default();
    }
}

impl Node {
    /// SWARM: the candidate with the smallest cumulative expected work;
    /// its key grows by the expected time of this task.
    pub(super) fn next_hop_by_cumulative_work(
        &mut self,
        exclude: &[NodeId],
    ) -> Option<(NodeId, Option<Label>)> {
        let cands: Vec<NodeId> = self
            .next_candidates()
            .into_iter()
            .filter(|c| !exclude.contains(c))
            .collect();
        let base = cands
            .iter()
            .filter_map(|c| self.peers[c].balancer.load)
            .reduce(f64::min)
            .unwrap_or(0.0);
        for &c in &cands {
            if self.peers[&c].balancer.load.is_none() {
                let tie = self.rng.next_f64();
                let e = &mut self.peers.get_mut(&c).unwrap().balancer;
                e.load = Some(base);
                e.tie = tie;
            }
        }
        let key = |e: &BalancerEntry| (e.load.unwrap_or(base), e.tie);
        let best = cands.into_iter().min_by(|a, b| {
            let (ka, kb) = (key(&self.peers[a].balancer), key(&self.peers[b].balancer));
            ka.partial_cmp(&kb).unwrap_or(std::cmp::Ordering::Equal)
        })?;
        let tie = self.rng.next_f64();
        let e = &mut self.peers.get_mut(&best).unwrap().balancer;
        e.load = Some(e.load.unwrap_or(base) + e.secs_per_task());
        e.tie = tie;
        Some((best, None))
    }

    /// A hop to `p` failed (no ack in time, or reported crashed): SWARM
    /// bans it for the lifetime of its DHT record and forgets its entry;
    /// the other policies suspect it for a few ticks.
    pub(super) fn peer_failed(&mut self, p: NodeId) {
        if !self.policy().balances_cumulative_work() {
            self.peer_suspect(p);
            return;
        }
        let until = self.now + BAN;
        if let Some(x) = self.peers.get_mut(&p) {
            x.banned_until = x.banned_until.max(until);
            x.balancer.forget();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// Relay 10 of stage 2 with next-stage peers 30, 31, 32 measured at 1,
    /// 2 and 4 microbatches per second.
    fn three_peers() -> Node {
        let mut n = started(Policy::Swarm, 10, 2, &[], &[(30, 3), (31, 3), (32, 3)]);
        for (p, thr) in [(30, 1.0), (31, 2.0), (32, 4.0)] {
            n.peers.get_mut(&p).unwrap().balancer.observe(1.0 / thr);
        }
        n
    }

    fn shares(n: &mut Node, tasks: usize) -> [usize; 3] {
        let mut count = [0; 3];
        for _ in 0..tasks {
            let (p, _) = n.next_hop_by_cumulative_work(&[]).unwrap();
            count[(p - 30) as usize] += 1;
        }
        count
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

    /// Distance does not matter: a far fast peer gets the same share as a
    /// near one of the same throughput.
    #[test]
    fn the_heap_ignores_distance() {
        let mut n = three_peers();
        n.peers.get_mut(&31).unwrap().lat = Some(0.2);
        n.peers.get_mut(&32).unwrap().lat = Some(0.001);
        n.peers.get_mut(&32).unwrap().balancer = BalancerEntry::default();
        n.peers.get_mut(&32).unwrap().balancer.observe(0.5);
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
        let (p, _) = n.next_hop_by_cumulative_work(&[]).unwrap();
        let min_other = [30, 31, 32]
            .iter()
            .map(|c| n.peers[c].balancer.load.unwrap())
            .reduce(f64::min)
            .unwrap();
        assert!(p == 33 || n.peers[&33].balancer.load.unwrap() <= min_other + 1e-9);
    }

    /// A failed peer is not chosen until its ban (300 s) expires; then it
    /// comes back with its throughput forgotten, at the smallest key.
    #[test]
    fn a_failed_peer_is_banned_until_its_record_expires() {
        let mut n = three_peers();
        let start = n.now;
        n.peer_failed(32);
        assert_eq!(n.peers[&32].balancer.updates, 0);
        let c = shares(&mut n, 30);
        assert_eq!(c[2], 0, "{c:?}");
        n.now = start + BAN - SEC;
        assert_eq!(shares(&mut n, 10)[2], 0);
        n.now = start + BAN;
        assert_eq!(n.next_hop_by_cumulative_work(&[]).unwrap().0, 32);
        assert_eq!(n.peers[&32].balancer.secs_per_task(), INITIAL_SECS_PER_TASK);
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
}
