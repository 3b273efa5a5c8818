"""A vision-language policy learning on CPU: the tiny Qwen2.5-VL counting squares.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/vision_cpu.py [overrides]

Makes the model and the dataset (tools/make_tiny_vision.py) where ``experiment=tiny_vision``
expects them, runs the experiment as a user would (`python -m rl.train
experiment=tiny_vision`), and writes tools/bench/results/vision_cpu.json: the held-out
greedy accuracy at the end of the warm-up (RL step 0, ``start_accuracy``) and after RL
(``final_accuracy``), the gain in points against the goal of +15, the job's wall time
(``job_wall_s``, against the goal of 20 minutes), the per-step costs and the peak memory of
the job's processes. The run's plot is copied to docs/tiny_vision_curves.png.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from async_vs_sync import job
from bench_util import write_result
from smollm2_arith import summarize

ROOT = Path(__file__).resolve().parents[2]
GOAL_POINTS, GOAL_WALL_S = 15.0, 20 * 60.0


def prepare() -> None:
    if (ROOT / "models/tiny-vl/config.json").exists() and (ROOT / "data/shapes").exists():
        return
    subprocess.run([sys.executable, str(ROOT / "tools/make_tiny_vision.py"), "--model-out",
                    str(ROOT / "models/tiny-vl"), "--data-out", str(ROOT / "data/shapes")],
                   check=True, cwd=ROOT)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/vision_cpu.json"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the run")
    a = ap.parse_args()
    prepare()
    run = Path(tempfile.mkdtemp(prefix="tiny-vision-")) / "run"
    print(f"[bench] experiment=tiny_vision in {run} (log: {run.with_suffix('.log')})")
    wall, peak = job(["experiment=tiny_vision", *a.overrides], run)
    s = summarize(run, wall, peak)
    gain = s["gain_points"]
    result = {
        "experiment": "tiny_vision",
        "overrides": a.overrides,
        "start_accuracy": s["start_pass@1"],
        "final_accuracy": s["final_pass@1"],
        "goal": f">= +{GOAL_POINTS:g} points in <= {GOAL_WALL_S / 60:g} min",
        "goal_met": gain >= GOAL_POINTS and wall <= GOAL_WALL_S,
        **s,
    }
    shutil.copy(run / "curves.png", ROOT / "docs" / "tiny_vision_curves.png")
    print(
        f"[bench] held-out accuracy {result['start_accuracy']:.3f} -> "
        f"{result['final_accuracy']:.3f} ({gain:+.1f} points) in {wall / 60:.1f} min; "
        f"peak RSS {peak:.0f} MB; goal met: {result['goal_met']}"
    )
    write_result(result, a.out)


if __name__ == "__main__":
    main()
