#!/usr/bin/python3
"""membox.torch.OverlappedOptimizer in a real DDP model (a Gloo group of one,
and of two processes, a real `membox serve`): stepping each bucket as its
average arrives gives the same parameters as one optimizer.step() after
backward, through membox's hook and through the process group's AllReduce;
its state round-trips; the errors a user sees. Skips (77) without torch."""
import faulthandler
import os
import sys
import tempfile
import unittest

try:
    import torch
    import torch.distributed as dist
except ImportError:
    print("SKIP: needs torch")
    sys.exit(77)

import membox
import membox.torch as mt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_client import Node  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1024),
        torch.nn.ReLU(), torch.nn.Linear(1024, 8))


def ddp(module):
    # Small buckets: several per backward (after DDP's first iteration,
    # which has one), so buckets are stepped apart.
    return torch.nn.parallel.DistributedDataParallel(module,
                                                     bucket_cap_mb=0.1)


def train(model, opt, steps, plain_step, seed=7):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen)
        y = torch.randn(32, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if plain_step:
            opt.step()


def two_rank_worker(rank, world, pg_file, endpoint, secret, out_dir):
    """One of two ranks: each sees its own data, so the averaged gradients
    differ from either rank's own. Writes its parameters after the
    reference (plain DDP + Adam.step() after backward) and after
    OverlappedOptimizer with membox's hook and with Gloo's AllReduce."""
    # Every thread's Python stack if the process aborts. A CI run once saw
    # a rank end with SIGABRT, "terminate called without an active
    # exception": a step thread that had just completed DDP's future (torch
    # releases the GIL to wake its waiters) asked the finalizing
    # interpreter for the GIL. The step threads now end at Python's exit
    # (membox.torch.overlapped._stop_at_exit).
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + pg_file,
                            rank=rank, world_size=world)
    mt.init(mode="average", client=membox.connect(
        [endpoint], secret, rank, world, timeout=20.0))

    def run(make_opt, plain_step):
        model = ddp(mlp())
        opt = make_opt(model)
        train(model, opt, 5, plain_step, seed=100 + rank)  # rank's own data
        return [p.detach().clone() for p in model.parameters()], opt

    got = {}
    got["reference"], _ = run(
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), True)
    for name, hook in (("membox", None), ("allreduce", "allreduce")):
        got[name], opt = run(
            lambda m: mt.OverlappedOptimizer(m, torch.optim.Adam, lr=1e-2,
                                             hook=hook), False)
        got[name + "_buckets"] = opt.buckets_stepped
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


class TwoRankTest(unittest.TestCase):
    """World size 2: the averaged, not a rank's own, gradients are stepped,
    and both ranks end with the reference's parameters."""

    def test_two_ranks_step_the_average_like_one_step_after_backward(self):
        import torch.multiprocessing as tmp_mp
        tmp = tempfile.mkdtemp()
        node = Node(tmp)
        try:
            tmp_mp.spawn(two_rank_worker,
                         args=(2, os.path.join(tmp, "pg2"), node.endpoint,
                               node.secret, tmp),
                         nprocs=2, join=True)
        finally:
            node.kill()
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"))
                 for r in range(2)]
        ref0 = ranks[0]["reference"]
        # The reference itself is rank-independent (DDP averaged) and moved.
        for a, b in zip(ref0, ranks[1]["reference"]):
            self.assertTrue(torch.equal(a, b))
        self.assertFalse(torch.equal(ref0[0], mlp()[0].weight))
        for r in ranks:
            for name in ("membox", "allreduce"):
                self.assertGreaterEqual(r[name + "_buckets"], 1 + 2 * 4)
                for g, w in zip(r[name], ref0):
                    self.assertTrue(torch.allclose(g, w, rtol=1e-5, atol=1e-6),
                                    (name, (g - w).abs().max()))


class OverlappedOptimizerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        dist.init_process_group(
            "gloo", init_method="file://" + os.path.join(cls.tmp, "pg"),
            rank=0, world_size=1)
        cls.node = Node(cls.tmp)
        mt.init(mode="average", client=membox.connect(
            [cls.node.endpoint], cls.node.secret, 0, 1, timeout=10.0))

    @classmethod
    def tearDownClass(cls):
        cls.node.kill()
        dist.destroy_process_group()

    def reference(self, steps=6):
        model = ddp(mlp())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train(model, opt, steps, plain_step=True)
        return [p.detach().clone() for p in model.parameters()]

    def assert_same(self, got, want):
        self.assertEqual(len(got), len(want))
        for g, w in zip(got, want):
            self.assertTrue(torch.allclose(g, w, rtol=1e-5, atol=1e-7),
                            (g - w).abs().max())

    def test_same_parameters_as_one_step_after_backward(self):
        want = self.reference()
        for hook in (None, "allreduce"):  # membox's hook, Gloo's AllReduce
            model = ddp(mlp())
            opt = mt.OverlappedOptimizer(model, torch.optim.Adam, lr=1e-2,
                                         hook=hook)
            train(model, opt, 6, plain_step=False)
            self.assert_same([p.detach() for p in model.parameters()], want)
            # every step stepped its buckets: one in DDP's first
            # iteration, more after its rebuild
            self.assertGreaterEqual(opt.buckets_stepped, 1 + 2 * 5)
            # the parameters moved: not a run that stepped nothing
            self.assertFalse(torch.equal(want[0], mlp()[0].weight))

    def test_state_round_trips_and_learning_rate(self):
        want = self.reference(steps=6)
        first = ddp(mlp())
        opt = mt.OverlappedOptimizer(first, torch.optim.Adam, lr=1e-2)
        train(first, opt, 3, plain_step=False)
        state = opt.state_dict()
        # A second model from the first's weights and optimizer state
        # continues where it stopped (same inputs: the generator restarts,
        # so the reference's steps 4-6 see the inputs of steps 1-3 again).
        second = mlp()
        second.load_state_dict(first.module.state_dict())
        second = ddp(second)
        opt2 = mt.OverlappedOptimizer(second, torch.optim.Adam, lr=1e-2)
        opt2.load_state_dict(state)
        train(second, opt2, 3, plain_step=False)
        ref = ddp(mlp())
        ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        train(ref, ropt, 3, plain_step=True)
        train(ref, ropt, 3, plain_step=True)
        self.assert_same([p.detach() for p in second.parameters()],
                         [p.detach() for p in ref.parameters()])
        self.assertEqual(len(want), len(state["per_parameter"]))
        opt2.set_lr(0.5)
        self.assertEqual(opt2.lr, 0.5)
        self.assertTrue(all(g["lr"] == 0.5 for o in opt2.optimizers.values()
                            for g in o.param_groups))

    def test_errors(self):
        with self.assertRaisesRegex(TypeError, "DistributedDataParallel"):
            mt.OverlappedOptimizer(mlp(), torch.optim.SGD, lr=0.1)
        with self.assertRaisesRegex(ValueError, "hook must be"):
            mt.OverlappedOptimizer(ddp(mlp()), torch.optim.SGD, hook="nccl",
                                   lr=0.1)
        with self.assertRaises(ValueError):  # the optimizer's own check
            mt.OverlappedOptimizer(ddp(mlp()), torch.optim.SGD, lr=-1.0)
        opt = mt.OverlappedOptimizer(ddp(mlp()), torch.optim.SGD, lr=0.1)
        with self.assertRaisesRegex(ValueError, "6 parameters"):
            opt.load_state_dict({"per_parameter": [{}]})
        with self.assertRaisesRegex(ValueError, "not an OverlappedOptimizer"):
            opt.load_state_dict([1, 2])

    def test_a_failed_bucket_steps_nothing_and_backward_raises(self):
        def failing(state, bucket):
            fut = torch.futures.Future()
            fut.set_exception(RuntimeError("link down"))
            return fut

        model = ddp(mlp())
        opt = mt.OverlappedOptimizer(model, torch.optim.SGD, lr=0.1,
                                     hook=failing)
        before = [p.detach().clone() for p in model.parameters()]
        with self.assertRaisesRegex(RuntimeError, "link down"):
            model(torch.randn(4, 64)).sum().backward()
        self.assertEqual(opt.buckets_stepped, 0)
        for p, b in zip(model.parameters(), before):
            self.assertTrue(torch.equal(p.detach(), b))


if __name__ == "__main__":
    unittest.main()
