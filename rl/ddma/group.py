"""A process group that spans trainer ranks and generator ranks, outside either's world.

Why: the trainer's default group is Megatron's world and SGLang's is its own; DDMA needs a
third group joining the two, created next to both without touching them. This is the
trainer side of SGLang's ``/init_weights_update_group``: the same TCP rendezvous, a
store prefixed by the group name, and ranks ``[0, n_trainer)`` for the trainer, the
SGLang TP ranks after them. The group is registered under its name with identity rank
mapping, so ``torch.distributed`` point-to-point calls address peers by group rank.

:func:`backend` is the one place a DDMA group's backend is chosen, from the device of the
tensors it carries: gloo for host tensors; on CUDA, torch's per-device backend string,
NCCL for the buckets and gloo beside it for host messages (shm signals, stand-ins), so the
same code posts either and a CUDA bucket never goes through the host.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from rl.runtime.net import listening_socket

HOST_BACKEND = "gloo"
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def local(device: str) -> torch.device:
    """``device`` ("cpu" or "cuda") as this process's torch device."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def backend(device: torch.device | str) -> str:
    """The backend of a DDMA group whose buckets lie on ``device``."""
    kind = torch.device(device).type
    if kind == "cpu":
        return HOST_BACKEND
    if kind == "cuda":
        return CUDA_BACKEND
    raise ValueError(f"DDMA groups carry cpu or cuda tensors, not device={device!r}")


def group_name(port: int, server: int) -> str:
    """The DDMA group of ``server`` (its index in the job) for a sync whose first group
    listens on ``port``: trainer ranks and that server's ranks find it by this name."""
    return f"ddma-{port}-{server}"


def join(
    address: str,
    port: int,
    world_size: int,
    rank: int,
    name: str,
    device: torch.device | str = "cpu",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group ``name`` for buckets on ``device``; blocks until all
    ``world_size`` ranks do."""
    from torch.distributed.distributed_c10d import (
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = timedelta(seconds=timeout_s)
    # SGLang's ranks join through torch's tcp:// rendezvous; rank 0 hosts its store on a
    # socket of its own, bound to ``address``: torch's would listen on every interface.
    fd = listening_socket(address, port)[0] if rank == 0 else None
    store = dist.TCPStore(address, port, world_size, rank == 0, timeout, multi_tenant=True,
                          master_listen_fd=fd)  # fmt: skip
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend(device)),
        PrefixStore(name, store),
        group_name=GroupName(name),
        timeout=timeout,
    )
    # No rank list: the group is every rank of the rendezvous, this one included.
    assert isinstance(pg, dist.ProcessGroup)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def find(name: str) -> dist.ProcessGroup:
    """The group registered as ``name`` in this process (e.g. by SGLang's
    ``init_weights_update_group``)."""
    from torch.distributed.distributed_c10d import _world

    for pg, pg_name in _world.pg_names.items():
        if pg_name == name:
            return pg
    raise KeyError(f"no process group named {name!r} in this process")
