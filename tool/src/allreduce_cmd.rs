//! `gwtf bench allreduce`: the stage all-reduce (the butterfly up to 64
//! members, the hierarchy beyond, as a commit runs it) of N member
//! processes on loopback TCP, against torch.distributed's gloo all-reduce
//! of the same members and bytes, in the same run.
//!
//! Each member is a process of this tool (`--member`, hidden): it listens,
//! writes its address and node id to a shared directory, connects to the
//! members after it, and then, for every repetition, waits at a barrier
//! (files in that directory) and times its part from the barrier to its
//! end. A repetition's time is its slowest member's; the median over the
//! repetitions is printed, beside gloo's measured the same way
//! (`scripts/allreduce_gloo.py`), and the ratio gloo / ours (above 1: ours
//! is faster). Every member must end with the same bits, or the run fails.
use super::checks;
use clap::Args;
use gwtf::engine::{NodeOptions, Transport};
use gwtf::protocol::rng::Rng;
use gwtf::protocol::BUTTERFLY_MAX_MEMBERS;
use gwtf::swarm::allreduce::{Machine, Outcome};
use gwtf::swarm::allreduce_net;
use gwtf::swarm::butterfly::ButterflyAllReduce;
use gwtf::swarm::hierarchy::HierarchicalAllReduce;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const KEY: &[u8] = b"gwtf-bench-allreduce-loopback-key";
/// How long members wait for each other at a step, at most.
const PATIENCE: Duration = Duration::from_secs(120);

#[derive(Args)]
pub struct BenchAllReduceArgs {
    /// Member counts, comma-separated (each 2..=256; up to 64 the
    /// butterfly, beyond the hierarchy).
    #[arg(long, value_delimiter = ',', default_value = "4,16,64",
          value_parser = checks::int_in::<u32>(2, 256))]
    members: Vec<u32>,
    /// Buffer sizes in MB (f32), comma-separated (each 1..=256). A cell
    /// whose members' buffers and frames would not fit in half this
    /// machine's available memory is skipped, and says so.
    #[arg(long, value_delimiter = ',', default_value = "1,64,256",
          value_parser = checks::int_in::<u32>(1, 256))]
    mb: Vec<u32>,
    /// Timed repetitions per cell, after one untimed (the median is
    /// printed).
    #[arg(long, default_value_t = 3, value_parser = checks::int_in::<u32>(1, 100))]
    reps: u32,
    /// Ours only: do not run gloo.
    #[arg(long)]
    no_gloo: bool,
    /// Python with torch (default: the checkout's .venv, made by
    /// scripts/python-deps).
    #[arg(long)]
    python: Option<PathBuf>,
    /// One member's side (internal): DIR,INDEX,MEMBERS,ELEMENTS,REPS.
    #[arg(long, hide = true)]
    member: Option<String>,
}

pub fn run(a: BenchAllReduceArgs) -> super::CliResult {
    if let Some(spec) = &a.member {
        return member(spec);
    }
    let python = (!a.no_gloo).then(|| {
        a.python
            .clone()
            .unwrap_or_else(|| super::flow_cmd::repo_dir().join(".venv/bin/python"))
    });
    if let Some(p) = &python {
        if !p.exists() {
            return Err(format!(
                "{} not found: run scripts/python-deps first (it installs torch), or pass --no-gloo",
                p.display()
            )
            .into());
        }
    }
    let avail = available_bytes();
    println!(
        "gwtf bench allreduce: {} cores; member processes on loopback TCP; the slowest member's \
         time from a barrier, median of {} repetitions",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        a.reps
    );
    println!(
        "{:>7} {:>6} {:>10} {:>11} {:>11} {:>10}",
        "members", "MB", "algorithm", "ours_s", "gloo_s", "gloo/ours"
    );
    for &n in &a.members {
        for &mb in &a.mb {
            let elements = (mb as usize) << 18;
            let need = n as u64 * member_bytes(elements, n as usize);
            let algo = if n as usize <= BUTTERFLY_MAX_MEMBERS {
                "butterfly"
            } else {
                "hierarchy"
            };
            if need > avail / 2 {
                println!(
                    "{n:>7} {mb:>6} {algo:>10}   skipped: needs about {:.1} GB, {:.1} GB available",
                    need as f64 / 1e9,
                    avail as f64 / 1e9
                );
                continue;
            }
            let ours = median(&run_ours(n, elements, a.reps)?);
            let gloo = match &python {
                Some(p) => Some(median(&run_gloo(p, n, elements, a.reps)?)),
                None => None,
            };
            let (g, ratio) = match gloo {
                Some(g) => (format!("{g:.4}"), format!("{:.2}", g / ours)),
                None => ("-".into(), "-".into()),
            };
            println!("{n:>7} {mb:>6} {algo:>10} {ours:>11.4} {g:>11} {ratio:>10}");
        }
    }
    Ok(())
}

/// Memory one member needs, about: its buffer, the machine's copies, and
/// its frame pool.
fn member_bytes(elements: usize, n: usize) -> u64 {
    let buf = 4 * elements as u64;
    3 * buf + pool_bytes(elements, n) as u64
}

/// The largest frame: a butterfly's part, or a hierarchy's part of the
/// total (its columns are the smallest group's size).
fn max_payload(elements: usize, n: usize) -> u64 {
    let groups = gwtf::swarm::hierarchy::groups(n, BUTTERFLY_MAX_MEMBERS);
    let parts = groups.iter().map(|r| r.len()).min().unwrap_or(1).max(1);
    (4 * (elements + 1).div_ceil(parts) as u64)
        .next_power_of_two()
        .max(1 << 20)
}

/// Frames in flight: every slice out and every part in at once.
fn pool_bytes(elements: usize, n: usize) -> usize {
    (4 * 4 * (elements + 1))
        .next_power_of_two()
        .max(8 * max_payload(elements, n) as usize)
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// MemAvailable, or 8 GB where it cannot be read.
fn available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(8 << 30, |kb| kb * 1024)
}

/// Runs `n` member processes; every repetition's slowest member's seconds.
fn run_ours(n: u32, elements: usize, reps: u32) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!(
        "gwtf-bench-allreduce-{}-{n}-{elements}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for i in 0..n {
        let spec = format!("{},{i},{n},{elements},{reps}", dir.display());
        let child = Command::new(&exe)
            .args(["bench", "allreduce", "--member", &spec])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        children.push(child);
    }
    let mut failed = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
            failed.push(format!("member {i}: {err}"));
        }
    }
    let result = collect(&dir, n, reps);
    let _ = std::fs::remove_dir_all(&dir);
    if !failed.is_empty() {
        return Err(failed.join("; ").into());
    }
    result
}

/// Every member's times and result digest, from its file: the slowest
/// member per repetition, once every digest is the same.
fn collect(dir: &Path, n: u32, reps: u32) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let mut slowest = vec![0f64; reps as usize];
    let mut digest = None;
    for i in 0..n {
        let text = std::fs::read_to_string(dir.join(format!("{i}.result")))?;
        let mut words = text.split_whitespace();
        let d = words.next().ok_or("empty result")?.to_string();
        if *digest.get_or_insert_with(|| d.clone()) != d {
            return Err(format!("member {i} ended with other bits ({d})").into());
        }
        for s in slowest.iter_mut() {
            let t: f64 = words.next().ok_or("too few times")?.parse()?;
            *s = s.max(t);
        }
    }
    Ok(slowest)
}

fn run_gloo(
    python: &Path,
    n: u32,
    elements: usize,
    reps: u32,
) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let script = super::flow_cmd::repo_dir().join("scripts/allreduce_gloo.py");
    let out = Command::new(python)
        .arg(&script)
        .args([n.to_string(), elements.to_string(), (reps + 1).to_string()])
        .output()?;
    if !out.status.success() {
        return Err(format!("gloo: {}", String::from_utf8_lossy(&out.stderr).trim()).into());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().ok_or("gloo printed nothing")?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let secs: Vec<f64> = (v["secs"].as_array().ok_or("no secs")?.iter())
        .filter_map(|x| x.as_f64())
        .collect();
    // The first repetition is a warm-up, as ours.
    Ok(secs.into_iter().skip(1).collect())
}

/// Waits until `path` exists (bounded).
fn wait_for(path: &Path) -> Result<(), String> {
    let deadline = Instant::now() + PATIENCE;
    while !path.exists() {
        if Instant::now() > deadline {
            return Err(format!("{} did not appear", path.display()));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

/// Writes `text` to `path` at once (a reader never sees it half written).
fn publish(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, path)
}

/// One member: DIR,INDEX,MEMBERS,ELEMENTS,REPS.
fn member(spec: &str) -> super::CliResult {
    let parts: Vec<&str> = spec.split(',').collect();
    let [dir, i, n, elements, reps] = parts[..] else {
        return Err(format!("--member {spec}: DIR,INDEX,MEMBERS,ELEMENTS,REPS expected").into());
    };
    let dir = PathBuf::from(dir);
    let (i, n): (usize, usize) = (i.parse()?, n.parse()?);
    let (elements, reps): (usize, u32) = (elements.parse()?, reps.parse()?);
    let node = Transport::new(NodeOptions {
        listen: Some("127.0.0.1:0".parse()?),
        swarm_key: KEY.to_vec(),
        max_payload: max_payload(elements, n),
        pool_bytes: pool_bytes(elements, n),
        heartbeat_interval: Duration::from_secs(2),
        peer_timeout: Duration::from_secs(120),
        max_connections_per_address: 1024,
        max_handshakes_per_address: 256,
        ..NodeOptions::default()
    })?;
    let me = node.node_id();
    publish(
        &dir.join(format!("{i}.addr")),
        &format!("{} {me}", node.local_addr().ok_or("no listening address")?),
    )?;
    let mut ids = Vec::with_capacity(n);
    for j in 0..n {
        let path = dir.join(format!("{j}.addr"));
        wait_for(&path)?;
        let text = std::fs::read_to_string(&path)?;
        let (addr, id) = text.split_once(' ').ok_or("bad address file")?;
        ids.push(id.trim().parse::<u64>()?);
        if j > i {
            node.connect_wait(addr.parse()?, PATIENCE)?;
        }
    }
    let deadline = Instant::now() + PATIENCE;
    while node.peers().len() < n - 1 {
        if Instant::now() > deadline {
            return Err("the members did not all connect".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut rng = Rng::new(1000 + i as u64);
    let sum: Vec<f32> = (0..elements)
        .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
        .collect();
    let mut times = Vec::new();
    let mut digest = 0u64;
    for rep in 0..=reps {
        publish(&dir.join(format!("{i}.ready{rep}")), "")?;
        for j in 0..n {
            wait_for(&dir.join(format!("{j}.ready{rep}")))?;
        }
        let t0 = Instant::now();
        let op = 1 + rep as u64;
        let deadline = Instant::now() + PATIENCE;
        let out = if n <= BUTTERFLY_MAX_MEMBERS {
            let m = ButterflyAllReduce::new(op, me, &ids, &sum, 1)?;
            finish(&node, m, deadline)?
        } else {
            let m = HierarchicalAllReduce::new(op, me, &ids, &sum, 1, BUTTERFLY_MAX_MEMBERS)?;
            finish(&node, m, deadline)?
        };
        let secs = t0.elapsed().as_secs_f64();
        let Outcome::Done { mean, .. } = out else {
            return Err(format!("the all-reduce ended {out:?}").into());
        };
        digest = mean.iter().fold(0xcbf2_9ce4_8422_2325, |h, x| {
            (h ^ x.to_bits() as u64).wrapping_mul(0x0100_0000_01b3)
        });
        if rep > 0 {
            times.push(secs);
        }
    }
    let times: Vec<String> = times.iter().map(|t| format!("{t:.6}")).collect();
    publish(
        &dir.join(format!("{i}.result")),
        &format!("{digest:x} {}", times.join(" ")),
    )?;
    // The others may still need this member's last frames.
    let done = dir.join(format!("{i}.done"));
    publish(&done, "")?;
    for j in 0..n {
        wait_for(&dir.join(format!("{j}.done")))?;
    }
    Ok(())
}

fn finish<M: Machine>(node: &Transport, m: M, deadline: Instant) -> Result<Outcome, String> {
    allreduce_net::run(node, 0, m, deadline).map_err(|e| e.to_string())
}
