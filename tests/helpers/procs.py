"""Process checks for the tests: did every process of a server's group go away? And a
tagged RL job run as a user runs it, for the tests that stop or kill one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def tree_listeners(pid: int) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket listening in process ``pid`` or
    one of its descendants (by parent links: SGLang's processes rewrite their environment with
    their titles, so a tag there does not find them)."""
    out: set[tuple[str, int, str]] = set()
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
            name = p.name()
        except psutil.Error:
            continue
        out |= {(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN}
    return out


def run_listening(
    cmd: Sequence[str], cwd: str | os.PathLike[str], env: Mapping[str, str], timeout: float
) -> tuple[subprocess.CompletedProcess, set[tuple[str, int, str]]]:
    """Run ``cmd`` to the end, as ``subprocess.run(capture_output=True, text=True)``, and
    sample every TCP listener of it and of its descendants every 0.5 s meanwhile (a store
    lives as long as its job; reading every process's sockets costs CPU the job needs)."""
    listening: set[tuple[str, int, str]] = set()
    with subprocess.Popen(list(cmd), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:  # fmt: skip
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise subprocess.TimeoutExpired(list(cmd), timeout)
            listening |= tree_listeners(proc.pid)
            time.sleep(0.5)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err), listening


def run_job(overrides: list[str], timeout: float) -> str:
    """``python -m rl.train *overrides`` to its end, as a user runs it; its output (stdout,
    then stderr). Fails the test with the output's tail if the job does."""
    res = subprocess.run(
        [sys.executable, "-m", "rl.train", *overrides],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def no_run_process_left(out: Path, timeout: float = 30.0) -> None:
    """Fail if a process naming the run directory ``out`` on its command line (a server
    and its guard) is still alive ``timeout`` seconds after its job ended."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p.pid for p in psutil.process_iter(["cmdline"])
                if str(out) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
        if not left:
            return
        assert time.monotonic() < deadline, f"processes of the run outlived it: {left}"
        time.sleep(0.5)


def shm_leftovers() -> set[str]:
    """What a run could leave in /dev/shm: multiprocessing's named semaphores (a server's
    tqdm made one that its stop left behind: rl/serving/server_footprint.py) and SGLang's
    load snapshots (the end of a run SIGKILLs each server with its guard, which would
    have unlinked it: rl/serving/launcher.py)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("sem.mp-", "sglang_loads_"))}


def assert_tagged_gone(key: str, value: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while alive := live_tagged(key, value):
        assert time.monotonic() < deadline, f"processes of the job outlived it: {alive}"
        time.sleep(0.2)


class TaggedJob:
    """One `python -m rl.train *args` in a session of its own, every process of it tagged
    in its environment (``key``); its output read as it comes."""

    def __init__(self, out: Path, args: list[str], key: str):
        self.tag, self.key = uuid.uuid4().hex, key
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rl.train", *args, f"run.output_dir={out}"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), key: self.tag},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(s, acc), daemon=True)
            for s, acc in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, acc: list[str]) -> None:
        for line in stream:
            acc.append(line.rstrip("\n"))

    def wait_for(self, pred, what: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{what}: not reached\n" + "\n".join(self.err[-40:]))
            time.sleep(0.2)

    def ended(self, timeout: float) -> float:
        """Seconds until the top process exited (fails past ``timeout``)."""
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout}s of the stop")
        took = time.monotonic() - t0
        for t in self._readers:
            t.join(5)
        return took

    def kill(self) -> None:
        for p in psutil.process_iter():
            try:
                if p.environ().get(self.key) == self.tag:
                    p.kill()
            except psutil.Error:
                pass

    def rank(self, title: str) -> psutil.Process:
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if " ".join(p.cmdline()).startswith(title):
                    return p
            except psutil.Error:
                continue
        raise AssertionError(f"no process titled {title!r}")


def state_step(out: Path) -> int:
    """The RL step of the run's resume point (-1: none yet)."""
    try:
        return int(json.loads((out / "rl_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1
