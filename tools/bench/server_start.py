"""How long a CPU SGLang server takes to become ready: as SGLang starts it (``spawn``: its
scheduler and detokenizer spawned), with them forked (``fork``: rl/serving/cpu_fork.py),
and as this project starts it (``lean``: forked, no Megatron-Core imported,
rl/serving/cpu_no_megatron.py, and only the checkpoint's model modules,
rl/serving/model_modules.py).

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/server_start.py

A tiny random Llama (the test suite's shape) served with one thread, started ``--rounds`` times
in each mode, the modes alternating so both see the same machine: seconds from the
launcher's start to a healthy server, then one greedy request whose tokens must be equal
in both modes. Peak memory: the sum of the server tree's peak RSS while it is up.
Writes tools/bench/results/server_start.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_util import tree_peak_rss_mb, write_result

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common import TINY, make_llama  # noqa: E402

from rl.config.sampling import SamplingParams  # noqa: E402
from rl.generator.client import GeneratorClient  # noqa: E402
from rl.serving.cpu_fork import FORK_ENV  # noqa: E402
from rl.serving.cpu_no_megatron import ALLOW_ENV  # noqa: E402
from rl.serving.launcher import ServerConfig, ServerLauncher  # noqa: E402
from rl.serving.model_modules import DISABLED_ENV  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
# The environment each mode's server inherits (None: unset). An empty skip list is SGLang's
# default: every model module imported.
MODES: dict[str, dict[str, str | None]] = {
    "spawn": {FORK_ENV: "0", ALLOW_ENV: "1", DISABLED_ENV: ""},
    "fork": {FORK_ENV: "1", ALLOW_ENV: "1", DISABLED_ENV: ""},
    "lean": {FORK_ENV: "1", ALLOW_ENV: None, DISABLED_ENV: None},
}


def start_once(model: Path, mode: str, logs: Path) -> dict:
    for var, value in MODES[mode].items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    t0 = time.perf_counter()
    with ServerLauncher(ServerConfig(model_path=str(model), threads=1), n=1, log_dir=logs) as s:
        ready = time.perf_counter() - t0
        peak = tree_peak_rss_mb(s.servers[0].proc.pid)
        with GeneratorClient.for_launcher(s) as client:
            ids = client.generate([[1, 5, 6, 7]], GREEDY)[0].output_ids
        s.stop(grace=0)
    return {"ready_s": round(ready, 2), "peak_rss_mb": round(peak), "ids": ids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/server_start.json"))
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_llama(Path(tmp) / "tiny", TINY)
        for i in range(args.rounds):
            for mode in runs:
                r = start_once(model, mode, Path(tmp) / f"logs-{mode}-{i}")
                runs[mode].append(r)
                print(f"{mode} round {i}: ready in {r['ready_s']} s, {r['peak_rss_mb']} MB")
    ids = {tuple(r["ids"]) for rs in runs.values() for r in rs}
    if len(ids) != 1:
        raise SystemExit(f"the modes served different tokens: {ids}")
    med = {m: statistics.median(r["ready_s"] for r in rs) for m, rs in runs.items()}
    result = {
        "what": "seconds from ServerLauncher start to a healthy tiny CPU server, median",
        "baseline": "spawn (SGLang's start method)",
        "rounds": args.rounds,
        "ready_s": med,
        "ratio_fork_vs_spawn": round(med["fork"] / med["spawn"], 3),
        "ratio_lean_vs_spawn": round(med["lean"] / med["spawn"], 3),
        "ratio_lean_vs_fork": round(med["lean"] / med["fork"], 3),
        "peak_rss_mb": {m: max(r["peak_rss_mb"] for r in rs) for m, rs in runs.items()},
        "same_tokens": True,
        "runs": runs,
    }
    print(f"ready: spawn {med['spawn']:.1f} s, fork {med['fork']:.1f} s, lean "
          f"{med['lean']:.1f} s (x{result['ratio_lean_vs_spawn']} of spawn)")  # fmt: skip
    write_result(result, args.out)


if __name__ == "__main__":
    main()
