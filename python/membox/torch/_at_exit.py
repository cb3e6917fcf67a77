"""The one exit rule for membox's Python threads that complete torch
futures or run inside torch's C++ (the backend's groups, OverlappedOptimizer's
step threads, CUDA staging): they end at Python's exit, before the
interpreter finalizes.

Why: a thread that has just completed a torch Future (torch releases the GIL
while it marks it complete) may still be on its way back to the GIL when
the main thread ends the script. Once the interpreter finalizes, Python ends
such a thread with pthread_exit; its unwinding through a C++ destructor that
takes the GIL (pybind11's, torch's) is noexcept, and the process aborts
("terminate called without an active exception") after the job finished.

Ownership: owners are held weakly; one that is collected is forgotten.
Threading: end_at_exit() and forget() from any thread. The stops run on the
exiting thread, newest first (as atexit runs its hooks), each error a
warning. Registered after membox._core's own hook (this module imports
membox first), so they run while the core's completion thread still runs.
"""
import atexit
import itertools
import threading
import warnings
import weakref

import membox  # noqa: F401 - its atexit hook first: ours runs before it

_lock = threading.Lock()
_owners = weakref.WeakKeyDictionary()  # owner -> (order, stop(owner))
_order = itertools.count()


def end_at_exit(owner, stop):
    """Calls stop(owner) at Python's exit unless forget(owner) came first."""
    with _lock:
        if owner not in _owners:
            _owners[owner] = (next(_order), stop)


def forget(owner):
    with _lock:
        _owners.pop(owner, None)


def _stop_all():
    with _lock:
        todo = sorted(((o, *v) for o, v in _owners.items()),
                      key=lambda t: -t[1])
        _owners.clear()
    for owner, _, stop in todo:
        try:
            stop(owner)
        except Exception as e:  # noqa: BLE001 - exit goes on
            warnings.warn("membox: stopping %s at exit: %s"
                          % (type(owner).__name__, e))


atexit.register(_stop_all)
