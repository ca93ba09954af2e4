//! The centrally planned policy (`central-mcmf`): a min-cost max-flow over the
//! layered routing graph with global knowledge (docs/SPEC.md section 3),
//! behind a small trait so that the project's routing solver (`src/flow/`)
//! can be plugged in. It is a plan, not an optimum: it minimises the sum of
//! the paths' costs, not the iteration time (the yardstick for that is
//! [`super::bound`]).
//!
//! [`FlowRouter`] builds the instance for the project's min-cost flow solver
//! (`crate::flow`), the same one the routing benchmarks and the C API use.
//! Costs are load-dependent: the `k`-th microbatch routed through a relay
//! (from 0) also pays `k` times the relay's GPU time per microbatch, the
//! time it waits behind the others (a convex cost, one unit arc per
//! microbatch of the relay's capacity). Without it every flow of a stage
//! goes through its cheapest relay up to that relay's capacity.
use std::collections::BTreeMap;

use crate::protocol::{NodeId, Stage};

/// A routing instance: holders (source and sink of their own flows) and relays.
pub struct RouteInstance<'a> {
    /// (holder, microbatches it may have in flight).
    pub holders: Vec<(NodeId, u32)>,
    /// (relay, stage 1..=S, capacity).
    pub relays: Vec<(NodeId, Stage, u32)>,
    pub stages: Stage,
    /// d_ij in seconds (docs/SPEC.md section 2).
    pub cost: &'a dyn Fn(NodeId, NodeId) -> f64,
    /// GPU seconds per microbatch (forward + backward) of a relay: the wait
    /// each further microbatch routed through it adds.
    pub relay_secs: &'a dyn Fn(NodeId) -> f64,
}

/// The routing chosen: paths per holder (holder, stage-1 relay, ..., stage-S relay).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutePlan {
    pub paths: BTreeMap<NodeId, Vec<Vec<NodeId>>>,
    /// Flow value: microbatches routed at once.
    pub flow: u32,
    /// Largest cost of a flow (seconds), each flow returning to its holder.
    pub critical_path_s: f64,
    /// Sum of the flow costs of the min-cost flow (single commodity).
    pub total_cost_s: f64,
}

/// Anything that computes a centralized routing.
pub trait CentralRouter {
    fn route(&mut self, inst: &RouteInstance) -> RoutePlan;
}

/// The project's min-cost flow solver ([`crate::flow::MinCostFlow`]) on the
/// layered graph, with a bypass arc so that the most microbatches are routed
/// first and only then the least total delay.
#[derive(Default)]
pub struct FlowRouter;

impl CentralRouter for FlowRouter {
    fn route(&mut self, inst: &RouteInstance) -> RoutePlan {
        // An error is only possible with absurd costs (beyond exact cost
        // scaling): then nothing is routed.
        route_with_solver(inst).unwrap_or_default()
    }
}

fn route_with_solver(inst: &RouteInstance) -> Result<RoutePlan, crate::flow::FlowError> {
    use crate::flow::{ArcId, MinCostFlow};
    // Vertices: 0 source, 1 sink, holder h: 2+2i (out), 3+2i (in);
    // relay r: base+2j (in), base+2j+1 (out).
    let nh = inst.holders.len();
    let base = 2 + 2 * nh;
    let n = base + 2 * inst.relays.len();
    let demand: i64 = inst.holders.iter().map(|&(_, c)| c as i64).sum();
    let us = |s: f64| (s * 1e6).round() as i64;
    let mut mcf = MinCostFlow::with_capacity(n, n * 4);
    let mut nodes = Vec::with_capacity(n);
    for v in 0..n {
        let supply = match v {
            0 => demand,
            1 => -demand,
            _ => 0,
        };
        nodes.push(mcf.add_node(supply)?);
    }
    // Local copy of the arcs (tail, head, solver id) for the path decomposition.
    let mut arcs: Vec<(usize, usize, ArcId)> = Vec::new();
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut max_cost = 1i64;
    let mut add = |mcf: &mut MinCostFlow, a: usize, b: usize, cap: i64, cost: i64| {
        let id = mcf.add_arc(nodes[a], nodes[b], cap, cost)?;
        out[a].push(arcs.len());
        arcs.push((a, b, id));
        max_cost = max_cost.max(cost.abs());
        Ok::<(), crate::flow::FlowError>(())
    };
    for (i, &(_, cap)) in inst.holders.iter().enumerate() {
        add(&mut mcf, 0, 2 + 2 * i, cap as i64, 0)?;
        add(&mut mcf, 3 + 2 * i, 1, cap as i64, 0)?;
    }
    let mut by_stage: BTreeMap<Stage, Vec<usize>> = BTreeMap::new();
    for (j, &(r, s, cap)) in inst.relays.iter().enumerate() {
        let wait = us((inst.relay_secs)(r));
        for k in 0..cap.min(demand.max(1) as u32) as i64 {
            add(&mut mcf, base + 2 * j, base + 2 * j + 1, 1, k * wait)?;
        }
        by_stage.entry(s).or_default().push(j);
    }
    let empty = Vec::new();
    for (i, &(h, _)) in inst.holders.iter().enumerate() {
        for &j in by_stage.get(&1).unwrap_or(&empty) {
            let c = us((inst.cost)(h, inst.relays[j].0));
            add(&mut mcf, 2 + 2 * i, base + 2 * j, demand, c)?;
        }
        for &j in by_stage.get(&inst.stages).unwrap_or(&empty) {
            let c = us((inst.cost)(inst.relays[j].0, h));
            add(&mut mcf, base + 2 * j + 1, 3 + 2 * i, demand, c)?;
        }
    }
    for s in 1..inst.stages {
        for &a in by_stage.get(&s).unwrap_or(&empty) {
            for &b in by_stage.get(&(s + 1)).unwrap_or(&empty) {
                let c = us((inst.cost)(inst.relays[a].0, inst.relays[b].0));
                add(&mut mcf, base + 2 * a + 1, base + 2 * b, demand, c)?;
            }
        }
    }
    // "Not routed this iteration": dearer than any simple path, so flow comes first.
    let bypass_cost = (n as i64 + 1).saturating_mul(max_cost).saturating_add(1);
    let bypass = mcf.add_arc(nodes[0], nodes[1], demand, bypass_cost)?;
    mcf.solve()?;
    let unrouted = mcf.arc_flow(bypass)?;
    let flow = demand - unrouted;
    let total = mcf.cost_i128() - unrouted as i128 * bypass_cost as i128;
    let mut used: Vec<i64> = Vec::with_capacity(arcs.len());
    for &(_, _, id) in &arcs {
        used.push(mcf.arc_flow(id)?);
    }
    // Decompose into paths from each holder; each path returns to its own
    // holder (the single-commodity optimum may end at another holder: its
    // last hop is replaced by the hop to its own holder).
    let mut plan = RoutePlan {
        flow: flow.max(0) as u32,
        total_cost_s: total as f64 / 1e6,
        ..Default::default()
    };
    let is_relay_in = |v: usize| v >= base && (v - base) % 2 == 0;
    for (i, &(h, _)) in inst.holders.iter().enumerate() {
        loop {
            let mut v = 2 + 2 * i;
            let mut path = vec![h];
            let mut ok = false;
            for _ in 0..=2 * inst.stages as usize + 2 {
                let Some(k) = out[v].iter().copied().find(|&k| used[k] > 0) else {
                    break;
                };
                used[k] -= 1;
                v = arcs[k].1;
                if is_relay_in(v) {
                    path.push(inst.relays[(v - base) / 2].0);
                }
                if v >= 2 && v < base && v % 2 == 1 {
                    ok = true;
                    break;
                }
            }
            if !ok {
                break;
            }
            let mut c = 0.0;
            for w in path.windows(2) {
                c += (inst.cost)(w[0], w[1]);
            }
            c += (inst.cost)(*path.last().unwrap(), h);
            plan.critical_path_s = plan.critical_path_s.max(c);
            plan.paths.entry(h).or_default().push(path);
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_cheap_relays_and_respects_capacity() {
        // Two holders, two stages of two relays; relay 10 and 20 are cheap,
        // each holds one microbatch; 11 and 21 are expensive.
        let cost = |a: NodeId, b: NodeId| -> f64 {
            if a == 11 || b == 11 || a == 21 || b == 21 {
                5.0
            } else {
                1.0
            }
        };
        let inst = RouteInstance {
            holders: vec![(1, 1), (2, 1)],
            relays: vec![(10, 1, 1), (11, 1, 1), (20, 2, 1), (21, 2, 1)],
            stages: 2,
            cost: &cost,
            relay_secs: &|_| 0.0,
        };
        let plan = FlowRouter.route(&inst);
        assert_eq!(plan.flow, 2);
        let all: Vec<Vec<NodeId>> = plan.paths.values().flatten().cloned().collect();
        assert_eq!(all.len(), 2);
        assert!(all.contains(&vec![1, 10, 20]) || all.contains(&vec![2, 10, 20]));
        assert!((plan.total_cost_s - (3.0 + 15.0)).abs() < 1e-6);
        assert!((plan.critical_path_s - 15.0).abs() < 1e-6);
    }

    #[test]
    fn load_dependent_costs_spread_the_flows() {
        // Two holders of two microbatches, one stage of two equal relays of
        // capacity 4 with 1 s of GPU work per microbatch: without the wait
        // all four flows may share a relay; with it, two go through each
        // (a third on one relay would wait 2 s where the other's first
        // waits 0 s).
        let cost = |_: NodeId, _: NodeId| 1.0;
        let inst = RouteInstance {
            holders: vec![(1, 2), (2, 2)],
            relays: vec![(10, 1, 4), (11, 1, 4)],
            stages: 1,
            cost: &cost,
            relay_secs: &|_| 1.0,
        };
        let plan = FlowRouter.route(&inst);
        assert_eq!(plan.flow, 4);
        let through = |r: NodeId| plan.paths.values().flatten().filter(|p| p[1] == r).count();
        assert_eq!((through(10), through(11)), (2, 2));
        // Waits 0 + 1 on each relay, on top of 4 x 2 s of links.
        assert!(
            (plan.total_cost_s - (8.0 + 2.0)).abs() < 1e-6,
            "{}",
            plan.total_cost_s
        );
    }
}
