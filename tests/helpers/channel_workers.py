"""Rank function for the channel tests (module level, so spawned ranks import it)."""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Ping:
    payload: torch.Tensor


@dataclass
class Pong:
    rank: int
    total: float
    group_size: int


def role_rank(cfg, fail_rank: int | None = None) -> dict:
    """Controller (rank 0) sends a >8 MB tensor to each trainer rank; trainer ranks
    all-reduce within their own role group and answer. ``fail_rank`` raises instead."""
    from rl.runtime.channel import ChannelError, Failed, RemoteError
    from rl.runtime.job import join

    job = join(cfg)
    try:
        if job.role == "controller":
            import os

            import psutil

            port = int(os.environ["MASTER_PORT"])  # the job's store, which this rank hosts
            listens = [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                       if c.status == psutil.CONN_LISTEN and c.laddr.port == port]  # fmt: skip
            n = job.role_size("trainer")
            outs = [job.channel(f"t/in/{r}", Ping) for r in range(n)]
            back = job.channel("t/out", Pong)
            big = torch.arange(3_000_000, dtype=torch.float32)  # 12 MB: chunked
            for ch in outs:
                ch.put(Ping(big))
            try:
                outs[0].put(Pong(0, 0.0, 0))
            except ChannelError as e:
                wrong_type = str(e)
            got, remote = [], None
            for _ in range(n):
                try:
                    got.append(back.get(timeout=60))
                except RemoteError as e:
                    remote = str(e)
            try:
                back.get(timeout=1)
            except ChannelError as e:
                timed_out = str(e)
            return {
                "got": got,
                "store_listens": listens,
                "wrong_type": wrong_type,
                "remote": remote,
                "timed_out": timed_out,
                "world": dist.get_world_size(),
            }
        ping = job.channel(f"t/in/{job.role_rank}", Ping).get()
        t = torch.tensor([float(job.role_rank + 1)])
        dist.all_reduce(t)  # the trainer's own group: ranks 1 and 2 of the job
        reply = job.channel("t/out", Pong)
        if job.rank == fail_rank:
            try:
                raise ValueError("boom on purpose")
            except ValueError:
                reply.put(Failed(job.role, job.role_rank, traceback.format_exc()))
                return {"sum": float(ping.payload.sum())}
        reply.put(Pong(job.rank, float(t), dist.get_world_size()))
        return {"sum": float(ping.payload.sum())}
    finally:
        job.finish()
