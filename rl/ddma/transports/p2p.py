"""``p2p``: point to point over the DDMA group, between any hosts (rl/ddma/engine.py).

The group's backend follows the buckets' device (rl/ddma/group.py): gloo for host buffers,
NCCL for CUDA ones when both ends are on CUDA, so no byte of a GPU-to-GPU sync goes
through host memory. The only transport whose servers relay buckets to other servers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rl.ddma.grouped import GroupTransport

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from rl.ddma import wire
    from rl.ddma.engine import TransferStats
    from rl.ddma.plan import Plan


class P2P(GroupTransport):
    name = "p2p"
    summary = "point to point over a process group (gloo, or NCCL GPU to GPU); any hosts"
    relays = True

    def send_over(
        self, plan: Plan, src_rank: int, shards: wire.SrcGetter, version: int,
        dtype: torch.dtype, pg: dist.ProcessGroup | None, dst_ranks: Sequence[int],
        device: str | torch.device,
    ) -> TransferStats:  # fmt: skip
        from rl.ddma import engine

        return engine.send(plan, src_rank, shards, version, dtype, pg, dst_ranks, device)

    def receive_over(
        self, plan: Plan, dst_rank: int, tensors: wire.DstGetter, version: int,
        dtype: torch.dtype, pg: dist.ProcessGroup | None, src_ranks: Sequence[int],
        device: str | torch.device, replica: int, dst_ranks: Sequence[int],
    ) -> TransferStats:  # fmt: skip
        from rl.ddma import engine

        return engine.receive(plan, dst_rank, tensors, version, dtype, pg, src_ranks, device,
                              replica=replica, dst_ranks=dst_ranks)  # fmt: skip


TRANSPORT = P2P()
