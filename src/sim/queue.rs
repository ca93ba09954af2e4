//! The simulator's event queue: a calendar queue (Brown 1988) ordered by
//! (time, sequence number).
//!
//! Time is cut into buckets of `2^SHIFT` µs; a ring of `BUCKETS` buckets
//! covers the next few seconds, where nearly every event falls (message
//! deliveries, compute, protocol ticks); later events wait in a binary heap
//! and move into the ring as it reaches them. Events are stored in their
//! bucket (no separate slab): a push is an append to an unsorted bucket; a
//! bucket is ordered once, when it becomes the current one, by sorting small
//! keys that point into it (later pushes into it are inserted in order).
//! Events come out in exactly the (time, sequence) order of a binary heap
//! on the same keys: the same run, at O(1) amortized per event and with
//! the events of one bucket side by side in memory, instead of O(log n)
//! cache misses in a heap of hundreds of thousands of entries plus one in a
//! slab.
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::protocol::Time;

/// Bucket width: 2^SHIFT µs (about 1 ms).
const SHIFT: u32 = 10;
/// Buckets in the ring (a power of two): a horizon of about 4 s.
const BUCKETS: usize = 4096;
const MASK: u64 = BUCKETS as u64 - 1;
const WORDS: usize = BUCKETS / 64;
/// A drained bucket buffer larger than this is not recycled into the ring
/// (a burst's capacity would otherwise spread to every bucket).
const KEEP: usize = 256;

/// (time, sequence number, index of the event in the current bucket).
type Key = (Time, u64, u32);

struct Far<E> {
    t: Time,
    seq: u64,
    ev: E,
}
impl<E> PartialEq for Far<E> {
    fn eq(&self, o: &Self) -> bool {
        (self.t, self.seq) == (o.t, o.seq)
    }
}
impl<E> Eq for Far<E> {}
impl<E> PartialOrd for Far<E> {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl<E> Ord for Far<E> {
    fn cmp(&self, o: &Self) -> Ordering {
        (self.t, self.seq).cmp(&(o.t, o.seq))
    }
}

pub(crate) struct EventQueue<E> {
    /// Bucket number (time >> SHIFT) of the current bucket.
    cur: u64,
    /// The current bucket's events (taken out as they are popped) ...
    current: Vec<Option<(Time, u64, E)>>,
    /// ... and their keys, in decreasing order (the next one last).
    order: Vec<Key>,
    /// Ring of the buckets after `cur` and before `cur + BUCKETS`: bucket
    /// number b is at index b & MASK; unsorted.
    ring: Vec<Vec<Option<(Time, u64, E)>>>,
    /// Non-empty ring buckets.
    bits: [u64; WORDS],
    /// Events at or after `cur + BUCKETS` (sequence numbers are unique, so
    /// the order is total).
    far: BinaryHeap<Reverse<Far<E>>>,
    len: usize,
}

fn bucket(t: Time) -> u64 {
    t >> SHIFT
}

impl<E> EventQueue<E> {
    pub fn new() -> EventQueue<E> {
        EventQueue {
            cur: 0,
            current: Vec::new(),
            order: Vec::new(),
            ring: (0..BUCKETS).map(|_| Vec::new()).collect(),
            bits: [0; WORDS],
            far: BinaryHeap::new(),
            len: 0,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Queues `ev` at `t` with sequence number `seq` (unique, increasing);
    /// `t` must not be before the last event popped.
    pub fn push(&mut self, t: Time, seq: u64, ev: E) {
        self.len += 1;
        let b = bucket(t);
        debug_assert!(b >= self.cur, "event in the past");
        if b <= self.cur {
            // Into the bucket being consumed, in order.
            let k = (t, seq, self.current.len() as u32);
            self.current.push(Some((t, seq, ev)));
            let at = self.order.partition_point(|x| *x > k);
            self.order.insert(at, k);
        } else if b < self.cur + BUCKETS as u64 {
            let i = (b & MASK) as usize;
            self.ring[i].push(Some((t, seq, ev)));
            self.bits[i / 64] |= 1 << (i % 64);
        } else {
            self.far.push(Reverse(Far { t, seq, ev }));
        }
    }

    /// The earliest event (smallest (t, seq)) and its time.
    pub fn pop(&mut self) -> Option<(Time, E)> {
        if self.order.is_empty() && !self.advance() {
            return None;
        }
        let (_, _, i) = self.order.pop()?;
        self.len -= 1;
        let (t, _, ev) = self.current[i as usize].take().expect("queued event");
        Some((t, ev))
    }

    /// Makes the next non-empty bucket current; false when none is left.
    fn advance(&mut self) -> bool {
        let next = match (self.next_in_ring(), self.far.peek()) {
            (Some(r), Some(Reverse(f))) => r.min(bucket(f.t)),
            (Some(r), None) => r,
            (None, Some(Reverse(f))) => bucket(f.t),
            (None, None) => return false,
        };
        self.cur = next;
        // The ring now covers [next, next + BUCKETS): bring in what the
        // window reached.
        while let Some(Reverse(f)) = self.far.peek() {
            if bucket(f.t) >= next + BUCKETS as u64 {
                break;
            }
            let Reverse(f) = self.far.pop().unwrap();
            let i = (bucket(f.t) & MASK) as usize;
            self.ring[i].push(Some((f.t, f.seq, f.ev)));
            self.bits[i / 64] |= 1 << (i % 64);
        }
        let i = (next & MASK) as usize;
        self.bits[i / 64] &= !(1 << (i % 64));
        self.current.clear();
        if self.current.capacity() > KEEP {
            self.current = Vec::new();
        }
        std::mem::swap(&mut self.current, &mut self.ring[i]);
        self.order.clear();
        self.order
            .extend(self.current.iter().enumerate().map(|(j, e)| {
                let (t, seq, _) = e.as_ref().expect("queued event");
                (*t, *seq, j as u32)
            }));
        self.order.sort_unstable_by(|a, b| b.cmp(a));
        true
    }

    /// Bucket number of the first non-empty ring bucket after `cur`.
    fn next_in_ring(&self) -> Option<u64> {
        let start = ((self.cur + 1) & MASK) as usize;
        // Scan the words from `start` around the ring once.
        let mut w = start / 64;
        let mut word = self.bits[w] & (!0u64 << (start % 64));
        for _ in 0..=WORDS {
            if word != 0 {
                let i = w * 64 + word.trailing_zeros() as usize;
                let off = (i + BUCKETS - start) % BUCKETS;
                return Some(self.cur + 1 + off as u64);
            }
            w = (w + 1) % WORDS;
            word = self.bits[w];
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::rng::Rng;

    /// Same order as a binary heap on (t, seq), whatever the mix of near,
    /// same-bucket and far events.
    #[test]
    fn pops_in_heap_order() {
        for seed in 0..20 {
            let mut rng = Rng::new(seed);
            let mut q: EventQueue<u64> = EventQueue::new();
            let mut h: BinaryHeap<Reverse<(Time, u64)>> = BinaryHeap::new();
            let mut seq = 0;
            let mut now = 0;
            for _ in 0..20_000 {
                let pushes = rng.below(3);
                for _ in 0..pushes {
                    let d = match rng.below(6) {
                        0 => 0,
                        1 => rng.below(1 << SHIFT),
                        2 => rng.below(100_000),
                        3 => rng.below(3_000_000),
                        4 => rng.below(30_000_000),
                        _ => (BUCKETS as u64) << SHIFT,
                    };
                    seq += 1;
                    q.push(now + d, seq, seq);
                    h.push(Reverse((now + d, seq)));
                }
                if rng.below(2) == 0 {
                    let a = q.pop();
                    let b = h.pop().map(|r| (r.0 .0, r.0 .1));
                    assert_eq!(a, b);
                    if let Some((t, _)) = a {
                        now = t;
                    }
                }
                assert_eq!(q.len(), h.len());
            }
            while let Some(Reverse(k)) = h.pop() {
                assert_eq!(q.pop(), Some(k));
            }
            assert_eq!(q.pop(), None);
        }
    }
}
