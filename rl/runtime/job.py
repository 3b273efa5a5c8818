"""Joining the job: this rank's role, its executor's process group, and the channels.

Every rank of a launch calls :func:`join`. The launcher's ``env://`` variables lead to the
job's store (torchrun's agent store, or the TCPStore rank 0 hosts under our spawner). Each
executor then gets a default process group of its own over its own ranks, through a
prefix of that store. That is what Megatron-Core needs (it builds its TP/PP/DP groups
from the default group's ranks, so the trainer's world must be exactly the trainer ranks),
and it keeps each executor's collectives away from the others. Executors talk to the
controller only through :class:`~rl.runtime.channel.Channel` queues.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from rl.config.roles import NODE_RANKS_ENV, RoleError, RoleMap, parse_node_ranks
from rl.runtime.channel import Channel
from rl.runtime.net import listening_socket

if TYPE_CHECKING:
    from torch.distributed import Store

    from rl.config.schema import RootConfig

EXIT_KEY = "job/exited"


@dataclass
class Job:
    rank: int
    world: int
    role: str
    role_rank: int
    _: KW_ONLY
    roles: RoleMap
    store: Store  # the job's store, shared by every rank (the channels' queues)
    timeout: float
    # The job's key (rl.runtime.secret), which signs every channel message; kept out of repr.
    secret: bytes = field(repr=False)

    def channel(self, name: str, *types: type) -> Channel:
        """A new endpoint (own connection) of channel ``name`` carrying ``types``."""
        return Channel(self.store, name, types, self.timeout, key=self.secret)

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


def placed_rank(roles: RoleMap, env: Mapping[str, str], rank: int) -> int:
    """The role-map rank this process plays.

    Why not the launcher's rank: under ``srun torchrun --rdzv_backend c10d`` the global
    ranks follow the rendezvous order of the nodes' agents, not the nodes' order. So
    launch/slurm/train.sbatch asks the planner, before any rank starts, which role-map
    ranks each node runs (trainer ranks on the training nodes, generator ranks next to
    their servers) and hands that to every process in MSRL_NODE_RANKS; each finds its
    place from its node (SLURM_NODEID) and its local rank. Elsewhere the launcher's rank
    is the role-map rank."""
    text = env.get(NODE_RANKS_ENV)
    if text is None:
        return rank
    per_node = parse_node_ranks(text, roles)
    node, local = int(env["SLURM_NODEID"]), int(env["LOCAL_RANK"])
    started = int(env["LOCAL_WORLD_SIZE"])
    if node >= len(per_node) or started != len(per_node[node]):
        expected = len(per_node[node]) if node < len(per_node) else 0
        raise RoleError(
            f"node {node} started {started} ranks but the placement of cluster.nodes="
            f"{len(per_node)} puts {expected} there (python -m rl.plan --ranks-per-node)"
        )
    return per_node[node][local]


def job_store(rank: int, world: int, timeout: timedelta) -> Store:
    """The job's store, from the launcher's ``env://`` variables. Rank 0 hosts it on a
    socket it binds to ``MASTER_ADDR`` itself (127.0.0.1 under our spawner, the node's
    address under a multi-node launcher): given only a host, torch's TCPStore listens on
    every interface. Under torchrun the store is torchrun's agent store, which rank 0 does
    not host."""
    import torch.distributed as dist

    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return next(dist.rendezvous("env://", timeout=timeout))[0]
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    fd, port = listening_socket(host, port)
    return dist.TCPStore(host, port, world, True, timeout, master_listen_fd=fd)


def place(cfg: RootConfig) -> tuple[str, int, int]:
    """The role this process plays, its rank in it and the role's size, from the
    launcher's variables alone (before it joins: a generator rank starts its servers
    first)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    roles = RoleMap.from_config(cfg)
    roles.check_world(world)
    role, role_rank = roles.role_of(placed_rank(roles, os.environ, rank))
    return role, role_rank, len(roles.ranks(role))


def join(cfg: RootConfig, device: str = "cpu") -> Job:
    """Join the job as the rank the launcher says this process is (RANK, WORLD_SIZE)."""
    import torch
    import torch.distributed as dist

    from rl.runtime import secret

    key = secret.load()  # first: a rank without the job's key must not join
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    roles = RoleMap.from_config(cfg)
    role, role_rank, _ = place(cfg)
    timeout = float(cfg.rl.channel_timeout)
    store = job_store(rank, world, timedelta(seconds=timeout))
    # The trainer is the one executor with heavy collectives: NCCL on GPUs.
    backend = "nccl" if (role == "trainer" and device == "cuda") else "gloo"
    if backend == "nccl":  # trainer ranks fill their nodes' GPUs in order (rl/plan)
        torch.cuda.set_device(role_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"role/{role}", store),
        rank=role_rank,
        world_size=len(roles.ranks(role)),
        timeout=timedelta(seconds=timeout),
    )
    return Job(rank, world, role, role_rank, roles=roles, store=store, timeout=timeout, secret=key)
