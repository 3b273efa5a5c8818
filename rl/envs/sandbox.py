"""Run untrusted Python (a model's tool call) in a subprocess that cannot harm the job.

Each run gets its own directory and, where the machine allows:

- **namespaces** (util-linux ``unshare``): a user namespace, so the limits below bind even
  when the job runs as root; a network namespace with no interface up, so nothing can be
  reached; a PID namespace whose first process, when killed, takes every process of the
  run with it, a fork bomb's included;
- a **private root** (rl/envs/private_root.py, in a mount namespace of its own): the run's
  whole file tree is a read-only tmpfs holding, at their own paths, read-only binds of the
  Python installation and system libraries, ``/dev/null`` and the run's directory, and the
  run holds no capability after entering it. No ``/proc``, ``/tmp``, ``/run`` or home is
  there, so no named unix socket of the host (a D-Bus bus, docker.sock, a server's socket
  beside the run's directory) can be connected to, which neither the network namespace
  nor Landlock prevents;
- **Landlock** (rl/envs/landlock.py): files read only under the Python installation and
  system library directories, written only in the run's directory (so neither the job's
  secret file nor its checkpoints can be read or changed), no TCP, no signals to
  processes outside the run, and no mount, umount or pivot_root;
- a **seccomp filter** (rl/envs/seccomp.py): ptrace and its kin, bpf, perf_event_open,
  userfaultfd, the key store, kexec, module loading, io_uring, every mount call, unshare,
  setns and clone into new namespaces fail with EPERM (clone3 with ENOSYS, so libc falls
  back to clone, whose flags the filter reads);
- **rlimits**: CPU seconds, address space, processes, file size;
- a wall-clock limit, after which the whole process group is killed;
- an environment of four variables, none of the job's.

``containment()`` names what this machine gives, and ``launch_warnings()`` are the lines
to print at launch for what it lacks: nothing keeps the host's named sockets out of reach
(``host_socket_warning()``), or no syscall filter (``seccomp_warning()``). A run never
raises for what the code did: a timeout, a crash or a limit is a :class:`RunResult` the
tool turns into an observation.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from rl.envs import landlock

_BOOT = Path(__file__).with_name("sandbox_boot.py")
_SYSTEM_READ = ("/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache", "/etc/localtime")
# sandbox_boot.py's exit statuses when a mechanism containment() named failed in the run
PRIVATE_ROOT_REFUSED, LANDLOCK_REFUSED, SECCOMP_REFUSED = 96, 97, 98


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    processes: int = 32
    _: KW_ONLY
    file_mb: int = 16
    output_chars: int = 4000  # of stdout and of stderr, each, handed back


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    returncode: int | None
    reason: str = ""  # "", "timeout", "signal <name>", "exit <n>"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.reason


_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--kill-child"]
_MOUNT = ["--mount"]  # a mount namespace whose mounts are private (unshare's default)


@functools.cache
def _namespaces() -> bool:
    """Whether ``unshare`` can give a run its own user, network and PID namespaces here."""
    if shutil.which("unshare") is None:
        return False
    cmd = [*_UNSHARE, "true"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _boots(prefix: list[str], *, private_root: bool, seccomp: bool) -> bool:
    """Whether the boot, under ``prefix`` and with the mechanisms asked for, runs an empty
    ``main.py`` to its end here."""
    base = Path(tempfile.mkdtemp(prefix="sandbox-probe-"))
    try:
        workdir, spec = _prepare(
            base, "", private_root=private_root, landlock=False, seccomp=seccomp
        )
        cmd = [*prefix, *_boot(spec)]
        done = subprocess.run(cmd, cwd=workdir, env=_env(workdir), capture_output=True, timeout=10)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        shutil.rmtree(base, ignore_errors=True)


@functools.cache
def _private_root() -> bool:
    """Whether a run can be given its private root here: the boot enters one, with every
    mount and pivot a run makes."""
    return _namespaces() and _boots([*_UNSHARE, *_MOUNT], private_root=True, seccomp=False)


@functools.cache
def _seccomp() -> bool:
    """Whether the boot can install the seccomp filter here (refused on a kernel without
    seccomp filters, or an architecture rl/envs/seccomp.py has no table for)."""
    return _boots([], private_root=False, seccomp=True)


@functools.cache
def containment() -> tuple[str, ...]:
    """What isolates a run on this machine, by name: ``namespaces`` (user, net, pid),
    ``private-root``, ``landlock-files``, ``landlock-tcp``, ``landlock-signals``,
    ``seccomp`` and always ``rlimits``."""
    out = ["namespaces"] if _namespaces() else []
    if _private_root():
        out.append("private-root")
    version = landlock.abi()
    if version >= 1:
        out.append("landlock-files")
    if version >= 4:
        out.append("landlock-tcp")
    if version >= 6:
        out.append("landlock-signals")
    if _seccomp():
        out.append("seccomp")
    return (*out, "rlimits")


def launch_warnings() -> list[str]:
    """The lines to print at launch, one per layer this machine lacks that leaves the
    host open to the python tool's code (none on a machine that has them all)."""
    return [line for line in (host_socket_warning(), seccomp_warning()) if line is not None]


def host_socket_warning() -> str | None:
    """The one line to print at launch when sandboxed code could connect to a named unix
    socket of the host it knows the path of; None when the private root rules that out.
    (Landlock's right over such connections, ``LANDLOCK_ACCESS_FS_RESOLVE_UNIX``, is not
    in any ABI up to 7, the newest this module knows.)"""
    if "private-root" in containment():
        return None
    return (
        "sandbox: no private root on this machine (unshare --mount failed): the python "
        "tool's code can connect to any named unix socket of the host whose path it knows "
        "(e.g. /run/dbus/system_bus_socket, /var/run/docker.sock)"
    )


def seccomp_warning() -> str | None:
    """The one line to print at launch when no seccomp filter narrows the system calls
    sandboxed code can make; None when the boot installs one."""
    if "seccomp" in containment():
        return None
    return (
        "sandbox: no seccomp filter on this machine (the kernel or this architecture "
        "refused it): the python tool's code can make every system call the kernel allows "
        "it (ptrace, bpf, io_uring, unshare, ...), which widens what a kernel bug exposes"
    )


def _readable() -> list[str]:
    """Where the sandboxed interpreter may read: its installation, its packages, and the
    system's libraries."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *_SYSTEM_READ}
    paths |= {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.add(str(Path(sys.executable).resolve().parent.parent))
    return sorted(paths)


def _preexec(limits: Limits, processes: int) -> None:
    """In the child, before exec: the rlimits every process of the run inherits."""
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _own_processes() -> int:
    """How many processes this uid runs now: without a user namespace RLIMIT_NPROC counts
    them all, so a run's allowance is added to it."""
    uid = os.getuid()
    return sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _uid(p) == uid)


def _uid(proc: Path) -> int | None:
    try:
        return proc.stat().st_uid
    except OSError:
        return None


def _tail(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        data = f.read(limit * 4)
    text = data.decode("utf-8", "replace")
    return text if len(text) <= limit else text[:limit] + "\n[... output cut]"


def _reason(code: int | None, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if code is None or code == 0:
        return ""
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    if code - 128 in signal.valid_signals():
        # the namespace's init (sandbox_boot.py) reports its child's death this way
        return f"signal {signal.Signals(code - 128).name}"
    return f"exit {code}"


def _prepare(
    base: Path, code: str, *, private_root: bool, landlock: bool, seccomp: bool
) -> tuple[Path, dict[str, object]]:
    """The run's directory with ``code`` as its ``main.py``, and the boot's spec: beside the
    directory, the empty mount point of the private root."""
    workdir = base / "work"
    workdir.mkdir()
    (workdir / "main.py").write_text(code)
    spec: dict[str, object] = {"workdir": str(workdir), "root": None}
    spec |= {"landlock": landlock, "seccomp": seccomp}
    if private_root:
        (base / "root").mkdir()
        spec["root"] = str(base / "root")
    spec["read"] = _readable()
    return workdir, spec


def _boot(spec: dict[str, object]) -> list[str]:
    return [sys.executable, "-I", str(_BOOT), json.dumps(spec)]


def _env(workdir: Path) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(workdir),
        "LANG": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1",
    }


def run_python(code: str, limits: Limits = Limits(), base_dir: str | None = None) -> RunResult:
    """Run ``code`` as ``main.py`` in a fresh directory under ``base_dir`` (the system's
    temporary directory by default), contained as this machine allows, and remove the
    directory afterwards."""
    where = containment()
    base = Path(tempfile.mkdtemp(prefix="sandbox-", dir=base_dir))  # mode 0700
    try:
        workdir, spec = _prepare(
            base,
            code,
            private_root="private-root" in where,
            landlock="landlock-files" in where,
            seccomp="seccomp" in where,
        )
        cmd = _boot(spec)
        processes = limits.processes
        if "namespaces" in where:
            cmd = [*_UNSHARE, *(_MOUNT if spec["root"] else []), *cmd]
        elif os.getuid() != 0:
            processes += _own_processes()
        out, err = base / "stdout", base / "stderr"  # outside what the code may write
        with out.open("wb") as fo, err.open("wb") as fe:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fo,
                stderr=fe,
                cwd=workdir,
                env=_env(workdir),
                start_new_session=True,
                preexec_fn=functools.partial(_preexec, limits, processes),
            )
            deadline = time.monotonic() + limits.wall_s
            timed_out = False
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        return RunResult(
            stdout=_tail(out, limits.output_chars),
            stderr=_tail(err, limits.output_chars),
            returncode=proc.returncode,
            reason=_reason(proc.returncode, timed_out),
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    """SIGKILL the run's process group: unshare first, whose death (``--kill-child``)
    kills the PID namespace's first process and with it every process in the namespace."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
