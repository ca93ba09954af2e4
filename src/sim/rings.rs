//! The stage all-reduces running in the simulator, followed member by
//! member, so that a member's loss does to the others what it does to the
//! runtime's all-reduce.
//!
//! A ring ([`super::allreduce::RingLoss`]): nothing once its successors
//! finished, a bypass (the survivors finish a little later, the result
//! with its contributions) in the all-gather half, an abort before. The
//! aggregate tasks of a ring that aborted fail (`Input::TaskFailed`), each
//! when its member hears of it: the successor when its connection with the
//! lost member breaks, the others one link later (the successor's abort),
//! those that start later at once (the abort waits for them).
//!
//! A butterfly (`crate::swarm::butterfly`): nothing once every survivor
//! still running holds what it needed of the lost member (its slice of the
//! survivor's part, and its reduced part); otherwise an abort, heard by a
//! survivor that lacks something when its connection with the lost member
//! breaks, by the others one link later (the first such survivor's abort).
//! A survivor that ended already keeps its result (the coordinator sees
//! the others fail and commits again).
use std::collections::BTreeMap;

use super::allreduce::{butterfly_lacks, hierarchy_owes, LossEffect, RingLoss, STREAMS_PER_MEMBER};
use crate::protocol::{secs, to_secs, NodeId, Stage, TaskId, Time};

/// A commit's all-reduce: (stage, iteration, epoch).
pub(super) type RingKey = (Stage, u32, u64);

/// One member's aggregate task.
struct Run {
    task: TaskId,
    start: Time,
    end: Time,
}

/// A commit's all-reduce algorithm with its sizes, as a loss needs them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Shape {
    /// Around the ring both ways: seconds per step (the ring's slowest
    /// link) and bytes per chunk.
    Ring { step: f64, chunk: f64 },
    /// The butterfly: bytes per part.
    Butterfly { part: f64 },
    /// The hierarchy (`crate::swarm::hierarchy`): seconds of its group
    /// phase.
    Hierarchy { groups: f64 },
}

struct Ring {
    /// The commit's members, in its order.
    members: Vec<NodeId>,
    shape: Shape,
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
/// the sender sends `streams` such chunks at once (two in a ring, one to
/// each neighbour; `n - 1` in a butterfly).
pub(super) trait Wire {
    fn latency(&self, a: NodeId, b: NodeId) -> f64;
    fn send_secs(&self, a: NodeId, b: NodeId, bytes: f64, streams: f64) -> f64;
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
    /// `node` starts its part `task` of all-reduce `key` (`members` in the
    /// commit's order, of the `shape` worked out when the all-reduce is
    /// new) at `now`, for `dur` s: when it ends, or
    /// `None` when the all-reduce aborted already (the task fails at once).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        &mut self,
        key: RingKey,
        members: &[NodeId],
        shape: impl FnOnce() -> Shape,
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
            shape: shape(),
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
            let lacking = match ring.shape {
                Shape::Ring { .. } => None,
                Shape::Hierarchy { groups } => Some(hierarchy_lacking(ring, i, groups, now, alive)),
                Shape::Butterfly { part } => {
                    Some(butterfly_lacking(ring, v, part, now, alive, wire))
                }
            };
            // The butterfly and the hierarchy: nothing, or an abort.
            if let Some(lacking) = lacking {
                if lacking.is_empty() {
                    ring.bypassed.get_or_insert(v);
                } else {
                    self.aborted += 1;
                    ring.aborted = true;
                    abort_running(ring, v, &lacking, now, alive, wire, &mut changes);
                }
                continue;
            }
            let Shape::Ring { step, chunk } = ring.shape else {
                continue;
            };
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
            let loss =
                RingLoss {
                    n,
                    step,
                    successor_since,
                    bypassed_before: ring.bypassed.is_some(),
                    notice,
                    resume: wire.latency(q, p).max(wire.latency(p, q)),
                    bypass_step: (wire.send_secs(p, q, chunk, STREAMS_PER_MEMBER))
                        .max(wire.send_secs(q, p, chunk, STREAMS_PER_MEMBER)),
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

/// The survivors still running butterfly `ring` that lack something of
/// `v`, lost at `now`: its slice of their part (sent when `v` started, all
/// `n - 1` at once) or its reduced part (sent once `v` held every slice of
/// its own: the slowest of the other members' transfers from their
/// starts; never, while a member has not started).
fn butterfly_lacking(
    ring: &Ring,
    v: NodeId,
    part: f64,
    now: Time,
    alive: &dyn Fn(NodeId) -> bool,
    wire: &dyn Wire,
) -> Vec<NodeId> {
    let streams = ring.members.len().saturating_sub(1) as f64;
    let started = |m: NodeId| ring.runs.get(&m).map(|r| to_secs(r.start));
    let sent_v = started(v);
    let reduced_v = (ring.members.iter().filter(|&&a| a != v))
        .map(|&a| started(a).map(|s| s + wire.send_secs(a, v, part, streams)))
        .try_fold(sent_v.unwrap_or(f64::INFINITY), |acc, t| {
            t.map(|t| acc.max(t))
        })
        .unwrap_or(f64::INFINITY);
    let t = to_secs(now);
    (ring.runs.iter())
        .filter(|(&m, r)| m != v && alive(m) && r.end > now)
        .filter(|(&m, _)| {
            let send = wire.send_secs(v, m, part, streams);
            let slice = sent_v.map_or(f64::INFINITY, |s| s + send);
            butterfly_lacks(slice <= t, reduced_v + send <= t)
        })
        .map(|(&m, _)| m)
        .collect()
}

/// The survivors still running hierarchy `ring` that `v` (member `i`),
/// lost at `now`, leaves lacking: none once `v` owes nothing
/// ([`hierarchy_owes`]), which is after its group's butterfly (`groups` s
/// from its start) for a member outside the columns, and once it and its
/// group and column ended for a column member (it sends its part of the
/// total last); otherwise the running members of its
/// group and its column (the others hear of it through their aborts). A
/// member that has not started owes everything.
fn hierarchy_lacking(
    ring: &Ring,
    i: usize,
    groups: f64,
    now: Time,
    alive: &dyn Fn(NodeId) -> bool,
) -> Vec<NodeId> {
    let n = ring.members.len();
    let parts = crate::swarm::hierarchy::groups(n, super::allreduce::BUTTERFLY_MAX_MEMBERS);
    let k = parts.iter().map(|r| r.len()).min().unwrap_or(1);
    let place = |j: usize| {
        let g = parts.partition_point(|r| r.end <= j);
        (g, j - parts[g].start)
    };
    let (g, pos) = place(i);
    let v = ring.members[i];
    let running: Vec<(usize, NodeId)> = (ring.members.iter().enumerate())
        .filter(|(_, m)| **m != v && alive(**m))
        .filter(|(_, m)| ring.runs.get(m).is_none_or(|r| r.end > now))
        .map(|(j, m)| (j, *m))
        .collect();
    let near: Vec<NodeId> = (running.iter())
        .filter(|(j, _)| {
            let (gj, pj) = place(*j);
            gj == g || (pj == pos && pos < k)
        })
        .map(|(_, m)| *m)
        .collect();
    // What it sent arrived once it ended and those who wait for it (its
    // group and its column) ended too.
    let owes = ring.runs.get(&v).is_none_or(|r| {
        let group_over = now >= r.start + secs(groups);
        hierarchy_owes(pos < k, group_over, now >= r.end && near.is_empty())
    });
    if !owes || running.is_empty() {
        return Vec::new();
    }
    if near.is_empty() {
        running.into_iter().map(|(_, m)| m).collect()
    } else {
        near
    }
}

/// Fails the aggregate tasks of `ring`'s running survivors after `v`'s
/// loss: those in `lacking` when they notice it, the others one link
/// after the first of them can tell them.
fn abort_running(
    ring: &mut Ring,
    v: NodeId,
    lacking: &[NodeId],
    now: Time,
    alive: &dyn Fn(NodeId) -> bool,
    wire: &dyn Wire,
    changes: &mut Vec<Change>,
) {
    for (&m, r) in ring.runs.iter_mut() {
        if m == v || !alive(m) || r.end <= now {
            continue;
        }
        let heard = if lacking.contains(&m) {
            wire.latency(v, m)
        } else {
            (lacking.iter())
                .map(|&l| wire.latency(v, l) + wire.latency(l, m))
                .fold(f64::INFINITY, f64::min)
        };
        r.end = Time::MAX;
        changes.push(Change::FailsAt {
            node: m,
            task: r.task,
            at: now + secs(heard).max(1),
        });
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
        fn send_secs(&self, _: NodeId, _: NodeId, _: f64, _: f64) -> f64 {
            1.0
        }
    }

    const RING: [NodeId; 4] = [10, 11, 12, 13];
    const KEY: RingKey = (1, 0, 7);
    const RING_SHAPE: Shape = Shape::Ring {
        step: 1.0,
        chunk: 4.0,
    };

    /// The ring 10 -> 11 -> 12 -> 13 (1 s steps, 6 s), each member of
    /// `starts` started at its time (s), its task numbered as the member.
    fn started(starts: &[(NodeId, Time)]) -> Rings {
        let mut rings = Rings::default();
        for &(m, at) in starts {
            let end = rings.start(KEY, &RING, || RING_SHAPE, m, m as TaskId, at * SEC, 6.0);
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
        assert_eq!(
            rings.start(KEY, &[], || RING_SHAPE, 12, 9, 3 * SEC, 6.0),
            None
        );
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

    /// As [`Flat`], but what 11 sends 13 takes 3 s.
    struct SlowTo13;
    impl Wire for SlowTo13 {
        fn latency(&self, _: NodeId, _: NodeId) -> f64 {
            0.01
        }
        fn send_secs(&self, a: NodeId, b: NodeId, _: f64, _: f64) -> f64 {
            if (a, b) == (11, 13) {
                3.0
            } else {
                1.0
            }
        }
    }

    /// The butterfly of 10..=13, each member started at its time (s), for
    /// 4 s, its task numbered as the member.
    fn butterfly(starts: &[(NodeId, Time)]) -> Rings {
        let mut rings = Rings::default();
        for &(m, at) in starts {
            let shape = Shape::Butterfly { part: 4.0 };
            let end = rings.start(KEY, &RING, || shape, m, m as TaskId, at * SEC, 4.0);
            assert_eq!(end, Some((at + 4) * SEC));
        }
        rings
    }

    fn failures(ch: &[Change]) -> BTreeMap<NodeId, Time> {
        (ch.iter())
            .map(|c| match c {
                Change::FailsAt { node, at, .. } => (*node, *at),
                c => panic!("{c:?}"),
            })
            .collect()
    }

    #[test]
    fn a_butterfly_member_lost_before_everyone_holds_its_parts_aborts_it() {
        // Slices sent at 0 arrive at 1 s; 11 holds every slice of its part
        // at 1 s, its reduced part arrives at 2 s. Lost at 0.5 s or 1.5 s:
        // every survivor lacks something and hears of it when its
        // connection with 11 breaks.
        for at in [SEC / 2, 3 * SEC / 2] {
            let mut rings = butterfly(&RING.map(|m| (m, 0)));
            let ch = rings.lose(11, at, &|m| m != 11, &Flat);
            let want: BTreeMap<NodeId, Time> = [10, 12, 13].map(|m| (m, at + secs(0.01))).into();
            assert_eq!(failures(&ch), want);
            assert_eq!((rings.bypassed, rings.aborted), (0, 1));
            assert_eq!(
                rings.start(
                    KEY,
                    &RING,
                    || Shape::Butterfly { part: 4.0 },
                    12,
                    9,
                    at,
                    4.0
                ),
                None
            );
        }
        // Lost at 2.5 s: every survivor holds all it needed of 11.
        let mut rings = butterfly(&RING.map(|m| (m, 0)));
        assert!(rings.lose(11, 5 * SEC / 2, &|m| m != 11, &Flat).is_empty());
        assert_eq!((rings.bypassed, rings.aborted), (0, 0));
        // 13 started at 1 s: its slice reaches 11 at 2 s, 11's reduced part
        // the others at 3 s; lost at 2.5 s, it aborts.
        let mut rings = butterfly(&[(10, 0), (11, 0), (12, 0), (13, 1)]);
        assert_eq!(
            failures(&rings.lose(11, 5 * SEC / 2, &|m| m != 11, &Flat)).len(),
            3
        );
        // A member that has not started: nobody can hold 11's reduced part.
        let mut rings = butterfly(&[(10, 0), (11, 0), (12, 0)]);
        assert_eq!(
            failures(&rings.lose(11, 3 * SEC, &|m| m != 11, &Flat)).len(),
            2
        );
    }

    #[test]
    fn a_butterfly_member_whose_reduced_part_reached_some_aborts_the_others_by_them() {
        // 11's reduced part reaches 10 and 12 at 2 s and 13 at 4 s. Lost at
        // 2.5 s: 13 lacks it and hears at once (2.51 s); 10 and 12 hold
        // everything and hear of the abort from 13 (2.52 s).
        let mut rings = butterfly(&RING.map(|m| (m, 0)));
        let ch = rings.lose(11, 5 * SEC / 2, &|m| m != 11, &SlowTo13);
        let t = |s: f64| 5 * SEC / 2 + secs(s);
        let want: BTreeMap<NodeId, Time> = [(10, t(0.02)), (12, t(0.02)), (13, t(0.01))].into();
        assert_eq!(failures(&ch), want);
        // A member that ended already keeps its result.
        let mut rings = butterfly(&[(10, 0), (11, 0), (12, 0), (13, 0)]);
        rings
            .map
            .get_mut(&KEY)
            .unwrap()
            .runs
            .get_mut(&10)
            .unwrap()
            .end = 2 * SEC;
        let ch = rings.lose(11, 5 * SEC / 2, &|m| m != 11, &SlowTo13);
        assert_eq!(failures(&ch).keys().copied().collect::<Vec<_>>(), [12, 13]);
    }
}
