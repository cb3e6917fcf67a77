"""membox as a torch.distributed backend: `import membox.torch` registers
"membox", and `dist.init_process_group("membox")` runs a process group's
collectives through the memory nodes (docs/design/backend.md).

Paths:
  * Sums and averages of floating-point tensors (all_reduce, reduce,
    reduce_scatter, their coalesced and tensor forms) are rounds on the
    memory nodes: every rank pushes, the nodes sum (striped over the
    nodes, combined in the node's memory for small tensors on one node),
    and the result is pulled -- by every rank (all_reduce), by the root
    (reduce), or each rank its own chunk (reduce_scatter).
  * Moving data (broadcast, all_gather, gather, scatter, all_to_all,
    send/recv) and the reductions the nodes do not sum (MIN, MAX,
    PRODUCT, bitwise ops, integer tensors) are exchanges: each rank
    stores what it sends into stored keys on the nodes, the ranks meet
    at a fence (one 4-byte round), and each pulls what it receives.
    Reductions then reduce locally.
  * Small floating-point broadcasts and all_gathers (result up to
    256 KiB) are one sum round instead: each rank places its data in a
    buffer of -0.0 and the nodes sum, which leaves every value as placed.

Threading: collectives are called on the training thread (or DDP's
autograd thread). Rounds are submitted at once and complete on the
client's completion thread; exchanges run in issue order on the group's
one exchange thread (so every rank takes its fences in the same order).
Each operation's Work completes once, with its result or its error.

Subgroups (fewer ranks than the job) take no rounds, since the nodes'
rounds count every rank of the job: every operation is an exchange, sums
reduced locally, and the fence is a counter in the group's store.

Keys: the group's own key space (0xD << 60, then a digest of the group's
name), so a membox process group lives next to the DDP hook's,
ParameterServer's and offload's keys on the same nodes."""
import functools
import hashlib
import os
import queue
import socket
import threading
import time
import uuid
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import membox
from membox.torch import _at_exit, _split
from membox.torch._cuda_staged import _Streams, staged
from membox.torch._session import flat_numpy

_KEY_BASE = 0xD << 60
_STORE_KEY = "membox/proxies"  # the same rendezvous key init() uses
_ROUTING_KEY = "membox/routing"

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# A tensor this large all-reduced twice at one address moves in place.
_IN_PLACE_BYTES = 256 << 10
_KEYS_PER_SIZE = 4
# A float all_gather or broadcast of at most this many bytes is a sum round
# (_placed_sum): latency-bound sizes, where one round beats an exchange's
# store, fence and pull.
_SUM_MOVE_BYTES = 256 << 10
# An all_gather (its output), a float32 / 16-bit SUM/AVG reduce_scatter (its input)
# or a broadcast of at least this many bytes goes over the workers' own
# ring (collective::RingAllreduce) instead of through the nodes
# (docs/design/backend.md, "Direct path"). 0 turns the ring off
# (MEMBOX_BACKEND_DIRECT_BYTES, read once at import).
_DIRECT_BYTES = int(os.environ.get("MEMBOX_BACKEND_DIRECT_BYTES", 1 << 20))
# The same bound where the nodes map the workers' memory (one host): from
# 512 KiB the ring wins there too (2 workers, 2026-12-07: reduce_scatter of
# 768 KiB 1.2 ms around the ring, 2.9-3.8 ms as the nodes' rounds;
# all_gather of 512-768 KiB 0.45-0.80 ms, 0.75-1.01 ms over the mesh;
# FSDP2's transformer step 51.5 against 62.1 ms, Gloo 51.8). Below, the
# nodes' rounds and the mesh win or tie. The variable sets both.
_DIRECT_BYTES_ONE_HOST = int(os.environ.get("MEMBOX_BACKEND_DIRECT_BYTES",
                                            512 << 10))
_RING_MAX_BYTES = _split.RING_MAX_BYTES  # the ring's pieces: this / world
_RING_SEGMENT_BYTES = _split.RING_SEGMENT_BYTES  # across hosts
# A subgroup's float32 SUM/AVG all_reduce of at least this many bytes goes
# around its ring; a smaller one is gathered over its mesh and summed on
# each rank (one host, subgroups of 2: the ring took 4.1-4.4 ms at 1-2 MiB,
# the gather 2.5-3.9 ms; from 3 MiB the ring is faster). Off with the
# direct path.
_SUB_RING_BYTES = 2 << 20
# The mesh's (collective::Mesh) buffers: this / world per peer, each way.
# Every all_to_all, and every exchange (gathers, scatters, the reductions
# the nodes do not sum), goes over the mesh while the direct path is on
# (MEMBOX_BACKEND_DIRECT_BYTES > 0): the nodes would only relay it.
_MESH_MAX_BYTES = 16 << 20
# Across hosts (nodes on other hosts than rank 0), a broadcast below the
# ring's threshold goes over the workers' mesh, never as a sum round on the
# nodes (4w4m, 4 KiB: 0.81 ms against the round's 1.70 ms; Gloo 0.67).
# From this many bytes, in a group of 4 ranks or more, it goes down a
# binomial tree of mesh exchanges: ceil(log2 p) steps, each carrying the
# bytes once per sender, where the flat exchange puts p - 1 copies on the
# root's link at once (4w4m, 256 KiB: the flat exchange 16.4 ms, Gloo's
# tree 10.9 ms).
_TREE_BROADCAST_BYTES = 32 << 10

# An all_to_all over the mesh moving at most this many bytes (sent and
# received), and a barrier, run on the caller's thread when nothing of the
# group is queued ahead of them (_Jobs): blocking, but shorter than the
# hand-offs to the exchange thread.
_INLINE_BYTES = 1 << 20
# A direct send of at most this many bytes is one message (PointToPoint's
# inline_bytes): it runs on the caller's thread when its lane is idle.
_P2P_INLINE_BYTES = 512 << 10
# A float32, bfloat16 or float16 SUM/AVG all_reduce of at least this many
# bytes is split: its head over the workers' ring, its tail through the
# nodes at the same time (seed 000's dual synchronisation within one
# tensor; docs/design/backend.md, "Split all_reduce"). 0 turns it off
# (MEMBOX_BACKEND_SPLIT_BYTES, read once at import).
_SPLIT_BYTES = int(os.environ.get("MEMBOX_BACKEND_SPLIT_BYTES", 4 << 20))
_SPLIT_STEPS = _split.STEPS  # the ring's share is a multiple of 1/16
# What the workers' ring sums (collective::RingAllreduce), by membox's name.
_RING_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}
# Across hosts, such an all_reduce from this many bytes up to _SPLIT_BYTES
# goes around the workers' ring alone (_ring_whole).
_RING_SUM_BYTES = int(os.environ.get("MEMBOX_BACKEND_RING_SUM_BYTES",
                                     16 << 10))
_SPLIT_ON_ONE_HOST = False  # tests: split even where the nodes map memory
_NAMES = {torch.float32: "float32", torch.float64: "float64",
          torch.float16: "float16", torch.bfloat16: "bfloat16"}


# The links' balance (tests read it here).
_first_split_share = _split.first_share


def _op_name(op):
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR",
                 "BXOR", "PREMUL_SUM"):
        if op == getattr(dist.ReduceOp, name):
            return name
    return str(op)


def _local_reduce(name, stacked):
    """Reduces dim 0 of `stacked` with torch's op `name` (the exchange path:
    every rank's contribution is here)."""
    if name in ("SUM", "AVG"):
        out = stacked.sum(0, dtype=stacked.dtype)
        if name == "AVG":
            if stacked.dtype.is_floating_point or stacked.is_complex():
                out = out / stacked.shape[0]
            else:
                out = torch.div(out, stacked.shape[0], rounding_mode="floor")
        return out
    if name == "PRODUCT":
        return stacked.prod(0, dtype=stacked.dtype)
    if name == "MIN":
        return stacked.amin(0) if stacked.dtype != torch.bool \
            else stacked.all(0)
    if name == "MAX":
        return stacked.amax(0) if stacked.dtype != torch.bool \
            else stacked.any(0)
    ops = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
           "BXOR": torch.bitwise_xor}
    if name in ops:
        out = stacked[0].clone()
        for t in stacked[1:]:
            out = ops[name](out, t)
        return out
    raise RuntimeError("membox backend: reduce op %s is not supported" % name)


def _bytes_view(t):
    """A contiguous CPU tensor's bytes as a flat uint8 tensor (same memory)."""
    t = t.detach()  # collectives move values, not autograd history
    return t.view(-1).view(torch.uint8) if t.numel() else \
        torch.empty(0, dtype=torch.uint8, device="cpu")


class _Work(dist.Work):
    """One operation: completes once, with its outputs or an error. wait()
    waits up to its timeout (the group's when none is given) and raises the
    operation's error; get_future() gives a Future of the outputs whose
    error C++ callers (DDP's reducer) see as an error too."""

    def __init__(self, what, outputs, timeout, device=None):
        super().__init__()
        self._what = what
        self._outputs = outputs
        self._timeout = timeout
        self._event = threading.Event()
        self._finish_lock = threading.Lock()
        self._finishing = False
        self._error = None
        # A CUDA operation's future is one of its device (_cuda_staged).
        self._fut = torch.futures.Future(
            devices=[device] if device is not None else None)
        self._checked = None
        # A receive's sender (set by the receive; for one from any rank,
        # once it has arrived), or the Work that knows it (a CUDA receive's
        # staged copy: _cuda_staged).
        self._src = None
        self._src_of = None

    def _source_rank(self):
        """The rank a receive took its message from (torch's recv without
        src reads it after wait())."""
        if self._src_of is not None:
            return self._src_of._source_rank()
        if self._src is None:
            raise RuntimeError("membox backend: %s: no source rank (only a "
                               "completed receive has one)" % self._what)
        return self._src

    source_rank = _source_rank

    def _finish(self, error=None):
        """Completes the Work once: the futures first (their callbacks run
        here), then wait(). So once wait() returns, get_future() is complete
        too, and a then() on it runs at once, on the caller's thread, which
        torchft's Manager relies on."""
        with self._finish_lock:
            if self._finishing:
                return
            self._finishing = True
        self._error = error
        if error is None:
            self._fut.set_result(self._outputs)
        else:
            self._fut.set_exception(error)
        self._event.set()

    def wait(self, timeout=None):
        t = self._timeout
        if timeout is not None and timeout > timedelta(0):
            t = timeout
        if not self._event.wait(t.total_seconds()):
            raise RuntimeError(_timed_out(self._what, t))
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._event.is_set()

    def is_success(self):
        return self._event.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return self._outputs

    def get_future(self):
        if self._checked is None:
            # set_exception keeps the error as the value, which C++ then
            # fails to read as tensors: a then() that raises it makes it
            # an error there too (as membox.torch.ddp.for_ddp does).
            self._checked = self._fut.then(lambda f: f.value())
        return self._checked


class _Jobs:
    """A group's operations in issue order: each runs on the group's
    exchange thread, or, when it asks to and nothing is queued or running,
    at once on the caller's thread (a small operation then skips the two
    thread hand-offs, which cost more than the operation itself on a busy
    machine). Submitters wait on each other only while an inline operation
    runs, so the issue order is the run order either way."""

    def __init__(self, name):
        self._queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # queued or running on the exchange thread
        self._thread = threading.Thread(target=self.serve, daemon=True,
                                        name=name)
        self._thread.start()

    def submit(self, w, fn, inline=False):
        with self._lock:
            if inline and self._pending == 0:
                _run(w, fn)
                return
            self._pending += 1
            self._queue.put((w, fn))

    def stop(self, wait_s=10):
        """Ends the thread once what is queued has run, and waits up to
        `wait_s` for it (unless called from it): a job's completion may
        still be on its way back to the GIL (torch's Future releases it
        while it wakes the waiters), and a thread that asks for the GIL of
        a finalizing interpreter aborts the process."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(wait_s)

    def serve(self):
        """The exchange thread: runs jobs until stop(). (It holds this
        object only, not the group, so the group can be collected.)"""
        while True:
            job = self._queue.get()
            if job is None:
                return
            _run(*job)
            del job
            with self._lock:
                self._pending -= 1


def _timed_out(what, timeout, why=None):
    """The error of an operation that outlived its timeout, worded as
    torch's backends word it (callers match "Timed out")."""
    return "membox backend: %s: Timed out after %s waiting for the " \
        "operation to complete%s" % (what, timeout,
                                     " (%s)" % why if why else "")


def _run(w, fn):
    """Runs fn() and completes the Work `w` with its outcome."""
    try:
        fn()
        w._finish()
    except Exception as e:  # noqa: BLE001 - the Work carries it
        if "DEADLINE_EXCEEDED" in str(e):
            # A transfer inside the operation waited out the group's
            # timeout (membox's C++ waits are bounded by it).
            e = RuntimeError(_timed_out(w._what, w._timeout, e))
        w._finish(e if isinstance(e, RuntimeError)
                  else RuntimeError("membox backend: %s failed: %s"
                                    % (w._what, e)))


def _done(what, outputs, timeout):
    w = _Work(what, outputs, timeout)
    w._finish()
    return w


def _proxies(store, rank, timeout):
    """The memory nodes: MEMBOX_PROXIES, or what a rank that has it put into
    the group's store (one host's environment is enough), waited for up to
    60 s (or the group's timeout, if shorter)."""
    env = os.environ.get("MEMBOX_PROXIES")
    if env:
        store.set(_STORE_KEY, env)
        return env.split(",")
    wait = min(timeout, timedelta(seconds=60))
    try:
        store.wait([_STORE_KEY], wait)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds
        raise membox.MemboxError(
            "membox backend: no memory nodes. Set MEMBOX_PROXIES "
            "(host:port of each memory node, comma-separated) on at least "
            "one rank, or start the job with `membox launch`; rank %d "
            "waited %s for another rank to publish them (%s)" %
            (rank, wait, e))
    return store.get(_STORE_KEY).decode().split(",")


def _base_class():
    """torch's Backend where Python may subclass it (torch 2.15 on), else
    its ProcessGroup: earlier torch binds no constructor for Backend, and
    a creator that returns a ProcessGroup gives torch the group itself
    (torch's own Python process groups, test_c10d_pypg, do the same)."""
    backend = torch._C._distributed_c10d.Backend

    class _Probe(backend):
        pass
    try:
        _Probe(0, 1)
        return backend
    except TypeError:
        return dist.ProcessGroup


class MemboxBackend(_base_class()):
    """A torch.distributed backend whose collectives run on the memory
    nodes (module docstring). Made by torch through the "membox" name:
    init_process_group("membox") under torchrun, file:// or tcp:// init,
    or mp.spawn with rank and world_size. A torch.distributed Backend,
    or on torch before 2.15 a ProcessGroup (_base_class)."""

    # Groups of the whole job made in this process: each its own key space.
    # Every rank makes them in the same order (torch's rule), so the count
    # names the same group on every rank. A subgroup is named by torch's
    # group name within the whole-job group it was made in.
    _groups = 0
    # The one client of this process's groups (the nodes take one
    # connection per rank of a job): [client, global rank, job size, groups
    # using it]. A group of another rank or job size replaces it. When the
    # last group using it is destroyed (torch calls shutdown()), it is
    # dropped and its connection closes: once every rank's has, the job has
    # ended on the nodes, which free its keys (all scratch: _declare).
    _shared = None
    # The first memory node of the process's connection: the direct paths
    # listen on the address toward it (a subgroup's store need not hold the
    # nodes' list).
    _first_proxy = None
    # Connections this process made for whole jobs (_job_name's count).
    _connections = 0
    # Groups not shut down yet (see __init__).
    _open = set()

    def __init__(self, store, rank, size, timeout, global_ranks=None,
                 group_name="", space=None, rejoin=False, job=None):
        """`space`: the name of the group's key space, the same on every
        rank (default: the group's place among this process's groups, see
        _groups). `rejoin`: the group follows another job on the same nodes
        (torchft's next quorum): its connection waits for that job's to
        close (membox.connect's rejoin). `job`: (this process's rank in the
        job, the job's size) when the group is part of a larger job that no
        torch group describes (torchft's replica groups of several ranks:
        one group per local rank, all one job on the nodes)."""
        super().__init__(rank, size)
        # A Backend (torch 2.15 on) is held here until shutdown(), which
        # torch calls at destroy_process_group: torch may keep only its C++
        # side (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps it in its
        # ProcessGroupWrapper), and once the Python object is collected
        # torch can no longer reach its methods. (A ProcessGroup, on older
        # torch, is the group itself, never wrapped; torch passes it no
        # shutdown(), so it is left to be collected, its __del__ shutting
        # it down.)
        if not isinstance(self, dist.ProcessGroup):
            MemboxBackend._open.add(self)
        self._collectives = 0  # issued: _get_sequence_number_for_group
        self._monitored_barriers = 0  # issued: monitored_barrier's keys
        self._rank, self._size = rank, size
        self._timeout = timeout if isinstance(timeout, timedelta) and \
            timeout > timedelta(0) else timedelta(minutes=30)
        self._h2d = _Streams()  # CUDA results' copies back (_cuda_staged)
        # The job's ranks and this process's among them: the default group
        # is the job (torch passes no rank list for it).
        global_ranks = list(global_ranks or [])
        job_size = dist.get_world_size() if global_ranks and \
            dist.is_initialized() else size
        me = global_ranks[rank] if global_ranks else rank
        if job is not None:
            me, job_size = job
            if not 0 <= me < job_size or job_size < size:
                raise ValueError("membox backend: job rank %d of %d cannot "
                                 "hold a group of %d" % (me, job_size, size))
        # A subgroup of fewer ranks than the job: the nodes' rounds count
        # every rank of the job, so its operations are exchanges, and its
        # ranks meet at fences in the group's store instead of at a round.
        self._sub = size < job_size
        if space is not None:
            self._index = ("named", space)
        elif self._sub:
            self._index = ("subgroup", MemboxBackend._groups - 1, group_name)
        else:
            self._index = MemboxBackend._groups
            MemboxBackend._groups += 1
        self._base_store = store
        self._handle = None  # get_reconfigure_handle's, made on first use
        self._start(store, me, job_size, group_name or str(self._index),
                    rejoin)

    def _start(self, store, me, job_size, label, rejoin):
        """Connects (or shares the process's connection for job rank `me` of
        `job_size`) and starts the group's exchange thread and state."""
        self._store = store
        shared = MemboxBackend._shared
        if os.environ.get("MEMBOX_PROXIES"):  # for ranks that lack it
            store.set(_STORE_KEY, os.environ["MEMBOX_PROXIES"])
        if shared is not None and shared[1:3] == [me, job_size]:
            self._client = shared[0]  # a further group: same connection
            shared[3] += 1
        else:
            MemboxBackend._shared = None
            shared = None  # the old connection closes first
            proxies = _proxies(store, self._rank, self._timeout)
            MemboxBackend._first_proxy = proxies[0]
            self._client = membox.connect(
                proxies, rank=me, world=job_size, name="torch-rank-%d" % me,
                timeout=self._timeout.total_seconds(), rejoin=rejoin,
                job=self._job_name(store, label, rejoin))
            self._client.configure(mode="sum")
            if self._client.num_proxies > 1 and not self._sub:
                self._route()
            MemboxBackend._shared = [self._client, me, job_size, 1]
        self._declared = {}  # key -> bytes
        self._buffers = {}  # key -> registered numpy buffer
        self._calls = {}  # (dtype, bytes) -> rounds of that size so far
        self._round_keys = {}  # ((dtype, bytes), entry) -> its key
        self._seen = set()  # addresses of tensors all-reduced once
        self._placed = set()  # addresses of tensors moved in place
        self._exchanges = 0
        self._fences = 0  # a subgroup's fences so far
        self._p2p_sent = {}  # (dst, tag) -> sends so far
        self._p2p_recv = {}  # (src, tag) -> receives so far
        self._ring = None  # the workers' ring, made on its first use
        self._mesh = None  # the workers' mesh, made on its first use
        self._pairs = None  # their point to point, made on its first use
        self._pairs_lock = threading.Lock()
        self._peers_known = set()  # ranks whose p2p endpoint _pairs has
        self._lanes = {}  # (direction, peer) -> _Jobs of direct p2p
        # The ring's share of each split all_reduce (_split_allreduce).
        self._share = _split.Share(self._store, self._rank, self._size,
                                   self._client.num_proxies, "membox/split")
        self._remote = None  # rank 0's nodes are on other hosts
        if self._rank == 0:
            self._store.set("membox/nodes/remote", "0" if
                            self._client.proxies_map_memory else "1")
        self._jobs = _Jobs("membox-backend-%s" % label)
        self._p2p_threads = set()  # _p2p's, while they run
        self._closed = False
        # Never destroyed (destroy_process_group is optional): shut down at
        # Python's exit (membox.torch._at_exit says why).
        _at_exit.end_at_exit(self, MemboxBackend.shutdown)
        if not self._sub:
            self._fence = self._key(2, 0, "fence")
            self._declare(self._fence, 4, "float32")
            self._one = self._client.allocate(4).view(np.float32)

    def _job_name(self, store, label, rejoin):
        """The name this connection's job gives the nodes (membox.connect's
        job): a process that destroys its group and makes another must not
        say hello while its peers' old connections are still open, or
        their closing would end the new job. Rank 0 makes a fresh name and
        puts it into the group's store under the count of connections this
        process made (the same on every rank: they make the same groups);
        a group that follows another job (reconfigured, torchft's) is named
        by its label, the same on every rank of it. A connection for part
        of a job (a subgroup, a torchft replica group of several ranks) is
        unnamed: the job's other ranks connect through other groups."""
        if self._sub:
            return ""
        if rejoin:  # bounded like a worker's name
            return hashlib.sha256(label.encode()).hexdigest()
        key = "membox/job/%d" % MemboxBackend._connections
        MemboxBackend._connections += 1
        if self._rank == 0:
            name = uuid.uuid4().hex
            store.set(key, name)
            return name
        store.wait([key], self._timeout)
        return store.get(key).decode()

    # What torch asks a backend it may do, each answered here: torch 2.15
    # reads these through the C++ Backend, which for a Python subclass
    # looks them up on the class and, where the class only inherits
    # Backend's own property, calls itself again until Python's recursion
    # limit (batch_isend_irecv asked supports_coalescing and failed so).
    supports_coalescing = False  # batch_isend_irecv: one op after another
    supports_splitting = False
    supports_shrinking = False
    supports_window = False
    _supports_time_estimate = False

    # ---------------------------------------------------------- reconfigure
    # torch's reconfigure API (torch 2.15, as Gloo's): a group made with
    # init_process_group(..., enable_reconfigure=True) takes a new set of
    # peers -- a fault-tolerance layer's next quorum -- without being made
    # again.
    @property
    def supports_reconfigure(self):
        return True

    def get_reconfigure_handle(self):
        """This process's handle for the peers' out-of-band exchange."""
        if self._handle is None:
            import socket
            import uuid
            self._handle = "membox:%s:%d:%s" % (
                socket.gethostname(), os.getpid(), uuid.uuid4().hex)
        return self._handle

    def reconfigure(self, opts):
        """Becomes a group of the processes whose handles are in
        opts.handles (a list: ranks by position; a set: in sorted order), a
        new job on the nodes: this rank's connection to the old one closes,
        the new one waits for the old job's other connections to close
        (rejoin), and its keys are a space named by opts.uuid. torch keeps
        the ProcessGroup's rank() and size() of its creation for a backend
        registered from Python; the backend's own operations use the new
        rank and size."""
        handles = list(opts.handles) if isinstance(opts.handles, list) \
            else sorted(opts.handles)
        mine = self.get_reconfigure_handle()
        if len(set(handles)) != len(handles):
            raise ValueError("membox backend: reconfigure: a handle is "
                             "named twice")
        if mine not in handles:
            raise ValueError("membox backend: reconfigure: this process's "
                             "handle is not among the %d handles"
                             % len(handles))
        self.shutdown()  # the exchange thread and the old connection
        self._rank, self._size = handles.index(mine), len(handles)
        self._sub = False
        self._index = ("reconfigured", int(opts.uuid))
        store = dist.PrefixStore("membox/reconfigured/%d/" % int(opts.uuid),
                                 self._base_store)
        if not os.environ.get("MEMBOX_PROXIES"):  # what init() found
            store.set(_STORE_KEY, self._base_store.get(_STORE_KEY))
        self._start(store, self._rank, self._size,
                    "reconfigured-%d" % int(opts.uuid), rejoin=True)
        return _done("reconfigure", [], self._timeout)

    # ------------------------------------------------------------ plumbing
    def getBackendName(self):
        return "membox"

    def _get_sequence_number_for_group(self):
        """Collectives issued in this group so far, the same on every rank
        of a correct program (send and recv are not counted, as Gloo does
        not): TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper compares them
        across ranks before each collective."""
        return self._collectives

    @property
    def client(self):
        """The membox client this group's collectives use."""
        return self._client

    def _route(self):
        """Every rank routes by rank 0's measurement of the nodes (through
        the store: the group is not up yet)."""
        import pickle
        if self._rank == 0:
            table = self._client.profile([256 << 10, 1 << 20, 4 << 20], 3)
            self._store.set(_ROUTING_KEY, pickle.dumps(table))
        else:
            self._store.wait([_ROUTING_KEY], self._timeout)
            self._client.set_routing(
                pickle.loads(self._store.get(_ROUTING_KEY)))

    def _key(self, kind, parity, *what):
        """A key of this group: kind (1 rounds, 2 fence, 3 exchange, 4
        point-to-point), then a digest of what it holds."""
        h = hashlib.blake2b(repr((self._index, parity) + what).encode(),
                            digest_size=8).digest()
        bits = int.from_bytes(h, "little")
        space = self._index if isinstance(self._index, int) else bits >> 60
        return _KEY_BASE | (kind << 56) | (space & 0xF) << 52 | \
            (bits & ((1 << 52) - 1))

    def _declare(self, key, nbytes, dtype=None):
        """Declares `key` once (dtype None: a stored key of bytes), as the
        job's scratch: the nodes free it when the job ends."""
        if key in self._declared:
            if self._declared[key] != nbytes:
                raise RuntimeError("membox backend: key collision")
            return
        if dtype is None:
            self._client.declare_scratch(key, max(nbytes, 1), "uint8",
                                         stored=True)
        else:
            self._client.declare_scratch(key, nbytes, dtype)
        self._declared[key] = nbytes

    def _buffer(self, key, nbytes):
        """Registered memory kept for `key` (stored keys move no other)."""
        b = self._buffers.get(key)
        if b is None:
            b = self._buffers[key] = self._client.allocate(max(nbytes, 1))
        return b

    def _check(self, what, tensors):
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError("membox backend: %s takes tensors" % what)
            if t.device.type != "cpu":  # CUDA ones are host copies here
                raise RuntimeError(
                    "membox backend: %s of a %s tensor is not supported "
                    "(CPU and CUDA tensors only)" % (what, t.device.type))
            if t.is_sparse:
                raise RuntimeError("membox backend: %s of a sparse tensor is "
                                   "not supported" % what)

    def _staged_work(self, what, outputs, device):
        """The Work of an operation on CUDA tensors (_cuda_staged.staged)."""
        return _Work(what, outputs, self._timeout, device)

    def _submit(self, what, outputs, fn, inline=False):
        """Runs fn() in issue order, on the exchange thread (or, `inline`
        and with nothing ahead of it, on this thread: _Jobs); the Work
        completes when it returns."""
        if self._closed:
            raise RuntimeError("membox backend: the process group is "
                               "destroyed")
        w = _Work(what, outputs, self._timeout)
        self._jobs.submit(w, fn, inline)
        return w

    def _wait(self, handles):
        t = self._timeout.total_seconds()
        for h in handles:
            h.wait(t)

    # ------------------------------------------------------------- rounds
    def _round(self, t, push_only=False, space=""):
        """Sum of contiguous float tensor `t` over the ranks on the nodes,
        into `t` (push_only: `t` is only pushed). Returns the handle.
        `space`: a set of keys and call counts of its own (the tails of
        split all_reduces, issued from the exchange thread)."""
        nbytes = t.numel() * t.element_size()
        # The k-th call of a size takes entry k mod 4 of its keys: the same
        # on every rank (they call in the same order), and DDP's buckets of
        # one size run side by side instead of in one key's round order.
        # A split's tail is one round at a time (the exchange thread waits
        # for it): one key per size, whose buffers are warm from its second
        # round on, instead of _KEYS_PER_SIZE keys each touched afresh.
        sig = (t.dtype, nbytes, space)
        n = self._calls.get(sig, 0)
        self._calls[sig] = n + 1
        slot = (sig, 0 if space == "split" else n % _KEYS_PER_SIZE)
        key = self._round_keys.get(slot)
        if key is None:  # first use: named and declared once
            key = self._key(1, slot[1], _NAMES[t.dtype], nbytes,
                            *((space,) if space else ()))
            self._declare(key, nbytes, _NAMES[t.dtype])
            self._round_keys[slot] = key
        arr = None
        if not push_only and nbytes >= _IN_PLACE_BYTES:
            arr = self._in_place(key, t)
        if arr is None:  # staged through the key's buffer by the client
            arr = t.detach().view(-1)
            if arr.dtype == torch.bfloat16:
                arr = arr.view(torch.int16)
            arr = arr.numpy()
        if push_only:
            return self._client.push(key, arr)
        return self._client.push_pull(key, arr, arr)

    def _in_place(self, key, t):
        """A tensor all-reduced again at the same address (DDP's gradient
        buckets) moves in place from its second time on, as the DDP hook's
        buckets do (membox.torch.ddp): on one host its storage moves into
        shared memory the nodes map (torch's share_memory_: every view
        follows), elsewhere it is registered with the transport. Returns
        its flat numpy array, or None (staged this time)."""
        from membox.torch import ddp
        t = t.detach()
        ptr = t.data_ptr()
        if ptr in self._placed:
            return ddp.flat_numpy(t)
        if ptr not in self._seen:
            self._seen.add(ptr)  # once: may be a one-off tensor
            return None
        c = self._client
        if c.proxies_map_memory:
            arr = ddp._shared_bucket(c, ("pg", self._index, ptr), t)
        else:
            arr = ddp.flat_numpy(t)
            ddp._register_bucket(c, ("pg", self._index, ptr), t, arr)
        if arr is not None:
            self._placed.add(t.data_ptr())  # its new address, if it moved
        return arr

    def _rounds(self, what, tensors, name, outputs, then=None):
        """All-reduces each tensor on the nodes; the Work completes when
        all are back (AVG divides here: the nodes sum), after then()."""
        w = _Work(what, outputs, self._timeout)
        staged = []
        for t in tensors:
            c = t if t.is_contiguous() else t.contiguous()
            staged.append((t, c))
        left = [len(staged)]
        lock = threading.Lock()

        def one_done(err):
            if err is not None:
                return w._finish(RuntimeError("membox backend: %s: %s" %
                                              (what, err)))
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    for t, c in staged:
                        if name == "AVG":
                            c.div_(self._size)
                        if c is not t:
                            t.copy_(c)
                    if then is not None:
                        then()
                    w._finish()
                except Exception as e:  # noqa: BLE001 - reach the waiter
                    w._finish(RuntimeError(str(e)))

        if not staged:
            w._finish()
        for _, c in staged:
            self._round(c).add_done_callback(one_done)
        return w

    def _moves_as_sum(self, tensors, times=1):
        """Whether moving `tensors` (times their size in all) is cheaper as
        a sum round than as an exchange: non-empty, floating point, small,
        in a group of the whole job. It depends on what every rank's
        tensors share (dtype, size), so every rank takes the same path."""
        return not self._sub and all(t.dtype in _FLOATS and
                   0 < t.numel() * t.element_size() * times <= _SUM_MOVE_BYTES
                   for t in tensors)

    def _placed_sum(self, what, out, own, at, outputs, then=None):
        """Data movement as a sum: every rank fills the flat float tensor
        `out` with -0.0 but for its own part `own` (None: nothing) at
        element `at`, and the nodes sum. x + (-0.0) is x for every x (zeros
        and NaNs included), in any order, so each element ends as the value
        the one rank placed there, bit for bit: one round (combined in a
        node's memory for small tensors) instead of an exchange's store,
        fence and pull. The Work carries `outputs`, after then()."""
        n = 0 if own is None else own.numel()
        slot = out[at:at + n]
        if own is not None and own.data_ptr() != slot.data_ptr() and \
                own.untyped_storage().data_ptr() == \
                out.untyped_storage().data_ptr():
            own = own.clone()  # elsewhere in `out`: the fill would clobber it
        out[:at].fill_(-0.0)
        out[at + n:].fill_(-0.0)
        if own is not None and own.data_ptr() != slot.data_ptr():
            slot.copy_(own)
        return self._rounds(what, [out], "SUM", outputs, then)

    def _nodes_remote(self):
        """Whether rank 0 reaches the memory nodes over a link rather than
        through memory they map: rank 0's view, from the group's store, so
        that every rank takes the same path."""
        if self._remote is None:
            self._remote = self._store.get("membox/nodes/remote") == b"1"
        return self._remote

    def _on_nodes(self, name, tensors):
        """Whether the nodes sum this reduction: a sum or average of
        floating-point tensors, in a group of the whole job (the nodes'
        rounds count every rank of the job)."""
        return not self._sub and name in ("SUM", "AVG") and all(
            t.dtype in _FLOATS for t in tensors)

    # ---------------------------------------------------------- exchanges
    def _fence_round(self):
        """Every rank meets here: one 4-byte round on the nodes, or, in a
        subgroup, a counter in the group's store."""
        if self._sub:
            return self._fence_in_store()
        self._one[0] = 1.0
        self._client.push_pull(self._fence, self._one, self._one).wait(
            self._timeout.total_seconds())

    def _fence_in_store(self):
        """A subgroup's fence: each rank adds one to the fence's counter in
        the group's store and waits until every rank has. Once a rank is
        past fence n, every rank has left fence n - 1's wait, so rank 0
        removes that counter then."""
        import time
        n = self._fences
        self._fences += 1
        key = "membox/fence/%d" % n
        self._store.add(key, 1)
        until = time.monotonic() + self._timeout.total_seconds()
        pause = 50e-6
        while self._store.add(key, 0) < self._size:
            if time.monotonic() > until:
                raise RuntimeError(
                    "membox backend: timed out after %s at a fence of the "
                    "group's %d ranks (%d arrived)" % (
                        self._timeout, self._size, self._store.add(key, 0)))
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
        if n >= 1 and self._rank == 0:
            self._store.delete_key("membox/fence/%d" % (n - 1))

    def _exchange(self, sends, recvs):
        """On the exchange thread: `sends` {dst or None (every rank): bytes
        tensor}, `recvs` {src: (bytes tensor out, from_all)}. Over the
        group's mesh while the direct path is on (one all-to-all: the pairs
        that exchange nothing send an empty notice), else through the
        nodes (_exchange_on_nodes)."""
        if self._mesh_path():
            none = torch.empty(0, dtype=torch.uint8, device="cpu")
            every = sends.get(None)
            outs = [recvs[q][0] if q in recvs else none
                    for q in range(self._size)]
            ins = [sends.get(q, every if every is not None else none)
                   if q != self._rank else none for q in range(self._size)]
            self._ensure_mesh()
            self._mesh.alltoall([t.numpy() for t in ins],
                                [t.numpy() for t in outs])
            return
        self._exchange_on_nodes(sends, recvs)

    def _exchange_on_nodes(self, sends, recvs):
        """Stores, meets the other ranks at the fence, pulls. Keys
        alternate between two sets (a rank cannot store into the set the
        others may still be reading from: it would have to pass the fence
        after those reads)."""
        parity = self._exchanges % 2
        self._exchanges += 1
        handles = []
        for dst, data in sends.items():
            n = data.numel()
            key = self._key(3, parity, self._rank, dst, n)
            self._declare(key, n)
            buf = self._buffer(key, n)
            np.copyto(buf[:n], data.numpy()) if n else None
            handles.append(self._client.store(key, buf))
        # Every rank declares what it pulls before the fence: a pull of a
        # stored key reads what is there now.
        pulls = []
        for src, (out, from_all) in recvs.items():
            n = out.numel()
            key = self._key(3, parity, src, None if from_all else self._rank,
                            n)
            self._declare(key, n)
            pulls.append((key, out, n))
        self._wait(handles)
        self._fence_round()
        handles = []
        for key, out, n in pulls:
            buf = self._buffer(key, n)
            handles.append((self._client.pull(key, buf), buf, out, n))
        for h, buf, out, n in handles:
            h.wait(self._timeout.total_seconds())
            if n:
                out.numpy()[:] = buf[:n]

    # ---------------------------------------------------------- direct path
    def _direct(self, total_bytes):
        """Whether an all_gather of `total_bytes` (the output), a
        reduce_scatter (the input), a broadcast or a subgroup's float32
        sum of that many goes over the group's own ring of workers: large
        (from 1 MiB where the nodes are on other hosts, 512 KiB where they
        map the workers' memory). Every rank sees the same sizes and the
        same rank 0's view of the nodes, so every rank takes the same
        path."""
        if not (self._size > 1 and _DIRECT_BYTES > 0):
            return False
        return total_bytes >= (_DIRECT_BYTES if self._nodes_remote() else
                               _DIRECT_BYTES_ONE_HOST)

    def _ring_gather(self, flat, chunk_bytes):
        """On the exchange thread: the uint8 tensor `flat` holds every
        rank's chunk of `chunk_bytes`, this rank's filled in; the ring
        fills the rest. The ring is made on first use: each rank listens
        on its address toward the first memory node (the interface the
        job already uses) and finds the others' in the group's store."""
        self._ensure_ring()
        self._ring.allgather(flat.numpy(), chunk_bytes)

    def _ensure_ring(self):
        if self._ring is None:
            # Pipelined in segments where the ranks talk over links (the
            # nodes on other hosts, rank 0's view: every rank cuts alike).
            seg = _RING_SEGMENT_BYTES if self._nodes_remote() else 0
            self._ring = self._connect_direct("ring", membox._core.Ring,
                                              _RING_MAX_BYTES,
                                              segment_bytes=seg)

    def _ensure_mesh(self):
        if self._mesh is None:
            self._mesh = self._connect_direct("mesh", membox._core.Mesh,
                                              _MESH_MAX_BYTES)

    def _direct_address(self):
        """This rank's address toward the first memory node: the interface
        the job already uses, where the direct paths listen."""
        return _split.address_toward(MemboxBackend._first_proxy or _proxies(
            self._store, self._rank, self._timeout)[0])

    def _connect_direct(self, kind, make, max_bytes, **options):
        """A ring or mesh of this group's ranks, connected through the
        group's store under "membox/<kind>/<rank>" (_split.connect_direct)."""
        return _split.connect_direct(
            self._store, self._rank, self._size, self._direct_address(),
            "membox/" + kind, make, max_bytes, self._timeout, **options)

    def _gather_all(self, t):
        """Every rank's `t` (same shape), stacked: on the exchange thread."""
        c = t.contiguous()
        out = torch.empty((self._size,) + tuple(t.shape), dtype=t.dtype,
                          device="cpu")
        recvs = {q: (_bytes_view(out[q]), True) for q in range(self._size)
                 if q != self._rank}
        out[self._rank].copy_(c)
        self._exchange({None: _bytes_view(c)}, recvs)
        return out

    # ------------------------------------------------------ split all_reduce
    def _split(self, name, tensors):
        """Whether this all_reduce is split between the workers' ring and
        the nodes: one large contiguous float32 tensor, SUM or AVG, in a
        group of the whole job (the same answer on every rank), with nodes
        on other hosts than rank 0: nodes that map the workers' memory (one
        host) sum at memory speed, and the ring would only slow them down.
        (Rank 0's view is in the group's store, so every rank agrees.)"""
        n = self._ring_candidate(name, tensors)
        if n is None or n < _SPLIT_BYTES:
            return False
        return self._nodes_remote() or _SPLIT_ON_ONE_HOST

    def _ring_whole(self, name, tensors):
        """Whether this all_reduce goes around the workers' ring alone:
        what _split would split but below its threshold, down to
        _RING_SUM_BYTES, with the nodes on other hosts. There the
        replicated nodes' round waits for its backup copies between the
        pushes and the answers, and the split's two paths are too short
        to balance; below _RING_SUM_BYTES the ring's 2(p - 1) dependent
        steps cost more than the nodes' one round."""
        n = self._ring_candidate(name, tensors)
        if n is None or not _RING_SUM_BYTES <= n < _SPLIT_BYTES:
            return False
        return self._nodes_remote()

    def _ring_candidate(self, name, tensors):
        """The bytes of an all_reduce the workers' ring may take (alone or
        split): one contiguous float32, bfloat16 or float16 tensor, SUM or
        AVG, in a group of the whole job, with the direct path and the
        split on; else None."""
        if not (_SPLIT_BYTES > 0 and _DIRECT_BYTES > 0 and not self._sub and
                self._size > 1 and name in ("SUM", "AVG") and
                len(tensors) == 1 and tensors[0].dtype in _RING_DTYPES and
                tensors[0].is_contiguous()):
            return None
        return tensors[0].numel() * tensors[0].element_size()

    def _split_allreduce(self, t, name):
        """On the exchange thread: the first share/16 of `t` over the
        workers' ring while the rest goes through the nodes; the share
        follows the paths' measured speeds, agreed through the group's
        store (_split.Share)."""
        share = self._share.take()
        flat = t.detach().view(-1)
        cut = flat.numel() * share // _SPLIT_STEPS
        head, tail = flat[:cut], flat[cut:]
        done = threading.Event()
        nodes = [None, None]  # error, seconds

        def tail_done(err):
            nodes[0], nodes[1] = err, time.perf_counter() - t0
            done.set()

        t0 = time.perf_counter()
        if tail.numel():
            self._round(tail, space="split").add_done_callback(tail_done)
        else:
            tail_done(None)
        self._ring_allreduce(head)
        ring_s = time.perf_counter() - t0
        if not done.wait(self._timeout.total_seconds()):
            raise RuntimeError("membox backend: all_reduce: the nodes' part "
                               "timed out after %s" % self._timeout)
        if nodes[0] is not None:
            raise RuntimeError("membox backend: all_reduce: %s" % nodes[0])
        if name == "AVG":
            flat.div_(self._size)
        self._share.measured(share, ring_s, nodes[1])

    def _ring_allreduce(self, flat):
        """The sum of `flat` (1-D; float32, bfloat16 or float16: a 16-bit
        sum is rounded at each add, as Gloo's is) in place around the ring,
        in pieces of at most the ring's buffer."""
        name = _RING_DTYPES[flat.dtype]
        step = _RING_MAX_BYTES // flat.element_size()
        for i in range(0, flat.numel(), step):
            self._ensure_ring()
            self._ring.allreduce(flat_numpy(flat[i:i + step]), name)

    # --------------------------------------------------------- collectives
    @staged("inout")
    def allreduce(self, tensors, opts):
        self._check("all_reduce", tensors)
        name = _op_name(opts.reduceOp)
        if self._split(name, tensors):
            t = tensors[0]
            return self._submit("all_reduce(%s)" % name, tensors,
                                lambda: self._split_allreduce(t, name))
        whole = self._ring_whole(name, tensors)
        if self._on_nodes(name, tensors) and not whole:
            return self._rounds("all_reduce", tensors, name, tensors)

        def run():
            for t in tensors:
                if whole or self._ring_sum(name, t):
                    c = t if t.is_contiguous() else t.contiguous()
                    flat = c.view(-1)
                    self._ring_allreduce(flat)
                    if name == "AVG":
                        flat.div_(self._size)
                    if c is not t:
                        t.copy_(c)
                else:
                    t.copy_(_local_reduce(name, self._gather_all(t)))
        return self._submit("all_reduce(%s)" % name, tensors, run)

    def _ring_sum(self, name, t):
        """Whether a subgroup's all_reduce of `t` goes around its ring of
        workers: a large float32, bfloat16 or float16 sum or average (the
        nodes' rounds count every rank of the job, so a subgroup's sums
        never go there; a small one is gathered over the mesh and summed
        on each rank)."""
        return (self._sub and name in ("SUM", "AVG") and
                t.dtype in _RING_DTYPES and _DIRECT_BYTES > 0 and
                t.numel() * t.element_size() >= _SUB_RING_BYTES)

    @staged("inout")
    def allreduce_coalesced(self, tensors, opts):
        self._check("all_reduce_coalesced", tensors)
        name = _op_name(opts.reduceOp)
        if not tensors:
            return _done("all_reduce_coalesced", tensors, self._timeout)
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise RuntimeError("membox backend: all_reduce_coalesced needs "
                               "tensors of one dtype")
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if self._on_nodes(name, [flat]):
            def scatter_back():
                at = 0
                for t in tensors:
                    t.copy_(flat[at:at + t.numel()].view_as(t))
                    at += t.numel()
            return self._rounds("all_reduce_coalesced", [flat], name,
                                tensors, then=scatter_back)

        def run():
            r = _local_reduce(name, self._gather_all(flat))
            at = 0
            for t in tensors:
                t.copy_(r[at:at + t.numel()].view_as(t))
                at += t.numel()
        return self._submit("all_reduce_coalesced", tensors, run)

    @staged("inout")
    def reduce(self, tensors, opts):
        self._check("reduce", tensors)
        name = _op_name(opts.reduceOp)
        root = opts.rootRank
        if self._on_nodes(name, tensors) and len(tensors) == 1:
            if self._rank == root:
                return self._rounds("reduce", tensors, name, tensors)
            # A rank other than the root only pushes its part; its tensor
            # stays as it was.
            t = tensors[0].contiguous()
            w = _Work("reduce", tensors, self._timeout)
            self._round(t, push_only=True).add_done_callback(
                lambda err: w._finish(None if err is None else RuntimeError(
                    "membox backend: reduce: %s" % err)))
            return w

        def run():
            for t in tensors:
                stacked = self._gather_to(root, t)
                if stacked is not None:
                    t.copy_(_local_reduce(name, stacked))
        return self._submit("reduce(%s)" % name, tensors, run)

    def _gather_to(self, root, t):
        """Every rank's `t` stacked on `root` (None elsewhere)."""
        c = t.contiguous()
        if self._rank != root:
            self._exchange({root: _bytes_view(c)}, {})
            return None
        out = torch.empty((self._size,) + tuple(t.shape), dtype=t.dtype,
                          device="cpu")
        out[root].copy_(c)
        self._exchange({}, {q: (_bytes_view(out[q]), False)
                            for q in range(self._size) if q != root})
        return out

    @staged("inout")
    def broadcast(self, tensors, opts):
        self._check("broadcast", tensors)
        root = opts.rootRank
        if len(tensors) == 1 and self._moves_as_sum(tensors) and not (
                self._mesh_path() and self._nodes_remote()):
            # One round on the nodes where they map the workers' memory
            # (one host); across hosts over the mesh (below).
            t = tensors[0]
            c = t if t.is_contiguous() else t.contiguous()
            flat = c.view(-1)
            return self._placed_sum(
                "broadcast", flat, flat if self._rank == root else None, 0,
                tensors, None if c is t else lambda: t.copy_(c))

        def run():
            for t in tensors:
                nb = t.numel() * t.element_size()
                if nb and self._direct(nb):  # down the workers' ring
                    c = t.contiguous()
                    self._ensure_ring()
                    self._ring.broadcast(_bytes_view(c).numpy(), root)
                    if c is not t:
                        t.copy_(c)
                elif nb and self._tree_broadcast(nb):
                    c = t.contiguous()
                    self._tree(_bytes_view(c), root)
                    if c is not t:
                        t.copy_(c)
                elif self._rank == root:
                    self._exchange({None: _bytes_view(t.contiguous())}, {})
                else:
                    c = torch.empty_like(t, memory_format=torch.contiguous_format)
                    self._exchange({}, {root: (_bytes_view(c), True)})
                    t.copy_(c)
        moved = sum(t.numel() * t.element_size() for t in tensors)
        return self._submit("broadcast", tensors, run,
                            inline=self._inline_a2a(moved) and
                            not self._direct(moved))

    def _tree_broadcast(self, nb):
        """Whether a broadcast of `nb` bytes below the ring's threshold
        goes down a binomial tree of mesh exchanges: large enough, in a
        group of the whole job of 4 ranks or more, with the nodes on other
        hosts (where the links, not memory, set the time). The same answer
        on every rank."""
        return (nb >= _TREE_BROADCAST_BYTES and self._size >= 4 and
                not self._sub and self._mesh_path() and self._nodes_remote())

    def _tree(self, buf, root):
        """Broadcasts bytes tensor `buf` from `root` down a binomial tree:
        in step k (1, 2, 4, ...) each rank that has the bytes (relative
        rank below k) sends them to the rank k further on. Each step is one
        mesh exchange, so the pairs' sizes are checked as in any other."""
        rel = (self._rank - root) % self._size
        k = 1
        while k < self._size:
            if rel < k and rel + k < self._size:
                self._exchange({(self._rank + k) % self._size: buf}, {})
            elif k <= rel < 2 * k:
                self._exchange({}, {(self._rank - k) % self._size:
                                    (buf, False)})
            else:
                self._exchange({}, {})
            k *= 2

    @staged("out")
    def allgather(self, output_tensors, input_tensors, opts=None):
        self._check("all_gather", input_tensors)
        for outs in output_tensors:
            self._check("all_gather", outs)
            if len(outs) != self._size:
                raise ValueError("membox backend: all_gather needs %d output "
                                 "tensors, got %d" % (self._size, len(outs)))

        t, outs = (input_tensors[0], output_tensors[0]) \
            if len(input_tensors) == 1 else (None, ())
        if t is not None and self._moves_as_sum([t], self._size) and \
                all(o.dtype == t.dtype and o.numel() == t.numel()
                    for o in outs):
            n = t.numel()
            flat = torch.empty(n * self._size, dtype=t.dtype, device="cpu")

            def unpack():
                for q, o in enumerate(outs):
                    o.copy_(flat[q * n:(q + 1) * n].view_as(o))
            return self._placed_sum("all_gather", flat, t.reshape(-1),
                                    self._rank * n, output_tensors, unpack)

        def run():
            for outs, t in zip(output_tensors, input_tensors):
                c = t.contiguous()
                nb = c.numel() * c.element_size()
                if nb and self._direct(nb * self._size):
                    flat = torch.empty(nb * self._size, dtype=torch.uint8,
                                       device="cpu")
                    flat[self._rank * nb:(self._rank + 1) * nb].copy_(
                        _bytes_view(c))
                    self._ring_gather(flat, nb)
                    for q, o in enumerate(outs):
                        o.copy_(flat[q * nb:(q + 1) * nb].view(c.dtype)
                                .view_as(o))
                    continue
                tmp = [torch.empty_like(o, memory_format=torch.contiguous_format)
                       for o in outs]
                recvs = {q: (_bytes_view(tmp[q]), True)
                         for q in range(self._size) if q != self._rank}
                self._exchange({None: _bytes_view(c)}, recvs)
                for q, o in enumerate(outs):
                    o.copy_(c.view_as(o) if q == self._rank else tmp[q])
        return self._submit("all_gather", output_tensors, run)

    @staged("out")
    def all_gather_single(self, output, input, opts=None):
        self._check("all_gather_into_tensor", [output, input])
        if output.numel() != input.numel() * self._size:
            raise ValueError("membox backend: all_gather_into_tensor's output "
                             "must hold world_size x the input")
        if self._moves_as_sum([output]) and input.dtype == output.dtype:
            # FSDP2's input is often the output's own chunk: left in place.
            c = output if output.is_contiguous() else output.contiguous()
            return self._placed_sum(
                "all_gather_into_tensor", c.view(-1),
                input.contiguous().view(-1), self._rank * input.numel(),
                [output], None if c is output else lambda: output.copy_(c))

        def run():
            out = output.contiguous()
            parts = out.view(-1).chunk(self._size)
            c = input.contiguous().view(-1)
            nb = c.numel() * c.element_size()
            if nb and self._direct(nb * self._size):
                parts[self._rank].copy_(c)
                self._ring_gather(_bytes_view(out), nb)
                if out is not output:
                    output.copy_(out)
                return
            recvs = {q: (_bytes_view(parts[q]), True)
                     for q in range(self._size) if q != self._rank}
            self._exchange({None: _bytes_view(c)}, recvs)
            parts[self._rank].copy_(c)
            if out is not output:
                output.copy_(out)
        return self._submit("all_gather_into_tensor", [output], run)

    @staged("out")
    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        # output_lists[r][i] is rank r's input i; allgather takes, per
        # input, the list over ranks.
        if len(output_lists) != self._size or any(
                len(o) != len(input_tensors) for o in output_lists):
            raise ValueError("membox backend: all_gather_coalesced needs %d "
                             "lists of %d tensors" % (self._size,
                                                      len(input_tensors)))
        per_input = [[output_lists[r][i] for r in range(self._size)]
                     for i in range(len(input_tensors))]
        return self.allgather(per_input, input_tensors, opts)

    @staged("out")
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._all_of("all_gather_into_tensor_coalesced", outputs, [
            self.all_gather_single(o, i, opts)
            for o, i in zip(outputs, inputs)])

    def _all_of(self, what, outputs, works):
        """A Work done when every one of `works` is (with the first error)."""
        w = _Work(what, outputs, self._timeout)
        left = [len(works)]
        lock = threading.Lock()

        def one_done(fut):
            err = None
            try:
                fut.wait()
            except Exception as e:  # noqa: BLE001 - the Work carries it
                err = e if isinstance(e, RuntimeError) else RuntimeError(str(e))
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if err is not None or last:
                w._finish(err)

        if not works:
            w._finish()
        for x in works:
            x._fut.add_done_callback(one_done)
        return w

    def _check_root_list(self, op, side, tensors, root):
        """The root of a gather or scatter passes one list of a tensor per
        rank on its `side`."""
        if self._rank == root and (len(tensors) != 1 or
                                   len(tensors[0]) != self._size):
            raise ValueError("membox backend: %s needs %d %s tensors on the "
                             "root" % (op, self._size, side))

    @staged("out")
    def gather(self, output_tensors, input_tensors, opts):
        self._check("gather", input_tensors)
        root = opts.rootRank
        self._check_root_list("gather", "output", output_tensors, root)

        def run():
            stacked = self._gather_to(root, input_tensors[0])
            if stacked is not None:
                for q, o in enumerate(output_tensors[0]):
                    o.copy_(stacked[q])
        return self._submit("gather", output_tensors, run)

    @staged("out")
    def scatter(self, output_tensors, input_tensors, opts):
        self._check("scatter", output_tensors)
        root = opts.rootRank
        self._check_root_list("scatter", "input", input_tensors, root)

        def run():
            out = output_tensors[0]
            if self._rank == root:
                ins = [t.contiguous() for t in input_tensors[0]]
                self._exchange({q: _bytes_view(ins[q])
                                for q in range(self._size) if q != root}, {})
                out.copy_(ins[root])
            else:
                c = torch.empty_like(out, memory_format=torch.contiguous_format)
                self._exchange({}, {root: (_bytes_view(c), False)})
                out.copy_(c)
        return self._submit("scatter", output_tensors, run)

    @staged("out")
    def reduce_scatter(self, output_tensors, input_tensors, opts):
        self._check("reduce_scatter", output_tensors)
        name = _op_name(opts.reduceOp)
        for ins in input_tensors:
            if len(ins) != self._size:
                raise ValueError("membox backend: reduce_scatter needs %d "
                                 "input tensors" % self._size)
        dtype = output_tensors[0].dtype if output_tensors else None
        if len(output_tensors) == 1 and name in ("SUM", "AVG") and all(
                t.dtype == dtype and t.numel() ==
                output_tensors[0].numel()
                for t in list(input_tensors[0]) + output_tensors) and \
                dtype in _RING_DTYPES and self._direct(
                    output_tensors[0].numel() *
                    output_tensors[0].element_size() * self._size):
            out, ins = output_tensors[0], input_tensors[0]

            def ring():  # around the workers' ring (the direct path)
                n = out.numel()
                flat = torch.cat([t.detach().reshape(-1) for t in ins])
                self._ensure_ring()
                self._ring.reduce_scatter(flat_numpy(flat), n,
                                          _RING_DTYPES[flat.dtype])
                mine = flat[self._rank * n:(self._rank + 1) * n]
                if name == "AVG":
                    mine.div_(self._size)
                out.copy_(mine.view_as(out))
            return self._submit("reduce_scatter(%s)" % name, output_tensors,
                                ring)
        if self._mesh_path() and len(output_tensors) == 1 and not (
                self._on_nodes(name, output_tensors) and
                not self._nodes_remote()):
            # Over the mesh: each rank's chunk q straight to rank q, summed
            # there (one step, n(p-1)/p each way). Where the nodes map the
            # workers' memory (one host) their rounds are faster: 4w4m,
            # 4-256 KiB, the mesh took 0.25-0.50x Gloo's time, the rounds
            # 0.81-1.75x; one host, the rounds 0.38-0.56x, the mesh
            # 0.87-1.04x.
            out, ins = output_tensors[0], input_tensors[0]

            def mesh():
                got = [torch.empty_like(out,
                                        memory_format=torch.contiguous_format)
                       for _ in range(self._size)]
                self._alltoall(got, [t.contiguous() for t in ins])
                out.copy_(_local_reduce(name, torch.stack(got)))
            moved = 2 * sum(t.numel() * t.element_size() for t in ins)
            return self._submit("reduce_scatter(%s)" % name, output_tensors,
                                mesh, inline=self._inline_a2a(moved))
        if self._on_nodes(name, output_tensors) and len(output_tensors) == 1:
            return self._reduce_scatter_rounds(
                output_tensors[0], input_tensors[0], name, output_tensors)

        def run():
            for out, ins in zip(output_tensors, input_tensors):
                flat = torch.stack([t.contiguous() for t in ins])
                out.copy_(_local_reduce(name, self._gather_all(flat))[
                    self._rank])
        return self._submit("reduce_scatter(%s)" % name, output_tensors, run)

    @staged("out")
    def reduce_scatter_single(self, output, input, opts):
        self._check("reduce_scatter_tensor", [output, input])
        if input.numel() != output.numel() * self._size:
            raise ValueError("membox backend: reduce_scatter_tensor's input "
                             "must hold world_size x the output")
        chunks = list(input.contiguous().view(-1).chunk(self._size))
        return self.reduce_scatter([output], [[c.view_as(output)
                                               for c in chunks]], opts)

    @staged("out")
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return self._all_of("reduce_scatter_tensor_coalesced", outputs, [
            self.reduce_scatter_single(o, i, opts)
            for o, i in zip(outputs, inputs)])

    def _reduce_scatter_rounds(self, out, ins, name, outputs):
        """Every rank pushes every chunk (a round per chunk) and pulls only
        its own: a rank's link carries the input out and one chunk back."""
        w = _Work("reduce_scatter", outputs, self._timeout)
        mine = ins[self._rank].contiguous().clone()
        pushed = [c.contiguous() for c in ins]
        left = [len(pushed)]
        lock = threading.Lock()

        def one_done(err):
            if err is not None:
                return w._finish(RuntimeError(
                    "membox backend: reduce_scatter: %s" % err))
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                if name == "AVG":
                    mine.div_(self._size)
                out.copy_(mine.view_as(out))
                w._finish()

        for q, c in enumerate(pushed):
            h = self._round(mine if q == self._rank else c,
                            push_only=q != self._rank)
            h.add_done_callback(one_done)
        return w

    @staged("out")
    def all_to_all_single(self, output, input, output_split_sizes,
                          input_split_sizes, opts=None):
        self._check("all_to_all_single", [output, input])

        def splits(t, sizes):
            flat = t.contiguous().view(t.shape[0], -1) if t.dim() else \
                t.contiguous().view(1, -1)
            if not sizes:
                if t.shape[0] % self._size:
                    raise ValueError("membox backend: all_to_all_single: "
                                     "dim 0 does not divide by world_size")
                sizes = [t.shape[0] // self._size] * self._size
            if len(sizes) != self._size or sum(sizes) != t.shape[0]:
                raise ValueError("membox backend: all_to_all_single: bad "
                                 "split sizes %s" % list(sizes))
            return list(flat.split(list(sizes))), flat

        outs, out_flat = splits(output, list(output_split_sizes))
        ins, _ = splits(input, list(input_split_sizes))

        def run():
            self._alltoall(outs, ins)
            if out_flat.data_ptr() != output.data_ptr():
                output.copy_(out_flat.view_as(output))
        moved = (output.numel() * output.element_size() +
                 input.numel() * input.element_size())
        return self._submit("all_to_all_single", [output], run,
                            inline=self._inline_a2a(moved))

    @staged("out")
    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._check("all_to_all", output_tensors + input_tensors)
        if len(output_tensors) != self._size or \
                len(input_tensors) != self._size:
            raise ValueError("membox backend: all_to_all needs %d tensors "
                             "each way" % self._size)

        def run():
            outs = [torch.empty_like(o, memory_format=torch.contiguous_format)
                    for o in output_tensors]
            self._alltoall(outs, [t.contiguous() for t in input_tensors])
            for o, t in zip(output_tensors, outs):
                o.copy_(t)
        moved = sum(t.numel() * t.element_size()
                    for t in output_tensors + input_tensors)
        return self._submit("all_to_all", output_tensors, run,
                            inline=self._inline_a2a(moved))

    def _mesh_path(self):
        """Whether all_to_all and exchanges go over the group's mesh of
        workers (and send/recv straight between them): while the direct
        path is on, in any group."""
        return self._size > 1 and _DIRECT_BYTES > 0

    def _inline_a2a(self, moved):
        return self._mesh_path() and moved <= _INLINE_BYTES

    def _alltoall(self, outs, ins):
        """outs[q] <- rank q's ins[this rank]: over the workers' mesh (each
        pair's bytes cross once, directly), else by one exchange through
        the nodes."""
        if self._mesh_path():
            self._ensure_mesh()
            tmp = [o if o.is_contiguous() else o.contiguous() for o in outs]
            self._mesh.alltoall(
                [_bytes_view(t.contiguous()).numpy() for t in ins],
                [_bytes_view(t).numpy() for t in tmp])
            for o, t in zip(outs, tmp):
                if o is not t:
                    o.copy_(t)
            return
        sends = {q: _bytes_view(ins[q].contiguous())
                 for q in range(self._size) if q != self._rank}
        tmp = [o if o.is_contiguous() else o.contiguous() for o in outs]
        recvs = {q: (_bytes_view(tmp[q]), False)
                 for q in range(self._size) if q != self._rank}
        self._exchange(sends, recvs)
        tmp[self._rank].copy_(ins[self._rank])
        for o, t in zip(outs, tmp):
            if o is not t:
                o.copy_(t)

    def barrier(self, opts=None):
        if self._sub and self._mesh_path():
            # Every pair's empty notice: no rank leaves before all came.
            return self._submit("barrier", [], self._mesh_barrier,
                                inline=True)
        return self._submit("barrier", [], self._fence_round, inline=True)

    def monitored_barrier(self, opts, wait_all_ranks=False):
        """torch's monitored_barrier, with Gloo's semantics and messages:
        every other rank checks in with rank 0, which names the ranks that
        did not within opts.timeout (the first, or with wait_all_ranks
        all of them) and then releases or fails the others. Through the
        group's store, so it works whatever state the group's transfers
        are in: it is how a job finds the rank that hangs."""
        n = self._monitored_barriers
        self._monitored_barriers += 1
        base = "membox/monitored/%d" % n
        secs = max(opts.timeout.total_seconds(), 0.0)
        ms = int(secs * 1000)
        deadline = time.monotonic() + secs
        done = base + "/done"
        if self._rank != 0:
            self._store.set("%s/%d" % (base, self._rank), "1")
            if not self._store_wait_until([done], deadline) or \
                    self._store.get(done) != b"ok":
                raise RuntimeError(
                    "Rank %d successfully reached monitoredBarrier, but "
                    "received errors while waiting for send/recv from rank "
                    "0. Please check rank 0 logs for faulty rank."
                    % self._rank)
            return
        keys = {r: "%s/%d" % (base, r) for r in range(1, self._size)}
        failed = []
        if wait_all_ranks:
            self._store_wait_until(list(keys.values()), deadline)
            failed = [r for r, k in keys.items() if not self._store.check([k])]
            why = "Ranks %s failed to pass monitoredBarrier in %d ms" % (
                ", ".join(map(str, failed)), ms)
        else:
            for r, k in keys.items():
                if time.monotonic() >= deadline and not self._store.check([k]):
                    failed, why = [r], (
                        "Rank 0 timed out in monitoredBarrier after %d ms "
                        "(rank %d had not checked in)" % (ms, r))
                    break
                if not self._store_wait_until([k], deadline):
                    failed, why = [r], (
                        "Rank %d failed to pass monitoredBarrier in %d ms"
                        % (r, ms))
                    break
        for k in keys.values():
            self._store.delete_key(k)
        if n > 0 and not failed:  # every rank has read the last one's word
            self._store.delete_key("membox/monitored/%d/done" % (n - 1))
        self._store.set(done, "failed" if failed else "ok")
        if failed:
            raise RuntimeError("[Rank 0]: " + why)

    def _mesh_barrier(self):
        self._ensure_mesh()
        none = np.empty(0, dtype=np.uint8)
        self._mesh.alltoall([none] * self._size, [none] * self._size)

    # ------------------------------------------------------ point to point
    # In a group of the whole job (direct path on), a send and a recv go
    # straight between the two workers (collective::PointToPoint), each on
    # the lane of its peer and direction, in issue order; a send that fits
    # in one message runs at once when its lane is idle.
    #
    # Otherwise a send stores into a key of its own (sender, receiver, tag,
    # the pair's count) and says so in the group's store; the receiver
    # waits for that word, pulls, and says it has read, which the sender
    # waits for before reusing the key two sends later.
    def _p2p_direct(self):
        return self._mesh_path()

    def _ensure_pairs(self):
        """This rank's PointToPoint, made on its first send or recv, its
        endpoint published under "membox/pairs/<rank>" (no other rank need
        be there: connections are made per pair as they are used)."""
        with self._pairs_lock:
            if self._pairs is None:
                self._pairs = membox._core.PointToPoint(
                    self._rank, self._size, "%s:0" % self._direct_address(),
                    membox._secret(), _MESH_MAX_BYTES,
                    self._timeout.total_seconds())
                self._store.set("membox/pairs/%d" % self._rank,
                                self._pairs.endpoint)
            return self._pairs

    def _pair_to(self, dst):
        """The PointToPoint, knowing dst's endpoint: published when dst
        made its own (its first send or recv), waited for here."""
        pairs = self._ensure_pairs()
        if dst not in self._peers_known:
            key = "membox/pairs/%d" % dst
            self._store_wait(key)
            pairs.add_peer(dst, self._store.get(key).decode())
            self._peers_known.add(dst)
        return pairs

    def _lane(self, kind, peer):
        """The _Jobs (and its thread) of sends to, or receives from, peer."""
        lane = self._lanes.get((kind, peer))
        if lane is None:
            lane = self._lanes[(kind, peer)] = _Jobs(
                "membox-%s-%s" % (kind, peer))
        return lane

    def _direct_p2p(self, kind, peer, tensors, fn, inline):
        w = _Work("%s %d" % (kind, peer), tensors, self._timeout)
        self._lane(kind, peer).submit(w, fn, inline)
        return w

    @staged("in")
    def send(self, tensors, dst, tag):
        self._check("send", tensors)
        t = tensors[0].contiguous()
        if self._p2p_direct():
            data = _bytes_view(t)

            def direct():
                self._pair_to(dst).send(dst, data.numpy(), tag % (1 << 64))
            return self._direct_p2p(
                "send to", dst, tensors, direct,
                inline=(data.numel() <= _P2P_INLINE_BYTES and
                        dst in self._peers_known))
        n = self._p2p_sent.get((dst, tag), 0)
        self._p2p_sent[(dst, tag)] = n + 1
        data = _bytes_view(t).clone()

        def run():
            base = "membox/p2p/%d/%d/%d/%d" % (self._rank, dst, tag, n)
            if n >= 2:
                old = "membox/p2p/%d/%d/%d/%d/read" % (self._rank, dst, tag,
                                                       n - 2)
                self._store_wait(old)
                self._store.delete_key(old)
            key = self._key(4, n % 2, self._rank, dst, tag, data.numel())
            self._declare(key, data.numel())
            buf = self._buffer(key, data.numel())
            if data.numel():
                np.copyto(buf[:data.numel()], data.numpy())
            self._client.store(key, buf).wait(self._timeout.total_seconds())
            self._store.set(base, str(data.numel()))
        # Sends and receives do not take the exchange thread: a rank may
        # send and then receive while its peer receives and then sends.
        return self._p2p(("send to %d" % dst), tensors, run)

    @staged("out")
    def recv(self, tensors, src, tag):
        self._check("recv", tensors)
        t = tensors[0]
        if self._p2p_direct():
            def direct():
                c = t if t.is_contiguous() else torch.empty_like(
                    t, memory_format=torch.contiguous_format)
                self._ensure_pairs().recv(src, _bytes_view(c).numpy(),
                                          tag % (1 << 64))
                if c is not t:
                    t.copy_(c)
            # (never on the caller's thread: an irecv before an isend)
            w = self._direct_p2p("recv from", src, tensors, direct,
                                 inline=False)
            w._src = src
            return w
        n = self._p2p_recv.get((src, tag), 0)
        self._p2p_recv[(src, tag)] = n + 1

        def run():
            base = "membox/p2p/%d/%d/%d/%d" % (src, self._rank, tag, n)
            self._store_wait(base)
            size = int(self._store.get(base))
            self._store.delete_key(base)
            if size != t.numel() * t.element_size():
                raise RuntimeError(
                    "membox backend: recv from %d: the send was %d bytes, "
                    "the tensor holds %d" % (src, size,
                                             t.numel() * t.element_size()))
            key = self._key(4, n % 2, src, self._rank, tag, size)
            self._declare(key, size)
            buf = self._buffer(key, size)
            self._client.pull(key, buf).wait(self._timeout.total_seconds())
            c = torch.empty_like(t, memory_format=torch.contiguous_format)
            if size:
                _bytes_view(c).numpy()[:] = buf[:size]
            t.copy_(c)
            self._store.set(base + "/read", "1")
        w = self._p2p("recv from %d" % src, tensors, run)
        w._src = src
        return w

    @staged("out")
    def recvAnysource(self, tensors, tag):
        """The next message under `tag` from any rank (torch's recv with no
        src): over the workers' direct connections, looking at each peer
        in turn (collective::PointToPoint::RecvAny); the Work's
        _source_rank() names the sender. Receives from any rank run in
        issue order on a lane of their own."""
        self._check("recv", tensors)
        t = tensors[0]
        if not self._p2p_direct():
            raise RuntimeError(
                "membox backend: recv without a source needs the direct "
                "path between workers, which MEMBOX_BACKEND_DIRECT_BYTES=0 "
                "turns off; name src, or leave that variable unset")
        w = _Work("recv from any rank", tensors, self._timeout)

        def direct():
            c = t if t.is_contiguous() else torch.empty_like(
                t, memory_format=torch.contiguous_format)
            w._src = self._ensure_pairs().recv_any(_bytes_view(c).numpy(),
                                                   tag % (1 << 64))
            if c is not t:
                t.copy_(c)
        self._lane("recv from", "any").submit(w, direct, inline=False)
        return w

    def _store_wait(self, key):
        """Waits for `key` in the group's store by polling: a blocking wait
        would hold the store's one connection, and a send's set() on
        another thread would queue behind it (two ranks sending to each
        other while each waits for the other's word would never meet)."""
        if not self._store_wait_until(
                [key], time.monotonic() + self._timeout.total_seconds()):
            raise RuntimeError("Timed out after %s waiting for the peer"
                               % self._timeout)

    def _store_wait_until(self, keys, deadline):
        """Whether every key is in the group's store by `deadline`
        (time.monotonic()), polling as _store_wait does."""
        pause = 50e-6
        while not self._store.check(keys):
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(pause * 2, 5e-3)
        return True

    def _p2p(self, what, outputs, fn):
        w = _Work(what, outputs, self._timeout)

        def run():
            try:
                fn()
                w._finish()
            except Exception as e:  # noqa: BLE001 - the Work carries it
                w._finish(RuntimeError("membox backend: %s: %s" % (what, e)))
            finally:
                self._p2p_threads.discard(threading.current_thread())
        t = threading.Thread(target=run, daemon=True)
        self._p2p_threads.add(t)
        t.start()
        return w

    # -------------------------------------------------------------- teardown
    def shutdown(self):
        """The group is destroyed: its exchange thread ends, and the last
        group of the process's connection closes it (the memory it
        registered goes with it)."""
        if self._closed:
            return
        self._closed = True
        MemboxBackend._open.discard(self)
        _at_exit.forget(self)
        self._jobs.stop()
        for t in list(self._p2p_threads):
            if t is not threading.current_thread():
                t.join(timeout=10)
        shared = MemboxBackend._shared
        stays = False  # the connection goes on serving other groups
        if shared is not None and shared[0] is self._client:
            shared[3] -= 1
            stays = shared[3] > 0
            if not stays:
                MemboxBackend._shared = None
        for lane in self._lanes.values():
            lane.stop()
        self._lanes.clear()
        if stays and self._declared:
            # Destroyed mid-job (a subgroup, or one group of several): its
            # keys go now, once every rank that used them has let them go,
            # instead of when the job ends (the connection's close).
            try:
                self._client.free_scratch(list(self._declared))
            except Exception as e:  # noqa: BLE001 - teardown goes on
                warnings.warn("membox backend: group %s: the memory nodes "
                              "keep its keys until the job ends: %s"
                              % (self._index, e))
            self._declared.clear()
        self._buffers.clear()
        self._one = None
        self._ring = None  # closes its channels
        self._mesh = None
        self._pairs = None
        self._client = None

    def abort(self):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _counted(op):
    """op, counting the group's collectives. Every rank makes the same
    calls (a coalesced op calls the single ones on every rank alike), so
    the counts agree across ranks, which is all torch compares."""
    @functools.wraps(op)
    def run(self, *args, **kwargs):
        self._collectives += 1
        return op(self, *args, **kwargs)
    return run


for _name in ("broadcast", "allreduce", "allreduce_coalesced", "reduce",
              "allgather", "all_gather_single", "allgather_coalesced",
              "all_gather_single_coalesced", "gather", "scatter",
              "reduce_scatter", "reduce_scatter_single",
              "reduce_scatter_single_coalesced", "all_to_all_single",
              "alltoall", "barrier"):
    setattr(MemboxBackend, _name, _counted(getattr(MemboxBackend, _name)))

# torch's name for a receive from any rank (its C++ trampoline looks it up).
MemboxBackend.recv_anysource = MemboxBackend.recvAnysource


if issubclass(MemboxBackend, dist.ProcessGroup):
    # torch before 2.15 calls a ProcessGroup's single-tensor collectives by
    # these names (and binds no Python override for them).
    MemboxBackend._allgather_base = MemboxBackend.all_gather_single
    MemboxBackend._reduce_scatter_base = MemboxBackend.reduce_scatter_single
    MemboxBackend.alltoall_base = MemboxBackend.all_to_all_single
    MemboxBackend.allgather_into_tensor_coalesced = \
        MemboxBackend.all_gather_single_coalesced
    MemboxBackend.reduce_scatter_tensor_coalesced = \
        MemboxBackend.reduce_scatter_single_coalesced

    # The group is its own backend for every device, and keeps the name
    # torch gives it (its C++ side reads the name from a registered
    # backend, which a Python group has none of).
    def _get_backend(self, device=None):
        return self

    def _set_group_name(self, name):
        self._membox_group_name = name

    MemboxBackend._get_backend = _get_backend
    MemboxBackend._set_group_name = _set_group_name
    MemboxBackend.group_name = property(
        lambda self: getattr(self, "_membox_group_name", ""))


def _bridge_recv_anysource():
    """torch's recv with no src asks the group's backend for a receive from
    any rank, then the Work for its sender (_source_rank()). A Python
    backend's Work reaches the caller wrapped by torch (PyWorkHolder, torch
    2.15), which forwards wait() and get_future() but not the sender. So a
    group whose backend for the tensor's device is membox's answers
    recv_anysource with membox's own Work; any other group is untouched."""
    pg = dist.ProcessGroup
    if getattr(pg.recv_anysource, "_membox_bridge", False):
        return
    torch_recv_anysource = pg.recv_anysource

    def recv_anysource(self, tensors, tag):
        backend = None
        if not isinstance(self, MemboxBackend) and tensors:
            try:
                backend = self._get_backend(tensors[0].device)
                # TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper (it checks no
                # point-to-point operation)
                backend = getattr(backend, "wrapped_pg", backend)
            except RuntimeError:
                backend = None
        if isinstance(backend, MemboxBackend):
            return backend.recvAnysource(tensors, tag)
        return torch_recv_anysource(self, tensors, tag)
    recv_anysource._membox_bridge = True
    pg.recv_anysource = recv_anysource


def _create(opts, backend_options=None):
    """torch's extended creator: the group's store, rank and size, and its
    name and ranks in the job (empty for the default group)."""
    return MemboxBackend(opts.store, opts.group_rank, opts.group_size,
                         opts.timeout, list(opts.global_ranks_in_group),
                         opts.group_id)


def register():
    """Registers the "membox" backend with torch.distributed (once)."""
    if "membox" in dist.Backend.backend_list:
        return
    _bridge_recv_anysource()
    dist.Backend.register_backend("membox", _create, extended_api=True,
                                  devices=["cpu", "cuda"])
