//! The centralized yardstick: min-cost max-flow over the layered routing
//! graph with global knowledge (GWTF.md section 4), behind a small trait so
//! that the project's routing solver (`src/flow/`) can be plugged in.
//!
//! [`SspRouter`] is a small successive-shortest-paths solver (Bellman-Ford
//! on the residual graph) meant for simulator-sized instances (hundreds of
//! nodes); it is not the project's solver.
use std::collections::BTreeMap;

use crate::protocol::{NodeId, Stage};

/// A routing instance: holders (source and sink of their own flows) and relays.
pub struct RouteInstance<'a> {
    /// (holder, microbatches it may have in flight).
    pub holders: Vec<(NodeId, u32)>,
    /// (relay, stage 1..=S, capacity).
    pub relays: Vec<(NodeId, Stage, u32)>,
    pub stages: Stage,
    /// d_ij in seconds (GWTF.md section 3).
    pub cost: &'a dyn Fn(NodeId, NodeId) -> f64,
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

/// Successive shortest paths (small instances).
#[derive(Default)]
pub struct SspRouter;

struct Arc_ {
    to: usize,
    cap: i64,
    cost: i64,
}

struct Graph {
    arcs: Vec<Arc_>,
    adj: Vec<Vec<usize>>,
}

impl Graph {
    fn new(n: usize) -> Graph {
        Graph {
            arcs: Vec::new(),
            adj: vec![Vec::new(); n],
        }
    }
    fn add(&mut self, a: usize, b: usize, cap: i64, cost: i64) {
        self.adj[a].push(self.arcs.len());
        self.arcs.push(Arc_ { to: b, cap, cost });
        self.adj[b].push(self.arcs.len());
        self.arcs.push(Arc_ {
            to: a,
            cap: 0,
            cost: -cost,
        });
    }
}

impl CentralRouter for SspRouter {
    fn route(&mut self, inst: &RouteInstance) -> RoutePlan {
        // Vertices: 0 source, 1 sink, holder h: 2+2i (out), 3+2i (in);
        // relay r: base+2j (in), base+2j+1 (out).
        let nh = inst.holders.len();
        let base = 2 + 2 * nh;
        let n = base + 2 * inst.relays.len();
        let mut g = Graph::new(n);
        let us = |s: f64| (s * 1e6).round() as i64;
        for (i, &(_, cap)) in inst.holders.iter().enumerate() {
            g.add(0, 2 + 2 * i, cap as i64, 0);
            g.add(3 + 2 * i, 1, cap as i64, 0);
        }
        let mut by_stage: BTreeMap<Stage, Vec<usize>> = BTreeMap::new();
        for (j, &(_, s, cap)) in inst.relays.iter().enumerate() {
            g.add(base + 2 * j, base + 2 * j + 1, cap as i64, 0);
            by_stage.entry(s).or_default().push(j);
        }
        let empty = Vec::new();
        for (i, &(h, _)) in inst.holders.iter().enumerate() {
            for &j in by_stage.get(&1).unwrap_or(&empty) {
                g.add(
                    2 + 2 * i,
                    base + 2 * j,
                    i64::MAX / 4,
                    us((inst.cost)(h, inst.relays[j].0)),
                );
            }
            for &j in by_stage.get(&inst.stages).unwrap_or(&empty) {
                g.add(
                    base + 2 * j + 1,
                    3 + 2 * i,
                    i64::MAX / 4,
                    us((inst.cost)(inst.relays[j].0, h)),
                );
            }
        }
        for s in 1..inst.stages {
            for &a in by_stage.get(&s).unwrap_or(&empty) {
                for &b in by_stage.get(&(s + 1)).unwrap_or(&empty) {
                    let c = us((inst.cost)(inst.relays[a].0, inst.relays[b].0));
                    g.add(base + 2 * a + 1, base + 2 * b, i64::MAX / 4, c);
                }
            }
        }
        // Successive shortest paths, one augmentation per Bellman-Ford.
        let mut flow = 0i64;
        let mut total = 0i64;
        loop {
            let mut dist = vec![i64::MAX; n];
            let mut pred = vec![usize::MAX; n];
            let mut inq = vec![false; n];
            let mut q = std::collections::VecDeque::new();
            dist[0] = 0;
            q.push_back(0);
            while let Some(u) = q.pop_front() {
                inq[u] = false;
                for &e in &g.adj[u] {
                    let a = &g.arcs[e];
                    if a.cap > 0 && dist[u] + a.cost < dist[a.to] {
                        dist[a.to] = dist[u] + a.cost;
                        pred[a.to] = e;
                        if !inq[a.to] {
                            inq[a.to] = true;
                            q.push_back(a.to);
                        }
                    }
                }
            }
            if dist[1] == i64::MAX {
                break;
            }
            let mut f = i64::MAX;
            let mut v = 1;
            while v != 0 {
                let e = pred[v];
                f = f.min(g.arcs[e].cap);
                v = g.arcs[e ^ 1].to;
            }
            let mut v = 1;
            while v != 0 {
                let e = pred[v];
                g.arcs[e].cap -= f;
                g.arcs[e ^ 1].cap += f;
                v = g.arcs[e ^ 1].to;
            }
            flow += f;
            total += f * dist[1];
        }
        // Decompose into paths from each holder; each path returns to its own
        // holder (the single-commodity optimum may end at another holder:
        // its last hop is replaced by the hop to its own holder).
        let mut used: Vec<i64> = (0..g.arcs.len())
            .map(|e| if e % 2 == 0 { g.arcs[e ^ 1].cap } else { 0 })
            .collect();
        let mut plan = RoutePlan {
            flow: flow as u32,
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
                    let next = g.adj[v]
                        .iter()
                        .copied()
                        .find(|&e| e % 2 == 0 && used[e] > 0);
                    let Some(e) = next else { break };
                    used[e] -= 1;
                    v = g.arcs[e].to;
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
        plan
    }
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
        };
        let plan = SspRouter.route(&inst);
        assert_eq!(plan.flow, 2);
        let all: Vec<Vec<NodeId>> = plan.paths.values().flatten().cloned().collect();
        assert_eq!(all.len(), 2);
        assert!(all.contains(&vec![1, 10, 20]) || all.contains(&vec![2, 10, 20]));
        assert!((plan.total_cost_s - (3.0 + 15.0)).abs() < 1e-6);
        assert!((plan.critical_path_s - 15.0).abs() < 1e-6);
    }
}
