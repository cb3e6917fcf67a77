#!/usr/bin/python3
"""The sparse parameter store from Python against real `membox serve
--emb-dir` processes (MEMBOX_BIN): the EmbeddingClient, the
membox.torch Embedding / EmbeddingBag layers (same training as torch's own
layers), prefetching, the errors a user sees, and the wide & deep example
under `membox launch`."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch
import torch.nn.functional as F

import membox
import membox.torch as mt
from membox.launch import free_port

MEMBOX = os.environ.get("MEMBOX_BIN", "membox")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Node:
    def __init__(self, tmp, i):
        self.secret = "python-embedding-secret-0123456789abcdefghij"
        path = os.path.join(tmp, "secret")
        # membox serve refuses a secret file others may read.
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(self.secret + "\n")
        self.p = subprocess.Popen(
            [MEMBOX, "--log-level", "warn", "serve", "--listen", "127.0.0.1:0",
             "--pool-size", "16MiB", "--secret-file", path, "--ps-listen",
             "off", "--emb-dir", os.path.join(tmp, f"emb{i}"),
             "--exit-with-parent"], stdout=subprocess.PIPE, text=True)
        self.endpoint = None
        for line in self.p.stdout:
            if line.startswith("membox serve: embedding server on "):
                self.endpoint = line.split()[-1]
                break
        assert self.endpoint, "membox serve did not start"

    def kill(self):
        self.p.kill()
        self.p.wait()
        self.p.stdout.close()


class EmbeddingTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.nodes = [Node(self.tmp, i) for i in range(2)]
        self.client = membox.connect_embeddings(
            [n.endpoint for n in self.nodes], self.nodes[0].secret,
            timeout=10.0)

    def tearDown(self):
        # The client first: one left open would go on reconnecting to the
        # dead nodes' ports (for its failover_timeout) after the test.
        self.client.close()
        for n in self.nodes:
            n.kill()

    def test_pull_push_with_duplicates_applies_adagrad(self):
        c = self.client
        t = c.open_table("ids", 4, optimizer="adagrad", lr=0.1, seed=3)
        keys = np.array([7, 8, 7, 2**40 + 1], dtype=np.int64)
        rows = c.pull(t, keys)
        self.assertEqual(rows.shape, (4, 4))
        np.testing.assert_array_equal(rows[0], rows[2])
        self.assertTrue(np.all(np.abs(rows) <= 0.01))
        g = np.ones((4, 4), dtype=np.float32)
        c.push(t, keys, g)
        after = c.pull(t, keys)
        # key 7 appears twice: one Adagrad step with gradient 2.
        want7 = rows[0] - 0.1 * 2 / (np.sqrt(4) + 1e-8)
        np.testing.assert_allclose(after[0], want7, rtol=1e-5)
        want8 = rows[1] - 0.1 * 1 / (np.sqrt(1) + 1e-8)
        np.testing.assert_allclose(after[1], want8, rtol=1e-5)
        self.assertEqual({c.node_of(7), c.node_of(8)}, {0, 1})
        self.assertIn("rows_pushed", c.node_status(1))

    def test_store_layers_train_like_torch_layers(self):
        vocab, dim = 50, 3
        bag = mt.EmbeddingBag("bag", dim, mode="mean", optimizer="sgd",
                              lr=0.5, client=self.client, seed=1)
        emb = mt.Embedding("emb", dim, optimizer="sgd", lr=0.5,
                           client=self.client, seed=2)
        keys = np.arange(vocab, dtype=np.int64)
        ref_bag = torch.nn.EmbeddingBag(vocab, dim, mode="mean")
        ref_emb = torch.nn.Embedding(vocab, dim)
        with torch.no_grad():
            ref_bag.weight.copy_(torch.from_numpy(self.client.pull(bag.table, keys)))
            ref_emb.weight.copy_(torch.from_numpy(self.client.pull(emb.table, keys)))
        opt = torch.optim.SGD(list(ref_bag.parameters()) +
                              list(ref_emb.parameters()), lr=0.5)
        g = torch.Generator().manual_seed(0)
        for step in range(6):
            x = torch.randint(0, vocab, (8, 4), generator=g)
            y = torch.randn(8, generator=g)
            out = bag(x).sum(1) + emb(x[:, 0]).sum(1)
            ref = ref_bag(x).sum(1) + ref_emb(x[:, 0]).sum(1)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            F.mse_loss(out, y).backward()
            bag.synchronize()
            emb.synchronize()
            opt.zero_grad()
            F.mse_loss(ref, y).backward()
            opt.step()
        np.testing.assert_allclose(self.client.pull(bag.table, keys),
                                   ref_bag.weight.detach().numpy(),
                                   rtol=1e-5, atol=1e-6)
        # 1-D ids with offsets, and sum pooling.
        s = mt.EmbeddingBag("bag", dim, mode="mean", optimizer="sgd", lr=0.5,
                            client=self.client, seed=1)
        ids = torch.tensor([1, 2, 3, 4])
        out = s(ids, torch.tensor([0, 1]))
        torch.testing.assert_close(out, ref_bag(ids, torch.tensor([0, 1])),
                                   rtol=1e-5, atol=1e-6)

    def test_prefetch_pins_and_checks_its_batch(self):
        bag = mt.EmbeddingBag("p", 2, mode="sum", client=self.client)
        x = torch.tensor([[1, 2], [3, 4]])
        p1 = bag.prefetch(x)
        p2 = bag.prefetch(x + 10)
        status = self.client.node_status(0) + self.client.node_status(1)
        # keys 1..4 and 11..14: four rows of each node pinned for the two
        # batches
        self.assertEqual(status.count(" pinned 4 "), 2, status)
        with self.assertRaises(ValueError):
            bag(x, prefetched=p2)  # another batch's rows
        bag(x, prefetched=p1).sum().backward()
        bag(x + 10, prefetched=p2).sum().backward()
        bag.synchronize()
        for i in range(2):
            self.assertIn(" pinned 0 ", self.client.node_status(i))
        with self.assertRaises(ValueError):
            bag(x, prefetched=p1)  # used already
        bag.eval()
        with torch.no_grad():
            bag(x)
        for i in range(2):
            self.assertIn(" pinned 0 ", self.client.node_status(i))

    def test_bags_with_offsets_train_like_torch_bags(self):
        # 1-D ids with offsets (an empty bag among them), sum and mean: the
        # same outputs and, after SGD steps, the same rows as torch's bag.
        vocab, dim = 30, 2
        keys = np.arange(vocab, dtype=np.int64)
        for mode in ("sum", "mean"):
            bag = mt.EmbeddingBag("off" + mode, dim, mode=mode,
                                  optimizer="sgd", lr=0.5,
                                  client=self.client, seed=7)
            ref = torch.nn.EmbeddingBag(vocab, dim, mode=mode)
            with torch.no_grad():
                ref.weight.copy_(torch.from_numpy(
                    self.client.pull(bag.table, keys)))
            opt = torch.optim.SGD(ref.parameters(), lr=0.5)
            g = torch.Generator().manual_seed(3)
            for step in range(3):
                ids = torch.randint(0, vocab, (9,), generator=g)
                offsets = torch.tensor([0, 2, 2, 6])  # bag 1 is empty
                w = torch.randn(4, dim, generator=g)
                out = bag(ids, offsets)
                want = ref(ids, offsets)
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
                (out * w).sum().backward()
                bag.synchronize()
                opt.zero_grad()
                (want * w).sum().backward()
                opt.step()
            np.testing.assert_allclose(self.client.pull(bag.table, keys),
                                       ref.weight.detach().numpy(),
                                       rtol=1e-5, atol=1e-6)
            with self.assertRaises(RuntimeError):  # torch's own complaint
                bag(torch.tensor([1, 2]), torch.tensor([1]))

    def test_prefetch_checks_ids_and_uniques_a_shared_tensor_once(self):
        wide = mt.EmbeddingBag("uw", 1, mode="sum", client=self.client)
        deep = mt.Embedding("ud", 2, client=self.client)
        group = mt.EmbeddingGroup(wide, deep)
        x = torch.tensor([[5, 6], [6, 7]])
        pw, pd = group.prefetch(x, x)
        self.assertIs(pw.ids, pd.ids)  # one np.unique for both members
        # An equal tensor that is not the prefetched one is compared.
        out = wide(x.clone(), prefetched=pw).sum() + deep(x, prefetched=pd).sum()
        out.backward()
        group.synchronize()
        # The prefetched tensor written in place is caught, not trusted.
        pw, pd = group.prefetch(x, x)
        x[0, 0] = 99
        with self.assertRaisesRegex(ValueError, "differ from the prefetched"):
            wide(x, prefetched=pw)
        x[0, 0] = 5  # written again, same ids: compared and accepted
        wide.eval()
        deep.eval()
        with torch.no_grad():  # in eval mode a forward releases the pins
            deep(x, prefetched=pd)
            wide(x, prefetched=pw)
        for i in range(2):
            self.assertIn(" pinned 0 ", self.client.node_status(i))
        # numpy ids (no version counter) are compared too.
        ids = np.array([1, 2, 2], dtype=np.int64)
        p = deep.prefetch(ids)
        with self.assertRaises(ValueError):
            deep(np.array([1, 2, 3], dtype=np.int64), prefetched=p)

    def test_group_moves_every_table_in_one_request_per_node(self):
        # The same training through an EmbeddingGroup and through layers
        # on their own gives the same weights; the group's step costs one
        # pull and one push request per node for its three tables.
        def stats():
            out = []
            for i in range(2):
                kv = dict(line.split(" ", 1) for line in
                          self.client.node_status(i).splitlines()
                          if line.startswith(("pulls ", "pushes ")))
                out.append((int(kv["pulls "[:-1]]), int(kv["pushes "[:-1]])))
            return out

        def train(prefix, grouped):
            layers = [mt.EmbeddingBag(prefix + "w", 1, mode="sum",
                                      optimizer="adagrad", lr=0.3,
                                      client=self.client, seed=4),
                      mt.Embedding(prefix + "d", 3, optimizer="adagrad",
                                   lr=0.3, client=self.client, seed=5),
                      mt.EmbeddingBag(prefix + "h", 3, mode="mean",
                                      optimizer="adagrad", lr=0.3,
                                      client=self.client, seed=6)]
            group = mt.EmbeddingGroup(*layers) if grouped else None
            g = torch.Generator().manual_seed(1)
            for step in range(4):
                x = torch.randint(0, 40, (6, 3), generator=g)
                h = torch.randint(0, 40, (6, 5), generator=g)
                y = torch.randn(6, generator=g)
                before = stats()
                pre = (group.prefetch(x, x, h) if grouped else
                       (None, None, None))
                out = (layers[0](x, prefetched=pre[0]).sum(1) +
                       layers[1](x, prefetched=pre[1]).sum((1, 2)) +
                       layers[2](h, prefetched=pre[2]).sum(1))
                F.mse_loss(out, y).backward()
                for layer in layers:
                    layer.synchronize()
                if grouped:
                    after = stats()
                    for (p0, q0), (p1, q1) in zip(before, after):
                        self.assertEqual((p1 - p0, q1 - q0), (1, 1))
            keys = np.arange(40, dtype=np.int64)
            return [self.client.pull(layer.table, keys) for layer in layers]

        for a, b in zip(train("g", True), train("s", False)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        # The pushes that ended the batches reached the pinned rows
        # directly (no second hash lookup on the node).
        for i in range(2):
            through = [int(line.split("pushed_through_pins ")[1])
                       for line in self.client.node_status(i).splitlines()
                       if "pushed_through_pins " in line]
            self.assertTrue(through and max(through) > 0, through)
        for i in range(2):
            self.assertIn(" pinned 0 ", self.client.node_status(i))

        # A member whose output does not reach the loss: the others' push
        # leaves at synchronize(), and its own pins are dropped.
        bags = [mt.EmbeddingBag(n, 2, mode="sum", client=self.client)
                for n in ("ga", "gb")]
        group = mt.EmbeddingGroup(*bags)
        x = torch.tensor([[1, 2], [3, 4]])
        pa, pb = group.prefetch(x, x)
        unused = bags[1](x, prefetched=pb)
        del unused
        bags[0](x, prefetched=pa).sum().backward()
        group.synchronize()
        rows = self.client.pull(bags[0].table, np.array([1], np.int64))
        self.assertFalse(np.allclose(rows, self.client.pull(
            bags[1].table, np.array([1], np.int64))))
        # Pins of the unused member stay until released: release them the
        # way a user would, then nothing is pinned.
        self.client.release(bags[1].table, pb.batch)
        for i in range(2):
            self.assertIn(" pinned 0 ", self.client.node_status(i))
        with self.assertRaises(TypeError):
            mt.EmbeddingGroup(torch.nn.Linear(2, 2))
        with self.assertRaises(ValueError):
            mt.EmbeddingGroup(bags[0], bags[0])
        with self.assertRaises(ValueError):
            group.prefetch(x)  # one input for two layers

    def test_errors(self):
        c = self.client
        t = c.open_table("e", 4)
        with self.assertRaises(ValueError):
            c.push(t, np.array([1], dtype=np.int64), np.ones(3, np.float32))
        with self.assertRaises(membox.MemboxError):
            c.open_table("e", 8)  # exists with dim 4
        with self.assertRaises(membox.MemboxError):
            c.open_table("bad/name", 4)
        with self.assertRaises(ValueError):
            c.pull(99, np.array([1], dtype=np.int64))
        with self.assertRaises(membox.MemboxError):
            membox.connect_embeddings([self.nodes[0].endpoint], "wrong-secret",
                                      timeout=5.0)
        with self.assertRaises(TypeError):
            mt.Embedding("e", 4, client=c)(torch.tensor([0.5]))
        # A node that dies and does not come back: the client waits for it
        # (failover_timeout), then fails naming it.
        quick = membox.connect_embeddings([n.endpoint for n in self.nodes],
                                          self.nodes[0].secret, timeout=10.0,
                                          failover_timeout=1.0)
        tq = quick.open_table("e", 4)
        self.nodes[1].kill()
        with self.assertRaises(membox.ProxyUnavailable) as e:
            quick.pull(tq, np.arange(10, dtype=np.int64))
        self.assertIn(self.nodes[1].endpoint, str(e.exception))
        self.assertIn("did not come back within 1 s", str(e.exception))
        quick.close()
        with self.assertRaisesRegex(ValueError, "closed"):
            quick.pull(tq, np.arange(10, dtype=np.int64))
        quick.close()  # twice: nothing more happens


def _run_ranks(args, ranks=2, tries=2):
    """Runs `python args...` as `ranks` processes with torchrun's
    environment; returns the processes' outputs (each must exit 0). These
    are torch's own baselines (DDP on Gloo): a set in which a rank failed is
    run again once (`tries`), after printing what every rank wrote."""
    for attempt in range(1, tries + 1):
        outs, failed = _run_ranks_once(args, ranks)
        if not failed:
            return outs
        report = "\n".join(f"-- rank {r} exited {code}:\n{outs[r][-3000:]}"
                           for r, code in failed)
        if attempt == tries:
            raise AssertionError(f"{args}: {report}")
        print(f"{args} failed (try {attempt} of {tries}), run again:\n"
              f"{report}", file=sys.stderr, flush=True)


def _run_ranks_once(args, ranks):
    port = free_port()  # below the ephemeral range (see free_port)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable] + args, cwd=ROOT,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(ranks)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return outs, [(r, p.returncode) for r, p in enumerate(procs)
                  if p.returncode != 0]


def _result(out):
    line = [l for l in out.splitlines() if "RESULT " in l][-1]
    return json.loads(line.split("RESULT ", 1)[1])


class WideDeepExampleTest(unittest.TestCase):
    def test_membox_matches_local_torch(self):
        args = ["examples/ctr_wide_deep.py", "--samples", "40000",
                "--vocab", "20000", "--batch", "128"]
        local = subprocess.run([sys.executable] + args + ["--local"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
        self.assertEqual(local.returncode, 0, local.stderr[-2000:])
        run = subprocess.run(
            [MEMBOX, "launch", "--nodes", "2", "--workers", "2", "--",
             sys.executable] + args, cwd=ROOT, capture_output=True, text=True,
            timeout=300)
        self.assertEqual(run.returncode, 0, run.stdout[-3000:])
        ref, got = _result(local.stdout), _result(run.stdout)
        self.assertGreater(ref["test_auc"], 0.6)
        self.assertGreater(got["test_auc"], 0.6)
        self.assertLess(abs(got["test_auc"] - ref["test_auc"]), 0.03)
        self.assertLess(got["test_logloss"], got["constant_logloss"])
        # `membox bench ctr`'s torch-ddp reference: torch's tables in two
        # processes under DDP (torchrun's environment), the same model.
        ddp = _result(_run_ranks(args + ["--ddp"])[0])
        self.assertEqual((ddp["backend"], ddp["workers"]), ("torch-ddp", 2))
        self.assertLess(abs(ddp["test_auc"] - ref["test_auc"]), 0.03)
        # --ddp alone, outside a process group launch: a clear error.
        alone = subprocess.run([sys.executable] + args + ["--ddp"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60,
                               env={k: v for k, v in os.environ.items()
                                    if k not in ("RANK", "WORLD_SIZE")})
        self.assertNotEqual(alone.returncode, 0)
        self.assertIn("--ddp runs under torchrun", alone.stderr)

    def test_torchrec_baseline_matches_local_torch(self):
        # The TorchRec baseline of `membox bench ctr` trains the same model.
        # Needs torchrec and an fbgemm-gpu-cpu built for this torch (none
        # exists for torch 2.15 yet: skipped in CI; run in a venv with
        # torch 2.14, see docs/results/ctr.md).
        try:
            import torchrec  # noqa: F401
            import fbgemm_gpu  # noqa: F401
        except Exception as e:  # ImportError, or OSError on an ABI mismatch
            self.skipTest(f"torchrec unavailable: {type(e).__name__}")
        args = ["examples/ctr_wide_deep.py", "--samples", "40000",
                "--vocab", "20000", "--batch", "128"]
        res = {}
        for flag in ("--local", "--torchrec"):
            p = subprocess.run([sys.executable] + args + [flag], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
            self.assertEqual(p.returncode, 0, p.stderr[-2000:])
            res[flag] = _result(p.stdout)
        self.assertEqual(res["--torchrec"]["backend"], "torchrec")
        self.assertLess(abs(res["--torchrec"]["test_auc"] -
                            res["--local"]["test_auc"]), 0.02)
        # TorchRec's multi-process form (bench ctr's torchrec-dmp): the
        # tables sharded over two ranks by DistributedModelParallel, each
        # rank on its half of the data, like DDP.
        dmp = _result(_run_ranks(args + ["--torchrec", "--dmp"])[0])
        self.assertEqual((dmp["backend"], dmp["workers"]), ("torchrec-dmp", 2))
        self.assertLess(abs(dmp["test_auc"] - res["--local"]["test_auc"]), 0.03)
        # --dmp without --torchrec, or outside a process-group launch.
        for extra, msg in ((["--dmp"], "use it with --torchrec"),
                           (["--torchrec", "--dmp"], "--dmp runs under torchrun")):
            p = subprocess.run([sys.executable] + args + extra, cwd=ROOT,
                               capture_output=True, text=True, timeout=120,
                               env={k: v for k, v in os.environ.items()
                                    if k not in ("RANK", "WORLD_SIZE")})
            self.assertNotEqual(p.returncode, 0)
            self.assertIn(msg, p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
