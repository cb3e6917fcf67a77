#!/usr/bin/python3
"""A communication-bound model: a 4-layer MLP with ~134 M parameters
(537 MB of fp32 gradients per iteration) and a tiny batch, trained with
PyTorch DDP; gradients averaged by Gloo (--backend gloo), by membox
memory nodes through the two-line hook (--backend membox), or by plain DDP
on the membox process group (--backend membox-pg:
init_process_group("membox"), no hook). Run under
`membox launch`; rank 0 prints the mean iteration time.

    membox launch --nodes 1 --workers 2 -- /usr/bin/python3 examples/comm_bound.py --backend membox
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("membox", "membox-pg", "gloo"),
                    required=True)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--width", type=int, default=5792)
    ap.add_argument("--bucket-mb", type=int, default=25)
    ap.add_argument("--wire-dtype", choices=("bfloat16", "float16"),
                    help="gradients on the wire in this type: membox's "
                    "wire_dtype, or for Gloo torch's bf16_compress_hook / "
                    "fp16_compress_hook (the same wire for both)")
    ap.add_argument("--no-sync", action="store_true",
                    help="compute only (DDP's no_sync): the floor")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.backend == "membox-pg":
        import membox.torch  # noqa: F401 - registers the backend
    dist.init_process_group("membox" if a.backend == "membox-pg" else "gloo",
                            rank=rank, world_size=world)
    w = a.width
    net = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                        nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w))
    params = sum(p.numel() for p in net.parameters())
    model = nn.parallel.DistributedDataParallel(net,
                                                bucket_cap_mb=a.bucket_mb)
    if a.backend == "membox":
        import membox.torch
        membox.torch.init(wire_dtype=a.wire_dtype)
        model.register_comm_hook(None, membox.torch.allreduce_hook)
    elif a.wire_dtype:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, {
            "bfloat16": default_hooks.bf16_compress_hook,
            "float16": default_hooks.fp16_compress_hook}[a.wire_dtype])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(2, w)
    times = []
    for i in range(a.iters):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        if a.no_sync:
            with model.no_sync():
                model(x).square().mean().backward()
        else:
            model(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([sum(times[2:]) / len(times[2:])], dtype=torch.float64)
    dist.all_reduce(t)
    if rank == 0:
        print("RESULT %s params %d iteration_ms %.1f" %
              ("compute-only" if a.no_sync else
               a.backend + ("-" + a.wire_dtype if a.wire_dtype else ""), params,
               t.item() / world * 1e3), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
