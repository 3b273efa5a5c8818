"""``p2p_shm``: the DDMA group carries only signals, the bytes go through shared memory.

Every trainer rank and server on one host (rl/ddma/shm.py): each trainer rank packs into
its ring in ``/dev/shm``, each server rank maps it and scatters from there. Host memory
only: a CUDA trainer packs into the ring, a CUDA server scatters from it.
"""

from __future__ import annotations

from types import ModuleType

from rl.ddma.transport import GroupTransport


class P2PShm(GroupTransport):
    name = "p2p_shm"
    summary = "signals over a process group, bytes through shared-memory rings; one host"
    one_host = True
    host_buckets = True

    def engine(self) -> ModuleType:
        from rl.ddma import shm

        return shm


TRANSPORT = P2PShm()
