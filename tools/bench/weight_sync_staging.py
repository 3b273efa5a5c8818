"""The live-server part of tools/bench/weight_sync.py for ``rollout.weight_sync.staging``:
what each option costs the server in memory and the sync in time. Also runs alone, on a
server of its own (the same ~125M-param model):

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/weight_sync_staging.py

Two trainer ranks (Megatron TP=2 shards) push the same weights over ipc DDMA with each
option in turn, in one world, so the trainers' shared-memory buckets are mapped by the
server once, before any option is measured. For each option the server first takes one
sync with staging ``none``, which frees (and returns to the OS) whatever copy the option
before held; then its process tree's peak counters are reset, and a warm-up sync (which
allocates the copy and faults its pages in) and ``reps`` timed syncs run. Reported per
option: the server's peak extra memory (the tree's VmHWM above its RSS before the
warm-up), the bytes its receiver holds for staging (its own count of its tensors), the
median sync time, both as ratios to ``device`` (today's behaviour) measured in the same
run, and the tokens the server then generates greedily (the same for every option).
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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from bench_util import reset_peak, tree_peak_rss_mb, tree_rss_mb, write_result

from rl.config.sglang import WEIGHT_STAGINGS
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.generator.ddma_target import SGLangTarget
from rl.runtime.launch import spawn
from rl.weights.keymap import Dims

if TYPE_CHECKING:
    from rl.serving.launcher import ServerLauncher
    from rl.serving.server_api import ServerKeys

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20
PROBE = [[1, 5, 6, 7, 8], [1, 300, 301]]


def staging_rank(
    model_dir: str, url: str, keys: ServerKeys, pid: int, bucket_mb: int, reps: int
) -> dict:
    """One trainer rank; rank 0 also plays the controller and reads the server's memory
    (``pid``: the server's main process)."""
    from weight_sync import dims, trainer_shards

    from rl.config.sampling import SamplingParams
    from rl.generator.client import GeneratorClient
    from rl.generator.types import ModelLimits

    path = Path(model_dir)
    d = dims(path)
    rank, tp = dist.get_rank(), dist.get_world_size()
    plan = make_plan(d, SrcLayout(tp), DstLayout.sglang(1, "cpu"), 4, bucket_mb * MB)
    shards = trainer_shards(path, d, tp, rank)
    target = SGLangTarget(url, plan, torch.float32, timeout=600, keys=keys)
    lead = rank == 0
    client = GeneratorClient([url], ModelLimits.from_model_dir(path), keys=keys) if lead else None
    version = [client.weight_versions()[0] if client else 0]
    dist.broadcast_object_list(version, src=0)  # every trainer rank sends the same version

    def sync(staging: str) -> float:
        version[0] += 1
        target.staging = staging
        dist.barrier()
        t0 = time.perf_counter()
        if lead:
            target.begin(version[0])
        dist.barrier()
        target.push(rank, lambda k, i: shards[(k, i)], version[0])
        dist.barrier()
        if lead:
            target.commit(version[0])
        dist.barrier()
        return time.perf_counter() - t0

    out: dict = {}
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    for staging in WEIGHT_STAGINGS:
        sync("none")  # frees the previous option's copy
        rss0 = tree_rss_mb(pid)
        if lead:
            reset_peak(pid)
        sync(staging)  # warm-up: the copy is allocated and its pages faulted in here
        times = [sync(staging) for _ in range(reps)]
        if client is not None:
            (state,) = target.receivers  # as the last commit reported it
            out[staging] = {
                "s": round(statistics.median(times), 4),
                "server_peak_extra_mb": round(tree_peak_rss_mb(pid) - rss0, 1),
                "receiver_staging_mb": round(state["staging_bytes"] / MB, 1),
                "tokens": [r.output_ids for r in client.generate(PROBE, greedy)],
            }
    if client is not None:
        client.close()
    return out


def summarize(per_option: dict, weights_bytes: int) -> dict:
    """Ratios to ``device`` and whether every option served the same tokens."""
    base = per_option["device"]
    out: dict = {"server_weights_mb": round(weights_bytes / MB, 1), "options": {}}
    for staging, r in per_option.items():
        out["options"][staging] = {
            "s": r["s"],
            "s_over_device": round(r["s"] / base["s"], 2),
            "server_peak_extra_mb": r["server_peak_extra_mb"],
            "peak_extra_over_device": round(
                r["server_peak_extra_mb"] / max(base["server_peak_extra_mb"], 1e-9), 3
            ),
            "receiver_staging_mb": r["receiver_staging_mb"],
        }
    tokens = [r["tokens"] for r in per_option.values()]
    out["same_tokens"] = all(t == tokens[0] for t in tokens)
    return out


def run(model: Path, launcher: ServerLauncher, bucket_mb: int, reps: int) -> tuple[dict, list]:
    """Every option on the launcher's (only) server: the summary, and the tokens served
    after each option (for the caller's same-tokens check)."""
    server = launcher.servers[0]
    assert server.proc is not None
    ranks = spawn(staging_rank, 2, str(model), server.url, launcher.keys, server.proc.pid,
                  bucket_mb, reps, timeout_s=1800)  # fmt: skip
    plan = make_plan(_dims(model), SrcLayout(2), DstLayout.sglang(1, "cpu"), 4, bucket_mb * MB)
    out = summarize(ranks[0], plan.dst_bytes(real_only=False))
    for staging, r in out["options"].items():
        print(f"live server, staging {staging}: {r['s']:.3f}s ({r['s_over_device']}x device), "
              f"server peak extra {r['server_peak_extra_mb']} MB, receiver holds "
              f"{r['receiver_staging_mb']} MB", flush=True)  # fmt: skip
    return out, [r["tokens"] for r in ranks[0].values()]


def _dims(model: Path) -> Dims:
    from weight_sync import dims  # late: weight_sync imports this module

    return dims(model)


def main(argv: list[str] | None = None) -> dict:
    from weight_sync import SHAPE, make_model

    from rl.serving.launcher import ServerConfig, ServerLauncher

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bucket-mb", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/weight_sync_staging.json"))
    args = ap.parse_args(argv)
    result: dict = {"benchmark": "weight_sync_staging", "model": {**SHAPE, "dtype": "fp32"}}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model")
        cfg = ServerConfig(model_path=str(model), startup_timeout=600)
        with ServerLauncher(cfg, n=1, log_dir=Path(tmp) / "logs") as launcher:
            result["megatron_tp2_to_live_sglang_tp1"], _ = run(
                model, launcher, args.bucket_mb, args.reps
            )
    print(json.dumps(result, indent=1), flush=True)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.exit(0 if main() else 1)
