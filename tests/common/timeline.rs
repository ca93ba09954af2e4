//! Figures of a finished swarm run read from its event lines ([`Seen`]):
//! how long it stood still, how fast it went, and its timeline for a
//! failure report.
#![allow(dead_code)]

use super::swarm_procs::Seen;
use std::time::{Duration, Instant};

/// When each iteration became final: the first holder's `iteration` line
/// for it, in iteration order.
pub fn finals(ev: &[Seen]) -> Vec<(u64, Instant)> {
    let mut f: Vec<(u64, Instant)> = Vec::new();
    for e in ev.iter().filter(|e| e.event() == "iteration") {
        let k = e.u("iteration");
        match f.iter_mut().find(|(j, _)| *j == k) {
            Some(x) => x.1 = x.1.min(e.at),
            None => f.push((k, e.at)),
        }
    }
    f.sort();
    f
}

/// The longest time between two iterations becoming final, from the first
/// one on, and the iteration that ended it.
pub fn longest_gap(ev: &[Seen]) -> (Duration, u64) {
    finals(ev)
        .windows(2)
        .map(|w| (w[1].1.saturating_duration_since(w[0].1), w[1].0))
        .max()
        .unwrap_or_default()
}

/// The longest a run may stand still: 5 s, or three of its own iteration
/// times (its first iterations') where those are longer (a shared machine).
pub fn stall_bound(ev: &[Seen]) -> Duration {
    let f = finals(ev);
    let first: Vec<Instant> = f.iter().filter(|x| x.0 <= 2).map(|x| x.1).collect();
    let normal = match (first.first(), first.last()) {
        (Some(a), Some(b)) if first.len() > 1 => b.saturating_duration_since(*a) / 2,
        _ => Duration::ZERO,
    };
    Duration::from_secs(5).max(3 * normal)
}

/// Iterations per second from the first final iteration to the last (the
/// start-up not counted); None with fewer than two.
pub fn iterations_per_s(ev: &[Seen]) -> Option<f64> {
    let f = finals(ev);
    let (first, last) = (f.first()?, f.last()?);
    let s = last.1.saturating_duration_since(first.1).as_secs_f64();
    (last.0 > first.0 && s > 0.0).then(|| (last.0 - first.0) as f64 / s)
}

/// The run's event lines in time order, with the time since the first,
/// without the chatty ones (`work`, `stats`, `mb_done`).
pub fn timeline(ev: &[Seen]) -> String {
    let Some(t0) = ev.iter().map(|e| e.at).min() else {
        return String::new();
    };
    let mut v: Vec<&Seen> = ev
        .iter()
        .filter(|e| !matches!(e.event(), "work" | "stats" | "mb_done"))
        .collect();
    v.sort_by_key(|e| e.at);
    v.iter()
        .map(|e| {
            let t = e.at.saturating_duration_since(t0).as_secs_f64();
            format!("{t:8.3} node {:>2} {}\n", e.node, e.v)
        })
        .collect()
}
