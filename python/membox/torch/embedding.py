"""Embedding layers whose tables live in the memory nodes' sparse
parameter store (memory + SSD tiers)."""
import itertools
import threading

import numpy as np
import torch
import torch.nn.functional as F

import membox


# ------------------------------------------------------------ embeddings

_emb_client = None
_emb_lock = threading.Lock()
_pin_tags = itertools.count(1)  # batch ids the nodes pin rows under


def embeddings():
    """This process's EmbeddingClient (membox.connect_embeddings())."""
    global _emb_client
    with _emb_lock:
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
