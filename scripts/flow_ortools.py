#!/usr/bin/env python3
"""flow_ortools.py - OR-tools side of `gwtf bench flow`.

Generates one layered GWTF-shaped instance with the reference generator
(`make_instance` of shared/bench/flow_reference.py, imported from --reference), writes it
as DIMACS for the Rust side, then serves timing requests on stdin so that the Rust
benchmark can interleave OR-tools and its own runs (A B A B ...):

    cold        -> build SimpleMinCostFlow from the arrays + solve, from scratch
    resolve K   -> the instance with the stage node of split arc K deleted
                   (flow_reference.delete_stage_node), build + solve from scratch
    quit

Every reply is one JSON line: {"ms": build+solve milliseconds, "cost": optimal cost}.
Instance deletion (numpy masking) is not timed: only what a solver user would pay.
"""
import argparse
import json
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", default=os.path.join(here, "..", "..", "shared", "bench"))
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--mode", default="knn16")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--dh-frac", type=float, default=0.1)
    ap.add_argument("--act-mib", type=float, default=4.0)
    ap.add_argument("--dimacs", required=True)
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.reference))
    import flow_reference as ref  # noqa: E402

    mode_k = None if args.mode == "dense" else int(args.mode.replace("knn", ""))
    t0 = time.perf_counter()
    inst = ref.make_instance(args.size, stages=args.stages, dh_frac=args.dh_frac,
                             mode_k=mode_k, seed=args.seed, act_mib=args.act_mib)
    gen_s = time.perf_counter() - t0
    ref.dump_dimacs(inst, args.dimacs)
    print(json.dumps(dict(ready=True, peers=int(inst["total_nodes"]), n_graph=int(inst["n_graph"]),
                          n_arcs=int(inst["n_arcs"]), F=int(inst["F"]), mode=inst["mode"],
                          split_arc_first=int(inst["split_arc_first"]),
                          split_arc_count=int(inst["split_arc_count"]), gen_s=gen_s)), flush=True)

    def timed(i):
        t0 = time.perf_counter()
        smcf, _ = ref.ortools_build(i)
        cost = ref.ortools_solve(smcf)
        return (time.perf_counter() - t0) * 1e3, int(cost)

    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] == "cold":
            ms, cost = timed(inst)
        elif words[0] == "resolve":
            inst2 = ref.delete_stage_node(inst, int(words[1]))
            ms, cost = timed(inst2)
            del inst2
        else:
            print(json.dumps(dict(error=f"unknown command {words[0]}")), flush=True)
            continue
        print(json.dumps(dict(ms=ms, cost=cost)), flush=True)


if __name__ == "__main__":
    main()
