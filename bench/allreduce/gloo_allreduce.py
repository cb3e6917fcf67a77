#!/usr/bin/python3
"""Gloo baseline of `membox bench allreduce`: torch.distributed all_reduce
(sum, fp32) across --workers processes on this machine. Prints
"RESULT gloo <bytes> <seconds>" per size: the median over iterations of the
slowest rank's time."""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, port, sizes, iters):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for size in sizes:
        n = size // 4
        # The bench's check (allreduce_bench.cc, RampInput): element i of
        # rank r is (r + 1) * (i mod 4093 + 1); every element is compared.
        ramp = (torch.arange(n, dtype=torch.int64) % 4093 + 1).to(torch.float32)
        src = ramp * float(rank + 1)
        t = src.clone()
        times = []
        n_iters = iters if iters > 0 else (3 if size >= (256 << 20) else 10)
        for i in range(n_iters + 1):
            t.copy_(src)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i > 0:
                times.append(dt.item())
        want = ramp * float(world * (world + 1) // 2)
        if not torch.equal(t, want):
            bad = int((t != want).nonzero()[0])
            raise SystemExit("gloo rank %d: wrong sum at element %d of %d: "
                             "%s, expected %s" % (rank, bad, n, t[bad].item(),
                                                  want[bad].item()))
        if rank == 0:
            print("RESULT gloo %d %.9f" % (size, statistics.median(times)),
                  flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    mp.spawn(run, args=(a.workers, a.port, sizes, a.iters), nprocs=a.workers,
             join=True)


if __name__ == "__main__":
    sys.exit(main())
