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

/// Checks (or with `GWTF_BLESS`, writes) one seed file.
fn seed(target: &str, name: &str, want: &[u8]) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let path = dir.join(name);
    if std::env::var_os("GWTF_BLESS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, want).unwrap();
    }
    let got = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run GWTF_BLESS=1 cargo test --test protocol_codec)",
            path.display()
        )
    });
    assert_eq!(got, want, "{} is stale", path.display());
}

/// Plain frames of every kind the connection reads: a data frame with a
/// checksum, a heartbeat, a control message, a sliced data frame with a
/// heartbeat between its slices, a goodbye.
fn plain_frames() -> Vec<u8> {
    use gwtf::wire::{
        crc32c, encode_control_frame, slice_head, sliced_head, FrameHeader, FrameKind, Goodbye,
        GoodbyeReason, Heartbeat, FLAG_PAYLOAD_CRC,
    };
    let hb = |seq| {
        encode_control_frame(
            FrameKind::Heartbeat,
            2,
            &Heartbeat { seq, sent_at_us: 9 }.encode(),
        )
    };
    let data = |len: usize| {
        let payload: Vec<u8> = (0..len).map(|i| (i * 13) as u8).collect();
        let mut h = FrameHeader::data();
        h.sender = 2;
        h.stage = 1;
        h.microbatch = 5;
        h.payload_len = len as u64;
        h.flags = FLAG_PAYLOAD_CRC;
        h.payload_crc = crc32c(&payload);
        (h.encode(), payload)
    };
    let mut v = Vec::new();
    let (h, p) = data(64);
    v.extend(h);
    v.extend(p);
    v.extend(hb(1));
    let m = &codec::samples()[0];
    v.extend(encode_control_frame(
        FrameKind::Control,
        2,
        &codec::encode(m).unwrap().encode().unwrap(),
    ));
    let (h, p) = data(300);
    v.extend(sliced_head(&h));
    for (i, part) in p.chunks(128).enumerate() {
        v.extend(hb(2 + i as u64));
        v.extend(slice_head(2, part.len() as u64));
        v.extend_from_slice(part);
    }
    v.extend(encode_control_frame(
        FrameKind::Goodbye,
        2,
        &Goodbye {
            reason: GoodbyeReason::Shutdown,
            message: "bye".into(),
        }
        .encode(),
    ));
    v
}

/// The `conn_stream` and `frame_header` seeds follow the wire version:
/// each conn_stream seed runs through the harness and delivers what it
/// should.
#[test]
fn fuzz_seed_corpus_follows_the_wire_version() {
    use gwtf::wire::harness::{
        input, run, MODE_CONNECTOR, MODE_ENCRYPT, MODE_HANDSHAKE, MODE_SEALED,
    };
    use gwtf::wire::ConnEvent;
    let frames = plain_frames();
    // Name, mode, read sizes, stream, frames delivered.
    type Case = (&'static str, u8, [u8; 4], Vec<u8>, usize);
    let cases: [Case; 6] = [
        (
            "hello_only",
            0,
            [0; 4],
            gwtf::wire::handshake::Preamble {
                role: gwtf::wire::Role::Connector,
            }
            .encode()
            .to_vec(),
            0,
        ),
        (
            "garbage",
            0,
            [3, 0, 7, 1],
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            0,
        ),
        (
            "sealed_frames",
            MODE_HANDSHAKE | MODE_SEALED,
            [95, 0, 200, 17],
            frames.clone(),
            8,
        ),
        (
            "sealed_frames_connector",
            MODE_HANDSHAKE | MODE_SEALED | MODE_CONNECTOR,
            [255; 4],
            frames.clone(),
            8,
        ),
        (
            "sealed_frames_encrypted",
            MODE_HANDSHAKE | MODE_SEALED | MODE_ENCRYPT,
            [111, 3, 255, 40],
            frames.clone(),
            8,
        ),
        ("unsealed_frames", MODE_HANDSHAKE, [255; 4], frames, 0),
    ];
    for (name, mode, cuts, stream, delivered) in cases {
        let data = input(mode, cuts, &stream);
        let events = run(&data);
        let n = events
            .iter()
            .filter(|e| !matches!(e, ConnEvent::Established { .. } | ConnEvent::DataHeader(_)))
            .count();
        assert_eq!(n, delivered, "{name}: {events:?}");
        seed("conn_stream", name, &data);
    }
    // Frame headers: valid ones of the current version, and a version-1 one.
    let mut h = gwtf::wire::FrameHeader::data();
    h.payload_len = 64;
    h.flags = gwtf::wire::FLAG_PAYLOAD_CRC;
    h.payload_crc = 0x1234_5678;
    seed("frame_header", "data_crc", &h.encode());
    h.flags = 0;
    h.payload_crc = 0;
    h.dtype = gwtf::wire::Dtype::F32 as u16;
    h.ndim = 2;
    h.shape[..2].copy_from_slice(&[4, 4]);
    seed("frame_header", "data_f32", &h.encode());
    let hb = gwtf::wire::FrameHeader::new(gwtf::wire::FrameKind::Heartbeat, 3, 16);
    seed("frame_header", "heartbeat", &hb.encode());
    let mut old = hb;
    old.version = 1;
    seed("frame_header", "bad_version", &old.encode());
}

/// Every protocol message kind crosses a real authenticated connection as a
/// control frame and decodes to the message that was sent.
#[test]
fn protocol_messages_cross_the_transport_as_control_frames() {
    use gwtf::engine::{NodeOptions, Transport, TransportEvent};
    use std::time::{Duration, Instant};
    let o = NodeOptions {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        swarm_key: b"protocol-codec-test-swarm-key!!".to_vec(),
        pool_bytes: 4 << 20,
        max_payload: 1 << 20,
        ..NodeOptions::default()
    };
    let a = Transport::new(o.clone()).unwrap();
    let b = Transport::new(o).unwrap();
    let t = Duration::from_secs(20);
    let peer = a.connect_wait(b.local_addr().unwrap(), t).unwrap();
    let samples = codec::samples();
    for m in &samples {
        a.send_control(peer, &codec::encode(m).unwrap(), t).unwrap();
    }
    let deadline = Instant::now() + t;
    let mut got = Vec::new();
    while got.len() < samples.len() && Instant::now() < deadline {
        if let Some(TransportEvent::Control { peer, msg }) =
            b.poll_event(Duration::from_millis(100))
        {
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
