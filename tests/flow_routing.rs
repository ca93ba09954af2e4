//! Routing model: a hand-checked scenario, crash repair, bypass feasibility, geo10.
use gwtf::flow::geo::{self, GeoConfig};
use gwtf::flow::{LinkParams, NodeIdx, RoutingModel, Status};
use gwtf::sim::scenario::Scenario;

/// H (holder, cap 2) -> {A (cap 1, 100 us), B (cap 1, 300 us)} -> C (cap 2, 100 us) -> H.
/// Latency 1000 us each way, zero-size activations, so d = (c_i + c_j)/2 + 1000.
fn tiny() -> (RoutingModel, [NodeIdx; 4]) {
    let mut m = RoutingModel::new(2, 0).unwrap();
    let h = m.add_data_holder_named("H", 2, 0.0).unwrap();
    let a = m.add_relay_named("A", 1, 1, 100.0).unwrap();
    let b = m.add_relay_named("B", 1, 1, 300.0).unwrap();
    let c = m.add_relay_named("C", 2, 2, 100.0).unwrap();
    let l = LinkParams::symmetric(1000.0, 1e9);
    for (x, y) in [(h, a), (h, b), (a, c), (b, c), (c, h)] {
        m.set_link(x, y, l).unwrap();
    }
    m.set_aggregation_us(2, 500).unwrap();
    (m, [h, a, b, c])
}

#[test]
fn tiny_scenario_known_routes() {
    let (mut m, [h, a, b, c]) = tiny();
    assert_eq!(m.solve().unwrap(), Status::Optimal);
    assert_eq!(m.flow_value(), 2);
    let r = m.routes();
    assert_eq!(r.len(), 2, "{r:?}");
    // H->A 1050, A->C 1100, C->H 1050 ; H->B 1150, B->C 1200, C->H 1050
    assert_eq!(r[0].nodes, vec![h, a, c, h]);
    assert_eq!((r[0].count, r[0].cost_us), (1, 3200));
    assert_eq!(r[1].nodes, vec![h, b, c, h]);
    assert_eq!((r[1].count, r[1].cost_us), (1, 3400));
    assert_eq!(m.total_cost(), 6600);
    assert_eq!(m.critical_path_us(), 3400);
    assert_eq!(m.t_iter_us(), 2 * 3400 + 500);
    assert!((m.t_iter_per_flow_us() - 3650.0).abs() < 1e-9);
}

#[test]
fn crash_repairs_routes() {
    let (mut m, [h, a, b, c]) = tiny();
    m.solve().unwrap();
    m.remove_node(a).unwrap();
    assert_eq!(m.solve().unwrap(), Status::Optimal);
    assert!(
        m.solver().stats().warm,
        "crash must be repaired incrementally"
    );
    assert_eq!(m.flow_value(), 1);
    assert_eq!(m.unrouted(), 1);
    let r = m.routes();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].nodes, vec![h, b, c, h]);
    assert_eq!(m.total_cost(), 3400);
    // a node joins and takes the lost capacity back
    let d = m.add_relay_named("D", 1, 1, 100.0).unwrap();
    let l = LinkParams::symmetric(1000.0, 1e9);
    m.set_link(h, d, l).unwrap();
    m.set_link(d, c, l).unwrap();
    m.solve().unwrap();
    assert_eq!(m.flow_value(), 2);
    assert_eq!(m.total_cost(), 6600);
    // errors, not panics
    assert!(m.remove_node(a).is_err());
    assert!(m.add_relay(7, 1, 1.0).is_err());
}

#[test]
fn bypass_makes_excess_demand_feasible() {
    let (mut m, _) = tiny();
    m.set_demand(Some(5)).unwrap();
    assert_eq!(m.solve().unwrap(), Status::Optimal);
    assert_eq!(m.flow_value(), 2);
    assert_eq!(m.unrouted(), 3);
    assert_eq!(m.total_cost(), 6600);
    // capacity change: B can hold 0 -> one route left
    let b = m.find("B").unwrap();
    m.set_capacity(b, 0).unwrap();
    m.solve().unwrap();
    assert_eq!(m.flow_value(), 1);
}

#[test]
fn geo10_crash_repair_matches_fresh_solve() {
    let cfg = GeoConfig {
        nodes_per_region: 4,
        stages: 6,
        cap_lo: 1,
        cap_hi: 4,
        seed: 1,
        ..Default::default()
    };
    let mut sc = geo::build_geo(geo::GEO10_CSV, geo::GEO10_COMPUTE_CSV, &cfg).unwrap();
    assert_eq!(sc.model.solve().unwrap(), Status::Optimal);
    assert!(sc.model.flow_value() > 0);
    for r in sc.model.routes() {
        assert_eq!(r.nodes.len(), 6 + 2);
    }
    // crash the busiest relays one after another, compare with a fresh build
    let mut crashed = Vec::new();
    for _ in 0..5 {
        let routes = sc.model.routes();
        let victim = routes[0].nodes[1];
        crashed.push(sc.model.name(victim).unwrap().to_string());
        sc.model.remove_node(victim).unwrap();
        sc.model.solve().unwrap();
        sc.model.solver().check_optimality().unwrap();
        let mut fresh = geo::build_geo(geo::GEO10_CSV, geo::GEO10_COMPUTE_CSV, &cfg).unwrap();
        for name in &crashed {
            let i = fresh.model.find(name).unwrap();
            fresh.model.remove_node(i).unwrap();
        }
        fresh.model.solve().unwrap();
        assert_eq!(sc.model.flow_value(), fresh.model.flow_value());
        assert_eq!(sc.model.total_cost(), fresh.model.total_cost());
    }
}

#[test]
fn scenario_files_place_members_over_their_regions() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scenarios/example.scenario"
    ))
    .unwrap();
    let cfg = GeoConfig {
        nodes_per_region: 8,
        ..Default::default()
    };
    let mut sc = Scenario::parse(&text).unwrap().routing(&cfg).unwrap();
    assert_eq!(sc.region.len(), 24);
    assert!(sc.model.find("Tokyo-7").is_some());
    assert_eq!(sc.model.solve().unwrap(), Status::Optimal);
    assert!(sc.model.flow_value() > 0);

    // geo10 through the scenario is geo10 from the CSVs with the scenario's
    // same-region link.
    let cfg = GeoConfig {
        same_region_latency_us: 2_000.0,
        same_region_gbps: 1.0,
        ..Default::default()
    };
    let mut a = Scenario::geo10().routing(&GeoConfig::default()).unwrap();
    let mut b = geo::build_geo(geo::GEO10_CSV, geo::GEO10_COMPUTE_CSV, &cfg).unwrap();
    a.model.solve().unwrap();
    b.model.solve().unwrap();
    assert_eq!(a.model.flow_value(), b.model.flow_value());
    assert_eq!(a.model.total_cost(), b.model.total_cost());
}
