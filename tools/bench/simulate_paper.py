"""The step-time simulator on the LlamaRL paper's three settings, next to the paper's table.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/simulate_paper.py

Runs ``rl.simulate`` on experiment=llama3_8b_256gpu, llama3_70b_512gpu and
llama3_405b_1024gpu with the one hardware profile of conf/cluster/slurm.yaml, and writes
tools/bench/results/simulate_paper.json: per preset the predicted sync and async step
times, the speedup, the paper's numbers and the per-phase breakdown, and every assumption
with its source. tests/presets/test_simulate_paper.py checks the committed file against
what the simulator says now. A prediction, not a measurement: no baseline is timed here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench_util import write_result  # noqa: E402

PRESETS = ("llama3_8b_256gpu", "llama3_70b_512gpu", "llama3_405b_1024gpu")
GOAL = 0.15  # each predicted speedup within 15% of the paper's


def result() -> dict:
    from rl.compose import compose
    from rl.simulate.report import to_json
    from rl.simulate.simulation import simulate

    presets, assumed = {}, None
    for name in PRESETS:
        cfg = compose([f"experiment={name}"])
        t0 = time.perf_counter()
        sim = simulate(cfg)
        out = to_json(sim, cfg)
        out["simulate_s"] = round(time.perf_counter() - t0, 3)
        assumed = out.pop("assumptions")
        presets[name] = out
    return {
        "benchmark": "simulate_paper",
        "goal": f"each predicted speedup within {GOAL:.0%} of the paper's",
        "presets": presets,
        "within_goal": {n: abs(p["speedup_error"]) <= GOAL for n, p in presets.items()},
        "assumptions": assumed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/simulate_paper.json"))
    a = ap.parse_args()
    r = result()
    for name, p in r["presets"].items():
        print(
            f"{name}: sync {p['sync']['step_s']:.1f} s, async {p['async']['step_s']:.1f} s -> "
            f"{p['speedup']:.2f}x (paper {p['paper']['speedup']:.2f}x, "
            f"{p['speedup_error']:+.0%})"
        )
    write_result(r, a.out)


if __name__ == "__main__":
    main()
