//! The stage all-reduces running in the simulator, followed member by
//! member, so that a member's loss does to the others what it does to the
//! runtime's ring ([`super::allreduce::RingLoss`]): nothing once its
//! successor finished, a bypass (the survivors finish a little later, the
//! result with its contributions) in the all-gather half, an abort before.
//! The aggregate tasks of a ring that aborted fail (`Input::TaskFailed`),
//! each when its member hears of it: the successor when its connection with
//! the lost member breaks, the others one link later (the successor's
//! abort), those that start later at once (the abort waits for them).
use std::collections::BTreeMap;

use super::allreduce::{LossEffect, RingLoss};
use crate::protocol::{secs, to_secs, NodeId, Stage, TaskId, Time};

/// A commit's all-reduce: (stage, iteration, epoch).
pub(super) type RingKey = (Stage, u32, u64);

/// One member's aggregate task.
struct Run {
    task: TaskId,
    start: Time,
    end: Time,
}

struct Ring {
    /// The commit's members, in ring order.
    members: Vec<NodeId>,
    /// Seconds per step (the ring's slowest link) and bytes per chunk.
    step: f64,
    chunk: f64,
    runs: BTreeMap<NodeId, Run>,
    bypassed: Option<NodeId>,
    aborted: bool,
    /// What the bypass added to every member's time.
    delay: Time,
}

/// What a loss makes of a member's aggregate task.
#[derive(Debug, PartialEq)]
pub(super) enum Change {
    /// It ends at `at` now (an `AggDone` for its old end is stale).
    EndsAt {
        node: NodeId,
        task: TaskId,
        at: Time,
        ring: RingKey,
    },
    /// It fails at `at`.
    FailsAt {
        node: NodeId,
        task: TaskId,
        at: Time,
    },
}

/// The network as a loss needs it: one-way latency between two nodes (s),
/// and the seconds to send a chunk of `bytes` from one to the other while
/// sending another to a second neighbour (the all-reduce goes both ways).
pub(super) trait Wire {
    fn latency(&self, a: NodeId, b: NodeId) -> f64;
    fn send_secs(&self, a: NodeId, b: NodeId, bytes: f64) -> f64;
}

#[derive(Default)]
pub(super) struct Rings {
    map: BTreeMap<RingKey, Ring>,
    pub(super) bypassed: u64,
    pub(super) aborted: u64,
}

/// Rings kept at most (those of applied iterations go first).
const MAX_RINGS: usize = 4096;

impl Rings {
    /// `node` starts its part `task` of ring `key` (`members` in ring
    /// order, steps of `step` s, chunks of `chunk` bytes) at `now`, for
    /// `dur` s: when it ends, or `None` when the ring aborted already
    /// (the task fails at once).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        &mut self,
        key: RingKey,
        members: &[NodeId],
        step: f64,
        chunk: f64,
        node: NodeId,
        task: TaskId,
        now: Time,
        dur: f64,
    ) -> Option<Time> {
        if self.map.len() >= MAX_RINGS && !self.map.contains_key(&key) {
            self.map.pop_first();
        }
        let ring = self.map.entry(key).or_insert_with(|| Ring {
            members: members.to_vec(),
            step,
            chunk,
            runs: BTreeMap::new(),
            bypassed: None,
            aborted: false,
            delay: 0,
        });
        if ring.aborted {
            return None;
        }
        let end = now + secs(dur) + ring.delay;
        ring.runs.insert(
            node,
            Run {
                task,
                start: now,
                end,
            },
        );
        Some(end)
    }

    /// Whether `node` started its part of ring `key`.
    pub(super) fn started(&self, key: &RingKey, node: NodeId) -> bool {
        self.map
            .get(key)
            .is_some_and(|r| r.runs.contains_key(&node))
    }

    /// Whether `node`'s task `task` of ring `key` still ends at `at` (a
    /// bypass moved it, an abort failed it).
    pub(super) fn ends_at(&self, key: &RingKey, node: NodeId, task: TaskId, at: Time) -> bool {
        self.map
            .get(key)
            .and_then(|r| r.runs.get(&node))
            .is_none_or(|r| r.task != task || r.end == at)
    }

    /// Rings of iterations up to `iter` are over (the iteration is final:
    /// every stage applied it).
    pub(super) fn forget_upto(&mut self, iter: u32) {
        self.map.retain(|k, _| k.1 > iter);
    }

    /// `v` is gone at `now`: what that does to the aggregate tasks of the
    /// rings it is a member of. `alive` tells the survivors.
    pub(super) fn lose(
        &mut self,
        v: NodeId,
        now: Time,
        alive: &dyn Fn(NodeId) -> bool,
        wire: &dyn Wire,
    ) -> Vec<Change> {
        let mut changes = Vec::new();
        for (&key, ring) in self.map.iter_mut() {
            let Some(i) = ring.members.iter().position(|&m| m == v) else {
                continue;
            };
            if ring.aborted || ring.bypassed == Some(v) {
                continue;
            }
            let n = ring.members.len();
            let (p, q) = (ring.members[(i + n - 1) % n], ring.members[(i + 1) % n]);
            // A member (the lost one too) that has not started cannot have
            // passed the reduce-scatter, so neither has anyone.
            let all_started = ring
                .members
                .iter()
                .all(|&m| (m != v && !alive(m)) || ring.runs.contains_key(&m));
            let running: Vec<(NodeId, TaskId)> = ring
                .runs
                .iter()
                .filter(|(&m, r)| m != v && alive(m) && r.end > now)
                .map(|(&m, r)| (m, r.task))
                .collect();
            // Both directions lose `v` at once: around the ring `q` is its
            // successor, the way back `p`; the loss is bypassed only where
            // both directions can bypass it, and as late as the later.
            let since = |m: NodeId| {
                ring.runs
                    .get(&m)
                    .filter(|_| all_started && alive(m))
                    .map(|r| to_secs(now.saturating_sub(r.start)))
            };
            let successor_since = since(q).zip(since(p)).map(|(a, b)| a.min(b));
            let notice = wire.latency(v, q).max(wire.latency(v, p));
            let loss = RingLoss {
                n,
                step: ring.step,
                successor_since,
                bypassed_before: ring.bypassed.is_some(),
                notice,
                resume: wire.latency(q, p).max(wire.latency(p, q)),
                bypass_step: (wire.send_secs(p, q, ring.chunk))
                    .max(wire.send_secs(q, p, ring.chunk)),
            };
            let effect = if running.is_empty() && all_started {
                LossEffect::Nothing
            } else {
                loss.effect()
            };
            match effect {
                LossEffect::Nothing => {
                    ring.bypassed.get_or_insert(v);
                }
                LossEffect::Bypass { delay } => {
                    self.bypassed += 1;
                    ring.bypassed = Some(v);
                    let d = secs(delay);
                    ring.delay += d;
                    for (m, task) in running {
                        let r = ring.runs.get_mut(&m).expect("running");
                        r.end += d;
                        changes.push(Change::EndsAt {
                            node: m,
                            task,
                            at: r.end,
                            ring: key,
                        });
                    }
                }
                LossEffect::Abort => {
                    self.aborted += 1;
                    ring.aborted = true;
                    for (m, task) in running {
                        let heard = if m == q || m == p {
                            notice
                        } else {
                            notice + wire.latency(q, m).min(wire.latency(p, m))
                        };
                        let r = ring.runs.get_mut(&m).expect("running");
                        r.end = Time::MAX;
                        changes.push(Change::FailsAt {
                            node: m,
                            task,
                            at: now + secs(heard).max(1),
                        });
                    }
                }
            }
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::SEC;

    /// Every link 0.01 s one way; a chunk takes 1 s on any link.
    struct Flat;
    impl Wire for Flat {
        fn latency(&self, _: NodeId, _: NodeId) -> f64 {
            0.01
        }
        fn send_secs(&self, _: NodeId, _: NodeId, _: f64) -> f64 {
            1.0
        }
    }

    const RING: [NodeId; 4] = [10, 11, 12, 13];
    const KEY: RingKey = (1, 0, 7);

    /// The ring 10 -> 11 -> 12 -> 13 (1 s steps, 6 s), each member of
    /// `starts` started at its time (s), its task numbered as the member.
    fn started(starts: &[(NodeId, Time)]) -> Rings {
        let mut rings = Rings::default();
        for &(m, at) in starts {
            let end = rings.start(KEY, &RING, 1.0, 4.0, m, m as TaskId, at * SEC, 6.0);
            assert_eq!(end, Some((at + 6) * SEC));
        }
        rings
    }

    /// All four started at 0.
    fn ring4() -> Rings {
        started(&RING.map(|m| (m, 0)))
    }

    #[test]
    fn a_loss_in_the_reduce_scatter_fails_every_survivor() {
        let mut rings = ring4();
        let alive = |m: NodeId| m != 11;
        let ch = rings.lose(11, 2 * SEC, &alive, &Flat);
        // Its successors hear first, each way round (12, and 10 on the
        // way back); 13 one link later.
        assert_eq!(ch.len(), 3);
        for c in &ch {
            let Change::FailsAt { node, at, .. } = c else {
                panic!("{c:?}")
            };
            let want = if *node == 13 { 0.02 } else { 0.01 };
            assert_eq!(*at, 2 * SEC + secs(want), "{node}");
            assert!(!rings.ends_at(&KEY, *node, *node as TaskId, 6 * SEC));
        }
        assert_eq!((rings.bypassed, rings.aborted), (0, 1));
        // A member that starts late fails at once; a second loss changes
        // nothing more.
        assert_eq!(rings.start(KEY, &[], 1.0, 4.0, 12, 9, 3 * SEC, 6.0), None);
        assert!(rings
            .lose(13, 3 * SEC, &|m| m != 11 && m != 13, &Flat)
            .is_empty());
    }

    #[test]
    fn a_loss_in_the_all_gather_half_delays_the_survivors() {
        let mut rings = ring4();
        let ch = rings.lose(11, 4 * SEC + SEC / 2, &|m| m != 11, &Flat);
        // 4 steps received at 4.5 s; 2 left from 4.52 s on: end at 6.52 s.
        assert_eq!(ch.len(), 3);
        for c in &ch {
            let Change::EndsAt { node, task, at, .. } = c else {
                panic!("{c:?}")
            };
            assert_eq!(*at, 6 * SEC + secs(0.52), "{node}");
            assert!(rings.ends_at(&KEY, *node, *task, *at));
            assert!(!rings.ends_at(&KEY, *node, *task, 6 * SEC));
        }
        assert_eq!((rings.bypassed, rings.aborted), (1, 0));
        // A second loss aborts.
        let ch = rings.lose(13, 5 * SEC, &|m| m != 11 && m != 13, &Flat);
        assert_eq!(ch.len(), 2);
        assert!(ch.iter().all(|c| matches!(c, Change::FailsAt { .. })));
    }

    #[test]
    fn a_loss_after_the_successor_finished_changes_nothing() {
        // 11's successors each way round, 12 and 10, started first and are
        // done at 6 s; 13 started later and still runs, but needs nothing
        // of 11 any more.
        let mut rings = started(&[(10, 0), (11, 2), (12, 0), (13, 2)]);
        assert!(rings.lose(11, 7 * SEC, &|m| m != 11, &Flat).is_empty());
        assert_eq!((rings.bypassed, rings.aborted), (0, 0));
        // With the way back's successor (10) still running, the loss is
        // bypassed, not nothing.
        let mut rings = started(&[(10, 2), (11, 2), (12, 0), (13, 2)]);
        let ch = rings.lose(11, 7 * SEC, &|m| m != 11, &Flat);
        assert!(!ch.is_empty() && ch.iter().all(|c| matches!(c, Change::EndsAt { .. })));
        assert_eq!((rings.bypassed, rings.aborted), (1, 0));
        // A member not started when the loss comes: the ring cannot have
        // passed its reduce-scatter.
        let mut rings = started(&[(10, 0), (11, 0), (12, 0)]);
        let ch = rings.lose(11, 5 * SEC, &|m| m != 11, &Flat);
        assert_eq!(rings.aborted, 1);
        assert_eq!(ch.len(), 2);
        // Nor when the lost member itself never started.
        let mut rings = started(&[(10, 0), (12, 0), (13, 0)]);
        assert_eq!(rings.lose(11, 5 * SEC, &|m| m != 11, &Flat).len(), 3);
        assert_eq!(rings.aborted, 1);
    }
}
