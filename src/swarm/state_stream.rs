//! A state sent in chunks, and put together again. A stage's state is one
//! payload as large as its weights and optimizer state (85 MB for
//! llama-small, gigabytes for the paper's models). Sent as one data frame
//! it took its connection's data lane for the whole transfer (7 s at
//! 100 Mbit/s): every data frame queued behind it waited that long, the
//! all-reduce chunks among them, and a stage whose member was downloading
//! the state stood still. Sent in chunks of [`CHUNK`] bytes, each queued
//! only once the peer's data lane is empty, the other data frames go
//! between two chunks: they wait one chunk at most.
//!
//! On the wire: the `StateResponse` message, then its bytes in data frames
//! of the same kind whose `microbatch` field is the chunk's offset, in
//! order, the low half of `iteration` [`MORE`] on every chunk but the last.
//! The receiver puts them together in a frame of the message's `bytes` and
//! hands that on as the message's data; a state in one frame is a single
//! chunk and goes on as it is. A last chunk that leaves the state short
//! hands on what came, and the length check refuses it as cut off.
//!
//! The engine hands messages and data frames over through two queues read
//! in no fixed order, so chunks may come before their message: they wait
//! for it (at most [`EARLY_CHUNKS_MAX`] of a peer), and are put together
//! once it came ([`StateReceiver::expect`] gives them back).
use crate::engine::{EngineError, Frame, SharedFrame, Transport};
use crate::protocol::NodeId;
use std::collections::HashMap;

/// Bytes of one chunk: 0.3 s at 100 Mbit/s, what a frame queued behind it
/// waits at most.
pub(super) const CHUNK: usize = 4 << 20;
/// The low half of a chunk's `iteration` field: more chunks follow.
pub(super) const MORE: u64 = 1;
/// The low half of the `iteration` field.
const LOW: u64 = 0xffff_ffff;
/// Chunks of a peer's state that may wait for its message (64 MiB).
pub(super) const EARLY_CHUNKS_MAX: usize = 16;

/// States being sent, by requester.
pub(super) struct StateSender {
    /// (requester, the state, the offset of its next chunk).
    streams: Vec<(NodeId, SharedFrame, usize)>,
    /// Bytes of a chunk ([`CHUNK`]).
    chunk: usize,
}

impl Default for StateSender {
    fn default() -> StateSender {
        StateSender::with_chunk(CHUNK)
    }
}

impl StateSender {
    pub(super) fn with_chunk(chunk: usize) -> StateSender {
        StateSender {
            streams: Vec::new(),
            chunk: chunk.max(1),
        }
    }

    /// Sends `state` to `to` from now on (one sent to it before is given
    /// up: its answer is this one).
    pub(super) fn start(&mut self, to: NodeId, state: SharedFrame) {
        self.forget(to);
        self.streams.push((to, state, 0));
    }

    /// `to` is gone: its state goes no further.
    pub(super) fn forget(&mut self, to: NodeId) {
        self.streams.retain(|s| s.0 != to);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Queues the next chunk of each state whose peer's data lane is
    /// empty; the states that could not go on (peer gone), with why.
    pub(super) fn pump(&mut self, net: &Transport) -> Vec<(NodeId, String)> {
        let mut failed = Vec::new();
        let chunk = self.chunk;
        self.streams.retain_mut(|(to, state, next)| {
            match net.queued_data(*to as u64) {
                None => {
                    failed.push((*to, "not connected".to_string()));
                    return false;
                }
                Some(0) => {}
                Some(_) => return true,
            }
            let end = (*next + chunk).min(state.len());
            let mut header = state.header;
            header.microbatch = *next as u64;
            header.iteration &= !LOW;
            if end < state.len() {
                header.iteration |= MORE;
            }
            match net.send_shared_range(*to as u64, header, state, *next..end, Default::default()) {
                Ok(()) => {
                    *next = end;
                    end < state.len()
                }
                Err(EngineError::Timeout(_)) => true,
                Err(e) => {
                    failed.push((*to, e.to_string()));
                    false
                }
            }
        });
        failed
    }
}

/// A state being put together.
struct Assembly {
    /// Its bytes, as its message says.
    total: usize,
    /// Where the chunks go (allocated at the first chunk shorter than the
    /// whole).
    frame: Option<Frame>,
    filled: usize,
    /// Its leading bytes that hold the weights were handed on already.
    weights_handed: bool,
}

/// What a chunk completed.
#[derive(Debug)]
pub(super) enum Received {
    /// Nothing yet.
    Nothing,
    /// A copy of the state's leading bytes that hold its weights (as the
    /// `weights` rule of [`StateReceiver::chunk`] says), the rest to come.
    Weights(Frame),
    /// The whole state.
    Whole(Frame),
    /// The whole state whose weights were handed on before.
    Rest(Frame),
}

impl Received {
    /// The whole state, whichever way it came.
    #[cfg(test)]
    fn whole(self) -> Option<Frame> {
        match self {
            Received::Whole(f) | Received::Rest(f) => Some(f),
            _ => None,
        }
    }
}

/// How many leading bytes of a state of `total` bytes hold its weights,
/// read from its first bytes (None: it goes on whole only).
pub(super) type WeightsRule<'a> = &'a dyn Fn(&[u8], usize) -> Option<usize>;

/// Why a chunk was not taken.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum ChunkError {
    /// Out of order, beyond the length announced, or of no state
    /// announced: the sender breaks the rules.
    Refused(String),
    /// The frame pool has no room for the whole state now: it is dropped
    /// (asked for again).
    NoRoom(String),
}

/// States being received, by sender.
#[derive(Default)]
pub(super) struct StateReceiver {
    by_peer: HashMap<NodeId, Assembly>,
    /// Chunks that came before their message, in order from offset 0.
    early: HashMap<NodeId, Vec<Frame>>,
}

impl StateReceiver {
    /// `from`'s message announces a state of `bytes`. Returns the chunks of
    /// it that came before the message: they go through
    /// [`StateReceiver::chunk`] now, in order.
    #[must_use]
    pub(super) fn expect(&mut self, from: NodeId, bytes: u64) -> Vec<Frame> {
        let total = bytes as usize;
        self.by_peer.insert(
            from,
            Assembly {
                total,
                frame: None,
                filled: 0,
                weights_handed: false,
            },
        );
        self.early.remove(&from).unwrap_or_default()
    }

    /// `from` is gone: what came of its state is dropped.
    pub(super) fn forget(&mut self, from: NodeId) {
        self.by_peer.remove(&from);
        self.early.remove(&from);
    }

    /// A chunk of `from`'s state: the whole state once its last chunk is
    /// in (None before). A chunk out of order or beyond the announced
    /// length is an error (the state is dropped). Of a state not announced
    /// yet, a single frame goes on as it is (the message's length check
    /// then judges it), and chunks wait for the message, in order from
    /// offset 0, at most [`EARLY_CHUNKS_MAX`]. `alloc` gives the frame the
    /// chunks go into. With a `weights` rule, once the leading bytes it
    /// names are in (and the state is not), a copy of them is handed on
    /// first ([`Received::Weights`], when the pool has room for it), and
    /// the whole state later as [`Received::Rest`].
    pub(super) fn chunk(
        &mut self,
        from: NodeId,
        weights: Option<WeightsRule>,
        f: Frame,
        mut alloc: impl FnMut(usize) -> Result<Frame, EngineError>,
    ) -> Result<Received, ChunkError> {
        let offset = f.header.microbatch as usize;
        let more = f.header.iteration & LOW != 0;
        let Some(a) = self.by_peer.get_mut(&from) else {
            if offset == 0 && !more {
                return Ok(Received::Whole(f));
            }
            let early = self.early.entry(from).or_default();
            if offset == 0 {
                // A new state: what came of another one goes.
                early.clear();
            }
            let next: usize = early.iter().map(|c| c.len()).sum();
            if offset != next || early.len() >= EARLY_CHUNKS_MAX {
                let kept = early.len();
                self.early.remove(&from);
                return Err(ChunkError::Refused(format!(
                    "a state chunk at byte {offset} of no state announced \
                     ({kept} chunks of it wait for its message)"
                )));
            }
            early.push(f);
            return Ok(Received::Nothing);
        };
        let n = f.len();
        if offset != a.filled || n == 0 || n > a.total - a.filled {
            let (total, filled) = (a.total, a.filled);
            self.by_peer.remove(&from);
            return Err(ChunkError::Refused(format!(
                "a state chunk of {n} bytes at byte {offset} (expected byte {filled} of {total})"
            )));
        }
        if offset == 0 && (n == a.total || !more) {
            // Whole in one frame, or a single frame short of it (refused
            // as cut off by the length check).
            self.by_peer.remove(&from);
            return Ok(Received::Whole(f));
        }
        if a.frame.is_none() {
            match alloc(a.total) {
                Ok(mut whole) => {
                    whole.header = f.header;
                    whole.header.microbatch = 0;
                    whole.header.iteration &= !LOW;
                    whole.header.payload_len = a.total as u64;
                    a.frame = Some(whole);
                }
                Err(e) => {
                    let total = a.total;
                    self.by_peer.remove(&from);
                    return Err(ChunkError::NoRoom(format!(
                        "no room for a state of {total} bytes: {e}"
                    )));
                }
            }
        }
        let whole = a.frame.as_mut().expect("allocated");
        whole.payload_mut()[offset..offset + n].copy_from_slice(f.payload());
        a.filled += n;
        if a.filled < a.total && more {
            if a.weights_handed {
                return Ok(Received::Nothing);
            }
            let (total, filled) = (a.total, a.filled);
            let Some(len) = weights
                .and_then(|rule| rule(&whole.payload()[..filled], total))
                .filter(|&len| len > 0 && len <= filled)
            else {
                return Ok(Received::Nothing);
            };
            // Without room for the copy now, tried again at the next
            // chunk: at worst the state goes on whole.
            let Ok(mut w) = alloc(len) else {
                return Ok(Received::Nothing);
            };
            a.weights_handed = true;
            w.header = whole.header;
            w.header.payload_len = len as u64;
            w.payload_mut().copy_from_slice(&whole.payload()[..len]);
            return Ok(Received::Weights(w));
        }
        // Whole, or its last chunk came short: what came goes on, and the
        // length check refuses it as cut off.
        let a = self.by_peer.remove(&from).expect("present");
        let handed = a.weights_handed;
        let Some(mut whole) = a.frame else {
            return Ok(Received::Nothing);
        };
        whole.truncate(a.filled);
        Ok(if handed {
            Received::Rest(whole)
        } else {
            Received::Whole(whole)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::NodeOptions;
    use std::time::{Duration, Instant};

    const T: Duration = Duration::from_secs(10);

    fn net(listen: bool) -> Transport {
        let opts = NodeOptions {
            listen: listen.then(|| "127.0.0.1:0".parse().unwrap()),
            max_payload: 1 << 20,
            pool_bytes: 16 << 20,
            swarm_key: b"state-stream-unit-test-key".to_vec(),
            ..NodeOptions::default()
        };
        Transport::new(opts).unwrap()
    }

    /// A chunk at `microbatch`, the last one unless `more`.
    fn chunk_at(net: &Transport, bytes: &[u8], microbatch: u64, more: bool) -> Frame {
        let mut f = net.alloc_copy(bytes, T).unwrap();
        f.header.microbatch = microbatch;
        f.header.iteration = (39 << 32) | if more { MORE } else { 0 };
        f
    }

    fn frame(net: &Transport, bytes: &[u8], microbatch: u64) -> Frame {
        chunk_at(net, bytes, microbatch, true)
    }

    /// With a rule for its weights, a state's leading bytes go on first,
    /// once they are in (a copy), and the whole state after them; without
    /// room for the copy, the state goes on whole.
    #[test]
    fn the_weights_go_on_first_when_a_rule_names_them() {
        let n = net(false);
        let state: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let rule = |head: &[u8], total: usize| (total == 1000 && head.len() >= 8).then_some(500);
        let rule: WeightsRule = &rule;
        for room in [true, false] {
            let mut r = StateReceiver::default();
            let alloc = |len| {
                if len == 500 && !room {
                    return Err(EngineError::InvalidArgument("no room".into()));
                }
                n.alloc(len, T)
            };
            assert!(r.expect(7, 1000).is_empty());
            let first = r.chunk(7, Some(rule), frame(&n, &state[..400], 0), alloc);
            assert!(matches!(first, Ok(Received::Nothing)));
            let mid = r.chunk(7, Some(rule), frame(&n, &state[400..800], 400), alloc);
            let last = chunk_at(&n, &state[800..], 800, false);
            let last = r.chunk(7, Some(rule), last, alloc).unwrap();
            match (room, mid.unwrap(), last) {
                (true, Received::Weights(w), Received::Rest(whole)) => {
                    assert_eq!(w.payload(), &state[..500]);
                    assert_eq!((w.header.microbatch, w.header.iteration), (0, 39 << 32));
                    assert_eq!(whole.payload(), &state[..]);
                }
                (false, Received::Nothing, Received::Whole(whole)) => {
                    assert_eq!(whole.payload(), &state[..]);
                }
                (room, mid, last) => panic!("room {room}: {mid:?} then {last:?}"),
            }
        }
    }

    /// A state in chunks is put together; one in a single frame goes on as
    /// it is; a last chunk short of the length announced hands on what
    /// came (the length check refuses it); chunks out of order, or beyond
    /// the length announced, or of a state never announced, are refused.
    #[test]
    fn chunks_are_put_together_in_order_only() {
        let n = net(false);
        let state: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let mut r = StateReceiver::default();
        let alloc = |len| n.alloc(len, T);
        assert!(r.expect(7, 1000).is_empty());
        assert!(matches!(
            r.chunk(7, None, frame(&n, &state[..400], 0), alloc),
            Ok(Received::Nothing)
        ));
        let mid = frame(&n, &state[400..800], 400);
        assert!(matches!(
            r.chunk(7, None, mid, alloc),
            Ok(Received::Nothing)
        ));
        let last = chunk_at(&n, &state[800..], 800, false);
        let whole = r.chunk(7, None, last, alloc).unwrap().whole().unwrap();
        assert_eq!((whole.payload(), whole.header.microbatch), (&state[..], 0));
        assert_eq!(whole.header.iteration, 39 << 32);

        let _ = r.expect(7, 1000);
        let one = r.chunk(7, None, chunk_at(&n, &state, 0, false), alloc);
        assert_eq!(one.unwrap().whole().unwrap().payload(), &state[..]);

        // Cut off, in one frame or more.
        let _ = r.expect(7, 1000);
        let short = r.chunk(7, None, chunk_at(&n, &state[..40], 0, false), alloc);
        assert_eq!(short.unwrap().whole().unwrap().len(), 40);
        let _ = r.expect(7, 1000);
        assert!(matches!(
            r.chunk(7, None, frame(&n, &state[..400], 0), alloc),
            Ok(Received::Nothing)
        ));
        let short = chunk_at(&n, &state[400..500], 400, false);
        assert_eq!(
            r.chunk(7, None, short, alloc)
                .unwrap()
                .whole()
                .unwrap()
                .len(),
            500
        );

        let _ = r.expect(7, 1000);
        assert!(matches!(
            r.chunk(7, None, frame(&n, &state[..400], 0), alloc),
            Ok(Received::Nothing)
        ));
        let e = r
            .chunk(7, None, frame(&n, &state[..400], 0), alloc)
            .unwrap_err();
        assert!(
            matches!(&e, ChunkError::Refused(m) if m.contains("expected byte 400 of 1000")),
            "{e:?}"
        );
        // Dropped with the error: a chunk after it belongs to nothing.
        assert!(r
            .chunk(7, None, frame(&n, &state[400..800], 400), alloc)
            .is_err());

        let _ = r.expect(7, 500);
        assert!(r
            .chunk(7, None, frame(&n, &state[..600], 0), alloc)
            .is_err());
        // Not announced: a whole frame goes on (its message judges it).
        let f = r.chunk(8, None, chunk_at(&n, &state[..10], 0, false), alloc);
        assert_eq!(f.unwrap().whole().unwrap().len(), 10);
    }

    /// Chunks that come before their message wait for it, then are put
    /// together; out of order, or too many, they are refused; a peer gone
    /// takes them with it.
    #[test]
    fn chunks_before_their_message_wait_for_it() {
        let n = net(false);
        let state: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let mut r = StateReceiver::default();
        let alloc = |len| n.alloc(len, T);
        assert!(matches!(
            r.chunk(7, None, frame(&n, &state[..400], 0), alloc),
            Ok(Received::Nothing)
        ));
        let mid = frame(&n, &state[400..800], 400);
        assert!(matches!(
            r.chunk(7, None, mid, alloc),
            Ok(Received::Nothing)
        ));
        let early = r.expect(7, 1000);
        assert_eq!(early.len(), 2);
        for f in early {
            assert!(matches!(r.chunk(7, None, f, alloc), Ok(Received::Nothing)));
        }
        let last = chunk_at(&n, &state[800..], 800, false);
        let whole = r.chunk(7, None, last, alloc).unwrap().whole().unwrap();
        assert_eq!(whole.payload(), &state[..]);

        // All of it before the message: whole once it comes.
        for (at, more) in [(0, true), (400, true), (800, false)] {
            let end = if more { at + 400 } else { 1000 };
            let c = chunk_at(&n, &state[at..end], at as u64, more);
            assert!(matches!(r.chunk(7, None, c, alloc), Ok(Received::Nothing)));
        }
        let mut got = None;
        for f in r.expect(7, 1000) {
            got = r.chunk(7, None, f, alloc).unwrap().whole();
        }
        assert_eq!(got.unwrap().payload(), &state[..]);

        // Out of order: refused, and what waited goes.
        assert!(matches!(
            r.chunk(7, None, frame(&n, &state[..400], 0), alloc),
            Ok(Received::Nothing)
        ));
        assert!(r
            .chunk(7, None, frame(&n, &state[800..], 800), alloc)
            .is_err());
        assert!(r.expect(7, 1000).is_empty());
        r.forget(7);

        // At most EARLY_CHUNKS_MAX wait.
        for k in 0..EARLY_CHUNKS_MAX {
            let c = frame(&n, &state[..10], 10 * k as u64);
            assert!(matches!(r.chunk(9, None, c, alloc), Ok(Received::Nothing)));
        }
        let over = frame(&n, &state[..10], 10 * EARLY_CHUNKS_MAX as u64);
        let e = r.chunk(9, None, over, alloc).unwrap_err();
        assert!(matches!(&e, ChunkError::Refused(m) if m.contains("wait for its message")));
        assert!(r.expect(9, 1000).is_empty());

        // A peer gone takes its early chunks with it.
        assert!(matches!(
            r.chunk(5, None, frame(&n, &state[..400], 0), alloc),
            Ok(Received::Nothing)
        ));
        r.forget(5);
        assert!(r.expect(5, 1000).is_empty());
    }

    /// A state goes out one chunk at a time, each once the peer's data
    /// lane is empty: a data frame sent while it streams arrives before the
    /// state's next chunk, not after the whole state.
    #[test]
    fn a_data_frame_goes_between_two_chunks_of_a_state() {
        let (a, b) = (net(false), net(true));
        let peer = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
        let state: Vec<u8> = (0..256u32 * 1024).map(|i| (i % 251) as u8).collect();
        let state = SharedFrame::from(frame(&a, &state, 0));
        let mut s = StateSender::with_chunk(64 << 10);
        s.start(peer as NodeId, state.clone());
        assert_eq!(s.pump(&a), vec![]);
        a.send(peer, frame(&a, b"between", 0), T).unwrap();
        let deadline = Instant::now() + T;
        while !s.is_empty() {
            assert!(Instant::now() < deadline, "the state never went out");
            assert!(s.pump(&a).is_empty());
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut r = StateReceiver::default();
        let _ = r.expect(1, state.len() as u64);
        let mut got = Vec::new();
        let mut whole = None;
        while whole.is_none() {
            let f = b.recv(T).unwrap();
            got.push(f.len());
            if f.len() == 7 {
                continue;
            }
            whole = r.chunk(1, None, f, |len| b.alloc(len, T)).unwrap().whole();
        }
        assert_eq!(got, vec![64 << 10, 7, 64 << 10, 64 << 10, 64 << 10]);
        assert_eq!(whole.unwrap().payload(), state.payload());
    }
}
