//! Authenticated channels and bounded intake, against a node over
//! loopback: frames replayed or reordered on the way are refused with the
//! reason `mac`; a key holder claiming another node's id is refused in the
//! handshake, dialling or dialled, and so is a second key of a known id; a
//! flood of 1,100 keyed connections from one address does
//! not keep a joiner from another out, and its refusals are counted and
//! sampled; half-sent 64 MiB frames (slowloris) lose their pool slots at
//! the frame deadline; dials refused by a peer gone for good give their
//! handshake slots back. Deadlines are generous and every loop is bounded.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use common::RawPeer;
use gwtf::engine::{CloseReason, NodeOptions, Transport, TransportEvent};
use gwtf::wire::{
    encode_control_frame, FrameHeader, FrameKind, Heartbeat, Role, WireError, HEAD_LEN,
};

const KEY: &[u8] = b"intake-test-swarm-key-0123456789";
const T: Duration = Duration::from_secs(30);

fn node(o: NodeOptions) -> Transport {
    Transport::new(NodeOptions {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        swarm_key: KEY.to_vec(),
        log: true,
        ..o
    })
    .unwrap()
}

fn raw(addr: SocketAddr, id: u64) -> RawPeer {
    common::raw_authenticated(addr, id, KEY, T)
}

fn heartbeat(seq: u64) -> Vec<u8> {
    encode_control_frame(
        FrameKind::Heartbeat,
        7,
        &Heartbeat { seq, sent_at_us: 0 }.encode(),
    )
}

/// The reason the node gives for losing `peer`.
fn lost_reason(n: &Transport, peer: u64) -> CloseReason {
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        if let Some(TransportEvent::PeerLost {
            peer: p, reason, ..
        }) = n.poll_event(Duration::from_millis(50))
        {
            if p == peer {
                return reason;
            }
        }
    }
    panic!("peer {peer:x} not lost within {T:?}");
}

fn wait_connected(n: &Transport, peer: u64) {
    let deadline = Instant::now() + T;
    while !n.is_connected(peer) {
        assert!(Instant::now() < deadline, "peer {peer:x} never connected");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The next `Refused` event of `n` (bounded wait).
fn next_refusal(n: &Transport) -> (bool, CloseReason) {
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        if let Some(TransportEvent::Refused {
            inbound, reason, ..
        }) = n.poll_event(Duration::from_millis(50))
        {
            return (inbound, reason);
        }
    }
    panic!("no refusal within {T:?}");
}

/// A node's id follows from its key: a holder of the swarm key that claims
/// another node's id (with its own key) is refused in the handshake, with
/// the reason `auth` (code 8), when it dials and when it is dialled; the
/// node whose id it is connects; a node cannot even start under an id that
/// is not its key's.
#[test]
fn a_node_claiming_another_s_id_is_refused() {
    let n = node(NodeOptions::default());
    let addr = n.local_addr().unwrap();
    let owner_key = gwtf::wire::NodeKey::generate().unwrap();
    let victim = owner_key.node_id() as u64;
    // It dials, claiming the victim's id.
    let s = std::net::TcpStream::connect(addr).unwrap();
    let r = common::try_raw_handshake(s, Role::Connector, victim, KEY, T);
    assert!(r.is_err(), "the impostor was let in");
    let (inbound, reason) = next_refusal(&n);
    assert!(inbound);
    assert!(
        matches!(reason, CloseReason::Protocol(WireError::IdNotBound { claimed, .. }) if claimed == victim),
        "{reason:?}"
    );
    assert_eq!(reason.code(), 8);
    assert!(
        reason.to_string().contains("ids follow from node keys"),
        "{reason}"
    );
    // It is dialled, and claims the victim's id in its answer.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    n.connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    let r = common::try_raw_handshake(s, Role::Acceptor, victim, KEY, Duration::from_secs(5));
    let (inbound, reason) = next_refusal(&n);
    assert!(!inbound);
    assert!(
        matches!(reason, CloseReason::Protocol(WireError::IdNotBound { .. })),
        "{reason:?}"
    );
    // (The acceptor ends its handshake before it learns of the refusal.)
    drop(r);
    assert!(!n.is_connected(victim));
    assert_eq!(n.peers(), Vec::<u64>::new());
    // The owner of the key connects under its id.
    let owner = Transport::new(NodeOptions {
        swarm_key: KEY.to_vec(),
        node_key: Some(owner_key.clone()),
        ..NodeOptions::default()
    })
    .unwrap();
    assert_eq!(owner.node_id(), victim);
    assert_eq!(owner.connect_wait(addr, T).unwrap(), n.node_id());
    wait_connected(&n, victim);
    // An id that is not the key's does not start (only chosen_ids allows it).
    let e = Transport::new(NodeOptions {
        swarm_key: KEY.to_vec(),
        node_key: Some(owner_key.clone()),
        node_id: victim ^ 1,
        ..NodeOptions::default()
    })
    .err()
    .expect("a node under another id started");
    assert!(
        e.to_string().contains("is not the id of this node's key"),
        "{e}"
    );
    assert!(Transport::new(NodeOptions {
        swarm_key: KEY.to_vec(),
        node_key: Some(owner_key),
        node_id: victim ^ 1,
        chosen_ids: true,
        ..NodeOptions::default()
    })
    .is_ok());
}

/// Two private keys whose public keys hash to the same node id (found by
/// trying keys: a birthday search over 48,000 keys; an attacker after a
/// given node's id needs about 2^32).
const SAME_ID: [&str; 2] = [
    "28246d9ed84936db4e3b363e919d99ea993093e499b33388717e59e143d167c6",
    "ee623f30fbfbf569d1f24ad64e11382a2edd7f4d340d6bf3b3f670f66b7e57f7",
];

/// A node remembers the key each id connected with: a second key of the
/// same id (one found by trying keys) is refused, reason `auth`; the first
/// key connects again (a restarted node keeps its key file).
#[test]
fn a_second_key_of_a_known_id_is_refused() {
    let [first, second] =
        SAME_ID.map(|h| gwtf::wire::NodeKey::from_file_bytes(h.as_bytes()).unwrap());
    assert_eq!(first.node_id(), second.node_id(), "the keys' ids differ");
    assert_ne!(first.public(), second.public());
    let id = first.node_id() as u64;
    let n = node(NodeOptions::default());
    let addr = n.local_addr().unwrap();
    let dial = |key: &gwtf::wire::NodeKey| {
        Transport::new(NodeOptions {
            swarm_key: KEY.to_vec(),
            node_key: Some(key.clone()),
            connect_attempts: 1,
            ..NodeOptions::default()
        })
        .unwrap()
    };
    let a = dial(&first);
    assert_eq!(a.connect_wait(addr, T).unwrap(), n.node_id());
    wait_connected(&n, id);
    drop(a);
    let deadline = Instant::now() + T;
    while n.is_connected(id) {
        assert!(Instant::now() < deadline, "the first key's node never left");
        std::thread::sleep(Duration::from_millis(5));
    }
    let b = dial(&second);
    let _ = b.connect_wait(addr, Duration::from_secs(5));
    let (inbound, reason) = loop {
        let (inbound, reason) = next_refusal(&n);
        if matches!(reason, CloseReason::Protocol(_)) {
            break (inbound, reason);
        }
    };
    assert!(inbound);
    assert!(
        matches!(reason, CloseReason::Protocol(WireError::KeyChanged { id: i }) if i == id),
        "{reason:?}"
    );
    assert_eq!(reason.code(), 8);
    assert!(!n.is_connected(id));
    drop(b);
    let again = dial(&first);
    assert_eq!(again.connect_wait(addr, T).unwrap(), n.node_id());
    wait_connected(&n, id);
}

/// A frame replayed, one reordered, one dropped, one changed: each is
/// refused for its tag, the connection closes with `mac` (code 12), and
/// none is delivered.
#[test]
fn replayed_reordered_dropped_and_changed_frames_close_with_mac() {
    let n = node(NodeOptions::default());
    let addr = n.local_addr().unwrap();
    let mut h = FrameHeader::data();
    h.sender = 7;
    h.payload_len = 4096;
    let mut data = h.encode().to_vec();
    data.extend(vec![9u8; 4096]);
    for case in ["replayed", "reordered", "dropped", "changed"].iter() {
        let mut p = raw(addr, 0);
        let id = p.id;
        wait_connected(&n, id);
        let seal =
            |p: &mut RawPeer, plain: &[u8]| gwtf::wire::seal_frames(&mut p.conn, plain).unwrap();
        let first = seal(&mut p, &heartbeat(1));
        let second = seal(&mut p, &data);
        let bytes = match *case {
            "replayed" => [first.clone(), first].concat(),
            "reordered" => [second, first].concat(),
            "dropped" => second,
            _ => {
                let mut b = [first, second].concat();
                let at = b.len() - 100;
                b[at] ^= 1;
                b
            }
        };
        p.send_raw(&bytes).unwrap();
        let r = lost_reason(&n, id);
        assert!(
            matches!(r, CloseReason::Protocol(WireError::Mac { .. })),
            "{case}: {r:?}"
        );
        assert_eq!(r.code(), 12, "{case}");
    }
    assert!(
        n.recv(Duration::from_millis(200)).is_err(),
        "a refused frame was delivered"
    );
    assert_eq!(n.stats().tag_failures, 4);
}

/// 1,100 connections from 127.0.0.2 by a key holder, each through its
/// handshake as far as the node lets it, held open: the node takes at
/// most its per-address limit of them, refuses the rest at once, reports
/// a sample of the refusals, and a joiner from 127.0.0.1 joins in well
/// under 10 s. (Before the limits, the flood filled `max_connections`
/// and every later connection was refused.)
#[test]
fn a_flood_from_one_address_does_not_keep_a_joiner_out() {
    let n = node(NodeOptions::default());
    let addr = n.local_addr().unwrap();
    let flood_from = Ipv4Addr::new(127, 0, 0, 2);
    let t0 = Instant::now();
    let mut held = Vec::new();
    let mut failed = 0;
    for _ in 0..1100 {
        let Ok(s) = common::connect_from(flood_from, addr) else {
            failed += 1;
            continue;
        };
        match common::try_raw_handshake(s, Role::Connector, 0, KEY, T) {
            Ok(p) => held.push(p),
            Err(_) => failed += 1,
        }
    }
    let flood_s = t0.elapsed().as_secs_f64();
    let limit = NodeOptions::default().max_connections_per_address;
    assert!(
        held.len() <= limit,
        "{} flood connections taken",
        held.len()
    );
    assert!(
        held.len() >= limit / 2,
        "{} flood connections taken",
        held.len()
    );
    // The joiner, while the flood's connections are held.
    let joiner = Transport::new(NodeOptions {
        swarm_key: KEY.to_vec(),
        ..NodeOptions::default()
    })
    .unwrap();
    let t1 = Instant::now();
    let peer = joiner.connect_wait(addr, Duration::from_secs(10));
    let join_s = t1.elapsed().as_secs_f64();
    assert_eq!(peer.ok(), Some(n.node_id()), "the joiner was kept out");
    assert!(join_s < 10.0, "the joiner took {join_s:.2} s");
    let st = n.stats();
    let mut reported = 0;
    while let Some(ev) = n.poll_event(Duration::from_millis(20)) {
        if let TransportEvent::Refused { addr, .. } = ev {
            if addr.ip() == flood_from {
                reported += 1;
            }
        }
    }
    eprintln!(
        "flood: {} held, {failed} refused in {flood_s:.2} s; the joiner joined in {:.1} ms; \
         refusals {} ({} reported as events, {} only counted)",
        held.len(),
        join_s * 1e3,
        st.connections_refused,
        reported,
        st.refusals_unreported
    );
    assert!(st.connections_refused >= 1000, "{st:?}");
    // A few reports per second of flood, not one per connection.
    let most = 16 * (flood_s.ceil() as u64 + 1);
    assert!(
        reported <= most,
        "{reported} refusals reported (most {most})"
    );
    assert!(st.refusals_unreported + reported >= 1000, "{st:?}");
}

/// 300 peers each send the head of a 64 MiB data frame and a few bytes
/// of it, then nothing (slowloris): each half-sent frame loses its pool
/// slot at the frame deadline (its bytes stopped coming), not after the
/// 64 s its length would earn at the slowest accepted rate; the pool is
/// empty again and an honest peer's frames go through.
#[test]
fn half_sent_frames_lose_their_pool_slots_at_the_frame_deadline() {
    let frame_timeout = Duration::from_secs(1);
    let n = node(NodeOptions {
        max_payload: 64 << 20,
        pool_bytes: 1 << 30,
        frame_timeout,
        peer_timeout: Duration::from_secs(60),
        ..NodeOptions::default()
    });
    let addr = n.local_addr().unwrap();
    let mut h = FrameHeader::data();
    h.sender = 7;
    h.payload_len = 64 << 20;
    // Its head (header and a tag: never checked, the payload never
    // completes) and 4 KiB of its payload.
    let mut head = h.encode().to_vec();
    head.extend([0u8; HEAD_LEN - 96]);
    head.extend([1u8; 4096]);
    let mut slow = Vec::new();
    let mut sent_at = std::collections::HashMap::new();
    for _ in 0..300 {
        let Ok(s) = std::net::TcpStream::connect(addr) else {
            continue;
        };
        if let Ok(mut p) = common::try_raw_handshake(s, Role::Connector, 0, KEY, T) {
            if p.send_raw(&head).is_ok() {
                sent_at.insert(p.id, Instant::now());
                slow.push(p);
            }
        }
    }
    let sent = Instant::now();
    // One address: at most its limit of connections at once.
    let limit = NodeOptions::default().max_connections_per_address;
    let refused = n.stats().connections_refused;
    assert!(
        slow.len() + refused as usize >= 300,
        "{} {refused}",
        slow.len()
    );
    assert!(
        slow.len() <= limit + 16,
        "{} slow frames taken (refused {refused})",
        slow.len()
    );
    // Every half-sent frame is cut at its deadline (its 4 KiB earned it
    // 4 ms more); the connections stay open, nothing else frees them.
    let deadline = Instant::now() + T;
    let mut longest = Duration::ZERO;
    let mut cut = 0;
    while cut < slow.len() {
        assert!(
            Instant::now() < deadline,
            "{cut} of {} half-sent frames cut; pool {:?}",
            slow.len(),
            n.stats().pool
        );
        if let Some(TransportEvent::PeerLost { peer, reason, .. }) =
            n.poll_event(Duration::from_millis(50))
        {
            assert_eq!(reason, CloseReason::FrameTimeout, "peer {peer:x}");
            longest = longest.max(sent_at[&peer].elapsed());
            cut += 1;
        }
    }
    while n.stats().pool.in_use_bytes != 0 {
        assert!(
            Instant::now() < deadline,
            "pool not released: {:?}",
            n.stats().pool
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "{} slowloris frames of 64 MiB: each cut at most {longest:?} after its head",
        slow.len()
    );
    // 16 slots of 64 MiB: the frames got theirs in turns of about a frame
    // deadline each, and all were cut within a few turns, not after the
    // 64 s their length would have earned at the slowest accepted rate.
    let turns = slow.len().div_ceil(16) as u32;
    let bound = (frame_timeout + Duration::from_millis(500)) * turns + Duration::from_secs(3);
    eprintln!(
        "all cut {:?} after the last head (bound {bound:?})",
        sent.elapsed()
    );
    assert!(longest < bound, "{longest:?}");
    // An honest peer is served.
    let honest = Transport::new(NodeOptions {
        swarm_key: KEY.to_vec(),
        max_payload: 64 << 20,
        pool_bytes: 256 << 20,
        ..NodeOptions::default()
    })
    .unwrap();
    let p = honest.connect_wait(addr, T).unwrap();
    let f = honest.alloc(8 << 20, T).unwrap();
    honest.send(p, f, T).unwrap();
    let got = n.recv(T).unwrap();
    assert_eq!(got.len(), 8 << 20);
    drop(slow);
}

/// A dial refused by the other side (a peer gone for good, its port
/// closed) gives its handshake slot back: after ten times the most
/// handshakes at once refused dials, the node still connects. Before, each
/// refused dial kept its slot, and nodes that redialed a finished holder
/// refused every connection once they had leaked 256.
#[test]
fn refused_dials_give_their_handshake_slots_back() {
    let most = 4;
    let dialer = Transport::new(NodeOptions {
        swarm_key: KEY.to_vec(),
        connect_attempts: 1,
        max_handshakes: most,
        ..NodeOptions::default()
    })
    .unwrap();
    let gone = {
        let l = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        l.local_addr().unwrap()
    };
    for i in 0..10 * most {
        let r = dialer.connect_wait(gone, T);
        assert!(r.is_err(), "dial {i} to a closed port connected");
        let e = r.unwrap_err().to_string();
        assert!(!e.contains("handshakes in progress"), "dial {i}: {e}");
    }
    let live = node(NodeOptions::default());
    let addr = live.local_addr().unwrap();
    assert_eq!(dialer.connect_wait(addr, T).unwrap(), live.node_id());
}
