#!/usr/bin/env python3
"""PyTorch's own backend-agnostic distributed tests
(torch.testing._internal.distributed.distributed_test), driven the way
PyTorch's test/distributed/test_distributed_spawn.py drives them for Gloo,
with BACKEND=membox: one process per rank (WORLD_SIZE, default 2), file://
init, the memory nodes named in MEMBOX_PROXIES (a node must be running:
tests/python/torch_distributed_suite.sh starts one).

membox declares what it implements the way PyTorch's own backends are
declared in DistTestCases: the DDP tests run ("ddp"); send/recv without a
source and subgroups are not implemented, so the tests that need them skip.
Usage (pytest-style filters through unittest's -k):
    torch_distributed_suite.py [-k PATTERN ...]"""
import os
import sys

os.environ.setdefault("BACKEND", "membox")
os.environ.setdefault("WORLD_SIZE", "2")

try:
    import torch  # noqa: F401
    import membox.torch as mt
except ImportError as e:
    print("SKIP: %s" % e)
    sys.exit(77)
if mt.MemboxBackend is None:
    print("SKIP: this torch has no Python backends")
    sys.exit(77)

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

DistTestCases.backend_feature["plugin"].add("membox")
DistTestCases.backend_feature["ddp"].add("membox")
DistTestCases.skip_collective["sendrecv anysource"].add("membox")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest, TestDistBackend)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
