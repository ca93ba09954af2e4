#!/usr/bin/env python3
"""flow_ortools.py - the OR-tools side of `gwtf bench flow` and of tests/flow_ortools.rs.

It generates one random routing instance shaped like the problem GWTF solves every
iteration, writes it as a DIMACS min-cost flow file for the Rust side, and then answers
timing requests on stdin, so that the Rust benchmark can interleave OR-tools and its own
solver (A B A B ...) on the very same instance:

    cold        -> build a SimpleMinCostFlow from the arrays and solve it from scratch
    resolve K   -> the instance without the stage node whose split arc is K (0-based arc
                   index), built and solved from scratch (what OR-tools pays after a crash)
    quit

Every answer is one JSON line: {"ms": build + solve milliseconds, "cost": optimal cost}.
Editing the instance (numpy masking) is not timed: only what a solver's user pays.

The instance (one training iteration; see docs/SPEC.md sections 2-3):

    s -> send(h) -> in(1,j) =[cap, compute]=> out(1,j) -> ... -> out(S,j) -> return(h) -> t

* D data holders and S stages of N relays; D = round(size * dh_frac), N = (size - D) / S.
* Every relay is split into an in-vertex and an out-vertex joined by its "split arc"
  (capacity = microbatches it can hold, 1..8; cost = its compute time, 20..200 ms). The split
  arcs are contiguous in arc order; the first line of the protocol says where.
* Peers sit at uniform random points of a sphere; the one-way latency of a pair is
  5 ms + 295 ms * (angle / pi). Each peer's bandwidth is log-uniform in 10 Mbit/s..10 Gbit/s
  and a link runs at the smaller of its two ends.
* An arc between consecutive layers costs round(2 * latency + 2 * transfer time) ms
  (forward activation + backward gradient; tokens of 64 KiB into stage 1, activations of
  --act-mib MiB after it), with capacity min(cap(a), cap(b)).
* Edges between layers: "dense" (all pairs) or "knnK" (each peer to its K nearest peers of
  the next layer).
* F = 90% of the smallest layer capacity must go from s to t; a bypass arc s -> t of capacity
  F and prohibitive cost ("not trained this iteration") keeps every instance feasible, so the
  optimum maximises the flow first and minimises its cost second.

Requires numpy, scipy and ortools (scripts/python-deps installs them into .venv).
"""
import argparse
import json
import math
import sys
import time

import numpy as np
from ortools.graph.python import min_cost_flow
from scipy.spatial import cKDTree

MIB = 1 << 20
TOKEN_BYTES = 64 * 1024


def random_sphere(rng, n):
    """n points spread uniformly over the unit sphere."""
    v = rng.normal(size=(n, 3))
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def latency_ms(a, b):
    """One-way latency between matching rows of two point arrays."""
    cos = np.clip(np.sum(a * b, axis=1), -1.0, 1.0)
    return 5.0 + 295.0 * np.arccos(cos) / math.pi


def layer_pairs(src, dst, k):
    """Index pairs (i, j) of the arcs from layer src to layer dst: all pairs when k is None,
    else each src point to its k nearest dst points (the chord distance orders points as
    the great-circle distance does)."""
    if k is None:
        return np.repeat(np.arange(len(src)), len(dst)), np.tile(np.arange(len(dst)), len(src))
    k = min(k, len(dst))
    _, near = cKDTree(dst).query(src, k=k)
    near = np.asarray(near).reshape(len(src), k)
    return np.repeat(np.arange(len(src)), k), near.reshape(-1)


class ArcList:
    """Arcs appended in blocks, concatenated at the end."""

    def __init__(self):
        self.blocks = []
        self.count = 0

    def add(self, tail, head, cap, cost):
        block = [np.asarray(x, dtype=np.int64).ravel() for x in (tail, head, cap, cost)]
        n = max(len(x) for x in block)
        block = [np.broadcast_to(x, (n,)) if len(x) == 1 else x for x in block]
        self.blocks.append(block)
        self.count += n

    def arrays(self):
        return [np.concatenate([b[i] for b in self.blocks]) for i in range(4)]


def make_instance(size, stages=8, dh_frac=0.1, knn=None, seed=1, act_mib=4.0):
    rng = np.random.default_rng(seed)
    holders = max(1, int(round(size * dh_frac)))
    per_stage = max(1, (size - holders) // stages)
    peers = holders + stages * per_stage
    where = random_sphere(rng, peers)
    bw_bits = np.exp(rng.uniform(math.log(10e6), math.log(10e9), size=peers))
    cap = rng.integers(1, 9, size=peers)
    compute = rng.uniform(20.0, 200.0, size=peers)

    # Peers: holders first, then stage by stage. Vertices: s, t, send(h), return(h), then
    # in/out of every relay.
    layer_peers = [np.arange(holders)] + [
        holders + k * per_stage + np.arange(per_stage) for k in range(stages)]
    s, t = 0, 1
    send = 2 + np.arange(holders)
    ret = 2 + holders + np.arange(holders)
    relay_in = lambda p: 2 + 2 * holders + 2 * (p - holders)  # noqa: E731
    relay_out = lambda p: relay_in(p) + 1  # noqa: E731
    vertices = 2 + 2 * holders + 2 * stages * per_stage

    def link_cost(pa, pb, nbytes):
        seconds = 8.0 * nbytes / np.minimum(bw_bits[pa], bw_bits[pb])
        return np.rint(2.0 * latency_ms(where[pa], where[pb]) + 2000.0 * seconds)

    arcs = ArcList()
    h = layer_peers[0]
    arcs.add(s, send, cap[h], 0)
    arcs.add(ret, t, cap[h], 0)
    split_first = arcs.count
    relays = np.concatenate(layer_peers[1:])
    arcs.add(relay_in(relays), relay_out(relays), cap[relays], np.rint(compute[relays]))
    # holders -> stage 1 (tokens), stage k -> k+1, stage S -> holders (activations)
    for k in range(stages + 1):
        a = layer_peers[k]
        b = layer_peers[k + 1] if k < stages else layer_peers[0]
        i, j = layer_pairs(where[a], where[b], knn)
        pa, pb = a[i], b[j]
        tail = send[pa] if k == 0 else relay_out(pa)
        head = ret[pb] if k == stages else relay_in(pb)
        nbytes = TOKEN_BYTES if k == 0 else act_mib * MIB
        arcs.add(tail, head, np.minimum(cap[pa], cap[pb]), link_cost(pa, pb, nbytes))

    tail, head, capa, cost = arcs.arrays()
    demand = max(1, int(0.9 * min(int(cap[l].sum()) for l in layer_peers)))
    # more than any s-t path: 2 * stages + 1 arcs of at most cost.max() each
    bypass_cost = int(cost.max()) * (2 * stages + 2) + 1
    tail, head = np.append(tail, s), np.append(head, t)
    capa, cost = np.append(capa, demand), np.append(cost, bypass_cost)
    supply = np.zeros(vertices, dtype=np.int64)
    supply[s], supply[t] = demand, -demand
    return dict(peers=peers, stages=stages, vertices=vertices, tail=tail, head=head,
                cap=capa, cost=cost, supply=supply, demand=demand,
                split_first=split_first, split_count=len(relays),
                mode="dense" if knn is None else f"knn{knn}")


def without_relay(inst, split_arc):
    """A copy of the instance with the relay of one split arc and all its arcs removed."""
    gone = (inst["tail"][split_arc], inst["head"][split_arc])
    keep = ~(np.isin(inst["tail"], gone) | np.isin(inst["head"], gone))
    out = dict(inst)
    for key in ("tail", "head", "cap", "cost"):
        out[key] = inst[key][keep]
    return out


def write_dimacs(inst, path):
    """DIMACS min-cost flow, 1-based vertices, arcs in instance order."""
    n_arcs = len(inst["tail"])
    with open(path, "w") as f:
        f.write(f"c layered GWTF-shaped instance: {inst['peers']} peers, {inst['mode']}, "
                f"{inst['stages']} stages, demand {inst['demand']}\n")
        f.write(f"p min {inst['vertices']} {n_arcs}\n")
        for v in np.nonzero(inst["supply"])[0]:
            f.write(f"n {v + 1} {int(inst['supply'][v])}\n")
        rows = np.column_stack([inst["tail"] + 1, inst["head"] + 1,
                                np.zeros(n_arcs, dtype=np.int64), inst["cap"], inst["cost"]])
        np.savetxt(f, rows, fmt="a %d %d %d %d %d")


def ortools_cost(inst):
    """Builds and solves the instance with OR-tools; returns the optimal cost."""
    solver = min_cost_flow.SimpleMinCostFlow()
    solver.add_arcs_with_capacity_and_unit_cost(inst["tail"], inst["head"], inst["cap"],
                                                 inst["cost"])
    solver.set_nodes_supplies(np.arange(inst["vertices"], dtype=np.int64), inst["supply"])
    status = solver.solve()
    if status != solver.OPTIMAL:
        raise RuntimeError(f"OR-tools status {status}")
    return solver.optimal_cost()


def timed(inst):
    t0 = time.perf_counter()
    cost = ortools_cost(inst)
    return (time.perf_counter() - t0) * 1e3, int(cost)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, required=True, help="peers (holders + relays)")
    ap.add_argument("--mode", default="knn16", help="dense or knnK")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--dh-frac", type=float, default=0.1, help="fraction of data holders")
    ap.add_argument("--act-mib", type=float, default=4.0, help="activation size in MiB")
    ap.add_argument("--dimacs", required=True, help="where to write the instance")
    args = ap.parse_args()
    if args.size < args.stages + 1:
        ap.error(f"--size {args.size} is too small for {args.stages} stages")
    if args.mode != "dense" and not (args.mode.startswith("knn") and args.mode[3:].isdigit()
                                     and int(args.mode[3:]) > 0):
        ap.error(f"--mode must be dense or knnK with K > 0, got {args.mode!r}")
    knn = None if args.mode == "dense" else int(args.mode[3:])

    t0 = time.perf_counter()
    inst = make_instance(args.size, stages=args.stages, dh_frac=args.dh_frac, knn=knn,
                         seed=args.seed, act_mib=args.act_mib)
    gen_s = time.perf_counter() - t0
    write_dimacs(inst, args.dimacs)
    print(json.dumps(dict(ready=True, peers=int(inst["peers"]), n_graph=int(inst["vertices"]),
                          n_arcs=len(inst["tail"]), F=int(inst["demand"]), mode=inst["mode"],
                          split_arc_first=int(inst["split_first"]),
                          split_arc_count=int(inst["split_count"]), gen_s=gen_s)), flush=True)

    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] == "cold":
            ms, cost = timed(inst)
        elif words[0] == "resolve" and len(words) == 2 and words[1].isdigit():
            arc = int(words[1])
            first, count = inst["split_first"], inst["split_count"]
            if not first <= arc < first + count:
                print(json.dumps(dict(error=f"arc {arc} is not a split arc "
                                            f"({first}..{first + count - 1})")), flush=True)
                continue
            ms, cost = timed(without_relay(inst, arc))
        else:
            print(json.dumps(dict(error=f"unknown command {line.strip()!r}")), flush=True)
            continue
        print(json.dumps(dict(ms=ms, cost=cost)), flush=True)


if __name__ == "__main__":
    main()
