//! A deliberately simple reference solver for tests: successive shortest paths with
//! Bellman-Ford on the residual graph (negative-cost arcs are saturated first, so the
//! residual graph has no negative cycle). O(F * n * m): small graphs only.

/// Arc of a reference instance: `(tail, head, capacity, cost)`.
pub type RefArc = (usize, usize, i64, i64);

/// Result of the reference solver: `None` when infeasible, else `(cost, flow per arc)`.
pub fn solve(n: usize, supply: &[i64], arcs: &[RefArc]) -> Option<(i128, Vec<i64>)> {
    if supply.iter().map(|&s| s as i128).sum::<i128>() != 0 {
        return None;
    }
    // residual graph as edge list: 2*i forward, 2*i+1 backward
    let mut to = Vec::new();
    let mut cap = Vec::new();
    let mut cost = Vec::new();
    let mut excess = supply.to_vec();
    for &(u, v, c, w) in arcs {
        to.push(v);
        to.push(u);
        if w < 0 {
            // saturate
            cap.push(0);
            cap.push(c);
            excess[u] -= c;
            excess[v] += c;
        } else {
            cap.push(c);
            cap.push(0);
        }
        cost.push(w);
        cost.push(-w);
    }
    let from = |e: usize| -> usize { to[e ^ 1] };
    loop {
        let srcs: Vec<usize> = (0..n).filter(|&v| excess[v] > 0).collect();
        if srcs.is_empty() {
            break;
        }
        // Bellman-Ford from all excess nodes.
        let mut dist = vec![i128::MAX; n];
        let mut par = vec![usize::MAX; n];
        for &s in &srcs {
            dist[s] = 0;
        }
        for _ in 0..n {
            let mut changed = false;
            for e in 0..to.len() {
                let u = from(e);
                if cap[e] > 0 && dist[u] != i128::MAX {
                    let nd = dist[u] + cost[e] as i128;
                    if nd < dist[to[e]] {
                        dist[to[e]] = nd;
                        par[to[e]] = e;
                        changed = true;
                    }
                }
            }
            if !changed {
                break;
            }
        }
        let t = (0..n)
            .filter(|&v| excess[v] < 0 && dist[v] != i128::MAX)
            .min_by_key(|&v| dist[v])?;
        let mut amt = -excess[t];
        let mut v = t;
        while par[v] != usize::MAX {
            amt = amt.min(cap[par[v]]);
            v = from(par[v]);
        }
        amt = amt.min(excess[v]);
        let s = v;
        let mut v = t;
        while par[v] != usize::MAX {
            let e = par[v];
            cap[e] -= amt;
            cap[e ^ 1] += amt;
            v = from(e);
        }
        excess[s] -= amt;
        excess[t] += amt;
    }
    if excess.iter().any(|&e| e != 0) {
        return None;
    }
    let flows: Vec<i64> = (0..arcs.len()).map(|i| cap[2 * i + 1]).collect();
    let total = arcs
        .iter()
        .zip(&flows)
        .map(|(a, &f)| f as i128 * a.3 as i128)
        .sum();
    Some((total, flows))
}
