"""Rank functions for the shared-memory tests (module level, so spawned ranks import them):
trainer ranks send Megatron shards through :mod:`rl.ddma.shm`, generator ranks receive
them into buffers in SGLang's layout, over several versions; and senders whose receiver
or server is gone before it opens what they put in ``/dev/shm`` (what they leave there)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
from functools import partial
from http.server import BaseHTTPRequestHandler, HTTPServer
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


def shm_unmapped_rank(model_dir: str, how: str) -> dict:
    """Trainer rank 0 sends one version to generator rank 1, which never maps its ring:
    ``how`` "exit" (it returns at once, so its process ends and its connections close
    before the hello) or "refuse" (it cannot map the ring and says so). The trainer rank
    returns the error, its pid (the test looks for its files again once it ended), the
    ``/dev/shm`` files of its rings left after the failure and the rings it keeps."""
    from rl.ddma import shm
    from rl.ddma.engine import TransferError
    from tests.helpers.ddma_util import gloo_world, megatron_shards

    rank, plan, src_ranks, dst_ranks, glob = gloo_world(Path(model_dir), (1, 1), 1, 3000)
    world = dist.group.WORLD
    if rank == 1:
        if how == "refuse":

            def unmappable(path: str, nbytes: int) -> torch.Tensor:
                raise OSError(f"{path}: no such file")

            shm._map = unmappable
            out = {n: torch.zeros(s) for n, s in plan.dst_shapes.items()}
            try:
                shm.receive(plan, 0, out.__getitem__, 1, torch.float32, world, src_ranks)
            except TransferError as e:
                return {"error": str(e)}
        return {"error": ""}
    get = partial(_scaled_getter, megatron_shards(glob, plan, rank))
    try:
        shm.send(plan, rank, get, 1, torch.float32, world, dst_ranks)
        error = ""
    except TransferError as e:
        error = str(e)
    return {"error": error, "pid": os.getpid(), "left": shm_files(shm.PREFIX),
            "rings": [r.path for r in shm._rings.values()]}  # fmt: skip


def shm_files(prefix: str, pid: int | None = None) -> list[tuple[str, int]]:
    """This process's (or ``pid``'s) files in ``/dev/shm`` named ``<prefix><pid>...``, with
    their sizes (a ring's name puts its creator's pid after the prefix, as torch does)."""
    import glob

    out = []
    for path in sorted(glob.glob(f"/dev/shm/{prefix}{pid or os.getpid()}[-_]*")):
        with contextlib.suppress(FileNotFoundError):
            out.append((path, os.path.getsize(path)))
    return out


class _GoneSGLang(BaseHTTPRequestHandler):
    """SGLang's HTTP API as a weight update uses it, with no model behind it: every call
    succeeds but ``/update_weights_from_tensor``, whose payload is never opened: the
    server is killed on receiving it (``how`` "killed") or refuses it ("refuses")."""

    how = "killed"

    def _answer(self, reply: dict) -> None:
        body = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer({"weight_version": "0"})  # /model_info

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/update_weights_from_tensor":
            self._answer({"success": True})
        elif self.how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            self._answer({"success": False, "message": "refused before loading"})

    def log_message(self, *args: object) -> None:
        pass


def _serve_gone_sglang(how: str, port: multiprocessing.connection.Connection) -> None:
    _GoneSGLang.how = how
    server = HTTPServer(("127.0.0.1", 0), _GoneSGLang)
    port.send(server.server_address[1])
    server.serve_forever()


@contextlib.contextmanager
def gone_sglang(how: str):
    """The URL of a :class:`_GoneSGLang` in a process of its own (a child of this one)."""
    ctx = multiprocessing.get_context("fork")
    got, put = ctx.Pipe(duplex=False)
    server = ctx.Process(target=_serve_gone_sglang, args=(how, put), daemon=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{got.recv()}"
    finally:
        server.kill()
        server.join()


def http_update_rank(how: str, nbytes: int) -> dict:
    """One weight update of ``nbytes`` through :class:`rl.generator.client.GeneratorClient`
    to a server that never opens its payload (:class:`_GoneSGLang`). Returns the error
    (kept alive meanwhile, as a caller that reports it later keeps it), this rank's pid
    and the ``/dev/shm`` files it made for the update that are left afterwards."""
    from rl.generator.client import GeneratorClient
    from rl.generator.types import ModelLimits
    from rl.serving import server_api as api

    with gone_sglang(how) as url:
        client = GeneratorClient([url], ModelLimits(100, 64), keys=api.ServerKeys.random())
        before = shm_files("torch_")
        error: Exception | None = None
        try:
            client.update_weights([("w", torch.ones(nbytes // 4))], 1, bucket_bytes=2 * nbytes)
        except Exception as e:
            error = e
        left = [f for f in shm_files("torch_") if f not in before]
        client.close()
    return {"error": repr(error), "pid": os.getpid(), "left": left}


def staged_push_rank(transport: str, fault: str) -> dict:
    """One version pushed over a staged ``transport`` (rl/ddma/staged.py) into a server
    that is killed on the first request, before it opens the bucket (``fault``
    "killed"), or whose bucket fails to pack before any request ("pack"). Returns the
    error, this rank's pid and its ring files left in ``/dev/shm``."""
    from rl.ddma import shm
    from rl.ddma.plan import DstLayout, SrcLayout, make_plan
    from rl.generator.ddma_target import SGLangTarget
    from rl.serving import server_api as api
    from rl.weights import keymap as km

    d = km.Dims(layers=2, hidden=64, ffn=256, heads=4, groups=2, head_dim=16, vocab=512,
                padded_vocab=512, tied=False, qkv_bias=False)  # fmt: skip
    plan = make_plan(d, SrcLayout(1), DstLayout(1), 4, 1 << 14)
    shards = {k: torch.ones(s) for k, s in plan.src_shapes.items()}

    def get(key: str, layer: int | None) -> torch.Tensor:
        if fault == "pack":
            raise KeyError(f"no shard {key}")
        return shards[(key, layer)]

    with gone_sglang("killed") as url:
        target = SGLangTarget(url, plan, torch.float32, keys=api.ServerKeys.random(),
                              transport=transport, timeout=30)  # fmt: skip
        try:
            target.push(0, get, 1)
            error = ""
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    import gc

    gc.collect()  # the failed request's frames and future hold each other (a cycle)
    # What names the slots in each request travels as a one-byte tensor: torch's file of
    # it goes once no one holds it (SGLangTarget.post hands back what no server opened).
    return {"error": error, "pid": os.getpid(), "left": shm_files(shm.PREFIX),
            "torch_left": shm_files("torch_")}  # fmt: skip


def killed_mid_handshake(run_dir: str) -> None:
    """Rank 0 holds a ring no receiver mapped yet (as :func:`rl.ddma.shm.send` does until
    its handshake is done) and waits; rank 1 fails once the ring's name is in
    ``run_dir/ring``, so the launcher kills rank 0 with the ring still linked."""
    import time

    from rl.ddma import shm

    if int(os.environ["RANK"]) == 0:
        ring = shm.create_ring(3000, 2)
        Path(run_dir, "ring.tmp").write_text(ring.path)
        os.replace(Path(run_dir, "ring.tmp"), Path(run_dir, "ring"))
        time.sleep(120)
    while not Path(run_dir, "ring").exists():
        time.sleep(0.02)
    raise RuntimeError("the generator rank failed before the handshake")
