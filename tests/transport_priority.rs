//! Control frames never wait behind data: a long data frame on a slow
//! (emulated) link does not hold back the heartbeats and control messages
//! of its connection, nor the node's other connections, and no side takes
//! the other for dead while it arrives.

use std::time::{Duration, Instant};

use gwtf::engine::{Incoming, LinkEmulation, NodeOptions, Transport, TransportEvent};
use gwtf::wire::ControlEnvelope;

const KEY: &[u8] = b"0123456789abcdef-test-swarm-key";
const T: Duration = Duration::from_secs(20);
/// 100 Mbit/s.
const RATE: u64 = 12_500_000;
const BIG: usize = 32 << 20;

fn opts(link: Option<LinkEmulation>) -> NodeOptions {
    NodeOptions {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        swarm_key: KEY.to_vec(),
        max_payload: 40 << 20,
        pool_bytes: 96 << 20,
        heartbeat_interval: Duration::from_millis(200),
        // Far shorter than the big frame takes (about 2.7 s).
        peer_timeout: Duration::from_secs(1),
        link,
        ..NodeOptions::default()
    }
}

fn ctrl(msg_type: u16) -> ControlEnvelope {
    ControlEnvelope {
        msg_type,
        msg_version: 1,
        body: vec![7; 100],
    }
}

fn byte(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

/// What one node saw until `until`, or until it has the big frame and
/// every control message it waits for.
#[derive(Default, Debug)]
struct Seen {
    controls: Vec<(u16, Instant)>,
    big: Option<Instant>,
    lost: Vec<String>,
}

fn watch(node: &Transport, want_controls: usize, want_big: bool, until: Instant) -> Seen {
    let mut seen = Seen::default();
    let mut done: Option<Instant> = None;
    while Instant::now() < until {
        if seen.controls.len() >= want_controls && (!want_big || seen.big.is_some()) {
            // Stay a little longer: a peer lost right after counts too.
            let d = *done.get_or_insert_with(Instant::now);
            if d.elapsed() > Duration::from_millis(1500) {
                break;
            }
        }
        match node.next_incoming(Duration::from_millis(20)) {
            Some(Incoming::Frame(f)) => {
                assert_eq!(f.len(), BIG);
                let p = f.payload();
                assert!(
                    (0..BIG).step_by(4093).all(|i| p[i] == byte(i)),
                    "payload corrupted"
                );
                seen.big = Some(Instant::now());
            }
            Some(Incoming::Event(TransportEvent::Control { msg, .. })) => {
                seen.controls.push((msg.msg_type, Instant::now()));
            }
            Some(Incoming::Event(e @ TransportEvent::PeerLost { .. })) => {
                seen.lost.push(format!("{e:?}"))
            }
            _ => {}
        }
    }
    seen
}

#[test]
fn control_frames_overtake_a_long_data_frame_and_no_peer_is_lost() {
    let link = LinkEmulation {
        delay: Duration::ZERO,
        bandwidth_bytes_per_s: RATE,
    };
    let a = Transport::new(opts(Some(link))).unwrap();
    let b = Transport::new(opts(None)).unwrap();
    let c = Transport::new(opts(None)).unwrap();
    let pb = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
    let pc = a.connect_wait(c.local_addr().unwrap(), T).unwrap();
    let pa = a.node_id();
    // Let both connections settle (handshakes, first heartbeats).
    std::thread::sleep(Duration::from_millis(300));

    let mut f = a.alloc(BIG, T).unwrap();
    for (i, x) in f.payload_mut().iter_mut().enumerate() {
        *x = byte(i);
    }
    let t0 = Instant::now();
    a.send(pb, f, T).unwrap();
    let until = t0 + Duration::from_secs(25);
    let (sa, sb, sc, t1) = std::thread::scope(|s| {
        let hb = s.spawn(|| watch(&b, 1, true, until));
        let hc = s.spawn(|| watch(&c, 1, false, until));
        let ha = s.spawn(|| watch(&a, 1, false, until));
        // Well inside the big frame's transfer.
        std::thread::sleep(Duration::from_millis(300));
        let t1 = Instant::now();
        a.send_control(pb, &ctrl(9), T).unwrap();
        a.send_control(pc, &ctrl(10), T).unwrap();
        b.send_control(pa, &ctrl(11), T).unwrap();
        (
            ha.join().unwrap(),
            hb.join().unwrap(),
            hc.join().unwrap(),
            t1,
        )
    });
    let big = sb.big.expect("the big frame arrived") - t0;
    let ideal = Duration::from_secs_f64(BIG as f64 / RATE as f64);
    assert!(
        big >= ideal.mul_f64(0.75),
        "the link emulation still caps the data: {big:?} for {BIG} bytes at {RATE} B/s"
    );
    let bound = big / 4;
    let after = |seen: &Seen, ty: u16, who: &str| {
        let (_, at) = seen
            .controls
            .iter()
            .find(|(t, _)| *t == ty)
            .unwrap_or_else(|| panic!("{who} never got control message {ty}: {seen:?}"));
        let d = *at - t1;
        assert!(
            d < bound,
            "{who}: control message {ty} took {d:?} (the big frame {big:?}, bound {bound:?})"
        );
        d
    };
    // On the same connection, ahead of the rest of the big frame.
    let d_same = after(&sb, 9, "receiver");
    assert!(sb.controls[0].1 < sb.big.unwrap(), "{sb:?}");
    // On the sender's other connection, and from the receiver to the
    // sender: the sender's poll thread is not busy pacing the big frame.
    let d_other = after(&sc, 10, "third node");
    let d_back = after(&sa, 11, "sender");
    eprintln!(
        "big frame {big:?}; control on its connection {d_same:?}, \
         on another connection {d_other:?}, back to the sender {d_back:?}"
    );
    for (who, s) in [("sender", &sa), ("receiver", &sb), ("third node", &sc)] {
        assert!(
            s.lost.is_empty(),
            "{who} lost a peer during the transfer: {:?}",
            s.lost
        );
    }
    assert!(a.is_connected(pb) && b.is_connected(pa) && c.is_connected(pa));
}

#[test]
fn sliced_and_whole_frames_keep_their_order_with_control_in_between() {
    // Unlimited link: frames of every size around the slice length, each
    // followed by a control message; data order is kept, and every frame
    // is intact.
    let a = Transport::new(opts(None)).unwrap();
    let b = Transport::new(opts(None)).unwrap();
    let pb = a.connect_wait(b.local_addr().unwrap(), T).unwrap();
    let sizes = [
        0usize,
        1,
        1000,
        (256 << 10) - 1,
        256 << 10,
        (256 << 10) + 1,
        3 << 20,
        (5 << 20) + 17,
        40 << 10,
    ];
    std::thread::scope(|s| {
        s.spawn(|| {
            for (i, &n) in sizes.iter().enumerate() {
                let mut f = a.alloc(n, T).unwrap();
                for (j, x) in f.payload_mut().iter_mut().enumerate() {
                    *x = byte(j + i);
                }
                f.header.microbatch = i as u64;
                a.send(pb, f, T).unwrap();
                a.send_control(pb, &ctrl(100 + i as u16), T).unwrap();
            }
        });
        let deadline = Instant::now() + T;
        let (mut frames, mut controls) = (0usize, 0usize);
        while (frames < sizes.len() || controls < sizes.len()) && Instant::now() < deadline {
            match b.next_incoming(Duration::from_millis(50)) {
                Some(Incoming::Frame(f)) => {
                    assert_eq!(f.header.microbatch, frames as u64, "data order");
                    assert_eq!(f.len(), sizes[frames]);
                    assert!(f
                        .payload()
                        .iter()
                        .enumerate()
                        .all(|(j, x)| *x == byte(j + frames)));
                    frames += 1;
                }
                Some(Incoming::Event(TransportEvent::Control { msg, .. })) => {
                    assert_eq!(msg.msg_type, 100 + controls as u16, "control order");
                    controls += 1;
                }
                Some(Incoming::Event(e @ TransportEvent::PeerLost { .. })) => panic!("{e:?}"),
                _ => {}
            }
        }
        assert_eq!((frames, controls), (sizes.len(), sizes.len()));
    });
    assert_eq!(b.stats().pool.in_use_bytes, 0);
}
