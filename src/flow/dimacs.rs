//! DIMACS min-cost flow files: `c` comments, `p min N M`, `n ID SUPPLY`, `a U V LOW CAP COST`.
//!
//! Node ids are 1-based in the file and map to `NodeId(id - 1)`; arcs keep file order, so
//! `ArcId(k)` is the k-th `a` line. Lower bounds `LOW > 0` are removed by the standard
//! transformation (send `LOW` units up front: supply(u) -= LOW, supply(v) += LOW, capacity
//! becomes `CAP - LOW`, and `LOW * COST` is a constant cost offset); the offset and the
//! lower bounds are kept in [`DimacsProblem`] so reported costs and flows are in the
//! original problem's terms.
//!
//! Limits are checked before allocating: `N` and `M` must fit in `u32`, and they must be
//! plausible for the input size (each arc line needs at least 10 bytes), so a 100-byte file
//! cannot make us allocate gigabytes.
use super::{ArcId, FlowError, MinCostFlow, NodeId};
use std::io::{BufRead, BufReader, Read, Write};

/// A parsed DIMACS problem.
#[derive(Clone, Debug)]
pub struct DimacsProblem {
    /// The problem with lower bounds already transformed away.
    pub mcf: MinCostFlow,
    /// Lower bound of each arc, in file order (all zero for most files).
    pub lower: Vec<i64>,
    /// `sum LOW * COST`: add to `mcf.cost()` to get the original problem's cost.
    pub cost_offset: i128,
    /// Original supplies (before the lower-bound transformation), by node.
    pub supply: Vec<i64>,
}

impl DimacsProblem {
    /// Total cost in the original problem's terms (after solving).
    pub fn cost(&self) -> i128 {
        self.mcf.cost_i128() + self.cost_offset
    }
    /// Flow of each arc in file order, lower bounds added back.
    pub fn arc_flows(&self) -> Vec<i64> {
        self.mcf
            .arc_flows()
            .iter()
            .zip(&self.lower)
            .map(|(f, l)| f + l)
            .collect()
    }
    /// Total flow out of supply nodes (sum of positive original supplies).
    pub fn flow_value(&self) -> i64 {
        self.supply.iter().filter(|&&s| s > 0).sum()
    }
}

fn perr(line: usize, msg: impl Into<String>) -> FlowError {
    FlowError::Parse {
        line,
        msg: msg.into(),
    }
}

fn field<T: std::str::FromStr>(tok: Option<&str>, line: usize, what: &str) -> Result<T, FlowError> {
    let t = tok.ok_or_else(|| perr(line, format!("missing {what}")))?;
    t.parse::<T>()
        .map_err(|_| perr(line, format!("bad {what} '{t}'")))
}

/// Reads a DIMACS min-cost flow problem. `size_hint` is the input length in bytes when
/// known (used to refuse absurd `N`/`M`); pass `None` for streams.
pub fn read<R: Read>(input: R, size_hint: Option<u64>) -> Result<DimacsProblem, FlowError> {
    let mut rd = BufReader::new(input);
    let mut line = String::new();
    let mut lineno = 0usize;
    let mut header: Option<(usize, usize)> = None;
    let mut mcf = MinCostFlow::new();
    let mut lower: Vec<i64> = Vec::new();
    let mut supply: Vec<i64> = Vec::new();
    let mut offset: i128 = 0;
    let mut seen_node = Vec::new();
    loop {
        line.clear();
        let got = rd
            .read_line(&mut line)
            .map_err(|e| FlowError::Io(format!("line {}: {e}", lineno + 1)))?;
        if got == 0 {
            break;
        }
        lineno += 1;
        let mut toks = line.split_ascii_whitespace();
        let Some(kind) = toks.next() else { continue };
        match kind {
            "c" => continue,
            "p" => {
                if header.is_some() {
                    return Err(perr(lineno, "second 'p' line"));
                }
                let fmt: String = field(toks.next(), lineno, "problem type")?;
                if fmt != "min" {
                    return Err(perr(
                        lineno,
                        format!("problem type '{fmt}', expected 'min'"),
                    ));
                }
                let n: u64 = field(toks.next(), lineno, "node count")?;
                let m: u64 = field(toks.next(), lineno, "arc count")?;
                if n >= u32::MAX as u64 / 2 || m >= u32::MAX as u64 / 2 {
                    return Err(perr(lineno, format!("N={n} M={m} exceed the 2^31 limit")));
                }
                if let Some(sz) = size_hint {
                    // Each arc line needs >= 10 bytes ("a 1 2 0 1 0\n"); nodes need no line,
                    // but more than 64 nodes per input byte is not a sane file.
                    if m > sz / 10 + 1 || n > sz.saturating_mul(64) + 64 {
                        return Err(perr(
                            lineno,
                            format!("N={n} M={m} are implausible for a {sz}-byte file"),
                        ));
                    }
                }
                let (n, m) = (n as usize, m as usize);
                mcf = MinCostFlow::with_capacity(n, m);
                for _ in 0..n {
                    mcf.add_node(0)?;
                }
                supply = vec![0; n];
                seen_node = vec![false; n];
                lower.reserve(m.min(1 << 24));
                header = Some((n, m));
            }
            "n" => {
                let (n, _) = header.ok_or_else(|| perr(lineno, "'n' line before 'p' line"))?;
                let id: usize = field(toks.next(), lineno, "node id")?;
                let s: i64 = field(toks.next(), lineno, "supply")?;
                if id == 0 || id > n {
                    return Err(perr(lineno, format!("node id {id} outside 1..={n}")));
                }
                if seen_node[id - 1] {
                    return Err(perr(lineno, format!("node {id} given twice")));
                }
                seen_node[id - 1] = true;
                supply[id - 1] = s;
                let cur = mcf.supply(NodeId(id as u32 - 1))?;
                let v = cur
                    .checked_add(s)
                    .ok_or_else(|| perr(lineno, "supply overflow"))?;
                mcf.set_supply(NodeId(id as u32 - 1), v)?;
            }
            "a" => {
                let (n, m) = header.ok_or_else(|| perr(lineno, "'a' line before 'p' line"))?;
                let u: usize = field(toks.next(), lineno, "tail")?;
                let v: usize = field(toks.next(), lineno, "head")?;
                let lo: i64 = field(toks.next(), lineno, "lower bound")?;
                let cap: i64 = field(toks.next(), lineno, "capacity")?;
                let cost: i64 = field(toks.next(), lineno, "cost")?;
                if u == 0 || u > n || v == 0 || v > n {
                    return Err(perr(lineno, format!("arc {u}->{v}: node outside 1..={n}")));
                }
                if lower.len() >= m {
                    return Err(perr(lineno, format!("more than the {m} arcs announced")));
                }
                if lo < 0 || cap < lo {
                    return Err(perr(
                        lineno,
                        format!("need 0 <= LOW <= CAP, got LOW={lo} CAP={cap}"),
                    ));
                }
                let (un, vn) = (NodeId(u as u32 - 1), NodeId(v as u32 - 1));
                if lo > 0 {
                    let su = mcf.supply(un)?.checked_sub(lo);
                    let sv = mcf.supply(vn)?.checked_add(lo);
                    match (su, sv) {
                        (Some(su), Some(sv)) => {
                            mcf.set_supply(un, su)?;
                            mcf.set_supply(vn, sv)?;
                        }
                        _ => return Err(perr(lineno, "supply overflow from lower bound")),
                    }
                    offset += lo as i128 * cost as i128;
                }
                mcf.add_arc(un, vn, cap - lo, cost)?;
                lower.push(lo);
            }
            other => {
                return Err(perr(lineno, format!("unknown line type '{other}'")));
            }
        }
        if toks.next().is_some() && kind != "c" {
            return Err(perr(lineno, "trailing fields"));
        }
    }
    let (_, m) = header.ok_or_else(|| perr(lineno.max(1), "no 'p min N M' line"))?;
    if lower.len() != m {
        return Err(perr(
            lineno.max(1),
            format!("announced {m} arcs, found {}", lower.len()),
        ));
    }
    Ok(DimacsProblem {
        mcf,
        lower,
        cost_offset: offset,
        supply,
    })
}

/// Writes the live part of a problem as DIMACS. Removed nodes stay (ids are positions) with
/// no supply; removed arcs are skipped, so arc order in the file is live arcs in id order.
pub fn write<W: Write>(mcf: &MinCostFlow, mut out: W) -> Result<(), FlowError> {
    let io = |e: std::io::Error| FlowError::Io(e.to_string());
    let n = mcf.node_count();
    let live: Vec<u32> = (0..mcf.arc_count() as u32)
        .filter(|&a| mcf.arc_alive(ArcId(a)))
        .collect();
    writeln!(out, "c written by gwtf").map_err(io)?;
    writeln!(out, "p min {} {}", n, live.len()).map_err(io)?;
    for i in 0..n as u32 {
        if mcf.node_alive(NodeId(i)) {
            let s = mcf.supply(NodeId(i))?;
            if s != 0 {
                writeln!(out, "n {} {}", i + 1, s).map_err(io)?;
            }
        }
    }
    for a in live {
        let (u, v) = mcf.arc_ends(ArcId(a))?;
        let cap = mcf.arc_capacity(ArcId(a))?;
        let cost = mcf.arc_cost(ArcId(a))?;
        writeln!(out, "a {} {} 0 {} {}", u.0 + 1, v.0 + 1, cap, cost).map_err(io)?;
    }
    Ok(())
}
