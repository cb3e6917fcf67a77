#!/usr/bin/python3
"""Wide & deep click-through-rate model on a synthetic click log whose ids
follow a power law, with its sparse features in membox's embedding store.

    membox launch --nodes 2 --workers 2 -- /usr/bin/python3 examples/ctr_wide_deep.py
    /usr/bin/python3 examples/ctr_wide_deep.py --local     # same model, torch tables
    python examples/ctr_wide_deep.py --torchrec   # same model, TorchRec tables
    torchrun --nproc_per_node 2 examples/ctr_wide_deep.py --torchrec --dmp

The click log (the same on every worker, from --seed): each impression has
--fields categorical fields plus a variable-length "history" bag; ids of
every field are Zipf(--alpha) distributed over --vocab values, and a hidden
weight per id decides the click probability (logistic), so there is a
model to learn and a best achievable AUC to compare with.

Model: wide = EmbeddingBag(dim 1, sum) over the fields' ids; deep =
Embedding(dim --dim) per field, EmbeddingBag(mean) over the history,
concatenated into an MLP. Sparse tables live in the memory nodes
(membox.torch.Embedding / EmbeddingBag: Adagrad on the nodes, rows pulled
--prefetch batches ahead and pinned until their gradients are pushed); the
MLP is data-parallel through DDP with membox's allreduce hook (the
parameter-synchronisation layer). --local trains the same model in one
process with torch.nn.EmbeddingBag / Embedding and torch's Adagrad, as the
reference. --torchrec trains it in one process with TorchRec's
FusedEmbeddingBagCollection (fbgemm's batched CPU kernels, Adagrad fused
into backward; needs torchrec and fbgemm-gpu-cpu): the three tables are
looked up in one call from a KeyedJaggedTensor. fbgemm wants dims that are
multiples of 4, so TorchRec's wide table is 4 wide and the model reads its
first column (the other columns get no gradient). --torchrec --dmp trains it
as TorchRec's users train on several processes: under torchrun, the tables
in an EmbeddingBagCollection sharded across the ranks by TorchRec's planner
(DistributedModelParallel over Gloo, ids sent to their table's rank by
all-to-all, Adagrad applied in backward), the MLP data-parallel through the
DDP that DistributedModelParallel wraps it in.

Rank 0 prints one line per epoch and a final `RESULT {json}` line: test
AUC and log loss, the hidden model's AUC (the ceiling), throughput.
"""
import argparse
import collections
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import log_loss, roc_auc_score


def click_log(a):
    """(fields ids (N, F) as global keys, history keys, history offsets,
    labels, true click probabilities)."""
    rng = np.random.default_rng(a.seed)
    p = 1.0 / np.arange(1, a.vocab + 1) ** a.alpha
    p /= p.sum()
    n, f, v = a.samples, a.fields, a.vocab
    ids = np.empty((n, f), dtype=np.int64)
    for j in range(f):
        perm = rng.permutation(v)  # each field's popular ids differ
        ids[:, j] = j * v + perm[rng.choice(v, size=n, p=p)]
    hist_len = rng.integers(1, 6, size=n)
    hist = f * v + rng.permutation(v)[rng.choice(v, size=int(hist_len.sum()),
                                                  p=p)]
    offsets = np.concatenate([[0], np.cumsum(hist_len)[:-1]])
    w = rng.normal(0.0, 0.6, size=(f + 1) * v)
    logit = w[ids].sum(1) + np.add.reduceat(w[hist], offsets) / hist_len - 1.5
    prob = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < prob).astype(np.float32)
    return ids, hist, offsets, hist_len, labels, prob


def batches(ids, hist, offsets, hist_len, labels, idx, size):
    for s in range(0, len(idx), size):
        b = idx[s:s + size]
        h = [hist[offsets[i]:offsets[i] + hist_len[i]] for i in b]
        lens = np.array([len(x) for x in h])
        yield (torch.from_numpy(ids[b]),
               torch.from_numpy(np.concatenate(h)),
               torch.from_numpy(np.concatenate([[0], np.cumsum(lens)[:-1]])),
               torch.from_numpy(labels[b]))


class TorchRecTables(nn.Module):
    """The wide, deep and history tables as one TorchRec
    FusedEmbeddingBagCollection; forward takes the same (ids, history,
    offsets) and returns what WideDeep's three layers return."""

    def __init__(self, a):
        super().__init__()
        from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig,
                              PoolingType)
        from torchrec.modules.fused_embedding_modules import \
            FusedEmbeddingBagCollection
        rows = (a.fields + 1) * a.vocab
        gen = torch.Generator().manual_seed(a.seed)

        def init(t):
            with torch.no_grad():
                return t.uniform_(-0.05, 0.05, generator=gen)
        self.fields = [f"f{j}" for j in range(a.fields)]
        tables = [
            EmbeddingBagConfig(name="wide", embedding_dim=4,
                               num_embeddings=rows, feature_names=["wide"],
                               pooling=PoolingType.SUM, init_fn=init),
            EmbeddingBagConfig(name="deep", embedding_dim=a.dim,
                               num_embeddings=rows, feature_names=self.fields,
                               pooling=PoolingType.SUM, init_fn=init),
            EmbeddingBagConfig(name="history", embedding_dim=a.dim,
                               num_embeddings=rows, feature_names=["hist"],
                               pooling=PoolingType.MEAN, init_fn=init)]
        if a.dmp:
            # Sharded by DistributedModelParallel; its kernels apply the
            # optimizer registered here in backward, as the fused
            # collection does in one process.
            from torchrec.optim.apply_optimizer_in_backward import \
                apply_optimizer_in_backward
            self.ebc = EmbeddingBagCollection(tables=tables,
                                              device=torch.device("cpu"))
            apply_optimizer_in_backward(torch.optim.Adagrad,
                                        self.ebc.parameters(),
                                        {"lr": a.sparse_lr})
        else:
            self.ebc = FusedEmbeddingBagCollection(
                tables=tables, optimizer_type=torch.optim.Adagrad,
                optimizer_kwargs={"lr": a.sparse_lr},
                device=torch.device("cpu"))

    def forward(self, x, h, ho):
        from torchrec import KeyedJaggedTensor
        b, f = x.shape
        hl = torch.diff(ho, append=torch.tensor([len(h)]))
        kjt = KeyedJaggedTensor(
            keys=["wide"] + self.fields + ["hist"],
            values=torch.cat([x.reshape(-1), x.t().reshape(-1), h]),
            lengths=torch.cat([torch.full((b,), f, dtype=torch.long),
                               torch.ones(b * f, dtype=torch.long), hl]))
        out = self.ebc(kjt).to_dict()
        wide = out["wide"][:, :1]
        deep = torch.stack([out[k] for k in self.fields], 1)
        return wide, deep, out["hist"]


class WideDeep(nn.Module):
    def __init__(self, a, store):
        super().__init__()
        self.torchrec = None
        if a.torchrec:
            self.torchrec = TorchRecTables(a)
        elif store:
            import membox.torch as mt
            kw = dict(optimizer="adagrad", lr=a.sparse_lr, seed=a.seed,
                      init_scale=0.05)
            self.wide = mt.EmbeddingBag("wide", 1, mode="sum", **kw)
            self.deep = mt.Embedding("deep", a.dim, **kw)
            self.hist = mt.EmbeddingBag("history", a.dim, mode="mean", **kw)
            # One request per memory node per step for the three tables
            # (--no-group: one per table).
            self.group = (None if a.no_group else
                          mt.EmbeddingGroup(self.wide, self.deep, self.hist))
        else:
            rows = (a.fields + 1) * a.vocab
            self.wide = nn.EmbeddingBag(rows, 1, mode="sum", sparse=True)
            self.deep = nn.Embedding(rows, a.dim, sparse=True)
            self.hist = nn.EmbeddingBag(rows, a.dim, mode="mean", sparse=True)
            for e in (self.wide, self.deep, self.hist):
                nn.init.uniform_(e.weight, -0.05, 0.05)
        self.mlp = nn.Sequential(
            nn.Linear((a.fields + 1) * a.dim, 64), nn.ReLU(),
            nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
        self.store = store

    def prefetch(self, x, h):
        if self.group is None:
            return (self.wide.prefetch(x), self.deep.prefetch(x),
                    self.hist.prefetch(h))
        return self.group.prefetch(x, x, h)

    def forward(self, x, h, ho, pre=(None, None, None)):
        if self.torchrec is not None:
            wide, deep, hist = self.torchrec(x, h, ho)
            return (wide + self.mlp(torch.cat([deep.flatten(1), hist], 1))
                    ).squeeze(1)
        kw = (lambda p: {"prefetched": p}) if self.store else (lambda p: {})
        wide = self.wide(x, **kw(pre[0]))
        deep = torch.cat([self.deep(x, **kw(pre[1])).flatten(1),
                          self.hist(h, ho, **kw(pre[2]))], 1)
        return (wide + self.mlp(deep)).squeeze(1)


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
    ap.add_argument("--samples", type=int, default=200000)
    ap.add_argument("--fields", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=100000)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256, help="per worker")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--sparse-lr", type=float, default=0.05)
    ap.add_argument("--dense-lr", type=float, default=0.003)
    ap.add_argument("--prefetch", type=int, default=2,
                    help="batches pulled ahead (0: pull in forward)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="",
                    help="rank 0 appends each epoch's record (JSON) here")
    ap.add_argument("--in-memory-state", action="store_true",
                    help="keep the MLP's weights and Adam state in the "
                         "memory nodes (membox.torch.InMemoryState): a "
                         "worker set restarted by `membox launch "
                         "--max-restarts` continues from the step they hold "
                         "(the sparse tables are in the nodes anyway)")
    ap.add_argument("--local", action="store_true",
                    help="torch tables in this process (the reference)")
    ap.add_argument("--ddp", action="store_true",
                    help="torch tables replicated in every process (run "
                    "under torchrun), the whole model under DDP with Gloo: "
                    "the tables' sparse gradients are all-reduced as sparse "
                    "tensors (the data-parallel reference with membox's "
                    "worker count)")
    ap.add_argument("--no-group", action="store_true",
                    help="a pull and a push request per table per node "
                    "(default: one per node for all tables)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads (membox's workers use 1 "
                    "each; a one-process baseline gets the cores the "
                    "membox run uses, `membox bench ctr`)")
    ap.add_argument("--dmp", action="store_true",
                    help="with --torchrec, under torchrun with 2 or more "
                    "processes: TorchRec's DistributedModelParallel (tables "
                    "sharded across the ranks, the MLP under DDP, Gloo)")
    ap.add_argument("--torchrec", action="store_true",
                    help="TorchRec's FusedEmbeddingBagCollection in this "
                    "process (needs torchrec and fbgemm-gpu-cpu)")
    a = ap.parse_args()
    if a.torchrec:
        try:
            import torchrec  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"--torchrec needs torchrec and fbgemm-gpu-cpu "
                             f"(pip install torchrec fbgemm-gpu-cpu with a "
                             f"matching torch): {e}")
        a.local = not a.dmp
    elif a.dmp:
        raise SystemExit("--dmp is TorchRec's model parallelism: use it "
                         "with --torchrec")

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if a.local and world != 1:
        raise SystemExit("--local runs in one process")
    if a.ddp and (a.local or world < 2):
        raise SystemExit("--ddp runs under torchrun with 2 or more processes "
                         "(torchrun --nproc_per_node 2 ... --ddp)")
    if a.dmp and world < 2:
        raise SystemExit("--dmp runs under torchrun with 2 or more processes "
                         "(torchrun --nproc_per_node 2 ... --torchrec --dmp)")
    # torch's or TorchRec's tables in this process (or, --dmp, in the ranks)
    local_tables = a.local or a.ddp or a.dmp
    ids, hist, offsets, hist_len, labels, prob = click_log(a)
    n_test = a.samples // 10
    train_idx = np.arange(n_test, a.samples)
    test_idx = np.arange(n_test)
    model = WideDeep(a, store=not local_tables)
    step_model = model  # what a training step calls
    dense = model.mlp
    if a.ddp:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        step_model = nn.parallel.DistributedDataParallel(model)
    elif a.dmp:
        from torchrec.distributed.model_parallel import \
            DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv
        dist.init_process_group("gloo", rank=rank, world_size=world)
        step_model = DistributedModelParallel(
            model, env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"))
    elif world > 1:
        import membox.torch as mt
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mt.init()
        dense = nn.parallel.DistributedDataParallel(model.mlp)
        dense.register_comm_hook(None, mt.allreduce_hook)
        model.mlp = dense
    opt = torch.optim.Adam(model.mlp.parameters(), lr=a.dense_lr)
    # Restarted workers go on from the step the nodes hold: the dense part
    # from InMemoryState, the sparse tables as the nodes have them (their
    # pushes since that step stay applied: close, not bit-exact).
    per_epoch = len(train_idx[rank::world]) // a.batch
    first_epoch, skip, mem = 0, 0, None
    if a.in_memory_state and world > 1:
        mem = mt.InMemoryState(model.mlp, opt)
        first_epoch, skip = divmod(mem.restore(), per_epoch)
    sparse_opt = None
    if local_tables and not a.torchrec:  # TorchRec's: in backward
        sparse_opt = torch.optim.Adagrad(
            [p for n, p in model.named_parameters() if not n.startswith("mlp")],
            lr=a.sparse_lr)
    lossf = nn.BCEWithLogitsLoss()
    # Under --dmp a forward is collective (ids go to their table's rank):
    # every rank evaluates the whole test set through the sharded model.
    eval_model = step_model if a.dmp else model

    def evaluate():
        model.eval()
        preds = []
        with torch.no_grad():
            for x, h, ho, y in batches(ids, hist, offsets, hist_len, labels,
                                       test_idx, 4096):
                preds.append(torch.sigmoid(eval_model(x, h, ho)).numpy())
        model.train()
        p = np.clip(np.concatenate(preds), 1e-7, 1 - 1e-7)
        y = labels[test_idx]
        return roc_auc_score(y, p), log_loss(y, p)

    if rank == 0 and a.out and first_epoch and not skip and \
            first_epoch not in recorded_epochs(a.out):
        # The set stopped after epoch first_epoch's last step and before its
        # record: written now from the restored state (its training loss
        # was lost with the worker).
        auc, ll = evaluate()
        with open(a.out, "a") as f:
            f.write(json.dumps({"epoch": first_epoch, "train_loss": None,
                                "test_auc": auc, "test_logloss": ll,
                                "recovered": True}) + "\n")
    history = []
    t_train = 0.0
    seen = 0
    if rank == 0:
        print(f"training {per_epoch} steps per epoch per worker, from "
              f"epoch {first_epoch + 1} step {skip}", flush=True)
    for epoch in range(first_epoch, a.epochs):
        rng = np.random.default_rng(a.seed + 100 + epoch)
        order = rng.permutation(train_idx)
        mine = order[rank::world]
        steps = len(mine) // a.batch  # equal on every worker (DDP)
        begin = skip if epoch == first_epoch else 0  # done before a restart
        mine = mine[begin * a.batch:steps * a.batch]
        data = batches(ids, hist, offsets, hist_len, labels, mine, a.batch)
        ahead = collections.deque()
        t0 = time.perf_counter()
        total = 0.0
        for step in range(begin, steps):
            while len(ahead) <= a.prefetch and (step + len(ahead)) < steps:
                x, h, ho, y = next(data)
                pre = (model.prefetch(x, h) if not local_tables and
                       a.prefetch else (None, None, None))
                ahead.append((x, h, ho, y, pre))
            x, h, ho, y, pre = ahead.popleft()
            loss = lossf(step_model(x, h, ho, pre), y)
            opt.zero_grad()
            if sparse_opt:
                sparse_opt.zero_grad()
            loss.backward()
            opt.step()
            if mem is not None and not mem.auto:
                mem.commit()  # torch 1.x: no optimizer step hooks
            if sparse_opt:
                sparse_opt.step()
            total += float(loss.detach())
            seen += len(y)
        if not local_tables:
            for layer in (model.wide, model.deep, model.hist):
                layer.synchronize()
        if world > 1:
            dist.barrier()
        t_train += time.perf_counter() - t0
        auc, ll = evaluate()
        row = {"epoch": epoch + 1,
               "train_loss": total / max(steps - begin, 1),
               "test_auc": auc, "test_logloss": ll}
        history.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
            # A set restarted from in-memory state may re-run the last
            # steps of an epoch recorded before the failure: not twice.
            if a.out and not (os.environ.get("MEMBOX_RESUMED") and
                             row["epoch"] in recorded_epochs(a.out)):
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    if rank == 0:
        y = labels[test_idx]
        best = roc_auc_score(y, prob[test_idx])
        base = log_loss(y, np.full(len(y), labels[train_idx].mean()))
        print("RESULT " + json.dumps({
            "backend": ("torchrec-dmp" if a.dmp else
                        "torchrec" if a.torchrec else
                        "torch-local" if a.local else
                        "torch-ddp" if a.ddp else "membox"),
            "workers": world, "test_auc": history[-1]["test_auc"],
            "test_logloss": history[-1]["test_logloss"],
            "hidden_model_auc": best, "constant_logloss": base,
            "samples_per_s": seen * world / t_train}), flush=True)


if __name__ == "__main__":
    main()
