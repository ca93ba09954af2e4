//! Two or more nodes in one process over loopback: the Rust `Transport` API.

use std::time::{Duration, Instant};

use gwtf::engine::{CloseReason, NodeOptions, Transport, TransportEvent};
use gwtf::wire::Dtype;

const KEY: &[u8] = b"0123456789abcdef-test-swarm-key";
const T: Duration = Duration::from_secs(20);

fn opts() -> NodeOptions {
    NodeOptions {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        swarm_key: KEY.to_vec(),
        max_payload: 4 << 20,
        pool_bytes: 32 << 20,
        heartbeat_interval: Duration::from_millis(200),
        peer_timeout: Duration::from_secs(2),
        ..NodeOptions::default()
    }
}

fn wait_event(node: &Transport, pred: impl Fn(&TransportEvent) -> bool) -> TransportEvent {
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        if let Some(ev) = node.poll_event(Duration::from_millis(100)) {
            if pred(&ev) {
                return ev;
            }
        }
    }
    panic!("event not seen within {T:?}");
}

#[test]
fn send_and_receive_tensors_between_two_nodes() {
    let a = Transport::new(opts()).unwrap();
    let b = Transport::new(opts()).unwrap();
    let peer = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
    assert_eq!(peer, b.node_id());
    wait_event(
        &b,
        |e| matches!(e, TransportEvent::PeerConnected { peer, .. } if *peer == a.node_id()),
    );
    for (i, n) in [0usize, 1, 3, 1000, 65536, 1 << 20, (4 << 20) / 4]
        .into_iter()
        .enumerate()
    {
        let mut f = a.alloc(n * 4, T).unwrap();
        for (j, c) in f.payload_mut().chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&((j as f32) * 0.5 + i as f32).to_le_bytes());
        }
        f.header.microbatch = i as u64;
        f.header.dtype = Dtype::F32 as u16;
        f.header.ndim = 1;
        f.header.shape[0] = n as u64;
        a.send(peer, f, T).unwrap();
        let r = b.recv(T).unwrap();
        assert_eq!(r.peer(), a.node_id());
        assert_eq!(r.header.microbatch, i as u64);
        assert_eq!(r.len(), n * 4);
        for (j, c) in r.payload().chunks_exact(4).enumerate() {
            assert_eq!(
                f32::from_le_bytes(c.try_into().unwrap()),
                (j as f32) * 0.5 + i as f32
            );
        }
    }
    let s = b.stats();
    assert_eq!(s.frames_received, 7);
    assert_eq!(s.user_copies, 0);
    assert_eq!(a.stats().user_copies, 0);
    // Everything was released.
    assert_eq!(b.stats().pool.in_use_bytes, 0);
    assert_eq!(a.stats().pool.in_use_bytes, 0);
}

#[test]
fn goodbye_and_dead_peer_are_reported() {
    let a = Transport::new(opts()).unwrap();
    let b = Transport::new(opts()).unwrap();
    let peer = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
    let bid = b.node_id();
    wait_event(&b, |e| matches!(e, TransportEvent::PeerConnected { .. }));
    b.shutdown();
    let ev = wait_event(&a, |e| matches!(e, TransportEvent::PeerLost { .. }));
    match ev {
        TransportEvent::PeerLost {
            peer: p, reason, ..
        } => {
            assert_eq!(p, bid);
            assert!(matches!(reason, CloseReason::Goodbye { .. }), "{reason}");
        }
        _ => unreachable!(),
    }
    let f = a.alloc(10, T).unwrap();
    assert!(a.send(peer, f, T).is_err());
}

#[test]
fn connect_to_nothing_fails_after_retries() {
    let mut o = opts();
    o.connect_attempts = 3;
    o.connect_backoff = Duration::from_millis(10);
    let a = Transport::new(o).unwrap();
    // A port nobody listens on: bind then drop.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = a.connect_wait(addr, T).unwrap_err();
    assert!(e.to_string().contains("3 attempts"), "{e}");
}

#[test]
fn wrong_key_is_refused_on_both_sides() {
    let a = Transport::new(opts()).unwrap();
    let mut o = opts();
    o.swarm_key = b"another-key-of-sufficient-length".to_vec();
    let b = Transport::new(o).unwrap();
    let e = a.connect_wait(b.local_addr().unwrap(), T).unwrap_err();
    // The dialling side proved its key first and was refused: it is told
    // the keys likely differ.
    assert!(e.to_string().contains("swarm key differs"), "{e}");
    let ev = wait_event(&b, |e| matches!(e, TransportEvent::Refused { .. }));
    assert!(format!("{ev:?}").contains("AuthFailed"), "{ev:?}");
    assert!(b.peers().is_empty());
}

/// Per-peer link emulation (a testbed's pairwise latencies): the link to
/// the peer named in `peer_links` takes its own delay and bandwidth once
/// the handshake names the peer; the link to another peer takes none.
#[test]
fn a_peer_named_in_peer_links_gets_its_own_delay_and_bandwidth() {
    use gwtf::engine::LinkEmulation;
    let far = Transport::new(opts()).unwrap();
    let near = Transport::new(opts()).unwrap();
    let (delay, rate, len) = (Duration::from_millis(500), 2u64 << 20, 3usize << 20);
    let links = [(
        far.node_id(),
        LinkEmulation {
            delay,
            bandwidth_bytes_per_s: rate,
        },
    )];
    let a = Transport::new(NodeOptions {
        peer_links: Some(std::sync::Arc::new(links.into_iter().collect())),
        ..opts()
    })
    .unwrap();
    let to_far = a.connect_wait(far.local_addr().unwrap(), T).unwrap();
    let to_near = a.connect_wait(near.local_addr().unwrap(), T).unwrap();
    let t0 = Instant::now();
    for peer in [to_far, to_near] {
        let f = a.alloc(len, T).unwrap();
        a.send(peer, f, T).unwrap();
    }
    let got_near = near.recv(T).unwrap();
    let near_s = t0.elapsed();
    let got_far = far.recv(T).unwrap();
    let far_s = t0.elapsed();
    assert_eq!((got_near.len(), got_far.len()), (len, len));
    // The far link: its delay, then all but the first burst at its rate.
    let at_least =
        delay + Duration::from_secs_f64((len as f64 - 16384.0 - rate as f64 / 100.0) / rate as f64);
    assert!(
        far_s >= at_least,
        "the far peer's frame came in {far_s:?}, before {at_least:?}"
    );
    assert!(
        near_s < far_s,
        "the near peer's frame ({near_s:?}) waited for the far one ({far_s:?})"
    );
}

/// A slow, far link (user-space emulation): back-pressure bounds the send
/// queue (a would-block send fails fast, a waiting send resumes once the
/// queue drains), and payloads that trickle in a few KiB at a time still
/// complete whole and in order, whatever the receive low-water mark is.
#[test]
fn slow_link_applies_back_pressure_and_delivers_trickled_frames_whole() {
    use gwtf::engine::LinkEmulation;
    let depth = 4;
    let a = Transport::new(NodeOptions {
        send_queue_depth: depth,
        link: Some(LinkEmulation {
            delay: Duration::from_millis(20),
            bandwidth_bytes_per_s: 8 << 20,
        }),
        ..opts()
    })
    .unwrap();
    let b = Transport::new(opts()).unwrap();
    let peer = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
    // Sizes that straddle the low-water mark: several MiB, a few bytes after
    // a large frame, an odd length, and an empty payload last.
    let sizes = [
        3 << 20,
        5,
        (1 << 20) + 1,
        1 << 20,
        0,
        2 << 20,
        17,
        (4 << 20) - 3,
        0,
    ];
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            for (i, &n) in sizes.iter().enumerate() {
                let mut f = a.alloc(n, T).unwrap();
                for (j, x) in f.payload_mut().iter_mut().enumerate() {
                    *x = (j as u64 * 31 + i as u64) as u8;
                }
                f.header.microbatch = i as u64;
                a.send(peer, f, T).unwrap();
            }
            // The queue is full while the link drains at 8 MiB/s: a send
            // that may not wait is refused at once, and nothing grows.
            let mut refused = 0;
            for _ in 0..3 {
                let f = a.alloc(1 << 20, T).unwrap();
                if a.send(peer, f, Duration::ZERO).is_err() {
                    refused += 1;
                }
            }
            assert!(refused >= 1, "a full send queue accepted every frame");
        });
        let mut got = 0;
        while got < sizes.len() {
            let r = b.recv(T).unwrap();
            if r.header.microbatch as usize >= sizes.len() {
                continue; // one of the extra frames, if it got in
            }
            let i = got;
            assert_eq!(r.header.microbatch, i as u64, "frames arrive in order");
            assert_eq!(r.len(), sizes[i]);
            assert!(r
                .payload()
                .iter()
                .enumerate()
                .all(|(j, &x)| x == (j as u64 * 31 + i as u64) as u8));
            got += 1;
        }
    });
    // 16 MiB at 8 MiB/s cannot arrive in less than about two seconds.
    let total: usize = sizes.iter().sum();
    let floor = Duration::from_secs_f64(total as f64 / (8 << 20) as f64 * 0.8);
    assert!(
        t0.elapsed() >= floor,
        "the bandwidth cap was not applied: {:?} < {floor:?}",
        t0.elapsed()
    );
    assert_eq!(b.stats().user_copies, 0);
}

/// A caller that is late to read its events loses no control message: past
/// the event queue's size the node stops reading (TCP pushes back on the
/// sender) and resumes once there is room again.
#[test]
fn a_burst_of_control_messages_larger_than_the_event_queue_is_delivered_whole() {
    use gwtf::wire::ControlEnvelope;
    let a = Transport::new(opts()).unwrap();
    let b = Transport::new(opts()).unwrap();
    let peer = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
    wait_event(&b, |ev| matches!(ev, TransportEvent::PeerConnected { .. }));
    const N: u32 = 10_000;
    let sender = std::thread::scope(|s| {
        let h = s.spawn(|| {
            for i in 0..N {
                let msg = ControlEnvelope {
                    msg_type: 7,
                    msg_version: 1,
                    body: i.to_le_bytes().to_vec(),
                };
                a.send_control(peer, &msg, T).unwrap();
            }
        });
        // Read nothing for a while: the queue fills up.
        std::thread::sleep(Duration::from_millis(500));
        let mut next = 0u32;
        let deadline = Instant::now() + T;
        while next < N && Instant::now() < deadline {
            if let Some(TransportEvent::Control { msg, .. }) =
                b.poll_event(Duration::from_millis(100))
            {
                let i = u32::from_le_bytes(msg.body[..4].try_into().unwrap());
                assert_eq!(i, next, "control messages out of order or lost");
                next += 1;
            }
        }
        h.join().unwrap();
        next
    });
    assert_eq!(sender, N);
    assert_eq!(b.stats().events_dropped, 0);
}

/// Two nodes that dial each other at the same moment get two connections;
/// the engine keeps one. Whatever either side sent before it learned which
/// one is kept must still arrive, exactly once, and neither side may see the
/// other as lost.
#[test]
fn two_nodes_dialling_each_other_at_once_lose_nothing() {
    use gwtf::engine::EngineError;
    use gwtf::wire::ControlEnvelope;
    const ROUNDS: u64 = 30;
    const N: u64 = 200;
    // One side sends: frames (data) and control messages, alternating, as
    // fast as the connection takes them, starting the moment one is up.
    fn send_all(me: &Transport, to: u64) {
        let deadline = Instant::now() + T;
        let mut i = 0u64;
        let mut ever_connected = false;
        while i < N {
            assert!(
                Instant::now() < deadline,
                "could not send {N} messages in {T:?}"
            );
            let r = if i % 2 == 0 {
                let mut f = me.alloc(1024, T).unwrap();
                f.header.microbatch = i;
                me.send(to, f, T)
            } else {
                let msg = ControlEnvelope {
                    msg_type: 7,
                    msg_version: 1,
                    body: i.to_le_bytes().to_vec(),
                };
                me.send_control(to, &msg, T)
            };
            match r {
                Ok(()) => {
                    ever_connected = true;
                    i += 1;
                }
                Err(EngineError::NotFound(_)) if !ever_connected => {
                    std::thread::sleep(Duration::from_micros(200))
                }
                Err(e) => panic!("send {i} failed after the peer was connected: {e}"),
            }
        }
    }
    // The other side takes everything until it has all, or the deadline.
    fn receive_all(me: &Transport, from: u64) -> (Vec<u64>, Vec<String>) {
        let mut got = Vec::new();
        let mut lost = Vec::new();
        let deadline = Instant::now() + T;
        while (got.len() as u64) < N && Instant::now() < deadline {
            while let Ok(f) = me.recv(Duration::ZERO) {
                assert_eq!(f.peer(), from);
                got.push(f.header.microbatch);
            }
            match me.poll_event(Duration::from_millis(1)) {
                Some(TransportEvent::Control { msg, .. }) => {
                    got.push(u64::from_le_bytes(msg.body[..8].try_into().unwrap()))
                }
                Some(TransportEvent::PeerLost { reason, .. }) => lost.push(reason.to_string()),
                _ => {}
            }
        }
        got.sort_unstable();
        (got, lost)
    }
    let mut duplicates = 0;
    for round in 0..ROUNDS {
        let a = Transport::new(opts()).unwrap();
        let b = Transport::new(opts()).unwrap();
        let (ida, idb) = (a.node_id(), b.node_id());
        a.connect(b.local_addr().unwrap()).unwrap();
        b.connect(a.local_addr().unwrap()).unwrap();
        let ((ga, la), (gb, lb)) = std::thread::scope(|s| {
            s.spawn(|| send_all(&a, idb));
            s.spawn(|| send_all(&b, ida));
            let ra = s.spawn(|| receive_all(&a, idb));
            let rb = s.spawn(|| receive_all(&b, ida));
            (ra.join().unwrap(), rb.join().unwrap())
        });
        let want: Vec<u64> = (0..N).collect();
        assert_eq!(ga, want, "round {round}: what b sent is not what a got");
        assert_eq!(gb, want, "round {round}: what a sent is not what b got");
        assert!(
            la.is_empty() && lb.is_empty(),
            "round {round}: peer lost: {la:?} {lb:?}"
        );
        assert_eq!(a.stats().peers_connected, 1);
        assert_eq!(b.stats().peers_connected, 1);
        duplicates += a.stats().duplicates_retired;
    }
    // The case this test is about happened (most rounds make two connections).
    assert!(
        duplicates >= ROUNDS / 3,
        "only {duplicates} duplicate connections in {ROUNDS} rounds"
    );
}

/// A shared frame is sent as often as needed without a copy; its pool slot
/// comes back when the last share (the caller's, the queued sends') is gone.
#[test]
fn a_shared_frame_is_sent_several_times_without_a_copy() {
    use gwtf::engine::SharedFrame;
    let a = Transport::new(opts()).unwrap();
    let b = Transport::new(opts()).unwrap();
    let peer = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
    let mut f = a.alloc(100_000, T).unwrap();
    for (i, x) in f.payload_mut().iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    let kept: SharedFrame = f.into();
    for i in 0..3u64 {
        let mut h = kept.header;
        h.microbatch = i;
        a.send_shared(peer, h, &kept, T).unwrap();
    }
    for i in 0..3u64 {
        let r = b.recv(T).unwrap();
        assert_eq!(r.header.microbatch, i);
        assert!(r.payload() == kept.payload(), "payload {i} differs");
    }
    let s = a.stats();
    assert_eq!((s.user_copies, s.frames_sent), (0, 3));
    assert!(s.pool.in_use_bytes > 0, "the kept share holds its slot");
    drop(kept);
    let deadline = Instant::now() + T;
    while a.stats().pool.in_use_bytes > 0 {
        assert!(Instant::now() < deadline, "the slot never came back");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The emulated cut (`set_link_cut`): while cut, a node neither delivers
/// what its peer sends nor sends anything, its connection stays (a short
/// cut costs none), and what was sent both ways arrives once the link is
/// back. A cut longer than the peer timeout loses the peer on both sides;
/// the cut side's close reaches the other only after link-up, as over a
/// real cut, and the two connect again then.
#[test]
fn a_cut_link_delivers_nothing_until_it_is_restored() {
    let a = Transport::new(opts()).unwrap();
    let b = Transport::new(opts()).unwrap();
    let peer = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
    wait_event(&b, |e| matches!(e, TransportEvent::PeerConnected { .. }));
    let frame = |n: &Transport, tag: u64| {
        let mut f = n.alloc(1000, T).unwrap();
        f.header.microbatch = tag;
        f
    };
    // Shorter than the 2 s peer timeout.
    a.set_link_cut(true);
    b.send(a.node_id(), frame(&b, 1), T).unwrap();
    a.send(peer, frame(&a, 2), T).unwrap();
    assert!(
        a.recv(Duration::from_millis(700)).is_err(),
        "read while cut"
    );
    assert!(
        b.recv(Duration::from_millis(700)).is_err(),
        "sent while cut"
    );
    a.set_link_cut(false);
    assert_eq!(a.recv(T).unwrap().header.microbatch, 1);
    assert_eq!(b.recv(T).unwrap().header.microbatch, 2);
    let lost = |n: &Transport| {
        std::iter::from_fn(|| n.poll_event(Duration::from_millis(50)))
            .any(|e| matches!(e, TransportEvent::PeerLost { .. }))
    };
    assert!(!lost(&a) && !lost(&b), "a short cut cost the connection");

    // Longer than the peer timeout: each side gives the other up, b
    // through its own timer, not through a's close (held until link-up).
    a.set_link_cut(true);
    let t = Instant::now();
    wait_event(&b, |e| matches!(e, TransportEvent::PeerLost { .. }));
    let b_lost = t.elapsed();
    assert!(b_lost >= Duration::from_millis(1500), "{b_lost:?}");
    wait_event(&a, |e| matches!(e, TransportEvent::PeerLost { .. }));
    // While cut, a dial fails.
    assert!(a
        .connect_wait(b.local_addr().unwrap(), Duration::from_secs(1))
        .is_err());
    a.set_link_cut(false);
    let again = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
    a.send(again, frame(&a, 3), T).unwrap();
    assert_eq!(b.recv(T).unwrap().header.microbatch, 3);
}
