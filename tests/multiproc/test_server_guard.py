"""The server guard on plain shell processes (no SGLang, seconds): a crashed child's strays,
a child that ignores SIGTERM, and a SIGKILLed owner all end with an empty process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from rl.serving.launcher import GUARD
from tests.helpers.procs import assert_group_gone, live_group_members


def _guard(cmd: list[str], grace: float = 1.0) -> subprocess.Popen:
    argv = [sys.executable, "-I", str(GUARD), "--owner", str(os.getpid()), "--grace", str(grace)]
    return subprocess.Popen([*argv, "--", *cmd], start_new_session=True)


def _wait_for_members(pgid: int, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(live_group_members(pgid)) < n:
        assert time.monotonic() < deadline, live_group_members(pgid)
        time.sleep(0.05)


def test_crashed_child_takes_its_strays_and_the_exit_code_is_passed_on():
    g = _guard(["sh", "-c", "sleep 300 & wait"])  # the background sleep would outlive sh
    _wait_for_members(g.pid, 3)  # guard, sh, sleep
    (sh,) = psutil.Process(g.pid).children()
    os.kill(sh.pid, signal.SIGKILL)
    assert g.wait(timeout=20) == -signal.SIGKILL
    assert_group_gone(g.pid, timeout=10)


def test_stop_escalates_to_sigkill_for_a_child_that_ignores_sigterm():
    g = _guard(["sh", "-c", "trap '' TERM; sleep 300 & wait"], grace=1.0)
    _wait_for_members(g.pid, 3)
    t0 = time.monotonic()
    g.send_signal(signal.SIGTERM)
    assert g.wait(timeout=20) == -signal.SIGKILL  # the child was killed after the grace
    assert 1.0 <= time.monotonic() - t0 < 15
    assert_group_gone(g.pid, timeout=10)


def test_child_that_exits_cleanly_on_sigterm_gives_a_clean_stop():
    g = _guard(["sleep", "300"], grace=10.0)
    _wait_for_members(g.pid, 2)
    g.send_signal(signal.SIGTERM)
    assert g.wait(timeout=20) == -signal.SIGTERM  # sleep died of the forwarded SIGTERM
    assert_group_gone(g.pid, timeout=10)


_OWNER = """
import os, subprocess, sys, time
guard, grace = sys.argv[1], sys.argv[2]
argv = [sys.executable, "-I", guard, "--owner", str(os.getpid()), "--grace", grace, "--"]
g = subprocess.Popen([*argv, "sh", "-c", "sleep 300 & wait"], start_new_session=True)
print(g.pid, flush=True)
time.sleep(300)
"""


def test_sigkilled_owner_stops_the_guarded_process_group():
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(GUARD), "1.0"], stdout=subprocess.PIPE, text=True
    )
    try:
        pgid = int(owner.stdout.readline())
        _wait_for_members(pgid, 3)
        owner.kill()  # no Python runs in the owner: only the kernel's parent-death signal
        owner.wait(timeout=10)
        assert_group_gone(pgid, timeout=15)
    finally:
        owner.kill()


def test_a_taken_port_is_refused_before_the_server_starts(tmp_path):
    """``--listen``: a port someone listens on is refused in milliseconds with the words
    the launcher looks for, and the command never runs; a free one (or one left in
    TIME_WAIT) lets it run."""
    import socket

    ran = tmp_path / "ran"
    argv = [sys.executable, "-I", str(GUARD), "--owner", str(os.getpid()), "--listen"]

    def guard(port: int) -> subprocess.CompletedProcess:
        cmd = [*argv, f"127.0.0.1:{port}", "--", "sh", "-c", f"touch {ran}"]
        # A group of its own: the guard sweeps its whole group when its child is done.
        return subprocess.run(cmd, capture_output=True, text=True, start_new_session=True)

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        res = guard(port)
    assert res.returncode == 1 and not ran.exists()
    assert res.stdout == f"server_guard: cannot bind 127.0.0.1:{port}: address already in use\n"
    res = guard(port)
    assert res.returncode == 0 and ran.exists(), res.stdout
