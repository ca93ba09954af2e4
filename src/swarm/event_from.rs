//! How a running node's events read in the one event schema: the runtime's
//! [`NodeEvent`]s become [`LogEvent`]s here, once, for every reader: the
//! JSON lines of `gwtf node --json`, the C API's event tasks and their
//! text ([`LogEvent::sentence`]), and any Rust embedder that logs.

use super::event_log::{f32_as_written, LogEvent, NodeId};
use super::runtime::NodeEvent;
use crate::protocol::{Event, FenceReason};

impl LogEvent {
    /// `ev`, reported by node `node`, as a line of the schema; `None` for
    /// events the schema does not carry (the protocol's bookkeeping, and a
    /// checkpoint's states, which their writer takes). `tokens_per_mb`
    /// turns an iteration's microbatches into its tokens (0: unknown).
    pub fn of(node: NodeId, ev: &NodeEvent, tokens_per_mb: u64) -> Option<LogEvent> {
        Some(match ev {
            NodeEvent::Protocol(e) => return of_protocol(node, e),
            NodeEvent::Applied {
                stage,
                iteration,
                weights,
                microbatches,
            } => LogEvent::Applied {
                node,
                stage: (*stage).into(),
                iteration: (*iteration).into(),
                weights_sha256: hex(weights),
                microbatches: *microbatches,
            },
            NodeEvent::Iteration {
                iteration,
                loss,
                microbatches,
            } => LogEvent::Iteration {
                node,
                iteration: (*iteration).into(),
                loss: f32_as_written(*loss),
                microbatches: (*microbatches).into(),
                tokens: u64::from(*microbatches).saturating_mul(tokens_per_mb),
            },
            NodeEvent::Checkpoint { .. } => return None,
            NodeEvent::CheckpointDropped { iteration, why } => LogEvent::CheckpointSkipped {
                node,
                iteration: (*iteration).into(),
                why: why.clone(),
            },
            NodeEvent::StageRebuilt {
                stage,
                from,
                applied,
                averaged,
                weights,
            } if *averaged > 0 => LogEvent::StageRebuilt {
                node,
                stage: (*stage).into(),
                from: ids(from),
                applied: applied.map(u64::from),
                averaged: (*averaged).into(),
                weights_sha256: hex(weights),
                source: "checkfree".into(),
                why: "no live node held this stage and no data holder kept a copy of it: it \
                      goes on from the average of its neighbouring stages' weights"
                    .into(),
            },
            NodeEvent::StageRebuilt {
                stage,
                from,
                applied,
                ..
            } => LogEvent::StageRestarted {
                node,
                stage: (*stage).into(),
                applied: applied.map(u64::from),
                source: "initial".into(),
                neighbours: Some(ids(from)),
                why: "no live node held this stage, no data holder kept a copy of it, and its \
                      neighbouring stages' weights do not fit its shapes: it starts again from \
                      the initial weights"
                    .into(),
            },
            NodeEvent::CopyKept {
                stage,
                iteration,
                from,
                bytes,
                ms,
                ..
            } => LogEvent::CopyKept {
                node,
                stage: (*stage).into(),
                iteration: (*iteration).into(),
                from: (*from).into(),
                bytes: *bytes,
                ms: *ms,
            },
            NodeEvent::StateDownloaded {
                from,
                bytes,
                ms,
                bytes_per_s,
                import_ms,
                weights,
                weights_ms,
            } => LogEvent::StateDownload {
                node,
                from: (*from).into(),
                bytes: *bytes,
                ms: *ms,
                bytes_per_s: *bytes_per_s,
                import_ms: *import_ms,
                weights_sha256: hex(weights),
                weights_ms: *weights_ms,
            },
            NodeEvent::PeerLost { peer } => LogEvent::PeerLost {
                node,
                peer: (*peer).into(),
            },
            NodeEvent::ConnectFailed {
                addr,
                attempts,
                reason,
            } => LogEvent::ConnectFailed {
                node,
                addr: addr.to_string(),
                given: None,
                attempts: Some((*attempts).into()),
                reason: reason.clone(),
            },
            NodeEvent::Refused {
                peer,
                reason,
                detail,
            } => LogEvent::Refused {
                node,
                peer: peer.map(u64::from),
                reason: reason.name().into(),
                message: detail.clone(),
            },
            NodeEvent::Error(message) => LogEvent::Error {
                node,
                message: message.clone(),
            },
        })
    }
}

/// The protocol's events that a person or a trainer acts on.
fn of_protocol(node: NodeId, e: &Event) -> Option<LogEvent> {
    Some(match e {
        Event::Active { stage } => LogEvent::Active {
            node,
            stage: (*stage).into(),
        },
        Event::Rerouted { mb, stage } => LogEvent::Recovered {
            node,
            kind: "rerouted".into(),
            stage: (*stage).into(),
            iteration: mb.iter.into(),
            holder: mb.holder.into(),
            index: mb.idx.into(),
        },
        Event::Restarted { mb } => LogEvent::Recovered {
            node,
            kind: "restarted".into(),
            stage: 1,
            iteration: mb.iter.into(),
            holder: mb.holder.into(),
            index: mb.idx.into(),
        },
        Event::StageCommitted {
            stage,
            iter,
            mbs,
            dropped,
        } => LogEvent::Committed {
            node,
            stage: (*stage).into(),
            iteration: (*iter).into(),
            microbatches: mbs.len() as u64,
            dropped: dropped.len() as u64,
            mbs: Some(
                mbs.iter()
                    .map(|(m, by)| [m.holder.into(), m.idx.into(), (*by).into()])
                    .collect(),
            ),
        },
        Event::MbDone { mb, path } => LogEvent::MbDone {
            node,
            holder: mb.holder.into(),
            index: mb.idx.into(),
            iteration: mb.iter.into(),
            path: ids(path),
        },
        Event::Stalled { iter, stage } => LogEvent::Stalled {
            node,
            stage: (*stage).into(),
            iteration: (*iter).into(),
        },
        Event::MemberRemoved { peer } => LogEvent::PeerLost {
            node,
            peer: (*peer).into(),
        },
        Event::StageEmpty { stage } => LogEvent::StageEmpty {
            node,
            stage: (*stage).into(),
            why: "no live node of this stage is known: its microbatches wait until a node \
                  joins it"
                .into(),
        },
        Event::AggregateFailed {
            stage,
            iter,
            member,
        } => LogEvent::AggregateFailed {
            node,
            stage: (*stage).into(),
            iteration: (*iter).into(),
            member: (*member).into(),
            why: "a member's all-reduce ended without the mean: the stage commits again".into(),
        },
        Event::LeftOut { stage, iter, slow } => LogEvent::LeftOut {
            node,
            stage: (*stage).into(),
            iteration: (*iter).into(),
            slow: ids(slow),
            why: "members with no grant behind links far slower than the others' are left out \
                  of the stage's all-reduce: they download the state again"
                .into(),
        },
        Event::StageResumed { stage } => LogEvent::StageResumed {
            node,
            stage: (*stage).into(),
        },
        Event::Fenced {
            reason,
            incarnation,
        } => LogEvent::Fenced {
            node,
            reason: reason.name().into(),
            incarnation: *incarnation,
            gap_ms: match reason {
                FenceReason::Paused { gap } => Some(gap / 1000),
                _ => None,
            },
            why: "this node's view of its stage group may be stale: it stops serving the group \
                  and joins again with a fresh state download"
                .into(),
        },
        Event::StageRestarted { stage, applied } => LogEvent::StageRestarted {
            node,
            stage: (*stage).into(),
            applied: applied.map(u64::from),
            source: "initial".into(),
            neighbours: None,
            why: "no live node held this stage and no data holder kept a copy of it: it starts \
                  again from the initial weights"
                .into(),
        },
        Event::StageRestored {
            stage,
            from,
            iteration,
            applied,
        } => LogEvent::StageRestored {
            node,
            stage: (*stage).into(),
            from: (*from).into(),
            iteration: (*iteration).into(),
            applied: (*applied).into(),
            source: "kept".into(),
            why: "no live node held this stage: it goes on from the freshest copy of its state \
                  a data holder kept"
                .into(),
        },
        Event::StateKept { stage, applied } => LogEvent::StateKept {
            node,
            stage: (*stage).into(),
            applied: (*applied).into(),
            why: "the members left miss the update this node kept at its fence: it serves its \
                  weights again"
                .into(),
        },
        Event::ReplicasDiverged {
            stage,
            iter,
            digests,
        } => LogEvent::ReplicasDiverged {
            node,
            stage: (*stage).into(),
            iteration: (*iter).into(),
            digests: digests.iter().map(|&(m, d)| [m.into(), d]).collect(),
            why: "the stage's replicas hold different weights after the same update: they \
                  must be bit-identical"
                .into(),
        },
        Event::Left => LogEvent::Left { node },
        _ => return None,
    })
}

/// Node ids as the lines carry them.
fn ids(v: &[crate::protocol::NodeId]) -> Vec<NodeId> {
    v.iter().map(|&id| id.into()).collect()
}

/// A digest as the lines carry it: lower-case hex.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::MbId;
    use crate::swarm::event_log::parse_line;
    use std::sync::Arc;

    /// Every event a node reports that the schema carries reads back from
    /// its line as it was made, and says what it is in a sentence with
    /// its numbers in it.
    #[test]
    fn node_events_become_lines_that_read_back_and_sentences_that_say_them() {
        let mb = MbId {
            holder: 0x1f,
            iter: 12,
            idx: 3,
        };
        let cases: Vec<(NodeEvent, &str, &[&str])> = vec![
            (
                NodeEvent::Applied {
                    stage: 2,
                    iteration: 12,
                    weights: [0xab; 32],
                    microbatches: 8,
                },
                "applied",
                &["stage 2", "iteration 12"],
            ),
            (
                NodeEvent::Iteration {
                    iteration: 12,
                    loss: 5.1,
                    microbatches: 8,
                },
                "iteration",
                &["iteration 12", "loss 5.1 ", "8 microbatches"],
            ),
            (
                NodeEvent::Protocol(Event::Rerouted { mb, stage: 3 }),
                "recovered",
                &["1f/12/3", "rerouted at stage 3"],
            ),
            (
                NodeEvent::Protocol(Event::StageCommitted {
                    stage: 1,
                    iter: 12,
                    mbs: Arc::new(vec![(mb, 9)]),
                    dropped: vec![mb],
                }),
                "committed",
                &["stage 1", "iteration 12", "1 microbatches, 1 dropped"],
            ),
            (
                NodeEvent::Protocol(Event::ReplicasDiverged {
                    stage: 2,
                    iter: 12,
                    digests: vec![(5, 1), (6, 2)],
                }),
                "replicas_diverged",
                &["stage 2", "disagree", "iteration 12"],
            ),
            (
                NodeEvent::Protocol(Event::StageRestored {
                    stage: 2,
                    from: 0x1f,
                    iteration: 9,
                    applied: 12,
                }),
                "stage_restored",
                &["stage 2", "iteration 9", "holder 1f", "iteration 12"],
            ),
            (
                NodeEvent::StageRebuilt {
                    stage: 2,
                    from: vec![0xa, 0xb],
                    applied: Some(12),
                    averaged: 2,
                    weights: [1; 32],
                },
                "stage_rebuilt",
                &["stage 2", "average of 2", "a, b"],
            ),
            (
                NodeEvent::StageRebuilt {
                    stage: 2,
                    from: vec![0xa],
                    applied: None,
                    averaged: 0,
                    weights: [0; 32],
                },
                "stage_restarted",
                &["stage 2", "neighbours (a)", "initial weights"],
            ),
            (
                NodeEvent::ConnectFailed {
                    addr: "127.0.0.1:9".parse().unwrap(),
                    attempts: 5,
                    reason: "Connection refused".into(),
                },
                "connect_failed",
                &["127.0.0.1:9", "after 5 attempts", "Connection refused"],
            ),
            (
                NodeEvent::StateDownloaded {
                    from: 0x1f,
                    bytes: 1000,
                    ms: 2.0,
                    bytes_per_s: 5e5,
                    import_ms: 1.0,
                    weights: [2; 32],
                    weights_ms: Some(0.5),
                },
                "state_download",
                &[
                    "1000 bytes",
                    "from 1f",
                    "0.5 MB/s",
                    "weights first, in 0.5 ms",
                ],
            ),
            (NodeEvent::Error("it broke".into()), "error", &["it broke"]),
        ];
        for (ev, kind, said) in cases {
            let line = LogEvent::of(0x2a, &ev, 64).unwrap_or_else(|| panic!("{ev:?} dropped"));
            assert_eq!(line.kind(), kind, "{ev:?}");
            assert_eq!(parse_line(&line.to_line()).as_ref(), Some(&line));
            let s = line.sentence();
            for w in said {
                assert!(s.contains(w), "{kind}: {w:?} not in {s:?}");
            }
        }
        let tokens = LogEvent::of(
            1,
            &NodeEvent::Iteration {
                iteration: 0,
                loss: 1.0,
                microbatches: 3,
            },
            64,
        );
        assert!(matches!(
            tokens,
            Some(LogEvent::Iteration { tokens: 192, .. })
        ));
    }

    /// A checkpoint's states go to their writer, and the protocol's
    /// bookkeeping to nobody.
    #[test]
    fn what_the_schema_does_not_carry_is_none() {
        let none = [
            NodeEvent::Checkpoint {
                iteration: 1,
                states: Vec::new(),
            },
            NodeEvent::Protocol(Event::IterStarted { iter: 1 }),
        ];
        for ev in none {
            assert_eq!(LogEvent::of(1, &ev, 0), None, "{ev:?}");
        }
    }
}
