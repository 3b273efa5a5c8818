"""A user's tool runs in worker processes (rl/envs/tool_worker.py): what it returns, prints
or raises comes back as an observation, cut to its limit; a call that never returns is
answered as a timeout and its worker killed, so nothing is left running however many
calls overrun."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest

from rl.envs.sandbox import Limits
from rl.envs.toolcall import ToolCall
from rl.envs.tools import load_tools, run_tool, worker_pool

TOOLS = '''
import time

def hang(seconds: int) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long.
    """
    print("a print that must not reach the protocol")
    time.sleep(seconds)
    return f"slept {seconds}"


def crash(size: int) -> str:
    """Raise a long message.

    Args:
        size: Its length.
    """
    raise RuntimeError("x" * size)
'''


@pytest.fixture()
def tools(tmp_path: Path):
    path = tmp_path / "user_tools.py"
    path.write_text(TOOLS)
    limits = Limits(wall_s=0.3, output_chars=500)
    loaded = load_tools([f"{path}:hang", f"{path}:crash"], limits)
    yield loaded
    for tool in loaded.values():
        if (pool := worker_pool(tool)) is not None:
            pool.close()


def _workers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "rl.envs.tool_worker" in " ".join(p.cmdline())]  # fmt: skip


def test_a_users_tool_answers_from_a_worker_and_its_text_is_cut(tools):
    out = run_tool(tools, ToolCall("hang", {"seconds": 0}))
    assert (out.status, out.text) == ("ok", "slept 0")
    workers = _workers()
    assert len(workers) == 1  # one worker, reused by the next call
    assert run_tool(tools, ToolCall("hang", {"seconds": 0})).text == "slept 0"
    assert _workers() == workers
    out = run_tool(tools, ToolCall("crash", {"size": 5000}))
    assert out.status == "error"
    assert out.text.startswith("error: 'crash' raised RuntimeError: xxx")
    assert len(out.text) < 560 and out.text.endswith(" more characters]")  # 500 + the cut
    assert "[cut: 4536 more characters]" in out.text  # 5036 - 500


def test_calls_that_never_return_leave_nothing_behind(tools):
    """50 calls of a tool that sleeps an hour, 5 at a time (as an episode's workers make
    them): each is a timeout, and no thread or process of theirs is left."""
    threads = threading.active_count()
    took: list[float] = []

    def five_by_ten() -> None:
        for _ in range(10):
            t0 = time.monotonic()
            out = run_tool(tools, ToolCall("hang", {"seconds": 3600}))
            took.append(time.monotonic() - t0)
            assert (out.status, out.text) == ("timeout", "error: 'hang' took longer than 0.3 s")

    callers = [threading.Thread(target=five_by_ten) for _ in range(5)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(120)
    assert len(took) == 50, "a call did not come back"
    took.sort()
    print(f"50 overrunning calls: median {took[25]:.2f} s, at most {took[-1]:.2f} s")
    # Each is its 0.3 s, plus its worker's load: a killed worker's replacement starts at
    # once, but the next call finds it still loading (0.1-0.2 s alone, more with 5 at once).
    assert took[0] >= 0.3 and took[25] < 0.3 + 1.0, took
    assert took[-1] < 0.3 + 5.0, took  # a machine busy with other work
    assert threading.active_count() == threads  # no thread per call
    assert len(_workers()) <= 5  # at most the replacements, loaded for the next calls
    pool = worker_pool(tools["hang"])
    assert pool is not None
    pool.close()
    assert _workers() == []
