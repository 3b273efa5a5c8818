"""Guard process in front of one SGLang server: whatever happens, its whole tree goes away.

    python -I server_guard.py --owner PID --grace SECONDS -- <sglang command...>

Why: SGLang forks a scheduler and a detokenizer and relies on their parent-death signals to
clean up after a crash of its main process; under load on a CPU machine that was seen to
leave a detokenizer running with PPID 1. So the launcher runs this guard, which:

* leads the server's process group and asks for SIGTERM when its owner (the launcher's
  thread) dies, even by SIGKILL (PR_SET_PDEATHSIG);
* on SIGTERM/SIGINT/SIGHUP, forwards SIGTERM to SGLang (which then stops its children in
  order) and, after ``--grace`` seconds, SIGKILLs everything left in the group;
* when SGLang exits on its own (a crash, or a kill by someone else), SIGKILLs what is left
  of the group and exits with SGLang's status (re-raising a fatal signal), so the launcher
  sees the same exit code as if it had run SGLang directly;
* gives SGLang a parent-death SIGTERM as well, in case the guard itself is SIGKILLed;
* with ``--listen HOST:PORT``, refuses at once, before SGLang starts, when that port is
  taken: SGLang binds its HTTP port only after loading the model (half a minute on CPU,
  minutes for a large model on GPU), so the launcher would otherwise learn of the clash
  that late (the port can still be taken later, while SGLang loads: the launcher reads
  the same line in the log then);
* removes the POSIX shared-memory names SGLang's processes had open (``/dev/shm``: its
  load-snapshot file, multiprocessing's semaphores) once they are all gone: SGLang unlinks
  none of them when it is stopped by a signal, so every start left them behind.

Run by file path and standard library only, so it starts in milliseconds and does not
depend on PYTHONPATH or on this package being importable.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
SHM = "/dev/shm/"
# What SGLang's processes create there and leave on a signal: the scheduler's load
# snapshot (sglang/srt/managers/load_snapshot.py) and multiprocessing's named semaphores.
OWNED = ("sglang_loads_", "sem.mp-")
SHM_SCAN_S = 2.0  # how often the server's mappings are read while it runs


def _pdeathsig(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` other than this one (from /proc, stdlib only)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the parenthesised name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def shm_names(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` names of :data:`OWNED` kinds that ``pids`` have mapped."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(SHM)
                    path = line[i:].rstrip("\n") if i >= 0 else ""
                    if path.startswith(tuple(SHM + o for o in OWNED)) and " " not in path:
                        out.add(path)  # (a name already unlinked reads "... (deleted)")
        except OSError:
            continue
    return out


def unlink(paths: set[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _sweep() -> None:
    for pid in group_members(os.getpgid(0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _port_taken(listen: str) -> bool:
    """Is ``HOST:PORT`` bound by another socket now? Binds as uvicorn does (SO_REUSEADDR:
    a port left in TIME_WAIT is free to it, so to us); any other bind error is SGLang's
    to report."""
    host, _, port = listen.rpartition(":")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), int(port)))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--owner", type=int, required=True)
    ap.add_argument("--grace", type=float, default=20.0)
    ap.add_argument("--listen", help="HOST:PORT the server will bind; refuse now if taken")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command to run")

    stop_at: list[float] = []  # set once a stop was requested: the SIGKILL deadline

    def on_stop(signum: int, frame: object) -> None:
        if not stop_at:
            stop_at.append(time.monotonic() + args.grace)
            if child is not None and child.poll() is None:
                child.send_signal(signal.SIGTERM)

    if args.listen and _port_taken(args.listen):
        # The words the launcher looks for (uvicorn's, when the clash comes later).
        print(f"server_guard: cannot bind {args.listen}: address already in use", flush=True)
        return 1
    child: subprocess.Popen | None = None
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_stop)
    _pdeathsig(signal.SIGTERM)
    if os.getppid() != args.owner:  # the owner died before the line above took effect
        return 128 + signal.SIGTERM
    child = subprocess.Popen(cmd, preexec_fn=lambda: _pdeathsig(signal.SIGTERM))
    if stop_at:  # a stop arrived while the child was being created
        child.send_signal(signal.SIGTERM)
    shm: set[str] = set()
    scanned = 0.0
    while child.poll() is None:
        if stop_at and time.monotonic() > stop_at[0]:
            break
        if time.monotonic() - scanned > SHM_SCAN_S:
            shm |= shm_names(group_members(os.getpgid(0)))
            scanned = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=0.2)
    shm |= shm_names(group_members(os.getpgid(0)))
    _sweep()
    code = child.wait()
    unlink(shm)
    if code < 0:  # died of a signal: die of the same one, so our parent sees it too
        with contextlib.suppress(OSError, ValueError):  # SIGKILL/SIGSTOP have no handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
