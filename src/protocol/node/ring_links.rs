//! The order of a stage's all-reduce ring (docs/SPEC.md section 6): each
//! step of a ring all-reduce waits for the ring's slowest link, so the
//! coordinator commits its members in an order that keeps that link fast
//! ([`crate::flow::ring::order`]). It needs the links between members: each
//! member measures those to a few other members per introduction cycle (an
//! `Introduce` gives the latency, a `Probe` the bandwidth, as with any
//! peer) and reports what it knows to its coordinator (`LinkReport`). A
//! link nobody measured costs more than any measured one, so with nothing
//! known the ring keeps the member list's (id) order.
use super::*;
use crate::flow::ring;

/// Members a node introduces itself to per cycle to measure its links.
const PROBED_PER_CYCLE: usize = 8;
/// Members whose links a node measures at most: every member of a group of
/// up to 17; in a larger one the 16 around it in id order (8 before, 8
/// after, circularly: each such peer is kept in the view, and a node of a
/// stage of a thousand must not know them all). The ring's tour then uses
/// what is known.
const MEASURED_MAX: usize = 16;
/// Links a member reports (its cheapest).
pub(super) const REPORTED_LINKS: usize = 64;
/// Rings up to this size are improved by 2-opt moves (`O(n^4)` at worst);
/// larger ones keep the nearest-neighbour tour (`O(n^2)`).
const TWO_OPT_MAX: usize = 64;
/// The cost of a link nobody measured (seconds): more than any real one.
const UNKNOWN_LINK_S: f64 = 1e6;

/// Coordinator: the links its members reported, by reporter:
/// (member, one-way latency s, bandwidth bytes/s).
#[derive(Debug, Default)]
pub(super) struct RingLinks {
    reported: BTreeMap<NodeId, Vec<(NodeId, f64, f64)>>,
}

impl Node {
    /// Introduces this node to up to [`PROBED_PER_CYCLE`] members of its
    /// group whose link it has not measured yet (their answer measures it).
    pub(super) fn measure_group_links(&mut self) {
        if self.phase != Phase::Active {
            return;
        }
        let unmeasured: Vec<NodeId> = self
            .measured_members()
            .into_iter()
            .filter(|m| {
                self.peers
                    .get(m)
                    .is_none_or(|p| !p.dead && (p.lat.is_none() || p.bw.is_none()))
            })
            .take(PROBED_PER_CYCLE)
            .collect();
        for m in unmeasured {
            let msg = self.intro_msg(None);
            self.send(m, msg);
        }
    }

    /// The members whose links this node measures (see [`MEASURED_MAX`]).
    fn measured_members(&self) -> Vec<NodeId> {
        let all: Vec<NodeId> = self.group.members.iter().copied().collect();
        let n = all.len();
        if n <= MEASURED_MAX + 1 {
            return all.into_iter().filter(|&m| m != self.id).collect();
        }
        let me = all.partition_point(|&m| m < self.id);
        let half = MEASURED_MAX / 2;
        let mut out: Vec<NodeId> = (1..=half)
            .flat_map(|d| [all[(me + n - d) % n], all[(me + d) % n]])
            .filter(|&m| m != self.id)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// A member tells its coordinator the links it measured to other
    /// members (the cheapest [`REPORTED_LINKS`] for this stage's chunk).
    pub(super) fn report_group_links(&mut self) {
        let Some(c) = self.group.coord.filter(|&c| c != self.id) else {
            return;
        };
        let mut links = self.own_member_links();
        if links.is_empty() {
            return;
        }
        let chunk = self.ring_chunk_bytes(self.group.members.len());
        links.sort_by(|a, b| (a.1 + chunk / a.2).total_cmp(&(b.1 + chunk / b.2)));
        links.truncate(REPORTED_LINKS);
        self.send(c, Msg::LinkReport { links });
    }

    /// This node's measured links to the other members of its group.
    fn own_member_links(&self) -> Vec<(NodeId, f64, f64)> {
        self.measured_members()
            .into_iter()
            .filter_map(|m| {
                let p = self.peers.get(&m)?;
                Some((m, p.lat?, p.bw?))
            })
            .collect()
    }

    /// A member's links (the coordinator keeps the latest report of each
    /// member; a peer's numbers are its word, kept within sane limits).
    pub(super) fn on_link_report(&mut self, from: NodeId, links: Vec<(NodeId, f64, f64)>) {
        if self.group.coord != Some(self.id) || !self.group.members.contains(&from) {
            return;
        }
        let links: Vec<(NodeId, f64, f64)> = links
            .into_iter()
            .filter(|(m, _, _)| *m != from && self.group.members.contains(m))
            .take(REPORTED_LINKS)
            .map(|(m, lat, bw)| (m, lat.clamp(0.0, 60.0), bw.clamp(1e3, 1e13)))
            .collect();
        let members = &self.group.members;
        self.ring_links.reported.retain(|r, _| members.contains(r));
        self.ring_links.reported.insert(from, links);
    }

    /// Bytes of one all-reduce chunk of this stage among `n` members (f32
    /// gradients; the state is 16 bytes per parameter).
    fn ring_chunk_bytes(&self, n: usize) -> f64 {
        let state = self.own_state_bytes();
        let grads = if state > 0 {
            state as f64 / 4.0
        } else {
            self.cfg.activation_bytes as f64
        };
        grads / n.max(1) as f64
    }

    /// Coordinator: `members` in the ring order to commit.
    pub(super) fn ring_order(&self, members: &BTreeSet<NodeId>) -> Vec<NodeId> {
        let ids: Vec<NodeId> = members.iter().copied().collect();
        let n = ids.len();
        if n <= 3 {
            return ids;
        }
        let chunk = self.ring_chunk_bytes(n);
        let index = |m: NodeId| ids.binary_search(&m).ok();
        // cost[a][b]: sending a chunk from member a to member b.
        let mut cost = vec![f64::NAN; n * n];
        let mut set = |a: usize, b: usize, lat: f64, bw: f64| cost[a * n + b] = lat + chunk / bw;
        if let Some(me) = index(self.id) {
            for (m, lat, bw) in self.own_member_links() {
                if let Some(b) = index(m) {
                    set(me, b, lat, bw);
                }
            }
        }
        for (r, links) in &self.ring_links.reported {
            let Some(a) = index(*r) else { continue };
            for &(m, lat, bw) in links {
                if let Some(b) = index(m) {
                    set(a, b, lat, bw);
                }
            }
        }
        // A link measured one way only stands for both.
        let link = |a: usize, b: usize| {
            let (x, y) = (cost[a * n + b], cost[b * n + a]);
            if !x.is_nan() {
                x
            } else if !y.is_nan() {
                y
            } else {
                UNKNOWN_LINK_S
            }
        };
        let order = if n <= TWO_OPT_MAX {
            ring::order(n, link)
        } else {
            ring::nearest_neighbour(n, link)
        };
        order.into_iter().map(|i| ids[i]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// Members 1 2 3 4: 1 and 3 in one region, 2 and 4 in another far away
    /// (a slow link between the regions). In id order the ring crosses the
    /// slow link four times; the coordinator, told the links, commits a
    /// ring that crosses it twice. With nothing reported it keeps the id
    /// order.
    #[test]
    fn the_coordinator_commits_a_ring_that_avoids_slow_links() {
        let mut n = started(Policy::Gwtf, 1, 2, &[2, 3, 4], &[]);
        let members: BTreeSet<NodeId> = [1, 2, 3, 4].into_iter().collect();
        assert_eq!(n.ring_order(&members), vec![1, 2, 3, 4]);
        let near = |m: NodeId, o: NodeId| (m % 2) == (o % 2);
        let report = |m: NodeId| {
            let links = [1, 2, 3, 4]
                .into_iter()
                .filter(|&o| o != m)
                .map(|o| {
                    if near(m, o) {
                        (o, 0.001, 1e9)
                    } else {
                        (o, 0.2, 1e7)
                    }
                })
                .collect();
            Msg::LinkReport { links }
        };
        for m in [2, 3, 4] {
            deliver(&mut n, m, report(m));
        }
        let ring = n.ring_order(&members);
        let crossings = (0..4)
            .filter(|&k| !near(ring[k], ring[(k + 1) % 4]))
            .count();
        assert_eq!(crossings, 2, "{ring:?}");
        // Nonsense from a member (negative, infinite, zero) is kept within
        // limits: the order is still a ring of the members.
        let wild = Msg::LinkReport {
            links: vec![
                (1, -5.0, f64::INFINITY),
                (3, f64::INFINITY, 0.0),
                (4, 1e300, -1.0),
            ],
        };
        deliver(&mut n, 2, wild);
        let mut seen = n.ring_order(&members);
        seen.sort_unstable();
        assert_eq!(seen, vec![1, 2, 3, 4]);
        assert!(n
            .ring_links
            .reported
            .values()
            .flatten()
            .all(|l| (0.0..=60.0).contains(&l.1) && (1e3..=1e13).contains(&l.2)));
        // A report from a node outside the group counts for nothing.
        let mut other = started(Policy::Gwtf, 1, 2, &[2, 3, 4], &[]);
        deliver(&mut other, 9, report(3));
        assert_eq!(other.ring_order(&members), vec![1, 2, 3, 4]);
    }

    /// A member reports the links it measured to other members, to its
    /// coordinator only, and introduces itself to members it has not
    /// measured yet.
    #[test]
    fn a_member_measures_and_reports_its_links_to_other_members() {
        let mut n = started(Policy::Gwtf, 5, 2, &[1, 9], &[]);
        n.out.clear();
        n.measure_group_links();
        let to: Vec<NodeId> = sends(&n.out)
            .iter()
            .filter(|(_, m)| matches!(m, Msg::Introduce { .. }))
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(to, vec![1, 9]);
        n.out.clear();
        n.report_group_links();
        assert!(sends(&n.out).is_empty(), "nothing measured: nothing to say");
        // Their answers: an introduction echoing ours (the round trip gives
        // the latency), then the bandwidth probe's ack.
        let t0 = n.now;
        for (m, rtt) in [(1, SEC / 50), (9, SEC / 10)] {
            let echo = Msg::Introduce {
                iter: 0,
                stage: 2,
                spare: 1,
                compute_s: 0.5,
                sent_at: t0,
                echo: Some(t0),
            };
            n.handle(t0 + rtt, Input::Message { from: m, msg: echo });
            let ack = Msg::ProbeAck {
                bytes: 1 << 20,
                sent_at: t0 + rtt,
            };
            n.handle(t0 + 3 * rtt, Input::Message { from: m, msg: ack });
        }
        n.out.clear();
        n.report_group_links();
        match sends(&n.out)[..] {
            [(1, Msg::LinkReport { links })] => {
                let got: Vec<NodeId> = links.iter().map(|l| l.0).collect();
                assert_eq!(got, vec![1, 9], "cheapest first: {links:?}");
                assert!(links.iter().all(|l| l.1 > 0.0 && l.2 > 0.0), "{links:?}");
            }
            ref s => panic!("{s:?}"),
        }
    }
}
