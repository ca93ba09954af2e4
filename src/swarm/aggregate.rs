//! The stage all-reduce a runtime node runs for the protocol's aggregate
//! task: one [`RingAllReduce`] at a time, among the commit's members in the
//! commit's order, fed by the driver with chunk frames and lost peers.
//!
//! Chunks of an operation this node has not started yet (a faster
//! neighbour is ahead) wait, bounded; a newer commit of the same iteration
//! replaces the operation in progress.
use super::allreduce::{Outcome, RingAllReduce, SetupError};
use super::allreduce_net::{frame_of, message_of};
use crate::engine::{Frame, Node as Net};
use crate::protocol::{AggregatePlan, NodeId, TaskId};
use std::collections::VecDeque;
use std::time::Duration;

/// Chunks kept for operations not started yet.
const EARLY_MAX: usize = 256;
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
        let ring: Vec<u64> = plan.members.iter().map(|&m| m as u64).collect();
        let op = op_id(stage, plan.iter, plan.epoch);
        let r = RingAllReduce::new(op, me as u64, &ring, sum, plan.granted.len() as u64)?;
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
        let from = f.peer();
        if let Some(r) = self.running.as_mut() {
            if f.header.microbatch == r.ring.op() && f.header.stage == r.stage {
                match message_of(r.stage, &f) {
                    Some(Ok(msg)) => r.ring.on_message(from, msg),
                    Some(Err(_)) => r.ring.on_peer_lost(from),
                    None => {}
                }
                return;
            }
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

    pub fn on_peer_lost(&mut self, peer: u64) {
        if let Some(r) = self.running.as_mut() {
            r.ring.on_peer_lost(peer);
        }
    }

    /// The frames the operation asks to send (to, frame); a frame that
    /// cannot be made is a member lost.
    pub fn outgoing(&mut self, net: &Net) -> Vec<(u64, Frame)> {
        let mut out = Vec::new();
        let Some(r) = self.running.as_mut() else {
            return out;
        };
        for (to, msg) in r.ring.take_outbox() {
            match frame_of(net, r.stage, &msg, Duration::from_secs(5)) {
                Ok(f) => out.push((to, f)),
                Err(_) => r.ring.on_peer_lost(to),
            }
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
        Some((r.task, r.iter, end))
    }
}
