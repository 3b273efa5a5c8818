"""The role map: which global ranks of the job run which executor.

One launch (our spawner, torchrun, or srun + torchrun) starts every rank of the job; each
rank looks itself up here. Ranks are assigned in a fixed order, so every rank computes
the same map from the same config without talking to anyone:

    controller (1) | trainer (tp*cp*pp*dp) | generator owners | reward | critic | reward_model |
    teacher (each model executor: its own tp*cp*pp*dp, when configured)

The trainer ranks come right after the controller so that its role group's rank r is
global rank r+1 on every launcher. Pure logic: no torch.distributed.

Under SLURM the launcher's ranks do not follow the nodes (rl/runtime/job.py says why),
so the planner's placement is handed to every process as text: each node's role-map
ranks (:func:`format_node_ranks`, ``python -m rl.plan --node-ranks``), read back by
:func:`parse_node_ranks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

ROLES = ("controller", "trainer", "generator", "reward", "critic", "reward_model", "teacher")
# The model executors (rl/companion): a role each, with a config section of that name.
COMPANIONS = ("critic", "reward_model", "teacher")
# The environment variable launch/slurm/train.sbatch puts the planner's node ranks in.
NODE_RANKS_ENV = "MSRL_NODE_RANKS"


class RoleError(ValueError):
    """A role map that cannot be run (the message names the field and value)."""


@dataclass(frozen=True)
class RoleMap:
    counts: tuple[tuple[str, int], ...]  # (role, ranks) in ROLES order

    @classmethod
    def from_config(cls, cfg: RootConfig) -> RoleMap:
        t, roles = cfg.trainer, cfg.cluster.roles
        for role in ("generator", "reward"):
            n = getattr(roles, role)
            if not (isinstance(n, int) and n >= 0):
                raise RoleError(f"cluster.roles.{role}={n!r} must be an integer >= 0")
        # A warm-up-only run (rl.steps=0) starts no generator or reward rank: nothing would
        # send them work, and idle ranks would only hold the job's end.
        rl_only = 1 if cfg.rl.steps > 0 else 0
        counts = {
            "controller": 1,
            "trainer": t.tp * t.cp * t.pp * t.dp,
            "generator": roles.generator * rl_only,
            "reward": roles.reward * rl_only,
        }
        for role in COMPANIONS:
            sec = getattr(cfg, role)
            c = sec.trainer
            counts[role] = c.tp * c.cp * c.pp * c.dp * rl_only * int(sec.enabled)
        rl_steps = cfg.rl.steps
        if rl_steps > 0:
            for role in ("generator", "reward"):
                if counts[role] < 1:
                    raise RoleError(
                        f"cluster.roles.{role}={counts[role]}: rl.steps={rl_steps} needs at "
                        f"least one {role} rank"
                    )
            servers = cfg.rollout.servers
            if servers % counts["generator"]:
                raise RoleError(
                    f"rollout.servers={servers} is not a multiple of cluster.roles.generator="
                    f"{counts['generator']} (each generator rank owns the same number)"
                )
        return cls(tuple((r, counts[r]) for r in ROLES))

    @property
    def world_size(self) -> int:
        return sum(n for _, n in self.counts)

    def ranks(self, role: str) -> list[int]:
        start = 0
        for r, n in self.counts:
            if r == role:
                return list(range(start, start + n))
            start += n
        raise KeyError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")

    def role_of(self, rank: int) -> tuple[str, int]:
        """(role, rank within the role) of a global rank."""
        start = 0
        for r, n in self.counts:
            if start <= rank < start + n:
                return r, rank - start
            start += n
        raise RoleError(f"rank {rank} is outside the role map ({self.describe()})")

    def describe(self) -> str:
        parts = " + ".join(f"{r} {n}" for r, n in self.counts if n)
        return f"{parts} = {self.world_size} ranks"

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise RoleError(
                f"the launcher started {world_size} ranks but the role map needs "
                f"{self.describe()} (trainer = trainer.tp*cp*pp*dp; set cluster.roles.* or the "
                f"launcher's process count)"
            )


def format_node_ranks(per_node: Sequence[Sequence[int]]) -> str:
    """``[[0, 1, 2], [3, 4]]`` -> ``"0,1,2;3,4"``: nodes in order, each node's role-map ranks
    in the order its local ranks play them (a node without ranks is empty)."""
    return ";".join(",".join(str(r) for r in ranks) for ranks in per_node)


def parse_node_ranks(text: str, roles: RoleMap) -> list[list[int]]:
    """The inverse of :func:`format_node_ranks`, checked against the role map: every rank
    of ``roles`` on exactly one node, so a placement from another config is refused."""
    try:
        per_node = [[int(r) for r in node.split(",") if r] for node in text.split(";")]
    except ValueError:
        raise RoleError(
            f"{NODE_RANKS_ENV}={text!r:.200} is not the planner's node ranks "
            "(python -m rl.plan --node-ranks: ranks comma-separated, nodes by ';')"
        ) from None
    placed = sorted(r for ranks in per_node for r in ranks)
    if placed != list(range(roles.world_size)):
        raise RoleError(
            f"{NODE_RANKS_ENV} places {len(placed)} ranks on {len(per_node)} nodes, not each "
            f"rank of the role map once ({roles.describe()}): the placement was planned for "
            "another config (python -m rl.plan --node-ranks <the job's overrides>)"
        )
    return per_node
