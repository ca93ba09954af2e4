//! The order of a stage's ring all-reduce.
//!
//! A ring all-reduce of `n` members takes `2 (n-1)` steps, and every step
//! waits for its slowest link, so the time is about `2 (n-1) * max over the
//! ring's links of (latency + chunk / bandwidth)`: the order matters as much as
//! the links. [`order`] picks a ring that keeps the slowest link fast (a
//! bottleneck travelling-salesman tour): the exact best ring up to
//! [`EXACT_MAX`] members ([`best_ring`], Held-Karp), beyond that nearest
//! neighbour then 2-opt moves that lower the slowest link, and the total as a
//! tie-break. For rings of hundreds of members whose links are only partly
//! known, [`super::ring_clusters`] orders clusters of near members. All of it
//! is deterministic, so every member (and the simulator) computes the same
//! ring from the same costs.

/// Rings up to this size are ordered exactly ([`best_ring`], `O(2^n n^2)`).
pub const EXACT_MAX: usize = 12;

/// Cost of a ring under `cost`: (slowest link, sum of links).
pub fn ring_cost(ring: &[usize], cost: &impl Fn(usize, usize) -> f64) -> (f64, f64) {
    let n = ring.len();
    if n < 2 {
        return (0.0, 0.0);
    }
    (0..n).fold((0.0f64, 0.0), |(max, sum), k| {
        let c = cost(ring[k], ring[(k + 1) % n]);
        (max.max(c), sum + c)
    })
}

/// A ring over `0..n` for a (symmetric or not) link cost `cost(a, b)` of
/// sending from `a` to `b`: [`best_ring`] up to [`EXACT_MAX`] members, else
/// the nearest-neighbour tour from member 0 improved by 2-opt moves.
/// Bounded: at most `n` passes of `n^2` candidate moves.
pub fn order(n: usize, cost: impl Fn(usize, usize) -> f64) -> Vec<usize> {
    if n <= 3 {
        return (0..n).collect();
    }
    if n <= EXACT_MAX {
        return best_ring(n, cost);
    }
    let mut ring = nearest_neighbour(n, &cost);
    // 2-opt: reverse ring[i+1..=j] when that lowers (slowest, total).
    let better =
        |a: (f64, f64), b: (f64, f64)| a.0 < b.0 - 1e-12 || (a.0 <= b.0 && a.1 < b.1 - 1e-12);
    let mut best = ring_cost(&ring, &cost);
    for _ in 0..n {
        let mut improved = false;
        for i in 0..n - 1 {
            for j in i + 2..n {
                ring[i + 1..=j].reverse();
                let c = ring_cost(&ring, &cost);
                if better(c, best) {
                    best = c;
                    improved = true;
                } else {
                    ring[i + 1..=j].reverse();
                }
            }
        }
        if !improved {
            break;
        }
    }
    ring
}

/// The nearest-neighbour tour over `0..n` from member 0 (each next member
/// the cheapest to reach from the last; ties to the smallest index):
/// `O(n^2)`, for rings too large for [`order`]'s 2-opt moves.
pub fn nearest_neighbour(n: usize, cost: impl Fn(usize, usize) -> f64) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    let mut ring = Vec::with_capacity(n);
    ring.push(0);
    let mut left: Vec<usize> = (1..n).collect();
    while !left.is_empty() {
        let last = *ring.last().expect("non-empty");
        let mut k = 0;
        for i in 1..left.len() {
            if cost(last, left[i]) < cost(last, left[k]) {
                k = i;
            }
        }
        ring.push(left.remove(k));
    }
    ring
}

/// Held-Karp over paths from member 0: `table[set * n + j]` is the smallest
/// slowest link of a path from 0 through `set` (a bit set holding 0) ending
/// at `j`.
fn bottleneck_paths(n: usize, cost: &impl Fn(usize, usize) -> f64) -> Vec<f64> {
    let full = 1usize << n;
    let mut best = vec![f64::INFINITY; full * n];
    best[n] = 0.0; // set {0}, ending at 0
    for set in (1..full).step_by(2) {
        for j in 0..n {
            let here = best[set * n + j];
            if !here.is_finite() {
                continue;
            }
            for k in (0..n).filter(|&k| set & (1 << k) == 0) {
                let next = &mut best[(set | 1 << k) * n + k];
                *next = next.min(here.max(cost(j, k)));
            }
        }
    }
    best
}

/// The smallest slowest link of any ring over `2..=`[`EXACT_MAX`] members
/// (bottleneck travelling salesman, exact). `0.0` below two members.
pub fn best_ring_bottleneck(n: usize, cost: impl Fn(usize, usize) -> f64) -> f64 {
    assert!(n <= EXACT_MAX, "best_ring_bottleneck: {n} members");
    if n < 2 {
        return 0.0;
    }
    let best = bottleneck_paths(n, &cost);
    let last = ((1usize << n) - 1) * n;
    (1..n)
        .map(|j| best[last + j].max(cost(j, 0)))
        .fold(f64::INFINITY, f64::min)
}

/// The best ring over `0..=`[`EXACT_MAX`] members, starting at member 0:
/// the smallest slowest link, then among those rings the smallest total
/// (a second Held-Karp pass over the links no slower than that bottleneck).
pub fn best_ring(n: usize, cost: impl Fn(usize, usize) -> f64) -> Vec<usize> {
    assert!(n <= EXACT_MAX, "best_ring: {n} members");
    if n <= 3 {
        return (0..n).collect();
    }
    let limit = best_ring_bottleneck(n, &cost);
    let usable = |a: usize, b: usize| cost(a, b) <= limit;
    let full = 1usize << n;
    let mut total = vec![f64::INFINITY; full * n];
    let mut from = vec![u8::MAX; full * n];
    total[n] = 0.0;
    for set in (1..full).step_by(2) {
        for j in 0..n {
            let here = total[set * n + j];
            if !here.is_finite() {
                continue;
            }
            for k in (0..n).filter(|&k| set & (1 << k) == 0 && usable(j, k)) {
                let at = (set | 1 << k) * n + k;
                if here + cost(j, k) < total[at] {
                    total[at] = here + cost(j, k);
                    from[at] = j as u8;
                }
            }
        }
    }
    let last = (full - 1) * n;
    let end = (1..n)
        .filter(|&j| usable(j, 0) && total[last + j].is_finite())
        .min_by(|&a, &b| (total[last + a] + cost(a, 0)).total_cmp(&(total[last + b] + cost(b, 0))))
        .expect("the bottleneck ring exists");
    let (mut ring, mut set, mut j) = (Vec::with_capacity(n), full - 1, end);
    while j != 0 {
        ring.push(j);
        let prev = from[set * n + j] as usize;
        set &= !(1 << j);
        j = prev;
    }
    ring.push(0);
    ring.reverse();
    // Ties keep the id order (with nothing known, nothing changes).
    let ids: Vec<usize> = (0..n).collect();
    let (found, plain) = (ring_cost(&ring, &cost), ring_cost(&ids, &cost));
    if plain.0 <= found.0 && plain.1 <= found.1 {
        ids
    } else {
        ring
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Points on a line: the best ring goes out and back.
    #[test]
    fn points_on_a_line_are_visited_in_order() {
        let pos = [0.0, 9.0, 1.0, 5.0, 3.0, 7.0];
        let cost = |a: usize, b: usize| f64::abs(pos[a] - pos[b]);
        let ring = order(pos.len(), cost);
        let mut seen = ring.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..pos.len()).collect::<Vec<_>>());
        // Out and back over every other point: the slowest link is the
        // largest gap between a point and the next but one (5..9 or 1..5: 4),
        // never the jump from one end to the other.
        assert_eq!(ring_cost(&ring, &cost).0, 4.0);
        let naive = ring_cost(&(0..pos.len()).collect::<Vec<_>>(), &cost).0;
        assert!(naive > 2.0);
    }

    #[test]
    fn two_far_clusters_are_crossed_only_twice() {
        // Members 0..4 in one region, 4..8 in another, interleaved ids.
        let region = |m: usize| m % 2;
        let cost = |a: usize, b: usize| if region(a) == region(b) { 1.0 } else { 100.0 };
        let ring = order(8, cost);
        let crossings = (0..8)
            .filter(|&k| region(ring[k]) != region(ring[(k + 1) % 8]))
            .count();
        assert_eq!(crossings, 2, "{ring:?}");
    }

    /// The nearest-neighbour tour: each next member the cheapest from the
    /// last, ties to the smallest index (all links equal: the id order).
    #[test]
    fn nearest_neighbour_tour_and_its_ties() {
        let pos = [0.0, 9.0, 1.0, 5.0, 3.0, 7.0];
        let cost = |a: usize, b: usize| f64::abs(pos[a] - pos[b]);
        assert_eq!(nearest_neighbour(6, cost), vec![0, 2, 4, 3, 5, 1]);
        assert_eq!(nearest_neighbour(5, |_, _| 1.0), vec![0, 1, 2, 3, 4]);
        assert_eq!(order(5, |_, _| 1.0), vec![0, 1, 2, 3, 4]);
        assert!(nearest_neighbour(0, cost).is_empty());
    }

    #[test]
    fn small_rings_and_determinism() {
        assert_eq!(order(0, |_, _| 1.0), Vec::<usize>::new());
        assert_eq!(order(3, |_, _| 1.0), vec![0, 1, 2]);
        let cost = |a: usize, b: usize| ((a * 7 + b * 13) % 11) as f64;
        assert_eq!(order(9, cost), order(9, cost));
    }
}
