//! Network and compute scenarios: `geo10` (ten AWS regions), `homogeneous`,
//! and custom ones read from a small text file. The one scenario description
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
}

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
        })
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

    /// `geo10`, `homogeneous`, or the path of a scenario file.
    pub fn by_name(name: &str) -> Result<Scenario, String> {
        match name {
            "geo10" => Ok(Scenario::geo10()),
            "homogeneous" => Ok(Scenario::homogeneous()),
            path => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!("scenario `{path}`: not geo10, homogeneous or a readable file ({e})")
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
    }
}
