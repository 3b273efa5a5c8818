"""``p2p``: point to point over the DDMA group, between any hosts (rl/ddma/engine.py).

The group's backend follows the buckets' device (rl/ddma/group.py): gloo for host buffers,
NCCL for CUDA ones when both ends are on CUDA, so no byte of a GPU-to-GPU sync goes
through host memory. The only transport whose servers relay buckets to other servers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.ddma.grouped import GroupHop, GroupTransport

if TYPE_CHECKING:
    from rl.ddma import wire
    from rl.ddma.engine import TransferStats


class P2P(GroupTransport):
    name = "p2p"
    summary = "point to point over a process group (gloo, or NCCL GPU to GPU); any hosts"
    relays = True

    def send_over(self, hop: GroupHop, shards: wire.SrcGetter) -> TransferStats:
        from rl.ddma import engine

        return engine.send(hop.plan, hop.rank, shards, hop.version, hop.dtype, hop.pg,
                           hop.peers, hop.device)  # fmt: skip

    def receive_over(self, hop: GroupHop, tensors: wire.DstGetter) -> TransferStats:
        from rl.ddma import engine

        return engine.receive(hop.plan, hop.rank, tensors, hop.version, hop.dtype, hop.pg,
                              hop.peers, hop.device, replica=hop.replica,
                              dst_ranks=hop.forward_to)  # fmt: skip


TRANSPORT = P2P()
