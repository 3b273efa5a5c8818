"""How a spawned job ends when a rank dies, a thread in one dies, or the launcher is told to
stop: within seconds, one error naming the rank, and no process of the job left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rl.runtime import tree
from rl.runtime.launch import RankFailed, spawn
from tests.helpers.spawn_workers import fail, finish_leaving_children, started_as

ROOT = Path(__file__).resolve().parents[2]


def _names(r: int) -> str:
    return f"worker rank {r}"


def _children(run_dir: Path) -> list[int]:
    return [int(x) for f in run_dir.glob("children.*") for x in f.read_text().split()]


def _assert_gone(pids: list[int], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]  # fmt: skip
        if not alive:
            return
        assert time.monotonic() < deadline, f"outlived the job: {alive}"
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("sigkill", "worker rank 1 was killed by SIGKILL (exited with code -9)"),
        ("exit", "worker rank 1 exited with code 3 without reporting a result"),
        ("raise", "worker rank 1 failed:\nTraceback"),
        ("thread", "worker rank 1: thread 'replies' died:\nTraceback"),
        ("protocol", "worker rank 1: thread 'replies' died: ProtocolError: reward/out: a reply "
                     "to request 7, which is not pending"),
        ("protocol_raise", "worker rank 1 failed: ProtocolError: reward/out: a reply to "
                           "request 7, which is not pending"),
    ],
)  # fmt: skip
def test_a_dying_rank_fails_the_job_in_seconds_with_its_name_and_last_lines(tmp_path, how, message):
    with pytest.raises(RankFailed) as err:
        spawn(fail, 3, str(tmp_path), 1, how, setup=False, names=_names)
    took = time.time() - float((tmp_path / "died_at").read_text())
    text = str(err.value)
    assert text.startswith(message), text
    if how.startswith("protocol"):  # the message is the whole story: one line
        assert text == message
    else:
        assert "last lines of worker rank 1:" in text and f"last words before {how}" in text
    assert "then also" not in text  # the others were waiting, not failing
    if how == "raise":
        assert "ValueError: a bad value in the victim" in text
    if how == "thread":
        assert "RuntimeError: the reply thread met a malformed message" in text
    assert took < 5, took  # the other ranks would have waited 120 s
    # The victim's Manager and grandchild (orphans once it died) went with it.
    assert len(_children(tmp_path)) == 2
    _assert_gone(_children(tmp_path))
    assert not tree.descendants(tree.multiprocessing_servers())


def test_a_finished_job_returns_at_once_and_leaves_nothing(tmp_path):
    t0 = time.monotonic()
    assert spawn(finish_leaving_children, 2, str(tmp_path), setup=False) == [0, 1]
    assert time.monotonic() - t0 < 20
    assert len(_children(tmp_path)) == 4
    _assert_gone(_children(tmp_path))


def test_cpu_ranks_fork_ready_with_the_launchers_environment_of_now(monkeypatch):
    """CPU ranks come from the fork server with Megatron imported and patched, yet see the
    launcher's environment as it is when they start, not as it was when the server did."""
    var = "MSRL_TEST_RANK_ENV"
    monkeypatch.setenv(var, "before")
    spawn(started_as, 1, var)  # the fork server is up, with "before" in its environment
    monkeypatch.setenv(var, "now")
    forked = spawn(started_as, 2, var, setup=False)
    assert [r["value"] for r in forked] == ["now", "now"]
    assert all(r["megatron"] and r["patched"] for r in forked), forked
    assert all(r["parent"] == forked[0]["parent"] for r in forked)
    assert all(r["title"] == "msrl:test:0" for r in forked)
    monkeypatch.delenv(var)
    (fresh,) = spawn(started_as, 1, var, setup=False, fresh=True)
    assert fresh["value"] is None  # unset in the launcher: unset in the rank
    assert not fresh["megatron"] and not fresh["patched"]
    assert fresh["parent"] == os.getpid() and fresh["title"] == "msrl:test:0"
    # fresh_ranks: those alone start fresh (a job's generator ranks), the others forked.
    mixed = spawn(started_as, 3, var, setup=False, fresh_ranks=[1])
    assert [r["megatron"] for r in mixed] == [True, False, True], mixed
    assert mixed[1]["parent"] == os.getpid() != mixed[0]["parent"] == mixed[2]["parent"]


def _waiting_job(run_dir: Path) -> subprocess.Popen:
    """A launcher in a session of its own whose three ranks wait, once they all do."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.spawn_workers", str(run_dir)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while len(list(run_dir.glob("ready.*"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_stops_every_rank_with_one_line(tmp_path, sig, code):
    proc = _waiting_job(tmp_path)
    ranks = psutil.Process(proc.pid).children(recursive=True)
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    name = signal.Signals(sig).name
    assert lines[0].startswith(f"stopped by {name} in "), lines
    assert lines[0].endswith(
        "3 ranks, 0 SGLang servers, 9 processes in all; saved: nothing (a test)"
    )
    assert took < 5, took
    _assert_gone([p.pid for p in ranks] + _children(tmp_path))


def test_a_launcher_killed_alone_takes_its_ranks_with_it(tmp_path):
    """SIGKILL to the launcher only (no handler runs): its fork server sees it gone and
    exits, and each rank, forked from that server, gets SIGTERM from the kernel, and its
    Manager goes with it. (A plain grandchild outlives it: no subreaper is left to sweep.)"""
    proc = _waiting_job(tmp_path)
    sleepers = {int(f.read_text().split()[1]) for f in tmp_path.glob("children.*")}
    job = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(job) >= 9  # resource tracker, fork server, 3 ranks, their Managers, sleepers
    proc.kill()
    proc.wait(timeout=10)  # not communicate(): the sleepers hold its output pipes open
    try:
        _assert_gone([p for p in job if p not in sleepers], timeout=10)
    finally:
        for pid in sleepers:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def test_a_job_killed_whole_leaves_nothing_in_dev_shm(tmp_path):
    """SIGKILL to every process of a job at once (an OOM kill of its cgroup, scancel's
    last step), resource tracker included: nothing of the launcher's is left in
    /dev/shm. Its result queue left three named semaphores so."""
    before = set(os.listdir("/dev/shm"))
    proc = _waiting_job(tmp_path)
    job = [p for p in psutil.process_iter() if _session(p) == proc.pid]
    assert len(job) >= 5  # the launcher, its resource tracker, three ranks (and theirs)
    for p in job:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.communicate(timeout=10)
    _assert_gone([p.pid for p in job])
    assert set(os.listdir("/dev/shm")) - before == set()


def _session(p: psutil.Process) -> int:
    try:
        return os.getsid(p.pid)
    except OSError:
        return -1
