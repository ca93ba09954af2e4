//! The simulator's event queue: a calendar queue (Brown 1988) over
//! (time, sequence number) keys.
//!
//! Time is cut into buckets of `2^SHIFT` µs; a ring of `BUCKETS` buckets
//! covers the next few seconds, where nearly every event falls (message
//! deliveries, compute, protocol ticks); later events wait in a binary heap
//! and move into the ring as it reaches them. A push into the ring is an
//! append to an unsorted bucket; a bucket is sorted once, when it becomes
//! the current one (later pushes into it are inserted in order). Events come
//! out in exactly the (time, sequence) order of a binary heap on the same
//! keys: the same run, at O(1) amortized per event instead of O(log n)
//! cache misses in a heap of hundreds of thousands of entries.
use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::protocol::Time;

/// Bucket width: 2^SHIFT µs (about 1 ms).
const SHIFT: u32 = 10;
/// Buckets in the ring (a power of two): a horizon of about 4 s.
const BUCKETS: usize = 4096;
const MASK: u64 = BUCKETS as u64 - 1;
const WORDS: usize = BUCKETS / 64;

/// One queued event: its instant, its sequence number (ties) and where the
/// event itself waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Key {
    pub t: Time,
    pub seq: u64,
    pub slot: u32,
}

impl Key {
    fn bucket(&self) -> u64 {
        self.t >> SHIFT
    }
}

pub(crate) struct EventQueue {
    /// Bucket number (time >> SHIFT) of `current`.
    cur: u64,
    /// The current bucket, sorted in decreasing order (the next key last).
    current: Vec<Key>,
    /// Ring of the buckets after `cur` and before `cur + BUCKETS`: bucket
    /// number b is at index b & MASK; unsorted.
    ring: Vec<Vec<Key>>,
    /// Non-empty ring buckets.
    bits: [u64; WORDS],
    /// Keys at or after `cur + BUCKETS` (sequence numbers are unique, so
    /// the order is total).
    far: BinaryHeap<Reverse<Key>>,
    len: usize,
}

impl EventQueue {
    pub fn new() -> EventQueue {
        EventQueue {
            cur: 0,
            current: Vec::new(),
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

    /// Queues `k`; `k.t` must not be before the last key popped.
    pub fn push(&mut self, k: Key) {
        self.len += 1;
        let b = k.bucket();
        debug_assert!(b >= self.cur, "event in the past");
        if b <= self.cur {
            // Into the bucket being consumed, in order.
            let at = self.current.partition_point(|x| *x > k);
            self.current.insert(at, k);
        } else if b < self.cur + BUCKETS as u64 {
            let i = (b & MASK) as usize;
            self.ring[i].push(k);
            self.bits[i / 64] |= 1 << (i % 64);
        } else {
            self.far.push(Reverse(k));
        }
    }

    /// The earliest key (smallest (t, seq)).
    pub fn pop(&mut self) -> Option<Key> {
        if self.current.is_empty() && !self.advance() {
            return None;
        }
        self.len -= 1;
        self.current.pop()
    }

    /// Makes the next non-empty bucket current; false when none is left.
    fn advance(&mut self) -> bool {
        let next = match (self.next_in_ring(), self.far.peek()) {
            (Some(r), Some(Reverse(f))) => r.min(f.bucket()),
            (Some(r), None) => r,
            (None, Some(Reverse(f))) => f.bucket(),
            (None, None) => return false,
        };
        self.cur = next;
        // The ring now covers [next, next + BUCKETS): bring in what the
        // window reached.
        while let Some(Reverse(f)) = self.far.peek() {
            if f.bucket() >= next + BUCKETS as u64 {
                break;
            }
            let Reverse(f) = self.far.pop().unwrap();
            let i = (f.bucket() & MASK) as usize;
            self.ring[i].push(f);
            self.bits[i / 64] |= 1 << (i % 64);
        }
        let i = (next & MASK) as usize;
        self.bits[i / 64] &= !(1 << (i % 64));
        // The drained buffer goes back to the ring: not a large one (a
        // burst's capacity would otherwise spread to every bucket).
        if self.current.capacity() > 256 {
            self.current = Vec::new();
        }
        std::mem::swap(&mut self.current, &mut self.ring[i]);
        self.current.sort_unstable_by(|a, b| b.cmp(a));
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
            let mut q = EventQueue::new();
            let mut h: BinaryHeap<Reverse<Key>> = BinaryHeap::new();
            let mut seq = 0;
            let mut now = 0;
            for step in 0..20_000 {
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
                    let k = Key {
                        t: now + d,
                        seq,
                        slot: step,
                    };
                    q.push(k);
                    h.push(Reverse(k));
                }
                if rng.below(2) == 0 {
                    let a = q.pop();
                    let b = h.pop().map(|r| r.0);
                    assert_eq!(a, b);
                    if let Some(k) = a {
                        now = k.t;
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
