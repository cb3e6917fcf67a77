"""This worker's connection to the memory nodes, shared by the DDP hook,
OverlappedOptimizer, ParameterServer, InMemoryState and offload: the one
client (init()), the keys it declared, the wire type the hook narrows to,
and the per-client buffers the hook keeps. All of it is in one Session
object (`session`), guarded by its lock; nothing else keeps module state.

Threading: init() runs on the training thread; the hook and the client's
completion callbacks read the session under session.lock."""
import os
import threading

import torch

import membox


_WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class Session:
    """What this worker process keeps for membox.torch: the client init()
    made, the keys declared through it, and the DDP hook's per-bucket
    state. One instance (`session`); reset() forgets it all (a new client)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self, client=None, wire=None, mode="average"):
        self.client = client
        self.wire = wire  # dtype the hook sends float gradients in
        self.mode = mode  # the nodes' synchronisation mode (init's)
        self.declared = set()  # keys declared through `client`
        # The DDP hook's state (membox.torch.ddp):
        self.iterations_seen = 0  # DDP iterations whose last bucket came
        self.buckets = {}  # bucket index -> (address, bytes, tensor) registered
        self.narrow = {}  # bucket index -> its wire-dtype buffer
        self.results = {}  # bucket key -> (numpy, tensor) registered result
        self.share_refused = []  # why the nodes cannot map a bucket, if so
        self.splitter = None  # the hook's split buckets (ddp._Splitter)


session = Session()


def init(mode="average", client=None, wire_dtype=None, profile=True,
         **configure):
    """Connects this worker to the memory nodes (environment of `membox
    launch`, see membox.connect) and sets the synchronisation mode.

    With several memory nodes (and profile=True), the nodes are measured
    once from this worker and the routing the measurement implies is used
    (docs/design/ps.md: striped over nodes with equal links, otherwise
    small tensors to the nearest node and large ones to the widest link);
    under torch.distributed rank 0 measures and every rank uses its table.

    wire_dtype="bfloat16" or "float16": the DDP hook sends float32/float64
    gradient buckets in that type (half the bytes); the memory nodes sum
    them in float32 and round once, and the average comes back into the
    bucket. CUDA buckets are rounded and widened on the GPU, so only the
    narrow copy crosses PCIe and the wire (half the staging bytes each
    way).

    Under torch.distributed the rank and world come from the process group
    (scripts that pass rank= to init_process_group, as mp.spawn and
    Lightning do, set no RANK). Called again (Lightning sets a callback up
    for fit, validate and test), init() keeps its connection and applies
    the new settings."""
    if wire_dtype is not None:
        key = str(wire_dtype).replace("torch.", "")
        if key not in _WIRE_DTYPES:
            raise ValueError("wire_dtype must be float16 or bfloat16")
        wire_dtype = _WIRE_DTYPES[key]
    import torch.distributed as dist
    up = dist.is_available() and dist.is_initialized()
    if up and dist.get_backend() == "membox":
        raise membox.MemboxError(
            "the process group's backend is membox: DDP already synchronises "
            "through the memory nodes, without init() and the hook")
    with session.lock:
        again = session.client if client is None else None
    if again is not None:
        again.configure(mode=mode, **configure)
        with session.lock:
            session.wire = wire_dtype
            session.mode = mode
        return again
    if client is None:
        rank = dist.get_rank() if up else None
        world = dist.get_world_size() if up else None
        client = membox.connect(_proxies(), rank=rank, world=world)
    c = client
    c.configure(mode=mode, **configure)
    if profile and c.num_proxies > 1:
        _route(c)
    with session.lock:
        session.reset(c, wire_dtype, mode)
    return c


_STORE_KEY = "membox/proxies"


def _proxies():
    """The memory nodes: MEMBOX_PROXIES, or under torch.distributed (e.g.
    torchrun) what a rank that has MEMBOX_PROXIES put into the process
    group's store -- so one host's environment is enough. Every rank that
    has the variable publishes it; a rank without it waits up to 60 s."""
    env = os.environ.get("MEMBOX_PROXIES")
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return env.split(",") if env else None
    from datetime import timedelta
    store = dist.distributed_c10d._get_default_store()
    if env:
        store.set(_STORE_KEY, env)
        return env.split(",")
    try:
        store.wait([_STORE_KEY], timedelta(seconds=60))
    except Exception as e:  # noqa: BLE001 - torch raises several kinds
        raise membox.MemboxError(
            "no memory nodes: MEMBOX_PROXIES is not set here and no rank put "
            "it into torch.distributed's store within 60 s (%s)" % e)
    return store.get(_STORE_KEY).decode().split(",")


# Sizes the routing profile measures at init(): enough to tell a near node
# from a wide one and find the shard size that fills a link, and short on
# slow links (3 x 5.3 MB per node).
_PROFILE_SIZES = [256 << 10, 1 << 20, 4 << 20]


def _route(c):
    """Every worker routes by rank 0's measurement (sent through
    torch.distributed when it is up; otherwise each measures itself)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and \
            dist.get_world_size() > 1:
        rank = dist.get_rank()
        table = [c.profile(_PROFILE_SIZES, 3) if rank == 0 else None]
        dist.broadcast_object_list(table, src=0)
        if rank != 0:
            c.set_routing(table[0])
    else:
        c.profile(_PROFILE_SIZES, 3)


def client():
    """The client init() made; an error before init()."""
    c = session.client
    if c is None:
        raise membox.MemboxError("call membox.torch.init() first")
    return c


def flat_numpy(t):
    """A CPU tensor's elements as a flat numpy array sharing its memory
    (bfloat16 as int16: numpy has none)."""
    if t.device.type != "cpu":
        raise membox.MemboxError("membox.torch moves CPU and CUDA tensors "
                                 "(got %s)" % t.device)
    flat = t.detach().contiguous().view(-1)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: same bits
        flat = flat.view(torch.int16)
    return flat.numpy()


def dtype_name(t):
    """membox's name of a tensor's dtype; an error for one it cannot sum."""
    names = {torch.float32: "float32", torch.float64: "float64",
             torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if t.dtype not in names:
        raise membox.MemboxError("unsupported dtype %s" % t.dtype)
    return names[t.dtype]


def declare(key, t):
    """Declares `key` for tensors like `t` once per client."""
    with session.lock:
        if key not in session.declared:
            client().declare(key, t.numel() * t.element_size(),
                             dtype_name(t))
            session.declared.add(key)
