"""A float32 sum split between the workers' ring and the memory nodes
(seed 000's dual synchronisation inside one tensor), for the torch
backend's all_reduce and the DDP hook alike: the ring's first share, how it
follows the measured speeds, and how every rank agrees on it; and the
workers' direct connections (ring, mesh) made through a store
(docs/design/backend.md, "Split all_reduce").

Threading: see Share."""
import datetime
import os
import socket

import membox

STEPS = membox._core.SPLIT_STEPS  # the ring's share is a multiple of 1/16
RING_MAX_BYTES = 64 << 20  # the workers' ring's pieces: this / world a step
# Across hosts a ring step's chunk goes in segments of this many bytes,
# each forwarded as it arrives (RingOptions::segment_bytes; 0: whole
# steps). MEMBOX_BACKEND_RING_SEGMENT_BYTES, read once at import.
RING_SEGMENT_BYTES = int(os.environ.get("MEMBOX_BACKEND_RING_SEGMENT_BYTES",
                                        1 << 20))


def first_share(workers, nodes):
    """The ring's share of a split all_reduce, in 16ths, that loads every
    link alike when all hosts' links have one rate (sync::FirstSplitShare,
    the rule the C++ SplitAllreduce uses too): 0 where the nodes have as
    many links as the workers, 6/16 for 4 workers and 2 nodes."""
    return membox._core.split_first_share(workers, nodes)


class Share:
    """The ring's share of each split, in 16ths. It starts at the links'
    balance (first_share) and follows the parts' measured times
    (sync::NextSplitShare: toward equal times, at once within two
    sixteenths, half way further, not within half a sixteenth), as rank 0
    measures them. Rank 0 publishes the share of its k-th split in `store`
    under "<prefix>/<k>" when it takes it; every other rank reads it there
    before its k-th split, so every rank cuts alike, whether or not the
    splits before have finished (the DDP hook runs a bucket's ring part
    while the buckets before it are still on the nodes). Once the nodes
    alone are chosen it stays 0.

    Threading: take() from one thread, in split order; measured() from one
    thread (the same or another), in the same order. On rank 0 measured()
    is the only writer of `value` and take() reads it once."""

    def __init__(self, store, rank, workers, nodes, prefix):
        self._store, self._rank, self._prefix = store, rank, prefix
        self.value = first_share(workers, nodes)
        self._splits = 0  # splits taken so far
        self._measured = 0  # splits measured so far (rank 0)

    def take(self):
        """The share of the next split (blocks on the store on ranks other
        than 0 from the second split on, until rank 0 has taken it). Rank
        0 cuts by exactly what it publishes: the value is read once, since
        measured() may change it meanwhile on another thread (it did: rank
        0 cut by a newer share than it had published, and the ranks' tails
        were different keys, each waiting for the others forever)."""
        k = self._splits
        self._splits += 1
        value = self.value
        if k > 0:
            key = "%s/%d" % (self._prefix, k)
            if self._rank == 0:
                self._store.set(key, str(value))
            else:
                value = self.value = int(self._store.get(key))
        return value

    def measured(self, share, ring_s, nodes_s):
        """Rank 0, once the oldest split not yet measured (take() gave it
        `share`) has finished on both paths: the seconds each part took.
        Sets the share of the splits taken from now on; that split's key
        goes (every rank took it: its parts could not finish without
        them)."""
        if self._rank != 0:
            return
        k = self._measured
        self._measured += 1
        self.value = membox._core.split_next_share(share, ring_s, nodes_s)
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
