//! Swarms of `gwtf node` processes in Linux network namespaces, for tests:
//! one namespace per node, joined through a bridge in a hub namespace by
//! veth pairs shaped with tbf on both ends. A [`Lab`] owns every namespace,
//! process and route it made and removes them when dropped, whatever
//! happened (a failed assertion included).
//!
//! Names: every namespace is `gwtfns<pid><tag>...` (the test process's pid,
//! then a tag of the test), so that tests running at once never clash and
//! the namespaces of a test run that was itself killed are found and removed
//! by the next one ([`remove_stale`]).
//!
//! Needs root and `ip` / `tc` (iproute2); [`unavailable`] says why not.
#![allow(dead_code)]

use super::swarm_procs::Seen;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// Namespaces of these tests are named `PREFIX<pid>...`.
pub const PREFIX: &str = "gwtfns";
/// Every node listens on this port of its own address.
pub const PORT: u16 = 7000;
/// The nodes' subnets are `10.77.N.0/24`, one per test; a blackhole route
/// for one carries the test process's pid as its metric.
const ROUTE_OWNER: &str = "10.77.";

/// Runs a command to completion; Err with its output when it fails.
pub fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", args[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Why namespace tests cannot run here (`ip` or `tc` missing), if so.
/// Whether namespaces may be created at all is known only by trying
/// ([`Lab::start`]).
pub fn unavailable() -> Option<String> {
    for tool in ["ip", "tc"] {
        if Command::new(tool)
            .arg("-V")
            .output()
            .map(|o| !o.status.success())
            .unwrap_or(true)
        {
            return Some(format!("`{tool}` (iproute2) is not installed"));
        }
    }
    None
}

fn pid_gone(pid: &str) -> bool {
    !pid.is_empty() && !Path::new(&format!("/proc/{pid}")).exists()
}

/// Deletes the namespaces and blackhole routes left by an earlier run of
/// these tests that was itself killed (its pid is gone).
pub fn remove_stale() {
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            let Some(rest) = name.strip_prefix(PREFIX) else {
                continue;
            };
            let pid: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            if pid_gone(&pid) {
                let _ = sh(&["ip", "netns", "del", name]);
            }
        }
    }
    if let Ok(out) = Command::new("ip")
        .args(["route", "show", "type", "blackhole"])
        .output()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "blackhole 10.77.1.0/24 metric 4242"
            let f: Vec<&str> = line.split_whitespace().collect();
            if let ["blackhole", net, "metric", pid] = f[..] {
                if net.starts_with(ROUTE_OWNER) && pid_gone(pid) {
                    let _ = sh(&["ip", "route", "del", "blackhole", net, "metric", pid]);
                }
            }
        }
    }
}

/// The namespaces, processes and routes of one run; dropping it kills every
/// process still running, deletes every namespace and removes its routes.
pub struct Lab {
    /// `PREFIX<pid><tag>`: the start of every namespace name.
    base: String,
    /// The first three bytes of the nodes' /24 (`10.77.1`).
    subnet: String,
    namespaces: Vec<String>,
    children: Vec<(u32, Child)>,
    /// Arguments of `ip route del` for the routes added.
    routes: Vec<Vec<String>>,
    /// Each node's address, once the network is built.
    pub addrs: BTreeMap<u32, String>,
}

/// How [`Lab::start`] failed: the test skips (with the reason) or fails.
pub enum Unavailable {
    Skip(String),
    Fail(String),
}

impl Lab {
    /// An empty lab; nothing is created yet. `tag` tells this test's
    /// namespaces from another's in the same process (letters only, or
    /// empty); `subnet` is its nodes' /24 (`10.77.N`, one per test).
    pub fn new(tag: &str, subnet: &str) -> Lab {
        assert!(tag.chars().all(|c| c.is_ascii_alphabetic()), "tag {tag:?}");
        assert!(subnet.starts_with(ROUTE_OWNER), "subnet {subnet:?}");
        Lab {
            base: format!("{PREFIX}{}{tag}", std::process::id()),
            subnet: subnet.to_string(),
            namespaces: Vec::new(),
            children: Vec::new(),
            routes: Vec::new(),
            addrs: BTreeMap::new(),
        }
    }

    /// Removes what killed runs left, creates the hub namespace (which
    /// tells whether namespaces may be created here) and the nodes' links
    /// ([`Lab::build_network`]), every one shaped by `tbf`.
    pub fn start(tag: &str, subnet: &str, ids: &[u32], tbf: &[&str]) -> Result<Lab, Unavailable> {
        if let Some(why) = unavailable() {
            return Err(Unavailable::Skip(why));
        }
        remove_stale();
        let mut lab = Lab::new(tag, subnet);
        let hub = lab.hub();
        if let Err(e) = lab.add_ns(&hub) {
            return Err(Unavailable::Skip(format!(
                "cannot create a network namespace (root is needed): {e}"
            )));
        }
        match lab.build_network(ids, tbf) {
            Ok(()) => Ok(lab),
            Err(e) if e.contains("tbf") || e.contains("qdisc") => Err(Unavailable::Skip(format!(
                "cannot shape links with tbf here: {e}"
            ))),
            Err(e) => Err(Unavailable::Fail(format!("cannot build the network: {e}"))),
        }
    }

    pub fn hub(&self) -> String {
        format!("{}hub", self.base)
    }

    /// The namespace of node `id`.
    pub fn ns(&self, id: u32) -> String {
        format!("{}n{id}", self.base)
    }

    /// `10.77.N.0/24`.
    pub fn cidr(&self) -> String {
        format!("{}.0/24", self.subnet)
    }

    pub fn add_ns(&mut self, name: &str) -> Result<(), String> {
        sh(&["ip", "netns", "add", name])?;
        self.namespaces.push(name.to_string());
        sh(&["ip", "-n", name, "link", "set", "lo", "up"])
    }

    /// A bridge in the hub namespace (created first with [`Lab::add_ns`]),
    /// and one namespace per node linked to it by a veth pair (`e0` in the
    /// node's namespace, `p<id>` in the hub's) shaped by `tbf` on both ends.
    /// Fills [`Lab::addrs`].
    pub fn build_network(&mut self, ids: &[u32], tbf: &[&str]) -> Result<(), String> {
        let hub = self.hub();
        sh(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", &hub, "link", "set", "br0", "up"])?;
        for (k, &id) in ids.iter().enumerate() {
            let ns = self.ns(id);
            self.add_ns(&ns)?;
            let port = format!("p{id}");
            let ip = format!("{}.{}", self.subnet, k + 1);
            sh(&[
                "ip", "-n", &ns, "link", "add", "e0", "type", "veth", "peer", "name", &port,
                "netns", &hub,
            ])?;
            sh(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                "e0",
            ])?;
            sh(&["ip", "-n", &ns, "link", "set", "e0", "up"])?;
            sh(&["ip", "-n", &hub, "link", "set", &port, "master", "br0"])?;
            sh(&["ip", "-n", &hub, "link", "set", &port, "up"])?;
            self.shape_with(id, "add", tbf)?;
            self.addrs.insert(id, format!("{ip}:{PORT}"));
        }
        Ok(())
    }

    fn shape_with(&self, id: u32, how: &str, tbf: &[&str]) -> Result<(), String> {
        let (ns, hub, port) = (self.ns(id), self.hub(), format!("p{id}"));
        for (side, dev) in [(&ns, "e0"), (&hub, port.as_str())] {
            let mut tc = vec![
                "ip", "netns", "exec", side, "tc", "qdisc", how, "dev", dev, "root", "tbf",
            ];
            tc.extend_from_slice(tbf);
            sh(&tc)?;
        }
        Ok(())
    }

    /// Shapes node `id`'s link (both directions) by `tbf` instead.
    pub fn reshape(&self, id: u32, tbf: &[&str]) -> Result<(), String> {
        self.shape_with(id, "replace", tbf)
    }

    /// Cuts node `id` off: its end of the veth pair goes down.
    pub fn cut(&self, id: u32) -> Result<(), String> {
        sh(&["ip", "-n", &self.ns(id), "link", "set", "e0", "down"])
    }

    /// Undoes [`Lab::cut`]: the link is up and the node's namespace has a
    /// route to its subnet again (at most 2 s after).
    pub fn restore(&self, id: u32) -> Result<(), String> {
        let ns = self.ns(id);
        sh(&["ip", "-n", &ns, "link", "set", "e0", "up"])?;
        // An address of the subnet that is nobody's (not the node's own,
        // which its namespace always routes).
        let other = format!("{}.254", self.subnet);
        let until = Instant::now() + Duration::from_secs(2);
        loop {
            match sh(&["ip", "-n", &ns, "route", "get", &other]) {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > until => {
                    return Err(format!("no route back after link-up: {e}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// Until the lab is dropped, a blackhole route for the nodes' subnet in
    /// this (the root) namespace: no packet for a test address ever leaves
    /// through another route. Its metric is this process's pid, so that
    /// tests of several processes never take each other's route.
    pub fn hold_blackhole(&mut self) -> Result<(), String> {
        let (net, metric) = (self.cidr(), std::process::id().to_string());
        sh(&["ip", "route", "add", "blackhole", &net, "metric", &metric])?;
        self.routes.push(
            ["route", "del", "blackhole", &net, "metric", &metric]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        );
        Ok(())
    }

    /// Starts `gwtf node ARGS` in node `id`'s namespace (with `GWTF_LOG=1`,
    /// its stderr in `log_dir/node-<id>.stderr`); a thread sends each line
    /// it prints on `tx` as it is read (a line that is no JSON as
    /// `{"event":"unparsed","line":...}`).
    pub fn spawn(&mut self, id: u32, args: &[String], log_dir: &Path, tx: &Sender<Seen>) {
        let stderr = std::fs::File::create(log_dir.join(format!("node-{id}.stderr"))).unwrap();
        let mut c = Command::new("ip")
            .args(["netns", "exec", &self.ns(id)])
            .arg(super::gwtf_exe())
            .arg("node")
            .args(args)
            .env("GWTF_LOG", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start node {id}: {e}"));
        let out = c.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let v = serde_json::from_str(&line)
                    .unwrap_or_else(|_| serde_json::json!({"event": "unparsed", "line": line}));
                let seen = Seen {
                    at: Instant::now(),
                    node: id,
                    v,
                };
                if tx.send(seen).is_err() {
                    break;
                }
            }
        });
        self.children.push((id, c));
    }

    pub fn child(&mut self, id: u32) -> &mut Child {
        &mut self
            .children
            .iter_mut()
            .find(|(i, _)| *i == id)
            .expect("a started node")
            .1
    }

    /// SIGTERM to node `id` (a graceful leave); does not wait.
    pub fn terminate(&mut self, id: u32) {
        let pid = self.child(id).id() as libc::pid_t;
        // SAFETY: kill(2) on a child of ours that has not been reaped.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in self.namespaces.iter().rev() {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
        for r in &self.routes {
            let mut args = vec!["ip"];
            args.extend(r.iter().map(String::as_str));
            let _ = sh(&args);
        }
    }
}

/// Waits for `c` to exit, at most `within`.
pub fn wait_exit(c: &mut Child, within: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    loop {
        if let Ok(Some(s)) = c.try_wait() {
            return Some(s);
        }
        if t.elapsed() > within {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A swarm of llama-tiny nodes in a [`Lab`]: data holders (stage 0) and
/// relays, every one a founding member, each in its own namespace; their
/// event lines gathered in the order read.
pub struct NetSwarm {
    pub lab: Lab,
    /// (id, stage) of every node; stage 0: a data holder.
    pub layout: Vec<(u32, u16)>,
    /// Every node's stderr (its log) and the run's timeline on failure.
    pub dir: PathBuf,
    rx: Receiver<Seen>,
    tx: Option<Sender<Seen>>,
    pub events: Vec<Seen>,
    /// How processes ended badly ([`NetSwarm::finish`]).
    bad_exits: Vec<String>,
    /// No wait of [`NetSwarm::until`] goes past it.
    pub deadline: Instant,
}

impl NetSwarm {
    /// Starts every node of `layout` in `lab` with `common` arguments
    /// (model, stages, iterations, ...; see `llama_tiny_args`) and the
    /// founding members' list. `name` names the log directory.
    pub fn start(
        lab: Lab,
        name: &str,
        key: &str,
        layout: &[(u32, u16)],
        common: &[String],
        deadline: Duration,
    ) -> NetSwarm {
        let dir = super::scratch(&format!("{name}-{}", std::process::id()));
        let key_file = dir.join("key");
        std::fs::write(&key_file, key).unwrap();
        let (tx, rx) = channel();
        let mut swarm = NetSwarm {
            lab,
            layout: layout.to_vec(),
            dir,
            rx,
            tx: Some(tx),
            events: Vec::new(),
            bad_exits: Vec::new(),
            deadline: Instant::now() + deadline,
        };
        let mut peers = Vec::new();
        for &(id, stage) in layout {
            peers.push("--peer".to_string());
            peers.push(format!("{id}/{stage}/{}", swarm.lab.addrs[&id]));
        }
        for &(id, stage) in layout {
            let mut args: Vec<String> = vec![
                "--listen".into(),
                swarm.lab.addrs[&id].clone(),
                "--chosen-id".into(),
                id.to_string(),
                "--swarm-key-file".into(),
                key_file.display().to_string(),
                "--json".into(),
            ];
            args.extend(peers.iter().cloned());
            if stage == 0 {
                args.push("--holder".into());
            } else {
                args.extend(["--stage".into(), stage.to_string()]);
            }
            args.extend(common.iter().cloned());
            let tx = swarm.tx.clone().unwrap();
            swarm.lab.spawn(id, &args, &swarm.dir, &tx);
        }
        swarm
    }

    /// Fails (with the evidence) unless every holder exited by itself with
    /// success after `done` and every relay with success after SIGTERM.
    pub fn assert_exits(&self) {
        if !self.bad_exits.is_empty() {
            self.fail(&self.bad_exits.join("; "));
        }
    }

    pub fn holders(&self) -> Vec<u32> {
        (self.layout.iter())
            .filter(|n| n.1 == 0)
            .map(|n| n.0)
            .collect()
    }

    /// Takes the lines read so far, waiting at most until `until`; false
    /// once every node's output has ended.
    fn take(&mut self, until: Instant) -> bool {
        let left = until.saturating_duration_since(Instant::now());
        match self.rx.recv_timeout(left) {
            Ok(s) => {
                self.events.push(s);
                while let Ok(s) = self.rx.try_recv() {
                    self.events.push(s);
                }
                true
            }
            Err(RecvTimeoutError::Timeout) => true,
            Err(RecvTimeoutError::Disconnected) => false,
        }
    }

    /// Gathers lines for `d`.
    pub fn wait(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while Instant::now() < until {
            if !self.take(until) {
                std::thread::sleep(until.saturating_duration_since(Instant::now()));
            }
        }
    }

    /// Gathers lines until `pred` holds over them (checked after every
    /// batch read); fails at the deadline with the run's timeline and the
    /// nodes' logs.
    pub fn until(&mut self, what: &str, mut pred: impl FnMut(&[Seen]) -> bool) {
        loop {
            if pred(&self.events) {
                return;
            }
            let now = Instant::now();
            if now >= self.deadline {
                self.fail(&format!("timed out waiting for {what}"));
            }
            let until = self.deadline.min(now + Duration::from_millis(200));
            if !self.take(until) {
                self.fail(&format!("every node's output ended before {what}"));
            }
        }
    }

    /// Panics with `msg`, the path of the logs, the end of the timeline
    /// (all of it is written to `timeline.txt`) and the last log lines of
    /// every node.
    pub fn fail(&self, msg: &str) -> ! {
        panic!("{msg}\n{}", self.evidence());
    }

    /// The run's timeline (written in full to `timeline.txt` of the log
    /// directory; its last 60 lines here) and the end of every node's log.
    pub fn evidence(&self) -> String {
        let (tl, path) = self.save_timeline();
        let lines: Vec<&str> = tl.lines().collect();
        let mut s = format!(
            "logs in {}; timeline (last 60 of {} lines, all in {}):\n",
            self.dir.display(),
            lines.len(),
            path.display()
        );
        for l in &lines[lines.len().saturating_sub(60)..] {
            s += l;
            s.push('\n');
        }
        for &(id, _) in &self.layout {
            let err = self.stderr(id);
            let tail: Vec<&str> = err.lines().rev().take(15).collect();
            s += &format!("--- node {id} stderr (last {} lines):\n", tail.len());
            for l in tail.iter().rev() {
                s += l;
                s.push('\n');
            }
        }
        s
    }

    /// Writes the run's timeline so far to `timeline.txt` of the log
    /// directory; returns it and the file's path.
    pub fn save_timeline(&self) -> (String, PathBuf) {
        let tl = super::timeline::timeline(&self.events);
        let path = self.dir.join("timeline.txt");
        let _ = std::fs::write(&path, &tl);
        (tl, path)
    }

    pub fn stderr(&self, id: u32) -> String {
        std::fs::read_to_string(self.dir.join(format!("node-{id}.stderr"))).unwrap_or_default()
    }

    /// Ends the run: waits for every holder's `done`, then (at most 5 s)
    /// for every relay to print that it applied the last iteration, sends
    /// SIGTERM to the relays, and gathers every line until every process
    /// has ended (one that does not exit in time is killed). Returns the
    /// run's events; [`NetSwarm::assert_exits`] checks how they ended.
    pub fn finish(&mut self, exit_within: Duration) -> Vec<Seen> {
        let holders = self.holders();
        self.until("every holder's done", |ev| {
            holders
                .iter()
                .all(|h| ev.iter().any(|e| e.node == *h && e.event() == "done"))
        });
        let last = (self.events.iter())
            .filter(|e| e.event() == "iteration")
            .map(|e| e.u("iteration"))
            .max();
        let relays: Vec<u32> = (self.layout.iter())
            .filter(|n| n.1 != 0)
            .map(|n| n.0)
            .collect();
        let settle = Instant::now() + Duration::from_secs(5);
        while Instant::now() < settle {
            let settled = relays.iter().all(|id| {
                self.events.iter().any(|e| {
                    e.node == *id && e.event() == "applied" && Some(e.u("iteration")) == last
                })
            });
            if settled || !self.take(settle) {
                break;
            }
        }
        let mut bad = Vec::new();
        for h in &holders {
            match wait_exit(self.lab.child(*h), exit_within) {
                Some(s) if s.success() => {}
                Some(s) => bad.push(format!("holder {h} exited with {s}")),
                None => {
                    let _ = self.lab.child(*h).kill();
                    bad.push(format!("holder {h} printed done but did not exit"));
                }
            }
        }
        for id in &relays {
            self.lab.terminate(*id);
        }
        for id in &relays {
            match wait_exit(self.lab.child(*id), exit_within) {
                Some(s) if s.success() => {}
                Some(s) => bad.push(format!("relay {id} exited with {s} after SIGTERM")),
                None => {
                    let _ = self.lab.child(*id).kill();
                    bad.push(format!(
                        "relay {id} did not exit within {exit_within:?} of SIGTERM"
                    ));
                }
            }
        }
        self.bad_exits = bad;
        // Every process has ended: the readers see the end of their output.
        self.tx = None;
        let until = Instant::now() + exit_within;
        while Instant::now() < until {
            if !self.take(until) {
                self.save_timeline();
                return self.events.clone();
            }
        }
        self.fail("the nodes' output did not end");
    }
}
