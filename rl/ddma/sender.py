"""The trainer's half of a DDMA weight sync: this rank's own shards -> every generator server.

Runs on every trainer rank. The shard map (views of the live parameters) is built once,
so a push copies nothing before packing. What a server is, and how a request reaches it,
is the :class:`Target` the entry point injects (rl/train.py passes the SGLang target of
rl/generator/ddma_target.py), so neither this engine nor the trainer knows the generator.
How bytes travel is the transport's (rl/ddma/transport.py): this rank prepares its
sending half once, joins the DDMA groups the controller formed (:meth:`Sender.join`;
none for a transport that needs none) and sends each version through it. The
controller brackets every version on every server (rl/controller/weight_sync.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from rl.ddma import group, relay
from rl.ddma import transport as transports
from rl.ddma.engine import TransferStats
from rl.ddma.megatron_source import ParallelRank, shard_getter, source_rank
from rl.ddma.plan import Plan

Target = transports.Target


class TargetFactory(Protocol):
    """Builds the :class:`Target` of the server at ``url`` (e.g. the target's class)."""

    def __call__(
        self, url: str, plan: Plan, dtype: torch.dtype, *, timeout: float, transport: str,
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
        *,
        plan: Plan,
        dtype: torch.dtype,
        urls: list[str],
        make_target: TargetFactory,
        timeout: float,
        transport: str = "ipc",
        relaying: relay.Relaying = relay.NO_RELAY,
        device: str = "cpu",
    ) -> None:
        self.plan = plan
        self.rank = source_rank(layout, plan.src)
        self.getter = shard_getter(model, plan, self.rank)
        targets = [make_target(u, plan, dtype, timeout=timeout, transport=transport,
                               device=device) for u in urls]  # fmt: skip
        self.targets = targets
        # Where the buckets lie: their checksum and the group's backend follow; packing
        # reads the shards from wherever they are.
        link = transports.Link(plan=plan, rank=self.rank, dtype=dtype, targets=targets,
                               device=group.local(device), relaying=relaying,
                               timeout=timeout)  # fmt: skip
        self.sending = transports.get(transport).prepare(link)

    def join(self, address: str, ports: list[int], groups: list[list[int]]) -> None:
        """Join DDMA group k at ``ports[k]`` with the servers ``groups[k]``, in that order
        (blocks until their ranks join too; the controller asks them to at the same
        time). Servers named here leave the group they were in (it died with them)."""
        self.sending.join(address, ports, groups)

    def push(
        self, version: int, servers: list[int] | None = None
    ) -> tuple[TransferStats, list[int]]:
        """Send this rank's part of ``version`` to ``servers`` (default: every server). A
        server that stops answering (it died) is left out and returned in the second item;
        the others still get the version."""
        return self.sending.send(self.getter, version, servers)

    def close(self) -> None:
        self.sending.close()
