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
//!   all-reduce, which needs every gradient (by the best possible ring,
//!   [`super::allreduce::allreduce_lower_bound`]). A relay takes at most
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
//!   `ceil(m / F) P_h`); and each relay stage's work as above followed by
//!   the way back of its last task (a backward: each microbatch's comes
//!   after its forward there) through the stages before and the embedding's
//!   backward. Then the holders' all-reduce, by the best ring.
//!
//! Per-link byte limits are not counted (the bound is weaker, still
//! valid). What the bound ignores (the barrier's messages, queueing beyond
//! the above, aggregation waiting for every stage, a crash's recomputation)
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
    pub holders: &'a [Member],
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
    let waves = w.mb_per_holder.div_ceil(w.in_flight.max(1)) as f64;
    let mut trips: BTreeMap<usize, f64> = BTreeMap::new();
    let mut holders_done: f64 = 0.0;
    for h in w.holders {
        let own = w.mb_per_holder as f64 * holder_flops / h.flops;
        let relays_trip = *trips
            .entry(h.region)
            .or_insert_with(|| cheapest_relay_trip(w, h.region));
        let chain = waves * (holder_flops / h.flops + relays_trip);
        holders_done = holders_done.max(own.max(chain));
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
        relay_secs.push(busy_until + allreduce_lower_bound(&regions, m.stage_params(k), w.links));
        // The stage's last task is a backward (each microbatch's comes
        // after its forward here); that microbatch still goes back through
        // the stages before and the holder's embedding.
        holders_done = holders_done.max(busy_until + drain);
        fill += fwd / fastest(members) + hop;
        drain += 2.0 * fwd / fastest(members) + hop;
    }
    // Holders: their all-reduce needs every microbatch done.
    let regions: Vec<usize> = w.holders.iter().map(|h| h.region).collect();
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
/// one relay per stage and back, without the holder's own compute: each
/// relay's forward + backward on the fastest relay of its region, each hop's
/// transfer both ways. Members of a region share their links, so the
/// shortest path runs over (stage, region): `O(S R^2)`.
fn cheapest_relay_trip(w: &World, home: usize) -> f64 {
    let act = w.model.activation_bytes() as f64;
    let hop = |a: usize, b: usize| w.links.send_secs(a, b, act) + w.links.send_secs(b, a, act);
    // (region, cheapest cost so far ending at a relay of that region).
    let mut frontier: Vec<(usize, f64)> = vec![(home, 0.0)];
    for (i, members) in w.relays.iter().enumerate() {
        let k = (i + 1) as u16;
        let per_mb = 3.0 * w.model.stage_fwd_flops(k);
        let mut fastest: BTreeMap<usize, f64> = BTreeMap::new();
        for r in members {
            let t = per_mb / r.flops;
            let e = fastest.entry(r.region).or_insert(t);
            *e = e.min(t);
        }
        frontier = fastest
            .into_iter()
            .map(|(region, compute)| {
                let reach = frontier
                    .iter()
                    .map(|&(from, c)| c + hop(from, region))
                    .fold(f64::INFINITY, f64::min);
                (region, reach + compute)
            })
            .collect();
    }
    frontier
        .iter()
        .map(|&(from, c)| c + hop(from, home))
        .fold(f64::INFINITY, f64::min)
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
        let model = ModelPreset::by_name("llama-124m").unwrap();
        let link = |_: usize, _: usize| (0.001, 1e9);
        let links = Links {
            link: &link,
            nic: 1e12,
        };
        let holder = member(0, 1e12);
        iteration_bound(&World {
            model: &model,
            holders: &[holder, holder],
            relays,
            mb_per_holder: 4,
            in_flight: 2,
            links: &links,
        })
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
        // work on two relays (4 TFLOP/s); then a ring of two: 2 steps of
        // 1 ms + 4 ceil((params + 1) / 2) bytes / 1 GB/s.
        let fill1 = embed / 1e12 + hop;
        assert!(work(1) > 8.0 * 3.0 * f(1) / 4e12, "the drain binds stage 1");
        let busy1 = fill1 + work(1);
        let p1 = model.stage_params(1);
        let agg1 = 2.0 * (0.001 + 4.0 * (p1 + 1).div_ceil(2) as f64 / 1e9);
        assert!((b.stage_secs[1] - (busy1 + agg1)).abs() < 1e-12, "{b:?}");
        // Stage 2 starts after stage 1's forward and another hop; one
        // 2 TFLOP/s relay, alone: no all-reduce.
        let fill2 = fill1 + f(1) / 2e12 + hop;
        let busy2 = fill2 + work(2);
        assert!((b.stage_secs[2] - busy2).abs() < 1e-12, "{b:?}");
        // Holders: their all-reduce (a ring of two) after the latest of
        // 2 waves (4 microbatches, 2 in flight) of the round trip (own
        // compute + every relay's 3 forward at 2 TFLOP/s + s+1 hops both
        // ways), their own work, and each stage's work followed by the way
        // back of its last backward (the stages before, then the
        // embedding's backward).
        let own = model.loss_flops() + 3.0 * embed;
        let relays_c: f64 = (1..=s as u16).map(|k| 3.0 * f(k) / 2e12).sum();
        let trip = own / 1e12 + relays_c + (s as f64 + 1.0) * 2.0 * hop;
        let mut done = (2.0 * trip).max(4.0 * own / 1e12);
        let (mut fill, mut drain) = (fill1, 2.0 * embed / 1e12 + hop);
        for k in 1..=s as u16 {
            done = done.max(fill + work(k) + drain);
            fill += f(k) / 2e12 + hop;
            drain += 2.0 * f(k) / 2e12 + hop;
        }
        let p0 = model.stage_params(0);
        let agg0 = 2.0 * (0.001 + 4.0 * (p0 + 1).div_ceil(2) as f64 / 1e9);
        let want0 = done + agg0;
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
        };
        let near = member(0, 1e15);
        let far = member(1, 2e15);
        let relays = vec![vec![near, far]; s];
        let holders = [near];
        let w = World {
            model: &model,
            holders: &holders,
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
        let b = tiny(&relays).unwrap();
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
        let want = fill1 + 8.0 / rate;
        assert!(
            (b.stage_secs[1] - want).abs() < 1e-9,
            "{} {want}",
            b.stage_secs[1]
        );
        // Stage 2 has room: GPU time alone, after its fill.
        let f2 = model.stage_fwd_flops(2);
        let fill2 = fill1 + f1 / 2e12 + hop / 2.0;
        assert!((b.stage_secs[2] - fill2 - 8.0 * 3.0 * f2 / 2e12).abs() < 1e-12);
    }
}
