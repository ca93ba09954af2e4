//! Copies of the relay stages' states that a data holder keeps, so that a
//! stage's trained state outlives its nodes: after every
//! `Config::keep_states_every` of its own updates a holder asks one member
//! of each relay stage it keeps that round (one holder per stage and round,
//! in turn: [`Copies::keeps`]) for its state (`Msg::CopyRequest`), which the member
//! exports and sends like a joiner's download (chunked, so training
//! frames go between its chunks), and the holder keeps the newest verified
//! copy of each stage in memory.
//!
//! Bounded: one copy per stage is kept (as large as the stage's state), one
//! request per member is awaited, and a request unanswered for
//! [`ASK_EXPIRY`] is forgotten (the member died, or was busy serving
//! joiners and dropped it: the next round asks again).
use super::background::Background;
use crate::engine::Frame;
use crate::protocol::{NodeId, Stage};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A request unanswered this long is given up.
pub(super) const ASK_EXPIRY: Duration = Duration::from_secs(180);

/// A stage's state as a holder keeps it.
#[derive(Clone, Debug)]
pub struct KeptState {
    /// (iteration whose update it includes last, weights digest), as the
    /// member that sent it held it.
    pub version: (u32, u64),
    pub from: NodeId,
    /// The state as the stage's trainer exported it.
    pub state: std::sync::Arc<Vec<u8>>,
}

#[derive(Debug, Default)]
pub(super) struct Copies {
    /// Per member asked: its stage, and when.
    asked: HashMap<NodeId, (Stage, Instant)>,
}

impl Copies {
    /// Whether a holder that applied the update of `iteration` asks for
    /// copies now (after every `every` updates; never for 0).
    pub(super) fn due(iteration: u32, every: u32) -> bool {
        every > 0 && (iteration + 1) % every == 0
    }

    /// Whether the holder ranked `rank` among `holders` keeps `stage`'s
    /// copy at `round`: one holder per stage and round, in turn, so that
    /// each stage's newest copy is on one holder and the ones before on
    /// the others, and a stage's members serve one copy a round however
    /// many holders there are (every holder asking every stage cost the
    /// stage `holders` states a round).
    pub(super) fn keeps(stage: Stage, rank: usize, holders: usize, round: u32) -> bool {
        let h = holders.max(1);
        (stage as usize + round as usize) % h == rank % h
    }

    /// Of `members` (a relay stage's, sorted), the one a holder ranked
    /// `rank` among the holders asks at `round`: the holders spread their
    /// requests over the members, and each round asks the next one.
    pub(super) fn pick(members: &[NodeId], rank: usize, round: u32) -> Option<NodeId> {
        if members.is_empty() {
            return None;
        }
        Some(members[(rank + round as usize) % members.len()])
    }

    /// Whether `member` may be asked now (no request of ours to it is
    /// awaited, or the one awaited expired).
    pub(super) fn may_ask(&mut self, member: NodeId, now: Instant) -> bool {
        self.asked
            .retain(|_, (_, at)| now.duration_since(*at) < ASK_EXPIRY);
        !self.asked.contains_key(&member)
    }

    /// A copy of `stage` was asked of `member`.
    pub(super) fn asked(&mut self, member: NodeId, stage: Stage, now: Instant) {
        self.asked.insert(member, (stage, now));
    }

    /// Whether a copy is awaited from `member`.
    pub(super) fn awaits(&self, member: NodeId) -> bool {
        self.asked.contains_key(&member)
    }

    /// A copy came from `member`: the stage asked and when, if awaited.
    pub(super) fn answered(&mut self, member: NodeId) -> Option<(Stage, Instant)> {
        self.asked.remove(&member)
    }

    /// `member` is gone: its copy will not come.
    pub(super) fn gone(&mut self, member: NodeId) {
        self.asked.remove(&member);
    }
}

/// A copy being checked: whose, of which stage and version, asked when.
#[derive(Clone, Copy, Debug)]
pub(super) struct CopyHead {
    pub from: NodeId,
    pub stage: Stage,
    pub version: (u32, u64),
    pub asked: Instant,
}

/// A copy checked: the state, or why it was refused.
pub(super) struct Verified {
    pub head: CopyHead,
    pub state: Result<Arc<Vec<u8>>, String>,
}

/// Checks copies on threads of their own (`background.rs`), and the driver
/// collects them: the SHA-256 over a whole state and its copy out of the
/// frame pool (85 MB for llama-small) took the driver of a holder on a busy
/// machine past the suspicion time, and the holder fenced itself as if it
/// had been paused.
#[derive(Default)]
pub(super) struct Verifier(Background<Verified>);

impl Verifier {
    /// Checks `data` (`announced` bytes: the state, then its SHA-256) on a
    /// thread of its own.
    pub(super) fn start(&self, head: CopyHead, data: Frame, announced: u64) {
        self.0.start("gwtf-copy-check", move || {
            let state = super::serving::verify_state(data, announced)
                .map(|f| Arc::new(f.payload().to_vec()));
            Verified { head, state }
        });
    }

    /// The copies checked since the last call.
    pub(super) fn done(&self) -> Vec<Verified> {
        self.0.done()
    }
}

/// How a node says it restored emptied `stage` from holder `from`'s copy
/// of `iteration`, standing for the weights after the update of `applied`.
pub(crate) fn restored_line(stage: Stage, from: NodeId, iteration: u32, applied: u32) -> String {
    super::event_log::restored_sentence(stage.into(), from.into(), iteration.into(), applied.into())
}

/// Keeps `copy` of `stage` in `kept` unless the one kept is newer:
/// whether kept.
pub(super) fn keep(kept: &mut BTreeMap<Stage, KeptState>, stage: Stage, copy: KeptState) -> bool {
    match kept.get(&stage) {
        Some(k) if k.version.0 > copy.version.0 => false,
        _ => {
            kept.insert(stage, copy);
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(iteration: u32, from: NodeId) -> KeptState {
        KeptState {
            version: (iteration, 7),
            from,
            state: std::sync::Arc::new(vec![1, 2, 3]),
        }
    }

    #[test]
    fn rounds_come_every_k_updates_and_spread_over_members() {
        let due: Vec<u32> = (0..12).filter(|&i| Copies::due(i, 5)).collect();
        assert_eq!(due, [4, 9]);
        assert!(!(0..100).any(|i| Copies::due(i, 0)));
        let m = [11, 12, 13];
        assert_eq!(Copies::pick(&m, 0, 0), Some(11));
        assert_eq!(Copies::pick(&m, 1, 0), Some(12));
        assert_eq!(Copies::pick(&m, 0, 4), Some(12));
        assert_eq!(Copies::pick(&[], 0, 4), None);
    }

    /// Each round, each stage is kept by exactly one holder, and over as
    /// many rounds as holders, by each of them once.
    #[test]
    fn each_stage_is_kept_by_one_holder_a_round_in_turn() {
        for holders in 1..5usize {
            for stage in 1..4 {
                let mut by = Vec::new();
                for round in 0..holders as u32 {
                    let k: Vec<usize> = (0..holders)
                        .filter(|&r| Copies::keeps(stage, r, holders, round))
                        .collect();
                    assert_eq!(k.len(), 1, "stage {stage} round {round}: {k:?}");
                    by.push(k[0]);
                }
                by.sort();
                assert_eq!(by, (0..holders).collect::<Vec<_>>());
            }
        }
        assert!(
            Copies::keeps(2, 0, 0, 7),
            "a holder alone keeps every stage"
        );
    }

    #[test]
    fn one_request_per_member_awaited_until_answered_gone_or_expired() {
        let mut c = Copies::default();
        let t0 = Instant::now();
        assert!(c.may_ask(11, t0));
        c.asked(11, 1, t0);
        assert!(c.awaits(11) && !c.may_ask(11, t0));
        assert_eq!(c.answered(11), Some((1, t0)));
        assert!(!c.awaits(11) && c.answered(11).is_none());
        c.asked(12, 2, t0);
        c.gone(12);
        assert!(!c.awaits(12));
        c.asked(13, 2, t0);
        assert!(
            c.may_ask(13, t0 + ASK_EXPIRY),
            "an expired request still holds"
        );
        assert!(!c.awaits(13));
    }

    #[test]
    fn the_newest_copy_of_a_stage_is_kept() {
        let mut kept = BTreeMap::new();
        assert!(keep(&mut kept, 1, copy(4, 11)));
        assert!(keep(&mut kept, 1, copy(9, 12)));
        assert!(!keep(&mut kept, 1, copy(4, 13)));
        assert_eq!(kept.get(&1).map(|k| (k.version.0, k.from)), Some((9, 12)));
        assert!(!kept.contains_key(&2));
    }

    /// A copy is checked on a thread of its own: a whole one is kept, one
    /// changed on the way or cut short is refused with why.
    #[test]
    fn copies_are_checked_off_the_driver() {
        use crate::engine::{NodeOptions, Transport};
        let t = Duration::from_secs(10);
        let net = Transport::new(NodeOptions {
            max_payload: 1 << 16,
            pool_bytes: 1 << 20,
            swarm_key: b"copies-unit-test-key".to_vec(),
            ..NodeOptions::default()
        })
        .unwrap();
        let state = b"a stage's state, exported".to_vec();
        let sealed = || {
            let f = net.alloc_copy(&state, t).unwrap();
            let d = super::super::serving::state_digest(&f);
            super::super::serving::append_digest(f, d, |len| net.alloc(len, t)).unwrap()
        };
        let head = |from| CopyHead {
            from,
            stage: 2,
            version: (9, 7),
            asked: Instant::now(),
        };
        let v = Verifier::default();
        let good = sealed();
        let n = good.len() as u64;
        v.start(head(1), good, n);
        let mut bad = sealed();
        bad.payload_mut()[0] ^= 1;
        v.start(head(2), bad, n);
        v.start(head(3), sealed(), n + 1);
        let deadline = Instant::now() + t;
        let mut got = Vec::new();
        while got.len() < 3 {
            assert!(Instant::now() < deadline, "the checks never came back");
            got.extend(v.done());
            std::thread::sleep(Duration::from_millis(5));
        }
        got.sort_by_key(|c| c.head.from);
        assert_eq!(got[0].state.as_deref(), Ok(&state));
        assert!(matches!(&got[1].state, Err(e) if e.contains("SHA-256")));
        assert!(matches!(&got[2].state, Err(e) if e.contains("cut off")));
        assert_eq!((got[0].head.stage, got[0].head.version), (2, (9, 7)));
    }
}
