"""Relay fan-out: one replica's DDMA buckets into many servers, servers forwarding them.

Why: every generator server (replica) needs the same bytes in the same layout, so the
trainer need not send them once per server. A few *root* servers get the buckets from the
trainer ranks; every other server gets each bucket, unchanged, from the same generator
rank of its parent server, which forwards bucket k while it receives bucket k+1. A
trainer rank then sends each byte to the roots only, and a relay GPU sends what it
received once (chain) or ``fanout`` times (tree), full duplex with its receiving.

The schedule extends the one-replica plan's rounds (rl/ddma/plan.py ``_schedule``):
root r gets the bucket of round k at round ``k * roots + r`` (a trainer rank still sends
at most once a round), and a replica gets it one round after its parent. So a
(replica, generator rank) receives at most once a round, and every rank's k-th bucket has
finished all its hops rounds before its (k+2)-th arrives: walking the hops in this global
order with two buffers per rank (rl/ddma/engine.py) cannot deadlock.

Pure logic: integers only, no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from rl.config.sglang import RELAYS
from rl.ddma.plan import Bucket, Hop, Plan, PlanError, plan_digest, plan_for

if TYPE_CHECKING:
    from rl.config.schema import RolloutConfig, TrainerConfig, WeightSyncConfig
    from rl.models.arch import ModelShape

__all__ = ["RELAYS", "TRAINER"]
TRAINER = -1  # parent of a replica the trainer ranks feed


def topology(replicas: int, relay: str, roots: int, fanout: int) -> tuple[int, ...]:
    """Each replica's parent (``TRAINER`` for the roots, replicas ``0..roots-1``). chain:
    replica s follows s - roots (roots chains, dealt round robin); tree: replica s
    follows (s - roots) // fanout (breadth first). none: every replica is a root."""
    if relay not in RELAYS:
        raise PlanError(f"rollout.weight_sync.relay={relay!r} must be one of {RELAYS}")
    if fanout < 1:
        raise PlanError(f"rollout.weight_sync.relay_fanout={fanout} must be >= 1")
    roots = replicas if relay == "none" else max(1, min(roots, replicas))
    if relay == "chain":
        return tuple(TRAINER if s < roots else s - roots for s in range(replicas))
    return tuple(TRAINER if s < roots else (s - roots) // fanout for s in range(replicas))


def auto_roots(plan: Plan, replicas: int) -> int:
    """As many roots as keep the busiest trainer rank's bytes at or below the busiest
    generator GPU's: each root then adds no time to the sync (a root GPU cannot take its
    bytes faster than that anyway) and every extra root shortens the relay pipeline."""
    sent: dict[int, int] = defaultdict(int)
    got: dict[int, int] = defaultdict(int)
    for b in plan.buckets:
        n = _payload(plan, b)
        sent[b.src] += n
        got[b.dst] += n
    most = max(sent.values(), default=0)
    return max(1, min(replicas, max(got.values(), default=0) // max(most, 1)))


def attach(
    plan: Plan, replicas: int, relay: str, roots: int = 0, fanout: int = 2, schedule: bool = True
) -> Plan:
    """Turn the one-replica ``plan`` into a plan for ``replicas`` servers (in place; one
    replica: unchanged). ``roots`` 0: :func:`auto_roots`. ``schedule`` False leaves out
    the hops (servers x buckets of them), for byte counts alone (:func:`traffic`)."""
    parents = parents_for(plan, replicas, relay, roots, fanout)
    if replicas == 1:
        return plan
    plan.replicas, plan.relay, plan.parents = replicas, relay, parents
    plan.digest = plan_digest(plan)
    if schedule:
        plan.hops = _hops(plan)
    return plan


def parents_for(
    plan: Plan, replicas: int, relay: str, roots: int = 0, fanout: int = 2
) -> tuple[int, ...]:
    """Each replica's parent for ``replicas`` servers fed under ``plan`` (see :func:`attach`)."""
    if replicas < 1:
        raise PlanError(f"rollout.servers={replicas} must be >= 1")
    if roots < 0:
        raise PlanError(f"rollout.weight_sync.relay_roots={roots} must be >= 0")
    if not roots:
        roots = auto_roots(plan, replicas)
        if relay == "chain":  # the fewest roots that give chains this short
            roots = -(-replicas // -(-replicas // roots))
    return topology(replicas, relay, roots, fanout)


def with_parents(plan: Plan, relay: str, parents: tuple[int, ...]) -> Plan:
    """A copy of the one-replica ``plan`` for ``len(parents)`` servers in this topology
    (``plan`` itself for one server): what a live sync into a subset of the servers runs,
    built the same way by the trainer ranks and every receiving server."""
    if len(parents) == 1:
        return plan
    roots = parents.count(TRAINER)
    if (
        relay not in RELAYS
        or any(p != TRAINER for p in parents[:roots])
        or any(not 0 <= p < c for c, p in enumerate(parents) if c >= roots)
    ):
        raise PlanError(
            f"relay {relay!r} topology {list(parents)}: the roots come first and a parent "
            "precedes its children"
        )
    out = replace(plan, replicas=len(parents), relay=relay, parents=tuple(parents), hops=[])
    out.digest = plan_digest(out)
    out.hops = _hops(out)
    return out


def _hops(plan: Plan) -> list[Hop]:
    parents = plan.parents
    n_roots = parents.count(TRAINER)
    when: dict[tuple[int, int], int] = {}  # (replica, bucket) -> round it arrives
    order = []
    for c, parent in enumerate(parents):  # a parent precedes its children
        for b in plan.buckets:
            # a root gets round k's bucket at k * roots + c, a child one round after its parent
            rnd = b.round * n_roots + c if parent == TRAINER else when[(parent, b.index)] + 1
            when[(c, b.index)] = rnd
            order.append((rnd, c, b.index, parent))
    order.sort()
    return [Hop(i, rnd, b, parent, c) for i, (rnd, c, b, parent) in enumerate(order)]


def plan_with_relay(
    model: ModelShape,
    trainer: TrainerConfig,
    rollout: RolloutConfig,
    dp: int = 1,
    bucket_bytes: int | None = None,
    schedule: bool = True,
) -> Plan:
    """The plan of one sync into every server of ``rollout``, relayed as configured (only a
    relaying transport may be: rl.ddma.transport.check)."""
    w = rollout.weight_sync
    plan = plan_for(model, trainer, rollout, dp, bucket_bytes)
    return attach(plan, rollout.servers, w.relay, w.relay_roots, w.relay_fanout, schedule)


class Relaying(NamedTuple):
    """How live syncs relay (rollout.weight_sync.relay, relay_roots, relay_fanout)."""

    kind: str = "none"
    roots: int = 0
    fanout: int = 2

    @classmethod
    def of(cls, sync: WeightSyncConfig) -> Relaying:
        return cls(sync.relay, sync.relay_roots, sync.relay_fanout)


NO_RELAY = Relaying()


@dataclass(frozen=True)
class Fanout:
    """How one live sync reaches some servers of one DDMA group (trainer ranks first, then
    server after server of ``dst.tp`` ranks): the servers at ``positions`` of the group,
    in that order, are the plan's replicas, fed in the ``relay`` topology ``parents``."""

    relay: str
    parents: tuple[int, ...]
    positions: tuple[int, ...]

    def plan(self, plan: Plan) -> Plan:
        """The relay plan of this sync, from the one-replica ``plan``."""
        return with_parents(plan, self.relay, self.parents)

    def dst_ranks(self, plan: Plan) -> list[int]:
        """Group rank of each destination rank (:func:`flat`) of the relay plan."""
        n, tp = plan.src.world, plan.dst.tp
        return [n + pos * tp + j for pos in self.positions for j in range(tp)]


def fanout(plan: Plan, positions: list[int], relay: str, roots: int, fan: int) -> Fanout:
    """The sync into the servers at ``positions`` of a group (in that order: the first
    are the roots), ``relay`` as configured (rollout.weight_sync.relay, relay_roots,
    relay_fanout): what the controller tells each server and the trainer ranks both build."""
    parents = parents_for(plan, len(positions), relay, roots, fan)
    return Fanout(relay, parents, tuple(positions))


def routes(
    plan: Plan, where: Sequence[tuple[str, int]], servers: Sequence[int], how: Relaying
) -> list[tuple[str, Fanout, list[int]]]:
    """One live sync into ``servers`` (indices into ``where``: each server's DDMA group and
    position in it): per group, how it runs and the servers it reaches, replica by replica.
    A server left out (lost, restarted into another group) leaves the topology re-formed
    over the rest: the controller and every trainer rank compute the same from the same."""
    by_group: dict[str, list[int]] = {}
    for i in sorted(servers, key=lambda i: where[i]):
        by_group.setdefault(where[i][0], []).append(i)
    return [
        (name, fanout(plan, [where[i][1] for i in members], *how), members)
        for name, members in by_group.items()
    ]


# ------------------------------------------------------------------------ per-rank walks
def flat(plan: Plan, replica: int, rank: int) -> int:
    """Index of generator rank ``rank`` of ``replica`` among all destination ranks."""
    return replica * plan.dst.tp + rank


def trainer_walk(plan: Plan, src_rank: int) -> list[tuple[Bucket, list[int]]]:
    """This trainer rank's buckets in send order, each with the destination ranks
    (:func:`flat`) it goes to: packed once, sent to each root."""
    if not plan.hops:
        return [(b, [b.dst]) for b in plan.sends(src_rank)]
    out: list[tuple[Bucket, list[int]]] = []
    where: dict[int, int] = {}
    for h in plan.hops:
        b = plan.buckets[h.bucket]
        if h.src != TRAINER or b.src != src_rank:
            continue
        if h.bucket not in where:
            where[h.bucket] = len(out)
            out.append((b, []))
        out[where[h.bucket]][1].append(flat(plan, h.dst, b.dst))
    return out


def replica_walk(plan: Plan, replica: int, rank: int) -> list[tuple[Bucket, int, list[int]]]:
    """What generator rank ``rank`` of ``replica`` receives, in order: (bucket, sender:
    ``TRAINER`` (the bucket's trainer rank) or the parent's rank (:func:`flat`), the ranks it
    forwards the bucket to)."""
    if not plan.hops:
        return [(b, TRAINER, []) for b in plan.receives(rank)]
    out: list[tuple[Bucket, int, list[int]]] = []
    where: dict[int, int] = {}
    for h in plan.hops:
        b = plan.buckets[h.bucket]
        if b.dst != rank:
            continue
        if h.dst == replica:
            sender = TRAINER if h.src == TRAINER else flat(plan, h.src, rank)
            where[h.bucket] = len(out)
            out.append((b, sender, []))
        elif h.src == replica:  # forwarded after it arrived: hops are in order
            out[where[h.bucket]][2].append(flat(plan, h.dst, rank))
    return out


# ------------------------------------------------------------------------ accounting
def traffic(plan: Plan) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Payload bytes of one sync: sent per trainer rank, and received and forwarded per
    destination rank (:func:`flat`); from the hops, or, for a plan attached without them,
    from the topology (every replica gets every bucket once, from its parent)."""
    per_bucket = [_payload(plan, b) for b in plan.buckets]
    sent: dict[int, int] = defaultdict(int)
    got: dict[int, int] = defaultdict(int)
    fwd: dict[int, int] = defaultdict(int)
    if plan.hops:
        for h in plan.hops:
            b, n = plan.buckets[h.bucket], per_bucket[h.bucket]
            got[flat(plan, h.dst, b.dst)] += n
            if h.src == TRAINER:
                sent[b.src] += n
            else:
                fwd[flat(plan, h.src, b.dst)] += n
        return dict(sent), dict(got), dict(fwd)
    one_sent: dict[int, int] = defaultdict(int)
    one_got: dict[int, int] = defaultdict(int)
    for b, n in zip(plan.buckets, per_bucket, strict=True):
        one_sent[b.src] += n
        one_got[b.dst] += n
    roots = plan.parents.count(TRAINER)
    for s, n in one_sent.items():
        sent[s] = roots * n
    for r, parent in enumerate(plan.parents):
        for j, n in one_got.items():
            got[flat(plan, r, j)] = n
            if parent != TRAINER:
                fwd[flat(plan, parent, j)] += n
    return dict(sent), dict(got), dict(fwd)


def depth(plan: Plan) -> int:
    """Servers on the longest path from the trainer (1: every server is fed directly)."""
    level: list[int] = []
    for parent in plan.parents:
        level.append(1 if parent == TRAINER else level[parent] + 1)
    return max(level)


def schedule_errors(plan: Plan) -> list[str]:
    """Why the relay schedule could not run as planned (empty: it can): each replica gets
    a bucket from its parent after the parent got it, and no (replica, generator rank)
    receives, nor trainer rank sends, twice in one round."""
    errors: list[str] = []
    at: dict[tuple[int, int], int] = {}  # (replica, bucket) -> hop that brought it
    busy: set[tuple[str, int, int, int]] = set()
    for i, h in enumerate(plan.hops):
        b = plan.buckets[h.bucket]
        if h.seq != i or (i and h.round < plan.hops[i - 1].round):
            errors.append(f"hop {i}: out of order")
        if h.src != plan.parents[h.dst]:
            errors.append(f"hop {i}: replica {h.dst} fed by {h.src}, not its parent")
        elif h.src != TRAINER and at.get((h.src, h.bucket), i) >= i:
            errors.append(f"hop {i}: replica {h.src} forwards bucket {h.bucket} before it has it")
        at[(h.dst, h.bucket)] = i
        ends = [("receives", h.dst, b.dst)]
        if h.src == TRAINER:
            ends.append(("sends", TRAINER, b.src))
        for kind, replica, rank in ends:
            if (kind, replica, rank, h.round) in busy:
                who = (
                    f"trainer rank {rank}"
                    if replica == TRAINER
                    else f"replica {replica} rank {rank}"
                )
                errors.append(f"hop {i}: {who} {kind} twice in round {h.round}")
            busy.add((kind, replica, rank, h.round))
    return errors


def _payload(plan: Plan, b: Bucket) -> int:
    return plan.payload(b)
