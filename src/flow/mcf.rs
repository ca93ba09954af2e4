//! The min-cost flow solver: cold cost scaling plus incremental repair (see the module docs
//! of [`crate::flow`] for the algorithm choice).
//!
//! Sign conventions: the reduced cost of a residual arc `u -> v` is
//! `c(u,v) - pi(u) + pi(v)`; at optimality every residual arc has a non-negative reduced cost.
//! Flow moves from high to low potential, so `pi` behaves like minus a shortest distance.
//!
//! Ids: [`NodeId`] and [`ArcId`] are dense indices issued in order and never reused. Removed
//! nodes and arcs stay as tombstones (capacity 0, no supply) so ids remain stable; their
//! storage is reclaimed only when the whole solver is dropped.
//!
//! Incremental behaviour: after a successful [`MinCostFlow::solve`] the solver is *warm*.
//! Every later change is applied to the stored flow immediately (cancelling or saturating
//! flow so that the reduced-cost condition still holds) and records node imbalances; the next
//! `solve()` repairs those imbalances with bounded Dijkstra searches instead of re-solving.
//! Removals, capacity, cost and supply changes cost O(degree) plus the repair. Adding an
//! arc rebuilds the CSR arrays at the next `solve()` (O(n + m), no re-solve). Arcs with
//! capacity `>= INFINITE_CAPACITY` disable warm repairs (cold solves detect unboundedness).
use super::FlowError;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Identifier of a node; stable across removals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// Identifier of an arc; stable across removals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ArcId(pub u32);

/// Outcome of the last solve.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Status {
    /// Nothing solved yet, or the model changed since (call `solve()`).
    #[default]
    NotSolved,
    /// An optimal flow and dual-feasible potentials are available.
    Optimal,
    /// Supplies cannot be routed within the capacities (or do not sum to zero).
    Infeasible,
    /// A negative-cost cycle of arcs with capacity `>= INFINITE_CAPACITY` exists.
    Unbounded,
}

impl Status {
    /// Lower-case name used in JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::NotSolved => "not_solved",
            Status::Optimal => "optimal",
            Status::Infeasible => "infeasible",
            Status::Unbounded => "unbounded",
        }
    }
}

/// Capacities at or above this value are treated as unbounded.
pub const INFINITE_CAPACITY: i64 = 1 << 50;
/// Bound on `max |cost| * (n + 1)` so that scaled costs and prices stay far from overflow.
const SCALED_COST_LIMIT: i128 = 1 << 58;
/// Cost-scaling factor per phase (OR-tools uses 5, CS2 8–16).
const ALPHA: i64 = 5;
/// Global price updates run after this many relabels per node (they cost O(m); on our
/// layered instances frequent updates cost more than the relabels they save).
const UPDATE_EVERY_N_RELABELS: usize = 20;
const NONE: u32 = u32::MAX;
const BUCKETS: usize = 1024;
/// "Unreached" distance of the repair searches.
const INF: i64 = i64::MAX / 4;

/// CSR residual network. Slot `fwd[a]` is arc `a` (residual capacity `cap - flow`), slot
/// `rev[fwd[a]]` its reverse (residual capacity `flow`, cost `-cost`).
#[derive(Clone, Debug, Default)]
struct Residual {
    first: Vec<u32>,
    head: Vec<u32>,
    rev: Vec<u32>,
    rcap: Vec<i64>,
    /// Capacity of the slot's arc (same for both slots of a pair):
    /// `rcap[rev[a]] == tot[a] - rcap[a]`.
    tot: Vec<i64>,
    cost: Vec<i64>,
    fwd: Vec<u32>,
    /// Arc id of every slot (forward and reverse).
    slot_arc: Vec<u32>,
}

impl Residual {
    fn bytes(&self) -> usize {
        self.first.capacity() * 4
            + self.head.capacity() * 4
            + self.rev.capacity() * 4
            + self.rcap.capacity() * 8
            + self.tot.capacity() * 8
            + self.cost.capacity() * 8
            + self.fwd.capacity() * 4
            + self.slot_arc.capacity() * 4
    }
}

/// Priority queue of one repair search: Dial buckets for distances below `BUCKETS` (repair
/// distances are mostly tiny), LIFO inside a bucket, and a heap beyond. Entries may be stale
/// (the caller checks them against its labels).
#[derive(Clone, Debug, Default)]
struct DistQueue {
    /// (distance, LIFO tie-break sequence, node).
    heap: BinaryHeap<Reverse<(i64, u32, u32)>>,
    seq: u32,
    buckets: Vec<Vec<u32>>,
    cb: usize,
}

impl DistQueue {
    fn reset(&mut self) {
        self.heap.clear();
        if self.buckets.len() < BUCKETS {
            self.buckets.resize(BUCKETS, Vec::new());
        }
        for b in self.buckets[self.cb.min(BUCKETS)..].iter_mut() {
            b.clear();
        }
        self.cb = 0;
    }
    #[inline]
    fn push(&mut self, d: i64, v: u32) {
        if (d as u64) < BUCKETS as u64 {
            self.buckets[d as usize].push(v);
            self.cb = self.cb.min(d as usize);
        } else {
            self.seq = self.seq.wrapping_sub(1);
            self.heap.push(Reverse((d, self.seq, v)));
        }
    }
    /// Smallest entry, without removing it.
    #[inline]
    fn peek(&mut self) -> Option<(i64, u32)> {
        while self.cb < BUCKETS {
            if let Some(&v) = self.buckets[self.cb].last() {
                return Some((self.cb as i64, v));
            }
            self.cb += 1;
        }
        self.heap.peek().map(|Reverse((d, _, v))| (*d, *v))
    }
    /// Removes the entry last returned by `peek`.
    #[inline]
    fn pop_peeked(&mut self) {
        if self.cb < BUCKETS {
            self.buckets[self.cb].pop();
        } else {
            self.heap.pop();
        }
    }
}

/// Labels of one direction of the bidirectional repair search.
#[derive(Clone, Debug, Default)]
struct SearchSide {
    dist: Vec<i64>,
    /// `== epoch`: labelled; `== epoch + 1`: settled.
    stamp: Vec<u32>,
    /// Residual slot by which the node was labelled (forward: the arc into it; backward:
    /// the arc out of it towards a deficit), `NONE` for a start node.
    parent: Vec<u32>,
    queue: DistQueue,
    settled: Vec<u32>,
}

impl SearchSide {
    fn resize(&mut self, n: usize) {
        if self.dist.len() < n {
            self.dist.resize(n, 0);
            self.stamp.resize(n, 0);
            self.parent.resize(n, NONE);
        }
    }
    /// Distance of the smallest non-stale queue entry (`INF` when empty).
    #[inline]
    fn top(&mut self, lab: u32) -> i64 {
        while let Some((d, v)) = self.queue.peek() {
            let v = v as usize;
            if self.stamp[v] != lab || d > self.dist[v] {
                self.queue.pop_peeked();
                continue;
            }
            return d;
        }
        INF
    }
}

/// Scratch space for repair searches (kept between calls to avoid O(n) resets).
#[derive(Clone, Debug, Default)]
struct Scratch {
    fwd: SearchSide,
    bwd: SearchSide,
    epoch: u32,
    /// Augmenting walk (slots) and per-node position stamps for removing zero-cost cycles.
    path: Vec<u32>,
    path_nodes: Vec<u32>,
    pos: Vec<u32>,
    pos_stamp: Vec<u32>,
}

/// A min-cost flow problem with integer capacities and costs, solved cold by cost scaling
/// and repaired incrementally after changes.
#[derive(Clone, Debug, Default)]
pub struct MinCostFlow {
    supply: Vec<i64>,
    node_alive: Vec<bool>,
    degree: Vec<u32>,
    tail: Vec<u32>,
    head: Vec<u32>,
    cap: Vec<i64>,
    cost: Vec<i64>,
    arc_alive: Vec<bool>,
    infinite_arcs: usize,
    supply_sum: i128,

    status: Status,
    res: Residual,
    /// Arcs `>= res.fwd.len()` are not yet in the CSR arrays.
    pi: Vec<i64>,
    excess: Vec<i64>,
    warm: bool,
    dirty: Vec<u32>,
    total_cost: i128,
    scratch: Scratch,
    stats: SolveStats,
}

/// Counters of the last `solve()`, for benchmarks and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SolveStats {
    /// True when the last solve was an incremental repair.
    pub warm: bool,
    /// Dijkstra searches (repair) or refine phases (cold).
    pub iterations: u64,
    /// Nodes settled by repair searches, or relabels in a cold solve.
    pub work: u64,
}

impl MinCostFlow {
    /// An empty problem.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty problem with room for `nodes` nodes and `arcs` arcs.
    pub fn with_capacity(nodes: usize, arcs: usize) -> Self {
        let mut s = Self::default();
        s.supply.reserve(nodes);
        s.node_alive.reserve(nodes);
        s.degree.reserve(nodes);
        s.tail.reserve(arcs);
        s.head.reserve(arcs);
        s.cap.reserve(arcs);
        s.cost.reserve(arcs);
        s.arc_alive.reserve(arcs);
        s
    }

    // ----------------------------------------------------------------- model accessors

    /// Number of node ids issued (including removed ones).
    pub fn node_count(&self) -> usize {
        self.supply.len()
    }
    /// Number of arc ids issued (including removed ones).
    pub fn arc_count(&self) -> usize {
        self.tail.len()
    }
    /// Status of the last solve (`NotSolved` after any change).
    pub fn status(&self) -> Status {
        self.status
    }
    /// Counters of the last solve.
    pub fn stats(&self) -> SolveStats {
        self.stats
    }
    /// True when the node exists and was not removed.
    pub fn node_alive(&self, n: NodeId) -> bool {
        self.node_alive.get(n.0 as usize).copied().unwrap_or(false)
    }
    /// True when the arc exists and was not removed.
    pub fn arc_alive(&self, a: ArcId) -> bool {
        self.arc_alive.get(a.0 as usize).copied().unwrap_or(false)
    }
    /// Endpoints of an arc (also of removed arcs).
    pub fn arc_ends(&self, a: ArcId) -> Result<(NodeId, NodeId), FlowError> {
        let i = self.arc_index(a)?;
        Ok((NodeId(self.tail[i]), NodeId(self.head[i])))
    }
    /// Capacity of an arc.
    pub fn arc_capacity(&self, a: ArcId) -> Result<i64, FlowError> {
        Ok(self.cap[self.arc_index(a)?])
    }
    /// Cost per unit of an arc.
    pub fn arc_cost(&self, a: ArcId) -> Result<i64, FlowError> {
        Ok(self.cost[self.arc_index(a)?])
    }
    /// Supply (positive) or demand (negative) of a node.
    pub fn supply(&self, n: NodeId) -> Result<i64, FlowError> {
        Ok(self.supply[self.node_index(n)?])
    }
    /// Approximate heap bytes held by the solver (all arrays, by capacity).
    pub fn memory_bytes(&self) -> usize {
        self.supply.capacity() * 8
            + self.node_alive.capacity()
            + self.degree.capacity() * 4
            + self.tail.capacity() * 4
            + self.head.capacity() * 4
            + self.cap.capacity() * 8
            + self.cost.capacity() * 8
            + self.arc_alive.capacity()
            + self.res.bytes()
            + self.pi.capacity() * 8
            + self.excess.capacity() * 8
            + (self.scratch.fwd.dist.capacity() + self.scratch.bwd.dist.capacity()) * 8
            + (self.scratch.fwd.stamp.capacity() + self.scratch.bwd.stamp.capacity()) * 4
            + (self.scratch.fwd.parent.capacity() + self.scratch.bwd.parent.capacity()) * 4
            + (self.scratch.pos.capacity() + self.scratch.pos_stamp.capacity()) * 4
    }

    fn node_index(&self, n: NodeId) -> Result<usize, FlowError> {
        let i = n.0 as usize;
        match self.node_alive.get(i) {
            None => Err(FlowError::UnknownNode(n.0)),
            Some(false) => Err(FlowError::NodeRemoved(n.0)),
            Some(true) => Ok(i),
        }
    }
    fn arc_index(&self, a: ArcId) -> Result<usize, FlowError> {
        let i = a.0 as usize;
        if i >= self.tail.len() {
            return Err(FlowError::UnknownArc(a.0));
        }
        Ok(i)
    }
    fn live_arc_index(&self, a: ArcId) -> Result<usize, FlowError> {
        let i = self.arc_index(a)?;
        if !self.arc_alive[i] {
            return Err(FlowError::ArcRemoved(a.0));
        }
        Ok(i)
    }

    // ----------------------------------------------------------------- solution accessors

    /// Total cost of the current flow (meaningful when `status() == Optimal`).
    pub fn cost(&self) -> i64 {
        i64::try_from(self.total_cost).unwrap_or(i64::MAX)
    }
    /// Total cost as `i128` (never overflows).
    pub fn cost_i128(&self) -> i128 {
        self.total_cost
    }
    /// Flow on an arc (0 for removed arcs and before the first solve).
    pub fn arc_flow(&self, a: ArcId) -> Result<i64, FlowError> {
        let i = self.arc_index(a)?;
        Ok(self.flow_of(i))
    }
    fn flow_of(&self, i: usize) -> i64 {
        if !self.arc_alive[i] || i >= self.res.fwd.len() {
            return 0;
        }
        let s = self.res.fwd[i] as usize;
        self.res.rcap[self.res.rev[s] as usize]
    }
    /// Flows of all arcs in id order.
    pub fn arc_flows(&self) -> Vec<i64> {
        (0..self.tail.len()).map(|i| self.flow_of(i)).collect()
    }
    /// Node potential (dual value); with it every residual arc has reduced cost
    /// `cost - pi(tail) + pi(head) >= 0`.
    pub fn potential(&self, n: NodeId) -> Result<i64, FlowError> {
        let i = self.node_index(n)?;
        Ok(self.pi.get(i).copied().unwrap_or(0))
    }
    /// Total flow leaving supply nodes (= sum of positive supplies when optimal).
    pub fn flow_value(&self) -> i64 {
        self.supply
            .iter()
            .zip(&self.node_alive)
            .filter(|(s, a)| **a && **s > 0)
            .map(|(s, _)| *s)
            .sum()
    }

    // ----------------------------------------------------------------- building / changes

    /// Adds a node with the given supply (positive) or demand (negative).
    pub fn add_node(&mut self, supply: i64) -> Result<NodeId, FlowError> {
        if self.supply.len() >= (u32::MAX - 1) as usize {
            return Err(FlowError::TooLarge);
        }
        let id = self.supply.len() as u32;
        self.supply.push(supply);
        self.supply_sum += supply as i128;
        self.node_alive.push(true);
        self.degree.push(0);
        if self.warm {
            // An isolated node extends the CSR arrays without a rebuild.
            let last = *self.res.first.last().unwrap_or(&0);
            self.res.first.push(last);
            self.pi.push(0);
            self.excess.push(supply);
            if supply != 0 {
                self.dirty.push(id);
            }
        }
        self.status = Status::NotSolved;
        Ok(NodeId(id))
    }

    /// Adds an arc `u -> v` with capacity `cap >= 0` and cost per unit `cost`.
    pub fn add_arc(
        &mut self,
        u: NodeId,
        v: NodeId,
        cap: i64,
        cost: i64,
    ) -> Result<ArcId, FlowError> {
        let ui = self.node_index(u)?;
        let vi = self.node_index(v)?;
        if cap < 0 {
            return Err(FlowError::NegativeCapacity(cap));
        }
        if self.tail.len() >= (u32::MAX / 2 - 1) as usize {
            return Err(FlowError::TooLarge);
        }
        let id = self.tail.len() as u32;
        if self.warm && ui != vi {
            // A node without arcs has no flow: choose its potential so the new arc is tight
            // (a joining node then starts dual feasible and needs no saturation).
            if self.degree[vi] == 0 {
                self.pi[vi] = self.pi[ui].saturating_sub(cost);
            } else if self.degree[ui] == 0 {
                self.pi[ui] = self.pi[vi].saturating_add(cost);
            }
        }
        self.tail.push(u.0);
        self.head.push(v.0);
        self.cap.push(cap);
        self.cost.push(cost);
        self.arc_alive.push(true);
        self.degree[ui] += 1;
        self.degree[vi] += 1;
        if cap >= INFINITE_CAPACITY {
            self.infinite_arcs += 1;
            self.warm = false;
        }
        self.status = Status::NotSolved;
        Ok(ArcId(id))
    }

    /// Removes an arc; flow on it is cancelled and repaired at the next `solve()`.
    pub fn remove_arc(&mut self, a: ArcId) -> Result<(), FlowError> {
        let i = self.live_arc_index(a)?;
        if self.warm && i < self.res.fwd.len() {
            let f = self.flow_of(i);
            if f > 0 {
                self.push_arc(i, -f);
            }
            let s = self.res.fwd[i] as usize;
            let r = self.res.rev[s] as usize;
            self.res.rcap[s] = 0;
            self.res.rcap[r] = 0;
            self.res.tot[s] = 0;
            self.res.tot[r] = 0;
        }
        self.arc_alive[i] = false;
        self.degree[self.tail[i] as usize] -= 1;
        self.degree[self.head[i] as usize] -= 1;
        if self.cap[i] >= INFINITE_CAPACITY {
            self.infinite_arcs -= 1;
        }
        self.status = Status::NotSolved;
        Ok(())
    }

    /// Removes a node with all its arcs and its supply.
    pub fn remove_node(&mut self, n: NodeId) -> Result<(), FlowError> {
        let i = self.node_index(n)?;
        let arcs = self.incident_arcs(i);
        for a in arcs {
            self.remove_arc(ArcId(a))?;
        }
        self.set_supply(n, 0)?;
        self.node_alive[i] = false;
        Ok(())
    }

    /// Live arcs incident to node index `i` (CSR slots plus arcs added since the last build).
    fn incident_arcs(&self, i: usize) -> Vec<u32> {
        let mut out = Vec::new();
        if i + 1 < self.res.first.len() {
            let (b, e) = (self.res.first[i] as usize, self.res.first[i + 1] as usize);
            out.extend(self.res.slot_arc[b..e].iter().copied());
        }
        for a in self.res.fwd.len()..self.tail.len() {
            if self.tail[a] as usize == i || self.head[a] as usize == i {
                out.push(a as u32);
            }
        }
        out.retain(|&a| self.arc_alive[a as usize]);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Sets an arc's capacity; excess flow is cancelled, new residual capacity on a
    /// negative reduced-cost arc is saturated, and imbalances are repaired at `solve()`.
    pub fn set_arc_capacity(&mut self, a: ArcId, cap: i64) -> Result<(), FlowError> {
        let i = self.live_arc_index(a)?;
        if cap < 0 {
            return Err(FlowError::NegativeCapacity(cap));
        }
        let old = self.cap[i];
        if old >= INFINITE_CAPACITY {
            self.infinite_arcs -= 1;
        }
        if cap >= INFINITE_CAPACITY {
            self.infinite_arcs += 1;
            self.warm = false;
        }
        self.cap[i] = cap;
        if self.warm && i < self.res.fwd.len() {
            let f = self.flow_of(i);
            if f > cap {
                self.push_arc(i, cap - f);
            }
            let f = self.flow_of(i);
            let s = self.res.fwd[i] as usize;
            self.res.rcap[s] = cap - f;
            let r = self.res.rev[s] as usize;
            self.res.tot[s] = cap;
            self.res.tot[r] = cap;
            if cap > f && self.reduced_cost(i) < 0 {
                self.push_arc(i, cap - f);
            }
        }
        self.status = Status::NotSolved;
        Ok(())
    }

    /// Sets an arc's cost per unit; arcs whose reduced cost changes sign are saturated or
    /// emptied, and imbalances are repaired at `solve()`.
    pub fn set_arc_cost(&mut self, a: ArcId, cost: i64) -> Result<(), FlowError> {
        let i = self.live_arc_index(a)?;
        if self.warm && i < self.res.fwd.len() {
            let f = self.flow_of(i);
            self.total_cost += f as i128 * (cost as i128 - self.cost[i] as i128);
            self.cost[i] = cost;
            let s = self.res.fwd[i] as usize;
            let r = self.res.rev[s] as usize;
            self.res.cost[s] = cost;
            self.res.cost[r] = -cost;
            let rc = self.reduced_cost(i);
            if rc < 0 && self.cap[i] > f {
                self.push_arc(i, self.cap[i] - f);
            } else if rc > 0 && f > 0 {
                self.push_arc(i, -f);
            }
        } else {
            self.cost[i] = cost;
        }
        self.status = Status::NotSolved;
        Ok(())
    }

    /// Sets a node's supply (positive) or demand (negative).
    pub fn set_supply(&mut self, n: NodeId, supply: i64) -> Result<(), FlowError> {
        let i = self.node_index(n)?;
        let delta = supply
            .checked_sub(self.supply[i])
            .ok_or(FlowError::Overflow)?;
        self.supply[i] = supply;
        self.supply_sum += delta as i128;
        if self.warm && delta != 0 {
            self.excess[i] += delta;
            self.dirty.push(i as u32);
        }
        if delta != 0 {
            self.status = Status::NotSolved;
        }
        Ok(())
    }

    /// Reduced cost of arc index `i` (in the CSR) under the current potentials.
    fn reduced_cost(&self, i: usize) -> i64 {
        let (u, v) = (self.tail[i] as usize, self.head[i] as usize);
        self.cost[i] - self.pi[u] + self.pi[v]
    }

    /// Pushes `d` units (negative: cancels) along arc index `i`, updating excesses, the
    /// running cost and the dirty list.
    fn push_arc(&mut self, i: usize, d: i64) {
        let s = self.res.fwd[i] as usize;
        let r = self.res.rev[s] as usize;
        self.res.rcap[s] -= d;
        self.res.rcap[r] += d;
        let (u, v) = (self.tail[i] as usize, self.head[i] as usize);
        self.excess[u] -= d;
        self.excess[v] += d;
        self.total_cost += d as i128 * self.cost[i] as i128;
        self.dirty.push(u as u32);
        self.dirty.push(v as u32);
    }
}

/// Bellman-Ford style queue relaxation budget guard: relaxations per node before we call it a
/// negative cycle.
fn too_many(count: u32, n: usize) -> bool {
    count as usize > n + 1
}

/// Exact integer potentials from rounded scaled prices `q` (reduced costs
/// `>= -1` on the residual CSR graph): a queue-based Bellman-Ford pass fixes
/// the rest. `None` when a negative residual cycle exists (a node relaxed more
/// than `n + 1` times) or, with `push_budget`, when more pushes than that
/// would be needed (the cost-scaling early exit gives up cheaply then).
fn exact_from_prices(
    first: &[u32],
    head: &[u32],
    rcap: &[i64],
    cost: &[i64],
    q: Vec<i64>,
    push_budget: Option<usize>,
) -> Option<Vec<i64>> {
    let n = first.len() - 1;
    let mut d = vec![0i64; n];
    let mut inq = vec![false; n];
    let mut cnt = vec![0u32; n];
    let mut pushes = 0usize;
    let mut queue = std::collections::VecDeque::new();
    for u in 0..n {
        let (b, e) = (first[u] as usize, first[u + 1] as usize);
        if (b..e).any(|a| rcap[a] > 0 && cost[a] - q[u] + q[head[a] as usize] < 0) {
            queue.push_back(u as u32);
            inq[u] = true;
        }
    }
    while let Some(u) = queue.pop_front() {
        let u = u as usize;
        inq[u] = false;
        for a in first[u] as usize..first[u + 1] as usize {
            if rcap[a] > 0 {
                let v = head[a] as usize;
                let nd = d[u] + cost[a] - q[u] + q[v];
                if nd < d[v] {
                    d[v] = nd;
                    if !inq[v] {
                        cnt[v] += 1;
                        pushes += 1;
                        if too_many(cnt[v], n) || push_budget.is_some_and(|b| pushes > b) {
                            return None;
                        }
                        inq[v] = true;
                        queue.push_back(v as u32);
                    }
                }
            }
        }
    }
    Some(q.iter().zip(&d).map(|(q, d)| q - d).collect())
}

impl MinCostFlow {
    // ----------------------------------------------------------------- solving

    /// Restores an optimal flow: an incremental repair when a previous optimal solution
    /// exists (warm), otherwise a cold cost-scaling solve.
    pub fn solve(&mut self) -> Result<Status, FlowError> {
        if self.warm && self.infinite_arcs == 0 && self.status != Status::Optimal {
            if self.res.fwd.len() < self.tail.len() {
                let from = self.res.fwd.len();
                self.rebuild(true, INFINITE_CAPACITY)?;
                for i in from..self.tail.len() {
                    if self.arc_alive[i] && self.reduced_cost(i) < 0 {
                        let c = self.cap[i];
                        if c > 0 {
                            self.push_arc(i, c);
                        }
                    }
                }
            }
            let st = self.repair()?;
            self.status = st;
            self.stats.warm = true;
            if st != Status::Optimal {
                self.warm = false;
            }
            return Ok(st);
        }
        if self.status == Status::Optimal {
            return Ok(Status::Optimal);
        }
        let st = self.cold()?;
        self.status = st;
        Ok(st)
    }

    /// Forces a from-scratch solve (ignores any previous solution).
    pub fn solve_cold(&mut self) -> Result<Status, FlowError> {
        let st = self.cold()?;
        self.status = st;
        Ok(st)
    }

    /// Builds the CSR residual arrays from the model. With `keep_flow`, arcs already in the
    /// old arrays keep their flow; all others start at 0. Capacities are clamped to `clamp`.
    fn rebuild(&mut self, keep_flow: bool, clamp: i64) -> Result<(), FlowError> {
        let n = self.node_count();
        let m = self.arc_count();
        let flows: Vec<i64> = if keep_flow {
            self.arc_flows()
        } else {
            Vec::new()
        };
        let mut first = vec![0u32; n + 1];
        for a in 0..m {
            if self.arc_alive[a] {
                first[self.tail[a] as usize + 1] += 1;
                first[self.head[a] as usize + 1] += 1;
            }
        }
        for i in 0..n {
            first[i + 1] += first[i];
        }
        let slots = first[n] as usize;
        let mut pos: Vec<u32> = first[..n].to_vec();
        let r = &mut self.res;
        r.head.clear();
        r.head.resize(slots, 0);
        r.rev.clear();
        r.rev.resize(slots, 0);
        r.rcap.clear();
        r.rcap.resize(slots, 0);
        r.tot.clear();
        r.tot.resize(slots, 0);
        r.cost.clear();
        r.cost.resize(slots, 0);
        r.slot_arc.clear();
        r.slot_arc.resize(slots, NONE);
        r.fwd.clear();
        r.fwd.resize(m, NONE);
        #[allow(clippy::needless_range_loop)]
        for a in 0..m {
            if !self.arc_alive[a] {
                continue;
            }
            let (u, v) = (self.tail[a] as usize, self.head[a] as usize);
            let s = pos[u] as usize;
            pos[u] += 1;
            let t = pos[v] as usize;
            pos[v] += 1;
            let f = if keep_flow { flows[a] } else { 0 };
            let c = self.cap[a].min(clamp);
            r.head[s] = v as u32;
            r.head[t] = u as u32;
            r.rev[s] = t as u32;
            r.rev[t] = s as u32;
            r.rcap[s] = c - f;
            r.rcap[t] = f;
            r.tot[s] = c;
            r.tot[t] = c;
            r.cost[s] = self.cost[a];
            r.cost[t] = -self.cost[a];
            r.slot_arc[s] = a as u32;
            r.slot_arc[t] = a as u32;
            r.fwd[a] = s as u32;
        }
        r.first = first;
        Ok(())
    }

    fn cold(&mut self) -> Result<Status, FlowError> {
        self.warm = false;
        self.dirty.clear();
        self.stats = SolveStats::default();
        self.total_cost = 0;
        let n = self.node_count();
        let m = self.arc_count();
        if self.supply_sum != 0 {
            return Ok(Status::Infeasible);
        }
        let mut maxc: i128 = 0;
        for a in 0..m {
            if self.arc_alive[a] {
                maxc = maxc.max((self.cost[a] as i128).abs());
            }
        }
        if maxc * (n as i128 + 1) >= SCALED_COST_LIMIT {
            return Err(FlowError::CostRange);
        }
        // Zero flow with zero prices is eps-optimal for any eps >= the largest negative cost,
        // so the first eps need not be the largest cost: a few huge costs (the routing bypass
        // arc) would only add phases. Start from the 99th percentile of |cost| instead.
        let start_eps_cost = {
            let mut sample: Vec<i64> = Vec::with_capacity(m.min(1 << 16));
            let step = (m / (1 << 16)).max(1);
            let mut maxneg = 0i64;
            for a in 0..m {
                if self.arc_alive[a] {
                    if self.cost[a] < 0 {
                        maxneg = maxneg.max(-self.cost[a]);
                    }
                    if a % step == 0 {
                        sample.push(self.cost[a].abs());
                    }
                }
            }
            let q = if sample.is_empty() {
                1
            } else {
                let k = (sample.len() * 99 / 100).min(sample.len() - 1);
                *sample.select_nth_unstable(k).1
            };
            q.max(maxneg).max(1)
        };
        let mut clamp = INFINITE_CAPACITY;
        if self.infinite_arcs > 0 {
            if self.has_negative_infinite_cycle() {
                return Ok(Status::Unbounded);
            }
            // Some optimal flow puts at most (total supply + all finite capacity) on any arc.
            let mut b: i128 = 1;
            for (i, &s) in self.supply.iter().enumerate() {
                if self.node_alive[i] && s > 0 {
                    b += s as i128;
                }
            }
            for a in 0..m {
                if self.arc_alive[a] && self.cap[a] < INFINITE_CAPACITY {
                    b += self.cap[a] as i128;
                }
            }
            clamp = i64::try_from(b).map_err(|_| FlowError::Overflow)?;
            clamp = clamp.max(INFINITE_CAPACITY);
        }
        self.rebuild(false, clamp)?;
        self.excess.clear();
        self.excess.extend(
            self.supply
                .iter()
                .zip(&self.node_alive)
                .map(|(&s, &a)| if a { s } else { 0 }),
        );
        let scale = n as i64 + 1;
        let mut cs = CostScaling::new(
            &self.res.first,
            &self.res.head,
            &self.res.rev,
            &self.res.cost,
            &self.res.tot,
            &mut self.res.rcap,
            &mut self.excess,
            scale,
        );
        let ok = cs.run(start_eps_cost * scale);
        let (phases, relabels) = (cs.phases, cs.relabels);
        let price = std::mem::take(&mut cs.price);
        let exact = cs.exact.take();
        drop(cs);
        self.stats = SolveStats {
            warm: false,
            iterations: phases,
            work: relabels,
        };
        if !ok {
            self.pi = vec![0; n];
            return Ok(Status::Infeasible);
        }
        self.pi = match exact {
            Some(pi) => pi,
            None => self.exact_potentials(&price, scale)?,
        };
        let mut total: i128 = 0;
        for a in 0..m {
            if self.arc_alive[a] {
                total += self.flow_of(a) as i128 * self.cost[a] as i128;
            }
        }
        self.total_cost = total;
        self.warm = self.infinite_arcs == 0;
        Ok(Status::Optimal)
    }

    /// Negative cycle among arcs of unbounded capacity (Bellman-Ford on that subgraph only).
    fn has_negative_infinite_cycle(&self) -> bool {
        let n = self.node_count();
        let arcs: Vec<usize> = (0..self.arc_count())
            .filter(|&a| self.arc_alive[a] && self.cap[a] >= INFINITE_CAPACITY)
            .collect();
        let mut d = vec![0i64; n];
        for _ in 0..=n {
            let mut changed = false;
            for &a in &arcs {
                let (u, v) = (self.tail[a] as usize, self.head[a] as usize);
                let nd = d[u].saturating_add(self.cost[a]);
                if nd < d[v] {
                    d[v] = nd;
                    changed = true;
                }
            }
            if !changed {
                return false;
            }
        }
        true
    }

    /// Exact integer potentials from the final cost-scaling prices: `floor(price / scale)`
    /// leaves reduced costs `>= -1`; a queue-based Bellman-Ford pass fixes the rest (the
    /// residual graph of an optimal flow has no negative cycle, so it terminates).
    fn exact_potentials(&self, price: &[i64], scale: i64) -> Result<Vec<i64>, FlowError> {
        let r = &self.res;
        let q: Vec<i64> = price.iter().map(|p| p.div_euclid(scale)).collect();
        exact_from_prices(&r.first, &r.head, &r.rcap, &r.cost, q, None)
            .ok_or_else(|| FlowError::Internal("negative residual cycle after cost scaling".into()))
    }

    /// Repairs the recorded imbalances by successive shortest paths on reduced costs.
    ///
    /// Each augmenting path comes from a bidirectional Dijkstra: forward from all excess
    /// nodes, backward from all deficit nodes, always advancing the side that has settled
    /// fewer nodes, until `top_f + top_b >= mu` (`mu`: the best excess-to-deficit walk seen).
    /// With `Lf = min(top_f, mu)` and `Lb = mu - Lf`, the potentials are updated by
    /// `pi += Lf - df` on forward-settled nodes with `df < Lf` and `pi -= Lb - db` on
    /// backward-settled nodes with `db < Lb` (the two sets are disjoint since
    /// `df + db >= mu`). Every residual arc keeps a non-negative reduced cost (case check
    /// over the three node classes) and every arc of the shortest walk becomes tight, so
    /// pushing along it keeps the flow optimal. Searches stay within about half the
    /// distance from each side, which matters because many nodes lie at small reduced
    /// distance from the imbalance on our layered instances.
    fn repair(&mut self) -> Result<Status, FlowError> {
        self.stats = SolveStats {
            warm: true,
            ..Default::default()
        };
        if self.supply_sum != 0 {
            return Ok(Status::Infeasible);
        }
        let n = self.node_count();
        let sc = &mut self.scratch;
        sc.fwd.resize(n);
        sc.bwd.resize(n);
        if sc.pos.len() < n {
            sc.pos.resize(n, 0);
            sc.pos_stamp.resize(n, 0);
        }
        self.dirty.sort_unstable();
        self.dirty.dedup();
        loop {
            let sc = &mut self.scratch;
            sc.epoch = sc.epoch.wrapping_add(2);
            if sc.epoch < 2 {
                sc.fwd.stamp.iter_mut().for_each(|s| *s = 0);
                sc.bwd.stamp.iter_mut().for_each(|s| *s = 0);
                sc.pos_stamp.iter_mut().for_each(|s| *s = 0);
                sc.epoch = 2;
            }
            let lab = sc.epoch;
            let done = lab + 1;
            sc.fwd.queue.reset();
            sc.bwd.queue.reset();
            sc.fwd.settled.clear();
            sc.bwd.settled.clear();
            let (mut any_src, mut any_dst) = (false, false);
            for &v in &self.dirty {
                let vi = v as usize;
                let e = self.excess[vi];
                let side = if e > 0 {
                    any_src = true;
                    &mut sc.fwd
                } else if e < 0 {
                    any_dst = true;
                    &mut sc.bwd
                } else {
                    continue;
                };
                side.dist[vi] = 0;
                side.parent[vi] = NONE;
                side.stamp[vi] = lab;
                side.queue.push(0, v);
            }
            if !any_src && !any_dst {
                break;
            }
            if !any_src || !any_dst {
                return Ok(Status::Infeasible);
            }
            self.stats.iterations += 1;
            let r = &self.res;
            let pi = &self.pi;
            // Best walk: forward-labelled `meet_u`, arc `meet_a`, backward-labelled head.
            let mut mu = INF;
            let mut meet_a = NONE;
            let (mut top_f, mut top_b);
            loop {
                top_f = sc.fwd.top(lab);
                top_b = sc.bwd.top(lab);
                if top_f.saturating_add(top_b) >= mu || (top_f == INF && top_b == INF) {
                    break;
                }
                let forward =
                    top_b == INF || (top_f != INF && sc.fwd.settled.len() <= sc.bwd.settled.len());
                if forward {
                    let f = &mut sc.fwd;
                    let (d, u) = f.queue.peek().expect("non-empty forward queue");
                    f.queue.pop_peeked();
                    let u = u as usize;
                    f.stamp[u] = done;
                    f.settled.push(u as u32);
                    let pu = pi[u];
                    for a in r.first[u] as usize..r.first[u + 1] as usize {
                        if r.rcap[a] > 0 {
                            let v = r.head[a] as usize;
                            let nd = d + r.cost[a] - pu + pi[v];
                            let sb = sc.bwd.stamp[v];
                            if (sb == lab || sb == done) && nd + sc.bwd.dist[v] < mu {
                                mu = nd + sc.bwd.dist[v];
                                meet_a = a as u32;
                            }
                            let st = f.stamp[v];
                            if st == done {
                                continue;
                            }
                            if st != lab || nd < f.dist[v] {
                                f.stamp[v] = lab;
                                f.dist[v] = nd;
                                f.parent[v] = a as u32;
                                f.queue.push(nd, v as u32);
                            }
                        }
                    }
                } else {
                    let b = &mut sc.bwd;
                    let (d, v) = b.queue.peek().expect("non-empty backward queue");
                    b.queue.pop_peeked();
                    let v = v as usize;
                    b.stamp[v] = done;
                    b.settled.push(v as u32);
                    let pv = pi[v];
                    // Incoming residual arcs u -> v are the reverse slots of v's slots.
                    for a in r.first[v] as usize..r.first[v + 1] as usize {
                        if r.tot[a] - r.rcap[a] > 0 {
                            let u = r.head[a] as usize;
                            let nd = d - r.cost[a] - pi[u] + pv;
                            let sf = sc.fwd.stamp[u];
                            if (sf == lab || sf == done) && nd + sc.fwd.dist[u] < mu {
                                mu = nd + sc.fwd.dist[u];
                                meet_a = r.rev[a];
                            }
                            let st = b.stamp[u];
                            if st == done {
                                continue;
                            }
                            if st != lab || nd < b.dist[u] {
                                b.stamp[u] = lab;
                                b.dist[u] = nd;
                                b.parent[u] = r.rev[a];
                                b.queue.push(nd, u as u32);
                            }
                        }
                    }
                }
            }
            self.stats.work += (sc.fwd.settled.len() + sc.bwd.settled.len()) as u64;
            if meet_a == NONE {
                return Ok(Status::Infeasible);
            }
            let lf = top_f.min(mu);
            let lb = mu - lf;
            for &v in &sc.fwd.settled {
                let v = v as usize;
                let d = sc.fwd.dist[v];
                if d < lf {
                    self.pi[v] += lf - d;
                }
            }
            for &v in &sc.bwd.settled {
                let v = v as usize;
                let d = sc.bwd.dist[v];
                if d < lb {
                    self.pi[v] -= lb - d;
                }
            }
            // The walk: forward parents back to an excess node, the meeting arc, backward
            // parents on to a deficit node. Zero-cost cycles (possible on shortest walks)
            // are cut out so that every slot is used once.
            let r = &self.res;
            sc.path.clear();
            let mut v = r.head[r.rev[meet_a as usize] as usize] as usize;
            while sc.fwd.parent[v] != NONE {
                let a = sc.fwd.parent[v];
                sc.path.push(a);
                v = r.head[r.rev[a as usize] as usize] as usize;
            }
            let src = v;
            sc.path.reverse();
            sc.path.push(meet_a);
            let mut v = r.head[meet_a as usize] as usize;
            while sc.bwd.parent[v] != NONE {
                let a = sc.bwd.parent[v];
                sc.path.push(a);
                v = r.head[a as usize] as usize;
            }
            let dst = v;
            // Remove cycles: path_nodes[i] is the tail of path[i].
            sc.path_nodes.clear();
            let mut kept = 0usize;
            let mut tail = src;
            sc.pos_stamp[src] = lab;
            sc.pos[src] = 0;
            for i in 0..sc.path.len() {
                let a = sc.path[i];
                let h = r.head[a as usize] as usize;
                sc.path[kept] = a;
                sc.path_nodes.push(tail as u32);
                kept += 1;
                if sc.pos_stamp[h] == lab {
                    // h was visited before: drop the cycle back to it.
                    let p = sc.pos[h] as usize;
                    for &x in &sc.path_nodes[p + 1..kept] {
                        sc.pos_stamp[x as usize] = 0;
                    }
                    kept = p;
                    sc.path_nodes.truncate(p);
                } else {
                    sc.pos_stamp[h] = lab;
                    sc.pos[h] = kept as u32;
                }
                tail = h;
            }
            sc.path.truncate(kept);
            for &x in &sc.path_nodes {
                sc.pos_stamp[x as usize] = 0;
            }
            sc.pos_stamp[dst] = 0;
            let mut amount = self.excess[src].min(-self.excess[dst]);
            for &a in &sc.path {
                amount = amount.min(self.res.rcap[a as usize]);
            }
            if amount <= 0 {
                return Err(FlowError::Internal("repair walk without capacity".into()));
            }
            for &a in &sc.path {
                let a = a as usize;
                let ra = self.res.rev[a] as usize;
                self.res.rcap[a] -= amount;
                self.res.rcap[ra] += amount;
                self.total_cost += amount as i128 * self.res.cost[a] as i128;
            }
            self.excess[src] -= amount;
            self.excess[dst] += amount;
        }
        self.dirty.clear();
        Ok(Status::Optimal)
    }

    /// Checks the optimality certificate of the current solution: capacity bounds, flow
    /// conservation, and non-negative reduced cost on every residual arc. Returns the first
    /// violation found. O(n + m); meant for tests and debugging.
    pub fn check_optimality(&self) -> Result<(), String> {
        if self.status != Status::Optimal {
            return Err(format!("status is {:?}", self.status));
        }
        let n = self.node_count();
        let mut bal: Vec<i128> = (0..n)
            .map(|i| {
                if self.node_alive[i] {
                    self.supply[i] as i128
                } else {
                    0
                }
            })
            .collect();
        let mut total: i128 = 0;
        for a in 0..self.arc_count() {
            if !self.arc_alive[a] {
                continue;
            }
            let f = self.flow_of(a);
            let (u, v) = (self.tail[a] as usize, self.head[a] as usize);
            if f < 0 || f > self.cap[a] {
                return Err(format!("arc {a}: flow {f} outside [0, {}]", self.cap[a]));
            }
            bal[u] -= f as i128;
            bal[v] += f as i128;
            total += f as i128 * self.cost[a] as i128;
            let rc = self.cost[a] as i128 - self.pi[u] as i128 + self.pi[v] as i128;
            if f < self.cap[a] && rc < 0 {
                return Err(format!(
                    "arc {a}: residual forward arc with reduced cost {rc}"
                ));
            }
            if f > 0 && rc > 0 {
                return Err(format!(
                    "arc {a}: residual backward arc with reduced cost {}",
                    -rc
                ));
            }
        }
        if let Some(i) = bal.iter().position(|&b| b != 0) {
            return Err(format!("node {i}: imbalance {}", bal[i]));
        }
        if total != self.total_cost {
            return Err(format!("cost {} != recomputed {total}", self.total_cost));
        }
        Ok(())
    }
}

/// Cost-scaling push-relabel on borrowed CSR arrays.
struct CostScaling<'a> {
    first: &'a [u32],
    head: &'a [u32],
    rev: &'a [u32],
    cost: &'a [i64],
    tot: &'a [i64],
    rcap: &'a mut [i64],
    excess: &'a mut [i64],
    price: Vec<i64>,
    current: Vec<u32>,
    scale: i64,
    eps: i64,
    stack: Vec<u32>,
    relabels: u64,
    phases: u64,
    since_update: usize,
    dist: Vec<u64>,
    scanned: Vec<bool>,
    touched: Vec<u32>,
    scanned_list: Vec<u32>,
    buckets: Vec<Vec<u32>>,
    /// Exact potentials when `try_exact` proved optimality before the last phase.
    exact: Option<Vec<i64>>,
}

impl<'a> CostScaling<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        first: &'a [u32],
        head: &'a [u32],
        rev: &'a [u32],
        cost: &'a [i64],
        tot: &'a [i64],
        rcap: &'a mut [i64],
        excess: &'a mut [i64],
        scale: i64,
    ) -> Self {
        let n = first.len() - 1;
        CostScaling {
            first,
            head,
            rev,
            cost,
            tot,
            rcap,
            excess,
            price: vec![0; n],
            current: first[..n].to_vec(),
            scale,
            eps: 1,
            stack: Vec::new(),
            relabels: 0,
            phases: 0,
            since_update: 0,
            dist: vec![u64::MAX; n],
            scanned: vec![false; n],
            touched: Vec::new(),
            scanned_list: Vec::new(),
            buckets: Vec::new(),
            exact: None,
        }
    }

    fn n(&self) -> usize {
        self.first.len() - 1
    }

    /// Runs all phases; false when the supplies cannot be routed.
    fn run(&mut self, max_scaled_cost: i64) -> bool {
        let mut eps = max_scaled_cost.max(1);
        loop {
            eps = (eps / ALPHA).max(1);
            self.eps = eps;
            self.phases += 1;
            if !self.refine() {
                return false;
            }
            if eps == 1 {
                return true;
            }
            // Early exit: once eps is below one original cost unit, rounded prices leave
            // reduced costs >= -1, and a budgeted Bellman-Ford pass either proves the flow
            // optimal (returning exact potentials) or gives up; costs are integers, so the
            // remaining phases are often unnecessary.
            if eps < self.scale {
                if let Some(pi) = self.try_exact(2 * self.n() + 64) {
                    self.exact = Some(pi);
                    return true;
                }
            }
        }
    }

    /// Exact integer potentials for the current flow if it is optimal, found by a queue
    /// Bellman-Ford from `floor(price / scale)` within `budget` re-queues; `None` if the
    /// budget runs out (a negative cycle may remain).
    fn try_exact(&self, budget: usize) -> Option<Vec<i64>> {
        let q: Vec<i64> = self
            .price
            .iter()
            .map(|p| p.div_euclid(self.scale))
            .collect();
        exact_from_prices(self.first, self.head, self.rcap, self.cost, q, Some(budget))
    }

    #[inline(always)]
    fn rc(&self, a: usize, pu: i64) -> i64 {
        self.cost[a] * self.scale - pu + self.price[self.head[a] as usize]
    }

    fn refine(&mut self) -> bool {
        let n = self.n();
        for u in 0..n {
            let pu = self.price[u];
            for a in self.first[u] as usize..self.first[u + 1] as usize {
                let c = self.rcap[a];
                if c > 0 && self.rc(a, pu) < 0 {
                    self.rcap[a] = 0;
                    self.rcap[self.rev[a] as usize] += c;
                    self.excess[u] -= c;
                    self.excess[self.head[a] as usize] += c;
                }
            }
        }
        self.stack.clear();
        for u in 0..n {
            if self.excess[u] > 0 {
                self.stack.push(u as u32);
            }
        }
        if self.stack.is_empty() {
            return true;
        }
        while let Some(u) = self.stack.pop() {
            let u = u as usize;
            if self.excess[u] <= 0 {
                continue;
            }
            if !self.discharge(u) {
                return false;
            }
            if self.since_update > n * UPDATE_EVERY_N_RELABELS && !self.global_update() {
                return false;
            }
        }
        true
    }

    fn discharge(&mut self, u: usize) -> bool {
        loop {
            let pu = self.price[u];
            let end = self.first[u + 1] as usize;
            let mut a = self.current[u] as usize;
            while a < end {
                if self.rcap[a] > 0 && self.rc(a, pu) < 0 {
                    let v = self.head[a] as usize;
                    if self.excess[v] >= 0 && !self.has_admissible(v) {
                        self.relabel(v);
                        if self.rc(a, pu) >= 0 {
                            a += 1;
                            continue;
                        }
                    }
                    let d = self.excess[u].min(self.rcap[a]);
                    self.rcap[a] -= d;
                    self.rcap[self.rev[a] as usize] += d;
                    self.excess[u] -= d;
                    let ev = self.excess[v];
                    self.excess[v] = ev + d;
                    if ev <= 0 && ev + d > 0 {
                        self.stack.push(v as u32);
                    }
                    if self.excess[u] == 0 {
                        self.current[u] = a as u32;
                        return true;
                    }
                }
                a += 1;
            }
            if !self.relabel(u) {
                return false;
            }
        }
    }

    #[inline]
    fn has_admissible(&mut self, v: usize) -> bool {
        let pv = self.price[v];
        let end = self.first[v + 1] as usize;
        let mut a = self.current[v] as usize;
        while a < end {
            if self.rcap[a] > 0 && self.rc(a, pv) < 0 {
                self.current[v] = a as u32;
                return true;
            }
            a += 1;
        }
        false
    }

    /// Raises `price[u]` so its cheapest residual arc gets reduced cost `-eps`.
    fn relabel(&mut self, u: usize) -> bool {
        let mut best = i64::MAX;
        for a in self.first[u] as usize..self.first[u + 1] as usize {
            if self.rcap[a] > 0 {
                let val = self.cost[a] * self.scale + self.price[self.head[a] as usize];
                best = best.min(val);
            }
        }
        if best == i64::MAX {
            return false;
        }
        self.price[u] = best + self.eps;
        self.current[u] = self.first[u];
        self.relabels += 1;
        self.since_update += 1;
        true
    }

    /// Global price update: bucket Dijkstra backwards from the deficit nodes with arc lengths
    /// `floor(rc / eps) + 1` (0 for admissible arcs), stopping once every active node is
    /// reached; lowers the prices of the scanned nodes accordingly. Returns false when an
    /// active node cannot reach any deficit (the problem is infeasible).
    fn global_update(&mut self) -> bool {
        self.since_update = 0;
        let n = self.n();
        let mut remaining = (0..n).filter(|&v| self.excess[v] > 0).count();
        if remaining == 0 {
            return true;
        }
        for &v in &self.touched {
            self.dist[v as usize] = u64::MAX;
            self.scanned[v as usize] = false;
        }
        self.touched.clear();
        self.scanned_list.clear();
        let maxb = ((4 * n + 16) as u64).min((i64::MAX as u64 / 4) / self.eps as u64) as usize;
        if self.buckets.len() < maxb.min(4 * n + 16) + 1 {
            self.buckets.resize(maxb.min(4 * n + 16) + 1, Vec::new());
        }
        let mut top = 0usize;
        for v in 0..n {
            if self.excess[v] < 0 {
                self.dist[v] = 0;
                self.touched.push(v as u32);
                self.buckets[0].push(v as u32);
            }
        }
        let mut truncated = false;
        let mut stop: Option<u64> = None;
        let mut d = 0usize;
        'outer: while d <= top {
            while let Some(v) = self.buckets[d].pop() {
                let v = v as usize;
                if self.scanned[v] || self.dist[v] != d as u64 {
                    continue;
                }
                self.scanned[v] = true;
                self.scanned_list.push(v as u32);
                if self.excess[v] > 0 {
                    remaining -= 1;
                    if remaining == 0 {
                        stop = Some(d as u64);
                        break 'outer;
                    }
                }
                let pv = self.price[v];
                for a in self.first[v] as usize..self.first[v + 1] as usize {
                    // Residual capacity of the reverse slot u -> v, read from this slot's
                    // pair total (sequential) instead of rcap[rev[a]] (a cache miss).
                    if self.tot[a] - self.rcap[a] > 0 {
                        let u = self.head[a] as usize;
                        if self.scanned[u] {
                            continue;
                        }
                        let rcu = -self.cost[a] * self.scale - self.price[u] + pv;
                        let len = if rcu < 0 {
                            0
                        } else {
                            (rcu / self.eps) as u64 + 1
                        };
                        let nd = d as u64 + len;
                        if nd < self.dist[u] {
                            if nd > maxb as u64 {
                                truncated = true;
                                continue;
                            }
                            if self.dist[u] == u64::MAX {
                                self.touched.push(u as u32);
                            }
                            self.dist[u] = nd;
                            self.buckets[nd as usize].push(u as u32);
                            top = top.max(nd as usize);
                        }
                    }
                }
            }
            d += 1;
        }
        let last = top.min(self.buckets.len() - 1);
        for b in self.buckets[..=last].iter_mut() {
            b.clear();
        }
        let k = match stop {
            Some(k) => k,
            None if truncated => {
                if !self.all_active_reach_deficit() {
                    return false;
                }
                maxb as u64
            }
            None => return false,
        };
        let eps = self.eps;
        for &v in &self.scanned_list {
            let v = v as usize;
            self.price[v] -= eps * (k - self.dist[v]) as i64;
        }
        self.current.copy_from_slice(&self.first[..n]);
        true
    }

    /// Plain reachability (ignoring costs): can every active node reach a deficit node in
    /// the residual graph? Used only when the bucket search was truncated.
    fn all_active_reach_deficit(&self) -> bool {
        let n = self.n();
        let mut seen = vec![false; n];
        let mut queue: Vec<u32> = (0..n as u32)
            .filter(|&v| self.excess[v as usize] < 0)
            .collect();
        for &v in &queue {
            seen[v as usize] = true;
        }
        while let Some(v) = queue.pop() {
            let v = v as usize;
            for a in self.first[v] as usize..self.first[v + 1] as usize {
                let u = self.head[a] as usize;
                if !seen[u] && self.tot[a] - self.rcap[a] > 0 {
                    seen[u] = true;
                    queue.push(u as u32);
                }
            }
        }
        (0..n).all(|v| self.excess[v] <= 0 || seen[v])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn diamond() -> (MinCostFlow, [ArcId; 5]) {
        let mut g = MinCostFlow::new();
        let n: Vec<NodeId> = [4, 0, 0, -4]
            .iter()
            .map(|&s| g.add_node(s).unwrap())
            .collect();
        let a = [
            g.add_arc(n[0], n[1], 4, 2).unwrap(),
            g.add_arc(n[0], n[2], 2, 2).unwrap(),
            g.add_arc(n[1], n[2], 2, 1).unwrap(),
            g.add_arc(n[1], n[3], 3, 3).unwrap(),
            g.add_arc(n[2], n[3], 5, 1).unwrap(),
        ];
        (g, a)
    }

    #[test]
    fn solves_small_problem_with_certificate() {
        let (mut g, a) = diamond();
        assert_eq!(g.solve().unwrap(), Status::Optimal);
        assert_eq!(g.cost(), 14);
        assert_eq!(g.flow_value(), 4);
        g.check_optimality().unwrap();
        let total: i64 = a.iter().map(|&x| g.arc_flow(x).unwrap()).sum();
        assert!(total >= 4);
        assert!(!g.stats().warm);
    }

    #[test]
    fn parallel_arcs_and_repair() {
        let (mut g, a) = diamond();
        g.solve().unwrap();
        // a cheaper parallel arc 1 -> 3
        let p = g.add_arc(NodeId(1), NodeId(3), 3, 0).unwrap();
        assert_eq!(g.solve().unwrap(), Status::Optimal);
        assert!(g.stats().warm);
        g.check_optimality().unwrap();
        assert_eq!(g.arc_flow(p).unwrap(), 3);
        // raise a cost so flow must move, then remove an arc
        g.set_arc_cost(p, 10).unwrap();
        g.solve().unwrap();
        g.check_optimality().unwrap();
        assert_eq!(g.cost(), 14);
        g.remove_arc(a[4]).unwrap();
        g.solve().unwrap();
        g.check_optimality().unwrap();
        assert_eq!(g.cost(), 4 * 2 + 3 * 3 + 10);
    }

    #[test]
    fn supply_change_and_infeasible_then_recover() {
        let (mut g, _) = diamond();
        g.solve().unwrap();
        g.set_supply(NodeId(0), 9).unwrap();
        g.set_supply(NodeId(3), -9).unwrap();
        assert_eq!(g.solve().unwrap(), Status::Infeasible);
        g.set_supply(NodeId(0), 6).unwrap();
        g.set_supply(NodeId(3), -6).unwrap();
        assert_eq!(g.solve().unwrap(), Status::Optimal);
        g.check_optimality().unwrap();
        g.set_supply(NodeId(0), 5).unwrap();
        assert_eq!(
            g.solve().unwrap(),
            Status::Infeasible,
            "unbalanced supplies"
        );
    }

    #[test]
    fn cost_range_is_checked() {
        let mut g = MinCostFlow::new();
        let a = g.add_node(1).unwrap();
        let b = g.add_node(-1).unwrap();
        g.add_arc(a, b, 1, i64::MAX / 2).unwrap();
        assert_eq!(g.solve(), Err(FlowError::CostRange));
    }
}
