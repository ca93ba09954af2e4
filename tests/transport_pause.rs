//! A node that did not run for a while (SIGSTOP, a starved host) does not
//! hold its own stall against its peers: on waking it reads what they sent
//! meanwhile before judging them, so a pause shorter than the peers' own
//! timeout costs no connection.
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gwtf::engine::{Event, Node, NodeOptions};

const KEY: &[u8] = b"0123456789abcdef-test-swarm-key";
const T: Duration = Duration::from_secs(20);

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: plain kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, sig) }, 0);
}

#[test]
fn a_node_paused_longer_than_its_peer_timeout_keeps_its_peers() {
    let dir = std::env::temp_dir().join(format!("gwtf-pause-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("key");
    std::fs::write(&key_file, KEY).unwrap();
    // The echo node judges its peers after 1 s of silence.
    let mut echo = Command::new(env!("CARGO_BIN_EXE_gwtf"))
        .args(["echo", "--listen", "127.0.0.1:0", "--swarm-key-file"])
        .arg(&key_file)
        .args(["--heartbeat-ms", "100", "--peer-timeout-ms", "1000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(echo.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split_whitespace()
        .nth(4)
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .parse()
        .unwrap();
    // This node is patient: any connection loss comes from the echo node.
    let me = Node::new(NodeOptions {
        listen: None,
        swarm_key: KEY.to_vec(),
        max_payload: 1 << 20,
        pool_bytes: 8 << 20,
        heartbeat_interval: Duration::from_millis(100),
        peer_timeout: Duration::from_secs(60),
        ..NodeOptions::default()
    })
    .unwrap();
    let peer = me.connect_wait(addr, T).unwrap();
    let round_trip = |n: u64| {
        let mut f = me.alloc(64, T).unwrap();
        f.header.microbatch = n;
        me.send(peer, f, T).unwrap();
        let back = me.recv(T).unwrap();
        assert_eq!(back.header.microbatch, n);
    };
    round_trip(1);
    signal(echo.id(), libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(3));
    signal(echo.id(), libc::SIGCONT);
    // Time for the echo node to run its timers several times over.
    std::thread::sleep(Duration::from_millis(1500));
    round_trip(2);
    let mut lost = Vec::new();
    let until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < until {
        if let Some(ev) = me.poll_event(Duration::from_millis(50)) {
            if matches!(ev, Event::PeerLost { .. }) {
                lost.push(format!("{ev:?}"));
            }
        }
    }
    signal(echo.id(), libc::SIGTERM);
    let out = echo.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        lost.is_empty(),
        "the connection was lost: {lost:?}\n{stderr}"
    );
    assert!(
        !stderr.contains("lost"),
        "the paused node dropped its peer:\n{stderr}"
    );
}
