//! The order of a stage's all-reduce ring (docs/SPEC.md section 6): each
//! step of a ring all-reduce waits for the ring's slowest link, so the
//! coordinator commits its members in an order that keeps that link fast
//! ([`crate::flow::ring::order`], [`crate::flow::ring_clusters`] for large
//! groups). It needs the links between members: each member measures those
//! to a few other members per introduction cycle (an
//! `Introduce` gives the latency, a `Probe` the bandwidth, as with any
//! peer) and reports what it knows to its coordinator (`LinkReport`: each
//! cycle, at the next tick when it measured a member's link for the first
//! time, and to a new coordinator with its sync). A
//! link nobody measured costs more than any measured one, so with nothing
//! known the ring keeps the member list's (id) order.
use super::*;
use crate::flow::{ring, ring_clusters};
use std::collections::HashMap;

/// Members a node introduces itself to per cycle to measure its links.
const PROBED_PER_CYCLE: usize = 8;
/// Members whose links a node measures at most: every member of a group of
/// up to 17; in a larger one 16 spread over the group (each such peer is
/// kept in the view, and a node of a stage of a thousand must not know them
/// all). The coordinator's ring then uses what is known.
const MEASURED_MAX: usize = 16;
/// Links a member reports (its cheapest).
pub(super) const REPORTED_LINKS: usize = 64;
/// Rings up to this size are also ordered by [`ring::order`] (2-opt and
/// Or-opt moves, `O(n^4)` at worst, and the exact ring over groups of
/// members with equal links) and the better of that and the clusters' tour
/// is kept; larger ones are ordered by clusters only (sorting the known
/// links).
const TWO_OPT_MAX: usize = 64;
/// The stream of the rendezvous hash that picks the measured members.
const RING: u64 = 0x7269_6e67;
/// The cost of a link nobody measured (seconds): more than any real one.
const UNKNOWN_LINK_S: f64 = 1e6;

/// Coordinator: the links its members reported, by reporter:
/// (member, one-way latency s, bandwidth bytes/s).
#[derive(Debug, Default)]
pub(super) struct RingLinks {
    reported: BTreeMap<NodeId, Vec<(NodeId, f64, f64)>>,
    /// The members this node measures, for a version of the member set.
    measured: Option<(u64, Vec<NodeId>)>,
    /// The version of the member set `reported` was last pruned for.
    pruned_at: Option<u64>,
    /// A link to a member was measured for the first time since this node
    /// last reported: reported at the next tick, not at the next cycle
    /// (a ring ordered meanwhile takes that link for the slowest there is).
    fresh: bool,
}

impl Node {
    /// Introduces this node to up to [`PROBED_PER_CYCLE`] members of its
    /// group whose link it has not measured yet (their answer measures it).
    pub(super) fn measure_group_links(&mut self) {
        if self.phase != Phase::Active {
            return;
        }
        self.refresh_measured_members();
        let unmeasured: Vec<NodeId> = self
            .measured_members()
            .iter()
            .copied()
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

    /// The members whose links this node measures (see [`MEASURED_MAX`]):
    /// in a large group the [`MEASURED_MAX`] that rank first by a hash of
    /// the pair (rendezvous hashing). They are spread over the group
    /// whatever its ids say (ids handed out region by region would make id
    /// neighbours all of other regions, or all of one), and a member
    /// joining or leaving changes the choice only if it is (or was) one of
    /// them, so churn does not set every node measuring anew. Recomputed
    /// when the members changed.
    fn refresh_measured_members(&mut self) {
        let version = self.group.members().version();
        if self
            .ring_links
            .measured
            .as_ref()
            .is_some_and(|(v, _)| *v == version)
        {
            return;
        }
        let set = &self.group.members().as_set();
        let me = self.id;
        let chosen: Vec<NodeId> = if set.len() <= MEASURED_MAX + 1 {
            set.iter().copied().filter(|&m| m != me).collect()
        } else {
            let rank = |m: NodeId| Rng::derive(u64::from(me) << 32 | u64::from(m), RING).next_u64();
            let mut ranked: Vec<(u64, NodeId)> = (set.iter())
                .filter(|&&m| m != me)
                .map(|&m| (rank(m), m))
                .collect();
            ranked.select_nth_unstable(MEASURED_MAX - 1);
            let mut out: Vec<NodeId> = ranked[..MEASURED_MAX].iter().map(|&(_, m)| m).collect();
            out.sort_unstable();
            out
        };
        self.ring_links.measured = Some((version, chosen));
    }

    /// The members whose links this node measures, as last chosen.
    fn measured_members(&self) -> &[NodeId] {
        self.ring_links.measured.as_ref().map_or(&[], |(_, m)| m)
    }

    /// A link to `p` was measured (its bandwidth) for the first time: if
    /// `p` is a member, this node reports its links at the next tick.
    pub(super) fn link_measured(&mut self, p: NodeId) {
        if self.group.members().contains(&p) {
            self.ring_links.fresh = true;
        }
    }

    /// Each tick: links measured for the first time are reported now.
    pub(super) fn report_fresh_links(&mut self) {
        if std::mem::take(&mut self.ring_links.fresh) {
            self.report_group_links();
        }
    }

    /// A member tells its coordinator the links it measured to other
    /// members (the cheapest [`REPORTED_LINKS`] for this stage's chunk).
    pub(super) fn report_group_links(&mut self) {
        let Some(c) = self.group.coord().filter(|&c| c != self.id) else {
            return;
        };
        let mut links = self.own_member_links();
        if links.is_empty() {
            return;
        }
        let chunk = self.ring_chunk_bytes(self.group.members().len());
        links.sort_by(|a, b| (a.1 + chunk / a.2).total_cmp(&(b.1 + chunk / b.2)));
        links.truncate(REPORTED_LINKS);
        self.send(c, Msg::LinkReport { links });
    }

    /// This node's measured links to the other members of its group.
    fn own_member_links(&self) -> Vec<(NodeId, f64, f64)> {
        self.measured_members()
            .iter()
            .filter_map(|&m| {
                let p = self.peers.get(&m)?;
                Some((m, p.lat?, p.bw?))
            })
            .collect()
    }

    /// A member's links (the coordinator keeps the latest report of each
    /// member; a peer's numbers are its word, kept within sane limits).
    pub(super) fn on_link_report(&mut self, from: NodeId, links: Vec<(NodeId, f64, f64)>) {
        if self.group.coord() != Some(self.id) || !self.group.members().contains(&from) {
            return;
        }
        let links: Vec<(NodeId, f64, f64)> = links
            .into_iter()
            .filter(|(m, _, _)| *m != from && self.group.members().contains(m))
            .take(REPORTED_LINKS)
            .map(|(m, lat, bw)| (m, lat.clamp(0.0, 60.0), bw.clamp(1e3, 1e13)))
            .collect();
        // Reports of members gone are dropped once per change of the
        // members, not at every report (a coordinator of a thousand gets a
        // thousand reports per cycle).
        let members = &self.group.members();
        if self.ring_links.pruned_at != Some(members.version()) {
            self.ring_links.reported.retain(|r, _| members.contains(r));
            self.ring_links.pruned_at = Some(members.version());
        }
        self.ring_links.reported.insert(from, links);
    }

    /// Bytes of one all-reduce chunk of this stage among `n` members (f32
    /// gradients, half each way round; the state is 16 bytes per
    /// parameter).
    fn ring_chunk_bytes(&self, n: usize) -> f64 {
        let state = self.own_state_bytes();
        let grads = if state > 0 {
            state as f64 / 4.0
        } else {
            self.cfg.activation_bytes as f64
        };
        grads / 2.0 / n.max(1) as f64
    }

    /// Coordinator: `members` in the ring order to commit: exact up to
    /// [`ring::EXACT_MAX`] members; beyond, the better of [`ring::order`]'s
    /// (up to [`TWO_OPT_MAX`]) and the tour of clusters of near members
    /// ([`ring_clusters::order_by_clusters`], made for what a large group
    /// knows: a few links per member).
    pub(super) fn ring_order(&self, members: &BTreeSet<NodeId>) -> Vec<NodeId> {
        let ids: Vec<NodeId> = members.iter().copied().collect();
        let n = ids.len();
        if n <= 3 {
            return ids;
        }
        let chunk = self.ring_chunk_bytes(n);
        let index = |m: NodeId| ids.binary_search(&m).ok();
        // Seconds to send a chunk from member a to member b, as measured.
        let mut sent: HashMap<(usize, usize), f64> = HashMap::new();
        let own = self.own_member_links();
        let mine = index(self.id).map(|me| (me, own.as_slice()));
        let reported = (self.ring_links.reported.iter())
            .filter_map(|(r, links)| Some((index(*r)?, links.as_slice())));
        for (a, links) in mine.into_iter().chain(reported) {
            for &(m, lat, bw) in links {
                if let Some(b) = index(m) {
                    sent.insert((a, b), lat + chunk / bw);
                }
            }
        }
        let order = if n <= TWO_OPT_MAX {
            // The all-reduce goes both ways round at once: a link costs the
            // dearer of its two ways (a way measured alone stands for both).
            let mut cost = vec![UNKNOWN_LINK_S; n * n];
            for (a, b, c) in both_ways(&sent) {
                cost[a * n + b] = c;
                cost[b * n + a] = c;
            }
            let link = |a: usize, b: usize| cost[a * n + b];
            let toured = ring::order(n, link);
            if n <= ring::EXACT_MAX {
                toured
            } else {
                let clustered = ring_clusters::order_by_clusters(n, &both_ways(&sent));
                let (t, c) = (
                    ring::ring_cost(&toured, &link),
                    ring::ring_cost(&clustered, &link),
                );
                if c.0 < t.0 || (c.0 == t.0 && c.1 < t.1) {
                    clustered
                } else {
                    toured
                }
            }
        } else {
            ring_clusters::order_by_clusters(n, &both_ways(&sent))
        };
        order.into_iter().map(|i| ids[i]).collect()
    }
}

impl Node {
    /// Coordinator: the members of `members` (not itself) whose best
    /// measured link (its own to them, or one a member reported) is
    /// [`SLOW_LINK_RATIO`] times slower than the median of this node's
    /// measured links to all its peers, and over which a member's share
    /// of the stage's all-reduce takes at least [`SLOW_LINK_MIN_S`]. A
    /// coordinator that is itself the slow one finds nobody slower.
    pub(super) fn slow_members(&self, members: &BTreeSet<NodeId>) -> BTreeSet<NodeId> {
        let mut bws: Vec<f64> = (self.peers.values()).filter_map(|p| p.bw).collect();
        if bws.len() < 2 || members.len() < 2 {
            return BTreeSet::new();
        }
        bws.sort_by(f64::total_cmp);
        let median = bws[bws.len() / 2];
        let share = self.ring_chunk_bytes(1) * 2.0;
        let mut best: BTreeMap<NodeId, f64> = BTreeMap::new();
        let mut saw = |m: NodeId, bw: f64| {
            let b = best.entry(m).or_insert(0.0);
            *b = b.max(bw);
        };
        for &m in members {
            if let Some(bw) = self.peers.get(&m).and_then(|p| p.bw) {
                saw(m, bw);
            }
        }
        for (&r, links) in &self.ring_links.reported {
            for &(m, _, bw) in links {
                saw(m, bw);
                saw(r, bw);
            }
        }
        (best.into_iter())
            .filter(|&(m, bw)| {
                m != self.id
                    && members.contains(&m)
                    && bw * SLOW_LINK_RATIO < median
                    && share / bw >= SLOW_LINK_MIN_S
            })
            .map(|(m, _)| m)
            .collect()
    }
}

/// Each measured pair once, at the dearer of its two ways.
fn both_ways(sent: &HashMap<(usize, usize), f64>) -> Vec<(usize, usize, f64)> {
    let mut pairs: HashMap<(usize, usize), f64> = HashMap::new();
    for (&(a, b), &c) in sent {
        let e = pairs.entry((a.min(b), a.max(b))).or_insert(c);
        *e = e.max(c);
    }
    pairs.into_iter().map(|((a, b), c)| (a, b, c)).collect()
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
    /// The all-reduce goes both ways round the ring, so a link fast one
    /// way and slow the other is slow. Members 2 3 4 5 form a cycle whose
    /// links are fast forward (2 -> 3 -> 4 -> 5 -> 2) and slow back; every
    /// other link is medium. Costed one way, the ring 1 2 3 4 5 would pass
    /// three of those links (its slowest link medium); both ways, each of
    /// them is slow and the committed ring passes the one it must.
    #[test]
    fn a_link_costs_the_dearer_of_its_two_ways() {
        let mut n = started(Policy::Gwtf, 1, 2, &[2, 3, 4, 5], &[]);
        let members: BTreeSet<NodeId> = [1, 2, 3, 4, 5].into_iter().collect();
        let next = |m: NodeId| if m == 5 { 2 } else { m + 1 };
        let lat = |m: NodeId, o: NodeId| match () {
            _ if m == 1 || o == 1 => 0.1,
            _ if o == next(m) => 0.001,
            _ if m == next(o) => 1.0,
            _ => 0.1,
        };
        for m in [2, 3, 4, 5] {
            let links = (1..=5)
                .filter(|&o| o != m)
                .map(|o| (o, lat(m, o), 1e12))
                .collect();
            deliver(&mut n, m, Msg::LinkReport { links });
        }
        let ring = n.ring_order(&members);
        let cycle_links = (0..5)
            .filter(|&k| {
                let (a, b) = (ring[k], ring[(k + 1) % 5]);
                a != 1 && b != 1 && (b == next(a) || a == next(b))
            })
            .count();
        assert_eq!(cycle_links, 1, "{ring:?}");
    }

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
        for (m, rtt) in [(1, SEC / 50), (9, SEC / 10)] {
            measure_link(&mut n, m, rtt);
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

    /// `peer` answers `n`'s introduction one round trip `rtt` later (the
    /// latency), then its bandwidth probe.
    fn measure_link(n: &mut Node, peer: NodeId, rtt: Time) {
        let t0 = n.now;
        let echo = Msg::Introduce {
            iter: 0,
            stage: 2,
            spare: 1,
            compute_s: 0.5,
            sent_at: t0,
            echo: Some(t0),
        };
        n.handle(
            t0 + rtt,
            Input::Message {
                from: peer,
                msg: echo,
            },
        );
        let ack = Msg::ProbeAck {
            bytes: 1 << 20,
            sent_at: t0 + rtt,
        };
        n.handle(
            t0 + 3 * rtt,
            Input::Message {
                from: peer,
                msg: ack,
            },
        );
    }

    /// A link to a member measured for the first time is reported at the
    /// next tick (not at the next introduction cycle, 24 s later: a ring
    /// ordered meanwhile took it for the slowest link there is), once; and
    /// a member tells a new coordinator its links with its sync (the new
    /// coordinator had none, and ordered its first ring blind).
    #[test]
    fn fresh_links_reach_the_coordinator_at_once() {
        let reports = |acts: &[Action]| -> Vec<NodeId> {
            sends(acts)
                .iter()
                .filter(|(_, m)| matches!(m, Msg::LinkReport { .. }))
                .map(|(to, _)| *to)
                .collect()
        };
        let mut n = started(Policy::Gwtf, 5, 2, &[1, 9], &[]);
        let t0 = n.now;
        measure_link(&mut n, 9, SEC / 50);
        // The next tick reports it to the coordinator (1); the one after
        // has nothing new to say.
        let tick = n.cfg.tick;
        let first = n.on_timeout(n.next_tick.max(t0 + tick));
        assert_eq!(reports(&first), vec![1]);
        let next = n.on_timeout(n.next_tick);
        assert!(reports(&next).is_empty());
        // Its coordinator dies and it succeeds it: nothing to report (it
        // reads its own links).
        let now = n.now;
        let acts = n.handle(now, Input::PeerLost { peer: 1 });
        assert!(reports(&acts).is_empty(), "no report to itself");
        // A member whose coordinator changes to another node reports to it.
        let mut m = started(Policy::Gwtf, 9, 2, &[1, 5], &[]);
        measure_link(&mut m, 5, SEC / 50);
        let now = m.now;
        let acts = m.handle(now, Input::PeerLost { peer: 1 });
        assert_eq!(m.group.coord(), Some(5));
        assert_eq!(reports(&acts), vec![5]);
    }

    /// In a group of 300 whose ids go round ten regions (member m in region
    /// m % 10), a node measures 16 members spread over the regions (not
    /// its id neighbours, all of other regions); a member joining that is
    /// not among them changes nothing, one leaving that is changes only
    /// that one.
    #[test]
    fn a_node_of_a_large_group_measures_a_few_members_spread_over_it() {
        let members: Vec<NodeId> = (100..400).collect();
        let mut n = started(Policy::Gwtf, 205, 2, &members, &[]);
        n.refresh_measured_members();
        let chosen = n.measured_members().to_vec();
        assert_eq!(chosen.len(), MEASURED_MAX);
        assert!(!chosen.contains(&205));
        let regions: BTreeSet<NodeId> = chosen.iter().map(|m| m % 10).collect();
        assert!(regions.len() >= 6, "{chosen:?}");
        assert!(
            chosen.iter().any(|m| m % 10 == 5),
            "its own region too: {chosen:?}"
        );
        // A join that does not rank among them.
        let joiner = (400..500)
            .find(|&j| {
                let mut m = n.group.members().clone();
                m.insert(j);
                let mut probe = started(Policy::Gwtf, 205, 2, &members, &[]);
                *probe.group.members_mut() = m;
                probe.refresh_measured_members();
                !probe.measured_members().contains(&j)
            })
            .unwrap();
        n.group.members_mut().insert(joiner);
        n.refresh_measured_members();
        assert_eq!(n.measured_members(), &chosen[..]);
        n.group.members_mut().remove(&chosen[3]);
        n.refresh_measured_members();
        let after = n.measured_members().to_vec();
        assert_eq!(after.len(), MEASURED_MAX);
        let kept = chosen.iter().filter(|m| after.contains(m)).count();
        assert_eq!(kept, MEASURED_MAX - 1, "{chosen:?} -> {after:?}");
    }
}
