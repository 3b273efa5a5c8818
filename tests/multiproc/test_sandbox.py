"""The python tool's sandbox: each attack is contained, counted as a failed or timed-out
call, and leaves this process (the job) running and able to run the next call."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rl.envs import sandbox, seccomp
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
        "seccomp",
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
    "trace the run's pid 1": _LIBC
    + _FAILS.format(call="libc.ptrace(16, 1, 0, 0)", what="ptrace"),  # PTRACE_ATTACH
    "a user namespace of its own": _LIBC
    + _FAILS.format(call="libc.unshare(0x10000000 | 0x20000)", what="unshare"),
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


def test_a_launch_without_seccomp_warns_in_one_line(monkeypatch):
    monkeypatch.setattr(sandbox, "containment", lambda: ("namespaces", "private-root"))
    (line,) = sandbox.launch_warnings()
    assert "\n" not in line and line.startswith("sandbox: no seccomp filter"), line
    monkeypatch.setattr(sandbox, "containment", lambda: ("private-root", "seccomp"))
    assert sandbox.launch_warnings() == []


# Each call the filter denies, with arguments the kernel rejects harmlessly (or, for the
# process_vm calls and unshare(0), that do nothing) when no filter stands in the way.
# The numbers are typed here from the kernel's tables, not taken from rl/envs/seccomp.py.
PROBES = """import ctypes, errno, json, mmap, os, platform
libc = ctypes.CDLL(None, use_errno=True)
sc = libc.syscall
NR = {
    "x86_64": dict(bpf=321, perf_event_open=298, userfaultfd=323, add_key=248,
        request_key=249, keyctl=250, kexec_load=246, kexec_file_load=320, finit_module=313,
        pivot_root=155, clone=56),
    "aarch64": dict(bpf=280, perf_event_open=241, userfaultfd=282, add_key=217,
        request_key=218, keyctl=219, kexec_load=104, kexec_file_load=294, finit_module=273,
        pivot_root=41, clone=220),
}[platform.machine()]
NR.update(io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_tree=428,
    move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, clone3=435,
    pidfd_getfd=438, process_madvise=440, mount_setattr=442)
class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
src, dst = ctypes.create_string_buffer(8), ctypes.create_string_buffer(8)
here, there = Iovec(ctypes.addressof(dst), 8), Iovec(ctypes.addressof(src), 8)
vm = (os.getpid(), ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
CALLS = {
    "ptrace": lambda: libc.ptrace(16, 1 << 30, 0, 0),  # PTRACE_ATTACH, no such pid
    "process_vm_readv": lambda: libc.process_vm_readv(*vm),
    "process_vm_writev": lambda: libc.process_vm_writev(*vm),
    "pidfd_getfd": lambda: sc(NR["pidfd_getfd"], -1, 0, 0),
    "process_madvise": lambda: sc(NR["process_madvise"], -1, None, 0, 0, 0),
    "bpf": lambda: sc(NR["bpf"], 1000, None, 0),
    "perf_event_open": lambda: sc(NR["perf_event_open"], None, 0, -1, -1, 0),
    "userfaultfd": lambda: sc(NR["userfaultfd"], 1 | 2),  # user-mode only, a bad flag
    "add_key": lambda: sc(NR["add_key"], None, None, None, 0, 0),
    "request_key": lambda: sc(NR["request_key"], None, None, None, 0),
    "keyctl": lambda: sc(NR["keyctl"], 9999, 0, 0, 0, 0),
    "kexec_load": lambda: sc(NR["kexec_load"], 0, 1 << 20, None, 0xFFFF0000),
    "kexec_file_load": lambda: sc(NR["kexec_file_load"], -1, -1, 0, None, 0xFFFF0000),
    "init_module": lambda: libc.init_module(None, 0, b""),
    "finit_module": lambda: sc(NR["finit_module"], -1, b"", 0),
    "delete_module": lambda: libc.delete_module(None, 0),
    "io_uring_setup": lambda: sc(NR["io_uring_setup"], 1, None),
    "io_uring_enter": lambda: sc(NR["io_uring_enter"], -1, 0, 0, 0, None, 0),
    "io_uring_register": lambda: sc(NR["io_uring_register"], -1, 0, None, 0),
    "mount": lambda: libc.mount(None, None, None, 0, None),
    "umount2": lambda: libc.umount2(None, 0),
    "pivot_root": lambda: sc(NR["pivot_root"], None, None),
    "open_tree": lambda: sc(NR["open_tree"], -1, None, 0),
    "move_mount": lambda: sc(NR["move_mount"], -1, None, -1, None, 0),
    "fsopen": lambda: sc(NR["fsopen"], None, 0),
    "fsconfig": lambda: sc(NR["fsconfig"], -1, 0, None, None, 0),
    "fsmount": lambda: sc(NR["fsmount"], -1, 0, 0),
    "fspick": lambda: sc(NR["fspick"], -1, None, 0),
    "mount_setattr": lambda: sc(NR["mount_setattr"], -1, None, 0, None, 0),
    "unshare": lambda: libc.unshare(0),
    "setns": lambda: libc.setns(-1, 0),
    "clone3": lambda: sc(NR["clone3"], None, 0),
}
# CLONE_SIGHAND without CLONE_VM: the kernel's EINVAL, before any child is made
for flag, name in [(0x20000, "ns"), (0x2000000, "cgroup"), (0x4000000, "uts"),
        (0x8000000, "ipc"), (0x10000000, "user"), (0x20000000, "pid"), (0x40000000, "net")]:
    CALLS["clone new" + name] = lambda flag=flag: sc(NR["clone"], flag | 0x800, 0, 0, 0, 0)
CALLS["clone"] = lambda: sc(NR["clone"], 0x800, 0, 0, 0, 0)
if platform.machine() == "x86_64":
    CALLS["x32 getpid"] = lambda: sc(0x40000000 | 39)
    # mov eax, 20 (i386 getpid); int 0x80; ret: the 32-bit table of the same kernel
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))
    int80 = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    def i386_getpid():
        result = int80()  # the pid, or -errno as the kernel returns it
        if result < 0:
            ctypes.set_errno(-result)
        return result
    CALLS["i386 getpid"] = i386_getpid
out = {}
for name, call in CALLS.items():
    ctypes.set_errno(0)
    result = call()
    out[name] = "ok" if result >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
out["seccomp mode"] = libc.prctl(21, 0, 0, 0, 0)  # PR_GET_SECCOMP: 2 under a filter
print(json.dumps(out))
"""

# The calls the kernel refuses without a capability before it reads their arguments, by the
# capability: outside the sandbox, a job that lacks it gets EPERM there with no filter.
_NEEDS = {
    21: ("pivot_root", "move_mount", "fsopen", "fsmount", "fspick"),  # CAP_SYS_ADMIN
    22: ("kexec_load", "kexec_file_load"),  # CAP_SYS_BOOT
    16: ("init_module", "finit_module", "delete_module"),  # CAP_SYS_MODULE
}
_PASSED = ("clone", "clone3", "seccomp mode")  # not denied: clone3 is ENOSYS


def _outside(prefix: str = "") -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-I", "-c", prefix + PROBES], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _lacking() -> set[str]:
    status = Path("/proc/self/status").read_text()
    (caps,) = [int(line.split()[1], 16) for line in status.splitlines() if line[:7] == "CapEff:"]
    return {name for bit, names in _NEEDS.items() if not caps >> bit & 1 for name in names}


def test_each_call_the_filter_denies_is_eperm_inside_and_reaches_the_kernel_outside():
    run = sandbox.run_python(PROBES, LIMITS)
    assert run.ok, run
    inside, outside = json.loads(run.stdout), _outside()
    assert {k: v for k, v in inside.items() if k not in _PASSED and v != "EPERM"} == {}
    assert inside["clone3"] == "ENOSYS" and inside["clone"] == outside["clone"] == "EINVAL"
    assert inside["seccomp mode"] == 2 and outside["seccomp mode"] == 0
    assert {k for k, v in outside.items() if v == "EPERM"} <= _lacking(), outside


def test_the_filter_itself_answers_each_call_it_denies():
    # In the sandbox a dropped capability answers some of these with EPERM too; here the
    # filter alone, with an errno that nothing else answers, is what each call meets.
    load = (
        "import importlib.util as u\n"
        f"s = u.spec_from_file_location('f', {seccomp.__file__!r})\n"
        "f = u.module_from_spec(s)\ns.loader.exec_module(f)\n"
        f"f.install({errno.ENOTRECOVERABLE})\n"
    )
    caught = _outside(load)
    names = set(caught) - set(_PASSED)
    assert {k: caught[k] for k in names} == dict.fromkeys(names, "ENOTRECOVERABLE")
    assert caught["clone3"] == "ENOSYS" and caught["clone"] == "EINVAL"
    assert set(seccomp.DENIED) <= names


NORMAL = """import concurrent.futures, os, subprocess, sys
import numpy as np
a = np.arange(12.0).reshape(3, 4)
print(float((a @ a.T).trace()))
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    print(sum(pool.map(lambda x: x * x, range(10))))
pid = os.fork()
if pid == 0:
    os._exit(7)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True).stdout)
"""


def test_a_tool_call_with_numpy_threads_fork_and_a_subprocess_runs_under_the_filter():
    call = '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>'
    env = ToolEnvironment({"python": load_tool("python", sandbox.Limits())}, "qwen")
    step = env.step([{"role": "assistant", "content": call % json.dumps(NORMAL)}])
    assert step.observations[0]["content"] == "506.0\n285\n7\nb'child\\n'"
    assert step.metrics["tool_errors"] == 0.0
