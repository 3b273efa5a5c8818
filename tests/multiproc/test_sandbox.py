"""The python tool's sandbox: each attack is contained, counted as a failed or timed-out
call, and leaves this process (the job) running and able to run the next call."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
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
        "private-root",
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
    # Not even there: the private root holds no path of the job's.
    "write outside its directory": (
        "open('{outside}', 'w').write('pwned')",
        "error",
        "FileNotFoundError",
    ),
    "read the job's secret": (
        "print(open('{secret}').read())",
        "error",
        "FileNotFoundError",
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


CONNECT = """import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect({path!r})
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""
REFUSED = {"FileNotFoundError", "ConnectionRefusedError", "PermissionError"}


@pytest.mark.parametrize("where", ["in /tmp", "beside the run's directory"])
def test_a_named_unix_socket_of_the_host_is_out_of_reach(where, tmp_path: Path):
    # Landlock has no right for it and the network namespace hides abstract sockets only:
    # what keeps it out of reach is that the private root has no such path.
    in_tmp = where == "in /tmp"
    home = Path(tempfile.mkdtemp(dir="/tmp")) if in_tmp else tmp_path
    base_dir = None if in_tmp else str(tmp_path)  # the run's directory beside the socket
    path = str(home / "host.sock")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(path)
            server.listen()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as job:
                job.connect(path)  # the job itself can
            out = sandbox.run_python(CONNECT.format(path=path), LIMITS, base_dir=base_dir)
    finally:
        if in_tmp:
            shutil.rmtree(home)
    assert out.ok and out.stdout.strip() in REFUSED, out


def test_an_abstract_unix_socket_of_the_job_is_out_of_reach():
    name = f"\0sandbox-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(name)
        server.listen()
        out = sandbox.run_python(CONNECT.format(path=name), LIMITS)
    assert out.ok and out.stdout.strip() in REFUSED, out


_LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
_FAILS = "if {call} != 0:\n    raise OSError(ctypes.get_errno(), {what!r})\n"
ESCAPES = {
    "umount a bind": _LIBC + _FAILS.format(call="libc.umount2(b'/usr', 0)", what="umount"),
    "detach the root": _LIBC + _FAILS.format(call="libc.umount2(b'/', 2)", what="umount"),
    "mount a tmpfs": _LIBC
    + _FAILS.format(call="libc.mount(b'x', b'.', b'tmpfs', 0, None)", what="mount"),
    "bind the root elsewhere": _LIBC
    + _FAILS.format(call="libc.mount(b'/', b'.', None, 4096 | 16384, None)", what="mount"),
    "read /proc/1/cmdline": "print(open('/proc/1/cmdline').read())",
    "list /tmp": "import os\nprint(os.listdir('/tmp'))",
    "list /run": "import os\nprint(os.listdir('/run'))",
}


@pytest.mark.parametrize("escape", list(ESCAPES))
def test_the_code_cannot_see_or_change_the_mounts_around_it(escape):
    code = "try:\n" + "".join(f"    {line}\n" for line in ESCAPES[escape].splitlines())
    code += "    print('done')\nexcept OSError as e:\n    print(type(e).__name__)\n"
    out = sandbox.run_python(code, LIMITS)
    assert out.ok and out.stdout.strip() in {"PermissionError", "FileNotFoundError"}, out


def test_a_private_root_that_cannot_be_made_fails_the_run_closed(monkeypatch):
    prepare = sandbox._prepare

    def no_mount_point(base, code, **kw):
        workdir, spec = prepare(base, code, **kw)
        spec["root"] = str(base / "missing")
        return workdir, spec

    monkeypatch.setattr(sandbox, "_prepare", no_mount_point)
    out = sandbox.run_python("print('ran')", LIMITS)
    assert out.returncode == sandbox.PRIVATE_ROOT_REFUSED and "ran" not in out.stdout, out
    assert "sandbox: no private root" in out.stderr


def test_a_launch_without_a_private_root_warns_in_one_line(monkeypatch):
    monkeypatch.setattr(sandbox, "containment", lambda: ("namespaces", "landlock-files"))
    line = sandbox.host_socket_warning()
    assert line is not None and "\n" not in line and "named unix socket" in line
    monkeypatch.setattr(sandbox, "containment", lambda: ("namespaces", "private-root"))
    assert sandbox.host_socket_warning() is None
