"""The role map: which global ranks of the job run which executor.

One launch (our spawner, torchrun, or srun + torchrun) starts every rank of the job; each
rank looks itself up here. Ranks are assigned in a fixed order, so every rank computes
the same map from the same config without talking to anyone:

    controller (1) | trainer (tp*pp*dp) | generator owners | reward

The trainer ranks come right after the controller so that its role group's rank r is
global rank r+1 on every launcher. Pure logic: no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("controller", "trainer", "generator", "reward")


class RoleError(ValueError):
    """A role map that cannot be run (the message names the field and value)."""


@dataclass(frozen=True)
class RoleMap:
    counts: tuple[tuple[str, int], ...]  # (role, ranks) in ROLES order

    @classmethod
    def from_config(cls, cfg: Any) -> RoleMap:
        t, roles = cfg.trainer, cfg.cluster.roles
        counts = {
            "controller": 1,
            "trainer": t.tp * t.pp * t.dp,
            "generator": roles.generator,
            "reward": roles.reward,
        }
        for role in ("generator", "reward"):
            n = counts[role]
            if not (isinstance(n, int) and n >= 0):
                raise RoleError(f"cluster.roles.{role}={n!r} must be an integer >= 0")
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
                f"{self.describe()} (trainer = trainer.tp*pp*dp; set cluster.roles.* or the "
                f"launcher's process count)"
            )
