"""Everything a launching process started, found and ended: ranks and whatever they started.

Why: a rank starts processes of its own (Megatron's checkpoint saving starts a
multiprocessing Manager; multiprocessing starts a resource tracker; torch starts
``torch_shm_manager``; a generator rank starts SGLang servers, each in a session of its
own behind a guard). When a rank dies, its children are reparented and become invisible
to a ``children()`` walk from the launcher, so a killed trainer rank left a 700 MB
Manager running with PPID 1. The launcher therefore makes itself a *child subreaper*
(Linux PR_SET_CHILD_SUBREAPER): orphans of its descendants are reparented to it, so one
recursive walk from it always finds every process of the job, whatever died first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper(on: bool = True) -> bool:
    """Make orphaned descendants of this process its children (best effort: Linux only);
    ``on=False`` once the job is gone, so a longer-lived caller (a test session) does not
    collect other orphans as zombies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def descendants(keep: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """Live (non-zombie) descendants of this process, except the pids in ``keep``."""
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.pid not in keep and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def kill_all(
    keep: frozenset[int] = frozenset(),
    spare_reap: frozenset[int] = frozenset(),
    timeout: float = 5.0,
) -> int:
    """SIGKILL every descendant (but ``keep``) until none is left or ``timeout`` passes;
    returns how many were killed. A walk repeats because a process that is being killed
    may have started another one in the meantime. ``spare_reap``: children whose exit
    status someone else collects (multiprocessing, for the ranks)."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        left = descendants(keep)
        if not left or time.monotonic() > deadline:
            break
        signal_all(left, signal.SIGKILL)
        killed.update(p.pid for p in left)
        reap(keep | spare_reap)
        time.sleep(0.05)
    reap(keep | spare_reap)
    return len(killed)


def reap(keep: frozenset[int] = frozenset()) -> None:
    """Collect the exit status of finished children that nobody else waits for (orphans
    reparented to this subreaper), so they do not linger as zombies. The pids in ``keep``
    (the ranks: multiprocessing waits for those itself) are left alone."""
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process().children():
            if p.pid in keep:
                continue
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if p.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(p.pid, os.WNOHANG)


def multiprocessing_servers() -> frozenset[int]:
    """This process's multiprocessing helpers, which outlive each job: the resource
    tracker (it exits by itself once every holder of its pipe is gone, and killing it early
    makes it warn about leaks) and the fork server the CPU ranks are forked from
    (:mod:`rl.runtime.preload`; it exits when this process does)."""
    from multiprocessing import forkserver, resource_tracker

    pids = (
        getattr(resource_tracker._resource_tracker, "_pid", None),
        getattr(forkserver._forkserver, "_forkserver_pid", None),
    )
    return frozenset(p for p in pids if p is not None)


SHM = "/dev/shm/"
# /dev/shm names a job's processes create and only their owner unlinks, so that a SIGKILL
# leaves them: SGLang's load snapshots, multiprocessing's named semaphores and the DDMA
# rings whose handshake a trainer rank had not finished (rl/ddma/shm.py; plain mmap'ed
# files: unlinking one is safe whoever still maps it, a mapping survives it). (The
# server's guard keeps its own list: it runs isolated from this package.)
# Not torch's ``torch_*`` files (``file_system`` sharing, the HTTP weight payloads):
# whoever frees one last unlinks it, and aborts if the name is gone. Unlinking one is
# safe only if some process that is killed still maps it (its reference is never
# dropped, so no survivor frees it last), and that is not sure of a name listed here:
# the list also comes from descendants the sweep spares, and a process being killed may
# unmap the file between the listing and its death, leaving the launcher or a spared
# process its last holder.
SHM_KINDS = ("sglang_loads_", "sem.mp-", "ddma-")


def shm_mapped(procs: list[psutil.Process]) -> set[str]:
    """The ``/dev/shm`` names of :data:`SHM_KINDS` that ``procs`` have mapped (read before
    they are killed: unlink them after)."""
    out, kinds = set(), tuple(SHM + k for k in SHM_KINDS)
    for p in procs:
        with contextlib.suppress(OSError), open(f"/proc/{p.pid}/maps") as f:
            for line in f:  # /proc/PID/maps, not psutil's smaps: fast for large processes
                i = line.find(SHM)
                path = line[i:].rstrip("\n") if i >= 0 else ""
                if path.startswith(kinds) and " " not in path:
                    out.add(path)  # (one already unlinked reads "... (deleted)")
    return out


def unlink_all(paths: set[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
