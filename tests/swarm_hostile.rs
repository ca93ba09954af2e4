//! Bad input to swarm nodes: a node with the wrong swarm key, a stranger
//! (right key, never introduced) sending protocol messages and frames,
//! garbage, cut-off and flooding tensor frames, stage claims against the
//! swarm, and state servers that send a cut-off or corrupted state. Each is
//! refused with a logged reason (`NodeEvent::Refused`, counted by reason in
//! `Runtime::refused`), the honest nodes train on with every microbatch
//! counted exactly once per stage and replicas that agree, nothing panics,
//! and the node's memory (its frame pool) is not held by the garbage.
//!
//! The hostile parties are built from the project's own pieces: an engine
//! node with the right or a wrong key sending crafted control messages
//! (`protocol::codec`, the directory message) and data frames, and a raw
//! authenticated TCP stream for a frame cut in the middle.
mod common;

use common::swarm_inproc::{free_addr, model_protocol_config, peers_of, start_node, Seen};
use gwtf::engine::{Frame, NodeOptions, Transport, TransportEvent};
use gwtf::model::dataset::Dataset;
use gwtf::model::preset;
use gwtf::protocol::{codec, Config, MbId, Msg, NodeId, Stage, StageSummary};
use gwtf::swarm::bulk::header_fields;
use gwtf::swarm::directory::{self, DIRECTORY_MSG};
use gwtf::swarm::model_trainer::{reference_losses, ModelRun, ModelTrainer};
use gwtf::swarm::runtime::{
    parse_directory, realtime_config, Peer, Refusal, Runtime, TimedTrainer, Trainer,
};
use gwtf::swarm::work::{Output, Work, WorkKind, WorkPort};
use gwtf::wire::{encode_control_frame, FrameHeader, FrameKind, HEAD_LEN};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY: &[u8] = b"0123456789abcdef-hostile-swarm-key";
const WRONG_KEY: &[u8] = b"0123456789abcdef-some-other-swarm!";
const MB_PER_ITER: u32 = 4;
const ACT_BYTES: u64 = 64 << 10;
/// Generous: a swarm on a loaded 2-core machine.
const DEADLINE: Duration = Duration::from_secs(150);
const T: Duration = Duration::from_secs(10);
/// How long a node may take to cut a hostile peer off: it does so as the
/// refused frame or message arrives, but a node of a swarm test shares 2
/// cores with the other tests' swarms (10 s was once not enough in CI).
const CUT_OFF: Duration = Duration::from_secs(60);

fn trace() -> bool {
    std::env::var_os("GWTF_TEST_TRACE").is_some()
}

fn timed_config() -> Arc<Config> {
    let mut c = realtime_config(2, ACT_BYTES);
    c.mb_per_iter = MB_PER_ITER;
    c.max_in_flight = 2;
    Arc::new(c)
}

fn net_options() -> NodeOptions {
    NodeOptions {
        heartbeat_interval: Duration::from_millis(200),
        peer_timeout: Duration::from_secs(10),
        pool_bytes: 64 << 20,
        max_payload: 4 << 20,
        log: trace(),
        // These swarms choose their ids (1, 11, 12, ...), and so does the
        // hostile party: the insecure mode in which ids need not follow
        // from node keys (the binding is tested in transport_intake.rs).
        chosen_ids: true,
        ..NodeOptions::default()
    }
}

fn timed() -> TimedTrainer {
    TimedTrainer::new(Duration::from_millis(5))
}

/// An honest swarm in this process.
struct Swarm {
    cfg: Arc<Config>,
    peers: Vec<Peer>,
    nodes: Vec<(NodeId, Runtime)>,
    holders: usize,
    seen: Seen,
    deadline: Instant,
    /// Errors the test provokes on purpose (a part of their text).
    expected_errors: Vec<&'static str>,
}

impl Swarm {
    /// One holder and two relays in each of two stages, timed trainers.
    fn timed(layout: &[(NodeId, Stage)], net: impl Fn(NodeId) -> NodeOptions) -> Swarm {
        let cfg = timed_config();
        let peers = peers_of(layout);
        let nodes = peers
            .iter()
            .map(|p| {
                (
                    p.id,
                    start_node(p, &peers, &cfg, false, KEY, net(p.id), timed()),
                )
            })
            .collect();
        Swarm::of(cfg, peers, nodes)
    }

    fn of(cfg: Arc<Config>, peers: Vec<Peer>, nodes: Vec<(NodeId, Runtime)>) -> Swarm {
        let holders = peers.iter().filter(|p| p.stage == 0).count();
        Swarm {
            cfg,
            peers,
            nodes,
            holders,
            seen: Seen::default(),
            deadline: Instant::now() + DEADLINE,
            expected_errors: Vec::new(),
        }
    }

    fn node(&self, id: NodeId) -> &Runtime {
        &self.nodes.iter().find(|(n, _)| *n == id).unwrap().1
    }

    fn addr(&self, id: NodeId) -> SocketAddr {
        self.peers.iter().find(|p| p.id == id).unwrap().addr
    }

    /// Starts node `id` (timed trainer), joining through `contact`.
    fn join(&mut self, id: NodeId, contact: SocketAddr) {
        let me = Peer {
            id,
            stage: 0,
            addr: free_addr(),
        };
        let contact = Peer {
            id: 0,
            stage: 0,
            addr: contact,
        };
        let cfg = self.cfg.clone();
        let n = start_node(&me, &[contact], &cfg, true, KEY, net_options(), timed());
        self.nodes.push((id, n));
    }

    fn pump(&mut self) {
        for (id, n) in &self.nodes {
            while let Ok(ev) = n.events().try_recv() {
                self.seen.take(*id, ev);
            }
        }
    }

    /// Pumps events until `done`, failing at the deadline or on an error.
    /// The errors reported that the test did not provoke.
    fn unexpected_errors(&self) -> Vec<&String> {
        let expected = |e: &String| self.expected_errors.iter().any(|x| e.contains(x));
        self.seen.errors.iter().filter(|e| !expected(e)).collect()
    }

    fn until(&mut self, what: &str, mut done: impl FnMut(&Seen) -> bool) {
        loop {
            self.pump();
            let unexpected = self.unexpected_errors();
            assert!(unexpected.is_empty(), "{unexpected:?}");
            if done(&self.seen) {
                return;
            }
            assert!(
                Instant::now() < self.deadline,
                "timed out waiting for {what} ({} iterations final)",
                self.seen.losses.len()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until `node` refused at least `n` things for `reason`; checks
    /// that each of `want` is said of one of them; returns what was said.
    fn refused(&mut self, node: NodeId, reason: Refusal, n: usize, want: &[&str]) -> Vec<String> {
        self.until(&format!("{n} refusals ({})", reason.name()), |s| {
            s.refusals(node, reason).len() >= n
        });
        let said: Vec<String> = self
            .seen
            .refusals(node, reason)
            .into_iter()
            .map(String::from)
            .collect();
        for w in want {
            assert!(said.iter().any(|d| d.contains(w)), "{w:?} not in {said:?}");
        }
        assert!(self.node(node).refused().get(reason) >= n as u64);
        said
    }

    /// The frames the garbage held in `node`'s pool are back.
    fn pool_given_back(&self, node: NodeId) {
        let pool = self.node(node).net_stats().pool;
        assert!(pool.in_use_bytes <= 8 << 20, "{pool:?}");
    }

    fn iterations_done(&mut self, n: u32) {
        let holders = self.holders;
        self.until(&format!("{n} iterations"), |s| {
            (0..n).all(|k| s.losses.get(&k).is_some_and(|l| l.len() == holders))
        });
    }

    /// Every node leaves; the invariants of the run: no errors, every
    /// microbatch of every iteration counted exactly once per stage, and
    /// the replicas of each stage agree after every update.
    fn finish_and_check(mut self, iterations: u32) -> Seen {
        std::thread::sleep(Duration::from_millis(300));
        self.pump();
        for (_, n) in self.nodes.drain(..) {
            n.leave();
        }
        let unexpected = self.unexpected_errors();
        assert!(unexpected.is_empty(), "{unexpected:?}");
        let seen = self.seen;
        let want = self.holders * MB_PER_ITER as usize;
        for s in 0..=self.cfg.relay_stages {
            for k in 0..iterations {
                let mut got = seen.committed.get(&(s, k)).cloned().unwrap_or_default();
                let n = got.len();
                got.sort_unstable();
                got.dedup();
                assert_eq!((n, got.len()), (want, want), "stage {s} iteration {k}");
            }
        }
        for ((s, k), d) in &seen.digests {
            assert_eq!(d.len(), 1, "stage {s} iteration {k}: {} digests", d.len());
        }
        seen
    }
}

fn layout() -> Vec<(NodeId, Stage)> {
    vec![(1, 0), (11, 1), (12, 1), (21, 2), (22, 2)]
}

// ---- the hostile party

/// An engine node with `key`, listening on loopback.
fn hostile(id: NodeId, key: &[u8]) -> Transport {
    Transport::new(NodeOptions {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        swarm_key: key.to_vec(),
        node_id: id as u64,
        // The swarms here choose their ids (see `net_options`).
        chosen_ids: true,
        connect_attempts: 1,
        max_payload: 4 << 20,
        pool_bytes: 64 << 20,
        log: trace(),
        ..NodeOptions::default()
    })
    .unwrap()
}

fn connect(h: &Transport, addr: SocketAddr) -> u64 {
    h.connect_wait(addr, T).unwrap()
}

/// Introduces `h` to `peer` as a member of `stage`, with `others` as the
/// peers it claims to know.
fn introduce(h: &Transport, peer: u64, stage: Stage, others: &[Peer]) {
    let me = Peer {
        id: h.node_id() as NodeId,
        stage,
        addr: h.local_addr().unwrap(),
    };
    h.send_control(peer, &directory::message(&me, others.iter()), T)
        .unwrap();
}

fn send_msg(h: &Transport, peer: u64, msg: &Msg) -> bool {
    h.send_control(peer, &codec::encode(msg).unwrap(), T)
        .is_ok()
}

/// A data frame of `len` bytes of a pattern, with these header fields.
fn data_frame(h: &Transport, len: usize, (microbatch, iteration): (u64, u64), stage: u32) -> Frame {
    let mut f = h.alloc(len, T).unwrap();
    for (i, b) in f.payload_mut().iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    f.header.microbatch = microbatch;
    f.header.iteration = iteration;
    f.header.stage = stage;
    f
}

fn forward(mb: MbId, path: Vec<NodeId>) -> Msg {
    Msg::Forward {
        mb,
        attempt: 7,
        path: Arc::new(path),
        label: None,
        hint: None,
        need_grad: true,
        plan: None,
    }
}

/// Waits until `h`'s connection to `peer` is gone (the node cut it off).
fn wait_cut_off(h: &Transport, peer: u64) {
    let end = Instant::now() + CUT_OFF;
    while Instant::now() < end {
        if !h.peers().contains(&peer) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "node {peer:x} did not cut the hostile {:x} off",
        h.node_id()
    );
}

// ---- the cases

/// A node with the wrong swarm key tries to join (and an engine node with
/// it to connect): the swarm's nodes refuse the connections, say why, and
/// train on; the stranger never becomes active.
#[test]
fn a_node_with_the_wrong_swarm_key_is_refused() {
    let mut swarm = Swarm::timed(&layout(), |_| net_options());
    swarm.iterations_done(1);
    let wrong = Peer {
        id: 31,
        stage: 0,
        addr: free_addr(),
    };
    let bootstrap = vec![Peer {
        id: 0,
        stage: 0,
        addr: swarm.addr(1),
    }];
    let intruder = start_node(
        &wrong,
        &bootstrap,
        &swarm.cfg.clone(),
        true,
        WRONG_KEY,
        net_options(),
        timed(),
    );
    let raw = hostile(32, WRONG_KEY);
    assert!(raw.connect_wait(swarm.addr(11), T).is_err());
    for n in [1, 11] {
        let auth = ["authentication failed (wrong swarm key, or a replayed handshake)"];
        swarm.refused(n, Refusal::Connection, 1, &auth);
    }
    swarm.iterations_done(5);
    // The intruder knows it was turned away, and got nowhere.
    let mut intruder_seen = Seen::default();
    while let Ok(ev) = intruder.events().try_recv() {
        intruder_seen.take(31, ev);
    }
    assert!(intruder_seen.active.is_empty());
    assert!(intruder.refused().get(Refusal::Connection) >= 1);
    assert!(swarm.seen.paths.iter().all(|p| !p.contains(&31)));
    drop(intruder);
    swarm.finish_and_check(5);
}

/// A node with the right key that never introduced itself (no directory
/// message) sends protocol messages that would disturb the swarm if acted
/// upon (a forged update, an iteration start, an introduction as a relay, a
/// forward with its tensor): each node refuses them, says why, and cuts
/// the stranger off; the protocol never hears of it.
#[test]
fn a_stranger_s_messages_are_refused_and_it_is_cut_off() {
    let mut swarm = Swarm::timed(&layout(), |_| net_options());
    swarm.iterations_done(1);
    let s = hostile(77, KEY);
    let mb = MbId {
        holder: 1,
        iter: 2,
        idx: 0,
    };
    let messages = |target: NodeId| -> Vec<Msg> {
        match target {
            1 => vec![Msg::StartIter {
                iter: 40,
                holders: Arc::new(vec![77]),
            }],
            11 => vec![
                Msg::Introduce {
                    iter: 0,
                    stage: 1,
                    spare: 100,
                    compute_s: 1e-6,
                    sent_at: 0,
                    echo: None,
                },
                Msg::Applied {
                    iter: 1,
                    version: 99,
                },
            ],
            _ => vec![forward(mb, vec![1, 77])],
        }
    };
    for target in [1, 11, 21] {
        let peer = connect(&s, swarm.addr(target));
        for m in messages(target) {
            if !send_msg(&s, peer, &m) {
                break;
            }
            if m.is_bulk() {
                let f = data_frame(&s, ACT_BYTES as usize, header_fields(&m), 0);
                let _ = s.send(peer, f, T);
            }
        }
        wait_cut_off(&s, peer);
    }
    for (n, what) in [(1, "StartIter"), (11, "Introduce"), (21, "Forward")] {
        let said = format!("{what} from 4d, which is not in the swarm's directory");
        swarm.refused(n, Refusal::Stranger, 1, &[&said]);
    }
    swarm.iterations_done(6);
    let seen = swarm.finish_and_check(6);
    // Nobody took the stranger for a peer: never lost, never on a path.
    assert!(seen.lost.iter().all(|(_, p)| *p != 77), "{:?}", seen.lost);
    assert!(seen.paths.iter().all(|p| !p.contains(&77)));
}

/// A member that is not a data holder (introduced as a relay of stage 2)
/// asks a relay for a copy of its stage's state, which only holders keep:
/// the relay refuses it, says why, sends no state, and training goes on.
#[test]
fn a_copy_request_from_a_relay_is_refused() {
    let mut swarm = Swarm::timed(&layout(), |_| net_options());
    swarm.iterations_done(1);
    let h = hostile(31, KEY);
    let p = connect(&h, swarm.addr(11));
    introduce(&h, p, 2, &[]);
    assert!(send_msg(&h, p, &Msg::CopyRequest { iteration: 0 }));
    swarm.refused(
        11,
        Refusal::Message,
        1,
        &["copy request from 1f, which is not a data holder"],
    );
    swarm.iterations_done(3);
    assert!(
        h.recv(Duration::from_millis(200)).is_err(),
        "a state was sent to a relay that asked for a copy"
    );
    swarm.finish_and_check(3);
}

/// Tensor frames that are not what they say, sent to a relay by members of
/// the swarm (introduced with a directory message): a tensor shorter than
/// the swarm's activations, a frame of a message kind that carries no data,
/// another stage's all-reduce chunk, and a frame cut off in the middle by a
/// peer that then dies. Each is refused (the first three with their reason,
/// the sender cut off; the cut frame by the engine), no trainer sees them,
/// the relay's pool is given back, and the swarm trains on.
#[test]
fn garbage_and_cut_off_tensor_frames_are_refused() {
    let mut swarm = Swarm::timed(&layout(), |_| net_options());
    swarm.iterations_done(1);
    let relay = swarm.addr(21);
    let mb = MbId {
        holder: 1,
        iter: 1,
        idx: 0,
    };
    // A truncated tensor, with its message.
    let short = hostile(41, KEY);
    let p = connect(&short, relay);
    introduce(&short, p, 1, &[]);
    let m = forward(mb, vec![1, 41]);
    assert!(send_msg(&short, p, &m));
    let _ = short.send(
        p,
        data_frame(&short, ACT_BYTES as usize / 2, header_fields(&m), 0),
        T,
    );
    wait_cut_off(&short, p);
    // Garbage: a data frame of a kind without data (Ack), then another
    // stage's all-reduce chunk.
    let garbage = hostile(42, KEY);
    let p = connect(&garbage, relay);
    introduce(&garbage, p, 1, &[]);
    let _ = garbage.send(p, data_frame(&garbage, 4096, (5, 21 << 32), 0), T);
    wait_cut_off(&garbage, p);
    let chunk = hostile(43, KEY);
    let p = connect(&chunk, relay);
    introduce(&chunk, p, 1, &[]);
    let _ = chunk.send(p, data_frame(&chunk, 4096, (5, 1), 1), T);
    wait_cut_off(&chunk, p);
    // A frame cut in the middle, by a peer that dies.
    let mut raw = common::raw_authenticated(relay, 44, KEY, T);
    let dir = directory::message(
        &Peer {
            id: 44,
            stage: 1,
            addr: free_addr(),
        },
        [].iter(),
    );
    raw.send(&encode_control_frame(
        FrameKind::Control,
        44,
        &dir.encode().unwrap(),
    ))
    .unwrap();
    let m = forward(MbId { idx: 1, ..mb }, vec![1, 44]);
    let env = codec::encode(&m).unwrap();
    raw.send(&encode_control_frame(
        FrameKind::Control,
        44,
        &env.encode().unwrap(),
    ))
    .unwrap();
    let mut h = FrameHeader::data();
    h.sender = 44;
    h.payload_len = ACT_BYTES;
    (h.microbatch, h.iteration) = header_fields(&m);
    let mut frame = h.encode().to_vec();
    frame.extend(vec![1u8; ACT_BYTES as usize]);
    raw.send_prefix(&frame, HEAD_LEN + ACT_BYTES as usize / 3)
        .unwrap();
    drop(raw);

    let said = swarm.refused(
        21,
        Refusal::Frame,
        3,
        &[
            "a tensor of 32768 bytes (this node takes 65536 bytes at its stage's boundary) from 29",
            "a data frame of message kind 21, which carries no data from 2a",
            "an all-reduce frame of stage 1 (this node serves stage 2) from 2b",
        ],
    );
    assert_eq!(said.len(), 3, "{said:?}");
    swarm.iterations_done(6);
    swarm.pool_given_back(21);
    let seen = swarm.finish_and_check(6);
    for h in 41..=44 {
        assert!(seen.paths.iter().all(|p| !p.contains(&h)));
    }
}

/// A member floods a relay with frames that wait for messages that never
/// come: the relay keeps at most a few waiting (limits checked before
/// keeping), refuses the rest and cuts the flooder off, each time. Another
/// floods it with all-reduce chunks of the relay's stage for an operation
/// that never starts: the relay keeps no more of them than a quarter of
/// its pool. It trains on with a small pool that either flood, kept, would
/// fill.
#[test]
fn a_flood_of_frames_does_not_hold_the_pool() {
    // The relay's pool: 16 MiB; the flood below is 4 times that.
    let small = |id: NodeId| NodeOptions {
        pool_bytes: if id == 21 { 16 << 20 } else { 64 << 20 },
        max_payload: 1 << 20,
        ..net_options()
    };
    let mut swarm = Swarm::timed(&layout(), small);
    swarm.iterations_done(1);
    let relay = swarm.addr(21);
    let mut sent = 0u64;
    for round in 0..4u32 {
        let f = hostile(50 + round, KEY);
        let p = connect(&f, relay);
        introduce(&f, p, 1, &[]);
        // Tensors of the right size for microbatches nobody sent.
        for i in 0..256u32 {
            let m = forward(
                MbId {
                    holder: 1,
                    iter: 1000 + round,
                    idx: i,
                },
                vec![1],
            );
            let frame = data_frame(&f, ACT_BYTES as usize, header_fields(&m), 0);
            if f.send(p, frame, Duration::from_secs(2)).is_err() {
                break;
            }
            sent += ACT_BYTES;
        }
        wait_cut_off(&f, p);
    }
    assert!(sent >= 4 * (32 + 1) * ACT_BYTES, "{sent}");
    let flood = ["32 of its frames wait for their messages already"];
    swarm.refused(21, Refusal::Flood, 4, &flood);
    // 16 MiB of early chunks (step 1 of an operation nobody runs).
    let chunks = hostile(60, KEY);
    let p = connect(&chunks, relay);
    introduce(&chunks, p, 2, &[]);
    for _ in 0..64 {
        let f = data_frame(&chunks, 256 << 10, (0xdead_beef, 1), 2);
        chunks.send(p, f, T).unwrap();
    }
    swarm.iterations_done(6);
    let pool = swarm.node(21).net_stats().pool;
    eprintln!("relay pool after the floods: {pool:?}");
    assert!(pool.in_use_bytes <= (16 << 20) / 4 + (4 << 20), "{pool:?}");
    swarm.finish_and_check(6);
}

/// Stage claims against the swarm: a member announces itself in a stage
/// the swarm does not have, and claims that a member of the relay's own
/// stage serves another stage (at its own address); another sends an
/// introduction in a stage that does not exist. The relay refuses each
/// claim with its reason, passes none of them on (its directory still
/// names its stage peer where it is), and a node that joins through it
/// becomes active in a real stage; the swarm trains on.
#[test]
fn stage_claims_against_the_swarm_are_refused() {
    let mut swarm = Swarm::timed(&layout(), |_| net_options());
    swarm.iterations_done(1);
    let relay = swarm.addr(11);
    let liar = hostile(5, KEY);
    let p = connect(&liar, relay);
    let fake_12 = Peer {
        id: 12,
        stage: 2,
        addr: liar.local_addr().unwrap(),
    };
    introduce(&liar, p, 7, &[fake_12]);
    let other = hostile(6, KEY);
    let q = connect(&other, relay);
    introduce(&other, q, 2, &[]);
    assert!(send_msg(
        &other,
        q,
        &Msg::Introduce {
            iter: 0,
            stage: 9,
            spare: 1,
            compute_s: 0.01,
            sent_at: 0,
            echo: None,
        }
    ));
    swarm.refused(
        11,
        Refusal::Stage,
        3,
        &[
            "a directory entry from 5: node 5 claims stage 7; this swarm's stages are 0 to 2",
            "a directory entry from 5: node c claims stage 2, but it is a member of this node's stage 1",
            "Introduce: node 6 claims stage 9; this swarm's stages are 0 to 2",
        ],
    );
    // What the relay tells a newcomer: its stage peer where it is, no
    // stage 7 or 9.
    let probe = hostile(7, KEY);
    let p = connect(&probe, relay);
    let dir = loop {
        match probe.poll_event(T) {
            Some(TransportEvent::Control { peer, msg })
                if peer == p && msg.msg_type == DIRECTORY_MSG =>
            {
                break parse_directory(&msg.body).unwrap()
            }
            Some(_) => {}
            None => panic!("no directory from the relay"),
        }
    };
    let twelve = dir.iter().find(|e| e.id == 12).unwrap();
    assert_eq!((twelve.stage, twelve.addr), (1, swarm.addr(12)), "{dir:?}");
    assert!(dir.iter().all(|e| e.stage <= 2), "{dir:?}");
    assert!(dir.iter().all(|e| e.id != 5), "{dir:?}");
    // A joiner through the relay picks a real stage and trains.
    swarm.join(31, relay);
    swarm.until("the joiner's first update", |s| s.applied(31));
    assert!(
        matches!(swarm.seen.active.get(&31), Some(1 | 2)),
        "{:?}",
        swarm.seen.active
    );
    swarm.iterations_done(6);
    drop((liar, other, probe));
    swarm.finish_and_check(6);
}

/// A trainer whose gradient answers go wrong on purpose: the answers
/// (counted from 0) in `fail` are failures, those in `short` are one float
/// short.
struct FaultyGradients {
    inner: TimedTrainer,
    answers: u32,
    fail: &'static [u32],
    short: &'static [u32],
}

impl Trainer for FaultyGradients {
    fn run(&mut self, work: Work, port: &WorkPort) -> Result<Output, String> {
        let gradient = matches!(work.kind, WorkKind::Gradient { .. });
        let mut out = self.inner.run(work, port)?;
        if gradient {
            let n = self.answers;
            self.answers += 1;
            if self.fail.contains(&n) {
                return Err("this gradient fails on purpose".into());
            }
            if let (true, Output::Gradient { sum, .. }) = (self.short.contains(&n), &mut out) {
                sum.pop();
            }
        }
        Ok(out)
    }
}

/// Gradient answers that cannot be all-reduced, with every member alive: a
/// relay's trainer fails its second gradient; another answers its first
/// (before its stage's members ever agreed on a length: the ring fails on
/// the chunk sizes) and its fifth (after: refused at once) one float
/// short. Each time the stage's coordinator commits again, the trainer is
/// asked again, and training goes on with every microbatch counted once
/// and replicas that agree; without that the stage would wait for its
/// apply forever.
#[test]
fn a_gradient_that_cannot_be_all_reduced_is_committed_again() {
    let cfg = timed_config();
    let peers = peers_of(&layout());
    let nodes = peers
        .iter()
        .map(|p| {
            let (fail, short): (&'static [u32], &'static [u32]) = match p.id {
                12 => (&[1], &[]),
                22 => (&[], &[0, 4]),
                _ => (&[], &[]),
            };
            let trainer = FaultyGradients {
                inner: timed(),
                answers: 0,
                fail,
                short,
            };
            let n = start_node(p, &peers, &cfg, false, KEY, net_options(), trainer);
            (p.id, n)
        })
        .collect();
    let mut swarm = Swarm::of(cfg, peers, nodes);
    swarm.expected_errors = vec![
        "c: the trainer failed gradient: this gradient fails on purpose",
        "16: the trainer failed gradient: a gradient of 15 floats; the stage's all-reduce sums 16",
    ];
    swarm.iterations_done(7);
    let seen = swarm.finish_and_check(7);
    assert_eq!(seen.errors.len(), 2, "{:?}", seen.errors);
    // Three commits failed: stage 1 once (node 12's failure), stage 2
    // twice (the short sum, then its refusal).
    let failed: Vec<(Stage, u32)> = seen.aggregate_failed.iter().map(|f| (f.0, f.1)).collect();
    assert_eq!(
        failed.iter().filter(|f| f.0 == 1).count(),
        1,
        "{:?}",
        seen.aggregate_failed
    );
    assert_eq!(
        failed.iter().filter(|f| f.0 == 2).count(),
        2,
        "{:?}",
        seen.aggregate_failed
    );
}

/// Serves state downloads badly: answers the first state request with a
/// state cut off (fewer bytes than its message says) and then stays
/// connected and silent (`cut`), or with a state whose SHA-256 does not
/// match and then dies once cut off. Poses as its stage's bottleneck
/// member to joiners that ask. Returns the node if it is to live on.
fn bad_state_server(h: Transport, cut: bool) -> std::thread::JoinHandle<Option<Transport>> {
    std::thread::spawn(move || {
        let end = Instant::now() + DEADLINE;
        while Instant::now() < end {
            let Some(TransportEvent::Control { peer, msg }) =
                h.poll_event(Duration::from_millis(100))
            else {
                continue;
            };
            match codec::decode(&msg) {
                Ok(Msg::StageQuery) => {
                    let summary = StageSummary {
                        stage: 2,
                        members: 1,
                        throughput: 1.0,
                        open_iter: 0,
                        empty_neighbors: Vec::new(),
                    };
                    let _ = send_msg(&h, peer, &Msg::StageInfo { summary });
                    continue;
                }
                Ok(Msg::StateRequest) => {}
                _ => continue,
            }
            let (announced, sent) = if cut { (96, 40) } else { (64, 64) };
            let m = Msg::StateResponse {
                version: (0, 0),
                members: Arc::new(vec![21]),
                bytes: announced,
                coord: 21,
            };
            let _ = send_msg(&h, peer, &m);
            let _ = h.send(peer, data_frame(&h, sent, header_fields(&m), 2), T);
            wait_cut_off(&h, peer);
            return cut.then_some(h);
        }
        panic!("no state request came")
    })
}

/// A joiner's stage (2, the bottleneck) has two bad state servers besides
/// its honest member: the first the joiner asks sends a cut-off state, the
/// second a corrupted one and dies. The joiner refuses both, saying why,
/// takes the state from the honest member, and trains on with replicas
/// that agree.
#[test]
fn cut_off_and_corrupted_state_downloads_are_refused() {
    let mut swarm = Swarm::timed(&[(1, 0), (11, 1), (12, 1), (21, 2)], |_| net_options());
    swarm.iterations_done(1);
    // The bad servers (ids below the honest member's: asked first) tell
    // the holder they serve stage 2; the holder's directory passes that on.
    let mut servers = Vec::new();
    for (id, cut) in [(19, true), (20, false)] {
        let h = hostile(id, KEY);
        let p = connect(&h, swarm.addr(1));
        introduce(&h, p, 2, &[]);
        servers.push(bad_state_server(h, cut));
    }
    // The joiner learns the swarm from the holder's directory: join once it
    // names both bad servers (else the joiner may never hear of one).
    let holder = swarm.addr(1);
    let knows_both = |attempt: u64| {
        let probe = hostile(40 + attempt as NodeId, KEY);
        let p = connect(&probe, holder);
        let until = Instant::now() + T;
        while Instant::now() < until {
            if let Some(TransportEvent::Control { peer, msg }) = probe.poll_event(T) {
                if peer == p && msg.msg_type == DIRECTORY_MSG {
                    let dir = parse_directory(&msg.body).unwrap();
                    return [19, 20].iter().all(|id| dir.iter().any(|e| e.id == *id));
                }
            }
        }
        false
    };
    let mut attempt = 0;
    while !knows_both(attempt) {
        attempt += 1;
        assert!(attempt < 50, "the holder never named both bad servers");
        std::thread::sleep(Duration::from_millis(20));
    }
    swarm.join(31, swarm.addr(1));
    swarm.until("the joiner's download", |s| !s.downloads.is_empty());
    // Every state the joiner took in came from the honest member (a second
    // download happens when it joined while an update ran: it missed it).
    assert!(
        swarm.seen.downloads.iter().all(|d| *d == (31, 21)),
        "{:?}",
        swarm.seen.downloads
    );
    let said = swarm.refused(
        31,
        Refusal::State,
        2,
        &[
            "the state from 13: cut off: 40 of the 96 bytes announced",
            "the state from 14: its SHA-256 does not match (cut or corrupted)",
        ],
    );
    assert_eq!(said.len(), 2, "{said:?}");
    assert_eq!(swarm.seen.active.get(&31), Some(&2));
    swarm.until("the joiner's first update", |s| s.applied(31));
    swarm.iterations_done(6);
    swarm.finish_and_check(6);
    let silent: Vec<Option<Transport>> = servers.into_iter().map(|s| s.join().unwrap()).collect();
    assert!(silent[0].is_some() && silent[1].is_none());
}

// ---- with the model: the losses are still the reference's

const MODEL_ITERATIONS: u32 = 4;

fn model_run() -> ModelRun {
    ModelRun::new(
        preset("llama-tiny").unwrap(),
        4,
        7,
        MODEL_ITERATIONS as usize,
    )
    .unwrap()
}

fn docs() -> Vec<Vec<u32>> {
    Dataset::synthetic(3, 16 << 10, 16).train
}

/// Wrong-size and garbage tensors sent to every relay of a swarm that
/// trains libgwtf's model: refused, and the losses of every iteration are
/// still the single-process reference's (nothing reached a trainer).
#[test]
fn refused_tensors_leave_the_model_s_losses_equal_to_the_reference() {
    let run = model_run();
    let cfg = model_protocol_config(&run, MB_PER_ITER);
    let act = cfg.activation_bytes as usize;
    let peers = peers_of(&[(1, 0), (11, 1), (12, 1), (21, 2), (22, 2)]);
    let net = NodeOptions {
        pool_bytes: 64 << 20,
        max_payload: 16 << 20,
        ..net_options()
    };
    let nodes = peers
        .iter()
        .map(|p| {
            let t = ModelTrainer::new(run.clone(), p.stage, docs()).unwrap();
            (
                p.id,
                start_node(p, &peers, &cfg, false, KEY, net.clone(), t),
            )
        })
        .collect();
    let mut swarm = Swarm::of(cfg.clone(), peers, nodes);
    swarm.iterations_done(1);
    let mut id = 60;
    for target in [11, 12, 21, 22] {
        for len in [act - 4, act + 4] {
            id += 1;
            let h = hostile(id, KEY);
            let p = connect(&h, swarm.addr(target));
            introduce(&h, p, target as Stage / 10 - 1, &[]);
            let mb = MbId {
                holder: 1,
                iter: 2,
                idx: 1,
            };
            let m = if len < act {
                forward(mb, vec![1, id])
            } else {
                Msg::Backward {
                    mb,
                    attempt: 7,
                    path: Arc::new(vec![1, target, id]),
                }
            };
            assert!(send_msg(&h, p, &m));
            let _ = h.send(p, data_frame(&h, len, header_fields(&m), 0), T);
            wait_cut_off(&h, p);
        }
    }
    for n in [11, 12, 21, 22] {
        let said = swarm.refused(
            n,
            Refusal::Frame,
            2,
            &[&format!("a tensor of {} bytes", act - 4)],
        );
        assert!(
            said[1].contains(&format!("a tensor of {} bytes", act + 4)),
            "{said:?}"
        );
    }
    swarm.iterations_done(MODEL_ITERATIONS);
    let seen = swarm.finish_and_check(MODEL_ITERATIONS);
    let docs = docs();
    let holders: Vec<(NodeId, &[Vec<u32>])> = vec![(1, &docs[..])];
    let want = reference_losses(&run, &holders, MB_PER_ITER, MODEL_ITERATIONS, |_, _| {}).unwrap();
    for (k, w) in want.iter().enumerate() {
        let got = seen.losses[&(k as u32)][0];
        assert!(
            (got - w).abs() <= 1e-4 * w.abs(),
            "iteration {k}: swarm {got} reference {w}"
        );
    }
}
