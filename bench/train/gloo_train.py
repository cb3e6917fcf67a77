#!/usr/bin/python3
"""Gloo baseline of `membox bench train`: PyTorch DDP's communication pattern
-- gradients bucketed (25 MB, in backward order), each bucket all-reduced
asynchronously as soon as its last gradient is ready, the iteration waiting
for all buckets at the end of backward, then the optimizer step -- with
compute emulated by sleeps.
Reads the model from a file of "layer elements" lines. Prints
"RESULT <iteration ms> <blocked ms>" (means over ranks and iterations)."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BUCKET = 25 * 1024 * 1024


def run(rank, a, layers):
    torch.set_num_threads(1)
    if a.attached:  # one rank of `membox launch --attach` (bench cluster)
        dist.init_process_group("gloo")
        rank, a.workers = dist.get_rank(), dist.get_world_size()
    else:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(a.port)
        dist.init_process_group("gloo", rank=rank, world_size=a.workers)
    sizes = [n for l in layers for n in l]
    owner = [i for i, l in enumerate(layers) for _ in l]
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + n)
    flat = torch.ones(offs[-1], dtype=torch.float32)
    # Buckets in backward order: (first tensor, last tensor, ready at layer).
    buckets, cur, acc = [], [], 0
    for t in reversed(range(len(sizes))):
        cur.append(t)
        acc += 4 * sizes[t]
        if acc >= BUCKET:
            buckets.append(cur)
            cur, acc = [], 0
    if cur:
        buckets.append(cur)
    ready_at = {}
    for b in buckets:
        ready_at.setdefault(min(owner[t] for t in b), []).append(b)
    nl = len(layers)
    fp, bp = a.forward_ms / 1e3 / nl, a.backward_ms / 1e3 / nl
    iters, blocked = [], []
    for it in range(a.iters):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(nl):
            time.sleep(fp)
        works = []
        for l in reversed(range(nl)):
            time.sleep(bp)
            for b in ready_at.get(l, []):
                lo, hi = offs[min(b)], offs[max(b) + 1]
                works.append(dist.all_reduce(flat[lo:hi], async_op=True))
        for w in works:
            w.wait()
        time.sleep(a.step_ms / 1e3)  # the optimizer step
        t2 = time.perf_counter()
        if it >= 2:  # warm-up, as the C++ schemes
            iters.append(t2 - t0)
            blocked.append(t2 - t0 - (a.forward_ms + a.backward_ms +
                                      a.step_ms) / 1e3)
    res = torch.tensor([sum(iters) / len(iters), sum(blocked) / len(blocked)],
                       dtype=torch.float64)
    dist.all_reduce(res)
    if rank == 0:
        print("RESULT %.3f %.3f" % (res[0].item() / a.workers * 1e3,
                                    res[1].item() / a.workers * 1e3),
              flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--model", required=True)
    ap.add_argument("--forward-ms", type=float, required=True)
    ap.add_argument("--backward-ms", type=float, required=True)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--attached", action="store_true",
                    help="this process is one rank; the process group comes "
                    "from the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT)")
    a = ap.parse_args()
    layers = {}
    with open(a.model) as f:
        for line in f:
            l, n = line.split()
            layers.setdefault(int(l), []).append(int(n))
    layers = [layers[i] for i in sorted(layers)]
    if a.attached:
        run(0, a, layers)
    else:
        mp.spawn(run, args=(a, layers), nprocs=a.workers, join=True)


if __name__ == "__main__":
    main()
