"""Transports that move a version point to point over a DDMA process group.

The servers' ranks join a group with the trainer ranks (rl/ddma/group.py,
``/init_weights_update_group``): one per server, or, relaying, one for many, in which
the trainer ranks feed the root servers and every other server gets the buckets from its
parent server (rl/ddma/relay.py). Each version is then one send per trainer rank and
group against one receive per server rank, in a request of the server's own (which may
run while it generates: ``overlaps``). A transport of this kind says only what moves the
bytes over the group (:meth:`GroupTransport.send_over`, :meth:`~GroupTransport.receive_over`:
rl/ddma/engine.py, or rl/ddma/shm.py's rings signalled over the group); the groups, the
routes and the lifecycle are this module's.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.ddma.transport import Inbound, Link, Route, Sending, Transport

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from rl.ddma import wire
    from rl.ddma.engine import TransferStats
    from rl.ddma.plan import Plan
    from rl.ddma.relay import Fanout, Relaying


@dataclass(frozen=True, kw_only=True)
class GroupHop:
    """One version over one DDMA group ``pg`` as one rank moves it: ``plan`` (a relay plan
    for a relayed sync), this rank's index there (``rank``: a source rank sending, a
    destination rank receiving), the group ranks at the other end (``peers``), and, for a
    server rank of a relay sync, its ``replica`` and the group ranks it forwards to."""

    plan: Plan
    rank: int
    version: int
    dtype: torch.dtype
    pg: dist.ProcessGroup | None
    peers: Sequence[int]
    device: str | torch.device
    replica: int = 0
    forward_to: Sequence[int] = ()


class GroupTransport(Transport):
    """Point to point over DDMA groups (see the module)."""

    overlaps = True

    @abstractmethod
    def send_over(self, hop: GroupHop, shards: wire.SrcGetter) -> TransferStats:
        """Send this trainer rank's buckets of ``hop.plan`` to the group ranks ``hop.peers``;
        a rank that fails is reported in ``lost`` (or raises :class:`TransferError`)."""

    @abstractmethod
    def receive_over(self, hop: GroupHop, tensors: wire.DstGetter) -> TransferStats:
        """Receive, verify and scatter this server rank's buckets into ``tensors`` from
        ``hop.peers`` (in a relay plan as ``hop.replica``, forwarding to its children among
        ``hop.forward_to``)."""

    def groups(self, servers: list[int], relaying: Relaying) -> list[list[int]]:
        return [servers] if relaying.kind != "none" else [[i] for i in servers]

    def routes(
        self, plan: Plan, where: Sequence[tuple[str, int]], servers: Sequence[int],
        relaying: Relaying,
    ) -> list[Route]:  # fmt: skip
        from rl.ddma import relay

        return relay.routes(plan, where, servers, relaying)

    def prepare(self, link: Link) -> Sending:
        return GroupSending(self, link)

    def receive(self, inbound: Inbound) -> list[int]:
        """This rank's buckets of the version over the group ``ctl["group"]``: trainer
        ranks first, then servers of ``plan.dst.tp`` ranks each, this one at
        ``positions[replica]``. A relay sync (``relay``, ``parents``) feeds the servers
        ``positions`` names, in that order, from the roots down; this rank forwards what it
        gets to its children."""
        from rl.ddma import group, relay

        plan, ctl = inbound.plan, inbound.ctl
        parents = tuple(int(p) for p in ctl.get("parents", (relay.TRAINER,)))
        route = relay.Fanout(str(ctl.get("relay", "none")), parents,
                             tuple(int(p) for p in ctl.get("positions", (0,))))  # fmt: skip
        replica = int(ctl.get("replica", 0))
        if len(route.positions) != len(parents) or not 0 <= replica < len(parents):
            raise ValueError(f"replica {replica} of {route}")
        if len(parents) > 1 and not self.relays:
            raise ValueError(f"a relay sync runs over a relaying transport, not {self.name}")
        # Where the buckets land (bucket_device): on a GPU only when both ends are.
        device = group.local(str(ctl.get("device", "cpu")))
        inbound.writing()
        hop = GroupHop(plan=_relay_plan(plan, route), rank=inbound.rank, version=inbound.version,
                  dtype=inbound.dtype, pg=group.find(ctl["group"]),
                  peers=list(range(plan.src.world)), device=device, replica=replica,
                  forward_to=route.dst_ranks(plan))  # fmt: skip
        self.receive_over(hop, inbound.into)
        return [b.index for b in plan.receives(inbound.rank)]


_RELAYED: OrderedDict[tuple[int, Fanout], Plan] = OrderedDict()


def _relay_plan(plan: Plan, route: Fanout) -> Plan:
    """The relay plan of a sync (its hops: servers x buckets), built once per topology and
    not on every version."""
    key = (plan.digest, route)
    if key not in _RELAYED:
        _RELAYED[key] = route.plan(plan)
        while len(_RELAYED) > 4:
            _RELAYED.popitem(last=False)
    return _RELAYED[key]


class GroupSending(Sending):
    """A trainer rank in the DDMA groups it joined: one per server, or with relays one for
    many, the trainer ranks feeding the roots."""

    def __init__(self, transport: GroupTransport, link: Link) -> None:
        self.transport, self.link = transport, link
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.where: list[tuple[str, int]] = [("", 0)] * len(link.targets)
        self.joined = False

    def join(self, address: str, ports: list[int], groups: list[list[int]]) -> None:
        """Servers named here leave the group they were in (it died with them)."""
        from rl.ddma import group

        plan = self.link.plan
        for k, (port, servers) in enumerate(zip(ports, groups, strict=True)):
            name = group.group_name(ports[0], k)
            world = plan.src.world + len(servers) * plan.dst.tp
            self.groups[name] = group.join(address, port, world, self.link.rank, name,
                                           self.link.device, self.link.timeout)  # fmt: skip
            for pos, i in enumerate(servers):
                self.where[i] = (name, pos)
        self.joined = True

    def close(self) -> None:
        # Forgotten, not destroyed: its other ranks (a server) may be gone already.
        self.groups.clear()
        self.joined = False

    def send(
        self, shards: wire.SrcGetter, version: int, servers: Sequence[int] | None = None
    ) -> tuple[TransferStats, list[int]]:
        from rl.ddma.engine import TransferError, TransferStats

        assert self.joined, "a group transport sends after join"
        link, plan = self.link, self.link.plan
        which = list(range(len(link.targets))) if servers is None else list(servers)
        total, lost = TransferStats(), list[int]()
        for name, route, members in self.transport.routes(plan, self.where, which,
                                                          link.relaying):  # fmt: skip
            try:
                hop = GroupHop(plan=route.plan(plan), rank=link.rank, version=version,
                          dtype=link.dtype, pg=self.groups[name], peers=route.dst_ranks(plan),
                          device=link.device)  # fmt: skip
                s = self.transport.send_over(hop, shards)
            except TransferError as e:  # p2p_shm: a server could not map the rings
                lost += members
                total.error = total.error or str(e)
                continue
            total.add(s)
            tp = plan.dst.tp
            lost += [members[(r - plan.src.world) // tp] for r in s.lost]
        return total, sorted(set(lost))
