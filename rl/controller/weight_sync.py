"""The controller's weight sync: trainer ranks -> every SGLang server, one version at a time.

The one place that knows both sides. It owns ``weight_version`` (what every server serves
since the last sync) and brackets each new version on every server: pause generation and
begin (:meth:`SGLangTarget.begin`), let the trainer ranks send their own shards (through
the trainer's handle: ``connect`` once, ``join`` for p2p, ``push`` per version), then
commit on every server, which swaps the version in only if every rank holds every bucket.
A failed sync leaves every server on its previous version, and generation resumes on it.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from rl.config.dtypes import torch_dtype
from rl.ddma.group import group_name
from rl.ddma.plan import plan_for
from rl.generator.ddma_target import SGLangTarget

if TYPE_CHECKING:
    from rl.config.schema import RootConfig
    from rl.trainer.service import TrainerHandle

TRANSPORTS = ("ipc", "p2p")


class WeightSync:
    """Pushes the trainer's weights into the servers behind ``targets`` over
    ``transport``; ``push`` makes them the next version everywhere or nowhere."""

    def __init__(
        self,
        trainer: TrainerHandle,
        targets: list[SGLangTarget],
        transport: str,
        weight_version: int,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"rollout.weight_sync.transport={transport!r} not in {TRANSPORTS}")
        self.trainer, self.targets, self.transport = trainer, targets, transport
        self.weight_version = weight_version
        self.names: list[str] = []  # p2p: each server's DDMA group

    @classmethod
    def connect(
        cls, cfg: RootConfig, trainer: TrainerHandle, urls: list[str], weight_version: int
    ) -> WeightSync:
        """Set up DDMA from the trainer into the servers at ``urls``: the same plan on both
        sides, and for p2p every group joined. ``weight_version``: the version the servers
        were last given (the next :meth:`push` publishes the one after it)."""
        w, t = cfg.rollout.weight_sync, cfg.trainer
        plan = plan_for(cfg.model, t, cfg.rollout, dp=t.dp)
        dtype = torch_dtype(t.params_dtype)
        targets = [SGLangTarget(u, plan, dtype, w.timeout) for u in urls]
        sync = cls(trainer, targets, w.transport, weight_version)
        where = trainer.connect(urls)
        if w.transport == "p2p":
            joined = sync._open(where["address"], where["ports"])
            trainer.join(where["address"], where["ports"])
            for f in joined:
                f.result()
        return sync

    def _open(self, address: str, ports: list[int]) -> list[Future]:
        """p2p: ask every server's ranks to join its group (trainer ranks join meanwhile)."""
        self.names = [group_name(ports[0], i) for i in range(len(ports))]
        return [
            t.open_group(name, address, port)
            for t, name, port in zip(self.targets, self.names, ports, strict=True)
        ]

    def push(self) -> dict[str, float]:
        """Make the trainer's current weights version ``weight_version + 1`` on every
        server: begin on each, the trainer ranks send, commit on each. Raises after putting
        every server back on its previous version if any part fails."""
        version = self.weight_version + 1
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
            stats = self.trainer.push(version)
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
        self.weight_version = version
        return {**stats, "sync_s": time.perf_counter() - t0}
