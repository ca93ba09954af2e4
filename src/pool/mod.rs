//! Frame buffers: one large anonymous memory map per pool, carved into
//! power-of-two slots (size classes from 4 KiB up to the largest frame) by a
//! buddy allocator. A [`Lease`] is exclusive use of one slot until it is
//! released (dropped), from any thread. The pool never grows: when it is
//! full, allocation waits up to a timeout, then fails with a clear error.
//! Accounting (bytes and slots in use, high-water marks, waits, failures) is
//! visible through [`Pool::stats`].

use std::collections::BTreeSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// Smallest slot (one page).
pub const MIN_SLOT: usize = 4096;

/// Why an allocation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolError {
    /// The request is larger than the largest slot; it can never succeed.
    TooLarge { len: usize, max: usize },
    /// No slot became free within the timeout.
    Exhausted {
        len: usize,
        in_use: usize,
        capacity: usize,
        waited: Duration,
    },
    /// The memory map could not be created.
    Map(String),
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::TooLarge { len, max } => {
                write!(f, "buffer of {len} bytes is larger than the largest pool slot ({max} bytes)")
            }
            PoolError::Exhausted {
                len,
                in_use,
                capacity,
                waited,
            } => write!(
                f,
                "frame pool exhausted: no slot for {len} bytes after waiting {waited:?} ({in_use} of {capacity} bytes in use; release frames or raise the pool size)"
            ),
            PoolError::Map(e) => write!(f, "cannot map the frame pool: {e}"),
        }
    }
}

impl std::error::Error for PoolError {}

/// Pool accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub capacity_bytes: u64,
    /// Bytes of the slots in use (slot sizes, not requested lengths).
    pub in_use_bytes: u64,
    pub high_water_bytes: u64,
    /// Number of smallest slots the pool holds (capacity / 4 KiB).
    pub slots_total: u64,
    pub slots_in_use: u64,
    pub slots_high_water: u64,
    pub leases_total: u64,
    /// Allocations that had to wait for a release.
    pub waits: u64,
    /// Allocations that failed (timeout or too large).
    pub failures: u64,
}

struct Buddy {
    /// Free block offsets per order (order 0 = MIN_SLOT).
    free: Vec<BTreeSet<usize>>,
    in_use_bytes: usize,
    high_water_bytes: usize,
    slots_in_use: usize,
    slots_high_water: usize,
}

impl Buddy {
    fn alloc(&mut self, order: usize) -> Option<usize> {
        let mut o = order;
        while o < self.free.len() && self.free[o].is_empty() {
            o += 1;
        }
        if o == self.free.len() {
            return None;
        }
        let off = self.free[o].pop_first()?;
        while o > order {
            o -= 1;
            self.free[o].insert(off + (MIN_SLOT << o));
        }
        let size = MIN_SLOT << order;
        self.in_use_bytes += size;
        self.high_water_bytes = self.high_water_bytes.max(self.in_use_bytes);
        self.slots_in_use += 1;
        self.slots_high_water = self.slots_high_water.max(self.slots_in_use);
        Some(off)
    }

    fn release(&mut self, mut off: usize, mut order: usize) {
        self.in_use_bytes -= MIN_SLOT << order;
        self.slots_in_use -= 1;
        let top = self.free.len() - 1;
        while order < top {
            let buddy = off ^ (MIN_SLOT << order);
            if self.free[order].remove(&buddy) {
                off = off.min(buddy);
                order += 1;
            } else {
                break;
            }
        }
        self.free[order].insert(off);
    }
}

struct Inner {
    map: memmap2::MmapMut,
    base: *mut u8,
    max_slot: usize,
    state: Mutex<Buddy>,
    released: Condvar,
    waiters: AtomicUsize,
    hook: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
    want_hook: std::sync::atomic::AtomicBool,
    leases_total: AtomicU64,
    waits: AtomicU64,
    failures: AtomicU64,
}

// SAFETY: `base` points into `map`, which lives as long as Inner; the buddy
// allocator hands each byte range to at most one lease at a time.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// A pool of frame buffers. Cheap to clone (shared).
#[derive(Clone)]
pub struct Pool(Arc<Inner>);

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pool({:?})", self.stats())
    }
}

fn order_for(len: usize) -> usize {
    let slots = len.max(1).div_ceil(MIN_SLOT);
    slots.next_power_of_two().trailing_zeros() as usize
}

impl Pool {
    /// A pool of at least `capacity` bytes whose largest slot holds `max_len`
    /// bytes. The capacity is rounded up to a whole number of largest slots;
    /// pages are only backed by memory once they are used.
    pub fn new(capacity: usize, max_len: usize) -> Result<Self, PoolError> {
        let top = order_for(max_len);
        let max_slot = MIN_SLOT << top;
        let blocks = capacity.max(1).div_ceil(max_slot).max(1);
        let len = blocks
            .checked_mul(max_slot)
            .ok_or_else(|| PoolError::Map("capacity overflows".into()))?;
        let mut map = memmap2::MmapOptions::new()
            .len(len)
            .map_anon()
            .map_err(|e| PoolError::Map(e.to_string()))?;
        let base = map.as_mut_ptr();
        let mut free: Vec<BTreeSet<usize>> = (0..=top).map(|_| BTreeSet::new()).collect();
        for b in 0..blocks {
            free[top].insert(b * max_slot);
        }
        Ok(Pool(Arc::new(Inner {
            map,
            base,
            max_slot,
            state: Mutex::new(Buddy {
                free,
                in_use_bytes: 0,
                high_water_bytes: 0,
                slots_in_use: 0,
                slots_high_water: 0,
            }),
            released: Condvar::new(),
            waiters: AtomicUsize::new(0),
            hook: Mutex::new(None),
            want_hook: Default::default(),
            leases_total: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        })))
    }

    pub fn capacity(&self) -> usize {
        self.0.map.len()
    }

    pub fn max_slot(&self) -> usize {
        self.0.max_slot
    }

    fn lease(&self, off: usize, order: usize, len: usize) -> Lease {
        self.0.leases_total.fetch_add(1, Ordering::Relaxed);
        Lease {
            pool: self.0.clone(),
            // SAFETY: off + slot size <= map length (buddy invariant).
            ptr: unsafe { self.0.base.add(off) },
            off,
            order,
            len,
        }
    }

    /// A slot for `len` bytes now, or `None` when the pool is full.
    pub fn try_alloc(&self, len: usize) -> Result<Option<Lease>, PoolError> {
        if len > self.0.max_slot {
            self.0.failures.fetch_add(1, Ordering::Relaxed);
            return Err(PoolError::TooLarge {
                len,
                max: self.0.max_slot,
            });
        }
        let order = order_for(len);
        let off = self.0.state.lock().alloc(order);
        Ok(off.map(|off| self.lease(off, order, len)))
    }

    /// A slot for `len` bytes, waiting up to `timeout` for one to be released.
    pub fn alloc(&self, len: usize, timeout: Duration) -> Result<Lease, PoolError> {
        if let Some(l) = self.try_alloc(len)? {
            return Ok(l);
        }
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        let order = order_for(len);
        self.0.waits.fetch_add(1, Ordering::Relaxed);
        let mut st = self.0.state.lock();
        self.0.waiters.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            if let Some(off) = st.alloc(order) {
                break Some(off);
            }
            let timed_out = match deadline {
                Some(d) => self.0.released.wait_until(&mut st, d).timed_out(),
                None => {
                    self.0.released.wait(&mut st);
                    false
                }
            };
            if timed_out {
                break st.alloc(order);
            }
        };
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
        let in_use = st.in_use_bytes;
        drop(st);
        match result {
            Some(off) => Ok(self.lease(off, order, len)),
            None => {
                self.0.failures.fetch_add(1, Ordering::Relaxed);
                Err(PoolError::Exhausted {
                    len,
                    in_use,
                    capacity: self.capacity(),
                    waited: start.elapsed(),
                })
            }
        }
    }

    /// Sets a function called (on the releasing thread) after a release while
    /// [`Pool::want_release_hook`] is armed: the engine uses it to wake its
    /// poll thread when it waits for a slot.
    pub fn set_release_hook(&self, f: Box<dyn Fn() + Send + Sync>) {
        *self.0.hook.lock() = Some(f);
    }

    /// Arms (or disarms) the release hook.
    pub fn want_release_hook(&self, on: bool) {
        self.0.want_hook.store(on, Ordering::SeqCst);
    }

    pub fn stats(&self) -> PoolStats {
        let st = self.0.state.lock();
        PoolStats {
            capacity_bytes: self.capacity() as u64,
            in_use_bytes: st.in_use_bytes as u64,
            high_water_bytes: st.high_water_bytes as u64,
            slots_total: (self.capacity() / MIN_SLOT) as u64,
            slots_in_use: st.slots_in_use as u64,
            slots_high_water: st.slots_high_water as u64,
            leases_total: self.0.leases_total.load(Ordering::Relaxed),
            waits: self.0.waits.load(Ordering::Relaxed),
            failures: self.0.failures.load(Ordering::Relaxed),
        }
    }
}

/// Exclusive use of one pool slot, released on drop (from any thread). The
/// pool's memory stays mapped while any lease is alive.
pub struct Lease {
    pool: Arc<Inner>,
    ptr: *mut u8,
    off: usize,
    order: usize,
    len: usize,
}

// SAFETY: a lease is the only handle to its byte range.
unsafe impl Send for Lease {}
unsafe impl Sync for Lease {}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lease({} bytes at +{})", self.len, self.off)
    }
}

impl Lease {
    /// Requested length.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Size of the slot (at least `len`).
    pub fn slot_len(&self) -> usize {
        MIN_SLOT << self.order
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: exclusive range of `len` bytes inside the live map.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    /// Shortens the lease (the slot stays the same).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    /// Lengthens the lease to `len` within its slot (the added bytes hold
    /// whatever the slot held); false, and unchanged, if the slot is
    /// shorter. Lets a trailer follow a payload without a second buffer.
    pub fn grow_within_slot(&mut self, len: usize) -> bool {
        if len > self.slot_len() {
            return false;
        }
        self.len = self.len.max(len);
        true
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let p = &self.pool;
        p.state.lock().release(self.off, self.order);
        if p.waiters.load(Ordering::SeqCst) > 0 {
            p.released.notify_all();
        }
        if p.want_hook.load(Ordering::SeqCst) {
            if let Some(h) = p.hook.lock().as_ref() {
                h();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carve_release_and_coalesce() {
        let pool = Pool::new(1 << 20, 1 << 20).unwrap();
        assert_eq!(pool.capacity(), 1 << 20);
        let a = pool.try_alloc(100).unwrap().unwrap();
        let b = pool.try_alloc(5000).unwrap().unwrap();
        assert_eq!(a.slot_len(), 4096);
        assert_eq!(b.slot_len(), 8192);
        assert!(pool.try_alloc(1 << 20).unwrap().is_none());
        let s = pool.stats();
        assert_eq!(s.slots_in_use, 2);
        assert_eq!(s.in_use_bytes, 12288);
        drop(a);
        drop(b);
        let big = pool.try_alloc(1 << 20).unwrap().unwrap();
        assert_eq!(big.len(), 1 << 20);
        drop(big);
        let s = pool.stats();
        assert_eq!((s.in_use_bytes, s.slots_in_use), (0, 0));
        assert_eq!(s.high_water_bytes, 1 << 20);
        assert!(matches!(
            pool.try_alloc((1 << 20) + 1),
            Err(PoolError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_lease_grows_within_its_slot_and_no_further() {
        let pool = Pool::new(1 << 20, 1 << 20).unwrap();
        let mut a = pool.try_alloc(5000).unwrap().unwrap();
        a.as_mut_slice().fill(1);
        assert!(a.grow_within_slot(5032));
        assert_eq!(a.len(), 5032);
        assert_eq!(&a.as_slice()[..5000], &[1u8; 5000][..]);
        assert!(a.grow_within_slot(8192));
        assert!(!a.grow_within_slot(8193));
        assert_eq!(a.len(), 8192);
        // Growing never shortens.
        assert!(a.grow_within_slot(10));
        assert_eq!(a.len(), 8192);
    }

    #[test]
    fn exhausted_waits_then_fails_or_gets_released_slot() {
        let pool = Pool::new(64 << 10, 64 << 10).unwrap();
        let mut l = pool.alloc(64 << 10, Duration::ZERO).unwrap();
        l.as_mut_slice()[0] = 7;
        let e = pool.alloc(1, Duration::from_millis(20)).unwrap_err();
        assert!(e.to_string().contains("exhausted"), "{e}");
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(l);
        });
        let l2 = pool.alloc(10, Duration::from_secs(30)).unwrap();
        t.join().unwrap();
        assert_eq!(l2.len(), 10);
        assert_eq!(pool.stats().failures, 1);
    }

    #[test]
    fn many_threads_never_overlap() {
        let pool = Pool::new(1 << 20, 64 << 10).unwrap();
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    for i in 0..200usize {
                        let len = 1 + (i * 7919 + t as usize * 31) % (64 << 10);
                        let mut l = pool.alloc(len, Duration::from_secs(30)).unwrap();
                        l.as_mut_slice().fill(t);
                        std::thread::yield_now();
                        assert!(l.as_slice().iter().all(|&b| b == t));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(pool.stats().in_use_bytes, 0);
    }
}
