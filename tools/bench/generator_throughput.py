"""Rollout throughput of the generator executor vs one request at a time, in one run.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/generator_throughput.py

Both modes hit the same SGLang server(s), started here from a random Llama made locally,
with the same sampling settings (temperature 1, logprobs on, no early stop):

* baseline: the plain way to call a server, one ``/generate`` request at a time;
* executor: ``GeneratorClient.submit`` for every sample of every prompt at once, with
  rollouts streamed back as they finish (the server batches whatever is in flight).

Prints tokens/s of each, their ratio, the time to the first finished rollout, and peak
memory (this process, and each server's process tree); writes the same as JSON.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_util import tree_peak_rss_mb, write_result
from common import llama_shape, make_llama

from rl.config.sampling import SamplingParams
from rl.generator.client import GeneratorClient
from rl.serving import server_api as api
from rl.serving.launcher import ServerConfig, ServerLauncher

ROOT = Path(__file__).resolve().parents[2]


SHAPE = llama_shape(hidden=256, ffn=688, layers=4, heads=8, kv_heads=4, vocab=1024)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (n)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--baseline-requests", type=int, default=24)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--server-threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/generator_throughput.json"))
    args = ap.parse_args(argv)

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 1024, (args.prompts, args.prompt_len), generator=g).tolist()
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True, n=args.samples
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = make_llama(Path(tmp) / "model", SHAPE)
        cfg = ServerConfig(model_path=str(model), threads=args.server_threads)
        t0 = time.perf_counter()
        with ServerLauncher(cfg, n=args.servers, log_dir=Path(tmp) / "logs") as launcher:
            startup = time.perf_counter() - t0
            print(f"{args.servers} server(s) up in {startup:.1f}s", flush=True)
            with GeneratorClient.for_launcher(launcher) as client:
                client.generate([prompts[0]], SamplingParams(max_new_tokens=4))  # warm up

                # Baseline: one request at a time, straight to the server.
                sp = sampling.to_sglang(args.max_new_tokens, None)
                n_base, tokens = args.baseline_requests, 0
                t = time.perf_counter()
                for i in range(n_base):
                    call = api.generate([prompts[i % len(prompts)]], [sp])
                    url = launcher.urls[i % args.servers]
                    out = api.call(url, call, launcher.keys, timeout=600)
                    tokens += len(out["output_ids"])
                base_s = time.perf_counter() - t
                base_tps = tokens / base_s
                print(f"baseline: {n_base} requests, {tokens} tokens in {base_s:.2f}s "
                      f"= {base_tps:,.0f} tok/s", flush=True)  # fmt: skip

                # Executor: everything in flight, streamed back as it finishes.
                t = time.perf_counter()
                futures = [f for p in prompts for f in client.submit(p, sampling)]
                first, tokens, done = None, 0, 0
                for r in client.as_completed(futures):
                    first = first if first is not None else time.perf_counter() - t
                    tokens += len(r.output_ids)
                    done += 1
                exec_s = time.perf_counter() - t
                exec_tps = tokens / exec_s
                print(
                    f"executor: {done} rollouts, {tokens} tokens in {exec_s:.2f}s = "
                    f"{exec_tps:,.0f} tok/s (first rollout after {first:.2f}s)",
                    flush=True,
                )
                server_mb = [tree_peak_rss_mb(s.proc.pid) for s in launcher.servers]

    result = {
        "benchmark": "generator_throughput",
        "workload": {
            "prompts": args.prompts,
            "samples_per_prompt": args.samples,
            "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens,
            "baseline_requests": args.baseline_requests,
            "servers": args.servers,
            "model": "random Llama, hidden 256, 4 layers, GQA 8/4, vocab 1024, fp32",
        },
        "baseline_one_at_a_time": {"tokens_per_s": round(base_tps, 1), "seconds": base_s},
        "executor": {
            "tokens_per_s": round(exec_tps, 1),
            "seconds": exec_s,
            "first_rollout_s": first,
            "rollouts": done,
        },
        "speedup": round(exec_tps / base_tps, 2),
        "peak_rss_mb": {
            "client": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "servers": server_mb,
        },
        "server_startup_s": startup,
    }
    print(f"speedup executor / one-at-a-time: {result['speedup']:.2f}x; peak RSS client "
          f"{result['peak_rss_mb']['client']:.0f} MB, servers "
          f"{', '.join(f'{m:.0f}' for m in server_mb)} MB")  # fmt: skip
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
