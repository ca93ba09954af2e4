//! A failed call leaves a `gwtf_flow` exactly as it was: for every function
//! that changes one, a call that fails after a solve must keep the solve's
//! metrics, routes and arc flows readable and unchanged.
use super::*;
use std::ptr::{null, null_mut};

const OK: gwtf_status = gwtf_status::Ok;

/// Everything a caller can read back from a handle.
#[derive(Debug, PartialEq)]
struct Observed {
    state: i32,
    flow_value: i64,
    total_cost: i64,
    unrouted: i64,
    critical_path_us: i64,
    route_count: u64,
    /// Routing: (members, count, cost) of each route. Graph: arc flows.
    detail: Vec<Vec<i64>>,
}

fn observe(f: *mut gwtf_flow) -> Observed {
    let mut m = gwtf_flow_metrics::default();
    assert_eq!(gwtf_flow_metrics_init(&mut m), OK);
    assert_eq!(gwtf_flow_get_metrics(f, &mut m, null_mut()), OK);
    let mut detail = Vec::new();
    for r in 0..m.route_count as usize {
        let (mut ids, mut len, mut count, mut cost) = ([0u32; 16], 0usize, 0i64, 0i64);
        let st = gwtf_flow_route(
            f,
            r,
            ids.as_mut_ptr(),
            ids.len(),
            &mut len,
            &mut count,
            &mut cost,
            null_mut(),
        );
        assert_eq!(st, OK, "route {r} of {}", m.route_count);
        let mut row: Vec<i64> = ids[..len].iter().map(|&x| x as i64).collect();
        row.extend([count, cost]);
        detail.push(row);
    }
    let mut flows = [0i64; 64];
    let mut n = 0usize;
    if gwtf_flow_arc_flows(f, flows.as_mut_ptr(), flows.len(), &mut n, null_mut()) == OK {
        detail.push(flows[..n].to_vec());
    }
    Observed {
        state: m.state,
        flow_value: m.flow_value,
        total_cost: m.total_cost,
        unrouted: m.unrouted,
        critical_path_us: m.critical_path_us,
        route_count: m.route_count,
        detail,
    }
}

fn solve(f: *mut gwtf_flow) {
    let mut state = 0;
    assert_eq!(gwtf_flow_solve(f, &mut state, null_mut()), OK);
    assert_eq!(state, gwtf_flow_state::Optimal as i32);
}

/// Runs each failing call on a freshly solved handle and checks that it
/// failed and changed nothing.
fn each_failure_changes_nothing(
    make: fn() -> *mut gwtf_flow,
    failing: &[(&str, &dyn Fn(*mut gwtf_flow) -> gwtf_status)],
) {
    for (what, call) in failing {
        let f = make();
        solve(f);
        let before = observe(f);
        assert!(before.flow_value > 0, "{what}: the fixture routes nothing");
        let st = call(f);
        assert_ne!(st, OK, "{what} should fail");
        assert_eq!(observe(f), before, "{what} changed the object");
        gwtf_flow_free(f);
    }
}

/// Two stages, one data holder, two relays per stage, all linked.
fn routing_fixture() -> *mut gwtf_flow {
    let mut f = null_mut();
    assert_eq!(gwtf_flow_new_routing(2, 1 << 20, &mut f, null_mut()), OK);
    let mut h = 0;
    assert_eq!(
        gwtf_flow_add_data_holder(f, 4, 100.0, &mut h, null_mut()),
        OK
    );
    let mut relays = Vec::new();
    for stage in [1, 1, 2, 2] {
        let mut r = 0;
        let st = gwtf_flow_add_relay(f, stage, 2, 1000.0 * stage as f64, &mut r, null_mut());
        assert_eq!(st, OK);
        relays.push(r);
    }
    let pairs = [
        (h, relays[0]),
        (h, relays[1]),
        (relays[0], relays[2]),
        (relays[0], relays[3]),
        (relays[1], relays[2]),
        (relays[1], relays[3]),
        (relays[2], h),
        (relays[3], h),
    ];
    for (k, (a, b)) in pairs.into_iter().enumerate() {
        let lat = 1000.0 * (k + 1) as f64;
        let st = gwtf_flow_set_link(f, a, b, lat, lat, 1e9, 1e9, null_mut());
        assert_eq!(st, OK);
    }
    f
}

#[test]
fn failed_routing_changes_leave_the_solution_as_it_was() {
    let failing: &[(&str, &dyn Fn(*mut gwtf_flow) -> gwtf_status)] = &[
        ("add_data_holder with a negative capacity", &|f| {
            gwtf_flow_add_data_holder(f, -1, 1.0, null_mut(), null_mut())
        }),
        ("add_data_holder with a NaN time", &|f| {
            gwtf_flow_add_data_holder(f, 1, f64::NAN, null_mut(), null_mut())
        }),
        ("add_relay to stage 0", &|f| {
            gwtf_flow_add_relay(f, 0, 1, 1.0, null_mut(), null_mut())
        }),
        ("add_relay to stage 3 of 2", &|f| {
            gwtf_flow_add_relay(f, 3, 1, 1.0, null_mut(), null_mut())
        }),
        ("set_link to an unknown member", &|f| {
            gwtf_flow_set_link(f, 0, 99, 1.0, 1.0, 1.0, 1.0, null_mut())
        }),
        ("set_link with a negative latency", &|f| {
            gwtf_flow_set_link(f, 0, 1, -1.0, 1.0, 1.0, 1.0, null_mut())
        }),
        ("remove_member of an unknown id", &|f| {
            gwtf_flow_remove_member(f, 99, null_mut())
        }),
        ("set_member_capacity of an unknown id", &|f| {
            gwtf_flow_set_member_capacity(f, 99, 1, null_mut())
        }),
        ("set_member_capacity negative", &|f| {
            gwtf_flow_set_member_capacity(f, 1, -5, null_mut())
        }),
        ("set_member_compute infinite", &|f| {
            gwtf_flow_set_member_compute(f, 1, f64::INFINITY, null_mut())
        }),
        ("set_member_compute of an unknown id", &|f| {
            gwtf_flow_set_member_compute(f, 99, 1.0, null_mut())
        }),
        ("a graph call on a routing model", &|f| {
            gwtf_flow_add_node(f, 0, null_mut(), null_mut())
        }),
    ];
    each_failure_changes_nothing(routing_fixture, failing);
    // A removed member's id is refused too, and the refusal changes nothing.
    let f = routing_fixture();
    assert_eq!(gwtf_flow_remove_member(f, 1, null_mut()), OK);
    solve(f);
    let before = observe(f);
    assert_ne!(gwtf_flow_remove_member(f, 1, null_mut()), OK);
    assert_ne!(gwtf_flow_set_member_capacity(f, 1, 3, null_mut()), OK);
    assert_eq!(observe(f), before);
    gwtf_flow_free(f);
}

/// s -> a -> t and s -> b -> t with two units to send.
fn graph_fixture() -> *mut gwtf_flow {
    let mut f = null_mut();
    assert_eq!(gwtf_flow_new_graph(&mut f, null_mut()), OK);
    let mut ids = [0u32; 4];
    for (k, supply) in [2, 0, 0, -2].into_iter().enumerate() {
        assert_eq!(gwtf_flow_add_node(f, supply, &mut ids[k], null_mut()), OK);
    }
    for (u, v, cost) in [(0, 1, 1), (0, 2, 5), (1, 3, 1), (2, 3, 1)] {
        let st = gwtf_flow_add_arc(f, ids[u], ids[v], 1, cost, null_mut(), null_mut());
        assert_eq!(st, OK);
    }
    f
}

#[test]
fn failed_graph_changes_leave_the_solution_as_it_was() {
    let failing: &[(&str, &dyn Fn(*mut gwtf_flow) -> gwtf_status)] = &[
        ("add_arc from an unknown node", &|f| {
            gwtf_flow_add_arc(f, 99, 0, 1, 1, null_mut(), null_mut())
        }),
        ("add_arc with a negative capacity", &|f| {
            gwtf_flow_add_arc(f, 0, 1, -1, 1, null_mut(), null_mut())
        }),
        ("remove_node of an unknown node", &|f| {
            gwtf_flow_remove_node(f, 99, null_mut())
        }),
        ("remove_arc of an unknown arc", &|f| {
            gwtf_flow_remove_arc(f, 99, null_mut())
        }),
        ("set_arc_capacity negative", &|f| {
            gwtf_flow_set_arc_capacity(f, 0, -1, null_mut())
        }),
        ("set_arc_capacity of an unknown arc", &|f| {
            gwtf_flow_set_arc_capacity(f, 99, 1, null_mut())
        }),
        ("set_arc_cost of an unknown arc", &|f| {
            gwtf_flow_set_arc_cost(f, 99, 1, null_mut())
        }),
        ("set_supply of an unknown node", &|f| {
            gwtf_flow_set_supply(f, 99, 1, null_mut())
        }),
        ("a routing call on a graph", &|f| {
            gwtf_flow_remove_member(f, 0, null_mut())
        }),
        ("NULL handle", &|_| {
            gwtf_flow_remove_arc(null::<gwtf_flow>() as *mut _, 0, null_mut())
        }),
    ];
    each_failure_changes_nothing(graph_fixture, failing);
}
