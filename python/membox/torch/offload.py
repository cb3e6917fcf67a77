"""Extended parameter storage (seed 000 COARSE, Fig. 16e): the memory nodes
hold the model -- fp32 master parameters, the optimizer state and the sums
of the gradients -- and a worker holds a unit's parameters only while that
unit computes.

    opt = membox.torch.offload(model, optimizer="adam", lr=1e-3)
    loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()

Design (docs/design/offload.md):

- A *unit* is a submodule (chosen by size, like FSDP's auto-wrap, or named
  by the caller); the root is a unit of the parameters no other unit owns.
  A parameter used by several units (tied weights) is a unit of its own
  that stays resident from its first use in a step until its gradient is
  pushed. Each unit's parameters are one key per (dtype, trainable) on the
  memory nodes, striped over them like any large key.
- Forward: a unit's forward pre-hook waits for its pull (issued `prefetch`
  units ahead, in the order recorded in the first step) into one of
  prefetch + 1 registered buffers the units take turns in (unit i always in
  buffer i mod (prefetch + 1)), and lays the parameters out as views of it;
  its forward hook releases them. Autograd's saved views point into that
  buffer, which holds the unit's value again whenever its backward runs.
- Backward: a hook on the unit's outputs pulls the unit again unless its
  buffer still holds it (the last units of the forward do) (prefetching
  the next ones in backward order); each parameter's post-accumulate-grad
  hook counts the unit's gradients, and the last copies them into a
  registered buffer, pushes them and frees them and the parameters. The
  nodes sum the pushes of every worker, average them and step the
  optimizer on each shard as soon as the round is complete -- overlapped
  with the rest of backward. The next forward's pull waits for that round.
- step() waits for the pushes; zero_grad() has nothing to free.
- Gradient accumulation is DDP's: micro-batches inside `opt.no_sync()` keep
  their gradients on the worker (as DDP and FSDP do); the backward outside
  it pushes the sum. A second backward outside no_sync() before step() is
  an error (it would step the optimizer twice).

Threading: hooks run on the thread autograd runs them on (the caller's for
CPU backward); pushes and pulls complete on membox's transport threads, and
only their handles are touched there. Not for concurrent steps on one model.
"""
import contextlib
import itertools
import math
import time

import torch

import membox
from membox.torch import _session
from membox.torch.staging import staging_for

_KEY_BASE = 0xB << 60  # key space of offloaded models (the other modules have others)
_models = itertools.count()
_OPTIMIZERS = {
    # name: hyperparameters it takes (torch.optim's names) and their defaults
    "sgd": {"momentum": 0.0, "weight_decay": 0.0},
    "adam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
    "adagrad": {"eps": 1e-10, "weight_decay": 0.0},
}
_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
# The nodes' optimizer state by torch's names: (state key, node part).
_MOMENTS = {
    "sgd": (("momentum_buffer", "moment1"),),
    "adam": (("exp_avg", "moment1"), ("exp_avg_sq", "moment2")),
    "adamw": (("exp_avg", "moment1"), ("exp_avg_sq", "moment2")),
    "adagrad": (("sum", "moment1"),),
}


def _no_grad_hook(fn):
    def run(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)
    return run


class _Key:
    """One key on the memory nodes: the parameters of one unit with one
    dtype and trainability, back to back. On CPU they are laid out as views
    of the unit's transfer buffer (the pull lands there); a CUDA key has a
    device tensor `flat` whose storage is allocated only while laid out."""

    def __init__(self, key, params, trainable, compute_dtype=None):
        self.key = key
        self.params = params
        self.trainable = trainable
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.shapes = [p.shape for p in params]  # p.data is swapped later
        self.offsets, at = [], 0
        for p in params:
            self.offsets.append(at)
            at += p.numel()
        self.numel = at
        self.esize = params[0].element_size()
        self.nbytes = at * self.esize
        # What the parameters are laid out in: views of the unit's buffer
        # (CPU, the masters' dtype), or a tensor of their own whose storage
        # exists only while laid out (CUDA; or a compute dtype: bfloat16 /
        # float16 copies of the float32 masters).
        self.flat = None
        compute = compute_dtype if compute_dtype is not None and \
            self.dtype.is_floating_point else self.dtype
        if self.device.type == "cuda" or compute != self.dtype:
            self.flat = torch.empty(self.numel, dtype=compute,
                                    device=self.device)
            self.flat.untyped_storage().resize_(0)
        self.at = 0  # byte offset in the unit's buffer
        self.pushed = False  # this step's gradient is on its way
        # Rounds the nodes completed on every shard of the key; a key ahead
        # of the job's step (its round finished before a worker died
        # mid-step) is recomputed from its previous value and not pushed in
        # that step. A key whose round finished on some shards only is not
        # ahead: it is pushed again, and those shards answer with their
        # result.
        self.version = 0
        self.ahead = False

    def write_initial(self, out):
        """Copies the parameters' current values into flat CPU `out`."""
        for p, off in zip(self.params, self.offsets):
            out[off:off + p.numel()].copy_(p.data.reshape(-1))

    def views(self, flat):
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            yield p, flat[off:off + shape.numel()].view(shape)

    def allocated(self):
        return self.flat.untyped_storage().nbytes() if self.flat is not None \
            else 0


class _Unit:
    """A module whose own parameters (those of no inner unit) are laid out
    only around its forward and backward.

    States: `loaded` -- its buffer holds the nodes' current value (a pull
    completed and no push of it since); `pending` -- a pull into its buffer
    is in flight; `laid` -- its parameters are views of that value; `busy`
    -- its forward or backward is running (its buffer must not be
    reused)."""

    def __init__(self, name, module, keys, shared=False):
        self.name = name
        self.module = module
        self.keys = keys
        self.shared = shared  # tied parameters: resident for the step
        at = 0
        for k in keys:
            k.at = at
            at += (k.nbytes + 63) // 64 * 64
        self.nbytes = at
        self.buffer = None  # index into the optimizer's buffers
        self.loaded = self.laid = self.busy = False
        self.pending = None  # [handles]
        self.grads_left = self.grads_total = 0
        self.backward_seen = False
        self.pull_s = self.compute_s = None  # timed in the first step
        self.users = []  # shared units: the units whose compute needs it

    @property
    def trainable(self):
        return [p for k in self.keys if k.trainable for p in k.params]


class _Buffer:
    """Transport-registered memory (CUDA: also page-locked) that pulls land
    in and pushes leave from: the nodes read and write it in place."""

    def __init__(self, client, size, cuda, tag):
        self.size = size
        if cuda:
            self.arr, self.host = staging_for(client).buffer(tag, size)
        else:
            self.arr = client.allocate(size)
            self.host = torch.frombuffer(self.arr, dtype=torch.uint8)
        self.owner = None  # the unit whose value it holds or receives
        # CUDA: the host-to-device copy out of this buffer, which a pull
        # into it must wait for.
        self.copied = None


class OffloadOptimizer(torch.optim.Optimizer):
    """The optimizer of a model whose state lives on the memory nodes (see
    membox.torch.offload). One param group, whose hyperparameters torch's LR
    schedulers drive; a change reaches the nodes before the next step's
    first push."""

    def __init__(self, model, client, optimizer, hyper, prefetch, units,
                 min_unit_params, compute_dtype=None):
        self._ready = False
        params = list(model.parameters())
        torch.optim.Optimizer.__init__(self, params, dict(hyper))
        self.model = model
        self.client = client
        self.kind = optimizer
        # prefetch None: 2 for the first step, then chosen from its timings.
        self._auto = prefetch is None
        self.prefetch = 2 if prefetch is None else prefetch
        self.profiled = None
        self._sync = True
        self._step_open = False  # a backward pushed since the last step()
        self._handles = []  # pushes in flight: (slot, handle)
        self._order = []  # units in the order their forward ran (1st step)
        self._recording = True
        self._peak_units = 0
        self._peak_bytes = 0
        self._sent = self._hyper()
        self._build_units(model, units, min_unit_params, compute_dtype)
        self._declare()
        self._install_hooks()
        self._ready = True

    # ------------------------------------------------------------ building
    def _build_units(self, model, units, min_unit_params, compute_dtype):
        names = {id(m): n for n, m in model.named_modules()}
        if units is None:
            chosen = _size_policy(model, min_unit_params)
        elif callable(units):
            chosen = [m for m in model.modules() if m is not model and
                      units(m)]
        else:
            chosen = list(units)
            for m in chosen:
                if id(m) not in names:
                    raise ValueError("offload: a unit is not a submodule of "
                                     "the model")
        chosen = [m for m in chosen if m is not model]
        unit_of = {}  # id(module) -> unit name
        for m in chosen:
            unit_of[id(m)] = names[id(m)]
        # Owner unit of every parameter: the innermost unit above it.
        owners = {}  # id(param) -> set of unit modules using it
        param_by_id = {}

        def walk(module, current):
            if id(module) in unit_of:
                current = module
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), [])
                if current not in owners[id(p)]:
                    owners[id(p)].append(current)
                param_by_id[id(p)] = p
            for child in module.children():
                walk(child, current)

        # named_modules() visits a module once; walk every edge so a module
        # (or parameter) reached by two paths is seen in both units.
        walk(model, model)
        groups = {}  # unit module (or "shared") -> [params]
        order = []
        for pid, us in owners.items():
            home = us[0] if len(us) == 1 else "shared"
            if home not in groups:
                groups[home] = []
                order.append(home)
            groups[home].append(param_by_id[pid])
        model_index = next(_models)
        self._base = _KEY_BASE + (model_index << 32)
        self.units = []
        self._unit_of_module = {}
        next_key = itertools.count(self._base)
        for home in order:
            keys = []
            params = groups[home]
            for dtype in sorted({p.dtype for p in params}, key=str):
                for trainable in (True, False):
                    ps = [p for p in params if p.dtype == dtype and
                          p.requires_grad == trainable]
                    if ps:
                        keys.append(_Key(next(next_key), ps, trainable,
                                         compute_dtype))
            if home == "shared":
                u = _Unit("(tied)", None, keys, shared=True)
                u.users = sorted({id(m) for pid, us in owners.items()
                                  if len(us) > 1 for m in us})
            else:
                u = _Unit(names[id(home)] or "(root)", home, keys)
                self._unit_of_module[id(home)] = u
            self.units.append(u)
        # Modules that are units but own no parameter directly still get
        # hooks (they may use a tied unit).
        for m in chosen:
            if id(m) not in self._unit_of_module:
                u = _Unit(names[id(m)], m, [])
                self._unit_of_module[id(m)] = u
                self.units.append(u)
        if id(model) not in self._unit_of_module:
            u = _Unit("(root)", model, [])
            self._unit_of_module[id(model)] = u
            self.units.append(u)
        self.root = self._unit_of_module[id(model)]
        self.shared = [u for u in self.units if u.shared]
        self._param_unit = {}
        for u in self.units:
            for k in u.keys:
                for p in k.params:
                    self._param_unit[id(p)] = (u, k)
        self._cuda = any(k.device.type == "cuda" for u in self.units
                         for k in u.keys)
        # Buffers: the root's and the tied parameters' own (resident for a
        # step anyway), and prefetch + 1 that the other units take turns
        # in -- unit i of the forward order always in buffer i mod
        # (prefetch + 1), so the views autograd saved in its forward see
        # its value again when it is pulled back for its backward.
        self._buffers = []
        for u in self.units:
            if u.keys and (u.shared or u is self.root):
                u.buffer = self._new_buffer(u.nbytes)
        turns = [u for u in self.units if u.keys and u.buffer is None]
        largest = max((u.nbytes for u in turns), default=0)
        self._turns = [self._new_buffer(largest)
                       for _ in range(self.prefetch + 1)] if turns else []
        biggest = max((k.nbytes for u in self.units for k in u.keys
                       if k.trainable), default=0)
        self._push_bufs = [self._new_buffer(biggest) for _ in range(2)] \
            if biggest else []
        self._push_free = list(range(len(self._push_bufs)))
        self._overflow_warned = False

    def _new_buffer(self, size):
        b = _Buffer(self.client, max(size, 64), self._cuda,
                    ("offload", id(self), len(self._buffers)))
        self._buffers.append(b)
        return len(self._buffers) - 1

    def _declare(self):
        kw = self._node_hyper(self._hyper())
        for u in self.units:
            # Initial values from registered memory (the unit's buffer): the
            # nodes read them in place, and the client needs no staging copy
            # of the key (which it would keep).
            b = self._buffers[u.buffer if u.buffer is not None
                              else self._turns[0]]
            for k in u.keys:
                src = b.host[k.at:k.at + k.nbytes]
                k.write_initial(src.view(k.dtype))
                # Frozen keys have the optimizer too (they are never
                # pushed, so it never steps): a loaded state dict writes
                # their values the same way, and one tune covers every key.
                k.version = self.client.declare(
                    k.key, k.nbytes, _DTYPES[k.dtype],
                    b.arr[k.at:k.at + k.nbytes], optimizer=self.kind, **kw)
        # Steps every key has completed: where a restarted worker goes on.
        trained = [k.version for u in self.units for k in u.keys
                   if k.trainable]
        self.version = min(trained) if trained else 0
        for u in self.units:
            for k in u.keys:
                k.ahead = k.trainable and k.version > self.version
        # Keys whose round of step version + 1 finished before the job died
        # (a restarted worker recomputes that step from their previous
        # values and does not push them).
        self.ahead = sum(k.ahead for u in self.units for k in u.keys)
        import os
        restarted = os.environ.get("MEMBOX_RESTART", "0") != "0"
        # A job going on from the nodes: until the first step() the forward
        # and backward compute from the values as of that step, shard by
        # shard (_pull).
        self._first_step = bool(self.version) or restarted
        if self.version and not restarted:
            import warnings
            warnings.warn("offload: the memory nodes already hold this "
                          "model at step %d (an earlier job's keys, not a "
                          "restart of this one): training goes on from "
                          "there; start fresh nodes for a new model" %
                          self.version)
        # The model's memory goes: from here on the nodes hold it.
        placeholder = {}
        for u in self.units:
            for k in u.keys:
                for p in k.params:
                    ph = placeholder.get((p.dtype, p.device))
                    if ph is None:
                        ph = torch.empty(0, dtype=p.dtype, device=p.device)
                        placeholder[(p.dtype, p.device)] = ph
                    p.data = ph
        self._placeholder = placeholder

    def _install_hooks(self):
        for u in self.units:
            if u.module is None:
                continue
            u.module.register_forward_pre_hook(self._make_pre_forward(u))
            u.module.register_forward_hook(self._make_post_forward(u))
        # model.state_dict(): each module with parameters of its own fills
        # them in from the nodes (or from a resident unit).
        for m in self.model.modules():
            if any(id(p) in self._param_unit
                   for p in m.parameters(recurse=False)):
                m._register_state_dict_hook(self._state_hook)
        # Gathered once per state_dict() call (a unit's modules share it);
        # the root's last hook lets the copies go.
        self._gathered = {}  # unit -> {id(param): value}
        self.model._register_state_dict_hook(
            lambda *args: self._gathered.clear())
        # model.load_state_dict(): values go to the nodes.
        self._loading = {}  # key -> {id(param): loaded tensor}
        for m in self.model.modules():
            if any(id(p) in self._param_unit
                   for p in m.parameters(recurse=False)):
                m._register_load_state_dict_pre_hook(self._load_hook,
                                                     with_module=True)
        self.model.register_load_state_dict_post_hook(self._load_done)
        for u in self.units:
            for k in u.keys:
                if not k.trainable:
                    continue
                for p in k.params:
                    u.grads_left += 1
                    p.register_post_accumulate_grad_hook(
                        self._make_grad_hook(u))
            u.grads_total = u.grads_left

    # ------------------------------------------------------ hyperparameters
    def _hyper(self):
        g = self.param_groups[0]
        return {name: g[name] for name in g if name != "params"}

    def _node_hyper(self, h):
        out = {"lr": float(h["lr"])}
        if "momentum" in h:
            out["momentum"] = float(h["momentum"])
        if "betas" in h:
            out["beta1"], out["beta2"] = (float(b) for b in h["betas"])
        if "eps" in h:
            out["eps"] = float(h["eps"])
        if "weight_decay" in h:
            out["weight_decay"] = float(h["weight_decay"])
        return out

    def set_lr(self, lr):
        """Sets the learning rate from the next step on (every worker, the
        same value between the same two steps, as a schedule does)."""
        self.param_groups[0]["lr"] = lr

    def _tune(self):
        want = self._hyper()
        if want == self._sent:
            return
        kw = self._node_hyper(want)
        keys = [k.key for u in self.units for k in u.keys]
        if keys:
            self.client.tune(min(keys), max(keys) + 1, self.kind, **kw)
        self._sent = want

    # ---------------------------------------------------------- transfers
    def _buffer_of(self, u):
        """The buffer unit u is pulled into: its own, or its turn."""
        if u.buffer is not None:
            return u.buffer
        if u not in self._order:
            self._order.append(u)  # outside the recorded forward
        i = self._order.index(u) % len(self._turns)
        return self._turns[i]

    def _take(self, u, b, must):
        """Makes buffer b unit u's: evicts its holder unless that one is in
        use. False when it is (and `must` is not set)."""
        buf = self._buffers[b]
        w = buf.owner
        if w is u or w is None:
            buf.owner = u
            return True
        if w.laid or w.busy:
            if not must:
                return False
            if u.backward_seen or u.laid:
                raise membox.MemboxError(
                    "offload: unit %s must return to its buffer for backward, "
                    "but unit %s is using it (the units ran in an order unlike "
                    "the first step's); pass units= without nesting" %
                    (u.name, w.name))
            # A unit whose turn is taken before its forward: a buffer of its
            # own from now on.
            if not self._overflow_warned:
                import warnings
                warnings.warn("offload: unit %s and %s overlap in time; %s "
                              "gets a buffer of its own" %
                              (u.name, w.name, u.name))
                self._overflow_warned = True
            u.buffer = self._new_buffer(u.nbytes)
            self._buffers[u.buffer].owner = u
            return True
        if w.pending is not None:
            for h in w.pending:
                h.wait()
            w.pending = None
        w.loaded = False
        buf.owner = u
        return True

    def _request(self, u, must=False):
        """Starts pulling unit u into its buffer unless its value is there
        or on its way."""
        if not u.keys or u.laid or u.pending is not None:
            return
        b = self._buffer_of(u)
        if u.loaded and self._buffers[b].owner is u:
            return
        if not self._take(u, b, must):
            return
        b = self._buffer_of(u)  # may be a new buffer of its own
        if self._buffers[b].copied is not None:
            self._buffers[b].copied.synchronize()
            self._buffers[b].copied = None
        arr = self._buffers[b].arr
        u.pending = [self._pull(k, arr[k.at:k.at + k.nbytes])
                     for k in u.keys]
        u.loaded = False

    def _pull(self, k, out):
        if not (self._first_step and k.trainable):
            return self.client.pull(k.key, out)
        # The first step after declaring: the values as of self.version.
        # Where a job died in this step, its round may have finished on
        # some shards of the key (all of them: an ahead key): those give
        # the value from before it.
        h = self.client.pull_at(k.key, self.version, out)
        try:
            h.wait()
        except membox.MemboxError as e:
            import warnings
            warnings.warn("offload: key %d's value before its last step is "
                          "gone (%s); the step after a restart uses its "
                          "current value" % (k.key, e))
            return self.client.pull(k.key, out)
        return h

    def _materialize(self, u):
        """Lays unit u's parameters out (pulling them if needed)."""
        if u.laid or not u.keys:
            return
        self._request(u, must=True)
        if u.pending is not None:
            for h in u.pending:
                h.wait()
            u.pending = None
        u.loaded = True
        buf = self._buffers[u.buffer if u.buffer is not None
                            else self._buffer_of(u)]
        host = buf.host
        streams = set()
        staged = []
        for k in u.keys:
            src = host[k.at:k.at + k.nbytes]
            flat = src.view(k.dtype)
            if k.flat is not None:
                nbytes = k.numel * k.flat.element_size()
                if k.device.type != "cuda":  # a compute-dtype copy
                    k.flat.untyped_storage().resize_(nbytes)
                    k.flat.copy_(flat)
                elif k.flat.dtype == k.dtype:  # the pull, to the device
                    # Allocated in the copy's stream: a block the compute
                    # stream freed may still be read by its queued kernels
                    # (a unit released before the GPU ran its compute);
                    # the allocator holds a block back from other streams
                    # until the compute recorded on it is done (below).
                    staging = staging_for(self.client)
                    _, h2d = staging.streams(k.device)
                    with torch.cuda.stream(h2d):
                        k.flat.untyped_storage().resize_(nbytes)
                    streams.add(staging.to_device(src, k.flat, k.device))
                    staged.append(k.flat)
                else:  # to the device, then narrowed there
                    k.flat.untyped_storage().resize_(nbytes)
                    k.flat.copy_(flat.to(k.device))
                flat = k.flat
            for p, view in k.views(flat):
                p.data = view
        for st in streams:
            torch.cuda.current_stream(st.device).wait_stream(st)
            buf.copied = st.record_event()
        for t in staged:  # read by the compute stream from now on
            t.record_stream(torch.cuda.current_stream(t.device))
        u.laid = True
        self._account()

    def _release(self, u):
        """Unit u's parameters go (its value stays in its buffer until
        another unit takes it or a push makes it stale)."""
        for k in u.keys:
            for p in k.params:
                p.data = self._placeholder[(k.dtype, k.device)]
            if k.flat is not None:
                k.flat.untyped_storage().resize_(0)
        u.laid = False

    def _account(self):
        def counted(u):
            return u.keys and not u.shared and u is not self.root
        units = sum(1 for u in self.units if counted(u) and
                    (u.laid or
                     any(p.grad is not None for p in u.trainable)))
        self._peak_units = max(self._peak_units, units)
        self._peak_bytes = max(self._peak_bytes, self.resident_bytes())

    def _push(self, u):
        self._gathered.clear()
        if self._hyper() != self._sent:
            self._tune()
        for k in u.keys:
            if not k.trainable:
                continue
            if k.ahead:  # its round of this step is done already
                k.pushed = True
                for p in k.params:
                    p.grad = None
                continue
            if k.pushed:
                raise membox.MemboxError(
                    "offload: a second backward before step() would step "
                    "the optimizer twice; run the earlier micro-batches "
                    "inside opt.no_sync()")
            while not self._push_free:
                self._wait_oldest_push()
            i = self._push_free.pop(0)
            pb = self._buffers[self._push_bufs[i]]
            arr, host = pb.arr, pb.host
            buf = host[:k.nbytes]
            event = None
            for p, off, shape in zip(k.params, k.offsets, k.shapes):
                dst = buf[off * k.esize:(off + shape.numel()) * k.esize]
                if p.grad is None:
                    dst.zero_()
                elif p.grad.is_cuda:
                    g = p.grad if p.grad.dtype == k.dtype else \
                        p.grad.to(k.dtype)  # widened on the device
                    event = staging_for(self.client).to_host(
                        g, dst, p.grad.device)
                else:
                    dst.view(k.dtype).copy_(p.grad.reshape(-1))
            if event is not None:
                event.synchronize()
            k.pushed = True
            h = self.client.push(k.key, arr[:k.nbytes],
                                 priority=self._priority(u))
            self._handles.append((i, h))
            for p in k.params:
                p.grad = None
            u.loaded = False  # the nodes' value moves on with this round
        self._step_open = True

    def _priority(self, u):
        # The first units' rounds first: the next forward needs them first.
        try:
            return self._order.index(u)
        except ValueError:
            return len(self._order)

    def _wait_oldest_push(self):
        i, h = self._handles.pop(0)
        h.wait()
        self._push_free.append(i)

    # -------------------------------------------------------------- hooks
    def _make_pre_forward(self, u):
        @_no_grad_hook
        def hook(module, args):
            if u is self.root:
                self._begin_forward()
            if self._recording and u.keys and u not in self._order:
                self._order.append(u)
            for s in self.shared:
                if id(module) in s.users:
                    self._materialize(s)
            u.busy = True
            if self._recording and self._auto and u.keys:
                # The first forward prefetches nothing: each unit's wait is
                # a whole pull; its compute is timed in the forward hook.
                t0 = time.perf_counter()
                self._materialize(u)
                u.pull_s = time.perf_counter() - t0
                u.compute_from = time.perf_counter()
            else:
                self._materialize(u)
            self._prefetch_after(u, self._order)
        return hook

    def _make_post_forward(self, u):
        def hook(module, args, output):
            if u is self.root:
                self._recording = False
                return output
            if self._recording and self._auto and u.keys:
                u.compute_s = time.perf_counter() - u.compute_from
            if torch.is_grad_enabled():
                outs = [t for t in _tensors(output) if t.requires_grad]
                if outs:
                    u.backward_seen = False

                    def pre_backward(grad):
                        if not u.backward_seen:
                            u.backward_seen = True
                            with torch.no_grad():
                                self._pre_backward(u)
                        return grad
                    for t in outs:
                        t.register_hook(pre_backward)
            u.busy = False
            if u.keys:
                with torch.no_grad():
                    self._release(u)
            return output
        return hook

    def _pre_backward(self, u):
        # A frozen unit's backward is over once the next unit's begins (it
        # has no gradient whose arrival would say so).
        for w in self.units:
            if w is not u and w.busy and w.laid and not w.trainable and \
                    not w.shared and w is not self.root:
                w.busy = False
                self._release(w)
        u.busy = True
        self._materialize(u)
        self._prefetch_after(u, self._order[::-1])

    def _make_grad_hook(self, u):
        @_no_grad_hook
        def hook(p):
            u.grads_left -= 1
            self._account()
            if u.grads_left > 0:
                return
            u.grads_left = u.grads_total
            if self._sync:
                self._push(u)
            if not u.shared and u is not self.root:
                u.busy = False
                self._release(u)
            self._account()
        return hook

    def _state_hook(self, module, state_dict, prefix, local_metadata):
        for name, p in module.named_parameters(prefix="", recurse=False):
            if id(p) not in self._param_unit:
                continue
            u, _ = self._param_unit[id(p)]
            if u not in self._gathered:
                self._gathered[u] = self._gather(u)
            state_dict[prefix + name] = self._gathered[u][id(p)]
        return state_dict

    def _begin_forward(self):
        if self._hyper() != self._sent and not self._step_open:
            self._tune()

    def _prefetch_after(self, u, order):
        if u not in order:
            return
        at = order.index(u)
        for v in order[at + 1:at + 1 + self.prefetch]:
            self._request(v)

    # ------------------------------------------------------------ public
    def no_sync(self):
        """Backward passes inside keep their gradients on the worker and
        add to them (as DDP's no_sync()); the next backward outside pushes
        the sum."""
        @contextlib.contextmanager
        def ctx():
            old, self._sync = self._sync, False
            try:
                yield
            finally:
                self._sync = old
        return ctx()

    def step(self, closure=None):
        """Waits until this step's gradients are pushed (the nodes step the
        optimizer as each round completes). Units whose gradients backward
        did not produce push zeros, as DDP averages them."""
        loss = closure() if closure is not None else None
        if not self._ready:
            return loss
        with torch.no_grad():
            for u in self.units:
                if self._step_open and any(k.trainable and not k.pushed
                                           for k in u.keys):
                    self._push(u)
            while self._handles:
                self._wait_oldest_push()
            for u in self.units:
                for k in u.keys:
                    k.pushed = False
                    if k.ahead:  # its buffer holds the old value
                        k.ahead = False
                        u.loaded = False
                if u.laid:
                    self._release(u)
                u.busy = False
                u.grads_left = u.grads_total
        self._step_open = False
        self._first_step = False
        self.version += 1
        if self._auto:
            self._auto = False
            self._choose_prefetch()
        return loss

    def _choose_prefetch(self):
        """prefetch=None: after the first step, enough units ahead that a
        unit's pull (timed in the first forward, which waited for every
        pull) hides behind the forward compute of the units before it:
        ceil(pull / compute) of the slowest unit, from 1 to 4."""
        ratios = [u.pull_s / max(u.compute_s, 1e-6) for u in self._order
                  if u.pull_s is not None and u.compute_s is not None]
        if not ratios or not self._turns:
            return
        depth = min(4, max(1, math.ceil(max(ratios))))
        self.profiled = {"pull_over_compute": max(ratios), "prefetch": depth}
        if depth == self.prefetch:
            return
        # New turn buffers (nothing is laid out between steps).
        size = self._buffers[self._turns[0]].size
        for i in self._turns:
            self._buffers[i] = None
        for u in self.units:
            if u.buffer is None:
                if u.pending is not None:  # a prefetch into an old buffer
                    for h in u.pending:
                        h.wait()
                    u.pending = None
                u.loaded = False
        self.prefetch = depth
        self._turns = [self._new_buffer(size) for _ in range(depth + 1)]

    def zero_grad(self, set_to_none=True):
        """Gradients held on the worker (inside no_sync) are dropped."""
        for u in self.units:
            for p in u.trainable:
                p.grad = None
            u.grads_left = u.grads_total

    def resident_bytes(self, detail=False):
        """What this worker holds of model state now: laid-out parameters,
        gradients not yet pushed, and the registered transfer buffers."""
        # CPU parameters are laid out in the buffers (counted there once);
        # CUDA ones in device memory besides.
        laid = sum(u.nbytes for u in self.units if u.laid) \
            if not self._cuda else 0
        device = sum(k.allocated() for u in self.units for k in u.keys)
        grads = sum(p.grad.numel() * p.grad.element_size()
                    for u in self.units for p in u.trainable
                    if p.grad is not None)
        buffers = sum(b.size for b in self._buffers if b is not None)
        params = laid + device
        total = device + grads + buffers
        if detail:
            return {"parameters": params, "gradients": grads,
                    "buffers": buffers, "total": total}
        return total

    def stats(self):
        """Peaks since offload(): units resident at once (parameters or
        gradients; tied parameters and the root's own not counted) and
        resident_bytes()."""
        return {"peak_units": self._peak_units,
                "peak_bytes": self._peak_bytes,
                "units": [(u.name, u.nbytes) for u in self.units if u.keys]}

    def _gather(self, u):
        """{id(param): a copy of its value on the nodes} for unit u's
        parameters (from its buffer when that holds the current value)."""
        if u.pending is not None or not u.loaded:
            self._request(u, must=True)
            for h in u.pending or []:
                h.wait()
            u.pending = None
            u.loaded = True
        b = u.buffer if u.buffer is not None else self._buffer_of(u)
        host = self._buffers[b].host
        out = {}
        for k in u.keys:
            flat = host[k.at:k.at + k.nbytes].view(k.dtype)
            for p, view in k.views(flat):
                out[id(p)] = view.clone().to(p.device)
        return out

    # ------------------------------------------------------- state dicts
    def _between_steps(self, what):
        if self._step_open or self._handles or \
                any(u.laid for u in self.units if u is not self.root):
            raise membox.MemboxError("offload: %s between steps (after "
                                     "step(), before the next forward)"
                                     % what)

    def _moments(self):
        names = _MOMENTS[self.kind]
        if self.kind == "sgd" and not self.param_groups[0]["momentum"]:
            return ()
        return names

    def state_dict(self):
        """torch's layout: {"state": {index: {"exp_avg": ..., ...}},
        "param_groups": [...]}, the moments gathered from the nodes (a
        parameter the nodes have not stepped yet has no entry), plus
        "membox": the optimizer kind and the steps completed."""
        self._between_steps("state_dict()")
        sd = torch.optim.Optimizer.state_dict(self)
        index = {id(p): i for i, p in
                 enumerate(self.param_groups[0]["params"])}
        pb = self._buffers[self._push_bufs[0]] if self._push_bufs else None
        state = {}
        for u in self.units:
            for k in u.keys:
                if not k.trainable:
                    continue
                got = {}
                for name, part in self._moments():
                    try:
                        self.client.pull_state(k.key, part,
                                               pb.arr[:k.nbytes]).wait()
                    except membox.MemboxError as e:
                        if "FAILED_PRECONDITION" not in str(e):
                            raise
                        got = {}  # not stepped yet
                        break
                    flat = pb.host[:k.nbytes].view(k.dtype)
                    got[name] = {id(p): v.clone().to(p.device)
                                 for p, v in k.views(flat)}
                if not got and self._moments():
                    continue
                for p in k.params:
                    entry = state.setdefault(index[id(p)], {})
                    for name in got:
                        entry[name] = got[name][id(p)]
                    if self.kind != "sgd":
                        entry["step"] = torch.tensor(float(self.version))
        sd["state"] = state
        sd["membox"] = {"optimizer": self.kind, "version": self.version}
        return sd

    def load_state_dict(self, state_dict):
        """Hyperparameters into param_groups; the moments in "state" (as
        state_dict() gives them, or a torch optimizer of the same kind over
        the same parameters) written to the nodes. The nodes' step count
        (Adam's bias correction) stays theirs. Between steps; every worker
        loads the same state."""
        kind = state_dict.get("membox", {}).get("optimizer")
        if kind is not None and kind != self.kind:
            raise ValueError("offload: state of a %r optimizer loaded into "
                             "%r" % (kind, self.kind))
        groups = state_dict["param_groups"]
        if len(groups) != 1:
            raise ValueError("offload: one param group expected")
        state = state_dict.get("state", {})
        index = {id(p): i for i, p in
                 enumerate(self.param_groups[0]["params"])}
        writes = []
        for u in self.units:
            for k in u.keys:
                if not k.trainable:
                    continue
                for name, part in self._moments():
                    have = [index[id(p)] in state and
                            name in state[index[id(p)]] for p in k.params]
                    if not any(have):
                        continue
                    if not all(have):
                        raise ValueError(
                            "offload: %s is in the state of some parameters "
                            "of unit %s but not all" % (name, u.name))
                    flat = torch.empty(k.numel, dtype=k.dtype, device="cpu")
                    for p, off, shape in zip(k.params, k.offsets, k.shapes):
                        t = state[index[id(p)]][name]
                        if tuple(t.shape) != tuple(shape):
                            raise ValueError(
                                "offload: %s of a parameter of unit %s has "
                                "shape %s, the parameter %s" %
                                (name, u.name, tuple(t.shape), tuple(shape)))
                        flat[off:off + shape.numel()].copy_(t.reshape(-1))
                    writes.append((k, part, flat))
        if writes:
            self._between_steps("load_state_dict()")
        for k, part, flat in writes:
            self._store(k, part, flat)
        for name, value in groups[0].items():
            if name != "params":
                self.param_groups[0][name] = value

    def _store(self, k, part, flat):
        """Writes flat CPU tensor `flat` as `part` of key k on the nodes,
        from k's place in its unit's buffer (registered memory)."""
        u, _ = self._param_unit[id(k.params[0])]
        if u.pending is not None:
            for h in u.pending:
                h.wait()
            u.pending = None
        b = u.buffer if u.buffer is not None else self._buffer_of(u)
        buf = self._buffers[b]
        if buf.copied is not None:
            buf.copied.synchronize()
            buf.copied = None
        if buf.owner is not None:
            buf.owner.loaded = False
        buf.owner = u
        u.loaded = False
        buf.host[k.at:k.at + k.nbytes].view(k.dtype).copy_(flat)
        self.client.store_state(k.key, part,
                                buf.arr[k.at:k.at + k.nbytes]).wait()

    def _load_hook(self, module, state_dict, prefix, *args):
        """model.load_state_dict(): the loaded values of this module's
        parameters go to the nodes (every worker loads the same)."""
        self._between_steps("model.load_state_dict()")
        for name, p in module.named_parameters(prefix="", recurse=False):
            if id(p) not in self._param_unit or prefix + name not in \
                    state_dict:
                continue
            u, k = self._param_unit[id(p)]
            self._loading.setdefault(k, {})[id(p)] = state_dict[prefix + name]
        # torch copies into the parameters next: give them their shapes.
        for name, p in module.named_parameters(prefix="", recurse=False):
            if id(p) in self._param_unit:
                u, k = self._param_unit[id(p)]
                for q, shape in zip(k.params, k.shapes):
                    if q is p:
                        p.data = torch.empty(shape, dtype=p.dtype,
                                             device=p.device)

    def _load_done(self, module, incompatible):
        loading, self._loading = self._loading, {}
        for k, values in loading.items():
            flat = self._read_key(k)
            for p, off, shape in zip(k.params, k.offsets, k.shapes):
                if id(p) in values:
                    flat[off:off + shape.numel()].copy_(
                        values[id(p)].reshape(-1))
            self._store(k, "value", flat)
            u, _ = self._param_unit[id(k.params[0])]
            u.loaded = False
        for u in self.units:
            for k in u.keys:
                for p in k.params:
                    p.data = self._placeholder[(k.dtype, k.device)]

    def _read_key(self, k):
        u, _ = self._param_unit[id(k.params[0])]
        values = self._gather(u)
        flat = torch.empty(k.numel, dtype=k.dtype, device="cpu")
        for p, off, shape in zip(k.params, k.offsets, k.shapes):
            flat[off:off + shape.numel()].copy_(values[id(p)].reshape(-1))
        return flat


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o)


def _size_policy(model, min_params):
    """FSDP-style auto-wrap: bottom-up, a submodule whose parameters not
    yet in a unit reach `min_params` becomes a unit."""
    chosen = []
    counted = set()

    def visit(m):
        n = 0
        for c in m.children():
            n += visit(c)
        own = sum(p.numel() for p in m.parameters(recurse=False)
                  if id(p) not in counted)
        for p in m.parameters(recurse=False):
            counted.add(id(p))
        n += own
        if m is not model and n >= min_params:
            chosen.append(m)
            return 0
        return n
    visit(model)
    return chosen


def offload(model, optimizer="adam", lr=1e-3, prefetch=None, units=None,
            min_unit_params=None, compute_dtype=None, client=None, **hyper):
    """Moves `model`'s parameters and optimizer to the memory nodes; returns
    the optimizer to step (see the module docstring). optimizer: "sgd"
    (momentum), "adam", "adamw" or "adagrad", with torch.optim's
    hyperparameter names (betas, eps, momentum, weight_decay). prefetch:
    units pulled ahead (None: 2 in the first step, then what its timings
    ask for, 1 to 4). units: a list of submodules, a
    predicate on modules, or None: by size, bottom-up, a submodule holding
    at least `min_unit_params` parameters not in an inner unit (default: a
    twentieth of the model's). compute_dtype: torch.bfloat16 or
    torch.float16 -- the worker computes with copies of that type (feed it
    inputs of that type, or use autocast) while the nodes keep float32
    masters and step them with float32 gradients; the wire stays float32."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError("offload: model must be a torch.nn.Module")
    if getattr(model, "_membox_offload", None) is not None:
        raise membox.MemboxError("offload: this model is already offloaded")
    kind = str(optimizer).lower()
    if kind not in _OPTIMIZERS:
        raise ValueError("offload: unknown optimizer %r (sgd, adam, adamw, "
                         "adagrad)" % (optimizer,))
    allowed = _OPTIMIZERS[kind]
    unknown = sorted(set(hyper) - set(allowed))
    if unknown:
        raise TypeError("offload: %s takes no hyperparameter %s (it takes "
                        "lr, %s)" % (kind, ", ".join(unknown),
                                     ", ".join(sorted(allowed))))
    values = {"lr": lr}
    values.update(allowed)
    values.update(hyper)
    _check_hyper(kind, values)
    params = list(model.parameters())
    if not params:
        raise ValueError("offload: the model has no parameters")
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise ValueError("offload: parameter %s is on the meta device; "
                             "materialize the model (to_empty + init) first"
                             % name)
        if p.dtype not in _DTYPES:
            raise ValueError("offload: parameter %s is %s; the nodes keep "
                             "float32 or float64 masters" % (name, p.dtype))
    if compute_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError("offload: compute_dtype must be torch.bfloat16, "
                         "torch.float16 or None (got %r)" % (compute_dtype,))
    if prefetch is not None and (not isinstance(prefetch, int) or
                                 prefetch < 0):
        raise ValueError("offload: prefetch must be an int >= 0")
    if min_unit_params is None:
        total = sum(p.numel() for p in params)
        min_unit_params = max(total // 20, 1)
    if client is None:
        client = _session.session.client or _session.init(mode="average")
    else:
        client.configure(mode="average")
    opt = OffloadOptimizer(model, client, kind, values, prefetch, units,
                           min_unit_params, compute_dtype)
    model._membox_offload = opt
    return opt


def _check_hyper(kind, v):
    def bad(name, why):
        raise ValueError("offload: %s %s" % (name, why))
    if not (isinstance(v["lr"], (int, float)) and v["lr"] >= 0 and
            math.isfinite(v["lr"])):
        bad("lr", "must be a finite number >= 0")
    if "momentum" in v and not 0 <= v["momentum"] < 1:
        bad("momentum", "must be in [0, 1)")
    if "betas" in v:
        b = v["betas"]
        if len(b) != 2 or not all(0 <= x < 1 for x in b):
            bad("betas", "must be two numbers in [0, 1)")
    if "eps" in v and not v["eps"] > 0:
        bad("eps", "must be > 0")
    if not (v.get("weight_decay", 0) >= 0 and
            math.isfinite(v.get("weight_decay", 0))):
        bad("weight_decay", "must be a finite number >= 0")
