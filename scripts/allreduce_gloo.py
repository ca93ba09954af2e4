"""The reference for `gwtf bench allreduce`: torch.distributed's gloo
all-reduce (sum) of N member processes on loopback, on the same number of
f32 elements, timed the same way (each repetition from a barrier to the
member's end, the slowest member's time). Prints one JSON line:
{"secs": [per repetition]}.

Usage: python allreduce_gloo.py MEMBERS ELEMENTS REPS
"""
import json
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def member(rank, n, elements, reps, port):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n
    )
    gen = torch.Generator().manual_seed(rank)
    mine = torch.rand(elements, generator=gen) * 2 - 1
    secs = []
    for _ in range(reps):
        x = mine.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        secs.append(time.perf_counter() - t0)
    slowest = torch.tensor(secs, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"secs": slowest.tolist()}), flush=True)
    dist.destroy_process_group()


def main():
    n, elements, reps = (int(x) for x in sys.argv[1:4])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(member, args=(n, elements, reps, port), nprocs=n, join=True)


if __name__ == "__main__":
    main()
