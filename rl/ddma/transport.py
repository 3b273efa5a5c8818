"""DDMA transports: how a version's buckets travel from the trainer ranks to the server ranks.

What every transport shares is fixed elsewhere: the plan (which bytes go from which trainer
rank to which server rank, rl/ddma/plan.py), the bucket format (header, checksum, pack and
scatter: rl/ddma/wire.py), the receiver's staging and commit (rl/ddma/sglang_receiver.py)
and the controller's bracketing of a version (rl/controller/weight_sync.py). A transport
decides only where a bucket lies while it travels, behind one lifecycle that every caller
uses and no caller looks past:

* the controller asks which DDMA process groups the servers join with the trainer ranks
  (:meth:`Transport.groups`; none for a transport that reaches them through their API),
  and for each version which servers to ask to receive it in a request of their own
  (:meth:`Transport.routes`; none where the trainer ranks' requests carry the buckets);
* a trainer rank prepares its sending half once (:meth:`Transport.prepare`, a
  :class:`Sending`), joins the groups, sends version after version and closes it;
* a server rank takes each request's buckets into the version's staging
  (:meth:`Transport.receive`); the receiver commits or drops the version whole, whatever
  brought it.

Two kinds implement it today (rl/ddma/grouped.py: point to point over a group;
rl/ddma/staged.py: buckets left in the trainer's slots and named in the server's
weight-update API), but a transport may implement the lifecycle directly. Each is a class
in its own module under ``rl/ddma/transports/``, found by listing the package as model
families are (rl/models/registry.py): adding one is that module and its tests.
``rollout.weight_sync.transport`` names it, and :func:`check` is the one place a config's
choice is judged.

Importing this module or a transport's loads no torch: the planner reads the traits and
runs :func:`check` in a process that never needs torch; a transport imports what moves
its bytes (rl/ddma/engine.py, rl/ddma/shm.py, torch) inside the methods that move them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, ClassVar, Protocol

from rl.config.errors import ConfigError
from rl.plugins import discover

if TYPE_CHECKING:
    import torch

    from rl.config.schema import RootConfig
    from rl.ddma import wire
    from rl.ddma.engine import TransferStats
    from rl.ddma.plan import Plan
    from rl.ddma.relay import Fanout, Relaying

# One sync over one DDMA group: its name, how it runs, the servers it reaches in order.
Route = tuple[str, "Fanout", list[int]]
Entry = tuple[dict, "torch.Tensor"]  # a request's part for one server rank: control, tensor


def link_device(trainer: str, rollout: str) -> str:
    """Where buckets lie between trainer ranks on ``trainer`` and servers on ``rollout``
    (trainer.device, rollout.device): on the GPU only when both ends are (with a CPU end
    both take host buffers, and the GPU end packs into or scatters from them)."""
    return "cuda" if trainer == rollout == "cuda" else "cpu"


class Target(Protocol):
    """One server as a trainer rank reaches it through its weight-update API (the SGLang
    target of rl/generator/ddma_target.py)."""

    def post(self, entries: list[Entry]) -> list[dict]:
        """One request carrying one entry per server rank; each rank's status. Raises
        :class:`~rl.ddma.engine.TransferError` if the server is gone."""
        ...

    def check(self, statuses: list[dict]) -> None:
        """Raise if a rank refused what the request carried."""
        ...


@dataclass(frozen=True, kw_only=True)
class Link:
    """What a trainer rank's sending half is prepared with: its part of ``plan`` (as source
    rank ``rank``) in ``dtype``, in buckets on ``device``, for the servers behind
    ``targets`` (a server is its index there), relayed as ``relaying``; ``timeout``:
    seconds to wait for a group's other ranks."""

    plan: Plan
    rank: int
    dtype: torch.dtype
    targets: Sequence[Target]
    device: torch.device
    relaying: Relaying
    timeout: float


@dataclass(frozen=True, kw_only=True)
class Inbound:
    """One request's part for server rank ``rank``: its control fields ``ctl`` and tensor,
    for ``version`` of ``plan`` in ``dtype``. The buckets go into ``into``; ``deferred``
    holds the checks of device buckets that wait for the version's end; ``writing`` is
    called before the first byte is written (staging none: the model is torn from then)."""

    plan: Plan
    rank: int
    version: int
    dtype: torch.dtype
    ctl: dict
    tensor: torch.Tensor
    into: wire.DstGetter
    deferred: wire.Deferred
    writing: Callable[[], None]


class SlotsGone(RuntimeError):
    """A request named slots this server can no longer find (it restarted since they were
    unlinked): the trainer rank makes others."""


class Sending(ABC):
    """A trainer rank's sending half, kept across versions."""

    def join(self, address: str, ports: list[int], groups: list[list[int]]) -> None:
        """Join DDMA group k at ``ports[k]`` with the servers ``groups[k]`` (those
        :meth:`Transport.groups` formed; blocks until their ranks join too)."""
        if groups:
            raise ValueError(f"{type(self).__name__} sends over no DDMA group")

    @abstractmethod
    def send(
        self, shards: wire.SrcGetter, version: int, servers: Sequence[int] | None = None
    ) -> tuple[TransferStats, list[int]]:
        """Send this rank's part of ``version`` (its shards read through ``shards``) to
        ``servers`` (default: every server). A server that stops answering (it died) is
        left out and returned in the second item (the first error in ``stats.error``); the
        others still get the version."""

    @abstractmethod
    def close(self) -> None:
        """Free what the sending half holds (its slots, its groups)."""


class Transport(ABC):
    """A transport: what config checks and the planner read (the traits), and the
    lifecycle the controller, trainer ranks and server ranks drive (see the module)."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for docs/ddma.md and for refusals
    one_host: ClassVar[bool] = False  # every trainer rank and server on one host
    relays: ClassVar[bool] = False  # servers can forward buckets to servers (rl/ddma/relay.py)
    cuda: ClassVar[bool] = False  # only between CUDA trainer ranks and CUDA servers
    host_buckets: ClassVar[bool] = False  # buckets lie in host memory whatever the devices
    # Servers take a version in a request of their own, which may run while they generate
    # (rollout.weight_sync.overlap).
    overlaps: ClassVar[bool] = False

    def bucket_device(self, trainer: str, rollout: str) -> str:
        """Where buckets lie in transit, from trainer.device and rollout.device."""
        return "cpu" if self.host_buckets else link_device(trainer, rollout)

    def refusal(self, trainer: str, rollout: str) -> str | None:
        """Why this transport cannot join trainer ranks on ``trainer`` to servers on
        ``rollout`` (None: it can); the hosts and relaying are :func:`check`'s."""
        if self.cuda and not trainer == rollout == "cuda":
            return (f"rollout.weight_sync.transport={self.name!r} needs trainer.device=cuda "
                    f"and rollout.device=cuda, not {trainer}, {rollout}")  # fmt: skip
        return None

    def groups(self, servers: list[int], relaying: Relaying) -> list[list[int]]:
        """Controller: the DDMA groups ``servers`` join, each a list of servers (none: the
        trainer ranks reach them without one)."""
        return []

    def routes(
        self, plan: Plan, where: Sequence[tuple[str, int]], servers: Sequence[int],
        relaying: Relaying,
    ) -> list[Route]:  # fmt: skip
        """Controller and trainer ranks: how one version reaches ``servers`` over their
        groups (``where``: each server's group and position in it), group by group; the
        servers named here receive it in a request of their own. None: the trainer ranks'
        requests carry it."""
        return []

    @abstractmethod
    def prepare(self, link: Link) -> Sending:
        """Trainer rank: its sending half (once; it is kept across versions)."""

    @abstractmethod
    def receive(self, inbound: Inbound) -> Collection[int]:
        """Server rank: verify and scatter the buckets this request brings (or fetches)
        into ``inbound.into``; returns their indices. Raises
        :class:`~rl.ddma.wire.BucketError` for a bad bucket (nothing of it written),
        :class:`~rl.ddma.engine.TransferError` for a peer lost, :class:`SlotsGone`."""


class UnknownTransport(ConfigError):
    """A transport name no module under rl/ddma/transports/ declares."""


@cache
def registry() -> dict[str, Transport]:
    """Name -> transport, one per module of ``rl/ddma/transports``."""
    from rl.ddma import transports

    return discover(transports, "TRANSPORT", lambda t: t.name)


def get(name: str, field: str = "rollout.weight_sync.transport") -> Transport:
    t = registry().get(name)
    if t is None:
        raise UnknownTransport(f"{field}={name!r} is not one of {', '.join(registry())}")
    return t


def check(cfg: RootConfig) -> None:
    """Raise :class:`ConfigError` (one line) if the config's transport cannot carry its
    sync: the name, the devices, the hosts and relaying."""
    w, nodes = cfg.rollout.weight_sync, cfg.cluster.nodes
    t = get(w.transport)
    if t.one_host and nodes != 1:
        across = ", ".join(n for n, x in registry().items() if not x.one_host)
        raise ConfigError(
            f"rollout.weight_sync.transport={w.transport!r} needs every trainer rank and "
            f"server on one host, not cluster.nodes={nodes} (across hosts: {across})"
        )
    why = t.refusal(cfg.trainer.device, cfg.rollout.device)
    if why is not None:
        raise ConfigError(why)
    if w.relay != "none" and not t.relays:
        relaying = ", ".join(n for n, x in registry().items() if x.relays)
        raise ConfigError(
            f"rollout.weight_sync.relay={w.relay!r} needs a transport whose servers forward "
            f"buckets ({relaying}), not transport={w.transport!r}"
        )
