//! The order of a large ring whose links are only partly known.
//!
//! A member of a stage of hundreds measures its links to a few other members
//! only (the protocol bounds it), so the coordinator knows a sparse graph,
//! and a nearest-neighbour tour over it runs out of known links and jumps
//! blindly, maybe across the slowest pair of the world. Instead:
//! 1. members are joined into clusters by their cheapest known links (single
//!    linkage, in the order Kruskal's algorithm adds them); a cluster of
//!    `n / (2 EXACT_MAX)` members or more is established, and two
//!    established clusters are joined only while more than
//!    [`ring::EXACT_MAX`] are, a member (or a few) only to an established
//!    cluster, or to each other, by a link no dearer than twice those inside
//!    the clusters: regions stay apart;
//! 2. the established clusters go in the best ring for the cheapest known
//!    link between each two of them ([`ring::order`]: exact up to
//!    [`ring::EXACT_MAX`]);
//! 3. each cluster is walked depth first along its spanning tree, from the
//!    member the link from the previous cluster reaches to the one the link
//!    to the next cluster leaves from;
//! 4. the members left out (strays: no known link into a cluster of their
//!    own) are put, one by one, where their known links cost least: next
//!    to a member, or inside a cluster, they know a cheap link to.
//!
//! In a world of regions (the links between two regions all cost about the
//! same, those within one less) a cluster is a region, and the ring crosses
//! between regions as the best ring over them does, though no member
//! measured more than a few links; a stray costs its cheapest known link to
//! another region. Deterministic: the same links give the same ring.
use super::ring;
use std::collections::HashMap;

/// What a link nobody measured costs here: more than any measured one.
const UNKNOWN: f64 = 1e12;

/// A ring over `0..n` from the known symmetric links `(a, b, cost)` (a pair
/// not listed costs more than any listed; entries naming a member outside
/// `0..n`, a member with itself or a cost that is not a finite number are
/// ignored). Starts at member 0. About `O(E log E + k^2 + s n)` for `E`
/// links, `k` clusters and `s` strays.
pub fn order_by_clusters(n: usize, links: &[(usize, usize, f64)]) -> Vec<usize> {
    if n <= 3 {
        return (0..n).collect();
    }
    let mut edges: Vec<(f64, usize, usize)> = links
        .iter()
        .filter(|&&(a, b, w)| a < n && b < n && a != b && w.is_finite())
        .map(|&(a, b, w)| (w, a.min(b), a.max(b)))
        .collect();
    edges.sort_by(|x, y| x.0.total_cmp(&y.0).then((x.1, x.2).cmp(&(y.1, y.2))));
    let forest = Forest::single_linkage(n, &edges, ring::EXACT_MAX);
    let k = forest.members.len();
    let cluster_cost = |x: usize, y: usize| -> f64 {
        if x == y {
            0.0
        } else {
            *forest
                .cheapest
                .get(&(x.min(y), x.max(y)))
                .unwrap_or(&UNKNOWN)
        }
    };
    let clusters = if k <= 64 {
        ring::order(k, cluster_cost)
    } else {
        ring::nearest_neighbour(k, cluster_cost)
    };
    let (entry, exit) = forest.crossings(&clusters, &edges);
    let mut out = Vec::with_capacity(n);
    let mut walked = vec![false; n];
    for &c in &clusters {
        forest.walk(c, (entry[c], exit[c]), &mut walked, &mut out);
    }
    forest.insert_strays(&edges, &mut out);
    let zero = out
        .iter()
        .position(|&m| m == 0)
        .expect("every member is placed");
    out.rotate_left(zero);
    out
}

/// Clusters, the spanning tree of each, and the strays.
struct Forest {
    /// Each member's cluster (None: a stray).
    cluster: Vec<Option<usize>>,
    /// Each cluster's members, ascending; clusters numbered by their
    /// smallest member.
    members: Vec<Vec<usize>>,
    /// Tree links of each clustered member, (cost, other), cheapest first.
    tree: Vec<Vec<(f64, usize)>>,
    /// The cheapest known link between two clusters (smaller id first).
    cheapest: HashMap<(usize, usize), f64>,
}

impl Forest {
    /// Joins the members of `0..n` along `edges` (sorted, cheapest first);
    /// see the module's doc. With no cluster established (nothing known,
    /// or too little) every component is a cluster.
    fn single_linkage(n: usize, edges: &[(f64, usize, usize)], clusters: usize) -> Forest {
        let mut parent: Vec<usize> = (0..n).collect();
        fn root(parent: &mut [usize], mut a: usize) -> usize {
            while parent[a] != a {
                parent[a] = parent[parent[a]];
                a = parent[a];
            }
            a
        }
        let big = (n / (2 * clusters.max(1))).max(2);
        let mut size = vec![1usize; n];
        // The dearest tree link inside each component.
        let mut height = vec![0.0f64; n];
        let mut established = 0usize;
        // The dearest link inside any established cluster: the scale of
        // "near" (two strays farther apart than twice it stay apart).
        let mut scale = 0.0f64;
        let mut joins = Vec::new();
        for &(w, a, b) in edges {
            let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
            if ra == rb {
                continue;
            }
            let (sa, sb) = (size[ra], size[rb]);
            let join = match (sa >= big, sb >= big) {
                (false, false) => established == 0 || w <= 2.0 * scale,
                (true, true) => established > clusters,
                (true, false) => w <= 2.0 * height[ra],
                (false, true) => w <= 2.0 * height[rb],
            };
            if !join {
                continue;
            }
            let (keep, gone) = (ra.min(rb), ra.max(rb));
            parent[gone] = keep;
            size[keep] = sa + sb;
            height[keep] = height[ra].max(height[rb]).max(w);
            established = established + usize::from(sa + sb >= big)
                - usize::from(sa >= big)
                - usize::from(sb >= big);
            if sa + sb >= big {
                scale = scale.max(height[keep]);
            }
            joins.push((w, a, b));
        }
        let clustered = |size_of_root: usize| established == 0 || size_of_root >= big;
        let mut index = HashMap::new();
        let mut cluster = vec![None; n];
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (m, slot) in cluster.iter_mut().enumerate() {
            let r = root(&mut parent, m);
            if !clustered(size[r]) {
                continue;
            }
            let c = *index.entry(r).or_insert_with(|| {
                members.push(Vec::new());
                members.len() - 1
            });
            *slot = Some(c);
            members[c].push(m);
        }
        let mut tree = vec![Vec::new(); n];
        for (w, a, b) in joins {
            if cluster[a].is_some() {
                tree[a].push((w, b));
                tree[b].push((w, a));
            }
        }
        for t in &mut tree {
            t.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
        }
        let mut cheapest: HashMap<(usize, usize), f64> = HashMap::new();
        for &(w, a, b) in edges {
            if let (Some(x), Some(y)) = (cluster[a], cluster[b]) {
                if x != y {
                    cheapest.entry((x.min(y), x.max(y))).or_insert(w);
                }
            }
        }
        Forest {
            cluster,
            members,
            tree,
            cheapest,
        }
    }

    /// Where the ring enters and leaves each cluster, for the clusters in
    /// ring order: between two consecutive clusters the cheapest known link
    /// whose ends keep a cluster of two or more members from being entered
    /// and left at the same member. (None where no known link fits.)
    fn crossings(
        &self,
        ring: &[usize],
        edges: &[(f64, usize, usize)],
    ) -> (Vec<Option<usize>>, Vec<Option<usize>>) {
        let k = ring.len();
        let mut entry = vec![None; k];
        let mut exit = vec![None; k];
        if k < 2 {
            return (entry, exit);
        }
        // Known links between consecutive clusters, cheapest first, as
        // (from a member of the earlier, to one of the later).
        let mut next_of = vec![usize::MAX; k];
        for i in 0..k {
            next_of[ring[i]] = ring[(i + 1) % k];
        }
        let mut between: HashMap<usize, Vec<(usize, usize)>> = HashMap::new();
        for &(_, a, b) in edges {
            let (Some(x), Some(y)) = (self.cluster[a], self.cluster[b]) else {
                continue;
            };
            if x == y {
                continue;
            }
            if next_of[x] == y {
                between.entry(x).or_default().push((a, b));
            }
            if next_of[y] == x {
                between.entry(y).or_default().push((b, a));
            }
        }
        for &x in ring {
            let y = next_of[x];
            let fits = |&&(a, b): &&(usize, usize)| {
                (self.members[x].len() < 2 || entry[x] != Some(a))
                    && (self.members[y].len() < 2 || exit[y] != Some(b))
            };
            if let Some(&(a, b)) = between.get(&x).and_then(|c| c.iter().find(fits)) {
                exit[x] = Some(a);
                entry[y] = Some(b);
            }
        }
        (entry, exit)
    }

    /// Appends the members of cluster `c` to `out`: depth first along its
    /// tree from `entry`, `exit` last.
    fn walk(
        &self,
        c: usize,
        (entry, exit): (Option<usize>, Option<usize>),
        walked: &mut [bool],
        out: &mut Vec<usize>,
    ) {
        let members = &self.members[c];
        let start = entry
            .or_else(|| members.iter().copied().find(|&m| Some(m) != exit))
            .unwrap_or(members[0]);
        let from = out.len();
        let mut stack = vec![start];
        while let Some(m) = stack.pop() {
            if std::mem::replace(&mut walked[m], true) {
                continue;
            }
            out.push(m);
            // Cheapest child first: push the others before it.
            stack.extend(self.tree[m].iter().rev().map(|&(_, o)| o));
        }
        if let Some(x) = exit.filter(|&x| x != start) {
            let at = from
                + out[from..]
                    .iter()
                    .position(|&m| m == x)
                    .expect("exit in cluster");
            let x = out.remove(at);
            out.push(x);
        }
    }

    /// Puts every stray, in id order, between the two neighbours of `ring`
    /// where its dearer known link is cheapest (then the sum of both): a
    /// link it measured, else its cheapest link into the neighbour's
    /// cluster, else unknown.
    fn insert_strays(&self, edges: &[(f64, usize, usize)], ring: &mut Vec<usize>) {
        let mut known: HashMap<usize, Vec<(usize, f64)>> = HashMap::new();
        for &(w, a, b) in edges {
            for (s, o) in [(a, b), (b, a)] {
                if self.cluster[s].is_none() {
                    known.entry(s).or_default().push((o, w));
                }
            }
        }
        let strays = (0..self.cluster.len()).filter(|&m| self.cluster[m].is_none());
        for s in strays {
            let links = known.get(&s).map_or(&[][..], |v| v.as_slice());
            let direct: HashMap<usize, f64> = links.iter().map(|&(o, w)| (o, w)).collect();
            let mut into: HashMap<usize, f64> = HashMap::new();
            for &(o, w) in links {
                if let Some(c) = self.cluster[o] {
                    let e = into.entry(c).or_insert(w);
                    *e = e.min(w);
                }
            }
            let est = |m: usize| -> f64 {
                direct
                    .get(&m)
                    .or_else(|| self.cluster[m].and_then(|c| into.get(&c)))
                    .copied()
                    .unwrap_or(UNKNOWN)
            };
            let len = ring.len();
            let mut best = (f64::INFINITY, f64::INFINITY, len);
            for i in 0..len {
                let (x, y) = (est(ring[i]), est(ring[(i + 1) % len]));
                let c = (x.max(y), x + y, i + 1);
                if c.0 < best.0 || (c.0 == best.0 && c.1 < best.1) {
                    best = c;
                }
            }
            ring.insert(best.2.min(len), s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A world of regions: the one-way cost between two regions.
    fn region_cost(ra: usize, rb: usize) -> f64 {
        if ra == rb {
            1.0
        } else {
            // Symmetric, uneven, well above the cost within a region.
            10.0 + ((ra * ra + rb * rb + 7 * ra * rb) % 37) as f64
        }
    }

    /// 300 members of 10 regions, interleaved by id (member m in region
    /// m % 10, the worst case for any order that follows ids), each knowing
    /// its links to 16 members at pseudo-random offsets and nothing else.
    /// The ring found crosses between regions no slower than the best ring
    /// over the regions does; the id order and
    /// the nearest-neighbour tour over the same known links are far slower.
    #[test]
    fn a_sparse_world_of_regions_gets_the_best_ring_over_regions() {
        let (n, r) = (300, 10);
        let region = |m: usize| m % r;
        let true_cost = |a: usize, b: usize| region_cost(region(a), region(b));
        let mut links = Vec::new();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for a in 0..n {
            for _ in 0..16 {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let b = (a + 1 + (state >> 33) as usize % (n - 1)) % n;
                links.push((a, b, true_cost(a, b)));
            }
        }
        let ring_found = order_by_clusters(n, &links);
        let mut seen = ring_found.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..n).collect::<Vec<_>>());
        let best_over_regions = ring::best_ring_bottleneck(r, region_cost);
        let slowest = ring::ring_cost(&ring_found, &true_cost).0;
        // (A ring over members may visit a region twice and beat it.)
        assert!(slowest <= best_over_regions, "{slowest}: {ring_found:?}");
        let ids: Vec<usize> = (0..n).collect();
        assert!(ring::ring_cost(&ids, &true_cost).0 > best_over_regions);
        let known: HashMap<(usize, usize), f64> = links
            .iter()
            .map(|&(a, b, w)| ((a.min(b), a.max(b)), w))
            .collect();
        let nn = ring::nearest_neighbour(n, |a, b| {
            *known.get(&(a.min(b), a.max(b))).unwrap_or(&UNKNOWN)
        });
        assert!(ring::ring_cost(&nn, &true_cost).0 > best_over_regions);
    }

    /// With nothing known every member is its own cluster and the ring is
    /// the id order; nonsense entries are ignored.
    #[test]
    fn nothing_known_keeps_the_id_order() {
        assert_eq!(order_by_clusters(20, &[]), (0..20).collect::<Vec<_>>());
        let nonsense = [
            (0, 0, 1.0),
            (3, 99, 1.0),
            (2, 5, f64::NAN),
            (4, 6, f64::INFINITY),
        ];
        assert_eq!(
            order_by_clusters(20, &nonsense),
            (0..20).collect::<Vec<_>>()
        );
        assert_eq!(order_by_clusters(3, &[]), vec![0, 1, 2]);
        assert!(order_by_clusters(0, &[]).is_empty());
    }

    /// Two clusters known as chains, joined by one known cheap link and one
    /// dear one: the ring enters and leaves each at different members and
    /// crosses twice.
    #[test]
    fn two_clusters_are_crossed_twice_at_different_members() {
        // Cluster A: 0-2-4-6-8-10-12-14 (chain), B: 1-3-5-...-29.
        let mut links = Vec::new();
        for m in (0..28).step_by(2) {
            links.push((m, m + 2, 1.0));
            links.push((m + 1, m + 3, 1.0));
        }
        links.push((0, 1, 50.0));
        links.push((0, 3, 50.0));
        links.push((2, 1, 60.0));
        let ring = order_by_clusters(30, &links);
        let mut seen = ring.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..30).collect::<Vec<_>>());
        let crossings = (0..30)
            .filter(|&i| ring[i] % 2 != ring[(i + 1) % 30] % 2)
            .count();
        assert_eq!(crossings, 2, "{ring:?}");
    }

    proptest! {
        /// Whatever the links, the ring holds every member once.
        #[test]
        fn every_member_once(n in 0usize..60,
                             raw in proptest::collection::vec((0usize..70, 0usize..70, 0.0f64..100.0), 0..300)) {
            let ring = order_by_clusters(n, &raw);
            let mut seen = ring.clone();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..n).collect::<Vec<_>>());
            if n > 0 {
                prop_assert_eq!(ring[0], 0);
            }
        }
    }
}
