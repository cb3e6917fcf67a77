"""membox as torchft's process group: `ProcessGroupMembox` for torchft's
Manager (PyPI torchft), so that a fault-tolerant job's gradient averages
run on the memory nodes.

    from membox.torch.ft import ProcessGroupMembox
    manager = torchft.Manager(pg=ProcessGroupMembox(), ...)

torchft reconfigures its process group at every new quorum (a replica
group died, or one came back): `configure(store_addr, replica_id, rank,
world_size)` aborts the group it had and makes a new one for the quorum.
Each is a membox backend (membox.torch.backend) of its own:

  * its key space is named by the quorum's store address, which torchft
    makes the same on every replica of the quorum and new for each;
  * its connection follows the previous quorum's job on the same nodes
    (`rejoin`): the nodes serve one job at a time, so its hello is retried
    until the previous quorum's connections have closed (this replica's
    closes at abort; a dead replica's with its process);
  * its keys are the job's scratch, freed by the nodes when the quorum's
    job ends;
  * replica groups of several ranks: torchft makes one group per local
    rank, across the quorum's replicas. They are one job on the nodes
    (rank replica_rank * group_world_size + group_rank), each group a part
    of it whose averages go around its workers (the nodes' rounds count
    every rank of a job).

The memory nodes come from MEMBOX_PROXIES (or the quorum's store, as for
init_process_group("membox")), the secret from MEMBOX_SECRET(_FILE).
Threading: as torchft's other process groups (configure on torchft's
quorum thread, operations on the training thread)."""
from datetime import timedelta

import torch

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("membox.torch.ft needs torchft (pip install torchft): "
                      "%s" % e) from e


class ProcessGroupMembox(ProcessGroupWrapper):
    """A reconfigurable membox process group for torchft's Manager."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._store_addr = None
        self._job = None

    def configure(self, store_addr, replica_id, rank, world_size,
                  quorum_id=None, group_rank=None, group_world_size=None,
                  global_ranks=None):
        self._store_addr = store_addr  # names the quorum's key space
        # Replica groups of several ranks: one group per local rank, each
        # of the quorum's replicas; together they are one job on the nodes.
        self._job = None
        if group_world_size is not None and group_world_size > 1:
            if group_rank is None or not 0 <= group_rank < group_world_size:
                raise ValueError("ProcessGroupMembox: group rank %r of %d"
                                 % (group_rank, group_world_size))
            self._job = (rank * group_world_size + group_rank,
                         world_size * group_world_size)
        super().configure(store_addr, replica_id, rank, world_size, quorum_id,
                          group_rank, group_world_size, global_ranks)

    def _create_pg(self, store, rank, world_size):
        from torch.distributed import ProcessGroup as BaseProcessGroup

        from membox.torch.backend import MemboxBackend
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.CUSTOM)
        backend = MemboxBackend(store, rank, world_size, self._timeout,
                                space="torchft:%s" % self._store_addr,
                                rejoin=True, job=self._job)
        pg._register_backend(torch.device("cpu"),
                             BaseProcessGroup.BackendType.CUSTOM, backend)
        return pg

    def getBackendName(self) -> str:
        return "torchft-membox"
