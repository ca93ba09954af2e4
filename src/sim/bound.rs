//! A lower bound on the time of one iteration for a given membership: the
//! yardstick every policy is measured against (no policy can beat it, so
//! "time / bound" says how much any routing could still gain).
//!
//! An iteration trains `m` microbatches per holder (`H m` in all) and then
//! every stage all-reduces its gradients; the next iteration starts only once
//! every stage has applied (the protocol's barrier). With the membership
//! fixed during the iteration, its time is at least the largest of:
//!
//! - **Each relay stage `k`**: no microbatch reaches it before its fill
//!   (the fastest embedding and forwards of the stages before, the
//!   cheapest hop before each); from then on its `H m` microbatches take
//!   their count over the most its members can take per second; then its
//!   all-reduce, which needs every gradient (by the algorithm the runtime
//!   runs for its members: a butterfly, whose time does not depend on
//!   their order, or the best possible ring,
//!   [`super::allreduce::allreduce_lower_bound`]). Its last backward also
//!   comes no earlier than the holders' chains bring it: one of a holder's
//!   in-flight slots carries `ceil(m / F)` microbatches one after another,
//!   each a whole trip (at least the cheapest, `P_h`), so the last starts
//!   no earlier than `(ceil(m / F) - 1) P_h` and reaches the stage's
//!   backward no earlier than its least time there after. A relay takes at most
//!   `flops / (3 x forward FLOPs of k)` per second (backward = 2 x forward,
//!   one task at a time) and, keeping activations, at most `capacity /
//!   hold` (Little's law: they stay at least from its forward through every
//!   later stage and the loss back to its backward, each part at its
//!   fastest); beyond that only stateless backwards (4 x forward, SWARM's)
//!   in the GPU time left. And the pipeline drains: the stage's last
//!   forward ends no earlier than all `H m` forwards spread over its
//!   members at full speed, and that microbatch still goes through every
//!   later stage, the loss and back before its backward here (each part at
//!   its fastest).
//! - **The holders** (stage 0): their all-reduce needs every microbatch of
//!   the iteration done, so it starts after the latest of: each holder's own
//!   GPU work (embedding, head and loss of its `m` microbatches, nobody else
//!   can do it); each holder's chain (at most `F`, its in-flight limit, of
//!   its microbatches are in flight at once, each for at least the cheapest
//!   round trip `P_h`: embedding, forward through one relay per stage,
//!   loss, backward through the same relays, embedding backward, every
//!   hop's latency + activation / bandwidth both ways; so at least
//!   `ceil(m / F) P_h`, and more where the first microbatches of its `F`
//!   slots must queue on a link or a GPU, which carry one transfer or task
//!   at a time: see `HolderTrips` and `relay_gpus_secs`); and each
//!   relay stage's work as above followed by the way back of its last task
//!   (a backward: each microbatch's comes after its forward there) through
//!   the stages before and the embedding's backward. Then the holders'
//!   all-reduce, by the best ring.
//!
//! Links and GPUs are counted only for the holders' first microbatches
//! (beyond that, per-link byte limits are not: the bound is weaker, still
//! valid). A trip's backward is modelled on the relays of its forward (a
//! stateless backward, SWARM's, may run elsewhere but runs the forward
//! again, two forwards more than modelled, and goes through the holder).
//! What the bound ignores (the barrier's messages, queueing beyond the
//! above, aggregation waiting for every stage, a crash's recomputation)
//! can only make an iteration longer. Under churn the bound of the
//! membership an iteration starts with is reported; it is checked only on
//! iterations during which the membership did not change.
use super::allreduce::{allreduce_lower_bound, Links};
use super::model::ModelPreset;
use std::collections::BTreeMap;

/// A live node: its region, its speed (FLOP/s) and its memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Member {
    pub region: usize,
    pub flops: f64,
    /// Microbatches whose activations it can hold at once (a relay).
    pub capacity: u32,
}

/// The membership of one iteration and what it trains.
pub struct World<'a> {
    pub model: &'a ModelPreset,
    /// The holders that train this iteration.
    pub holders: &'a [Member],
    /// Every member of the holders' stage: all take part in its
    /// all-reduce, a holder that joined during the iteration before with
    /// nothing to add (it trains from the next).
    pub holder_group: &'a [Member],
    /// Relays of stage `k` at index `k - 1`.
    pub relays: &'a [Vec<Member>],
    pub mb_per_holder: u32,
    pub in_flight: u32,
    pub links: &'a Links<'a>,
}

/// The bound and what sets it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct IterationBound {
    /// Seconds: no iteration of this membership is shorter.
    pub secs: f64,
    /// The bound of each stage (index 0 = the holders).
    pub stage_secs: Vec<f64>,
}

impl IterationBound {
    /// The stage whose bound is the iteration's.
    pub fn binding_stage(&self) -> usize {
        (0..self.stage_secs.len())
            .max_by(|&a, &b| self.stage_secs[a].total_cmp(&self.stage_secs[b]))
            .unwrap_or(0)
    }
}

/// The iteration bound of `w`; `None` when there is no holder or a stage has
/// no member (no iteration can finish).
pub fn iteration_bound(w: &World) -> Option<IterationBound> {
    let m = w.model;
    if w.holders.is_empty() || w.relays.iter().any(|r| r.is_empty()) {
        return None;
    }
    let mbs = w.holders.len() as f64 * w.mb_per_holder as f64;
    let mut stage_secs = Vec::with_capacity(w.relays.len() + 1);
    // Holders: own work or chain, then their all-reduce.
    let holder_flops = m.loss_flops() + 3.0 * m.embed_flops();
    let mut trips: BTreeMap<usize, HolderTrips> = BTreeMap::new();
    // Per region: its holders and the least own work per microbatch.
    let mut regions: BTreeMap<usize, (usize, f64)> = BTreeMap::new();
    let mut holders_done: f64 = 0.0;
    // Per relay stage: no earlier than this its last backward ends.
    let mut last_backward = vec![0.0f64; w.relays.len()];
    for h in w.holders {
        let own = w.mb_per_holder as f64 * holder_flops / h.flops;
        let trips = trips
            .entry(h.region)
            .or_insert_with(|| HolderTrips::new(w, h.region));
        let (per_mb, loss) = (holder_flops / h.flops, m.loss_flops() / h.flops);
        let chain = trips.chain_secs(per_mb, loss, w.mb_per_holder, w.in_flight);
        holders_done = holders_done.max(own.max(chain));
        let before = (m.loss_flops() + m.embed_flops()) / h.flops;
        let lasts = trips.last_backwards(per_mb, before, w.mb_per_holder, w.in_flight);
        for (l, t) in last_backward.iter_mut().zip(lasts) {
            *l = l.max(t);
        }
        let r = regions.entry(h.region).or_insert((0, f64::INFINITY));
        *r = (r.0 + 1, r.1.min(per_mb));
    }
    for (region, (holders, own)) in regions {
        holders_done = holders_done.max(relay_gpus_secs(w, &trips[&region], holders, own));
    }
    // Relay stages: the most microbatches per second their members can
    // take (GPU time and memory), from the first instant a microbatch can
    // reach them; then their all-reduce, which needs every gradient.
    let hop = cheapest_hop(w);
    let holds = min_holds(w, hop);
    let fastest = |xs: &[Member]| xs.iter().map(|x| x.flops).fold(0.0, f64::max);
    let mut fill = m.embed_flops() / fastest(w.holders) + hop;
    let mut drain = 2.0 * m.embed_flops() / fastest(w.holders) + hop;
    let mut relay_secs = Vec::with_capacity(w.relays.len());
    for (i, members) in w.relays.iter().enumerate() {
        let k = (i + 1) as u16;
        let fwd = m.stage_fwd_flops(k);
        let rate: f64 = members.iter().map(|r| relay_rate(r, fwd, holds[i])).sum();
        let speed: f64 = members.iter().map(|r| r.flops).sum();
        // The stage's last forward ends no earlier than all of them on all
        // its members at full speed; that microbatch then goes through
        // every later stage and back, and its backward runs here.
        let last_forward = mbs * fwd / speed + holds[i] - fwd / fastest(members);
        let busy_until = fill + (mbs / rate).max(last_forward);
        let regions: Vec<usize> = members.iter().map(|r| r.region).collect();
        let allreduce = allreduce_lower_bound(&regions, m.stage_params(k), w.links);
        // Its all-reduce needs its last backward: by its own work, or by
        // the holders' chains (their last microbatches come late).
        relay_secs.push(busy_until.max(last_backward[i]) + allreduce);
        // The stage's last task is a backward (each microbatch's comes
        // after its forward here); that microbatch still goes back through
        // the stages before and the holder's embedding.
        holders_done = holders_done.max(busy_until + drain);
        fill += fwd / fastest(members) + hop;
        drain += 2.0 * fwd / fastest(members) + hop;
    }
    // Holders: their all-reduce needs every microbatch done.
    let regions: Vec<usize> = w.holder_group.iter().map(|h| h.region).collect();
    stage_secs.push(holders_done + allreduce_lower_bound(&regions, m.stage_params(0), w.links));
    stage_secs.extend(relay_secs);
    let secs = stage_secs.iter().copied().fold(0.0, f64::max);
    Some(IterationBound { secs, stage_secs })
}

/// The cheapest one-way transfer of one activation between any two regions
/// the members are in (the same region included).
fn cheapest_hop(w: &World) -> f64 {
    let act = w.model.activation_bytes() as f64;
    let mut regions: Vec<usize> = w
        .holders
        .iter()
        .chain(w.relays.iter().flatten())
        .map(|x| x.region)
        .collect();
    regions.sort_unstable();
    regions.dedup();
    let mut hop = f64::INFINITY;
    for &a in &regions {
        for &b in &regions {
            hop = hop.min(w.links.send_secs(a, b, act));
        }
    }
    hop
}

/// The most microbatches per second relay `r` can take, whose stage's
/// forward is `fwd` FLOPs and whose kept activations stay at least `hold`
/// seconds. Keeping them (backward = 2 forwards) it takes at most
/// `capacity / hold` at once (Little's law), by GPU time at most
/// `flops / 3 fwd`; beyond that it can only run a stateless backward that
/// runs the forward again (4 forwards per microbatch, SWARM's way) in the
/// GPU time left. The best mix: `x` kept up to both limits, the rest
/// stateless.
fn relay_rate(r: &Member, fwd: f64, hold: f64) -> f64 {
    let gpu_kept = r.flops / (3.0 * fwd);
    let kept = gpu_kept.min(r.capacity as f64 / hold.max(1e-12));
    kept + (r.flops - 3.0 * fwd * kept).max(0.0) / (4.0 * fwd)
}

/// For each relay stage, the least time a microbatch's activations stay at
/// one of its relays: from its forward to its backward, the microbatch goes
/// through every later stage and the holder's loss and comes back. Each
/// part at its fastest (the fastest member of each later stage, the fastest
/// holder, `hop` (the cheapest one-way hop) both ways between stages).
fn min_holds(w: &World, hop: f64) -> Vec<f64> {
    let m = w.model;
    let hop = 2.0 * hop;
    let fastest = |xs: &[Member]| xs.iter().map(|x| x.flops).fold(0.0, f64::max);
    let loss = m.loss_flops() / fastest(w.holders);
    let s = w.relays.len();
    let mut holds = vec![0.0; s];
    // Back to front: what lies beyond stage k, then stage k's own work.
    let mut beyond = loss + hop;
    for i in (0..s).rev() {
        let k = (i + 1) as u16;
        let own = 3.0 * m.stage_fwd_flops(k) / fastest(&w.relays[i]);
        holds[i] = own + beyond;
        beyond += own + hop;
    }
    holds
}

/// The cheapest round trip of one microbatch from a holder in `home` through
/// one relay per stage and back, without the holder's own compute.
#[cfg(test)]
fn cheapest_relay_trip(w: &World, home: usize) -> f64 {
    HolderTrips::new(w, home).cheapest
}

/// What a holder's microbatches cost on their way through the relays, for
/// the holder's chain (the in-flight limit) with the queues of the links
/// and GPUs its first microbatches share.
///
/// The model of one trip (a lower bound on any): from the holder in `home`
/// through one relay per stage and back through the same relays, each
/// relay's forward and backward on the fastest relay of its region, each
/// hop's transfer both ways (a hop between relays may go through the
/// holder, SWARM's data path: the cheaper of the two is counted). Members of
/// a region share their links' figures, so the shortest paths run over
/// (stage, region): `O(S R^2)`.
///
/// A link carries one transfer at a time, a GPU runs one task at a time.
/// Every trip crosses each *cut* (the holder's link to stage 1, stage `k`
/// to stage `k + 1` directly or through the holder, stage `S` to the
/// holder's loss; each direction) on exactly one link, and runs one
/// backward at each stage. The `i`-th of several microbatches through one
/// link `e` (or one GPU) finishes there no earlier than `i` transfers (or
/// tasks) after the earliest any of them can be there, and its trip then
/// takes at least the least time any trip needs from there on: it ends no
/// earlier than `P_e + (i - 1) t_e`, `P_e` the least time before `e` plus
/// `t_e` plus the least time after (each minimised on its own: another
/// microbatch may come by another way). [`HolderTrips::cuts`] keeps, per
/// cut, the `in_flight` smallest such ends over all its links: the best the
/// first microbatches of the holder's in-flight slots can do.
struct HolderTrips {
    /// The cheapest trip (the holder's own compute left out, as below).
    cheapest: f64,
    /// Per relay stage (index `k` for stage `k + 1`): the least time from a
    /// microbatch's start to its backward's end at that stage, the
    /// holder's own compute left out (its embedding and loss come before).
    to_backward: Vec<f64>,
    /// Per cut and direction: the `in_flight` smallest trip ends, ascending.
    cuts: Vec<Vec<f64>>,
    /// The least time of a trip besides its loss on the holder's GPU: the
    /// least before it plus the least after it.
    around_loss: f64,
    /// Per relay stage and region: the least time of a trip through a
    /// relay there besides that relay's own forward and backward.
    around_relay: Vec<BTreeMap<usize, f64>>,
}

/// Per (stage, region): the fastest member's forward seconds and how many
/// members the stage has there.
type StageRegions = BTreeMap<usize, (f64, usize)>;

impl HolderTrips {
    fn new(w: &World, home: usize) -> HolderTrips {
        let slots = w.in_flight.max(1) as usize;
        let act = w.model.activation_bytes() as f64;
        let send = |a: usize, b: usize| w.links.send_secs(a, b, act);
        let xfer = |a: usize, b: usize| send(a, b) - w.links.send_secs(a, b, 0.0);
        // One way between two relays: directly or through the holder.
        let one_way = |a: usize, b: usize| send(a, b).min(send(a, home) + send(home, b));
        let min = |it: &mut dyn Iterator<Item = f64>| it.fold(f64::INFINITY, f64::min);
        let stages: Vec<StageRegions> = (w.relays.iter().enumerate())
            .map(|(i, members)| {
                let fwd = w.model.stage_fwd_flops((i + 1) as u16);
                let mut by_region = StageRegions::new();
                for r in members {
                    let e = by_region.entry(r.region).or_insert((f64::INFINITY, 0));
                    e.0 = e.0.min(fwd / r.flops);
                    e.1 += 1;
                }
                by_region
            })
            .collect();
        let s = stages.len();
        type Row = BTreeMap<usize, f64>;
        // fwd_to[k][a]: from the start to the forward output of a relay of
        // stage k + 1 in region a; back_from[k][a]: from that relay's
        // backward output to the end; round[k][a]: from the forward input
        // of that relay to its backward output (the rest of the trip there
        // and back, through the same relays).
        let mut fwd_to: Vec<Row> = Vec::with_capacity(s);
        let mut back_from: Vec<Row> = Vec::with_capacity(s);
        for k in 0..s {
            let (f, b): (Row, Row) = (stages[k].iter())
                .map(|(&a, &(fwd, _))| {
                    if k == 0 {
                        ((a, send(home, a) + fwd), (a, send(a, home)))
                    } else {
                        let f = min(&mut fwd_to[k - 1].iter().map(|(&p, &c)| c + one_way(p, a)));
                        let b = min(&mut (stages[k - 1].iter())
                            .map(|(&p, &(fp, _))| one_way(a, p) + 2.0 * fp + back_from[k - 1][&p]));
                        ((a, f + fwd), (a, b))
                    }
                })
                .unzip();
            fwd_to.push(f);
            back_from.push(b);
        }
        let mut round: Vec<Row> = vec![Row::new(); s];
        for k in (0..s).rev() {
            round[k] = (stages[k].iter())
                .map(|(&a, &(fwd, _))| {
                    let beyond = if k + 1 == s {
                        send(a, home) + send(home, a)
                    } else {
                        min(&mut round[k + 1]
                            .iter()
                            .map(|(&b, &c)| one_way(a, b) + c + one_way(b, a)))
                    };
                    (a, 3.0 * fwd + beyond)
                })
                .collect();
        }
        let cheapest =
            min(&mut (round[0].iter()).map(|(&a, &c)| send(home, a) + c + send(a, home)));
        let to_backward = (0..s)
            .map(|k| {
                min(&mut (stages[k].iter())
                    .map(|(&a, &(fwd_a, _))| fwd_to[k][&a] - fwd_a + round[k][&a]))
            })
            .collect();
        // Each cut, one direction at a time: its links as (least trip
        // through one, how many such links in parallel, its transfer).
        type Cut = Vec<(f64, usize, f64)>;
        let mut cuts = Vec::with_capacity(2 * (s + 1));
        let mut add = |fwd: Cut, bwd: Cut| {
            cuts.push(first_ends(&fwd, slots));
            cuts.push(first_ends(&bwd, slots));
        };
        // The holder and stage 1.
        let (mut fwd, mut bwd) = (Cut::new(), Cut::new());
        for (&a, &(_, n)) in &stages[0] {
            let p = send(home, a) + round[0][&a] + send(a, home);
            fwd.push((p, n, xfer(home, a)));
            bwd.push((p, n, xfer(a, home)));
        }
        add(fwd, bwd);
        // Stage k + 1 to stage k + 2: the direct links, and through the
        // holder, its link into the relay (forward into b, backward into a).
        for k in 0..s.saturating_sub(1) {
            let (mut fwd, mut bwd) = (Cut::new(), Cut::new());
            for (&a, &(fwd_a, na)) in &stages[k] {
                let ends = fwd_to[k][&a] + 2.0 * fwd_a + back_from[k][&a];
                for (&b, &(_, nb)) in &stages[k + 1] {
                    let ends = ends + round[k + 1][&b];
                    let (there, back) = (one_way(a, b), one_way(b, a));
                    fwd.push((ends + send(a, b) + back, na * nb, xfer(a, b)));
                    let via = send(a, home) + send(home, b);
                    fwd.push((ends + via + back, nb, xfer(home, b)));
                    bwd.push((ends + there + send(b, a), na * nb, xfer(b, a)));
                    let via = send(b, home) + send(home, a);
                    bwd.push((ends + there + via, na, xfer(home, a)));
                }
            }
            add(fwd, bwd);
        }
        // Stage S and the holder (the loss).
        let (mut fwd, mut bwd) = (Cut::new(), Cut::new());
        for (&a, &(fwd_a, n)) in &stages[s - 1] {
            let ends = fwd_to[s - 1][&a] + 2.0 * fwd_a + back_from[s - 1][&a];
            let p = ends + send(a, home) + send(home, a);
            fwd.push((p, n, xfer(a, home)));
            bwd.push((p, n, xfer(home, a)));
        }
        add(fwd, bwd);
        let last = &stages[s - 1];
        let around_loss = min(&mut fwd_to[s - 1].iter().map(|(&a, &c)| c + send(a, home)))
            + min(&mut (last.iter())
                .map(|(&a, &(fwd_a, _))| send(home, a) + 2.0 * fwd_a + back_from[s - 1][&a]));
        let around_relay = (0..s)
            .map(|k| {
                (stages[k].iter())
                    .map(|(&a, &(fwd_a, _))| {
                        let up = round[k][&a] - 3.0 * fwd_a;
                        (a, fwd_to[k][&a] - fwd_a + up + back_from[k][&a])
                    })
                    .collect()
            })
            .collect();
        HolderTrips {
            cheapest,
            to_backward,
            cuts,
            around_loss,
            around_relay,
        }
    }

    /// The earliest the last backward of a holder's microbatches at each
    /// relay stage ends: one of its in-flight slots carries `ceil(m /
    /// slots)` microbatches one after another, each a whole trip (`own`
    /// the holder's work per microbatch, `before` the part of it before the
    /// relays' backwards: embedding and loss), so the last starts no
    /// earlier than that many trips less one, and reaches each stage's
    /// backward no earlier than its least time there after.
    fn last_backwards(&self, own: f64, before: f64, m: u32, slots: u32) -> Vec<f64> {
        let start = m.div_ceil(slots.max(1)).saturating_sub(1) as f64 * (own + self.cheapest);
        (self.to_backward.iter())
            .map(|&t| start + before + t)
            .collect()
    }

    /// The earliest a holder whose own work per microbatch is `own` seconds,
    /// `loss` of it the loss, ends `m` microbatches, at most `slots` in
    /// flight: each slot runs its microbatches one after another, the first
    /// no earlier than one of a cut's first ends, each later one a whole
    /// cheapest trip. Its GPU is a cut too: every trip runs a loss there.
    fn chain_secs(&self, own: f64, loss: f64, m: u32, slots: u32) -> f64 {
        let trip = own + self.cheapest;
        let waves = m.div_ceil(slots.max(1)) as f64 * trip;
        let losses: Vec<f64> = (0..slots.max(1))
            .map(|j| (self.around_loss + loss * j as f64).max(self.cheapest))
            .collect();
        (self.cuts.iter().chain(std::iter::once(&losses)))
            .map(|ends| slots_finish(ends, own, trip, m))
            .fold(waves, f64::max)
    }
}

/// The holders of one region (same trips) and the relays' GPUs: the first
/// microbatches of their slots (each uses at least `ceil(m / waves)` slots,
/// or it needs a wave more) all run a backward at every stage; the last of
/// them to be done at a stage ends its trip no earlier than the `n`-th
/// smallest `P_r + (j - 1) b_r` over the stage's relays `r` (`b_r` its
/// backward), and its holder's other slots' first ends no earlier than the
/// cheapest trip. `own`: the least own work per microbatch among them.
fn relay_gpus_secs(w: &World, trips: &HolderTrips, holders: usize, own: f64) -> f64 {
    let m = w.mb_per_holder;
    let slots = w.in_flight.max(1);
    let waves = m.div_ceil(slots);
    let used = m.div_ceil(waves.max(1)) as usize;
    let n = holders * used;
    let trip = own + trips.cheapest;
    let mut secs: f64 = 0.0;
    for (i, members) in w.relays.iter().enumerate() {
        let fwd = w.model.stage_fwd_flops((i + 1) as u16);
        // (next end, backward seconds) per relay, the smallest first.
        let mut heap: std::collections::BinaryHeap<std::cmp::Reverse<(Ordered, Ordered)>> =
            (members.iter())
                .filter_map(|r| {
                    let around = *trips.around_relay[i].get(&r.region)?;
                    let p = (around + 3.0 * fwd / r.flops).max(trips.cheapest);
                    Some(std::cmp::Reverse((
                        Ordered(p),
                        Ordered(2.0 * fwd / r.flops),
                    )))
                })
                .collect();
        let mut last = trips.cheapest;
        for _ in 0..n {
            let Some(std::cmp::Reverse((Ordered(p), Ordered(b)))) = heap.pop() else {
                break;
            };
            last = p;
            heap.push(std::cmp::Reverse((Ordered(p + b), Ordered(b))));
        }
        let mut ends = vec![trips.cheapest; slots as usize - 1];
        ends.push(last);
        let gpus = slots_finish(&ends, own, trip, m);
        secs = secs.max(gpus.min((waves + 1) as f64 * trip));
    }
    secs
}

/// An `f64` ordered by `total_cmp` (for the heap above).
#[derive(Clone, Copy, PartialEq)]
struct Ordered(f64);
impl Eq for Ordered {}
impl PartialOrd for Ordered {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Ordered {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// The `slots` smallest values of `P + floor(i / n) t` (i = 0, 1, ...) over
/// the links `(P, n, t)` (`n` parallel links whose cheapest trip is `P`,
/// each taking `t` per transfer), ascending.
fn first_ends(links: &[(f64, usize, f64)], slots: usize) -> Vec<f64> {
    let mut ends: Vec<f64> = Vec::new();
    for &(p, n, t) in links {
        if !p.is_finite() || n == 0 {
            continue;
        }
        ends.extend((0..slots).map(|i| p + (i / n) as f64 * t));
    }
    ends.sort_by(f64::total_cmp);
    ends.truncate(slots);
    ends
}

/// The least `T` at which slots whose first microbatch ends at `ends[j] +
/// own` and every later one `trip` after the one before have ended `m`
/// microbatches in all.
fn slots_finish(ends: &[f64], own: f64, trip: f64, m: u32) -> f64 {
    if m == 0 {
        return 0.0;
    }
    let done_by = |t: f64| -> u64 {
        (ends.iter())
            .map(|&e| {
                let first = e + own;
                if t + 1e-12 < first {
                    0
                } else {
                    ((t - first) / trip + 1e-9).floor() as u64 + 1
                }
            })
            .sum()
    };
    let mut best = f64::INFINITY;
    for &e in ends {
        for q in 0..m as u64 {
            let t = e + own + q as f64 * trip;
            if t < best && done_by(t) >= m as u64 {
                best = t;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(region: usize, flops: f64) -> Member {
        Member {
            region,
            flops,
            capacity: 32,
        }
    }

    /// The bound of llama-124m in one region (link 1 ms, 1 GB/s, NIC
    /// 1 TB/s) with two holders at 1 TFLOP/s, 4 microbatches each, 2 in
    /// flight, and these relays.
    fn tiny(relays: &[Vec<Member>]) -> Option<IterationBound> {
        tiny_with(relays, 4, 2)
    }

    /// [`tiny`] with `mb` microbatches per holder, `in_flight` in flight.
    fn tiny_with(relays: &[Vec<Member>], mb: u32, in_flight: u32) -> Option<IterationBound> {
        let model = ModelPreset::by_name("llama-124m").unwrap();
        let link = |_: usize, _: usize| (0.001, 1e9);
        let links = Links {
            link: &link,
            nic: 1e12,
            ring_beyond_butterfly: false,
        };
        let holder = member(0, 1e12);
        iteration_bound(&World {
            model: &model,
            holders: &[holder, holder],
            holder_group: &[holder, holder],
            relays,
            mb_per_holder: mb,
            in_flight,
            links: &links,
        })
    }

    /// In [`tiny`]'s world with relays of 2 TFLOP/s: the earliest stage
    /// `k`'s last backward ends by the holders' chains. A slot carries two
    /// microbatches, the second starts a whole trip after the first (the
    /// holder's own work, every stage's 3 forwards, `s + 1` hops both ways);
    /// then its embedding and loss on the holder, and from its start to
    /// stage `k`'s backward: every forward, the backwards of stages `s`
    /// down to `k`, and `2 s + 2 - k` hops.
    fn chain_backward(model: &ModelPreset, k: u16) -> f64 {
        let s = model.relay_stages;
        let hop = 0.001 + model.activation_bytes() as f64 / 1e9;
        let f = |j: u16| model.stage_fwd_flops(j) / 2e12;
        let own = (model.loss_flops() + 3.0 * model.embed_flops()) / 1e12;
        let relays: f64 = (1..=s).map(|j| 3.0 * f(j)).sum();
        let trip = own + relays + (s as f64 + 1.0) * 2.0 * hop;
        let before = (model.loss_flops() + model.embed_flops()) / 1e12;
        let forwards: f64 = (1..=s).map(f).sum();
        let backwards: f64 = (k..=s).map(|j| 2.0 * f(j)).sum();
        trip + before + forwards + backwards + (2 * s + 2 - k) as f64 * hop
    }

    /// The butterfly of two members in [`tiny`]'s region (1 ms, 1 GB/s): a
    /// part of `ceil((params + 1) / 2)` f32 each way, then the reduced
    /// part each way.
    fn butterfly_of_two(params: u64) -> f64 {
        2.0 * (0.001 + 4.0 * (params + 1).div_ceil(2) as f64 / 1e9)
    }

    /// llama-124m, one region (link 1 ms, 1 GB/s), two holders at 1 TFLOP/s
    /// and relays of 2 TFLOP/s; the bound is worked out from the model's own
    /// figures so that the test checks the arithmetic, not the preset.
    #[test]
    fn a_tiny_world_by_hand() {
        let model = ModelPreset::by_name("llama-124m").unwrap();
        let s = model.relay_stages as usize;
        let relay = member(0, 2e12);
        // Stage 1 has two relays, the others one.
        let mut relays = vec![vec![relay]; s];
        relays[0].push(relay);
        let b = tiny(&relays).unwrap();
        let act = model.activation_bytes() as f64;
        let hop = 0.001 + act / 1e9;
        let embed = model.embed_flops();
        let f = |k: u16| model.stage_fwd_flops(k);
        let speed = |k: u16| if k == 1 { 4e12 } else { 2e12 };
        // From stage k's forward to its backward: a hop, every later
        // stage's forward and backward (3 forwards at 2 TFLOP/s) and a hop
        // back each, a holder's loss at 1 TFLOP/s and two hops.
        let beyond = |k: u16| {
            let later: f64 = (k + 1..=s as u16)
                .map(|j| 3.0 * f(j) / 2e12 + 2.0 * hop)
                .sum();
            model.loss_flops() / 1e12 + 2.0 * hop + later
        };
        // Stage k's 2 holders x 4 microbatches: 3 forward FLOPs each on
        // its relays, or all forwards first, then the last one's way
        // round and its backward (2 forwards on a 2 TFLOP/s relay).
        let work = |k: u16| {
            let gpu = 8.0 * 3.0 * f(k) / speed(k);
            gpu.max(8.0 * f(k) / speed(k) + beyond(k) + 2.0 * f(k) / 2e12)
        };
        // Stage 1 cannot start before an embedding and a hop; then its
        // work on two relays (4 TFLOP/s), unless the holders' chains bring
        // its last backward later; then a butterfly of two.
        let fill1 = embed / 1e12 + hop;
        assert!(work(1) > 8.0 * 3.0 * f(1) / 4e12, "the drain binds stage 1");
        let busy1 = (fill1 + work(1)).max(chain_backward(&model, 1));
        let agg1 = butterfly_of_two(model.stage_params(1));
        assert!((b.stage_secs[1] - (busy1 + agg1)).abs() < 1e-12, "{b:?}");
        // Stage 2 starts after stage 1's forward and another hop; one
        // 2 TFLOP/s relay, alone: no all-reduce.
        let fill2 = fill1 + f(1) / 2e12 + hop;
        let busy2 = (fill2 + work(2)).max(chain_backward(&model, 2));
        assert!((b.stage_secs[2] - busy2).abs() < 1e-12, "{b:?}");
        // Holders: their all-reduce (a ring of two) after the latest of
        // their chain, their own work, and each stage's work followed by the
        // way back of its last backward (the stages before, then the
        // embedding's backward). The chain: 2 waves (4 microbatches, 2 in
        // flight) of the round trip (own compute + every relay's 3 forward
        // at 2 TFLOP/s + s+1 hops both ways), one slot's first microbatch
        // late by the most of: a transfer (from stage 2 on, each stage has
        // one relay, so both slots' first microbatches cross the one link
        // between stages 2 and 3, one after the other; going through the
        // holder instead costs a whole hop more), a loss (both run one on
        // the holder's GPU), and three backwards on the one relay of a
        // later stage (the 2 x 2 first microbatches of both holders run
        // one each there; stage 1 has two relays: one backward).
        let own = model.loss_flops() + 3.0 * embed;
        let relays_c: f64 = (1..=s as u16).map(|k| 3.0 * f(k) / 2e12).sum();
        let trip = own / 1e12 + relays_c + (s as f64 + 1.0) * 2.0 * hop;
        let backwards = (2..=s as u16)
            .map(|k| 3.0 * 2.0 * f(k) / 2e12)
            .fold(2.0 * f(1) / 2e12, f64::max);
        let late = (act / 1e9).max(model.loss_flops() / 1e12).max(backwards);
        let mut done = (2.0 * trip + late).max(4.0 * own / 1e12);
        let (mut fill, mut drain) = (fill1, 2.0 * embed / 1e12 + hop);
        for k in 1..=s as u16 {
            done = done.max(fill + work(k) + drain);
            fill += f(k) / 2e12 + hop;
            drain += 2.0 * f(k) / 2e12 + hop;
        }
        let want0 = done + butterfly_of_two(model.stage_params(0));
        assert!(
            (b.stage_secs[0] - want0).abs() < 1e-9,
            "{} {want0}",
            b.stage_secs[0]
        );
        let max = b.stage_secs.iter().copied().fold(0.0, f64::max);
        assert_eq!(b.secs, max);
        assert_eq!(b.stage_secs[b.binding_stage()], max);
        // An empty stage: no bound.
        let mut gap = relays.clone();
        gap[1].clear();
        assert!(tiny(&gap).is_none());
    }

    /// A holder that joined during the iteration before trains nothing in
    /// this one, but takes part in the holders' all-reduce: its chain does
    /// not count, its links do.
    #[test]
    fn a_holder_that_does_not_train_only_joins_the_all_reduce() {
        let model = ModelPreset::by_name("llama-124m").unwrap();
        let s = model.relay_stages as usize;
        let link = |a: usize, b: usize| if a == b { (0.001, 1e9) } else { (0.1, 1e8) };
        let links = Links {
            link: &link,
            nic: 1e12,
            ring_beyond_butterfly: false,
        };
        let (near, far) = (member(0, 1e12), member(1, 1e11));
        let relays = vec![vec![member(0, 2e12)]; s];
        let bound = |holders: &[Member], group: &[Member]| {
            iteration_bound(&World {
                model: &model,
                holders,
                holder_group: group,
                relays: &relays,
                mb_per_holder: 4,
                in_flight: 2,
                links: &links,
            })
            .unwrap()
        };
        let alone = bound(&[near], &[near]);
        let joined = bound(&[near], &[near, far]);
        let agg = allreduce_lower_bound(&[0, 1], model.stage_params(0), &links);
        assert!(agg > 0.0);
        assert!((joined.stage_secs[0] - (alone.stage_secs[0] + agg)).abs() < 1e-9);
        assert_eq!(joined.stage_secs[1..], alone.stage_secs[1..]);
        // Training, the slow far holder's chain counts too.
        let both = bound(&[near, far], &[near, far]);
        assert!(both.stage_secs[0] > joined.stage_secs[0] + 1e-3, "{both:?}");
    }

    #[test]
    fn the_cheapest_trip_goes_through_the_near_region() {
        // Two regions 100 ms apart; one relay per stage in each; the home
        // region's relays are slower but the far ones cost 2 x 100 ms a hop.
        let model = ModelPreset::by_name("llama-124m").unwrap();
        let s = model.relay_stages as usize;
        let link = |a: usize, b: usize| if a == b { (0.0, 1e15) } else { (0.1, 1e15) };
        let links = Links {
            link: &link,
            nic: 1e15,
            ring_beyond_butterfly: false,
        };
        let near = member(0, 1e15);
        let far = member(1, 2e15);
        let relays = vec![vec![near, far]; s];
        let holders = [near];
        let w = World {
            model: &model,
            holders: &holders,
            holder_group: &holders,
            relays: &relays,
            mb_per_holder: 1,
            in_flight: 1,
            links: &links,
        };
        let work: f64 = (1..=s as u16).map(|k| 3.0 * model.stage_fwd_flops(k)).sum();
        // Far relays are twice as fast but every far hop costs 2 x 100 ms.
        let hops = (s as f64 + 1.0) * 2.0 * model.activation_bytes() as f64 / 1e15;
        let trip = cheapest_relay_trip(&w, 0);
        assert!((trip - (work / 1e15 + hops)).abs() < 1e-12, "{trip}");
    }

    /// A relay that holds one microbatch's activations at a time: the
    /// activations stay through every later stage and the loss (the hold),
    /// so it keeps at most one per hold, and spends the GPU time left on
    /// stateless backwards (4 forwards each); its stage's bound says so. With
    /// room for many, only GPU time counts (the previous test).
    #[test]
    fn a_relay_short_of_memory_bounds_its_stage() {
        let model = ModelPreset::by_name("llama-124m").unwrap();
        let s = model.relay_stages as usize;
        let mut relays = vec![vec![member(0, 2e12)]; s];
        relays[0][0].capacity = 1;
        // 16 microbatches per holder, 8 in flight: two a slot, as in
        // `tiny` (the same chains), and 32 through stage 1.
        let b = tiny_with(&relays, 16, 8).unwrap();
        let act = model.activation_bytes() as f64;
        let hop = 2.0 * (0.001 + act / 1e9);
        let f1 = model.stage_fwd_flops(1);
        let hold: f64 = (1..=s as u16)
            .map(|k| 3.0 * model.stage_fwd_flops(k) / 2e12)
            .sum::<f64>()
            + model.loss_flops() / 1e12
            + s as f64 * hop;
        let kept = (2e12 / (3.0 * f1)).min(1.0 / hold);
        assert!(kept < 2e12 / (3.0 * f1), "memory must bind here");
        let rate = kept + (2e12 - 3.0 * f1 * kept) / (4.0 * f1);
        let fill1 = model.embed_flops() / 1e12 + hop / 2.0;
        let want = fill1 + 32.0 / rate;
        assert!(want > chain_backward(&model, 1), "not the chains");
        assert!(
            (b.stage_secs[1] - want).abs() < 1e-9,
            "{} {want}",
            b.stage_secs[1]
        );
        // Stage 2 has room: GPU time alone, after its fill, or the holders'
        // chains.
        let f2 = model.stage_fwd_flops(2);
        let fill2 = fill1 + f1 / 2e12 + hop / 2.0;
        let busy2 = (fill2 + 32.0 * 3.0 * f2 / 2e12).max(chain_backward(&model, 2));
        assert!((b.stage_secs[2] - busy2).abs() < 1e-12);
    }

    #[test]
    fn slots_end_after_their_first_microbatch_and_whole_trips() {
        // Two slots, the second's first microbatch 0.5 s later: 2 + 2
        // microbatches end at 2.5 (3 + 1 would end at 3).
        assert!((slots_finish(&[1.0, 1.5], 0.0, 1.0, 4) - 2.5).abs() < 1e-12);
        // The second slot 2.5 s later: 3 + 1 end at 3.5, better than 4 + 0.
        assert!((slots_finish(&[1.0, 3.5], 0.0, 1.0, 4) - 3.5).abs() < 1e-12);
        // The holder's own work is on every trip (`trip` includes it).
        assert!((slots_finish(&[1.0, 1.0], 0.5, 1.5, 4) - 3.0).abs() < 1e-12);
        // Links: two in parallel at 1 s, 0.5 s a transfer, and one at
        // 1.2 s: the 4 earliest ends are 1, 1, 1.2, 1.5.
        let ends = first_ends(&[(1.0, 2, 0.5), (1.2, 1, 0.5), (f64::INFINITY, 1, 0.0)], 4);
        assert_eq!(ends, vec![1.0, 1.0, 1.2, 1.5]);
    }

    /// A holder with 4 in flight and one relay of stage 1 near it (every
    /// later stage has four): its four first microbatches cross its one
    /// link to that relay one after another, so the fourth ends its trip
    /// three transfers after the first; unless a second relay of stage 1, a
    /// little farther, takes some of them over a link of its own.
    #[test]
    fn a_holders_first_microbatches_queue_on_a_shared_link() {
        let model = ModelPreset::by_name("llama-124m").unwrap();
        let s = model.relay_stages as usize;
        let act = model.activation_bytes() as f64;
        let t = act / 1e9;
        // Region 1 is 2 ms from region 0, 1 ms more than within a region.
        let link = |a: usize, b: usize| if a == b { (0.001, 1e9) } else { (0.002, 1e9) };
        let links = Links {
            link: &link,
            nic: 1e12,
            ring_beyond_butterfly: false,
        };
        let holders = [member(0, 1e12)];
        let world = |relays: &[Vec<Member>]| {
            let w = World {
                model: &model,
                holders: &holders,
                holder_group: &holders,
                relays,
                mb_per_holder: 4,
                in_flight: 4,
                links: &links,
            };
            let trips = HolderTrips::new(&w, 0);
            let own = (model.loss_flops() + 3.0 * model.embed_flops()) / 1e12;
            (trips.cheapest, trips.chain_secs(own, 0.0, 4, 4) - own)
        };
        let mut relays = vec![vec![member(0, 2e12); 4]; s];
        relays[0].truncate(1);
        let (trip, chain) = world(&relays);
        assert!(t > 0.005, "a transfer must outweigh the detour below");
        assert!((chain - (trip + 3.0 * t)).abs() < 1e-9, "{chain} {trip}");
        // A relay of stage 1 in region 1: through it, a trip's hops from
        // the holder and on to stage 2 cost 1 ms more each way (4 ms). The
        // four earliest ends: 0, 4 ms, t, t + 4 ms after the cheapest.
        relays[0].push(member(1, 2e12));
        let (trip2, chain2) = world(&relays);
        assert!((trip2 - trip).abs() < 1e-12);
        assert!(
            (chain2 - (trip + t + 0.004)).abs() < 1e-9,
            "{chain2} {trip}"
        );
    }

    /// Holders of one region, 4 microbatches each, 2 in flight, one relay
    /// per stage: their first microbatches (2 a holder) run a backward each
    /// on every relay, one after another, so one of them ends its trip a
    /// backward (of the slowest stage) per other first microbatch after the
    /// cheapest, and its holder ends a whole trip after that; unless a
    /// third wave is sooner.
    #[test]
    fn the_holders_first_microbatches_queue_on_a_relays_gpu() {
        let model = ModelPreset::by_name("llama-124m").unwrap();
        let s = model.relay_stages;
        let link = |_: usize, _: usize| (0.001, 1e9);
        let links = Links {
            link: &link,
            nic: 1e12,
            ring_beyond_butterfly: false,
        };
        let holders = [member(0, 1e15), member(0, 1e15)];
        let relays = vec![vec![member(0, 2e12)]; s as usize];
        let w = World {
            model: &model,
            holders: &holders,
            holder_group: &holders,
            relays: &relays,
            mb_per_holder: 4,
            in_flight: 2,
            links: &links,
        };
        let trips = HolderTrips::new(&w, 0);
        let own = (model.loss_flops() + 3.0 * model.embed_flops()) / 1e15;
        let trip = own + trips.cheapest;
        let backward = (1..=s)
            .map(|k| 2.0 * model.stage_fwd_flops(k) / 2e12)
            .fold(0.0, f64::max);
        // Two holders: 4 first microbatches, the last 3 backwards late.
        let secs = relay_gpus_secs(&w, &trips, 2, own);
        assert!(3.0 * backward < trip);
        assert!(
            (secs - (2.0 * trip + 3.0 * backward)).abs() < 1e-9,
            "{secs} {trip}"
        );
        // Ten: 19 backwards late, more than a third wave.
        let secs = relay_gpus_secs(&w, &trips, 10, own);
        assert!(19.0 * backward > trip);
        assert!((secs - 3.0 * trip).abs() < 1e-9, "{secs} {trip}");
    }
}
