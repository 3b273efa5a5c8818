"""DDMA transports: how a version's buckets travel from the trainer ranks to the server ranks.

What every transport shares is fixed elsewhere: the plan (which bytes go from which trainer
rank to which server rank, rl/ddma/plan.py), the bucket format (header, checksum, pack and
scatter: rl/ddma/wire.py), the receiver's staging and commit (rl/ddma/sglang_receiver.py)
and the controller's bracketing of a version (rl/controller/weight_sync.py). A transport
decides only where a bucket lies while it travels, and it is one of two kinds:

* :class:`GroupTransport`: the servers' ranks join a DDMA process group with the trainer
  ranks (rl/ddma/group.py, ``/init_weights_update_group``), and each version is one
  :meth:`~GroupTransport.send` per trainer rank against one
  :meth:`~GroupTransport.receive` per server rank, point to point.
* :class:`StagedTransport`: a trainer rank packs each bucket into one of its
  :class:`Slots` and names it in a ``/update_weights_from_tensor`` request; the server's
  rank finds it there (:meth:`~StagedTransport.locate`), verifies and scatters it.

Every transport is a class in its own module under ``rl/ddma/transports/``, found by
listing the package as model families are (rl/models/registry.py): adding one is that
module and its tests. ``rollout.weight_sync.transport`` names it, and :func:`check` is the
one place a config's choice is judged.

Importing this module or a transport's loads no torch: the planner reads the traits and
runs :func:`check` in a process that never needs torch; a transport imports what moves
its bytes (rl/ddma/engine.py, rl/ddma/shm.py, torch) inside the methods that move them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar, Protocol

from rl.config.errors import ConfigError
from rl.plugins import discover

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from rl.config.schema import RootConfig
    from rl.ddma import wire
    from rl.ddma.engine import TransferStats
    from rl.ddma.plan import Plan


def link_device(trainer: str, rollout: str) -> str:
    """Where buckets lie between trainer ranks on ``trainer`` and servers on ``rollout``
    (trainer.device, rollout.device): on the GPU only when both ends are (with a CPU end
    both take host buffers, and the GPU end packs into or scatters from them)."""
    return "cuda" if trainer == rollout == "cuda" else "cpu"


class Transport(ABC):
    """What config checks, the planner and both ends need to know of a transport."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for the README and for refusals
    one_host: ClassVar[bool] = False  # every trainer rank and server on one host
    relays: ClassVar[bool] = False  # servers can forward buckets to servers (rl/ddma/relay.py)
    cuda: ClassVar[bool] = False  # only between CUDA trainer ranks and CUDA servers
    host_buckets: ClassVar[bool] = False  # buckets lie in host memory whatever the devices

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


class GroupTransport(Transport):
    """Point to point over a DDMA group, run by an engine module with the signatures of
    :mod:`rl.ddma.engine` (``send`` and ``receive``; a module whose servers do not relay
    takes no ``replica``/``dst_ranks``). A transport names its engine; one with another
    kind of engine overrides :meth:`send` and :meth:`receive` instead."""

    @abstractmethod
    def engine(self) -> ModuleType:
        """The module that moves the bytes, imported here (not when the transport is)."""

    def send(
        self, plan: Plan, src_rank: int, shards: wire.SrcGetter, version: int,
        dtype: torch.dtype, pg: dist.ProcessGroup | None, dst_ranks: Sequence[int],
        device: str | torch.device = "cpu",
    ) -> TransferStats:  # fmt: skip
        """Send this trainer rank's buckets of ``plan`` to the group ranks ``dst_ranks``; a
        rank that fails is reported in ``lost`` (or raises :class:`TransferError`)."""
        return self.engine().send(plan, src_rank, shards, version, dtype, pg, dst_ranks, device)

    def receive(
        self, plan: Plan, dst_rank: int, tensors: wire.DstGetter, version: int,
        dtype: torch.dtype, pg: dist.ProcessGroup | None, src_ranks: Sequence[int],
        device: str | torch.device = "cpu", replica: int = 0, dst_ranks: Sequence[int] = (),
    ) -> TransferStats:  # fmt: skip
        """Receive, verify and scatter this server rank's buckets into ``tensors`` (in a
        relay plan as ``replica``, forwarding to its children among ``dst_ranks``)."""
        engine = self.engine()
        if self.relays:
            return engine.receive(plan, dst_rank, tensors, version, dtype, pg, src_ranks,
                                  device, replica=replica, dst_ranks=dst_ranks)  # fmt: skip
        if replica or len(dst_ranks) > plan.dst.tp:
            raise ValueError(f"a relay sync runs over a relaying transport, not {self.name}")
        return engine.receive(plan, dst_rank, tensors, version, dtype, pg, src_ranks, device)


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


def grouped(name: str) -> GroupTransport:
    t = get(name)
    if not isinstance(t, GroupTransport):
        raise ValueError(f"transport {name!r} does not send over a DDMA group")
    return t


def staged(name: str) -> StagedTransport:
    t = get(name)
    if not isinstance(t, StagedTransport):
        raise ValueError(f"transport {name!r} does not stage buckets through the server's API")
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
