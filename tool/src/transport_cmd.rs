//! `gwtf echo` (a diagnostic peer) and `gwtf bench transport` (framed
//! zero-copy transport, with integrity tags and with encryption, against
//! raw TCP, interleaved, in one run).
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use clap::Args;
use gwtf::engine::{LinkEmulation, NodeOptions, Transport, TransportEvent};
use gwtf::wire::handshake::MIN_KEY_LEN;
use gwtf::wire::NodeKey;

use super::checks;

#[derive(Args)]
pub struct EchoArgs {
    /// Address to listen on (port 0: any free port; the address is printed).
    #[arg(long)]
    pub listen: SocketAddr,
    /// File holding the swarm key (raw bytes; trailing whitespace ignored).
    #[arg(long)]
    pub swarm_key_file: PathBuf,
    /// Encrypt frame payloads (a connection encrypts when either end asks).
    #[arg(long)]
    pub encrypt: bool,
    /// This node's private key, created on first start when missing; the
    /// node's id follows from it [default: a fresh key for this run].
    #[arg(long, value_name = "FILE")]
    pub node_key: Option<PathBuf>,
    /// Insecure, for test swarms with fixed ids: take id N, and accept peers
    /// whose ids do not follow from their keys (any holder of the swarm key
    /// can then act as any node).
    #[arg(long, value_name = "N", value_parser = checks::int_at_least::<u64>(1))]
    pub chosen_id: Option<u64>,
    /// Largest payload accepted.
    #[arg(long, default_value_t = 256 << 20, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(1))]
    pub max_payload: u64,
    /// Frame pool size in bytes.
    #[arg(long, default_value_t = 1 << 30, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    pub pool_bytes: usize,
    #[arg(long, default_value_t = 1000, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(1))]
    pub heartbeat_ms: u64,
    #[arg(long, default_value_t = 10000, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(1))]
    pub peer_timeout_ms: u64,
    #[arg(long, default_value_t = 5000, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(1))]
    pub handshake_timeout_ms: u64,
    #[arg(long, default_value_t = 10000, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(1))]
    pub frame_timeout_ms: u64,
    /// Emulated one-way delay added on the send side (milliseconds).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(0))]
    pub link_delay_ms: u64,
    /// Emulated bandwidth cap on the send side (bytes per second, 0: none).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<u64>(0))]
    pub link_bandwidth: u64,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

pub fn read_key(path: &std::path::Path) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let mut key = std::fs::read(path)
        .map_err(|e| format!("cannot read --swarm-key-file {}: {e}", path.display()))?;
    while key.last().is_some_and(|b| b.is_ascii_whitespace()) {
        key.pop();
    }
    if key.len() < MIN_KEY_LEN {
        return Err(format!(
            "--swarm-key-file {}: the key has {} bytes, at least {MIN_KEY_LEN} are needed",
            path.display(),
            key.len()
        )
        .into());
    }
    Ok(key)
}

/// The key at `--node-key FILE` (created when missing, said on stderr by
/// `who`), or a fresh one for this run.
pub fn node_key(path: Option<&std::path::Path>, who: &str) -> Result<NodeKey, String> {
    let Some(path) = path else {
        return NodeKey::generate().map_err(|e| e.to_string());
    };
    let (key, created) = NodeKey::load_or_create(path)?;
    if created {
        eprintln!(
            "{who}: created node key {} (node id {})",
            path.display(),
            key.node_id()
        );
    }
    Ok(key)
}

pub fn echo(args: EchoArgs) -> super::CliResult {
    let key = read_key(&args.swarm_key_file)?;
    let node_key = node_key(args.node_key.as_deref(), "gwtf echo")?;
    let link = (args.link_delay_ms > 0 || args.link_bandwidth > 0).then(|| LinkEmulation {
        delay: Duration::from_millis(args.link_delay_ms),
        bandwidth_bytes_per_s: args.link_bandwidth,
    });
    let node = Transport::new(NodeOptions {
        listen: Some(args.listen),
        swarm_key: key,
        node_id: args.chosen_id.unwrap_or(0),
        chosen_ids: args.chosen_id.is_some(),
        node_key: Some(node_key),
        max_payload: args.max_payload,
        pool_bytes: args.pool_bytes,
        heartbeat_interval: Duration::from_millis(args.heartbeat_ms),
        peer_timeout: Duration::from_millis(args.peer_timeout_ms),
        handshake_timeout: Duration::from_millis(args.handshake_timeout_ms),
        frame_timeout: Duration::from_millis(args.frame_timeout_ms),
        link,
        encrypt: args.encrypt,
        ..NodeOptions::default()
    })?;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    println!(
        "gwtf echo: listening on {} as node {:x}",
        node.local_addr().expect("listening"),
        node.node_id()
    );
    std::io::stdout().flush()?;
    while !STOP.load(Ordering::SeqCst) {
        while let Some(ev) = node.poll_event(Duration::ZERO) {
            match ev {
                TransportEvent::Refused {
                    addr,
                    inbound,
                    reason,
                } => eprintln!(
                    "gwtf echo: refused {} connection from {addr}: {reason}",
                    if inbound { "inbound" } else { "outbound" }
                ),
                TransportEvent::PeerConnected { peer, addr, .. } => {
                    eprintln!("gwtf echo: peer {peer:x} connected from {addr}")
                }
                TransportEvent::PeerLost { peer, addr, reason } => {
                    eprintln!("gwtf echo: peer {peer:x} ({addr}) lost: {reason}")
                }
                other => eprintln!("gwtf echo: {other:?}"),
            }
        }
        match node.recv(Duration::from_millis(100)) {
            Ok(frame) => {
                let peer = frame.peer();
                // The received lease goes back out as is: no copy.
                if let Err(e) = node.forward(peer, frame, Duration::from_secs(30)) {
                    eprintln!("gwtf echo: cannot echo to {peer:x}: {e}");
                }
            }
            Err(gwtf::engine::EngineError::Timeout(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let s = node.stats();
    node.shutdown();
    eprintln!(
        "gwtf echo: stopped; {} frames / {} bytes echoed, {} user-space copies, {} refused ({} of them not reported one by one), {} closed for a bad tag",
        s.frames_received, s.bytes_received, s.user_copies, s.connections_refused, s.refusals_unreported, s.tag_failures
    );
    Ok(())
}

// ---------------------------------------------------------------- benchmark

#[derive(Args)]
pub struct BenchTransportArgs {
    /// Frame sizes in bytes (suffix K or M).
    #[arg(long, value_delimiter = ',', default_value = "64K,1M,16M,64M")]
    pub sizes: Vec<String>,
    /// Connection counts (each >= 1).
    #[arg(long, value_delimiter = ',', default_value = "1,4", allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    pub conns: Vec<usize>,
    /// Measured rounds per case (raw, tagged, encrypted; after one warm-up round; >= 1).
    #[arg(long, default_value_t = 5, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    pub pairs: usize,
    /// Payload bytes per measurement (all connections together; suffix K, M or G).
    #[arg(long, default_value = "1G")]
    pub bytes: String,
    /// Round trips for the latency measurement (each path), taken in
    /// `--rtt-rounds` interleaved rounds (raw, framed, raw, framed ...).
    #[arg(long, default_value_t = 2000, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    pub rtt_iters: usize,
    /// Interleaved rounds of the latency measurement (1..=--rtt-iters).
    #[arg(long, default_value_t = 10, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    pub rtt_rounds: usize,
    /// Payload CRC32C on the framed path (off: header CRC only).
    #[arg(long)]
    pub payload_crc: bool,
    /// One JSON object per case instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A positive byte count with an optional K, M or G suffix (binary units).
fn parse_size(flag: &str, s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n = num
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("{flag} {s}: not a byte count such as 4096, 64K, 16M or 1G"))?;
    if n == 0 {
        return Err(format!("{flag} {s}: must be > 0"));
    }
    Ok(n)
}

const BENCH_KEY: &[u8] = b"gwtf-bench-transport-swarm-key!!";

fn raw_pairs(c: usize) -> std::io::Result<Vec<(TcpStream, TcpStream)>> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    (0..c)
        .map(|_| {
            let s = TcpStream::connect(addr)?;
            let (r, _) = l.accept()?;
            s.set_nodelay(true)?;
            r.set_nodelay(true)?;
            Ok((s, r))
        })
        .collect()
}

/// Raw TCP: back-to-back writes of a reused buffer into reads of a reused buffer.
/// CPU time this process has used (every thread, user and system: on
/// loopback the kernel's TCP work is done in the senders' and receivers'
/// system calls), in seconds.
fn process_cpu_s() -> f64 {
    // SAFETY: getrusage writes one rusage struct, ours.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Runs one throughput measurement: its GB/s and how many cores it kept
/// busy on average.
fn with_cpu(run: impl FnOnce() -> f64) -> (f64, f64) {
    let (c0, t0) = (process_cpu_s(), Instant::now());
    let gbps = run();
    let busy = (process_cpu_s() - c0) / t0.elapsed().as_secs_f64();
    (gbps, busy)
}

fn raw_run(pairs: &[(TcpStream, TcpStream)], size: usize, per_conn: usize) -> f64 {
    let barrier = Barrier::new(2 * pairs.len() + 1);
    std::thread::scope(|s| {
        let mut receivers = Vec::new();
        for (tx, rx) in pairs {
            let b = &barrier;
            s.spawn(move || {
                let buf = vec![0xabu8; size];
                let mut tx = tx;
                b.wait();
                for _ in 0..per_conn {
                    tx.write_all(&buf).expect("raw send");
                }
            });
            receivers.push(s.spawn(move || {
                let mut buf = vec![0u8; size];
                b.wait();
                for _ in 0..per_conn {
                    recv_waitall(rx, &mut buf).expect("raw recv");
                }
            }));
        }
        barrier.wait();
        let t0 = Instant::now();
        for r in receivers {
            r.join().expect("receiver");
        }
        let dt = t0.elapsed().as_secs_f64();
        (size * per_conn * pairs.len()) as f64 / dt / 1e9
    })
}

/// The strongest blocking receive loop: `recv(MSG_WAITALL)` sleeps in the
/// kernel until the whole message is there (as the shared reference harness
/// does), instead of returning to user space per segment.
fn recv_waitall(rx: &TcpStream, buf: &mut [u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut off = 0;
    while off < buf.len() {
        let rest = &mut buf[off..];
        // SAFETY: `rest` is a valid writable buffer of `rest.len()` bytes and
        // the descriptor is owned by `rx` for the duration of the call.
        let n = unsafe {
            libc::recv(
                rx.as_raw_fd(),
                rest.as_mut_ptr().cast(),
                rest.len(),
                libc::MSG_WAITALL,
            )
        };
        match n {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            n => off += n as usize,
        }
    }
    Ok(())
}

/// Round-trip times (us) of 64-byte messages on a raw socket pair.
fn raw_rtt(pair: &(TcpStream, TcpStream), iters: usize) -> Vec<f64> {
    let (a, b) = pair;
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut b = b;
            let mut buf = [0u8; 64];
            for _ in 0..iters {
                b.read_exact(&mut buf).expect("rtt read");
                b.write_all(&buf).expect("rtt write");
            }
        });
        let mut a = a;
        let mut buf = [7u8; 64];
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            a.write_all(&buf).expect("rtt write");
            a.read_exact(&mut buf).expect("rtt read");
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        times
    })
}

/// The framed side of a case: `c` independent connections, each between its
/// own sending and receiving node (as raw TCP has `c` independent sockets,
/// each with its own sender and receiver thread).
struct FramedPair {
    tx: Transport,
    rx: Transport,
    peer: u64,
}

fn framed_pairs(
    c: usize,
    size: usize,
    crc: bool,
    encrypt: bool,
) -> Result<Vec<FramedPair>, Box<dyn std::error::Error>> {
    let depth = ((16usize << 20) / size).clamp(2, 256);
    let pool = size.max(4096).next_power_of_two() * (depth + 6);
    (0..c)
        .map(|_| {
            let o = NodeOptions {
                listen: Some("127.0.0.1:0".parse().expect("addr")),
                swarm_key: BENCH_KEY.to_vec(),
                max_payload: size as u64,
                pool_bytes: pool,
                send_queue_depth: depth,
                payload_crc_max: if crc { u64::MAX } else { 0 },
                peer_timeout: Duration::from_secs(60),
                encrypt,
                ..NodeOptions::default()
            };
            let rx = Transport::new(o.clone())?;
            let tx = Transport::new(NodeOptions { listen: None, ..o })?;
            let peer =
                tx.connect_wait(rx.local_addr().expect("listening"), Duration::from_secs(10))?;
            Ok(FramedPair { tx, rx, peer })
        })
        .collect()
}

const T: Duration = Duration::from_secs(60);

/// Framed: alloc a pool slot, set the header, send (writev of header + slot);
/// the receiver gets the payload read straight into a slot and checks it.
fn framed_run(pairs: &[FramedPair], size: usize, per_conn: usize) -> f64 {
    let barrier = Barrier::new(2 * pairs.len() + 1);
    std::thread::scope(|s| {
        let mut receivers = Vec::new();
        for p in pairs {
            let b = &barrier;
            s.spawn(move || {
                b.wait();
                for i in 0..per_conn {
                    let mut f = p.tx.alloc(size, T).expect("alloc");
                    f.header.microbatch = i as u64;
                    p.tx.send(p.peer, f, T).expect("send");
                }
            });
            receivers.push(s.spawn(move || {
                b.wait();
                for i in 0..per_conn {
                    let f = p.rx.recv(T).expect("recv");
                    assert!(
                        f.header.microbatch == i as u64 && f.len() == size,
                        "bad frame"
                    );
                }
            }));
        }
        barrier.wait();
        let t0 = Instant::now();
        for r in receivers {
            r.join().expect("receiver");
        }
        let dt = t0.elapsed().as_secs_f64();
        (size * per_conn * pairs.len()) as f64 / dt / 1e9
    })
}

/// Round-trip times (us) of 64-byte frames through both nodes' poll threads.
fn framed_rtt(p: &FramedPair, iters: usize) -> Vec<f64> {
    let (tx, peer) = (&p.tx, &p.peer);
    let back = tx.node_id();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..iters {
                let f = p.rx.recv(T).expect("rtt recv");
                p.rx.forward(back, f, T).expect("rtt echo");
            }
            stop.store(true, Ordering::SeqCst);
        });
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            let f = tx.alloc(64, T).expect("alloc");
            tx.send(*peer, f, T).expect("send");
            let r = tx.recv(T).expect("rtt recv");
            drop(r);
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        times
    })
}

fn median(v: &mut [f64]) -> f64 {
    quantile(v, 0.5)
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// A round trip slower than this waited for a CPU: on a loaded machine a
/// woken thread can wait a whole scheduler time slice (about 4 ms here).
const SLOW_RTT_US: f64 = 1000.0;

/// Latency of both paths, measured in interleaved rounds so that a burst of
/// load from other processes hits both alike.
struct Rtt {
    raw: Vec<f64>,
    framed: Vec<f64>,
}

impl Rtt {
    fn measure(
        raw: &(TcpStream, TcpStream),
        framed: &FramedPair,
        iters: usize,
        rounds: usize,
    ) -> Rtt {
        let per_round = iters.div_ceil(rounds).max(1);
        let (mut r, mut f) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            r.extend(raw_rtt(raw, per_round));
            f.extend(framed_rtt(framed, per_round));
        }
        Rtt { raw: r, framed: f }
    }
    fn slow(v: &[f64]) -> usize {
        v.iter().filter(|&&t| t > SLOW_RTT_US).count()
    }
}

/// What one core does per second here, to read the ratios against: the
/// tag and the encryption cost CPU that raw TCP does not spend.
struct CoreRates {
    memcpy: f64,
    blake3: f64,
    aes_gcm: f64,
}

impl CoreRates {
    fn measure() -> CoreRates {
        const N: usize = 16 << 20;
        let src = vec![0x5au8; N];
        let mut dst = vec![0u8; N];
        let best = |f: &mut dyn FnMut()| {
            (0..5)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    N as f64 / t.elapsed().as_secs_f64() / 1e9
                })
                .fold(0.0f64, f64::max)
        };
        let memcpy = best(&mut || {
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
        });
        let key = [7u8; 32];
        let blake3 = best(&mut || {
            std::hint::black_box(blake3::keyed_hash(&key, &src));
        });
        let aead = ring::aead::LessSafeKey::new(
            ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &key).expect("32-byte key"),
        );
        let mut seq = 0u64;
        let aes_gcm = best(&mut || {
            seq += 1;
            let mut n = [0u8; 12];
            n[4..].copy_from_slice(&seq.to_le_bytes());
            let tag = aead
                .seal_in_place_separate_tag(
                    ring::aead::Nonce::assume_unique_for_key(n),
                    ring::aead::Aad::empty(),
                    &mut dst,
                )
                .expect("in range");
            let _ = std::hint::black_box(tag);
        });
        CoreRates {
            memcpy,
            blake3,
            aes_gcm,
        }
    }
}

/// The 1-minute load average, when the system reports one.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub fn bench(args: BenchTransportArgs) -> super::CliResult {
    let total = parse_size("--bytes", &args.bytes)? as usize;
    let sizes = args
        .sizes
        .iter()
        .map(|s| parse_size("--sizes", s).map(|n| (s, n as usize)))
        .collect::<Result<Vec<_>, _>>()?;
    if args.rtt_rounds > args.rtt_iters {
        return Err(format!(
            "--rtt-rounds {} is more than --rtt-iters {}: each round needs a round trip",
            args.rtt_rounds, args.rtt_iters
        )
        .into());
    }
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = load_average();
    if let Some(l) = load.filter(|&l| l >= cores as f64) {
        eprintln!(
            "gwtf bench transport: warning: load average {l:.1} on {cores} cores: other processes compete for the CPUs. \
             A framed round trip hands over between four threads (caller, two poll threads, echo), a raw one between two; \
             under contention a hand-off can wait a whole scheduler time slice (~4 ms), which the 'slow' column counts."
        );
    }
    let core = CoreRates::measure();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "one_core_gbps": {
                    "memcpy": core.memcpy,
                    "keyed_blake3": core.blake3,
                    "aes_256_gcm": core.aes_gcm,
                }
            })
        );
    } else {
        println!(
            "one core here: memcpy {:.1} GB/s, keyed BLAKE3 {:.1} GB/s, AES-256-GCM {:.1} GB/s (each side of a tagged frame hashes it once; an encrypted one is copied and sealed, then opened)",
            core.memcpy, core.blake3, core.aes_gcm
        );
    }
    if !args.json {
        println!(
            "gwtf bench transport: loopback, {cores} cores, {} rounds (raw, tagged, encrypted, interleaved) after warm-up, >= {} MiB per measurement, payload crc {}",
            args.pairs,
            total >> 20,
            if args.payload_crc { "on" } else { "off (header crc only)" }
        );
        println!(
            "raw: blocking send / recv(MSG_WAITALL) of reused buffers; tagged: pool slot -> writev (header, keyed BLAKE3 tag, slot) -> pool slot, tag checked; encrypted: AES-256-GCM, the sender encrypts a copy, the receiver decrypts in place; TCP_NODELAY on all; one sender and one receiver per connection"
        );
        println!(
            "{:>9} {:>5} {:>9} {:>11} {:>7} {:>13} {:>10} {:>7} {:>13} {:>11} {:>11} {:>8} {:>10} {:>10} {:>6}",
            "size",
            "conns",
            "raw GB/s",
            "tagged GB/s",
            "ratio",
            "(min-max)",
            "enc GB/s",
            "ratio",
            "(min-max)",
            "copies/frm",
            "enc copies",
            "raw rtt",
            "tagged rtt",
            "tag p99",
            "slow"
        );
    }
    for (size_s, size) in sizes {
        for &c in &args.conns {
            let per_conn = total.div_ceil(size * c).max(1);
            let raw = raw_pairs(c)?;
            let framed = framed_pairs(c, size, args.payload_crc, false)?;
            let sealed = framed_pairs(c, size, args.payload_crc, true)?;
            // Warm-up round.
            raw_run(&raw, size, per_conn.div_ceil(4));
            framed_run(&framed, size, per_conn.div_ceil(4));
            framed_run(&sealed, size, per_conn.div_ceil(4));
            let sum =
                |ps: &[FramedPair], f: &dyn Fn(&FramedPair) -> u64| ps.iter().map(f).sum::<u64>();
            let copies = |ps: &[FramedPair]| {
                sum(ps, &|p| p.tx.stats().user_copies + p.rx.stats().user_copies)
            };
            let frames = |ps: &[FramedPair]| sum(ps, &|p| p.rx.stats().frames_received);
            let copies0 = (copies(&framed), copies(&sealed));
            let frames0 = (frames(&framed), frames(&sealed));
            let reads0: u64 = sum(&framed, &|p| p.rx.stats().read_calls);
            let writes0: u64 = sum(&framed, &|p| p.tx.stats().write_calls);
            let (mut raws, mut frs, mut encs) = (Vec::new(), Vec::new(), Vec::new());
            let (mut ratios, mut enc_ratios) = (Vec::new(), Vec::new());
            // Cores each kept busy, and core-nanoseconds per byte.
            let (mut busy, mut cpu_ns) = ([0.0f64; 3], [0.0f64; 3]);
            for _ in 0..args.pairs {
                let r = with_cpu(|| raw_run(&raw, size, per_conn));
                let f = with_cpu(|| framed_run(&framed, size, per_conn));
                let e = with_cpu(|| framed_run(&sealed, size, per_conn));
                for (i, (gbps, b)) in [r, f, e].into_iter().enumerate() {
                    busy[i] += b / args.pairs as f64;
                    cpu_ns[i] += b / gbps / args.pairs as f64;
                }
                let (r, f, e) = (r.0, f.0, e.0);
                raws.push(r);
                frs.push(f);
                encs.push(e);
                ratios.push(f / r);
                enc_ratios.push(e / r);
            }
            // Tagging adds a keyed BLAKE3 pass on each side to raw's work:
            // with every core busy, throughput goes as 1 / CPU per byte.
            let tag_ns = 2.0 / core.blake3;
            let ceiling = cpu_ns[0] / (cpu_ns[0] + tag_ns);
            let per_frame =
                |c1: u64, c0: u64, f1: u64, f0: u64| (c1 - c0) as f64 / (f1 - f0).max(1) as f64;
            let copies_per_frame =
                per_frame(copies(&framed), copies0.0, frames(&framed), frames0.0);
            let enc_copies_per_frame =
                per_frame(copies(&sealed), copies0.1, frames(&sealed), frames0.1);
            let nframes = (frames(&framed) - frames0.0).max(1) as f64;
            let reads_per_frame =
                (sum(&framed, &|p| p.rx.stats().read_calls) - reads0) as f64 / nframes;
            let writes_per_frame =
                (sum(&framed, &|p| p.tx.stats().write_calls) - writes0) as f64 / nframes;
            let mut rtt = Rtt::measure(&raw[0], &framed[0], args.rtt_iters, args.rtt_rounds);
            let (raw_slow, framed_slow) = (Rtt::slow(&rtt.raw), Rtt::slow(&rtt.framed));
            let raw_rtt_us = median(&mut rtt.raw);
            let framed_rtt_us = median(&mut rtt.framed);
            let raw_p99_us = quantile(&mut rtt.raw, 0.99);
            let framed_p99_us = quantile(&mut rtt.framed, 0.99);
            let range = |v: &[f64]| {
                v.iter()
                    .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)))
            };
            let (rmin, rmax) = range(&ratios);
            let (emin, emax) = range(&enc_ratios);
            let ratio = median(&mut ratios.clone());
            let enc_ratio = median(&mut enc_ratios.clone());
            let raw_gbps = median(&mut raws.clone());
            let framed_gbps = median(&mut frs.clone());
            let enc_gbps = median(&mut encs.clone());
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "size_bytes": size,
                        "connections": c,
                        "raw_gbps": raw_gbps,
                        "framed_gbps": framed_gbps,
                        "ratio": ratio,
                        "ratio_min": rmin,
                        "ratio_max": rmax,
                        "encrypted_gbps": enc_gbps,
                        "encrypted_ratio": enc_ratio,
                        "encrypted_ratio_min": emin,
                        "encrypted_ratio_max": emax,
                        "raw_gbps_runs": raws,
                        "framed_gbps_runs": frs,
                        "encrypted_gbps_runs": encs,
                        "copies_per_frame": copies_per_frame,
                        "encrypted_copies_per_frame": enc_copies_per_frame,
                        "read_calls_per_frame": reads_per_frame,
                        "write_calls_per_frame": writes_per_frame,
                        "raw_rtt_us": raw_rtt_us,
                        "framed_rtt_us": framed_rtt_us,
                        "raw_rtt_p99_us": raw_p99_us,
                        "framed_rtt_p99_us": framed_p99_us,
                        "rtt_samples": rtt.framed.len(),
                        "raw_rtt_slow": raw_slow,
                        "framed_rtt_slow": framed_slow,
                        "slow_rtt_threshold_us": SLOW_RTT_US,
                        "load_average": load,
                        "bytes_per_measurement": size * per_conn * c,
                        "pairs": args.pairs,
                        "payload_crc": args.payload_crc,
                        "cores": cores,
                        "cores_busy": {"raw": busy[0], "tagged": busy[1], "encrypted": busy[2]},
                        "cpu_ns_per_byte": {"raw": cpu_ns[0], "tagged": cpu_ns[1], "encrypted": cpu_ns[2]},
                        "tag_passes_ns_per_byte": tag_ns,
                        "tagged_ratio_ceiling": ceiling,
                    })
                );
            } else {
                println!(
                    "{:>9} {:>5} {:>9.2} {:>11.2} {:>7.3} {:>13} {:>10.2} {:>7.3} {:>13} {:>11.1} {:>11.1} {:>6.1}us {:>8.1}us {:>8.1}us {:>6}",
                    size_s,
                    c,
                    raw_gbps,
                    framed_gbps,
                    ratio,
                    format!("({rmin:.2}-{rmax:.2})"),
                    enc_gbps,
                    enc_ratio,
                    format!("({emin:.2}-{emax:.2})"),
                    copies_per_frame,
                    enc_copies_per_frame,
                    raw_rtt_us,
                    framed_rtt_us,
                    framed_p99_us,
                    format!("{framed_slow}/{}", rtt.framed.len())
                );
                println!(
                    "{:>15} cpu: raw keeps {:.2} of {cores} cores busy ({:.2} core-ns per byte), tagged {:.2} ({:.2}), encrypted {:.2} ({:.2}); the two keyed BLAKE3 passes add {:.2}: with every core busy, tagged reaches at most {:.2}x raw here",
                    "",
                    busy[0],
                    cpu_ns[0],
                    busy[1],
                    cpu_ns[1],
                    busy[2],
                    cpu_ns[2],
                    tag_ns,
                    ceiling
                );
            }
            drop(framed);
            drop(sealed);
        }
    }
    Ok(())
}
