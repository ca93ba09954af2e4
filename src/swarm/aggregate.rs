//! The stage all-reduce a runtime node runs for the protocol's aggregate
//! task: one [`RingAllReduce`] at a time, among the commit's members in the
//! commit's order, fed by the driver with chunk frames and lost peers.
//!
//! Chunks of an operation this node has not started yet (a faster
//! neighbour is ahead) wait, bounded; a newer commit of the same iteration
//! replaces the operation in progress. An operation that ended with the
//! mean is kept while it serves (`RingAllReduce::serving`: a neighbour's
//! neighbour may still ask it to stand in for a lost member), until it
//! stops or the next operation starts.
use super::allreduce::{Message, Outcome, RingAllReduce, SetupError};
use super::allreduce_net::{frame_of, message_of};
use crate::engine::{Frame, Node as Net};
use crate::protocol::{AggregatePlan, NodeId, TaskId};
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
    ring: RingAllReduce,
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
}

impl Default for Aggregation {
    fn default() -> Self {
        Aggregation::with_early_budget(EARLY_BYTES_MAX)
    }
}

/// The operation id of a commit: unique per stage, iteration and epoch.
pub fn op_id(stage: u32, iter: u32, epoch: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for x in [stage as u64, iter as u64, epoch] {
        h ^= x;
        h = h.wrapping_mul(0x0100_0000_01b3).rotate_left(29);
    }
    h
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
        let op = op_id(stage, plan.iter, plan.epoch);
        let mut r = RingAllReduce::new(op, me as u64, &ring, sum, plan.granted.len() as u64)?;
        for &m in &self.lost {
            r.on_peer_lost(m);
        }
        self.running = Some(Running {
            task,
            iter: plan.iter,
            stage,
            ring: r,
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
        if self.route(f.peer(), op, stage, || message_of(stage, &f)) {
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
        msg: impl FnOnce() -> Option<Result<Message, String>>,
    ) -> bool {
        let Some(r) = [self.running.as_mut(), self.serving.as_mut()]
            .into_iter()
            .flatten()
            .find(|r| r.ring.op() == op && r.stage == stage)
        else {
            return false;
        };
        match msg() {
            Some(Ok(msg)) => r.ring.on_message(from, msg),
            Some(Err(_)) => r.ring.on_peer_lost(from),
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
            r.ring.on_peer_lost(peer);
        }
    }

    /// `peer` is connected (again): it is not lost for operations that
    /// start from now on.
    pub fn on_peer_back(&mut self, peer: u64) {
        self.lost.retain(|&p| p != peer);
    }

    /// The frames the operation asks to send (to, frame); a frame that
    /// cannot be made is a member lost.
    pub fn outgoing(&mut self, net: &Net) -> Vec<(u64, Frame)> {
        let mut out = Vec::new();
        for r in [self.running.as_mut(), self.serving.as_mut()]
            .into_iter()
            .flatten()
        {
            for (to, msg) in r.ring.take_outbox() {
                match frame_of(net, r.stage, &msg, Duration::from_secs(5)) {
                    Ok(f) => out.push((to, f)),
                    Err(_) => r.ring.on_peer_lost(to),
                }
            }
        }
        if self.serving.as_ref().is_some_and(|r| !r.ring.serving()) {
            self.serving = None;
        }
        out
    }

    /// How the operation ended, once.
    pub fn finished(&mut self) -> Option<Finished> {
        let r = self.running.as_mut()?;
        let end = match r.ring.outcome() {
            Outcome::Running => return None,
            Outcome::Done { mean, microbatches } => Ok((mean.clone(), *microbatches)),
            Outcome::Lost { member } => Err(format!("member {member:x} lost")),
            Outcome::Failed { reason } => Err(reason.clone()),
        };
        let r = self.running.take().expect("running");
        let (task, iter) = (r.task, r.iter);
        if r.ring.serving() {
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

    use crate::swarm::allreduce_net::tests::node as net;

    /// Member 1's side of the ring 1 -> 2 -> 3 -> 1 of stage 4, iteration
    /// 0, two microbatches of five gradients (six elements with the count:
    /// chunks of two).
    fn started(agg: &mut Aggregation) -> u64 {
        let plan = AggregatePlan {
            iter: 0,
            epoch: 1,
            members: Arc::new(vec![1, 2, 3]),
            granted: (0..2)
                .map(|idx| MbId {
                    holder: 9,
                    iter: 0,
                    idx,
                })
                .collect(),
        };
        agg.start(4, 1, 77, plan, &[1.0; 5]).unwrap();
        op_id(4, 0, 1)
    }

    fn chunk(op: u64, step: u32) -> Message {
        Message::Chunk {
            op,
            step,
            data: vec![0.5; 2],
        }
    }

    /// The messages in `out`, with their destination.
    fn decoded(out: Vec<(u64, Frame)>) -> Vec<(u64, Message)> {
        out.into_iter()
            .map(|(to, f)| (to, message_of(4, &f).unwrap().unwrap()))
            .collect()
    }

    /// Member 1 ends with the mean, and stays to serve member 3 (two to its
    /// right) should member 2 be lost: 3's Resume, after the end, is
    /// answered with the chunk 2 would have forwarded; then the operation
    /// is let go.
    #[test]
    fn a_done_operation_serves_a_late_resume() {
        let (net, mut agg) = (net(), Aggregation::default());
        let op = started(&mut agg);
        for step in 0..4 {
            assert!(agg.route(3, op, 4, || Some(Ok(chunk(op, step)))));
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
        assert!(agg.route(3, op, 4, || Some(Ok(resume))));
        let out = decoded(agg.outgoing(&net));
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(matches!(out[0], (3, Message::Chunk { step: 3, .. })));
        assert!(agg.serving.is_none(), "served: let go");
        // Another operation's message is not taken.
        assert!(!agg.route(3, op, 4, || Some(Ok(chunk(op, 0)))));
    }

    /// A member lost before this node started the operation: the ring
    /// learns it at its start (nothing would tell it again). Lost in the
    /// reduce-scatter, it ends the operation for everyone at once; a peer
    /// that connects again is not lost for the next operation.
    #[test]
    fn an_operation_started_after_a_loss_learns_of_it() {
        let (net, mut agg) = (net(), Aggregation::default());
        agg.on_peer_lost(3);
        let op = started(&mut agg);
        let out = decoded(agg.outgoing(&net));
        assert_eq!(out, vec![(2, Message::Abort { op, lost: 3 })]);
        let (_, _, end) = agg.finished().expect("ended");
        assert!(end.unwrap_err().contains("lost"));
        agg.on_peer_back(3);
        started(&mut agg);
        let out = decoded(agg.outgoing(&net));
        assert!(
            matches!(out[..], [(2, Message::Chunk { step: 0, .. })]),
            "{out:?}"
        );
        assert!(agg.finished().is_none());
    }
}
