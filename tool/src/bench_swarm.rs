//! `gwtf bench swarm`: a local swarm of `gwtf node` processes measured
//! against `gwtf train` in one process, on the same cores, in one run.
//!
//! 1. Throughput: tokens/s of the swarm without crashes (from the holders'
//!    `iteration` events) against `gwtf train` doing the same work per step
//!    (`--accum` = microbatches of the whole swarm per iteration), both in
//!    steady state (from the first step/iteration to the last).
//! 2. Recovery after a SIGKILL of a relay, repeated (a replacement joins
//!    after each kill). For each kill, from the kill (just before kill(2)):
//!    `detect` until the first survivor reports the victim lost
//!    (`peer_lost`); `reroute` until the first `recovered` event (a hop of a
//!    microbatch in flight through the victim is sent elsewhere, or the
//!    microbatch restarted); `recovered` until the holder reports the last
//!    of those microbatches done (`mb_done`: its backward is back, so the
//!    hop was redone elsewhere; an upper bound on the hop itself); `next
//!    iteration` until the holders next report an iteration final.
//! 3. Wasted compute: 1 - useful / compute over every node's last `stats`
//!    (killed nodes: their last report before the kill), without crashes and
//!    with a relay killed every `--crash-every-s`.
use super::checks;
use super::train_cmd::TRAINABLE;
use clap::Args;
use gwtf::model::preset;
use gwtf::swarm::event_log::{parse_line, LogEvent};
use gwtf::swarm::model_trainer::ModelRun;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct BenchSwarmArgs {
    /// Data holders.
    #[arg(long, default_value_t = 2, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    holders: u32,
    /// Relay stages (the model is cut into relay stages + 2).
    #[arg(long, default_value_t = 2, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    relay_stages: u32,
    /// Relays per relay stage (at least 2: a killed relay needs a survivor).
    #[arg(long, default_value_t = 2, value_parser = checks::int_at_least::<u32>(2),
          allow_negative_numbers = true)]
    relays: u32,
    /// Model preset (gpt-tiny, llama-tiny or llama-small).
    #[arg(long, default_value = "llama-tiny")]
    model: String,
    /// Iterations of the throughput run (and steps of `gwtf train`).
    #[arg(long, default_value_t = 200, value_parser = checks::int_at_least::<u32>(3),
          allow_negative_numbers = true)]
    iterations: u32,
    /// Microbatches per data holder per iteration.
    #[arg(long, default_value_t = 4, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    microbatches: u32,
    /// The cost of the holders' copies of the relay stages' states: the
    /// throughput run again with `gwtf node --keep-states-every K` on the
    /// holders, in interleaved pairs with runs without (0: skip).
    #[arg(long, value_name = "K", default_value_t = 5, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(0))]
    copies_every: u32,
    /// With --copies-every: the runs with copies also write a checkpoint of
    /// the model every K updates (`gwtf node --save DIR --save-every K` on
    /// --save-writers of the holders), so the ratio is what copies and
    /// checkpoints cost together (0: copies only).
    #[arg(long, value_name = "K", default_value_t = 0, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(0))]
    save_every: u32,
    /// With --save-every: how many of the holders write the checkpoints
    /// (a user who wants the model on one machine gives `--save` to one;
    /// each writer asks every stage for its state at each checkpoint).
    #[arg(long, value_name = "N", default_value_t = 1, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(1))]
    save_writers: u32,
    /// With --copies-every: how many pairs of runs (without, then with)
    /// the ratio is the mean over (more pairs, less noise).
    #[arg(long, value_name = "N", default_value_t = 2, allow_negative_numbers = true,
          value_parser = checks::int_in::<u32>(1, 20))]
    copies_pairs: u32,
    /// SIGKILLs of a relay for the recovery time (0: skip).
    #[arg(long, default_value_t = 20, value_parser = checks::int_at_least::<u32>(0),
          allow_negative_numbers = true)]
    kills: u32,
    /// Seconds the wasted-compute run under crashes lasts, about (0: skip).
    #[arg(long, default_value_t = 40.0, value_parser = checks::float_in(0.0, 86400.0))]
    crash_run_s: f64,
    /// A relay is killed this often in the wasted-compute run (seconds).
    #[arg(long, default_value_t = 10.0, value_parser = checks::float_in(0.5, 86400.0))]
    crash_every_s: f64,
    /// How long a replacement may take to become active (seconds).
    #[arg(long, default_value_t = 5.0, value_parser = checks::float_in(0.1, 3600.0))]
    join_timeout_s: f64,
    /// How long the swarm may go without an iteration before the bench
    /// gives up (seconds).
    #[arg(long, default_value_t = 60.0, value_parser = checks::float_in(1.0, 86400.0))]
    stall_timeout_s: f64,
    /// CPU threads of each node's kernels (0: one per core, as on a
    /// machine of its own; at most 1024) [default: cores / nodes, at least
    /// 1: the nodes share this machine's cores as `gwtf train` uses them].
    #[arg(long, value_parser = checks::int_in::<usize>(0, 1024), allow_negative_numbers = true)]
    node_threads: Option<usize>,
    /// Also write the results as one JSON object to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn check_interrupted() -> Res<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err("interrupted".into());
    }
    Ok(())
}

/// A line a node printed, when it was read (`ev`: `None` for garbage).
struct Line {
    id: u32,
    at: Instant,
    ev: Option<LogEvent>,
}

/// The microbatch an event names, (holder, iteration, index); zeros for
/// an event that names none.
fn mb_key(e: &Option<LogEvent>) -> (u64, u64, u64) {
    match e {
        Some(LogEvent::Recovered {
            holder,
            iteration,
            index,
            ..
        })
        | Some(LogEvent::MbDone {
            holder,
            iteration,
            index,
            ..
        }) => (*holder, *iteration, *index),
        _ => (0, 0, 0),
    }
}

fn num(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

/// One `gwtf node` process.
struct Proc {
    child: Child,
    /// 0: holder; a relay's stage (a joiner's once active; None before).
    stage: Option<u32>,
    alive: bool,
    /// Last `stats`: (compute ms, useful ms).
    stats: (f64, f64),
}

/// A swarm of `gwtf node` processes; dropping it kills them all.
struct Swarm {
    exe: PathBuf,
    dir: PathBuf,
    key: PathBuf,
    /// What every node is started with (model, stages, iterations, ...).
    common: Vec<String>,
    procs: BTreeMap<u32, Proc>,
    holders: Vec<(u32, SocketAddr)>,
    tx: Sender<Line>,
    rx: Receiver<Line>,
    /// The number in the next node key file's name.
    next_key: u32,
    /// Each node's key file (its id follows from the key).
    keys: BTreeMap<u32, PathBuf>,
    /// Holder iteration reports: iteration -> (holders reported, tokens, last report).
    iterations: BTreeMap<u64, (u32, u64, Instant)>,
    done: BTreeSet<u32>,
    /// Relay stage -> relays seen on recent microbatch paths, latest last.
    recent: HashMap<u32, VecDeque<u32>>,
    last_iteration: Instant,
    stall: Duration,
    /// `error` events: (node, message).
    errors: Vec<(u32, String)>,
    /// Hops redone (`recovered` events).
    recovered: u64,
    /// `copy_kept` events (holders' copies of the stages' states).
    copies_kept: usize,
    checkpoints: usize,
}

fn free_port() -> Res<SocketAddr> {
    let port = super::demo_procs::free_port()?;
    Ok(SocketAddr::from(([127, 0, 0, 1], port)))
}

impl Swarm {
    fn start(a: &BenchSwarmArgs, dir: &std::path::Path, iterations: u32) -> Res<Swarm> {
        Swarm::start_keeping(a, dir, iterations, 0, 0)
    }

    /// [`Swarm::start`] whose holders keep copies of the relay stages'
    /// states every `keep_every` updates and write a checkpoint every
    /// `save_every` (0: none).
    fn start_keeping(
        a: &BenchSwarmArgs,
        dir: &std::path::Path,
        iterations: u32,
        keep_every: u32,
        save_every: u32,
    ) -> Res<Swarm> {
        let key = dir.join("key");
        let (tx, rx) = channel();
        let mut s = Swarm {
            exe: std::env::current_exe()?,
            dir: dir.to_path_buf(),
            key,
            common: vec![
                "--model".into(),
                a.model.clone(),
                "--stages".into(),
                (a.relay_stages + 2).to_string(),
                "--iterations".into(),
                iterations.to_string(),
                "--microbatches".into(),
                a.microbatches.to_string(),
                "--threads".into(),
                node_threads(a).to_string(),
                "--json".into(),
            ],
            procs: BTreeMap::new(),
            holders: Vec::new(),
            tx,
            rx,
            next_key: 1,
            keys: BTreeMap::new(),
            iterations: BTreeMap::new(),
            done: BTreeSet::new(),
            recent: HashMap::new(),
            last_iteration: Instant::now(),
            stall: Duration::from_secs_f64(a.stall_timeout_s),
            errors: Vec::new(),
            recovered: 0,
            copies_kept: 0,
            checkpoints: 0,
        };
        let mut founders = Vec::new();
        for _ in 0..a.holders {
            founders.push((s.fresh_id()?, 0, free_port()?));
        }
        for st in 1..=a.relay_stages {
            for _ in 0..a.relays {
                founders.push((s.fresh_id()?, st, free_port()?));
            }
        }
        let peers: Vec<String> = founders
            .iter()
            .flat_map(|(id, st, addr)| ["--peer".to_string(), format!("{id}/{st}/{addr}")])
            .collect();
        let mut writers = a.save_writers;
        for &(id, st, addr) in &founders {
            let mut args = vec!["--listen".to_string(), addr.to_string()];
            args.extend(peers.iter().cloned());
            if st == 0 {
                args.push("--holder".into());
                if keep_every > 0 {
                    args.extend(["--keep-states-every".into(), keep_every.to_string()]);
                }
                if save_every > 0 && writers > 0 {
                    writers -= 1;
                    let to = dir.join(format!("checkpoints-{id:x}"));
                    args.extend([
                        "--save".into(),
                        to.display().to_string(),
                        "--save-every".into(),
                        save_every.to_string(),
                    ]);
                }
                s.holders.push((id, addr));
            } else {
                args.extend(["--stage".to_string(), st.to_string()]);
            }
            s.spawn(id, Some(st), &args)?;
        }
        s.last_iteration = Instant::now();
        Ok(s)
    }

    /// A new node key file and the id that follows from it (unlike the
    /// ids given out before).
    fn fresh_id(&mut self) -> Res<u32> {
        for _ in 0..16 {
            let path = self.dir.join(format!("node-{}.key", self.next_key));
            self.next_key += 1;
            let (key, _) = gwtf::wire::NodeKey::load_or_create(&path)?;
            if let std::collections::btree_map::Entry::Vacant(e) = self.keys.entry(key.node_id()) {
                e.insert(path);
                return Ok(key.node_id());
            }
        }
        Err("16 node keys in a row had ids already taken".into())
    }

    fn spawn(&mut self, id: u32, stage: Option<u32>, args: &[String]) -> Res<()> {
        let stderr = std::fs::File::create(self.dir.join(format!("node-{id}.stderr")))?;
        let mut cmd = Command::new(&self.exe);
        let key = self.keys.get(&id).ok_or("a node without a key file")?;
        cmd.arg("node")
            .arg("--node-key")
            .arg(key)
            .arg("--swarm-key-file")
            .arg(&self.key)
            .args(&self.common)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr));
        super::demo_procs::die_with_parent(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.exe.display()))?;
        let out = child.stdout.take().expect("piped");
        let tx = self.tx.clone();
        // What it prints is kept beside its stderr: a failed bench keeps
        // its directory for them.
        let mut log = std::io::LineWriter::new(std::fs::File::create(
            self.dir.join(format!("node-{id}.stdout")),
        )?);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let _ = writeln!(log, "{line}");
                let at = Instant::now();
                let ev = parse_line(&line);
                if tx.send(Line { id, at, ev }).is_err() {
                    break;
                }
            }
        });
        self.procs.insert(
            id,
            Proc {
                child,
                stage,
                alive: true,
                stats: (0.0, 0.0),
            },
        );
        Ok(())
    }

    /// Starts a replacement that joins through a holder; returns its id.
    fn join(&mut self) -> Res<u32> {
        let id = self.fresh_id()?;
        let via = self.holders[0].1;
        let args = vec![
            "--listen".to_string(),
            "127.0.0.1:0".into(),
            "--join".into(),
            via.to_string(),
        ];
        self.spawn(id, None, &args)?;
        Ok(id)
    }

    fn kill(&mut self, id: u32) {
        if let Some(p) = self.procs.get_mut(&id) {
            let _ = p.child.kill();
            let _ = p.child.wait();
            p.alive = false;
        }
    }

    /// The next line (bookkept), waiting at most `within`; an error when
    /// the swarm has made no progress for the stall timeout.
    fn next(&mut self, within: Duration) -> Res<Option<Line>> {
        check_interrupted()?;
        let within = within.min(Duration::from_millis(200));
        let l = match self.rx.recv_timeout(within) {
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => {
                if self.last_iteration.elapsed() > self.stall {
                    KEEP_SCRATCH.store(true, std::sync::atomic::Ordering::Relaxed);
                    return Err(format!(
                        "the swarm made no progress for {:?} (node logs: {})",
                        self.stall,
                        self.dir.display()
                    )
                    .into());
                }
                return Ok(None);
            }
            Err(RecvTimeoutError::Disconnected) => return Err("every node's output ended".into()),
        };
        match &l.ev {
            Some(LogEvent::Stats {
                compute_ms,
                useful_ms,
                ..
            }) => {
                if let Some(p) = self.procs.get_mut(&l.id) {
                    p.stats = (*compute_ms, *useful_ms);
                }
            }
            Some(LogEvent::Active { stage, .. }) => {
                if let Some(p) = self.procs.get_mut(&l.id) {
                    p.stage = Some(*stage);
                }
            }
            Some(LogEvent::Done { .. }) => {
                self.done.insert(l.id);
            }
            Some(LogEvent::Recovered { .. }) => self.recovered += 1,
            Some(LogEvent::CopyKept { .. }) => self.copies_kept += 1,
            Some(LogEvent::Checkpoint { .. }) => self.checkpoints += 1,
            Some(LogEvent::Iteration {
                iteration, tokens, ..
            }) => {
                self.last_iteration = l.at;
                let e = self.iterations.entry(*iteration).or_insert((0, 0, l.at));
                e.0 += 1;
                e.1 += tokens;
                e.2 = l.at;
            }
            Some(LogEvent::MbDone { path, .. }) => {
                for (st, &n) in path.iter().enumerate().skip(1) {
                    let q = self.recent.entry(st as u32).or_default();
                    q.push_back(n as u32);
                    if q.len() > 16 {
                        q.pop_front();
                    }
                }
            }
            Some(LogEvent::Error { message, .. }) => {
                self.errors.push((l.id, message.clone()));
            }
            _ => {}
        }
        Ok(Some(l))
    }

    /// Live relays of `stage` that are active.
    fn relays_of(&self, stage: u32) -> Vec<u32> {
        self.procs
            .iter()
            .filter(|(_, p)| p.alive && p.stage == Some(stage))
            .map(|(id, _)| *id)
            .collect()
    }

    /// The relay of `stage` to kill: the one that carried a microbatch
    /// most recently (so that the kill hits work in flight), else the first.
    fn victim(&self, stage: u32) -> Option<u32> {
        let live = self.relays_of(stage);
        if live.len() < 2 {
            return None;
        }
        let recent = self.recent.get(&stage);
        recent
            .and_then(|q| q.iter().rev().find(|id| live.contains(id)).copied())
            .or(live.first().copied())
    }

    /// Waits for the next holder iteration report.
    fn wait_iteration(&mut self) -> Res<Instant> {
        loop {
            if let Some(l) = self.next(Duration::from_millis(200))? {
                if matches!(l.ev, Some(LogEvent::Iteration { .. })) {
                    return Ok(l.at);
                }
            }
        }
    }

    /// Waits until every holder printed `done`.
    fn wait_done(&mut self) -> Res<()> {
        let holders = self.holders.len();
        while self.done.len() < holders {
            self.next(Duration::from_millis(200))?;
        }
        Ok(())
    }

    /// Lets the last updates land, asks every live node to leave, and reads
    /// what they print until they exit (their final `stats`).
    fn finish(&mut self) -> Res<()> {
        let settle = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < settle {
            self.next(Duration::from_millis(100))?;
        }
        for p in self.procs.values_mut().filter(|p| p.alive) {
            if p.child.try_wait().ok().flatten().is_none() {
                // SAFETY: kill(2) on our own child, not yet reaped.
                unsafe {
                    libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM);
                }
            }
        }
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            let mut running = 0;
            for p in self.procs.values_mut().filter(|p| p.alive) {
                if p.child.try_wait().ok().flatten().is_none() {
                    running += 1;
                }
            }
            if running == 0 {
                break;
            }
            self.next(Duration::from_millis(50))?;
        }
        // Drain what the readers still hold.
        while let Ok(Some(_)) = self.next(Duration::from_millis(50)) {}
        Ok(())
    }

    /// 1 - useful / compute over every node, and the compute (ms).
    fn wasted(&self) -> (f64, f64) {
        let (c, u) = self
            .procs
            .values()
            .fold((0.0, 0.0), |(c, u), p| (c + p.stats.0, u + p.stats.1));
        (if c > 0.0 { 1.0 - u / c } else { 0.0 }, c)
    }

    /// Tokens of every iteration reported final.
    fn tokens(&self) -> u64 {
        self.iterations.values().map(|x| x.1).sum()
    }

    /// Steady tokens/s: from the first iteration final to the last.
    fn tokens_per_s(&self) -> Option<(f64, f64)> {
        let first = self.iterations.values().next()?;
        let last = self.iterations.values().next_back()?;
        let tokens: u64 = self.iterations.values().skip(1).map(|x| x.1).sum();
        let s = last.2.duration_since(first.2).as_secs_f64();
        (s > 0.0).then(|| (tokens as f64 / s, s))
    }
}

impl Drop for Swarm {
    fn drop(&mut self) {
        for p in self.procs.values_mut() {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }
}

/// CPU seconds (user and system) of this process's children reaped so far.
fn children_cpu_s() -> f64 {
    // SAFETY: getrusage fills the struct it is given, nothing else.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru);
        ru
    };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    s(ru.ru_utime) + s(ru.ru_stime)
}

/// Kernel threads per node: `--node-threads`, or the cores shared out.
fn node_threads(a: &BenchSwarmArgs) -> usize {
    let nodes = (a.holders + a.relay_stages * a.relays) as usize;
    a.node_threads
        .unwrap_or_else(|| super::demo_procs::threads_per_node(nodes))
}

/// A scratch directory removed at the end.
/// The bench's directory, removed at the end unless the run failed (an
/// error names it for its node logs).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() && !KEEP_SCRATCH.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Set when the bench fails: its directory stays for the logs it names.
static KEEP_SCRATCH: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `gwtf train` on the same work: steady tokens/s and its seconds.
fn reference(a: &BenchSwarmArgs) -> Res<(f64, f64, Vec<Value>)> {
    let accum = a.holders * a.microbatches;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["train", "--model", &a.model, "--json"])
        .args(["--steps", &a.iterations.to_string()])
        .args(["--accum", &accum.to_string()])
        .args(["--stages", &(a.relay_stages + 2).to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    super::demo_procs::die_with_parent(&mut cmd);
    let out = cmd.output()?;
    check_interrupted()?;
    if !out.status.success() {
        return Err(format!(
            "gwtf train failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let steps: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let (Some(f), Some(l)) = (steps.first(), steps.last()) else {
        return Err("gwtf train printed no steps".into());
    };
    let cfg = preset(&a.model)?;
    let run = ModelRun::new(cfg, a.relay_stages as usize + 2, 1, a.iterations as usize)?;
    let per_step = (run.opts.batch * run.opts.seq) as f64 * accum as f64;
    let (s0, s1) = (num(f, "step"), num(l, "step"));
    let (e0, e1) = (
        f["elapsed_s"].as_f64().unwrap_or(0.0),
        l["elapsed_s"].as_f64().unwrap_or(0.0),
    );
    if s1 <= s0 || e1 <= e0 {
        return Err("gwtf train: too few steps to time".into());
    }
    Ok((per_step * (s1 - s0) as f64 / (e1 - e0), e1, steps))
}

/// Node errors of one phase, for the report.
#[derive(Default)]
struct Errors {
    count: usize,
    /// The first few, as "phase: node N: message".
    first: Vec<String>,
}

impl Errors {
    fn take(&mut self, phase: &str, s: &mut Swarm) {
        for (id, m) in s.errors.drain(..) {
            self.count += 1;
            if self.first.len() < 4 {
                self.first.push(format!("{phase}: node {id}: {m}"));
            }
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One kill of the recovery run.
#[derive(Default)]
struct Kill {
    victim: u32,
    stage: u32,
    detect_ms: Option<f64>,
    reroute_ms: Option<f64>,
    recovered_ms: Option<f64>,
    next_iteration_ms: Option<f64>,
    affected: usize,
    replacement_active_ms: Option<f64>,
}

fn stats(xs: &[f64]) -> Value {
    if xs.is_empty() {
        return json!(null);
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    json!({"n": v.len(), "median_ms": v[v.len() / 2], "max_ms": v[v.len() - 1]})
}

fn show(v: &Value) -> String {
    if v.is_null() {
        return "-".into();
    }
    format!(
        "median {:.0} ms, max {:.0} ms (n={})",
        v["median_ms"].as_f64().unwrap_or(0.0),
        v["max_ms"].as_f64().unwrap_or(0.0),
        v["n"]
    )
}

/// Kills a relay, measures, starts a replacement. Returns the measurement
/// and whether the swarm kept its size (the replacement became active).
fn one_kill(s: &mut Swarm, stage: u32, a: &BenchSwarmArgs) -> Res<Option<(Kill, bool)>> {
    let Some(victim) = s.victim(stage) else {
        return Ok(None);
    };
    let mut k = Kill {
        victim,
        stage,
        ..Kill::default()
    };
    let t0 = Instant::now();
    s.kill(victim);
    // Microbatches a recovery touched: first `recovered`, then `mb_done`.
    let mut affected: HashMap<(u64, u64, u64), Option<Instant>> = HashMap::new();
    let mut last_recovered = t0;
    let deadline = t0 + Duration::from_secs_f64(a.stall_timeout_s);
    loop {
        let all_done = affected.values().all(|d| d.is_some());
        let quiet = last_recovered.elapsed() > Duration::from_secs(1);
        if k.detect_ms.is_some() && k.next_iteration_ms.is_some() && all_done && quiet {
            break;
        }
        if Instant::now() > deadline {
            break;
        }
        let Some(l) = s.next(Duration::from_millis(100))? else {
            continue;
        };
        let since = ms(l.at.saturating_duration_since(t0));
        let key = mb_key(&l.ev);
        match &l.ev {
            Some(LogEvent::PeerLost { peer, .. }) if *peer == u64::from(victim) => {
                k.detect_ms.get_or_insert(since);
            }
            Some(LogEvent::Recovered { .. }) => {
                k.reroute_ms.get_or_insert(since);
                last_recovered = l.at;
                affected.entry(key).or_insert(None);
            }
            Some(LogEvent::MbDone { .. }) => {
                if let Some(d) = affected.get_mut(&key) {
                    d.get_or_insert(l.at);
                }
            }
            Some(LogEvent::Iteration { .. }) => {
                k.next_iteration_ms.get_or_insert(since);
            }
            _ => {}
        }
    }
    k.affected = affected.len();
    if !affected.is_empty() && affected.values().all(|d| d.is_some()) {
        k.recovered_ms = affected
            .values()
            .flatten()
            .map(|t| ms(t.saturating_duration_since(t0)))
            .reduce(f64::max);
    }
    let j = s.join()?;
    let t1 = Instant::now();
    let until = t1 + Duration::from_secs_f64(a.join_timeout_s);
    while Instant::now() < until {
        if let Some(l) = s.next(Duration::from_millis(100))? {
            if l.id == j && matches!(l.ev, Some(LogEvent::Active { .. })) {
                k.replacement_active_ms = Some(ms(l.at.saturating_duration_since(t1)));
                break;
            }
        }
    }
    let kept = k.replacement_active_ms.is_some();
    if kept {
        s.wait_iteration()?;
    } else {
        s.kill(j);
    }
    Ok(Some((k, kept)))
}

pub fn run(a: BenchSwarmArgs) -> super::CliResult {
    if !TRAINABLE.contains(&a.model.as_str()) {
        return Err(format!(
            "--model {}: the swarm trains gpt-tiny, llama-tiny or llama-small",
            a.model
        )
        .into());
    }
    ModelRun::new(
        preset(&a.model)?,
        a.relay_stages as usize + 2,
        1,
        a.iterations as usize,
    )?;
    if let Some(p) = &a.json {
        checks::writable_output("--json", p)?;
    }
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let dir = std::env::temp_dir().join(format!("gwtf-bench-swarm-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let scratch = Scratch(dir.clone());
    std::fs::write(dir.join("key"), "gwtf-bench-swarm-key-0123456789\n")?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let nodes = a.holders + a.relay_stages * a.relays;
    println!(
        "gwtf bench swarm: {} cut into {} stages; {} holders x {} microbatches, {} relay \
         stages x {} relays ({nodes} processes) on {cores} cores",
        a.model,
        a.relay_stages + 2,
        a.holders,
        a.microbatches,
        a.relay_stages,
        a.relays
    );

    // 1. Throughput, and the wasted compute without crashes.
    // The reference runs before and after the swarm, and counts with the
    // mean of both: a shared machine's speed drifts over a run.
    let (ref_before, ref_s_before, _) = reference(&a)?;
    let t = Instant::now();
    let mut s = Swarm::start(&a, &dir, a.iterations)?;
    s.wait_done()?;
    let wall = t.elapsed().as_secs_f64();
    s.finish()?;
    let (tps, steady_s) = s
        .tokens_per_s()
        .ok_or("the swarm reported too few iterations")?;
    let (waste0, compute_ms) = s.wasted();
    let recovered0 = s.recovered;
    let mut errors = Errors::default();
    errors.take("throughput", &mut s);
    drop(s);
    let (ref_after, ref_s_after, _) = reference(&a)?;
    let (ref_tps, ref_s) = (
        (ref_before + ref_after) / 2.0,
        (ref_s_before + ref_s_after) / 2.0,
    );
    let ratio = tps / ref_tps;
    let iter_s = steady_s / (a.iterations - 1) as f64;
    println!(
        "throughput  swarm {tps:.0} tokens/s, gwtf train {ref_tps:.0} tokens/s (before \
         {ref_before:.0}, after {ref_after:.0}): ratio {ratio:.2} \
         ({:.1} ms per iteration)",
        iter_s * 1e3
    );
    let busy = compute_ms / 1e3 / (wall * cores.min(nodes as usize) as f64);
    let where_time = json!({
        "swarm_wall_s": wall,
        "swarm_compute_s": compute_ms / 1e3,
        "train_wall_s": ref_s,
        "hops_redone": recovered0,
        "compute_over_train": compute_ms / 1e3 / ref_s,
        "busy_fraction": busy,
    });
    if ratio < 0.8 {
        println!(
            "  where the time goes: the nodes computed {:.1} s in all (gwtf train: {ref_s:.1} s \
             for the same work, x{:.2}) in {wall:.1} s of wall time on {} cores: busy {:.0} %, \
             the rest is waiting (messages, the iteration barrier, the all-reduce, startup)",
            compute_ms / 1e3,
            compute_ms / 1e3 / ref_s,
            cores.min(nodes as usize),
            busy * 100.0
        );
    }

    // 1b. What the holders' copies of the stages' states cost: runs
    // without and with them, interleaved (the machine's speed drifts).
    let mut copies = Value::Null;
    if a.copies_every > 0 {
        let (mut without, mut with, mut kept, mut saved) = (Vec::new(), Vec::new(), 0usize, 0usize);
        // CPU seconds the nodes used per 1000 tokens trained: what the
        // copies cost in work, which a busy machine's drift hides less
        // than it hides their cost in time.
        let (mut cpu_without, mut cpu_with) = (Vec::new(), Vec::new());
        for round in 0..2 * a.copies_pairs {
            let keep = if round % 2 == 0 { 0 } else { a.copies_every };
            let save = if keep == 0 { 0 } else { a.save_every };
            let cpu0 = children_cpu_s();
            let mut s = Swarm::start_keeping(&a, &dir, a.iterations, keep, save)?;
            s.wait_done()?;
            s.finish()?;
            let (tps, _) = s
                .tokens_per_s()
                .ok_or("the swarm reported too few iterations")?;
            kept += s.copies_kept;
            saved += s.checkpoints;
            errors.take("copies", &mut s);
            let tokens = s.tokens();
            // Every node reaped, so that its CPU time is counted.
            drop(s);
            let cpu = (children_cpu_s() - cpu0) * 1000.0 / tokens.max(1) as f64;
            if keep == 0 {
                without.push(tps);
                cpu_without.push(cpu);
            } else {
                with.push(tps);
                cpu_with.push(cpu);
            }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let copy_ratio = mean(&with) / mean(&without);
        let cpu_ratio = mean(&cpu_with) / mean(&cpu_without);
        let saving = if a.save_every > 0 {
            let writers = a.save_writers.min(a.holders);
            format!(
                " and {writers} of the {} writing a checkpoint every {}",
                a.holders, a.save_every
            )
        } else {
            String::new()
        };
        println!(
            "copies      holders keeping every stage's state every {} updates (one holder a \
             stage in turn){saving}: {:.0} \
             tokens/s against {:.0} without (interleaved, {} runs each): ratio \
             {copy_ratio:.3}; {kept} copies kept, {saved} checkpoints written",
            a.copies_every,
            mean(&with),
            mean(&without),
            a.copies_pairs
        );
        println!(
            "copies cpu  the nodes' CPU per 1000 tokens: {:.2} s with, {:.2} s without: ratio \
             {cpu_ratio:.3} (pairs: {})",
            mean(&cpu_with),
            mean(&cpu_without),
            (cpu_with.iter().zip(&cpu_without))
                .map(|(w, o)| format!("{:.3}", w / o))
                .collect::<Vec<_>>()
                .join(", ")
        );
        copies = json!({
            "every": a.copies_every, "save_every": a.save_every, "pairs": a.copies_pairs,
            "save_writers": a.save_writers.min(a.holders),
            "tokens_per_s_with": with, "tokens_per_s_without": without,
            "ratio": copy_ratio, "copies_kept": kept, "checkpoints": saved,
            "cpu_s_per_1000_tokens_with": cpu_with, "cpu_s_per_1000_tokens_without": cpu_without,
            "cpu_ratio": cpu_ratio,
        });
    }

    // 2. Recovery after SIGKILL.
    let mut kills: Vec<Kill> = Vec::new();
    let mut restarts = 0;
    if a.kills > 0 {
        let big = 1_000_000;
        let mut s = Swarm::start(&a, &dir, big)?;
        s.wait_iteration()?;
        while kills.len() < a.kills as usize {
            let stage = kills.len() as u32 % a.relay_stages + 1;
            let r = one_kill(&mut s, stage, &a)?;
            let kept = match r {
                Some((k, kept)) => {
                    kills.push(k);
                    kept
                }
                None => false,
            };
            if !kept {
                // The stage is short of a relay: start over with a full swarm.
                errors.take("recovery", &mut s);
                drop(s);
                restarts += 1;
                s = Swarm::start(&a, &dir, big)?;
                s.wait_iteration()?;
            }
        }
        errors.take("recovery", &mut s);
    }
    let pick = |f: fn(&Kill) -> Option<f64>| -> Value {
        stats(&kills.iter().filter_map(f).collect::<Vec<_>>())
    };
    let detect = pick(|k| k.detect_ms);
    let reroute = pick(|k| k.reroute_ms);
    let recovered = pick(|k| k.recovered_ms);
    let next_iter = pick(|k| k.next_iteration_ms);
    let joined = pick(|k| k.replacement_active_ms);
    let hit = kills.iter().filter(|k| k.affected > 0).count();
    if !kills.is_empty() {
        println!(
            "recovery    {} kills ({hit} hit microbatches in flight), from the SIGKILL:",
            kills.len()
        );
        println!("  detected (peer_lost)                   {}", show(&detect));
        println!(
            "  hop sent elsewhere (first recovered)   {}",
            show(&reroute)
        );
        println!(
            "  affected microbatches done (mb_done)   {}",
            show(&recovered)
        );
        println!(
            "  next iteration final                   {}",
            show(&next_iter)
        );
        println!(
            "  replacement active (from its start)    {} ; {} of {} became active{}",
            show(&joined),
            kills
                .iter()
                .filter(|k| k.replacement_active_ms.is_some())
                .count(),
            kills.len(),
            if restarts > 0 {
                format!(" (swarm restarted {restarts} times to keep its size)")
            } else {
                String::new()
            }
        );
    }

    // 3. Wasted compute under a crash every crash_every_s.
    let mut crash = json!(null);
    if a.crash_run_s > 0.0 {
        let n = ((a.crash_run_s / iter_s.max(1e-3)) as u32).max(3);
        let mut s = Swarm::start(&a, &dir, n)?;
        s.wait_iteration()?;
        let every = Duration::from_secs_f64(a.crash_every_s);
        let mut next = Instant::now() + every;
        let (mut crashes, mut skipped, mut turn) = (0u32, 0u32, 0u32);
        while s.done.len() < s.holders.len() {
            if Instant::now() >= next {
                next += every;
                let victim = (0..a.relay_stages)
                    .map(|i| (turn + i) % a.relay_stages + 1)
                    .find_map(|st| s.victim(st));
                turn += 1;
                match victim {
                    Some(v) => {
                        s.kill(v);
                        s.join()?;
                        crashes += 1;
                    }
                    None => skipped += 1,
                }
            }
            s.next(Duration::from_millis(100))?;
        }
        s.finish()?;
        errors.take("crashes", &mut s);
        let (w, c) = s.wasted();
        let joined = s
            .procs
            .iter()
            .filter(|(id, p)| **id > a.holders + a.relay_stages * a.relays && p.stage.is_some())
            .count();
        crash = json!({
            "iterations": n, "crashes": crashes, "crashes_skipped": skipped,
            "replacements_active": joined, "wasted": w, "compute_s": c / 1e3,
        });
        println!(
            "wasted      no crashes {:.2} % ({recovered0} hops redone); a crash every {:.0} s: \
             {:.2} % ({crashes} crashes over {n} iterations, {joined} of {crashes} replacements \
             became active{})",
            waste0 * 100.0,
            a.crash_every_s,
            w * 100.0,
            if skipped > 0 {
                format!(", {skipped} crashes skipped: no stage had a relay to spare")
            } else {
                String::new()
            }
        );
    } else {
        println!(
            "wasted      no crashes {:.2} % ({recovered0} hops redone)",
            waste0 * 100.0
        );
    }

    if errors.count > 0 {
        println!(
            "node errors {} (the runtime's; first {}):",
            errors.count,
            errors.first.len()
        );
        for e in &errors.first {
            println!("  {e}");
        }
    }

    if let Some(p) = &a.json {
        let per_kill: Vec<Value> = kills
            .iter()
            .map(|k| {
                json!({
                    "victim": k.victim, "stage": k.stage, "detect_ms": k.detect_ms,
                    "reroute_ms": k.reroute_ms, "recovered_ms": k.recovered_ms,
                    "next_iteration_ms": k.next_iteration_ms, "affected": k.affected,
                    "replacement_active_ms": k.replacement_active_ms,
                })
            })
            .collect();
        let v = json!({
            "model": a.model, "holders": a.holders, "relay_stages": a.relay_stages,
            "relays": a.relays, "microbatches": a.microbatches, "cores": cores,
            "throughput": {
                "iterations": a.iterations, "swarm_tokens_per_s": tps,
                "train_tokens_per_s": ref_tps, "train_tokens_per_s_before": ref_before,
                "train_tokens_per_s_after": ref_after, "ratio": ratio, "where": where_time,
            },
            "recovery": {
                "kills": kills.len(), "hit_in_flight": hit, "swarm_restarts": restarts,
                "detect": detect, "reroute": reroute, "recovered": recovered,
                "next_iteration": next_iter, "replacement_active": joined,
                "per_kill": per_kill,
            },
            "wasted": {"no_crashes": waste0, "crashes": crash},
            "copies": copies,
            "node_errors": {"count": errors.count, "first": errors.first},
        });
        std::fs::write(p, format!("{v:#}\n"))?;
    }
    drop(scratch);
    Ok(())
}
