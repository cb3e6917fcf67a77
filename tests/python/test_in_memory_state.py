#!/usr/bin/python3
"""membox.torch.InMemoryState against a real `membox serve` (MEMBOX_BIN):
what a restarted worker gets back (weights, buffers, optimizer state, the
hyperparameters a schedule changed, the scheduler's own state), commits
every k steps, a fresh job ignoring what an earlier one left, and the
errors: a different model after a restart, state that does not fit.
A restart is a new client with MEMBOX_RESTART=1, as `membox launch
--max-restarts` starts it."""
import gc
import os
import sys
import tempfile
import time
import unittest

try:
    import torch
except ImportError:
    print("SKIP: needs torch")
    sys.exit(77)

import membox
import membox.torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_client import Node  # noqa: E402


def model(seed, extra=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(),
              torch.nn.Linear(5, 3)]
    if extra:
        layers.append(torch.nn.Linear(3, 3))
    return torch.nn.Sequential(*layers)


def like(m, opt, sched, seed, **kw):
    """A model, optimizer and scheduler of the same kinds, loaded with
    their state (what the job would have gone on with)."""
    m2 = model(seed)
    m2.load_state_dict(m.state_dict())
    opt2 = type(opt)(m2.parameters(), **kw)
    opt2.load_state_dict(opt.state_dict())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    sched2.load_state_dict(sched.state_dict())
    return m2, opt2, sched2


def train(m, opt, state, steps, seed=0, sched=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()
        if state is not None and not state.auto:
            state.commit()  # torch 1.x: at the end of the iteration


def snapshot(m, opt):
    return ({k: v.clone() for k, v in m.state_dict().items()},
            {i: {k: (v.clone() if torch.is_tensor(v) else v)
                 for k, v in s.items()}
             for i, s in enumerate(opt.state.values())},
            [dict((k, v) for k, v in g.items() if k != "params")
             for g in opt.param_groups])


class InMemoryStateTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.node = Node(self.tmp)
        os.environ.pop("MEMBOX_RESTART", None)
        self.c = None

    def tearDown(self):
        os.environ.pop("MEMBOX_RESTART", None)
        self.c = None
        gc.collect()
        self.node.kill()

    def connect(self, restarted, old=None):
        """A worker's client; a restarted one first drops the old one (the
        node allows one connection per rank): the dead worker's state
        object `old` lets go of it."""
        if old is not None:
            old.close()
        self.c = None
        gc.collect()
        if restarted:
            os.environ["MEMBOX_RESTART"] = "1"
        deadline = time.time() + 10
        while True:
            try:
                self.c = membox.connect([self.node.endpoint],
                                        self.node.secret, 0, 1, timeout=10.0)
                self.c.configure(mode="average")
                return self.c
            except membox.MemboxError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)

    def test_restart_gets_weights_optimizer_state_and_schedule(self):
        m = model(1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                              weight_decay=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        state = membox.torch.InMemoryState(m, opt, sched,
                                           client=self.connect(False))
        self.assertEqual(state.restore(), 0)
        train(m, opt, state, 5, sched=sched)
        state.flush()
        want = snapshot(m, opt)
        self.assertAlmostEqual(want[2][0]["lr"], 0.1 * 0.5 ** 2)
        kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)
        m, opt, sched = like(m, opt, sched, 1, **kw)

        m2 = model(2)  # other initial weights: all of them come back
        opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9,
                               weight_decay=1e-3)
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
        state2 = membox.torch.InMemoryState(
            m2, opt2, sched2, client=self.connect(True, old=state))
        self.assertEqual(state2.restore(), 5)
        got = snapshot(m2, opt2)
        for k, v in want[0].items():
            self.assertTrue(torch.equal(v, got[0][k]), k)
        self.assertEqual(len(got[1]), len(want[1]))
        for i, s in want[1].items():
            for k, v in s.items():
                self.assertTrue(torch.equal(v, got[1][i][k]), (i, k))
        self.assertEqual(got[2], want[2])
        self.assertEqual(sched2.state_dict(), sched.state_dict())
        # Training goes on from there exactly as the first job would have.
        train(m, opt, None, 3, seed=7, sched=sched)
        train(m2, opt2, state2, 3, seed=7, sched=sched2)
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(v, m2.state_dict()[k]), k)

    def test_adam_every_k_steps(self):
        m = model(3)
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        state = membox.torch.InMemoryState(m, opt, every=3,
                                           client=self.connect(False))
        state.restore()
        train(m, opt, state, 6)
        at6 = snapshot(m, opt)
        train(m, opt, state, 2)  # steps 7 and 8: not committed
        state.flush()
        m2 = model(4)
        opt2 = torch.optim.Adam(m2.parameters(), lr=0.01)
        state2 = membox.torch.InMemoryState(
            m2, opt2, every=3, client=self.connect(True, old=state))
        self.assertEqual(state2.restore(), 6)
        got = snapshot(m2, opt2)
        for k, v in at6[0].items():
            self.assertTrue(torch.equal(v, got[0][k]), k)
        for i, s in at6[1].items():
            for k, v in s.items():
                if torch.is_tensor(v):
                    self.assertTrue(torch.equal(v, got[1][i][k]), (i, k))
                else:
                    self.assertEqual(v, got[1][i][k], (i, k))

    def test_a_fresh_job_ignores_an_earlier_jobs_state(self):
        m = model(5)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        state = membox.torch.InMemoryState(m, opt, client=self.connect(False))
        state.restore()
        train(m, opt, state, 4)
        state.flush()
        # A new job on the same node starts fresh (and invalidates the old
        # markers): its own restart before its first step finds nothing.
        m2 = model(6)
        opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        fresh = membox.torch.InMemoryState(
            m2, opt2, client=self.connect(False, old=state))
        self.assertEqual(fresh.restore(), 0)
        m3 = model(7)
        opt3 = torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9)
        before = {k: v.clone() for k, v in m3.state_dict().items()}
        again = membox.torch.InMemoryState(
            m3, opt3, client=self.connect(True, old=fresh))
        self.assertEqual(again.restore(), 0)
        for k, v in before.items():
            self.assertTrue(torch.equal(v, m3.state_dict()[k]), k)

    def test_a_different_model_after_a_restart_is_refused(self):
        m = model(8)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        state = membox.torch.InMemoryState(m, opt, client=self.connect(False))
        state.restore()
        train(m, opt, state, 3)
        state.flush()
        m2 = model(8, extra=True)
        opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        state2 = membox.torch.InMemoryState(
            m2, opt2, client=self.connect(True, old=state))
        with self.assertRaisesRegex(membox.MemboxError, "differs|other"):
            state2.restore()

    def test_a_restart_with_another_world_size_is_refused(self):
        m = model(10)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        state = membox.torch.InMemoryState(m, opt, client=self.connect(False))
        state.restore()
        train(m, opt, state, 3)
        state.flush()
        # The same client (world 1) playing rank 0 of a 2-worker restart.
        m2 = model(10)
        opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        state2 = membox.torch.InMemoryState(
            m2, opt2, client=self.connect(True, old=state), rank=0, world=2)
        with self.assertRaisesRegex(membox.MemboxError, "1 workers"):
            state2.restore()

    def test_errors(self):
        m = model(9)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        c = self.connect(False)
        with self.assertRaises(ValueError):
            membox.torch.InMemoryState(m, opt, client=c, every=0)
        with self.assertRaises(ValueError):
            membox.torch.InMemoryState(m, opt, client=c, rank=2, world=2)
        # Hyperparameters travel as JSON: a value that is not refuses.
        opt.param_groups[0]["note"] = object()
        state = membox.torch.InMemoryState(m, opt, client=c)
        state.restore()
        with self.assertRaisesRegex(membox.MemboxError, "JSON"):
            train(m, opt, state, 1)
            state.flush()  # torch 2.x: extras go before the next step


if __name__ == "__main__":
    unittest.main()
