//! A swarm node for real: the protocol state machine (`protocol::Node`, the
//! same code the simulator drives) run on real time over the engine's
//! authenticated TCP connections, with a trainer on a thread of its own.
//!
//! Threads: the *driver* owns the protocol node, turns engine events into
//! protocol inputs (a control frame becomes `Input::Message`, a broken
//! connection `Input::PeerLost` at once), performs the protocol's actions
//! (messages go out through `protocol::codec` as control frames; tasks go to
//! the trainer; events go to the caller) and runs its timers. The *trainer*
//! thread runs one task at a time and reports it done.
//!
//! Addresses: the protocol names peers by `NodeId`; the engine's node id is
//! that same number. Each connection starts with a directory message
//! ([`DIRECTORY_MSG`], outside the protocol's message kinds) carrying the
//! sender's stage and listening address and the peers it knows, so a node
//! can reach any peer the protocol names. A message to a peer not yet
//! connected waits (bounded) until the connection is up; a peer that cannot
//! be reached is lost to the protocol.
//!
//! Bulk messages (activations, gradients, bandwidth probes, state) are
//! followed by their data frame ([`super::bulk`]), so transfers take their
//! real time and the protocol measures real bandwidths. What this runtime
//! does not do yet (the real-swarm work builds on it): the frames carry no
//! tensor yet (their payload is as long as the tensor would be), the stage
//! all-reduce inside the aggregate task (`super::allreduce` exists), a real
//! state download. Its trainer interface therefore only runs tasks;
//! [`TimedTrainer`] takes the time a task would take, for tests of the
//! runtime itself.
use super::bulk::{self, Pairing};
use crate::engine::{EngineError, Event as NetEvent, Frame, Incoming, Node as Net, NodeOptions};
use crate::protocol::{codec, Action, Config, Event, Input, Msg, Node, NodeId, Stage, Task, Time};
use crate::wire::ControlEnvelope;
use crossbeam_channel::{unbounded, Receiver, Sender, TryRecvError};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `msg_type` of the runtime's directory message.
pub const DIRECTORY_MSG: u16 = 0x8000;
/// Peers one directory message carries at most.
const DIRECTORY_MAX: usize = 512;
/// Messages kept for a peer whose connection is being set up.
const PENDING_MAX: usize = 4096;
/// How long a joiner waits for its bootstrap peers' directories.
const JOIN_DIRECTORY_WAIT: Duration = Duration::from_secs(10);

/// Runs the protocol's tasks: forward, backward, loss, aggregate.
pub trait Trainer: Send + 'static {
    fn run(&mut self, task: &Task) -> Result<(), String>;
}

/// A trainer that only takes time: `per_task` for each compute task.
pub struct TimedTrainer {
    pub per_task: Duration,
}

impl Trainer for TimedTrainer {
    fn run(&mut self, task: &Task) -> Result<(), String> {
        if task.kind.is_compute() {
            std::thread::sleep(self.per_task);
        }
        Ok(())
    }
}

/// A swarm member as the directory knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub id: NodeId,
    pub stage: Stage,
    pub addr: SocketAddr,
}

/// How to start a node.
#[derive(Clone)]
pub struct RuntimeOptions {
    pub id: NodeId,
    /// 0 for a data holder, else the relay stage.
    pub stage: Stage,
    pub listen: SocketAddr,
    pub swarm_key: Vec<u8>,
    /// Peers to start from.
    pub bootstrap: Vec<Peer>,
    /// Join a running swarm (else: a founding member).
    pub join: bool,
    pub protocol: Arc<Config>,
    /// Compute time of one microbatch on this node (the protocol's first
    /// estimate; it measures the real one).
    pub compute_s: f64,
    /// Microbatches this node can hold.
    pub capacity: u32,
    pub seed: u64,
    /// Options of the engine (listen and key are taken from above).
    pub net: NodeOptions,
}

/// A running node. Dropping it stops it abruptly (as a crash would, but
/// for the engine's goodbye); [`Runtime::leave`] leaves gracefully.
pub struct Runtime {
    net: Arc<Net>,
    stop: Arc<AtomicBool>,
    leave: Sender<()>,
    events: Receiver<Event>,
    driver: Option<JoinHandle<()>>,
    trainer: Option<JoinHandle<()>>,
}

impl Runtime {
    pub fn start(opts: RuntimeOptions, mut trainer: impl Trainer) -> Result<Runtime, EngineError> {
        let net = Arc::new(Net::new(NodeOptions {
            listen: Some(opts.listen),
            swarm_key: opts.swarm_key.clone(),
            node_id: opts.id as u64,
            ..opts.net.clone()
        })?);
        let addr = net
            .local_addr()
            .ok_or_else(|| EngineError::InvalidArgument("the node does not listen".into()))?;
        let (tasks_tx, tasks_rx) = unbounded::<Task>();
        let (done_tx, done_rx) = unbounded::<(Task, Result<(), String>)>();
        let (events_tx, events) = unbounded();
        let (leave, leave_rx) = unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let trainer_thread = std::thread::Builder::new()
            .name(format!("gwtf-trainer-{:x}", opts.id))
            .spawn(move || {
                for task in tasks_rx {
                    let r = trainer.run(&task);
                    if done_tx.send((task, r)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| EngineError::InvalidArgument(format!("cannot start a thread: {e}")))?;
        let me = Peer {
            id: opts.id,
            stage: opts.stage,
            addr,
        };
        let mut driver = Driver {
            cfg: opts.protocol.clone(),
            pairing: Pairing::default(),
            node: Node::new(
                opts.protocol.clone(),
                opts.id,
                opts.stage,
                opts.compute_s,
                opts.capacity,
                opts.seed,
            ),
            net: net.clone(),
            start: Instant::now(),
            dir: opts.bootstrap.iter().map(|p| (p.id, p.clone())).collect(),
            me,
            pending: HashMap::new(),
            lost: VecDeque::new(),
            tasks_tx,
            done_rx,
            events_tx,
            leave_rx,
            stop: stop.clone(),
            busy: 0,
            joining: None,
        };
        let bootstrap: Vec<(NodeId, Stage)> = opts
            .bootstrap
            .iter()
            .filter(|p| p.id != opts.id)
            .map(|p| (p.id, p.stage))
            .collect();
        // A joiner first learns the swarm's directory from its bootstrap
        // peers: the protocol's join needs peers of every stage.
        let first = if opts.join {
            driver.joining = Some(Instant::now() + JOIN_DIRECTORY_WAIT);
            for p in &opts.bootstrap {
                let _ = net.connect(p.addr);
            }
            None
        } else {
            Some(Input::Start { peers: bootstrap })
        };
        let driver_thread = std::thread::Builder::new()
            .name(format!("gwtf-driver-{:x}", opts.id))
            .spawn(move || driver.run(first))
            .map_err(|e| EngineError::InvalidArgument(format!("cannot start a thread: {e}")))?;
        Ok(Runtime {
            net,
            stop,
            leave,
            events,
            driver: Some(driver_thread),
            trainer: Some(trainer_thread),
        })
    }

    /// The protocol's events, in order.
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// The engine's counters (frames and bytes moved, peers, pool).
    pub fn net_stats(&self) -> crate::engine::NodeStats {
        self.net.stats()
    }

    /// Where this node listens.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.net.local_addr()
    }

    /// Leaves gracefully (the protocol says goodbye) and waits until done.
    pub fn leave(mut self) {
        let _ = self.leave.send(());
        self.join_threads();
    }

    fn join_threads(&mut self) {
        if let Some(d) = self.driver.take() {
            let _ = d.join();
        }
        self.net.shutdown();
        if let Some(t) = self.trainer.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.join_threads();
    }
}

struct Driver {
    cfg: Arc<Config>,
    /// Bulk messages and data frames waiting for each other.
    pairing: Pairing<Frame>,
    node: Node,
    net: Arc<Net>,
    start: Instant,
    me: Peer,
    dir: BTreeMap<NodeId, Peer>,
    /// Messages for peers whose connection is being set up.
    pending: HashMap<NodeId, VecDeque<Msg>>,
    /// Peers found unreachable, to tell the protocol.
    lost: VecDeque<NodeId>,
    tasks_tx: Sender<Task>,
    done_rx: Receiver<(Task, Result<(), String>)>,
    events_tx: Sender<Event>,
    leave_rx: Receiver<()>,
    stop: Arc<AtomicBool>,
    /// Tasks handed to the trainer and not yet done.
    busy: usize,
    /// A joiner waiting for a directory, until this time.
    joining: Option<Instant>,
}

impl Driver {
    fn now(&self) -> Time {
        self.start.elapsed().as_micros() as Time
    }

    fn input(&mut self, input: Input) {
        let now = self.now();
        let actions = self.node.handle(now, input);
        self.perform(actions);
    }

    fn perform(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Send { to, msg } => self.send(to, msg),
                Action::Run(task) => {
                    self.busy += 1;
                    let _ = self.tasks_tx.send(task);
                }
                Action::Event(e) => {
                    let _ = self.events_tx.send(e);
                }
            }
        }
    }

    fn send(&mut self, to: NodeId, msg: Msg) {
        if let Some(q) = self.pending.get_mut(&to) {
            if q.len() < PENDING_MAX {
                q.push_back(msg);
            }
            return;
        }
        let env = match codec::encode(&msg) {
            Ok(env) => env,
            Err(e) => {
                self.log(format!("cannot encode {} for {to:x}: {e}", msg.name()));
                return;
            }
        };
        match self
            .net
            .send_control(to as u64, &env, Duration::from_secs(5))
        {
            Ok(()) if msg.is_bulk() => self.send_data(to, &msg),
            Ok(()) => {}
            Err(EngineError::NotFound(_)) => self.connect(to, msg),
            Err(e) => {
                self.log(format!("send to {to:x}: {e}"));
                self.lost.push_back(to);
            }
        }
    }

    /// The data frame after a bulk message (as long as its tensor would be).
    fn send_data(&mut self, to: NodeId, msg: &Msg) {
        let max = self.net.options().max_payload;
        let len = bulk::payload_len(msg, &self.cfg).min(max) as usize;
        let (microbatch, iteration) = bulk::header_fields(msg);
        let sent = self
            .net
            .alloc(len, Duration::from_secs(5))
            .and_then(|mut f| {
                f.header.stage = self.me.stage as u32;
                f.header.microbatch = microbatch;
                f.header.iteration = iteration;
                self.net.send(to as u64, f, Duration::from_secs(5))
            });
        if let Err(e) = sent {
            self.log(format!("data for {} to {to:x}: {e}", msg.name()));
        }
    }

    /// Opens a connection to `to` and keeps `first` until it is up.
    fn connect(&mut self, to: NodeId, first: Msg) {
        match self.dir.get(&to) {
            Some(p) => {
                if self.net.connect(p.addr).is_ok() {
                    self.pending.entry(to).or_default().push_back(first);
                } else {
                    self.lost.push_back(to);
                }
            }
            None => {
                self.log(format!("no address for {to:x}"));
                self.lost.push_back(to);
            }
        }
    }

    fn log(&self, line: String) {
        if self.net.options().log {
            eprintln!("gwtf node {:x}: {line}", self.me.id);
        }
    }

    fn directory_msg(&self) -> ControlEnvelope {
        let mut body = Vec::new();
        let entries: Vec<&Peer> = std::iter::once(&self.me)
            .chain(self.dir.values())
            .take(DIRECTORY_MAX)
            .collect();
        body.extend_from_slice(&(entries.len() as u16).to_le_bytes());
        for p in entries {
            body.extend_from_slice(&p.id.to_le_bytes());
            body.extend_from_slice(&p.stage.to_le_bytes());
            let a = p.addr.to_string();
            body.push(a.len() as u8);
            body.extend_from_slice(a.as_bytes());
        }
        ControlEnvelope {
            msg_type: DIRECTORY_MSG,
            msg_version: 1,
            body,
        }
    }

    fn on_directory(&mut self, from: NodeId, body: &[u8]) {
        match parse_directory(body) {
            Ok(peers) => {
                for p in peers {
                    if p.id != self.me.id {
                        self.dir.insert(p.id, p);
                    }
                }
                if self.joining.is_some() {
                    self.join_now();
                }
            }
            Err(e) => self.log(format!("bad directory from {from:x}: {e}")),
        }
    }

    /// Joins through every peer the directory knows.
    fn join_now(&mut self) {
        self.joining = None;
        let peers = self.dir.values().map(|p| (p.id, p.stage)).collect();
        self.input(Input::Join { peers });
    }

    fn on_net(&mut self, ev: NetEvent) {
        match ev {
            NetEvent::PeerConnected { peer, .. } => {
                let env = self.directory_msg();
                let _ = self.net.send_control(peer, &env, Duration::from_secs(5));
                let Ok(id) = NodeId::try_from(peer) else {
                    let _ = self.net.disconnect(peer);
                    return;
                };
                if let Some(q) = self.pending.remove(&id) {
                    for m in q {
                        self.send(id, m);
                    }
                }
            }
            NetEvent::PeerLost { peer, .. } => {
                if let Ok(id) = NodeId::try_from(peer) {
                    self.pending.remove(&id);
                    self.pairing.forget(id);
                    self.input(Input::PeerLost { peer: id });
                }
            }
            NetEvent::ConnectFailed { addr, .. } => {
                let ids: Vec<NodeId> = self
                    .dir
                    .values()
                    .filter(|p| p.addr == addr)
                    .map(|p| p.id)
                    .collect();
                for id in ids {
                    if self.pending.remove(&id).is_some() {
                        self.input(Input::PeerLost { peer: id });
                    }
                }
            }
            NetEvent::Control { peer, msg } => {
                let Ok(from) = NodeId::try_from(peer) else {
                    return;
                };
                if msg.msg_type == DIRECTORY_MSG {
                    self.on_directory(from, &msg.body);
                    return;
                }
                match codec::decode(&msg) {
                    Ok(m) if m.is_bulk() => {
                        let key = bulk::key_of_msg(from, &m);
                        if let Some((m, _data)) = self.pairing.on_msg(key, m) {
                            self.input(Input::Message { from, msg: m });
                        }
                    }
                    Ok(m) => self.input(Input::Message { from, msg: m }),
                    Err(e) => {
                        self.log(format!("refused a message from {from:x}: {e}"));
                        let _ = self.net.disconnect(peer);
                    }
                }
            }
            NetEvent::Refused { addr, reason, .. } => {
                self.log(format!("refused {addr}: {reason}"));
            }
        }
    }

    /// A data frame: the second half of a bulk message.
    fn on_frame(&mut self, f: Frame) {
        let Ok(from) = NodeId::try_from(f.peer()) else {
            return;
        };
        let key = bulk::key_of_frame(from, f.header.microbatch, f.header.iteration);
        if let Some((msg, _data)) = self.pairing.on_data(key, f) {
            self.input(Input::Message { from, msg });
        }
    }

    fn run(&mut self, first: Option<Input>) {
        if let Some(first) = first {
            self.input(first);
        }
        let mut leaving = false;
        while !self.stop.load(Ordering::SeqCst) {
            if self.joining.is_some_and(|t| Instant::now() >= t) {
                self.join_now();
            }
            while let Some(id) = self.lost.pop_front() {
                self.input(Input::PeerLost { peer: id });
            }
            if !leaving && self.leave_rx.try_recv().is_ok() {
                leaving = true;
                self.input(Input::Leave);
            }
            loop {
                match self.done_rx.try_recv() {
                    Ok((task, r)) => {
                        self.busy -= 1;
                        if let Err(e) = r {
                            self.log(format!("task {:?} failed: {e}", task.kind));
                        }
                        self.input(Input::TaskDone { id: task.id });
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            let now = self.now();
            if let Some(t) = self.node.timeout() {
                if t <= now {
                    let actions = self.node.on_timeout(now);
                    self.perform(actions);
                    continue;
                }
            }
            if leaving && !self.node.is_active() && self.busy == 0 {
                // Goodbyes are queued; the engine sends them at shutdown.
                return;
            }
            // Wait for the network, but not past the next timer, and look
            // at the trainer's completions often while it works.
            let until_timer = self.node.timeout().map_or(Duration::from_millis(20), |t| {
                Duration::from_micros(t.saturating_sub(now))
            });
            let cap = if self.busy > 0 { 1 } else { 20 };
            let wait = until_timer.min(Duration::from_millis(cap));
            let mut next = self.net.next_incoming(wait);
            while let Some(incoming) = next {
                match incoming {
                    Incoming::Event(ev) => self.on_net(ev),
                    Incoming::Frame(f) => self.on_frame(f),
                }
                next = self.net.next_incoming(Duration::ZERO);
            }
        }
    }
}

/// Parses a directory message: `count u16`, then per peer `id u32`,
/// `stage u16`, `addr_len u8`, `addr` (text).
pub fn parse_directory(mut body: &[u8]) -> Result<Vec<Peer>, String> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
        if b.len() < n {
            return Err("truncated".into());
        }
        let (head, rest) = b.split_at(n);
        *b = rest;
        Ok(head)
    }
    let count = u16::from_le_bytes(take(&mut body, 2)?.try_into().expect("2 bytes")) as usize;
    if count > DIRECTORY_MAX || count * 7 > body.len() {
        return Err(format!("{count} entries in {} bytes", body.len()));
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let id = u32::from_le_bytes(take(&mut body, 4)?.try_into().expect("4 bytes"));
        let stage = u16::from_le_bytes(take(&mut body, 2)?.try_into().expect("2 bytes"));
        let len = take(&mut body, 1)?[0] as usize;
        let text = std::str::from_utf8(take(&mut body, len)?).map_err(|_| "address is not text")?;
        let addr = text.parse().map_err(|_| format!("bad address {text:?}"))?;
        out.push(Peer { id, stage, addr });
    }
    if !body.is_empty() {
        return Err(format!("{} trailing bytes", body.len()));
    }
    Ok(out)
}
