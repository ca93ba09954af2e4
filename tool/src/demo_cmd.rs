//! `gwtf demo`: a local swarm of `gwtf node` processes on loopback, with
//! crashes (SIGKILL) and joins while it trains, and what came of it.
//!
//! The orchestrator starts the data holders and the relays (spread evenly over
//! the relay stages) as separate processes of this same executable, reads each
//! one's `--json` event lines on a thread of its own, and keeps the run's
//! facts (`demo_events`). Every `--crash-every` seconds it kills a relay,
//! timed to hit a phase in turn: right after a holder's iteration opened
//! (forward), in the middle of an iteration (backward), right after its stage
//! committed (the aggregation), while a joiner of its stage downloads the
//! stage's state, or at random; the victim carries microbatches in flight
//! where the aim allows (`demo_chaos`); never the last member of a stage
//! unless `--allow-empty-stage`. Every `--pause-every` seconds it stops a
//! relay (SIGSTOP) for `--pause-for` seconds; every `--cut-every` seconds it
//! cuts a relay's link (emulated by the node) for `--cut-for` seconds. Every `--join-every` seconds it
//! starts a node with `--join`. It stops when the holders print `done` (or at the
//! deadline), then trains the single-process reference, prints the facts,
//! writes `--json` and `--report`, and fails when a microbatch was lost or
//! counted twice, replicas disagreed or the run did not finish.
//!
//! No child outlives the demo: each runs in its own process group (a Ctrl-C
//! reaches the demo only, which stops them), is killed by the kernel if the
//! demo dies (`PR_SET_PDEATHSIG`), and is killed by a drop guard on every way
//! out of [`run`], panics included.
use super::checks;
use super::demo_chaos::{chaos_on_event, chaos_tick, Chaos};
use super::demo_procs::{
    catch_interrupts, free_port, read_stderr, read_stdout, Msg, Proc, Procs, Rng, INTERRUPTED,
};
use super::demo_report;
use clap::{Args, ValueEnum};
use crossbeam_channel::{Receiver, Sender};
use gwtf::swarm::audit::{parse_line, Entry, Facts, NodeId, Plan, Summary, What};
use gwtf::wire::NodeKey;
use std::collections::VecDeque;
use std::io::{IsTerminal, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Link emulation between the nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Links {
    /// Plain loopback.
    None,
    /// Each node in one of geo10's ten regions (in turn): its frames leave
    /// after the mean one-way latency from its region to the others, divided
    /// by 10 so the demo stays short, at the mean bandwidth of its region's
    /// links.
    Geo10,
}

#[derive(Args)]
pub struct DemoArgs {
    /// Relays at the start, spread evenly over the relay stages.
    #[arg(long, default_value_t = 6, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    pub nodes: u32,
    /// Data holders (they run the embedding and the loss: the first and last stage).
    #[arg(long, default_value_t = 2, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    pub holders: u32,
    /// Pipeline stages of the model's cut (holders run the first and last, relays
    /// stages 1..S-2).
    #[arg(long, default_value_t = 4, value_parser = checks::int_at_least::<u32>(3),
          allow_negative_numbers = true)]
    pub stages: u32,
    /// Model preset: gpt-tiny, llama-tiny or llama-small.
    #[arg(long, default_value = "llama-tiny")]
    pub model: String,
    /// Routing policy every node runs: gwtf, swarm, swarm-plus or
    /// swarm-deccom (`gwtf node --policy`).
    #[arg(long, default_value = "gwtf", value_parser = super::node_cmd::parse_policy)]
    pub policy: gwtf::protocol::Policy,
    /// Iterations (aggregations) to train.
    #[arg(long, default_value_t = 30, value_parser = checks::int_at_least::<u64>(1),
          allow_negative_numbers = true)]
    pub iterations: u64,
    /// Microbatches per holder per iteration.
    #[arg(long, default_value_t = 4, value_parser = checks::int_at_least::<u64>(1),
          allow_negative_numbers = true)]
    pub microbatches: u64,
    /// Kill (SIGKILL) a relay every SEC seconds (0: never).
    #[arg(long, default_value_t = 1.0, value_name = "SEC",
          value_parser = checks::float_in(0.0, 86400.0), allow_negative_numbers = true)]
    pub crash_every: f64,
    /// Start a joining relay every SEC seconds (0: never).
    #[arg(long, default_value_t = 2.5, value_name = "SEC",
          value_parser = checks::float_in(0.0, 86400.0), allow_negative_numbers = true)]
    pub join_every: f64,
    /// Pause (SIGSTOP) a relay every SEC seconds, and continue it (SIGCONT)
    /// --pause-for seconds later (0: never). Victims are chosen as for
    /// crashes: among the nodes carrying microbatches in flight, never the
    /// last available member of a stage.
    #[arg(long, default_value_t = 0.0, value_name = "SEC",
          value_parser = checks::float_in(0.0, 86400.0), allow_negative_numbers = true)]
    pub pause_every: f64,
    /// How long a paused relay stays stopped (seconds; longer than the
    /// nodes' 5 s peer timeout and its peers give it up as lost).
    #[arg(long, default_value_t = 3.0, value_name = "SEC",
          value_parser = pause_length, allow_negative_numbers = true)]
    pub pause_for: f64,
    /// Cut a relay's link every SEC seconds, and restore it --cut-for
    /// seconds later (0: never): the node runs on but reads and writes none
    /// of its sockets meanwhile (emulated in user space: `gwtf node` on
    /// SIGUSR1 and SIGUSR2). Victims are chosen as for pauses.
    #[arg(long, default_value_t = 0.0, value_name = "SEC",
          value_parser = checks::float_in(0.0, 86400.0), allow_negative_numbers = true)]
    pub cut_every: f64,
    /// How long a cut link stays down (seconds).
    #[arg(long, default_value_t = 3.0, value_name = "SEC",
          value_parser = pause_length, allow_negative_numbers = true)]
    pub cut_for: f64,
    /// Let a crash take the last live member of a stage.
    #[arg(long)]
    pub allow_empty_stage: bool,
    /// Empty a relay stage on purpose once iteration ITER is final: every
    /// live member of the stage with the fewest members is SIGKILLed at
    /// once. The next joiner restores the stage from the freshest copy of
    /// its state the holders keep (--keep-states-every), or with none
    /// rebuilds it from the average of its neighbouring stages' weights
    /// (CheckFree), and the report marks where on the loss curve.
    #[arg(long, value_name = "ITER")]
    pub empty_stage_at: Option<u64>,
    /// The holders keep a copy of every relay stage's state after every K
    /// of their updates (0: none, so an emptied stage is rebuilt from its
    /// neighbours' weights, or restarts from the initial weights).
    #[arg(long, value_name = "K", default_value_t = 5, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(0))]
    pub keep_states_every: u32,
    /// Encrypt the payloads on every node's links (AES-256-GCM; every
    /// frame is authenticated either way).
    #[arg(long)]
    pub encrypt: bool,
    /// Seed of the model, the data order, and the choice of victims.
    #[arg(long, default_value_t = 1, value_parser = checks::int_at_least::<u64>(0),
          allow_negative_numbers = true)]
    pub seed: u64,
    /// Link emulation (geo10 also makes an iteration of llama-tiny last long
    /// enough, about 0.3 s, for crashes to land mid-run).
    #[arg(long, value_enum, default_value_t = Links::Geo10)]
    pub links: Links,
    /// UTF-8 text files the holders train on [default: the generated corpus].
    #[arg(long, num_args = 1.., value_name = "FILE")]
    pub data: Vec<PathBuf>,
    /// Write the run's facts as one JSON object.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write a self-contained HTML page with plots of the run.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Keep each node's stdout and stderr (node-ID.stdout, node-ID.stderr),
    /// the demo's own actions (demo.log), and every node's event lines in
    /// the order the demo read them, each with its time in seconds and the
    /// node (events.log: `12.525 node 8 {...}`), in this directory.
    #[arg(long, value_name = "DIR")]
    pub keep_logs: Option<PathBuf>,
    /// Give up after this many seconds (every node is killed, the run fails).
    #[arg(long, default_value_t = 600.0, value_name = "SEC",
          value_parser = checks::positive_float, allow_negative_numbers = true)]
    pub deadline: f64,
    /// Skip the single-process reference run.
    #[arg(long)]
    pub no_reference: bool,
}

/// A pause length: more than 0, at most an hour.
fn pause_length(s: &str) -> Result<f64, String> {
    let v = checks::positive_float(s)?;
    if v > 3600.0 {
        return Err(format!("must be <= 3600, got {s}"));
    }
    Ok(v)
}

/// Checks every argument and output path; nothing is started before this.
fn check(a: &DemoArgs) -> Res<()> {
    let mut cfg = gwtf::model::preset(&a.model).map_err(|e| format!("--model {}: {e}", a.model))?;
    if !super::train_cmd::TRAINABLE.contains(&a.model.as_str()) {
        return Err(format!(
            "--model {}: only gpt-tiny, llama-tiny and llama-small are trained here",
            a.model
        )
        .into());
    }
    cfg.n_stages = a.stages as usize;
    cfg.validate()
        .map_err(|e| format!("--stages {} does not cut {}: {e}", a.stages, a.model))?;
    let relay_stages = a.stages - 2;
    if a.nodes < relay_stages {
        return Err(format!(
            "--nodes {} is fewer than the {relay_stages} relay stages of --stages {}: every \
             relay stage needs a relay",
            a.nodes, a.stages
        )
        .into());
    }
    if !a.data.is_empty() {
        use gwtf::model::dataset::{DataSource, Dataset};
        Dataset::load(&DataSource::Files(a.data.clone()), cfg.seq)
            .map_err(|e| format!("--data: {e}"))?;
    }
    if let Some(p) = &a.json {
        checks::writable_output("--json", p)?;
    }
    if let Some(p) = &a.report {
        checks::writable_output("--report", p)?;
    }
    if let Some(k) = a.empty_stage_at {
        if k + 1 >= a.iterations {
            return Err(format!(
                "--empty-stage-at {k}: the run has {} iterations (0 to {}); empty a stage \
                 before its last",
                a.iterations,
                a.iterations - 1
            )
            .into());
        }
        if a.join_every <= 0.0 {
            return Err(
                "--empty-stage-at needs joiners (--join-every > 0): nobody would take the \
                 emptied stage up"
                    .into(),
            );
        }
    }
    if let (Some(j), Some(r)) = (&a.json, &a.report) {
        if j == r {
            return Err(format!("--json and --report are the same file {}", j.display()).into());
        }
    }
    if let Some(d) = &a.keep_logs {
        if d.exists() && !d.is_dir() {
            return Err(format!("--keep-logs {}: not a directory", d.display()).into());
        }
        std::fs::create_dir_all(d)
            .map_err(|e| format!("--keep-logs {}: cannot create it: {e}", d.display()))?;
        checks::writable_output("--keep-logs", &d.join("demo.log"))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Processes

/// What a node is started with.
struct Launch {
    id: NodeId,
    /// Its node key file (its id follows from the key).
    key: PathBuf,
    port: u16,
    holder: bool,
    /// Founding members' list (ID/STAGE/ADDR), or the addresses to join through.
    peers: Vec<String>,
    join: Vec<String>,
    stage: Option<u32>,
    link: Option<(u64, u64)>,
}

/// Everything the run's loop needs.
pub struct Swarm<'a> {
    pub a: &'a DemoArgs,
    pub exe: PathBuf,
    pub key_file: PathBuf,
    pub start: Instant,
    pub tx: Sender<Msg>,
    pub procs: Procs,
    pub facts: Facts,
    pub log: Option<std::fs::File>,
    /// events.log: every node's event lines, in the order they were read.
    pub events: Option<std::io::BufWriter<std::fs::File>>,
    /// The time of the last line kept in events.log.
    pub events_t: f64,
    pub rng: Rng,
    /// The number in the next node key file's name.
    pub next_key: usize,
    /// Every node id given out in this run.
    pub ids: std::collections::BTreeSet<NodeId>,
    pub next_region: usize,
    pub out: Out,
    /// A stage was emptied on purpose (`--empty-stage-at`).
    pub emptied: bool,
}

impl Swarm<'_> {
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Keeps node `id`'s line read at `t` in events.log (with --keep-logs).
    /// Each node's reader thread stamps its lines; two threads can hand
    /// theirs over in the other order, so a line's time is at least the
    /// last one's (the file stays in time order, off by the hand-over).
    fn keep_line(&mut self, id: NodeId, t: f64, line: &str) {
        if let Some(f) = &mut self.events {
            let t = t.max(self.events_t);
            self.events_t = t;
            let _ = writeln!(f, "{t:.3} node {id} {line}");
        }
    }

    fn record(&mut self, what: What) {
        let e = Entry {
            t: self.now(),
            what,
        };
        if let Some(f) = &mut self.log {
            let _ = writeln!(f, "{:.3} {:?}", e.t, e.what);
        }
        self.facts.push(&e);
    }

    fn node_args(&mut self, l: &Launch) -> Vec<String> {
        let a = self.a;
        let mut v: Vec<String> = vec![
            "node".into(),
            "--listen".into(),
            format!("127.0.0.1:{}", l.port),
            "--swarm-key-file".into(),
            self.key_file.display().to_string(),
            "--node-key".into(),
            l.key.display().to_string(),
            "--model".into(),
            a.model.clone(),
            "--policy".into(),
            a.policy.name().into(),
            "--stages".into(),
            a.stages.to_string(),
            "--iterations".into(),
            a.iterations.to_string(),
            "--microbatches".into(),
            a.microbatches.to_string(),
            "--seed".into(),
            a.seed.to_string(),
            "--threads".into(),
            super::demo_procs::threads_per_node((a.holders + a.nodes) as usize).to_string(),
            "--json".into(),
        ];
        for p in &l.peers {
            v.extend(["--peer".into(), p.clone()]);
        }
        for j in &l.join {
            v.extend(["--join".into(), j.clone()]);
        }
        if l.holder {
            v.push("--holder".into());
            if a.keep_states_every > 0 {
                v.extend([
                    "--keep-states-every".into(),
                    a.keep_states_every.to_string(),
                ]);
            }
            for d in &a.data {
                v.extend(["--data".into(), d.display().to_string()]);
            }
        } else if let Some(s) = l.stage {
            v.extend(["--stage".into(), s.to_string()]);
        }
        if a.encrypt {
            v.push("--encrypt".into());
        }
        if let Some((delay, mbps)) = l.link {
            v.extend([
                "--link-delay-ms".into(),
                delay.to_string(),
                "--link-mbps".into(),
                mbps.to_string(),
            ]);
        }
        v
    }

    fn launch(&mut self, l: Launch, joiner: bool) -> Res<()> {
        let args = self.node_args(&l);
        let mut cmd = Command::new(&self.exe);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        super::demo_procs::die_with_parent(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {} node: {e}", self.exe.display()))?;
        let (stdout_log, stderr_log) = match &self.a.keep_logs {
            Some(d) => (
                Some(std::fs::File::create(
                    d.join(format!("node-{}.stdout", l.id)),
                )?),
                Some(std::fs::File::create(
                    d.join(format!("node-{}.stderr", l.id)),
                )?),
            ),
            None => (None, None),
        };
        let now = self.now();
        if let Some(f) = &mut self.log {
            // One line per node with its pid: the tests check none outlives the demo.
            let _ = writeln!(
                f,
                "{now:.3} pid {} node {}: {}",
                child.id(),
                l.id,
                args.join(" ")
            );
        }
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let (tx, id, start) = (self.tx.clone(), l.id, self.start);
        std::thread::spawn(move || read_stdout(stdout, stdout_log, tx, id, start));
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let t2 = tail.clone();
        std::thread::spawn(move || read_stderr(stderr, stderr_log, t2));
        self.procs.0.push(Proc {
            id: l.id,
            child,
            exited: false,
            stdout_closed: false,
            stderr_tail: tail,
        });
        self.record(What::Launched {
            node: l.id,
            holder: l.holder,
            joiner,
            stage: if l.holder { Some(0) } else { l.stage },
        });
        Ok(())
    }

    /// The link emulation of the next node.
    fn next_link(&mut self) -> Option<(u64, u64)> {
        match self.a.links {
            Links::None => None,
            Links::Geo10 => {
                let r = self.next_region;
                self.next_region += 1;
                Some(geo10_link(r))
            }
        }
    }

    /// Holders, then relays spread evenly over the relay stages; every founding
    /// member gets the full list.
    fn launch_founders(&mut self) -> Res<()> {
        let a = self.a;
        let mut members: Vec<(NodeId, PathBuf, u32, u16)> = Vec::new();
        // Holders first, then the relays; each id follows from its key.
        for h in 0..a.holders + a.nodes {
            let stage = if h < a.holders {
                0
            } else {
                1 + (h - a.holders) % (a.stages - 2)
            };
            let (id, key) = self.new_member_key()?;
            members.push((id, key, stage, free_port()?));
        }
        let peers: Vec<String> = members
            .iter()
            .map(|(id, _, s, port)| format!("{id}/{s}/127.0.0.1:{port}"))
            .collect();
        for (id, key, stage, port) in members {
            let link = self.next_link();
            self.launch(
                Launch {
                    id,
                    key,
                    port,
                    holder: stage == 0,
                    peers: peers.clone(),
                    join: Vec::new(),
                    stage: Some(stage),
                    link,
                },
                false,
            )?;
        }
        Ok(())
    }

    /// A new member's node key (`node-K.key` beside the swarm key) and the
    /// id that follows from it, unlike any id seen in this run.
    fn new_member_key(&mut self) -> Res<(NodeId, PathBuf)> {
        for _ in 0..16 {
            let path = self
                .key_file
                .with_file_name(format!("node-{}.key", self.next_key));
            self.next_key += 1;
            let (key, _) = NodeKey::load_or_create(&path)?;
            let id = key.node_id() as NodeId;
            if !self.ids.contains(&id) {
                self.ids.insert(id);
                return Ok((id, path));
            }
        }
        Err("16 node keys in a row had ids already taken".into())
    }

    /// Starts a joiner through up to three live members (the swarm picks its
    /// stage).
    pub fn join(&mut self) -> Res<NodeId> {
        let mut contacts: Vec<String> = self
            .facts
            .nodes
            .values()
            .filter(|n| n.member())
            .filter_map(|n| n.addr.clone())
            .collect();
        self.rng.shuffle(&mut contacts);
        contacts.truncate(3);
        if contacts.is_empty() {
            return Err("no live member has printed its address yet".into());
        }
        let (id, key) = self.new_member_key()?;
        let link = self.next_link();
        let port = free_port()?;
        self.launch(
            Launch {
                id,
                key,
                port,
                holder: false,
                peers: Vec::new(),
                join: contacts,
                stage: None,
                link,
            },
            true,
        )?;
        Ok(id)
    }

    /// Relays that may be killed now, optionally only of `stage` (each stage
    /// keeps a member that holds its current state, unless empty stages are
    /// allowed).
    pub fn victims(&self, stage: Option<u32>) -> Vec<NodeId> {
        // Paused members do not serve their stage meanwhile: they count as
        // neither members nor victims.
        let members = self.facts.available_per_stage();
        let in_sync = self.facts.in_sync_per_stage();
        self.facts
            .nodes
            .iter()
            .filter(|(_, n)| !n.holder && n.available())
            .filter(|(_, n)| stage.is_none() || n.stage == stage)
            .filter(|(_, n)| {
                // A stage keeps a member, and one known to hold its current
                // state (a joiner fresh from a download that missed an
                // update cannot serve it: the stage would be lost).
                let s = n.stage.unwrap_or(0) as usize;
                let synced_after = in_sync.get(s).copied().unwrap_or(0) - n.in_sync() as u32;
                self.a.allow_empty_stage
                    || (members.get(s).copied().unwrap_or(0) >= 2 && synced_after >= 1)
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// Microbatches in flight on node `id` now (see `Facts::in_flight`).
    fn carrying(&self, id: NodeId) -> u64 {
        let in_flight = self.facts.in_flight(self.a.microbatches);
        super::demo_chaos::carried(&in_flight)
            .get(&id)
            .copied()
            .unwrap_or(0)
    }

    pub fn kill(&mut self, id: NodeId, aim: &str, joiner: Option<NodeId>) {
        let carrying = self.carrying(id);
        self.procs.signal(id, libc::SIGKILL);
        let stage = self.facts.nodes.get(&id).and_then(|n| n.stage);
        self.record(What::Killed {
            node: id,
            aim: aim.to_string(),
            joiner,
            carrying: Some(carrying),
        });
        self.out.note(&format!(
            "{:>7.1}s  crash: SIGKILL node {id} (stage {}), timed to hit {aim}, {}",
            self.now(),
            stage.map_or("?".into(), |s| s.to_string()),
            carrying_words(carrying)
        ));
    }

    /// Stops node `id` for `for_s` seconds (the chaos continues it): pauses
    /// it (SIGSTOP), or with `cut` cuts its link (SIGUSR1, emulated).
    pub fn pause(&mut self, id: NodeId, for_s: f64, aim: &str, cut: bool) {
        let carrying = self.carrying(id);
        self.procs
            .signal(id, if cut { libc::SIGUSR1 } else { libc::SIGSTOP });
        let stage = self.facts.nodes.get(&id).and_then(|n| n.stage);
        self.record(What::Paused {
            node: id,
            aim: aim.to_string(),
            for_s,
            carrying: Some(carrying),
            cut,
        });
        let what = if cut {
            format!("cut: link of node {id} cut (SIGUSR1, emulated)")
        } else {
            format!("pause: SIGSTOP node {id}")
        };
        self.out.note(&format!(
            "{:>7.1}s  {what} (stage {}) for {for_s} s, timed to hit {aim}, {}",
            self.now(),
            stage.map_or("?".into(), |s| s.to_string()),
            carrying_words(carrying)
        ));
    }

    /// Continues a paused node (SIGCONT) or restores its cut link
    /// (SIGUSR2), unless it is gone.
    pub fn resume(&mut self, id: NodeId) {
        let Some(n) = self.facts.nodes.get(&id) else {
            return;
        };
        if !n.paused || !n.alive() {
            return;
        }
        let cut = n.cut;
        self.procs
            .signal(id, if cut { libc::SIGUSR2 } else { libc::SIGCONT });
        self.record(What::Resumed { node: id });
        let what = if cut {
            format!("restore: link of node {id} back (SIGUSR2)")
        } else {
            format!("resume: SIGCONT node {id}")
        };
        self.out.note(&format!("{:>7.1}s  {what}", self.now()));
    }
}

/// "carrying N microbatches in flight" or "carrying none".
fn carrying_words(n: u64) -> String {
    match n {
        0 => "carrying no microbatch in flight".into(),
        1 => "carrying 1 microbatch in flight".into(),
        n => format!("carrying {n} microbatches in flight"),
    }
}

/// Latency divisor of `--links geo10`.
const GEO10_LATENCY_SCALE: f64 = 10.0;

/// (delay ms, Mbit/s) of a node in geo10 region `r % 10`.
fn geo10_link(r: usize) -> (u64, u64) {
    let s = gwtf::sim::scenario::Scenario::geo10();
    let n = s.regions.len();
    let r = r % n;
    let others: Vec<usize> = (0..n).filter(|&b| b != r).collect();
    let lat = others.iter().map(|&b| s.latency[r][b]).sum::<f64>() / others.len() as f64;
    let bw = others.iter().map(|&b| s.bandwidth[r][b]).sum::<f64>() / others.len() as f64;
    (
        (lat * 1000.0 / GEO10_LATENCY_SCALE).round().max(1.0) as u64,
        (bw * 8.0 / 1e6).round().max(1.0) as u64,
    )
}

// ---------------------------------------------------------------------------
// Progress

/// Live progress: an indicatif bar on a terminal, else one plain line per
/// iteration (and per crash or join) on stdout.
pub struct Out {
    bar: Option<indicatif::ProgressBar>,
}

impl Out {
    fn new(iterations: u64) -> Out {
        if !std::io::stderr().is_terminal() {
            return Out { bar: None };
        }
        let bar = indicatif::ProgressBar::new(iterations);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:28.cyan/blue}] {pos}/{len} {msg}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        Out { bar: Some(bar) }
    }
    pub fn note(&self, s: &str) {
        match &self.bar {
            Some(b) => b.println(s),
            None => println!("{s}"),
        }
    }
    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// The progress line: loss, tokens/s of the last iterations, members per
/// stage, crashes, recovered hops, joins.
fn status(f: &Facts) -> String {
    let rows = f.completed_iterations();
    let loss = rows.last().map_or("-".into(), |r| format!("{:.3}", r.loss));
    let recent = &rows[rows.len().saturating_sub(5)..];
    let tps = match (recent.first(), recent.last()) {
        (Some(a), Some(b)) if b.t_s > a.t_s => {
            let tok: u64 = recent[1..].iter().map(|r| r.tokens).sum();
            format!("{:.0}", tok as f64 / (b.t_s - a.t_s))
        }
        _ => "-".into(),
    };
    let members = f.members_per_stage();
    let relays: Vec<String> = members.iter().skip(1).map(|m| m.to_string()).collect();
    let pauses = match f.pause_count() {
        0 => String::new(),
        n => format!("pauses {n}  "),
    };
    let pauses = match f.cut_count() {
        0 => pauses,
        n => format!("{pauses}cuts {n}  "),
    };
    format!(
        "loss {loss}  {tps} tok/s  holders {}  relays per stage [{}]  crashes {}  \
         {pauses}recovered {}  joins {}",
        members.first().copied().unwrap_or(0),
        relays.join(" "),
        f.crashes(),
        f.recovered_count(),
        f.joins()
    )
}

// ---------------------------------------------------------------------------
// The reference

/// What the single-process reference trains.
pub struct ReferenceSpec<'a> {
    pub model: &'a str,
    pub stages: u32,
    pub seed: u64,
    /// Iterations to train, of a run planned for `schedule` (the learning rate
    /// follows the planned run's schedule when the swarm stopped early).
    pub iterations: u64,
    pub schedule: u64,
    /// Microbatches per holder per iteration.
    pub microbatches: u64,
    /// The holders' node ids (each draws its own microbatches).
    pub holders: Vec<NodeId>,
    pub data: &'a [PathBuf],
}

/// The loss per iteration of the same model trained in one process on
/// exactly the swarm's microbatches (each holder's, drawn as its node draws
/// them from the same documents), one optimizer step per iteration:
/// `swarm::model_trainer::reference_losses` on the data a holder loads.
pub fn reference_losses(r: &ReferenceSpec) -> Res<Vec<f64>> {
    use gwtf::model::dataset::{DataSource, Dataset};
    use gwtf::swarm::model_trainer::{self, ModelRun};
    let cfg = gwtf::model::preset(r.model)?;
    let run = ModelRun::new(cfg, r.stages as usize, r.seed, r.schedule as usize)?;
    // What `gwtf node --holder` trains on: the files, or the generated corpus.
    let src = if r.data.is_empty() {
        DataSource::Synthetic {
            seed: r.seed,
            bytes: run.opts.corpus_bytes,
        }
    } else {
        DataSource::Files(r.data.to_vec())
    };
    let docs = Dataset::load(&src, run.opts.seq)?.train;
    let holders: Vec<(gwtf::protocol::NodeId, &[Vec<u32>])> = r
        .holders
        .iter()
        .map(|&h| Ok((u32::try_from(h)?, docs.as_slice())))
        .collect::<Res<_>>()?;
    let losses = model_trainer::reference_losses(
        &run,
        &holders,
        u32::try_from(r.microbatches)?,
        u32::try_from(r.iterations)?,
        |_, _| {},
    )?;
    Ok(losses.into_iter().map(f64::from).collect())
}

// ---------------------------------------------------------------------------
// The run

pub fn run(a: DemoArgs) -> super::CliResult {
    check(&a)?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let tmp = tempfile::Builder::new().prefix("gwtf-demo-").tempdir()?;
    let key_file = tmp.path().join("swarm.key");
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| format!("no random swarm key: {e}"))?;
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&key_file, hex + "\n")?;
    let log = match &a.keep_logs {
        Some(d) => Some(std::fs::File::create(d.join("demo.log"))?),
        None => None,
    };
    let events = match &a.keep_logs {
        Some(d) => Some(std::io::BufWriter::new(std::fs::File::create(
            d.join("events.log"),
        )?)),
        None => None,
    };
    catch_interrupts();

    println!(
        "gwtf demo: {}, {} stages, {} holders + {} relays, {} iterations of {} microbatches per \
         holder; policy {}, crash every {}, join every {}, {}links {}",
        a.model,
        a.stages,
        a.holders,
        a.nodes,
        a.iterations,
        a.microbatches,
        a.policy.name(),
        every(a.crash_every),
        every(a.join_every),
        if a.pause_every > 0.0 {
            format!(
                "pause every {} for {} s, ",
                every(a.pause_every),
                a.pause_for
            )
        } else {
            String::new()
        } + &if a.cut_every > 0.0 {
            format!("cut every {} for {} s, ", every(a.cut_every), a.cut_for)
        } else {
            String::new()
        },
        links_name(a.links)
    );
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut sw = Swarm {
        a: &a,
        exe: exe.clone(),
        key_file,
        start: Instant::now(),
        tx,
        procs: Procs::default(),
        facts: Facts::new(a.stages),
        log,
        events,
        events_t: 0.0,
        rng: Rng(a.seed ^ 0x6777_7466_6465_6d6f),
        next_key: 1,
        ids: Default::default(),
        next_region: 0,
        out: Out::new(a.iterations),
        emptied: false,
    };
    let outcome = drive(&mut sw, &rx);
    sw.out.finish();
    // Every node is stopped before anything else happens (the guard would too).
    let ended = sw.procs.kill_all();
    drain(&mut sw, &rx, Duration::from_millis(200));
    if let Some(f) = &mut sw.events {
        let _ = f.flush();
    }
    for (id, code) in ended {
        sw.record(What::Exited { node: id, code });
    }
    let wall = sw.now();
    let stopped_why = outcome?;

    // The reference covers the iterations the swarm completed (none after a
    // Ctrl-C: whoever pressed it wants to stop).
    let completed = sw.facts.completed_iterations().len() as u64;
    let interrupted = INTERRUPTED.load(Ordering::SeqCst);
    let reference = if a.no_reference || interrupted || completed == 0 {
        None
    } else {
        let spec = ReferenceSpec {
            model: &a.model,
            stages: a.stages,
            seed: a.seed,
            iterations: completed.min(a.iterations),
            schedule: a.iterations,
            microbatches: a.microbatches,
            holders: sw.facts.holders().map(|(&id, _)| id).collect(),
            data: &a.data,
        };
        match reference_losses(&spec) {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!("gwtf demo: warning: no single-process reference: {e}");
                None
            }
        }
    };
    let plan = Plan {
        model: a.model.clone(),
        stages: a.stages,
        iterations: a.iterations,
        microbatches: a.microbatches,
    };
    let mut summary = sw.facts.summary(&plan, reference.as_deref(), wall);
    if let Some(why) = &stopped_why {
        summary.failures.insert(0, why.clone());
        summary.ok = false;
    }
    print_summary(&summary);
    show_troubled_nodes(&sw, a.keep_logs.is_some());
    if let Some(p) = &a.json {
        let mut v = serde_json::to_value(&summary)?;
        v["command"] = serde_json::json!(command);
        v["seed"] = serde_json::json!(a.seed);
        v["links"] = serde_json::json!(links_name(a.links));
        v["crash_every_s"] = serde_json::json!(a.crash_every);
        v["join_every_s"] = serde_json::json!(a.join_every);
        v["pause_every_s"] = serde_json::json!(a.pause_every);
        v["pause_for_s"] = serde_json::json!(a.pause_for);
        v["cut_every_s"] = serde_json::json!(a.cut_every);
        v["cut_for_s"] = serde_json::json!(a.cut_for);
        v["encrypt"] = serde_json::json!(a.encrypt);
        v["policy"] = serde_json::json!(a.policy.name());
        std::fs::write(p, serde_json::to_string_pretty(&v)? + "\n")
            .map_err(|e| format!("cannot write --json {}: {e}", p.display()))?;
    }
    if let Some(p) = &a.report {
        std::fs::write(p, demo_report::render_html(&summary, &command)?)
            .map_err(|e| format!("cannot write --report {}: {e}", p.display()))?;
    }
    if !summary.ok {
        return Err(format!("the demo failed: {}", summary.failures.join("; ")).into());
    }
    Ok(())
}

fn links_name(l: Links) -> &'static str {
    match l {
        Links::None => "none",
        Links::Geo10 => "geo10",
    }
}

fn every(s: f64) -> String {
    if s > 0.0 {
        format!("{s} s")
    } else {
        "never".into()
    }
}

/// The last stderr lines of the first nodes that failed on their own (exited
/// with an error status without being killed, or printed an error event).
fn show_troubled_nodes(sw: &Swarm, logs_kept: bool) {
    const SHOWN: usize = 2;
    let troubled: Vec<&Proc> = sw
        .procs
        .0
        .iter()
        .filter(|p| {
            sw.facts.nodes.get(&p.id).is_some_and(|n| {
                (n.killed_s.is_none() && n.exit_code.is_some_and(|c| c != 0))
                    || !n.errors.is_empty()
            })
        })
        .collect();
    for p in troubled.iter().take(SHOWN) {
        let Ok(t) = p.stderr_tail.lock() else {
            continue;
        };
        if !t.is_empty() {
            eprintln!("node {} stderr, last lines:", p.id);
            for l in t.iter().filter(|l| !l.trim().is_empty()) {
                eprintln!("  {l}");
            }
        }
    }
    if troubled.len() > SHOWN {
        eprintln!(
            "{} more nodes failed{}",
            troubled.len() - SHOWN,
            if logs_kept {
                ": their output is in --keep-logs"
            } else {
                " (--keep-logs DIR keeps every node's output)"
            }
        );
    }
}

fn print_summary(s: &Summary) {
    println!();
    for (k, v) in demo_report::fact_rows(s) {
        println!("  {:<44} {v}", format!("{k}:"));
    }
    for f in &s.failures {
        println!("FAILED: {f}");
    }
    for w in &s.warnings {
        println!("warning: {w}");
    }
    for u in &s.unverified {
        println!("not checked: {u}");
    }
}

/// Reads lines that are already there (or come within `wait`).
fn drain(sw: &mut Swarm, rx: &Receiver<Msg>, wait: Duration) {
    let until = Instant::now() + wait;
    while let Ok(m) = rx.recv_deadline(until) {
        match m {
            Msg::Line(id, t, line) => {
                sw.keep_line(id, t, &line);
                sw.facts.push(&Entry {
                    t,
                    what: What::Line {
                        node: id,
                        event: parse_line(&line),
                    },
                })
            }
            Msg::Eof(id) => {
                if let Some(p) = sw.procs.get(id) {
                    p.stdout_closed = true;
                }
            }
        }
    }
}

/// Takes in one line of node `id`, read at `t`: the facts, the progress, the
/// notes worth a line of their own, and the kills waiting for an event.
fn on_line(sw: &mut Swarm, chaos: &mut Chaos, shown: &mut usize, id: NodeId, t: f64, line: &str) {
    use gwtf::swarm::audit::Event;
    sw.keep_line(id, t, line);
    let ev = parse_line(line);
    sw.facts.push(&Entry {
        t,
        what: What::Line {
            node: id,
            event: ev.clone(),
        },
    });
    let Some(ev) = ev else {
        return;
    };
    match &ev {
        Event::Iteration { iteration, .. } => {
            if sw.a.empty_stage_at == Some(*iteration) && !sw.emptied {
                sw.emptied = true;
                empty_a_stage(sw);
            }
            let rows = sw.facts.completed_iterations();
            while *shown < rows.len() {
                let r = &rows[*shown];
                *shown += 1;
                match &sw.out.bar {
                    Some(b) => {
                        b.set_position(rows.len() as u64);
                        b.set_message(status(&sw.facts));
                    }
                    None => println!(
                        "{:>7.1}s  iteration {:>4}/{}  {}",
                        r.t_s,
                        *shown,
                        sw.a.iterations,
                        status(&sw.facts)
                    ),
                }
            }
        }
        Event::Error { message, .. } => {
            sw.out
                .note(&format!("{t:>7.1}s  node {id} error: {message}"));
        }
        Event::Stalled {
            stage, iteration, ..
        } => {
            sw.out.note(&format!(
                "{t:>7.1}s  node {id}: stage {stage} stalled in iteration {iteration}"
            ));
        }
        Event::Fenced {
            reason,
            incarnation,
            ..
        } => {
            sw.out.note(&format!(
                "{t:>7.1}s  node {id} fenced itself ({reason}): it joins again as \
                 incarnation {incarnation}"
            ));
        }
        Event::StageEmpty { stage, .. } => {
            sw.out
                .note(&format!("{t:>7.1}s  node {id}: stage {stage} is empty"));
        }
        Event::StageRestored {
            stage,
            from,
            iteration,
            applied,
            ..
        } => {
            sw.out.note(&format!(
                "{t:>7.1}s  node {id} restored stage {stage} from holder {from}'s copy of \
                 iteration {iteration} (standing for iteration {applied})"
            ));
        }
        Event::StageRebuilt { stage, from, .. } => {
            sw.out.note(&format!(
                "{t:>7.1}s  node {id} rebuilt stage {stage} from the average of its \
                 neighbours' weights (nodes {from:?}; no copy kept)"
            ));
        }
        Event::StageRestarted { stage, .. } => {
            sw.out.note(&format!(
                "{t:>7.1}s  node {id} restarted stage {stage} from the initial weights \
                 (no copy kept)"
            ));
        }
        Event::StateDownload {
            from,
            bytes,
            ms,
            bytes_per_s,
            ..
        } => {
            sw.out.note(&format!(
                "{t:>7.1}s  node {id} downloaded its stage's state from node {from} \
                 ({bytes} bytes in {ms:.0} ms from its request, {:.1} MB/s)",
                bytes_per_s / 1e6
            ));
        }
        _ => {}
    }
    chaos_on_event(sw, chaos, id, &ev);
}

/// `--empty-stage-at`: every live relay of the stage with the fewest
/// members is SIGKILLed at once, and every joiner not yet active and every
/// fenced node coming back (either may be downloading that stage's state,
/// and would take the stage up with it).
fn empty_a_stage(sw: &mut Swarm) {
    let avail = sw.facts.available_per_stage();
    let Some(stage) = (1..avail.len() as u32).min_by_key(|&s| (avail[s as usize], s)) else {
        return;
    };
    let victims: Vec<NodeId> = (sw.facts.nodes.iter())
        .filter(|(_, n)| !n.holder && n.alive())
        .filter(|(_, n)| n.stage == Some(stage) || n.active_s.is_none() || n.fenced)
        .map(|(&id, _)| id)
        .collect();
    sw.out.note(&format!(
        "{:>7.1}s  emptying stage {stage} on purpose (--empty-stage-at): killing its live \
         node(s) and the joiners on their way, {} in all",
        sw.now(),
        victims.len()
    ));
    for id in victims {
        sw.kill(
            id,
            &format!("emptying stage {stage} (--empty-stage-at)"),
            None,
        );
    }
}

/// Runs the swarm until the holders are done; `Ok(Some(why))` when it was
/// stopped early (deadline, interrupt, holders gone).
fn drive(sw: &mut Swarm, rx: &Receiver<Msg>) -> Res<Option<String>> {
    let a = sw.a;
    if a.crash_every > 0.0 && !a.allow_empty_stage && a.nodes < 2 * (a.stages - 2) {
        sw.out.note(&format!(
            "note: with {} relays over {} relay stages some stage has a single relay, which is \
             never killed (--allow-empty-stage kills it too)",
            a.nodes,
            a.stages - 2
        ));
    }
    sw.launch_founders()?;
    let mut chaos = Chaos::new(a);
    let mut next_join = if a.join_every > 0.0 {
        a.join_every
    } else {
        f64::INFINITY
    };
    let mut shown_iterations = 0usize;
    let mut last_status = Instant::now();
    loop {
        if INTERRUPTED.load(Ordering::SeqCst) {
            return Ok(Some("interrupted (Ctrl-C): every node was stopped".into()));
        }
        let now = sw.now();
        if now > a.deadline {
            return Ok(Some(format!(
                "the deadline of {} s passed after {} of {} iterations: every node was killed",
                a.deadline,
                sw.facts.completed_iterations().len(),
                a.iterations
            )));
        }
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(Msg::Line(id, t, line)) => {
                on_line(sw, &mut chaos, &mut shown_iterations, id, t, &line)
            }
            Ok(Msg::Eof(id)) => {
                if let Some(p) = sw.procs.get(id) {
                    p.stdout_closed = true;
                }
            }
            Err(_) => {}
        }
        for (id, code) in sw.procs.reap() {
            let killed = sw
                .facts
                .nodes
                .get(&id)
                .is_some_and(|n| n.killed_s.is_some());
            let holder = sw.facts.nodes.get(&id).is_some_and(|n| n.holder);
            sw.record(What::Exited { node: id, code });
            if !(killed || holder && code == Some(0)) {
                sw.out.note(&format!(
                    "{:>7.1}s  node {id} exited on its own ({})",
                    sw.now(),
                    code.map_or("by a signal".into(), |c| format!("status {c}"))
                ));
            }
        }
        if sw.facts.holders_done() {
            break;
        }
        if sw
            .facts
            .holders()
            .any(|(_, n)| n.exited_s.is_some() && !n.done)
        {
            return Ok(Some("a holder ended before it was done".into()));
        }
        if sw.procs.running() == 0 {
            return Ok(Some("every node has ended".into()));
        }
        let now = sw.now();
        chaos_tick(sw, &mut chaos, now)?;
        if now >= next_join {
            next_join = now + a.join_every;
            match sw.join() {
                Ok(j) => sw.out.note(&format!(
                    "{:>7.1}s  join: node {j} (stage: the protocol's choice)",
                    now
                )),
                Err(e) => sw.out.note(&format!("{now:>7.1}s  no join: {e}")),
            }
        }
        if last_status.elapsed() > Duration::from_millis(250) {
            last_status = Instant::now();
            if let Some(b) = &sw.out.bar {
                b.set_message(status(&sw.facts));
            }
        }
    }
    // The holders are done: the paused come back, the relays leave
    // gracefully, then the stragglers die.
    chaos.resume_all(sw);
    let ids: Vec<NodeId> = sw
        .procs
        .0
        .iter()
        .filter(|p| !p.exited)
        .map(|p| p.id)
        .collect();
    for id in ids {
        sw.procs.signal(id, libc::SIGTERM);
        sw.record(What::Stopped { node: id });
    }
    let until = Instant::now() + Duration::from_secs(3);
    while sw.procs.running() > 0 && Instant::now() < until {
        drain(sw, rx, Duration::from_millis(50));
        for (id, code) in sw.procs.reap() {
            sw.record(What::Exited { node: id, code });
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geo10_links_are_short_but_ordered_by_distance() {
        let all: Vec<(u64, u64)> = (0..10).map(geo10_link).collect();
        for &(delay, mbps) in &all {
            assert!((1..=30).contains(&delay), "{all:?}");
            assert!(mbps >= 1, "{all:?}");
        }
        assert_eq!(geo10_link(3), geo10_link(13));
        // Sydney (index 6) is farther from everyone than Ohio (index 2).
        assert!(all[6].0 > all[2].0, "{all:?}");
    }

    #[test]
    fn the_rng_is_deterministic_and_in_range() {
        let mut a = Rng(7);
        let mut b = Rng(7);
        for _ in 0..100 {
            let x = a.below(5);
            assert_eq!(x, b.below(5));
            assert!(x < 5);
        }
        assert_eq!(a.pick::<u8>(&[]), None);
        let mut v: Vec<u32> = (0..10).collect();
        a.shuffle(&mut v);
        v.sort();
        assert_eq!(v, (0..10).collect::<Vec<_>>());
    }
}
