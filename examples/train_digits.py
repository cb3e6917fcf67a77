#!/usr/bin/python3
"""Data-parallel training of a small CNN on the handwritten digits that
Debian's python3-sklearn ships (1797 8x8 images), with PyTorch DDP whose
gradient synchronisation is either Gloo's AllReduce (--backend gloo) or
membox's memory nodes (--backend membox: the two-line change below).

Run under `membox launch` (which sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and
MEMBOX_PROXIES / MEMBOX_SECRET_FILE):

    membox launch --nodes 2 --workers 4 -- /usr/bin/python3 examples/train_digits.py --backend membox
    membox launch --nodes 0 --workers 4 -- /usr/bin/python3 examples/train_digits.py --backend gloo

Rank 0 prints one line per epoch -- mean loss over all workers, test
accuracy, mean iteration time, blocked communication time (iteration time
minus the same worker's compute-only iteration time, measured with DDP's
no_sync()) -- and with --out writes them as JSON lines.
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.datasets import load_digits


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def recorded_epochs(path):
    """The epochs whose records the --out file at `path` holds (a restarted
    worker set must not write one twice, nor leave one out)."""
    try:
        with open(path) as f:
            return {json.loads(line).get("epoch") for line in f
                    if line.strip()}
    except FileNotFoundError:
        return set()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("membox", "gloo"), required=True)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per step (the first ones under "
                         "DDP's no_sync())")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the DDP model (torch 2.x)")
    ap.add_argument("--wire-dtype", choices=("bfloat16", "float16"),
                    help="membox: send gradients in this type (the nodes "
                         "sum in float32)")
    ap.add_argument("--in-memory-state", action="store_true",
                    help="membox: keep the weights and optimizer state in "
                         "the memory nodes (membox.torch.InMemoryState), so "
                         "that `membox launch --max-restarts` restarts "
                         "continue from the newest step without a file")
    ap.add_argument("--state-every", type=int, default=1,
                    help="with --in-memory-state: commit every k steps")
    a = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = np.random.RandomState(0).permutation(len(y))
    train, test = perm[:1440], perm[1440:]

    model = nn.parallel.DistributedDataParallel(Net())
    if a.backend == "membox":
        import membox.torch
        membox.torch.init(wire_dtype=a.wire_dtype)                   # line 1
        model.register_comm_hook(None, membox.torch.allreduce_hook)  # line 2
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    ddp = model
    # Checkpoints (with `membox launch --checkpoint-dir`): the weights,
    # the optimizer's state and the epoch, after every epoch; `membox
    # launch --resume` continues after the last one.
    saving = bool(os.environ.get("MEMBOX_CHECKPOINT_DIR"))
    start = 0
    if saving:
        import membox.torch
        state = membox.torch.load_checkpoint()
        if state is not None:
            ddp.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["epoch"]
            if rank == 0:
                print(f"resumed after epoch {start}", flush=True)
    # In-memory state: restarted workers continue from the step the memory
    # nodes hold (at most two steps behind the one that died).
    mem, skip = None, 0
    if a.in_memory_state and a.backend == "membox":
        mem = membox.torch.InMemoryState(ddp, opt, every=a.state_every)
        step = mem.restore()
        per_epoch = len(train[rank::world]) // a.batch // a.accumulate
        start, skip = divmod(step, per_epoch)
        if rank == 0 and a.out and start and not skip and \
                start not in recorded_epochs(a.out):
            # The set stopped after epoch `start`'s last step and before
            # its record: written now from the restored weights (the
            # epoch's loss and times were lost with the worker).
            model.eval()
            with torch.no_grad():
                acc = (ddp.module(x[test]).argmax(1) == y[test]).float().mean()
            with open(a.out, "a") as f:
                f.write(json.dumps({"backend": a.backend, "epoch": start,
                                    "loss": None, "accuracy": acc.item(),
                                    "recovered": True}) + "\n")
    if a.compile:
        model = torch.compile(model)
    loss_fn = nn.CrossEntropyLoss()

    def batches(epoch):
        order = np.random.RandomState(a.seed + epoch + 1).permutation(train)
        mine = order[rank::world]
        for i in range(0, len(mine) - a.batch + 1, a.batch):
            idx = torch.tensor(mine[i:i + a.batch])
            yield x[idx], y[idx]

    # Compute-only iteration time: the same work with DDP's sync disabled.
    xb, yb = next(batches(-1))
    compute = []
    for i in range(6):
        t0 = time.perf_counter()
        with ddp.no_sync():
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
        compute.append(time.perf_counter() - t0)
    opt.zero_grad()
    compute_s = float(np.median(compute[1:]))

    for epoch in range(start, a.epochs):
        model.train()
        losses, times = [], []
        micro = []
        for n, (xb, yb) in enumerate(batches(epoch)):
            if epoch == start and n < skip * a.accumulate:
                continue  # done before the restart
            micro.append((xb, yb))
            if len(micro) < a.accumulate:
                continue
            t0 = time.perf_counter()
            opt.zero_grad()
            for xm, ym in micro[:-1]:  # accumulate locally, no communication
                with ddp.no_sync():
                    (loss_fn(model(xm), ym) / a.accumulate).backward()
            xm, ym = micro[-1]
            loss = loss_fn(model(xm), ym) / a.accumulate
            loss.backward()       # gradients synchronised here
            opt.step()
            if mem is not None and not mem.auto:
                mem.commit()  # torch 1.x: no optimizer step hooks
            micro = []
            times.append(time.perf_counter() - t0)
            losses.append(loss.item() * a.accumulate)
        stats = torch.tensor([float(np.mean(losses)), float(np.mean(times))],
                             dtype=torch.float64)
        dist.all_reduce(stats)
        stats /= world
        model.eval()
        with torch.no_grad():
            acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        if rank == 0:
            rec = {"backend": a.backend, "epoch": epoch + 1,
                   "loss": stats[0].item(), "accuracy": acc,
                   "iteration_ms": stats[1].item() * 1e3,
                   "blocked_ms": max(0.0, (stats[1].item() - compute_s) * 1e3)}
            print("epoch %d  loss %.6f  accuracy %.4f  iteration %.2f ms  "
                  "blocked %.2f ms" % (rec["epoch"], rec["loss"], rec["accuracy"],
                                       rec["iteration_ms"], rec["blocked_ms"]),
                  flush=True)
            # A set restarted from in-memory state may re-run the last steps
            # of an epoch whose record was written before the failure.
            if a.out and not (os.environ.get("MEMBOX_RESUMED") and
                             rec["epoch"] in recorded_epochs(a.out)):
                with open(a.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        if saving:
            membox.torch.save_checkpoint({"model": ddp.module.state_dict(),
                                          "opt": opt.state_dict(),
                                          "epoch": epoch + 1})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
