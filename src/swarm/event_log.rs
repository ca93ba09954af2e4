//! The events a swarm node reports, as one typed schema: the JSON lines of
//! `gwtf node --json` are written from [`LogEvent`] and read back into it
//! (by `gwtf demo`, `gwtf bench swarm` and the run audit), so the writer and
//! its readers cannot drift apart.
//!
//! One event is one JSON object on one line; `"event"` names its kind in
//! snake case and `"node"` the node (hex ids nowhere: ids are numbers). A
//! reader meets lines of other builds: a kind this build does not know reads
//! as [`LogEvent::Unknown`], a field added later is ignored, and fields that
//! older nodes did not write read as their defaults. A line that is not JSON,
//! or a known kind with a missing or mistyped field, is garbage:
//! [`parse_line`] answers `None`, never an error that stops the reader.
//!
//! The `why` fields are for people: a sentence that says what the event
//! means for the run. Nothing reads them.

use serde::{Deserialize, Serialize};

use super::model_checkpoint::ManifestStage;

/// A node id as the lines carry it.
pub type NodeId = u64;

/// One line of a node's event log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum LogEvent {
    /// The node listens (`addr`: `None` when it could not learn its
    /// address), runs its stages on `device`, and takes a peer silent for
    /// `suspicion_ms` for gone.
    Listening {
        node: NodeId,
        addr: Option<String>,
        #[serde(default)]
        device: String,
        #[serde(default)]
        suspicion_ms: u64,
    },
    /// The node serves `stage` (a joiner once its state is in).
    Active {
        node: NodeId,
        stage: u32,
    },
    /// The stage's replicas applied `iteration`'s update; `weights_sha256`:
    /// the digest of the weights after it (equal at every replica).
    Applied {
        node: NodeId,
        stage: u32,
        iteration: u64,
        weights_sha256: String,
        #[serde(default)]
        microbatches: u64,
    },
    /// A data holder's iteration is final: its mean `loss` over
    /// `microbatches` microbatches of `tokens` tokens.
    Iteration {
        node: NodeId,
        iteration: u64,
        /// The trainer's f32 with its shortest digits ([`f32_as_written`]).
        loss: f64,
        microbatches: u64,
        #[serde(default)]
        tokens: u64,
    },
    /// The node took `peer` for gone.
    PeerLost {
        node: NodeId,
        peer: NodeId,
    },
    /// A microbatch lost with a node goes on: `kind` "rerouted" (its lost
    /// stage runs again elsewhere) or "restarted" (from its first stage).
    Recovered {
        node: NodeId,
        kind: String,
        stage: u32,
        iteration: u64,
        #[serde(default)]
        holder: NodeId,
        #[serde(default)]
        index: u64,
    },
    /// No live node of `stage` is known.
    StageEmpty {
        node: NodeId,
        stage: u32,
        #[serde(default)]
        why: String,
    },
    /// A joiner took up an emptied stage from the copy of its state holder
    /// `from` kept (of `iteration`), standing for iteration `applied`.
    StageRestored {
        node: NodeId,
        stage: u32,
        from: NodeId,
        iteration: u64,
        applied: u64,
        #[serde(default)]
        source: String,
        #[serde(default)]
        why: String,
    },
    /// A joiner took up an emptied stage (no copy kept) from the average of
    /// the weights of its neighbouring stages' members `from` (CheckFree),
    /// standing for iteration `applied`.
    StageRebuilt {
        node: NodeId,
        stage: u32,
        from: Vec<NodeId>,
        applied: Option<u64>,
        #[serde(default)]
        averaged: u64,
        #[serde(default)]
        weights_sha256: String,
        #[serde(default)]
        source: String,
        #[serde(default)]
        why: String,
    },
    /// A joiner took up an emptied stage from the initial weights (no copy
    /// kept, and the neighbours' weights, if any were asked, did not fit),
    /// standing for iteration `applied`.
    StageRestarted {
        node: NodeId,
        stage: u32,
        applied: Option<u64>,
        #[serde(default)]
        source: String,
        /// The neighbours asked for their weights (none when not asked).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        neighbours: Option<Vec<NodeId>>,
        #[serde(default)]
        why: String,
    },
    /// A fenced node's members miss the update it kept: it serves its
    /// weights again, standing for iteration `applied`.
    StateKept {
        node: NodeId,
        stage: u32,
        applied: u64,
        #[serde(default)]
        why: String,
    },
    /// A data holder keeps a copy of `stage`'s state of `iteration` from
    /// `from` (for a stage that empties).
    CopyKept {
        node: NodeId,
        stage: u32,
        iteration: u64,
        from: NodeId,
        bytes: u64,
        ms: f64,
    },
    /// A state came in from `from`: `ms` from the request to the whole
    /// state, its hash checked; `import_ms` the trainer's import. With the
    /// weights imported first, `weights_ms` from the request to them: the
    /// node computed from then on while the rest came.
    StateDownload {
        node: NodeId,
        from: NodeId,
        bytes: u64,
        ms: f64,
        #[serde(default)]
        bytes_per_s: f64,
        #[serde(default)]
        import_ms: f64,
        #[serde(default)]
        weights_sha256: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        weights_ms: Option<f64>,
    },
    /// The node's compute time so far, and the part that went into an
    /// applied update.
    Stats {
        node: NodeId,
        compute_ms: f64,
        useful_ms: f64,
    },
    /// A stage coordinator committed `iteration`: the microbatches counted
    /// and dropped, and (optional: the count alone is checked without it)
    /// the counted ones as [holder, index, member that computed it].
    Committed {
        node: NodeId,
        stage: u32,
        iteration: u64,
        microbatches: u64,
        dropped: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mbs: Option<Vec<[u64; 3]>>,
    },
    /// A stage's iteration waits for microbatches that do not come.
    Stalled {
        node: NodeId,
        stage: u32,
        iteration: u64,
    },
    /// A holder finished the backward of one of its microbatches; `path`:
    /// the nodes it went through (the holder, then one per relay stage).
    MbDone {
        node: NodeId,
        holder: NodeId,
        index: u64,
        iteration: u64,
        path: Vec<NodeId>,
    },
    /// A member's all-reduce ended without the mean: the stage commits again.
    AggregateFailed {
        node: NodeId,
        stage: u32,
        iteration: u64,
        member: NodeId,
        #[serde(default)]
        why: String,
    },
    /// Members behind links far slower than the others' are left out of
    /// the stage's all-reduce.
    LeftOut {
        node: NodeId,
        stage: u32,
        iteration: u64,
        slow: Vec<NodeId>,
        #[serde(default)]
        why: String,
    },
    /// The replicas of `stage` hold different weights after the update of
    /// `iteration` (`digests`: [member, the protocol's digest of its
    /// weights]): the worst failure a run can have.
    ReplicasDiverged {
        node: NodeId,
        stage: u32,
        iteration: u64,
        digests: Vec<[u64; 2]>,
        #[serde(default)]
        why: String,
    },
    /// The stage's microbatches flow again.
    StageResumed {
        node: NodeId,
        stage: u32,
    },
    /// The node stopped serving its stage group (`reason`: paused, cut off,
    /// evicted, outvoted, behind) and joins again as `incarnation`;
    /// `gap_ms`: how long it was paused.
    Fenced {
        node: NodeId,
        reason: String,
        incarnation: u32,
        #[serde(default)]
        gap_ms: Option<u64>,
        #[serde(default)]
        why: String,
    },
    /// A checkpoint of `iteration` is complete in `dir`.
    Checkpoint {
        node: NodeId,
        iteration: u64,
        dir: String,
        ms: f64,
        bytes: u64,
        stages: Vec<ManifestStage>,
    },
    /// A checkpoint round was not written (a newer one replaced it, or a
    /// stage's copy did not come).
    CheckpointSkipped {
        node: NodeId,
        iteration: u64,
        why: String,
    },
    /// Writing a checkpoint failed (`iteration`: unknown when the writer
    /// died).
    CheckpointFailed {
        node: NodeId,
        #[serde(default)]
        iteration: Option<u64>,
        why: String,
    },
    /// The node could not reach `addr` (`given`: the address as the user
    /// gave it, when it was a name).
    ConnectFailed {
        node: NodeId,
        addr: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        given: Option<String>,
        /// Connection attempts made (`None`: not counted).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attempts: Option<u64>,
        reason: String,
    },
    /// A peer was refused (`reason`: the kind, `message`: the detail;
    /// `peer`: `None` before its id was known).
    Refused {
        node: NodeId,
        peer: Option<NodeId>,
        reason: String,
        message: String,
    },
    /// A trainer's work started or ended (`--trace-work`).
    Work {
        node: NodeId,
        kind: String,
        phase: String,
    },
    /// The node's links were cut (a test's signal) ...
    LinkCut {
        node: NodeId,
    },
    /// ... and restored.
    LinkRestored {
        node: NodeId,
    },
    /// The holder's last iteration is final.
    Done {
        node: NodeId,
    },
    /// The node left its swarm.
    Left {
        node: NodeId,
    },
    Error {
        node: NodeId,
        message: String,
    },
    /// An event kind this build does not know.
    #[serde(other)]
    Unknown,
}

impl LogEvent {
    /// The kind as the line names it (`"applied"`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            LogEvent::Listening { .. } => "listening",
            LogEvent::Active { .. } => "active",
            LogEvent::Applied { .. } => "applied",
            LogEvent::Iteration { .. } => "iteration",
            LogEvent::PeerLost { .. } => "peer_lost",
            LogEvent::Recovered { .. } => "recovered",
            LogEvent::StageEmpty { .. } => "stage_empty",
            LogEvent::StageRestored { .. } => "stage_restored",
            LogEvent::StageRebuilt { .. } => "stage_rebuilt",
            LogEvent::StageRestarted { .. } => "stage_restarted",
            LogEvent::StateKept { .. } => "state_kept",
            LogEvent::CopyKept { .. } => "copy_kept",
            LogEvent::StateDownload { .. } => "state_download",
            LogEvent::Stats { .. } => "stats",
            LogEvent::Committed { .. } => "committed",
            LogEvent::Stalled { .. } => "stalled",
            LogEvent::MbDone { .. } => "mb_done",
            LogEvent::AggregateFailed { .. } => "aggregate_failed",
            LogEvent::LeftOut { .. } => "left_out",
            LogEvent::ReplicasDiverged { .. } => "replicas_diverged",
            LogEvent::StageResumed { .. } => "stage_resumed",
            LogEvent::Fenced { .. } => "fenced",
            LogEvent::Checkpoint { .. } => "checkpoint",
            LogEvent::CheckpointSkipped { .. } => "checkpoint_skipped",
            LogEvent::CheckpointFailed { .. } => "checkpoint_failed",
            LogEvent::ConnectFailed { .. } => "connect_failed",
            LogEvent::Refused { .. } => "refused",
            LogEvent::Work { .. } => "work",
            LogEvent::LinkCut { .. } => "link_cut",
            LogEvent::LinkRestored { .. } => "link_restored",
            LogEvent::Done { .. } => "done",
            LogEvent::Left { .. } => "left",
            LogEvent::Error { .. } => "error",
            LogEvent::Unknown => "unknown",
        }
    }

    /// The event as one JSON line (no newline).
    pub fn to_line(&self) -> String {
        // Every field is a number, a string, a list or a map with string
        // keys: serializing cannot fail.
        serde_json::to_string(self).expect("an event serializes")
    }

    /// The event's fields for a person: the JSON object without its
    /// `event` and `node`.
    pub fn fields_text(&self) -> String {
        let mut v = serde_json::to_value(self).expect("an event serializes");
        if let Some(m) = v.as_object_mut() {
            m.remove("event");
            m.remove("node");
        }
        v.to_string()
    }
}

impl LogEvent {
    /// The event as one sentence for a person (node ids in hex, as the
    /// tools print them): the text of the C API's event tasks, and of
    /// `gwtf node` without `--json`.
    pub fn sentence(&self) -> String {
        use LogEvent as E;
        match self {
            E::Listening { addr, device, .. } => format!(
                "listening on {}, computing on {device}",
                addr.as_deref().unwrap_or("an address it could not learn")
            ),
            E::Active { stage, .. } => format!("serving stage {stage}"),
            E::Applied {
                stage, iteration, ..
            } => format!("stage {stage} applied iteration {iteration}"),
            E::Iteration {
                iteration,
                loss,
                microbatches,
                ..
            } => {
                format!("iteration {iteration} final: loss {loss} over {microbatches} microbatches")
            }
            E::PeerLost { peer, .. } => format!("peer {peer:x} lost"),
            E::Recovered {
                kind,
                stage,
                iteration,
                holder,
                index,
                ..
            } => {
                let mb = format!("microbatch {holder:x}/{iteration}/{index}");
                if kind == "restarted" {
                    format!("{mb} restarted from its holder")
                } else {
                    format!("{mb} {kind} at stage {stage}")
                }
            }
            E::StageEmpty { stage, .. } => {
                format!("stage {stage} has no live node: training pauses until one joins it")
            }
            E::StageRestored {
                stage,
                from,
                iteration,
                applied,
                ..
            } => restored_sentence(*stage, *from, *iteration, *applied),
            E::StageRebuilt {
                stage,
                from,
                averaged,
                ..
            } => format!(
                "stage {stage} had no live node and no kept copy: rebuilt from the average of \
                 {averaged} neighbouring stage member(s)' states ({})",
                hex_ids(from)
            ),
            E::StageRestarted {
                stage, neighbours, ..
            } => match neighbours {
                Some(n) => format!(
                    "stage {stage} had no live node and no kept copy, and the states of its \
                     neighbours ({}) did not fit it: restarted from the initial weights",
                    hex_ids(n)
                ),
                None => format!(
                    "stage {stage} had no live node and no kept copy: restarted from the \
                     initial weights"
                ),
            },
            E::StateKept { stage, applied, .. } => format!(
                "serving stage {stage} again with the weights it kept at its fence (the update \
                 of iteration {applied}): the members behind download them"
            ),
            E::CopyKept {
                stage,
                iteration,
                from,
                bytes,
                ms,
                ..
            } => format!(
                "kept a copy of stage {stage}'s state of iteration {iteration} from {from:x} \
                 ({bytes} bytes in {ms:.1} ms)"
            ),
            E::StateDownload {
                from,
                bytes,
                ms,
                bytes_per_s,
                import_ms,
                weights_ms,
                ..
            } => {
                let first = weights_ms.map_or(String::new(), |w| {
                    format!(" (its weights first, in {w:.1} ms: computing from then on)")
                });
                format!(
                    "state of {bytes} bytes from {from:x} in {ms:.1} ms from the request \
                     ({:.1} MB/s){first}, imported in {import_ms:.1} ms",
                    bytes_per_s / 1e6
                )
            }
            E::Stats {
                compute_ms,
                useful_ms,
                ..
            } => format!(
                "compute {:.1} s so far, {:.1} s of it in applied updates",
                compute_ms / 1e3,
                useful_ms / 1e3
            ),
            E::Committed {
                stage,
                iteration,
                microbatches,
                dropped,
                ..
            } => {
                let dropped = match dropped {
                    0 => String::new(),
                    d => format!(", {d} dropped"),
                };
                format!(
                    "stage {stage} committed iteration {iteration} ({microbatches} \
                     microbatches{dropped})"
                )
            }
            E::Stalled {
                stage, iteration, ..
            } => format!("iteration {iteration} waits for stage {stage}"),
            E::MbDone {
                holder,
                index,
                iteration,
                path,
                ..
            } => format!(
                "microbatch {holder:x}/{iteration}/{index} done through {}",
                hex_ids(path)
            ),
            E::AggregateFailed {
                stage,
                iteration,
                member,
                ..
            } => format!(
                "the all-reduce of iteration {iteration} at stage {stage} failed at node \
                 {member:x}: committed again"
            ),
            E::LeftOut {
                stage,
                iteration,
                slow,
                ..
            } => format!(
                "stage {stage} left {} out of the all-reduce of iteration {iteration}: their \
                 links are far slower than the others', and they download the state again",
                hex_ids(slow)
            ),
            E::ReplicasDiverged {
                stage, iteration, ..
            } => format!("the replicas of stage {stage} disagree after iteration {iteration}"),
            E::StageResumed { stage, .. } => format!("stage {stage} has a node again"),
            E::Fenced {
                reason,
                incarnation,
                ..
            } => format!(
                "fenced ({reason}): this peer's view of its stage group may be stale; it stops \
                 serving the group and joins again as incarnation {incarnation}"
            ),
            E::Checkpoint {
                iteration,
                dir,
                ms,
                bytes,
                ..
            } => format!(
                "a checkpoint of iteration {iteration} is complete in {dir} ({bytes} bytes, \
                 {ms:.0} ms)"
            ),
            E::CheckpointSkipped { iteration, why, .. } => {
                format!("the checkpoint of iteration {iteration} is not written: {why}")
            }
            E::CheckpointFailed { iteration, why, .. } => match iteration {
                Some(i) => format!("writing the checkpoint of iteration {i} failed: {why}"),
                None => format!("writing a checkpoint failed: {why}"),
            },
            E::ConnectFailed {
                addr,
                given,
                attempts,
                reason,
                ..
            } => {
                let given = given.as_ref().map_or(String::new(), |g| format!(" ({g})"));
                let attempts = attempts.map_or(String::new(), |n| format!(" after {n} attempts"));
                format!("cannot reach {addr}{given}{attempts}: {reason}")
            }
            E::Refused {
                reason, message, ..
            } => format!("refused ({reason}): {message}"),
            E::Work { kind, phase, .. } => format!("{kind} work: {phase}"),
            E::LinkCut { .. } => "its links are cut".into(),
            E::LinkRestored { .. } => "its links are back".into(),
            E::Done { .. } => "the last iteration is final".into(),
            E::Left { .. } => "left the swarm".into(),
            E::Error { message, .. } => message.clone(),
            E::Unknown => "an event this build does not know".into(),
        }
    }
}

/// The sentence of a restored stage (also logged by the runtime itself).
pub(crate) fn restored_sentence(stage: u32, from: NodeId, iteration: u64, applied: u64) -> String {
    format!(
        "stage {stage} had no live node: restored from the copy of iteration {iteration} that \
         holder {from:x} kept, standing for iteration {applied}"
    )
}

/// Node ids in hex, comma-separated.
fn hex_ids(ids: &[NodeId]) -> String {
    let v: Vec<String> = ids.iter().map(|id| format!("{id:x}")).collect();
    v.join(", ")
}

/// An f32 as the f64 its shortest decimal digits spell: what a line holds
/// for a trainer's f32 (a loss), so that it reads `5.1`, not the widened
/// `5.099999904632568`, and a reader gets the f64 of those digits.
pub fn f32_as_written(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// Parses one line of a node's event log: `None` for garbage (not JSON, not
/// an object with a string `event`, or a known kind with missing or
/// mistyped fields).
pub fn parse_line(line: &str) -> Option<LogEvent> {
    let line = line.trim();
    if !line.starts_with('{') {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    v.get("event")?.as_str()?;
    serde_json::from_value(v).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One event of every kind (but `Unknown`), with values in every field.
    fn every_kind() -> Vec<LogEvent> {
        let n = 0x2a;
        vec![
            LogEvent::Listening {
                node: n,
                addr: Some("127.0.0.1:7000".into()),
                device: "cpu".into(),
                suspicion_ms: 1200,
            },
            LogEvent::Active { node: n, stage: 2 },
            LogEvent::Applied {
                node: n,
                stage: 1,
                iteration: 7,
                weights_sha256: "ab".repeat(32),
                microbatches: 8,
            },
            LogEvent::Iteration {
                node: n,
                iteration: 7,
                loss: 3.25,
                microbatches: 8,
                tokens: 512,
            },
            LogEvent::PeerLost { node: n, peer: 9 },
            LogEvent::Recovered {
                node: n,
                kind: "rerouted".into(),
                stage: 2,
                iteration: 3,
                holder: 1,
                index: 4,
            },
            LogEvent::StageEmpty {
                node: n,
                stage: 2,
                why: "w".into(),
            },
            LogEvent::StageRestored {
                node: n,
                stage: 2,
                from: 1,
                iteration: 5,
                applied: 6,
                source: "kept".into(),
                why: "w".into(),
            },
            LogEvent::StageRebuilt {
                node: n,
                stage: 2,
                from: vec![3, 4],
                applied: Some(6),
                averaged: 2,
                weights_sha256: "cd".repeat(32),
                source: "checkfree".into(),
                why: "w".into(),
            },
            LogEvent::StageRestarted {
                node: n,
                stage: 2,
                applied: None,
                source: "initial".into(),
                neighbours: Some(vec![3]),
                why: "w".into(),
            },
            LogEvent::StateKept {
                node: n,
                stage: 2,
                applied: 6,
                why: "w".into(),
            },
            LogEvent::CopyKept {
                node: n,
                stage: 2,
                iteration: 5,
                from: 3,
                bytes: 1 << 20,
                ms: 12.5,
            },
            LogEvent::StateDownload {
                node: n,
                from: 3,
                bytes: 1 << 20,
                ms: 80.0,
                bytes_per_s: 1.3e7,
                import_ms: 2.0,
                weights_sha256: "ef".repeat(32),
                weights_ms: Some(21.5),
            },
            LogEvent::Stats {
                node: n,
                compute_ms: 10.0,
                useful_ms: 9.5,
            },
            LogEvent::Committed {
                node: n,
                stage: 1,
                iteration: 7,
                microbatches: 2,
                dropped: 0,
                mbs: Some(vec![[1, 0, 5], [1, 1, 6]]),
            },
            LogEvent::Stalled {
                node: n,
                stage: 1,
                iteration: 7,
            },
            LogEvent::MbDone {
                node: n,
                holder: 1,
                index: 0,
                iteration: 7,
                path: vec![1, 5, 9],
            },
            LogEvent::AggregateFailed {
                node: n,
                stage: 1,
                iteration: 7,
                member: 5,
                why: "w".into(),
            },
            LogEvent::LeftOut {
                node: n,
                stage: 1,
                iteration: 7,
                slow: vec![5],
                why: "w".into(),
            },
            LogEvent::StageResumed { node: n, stage: 1 },
            LogEvent::Fenced {
                node: n,
                reason: "paused".into(),
                incarnation: 1,
                gap_ms: Some(4000),
                why: "w".into(),
            },
            LogEvent::Checkpoint {
                node: n,
                iteration: 10,
                dir: "ck/10".into(),
                ms: 40.0,
                bytes: 1 << 22,
                stages: vec![ManifestStage {
                    stage: 1,
                    from: 5,
                    files: vec!["stage-1.safetensors".into()],
                    weights_sha256: "01".repeat(32),
                }],
            },
            LogEvent::CheckpointSkipped {
                node: n,
                iteration: 9,
                why: "w".into(),
            },
            LogEvent::CheckpointFailed {
                node: n,
                iteration: None,
                why: "w".into(),
            },
            LogEvent::ConnectFailed {
                node: n,
                addr: "10.0.0.1:7000".into(),
                given: Some("node-a:7000".into()),
                attempts: Some(5),
                reason: "refused".into(),
            },
            LogEvent::Refused {
                node: n,
                peer: Some(5),
                reason: "bad_key".into(),
                message: "m".into(),
            },
            LogEvent::Work {
                node: n,
                kind: "forward".into(),
                phase: "start".into(),
            },
            LogEvent::LinkCut { node: n },
            LogEvent::LinkRestored { node: n },
            LogEvent::Done { node: n },
            LogEvent::Left { node: n },
            LogEvent::ReplicasDiverged {
                node: n,
                stage: 2,
                iteration: 7,
                digests: vec![[3, 11], [4, 12]],
                why: "w".into(),
            },
            LogEvent::Error {
                node: n,
                message: "m".into(),
            },
        ]
    }

    #[test]
    fn every_kind_reads_back_as_written_and_names_itself() {
        let all = every_kind();
        let mut kinds = std::collections::BTreeSet::new();
        for e in &all {
            let line = e.to_line();
            assert!(!line.contains('\n'), "{line}");
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            assert_eq!(v["event"], e.kind(), "{line}");
            assert_eq!(v["node"], 0x2a, "{line}");
            assert_eq!(parse_line(&line).as_ref(), Some(e), "{line}");
            assert!(!e.fields_text().contains("\"event\""));
            let said = e.sentence();
            assert!(!said.is_empty() && !said.contains('{'), "{said}");
            kinds.insert(e.kind());
        }
        assert_eq!(kinds.len(), all.len(), "two events share a kind");
    }

    #[test]
    fn lines_of_other_builds_read_as_well_as_they_can() {
        // A kind this build does not know.
        assert_eq!(
            parse_line(r#"{"event":"novel","node":1,"x":2}"#),
            Some(LogEvent::Unknown)
        );
        // A field added later is ignored; one an older node did not write
        // reads as its default.
        assert_eq!(
            parse_line(
                r#"{"event":"iteration","node":1,"iteration":2,"loss":1.5,"microbatches":4,"new":true}"#
            ),
            Some(LogEvent::Iteration {
                node: 1,
                iteration: 2,
                loss: 1.5,
                microbatches: 4,
                tokens: 0
            })
        );
    }

    #[test]
    fn an_f32_loss_is_written_with_its_own_digits() {
        let e = LogEvent::Iteration {
            node: 1,
            iteration: 0,
            loss: f32_as_written(5.1),
            microbatches: 1,
            tokens: 1,
        };
        assert!(e.to_line().contains(r#""loss":5.1,"#), "{}", e.to_line());
        assert_eq!(f32_as_written(5.1), 5.1);
        assert_eq!(f32_as_written(0.25), 0.25);
    }

    #[test]
    fn garbage_is_none_not_an_error() {
        for line in [
            "",
            "not json",
            "{",
            "[1,2]",
            r#"{"node":1}"#,
            r#"{"event":3,"node":1}"#,
            r#"{"event":"applied","node":1}"#,
            r#"{"event":"active","node":"one","stage":1}"#,
        ] {
            assert_eq!(parse_line(line), None, "{line}");
        }
    }
}
