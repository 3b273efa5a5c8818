"""``ipc``: buckets in a host shared-memory ring, named in the server's weight-update API.

Trainer ranks and servers on one host. Each trainer rank packs its buckets into a ring of
its own (rl/ddma/shm.py: a plain ``/dev/shm`` file, two slots per server rank) and posts
where each lies with ``/update_weights_from_tensor``; the server's rank maps the ring once
and scatters from it. The ring is a file, not a torch shared tensor: a server that frees a
dead trainer process's torch tensor aborts (its ``torch_shm_manager`` is gone). It is
unlinked once the server mapped it, so a crash leaves nothing in ``/dev/shm``; a server
that restarted since cannot open it any more, and the trainer rank makes another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.ddma.staged import StagedTransport

if TYPE_CHECKING:
    import torch


class RingSlots:
    """The slots of one ring (see the module docstring)."""

    def __init__(self, bucket_bytes: int, count: int) -> None:
        from rl.ddma import shm

        self.ring = shm.create_ring(bucket_bytes, count)
        self.nbytes = self.ring.data.numel()

    @property
    def may_be_gone(self) -> bool:
        """Unlinked: a server that restarted since it mapped the ring cannot find it."""
        return not self.ring.linked

    def slot(self, i: int) -> torch.Tensor:
        return self.ring.slot(i)

    def entry(self, i: int, nbytes: int) -> tuple[dict[str, object], torch.Tensor]:
        import torch

        where = {"ring": self.ring.path, "ring_bytes": self.nbytes, "slot": i}
        return where, torch.zeros(1, dtype=torch.uint8)

    def posted(self) -> None:
        self.ring.unlink()


class Ipc(StagedTransport):
    name = "ipc"
    summary = "host shared-memory rings named in the servers' HTTP API; one host"
    one_host = True
    host_buckets = True

    def slots(self, bucket_bytes: int, count: int, device: str) -> RingSlots:
        return RingSlots(bucket_bytes, count)

    def locate(self, ctl: dict, tensor: torch.Tensor, bucket_bytes: int) -> torch.Tensor:
        from rl.ddma import shm

        ring = shm.map_ring(str(ctl["ring"]), int(ctl["ring_bytes"]))
        return ring[int(ctl["slot"]) * bucket_bytes :][:bucket_bytes]


TRANSPORT = Ipc()
