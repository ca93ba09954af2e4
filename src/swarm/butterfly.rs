//! The stage all-reduce as a butterfly (the averager of hivemind and
//! SWARM): every member reduces one part of the buffer, as a sans-I/O state
//! machine beside the ring ([`super::allreduce`]), with the same messages,
//! outcomes and weighting by microbatches.
//!
//! Why: a ring pays `2 (n-1)` message latencies in sequence (each step
//! forwards what the previous one brought) and uses two links per member.
//! The butterfly pays two (a reduce-scatter round, then an all-gather
//! round) and uses all `n-1` links of each member at once. Each member
//! still sends and receives `2 (n-1)/n` of the buffer, like the ring: the
//! bandwidth optimum where the members' pair links are independent (a
//! wide-area swarm) and the NIC is not the limit.
//!
//! Schedule, for member `i` of `n` (its index in `members`, the same order
//! at every member), over the buffer `sum` followed by the microbatch count
//! as one f32 (exact up to 2^24), of `L` elements. Member `k` owns part
//! `k`, `[k L / n, (k+1) L / n)` (the ring's chunks: a buffer shorter than
//! `n` has empty parts, which travel all the same, so that counting works).
//! - Reduce-scatter: at [`ButterflyAllReduce::new`], `i` sends its slice of
//!   part `j` to every other member `j` (wire step 0), and keeps its slice
//!   of part `i`.
//! - Once owner `i` holds every member's slice of part `i`, it sums them in
//!   member order and sends the reduced part to every other member (wire
//!   step `1 + i`).
//! - All-gather: a member ends [`Outcome::Done`] when it holds every
//!   reduced part, its own included.
//!
//! Determinism: a part is summed only by its owner, in member order, so the
//! bits do not depend on arrival order; everyone else copies it verbatim.
//! Every member that ends Done holds bit-identical results, each the full
//! sum of every member's contribution.
//!
//! Nothing is ever added twice or from the wrong member: a slice of my part
//! is taken once per member (step 0), a reduced part once and only from its
//! owner (step `1 + k` from `members[k]`), each of the right length. Any
//! other message of this operation from a member is a violation: the
//! operation ends [`Outcome::Failed`] and the others hear of it as the loss
//! of the offender (the caller should also disconnect it). Messages of
//! another operation, from non-members (as their losses: nothing names a
//! non-member to the others) and from members taken for lost are ignored,
//! and so is everything after the end.
//!
//! # A lost member
//!
//! There is no bypass: a survivor needs from lost member `d` exactly two
//! things, `d`'s slice of the survivor's own part (step 0) and `d`'s reduced
//! part (step `1 + idx(d)`), and nobody else holds either. A running member
//! that learns of the loss and lacks either ends [`Outcome::Lost`] and sends
//! [`Message::Abort`] to every other member not known lost (members waiting
//! for its reduced part would wait forever); one that lacks neither only
//! remembers `d` (ignoring its later messages) and goes on. An abort
//! received while running ends the operation Lost; it is not passed on,
//! since every aborting member tells everyone directly. A Done member
//! ignores losses and aborts: its result stands.
//!
//! What holds, with members lost by crashes at any moments (a crashed member
//! sends nothing after; what it sent before may still arrive unless the
//! receiver already took it for lost), once every message is delivered and
//! every loss reported to every survivor:
//! - every survivor ends, Done or Lost (a survivor still running would hold
//!   everything from the lost members, so it would wait for a survivor's
//!   reduced part; that survivor either sent it or ended Lost and aborted
//!   everyone);
//! - every survivor that ends Done holds the full result, every original
//!   member's contribution (the lost ones' included), bit-identical to the
//!   others' (it holds every reduced part, and an owner reduces only with
//!   every slice in);
//! - if a survivor lacks a lost member's slice of its part, no survivor ends
//!   Done (nobody can ever get that survivor's reduced part).
//!
//! Unlike the ring (which bypasses a member lost in its all-gather half, so
//! that all survivors end alike), a survivor may end Done while another ends
//! Lost: the lost member sent its reduced part to some and not to others.
//! So [`Outcome::Done`] means the result is ready, not that it may be
//! applied: the stage coordinator decides, and otherwise runs the operation
//! again among the survivors. The whole operation takes two message rounds,
//! so a redo is short.
use super::allreduce::{
    done_in_place, done_with, ChunkData, Machine, MemberId, Message, Outcome, SetupError,
};
use std::sync::Arc;

/// One member's side of one butterfly all-reduce.
#[derive(Debug)]
pub struct ButterflyAllReduce {
    op: u64,
    members: Vec<MemberId>,
    /// My index in `members` (the part I own).
    me: usize,
    /// Elements of the buffer: the gradients, then the microbatch count.
    len: usize,
    /// By member index: whether its slice of my part came (mine included).
    got: Vec<bool>,
    /// By member index: its slice of my part, until I reduce it (then
    /// dropped).
    slices: Vec<ChunkData>,
    /// By part: whether its reduced part is in `result` (mine once reduced).
    gathered: Vec<bool>,
    /// The reduced parts gathered so far, in place; the last element is the
    /// total microbatch count once its part is here.
    result: Vec<f32>,
    /// Whether `result` stays after the end ([`Self::new_keeping_sums`]);
    /// otherwise it becomes the mean.
    keep_sums: bool,
    /// By member index: taken for lost (reported, or an offender). Nothing
    /// is sent to them and their messages are ignored.
    lost: Vec<bool>,
    outcome: Outcome,
    /// Messages for the driver to send, in order.
    outbox: Vec<(MemberId, Message)>,
}

impl ButterflyAllReduce {
    /// Sets up member `me`'s side of operation `op` among `members` (every
    /// member must be given the same order: it decides who owns which part
    /// and the order of the sums), contributing `sum` (the sum of its
    /// microbatches' gradients) and `microbatches`. The step-0 slices for
    /// every other member are in the outbox at once.
    pub fn new(
        op: u64,
        me: MemberId,
        members: &[MemberId],
        sum: &[f32],
        microbatches: u64,
    ) -> Result<ButterflyAllReduce, SetupError> {
        Self::with(op, me, members, sum, microbatches, false)
    }

    /// As [`Self::new`], for a caller that goes on summing: the reduced
    /// buffer stays readable ([`Self::reduced`]) after the end. Otherwise
    /// the mean is divided in place, in the buffer that gathered the parts
    /// (no second buffer of the whole size to allocate and fault in).
    pub fn new_keeping_sums(
        op: u64,
        me: MemberId,
        members: &[MemberId],
        sum: &[f32],
        microbatches: u64,
    ) -> Result<ButterflyAllReduce, SetupError> {
        Self::with(op, me, members, sum, microbatches, true)
    }

    fn with(
        op: u64,
        me: MemberId,
        members: &[MemberId],
        sum: &[f32],
        microbatches: u64,
        keep_sums: bool,
    ) -> Result<ButterflyAllReduce, SetupError> {
        let mut sorted = members.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(SetupError::DuplicateMember(w[0]));
        }
        let me = members
            .iter()
            .position(|&m| m == me)
            .ok_or(SetupError::NotAMember)?;
        if microbatches > 1 << 24 {
            return Err(SetupError::TooManyMicrobatches(microbatches));
        }
        let n = members.len();
        let len = sum.len() + 1;
        let mut b = ButterflyAllReduce {
            op,
            members: members.to_vec(),
            me,
            len,
            got: vec![false; n],
            slices: vec![ChunkData::default(); n],
            gathered: vec![false; n],
            result: vec![0.0; len],
            keep_sums,
            lost: vec![false; n],
            outcome: Outcome::Running,
            outbox: Vec::new(),
        };
        for j in 0..n {
            // Part j of the buffer `sum` then the count, copied once.
            let part = b.part(j);
            let mut data = Vec::with_capacity(part.len());
            data.extend_from_slice(&sum[part.start.min(sum.len())..part.end.min(sum.len())]);
            if part.end == len && part.start < len {
                data.push(microbatches as f32);
            }
            let data = Arc::new(data);
            if j == me {
                b.got[me] = true;
                b.slices[me] = data;
            } else {
                let msg = Message::Chunk { op, step: 0, data };
                b.outbox.push((b.members[j], msg));
            }
        }
        b.try_reduce();
        Ok(b)
    }

    fn n(&self) -> usize {
        self.members.len()
    }

    /// The elements of part `k` (the ring's chunk `k`).
    fn part(&self, k: usize) -> std::ops::Range<usize> {
        let (len, n) = (self.len, self.n());
        k * len / n..(k + 1) * len / n
    }

    fn index(&self, m: MemberId) -> Option<usize> {
        self.members.iter().position(|&x| x == m)
    }

    /// Whether I still need something from member `k`: its slice of my part,
    /// or its reduced part.
    fn lacks(&self, k: usize) -> bool {
        !self.got[k] || !self.gathered[k]
    }

    /// Once every slice of my part is here: sums them in member order
    /// (fixed, so the bits do not depend on arrival order) and sends the
    /// reduced part to every other member not known lost.
    fn try_reduce(&mut self) {
        if self.gathered[self.me] || !self.got.iter().all(|&g| g) {
            return;
        }
        let mut slices = std::mem::take(&mut self.slices).into_iter();
        let mut sum = Arc::unwrap_or_clone(slices.next().unwrap_or_default());
        for s in slices {
            for (d, x) in sum.iter_mut().zip(s.iter()) {
                *d += *x;
            }
        }
        let sum = Arc::new(sum);
        for (k, &m) in self.members.iter().enumerate() {
            if k != self.me && !self.lost[k] {
                let msg = Message::Chunk {
                    op: self.op,
                    step: 1 + self.me as u32,
                    data: sum.clone(),
                };
                self.outbox.push((m, msg));
            }
        }
        let range = self.part(self.me);
        self.result[range].copy_from_slice(&sum);
        self.gathered[self.me] = true;
        self.try_finish();
    }

    /// Ends Done once every reduced part is here (as the ring's finish: a
    /// count of zero gives zeros).
    fn try_finish(&mut self) {
        if self.outcome != Outcome::Running || !self.gathered.iter().all(|&g| g) {
            return;
        }
        self.outcome = if self.keep_sums {
            done_with(&self.result)
        } else {
            done_in_place(std::mem::take(&mut self.result))
        };
    }

    /// A message from `from` arrived. Messages of another operation (a late
    /// chunk of an aborted run), from non-members, from members taken for
    /// lost (what they sent before may still arrive) and after the end are
    /// ignored.
    pub fn on_message(&mut self, from: MemberId, msg: Message) {
        if msg.op() != self.op || self.outcome != Outcome::Running {
            return;
        }
        let Some(a) = self.index(from) else {
            return;
        };
        if self.lost[a] {
            return;
        }
        match msg {
            Message::Abort { lost, .. } => {
                // Its sender told everyone: nothing to pass on.
                self.outbox.clear();
                self.slices.clear();
                self.outcome = Outcome::Lost { member: lost };
            }
            Message::Chunk { step, data, .. } => self.on_chunk(a, step, data),
            Message::Resume { .. } => self.fail(
                a,
                format!("resume from {from:x}: a butterfly never sends one"),
            ),
            Message::Complete { .. } => self.fail(
                a,
                format!("complete from {from:x}: a butterfly never sends one"),
            ),
        }
    }

    /// A chunk from member `a` (known, not lost, the operation running).
    fn on_chunk(&mut self, a: usize, step: u32, data: ChunkData) {
        let from = self.members[a];
        if a == self.me {
            self.fail(a, format!("chunk of step {step} from myself ({from:x})"));
            return;
        }
        if step == 0 {
            let want = self.part(self.me).len();
            if data.len() != want {
                self.fail(
                    a,
                    format!(
                        "chunk of step 0 from {from:x} has {} elements, {want} expected",
                        data.len()
                    ),
                );
            } else if self.got[a] {
                self.fail(a, format!("two chunks of step 0 from {from:x}"));
            } else {
                self.got[a] = true;
                self.slices[a] = data;
                self.try_reduce();
            }
            return;
        }
        let k = (step - 1) as usize;
        if k >= self.n() {
            self.fail(
                a,
                format!(
                    "chunk of step {step} from {from:x} (expected steps 0..={})",
                    self.n()
                ),
            );
            return;
        }
        let range = self.part(k);
        if k != a {
            self.fail(
                a,
                format!(
                    "reduced part {k} (step {step}) from {from:x}, which is not its owner {:x}",
                    self.members[k]
                ),
            );
        } else if data.len() != range.len() {
            self.fail(
                a,
                format!(
                    "chunk of step {step} from {from:x} has {} elements, {} expected",
                    data.len(),
                    range.len()
                ),
            );
        } else if self.gathered[k] {
            self.fail(a, format!("two chunks of step {step} from {from:x}"));
        } else {
            self.result[range].copy_from_slice(&data);
            self.gathered[k] = true;
            self.try_finish();
        }
    }

    /// Member `a` broke the protocol: the operation ends here, and the
    /// other members hear of it as the loss of the offender.
    fn fail(&mut self, a: usize, reason: String) {
        self.lost[a] = true;
        self.abort_all(self.members[a]);
        self.outcome = Outcome::Failed { reason };
    }

    /// `member` is gone (its connection broke, or the protocol declared it
    /// dead). If I still need something from it the operation ends Lost for
    /// everyone who needs what I would send (see the module doc); otherwise
    /// I only remember it. Reporting a loss again, a non-member, myself, or
    /// a loss after the end changes nothing.
    pub fn on_peer_lost(&mut self, member: MemberId) {
        let Some(d) = self.index(member) else {
            return;
        };
        if d == self.me || self.lost[d] || self.outcome != Outcome::Running {
            return;
        }
        self.lost[d] = true;
        self.outbox.retain(|(to, _)| *to != member);
        if self.lacks(d) {
            self.abort_all(member);
            self.outcome = Outcome::Lost { member };
        }
    }

    /// Tells every other member not known lost that the operation is over
    /// because of `lost`; nothing else is sent.
    fn abort_all(&mut self, lost: MemberId) {
        self.outbox.clear();
        self.slices.clear();
        for (k, &m) in self.members.iter().enumerate() {
            if k != self.me && !self.lost[k] && m != lost {
                self.outbox.push((m, Message::Abort { op: self.op, lost }));
            }
        }
    }

    /// Whether messages wait in the outbox (the call that ends Done may
    /// also have made this member's reduced part, which the others need).
    pub fn has_outbox(&self) -> bool {
        !self.outbox.is_empty()
    }

    /// Messages to send now, in order (also after the end: the call that
    /// ends Done may also send this member's reduced part).
    pub fn take_outbox(&mut self) -> Vec<(MemberId, Message)> {
        std::mem::take(&mut self.outbox)
    }

    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// Always false: every send is in the outbox the moment it is made, and
    /// nobody can ask a finished member for anything (unlike the ring's
    /// Resume).
    pub fn serving(&self) -> bool {
        false
    }

    pub fn op(&self) -> u64 {
        self.op
    }

    /// Whether I lack something from member `m`: its slice of my part, or
    /// its reduced part (nothing, once Done).
    pub fn needs(&self, m: MemberId) -> bool {
        self.index(m).is_some_and(|k| self.lacks(k))
    }

    /// The reduced buffer (the sums, then the microbatch count) once Done,
    /// if made by [`Self::new_keeping_sums`]: what [`Outcome::Done`]
    /// divides, for a caller that goes on summing (`super::hierarchy`).
    pub fn reduced(&self) -> Option<&[f32]> {
        (self.keep_sums && matches!(self.outcome, Outcome::Done { .. })).then_some(&self.result[..])
    }

    /// The members in the order given (part `k` is `members()[k]`'s).
    pub fn members(&self) -> &[MemberId] {
        &self.members
    }
}

impl Machine for ButterflyAllReduce {
    fn op(&self) -> u64 {
        ButterflyAllReduce::op(self)
    }
    fn on_message(&mut self, from: MemberId, msg: Message) {
        ButterflyAllReduce::on_message(self, from, msg)
    }
    fn on_peer_lost(&mut self, member: MemberId) {
        ButterflyAllReduce::on_peer_lost(self, member)
    }
    fn take_outbox(&mut self) -> Vec<(MemberId, Message)> {
        ButterflyAllReduce::take_outbox(self)
    }
    fn outcome(&self) -> &Outcome {
        ButterflyAllReduce::outcome(self)
    }
    fn keep(&self) -> bool {
        self.has_outbox()
    }
}

#[cfg(test)]
#[path = "butterfly_tests.rs"]
mod tests;
