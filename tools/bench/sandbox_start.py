"""What the python tool's seccomp filter costs: what the boot spends on it (loading
rl/envs/seccomp.py and installing the filter, timed in a fresh interpreter each round, with
the modules the boot has already loaded); a
run of ``pass`` from ``run_python`` to its result (the boot, the namespaces, the private
root, Landlock and the filter included); and inside a run the time of a system call the
filter lets through. Runs go with the filter and without it (``seccomp`` taken out of
``containment()``), the two alternating so both see the same machine. Besides wall time,
the CPU time each run's processes used (user + system, from ``RUSAGE_CHILDREN``): on a
shared machine it moves far less with the load than the wall clock does.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/sandbox_start.py

Writes tools/bench/results/sandbox_start.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_util import write_result

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rl.envs import sandbox  # noqa: E402

# getppid and stat: one call the kernel's seccomp cache answers without running the
# filter, one whose path lookup dwarfs it; clone (os.fork) is the one whose flags it reads.
CALLS = """import os, time
def per_call_ns(fn, n):
    t = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t) / n
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print(per_call_ns(os.getppid, 200000), per_call_ns(lambda: os.stat("."), 100000),
      per_call_ns(fork, 200))
"""


# ctypes and platform first: the boot has them from landlock.py and private_root.py
INSTALL = """import ctypes, importlib.util, platform, time
t = time.process_time()
spec = importlib.util.spec_from_file_location("f", {path!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.install()
print(time.process_time() - t)
"""


def install_s() -> float:
    from rl.envs import seccomp

    code = INSTALL.format(path=seccomp.__file__)
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    return float(done.stdout)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one(code: str, with_filter: bool, where: tuple[str, ...]) -> tuple[float, float, str]:
    """Wall and CPU seconds of one run of ``code``, and what it printed."""
    kept = where if with_filter else tuple(x for x in where if x != "seccomp")
    sandbox.containment = lambda: kept  # type: ignore[method-assign]
    t, cpu = time.perf_counter(), _children_cpu()
    out = sandbox.run_python(code)
    assert out.ok, out
    return time.perf_counter() - t, _children_cpu() - cpu, out.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    where = sandbox.containment()
    assert "seccomp" in where, where
    installs = [install_s() for _ in range(args.rounds)]
    start: dict[str, list[float]] = {"filter": [], "none": []}
    start_cpu: dict[str, list[float]] = {"filter": [], "none": []}
    calls: dict[str, list[list[float]]] = {"filter": [], "none": []}
    for _ in range(args.rounds):
        for mode in ("filter", "none"):
            wall, cpu, _ = one("pass", mode == "filter", where)
            start[mode].append(wall)
            start_cpu[mode].append(cpu)
    for _ in range(max(args.rounds // 6, 3)):
        for mode in ("filter", "none"):
            calls[mode].append([float(x) for x in one(CALLS, mode == "filter", where)[2].split()])
    median_ms = {m: round(statistics.median(v) * 1e3, 1) for m, v in start.items()}
    cpu_ms = {m: round(statistics.median(v) * 1e3, 1) for m, v in start_cpu.items()}
    per_call = {
        m: {
            name: round(statistics.median(r[i] for r in rows), 1)
            for i, name in enumerate(["getppid_ns", "stat_ns", "fork_ns"])
        }
        for m, rows in calls.items()
    }
    result = {
        "what": "ms from run_python('pass') to its result and CPU ms its processes used, "
        "medians; ns per call inside a run; CPU ms the boot spends loading and installing "
        "the filter",
        "containment": list(where),
        "rounds": args.rounds,
        "load_average": list(os.getloadavg()),
        "install_cpu_ms": round(statistics.median(installs) * 1e3, 2),
        "start_ms": median_ms,
        "start_min_ms": {m: round(min(v) * 1e3, 1) for m, v in start.items()},
        "filter_adds_ms": round(median_ms["filter"] - median_ms["none"], 1),
        "start_cpu_ms": cpu_ms,
        "filter_adds_cpu_ms": round(cpu_ms["filter"] - cpu_ms["none"], 1),
        "per_call": per_call,
    }
    print(result)
    write_result(result, ROOT / "tools/bench/results/sandbox_start.json")


if __name__ == "__main__":
    main()
