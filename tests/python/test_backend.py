#!/usr/bin/env python3
"""membox as a torch.distributed backend against real `membox serve` nodes:
init_process_group("membox") with rank and world from the call (as mp.spawn
scripts do) over tcp:// and file:// init, and under `membox launch`
(env://); every collective's result against what it must be, for the
dtypes and reduce ops torch allows; point to point; the object
collectives; DDP on the backend against DDP on Gloo; and the errors a user
sees. Needs torch 2.x (Python backends); skips (77) without it."""
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from datetime import timedelta

try:
    import torch
    import torch.distributed as dist
except ImportError:
    print("SKIP: needs torch")
    sys.exit(77)

import membox
import membox.torch as mt

if mt.MemboxBackend is None:
    print("SKIP: torch %s has no Python backends" % torch.__version__)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_client import MEMBOX, Node, proxy_stats  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


# ------------------------------------------------------------ rank programs
class _Group:
    """torch.distributed's calls on `group` (None: the default group), with
    roots and peers given as ranks in the group."""

    _PEER = ("send", "recv", "isend", "irecv")

    def __init__(self, group):
        self.group = group

    def __getattr__(self, name):
        fn = getattr(dist, name)
        if self.group is None or name[:1].isupper():
            return fn

        def call(*args, **kw):
            def glob(r):
                return dist.get_global_rank(self.group, r)
            for k in ("src", "dst"):
                if k in kw:
                    kw[k] = glob(kw[k])
            if name in self._PEER:
                args = (args[0], glob(args[1])) + args[2:]
            return fn(*args, group=self.group, **kw)
        return call


def _collectives(rank, world, group=None):
    """Every collective on `group` (None: the default group; `rank` and
    `world` are the group's), checked here; returns what it checked."""
    done = []
    d = _Group(group)

    def check(name, got, want):
        if not torch.equal(got, want):
            raise AssertionError("%s on rank %d: %s, want %s" %
                                 (name, rank, got.tolist(), want.tolist()))
        done.append(name)

    ranks = torch.arange(world)
    for dtype in (torch.float32, torch.float64, torch.bfloat16,
                  torch.float16, torch.int64, torch.int32):
        for op, want in (("SUM", (ranks + 1).sum()),
                         ("MIN", (ranks + 1).min()),
                         ("MAX", (ranks + 1).max()),
                         ("PRODUCT", (ranks + 1).prod())):
            t = torch.full((7,), rank + 1, dtype=dtype)
            d.all_reduce(t, op=getattr(d.ReduceOp, op))
            check("all_reduce %s %s" % (op, dtype), t,
                  torch.full((7,), int(want), dtype=dtype))
    t = torch.full((5,), float(rank))
    d.all_reduce(t, op=d.ReduceOp.AVG)
    check("all_reduce AVG", t, torch.full((5,), (world - 1) / 2))
    t = torch.full((3,), rank, dtype=torch.uint8)
    d.all_reduce(t, op=d.ReduceOp.BOR)
    want = 0
    for q in range(world):
        want |= q
    check("all_reduce BOR", t, torch.full((3,), want, dtype=torch.uint8))
    # Non-contiguous, and a large tensor striped over the nodes.
    m = torch.arange(12.0).view(3, 4) * (rank + 1)
    col = m[:, 1]
    d.all_reduce(col)
    check("all_reduce strided", col, torch.tensor([1.0, 5.0, 9.0]) *
          (world * (world + 1) / 2))
    # Large float32 sums and averages are split between the workers' ring
    # and the nodes (the test forces the split on one host); the share
    # moves between calls, and every call is exact.
    for i in range(4):
        big = torch.full((3 << 20,), float(rank + 1 + i))
        big[-1] = rank * 2 ** 20
        d.all_reduce(big)
        check("all_reduce 12 MiB", big[::65537],
              torch.full_like(big[::65537], world * (world + 1) / 2 + world * i))
        check("all_reduce 12 MiB last", big[-1:],
              torch.tensor([world * (world - 1) / 2 * 2 ** 20]))
        big = torch.arange((1 << 20) + 5, dtype=torch.float32) * (rank + 1)
        d.all_reduce(big, op=d.ReduceOp.AVG)
        check("all_reduce AVG 4 MiB", big[::4099],
              torch.arange((1 << 20) + 5, dtype=torch.float32)[::4099] *
              ((world + 1) / 2))
    # Coalesced.
    ts = [torch.full((n,), float(rank + 1)) for n in (1, 100, 1000)]
    d.all_reduce_coalesced(ts)
    for t in ts:
        check("all_reduce_coalesced", t,
              torch.full_like(t, world * (world + 1) / 2))
    # broadcast, from every root.
    for root in range(world):
        t = torch.arange(6, dtype=torch.int64) * (rank + 1)
        d.broadcast(t, src=root)
        check("broadcast from %d" % root, t,
              torch.arange(6, dtype=torch.int64) * (root + 1))
    # all_gather, into a list and into one tensor.
    outs = [torch.empty(3) for _ in range(world)]
    d.all_gather(outs, torch.full((3,), float(rank)))
    check("all_gather", torch.stack(outs),
          torch.arange(world, dtype=torch.float32)[:, None].expand(world, 3))
    out = torch.empty(world * 2, dtype=torch.int32)
    d.all_gather_into_tensor(out, torch.full((2,), rank,
                                                dtype=torch.int32))
    check("all_gather_into_tensor", out,
          torch.arange(world, dtype=torch.int32).repeat_interleave(2))
    # Large all_gathers (1 MiB or more in all) go over the workers' own
    # ring in a group of the whole job (the direct path), through the nodes
    # in a subgroup: odd sizes, several dtypes, into a list and into one
    # tensor, chunks larger than a ring piece included.
    for dtype, n in ((torch.float32, (1 << 18) + 3), (torch.int64, 70001),
                     (torch.uint8, (40 << 20) + 1)):
        mine = (torch.arange(n) % 251 + rank).to(dtype)
        want = torch.cat([(torch.arange(n) % 251 + q).to(dtype)
                          for q in range(world)])
        out = torch.empty(n * world, dtype=dtype)
        d.all_gather_into_tensor(out, mine)
        check("all_gather_into_tensor large %s" % dtype, out, want)
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
        d.all_gather(outs, mine)
        check("all_gather large %s" % dtype, torch.cat(outs), want)
        bn = n if n < (8 << 20) else (3 << 20) + 1  # 3 MiB of uint8
        for root in range(world):  # large broadcasts: down the ring too
            t = (torch.arange(bn) % 241 + root * (rank + 1)).to(dtype)
            d.broadcast(t, src=root)
            check("broadcast large %s from %d" % (dtype, root), t,
                  (torch.arange(bn) % 241 + root * (root + 1)).to(dtype))
    # Small float broadcast and all_gather move as sum rounds (-0.0 where a
    # rank places nothing): every value arrives bit for bit, -0.0, NaN,
    # infinities and subnormals included.
    def bits(t):
        return t.view({2: torch.int16, 4: torch.int32,
                       8: torch.int64}[t.element_size()])

    for dtype in (torch.float32, torch.float64, torch.bfloat16,
                  torch.float16):
        odd = torch.tensor([-0.0, 0.0, float("nan"), float("inf"),
                            -float("inf"), 1e-40, -3.5, 1.0 + rank],
                           dtype=dtype)
        for root in range(world):
            t = odd.clone() if rank == root else torch.full_like(odd, 7.0)
            d.broadcast(t, src=root)
            want = odd.clone()
            want[-1] = 1.0 + root
            check("broadcast bits %s from %d" % (dtype, root), bits(t),
                  bits(want))
        # Where the nodes are on other hosts, small broadcasts go straight
        # from the root over the workers' mesh: the same bits.
        b = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
        b._remote = True

        def no_round(*args):
            raise AssertionError("a small broadcast took a round on the "
                                 "nodes across hosts")
        b._placed_sum = no_round
        for root in range(world):
            t = odd.clone() if rank == root else torch.full_like(odd, 7.0)
            d.broadcast(t, src=root)
            want = odd.clone()
            want[-1] = 1.0 + root
            check("broadcast over the mesh %s from %d" % (dtype, root),
                  bits(t), bits(want))
        del b._placed_sum
        b._remote = None  # rank 0's view again, from the store
        out = torch.empty(world * odd.numel(), dtype=dtype)
        mine = out[rank * odd.numel():(rank + 1) * odd.numel()]
        mine.copy_(odd)  # FSDP2's way: the input is the output's own chunk
        d.all_gather_into_tensor(out, mine)
        want = torch.cat([torch.cat([odd[:-1],
                                     torch.tensor([1.0 + q], dtype=dtype)])
                          for q in range(world)])
        check("all_gather_into_tensor bits %s" % dtype, bits(out),
              bits(want))
        outs = [torch.empty_like(odd) for _ in range(world)]
        d.all_gather(outs, odd)
        check("all_gather bits %s" % dtype, bits(torch.cat(outs)),
              bits(want))
    m = torch.arange(12.0).view(3, 4) * (rank + 1)
    d.broadcast(m[:, 2], src=0)  # non-contiguous
    check("broadcast strided", m[:, 2], torch.tensor([2.0, 6.0, 10.0]))
    # 640 KiB of output (FSDP2's unit sizes): around the workers' ring
    # where the nodes map the workers' memory (one host), over the mesh
    # where they are on other hosts.
    b = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
    gathers = []
    ring_gather = b._ring_gather
    b._ring_gather = lambda flat, nb: (gathers.append(nb),
                                       ring_gather(flat, nb))[1]
    n = (640 << 10) // 4 // world
    out = torch.empty(world * n)
    d.all_gather_into_tensor(out, torch.arange(n, dtype=torch.float32) + rank)
    check("all_gather_into_tensor 640 KiB", out,
          torch.cat([torch.arange(n, dtype=torch.float32) + q
                     for q in range(world)]))
    del b._ring_gather
    if gathers != ([] if b._nodes_remote() else [n * 4]):
        raise AssertionError("a 640 KiB all_gather took the ring %s times "
                             "with the nodes %s" % (len(gathers), "remote"
                             if b._nodes_remote() else "mapped"))
    # reduce, gather and scatter to and from the last rank.
    root = world - 1
    t = torch.full((4,), float(rank + 1))
    d.reduce(t, dst=root)
    check("reduce", t, torch.full((4,), float(world * (world + 1) / 2))
          if rank == root else torch.full((4,), float(rank + 1)))
    t = torch.full((4,), rank + 1, dtype=torch.int64)
    d.reduce(t, dst=root, op=d.ReduceOp.MAX)
    if rank == root:
        check("reduce MAX", t, torch.full((4,), world, dtype=torch.int64))
    g = [torch.empty(2) for _ in range(world)] if rank == root else None
    d.gather(torch.full((2,), float(rank)), g, dst=root)
    if rank == root:
        check("gather", torch.stack(g),
              torch.arange(world, dtype=torch.float32)[:, None].expand(
                  world, 2))
    s = torch.empty(3)
    d.scatter(s, [torch.full((3,), float(q * 10)) for q in range(world)]
                 if rank == root else None, src=root)
    check("scatter", s, torch.full((3,), float(rank * 10)))
    # reduce_scatter, list and tensor forms, on the nodes and not.
    out = torch.empty(2)
    d.reduce_scatter(out, [torch.full((2,), float(q + rank))
                              for q in range(world)])
    check("reduce_scatter", out,
          torch.full((2,), float(world * rank + world * (world - 1) / 2)))
    out = torch.empty(2, dtype=torch.int64)
    d.reduce_scatter_tensor(
        out, torch.arange(2 * world, dtype=torch.int64) + rank,
        op=d.ReduceOp.MAX)
    check("reduce_scatter_tensor MAX", out,
          torch.arange(2 * rank, 2 * rank + 2, dtype=torch.int64) + world - 1)
    # Large float32 reduce_scatters go around the workers' ring (whole-job
    # group; in a subgroup, the nodes): list and tensor forms, SUM and AVG,
    # the inputs left as they were.
    n = (3 << 17) + 5
    ins = [torch.arange(n, dtype=torch.float32) % 17 + q + rank
           for q in range(world)]
    kept = [t.clone() for t in ins]
    out = torch.empty(n)
    d.reduce_scatter(out, ins)
    check("reduce_scatter large", out, (torch.arange(n) % 17).float() * world +
          world * rank + world * (world - 1) / 2)
    check("reduce_scatter large: inputs kept", torch.cat(ins), torch.cat(kept))
    out = torch.empty(n)
    d.reduce_scatter_tensor(out, torch.cat(ins), op=d.ReduceOp.AVG)
    check("reduce_scatter_tensor large AVG", out,
          (torch.arange(n) % 17).float() + rank + (world - 1) / 2)
    # all_to_all, even and uneven.
    inp = torch.arange(world * 2) + 100 * rank
    o = torch.empty(world * 2, dtype=inp.dtype)
    d.all_to_all_single(o, inp)
    check("all_to_all_single", o, torch.tensor(
        [100 * q + 2 * rank + i for q in range(world) for i in range(2)]))
    # Rank r sends q + 1 elements to rank q.
    send = [q + 1 for q in range(world)]
    recv = [rank + 1] * world
    inp = torch.cat([torch.full((q + 1,), float(rank * 10 + q))
                     for q in range(world)])
    o = torch.empty(sum(recv))
    d.all_to_all_single(o, inp, recv, send)
    check("all_to_all_single uneven", o, torch.cat(
        [torch.full((rank + 1,), float(q * 10 + rank)) for q in range(world)]))
    # A large uneven all_to_all: pairs of up to 8 MiB (two of the mesh's
    # pieces at three ranks), some empty (world 3: rank 1 to rank 2).
    def pair(r, q):
        return (r + q) % 3 * (1 << 19) + (q if q % 2 else 0)
    send = [pair(rank, q) for q in range(world)]
    recv = [pair(q, rank) for q in range(world)]
    inp = torch.cat([torch.arange(send[q], dtype=torch.float64) +
                     1000 * rank + q for q in range(world)])
    o = torch.empty(sum(recv), dtype=torch.float64)
    d.all_to_all_single(o, inp, recv, send)
    check("all_to_all_single large", o, torch.cat(
        [torch.arange(recv[q], dtype=torch.float64) + 1000 * q + rank
         for q in range(world)]))
    outs = [torch.empty(1) for _ in range(world)]
    d.all_to_all(outs, [torch.tensor([float(rank * world + q)])
                           for q in range(world)])
    check("all_to_all", torch.cat(outs), torch.tensor(
        [float(q * world + rank) for q in range(world)]))
    # Point to point around the ring, three times on one pair (the keys
    # alternate), and isend/irecv.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for i in range(3):
        x = torch.empty(4)
        if rank % 2 == 0:
            d.send(torch.full((4,), float(rank * 100 + i)), nxt)
            d.recv(x, prv)
        else:
            d.recv(x, prv)
            d.send(torch.full((4,), float(rank * 100 + i)), nxt)
        check("send/recv %d" % i, x, torch.full((4,), float(prv * 100 + i)))
    x = torch.empty(2, dtype=torch.float64)
    reqs = [d.isend(torch.full((2,), float(rank), dtype=torch.float64),
                       nxt, tag=7),
            d.irecv(x, prv, tag=7)]
    for r in reqs:
        r.wait()
    check("isend/irecv", x, torch.full((2,), float(prv), dtype=torch.float64))
    # A message of several of the direct path's pieces (20 MiB) under tag
    # 1, then a small one under tag 2, received in the other order.
    big = torch.arange(5 << 20, dtype=torch.float32) + rank
    got_big, got_small = torch.empty_like(big), torch.empty(3)
    reqs = [d.isend(big, nxt, tag=1), d.isend(torch.full((3,), rank + 0.5),
                                              nxt, tag=2),
            d.irecv(got_small, prv, tag=2), d.irecv(got_big, prv, tag=1)]
    for r in reqs:
        r.wait()
    check("isend/irecv large, tags reordered", torch.cat([got_small,
                                                          got_big[-3:]]),
          torch.tensor([prv + 0.5] * 3 + [float((5 << 20) - 3 + prv + k)
                                          for k in range(3)]))
    check("isend/irecv large: every element",
          got_big, torch.arange(5 << 20, dtype=torch.float32) + prv)
    # Work objects: async ops, wait, get_future. (torch 2.15 wraps a Python
    # backend's Work in a holder whose is_completed() stays False: only
    # wait() and get_future() reach the backend's own.)
    t = torch.ones(8)
    w = d.all_reduce(t, async_op=True)
    got = w.get_future().wait()
    if not w.wait():
        raise AssertionError("wait() of a done Work said False")
    check("async all_reduce", got[0], torch.full((8,), float(world)))
    # Object collectives.
    objs = [None] * world
    d.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    if objs != [{"rank": q, "s": "x" * q} for q in range(world)]:
        raise AssertionError("all_gather_object: %s" % objs)
    lst = [("from", rank)]
    d.broadcast_object_list(lst, src=1)
    if lst != [("from", 1)]:
        raise AssertionError("broadcast_object_list: %s" % lst)
    got = [None]
    d.scatter_object_list(got, [q * q for q in range(world)]
                             if rank == 0 else None, src=0)
    if got != [rank * rank]:
        raise AssertionError("scatter_object_list: %s" % got)
    done.append("objects")
    d.barrier()
    return done


def _ddp(rank, world):
    """Ten DDP steps of a small MLP, rank-dependent data; final weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model,
                                                    bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(10):
        x = torch.randn(8, 16, generator=g, device="cpu").to(
            torch.get_default_device())
        loss = (ddp(x) - x[:, :4]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().tolist() for p in model.parameters()]


def _ddp_big(rank, world, hook, wire=None, width=1024, layers=1):
    """Six DDP steps (on Gloo) of an MLP whose one bucket is 4.2 MB (width
    1024; 8.4 MB at 2048); with `layers` 3, three such layers in buckets
    of about one layer (DDP makes two: 8.4 and 4.2 MB); with `hook`, membox's DDP hook, whose buckets of 4 MiB and more
    on the wire (`wire`: the hook's wire_dtype) are split between the
    workers' ring and the nodes (forced here on one host). Returns the
    final weights and how many buckets were split."""
    from membox.torch import ddp as mddp
    from membox.torch._session import session
    torch.manual_seed(0)
    big = [torch.nn.Linear(width if i == 0 else 1024, 1024)
           for i in range(layers)]
    model = torch.nn.Sequential(*[m for b in big for m in (b, torch.nn.Tanh())],
                                torch.nn.Linear(1024, 4))
    cap = 25 if layers == 1 else width * 1024 * 4 / 1e6 * 1.01
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    if hook:
        import membox.torch as mt
        mddp._SPLIT_ON_ONE_HOST = True
        mt.init(wire_dtype=wire)
        ddp.register_comm_hook(None, mt.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x = torch.randn(8, width, generator=g)
        loss = (ddp(x) - x[:, :4]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    splits = session.splitter._share._splits if hook and \
        session.splitter is not None else 0
    return [p.detach().tolist() for p in model.parameters()], splits


def _fsdp2(rank, world):
    """Ten FSDP2 (fully_shard) steps of a small MLP, AdamW, rank-dependent
    data: each step's loss summed over the ranks, and the full weights."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 1))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)  # parameters sharded: all_gather, reduce_scatter
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(10):
        x = torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
    weights = [p.full_tensor().detach().tolist() for p in model.parameters()]
    return [losses, weights]


def _direct_paths(group):
    """Which direct paths the group's backend has made (its own ring, mesh
    and point to point)."""
    b = group._get_backend(torch.device("cpu"))
    return sorted(kind[1:] for kind in ("_ring", "_mesh", "_pairs")
                  if getattr(b, kind, None) is not None)


def _subgroups(rank, world):
    """Three ranks: every collective on a subgroup of two whose ranks are
    the job's in another order ([2, 0]), while the third rank uses the
    default group and a subgroup of its own; then every collective on a
    group of the whole job in reverse order. Returns what each checked."""
    pair = dist.new_group([2, 0])  # every rank makes every group (torch)
    other = dist.new_group([1, 2])
    everyone = dist.new_group([2, 1, 0])
    out = {}
    if rank != 1:
        out["pair"] = _collectives(dist.get_rank(pair), 2, pair)
        out["pair paths"] = _direct_paths(pair)
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)  # the default group, between the subgroups' work
    out["world"] = t.tolist()
    if rank != 0:
        t = torch.full((3,), float(rank), dtype=torch.float64)
        dist.all_reduce(t, group=other)
        dist.barrier(group=other)
        out["other"] = t.tolist()
        out["other paths"] = _direct_paths(other)
        dist.destroy_process_group(other)
    out["everyone"] = _collectives(dist.get_rank(everyone), 3, everyone)
    return out


def _errors(rank, world):
    """What a user gets wrong, each a clear error; the group still works."""
    said = {}
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.PREMUL_SUM)
    except Exception as e:  # noqa: BLE001 - the message is the point
        said["premul"] = str(e)
    if rank == 0:
        dist.send(torch.ones(3), 1)
    elif rank == 1:
        try:
            dist.recv(torch.empty(5), 0)
        except Exception as e:  # noqa: BLE001
            said["recv size"] = str(e)
    # A group of every rank is a group of its own on the same connection.
    everyone = dist.new_group(list(range(world)))
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, group=everyone)
    said["everyone"] = t.tolist()
    try:  # the hook on top of the backend
        mt.init()
    except membox.MemboxError as e:
        said["hook"] = str(e)
    # all_to_all sizes that disagree: rank 0 sends rank 1 two elements,
    # rank 1 expects one. Rank 1 names the pair; no rank hangs.
    send = [1] * world
    if rank == 0:
        send[1] = 2
    try:
        dist.all_to_all_single(torch.empty(world), torch.zeros(sum(send)),
                               [1] * world, send)
    except Exception as e:  # noqa: BLE001
        said["all_to_all sizes"] = str(e)
    # monitored_barrier (torch's Gloo semantics): every rank passes one;
    # then only rank 0 comes, and it names every rank that did not.
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    if rank == 0:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=0.5),
                                   wait_all_ranks=True)
        except Exception as e:  # noqa: BLE001
            said["monitored"] = str(e)
    t = torch.ones(2)
    dist.all_reduce(t)
    said["after"] = t.tolist()
    return said


def _reconfigure(rank, world):
    """Three ranks, then torch's reconfigure API: rank 2 leaves, ranks 0
    and 1 reconfigure the default group with their handles in reverse
    order (global rank 1 becomes rank 0) and go on."""
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    out = {"before": t.tolist(), "supports": dist._supports_reconfigure()}
    handles = [None] * world
    dist.all_gather_object(handles, dist._get_reconfigure_handle())
    if rank == 2:
        return out  # leaves the job (its connection closes)
    dist._reconfigure(uuid=42, handles=[handles[1], handles[0]]).wait()
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    out["after"] = t.tolist()
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=0)  # the new rank 0: global rank 1
    out["broadcast"] = b.tolist()
    dist.barrier()
    return out


def _node_stats(server, secret_file):
    """(keys, stored bytes) of the parameter proxy of the node at `server`."""
    stats = proxy_stats(server, secret_file)
    return stats["keys"], stats["stored_bytes"]


def _broadcast_tree(rank, world):
    """Broadcasts below the ring's threshold as where the nodes are on
    other hosts: small ones flat over the mesh, from 32 KiB down a binomial
    tree of mesh exchanges when there are 4 ranks or more; never a round on
    the nodes. Every root, odd sizes, several dtypes."""
    b = dist.group.WORLD._get_backend(torch.device("cpu"))
    b._remote = True
    made = []  # (kind, options) of the direct paths made
    connect = b._connect_direct
    b._connect_direct = lambda kind, make, max_bytes, **o: (
        made.append((kind, o)), connect(kind, make, max_bytes, **o))[1]
    trees = []

    def no_round(*args):
        raise AssertionError("a broadcast took a round on the nodes")
    b._placed_sum = no_round
    tree = b._tree
    b._tree = lambda buf, root: (trees.append(buf.numel()), tree(buf, root))
    sizes = ((torch.float32, 5), (torch.float32, 8192),
             (torch.bfloat16, 40001), (torch.uint8, 100003),
             (torch.int64, 37501))
    for dtype, n in sizes:
        for root in range(world):
            want = (torch.arange(n) % 251 + 3 * root).to(dtype)
            t = want.clone() if rank == root else torch.zeros(n, dtype=dtype)
            dist.broadcast(t, src=root)
            if not torch.equal(t, want):
                raise AssertionError("broadcast of %d %s from %d on rank %d"
                                     % (n, dtype, root, rank))
    # float32 sums from 16 KiB below the split's 4 MiB go around the
    # workers' ring alone; smaller ones stay rounds on the nodes.
    rounds = []
    b._rounds = lambda *args: rounds.append(args[0]) or no_round()
    for n, op in ((4096, dist.ReduceOp.SUM), (100003, dist.ReduceOp.SUM),
                  (50000, dist.ReduceOp.AVG)):
        t = torch.arange(n, dtype=torch.float32) % 97 * (rank + 1)
        dist.all_reduce(t, op=op)
        want = torch.arange(n, dtype=torch.float32) % 97 * \
            (world * (world + 1) / 2)
        if op == dist.ReduceOp.AVG:
            want /= world
        if not torch.equal(t, want):
            raise AssertionError("all_reduce of %d on rank %d" % (n, rank))
    del b._rounds
    # Large ones across hosts go around the ring in segments of 1 MiB
    # forwarded as they arrive (a pipelined pass): a split sum, an
    # all_gather and a reduce_scatter whose ring chunks hold 2-3 segments.
    n = 4 << 20  # 16 MiB of float32: split between the ring and the nodes
    t = torch.arange(n, dtype=torch.float32) % 89 * (rank + 1)
    dist.all_reduce(t)
    if not torch.equal(t, torch.arange(n, dtype=torch.float32) % 89 *
                       (world * (world + 1) / 2)):
        raise AssertionError("split all_reduce on rank %d" % rank)
    # 16-bit tensors too, summed in their type around the ring (small
    # integers: exact in bfloat16 and float16): an 8 MiB split sum, a
    # ring-alone sum, a ring-alone average.
    ring_dtypes = []
    ring = b._ring_allreduce
    b._ring_allreduce = lambda flat: (ring_dtypes.append(flat.dtype),
                                      ring(flat))[1]
    for dtype, n, op in ((torch.bfloat16, 4 << 20, dist.ReduceOp.SUM),
                         (torch.float16, 100003, dist.ReduceOp.SUM),
                         (torch.bfloat16, 50001, dist.ReduceOp.AVG)):
        t = (torch.arange(n) % 5 * (rank + 1)).to(dtype)
        dist.all_reduce(t, op=op)
        want = torch.arange(n) % 5 * (world * (world + 1) / 2)
        if op == dist.ReduceOp.AVG:
            want = want / world
        if not torch.equal(t, want.to(dtype)):
            raise AssertionError("all_reduce of %d %s on rank %d"
                                 % (n, dtype, rank))
    if ring_dtypes != [torch.bfloat16, torch.float16, torch.bfloat16]:
        raise AssertionError("the ring summed %s" % ring_dtypes)
    del b._ring_allreduce
    m = 3 << 18  # 3 MiB of float32 per rank
    out = torch.empty(world * m)
    dist.all_gather_into_tensor(out, torch.arange(m, dtype=torch.float32) %
                                83 + rank)
    for q in range(world):
        if not torch.equal(out[q * m:(q + 1) * m],
                           torch.arange(m, dtype=torch.float32) % 83 + q):
            raise AssertionError("all_gather chunk %d on rank %d" % (q, rank))
    part = torch.empty(m)
    dist.reduce_scatter_tensor(part, torch.arange(
        world * m, dtype=torch.float32) % 79 * (rank + 1))
    want = (torch.arange(world * m, dtype=torch.float32) % 79)[
        rank * m:(rank + 1) * m] * (world * (world + 1) / 2)
    if not torch.equal(part, want):
        raise AssertionError("reduce_scatter on rank %d" % rank)
    # bfloat16 (FSDP2's reduce_dtype): summed in its type on the ring.
    h = 1 << 19  # 1 MiB of bfloat16 per rank
    part = torch.empty(h, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(part, (torch.arange(world * h) % 7 * (
        rank + 1)).to(torch.bfloat16))
    want = (torch.arange(world * h) % 7)[rank * h:(rank + 1) * h] * (
        world * (world + 1) / 2)
    if not torch.equal(part, want.to(torch.bfloat16)):
        raise AssertionError("bfloat16 reduce_scatter on rank %d" % rank)
    if ("ring", {"segment_bytes": 1 << 20}) not in made:
        raise AssertionError("the ring across hosts is not pipelined: %s"
                             % made)
    t = torch.ones(1000)  # 4000 bytes: a round on the nodes
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((1000,), float(world))):
        raise AssertionError("small all_reduce on rank %d" % rank)
    return trees


def _held(rank, world):
    """Every collective; then, while every rank is still in the job, what
    the node holds for it (rank 0 asks); then destroy_process_group(), and
    how long until the node holds what it held before the job (the
    baseline) again, with every rank's process still alive (None: not
    within 20 s)."""
    import time
    server = os.environ["MEMBOX_TEST_NODE_SERVER"]
    secret_file = os.environ["MEMBOX_SECRET_FILE"]
    baseline = tuple(int(x) for x in
                     os.environ["MEMBOX_TEST_NODE_BASELINE"].split(","))
    _collectives(rank, world)
    dist.barrier()
    held = _node_stats(server, secret_file) if rank == 0 else None
    dist.barrier()
    dist.destroy_process_group()
    start = time.monotonic()
    while _node_stats(server, secret_file) != baseline:
        if time.monotonic() - start > 20:
            return held, None
        time.sleep(0.05)
    return held, time.monotonic() - start


def _subgroup_held(rank, world):
    """Three ranks, what the node holds (rank 0 asks) as groups come and
    go mid-job, the default group in use throughout: with the default
    group's keys only ("before"); with a subgroup of two in use too; how
    long after the subgroup is destroyed until the node holds "before"
    again (None: not within 20 s); with a group of the whole job in use
    too; and how long after that one is destroyed until it holds "before"
    again. Then the default group's sum."""
    import time
    server = os.environ["MEMBOX_TEST_NODE_SERVER"]
    secret_file = os.environ["MEMBOX_SECRET_FILE"]

    def stats():
        dist.barrier()
        got = _node_stats(server, secret_file) if rank == 0 else None
        dist.barrier()
        return got

    def wait_until(done):
        """Seconds until done(stats) (rank 0; None: not within 20 s), and
        the last stats."""
        got = None
        if rank == 0:
            start = time.monotonic()
            while time.monotonic() - start < 20:
                got = _node_stats(server, secret_file)
                if done(got):
                    return time.monotonic() - start, got
                time.sleep(0.05)
        return None, got

    for _ in range(2):  # the default group's keys, both parities
        t = torch.full((2,), float(rank))
        dist.all_reduce(t)
        dist.barrier()
    out = {"before": stats()}
    pair = dist.new_group([0, 1])
    if rank != 2:
        _collectives(dist.get_rank(pair), 2, pair)
    out["with the subgroup"] = stats()
    if rank != 2:
        dist.destroy_process_group(pair)
    dist.barrier()
    out["subgroup freed after"], out["after the subgroup"] = wait_until(
        lambda s: s == out["before"])
    dist.barrier()
    everyone = dist.new_group([2, 1, 0])
    _collectives(dist.get_rank(everyone), 3, everyone)
    out["with the group"] = stats()
    dist.destroy_process_group(everyone)
    dist.barrier()
    out["group freed after"], out["after the group"] = wait_until(
        lambda s: s == out["before"])
    dist.barrier()
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    return out


def _rank_main(rank, world, init, proxies_on, secret_file, program, q):
    try:
        # A rank the parent finds hung prints every thread's stack.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        os.environ["MEMBOX_SECRET_FILE"] = secret_file
        os.environ.pop("MEMBOX_SECRET", None)
        if rank in proxies_on:
            os.environ["MEMBOX_PROXIES"] = proxies_on[rank]
        else:
            os.environ.pop("MEMBOX_PROXIES", None)
        if "-cuda" in program:  # every tensor the program makes: CUDA
            torch.cuda.set_device(0)
            torch.set_default_device("cuda")
            program = program.replace("-cuda", "")
        backend = "gloo" if program.endswith("-gloo") else "membox"
        import membox.torch.backend as mb
        mb._SPLIT_ON_ONE_HOST = True  # the split's path, on one host too
        extra = {"enable_reconfigure": True} if program == "reconfigure" \
            else {}
        dist.init_process_group(backend, init_method=init, rank=rank,
                                world_size=world, **extra)
        fn = {"collectives": _collectives, "ddp": _ddp, "ddp-gloo": _ddp,
              "fsdp2": _fsdp2, "fsdp2-gloo": _fsdp2,
              "errors": _errors, "subgroups": _subgroups,
              "held": _held, "reconfigure": _reconfigure,
              "broadcast-tree": _broadcast_tree,
              "subgroup-held": _subgroup_held,
              "ddp-split-hook-gloo": lambda r, w: _ddp_big(r, w, True),
              "ddp-big-gloo": lambda r, w: _ddp_big(r, w, False),
              "ddp-split-hook-bf16-gloo": lambda r, w: _ddp_big(
                  r, w, True, "bfloat16", 2048),
              "ddp-split-hook-fp16-gloo": lambda r, w: _ddp_big(
                  r, w, True, "float16", 2048),
              "ddp-wide-gloo": lambda r, w: _ddp_big(r, w, False, None,
                                                     2048),
              "ddp-split-hook-3b-gloo": lambda r, w: _ddp_big(
                  r, w, True, layers=3),
              "ddp-3b-gloo": lambda r, w: _ddp_big(r, w, False, layers=3)
              }[program]
        out = fn(rank, world)
        if program == "collectives" and init.startswith("file") and \
                rank == 0:
            # Rank 1 makes its next group while rank 0's first is still
            # connected: its closing must not end the next one.
            time.sleep(1.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        if program == "collectives" and init.startswith("file"):
            # A second group in the same process, on the same nodes.
            dist.init_process_group("membox", init_method=init + "-again",
                                    rank=rank, world_size=world)
            t = torch.full((3,), float(rank))
            dist.all_reduce(t)
            out.append("second group %s" % t.tolist())
            dist.destroy_process_group()
        q.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        q.put((rank, "error", "%s\n%s" % (e, traceback.format_exc())))


_LIGHTNING = """
import os, torch, lightning as L
import membox.torch  # registers the backend
from lightning.pytorch.strategies import DDPStrategy

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 1)
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(1)
x = torch.randn(256, 8, generator=g)
data = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
trainer = L.Trainer(
    accelerator="cpu", devices=2, max_epochs=2, logger=False,
    strategy=DDPStrategy(process_group_backend=os.environ["BACKEND"]),
    enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False)
model = Model()
trainer.fit(model, data)
if trainer.global_rank == 0:
    print("RESULT", model.layer.weight.detach().view(-1).tolist())
"""


class SplitShareTest(unittest.TestCase):
    def test_the_first_share_balances_equal_links(self):
        # The ring's first share of a split all_reduce, in 16ths: none
        # where the nodes have as many links as the workers (4w4m), the
        # links' balance where they have fewer (0.4 of the tensor on 4w2m).
        from membox.torch.backend import _first_split_share as share
        self.assertEqual(share(4, 4), 0)
        self.assertEqual(share(4, 8), 0)
        self.assertEqual(share(1, 1), 0)
        self.assertEqual(share(4, 2), 6)
        self.assertEqual(share(2, 1), 8)
        self.assertEqual(share(64, 1), 15)

    def test_rank_0_moves_the_share_and_the_others_follow(self):
        # _split.Share: after each split rank 0 sets the share that evens
        # both parts' time per sixteenth -- straight there within two
        # sixteenths, half way beyond, not at all within half a sixteenth
        # -- and publishes it; another rank reads it before its next split.
        from membox.torch._split import Share

        class Store(dict):
            def set(self, k, v):
                self[k] = v.encode()

            def get(self, k):
                return dict.__getitem__(self, k)

            def delete_key(self, k):
                del self[k]
        store = Store()
        zero, one = (Share(store, r, 4, 2, "t") for r in (0, 1))
        self.assertEqual((zero.take(), one.take()), (6, 6))
        zero.measured(6, ring_s=1.0, nodes_s=1.0)  # both parts alike
        self.assertEqual(zero.value, 6)
        self.assertEqual((zero.take(), store["t/1"], one.take()), (6, b"6", 6))
        # The ring's part took longer: 0.2 s per sixteenth against the
        # nodes' 0.1, target 16/3 = 5.3, within two: straight there.
        zero.measured(6, ring_s=6 * 0.2, nodes_s=10 * 0.1)
        self.assertEqual(zero.value, 5)
        self.assertNotIn("t/1", store)  # the measured split's key goes
        self.assertEqual((zero.take(), one.take()), (5, 5))
        # Pipelined: rank 0 takes split 3 before split 2 is measured; it
        # publishes what it cuts by, so the ranks still agree.
        self.assertEqual((zero.take(), one.take()), (5, 5))
        # The nodes took 9 times as long per sixteenth: target 14.4, more
        # than two away: half way (5 + 4.7, rounded).
        zero.measured(5, ring_s=5 * 0.1, nodes_s=11 * 0.9)
        self.assertEqual(zero.value, 10)
        self.assertNotIn("t/2", store)
        self.assertEqual((zero.take(), one.take()), (10, 10))
        zero.measured(5, ring_s=1.0, nodes_s=1.0)  # split 3
        self.assertEqual(sorted(store), ["t/4"])
        self.assertEqual(Share(store, 0, 4, 4, "u").take(), 0)  # 4w4m

        # The finish thread measures a split while the ring thread's take()
        # is publishing the next one: rank 0 still cuts by what it
        # published (it once cut by the newer value; the ranks' tails were
        # then different keys, each waiting for the others).
        class Racing(Store):
            def set(self, k, v):
                super().set(k, v)
                if k == "r/2":
                    zero.measured(6, ring_s=6 * 0.2, nodes_s=10 * 0.1)
        store = Racing()
        zero, one = (Share(store, r, 4, 2, "r") for r in (0, 1))
        for _ in range(2):
            self.assertEqual((zero.take(), one.take()), (6, 6))
        self.assertEqual((zero.take(), one.take()), (6, 6))  # split 2
        self.assertEqual(zero.value, 5)  # measured meanwhile: the next
        self.assertEqual((zero.take(), one.take()), (5, 5))


class BackendTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        cls.nodes = [Node(cls.tmp)]
        cls.secret_file = os.path.join(cls.tmp, "secret")

    @classmethod
    def tearDownClass(cls):
        for n in cls.nodes:
            n.kill()

    def run_ranks_with(self, env, world, program):
        """run_ranks with `env` added to the ranks' environment."""
        os.environ.update(env)  # the spawned ranks inherit it
        try:
            return self.run_ranks(world, program)
        finally:
            for k in env:
                del os.environ[k]

    def run_ranks(self, world, program, init=None, proxies_on=None):
        """Runs `program` in `world` spawned processes (rank and world
        passed to init_process_group, as mp.spawn scripts do); returns
        each rank's result."""
        if init is None:
            # Below the ephemeral range: a port bound to 0 and released
            # could go to an outgoing connection before rank 0's store
            # binds it.
            from membox.launch import free_port
            init = "tcp://127.0.0.1:%d" % free_port()
        if proxies_on is None:  # only rank 0 knows the nodes
            proxies_on = {0: self.nodes[0].endpoint}
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank_main,
                             args=(r, world, init, proxies_on,
                                   self.secret_file, program, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(world):
                try:
                    rank, status, out = q.get(timeout=240)
                except queue.Empty:
                    # Where the ranks that have not answered are stuck.
                    for r, p in enumerate(procs):
                        if r not in results and p.is_alive():
                            os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(2)
                    self.fail("%s: ranks %s did not finish within 240 s "
                              "(their stacks are above)" %
                              (program, sorted(set(range(world)) -
                                               set(results))))
                self.assertEqual(status, "ok", "rank %d: %s" % (rank, out))
                results[rank] = out
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        return [results[r] for r in range(world)]

    def test_collectives_three_ranks_tcp_init(self):
        outs = self.run_ranks(3, "collectives")
        for r, out in enumerate(outs):
            self.assertIn("objects", out)
            self.assertIn("all_to_all_single uneven", out)

    def test_a_finished_jobs_keys_are_freed(self):
        """A long-lived node keeps nothing of a job of the backend once its
        groups are destroyed (every key it declares is the job's scratch,
        and the last group's destruction closes the rank's connection):
        keys and bytes held while the ranks run, and none after
        destroy_process_group(), while the processes are still alive."""
        server = self.nodes[0].server
        before = _node_stats(server, self.secret_file)
        outs = self.run_ranks_with(
            {"MEMBOX_TEST_NODE_SERVER": server,
             "MEMBOX_TEST_NODE_BASELINE": "%d,%d" % before}, 2, "held")
        held = outs[0][0]
        self.assertGreater(held[0], before[0], "the job's keys: %s" % (held,))
        self.assertGreater(held[1], before[1])
        for rank, (_, freed_after) in enumerate(outs):
            self.assertIsNotNone(freed_after, "rank %d: the node still held "
                                 "the job's keys 20 s after "
                                 "destroy_process_group()" % rank)

    def test_a_destroyed_groups_keys_are_freed_mid_job(self):
        """destroy_process_group(group) of a group of the whole job, one
        of several on the rank's connection, or of a subgroup, frees its
        keys on the node while the job goes on (not only when the job
        ends)."""
        outs = self.run_ranks_with(
            {"MEMBOX_TEST_NODE_SERVER": self.nodes[0].server}, 3,
            "subgroup-held")
        got = outs[0]
        # The subgroup's operations go straight between its ranks here (one
        # host): it may hold nothing on the node, and must leave nothing.
        self.assertIsNotNone(got["subgroup freed after"], "the node still "
                             "held the subgroup's keys 20 s after it was "
                             "destroyed: %s" % (got,))
        self.assertGreater(got["with the group"][0], got["before"][0],
                           "the group's keys: %s" % (got,))
        self.assertGreater(got["with the group"][1], got["before"][1])
        self.assertIsNotNone(got["group freed after"], "the node still held "
                             "the group's keys 20 s after it was destroyed: "
                             "%s" % (got,))
        for out in outs:
            self.assertEqual(out["sum"], [3.0, 3.0])

    def test_collectives_two_ranks_file_init(self):
        # Both ranks know the nodes: rank 1 makes its second group without
        # waiting for rank 0 to publish them (_rank_main's sleep).
        ep = self.nodes[0].endpoint
        outs = self.run_ranks(2, "collectives",
                              init="file://" + os.path.join(self.tmp, "rdv"),
                              proxies_on={0: ep, 1: ep})
        self.assertIn("send/recv 2", outs[1])
        for out in outs:
            self.assertEqual(out[-1], "second group %s" % [1.0, 1.0, 1.0])

    def test_broadcast_down_a_tree_across_hosts(self):
        # 4 and 5 ranks (a full tree and one with a missing leaf): from
        # 32 KiB, every rank takes part in a tree step (each step is an
        # exchange of every pair); below, one flat exchange.
        for world in (4, 5):
            outs = self.run_ranks(world, "broadcast-tree")
            big = [n for _, n in ((torch.float32, 8192 * 4),
                                  (torch.bfloat16, 40001 * 2),
                                  (torch.uint8, 100003),
                                  (torch.int64, 37501 * 8))]
            want = [n for n in big for _ in range(world)]
            for out in outs:
                self.assertEqual(out, want)
        # 3 ranks: a flat exchange at every size.
        for out in self.run_ranks(3, "broadcast-tree"):
            self.assertEqual(out, [])

    def test_ddp_matches_gloo(self):
        got = self.run_ranks(2, "ddp")
        want = self.run_ranks(2, "ddp-gloo")
        for g, w in zip(got[0], want[0]):
            # The nodes sum in another order than Gloo's ring: a few units
            # in the last place per step.
            self.assertTrue(torch.allclose(torch.tensor(g), torch.tensor(w),
                                           rtol=1e-5, atol=1e-6))
        self.assertEqual(got[0], got[1])  # the ranks agree exactly

    def check_split_hook(self, program, gloo_program, splits):
        """Three ranks of `program` (the hook, split) against
        `gloo_program`: `splits` buckets split on every rank, the weights
        close to Gloo's (the ring and the nodes sum in other orders) and
        equal on every rank."""
        got = self.run_ranks(3, program)
        want = self.run_ranks(3, gloo_program)
        for r in range(3):
            self.assertEqual(got[r][1], splits)
            for g, w in zip(got[r][0], want[0][0]):
                self.assertTrue(torch.allclose(torch.tensor(g),
                                               torch.tensor(w),
                                               rtol=1e-5, atol=1e-6))
        self.assertEqual(got[0][0], got[1][0])  # the ranks agree exactly
        self.assertEqual(got[0][0], got[2][0])

    def test_ddp_hook_splits_large_buckets_between_ring_and_nodes(self):
        # Three ranks, one node: the links' balance gives the ring 11/16 of
        # each bucket; the first iteration goes through Gloo (DDP rebuilds
        # its buckets after it), the five after it are split.
        self.check_split_hook("ddp-split-hook-gloo", "ddp-big-gloo", 5)

    def test_ddp_hook_pipelines_split_buckets(self):
        # Three 4.2 MB layers in two buckets (8.4 and 4.2 MB once DDP has
        # rebuilt them), both split (5 iterations x 2): the second bucket's
        # head goes around the ring while the first one's tail may still be
        # on the nodes, and each bucket is finished in DDP's order.
        self.check_split_hook("ddp-split-hook-3b-gloo", "ddp-3b-gloo", 10)

    def test_ddp_hook_splits_narrow_wire_buckets(self):
        # The same with a bfloat16 and a float16 wire (an 8.4 MB float32
        # bucket, 4.2 MB on the wire): the head is summed in the wire type
        # around the ring (rounded at each of its two adds, as Gloo's
        # compress hooks are), the tail on the nodes in float32 and rounded
        # once; the average is divided after widening.
        want = self.run_ranks(3, "ddp-wide-gloo")
        for program, tol in (("ddp-split-hook-bf16-gloo", 2e-3),
                             ("ddp-split-hook-fp16-gloo", 3e-4)):
            got = self.run_ranks(3, program)
            for r in range(3):
                self.assertEqual(got[r][1], 5, program)
                for g, w in zip(got[r][0], want[0][0]):
                    # Six SGD steps of lr 0.1 on gradients rounded to 8
                    # (bfloat16) or 11 (float16) significant bits.
                    self.assertTrue(torch.allclose(torch.tensor(g),
                                                   torch.tensor(w),
                                                   rtol=tol, atol=tol),
                                    program)
            self.assertEqual(got[0][0], got[1][0])  # the ranks agree exactly
            self.assertEqual(got[0][0], got[2][0])

    def test_fsdp2_matches_gloo(self):
        got = self.run_ranks(2, "fsdp2")
        want = self.run_ranks(2, "fsdp2-gloo")
        self.assertEqual(got[0], got[1])  # the ranks agree exactly
        # all_gather moves bytes, and two ranks' sums are the same in any
        # order: the same losses and weights as Gloo's, to the last bit.
        self.assertEqual(got[0][0], want[0][0])
        for g, w in zip(got[0][1], want[0][1]):
            self.assertEqual(g, w)

    def test_subgroups(self):
        outs = self.run_ranks(3, "subgroups")
        for rank, out in enumerate(outs):
            self.assertEqual(out["world"], [3.0, 3.0])
            self.assertIn("objects", out["everyone"])
            self.assertIn("all_to_all_single uneven", out["everyone"])
            if rank != 1:
                self.assertIn("objects", out["pair"])
                self.assertIn("send/recv 2", out["pair"])
                # A subgroup's collectives go straight between its workers:
                # its own ring (large gathers, sums), mesh (exchanges,
                # all_to_all) and point to point.
                self.assertEqual(out["pair paths"], ["mesh", "pairs", "ring"])
            if rank != 0:
                self.assertEqual(out["other"], [3.0, 3.0, 3.0])
                self.assertIn("mesh", out["other paths"])

    @unittest.skipUnless(hasattr(dist, "_reconfigure"),
                         "torch without the reconfigure API")
    def test_reconfigure_after_a_rank_leaves(self):
        outs = self.run_ranks(3, "reconfigure")
        for rank, out in enumerate(outs):
            self.assertTrue(out["supports"])
            self.assertEqual(out["before"], [3.0, 3.0])
            if rank < 2:
                self.assertEqual(out["after"], [3.0, 3.0])
                self.assertEqual(out["broadcast"], [1.0, 1.0, 1.0])

    def test_errors_are_clear(self):
        outs = self.run_ranks(3, "errors")
        for rank, out in enumerate(outs):
            self.assertIn("PREMUL_SUM", out["premul"])
            self.assertEqual(out["after"], [3.0, 3.0])
            self.assertEqual(out["everyone"], [3.0, 3.0])
            self.assertIn("without init() and the hook", out["hook"])
        self.assertIn("the send was 12 bytes", outs[1]["recv size"])
        self.assertIn("Ranks 1, 2 failed to pass monitoredBarrier in 500 ms",
                      outs[0]["monitored"])
        self.assertIn("all-to-all sizes disagree: worker 0 sends 8 bytes to "
                      "worker 1, which expects 4",
                      outs[1]["all_to_all sizes"])

    def test_no_memory_nodes_named(self):
        env = {k: v for k, v in os.environ.items()
               if k not in ("MEMBOX_PROXIES",)}
        code = ("import torch.distributed as dist, membox.torch\n"
                "from datetime import timedelta\n"
                "dist.init_process_group('membox', "
                "init_method='file://%s', rank=0, world_size=1, "
                "timeout=timedelta(seconds=2))\n" %
                os.path.join(self.tmp, "lonely"))
        p = subprocess.run([sys.executable, "-c", code], env=dict(
            env, MEMBOX_SECRET_FILE=self.secret_file),
            capture_output=True, text=True, timeout=120)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("Set MEMBOX_PROXIES", p.stderr)

    def test_groups_never_destroyed_end_before_the_interpreter(self):
        # A script that ends without destroy_process_group, while an
        # operation's completion is still running on the group's exchange
        # thread (a callback of its future): membox's exit hook ends that
        # thread before Python finalizes, so it never asks a finalizing
        # interpreter for the GIL (which aborted the process at exit).
        code = ("import atexit, threading\n"
                "def after():  # registered first: runs after membox's\n"
                "    print('LEFT', sorted(t.name for t in threading.enumerate()"
                " if t.name.startswith('membox-')), flush=True)\n"
                "atexit.register(after)\n"
                "import time, torch, torch.distributed as dist\n"
                "import membox.torch\n"
                "dist.init_process_group('membox', init_method='file://%s', "
                "rank=0, world_size=1)\n"
                "t = torch.ones(1024)\n"
                "w = dist.all_reduce(t, async_op=True)\n"
                "fut = w.get_future()\n"
                "fut.then(lambda f: time.sleep(0.5))\n"
                "fut.wait()\n"
                "print('RESULT', t[:2].tolist(), flush=True)\n" %
                os.path.join(self.tmp, "never_destroyed"))
        p = subprocess.run([sys.executable, "-c", code], env=dict(
            os.environ, MEMBOX_PROXIES=self.nodes[0].endpoint,
            MEMBOX_SECRET_FILE=self.secret_file),
            capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr[-3000:])
        self.assertIn("RESULT [1.0, 1.0]", p.stdout)
        self.assertIn("LEFT []", p.stdout)

    def test_lightning_ddp_strategy(self):
        # PyTorch Lightning's own launcher (it starts the second process and
        # passes rank= to init_process_group): the backend name is the one
        # change, and the weights equal Gloo's.
        try:
            import lightning  # noqa: F401
        except ImportError:
            self.skipTest("needs lightning")
        script = os.path.join(self.tmp, "lightning_ddp.py")
        with open(script, "w") as f:
            f.write(_LIGHTNING)
        got = {}
        for backend in ("membox", "gloo"):
            env = dict(os.environ, BACKEND=backend,
                       MEMBOX_PROXIES=self.nodes[0].endpoint,
                       MEMBOX_SECRET_FILE=self.secret_file)
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
                env.pop(k, None)
            p = subprocess.run([sys.executable, script], env=env, cwd=self.tmp,
                               capture_output=True, text=True, timeout=300)
            self.assertEqual(p.returncode, 0, p.stdout[-2000:] +
                             p.stderr[-3000:])
            lines = [l for l in p.stdout.splitlines() if "RESULT" in l]
            self.assertEqual(len(lines), 1, p.stdout[-2000:])
            got[backend] = lines[0].split("RESULT ", 1)[1]
        self.assertEqual(got["membox"], got["gloo"])

    def test_under_membox_launch(self):
        # env:// init under `membox launch`, two nodes (striped rounds).
        code = ("import torch, torch.distributed as dist, membox.torch\n"
                "dist.init_process_group('membox')\n"
                "t = torch.full((1 << 20,), float(dist.get_rank() + 1))\n"
                "dist.all_reduce(t)\n"
                "o = [torch.empty(1) for _ in range(2)]\n"
                "dist.all_gather(o, torch.tensor([float(dist.get_rank())]))\n"
                "print('RESULT', t[0].item(), t[-1].item(), "
                "torch.cat(o).tolist(), dist.get_backend())\n"
                "dist.destroy_process_group()\n")
        p = subprocess.run([MEMBOX, "launch", "--nodes", "2", "--workers", "2",
                            "--", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-2000:])
        lines = [l for l in p.stdout.splitlines() if "RESULT" in l]
        self.assertEqual(len(lines), 2, p.stdout[-2000:])
        for l in lines:
            self.assertTrue(l.endswith("RESULT 3.0 3.0 [0.0, 1.0] membox"), l)
        # The nodes log at warn unless told otherwise.
        self.assertNotIn("parameter proxy 0/2 listening on", p.stdout)

    def test_membox_launch_node_log_level(self):
        p = subprocess.run([MEMBOX, "launch", "--nodes", "2", "--workers", "1",
                            "--node-log-level", "info", "--", sys.executable,
                            "-c", "print('RESULT')"],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-2000:])
        self.assertIn("parameter proxy 0/2 listening on", p.stdout)
        p = subprocess.run([MEMBOX, "launch", "--node-log-level", "loud",
                            "--", sys.executable, "-c", "pass"],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--node-log-level", p.stderr)


if __name__ == "__main__":
    unittest.main()
