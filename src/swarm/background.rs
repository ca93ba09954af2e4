//! Work that training must not wait for, nor lose cores to: a holder's
//! check of the copies it receives, a member's digest of the copy it sends,
//! a holder's checkpoint writes. Each job runs on a thread of its own at
//! the lowest priority (nice 19), so on a busy machine it runs on what the
//! trainers and drivers leave; the driver collects the results when it
//! next looks, never blocking on them.
use crossbeam_channel::{Receiver, Sender};
use std::sync::{Arc, Mutex};

/// Lowers the calling thread's priority to the least (nice 19). Not
/// `SCHED_IDLE`: a thread that never runs while the cores are busy could
/// hold a lock training needs (the allocator's) for good. Best effort:
/// where the system refuses, the thread runs as it was.
pub fn lower_priority() {
    // SAFETY: gettid has no preconditions; setpriority on our own thread
    // id only changes this thread's nice value.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
}

/// Jobs on low-priority threads of their own, and their results.
pub(crate) struct Background<R> {
    tx: Sender<R>,
    rx: Receiver<R>,
}

impl<R> Default for Background<R> {
    fn default() -> Background<R> {
        let (tx, rx) = crossbeam_channel::unbounded();
        Background { tx, rx }
    }
}

impl<R: Send + 'static> Background<R> {
    /// Runs `job` on a thread named `name` at the lowest priority; here,
    /// at the caller's, where no thread can be started (nothing is lost).
    pub(crate) fn start<F>(&self, name: &str, job: F)
    where
        F: FnOnce() -> R + Send + 'static,
    {
        fn take<F>(slot: &Mutex<Option<F>>) -> Option<F> {
            slot.lock().ok().and_then(|mut j| j.take())
        }
        // The job waits in a slot that both sides can take it from, so
        // that a thread refused does not take the job down with it.
        let slot = Arc::new(Mutex::new(Some(job)));
        let (theirs, tx) = (slot.clone(), self.tx.clone());
        let spawned = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                lower_priority();
                if let Some(job) = take(&theirs) {
                    let _ = tx.send(job());
                }
            });
        if spawned.is_err() {
            if let Some(job) = take(&slot) {
                let _ = self.tx.send(job());
            }
        }
    }

    /// The results of the jobs done since the last call.
    pub(crate) fn done(&self) -> Vec<R> {
        self.rx.try_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Every job's result comes back once, on a thread at nice 19.
    #[test]
    fn jobs_run_at_the_lowest_priority_and_come_back_once() {
        let bg = Background::default();
        for k in 0..4u32 {
            bg.start("gwtf-bg-test", move || {
                // SAFETY: getpriority on our own thread id reads only.
                let nice = unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::getpriority(libc::PRIO_PROCESS, tid)
                };
                (k, nice)
            });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut got = Vec::new();
        while got.len() < 4 && Instant::now() < deadline {
            got.extend(bg.done());
            std::thread::sleep(Duration::from_millis(5));
        }
        got.sort_unstable();
        assert_eq!(got, (0..4).map(|k| (k, 19)).collect::<Vec<_>>());
        assert!(bg.done().is_empty());
    }
}
