//! The memory of the stage all-reduce's chunks: views of shared buffers
//! and a free list that takes a buffer back when its last view goes.
//!
//! Why: a member of a 64 MB all-reduce used to allocate a fresh buffer for
//! every part of its input, for every chunk it received and for its result,
//! each operation: tens of thousands of page faults and page clearings per
//! member, more than the copies themselves cost (the profile is in
//! docs/EVALUATION.md). Now the input is one buffer whose parts travel as
//! views ([`SharedBuf::slice`]), the result is gathered into that same
//! buffer (in place, as gloo reduces), and a received chunk's buffer comes
//! from a [`ChunkBuffers`] list that gets it back when the machine is done
//! with it.
use crate::engine::Frame;
use std::ops::{Deref, Range};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// The free list a pooled buffer goes back to.
type FreeList = Mutex<Vec<Vec<f32>>>;

/// A buffer and, if it came from a [`ChunkBuffers`], the list it goes back
/// to when dropped; or a received frame whose payload is read in place.
#[derive(Debug, Default)]
struct Pooled {
    v: Vec<f32>,
    home: Option<Weak<FreeList>>,
    /// A frame read in place (then `v` is empty), and the counter of the
    /// bytes such frames hold, which its drop gives back.
    frame: Option<(Frame, Arc<AtomicUsize>)>,
}

impl Pooled {
    fn of(v: Vec<f32>) -> Pooled {
        Pooled {
            v,
            home: None,
            frame: None,
        }
    }

    fn elements(&self) -> &[f32] {
        match &self.frame {
            Some((f, _)) => f32s_of(f.payload()).unwrap_or(&[]),
            None => &self.v,
        }
    }
}

/// `bytes` as f32s in place, where that is their memory layout (a
/// little-endian machine, 4-byte aligned, a whole number of elements).
fn f32s_of(bytes: &[u8]) -> Option<&[f32]> {
    if cfg!(target_endian = "big") || bytes.len() % 4 != 0 {
        return None;
    }
    // SAFETY: every bit pattern is a valid f32, and `align_to` only puts
    // in the middle what is aligned for f32.
    let (head, mid, tail) = unsafe { bytes.align_to::<f32>() };
    (head.is_empty() && tail.is_empty()).then_some(mid)
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some((f, held)) = self.frame.take() {
            held.fetch_sub(f.slot_len(), Ordering::Relaxed);
            return;
        }
        let Some(home) = self.home.take().and_then(|h| h.upgrade()) else {
            return;
        };
        // A poisoned list only means another thread panicked while
        // pushing: the buffer is freed instead.
        let Ok(mut free) = home.lock() else {
            return;
        };
        let kept: usize = free.iter().map(|v| v.capacity()).sum();
        if free.len() < ChunkBuffers::KEPT
            && kept + self.v.capacity() <= ChunkBuffers::KEPT_ELEMENTS
        {
            free.push(std::mem::take(&mut self.v));
        }
    }
}

/// A buffer shared by the messages that carry its parts. The member's own
/// copy is written in place ([`SharedBuf::make_mut`]) once no message holds
/// it any more; while one does, writing copies it first, so a view never
/// changes under its reader.
#[derive(Debug, Default)]
pub struct SharedBuf(Arc<Pooled>);

impl SharedBuf {
    pub fn new(v: Vec<f32>) -> SharedBuf {
        SharedBuf(Arc::new(Pooled::of(v)))
    }

    /// Elements `range` as a chunk that shares this buffer (no copy).
    pub fn slice(&self, range: Range<usize>) -> ChunkData {
        debug_assert!(range.end <= self.0.elements().len());
        ChunkData {
            buf: self.0.clone(),
            range,
        }
    }

    /// The buffer to write: in place when no view of it is alive (the
    /// driver framed and dropped the messages that held them), otherwise a
    /// copy that replaces this member's (the views keep the old bits).
    pub fn make_mut(&mut self) -> &mut Vec<f32> {
        if Arc::get_mut(&mut self.0).is_none_or(|p| p.frame.is_some()) {
            self.0 = Arc::new(Pooled::of(self.0.elements().to_vec()));
        }
        &mut Arc::get_mut(&mut self.0).expect("unique after the copy").v
    }

    /// The buffer itself, copied only if a view of it is still alive.
    pub fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(self.make_mut())
    }
}

impl Deref for SharedBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        self.0.elements()
    }
}

/// A chunk's elements: a range of a shared buffer. A butterfly owner sends
/// one reduced part to every other member from one buffer, a member's
/// input parts travel as views of its input, and a received chunk's buffer
/// goes back to its [`ChunkBuffers`] when the last view is dropped.
#[derive(Clone, Default)]
pub struct ChunkData {
    buf: Arc<Pooled>,
    range: Range<usize>,
}

impl ChunkData {
    /// Whether this chunk is the whole of a buffer nothing else shares:
    /// the reduction may then sum into it without a copy.
    pub fn into_unique_vec(self) -> Result<Vec<f32>, ChunkData> {
        let whole = self.range.start == 0 && self.range.end == self.buf.v.len();
        if !whole || self.buf.frame.is_some() {
            return Err(self);
        }
        let range = self.range;
        match Arc::try_unwrap(self.buf) {
            Ok(mut p) => {
                // Leaves the pool: the caller keeps it (as a reduced part,
                // which goes back to nobody).
                p.home = None;
                Ok(std::mem::take(&mut p.v))
            }
            Err(buf) => Err(ChunkData { buf, range }),
        }
    }
}

impl Deref for ChunkData {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf.elements()[self.range.clone()]
    }
}

impl From<Vec<f32>> for ChunkData {
    fn from(v: Vec<f32>) -> ChunkData {
        let range = 0..v.len();
        ChunkData {
            buf: Arc::new(Pooled::of(v)),
            range,
        }
    }
}

impl PartialEq for ChunkData {
    fn eq(&self, other: &ChunkData) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for ChunkData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Buffers for received chunks, reused: a chunk's buffer comes back here
/// when the machine drops its last view (summed into the owner's part,
/// copied into the result), and takes the next chunk received. A buffer of
/// tens of megabytes freshly allocated costs more in page faults than its
/// copy; reused, it costs the copy only. Cloning shares the list. At most
/// [`Self::KEPT`] buffers and [`Self::KEPT_ELEMENTS`] elements are kept;
/// dropping the list frees them (buffers still in use are freed when their
/// chunk goes).
#[derive(Clone, Debug, Default)]
pub struct ChunkBuffers {
    free: Arc<FreeList>,
    /// Pool bytes (slots) of received frames read in place
    /// ([`Self::take`]) while their chunks live, and how many they may be
    /// (0: never).
    frames_held: Arc<AtomicUsize>,
    frame_budget: usize,
}

impl ChunkBuffers {
    /// Buffers that also read received frames in place, without a copy,
    /// while the pool slots such chunks hold stay within `bytes`: a chunk
    /// holds its frame's pool slot until it is summed or gathered, and a
    /// pool held by chunks cannot receive the rest of them.
    pub fn holding_frames(bytes: usize) -> ChunkBuffers {
        ChunkBuffers {
            frame_budget: bytes,
            ..ChunkBuffers::default()
        }
    }

    /// Pool bytes (slots) of received frames that chunks hold now.
    pub fn frames_held(&self) -> usize {
        self.frames_held.load(Ordering::Relaxed)
    }

    /// The chunk of received frame `f`'s payload (little-endian f32s):
    /// the frame itself, read in place, while the budget of
    /// [`Self::holding_frames`] allows; otherwise copied as
    /// [`Self::fill`] does, and the frame let go at once.
    pub fn take(&self, f: Frame) -> ChunkData {
        let len = f.slot_len();
        let n = f32s_of(f.payload()).map(<[f32]>::len);
        let held = self.frames_held.fetch_add(len, Ordering::Relaxed);
        match n {
            Some(n) if held + len <= self.frame_budget => ChunkData {
                buf: Arc::new(Pooled {
                    v: Vec::new(),
                    home: None,
                    frame: Some((f, self.frames_held.clone())),
                }),
                range: 0..n,
            },
            _ => {
                self.frames_held.fetch_sub(len, Ordering::Relaxed);
                self.fill(f.payload())
            }
        }
    }

    /// Buffers kept at most: a butterfly of 64 members holds 63 received
    /// slices of its part at once.
    pub const KEPT: usize = 64;
    /// Elements kept at most, all buffers together (1 GiB of f32).
    pub const KEPT_ELEMENTS: usize = 1 << 28;

    /// Buffers waiting for a chunk.
    pub fn kept(&self) -> usize {
        self.free.lock().map(|f| f.len()).unwrap_or(0)
    }

    /// The little-endian f32s of `src` (a trailing partial element is
    /// ignored; callers check the length), in a kept buffer large enough
    /// if there is one: one copy on a little-endian machine. The chunk's
    /// buffer comes back to this list when its last view is dropped.
    pub fn fill(&self, src: &[u8]) -> ChunkData {
        let n = src.len() / 4;
        let kept = self.free.lock().ok().and_then(|mut free| {
            let i = free.iter().position(|v| v.capacity() >= n)?;
            Some(free.swap_remove(i))
        });
        let mut out = kept.unwrap_or_else(|| Vec::with_capacity(n));
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
        ChunkData {
            buf: Arc::new(Pooled {
                v: out,
                home: Some(Arc::downgrade(&self.free)),
                frame: None,
            }),
            range: 0..n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(xs: &[f32]) -> Vec<u8> {
        xs.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// A received chunk's buffer goes back to its list when its last view
    /// is dropped, and the next chunk is written into it.
    #[test]
    fn a_dropped_chunks_buffer_takes_the_next_one() {
        let bufs = ChunkBuffers::default();
        let a = bufs.fill(&bytes(&[1.0, 2.0, 3.0]));
        assert_eq!(&*a, &[1.0, 2.0, 3.0]);
        let ptr = a.as_ptr();
        let view = a.clone();
        drop(a);
        assert_eq!(bufs.kept(), 0, "a view still holds it");
        drop(view);
        assert_eq!(bufs.kept(), 1);
        let b = bufs.fill(&bytes(&[-1.25, 3.0]));
        assert_eq!(&*b, &[-1.25, 3.0]);
        assert_eq!(b.as_ptr(), ptr, "the kept buffer");
        assert_eq!(bufs.kept(), 0);
        let c = bufs.fill(&bytes(&[0.5; 4]));
        assert_ne!(c.as_ptr(), ptr, "a fresh one while the first is in use");
    }

    #[test]
    fn the_list_keeps_at_most_its_bounds() {
        let bufs = ChunkBuffers::default();
        let chunks: Vec<ChunkData> = (0..ChunkBuffers::KEPT + 3)
            .map(|_| bufs.fill(&bytes(&[1.0])))
            .collect();
        drop(chunks);
        assert_eq!(bufs.kept(), ChunkBuffers::KEPT);
        let gone = ChunkBuffers::default();
        let orphan = gone.fill(&bytes(&[1.0]));
        drop(gone);
        drop(orphan); // its list is gone: freed, nothing to panic on
    }

    /// A view never changes under its reader: writing the shared buffer
    /// while a view is alive writes a copy.
    #[test]
    fn writing_a_shared_buffer_leaves_its_views_alone() {
        let mut buf = SharedBuf::new(vec![1.0, 2.0, 3.0, 4.0]);
        let ptr = buf.as_ptr();
        let view = buf.slice(2..4);
        buf.make_mut()[3] = 9.0;
        assert_eq!(&*view, &[3.0, 4.0]);
        assert_eq!(&buf[..], &[1.0, 2.0, 3.0, 9.0]);
        assert_ne!(buf.as_ptr(), ptr, "copied");
        drop(view);
        let ptr = buf.as_ptr();
        buf.make_mut()[0] = 5.0;
        assert_eq!(buf.as_ptr(), ptr, "in place once no view is alive");
        assert_eq!(buf.into_vec(), vec![5.0, 2.0, 3.0, 9.0]);
    }

    #[test]
    fn only_a_whole_unshared_chunk_gives_its_vec() {
        let whole = ChunkData::from(vec![1.0, 2.0]);
        let other = whole.clone();
        let whole = whole.into_unique_vec().expect_err("shared");
        drop(other);
        assert_eq!(whole.into_unique_vec().unwrap(), vec![1.0, 2.0]);
        let buf = SharedBuf::new(vec![1.0, 2.0, 3.0]);
        let part = buf.slice(0..2);
        drop(buf);
        assert!(part.into_unique_vec().is_err(), "a part of a buffer");
    }
}
