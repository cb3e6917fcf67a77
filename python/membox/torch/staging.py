"""Page-locked, transport-registered staging of CUDA tensors, one per
client (kept while the client lives), and its copy-rate statistics."""
import threading
import weakref

import torch

import membox
from membox.torch import _at_exit
from membox.torch._session import client


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
        self._client = weakref.ref(client)  # _stagings maps it to this
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

    def _copy_on(self, stream, direction, nbytes, copy):
        """Runs copy() on `stream` between two events; returns the one after
        it (timed as `direction` when timing)."""
        with torch.cuda.stream(stream):
            start = self._event()
            start.record(stream)
            copy()
            done = self._event()
            done.record(stream)
        if self.timing:
            self._timed[direction].append((nbytes, start, done))
        return done

    def to_host(self, src, host, device):
        """Starts copying `src` (on `device`) into pinned `host` once the
        current stream's work on it is done; returns the completion event."""
        if not src.is_contiguous():
            src = src.contiguous()
        d2h, _ = self.streams(device)
        ready = torch.cuda.current_stream(device).record_event()
        d2h.wait_event(ready)
        done = self._copy_on(d2h, "d2h", host.numel(), lambda: host.copy_(
            src.reshape(-1).view(torch.uint8), non_blocking=True))
        src.record_stream(d2h)
        return done

    def to_device(self, host, dst, device):
        """Enqueues pinned `host` -> `dst` on the host-to-device stream; the
        caller's current stream must wait on that stream (or on a Future
        completed inside it) before using dst."""
        if not dst.is_contiguous():
            raise membox.MemboxError("membox needs contiguous CUDA tensors")
        _, h2d = self.streams(device)
        self._copy_on(h2d, "h2d", host.numel(), lambda: dst.reshape(-1).view(
            torch.uint8).copy_(host, non_blocking=True))
        dst.record_stream(h2d)
        return h2d

    def after(self, event, fn):
        """Runs fn() on the staging thread once `event` has completed."""
        with self._lock:
            if self._queue is None:
                import queue
                self._queue = queue.SimpleQueue()
                t = threading.Thread(target=self._run,
                                     name="membox-cuda-staging", daemon=True)
                t.start()
                # Ended before the interpreter finalizes: a thread inside
                # torch's C++ then would abort the process at exit
                # (membox.torch._at_exit).
                self._thread = t
                _at_exit.end_at_exit(self, _CudaStaging._stop)
        self._queue.put((event, fn))

    def _stop(self):
        self._queue.put((None, None))
        self._thread.join(timeout=10)

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


_stagings = weakref.WeakKeyDictionary()  # client -> its _CudaStaging
_stagings_lock = threading.Lock()


def staging_for(c):
    """The client's _CudaStaging, made on first use; it lives as long as
    the client (the client's memory backs it)."""
    with _stagings_lock:
        s = _stagings.get(c)
        if s is None:
            s = _stagings[c] = _CudaStaging(c)
    return s


def staging_stats(timing=None, of=None):
    """Achieved rates of the CUDA staging copies since the last call:
    {"d2h": {"bytes", "copies", "seconds", "gbps"}, "h2d": {...}}.
    staging_stats(timing=True) starts timing them (CUDA events per copy);
    `of` is the client (default: this worker's, from init())."""
    s = staging_for(of if of is not None else client())
    st = s.stats()
    if timing is not None:
        s.timing = bool(timing)
    return st
