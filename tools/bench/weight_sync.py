"""DDMA weight sync vs the gather-to-rank-0 baseline, in one run, on a ~125M-param model.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/weight_sync.py

A random Llama (hidden 768, 12 layers, GQA 12/4, MLP 2048, vocab 32000, fp32) is made
locally. Trainer ranks hold its Megatron TP=2 shards (built with rl.weights.keymap, the
layout the converter tests check against Megatron's own checkpoints).

0. This host's caps, measured first: single-thread memcpy, one raw gloo send/recv of
   64 MB between two processes (TCP loopback), and where one trainer rank's DDMA CPU time
   goes (pack, checksum, verify, scatter: ``phases_one_trainer_rank``).
1. In one gloo world: 2 trainer ranks -> 2 generator ranks that hold buffers in SGLang's
   TP=2 layout. DDMA through shared memory (rl.ddma.shm, the same-host transport: the
   headline; also without the payload checksum) and over gloo (rl.ddma.engine), against
   the baseline (tools/bench/ddma_baseline.py: gather every tensor to trainer rank 0,
   rename to HF, broadcast everything to every generator rank, which cuts out its shard
   as SGLang's loaders do). All must leave identical buffers.
2. Into a live SGLang server (TP=1, CPU): DDMA (rl.generator.ddma_target) by ``ipc``
   (each trainer rank's shared-memory ring, one HTTP request per bucket), ``p2p`` (a gloo
   group the server joins, one request per version) and ``p2p_shm`` (that group only
   signalling, the buckets in the trainer ranks' rings), each split into begin / transfer
   / commit, against the generator client's HF-named bucketed update fed by a gather to
   trainer rank 0. All must serve the same tokens. Then each
   rollout.weight_sync.staging option (device, host, none) against device: the server's
   peak extra memory and the sync time (tools/bench/weight_sync_staging.py).

``--device cuda`` runs instead DDMA's device path on ``cuda:0`` against a device-to-device
copy of the same bytes (tools/bench/weight_sync_device.py; tools/gpu_check.sh runs it).

Prints and writes (JSON) median times, their ratio, effective bandwidth against this
machine's memcpy bandwidth measured in the same run, bytes sent against the
destination's size, and each rank's peak extra memory (VmHWM above the rank's resident
size before the transfer; the kernel's peak counter is reset first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import ddma_baseline as baseline
import torch
import torch.distributed as dist
import weight_sync_staging
from bench_util import peak_mb, reset_peak, rss_mb, tree_peak_rss_mb, tree_rss_mb, write_result
from common import dims, llama_shape, make_llama, trainer_shards

from rl.ddma import engine, group, shm
from rl.ddma.plan import HEADER_BYTES, DstLayout, SrcLayout, make_plan
from rl.generator.ddma_target import SGLangTarget
from rl.runtime.launch import spawn
from rl.serving.server_api import ServerKeys
from rl.weights import keymap as km

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20
# The DDMA transports of part 1 (module, extra keywords of its send and receive): same
# host (shared memory), with and without the payload checksum, and any host (gloo).
TRANSPORTS: dict[str, tuple[Any, dict]] = {
    "shm": (shm, {}),
    "shm_no_checksum": (shm, {"checksum": False}),
    "gloo": (engine, {}),
}
DDMA_MODES = ("ipc", "p2p", "p2p_shm")  # into the live server (part 2)
SHAPE = llama_shape(hidden=768, ffn=2048, layers=12, heads=12, kv_heads=4, vocab=32000)


def make_model(path: Path) -> Path:
    return make_llama(path, SHAPE)


def _timed(fn, reps: int) -> tuple[list[float], list[int], Any]:
    """Times and peak extra memory of ``reps`` calls, and the last call's return value."""
    times, peaks, ret = [], [], None
    for _ in range(reps):
        dist.barrier()
        me = os.getpid()
        rss0 = rss_mb(me)
        reset_peak(me)
        t0 = time.perf_counter()
        ret = fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        peaks.append(int((peak_mb(me) - rss0) * MB))
    return times, peaks, ret


def _digest(tensors: dict) -> float:
    return float(sum(t.double().sum() * (i + 1) for i, t in enumerate(tensors.values())))


# ---------------------------------------------------------------- part 1: one world
def world_rank(model_dir: str, tp: int, dst_tp: int, bucket_mb: int, reps: int) -> dict:
    """DDMA through shared memory (rl.ddma.shm: the same-host transport) and over gloo
    (rl.ddma.engine), then the baseline, each leaving the generator's buffers to compare."""
    path = Path(model_dir)
    d = dims(path)
    rank = dist.get_rank()
    plan = make_plan(d, SrcLayout(tp), DstLayout(dst_tp), 4, bucket_mb * MB)
    trainers = dist.new_group(list(range(tp)))
    fanout = dist.new_group([0, *range(tp, tp + dst_tp)])
    src_ranks, dst_ranks = list(range(tp)), list(range(tp, tp + dst_tp))
    f32, world = torch.float32, dist.group.WORLD
    out: dict = {}
    if rank < tp:
        shards = trainer_shards(path, d, tp, rank)
        get = lambda k, i: shards[(k, i)]  # noqa: E731
        modes = {t: partial(m.send, plan, rank, get, 1, f32, world, dst_ranks, **kw)
                 for t, (m, kw) in TRANSPORTS.items()}  # fmt: skip

        def base():
            named = baseline.gather_hf(get, d, tp, trainers, 0)
            if rank == 0:
                baseline.broadcast_hf(named, d, f32, fanout, 0)
            else:
                for _ in named:
                    pass
    else:
        me = rank - tp
        out = {n: torch.zeros(s) for n, s in plan.dst_shapes.items()}
        modes = {t: partial(m.receive, plan, me, out.__getitem__, 1, f32, world, src_ranks, **kw)
                 for t, (m, kw) in TRANSPORTS.items()}  # fmt: skip

        def base():
            hf = baseline.broadcast_hf(None, d, f32, fanout, 0)
            baseline.load_rank(hf, d, DstLayout(dst_tp), me, out.__getitem__)

    result: dict = {"rank": rank, "role": "trainer" if rank < tp else "generator"}
    digests = {}
    for name, fn in [*modes.items(), ("baseline", base)]:
        for t in out.values():
            t.zero_()  # each mode must write every byte itself
        fn()  # warm-up: connections, shared-memory rings, page faults
        times, peaks, stats = _timed(fn, reps)
        digests[name] = _digest(out) if rank >= tp else None
        result[name] = {"s": times, "peak_extra": max(peaks)}
        if stats is not None:
            result[name]["buffer_bytes"] = stats.buffer_bytes
    result["identical"] = all(v == digests["baseline"] for v in digests.values())
    result["shard_bytes"] = sum(t.numel() * 4 for t in (shards if rank < tp else out).values())
    return result


def gloo_rank(nbytes: int, reps: int) -> list[float]:
    """One raw gloo send/recv of ``nbytes`` between two processes, ``reps`` times."""
    t = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first one sets the connection up


def gloo_loopback_gbps(nbytes: int = 64 * MB, reps: int = 5) -> float:
    """The cap of gloo's TCP loopback on this host: the best of ``reps`` raw transfers."""
    a, b = spawn(gloo_rank, 2, nbytes, reps, timeout_s=600)
    return nbytes / min(max(x, y) for x, y in zip(a, b, strict=True)) / 1e9


def phases(model: Path, d: km.Dims, bucket_mb: int, reps: int = 3) -> dict:
    """Where a DDMA transfer's CPU time goes, in this process (one thread): trainer rank 0
    packing its buckets (checksum included), the checksum alone, and a generator verifying
    and scattering the same buckets into kept buffers; best of ``reps``."""
    from rl.ddma import checksum, wire

    plan = make_plan(d, SrcLayout(2), DstLayout(2), 4, bucket_mb * MB)
    shards = trainer_shards(model, d, 2, 0)
    mine = plan.sends(0)
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    out = {n: torch.zeros(s) for n, s in plan.dst_shapes.items()}
    best: dict[str, float] = {}
    for _ in range(reps):
        took = dict.fromkeys(("pack", "checksum", "verify", "unpack"), 0.0)
        for b in mine:
            t0 = time.perf_counter()
            msg = wire.pack(buf, plan, b, lambda k, i: shards[(k, i)], torch.float32, 1)
            t1 = time.perf_counter()
            checksum.XXH3(msg[HEADER_BYTES:])
            t2 = time.perf_counter()
            wire.verify(msg, plan, b, 1)
            t3 = time.perf_counter()
            wire.unpack(msg, plan, b, out.__getitem__, torch.float32)
            t4 = time.perf_counter()
            for k, dt in zip(took, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                took[k] += dt
        best = {k: min(v, best.get(k, v)) for k, v in took.items()}
    nbytes = sum(b.nbytes for b in mine)
    res: dict = {"bytes": nbytes, "pieces": sum(len(b.pieces) for b in mine)}
    res.update({f"{k}_s": round(v, 4) for k, v in best.items()})
    res.update({f"{k}_gbps": round(nbytes / v / 1e9, 2) for k, v in best.items()})
    return res


# ---------------------------------------------------------------- part 2: live server
def server_rank(
    model_dir: str, url: str, keys: ServerKeys, bucket_mb: int, reps: int, mode: str, port: int
):
    """mode: "ipc" (DDMA, shared-memory buckets posted through HTTP), "p2p" (DDMA over a
    gloo group the server joins), "p2p_shm" (the same group only signalling, the buckets
    in the trainer ranks' shared-memory rings: rl/ddma/shm.py) or "baseline" (gather to
    rank 0, HF-named buckets through the client). ``keys``: the server's (handed over by
    pickle, never on a command line)."""
    from rl.config.sampling import SamplingParams
    from rl.generator.client import GeneratorClient
    from rl.generator.types import ModelLimits

    path = Path(model_dir)
    d = dims(path)
    rank, tp = dist.get_rank(), dist.get_world_size()
    plan = make_plan(d, SrcLayout(tp), DstLayout.sglang(1, "cpu"), 4, bucket_mb * MB)
    shards = trainer_shards(path, d, tp, rank)
    get = lambda k, i: shards[(k, i)]  # noqa: E731
    transport = mode if mode in DDMA_MODES else "ipc"  # rl/ddma/transports/
    target = SGLangTarget(url, plan, torch.float32, timeout=600, keys=keys, transport=transport)
    limits = ModelLimits.from_model_dir(path)
    client = GeneratorClient([url], limits, keys=keys) if rank == 0 else None
    version = [client.weight_versions()[0] if client else 0]
    dist.broadcast_object_list(version, src=0)  # every trainer rank sends the same version
    p2p = mode.startswith("p2p")
    name = group.group_name(port, 0)
    if p2p:  # this server in a DDMA group of its own with the trainer ranks
        opened = target.open_group(name, "127.0.0.1", port) if rank == 0 else None
        target.sender(rank).join("127.0.0.1", [port], [[0]])
        if opened is not None:
            opened.result()

    buffers = [0]
    steps: list[list[float]] = []  # per sync: begin, transfer, commit (seconds)
    served: list[tuple[float, int]] = []  # ipc: the target's running totals after each sync

    def ddma() -> None:
        version[0] += 1
        t0 = time.perf_counter()
        if rank == 0:
            target.begin(version[0])
        dist.barrier()
        t1 = time.perf_counter()
        received = target.receive(version[0], name) if p2p and rank == 0 else None
        stats = target.push(rank, get, version[0])
        if received is not None:
            received.result()
        buffers[0] = stats.buffer_bytes
        dist.barrier()
        t2 = time.perf_counter()
        if rank == 0:
            target.commit(version[0])
        steps.append([t1 - t0, t2 - t1, time.perf_counter() - t2])
        served.append((target.server_seconds, target.requests))

    def base() -> None:
        version[0] += 1
        named = baseline.gather_hf(get, d, tp, dist.group.WORLD, 0)
        if rank == 0:
            client.update_weights(named, version[0], bucket_bytes=bucket_mb * MB)
        else:
            for _ in named:
                pass

    fn = base if mode == "baseline" else ddma
    fn()  # warm-up
    times, peaks, _ = _timed(fn, reps)
    probe = [[1, 5, 6, 7, 8], [1, 300, 301]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    tokens = [r.output_ids for r in client.generate(probe, greedy)] if client else None
    if client:
        client.close()
    # Where a timed sync's time went (medians; the warm-up's is left out).
    medians = [statistics.median(col) for col in zip(*steps[1:], strict=True)]
    split = dict(zip(("begin", "transfer", "commit"), medians, strict=True)) if medians else {}
    if mode == "ipc" and len(served) > 1:  # this rank's requests, and the server's part
        (s0, n0), (s1, n1) = served[0], served[-1]
        split["transfer_server_side"] = (s1 - s0) / (len(served) - 1)
        split["transfer_requests"] = (n1 - n0) / (len(served) - 1)
    return {
        "rank": rank,
        "s": times,
        "peak_extra": max(peaks),
        "buffers": buffers[0],
        "tokens": tokens,
        "split": split if steps else {},
    }


def memcpy_gbps(nbytes: int = 256 * MB) -> float:
    torch.set_num_threads(1)
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(_time(lambda: b.copy_(a)) for _ in range(5))
    return nbytes / best / 1e9


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def wall(ranks: list[dict], key: str) -> float:
    """Median over repetitions of the slowest rank's time (ranks end on a barrier)."""
    return statistics.median(max(r[key][i] for r in ranks) for i in range(len(ranks[0][key])))


def bandwidth(plan, seconds: float, memcpy: float) -> dict:
    sent = plan.sent_bytes()
    return {
        "bytes_sent": sent,
        "destination_bytes": plan.dst_bytes(),
        "sent_over_destination": round(sent / plan.dst_bytes(), 4),
        "ddma_effective_gbps": round(sent / seconds / 1e9, 3),
        "ddma_bandwidth_over_memcpy": round(sent / seconds / 1e9 / memcpy, 3),
        "bucket_bytes": plan.bucket_bytes,
    }


def live_server(model: Path, d: km.Dims, args, memcpy: float, tmp: str) -> dict:

    from rl.runtime.net import free_port
    from rl.serving.launcher import ServerConfig, ServerLauncher

    plan = make_plan(d, SrcLayout(2), DstLayout.sglang(1, "cpu"), 4, args.bucket_mb * MB)
    out: dict = {"modes": {}}
    cfg = ServerConfig(model_path=str(model), startup_timeout=600)
    logs = Path(args.server_logs or Path(tmp) / "logs")
    with ServerLauncher(cfg, n=1, log_dir=logs) as launcher:
        pid = launcher.servers[0].proc.pid
        tokens = []
        for mode in ("baseline", *DDMA_MODES):
            rss0 = tree_rss_mb(pid)
            reset_peak(pid)
            ranks = spawn(server_rank, 2, str(model), launcher.urls[0], launcher.keys,
                          args.bucket_mb, args.reps, mode, free_port(),
                          timeout_s=1800)  # fmt: skip
            secs = wall(ranks, "s")
            out["modes"][mode] = {
                "s": round(secs, 4),
                "trainer_peak_extra_mb": [round(r["peak_extra"] / MB, 1) for r in ranks],
                # ipc: shared-memory buckets allocated at the first sync and kept (so the
                # timed repetitions add nothing on top); p2p: the engine's two buffers.
                "trainer_transfer_buffers_mb": [round(r["buffers"] / MB, 1) for r in ranks],
                "server_peak_extra_mb": round(tree_peak_rss_mb(pid) - rss0, 1),
            }
            if ranks[0]["split"]:
                split = {k: round(v, 4) for k, v in ranks[0]["split"].items()}
                out["modes"][mode]["split_s"] = split
            tokens.append(ranks[0]["tokens"])
            print(f"live server, {mode}: {secs:.3f}s", flush=True)
        # rollout.weight_sync.staging: each option's peak server memory and sync time.
        out["staging"], served = weight_sync_staging.run(model, launcher, args.bucket_mb,
                                                         args.reps)  # fmt: skip
        tokens += served
    base = out["modes"]["baseline"]["s"]
    for mode in DDMA_MODES:
        out["modes"][mode]["speedup"] = round(base / out["modes"][mode]["s"], 2)
        out["modes"][mode].update(bandwidth(plan, out["modes"][mode]["s"], memcpy))
    out["trainer_shard_mb"] = round(plan.sent_bytes() / 2 / MB, 1)
    # With staging device (the default) the server keeps one copy of its weights from the
    # first DDMA sync on: it shows in the first DDMA mode's server_peak_extra_mb, with the
    # mappings of the trainers' shared buckets for ipc; "staging" compares the options.
    out["server_staging_mb"] = round(plan.dst_bytes(real_only=False) / MB, 1)
    out["same_tokens"] = all(t == tokens[0] for t in tokens)
    return out


def world_summary(ranks: list[dict], d: km.Dims, args, memcpy: float) -> dict:
    """Part 1's figures: the same-host transport (shm) as the headline, gloo beside it."""
    plan = make_plan(d, SrcLayout(2), DstLayout(2), 4, args.bucket_mb * MB)
    times = {m: wall([r[m] for r in ranks], "s") for m in ("baseline", *TRANSPORTS)}
    base = times["baseline"]
    out: dict = {"transport": "shm", "baseline_s": round(base, 4), "transports": {}}
    for m in TRANSPORTS:
        out["transports"][m] = {"ddma_s": round(times[m], 4), "speedup": round(base / times[m], 2),
                                **bandwidth(plan, times[m], memcpy)}  # fmt: skip
    out.update(out["transports"]["shm"])
    out["identical_buffers"] = all(r["identical"] for r in ranks if r["role"] == "generator")
    # A generator rank allocates nothing for shm (it maps the senders' rings, whose pages
    # its VmHWM counts although the memory is the senders').
    out["per_rank"] = [
        {
            "rank": r["rank"],
            "role": r["role"],
            "shard_mb": round(r["shard_bytes"] / MB, 1),
            **{f"{m}_peak_extra_mb": round(r[m]["peak_extra"] / MB, 1) for m in TRANSPORTS},
            **{f"{m}_allocated_mb": round(r[m]["buffer_bytes"] / MB, 1) for m in TRANSPORTS},
            "baseline_peak_extra_mb": round(r["baseline"]["peak_extra"] / MB, 1),
        }
        for r in ranks
    ]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bucket-mb", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--skip-world", action="store_true", help="only the live server")
    ap.add_argument("--server-logs", help="keep the server's log here")
    ap.add_argument("--out", help="default: tools/bench/results/weight_sync[_cuda].json")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: DDMA's device path on cuda:0 against a device copy "
                    "(tools/bench/weight_sync_device.py); nothing else runs")  # fmt: skip
    args = ap.parse_args(argv)
    suffix = "_cuda" if args.device == "cuda" else ""
    args.out = args.out or str(ROOT / f"tools/bench/results/weight_sync{suffix}.json")
    if args.device == "cuda":
        import weight_sync_device

        with tempfile.TemporaryDirectory() as tmp:
            model = make_model(Path(tmp) / "model")
            result = {"benchmark": "weight_sync_device", "model": {**SHAPE, "dtype": "fp32"}}
            result.update(weight_sync_device.run(model, dims(model), args.bucket_mb, args.reps,
                                                 trainer_shards))  # fmt: skip
        write_result(result, args.out)
        return result

    memcpy = memcpy_gbps()
    print(f"memcpy bandwidth (1 thread): {memcpy:.2f} GB/s", flush=True)
    result: dict = {"benchmark": "weight_sync", "memcpy_gbps": round(memcpy, 2)}
    cap = gloo_loopback_gbps()
    result["gloo_loopback_64mb_gbps"] = round(cap, 2)
    result["gloo_loopback_over_memcpy"] = round(cap / memcpy, 3)
    print(f"gloo TCP loopback, one 64 MB send/recv: {cap:.2f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model")
        d = dims(model)
        params = sum(int(torch.Size(s).numel()) for s in km.hf_shapes(d).values())
        result["model"] = {**SHAPE, "params_millions": round(params / 1e6, 1), "dtype": "fp32"}
        print(f"model: {params / 1e6:.1f}M params", flush=True)

        if not args.skip_world:
            result["phases_one_trainer_rank"] = phases(model, d, args.bucket_mb)
            print("phases:", result["phases_one_trainer_rank"], flush=True)
            ranks = spawn(world_rank, 4, str(model), 2, 2, args.bucket_mb, args.reps,
                          timeout_s=1800)  # fmt: skip
            part1 = world_summary(ranks, d, args, memcpy)
            result["megatron_tp2_to_destination_tp2"] = part1
            print(json.dumps(part1, indent=1), flush=True)

        if not args.skip_server:
            result["megatron_tp2_to_live_sglang_tp1"] = live_server(model, d, args, memcpy, tmp)
            print(json.dumps(result["megatron_tp2_to_live_sglang_tp1"], indent=1), flush=True)

    write_result(result, args.out)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.exit(0 if main() else 1)
