"""Process checks for the tests: did every process of a server's group go away?"""

from __future__ import annotations

import os
import time

import psutil


def live_group_members(pgid: int) -> list[str]:
    """Processes of group ``pgid`` that are not zombies (a zombie holds no memory, port or
    file; whether PID 1 reaps it promptly depends on the machine's init)."""
    out = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getpgid(p.info["pid"]) != pgid or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
        except (ProcessLookupError, psutil.Error):
            continue
        out.append(f"{p.info['pid']} {p.info['status']} {' '.join(p.info['cmdline'] or [])}")
    return out


def assert_group_gone(pgid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while alive := live_group_members(pgid):
        assert time.monotonic() < deadline, f"processes of group {pgid} outlived it: {alive}"
        time.sleep(0.2)
