//! `gwtf_flow`: the routing solver for C callers. One handle is either a
//! general min-cost flow graph or a GWTF routing model; both are repaired
//! incrementally after changes, not re-solved.

use std::ffi::c_char;
use std::time::Instant;

use super::boundary::{
    guard, guard_handle, require_out, write_out, FfiError, FfiHandle, FfiResult, HandleHeader,
};
use super::error::gwtf_error;
use super::status::gwtf_status;
use crate::flow::routing::{LinkParams, NodeIdx, Route, RoutingModel};
use crate::flow::{dimacs, ArcId, FlowError, MinCostFlow, NodeId, Status};
use parking_lot::Mutex;

/// Outcome of `gwtf_flow_solve` (`GWTF_FLOW_STATE_*`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum gwtf_flow_state {
    /// Not solved yet, or changed since the last solve.
    NotSolved = 0,
    /// Optimal: most flow first (routing), then least cost.
    Optimal = 1,
    /// The supplies cannot be routed (general graphs only; routing is always feasible).
    Infeasible = 2,
    /// A negative-cost cycle of unbounded capacity (general graphs only).
    Unbounded = 3,
}

impl From<Status> for gwtf_flow_state {
    fn from(s: Status) -> Self {
        match s {
            Status::NotSolved => Self::NotSolved,
            Status::Optimal => Self::Optimal,
            Status::Infeasible => Self::Infeasible,
            Status::Unbounded => Self::Unbounded,
        }
    }
}

/// Current version of `gwtf_flow_metrics`.
pub const GWTF_FLOW_METRICS_VERSION: u32 = 1;

/// Results of the last solve. Set `version` with `gwtf_flow_metrics_init`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct gwtf_flow_metrics {
    pub version: u32,
    /// A `GWTF_FLOW_STATE_*` value.
    pub state: i32,
    /// Graph: total flow out of supply nodes. Routing: microbatches routed.
    pub flow_value: i64,
    /// Graph: total cost. Routing: sum of route costs (microseconds).
    pub total_cost: i64,
    /// Routing: microbatches that could not be routed this iteration.
    pub unrouted: i64,
    /// Routing: largest route cost (microseconds).
    pub critical_path_us: i64,
    /// Routing: 2 * critical path + the largest stage aggregation time (microseconds).
    pub t_iter_us: i64,
    /// Routing: T_iter / flow (microseconds; +inf when nothing is routed).
    pub t_iter_per_flow_us: f64,
    /// Routing: distinct routes (read them with `gwtf_flow_route`).
    pub route_count: u64,
    /// Wall time of the last solve or repair, milliseconds.
    pub solve_ms: f64,
}

enum Model {
    Graph {
        mcf: Box<MinCostFlow>,
        /// DIMACS lower bounds (file order) and their constant cost.
        lower: Vec<i64>,
        cost_offset: i128,
    },
    Routing {
        model: Box<RoutingModel>,
        /// Routes of the last solve, decomposed once.
        routes: Vec<Route>,
    },
}

struct Inner {
    model: Model,
    solve_ms: f64,
}

/// A min-cost flow graph or a GWTF routing model (opaque).
pub struct gwtf_flow {
    header: HandleHeader,
    inner: Mutex<Inner>,
}

impl FfiHandle for gwtf_flow {
    const MAGIC: u64 = 0x6777_7466_666c_6f77; // "gwtfflow"
    const NAME: &'static str = "gwtf_flow";
    fn header(&self) -> &HandleHeader {
        &self.header
    }
}

fn flow_err(e: FlowError) -> FfiError {
    let status = match e {
        FlowError::UnknownNode(_)
        | FlowError::NodeRemoved(_)
        | FlowError::UnknownArc(_)
        | FlowError::ArcRemoved(_) => gwtf_status::NotFound,
        FlowError::TooLarge | FlowError::CostRange | FlowError::Overflow => {
            gwtf_status::LimitExceeded
        }
        FlowError::Parse { .. } => gwtf_status::Protocol,
        FlowError::Io(_) => gwtf_status::Io,
        FlowError::Internal(_) => gwtf_status::Internal,
        _ => gwtf_status::InvalidArgument,
    };
    FfiError::new(status, e.to_string())
}

fn new_handle(model: Model) -> *mut gwtf_flow {
    gwtf_flow {
        header: HandleHeader::new(gwtf_flow::MAGIC),
        inner: Mutex::new(Inner {
            model,
            solve_ms: 0.0,
        }),
    }
    .into_raw()
}

/// The graph, for a change. A DIMACS graph with lower bounds is read-only:
/// its bounds were transformed into supplies, which a change would invalidate.
fn graph(i: &mut Inner) -> FfiResult<&mut MinCostFlow> {
    match &mut i.model {
        Model::Graph { mcf, lower, .. } => {
            if lower.iter().any(|&l| l != 0) {
                return Err(FfiError::invalid(
                    "this graph came from DIMACS with lower bounds and cannot be changed",
                ));
            }
            Ok(mcf.as_mut())
        }
        Model::Routing { .. } => Err(FfiError::invalid(
            "this gwtf_flow is a routing model; graph calls need gwtf_flow_new_graph",
        )),
    }
}

/// Runs one change of a routing model. The routes of the last solve are
/// dropped only when the change succeeded: a call that fails leaves the
/// object exactly as it was (the model's own methods check their arguments
/// before they change anything).
fn change_routing<T>(
    i: &mut Inner,
    change: impl FnOnce(&mut RoutingModel) -> Result<T, FlowError>,
) -> FfiResult<T> {
    match &mut i.model {
        Model::Routing { model, routes } => {
            let out = change(model.as_mut()).map_err(flow_err)?;
            routes.clear();
            Ok(out)
        }
        Model::Graph { .. } => Err(FfiError::invalid(
            "this gwtf_flow is a general graph; routing calls need gwtf_flow_new_routing",
        )),
    }
}

/// Runs `body` on a flow handle's state (serialised).
fn with_flow(
    out_err: *mut *mut gwtf_error,
    flow: *const gwtf_flow,
    body: impl FnOnce(&mut Inner) -> FfiResult<()>,
) -> gwtf_status {
    guard_handle(out_err, flow, |h| body(&mut h.inner.lock()))
}

/// Writes an id output after the call succeeded.
fn id_out(out: *mut u32, id: u32) {
    if !out.is_null() {
        // SAFETY: checked non-NULL; the caller provides a writable u32.
        unsafe { write_out(out, id) };
    }
}

/// Creates an empty general min-cost flow graph.
///
/// Ownership: the caller owns `*out_flow` and frees it with `gwtf_flow_free`.
///
/// Thread safety: any thread; calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_flow_new_graph(
    out_flow: *mut *mut gwtf_flow,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_flow, "out_flow")?;
        let h = new_handle(Model::Graph {
            mcf: Box::new(MinCostFlow::new()),
            lower: Vec::new(),
            cost_offset: 0,
        });
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_flow, h) };
        Ok(())
    })
}

/// Parses a DIMACS min-cost flow problem (`p min`, `n`, `a` lines) from
/// `len` bytes of `text` into a new general graph. DIMACS node `k` becomes
/// node `k - 1`; arc ids follow the file's order.
///
/// Ownership: `text` is read during the call; the caller owns `*out_flow`.
///
/// Thread safety: any thread.
///
/// Errors: `GWTF_STATUS_PROTOCOL` (malformed input; the message has the line
/// number and reason), `GWTF_STATUS_LIMIT_EXCEEDED`, `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_flow_new_from_dimacs(
    text: *const c_char,
    len: usize,
    out_flow: *mut *mut gwtf_flow,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_flow, "out_flow")?;
        if text.is_null() && len > 0 {
            return Err(FfiError::null("text"));
        }
        let bytes: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: non-NULL, len bytes per the contract.
            unsafe { std::slice::from_raw_parts(text.cast::<u8>(), len) }
        };
        let p = dimacs::read(bytes, Some(len as u64)).map_err(flow_err)?;
        let h = new_handle(Model::Graph {
            mcf: Box::new(p.mcf),
            lower: p.lower,
            cost_offset: p.cost_offset,
        });
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_flow, h) };
        Ok(())
    })
}

/// Adds a node with `supply` (positive: source, negative: sink). `*out_node`
/// (may be NULL) receives its id; ids are never reused.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT` (a routing model),
/// `GWTF_STATUS_LIMIT_EXCEEDED`, `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_add_node(
    flow: *mut gwtf_flow,
    supply: i64,
    out_node: *mut u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        let n = graph(i)?.add_node(supply).map_err(flow_err)?;
        id_out(out_node, n.0);
        Ok(())
    })
}

/// Adds an arc `from -> to` with `capacity` (>= 0) and `cost` (may be
/// negative). Parallel arcs are allowed. `*out_arc` (may be NULL) gets its id.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_NOT_FOUND` (unknown or removed node),
/// `GWTF_STATUS_INVALID_ARGUMENT`, `GWTF_STATUS_LIMIT_EXCEEDED`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_add_arc(
    flow: *mut gwtf_flow,
    from: u32,
    to: u32,
    capacity: i64,
    cost: i64,
    out_arc: *mut u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        let a = graph(i)?
            .add_arc(NodeId(from), NodeId(to), capacity, cost)
            .map_err(flow_err)?;
        id_out(out_arc, a.0);
        Ok(())
    })
}

/// Removes a node and its arcs; the next solve repairs the flow it carried.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_NOT_FOUND`, `GWTF_STATUS_INVALID_ARGUMENT`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_remove_node(
    flow: *mut gwtf_flow,
    node: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        graph(i)?.remove_node(NodeId(node)).map_err(flow_err)
    })
}

/// Removes an arc; the next solve repairs the flow it carried.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_NOT_FOUND`, `GWTF_STATUS_INVALID_ARGUMENT`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_remove_arc(
    flow: *mut gwtf_flow,
    arc: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        graph(i)?.remove_arc(ArcId(arc)).map_err(flow_err)
    })
}

/// Changes an arc's capacity (>= 0).
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_NOT_FOUND`, `GWTF_STATUS_INVALID_ARGUMENT`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_set_arc_capacity(
    flow: *mut gwtf_flow,
    arc: u32,
    capacity: i64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        graph(i)?
            .set_arc_capacity(ArcId(arc), capacity)
            .map_err(flow_err)
    })
}

/// Changes an arc's cost.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_NOT_FOUND`, `GWTF_STATUS_INVALID_ARGUMENT`,
/// `GWTF_STATUS_LIMIT_EXCEEDED`, `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_set_arc_cost(
    flow: *mut gwtf_flow,
    arc: u32,
    cost: i64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        graph(i)?.set_arc_cost(ArcId(arc), cost).map_err(flow_err)
    })
}

/// Changes a node's supply.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_NOT_FOUND`, `GWTF_STATUS_INVALID_ARGUMENT`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_set_supply(
    flow: *mut gwtf_flow,
    node: u32,
    supply: i64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        graph(i)?.set_supply(NodeId(node), supply).map_err(flow_err)
    })
}

/// Creates an empty GWTF routing model with `stages` pipeline stages and
/// activations of `activation_bytes` per microbatch (docs/SPEC.md sections 2-3).
///
/// Ownership: the caller owns `*out_flow` and frees it with `gwtf_flow_free`.
///
/// Thread safety: any thread; calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT` (0 stages), `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_flow_new_routing(
    stages: u32,
    activation_bytes: u64,
    out_flow: *mut *mut gwtf_flow,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_flow, "out_flow")?;
        let model = RoutingModel::new(stages, activation_bytes).map_err(flow_err)?;
        let h = new_handle(Model::Routing {
            model: Box::new(model),
            routes: Vec::new(),
        });
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_flow, h) };
        Ok(())
    })
}

/// Adds a data holder that feeds `capacity` microbatches per iteration and
/// computes one (embedding + head + loss) in `compute_us` microseconds.
/// `*out_member` (may be NULL) receives its member id.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT` (negative capacity, non-finite
/// time, not a routing model), `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_add_data_holder(
    flow: *mut gwtf_flow,
    capacity: i64,
    compute_us: f64,
    out_member: *mut u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        let m = change_routing(i, |m| m.add_data_holder(capacity, compute_us))?;
        id_out(out_member, m.0);
        Ok(())
    })
}

/// Adds a relay serving `stage` (1-based) that holds `capacity` microbatches
/// and computes one in `compute_us` microseconds.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT` (stage out of range, negative
/// capacity, non-finite time, not a routing model), `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_add_relay(
    flow: *mut gwtf_flow,
    stage: u32,
    capacity: i64,
    compute_us: f64,
    out_member: *mut u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        let m = change_routing(i, |m| m.add_relay(stage, capacity, compute_us))?;
        id_out(out_member, m.0);
        Ok(())
    })
}

/// Sets (or updates) the measured link between members `a` and `b`: one-way
/// latency (microseconds) and bandwidth (bytes per second) in each direction.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT` (unknown member, non-positive
/// bandwidth, negative latency), `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn gwtf_flow_set_link(
    flow: *mut gwtf_flow,
    a: u32,
    b: u32,
    latency_ab_us: f64,
    latency_ba_us: f64,
    bandwidth_ab: f64,
    bandwidth_ba: f64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        let p = LinkParams {
            latency_ab_us,
            latency_ba_us,
            bandwidth_ab,
            bandwidth_ba,
        };
        let all = [latency_ab_us, latency_ba_us, bandwidth_ab, bandwidth_ba];
        if all.iter().any(|v| !v.is_finite() || *v < 0.0)
            || bandwidth_ab <= 0.0
            || bandwidth_ba <= 0.0
        {
            return Err(FfiError::invalid(
                "latencies must be finite and >= 0, bandwidths finite and > 0",
            ));
        }
        change_routing(i, |m| m.set_link(NodeIdx(a), NodeIdx(b), p))
    })
}

/// Removes a member (it crashed or left); the next solve repairs the routes
/// it was on instead of solving from scratch.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT` (unknown or removed member),
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_remove_member(
    flow: *mut gwtf_flow,
    member: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        change_routing(i, |m| m.remove_node(NodeIdx(member)))
    })
}

/// Changes a member's capacity (microbatches it can hold).
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT`, `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_set_member_capacity(
    flow: *mut gwtf_flow,
    member: u32,
    capacity: i64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        change_routing(i, |m| m.set_capacity(NodeIdx(member), capacity))
    })
}

/// Changes a member's measured compute time per microbatch (microseconds).
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT`, `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_set_member_compute(
    flow: *mut gwtf_flow,
    member: u32,
    compute_us: f64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        change_routing(i, |m| m.set_compute(NodeIdx(member), compute_us))
    })
}

/// Solves, or after changes repairs, the flow. `*out_state` (may be NULL)
/// receives a `GWTF_FLOW_STATE_*` value; infeasible and unbounded are answers,
/// not errors.
///
/// Ownership: `flow` is borrowed.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_LIMIT_EXCEEDED` (costs too large for exact scaling),
/// `GWTF_STATUS_INTERNAL`, `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_solve(
    flow: *mut gwtf_flow,
    out_state: *mut i32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        let t = Instant::now();
        let status = match &mut i.model {
            Model::Graph { mcf, .. } => mcf.solve().map_err(flow_err)?,
            Model::Routing { model, routes } => {
                let s = model.solve().map_err(flow_err)?;
                *routes = model.routes();
                s
            }
        };
        i.solve_ms = t.elapsed().as_secs_f64() * 1e3;
        if !out_state.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_state, gwtf_flow_state::from(status) as i32) };
        }
        Ok(())
    })
}

/// Fills `metrics` to its `version` with `GWTF_FLOW_METRICS_VERSION` and zeros.
///
/// Ownership: caller memory, only written.
///
/// Thread safety: any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_flow_metrics_init(metrics: *mut gwtf_flow_metrics) -> gwtf_status {
    guard(std::ptr::null_mut(), || {
        require_out(metrics, "metrics")?;
        // SAFETY: checked non-NULL.
        unsafe {
            write_out(
                metrics,
                gwtf_flow_metrics {
                    version: GWTF_FLOW_METRICS_VERSION,
                    ..Default::default()
                },
            )
        };
        Ok(())
    })
}

/// Reads the results of the last solve (see `gwtf_flow_metrics`).
///
/// Ownership: `metrics` is caller memory (initialised by `gwtf_flow_metrics_init`).
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_UNSUPPORTED_VERSION`, `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_get_metrics(
    flow: *const gwtf_flow,
    metrics: *mut gwtf_flow_metrics,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        require_out(metrics, "metrics")?;
        // SAFETY: checked non-NULL.
        let version = unsafe { (*metrics).version };
        if version == 0 || version > GWTF_FLOW_METRICS_VERSION {
            return Err(FfiError::new(
                gwtf_status::UnsupportedVersion,
                format!("gwtf_flow_metrics.version {version} (call gwtf_flow_metrics_init)"),
            ));
        }
        let mut m = gwtf_flow_metrics {
            version,
            solve_ms: i.solve_ms,
            ..Default::default()
        };
        match &i.model {
            Model::Graph {
                mcf, cost_offset, ..
            } => {
                m.state = gwtf_flow_state::from(mcf.status()) as i32;
                m.flow_value = mcf.flow_value();
                m.total_cost = i64::try_from(mcf.cost_i128() + cost_offset).unwrap_or(i64::MAX);
            }
            Model::Routing { model, routes } => {
                m.state = gwtf_flow_state::from(model.solver().status()) as i32;
                m.flow_value = model.flow_value();
                m.total_cost = model.total_cost();
                m.unrouted = model.unrouted();
                m.critical_path_us = routes.iter().map(|r| r.cost_us).max().unwrap_or(0);
                m.t_iter_us = model.t_iter_us();
                m.t_iter_per_flow_us = model.t_iter_per_flow_us();
                m.route_count = routes.len() as u64;
            }
        }
        // SAFETY: checked non-NULL.
        unsafe { write_out(metrics, m) };
        Ok(())
    })
}

/// Copies the flow of every arc (by arc id; removed arcs read 0; DIMACS lower
/// bounds added back) into `buf`. `*out_len` (may be NULL) receives the
/// count, also on `GWTF_STATUS_BUFFER_TOO_SMALL`.
///
/// Ownership: `buf` is caller memory.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_BUFFER_TOO_SMALL`, `GWTF_STATUS_INVALID_ARGUMENT`
/// (a routing model), `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_arc_flows(
    flow: *const gwtf_flow,
    buf: *mut i64,
    buf_len: usize,
    out_len: *mut usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        let (flows, lower) = match &i.model {
            Model::Graph { mcf, lower, .. } => (mcf.arc_flows(), lower),
            Model::Routing { .. } => {
                return Err(FfiError::invalid(
                    "arc flows are for general graphs; read routes with gwtf_flow_route",
                ))
            }
        };
        let flows: Vec<i64> = flows
            .iter()
            .enumerate()
            .map(|(k, f)| f + lower.get(k).copied().unwrap_or(0))
            .collect();
        if !out_len.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_len, flows.len()) };
        }
        copy_i64_out(&flows, buf, buf_len)
    })
}

fn copy_i64_out<T: Copy>(src: &[T], dst: *mut T, dst_len: usize) -> FfiResult<()> {
    if dst_len < src.len() {
        return Err(FfiError::new(
            gwtf_status::BufferTooSmall,
            format!("buffer holds {dst_len} elements, {} needed", src.len()),
        ));
    }
    if !src.is_empty() {
        if dst.is_null() {
            return Err(FfiError::null("buf"));
        }
        // SAFETY: non-NULL with room for src.len() elements.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    }
    Ok(())
}

/// Route `index` (0-based, cheapest first) of the last routing solve: its
/// members (a data holder, one relay per stage, a data holder) into
/// `members`, how many microbatches take it into `*out_count` and its cost
/// (microseconds) into `*out_cost_us`. `*out_len` (may be NULL) receives the
/// member count, also on `GWTF_STATUS_BUFFER_TOO_SMALL`.
///
/// Ownership: caller buffers.
///
/// Thread safety: calls on one `gwtf_flow` are serialised.
///
/// Errors: `GWTF_STATUS_NOT_FOUND` (index past `route_count`),
/// `GWTF_STATUS_BUFFER_TOO_SMALL`, `GWTF_STATUS_INVALID_ARGUMENT` (a general
/// graph), `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_flow_route(
    flow: *const gwtf_flow,
    index: usize,
    members: *mut u32,
    members_len: usize,
    out_len: *mut usize,
    out_count: *mut i64,
    out_cost_us: *mut i64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_flow(out_err, flow, |i| {
        let routes = match &i.model {
            Model::Routing { routes, .. } => routes,
            Model::Graph { .. } => {
                return Err(FfiError::invalid(
                    "routes exist for routing models; use gwtf_flow_arc_flows",
                ))
            }
        };
        let r = routes.get(index).ok_or_else(|| {
            FfiError::new(
                gwtf_status::NotFound,
                format!("route {index} of {}", routes.len()),
            )
        })?;
        let ids: Vec<u32> = r.nodes.iter().map(|n| n.0).collect();
        if !out_len.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_len, ids.len()) };
        }
        copy_i64_out(&ids, members, members_len)?;
        if !out_count.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_count, r.count) };
        }
        if !out_cost_us.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_cost_us, r.cost_us) };
        }
        Ok(())
    })
}

/// Frees a flow. `gwtf_flow_free(NULL)` does nothing.
///
/// Ownership: takes ownership of `flow`.
///
/// Thread safety: no other thread may use `flow` during or after this call.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_flow_free(flow: *mut gwtf_flow) {
    // SAFETY: NULL or a pointer from a gwtf_flow_new_* function, once.
    unsafe { super::boundary::free_handle(flow) }
}

#[cfg(test)]
#[path = "flow_tests.rs"]
mod tests;
