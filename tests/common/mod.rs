//! Shared helpers for the tests that build and run C, C++ and Go programs
//! against the built `libgwtf.so`.
#![allow(dead_code)]

pub mod netns;
pub mod skip;
pub mod swarm_inproc;
pub mod swarm_procs;
pub mod tamper_proxy;
pub mod timeline;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::SystemTime;

/// The built `gwtf` tool. It is the workspace's member crate `tool/`, so
/// Cargo gives these tests no `CARGO_BIN_EXE_gwtf`: the tool lies in the
/// profile directory above this test's own executable (`target/debug/deps/`
/// -> `target/debug/gwtf`). `cargo test` at the workspace root builds it
/// (the tool's own integration tests make Cargo build its binary), and so
/// does `scripts/test`; a lone `cargo test --test NAME` does not, so a
/// missing tool, or one older than the library's or the tool's sources,
/// fails loudly instead of testing old code (as [`lib_dir`] does).
pub fn gwtf_exe() -> PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let exe = target_profile_dir().join(format!("gwtf{}", std::env::consts::EXE_SUFFIX));
        let meta = std::fs::metadata(&exe).unwrap_or_else(|_| {
            panic!(
                "{} is missing: build the tool first with `cargo build --bins` (plain \
                 `cargo test` at the workspace root and scripts/test do this)",
                exe.display()
            )
        });
        let built = meta.modified().unwrap();
        let src =
            newest_mtime(&repo_root().join("src")).max(newest_mtime(&repo_root().join("tool/src")));
        assert!(
            built >= src,
            "{} is older than the sources: run `cargo build --bins` again",
            exe.display()
        );
        exe
    })
    .clone()
}

/// A free port on a loopback address of its own (127.a.b.c, drawn at
/// random): bound and released for a node to bind next. Not 127.0.0.1,
/// whose ports the kernel also hands to outgoing connections (a port
/// released there can be taken before the node binds it); a random
/// address makes a clash with another test improbable too.
pub fn free_addr() -> std::net::SocketAddr {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static DRAWN: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(DRAWN.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    let r = h.finish();
    let byte = |shift: u32| 1 + ((r >> shift) % 250) as u8;
    let ip = std::net::Ipv4Addr::new(127, byte(0), byte(8), byte(16));
    std::net::TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// target/<profile>/ of this test run (the test executable lives in its deps/).
pub fn target_profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("test executable in target/<profile>/deps")
        .to_path_buf()
}

fn newest_mtime(dir: &Path) -> SystemTime {
    let mut newest = SystemTime::UNIX_EPOCH;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            let t = if p.is_dir() {
                newest_mtime(&p)
            } else {
                e.metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(SystemTime::UNIX_EPOCH)
            };
            newest = newest.max(t);
        }
    }
    newest
}

/// The directory holding a fresh `libgwtf.so`.
///
/// `cargo test` does not build the cdylib, so the test command runs
/// `cargo build` first; a missing or stale library fails loudly instead of
/// testing old code.
pub fn lib_dir() -> PathBuf {
    let dir = target_profile_dir();
    let so = dir.join("libgwtf.so");
    let meta = std::fs::metadata(&so).unwrap_or_else(|_| {
        panic!(
            "{} is missing: build it first with `cargo build` (scripts/test does this)",
            so.display()
        )
    });
    let built = meta.modified().unwrap();
    let src = newest_mtime(&repo_root().join("src"));
    assert!(
        built >= src,
        "{} is older than the sources: run `cargo build` again (scripts/test does this)",
        so.display()
    );
    dir
}

/// The `gwtf` executable of a release build of this tree, built once per
/// test process with `cargo build --release --bin gwtf` (a few minutes from
/// scratch; a no-op when it is fresh): for swarm tests whose model is too
/// large for a debug build's kernels (llama-small: seconds per microbatch).
pub fn release_gwtf() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let t = std::time::Instant::now();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        run_ok(Command::new(cargo).current_dir(repo_root()).args([
            "build",
            "--release",
            "--bin",
            "gwtf",
        ]));
        // target/<profile>/ of this run: its sibling release/.
        let bin = target_profile_dir()
            .parent()
            .expect("target/")
            .join("release/gwtf");
        assert!(bin.exists(), "{} missing after the build", bin.display());
        eprintln!(
            "release gwtf built (or fresh) in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        bin
    })
    .clone()
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs a command; panics with its full output if it fails.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    if !out.status.success() {
        panic!(
            "{cmd:?} failed with {}\n--- stdout\n{}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

pub fn stdout_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs the built `gwtf` with `args`, which must be refused before any work:
/// it fails within `REFUSE_WITHIN`, prints nothing on stdout, and its error
/// names every string of `names` (the flag, the value, the path). Returns stderr.
pub fn gwtf_refuses(args: &[&str], names: &[&str]) -> String {
    let t = std::time::Instant::now();
    let out = Command::new(gwtf_exe()).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} accepted");
    assert!(
        t.elapsed() < REFUSE_WITHIN,
        "{args:?} took {:?}: the check comes after the work",
        t.elapsed()
    );
    assert_eq!(stdout_of(&out), "", "{args:?} printed before refusing");
    for n in names {
        assert!(
            err.contains(n),
            "{args:?}: error does not name {n:?}: {err}"
        );
    }
    err
}

/// Refusals are immediate; the work they guard (e.g. a simulation of
/// 100,000 iterations) takes far longer, even in a debug build.
pub const REFUSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(20);

/// Flags every C/C++ program of ours is built with.
pub const WARN: &[&str] = &["-Wall", "-Wextra", "-Werror", "-pedantic"];
pub const ASAN: &[&str] = &[
    "-fsanitize=address,undefined",
    "-fno-omit-frame-pointer",
    "-g",
];

/// Compiles C or C++ sources into `out` against include/ and libgwtf.so (with an rpath).
pub fn build_program(compiler: &str, std: &str, sources: &[PathBuf], out: &Path, asan: bool) {
    let lib = lib_dir();
    let mut cmd = Command::new(compiler);
    cmd.arg(format!("-std={std}"))
        .args(WARN)
        .arg(format!("-I{}", repo_root().join("include").display()));
    if asan {
        cmd.args(ASAN);
    }
    cmd.args(sources)
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", soname_dir().display()))
        .arg("-lgwtf");
    run_ok(&mut cmd);
}

/// A directory with `libgwtf.so.<ABI>` linking to the built library: the
/// loader looks the SONAME up, and cargo only writes `libgwtf.so`.
pub fn soname_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let lib = lib_dir();
        let dir = scratch(&format!("soname-{}", std::process::id()));
        let link = dir.join(format!(
            "libgwtf.so.{}",
            gwtf::ffi::version::GWTF_ABI_VERSION
        ));
        std::os::unix::fs::symlink(lib.join("libgwtf.so"), link).unwrap();
        dir
    })
    .clone()
}

/// Environment for running an AddressSanitizer build (leak checks on).
pub fn asan_env(cmd: &mut Command) -> &mut Command {
    cmd.env(
        "ASAN_OPTIONS",
        "detect_leaks=1:abort_on_error=0:halt_on_error=1",
    )
    .env("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
}

/// Builds the stand-in CUDA driver (present, no device) and returns its directory.
pub fn stub_libcuda_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(build_stub_libcuda).clone()
}

fn build_stub_libcuda() -> PathBuf {
    let dir = scratch(&format!("stub-libcuda-{}", std::process::id()));
    let so = dir.join("libcuda.so.1");
    run_ok(
        Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&so)
            .arg(repo_root().join("tests/c/stub_libcuda.c")),
    );
    std::os::unix::fs::symlink("libcuda.so.1", dir.join("libcuda.so")).unwrap();
    dir
}

/// A raw TCP peer through the handshake: for tests that write bytes no
/// node would. Complete frames go out sealed with the connection's keys
/// ([`RawPeer::send`]); anything else as it is ([`RawPeer::send_raw`]).
#[allow(dead_code)]
pub struct RawPeer {
    pub stream: std::net::TcpStream,
    pub conn: gwtf::wire::Connection,
    /// The id it claimed.
    pub id: u64,
}

#[allow(dead_code)]
impl RawPeer {
    /// Seals plain frames (each header followed by its payload) and
    /// writes them.
    pub fn send(&mut self, plain: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        let sealed = gwtf::wire::seal_frames(&mut self.conn, plain).expect("established");
        self.stream.write_all(&sealed)
    }

    /// Seals one plain frame and writes only its first `n` bytes (header
    /// and tag included): a frame cut in the middle.
    pub fn send_prefix(&mut self, plain: &[u8], n: usize) -> std::io::Result<()> {
        use std::io::Write;
        let sealed = gwtf::wire::seal_frames(&mut self.conn, plain).expect("established");
        self.stream.write_all(&sealed[..n.min(sealed.len())])
    }

    /// Writes bytes as they are.
    pub fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        self.stream.write_all(bytes)
    }

    /// The next frame the node sent (tag checked): its header and payload;
    /// None when the stream ends, times out or fails.
    pub fn read_frame(&mut self) -> Option<(gwtf::wire::FrameHeader, Vec<u8>)> {
        use gwtf::wire::{ConnEvent, ReadTarget};
        use std::io::Read;
        let mut payload = Vec::new();
        for _ in 0..100_000 {
            let r = match self.conn.read_target() {
                ReadTarget::Closed => return None,
                ReadTarget::Small(buf) => {
                    let n = self.stream.read(buf).ok().filter(|&n| n > 0)?;
                    self.conn.small_read(n)
                }
                ReadTarget::Payload { remaining, .. } => {
                    let start = payload.len();
                    payload.resize(start + remaining.min(1 << 20) as usize, 0);
                    let n = self
                        .stream
                        .read(&mut payload[start..])
                        .ok()
                        .filter(|&n| n > 0)?;
                    payload.truncate(start + n);
                    self.conn.payload_read(&mut payload, n)
                }
            };
            match r.ok()? {
                Some(ConnEvent::Data(h)) => return Some((h, payload)),
                Some(ConnEvent::DataHeader(_)) | None => {}
                Some(_) => payload.clear(),
            }
        }
        None
    }

    pub fn set_read_timeout(&self, t: std::time::Duration) {
        self.stream.set_read_timeout(Some(t)).unwrap();
    }
}

/// A raw peer through the handshake as node `id` (0: the id of its fresh
/// node key) with `key` (reads time out after `timeout`).
#[allow(dead_code)]
pub fn raw_authenticated(
    addr: std::net::SocketAddr,
    id: u64,
    key: &[u8],
    timeout: std::time::Duration,
) -> RawPeer {
    let s = std::net::TcpStream::connect(addr).unwrap();
    raw_handshake(s, gwtf::wire::Role::Connector, id, key, timeout)
}

/// Takes `s` through the handshake in `role` as node `id` (0: the id of
/// its key) with `key` and a fresh node key (reads time out after
/// `timeout`); returns it established.
#[allow(dead_code)]
pub fn raw_handshake(
    s: std::net::TcpStream,
    role: gwtf::wire::Role,
    id: u64,
    key: &[u8],
    timeout: std::time::Duration,
) -> RawPeer {
    try_raw_handshake(s, role, id, key, timeout).unwrap_or_else(|e| panic!("{e}"))
}

/// [`raw_handshake`], or why it failed.
#[allow(dead_code)]
pub fn try_raw_handshake(
    mut s: std::net::TcpStream,
    role: gwtf::wire::Role,
    id: u64,
    key: &[u8],
    timeout: std::time::Duration,
) -> Result<RawPeer, String> {
    use gwtf::wire::{ConnEvent, ConnOptions, Connection, NodeKey, ReadTarget, SwarmKey};
    use std::io::{Read, Write};
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let node_key = NodeKey::generate().unwrap();
    let id = match id {
        0 => node_key.node_id() as u64,
        id => id,
    };
    // It claims what it is told (a node with bound ids refuses an id not
    // of its key), and takes the other end's id as it comes.
    let mut c = Connection::new(
        role,
        id,
        &SwarmKey::new(key).unwrap(),
        &node_key,
        &ConnOptions {
            chosen_ids: true,
            ..ConnOptions::new(4 << 20)
        },
    );
    for _ in 0..10 {
        s.write_all(&c.take_outgoing()).map_err(|e| e.to_string())?;
        let ReadTarget::Small(buf) = c.read_target() else {
            return Err("handshake state".into());
        };
        let n = s.read(buf).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the node closed the handshake".into());
        }
        if let Some(ConnEvent::Established { .. }) = c.small_read(n).map_err(|e| e.to_string())? {
            s.write_all(&c.take_outgoing()).map_err(|e| e.to_string())?;
            return Ok(RawPeer {
                stream: s,
                conn: c,
                id,
            });
        }
    }
    Err("handshake did not finish".into())
}

/// A TCP connection to `to` from the local address `from` (another
/// loopback address: a second source on one machine).
#[allow(dead_code)]
pub fn connect_from(
    from: std::net::Ipv4Addr,
    to: std::net::SocketAddr,
) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(to) = to else {
        return Err(std::io::Error::other("IPv4 only"));
    };
    let sin = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(ip.octets()),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor this function owns; the
    // addresses are valid sockaddr_in values of `len` bytes.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = std::net::TcpStream::from_raw_fd(fd);
        let src = sin(from, 0);
        if libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let dst = sin(*to.ip(), to.port());
        if libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}
