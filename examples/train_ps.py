#!/usr/bin/python3
"""A custom training loop with membox's explicit parameter server: the
memory nodes hold the weights and run SGD with momentum; workers push
gradients and pull weights (synchronously, or --mode async on one node with
an optional --staleness bound). A checkpoint is written on every memory
node after each epoch; started under `membox launch --resume`, training
continues from the last one. Under `membox launch --max-restarts N`, a
worker set restarted after a failure continues from the memory nodes'
current state: at the step their version says, no round lost or repeated.
With --out, rank 0 appends one record per epoch; a set that stopped between
an epoch's last round and its record writes that record when it resumes
(from the nodes' weights, "recovered": true, its training loss lost).

    membox launch --nodes 2 --workers 2 --checkpoint-dir /tmp/ck -- \
        /usr/bin/python3 examples/train_ps.py --epochs 4
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn as nn
from sklearn.datasets import load_digits

import membox
import membox.torch as mt


def has_record(path, epoch):
    """True when the records file at `path` has epoch `epoch`'s."""
    try:
        with open(path) as f:
            return any(json.loads(line).get("epoch") == epoch
                       for line in f if line.strip())
    except FileNotFoundError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--mode", choices=("average", "async"), default="average")
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--pause-after-epoch", type=int, default=0,
                    help="sleep 3 s after this epoch (fault-injection tests)")
    ap.add_argument("--out", default="")
    ap.add_argument("--exit-before-record", type=int, default=0,
                    help="rank 0 of the first start exits after this "
                         "epoch's rounds, before its record (fault-injection "
                         "tests: the record written after the restart)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).flatten(1)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = np.random.RandomState(0).permutation(len(y))
    train, test = perm[:1440], perm[1440:]
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    client = membox.connect()
    ps = mt.ParameterServer(model.parameters(), mode=a.mode,
                            staleness=a.staleness, optimizer="sgd", lr=0.1,
                            momentum=0.9, client=client)
    steps = (len(train) // world) // a.batch
    first_epoch, first_step = 0, 0
    if os.environ.get("MEMBOX_RESUMED"):  # membox launch --resume / restarts
        # Versions count rounds (synchronous) or single pushes (async).
        per_step = world if a.mode == "async" else 1
        first_epoch = ps.version // (steps * per_step)
        first_step = (ps.version % (steps * per_step)) // per_step
    if rank == 0 and (first_epoch or first_step):
        restart = int(os.environ.get("MEMBOX_RESTART", "0"))
        source = "the memory nodes" if restart else "checkpoint"
        print(f"resumed from {source} at epoch {first_epoch} step "
              f"{first_step} (version {ps.version}, restart {restart})",
              flush=True)
    loss_fn = nn.CrossEntropyLoss()
    if rank == 0 and a.out and first_epoch and not first_step and \
            not has_record(a.out, first_epoch):
        # The set stopped after epoch first_epoch's last round and before
        # its record: write it now from the weights the nodes hold. Its
        # training loss was lost with the worker that stopped.
        with torch.no_grad():
            acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        rec = {"epoch": first_epoch, "loss": None, "accuracy": acc,
               "iteration_ms": None, "recovered": True}
        print(json.dumps(rec), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    for epoch in range(first_epoch, a.epochs):
        order = np.random.RandomState(epoch + 1).permutation(train)[rank::world]
        losses, t0 = [], time.perf_counter()
        for i in range(first_step if epoch == first_epoch else 0, steps):
            idx = torch.tensor(order[i * a.batch:(i + 1) * a.batch])
            model.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            ps.step()                      # push grads, pull new weights
            losses.append(loss.item())
        with torch.no_grad():
            acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        if rank == 0 and epoch + 1 == a.exit_before_record and \
                not os.environ.get("MEMBOX_RESUMED"):
            os._exit(3)
        if rank == 0:
            if os.environ.get("MEMBOX_CHECKPOINT_DIR"):
                client.checkpoint("latest.mbck")  # on every memory node
            rec = {"epoch": epoch + 1, "loss": float(np.mean(losses)),
                   "accuracy": acc,
                   "iteration_ms": (time.perf_counter() - t0) / steps * 1e3}
            print(json.dumps(rec), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        if epoch + 1 == a.pause_after_epoch:
            time.sleep(3)


if __name__ == "__main__":
    main()
