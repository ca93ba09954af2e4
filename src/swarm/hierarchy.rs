//! The stage all-reduce of a large stage: butterflies of butterflies, so
//! that its time grows with the number of message rounds (five, up to
//! `group_max²` members), not with the members (a ring pays `2 (n-1)`
//! latencies in sequence: minutes at a thousand members on wide-area
//! links).
//!
//! The members, in the commit's order (the coordinator orders them by the
//! links they measured, so neighbours in the order are near each other),
//! are cut into `G = ceil(n / group_max)` contiguous groups of nearly equal
//! size; `K`, the size of the smallest group, is the number of *columns*.
//! The buffer (the sums, then the microbatch count as one f32) is cut into
//! `K` parts, `[c L / K, (c+1) L / K)`.
//! 1. **Group** (wire steps below [`COLUMN_STEP`]): every group runs a
//!    [`ButterflyAllReduce`] of the whole buffer among its members; each of
//!    them ends holding the group's sum.
//! 2. **Column** (steps from [`COLUMN_STEP`]): the member at position `c <
//!    K` of every group joins column `c`, a butterfly of part `c` of the
//!    group sums among the `G` groups' members at that position; each ends
//!    holding part `c` of the total.
//! 3. **Parts** (step [`PART_STEP`]` + c`): the member at position `c`
//!    sends part `c` of the total to every other member of its group. A
//!    member ends [`Outcome::Done`] when it holds all `K` parts.
//!
//! Every member sends and receives about three times the buffer (twice in
//! its group, once more spread over the parts), where a flat butterfly or
//! ring moves twice: the price of `2 (s-1) + 2 (G-1) + (s-1)` messages per
//! member instead of `2 (n-1)` (`s` the group's size), and of five rounds
//! instead of two (the butterfly) or `2 (n-1)` (the ring).
//!
//! Determinism: each group's sum is the group butterfly's (summed by each
//! part's owner in member order), each column's by its owners in group
//! order, and every other copy is verbatim; so every member that ends Done
//! holds the same bits, which do not depend on arrival order.
//!
//! Exactly once: a member's contribution enters its group's butterfly once
//! (that butterfly's rules), and a group's sum enters each column once
//! (the column butterfly's rules); a part is taken once and only from the
//! member at its position in the receiver's group.
//!
//! # A lost member
//!
//! The butterflies keep their rules: a member that lacks something a lost
//! member alone holds ends [`Outcome::Lost`]. So does a member still
//! waiting for a part from the lost member. A member that ends Lost (or
//! hears an abort, or fails on a message the protocol cannot send) tells
//! everyone who may wait for it, every other member of its group and of
//! its column, with [`Message::Abort`], and its receivers pass it on once
//! the same way: a member whose group or column cannot finish cannot send
//! its part, so those who wait for that must hear of it. A Done member
//! ignores losses and aborts (it owes nobody anything: it sent its slices
//! and its group part when it made them, and its column part before it
//! could end).
//!
//! What holds, with members lost by crashes at any moments, once every
//! message is delivered and every loss reported (tested on the in-memory
//! network with random losses):
//! - every survivor ends, Done or Lost;
//! - every survivor that ends Done holds every original member's
//!   contribution, bit-identical to every other Done member;
//! - a survivor told of a loss while it still needed something from the
//!   lost member does not end Done.
//!
//! As with the butterfly, Done means the result is ready, not that it may
//! be applied: the stage coordinator decides, and otherwise commits again
//! among the survivors.
use super::allreduce::{done_with, ChunkData, Machine, MemberId, Message, Outcome, SetupError};
use super::butterfly::ButterflyAllReduce;
use std::ops::Range;
use std::sync::Arc;

/// The first wire step of a column's butterfly (a group's butterfly uses
/// steps `0..=group_max`).
pub const COLUMN_STEP: u32 = 1 << 16;
/// The wire step of part 0 of the total (part `c` is `PART_STEP + c`).
pub const PART_STEP: u32 = 1 << 17;
/// The largest group a hierarchy accepts: its butterfly's steps stay below
/// [`COLUMN_STEP`], and its columns' below [`PART_STEP`].
pub const GROUP_MAX_LIMIT: usize = (COLUMN_STEP as usize) - 2;

/// The contiguous groups of `n` members with at most `group_max` each
/// (`group_max >= 1`): `ceil(n / group_max)` groups whose sizes differ by
/// at most one.
pub fn groups(n: usize, group_max: usize) -> Vec<Range<usize>> {
    let g = n.div_ceil(group_max.max(1)).max(1);
    (0..g).map(|k| k * n / g..(k + 1) * n / g).collect()
}

/// One member's side of one hierarchical all-reduce.
#[derive(Debug)]
pub struct HierarchicalAllReduce {
    op: u64,
    members: Vec<MemberId>,
    me: usize,
    /// Every group, as a range of indices into `members`.
    groups: Vec<Range<usize>>,
    /// My group, and my position in it.
    group: usize,
    pos: usize,
    /// `K`: the smallest group's size.
    columns: usize,
    /// Elements of the buffer: the gradients, then the count.
    len: usize,
    /// My group's butterfly.
    inner: ButterflyAllReduce,
    /// My column's butterfly, once my group's sum is here (only at a
    /// position below `columns`).
    column: Option<ButterflyAllReduce>,
    /// Column slices that came before my column started: at most one per
    /// other group.
    early: Vec<(MemberId, ChunkData)>,
    /// By part: whether it is in `result`.
    gathered: Vec<bool>,
    result: Vec<f32>,
    /// By member index: reported lost, or an offender.
    lost: Vec<bool>,
    outcome: Outcome,
    outbox: Vec<(MemberId, Message)>,
}

impl HierarchicalAllReduce {
    /// Sets up member `me`'s side of operation `op` among `members` (the
    /// same order at every member: it decides the groups, the columns and
    /// the order of the sums) in groups of at most `group_max` (`1 ..=`
    /// [`GROUP_MAX_LIMIT`], the same at every member), contributing `sum`
    /// and `microbatches`. The group butterfly's first slices are in the
    /// outbox at once.
    pub fn new(
        op: u64,
        me: MemberId,
        members: &[MemberId],
        sum: &[f32],
        microbatches: u64,
        group_max: usize,
    ) -> Result<HierarchicalAllReduce, SetupError> {
        let mut sorted = members.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(SetupError::DuplicateMember(w[0]));
        }
        let me_idx = members
            .iter()
            .position(|&m| m == me)
            .ok_or(SetupError::NotAMember)?;
        let groups = groups(members.len(), group_max.clamp(1, GROUP_MAX_LIMIT));
        let group = groups.partition_point(|r| r.end <= me_idx);
        let pos = me_idx - groups[group].start;
        let columns = groups.iter().map(|r| r.len()).min().unwrap_or(1);
        let inner = ButterflyAllReduce::new_keeping_sums(
            op,
            me,
            &members[groups[group].clone()],
            sum,
            microbatches,
        )?;
        let len = sum.len() + 1;
        let mut h = HierarchicalAllReduce {
            op,
            members: members.to_vec(),
            me: me_idx,
            groups,
            group,
            pos,
            columns,
            len,
            inner,
            column: None,
            early: Vec::new(),
            gathered: vec![false; columns],
            result: vec![0.0; len],
            lost: vec![false; members.len()],
            outcome: Outcome::Running,
            outbox: Vec::new(),
        };
        h.advance();
        Ok(h)
    }

    /// The elements of part `c` of the buffer.
    fn part(&self, c: usize) -> Range<usize> {
        c * self.len / self.columns..(c + 1) * self.len / self.columns
    }

    fn index(&self, m: MemberId) -> Option<usize> {
        self.members.iter().position(|&x| x == m)
    }

    fn group_of(&self, idx: usize) -> usize {
        self.groups.partition_point(|r| r.end <= idx)
    }

    /// (group, position) of member index `idx`.
    fn place(&self, idx: usize) -> (usize, usize) {
        let g = self.group_of(idx);
        (g, idx - self.groups[g].start)
    }

    /// Whether member index `idx` is in my column (not me).
    fn in_my_column(&self, idx: usize) -> bool {
        let (g, p) = self.place(idx);
        g != self.group && p == self.pos && self.pos < self.columns
    }

    /// My column's members, in group order.
    fn column_members(&self) -> Vec<MemberId> {
        (self.groups.iter())
            .map(|r| self.members[r.start + self.pos])
            .collect()
    }

    /// Whether I still need something from member `m`: a slice or a
    /// reduced part of my group's or my column's butterfly, or its part of
    /// the total.
    pub fn needs(&self, m: MemberId) -> bool {
        let Some(idx) = self.index(m) else {
            return false;
        };
        if self.outcome != Outcome::Running || idx == self.me {
            return false;
        }
        let (g, p) = self.place(idx);
        if g == self.group {
            return self.inner.needs(m) || (p < self.columns && !self.gathered[p]);
        }
        if self.in_my_column(idx) && !self.gathered[self.pos] {
            // A column not started yet needs every peer's reduced part.
            return self.column.as_ref().is_none_or(|c| c.needs(m));
        }
        false
    }

    /// Moves the butterflies' sends to my outbox, starts my column once my
    /// group's sum is here, sends my part of the total once my column
    /// holds it, and ends Done once every part is here (or Lost, when a
    /// butterfly did).
    fn advance(&mut self) {
        let op = self.op;
        let running = self.outcome == Outcome::Running;
        for (to, msg) in self.inner.take_outbox() {
            // A butterfly's abort: this machine tells everyone itself.
            if let (true, Message::Chunk { step, data, .. }) = (running, msg) {
                self.outbox.push((to, Message::Chunk { op, step, data }));
            }
        }
        if !running {
            if let Some(c) = &mut self.column {
                c.take_outbox();
            }
            return;
        }
        if let Outcome::Lost { member } = *self.inner.outcome() {
            return self.end_lost(member);
        }
        if self.column.is_none() && self.pos < self.columns {
            if let Some(group_sum) = self.inner.reduced() {
                let mine = group_sum[self.part(self.pos)].to_vec();
                if let Err(e) = self.start_column(&mine) {
                    let reason = format!("the column could not start: {e}");
                    return self.end_failed(None, reason);
                }
                if self.outcome != Outcome::Running {
                    return;
                }
            }
        }
        let Some(c) = self.column.as_mut() else {
            return self.try_finish();
        };
        let sends = c.take_outbox();
        let lost = match *c.outcome() {
            Outcome::Lost { member } => Some(member),
            _ => None,
        };
        let total = c.reduced().map(|t| t.to_vec());
        for (to, msg) in sends {
            if let Message::Chunk { step, data, .. } = msg {
                let step = COLUMN_STEP + step;
                self.outbox.push((to, Message::Chunk { op, step, data }));
            }
        }
        if let Some(member) = lost {
            return self.end_lost(member);
        }
        if let (false, Some(total)) = (self.gathered[self.pos], total) {
            let range = self.part(self.pos);
            let data = Arc::new(total[..range.len()].to_vec());
            self.result[range].copy_from_slice(&data);
            self.gathered[self.pos] = true;
            let step = PART_STEP + self.pos as u32;
            for k in self.groups[self.group].clone() {
                if k != self.me && !self.lost[k] {
                    let msg = Message::Chunk {
                        op,
                        step,
                        data: data.clone(),
                    };
                    self.outbox.push((self.members[k], msg));
                }
            }
        }
        self.try_finish();
    }

    /// Ends Done once every part of the total is here.
    fn try_finish(&mut self) {
        if self.outcome == Outcome::Running && self.gathered.iter().all(|&g| g) {
            self.outcome = done_with(&self.result);
        }
    }

    /// Starts my column with my part of my group's sum: the slices that
    /// came early go in first, then the losses known (none: a column
    /// peer's loss before my column starts ends the operation).
    fn start_column(&mut self, mine: &[f32]) -> Result<(), SetupError> {
        let me = self.members[self.me];
        let mut c =
            ButterflyAllReduce::new_keeping_sums(self.op, me, &self.column_members(), mine, 0)?;
        for (from, data) in std::mem::take(&mut self.early) {
            let step = 0;
            let op = self.op;
            c.on_message(from, Message::Chunk { op, step, data });
            if let Outcome::Failed { reason } = c.outcome() {
                let reason = reason.clone();
                self.column = Some(c);
                self.end_failed(self.index(from), reason);
                return Ok(());
            }
        }
        for k in 0..self.members.len() {
            if self.lost[k] && self.in_my_column(k) {
                c.on_peer_lost(self.members[k]);
            }
        }
        self.column = Some(c);
        Ok(())
    }

    /// A message from `from` arrived. Messages of another operation, from
    /// non-members, from members taken for lost and after the end are
    /// ignored; a message the protocol cannot send ends the operation
    /// [`Outcome::Failed`], and the others hear of it as the offender's
    /// loss.
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
        if a == self.me {
            return self.end_failed(Some(a), format!("a message from myself ({from:x})"));
        }
        match msg {
            Message::Abort { lost, .. } => return self.end_lost(lost),
            Message::Chunk { step, data, .. } => self.on_chunk(a, step, data),
            Message::Resume { .. } | Message::Complete { .. } => {
                let reason = format!("a ring's message from {from:x} in a hierarchy");
                return self.end_failed(Some(a), reason);
            }
        }
        if self.outcome == Outcome::Running {
            self.advance();
        }
    }

    fn on_chunk(&mut self, a: usize, step: u32, data: ChunkData) {
        let from = self.members[a];
        let (g, p) = self.place(a);
        let op = self.op;
        if step < COLUMN_STEP {
            if g != self.group {
                let reason = format!("a group chunk (step {step}) from {from:x} of another group");
                return self.end_failed(Some(a), reason);
            }
            self.inner
                .on_message(from, Message::Chunk { op, step, data });
            if let Outcome::Failed { reason } = self.inner.outcome() {
                let reason = reason.clone();
                self.end_failed(Some(a), reason);
            }
        } else if step < PART_STEP {
            let step = step - COLUMN_STEP;
            if !self.in_my_column(a) {
                let reason =
                    format!("a column chunk (step {step}) from {from:x}, not of my column");
                return self.end_failed(Some(a), reason);
            }
            if let Some(c) = self.column.as_mut() {
                c.on_message(from, Message::Chunk { op, step, data });
                if let Outcome::Failed { reason } = c.outcome() {
                    let reason = reason.clone();
                    self.end_failed(Some(a), reason);
                }
            } else if step != 0 {
                let reason = format!("column step {step} from {from:x} before my slice was sent");
                self.end_failed(Some(a), reason);
            } else if self.early.iter().any(|(m, _)| *m == from) {
                let reason = format!("two column slices from {from:x}");
                self.end_failed(Some(a), reason);
            } else {
                self.early.push((from, data));
            }
        } else {
            let c = (step - PART_STEP) as usize;
            let problem = if c >= self.columns || g != self.group || p != c {
                Some(format!("part {c} from {from:x}, which does not own it"))
            } else if data.len() != self.part(c).len() {
                let want = self.part(c).len();
                Some(format!(
                    "part {c} from {from:x} has {} elements, {want} expected",
                    data.len()
                ))
            } else if self.gathered[c] {
                Some(format!("two copies of part {c} from {from:x}"))
            } else {
                None
            };
            if let Some(reason) = problem {
                return self.end_failed(Some(a), reason);
            }
            let range = self.part(c);
            self.result[range].copy_from_slice(&data);
            self.gathered[c] = true;
        }
    }

    /// `member` is gone. If I still need something from it the operation
    /// ends Lost and everyone who waits for me hears of it; otherwise I
    /// only remember it. A loss reported again, of a non-member, of myself
    /// or after the end changes nothing.
    pub fn on_peer_lost(&mut self, member: MemberId) {
        let Some(d) = self.index(member) else {
            return;
        };
        if d == self.me || self.lost[d] || self.outcome != Outcome::Running {
            return;
        }
        self.lost[d] = true;
        self.outbox.retain(|(to, _)| *to != member);
        let (g, p) = self.place(d);
        if g == self.group {
            self.inner.on_peer_lost(member);
            if p < self.columns && !self.gathered[p] {
                return self.end_lost(member);
            }
        } else if self.in_my_column(d) {
            match &mut self.column {
                Some(c) => c.on_peer_lost(member),
                // Its reduced part of my column can never come.
                None => return self.end_lost(member),
            }
        }
        self.advance();
    }

    fn end_lost(&mut self, lost: MemberId) {
        self.abort_all(lost);
        self.outcome = Outcome::Lost { member: lost };
    }

    /// Ends Failed; the offender (if a member sent what the protocol
    /// cannot) is taken for lost, and the others hear of it as its loss.
    fn end_failed(&mut self, offender: Option<usize>, reason: String) {
        let lost = match offender {
            Some(a) => {
                self.lost[a] = true;
                self.members[a]
            }
            None => self.members[self.me],
        };
        self.abort_all(lost);
        self.outcome = Outcome::Failed { reason };
    }

    /// Tells every member of my group and my column not known lost that
    /// the operation is over because of `lost`; nothing else is sent.
    fn abort_all(&mut self, lost: MemberId) {
        self.outbox.clear();
        self.early.clear();
        self.inner.take_outbox();
        if let Some(c) = &mut self.column {
            c.take_outbox();
        }
        for k in 0..self.members.len() {
            let m = self.members[k];
            let near = self.group_of(k) == self.group || self.in_my_column(k);
            if k != self.me && near && !self.lost[k] && m != lost {
                self.outbox.push((m, Message::Abort { op: self.op, lost }));
            }
        }
    }

    /// Messages to send now, in order (also after the end: the call that
    /// ends Done may also send this member's part).
    pub fn take_outbox(&mut self) -> Vec<(MemberId, Message)> {
        std::mem::take(&mut self.outbox)
    }

    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    pub fn op(&self) -> u64 {
        self.op
    }

    /// The groups (ranges of indices into the members, in their order).
    pub fn group_ranges(&self) -> &[Range<usize>] {
        &self.groups
    }
}

impl Machine for HierarchicalAllReduce {
    fn op(&self) -> u64 {
        HierarchicalAllReduce::op(self)
    }
    fn on_message(&mut self, from: MemberId, msg: Message) {
        HierarchicalAllReduce::on_message(self, from, msg)
    }
    fn on_peer_lost(&mut self, member: MemberId) {
        HierarchicalAllReduce::on_peer_lost(self, member)
    }
    fn take_outbox(&mut self) -> Vec<(MemberId, Message)> {
        HierarchicalAllReduce::take_outbox(self)
    }
    fn outcome(&self) -> &Outcome {
        HierarchicalAllReduce::outcome(self)
    }
    fn keep(&self) -> bool {
        !self.outbox.is_empty()
    }
}

#[cfg(test)]
#[path = "hierarchy_tests.rs"]
mod tests;
