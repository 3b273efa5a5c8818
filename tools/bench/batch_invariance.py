"""Does SGLang on this CPU give a request the same tokens and log-probs whatever it is
batched with? The question a deterministic RL run depends on, measured.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/batch_invariance.py

One SGLang server (SmolLM2-135M-Instruct, fp32, as the learning experiment serves it),
16 arithmetic questions in its chat template, 32 new tokens each (EOS ignored, so every
answer runs the full length). Each question is generated three ways and compared with
itself, token ids and per-token log-probs bit for bit:

* alone: one request at a time;
* batched: the 16 together;
* mixed: the 16 in reverse order among 16 other questions (another batch composition).

Twice: greedy, and sampled at temperature 1 with per-request seeds (SGLang's
``sampling_seed``, from ``rollout.sampling.seed``: rl/generator/types.py; a CPU server
honours them through rl/serving/cpu_seeds.py). Then the same on a server started with
SGLang's ``--enable-deterministic-inference`` (refused on CPU: its error is recorded),
with the batched throughput of both measured in this run. Writes
tools/bench/results/batch_invariance.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench_util import write_result

from rl.config.sampling import SamplingParams
from rl.generator.client import GeneratorClient
from rl.serving.cpu_batch_invariant import BATCH_INVARIANT_ENV
from rl.serving.launcher import ServerConfig, ServerError, ServerLauncher

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models/smollm2-135m-instruct"


def questions(tok_dir: Path, n: int, offset: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    out = []
    for i in range(offset, offset + n):
        q = f"What is {17 + 7 * i} plus {29 + 3 * i}? Answer with the number only."
        msgs = [{"role": "system", "content": "You are a calculator."},
                {"role": "user", "content": q}]  # fmt: skip
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
        out.append(ids if isinstance(ids, list) else ids["input_ids"])
    return out


def compare(a: list, b: list) -> dict:
    """How far the runs ``b`` are from ``a`` (per question: (ids, logprobs))."""
    same_ids = sum(x[0] == y[0] for x, y in zip(a, b, strict=True))
    # Log-probs compared where the tokens still agree (after a split they score others).
    diffs = []
    for (ia, la), (ib, lb) in zip(a, b, strict=True):
        k = next((i for i, (u, v) in enumerate(zip(ia, ib, strict=True)) if u != v), len(ia))
        diffs += [abs(u - v) for u, v in zip(la[:k], lb[:k], strict=True)]
    return {
        "same_tokens": same_ids,
        "of": len(a),
        "bit_equal_logprobs": all(d == 0 for d in diffs),
        "max_abs_logprob_diff": max(diffs, default=0.0),
    }


def measure(client: GeneratorClient, target: list[list[int]], other: list[list[int]],
            sampling: SamplingParams) -> tuple[dict, float]:  # fmt: skip
    def run(prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        return [(r.output_ids, r.logprobs) for r in client.generate(prompts, sampling)]

    alone = [run([p])[0] for p in target]
    t0 = time.perf_counter()
    batched = run(target)
    tokens_per_s = sum(len(ids) for ids, _ in batched) / (time.perf_counter() - t0)
    mixed_prompts = [x for pair in zip(other, reversed(target), strict=True) for x in pair]
    mixed = run(mixed_prompts)[1::2][::-1]
    return {"batched_vs_alone": compare(alone, batched),
            "mixed_vs_alone": compare(alone, mixed),
            "batched_tokens_per_s": tokens_per_s}, tokens_per_s  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/batch_invariance.json"))
    args = ap.parse_args(argv)
    if not (MODEL / "config.json").exists():
        import subprocess

        subprocess.run([sys.executable, str(ROOT / "tools/make_smollm2.py"), "--out", str(MODEL)],
                       check=True)  # fmt: skip
    target = questions(MODEL, args.questions, 0)
    other = questions(MODEL, args.questions, 100)
    n = args.max_new_tokens
    modes = {
        "greedy": SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True),
        "sampled_seeded": SamplingParams(max_new_tokens=n, ignore_eos=True, seed=1234),
    }
    result: dict = {"model": "smollm2-135m-instruct", "dtype": "float32",
                    "questions": args.questions, "max_new_tokens": n}  # fmt: skip
    invariant = {BATCH_INVARIANT_ENV: "1"}
    servers = (
        ("default", (), {}),
        ("deterministic", ("--enable-deterministic-inference",), {}),
        ("batch_invariant", (), invariant),
        ("batch_invariant_no_radix_cache", ("--disable-radix-cache",), invariant),
    )
    for server, extra, env in servers:
        cfg = ServerConfig(model_path=str(MODEL), dtype="float32", threads=1,
                           max_total_tokens=16384, context_length=512,
                           extra_args=extra, env=env)  # fmt: skip
        with tempfile.TemporaryDirectory() as logs:
            try:
                with ServerLauncher(cfg, n=1, log_dir=Path(logs)) as launcher:
                    with GeneratorClient.for_launcher(launcher) as client:
                        client.generate([target[0]], SamplingParams(max_new_tokens=2))  # warm-up
                        out = {m: measure(client, target, other, s)[0] for m, s in modes.items()}
                    launcher.stop(grace=0)
            except ServerError as e:
                lines = [x for x in str(e).splitlines() if x.strip()]
                out = {"error": lines[0], "log_tail": lines[-3:]}
        result[server] = out
        print(f"[bench] {server}: {out}", flush=True)
    base = result["default"]["greedy"]["batched_tokens_per_s"]
    for server, _, _ in servers[1:]:
        if "error" not in result[server]:
            tps = result[server]["greedy"]["batched_tokens_per_s"]
            result[f"{server}_throughput_ratio"] = tps / base
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
