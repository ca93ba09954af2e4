//! Scenario builders for the routing model: members placed over regions, from the `geo10`
//! region CSVs or from any region table (the scenario files of `gwtf::sim::scenario`, the
//! one format read by both `gwtf flow route` and `gwtf sim`, go through [`build_regions`]).
//!
//! geo10 choices (documented defaults of [`GeoConfig`]):
//! * `nodes_per_region` members per region, named `Region-j`; a seeded shuffle picks
//!   `holders` data holders (default one per region), the rest are dealt round-robin to the
//!   stages in shuffled order.
//! * capacities uniform in `cap_lo..=cap_hi` (seeded), the same range for holders.
//! * compute time = `relative_compute_time * compute_unit_us` (default 10 ms per unit, so
//!   4.4 -> 44 ms); data holders compute `holder_compute_us` (default 0).
//! * cross-region links: one-way latency and bandwidth from the CSV, bandwidth read as
//!   Gbit/s (GWTF decision in the CSV header); same-region links: 1 ms and 10 Gbit/s.
//! * links between every pair of members in consecutive pipeline positions (dense).
use super::rng::SplitMix64;
use super::routing::{LinkParams, NodeIdx, RoutingModel};
use super::FlowError;
use std::collections::HashMap;

/// The ten-region link table (region, region, one-way latency ms, bandwidth Gbit/s).
pub const GEO10_CSV: &str = include_str!("data/geo10.csv");
/// The ten-region relative compute times (region, time per microbatch relative to the reference).
pub const GEO10_COMPUTE_CSV: &str = include_str!("data/geo10-compute.csv");

/// Parameters of a geo scenario.
#[derive(Clone, Debug)]
pub struct GeoConfig {
    pub nodes_per_region: usize,
    pub stages: u32,
    pub cap_lo: i64,
    pub cap_hi: i64,
    pub seed: u64,
    /// Number of data holders (default: one per region).
    pub holders: Option<usize>,
    pub compute_unit_us: f64,
    pub holder_compute_us: f64,
    pub activation_bytes: u64,
    pub same_region_latency_us: f64,
    pub same_region_gbps: f64,
}

impl Default for GeoConfig {
    fn default() -> Self {
        GeoConfig {
            nodes_per_region: 4,
            stages: 6,
            cap_lo: 1,
            cap_hi: 4,
            seed: 1,
            holders: None,
            compute_unit_us: 10_000.0,
            holder_compute_us: 0.0,
            activation_bytes: 4 << 20,
            same_region_latency_us: 1_000.0,
            same_region_gbps: 10.0,
        }
    }
}

fn csv_rows(text: &str) -> impl Iterator<Item = (usize, Vec<&str>)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
        .map(|(i, l)| (i, l.split(',').map(str::trim).collect()))
}

fn perr(line: usize, msg: impl Into<String>) -> FlowError {
    FlowError::Parse {
        line,
        msg: msg.into(),
    }
}

/// Region link table: `(a, b) -> (latency_ms, bandwidth_gbps)`, symmetric.
pub type RegionLinks = HashMap<(String, String), (f64, f64)>;

/// Parses `region_a,region_b,latency_ms,bandwidth_gbps` (header line allowed, `#` comments).
pub fn parse_region_links(text: &str) -> Result<RegionLinks, FlowError> {
    let mut out = HashMap::new();
    for (line, f) in csv_rows(text) {
        if f.first() == Some(&"region_a") {
            continue;
        }
        if f.len() != 4 {
            return Err(perr(line, format!("expected 4 fields, got {}", f.len())));
        }
        let lat: f64 = f[2]
            .parse()
            .map_err(|_| perr(line, format!("bad latency '{}'", f[2])))?;
        let bw: f64 = f[3]
            .parse()
            .map_err(|_| perr(line, format!("bad bandwidth '{}'", f[3])))?;
        if !(lat.is_finite() && lat >= 0.0 && bw.is_finite() && bw > 0.0) {
            return Err(perr(line, "latency must be >= 0 and bandwidth > 0"));
        }
        out.insert((f[0].to_string(), f[1].to_string()), (lat, bw));
        out.insert((f[1].to_string(), f[0].to_string()), (lat, bw));
    }
    Ok(out)
}

/// Parses `region,relative_compute_time`; keeps file order.
pub fn parse_region_compute(text: &str) -> Result<Vec<(String, f64)>, FlowError> {
    let mut out = Vec::new();
    for (line, f) in csv_rows(text) {
        if f.first() == Some(&"region") {
            continue;
        }
        if f.len() != 2 {
            return Err(perr(line, format!("expected 2 fields, got {}", f.len())));
        }
        let c: f64 = f[1]
            .parse()
            .map_err(|_| perr(line, format!("bad compute time '{}'", f[1])))?;
        if !(c.is_finite() && c >= 0.0) {
            return Err(perr(line, "compute time must be >= 0"));
        }
        out.push((f[0].to_string(), c));
    }
    Ok(out)
}

/// A built geo scenario: the model and each member's region.
pub struct GeoScenario {
    pub model: RoutingModel,
    pub region: HashMap<NodeIdx, String>,
}

/// Builds a geo scenario from the CSV texts (see the module docs for the choices made).
pub fn build_geo(
    links_csv: &str,
    compute_csv: &str,
    cfg: &GeoConfig,
) -> Result<GeoScenario, FlowError> {
    let links = parse_region_links(links_csv)?;
    let regions = parse_region_compute(compute_csv)?;
    build_regions(&regions, &links, cfg)
}

/// Builds a geo scenario from regions (name, relative compute time, in order) and the
/// links between every two of them; members of one region share `cfg`'s same-region link.
pub fn build_regions(
    regions: &[(String, f64)],
    links: &RegionLinks,
    cfg: &GeoConfig,
) -> Result<GeoScenario, FlowError> {
    if regions.is_empty() {
        return Err(FlowError::Routing("no regions".into()));
    }
    if cfg.cap_lo < 0 || cfg.cap_hi < cfg.cap_lo {
        return Err(FlowError::Routing("need 0 <= cap_lo <= cap_hi".into()));
    }
    let total = regions.len() * cfg.nodes_per_region;
    let holders = cfg.holders.unwrap_or(regions.len());
    if total < holders + cfg.stages as usize {
        return Err(FlowError::Routing(format!(
            "{total} nodes cannot cover {holders} holders and {} stages",
            cfg.stages
        )));
    }
    let mut rng = SplitMix64::new(cfg.seed);
    let mut order: Vec<usize> = (0..total).collect();
    for i in (1..total).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    let mut model = RoutingModel::new(cfg.stages, cfg.activation_bytes)?;
    let mut region = HashMap::new();
    let mut placed: Vec<(NodeIdx, usize)> = Vec::new();
    for (rank, &node) in order.iter().enumerate() {
        let r = node / cfg.nodes_per_region;
        let name = format!("{}-{}", regions[r].0, node % cfg.nodes_per_region);
        let cap = rng.range_i64(cfg.cap_lo, cfg.cap_hi);
        let idx = if rank < holders {
            model.add_data_holder_named(&name, cap, cfg.holder_compute_us)?
        } else {
            let stage = ((rank - holders) % cfg.stages as usize) as u32 + 1;
            model.add_relay_named(&name, stage, cap, regions[r].1 * cfg.compute_unit_us)?
        };
        region.insert(idx, regions[r].0.clone());
        placed.push((idx, r));
    }
    let pos = |m: &RoutingModel, i: NodeIdx| -> Vec<u32> {
        match m.stage_of(i).ok().flatten() {
            None => vec![0, m.stages() + 1],
            Some(k) => vec![k],
        }
    };
    for x in 0..placed.len() {
        for y in x + 1..placed.len() {
            let (a, ra) = placed[x];
            let (b, rb) = placed[y];
            let (pa, pb) = (pos(&model, a), pos(&model, b));
            let consecutive = pa
                .iter()
                .any(|p| pb.iter().any(|q| p + 1 == *q || q + 1 == *p));
            if !consecutive {
                continue;
            }
            let (lat_ms, gbps) = if ra == rb {
                (cfg.same_region_latency_us / 1000.0, cfg.same_region_gbps)
            } else {
                *links
                    .get(&(regions[ra].0.clone(), regions[rb].0.clone()))
                    .ok_or_else(|| {
                        FlowError::Routing(format!(
                            "no link between regions {} and {}",
                            regions[ra].0, regions[rb].0
                        ))
                    })?
            };
            model.set_link(
                a,
                b,
                LinkParams::symmetric(lat_ms * 1000.0, gbps * 1e9 / 8.0),
            )?;
        }
    }
    Ok(GeoScenario { model, region })
}
