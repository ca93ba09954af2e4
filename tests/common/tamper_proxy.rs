//! A TCP proxy that flips one byte of the first data frame's payload it
//! forwards from the connecting side (after the handshake), and forwards
//! everything else as it is: someone on the path who lets the handshake
//! through and then rewrites an activation.
#![allow(dead_code)]

use gwtf::wire::handshake::{MSG1_LEN, MSG3_LEN, PREAMBLE_LEN};
use gwtf::wire::{FrameKind, HEAD_LEN};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A running proxy: peers dial `addr` to reach `target`.
pub struct TamperProxy {
    pub addr: SocketAddr,
    /// Payload bytes flipped so far (at most `budget`, shared).
    pub tampered: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Drop for TamperProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl TamperProxy {
    /// A proxy to `target` that flips one byte in each data frame it sees
    /// while `tampered` is below `budget` (shared by proxies that share
    /// the counter).
    pub fn start(target: SocketAddr, tampered: Arc<AtomicUsize>, budget: usize) -> TamperProxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (s, t) = (stop.clone(), tampered.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((a, _)) => {
                        let Ok(b) = TcpStream::connect(target) else {
                            continue;
                        };
                        a.set_nonblocking(false).unwrap();
                        let _ = a.set_nodelay(true);
                        let _ = b.set_nodelay(true);
                        let (a2, b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
                        let t = t.clone();
                        std::thread::spawn(move || pump_tampering(a, b, t, budget));
                        std::thread::spawn(move || pump(b2, a2));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        TamperProxy {
            addr,
            tampered,
            stop,
        }
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// Connector to acceptor: the handshake's bytes pass, then frames are
/// followed (header, tag, payload) and one payload byte of a data frame
/// (or of a slice of one) is flipped.
fn pump_tampering(
    mut from: TcpStream,
    mut to: TcpStream,
    tampered: Arc<AtomicUsize>,
    budget: usize,
) {
    let mut skip = PREAMBLE_LEN + MSG1_LEN + MSG3_LEN;
    let mut head = Vec::with_capacity(HEAD_LEN);
    // Payload bytes of the current frame still to pass, and whether one
    // of them is to be flipped.
    let mut payload = 0u64;
    let mut flip = false;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut i = 0;
        while i < n {
            if skip > 0 {
                let k = skip.min(n - i);
                skip -= k;
                i += k;
            } else if payload > 0 {
                let k = (payload as usize).min(n - i);
                if flip {
                    buf[i + k / 2] ^= 0x20;
                    flip = false;
                }
                payload -= k as u64;
                i += k;
            } else {
                let k = (HEAD_LEN - head.len()).min(n - i);
                head.extend_from_slice(&buf[i..i + k]);
                i += k;
                if head.len() == HEAD_LEN {
                    let kind = u16::from_le_bytes([head[6], head[7]]);
                    let len = u64::from_le_bytes(head[80..88].try_into().unwrap());
                    payload = if kind == FrameKind::Sliced as u16 {
                        0
                    } else {
                        len
                    };
                    let data = kind == FrameKind::Data as u16 || kind == FrameKind::Slice as u16;
                    if data && payload > 0 && tampered.load(Ordering::SeqCst) < budget {
                        tampered.fetch_add(1, Ordering::SeqCst);
                        flip = true;
                    }
                    head.clear();
                }
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}
