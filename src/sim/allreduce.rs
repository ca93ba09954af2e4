//! How long a stage's all-reduce takes, modelled on the one the runtime ships
//! (`crate::swarm::aggregate`): the stage's gradients in f32 (4 bytes per
//! parameter; no bf16) and one element more for the microbatch count.
//!
//! A group of up to [`BUTTERFLY_MAX_MEMBERS`] runs the butterfly
//! (`crate::swarm::butterfly`): the commit's `n` members each own one part
//! of `ceil(L / n)` elements at most; every member sends each owner its
//! slice of that owner's part (all `n - 1` at once), and each owner, once
//! it holds every slice, sends the reduced part to every member. A pair's
//! transfer takes latency + part / bandwidth of the actual pair, the
//! bandwidth capped by the NIC shared by the `n - 1` streams a member
//! sends at once; the operation ends when the last member holds the last
//! reduced part. Two message rounds, where a ring pays `2 (n-1)` in
//! sequence: in `geo10` the holders' all-reduce takes 3.7 s where the
//! two-way ring took 11.8 s.
//!
//! A larger group goes around the ring both ways
//! (`crate::swarm::allreduce`): the first half of the buffer
//! all-reduced around the ring in the order the stage's coordinator
//! committed (it orders its members by the links they measured and
//! reported, `LinkReport`), the second half around the same ring the other
//! way, both at once. Each direction is a ring reduce-scatter +
//! all-gather, `2 (n-1)` steps, each moving a chunk of `ceil(L / n)`
//! elements of its half from every member to its neighbour and each
//! waiting for the previous one. A step lasts as long as the ring's
//! slowest link for that chunk, either way: latency + chunk / bandwidth of
//! the actual pair, the bandwidth capped by half the node's NIC (a member
//! sends to both its neighbours at once). A wide-area link is full duplex,
//! so the way back is a second link of its own: a one-way ring would leave
//! it idle and move twice the bytes per step.
//!
//! [`allreduce_lower_bound`] is what no all-reduce of the same members by
//! the same algorithm can beat, for the iteration bound ([`super::bound`]).
use crate::flow::ring;
pub use crate::protocol::BUTTERFLY_MAX_MEMBERS;

/// Bytes per element on the wire: the runtime all-reduces f32.
pub const BYTES_PER_ELEMENT: f64 = 4.0;

/// Chunks a member sends at once during an all-reduce step (one to each
/// neighbour: the halves go both ways round); each gets this share of its
/// NIC.
pub const STREAMS_PER_MEMBER: f64 = 2.0;

/// The links of the world: one-way latency (s) and bandwidth (bytes/s)
/// between two regions, and every node's NIC (bytes/s).
pub struct Links<'a> {
    pub link: &'a dyn Fn(usize, usize) -> (f64, f64),
    pub nic: f64,
    /// Groups beyond [`BUTTERFLY_MAX_MEMBERS`] go around the two-way ring
    /// instead of the hierarchy (`SimConfig::ring_beyond_butterfly`).
    pub ring_beyond_butterfly: bool,
}

impl Links<'_> {
    /// Seconds to send `bytes` from a node of region `a` to one of `b`.
    pub fn send_secs(&self, a: usize, b: usize, bytes: f64) -> f64 {
        let (lat, bw) = (self.link)(a, b);
        lat + bytes / bw.min(self.nic)
    }

    /// Seconds to send `bytes` from a node of region `a` to one of `b`
    /// while the sender sends `streams` such transfers at once (each gets
    /// that share of its NIC).
    pub fn stream_secs(&self, a: usize, b: usize, bytes: f64, streams: f64) -> f64 {
        let (lat, bw) = (self.link)(a, b);
        lat + bytes / bw.min(self.nic / streams.max(1.0))
    }

    /// Seconds of one all-reduce step's chunk of `bytes` between ring
    /// neighbours in regions `a` and `b`: the slower way of the two (the
    /// halves go both ways at once), each over half the NIC (a member
    /// sends to both its neighbours at once).
    pub fn step_secs(&self, a: usize, b: usize, bytes: f64) -> f64 {
        let one_way = |x: usize, y: usize| {
            let (lat, bw) = (self.link)(x, y);
            lat + bytes / bw.min(self.nic / STREAMS_PER_MEMBER)
        };
        one_way(a, b).max(one_way(b, a))
    }
}

/// Bytes of the largest chunk when a stage of `params` parameters is
/// all-reduced by `n` members: chunks `[k L / n, (k+1) L / n)` of the
/// `L = ceil(params / 2) + 1` elements of the larger half with its count.
pub fn chunk_bytes(params: u64, n: usize) -> f64 {
    BYTES_PER_ELEMENT * (params.div_ceil(2) + 1).div_ceil(n.max(1) as u64) as f64
}

/// Whether `n` members all-reduce by the butterfly (else around the ring).
pub fn is_butterfly(n: usize) -> bool {
    n <= BUTTERFLY_MAX_MEMBERS
}

/// Seconds of the all-reduce of a stage of `params` parameters among
/// members in `regions` (one entry per member, in the commit's order): the
/// butterfly or the hierarchy, by the group's size.
pub fn allreduce_secs(regions: &[usize], params: u64, links: &Links) -> f64 {
    if is_butterfly(regions.len()) {
        butterfly_secs(regions, params, links)
    } else if links.ring_beyond_butterfly {
        ring_allreduce_secs(regions, params, links)
    } else {
        hierarchy_secs(regions, params, links).total()
    }
}

/// The three phases of a hierarchical all-reduce, in seconds
/// ([`hierarchy_secs`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HierarchySecs {
    /// The slowest group's butterfly of the whole buffer.
    pub groups: f64,
    /// The slowest column's butterfly of its part of the group sums.
    pub columns: f64,
    /// The slowest group's sending of the parts of the total.
    pub parts: f64,
}

impl HierarchySecs {
    pub fn total(&self) -> f64 {
        self.groups + self.columns + self.parts
    }
}

/// Seconds of the hierarchical all-reduce (`crate::swarm::hierarchy`) of a
/// stage of `params` parameters among members in `regions`, in the
/// commit's order: the groups of [`crate::swarm::hierarchy::groups`] run
/// their butterflies of the whole buffer at once, then the `K` columns
/// (the members at one position of every group) theirs, of `ceil(L / K)`
/// elements, then each group's column members send their part to the
/// `s - 1` others at once. The phases are taken one after the other, each
/// as long as its slowest group or column (a member cannot start its
/// column before its group's sum is whole, nor send its part before its
/// column is done).
pub fn hierarchy_secs(regions: &[usize], params: u64, links: &Links) -> HierarchySecs {
    let n = regions.len();
    let groups = crate::swarm::hierarchy::groups(n, BUTTERFLY_MAX_MEMBERS);
    let k = groups.iter().map(|r| r.len()).min().unwrap_or(1);
    // A column's buffer: one part of the L = params + 1 elements, and the
    // column butterfly's own count element.
    let part_params = (params + 1).div_ceil(k as u64);
    let group_secs = (groups.iter())
        .map(|r| butterfly_secs(&regions[r.clone()], params, links))
        .fold(0.0, f64::max);
    let column_secs = (0..k)
        .map(|c| {
            let col: Vec<usize> = groups.iter().map(|r| regions[r.start + c]).collect();
            butterfly_secs(&col, part_params, links)
        })
        .fold(0.0, f64::max);
    let part = BYTES_PER_ELEMENT * part_params as f64;
    let parts_secs = (groups.iter())
        .map(|r| {
            let g = &regions[r.clone()];
            let streams = g.len().saturating_sub(1) as f64;
            let mut distinct = g.to_vec();
            distinct.sort_unstable();
            distinct.dedup();
            let count = |x: usize| g.iter().filter(|&&y| y == x).count();
            let mut worst: f64 = 0.0;
            for &a in &distinct {
                for &b in &distinct {
                    if a != b || count(a) > 1 {
                        worst = worst.max(links.stream_secs(a, b, part, streams));
                    }
                }
            }
            worst
        })
        .fold(0.0, f64::max);
    HierarchySecs {
        groups: group_secs,
        columns: column_secs,
        parts: parts_secs,
    }
}

/// Whether a survivor of a running butterfly lacks something of a member
/// lost, by the simulator's rule (a survivor that lacks something ends the
/// operation, and the others still running hear of it from it): the lost
/// member's slice of the survivor's part (`slice_arrived`), or its reduced
/// part (`reduced_arrived`), the two things nobody else holds. Tested
/// against the butterfly machines in `crate::swarm::butterfly`.
pub fn butterfly_lacks(slice_arrived: bool, reduced_arrived: bool) -> bool {
    !slice_arrived || !reduced_arrived
}

/// Whether a member of a running hierarchy still owes the others
/// something when it is lost, by the simulator's rule (its loss then aborts
/// the operation for everyone still running; otherwise nothing happens):
/// a member outside the columns owes its group's butterfly its slices and
/// its reduced part (`group_over`: they all arrived), and nothing after; a
/// column member owes until it ended and everything it sent arrived
/// (`all_arrived`; its part of the total is the last thing it sends). The
/// machines may do better for a column member whose sends all arrived
/// before its own end; never worse (tested against them in
/// `crate::swarm::hierarchy`).
pub fn hierarchy_owes(column: bool, group_over: bool, all_arrived: bool) -> bool {
    if column {
        !all_arrived
    } else {
        !group_over
    }
}

/// A lower bound on [`hierarchy_secs`] whatever the members' order: every
/// phase pays at least its rounds' latency over the members' fastest link
/// and, at every member, its bytes through the NIC (a transfer of `b`
/// bytes among `m` at once takes at least `b m / nic`): the group
/// butterfly two rounds of `s - 1` parts of `L / s`, the column two of
/// `G - 1` parts of `L / (K G)`, the parts one of `s - 1` parts of `L / K`
/// (`s` the smallest group, which is `K`).
pub fn hierarchy_lower_bound(regions: &[usize], params: u64, links: &Links) -> f64 {
    let n = regions.len();
    let groups = crate::swarm::hierarchy::groups(n, BUTTERFLY_MAX_MEMBERS);
    let (g, k) = (
        groups.len(),
        groups.iter().map(|r| r.len()).min().unwrap_or(1),
    );
    let mut distinct = regions.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let lat = (distinct.iter())
        .flat_map(|&a| distinct.iter().map(move |&b| (a, b)))
        .filter(|&(a, b)| a != b || regions.iter().filter(|&&x| x == a).count() > 1)
        .map(|(a, b)| (links.link)(a, b).0)
        .fold(f64::INFINITY, f64::min);
    let lat = if lat.is_finite() { lat } else { 0.0 };
    let bytes = BYTES_PER_ELEMENT * (params + 1) as f64;
    let (s, g, k) = (k as f64, g as f64, k as f64);
    let group = 2.0 * (lat + bytes / s * (s - 1.0) / links.nic);
    let column = 2.0 * (lat + bytes / (k * g) * (g - 1.0) / links.nic);
    let parts = lat + bytes / k * (s - 1.0) / links.nic;
    group + column + parts
}

/// Bytes of the largest part when a stage of `params` parameters is
/// all-reduced by a butterfly of `n` members: parts `[k L / n, (k+1) L / n)`
/// of the `L = params + 1` elements (the count last).
pub fn part_bytes(params: u64, n: usize) -> f64 {
    BYTES_PER_ELEMENT * (params + 1).div_ceil(n.max(1) as u64) as f64
}

/// Seconds of one part's transfer between members in regions `a` and `b`
/// of a butterfly of `n`: each member sends to the `n - 1` others at once.
pub fn butterfly_send_secs(links: &Links, a: usize, b: usize, bytes: f64, n: usize) -> f64 {
    links.stream_secs(a, b, bytes, n.saturating_sub(1) as f64)
}

/// Seconds of the butterfly all-reduce of a stage of `params` parameters
/// among members in `regions`: owner `b` holds every slice of its part
/// when the slowest of its `n - 1` incoming transfers arrives (`rs[b]`);
/// member `a` is done when the last reduced part reaches it (`rs[b]` + the
/// transfer from `b` to `a`). The order of the members does not matter.
pub fn butterfly_secs(regions: &[usize], params: u64, links: &Links) -> f64 {
    let n = regions.len();
    if n < 2 {
        return 0.0;
    }
    let part = part_bytes(params, n);
    // Members of one region have the same links: per region pair once.
    let mut distinct: Vec<usize> = regions.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let send = |a: usize, b: usize| butterfly_send_secs(links, a, b, part, n);
    // Whether a region holds more than one member (counted once each: this
    // runs for every group and column of a large stage's hierarchy).
    let shared: Vec<bool> = (distinct.iter())
        .map(|&r| regions.iter().filter(|&&x| x == r).nth(1).is_some())
        .collect();
    // rs[b]: the slowest transfer into an owner of region b from any other
    // member (another member of its own region included when there is one).
    let rs: Vec<f64> = (distinct.iter().zip(&shared))
        .map(|(&b, &shared_b)| {
            (distinct.iter())
                .filter(|&&a| a != b || shared_b)
                .map(|&a| send(a, b))
                .fold(0.0, f64::max)
        })
        .collect();
    let mut end: f64 = 0.0;
    for (i, &b) in distinct.iter().enumerate() {
        for &a in &distinct {
            if a != b || shared[i] {
                end = end.max(rs[i] + send(b, a));
            }
        }
    }
    end
}

/// Seconds of the ring all-reduce of a stage of `params` parameters among
/// members in `regions` (one entry per member), around the ring in that
/// order.
pub fn ring_allreduce_secs(regions: &[usize], params: u64, links: &Links) -> f64 {
    2.0 * regions.len().saturating_sub(1) as f64 * ring_step_secs(regions, params, links)
}

/// Seconds of one step of that all-reduce: its slowest link's chunk.
pub fn ring_step_secs(regions: &[usize], params: u64, links: &Links) -> f64 {
    let n = regions.len();
    if n < 2 {
        return 0.0;
    }
    let chunk = chunk_bytes(params, n);
    let step = |a: usize, b: usize| links.step_secs(regions[a], regions[b], chunk);
    let ring: Vec<usize> = (0..n).collect();
    ring::ring_cost(&ring, &step).0
}

/// What the loss of one member of a running ring all-reduce does to the
/// survivors, by the runtime's rule (`crate::swarm::allreduce`): its
/// successor can take the rest of the all-gather from its predecessor once
/// it received the lost member's reduced chunk (the all-gather's first
/// step, the end of step `n` of the successor's `2 (n-1)`); before that the
/// full sum of that chunk is gone, and every survivor aborts.
#[derive(Clone, Debug, PartialEq)]
pub enum LossEffect {
    /// The successor had finished: nobody needs the lost member any more.
    Nothing,
    /// The predecessor sends the successor the rest in the lost member's
    /// place; the survivors finish `delay` s later than planned.
    Bypass { delay: f64 },
    /// Every survivor's all-reduce ends without a result.
    Abort,
}

/// The ring at the moment one of its `n` members is lost, as the
/// simulator models it: every step lasts `step` s; the successor started
/// `successor_since` s before the loss (`None`: not yet), learns of it
/// `notice` s after it and tells the predecessor `resume` s later, from
/// which on the steps it still needs go over the predecessor's link, one
/// `bypass_step` s each, or `step` if that is longer (the ring's other
/// links still pace it).
pub struct RingLoss {
    pub n: usize,
    pub step: f64,
    pub successor_since: Option<f64>,
    /// A member of this ring was bypassed already: one loss is repaired,
    /// not two.
    pub bypassed_before: bool,
    pub notice: f64,
    pub resume: f64,
    pub bypass_step: f64,
}

impl RingLoss {
    pub fn effect(&self) -> LossEffect {
        let steps = 2 * self.n.saturating_sub(1);
        let planned = steps as f64 * self.step;
        let Some(since) = self.successor_since else {
            return LossEffect::Abort;
        };
        if since >= planned {
            return LossEffect::Nothing;
        }
        if self.bypassed_before || self.n < 3 || since < self.n as f64 * self.step {
            return LossEffect::Abort;
        }
        let received = ((since / self.step).floor() as usize).min(steps);
        let rest = (steps - received) as f64 * self.step.max(self.bypass_step);
        let end = self.notice + self.resume + rest;
        LossEffect::Bypass {
            delay: (end - (planned - since)).max(0.0),
        }
    }
}

/// A lower bound on the slowest link of any ring over `n >= 2` members with
/// link cost `cost(a, b)` of sending from `a` to `b`: the exact best ring's
/// slowest link up to [`ring::EXACT_MAX`] members, a relaxation beyond.
pub fn ring_step_lower_bound(n: usize, cost: impl Fn(usize, usize) -> f64) -> f64 {
    if n <= ring::EXACT_MAX {
        ring::best_ring_bottleneck(n, cost)
    } else {
        relaxed_ring_step(n, cost)
    }
}

/// A lower bound on the slowest link of any ring over `n >= 2` members with
/// link cost `cost(a, b)`. With `w(a, b) = min(cost(a, b), cost(b, a))`:
/// a ring less one link is a spanning path, so its slowest link is at least
/// the bottleneck of a minimum spanning tree of `w`; and (n >= 3) every
/// member has two different ring neighbours, so the slower of its two links
/// costs at least its second cheapest `w`. For `n = 2` the ring is the
/// pair's two links.
fn relaxed_ring_step(n: usize, cost: impl Fn(usize, usize) -> f64) -> f64 {
    if n < 2 {
        return 0.0;
    }
    if n == 2 {
        return cost(0, 1).max(cost(1, 0));
    }
    let w = |a: usize, b: usize| cost(a, b).min(cost(b, a));
    // Prim's algorithm: the largest edge of a minimum spanning tree.
    let mut best = vec![f64::INFINITY; n];
    let mut in_tree = vec![false; n];
    let mut bottleneck: f64 = 0.0;
    let mut v = 0;
    for _ in 1..n {
        in_tree[v] = true;
        let mut next = usize::MAX;
        for u in 0..n {
            if !in_tree[u] {
                best[u] = best[u].min(w(v, u));
                if next == usize::MAX || best[u] < best[next] {
                    next = u;
                }
            }
        }
        bottleneck = bottleneck.max(best[next]);
        v = next;
    }
    // Every member's second cheapest link.
    let mut second: f64 = 0.0;
    for a in 0..n {
        let (mut m1, mut m2) = (f64::INFINITY, f64::INFINITY);
        for b in (0..n).filter(|&b| b != a) {
            let c = w(a, b);
            if c < m1 {
                m2 = m1;
                m1 = c;
            } else if c < m2 {
                m2 = c;
            }
        }
        second = second.max(m2);
    }
    bottleneck.max(second)
}

/// A lower bound on the all-reduce of a stage of `params` parameters among
/// members in `regions` by the algorithm the group's size calls for: a
/// butterfly's time does not depend on the order of its members, so it is
/// its own bound; a ring's is `2 (n-1)` steps of at least the best
/// ring's slowest link. Links depend on the regions only, so that ring is
/// known exactly ([`ring::best_ring_bottleneck_grouped`]) unless the
/// members are spread too thinly over too many regions; then
/// [`ring_step_lower_bound`].
pub fn allreduce_lower_bound(regions: &[usize], params: u64, links: &Links) -> f64 {
    let n = regions.len();
    if n < 2 {
        return 0.0;
    }
    if is_butterfly(n) {
        butterfly_secs(regions, params, links)
    } else if links.ring_beyond_butterfly {
        ring_lower_bound(regions, params, links)
    } else {
        hierarchy_lower_bound(regions, params, links)
    }
}

/// A lower bound on any ring all-reduce (both ways) of a stage of `params`
/// parameters among members in `regions` (see [`allreduce_lower_bound`]).
pub fn ring_lower_bound(regions: &[usize], params: u64, links: &Links) -> f64 {
    let n = regions.len();
    if n < 2 {
        return 0.0;
    }
    let chunk = chunk_bytes(params, n);
    let by_region = |a: usize, b: usize| links.step_secs(a, b, chunk);
    let step = ring::best_ring_bottleneck_grouped(regions, by_region)
        .unwrap_or_else(|| ring_step_lower_bound(n, |a, b| by_region(regions[a], regions[b])));
    2.0 * (n - 1) as f64 * step
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three regions: a-b 10 ms and 100 MB/s, b-c 20 ms and 50 MB/s,
    /// a-c 50 ms and 10 MB/s.
    fn three(a: usize, b: usize) -> (f64, f64) {
        match (a.min(b), a.max(b)) {
            (0, 1) => (0.010, 100e6),
            (1, 2) => (0.020, 50e6),
            (0, 2) => (0.050, 10e6),
            _ => (0.001, 1e9),
        }
    }

    /// The links of [`three`] behind a NIC of `nic` bytes/s.
    fn three_links(nic: f64) -> Links<'static> {
        Links {
            link: &three,
            nic,
            ring_beyond_butterfly: false,
        }
    }

    #[test]
    fn three_members_by_hand() {
        let links = three_links(80e6);
        // 5,999,998 parameters: halves of 2,999,999, each + 1 count =
        // 3,000,000 f32 = 12 MB; chunk = 1,000,000 elements = 4 MB. Each
        // member sends to both neighbours at once, 40 MB/s of its NIC
        // each. Every ring of three members uses all three links, each
        // both ways: a-b 0.010 + 4e6 / min(100e6, 40e6) = 0.110 s,
        // b-c 0.020 + 4e6 / min(50e6, 40e6) = 0.120 s, a-c 0.050 + 4e6 /
        // 10e6 = 0.450 s. 2 (3-1) = 4 steps of the slowest, 0.450 s: 1.8 s,
        // what a one-way ring took for half as many parameters.
        let t = ring_allreduce_secs(&[0, 1, 2], 5_999_998, &links);
        assert!((t - 1.8).abs() < 1e-9, "{t}");
        // The lower bound is tight here: a ring of three is every link.
        let lb = ring_lower_bound(&[0, 1, 2], 5_999_998, &links);
        assert!((lb - 1.8).abs() < 1e-9, "{lb}");
        // One member: nothing to reduce; two: 2 steps of the pair's link.
        assert_eq!(ring_allreduce_secs(&[1], 10, &links), 0.0);
        // Halves of 1,999,999 + 1 elements, chunk 1e6 = 4 MB, b-c 0.020 +
        // 4e6 / min(50e6, 40e6) = 0.120 s, 2 steps.
        let t = ring_allreduce_secs(&[1, 2], 3_999_998, &links);
        assert!((t - 0.24).abs() < 1e-9, "{t}");
    }

    #[test]
    fn a_loss_is_bypassed_only_in_the_all_gather_half() {
        // Four members, steps of 1 s: 6 steps; the successor holds the lost
        // member's reduced chunk after step 4 (3 reduce-scatter steps and
        // the all-gather's first).
        let at = |since: Option<f64>| RingLoss {
            n: 4,
            step: 1.0,
            successor_since: since,
            bypassed_before: false,
            notice: 0.1,
            resume: 0.2,
            bypass_step: 1.5,
        };
        assert_eq!(at(None).effect(), LossEffect::Abort);
        assert_eq!(at(Some(0.5)).effect(), LossEffect::Abort);
        assert_eq!(at(Some(3.99)).effect(), LossEffect::Abort);
        // At 4.5 s: 4 steps received, 2 left over the predecessor's slower
        // link (1.5 s each) from 0.3 s on: ends 3.3 s after the loss, where
        // 1.5 s were planned.
        let LossEffect::Bypass { delay } = at(Some(4.5)).effect() else {
            panic!()
        };
        assert!((delay - 1.8).abs() < 1e-9, "{delay}");
        assert_eq!(at(Some(6.0)).effect(), LossEffect::Nothing);
        // A second loss, or a ring of two, cannot be bypassed.
        let second = RingLoss {
            bypassed_before: true,
            ..at(Some(4.5))
        };
        assert_eq!(second.effect(), LossEffect::Abort);
        let two = RingLoss {
            n: 2,
            ..at(Some(1.5))
        };
        assert_eq!(two.effect(), LossEffect::Abort);
    }

    #[test]
    fn the_exact_best_ring_on_points_of_a_line() {
        // Best ring over points of a line: out over every other point and
        // back over the rest; its slowest link is the largest gap between a
        // point and the next but one (here 4: 1..5 or 5..9).
        let pos = [0.0, 9.0, 1.0, 5.0, 3.0, 7.0];
        let cost = |a: usize, b: usize| f64::abs(pos[a] - pos[b]);
        assert_eq!(ring::best_ring_bottleneck(6, cost), 4.0);
        assert!(relaxed_ring_step(6, cost) <= 4.0);
        assert_eq!(ring::best_ring_bottleneck(2, cost), 9.0);
    }

    #[test]
    fn a_ring_with_a_slow_pair_in_it_waits_for_that_pair() {
        // Five members in this ring order: a c a b c. The slow a-c link is
        // in it, so every step waits for a-c.
        let links = three_links(1e12);
        let regions = [0, 2, 0, 1, 2];
        let chunk = chunk_bytes(999_999, 5);
        let t = ring_allreduce_secs(&regions, 999_999, &links);
        let ac = 0.050 + chunk / 10e6;
        assert!((t - 8.0 * ac).abs() < 1e-9, "{t}");
        assert!(ring_lower_bound(&regions, 999_999, &links) <= t + 1e-12);
    }

    #[test]
    fn a_ring_goes_in_the_order_given_and_stays_above_the_bound() {
        let links = three_links(200e6);
        // b a b c b a b c ...: only a-b and b-c links, the slowest b-c (its
        // bandwidth, 50 MB/s, under the 100 of half the NIC).
        let regions: Vec<usize> = (0..200).map(|i| [1, 0, 1, 2][i % 4]).collect();
        let t = ring_allreduce_secs(&regions, 10_000_000, &links);
        let lb = ring_lower_bound(&regions, 10_000_000, &links);
        assert!(lb <= t + 1e-12 && lb > 0.0, "{lb} {t}");
        let chunk = chunk_bytes(10_000_000, 200);
        assert!((t - 2.0 * 199.0 * (0.020 + chunk / 50e6)).abs() < 1e-9);
        // The same members with the a's and c's next to each other: the
        // slow a-c link is in the ring, and the all-reduce is slower.
        let mut sorted = regions.clone();
        sorted.sort_unstable();
        let slow = ring_allreduce_secs(&sorted, 10_000_000, &links);
        assert!((slow - 2.0 * 199.0 * (0.050 + chunk / 10e6)).abs() < 1e-9);
        // The relaxation is below the exact best ring on small rings too.
        let step = |a: usize, b: usize| links.step_secs(regions[a], regions[b], 1e6);
        let exact = ring::best_ring_bottleneck(8, step);
        assert!(relaxed_ring_step(8, step) <= exact + 1e-12);
    }

    /// Thirteen members (beyond the exact member-level ring): six in a, six
    /// in c, one in b. A ring goes from the a's to the c's and back; b can
    /// carry one of the two crossings, so the other is the slow a-c link:
    /// that is the bound (the regions' exact ring), above the relaxation's
    /// b-c, and the order the coordinator computes reaches it. With a
    /// second member in b both crossings go through b: b-c.
    #[test]
    fn beyond_twelve_members_the_bound_is_the_regions_exact_ring() {
        let links = three_links(200e6);
        let params = 12_999_999;
        let chunk = chunk_bytes(params, 13);
        let (ac, bc) = (0.050 + chunk / 10e6, 0.020 + chunk / 50e6);
        let mut regions = vec![1];
        regions.extend([0; 6]);
        regions.extend([2; 6]);
        let lb = ring_lower_bound(&regions, params, &links);
        assert!((lb - 24.0 * ac).abs() < 1e-9, "{lb}");
        let step = |a: usize, b: usize| links.step_secs(regions[a], regions[b], chunk);
        assert!((relaxed_ring_step(13, step) - bc).abs() < 1e-9);
        let ring = ring::order(13, step);
        let ordered: Vec<usize> = ring.iter().map(|&m| regions[m]).collect();
        assert!((ring_allreduce_secs(&ordered, params, &links) - lb).abs() < 1e-9);
        regions[1] = 1;
        let lb = ring_lower_bound(&regions, params, &links);
        assert!((lb - 24.0 * bc).abs() < 1e-9, "{lb}");
    }

    #[test]
    fn a_butterfly_of_three_by_hand() {
        let links = three_links(80e6);
        // 5,999,999 parameters and the count: 6,000,000 f32, parts of
        // 2,000,000 = 8 MB. Each member sends to both others at once, 40
        // MB/s of its NIC each: a-b 0.010 + 8e6 / 40e6 = 0.21 s, b-c 0.020
        // + 0.2 = 0.22 s, a-c 0.050 + 8e6 / 10e6 = 0.85 s. a's and c's
        // parts are whole after 0.85 s (the a-c slice), b's after 0.22 s;
        // the last reduced part (a's to c, c's to a) arrives 0.85 s later.
        let params = 5_999_999;
        let t = butterfly_secs(&[0, 1, 2], params, &links);
        assert!((t - 1.7).abs() < 1e-9, "{t}");
        // The order does not matter, so the time is its own bound.
        assert_eq!(butterfly_secs(&[2, 0, 1], params, &links), t);
        assert_eq!(allreduce_lower_bound(&[0, 1, 2], params, &links), t);
        assert_eq!(allreduce_secs(&[0, 1, 2], params, &links), t);
        // Two members of one region (1 ms, the whole NIC for the one
        // stream): 3,000,000 f32 = 12 MB each way, twice.
        let two = butterfly_secs(&[0, 0], params, &links);
        assert!((two - 2.0 * (0.001 + 12e6 / 80e6)).abs() < 1e-9, "{two}");
        // Three in one region and one far: the slow pair counts, the
        // members of one region reach each other too.
        let four = butterfly_secs(&[0, 0, 0, 2], params, &links);
        let part = part_bytes(params, 4);
        let ac = 0.050 + part / 10e6;
        assert!((four - 2.0 * ac).abs() < 1e-9, "{four}");
        // Beyond BUTTERFLY_MAX_MEMBERS: the hierarchy.
        let many: Vec<usize> = (0..=BUTTERFLY_MAX_MEMBERS).map(|i| i % 3).collect();
        let h = hierarchy_secs(&many, params, &links);
        assert_eq!(allreduce_secs(&many, params, &links), h.total());
        assert_eq!(
            allreduce_lower_bound(&many, params, &links),
            hierarchy_lower_bound(&many, params, &links)
        );
    }

    /// The hierarchy by hand: 128 members in regions 0 and 1 alternating:
    /// two groups of 64, K = 64 columns of two.
    #[test]
    fn a_hierarchy_by_hand_and_its_bound() {
        let links = three_links(80e6);
        let params = 6_399_999;
        let regions: Vec<usize> = (0..128).map(|i| i % 2).collect();
        let h = hierarchy_secs(&regions, params, &links);
        // Groups: a butterfly of 64 over both regions, as on its own.
        assert_eq!(h.groups, butterfly_secs(&regions[..64], params, &links));
        // Columns: position c holds region c % 2 in both groups. Parts of
        // 6,400,000 / 64 = 100,000 elements: a butterfly of two in one
        // region.
        assert_eq!(h.columns, butterfly_secs(&[0, 0], 100_000, &links));
        // Parts: 400,000 bytes to 63 others at once, the slowest pair a-b:
        // 0.010 + 4e5 / min(100e6, 80e6 / 63).
        let want = 0.010 + 4e5 / (80e6 / 63.0);
        assert!((h.parts - want).abs() < 1e-12, "{}", h.parts);
        assert_eq!(allreduce_secs(&regions, params, &links), h.total());
        let lb = hierarchy_lower_bound(&regions, params, &links);
        assert!(lb > 0.0 && lb <= h.total(), "{lb} vs {h:?}");
        // In any order.
        let mut shuffled = regions.clone();
        shuffled.sort_unstable();
        assert!(lb <= hierarchy_secs(&shuffled, params, &links).total());
    }

    /// Time grows with the rounds, not the members: 1,000 members over
    /// three regions take under ten times what 64 take (a ring of 1,000
    /// would take about 30 times).
    #[test]
    fn a_thousand_members_take_under_ten_times_sixty_four() {
        let links = three_links(1e9);
        let params = 50_000_000;
        let of = |n: usize| {
            let regions: Vec<usize> = (0..n).map(|i| i * 3 / n).collect();
            allreduce_secs(&regions, params, &links)
        };
        let (t64, t1000) = (of(64), of(1000));
        assert!(t1000 < 10.0 * t64, "{t1000} vs {t64}");
    }
}

#[cfg(test)]
mod geo10 {
    use super::*;
    use crate::sim::model::ModelPreset;
    use crate::sim::scenario::Scenario;

    /// The figure: the all-reduce of a llama-500m relay stage at
    /// 1,000 members on geo10's links takes under ten times its time at 64
    /// (members spread evenly over the ten regions, in region order, as a
    /// coordinator that orders them by their links puts them). The flat
    /// two-way ring it replaces is printed beside it.
    #[test]
    fn a_llama_500m_stage_at_1000_members_takes_under_ten_times_64() {
        let sc = Scenario::geo10();
        let r = sc.regions.len();
        let link =
            |a: usize, b: usize| (sc.latency[a][b], sc.bandwidth[a][b].min(sc.nic_bandwidth));
        let links = |ring| Links {
            link: &link,
            nic: sc.nic_bandwidth,
            ring_beyond_butterfly: ring,
        };
        let params = ModelPreset::by_name("llama-500m").unwrap().stage_params(1);
        let of = |n: usize, ring: bool| {
            let regions: Vec<usize> = (0..n).map(|i| i * r / n).collect();
            allreduce_secs(&regions, params, &links(ring))
        };
        let (t64, t1000, ring1000) = (of(64, false), of(1000, false), of(1000, true));
        eprintln!(
            "llama-500m stage ({params} parameters) on geo10: 64 members {t64:.2} s, \
             1,000 members {t1000:.2} s by the hierarchy ({:.2}x), {ring1000:.2} s \
             around the two-way ring ({:.2}x)",
            t1000 / t64,
            ring1000 / t64
        );
        assert!(t1000 < 10.0 * t64, "{t1000} vs {t64}");
    }
}
