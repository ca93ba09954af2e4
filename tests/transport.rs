//! The transport across processes over 127.0.0.1: frames of 0 B to 256 MiB
//! through a `gwtf echo` process, 64 peers at once, a peer killed mid-frame,
//! hostile byte streams and dead peers. Deadlines are generous and every loop
//! is bounded.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gwtf::engine::{CloseReason, NodeOptions, Transport, TransportEvent};
use gwtf::wire::{crc32c, Connection, FrameHeader, Role, SwarmKey, WireError, FLAG_PAYLOAD_CRC};

const KEY: &[u8] = b"transport-test-swarm-key-0123456";
const T: Duration = Duration::from_secs(60);

struct Echo {
    child: Child,
    addr: SocketAddr,
}

impl Echo {
    fn start(name: &str, extra: &[&str]) -> Echo {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("swarm.key");
        std::fs::write(&key, KEY).unwrap();
        let mut child = Command::new(common::gwtf_exe())
            .args(["echo", "--listen", "127.0.0.1:0", "--swarm-key-file"])
            .arg(&key)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .split_whitespace()
            .nth(4)
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .parse()
            .unwrap();
        Echo { child, addr }
    }

    /// SIGTERM, wait, and return what it logged.
    fn stop(mut self) -> String {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + T;
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "echo did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut err = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        err
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn opts(max_payload: u64, pool: usize) -> NodeOptions {
    NodeOptions {
        listen: None,
        swarm_key: KEY.to_vec(),
        max_payload,
        pool_bytes: pool,
        ..NodeOptions::default()
    }
}

fn pattern(seed: u64, buf: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

fn wait_event(
    node: &Transport,
    what: &str,
    pred: impl Fn(&TransportEvent) -> bool,
) -> TransportEvent {
    let deadline = Instant::now() + T;
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        if let Some(ev) = node.poll_event(Duration::from_millis(50)) {
            if pred(&ev) {
                return ev;
            }
            seen.push(ev);
        }
    }
    panic!("no {what} event within {T:?}; saw {seen:?}");
}

#[test]
fn frames_from_0_bytes_to_256_mib_roundtrip_through_an_echo_process() {
    let echo = Echo::start("echo-sizes", &[]);
    let node = Transport::new(opts(256 << 20, 600 << 20)).unwrap();
    let peer = node.connect_wait(echo.addr, T).unwrap();
    let sizes = [
        0usize,
        1,
        7,
        4095,
        4096,
        65536,
        (1 << 20) + 3,
        16 << 20,
        256 << 20,
    ];
    for (i, &n) in sizes.iter().enumerate() {
        let mut f = node.alloc(n, T).unwrap();
        pattern(i as u64, f.payload_mut());
        f.header.microbatch = i as u64;
        f.header.iteration = 42;
        node.send(peer, f, T).unwrap();
        let r = node.recv(T).unwrap();
        assert_eq!(
            (r.header.microbatch, r.header.iteration, r.len()),
            (i as u64, 42, n)
        );
        assert_eq!(r.header.sender, peer, "the echo re-sends as itself");
        let mut want = vec![0u8; n];
        pattern(i as u64, &mut want);
        assert!(r.payload() == &want[..], "payload of {n} bytes differs");
    }
    let s = node.stats();
    assert_eq!(s.user_copies, 0);
    assert_eq!(s.frames_received, sizes.len() as u64);
    assert_eq!(s.pool.in_use_bytes, 0);
    let log = echo.stop();
    assert!(log.contains("0 user-space copies"), "{log}");
}

#[test]
fn sixty_four_peers_at_once() {
    let echo = Echo::start("echo-64", &[]);
    let nodes: Vec<Transport> = (0..64)
        .map(|_| Transport::new(opts(1 << 20, 4 << 20)).unwrap())
        .collect();
    std::thread::scope(|s| {
        for (k, node) in nodes.iter().enumerate() {
            let addr = echo.addr;
            s.spawn(move || {
                let peer = node.connect_wait(addr, T).unwrap();
                for i in 0..4u64 {
                    let n = 1000 + (k * 4099 + i as usize * 65537) % (1 << 20);
                    let mut f = node.alloc(n, T).unwrap();
                    pattern(k as u64 * 100 + i, f.payload_mut());
                    f.header.microbatch = i;
                    node.send(peer, f, T).unwrap();
                }
                for i in 0..4u64 {
                    let r = node.recv(T).unwrap();
                    assert_eq!(r.header.microbatch, i);
                    let mut want = vec![0u8; r.len()];
                    pattern(k as u64 * 100 + i, &mut want);
                    assert!(r.payload() == &want[..]);
                }
            });
        }
    });
    for n in &nodes {
        assert_eq!(n.stats().pool.in_use_bytes, 0);
    }
    drop(nodes);
    let log = echo.stop();
    assert_eq!(log.matches("connected from").count(), 64, "{log}");
}

#[test]
fn peer_killed_mid_frame_is_reported_lost_without_leak_or_hang() {
    // The echo sends back at 2 MB/s, so its reply is mid-frame when it dies.
    let echo = Echo::start("echo-kill", &["--link-bandwidth", "2000000"]);
    let node = Transport::new(NodeOptions {
        peer_timeout: Duration::from_secs(30),
        ..opts(32 << 20, 128 << 20)
    })
    .unwrap();
    let peer = node.connect_wait(echo.addr, T).unwrap();
    let mut f = node.alloc(16 << 20, T).unwrap();
    pattern(1, f.payload_mut());
    node.send(peer, f, T).unwrap();
    let deadline = Instant::now() + T;
    while node.stats().wire_bytes_received < (1 << 20) {
        assert!(Instant::now() < deadline, "echo never started replying");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        node.stats().pool.in_use_bytes >= 16 << 20,
        "the reply's slot is leased"
    );
    let mut echo = echo;
    echo.child.kill().unwrap(); // SIGKILL
    let t0 = Instant::now();
    let ev = wait_event(&node, "peer lost", |e| {
        matches!(e, TransportEvent::PeerLost { .. })
    });
    let TransportEvent::PeerLost {
        peer: p, reason, ..
    } = ev
    else {
        unreachable!()
    };
    assert_eq!(p, peer);
    assert!(
        matches!(
            reason,
            CloseReason::Eof {
                mid_frame: true,
                ..
            } | CloseReason::Io(_)
        ),
        "{reason}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t0.elapsed()
    );
    // No partial frame is delivered, the slot came back, the node still works.
    assert!(node.recv(Duration::from_millis(200)).is_err());
    assert_eq!(node.stats().pool.in_use_bytes, 0);
    assert!(node.peers().is_empty());
}

#[test]
fn echo_logs_refused_connections_with_their_reason() {
    let echo = Echo::start("echo-refuse", &["--handshake-timeout-ms", "500"]);
    let mut s = TcpStream::connect(echo.addr).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n________________________")
        .unwrap();
    let bad = Transport::new(NodeOptions {
        swarm_key: b"not-the-swarm-key-at-all-000000".to_vec(),
        connect_attempts: 1,
        ..opts(1 << 20, 2 << 20)
    })
    .unwrap();
    assert!(bad.connect_wait(echo.addr, T).is_err());
    let _silent = TcpStream::connect(echo.addr).unwrap();
    // A good peer is still served.
    let good = Transport::new(opts(1 << 20, 2 << 20)).unwrap();
    let peer = good.connect_wait(echo.addr, T).unwrap();
    let f = good.alloc_copy(b"still served", T).unwrap();
    good.send(peer, f, T).unwrap();
    assert_eq!(good.recv(T).unwrap().payload(), b"still served");
    std::thread::sleep(Duration::from_millis(1500));
    let log = echo.stop();
    assert!(
        log.contains("refused inbound connection") && log.contains("bad magic"),
        "{log}"
    );
    assert!(log.contains("authentication failed"), "{log}");
    assert!(log.contains("handshake deadline passed"), "{log}");
}

// ------------------------------------------------------------ hostile streams

fn server() -> Transport {
    Transport::new(server_opts()).unwrap()
}

fn server_opts() -> NodeOptions {
    NodeOptions {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        handshake_timeout: Duration::from_millis(800),
        frame_timeout: Duration::from_millis(800),
        heartbeat_interval: Duration::from_millis(200),
        peer_timeout: Duration::from_millis(1500),
        log: true,
        // The raw peers here claim fixed ids (the binding of ids to keys
        // is tested in transport_intake.rs).
        chosen_ids: true,
        ..opts(1 << 20, 8 << 20)
    }
}

/// Authenticates a raw socket the honest way; returns the raw peer.
fn raw_authenticated(addr: SocketAddr, id: u64) -> common::RawPeer {
    common::raw_authenticated(addr, id, KEY, T)
}

fn header(len: u64) -> FrameHeader {
    let mut h = FrameHeader::data();
    h.sender = 1;
    h.payload_len = len;
    h
}

fn reason_for(server: &Transport, inbound_refused: bool) -> CloseReason {
    match wait_event(server, "close", |e| {
        if inbound_refused {
            matches!(e, TransportEvent::Refused { .. })
        } else {
            matches!(e, TransportEvent::PeerLost { .. })
        }
    }) {
        TransportEvent::Refused { reason, .. } | TransportEvent::PeerLost { reason, .. } => reason,
        _ => unreachable!(),
    }
}

#[test]
fn hostile_streams_are_closed_with_a_reason_while_others_are_served() {
    let srv = server();
    let addr = srv.local_addr().unwrap();
    // An honest peer keeps exchanging frames the whole time.
    let honest = Transport::new(opts(1 << 20, 8 << 20)).unwrap();
    let honest_id = honest.connect_wait(addr, T).unwrap();
    let _ = wait_event(&srv, "honest connect", |e| {
        matches!(e, TransportEvent::PeerConnected { .. })
    });
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let mut f = honest.alloc(100_000, T).unwrap();
                pattern(i, f.payload_mut());
                honest.send(honest_id, f, T).unwrap();
                let r = srv.recv(T).unwrap();
                let mut want = vec![0u8; 100_000];
                pattern(i, &mut want);
                assert!(r.payload() == &want[..]);
                i += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let check = |what: &str, refused: bool, pred: &dyn Fn(&CloseReason) -> bool| {
            let r = reason_for(&srv, refused);
            assert!(pred(&r), "{what}: unexpected reason {r:?}");
        };

        // Garbage before the handshake.
        let mut g = TcpStream::connect(addr).unwrap();
        g.write_all(&[0x55; 64]).unwrap();
        check("garbage", true, &|r| {
            matches!(r, CloseReason::Protocol(WireError::BadMagic { .. }))
        });
        // A hello of another version.
        let mut v = TcpStream::connect(addr).unwrap();
        let mut hello = gwtf::wire::handshake::Preamble {
            role: Role::Connector,
        }
        .encode();
        hello[4] = 1;
        v.write_all(&hello).unwrap();
        check("hello version", true, &|r| {
            matches!(
                r,
                CloseReason::Protocol(WireError::UnsupportedVersion { .. })
            )
        });
        // A wrong key.
        let bad = Transport::new(NodeOptions {
            swarm_key: b"wrong-key-wrong-key-wrong-key-00".to_vec(),
            connect_attempts: 1,
            ..opts(1 << 20, 2 << 20)
        })
        .unwrap();
        // The dialling side is told why, too.
        let e = bad.connect_wait(addr, T).unwrap_err().to_string();
        assert!(e.contains("swarm key differs"), "{e}");
        check("wrong key", true, &|r| {
            *r == CloseReason::Protocol(WireError::AuthFailed)
        });
        // A replayed handshake: record one, replay it on a new connection.
        let mut rec = TcpStream::connect(addr).unwrap();
        let mut c = Connection::new(
            Role::Connector,
            77,
            &SwarmKey::new(KEY).unwrap(),
            &gwtf::wire::NodeKey::generate().unwrap(),
            &gwtf::wire::ConnOptions::new(1 << 20),
        );
        let mut sent = c.take_outgoing();
        rec.write_all(&sent).unwrap();
        let mut srv_hello =
            [0u8; gwtf::wire::handshake::PREAMBLE_LEN + gwtf::wire::handshake::MSG2_LEN];
        rec.read_exact(&mut srv_hello).unwrap();
        let (_, e) = gwtf::wire::conn::drive_bytes(&mut c, &srv_hello, &[]);
        assert!(e.is_none());
        let proof = c.take_outgoing();
        rec.write_all(&proof).unwrap();
        sent.extend_from_slice(&proof);
        let _ = wait_event(&srv, "recorded connect", |e| {
            matches!(e, TransportEvent::PeerConnected { peer: 77, .. })
        });
        drop(rec);
        let _ = wait_event(&srv, "recorded gone", |e| {
            matches!(e, TransportEvent::PeerLost { peer: 77, .. })
        });
        let mut replay = TcpStream::connect(addr).unwrap();
        replay.write_all(&sent).unwrap();
        check("replay", true, &|r| {
            *r == CloseReason::Protocol(WireError::AuthFailed)
        });
        // Slowloris in the handshake: one byte at a time, too slowly.
        let mut slow = TcpStream::connect(addr).unwrap();
        let t0 = Instant::now();
        let hello = gwtf::wire::handshake::Preamble {
            role: Role::Connector,
        }
        .encode();
        std::thread::scope(|s2| {
            s2.spawn(|| {
                for b in hello.iter() {
                    if slow.write_all(&[*b]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
            });
            check("slow handshake", true, &|r| {
                *r == CloseReason::HandshakeTimeout
            });
        });
        assert!(t0.elapsed() < Duration::from_secs(10));

        // Authenticated peers that then misbehave.
        let mut next_id = 1000u64;
        let mut attack = |what: &str, bytes: Vec<u8>, pred: &dyn Fn(&CloseReason) -> bool| {
            next_id += 1;
            let mut s = raw_authenticated(addr, next_id);
            let _ = wait_event(&srv, "attacker connect", |e| {
                matches!(e, TransportEvent::PeerConnected { .. })
            });
            s.send(&bytes).unwrap();
            check(what, false, pred);
        };
        let mut h = header(10).encode();
        h[0] = b'X';
        attack("wrong magic", h.to_vec(), &|r| {
            matches!(r, CloseReason::Protocol(WireError::BadMagic { .. }))
        });
        let mut hv = header(10);
        hv.version = 1;
        attack("wrong version", hv.encode().to_vec(), &|r| {
            matches!(
                r,
                CloseReason::Protocol(WireError::UnsupportedVersion { got: 1, .. })
            )
        });
        attack("oversized", header(1 << 40).encode().to_vec(), &|r| {
            matches!(r, CloseReason::Protocol(WireError::PayloadTooLarge { .. }))
        });
        let mut hc = header(1000);
        hc.flags = FLAG_PAYLOAD_CRC;
        hc.payload_crc = crc32c(&[1u8; 1000]) ^ 1;
        let mut bytes = hc.encode().to_vec();
        bytes.extend_from_slice(&[1u8; 1000]);
        attack("bad checksum", bytes, &|r| {
            matches!(r, CloseReason::Protocol(WireError::PayloadChecksum { .. }))
        });
        // Slowloris inside a frame: a header dribbled one byte at a time.
        next_id += 1;
        let mut s = raw_authenticated(addr, next_id);
        let _ = wait_event(&srv, "slow frame connect", |e| {
            matches!(e, TransportEvent::PeerConnected { .. })
        });
        let hb = header(10).encode();
        std::thread::scope(|s2| {
            s2.spawn(|| {
                for b in hb.iter().take(20) {
                    if s.send_raw(&[*b]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            });
            check("slow frame", false, &|r| *r == CloseReason::FrameTimeout);
        });
        // A silent authenticated peer is detected as dead.
        next_id += 1;
        let _silent = raw_authenticated(addr, next_id);
        let _ = wait_event(&srv, "silent connect", |e| {
            matches!(e, TransportEvent::PeerConnected { .. })
        });
        let t0 = Instant::now();
        check("silent", false, &|r| {
            matches!(r, CloseReason::PeerTimeout { .. })
        });
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(1000) && took < Duration::from_secs(10),
            "{took:?}"
        );

        stop.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    // The honest peer was served throughout and memory is back.
    assert_eq!(srv.peers(), vec![honest.node_id()]);
    let st = srv.stats();
    assert!(st.frames_received > 0);
    assert!(st.connections_refused >= 5, "{st:?}");
    let deadline = Instant::now() + T;
    while srv.stats().pool.in_use_bytes != 0 {
        assert!(
            Instant::now() < deadline,
            "pool not released: {:?}",
            srv.stats().pool
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(st.pool.high_water_bytes <= st.pool.capacity_bytes);
}

/// A node that did not run for a while (SIGSTOP, a starved host) does not
/// hold its own stall against its peers: on waking it reads what they sent
/// meanwhile before judging them, so a pause longer than its own peer
/// timeout, but shorter than theirs, costs no connection.
#[test]
fn a_node_paused_longer_than_its_peer_timeout_keeps_its_peers() {
    // The echo node judges its peers after 1 s of silence.
    let echo = Echo::start(
        "pause",
        &["--heartbeat-ms", "100", "--peer-timeout-ms", "1000"],
    );
    // This node is patient: any connection loss comes from the echo node.
    let me = Transport::new(NodeOptions {
        listen: None,
        swarm_key: KEY.to_vec(),
        max_payload: 1 << 20,
        pool_bytes: 8 << 20,
        heartbeat_interval: Duration::from_millis(100),
        peer_timeout: Duration::from_secs(60),
        ..NodeOptions::default()
    })
    .unwrap();
    let peer = me.connect_wait(echo.addr, T).unwrap();
    let round_trip = |n: u64| {
        let mut f = me.alloc(64, T).unwrap();
        f.header.microbatch = n;
        me.send(peer, f, T).unwrap();
        let back = me.recv(T).unwrap();
        assert_eq!(back.header.microbatch, n);
    };
    round_trip(1);
    let pid = echo.child.id() as libc::pid_t;
    // SAFETY: plain kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    // Time for the echo node to run its timers many times over.
    std::thread::sleep(Duration::from_millis(1500));
    round_trip(2);
    let mut lost = Vec::new();
    for _ in 0..1000 {
        let Some(ev) = me.poll_event(Duration::from_millis(200)) else {
            break;
        };
        if matches!(ev, TransportEvent::PeerLost { .. }) {
            lost.push(format!("{ev:?}"));
        }
    }
    let stderr = echo.stop();
    assert!(
        lost.is_empty(),
        "the connection was lost: {lost:?}\n{stderr}"
    );
    assert!(
        !stderr.contains("lost"),
        "the paused node dropped its peer:\n{stderr}"
    );
}

/// The raw peer of the duplicate tests: its id is smaller than the node's.
const PEER: u64 = 0x10;

/// A node that never times its peers out on its own (the raw peer of
/// these tests sends no heartbeats).
fn patient_node() -> Transport {
    Transport::new(NodeOptions {
        node_id: 0x50,
        peer_timeout: T,
        ..server_opts()
    })
    .unwrap()
}

fn wait_connected(node: &Transport) {
    wait_event(node, "the first connection", |e| {
        matches!(e, TransportEvent::PeerConnected { peer: PEER, .. })
    });
}

/// Waits until `node` retired one of two connections to the peer; returns
/// the deadline it waited under.
fn wait_retired(node: &Transport) -> Instant {
    let deadline = Instant::now() + T;
    while node.stats().duplicates_retired == 0 {
        assert!(Instant::now() < deadline, "the node never retired one");
        std::thread::sleep(Duration::from_millis(5));
    }
    deadline
}

/// A node holds two connections to a peer and keeps the one the peer has
/// already given up on (the peer's dial reached this node while it was
/// paused; the handshake timed out at the peer, finished here on waking,
/// and this node's own dial came after). The peer uses the other one, which
/// this node retired. When the dead one ends, the duplicate takes over:
/// the peer stays connected (its caller hears of a reconnection), and
/// frames go both ways on it. Before, the peer was lost, dialled again,
/// and timed the retired connection out as silent (a live swarm member
/// lost at both ends, mid-commit, 5 s after a rejoin).
#[test]
fn a_retired_duplicate_takes_over_when_the_kept_connection_ends() {
    use std::net::TcpListener;
    // The raw peer has the smaller id: of a connection it dialled and one
    // the node dialled, the node keeps the first.
    let node = patient_node();
    let addr = node.local_addr().unwrap();
    let kept = raw_authenticated(addr, PEER);
    wait_connected(&node);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    node.connect(listener.local_addr().unwrap()).unwrap();
    let (s, _) = listener.accept().unwrap();
    let mut dup = common::raw_handshake(s, Role::Acceptor, PEER, KEY, T);
    let deadline = wait_retired(&node);
    // The peer had given up on the kept connection.
    drop(kept);
    while node.stats().duplicates_promoted == 0 {
        assert!(
            node.is_connected(PEER),
            "the peer was lost with the connection it had given up on"
        );
        assert!(Instant::now() < deadline, "the duplicate never took over");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut f = node.alloc(64, T).unwrap();
    f.header.microbatch = 7;
    node.send(PEER, f, T).unwrap();
    // What the node sends reaches the peer on the duplicate.
    assert!(
        reads_data_frame(&mut dup, 7),
        "no data frame on the duplicate"
    );
    // And what the peer sends on it reaches the node.
    let mut h = header(16);
    h.sender = PEER;
    h.microbatch = 9;
    let mut bytes = h.encode().to_vec();
    bytes.extend_from_slice(&[3u8; 16]);
    dup.send(&bytes).unwrap();
    let back = node.recv(T).unwrap();
    assert_eq!((back.peer(), back.header.microbatch), (PEER, 9));
    // The caller was told that the peer's connection broke and the peer
    // connected again (frames on the broken one may be lost), in that
    // order, and nothing else about it.
    let mut told = Vec::new();
    while let Some(ev) = node.poll_event(Duration::from_millis(300)) {
        match ev {
            TransportEvent::PeerLost { peer: PEER, .. } => told.push("lost"),
            TransportEvent::PeerConnected { peer: PEER, .. } => told.push("connected"),
            _ => {}
        }
    }
    assert_eq!(told, ["lost", "connected"]);
}

/// Reads frames from `s` until a data frame of `microbatch`: whether one
/// came before the stream ended or timed out.
fn reads_data_frame(s: &mut common::RawPeer, microbatch: u64) -> bool {
    for _ in 0..100 {
        match s.read_frame() {
            None => return false,
            Some((h, _)) if h.microbatch == microbatch => return true,
            Some(_) => {}
        }
    }
    false
}

/// A peer that dials a node twice: both ends keep the connection with the
/// smaller handshake hash, whichever finished its handshake first (the
/// ends may see the two finish in either order; keeping the older one,
/// each end kept its own, and each timed out the one it kept as silent).
#[test]
fn of_two_connections_dialled_by_one_side_the_smaller_handshake_hash_is_kept() {
    // Both orders: the smaller hash on the first connection, then on the
    // second (the hashes are random: dial again until the order comes).
    for small_first in [false, true] {
        let mut tries = 0;
        loop {
            tries += 1;
            assert!(tries <= 40, "the order {small_first} never came");
            let node = patient_node();
            let addr = node.local_addr().unwrap();
            let dial = || {
                let s = TcpStream::connect(addr).unwrap();
                let p = common::raw_handshake(s, Role::Connector, PEER, KEY, T);
                p.set_read_timeout(Duration::from_secs(10));
                p
            };
            let a = dial();
            wait_connected(&node);
            let b = dial();
            let hash = |p: &common::RawPeer| p.conn.handshake_hash().unwrap();
            if (hash(&a) < hash(&b)) != small_first {
                continue;
            }
            wait_retired(&node);
            let (mut small, _big) = if small_first { (a, b) } else { (b, a) };
            let mut f = node.alloc(64, T).unwrap();
            f.header.microbatch = 7;
            node.send(PEER, f, T).unwrap();
            assert!(
                reads_data_frame(&mut small, 7),
                "the node kept the connection with the larger hash (smaller dialled first: {small_first})"
            );
            break;
        }
    }
}
