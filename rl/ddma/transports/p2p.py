"""``p2p``: point to point over the DDMA group, between any hosts (rl/ddma/engine.py).

The group's backend follows the buckets' device (rl/ddma/group.py): gloo for host buffers,
NCCL for CUDA ones when both ends are on CUDA, so no byte of a GPU-to-GPU sync goes
through host memory. The only transport whose servers relay buckets to other servers.
"""

from __future__ import annotations

from types import ModuleType

from rl.ddma.transport import GroupTransport


class P2P(GroupTransport):
    name = "p2p"
    summary = "point to point over a process group (gloo, or NCCL GPU to GPU); any hosts"
    relays = True

    def engine(self) -> ModuleType:
        from rl.ddma import engine

        return engine


TRANSPORT = P2P()
