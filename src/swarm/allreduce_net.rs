//! The ring all-reduce over the engine's authenticated connections.
//!
//! A chunk is one data frame: `dtype` f32, `shape = [elements]`,
//! `stage` = the stage, `microbatch` = the operation id, `iteration` = the
//! step of the schedule. An abort is a frame with an empty payload,
//! `iteration` = [`ABORT_STEP`] and the lost member's id as its 8-byte
//! payload. Member ids are the engine's node ids.
//!
//! Chunks are written straight into pool slots (one copy, from the
//! trainer's gradient into the frame) and read out of the received slot
//! without another.
use super::allreduce::{Message, Outcome, RingAllReduce};
use crate::engine::{EngineError, Event, Frame, Node};
use crate::wire::Dtype;
use std::time::{Duration, Instant};

/// `iteration` of an abort frame.
pub const ABORT_STEP: u64 = u64::MAX;

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
    node: &Node,
    stage: u32,
    msg: &Message,
    timeout: Duration,
) -> Result<Frame, EngineError> {
    let mut f = match msg {
        Message::Chunk { op, step, data } => {
            let mut f = node.alloc(std::mem::size_of_val(data.as_slice()), timeout)?;
            for (dst, x) in f.payload_mut().chunks_exact_mut(4).zip(data) {
                dst.copy_from_slice(&x.to_le_bytes());
            }
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
    };
    f.header.stage = stage;
    Ok(f)
}

/// The message a received frame carries, if it is one of this stage's.
pub fn message_of(stage: u32, f: &Frame) -> Option<Result<Message, String>> {
    let h = &f.header;
    if h.stage != stage {
        return None;
    }
    if h.iteration == ABORT_STEP {
        let p = f.payload();
        if p.len() != 8 {
            return Some(Err(format!("abort frame of {} bytes", p.len())));
        }
        let lost = u64::from_le_bytes(p.try_into().expect("8 bytes"));
        return Some(Ok(Message::Abort {
            op: h.microbatch,
            lost,
        }));
    }
    if h.dtype != Dtype::F32 as u16 || h.iteration > u32::MAX as u64 || f.payload().len() % 4 != 0 {
        return Some(Err(format!(
            "chunk frame with dtype {}, step {} and {} bytes",
            h.dtype,
            h.iteration,
            f.payload().len()
        )));
    }
    let data = f
        .payload()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    Some(Ok(Message::Chunk {
        op: h.microbatch,
        step: h.iteration as u32,
        data,
    }))
}

/// Runs `op` to its end over `node`: sends what the machine asks, feeds it
/// the frames of `stage` and the engine's lost-peer events, until it is no
/// longer running or `deadline` passes. Frames of other stages or other
/// operations are dropped (this driver owns the node while it runs).
pub fn run(
    node: &Node,
    stage: u32,
    mut op: RingAllReduce,
    deadline: Instant,
) -> Result<Outcome, NetError> {
    let send_timeout = Duration::from_secs(5);
    loop {
        for (to, msg) in op.take_outbox() {
            let f = frame_of(node, stage, &msg, send_timeout)?;
            if let Err(e) = node.send(to, f, send_timeout) {
                // A peer that cannot be reached is a lost peer.
                match e {
                    EngineError::NotFound(_) | EngineError::Closed(_) => op.on_peer_lost(to),
                    e => return Err(e.into()),
                }
            }
        }
        if op.outcome() != &Outcome::Running {
            // Aborts still queued above were sent before we return.
            return Ok(op.outcome().clone());
        }
        while let Some(ev) = node.poll_event(Duration::ZERO) {
            if let Event::PeerLost { peer, .. } = ev {
                op.on_peer_lost(peer);
            }
        }
        if op.outcome() != &Outcome::Running {
            continue;
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(NetError::Timeout);
        }
        let wait = (deadline - now).min(Duration::from_millis(20));
        match node.recv(wait) {
            Ok(f) => {
                let from = f.peer();
                match message_of(stage, &f) {
                    Some(Ok(msg)) => op.on_message(from, msg),
                    Some(Err(_)) => op.on_peer_lost(from),
                    None => {}
                }
            }
            Err(EngineError::Timeout(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
}
