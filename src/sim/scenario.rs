//! Network and compute scenarios: `geo10` (ten AWS regions), `geo10-gib`
//! (the same figures read as GiB/s), `geo10-sparse` (fewer relays than
//! regions, uneven memory), `homogeneous`, and custom ones read from a small
//! text file. The one scenario description
//! of the project: the simulator runs on it, and [`Scenario::routing`] places
//! routing-model members on it (`gwtf flow route`), so both commands read the
//! same files (an example ships as `scenarios/example.scenario`).
//!
//! Custom scenario file format (one directive per line, `#` starts a comment):
//!
//! ```text
//! # intra-region link: one-way latency (ms) and bandwidth (Gbit/s)
//! intra 2 1.0
//! # region NAME RELATIVE_COMPUTE_TIME (higher = slower; 4.0 = 10 TFLOP/s)
//! region east 4.0
//! region west 4.4
//! # link A B LATENCY_MS BANDWIDTH_GBPS (symmetric; every pair of regions)
//! link east west 35 0.5
//! # optional: every node's NIC (Gbit/s; caps every link and the all-reduce)
//! nic 10
//! # optional: global batch = microbatches per aggregation (all holders together)
//! batch 80
//! # optional: the founding population and the GPU memory choices (GiB)
//! holders 10
//! relays 30
//! gpu-mem 4 8 16 21
//! ```
use crate::flow::geo::{self, GeoConfig, GeoScenario, RegionLinks};
use crate::flow::FlowError;
use std::collections::BTreeMap;

const GEO10: &str = include_str!("data/geo10.csv");
const GEO10_COMPUTE: &str = include_str!("data/geo10-compute.csv");

/// One-way latency (s) and bandwidth (bytes/s) between regions, and each
/// region's relative compute time.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    pub name: String,
    pub regions: Vec<String>,
    /// Relative time per microbatch of a node of the region (4.0 = the
    /// reference speed `base_tflops / 4`).
    pub compute_factor: Vec<f64>,
    /// latency[a][b] in seconds.
    pub latency: Vec<Vec<f64>>,
    /// bandwidth[a][b] in bytes per second.
    pub bandwidth: Vec<Vec<f64>>,
    /// Every node's NIC (bytes/s): no link of a node is faster.
    pub nic_bandwidth: f64,
    /// Global batch: microbatches per aggregation (all holders together).
    pub global_batch: Option<u32>,
    /// Founding data holders and relays (the command line may override them).
    pub holders: Option<u32>,
    pub relays: Option<u32>,
    /// GPU memory choices (GiB), one drawn per node.
    pub gpu_mem_gib: Option<Vec<u64>>,
}

/// **[decision]** A node's NIC when the scenario names none: 10 Gbit/s (a
/// common cloud instance); no built-in link is that fast, so it only bounds
/// scenarios that declare faster links.
pub const DEFAULT_NIC_GBIT_PER_S: f64 = 10.0;

/// Bytes per second in a GiB/s, over the bytes per second in a Gbit/s.
pub const GIB_PER_GBIT: f64 = 8.0 * 1.073_741_824;

fn gbps(x: f64) -> f64 {
    x * 1e9 / 8.0
}

impl Scenario {
    /// Ten regions from `geo10.csv` and `geo10-compute.csv` (bandwidth read
    /// as Gbit/s). **[decision]** Nodes in the same region: 2 ms, 1 Gbit/s.
    pub fn geo10() -> Scenario {
        let mut text = String::new();
        text.push_str("intra 2 1.0\n");
        for line in GEO10_COMPUTE
            .lines()
            .skip_while(|l| l.starts_with('#'))
            .skip(1)
        {
            let f: Vec<&str> = line.split(',').collect();
            if f.len() == 2 {
                text.push_str(&format!("region {} {}\n", f[0], f[1]));
            }
        }
        for line in GEO10.lines().skip_while(|l| l.starts_with('#')).skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            if f.len() == 4 {
                text.push_str(&format!("link {} {} {} {}\n", f[0], f[1], f[2], f[3]));
            }
        }
        let mut s = Scenario::parse(&text).expect("embedded geo10 data");
        s.name = "geo10".into();
        s
    }

    /// `geo10` with its bandwidth figures read as GiB/s instead of Gbit/s
    /// (how the source simulator of these figures read them): every link,
    /// the same-region one included, is 8 x 1.073741824 times faster; the NIC
    /// is at least the fastest link, so that it does not undo the reading.
    pub fn geo10_gib() -> Scenario {
        let mut s = Scenario::geo10();
        for row in &mut s.bandwidth {
            for b in row.iter_mut() {
                *b *= GIB_PER_GBIT;
            }
        }
        let fastest = s.bandwidth.iter().flatten().copied().fold(0.0, f64::max);
        s.nic_bandwidth = s.nic_bandwidth.max(fastest);
        s.name = "geo10-gib".into();
        s
    }

    /// `geo10` where routing matters: 30 relays over the 6 relay stages of
    /// llama-500m, so each stage has 5 relays for 10 regions and half the
    /// holders have no relay of stage 1 in their region, and uneven GPU
    /// memory (4, 8, 16 or 21 GiB: 2, 5, 12 or 16 microbatches of
    /// llama-500m at once).
    pub fn geo10_sparse() -> Scenario {
        let mut s = Scenario::geo10();
        s.relays = Some(30);
        s.gpu_mem_gib = Some(vec![4, 8, 16, 21]);
        s.name = "geo10-sparse".into();
        s
    }

    /// One region, identical nodes. **[decision]** 20 ms one-way, 1 Gbit/s,
    /// relative compute time 4.0.
    pub fn homogeneous() -> Scenario {
        let mut s = Scenario::parse("intra 20 1.0\nregion all 4.0\n").unwrap();
        s.name = "homogeneous".into();
        s
    }

    /// Parses the custom format (see the module documentation).
    pub fn parse(text: &str) -> Result<Scenario, String> {
        let mut intra: Option<(f64, f64)> = None;
        let mut regions: Vec<(String, f64)> = Vec::new();
        let mut links: BTreeMap<(usize, usize), (f64, f64)> = BTreeMap::new();
        let mut nic = gbps(DEFAULT_NIC_GBIT_PER_S);
        let mut global_batch = None;
        let mut holders = None;
        let mut relays = None;
        let mut gpu_mem_gib = None;
        let count = |s: &str, what: &str, line: usize| -> Result<u32, String> {
            match s.parse::<u32>() {
                Ok(v) if v >= 1 => Ok(v),
                _ => Err(format!(
                    "line {line}: {what} `{s}` is not a whole number >= 1"
                )),
            }
        };
        let num = |s: &str, what: &str, line: usize| -> Result<f64, String> {
            let v: f64 = s
                .parse()
                .map_err(|_| format!("line {line}: {what} `{s}` is not a number"))?;
            if !v.is_finite() || v < 0.0 {
                return Err(format!("line {line}: {what} must be finite and >= 0"));
            }
            Ok(v)
        };
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let l = raw.split('#').next().unwrap().trim();
            if l.is_empty() {
                continue;
            }
            let f: Vec<&str> = l.split_whitespace().collect();
            match f[0] {
                "intra" if f.len() == 3 => {
                    let bw = num(f[2], "bandwidth", line)?;
                    if bw <= 0.0 {
                        return Err(format!("line {line}: bandwidth must be > 0"));
                    }
                    intra = Some((num(f[1], "latency", line)? / 1e3, gbps(bw)));
                }
                "region" if f.len() == 3 => {
                    if regions.iter().any(|r| r.0 == f[1]) {
                        return Err(format!("line {line}: region {} defined twice", f[1]));
                    }
                    let c = num(f[2], "compute time", line)?;
                    if c <= 0.0 {
                        return Err(format!("line {line}: compute time must be > 0"));
                    }
                    regions.push((f[1].to_string(), c));
                }
                "link" if f.len() == 5 => {
                    let ix = |n: &str| {
                        regions.iter().position(|r| r.0 == n).ok_or_else(|| {
                            format!("line {line}: unknown region {n} (declare regions first)")
                        })
                    };
                    let (a, b) = (ix(f[1])?, ix(f[2])?);
                    if a == b {
                        return Err(format!("line {line}: a link joins two different regions"));
                    }
                    let bw = num(f[4], "bandwidth", line)?;
                    if bw <= 0.0 {
                        return Err(format!("line {line}: bandwidth must be > 0"));
                    }
                    let v = (num(f[3], "latency", line)? / 1e3, gbps(bw));
                    links.insert((a.min(b), a.max(b)), v);
                }
                "nic" if f.len() == 2 => {
                    let bw = num(f[1], "NIC bandwidth", line)?;
                    if bw <= 0.0 {
                        return Err(format!("line {line}: NIC bandwidth must be > 0"));
                    }
                    nic = gbps(bw);
                }
                "batch" if f.len() == 2 => global_batch = Some(count(f[1], "batch", line)?),
                "holders" if f.len() == 2 => holders = Some(count(f[1], "holders", line)?),
                "relays" if f.len() == 2 => relays = Some(count(f[1], "relays", line)?),
                "gpu-mem" if f.len() >= 2 => {
                    let mem = f[1..]
                        .iter()
                        .map(|x| count(x, "GPU memory (GiB)", line).map(u64::from))
                        .collect::<Result<Vec<u64>, String>>()?;
                    gpu_mem_gib = Some(mem);
                }
                _ => return Err(format!("line {line}: cannot read `{l}`")),
            }
        }
        let (ilat, ibw) = intra.ok_or("missing `intra LATENCY_MS BANDWIDTH_GBPS`")?;
        if regions.is_empty() {
            return Err("no region".into());
        }
        let n = regions.len();
        let mut latency = vec![vec![ilat; n]; n];
        let mut bandwidth = vec![vec![ibw; n]; n];
        for a in 0..n {
            for b in a + 1..n {
                let (l, w) = links
                    .get(&(a, b))
                    .copied()
                    .ok_or_else(|| format!("missing link {} {}", regions[a].0, regions[b].0))?;
                latency[a][b] = l;
                latency[b][a] = l;
                bandwidth[a][b] = w;
                bandwidth[b][a] = w;
            }
        }
        Ok(Scenario {
            name: "custom".into(),
            compute_factor: regions.iter().map(|r| r.1).collect(),
            regions: regions.into_iter().map(|r| r.0).collect(),
            latency,
            bandwidth,
            nic_bandwidth: nic,
            global_batch,
            holders,
            relays,
            gpu_mem_gib,
        })
    }

    /// Microbatches per holder per iteration that give the scenario's global
    /// batch with `holders` holders (rounded up), if it sets one.
    pub fn microbatches_per_holder(&self, holders: u32) -> Option<u32> {
        self.global_batch.map(|b| b.div_ceil(holders.max(1)))
    }

    /// A routing model of members placed over this scenario's regions:
    /// `cfg` says how many per region, their stages and capacities (see
    /// [`geo::build_regions`]); compute times, links and the same-region link
    /// come from the scenario (`cfg`'s same-region fields are overridden).
    pub fn routing(&self, cfg: &GeoConfig) -> Result<GeoScenario, FlowError> {
        let regions: Vec<(String, f64)> = self
            .regions
            .iter()
            .cloned()
            .zip(self.compute_factor.iter().copied())
            .collect();
        let ms = |s: f64| s * 1e3;
        let gbit = |bytes_per_s: f64| bytes_per_s * 8.0 / 1e9;
        let mut links = RegionLinks::new();
        for (a, na) in self.regions.iter().enumerate() {
            for (b, nb) in self.regions.iter().enumerate() {
                if a != b {
                    let l = (ms(self.latency[a][b]), gbit(self.bandwidth[a][b]));
                    links.insert((na.clone(), nb.clone()), l);
                }
            }
        }
        let cfg = GeoConfig {
            same_region_latency_us: self.latency[0][0] * 1e6,
            same_region_gbps: gbit(self.bandwidth[0][0]),
            ..cfg.clone()
        };
        geo::build_regions(&regions, &links, &cfg)
    }

    /// The built-in scenarios, by name.
    pub const BUILT_IN: [&'static str; 4] = ["geo10", "geo10-gib", "geo10-sparse", "homogeneous"];

    /// A built-in scenario ([`Scenario::BUILT_IN`]), or the path of a scenario file.
    pub fn by_name(name: &str) -> Result<Scenario, String> {
        match name {
            "geo10" => Ok(Scenario::geo10()),
            "geo10-gib" => Ok(Scenario::geo10_gib()),
            "geo10-sparse" => Ok(Scenario::geo10_sparse()),
            "homogeneous" => Ok(Scenario::homogeneous()),
            path => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!(
                        "scenario `{path}`: not a built-in scenario ({}) nor a readable file ({e})",
                        Scenario::BUILT_IN.join(", ")
                    )
                })?;
                let mut s = Scenario::parse(&text).map_err(|e| format!("{path}: {e}"))?;
                s.name = path.to_string();
                Ok(s)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geo10_reads_the_csvs() {
        let s = Scenario::geo10();
        assert_eq!(s.regions.len(), 10);
        let o = s.regions.iter().position(|r| r == "Oregon").unwrap();
        let v = s.regions.iter().position(|r| r == "Virginia").unwrap();
        assert!((s.latency[o][v] - 0.067).abs() < 1e-12);
        assert!((s.bandwidth[v][o] - 0.395e9 / 8.0).abs() < 1e-3);
        let l = s.regions.iter().position(|r| r == "London").unwrap();
        assert!((s.compute_factor[l] - 4.39).abs() < 1e-12);
        assert!((s.latency[o][o] - 0.002).abs() < 1e-12);
    }

    #[test]
    fn custom_format_and_errors() {
        let s =
            Scenario::parse("intra 1 2\nregion a 4\nregion b 5 # slow\nlink a b 30 0.5\n").unwrap();
        assert_eq!(s.regions, vec!["a", "b"]);
        assert!((s.latency[0][1] - 0.03).abs() < 1e-12);
        assert!(Scenario::parse("region a 4\n")
            .unwrap_err()
            .contains("intra"));
        assert!(Scenario::parse("intra 1 1\nregion a 4\nregion b 4\n")
            .unwrap_err()
            .contains("missing link"));
        assert!(Scenario::parse("intra 1 x\n")
            .unwrap_err()
            .contains("not a number"));
        assert!(Scenario::parse("intra 1 1\nregion a 0\n").is_err());
        assert!(Scenario::parse("intra 1 1\nlink a b 1 1\n")
            .unwrap_err()
            .contains("unknown region"));
        assert!(Scenario::parse("bogus\n").is_err());
        assert!(Scenario::parse("intra 1 1\nregion a 4\nnic 0\n").is_err());
        assert!(Scenario::parse("intra 1 1\nregion a 4\nbatch 0\n")
            .unwrap_err()
            .contains("whole number"));
        assert!(Scenario::parse("intra 1 1\nregion a 4\ngpu-mem 8 x\n").is_err());
    }

    #[test]
    fn scenario_parameters_are_read_and_defaulted() {
        let s = Scenario::parse(
            "intra 1 2\nregion a 4\nnic 25\nbatch 30\nholders 4\nrelays 12\ngpu-mem 8 16\n",
        )
        .unwrap();
        assert!((s.nic_bandwidth - 25e9 / 8.0).abs() < 1e-3);
        assert_eq!(s.global_batch, Some(30));
        assert_eq!(s.microbatches_per_holder(4), Some(8));
        assert_eq!((s.holders, s.relays), (Some(4), Some(12)));
        assert_eq!(s.gpu_mem_gib, Some(vec![8, 16]));
        let d = Scenario::homogeneous();
        assert!((d.nic_bandwidth - DEFAULT_NIC_GBIT_PER_S * 1e9 / 8.0).abs() < 1e-3);
        assert_eq!(d.microbatches_per_holder(10), None);
    }

    #[test]
    fn built_in_variants() {
        for name in Scenario::BUILT_IN {
            assert_eq!(Scenario::by_name(name).unwrap().name, name);
        }
        let (g, gib) = (Scenario::geo10(), Scenario::geo10_gib());
        assert_eq!(g.latency, gib.latency);
        for (a, b) in g
            .bandwidth
            .iter()
            .flatten()
            .zip(gib.bandwidth.iter().flatten())
        {
            assert!((b / a - 8.0 * 1.073741824).abs() < 1e-9, "{a} {b}");
        }
        let sparse = Scenario::geo10_sparse();
        assert_eq!(sparse.relays, Some(30));
        assert_eq!(sparse.bandwidth, g.bandwidth);
        // Uneven memory: llama-500m relays hold 2 to 16 microbatches.
        let m = crate::sim::model::ModelPreset::llama_500m();
        let caps: Vec<u32> = sparse
            .gpu_mem_gib
            .unwrap()
            .iter()
            .map(|g| m.relay_capacity(1, g << 30))
            .collect();
        assert_eq!(caps, vec![2, 5, 12, 16]);
    }
}
