//! The GWTF routing model (docs/SPEC.md sections 2-3) on top of [`MinCostFlow`].
//!
//! Flow graph: a super source `s` and sink `t`; every data holder `h` has a *send* node
//! (`s -> send`, capacity = holder capacity) and a *return* node (`return -> t`); every relay
//! is split into `in -> out` with capacity = the microbatches it can hold (node splitting).
//! Links become arcs only between consecutive pipeline positions: holder send -> stage 1,
//! stage k -> stage k+1, stage S -> holder return. A link's arc has capacity
//! `min(cap_i, cap_j)` and cost
//! `d_ij = (c_i + c_j)/2 + (lat_ij + lat_ji)/2 + 2*size/(bw_ij + bw_ji)` in integer µs.
//!
//! A bypass arc `s -> t` ("not trained this iteration") with capacity = demand keeps the
//! problem feasible. Its cost `M = (#flow nodes) * max d + 1` exceeds the cost of any simple
//! residual s-t path, so a min-cost solution always routes the maximum number of microbatches
//! first and only then minimises total delay.
//!
//! Relaxation (as in `bench/flow_reference.py`): this is a single-commodity flow, so a
//! microbatch may return to a different data holder than the one that sent it.
//!
//! Membership changes map to incremental solver updates: join = new nodes/arcs, crash or
//! leave = `remove_node`, capacity = `set_arc_capacity`, link or compute change =
//! `set_arc_cost`; the next [`RoutingModel::solve`] repairs instead of re-solving.
use super::{ArcId, FlowError, MinCostFlow, NodeId, Status};
use std::collections::HashMap;

/// Handle of a routing member (data holder or relay); stable across removals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeIdx(pub u32);

/// One route of the solution: the members it visits (a data holder, one relay per stage,
/// a data holder), how many microbatches take it, and its cost (sum of link costs, µs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub nodes: Vec<NodeIdx>,
    pub count: i64,
    pub cost_us: i64,
}

/// Measured properties of a link between two members, per direction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkParams {
    /// One-way latency a -> b, µs.
    pub latency_ab_us: f64,
    /// One-way latency b -> a, µs.
    pub latency_ba_us: f64,
    /// Bandwidth a -> b, bytes per second.
    pub bandwidth_ab: f64,
    /// Bandwidth b -> a, bytes per second.
    pub bandwidth_ba: f64,
}

impl LinkParams {
    /// A symmetric link.
    pub fn symmetric(latency_us: f64, bandwidth_bytes_per_s: f64) -> Self {
        LinkParams {
            latency_ab_us: latency_us,
            latency_ba_us: latency_us,
            bandwidth_ab: bandwidth_bytes_per_s,
            bandwidth_ba: bandwidth_bytes_per_s,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Holder,
    Relay(u32),
}

#[derive(Clone, Debug)]
struct Member {
    name: String,
    role: Role,
    capacity: i64,
    compute_us: f64,
    alive: bool,
    /// Holder: send node; relay: in node.
    a: NodeId,
    /// Holder: return node; relay: out node.
    b: NodeId,
    /// Holder: `s -> send`; relay: `in -> out`.
    cap_arc: ArcId,
    /// Holder: `return -> t`.
    cap_arc2: Option<ArcId>,
    /// Link arcs touching this member: (arc, other member).
    arcs: Vec<(ArcId, u32)>,
}

/// The GWTF routing problem; see the module docs.
#[derive(Clone, Debug)]
pub struct RoutingModel {
    stages: u32,
    activation_bytes: f64,
    aggregation_us: Vec<i64>,
    members: Vec<Member>,
    names: HashMap<String, u32>,
    links: HashMap<(u32, u32), LinkParams>,
    mcf: MinCostFlow,
    s: NodeId,
    t: NodeId,
    bypass: ArcId,
    demand: Option<i64>,
    current_demand: i64,
    max_d: i64,
    /// Flow node -> member index (u32::MAX for s and t).
    owner: Vec<u32>,
}

fn rerr(msg: impl Into<String>) -> FlowError {
    FlowError::Routing(msg.into())
}

impl RoutingModel {
    /// A model with `stages` pipeline stages and the given activation size in bytes (the
    /// gradient of a microbatch has the same size).
    pub fn new(stages: u32, activation_bytes: u64) -> Result<Self, FlowError> {
        if stages == 0 {
            return Err(rerr("need at least one stage"));
        }
        let mut mcf = MinCostFlow::new();
        let s = mcf.add_node(0)?;
        let t = mcf.add_node(0)?;
        let bypass = mcf.add_arc(s, t, 0, 1)?;
        Ok(RoutingModel {
            stages,
            activation_bytes: activation_bytes as f64,
            aggregation_us: vec![0; stages as usize],
            members: Vec::new(),
            names: HashMap::new(),
            links: HashMap::new(),
            mcf,
            s,
            t,
            bypass,
            demand: None,
            current_demand: 0,
            max_d: 1,
            owner: vec![u32::MAX, u32::MAX],
        })
    }

    /// Number of stages.
    pub fn stages(&self) -> u32 {
        self.stages
    }
    /// The underlying solver (read-only), e.g. for statistics.
    pub fn solver(&self) -> &MinCostFlow {
        &self.mcf
    }
    /// Number of member handles issued (including removed members).
    pub fn member_count(&self) -> usize {
        self.members.len()
    }
    /// Name of a member.
    pub fn name(&self, n: NodeIdx) -> Result<&str, FlowError> {
        Ok(&self.member(n)?.name)
    }
    /// Stage of a relay (1-based), or `None` for a data holder.
    pub fn stage_of(&self, n: NodeIdx) -> Result<Option<u32>, FlowError> {
        Ok(match self.member(n)?.role {
            Role::Holder => None,
            Role::Relay(k) => Some(k),
        })
    }
    /// Looks a live member up by name.
    pub fn find(&self, name: &str) -> Option<NodeIdx> {
        self.names.get(name).map(|&i| NodeIdx(i))
    }
    /// True when the member exists and has not been removed.
    pub fn is_alive(&self, n: NodeIdx) -> bool {
        self.members
            .get(n.0 as usize)
            .map(|m| m.alive)
            .unwrap_or(false)
    }

    fn member(&self, n: NodeIdx) -> Result<&Member, FlowError> {
        match self.members.get(n.0 as usize) {
            None => Err(rerr(format!("unknown member {}", n.0))),
            Some(m) if !m.alive => Err(rerr(format!("member {} ({}) was removed", n.0, m.name))),
            Some(m) => Ok(m),
        }
    }

    fn add_member(
        &mut self,
        name: Option<&str>,
        role: Role,
        capacity: i64,
        compute_us: f64,
    ) -> Result<NodeIdx, FlowError> {
        if capacity < 0 {
            return Err(rerr(format!("negative capacity {capacity}")));
        }
        if !compute_us.is_finite() || compute_us < 0.0 {
            return Err(rerr("compute time must be finite and >= 0"));
        }
        let idx = self.members.len() as u32;
        let name = name.map(str::to_string).unwrap_or_else(|| match role {
            Role::Holder => format!("h{idx}"),
            Role::Relay(k) => format!("r{idx}s{k}"),
        });
        if self.names.contains_key(&name) {
            return Err(rerr(format!("duplicate member name '{name}'")));
        }
        let a = self.mcf.add_node(0)?;
        let b = self.mcf.add_node(0)?;
        self.owner.push(idx);
        self.owner.push(idx);
        let (cap_arc, cap_arc2) = match role {
            Role::Holder => (
                self.mcf.add_arc(self.s, a, capacity, 0)?,
                Some(self.mcf.add_arc(b, self.t, capacity, 0)?),
            ),
            Role::Relay(_) => (self.mcf.add_arc(a, b, capacity, 0)?, None),
        };
        self.names.insert(name.clone(), idx);
        self.members.push(Member {
            name,
            role,
            capacity,
            compute_us,
            alive: true,
            a,
            b,
            cap_arc,
            cap_arc2,
            arcs: Vec::new(),
        });
        if role == Role::Holder {
            self.update_demand()?;
        }
        Ok(NodeIdx(idx))
    }

    /// Adds a data holder (source and sink of its microbatches) that can feed `capacity`
    /// microbatches per iteration; `compute_us` is its per-microbatch compute time.
    pub fn add_data_holder(
        &mut self,
        capacity: i64,
        compute_us: f64,
    ) -> Result<NodeIdx, FlowError> {
        self.add_member(None, Role::Holder, capacity, compute_us)
    }
    /// Like [`Self::add_data_holder`] with a name (unique) for display and lookup.
    pub fn add_data_holder_named(
        &mut self,
        name: &str,
        capacity: i64,
        compute_us: f64,
    ) -> Result<NodeIdx, FlowError> {
        self.add_member(Some(name), Role::Holder, capacity, compute_us)
    }
    /// Adds a relay serving `stage` (1-based) that can hold `capacity` microbatches and
    /// needs `compute_us` per microbatch.
    pub fn add_relay(
        &mut self,
        stage: u32,
        capacity: i64,
        compute_us: f64,
    ) -> Result<NodeIdx, FlowError> {
        self.add_relay_named_opt(None, stage, capacity, compute_us)
    }
    /// Like [`Self::add_relay`] with a name (unique).
    pub fn add_relay_named(
        &mut self,
        name: &str,
        stage: u32,
        capacity: i64,
        compute_us: f64,
    ) -> Result<NodeIdx, FlowError> {
        self.add_relay_named_opt(Some(name), stage, capacity, compute_us)
    }
    fn add_relay_named_opt(
        &mut self,
        name: Option<&str>,
        stage: u32,
        capacity: i64,
        compute_us: f64,
    ) -> Result<NodeIdx, FlowError> {
        if stage == 0 || stage > self.stages {
            return Err(rerr(format!("stage {stage} outside 1..={}", self.stages)));
        }
        self.add_member(name, Role::Relay(stage), capacity, compute_us)
    }

    /// Pipeline position: holders send at 0 and receive at S+1, relays at their stage.
    fn arc_ends(&self, i: u32, j: u32) -> Vec<(NodeId, NodeId, u32, u32)> {
        let (mi, mj) = (&self.members[i as usize], &self.members[j as usize]);
        let mut out = Vec::new();
        for (x, y, xi, yi) in [(mi, mj, i, j), (mj, mi, j, i)] {
            match (x.role, y.role) {
                (Role::Holder, Role::Relay(1)) => out.push((x.a, y.a, xi, yi)),
                (Role::Relay(k), Role::Holder) if k == self.stages => out.push((x.b, y.b, xi, yi)),
                (Role::Relay(k), Role::Relay(l)) if l == k + 1 => out.push((x.b, y.a, xi, yi)),
                _ => {}
            }
        }
        out
    }

    fn link_cost(&self, i: u32, j: u32, p: &LinkParams) -> i64 {
        let (ci, cj) = (
            self.members[i as usize].compute_us,
            self.members[j as usize].compute_us,
        );
        let bw = p.bandwidth_ab + p.bandwidth_ba;
        let xfer = if bw > 0.0 {
            2.0 * self.activation_bytes / bw * 1e6
        } else {
            f64::INFINITY
        };
        let d = (ci + cj) / 2.0 + (p.latency_ab_us + p.latency_ba_us) / 2.0 + xfer;
        if d.is_finite() {
            d.round().clamp(0.0, 1e15) as i64
        } else {
            1_000_000_000_000
        }
    }

    /// Sets (or updates) the measured link between two members. Links between members that
    /// are not consecutive in the pipeline are stored but carry no flow.
    pub fn set_link(&mut self, a: NodeIdx, b: NodeIdx, p: LinkParams) -> Result<(), FlowError> {
        self.member(a)?;
        self.member(b)?;
        if a == b {
            return Err(rerr("a link needs two different members"));
        }
        let vals = [
            p.latency_ab_us,
            p.latency_ba_us,
            p.bandwidth_ab,
            p.bandwidth_ba,
        ];
        if vals.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(rerr("latency and bandwidth must be finite and >= 0"));
        }
        let (key, p) = if a.0 < b.0 {
            ((a.0, b.0), p)
        } else {
            (
                (b.0, a.0),
                LinkParams {
                    latency_ab_us: p.latency_ba_us,
                    latency_ba_us: p.latency_ab_us,
                    bandwidth_ab: p.bandwidth_ba,
                    bandwidth_ba: p.bandwidth_ab,
                },
            )
        };
        self.links.insert(key, p);
        let d = self.link_cost(key.0, key.1, &p);
        self.max_d = self.max_d.max(d);
        let existing: Vec<ArcId> = self.members[key.0 as usize]
            .arcs
            .iter()
            .filter(|(_, o)| *o == key.1)
            .map(|(arc, _)| *arc)
            .collect();
        if !existing.is_empty() {
            for arc in existing {
                self.mcf.set_arc_cost(arc, d)?;
            }
            return Ok(());
        }
        for (u, v, xi, yi) in self.arc_ends(key.0, key.1) {
            let cap = self.members[xi as usize]
                .capacity
                .min(self.members[yi as usize].capacity);
            let arc = self.mcf.add_arc(u, v, cap, d)?;
            self.members[xi as usize].arcs.push((arc, yi));
            self.members[yi as usize].arcs.push((arc, xi));
        }
        Ok(())
    }

    /// Removes a link (its arcs are removed; flow on them is repaired at `solve()`).
    pub fn remove_link(&mut self, a: NodeIdx, b: NodeIdx) -> Result<(), FlowError> {
        self.member(a)?;
        self.member(b)?;
        let key = (a.0.min(b.0), a.0.max(b.0));
        if self.links.remove(&key).is_none() {
            return Err(rerr(format!("no link between {} and {}", a.0, b.0)));
        }
        let arcs: Vec<ArcId> = self.members[key.0 as usize]
            .arcs
            .iter()
            .filter(|(_, o)| *o == key.1)
            .map(|(arc, _)| *arc)
            .collect();
        for arc in arcs {
            self.mcf.remove_arc(arc)?;
        }
        self.members[key.0 as usize]
            .arcs
            .retain(|(_, o)| *o != key.1);
        self.members[key.1 as usize]
            .arcs
            .retain(|(_, o)| *o != key.0);
        Ok(())
    }

    /// Removes a member (crash or leave): its flow is cancelled and re-routed at `solve()`.
    pub fn remove_node(&mut self, n: NodeIdx) -> Result<(), FlowError> {
        let m = self.member(n)?.clone();
        self.mcf.remove_node(m.a)?;
        self.mcf.remove_node(m.b)?;
        for (_, o) in &m.arcs {
            let key = (n.0.min(*o), n.0.max(*o));
            self.links.remove(&key);
            self.members[*o as usize].arcs.retain(|(_, x)| *x != n.0);
        }
        let mm = &mut self.members[n.0 as usize];
        mm.alive = false;
        mm.arcs.clear();
        self.names.remove(&m.name);
        if m.role == Role::Holder {
            self.update_demand()?;
        }
        Ok(())
    }

    /// Changes how many microbatches a member can hold.
    pub fn set_capacity(&mut self, n: NodeIdx, capacity: i64) -> Result<(), FlowError> {
        let m = self.member(n)?;
        if capacity < 0 {
            return Err(rerr(format!("negative capacity {capacity}")));
        }
        let (cap_arc, cap_arc2, arcs, role) = (m.cap_arc, m.cap_arc2, m.arcs.clone(), m.role);
        self.members[n.0 as usize].capacity = capacity;
        self.mcf.set_arc_capacity(cap_arc, capacity)?;
        if let Some(a2) = cap_arc2 {
            self.mcf.set_arc_capacity(a2, capacity)?;
        }
        for (arc, o) in arcs {
            let c = capacity.min(self.members[o as usize].capacity);
            self.mcf.set_arc_capacity(arc, c)?;
        }
        if role == Role::Holder {
            self.update_demand()?;
        }
        Ok(())
    }

    /// Changes a member's per-microbatch compute time (updates the cost of its links).
    pub fn set_compute(&mut self, n: NodeIdx, compute_us: f64) -> Result<(), FlowError> {
        self.member(n)?;
        if !compute_us.is_finite() || compute_us < 0.0 {
            return Err(rerr("compute time must be finite and >= 0"));
        }
        self.members[n.0 as usize].compute_us = compute_us;
        let arcs = self.members[n.0 as usize].arcs.clone();
        for (arc, o) in arcs {
            let key = (n.0.min(o), n.0.max(o));
            let p = self.links[&key];
            let d = self.link_cost(key.0, key.1, &p);
            self.max_d = self.max_d.max(d);
            self.mcf.set_arc_cost(arc, d)?;
        }
        Ok(())
    }

    /// Aggregation (all-reduce) time of a stage (1-based), used in `T_iter`.
    pub fn set_aggregation_us(&mut self, stage: u32, us: i64) -> Result<(), FlowError> {
        if stage == 0 || stage > self.stages {
            return Err(rerr(format!("stage {stage} outside 1..={}", self.stages)));
        }
        if us < 0 {
            return Err(rerr(format!("negative aggregation time {us}")));
        }
        self.aggregation_us[stage as usize - 1] = us;
        Ok(())
    }

    /// Microbatches to train per iteration; `None` = sum of the data holders' capacities.
    pub fn set_demand(&mut self, demand: Option<i64>) -> Result<(), FlowError> {
        if let Some(d) = demand {
            if d < 0 {
                return Err(rerr("negative demand"));
            }
        }
        self.demand = demand;
        self.update_demand()
    }

    fn update_demand(&mut self) -> Result<(), FlowError> {
        let f = match self.demand {
            Some(d) => d,
            None => self
                .members
                .iter()
                .filter(|m| m.alive && m.role == Role::Holder)
                .fold(0i64, |sum, m| sum.saturating_add(m.capacity)),
        };
        if f != self.current_demand {
            self.current_demand = f;
            self.mcf.set_supply(self.s, f)?;
            self.mcf.set_supply(self.t, -f)?;
            self.mcf.set_arc_capacity(self.bypass, f)?;
        }
        Ok(())
    }

    /// Solves (or repairs) the routing. Always feasible thanks to the bypass arc.
    pub fn solve(&mut self) -> Result<Status, FlowError> {
        let nodes = self.mcf.node_count() as i64;
        let m_needed = nodes.saturating_mul(self.max_d).saturating_add(1);
        if self.mcf.arc_cost(self.bypass)? < m_needed {
            // Doubling keeps these (repairable) cost changes rare as the model grows.
            self.mcf
                .set_arc_cost(self.bypass, m_needed.saturating_mul(2))?;
        }
        self.mcf.solve()
    }

    /// Microbatches routed through the pipeline this iteration.
    pub fn flow_value(&self) -> i64 {
        self.current_demand - self.mcf.arc_flow(self.bypass).unwrap_or(0)
    }
    /// Microbatches that could not be routed (bypass flow).
    pub fn unrouted(&self) -> i64 {
        self.mcf.arc_flow(self.bypass).unwrap_or(0)
    }
    /// Sum over routed microbatches of their route cost (µs), bypass excluded.
    pub fn total_cost(&self) -> i64 {
        let bypass = self.unrouted() as i128 * self.mcf.arc_cost(self.bypass).unwrap_or(0) as i128;
        i64::try_from(self.mcf.cost_i128() - bypass).unwrap_or(i64::MAX)
    }

    /// Flow decomposition into routes (identical routes merged, sorted by cost then nodes).
    pub fn routes(&self) -> Vec<Route> {
        let n = self.mcf.node_count();
        let mut out_arcs: Vec<Vec<(u32, i64)>> = vec![Vec::new(); n];
        let mut rem: HashMap<u32, i64> = HashMap::new();
        for a in 0..self.mcf.arc_count() as u32 {
            let id = ArcId(a);
            if id == self.bypass || !self.mcf.arc_alive(id) {
                continue;
            }
            let f = self.mcf.arc_flow(id).unwrap_or(0);
            if f > 0 {
                let (u, _) = self.mcf.arc_ends(id).unwrap_or((NodeId(0), NodeId(0)));
                out_arcs[u.0 as usize].push((a, f));
                rem.insert(a, f);
            }
        }
        let mut merged: HashMap<Vec<NodeIdx>, (i64, i64)> = HashMap::new();
        let mut ptr = vec![0usize; n];
        loop {
            // Walk from s along arcs with remaining flow.
            let mut path: Vec<u32> = Vec::new();
            let mut v = self.s.0 as usize;
            let mut amount = i64::MAX;
            while v != self.t.0 as usize {
                let mut next = None;
                while ptr[v] < out_arcs[v].len() {
                    let a = out_arcs[v][ptr[v]].0;
                    if rem[&a] > 0 {
                        next = Some(a);
                        break;
                    }
                    ptr[v] += 1;
                }
                let Some(a) = next else { break };
                amount = amount.min(rem[&a]);
                path.push(a);
                v = self
                    .mcf
                    .arc_ends(ArcId(a))
                    .map(|e| e.1 .0 as usize)
                    .unwrap_or(0);
                if path.len() > n {
                    break; // cannot happen in a layered DAG; guards against cycles
                }
            }
            if path.is_empty() || v != self.t.0 as usize {
                break;
            }
            let mut nodes: Vec<NodeIdx> = Vec::new();
            let mut cost = 0i64;
            for &a in &path {
                *rem.get_mut(&a).unwrap() -= amount;
                let (u, w) = self
                    .mcf
                    .arc_ends(ArcId(a))
                    .unwrap_or((NodeId(0), NodeId(0)));
                let (ou, ow) = (self.owner[u.0 as usize], self.owner[w.0 as usize]);
                if ou != u32::MAX && ow != u32::MAX && ou != ow {
                    cost += self.mcf.arc_cost(ArcId(a)).unwrap_or(0);
                }
                if ow != u32::MAX && nodes.last() != Some(&NodeIdx(ow)) {
                    nodes.push(NodeIdx(ow));
                }
            }
            let e = merged.entry(nodes).or_insert((0, cost));
            e.0 += amount;
        }
        let mut routes: Vec<Route> = merged
            .into_iter()
            .map(|(nodes, (count, cost_us))| Route {
                nodes,
                count,
                cost_us,
            })
            .collect();
        routes.sort_by(|a, b| a.cost_us.cmp(&b.cost_us).then(a.nodes.cmp(&b.nodes)));
        routes
    }

    /// Largest route cost (µs): the critical path of the routing.
    pub fn critical_path_us(&self) -> i64 {
        self.routes().iter().map(|r| r.cost_us).max().unwrap_or(0)
    }
    /// `T_iter ~ 2 * critical path + max over stages of the aggregation time` (µs).
    pub fn t_iter_us(&self) -> i64 {
        2 * self.critical_path_us() + self.aggregation_us.iter().copied().max().unwrap_or(0)
    }
    /// Time per microbatch, `T_iter / flow` (µs); infinite when nothing is routed.
    pub fn t_iter_per_flow_us(&self) -> f64 {
        let f = self.flow_value();
        if f <= 0 {
            f64::INFINITY
        } else {
            self.t_iter_us() as f64 / f as f64
        }
    }
    /// Live members, in handle order.
    pub fn members(&self) -> Vec<NodeIdx> {
        (0..self.members.len() as u32)
            .filter(|&i| self.members[i as usize].alive)
            .map(NodeIdx)
            .collect()
    }
}
