#!/usr/bin/python3
"""A transformer-style model (a 2-layer causal Transformer encoder language
model) trained with PyTorch DDP on a synthetic token stream; gradients
averaged by membox memory nodes (--backend membox) or Gloo (--backend gloo).

    membox launch --nodes 2 --workers 2 -- /usr/bin/python3 examples/transformer_lm.py --backend membox

--offload keeps the model itself in the memory nodes (membox.torch.offload,
torch 2.1 or later): the nodes hold the weights and Adam's state and step
it; each worker pulls an encoder layer just before it computes and pushes
its gradients as backward makes them. At the end, rank 0 prints what a
worker held of model state, in bytes per parameter, against DDP with Adam.
"""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

VOCAB, SEQ = 64, 32


class LM(nn.Module):
    def __init__(self, d=128, layers=2, heads=4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(SEQ, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0,
                                           batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.out = nn.Linear(d, VOCAB)
        self.register_buffer("mask", torch.triu(
            torch.full((SEQ, SEQ), float("-inf")), diagonal=1))

    def forward(self, tokens):
        h = self.emb(tokens) + self.pos
        return self.out(self.enc(h, mask=self.mask))


def batch(gen, n):
    # Each sequence counts upwards modulo VOCAB from a random start with a
    # random stride: learnable from the first two tokens.
    start = torch.randint(0, VOCAB, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("membox", "gloo"), required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128,
                    help="width (4 heads; the feed-forward is 4x)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--no-sync", action="store_true",
                    help="no gradient exchange at all (DDP's no_sync): the "
                         "step's compute alone, for the breakdown of a "
                         "comparison")
    ap.add_argument("--wire-dtype", choices=("bfloat16", "float16"),
                    help="membox: gradients on the wire in this type")
    ap.add_argument("--in-memory-state", action="store_true",
                    help="membox: keep the weights and Adam's state in the "
                         "memory nodes (membox.torch.InMemoryState; a "
                         "restart continues from the nodes' step, the "
                         "synthetic token stream starts over)")
    ap.add_argument("--state-every", type=int, default=1,
                    help="with --in-memory-state: commit every k steps")
    ap.add_argument("--offload", action="store_true",
                    help="membox: the memory nodes hold the model and its "
                         "Adam state and step it (membox.torch.offload); "
                         "no DDP")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="with --offload: units pulled ahead")
    ap.add_argument("--out", help="with --offload: rank 0 appends each "
                    "step's loss here (JSON lines); a restarted worker set "
                    "(membox launch --max-restarts) goes on at the step the "
                    "memory nodes have completed, with that step's data")
    ap.add_argument("--exit-in-backward", type=int, default=0,
                    metavar="STEP",
                    help="with --offload, for restart tests: the last rank "
                         "exits in STEP's backward once the upper layers' "
                         "gradients are pushed (a job dying mid-step)")
    ap.add_argument("--fsdp2", action="store_true",
                    help="FSDP2 (fully_shard per encoder layer, then the "
                         "whole model) instead of DDP, on the process "
                         "group's backend: --backend membox runs it on "
                         "init_process_group(\"membox\"), gloo on Gloo")
    ap.add_argument("--overlap-optimizer", action="store_true",
                    help="step each gradient bucket's parameters as its "
                         "average arrives (membox.torch.OverlappedOptimizer; "
                         "with --backend gloo over Gloo's AllReduce)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.fsdp2 and a.backend == "membox":
        import membox.torch  # registers the "membox" backend
    dist.init_process_group("membox" if a.fsdp2 and a.backend == "membox"
                            else "gloo", rank=rank, world_size=world)
    if a.d_model < 4 or a.d_model % 4 or a.layers < 1:
        ap.error("--d-model must be a positive multiple of 4, --layers >= 1")
    if a.offload and (a.backend != "membox" or a.overlap_optimizer or
                      a.in_memory_state or a.no_sync or a.wire_dtype):
        ap.error("--offload needs --backend membox and goes without "
                 "--overlap-optimizer, --in-memory-state, --no-sync and "
                 "--wire-dtype")
    if a.fsdp2 and (a.offload or a.overlap_optimizer or a.in_memory_state
                    or a.no_sync or a.wire_dtype):
        ap.error("--fsdp2 goes without --offload, --overlap-optimizer, "
                 "--in-memory-state, --no-sync and --wire-dtype")
    model = LM(a.d_model, a.layers)
    nparams = sum(p.numel() for p in model.parameters())
    if a.fsdp2:
        from torch.distributed.fsdp import fully_shard
        for layer in model.enc.layers:
            fully_shard(layer)
        fully_shard(model)
    elif not a.offload:
        model = nn.parallel.DistributedDataParallel(model)
    if a.backend == "membox" and not a.fsdp2:
        import membox.torch
        membox.torch.init(wire_dtype=a.wire_dtype)
    if a.offload:
        opt = membox.torch.offload(model, optimizer="adam", lr=3e-3,
                                   prefetch=a.prefetch,
                                   units=list(model.enc.layers))
    elif a.overlap_optimizer:
        if a.in_memory_state or a.no_sync:
            ap.error("--overlap-optimizer goes without --in-memory-state "
                     "and --no-sync")
        import membox.torch
        opt = membox.torch.OverlappedOptimizer(
            model, torch.optim.Adam, lr=3e-3,
            hook=None if a.backend == "membox" else "allreduce")
    else:
        if a.backend == "membox" and not a.fsdp2:
            model.register_comm_hook(None, membox.torch.allreduce_hook)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = 1
    mem = None
    if a.in_memory_state and a.backend == "membox":
        mem = membox.torch.InMemoryState(model, opt, every=a.state_every)
        first = mem.restore() + 1
    current = [0]  # the step running (--exit-in-backward)
    if a.offload and a.exit_in_backward and rank == world - 1 and \
            os.environ.get("MEMBOX_RESTART", "0") == "0":
        # Once the first layer's gradient is in (every layer above it was
        # pushed before), give those pushes a moment to land and die.
        def die(p):
            if current[0] == a.exit_in_backward:
                time.sleep(0.5)
                os._exit(3)
        list(model.enc.layers[0].parameters())[0] \
            .register_post_accumulate_grad_hook(die)
    if a.offload:
        first = opt.version + 1
        if first > 1 and rank == 0:
            print("resumed from the memory nodes at step %d (%d keys already "
                  "stepped there, recomputed from their previous values)" %
                  (first, opt.ahead), flush=True)
    gen = torch.Generator().manual_seed(1000 + rank)
    loss_fn = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for step in range(first, a.steps + 1):
        current[0] = step
        if a.offload:
            # Each step's data from its number: the same after a restart.
            gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = batch(gen, a.batch)
        opt.zero_grad()
        with model.no_sync() if a.no_sync else contextlib.nullcontext():
            loss = loss_fn(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
        if not a.overlap_optimizer:  # stepped bucket by bucket in backward
            opt.step()
        if a.offload and rank == 0 and a.out:
            import json
            with open(a.out, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item()}) +
                        "\n")
        if mem is not None and not mem.auto:
            mem.commit()  # torch 1.x: no optimizer step hooks
        if rank == 0 and step % 10 == 0:
            done = step - first + 1
            print("step %d loss %.4f (%.1f ms/step)" %
                  (step, loss.item(), (time.perf_counter() - t0) / done * 1e3),
                  flush=True)
    if a.offload and rank == 0:
        # DDP with Adam holds weights, gradients, DDP's buckets (a copy of
        # the gradients) and two moments: 20 bytes per float32 parameter.
        peak = opt.stats()["peak_bytes"]
        print("resident model state per parameter: offload %.2f bytes "
              "(peak %.1f MB for %d parameters), DDP with Adam 20 bytes" %
              (peak / nparams, peak / 1e6, nparams), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
