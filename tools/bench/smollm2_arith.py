"""A real model learning on CPU: SmolLM2-135M-Instruct on generated arithmetic questions.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/smollm2_arith.py \
        [--experiment smollm2_arith_cpu_lora] [overrides]

Prepares the model (tools/make_smollm2.py) and the dataset (tools/make_arith_dataset.py)
where ``experiment=smollm2_arith_cpu`` expects them, runs the experiment as a user would
(`python -m rl.train experiment=smollm2_arith_cpu`), and writes what it measured: the
held-out pass@1 (greedy) and pass@k at the end of the warm-up (RL step 0) and after RL,
the gain in points, the wall time of the whole run and of its phases, the per-step costs
(warm-up step, RL train step, weight sync, whole RL step) and the peak memory of the job's
processes. The run's plot is copied to docs/<experiment>_curves.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from async_vs_sync import job
from bench_util import write_result

ROOT = Path(__file__).resolve().parents[2]


def prepare() -> None:
    for tool, out in (("make_smollm2.py", "models/smollm2-135m-instruct"),
                      ("make_arith_dataset.py", "data/arith")):  # fmt: skip
        if tool == "make_arith_dataset.py" and (ROOT / out / "train.jsonl").exists():
            continue
        subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--out", str(ROOT / out)],
                       check=True, cwd=ROOT)  # fmt: skip


def summarize(out: Path, wall: float, peak: float) -> dict:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in recs if r["phase"] == "warmup"]
    rl = [r for r in recs if r["phase"] == "rl"]
    ev = [r for r in recs if r["phase"] == "rl_eval"]
    start, end = ev[0], ev[-1]
    k = next((key for key in start if key.startswith("eval_pass@")), None)
    mean_k = k.replace("pass@", "mean@") if k else None
    timed = [r for r in rl if "eval_accuracy" not in r]
    return {
        "start_pass@1": start["eval_accuracy"],
        "final_pass@1": end["eval_accuracy"],
        "best_pass@1": max(r["eval_accuracy"] for r in ev),
        "gain_points": 100 * (end["eval_accuracy"] - start["eval_accuracy"]),
        **({f"start_{k[5:]}": start[k], f"final_{k[5:]}": end[k]} if k else {}),
        **({f"start_{mean_k[5:]}": start[mean_k], f"final_{mean_k[5:]}": end[mean_k]} if k else {}),
        "eval_curve_columns": ["step", "pass@1", k[5:] if k else None, mean_k[5:] if k else None],
        "eval_curve": [
            [r["step"], r["eval_accuracy"], r.get(k or ""), r.get(mean_k or "")] for r in ev
        ],
        "warmup_steps": len(warm),
        "warmup_step_s": statistics.mean(r["step_seconds"] for r in warm) if warm else 0.0,
        "warmup_end_s": warm[-1]["time"] if warm else 0.0,
        "rl_steps": len(rl),
        "rl_step_s": statistics.mean(r["step_s"] for r in timed),
        "rl_train_s": statistics.mean(r["train_s"] for r in timed),
        "rl_sync_s": statistics.mean(r["sync_s"] for r in timed),
        "rl_wait_batch_s": statistics.mean(r["wait_batch_s"] for r in timed),
        "uniform_groups_skipped": rl[-1].get("uniform_skipped_total", 0.0),
        "reward_mean_first10": statistics.mean(r["reward_mean"] for r in rl[:10]),
        "reward_mean_last10": statistics.mean(r["reward_mean"] for r in rl[-10:]),
        "job_wall_s": wall,
        "peak_rss_mb": peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experiment", default="smollm2_arith_cpu",
                    choices=["smollm2_arith_cpu", "smollm2_arith_cpu_lora"])  # fmt: skip
    ap.add_argument("--out", help="default: tools/bench/results/<experiment>.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the run")
    a = ap.parse_args()
    prepare()
    run = Path(tempfile.mkdtemp(prefix="smollm2-arith-")) / "run"
    print(f"[bench] experiment={a.experiment} in {run} (log: {run.with_suffix('.log')})")
    wall, peak = job([f"experiment={a.experiment}", *a.overrides], run)
    result = {"experiment": a.experiment, "overrides": a.overrides, **summarize(run, wall, peak)}
    shutil.copy(run / "curves.png", ROOT / "docs" / f"{a.experiment}_curves.png")
    print(
        f"[bench] held-out pass@1 {result['start_pass@1']:.3f} -> {result['final_pass@1']:.3f} "
        f"({result['gain_points']:+.1f} points) in {wall / 60:.1f} min; peak RSS {peak:.0f} MB"
    )
    write_result(result, a.out or ROOT / "tools/bench/results" / f"{a.experiment}.json")


if __name__ == "__main__":
    main()
