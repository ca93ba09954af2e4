//! `gwtf node`: one process = one swarm node (a data holder or a relay)
//! that trains libgwtf's model with the others over TCP. SIGTERM or Ctrl-C
//! leaves gracefully; SIGKILL is a crash the others survive; SIGUSR1 cuts
//! its link and SIGUSR2 restores it (emulated in user space: a test and
//! demo aid, printed as `link_cut` / `link_restored`).
use super::checks;
use super::node_save::Saver;
use super::transport_cmd::{node_key, read_key};
use clap::{Args, ValueEnum};
use gwtf::engine::{LinkEmulation, NodeOptions};
use gwtf::model::checkpoint::{self, Checkpoint};
use gwtf::model::dataset::{DataSource, Dataset};
use gwtf::model::preset;
use gwtf::protocol::{Event, NodeId, Policy, Stage};
use gwtf::sim::model::ModelPreset;
use gwtf::swarm::emulated::{EmulatedShape, EmulatedTrainer};
use gwtf::swarm::event_log::LogEvent;
#[cfg(feature = "cuda")]
use gwtf::swarm::model_pieces::OnBackend;
use gwtf::swarm::model_pieces::Placement;
use gwtf::swarm::model_trainer::{ModelRun, ModelTrainer};
use gwtf::swarm::runtime::{
    NodeEvent, Output, Peer, Runtime, RuntimeOptions, Trainer, Work, WorkPort,
};
use gwtf::swarm::sizing::{NodeNeeds, NodeSizing};
use gwtf::wire::NodeKey;
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

#[derive(Args)]
pub struct NodeArgs {
    /// Address to listen on (e.g. 127.0.0.1:7001).
    #[arg(long)]
    listen: SocketAddr,
    /// File holding the swarm key every member shares (at least 16 bytes).
    #[arg(long)]
    swarm_key_file: PathBuf,
    /// Encrypt frame payloads (AES-256-GCM) on this node's connections (a
    /// connection encrypts when either end asks). Every frame is
    /// authenticated either way.
    #[arg(long)]
    encrypt: bool,
    /// This node's private key, created on first start when missing; the
    /// node's id follows from it (`gwtf keygen FILE` prints it) and every
    /// handshake proves it [default: node-PORT.key next to the swarm key
    /// file, PORT the one of --listen].
    #[arg(long, value_name = "FILE")]
    node_key: Option<PathBuf>,
    /// Insecure, for test swarms with fixed ids: take id N (1..2^32-1), and
    /// accept peers whose ids do not follow from their keys (any holder of
    /// the swarm key can then act as any node); every member must be given
    /// it.
    #[arg(long, value_name = "N", value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    chosen_id: Option<u32>,
    /// A founding member, as ID/STAGE/ADDR (stage 0: a data holder; ID in
    /// decimal or 0x hex, as `gwtf keygen` prints it). Every founding
    /// member is given the same list.
    #[arg(long = "peer", value_name = "ID/STAGE/ADDR", value_parser = parse_peer)]
    peers: Vec<Peer>,
    /// Join a running swarm through this member's address (the swarm
    /// chooses the stage).
    #[arg(long, value_name = "ADDR")]
    join: Vec<SocketAddr>,
    /// A data holder: keep a copy of every relay stage's state (weights and
    /// optimizer state, in memory), asked for from one of the stage's
    /// members after every K updates, so that the stage's training
    /// outlives its nodes (`copy_kept` events). 0: none.
    #[arg(long, value_name = "K", default_value_t = 0, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(0))]
    keep_states_every: u32,
    /// A data holder: write a checkpoint of the swarm's model (every
    /// stage's weights and optimizer state of one iteration, in the layout
    /// of docs/CHECKPOINT.md) under DIR after every --save-every updates,
    /// from its own state and a copy of each relay stage's: DIR/iteration-N,
    /// complete or absent; DIR/LATEST names the newest (`checkpoint`
    /// events). `gwtf sample --checkpoint DIR` and `--resume DIR` read it.
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Updates between checkpoints (with --save; the last iteration's is
    /// written when the run's length is a multiple of K).
    #[arg(long, value_name = "K", default_value_t = 0, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u32>(0))]
    save_every: u32,
    /// Checkpoints kept under --save (the oldest are removed).
    #[arg(long, value_name = "N", default_value_t = 2, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    save_keep: usize,
    /// Test aid: each checkpoint's writer waits MS with every file written
    /// before the checkpoint takes its name (a test kills it then).
    #[arg(long, value_name = "MS", default_value_t = 0, hide = true)]
    save_pause_ms: u64,
    /// A founding member: start from the checkpoint in DIR (a checkpoint,
    /// or a --save directory: its newest), at the iteration after it. Give
    /// every founding member the same checkpoint, and the same --model,
    /// --stages, --seed and --iterations as the run that wrote it.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Give up, with an error naming the addresses, when no peer has been
    /// reached within SECONDS: for a joiner, none of its --join addresses;
    /// for a founding member, none of the other founding members (--peer).
    /// Reached: a peer completed the authenticated handshake with this node
    /// (it then sends the swarm's directory). Each address that refuses or
    /// does not answer is reported as it fails (a `connect_failed` event).
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS",
          value_parser = parse_join_timeout, allow_negative_numbers = true)]
    join_timeout: f64,
    /// Model preset (gpt-tiny, llama-tiny or llama-small).
    #[arg(long, default_value = "llama-tiny")]
    model: String,
    /// Stages of the model cut (>= 3): data holders run the first and the
    /// last, relays the stages in between.
    #[arg(long, default_value_t = 4, value_parser = checks::int_at_least::<usize>(3),
          allow_negative_numbers = true)]
    stages: usize,
    /// Be a data holder (embedding, loss and data).
    #[arg(long)]
    holder: bool,
    /// Routing policy: gwtf, or a baseline the simulator compares it with
    /// (swarm, swarm-plus, swarm-deccom; docs/SPEC.md section 8). Every
    /// node of a swarm must run the same one. central-mcmf is refused: it
    /// needs a planner with global knowledge, which only the simulator has.
    #[arg(long, default_value = "gwtf", value_parser = parse_policy)]
    policy: Policy,
    /// A founding relay's stage (1..stages-2), or auto for a joiner.
    #[arg(long, default_value = "auto")]
    stage: String,
    /// UTF-8 text files this data holder trains on [default: the generated
    /// English-like corpus of `gwtf train`, the same for every holder; each
    /// holder draws its own microbatches from it].
    #[arg(long, num_args = 1.., value_name = "FILE")]
    data: Vec<PathBuf>,
    /// Iterations to train; data holders print `done` and exit once they
    /// are committed.
    #[arg(long, default_value_t = 30, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    iterations: u32,
    /// Microbatches per data holder per iteration.
    #[arg(long, default_value_t = 4, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    microbatches: u32,
    /// Seed of the initial weights and of the microbatches (the same on
    /// every node).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where the model's stages run: the CPU, or CUDA device 0 (refused,
    /// with the reason, when there is no usable GPU).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// CPU threads of the model's kernels (0: one per core; at most 1024).
    /// Several nodes sharing a machine (a local swarm) run faster with fewer
    /// each.
    #[arg(long, default_value_t = 0, value_parser = checks::int_in::<usize>(0, 1024),
          allow_negative_numbers = true)]
    threads: usize,
    /// Memory this node may use for microbatches in flight (MiB): its
    /// capacity in the flows; as a relay it never keeps more microbatches'
    /// activations than fit (a forward beyond waits for a backward).
    #[arg(long, default_value_t = 256, value_parser = checks::int_at_least::<u64>(1),
          allow_negative_numbers = true)]
    memory_mb: u64,
    /// Size-faithful emulation (`gwtf bench testbed`): no model runs; each
    /// piece of work waits the time a GPU of --tflops takes for it on this
    /// simulator model (llama-124m, llama-500m, llama-1.5b, ...), and every
    /// activation, gradient and state has that model's size. --stages is
    /// the model's own then; --memory-mb is the GPU's memory (a relay holds
    /// what fits beside its stage's state, as in the simulator).
    #[arg(long, value_name = "MODEL")]
    emulate: Option<String>,
    /// With --emulate: sequences per microbatch [default: the model's].
    #[arg(long, value_name = "N", value_parser = checks::int_at_least::<usize>(1),
          allow_negative_numbers = true)]
    sequences: Option<usize>,
    /// With --emulate: this node's GPU speed (TFLOP/s).
    #[arg(long, default_value_t = 10.0, value_parser = checks::float_in(1e-3, 1e6))]
    tflops: f64,
    /// With --emulate: microbatches a relay holds at once [default: what
    /// --memory-mb holds beside its stage's state, the simulator's rule].
    #[arg(long, value_name = "N", value_parser = checks::int_in::<u32>(1, 1024),
          allow_negative_numbers = true)]
    capacity: Option<u32>,
    /// Microbatches a data holder keeps in flight at once.
    #[arg(long, default_value_t = 4, value_parser = checks::int_at_least::<u32>(1),
          allow_negative_numbers = true)]
    in_flight: u32,
    /// Emulated one-way delay on every link (ms).
    #[arg(long, default_value_t = 0, value_parser = checks::int_at_least::<u64>(0),
          allow_negative_numbers = true)]
    link_delay_ms: u64,
    /// Emulated bandwidth cap on every link (Mbit/s, 0: none).
    #[arg(long, default_value_t = 0.0, value_parser = checks::float_in(0.0, 1e6))]
    link_mbps: f64,
    /// Per-peer link emulation (`gwtf bench testbed` writes it): one line
    /// per peer, `ID DELAY_MS MBIT_S` (one-way delay, bandwidth cap, 0: none);
    /// a peer named here gets its own link instead of --link-delay-ms and
    /// --link-mbps. Lines starting with # are comments.
    #[arg(long, value_name = "FILE")]
    peer_links: Option<PathBuf>,
    /// One JSON object per line per event on stdout.
    #[arg(long)]
    json: bool,
    /// Log connections, refusals and recoveries to stderr (also when the
    /// environment has GWTF_LOG set, for the nodes a demo starts).
    #[arg(long)]
    log: bool,
    /// Test aid: also print `{"event":"work","kind":K,"phase":"start"|"end"}`
    /// around every piece of the trainer's work (with --json).
    #[arg(long)]
    trace_work: bool,
    /// Test aid: make every work of kind KIND (forward, backward, loss,
    /// embed, embed_backward, gradient, apply, export_state, import_state)
    /// take MS milliseconds longer, so that a test can kill the node in the
    /// middle of it.
    #[arg(long, value_name = "KIND=MS", value_parser = parse_slow)]
    slow_work: Vec<(String, u64)>,
}

const WORK_KINDS: [&str; 9] = [
    "embed",
    "forward",
    "loss",
    "backward",
    "embed_backward",
    "gradient",
    "apply",
    "export_state",
    "import_state",
];

/// The policies a swarm of processes can run ([`NodeArgs::policy`]).
pub(crate) fn parse_policy(s: &str) -> Result<Policy, String> {
    match Policy::by_name(s) {
        Some(Policy::CentralMcmf) => Err(format!(
            "{s:?} needs a central planner with global knowledge; only \
             `gwtf sim` and `gwtf bench policies` run it"
        )),
        Some(p) => Ok(p),
        None => Err(format!(
            "{s:?}: expected one of {}",
            Policy::ALL
                .iter()
                .filter(|p| **p != Policy::CentralMcmf)
                .map(|p| p.name())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

fn parse_slow(s: &str) -> Result<(String, u64), String> {
    let (k, ms) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected KIND=MS"))?;
    if !WORK_KINDS.contains(&k) {
        return Err(format!("{s:?}: KIND is one of {}", WORK_KINDS.join(", ")));
    }
    let ms = ms.parse().map_err(|_| format!("{s:?}: MS is a number"))?;
    Ok((k.to_string(), ms))
}

/// The built-in trainer, with the test aids around it.
struct Traced {
    inner: Box<dyn Trainer>,
    id: NodeId,
    trace: bool,
    slow: Vec<(String, u64)>,
}

impl Trainer for Traced {
    fn run(&mut self, w: Work, port: &WorkPort) -> Result<Output, String> {
        let kind = w.kind.name();
        let line = |phase: &str| {
            let v = LogEvent::Work {
                node: self.id.into(),
                kind: kind.to_string(),
                phase: phase.to_string(),
            };
            let mut o = std::io::stdout().lock();
            let _ = writeln!(o, "{}", v.to_line());
            let _ = o.flush();
        };
        if self.trace {
            line("start");
        }
        if let Some((_, ms)) = self.slow.iter().find(|(k, _)| k == kind) {
            std::thread::sleep(Duration::from_millis(*ms));
        }
        let r = self.inner.run(w, port);
        if self.trace {
            line("end");
        }
        r
    }
}

/// The links of a `--peer-links` file (see [`NodeArgs::peer_links`]).
fn read_peer_links(path: &std::path::Path) -> Res<BTreeMap<u64, LinkEmulation>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--peer-links {}: {e}", path.display()))?;
    let mut links = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |why: &str| {
            format!(
                "--peer-links {} line {}: {why}: {line:?}",
                path.display(),
                i + 1
            )
        };
        let f: Vec<&str> = line.split_whitespace().collect();
        let [id, delay, mbps] = f[..] else {
            return Err(bad("expected ID DELAY_MS MBIT_S").into());
        };
        let id = parse_id(id).map_err(|_| bad("ID is a number"))?;
        let delay: f64 = delay.parse().map_err(|_| bad("DELAY_MS is a number"))?;
        let mbps: f64 = mbps.parse().map_err(|_| bad("MBIT_S is a number"))?;
        if !(delay.is_finite() && (0.0..=3.6e6).contains(&delay)) {
            return Err(bad("DELAY_MS must be in 0..=3600000").into());
        }
        if !(mbps.is_finite() && (0.0..=1e6).contains(&mbps)) {
            return Err(bad("MBIT_S must be in 0..=1000000").into());
        }
        let link = LinkEmulation {
            delay: Duration::from_secs_f64(delay / 1e3),
            bandwidth_bytes_per_s: (mbps * 1e6 / 8.0) as u64,
        };
        if links.insert(u64::from(id), link).is_some() {
            return Err(bad("a peer named twice").into());
        }
    }
    Ok(links)
}

/// Longest --join-timeout (a week).
const JOIN_TIMEOUT_MAX: f64 = 7.0 * 86400.0;

fn parse_join_timeout(s: &str) -> Result<f64, String> {
    let v = checks::positive_float(s)?;
    if v > JOIN_TIMEOUT_MAX {
        return Err(format!("must be <= {JOIN_TIMEOUT_MAX} (a week), got {s}"));
    }
    Ok(v)
}

/// A node id in decimal or `0x` hex.
fn parse_id(s: &str) -> Result<NodeId, std::num::ParseIntError> {
    match s.strip_prefix("0x") {
        Some(h) => NodeId::from_str_radix(h, 16),
        None => s.parse(),
    }
}

fn parse_peer(s: &str) -> Result<Peer, String> {
    let f: Vec<&str> = s.splitn(3, '/').collect();
    let [id, stage, addr] = f[..] else {
        return Err(format!("{s:?}: expected ID/STAGE/ADDR"));
    };
    Ok(Peer {
        id: parse_id(id)
            .map_err(|_| format!("{s:?}: bad id {id:?}"))
            .and_then(|i: NodeId| {
                if i == 0 {
                    Err(format!("{s:?}: ids start at 1"))
                } else {
                    Ok(i)
                }
            })?,
        stage: stage
            .parse()
            .map_err(|_| format!("{s:?}: bad stage {stage:?}"))?,
        addr: addr
            .parse()
            .map_err(|_| format!("{s:?}: bad address {addr:?}"))?,
    })
}

static STOP: AtomicBool = AtomicBool::new(false);
/// SIGUSR1 cuts this node's link, SIGUSR2 restores it (emulated in user
/// space: `gwtf demo --cut-every`, tests).
static LINK_CUT: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

extern "C" fn on_link_signal(sig: libc::c_int) {
    LINK_CUT.store(sig == libc::SIGUSR1, Ordering::SeqCst);
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Args)]
pub struct KeygenArgs {
    /// The node key file: created (owner read and write only) when missing,
    /// else read.
    file: PathBuf,
    /// Print one JSON object: {"id", "id_hex", "public", "created"}.
    #[arg(long)]
    json: bool,
}

/// `gwtf keygen`: a node key file and the id that follows from it.
pub fn keygen(a: KeygenArgs) -> super::CliResult {
    let (key, created) = NodeKey::load_or_create(&a.file)?;
    let public: String = key.public().iter().map(|b| format!("{b:02x}")).collect();
    if a.json {
        println!(
            "{}",
            json!({"id": key.node_id(), "id_hex": format!("0x{:x}", key.node_id()),
                   "public": public, "created": created})
        );
    } else {
        println!(
            "node id {} (0x{:x}) of {} {}; public key {public}",
            key.node_id(),
            key.node_id(),
            if created { "new key" } else { "key" },
            a.file.display()
        );
    }
    Ok(())
}

/// The checked role of this node.
struct Role {
    id: NodeId,
    stage: Stage,
    join: bool,
}

/// Where this node's key is kept: --node-key, else `node-PORT.key` next to
/// the swarm key file (one key per listening port of a machine, so that
/// several nodes can share a swarm key file).
fn node_key_path(a: &NodeArgs) -> PathBuf {
    a.node_key.clone().unwrap_or_else(|| {
        a.swarm_key_file
            .with_file_name(format!("node-{}.key", a.listen.port()))
    })
}

fn role(a: &NodeArgs, model_stages: usize, key: &NodeKey) -> Res<Role> {
    let relay_stages = (model_stages - 2) as Stage;
    let id = a.chosen_id.unwrap_or_else(|| key.node_id());
    let join = !a.join.is_empty();
    if join && !a.peers.is_empty() {
        return Err(
            "--join and --peer exclude each other: a founding member is given \
                    --peer, a joiner --join"
                .into(),
        );
    }
    if !join && a.peers.is_empty() {
        return Err("give the founding members (--peer ID/STAGE/ADDR ...) or --join ADDR".into());
    }
    let stage = if a.holder {
        if join {
            return Err("data holders are founding members (--peer), they do not --join".into());
        }
        if a.stage != "auto" && a.stage != "0" {
            return Err(format!(
                "--holder with --stage {}: a data holder is stage 0",
                a.stage
            )
            .into());
        }
        0
    } else if a.stage == "auto" {
        if !join {
            return Err("a founding relay needs --stage K (1..=relay stages)".into());
        }
        0
    } else {
        if join {
            return Err("a joiner's stage is chosen by the swarm: leave --stage at auto".into());
        }
        let k: Stage = a
            .stage
            .parse()
            .map_err(|_| format!("--stage {}: a number or auto", a.stage))?;
        if k == 0 || k > relay_stages {
            return Err(format!(
                "--stage {k}: relays serve stages 1..={relay_stages} of a {}-stage cut \
                 (stage 0 is --holder)",
                model_stages
            )
            .into());
        }
        k
    };
    if !join {
        match a.peers.iter().find(|p| p.id == id) {
            Some(p) if p.stage != stage || p.addr != a.listen => {
                return Err(format!(
                    "--peer {}/{}/{} names this node (id {id}) with another stage or address",
                    p.id, p.stage, p.addr
                )
                .into())
            }
            _ => {}
        }
        if let Some(p) = a.peers.iter().find(|p| p.addr == a.listen && p.id != id) {
            return Err(format!(
                "--peer {}/{}/{} has this node's address, but this node is id {id} \
                 (its node key {}): another key file than the one its id was taken from?",
                p.id,
                p.stage,
                p.addr,
                node_key_path(a).display()
            )
            .into());
        }
        if let Some(p) = a.peers.iter().find(|p| p.stage > relay_stages) {
            return Err(format!(
                "--peer {}/{}/{}: stage {} does not exist (relay stages 1..={relay_stages})",
                p.id, p.stage, p.addr, p.stage
            )
            .into());
        }
    }
    if !a.data.is_empty() && !a.holder {
        return Err("--data is for data holders (--holder)".into());
    }
    if a.keep_states_every > 0 && !a.holder {
        return Err("--keep-states-every is for data holders (--holder)".into());
    }
    match (&a.save, a.save_every) {
        (Some(_), _) if !a.holder => {
            return Err("--save is for data holders (--holder)".into());
        }
        (Some(_), 0) => return Err("--save needs --save-every K (K > 0)".into()),
        (None, k) if k > 0 => return Err("--save-every needs --save DIR".into()),
        _ => {}
    }
    if a.resume.is_some() && join {
        return Err(
            "--resume is for founding members (--peer): a joiner downloads its \
             stage's state from the swarm"
                .into(),
        );
    }
    Ok(Role { id, stage, join })
}

/// Where the trainer's model stages run when not on the CPU (a trainer's
/// own place): CUDA device 0, or an error that says why there is none.
fn placement(device: Device) -> Res<Option<Arc<dyn Placement>>> {
    Ok(match device {
        Device::Cpu => None,
        #[cfg(feature = "cuda")]
        Device::Cuda => Some(Arc::new(OnBackend(gwtf::model::gpu::open_cuda()?))),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => return Err(gwtf::model::gpu::no_cuda().into()),
    })
}

/// Sizes the kernels' thread pools (rayon's and the matrix product's),
/// before any kernel runs and before this process starts other threads.
fn set_kernel_threads(n: usize) -> Res<()> {
    // The matrix product's pool reads its size from the environment once,
    // at its first use: no kernel has run yet, and this process has one
    // thread, so nothing reads the environment concurrently.
    std::env::set_var("MATMUL_NUM_THREADS", n.to_string());
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| format!("--threads {n}: {e}").into())
}

/// What a node runs, and the sizes the library's sizing rule needs.
struct Built {
    role: Role,
    trainer: Box<dyn Trainer>,
    /// Where its compute runs, in words.
    device: String,
    saver: Option<Saver>,
    needs: NodeNeeds,
    relay_stages: Stage,
    tokens_per_mb: u64,
    /// Microbatches it holds at once, where its own rule says (else the
    /// library's sizing from the memory budget).
    capacity: Option<u32>,
    /// The protocol's first estimate of a microbatch's compute (seconds).
    compute_s: f64,
    weights_first: Option<gwtf::swarm::runtime::WeightsPrefix>,
    /// The trainer averages neighbours' states (CheckFree).
    rebuilds: bool,
    /// The founding members start at the iteration after this one.
    resumed: Option<u32>,
}

/// The built-in model's node: a [`ModelTrainer`] on the CPU or the GPU.
fn modelled(a: &NodeArgs, node_key: &NodeKey) -> Res<Built> {
    if a.capacity.is_some() || a.sequences.is_some() {
        return Err(
            "--capacity and --sequences are for --emulate: a model's relay holds what \
                    --memory-mb holds, its microbatch is the model's"
                .into(),
        );
    }
    // The device first: without one the node stops before it listens.
    let placement = placement(a.device)?;
    let cfg = preset(&a.model)?;
    let run = ModelRun::new(cfg.clone(), a.stages, a.seed, a.iterations as usize)?;
    let r = role(a, run.stages, node_key)?;
    let mut data = None;
    let resumed = match &a.resume {
        Some(dir) => Some(resume_point(dir, &run)?),
        None => None,
    };
    let trainer = if r.join {
        ModelTrainer::joiner(run.clone())
    } else {
        let docs = if r.stage == 0 {
            let src = if a.data.is_empty() {
                DataSource::Synthetic {
                    seed: a.seed,
                    bytes: run.opts.corpus_bytes,
                }
            } else {
                DataSource::Files(a.data.clone())
            };
            let d = Dataset::load(&src, run.opts.seq)?;
            data = Some(d.description);
            d.train
        } else {
            Vec::new()
        };
        match &resumed {
            Some((ck, applied)) => {
                ModelTrainer::resumed(run.clone(), r.stage, docs, &ck.stages, *applied)?
            }
            None => ModelTrainer::new(run.clone(), r.stage, docs)?,
        }
    };
    let trainer = match placement {
        Some(p) => trainer.placed(p)?,
        None => trainer,
    };
    let device = trainer.placement();
    let saver = match (&a.save, data) {
        (Some(dir), Some(data)) => {
            let mut s = Saver::new(dir.clone(), a.save_keep, run.clone(), data, r.id);
            s.pause = Duration::from_millis(a.save_pause_ms);
            Some(s)
        }
        _ => None,
    };
    let relay_stages = (run.stages - 2) as Stage;
    let per_mb = (1..=relay_stages)
        .chain([0])
        .map(|s| run.bytes_per_microbatch(s))
        .collect::<Result<Vec<_>, _>>()?;
    let mine = if r.join {
        *per_mb.iter().max().unwrap_or(&1)
    } else {
        per_mb[if r.stage == 0 {
            per_mb.len() - 1
        } else {
            r.stage as usize - 1
        }]
    };
    // The library's one sizing rule (the C API's too): patience grows with
    // the largest state, capacity with the memory budget.
    let needs = NodeNeeds {
        stage_state_bytes: (0..=relay_stages)
            .map(|s| run.state_bytes(s))
            .collect::<Result<_, _>>()?,
        largest_tensor_bytes: run.activation_bytes() as u64,
        microbatch_bytes: mine,
        memory_budget_bytes: a.memory_mb << 20,
    };
    Ok(Built {
        role: r,
        trainer: Box::new(trainer),
        device,
        saver,
        needs,
        relay_stages,
        tokens_per_mb: (run.opts.batch * run.opts.seq) as u64,
        capacity: None,
        compute_s: 0.01,
        // The built-in trainer's relay states put the weights first.
        weights_first: Some(gwtf::swarm::model_trainer::weights_prefix),
        rebuilds: true,
        resumed: resumed.map(|r| r.1),
    })
}

/// A size-faithful emulated node (`--emulate`): see [`EmulatedTrainer`].
fn emulated(a: &NodeArgs, name: &str, node_key: &NodeKey) -> Res<Built> {
    let model = ModelPreset::with_sequences(name, a.sequences).ok_or_else(|| {
        format!("--emulate {name}: not a model preset of at least 3 stages (e.g. llama-124m, llama-500m, llama-1.5b)")
    })?;
    for (given, what) in [
        (a.save.is_some(), "--save"),
        (a.resume.is_some(), "--resume"),
        (!a.data.is_empty(), "--data"),
        (a.device != Device::Cpu, "--device"),
    ] {
        if given {
            return Err(format!("{what} needs a model; --emulate runs none").into());
        }
    }
    let flops = a.tflops * 1e12;
    let shape = EmulatedShape::of(&model, flops)?;
    let r = role(a, model.preset_stages, node_key)?;
    let relay_stages = model.relay_stages;
    let memory = a.memory_mb << 20;
    // The simulator's rules: a relay holds what fits in its GPU's memory
    // beside its stage's state; its first estimate is a forward and a
    // backward, a holder's its loss and embedding.
    let (capacity, compute_s) = if r.stage == 0 && !r.join {
        (
            None,
            (model.loss_flops() + 3.0 * model.embed_flops()) / flops,
        )
    } else {
        let fwd = if r.join {
            model.mean_stage_fwd_flops()
        } else {
            model.stage_fwd_flops(r.stage)
        };
        (
            Some(
                a.capacity
                    .unwrap_or_else(|| model.relay_capacity(r.stage.max(1), memory)),
            ),
            3.0 * fwd / flops,
        )
    };
    let needs = gwtf::swarm::emulated::node_needs(&model, memory);
    Ok(Built {
        role: r,
        trainer: Box::new(EmulatedTrainer::new(shape)),
        device: format!("emulated {name} at {} TFLOP/s", a.tflops),
        saver: None,
        needs,
        relay_stages,
        tokens_per_mb: (model.sequences * preset(name)?.seq) as u64,
        capacity,
        compute_s,
        weights_first: None,
        rebuilds: true,
        resumed: None,
    })
}

pub fn node(a: NodeArgs) -> super::CliResult {
    if a.threads > 0 {
        set_kernel_threads(a.threads)?;
    }
    let key = read_key(&a.swarm_key_file)?;
    let node_key = if a.chosen_id.is_some() && a.node_key.is_none() {
        // A test swarm's node: a key for this run only (none is written).
        node_key(None, "gwtf node")?
    } else {
        node_key(Some(&node_key_path(&a)), "gwtf node")?
    };
    let peer_links = match &a.peer_links {
        Some(p) => Some(Arc::new(read_peer_links(p)?)),
        None => None,
    };
    let built = match &a.emulate {
        Some(name) => emulated(&a, name, &node_key)?,
        None => modelled(&a, &node_key)?,
    };
    let Built {
        role: r,
        trainer,
        device,
        mut saver,
        needs,
        relay_stages,
        tokens_per_mb,
        capacity,
        compute_s,
        weights_first,
        rebuilds,
        resumed,
    } = built;
    let sizing = NodeSizing::of(&needs)?;
    let mut proto = sizing.protocol(&needs);
    debug_assert_eq!(proto.relay_stages, relay_stages);
    proto.mb_per_iter = a.microbatches;
    proto.policy = a.policy;
    proto.max_in_flight = a.in_flight;
    proto.iterations = Some(a.iterations);
    proto.keep_states_every = a.keep_states_every;
    proto.rebuild_from_neighbours = rebuilds;
    proto.save_every = a.save_every;
    proto.resume_from = resumed;
    let link = (a.link_delay_ms > 0 || a.link_mbps > 0.0).then(|| LinkEmulation {
        delay: Duration::from_millis(a.link_delay_ms),
        bandwidth_bytes_per_s: (a.link_mbps * 1e6 / 8.0) as u64,
    });
    let bootstrap = if r.join {
        a.join
            .iter()
            .map(|&addr| Peer {
                id: 0,
                stage: 0,
                addr,
            })
            .collect()
    } else {
        a.peers.clone()
    };
    let mut opts = RuntimeOptions {
        id: r.id,
        stage: r.stage,
        listen: a.listen,
        swarm_key: key,
        bootstrap,
        join: r.join,
        protocol: std::sync::Arc::new(proto),
        compute_s,
        capacity: capacity.unwrap_or(sizing.capacity),
        seed: a.seed ^ r.id as u64,
        net: NodeOptions {
            link,
            peer_links,
            log: a.log || std::env::var_os("GWTF_LOG").is_some(),
            encrypt: a.encrypt,
            node_key: Some(node_key),
            chosen_ids: a.chosen_id.is_some(),
            ..NodeOptions::default()
        },
        weights_first,
    };
    sizing.apply(&mut opts.net);
    let trainer = Traced {
        inner: trainer,
        id: r.id,
        trace: a.trace_work && a.json,
        slow: a.slow_work.clone(),
    };
    // The engine's socket writes do not raise SIGPIPE; a node whose stdout
    // reader went away (the demo died) must not die of it either, before it
    // has left: writes to stdout then fail quietly.
    // SAFETY: setting one signal's disposition before our threads start.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    let rt = Runtime::start(opts, trainer)?;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(
            libc::SIGUSR1,
            on_link_signal as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGUSR2,
            on_link_signal as *const () as libc::sighandler_t,
        );
    }
    let mut link_cut = false;
    let mut out = Printer {
        json: a.json,
        id: r.id,
        stage: r.stage,
        last_status: Instant::now(),
        iteration: None,
        loss: None,
        tokens_per_mb,
    };
    out.emit(LogEvent::Listening {
        node: r.id.into(),
        addr: rt.addr().map(|x| x.to_string()),
        device,
        suspicion_ms: sizing.liveness.suspicion().as_millis() as u64,
    });
    let (targets, what) = reach_targets(&a, &r);
    let mut reach = Reach::start(targets, what, Duration::from_secs_f64(a.join_timeout));
    let mut last_stats = Instant::now();
    loop {
        if STOP.load(Ordering::SeqCst) {
            out.stats(&rt);
            rt.leave();
            out.emit(LogEvent::Left { node: r.id.into() });
            return Ok(());
        }
        let cut = LINK_CUT.load(Ordering::SeqCst);
        if cut != link_cut {
            link_cut = cut;
            rt.set_link_cut(cut);
            out.emit(if cut {
                LogEvent::LinkCut { node: r.id.into() }
            } else {
                LogEvent::LinkRestored { node: r.id.into() }
            });
        }
        if rt.is_stopped() {
            out.emit(LogEvent::Error {
                node: r.id.into(),
                message: "the node stopped".into(),
            });
            return Err("the node stopped (see the errors above)".into());
        }
        if let Err(e) = reach.poll(&rt) {
            out.emit(LogEvent::Error {
                node: r.id.into(),
                message: e.clone(),
            });
            return Err(e.into());
        }
        if last_stats.elapsed() >= Duration::from_secs(1) {
            last_stats = Instant::now();
            out.stats(&rt);
        }
        if let Some(v) = saver.as_mut().and_then(|s| s.poll(false)) {
            out.emit(v);
        }
        let Ok(ev) = rt.events().recv_timeout(Duration::from_millis(100)) else {
            continue;
        };
        if let NodeEvent::ConnectFailed {
            addr,
            attempts,
            reason,
        } = &ev
        {
            reach.failed(*addr, reason, Some((*attempts).into()), &mut out);
            continue;
        }
        if let NodeEvent::Checkpoint { iteration, states } = ev {
            if let Some(v) = saver.as_mut().and_then(|s| s.start(iteration, states)) {
                out.emit(v);
            }
            continue;
        }
        if let Some(done) = out.event(ev, a.iterations) {
            if done {
                if let Some(s) = saver.as_mut() {
                    last_checkpoint(s, &rt, &mut out, &a);
                }
                out.stats(&rt);
                out.emit(LogEvent::Done { node: r.id.into() });
                rt.leave();
                return Ok(());
            }
        }
    }
}

/// The checkpoint in `dir` a founding member resumes from, checked against
/// this run, and the iteration whose update it holds last.
fn resume_point(dir: &std::path::Path, run: &ModelRun) -> Res<(Checkpoint, u32)> {
    let ck = checkpoint::load(dir)?;
    let at = checkpoint::resolve(dir)?;
    let mut mine = run.cfg.clone();
    mine.n_stages = run.stages;
    mine.batch = run.opts.batch;
    mine.seq = run.opts.seq;
    if let Some(d) = checkpoint::config_difference(&mine, &ck.config.model) {
        return Err(format!(
            "--resume {}: a checkpoint of another model or cut ({d}): give the --model \
             and --stages of the run that wrote it",
            at.display()
        )
        .into());
    }
    let (sched, seed) = (ck.config.training.schedule_steps, ck.config.seed);
    if sched != run.opts.steps || seed != run.seed {
        return Err(format!(
            "--resume {}: written by a run of --iterations {sched} --seed {seed}, this one \
             has --iterations {} --seed {}: give the same (the learning-rate schedule and \
             the microbatches follow from them)",
            at.display(),
            run.opts.steps,
            run.seed
        )
        .into());
    }
    let done = ck.config.steps_done;
    if done == 0 || done >= sched {
        return Err(format!(
            "--resume {}: {done} of the run's {sched} iterations done: nothing to resume",
            at.display()
        )
        .into());
    }
    Ok((ck, done as u32 - 1))
}

/// The run is over at this holder: when its last iteration closes a
/// checkpoint round, the checkpoint is waited for (the relays still serve
/// their copies) and written before the node leaves, for at most
/// [`LAST_CHECKPOINT_WAIT`].
fn last_checkpoint(s: &mut Saver, rt: &Runtime, out: &mut Printer, a: &NodeArgs) {
    let last = a.iterations - 1;
    if a.save_every == 0 || a.iterations % a.save_every != 0 {
        while let Some(v) = s.poll(true) {
            out.emit(v);
        }
        return;
    }
    let deadline = Instant::now() + LAST_CHECKPOINT_WAIT;
    let mut dropped = false;
    while s.last != Some(last) && Instant::now() < deadline {
        if let Some(v) = s.poll(false) {
            // Its write failed (and said why): nothing more to wait for.
            let failed = matches!(v, LogEvent::CheckpointFailed { iteration: Some(i), .. }
                if i == u64::from(last));
            out.emit(v);
            if s.last == Some(last) || failed {
                dropped = true;
                break;
            }
        }
        match rt.events().recv_timeout(Duration::from_millis(100)) {
            Ok(NodeEvent::Checkpoint { iteration, states }) => {
                if let Some(v) = s.start(iteration, states) {
                    out.emit(v);
                }
            }
            Ok(NodeEvent::CheckpointDropped { iteration, why }) if iteration == last => {
                out.emit(LogEvent::CheckpointSkipped {
                    node: out.id.into(),
                    iteration: iteration.into(),
                    why,
                });
                dropped = true;
                break;
            }
            Ok(ev) => {
                out.event(ev, a.iterations);
            }
            Err(_) => {}
        }
    }
    while let Some(v) = s.poll(true) {
        out.emit(v);
    }
    if s.last != Some(last) && !dropped {
        out.emit(LogEvent::CheckpointFailed {
            node: out.id.into(),
            iteration: Some(last.into()),
            why: format!(
                "the copies of the last iteration did not all come within {} s",
                LAST_CHECKPOINT_WAIT.as_secs()
            ),
        });
    }
}

/// How long a holder whose run is over waits for its last checkpoint.
const LAST_CHECKPOINT_WAIT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------
// Reaching the swarm (--join-timeout)

/// What became of connecting to an address.
#[derive(Clone, Debug, PartialEq)]
enum Probe {
    /// Every attempt of the engine failed: why.
    Failed(String),
}

/// One address this node starts from.
struct Target {
    /// As given: `--join ADDR` or `--peer ID/STAGE/ADDR`.
    shown: String,
    addr: SocketAddr,
    last: Option<Probe>,
}

/// Whether this node has reached any of the addresses it starts from, and
/// what became of each (--join-timeout): the engine reports every address
/// whose connection attempts all failed ([`NodeEvent::ConnectFailed`]);
/// reached means that it completed an authenticated handshake with some
/// peer (its counters).
struct Reach {
    targets: Vec<Target>,
    /// "--join address" or "founding member (--peer)".
    what: &'static str,
    started: Instant,
    timeout: Duration,
    reached: bool,
}

impl Reach {
    /// Watches `targets` (none: nothing to reach, never times out).
    fn start(targets: Vec<Target>, what: &'static str, timeout: Duration) -> Reach {
        Reach {
            reached: targets.is_empty(),
            targets,
            what,
            started: Instant::now(),
            timeout,
        }
    }

    /// The engine gave up connecting to `addr`: reported (a log line and a
    /// `connect_failed` event), once per address and reason.
    fn failed(&mut self, addr: SocketAddr, why: &str, attempts: Option<u64>, out: &mut Printer) {
        let t = self.targets.iter_mut().find(|t| t.addr == addr);
        let shown = t.as_ref().map(|t| t.shown.clone());
        if let Some(t) = t {
            let p = Probe::Failed(why.to_string());
            if t.last.as_ref() == Some(&p) {
                return;
            }
            t.last = Some(p);
        }
        match (&shown, self.reached) {
            (Some(shown), false) => eprintln!(
                "gwtf node {:x}: cannot reach {shown} ({why}); it gives up after \
                 --join-timeout {} s unless a peer is reached",
                out.id,
                self.timeout.as_secs_f64()
            ),
            _ => eprintln!("gwtf node {:x}: cannot reach {addr} ({why})", out.id),
        }
        out.emit(LogEvent::ConnectFailed {
            node: out.id.into(),
            addr: addr.to_string(),
            given: shown.clone(),
            attempts,
            reason: why.to_string(),
        });
    }

    /// Errs when nothing was reached within the timeout, naming what became
    /// of each address.
    fn poll(&mut self, rt: &Runtime) -> Result<(), String> {
        if self.reached {
            return Ok(());
        }
        let s = rt.net_stats();
        if s.peers_connected + s.peers_lost > 0 {
            self.reached = true;
            return Ok(());
        }
        if self.started.elapsed() < self.timeout {
            return Ok(());
        }
        let each: Vec<String> = self
            .targets
            .iter()
            .map(|t| {
                let state = match &t.last {
                    Some(Probe::Failed(why)) => why.clone(),
                    None => "no authenticated connection (still trying, or another \
                             swarm key?)"
                        .into(),
                };
                format!("{} ({state})", t.shown)
            })
            .collect();
        Err(format!(
            "no {} was reached within --join-timeout {} s: {}",
            self.what,
            self.timeout.as_secs_f64(),
            each.join(", ")
        ))
    }
}

/// The addresses a node starts from: a joiner's --join, or the founding
/// members other than itself.
fn reach_targets(a: &NodeArgs, r: &Role) -> (Vec<Target>, &'static str) {
    if r.join {
        let t = a
            .join
            .iter()
            .map(|&addr| Target {
                shown: format!("--join {addr}"),
                addr,
                last: None,
            })
            .collect();
        (t, "--join address")
    } else {
        let t = a
            .peers
            .iter()
            .filter(|p| p.id != r.id && p.addr != a.listen)
            .map(|p| Target {
                shown: format!("--peer {}/{}/{}", p.id, p.stage, p.addr),
                addr: p.addr,
                last: None,
            })
            .collect();
        (t, "founding member (--peer)")
    }
}

/// Writes the node's events: JSON lines, or a short status for a person.
struct Printer {
    json: bool,
    id: NodeId,
    stage: Stage,
    last_status: Instant,
    iteration: Option<u32>,
    loss: Option<f32>,
    tokens_per_mb: u64,
}

impl Printer {
    /// The node's compute time so far, and the part that went into an
    /// applied update.
    fn stats(&mut self, rt: &Runtime) {
        let s = rt.compute_stats();
        self.emit(LogEvent::Stats {
            node: self.id.into(),
            compute_ms: s.compute.as_secs_f64() * 1e3,
            useful_ms: s.useful.as_secs_f64() * 1e3,
        });
    }

    /// Writes `e`: its JSON line (the library's event schema), or a short
    /// line for a person.
    fn emit(&mut self, e: LogEvent) {
        let mut o = std::io::stdout().lock();
        if self.json {
            let _ = writeln!(o, "{}", e.to_line());
        } else {
            match &e {
                LogEvent::Stats {
                    compute_ms,
                    useful_ms,
                    ..
                } => {
                    if self.last_status.elapsed() < Duration::from_secs(2) {
                        return;
                    }
                    self.last_status = Instant::now();
                    let _ = writeln!(
                        o,
                        "node {:x} stage {} | iteration {} | loss {} | compute {:.1} s, useful {:.1} s",
                        self.id,
                        self.stage,
                        self.iteration.map_or("-".into(), |i| i.to_string()),
                        self.loss.map_or("-".into(), |l| format!("{l:.3}")),
                        compute_ms / 1e3,
                        useful_ms / 1e3,
                    );
                }
                LogEvent::Applied { .. } | LogEvent::Committed { .. } | LogEvent::MbDone { .. } => {
                }
                _ => {
                    let _ = writeln!(o, "node {:x}: {}", self.id, e.sentence());
                }
            }
        }
        let _ = o.flush();
    }

    /// Prints `ev`; Some(true) once the holder's last iteration is final.
    fn event(&mut self, ev: NodeEvent, iterations: u32) -> Option<bool> {
        let line = LogEvent::of(self.id.into(), &ev, self.tokens_per_mb)?;
        match (&ev, &line) {
            // Said once, by the loop, when this node is done or stopped.
            (_, LogEvent::Left { .. }) => return None,
            (NodeEvent::Protocol(Event::Active { stage }), _) => self.stage = *stage,
            (
                NodeEvent::Iteration {
                    iteration, loss, ..
                },
                _,
            ) => {
                self.iteration = Some(*iteration);
                self.loss = Some(*loss);
                self.emit(line);
                return Some(iteration + 1 >= iterations);
            }
            _ => {}
        }
        self.emit(line);
        None
    }
}
