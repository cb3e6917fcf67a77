#!/usr/bin/env python3
"""torchft's fault-tolerant DDP over membox (membox.torch.ft.ProcessGroupMembox)
survives a replica kill: a real `membox serve` node, torchft's lighthouse,
two replica groups (one process each, and again two processes each)
training a small model with
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


def _replica(replica, incarnation, lighthouse, q, group_rank=0,
             group_world=1, store_port=0):
    """Rank `group_rank` of a replica group of `group_world` processes
    (rank 0 holds the group's store, on `store_port`): trains to STEPS;
    replica 1's first incarnation kills itself at KILL_AT. Puts (replica,
    group rank, incarnation, participants per step, final weights) or the
    error on q."""
    try:
        from datetime import timedelta

        from torchft import Manager
        from torchft.ddp import DistributedDataParallel
        from torchft.optim import OptimizerWrapper

        from membox.launch import free_port
        from membox.torch.ft import ProcessGroupMembox

        torch.manual_seed(group_rank)  # each local rank its own model
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1))

        def state_dict():
            return {"model": model.state_dict(), "optim": opt.state_dict()}

        def load_state_dict(sd):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

        # The replica group's own store (torchrun's would be its master's).
        store = torch.distributed.TCPStore(
            "localhost", store_port, is_master=group_rank == 0,
            wait_for_workers=False, timeout=timedelta(seconds=60))
        manager = Manager(
            pg=ProcessGroupMembox(timeout=timedelta(seconds=30)),
            min_replica_size=1, load_state_dict=load_state_dict,
            state_dict=state_dict, replica_id="replica_%d" % replica,
            store_addr="localhost", store_port=store.port, rank=group_rank,
            world_size=group_world, lighthouse_addr=lighthouse, port=free_port(),
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
            g = torch.Generator().manual_seed(step * 100 + replica * 10 +
                                              group_rank)
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
            loss.backward()
            opt.step()
            participants.setdefault(step, []).append(
                manager.num_participants())
            time.sleep(0.15)  # room for the other replica to come back
        weights = [p.detach().tolist() for p in model.parameters()]
        manager.shutdown(wait=False)
        q.put((replica, group_rank, incarnation, "ok",
               (participants, weights)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        q.put((replica, group_rank, incarnation, "error",
               "%s\n%s" % (e, traceback.format_exc())))


class TorchftTest(unittest.TestCase):
    def _survive_a_replica_kill(self, group_world):
        """Two replica groups of `group_world` processes each; every
        process of replica 1 kills itself at KILL_AT and is started again.
        Returns {(replica, group rank): (participants per step, weights)}
        and the node's completed rounds."""
        from torchft.coordination import LighthouseServer

        from membox.launch import free_port
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
            port = free_port()  # the replica group's store
            started = []
            for g in range(group_world):
                p = ctx.Process(target=_replica, args=(
                    replica, incarnation, lighthouse.address(), q, g,
                    group_world, port))
                p.start()
                procs.append(p)
                started.append(p)
            return started

        results = {}
        try:
            start(0, 0)
            victims = start(1, 0)
            for victim in victims:
                victim.join(timeout=240)
                self.assertEqual(victim.exitcode, -signal.SIGKILL,
                                 "replica 1 should have killed itself")
            time.sleep(1.0)  # the survivor trains alone meanwhile
            start(1, 1)
            for _ in range(2 * group_world):
                replica, g, inc, status, out = q.get(timeout=300)
                self.assertEqual(status, "ok", "replica %d rank %d: %s" %
                                 (replica, g, out))
                results[(replica, g)] = out
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            lighthouse.shutdown()
            rounds = proxy_stats(node.server, os.path.join(tmp, "secret"))[
                "rounds_completed"]
            node.kill()
        for g in range(group_world):
            survivor, rejoined = results[(0, g)], results[(1, g)]
            self.assertEqual(sorted(survivor[0]), list(range(STEPS)),
                             "the survivor ran every step")
            # A step that failed (the kill) is tried again: the last try
            # counts.
            counts = [survivor[0][s][-1] for s in range(STEPS)]
            self.assertIn(1, counts, "alone after the kill: %s" % counts)
            self.assertEqual(counts[KILL_AT - 1], 2, counts)
            self.assertEqual(counts[-1], 2, "together again: %s" % counts)
            self.assertEqual(survivor[1], rejoined[1],
                             "rank %d: the replicas' weights differ" % g)
        return results, rounds

    def test_a_bad_group_rank_is_refused_before_anything_starts(self):
        from membox.torch.ft import ProcessGroupMembox
        pg = ProcessGroupMembox()
        with self.assertRaisesRegex(ValueError, "group rank 2 of 2"):
            pg.configure("localhost:1/x", "r0", 0, 2, group_rank=2,
                         group_world_size=2)

    def test_a_replica_kill_is_survived(self):
        results, rounds = self._survive_a_replica_kill(1)
        self.assertGreater(rounds, 0, "no round ran on the memory node")
        print("PASS: torchft DDP over membox survived a replica kill "
              "(participants per step: %s; %d rounds on the node)" %
              (results[(0, 0)][0], rounds))

    def test_replica_groups_of_two_ranks_survive_a_replica_kill(self):
        # One process group per local rank, each of the quorum's replicas:
        # one job of 4 ranks on the node, whose local ranks' averages are
        # separate (each rank's model is its own).
        results, _ = self._survive_a_replica_kill(2)
        self.assertNotEqual(results[(0, 0)][1], results[(0, 1)][1],
                            "the two local ranks' models should differ")
        print("PASS: torchft replica groups of two ranks over membox "
              "survived a replica kill (participants per step: %s)" %
              results[(0, 1)][0])


if __name__ == "__main__":
    unittest.main()
