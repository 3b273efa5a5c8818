"""A CPU server's rollouts with its attention batched (rl/serving/cpu_batched_attention.py)
and with SGLang's per-request loop, in one run.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/batched_attention.py

One server at a time on the main job's model shape (conf/model/tiny.yaml) and server
settings (conf/rollout/cpu.yaml: one thread, fp32), ``max_running_requests`` 256,
alternately with the patch off (``BATCHED_ATTENTION_ENV=0``) and on, ``--repeats`` servers
each (the machine's load drifts; alternating spreads it over both). Each serves the same
rounds of 256 seeded requests (fresh short random prompts each round, 4 new tokens,
temperature 1) as one ``/generate``, after a warm-up round. Prints and writes tokens/s and
the scheduler's CPU seconds per token (user + system of the ``sglang::scheduler``
process), medians over every round of a mode (and its fastest round's tokens/s: wall
time on a shared machine), their ratios to the loop's, whether the
last servers of both modes sampled the same tokens with the same log-probs (the CPU
servers' seeded draw depends only on a request's seed and position), and peak memory.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from bench_util import tree_peak_rss_mb, write_result
from common import llama_shape, make_llama

from rl.serving import server_api as api
from rl.serving.cpu_batched_attention import BATCHED_ATTENTION_ENV
from rl.serving.launcher import ServerConfig, ServerLauncher

ROOT = Path(__file__).resolve().parents[2]
# conf/model/tiny.yaml
SHAPE = llama_shape(hidden=192, ffn=512, layers=4, heads=6, kv_heads=2, vocab=32, max_positions=64)


def scheduler(root: int) -> psutil.Process:
    procs = psutil.Process(root).children(recursive=True)
    return next(p for p in procs if "sglang::scheduler" in " ".join(p.cmdline()))


def round_prompts(r: int, n: int, longest: int) -> list[list[int]]:
    """Round ``r``'s prompts, fresh each round (a round's prompts are not all in the
    radix cache already), the same in both servers."""
    g = torch.Generator().manual_seed(r)
    lens = torch.randint(longest // 2, longest + 1, (n,), generator=g)
    return [torch.randint(3, 32, (int(k),), generator=g).tolist() for k in lens]


def serve(model: Path, logs: Path, batched: bool, args: argparse.Namespace) -> dict:
    """Rounds of ``args.requests`` requests on a fresh server: each round's figures, the
    server's peak memory, and the last round's tokens and log-probs."""
    sampling = [
        {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True,
         "sampling_seed": 1000 + i}
        for i in range(args.requests)
    ]  # fmt: skip
    cfg = ServerConfig(
        model_path=str(model), threads=args.threads, max_running_requests=args.requests,
        env={} if batched else {BATCHED_ATTENTION_ENV: "0"},
    )  # fmt: skip
    rounds: list[dict] = []
    with ServerLauncher(cfg, n=1, log_dir=logs) as launcher:
        url, pid = launcher.urls[0], launcher.servers[0].proc.pid
        sched = scheduler(pid)
        for r in range(args.rounds + 1):  # round 0 warms up
            prompts = round_prompts(r, args.requests, args.prompt_len)
            cpu0, t0 = sum(sched.cpu_times()[:2]), time.perf_counter()
            out = api.call(url, api.generate(prompts, sampling), launcher.keys, timeout=600)
            wall, cpu = time.perf_counter() - t0, sum(sched.cpu_times()[:2]) - cpu0
            results = api.generate_results(out, len(prompts))
            tokens = sum(len(x["output_ids"]) for x in results)
            if r:
                rounds.append({"seconds": round(wall, 4), "scheduler_cpu_s": round(cpu, 2),
                               "tokens": tokens})  # fmt: skip
        server_mb = tree_peak_rss_mb(pid)
    sampled = [
        (x["output_ids"], [lp[0] for lp in x["meta_info"]["output_token_logprobs"]])
        for x in results
    ]
    return {"rounds": rounds, "server_peak_rss_mb": round(server_mb), "sampled": sampled}


def summary(servers: list[dict]) -> dict:
    """Medians over every round of every server of one mode, and its fastest round (the
    one least slowed by the machine's other work)."""
    rounds = [x for s in servers for x in s["rounds"]]
    tps = [x["tokens"] / x["seconds"] for x in rounds]
    return {
        "tokens_per_s": round(statistics.median(tps), 1),
        "tokens_per_s_fastest_round": round(max(tps), 1),
        "scheduler_cpu_ms_per_token": round(
            1e3 * statistics.median(x["scheduler_cpu_s"] / x["tokens"] for x in rounds), 4
        ),
        "server_peak_rss_mb": max(s["server_peak_rss_mb"] for s in servers),
        "rounds_by_server": [s["rounds"] for s in servers],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=12, help="longest prompt; shortest half")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per server")
    ap.add_argument("--repeats", type=int, default=2, help="servers per mode, alternating")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/batched_attention.json"))
    args = ap.parse_args(argv)

    runs: dict[str, list[dict]] = {"loop": [], "batched": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_llama(Path(tmp) / "model", SHAPE)
        for i in range(args.repeats):
            for mode in runs:
                one = serve(model, Path(tmp) / f"logs_{mode}_{i}", mode == "batched", args)
                runs[mode].append(one)
                s = summary([one])
                print(f"{mode} server {i}: {s['tokens_per_s']:,.0f} tok/s, scheduler "
                      f"{s['scheduler_cpu_ms_per_token']:.3f} CPU ms/token",
                      flush=True)  # fmt: skip

    a, b = runs["loop"][-1]["sampled"], runs["batched"][-1]["sampled"]
    same = [x[0] == y[0] for x, y in zip(a, b, strict=True)]
    diff = max(
        (abs(p - q) for x, y in zip(a, b, strict=True) if x[0] == y[0]
         for p, q in zip(x[1], y[1], strict=True)),
        default=0.0,
    )  # fmt: skip
    loop, batched = summary(runs["loop"]), summary(runs["batched"])
    result = {
        "benchmark": "batched_attention",
        "workload": {
            "requests": args.requests,
            "prompt_len": f"{args.prompt_len // 2}-{args.prompt_len}",
            "new_tokens": args.new_tokens,
            "rounds_per_server": args.rounds,
            "servers_per_mode": args.repeats,
            "server_threads": args.threads,
            "max_running_requests": args.requests,
            "model": "random Llama of conf/model/tiny.yaml's shape: hidden 192, 4 layers, "
            "GQA 6/2, vocab 32, fp32",
        },
        "loop": loop,
        "batched": batched,
        "tokens_per_s_ratio": round(batched["tokens_per_s"] / loop["tokens_per_s"], 2),
        "fastest_round_tokens_per_s_ratio": round(
            batched["tokens_per_s_fastest_round"] / loop["tokens_per_s_fastest_round"], 2
        ),
        "scheduler_cpu_per_token_ratio": round(
            batched["scheduler_cpu_ms_per_token"] / loop["scheduler_cpu_ms_per_token"], 3
        ),
        "last_round_same_tokens": f"{sum(same)}/{len(same)}",
        "last_round_max_logprob_diff": diff,
        "client_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    print(f"batched / loop: {result['tokens_per_s_ratio']:.2f}x tokens/s (fastest rounds "
          f"{result['fastest_round_tokens_per_s_ratio']:.2f}x), "
          f"{result['scheduler_cpu_per_token_ratio']:.3f}x scheduler CPU per token; same "
          f"tokens {result['last_round_same_tokens']}, log-probs within {diff:.1e}; peak RSS "
          f"servers {loop['server_peak_rss_mb']} / {batched['server_peak_rss_mb']} MB, "
          f"client {result['client_peak_rss_mb']} MB")  # fmt: skip
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
