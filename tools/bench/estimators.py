"""The advantage estimators and objectives on the tiny default, measured in one run.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/estimators.py
        [--runs grpo rloo dr_grpo gspo] [--steps 400] [hydra overrides for every run]
    # PPO with a critic against GRPO: tools/bench/results/ppo_critic_cpu.json
    ... estimators.py --runs grpo_clip ppo_gae --out tools/bench/results/ppo_critic_cpu.json

Each run is the README's `make run` job (the tiny arithmetic default: Megatron trainer
TP=2, one SGLang server, DDMA, async with one version of lag, AIPO's correction) from the
same warm-up checkpoint, with the same seeds, prompts and number of RL steps; only the
algorithm differs (RUNS). Reports each run's held-out accuracy at the start and the end
(0-1), its curve, per-step time and the estimator's figures; writes
tools/bench/results/estimators_tiny.json and the curves' plot docs/estimators_tiny_curves.png.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from async_vs_sync import job, summarize
from bench_util import write_result

ROOT = Path(__file__).resolve().parents[2]
RUNS = {
    "grpo": [],  # the default: algorithm=aipo, advantage grpo
    "rloo": ["algorithm/advantage=rloo"],
    "dr_grpo": ["algorithm/advantage=dr_grpo"],  # its loss_agg: seq_mean_token_sum_norm
    "gspo": ["algorithm/objective=gspo", "algorithm/correction=none"],
    "reinforce_pp": ["algorithm/advantage=reinforce_pp"],
    # GRPO as the paper runs it (PPO's clipped ratio, group-normalised advantages) against
    # PPO with a critic: the same objective, GAE's advantages from the critic's values, one
    # sample per prompt and 8x the prompts (the same 256 rows a step).
    "grpo_clip": ["algorithm=grpo"],
    "ppo_gae": [
        "algorithm=grpo",
        "algorithm/advantage=gae",
        "algorithm.group_size=1",
        "rl.prompts_per_step=256",
        "critic=tiny",
    ],
}
FIGURES = (
    "adv_mean",
    "adv_std",
    "adv_zero_frac",
    "seq_clipped_frac",
    "truncated_frac",
    "critic_loss",
    "critic_value_error",
    "critic_vf_clipfrac",
    "critic_step_seconds",
)


def figures(out: Path) -> dict[str, float]:
    """The mean over the RL steps of each estimator and objective figure that was logged."""
    import json

    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["phase"] == "rl"]
    return {k: statistics.mean(r[k] for r in steps) for k in FIGURES if k in steps[0]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in result["runs"].items():
        xs, ys = zip(*run["eval_curve"], strict=True)
        ax.plot(xs, [100 * y for y in ys], marker="o", label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("Tiny default, same warm-up: estimators and objectives")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", default=["grpo", "rloo", "dr_grpo", "gspo"],
                    choices=list(RUNS))  # fmt: skip
    ap.add_argument("--steps", type=int, default=400, help="RL steps per run")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/estimators_tiny.json"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="estimators-"))
    print(f"[bench] warm-up checkpoint (runs in {work})", flush=True)
    warm = work / "warmup"
    warm_s, _ = job(["rl.steps=0", "cluster.roles.generator=0", "cluster.roles.reward=0",
                     *a.overrides], warm)  # fmt: skip
    result: dict = {"steps": a.steps, "overrides": a.overrides, "warmup_s": warm_s, "runs": {}}
    for name in a.runs:
        args = [*a.overrides, *RUNS[name], f"rl.steps={a.steps}",
                f"rl.eval_every={a.eval_every}", "sft.steps=0",
                f"trainer.load_dir={warm}/checkpoint", "trainer.load_optimizer=false"]  # fmt: skip
        print(f"[bench] {name}: {' '.join(RUNS[name]) or 'the default'}", flush=True)
        wall, peak = job(args, work / name)
        s = summarize(work / name)
        run = {
            "overrides": RUNS[name],
            "start_accuracy": s["start_accuracy"],
            "final_accuracy": s["final_accuracy"],
            "gain_points": 100 * (s["final_accuracy"] - s["start_accuracy"]),
            "eval_curve": s["eval_curve"],
            "min_accuracy_after_start": s["min_accuracy_after_start"],
            "step_s": s["step_s"],
            "job_wall_s": wall,
            "peak_rss_mb": peak,
            **figures(work / name),
        }
        result["runs"][name] = run
        print(f"[bench] {name}: held-out {run['start_accuracy']:.1%} -> "
              f"{run['final_accuracy']:.1%} ({run['gain_points']:+.1f} points), "
              f"{run['step_s']:.2f} s/step, {wall:.0f} s", flush=True)  # fmt: skip
        write_result(result, a.out)  # after each run: a long bench keeps what it measured
    plot(result, ROOT / "docs" / f"{Path(a.out).stem}_curves.png")


if __name__ == "__main__":
    main()
