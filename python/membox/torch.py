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
"""
import threading

import torch

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
