"""Rank function for the multi-process DDMA tests: trainer ranks send Megatron shards,
generator ranks receive into buffers in SGLang's layout (module level, so spawned ranks
import it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from rl.serving.server_api import ServerKeys


def ddma_rank(
    model_dir: str,
    src: tuple[int, int],
    dst_tp: int,
    bucket_bytes: int,
    fault: str | None = None,
    report_dir: str | None = None,
    fp8_block: int | None = None,
) -> dict:
    """Ranks [0, tp*pp) are the trainer, the next ``dst_tp`` the generator (holding FP8
    linear weights and their scales when ``fp8_block`` is set).

    ``fault``: "corrupt" (trainer rank 0 flips a byte of its second bucket after packing),
    "disconnect" (generator rank 0 exits after its first bucket), "version" (the trainer
    sends version 2, generator expects 1). Each rank writes its outcome to ``report_dir``
    before anything can kill it, so the test reads every side's error.
    """
    from rl.ddma import engine, wire
    from tests.helpers.ddma_util import (
        corrupt_second_bucket,
        exit_after_first_bucket,
        gloo_world,
        megatron_shards,
        report_to,
    )

    rank, plan, src_ranks, dst_ranks, glob = gloo_world(
        Path(model_dir), src, dst_tp, bucket_bytes, fp8_block
    )
    n_src = len(src_ranks)
    report = report_to(report_dir, rank)

    try:
        if rank < n_src:
            shards = megatron_shards(glob, plan, rank)
            version = 1
            if fault == "corrupt":
                corrupt_second_bucket(rank)
            getter = shards.__getitem__
            stats = engine.send(
                plan, rank, lambda k, i: getter((k, i)), version, torch.float32,
                dist.group.WORLD, dst_ranks,
            )  # fmt: skip
            if stats.lost:  # the engine carries on past a lost peer; this worker fails
                raise engine.TransferError(stats.error)
            report("ok")
            return {"role": "trainer", "stats": stats}
        me = rank - n_src
        out = {
            n: torch.full(s, float("nan"), dtype=wire.dst_dtype(plan, n, torch.float32))
            for n, s in plan.dst_shapes.items()
        }
        if fault == "disconnect" and me == 0:
            exit_after_first_bucket(report)
        stats = engine.receive(
            plan, me, out.__getitem__, 1, torch.float32, dist.group.WORLD, src_ranks
        )
        report("ok")
        return {"role": "generator", "rank": me, "tensors": out, "stats": stats}
    except (engine.TransferError, wire.BucketError) as e:
        report(f"{type(e).__name__}: {e}")
        os._exit(3)  # the peers' pending transfers must fail, not hang


def relay_rank(
    model_dir: str,
    src: tuple[int, int],
    dst_tp: int,
    replicas: int,
    relay: str,
    bucket_bytes: int,
    fanout: int = 2,
    dies: int | None = None,
    report_dir: str | None = None,
) -> dict | None:
    """A relay plan for real: ranks [0, tp*pp) are the trainer, then ``replicas`` servers of
    ``dst_tp`` ranks each; the trainer feeds server 0 only, the others get every bucket
    from their parent server (``relay``: chain or tree). ``dies``: that server's ranks
    vanish right after their first bucket; every surviving rank reports how it ended
    (``report_dir``) and returns None."""
    from rl.ddma import engine, wire
    from rl.ddma import relay as relays
    from rl.ddma.plan import DstLayout, SrcLayout, make_plan
    from tests.helpers.ddma_util import (
        exit_after_first_bucket,
        hf_state,
        megatron_globals,
        megatron_shards,
        model_dims,
        report_to,
    )

    rank = dist.get_rank()
    d = model_dims(Path(model_dir), src_tp=src[0])
    plan = make_plan(d, SrcLayout(*src), DstLayout(dst_tp), 4, bucket_bytes)
    relays.attach(plan, replicas, relay, roots=1, fanout=fanout)
    n_src = plan.src.world
    src_ranks = list(range(n_src))
    dst_ranks = [n_src + j for j in range(replicas * dst_tp)]
    glob = megatron_globals(hf_state(Path(model_dir)), d)
    if rank < n_src:
        shards = megatron_shards(glob, plan, rank)
        stats = engine.send(
            plan, rank, lambda k, i: shards[(k, i)], 1, torch.float32, dist.group.WORLD,
            dst_ranks,
        )  # fmt: skip
        if dies is None:
            return {"role": "trainer", "stats": stats}
        report_to(str(report_dir), rank)(f"ok lost={stats.lost}")
        os._exit(0)
    replica, me = divmod(rank - n_src, dst_tp)
    out = {n: torch.full(s, float("nan")) for n, s in plan.dst_shapes.items()}
    if dies is None:
        stats = engine.receive(
            plan, me, out.__getitem__, 1, torch.float32, dist.group.WORLD, src_ranks,
            replica=replica, dst_ranks=dst_ranks,
        )  # fmt: skip
        return {"role": "generator", "replica": replica, "rank": me, "tensors": out,
                "stats": stats}  # fmt: skip
    report = report_to(str(report_dir), rank)
    if replica == dies:
        exit_after_first_bucket(report)
    try:
        stats = engine.receive(
            plan, me, out.__getitem__, 1, torch.float32, dist.group.WORLD, src_ranks,
            replica=replica, dst_ranks=dst_ranks,
        )  # fmt: skip
        report(f"ok lost={stats.lost}")
    except (engine.TransferError, wire.BucketError) as e:
        report(f"{type(e).__name__}: {e}")
    os._exit(0)  # a peer is gone: the group cannot be torn down cleanly


def train_then_sync(
    mcore_dir: str,
    m,
    url: str,
    save_dir: str,
    batch: dict,
    tp: int | None = None,
    ep: int = 1,
    lr: float | None = None,
    hf_dir: str | None = None,
    keys: ServerKeys | None = None,
) -> dict:
    """A Megatron trainer loads ``mcore_dir``, takes one optimizer step on ``batch``, saves,
    and DDMAs its own shards into the SGLang server at ``url`` as version 1 (rank 0
    brackets the transfer as the controller would). ``url`` may instead be the path of a
    file the parent writes the URL into once the server is up: the trainer then converts
    and trains while the server starts (an empty file: the server failed; give up).

    Layout: TP ``tp`` (default: the whole world), DP the rest of the world, experts split
    over ``ep`` of the DP ranks (MoE). ``lr``: the step's exact learning rate (no warm-up,
    constant); None: lr 0.05 under the default config's schedule (its warm-up starts the
    first step at lr / warmup_steps). ``hf_dir``: first convert that HF checkpoint into
    ``mcore_dir`` on these same ranks (saves a second world's start-up). ``keys``: the
    server's (handed over by pickle, as a job hands them over its secret file)."""
    from rl.algorithms.losses import nll_loss
    from rl.compose import compose
    from rl.ddma.megatron_source import shard_getter, source_rank
    from rl.ddma.plan import DstLayout, SrcLayout, make_plan
    from rl.engine.trainer import build_trainer
    from rl.generator.ddma_target import SGLangTarget
    from rl.weights.keymap import Dims

    world = dist.get_world_size()
    tp = tp or world
    dp = world // tp
    rows = batch.tokens.shape[0]
    if hf_dir is not None:
        from rl.weights.convert import hf_to_mcore_rank

        hf_to_mcore_rank(hf_dir, mcore_dir, m, tp, 1, "float32", ep)
    cfg = compose(
        [f"trainer.tp={tp}", f"trainer.dp={dp}", f"trainer.ep={ep}",
         "trainer.micro_batch_size=1", f"trainer.global_batch_size={rows}",
         "trainer.optim.clip_grad=0"]
        + (["trainer.optim.lr=0.05"] if lr is None else
           [f"trainer.optim.lr={lr}", f"trainer.optim.min_lr={lr}",
            "trainer.optim.warmup_steps=0", "trainer.optim.decay_style=constant"])
    )  # fmt: skip
    tr = build_trainer(m, cfg.trainer, total_steps=1)
    tr.load(mcore_dir, load_optimizer=False)
    metrics = tr.train_step(batch, nll_loss)
    tr.save(save_dir)
    url = _await_url(url)
    src = SrcLayout(tp, 1, dp, ep=ep)
    plan = make_plan(Dims.of(m), src, DstLayout.sglang(1, "cpu"), 4, 1 << 16)
    rank = source_rank(tr.layout, plan.src)
    target = SGLangTarget(url, plan, torch.float32, keys=keys)
    if rank == 0:
        target.begin(1)
    dist.barrier()
    stats = target.push(rank, shard_getter(tr.model.module, plan, rank), 1)
    dist.barrier()
    if rank == 0:
        target.commit(1)
    return {"metrics": metrics, "stats": stats, "rank": rank}


def _await_url(url: str, timeout_s: float = 600.0) -> str:
    """``url`` itself, or the URL the parent writes into the file at path ``url``."""
    import time

    if url.startswith("http"):
        return url
    deadline = time.monotonic() + timeout_s
    while not Path(url).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no server URL in {url} after {timeout_s:.0f}s")
        time.sleep(0.2)
    got = Path(url).read_text().strip()
    if not got:
        raise RuntimeError(f"{url}: the server did not start")
    return got


def baseline_rank(model_dir: str, tp: int, dst_tp: int) -> dict:
    """The gather-to-rank-0 baseline on ``tp`` trainer + ``dst_tp`` generator ranks."""
    from rl.ddma.plan import DstLayout, SrcLayout, make_plan
    from tests.helpers.ddma_util import hf_state, megatron_globals, megatron_shards, model_dims
    from tools.bench import ddma_baseline as baseline

    rank = dist.get_rank()
    d = model_dims(Path(model_dir), src_tp=tp)
    trainers = dist.new_group(list(range(tp)))
    fanout = dist.new_group([0, *range(tp, tp + dst_tp)])
    plan = make_plan(d, SrcLayout(tp), DstLayout(dst_tp), 4, 1 << 20)
    if rank < tp:
        shards = megatron_shards(megatron_globals(hf_state(Path(model_dir)), d), plan, rank)
        named = baseline.gather_hf(lambda k, i: shards[(k, i)], d, tp, trainers, 0)
        if rank == 0:
            baseline.broadcast_hf(named, d, torch.float32, fanout, 0)
        else:
            list(named)  # take part in the gathers
        return {"role": "trainer"}
    hf = baseline.broadcast_hf(None, d, torch.float32, fanout, 0)
    out = {n: torch.full(s, float("nan")) for n, s in plan.dst_shapes.items()}
    baseline.load_rank(hf, d, DstLayout(dst_tp), rank - tp, out.__getitem__)
    return {"role": "generator", "rank": rank - tp, "tensors": out}


def p2p_sync(
    urls: list[str], keys: ServerKeys, port: int, glob: dict, model_dir: str, version: int,
    relay: str = "none", during: list[int] | None = None,
) -> dict:  # fmt: skip
    """Two trainer ranks DDMA ``glob`` (Megatron globals) into the SGLang servers at
    ``urls`` point to point: they and every server's ranks join one gloo group; with
    ``relay`` chain the trainer ranks feed the first server only and each server forwards
    to the next. Rank 0 also plays the controller (open the group, begin, have the servers
    receive, commit). ``during``: the servers overlap the sync with generation; once they
    have started receiving, and before any byte is sent, rank 0 has each server generate
    greedily from this prompt (returned as ``during``)."""
    from rl.ddma import group, transport
    from rl.ddma import relay as relays
    from rl.ddma.plan import DstLayout, SrcLayout, make_plan
    from rl.generator.ddma_target import SGLangTarget
    from rl.serving import server_api as api
    from tests.helpers.ddma_util import megatron_shards, model_dims

    rank = dist.get_rank()
    plan = make_plan(model_dims(Path(model_dir), 2), SrcLayout(2), DstLayout.sglang(1, "cpu"),
                     4, 1 << 14)  # fmt: skip
    overlap = during is not None
    targets = [SGLangTarget(u, plan, torch.float32, keys=keys, transport="p2p", overlap=overlap)
               for u in urls]  # fmt: skip
    # Every server in one group (relay none: each fed by the trainer ranks themselves).
    name, servers = group.group_name(port, 0), list(range(len(urls)))
    opened = [t.open_group(name, "127.0.0.1", port, i, len(urls)) for i, t in
              enumerate(targets)] if rank == 0 else []  # fmt: skip
    link = transport.Link(plan=plan, rank=rank, dtype=torch.float32, targets=targets,
                          device=torch.device("cpu"), relaying=relays.Relaying(relay, 1, 2),
                          timeout=120)  # fmt: skip
    sending = transport.get("p2p").prepare(link)
    sending.join("127.0.0.1", [port], [servers])
    for f in opened:
        f.result()
    if rank == 0:
        for t in targets:
            t.begin(version)
    dist.barrier()
    route = relays.fanout(plan, servers, relay, 1, 2)  # the route the trainer ranks take too
    received = [t.receive(version, name, route, i) for i, t in enumerate(targets) if rank == 0]
    outputs = []
    if overlap:
        for f in received:  # started: generation has resumed
            f.result()
        greedy = {"temperature": 0, "max_new_tokens": 8}
        for u in urls if rank == 0 else []:
            reply = api.call(u, api.generate([during], [greedy]), keys, timeout=60)
            outputs.append(api.generate_results(reply, 1)[0]["output_ids"])
        dist.barrier()
    shards = megatron_shards(glob, plan, rank)
    stats, lost = sending.send(lambda k, i: shards[(k, i)], version)
    assert not lost, stats.error
    for f in received:
        f.result()
    if rank == 0:
        for t in targets:
            t.commit(version)
    dist.barrier()
    return {"stats": stats, "parents": route.parents, "during": outputs}
