"""The python tool's sandbox: each attack is contained, counted as a failed or timed-out
call, and leaves this process (the job) running and able to run the next call."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from rl.envs import sandbox
from rl.envs.environment import ToolEnvironment
from rl.envs.tools import load_tool
from rl.runtime import secret

LIMITS = sandbox.Limits(cpu_s=1, wall_s=3, memory_mb=256, processes=16)


def test_this_machine_contains_a_run_with_every_mechanism():
    # CI's machines have all of them; a machine without one fails here by name, not later.
    assert sandbox.containment() == (
        "namespaces",
        "landlock-files",
        "landlock-tcp",
        "landlock-signals",
        "rlimits",
    )
    out = sandbox.run_python("import os; print(sorted(os.environ))", LIMITS)
    assert out.ok and out.stdout.strip() == "['HOME', 'LANG', 'OPENBLAS_NUM_THREADS', 'PATH']"


def _survivors(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "ps -eo" not in line]


@pytest.fixture(scope="module")
def listener():
    """A TCP port on loopback that the job could reach and the sandbox must not."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


ATTACKS = {
    "infinite loop": ("while True: pass", "error", "[signal SIGXCPU]"),
    "sleeping forever": ("import time\ntime.sleep(600)", "timeout", "[timeout]"),
    "fork bomb": (
        "import os, time\nMARK = 'forkbomb-{mark}'\nwhile True:\n"
        "    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n",
        "timeout",
        "[timeout]",
    ),
    "memory hog": ("x = bytearray(1 << 30)", "error", "MemoryError"),
    "network connect": (
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
        "error",
        "PermissionError",
    ),
    "write outside its directory": (
        "open('{outside}', 'w').write('pwned')",
        "error",
        "PermissionError",
    ),
    "read the job's secret": (
        "print(open('{secret}').read())",
        "error",
        "PermissionError",
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_is_contained_counted_and_the_job_goes_on(
    attack, tmp_path: Path, listener, monkeypatch
):
    monkeypatch.setenv(secret.ENV, str(tmp_path / "run" / secret.NAME))
    key_file = secret.ensure(tmp_path / "run")
    outside = tmp_path / "outside.txt"
    code, status, says = ATTACKS[attack]
    mark = f"{os.getpid()}-{attack.replace(' ', '')}"
    code = code.format(port=listener, outside=outside, secret=key_file, mark=mark)
    call = '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>'
    env = ToolEnvironment({"python": load_tool("python", LIMITS)}, "qwen")
    step = env.step([{"role": "assistant", "content": call % json.dumps(code)}])
    text = step.observations[0]["content"]
    assert says in text, text
    counted = {"error": "tool_errors", "timeout": "tool_timeouts"}[status]
    assert step.metrics[counted] == 1.0 and step.metrics["tool_calls"] == 1.0
    assert not outside.exists()
    assert secret.load(key_file).hex() not in text
    assert _survivors(f"forkbomb-{mark}") == []
    # The job is still running, and the next call works.
    after = env.step([{"role": "assistant", "content": call % json.dumps("print(6 * 7)")}])
    assert after.observations[0]["content"] == "42"
