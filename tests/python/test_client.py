#!/usr/bin/python3
"""The Python API against a real `membox serve` (MEMBOX_BIN): sums, zero-copy
buffers, the parameter server with SGD on the node, and the errors a user
sees -- wrong secret, wrong buffer size, a memory node that dies."""
import os
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:  # a venv without torch (tests/install/pip_install_test.sh)
    HAVE_TORCH = False

import membox

MEMBOX = os.environ.get("MEMBOX_BIN", "membox")


class Node:
    def __init__(self, tmp, extra=()):
        self.secret = "python-test-secret-0123456789abcdefghij"
        path = os.path.join(tmp, "secret")
        # membox serve refuses a secret file others may read.
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(self.secret + "\n")
        self.p = subprocess.Popen(
            [MEMBOX, "--log-level", "warn", "serve", "--listen", "127.0.0.1:0",
             "--pool-size", "16MiB", "--secret-file", path,
             "--exit-with-parent", *extra], stdout=subprocess.PIPE, text=True)
        self.endpoint = None
        self.server = None  # the memory node's own endpoint (membox status)
        for line in self.p.stdout:
            if line.startswith("membox serve: listening on "):
                self.server = line.split()[-1]
            if line.startswith("membox serve: parameter proxy on "):
                self.endpoint = line.split()[-1]
                break
        assert self.endpoint, "membox serve did not start"

    def kill(self):
        self.p.kill()
        self.p.wait()


def proxy_stats(server, secret_file):
    """The stats of the parameter proxy of the memory node at `server`
    (`membox status --services`), as a dict of ints where they are ints."""
    out = subprocess.run(
        [MEMBOX, "status", "--server", server, "--services", "--secret-file",
         secret_file], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise AssertionError("membox status: %s" % out.stderr)
    stats = {}
    for line in out.stdout.split("-- parameter proxy")[1].splitlines()[1:]:
        parts = line.split(None, 1)
        if len(parts) == 2:
            stats[parts[0]] = int(parts[1]) if parts[1].isdigit() else parts[1]
    return stats


class ClientTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.node = Node(self.tmp)

    def tearDown(self):
        self.node.kill()

    def client(self, rank=0, world=1, secret=None):
        return membox.connect([self.node.endpoint], secret or self.node.secret,
                              rank, world, timeout=10.0)

    def test_push_pull_sums_and_zero_copy(self):
        a, b = self.client(0, 2), self.client(1, 2)
        for c in (a, b):
            c.declare(1, 4000)
        x = np.ones(1000, np.float32)
        y = a.allocate(4000).view(np.float32)   # registered memory
        y[:] = 2.0
        hx = a.push_pull(1, x, x)
        hy = b.push_pull(1, y, y)
        hx.wait(10)
        hy.wait(10)
        self.assertTrue(np.all(x == 3.0))
        self.assertTrue(np.all(y == 3.0))
        self.assertEqual(hy.version, 1)
        seen = []
        h = a.pull(1, x)
        h.add_done_callback(seen.append)
        h.wait()
        time.sleep(0.1)
        self.assertEqual(seen, [None])

    def test_small_keys_are_combined_in_the_nodes_memory(self):
        # From round 1 on, a small key is summed by the workers in a region
        # of the node's memory (docs/design/ps.md); the Python API sees the
        # same sums, versions, pulls and callbacks (what the node keeps once
        # the job is over: ps_test's SmallKeysAreCombinedInTheNodesMemory).
        a, b = self.client(0, 2), self.client(1, 2)
        for c in (a, b):
            c.declare(5, 4096)
        seen = []
        for r in range(6):
            x = np.full(1024, float(r), np.float32)
            y = np.full(1024, float(10 * r), np.float32)
            ox, oy = np.zeros_like(x), np.zeros_like(y)
            hx = a.push_pull(5, x, ox)
            hx.add_done_callback(seen.append)
            hy = b.push_pull(5, y, oy)
            hx.wait(10)
            hy.wait(10)
            self.assertTrue(np.all(ox == 11.0 * r), (r, ox[:3]))
            self.assertTrue(np.all(oy == 11.0 * r), (r, oy[:3]))
            self.assertEqual(hx.version, r + 1)
        pulled = np.zeros(1024, np.float32)
        a.pull(5, pulled).wait(10)
        self.assertTrue(np.all(pulled == 55.0))
        deadline = time.time() + 5
        while len(seen) < 6 and time.time() < deadline:
            time.sleep(0.01)
        self.assertEqual(seen, [None] * 6)
        # The node ran round 0 only; the other five never reached it.
        status = a.proxy_status()
        self.assertIn("\nrounds_completed 1\n", status, status)

    def test_registered_buffers_are_pushed_in_place(self):
        a, b = self.client(0, 2), self.client(1, 2)
        for c in (a, b):
            c.declare(5, 4096)
        x = np.full(1024, 1.0, np.float32)
        y = np.full(1024, 2.0, np.float32)
        a.register_tensor(x)
        a.register_tensor(x)            # again: already reachable
        b.register_tensor(y[:1024])
        ha, hb = a.push_pull(5, x, x), b.push_pull(5, y, y)
        ha.wait(10)
        hb.wait(10)
        self.assertTrue((x == 3).all() and (y == 3).all())
        b.unregister_tensor(y)
        with self.assertRaises(membox.MemboxError):
            b.unregister_tensor(y)      # NOT_FOUND
        # Memory freed and reused by a bigger buffer: the old registration
        # it overlaps is dropped, the new one serves the next round.
        b.register_tensor(y[256:])
        b.register_tensor(y)
        with self.assertRaises(membox.MemboxError):
            b.unregister_tensor(y[256:])  # dropped
        b.register_tensor(y[:512])      # inside: accepted as is
        ha, hb = a.push_pull(5, x, x), b.push_pull(5, y, y)
        ha.wait(10)
        hb.wait(10)
        self.assertTrue((x == 6).all() and (y == 6).all())
        with self.assertRaises(ValueError):
            b.register_tensor(np.ones(4, np.float32)[::2])  # not contiguous

    @unittest.skipUnless(HAVE_TORCH, "needs torch")
    def test_torch_tensors_are_shared_not_copied(self):
        import torch
        a = self.client()
        a.declare(5, 16)
        t = torch.tensor([1.0, 2.0, 3.0, 4.0])
        a.push_pull(5, t, t).wait(10)   # one worker: the sum is itself
        self.assertEqual(t.tolist(), [1.0, 2.0, 3.0, 4.0])
        out = torch.zeros(4)
        a.pull(5, out).wait(10)
        self.assertEqual(out.tolist(), [1.0, 2.0, 3.0, 4.0])
        with self.assertRaises(ValueError):
            a.push(5, torch.zeros(4, 2)[:, 0])  # not contiguous

    @unittest.skipUnless(HAVE_TORCH, "needs torch")
    def test_parameter_server_runs_sgd_on_the_node(self):
        import torch
        import membox.torch as mt
        c = self.client()
        w = torch.nn.Parameter(torch.ones(10))
        ps = mt.ParameterServer([w], mode="sum", optimizer="sgd", lr=0.5,
                                client=c)
        w.grad = torch.full((10,), 2.0)
        ps.step()
        self.assertTrue(torch.allclose(w.data, torch.zeros(10)))

    @unittest.skipUnless(HAVE_TORCH, "needs torch")
    def test_init_takes_the_rank_from_the_group_and_is_idempotent(self):
        # mp.spawn and Lightning pass rank= to init_process_group and set no
        # RANK; Lightning calls init() again for validate and test.
        import torch.distributed as dist
        import membox.torch as mt
        env = {k: os.environ.get(k) for k in
               ("RANK", "WORLD_SIZE", "MEMBOX_PROXIES", "MEMBOX_SECRET")}
        os.environ.update(RANK="1", WORLD_SIZE="2",
                          MEMBOX_PROXIES=self.node.endpoint,
                          MEMBOX_SECRET=self.node.secret)
        dist.init_process_group(
            "gloo", init_method="file://" + os.path.join(self.tmp, "pg"),
            rank=0, world_size=1)
        try:
            c = mt.init(mode="sum", profile=False)
            self.assertIs(mt.init(mode="sum", profile=False), c)
            c.declare(9, 8)
            x = np.ones(2, np.float32)
            c.push_pull(9, x, x).wait(10)  # world 1: its own round
            np.testing.assert_array_equal(x, np.ones(2, np.float32))
        finally:
            dist.destroy_process_group()
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            mt._session.session.reset()

    def test_a_key_is_read_as_of_a_round(self):
        # pull_at: what a restarted worker set recomputes a step from.
        c = self.client()
        init = np.ones(10, np.float32)
        c.declare(1, 40, "float32", init, optimizer="sgd", lr=0.5)
        c.push(1, np.full(10, 2.0, np.float32)).wait(10)
        out = np.zeros(10, np.float32)
        c.pull_at(1, 0, out).wait(10)  # one step back: before it
        np.testing.assert_array_equal(out, init)
        c.pull_at(1, 1, out).wait(10)  # the current round
        np.testing.assert_array_equal(out, np.zeros(10, np.float32))
        with self.assertRaisesRegex(membox.MemboxError, "as of version 3"):
            c.pull_at(1, 3, out).wait(10)
        with self.assertRaisesRegex(ValueError, "pull_at"):
            c.pull_state(1, "previous", out)
        c.declare(2, 40)  # no optimizer: no state, no previous value
        with self.assertRaisesRegex(membox.MemboxError, "no optimizer"):
            c.pull_at(2, 0, out).wait(10)

    def test_errors_are_exceptions_with_the_message(self):
        with self.assertRaisesRegex(membox.MemboxError, "wrong secret"):
            self.client(secret="not-the-secret")
        c = self.client()
        c.declare(1, 40)
        with self.assertRaisesRegex(ValueError, "declared with 40"):
            c.push(1, np.zeros(5, np.float32))
        with self.assertRaisesRegex(membox.MemboxError, "not declared"):
            c.push(2, np.zeros(10, np.float32))
        with self.assertRaises(ValueError):
            c.declare(3, 40, dtype="int8")
        self.node.kill()
        with self.assertRaises(membox.ProxyUnavailable) as e:
            for _ in range(50):
                c.push_pull(1, np.zeros(10, np.float32),
                            np.zeros(10, np.float32)).wait(10)
                time.sleep(0.1)
        self.assertIn(self.node.endpoint, str(e.exception))


class StatusWaitTest(unittest.TestCase):
    """`membox status --wait`: a script that starts nodes waits for them."""

    def test_waits_for_a_node_that_starts_later(self):
        tmp = tempfile.mkdtemp()
        secret = os.path.join(tmp, "secret")
        with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("status-wait-secret-0123456789abcdefghij\n")
        # Ports below the ephemeral range (launch.free_port): one bound to 0
        # and released may be taken by an outgoing connection before the
        # node binds it (a CI run failed so).
        from membox.launch import free_port
        port = free_port()
        status = subprocess.Popen(
            [MEMBOX, "status", "--wait", "--timeout", "60", "--server",
             "127.0.0.1:%d" % port, "--secret-file", secret],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        self.assertIsNone(status.poll(), "status did not wait")
        node = subprocess.Popen(
            [MEMBOX, "--log-level", "warn", "serve", "--listen",
             "127.0.0.1:%d" % port, "--ps-listen",
             "127.0.0.1:%d" % free_port(), "--emb-listen",
             "127.0.0.1:%d" % free_port(), "--pool-size", "16MiB",
             "--secret-file", secret, "--exit-with-parent"],
            stdout=subprocess.DEVNULL)
        try:
            out, err = status.communicate(timeout=60)
            self.assertEqual(status.returncode, 0, err)
            self.assertIn("pool_bytes 16777216", out)
        finally:
            node.kill()
            node.wait()
        # Nobody there: exit 1 after the timeout, naming the node.
        t0 = time.time()
        p = subprocess.run(
            [MEMBOX, "status", "--wait", "--timeout", "1", "--server",
             "127.0.0.1:%d" % port, "--secret-file", secret],
            capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 1)
        self.assertIn("127.0.0.1:%d" % port, p.stderr)
        self.assertLess(time.time() - t0, 30)


    def test_services_are_the_ones_the_node_runs(self):
        """--services asks the services a node names, wherever they
        listen, and says "none" of one the node does not run."""
        from membox import launch
        tmp = tempfile.mkdtemp()
        secret = os.path.join(tmp, "secret")
        with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("status-services-secret-0123456789abcdefg\n")
        mem, ps = launch.free_port(), launch.free_port()
        for extra, want_proxy in ((["--ps-listen", "off"], None),
                                  (["--ps-listen", "127.0.0.1:%d" % ps],
                                   "127.0.0.1:%d" % ps)):
            node = subprocess.Popen(
                [MEMBOX, "--log-level", "warn", "serve", "--listen",
                 "127.0.0.1:%d" % mem, "--pool-size", "16MiB",
                 "--secret-file", secret, "--exit-with-parent"] + extra,
                stdout=subprocess.DEVNULL)
            try:
                p = subprocess.run(
                    [MEMBOX, "status", "--wait", "--services", "--server",
                     "127.0.0.1:%d" % mem, "--secret-file", secret],
                    capture_output=True, text=True, timeout=60)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertNotIn("not answering", p.stdout)
                self.assertIn("-- embedding server: none", p.stdout)
                if want_proxy is None:
                    self.assertIn("-- parameter proxy: none", p.stdout)
                else:  # not the default port (+1): the one it listens on
                    self.assertIn("-- parameter proxy %s --" % want_proxy,
                                  p.stdout)
                    self.assertIn("service parameter_proxy %s" % want_proxy,
                                  p.stdout)
            finally:
                node.kill()
                node.wait()


class SettingsTest(unittest.TestCase):
    """The edges' settings: flags and MEMBOX_* variables (the libraries
    read none)."""

    def test_log_level_flag_and_variable(self):
        bad = subprocess.run([MEMBOX, "--log-level", "loud", "version"],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(bad.returncode, 2)
        self.assertIn("unknown log level 'loud'", bad.stderr)
        env = dict(os.environ, MEMBOX_LOG_LEVEL="loud")
        warned = subprocess.run([MEMBOX, "version"], env=env,
                                capture_output=True, text=True, timeout=30)
        self.assertEqual(warned.returncode, 0)
        self.assertIn("MEMBOX_LOG_LEVEL", warned.stderr)

    def test_secret_rule(self):
        env = {k: v for k, v in os.environ.items()
               if k not in ("MEMBOX_SECRET", "MEMBOX_SECRET_FILE")}
        code = ("import membox._core as c, sys; "
                "print(c.resolve_secret(*sys.argv[1:3]))")
        def resolve(*args, **extra):
            return subprocess.run([sys.executable, "-c", code, *args],
                                  env=dict(env, **extra), capture_output=True,
                                  text=True, timeout=60)
        self.assertEqual(resolve("given ", "").stdout.strip(), "given")
        self.assertEqual(resolve("", "", MEMBOX_SECRET="env\r").stdout.strip(),
                         "env")
        none = resolve("", "")
        self.assertNotEqual(none.returncode, 0)
        self.assertIn("MEMBOX_SECRET_FILE", none.stderr)


@unittest.skipUnless(HAVE_TORCH, "needs torch")
class ParameterServerTest(unittest.TestCase):
    """Two workers (threads of this process) and one node: rank 0's weights
    win, a torch LR scheduler drives the nodes' learning rate, and a plain
    averaged tensor (what the DDP hook declares) lives in the same job."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.node = Node(self.tmp)

    def tearDown(self):
        self.node.kill()

    def both(self, fn):
        """fn(rank) on two threads at once (synchronous rounds need both)."""
        import threading
        out, errors = [None, None], []

        def run(r):
            try:
                out[r] = fn(r)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        ts = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
        for t in ts:
            t.start()
            time.sleep(0.2)  # rank 1 declares first
        for t in ts:
            t.join(60)
        if errors:
            raise errors[0]
        return out

    def test_rank0_weights_lr_schedule_and_plain_tensors_in_one_job(self):
        import torch
        import membox.torch as mt
        clients = [membox.connect([self.node.endpoint], self.node.secret, r,
                                  2, timeout=20.0) for r in (0, 1)]
        for c in clients:
            c.configure(mode="average")  # what membox.torch.init() does
        weights = [torch.nn.Parameter(torch.full((1024,), 10.0 + r))
                   for r in (0, 1)]
        servers = self.both(lambda r: mt.ParameterServer(
            [weights[r]], optimizer="sgd", lr=0.5, client=clients[r]))
        # Rank 0's initial weights on both, though rank 1 declared first.
        for w in weights:
            self.assertTrue(torch.equal(w.data, torch.full((1024,), 10.0)))
        scheds = [torch.optim.lr_scheduler.StepLR(ps.optimizer, 1, 0.5)
                  for ps in servers]
        # A tensor without an optimizer in the same job: averaged.
        for c in clients:
            c.declare(7, 4096)
        expect = 10.0
        for step in range(3):
            lr = 0.5 * 0.5 ** step
            self.assertAlmostEqual(servers[0].lr, lr)

            def one(r):
                weights[r].grad = torch.full((1024,), 1.0 + 2 * r)  # avg 2
                servers[r].step()
                out = np.zeros(1024, np.float32)
                clients[r].push_pull(7, np.full(1024, 2.0 * r, np.float32),
                                     out).wait(20)
                return out
            outs = self.both(one)
            expect -= lr * 2.0
            for w in weights:
                self.assertTrue(torch.allclose(
                    w.data, torch.full((1024,), expect)), (step, w[:3]))
            for o in outs:
                self.assertTrue(np.all(o == 1.0))
            for sc in scheds:
                sc.step()
        # Workers that disagree on the rate for one step are refused.
        servers[0].set_lr(0.01)
        with self.assertRaisesRegex(membox.MemboxError, "disagree"):
            servers[1].set_lr(0.02)


@unittest.skipUnless(HAVE_TORCH, "needs torch")
class HalfPrecisionTest(unittest.TestCase):
    """float16 / bfloat16 gradients through the hook, and float32 buckets
    sent as bfloat16 / float16 (init(wire_dtype=...))."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def hook(self, t, wire, extra=()):
        import membox.torch as mt
        from membox.torch._session import session
        node = Node(self.tmp, extra)
        try:
            c = membox.connect([node.endpoint], node.secret, 0, 1,
                               timeout=10.0)
            mt.init(mode="average", client=c, wire_dtype=wire)
            return [mt.allreduce_hook(None, Bucket(t.clone(), 0)).wait()
                    for _ in range(2)][-1]
        finally:
            session.reset()  # forget the client and its wire type
            node.kill()

    def test_half_buckets_and_narrow_wire(self):
        import torch
        ints = torch.arange(-128, 128, dtype=torch.float32).repeat(16)
        for dtype in (torch.float16, torch.bfloat16):
            out = self.hook(ints.to(dtype), None)
            self.assertEqual(out.dtype, dtype)
            self.assertTrue(torch.equal(out.float(), ints))
        for wire in ("bfloat16", "float16"):
            for extra in ((), ("--transports", "tcp")):
                out = self.hook(ints, wire, extra)
                self.assertEqual(out.dtype, torch.float32)
                self.assertTrue(torch.equal(out, ints), (wire, extra))
        # Values the wire type cannot hold come back rounded to it.
        x = torch.full((4096,), 1.0 + 2 ** -10)
        self.assertTrue(torch.equal(self.hook(x, "bfloat16"),
                                    torch.ones(4096)))
        with self.assertRaisesRegex(ValueError, "wire_dtype"):
            import membox.torch as mt
            mt.init(wire_dtype="int8", client=object())


class Bucket:  # what DDP hands a comm hook
    def __init__(self, t, index):
        self.t, self.i = t, index

    def buffer(self):
        return self.t

    def index(self):
        return self.i

    def is_last(self):
        return True


@unittest.skipUnless(HAVE_TORCH, "needs torch")
class HookTest(unittest.TestCase):
    """The DDP hook's data path: staged through mapped memory when the node
    maps it (one host), DDP's bucket registered in place otherwise."""

    def run_hook(self, extra, refused=(), offset=0):
        import torch
        import membox.torch as mt
        from membox.torch._session import session
        tmp = tempfile.mkdtemp()
        node = Node(tmp, extra)
        try:
            c = membox.connect([node.endpoint], node.secret, 0, 1,
                               timeout=10.0)
            mt.init(mode="average", client=c)  # a fresh session
            session.share_refused[:] = list(refused)
            # `offset`: the bucket starts inside its storage (and inside a
            # page of the shared file)
            t = torch.zeros(4096 + offset)[offset:]
            outs = []
            for i in range(3):
                t.copy_(torch.arange(4096.0) * (i + 1))
                out = mt.allreduce_hook(None, Bucket(t, 0)).wait()
                self.assertTrue(torch.equal(out, torch.arange(4096.0) * (i + 1)))
                outs.append(out.data_ptr())
            return c.proxies_map_memory, dict(session.buckets), t, outs
        finally:
            session.reset()
            node.kill()

    def test_one_host_maps_the_bucket_in_place(self):
        for offset in (0, 77):
            mapped, buckets, t, outs = self.run_hook((), offset=offset)
            self.assertTrue(mapped)
            # The bucket moved into a shared-memory file the node maps: it
            # reads the gradients there and writes the average back, so the
            # Future's result is the bucket itself, every round.
            self.assertTrue(t.is_shared())
            self.assertEqual(buckets[0][0], t.data_ptr())
            self.assertEqual(set(outs), {t.data_ptr()})

    def test_one_host_stages_where_the_bucket_cannot_be_shared(self):
        mapped, buckets, t, outs = self.run_hook(
            (), refused=["the nodes cannot map it"])
        self.assertTrue(mapped)
        self.assertFalse(t.is_shared())
        self.assertEqual(buckets, {})

    def test_a_bucket_too_big_for_dev_shm_is_staged(self):
        from membox.torch import ddp
        room = ddp._shm_has_room
        ddp._shm_has_room = lambda nbytes: False  # a container's 64 MiB
        try:
            mapped, buckets, t, outs = self.run_hook(())
        finally:
            ddp._shm_has_room = room
        self.assertFalse(t.is_shared())
        self.assertEqual(buckets, {})
        self.assertNotEqual(outs[0], t.data_ptr())  # the result buffer
        self.assertTrue(ddp._shm_has_room(1 << 20))  # this machine has room
        # The average arrives in one registered buffer per bucket, which is
        # the Future's result (DDP copies the gradients out of it).
        self.assertNotEqual(outs[0], t.data_ptr())
        self.assertEqual(len(set(outs)), 1)

    def test_tcp_node_reads_the_bucket_in_place(self):
        mapped, buckets, t, outs = self.run_hook(("--transports", "tcp"))
        self.assertFalse(mapped)
        self.assertEqual(buckets[0][0], t.data_ptr())  # registered once
        self.assertEqual(set(outs), {t.data_ptr()})


class ExitTest(unittest.TestCase):
    """A worker that leaves while completion callbacks are still due must
    exit 0 (issue seen as 'terminate called without an active exception',
    exit -6, after training had finished)."""

    SCRIPT = r"""
import sys, time
import numpy as np
import membox
c = membox.connect([sys.argv[1]], sys.argv[2], 0, 1, timeout=10.0)
c.configure(mode="sum")
bufs = []
for k in range(1, 9):
    c.declare(k, 1 << 16)
for i in range(400):
    x = np.ones(1 << 14, np.float32)
    bufs.append(x)
    h = c.push_pull(1 + i % 8, x, x)
    h.add_done_callback(lambda err: time.sleep(0.0005))
# leave with callbacks still queued
"""

    def test_exit_with_callbacks_in_flight(self):
        tmp = tempfile.mkdtemp()
        node = Node(tmp)
        try:
            for run in range(12):
                p = subprocess.run(
                    [sys.executable, "-c", self.SCRIPT, node.endpoint,
                     node.secret], capture_output=True, text=True,
                    timeout=60)
                self.assertEqual(p.returncode, 0,
                                 f"run {run}: exit {p.returncode}\n"
                                 f"{p.stderr[-2000:]}")
                self.assertNotIn("terminate called", p.stderr)
        finally:
            node.kill()


class LaunchPortTest(unittest.TestCase):
    def test_ports_are_below_the_ephemeral_range_and_free(self):
        from membox import launch
        lo, _ = launch._ephemeral_range()
        for _ in range(50):
            port = launch.free_port()
            self.assertLess(port, lo)  # never handed to outgoing connections
            self.assertGreaterEqual(port, 10000)
            import socket
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))  # still free

    def test_a_port_is_handed_out_once(self):
        # The nodes bind their ports later: two picks before either binds
        # must differ (two nodes of one launch once got the same one).
        from membox import launch
        ports = [launch.free_port() for _ in range(2000)]
        self.assertEqual(len(set(ports)), len(ports))

    def test_a_node_whose_port_was_taken_starts_on_another(self):
        # The launcher picks its nodes' ports before they bind them; another
        # process on the host may bind one first. It then starts the nodes
        # again on other ports instead of ending the job.
        import contextlib
        import io
        import socket
        import membox.launch as launch
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        real = launch.free_port
        given = []

        def first_taken():  # node 0's parameter proxy port
            given.append(1)
            return port if len(given) == 1 else real()

        out = io.StringIO()
        launch.free_port = first_taken
        try:
            with contextlib.redirect_stdout(out):
                rc = launch.main([
                    "--nodes", "2", "--workers", "1", "--membox", MEMBOX,
                    "--", sys.executable, "-c",
                    "import os; print('PROXIES', os.environ['MEMBOX_PROXIES'])"])
        finally:
            launch.free_port = real
            taken.close()
        self.assertEqual(rc, 0, out.getvalue()[-3000:])
        self.assertIn("a port it was given was taken meanwhile", out.getvalue())
        self.assertIn("PROXIES 127.0.0.1:", out.getvalue())
        proxies = [line for line in out.getvalue().splitlines()
                   if "PROXIES " in line][0].split("PROXIES ")[1]
        self.assertNotIn("127.0.0.1:%d" % port, proxies.split(","))


if __name__ == "__main__":
    unittest.main()
