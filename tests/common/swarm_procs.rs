//! A swarm of `gwtf node` processes on loopback for tests: starts them,
//! reads their JSON events on threads, kills them (SIGKILL or SIGTERM), and
//! checks the invariants of a run. Every child is killed when the swarm is
//! dropped, whatever happened.
#![allow(dead_code)]

use super::free_addr;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const KEY: &str = "0123456789abcdef-process-swarm-key";

/// The swarm most process tests start: 2 data holders (1, 2) and 3 relays
/// for each of the 2 relay stages (11-13, 21-23) of a model cut into 4.
pub fn two_holders_and_two_by_three_relays() -> Vec<(u32, u16)> {
    vec![
        (1, 0),
        (2, 0),
        (11, 1),
        (12, 1),
        (13, 1),
        (21, 2),
        (22, 2),
        (23, 2),
    ]
}

/// Arguments every node of such a swarm gets: llama-tiny in 4 stages,
/// `iterations`, `mb` microbatches per holder, `seed`, then `more`.
pub fn llama_tiny_args(iterations: u32, mb: u32, seed: u64, more: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--model",
        "llama-tiny",
        "--stages",
        "4",
        "--iterations",
        &iterations.to_string(),
        "--microbatches",
        &mb.to_string(),
        "--seed",
        &seed.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(more.iter().map(|s| s.to_string()));
    v
}

/// The single-process losses of a run of [`llama_tiny_args`] (both
/// holders, 1 and 2, train on the generated corpus of `gwtf node`'s
/// default), `mb` microbatches per holder and iteration.
pub fn llama_tiny_reference(iterations: u32, mb: u32, seed: u64) -> Vec<f32> {
    use gwtf::model::dataset::Dataset;
    use gwtf::swarm::model_trainer::{reference_losses, ModelRun};
    let cfg = gwtf::model::preset("llama-tiny").unwrap();
    let run = ModelRun::new(cfg, 4, seed, iterations as usize).unwrap();
    let docs = Dataset::synthetic(seed, run.opts.corpus_bytes, run.opts.seq).train;
    let holders: Vec<(gwtf::protocol::NodeId, &[Vec<u32>])> = vec![(1, &docs[..]), (2, &docs[..])];
    reference_losses(&run, &holders, mb, iterations, |_, _| {}).unwrap()
}

/// One event line of one node.
#[derive(Clone, Debug)]
pub struct Seen {
    pub at: Instant,
    pub node: u32,
    pub v: Value,
}

impl Seen {
    pub fn event(&self) -> &str {
        self.v["event"].as_str().unwrap_or("")
    }
    pub fn u(&self, k: &str) -> u64 {
        self.v[k].as_u64().unwrap_or(u64::MAX)
    }
    pub fn s(&self, k: &str) -> &str {
        self.v[k].as_str().unwrap_or("")
    }
}

pub struct Node {
    pub id: u32,
    pub stage: u16,
    pub addr: SocketAddr,
    child: Option<Child>,
}

/// One process swarm at a time per test binary: eight processes per swarm
/// on two cores are enough load.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

pub struct Swarm {
    _turn: std::sync::MutexGuard<'static, ()>,
    pub dir: tempfile::TempDir,
    pub nodes: Vec<Node>,
    pub events: Arc<Mutex<Vec<Seen>>>,
    founders: String,
    common: Vec<String>,
    pub deadline: Instant,
    /// The `gwtf` executable the nodes run.
    bin: PathBuf,
}

impl Swarm {
    /// Founding members `layout` (id, stage; stage 0 = holder), started with
    /// `common` arguments (model, stages, iterations, ...).
    pub fn start(layout: &[(u32, u16)], common: &[&str], extra: &[(u32, &[&str])]) -> Swarm {
        Self::start_with(super::gwtf_exe(), layout, common, extra)
    }

    /// [`Swarm::start`] with the `gwtf` executable `bin` (e.g. a release
    /// build, [`super::release_gwtf`]).
    pub fn start_with(
        bin: PathBuf,
        layout: &[(u32, u16)],
        common: &[&str],
        extra: &[(u32, &[&str])],
    ) -> Swarm {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("key"), KEY).unwrap();
        let peers: Vec<(u32, u16, SocketAddr)> =
            layout.iter().map(|&(id, s)| (id, s, free_addr())).collect();
        let founders = peers
            .iter()
            .map(|(id, s, a)| format!("{id}/{s}/{a}"))
            .collect::<Vec<_>>()
            .join(" ");
        let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let mut swarm = Swarm {
            _turn: turn,
            dir,
            nodes: Vec::new(),
            events: Arc::new(Mutex::new(Vec::new())),
            founders,
            common: common.iter().map(|s| s.to_string()).collect(),
            deadline: Instant::now() + Duration::from_secs(150),
            bin,
        };
        for (id, stage, addr) in peers {
            let mut args: Vec<String> = Vec::new();
            for f in swarm.founders.split(' ') {
                args.push("--peer".into());
                args.push(f.into());
            }
            if stage == 0 {
                args.push("--holder".into());
            } else {
                args.push("--stage".into());
                args.push(stage.to_string());
            }
            if let Some((_, e)) = extra.iter().find(|(i, _)| *i == id) {
                args.extend(e.iter().map(|s| s.to_string()));
            }
            swarm.spawn(id, stage, addr, args);
        }
        swarm
    }

    fn spawn(&mut self, id: u32, stage: u16, addr: SocketAddr, args: Vec<String>) {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("node")
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--swarm-key-file")
            .arg(self.dir.path().join("key"))
            .arg("--chosen-id")
            .arg(id.to_string())
            .arg("--json")
            .arg("--trace-work")
            .args(&self.common)
            .args(&args)
            // Its log: the last lines of each node's come with a failure.
            .env("GWTF_LOG", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(
                std::fs::File::create(self.dir.path().join(format!("node-{id}.err"))).unwrap(),
            ));
        let mut child = cmd.spawn().expect("gwtf node starts");
        let out = child.stdout.take().unwrap();
        let events = self.events.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if std::env::var_os("GWTF_TEST_TRACE").is_some() {
                    eprintln!("{line}");
                }
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    events.lock().unwrap().push(Seen {
                        at: Instant::now(),
                        node: id,
                        v,
                    });
                }
            }
        });
        self.nodes.push(Node {
            id,
            stage,
            addr,
            child: Some(child),
        });
    }

    /// Starts a node that joins through `via`'s address.
    pub fn join(&mut self, id: u32, via: u32, extra: &[&str]) {
        let addr = self.nodes.iter().find(|n| n.id == via).unwrap().addr;
        let mut args = vec!["--join".to_string(), addr.to_string()];
        args.extend(extra.iter().map(|s| s.to_string()));
        self.spawn(id, 0, free_addr(), args);
    }

    /// SIGKILL: a crash.
    pub fn kill(&mut self, id: u32) -> Instant {
        let n = self.nodes.iter_mut().find(|n| n.id == id).unwrap();
        let mut c = n.child.take().expect("alive");
        let t = Instant::now();
        c.kill().unwrap();
        c.wait().unwrap();
        t
    }

    /// SIGTERM: a graceful leave; waits for the process to end.
    pub fn terminate(&mut self, id: u32) {
        let n = self.nodes.iter_mut().find(|n| n.id == id).unwrap();
        let mut c = n.child.take().expect("alive");
        // SAFETY: plain kill(2) on our own child.
        unsafe {
            libc::kill(c.id() as i32, libc::SIGTERM);
        }
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if c.try_wait().unwrap().is_some() {
                let _ = c.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        panic!("node {id} did not leave within 30 s of SIGTERM");
    }

    /// SIGSTOP, then SIGCONT after `pause`: a process that stops running
    /// (a laptop lid closed, a debugger, a starved VM) with its sockets
    /// open. Returns when it runs again.
    pub fn pause(&mut self, id: u32, pause: Duration) {
        let n = self.nodes.iter().find(|n| n.id == id).unwrap();
        let pid = n.child.as_ref().expect("alive").id() as i32;
        // SAFETY: plain kill(2) on our own child.
        unsafe {
            libc::kill(pid, libc::SIGSTOP);
        }
        std::thread::sleep(pause);
        // SAFETY: as above.
        unsafe {
            libc::kill(pid, libc::SIGCONT);
        }
    }

    /// SIGSTOP (`stop`) or SIGCONT: a pause whose end the test chooses.
    pub fn signal_pause(&mut self, id: u32, stop: bool) {
        let n = self.nodes.iter().find(|n| n.id == id).unwrap();
        let pid = n.child.as_ref().expect("alive").id() as i32;
        let sig = if stop { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: plain kill(2) on our own child.
        unsafe {
            libc::kill(pid, sig);
        }
    }

    /// Waits (until the deadline) for node `id` to exit; its exit status.
    pub fn wait_exit(&mut self, id: u32) -> std::process::ExitStatus {
        let n = self.nodes.iter_mut().find(|n| n.id == id).unwrap();
        let c = n.child.as_mut().expect("alive");
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                n.child = None;
                return st;
            }
            if Instant::now() > self.deadline {
                let ev = self.snapshot();
                panic!("node {id} did not exit\n{}", self.tail(&ev));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What node `id` wrote on stderr so far (its log with `GWTF_LOG=1`).
    pub fn stderr(&self, id: u32) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("node-{id}.err"))).unwrap_or_default()
    }

    pub fn snapshot(&self) -> Vec<Seen> {
        self.events.lock().unwrap().clone()
    }

    /// Waits until `pred` holds over the events so far; fails at the
    /// deadline with the last events of every node.
    pub fn until(&self, what: &str, mut pred: impl FnMut(&[Seen]) -> bool) -> Vec<Seen> {
        loop {
            let ev = self.snapshot();
            if pred(&ev) {
                return ev;
            }
            if Instant::now() > self.deadline {
                panic!("timed out waiting for {what}\n{}", self.tail(&ev));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until every stage (0..=`stages`) printed its `committed` line
    /// for each of the first `iterations`: a live run's events come from
    /// each node's own stream, so a holder's final `iteration` line may be
    /// read before a coordinator's `committed` line of that iteration
    /// ([`check_run`] over a snapshot taken at once then finds it missing).
    pub fn until_committed(&self, iterations: u32, stages: u16) -> Vec<Seen> {
        self.until("every stage's committed line of those iterations", |ev| {
            let seen: std::collections::HashSet<(u64, u64)> = (ev.iter())
                .filter(|e| e.event() == "committed")
                .map(|e| (e.u("stage"), e.u("iteration")))
                .collect();
            (0..iterations as u64).all(|k| (0..=stages as u64).all(|s| seen.contains(&(s, k))))
        })
    }

    /// Where each node stood, the last events, the nodes' logs and the
    /// whole timeline: the body of a swarm test's failure message.
    pub fn tail(&self, ev: &[Seen]) -> String {
        // What a reader needs first comes first (a CI log shows the head
        // of a long failure): where each node stood, then the run's last
        // moments, then the nodes' logs, then the whole run.
        let mut s = String::from("where each node stood:\n");
        for n in &self.nodes {
            let mine: Vec<&Seen> = ev.iter().filter(|e| e.node == n.id).collect();
            let applied = (mine.iter().rev())
                .find(|e| e.event() == "applied")
                .map(|e| e.u("iteration"));
            let fenced = mine.iter().filter(|e| e.event() == "fenced").count();
            let last: Vec<String> = (mine.iter().rev())
                .filter(|e| !matches!(e.event(), "work" | "stats" | "mb_done"))
                .take(3)
                .map(|e| e.v.to_string())
                .collect();
            s += &format!(
                "  node {}: last applied {applied:?}, fenced {fenced} times, last: {last:?}\n",
                n.id
            );
        }
        let whole = super::timeline::timeline(ev);
        let lines: Vec<&str> = whole.lines().collect();
        s += "the run's last 40 lines:\n";
        for l in &lines[lines.len().saturating_sub(40)..] {
            s += l;
            s += "\n";
        }
        for n in &self.nodes {
            let err = std::fs::read_to_string(self.dir.path().join(format!("node-{}.err", n.id)))
                .unwrap_or_default();
            // Without the per-microbatch loss lines, which say nothing of
            // where it stands.
            let err: Vec<&str> = (err.lines().rev())
                .filter(|l| !l.contains(": loss of MbId"))
                .take(15)
                .collect();
            s += &format!("node {} stderr (newest first): {err:?}\n", n.id);
        }
        // The whole run in time order: where it stood still and why.
        s += "timeline:\n";
        s += &whole;
        s
    }

    /// Waits for a work of `kind` to start at `node` (it is then in the
    /// middle of it when slowed with --slow-work).
    pub fn until_work(&self, node: u32, kind: &str, after: usize) -> Instant {
        let ev = self.until(&format!("node {node} starting {kind}"), |ev| {
            ev.iter().skip(after).any(|e| {
                e.node == node
                    && e.event() == "work"
                    && e.v["kind"] == kind
                    && e.v["phase"] == "start"
            })
        });
        ev.iter()
            .skip(after)
            .find(|e| e.node == node && e.event() == "work" && e.v["kind"] == kind)
            .unwrap()
            .at
    }

    /// Waits until every holder of `holders` printed `done`, then (at most
    /// 5 s more) until every other node the harness did not stop printed
    /// that it applied the last iteration: each process prints on its own,
    /// so a relay's last lines may come after the holders' `done`.
    pub fn until_done(&self, holders: &[u32]) -> Vec<Seen> {
        let ev = self.until("the holders' done", |ev| {
            holders
                .iter()
                .all(|h| ev.iter().any(|e| e.node == *h && e.event() == "done"))
        });
        let last = ev
            .iter()
            .filter(|e| e.event() == "iteration")
            .map(|e| e.u("iteration"))
            .max();
        let others: Vec<u32> = self
            .nodes
            .iter()
            .filter(|n| n.child.is_some() && !holders.contains(&n.id))
            .map(|n| n.id)
            .collect();
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let ev = self.snapshot();
            let settled = others.iter().all(|id| {
                ev.iter().any(|e| {
                    e.node == *id && e.event() == "applied" && Some(e.u("iteration")) == last
                })
            });
            if settled || Instant::now() > until {
                return ev;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn count(&self) -> usize {
        self.events.lock().unwrap().len()
    }
}

impl Drop for Swarm {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        self.keep_logs();
    }
}

impl Swarm {
    /// With `GWTF_TEST_KEEP=DIR`, the run's logs stay for a reader: every
    /// node's stderr (`GWTF_LOG=1` makes it a log) and `events.log`, every
    /// event line with its time, `work` included; into a fresh folder of
    /// DIR named after the process and the time.
    fn keep_logs(&self) {
        let Some(root) = std::env::var_os("GWTF_TEST_KEEP") else {
            return;
        };
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let to = std::path::Path::new(&root).join(format!("{}-{stamp}", std::process::id()));
        if std::fs::create_dir_all(&to).is_err() {
            return;
        }
        for n in &self.nodes {
            let name = format!("node-{}.err", n.id);
            let _ = std::fs::copy(self.dir.path().join(&name), to.join(&name));
        }
        let mut ev = self.snapshot();
        ev.sort_by_key(|e| e.at);
        // Wall-clock seconds, to be read beside the nodes' logs.
        let (now, wall) = (Instant::now(), stamp as f64 / 1000.0);
        let lines: String = ev
            .iter()
            .map(|e| {
                let t = wall - now.duration_since(e.at).as_secs_f64();
                format!("{t:.3} node {:>2} {}\n", e.node, e.v)
            })
            .collect();
        let _ = std::fs::write(to.join("events.log"), lines);
        eprintln!("swarm logs kept in {}", to.display());
    }
}

/// The invariants of a finished run over `iterations` with `mb` microbatches
/// per holder: no node reported an error; in every committed
/// stage-iteration each microbatch appears once and none was given up
/// (`lost` 0), and every microbatch of every holder that finished the
/// iteration is in it; the replicas of a stage that applied an iteration
/// printed the same weights digest. Returns the mean loss per iteration.
pub fn check_run(ev: &[Seen], iterations: u32, mb: u32, stages: u16) -> Vec<f64> {
    let errors: Vec<String> = ev
        .iter()
        .filter(|e| e.event() == "error")
        .map(|e| e.v.to_string())
        .collect();
    assert!(errors.is_empty(), "errors: {errors:?}");
    let mut losses: BTreeMap<u64, Vec<(u32, f64)>> = BTreeMap::new();
    for e in ev.iter().filter(|e| e.event() == "iteration") {
        losses
            .entry(e.u("iteration"))
            .or_default()
            .push((e.node, e.v["loss"].as_f64().unwrap()));
    }
    let mut committed: BTreeMap<(u64, u64), BTreeSet<(u64, u64)>> = BTreeMap::new();
    for e in ev.iter().filter(|e| e.event() == "committed") {
        assert_eq!(e.u("dropped"), 0, "a microbatch was given up: {}", e.v);
        let key = (e.u("stage"), e.u("iteration"));
        let mbs = e.v["mbs"].as_array().unwrap();
        let set: BTreeSet<(u64, u64)> = mbs
            .iter()
            .map(|m| (m[0].as_u64().unwrap(), m[1].as_u64().unwrap()))
            .collect();
        assert_eq!(set.len(), mbs.len(), "counted twice: {}", e.v);
        // A coordinator change can commit the same iteration again: the
        // same set, never another one.
        if let Some(old) = committed.insert(key, set.clone()) {
            assert_eq!(old, set, "stage-iteration {key:?} committed two ways");
        }
    }
    let applied: BTreeSet<(u64, u64)> = ev
        .iter()
        .filter(|e| e.event() == "applied")
        .map(|e| (e.u("stage"), e.u("iteration")))
        .collect();
    for k in 0..iterations as u64 {
        let holders = losses.get(&k).cloned().unwrap_or_default();
        assert!(!holders.is_empty(), "iteration {k} never final");
        for s in 0..=stages as u64 {
            let Some(set) = committed.get(&(s, k)) else {
                // A coordinator killed between sending `Applied` and printing
                // its `committed` line: its stage applied the update (the
                // digests below are still compared), the set is not known.
                assert!(
                    applied.contains(&(s, k)),
                    "stage {s} never committed iteration {k}"
                );
                eprintln!("note: stage {s} iteration {k} applied; its committed line was not printed (coordinator killed)");
                continue;
            };
            for (h, _) in &holders {
                for i in 0..mb as u64 {
                    assert!(
                        set.contains(&(*h as u64, i)),
                        "stage {s} iteration {k}: holder {h}'s microbatch {i} missing"
                    );
                }
            }
        }
    }
    let mut digests: BTreeMap<(u64, u64), BTreeSet<String>> = BTreeMap::new();
    for e in ev.iter().filter(|e| e.event() == "applied") {
        // The update averages exactly the committed microbatches.
        let key = (e.u("stage"), e.u("iteration"));
        if let Some(set) = committed.get(&key) {
            assert_eq!(
                e.u("microbatches"),
                set.len() as u64,
                "node {} applied a mean of another set than committed: {}",
                e.node,
                e.v
            );
        }
        digests
            .entry((e.u("stage"), e.u("iteration")))
            .or_default()
            .insert(e.v["weights_sha256"].as_str().unwrap().to_string());
    }
    for (k, d) in &digests {
        assert_eq!(
            d.len(),
            1,
            "replicas of stage-iteration {k:?} disagree: {d:?}"
        );
    }
    (0..iterations as u64)
        .map(|k| {
            let l = &losses[&k];
            l.iter().map(|x| x.1).sum::<f64>() / l.len() as f64
        })
        .collect()
}
