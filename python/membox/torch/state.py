"""InMemoryState: a DDP job's model, optimizer and extras kept in the
memory nodes every few steps, so that a restarted worker set resumes from
them instead of a file."""
import os
import threading

import numpy as np
import torch

import membox
from membox.torch import _session


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
    With several nodes (replicated by default) every
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
        self.client = client or _session.client()
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
        buf = torch.zeros(_SLOTS * self.world * _MARKER, dtype=torch.int64,
                          device="cpu")
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
        buf = torch.empty(per * self.world, dtype=torch.uint8, device="cpu")
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
        buf = torch.empty(_EXTRAS_BYTES, dtype=torch.uint8, device="cpu")
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
