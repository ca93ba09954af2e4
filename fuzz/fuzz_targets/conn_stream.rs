//! The connection state machine (handshake + framing reader) fed arbitrary
//! byte streams cut at arbitrary read sizes. With the first byte's low bit
//! set, the harness plays an honest peer's handshake first, so the framing
//! reader behind the authentication is reached too.
#![no_main]
use gwtf::wire::conn::drive_bytes;
use gwtf::wire::handshake::{prove, Hello, Transcript};
use gwtf::wire::{ConnEvent, Connection, Role, SwarmKey};
use libfuzzer_sys::fuzz_target;

const KEY: &[u8] = b"fuzz-swarm-key-0123456789abcdef";

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Some((cuts, stream)) = rest.split_first_chunk::<4>() else {
        return;
    };
    let cuts: Vec<usize> = cuts.iter().map(|&c| c as usize + 1).collect();
    let key = SwarmKey::new(KEY).unwrap();
    let role = if mode & 2 == 0 {
        Role::Acceptor
    } else {
        Role::Connector
    };
    let mut conn = Connection::new(role, 1, key.clone(), [0x11; 32], 1 << 20);
    let _ = conn.take_outgoing();
    if mode & 1 == 1 {
        // An honest peer's hello and proof.
        let peer_role = if role == Role::Acceptor {
            Role::Connector
        } else {
            Role::Acceptor
        };
        let hello = Hello {
            role: peer_role,
            node_id: 2,
            nonce: [0x22; 32],
        };
        let t = if role == Role::Acceptor {
            Transcript {
                connector_id: 2,
                connector_nonce: [0x22; 32],
                acceptor_id: 1,
                acceptor_nonce: [0x11; 32],
            }
        } else {
            Transcript {
                connector_id: 1,
                connector_nonce: [0x11; 32],
                acceptor_id: 2,
                acceptor_nonce: [0x22; 32],
            }
        };
        let mut prefix = hello.encode().to_vec();
        prefix.extend_from_slice(&prove(&key, peer_role, &t));
        let (ev, err) = drive_bytes(&mut conn, &prefix, &cuts);
        assert!(err.is_none(), "honest handshake failed: {err:?}");
        assert!(matches!(
            ev.as_slice(),
            [ConnEvent::Established { peer_id: 2 }]
        ));
    }
    let (events, _err) = drive_bytes(&mut conn, stream, &cuts);
    // Nothing is delivered before authentication.
    if mode & 1 == 0 {
        assert!(events
            .iter()
            .all(|e| matches!(e, ConnEvent::Established { .. })));
    }
});
