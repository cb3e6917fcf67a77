#!/usr/bin/env python3
"""torchft's fault-tolerant DDP over membox (membox.torch.ft.ProcessGroupMembox)
survives a replica kill: a real `membox serve` node, torchft's lighthouse,
two replica groups (one process each) training a small model with
torchft's Manager, DistributedDataParallel and OptimizerWrapper. Replica 1
is killed (SIGKILL) at step 8; replica 0 goes on alone (the next quorum's
process group is a new membox job of one rank); replica 1 is started
again, recovers the survivor's state through torchft and trains on with it.
Checks: the survivor ran every step with no error reaching the training
loop, it trained alone between the kill and the rejoin and with two
replicas before and after, both replicas end at the last step with the same
weights, and the averages ran on the memory node (its rounds). Needs torch
2.x and torchft (PyPI); skips (77) without them."""
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
import unittest

try:
    import torch
    import torchft  # noqa: F401
except ImportError as e:
    print("SKIP: needs torch and torchft (%s)" % e)
    sys.exit(77)

import membox.torch as mt  # noqa: E402

if mt.MemboxBackend is None:
    print("SKIP: torch %s has no Python backends" % torch.__version__)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_client import Node, proxy_stats  # noqa: E402

STEPS = 24
KILL_AT = 8


def _replica(replica, incarnation, lighthouse, q):
    """One replica group of one process: trains to STEPS; replica 1's first
    incarnation kills itself at KILL_AT. Puts (replica, incarnation,
    participants per step, final weights) or the error on q."""
    try:
        from datetime import timedelta

        from torchft import Manager
        from torchft.ddp import DistributedDataParallel
        from torchft.optim import OptimizerWrapper

        from membox.launch import free_port
        from membox.torch.ft import ProcessGroupMembox

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1))

        def state_dict():
            return {"model": model.state_dict(), "optim": opt.state_dict()}

        def load_state_dict(sd):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

        # The replica group's own store (torchrun's would be its master's).
        store = torch.distributed.TCPStore("localhost", 0, is_master=True,
                                           wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupMembox(timeout=timedelta(seconds=30)),
            min_replica_size=1, load_state_dict=load_state_dict,
            state_dict=state_dict, replica_id="replica_%d" % replica,
            store_addr="localhost", store_port=store.port, rank=0,
            world_size=1, lighthouse_addr=lighthouse, port=free_port(),
            timeout=timedelta(seconds=30),
            quorum_timeout=timedelta(seconds=60))
        ddp = DistributedDataParallel(manager, model)
        opt = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(),
                                                        lr=0.05))
        participants = {}
        while manager.current_step() < STEPS:
            step = manager.current_step()
            if replica == 1 and incarnation == 0 and step == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()  # torchft: the step's quorum (may heal)
            step = manager.current_step()
            g = torch.Generator().manual_seed(step * 10 + replica)
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
            loss.backward()
            opt.step()
            participants.setdefault(step, []).append(
                manager.num_participants())
            time.sleep(0.15)  # room for the other replica to come back
        weights = [p.detach().tolist() for p in model.parameters()]
        manager.shutdown(wait=False)
        q.put((replica, incarnation, "ok", (participants, weights)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        q.put((replica, incarnation, "error",
               "%s\n%s" % (e, traceback.format_exc())))


class TorchftTest(unittest.TestCase):
    def test_a_replica_kill_is_survived(self):
        from torchft.coordination import LighthouseServer
        tmp = tempfile.mkdtemp()
        node = Node(tmp)
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1,
                                      join_timeout_ms=300)
        os.environ["MEMBOX_PROXIES"] = node.endpoint
        os.environ["MEMBOX_SECRET_FILE"] = os.path.join(tmp, "secret")
        os.environ.pop("MEMBOX_SECRET", None)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = []

        def start(replica, incarnation):
            p = ctx.Process(target=_replica, args=(replica, incarnation,
                                                   lighthouse.address(), q))
            p.start()
            procs.append(p)
            return p

        try:
            start(0, 0)
            victim = start(1, 0)
            victim.join(timeout=180)
            self.assertEqual(victim.exitcode, -signal.SIGKILL,
                             "replica 1 should have killed itself")
            time.sleep(1.0)  # the survivor trains alone meanwhile
            start(1, 1)
            results = {}
            for _ in range(2):
                replica, inc, status, out = q.get(timeout=240)
                self.assertEqual(status, "ok", "replica %d: %s" %
                                 (replica, out))
                results[replica] = out
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            lighthouse.shutdown()
            rounds = proxy_stats(node.server, os.path.join(tmp, "secret"))[
                "rounds_completed"]
            node.kill()
        survivor, rejoined = results[0], results[1]
        self.assertEqual(sorted(survivor[0]), list(range(STEPS)),
                         "the survivor ran every step")
        # A step that failed (the kill) is tried again: the last try counts.
        counts = [survivor[0][s][-1] for s in range(STEPS)]
        self.assertIn(1, counts, "alone after the kill: %s" % counts)
        self.assertEqual(counts[KILL_AT - 1], 2, counts)
        self.assertEqual(counts[-1], 2, "together again: %s" % counts)
        self.assertEqual(survivor[1], rejoined[1],
                         "the replicas' weights differ")
        self.assertGreater(rounds, 0, "no round ran on the memory node")
        print("PASS: torchft DDP over membox survived a replica kill "
              "(participants per step: %s; %d rounds on the node)" %
              (survivor[0], rounds))


if __name__ == "__main__":
    unittest.main()
