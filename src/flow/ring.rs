//! The order of a stage's ring all-reduce.
//!
//! A ring all-reduce of `n` members takes `2 (n-1)` steps, and every step
//! waits for its slowest link, so the time is about `2 (n-1) * max over the
//! ring's links of (latency + chunk / bandwidth)`: the order matters as much as
//! the links. [`order`] picks a ring that keeps the slowest link fast (a
//! bottleneck travelling-salesman tour: nearest neighbour, then 2-opt moves
//! that lower the slowest link, and the total as a tie-break). It is
//! deterministic, so every member (and the simulator) computes the same ring
//! from the same costs.

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
/// sending from `a` to `b`. Starts at member 0. Bounded: at most `n` passes
/// of `n^2` candidate moves.
pub fn order(n: usize, cost: impl Fn(usize, usize) -> f64) -> Vec<usize> {
    if n <= 3 {
        return (0..n).collect();
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
