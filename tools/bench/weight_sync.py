"""DDMA weight sync vs the gather-to-rank-0 baseline, in one run, on a ~125M-param model.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/weight_sync.py

A random Llama (hidden 768, 12 layers, GQA 12/4, MLP 2048, vocab 32000, fp32) is made
locally. Trainer ranks hold its Megatron TP=2 shards (built with rl.weights.keymap, the
layout the converter tests check against Megatron's own checkpoints).

1. In one gloo world: 2 trainer ranks -> 2 generator ranks that hold buffers in SGLang's
   TP=2 layout. DDMA (rl.ddma.engine) against the baseline (rl.ddma.baseline: gather every
   tensor to trainer rank 0, rename to HF, broadcast everything to every generator rank,
   which cuts out its shard as SGLang's loaders do). Both must leave identical buffers.
2. Into a live SGLang server (TP=1, CPU): DDMA (rl.generator.ddma_target: each trainer rank
   stages its own buckets, then one commit) against the generator client's HF-named
   bucketed update fed by a gather to trainer rank 0. Both must serve the same tokens.
   Then each rollout.weight_sync.staging option (device, host, none) against device:
   the server's peak extra memory and the sync time (tools/bench/weight_sync_staging.py).

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
from pathlib import Path

import torch
import torch.distributed as dist
import weight_sync_staging
from bench_util import peak_mb, reset_peak, rss_mb, tree_peak_rss_mb, tree_rss_mb, write_result

from rl.ddma import baseline, engine
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.dist.launch import spawn
from rl.generator.ddma_target import SGLangTarget
from rl.generator.server_api import ServerKeys
from rl.weights import keymap as km
from rl.weights.hf_config import model_config_from_hf

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20
SHAPE = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def make_model(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(path)
    return path


def dims(model_dir: Path) -> km.Dims:
    cfg = json.loads((model_dir / "config.json").read_text())
    return km.Dims.of(model_config_from_hf(cfg, name="bench", make_vocab_size_divisible_by=128))


def trainer_shards(model_dir: Path, d: km.Dims, tp: int, rank: int) -> dict:
    """This TP rank's Megatron shards (cloned, so the full tensors can be freed)."""
    from safetensors.torch import load_file

    hf = load_file(str(model_dir / "model.safetensors"))
    keys = [(k, i) for i in range(d.layers) for k in km.layer_keys(d)]
    keys += [(k, None) for k in km.global_keys(d)]
    out = {}
    for key, layer in keys:
        full = km.to_megatron(key, [hf[n] for n in km.hf_names(key, d, layer)], d)
        out[(key, layer)] = km.tp_shard(key, full, tp, rank).clone()
    return out


def _timed(fn, reps: int) -> tuple[list[float], list[int]]:
    times, peaks = [], []
    for _ in range(reps):
        dist.barrier()
        me = os.getpid()
        rss0 = rss_mb(me)
        reset_peak(me)
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        peaks.append(int((peak_mb(me) - rss0) * MB))
    return times, peaks


def _digest(tensors: dict) -> float:
    return float(sum(t.double().sum() * (i + 1) for i, t in enumerate(tensors.values())))


# ---------------------------------------------------------------- part 1: gloo world
def world_rank(model_dir: str, tp: int, dst_tp: int, bucket_mb: int, reps: int) -> dict:
    path = Path(model_dir)
    d = dims(path)
    rank = dist.get_rank()
    plan = make_plan(d, SrcLayout(tp), DstLayout(dst_tp), 4, bucket_mb * MB)
    trainers = dist.new_group(list(range(tp)))
    fanout = dist.new_group([0, *range(tp, tp + dst_tp)])
    src_ranks, dst_ranks = list(range(tp)), list(range(tp, tp + dst_tp))
    f32 = torch.float32
    if rank < tp:
        shards = trainer_shards(path, d, tp, rank)
        get = lambda k, i: shards[(k, i)]  # noqa: E731

        def ddma():
            engine.send(plan, rank, get, 1, f32, dist.group.WORLD, dst_ranks)

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

        def ddma():
            engine.receive(plan, me, out.__getitem__, 1, f32, dist.group.WORLD, src_ranks)

        def base():
            hf = baseline.broadcast_hf(None, d, f32, fanout, 0)
            baseline.load_rank(hf, d, DstLayout(dst_tp), me, out.__getitem__)

    ddma()  # warm-up: connections, page faults
    dd_t, dd_peak = _timed(ddma, reps)
    digest_ddma = _digest(out) if rank >= tp else None
    base()
    bl_t, bl_peak = _timed(base, reps)
    digest_base = _digest(out) if rank >= tp else None
    return {
        "rank": rank,
        "role": "trainer" if rank < tp else "generator",
        "ddma_s": dd_t,
        "baseline_s": bl_t,
        "ddma_peak_extra": max(dd_peak),
        "baseline_peak_extra": max(bl_peak),
        "identical": digest_ddma == digest_base,
        "shard_bytes": sum(t.numel() * 4 for t in (shards if rank < tp else out).values()),
    }


# ---------------------------------------------------------------- part 2: live server
def server_rank(
    model_dir: str, url: str, keys: ServerKeys, bucket_mb: int, reps: int, mode: str, port: int
):
    """mode: "ipc" (DDMA, shared-memory buckets), "p2p" (DDMA over a gloo group the server
    joins) or "baseline" (gather to rank 0, HF-named buckets through the client). ``keys``:
    the server's (handed over by pickle, never on a command line)."""
    from rl.config.sampling import SamplingParams
    from rl.ddma import group
    from rl.generator.client import GeneratorClient
    from rl.generator.types import ModelLimits

    path = Path(model_dir)
    d = dims(path)
    rank, tp = dist.get_rank(), dist.get_world_size()
    plan = make_plan(d, SrcLayout(tp), DstLayout.sglang(1, "cpu"), 4, bucket_mb * MB)
    shards = trainer_shards(path, d, tp, rank)
    get = lambda k, i: shards[(k, i)]  # noqa: E731
    target = SGLangTarget(url, plan, torch.float32, timeout=600, keys=keys)
    limits = ModelLimits.from_model_dir(path)
    client = GeneratorClient([url], limits, keys=keys) if rank == 0 else None
    version = [client.weight_versions()[0] if client else 0]
    dist.broadcast_object_list(version, src=0)  # every trainer rank sends the same version
    pg = None
    if mode == "p2p":
        name = f"bench-{port}"
        opened = target.open_group(name, "127.0.0.1", port) if rank == 0 else None
        pg = group.join("127.0.0.1", port, tp + 1, rank, name)
        if opened is not None:
            opened.result()

    buffers = [0]

    def ddma() -> None:
        version[0] += 1
        if rank == 0:
            target.begin(version[0])
        dist.barrier()
        if mode == "p2p":
            received = target.receive(version[0], name) if rank == 0 else None
            stats = target.send(rank, get, version[0], pg)
            if received is not None:
                received.result()
        else:
            stats = target.stage(rank, get, version[0])
        buffers[0] = stats.buffer_bytes
        dist.barrier()
        if rank == 0:
            target.commit(version[0])

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
    times, peaks = _timed(fn, reps)
    probe = [[1, 5, 6, 7, 8], [1, 300, 301]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    tokens = [r.output_ids for r in client.generate(probe, greedy)] if client else None
    if client:
        client.close()
    return {
        "rank": rank,
        "s": times,
        "peak_extra": max(peaks),
        "buffers": buffers[0],
        "tokens": tokens,
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

    from rl.dist.net import free_port
    from rl.generator.launcher import ServerConfig, ServerLauncher

    plan = make_plan(d, SrcLayout(2), DstLayout.sglang(1, "cpu"), 4, args.bucket_mb * MB)
    out: dict = {"modes": {}}
    cfg = ServerConfig(model_path=str(model), startup_timeout=600)
    with ServerLauncher(cfg, n=1, log_dir=Path(tmp) / "logs") as launcher:
        pid = launcher.servers[0].proc.pid
        tokens = []
        for mode in ("baseline", "ipc", "p2p"):
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
            tokens.append(ranks[0]["tokens"])
            print(f"live server, {mode}: {secs:.3f}s", flush=True)
        # rollout.weight_sync.staging: each option's peak server memory and sync time.
        out["staging"], served = weight_sync_staging.run(model, launcher, args.bucket_mb,
                                                         args.reps)  # fmt: skip
        tokens += served
    base = out["modes"]["baseline"]["s"]
    for mode in ("ipc", "p2p"):
        out["modes"][mode]["speedup"] = round(base / out["modes"][mode]["s"], 2)
        out["modes"][mode].update(bandwidth(plan, out["modes"][mode]["s"], memcpy))
    out["trainer_shard_mb"] = round(plan.sent_bytes() / 2 / MB, 1)
    # With staging device (the default) the server keeps one copy of its weights from the
    # first DDMA sync on: it shows in the first DDMA mode's server_peak_extra_mb, with the
    # mappings of the trainers' shared buckets for ipc; "staging" compares the options.
    out["server_staging_mb"] = round(plan.dst_bytes(real_only=False) / MB, 1)
    out["same_tokens"] = all(t == tokens[0] for t in tokens)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bucket-mb", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/weight_sync.json"))
    args = ap.parse_args(argv)

    memcpy = memcpy_gbps()
    print(f"memcpy bandwidth (1 thread): {memcpy:.2f} GB/s", flush=True)
    result: dict = {"benchmark": "weight_sync", "memcpy_gbps": round(memcpy, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model")
        d = dims(model)
        params = sum(int(torch.Size(s).numel()) for s in km.hf_shapes(d).values())
        result["model"] = {**SHAPE, "params_millions": round(params / 1e6, 1), "dtype": "fp32"}
        print(f"model: {params / 1e6:.1f}M params", flush=True)

        ranks = spawn(world_rank, 4, str(model), 2, 2, args.bucket_mb, args.reps, timeout_s=1800)
        plan = make_plan(d, SrcLayout(2), DstLayout(2), 4, args.bucket_mb * MB)
        dd, bl = wall(ranks, "ddma_s"), wall(ranks, "baseline_s")
        part1 = {"ddma_s": round(dd, 4), "baseline_s": round(bl, 4), "speedup": round(bl / dd, 2)}
        part1.update(bandwidth(plan, dd, memcpy))
        part1["identical_buffers"] = all(r["identical"] for r in ranks if r["role"] == "generator")
        part1["per_rank"] = [
            {
                "rank": r["rank"],
                "role": r["role"],
                "shard_mb": round(r["shard_bytes"] / MB, 1),
                "ddma_peak_extra_mb": round(r["ddma_peak_extra"] / MB, 1),
                "ddma_peak_extra_buckets": round(r["ddma_peak_extra"] / plan.bucket_bytes, 2),
                "baseline_peak_extra_mb": round(r["baseline_peak_extra"] / MB, 1),
            }
            for r in ranks
        ]
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
