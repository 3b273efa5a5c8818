"""Transports that leave each bucket in the trainer rank's slots and name it in the server's
weight-update API (same host).

Every trainer rank packs its own buckets (already in the server's layout, one per server
rank per request) into slots of its own, two per server rank (``ipc``: a host
shared-memory ring; ``cuda_ipc``: GPU memory handed over as CUDA IPC handles), and names
each slot in one request to the server (:class:`~rl.ddma.transport.Target`). Packing the
next round overlaps the server's verify-and-scatter of the current one, and a bucket's
bytes are copied once by the trainer and once by the server. The slots are kept across
versions. A transport of this kind says only what the slots are (:meth:`StagedTransport.slots`)
and how the server finds a slot a request names (:meth:`~StagedTransport.locate`); the
rounds, the requests and the lifecycle are this module's.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from rl.ddma.transport import Entry, Inbound, Link, Sending, SlotsGone, Transport

if TYPE_CHECKING:
    import torch

    from rl.ddma import wire
    from rl.ddma.engine import TransferStats
    from rl.ddma.plan import Bucket


class Slots(Protocol):
    """A trainer rank's bucket-sized slots that a server reads by reference."""

    nbytes: int  # memory held

    @property
    def may_be_gone(self) -> bool:
        """The server may have lost them (it restarted since it mapped them): a version's
        first request then goes alone, and a ``ring_missing`` status renews them."""
        ...

    def slot(self, i: int) -> torch.Tensor:
        """Slot ``i``'s bytes, to pack a bucket into."""
        ...

    def entry(self, i: int, nbytes: int) -> tuple[dict[str, object], torch.Tensor]:
        """The control fields and the tensor that name slot ``i`` (its first ``nbytes``) in
        a request; called once the bucket is packed."""
        ...

    def posted(self) -> None:
        """Every server rank has read the slots once (a version's first request came back)."""
        ...


class StagedTransport(Transport):
    """Buckets left in the trainer rank's slots, named in the server's weight-update API."""

    @abstractmethod
    def slots(self, bucket_bytes: int, count: int, device: str) -> Slots:
        """``count`` new slots of ``bucket_bytes`` on ``device`` (a trainer rank keeps them
        across versions)."""

    @abstractmethod
    def locate(self, ctl: dict, tensor: torch.Tensor, bucket_bytes: int) -> torch.Tensor:
        """Server side: the bytes of the slot a request entry names (``ctl`` its control
        fields, ``tensor`` its tensor). Raises FileNotFoundError when the slots are gone
        (the sender then makes new ones)."""

    def release(self, msg: torch.Tensor) -> None:
        """Server side: done reading ``msg``; the sender may refill it once the request
        returns."""

    def prepare(self, link: Link) -> Sending:
        return StagedSending(self, link)

    def receive(self, inbound: Inbound) -> list[int]:
        """The one bucket the entry names, verified (on a device into a staging copy: its
        checks deferred to the version's end) and scattered."""
        from rl.ddma import engine, wire

        plan, rank, version = inbound.plan, inbound.rank, inbound.version
        try:  # where the bucket lies: the sender's slots
            msg = self.locate(inbound.ctl, inbound.tensor, plan.bucket_bytes)
        except FileNotFoundError as e:  # unlinked before this server (re)started
            raise SlotsGone(f"the slots of {self.name} are gone; the sender makes others") from e
        head = wire.read_header(msg)
        b = next((b for b in plan.receives(rank) if b.index == head["index"]), None)
        if b is None or head["dst"] != rank:
            raise ValueError(f"bucket {head['index']} is not addressed to generator rank {rank}")
        msg = msg[: b.nbytes]
        if msg.is_cuda and isinstance(inbound.into, engine.Staged):  # checked before prepare
            inbound.deferred.add(msg, plan, b, version)
        else:
            wire.verify(msg, plan, b, version)
        inbound.writing()
        wire.unpack(msg, plan, b, inbound.into, inbound.dtype)
        self.release(msg)  # (cuda_ipc: once the device has read it)
        return [b.index]


class StagedSending(Sending):
    """A trainer rank staging into each server in turn, through its slots for that server."""

    def __init__(self, transport: StagedTransport, link: Link) -> None:
        from rl.ddma.sglang_receiver import plan_spec

        self.transport, self.link = transport, link
        self.spec = plan_spec(link.plan, link.dtype)
        self.slots: dict[int, Slots] = {}  # by server: two per server rank

    def send(
        self, shards: wire.SrcGetter, version: int, servers: Sequence[int] | None = None
    ) -> tuple[TransferStats, list[int]]:
        from rl.ddma.engine import TransferError, TransferStats

        which = list(range(len(self.link.targets))) if servers is None else list(servers)
        total, lost = TransferStats(), list[int]()
        for i in which:  # one server after the other
            try:
                total.add(self._stage(i, shards, version))
            except TransferError as e:
                lost.append(i)
                total.error = total.error or str(e)
        return total, lost

    def close(self) -> None:
        for slots in self.slots.values():
            slots.posted()
        self.slots.clear()

    def _new_slots(self, i: int) -> Slots:
        plan, device = self.link.plan, self.link.device.type
        self.slots[i] = self.transport.slots(plan.bucket_bytes, 2 * plan.dst.tp, device)
        return self.slots[i]

    def _stage(self, i: int, shards: wire.SrcGetter, version: int) -> TransferStats:
        """This rank's buckets for ``version`` into server ``i``'s staging."""
        import torch

        from rl.ddma import wire
        from rl.ddma.engine import TransferStats

        link, target = self.link, self.link.targets[i]
        plan, tp = link.plan, link.plan.dst.tp
        mine = plan.sends(link.rank)
        stats = TransferStats(buckets=len(mine))
        # Requests carry one bucket per server rank: group this rank's buckets by round.
        rounds: dict[int, list[Bucket]] = {}
        for b in mine:
            rounds.setdefault(b.round, []).append(b)
        slots = self.slots.get(i) or self._new_slots(i)
        stats.buffer_bytes = slots.nbytes
        noop: Entry = ({"op": "noop"}, torch.zeros(1, dtype=torch.uint8))
        head = {"op": "receive", "plan": self.spec, "version": version,
                "transport": self.transport.name}  # fmt: skip

        def pack(k: int, group: list[Bucket]) -> list[Entry]:
            entries = [noop] * tp
            for b in group:
                slot = (k % 2) * tp + b.dst
                wire.pack(slots.slot(slot), plan, b, shards, link.dtype, version)
                where, tensor = slots.entry(slot, b.nbytes)
                entries[b.dst] = ({**head, **where}, tensor)
            return entries

        t0 = time.perf_counter()
        pending: Future[list[dict]] | None = None
        try:
            with ThreadPoolExecutor(1) as pool:
                for k, group in enumerate(rounds.values()):
                    entries = pack(k, group)
                    for b in group:
                        stats.count(plan, b)
                    if pending is not None:
                        target.check(pending.result())
                    if k == 0 and slots.may_be_gone:
                        # A server that restarted since it mapped the slots cannot find
                        # them any more: it gets new ones.
                        statuses = target.post(entries)
                        if any(s.get("ring_missing") for s in statuses):
                            slots = self._new_slots(i)
                            statuses = target.post(pack(k, group))
                        target.check(statuses)
                        continue
                    pending = pool.submit(target.post, entries)
                if pending is not None:
                    target.check(pending.result())
        finally:
            # Held by every server rank now (or the server cannot hold them any more: the
            # next version makes others), so a process that dies leaves nothing behind.
            slots.posted()
        stats.seconds = time.perf_counter() - t0
        return stats
