"""PyTorch integration.

Two lines turn a DDP training script's gradient AllReduce into membox
synchronisation through the memory nodes:

    membox.torch.init()
    model.register_comm_hook(None, membox.torch.allreduce_hook)

Each DDP gradient bucket is pushed to the memory nodes, averaged there (in
the same order every time, so runs are reproducible), and the average is
written back into the bucket; buckets holding the first layers get the
highest priority. Works with torch 1.13 (Debian 12) and uses only APIs that
torch 2.x keeps (GradBucket.buffer()/index(), torch.futures.Future).
OverlappedOptimizer runs the optimizer bucket by bucket as the averages
arrive, so it overlaps the communication of the last buckets.

ParameterServer is the explicit API for custom loops and asynchronous
training: workers push gradients and pull weights, the memory nodes run the
optimizer.

Embedding and EmbeddingBag (sum / mean pooling) are layers whose table
lives in the memory nodes' sparse parameter store (memory + SSD tiers):
forward pulls the rows of the batch's distinct keys, backward pushes their
gradients and the nodes apply the table's optimizer (Adagrad by default) --
the rows never join a torch optimizer. prefetch() pulls a later batch's
rows while this one trains.

Importing this package also registers the torch.distributed backend
"membox" (torch 2.x): `dist.init_process_group("membox")` runs a process
group's collectives through the memory nodes (membox.torch.backend).

The package's modules, one job each: _session (this worker's client and
what it declared), staging (CUDA through page-locked memory), ddp (the
hook), overlapped, ps, checkpoint, state (InMemoryState), embedding and
offload (the model itself in the nodes), backend (the process group). The
public names are all here.
"""
from membox.torch._session import client, init
from membox.torch.checkpoint import load_checkpoint, save_checkpoint
from membox.torch.ddp import allreduce_hook
from membox.torch.embedding import (Embedding, EmbeddingBag, EmbeddingGroup,
                                    Prefetched, embeddings)
from membox.torch.offload import OffloadOptimizer, offload
from membox.torch.overlapped import OverlappedOptimizer
from membox.torch.ps import ParameterServer
from membox.torch.staging import staging_stats
from membox.torch.state import InMemoryState

try:  # torch 2.x: Python classes may be torch.distributed backends
    from torch._C._distributed_c10d import Backend as _Backend  # noqa: F401
    from membox.torch.backend import MemboxBackend, register as _register
    _register()
except ImportError:  # torch 1.13, or a torch without distributed
    MemboxBackend = None

__all__ = [
    "init", "client", "allreduce_hook", "staging_stats",
    "OverlappedOptimizer", "ParameterServer", "save_checkpoint",
    "load_checkpoint", "InMemoryState", "embeddings", "Prefetched",
    "EmbeddingGroup", "Embedding", "EmbeddingBag", "offload",
    "OffloadOptimizer", "MemboxBackend",
]
