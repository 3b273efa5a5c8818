"""RL from a reward model on the tiny default: a Bradley-Terry model trained on the task's
(right, wrong) answer pairs, then the policy trained on its scores alone.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/reward_model.py
        [--steps 400] [--pairs 40000] [hydra overrides for the RL run]

1. the README's warm-up (``rl.steps=0``): the policy, exported to HF;
2. the reward model's decoder: the same tiny architecture, supervised on the task's
   answers for ``--rm-sft-steps`` (the policy's warm-up stops at 30% accuracy, well short
   of that), exported to HF: a judge stronger than the policy is a solver, as reward models
   usually are;
3. ``tools/train_reward_model.py`` from that decoder with a fresh scalar head, on
   ``--pairs`` pairs of training problems (the held-out problems are never among them):
   the right answer against the policy's own wrong one, sampled from the warm-up;
4. the README's `make run` job from the policy's warm-up with ``reward_model=cpu
   reward.fn=model`` and a KL penalty to the warm-up policy (``--kl``): the trained reward
   is the model's normalised score, never the rule's; the held-out accuracy is measured by
   the exact-match rule. Without the penalty the policy drifts to wrong answers the reward
   model ranks above the right one, and its accuracy falls (measured in
   docs/data-rewards-environments.md#reward-model).

Writes tools/bench/results/reward_model_cpu.json (``start_accuracy``, ``final_accuracy``:
held out, 0-1, and ``job_wall_s``) and docs/reward_model_cpu_curves.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from async_vs_sync import export_hf, job, plot_run, rl_records, summarize
from bench_util import write_result

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400, help="RL steps")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--pairs", type=int, default=40000, help="Bradley-Terry pairs")
    ap.add_argument("--rm-sft-steps", type=int, default=2000)
    ap.add_argument("--kl", type=float, default=0.1, help="algorithm.kl_coef of the RL run")
    ap.add_argument("--sampled", type=float, default=1.0,
                    help="the fraction of wrong answers sampled from the policy")  # fmt: skip
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/reward_model_cpu.json"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the RL run")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reward-model-"))
    print(f"[bench] warm-up checkpoint (runs in {work})", flush=True)
    warm = work / "warmup"
    warm_s, _ = job(["rl.steps=0", "cluster.roles.generator=0", "cluster.roles.reward=0"], warm)
    export_hf(warm / "checkpoint", work / "warm_hf")
    print(f"[bench] the reward model's decoder: {a.rm_sft_steps} supervised steps", flush=True)
    t0 = time.perf_counter()
    base = work / "rm_base"
    job(["rl.steps=0", "cluster.roles.generator=0", "cluster.roles.reward=0",
         f"sft.steps={a.rm_sft_steps}", "sft.stop_at_accuracy=null", "sft.eval_every=500"],
        base)  # fmt: skip
    base_accuracy = rl_records(base, "warmup_eval")[-1]["eval_accuracy"]
    export_hf(base / "checkpoint", work / "rm_base_hf")
    print("[bench] Bradley-Terry reward model", flush=True)
    rm = work / "reward_model"
    subprocess.run(
        [sys.executable, str(ROOT / "tools/train_reward_model.py"), "--init",
         str(work / "rm_base_hf"), "--negatives-from", str(work / "warm_hf"), "--out", str(rm),
         "--arithmetic", str(a.pairs), "--sampled", str(a.sampled), "--epochs",
         str(a.epochs), "--lr", str(a.lr), "--log-every", "200"],
        check=True, cwd=ROOT,
    )  # fmt: skip
    rm_s = time.perf_counter() - t0
    stats = json.loads((rm / "reward_stats.json").read_text())
    args = ["reward_model=cpu", f"reward_model.hf_checkpoint={rm}", "reward.fn=model",
            f"algorithm.kl_coef={a.kl}", f"rl.steps={a.steps}", f"rl.eval_every={a.eval_every}",
            "sft.steps=0",
            f"trainer.load_dir={warm}/checkpoint", "trainer.load_optimizer=false",
            *a.overrides]  # fmt: skip
    print(f"[bench] RL on the reward model's score: {' '.join(args)}", flush=True)
    wall, peak = job(args, work / "rl")
    s = summarize(work / "rl")
    recs = rl_records(work / "rl")
    result = {
        "steps": a.steps,
        "overrides": args,
        "warmup_s": warm_s,
        "reward_model": {
            "decoder_sft_steps": a.rm_sft_steps,
            "decoder_greedy_accuracy": base_accuracy,
            "negatives_sampled_from_policy": a.sampled,
            "pairs": stats["pairs"],
            "held_out_pairs": stats["held_out_pairs"],
            "held_out_pair_accuracy": stats["pair_accuracy"],
            "train_steps": stats["steps"],
            "train_s": rm_s,
            "score_mean": stats["mean"],
            "score_std": stats["std"],
        },
        "start_accuracy": s["start_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "gain_points": 100 * (s["final_accuracy"] - s["start_accuracy"]),
        "eval_curve": s["eval_curve"],
        "reward_model_mean_first20": sum(r["reward_model_mean"] for r in recs[:20]) / 20,
        "reward_model_mean_last20": sum(r["reward_model_mean"] for r in recs[-20:]) / 20,
        "step_s": s["step_s"],
        "job_wall_s": wall,
        "peak_rss_mb": peak,
    }
    write_result(result, a.out)
    right = {"reward_model_mean": "reward model (normalised)",
             "accuracy": "rule's pass rate of the samples"}  # fmt: skip
    plot_run(result["eval_curve"], recs, right, ("Trained on the reward model's score alone",
             "Training samples"), ROOT / "docs" / f"{Path(a.out).stem}_curves.png")  # fmt: skip
    print(f"[bench] held-out {result['start_accuracy']:.1%} -> {result['final_accuracy']:.1%} "
          f"({result['gain_points']:+.1f} points), {s['step_s']:.2f} s/step, {wall:.0f} s; "
          f"reward model: held-out pair accuracy {stats['pair_accuracy']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
