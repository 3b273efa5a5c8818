"""The trainer's half of a DDMA weight sync: this rank's own shards -> every generator server.

Runs on every trainer rank. The shard map (views of the live parameters) is built once,
so a push copies nothing before packing. What a server is, and how bytes reach it, is the
:class:`Target` the entry point injects (rl/train.py passes the SGLang target of
rl/generator/ddma_target.py), so neither this engine nor the trainer knows the generator.
How bytes travel is the transport's (rl/ddma/transport.py): a staged one (``ipc``,
``cuda_ipc``) stages each bucket into the server through the target; a group one
(``p2p``, ``p2p_shm``) sends over process groups this rank joined with the servers' ranks
(:meth:`Sender.join`): one per server, or with relays one for many, the trainer ranks
feeding the roots and the servers forwarding to the others (rl/ddma/relay.py). The
controller brackets every version on every server (rl/controller/weight_sync.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from rl.ddma import group, relay, wire
from rl.ddma import transport as transports
from rl.ddma.engine import TransferError, TransferStats
from rl.ddma.megatron_source import ParallelRank, shard_getter, source_rank
from rl.ddma.plan import Plan


class Target(Protocol):
    """One generator server as a trainer rank stages a version of ``plan`` into it."""

    def stage(self, src_rank: int, shards: wire.SrcGetter, version: int) -> TransferStats:
        """Same host: hand this rank's buckets to the server by reference."""
        ...


class TargetFactory(Protocol):
    """Builds the :class:`Target` of the server at ``url`` (e.g. the target's class)."""

    def __call__(
        self, url: str, plan: Plan, dtype: torch.dtype, timeout: float, *, transport: str,
        device: str,
    ) -> Target: ...  # fmt: skip


class Sender:
    """This trainer rank's sender: its live shards under ``plan`` -> the servers at
    ``urls``, as ``dtype``, over ``transport`` (rollout.weight_sync.transport), ``relaying``
    in each group, in buckets on ``device`` (the transport's ``bucket_device``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: ParallelRank,
        plan: Plan,
        dtype: torch.dtype,
        urls: list[str],
        make_target: TargetFactory,
        timeout: float,
        transport: str = "ipc",
        relaying: relay.Relaying = relay.NO_RELAY,
        device: str = "cpu",
    ) -> None:
        self.plan, self.dtype, self.timeout = plan, dtype, timeout
        self.transport, self.relaying = transports.get(transport), relaying
        self.rank = source_rank(layout, plan.src)
        self.getter = shard_getter(model, plan, self.rank)
        # Where the buckets lie: their checksum and the group's backend follow; packing
        # reads the shards from wherever they are.
        self.device = group.local(device)
        self.targets = [make_target(u, plan, dtype, timeout, transport=transport, device=device)
                        for u in urls]  # fmt: skip
        self.groups: dict[str, dist.ProcessGroup] = {}
        # A group transport: each server's DDMA group and its position there.
        self.where: list[tuple[str, int]] | None = None

    def join(self, address: str, ports: list[int], groups: list[list[int]]) -> None:
        """p2p: join DDMA group k at ``ports[k]`` with the servers ``groups[k]``, in that
        order (blocks until their ranks join too; the controller asks them to at the same
        time). Servers named here leave the group they were in (it died with them)."""
        if self.where is None:
            self.where = [("", 0)] * len(self.targets)
        for k, (port, servers) in enumerate(zip(ports, groups, strict=True)):
            name = group.group_name(ports[0], k)
            world = self.plan.src.world + len(servers) * self.plan.dst.tp
            self.groups[name] = group.join(address, port, world, self.rank, name, self.device,
                                           self.timeout)  # fmt: skip
            for pos, i in enumerate(servers):
                self.where[i] = (name, pos)

    def push(
        self, version: int, servers: list[int] | None = None
    ) -> tuple[TransferStats, list[int]]:
        """Send this rank's part of ``version`` to ``servers`` (default: every server). A
        server that stops answering (it died) is left out and returned in the second item;
        the others still get the version."""
        which = list(range(len(self.targets))) if servers is None else servers
        total, lost = TransferStats(), []
        moves = self.transport
        if not isinstance(moves, transports.GroupTransport):  # one server after the other
            for i in which:
                try:
                    _add(total, self.targets[i].stage(self.rank, self.getter, version))
                except TransferError:
                    lost.append(i)
            return total, lost
        assert self.where is not None, "a group transport pushes after join"
        for name, route, members in relay.routes(self.plan, self.where, which, self.relaying):
            plan = route.plan(self.plan)
            dst = route.dst_ranks(self.plan)
            try:
                s = moves.send(plan, self.rank, self.getter, version, self.dtype,
                               self.groups[name], dst, self.device)  # fmt: skip
            except TransferError:  # p2p_shm: a server could not map the rings
                lost += members
                continue
            _add(total, s)
            tp = self.plan.dst.tp
            lost += [members[(r - self.plan.src.world) // tp] for r in s.lost]
        return total, sorted(set(lost))


def _add(total: TransferStats, s: TransferStats) -> None:
    total.buckets += s.buckets
    total.payload_bytes += s.payload_bytes
    total.wire_bytes += s.wire_bytes
    total.seconds += s.seconds
    total.buffer_bytes = max(total.buffer_bytes, s.buffer_bytes)
