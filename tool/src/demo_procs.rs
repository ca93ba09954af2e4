//! The processes of `gwtf demo`: its node children (killed when the guard is
//! dropped), the threads that read their output, Ctrl-C, free ports, and the
//! seeded choice of victims.
use crossbeam_channel::Sender;
use gwtf::swarm::audit::NodeId;
use std::collections::{BTreeSet, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Set by SIGINT / SIGTERM: the demo stops its nodes and reports.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

pub extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Makes the child started by `cmd` die with this process (SIGKILL when
/// the parent goes), so that no node outlives the demo or the bench, even
/// when they are killed outright. The thread that spawns must live as long
/// as the parent (the main thread).
pub fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe; it runs in the child between fork
    // and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

pub fn catch_interrupts() {
    let handler: extern "C" fn(libc::c_int) = on_signal;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
    }
}

/// A line of one node's stdout with the time it was read, or its end (every
/// line of the node has been sent before).
pub enum Msg {
    Line(NodeId, f64, String),
    Eof(NodeId),
}

pub struct Proc {
    pub id: NodeId,
    pub child: Child,
    pub exited: bool,
    /// Every line of its stdout has been taken in.
    pub stdout_closed: bool,
    /// The last lines of its stderr.
    pub stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

/// Every node process; kills those still running when dropped.
#[derive(Default)]
pub struct Procs(pub Vec<Proc>);

impl Procs {
    pub fn get(&mut self, id: NodeId) -> Option<&mut Proc> {
        self.0.iter_mut().find(|p| p.id == id)
    }
    pub fn signal(&mut self, id: NodeId, sig: libc::c_int) {
        if let Some(p) = self.get(id).filter(|p| !p.exited) {
            // SAFETY: kill(2) on a child we have not reaped yet (its pid is ours).
            unsafe {
                libc::kill(p.child.id() as libc::pid_t, sig);
            }
        }
    }
    /// Children that ended since the last call and whose every line was taken
    /// in: (id, exit code).
    pub fn reap(&mut self) -> Vec<(NodeId, Option<i32>)> {
        let mut out = Vec::new();
        for p in self.0.iter_mut().filter(|p| !p.exited && p.stdout_closed) {
            if let Ok(Some(st)) = p.child.try_wait() {
                p.exited = true;
                out.push((p.id, st.code()));
            }
        }
        out
    }
    pub fn running(&self) -> usize {
        self.0.iter().filter(|p| !p.exited).count()
    }
    /// Kills and reaps every child still running: (id, exit code).
    pub fn kill_all(&mut self) -> Vec<(NodeId, Option<i32>)> {
        let mut out = Vec::new();
        for p in self.0.iter_mut().filter(|p| !p.exited) {
            let _ = p.child.kill();
            let code = p.child.wait().ok().and_then(|s| s.code());
            p.exited = true;
            out.push((p.id, code));
        }
        out
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        let _ = self.kill_all();
    }
}

/// Kernel threads for each of `nodes` nodes sharing this machine: its
/// cores shared out (at least one), so that the nodes do not fight over
/// the cores with more threads than there are.
pub fn threads_per_node(nodes: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / nodes.max(1)).max(1)
}

/// A free loopback port (bound and released; a node binds it right after).
///
/// The kernel may hand a released port out again at once, so two nodes
/// launched together could be given the same one: this process remembers
/// every port it handed out and never gives one twice.
pub fn free_port() -> Res<u16> {
    static HANDED_OUT: std::sync::Mutex<BTreeSet<u16>> = std::sync::Mutex::new(BTreeSet::new());
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..64 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        if handed.insert(port) {
            return Ok(port);
        }
    }
    Err("64 free ports in a row had been handed out already".into())
}

pub fn read_stdout(
    out: impl Read,
    mut log: Option<std::fs::File>,
    tx: Sender<Msg>,
    id: NodeId,
    start: Instant,
) {
    let mut r = BufReader::new(out);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let t = start.elapsed().as_secs_f64();
                if let Some(f) = &mut log {
                    let _ = f.write_all(&buf);
                }
                let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                if tx.send(Msg::Line(id, t, line)).is_err() {
                    break;
                }
            }
        }
    }
    let _ = tx.send(Msg::Eof(id));
}

pub fn read_stderr(
    err: impl Read,
    mut log: Option<std::fs::File>,
    tail: Arc<Mutex<VecDeque<String>>>,
) {
    let mut r = BufReader::new(err);
    let mut buf = Vec::new();
    while matches!(r.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
        if let Some(f) = &mut log {
            let _ = f.write_all(&buf);
        }
        if let Ok(mut t) = tail.lock() {
            t.push_back(String::from_utf8_lossy(&buf).trim_end().to_string());
            if t.len() > 20 {
                t.pop_front();
            }
        }
        buf.clear();
    }
}

/// A small deterministic generator (splitmix64) for the choice of victims.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> Option<T> {
        (!v.is_empty()).then(|| v[self.below(v.len())])
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::free_port;
    use std::collections::BTreeSet;

    /// 500 draws from some 28 000 ephemeral ports would almost surely repeat
    /// one (the birthday bound) if released ports were handed out again.
    #[test]
    fn free_ports_are_never_handed_out_twice() {
        let mut seen = BTreeSet::new();
        for _ in 0..500 {
            let port = free_port().expect("a free port");
            assert!(seen.insert(port), "port {port} handed out twice");
        }
    }
}
