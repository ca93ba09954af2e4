//! Bounded intake: how many inbound connections one source address may
//! hold and have in their handshake, how many handshakes may run at once,
//! and how many connections one node id may have; and the sampling of
//! refusals, so that a flood is counted, not reported connection by
//! connection. Pure bookkeeping (the poll thread asks and tells it); no I/O.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// The limits (from `NodeOptions`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Inbound connections one source address may hold (handshaking or
    /// established).
    pub per_address: usize,
    /// Inbound handshakes one source address may have in progress.
    pub handshakes_per_address: usize,
    /// Handshakes in progress at once, all addresses.
    pub handshakes: usize,
}

/// Refusals reported per source address per window; the rest are counted.
pub const REPORTED_PER_WINDOW: u32 = 16;
/// The sampling window.
pub const WINDOW: Duration = Duration::from_secs(1);

#[derive(Default)]
struct PerAddress {
    conns: usize,
    handshakes: usize,
}

struct Sample {
    since: Instant,
    reported: u32,
    /// Refusals not reported since the last reported one.
    hidden: u64,
}

/// What the poll thread tells about and asks of its intake.
pub struct Admission {
    limits: Limits,
    inbound: HashMap<IpAddr, PerAddress>,
    handshakes: usize,
    samples: HashMap<IpAddr, Sample>,
}

/// Why an inbound connection is not taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused(pub String);

impl Admission {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            inbound: HashMap::new(),
            handshakes: 0,
            samples: HashMap::new(),
        }
    }

    /// A new connection (inbound from `ip`, or outbound): taken into its
    /// handshake, or refused before anything is allocated for it.
    pub fn admit(&mut self, ip: Option<IpAddr>) -> Result<(), Refused> {
        if self.handshakes >= self.limits.handshakes {
            return Err(Refused(format!(
                "{} handshakes in progress (the most at once)",
                self.handshakes
            )));
        }
        if let Some(ip) = ip {
            let a = self.inbound.entry(ip).or_default();
            if a.conns >= self.limits.per_address {
                return Err(Refused(format!(
                    "{} connections from {ip} already (the most per address)",
                    a.conns
                )));
            }
            if a.handshakes >= self.limits.handshakes_per_address {
                return Err(Refused(format!(
                    "{} handshakes from {ip} in progress (the most per address)",
                    a.handshakes
                )));
            }
            a.conns += 1;
            a.handshakes += 1;
        }
        self.handshakes += 1;
        Ok(())
    }

    /// An admitted connection finished its handshake.
    pub fn established(&mut self, ip: Option<IpAddr>) {
        self.handshakes = self.handshakes.saturating_sub(1);
        if let Some(a) = ip.and_then(|ip| self.inbound.get_mut(&ip)) {
            a.handshakes = a.handshakes.saturating_sub(1);
        }
    }

    /// An admitted connection closed (`handshaking`: before it finished
    /// its handshake).
    pub fn closed(&mut self, ip: Option<IpAddr>, handshaking: bool) {
        if handshaking {
            self.established(ip);
        }
        if let Some(ip) = ip {
            if let Some(a) = self.inbound.get_mut(&ip) {
                a.conns = a.conns.saturating_sub(1);
                if a.conns == 0 {
                    self.inbound.remove(&ip);
                }
            }
        }
    }

    /// A refusal of a connection from `ip` at `now`: `Some(hidden)` when it
    /// is to be reported (with the number of refusals from that address
    /// not reported since the last reported one), None when it is only
    /// counted.
    pub fn sample(&mut self, ip: IpAddr, now: Instant) -> Option<u64> {
        if self.samples.len() > 4096 {
            self.samples
                .retain(|_, s| now.duration_since(s.since) < WINDOW);
        }
        let s = self.samples.entry(ip).or_insert(Sample {
            since: now,
            reported: 0,
            hidden: 0,
        });
        if now.duration_since(s.since) >= WINDOW {
            s.since = now;
            s.reported = 0;
        }
        if s.reported < REPORTED_PER_WINDOW {
            s.reported += 1;
            Some(std::mem::take(&mut s.hidden))
        } else {
            s.hidden += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            per_address: 3,
            handshakes_per_address: 2,
            handshakes: 4,
        }
    }

    #[test]
    fn one_address_cannot_take_what_others_need() {
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "10.0.0.1".parse().unwrap(),
            "10.0.0.2".parse().unwrap(),
            "10.0.0.3".parse().unwrap(),
        );
        let mut ad = Admission::new(limits());
        ad.admit(Some(a)).unwrap();
        ad.admit(Some(a)).unwrap();
        // A third handshake from `a` waits for one of the first two.
        assert!(ad.admit(Some(a)).is_err());
        ad.established(Some(a));
        ad.admit(Some(a)).unwrap();
        ad.established(Some(a));
        // Three connections from `a`: no more.
        let e = ad.admit(Some(a)).unwrap_err();
        assert!(e.0.contains("per address"), "{e:?}");
        // Others still get in, up to the handshakes of all.
        ad.admit(Some(b)).unwrap();
        ad.admit(Some(b)).unwrap();
        ad.admit(None).unwrap();
        assert_eq!(ad.handshakes, 4);
        assert!(ad.admit(Some(c)).unwrap_err().0.contains("at once"));
        // Closing gives the room back.
        ad.closed(Some(b), true);
        ad.admit(Some(c)).unwrap();
        ad.closed(Some(a), false);
        ad.closed(Some(a), false);
        ad.closed(Some(a), false);
        assert!(!ad.inbound.contains_key(&a));
    }

    #[test]
    fn a_flood_of_refusals_is_sampled() {
        let mut ad = Admission::new(limits());
        let ip: IpAddr = "10.0.0.9".parse().unwrap();
        let t0 = Instant::now();
        let n = REPORTED_PER_WINDOW as usize + 6;
        let shown: Vec<Option<u64>> = (0..n).map(|_| ad.sample(ip, t0)).collect();
        assert_eq!(
            shown.iter().filter(|s| s.is_some()).count(),
            REPORTED_PER_WINDOW as usize
        );
        // The next window reports again, with the count of the hidden.
        assert_eq!(ad.sample(ip, t0 + WINDOW), Some(6));
        assert_eq!(ad.sample(ip, t0 + WINDOW), Some(0));
        // Another address is reported on its own.
        let other: IpAddr = "10.0.0.8".parse().unwrap();
        assert_eq!(ad.sample(other, t0), Some(0));
    }
}
