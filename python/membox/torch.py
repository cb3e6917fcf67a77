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

ParameterServer is the explicit API for custom loops and asynchronous
training: workers push gradients and pull weights, the memory nodes run the
optimizer.

Embedding and EmbeddingBag (sum / mean pooling) are layers whose table
lives in the memory nodes' sparse parameter store (memory + SSD tiers):
forward pulls the rows of the batch's distinct keys, backward pushes their
gradients and the nodes apply the table's optimizer (Adagrad by default) --
the rows never join a torch optimizer. prefetch() pulls a later batch's
rows while this one trains.
"""
import itertools
import threading

import numpy as np
import torch
import torch.nn.functional as F

import membox

_client = None
_declared = set()
_lock = threading.Lock()


def init(mode="average", client=None, **configure):
    """Connects this worker to the memory nodes (environment of `membox
    launch`, see membox.connect) and sets the synchronisation mode."""
    global _client
    _client = client or membox.connect()
    _client.configure(mode=mode, **configure)
    return _client


def client():
    if _client is None:
        raise membox.MemboxError("call membox.torch.init() first")
    return _client


def _flat_numpy(t):
    if t.device.type != "cpu":
        raise membox.MemboxError("membox.torch moves CPU tensors (got %s)"
                                 % t.device)
    return t.detach().contiguous().view(-1).numpy()


def _dtype(t):
    names = {torch.float32: "float32", torch.float64: "float64",
             torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if t.dtype not in names:
        raise membox.MemboxError("unsupported dtype %s" % t.dtype)
    return names[t.dtype]


def _declare(key, t):
    with _lock:
        if key not in _declared:
            client().declare(key, t.numel() * t.element_size(), _dtype(t))
            _declared.add(key)


def allreduce_hook(state, bucket):
    """DDP communication hook: average the bucket across workers through the
    memory nodes. Returns a Future completed with the averaged bucket."""
    t = bucket.buffer()
    nbytes = t.numel() * t.element_size()
    # DDP rebuilds its buckets after the first iteration: a key per
    # (index, size) keeps every declaration consistent on all workers.
    key = (bucket.index() << 40) | nbytes
    _declare(key, t)
    arr = _flat_numpy(t)
    fut = torch.futures.Future()
    handle = client().push_pull(key, arr, arr, priority=-bucket.index())

    def done(err):
        if err is None:
            fut.set_result(t)
        else:
            fut.set_exception(membox.MemboxError(err))

    handle.add_done_callback(done)
    return fut


class ParameterServer:
    """Explicit parameter-server training: the memory nodes keep the weights
    and run the optimizer ("sgd" with momentum, or "adam"); workers push
    gradients and pull weights, synchronously (mode "average"/"sum") or
    asynchronously (mode "async", optionally with a staleness bound).

        ps = membox.torch.ParameterServer(model.parameters(), optimizer="sgd",
                                          lr=0.1, momentum=0.9)
        loss.backward(); ps.step()   # push grads, pull new weights
    """

    def __init__(self, params, mode="average", optimizer="sgd", lr=0.01,
                 momentum=0.0, beta1=0.9, beta2=0.999, eps=1e-8, staleness=0,
                 client=None, first_key=1 << 50):
        self.params = [p for p in params]
        self.client = client or (_client if _client is not None
                                 else membox.connect())
        self.client.configure(mode=mode, staleness=staleness,
                              optimizer=optimizer, lr=lr, momentum=momentum,
                              beta1=beta1, beta2=beta2, eps=eps)
        self.keys = []
        # Rounds completed on the memory nodes: 0 for a new job, the
        # checkpoint's after `membox launch --resume`.
        self.version = 0
        for i, p in enumerate(self.params):
            key = first_key + i
            data = _flat_numpy(p.data)
            # The first worker's initial weights win on every node.
            v = self.client.declare(key, data.nbytes, _dtype(p.data), data)
            self.version = max(self.version, v)
            self.keys.append(key)
        self.pull()

    def pull(self):
        """Overwrites the local parameters with the memory nodes' weights."""
        hs = [self.client.pull(k, _flat_numpy(p.data))
              for k, p in zip(self.keys, self.params)]
        for h in hs:
            h.wait()

    def step(self):
        """Pushes every gradient (first layers first) and pulls the updated
        weights."""
        hs = []
        n = len(self.params)
        for i, (k, p) in enumerate(zip(self.keys, self.params)):
            g = p.grad if p.grad is not None else torch.zeros_like(p.data)
            hs.append(self.client.push_pull(k, _flat_numpy(g),
                                            _flat_numpy(p.data),
                                            priority=i - n))
        for h in hs:
            h.wait()


# ------------------------------------------------------------ embeddings

_emb_client = None
_pin_tags = itertools.count(1)  # batch ids the nodes pin rows under


def embeddings():
    """This process's EmbeddingClient (membox.connect_embeddings())."""
    global _emb_client
    with _lock:
        if _emb_client is None:
            _emb_client = membox.connect_embeddings()
        return _emb_client


def _keys(input):
    """int64 ids (tensor or array) -> flat uint64 keys, shape."""
    a = input.detach().cpu().numpy() if hasattr(input, "detach") else \
        np.asarray(input)
    if a.dtype.kind not in "iu":
        raise TypeError(f"embedding ids must be integers, not {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.int64)
    return a.reshape(-1).view(np.uint64), a.shape


class Prefetched:
    """The rows of one batch, being pulled (from Embedding.prefetch)."""

    def __init__(self, layer, input, pin):
        self.flat, self.shape = _keys(input)
        self.unique, inverse = np.unique(self.flat, return_inverse=True)
        self.inverse = torch.from_numpy(inverse.astype(np.int64))
        self.batch = next(_pin_tags) if pin else 0
        self.layer = layer
        self.handle = layer.client.pull_async(layer.table, self.unique,
                                              self.batch)
        self.used = False


class _StoreLayer(torch.nn.Module):
    def __init__(self, name, dim, optimizer="adagrad", lr=0.01, seed=0,
                 init_scale=0.01, client=None, **table_options):
        super().__init__()
        self.client = client or embeddings()
        self.name, self.dim = name, dim
        self.table = self.client.open_table(
            name, dim, optimizer=optimizer, lr=lr, seed=seed,
            init_scale=init_scale, **table_options)
        self._pushes = []

    def prefetch(self, input):
        """Starts pulling the rows `input` will need; pass the result to
        forward(..., prefetched=) of that batch. In training mode the rows
        stay pinned in the nodes' memory until this batch's gradients are
        pushed."""
        return Prefetched(self, input, pin=self.training)

    def _rows(self, input, prefetched):
        p = prefetched if prefetched is not None else self.prefetch(input)
        if p.layer is not self or p.used:
            raise ValueError("this prefetch belongs to another layer or was "
                             "used already")
        flat, _ = _keys(input)
        if p.flat.shape != flat.shape or not np.array_equal(p.flat, flat):
            raise ValueError("forward's ids differ from the prefetched ones")
        p.used = True
        rows = torch.from_numpy(p.handle.wait())
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(self._push_hook(p))
        elif p.batch:
            self.client.release(self.table, p.batch)
        return rows, p.inverse.view(p.shape)

    def _push_hook(self, p):
        def push(grad):
            g = grad.detach().to(torch.float32).contiguous().numpy()
            self._pushes.append(self.client.push_async(
                self.table, p.unique, g, p.batch, True))
            while self._pushes and self._pushes[0].done():
                self._pushes.pop(0).wait()  # raises a failed push's error
        return push

    def synchronize(self):
        """Waits until every gradient pushed so far is applied."""
        while self._pushes:
            self._pushes.pop(0).wait()

    def extra_repr(self):
        return f"table={self.name!r}, dim={self.dim}"


class Embedding(_StoreLayer):
    """Like torch.nn.Embedding (any id shape -> shape + (dim,)), with the
    table in the memory nodes; ids are any 64-bit integers (no
    num_embeddings: rows are created on first use)."""

    def forward(self, input, prefetched=None):
        rows, idx = self._rows(input, prefetched)
        return F.embedding(idx, rows)


class EmbeddingBag(_StoreLayer):
    """Like torch.nn.EmbeddingBag with mode "sum" or "mean": (B, L) ids, or
    1-D ids with offsets, -> (B, dim)."""

    def __init__(self, name, dim, mode="mean", **kw):
        if mode not in ("sum", "mean"):
            raise ValueError("mode must be sum or mean")
        super().__init__(name, dim, **kw)
        self.mode = mode

    def forward(self, input, offsets=None, per_sample_weights=None,
                prefetched=None):
        rows, idx = self._rows(input, prefetched)
        return F.embedding_bag(idx, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights)
