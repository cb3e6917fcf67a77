"""OverlappedOptimizer: the optimizer stepped bucket by bucket as each
DDP bucket's average arrives."""
import queue
import threading
import weakref

import torch

from membox.torch import _at_exit
from membox.torch.ddp import allreduce_hook, for_ddp


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
        self._lock = threading.Lock()  # _queues, buckets_stepped
        self._queues = None  # "allreduce": bucket index -> its thread's queue
        self._threads = []  # (thread, its queue) of each bucket index
        if hook is None:
            hook = allreduce_hook
        elif hook == "allreduce":
            import torch.distributed as dist
            if model.process_group is not \
                    dist.distributed_c10d._get_default_group():
                self._group = model.process_group
            # The divisor of each bucket's sum, read once (not per bucket).
            self._world = dist.get_world_size(self._group)
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
        with self._lock:
            q = self._queues.get(index)
            if q is None:
                q = self._queues[index] = queue.SimpleQueue()
                t = threading.Thread(
                    target=OverlappedOptimizer._run_allreduce_steps,
                    args=(weakref.ref(self), q), daemon=True,
                    name=f"membox-overlapped-optimizer-{index}")
                self._threads.append((t, q))
                # End at Python's exit (membox.torch._at_exit says why).
                _at_exit.end_at_exit(self, OverlappedOptimizer._stop_threads)
                t.start()
        q.put((work, buf, layout, out))
        return for_ddp(out)

    @staticmethod
    def _run_allreduce_steps(ref, q):
        """A bucket index's thread: holds the optimizer only while a step
        runs (a weak reference otherwise), until _stop_threads' None."""
        while True:
            item = q.get()
            if item is None:
                return
            work, buf, layout, out = item
            del item
            self = ref()
            if self is None:
                return
            try:
                work.wait()
                buf.div_(self._world)
                self._step(buf, layout)
            except Exception as e:  # noqa: BLE001 - reach DDP's backward
                out.set_exception(e)
            else:
                out.set_result(buf)
            del self, work, buf, out

    def _stop_threads(self, wait_s=10):
        """Ends the step threads once their queued steps have run, waiting
        up to `wait_s` for each."""
        with self._lock:
            threads, self._threads = self._threads, []
            if self._queues is not None:
                self._queues.clear()
        _at_exit.forget(self)
        for _, q in threads:
            q.put(None)
        for t, _ in threads:
            if t is not threading.current_thread():
                t.join(wait_s)

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
        with self._lock:
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
