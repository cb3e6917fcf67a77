"""The DDP communication hook: each gradient bucket averaged through the
memory nodes, in place where the nodes map or register the bucket, staged
otherwise (CUDA through membox.torch.staging), optionally narrowed to a
16-bit wire type. The hook's per-bucket state lives in the session."""
import os
import queue
import threading
import time
from typing import NamedTuple

import torch

import membox
from membox.torch import _at_exit, _split
from membox.torch._session import (session, client, declare, dtype_name,
                                   flat_numpy)
from membox.torch.staging import staging_for


def _esize(dtype):
    """Bytes per element of `dtype` (torch 1.13 has no dtype.itemsize);
    on the CPU whatever the default device."""
    return torch.empty(0, dtype=dtype, device="cpu").element_size()


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
    if session.wire is not None and t.dtype in (torch.float32,
                                                 torch.float64):
        return _narrow_push_pull(client(), bucket.index(), t)
    nbytes = t.numel() * t.element_size()
    key = _bucket_key(bucket.index(), t.dtype, nbytes)
    declare(key, t)
    if t.device.type == "cuda":
        return _cuda_push_pull(client(), key, t, -bucket.index())
    c = client()
    arr = _shared_bucket(c, bucket.index(), t) if c.proxies_map_memory \
        else None
    if arr is not None:  # one host, the bucket mapped by the nodes
        out, result = arr, t
    elif not c.proxies_map_memory:
        arr = flat_numpy(t)
        _register_bucket(c, bucket.index(), t, arr)
        out, result = arr, t
    else:
        arr = flat_numpy(t)
        out, result = _result_buffer(c, key, t.numel(), t.dtype)
        result = result.view(t.shape)
    if out is arr:  # in place: a large float32 bucket may be split
        splitter = _splitter(c, t)
        if splitter is not None:
            return for_ddp(splitter.submit(bucket.index(), t, arr))
    fut = torch.futures.Future()
    handle = c.push_pull(key, arr, out, priority=-bucket.index())

    def done(err):
        if err is None:
            fut.set_result(result)
        else:
            fut.set_exception(_error(err))

    handle.add_done_callback(done)
    return for_ddp(fut)


# A CPU bucket of at least this many bytes on the wire (float32, or the
# bfloat16 / float16 wire copy of one), with the nodes on other hosts and
# more workers than nodes, is split as the backend's all_reduce is: its
# head around the workers' ring while its tail is averaged on the nodes
# (membox.torch._split; docs/design/backend.md, "Split all_reduce").
# 0 turns it off (MEMBOX_HOOK_SPLIT_BYTES, read once at import).
_SPLIT_BYTES = int(os.environ.get("MEMBOX_HOOK_SPLIT_BYTES", 4 << 20))
_SPLIT_ON_ONE_HOST = False  # tests: split even where the nodes map memory
# A split tail's key: _bucket_key's layout with this dtype code (float32),
# or the next lower one (a 16-bit wire's tails).
_SPLIT_TAIL = 15
_SPLIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _splitter(c, t):
    """The session's _Splitter when bucket `t` (what goes on the wire) is
    split, else None: float32, or a bfloat16 / float16 wire copy, on the
    CPU, _SPLIT_BYTES or more, the nodes averaging or summing, under
    torch.distributed with more workers than nodes (the links' balance
    gives the ring a share), and the nodes reached over a link (where they
    map this worker's memory they sum at memory speed)."""
    if not (0 < _SPLIT_BYTES <= t.numel() * t.element_size() and
            t.dtype in _SPLIT_DTYPES and t.device.type == "cpu" and
            session.mode in ("average", "sum")):
        return None
    if c.proxies_map_memory and not _SPLIT_ON_ONE_HOST:
        return None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _split.first_share(dist.get_world_size(), c.num_proxies) == 0:
        return None
    with session.lock:
        if session.splitter is None:
            session.splitter = _Splitter(c, session.mode == "average")
        return session.splitter


class _Splitter:
    """Split buckets: each one's head around a ring of the workers (made on
    first use) while its tail is a round on the nodes in place, the ring's
    share following the parts' speeds (membox.torch._split.Share, agreed
    through torch.distributed's store). Two threads of its own, so both
    paths stay busy: the ring thread takes the buckets in the order DDP
    hands them over (the same on every rank, so every rank cuts alike),
    starts each one's tail and runs its head, then goes on to the next
    bucket; the finish thread waits for each tail in the same order,
    finishes the bucket (widened, averaged) and completes its future. So
    bucket i + 1's head goes around the ring while bucket i's tail is still
    on the nodes, instead of whichever part ended first idling its path."""

    def __init__(self, c, average):
        import torch.distributed as dist
        from membox.torch._session import _proxies
        self._c, self._average = c, average
        self._store = dist.distributed_c10d._get_default_store()
        self._rank, self._size = dist.get_rank(), dist.get_world_size()
        self._share = _split.Share(self._store, self._rank, self._size,
                                   c.num_proxies, "membox/hook-split")
        self._first = _proxies()[0]
        self._ring = None
        self._jobs = queue.Queue()  # to the ring thread
        self._started = queue.Queue()  # to the finish thread
        self._threads = [
            threading.Thread(target=target, daemon=True, name=name)
            for target, name in ((self._serve, "membox-hook-split"),
                                 (self._finish, "membox-hook-split-finish"))]
        for th in self._threads:
            th.start()
        # It completes torch futures: ended at Python's exit (_at_exit).
        _at_exit.end_at_exit(self, _Splitter.stop)

    def submit(self, index, t, arr, result=None):
        """Sums bucket `t` (its memory: `arr`) in place; `result`: the
        float32 bucket `t` is a narrow wire copy of, widened into once the
        sum is in. The future's value is `result`, else `t`."""
        fut = torch.futures.Future()
        self._jobs.put((index, t, arr, result, fut))
        return fut

    def stop(self, wait_s=10):
        """Ends both threads once what is queued has run (waits up to
        `wait_s` unless called from one of them)."""
        self._jobs.put(None)
        if threading.current_thread() not in self._threads:
            for th in self._threads:
                th.join(wait_s)

    def _serve(self):
        while True:
            job = self._jobs.get()
            if job is None:
                self._started.put(None)
                return
            try:
                self._started.put(self._start(*job))
            except Exception as e:  # noqa: BLE001 - reach the waiter
                job[-1].set_exception(e)

    def _start(self, index, t, arr, result, fut):
        """On the ring thread: starts the bucket's tail on the nodes and
        sums its head around the ring. Returns what _finish needs."""
        share = self._share.take()
        n = arr.size
        cut = n * share // _split.STEPS
        name = dtype_name(t)
        esize = t.element_size()
        done = threading.Event()
        tail = [None, None]  # error, seconds
        t0 = time.perf_counter()

        def tail_done(err):
            tail[0], tail[1] = err, time.perf_counter() - t0
            done.set()
        if cut < n:
            code = _SPLIT_TAIL if t.dtype == torch.float32 else _SPLIT_TAIL - 1
            key = (index << 40) | (code << 36) | ((n - cut) * esize)
            declare(key, t.view(-1)[cut:])
            self._c.push_pull(key, arr[cut:], arr[cut:],
                              priority=-index).add_done_callback(tail_done)
        else:
            tail_done(None)
        ring_error = None
        if cut:
            try:
                if self._ring is None:
                    self._ring = _split.connect_direct(
                        self._store, self._rank, self._size,
                        _split.address_toward(self._first),
                        "membox/hook-ring", membox._core.Ring,
                        _split.RING_MAX_BYTES, _split.DEFAULT_TIMEOUT,
                        segment_bytes=_split.RING_SEGMENT_BYTES)
                step = _split.RING_MAX_BYTES // esize
                for i in range(0, cut, step):
                    self._ring.allreduce(arr[i:min(cut, i + step)], name)
            except Exception as e:  # noqa: BLE001 - after the tail's wait
                ring_error = e
        ring_s = time.perf_counter() - t0
        return _Started(t, result, fut, share, cut, ring_s, ring_error, done,
                        tail)

    def _finish(self):
        while True:
            started = self._started.get()
            if started is None:
                return
            try:
                self._end(started)
            except Exception as e:  # noqa: BLE001 - reach the waiter
                started.fut.set_exception(e)
                continue
            started.fut.set_result(started.t if started.result is None
                                   else started.result)

    def _end(self, s):
        """On the finish thread: waits for the bucket's tail (its tail
        shares `s.t`'s memory: never left running), then finishes it."""
        if not s.done.wait(_split.DEFAULT_TIMEOUT.total_seconds()):
            raise membox.MemboxError("a split bucket's round on the nodes "
                                     "did not finish")
        if s.ring_error is not None:
            raise s.ring_error
        if s.tail[0] is not None:
            raise _error(s.tail[0])
        out = s.t
        if s.result is not None:  # widened first: the head's average is
            out = s.result.view(-1)  # divided in float32, rounded once less
            out.copy_(s.t.view(-1))
        if s.cut and self._average:
            out.view(-1)[:s.cut].div_(self._size)
        self._share.measured(s.share, s.ring_s, s.tail[1])


class _Started(NamedTuple):
    """A split bucket as the ring thread hands it to the finish thread."""
    t: torch.Tensor  # the bucket (its head summed in place already)
    result: object  # the float32 bucket `t` is a wire copy of, or None
    fut: torch.futures.Future  # DDP's, completed by the finish thread
    share: int  # the ring's share of it (_split.Share.take)
    cut: int  # elements [0, cut) went around the ring
    ring_s: float  # the ring's seconds
    ring_error: object  # the ring's exception, or None
    done: threading.Event  # set when the tail's round on the nodes ends
    tail: list  # [error or None, seconds] of the tail's round


def _result_buffer(c, key, numel, dtype):
    """Where the nodes map this worker's memory (one host): the average is
    written by the node into registered memory kept per bucket key, and
    that memory is the Future's result. DDP copies its gradients out of
    whatever tensor the hook returns (Reducer's bucket views out), so the
    average is copied once into the gradients instead of first back into
    the bucket and then into the gradients. The buffer is rewritten only by
    the next round of the same bucket, after DDP has read it. Kept in the
    session (bucket key -> (numpy view, tensor)), as long as its client."""
    with session.lock:
        results = session.results
        r = results.get(key)
    if r is None:
        arr = c.allocate(numel * _esize(dtype))
        r = (arr, torch.from_numpy(arr).view(dtype))
        with session.lock:
            results[key] = r
    return r


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
    wire = session.wire
    key = _bucket_key(index, wire,
                      t.numel() * _esize(wire))
    arr = None
    if t.device.type == "cpu" and c.proxies_map_memory:
        arr, w = _result_buffer(c, key, t.numel(), wire)
    else:
        with session.lock:
            w = session.narrow.get(index)
            if (w is None or w.numel() != t.numel() or w.dtype != wire
                    or w.device != t.device):
                w = torch.empty(t.numel(), dtype=wire, device=t.device)
                session.narrow[index] = w
    w.copy_(t.view(-1))
    if t.device.type == "cuda":
        declare(key, w)
        return _cuda_push_pull(c, key, w, -index, result=t)
    if arr is None:
        arr = flat_numpy(w)
        _register_bucket(c, index, w, arr)
    # A large narrow bucket is split as a float32 one is: its head summed
    # in the wire type around the workers' ring, its tail on the nodes.
    # (flat_numpy(w): the elements; one host's `arr` is its bytes.)
    splitter = _splitter(c, w)
    if splitter is not None:
        return for_ddp(splitter.submit(index, w, flat_numpy(w), result=t))
    declare(key, w)
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
    return for_ddp(fut)


def _first_iteration(bucket):
    """True for the buckets of DDP's first iteration (before its bucket
    rebuild), when torch.distributed is up to carry them."""
    import torch.distributed as dist
    with session.lock:
        first = session.iterations_seen == 0
        if bucket.is_last():
            session.iterations_seen += 1
    return first and dist.is_available() and dist.is_initialized()


def _error(err):
    """membox's exception for a failed round's message (ProxyUnavailable for
    a memory node that is gone or a job it broke)."""
    gone = err.startswith(("UNAVAILABLE", "ABORTED"))
    return (membox.ProxyUnavailable if gone else membox.MemboxError)(err)


def _raise_or_value(f):
    return f.value()  # raises the exception set_exception stored


def for_ddp(fut):
    """torch's Future.set_exception stores the exception as the value, to be
    raised by a Python wait(); DDP reads the value in C++ and then fails with
    "Unable to cast <message> to Tensor". A then() whose callback raises it
    makes the error one C++ sees: backward() raises it with membox's message
    (the node named)."""
    return fut.then(_raise_or_value)


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
    file: then the staged path, and session.share_refused says why)."""
    if session.share_refused:
        return None
    if os.environ.get("MEMBOX_SHARE_BUCKETS", "1") == "0":
        session.share_refused.append("MEMBOX_SHARE_BUCKETS=0")
        return None
    nbytes = t.numel() * t.element_size()
    with session.lock:
        old = session.buckets.get(index)
    if old is not None and old[0] == t.data_ptr() and old[1] == nbytes:
        return flat_numpy(t)
    if not _shm_has_room(nbytes):
        return None  # this bucket staged; a smaller one may still fit
    try:  # torch 1.13 has no untyped_storage(); its storage() shares too
        storage = (t.untyped_storage() if hasattr(t, "untyped_storage")
                   else t.storage())
        fd, _ = storage._share_fd_cpu_()
    except (AttributeError, RuntimeError) as e:
        session.share_refused.append(
            "torch cannot share the bucket: %s" % e)
        return None
    arr = flat_numpy(t)  # after the move: the bucket's new address
    try:
        _register_bucket(c, index, t, arr, fd=fd,
                         file_offset=t.data_ptr() - storage.data_ptr())
    except membox.MemboxError as e:
        session.share_refused.append(str(e))
        with session.lock:
            session.buckets.pop(index, None)
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
    with session.lock:
        old = session.buckets.get(index)
        if old is not None and old[0] == ptr and old[1] == nbytes:
            return
        session.buckets[index] = (ptr, nbytes, t)
    if old is not None:
        try:
            c.unregister_tensor(flat_numpy(old[2]))
        except membox.MemboxError:
            pass  # already replaced by an overlapping registration
    c.register_tensor(arr, fd=fd, file_offset=file_offset)


def _cuda_push_pull(c, key, t, priority, result=None):
    """Averages CUDA tensor `t` through the staging memory (_CudaStaging):
    the Future completes with `t` on the host-to-device stream. With
    `result` (the bucket `t` is a wire-type copy of), `t` is widened into
    `result` on that stream first and the Future completes with `result`."""
    device = t.device
    staging = staging_for(c)
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
    return for_ddp(fut)
