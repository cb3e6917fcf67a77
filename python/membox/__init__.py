"""membox: parameter synchronisation through disaggregated memory nodes.

    import membox
    client = membox.connect()            # from MEMBOX_PROXIES, RANK, ...
    client.configure(mode="average")
    client.declare(1, nbytes)
    client.push_pull(1, grads, grads).wait()

    emb = membox.connect_embeddings()    # from MEMBOX_EMBEDDING_NODES
    t = emb.open_table("ids", dim=16, optimizer="adagrad", lr=0.05)
    rows = emb.pull(t, keys)             # float32 (len(keys), 16)
    emb.push(t, keys, grads)             # the nodes apply Adagrad

See membox.torch for the PyTorch DDP hook, the parameter-server API and
the embedding layers, and `membox launch` for starting memory nodes and
workers.
"""
import os

# UCX's malloc hooks would interpose malloc/free for the whole process (the
# user's torch and its allocators included); membox registers its memory
# explicitly and needs none. Set UCX_MEM_MALLOC_HOOKS=yes to have them.
os.environ.setdefault("UCX_MEM_MALLOC_HOOKS", "no")

from membox import _core  # noqa: E402
from membox._core import (EmbeddingClient, Handle, MemboxError, ProxyUnavailable,
                          PullHandle, PushHandle)

__all__ = ["Client", "EmbeddingClient", "Handle", "MemboxError",
           "ProxyUnavailable", "PullHandle", "PushHandle", "connect",
           "connect_embeddings"]


def _buffer(x):
    """numpy arrays and other buffers pass through; torch CPU tensors become
    numpy views of the same memory (no copy)."""
    if x is None or not hasattr(x, "detach"):
        return x
    if x.device.type != "cpu":
        raise MemboxError(f"membox moves CPU tensors (got {x.device})")
    if not x.is_contiguous():
        raise ValueError("membox needs contiguous tensors")
    if str(x.dtype) == "torch.bfloat16":  # numpy has no bfloat16: same bits
        import torch
        return x.detach().view(torch.int16).numpy()
    return x.detach().numpy()


class Client(_core.Client):
    """A worker's connection to the memory nodes (see docs/python.md).
    Accepts numpy arrays, any buffer, and torch CPU tensors (shared, not
    copied)."""

    def declare(self, key, nbytes, dtype="float32", init=None, **optimizer):
        """Declares a tensor (every worker, same size and dtype). init: the
        initial value (rank 0's wins). optimizer="sgd"/"adam"/"none" with
        lr, momentum, beta1, beta2, eps: the tensor's own optimizer on the
        memory nodes (default: configure()'s)."""
        return super().declare(key, nbytes, dtype, _buffer(init), **optimizer)

    def store(self, key, data):
        """Replaces stored key `key` (declare_stored) with `data` (memory
        from allocate() or register_tensor())."""
        return super().store(key, _buffer(data))

    def register_tensor(self, t, fd=-1, file_offset=0):
        """Registers a buffer or CPU tensor you keep alive: pushes and pulls
        on it are then zero copy (unregister_tensor before freeing it).
        With `fd`, the buffer is a shared mapping of that shared-memory file
        at `file_offset` (a torch tensor after share_memory_(): its
        storage's file): memory nodes on this host then map it and read and
        write it with loads and stores."""
        return super().register_tensor(_buffer(t), fd, file_offset)

    def unregister_tensor(self, t):
        return super().unregister_tensor(_buffer(t))

    def push(self, key, data, priority=0):
        return super().push(key, _buffer(data), priority)

    def pull(self, key, out):
        return super().pull(key, _buffer(out))

    def pull_state(self, key, part, out):
        """Part of a key with an optimizer, as the nodes hold it now:
        "moment1" or "moment2"."""
        return super().pull_state(key, part, _buffer(out))

    def pull_at(self, key, version, out):
        """A key with an optimizer as it was after `version` rounds (its
        value, or the one before its last step where a shard is a round
        past it)."""
        return super().pull_at(key, version, _buffer(out))

    def store_state(self, key, part, data):
        """Writes "value", "moment1" or "moment2" of a key with an
        optimizer on the nodes, between its rounds."""
        return super().store_state(key, part, _buffer(data))

    def push_pull(self, key, data, out, priority=0):
        return super().push_pull(key, _buffer(data), _buffer(out), priority)


def _secret():
    # The same rule as membox serve and the C API (membox/base/secret.h):
    # first line, trailing whitespace and CR removed.
    if not os.environ.get("MEMBOX_SECRET") and \
            not os.environ.get("MEMBOX_SECRET_FILE"):
        raise MemboxError("no secret: set MEMBOX_SECRET or MEMBOX_SECRET_FILE "
                          "(membox launch does)")
    return _core.resolve_secret("", "")


def _addresses(given, env, what):
    """`given` (a list of host:port), or the comma-separated list in the
    environment variable `env` that `membox launch` sets; none: an error
    naming the variable."""
    if given is not None:
        return list(given)
    value = os.environ.get(env)
    if not value:
        raise MemboxError(f"no {what}: set {env} (membox launch does)")
    return value.split(",")


def connect(proxies=None, secret=None, rank=None, world=None, name=None,
            timeout=60.0, partition_bytes=4 << 20, rejoin=False, job=""):
    """A Client for this worker. Missing arguments come from the environment
    `membox launch` sets: MEMBOX_PROXIES (comma-separated host:port),
    MEMBOX_SECRET or MEMBOX_SECRET_FILE, RANK, WORLD_SIZE. rejoin: this
    worker set follows one that used the nodes before (restarted, or of
    another size): the hello is retried for up to 45 s while the nodes
    still hold the previous job's connections. job: the job's name, the
    same on every worker of it: a node serving another job's workers
    refuses this one's hello until they have gone (waiting up to 45 s), so
    that a job following another on the same nodes never mixes with it."""
    proxies = _addresses(proxies, "MEMBOX_PROXIES", "memory nodes")
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
    return Client(list(proxies), secret or _secret(), rank, world,
                  name or f"worker-{rank}", timeout, partition_bytes, rejoin,
                  job)


def connect_embeddings(nodes=None, secret=None, name=None, timeout=60.0,
                       partition="modulo", failover_timeout=30.0):
    """An EmbeddingClient for this worker: the sparse parameter store on the
    memory nodes. Missing arguments come from the environment `membox
    launch` sets: MEMBOX_EMBEDDING_NODES (comma-separated host:port),
    MEMBOX_SECRET or MEMBOX_SECRET_FILE. `partition` spreads keys over the
    nodes: "modulo" (key % nodes) or "hash". A node that dies (and keeps a
    push log, the default) is waited for up to `failover_timeout` seconds
    while `membox launch --max-restarts` restarts it; the calls meanwhile
    take longer and nothing is lost or applied twice (0: fail at once)."""
    nodes = _addresses(nodes, "MEMBOX_EMBEDDING_NODES", "embedding nodes")
    rank = int(os.environ.get("RANK", 0))
    return EmbeddingClient(list(nodes), secret or _secret(),
                           name or f"worker-{rank}", timeout, partition,
                           failover_timeout)
