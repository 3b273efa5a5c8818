"""How long ``rl.runtime.launch.spawn`` takes to start CPU ranks that are ready to work
(torch and the patched Megatron-Core imported, the default gloo group joined): forked from
the fork server of :mod:`rl.runtime.preload` (``fork``) against fresh interpreters
(``spawn``, the baseline: how CUDA ranks start, and how CPU ranks started before).

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/rank_start.py

Each (mode, ranks) case runs in a fresh launcher process, ``--jobs`` jobs one after the
other, so the first job pays for starting the fork server and the later ones show what a
test session or a restarted job pays. The modes alternate over ``--rounds``. Memory: the
proportional set size (PSS: a page shared by n processes counts 1/n in each) of every rank,
summed, read once each rank is ready; forked ranks share the imported modules' pages.
Writes tools/bench/results/rank_start.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("spawn", "fork")


def ready_rank() -> float:
    """What each rank returns: its PSS in MB, once torch, Megatron and gloo are up."""
    import megatron.core  # noqa: F401  what a trainer rank imports first
    import psutil

    return psutil.Process().memory_full_info().pss / 2**20


def one_case(mode: str, ranks: int, jobs: int) -> dict:
    """In this (fresh) process: ``jobs`` spawns of ``ranks`` ranks, each timed."""
    from rl.runtime.launch import spawn

    times, pss = [], []
    for _ in range(jobs):
        t0 = time.perf_counter()
        out = spawn(ready_rank, ranks, fresh=mode == "spawn")
        times.append(round(time.perf_counter() - t0, 3))
        pss.append(round(sum(out)))
    return {"job_s": times, "ranks_pss_mb": max(pss)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=3, help="spawns per launcher process")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--case", nargs=2, metavar=("MODE", "RANKS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/rank_start.json"))
    args = ap.parse_args()
    if args.case:
        print(json.dumps(one_case(args.case[0], int(args.case[1]), args.jobs)))
        return
    from bench_util import write_result

    runs: dict[str, list[dict]] = {f"{m}-{n}": [] for n in args.ranks for m in MODES}
    for i in range(args.rounds):
        for n in args.ranks:
            for m in MODES:
                cmd = [sys.executable, __file__, "--case", m, str(n), "--jobs", str(args.jobs)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                runs[f"{m}-{n}"].append(r)
                print(f"round {i} {m} {n} ranks: jobs {r['job_s']} s, PSS {r['ranks_pss_mb']} MB")
    first = {k: statistics.median(r["job_s"][0] for r in rs) for k, rs in runs.items()}
    later = {k: statistics.median(t for r in rs for t in r["job_s"][1:]) for k, rs in runs.items()}
    result = {
        "what": "seconds for spawn() to return from N ready CPU ranks (torch, Megatron, gloo)",
        "baseline": "spawn: every rank a fresh interpreter",
        "rounds": args.rounds,
        "jobs_per_launcher": args.jobs,
        "first_job_s": first,
        "later_job_s": later,
        "ratio_fork_vs_spawn": {
            f"{n} ranks": {
                "first": round(first[f"fork-{n}"] / first[f"spawn-{n}"], 3),
                "later": round(later[f"fork-{n}"] / later[f"spawn-{n}"], 3),
            }
            for n in args.ranks
        },
        "ranks_pss_mb": {k: max(r["ranks_pss_mb"] for r in rs) for k, rs in runs.items()},
        "runs": runs,
    }
    for n in args.ranks:
        print(f"{n} ranks: first job spawn {first[f'spawn-{n}']:.2f} s, fork "
              f"{first[f'fork-{n}']:.2f} s; later jobs spawn {later[f'spawn-{n}']:.2f} s, "
              f"fork {later[f'fork-{n}']:.2f} s")  # fmt: skip
    write_result(result, args.out)


if __name__ == "__main__":
    main()
