"""rl/runtime/lifeline.py on plain processes (no torch, seconds): what a process starts
through multiprocessing (a spawn Manager as Megatron's checkpoint writer starts one, a
spawned, a forked and a forkserver child, and a child of the spawned one) ends when that
process is SIGKILLed; without the lifeline, the same helpers outlive it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import psutil
import pytest

from rl.runtime import lifeline


def _sleep() -> None:
    time.sleep(300)


def _sleep_with_child(pids: mp.Queue) -> None:
    child = mp.get_context("spawn").Process(target=_sleep)
    child.start()
    pids.put(child.pid)
    time.sleep(300)


def _owner(linked: bool, pids: mp.Queue) -> None:
    """Stands in for a rank: starts helpers the way Megatron and the reward executor do."""
    if linked:
        lifeline.install()
    spawn = mp.get_context("spawn")
    manager = spawn.Manager()  # serves until asked to shut down
    pids.put(manager._process.pid)  # type: ignore[attr-defined]
    fork, forkserver = mp.get_context("fork"), mp.get_context("forkserver")
    for ctx, target, args in ((spawn, _sleep_with_child, (pids,)), (fork, _sleep, ()),
                              (forkserver, _sleep, ())):  # fmt: skip
        p = ctx.Process(target=target, args=args)
        p.start()
        pids.put(p.pid)
    time.sleep(300)


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            continue
    return out


@pytest.mark.parametrize("linked", [True, False])
def test_helpers_end_with_the_process_that_started_them(linked: bool) -> None:
    pids: mp.Queue = mp.get_context("spawn").Queue()
    owner = mp.get_context("spawn").Process(target=_owner, args=(linked, pids))
    owner.start()
    helpers = [pids.get(timeout=60) for _ in range(5)]
    try:
        assert _alive(helpers) == helpers
        owner.kill()
        deadline = time.monotonic() + 3  # the lifeline polls every 0.2 s
        while _alive(helpers) and time.monotonic() < deadline:
            time.sleep(0.05)
        if linked:
            assert _alive(helpers) == [], "a helper outlived the SIGKILLed process"
        else:  # the check above can fail: without the lifeline they stay
            assert _alive(helpers) == helpers
    finally:
        for pid in _alive(helpers):
            os.kill(pid, signal.SIGKILL)
        owner.join(timeout=10)
