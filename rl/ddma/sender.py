"""The trainer's half of a DDMA weight sync: this rank's own shards -> every generator server.

Runs on every trainer rank. The shard map (views of the live parameters) is built once,
so a push copies nothing before packing. What a server is, and how bytes reach it, is the
:class:`Target` the entry point injects (rl/train.py passes the SGLang target of
rl/generator/ddma_target.py), so neither this engine nor the trainer knows the generator:
``ipc`` stages each bucket into the server through the target, ``p2p`` sends it over a
process group this rank joined with the server's ranks (:meth:`Sender.join`). The
controller brackets every version on every server (rl/controller/weight_sync.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from rl.ddma import group, wire
from rl.ddma.engine import TransferError, TransferStats
from rl.ddma.megatron_source import ParallelRank, shard_getter, source_rank
from rl.ddma.plan import Plan


class Target(Protocol):
    """One generator server as a trainer rank feeds it a version of ``plan``."""

    def stage(self, src_rank: int, shards: wire.SrcGetter, version: int) -> TransferStats:
        """Same host: hand this rank's buckets to the server by reference."""
        ...

    def send(
        self, src_rank: int, shards: wire.SrcGetter, version: int, pg: dist.ProcessGroup
    ) -> TransferStats:
        """Any host: send this rank's buckets over the server's DDMA group ``pg``."""
        ...


class TargetFactory(Protocol):
    """Builds the :class:`Target` of the server at ``url`` (e.g. the target's class)."""

    def __call__(self, url: str, plan: Plan, dtype: torch.dtype, timeout: float) -> Target: ...


class Sender:
    """This trainer rank's sender: its live shards under ``plan`` -> the servers at
    ``urls``, as ``dtype``."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: ParallelRank,
        plan: Plan,
        dtype: torch.dtype,
        urls: list[str],
        make_target: TargetFactory,
        timeout: float,
    ) -> None:
        self.plan, self.timeout = plan, timeout
        self.rank = source_rank(layout, plan.src)
        self.getter = shard_getter(model, plan, self.rank)
        self.targets = [make_target(u, plan, dtype, timeout) for u in urls]
        self.groups: list[dist.ProcessGroup | None] = []

    def join(self, address: str, ports: list[int], servers: list[int] | None = None) -> None:
        """p2p: join each server's DDMA group (blocks until that server's ranks join too;
        the controller asks them to at the same time). ``servers``: only these (restarted
        servers, whose groups died with them), one port each; default every server."""
        world = self.plan.src.world + self.plan.dst.tp
        which = range(len(ports)) if servers is None else servers
        if not self.groups:
            self.groups = [None] * len(self.targets)
        for i, port in zip(which, ports, strict=True):
            name = group.group_name(ports[0], i)
            self.groups[i] = group.join(address, port, world, self.rank, name, "gloo", self.timeout)

    def push(
        self, version: int, servers: list[int] | None = None
    ) -> tuple[TransferStats, list[int]]:
        """Send this rank's part of ``version`` to ``servers`` (default: every server), one
        after the other. A server that stops answering (:class:`TransferError`: it died) is
        skipped and returned in the second item; the others still get the version."""
        total, lost = TransferStats(), []
        for i in range(len(self.targets)) if servers is None else servers:
            target = self.targets[i]
            try:
                pg = self.groups[i] if self.groups else None
                if pg is not None:
                    s = target.send(self.rank, self.getter, version, pg)
                else:
                    s = target.stage(self.rank, self.getter, version)
            except TransferError:
                lost.append(i)
                continue
            total.buckets += s.buckets
            total.payload_bytes += s.payload_bytes
            total.wire_bytes += s.wire_bytes
            total.seconds += s.seconds
            total.buffer_bytes = max(total.buffer_bytes, s.buffer_bytes)
        return total, lost
