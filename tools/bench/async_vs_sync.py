"""Asynchronous vs synchronous RL on the same tiny workload, measured in one run.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/async_vs_sync.py [--steps 100]
        [--splits split default] [--lags 1 2] [hydra overrides for every run]

Both modes run the real job (`python -m rl.train`: Megatron trainer, SGLang server, DDMA,
reward ranks) with the same config, the same warm-up checkpoint, the same prompts (the
task's seeded sampler) and the same number of samples and steps; only ``rl.mode``
differs. sync is the DeepSpeed-Chat-like baseline (generate -> score -> train -> push
weights, in sequence); async lets the generator sample the next batch with the previous
policy while the trainer trains (AIPO corrects the one-step lag).

Two hardware splits of this 2-core machine are measured:
* ``split``: trainer TP=1 and a one-thread SGLang server, each executor on a core of its
  own, like LlamaRL's separate trainer and generator GPUs;
* ``default``: the embedded default's TP=2 trainer, whose two ranks already take both
  cores, so in async mode the executors compete for the same cores.

``--lags``: async runs at each lag bound k (``algorithm.max_policy_lag``); sync is run
once. ``--correction``: async runs with each off-policy correction (``algorithm.correction``:
aipo, tis, icepop, none), to show what a correction buys at a large lag; besides the final
accuracy, each run reports its training stability (the held-out accuracy at every
``--eval-every`` steps and its lowest value after the start, the worst grad norm, the
largest importance ratio and the train-vs-rollout mismatch). Reports per-step time (mean
over the RL steps after the first few), its ratio, the idle fractions of trainer and
generator, the held-out accuracy at the end, and the peak memory of the whole job (sum
of RSS over its processes); writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_util import tree_rss_mb, write_result

ROOT = Path(__file__).resolve().parents[2]
SPLITS = {"split": ["trainer.tp=1"], "default": []}
SKIP = 3  # first steps: caches warm up, the async pipeline fills


def job(args: list[str], out: Path) -> tuple[float, float]:
    """Run the RL job; return (wall seconds, peak summed RSS in MB of its processes)."""
    cmd = [sys.executable, "-m", "rl.train", *args, f"run.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        peak = [0.0]

        def sample() -> None:
            while proc.poll() is None:
                peak[0] = max(peak[0], tree_rss_mb(proc.pid))
                time.sleep(0.5)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        code = proc.wait()
        watcher.join()
    if code:
        tail = out.with_suffix(".log").read_text().splitlines()[-30:]
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n" + "\n".join(tail))
    return time.perf_counter() - t0, peak[0]


def summarize(out: Path) -> dict:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["phase"] == "rl"]
    evals = [r for r in recs if r["phase"] == "rl_eval"]
    timed = [r for r in steps[SKIP:] if "eval_accuracy" not in r]

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in timed)

    def phase(key: str) -> float | None:  # logged since the phase timings were added
        return mean(key) if all(key in r for r in timed) else None

    return {
        "step_s": mean("step_s"),
        "step_s_stdev": statistics.stdev(r["step_s"] for r in timed),
        "train_s": mean("train_s"),
        "sync_s": mean("sync_s"),
        "wait_batch_s": mean("wait_batch_s"),
        "trainer_idle_frac": mean("trainer_idle_frac"),
        "gen_idle_frac": mean("gen_idle_frac"),
        "lag_mean": mean("lag_mean"),
        "reward_mean_last20": statistics.mean(r["reward_mean"] for r in steps[-20:]),
        "start_accuracy": evals[0]["eval_accuracy"],
        "final_accuracy": evals[-1]["eval_accuracy"],
        "eval_curve": [[r["step"], r["eval_accuracy"]] for r in evals],
        "min_accuracy_after_start": min(r["eval_accuracy"] for r in evals[1:]),
        "grad_norm_max": max(r["grad_norm"] for r in steps),
        "grad_norm_mean": statistics.mean(r["grad_norm"] for r in steps),
        "is_ratio_max": max(r["is_ratio"] for r in steps),
        "mismatch_abs_logp_mean": statistics.mean(r["mismatch_abs_logp"] for r in steps),
        "lag_max": max(r["lag_max"] for r in steps),
        # Per-phase costs of a step, for the step-time model (rl/simulate): the servers'
        # busy seconds per batch (in async mode the weight sync's pause is inside it), a
        # group's wait for its rewards, the batch's assembly, the trainer call as the
        # controller sees it (the batch's transfer included), the sync's parts (pause and
        # open, the trainer ranks' transfer, commit) and what remains of the step.
        "gen_s": phase("gen_busy_s"),
        "reward_s": phase("reward_s"),
        "assemble_s": phase("assemble_s"),
        "train_call_s": phase("train_call_s"),
        "sync_begin_s": phase("sync_begin_s"),
        "sync_send_s": phase("sync_send_s"),
        "sync_commit_s": phase("sync_commit_s"),
        "overhead_s": phase("overhead_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="RL steps per mode")
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    ap.add_argument(
        "--lags", nargs="+", type=int, default=[1], help="async runs at these lag bounds k"
    )
    ap.add_argument(
        "--correction",
        nargs="+",
        default=["aipo"],
        choices=["aipo", "tis", "icepop", "none"],
        help="async runs with each of these off-policy corrections",
    )
    ap.add_argument("--eval-every", type=int, default=0, help="held-out eval interval (0: end)")
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/async_vs_sync.json"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="async-vs-sync-"))
    print(f"[bench] warm-up checkpoint (runs in {work})", flush=True)
    warm = work / "warmup"
    job(["rl.steps=0", "cluster.roles.generator=0", "cluster.roles.reward=0", *a.overrides], warm)
    result: dict = {"steps": a.steps, "lags": a.lags, "corrections": a.correction,
                    "overrides": a.overrides, "splits": {}}  # fmt: skip
    asyncs = [(k, c) for k in a.lags for c in a.correction]
    for split in a.splits:
        runs = {}
        # sync, then async at each lag bound k (the first is the headline "async").
        for name, mode, lag, corr in [("sync", "sync", 0, a.correction[0])] + [
            (_name(i, k, c, len(a.correction)), "async", k, c) for i, (k, c) in enumerate(asyncs)
        ]:
            args = [
                *SPLITS[split],
                *a.overrides,
                f"rl.mode={mode}",
                f"rl.steps={a.steps}",
                f"rl.eval_every={a.eval_every or a.steps}",
                f"algorithm/correction={corr}",
                "sft.steps=0",
                f"trainer.load_dir={warm}/checkpoint",
                "trainer.load_optimizer=false",
            ]
            if mode == "async":
                args.append(f"algorithm.max_policy_lag={lag}")
            print(f"[bench] {split}: {name}, {a.steps} steps", flush=True)
            wall, peak = job(args, work / f"{split}-{name}")
            runs[name] = {
                **summarize(work / f"{split}-{name}"),
                "job_wall_s": wall,
                "peak_rss_mb": peak,
            }
        s = runs["sync"]
        for name in [n for n in runs if n.startswith("async")]:
            y = runs[name]
            y["speedup_per_step"] = s["step_s"] / y["step_s"]
            y["accuracy_gap_points"] = 100 * (y["final_accuracy"] - s["final_accuracy"])
            print(
                f"[bench] {split}: sync {s['step_s']:.3f} s/step, {name} {y['step_s']:.3f} "
                f"s/step -> {y['speedup_per_step']:.2f}x; idle trainer "
                f"{s['trainer_idle_frac']:.0%} -> {y['trainer_idle_frac']:.0%}, generator "
                f"{s['gen_idle_frac']:.0%} -> {y['gen_idle_frac']:.0%}; final accuracy "
                f"{s['final_accuracy']:.3f} vs {y['final_accuracy']:.3f}; peak RSS "
                f"{s['peak_rss_mb']:.0f} / {y['peak_rss_mb']:.0f} MB",
                flush=True,
            )
        result["splits"][split] = runs
    write_result(result, a.out)


def _name(i: int, lag: int, correction: str, corrections: int) -> str:
    """The first async run is "async"; the others name what differs."""
    if corrections > 1:
        return f"async_k{lag}_{correction}"
    return "async" if i == 0 else f"async_k{lag}"


if __name__ == "__main__":
    main()


def rl_records(out: Path, phase: str = "rl") -> list[dict]:
    """The ``phase`` records of a run's metrics.jsonl, in order."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["phase"] == phase]


def export_hf(checkpoint: Path, out: Path) -> Path:
    """A run's Megatron checkpoint as an HF directory (tools/convert_mcore_to_hf.py)."""
    cmd = [sys.executable, str(ROOT / "tools/convert_mcore_to_hf.py"), "--ckpt",
           str(checkpoint), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return out


def plot_run(
    curve: list, records: list[dict], right: dict[str, str], titles: tuple[str, str],
    path: Path, hline: tuple[float, str] | None = None,
) -> None:  # fmt: skip
    """Two panels: the held-out accuracy curve (``hline``: a reference level and its
    label), and each ``right`` metric (key: label) of the RL steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    xs, ys = zip(*curve, strict=True)
    ax.plot(xs, [100 * y for y in ys], marker="o", label="held-out accuracy (exact match)")
    if hline is not None:
        ax.axhline(100 * hline[0], color="gray", ls="--", label=hline[1])
    ax.set_xlabel("RL step")
    ax.set_ylabel("%")
    ax.set_title(titles[0])
    ax.grid(alpha=0.3)
    ax.legend()
    steps = [r["step"] for r in records]
    for key, label in right.items():
        bx.plot(steps, [r[key] for r in records], label=label)
    bx.set_xlabel("RL step")
    bx.set_title(titles[1])
    bx.grid(alpha=0.3)
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
