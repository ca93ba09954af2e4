//! The ring all-reduce over the engine's authenticated connections.
//!
//! A chunk is one data frame: `dtype` f32, `shape = [elements]`,
//! `stage` = the stage, `microbatch` = the operation id, `iteration` = the
//! step of the schedule (below 2^32). The other messages are frames whose
//! `iteration` is a marker above 2^32, with `microbatch` = the operation id:
//! - an abort: `iteration` = [`ABORT_STEP`], payload the lost member's id
//!   (8 bytes, little-endian);
//! - a resume: `iteration` = [`RESUME_STEP`], payload the lost member's id
//!   (u64) then the first step asked for (u32), 12 bytes, little-endian;
//! - a complete notice: `iteration` = [`COMPLETE_STEP`], empty payload.
//!
//! A marker frame of another length is refused. Member ids are the engine's
//! node ids.
//!
//! Chunks are written straight into pool slots (one copy, from the
//! trainer's gradient into the frame) and read out of the received slot
//! without another.
use super::allreduce::{Machine, Message, Outcome};
use crate::engine::{EngineError, Frame, Transport, TransportEvent};
use crate::wire::Dtype;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `iteration` of an abort frame.
pub const ABORT_STEP: u64 = u64::MAX;
/// `iteration` of a resume frame.
pub const RESUME_STEP: u64 = u64::MAX - 1;
/// `iteration` of a complete notice.
pub const COMPLETE_STEP: u64 = u64::MAX - 2;
/// Bytes of a resume frame's payload: the lost member (u64), the step (u32).
const RESUME_LEN: usize = 12;

/// Why the exchange ended without an [`Outcome`].
#[derive(Debug)]
pub enum NetError {
    /// The deadline passed with the operation still running.
    Timeout,
    Engine(EngineError),
}

impl std::fmt::Display for NetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NetError::Timeout => write!(f, "the all-reduce did not finish in time"),
            NetError::Engine(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for NetError {}

impl From<EngineError> for NetError {
    fn from(e: EngineError) -> Self {
        NetError::Engine(e)
    }
}

/// The frame that carries one message.
pub fn frame_of(
    node: &Transport,
    stage: u32,
    msg: &Message,
    timeout: Duration,
) -> Result<Frame, EngineError> {
    let mut f = match msg {
        Message::Chunk { op, step, data } => {
            let mut f = node.alloc(std::mem::size_of_val(data.as_slice()), timeout)?;
            f32s_to_le_bytes(data, f.payload_mut());
            f.header.microbatch = *op;
            f.header.iteration = *step as u64;
            f.header.dtype = Dtype::F32 as u16;
            f.header.ndim = 1;
            f.header.shape = [data.len() as u64, 0, 0, 0];
            f
        }
        Message::Abort { op, lost } => {
            let mut f = node.alloc(8, timeout)?;
            f.payload_mut().copy_from_slice(&lost.to_le_bytes());
            f.header.microbatch = *op;
            f.header.iteration = ABORT_STEP;
            f
        }
        Message::Resume { op, lost, step } => {
            let mut f = node.alloc(RESUME_LEN, timeout)?;
            let p = f.payload_mut();
            p[..8].copy_from_slice(&lost.to_le_bytes());
            p[8..].copy_from_slice(&step.to_le_bytes());
            f.header.microbatch = *op;
            f.header.iteration = RESUME_STEP;
            f
        }
        Message::Complete { op } => {
            let mut f = node.alloc(0, timeout)?;
            f.header.microbatch = *op;
            f.header.iteration = COMPLETE_STEP;
            f
        }
    };
    f.header.stage = stage;
    Ok(f)
}

/// The message a received frame carries, if it is one of this stage's.
pub fn message_of(stage: u32, f: &Frame) -> Option<Result<Message, String>> {
    message_with(stage, f, &mut ChunkBuffers::default())
}

/// [`message_of`], its chunk's elements written into a buffer of `bufs`
/// when one is free (no fresh allocation to fault in page by page).
pub fn message_with(
    stage: u32,
    f: &Frame,
    bufs: &mut ChunkBuffers,
) -> Option<Result<Message, String>> {
    let h = &f.header;
    if h.stage != stage {
        return None;
    }
    let (op, p) = (h.microbatch, f.payload());
    Some(match h.iteration {
        ABORT_STEP => abort_of(op, p),
        RESUME_STEP => resume_of(op, p),
        COMPLETE_STEP if p.is_empty() => Ok(Message::Complete { op }),
        COMPLETE_STEP => Err(format!("complete frame of {} bytes", p.len())),
        _ => chunk_of(f, bufs),
    })
}

fn abort_of(op: u64, p: &[u8]) -> Result<Message, String> {
    let lost: [u8; 8] = p
        .try_into()
        .map_err(|_| format!("abort frame of {} bytes", p.len()))?;
    Ok(Message::Abort {
        op,
        lost: u64::from_le_bytes(lost),
    })
}

fn resume_of(op: u64, p: &[u8]) -> Result<Message, String> {
    if p.len() != RESUME_LEN {
        return Err(format!("resume frame of {} bytes", p.len()));
    }
    let (lost, step) = p.split_at(8);
    Ok(Message::Resume {
        op,
        lost: u64::from_le_bytes(lost.try_into().expect("8 bytes")),
        step: u32::from_le_bytes(step.try_into().expect("4 bytes")),
    })
}

/// A chunk: f32 elements at a step below 2^32 (the markers are above).
fn chunk_of(f: &Frame, bufs: &mut ChunkBuffers) -> Result<Message, String> {
    let h = &f.header;
    if h.dtype != Dtype::F32 as u16 || h.iteration > u32::MAX as u64 || f.payload().len() % 4 != 0 {
        return Err(format!(
            "chunk frame with dtype {}, step {} and {} bytes",
            h.dtype,
            h.iteration,
            f.payload().len()
        ));
    }
    Ok(Message::Chunk {
        op: h.microbatch,
        step: h.iteration as u32,
        data: Arc::new(bufs.fill(f.payload())),
    })
}

/// Writes `src` into `dst` (exactly its size) as little-endian f32s: one
/// copy on a little-endian machine, where that is the memory layout.
fn f32s_to_le_bytes(src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(dst.len(), std::mem::size_of_val(src));
    #[cfg(target_endian = "little")]
    {
        // SAFETY: f32 has no padding and every byte of it is initialized;
        // the view covers exactly `src`'s elements and lives only here.
        let bytes = unsafe {
            std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src))
        };
        dst.copy_from_slice(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for (d, x) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

/// Chunk buffers of one operation kept for reuse: a sent chunk's buffer
/// (once the frame holds its bytes) takes the next received chunk. A
/// buffer of tens of megabytes freshly allocated costs more in page faults
/// than its copy; reused, it costs the copy only. Kept only while the
/// operation runs (its owner drops them with it), at most [`Self::KEPT`].
#[derive(Debug, Default)]
pub struct ChunkBuffers {
    free: Vec<Vec<f32>>,
}

impl ChunkBuffers {
    /// Buffers kept at most: an operation's messages in flight at once.
    pub const KEPT: usize = 4;

    /// Keeps the buffer of a message just framed, if nothing else holds
    /// it (a butterfly's reduced part goes to every member: its last
    /// message frees it).
    pub fn recycle(&mut self, msg: Message) {
        if let Message::Chunk { data, .. } = msg {
            if let Ok(v) = Arc::try_unwrap(data) {
                if self.free.len() < Self::KEPT && v.capacity() > 0 {
                    self.free.push(v);
                }
            }
        }
    }

    /// The little-endian f32s of `src` (a trailing partial element is
    /// ignored; callers check the length), in a kept buffer large enough
    /// if there is one: one copy on a little-endian machine.
    pub fn fill(&mut self, src: &[u8]) -> Vec<f32> {
        let n = src.len() / 4;
        let fit = (self.free.iter()).position(|v| v.capacity() >= n);
        let mut out = match fit {
            Some(i) => self.free.swap_remove(i),
            None => Vec::with_capacity(n),
        };
        out.clear();
        #[cfg(target_endian = "little")]
        {
            // SAFETY: `out` has room for `n` elements; exactly `4 n` bytes
            // are copied into it, from a slice that cannot overlap it (we
            // own `out`), and every bit pattern is a valid f32, so the
            // first `n` elements are initialized before `set_len`.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), out.as_mut_ptr().cast::<u8>(), n * 4);
                out.set_len(n);
            }
        }
        #[cfg(not(target_endian = "little"))]
        out.extend(
            src.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))),
        );
        out
    }
}

/// Runs `op` (a ring's or a butterfly's side) to its end over `node`: sends
/// what the machine asks, feeds it the frames of `stage` and the engine's
/// lost-peer events, until it is no longer running nor kept
/// ([`Machine::keep`]: done, but a ring's neighbour's neighbour may still
/// ask it to stand in for a lost member) or `deadline` passes (a done
/// operation's outcome is returned then).
/// Frames of other stages or other operations are dropped (this driver
/// owns the node while it runs).
pub fn run<M: Machine>(
    node: &Transport,
    stage: u32,
    mut op: M,
    deadline: Instant,
) -> Result<Outcome, NetError> {
    let send_timeout = Duration::from_secs(5);
    let mut bufs = ChunkBuffers::default();
    loop {
        for (to, msg) in op.take_outbox() {
            let f = frame_of(node, stage, &msg, send_timeout)?;
            bufs.recycle(msg);
            if let Err(e) = node.send(to, f, send_timeout) {
                // A peer that cannot be reached is a lost peer.
                match e {
                    EngineError::NotFound(_) | EngineError::Closed(_) => op.on_peer_lost(to),
                    e => return Err(e.into()),
                }
            }
        }
        if op.outcome() != &Outcome::Running && !op.keep() {
            // Aborts still queued above were sent before we return.
            return Ok(op.outcome().clone());
        }
        let mut lost = Vec::new();
        while let Some(ev) = node.poll_event(Duration::ZERO) {
            if let TransportEvent::PeerLost { peer, .. } = ev {
                lost.push(peer);
            }
        }
        if !lost.is_empty() {
            // The engine queues a peer's last frames before its loss: they
            // count first (its reduced chunk may be among them).
            while let Ok(f) = node.recv(Duration::ZERO) {
                feed(stage, &mut op, &f, &mut bufs);
            }
            for peer in lost {
                op.on_peer_lost(peer);
            }
        }
        if op.outcome() != &Outcome::Running && !op.keep() {
            continue;
        }
        let now = Instant::now();
        if now >= deadline && op.keep() {
            return Ok(op.outcome().clone());
        }
        if now >= deadline {
            return Err(NetError::Timeout);
        }
        let wait = (deadline - now).min(Duration::from_millis(20));
        match node.recv(wait) {
            Ok(f) => feed(stage, &mut op, &f, &mut bufs),
            Err(EngineError::Timeout(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Gives `op` the message frame `f` carries (a malformed one is its
/// sender's loss).
fn feed<M: Machine>(stage: u32, op: &mut M, f: &Frame, bufs: &mut ChunkBuffers) {
    let from = f.peer();
    match message_with(stage, f, bufs) {
        Some(Ok(msg)) => op.on_message(from, msg),
        Some(Err(_)) => op.on_peer_lost(from),
        None => {}
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::engine::NodeOptions;
    use crate::swarm::allreduce::ChunkData;

    /// A node without a listener: only its pool is used, to build frames.
    pub(in crate::swarm) fn node() -> Transport {
        Transport::new(NodeOptions {
            swarm_key: b"allreduce-net-unit-test-key".to_vec(),
            max_payload: 1 << 12,
            pool_bytes: 1 << 16,
            ..NodeOptions::default()
        })
        .unwrap()
    }

    fn round_trip(node: &Transport, msg: &Message) -> Message {
        let f = frame_of(node, 7, msg, Duration::from_secs(1)).unwrap();
        message_of(7, &f)
            .expect("this stage's")
            .expect("well formed")
    }

    #[test]
    fn every_message_survives_its_frame() {
        let node = node();
        let msgs = [
            Message::Chunk {
                op: 3,
                step: 5,
                data: vec![1.5, -2.0, 0.25].into(),
            },
            Message::Abort { op: 3, lost: 42 },
            Message::Resume {
                op: u64::MAX,
                lost: 0x0123_4567_89ab_cdef,
                step: 0xfeed_beef,
            },
            Message::Complete { op: 9 },
        ];
        for msg in msgs {
            assert_eq!(round_trip(&node, &msg), msg);
        }
        let f = frame_of(&node, 7, &Message::Complete { op: 9 }, Duration::ZERO).unwrap();
        assert!(message_of(8, &f).is_none(), "another stage's");
    }

    /// A sent chunk's buffer, once nothing else holds it, takes the next
    /// received chunk (the same allocation, the received values); a buffer
    /// still shared, or one too small, is not taken.
    #[test]
    fn a_sent_chunks_buffer_takes_the_next_received_one() {
        let node = node();
        let mut bufs = ChunkBuffers::default();
        let sent: ChunkData = Arc::new(vec![7.0; 64]);
        let shared = Message::Chunk {
            op: 1,
            step: 0,
            data: sent.clone(),
        };
        bufs.recycle(shared);
        assert!(bufs.free.is_empty(), "taken while another message holds it");
        let ptr = sent.as_ptr();
        bufs.recycle(Message::Chunk {
            op: 1,
            step: 0,
            data: sent,
        });
        assert_eq!(bufs.free.len(), 1);
        let big = Message::Chunk {
            op: 1,
            step: 1,
            data: vec![0.5; 65].into(),
        };
        let f = frame_of(&node, 7, &big, Duration::ZERO).unwrap();
        let Some(Ok(Message::Chunk { data, .. })) = message_with(7, &f, &mut bufs) else {
            panic!("a chunk");
        };
        assert_eq!(*data, vec![0.5; 65]);
        assert_eq!(bufs.free.len(), 1, "too small for 65 elements");
        let small = Message::Chunk {
            op: 1,
            step: 1,
            data: vec![-1.25, 3.0].into(),
        };
        let f = frame_of(&node, 7, &small, Duration::ZERO).unwrap();
        let Some(Ok(Message::Chunk { data, .. })) = message_with(7, &f, &mut bufs) else {
            panic!("a chunk");
        };
        assert_eq!(*data, vec![-1.25, 3.0]);
        assert_eq!(data.as_ptr(), ptr, "the kept buffer");
        assert!(bufs.free.is_empty());
        for _ in 0..ChunkBuffers::KEPT + 2 {
            bufs.recycle(Message::Chunk {
                op: 1,
                step: 0,
                data: vec![1.0].into(),
            });
        }
        assert_eq!(bufs.free.len(), ChunkBuffers::KEPT, "kept at most");
    }

    #[test]
    fn a_marker_frame_of_the_wrong_length_is_refused() {
        let node = node();
        for (iteration, len, why) in [
            (RESUME_STEP, 8, "resume frame of 8 bytes"),
            (RESUME_STEP, 16, "resume frame of 16 bytes"),
            (RESUME_STEP, 0, "resume frame of 0 bytes"),
            (ABORT_STEP, 12, "abort frame of 12 bytes"),
            (COMPLETE_STEP, 4, "complete frame of 4 bytes"),
        ] {
            let mut f = node.alloc(len, Duration::ZERO).unwrap();
            // Even as f32 elements of a chunk, it is not one.
            f.header.dtype = Dtype::F32 as u16;
            f.header.iteration = iteration;
            f.header.stage = 7;
            assert_eq!(message_of(7, &f), Some(Err(why.to_string())));
        }
    }
}
