"""The controller's weight sync: trainer ranks -> every SGLang server, one version at a time.

The one place that knows both sides. It owns ``weight_version`` (what every server serves
since the last sync) and brackets each new version on every server: pause generation and
begin (:meth:`SGLangTarget.begin`), let the trainer ranks send their own shards (through
the trainer's handle: ``connect`` once, ``join`` for a group transport, ``push`` per
version), then commit on every server, which swaps the version in only if every rank
holds every bucket. A failed sync leaves every server on its previous version, and
generation resumes on it. With a group transport and a staging copy
(rollout.weight_sync.overlap), generation resumes as soon as the servers start
receiving, and pauses again only for the commit.

The transport (rl/ddma/transport.py) says which DDMA groups the servers sit in with the
trainer ranks (a group transport: one per server, or, with relays
(rollout.weight_sync.relay), one for all of them, in which the trainer ranks feed the
root servers and every other server gets the buckets from its parent server,
rl/ddma/relay.py; a staged one: none) and, per version, which servers receive it in a
request of their own. Each push forms the topology over the servers it reaches.

A server that stops answering during a sync (:class:`TransferError`: it died) is left out
of that version and reported in ``lost``, and the version still lands on the others
(those below it in a relay miss it too, and keep the previous one: :class:`UpstreamLost`;
the next push re-forms the topology without the lost server). When its generator rank
has restarted it, :meth:`repush` gives it the current version, in a new group. ``lock``
keeps a re-push between whole steps: it is held from a train step to the push of its
weights, so what the trainer holds is always ``weight_version`` when a re-push runs.
A server that would not flush its prefix cache at commit (:class:`NotFlushed`) is left
out and reported the same way: alive, it keeps its previous version and gets no rollouts
(the client routes by version) until the next push, which it takes part in.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rl.config.dtypes import torch_dtype
from rl.ddma import relay
from rl.ddma import transport as transports
from rl.ddma.engine import TransferError
from rl.ddma.group import group_name
from rl.ddma.plan import Plan, plan_for
from rl.generator.ddma_target import NotFlushed, SGLangTarget, UpstreamLost

if TYPE_CHECKING:
    from rl.config.schema import RootConfig
    from rl.trainer.service import TrainerHandle


@dataclass(kw_only=True)
class SyncResult:
    """One version pushed: the bytes the trainer ranks sent, where the time went (the
    servers paused and opened, the transfer, the commit; generation is paused across all
    three unless it overlaps the transfer), the servers fed by another server, and the
    servers that missed it (left on whatever they had)."""

    version: int
    committed: list[int] = field(default_factory=list)  # the servers that serve it now
    lost: list[int] = field(default_factory=list)
    payload_bytes: float = 0.0
    wire_bytes: float = 0.0
    begin_s: float = 0.0
    send_s: float = 0.0
    commit_s: float = 0.0
    relayed_servers: int = 0

    @property
    def seconds(self) -> float:
        return self.begin_s + self.send_s + self.commit_s

    def metrics(self) -> dict[str, float]:
        """As the step log names them."""
        return {
            "sync_bytes": self.payload_bytes, "sync_wire_bytes": self.wire_bytes,
            "sync_begin_s": self.begin_s, "sync_send_s": self.send_s,
            "sync_commit_s": self.commit_s, "sync_s": self.seconds,
            "sync_relayed_servers": float(self.relayed_servers),
            "sync_lost_servers": float(len(self.lost)),
        }  # fmt: skip


class WeightSync:
    """Pushes the trainer's weights into the servers behind ``targets`` (over their
    transport); ``push`` makes them the next version everywhere or nowhere."""

    def __init__(
        self,
        trainer: TrainerHandle,
        targets: list[SGLangTarget],
        *,
        weight_version: int,
        relaying: relay.Relaying = relay.NO_RELAY,
    ) -> None:
        self.trainer, self.targets = trainer, targets
        self.transport: transports.Transport = targets[0].transport
        self.weight_version = weight_version
        self.relaying = relaying
        # Told of every new version once it is committed (the rollout stream, the client's
        # routing): the one holder of weight_version tells the others.
        self.listeners: list[Callable[[SyncResult], None]] = []
        # Each server's DDMA group and its position there (a transport that forms groups).
        self.where: list[tuple[str, int]] = [("", 0)] * len(targets)
        self.lock = threading.RLock()

    @property
    def plan(self) -> Plan:
        return self.targets[0].plan

    @classmethod
    def connect(
        cls, cfg: RootConfig, trainer: TrainerHandle, urls: list[str], weight_version: int
    ) -> WeightSync:
        """Set up DDMA from the trainer into the servers at ``urls``: the same plan on both
        sides, and for a group transport every group joined. ``weight_version``: the
        version the servers were last given (the next :meth:`push` publishes the one after
        it)."""
        w, t = cfg.rollout.weight_sync, cfg.trainer
        plan = plan_for(cfg.model, t, cfg.rollout, dp=t.dp)
        dtype = torch_dtype(t.params_dtype)
        device = transports.get(w.transport).bucket_device(t.device, cfg.rollout.device)
        targets = [SGLangTarget(u, plan, dtype, timeout=w.timeout, staging=w.staging,
                                transport=w.transport, overlap=w.overlap, device=device)
                   for u in urls]  # fmt: skip
        sync = cls(trainer, targets, weight_version=weight_version,
                   relaying=relay.Relaying.of(w))  # fmt: skip
        where = trainer.connect(urls)
        sync._join(where.address, where.ports, list(range(len(urls))))
        return sync

    def _join(self, address: str, ports: list[int], servers: list[int]) -> None:
        """Put ``servers`` in the new DDMA groups the transport forms (a group transport:
        each its own, or, relaying, all in one; else none) and have their ranks and the
        trainer ranks join them."""
        groups = self.transport.groups(servers, self.relaying)
        if not groups:
            return
        joined = []
        for k, (port, members) in enumerate(zip(ports, groups, strict=False)):
            name = group_name(ports[0], k)
            for pos, i in enumerate(members):
                self.where[i] = (name, pos)
                target = self.targets[i]
                joined.append(target.open_group(name, address, port, pos, len(members)))
        self.trainer.join(address, ports[: len(groups)], groups)
        for f in joined:
            f.result()

    def push(self, skip: Collection[int] = ()) -> SyncResult:
        """Make the trainer's current weights version ``weight_version + 1`` on every
        server that answers: begin on each, the trainer ranks send, commit on each.
        ``lost``: the servers that stopped answering (left on whatever they had). Raises
        after putting every server back on its previous version if any other part fails.
        ``skip``: servers known lost (being restarted; each gets a :meth:`repush`). Every
        listener then hears of the new version."""
        with self.lock:
            which = [i for i in range(len(self.targets)) if i not in skip]
            out = self._push(self.weight_version + 1, which)
            self.weight_version += 1
            for tell in self.listeners:
                tell(out)
            return out

    def repush(self, servers: list[int]) -> SyncResult:
        """Give restarted ``servers`` the version every other server serves, which is what
        the trainer holds between steps (their DDMA groups, if the transport forms any,
        died with them: join new ones first)."""
        with self.lock:
            groups = self.transport.groups(servers, self.relaying)
            if groups:
                where = self.trainer.reserve(len(groups))
                self._join(where.address, where.ports, servers)
            return self._push(self.weight_version, servers)

    def _push(self, version: int, servers: list[int]) -> SyncResult:
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
            received = {}
            relayed = 0  # servers fed by another server, not by the trainer ranks
            # The servers that take the version in a request of their own (none where the
            # trainer ranks' requests carry it).
            for name, route, members in self.transport.routes(self.plan, self.where, begun,
                                                              self.relaying):  # fmt: skip
                relayed += len(members) - route.parents.count(relay.TRAINER)
                for replica, i in enumerate(members):
                    received[i] = self.targets[i].receive(version, name, route, replica)
            sent = self.trainer.push(version, begun)
            for i, f in received.items():
                try:
                    f.result()
                except (TransferError, UpstreamLost):  # it, or a server relaying to it, died
                    lost.append(i)
            lost += [i for i in sent.lost if i not in lost]
            t_sent = time.perf_counter()
            for i in begun:
                if i in lost:  # if it still lives, it resumes on its previous version
                    with contextlib.suppress(Exception):
                        self.targets[i].abort(version)
                else:
                    try:
                        self.targets[i].commit(version)  # aborts its version itself on failure
                    # Overlap: found out at commit. Or the server would not drop its cache:
                    # alive, it keeps its previous version, behind until a later one lands.
                    except (TransferError, UpstreamLost, NotFlushed):
                        lost.append(i)
                committed += 1
        except BaseException:
            for i in begun[committed + 1 :]:
                with contextlib.suppress(Exception):
                    self.targets[i].abort(version)
            raise
        serving = [i for i in begun if i not in lost]
        return SyncResult(version=version, committed=serving, lost=sorted(lost),
                          payload_bytes=sent.payload_bytes, wire_bytes=sent.wire_bytes,
                          begin_s=t_begun - t0, send_s=t_sent - t_begun,
                          commit_s=time.perf_counter() - t_sent,
                          relayed_servers=relayed)  # fmt: skip
