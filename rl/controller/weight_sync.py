"""The controller's weight sync: trainer ranks -> every SGLang server, one version at a time.

The one place that knows both sides. It owns ``weight_version`` (what every server serves
since the last sync) and brackets each new version on every server: pause generation and
begin (:meth:`SGLangTarget.begin`), let the trainer ranks send their own shards (through
the trainer's handle: ``connect`` once, ``join`` for p2p, ``push`` per version), then
commit on every server, which swaps the version in only if every rank holds every bucket.
A failed sync leaves every server on its previous version, and generation resumes on it.

A server that stops answering during a sync (:class:`TransferError`: it died) is left out
of that version and reported in ``lost``, and the version still lands on the others; when
its generator rank has restarted it, :meth:`repush` gives it the current version, from
the trainer ranks as usual. ``lock`` keeps a re-push between whole steps: it is held from
a train step to the push of its weights, so what the trainer holds is always
``weight_version`` when a re-push runs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Collection
from concurrent.futures import Future
from typing import TYPE_CHECKING

from rl.config.dtypes import torch_dtype
from rl.ddma.engine import TransferError
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
        self.lock = threading.RLock()

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
        targets = [SGLangTarget(u, plan, dtype, w.timeout, staging=w.staging) for u in urls]
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

    def push(self, skip: Collection[int] = ()) -> dict[str, float | list[int]]:
        """Make the trainer's current weights version ``weight_version + 1`` on every
        server that answers: begin on each, the trainer ranks send, commit on each.
        ``lost``: the servers that stopped answering (left on whatever they had). Raises
        after putting every server back on its previous version if any other part fails.
        ``skip``: servers known lost (being restarted; each gets a :meth:`repush`)."""
        with self.lock:
            which = [i for i in range(len(self.targets)) if i not in skip]
            out = self._push(self.weight_version + 1, which)
            self.weight_version += 1
            return out

    def repush(self, servers: list[int]) -> dict[str, float | list[int]]:
        """Give restarted ``servers`` the version every other server serves, which is what
        the trainer holds between steps (p2p: their DDMA groups died with them: join new
        ones first)."""
        with self.lock:
            if self.transport == "p2p":
                self._rejoin(servers)
            return self._push(self.weight_version, servers)

    def _rejoin(self, servers: list[int]) -> None:
        where = self.trainer.reserve(len(servers))
        address, ports = where["address"], where["ports"]
        joined = []
        for i, port in zip(servers, ports, strict=True):
            self.names[i] = group_name(ports[0], i)
            joined.append(self.targets[i].open_group(self.names[i], address, port))
        self.trainer.join(address, ports, servers)
        for f in joined:
            f.result()

    def _push(self, version: int, servers: list[int]) -> dict[str, float | list[int]]:
        t0 = time.perf_counter()
        begun: list[int] = []
        lost: list[int] = []
        committed = 0
        try:
            for i in servers:
                try:
                    self.targets[i].begin(version)
                except TransferError:
                    lost.append(i)
                    continue
                begun.append(i)
            t_begun = time.perf_counter()
            received = []
            if self.transport == "p2p":
                received = [self.targets[i].receive(version, self.names[i]) for i in begun]
            stats = self.trainer.push(version, begun)
            for i, f in zip(begun, received, strict=False):
                try:
                    f.result()
                except TransferError:  # the server died while receiving
                    lost.append(i)
            lost += [i for i in stats.pop("lost", []) if i not in lost]
            t_sent = time.perf_counter()
            for i in begun:
                if i in lost:  # if it still lives, it resumes on its previous version
                    with contextlib.suppress(Exception):
                        self.targets[i].abort(version)
                else:
                    try:
                        self.targets[i].commit(version)  # aborts its version itself on failure
                    except TransferError:
                        lost.append(i)
                committed += 1
        except BaseException:
            for i in begun[committed + 1 :]:
                with contextlib.suppress(Exception):
                    self.targets[i].abort(version)
            raise
        t1 = time.perf_counter()
        # Where the sync's time goes: pausing and opening the servers, the trainer ranks'
        # transfer, and committing (generation is paused across all three).
        phases = {"sync_begin_s": t_begun - t0, "sync_send_s": t_sent - t_begun,
                  "sync_commit_s": t1 - t_sent}  # fmt: skip
        return {**stats, **phases, "lost": sorted(lost), "sync_s": t1 - t0}
