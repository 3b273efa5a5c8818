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


def group_listeners(pgid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket listening in process group
    ``pgid`` (a server behind its guard: the HTTP server, SGLang's scheduler)."""
    out = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(p.info["pid"]) != pgid:
                continue
            conns = p.net_connections(kind="tcp")
        except (ProcessLookupError, psutil.Error):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                out.append((c.laddr.ip, c.laddr.port, p.info["name"]))
    return out


def live_tagged(key: str, value: str) -> list[str]:
    """Live (non-zombie) processes started with ``key=value`` in their environment: every
    descendant of a job started with it inherits it, whatever session or group it moved to
    (ranks lead groups of their own, SGLang servers sessions of their own)."""
    out = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.environ().get(key) != value:
                continue
        except psutil.Error:
            continue
        out.append(f"{p.info['pid']} {' '.join(p.info['cmdline'] or [])[:160]}")
    return out


def tagged_listeners(key: str, value: str) -> set[tuple[str, str]]:
    """(address, process name) of every TCP socket listening in a process started with
    ``key=value`` in its environment (:func:`live_tagged`'s processes)."""
    out = set()
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.environ().get(key) != value:
                continue
            conns = p.net_connections(kind="tcp")
        except psutil.Error:
            continue
        out |= {(c.laddr.ip, p.info["name"]) for c in conns if c.status == psutil.CONN_LISTEN}
    return out


def assert_tagged_gone(key: str, value: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while alive := live_tagged(key, value):
        assert time.monotonic() < deadline, f"processes of the job outlived it: {alive}"
        time.sleep(0.2)
