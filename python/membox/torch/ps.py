"""ParameterServer: the explicit API -- workers push gradients and pull
weights, the memory nodes run the optimizer."""
import torch

import membox
from membox.torch._session import session, dtype_name, flat_numpy
from membox.torch.staging import staging_for


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
        self.client = client or session.client or membox.connect()
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
                data = flat_numpy(self.params[b.indices[0]].data.cpu())
            else:
                for p, view in b.views(self.params):
                    view.copy_(p.data.view(-1))
                data = b.arr
            # Rank 0's initial weights win on every node (as DDP's
            # broadcast); other ranks' first pull waits for them.
            v = self.client.declare(b.key, b.nbytes,
                                    dtype_name(self.params[b.indices[0]]), data,
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
                arr, _ = staging_for(self.client).buffer(b.key, b.nbytes)
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
                staging = staging or staging_for(self.client)
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
                staging = staging or staging_for(self.client)
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
