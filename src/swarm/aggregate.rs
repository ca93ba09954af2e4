//! The stage all-reduce a runtime node runs for the protocol's aggregate
//! task: one operation at a time, among the commit's members, fed by the
//! driver with chunk frames and lost peers.
//!
//! A commit of up to [`BUTTERFLY_MAX_MEMBERS`] members runs one
//! [`ButterflyAllReduce`]: every member reduces one part, two message
//! rounds over all of a member's links at once (a ring pays `2 (n-1)`
//! message latencies in sequence: in `geo10` the holders' all-reduce takes
//! 3.7 s instead of 11.8 s). A larger commit (a butterfly would connect
//! every two members) runs a [`HierarchicalAllReduce`]: butterflies in
//! groups of up to [`BUTTERFLY_MAX_MEMBERS`], then across the groups, five
//! message rounds whatever the size (up to 4,096 members).
//!
//! The two-way ring is kept for the ring's own tests, which run every
//! commit as two [`RingAllReduce`]s at once, one per
//! direction: the first half of the buffer goes around the commit's ring,
//! the second half around the same ring the other way. Every link between ring neighbours
//! then carries data both ways, where one ring leaves the way back idle:
//! a wide-area link is full duplex (each direction has its own
//! bandwidth), and the ring's steps wait for its slowest link, so each
//! step moves half a chunk in about half the time. Each direction keeps
//! its ring's guarantees (the same bits at every member, a member lost in
//! the all-gather half bypassed); the operation ends with the mean when
//! both do, and without it when either does not.
//!
//! Chunks of an operation this node has not started yet (a faster
//! member is ahead) wait, bounded; a newer commit of the same iteration
//! replaces the operation in progress. An operation that ended with the
//! mean is kept while it serves (`RingAllReduce::serving`: a neighbour's
//! neighbour may still ask it to stand in for a lost member) or has
//! messages to send, until it stops or the next operation starts.
use super::allreduce::{Machine, Message, Outcome, RingAllReduce, SetupError};
use super::allreduce_net::{frame_of, message_with, ChunkBuffers};
use super::butterfly::ButterflyAllReduce;
use super::hierarchy::HierarchicalAllReduce;
use crate::engine::{Frame, Transport};
use crate::protocol::{AggregatePlan, NodeId, TaskId, BUTTERFLY_MAX_MEMBERS};
use std::collections::VecDeque;
use std::time::Duration;

/// Chunks kept for operations not started yet.
const EARLY_MAX: usize = 256;
/// Peers remembered as lost, at most (the newest kept).
const LOST_MAX: usize = 1024;
/// Bytes of them kept, unless set ([`Aggregation::with_early_budget`]).
const EARLY_BYTES_MAX: usize = 64 << 20;

struct Running {
    task: TaskId,
    iter: u32,
    stage: u32,
    /// The butterfly; or the first half of the buffer around the ring and
    /// the second half the other way. Each holds its part of the buffer,
    /// in order.
    machines: Vec<Box<dyn Machine>>,
    /// The other members.
    members: Vec<u64>,
    /// Members whose connection broke while it ran (they may be back at
    /// once: a connection that failed under live ends).
    broken: Vec<u64>,
    /// Why it ended without the mean, whatever its machines say.
    failed: Option<String>,
    /// Sent chunks' buffers, for the chunks received next.
    buffers: ChunkBuffers,
}

impl Running {
    /// The machine that runs operation `op`, if one does.
    fn machine_of(&mut self, op: u64) -> Option<&mut Box<dyn Machine>> {
        self.machines.iter_mut().find(|r| r.op() == op)
    }

    fn serving(&self) -> bool {
        self.machines.iter().any(|r| r.keep())
    }

    /// How the operation ended: with the mean when every machine did (the
    /// parts joined in order, the microbatch count once), without it when
    /// one did not; `None` while one still runs.
    fn end(&self) -> Option<Result<(Vec<f32>, u64), String>> {
        if let Some(why) = &self.failed {
            return Some(Err(why.clone()));
        }
        for r in &self.machines {
            match r.outcome() {
                Outcome::Failed { reason } => return Some(Err(reason.clone())),
                Outcome::Lost { member } => return Some(Err(format!("member {member:x} lost"))),
                _ => {}
            }
        }
        let mut mean = Vec::new();
        let mut count = 0;
        for r in &self.machines {
            let Outcome::Done {
                mean: part,
                microbatches,
            } = r.outcome()
            else {
                return None;
            };
            mean.extend_from_slice(part);
            count = *microbatches;
        }
        Some(Ok((mean, count)))
    }
}

/// How an operation ended: its task, iteration, and the mean with its
/// microbatch count, or why it did not finish.
pub type Finished = (TaskId, u32, Result<(Vec<f32>, u64), String>);

pub struct Aggregation {
    running: Option<Running>,
    /// The last operation, done but still serving.
    serving: Option<Running>,
    /// Peers lost lately, oldest first: an operation that starts later
    /// learns of those among its members at once (nothing would tell it
    /// again, and its ring would wait for them).
    lost: VecDeque<u64>,
    early: VecDeque<Frame>,
    /// Bytes of the early chunks, and how many they may be: each holds a
    /// pool slot, and a pool held by chunks nobody uses stops the node.
    early_bytes: usize,
    early_budget: usize,
    /// Commits of up to this many members run the butterfly
    /// ([`BUTTERFLY_MAX_MEMBERS`]; tests of the ring set it lower).
    butterfly_max: usize,
    /// Larger commits go around the two-way ring instead of the hierarchy
    /// (the ring's tests).
    rings_beyond: bool,
}

impl Default for Aggregation {
    fn default() -> Self {
        Aggregation::with_early_budget(EARLY_BYTES_MAX)
    }
}

/// The operation ids of a commit, one per ring direction (a butterfly uses
/// the first): unique per stage, iteration, epoch and direction.
pub fn op_ids(stage: u32, iter: u32, epoch: u64) -> [u64; 2] {
    [0u64, 1].map(|direction| {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for x in [stage as u64, iter as u64, epoch, direction] {
            h ^= x;
            h = h.wrapping_mul(0x0100_0000_01b3).rotate_left(29);
        }
        h
    })
}

impl Aggregation {
    /// An aggregation that keeps at most `bytes` of early chunks (the
    /// oldest go first).
    pub fn with_early_budget(bytes: usize) -> Aggregation {
        Aggregation {
            running: None,
            serving: None,
            lost: VecDeque::new(),
            early: VecDeque::new(),
            early_bytes: 0,
            early_budget: bytes,
            butterfly_max: BUTTERFLY_MAX_MEMBERS,
            rings_beyond: false,
        }
    }

    /// Bytes of chunks kept for operations not started yet.
    pub fn early_bytes(&self) -> usize {
        self.early_bytes
    }

    /// Starts this member's side of `plan`'s all-reduce with `sum` (over
    /// `plan.granted`), replacing any operation in progress.
    pub fn start(
        &mut self,
        stage: u32,
        me: NodeId,
        task: TaskId,
        plan: AggregatePlan,
        sum: &[f32],
    ) -> Result<(), SetupError> {
        self.running = None;
        self.serving = None;
        let ring: Vec<u64> = plan.members.iter().map(|&m| m as u64).collect();
        let [op, op_back] = op_ids(stage, plan.iter, plan.epoch);
        let mbs = plan.granted.len() as u64;
        let mut machines: Vec<Box<dyn Machine>> = if ring.len() <= self.butterfly_max {
            vec![Box::new(ButterflyAllReduce::new(
                op, me as u64, &ring, sum, mbs,
            )?)]
        } else if !self.rings_beyond {
            vec![Box::new(HierarchicalAllReduce::new(
                op,
                me as u64,
                &ring,
                sum,
                mbs,
                BUTTERFLY_MAX_MEMBERS,
            )?)]
        } else {
            let back: Vec<u64> = ring.iter().rev().copied().collect();
            let (first, second) = sum.split_at(sum.len().div_ceil(2));
            vec![
                Box::new(RingAllReduce::new(op, me as u64, &ring, first, mbs)?),
                Box::new(RingAllReduce::new(op_back, me as u64, &back, second, mbs)?),
            ]
        };
        for r in &mut machines {
            for &m in &self.lost {
                r.on_peer_lost(m);
            }
        }
        self.running = Some(Running {
            task,
            iter: plan.iter,
            stage,
            machines,
            members: ring.iter().copied().filter(|&m| m != me as u64).collect(),
            broken: Vec::new(),
            failed: None,
            buffers: ChunkBuffers::default(),
        });
        // Chunks that came before we started.
        let early: Vec<Frame> = std::mem::take(&mut self.early).into();
        self.early_bytes = 0;
        for f in early {
            self.on_frame(f);
        }
        Ok(())
    }

    /// A chunk (or abort) frame.
    pub fn on_frame(&mut self, f: Frame) {
        let (op, stage) = (f.header.microbatch, f.header.stage);
        if self.route(f.peer(), op, stage, |bufs| message_with(stage, &f, bufs)) {
            return;
        }
        if f.len() > self.early_budget {
            return;
        }
        while self.early.len() >= EARLY_MAX || self.early_bytes + f.len() > self.early_budget {
            match self.early.pop_front() {
                Some(old) => self.early_bytes -= old.len(),
                None => break,
            }
        }
        self.early_bytes += f.len();
        self.early.push_back(f);
    }

    /// Gives the message of operation `op` of `stage` from `from` (decoded
    /// by `msg` if it is one of ours; a malformed one is its sender's
    /// loss) to the operation running or serving it: false if neither is.
    fn route(
        &mut self,
        from: u64,
        op: u64,
        stage: u32,
        msg: impl FnOnce(&mut ChunkBuffers) -> Option<Result<Message, String>>,
    ) -> bool {
        let Some(r) = [self.running.as_mut(), self.serving.as_mut()]
            .into_iter()
            .flatten()
            .find(|r| r.stage == stage && r.machines.iter().any(|x| x.op() == op))
        else {
            return false;
        };
        match msg(&mut r.buffers) {
            Some(Ok(msg)) => {
                if let Some(m) = r.machine_of(op) {
                    m.on_message(from, msg);
                }
            }
            // A malformed message ends its sender's part in every machine.
            Some(Err(_)) => {
                for m in &mut r.machines {
                    m.on_peer_lost(from);
                }
            }
            None => {}
        }
        true
    }

    pub fn on_peer_lost(&mut self, peer: u64) {
        if !self.lost.contains(&peer) {
            if self.lost.len() >= LOST_MAX {
                self.lost.pop_front();
            }
            self.lost.push_back(peer);
        }
        for r in [self.running.as_mut(), self.serving.as_mut()]
            .into_iter()
            .flatten()
        {
            for m in &mut r.machines {
                m.on_peer_lost(peer);
            }
        }
    }

    /// The connection to `peer` broke. It may be back at once (both ends
    /// live; the driver waits a grace before it calls the peer lost, see
    /// [`Aggregation::on_peer_lost`]): the operation running remembers it.
    pub fn on_link_broken(&mut self, peer: u64) {
        if let Some(r) = self.running.as_mut() {
            if r.members.contains(&peer) && !r.broken.contains(&peer) && r.end().is_none() {
                r.broken.push(peer);
            }
        }
    }

    /// `peer` is connected (again): it is not lost for operations that
    /// start from now on. An operation it was in when its connection
    /// broke ends without the mean: chunks on the broken connection may
    /// be gone at either end, and nobody would send them again (the
    /// coordinator commits again when told, the stuck members with it).
    /// Returns whether that ended it.
    pub fn on_peer_back(&mut self, peer: u64) -> bool {
        self.lost.retain(|&p| p != peer);
        let Some(r) = self.running.as_mut() else {
            return false;
        };
        if !r.broken.contains(&peer) || r.end().is_some() {
            return false;
        }
        r.failed = Some(format!(
            "the connection to member {peer:x} broke and came back during the all-reduce: \
             chunks on it may be lost"
        ));
        true
    }

    /// The frames the operation asks to send (to, frame); a frame that
    /// cannot be made is a member lost.
    pub fn outgoing(&mut self, net: &Transport) -> Vec<(u64, Frame)> {
        let mut out = Vec::new();
        for r in [self.running.as_mut(), self.serving.as_mut()]
            .into_iter()
            .flatten()
        {
            for m in &mut r.machines {
                for (to, msg) in m.take_outbox() {
                    match frame_of(net, r.stage, &msg, Duration::from_secs(5)) {
                        Ok(f) => out.push((to, f)),
                        Err(_) => m.on_peer_lost(to),
                    }
                    r.buffers.recycle(msg);
                }
            }
        }
        if self.serving.as_ref().is_some_and(|r| !r.serving()) {
            self.serving = None;
        }
        out
    }

    /// How the operation ended, once.
    pub fn finished(&mut self) -> Option<Finished> {
        let end = self.running.as_ref()?.end()?;
        let r = self.running.take().expect("running");
        let (task, iter) = (r.task, r.iter);
        if r.serving() {
            self.serving = Some(r);
        }
        Some((task, iter, end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::MbId;
    use std::sync::Arc;

    use crate::swarm::allreduce_net::message_of;
    use crate::swarm::allreduce_net::tests::node as net;

    /// An aggregation that runs every commit around the ring (both ways),
    /// as commits beyond [`BUTTERFLY_MAX_MEMBERS`] members do.
    fn ring_only() -> Aggregation {
        Aggregation {
            butterfly_max: 0,
            rings_beyond: true,
            ..Default::default()
        }
    }

    /// Member 1's side of the ring 1 -> 2 -> 3 -> 1 of stage 4, iteration
    /// 0, two microbatches of ten gradients: the first five go around the
    /// ring (from 3, to 2), the last five the other way (from 2, to 3);
    /// six elements each with the count: chunks of two. The operation ids,
    /// in that order.
    fn started(agg: &mut Aggregation) -> [u64; 2] {
        let sum: Vec<f32> = (0..10).map(|i| i as f32).collect();
        agg.start(4, 1, 77, plan(2), &sum).unwrap();
        op_ids(4, 0, 1)
    }

    /// The commit of stage 4, iteration 0, epoch 1 among members 1, 2, 3,
    /// with `granted` microbatches granted to this member.
    fn plan(granted: u32) -> AggregatePlan {
        AggregatePlan {
            iter: 0,
            epoch: 1,
            members: Arc::new(vec![1, 2, 3]),
            granted: (0..granted)
                .map(|idx| MbId {
                    holder: 9,
                    iter: 0,
                    idx,
                })
                .collect(),
        }
    }

    /// Members 1, 2, 3 (by `new`) started, member `m` with `m` microbatches
    /// and its own sums of 11 gradients: the aggregations and the sums.
    fn three_started(new: fn() -> Aggregation) -> (Vec<Aggregation>, Vec<Vec<f32>>) {
        let sums: Vec<Vec<f32>> = (1..=3)
            .map(|m| (0..11).map(|i| (m * 100 + i) as f32).collect())
            .collect();
        let mut aggs: Vec<Aggregation> = (0..3).map(|_| new()).collect();
        for (i, agg) in aggs.iter_mut().enumerate() {
            let m = i as u32 + 1;
            agg.start(4, m, 70 + m as u64, plan(m), &sums[i]).unwrap();
        }
        (aggs, sums)
    }

    /// Member `i + 1`'s frame `f` to member `to`, which takes it.
    fn deliver(aggs: &mut [Aggregation], i: usize, to: u64, f: &Frame) {
        let msg = message_of(4, f);
        let taken = aggs[to as usize - 1].route(i as u64 + 1, f.header.microbatch, 4, |_| msg);
        assert!(taken);
    }

    /// Every member ended with the mean, the same bits, the weighted mean
    /// of the three sums (6 microbatches).
    fn assert_the_mean(ends: Vec<Option<Finished>>, sums: &[Vec<f32>]) {
        let mut means = Vec::new();
        for e in ends {
            let (_, _, end) = e.expect("done");
            means.push(end.expect("the mean"));
        }
        assert!(means.iter().all(|m| *m == means[0]), "the same bits");
        let (mean, microbatches) = &means[0];
        assert_eq!(*microbatches, 6);
        for (j, x) in mean.iter().enumerate() {
            let want = (sums[0][j] + sums[1][j] + sums[2][j]) / 6.0;
            assert!((x - want).abs() < 1e-4, "element {j}: {x} against {want}");
        }
    }

    fn chunk(op: u64, step: u32) -> Message {
        Message::Chunk {
            op,
            step,
            data: vec![0.5; 2].into(),
        }
    }

    /// The messages in `out`, with their destination.
    fn decoded(out: Vec<(u64, Frame)>) -> Vec<(u64, Message)> {
        out.into_iter()
            .map(|(to, f)| (to, message_of(4, &f).unwrap().unwrap()))
            .collect()
    }

    /// Three members, each with its own sums, exchange their frames until
    /// every one is done: all hold the same bits, the microbatch-weighted
    /// mean of every element (the first half went around the ring, the
    /// second the other way: two operation ids, and a first step to each
    /// neighbour).
    #[test]
    fn both_directions_make_the_mean() {
        let net = net();
        let (mut aggs, sums) = three_started(ring_only);
        let [op, back] = op_ids(4, 0, 1);
        assert_ne!(op, back);
        let mut ends = vec![None, None, None];
        for round in 0..100 {
            let mut sent = 0;
            for i in 0..3 {
                for (to, f) in aggs[i].outgoing(&net) {
                    if round == 0 {
                        let next = if f.header.microbatch == op {
                            i + 1
                        } else {
                            i + 2
                        };
                        assert_eq!(to as usize, next % 3 + 1, "first steps");
                    }
                    deliver(&mut aggs, i, to, &f);
                    sent += 1;
                }
                if let Some(e) = aggs[i].finished() {
                    ends[i] = Some(e);
                }
            }
            if sent == 0 {
                break;
            }
        }
        assert_the_mean(ends, &sums);
    }

    /// Member 1 ends with the mean, and stays to serve member 3 (two to its
    /// right) should member 2 be lost: 3's Resume, after the end, is
    /// answered with the chunk 2 would have forwarded; then the operation
    /// is let go.
    #[test]
    fn a_done_operation_serves_a_late_resume() {
        let (net, mut agg) = (net(), ring_only());
        let [op, back] = started(&mut agg);
        for step in 0..4 {
            assert!(agg.route(3, op, 4, |_| Some(Ok(chunk(op, step)))));
            assert!(agg.route(2, back, 4, |_| Some(Ok(chunk(back, step)))));
        }
        agg.outgoing(&net);
        let (task, iter, end) = agg.finished().expect("done");
        assert_eq!((task, iter), (77, 0));
        assert!(end.is_ok(), "{end:?}");
        assert!(agg.running.is_none() && agg.serving.is_some());
        // 3 noticed 2 gone after it had wire step 2 (the all-gather's
        // first): it asks for step 3, which 1 sent 2 at step 2.
        let resume = Message::Resume {
            op,
            lost: 2,
            step: 3,
        };
        assert!(agg.route(3, op, 4, |_| Some(Ok(resume))));
        let out = decoded(agg.outgoing(&net));
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(matches!(out[0], (3, Message::Chunk { step: 3, .. })));
        // The way back (3 -> 2 -> 1 -> 3) still serves until 2, two to
        // its right there, holds every chunk.
        assert!(agg.serving.is_some());
        assert!(agg.route(2, back, 4, |_| Some(Ok(Message::Complete { op: back }))));
        agg.outgoing(&net);
        assert!(agg.serving.is_none(), "served: let go");
        // Another operation's message is not taken.
        assert!(!agg.route(3, op, 4, |_| Some(Ok(chunk(op, 0)))));
    }

    /// A member lost before this node started the operation: the ring
    /// learns it at its start (nothing would tell it again). Lost in the
    /// reduce-scatter, it ends the operation for everyone at once; a peer
    /// that connects again is not lost for the next operation.
    #[test]
    fn an_operation_started_after_a_loss_learns_of_it() {
        let (net, mut agg) = (net(), ring_only());
        // Around the ring the abort goes on to 2; the way back, 1's next
        // member is 3 itself (2, its last, hears of 3 on its own).
        ends_at_once_without_3(&net, &mut agg);
        agg.on_peer_back(3);
        started(&mut agg);
        let out = decoded(agg.outgoing(&net));
        assert!(
            matches!(
                out[..],
                [
                    (2, Message::Chunk { step: 0, .. }),
                    (3, Message::Chunk { step: 0, .. })
                ]
            ),
            "{out:?}"
        );
        assert!(agg.finished().is_none());
    }

    /// Three members (a commit of up to `BUTTERFLY_MAX_MEMBERS` runs the
    /// butterfly) exchange their frames until every one is done: all hold
    /// the same bits, the microbatch-weighted mean of every element; a
    /// member first sends its slices (step 0 of the first operation id) to
    /// both others (member 1, before it hears from anyone). A member's end is
    /// taken before its frames are: the call that
    /// ends it may have made its reduced part, which must still go out.
    #[test]
    fn a_butterfly_makes_the_mean() {
        let net = net();
        let (mut aggs, sums) = three_started(Aggregation::default);
        let [op, _] = op_ids(4, 0, 1);
        let mut ends = vec![None, None, None];
        for round in 0..100 {
            let mut sent = 0;
            for i in 0..3 {
                if let Some(e) = aggs[i].finished() {
                    ends[i] = Some(e);
                }
                let out = aggs[i].outgoing(&net);
                // Member 1 goes first and has heard from nobody yet.
                if round == 0 && i == 0 {
                    let firsts: Vec<(u64, u64, u64)> = (out.iter())
                        .map(|(to, f)| (*to, f.header.microbatch, f.header.iteration))
                        .collect();
                    let others: Vec<u64> = (1..=3).filter(|&m| m != i as u64 + 1).collect();
                    assert_eq!(
                        firsts,
                        others.iter().map(|&m| (m, op, 0)).collect::<Vec<_>>()
                    );
                }
                for (to, f) in out {
                    deliver(&mut aggs, i, to, &f);
                    sent += 1;
                }
            }
            if sent == 0 {
                break;
            }
        }
        for (i, e) in ends.iter_mut().enumerate() {
            if e.is_none() {
                *e = aggs[i].finished();
            }
        }
        assert_the_mean(ends, &sums);
        assert!(aggs
            .iter()
            .all(|a| a.running.is_none() && a.serving.is_none()));
    }

    /// A butterfly member lost before this node started: the operation
    /// lacks its slice and ends at once, telling the other member.
    #[test]
    fn a_butterfly_started_after_a_loss_ends_at_once() {
        let (net, mut agg) = (net(), Aggregation::default());
        ends_at_once_without_3(&net, &mut agg);
    }

    /// A member's connection breaks during the operation and comes back
    /// (both ends live): chunks on it may be gone and nobody would send
    /// them again, so the operation ends without the mean (the coordinator
    /// commits again). A break of a non-member, a member back without a
    /// break, a break before the start, or one still not back end nothing.
    #[test]
    fn a_member_whose_connection_broke_and_came_back_ends_the_operation() {
        let (net, mut agg) = (net(), Aggregation::default());
        agg.on_link_broken(2);
        assert!(!agg.on_peer_back(2));
        started(&mut agg);
        let _ = agg.outgoing(&net);
        agg.on_link_broken(7);
        assert!(!agg.on_peer_back(7));
        assert!(!agg.on_peer_back(3));
        agg.on_link_broken(3);
        assert!(agg.finished().is_none(), "a broken link alone ends nothing");
        assert!(agg.on_peer_back(3));
        let (task, iter, end) = agg.finished().expect("ended");
        assert_eq!((task, iter), (77, 0));
        let why = end.unwrap_err();
        assert!(why.contains("member 3 broke and came back"), "{why}");
        assert!(!agg.on_peer_back(3), "ended once");
    }

    /// Member 3 is lost before `agg` starts: the operation tells member 2
    /// it aborts and ends at once, lost.
    fn ends_at_once_without_3(net: &Transport, agg: &mut Aggregation) {
        agg.on_peer_lost(3);
        let [op, _] = started(agg);
        let out = decoded(agg.outgoing(net));
        assert_eq!(out, vec![(2, Message::Abort { op, lost: 3 })]);
        let (_, _, end) = agg.finished().expect("ended");
        assert!(end.unwrap_err().contains("lost"));
    }
}
