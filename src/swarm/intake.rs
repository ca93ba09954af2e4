//! What a runtime node refuses of what reaches it, and why.
//!
//! The engine authenticates connections (the swarm key); everything after
//! that is checked here before the protocol or the trainer sees it:
//!
//! - a peer that has not introduced itself with a directory message is not
//!   in the swarm: its messages and frames are refused and it is cut off;
//! - a data frame must be what its header says: an all-reduce chunk of this
//!   node's stage, or the data of a bulk message kind, of that kind's size
//!   (a tensor is exactly the swarm's activation size);
//! - a stage claim (a directory entry, a protocol message that names the
//!   sender's stage) must be a stage of this swarm and agree with the
//!   protocol's view (a member of this node's stage group serves this stage);
//! - a state download must be as long as its message says and match its
//!   SHA-256.
//!
//! Each refusal is counted by [`Refusal`] (`Runtime::refused`), logged with
//! its reason and reported as `NodeEvent::Refused`.
use super::directory::Peer;
use super::work::TensorSizes;
use crate::protocol::{codec, Config, Msg, NodeId, Stage};
use crate::wire::FrameHeader;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why something was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Refusal {
    /// A connection that failed authentication (a wrong swarm key) or broke
    /// the wire protocol before it was authenticated.
    Connection,
    /// A message or frame from a peer that is not in the swarm's directory.
    Stranger,
    /// A control message that does not decode, or a directory that does
    /// not start with its sender.
    Message,
    /// A data frame that is not what its header says (unknown kind, wrong
    /// size, another stage's all-reduce chunk).
    Frame,
    /// A stage claim outside the swarm's stages or against the protocol's view.
    Stage,
    /// A state download that is cut off or does not match its SHA-256.
    State,
    /// A frame dropped because its peer already had too many waiting.
    Flood,
}

impl Refusal {
    pub const ALL: [Refusal; 7] = [
        Refusal::Connection,
        Refusal::Stranger,
        Refusal::Message,
        Refusal::Frame,
        Refusal::Stage,
        Refusal::State,
        Refusal::Flood,
    ];

    /// A short name (logs, JSON).
    pub fn name(self) -> &'static str {
        match self {
            Refusal::Connection => "connection",
            Refusal::Stranger => "stranger",
            Refusal::Message => "message",
            Refusal::Frame => "frame",
            Refusal::Stage => "stage",
            Refusal::State => "state",
            Refusal::Flood => "flood",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Refusals so far, by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Refused([u64; 7]);

impl Refused {
    pub fn get(&self, r: Refusal) -> u64 {
        self.0[r.index()]
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

/// The counters behind [`Refused`], shared by the driver and the handle.
#[derive(Default)]
pub struct RefusedCounters([AtomicU64; 7]);

impl RefusedCounters {
    /// Counts one; returns the count of `r` so far, this one included.
    pub fn add(&self, r: Refusal) -> u64 {
        self.0[r.index()].fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn get(&self) -> Refused {
        let mut out = Refused::default();
        for r in Refusal::ALL {
            out.0[r.index()] = self.0[r.index()].load(Ordering::Relaxed);
        }
        out
    }
}

/// Whether the `n`-th refusal of a reason is worth a log line and an event:
/// every one of the first 64, then one per power of two (a flood is counted
/// exactly but does not flood the log).
pub fn worth_reporting(n: u64) -> bool {
    n <= 64 || n.is_power_of_two()
}

/// What a data frame is, once checked.
#[derive(Debug, PartialEq, Eq)]
pub enum FrameUse {
    /// A chunk or abort of this stage's all-reduce.
    AllReduce,
    /// The data of a bulk message.
    Bulk,
}

/// Checks a data frame of `len` bytes with header `h` against what this
/// node (serving `stage`, downloading a state or not) accepts.
pub fn check_frame(
    h: &FrameHeader,
    len: usize,
    stage: Stage,
    cfg: &Config,
    sizes: &TensorSizes,
    want_state: bool,
) -> Result<FrameUse, String> {
    if super::bulk::is_allreduce_frame(h) {
        if h.stage != stage as u32 {
            return Err(format!(
                "an all-reduce frame of stage {} (this node serves stage {stage})",
                h.stage
            ));
        }
        return Ok(FrameUse::AllReduce);
    }
    let kind = (h.iteration >> 32) as u16;
    let probe = codec::msg_type(&Msg::Probe {
        bytes: 0,
        sent_at: 0,
    });
    let state = codec::msg_type(&Msg::StateResponse {
        version: (0, 0),
        members: Default::default(),
        bytes: 0,
        coord: 0,
    });
    let want = sizes.incoming_tensor(kind == codec::KIND_FORWARD, stage);
    match kind {
        codec::KIND_FORWARD | codec::KIND_BACKWARD if len != want => Err(format!(
            "a tensor of {len} bytes (this node takes {want} bytes at its stage's boundary)"
        )),
        codec::KIND_FORWARD | codec::KIND_BACKWARD => Ok(FrameUse::Bulk),
        k if k == probe && len as u64 > cfg.probe_bytes => Err(format!(
            "a probe of {len} bytes (probes are at most {} bytes)",
            cfg.probe_bytes
        )),
        k if k == state && !want_state => Err(format!(
            "a state of {len} bytes that this node did not ask for"
        )),
        k if k == probe || k == state => Ok(FrameUse::Bulk),
        k => Err(format!(
            "a data frame of message kind {k}, which carries no data"
        )),
    }
}

/// The stage a protocol message says its sender serves, if it says one.
pub fn stage_claim(msg: &Msg) -> Option<Stage> {
    match msg {
        Msg::Introduce { stage, .. }
        | Msg::GroupJoin { stage, .. }
        | Msg::StageDone { stage, .. } => Some(*stage),
        Msg::StageInfo { summary } => Some(summary.stage),
        _ => None,
    }
}

/// Whether `id`'s own message, claiming stage `claim`, says it left this
/// node's stage group (`my_stage`, `members`): a member that serves another
/// of the swarm's stages now (it fenced itself and joined that one). It is
/// dropped from the group and its message taken; a third party's word about
/// a member (a directory entry) is still refused ([`check_stage`]).
pub fn left_for_another_stage(
    id: NodeId,
    claim: Stage,
    last: Stage,
    my_stage: Stage,
    members: &[NodeId],
) -> bool {
    claim <= last && claim != my_stage && members.contains(&id)
}

/// Why `id` may not claim `claim`: outside the swarm's stages (`0..=last`),
/// or a member of this node's stage group (`my_stage`, `members`) claiming
/// another stage.
pub fn check_stage(
    id: NodeId,
    claim: Stage,
    last: Stage,
    my_stage: Stage,
    members: &[NodeId],
) -> Result<(), String> {
    if claim > last {
        return Err(format!(
            "node {id:x} claims stage {claim}; this swarm's stages are 0 to {last}"
        ));
    }
    if claim != my_stage && members.contains(&id) {
        return Err(format!(
            "node {id:x} claims stage {claim}, but it is a member of this node's stage {my_stage}"
        ));
    }
    Ok(())
}

/// A directory message from `from`, checked: the entries to take in, and
/// why the others were refused. Err: the whole message is refused (it does
/// not start with its sender, who would then pose as someone else).
pub fn check_directory(
    from: NodeId,
    peers: Vec<Peer>,
    last: Stage,
    my_stage: Stage,
    members: &[NodeId],
) -> Result<(Vec<Peer>, Vec<String>), String> {
    match peers.first() {
        Some(p) if p.id == from => {}
        Some(p) => {
            return Err(format!(
                "a directory from {from:x} that starts with node {:x}",
                p.id
            ))
        }
        None => return Err(format!("an empty directory from {from:x}")),
    }
    let mut ok = Vec::with_capacity(peers.len());
    let mut refused = Vec::new();
    for p in peers {
        if p.stage == super::directory::NO_STAGE {
            // A joiner before its stage is chosen (or a stale entry of
            // one): an address, no claim.
            ok.push(p);
            continue;
        }
        match check_stage(p.id, p.stage, last, my_stage, members) {
            Ok(()) => ok.push(p),
            Err(e) => refused.push(format!("a directory entry from {from:x}: {e}")),
        }
    }
    Ok((ok, refused))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Policy;

    fn peer(id: NodeId, stage: Stage) -> Peer {
        Peer {
            id,
            stage,
            addr: "127.0.0.1:9".parse().unwrap(),
        }
    }

    #[test]
    fn directories_start_with_their_sender_and_name_real_stages() {
        assert!(check_directory(5, vec![], 2, 1, &[]).is_err());
        assert!(check_directory(5, vec![peer(6, 1)], 2, 1, &[]).is_err());
        let (ok, refused) = check_directory(
            5,
            vec![peer(5, 1), peer(7, 3), peer(8, 2), peer(9, 1)],
            2,
            1,
            &[8],
        )
        .unwrap();
        assert_eq!(ok, vec![peer(5, 1), peer(9, 1)]);
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert!(refused[0].contains("claims stage 3"), "{refused:?}");
        assert!(
            refused[1].contains("member of this node's stage 1"),
            "{refused:?}"
        );
        // A joiner's entry from before its stage was chosen claims none:
        // taken as an address, even for a member of this stage.
        let none = super::super::directory::NO_STAGE;
        let (ok, refused) =
            check_directory(5, vec![peer(5, 1), peer(8, none)], 2, 1, &[8]).unwrap();
        assert_eq!((ok, refused.len()), (vec![peer(5, 1), peer(8, none)], 0));
    }

    #[test]
    fn frames_must_be_what_their_header_says() {
        let cfg = Config::new(Policy::Gwtf, 2, 1024);
        let sizes = TensorSizes::uniform(2, 1024);
        let fwd = crate::protocol::Msg::Backward {
            mb: crate::protocol::MbId {
                holder: 1,
                iter: 0,
                idx: 0,
            },
            attempt: 0,
            path: Default::default(),
        };
        let mut h = FrameHeader::data();
        (h.microbatch, h.iteration) = super::super::bulk::header_fields(&fwd);
        assert_eq!(
            check_frame(&h, 1024, 1, &cfg, &sizes, false),
            Ok(FrameUse::Bulk)
        );
        let e = check_frame(&h, 1000, 1, &cfg, &sizes, false).unwrap_err();
        assert!(e.contains("1000 bytes"), "{e}");
        h.iteration = (3u64 << 32) | 1;
        assert!(check_frame(&h, 8, 1, &cfg, &sizes, false).is_err());
        // A state: only while downloading one.
        h.iteration = 39u64 << 32;
        assert!(check_frame(&h, 80, 1, &cfg, &sizes, false).is_err());
        assert_eq!(
            check_frame(&h, 80, 1, &cfg, &sizes, true),
            Ok(FrameUse::Bulk)
        );
        // An all-reduce chunk: of this node's stage only.
        h.iteration = 2;
        h.stage = 1;
        assert_eq!(
            check_frame(&h, 64, 1, &cfg, &sizes, false),
            Ok(FrameUse::AllReduce)
        );
        assert!(check_frame(&h, 64, 2, &cfg, &sizes, false).is_err());
    }

    #[test]
    fn counters_report_a_flood_sparingly() {
        let c = RefusedCounters::default();
        let reported = (0..10_000)
            .filter(|_| worth_reporting(c.add(Refusal::Frame)))
            .count();
        assert_eq!(c.get().get(Refusal::Frame), 10_000);
        assert_eq!(c.get().total(), 10_000);
        assert!(reported < 80, "{reported}");
    }

    /// A member's own message naming another stage: it left the group
    /// (then its claim passes); a stage outside the swarm, or a node that
    /// is no member, is not a departure.
    #[test]
    fn a_member_naming_another_stage_for_itself_left_the_group() {
        let members = [3, 4];
        assert!(left_for_another_stage(3, 2, 2, 1, &members));
        assert!(check_stage(3, 2, 2, 1, &members).is_err());
        assert!(check_stage(3, 2, 2, 1, &[4]).is_ok());
        assert!(!left_for_another_stage(3, 1, 2, 1, &members), "same stage");
        assert!(
            !left_for_another_stage(3, 7, 2, 1, &members),
            "no such stage"
        );
        assert!(!left_for_another_stage(9, 2, 2, 1, &members), "no member");
    }
}
