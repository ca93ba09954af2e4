//! The stage all-reduce as a sans-I/O state machine: a ring reduce-scatter
//! followed by a ring all-gather (each member sends and receives
//! `2 (n-1)/n` of the buffer, the bandwidth optimum), weighted by the
//! microbatches each member contributes, and crash-tolerant in the sense the
//! protocol needs: a member lost in the middle makes every survivor end the
//! operation promptly with [`Outcome::Lost`] (an abort is passed around), so
//! the caller can run it again among the survivors once the lost member's
//! microbatches are recomputed. Nothing is ever added twice: a chunk is
//! accepted only from the ring neighbour whose turn it is, once per step.
//!
//! Determinism: every member is given the same ring (the order the stage
//! coordinator chose, e.g. with `flow::ring::order` so that neighbours are
//! near each other) and chunk `c` is summed in ring order starting at member
//! `c`, so every run over the same inputs gives the same bits, and the
//! all-gather copies each reduced chunk verbatim: after [`Outcome::Done`]
//! every member holds a bit-identical result.
//!
//! Schedule, for member `i` of `n` (ring neighbours `i+1` and `i-1`):
//! reduce-scatter steps `s = 0..n-1` send chunk `i-s` and add the received
//! chunk `i-s-1`; after them member `i` holds the complete sum of chunk
//! `i+1`. All-gather steps `s = 0..n-1` (numbered `n-1+s` on the wire) send
//! chunk `i+1-s` and store the received chunk `i-s`. Chunks are contiguous
//! slices, `[k L / n, (k+1) L / n)`, so a buffer shorter than `n` only has
//! empty chunks. The microbatch count travels as one extra element at the end
//! of the buffer (exact in f32 up to 2^24 microbatches).
//!
//! [`Outcome::Done`] means the result is ready, not that it may be applied:
//! a member lost after some survivors finished leaves those with a result
//! that includes its microbatches and the others with [`Outcome::Lost`]. So
//! the stage coordinator decides what is applied (the protocol's commit),
//! and every member applies the same thing.
use std::collections::BTreeMap;

/// A member of the operation (the node's id in the swarm).
pub type MemberId = u64;

/// What one member sends to another.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// One chunk at one step of the schedule (`step < 2 (n-1)`).
    Chunk { op: u64, step: u32, data: Vec<f32> },
    /// The operation cannot finish: `lost` is gone.
    Abort { op: u64, lost: MemberId },
}

impl Message {
    pub fn op(&self) -> u64 {
        match self {
            Message::Chunk { op, .. } | Message::Abort { op, .. } => *op,
        }
    }
}

/// How the operation ended (or that it has not yet).
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Running,
    /// The microbatch-weighted mean of every member's contribution, and the
    /// total number of microbatches it averages.
    Done {
        mean: Vec<f32>,
        microbatches: u64,
    },
    /// A member was lost before the end; nothing was applied.
    Lost {
        member: MemberId,
    },
    /// A member broke the protocol (a chunk of the wrong length, say).
    Failed {
        reason: String,
    },
}

/// Errors of setting an operation up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SetupError {
    NotAMember,
    DuplicateMember(MemberId),
    TooManyMicrobatches(u64),
}

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SetupError::NotAMember => write!(f, "this node is not among the members"),
            SetupError::DuplicateMember(m) => write!(f, "member {m:x} is listed twice"),
            SetupError::TooManyMicrobatches(n) => {
                write!(
                    f,
                    "{n} microbatches cannot be counted exactly (at most 2^24)"
                )
            }
        }
    }
}

impl std::error::Error for SetupError {}

/// One member's side of one all-reduce.
#[derive(Debug)]
pub struct RingAllReduce {
    op: u64,
    ring: Vec<MemberId>,
    me: usize,
    /// The contribution, then the partial sums, then the result; the last
    /// element is the microbatch count.
    buf: Vec<f32>,
    /// Next step to send (0..2(n-1)); a step's send waits for the previous
    /// step's receive.
    next_send: u32,
    /// Next step to receive.
    next_recv: u32,
    /// Chunks that arrived before their turn (the left neighbour may run
    /// ahead); at most one per step.
    early: BTreeMap<u32, Vec<f32>>,
    outcome: Outcome,
    /// Messages for the driver to send, in order.
    outbox: Vec<(MemberId, Message)>,
}

impl RingAllReduce {
    /// Sets up member `me`'s side of operation `op` around `ring` (every
    /// member must be given the same order), contributing `sum` (the sum of
    /// its microbatches' gradients) and `microbatches`.
    pub fn new(
        op: u64,
        me: MemberId,
        ring: &[MemberId],
        sum: &[f32],
        microbatches: u64,
    ) -> Result<RingAllReduce, SetupError> {
        let mut sorted = ring.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(SetupError::DuplicateMember(w[0]));
        }
        let ring = ring.to_vec();
        let me = ring
            .iter()
            .position(|&m| m == me)
            .ok_or(SetupError::NotAMember)?;
        if microbatches > 1 << 24 {
            return Err(SetupError::TooManyMicrobatches(microbatches));
        }
        let mut buf = Vec::with_capacity(sum.len() + 1);
        buf.extend_from_slice(sum);
        buf.push(microbatches as f32);
        let mut r = RingAllReduce {
            op,
            ring,
            me,
            buf,
            next_send: 0,
            next_recv: 0,
            early: BTreeMap::new(),
            outcome: Outcome::Running,
            outbox: Vec::new(),
        };
        r.advance();
        Ok(r)
    }

    fn n(&self) -> usize {
        self.ring.len()
    }

    fn steps(&self) -> u32 {
        2 * (self.n() as u32 - 1)
    }

    fn right(&self) -> MemberId {
        self.ring[(self.me + 1) % self.n()]
    }

    fn left(&self) -> MemberId {
        self.ring[(self.me + self.n() - 1) % self.n()]
    }

    /// Chunk index `i - k` modulo n.
    fn chunk_back(&self, k: usize) -> usize {
        (self.me + self.n() * 2 - k % self.n()) % self.n()
    }

    fn chunk_range(&self, c: usize) -> std::ops::Range<usize> {
        let (len, n) = (self.buf.len(), self.n());
        c * len / n..(c + 1) * len / n
    }

    /// The chunk sent at `step`.
    fn send_chunk(&self, step: u32) -> usize {
        let n = self.n() as u32;
        if step < n - 1 {
            self.chunk_back(step as usize)
        } else {
            // all-gather: chunk i+1-s
            (self.me + 1 + self.n() - ((step - (n - 1)) as usize % self.n())) % self.n()
        }
    }

    /// The chunk received at `step`.
    fn recv_chunk(&self, step: u32) -> usize {
        let n = self.n() as u32;
        if step < n - 1 {
            self.chunk_back(step as usize + 1)
        } else {
            self.chunk_back((step - (n - 1)) as usize)
        }
    }

    /// Sends what may be sent and applies early chunks whose turn came.
    fn advance(&mut self) {
        loop {
            if self.outcome != Outcome::Running {
                return;
            }
            let steps = self.steps();
            if self.next_recv == steps {
                let count = *self.buf.last().unwrap_or(&0.0);
                let len = self.buf.len() - 1;
                let mean = if count > 0.0 {
                    self.buf[..len].iter().map(|x| x / count).collect()
                } else {
                    vec![0.0; len]
                };
                self.outcome = Outcome::Done {
                    mean,
                    microbatches: count as u64,
                };
                return;
            }
            // Step s's send needs step s-1's receive (it forwards that chunk).
            if self.next_send < steps && self.next_send <= self.next_recv {
                let c = self.send_chunk(self.next_send);
                let data = self.buf[self.chunk_range(c)].to_vec();
                let msg = Message::Chunk {
                    op: self.op,
                    step: self.next_send,
                    data,
                };
                self.outbox.push((self.right(), msg));
                self.next_send += 1;
                continue;
            }
            match self.early.remove(&self.next_recv) {
                Some(data) => self.apply(data),
                None => return,
            }
        }
    }

    fn apply(&mut self, data: Vec<f32>) {
        let step = self.next_recv;
        let range = self.chunk_range(self.recv_chunk(step));
        if data.len() != range.len() {
            let left = self.left();
            self.fail(
                left,
                format!(
                    "chunk of step {step} from {:x} has {} elements, {} expected",
                    self.left(),
                    data.len(),
                    range.len()
                ),
            );
            return;
        }
        let reducing = step < self.n() as u32 - 1;
        let dst = &mut self.buf[range];
        if reducing {
            for (d, x) in dst.iter_mut().zip(&data) {
                *d += *x;
            }
        } else {
            dst.copy_from_slice(&data);
        }
        self.next_recv += 1;
    }

    /// `offender` broke the protocol: the operation ends here, and the
    /// other members hear of it as the loss of `offender` (without it the
    /// ring cannot finish; the caller should also disconnect it).
    fn fail(&mut self, offender: MemberId, reason: String) {
        self.abort_all(offender);
        self.outcome = Outcome::Failed { reason };
    }

    /// A message from `from` arrived. Messages of another operation are
    /// ignored (a late chunk of an aborted run).
    pub fn on_message(&mut self, from: MemberId, msg: Message) {
        if msg.op() != self.op || self.outcome != Outcome::Running {
            return;
        }
        match msg {
            Message::Abort { lost, .. } => self.lose(lost),
            Message::Chunk { step, data, .. } => {
                if from != self.left() {
                    self.fail(
                        from,
                        format!(
                            "chunk from {from:x}, which is not the ring neighbour {:x}",
                            self.left()
                        ),
                    );
                } else if step < self.next_recv || step >= self.steps() {
                    self.fail(
                        from,
                        format!(
                            "chunk of step {step} from {from:x} (expected steps {}..{})",
                            self.next_recv,
                            self.steps()
                        ),
                    );
                } else if self.early.insert(step, data).is_some() {
                    self.fail(from, format!("two chunks of step {step} from {from:x}"));
                } else {
                    self.advance();
                }
            }
        }
    }

    /// `member` is gone (its connection broke, or the protocol declared it
    /// dead). If it is part of the ring, the operation ends for everyone.
    pub fn on_peer_lost(&mut self, member: MemberId) {
        if self.outcome == Outcome::Running
            && self.ring.contains(&member)
            && member != self.ring[self.me]
        {
            self.lose(member);
        }
    }

    fn lose(&mut self, lost: MemberId) {
        self.abort_all(lost);
        self.outcome = Outcome::Lost { member: lost };
    }

    /// Tells every other member (but `lost`) that the operation is over.
    fn abort_all(&mut self, lost: MemberId) {
        self.outbox.clear();
        self.early.clear();
        let me = self.ring[self.me];
        for &m in &self.ring {
            if m != me && m != lost {
                self.outbox.push((m, Message::Abort { op: self.op, lost }));
            }
        }
    }

    /// Messages to send now, in order.
    pub fn take_outbox(&mut self) -> Vec<(MemberId, Message)> {
        std::mem::take(&mut self.outbox)
    }

    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    pub fn op(&self) -> u64 {
        self.op
    }

    /// The members in ring order.
    pub fn ring(&self) -> &[MemberId] {
        &self.ring
    }
}

#[cfg(test)]
#[path = "allreduce_tests.rs"]
mod tests;
