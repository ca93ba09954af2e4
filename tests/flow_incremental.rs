//! Incremental repair == from-scratch optimum, over long seeded random change sequences,
//! checked against an independent reference solver and an optimality certificate.
use gwtf::flow::reference;
use gwtf::flow::rng::SplitMix64;
use gwtf::flow::{ArcId, FlowError, MinCostFlow, NodeId, Status};

/// Builds a fresh solver with the same live graph (ids remapped) and the reference input.
#[allow(clippy::needless_range_loop)]
fn snapshot(m: &MinCostFlow) -> (MinCostFlow, usize, Vec<i64>, Vec<reference::RefArc>) {
    let mut map = vec![usize::MAX; m.node_count()];
    let mut fresh = MinCostFlow::new();
    let mut supply = Vec::new();
    for i in 0..m.node_count() {
        if m.node_alive(NodeId(i as u32)) {
            let s = m.supply(NodeId(i as u32)).unwrap();
            map[i] = supply.len();
            supply.push(s);
            fresh.add_node(s).unwrap();
        }
    }
    let mut arcs = Vec::new();
    for a in 0..m.arc_count() {
        let a = ArcId(a as u32);
        if m.arc_alive(a) {
            let (u, v) = m.arc_ends(a).unwrap();
            let (u, v) = (map[u.0 as usize], map[v.0 as usize]);
            let (c, w) = (m.arc_capacity(a).unwrap(), m.arc_cost(a).unwrap());
            fresh
                .add_arc(NodeId(u as u32), NodeId(v as u32), c, w)
                .unwrap();
            arcs.push((u, v, c, w));
        }
    }
    (fresh, supply.len(), supply, arcs)
}

/// Random graph with a feasible-by-construction bypass: node 0 supplies, node 1 demands,
/// plus an expensive 0 -> 1 arc.
fn random_graph(rng: &mut SplitMix64, n: usize, m: usize, neg: bool) -> MinCostFlow {
    let mut g = MinCostFlow::new();
    let f = rng.range_i64(1, 12);
    for i in 0..n {
        let s = match i {
            0 => f,
            1 => -f,
            _ => 0,
        };
        g.add_node(s).unwrap();
    }
    g.add_arc(NodeId(0), NodeId(1), f, 1000).unwrap();
    for _ in 0..m {
        let u = rng.below(n as u64) as u32;
        let v = rng.below(n as u64) as u32;
        let lo = if neg { -20 } else { 0 };
        g.add_arc(
            NodeId(u),
            NodeId(v),
            rng.range_i64(0, 6),
            rng.range_i64(lo, 50),
        )
        .unwrap();
    }
    g
}

fn live_nodes(g: &MinCostFlow) -> Vec<u32> {
    (0..g.node_count() as u32)
        .filter(|&i| g.node_alive(NodeId(i)))
        .collect()
}
fn live_arcs(g: &MinCostFlow) -> Vec<u32> {
    (0..g.arc_count() as u32)
        .filter(|&i| g.arc_alive(ArcId(i)))
        .collect()
}

/// One random change; returns a label for failure messages.
fn random_change(rng: &mut SplitMix64, g: &mut MinCostFlow, neg: bool) -> String {
    let nodes = live_nodes(g);
    let arcs = live_arcs(g);
    let pick_node = |rng: &mut SplitMix64| nodes[rng.below(nodes.len() as u64) as usize];
    let lo = if neg { -20 } else { 0 };
    match rng.below(9) {
        0 if nodes.len() > 3 => {
            // never remove the two terminals (keeps the problem balanced)
            let v = pick_node(rng);
            if v > 1 {
                g.remove_node(NodeId(v)).unwrap();
                return format!("remove_node {v}");
            }
            "noop".into()
        }
        1 => {
            let id = g.add_node(0).unwrap();
            let u = pick_node(rng);
            let v = pick_node(rng);
            g.add_arc(NodeId(u), id, rng.range_i64(1, 5), rng.range_i64(lo, 40))
                .unwrap();
            g.add_arc(id, NodeId(v), rng.range_i64(1, 5), rng.range_i64(lo, 40))
                .unwrap();
            format!("add_node {} ({u} -> it -> {v})", id.0)
        }
        2 => {
            let (u, v) = (pick_node(rng), pick_node(rng));
            let a = g
                .add_arc(
                    NodeId(u),
                    NodeId(v),
                    rng.range_i64(0, 6),
                    rng.range_i64(lo, 50),
                )
                .unwrap();
            format!("add_arc {} {u}->{v}", a.0)
        }
        3 if arcs.len() > 1 => {
            let a = arcs[1 + rng.below(arcs.len() as u64 - 1) as usize];
            if a != 0 {
                g.remove_arc(ArcId(a)).unwrap();
            }
            format!("remove_arc {a}")
        }
        4 | 5 if !arcs.is_empty() => {
            let a = arcs[rng.below(arcs.len() as u64) as usize];
            let c = if a == 0 { 1000 } else { rng.range_i64(0, 8) };
            g.set_arc_capacity(ArcId(a), c.max(if a == 0 { 12 } else { 0 }))
                .unwrap();
            format!("set_cap {a} {c}")
        }
        6 | 7 if !arcs.is_empty() => {
            let a = arcs[rng.below(arcs.len() as u64) as usize];
            let c = if a == 0 { 1000 } else { rng.range_i64(lo, 60) };
            g.set_arc_cost(ArcId(a), c).unwrap();
            format!("set_cost {a} {c}")
        }
        _ => {
            // move supply between the terminals (bypass capacity keeps it feasible)
            let f = rng.range_i64(1, 12);
            g.set_supply(NodeId(0), f).unwrap();
            g.set_supply(NodeId(1), -f).unwrap();
            format!("set_supply {f}")
        }
    }
}

fn run_sequences(seeds: std::ops::Range<u64>, steps: usize, n: usize, m: usize, neg: bool) {
    let (mut warm, mut total, mut infeasible) = (0usize, 0usize, 0usize);
    for seed in seeds {
        let mut rng = SplitMix64::new(seed);
        let mut g = random_graph(&mut rng, n, m, neg);
        // make sure the bypass can always carry the full supply
        g.set_arc_capacity(ArcId(0), 12).unwrap();
        assert_eq!(g.solve().unwrap(), Status::Optimal, "seed {seed}");
        for step in 0..steps {
            let what = random_change(&mut rng, &mut g, neg);
            let st = g.solve().unwrap();
            total += 1;
            warm += g.stats().warm as usize;
            infeasible += (st == Status::Infeasible) as usize;
            let (mut fresh, rn, rs, ra) = snapshot(&g);
            let fst = fresh.solve().unwrap();
            let rf = reference::solve(rn, &rs, &ra);
            let ctx = format!("seed {seed} step {step} after {what}");
            assert_eq!(st, fst, "{ctx}: status incremental vs scratch");
            match rf {
                None => assert_ne!(st, Status::Optimal, "{ctx}: reference infeasible"),
                Some((c, _)) => {
                    assert_eq!(st, Status::Optimal, "{ctx}");
                    assert_eq!(g.cost_i128(), c, "{ctx}: incremental vs reference");
                    assert_eq!(fresh.cost_i128(), c, "{ctx}: scratch vs reference");
                    g.check_optimality()
                        .unwrap_or_else(|e| panic!("{ctx}: certificate (incremental): {e}"));
                    fresh
                        .check_optimality()
                        .unwrap_or_else(|e| panic!("{ctx}: certificate (scratch): {e}"));
                }
            }
            if st != Status::Optimal {
                // restore feasibility: the terminals' bypass carries everything
                g.set_arc_capacity(ArcId(0), 12).unwrap();
            }
        }
    }
    println!("{total} steps: {warm} incremental repairs, {infeasible} infeasible");
    // The point of the test: most steps must go through the repair path.
    assert!(
        warm * 10 >= total * 7,
        "only {warm} of {total} solves were incremental"
    );
}

#[test]
fn incremental_equals_scratch_nonnegative_costs() {
    run_sequences(0..40, 60, 12, 40, false);
}

#[test]
fn incremental_equals_scratch_negative_costs() {
    run_sequences(100..140, 60, 10, 30, true);
}

#[test]
fn incremental_equals_scratch_larger_graphs() {
    run_sequences(200..206, 40, 60, 300, false);
}

#[test]
fn bad_ids_are_errors_not_panics() {
    let mut g = MinCostFlow::new();
    let a = g.add_node(1).unwrap();
    let b = g.add_node(-1).unwrap();
    let e = g.add_arc(a, b, 1, 1).unwrap();
    assert_eq!(
        g.add_arc(a, NodeId(7), 1, 1),
        Err(FlowError::UnknownNode(7))
    );
    assert_eq!(g.set_arc_cost(ArcId(9), 1), Err(FlowError::UnknownArc(9)));
    assert_eq!(
        g.set_arc_capacity(e, -1),
        Err(FlowError::NegativeCapacity(-1))
    );
    g.remove_arc(e).unwrap();
    assert_eq!(g.remove_arc(e), Err(FlowError::ArcRemoved(0)));
    g.remove_node(b).unwrap();
    assert_eq!(g.set_supply(b, 0), Err(FlowError::NodeRemoved(1)));
    assert!(g.potential(NodeId(5)).is_err());
}

#[test]
fn infeasible_and_unbounded() {
    let mut g = MinCostFlow::new();
    let a = g.add_node(5).unwrap();
    let b = g.add_node(-5).unwrap();
    g.add_arc(a, b, 3, 1).unwrap();
    assert_eq!(g.solve().unwrap(), Status::Infeasible);
    let mut g = MinCostFlow::new();
    let a = g.add_node(0).unwrap();
    let b = g.add_node(0).unwrap();
    g.add_arc(a, b, gwtf::flow::INFINITE_CAPACITY, -1).unwrap();
    g.add_arc(b, a, gwtf::flow::INFINITE_CAPACITY, 0).unwrap();
    assert_eq!(g.solve().unwrap(), Status::Unbounded);
    // a finite negative cycle is fine: saturate it
    let mut g = MinCostFlow::new();
    let a = g.add_node(0).unwrap();
    let b = g.add_node(0).unwrap();
    g.add_arc(a, b, 4, -3).unwrap();
    g.add_arc(b, a, 2, 1).unwrap();
    assert_eq!(g.solve().unwrap(), Status::Optimal);
    assert_eq!(g.cost(), -4);
    g.check_optimality().unwrap();
}
