"""Joining the job: this rank's role, its executor's process group, and the channels.

Every rank of a launch calls :func:`join`. The launcher's ``env://`` variables lead to the
job's store (torchrun's agent store, or the TCPStore rank 0 hosts under our spawner). Each
executor then gets a default process group of its own over its own ranks, through a
prefix of that store. That is what Megatron-Core needs (it builds its TP/PP/DP groups
from the default group's ranks, so the trainer's world must be exactly the trainer ranks),
and it keeps each executor's collectives away from the others. Executors talk to the
controller only through :class:`~rl.controller.channel.Channel` queues.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rl.controller.channel import Channel
from rl.controller.roles import RoleMap

EXIT_KEY = "job/exited"


@dataclass
class Job:
    rank: int
    world: int
    role: str
    role_rank: int
    roles: RoleMap
    store: Any
    timeout: float

    def channel(self, name: str, *types: type) -> Channel:
        """A new endpoint (own connection) of channel ``name`` carrying ``types``."""
        return Channel(self.store, name, types, self.timeout)

    def role_size(self, role: str | None = None) -> int:
        return len(self.roles.ranks(role or self.role))

    def finish(self) -> None:
        """Leave the job. Rank 0 hosts the store under our spawner, so it leaves last."""
        self.store.add(EXIT_KEY, 1)
        if self.rank != 0:
            return
        deadline = time.monotonic() + 120
        while self.store.add(EXIT_KEY, 0) < self.world and time.monotonic() < deadline:
            time.sleep(0.05)


def join(cfg: Any, device: str = "cpu") -> Job:
    """Join the job as the rank the launcher says this process is (RANK, WORLD_SIZE)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    roles = RoleMap.from_config(cfg)
    roles.check_world(world)
    role, role_rank = roles.role_of(rank)
    timeout = float(cfg.rl.channel_timeout)
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
    # The trainer is the one executor with heavy collectives: NCCL on GPUs.
    backend = "nccl" if (role == "trainer" and device == "cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"role/{role}", store),
        rank=role_rank,
        world_size=len(roles.ranks(role)),
        timeout=timedelta(seconds=timeout),
    )
    return Job(rank, world, role, role_rank, roles, store, timeout)
