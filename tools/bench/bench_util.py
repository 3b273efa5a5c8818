"""Shared by the benchmarks: peak-memory readings of process trees, and the result file.

Linux only (``/proc``). The kernel's peak counter (VmHWM) can be reset per process by
writing 5 to ``/proc/PID/clear_refs``, so a benchmark can measure the peak of one phase.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def write_result(result: dict, path: str | Path) -> Path:
    """Add the machine's description and write ``result`` as JSON. Results are kept in the
    repository (tools/bench/results/), so a number is read next to the machine it came from."""
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def _tree(pid: int) -> list[int]:
    import psutil  # here: a GPU machine's image may lack it, and write_result needs none

    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _field_mb(pid: int, field: str) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_mb(pid: int) -> float:
    return _field_mb(pid, "VmHWM")


def rss_mb(pid: int) -> float:
    return _field_mb(pid, "VmRSS")


def tree_peak_rss_mb(pid: int) -> float:
    """Sum of peak RSS (VmHWM) over a process and its children: an upper bound."""
    return sum(_field_mb(p, "VmHWM") for p in _tree(pid))


def tree_rss_mb(pid: int) -> float:
    return sum(_field_mb(p, "VmRSS") for p in _tree(pid))


def reset_peak(pid: int) -> None:
    """Restart the peak counters of a process tree at its current RSS."""
    for p in _tree(pid):
        try:
            Path(f"/proc/{p}/clear_refs").write_text("5")
        except OSError:
            pass
