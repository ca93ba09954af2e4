//! The `conn_stream` fuzz target's harness, here so that its seed corpus
//! is written (and checked) by the tests with the same code.
//!
//! Input: a mode byte, four read-size bytes, then the stream. Mode bits:
//! 1: an honest peer runs the handshake first (fixed keys, so a seed
//! replays the same transcript); 2: the machine under test is the
//! connector; 4: the honest peer asks for encryption; 8: the stream is
//! plain frames that the honest peer seals (else its bytes go on the wire
//! as they are, as from someone on the path).

use super::conn::{drive_bytes, seal_frames, ConnOptions, Connection};
use super::handshake::{NodeKey, Role, SwarmKey};
use super::ConnEvent;

pub const MODE_HANDSHAKE: u8 = 1;
pub const MODE_CONNECTOR: u8 = 2;
pub const MODE_ENCRYPT: u8 = 4;
pub const MODE_SEALED: u8 = 8;

const KEY: &[u8] = b"fuzz-swarm-key-0123456789abcdef";

fn machine(role: Role, id: u8, encrypt: bool) -> Connection {
    let opts = ConnOptions {
        encrypt,
        test_ephemeral: Some([id ^ 0x5a; 32]),
        ..ConnOptions::new(1 << 20)
    };
    let key = SwarmKey::new(KEY).expect("a long key");
    let node = NodeKey::from_private(&[id; 32]).expect("32 bytes");
    Connection::new(role, node.node_id() as u64, &key, &node, &opts)
}

/// Runs the honest handshake between the machine under test (`role`, node
/// key 1, under its id) and its peer (node key 2), its messages cut at
/// `cuts`.
fn handshake(role: Role, encrypt: bool, cuts: &[usize]) -> (Connection, Connection) {
    let mut conn = machine(role, 1, false);
    let mut peer = machine(role.other(), 2, encrypt);
    for _ in 0..4 {
        let (to_conn, to_peer) = (peer.take_outgoing(), conn.take_outgoing());
        let (_, e) = drive_bytes(&mut conn, &to_conn, cuts);
        assert!(e.is_none(), "honest handshake failed: {e:?}");
        let (_, e) = drive_bytes(&mut peer, &to_peer, cuts);
        assert!(e.is_none(), "honest handshake failed: {e:?}");
    }
    assert!(conn.is_established() && peer.is_established());
    assert_eq!(
        conn.peer_id(),
        Some(NodeKey::from_private(&[2; 32]).expect("32 bytes").node_id() as u64)
    );
    (conn, peer)
}

/// An established pair: the handshake (with fixed keys, the same every
/// time) runs once per role and encryption per thread, with the first
/// input's read sizes, and is copied after (X25519 would otherwise be
/// most of each run).
fn established(role: Role, encrypt: bool, cuts: &[usize]) -> (Connection, Connection) {
    type Pairs = Vec<((Role, bool), (Connection, Connection))>;
    thread_local! {
        static PAIRS: std::cell::RefCell<Pairs> = const { std::cell::RefCell::new(Vec::new()) };
    }
    PAIRS.with(|p| {
        let mut p = p.borrow_mut();
        if !p.iter().any(|(k, _)| *k == (role, encrypt)) {
            p.push(((role, encrypt), handshake(role, encrypt, cuts)));
        }
        let (_, (a, b)) = p
            .iter()
            .find(|(k, _)| *k == (role, encrypt))
            .expect("added");
        (
            a.copy_established().expect("between frames"),
            b.copy_established().expect("between frames"),
        )
    })
}

/// The input for `mode`, read sizes `cuts` and `stream`.
pub fn input(mode: u8, cuts: [u8; 4], stream: &[u8]) -> Vec<u8> {
    let mut v = vec![mode];
    v.extend(cuts);
    v.extend_from_slice(stream);
    v
}

/// Runs one input; panics when a property fails: an honest handshake
/// completes, nothing is delivered without one, and bytes that the
/// honest peer did not seal deliver nothing.
pub fn run(data: &[u8]) -> Vec<ConnEvent> {
    let Some((&mode, rest)) = data.split_first() else {
        return Vec::new();
    };
    let Some((cuts, stream)) = rest.split_first_chunk::<4>() else {
        return Vec::new();
    };
    let cuts: Vec<usize> = cuts.iter().map(|&c| c as usize + 1).collect();
    let role = if mode & MODE_CONNECTOR != 0 {
        Role::Connector
    } else {
        Role::Acceptor
    };
    let mut stream = stream.to_vec();
    let mut conn = if mode & MODE_HANDSHAKE != 0 {
        let encrypt = mode & MODE_ENCRYPT != 0;
        let (conn, mut peer) = established(role, encrypt, &cuts);
        if mode & MODE_SEALED != 0 {
            stream = seal_frames(&mut peer, &stream).expect("established");
        }
        conn
    } else {
        let mut conn = machine(role, 1, false);
        conn.take_outgoing();
        conn
    };
    let (events, _err) = drive_bytes(&mut conn, &stream, &cuts);
    let delivered = events
        .iter()
        .any(|e| !matches!(e, ConnEvent::Established { .. }));
    if mode & MODE_HANDSHAKE == 0 {
        assert!(!delivered, "delivered without a handshake: {events:?}");
    } else if mode & MODE_SEALED == 0 {
        // A frame the peer did not seal would need a forged tag (a data
        // header may be announced: nothing follows from it but a lease).
        assert!(
            events.iter().all(|e| matches!(e, ConnEvent::DataHeader(_))),
            "an unsealed frame was delivered: {events:?}"
        );
    }
    events
}
