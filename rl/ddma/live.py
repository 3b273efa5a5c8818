"""DDMA in the RL loop: one weight version, trainer ranks -> every SGLang server.

The two halves of a sync run in different processes. :class:`TrainerSide` lives on every
trainer rank and sends that rank's own shards (``ipc``: staged through the server's HTTP
API by reference; ``p2p``: point to point over a group with the server's ranks).
:class:`ControllerSide` lives in the controller and brackets the transfer on each server
(pause + begin, then commit only if every rank holds every bucket), so a failed sync
leaves every server on its previous version and generation resumes on it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from rl.ddma import group
from rl.ddma.engine import TransferStats
from rl.ddma.plan import Plan
from rl.ddma.sglang_target import SGLangTarget

TRANSPORTS = ("ipc", "p2p")


def group_name(port: int, server: int) -> str:
    return f"ddma-{port}-{server}"


class TrainerSide:
    """This trainer rank's sender: its live shards (views, built once) -> every server."""

    def __init__(
        self,
        model: Any,
        layout: Any,
        plan: Plan,
        dtype: torch.dtype,
        urls: list[str],
        timeout: float,
    ) -> None:
        from rl.ddma.megatron_source import shard_getter, source_rank

        self.plan, self.timeout = plan, timeout
        self.rank = source_rank(layout, plan.src)
        self.getter = shard_getter(model, plan, self.rank)
        self.targets = [SGLangTarget(u, plan, dtype, timeout) for u in urls]
        self.groups: list[Any] = []

    def join(self, address: str, ports: list[int]) -> None:
        """p2p: join each server's DDMA group (blocks until that server's ranks join too);
        the controller has asked every server to join with :meth:`ControllerSide.open`."""
        world = self.plan.src.world + self.plan.dst.tp
        for i, port in enumerate(ports):
            name = group_name(ports[0], i)
            self.groups.append(
                group.join(address, port, world, self.rank, name, "gloo", self.timeout)
            )

    def push(self, version: int) -> TransferStats:
        total = TransferStats()
        for i, target in enumerate(self.targets):
            if self.groups:
                s = target.send(self.rank, self.getter, version, self.groups[i])
            else:
                s = target.stage(self.rank, self.getter, version)
            total.buckets += s.buckets
            total.payload_bytes += s.payload_bytes
            total.wire_bytes += s.wire_bytes
            total.seconds += s.seconds
            total.buffer_bytes = max(total.buffer_bytes, s.buffer_bytes)
        return total


class ControllerSide:
    """Brackets a version on every server; ``push`` commits it everywhere or nowhere."""

    def __init__(
        self, urls: list[str], plan: Plan, dtype: torch.dtype, transport: str, timeout: float
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"rollout.weight_sync.transport={transport!r} not in {TRANSPORTS}")
        self.transport = transport
        self.targets = [SGLangTarget(u, plan, dtype, timeout) for u in urls]
        self.names: list[str] = []

    def open(self, address: str, ports: list[int]) -> list[Future]:
        """p2p: ask every server's ranks to join its group (trainer ranks join meanwhile)."""
        self.names = [group_name(ports[0], i) for i in range(len(ports))]
        return [
            t.open_group(name, address, port)
            for t, name, port in zip(self.targets, self.names, ports, strict=True)
        ]

    def push(self, version: int, send: Callable[[], dict]) -> dict:
        """Run one sync: begin on every server, ``send()`` (the trainer ranks transfer),
        commit on every server. Raises after putting every server back on its previous
        version if any part fails."""
        t0 = time.perf_counter()
        begun: list[SGLangTarget] = []
        committed = 0
        try:
            for t in self.targets:
                t.begin(version)
                begun.append(t)
            received = []
            if self.transport == "p2p":
                received = [t.receive(version, n) for t, n in zip(begun, self.names, strict=True)]
            stats = send()
            for f in received:
                f.result()
            for t in begun:
                t.commit(version)  # aborts this server's version itself if it fails
                committed += 1
        except BaseException:
            for t in begun[committed + 1 :]:
                with contextlib.suppress(Exception):
                    t.abort(version)
            raise
        return {**stats, "sync_s": time.perf_counter() - t0}


def connect(cfg: Any, trainer: Any, urls: list[str]) -> ControllerSide:
    """Set up DDMA from the trainer (a :class:`rl.trainer.service.TrainerHandle`) into the
    servers at ``urls``: the same plan on both sides, and for p2p the groups joined."""
    from rl.ddma.plan import plan_for

    w, t = cfg.rollout.weight_sync, cfg.trainer
    plan = plan_for(cfg.model, t, cfg.rollout, dp=t.dp)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[t.params_dtype]
    side = ControllerSide(urls, plan, dtype, w.transport, w.timeout)
    where = trainer.connect(urls)
    if w.transport == "p2p":
        joined = side.open(where["address"], where["ports"])
        trainer.join(where["address"], where["ports"])
        for f in joined:
            f.result()
    return side
