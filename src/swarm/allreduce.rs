//! The stage all-reduce as a sans-I/O state machine: a ring reduce-scatter
//! followed by a ring all-gather (each member sends and receives
//! `2 (n-1)/n` of the buffer, the bandwidth optimum), weighted by the
//! microbatches each member contributes, and crash-tolerant in the sense the
//! protocol needs (see "A lost member" below). Nothing is ever added twice:
//! a chunk is accepted only from the ring neighbour whose turn it is, once
//! per step.
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
//! # A lost member
//!
//! Member `d` lost (its connection broke, or the protocol declared it dead),
//! with predecessor `p = d-1` and successor `q = d+1`. The complete sum of
//! chunk `d+1` exists only at `d` until `d` sends it to `q` at wire step
//! `n-1` (all-gather step 0); every other chunk's complete sum is held by
//! another member. So:
//!
//! - If `q`, when it learns of the loss, has received wire step `n-1`, `d`
//!   is *bypassed*: every chunk's complete sum, `d`'s contribution in it, is
//!   held by a survivor, and `d`'s only remaining job was forwarding. At
//!   wire step `t >= n`, `q` receives from `d` the chunk `d+1-a` (`a =
//!   t-(n-1)`), which is the chunk `p` sent `d` at step `t-1`. `q` sends `p`
//!   a [`Message::Resume`] from its next step on, and `p` sends `q` its own
//!   chunks of steps `t-1`, labelled `t`, as soon as it holds them (`p`'s
//!   last send, step `2n-3`, carries `q`'s own chunk and is not needed).
//!   Ring neighbours skip `d`; chunk ranges and steps stay those of the
//!   original ring. Messages from `d` are ignored from then on (chunks it
//!   wrote before dying may still arrive; `q` takes those steps from `p`).
//!   The survivors end [`Outcome::Done`] with the bits the full ring would
//!   have given, `d`'s microbatches included.
//! - If `q` has not received wire step `n-1`, if the ring has two members,
//!   or if another member was already bypassed (a second loss), the
//!   operation ends for everyone with [`Outcome::Lost`] (an abort is passed
//!   around), and the caller runs it again among the survivors once the
//!   lost microbatches are recomputed. A Resume for a loss while another
//!   member is bypassed is such a second loss (its sender may not have
//!   heard of the first yet).
//!
//! The other members only remember the bypassed member (so that a second
//! loss aborts); `p` learns of the loss at the latest from the Resume.
//!
//! `q`'s Resume may come long after `p` received its last chunk (a silent
//! crash is noticed only at the peer timeout), `p` cannot tell whether `d`
//! will be lost, and `q` never asks when it held every chunk before it
//! heard of the loss. So a member ends [`Outcome::Done`] as soon as it
//! holds every chunk (its result waits for nothing), and then goes on
//! *serving* ([`RingAllReduce::serving`]): it answers a Resume from its
//! right-right neighbour until that neighbour holds every chunk (it says
//! so with [`Message::Complete`], sent once by every member of a ring of
//! three or more to its left-left neighbour), is lost, or was sent
//! everything it asked. The caller keeps a serving operation fed with
//! messages and losses, and its outbox sent, until it stops serving (about
//! one message latency after the end) or the next operation starts. A
//! serving member ignores chunks and aborts (its result stands; the
//! coordinator decides what is applied), and stops serving at a second
//! loss or a message the protocol cannot send.
//!
//! What holds, with one member lost by a crash (it sends nothing after, and
//! each survivor eventually learns of the loss or gets an abort): either
//! every survivor ends Done with the same bits (the full ring's result), or
//! every survivor ends Lost. A survivor that ends Done holds chunk `d+1`,
//! which only `q` can have passed on after receiving it at step `n-1`; so
//! `q` bypasses `d` and nobody aborts. If `q` aborts, no survivor can ever
//! hold chunk `d+1`, so none ends Done.
//!
//! [`Outcome::Done`] means the result is ready, not that it may be applied:
//! with two members lost (or a protocol violation), a survivor that
//! finished before it heard of both holds a (correct) result while the
//! others end Lost; and a member that was reported lost but is alive (a
//! broken link, not a crash) may be bypassed by some and wait for a chunk
//! that never comes. So the stage coordinator decides what is applied (the
//! protocol's commit), and every member applies the same thing.
use std::collections::BTreeMap;
use std::sync::Arc;

/// A member of the operation (the node's id in the swarm).
pub type MemberId = u64;

/// A chunk's elements, shared: a butterfly owner sends one reduced part to
/// every other member, and the driver only reads it into frames, so one
/// buffer serves every copy of the message (no clone per destination).
pub type ChunkData = Arc<Vec<f32>>;

/// What one member sends to another.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// One chunk at one step of the schedule (`step < 2 (n-1)`).
    Chunk { op: u64, step: u32, data: ChunkData },
    /// The operation cannot finish: `lost` is gone.
    Abort { op: u64, lost: MemberId },
    /// From the lost member's successor to its predecessor: `lost` is
    /// gone; send me, in its place, the all-gather chunks from wire step
    /// `step` on (`n <= step < 2 (n-1)`).
    Resume { op: u64, lost: MemberId, step: u32 },
    /// To the sender's left-left neighbour: the sender holds every chunk,
    /// so it will never ask that neighbour for a [`Message::Resume`] (and
    /// the neighbour may end).
    Complete { op: u64 },
}

impl Message {
    pub fn op(&self) -> u64 {
        match self {
            Message::Chunk { op, .. }
            | Message::Abort { op, .. }
            | Message::Resume { op, .. }
            | Message::Complete { op } => *op,
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
    /// A member was lost where it could not be bypassed (see the module
    /// doc); nothing was applied.
    Lost {
        member: MemberId,
    },
    /// A member broke the protocol (a chunk of the wrong length, say).
    Failed {
        reason: String,
    },
}

/// The outcome of a reduced buffer (the sums, then the microbatch count):
/// each sum over the count (zeros for a count of zero), and the count.
pub(super) fn done_with(reduced: &[f32]) -> Outcome {
    let count = *reduced.last().unwrap_or(&0.0);
    let len = reduced.len().saturating_sub(1);
    let mean = if count > 0.0 {
        reduced[..len].iter().map(|x| x / count).collect()
    } else {
        vec![0.0; len]
    };
    Outcome::Done {
        mean,
        microbatches: count as u64,
    }
}

/// [`done_with`] in `reduced`'s own memory: the same bits (each element
/// divided by the same count), without a second buffer.
pub(super) fn done_in_place(mut reduced: Vec<f32>) -> Outcome {
    let count = reduced.pop().unwrap_or(0.0);
    if count > 0.0 {
        for x in &mut reduced {
            *x /= count;
        }
    } else {
        reduced.fill(0.0);
    }
    Outcome::Done {
        mean: reduced,
        microbatches: count as u64,
    }
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

/// An all-reduce state machine as a driver runs it (the ring's or the
/// butterfly's, [`super::butterfly`]): the stage aggregation
/// (`super::aggregate`), [`super::allreduce_net::run`] and the tests drive
/// either through it.
pub trait Machine: Send {
    fn op(&self) -> u64;
    fn on_message(&mut self, from: MemberId, msg: Message);
    fn on_peer_lost(&mut self, member: MemberId);
    fn take_outbox(&mut self) -> Vec<(MemberId, Message)>;
    fn outcome(&self) -> &Outcome;
    /// Whether the driver must keep it after its end: it may still serve a
    /// peer (the ring's [`RingAllReduce::serving`]) or has messages to send
    /// (the butterfly's reduced part, made by the call that ended it).
    fn keep(&self) -> bool;
}

impl Machine for RingAllReduce {
    fn op(&self) -> u64 {
        RingAllReduce::op(self)
    }
    fn on_message(&mut self, from: MemberId, msg: Message) {
        RingAllReduce::on_message(self, from, msg)
    }
    fn on_peer_lost(&mut self, member: MemberId) {
        RingAllReduce::on_peer_lost(self, member)
    }
    fn take_outbox(&mut self) -> Vec<(MemberId, Message)> {
        RingAllReduce::take_outbox(self)
    }
    fn outcome(&self) -> &Outcome {
        RingAllReduce::outcome(self)
    }
    fn keep(&self) -> bool {
        self.serving()
    }
}

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
    early: BTreeMap<u32, ChunkData>,
    /// The member lost and bypassed (at most one per operation: a second
    /// loss aborts). Ring neighbours skip it; chunk ranges and steps stay
    /// those of the original ring.
    bypassed: Option<MemberId>,
    /// At the bypassed member's predecessor: the next wire step (in the
    /// successor's numbering) owed to the successor; `None` until its
    /// [`Message::Resume`] came.
    serve: Option<u32>,
    /// Whether this member told its left-left neighbour it is complete.
    told_complete: bool,
    /// Whether the right-right neighbour said it is complete.
    rr_complete: bool,
    /// Done, and no longer serving (a second loss, or a message the
    /// protocol cannot send, came after the end).
    quiet: bool,
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
            bypassed: None,
            serve: None,
            told_complete: false,
            rr_complete: false,
            quiet: false,
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

    /// The member `k` places to my right on the original ring.
    fn at(&self, k: usize) -> MemberId {
        self.ring[(self.me + k) % self.n()]
    }

    /// My original right neighbour (the member I forward to).
    fn orig_right(&self) -> MemberId {
        self.at(1)
    }

    /// My original left neighbour (the member I receive from).
    fn orig_left(&self) -> MemberId {
        self.at(self.n() - 1)
    }

    fn is_bypassed(&self, m: MemberId) -> bool {
        self.bypassed == Some(m)
    }

    /// The member I send to, skipping the bypassed one.
    fn right(&self) -> MemberId {
        if self.is_bypassed(self.orig_right()) {
            self.at(2)
        } else {
            self.orig_right()
        }
    }

    /// The member I receive from, skipping the bypassed one.
    fn left(&self) -> MemberId {
        if self.is_bypassed(self.orig_left()) {
            self.at(self.n() - 2)
        } else {
            self.orig_left()
        }
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

    /// Sends what may be sent, applies early chunks whose turn came, ends
    /// the operation once every chunk is here, and serves what is owed.
    fn advance(&mut self) {
        while self.outcome == Outcome::Running
            && (self.send_own() || self.serve_one() || self.apply_early())
        {}
        if self.outcome == Outcome::Running && self.next_recv == self.steps() {
            self.tell_complete();
            self.finish();
        }
        while self.serving() && self.serve_one() {}
    }

    /// Sends my next step to my right neighbour if I hold its data (step
    /// s forwards what step s-1 brought). Nothing goes to a bypassed right
    /// neighbour: its successor asks for what it needs with a Resume.
    fn send_own(&mut self) -> bool {
        let s = self.next_send;
        if s >= self.steps() || s > self.next_recv || self.is_bypassed(self.orig_right()) {
            return false;
        }
        let data = Arc::new(self.buf[self.chunk_range(self.send_chunk(s))].to_vec());
        let msg = Message::Chunk {
            op: self.op,
            step: s,
            data,
        };
        self.outbox.push((self.right(), msg));
        self.next_send += 1;
        true
    }

    /// Sends the bypassed member's successor its next owed step `t`: my
    /// chunk of wire step `t-1`, which is what the bypassed member would
    /// have forwarded at `t` (the all-gather copies verbatim), once I hold
    /// it (as for my own send of step `t-1`).
    fn serve_one(&mut self) -> bool {
        let Some(t) = self.serve else {
            return false;
        };
        if t >= self.steps() || t - 1 > self.next_recv {
            return false;
        }
        let data = Arc::new(self.buf[self.chunk_range(self.send_chunk(t - 1))].to_vec());
        let msg = Message::Chunk {
            op: self.op,
            step: t,
            data,
        };
        self.outbox.push((self.right(), msg));
        self.serve = Some(t + 1);
        true
    }

    fn apply_early(&mut self) -> bool {
        match self.early.remove(&self.next_recv) {
            Some(data) => {
                self.apply(data);
                true
            }
            None => false,
        }
    }

    /// Tells my left-left neighbour, once, that I hold every chunk: it is
    /// the one that would serve my Resume, and may end now.
    fn tell_complete(&mut self) {
        if self.told_complete || self.n() < 3 {
            return;
        }
        self.told_complete = true;
        let ll = self.at(self.n() - 2);
        if !self.is_bypassed(ll) {
            self.outbox.push((ll, Message::Complete { op: self.op }));
        }
    }

    /// Whether my right-right neighbour can no longer need a Resume from
    /// me: it said it is complete, it is the bypassed member, or I sent it
    /// everything its Resume asked.
    fn owes_nothing(&self) -> bool {
        self.n() < 3
            || self.rr_complete
            || self.is_bypassed(self.at(2))
            || self.serve == Some(self.steps())
    }

    fn finish(&mut self) {
        self.outcome = done_with(&self.buf);
    }

    fn apply(&mut self, data: ChunkData) {
        let step = self.next_recv;
        let range = self.chunk_range(self.recv_chunk(step));
        if data.len() != range.len() {
            let left = self.left();
            self.fail(
                left,
                format!(
                    "chunk of step {step} from {left:x} has {} elements, {} expected",
                    data.len(),
                    range.len()
                ),
            );
            return;
        }
        let reducing = step < self.n() as u32 - 1;
        let dst = &mut self.buf[range];
        if reducing {
            for (d, x) in dst.iter_mut().zip(data.iter()) {
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
    /// ignored (a late chunk of an aborted run), and so are those of the
    /// bypassed member (chunks it wrote before dying may still arrive; its
    /// successor takes those steps from its predecessor). Once done, only
    /// a Resume or a Complete matters, while serving.
    pub fn on_message(&mut self, from: MemberId, msg: Message) {
        if msg.op() != self.op || self.is_bypassed(from) {
            return;
        }
        if self.outcome != Outcome::Running {
            if self.serving() {
                match msg {
                    Message::Resume { lost, step, .. } => self.on_resume(from, lost, step),
                    Message::Complete { .. } => self.on_complete(from),
                    Message::Chunk { .. } | Message::Abort { .. } => {}
                }
            }
            return;
        }
        match msg {
            Message::Abort { lost, .. } => self.lose(lost),
            Message::Chunk { step, data, .. } => self.on_chunk(from, step, data),
            Message::Resume { lost, step, .. } => self.on_resume(from, lost, step),
            Message::Complete { .. } => self.on_complete(from),
        }
    }

    /// `from` sent what the protocol cannot send: while running, the
    /// operation fails ([`RingAllReduce::fail`]); once done, the result
    /// stands and this member stops serving.
    fn violation(&mut self, from: MemberId, reason: String) {
        if self.outcome == Outcome::Running {
            self.fail(from, reason);
        } else {
            self.quiet = true;
            self.outbox.clear();
        }
    }

    fn on_chunk(&mut self, from: MemberId, step: u32, data: ChunkData) {
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

    /// Why a Resume from `from` for `lost` at `step` is not one the
    /// protocol can send me, if it is not.
    fn resume_problem(&self, from: MemberId, lost: MemberId, step: u32) -> Option<String> {
        let (n, steps) = (self.n(), self.steps());
        if n < 3 {
            Some(format!(
                "resume from {from:x} in a ring of {n}: nothing can be bypassed"
            ))
        } else if lost != self.orig_right() {
            Some(format!(
                "resume from {from:x} for {lost:x}, which is not my right neighbour {:x}",
                self.orig_right()
            ))
        } else if from != self.at(2) {
            Some(format!(
                "resume from {from:x} for {lost:x}, whose successor is {:x}",
                self.at(2)
            ))
        } else if step < n as u32 || step >= steps {
            Some(format!(
                "resume from {from:x} at step {step} (expected steps {n}..{steps})"
            ))
        } else if self.serve.is_some() {
            Some(format!("second resume from {from:x}"))
        } else if self.rr_complete {
            Some(format!("resume from {from:x}, which said it was complete"))
        } else {
            None
        }
    }

    /// My right neighbour's successor asks me to stand in for it. A
    /// Resume before I noticed the loss myself counts as the loss; one for
    /// a loss while another member is already bypassed is a second loss
    /// (the successor may not have heard of the first yet).
    fn on_resume(&mut self, from: MemberId, lost: MemberId, step: u32) {
        if let Some(reason) = self.resume_problem(from, lost, step) {
            self.violation(from, reason);
            return;
        }
        match self.bypassed {
            Some(b) if b != lost && self.outcome == Outcome::Running => {
                self.lose(lost);
                return;
            }
            Some(b) if b != lost => {
                // A second loss after the end: nothing more to serve.
                self.quiet = true;
                return;
            }
            Some(_) => {}
            None => self.bypass(lost),
        }
        self.serve = Some(step);
        self.advance();
    }

    /// My right-right neighbour holds every chunk.
    fn on_complete(&mut self, from: MemberId) {
        if self.n() < 3 || from != self.at(2) {
            self.violation(
                from,
                format!(
                    "complete from {from:x}, which is not the member two to my right {:x}",
                    self.at(2)
                ),
            );
        } else if self.rr_complete {
            self.violation(from, format!("second complete from {from:x}"));
        } else {
            self.rr_complete = true;
            self.advance();
        }
    }

    /// `member` is gone (its connection broke, or the protocol declared it
    /// dead). If it is part of the ring, it is bypassed where the ring can
    /// finish without it, and the operation ends for everyone where it
    /// cannot (see the module doc). Reporting a loss again changes nothing.
    pub fn on_peer_lost(&mut self, member: MemberId) {
        if !self.ring.contains(&member) || member == self.ring[self.me] || self.is_bypassed(member)
        {
            return;
        }
        if self.outcome != Outcome::Running {
            // Done: a first loss is remembered (the predecessor waits for
            // its successor's Resume; a lost right-right neighbour needs
            // nothing more); a second ends the serving.
            if self.serving() {
                if self.bypassed.is_some() {
                    self.quiet = true;
                } else {
                    self.bypass(member);
                }
            }
            return;
        }
        if self.bypassed.is_some() || self.n() < 3 {
            self.lose(member);
            return;
        }
        if member == self.orig_left() {
            // I am its successor: its chunk's full sum reached me with wire
            // step n-1, or it is gone with it.
            if self.next_recv < self.n() as u32 {
                self.lose(member);
                return;
            }
            self.bypass(member);
            if self.next_recv < self.steps() {
                let msg = Message::Resume {
                    op: self.op,
                    lost: member,
                    step: self.next_recv,
                };
                self.outbox.push((self.left(), msg));
            }
        } else {
            // Its predecessor waits for the successor's Resume; any other
            // member only remembers it, so that a second loss aborts.
            self.bypass(member);
        }
        self.advance();
    }

    /// Goes on without `m`: nothing more is sent to it, and chunks it sent
    /// me that wait for their turn are dropped (its predecessor sends them
    /// again on my Resume).
    fn bypass(&mut self, m: MemberId) {
        self.bypassed = Some(m);
        self.outbox.retain(|(to, _)| *to != m);
        if m == self.orig_left() {
            self.early.clear();
        }
    }

    fn lose(&mut self, lost: MemberId) {
        self.abort_all(lost);
        self.outcome = Outcome::Lost { member: lost };
    }

    /// Tells every other member (but `lost` and the bypassed one) that the
    /// operation is over.
    fn abort_all(&mut self, lost: MemberId) {
        self.outbox.clear();
        self.early.clear();
        let me = self.ring[self.me];
        for &m in &self.ring {
            if m != me && m != lost && !self.is_bypassed(m) {
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

    /// Done, but the member two to the right may still ask this one to
    /// stand in for a lost neighbour (see the module doc): keep feeding it
    /// messages and losses, and sending its outbox, while this holds.
    pub fn serving(&self) -> bool {
        matches!(self.outcome, Outcome::Done { .. }) && !self.quiet && !self.owes_nothing()
    }

    pub fn op(&self) -> u64 {
        self.op
    }

    /// The members in ring order (the original ring, the bypassed member
    /// included).
    pub fn ring(&self) -> &[MemberId] {
        &self.ring
    }

    /// The member lost and bypassed, if any: its contribution is in the
    /// result all the same.
    pub fn bypassed(&self) -> Option<MemberId> {
        self.bypassed
    }
}

#[cfg(test)]
#[path = "allreduce_tests.rs"]
mod tests;
