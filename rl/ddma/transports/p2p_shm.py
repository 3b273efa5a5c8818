"""``p2p_shm``: the DDMA group carries only signals, the bytes go through shared memory.

Every trainer rank and server on one host (rl/ddma/shm.py): each trainer rank packs into
its ring in ``/dev/shm``, each server rank maps it and scatters from there. Host memory
only: a CUDA trainer packs into the ring, a CUDA server scatters from it. Nothing is
relayed: every server maps the trainer ranks' rings itself.
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


class P2PShm(GroupTransport):
    name = "p2p_shm"
    summary = "signals over a process group, bytes through shared-memory rings; one host"
    one_host = True
    host_buckets = True

    def send_over(
        self, plan: Plan, src_rank: int, shards: wire.SrcGetter, version: int,
        dtype: torch.dtype, pg: dist.ProcessGroup | None, dst_ranks: Sequence[int],
        device: str | torch.device,
    ) -> TransferStats:  # fmt: skip
        from rl.ddma import shm

        return shm.send(plan, src_rank, shards, version, dtype, pg, dst_ranks, device)

    def receive_over(
        self, plan: Plan, dst_rank: int, tensors: wire.DstGetter, version: int,
        dtype: torch.dtype, pg: dist.ProcessGroup | None, src_ranks: Sequence[int],
        device: str | torch.device, replica: int, dst_ranks: Sequence[int],
    ) -> TransferStats:  # fmt: skip
        from rl.ddma import shm

        if replica or len(dst_ranks) > plan.dst.tp:
            raise ValueError(f"a relay sync runs over a relaying transport, not {self.name}")
        return shm.receive(plan, dst_rank, tensors, version, dtype, pg, src_ranks, device)


TRANSPORT = P2PShm()
