"""A float32 sum split between the workers' ring and the memory nodes
(seed 000's dual synchronisation inside one tensor), for the torch
backend's all_reduce and the DDP hook alike: the ring's first share, how it
follows the measured speeds, and how every rank agrees on it; and the
workers' direct connections (ring, mesh) made through a store
(docs/design/backend.md, "Split all_reduce").

Threading: a Share is used by one thread at a time (the one that runs the
splits, in the same order on every rank)."""
import datetime
import os
import socket

import membox

STEPS = 16  # the ring's share is a multiple of 1/16
RING_MAX_BYTES = 64 << 20  # the workers' ring's pieces: this / world a step
# Across hosts a ring step's chunk goes in segments of this many bytes,
# each forwarded as it arrives (RingOptions::segment_bytes; 0: whole
# steps). MEMBOX_BACKEND_RING_SEGMENT_BYTES, read once at import.
RING_SEGMENT_BYTES = int(os.environ.get("MEMBOX_BACKEND_RING_SEGMENT_BYTES",
                                        1 << 20))


def first_share(workers, nodes):
    """The ring's share of a split all_reduce, in 16ths, that loads every
    link alike when all hosts' links have one rate. Per byte of the tensor
    the ring moves 2(p-1)/p bytes each way over each worker's link; the
    nodes' path moves 1 over each worker's link and p/m over each node's
    (p workers, m nodes, striped). With p <= m the nodes' path alone is
    fastest (the workers' links bound both, and the ring moves more); else
    the links balance at ring/nodes = (p/m - 1) p / (2 (p - 1)): 6/16 for
    4 workers and 2 nodes."""
    if workers < 2 or workers <= nodes:
        return 0
    r = (workers / nodes - 1) * workers / (2 * (workers - 1))
    return min(STEPS - 1, int(round(STEPS * r / (1 + r))))


class Share:
    """The ring's share of each split, in 16ths. It starts at the links'
    balance (first_share); after each split rank 0 takes each part's time
    per sixteenth (measured while both ran, so a shared link shows in
    both), computes the share that makes both take equally long, moves
    there at once when within two sixteenths, half way when further, not
    at all within half a sixteenth (each new cut is a new key on the
    nodes, touched afresh), and publishes it in `store` under
    "<prefix>/<k>"; every other rank reads it there before its k-th split,
    so every rank cuts alike. Once the nodes alone are chosen it stays 0."""

    def __init__(self, store, rank, workers, nodes, prefix):
        self._store, self._rank, self._prefix = store, rank, prefix
        self.value = first_share(workers, nodes)
        self._splits = 0  # splits taken so far

    def take(self):
        """The share of the next split (blocks on the store on ranks other
        than 0 from the second split on)."""
        k = self._splits
        self._splits += 1
        if k > 0 and self._rank != 0:
            self.value = int(self._store.get("%s/%d" % (self._prefix, k)))
        return self.value

    def measured(self, share, ring_s, nodes_s):
        """Rank 0, after the split take() gave `share`: the seconds each
        part took. Sets and publishes the next split's share."""
        if self._rank != 0:
            return
        k = self._splits - 1
        ring = ring_s / share if share else None
        node = nodes_s / (STEPS - share) if share < STEPS else None
        if ring is not None and node is not None:
            target = STEPS * node / (ring + node)
        elif ring is None:  # all on the nodes: it stays so
            target = 0
        else:
            target = STEPS - 1
        delta = target - share
        if abs(delta) < 0.5:
            nxt = share
        elif abs(delta) <= 2:
            nxt = int(target + 0.5)
        else:
            nxt = int(share + delta / 2 + 0.5)
        self.value = min(STEPS - 1, max(0, nxt))
        self._store.set("%s/%d" % (self._prefix, k + 1), str(self.value))
        if k >= 1:
            self._store.delete_key("%s/%d" % (self._prefix, k))


def address_toward(host_port):
    """This host's address toward `host_port` (the interface the job
    already uses to reach its first memory node): where direct paths
    listen. No packet is sent."""
    host, _, port = host_port.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.connect((host.strip("[]"), int(port)))
        return u.getsockname()[0]


def connect_direct(store, rank, size, address, name, make, max_bytes,
                   timeout, **options):
    """A ring or mesh (`make`: membox._core.Ring or Mesh) of `size` ranks,
    connected: this rank listens on `address`, publishes its endpoint in
    `store` under "<name>/<rank>" and finds the others' there; the job's
    secret is checked. `timeout`: a datetime.timedelta."""
    obj = make(rank, size, "%s:0" % address, membox._secret(), max_bytes,
               timeout.total_seconds(), **options)
    store.set("%s/%d" % (name, rank), obj.endpoint)
    keys = ["%s/%d" % (name, q) for q in range(size)]
    store.wait(keys, timeout)
    obj.connect([store.get(k).decode() for k in keys])
    return obj


DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
