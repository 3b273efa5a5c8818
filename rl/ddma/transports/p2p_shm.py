"""``p2p_shm``: the DDMA group carries only signals, the bytes go through shared memory.

Every trainer rank and server on one host (rl/ddma/shm.py): each trainer rank packs into
its ring in ``/dev/shm``, each server rank maps it and scatters from there. Host memory
only: a CUDA trainer packs into the ring, a CUDA server scatters from it. Nothing is
relayed: every server maps the trainer ranks' rings itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.ddma.grouped import GroupHop, GroupTransport

if TYPE_CHECKING:
    from rl.ddma import wire
    from rl.ddma.engine import TransferStats


class P2PShm(GroupTransport):
    name = "p2p_shm"
    summary = "signals over a process group, bytes through shared-memory rings; one host"
    one_host = True
    host_buckets = True

    def send_over(self, hop: GroupHop, shards: wire.SrcGetter) -> TransferStats:
        from rl.ddma import shm

        return shm.send(hop.plan, hop.rank, shards, hop.version, hop.dtype, hop.pg, hop.peers,
                        hop.device)  # fmt: skip

    def receive_over(self, hop: GroupHop, tensors: wire.DstGetter) -> TransferStats:
        from rl.ddma import shm

        if hop.replica or len(hop.forward_to) > hop.plan.dst.tp:
            raise ValueError(f"a relay sync runs over a relaying transport, not {self.name}")
        return shm.receive(hop.plan, hop.rank, tensors, hop.version, hop.dtype, hop.pg,
                           hop.peers, hop.device)  # fmt: skip


TRANSPORT = P2PShm()
