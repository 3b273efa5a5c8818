"""Rank function for the shared-memory DDMA tests (module level, so spawned ranks import
it): trainer ranks send Megatron shards through :mod:`rl.ddma.shm`, generator ranks
receive them into buffers in SGLang's layout, over several versions."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist


def shm_rank(
    model_dir: str,
    src: tuple[int, int],
    dst_tp: int,
    bucket_bytes: int,
    versions: int = 1,
    fault: str | None = None,
    report_dir: str | None = None,
) -> dict:
    """Ranks [0, tp*pp) are the trainer, the next ``dst_tp`` the generator. Each version
    sends the shards scaled by the version number, so a stale bucket would show.

    ``fault``: "corrupt" (trainer rank 0 flips the last byte of its second bucket after
    packing), "disconnect" (generator rank 0 exits after its first bucket). Each rank
    writes its outcome to ``report_dir`` before anything can kill it."""
    from rl.ddma import shm, wire
    from rl.ddma.engine import TransferError
    from tests.helpers.ddma_util import (
        corrupt_second_bucket,
        exit_after_first_bucket,
        gloo_world,
        megatron_shards,
        report_to,
    )

    rank, plan, src_ranks, dst_ranks, glob = gloo_world(Path(model_dir), src, dst_tp, bucket_bytes)
    n_src = len(src_ranks)
    report = report_to(report_dir, rank)

    try:
        if rank < n_src:
            shards = megatron_shards(glob, plan, rank)
            if fault == "corrupt":
                corrupt_second_bucket(rank)
            stats, paths = [], []
            for v in range(1, versions + 1):
                get = partial(_scaled_getter, {k: t * v for k, t in shards.items()})
                world = dist.group.WORLD
                stats.append(shm.send(plan, rank, get, v, torch.float32, world, dst_ranks))
                paths.append(sorted(r.path for r in shm._rings.values()))
            leftover = [p for ps in paths for p in ps if os.path.exists(p)]
            report("ok")
            return {"role": "trainer", "stats": stats, "rings": paths, "leftover": leftover}
        me = rank - n_src
        if fault == "disconnect" and me == 0:
            exit_after_first_bucket(report)
        outs, stats = [], []
        for v in range(1, versions + 1):
            out = {
                n: torch.full(s, float("nan"), dtype=wire.dst_dtype(plan, n, torch.float32))
                for n, s in plan.dst_shapes.items()
            }
            world = dist.group.WORLD
            stats.append(shm.receive(plan, me, out.__getitem__, v, torch.float32, world, src_ranks))
            outs.append(out)
        report("ok")
        return {"role": "generator", "rank": me, "tensors": outs, "stats": stats}
    except (TransferError, wire.BucketError) as e:
        report(f"{type(e).__name__}: {e}")
        os._exit(3)  # the peers' pending transfers must fail, not hang


def _scaled_getter(scaled: dict, key: str, layer: int | None) -> torch.Tensor:
    return scaled[(key, layer)]


def p2p_shm_sync(url: str, keys, port: int, globs: list[dict], model_dir: str, version: int):
    """Two trainer ranks push ``globs`` (Megatron globals, one per version from
    ``version`` on) into the SGLang server at ``url`` through shared-memory rings: they and
    the server's ranks join one gloo group that only signals; rank 0 also plays the
    controller (open the group, begin, have the server receive, commit)."""
    from rl.ddma import group, shm
    from rl.ddma.plan import DstLayout, SrcLayout, make_plan
    from rl.generator.ddma_target import SGLangTarget
    from tests.helpers.ddma_util import megatron_shards, model_dims

    rank = dist.get_rank()
    plan = make_plan(model_dims(Path(model_dir), 2), SrcLayout(2), DstLayout.sglang(1, "cpu"),
                     4, 1 << 14)  # fmt: skip
    target = SGLangTarget(url, plan, torch.float32, keys=keys, transport="p2p_shm")
    name = group.group_name(port, 0)
    opened = target.open_group(name, "127.0.0.1", port) if rank == 0 else None
    target.sender(rank).join("127.0.0.1", [port], [[0]])  # the trainer ranks' side
    if opened is not None:
        opened.result()
    stats, rings = [], []
    for v, glob in enumerate(globs, start=version):
        if rank == 0:
            target.begin(v)
        dist.barrier()
        received = target.receive(v, name) if rank == 0 else None
        shards = megatron_shards(glob, plan, rank)
        stats.append(target.push(rank, partial(_scaled_getter, shards), v))
        if received is not None:
            received.result()
            target.commit(v)
        dist.barrier()
        rings.append(sorted(r.path for r in shm._rings.values()))
    return {"stats": stats, "rings": rings}
