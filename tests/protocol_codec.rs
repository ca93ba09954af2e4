//! The fuzz seed corpus holds one encoded protocol message of every kind
//! (`GWTF_BLESS=1 cargo test --test protocol_codec` rewrites the seeds).
use gwtf::protocol::codec;

#[test]
fn fuzz_seed_corpus_has_every_protocol_message_kind() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/control_msg");
    let bless = std::env::var_os("GWTF_BLESS").is_some();
    for m in codec::samples() {
        // The control_msg target picks its decoder from the first byte: 3 is
        // "envelope, then protocol message".
        let mut want = vec![3u8];
        want.extend(codec::encode(&m).unwrap().encode().unwrap());
        let path = dir.join(format!("protocol-{}", m.name()));
        if bless {
            std::fs::write(&path, &want).unwrap();
        }
        let got = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run GWTF_BLESS=1 cargo test --test protocol_codec)",
                path.display()
            )
        });
        assert_eq!(got, want, "{} is stale", path.display());
    }
}

/// Every protocol message kind crosses a real authenticated connection as a
/// control frame and decodes to the message that was sent.
#[test]
fn protocol_messages_cross_the_transport_as_control_frames() {
    use gwtf::engine::{Event, Node, NodeOptions};
    use std::time::{Duration, Instant};
    let o = NodeOptions {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        swarm_key: b"protocol-codec-test-swarm-key!!".to_vec(),
        pool_bytes: 4 << 20,
        max_payload: 1 << 20,
        ..NodeOptions::default()
    };
    let a = Node::new(o.clone()).unwrap();
    let b = Node::new(o).unwrap();
    let t = Duration::from_secs(20);
    let peer = a.connect_wait(b.local_addr().unwrap(), t).unwrap();
    let samples = codec::samples();
    for m in &samples {
        a.send_control(peer, &codec::encode(m).unwrap(), t).unwrap();
    }
    let deadline = Instant::now() + t;
    let mut got = Vec::new();
    while got.len() < samples.len() && Instant::now() < deadline {
        if let Some(Event::Control { peer, msg }) = b.poll_event(Duration::from_millis(100)) {
            assert_eq!(peer, a.node_id());
            got.push(codec::decode(&msg).unwrap());
        }
    }
    assert_eq!(got, samples, "in order, all of them, unchanged");
}

/// The link size the simulator charges for a message is the size of the
/// frames it really takes: the encoded control frame, plus the data frame
/// of a bulk message.
#[test]
fn link_bytes_is_the_framed_size() {
    use gwtf::wire::{encode_control_frame, FrameKind, HEADER_LEN};
    let payload = 12_345u64;
    for m in codec::samples() {
        let env = codec::encode(&m).unwrap().encode().unwrap();
        let control = encode_control_frame(FrameKind::Control, 7, &env).len() as u64;
        let want = if m.is_bulk() {
            control + HEADER_LEN as u64 + payload
        } else {
            control
        };
        assert_eq!(codec::link_bytes(&m, payload), want, "{}", m.name());
        assert_eq!(
            codec::body_len(&m),
            codec::encode(&m).unwrap().body.len(),
            "{}",
            m.name()
        );
    }
}
