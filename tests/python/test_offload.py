#!/usr/bin/env python3
"""membox.torch.offload against a real `membox serve`: the memory nodes hold
the parameters and run the optimizer, the worker holds a unit only while it
computes. Losses equal local training with torch.optim (SGD with momentum,
Adam, AdamW, Adagrad, weight decay, an LR schedule), with one worker and
with two; gradient accumulation; tied and frozen parameters; the
resident-memory bound; state dicts; and the errors a user sees. Needs torch
2.1 or later (post-accumulate-grad hooks); skips (77) without it.

Tolerance: the nodes apply torch.optim's update formulas in float32, but in
another order of operations than torch's (foreach) kernels, so each step
may differ by a few units in the last place; over the few steps here that
stays below 1e-5 relative (2e-5 for Adagrad, whose tiny eps makes early
steps divide by small numbers)."""
import copy
import multiprocessing as mp
import os
import sys
import tempfile
import unittest

try:
    import torch
except ImportError:
    print("SKIP: needs torch")
    sys.exit(77)
if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
    print("SKIP: needs torch >= 2.1 (have %s)" % torch.__version__)
    sys.exit(77)

import membox
import membox.torch as mt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_client import Node  # noqa: E402

_TORCH_OPT = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam,
              "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad}


def mlp(layers=4, width=32, seed=0):
    torch.manual_seed(seed)
    mods = [torch.nn.Linear(16, width), torch.nn.Tanh()]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    mods.append(torch.nn.Linear(width, 4))
    return torch.nn.Sequential(*mods)


def batches(steps, n=16, seed=3):
    """Inputs and a fixed linear teacher's targets (learnable: the loss
    falls)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=g) / 4
    out = []
    for _ in range(steps):
        x = torch.randn(n, 16, generator=g)
        out.append((x, x @ teacher))
    return out


def linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def train(model, opt, data, sched=None, micro=1):
    losses = []
    for x, y in data:
        if micro == 1:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
        else:
            xs, ys = x.chunk(micro), y.chunk(micro)
            ctx = opt.no_sync() if hasattr(opt, "no_sync") else None
            loss = 0
            for i in range(micro):
                part = torch.nn.functional.mse_loss(model(xs[i]), ys[i])
                if i < micro - 1 and ctx is not None:
                    with opt.no_sync():
                        part.backward()
                else:
                    part.backward()
                loss = loss + part.detach()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses


def offload_worker(rank, world, endpoint, secret, kind, hyper, q):
    torch.set_num_threads(1)
    c = membox.connect([endpoint], secret, rank, world, timeout=20.0)
    model = mlp()
    opt = mt.offload(model, optimizer=kind, client=c, units=linears(model),
                     **hyper)
    data = batches(6, n=32)
    half = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in data]
    train(model, opt, half)
    # numpy: torch's shared-memory tensors would die with this process.
    q.put((rank, {k: v.numpy().copy() for k, v in model.state_dict().items()}))


class OffloadTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.node = Node(self.tmp)
        self.clients = []

    def tearDown(self):
        self.clients.clear()
        self.node.kill()

    def restart(self):
        """A fresh node (one client per rank and node)."""
        self.clients.clear()
        self.node.kill()
        self.node = Node(self.tmp)

    def client(self, rank=0, world=1):
        c = membox.connect([self.node.endpoint], self.node.secret, rank,
                           world, timeout=20.0)
        self.clients.append(c)
        return c

    def reference(self, kind, hyper, data, model_fn=mlp, sched=None,
                  micro=1, frozen=None):
        model = model_fn()
        if frozen:
            frozen(model)
        args = dict(hyper)
        opt = _TORCH_OPT[kind]([p for p in model.parameters()
                                if p.requires_grad], **args)
        s = sched(opt) if sched else None
        losses = train(model, opt, data, s, micro)
        return losses, model.state_dict()

    def offloaded(self, kind, hyper, data, model_fn=mlp, sched=None,
                  micro=1, frozen=None, **kw):
        model = model_fn()
        if frozen:
            frozen(model)
        kw.setdefault("units", linears(model))
        opt = mt.offload(model, optimizer=kind, client=self.client(),
                         **hyper, **kw)
        s = sched(opt) if sched else None
        losses = train(model, opt, data, s, micro)
        return losses, model.state_dict(), opt, model

    def assertClose(self, a, b, rtol):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b),
                                   rtol=rtol, atol=1e-6)

    def assertSameState(self, a, b, rtol=1e-5):
        self.assertEqual(sorted(a), sorted(b))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=1e-6,
                                       msg=k)

    def test_losses_equal_torch_optim(self):
        data = batches(8)
        cases = [
            ("sgd", dict(lr=0.05, momentum=0.9, weight_decay=0.01), 1e-5),
            ("adam", dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.01),
             1e-5),
            ("adamw", dict(lr=0.01, weight_decay=0.1), 1e-5),
            ("adagrad", dict(lr=0.05, weight_decay=0.01), 2e-5),
        ]
        for kind, hyper, rtol in cases:
            with self.subTest(kind):
                self.restart()
                want, want_sd = self.reference(kind, hyper, data)
                got, got_sd, _, _ = self.offloaded(kind, hyper, data)
                self.assertClose(got, want, rtol)
                self.assertSameState(got_sd, want_sd, rtol * 10)
                self.assertLess(got[-1], got[0])

    def test_lr_scheduler_drives_the_nodes(self):
        data = batches(6)
        sched = lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.3)
        want, _ = self.reference("adam", dict(lr=0.02), data, sched=sched)
        got, _, opt, _ = self.offloaded("adam", dict(lr=0.02), data,
                                        sched=sched)
        self.assertClose(got, want, 1e-5)
        # prefetch=None: chosen after the first step from its timings.
        self.assertIn(opt.profiled["prefetch"], (1, 2, 3, 4))
        self.assertEqual(opt.prefetch, opt.profiled["prefetch"])
        self.assertAlmostEqual(opt.param_groups[0]["lr"], 0.02 * 0.3 ** 3)
        opt.set_lr(0.5)
        self.assertEqual(opt.param_groups[0]["lr"], 0.5)

    def test_two_workers_average_like_one_large_batch(self):
        hyper = dict(lr=0.01)
        data = batches(6, n=32)
        _, want = self.reference("adam", hyper, data)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = [ctx.Process(target=offload_worker,
                          args=(r, 2, self.node.endpoint, self.node.secret,
                                "adam", hyper, q)) for r in range(2)]
        for p in ps:
            p.start()
        got = {}
        for _ in ps:
            rank, sd = q.get(timeout=120)
            got[rank] = {k: torch.from_numpy(v) for k, v in sd.items()}
        for p in ps:
            p.join(60)
            self.assertEqual(p.exitcode, 0)
        self.assertSameState(got[0], got[1], 0)
        self.assertSameState(got[0], want, 1e-4)

    def test_gradient_accumulation_in_no_sync(self):
        data = batches(5)
        hyper = dict(lr=0.05, momentum=0.5)
        want, want_sd = self.reference("sgd", hyper, data, micro=2)
        got, got_sd, opt, model = self.offloaded("sgd", hyper, data, micro=2)
        self.assertClose(got, want, 1e-5)
        self.assertSameState(got_sd, want_sd)
        # Outside no_sync, a second backward before step() is refused.
        x, y = data[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        with self.assertRaisesRegex(Exception, "no_sync"):
            torch.nn.functional.mse_loss(model(x), y).backward()

    def test_bfloat16_compute_with_float32_masters(self):
        """compute_dtype=bfloat16: the worker computes in bfloat16, the
        nodes keep and step float32 weights; the losses follow float32
        training within bfloat16's precision (8 bits: 2 % here)."""
        data = batches(6)
        want, _ = self.reference("adam", dict(lr=0.01), data)
        model = mlp()
        opt = mt.offload(model, optimizer="adam", lr=0.01,
                         client=self.client(), units=linears(model),
                         compute_dtype=torch.bfloat16)
        got = train(model, opt, [(x.bfloat16(), y.bfloat16())
                                 for x, y in data])
        self.assertClose(got, want, 2e-2)
        sd = model.state_dict()
        self.assertEqual(sd["0.weight"].dtype, torch.float32)
        with self.assertRaisesRegex(ValueError, "compute_dtype"):
            mt.offload(mlp(), client=opt.client, compute_dtype="int8")

    def test_tied_parameters(self):
        class Tied(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(1)
                self.emb = torch.nn.Embedding(50, 16)
                self.mid = torch.nn.Linear(16, 16)
                self.out = torch.nn.Linear(16, 50, bias=False)
                self.out.weight = self.emb.weight

            def forward(self, ids):
                return self.out(torch.tanh(self.mid(self.emb(ids))))

        g = torch.Generator().manual_seed(5)
        data = [(torch.randint(0, 50, (8,), generator=g),
                 torch.randint(0, 50, (8,), generator=g)) for _ in range(6)]

        def run(model, opt):
            out = []
            for ids, target in data:
                loss = torch.nn.functional.cross_entropy(model(ids), target)
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
            return out

        ref = Tied()
        want = run(ref, torch.optim.Adam(ref.parameters(), lr=0.01))
        model = Tied()
        opt = mt.offload(model, optimizer="adam", lr=0.01,
                         client=self.client(),
                         units=[model.emb, model.mid, model.out])
        got = run(model, opt)
        self.assertClose(got, want, 1e-5)
        sd = model.state_dict()
        self.assertTrue(torch.equal(sd["emb.weight"], sd["out.weight"]))
        self.assertSameState(sd, ref.state_dict())

    def test_frozen_parameters_are_pulled_never_pushed(self):
        data = batches(5)

        def freeze(m):
            for p in linears(m)[0].parameters():
                p.requires_grad_(False)
        before = mlp().state_dict()
        want, want_sd = self.reference("adam", dict(lr=0.01), data,
                                       frozen=freeze)
        got, got_sd, _, _ = self.offloaded("adam", dict(lr=0.01), data,
                                           frozen=freeze)
        self.assertClose(got, want, 1e-5)
        self.assertSameState(got_sd, want_sd)
        self.assertTrue(torch.equal(got_sd["0.weight"], before["0.weight"]))
        self.assertFalse(torch.equal(got_sd["2.weight"], before["2.weight"]))

    def test_worker_holds_at_most_prefetch_plus_one_units(self):
        data = batches(4)
        for prefetch in (0, 1, 2):
            with self.subTest(prefetch=prefetch):
                self.restart()
                model = mlp(layers=8, width=64)
                total = sum(p.numel() * 4 for p in model.parameters())
                opt = mt.offload(model, optimizer="adam", lr=0.01,
                                 client=self.client(), prefetch=prefetch,
                                 units=linears(model))
                after_offload = opt.resident_bytes(detail=True)
                self.assertEqual(after_offload["parameters"], 0)
                self.assertEqual(after_offload["gradients"], 0)
                train(model, opt, data)
                st = opt.stats()
                self.assertLessEqual(st["peak_units"], prefetch + 1)
                self.assertGreaterEqual(st["peak_units"], 1)
                largest = max(n for _, n in st["units"])
                self.assertLessEqual(
                    st["peak_bytes"],
                    opt.resident_bytes(detail=True)["buffers"] +
                    2 * (prefetch + 1) * largest)
                self.assertLess(st["peak_bytes"], 4 * total)
                end = opt.resident_bytes(detail=True)
                self.assertEqual(end["parameters"] + end["gradients"], 0)

    def test_model_state_dict_pulls_and_optimizer_state_round_trips(self):
        data = batches(3)
        got, sd, opt, model = self.offloaded("adamw", dict(lr=0.01), data)
        _, want = self.reference("adamw", dict(lr=0.01), data)
        self.assertSameState(sd, want)
        self.assertEqual(sd["0.weight"].shape, (32, 16))
        s = opt.state_dict()
        self.assertEqual(s["membox"]["optimizer"], "adamw")
        opt.set_lr(0.123)
        opt.load_state_dict(s)
        self.assertEqual(opt.param_groups[0]["lr"], 0.01)
        s["membox"]["optimizer"] = "sgd"
        with self.assertRaisesRegex(ValueError, "sgd"):
            opt.load_state_dict(s)

    def test_optimizer_state_is_gathered_as_torchs(self):
        """opt.state_dict() holds the nodes' moments in torch's layout:
        equal to torch.optim.Adam's own after the same steps."""
        data = batches(4)
        model = mlp()
        ref = torch.optim.Adam(model.parameters(), lr=0.01)
        train(model, ref, data)
        want = ref.state_dict()["state"]
        got_model = mlp()
        opt = mt.offload(got_model, optimizer="adam", lr=0.01,
                         client=self.client(), units=linears(got_model))
        self.assertEqual(opt.state_dict()["state"], {})  # nothing stepped
        train(got_model, opt, data)
        got = opt.state_dict()["state"]
        self.assertEqual(sorted(got), sorted(want))
        for i in want:
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got[i][name], want[i][name],
                                           rtol=1e-4, atol=1e-7,
                                           msg="%d %s" % (i, name))
            self.assertEqual(float(got[i]["step"]), float(want[i]["step"]))

    def test_checkpoint_and_load_continue_exactly(self):
        """model.state_dict() + opt.state_dict() after 3 steps, loaded into
        a fresh model on fresh nodes, continue as if never stopped (SGD
        with momentum: its state is all in the moments)."""
        data = batches(6)
        hyper = dict(lr=0.05, momentum=0.9)
        want, want_sd = self.reference("sgd", hyper, data)
        _, _, opt, model = self.offloaded("sgd", hyper, data[:3])
        msd = {k: v.clone() for k, v in model.state_dict().items()}
        osd = opt.state_dict()
        self.assertEqual(len(osd["state"]), 8)
        self.restart()
        fresh = mlp(seed=9)  # other initial weights: the load must win
        opt2 = mt.offload(fresh, optimizer="sgd", client=self.client(),
                          units=linears(fresh), lr=0.5, momentum=0.9)
        fresh.load_state_dict(msd)
        opt2.load_state_dict(osd)
        self.assertEqual(opt2.param_groups[0]["lr"], 0.05)
        self.assertSameState(fresh.state_dict(), msd, 0)
        got = train(fresh, opt2, data[3:])
        self.assertClose(got, want[3:], 1e-5)
        self.assertSameState(fresh.state_dict(), want_sd)
        # A state whose shapes do not fit is refused before anything moves.
        bad = copy.deepcopy(osd)
        bad["state"][0]["momentum_buffer"] = torch.zeros(3)
        with self.assertRaisesRegex(ValueError, "shape"):
            opt2.load_state_dict(bad)

    def test_bad_input_is_refused_and_changes_nothing(self):
        c = self.client()
        with self.assertRaisesRegex(ValueError, "no parameters"):
            mt.offload(torch.nn.ReLU(), client=c)
        model = mlp()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with self.assertRaisesRegex(ValueError, "unknown optimizer 'lamb'"):
            mt.offload(model, optimizer="lamb", client=c)
        with self.assertRaisesRegex(TypeError, "no hyperparameter momentum"):
            mt.offload(model, optimizer="adam", momentum=0.9, client=c)
        with self.assertRaisesRegex(ValueError, "betas"):
            mt.offload(model, optimizer="adam", betas=(0.9, 1.5), client=c)
        with self.assertRaisesRegex(ValueError, "lr"):
            mt.offload(model, lr=float("nan"), client=c)
        with torch.device("meta"):
            meta = torch.nn.Linear(4, 4)
        with self.assertRaisesRegex(ValueError, "meta device"):
            mt.offload(meta, client=c)
        self.assertSameState(model.state_dict(), before, 0)
        x = torch.randn(2, 16)
        model(x)  # still a working local model
        mt.offload(model, client=c, units=linears(model))
        with self.assertRaisesRegex(membox.MemboxError, "already offloaded"):
            mt.offload(model, client=c)


if __name__ == "__main__":
    unittest.main(verbosity=2)
