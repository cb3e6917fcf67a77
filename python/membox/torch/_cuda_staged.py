"""CUDA tensors through the membox process group: each operation runs on
page-locked host copies of its CUDA tensors (docs/design/backend.md, "CUDA
tensors").

An operation's CUDA arguments are copied to page-locked host tensors (torch's
caching host allocator) on the caller's current stream, which the copies then
wait for; the operation runs on the host copies by its CPU path; when it
completes, its outputs are copied back on a host-to-device stream of the
group's own, and only then does its Work complete. The Work's future is a
CUDA future of that device: a callback chained on it (DDP's reducer) waits on
events recorded after the copies, not on the whole device.

Threading: the device-to-host copies run on the caller's thread; the copies
back run on the thread that completes the host operation (the group's
exchange thread or the client's completion thread). Ownership: the host
copies live until the copies back have finished (the stream is synchronised
before the Work completes)."""
import functools
import threading

import torch


def _tensors(x, out):
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    return out


def _to_host(x, pairs, read):
    """`x` (a tensor, or lists of them, or anything else) with each CUDA
    tensor replaced by a page-locked host tensor of its shape and dtype,
    filled from it when `read`; `pairs` gets (CUDA tensor, host tensor)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cuda":
            return x
        h = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
        if read:
            h.copy_(x, non_blocking=True)
        pairs.append((x, h))
        return h
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(y, pairs, read) for y in x)
    return x


class _Streams:
    """One host-to-device stream per CUDA device, made on first use."""

    def __init__(self):
        self._lock = threading.Lock()
        self._streams = {}

    def get(self, device):
        with self._lock:
            s = self._streams.get(device.index)
            if s is None:
                s = self._streams[device.index] = torch.cuda.Stream(device)
            return s


def staged(first):
    """Decorates a process-group operation op(self, a0, *rest) so that CUDA
    tensors among its arguments go through host copies. `first` says what
    the operation does with a0: "out" (writes it), "inout" (reads and
    writes it: the in-place collectives) or "in" (reads it: send). Every
    other argument is read only.

    The backend supplies self._staged_work(what, outputs, device), a Work
    that is not yet complete, and self._h2d, a _Streams."""
    def wrap(op):
        @functools.wraps(op)
        def run(self, *args):
            cuda = [t for t in _tensors(args, []) if t.device.type == "cuda"]
            if not cuda:
                return op(self, *args)
            devices = {t.device for t in cuda}
            if len(devices) > 1:
                raise RuntimeError(
                    "membox backend: %s of tensors on several CUDA devices "
                    "(%s); one device per operation" %
                    (op.__name__, ", ".join(sorted(map(str, devices)))))
            device = cuda[0].device
            back = []
            a0 = _to_host(args[0], [] if first == "in" else back,
                          first != "out")
            rest = _to_host(args[1:], [], True)
            torch.cuda.current_stream(device).synchronize()
            inner = op(self, a0, *rest)
            w = self._staged_work(op.__name__, args[0], device)
            w._src_of = inner  # a receive's sender (recv from any rank)
            stream = self._h2d.get(device)

            def copy_back(fut):
                err = inner.exception()
                if err is not None:
                    return w._finish(err)
                try:
                    with torch.cuda.device(device), torch.cuda.stream(stream):
                        for t, h in back:
                            t.copy_(h, non_blocking=True)
                        stream.synchronize()
                        w._finish()  # events on `stream`, after the copies
                except Exception as e:  # noqa: BLE001 - reach the waiter
                    w._finish(RuntimeError(
                        "membox backend: %s: copying the result to %s: %s"
                        % (op.__name__, device, e)))
            inner._fut.add_done_callback(copy_back)
            return w
        return run
    return wrap
