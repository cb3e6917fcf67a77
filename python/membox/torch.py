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
"""
import itertools
import os
import queue
import threading
import weakref

import numpy as np
import torch
import torch.nn.functional as F

import membox

_client = None
_declared = set()
_lock = threading.Lock()
_wire = None  # dtype the hook sends float gradients in (init(wire_dtype=))
_WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


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
    way)."""
    global _client, _wire
    if wire_dtype is not None:
        key = str(wire_dtype).replace("torch.", "")
        if key not in _WIRE_DTYPES:
            raise ValueError("wire_dtype must be float16 or bfloat16")
        wire_dtype = _WIRE_DTYPES[key]
    _wire = wire_dtype
    _client = client or membox.connect(_proxies())
    _client.configure(mode=mode, **configure)
    if profile and _client.num_proxies > 1:
        _route(_client)
    return _client


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
    if _client is None:
        raise membox.MemboxError("call membox.torch.init() first")
    return _client


def _flat_numpy(t):
    if t.device.type != "cpu":
        raise membox.MemboxError("membox.torch moves CPU and CUDA tensors "
                                 "(got %s)" % t.device)
    flat = t.detach().contiguous().view(-1)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: same bits
        flat = flat.view(torch.int16)
    return flat.numpy()


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


class _CudaStaging:
    """Page-locked, transport-registered host memory for CUDA tensors.

    A GPU tensor crosses the wire through host memory the transport
    registered (Client.allocate) and CUDA page-locked (cudaHostRegister), so
    one asynchronous copy per direction moves it and the memory nodes read
    and write that memory in place: device -> staging on a device-to-host
    stream, push/pull in place, staging -> device on a host-to-device stream
    (two streams: the copy engines of both directions run at once). The
    streams wait on CUDA events only, never on the whole device.

    Threading: buffer() and the copies run on the caller's thread; a daemon
    thread waits for each device-to-host copy (an event, without the GIL)
    and only then starts the transfer, so backward compute, copies and the
    network overlap bucket by bucket. Buffers live as long as the client.
    """

    def __init__(self, client):
        self._client = weakref.ref(client)  # the client holds this object
        self._buffers = {}  # key -> (numpy uint8 over registered memory, tensor)
        self._streams = {}  # device index -> (d2h, h2d)
        self._lock = threading.Lock()
        self._queue = None
        # Achieved copy rates (bytes, CUDA event pairs), see staging_stats().
        self.timing = False
        self._timed = {"d2h": [], "h2d": []}

    def buffer(self, key, nbytes):
        """The staging buffer of `key` (allocated and pinned on first use)."""
        with self._lock:
            b = self._buffers.get(key)
            if b is not None and b[0].nbytes == nbytes:
                return b
        arr = self._client().allocate(nbytes)
        ptr = arr.ctypes.data
        # A UCX built with CUDA page-locks what it registers already.
        if not torch.from_numpy(arr).is_pinned():
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
            if err != 0:
                raise membox.MemboxError(
                    "cannot page-lock %d bytes of registered memory for CUDA "
                    "staging (cudaHostRegister error %d)" % (nbytes, err))
            # Unlocked when the client goes (its memory is unmapped after).
            weakref.finalize(self._client(), _unpin, ptr)
        b = (arr, torch.from_numpy(arr))
        with self._lock:
            self._buffers[key] = b
        return b

    def streams(self, device):
        with self._lock:
            s = self._streams.get(device.index)
            if s is None:
                s = (torch.cuda.Stream(device), torch.cuda.Stream(device))
                self._streams[device.index] = s
            return s

    def _event(self):
        return torch.cuda.Event(enable_timing=self.timing)

    def to_host(self, src, host, device):
        """Starts copying `src` (on `device`) into pinned `host` once the
        current stream's work on it is done; returns the completion event."""
        if not src.is_contiguous():
            src = src.contiguous()
        d2h, _ = self.streams(device)
        ready = torch.cuda.current_stream(device).record_event()
        d2h.wait_event(ready)
        with torch.cuda.stream(d2h):
            start = self._event()
            start.record(d2h)
            host.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
            done = self._event()
            done.record(d2h)
        src.record_stream(d2h)
        if self.timing:
            self._timed["d2h"].append((host.numel(), start, done))
        return done

    def to_device(self, host, dst, device):
        """Enqueues pinned `host` -> `dst` on the host-to-device stream; the
        caller's current stream must wait on that stream (or on a Future
        completed inside it) before using dst."""
        if not dst.is_contiguous():
            raise membox.MemboxError("membox needs contiguous CUDA tensors")
        _, h2d = self.streams(device)
        with torch.cuda.stream(h2d):
            start = self._event()
            start.record(h2d)
            dst.reshape(-1).view(torch.uint8).copy_(host, non_blocking=True)
            done = self._event()
            done.record(h2d)
        dst.record_stream(h2d)
        if self.timing:
            self._timed["h2d"].append((host.numel(), start, done))
        return h2d

    def after(self, event, fn):
        """Runs fn() on the staging thread once `event` has completed."""
        with self._lock:
            if self._queue is None:
                import atexit
                import queue
                self._queue = queue.SimpleQueue()
                t = threading.Thread(target=self._run,
                                     name="membox-cuda-staging", daemon=True)
                t.start()
                # Ended before the interpreter finalizes: a thread inside
                # torch's C++ then would abort the process at exit.
                atexit.register(self._stop, t)
        self._queue.put((event, fn))

    def _stop(self, thread):
        self._queue.put((None, None))
        thread.join(timeout=10)

    def _run(self):
        while True:
            event, fn = self._queue.get()
            if event is None:
                return
            event.synchronize()  # releases the GIL
            fn()

    def stats(self):
        out = {}
        for d, rows in self._timed.items():
            nbytes = sum(r[0] for r in rows)
            ms = 0.0
            for _, a, b in rows:
                b.synchronize()
                ms += a.elapsed_time(b)
            out[d] = {"bytes": nbytes, "copies": len(rows),
                      "seconds": ms / 1e3,
                      "gbps": nbytes / (ms / 1e3) / 1e9 if ms > 0 else 0.0}
            rows.clear()
        return out


def _unpin(ptr):
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutting down
        pass


def _staging_for(c):
    """The client's _CudaStaging (kept on the client: it lives as long)."""
    s = getattr(c, "_membox_cuda_staging", None)
    if s is None:
        with _lock:
            s = getattr(c, "_membox_cuda_staging", None)
            if s is None:
                s = _CudaStaging(c)
                c._membox_cuda_staging = s
    return s


def staging_stats(timing=None, of=None):
    """Achieved rates of the CUDA staging copies since the last call:
    {"d2h": {"bytes", "copies", "seconds", "gbps"}, "h2d": {...}}.
    staging_stats(timing=True) starts timing them (CUDA events per copy);
    `of` is the client (default: this worker's, from init())."""
    s = _staging_for(of if of is not None else client())
    st = s.stats()
    if timing is not None:
        s.timing = bool(timing)
    return st


def allreduce_hook(state, bucket):
    """DDP communication hook: average the bucket across workers through the
    memory nodes. Returns a Future completed with the averaged bucket.

    CPU buckets are pushed from the bucket and the average comes back into
    the bucket itself: on one host the bucket is moved into shared memory
    the nodes map (_shared_bucket), elsewhere it is registered with the
    transport; where neither works (one host, nodes that cannot map this
    process's files) it is staged and the average lands in registered
    memory that is the Future's result (_result_buffer: DDP copies the
    gradients out of it). CUDA buckets go through page-locked staging
    memory (see _CudaStaging): device-to-host copy on a side stream,
    push/pull once that copy is done, host-to-device copy on another side
    stream, and the Future completes on that stream, so DDP's stream waits
    for it without blocking the host.

    The first iteration goes through the process group's own AllReduce (what
    DDP does without a hook): DDP rebuilds its buckets after it, so keys,
    node storage and staging set up for the first layout would serve one
    iteration and double the start-up cost (4.1 s and 4.5 s for the first two
    iterations of an 84 M-parameter MLP against Gloo's 1.3 s)."""
    t = bucket.buffer()
    if _first_iteration(bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        return default_hooks.allreduce_hook(None, bucket)
    if _wire is not None and t.dtype in (torch.float32, torch.float64):
        return _narrow_push_pull(client(), bucket.index(), t)
    nbytes = t.numel() * t.element_size()
    key = _bucket_key(bucket.index(), t.dtype, nbytes)
    _declare(key, t)
    if t.device.type == "cuda":
        return _cuda_push_pull(client(), key, t, -bucket.index())
    c = client()
    arr = _shared_bucket(c, bucket.index(), t) if c.proxies_map_memory \
        else None
    if arr is not None:  # one host, the bucket mapped by the nodes
        out, result = arr, t
    elif not c.proxies_map_memory:
        arr = _flat_numpy(t)
        _register_bucket(c, bucket.index(), t, arr)
        out, result = arr, t
    else:
        arr = _flat_numpy(t)
        out, result = _result_buffer(c, key, t.numel(), t.dtype)
        result = result.view(t.shape)
    fut = torch.futures.Future()
    handle = c.push_pull(key, arr, out, priority=-bucket.index())

    def done(err):
        if err is None:
            fut.set_result(result)
        else:
            fut.set_exception(_error(err))

    handle.add_done_callback(done)
    return _for_ddp(fut)


def _result_buffer(c, key, numel, dtype):
    """Where the nodes map this worker's memory (one host): the average is
    written by the node into registered memory kept per bucket key, and
    that memory is the Future's result. DDP copies its gradients out of
    whatever tensor the hook returns (Reducer's bucket views out), so the
    average is copied once into the gradients instead of first back into
    the bucket and then into the gradients. The buffer is rewritten only by
    the next round of the same bucket, after DDP has read it. Kept on the
    client (bucket key -> (numpy view, tensor)): it lives as long."""
    with _lock:
        results = getattr(c, "_membox_results", None)
        if results is None:
            results = c._membox_results = {}
        r = results.get(key)
    if r is None:
        arr = c.allocate(numel * torch.empty(0, dtype=dtype).element_size())
        r = (arr, torch.from_numpy(arr).view(dtype))
        with _lock:
            results[key] = r
    return r


_narrow = {}  # bucket index -> the bucket's wire-dtype buffer
_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3,
                torch.bfloat16: 4}


def _bucket_key(index, dtype, nbytes):
    """DDP rebuilds its buckets after the first iteration: a key per
    (index, dtype, size) keeps every declaration consistent on all workers
    (and apart from a wire-type bucket of the same index)."""
    if nbytes >= 1 << 36:
        raise membox.MemboxError("gradient bucket of 64 GiB or more")
    return (index << 40) | (_DTYPE_CODES.get(dtype, 0) << 36) | nbytes


def _narrow_push_pull(c, index, t):
    """The hook with wire_dtype: the bucket is rounded into a buffer of the
    wire type (kept per bucket index, registered with the transport where
    the nodes do not map this worker's memory), averaged on the nodes in
    that type with float32 sums, and widened back into the bucket.

    A CUDA bucket is rounded on its device (on the current stream, so after
    the kernels that wrote it), and only the narrow buffer is staged: half
    the bytes over PCIe in each direction and on the wire. It is widened
    back on the host-to-device stream, after the copy into the narrow buffer
    and before the Future completes, so DDP's stream sees the averaged
    bucket (see _cuda_push_pull).

    On one host (the nodes map this worker's memory) the narrow buffer is
    registered memory from the client (_result_buffer), pushed and pulled
    in place: no staging copies."""
    key = _bucket_key(index, _wire,
                      t.numel() * torch.empty(0, dtype=_wire).element_size())
    arr = None
    if t.device.type == "cpu" and c.proxies_map_memory:
        arr, w = _result_buffer(c, key, t.numel(), _wire)
    else:
        with _lock:
            w = _narrow.get(index)
            if (w is None or w.numel() != t.numel() or w.dtype != _wire
                    or w.device != t.device):
                w = torch.empty(t.numel(), dtype=_wire, device=t.device)
                _narrow[index] = w
    w.copy_(t.view(-1))
    _declare(key, w)
    if t.device.type == "cuda":
        return _cuda_push_pull(c, key, w, -index, result=t)
    if arr is None:
        arr = _flat_numpy(w)
        _register_bucket(c, index, w, arr)
    fut = torch.futures.Future()

    def done(err):
        if err is not None:
            return fut.set_exception(_error(err))
        try:
            t.view(-1).copy_(w)
            fut.set_result(t)
        except Exception as e:  # noqa: BLE001 - reach the waiter
            fut.set_exception(e)

    c.push_pull(key, arr, arr, priority=-index).add_done_callback(done)
    return _for_ddp(fut)


_iterations_seen = 0  # DDP iterations whose last bucket reached the hook


def _first_iteration(bucket):
    """True for the buckets of DDP's first iteration (before its bucket
    rebuild), when torch.distributed is up to carry them."""
    global _iterations_seen
    import torch.distributed as dist
    with _lock:
        first = _iterations_seen == 0
        if bucket.is_last():
            _iterations_seen += 1
    return first and dist.is_available() and dist.is_initialized()


def _error(err):
    """membox's exception for a failed round's message (ProxyUnavailable for
    a memory node that is gone or a job it broke)."""
    gone = err.startswith(("UNAVAILABLE", "ABORTED"))
    return (membox.ProxyUnavailable if gone else membox.MemboxError)(err)


def _raise_or_value(f):
    return f.value()  # raises the exception set_exception stored


def _for_ddp(fut):
    """torch's Future.set_exception stores the exception as the value, to be
    raised by a Python wait(); DDP reads the value in C++ and then fails with
    "Unable to cast <message> to Tensor". A then() whose callback raises it
    makes the error one C++ sees: backward() raises it with membox's message
    (the node named)."""
    return fut.then(_raise_or_value)


_buckets = {}  # bucket index -> (address, bytes, tensor) registered


_share_refused = []  # why the nodes could not map a shared bucket, if so


def _shared_bucket(c, index, t):
    """One host: moves DDP's bucket into shared memory the memory nodes map
    (torch's own share_memory_ machinery: the bucket's storage is swapped
    for a shared-memory file and every view of it -- DDP's per-parameter
    views, gradients that are bucket views -- follows), and registers it
    with its file, the first time the bucket is seen. The nodes then read
    the gradients from the bucket and write the average back into it in
    their summing pass: no staging copy either way. Returns the bucket as a
    flat numpy array, or None where that is not possible (a torch without
    the file-descriptor sharing, or nodes that cannot map this process's
    file: then the staged path, and _share_refused says why)."""
    if _share_refused:
        return None
    if os.environ.get("MEMBOX_SHARE_BUCKETS", "1") == "0":
        _share_refused.append("MEMBOX_SHARE_BUCKETS=0")
        return None
    nbytes = t.numel() * t.element_size()
    with _lock:
        old = _buckets.get(index)
    if old is not None and old[0] == t.data_ptr() and old[1] == nbytes:
        return _flat_numpy(t)
    if not _shm_has_room(nbytes):
        return None  # this bucket staged; a smaller one may still fit
    try:  # torch 1.13 has no untyped_storage(); its storage() shares too
        storage = (t.untyped_storage() if hasattr(t, "untyped_storage")
                   else t.storage())
        fd, _ = storage._share_fd_cpu_()
    except (AttributeError, RuntimeError) as e:
        _share_refused.append("torch cannot share the bucket: %s" % e)
        return None
    arr = _flat_numpy(t)  # after the move: the bucket's new address
    try:
        _register_bucket(c, index, t, arr, fd=fd,
                         file_offset=t.data_ptr() - storage.data_ptr())
    except membox.MemboxError as e:
        _share_refused.append(str(e))
        with _lock:
            _buckets.pop(index, None)
        return None
    return arr


def _shm_has_room(nbytes):
    """Whether /dev/shm (where torch puts shared storages) has room for
    `nbytes` more with a margin. A file there is filled as it is written: a
    container's small /dev/shm (Docker's default is 64 MiB) would end a
    worker with SIGBUS on the first write that does not fit, so a bucket
    that does not fit is staged instead."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= nbytes + max(64 << 20, nbytes // 4)


def _register_bucket(c, index, t, arr, fd=-1, file_offset=0):
    """Registers DDP's bucket buffer with the transport the first time it is
    seen (and again after DDP rebuilds its buckets, dropping the old one), so
    every later round is pushed and pulled in place: no staging copies. The
    tensor is kept referenced while registered. Only where the memory nodes
    do not map this worker's memory (other hosts): on one host the staged
    path through mapped memory is faster (ParamClient::proxies_map_memory)."""
    ptr, nbytes = arr.ctypes.data, arr.nbytes
    with _lock:
        old = _buckets.get(index)
        if old is not None and old[0] == ptr and old[1] == nbytes:
            return
        _buckets[index] = (ptr, nbytes, t)
    if old is not None:
        try:
            c.unregister_tensor(_flat_numpy(old[2]))
        except membox.MemboxError:
            pass  # already replaced by an overlapping registration
    c.register_tensor(arr, fd=fd, file_offset=file_offset)


def _cuda_push_pull(c, key, t, priority, result=None):
    """Averages CUDA tensor `t` through the staging memory (_CudaStaging):
    the Future completes with `t` on the host-to-device stream. With
    `result` (the bucket `t` is a wire-type copy of), `t` is widened into
    `result` on that stream first and the Future completes with `result`."""
    device = t.device
    staging = _staging_for(c)
    nbytes = t.numel() * t.element_size()
    arr, host = staging.buffer(key, nbytes)
    fut = torch.futures.Future(devices=[device])
    copied = staging.to_host(t, host, device)

    def fail(err):
        fut.set_exception(_error(err))

    def done(err):
        if err is not None:
            return fail(err)
        try:
            h2d = staging.to_device(host, t, device)
            with torch.cuda.device(device), torch.cuda.stream(h2d):
                if result is not None:
                    result.view(-1).copy_(t)
                    result.record_stream(h2d)
                # set_result records an event on h2d for the waiter
                fut.set_result(t if result is None else result)
        except Exception as e:  # noqa: BLE001 - reach the waiter
            fut.set_exception(e)

    def start():
        try:
            c.push_pull(key, arr, arr, priority=priority) \
                .add_done_callback(done)
        except Exception as e:  # noqa: BLE001 - reach the waiter
            fut.set_exception(e)

    staging.after(copied, start)
    return _for_ddp(fut)


class OverlappedOptimizer:
    """Steps each DDP gradient bucket's parameters as soon as that bucket's
    average is back, instead of one optimizer.step() after the last bucket:
    the step of the first buckets runs while the last ones are still on the
    wire (and, for the first buckets out, while backward still computes).
    Registers its own comm hook on `model` (a DistributedDataParallel) that
    runs `hook` -- membox.torch.allreduce_hook by default, or "allreduce"
    for the process group's own AllReduce (Gloo, NCCL: what DDP does without
    a hook, so a baseline takes the same step) -- and chains the step to the
    hook's Future:

        opt = membox.torch.OverlappedOptimizer(model, torch.optim.Adam,
                                               lr=3e-3)
        opt.zero_grad(); loss.backward()   # the parameters are stepped

    One `optimizer_class` instance per parameter, built here with `kwargs`:
    the same update as one instance over all of them for optimizers that
    treat parameters independently (SGD, Adam, AdamW, Adagrad, RMSprop);
    not for those that couple them (LBFGS, clipping by the global norm).
    Under DDP's no_sync() the hook does not run and nothing is stepped: the
    accumulated gradients are stepped by the next synchronising backward.

    Threading: a bucket's step runs on the thread that completes its Future
    (membox's completion thread; with "allreduce", a thread of this
    optimizer per bucket index that waits for the group's AllReduce),
    concurrently with backward on the main thread; each parameter's
    optimizer is used only by its bucket's step, and DDP's backward returns
    only after every bucket's step has finished. zero_grad(), set_lr(), state_dict() and
    load_state_dict() are for the main thread between steps. A failed
    bucket steps nothing and backward() raises its error."""

    def __init__(self, model, optimizer_class, hook=None, **kwargs):
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError("OverlappedOptimizer needs a "
                            "DistributedDataParallel model, not "
                            f"{type(model).__name__}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that need "
                             "gradients")
        # Built here, in parameter order: a bad hyperparameter fails now,
        # and state_dict() has one entry per parameter in that order.
        self.optimizers = {p: optimizer_class([p], **kwargs)
                           for p in self.params}
        self._group = None  # "allreduce": the group, None for the default
        self._queues = None  # "allreduce": bucket index -> its thread's queue
        if hook is None:
            hook = allreduce_hook
        elif hook == "allreduce":
            import torch.distributed as dist
            if model.process_group is not \
                    dist.distributed_c10d._get_default_group():
                self._group = model.process_group
            self._queues = {}
            hook = None
        elif not callable(hook):
            raise ValueError(f"hook must be a comm hook or \"allreduce\", "
                             f"not {hook!r}")
        self._hook = hook
        self.buckets_stepped = 0  # completed bucket steps (for tests)
        model.register_comm_hook(None, self._hook_then_step)

    def _hook_then_step(self, state, bucket):
        # The bucket's gradients are views of its flat buffer; the hook's
        # result has the same layout (it may be another tensor: the average
        # in memory the nodes wrote, see _result_buffer).
        base = bucket.buffer().storage_offset()
        layout = [(p, g.storage_offset() - base, g.numel())
                  for p, g in zip(bucket.parameters(), bucket.gradients())]
        if self._queues is not None:
            return self._allreduce_then_step(bucket.index(), bucket.buffer(),
                                             layout)

        def step(f):
            result = f.value()  # raises the hook's error: nothing stepped
            self._step(result, layout)
            return result

        return self._hook(state, bucket).then(step)

    def _allreduce_then_step(self, index, buf, layout):
        """The process group's AllReduce, and the step on this optimizer's
        own thread once it is done. Not a then() on the group's Future: its
        callback would run on the group's thread, and with torch 1.13 a
        Python callback there can hang the process at exit (the group is
        destroyed, joining that thread, while the exiting thread holds the
        GIL the callback's clean-up waits for)."""
        import torch.distributed as dist
        work = dist.all_reduce(buf, group=self._group, async_op=True)
        out = torch.futures.Future()
        # A thread per bucket index: the group may finish a later bucket
        # first (Gloo runs them on several threads), and its step must not
        # wait behind an earlier bucket's.
        with _lock:
            q = self._queues.get(index)
            if q is None:
                q = self._queues[index] = queue.SimpleQueue()
                threading.Thread(
                    target=self._run_allreduce_steps, args=(q,), daemon=True,
                    name=f"membox-overlapped-optimizer-{index}").start()
        q.put((work, buf, layout, out))
        return _for_ddp(out)

    def _run_allreduce_steps(self, q):
        import torch.distributed as dist
        world = dist.get_world_size(self._group)
        while True:
            work, buf, layout, out = q.get()
            try:
                work.wait()
                buf.div_(world)
                self._step(buf, layout)
            except Exception as e:  # noqa: BLE001 - reach DDP's backward
                out.set_exception(e)
            else:
                out.set_result(buf)

    def _step(self, result, layout):
        flat = result.view(-1)
        for p, at, n in layout:
            opt = self.optimizers.get(p)
            if opt is None:
                continue
            # The optimizer reads p.grad: the averaged slice, for this step
            # only (DDP writes p.grad itself when backward ends).
            before = p.grad
            p.grad = flat[at:at + n].view_as(p)
            try:
                opt.step()
            finally:
                p.grad = before
        with _lock:
            self.buckets_stepped += 1

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def set_lr(self, lr):
        """Sets every parameter's learning rate (what an LR schedule
        drives)."""
        for opt in self.optimizers.values():
            for g in opt.param_groups:
                g["lr"] = lr

    @property
    def lr(self):
        return self.optimizers[self.params[0]].param_groups[0]["lr"]

    def state_dict(self):
        return {"per_parameter": [self.optimizers[p].state_dict()
                                  for p in self.params]}

    def load_state_dict(self, state):
        per = state.get("per_parameter") if isinstance(state, dict) else None
        if not isinstance(per, list) or len(per) != len(self.params):
            raise ValueError(
                "not an OverlappedOptimizer state for this model's "
                f"{len(self.params)} parameters")
        for p, s in zip(self.params, per):
            self.optimizers[p].load_state_dict(s)


class _NodeOptimizer(torch.optim.Optimizer):
    """The hyperparameters of a ParameterServer, in the form torch's LR
    schedulers drive (param_groups). The memory nodes run the optimizer:
    step() here does nothing."""

    def step(self, closure=None):  # noqa: D401 - the nodes step
        return closure() if closure is not None else None


class _PsBucket:
    """One key on the memory nodes: several CPU parameters of one dtype fused
    into a buffer in transport-registered memory (the nodes read and write it
    in place), or one CUDA parameter (staged, see _CudaStaging)."""

    def __init__(self, key, indices, params, client):
        self.key = key
        self.indices = indices
        first = params[indices[0]]
        self.cuda = first.data.is_cuda
        self.dtype = first.dtype
        self.sizes = [params[i].numel() for i in indices]
        self.nbytes = sum(self.sizes) * first.element_size()
        self.arr = self.flat = None
        if not self.cuda:
            self.arr = client.allocate(self.nbytes)   # uint8, registered
            self.flat = torch.frombuffer(self.arr, dtype=self.dtype)

    def views(self, params):
        """(parameter, its slice of the bucket buffer) pairs."""
        out, at = [], 0
        for i, n in zip(self.indices, self.sizes):
            out.append((params[i], self.flat[at:at + n]))
            at += n
        return out


class ParameterServer:
    """Explicit parameter-server training: the memory nodes keep the weights
    and run the optimizer ("sgd" with momentum, or "adam"); workers push
    gradients and pull weights, synchronously (mode "average"/"sum") or
    asynchronously (mode "async", optionally with a staleness bound).

        ps = membox.torch.ParameterServer(model.parameters(), optimizer="sgd",
                                          lr=0.1, momentum=0.9)
        loss.backward(); ps.step()   # push grads, pull new weights

    CPU parameters are fused into buckets of about `bucket_mb` MiB (in
    order, one dtype per bucket; a larger parameter is a bucket of its own):
    one key and one round trip per bucket instead of per tensor. CUDA
    parameters go one by one through page-locked staging memory.
    """

    def __init__(self, params, mode="average", optimizer="sgd", lr=0.01,
                 momentum=0.0, beta1=0.9, beta2=0.999, eps=1e-8, staleness=0,
                 client=None, first_key=1 << 50, bucket_mb=4):
        self.params = [p for p in params]
        self.client = client or (_client if _client is not None
                                 else membox.connect())
        # Mode and staleness are the job's (the same as init()'s when both
        # are used); the optimizer belongs to this server's tensors only.
        self.client.configure(mode=mode, staleness=staleness)
        self._kind = optimizer
        hyper = dict(lr=lr, momentum=momentum, beta1=beta1, beta2=beta2,
                     eps=eps)
        # A torch Optimizer over the same parameters whose param_groups[0]
        # holds the hyperparameters: torch's LR schedulers drive it, and
        # step() sends what they changed to the memory nodes.
        self.optimizer = _NodeOptimizer(self.params, hyper)
        self._sent = dict(hyper)
        self.buckets = []
        cap = max(1, int(bucket_mb * (1 << 20)))
        group, size = [], 0
        for i, p in enumerate(self.params):
            fits = group and not p.data.is_cuda and \
                self.params[group[0]].dtype == p.dtype and \
                size + p.numel() * p.element_size() <= cap
            if group and not fits:
                self._add_bucket(first_key, group)
                group, size = [], 0
            group.append(i)
            size += p.numel() * p.element_size()
            if p.data.is_cuda:
                self._add_bucket(first_key, group)
                group, size = [], 0
        if group:
            self._add_bucket(first_key, group)
        self.keys = [b.key for b in self.buckets]
        # Rounds completed on the memory nodes: 0 for a new job, the
        # checkpoint's after `membox launch --resume`.
        self.version = 0
        for b in self.buckets:
            if b.cuda:
                data = _flat_numpy(self.params[b.indices[0]].data.cpu())
            else:
                for p, view in b.views(self.params):
                    view.copy_(p.data.view(-1))
                data = b.arr
            # Rank 0's initial weights win on every node (as DDP's
            # broadcast); other ranks' first pull waits for them.
            v = self.client.declare(b.key, b.nbytes,
                                    _dtype(self.params[b.indices[0]]), data,
                                    optimizer=optimizer, **hyper)
            self.version = max(self.version, v)
        self.pull()

    def _add_bucket(self, first_key, indices):
        self.buckets.append(_PsBucket(first_key + len(self.buckets), indices,
                                      self.params, self.client))

    @property
    def lr(self):
        return self.optimizer.param_groups[0]["lr"]

    def set_lr(self, lr, **hyper):
        """Sets the learning rate (and optionally momentum, beta1, beta2,
        eps) from the next step on. Every worker calls it between the same
        two steps with the same values (a schedule does); the memory nodes
        refuse differing values for one round."""
        g = self.optimizer.param_groups[0]
        g["lr"] = lr
        for name, value in hyper.items():
            if name not in self._sent:
                raise TypeError("unknown hyperparameter %r" % name)
            g[name] = value
        self._tune()

    def _tune(self):
        g = self.optimizer.param_groups[0]
        want = {name: float(g[name]) for name in self._sent}
        if want == self._sent or not self.keys:
            return
        if self._kind == "none":
            raise membox.MemboxError("a ParameterServer without an optimizer "
                                     "has no learning rate")
        self.client.tune(self.keys[0], self.keys[-1] + 1, self._kind, **want)
        self._sent = want

    def pull(self):
        """Overwrites the local parameters with the memory nodes' weights
        (CUDA parameters through page-locked staging memory)."""
        hs = []
        for b in self.buckets:
            if b.cuda:
                arr, _ = _staging_for(self.client).buffer(b.key, b.nbytes)
                hs.append(self.client.pull(b.key, arr))
            else:
                hs.append(self.client.pull(b.key, b.arr))
        self._finish(hs)

    def _finish(self, hs):
        """Waits for the transfers in order; each bucket's weights are copied
        into the parameters as soon as it is back (CUDA: a host-to-device
        copy, and the current stream waits for all of them -- no
        device-wide sync)."""
        staging = None
        streams = {}
        for b, h in zip(self.buckets, hs):
            h.wait()
            if b.cuda:
                staging = staging or _staging_for(self.client)
                p = self.params[b.indices[0]]
                _, host = staging.buffer(b.key, b.nbytes)
                streams[p.device] = staging.to_device(host, p.data, p.device)
            else:
                with torch.no_grad():
                    for p, view in b.views(self.params):
                        p.data.view(-1).copy_(view)
        for device, h2d in streams.items():
            torch.cuda.current_stream(device).wait_stream(h2d)

    def step(self):
        """Pushes every gradient (first layers first) and pulls the updated
        weights: each CPU bucket is filled with its gradients and pushed at
        once, CUDA gradients are copied to page-locked staging memory on a
        side stream and each is pushed as soon as its copy is done; the
        weights come back the same way. A learning rate changed since the
        last step (set_lr, or an LR scheduler on self.optimizer) is sent to
        the memory nodes first."""
        self._tune()
        self.optimizer.step()  # bookkeeping torch's LR schedulers check
        n = len(self.buckets)
        copied = {}
        staging = None
        for j, b in enumerate(self.buckets):
            if b.cuda:
                staging = staging or _staging_for(self.client)
                p = self.params[b.indices[0]]
                g = p.grad if p.grad is not None else torch.zeros_like(p.data)
                _, host = staging.buffer(b.key, b.nbytes)
                copied[j] = staging.to_host(g, host, p.device)
        hs = []
        for j, b in enumerate(self.buckets):
            if b.cuda:
                arr, _ = staging.buffer(b.key, b.nbytes)
                copied[j].synchronize()  # this copy only, GIL released
                hs.append(self.client.push_pull(b.key, arr, arr,
                                                priority=j - n))
                continue
            with torch.no_grad():
                for p, view in b.views(self.params):
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad.reshape(-1))
            hs.append(self.client.push_pull(b.key, b.arr, b.arr,
                                            priority=j - n))
        self._finish(hs)


# ------------------------------------------------------------ checkpoints

def _checkpoint_path(name, directory):
    d = directory or os.environ.get("MEMBOX_CHECKPOINT_DIR", "")
    if not d:
        raise RuntimeError(
            "no checkpoint directory: start the job with `membox launch "
            "--checkpoint-dir DIR` (MEMBOX_CHECKPOINT_DIR) or pass directory=")
    if not name or os.sep in name or name in (".", ".."):
        raise ValueError(f"checkpoint name must be a plain file name, not "
                         f"{name!r}")
    return os.path.join(d, name)


def save_checkpoint(state, name="ddp.pt", directory=None):
    """Saves a DDP job's own state -- with the hook, the memory nodes hold
    only gradients in flight, so the weights, the optimizer's state and the
    epoch or step are the workers' to keep. Rank 0 writes `state` (anything
    torch.save takes) to `name` in the job's checkpoint directory
    (`membox launch --checkpoint-dir`) atomically: a temporary file, fsync,
    rename, fsync of the directory, so a crash leaves the previous
    checkpoint whole. Every rank calls it; when a process group is up, the
    others wait until rank 0 has written (no rank runs ahead of it).
    Returns the path."""
    import torch.distributed as dist
    path = _checkpoint_path(name, directory)
    group = dist.is_available() and dist.is_initialized()
    if not group or dist.get_rank() == 0:
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if group:
        dist.barrier()
    return path


def load_checkpoint(name="ddp.pt", directory=None, map_location="cpu"):
    """The state last saved by save_checkpoint when this job was started to
    resume (`membox launch --resume`, MEMBOX_RESUMED=1) and the file
    exists; None for a fresh start. A resumed job whose checkpoint is
    missing gets None too (nothing was saved before it stopped). Every rank
    loads the same file: load it before training, then DDP's own first
    broadcast agrees with it anyway."""
    if os.environ.get("MEMBOX_RESUMED") != "1" and directory is None:
        return None
    path = _checkpoint_path(name, directory)
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location=map_location)


# ------------------------------------------------- DDP state in the nodes

# Keys of InMemoryState: clear of the hook's bucket keys (< 2^50) and
# ParameterServer's (1 << 50 onwards). kind: 0 marker, 1 slice, 2 extras.
_STATE_BASE = 0xC << 60
_STATE_MAGIC = 0x6D656D626F780002  # "membox", format 2
# int64s: magic, step, generation, layout hash, bytes, extras, world size
_MARKER = 7
_EXTRAS_BYTES = 64 << 10
_SLOTS = 4


def _state_key(kind, slot, rank, gen=0):
    return _STATE_BASE | (kind << 56) | (gen << 36) | (slot << 32) | rank


def _restarted():
    """True in a worker set `membox launch --max-restarts` (MEMBOX_RESTART)
    or torchrun's elastic agent (TORCHELASTIC_RESTART_COUNT) started again
    after a failure."""
    return any(os.environ.get(v, "0") not in ("", "0")
               for v in ("MEMBOX_RESTART", "TORCHELASTIC_RESTART_COUNT"))


def _as_bytes(t):
    return t.detach().reshape(-1).view(torch.uint8)


class InMemoryState:
    """A DDP job's weights and optimizer state kept in the memory nodes'
    memory, so that a worker set restarted after a worker's death
    (`membox launch --max-restarts N`, or torchrun's elastic restarts)
    continues from the newest step the nodes hold -- no checkpoint file,
    nothing read from disk:

        membox.torch.init()
        model.register_comm_hook(None, membox.torch.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = membox.torch.InMemoryState(model, opt)
        start = state.restore()        # 0, or the step the nodes hold
        for step in range(start, steps):
            ...; loss.backward(); opt.step()   # commits (torch 2.x)
            sched.step()                   # optional

    After every optimizer step -- or every `every` steps: a restart then
    redoes more steps, each step costs less -- (automatically with torch
    2.x's step hooks; otherwise call commit() at the end of every
    iteration, after opt.step() and the scheduler's step) each rank
    copies its 1/p of
    the state -- parameters, buffers, the optimizer's tensors -- into
    registered memory and stores it on the nodes (stored keys,
    ParamClient::DeclareStored), in the background: a step costs a memcpy
    of state/p bytes and one small round trip for the previous step's
    marker. Rank 0 adds the optimizer's hyperparameters (what an LR
    schedule changed) and the scheduler's state_dict() if one is given.
    With several nodes and --ps-replicate (on with --max-restarts) every
    node holds it, so it also survives a memory node's death.

    Consistency: four slots used in turn. A rank stores a slot's marker
    (step, layout) only once its whole slice of that step is on the nodes
    (from the stores' completion, off the training thread), and begins the
    stores of commit c only after its marker of commit c-2 is stored. No
    rank can begin commit c's stores before every rank has made commit
    c-1 (DDP's gradient exchange after it needs them all), so a commit
    every rank has marked is never being overwritten, and restore() finds
    one at most three commits behind the newest: the steps since are run
    again (the same batches, if the script derives its data order from the
    step). Markers of an earlier job on long-lived nodes, and a restarted
    job's markers beyond the step it resumes from, are invalidated before
    training starts.

    What the script must do: create the model and optimizer as it always
    does, call restore() before training, and start its loop (data order,
    epoch) from the step it returns. Not kept: RNG states, data loader
    positions, anything outside model/optimizer/scheduler."""

    def __init__(self, model, optimizer, scheduler=None, client=None,
                 auto_commit=True, every=1, rank=None, world=None):
        import torch.distributed as dist
        self.client = client or globals()["client"]()
        group = dist.is_available() and dist.is_initialized()
        # The data-parallel rank and size: torch.distributed's by default.
        self.rank = rank if rank is not None else \
            (dist.get_rank() if group else 0)
        self.world = world if world is not None else \
            (dist.get_world_size() if group else 1)
        if not 0 <= self.rank < self.world:
            raise ValueError("rank must be in [0, world)")
        self.model, self.optimizer, self.scheduler = model, optimizer, \
            scheduler
        if int(every) < 1:
            raise ValueError("every must be a step count >= 1")
        self.every = int(every)
        self.step = 0
        self._params = [p for g in optimizer.param_groups
                        for p in g["params"]]
        self._layout_key = None
        self._gen = 0
        self._pending = None   # the last commit's slice store
        self._extras_due = None  # rank 0: the last commit's extras to store
        self._extras_handle = None
        self._marker_done = {}  # step -> Event set once its marker is stored
        self._timeout = 120.0
        self._restoring = False
        self._slice_buf = None
        self._declared = set()      # (slot, generation) keys declared
        self._extras_sent = {}      # (slot, generation) -> bytes stored
        # One marker buffer per slot: a step's marker may still be in
        # flight when the next one's is written.
        self._marker_bufs = [self.client.allocate(8 * _MARKER)
                             for _ in range(_SLOTS)]
        self._extras = self.client.allocate(_EXTRAS_BYTES) \
            if self.rank == 0 else None
        for slot in range(_SLOTS):
            for r in range(self.world):
                self.client.declare_stored(_state_key(0, slot, r),
                                           8 * _MARKER)
        self._hooks = []
        # True when opt.step() commits by itself (torch 2.x step hooks);
        # otherwise the script calls commit() at the end of every
        # iteration (after opt.step() and the scheduler's step).
        self.auto = bool(auto_commit and
                         hasattr(optimizer, "register_step_post_hook"))
        if self.auto:
            # After a step: its tensors. Before the next one: the
            # hyperparameters and the scheduler as the iteration left them
            # (a scheduler steps after the optimizer).
            self._hooks = [
                optimizer.register_step_post_hook(
                    lambda *_: None if self._restoring else self._stepped()),
                optimizer.register_step_pre_hook(
                    lambda *_: None if self._restoring
                    else self._commit_extras())]

    # -------------------------------------------------------------- layout

    def _tensors(self):
        """Every tensor the state holds, in a fixed order: the model's
        parameters and buffers, then per optimizer parameter (those with
        state) its state's tensors by name."""
        ts = [p.data for p in self.model.parameters()]
        ts += [b for b in self.model.buffers()]
        has = []
        for i, p in enumerate(self._params):
            st = self.optimizer.state.get(p)
            if not st:
                continue
            has.append(i)
            for k in sorted(st, key=str):
                if torch.is_tensor(st[k]):
                    ts.append(st[k])
        return ts, has

    def _layout(self, ts, has):
        """(layout key, hash, total bytes, slice bytes): recomputed when the
        optimizer's state gains entries (a parameter's first gradient)."""
        key = (len(ts), tuple(has))
        if self._layout_key is not None and self._layout_key[0] == key:
            return self._layout_key[1]
        import hashlib
        desc = repr([(tuple(t.shape), str(t.dtype)) for t in ts] + has)
        h = int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=8)
                           .digest(), "little") & ((1 << 63) - 1)
        total = sum(t.numel() * t.element_size() for t in ts)
        per = max(8, -(-total // self.world))
        per += -per % 8
        if self._layout_key is not None:
            self._gen += 1  # new keys for the new size
        lay = (h, total, per, self._gen)
        self._layout_key = (key, lay)
        return lay

    def _pieces(self, ts, lo, hi):
        """(tensor bytes, start, end, offset in [lo, hi)) for every tensor
        overlapping the state's byte range [lo, hi)."""
        at = 0
        for t in ts:
            n = t.numel() * t.element_size()
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                yield _as_bytes(t), a - at, b - at, a - lo
            at += n
            if at >= hi:
                break

    def _extras_json(self, has):
        import json
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        scalars = {}
        for i in has:
            st = self.optimizer.state[self._params[i]]
            plain = {str(k): v for k, v in st.items()
                     if not torch.is_tensor(v)}
            if plain:
                scalars[str(i)] = plain
        doc = {"groups": groups, "has": has, "scalars": scalars,
               "scheduler": self.scheduler.state_dict()
               if self.scheduler is not None else None}
        try:
            data = json.dumps(doc).encode()
        except TypeError as e:
            raise membox.MemboxError(
                "InMemoryState keeps the optimizer's hyperparameters and the "
                "scheduler's state as JSON: %s" % e)
        if len(data) > _EXTRAS_BYTES:
            raise membox.MemboxError(
                "optimizer hyperparameters and scheduler state take %d bytes "
                "as JSON (InMemoryState keeps up to %d)"
                % (len(data), _EXTRAS_BYTES))
        return data

    # -------------------------------------------------------------- commit

    def _wait_stores(self):
        """Waits for the last commit's slice store: its buffer is then free
        to refill."""
        if self._pending is None:
            return
        self._pending.wait()
        self._pending = None

    def _wait_marker(self, step):
        """Waits until the marker of `step` is on the nodes (stored once
        that step's slice and extras are)."""
        ev = self._marker_done.pop(step, None)
        if ev is None:
            return
        if not ev.wait(self._timeout):
            raise membox.MemboxError(
                "InMemoryState: the marker of step %d was not stored within "
                "%.0f s" % (step, self._timeout))
        if ev.error:
            raise membox.MemboxError("InMemoryState: storing step %d failed: "
                                     "%s" % (step, ev.error))

    def _marker_after(self, step, slot, parts, marker):
        """Returns part_done(err): once it has been called `parts` times
        (on membox's completion thread, or here), the marker of `step` is
        stored; its event is set when that is done."""
        ev = threading.Event()
        ev.error = None
        self._marker_done[step] = ev
        left = [parts]
        lock = threading.Lock()

        def marker_done(err):
            ev.error = err
            ev.set()

        def part_done(err):
            with lock:
                left[0] -= 1
                last = left[0] == 0
                if err is not None and ev.error is None:
                    ev.error = err
            if not last:
                return
            if ev.error is not None:
                return ev.set()
            try:
                buf = self._marker_bufs[slot]
                np.frombuffer(buf, dtype=np.int64)[:] = marker
                self.client.store(_state_key(0, slot, self.rank),
                                  buf).add_done_callback(marker_done)
            except Exception as e:  # noqa: BLE001 - reach the waiter
                marker_done(str(e))

        return part_done

    def _write_marker(self, slot, values):
        buf = self._marker_bufs[slot]
        np.frombuffer(buf, dtype=np.int64)[:] = values
        self.client.store(_state_key(0, slot, self.rank), buf).wait()

    def commit(self):
        """Stores the state at the end of an iteration, after opt.step()
        and the scheduler's step: what torch 2.x's step hooks do by
        themselves (call it only where InMemoryState.auto is False).
        Returns before the stores are done."""
        self._stepped()
        self._commit_extras()

    def _stepped(self):
        """After an optimizer step: every `every` steps, stores this rank's
        slice of the tensors. It waits only for the previous commit's
        slice store (to reuse its buffer) and for the marker of the commit
        before that."""
        self.step += 1
        if self.step % self.every:
            return
        self._wait_stores()
        self._wait_marker(self.step - 2 * self.every)
        ts, has = self._tensors()
        h, total, per, gen = self._layout(ts, has)
        slot = (self.step // self.every) % _SLOTS
        key = _state_key(1, slot, self.rank, gen)
        if self._slice_buf is None or self._slice_buf.nbytes != per:
            self._slice_buf = self.client.allocate(per)
        if (slot, gen) not in self._declared:
            self.client.declare_stored(key, per)
            if self.rank == 0:
                self.client.declare_stored(_state_key(2, slot, 0, gen),
                                           _EXTRAS_BYTES)
            self._declared.add((slot, gen))
        buf = torch.from_numpy(self._slice_buf)
        lo = self.rank * per
        with torch.no_grad():
            for src, a, b, off in self._pieces(ts, lo, lo + per):
                buf[off:off + b - a].copy_(src[a:b])
        marker = [_STATE_MAGIC, self.step, gen, h, total, 0, self.world]
        part_done = self._marker_after(self.step, slot, 2, marker)
        self._pending = self.client.store(key, self._slice_buf)
        self._pending.add_done_callback(part_done)
        if self.rank == 0:
            self._extras_due = (slot, gen, has, marker, part_done)
        else:
            part_done(None)

    def _commit_extras(self):
        """Rank 0, once the iteration of the last commit has ended (before
        the next step, or in commit() / flush()): the hyperparameters and
        the scheduler's state, stored when they differ from what the slot
        holds (an LR schedule's epoch)."""
        if self._extras_due is None:
            return
        slot, gen, has, marker, part_done = self._extras_due
        self._extras_due = None
        try:
            data = self._extras_json(has)
        except Exception as e:
            part_done(str(e))
            raise
        marker[5] = len(data)
        if self._extras_sent.get((slot, gen)) == data:
            return part_done(None)
        if self._extras_handle is not None:
            self._extras_handle.wait()  # its buffer is refilled next
        self._extras[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._extras_handle = self.client.store(_state_key(2, slot, 0, gen),
                                                self._extras)
        self._extras_handle.add_done_callback(part_done)
        self._extras_sent[(slot, gen)] = data

    def flush(self):
        """Waits until every commit is complete on the nodes, markers
        included."""
        self._commit_extras()
        self._wait_stores()
        for step in sorted(self._marker_done):
            self._wait_marker(step)

    def close(self):
        """Flushes, stops committing (removes the optimizer hooks) and lets
        go of the client and its buffers."""
        self.flush()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._slice_buf = self._extras = self._marker_bufs = None
        self._extras_handle = None
        self.client = None

    # ------------------------------------------------------------- restore

    def _markers(self):
        buf = torch.zeros(_SLOTS * self.world * _MARKER, dtype=torch.int64)
        self.client.register_tensor(buf)
        try:
            hs = []
            for slot in range(_SLOTS):
                for r in range(self.world):
                    i = (slot * self.world + r) * _MARKER
                    hs.append(self.client.pull(_state_key(0, slot, r),
                                               buf[i:i + _MARKER]))
            for x in hs:
                x.wait()
            return buf.view(_SLOTS, self.world, _MARKER).tolist()
        finally:
            self.client.unregister_tensor(buf)

    def _invalidate(self, keep=None):
        for slot in range(_SLOTS):
            if slot != keep:
                self._write_marker(slot, [0] * _MARKER)

    def restore(self):
        """Call once before training, on every rank. A fresh job: returns 0
        (and invalidates what an earlier job left on the nodes). A
        restarted worker set: loads the newest step every rank completed
        into the model, the optimizer (and scheduler) and returns it; 0 if
        the nodes hold none (the job died before its first step)."""
        marks = self._markers()
        best = None
        if _restarted():
            for slot in range(_SLOTS):
                ms = marks[slot]
                first = ms[0]
                if first[0] != _STATE_MAGIC or first[1] < 1:
                    continue
                if first[6] != self.world:
                    # Each rank holds 1/p of it: another p cannot use it
                    # (and would otherwise start over without a word).
                    raise membox.MemboxError(
                        "the memory nodes hold this job's state as written "
                        "by %d workers; this restart has %d: restart with "
                        "%d workers" % (first[6], self.world, first[6]))
                if any(m[:5] != first[:5] or m[0] != _STATE_MAGIC
                       for m in ms):
                    continue
                if best is None or first[1] > best[1][1]:
                    best = (slot, first)
        if best is None:
            self._invalidate()
            if _restarted() and self.rank == 0:
                print("membox: no state of this job on the memory nodes; "
                      "starting from step 0", flush=True)
            return 0
        slot, (_, step, gen, h, total, extras_len, _) = best
        import json
        extras = json.loads(self._pull_extras(slot, gen, extras_len))
        self._materialize(extras["has"])
        ts, has = self._tensors()
        if has != extras["has"]:
            raise membox.MemboxError(
                "the optimizer's state after a restart covers other "
                "parameters than the memory nodes' state of step %d" % step)
        self._gen, self._layout_key = gen, None  # go on with its keys
        lay = self._layout(ts, has)
        if lay[0] != h or lay[1] != total:
            raise membox.MemboxError(
                "the model or optimizer differs from the one whose state the "
                "memory nodes hold (%d bytes of state there, %d here): "
                "restart with the same model and optimizer"
                % (total, lay[1]))
        per = lay[2]
        buf = torch.empty(per * self.world, dtype=torch.uint8)
        self.client.register_tensor(buf)
        try:
            hs = []
            for r in range(self.world):
                key = _state_key(1, slot, r, gen)
                self.client.declare_stored(key, per)
                hs.append(self.client.pull(key, buf[r * per:(r + 1) * per]))
            for x in hs:
                x.wait()
        finally:
            self.client.unregister_tensor(buf)
        with torch.no_grad():
            for dst, a, b, off in self._pieces(ts, 0, total):
                dst[a:b].copy_(buf[off:off + b - a])
        self._load_extras(extras)
        self.step = step
        self._invalidate(keep=slot)
        if self.rank == 0:
            print("membox: resumed from the memory nodes at step %d "
                  "(weights and optimizer state; nothing read from disk)"
                  % step, flush=True)
        return step

    def _pull_extras(self, slot, gen, n):
        key = _state_key(2, slot, 0, gen)
        self.client.declare_stored(key, _EXTRAS_BYTES)
        buf = torch.empty(_EXTRAS_BYTES, dtype=torch.uint8)
        self.client.register_tensor(buf)
        try:
            self.client.pull(key, buf).wait()
        finally:
            self.client.unregister_tensor(buf)
        if not 0 < n <= _EXTRAS_BYTES:
            raise membox.MemboxError("bad InMemoryState marker on the nodes")
        return bytes(buf[:n].numpy())

    def _materialize(self, has):
        """Creates the optimizer's state for the parameters that had it (a
        step with zero gradients; every tensor is overwritten next)."""
        missing = [i for i in has if not self.optimizer.state.get(
            self._params[i])]
        if not missing:
            return
        saved = [p.grad for p in self._params]
        with torch.no_grad():
            for p in self._params:
                p.grad = None
            for i in missing:
                p = self._params[i]
                p.grad = torch.zeros_like(p)
            self._restoring = True
            try:
                self.optimizer.step()
            finally:
                self._restoring = False
            for p, g in zip(self._params, saved):
                p.grad = g

    def _load_extras(self, extras):
        for g, saved in zip(self.optimizer.param_groups, extras["groups"]):
            for k, v in saved.items():
                if isinstance(g.get(k), tuple) and isinstance(v, list):
                    v = tuple(v)
                g[k] = v
        for i, plain in extras["scalars"].items():
            st = self.optimizer.state[self._params[int(i)]]
            st.update(plain)
        if self.scheduler is not None and extras["scheduler"] is not None:
            self.scheduler.load_state_dict(extras["scheduler"])


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


class _Ids:
    """One id tensor's flat keys, distinct keys and inverse index (what a
    layer's forward gathers with), computed once however many layers of a
    group take the same tensor. Remembers the tensor and its version so
    forward can tell the ids it is given are the prefetched ones without
    comparing them."""

    def __init__(self, input):
        flat, self.shape = _keys(input)
        self.flat = flat.copy()  # not a view: the caller may reuse `input`
        self.unique, inverse = np.unique(self.flat, return_inverse=True)
        self.inverse = torch.from_numpy(inverse.astype(np.int64, copy=False))
        self.source = input
        self.version = getattr(input, "_version", None)

    def same(self, input):
        """True when `input` holds these ids."""
        if (input is self.source and self.version is not None
                and input._version == self.version):
            return True  # the same tensor, not written to since
        flat, _ = _keys(input)
        return (self.flat.shape == flat.shape and
                bool(np.array_equal(self.flat, flat)))


class Prefetched:
    """The rows of one batch of one layer, being pulled (from
    Embedding.prefetch or EmbeddingGroup.prefetch)."""

    def __init__(self, layer, input, pin, batch=None, grouped=False,
                 ids=None):
        self.ids = ids if ids is not None else _Ids(input)
        self.flat, self.shape = self.ids.flat, self.ids.shape
        self.unique, self.inverse = self.ids.unique, self.ids.inverse
        self.batch = batch if batch is not None else \
            (next(_pin_tags) if pin else 0)
        self.layer = layer
        self.step = None  # the EmbeddingGroup's step (set by it), or None
        self.handle = None
        self.rows = None
        if not grouped:  # a group pulls all its members' rows at once
            self.handle = layer.client.pull_async(layer.table, self.unique,
                                                  self.batch)
        self.used = False

    def wait(self):
        if self.rows is None:
            self.rows = (self.handle.wait() if self.handle is not None
                         else self.step.rows(self))
        return self.rows


class _GroupStep:
    """One prefetch of an EmbeddingGroup: the rows of every member arrive
    with one request per node, and the members' gradients leave the same
    way once every member whose rows entered the graph has its gradient
    (or when the group is synchronized)."""

    def __init__(self, group, pres):
        self.group = group
        self.pres = pres
        self.index = {id(p): i for i, p in enumerate(pres)}
        self.hooked = set()  # members whose rows entered the graph
        self.grads = {}      # member -> gradient rows not sent yet
        self.sent = set()
        self.handle = group.client.pull_many(
            [(p.layer.table, p.unique) for p in pres], pres[0].batch)
        self.result = None

    def rows(self, pre):
        if self.result is None:
            self.result = self.handle.wait()
        return self.result[self.index[id(pre)]]

    def expect(self, pre):
        self.hooked.add(self.index[id(pre)])

    def add(self, pre, grad):
        self.grads[self.index[id(pre)]] = grad
        if self.hooked <= self.sent | set(self.grads):
            self.send()
        else:
            self.group._waiting.add(self)

    def send(self):
        """Sends the gradients in hand, one request per node; each part
        unpins its member's rows."""
        self.group._waiting.discard(self)
        if not self.grads:
            return
        parts = [(self.pres[i].layer.table, self.pres[i].unique, g)
                 for i, g in sorted(self.grads.items())]
        self.sent |= set(self.grads)
        self.grads = {}
        self.group._track(self.group.client.push_many(
            parts, self.pres[0].batch, True))


class EmbeddingGroup:
    """Store layers whose pulls and pushes travel together: one request per
    memory node per step for all their tables, instead of one per table
    (seed 004's batched requests; what TorchRec's EmbeddingBagCollection
    does in one process). The layers must share one client (the default).

        group = membox.torch.EmbeddingGroup(wide, deep, hist)
        pre = group.prefetch(x, x, h)          # rows of all three tables
        out = wide(x, prefetched=pre[0]) ...    # as with layer.prefetch
        loss.backward()                         # one push for all three

    The push leaves when every member whose rows entered the graph has its
    gradient. group.synchronize() sends any step still waiting (a member
    whose output did not reach the loss) and waits until every push is
    applied."""

    def __init__(self, *layers):
        if not layers:
            raise ValueError("an EmbeddingGroup needs at least one layer")
        for layer in layers:
            if not isinstance(layer, _StoreLayer):
                raise TypeError("EmbeddingGroup members are membox.torch."
                                "Embedding / EmbeddingBag layers, not "
                                f"{type(layer).__name__}")
            if layer.client is not layers[0].client:
                raise ValueError("EmbeddingGroup members must share one "
                                 "embedding client")
        if len({id(layer) for layer in layers}) != len(layers):
            raise ValueError("a layer appears twice in the EmbeddingGroup")
        self.layers = tuple(layers)
        for layer in layers:
            layer._groups.append(self)
        self.client = layers[0].client
        self._waiting = set()  # steps holding gradients not sent yet
        self._pushes = []      # push handles in flight

    def prefetch(self, *inputs):
        """Starts pulling every member's rows for one batch (inputs in the
        members' order); returns a tuple of Prefetched, one per member, to
        pass as each member's forward(..., prefetched=)."""
        if len(inputs) != len(self.layers):
            raise ValueError(f"{len(inputs)} inputs for "
                             f"{len(self.layers)} layers")
        training = any(layer.training for layer in self.layers)
        batch = next(_pin_tags) if training else 0
        ids = {}  # id(input) -> _Ids: a tensor given twice is uniqued once
        for x in inputs:
            if id(x) not in ids:
                ids[id(x)] = _Ids(x)
        pres = tuple(Prefetched(layer, x, training, batch=batch, grouped=True,
                                ids=ids[id(x)])
                     for layer, x in zip(self.layers, inputs))
        step = _GroupStep(self, pres)
        for p in pres:
            p.step = step
        return pres

    def _track(self, handle):
        self._pushes.append(handle)
        while self._pushes and self._pushes[0].done():
            self._pushes.pop(0).wait()  # raises a failed push's error

    def synchronize(self):
        """Pushes what every finished step holds and waits until every
        push so far is applied."""
        for step in list(self._waiting):
            step.send()
        while self._pushes:
            self._pushes.pop(0).wait()


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
        self._groups = []  # EmbeddingGroups this layer belongs to

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
        if not p.ids.same(input):
            raise ValueError("forward's ids differ from the prefetched ones")
        p.used = True
        rows = torch.from_numpy(p.wait())
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(self._push_hook(p))
            if p.step is not None:
                p.step.expect(p)
        elif p.batch:
            self.client.release(self.table, p.batch)
        return rows, p.inverse.view(p.shape)

    def _push_hook(self, p):
        def push(grad):
            g = grad.detach().to(torch.float32).contiguous().numpy()
            if p.step is not None:
                p.step.add(p, g)
                return
            self._pushes.append(self.client.push_async(
                self.table, p.unique, g, p.batch, True))
            while self._pushes and self._pushes[0].done():
                self._pushes.pop(0).wait()  # raises a failed push's error
        return push

    def synchronize(self):
        """Waits until every gradient pushed so far is applied (also those
        of the EmbeddingGroups it is in)."""
        for g in self._groups:
            g.synchronize()
        while self._pushes:
            self._pushes.pop(0).wait()

    def extra_repr(self):
        return f"table={self.name!r}, dim={self.dim}"


class _GatherRows(torch.autograd.Function):
    """rows[idx] for flat positions idx, or (bag given) their per-bag sums
    out[bag[i]] += scale[i] * rows[idx[i]]. The pulled rows are a batch's
    distinct rows, so their gradient is dense and small: backward adds the
    output gradient into it with index_add, where F.embedding_bag's and
    F.embedding's dense backward sort the ids first (a third of the
    layers' backward in the CTR run)."""

    @staticmethod
    def forward(ctx, rows, idx, bag, nbags, scale):
        ctx.save_for_backward(idx, bag, scale)
        ctx.n = rows.shape[0]
        got = rows.index_select(0, idx)
        if bag is None:
            return got
        if scale is not None:
            got = got * scale
        return rows.new_zeros((nbags, rows.shape[1])).index_add_(0, bag, got)

    @staticmethod
    def backward(ctx, grad):
        idx, bag, scale = ctx.saved_tensors
        grad = grad.contiguous()
        if bag is not None:
            grad = grad.index_select(0, bag)
            if scale is not None:
                grad = grad * scale
        out = grad.new_zeros((ctx.n, grad.shape[-1]))
        return out.index_add_(0, idx, grad), None, None, None, None


class Embedding(_StoreLayer):
    """Like torch.nn.Embedding (any id shape -> shape + (dim,)), with the
    table in the memory nodes; ids are any 64-bit integers (no
    num_embeddings: rows are created on first use)."""

    def forward(self, input, prefetched=None):
        rows, idx = self._rows(input, prefetched)
        out = _GatherRows.apply(rows, idx.reshape(-1), None, 0, None)
        return out.view(*idx.shape, self.dim)


class EmbeddingBag(_StoreLayer):
    """Like torch.nn.EmbeddingBag with mode "sum" or "mean": (B, L) ids, or
    1-D ids with offsets, -> (B, dim)."""

    def __init__(self, name, dim, mode="mean", **kw):
        if mode not in ("sum", "mean"):
            raise ValueError("mode must be sum or mean")
        super().__init__(name, dim, **kw)
        self.mode = mode
        # (bags, width) -> (bag index, scale) of (B, L) ids: built once
        self._fixed_bags = {}

    def forward(self, input, offsets=None, per_sample_weights=None,
                prefetched=None):
        rows, idx = self._rows(input, prefetched)
        if per_sample_weights is not None or idx.dim() not in (1, 2) or \
                (idx.dim() == 1) != (offsets is not None):
            # torch's own path: weights, and the errors of odd shapes
            return F.embedding_bag(idx, rows, offsets, mode=self.mode,
                                   per_sample_weights=per_sample_weights)
        n = idx.numel()
        if idx.dim() == 2:  # (B, L): bags of L, the same every batch
            nbags, width = idx.shape
            bag, scale = self._fixed_bags.get((nbags, width), (None, None))
            if bag is None:
                bag = torch.arange(nbags).repeat_interleave(width)
                scale = (torch.full((n, 1), 1.0 / width)
                         if self.mode == "mean" and width else None)
                if len(self._fixed_bags) >= 8:
                    self._fixed_bags.clear()
                self._fixed_bags[(nbags, width)] = (bag, scale)
        else:  # 1-D ids, offsets[i] where bag i starts (numpy: fewer ops)
            off = (offsets.detach().cpu().numpy()
                   if isinstance(offsets, torch.Tensor) else
                   np.asarray(offsets))
            off = off.astype(np.int64, copy=False).reshape(-1)
            nbags = off.size
            lengths = np.diff(off, append=np.int64(n))
            if nbags == 0 or off[0] != 0 or (lengths < 0).any():
                # torch says what is wrong with them
                return F.embedding_bag(
                    idx, rows, torch.as_tensor(offsets, dtype=torch.int64),
                    mode=self.mode)
            bag = torch.from_numpy(np.repeat(np.arange(nbags), lengths))
            scale = None
            if self.mode == "mean":
                per_bag = (1.0 / np.maximum(lengths, 1)).astype(np.float32)
                scale = torch.from_numpy(np.repeat(per_bag, lengths)[:, None])
        return _GatherRows.apply(rows, idx.reshape(-1), bag, nbags, scale)


# Extended parameter storage: the model's state on the memory nodes.
from membox.offload import OffloadOptimizer, offload  # noqa: E402,F401
